//! The store's steps of post-processing: marking and clearing a candidate (PP_SLOT), copying it
//! out for writeback, and pointing its slot (or its multi-page object's slots) at the backing
//! location when the write completes, only if nothing touched it meanwhile. The scan is
//! `crate::pp`'s, the batches `crate::writeback`'s.

use super::stats::StoreStats;
use super::{Copied, Free, Store, WbTarget};
use crate::slot::{SlotFlags, SlotIndex, SlotState};
use crate::zsmalloc::Handle;
use std::sync::atomic::Ordering;

impl Store {
    /// Selects slot `index` for writeback (zram's `scan_slots_for_writeback`, one slot): if it
    /// holds an object in RAM, is not selected yet, and `accepts` its state, sets PP_SLOT under
    /// its lock and returns the object's size. Empty, same-filled and written-back slots are
    /// never selected.
    pub(crate) fn mark_pp(
        &self,
        index: SlotIndex,
        accepts: impl Fn(&SlotState) -> bool,
    ) -> Option<usize> {
        // Look without the lock first, so empty slots cost nothing (and their table pages stay
        // uncommitted); decide again under the lock. A page of a multi-page object is marked
        // like any other; writeback takes the object only when every page pointing into it is
        // marked ([`copy_group`](Self::copy_group)).
        let st = self.slots.entry(index).state_unlocked();
        if st.is_empty() || st.has(SlotFlags::SAME) || st.has(SlotFlags::WB) {
            return None;
        }
        let mut g = self.slots.lock(index);
        let st = g.state();
        if st.is_empty()
            || st.has(SlotFlags::SAME)
            || st.has(SlotFlags::WB)
            || st.has(SlotFlags::PP_SLOT)
            || !accepts(&st)
        {
            return None;
        }
        g.set_flags(SlotFlags::PP_SLOT);
        Some(st.size_bytes())
    }

    /// Clears PP_SLOT of one slot, under its lock (zram's `release_pp_slot`); for a page of a
    /// multi-page object in RAM, of every page pointing into it (one lock at a time): the
    /// object goes only with all of them, so none may keep a mark that would keep it from the
    /// next writeback's scan.
    pub(crate) fn clear_pp(&self, index: SlotIndex) {
        let mut g = self.slots.lock(index);
        let st = g.state();
        g.clear_flags(SlotFlags::PP_SLOT);
        drop(g);
        if self.multi_pages > 1 && st.has(SlotFlags::MULTI) && !st.has(SlotFlags::WB) {
            self.clear_group_pp(self.group_first(index));
        }
    }

    /// Clears PP_SLOT of every page of the group starting at `first` that points into its
    /// multi-page object in RAM (at most one per group), one lock at a time.
    pub(crate) fn clear_group_pp(&self, first: SlotIndex) {
        for k in 0..self.multi_pages as u64 {
            let mut g = self.slots.lock(SlotIndex(first.0 + k));
            let st = g.state();
            if st.has(SlotFlags::MULTI) && !st.has(SlotFlags::WB) {
                g.clear_flags(SlotFlags::PP_SLOT);
            }
        }
    }

    /// Copies writeback candidate `index` into `out` under its lock, if it still has PP_SLOT:
    /// the object as stored when `as_stored` (or when it is a raw HUGE page), else the page
    /// decompressed. `None` when the slot is no longer a candidate; the slot is then left
    /// without PP_SLOT (an object that does not decompress is not written back either).
    pub(crate) fn copy_candidate(
        &self,
        index: SlotIndex,
        out: &mut [u8],
        as_stored: bool,
    ) -> Option<Copied> {
        let mut g = self.slots.lock(index);
        let st = g.state();
        if !st.has(SlotFlags::PP_SLOT) {
            return None;
        }
        let Some(raw) = st.handle_raw().filter(|_| !st.has(SlotFlags::MULTI)) else {
            g.clear_flags(SlotFlags::PP_SLOT);
            return None;
        };
        let handle = Handle::from_raw(raw).expect("a PP_SLOT slot holds an object");
        let huge = st.has(SlotFlags::HUGE);
        let len_bytes = self.pool.read(handle, |obj| {
            if as_stored || huge {
                out[..obj.len()].copy_from_slice(obj);
                Some(obj.len())
            } else {
                let page = &mut out[..self.page_size_bytes];
                let codec = self.codecs.get(st.codec()).ok()?;
                codec.decompress(obj, page).ok().map(|()| page.len())
            }
        });
        let Some(len_bytes) = len_bytes else {
            g.clear_flags(SlotFlags::PP_SLOT);
            return None;
        };
        Some(Copied {
            handle: raw,
            len_bytes,
            codec: st.codec(),
            huge,
        })
    }

    /// Finishes a page whose write to `location` completed (`set_written_back`): under the
    /// slot's lock, if the slot still has PP_SLOT and still holds object `handle`, frees the
    /// object, points the slot at `location` (WB; size, HUGE/INCOMPRESSIBLE and priority
    /// kept) and commits the location to the target, and returns `true`. Otherwise (the slot
    /// was read, overwritten or discarded while the write was in flight) clears PP_SLOT and
    /// returns `false`: the caller gives the location back. Counts `bd_writes` either way.
    pub(crate) fn finish_writeback(&self, index: SlotIndex, handle: u64, location: u64) -> bool {
        StoreStats::add(&self.stats.bd_writes, 1);
        let mut g = self.slots.lock(index);
        let st = g.state();
        let Some(target) = self.target.as_ref() else {
            // Writeback runs only with a target: nothing was written, nothing changes.
            g.clear_flags(SlotFlags::PP_SLOT);
            return false;
        };
        if !st.has(SlotFlags::PP_SLOT) || st.handle_raw() != Some(handle) {
            g.clear_flags(SlotFlags::PP_SLOT);
            return false;
        }
        let mut keep = SlotFlags::NONE;
        for f in [SlotFlags::HUGE, SlotFlags::INCOMPRESSIBLE] {
            if st.has(f) {
                keep = keep | f;
            }
        }
        // The slot first, then the object (`docs/restart.md`).
        g.set_wb(location, st.size_bytes(), keep, st.codec());
        self.release_object(index, st, Free::Sync);
        target.commit(location, 1);
        true
    }

    /// Copies the multi-page object of the group holding writeback candidate `index` into
    /// `out` (the object as stored: it is written back compressed whatever
    /// `compressed_writeback` says, since its pages share it), under the group's locks, if
    /// every slot still pointing into it has PP_SLOT: the rule is that an object goes only
    /// when all its live pages were selected. Otherwise (or if it is gone) clears PP_SLOT on
    /// the group and returns `None`. `out` is at least a group's size.
    pub(crate) fn copy_group(&self, index: SlotIndex, out: &mut [u8]) -> Option<Copied> {
        let first = self.group_first(index);
        let mut guards = self.lock_group(first);
        let mut handle = None;
        let mut all_marked = true;
        for g in guards.iter().flatten() {
            let st = g.state();
            if st.has(SlotFlags::MULTI) && !st.has(SlotFlags::WB) {
                handle = Some(st);
                all_marked &= st.has(SlotFlags::PP_SLOT);
            }
        }
        let copied = handle.filter(|_| all_marked).map(|st| {
            let h = Handle::from_raw(st.value).expect("a MULTI slot holds an object");
            let len = self.pool.read(h, |obj| {
                out[..obj.len()].copy_from_slice(obj);
                obj.len()
            });
            Copied {
                handle: st.value,
                len_bytes: len,
                codec: st.codec(),
                huge: false,
            }
        });
        if copied.is_none() {
            for g in guards.iter_mut().flatten() {
                let st = g.state();
                if st.has(SlotFlags::MULTI) && !st.has(SlotFlags::WB) {
                    g.clear_flags(SlotFlags::PP_SLOT);
                }
            }
        }
        copied
    }

    /// Finishes a multi-page object whose write to `location` completed: under the locks of
    /// the group starting at `first`, if every slot still pointing at object `handle` has
    /// PP_SLOT (none was read, overwritten or freed meanwhile; pages broken out of it are
    /// not its any more), frees the object and points those slots at `location` (WB and
    /// MULTI, size and codec kept; the group's reference count stays), commits the location,
    /// and returns how many slots now point there. Otherwise clears PP_SLOT on the group and
    /// returns `None`: the caller gives the location back. Counts `bd_writes` (in blocks)
    /// either way.
    pub(crate) fn finish_group_writeback(
        &self,
        first: SlotIndex,
        handle: u64,
        location: u64,
    ) -> Option<u64> {
        let mut guards = self.lock_group(first);
        let mut live = 0u64;
        let mut all_marked = true;
        let mut obj = None;
        for g in guards.iter().flatten() {
            let st = g.state();
            if st.has(SlotFlags::MULTI) && st.handle_raw() == Some(handle) {
                live += 1;
                all_marked &= st.has(SlotFlags::PP_SLOT);
                obj = Some(st);
            }
        }
        let target = self.target.as_ref();
        let (Some(st), Some(target), true) = (obj, target, all_marked) else {
            for g in guards.iter_mut().flatten() {
                if g.state().handle_raw() == Some(handle) {
                    g.clear_flags(SlotFlags::PP_SLOT);
                }
            }
            if let Some(st) = obj {
                let blocks = WbTarget::group_blocks(st.size_bytes(), self.page_size_bytes);
                StoreStats::add(&self.stats.bd_writes, blocks);
            }
            return None;
        };
        let s = &self.stats;
        let blocks = WbTarget::group_blocks(st.size_bytes(), self.page_size_bytes);
        StoreStats::add(&s.bd_writes, blocks);
        debug_assert_eq!(
            u64::from(
                self.group_refs[(first.0 / self.multi_pages as u64) as usize]
                    .load(Ordering::Relaxed)
            ),
            live
        );
        for g in guards.iter_mut().flatten() {
            let gs = g.state();
            if gs.has(SlotFlags::MULTI) && gs.handle_raw() == Some(handle) {
                g.set_wb(location, st.size_bytes(), SlotFlags::MULTI, st.codec());
            }
        }
        // The slots first, then the object (`docs/restart.md`). The handle may come back for
        // another object: the caches of this one go first.
        self.multi_frees.fetch_add(1, Ordering::Release);
        self.pool
            .free(Handle::from_raw(handle).expect("a MULTI slot holds an object"));
        StoreStats::sub(&s.compr_data_size_bytes, st.size_bytes() as u64);
        StoreStats::sub(&s.multi_objects, 1);
        StoreStats::sub(&s.multi_pages, live);
        StoreStats::add(&s.multi_wb_objects, 1);
        StoreStats::add(&s.multi_wb_pages, live);
        StoreStats::add(&s.multi_wb_blocks, blocks);
        target.commit(location, blocks);
        Some(live)
    }
}
