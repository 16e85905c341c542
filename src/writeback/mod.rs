//! Writeback: moving pages from RAM to a backing device (zram's `CONFIG_ZRAM_WRITEBACK`).
//!
//! # Parts
//! - [`WritebackSpec`]: what to write back, parsed from the `writeback` attribute's syntax
//!   (`idle`, `huge`, `huge_idle`, `incompressible`, `type=<mode>`, `page_index=N`,
//!   `page_indexes=A-B`, several in one write).
//! - `candidates`: the scan that marks PP_SLOT and buckets slots by size, largest first.
//! - [`BlockBitmap`]: one backing block per slot, first free block, released exactly once.
//! - `batch`: the batched engine (a pool of requests between idle and in-flight lists).
//! - [`WbLimit`]: `writeback_limit` / `writeback_limit_enable`, charged at submission.
//! - Read-back lives with the other request paths in `device::request`.
//!
//! # State and locks
//! - `WbStore` (the backing device, its bitmap and `bd_*` counters) is part of an initialised
//!   device's contents: built from the `backing_dev` setting by `disksize`, dropped by `reset`.
//!   Every writeback holds the device's init lock shared for its whole run, so `reset` waits for
//!   it, as zram's does.
//! - One post-processing operation runs at a time (`Device::pp_lock`, zram's
//!   `pp_in_progress`); a second `writeback` fails with `EAGAIN`.
//! - Lock order: init lock → slot lock → {allocator locks, bitmap lock, limit lock}. The
//!   bitmap and limit locks are leaves. No slot lock is held while waiting for I/O: the engine
//!   copies under the lock and writes after dropping it; read-back pins the block under the lock
//!   and reads after dropping it.

mod batch;
mod bitmap;
pub(crate) mod candidates;
mod limit;
mod zoned;

pub use bitmap::{BlockBitmap, BlockIndex, BlockPin};
pub use candidates::ModeFilter;
pub use limit::{units_per_page, Charge, WbLimit};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::backing::{Backing, MAX_QUEUE_DEPTH};
use crate::device::attrs::kstrtou64;
use crate::device::Device;
use crate::error::{Error, ErrorKind, Result};
use crate::zoned::{GcReport, ZoneConfig, ZoneStore};

/// The default `writeback_batch_size`: upstream zram's (32 requests in flight).
pub const DEFAULT_WB_BATCH_SIZE: u32 = 32;

/// The largest pool a writeback uses: a larger `writeback_batch_size` is accepted (as the
/// kernel accepts any `u32`) but capped here, the deepest queue the backing layer makes
/// (16 MiB of request buffers with 4 KiB pages).
pub const MAX_WB_BATCH_SIZE: usize = MAX_QUEUE_DEPTH;

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// How written-back pages are laid out on the backing device (`backing_layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackingLayout {
    /// One page-sized block per slot, from a bitmap (zram's layout).
    #[default]
    Bitmap,
    /// Append-only zones of records with garbage collection ([`crate::zoned`]).
    Zoned,
}

impl BackingLayout {
    /// `bitmap` or `zoned`.
    pub fn name(self) -> &'static str {
        match self {
            BackingLayout::Bitmap => "bitmap",
            BackingLayout::Zoned => "zoned",
        }
    }

    /// Parses [`name`](Self::name)'s output.
    pub fn parse(s: &str) -> Result<BackingLayout> {
        match s {
            "bitmap" => Ok(BackingLayout::Bitmap),
            "zoned" => Ok(BackingLayout::Zoned),
            _ => Err(Error::invalid(format!(
                "backing_layout {s:?}: bitmap or zoned"
            ))),
        }
    }
}

/// An initialised device's backing store.
///
/// With the bitmap layout a WB slot's value is a [`BlockIndex`]; with the zoned layout it is a
/// packed [`crate::zoned::ZoneLoc`] (`ZoneLoc::to_raw`). The layout is fixed for the life of
/// an initialisation, so `zoned.is_some()` tells which one every WB slot holds.
#[derive(Debug)]
pub(crate) struct WbStore {
    pub(crate) backing: Arc<dyn Backing>,
    /// One bit per page-sized block of the backing device (no blocks with the zoned layout).
    pub(crate) bitmap: BlockBitmap,
    /// The zoned store, with the zoned layout.
    pub(crate) zoned: Option<Arc<ZoneStore>>,
    /// WB slots pointing into the zoned store (its `bd_count`).
    pub(crate) zoned_pages: AtomicU64,
    /// `compressed_writeback`: blocks hold the stored object (decompressed on read) rather
    /// than the page. Fixed for the life of the initialisation.
    pub(crate) compressed: bool,
    pub(crate) page_size_bytes: usize,
    /// Pages read back (zram's `bd_reads`).
    pub(crate) bd_reads: AtomicU64,
    /// Pages written to the backing device (zram's `bd_writes`).
    pub(crate) bd_writes: AtomicU64,
}

impl WbStore {
    /// The store for `backing`: a bitmap of its blocks, or (with `zones`) a zoned store;
    /// `EINVAL` for a zone configuration the backing cannot hold.
    pub(crate) fn new(
        backing: Arc<dyn Backing>,
        compressed: bool,
        page: usize,
        zones: Option<ZoneConfig>,
    ) -> Result<WbStore> {
        let (blocks, zoned) = match zones {
            None => (backing.size_bytes() / page as u64, None),
            Some(cfg) => (0, Some(Arc::new(ZoneStore::new(backing.clone(), cfg)?))),
        };
        Ok(WbStore {
            backing,
            bitmap: BlockBitmap::new(blocks),
            zoned,
            zoned_pages: AtomicU64::new(0),
            compressed,
            page_size_bytes: page,
            bd_reads: AtomicU64::new(0),
            bd_writes: AtomicU64::new(0),
        })
    }

    /// Pages on the backing device (zram's `bd_count`, in pages).
    pub(crate) fn pages_stored(&self) -> u64 {
        match self.zoned {
            Some(_) => self.zoned_pages.load(Ordering::Relaxed),
            None => self.bitmap.bd_count(),
        }
    }

    /// Byte offset of `block` on the backing device.
    pub(crate) fn offset(&self, block: BlockIndex) -> u64 {
        block.0 * self.page_size_bytes as u64
    }
}

/// A writeback mode (zram's `parse_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritebackMode {
    /// Slots marked idle.
    Idle,
    /// Slots stored raw (HUGE).
    Huge,
    /// Slots both idle and HUGE.
    HugeIdle,
    /// Slots recompression found incompressible.
    Incompressible,
}

impl WritebackMode {
    /// Parses `idle`, `huge`, `huge_idle` or `incompressible`.
    pub fn parse(s: &str) -> Result<WritebackMode> {
        Ok(match s {
            "idle" => WritebackMode::Idle,
            "huge" => WritebackMode::Huge,
            "huge_idle" => WritebackMode::HugeIdle,
            "incompressible" => WritebackMode::Incompressible,
            _ => return Err(Error::invalid(format!("unknown writeback mode {s:?}"))),
        })
    }

    /// The slot filter.
    pub fn filter(self) -> ModeFilter {
        match self {
            WritebackMode::Idle => ModeFilter {
                idle: true,
                ..Default::default()
            },
            WritebackMode::Huge => ModeFilter {
                huge: true,
                ..Default::default()
            },
            WritebackMode::HugeIdle => ModeFilter {
                idle: true,
                huge: true,
                ..Default::default()
            },
            WritebackMode::Incompressible => ModeFilter {
                incompressible: true,
                ..Default::default()
            },
        }
    }
}

/// One scan: slots `lo..hi` filtered by `mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scan {
    /// The filter (default: every slot holding data in RAM).
    pub mode: ModeFilter,
    /// First page.
    pub lo: u64,
    /// One past the last page.
    pub hi: u64,
}

/// What a writeback takes: the union of its scans.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WritebackSpec {
    /// The scans, in order.
    pub scans: Vec<Scan>,
}

impl WritebackSpec {
    /// Every slot of the device selected by `mode` (`writeback <mode>`).
    pub fn mode(mode: WritebackMode) -> WritebackSpec {
        WritebackSpec {
            scans: vec![Scan {
                mode: mode.filter(),
                lo: 0,
                hi: u64::MAX,
            }],
        }
    }

    /// Every slot holding data in RAM in pages `first..=last` (`page_indexes=first-last`).
    pub fn pages(first: u64, last: u64) -> WritebackSpec {
        WritebackSpec {
            scans: vec![Scan {
                mode: ModeFilter::default(),
                lo: first,
                hi: last.saturating_add(1),
            }],
        }
    }

    /// Adds a scan of pages `first..=last` with `mode` (None: any slot).
    pub fn and(mut self, mode: Option<WritebackMode>, first: u64, last: u64) -> WritebackSpec {
        self.scans.push(Scan {
            mode: mode.map(WritebackMode::filter).unwrap_or_default(),
            lo: first,
            hi: last.saturating_add(1),
        });
        self
    }

    /// Parses the `writeback` attribute's value for a device of `nr_pages` pages, as zram's
    /// `writeback_store` does: tokens are processed in order; `page_index=N` and
    /// `page_indexes=A-B` (inclusive) set the range and scan it with the current mode; a mode
    /// (`idle`, or `type=idle`) sets the mode, scans the current range (the whole device unless
    /// an index came first) and ends the parsing. Unknown `key=value` tokens are ignored; an
    /// unknown bare word or mode is `EINVAL`; an index past the device is `ERANGE`.
    pub fn parse(value: &str, nr_pages: u64) -> Result<WritebackSpec> {
        let mut scans = Vec::new();
        let mut mode = ModeFilter::default();
        let (mut lo, mut hi) = (0, nr_pages);
        for tok in value.split_ascii_whitespace() {
            let (key, val) = match tok.split_once('=') {
                Some((k, v)) if !v.is_empty() => (k, Some(v)),
                Some((k, _)) => (k, None),
                None => (tok, None),
            };
            match (key, val) {
                (m, None) | ("type", Some(m)) => {
                    mode = WritebackMode::parse(m)?.filter();
                    scans.push(Scan { mode, lo, hi });
                    break;
                }
                ("page_index", Some(v)) => {
                    lo = kstrtou64(v, 10)?;
                    if lo >= nr_pages {
                        return Err(out_of_range(lo, nr_pages));
                    }
                    hi = lo + 1;
                    scans.push(Scan { mode, lo, hi });
                }
                ("page_indexes", Some(v)) => {
                    let (a, b) = v
                        .split_once('-')
                        .ok_or_else(|| Error::invalid(format!("page_indexes={v}: not A-B")))?;
                    lo = kstrtou64(a, 10)?;
                    if lo >= nr_pages {
                        return Err(out_of_range(lo, nr_pages));
                    }
                    let last = kstrtou64(b, 10)?;
                    if last >= nr_pages || lo > last {
                        return Err(Error::new(
                            ErrorKind::OutOfRange,
                            format!("page_indexes={v}: not a range inside 0..{nr_pages}"),
                        ));
                    }
                    hi = last + 1;
                    scans.push(Scan { mode, lo, hi });
                }
                _ => {}
            }
        }
        Ok(WritebackSpec { scans })
    }

    fn check(&self, nr_pages: u64) -> Result<()> {
        for s in &self.scans {
            if s.lo >= nr_pages || s.hi <= s.lo {
                return Err(out_of_range(s.lo, nr_pages));
            }
        }
        Ok(())
    }
}

fn out_of_range(index: u64, nr_pages: u64) -> Error {
    Error::new(
        ErrorKind::OutOfRange,
        format!("page index {index} is past the device's {nr_pages} pages"),
    )
}

/// Progress of a running writeback, reported to the caller's callback after every reap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WritebackProgress {
    /// Slots selected by the scan.
    pub candidates: u64,
    /// Pages now on the backing device.
    pub written: u64,
    /// Pages written whose slot changed while in flight (the block was released).
    pub changed: u64,
    /// Pages whose write failed (they stay in RAM).
    pub failed: u64,
    /// Requests in flight.
    pub in_flight: u64,
}

/// Sorts a failed write's error: `ENOSPC` (the backing device says it is full) stops taking
/// candidates; anything else is kept as the pass's error while the pass goes on.
pub(crate) fn note_write_error(
    stop: &mut Option<Error>,
    write_error: &mut Option<Error>,
    err: Error,
) {
    if err.kind() == crate::error::ErrorKind::NoSpace {
        stop.get_or_insert(err);
    } else {
        *write_error = Some(err);
    }
}

/// Finishes a written-back page under its slot lock (`g`, whose state is `st` and which still
/// has PP_SLOT): frees its allocator object and points the slot at `location` (a bitmap block
/// or a packed zone location), keeping HUGE and INCOMPRESSIBLE.
pub(crate) fn set_written_back(
    inner: &crate::device::Inner,
    g: &mut crate::slot::SlotGuard<'_>,
    st: crate::slot::SlotState,
    location: u64,
) {
    debug_assert!(st.handle_raw().is_some(), "a PP_SLOT slot holds an object");
    crate::device::request::release_object(inner, st, crate::device::request::Free::Sync);
    let mut keep = crate::slot::SlotFlags::NONE;
    for f in [
        crate::slot::SlotFlags::HUGE,
        crate::slot::SlotFlags::INCOMPRESSIBLE,
    ] {
        if st.has(f) {
            keep = keep | f;
        }
    }
    g.set_wb(location, st.size_bytes(), keep, st.prio());
}

/// The outcome of one writeback.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WritebackReport {
    /// Slots selected by the scan.
    pub candidates: u64,
    /// Pages moved to the backing device (their slots are WB).
    pub written: u64,
    /// Candidates skipped before submission because they were accessed or freed.
    pub skipped: u64,
    /// Pages written whose slot changed while the write was in flight.
    pub changed: u64,
    /// Pages whose write failed or was refused (they stay in RAM, charge refunded).
    pub failed: u64,
    /// Write operations submitted (vectored writes count once).
    pub ops: u64,
    /// The pool size used.
    pub batch_size: usize,
    /// Why the writeback failed: `ENOSPC` (backing full), `EIO` (limit exhausted, or the most
    /// recent write error). Pages written before it stay written.
    pub error: Option<Error>,
    /// Zoned layout: zones the GC run after the pass reclaimed.
    pub gc_zones_reclaimed: u64,
    /// Zoned layout: why that GC run stopped early. It does not fail the writeback (every page
    /// it reported written is written); the space stays unreclaimed until a later GC.
    pub gc_error: Option<Error>,
}

impl WritebackReport {
    /// What the progress callback sees, with `in_flight` requests outstanding.
    pub(crate) fn progress(&self, in_flight: usize) -> WritebackProgress {
        WritebackProgress {
            candidates: self.candidates,
            written: self.written,
            changed: self.changed,
            failed: self.failed,
            in_flight: in_flight as u64,
        }
    }
}

impl Device {
    /// Writes back the slots `spec` selects, as writing `writeback` does. Returns the report,
    /// or the error zram's attribute would return (with the report's work done anyway).
    pub fn writeback(&self, spec: &WritebackSpec) -> Result<WritebackReport> {
        let report = self.writeback_with_progress(spec, &mut |_| {})?;
        match report.error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Like [`Device::writeback`], calling `progress` after every batch of completions. `Err`
    /// only for errors found before any work (not initialised: `EINVAL`; another writeback
    /// running: `EAGAIN`; no backing device: `ENODEV`; bad range: `ERANGE`); failures of the
    /// run itself are in the report's `error`. The callback must not call into this device
    /// (the writeback holds the init lock shared; a nested acquisition could deadlock behind a
    /// waiting `reset`).
    pub fn writeback_with_progress(
        &self,
        spec: &WritebackSpec,
        progress: &mut dyn FnMut(&WritebackProgress),
    ) -> Result<WritebackReport> {
        self.writeback_inner(|_| Ok(spec.clone()), progress)
    }

    /// Marks backing blocks allocated as if other slots held them (`testing`), so that a
    /// benchmark can start from a fragmented backing device, as a long-lived bitmap with holes
    /// is (every other block free: no two written blocks adjacent). Returns how many were free.
    /// `ENODEV` without a backing device. Never call it outside benchmarks and tests: the
    /// blocks are only given back by `reset`.
    #[cfg(any(test, feature = "testing"))]
    pub fn debug_reserve_backing_blocks(
        &self,
        blocks: impl IntoIterator<Item = u64>,
    ) -> Result<u64> {
        let inner = self.inner()?;
        let wb = inner
            .wb
            .as_ref()
            .ok_or_else(|| Error::new(ErrorKind::NoDevice, "no backing device"))?;
        let mut n = 0;
        for b in blocks {
            if b >= wb.bitmap.blocks() {
                return Err(Error::new(ErrorKind::OutOfRange, format!("no block {b}")));
            }
            n += u64::from(wb.bitmap.reserve(BlockIndex(b)));
        }
        Ok(n)
    }

    /// The `writeback` attribute: parse, then run.
    pub(crate) fn writeback_str(&self, value: &str) -> Result<()> {
        let value = value.strip_suffix('\n').unwrap_or(value).to_string();
        let report = self.writeback_inner(
            |nr_pages| WritebackSpec::parse(&value, nr_pages),
            &mut |_| {},
        )?;
        match report.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn writeback_inner(
        &self,
        spec: impl FnOnce(u64) -> Result<WritebackSpec>,
        progress: &mut dyn FnMut(&WritebackProgress),
    ) -> Result<WritebackReport> {
        let inner = self.inner()?;
        let Some(_pp) = self.pp_lock.try_lock() else {
            return Err(Error::new(
                ErrorKind::Again,
                "another writeback is in progress",
            ));
        };
        let Some(wb) = inner.wb.as_ref() else {
            return Err(Error::new(
                ErrorKind::NoDevice,
                "no backing device: set backing_dev before disksize",
            ));
        };
        let nr_pages = inner.slots.len();
        let spec = spec(nr_pages)?;
        spec.check(nr_pages)?;
        let mut ctl = candidates::PpCtl::new(self.page_size_bytes());
        for s in &spec.scans {
            ctl.scan(&inner, s.mode, s.lo, s.hi);
        }
        let batch = (self.wb_batch_size.load(Ordering::Relaxed) as usize).min(MAX_WB_BATCH_SIZE);
        let Some(store) = wb.zoned.as_ref() else {
            let r = batch::run(&inner, wb, &self.wb_limit, &mut ctl, batch, progress);
            ctl.release(&inner);
            return r;
        };
        let r = zoned::run(&inner, wb, &self.wb_limit, &mut ctl, batch, progress);
        ctl.release(&inner);
        let mut report = r?;
        if store.needs_gc() {
            match run_gc(&inner, store) {
                Ok(g) => report.gc_zones_reclaimed = g.zones_reclaimed,
                Err(e) => report.gc_error = Some(e),
            }
        }
        Ok(report)
    }

    /// Runs zoned-store garbage collection now, reclaiming every eligible zone (the `gc`
    /// attribute). Synchronous; runs while reads, writes and writeback go on (one GC at a
    /// time: a second caller waits). `ENODEV` without a zoned backing store; a backing error
    /// (`EIO`) or a full GC zone (`ENOSPC`) stops it with nothing lost and no victim reset
    /// early.
    pub fn gc(&self) -> Result<GcReport> {
        let inner = self.inner()?;
        let store = inner
            .wb
            .as_ref()
            .and_then(|wb| wb.zoned.as_ref())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NoDevice,
                    "gc needs a zoned backing store (backing_layout=zoned and backing_dev)",
                )
            })?;
        run_gc(&inner, store)
    }

    /// The zoned store's counters (`zone_stat`), with the zoned layout.
    pub fn zone_stats(&self) -> Option<crate::zoned::ZoneStats> {
        let inner = self.inner().ok()?;
        let store = inner.wb.as_ref()?.zoned.as_ref()?;
        Some(store.stats())
    }

    /// Checks the zoned store's bookkeeping (panics on a mismatch). For tests (`testing`).
    #[cfg(any(test, feature = "testing"))]
    pub fn debug_check_zones(&self) {
        if let Ok(inner) = self.inner() {
            if let Some(store) = inner.wb.as_ref().and_then(|wb| wb.zoned.as_ref()) {
                store.check();
            }
        }
    }
}

/// Queue depth of GC reads and writes: deep enough that the scratch space, not the queue,
/// bounds the I/O in flight (chunks are extents of live records, down to one record, so 2 MiB
/// of scratch may hold many small ones).
pub const GC_QUEUE_DEPTH: usize = 64;

/// Runs GC over every eligible victim, with a queue of its own on the store's backing.
fn run_gc(inner: &crate::device::Inner, store: &ZoneStore) -> Result<GcReport> {
    let mut queue = store.backing().new_queue(GC_QUEUE_DEPTH)?;
    store.gc(&SlotOwner { inner }, queue.as_mut(), usize::MAX)
}

/// The device as GC sees it: slots point at records through their WB value.
struct SlotOwner<'a> {
    inner: &'a crate::device::Inner,
}

impl crate::zoned::GcOwner for SlotOwner<'_> {
    /// Under the slot lock: if the slot is WB at `old`, point it at `new` (size, flags,
    /// priority and access time kept: a move is not an access) and call `moved`.
    fn repoint(
        &self,
        slot: u64,
        old: crate::zoned::ZoneLoc,
        new: crate::zoned::ZoneLoc,
        moved: &dyn Fn(),
    ) -> bool {
        let mut g = self.inner.slots.lock(crate::slot::SlotIndex(slot));
        let st = g.state();
        if st.wb_location() != Some(old.to_raw()) {
            return false;
        }
        g.set_wb(new.to_raw(), st.size_bytes(), st.flags(), st.prio());
        moved();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Vec<(ModeFilter, u64, u64)>> {
        WritebackSpec::parse(s, 100).map(|w| w.scans.iter().map(|s| (s.mode, s.lo, s.hi)).collect())
    }

    #[test]
    fn parses_zram_syntax() {
        let idle = WritebackMode::Idle.filter();
        let any = ModeFilter::default();
        assert_eq!(p("idle").unwrap(), vec![(idle, 0, 100)]);
        assert_eq!(p("type=huge_idle\n").unwrap().len(), 1);
        assert_eq!(p("page_index=5").unwrap(), vec![(any, 5, 6)]);
        assert_eq!(p("page_indexes=1-10").unwrap(), vec![(any, 1, 11)]);
        assert_eq!(
            p("page_index=1 page_indexes=20-30 page_index=99").unwrap(),
            vec![(any, 1, 2), (any, 20, 31), (any, 99, 100)]
        );
        // A mode after an index scans that index's range, and ends the parsing.
        assert_eq!(
            p("page_index=7 type=idle page_index=9").unwrap(),
            vec![(any, 7, 8), (idle, 7, 8)]
        );
        assert_eq!(p("foo=bar").unwrap(), vec![]);
        assert_eq!(p("").unwrap(), vec![]);
        for (bad, kind) in [
            ("bogus", ErrorKind::InvalidArgument),
            ("type=bogus", ErrorKind::InvalidArgument),
            ("page_index=x", ErrorKind::InvalidArgument),
            ("page_index=100", ErrorKind::OutOfRange),
            ("page_indexes=5", ErrorKind::InvalidArgument),
            ("page_indexes=5-100", ErrorKind::OutOfRange),
            ("page_indexes=9-3", ErrorKind::OutOfRange),
            ("page_indexes=100-101", ErrorKind::OutOfRange),
            ("page_index=99999999999999999999", ErrorKind::OutOfRange),
        ] {
            assert_eq!(p(bad).unwrap_err().kind(), kind, "{bad}");
        }
    }
}
