//! Device statistics (zram's `struct zram_stats`) and their kernel output formats.
//!
//! Counters are lock-free atomics updated on the I/O paths. Each is exact once the operations
//! that change it have returned: a slot's counters change under the slot's lock together with
//! the slot, so a quiescent device's `mm_stat` is consistent.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of an initialised device. Reset drops them with the device's contents.
#[derive(Debug, Default)]
pub struct DeviceStats {
    /// Bytes of compressed data held in the pool (sum of stored object sizes).
    pub compr_data_size_bytes: AtomicU64,
    /// Slots holding data (in RAM, same-filled or written back).
    pub pages_stored: AtomicU64,
    /// Slots holding a same-filled page.
    pub same_pages: AtomicU64,
    /// Slots stored raw (HUGE) right now.
    pub huge_pages: AtomicU64,
    /// HUGE pages stored since the device was initialised.
    pub huge_pages_since: AtomicU64,
    /// Reads that failed.
    pub failed_reads: AtomicU64,
    /// Writes that failed (no memory, mem_limit, codec error).
    pub failed_writes: AtomicU64,
    /// Slot frees notified by a swap frontend.
    pub notify_free: AtomicU64,
    /// Free notifications that found the slot busy (zram's `miss_free`).
    pub miss_free: AtomicU64,
    /// Highest `mem_used_total` seen, in pages (`mem_used_max`).
    pub max_used_pages: AtomicU64,
}

impl DeviceStats {
    /// Adds `n` to `counter`.
    #[inline]
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
    /// Subtracts `n` from `counter`; underflow is a bookkeeping bug.
    #[inline]
    pub fn sub(counter: &AtomicU64, n: u64) {
        let prev = counter.fetch_sub(n, Ordering::Relaxed);
        debug_assert!(prev >= n, "device counter underflow");
    }
    /// Reads a counter.
    #[inline]
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
    /// Raises `max_used_pages` to `pages` if higher.
    pub fn update_max_used(&self, pages: u64) {
        self.max_used_pages.fetch_max(pages, Ordering::Relaxed);
    }
}

/// A snapshot of everything `mm_stat`, `io_stat` and `debug_stat` show.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    /// Uncompressed size of the data stored (pages_stored × page size).
    pub orig_data_size_bytes: u64,
    /// Compressed size of the data in the pool.
    pub compr_data_size_bytes: u64,
    /// Memory the pool holds, including fragmentation.
    pub mem_used_total_bytes: u64,
    /// The memory limit (0: none).
    pub mem_limit_bytes: u64,
    /// Highest `mem_used_total` seen.
    pub mem_used_max_bytes: u64,
    /// Same-filled pages stored.
    pub same_pages: u64,
    /// Pages freed by compaction.
    pub pages_compacted: u64,
    /// Raw-stored pages now.
    pub huge_pages: u64,
    /// Raw-stored pages since initialisation.
    pub huge_pages_since: u64,
    /// Failed reads.
    pub failed_reads: u64,
    /// Failed writes.
    pub failed_writes: u64,
    /// Swap free notifications.
    pub notify_free: u64,
    /// Free notifications that missed.
    pub miss_free: u64,
    /// Slots holding data.
    pub pages_stored: u64,
    /// Backing blocks in use, in 4 KiB units (`bd_stat`'s first column).
    pub bd_count: u64,
    /// Pages read back from the backing device, in 4 KiB units.
    pub bd_reads: u64,
    /// Pages written to the backing device, in 4 KiB units.
    pub bd_writes: u64,
}

impl StatsSnapshot {
    /// `mm_stat`: nine columns, the kernel's `"%8llu %8llu %8llu %8lu %8ld %8llu %8lu %8llu %8llu\n"`.
    pub fn mm_stat(&self) -> String {
        format!(
            "{:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8}\n",
            self.orig_data_size_bytes,
            self.compr_data_size_bytes,
            self.mem_used_total_bytes,
            self.mem_limit_bytes,
            self.mem_used_max_bytes,
            self.same_pages,
            self.pages_compacted,
            self.huge_pages,
            self.huge_pages_since
        )
    }

    /// `io_stat`: `failed_reads failed_writes 0 notify_free` (the third column, invalid_io, is
    /// always 0 in current kernels), format `"%8llu %8llu 0 %8llu\n"`.
    pub fn io_stat(&self) -> String {
        format!(
            "{:8} {:8} 0 {:8}\n",
            self.failed_reads, self.failed_writes, self.notify_free
        )
    }

    /// `bd_stat`: `bd_count bd_reads bd_writes` in 4 KiB units, `"%8llu %8llu %8llu\n"`.
    pub fn bd_stat(&self) -> String {
        format!(
            "{:8} {:8} {:8}\n",
            self.bd_count, self.bd_reads, self.bd_writes
        )
    }

    /// `debug_stat`: `"version: 1\n0 %8llu\n"` (the retired writestall column, then miss_free).
    pub fn debug_stat(&self) -> String {
        format!("version: 1\n0 {:8}\n", self.miss_free)
    }
}

/// What `meta_stat` shows: the device's memory besides `mem_used_total` (the pool's zspages), in
/// bytes. uzram's own; see `docs/attributes.md`. All 0 when uninitialised.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MetaStats {
    /// The slot table: 16 bytes per page of `disksize`, fixed while initialised.
    pub slot_table_bytes: u64,
    /// The allocator's handle table ([`PoolMeta::handle_table_bytes`](crate::zsmalloc::PoolMeta)).
    pub handle_table_bytes: u64,
    /// The allocator's zspage bookkeeping ([`PoolMeta::zspage_meta_bytes`](crate::zsmalloc::PoolMeta)).
    pub zspage_meta_bytes: u64,
    /// Freed zspages' frames kept resident for reuse (at most 2 MiB; `compact` empties it).
    pub frame_cache_bytes: u64,
    /// The deferred-free queue's buffers when full.
    pub deferred_queue_bytes: u64,
}

impl MetaStats {
    /// The sum of the columns.
    pub fn total_bytes(&self) -> u64 {
        self.slot_table_bytes
            + self.handle_table_bytes
            + self.zspage_meta_bytes
            + self.frame_cache_bytes
            + self.deferred_queue_bytes
    }

    /// `meta_stat`: `slot_table handle_table zspage_meta frame_cache deferred_queue`, bytes,
    /// `%8llu` each as `mm_stat`.
    pub fn meta_stat(&self) -> String {
        format!(
            "{:8} {:8} {:8} {:8} {:8}\n",
            self.slot_table_bytes,
            self.handle_table_bytes,
            self.zspage_meta_bytes,
            self.frame_cache_bytes,
            self.deferred_queue_bytes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_match_the_kernel() {
        // Strings read from a real /sys/block/zram0 (kernel 6.18) in its initial state.
        let s = StatsSnapshot::default();
        assert_eq!(
            s.mm_stat(),
            "       0        0        0        0        0        0        0        0        0\n"
        );
        assert_eq!(s.io_stat(), "       0        0 0        0\n");
        assert_eq!(s.debug_stat(), "version: 1\n0        0\n");
        assert_eq!(s.bd_stat(), "       0        0        0\n");
        let s = StatsSnapshot {
            orig_data_size_bytes: 2449408,
            compr_data_size_bytes: 1553423,
            mem_used_total_bytes: 2543616,
            mem_used_max_bytes: 2543616,
            same_pages: 1,
            huge_pages: 14,
            huge_pages_since: 14,
            ..Default::default()
        };
        assert_eq!(
            s.mm_stat(),
            " 2449408  1553423  2543616        0  2543616        1        0       14       14\n"
        );
    }

    #[test]
    fn meta_stat_format() {
        assert_eq!(
            MetaStats::default().meta_stat(),
            "       0        0        0        0        0\n"
        );
        let m = MetaStats {
            slot_table_bytes: 8388608,
            handle_table_bytes: 1048576,
            zspage_meta_bytes: 123456,
            frame_cache_bytes: 2097152,
            deferred_queue_bytes: 524288,
        };
        assert_eq!(
            m.meta_stat(),
            " 8388608  1048576   123456  2097152   524288\n"
        );
        assert_eq!(
            m.total_bytes(),
            8388608 + 1048576 + 123456 + 2097152 + 524288
        );
    }
}
