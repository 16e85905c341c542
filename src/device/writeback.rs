//! The device's writeback and GC entry points (the `writeback` and `gc` attributes): the
//! device's part is its locks and settings (the init lock held shared for the whole run, so
//! `reset` waits for it as zram's does; `pp_lock`, one writeback at a time;
//! `writeback_batch_size`; the writeback limit), the work is [`crate::writeback`]'s on the
//! store.

use super::Device;
use crate::error::{Error, ErrorKind, Result};
use crate::writeback::{
    self, WritebackProgress, WritebackReport, WritebackSpec, MAX_WB_BATCH_SIZE,
};
use crate::zoned::{GcReport, ZoneStats};
use std::sync::atomic::Ordering;

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
        self.run_writeback(|_| Ok(spec.clone()), progress)
    }

    /// The `writeback` attribute: parse, then run.
    pub(crate) fn writeback_str(&self, value: &str) -> Result<()> {
        self.writeback_str_with(value, &mut |_| {})
    }

    /// The `writeback` attribute, calling `progress` as [`Device::writeback_with_progress`]
    /// does.
    pub(crate) fn writeback_str_with(
        &self,
        value: &str,
        progress: &mut dyn FnMut(&WritebackProgress),
    ) -> Result<()> {
        let value = value.strip_suffix('\n').unwrap_or(value).to_string();
        let report =
            self.run_writeback(|nr_pages| WritebackSpec::parse(&value, nr_pages), progress)?;
        match report.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Takes the locks, checks the device can write back, makes the spec for its size and runs
    /// it.
    fn run_writeback(
        &self,
        spec: impl FnOnce(u64) -> Result<WritebackSpec>,
        progress: &mut dyn FnMut(&WritebackProgress),
    ) -> Result<WritebackReport> {
        let store = self.store()?;
        let Some(_pp) = self.pp_lock.try_lock() else {
            return Err(Error::new(
                ErrorKind::Again,
                "another writeback is in progress",
            ));
        };
        if store.target().is_none() {
            return Err(Error::new(
                ErrorKind::NoDevice,
                "no backing device: set backing_dev before disksize",
            ));
        }
        let spec = spec(store.nr_pages())?;
        let batch = (self.wb_batch_size.load(Ordering::Relaxed) as usize).min(MAX_WB_BATCH_SIZE);
        let report = writeback::run(&store, &self.wb_limit, &spec, batch, progress);
        drop(store);
        // The budget it used, for the next process (a kill during the run leaves the budget
        // as it was before the run).
        if self.wb_limit.enabled() {
            self.save_limits();
        }
        report
    }

    /// Runs zoned-store garbage collection now, reclaiming every eligible zone (the `gc`
    /// attribute). Synchronous; runs while reads, writes and writeback go on (one GC at a
    /// time: a second caller waits). `ENODEV` without a zoned backing store; a backing error
    /// (`EIO`) or a full GC zone (`ENOSPC`) stops it with nothing lost and no victim reset
    /// early.
    pub fn gc(&self) -> Result<GcReport> {
        self.store()?.gc()
    }

    /// The zoned store's counters (`zone_stat`), with the zoned layout.
    pub fn zone_stats(&self) -> Option<ZoneStats> {
        self.store().ok()?.zone_stats()
    }

    /// Marks backing blocks allocated as if other slots held them (`testing`), so that a
    /// benchmark can start from a fragmented backing device, as a long-lived bitmap with holes
    /// is (every other block free: no two written blocks adjacent). Returns how many were free.
    /// `ENODEV` without a backing device with the bitmap layout. Never call it outside
    /// benchmarks and tests: the blocks are only given back by `reset`.
    #[cfg(any(test, feature = "testing"))]
    pub fn debug_reserve_backing_blocks(
        &self,
        blocks: impl IntoIterator<Item = u64>,
    ) -> Result<u64> {
        self.store()?.debug_reserve_blocks(blocks)
    }

    /// Writes back and reads back bitmap blocks without their CRC-32C: the baseline `uzram bench
    /// writeback --checksum-cost` measures the checksum against. Call it after `disksize` and
    /// before any writeback; only a `reset` turns checksums back on. Never outside benchmarks:
    /// the device then trusts its backing as kernel zram does. `ENODEV` without a backing
    /// device with the bitmap layout.
    #[cfg(any(test, feature = "testing"))]
    pub fn bench_skip_block_checksums(&self) -> Result<()> {
        self.store()?.bench_skip_block_checksums()
    }

    /// Checks the zoned store's bookkeeping (panics on a mismatch). For tests (`testing`).
    #[cfg(any(test, feature = "testing"))]
    pub fn debug_check_zones(&self) {
        if let Ok(store) = self.store() {
            store.debug_check_zones();
        }
    }
}
