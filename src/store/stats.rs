//! The store's counters (zram's `struct zram_stats`) and the snapshots `mm_stat`, `io_stat`,
//! `bd_stat`, `debug_stat` and `meta_stat` are made from (their formats are the device's, in
//! `device::stats`).
//!
//! Counters are lock-free atomics updated on the I/O paths. Each is exact once the operations
//! that change it have returned: a slot's counters change under the slot's lock together with
//! the slot, so a quiescent store's `mm_stat` is consistent.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of a store. Reset drops them with the store.
#[derive(Debug, Default)]
pub(crate) struct StoreStats {
    /// Bytes of compressed data held in the pool (sum of stored object sizes).
    pub(crate) compr_data_size_bytes: AtomicU64,
    /// Slots holding data (in RAM, same-filled or written back).
    pub(crate) pages_stored: AtomicU64,
    /// Slots holding a same-filled page.
    pub(crate) same_pages: AtomicU64,
    /// Slots stored raw (HUGE) right now.
    pub(crate) huge_pages: AtomicU64,
    /// HUGE pages stored since the device was initialised.
    pub(crate) huge_pages_since: AtomicU64,
    /// Reads that failed.
    pub(crate) failed_reads: AtomicU64,
    /// Writes that failed (no memory, mem_limit, codec error).
    pub(crate) failed_writes: AtomicU64,
    /// Slot frees notified by a swap frontend.
    pub(crate) notify_free: AtomicU64,
    /// Free notifications that found the slot busy (zram's `miss_free`).
    pub(crate) miss_free: AtomicU64,
    /// Highest `mem_used_total` seen, in pool pages of 4 KiB (`mem_used_max`).
    pub(crate) max_used_pages: AtomicU64,
    /// Pages read back from the backing device (zram's `bd_reads`).
    pub(crate) bd_reads: AtomicU64,
    /// Pages written to the backing device (zram's `bd_writes`).
    pub(crate) bd_writes: AtomicU64,
    /// Pages recompression tried a secondary codec on (`recomp_stat`).
    pub(crate) recomp_tried: AtomicU64,
    /// Pages recompression replaced with a smaller object (`recomp_stat`).
    pub(crate) recomp_done: AtomicU64,
    /// Pages recompression marked INCOMPRESSIBLE (`recomp_stat`).
    pub(crate) recomp_incompressible: AtomicU64,
    /// Multi-page objects stored (`multi_page_size`).
    pub(crate) multi_objects: AtomicU64,
    /// Slots pointing into them.
    pub(crate) multi_pages: AtomicU64,
    /// Multi-page objects on the backing device (written back whole), the pages of their
    /// groups pointing at them, and the page-sized blocks they take (in `bd_count`).
    pub(crate) multi_wb_objects: AtomicU64,
    pub(crate) multi_wb_pages: AtomicU64,
    pub(crate) multi_wb_blocks: AtomicU64,
    /// Reads of a page of a multi-page object served by the thread's group cache, and those that
    /// decompressed (a prefix of) the object.
    pub(crate) group_cache_hits: AtomicU64,
    pub(crate) group_cache_misses: AtomicU64,
}

impl StoreStats {
    /// Adds `n` to `counter`.
    #[inline]
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
    /// Subtracts `n` from `counter`; underflow is a bookkeeping bug.
    #[inline]
    pub(crate) fn sub(counter: &AtomicU64, n: u64) {
        let prev = counter.fetch_sub(n, Ordering::Relaxed);
        debug_assert!(prev >= n, "store counter underflow");
    }
    /// Reads a counter.
    #[inline]
    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
    /// Raises `max_used_pages` to `pages` if higher.
    pub(crate) fn update_max_used(&self, pages: u64) {
        self.max_used_pages.fetch_max(pages, Ordering::Relaxed);
    }
}

/// A snapshot of everything `mm_stat`, `io_stat`, `bd_stat` and `debug_stat` show.
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
    /// Pages recompression tried a secondary codec on, since initialisation.
    pub recomp_tried: u64,
    /// Pages recompression replaced with a smaller object, since initialisation.
    pub recomp_done: u64,
    /// Pages recompression marked INCOMPRESSIBLE (no codec shrank them), since
    /// initialisation.
    pub recomp_incompressible: u64,
    /// Backing reads whose data failed verification (a block's CRC-32C, a zoned record's magic,
    /// slot, length or CRC-32C): page reads, each refused with `EIO`, and zoned GC's reads of
    /// the records it moves (`bd_checksum_errors`).
    pub bd_checksum_errors: u64,
    /// Multi-page objects stored now (`multi_page_size`; `multi_stat`'s first column).
    pub multi_objects: u64,
    /// Pages (slots) pointing into them: counted in `pages_stored`, their objects' bytes once
    /// in `compr_data_size` (`multi_stat`'s second column).
    pub multi_pages: u64,
    /// Multi-page objects written back whole (`multi_stat`'s third column).
    pub multi_wb_objects: u64,
    /// Pages pointing at them (`multi_stat`'s fourth column; in `pages_stored`).
    pub multi_wb_pages: u64,
    /// Page-sized blocks they take on the backing device (`multi_stat`'s fifth column; in
    /// `bd_count`, in device pages).
    pub multi_wb_blocks: u64,
    /// Reads of a page of a multi-page object served by the reading thread's cache of its last
    /// decompressed object (`multi_stat`'s sixth column).
    pub group_cache_hits: u64,
    /// Reads that decompressed the object, or the prefix of it up to their page
    /// (`multi_stat`'s seventh column).
    pub group_cache_misses: u64,
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
    /// Serving swap: the server's swap reserve (one for all its devices, so the same on each,
    /// and not part of [`total_bytes`](Self::total_bytes)): bytes faulted in and waiting now.
    pub swap_reserve_bytes: u64,
    /// Serving swap: the swap reserve's size (`--swap-reserve`).
    pub swap_reserve_size_bytes: u64,
    /// Serving swap: new zspages (of every device of the server) the swap reserve had no frame
    /// for at once, ever; each writer waited for the refiller and failed if none came.
    pub swap_reserve_misses: u64,
}
