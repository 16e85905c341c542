//! How far a long operation has got: `done` of `total`, for a determinate progress bar.
//!
//! The long operations (`writeback`, `recompress`, `compact`, `gc`: the attributes a control
//! socket reports progress for) each know a total once they start: writeback and
//! recompression the candidates their scan selected (pages), compaction the pages its size
//! classes could free (the kernel's `zs_can_compact` estimate, summed), GC the zones eligible
//! as victims. [`Device::attr_store_with_progress`] stores such an attribute exactly as
//! [`Device::attr_store`] does (the same parsing, checks and errnos: the attribute functions
//! are shared) while the operation publishes its figures into an [`OpProgress`], which another
//! thread reads whenever it likes. Two atomics: the memory a progress report holds does not
//! grow with the operation.

use super::Device;
use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering};

/// What an operation's `done` and `total` count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressUnit {
    /// Device pages (writeback, recompress) or 4 KiB pool pages (compact).
    Pages,
    /// Zones of the zoned store (gc).
    Zones,
}

impl ProgressUnit {
    /// Its name on the wire and on screen.
    pub fn name(self) -> &'static str {
        match self {
            ProgressUnit::Pages => "pages",
            ProgressUnit::Zones => "zones",
        }
    }

    /// The unit of the long operation `attr`, `None` if it is not one.
    pub fn of(attr: &str) -> Option<ProgressUnit> {
        match attr {
            "writeback" | "recompress" | "compact" => Some(ProgressUnit::Pages),
            "gc" => Some(ProgressUnit::Zones),
            _ => None,
        }
    }
}

/// `done` of `total`, written by the operation's thread, read by any.
///
/// Invariant (as [`get`](Self::get) returns it): `done <= total`. `total` is 0 until the
/// operation has counted its work (and stays 0 when there is none).
#[derive(Debug, Default)]
pub struct OpProgress {
    done: AtomicU64,
    total: AtomicU64,
}

impl OpProgress {
    /// Nothing done of nothing.
    pub fn new() -> OpProgress {
        OpProgress::default()
    }

    /// Publishes `done` of `total`.
    pub fn set(&self, done: u64, total: u64) {
        // Relaxed: the two are independent figures for a person; `get` clamps a torn pair.
        self.total.store(total, Ordering::Relaxed);
        self.done.store(done, Ordering::Relaxed);
    }

    /// The operation succeeded: what it did is all there was to do (`total` becomes `done`:
    /// an estimate such as compaction's, or GC's eligible zones, can be more than the work
    /// turned out to be).
    pub fn finish(&self) {
        let (done, _) = self.get();
        self.set(done, done);
    }

    /// `(done, total)`, with `done <= total`.
    pub fn get(&self) -> (u64, u64) {
        let done = self.done.load(Ordering::Relaxed);
        let total = self.total.load(Ordering::Relaxed);
        (done.min(total), total)
    }
}

impl Device {
    /// Stores `name` as [`attr_store`](Device::attr_store) does; the long operations
    /// (`writeback`, `recompress`, `compact`, `gc`) also publish how far they have got into
    /// `progress` as they run (see the module documentation), and on success end with `done ==
    /// total` ([`OpProgress::finish`]). Other attributes leave it at `(0, 0)`.
    pub fn attr_store_with_progress(
        &self,
        name: &str,
        value: &str,
        progress: &OpProgress,
    ) -> Result<()> {
        let r = self.store_counting(name, value, progress);
        if r.is_ok() {
            progress.finish();
        }
        r
    }

    fn store_counting(&self, name: &str, value: &str, progress: &OpProgress) -> Result<()> {
        match name {
            "writeback" => self.writeback_str_with(value, &mut |p| {
                progress.set(p.written + p.changed + p.failed + p.skipped, p.candidates)
            }),
            "recompress" => self.recompress_str_with(value, &mut |r, max_pages| {
                // `max_pages` counts tries, not skipped candidates: with a budget smaller than
                // the candidates, the bar follows the budget.
                match max_pages {
                    Some(m) if m < r.candidates => progress.set(r.tried, m),
                    _ => progress.set(r.tried + r.skipped, r.candidates),
                }
            }),
            "compact" => super::attrs::store_compact_with(self, &mut |freed, estimate| {
                progress.set(freed, estimate)
            }),
            "gc" => super::attrs::store_gc_with(self, value, &mut |reclaimed, victims| {
                progress.set(reclaimed, victims)
            }),
            _ => self.attr_store(name, value),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_clamped_and_only_long_operations_have_a_unit() {
        let p = OpProgress::new();
        assert_eq!(p.get(), (0, 0));
        p.set(5, 3);
        assert_eq!(p.get(), (3, 3));
        assert_eq!(ProgressUnit::of("gc"), Some(ProgressUnit::Zones));
        assert_eq!(ProgressUnit::of("compact").unwrap().name(), "pages");
        assert_eq!(ProgressUnit::of("disksize"), None);
    }

    /// Writes `n` pages of position-dependent, compressible data.
    fn fill(dev: &Device, n: u64) {
        for i in 0..n {
            let page: Vec<u8> = (0..4096u64).map(|b| ((b / 64 + i) % 7) as u8 * 3).collect();
            dev.write_at(&page, i * 4096).unwrap();
        }
    }

    #[test]
    fn long_operations_end_with_everything_done_and_errors_are_attr_stores() {
        let dev = Device::new_uninit(4096).unwrap();
        // Uninitialised: the same EINVAL as attr_store, nothing counted.
        let p = OpProgress::new();
        let e = dev
            .attr_store_with_progress("compact", "1", &p)
            .unwrap_err();
        assert_eq!(e, dev.attr_store("compact", "1").unwrap_err());
        assert_eq!(p.get(), (0, 0));
        let dir = tempfile::tempdir().unwrap();
        let backing = dir.path().join("backing");
        std::fs::write(&backing, vec![0u8; 4 << 20]).unwrap();
        dev.attr_store("backing_dev", backing.to_str().unwrap())
            .unwrap();
        dev.attr_store("recomp_algorithm", "algo=zstd priority=1")
            .unwrap();
        dev.attr_store("disksize", "4M").unwrap();
        fill(&dev, 512);

        // Compaction after freeing three pages in four: it frees what it estimated.
        for i in (0..512u64).filter(|i| i % 4 != 0) {
            dev.discard(i * 4096, 4096).unwrap();
        }
        let p = OpProgress::new();
        dev.attr_store_with_progress("compact", "1", &p).unwrap();
        let (done, total) = p.get();
        assert!(done > 0 && done == total, "{done} of {total}");

        // Recompression of every idle page: every candidate done; with max_pages, the budget.
        dev.attr_store("idle", "all").unwrap();
        let p = OpProgress::new();
        dev.attr_store_with_progress("recompress", "type=idle max_pages=10", &p)
            .unwrap();
        assert_eq!(p.get(), (10, 10));
        let p = OpProgress::new();
        dev.attr_store_with_progress("recompress", "type=idle", &p)
            .unwrap();
        let (done, total) = p.get();
        assert!(total >= 100 && done == total, "{done} of {total}");

        // Writeback of the idle pages: every candidate done, and they read back identical.
        dev.attr_store("idle", "all").unwrap();
        let p = OpProgress::new();
        dev.attr_store_with_progress("writeback", "idle", &p)
            .unwrap();
        let (done, total) = p.get();
        assert_eq!(total, 128);
        assert_eq!(done, total);
        for i in (0..512u64).filter(|i| i % 4 == 0) {
            let mut got = vec![0u8; 4096];
            dev.read_at(&mut got, i * 4096).unwrap();
            let want: Vec<u8> = (0..4096u64).map(|b| ((b / 64 + i) % 7) as u8 * 3).collect();
            assert_eq!(got, want, "page {i}");
        }
        // A bad value: attr_store's errno.
        let p = OpProgress::new();
        let e = dev
            .attr_store_with_progress("writeback", "sideways", &p)
            .unwrap_err();
        assert_eq!(e, dev.attr_store("writeback", "sideways").unwrap_err());
        // gc without a zoned store: ENODEV, as attr_store.
        let e = dev.attr_store_with_progress("gc", "1", &p).unwrap_err();
        assert_eq!(e, dev.attr_store("gc", "1").unwrap_err());
        // Not a long operation: stored, no progress.
        let p = OpProgress::new();
        dev.attr_store_with_progress("mem_limit", "1M", &p).unwrap();
        assert_eq!(p.get(), (0, 0));
    }
}
