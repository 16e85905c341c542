//! Writeback: moving pages from RAM to a backing device (zram's `CONFIG_ZRAM_WRITEBACK`).
//!
//! # Parts
//! - [`WritebackSpec`]: what to write back, parsed from the `writeback` attribute's syntax
//!   (`idle`, `huge`, `huge_idle`, `incompressible`, `type=<mode>`, `page_index=N`,
//!   `page_indexes=A-B`, several in one write).
//! - `candidates`: the scan that marks PP_SLOT and buckets slots by size, largest first.
//! - `engine`: the batched engine, one core for both writeback targets: limit charge and
//!   refund, the requests in flight by op tag, the reap loop, progress, error sorting. What
//!   differs is where pages go, a `Placement`: `extents` (the bitmap target: a block per page,
//!   adjacent blocks written as one vectored write) or `stages` (the zoned target: records
//!   appended by the zone writer, written in large sequential stages).
//! - [`WbLimit`]: `writeback_limit` / `writeback_limit_enable`, charged at submission.
//! - The slot-state changes (PP_SLOT, copying a candidate, pointing a slot at its backing
//!   location) and read-back are the [store](crate::store)'s; so are the targets.
//!
//! # State and locks
//! - The writeback target is part of the store: built from the `backing_dev` setting by
//!   `disksize`, dropped by `reset`. The device holds its init lock shared for a writeback's
//!   whole run, so `reset` waits for it, as zram's does.
//! - One post-processing operation runs at a time (the device's `pp_lock`, zram's
//!   `pp_in_progress`); a second `writeback` fails with `EAGAIN`.
//! - Lock order: init lock → slot lock → {allocator locks, target lock, limit lock}. The
//!   target's and the limit's locks are leaves. No slot lock is held while waiting for I/O:
//!   the engine copies under the lock and writes after dropping it; read-back pins the
//!   location under the lock and reads after dropping it.

mod engine;
mod extents;
mod limit;
mod stages;

pub use crate::pp::ModeFilter;
pub use crate::store::BackingLayout;
pub use limit::{units_per_page, Charge, WbLimit};

use crate::backing::MAX_QUEUE_DEPTH;
use crate::error::{Error, ErrorKind, Result};
use crate::store::{Store, WbTarget};
use crate::units::kstrtou64;

/// The default `writeback_batch_size`: upstream zram's (32 requests in flight).
pub const DEFAULT_WB_BATCH_SIZE: u32 = 32;

/// The largest pool a writeback uses: a larger `writeback_batch_size` is accepted (as the
/// kernel accepts any `u32`) but capped here, the deepest queue the backing layer makes
/// (16 MiB of request buffers with 4 KiB pages).
pub const MAX_WB_BATCH_SIZE: usize = MAX_QUEUE_DEPTH;

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
    /// Candidates skipped before submission (accessed or freed since the scan).
    pub skipped: u64,
    /// Requests in flight.
    pub in_flight: u64,
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
            skipped: self.skipped,
            in_flight: in_flight as u64,
        }
    }
}

/// Writes back the slots `spec` selects from `store` with a pool of `batch` requests (the
/// zoned target: up to `batch` stage writes in flight, at most 16), charging `limit`, and
/// calls `progress` after every batch of completions. With the zoned target, GC runs after the
/// pass when the store is short of empty zones. `Err` only for what is found before any work:
/// `ENODEV` without a target, `ERANGE` for a scan outside the store; failures of the run are
/// in the report's `error`. The caller holds the device's init lock shared and `pp_lock`.
pub(crate) fn run(
    store: &Store,
    limit: &WbLimit,
    spec: &WritebackSpec,
    batch: usize,
    progress: &mut dyn FnMut(&WritebackProgress),
) -> Result<WritebackReport> {
    let Some(target) = store.target() else {
        return Err(Error::new(
            ErrorKind::NoDevice,
            "no backing device: set backing_dev before disksize",
        ));
    };
    spec.check(store.nr_pages())?;
    let mut ctl = crate::pp::PpCtl::new(store.page_size_bytes());
    for s in &spec.scans {
        ctl.scan(store, s.mode, s.lo, s.hi);
    }
    let r = match target {
        WbTarget::Bitmap(t) => {
            let placement = extents::Extents::new(t, batch)?;
            engine::run(store, target, limit, &mut ctl, placement, progress)
        }
        WbTarget::Zoned(t) => {
            let placement = stages::Stages::new(t, batch, store.page_size_bytes())?;
            engine::run(store, target, limit, &mut ctl, placement, progress)
        }
    };
    ctl.release(store);
    let mut report = r?;
    if store.needs_gc() {
        match store.gc() {
            Ok(g) => report.gc_zones_reclaimed = g.zones_reclaimed,
            Err(e) => report.gc_error = Some(e),
        }
    }
    Ok(report)
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
