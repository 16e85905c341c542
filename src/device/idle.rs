//! Idle marking (zram's `idle` attribute): `idle all` marks every slot holding data in RAM,
//! `idle <seconds>` only those not accessed for at least that long. Any later access clears
//! the mark (see `SlotGuard::touch`). Writeback and recompression act on marked slots.

use super::Device;
pub use crate::store::IdleCutoff;

impl Device {
    /// Marks slots idle. Same-filled and written-back slots are skipped, as in zram: neither
    /// writeback nor recompression can do anything for them. A no-op when uninitialised.
    pub fn mark_idle(&self, cutoff: IdleCutoff) {
        if let Ok(store) = self.store() {
            store.mark_idle(cutoff);
        }
    }

    /// Number of slots currently marked idle (for tests and `debug`).
    pub fn idle_pages(&self) -> u64 {
        self.store().map_or(0, |store| store.idle_pages())
    }
}
