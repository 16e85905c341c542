//! The zoned store's garbage collection as the store sees it: running it, and re-pointing a
//! slot whose record GC moved ([`GcOwner::repoint`]), under the slot lock (or the group's locks
//! for a multi-page object), only if the slot still points at the old record.

use super::{Store, WbTarget, ZonedTarget};
use crate::error::{Error, ErrorKind, Result};
use crate::slot::{SlotFlags, SlotIndex};
use crate::zoned::{GcOwner, GcReport, ZoneLoc, ZoneStats, GC_QUEUE_DEPTH};
use std::sync::atomic::Ordering;

impl Store {
    /// The zoned store, with the zoned layout.
    pub(super) fn zoned(&self) -> Option<&ZonedTarget> {
        match self.target.as_ref()? {
            WbTarget::Zoned(z) => Some(z),
            WbTarget::Bitmap(_) => None,
        }
    }

    /// Runs zoned-store GC over every eligible victim, with a queue of its own on the store's
    /// backing (see [`crate::zoned::gc`]). `ENODEV` without a zoned target.
    pub(crate) fn gc(&self) -> Result<GcReport> {
        self.gc_with_progress(&mut |_, _| {})
    }

    /// Like [`gc`](Self::gc), calling `progress(reclaimed, victims)` as each victim zone is
    /// reset (see [`crate::zoned::ZoneStore::gc_with_progress`]).
    pub(crate) fn gc_with_progress(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<GcReport> {
        let zoned = self.zoned().ok_or_else(|| {
            Error::new(
                ErrorKind::NoDevice,
                "gc needs a zoned backing store (backing_layout=zoned and backing_dev)",
            )
        })?;
        let store = zoned.store();
        let mut queue = store.backing().new_queue(GC_QUEUE_DEPTH)?;
        store.gc_with_progress(self, queue.as_mut(), usize::MAX, progress)
    }

    /// Whether the zoned store is short of empty zones (false without one).
    pub(crate) fn needs_gc(&self) -> bool {
        self.zoned().is_some_and(|z| z.store().needs_gc())
    }

    /// The zoned store's counters (`zone_stat`), with the zoned layout.
    pub(crate) fn zone_stats(&self) -> Option<ZoneStats> {
        Some(self.zoned()?.store().stats())
    }
}

impl GcOwner for Store {
    /// Under the slot lock: if the slot is WB at `old`, point it at `new` (size, flags,
    /// priority and access time kept: a move is not an access) and call `moved`.
    ///
    /// A record of a written-back multi-page object names the first slot of its group, and
    /// every slot of the group still pointing at it moves together, under the group's locks.
    fn repoint(&self, slot: u64, old: ZoneLoc, new: ZoneLoc, moved: &dyn Fn()) -> bool {
        if self.multi_pages > 1 {
            let first = SlotIndex(slot);
            if first.0 % self.multi_pages as u64 == 0
                && first.0 + self.multi_pages as u64 <= self.slots.len()
            {
                let mut guards = self.lock_group(first);
                let mut any = false;
                for g in guards.iter_mut().flatten() {
                    let st = g.state();
                    if st.wb_location() == Some(old.to_raw()) {
                        if !any && st.has(SlotFlags::MULTI) {
                            // A thread may cache another object that was at `new` before GC
                            // moved it away: keys made from now on differ.
                            self.multi_frees.fetch_add(1, Ordering::Release);
                        }
                        g.set_wb(new.to_raw(), st.size_bytes(), st.flags(), st.codec());
                        any = true;
                    }
                }
                if any {
                    moved();
                }
                return any;
            }
        }
        let mut g = self.slots.lock(SlotIndex(slot));
        let st = g.state();
        if st.wb_location() != Some(old.to_raw()) {
            return false;
        }
        g.set_wb(new.to_raw(), st.size_bytes(), st.flags(), st.codec());
        moved();
        true
    }
}
