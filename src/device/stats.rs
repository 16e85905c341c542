//! The formats of the statistics attributes (`mm_stat`, `io_stat`, `bd_stat`, `debug_stat`) as
//! the kernel prints them, and of uzram's `meta_stat`. The counters are the store's
//! ([`crate::store`]); a [`StatsSnapshot`] is what [`Device::stats`](super::Device::stats) reads
//! from them, a [`MetaStats`] what [`Device::meta_stats`](super::Device::meta_stats) does.

pub use crate::store::{MetaStats, StatsSnapshot};

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

    /// `bd_checksum_errors` (uzram's own): backing reads (of pages, or of records GC moves) that
    /// failed verification, `"%llu\n"`.
    pub fn bd_checksum_errors(&self) -> String {
        format!("{}\n", self.bd_checksum_errors)
    }

    /// `debug_stat`: `"version: 1\n0 %8llu\n"` (the retired writestall column, then miss_free).
    pub fn debug_stat(&self) -> String {
        format!("version: 1\n0 {:8}\n", self.miss_free)
    }
}

impl MetaStats {
    /// The sum of the device's own columns (the first five: not the server's swap reserve).
    pub fn total_bytes(&self) -> u64 {
        self.slot_table_bytes
            + self.handle_table_bytes
            + self.zspage_meta_bytes
            + self.frame_cache_bytes
            + self.deferred_queue_bytes
    }

    /// `meta_stat`: `slot_table handle_table zspage_meta frame_cache deferred_queue` (the
    /// device's own memory) then `swap_reserve swap_reserve_size swap_reserve_misses` (the
    /// server's swap reserve; 0 when not serving swap), bytes but the last, a count; `%8llu`
    /// each as `mm_stat`.
    pub fn meta_stat(&self) -> String {
        format!(
            "{:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8}\n",
            self.slot_table_bytes,
            self.handle_table_bytes,
            self.zspage_meta_bytes,
            self.frame_cache_bytes,
            self.deferred_queue_bytes,
            self.swap_reserve_bytes,
            self.swap_reserve_size_bytes,
            self.swap_reserve_misses
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
            "       0        0        0        0        0        0        0        0\n"
        );
        let m = MetaStats {
            slot_table_bytes: 8388608,
            handle_table_bytes: 1048576,
            zspage_meta_bytes: 123456,
            frame_cache_bytes: 2097152,
            deferred_queue_bytes: 524288,
            swap_reserve_bytes: 4096,
            swap_reserve_size_bytes: 16777216,
            swap_reserve_misses: 3,
        };
        assert_eq!(
            m.meta_stat(),
            " 8388608  1048576   123456  2097152   524288     4096 16777216        3\n"
        );
        assert_eq!(
            m.total_bytes(),
            8388608 + 1048576 + 123456 + 2097152 + 524288
        );
    }
}
