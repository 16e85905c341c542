//! Multi-page objects (`multi_page_size`): an aligned group of slots written at once shares one
//! compressed object (the slots' MULTI flag and the group's reference count), its reads served
//! from a per-thread cache of the decompressed object. The life of one is in `docs/design.md`
//! ("The life of a page", step 8).

use super::stats::StoreStats;
use super::{Free, Prepared, Store, MAX_MULTI_PAGES};
use crate::compress::same_filled_word;
use crate::error::Result;
use crate::slot::{SlotFlags, SlotGuard, SlotIndex, SlotState};
use crate::zsmalloc::Handle;
use std::cell::RefCell;
use std::sync::atomic::Ordering;

/// A thread's last decompressed multi-page object, so reads of its neighbouring pages
/// decompress it once: `key` is `(store id, where, multi_frees)` when `group` holds it.
#[derive(Default)]
struct GroupCache {
    key: Option<(u64, GroupWhere, u64)>,
    group: Vec<u8>,
    /// Leading bytes of `group` decompressed (a prefix when the codec could stop early).
    valid_bytes: usize,
    /// The blocks of a written-back object, as read.
    raw: Vec<u8>,
}

/// Where a multi-page object lives: its handle in RAM, or its backing location.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GroupWhere {
    Handle(u64),
    Backing(u64),
}

thread_local! {
    static GROUP_CACHE: RefCell<GroupCache> = RefCell::new(GroupCache::default());
}

impl Store {
    /// Stores an aligned group of [`multi_pages`](Self::multi_pages) pages starting at slot
    /// `first` (a multiple of it), written at once (`data`: the group), compressed as one object
    /// that every slot of the group points into (MULTI). `dst`: at least
    /// `compress_bound(group size)` bytes of scratch. A group whose pages are all same-filled is
    /// stored page by page; one that does not compress below its pages' worth of memory is
    /// stored as raw (HUGE) or same-filled pages, without compressing them again. The
    /// group's slots are locked in ascending order (as every multi-slot path locks them), so
    /// the group replaces them all at once; a failure leaves the old contents.
    pub(crate) fn write_group(
        &self,
        first: SlotIndex,
        data: &[u8],
        dst: &mut [u8],
        limit_pages: u64,
    ) -> Result<()> {
        let n = self.multi_pages;
        let page = self.page_size_bytes;
        debug_assert!(n > 1 && first.0 % n as u64 == 0 && data.len() == n * page);
        let per_page = |dst: &mut [u8]| {
            for (k, p) in data.chunks(page).enumerate() {
                self.write_page(SlotIndex(first.0 + k as u64), p, dst, limit_pages)?;
            }
            Ok(())
        };
        if data.chunks(page).all(|p| same_filled_word(p).is_some()) {
            return per_page(dst);
        }
        let comp_len = self.codecs.primary().compress(data, dst)?;
        if comp_len >= self.huge_group_bytes {
            // Compressing the pages one by one again would be wasted: a page that compressed
            // alone below the huge threshold would save the group at least as much (compressing
            // the whole is no worse than its parts, up to the codec's expansion of the
            // others: zstd stores incompressible blocks raw, lz4 adds a byte per 255), and
            // the group saved less. So its pages are stored raw (HUGE), or same-filled.
            for (k, p) in data.chunks(page).enumerate() {
                let prepared = match same_filled_word(p) {
                    Some(word) => Prepared::Same(word),
                    None => Prepared::Object {
                        handle: self.store_object(p, limit_pages)?,
                        size_bytes: page,
                        huge: true,
                    },
                };
                let mut g = self.slots.lock(SlotIndex(first.0 + k as u64));
                self.publish(&mut g, prepared);
            }
            return Ok(());
        }
        let handle = self.store_object(&dst[..comp_len], limit_pages)?;
        let mut guards: [Option<SlotGuard<'_>>; MAX_MULTI_PAGES] = Default::default();
        for (k, g) in guards.iter_mut().take(n).enumerate() {
            *g = Some(self.slots.lock(SlotIndex(first.0 + k as u64)));
        }
        // Every slot is pointed at the new object first, then what each held is released
        // (a process stopped in between leaves garbage, never a slot naming a freed object:
        // `docs/restart.md`); the group's count still counts the previous object's slots
        // while they are released, so its last one frees it.
        let mut olds: [Option<SlotState>; MAX_MULTI_PAGES] = [None; MAX_MULTI_PAGES];
        let now = self.now_secs();
        for (g, old) in guards.iter_mut().flatten().zip(olds.iter_mut()) {
            *old = Some(g.state());
            g.set_handle(handle.to_raw(), comp_len, SlotFlags::MULTI, 0);
            g.touch(now);
        }
        for (g, old) in guards.iter().flatten().zip(olds) {
            self.release_contents(g.index(), old.expect("set above"), Free::Sync);
        }
        self.group_refs[(first.0 / n as u64) as usize].store(n as u8, Ordering::Relaxed);
        let s = &self.stats;
        StoreStats::add(&s.compr_data_size_bytes, comp_len as u64);
        StoreStats::add(&s.pages_stored, n as u64);
        StoreStats::add(&s.multi_objects, 1);
        StoreStats::add(&s.multi_pages, n as u64);
        Ok(())
    }

    /// Copies page `k` of the multi-page object `handle`, compressed by codec id `codec`, into
    /// `out`, decompressing it unless this thread's [`GroupCache`] holds it. The caller holds the
    /// lock of a slot pointing at it.
    pub(super) fn read_multi(
        &self,
        handle: Handle,
        codec: u8,
        k: usize,
        out: &mut [u8],
    ) -> Result<()> {
        // Loaded after the slot lock was taken: a handle freed and reused since the cache was
        // filled has moved this counter (see `multi_frees`).
        let frees = self.multi_frees.load(Ordering::Acquire);
        self.with_group_cache(
            GroupWhere::Handle(handle.to_raw()),
            frees,
            k,
            out,
            |group, _, want| {
                let codec = self.codecs.get(codec)?;
                self.pool
                    .read(handle, |obj| codec.decompress_prefix(obj, group, want))
            },
        )
    }

    /// Copies page `k` of the multi-page object at `at` into `out`: from this thread's
    /// [`GroupCache`] if it holds the object, as of `frees` (the `multi_frees` seen under the
    /// lock of a slot pointing at it), at least up to that page; else after `fill`
    /// decompressed it into the cache's group buffer (`fill` gets it, a scratch buffer and the
    /// bytes wanted, and returns the leading bytes it made valid).
    ///
    /// A first read of an object decompresses only up to its page (a codec that can stop
    /// early: lz4; a random 4 KiB read then decodes half a group on average); a later read of
    /// the same object past that prefix decompresses it whole, so a sequential pass costs one
    /// page more than a whole decompression, never a decompression per page.
    pub(super) fn with_group_cache(
        &self,
        at: GroupWhere,
        frees: u64,
        k: usize,
        out: &mut [u8],
        fill: impl FnOnce(&mut [u8], &mut Vec<u8>, usize) -> Result<usize>,
    ) -> Result<()> {
        let group_bytes = self.multi_pages * self.page_size_bytes;
        let page = self.page_size_bytes;
        let need = (k + 1) * page;
        GROUP_CACHE.with(|cache| {
            let mut c = cache.borrow_mut();
            let c = &mut *c;
            let key = Some((self.id, at, frees));
            let same = c.key == key;
            if !same || c.valid_bytes < need {
                StoreStats::add(&self.stats.group_cache_misses, 1);
                let want = if same { group_bytes } else { need };
                c.key = None;
                if c.group.len() < group_bytes {
                    c.group.resize(group_bytes, 0);
                }
                c.valid_bytes = fill(&mut c.group[..group_bytes], &mut c.raw, want)?;
                c.key = key;
            } else {
                StoreStats::add(&self.stats.group_cache_hits, 1);
            }
            out.copy_from_slice(&c.group[k * page..need]);
            Ok(())
        })
    }

    /// Whether slot `index` holds a page of a multi-page object in RAM (a look without its
    /// lock, for writeback to choose its path: [`copy_group`](Self::copy_group) decides again).
    pub(crate) fn is_multi(&self, index: SlotIndex) -> bool {
        let st = self.slots.entry(index).state_unlocked();
        st.has(SlotFlags::MULTI) && !st.has(SlotFlags::WB)
    }

    /// The first slot of the multi-page group holding `index`.
    pub(crate) fn group_first(&self, index: SlotIndex) -> SlotIndex {
        SlotIndex(index.0 - index.0 % self.multi_pages as u64)
    }

    /// Locks every slot of the multi-page group starting at `first`, in ascending order (the
    /// order of every path holding several slot locks).
    pub(super) fn lock_group(&self, first: SlotIndex) -> [Option<SlotGuard<'_>>; MAX_MULTI_PAGES] {
        let mut guards: [Option<SlotGuard<'_>>; MAX_MULTI_PAGES] = Default::default();
        for (k, g) in guards.iter_mut().take(self.multi_pages).enumerate() {
            *g = Some(self.slots.lock(SlotIndex(first.0 + k as u64)));
        }
        guards
    }
}
