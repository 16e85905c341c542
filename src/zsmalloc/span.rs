//! Spans: objects larger than a pool page, stored as whole pages plus a tail.
//!
//! The pool's zspages are always made of [`POOL_PAGE_BYTES`] (4 KiB) pages, whatever the
//! device's page size. A pool for 16 or 64 KiB device pages takes objects up to that size; one
//! larger than a pool page is a *span*: `pages` whole pool pages of one frame (its first
//! `pages * 4096` bytes) and, when the rest is not a whole page, a *tail* (the last
//! `size % 4096` bytes) allocated as an ordinary small object of the 4 KiB class table, so it
//! packs with everything else and compaction moves it as any other. A tail that would be huge
//! (`>= huge_class_size` of 4 KiB, 3633 bytes) takes one more whole page instead.
//!
//! Why: zspages built from 16/64 KiB pages left up to 8 device pages half empty per
//! class (123 classes: tens of MiB at 64 KiB), and objects above the large pages' huge threshold
//! took a whole device page. A span wastes nothing but its tail's class rounding.
//!
//! # Locks
//!
//! A span's descriptor (`SpanDesc`, an rwlock over the span's frame and tail handle) is held shared
//! to read the span's pages, exclusive to write them and to install or take out the frame. The
//! span table's mutex (`SpanState`) protects the free span ids, the free handle indices of spans
//! and the counters; it is a leaf (nothing else is taken while it is held). The tail is reached
//! through its own handle, with its class's protocol (`read`/`write` take its migrate lock after
//! the span's descriptor is released or while holding it shared: descriptor → tail migrate lock;
//! compaction never takes a span descriptor, so no cycle). The location word of a span's handle
//! holds the span id in its zspage field and the object size (> 4096, which is how a span is
//! recognised); it is written only under the span table's mutex.

use parking_lot::{Mutex, RwLock};

use super::arena::SegArray;
use super::handle::Handle;
use super::page_alloc::Frame;

/// The page zspages and spans are made of, whatever the device's page size.
pub const POOL_PAGE_BYTES: usize = 4096;

/// A span's memory: `pages` whole pool pages at the start of `frame`, and the tail object.
#[derive(Debug)]
pub(crate) struct SpanObj {
    pub(crate) frame: Frame,
    pub(crate) pages: usize,
    pub(crate) tail: Option<Handle>,
}

/// One span's descriptor; recycled, never freed (so locking a stale one is harmless).
pub(crate) type SpanDesc = RwLock<Option<SpanObj>>;

/// How an object of `size_bytes` (> [`POOL_PAGE_BYTES`]) is split: whole pages and tail bytes
/// (0: none). A tail at least `huge_tail_bytes` (the 4 KiB table's huge threshold) becomes a
/// whole page.
pub(crate) fn split(size_bytes: usize, huge_tail_bytes: usize) -> (usize, usize) {
    let pages = size_bytes / POOL_PAGE_BYTES;
    let tail = size_bytes % POOL_PAGE_BYTES;
    if tail >= huge_tail_bytes {
        (pages + 1, 0)
    } else {
        (pages, tail)
    }
}

/// The span table's bookkeeping (under its mutex).
#[derive(Debug, Default)]
pub(crate) struct SpanState {
    /// Span ids freed, for reuse.
    pub(crate) free_ids: Vec<u32>,
    /// Ids ever handed out; the next fresh id.
    pub(crate) next_id: u32,
    /// Handle indices of freed spans, for reuse.
    pub(crate) free_handles: Vec<u32>,
    /// Spans allocated now.
    pub(crate) spans: u64,
    /// Their whole pages.
    pub(crate) pages: u64,
    /// Spans with a tail object.
    pub(crate) tails: u64,
    /// Bytes of the tails.
    pub(crate) tail_bytes: u64,
}

/// The span table: descriptors and their bookkeeping.
#[derive(Debug, Default)]
pub(crate) struct SpanTable {
    pub(crate) descs: SegArray<SpanDesc, 6>,
    pub(crate) state: Mutex<SpanState>,
}

impl SpanTable {
    /// The descriptor of span `id` (which exists: ids are handed out after their segment).
    pub(crate) fn desc(&self, id: u32) -> &SpanDesc {
        self.descs
            .get(u64::from(id))
            .expect("span id of a live handle has a descriptor")
    }

    /// Heap bytes of the table (descriptors and free lists).
    pub(crate) fn heap_bytes(&self) -> usize {
        let st = self.state.lock();
        self.descs.allocated_bytes()
            + (st.free_ids.capacity() + st.free_handles.capacity()) * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_keeps_small_tails_and_rounds_huge_ones() {
        assert_eq!(split(4097, 3633), (1, 1));
        assert_eq!(split(8192, 3633), (2, 0));
        assert_eq!(split(4096 + 3632, 3633), (1, 3632));
        assert_eq!(split(4096 + 3633, 3633), (2, 0));
        assert_eq!(split(65536, 3633), (16, 0));
        assert_eq!(split(65535, 3633), (16, 0));
        assert_eq!(split(61472, 3633), (15, 32));
    }
}
