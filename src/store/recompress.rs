//! Recompression (zram's `recompress_store` and `recompress_slot`): pages stored with the
//! primary codec are compressed again with the recompression codecs (`recomp_algorithm`), in
//! priority order, and replaced when that saves memory.
//!
//! # Life of one recompression
//!
//! 1. Only one post-processing operation (writeback or recompression) runs at a time: the
//!    device's `pp_lock`, taken by the caller, so PP_SLOT belongs to this run.
//! 2. Scan: every slot holding an object in RAM that the spec accepts (IDLE for `type=idle`,
//!    HUGE for `type=huge`, both for `huge_idle`; never INCOMPRESSIBLE; never one already
//!    written by the highest priority asked for) is marked PP_SLOT and bucketed by size
//!    ([`PpCtl`], the writeback's selection): the largest objects are tried first, as the
//!    kernel does, so `max_pages` spends its budget where most memory is.
//! 3. For each candidate, under its slot lock: if it still has PP_SLOT and its object is at
//!    least `threshold` bytes, decompress it (or copy a HUGE page) into a page buffer and clear
//!    IDLE (recompression touched it, as the kernel says: a later `writeback idle` must not
//!    take it for an old page). The lock is dropped.
//! 4. Outside any lock, compress the page with each configured codec from the first priority
//!    above the slot's own (and at least the spec's) up to the last one asked for, stopping at
//!    the first whose object lands in a **smaller size class** than the old one, below the
//!    huge threshold, and below `threshold` when one is given (a smaller object in the same
//!    class saves no memory). Every page that gets this far counts against `max_pages`,
//!    shrunk or not, as in the kernel.
//! 5. Success: allocate and fill the new object, retake the slot lock and, only if the slot
//!    still has PP_SLOT and still holds the old handle (any read, write or free in between
//!    clears PP_SLOT: the access wins and the new object is freed), free the old object and
//!    point the slot at the new one with the new priority (flags cleared, as zram's
//!    `zram_free_page` + `zram_set_priority`; the access time is kept: recompression is not
//!    an access). `compr_data_size` and `huge_pages` move as for any replacement.
//! 6. No codec shrank it: if the codecs tried included the highest configured one, the slot is
//!    marked INCOMPRESSIBLE (so later recompressions skip it and `writeback incompressible`
//!    takes it); otherwise it is left as it was.
//! 7. At the end every candidate not reached loses PP_SLOT.
//!
//! A multi-page object (`multi_page_size`) goes through the same steps as one candidate
//! ([`Store::recompress_run`]), under the locks of its group's slots (ascending) where a page
//! takes its slot's: only when every page still pointing into it is marked (writeback's
//! rule); the run is decompressed whole; a result must also stay below the size above which a
//! run is stored page by page, and `threshold` compares bytes per page; the new object and its
//! codec id go to every page still pointing at the old one, and the old handle's cached runs
//! are invalidated (`multi_frees`) before it is freed.
//!
//! Reads decompress with the codec of the slot's priority ([`Codecs`](super::Codecs)).

use super::stats::StoreStats;
use super::{Free, Store};
use crate::compress::{compress_bound, MAX_COMPS};
use crate::error::{Error, ErrorKind, Result};
use crate::slot::{SlotFlags, SlotIndex, SlotState};
use crate::units::{kstrtou64, strip_newline};
use crate::writeback::candidates::PpCtl;
use crate::zsmalloc::Handle;
use std::sync::atomic::Ordering;

/// What a `recompress` write asks for (zram's `recompress_store` arguments).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecompressSpec {
    /// Only IDLE slots (`type=idle`, `type=huge_idle`).
    pub idle: bool,
    /// Only HUGE slots (`type=huge`, `type=huge_idle`).
    pub huge: bool,
    /// Pages to try at most (`max_pages=N`); `None`: no limit.
    pub max_pages: Option<u64>,
    /// `threshold=BYTES`: only objects at least this large, and only results smaller than
    /// it; 0: no threshold. Must be below the huge threshold.
    pub threshold_bytes: u64,
    /// `algo=NAME`: only this recompression algorithm.
    pub algo: Option<String>,
    /// `priority=N`: only this priority (0 means 1, as in the kernel).
    pub priority: Option<u32>,
}

impl RecompressSpec {
    /// Parses the value written to `recompress`: space-separated `key=value` tokens (`type`,
    /// `max_pages`, `threshold`, `algo`, `priority`; other keys are ignored, as in zram). A
    /// token without a value, an unknown type or a malformed number is `EINVAL`; a number too
    /// large for its field `ERANGE` (the kernel's `kstrtouint`).
    pub fn parse(value: &str) -> Result<RecompressSpec> {
        let mut spec = RecompressSpec::default();
        for tok in strip_newline(value).split_ascii_whitespace() {
            let (key, val) = tok.split_once('=').unwrap_or((tok, ""));
            if val.is_empty() {
                return Err(Error::invalid(format!("recompress: {key} has no value")));
            }
            match key {
                "type" => {
                    (spec.idle, spec.huge) = match val {
                        "idle" => (true, false),
                        "huge" => (false, true),
                        "huge_idle" => (true, true),
                        _ => {
                            return Err(Error::invalid(format!(
                                "recompress: type={val}: idle, huge or huge_idle"
                            )))
                        }
                    }
                }
                "max_pages" => spec.max_pages = Some(kstrtou64(val, 10)?),
                "threshold" => spec.threshold_bytes = kstrtou32(val)?.into(),
                "algo" => spec.algo = Some(val.to_string()),
                "priority" => spec.priority = Some(kstrtou32(val)?),
                _ => {}
            }
        }
        Ok(spec)
    }
}

/// The kernel's `kstrtouint(val, 10)`: `EINVAL` malformed, `ERANGE` above `u32::MAX`.
fn kstrtou32(val: &str) -> Result<u32> {
    let v = kstrtou64(val, 10)?;
    u32::try_from(v)
        .map_err(|_| Error::new(ErrorKind::OutOfRange, format!("{val} is over {}", u32::MAX)))
}

/// What one recompression did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecompressReport {
    /// Slots selected by the scan.
    pub candidates: u64,
    /// Pages the codecs were tried on (what `max_pages` counts).
    pub tried: u64,
    /// Pages replaced with a smaller object.
    pub recompressed: u64,
    /// Pages marked INCOMPRESSIBLE.
    pub incompressible: u64,
    /// Pages accessed (read, written, freed) while being recompressed: left as the access left
    /// them.
    pub raced: u64,
    /// Candidates not tried (no longer a candidate, below the threshold, or already at a
    /// priority as high as asked); they do not count against `max_pages`.
    pub skipped: u64,
    /// Bytes of `compr_data_size` saved.
    pub saved_bytes: u64,
}

/// The outcome of one slot.
enum Outcome {
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
struct PrioRange {
    lo: usize,
    hi: usize,
}

impl Store {
    /// The priorities `spec` asks for, as the kernel resolves them: `priority=N` alone (0
    /// meaning 1), `algo=NAME` the first configured priority with that algorithm from there,
    /// default every recompression priority; capped at the highest configured. `EINVAL` when
    /// that leaves nothing (no recompression algorithm, an unknown `algo`, a priority above
    /// every configured one).
    fn prio_range(&self, spec: &RecompressSpec) -> Result<PrioRange> {
        let mut lo = 1usize;
        let mut hi = MAX_COMPS;
        if let Some(p) = spec.priority {
            lo = (p as usize).max(1);
            hi = lo.saturating_add(1);
        }
        if let Some(algo) = spec.algo.as_deref() {
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

    /// Runs a recompression (see the module docs); the caller holds `pp_lock`. `progress` is
    /// called after every candidate tried or skipped. Returns `Err` for a bad spec (nothing done) or, with the
    /// work done so far kept, for a codec or allocation failure, which stops the run (zram
    /// returns it from the write).
    pub(crate) fn recompress(
        &self,
        spec: &RecompressSpec,
        progress: &mut dyn FnMut(&RecompressReport),
    ) -> Result<RecompressReport> {
        let threshold = self.check_threshold(spec)?;
        let range = self.prio_range(spec)?;
        let mut ctl = PpCtl::new(self.page_size_bytes);
        ctl.scan_with(self, 0, self.nr_pages(), |st: &SlotState| {
            (!spec.idle || st.has(SlotFlags::IDLE))
                && (!spec.huge || st.has(SlotFlags::HUGE))
                && !st.has(SlotFlags::INCOMPRESSIBLE)
                && usize::from(st.prio()) + 1 < range.hi
        });
        let mut report = RecompressReport {
            candidates: ctl.total(),
            ..RecompressReport::default()
        };
        let mut budget = spec.max_pages.unwrap_or(u64::MAX);
        // A page, or a multi-page object's run.
        let run_bytes = self.multi_pages * self.page_size_bytes;
        let mut page = vec![0u8; run_bytes];
        let mut dst = vec![0u8; compress_bound(run_bytes)];
        let mut result = Ok(());
        while budget > 0 {
            let Some(index) = ctl.select() else { break };
            let outcome = if self.multi_pages > 1 && self.is_multi(index) {
                self.recompress_run(index, threshold, range, &mut page, &mut dst)
            } else {
                let ps = self.page_size_bytes;
                self.recompress_slot(index, threshold, range, &mut page[..ps], &mut dst)
            };
            let outcome = match outcome {
                Ok(o) => o,
                Err(e) => {
                    report.tried += 1;
                    result = Err(e);
                    break;
                }
            };
            match outcome {
                Outcome::Skipped => {
                    report.skipped += 1;
                    progress(&report);
                    continue;
                }
                Outcome::Recompressed(old, new) => {
                    report.recompressed += 1;
                    report.saved_bytes += (old - new) as u64;
                }
                Outcome::NotSmaller(marked) => report.incompressible += u64::from(marked),
                Outcome::Raced => report.raced += 1,
            }
            report.tried += 1;
            budget -= 1;
            progress(&report);
        }
        ctl.release(self);
        result.map(|()| report)
    }

    /// `threshold` as bytes; `EINVAL` at or above the huge threshold (the kernel's check
    /// against `huge_class_size`: no object that large is ever compressed).
    pub(crate) fn check_threshold(&self, spec: &RecompressSpec) -> Result<usize> {
        if spec.threshold_bytes >= self.huge_threshold_bytes as u64 {
            return Err(Error::invalid(format!(
                "recompress: threshold={} must be below the huge threshold ({} bytes)",
                spec.threshold_bytes, self.huge_threshold_bytes
            )));
        }
        Ok(spec.threshold_bytes as usize)
    }

    /// Recompresses one candidate (steps 3 to 6 of the module docs).
    fn recompress_slot(
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
        // Memory taken in the pool: a size class, or a run's pages plus its tail's class.
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
        self.release_object(index, st, Free::Sync);
        self.codecs.release(st.codec());
        self.codecs.acquire(id);
        g.set_handle(new.to_raw(), len, SlotFlags::NONE, id);
        StoreStats::add(&self.stats.compr_data_size_bytes, len as u64);
        StoreStats::add(&self.stats.recomp_done, 1);
        Ok(Outcome::Recompressed(old_size, len))
    }

    /// Recompresses the multi-page object of the group holding candidate `index`: the steps
    /// of a page, on the whole run, under the locks of the group's slots (ascending), and
    /// only when every page still pointing into the object is a candidate (writeback's rule).
    /// The threshold applies to the object's bytes per page; a result must also stay below
    /// the size where a run is stored page by page. The new object is published to every
    /// page pointing into the old one, with the new codec id; INCOMPRESSIBLE marks all of them.
    fn recompress_run(
        &self,
        index: SlotIndex,
        threshold: usize,
        range: PrioRange,
        run: &mut [u8],
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
        let run = &mut run[..n * self.page_size_bytes];
        let read = self
            .codecs
            .get(st.codec())
            .and_then(|codec| self.pool.read(handle, |obj| codec.decompress(obj, run)));
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
            len < self.huge_run_bytes
                && self.pool.footprint_bytes(len) < footprint_old
                && (threshold == 0 || per_page(len) < threshold)
        };
        let found = match self.first_shrinking(run, dst, lo..range.hi, shrinks) {
            Ok(found) => found,
            Err(e) => {
                self.clear_run_pp(first);
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
                self.clear_run_pp(first);
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
                self.clear_run_pp(first);
                return Err(e);
            }
        };
        self.pool.write(new, &dst[..len]);
        let mut guards = self.lock_group(first);
        if relock(&mut guards).is_none() {
            drop(guards);
            self.pool.free(new);
            self.clear_run_pp(first);
            return Ok(Outcome::Raced);
        }
        // The old handle may come back for another object: the caches of this one go first.
        self.multi_frees.fetch_add(1, Ordering::Release);
        self.pool.free(handle);
        for g in guards.iter_mut().flatten() {
            let gs = g.state();
            if gs.handle_raw() == Some(raw) && gs.has(SlotFlags::MULTI) {
                self.codecs.release(gs.codec());
                self.codecs.acquire(id);
                g.set_handle(new.to_raw(), len, SlotFlags::MULTI, id);
            }
        }
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
