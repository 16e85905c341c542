//! The store's steps of a recompression (zram's `recompress_slot`): the priorities asked for,
//! and one candidate (a page, or a multi-page object's group) replaced by a smaller object when a
//! recompression codec finds one. The scan and the loop are `crate::recompress`'s, which has
//! the life of one recompression, step by step; the numbers below refer to it.
//!
//! Reads decompress with the codec of the slot's priority ([`Codecs`](super::Codecs)).

use super::stats::StoreStats;
use super::{Free, Store};
use crate::compress::MAX_COMPS;
use crate::error::{Error, Result};
use crate::slot::{SlotFlags, SlotIndex, SlotState};
use crate::zsmalloc::Handle;
use std::sync::atomic::Ordering;

/// The outcome of one slot.
pub(crate) enum Outcome {
    /// Not tried: no longer a candidate, below the threshold, or already at a priority as high
    /// as asked.
    Skipped,
    /// Replaced: old and new object sizes.
    Recompressed(usize, usize),
    /// No codec shrank it; marked INCOMPRESSIBLE when `true`.
    NotSmaller(bool),
    /// Accessed meanwhile.
    Raced,
}

/// The priorities one run tries, `lo..hi`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrioRange {
    pub(crate) lo: usize,
    pub(crate) hi: usize,
}

impl Store {
    /// The priorities a recompression asks for, as the kernel resolves them: `priority=N` alone (0
    /// meaning 1), `algo=NAME` the first configured priority with that algorithm from there,
    /// default every recompression priority; capped at the highest configured. `EINVAL` when
    /// that leaves nothing (no recompression algorithm, an unknown `algo`, a priority above
    /// every configured one).
    pub(crate) fn prio_range(
        &self,
        priority: Option<u32>,
        algo: Option<&str>,
    ) -> Result<PrioRange> {
        let mut lo = 1usize;
        let mut hi = MAX_COMPS;
        if let Some(p) = priority {
            lo = (p as usize).max(1);
            hi = lo.saturating_add(1);
        }
        if let Some(algo) = algo {
            let p = (lo..MAX_COMPS)
                .find(|&p| self.codecs.name(p) == Some(algo))
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "recompress: algo={algo} is not a configured recompression algorithm \
                         (recomp_algorithm)"
                    ))
                })?;
            lo = p;
            hi = p + 1;
        }
        hi = hi.min(self.codecs.highest() + 1);
        if lo >= hi {
            return Err(Error::invalid(
                "recompress: no recompression algorithm at the priorities asked for (set \
                 recomp_algorithm before disksize)",
            ));
        }
        Ok(PrioRange { lo, hi })
    }

    /// `threshold` as bytes; `EINVAL` at or above the huge threshold (the kernel's check
    /// against `huge_class_size`: no object that large is ever compressed).
    pub(crate) fn check_threshold(&self, threshold_bytes: u64) -> Result<usize> {
        if threshold_bytes >= self.huge_threshold_bytes as u64 {
            return Err(Error::invalid(format!(
                "recompress: threshold={} must be below the huge threshold ({} bytes)",
                threshold_bytes, self.huge_threshold_bytes
            )));
        }
        Ok(threshold_bytes as usize)
    }

    /// Recompresses one candidate (steps 3 to 6 of the module docs).
    pub(crate) fn recompress_slot(
        &self,
        index: SlotIndex,
        threshold: usize,
        range: PrioRange,
        page: &mut [u8],
        dst: &mut [u8],
    ) -> Result<Outcome> {
        let mut g = self.slots.lock(index);
        let st = g.state();
        if !st.has(SlotFlags::PP_SLOT) {
            return Ok(Outcome::Skipped);
        }
        let old_size = st.size_bytes();
        let lo = range.lo.max(usize::from(st.prio()) + 1);
        let Some(raw) = st
            .handle_raw()
            .filter(|_| old_size >= threshold && lo < range.hi && !st.has(SlotFlags::MULTI))
        else {
            g.clear_flags(SlotFlags::PP_SLOT);
            return Ok(Outcome::Skipped);
        };
        let handle = Handle::from_raw(raw).expect("a slot in RAM holds a handle");
        let read = self.pool.read(handle, |obj| {
            if st.has(SlotFlags::HUGE) {
                page.copy_from_slice(obj);
                Ok(())
            } else {
                self.codecs.get(st.codec())?.decompress(obj, page)
            }
        });
        if let Err(e) = read {
            g.clear_flags(SlotFlags::PP_SLOT);
            return Err(e);
        }
        g.clear_flags(SlotFlags::IDLE);
        drop(g);

        StoreStats::add(&self.stats.recomp_tried, 1);
        // Memory taken in the pool: a size class, or a span's pages plus its tail's class.
        let footprint_old = self.pool.footprint_bytes(old_size);
        let shrinks = |len: usize| {
            len < self.huge_threshold_bytes
                && self.pool.footprint_bytes(len) < footprint_old
                && (threshold == 0 || len < threshold)
        };
        let found = match self.first_shrinking(page, dst, lo..range.hi, shrinks) {
            Ok(found) => found,
            Err(e) => {
                self.clear_pp_if(index, raw);
                return Err(e);
            }
        };
        let Some((id, len)) = found else {
            // The kernel marks a page INCOMPRESSIBLE only when the last codec has been tried.
            let last = range.hi > self.codecs.highest();
            let mut g = self.slots.lock(index);
            let st = g.state();
            if !st.has(SlotFlags::PP_SLOT) || st.handle_raw() != Some(raw) {
                return Ok(Outcome::Raced);
            }
            g.clear_flags(SlotFlags::PP_SLOT);
            if last {
                g.set_flags(SlotFlags::INCOMPRESSIBLE);
                StoreStats::add(&self.stats.recomp_incompressible, 1);
            }
            return Ok(Outcome::NotSmaller(last));
        };
        let new = match self.pool.malloc(len) {
            Ok(h) => h,
            Err(e) => {
                self.clear_pp_if(index, raw);
                return Err(e);
            }
        };
        self.pool.write(new, &dst[..len]);
        let mut g = self.slots.lock(index);
        let st = g.state();
        if !st.has(SlotFlags::PP_SLOT) || st.handle_raw() != Some(raw) {
            drop(g);
            self.pool.free(new);
            return Ok(Outcome::Raced);
        }
        self.codecs.release(st.codec());
        self.codecs.acquire(id);
        // The slot first, then the old object (`docs/restart.md`).
        g.set_handle(new.to_raw(), len, SlotFlags::NONE, id);
        self.release_object(index, st, Free::Sync);
        StoreStats::add(&self.stats.compr_data_size_bytes, len as u64);
        StoreStats::add(&self.stats.recomp_done, 1);
        Ok(Outcome::Recompressed(old_size, len))
    }

    /// Recompresses the multi-page object of the group holding candidate `index`: the steps
    /// of a page, on the whole group, under the locks of the group's slots (ascending), and
    /// only when every page still pointing into the object is a candidate (writeback's rule).
    /// The threshold applies to the object's bytes per page; a result must also stay below
    /// the size where a group is stored page by page. The new object is published to every
    /// page pointing into the old one, with the new codec id; INCOMPRESSIBLE marks all of them.
    pub(crate) fn recompress_group(
        &self,
        index: SlotIndex,
        threshold: usize,
        range: PrioRange,
        group: &mut [u8],
        dst: &mut [u8],
    ) -> Result<Outcome> {
        let n = self.multi_pages;
        let first = self.group_first(index);
        let per_page = |bytes: usize| bytes.div_ceil(n);
        let mut guards = self.lock_group(first);
        let live = |st: &SlotState| st.has(SlotFlags::MULTI) && !st.has(SlotFlags::WB);
        let mut obj = None;
        let mut all_marked = true;
        for g in guards.iter().flatten() {
            let st = g.state();
            if live(&st) {
                obj = Some(st);
                all_marked &= st.has(SlotFlags::PP_SLOT);
            }
        }
        let lo = obj.map_or(range.hi, |st| range.lo.max(usize::from(st.prio()) + 1));
        let Some(st) =
            obj.filter(|st| all_marked && per_page(st.size_bytes()) >= threshold && lo < range.hi)
        else {
            for g in guards.iter_mut().flatten() {
                if live(&g.state()) {
                    g.clear_flags(SlotFlags::PP_SLOT);
                }
            }
            return Ok(Outcome::Skipped);
        };
        let raw = st.value;
        let old_size = st.size_bytes();
        let handle = Handle::from_raw(raw).expect("a MULTI slot holds an object");
        let group = &mut group[..n * self.page_size_bytes];
        let read = self
            .codecs
            .get(st.codec())
            .and_then(|codec| self.pool.read(handle, |obj| codec.decompress(obj, group)));
        for g in guards.iter_mut().flatten() {
            if live(&g.state()) {
                if read.is_err() {
                    g.clear_flags(SlotFlags::PP_SLOT);
                } else {
                    g.clear_flags(SlotFlags::IDLE);
                }
            }
        }
        read?;
        drop(guards);

        StoreStats::add(&self.stats.recomp_tried, 1);
        let footprint_old = self.pool.footprint_bytes(old_size);
        let shrinks = |len: usize| {
            len < self.huge_group_bytes
                && self.pool.footprint_bytes(len) < footprint_old
                && (threshold == 0 || per_page(len) < threshold)
        };
        let found = match self.first_shrinking(group, dst, lo..range.hi, shrinks) {
            Ok(found) => found,
            Err(e) => {
                self.clear_group_pp(first);
                return Err(e);
            }
        };
        // Under the group's locks again: the pages still pointing at the old object, all
        // still marked, or the access won.
        let relock = |guards: &mut [Option<super::SlotGuard<'_>>]| {
            let mut ok = true;
            let mut count = 0u64;
            for g in guards.iter().flatten() {
                let st = g.state();
                if st.handle_raw() == Some(raw) && st.has(SlotFlags::MULTI) {
                    ok &= st.has(SlotFlags::PP_SLOT);
                    count += 1;
                }
            }
            (ok && count > 0).then_some(count)
        };
        let Some((id, len)) = found else {
            let last = range.hi > self.codecs.highest();
            let mut guards = self.lock_group(first);
            if relock(&mut guards).is_none() {
                drop(guards);
                self.clear_group_pp(first);
                return Ok(Outcome::Raced);
            }
            for g in guards.iter_mut().flatten() {
                if g.state().handle_raw() == Some(raw) {
                    g.clear_flags(SlotFlags::PP_SLOT);
                    if last {
                        g.set_flags(SlotFlags::INCOMPRESSIBLE);
                    }
                }
            }
            if last {
                StoreStats::add(&self.stats.recomp_incompressible, 1);
            }
            return Ok(Outcome::NotSmaller(last));
        };
        let new = match self.pool.malloc(len) {
            Ok(h) => h,
            Err(e) => {
                self.clear_group_pp(first);
                return Err(e);
            }
        };
        self.pool.write(new, &dst[..len]);
        let mut guards = self.lock_group(first);
        if relock(&mut guards).is_none() {
            drop(guards);
            self.pool.free(new);
            self.clear_group_pp(first);
            return Ok(Outcome::Raced);
        }
        for g in guards.iter_mut().flatten() {
            let gs = g.state();
            if gs.handle_raw() == Some(raw) && gs.has(SlotFlags::MULTI) {
                self.codecs.release(gs.codec());
                self.codecs.acquire(id);
                g.set_handle(new.to_raw(), len, SlotFlags::MULTI, id);
            }
        }
        // The slots first, then the old object (`docs/restart.md`). The old handle may come
        // back for another object: the caches of this one go first.
        self.multi_frees.fetch_add(1, Ordering::Release);
        self.pool.free(handle);
        StoreStats::sub(&self.stats.compr_data_size_bytes, old_size as u64);
        StoreStats::add(&self.stats.compr_data_size_bytes, len as u64);
        StoreStats::add(&self.stats.recomp_done, 1);
        Ok(Outcome::Recompressed(old_size, len))
    }

    /// The priority of slot `index` when it holds an object in RAM (see
    /// `Device::debug_slot_priority`).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn debug_slot_priority(&self, index: u64) -> Option<u8> {
        if index >= self.nr_pages() {
            return None;
        }
        let g = self.slots.lock(SlotIndex(index));
        let st = g.state();
        st.handle_raw().map(|_| st.prio())
    }

    /// What recompression priority `prio` holds (`dict_stat`).
    pub(crate) fn codecs_gen_stat(&self, prio: usize) -> Option<super::GenStat> {
        self.codecs.gen_stat(prio)
    }

    /// Step 4: compresses `src` into `dst` with the codec of each priority in `prios` in
    /// order (at its current dictionary generation: stable, since installing one takes
    /// `pp_lock`, which the caller holds), stopping at the first whose length `shrinks`
    /// accepts: that codec's id and the length; `None` when no codec did.
    fn first_shrinking(
        &self,
        src: &[u8],
        dst: &mut [u8],
        prios: std::ops::Range<usize>,
        shrinks: impl Fn(usize) -> bool,
    ) -> Result<Option<(u8, usize)>> {
        for prio in prios {
            let Some((id, codec)) = self.codecs.current(prio) else {
                continue;
            };
            let len = codec.compress(src, dst)?;
            if shrinks(len) {
                return Ok(Some((id, len)));
            }
        }
        Ok(None)
    }

    /// Clears PP_SLOT of slot `index` if it still holds object `raw` (a run that stops on an
    /// error leaves the slot as it was).
    fn clear_pp_if(&self, index: SlotIndex, raw: u64) {
        let mut g = self.slots.lock(index);
        if g.state().handle_raw() == Some(raw) {
            g.clear_flags(SlotFlags::PP_SLOT);
        }
    }
}
