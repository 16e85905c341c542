//! Idle marking (zram's `idle` attribute): `idle all` marks every slot holding data in RAM,
//! `idle <seconds>` only those not accessed for at least that long. Any later access clears
//! the mark (see `SlotGuard::touch`). Writeback and recompression act on marked slots.

use super::Device;
use crate::slot::{SlotFlags, SlotIndex};

/// Which slots `mark_idle` marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleCutoff {
    /// Every slot with data in RAM (`idle all`).
    All,
    /// Slots not accessed for at least this many seconds (`idle <seconds>`); slots accessed
    /// more recently get the mark cleared, as the kernel does.
    OlderThanSecs(u64),
}

impl Device {
    /// Marks slots idle. Same-filled and written-back slots are skipped, as in zram: neither
    /// writeback nor recompression can do anything for them. A no-op when uninitialised.
    pub fn mark_idle(&self, cutoff: IdleCutoff) {
        let Ok(inner) = self.inner() else {
            return;
        };
        let now = u64::from(inner.now_secs());
        for i in 0..inner.slots.len() {
            let index = SlotIndex(i);
            // An unlocked look first, so empty slots cost no lock and their table pages stay
            // uncommitted; the decision is re-made under the lock.
            if inner.slots.entry(index).state_unlocked().is_empty() {
                continue;
            }
            let mut g = inner.slots.lock(index);
            let st = g.state();
            if st.is_empty() || st.has(SlotFlags::SAME) || st.has(SlotFlags::WB) {
                continue;
            }
            let idle = match cutoff {
                IdleCutoff::All => true,
                IdleCutoff::OlderThanSecs(age) => {
                    now.saturating_sub(u64::from(st.ac_time_secs)) >= age
                }
            };
            if idle {
                g.set_flags(SlotFlags::IDLE);
            } else {
                g.clear_flags(SlotFlags::IDLE);
            }
        }
    }

    /// Number of slots currently marked idle (for tests and `debug`).
    pub fn idle_pages(&self) -> u64 {
        let Ok(inner) = self.inner() else {
            return 0;
        };
        (0..inner.slots.len())
            .filter(|&i| {
                inner
                    .slots
                    .entry(SlotIndex(i))
                    .state_unlocked()
                    .has(SlotFlags::IDLE)
            })
            .count() as u64
    }
}
