//! The store: an initialised device's pages, zram's `struct zram` minus its settings.
//!
//! A [`Store`] owns the slot table, the allocator pool, the codec, the counters and the
//! writeback target, all private. Every change of a slot's state is one of its methods, made
//! under the slot's lock, one file per concept:
//!
//! - the page paths (this file): [`prepare`](Store::prepare) (compress and allocate, outside the lock) then
//!   publish ([`write_page`](Store::write_page)), [`read_page`](Store::read_page),
//!   [`write_partial`](Store::write_partial) (read-modify-write), [`release`](Store::release)
//!   and [`free_page`](Store::free_page) (zram's `zram_free_page`, with the allocator object
//!   freed at once or through the deferred-free queue);
//! - idle marking ([`mark_idle`](Store::mark_idle));
//! - multi-page objects (`multi.rs`): [`write_group`](Store::write_group) and the reads of a shared
//!   object through the per-thread cache;
//! - post-processing's steps (`pp.rs`): [`mark_pp`](Store::mark_pp) and
//!   [`clear_pp`](Store::clear_pp) (the PP_SLOT ticket), [`copy_candidate`](Store::copy_candidate),
//!   and [`finish_writeback`](Store::finish_writeback), which frees the object and points the
//!   slot at its backing location (`set_written_back`); the same for a multi-page object;
//! - recompression's step (`recompress.rs`): a candidate replaced by a smaller object;
//! - GC (`gc.rs`): running it, and [`repoint`](crate::zoned::GcOwner::repoint) of a slot to a
//!   relocated record.
//!
//! The layers: `device` (settings, the init lock, attributes, request splitting),
//! `writeback` (the batched engine), `recompress` and `pp` (the candidate scan) call the store; the store calls
//! [`slot`](crate::slot), [`zsmalloc`](crate::zsmalloc), [`compress`](crate::compress) and its
//! writeback target ([`WbTarget`]: the bitmap store or the [zoned store](crate::zoned) over a
//! [backing device](crate::backing)). Nothing here knows about requests, attributes or
//! writeback's engine.
//!
//! # Read-back of written-back (WB) slots
//!
//! No slot lock is held across backing I/O. A read of a WB slot pins the slot's location under
//! the slot lock (so a block cannot be reused, nor a record's zone reset, while it is read:
//! [`WbTarget::pin`]), drops the lock, reads (decompressing when the location holds a
//! compressed object) and counts `bd_reads`. A failed backing read fails the read with `EIO` and
//! changes nothing. A partial write of a WB slot reads the location the same way, then retakes
//! the slot lock and goes on only if the slot still points at that location (a pinned location
//! cannot come back to the slot, so this check is exact); otherwise it starts over.
//!
//! # Locks
//!
//! The store adds none of its own. Lock order: slot lock → {allocator locks, the bitmap's
//! mutex, the zone store's `zones` mutex}, all leaves here. The caller (the device) holds the
//! init lock shared around every call; writeback's caller holds `pp_lock` too.

mod bitmap;
mod codecs;
mod gc;
mod multi;
mod pp;
mod recompress;
mod restore;
mod stats;
mod target;
mod train_dict;

pub use codecs::GenStat;
use multi::GroupWhere;
pub(crate) use recompress::Outcome;
pub use restore::{RecoveryReport, StoreFiles};
pub use stats::{MetaStats, StatsSnapshot};
pub(crate) use train_dict::NewGeneration;
pub use train_dict::{TrainReport, TrainSpec};

pub(crate) use codecs::{Codecs, SavedGens};
pub use target::BackingLayout;

pub(crate) use bitmap::BlockIndex;
pub(crate) use target::{BitmapTarget, WbTarget, ZonedTarget};

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::compress::{fill_same, same_filled_word};
#[cfg(any(test, feature = "testing"))]
use crate::error::ErrorKind;
use crate::error::{Error, Result};
use crate::slot::{SlotFlags, SlotGuard, SlotIndex, SlotState, SlotTable};
use crate::units::units_per_page;
use crate::zsmalloc::{DeferredStats, Handle, PoolStats, ZsPool, POOL_PAGE_BYTES};
use crate::Allocation;
use stats::StoreStats;
use target::WbPin;

/// Most pages a multi-page object spans (64 KiB of 4 KiB pages).
pub(crate) const MAX_MULTI_PAGES: usize = 16;

/// Which slots [`Store::mark_idle`] marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleCutoff {
    /// Every slot with data in RAM (`idle all`).
    All,
    /// Slots not accessed for at least this many seconds (`idle <seconds>`); slots accessed
    /// more recently get the mark cleared, as the kernel does.
    OlderThanSecs(u64),
}

/// How a release frees the slot's allocator object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Free {
    /// `PoolCore::free` (overwrites, write-zeroes, every path but the release paths).
    Sync,
    /// `ZsPool::free_deferred`: release paths (discard, free notifications).
    Deferred,
}

/// A page made ready for a slot outside its lock ([`Store::prepare`]).
#[derive(Debug)]
pub(crate) enum Prepared {
    /// A same-filled page: the word.
    Same(u64),
    /// A pool object holding the page compressed, or raw when `huge`.
    Object {
        handle: Handle,
        size_bytes: usize,
        huge: bool,
    },
}

/// What [`Store::copy_candidate`] copied out of a writeback candidate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Copied {
    /// The object's handle: the slot must still hold it when the write completes.
    pub(crate) handle: u64,
    /// Bytes copied to the start of the buffer: the object's size, or a page when decompressed.
    pub(crate) len_bytes: usize,
    /// The codec the object was compressed with (priority and generation, as the slot says).
    pub(crate) codec: u8,
    /// Whether the object is a raw page (HUGE).
    pub(crate) huge: bool,
}

/// An initialised device's contents. See the module docs.
#[derive(Debug)]
pub(crate) struct Store {
    page_size_bytes: usize,
    slots: SlotTable,
    pool: ZsPool,
    /// The primary codec and the recompression codecs (`recomp_algorithm`) with their
    /// dictionary generations; a slot's codec id names one.
    codecs: Codecs,
    /// Pages whose compressed size is at least this are stored raw (HUGE): the smallest size
    /// class holding one object per zspage, where compression saves nothing.
    huge_threshold_bytes: usize,
    /// Pages per multi-page object (`multi_page_size / page size`; 1: off).
    multi_pages: usize,
    /// A group compressed to at least this many bytes saves nothing as one object (it would cost
    /// its pages' worth of memory): stored page by page instead.
    huge_group_bytes: usize,
    /// Per aligned group of `multi_pages` slots: how many of them point at the group's
    /// multi-page object (at most one lives per group). Changed only by a holder of the lock
    /// of a slot that points at it (decrement) or of every slot of the group (set); the
    /// decrement that reaches 0 frees the object. Empty when multi-page objects are off.
    group_refs: Box<[AtomicU8]>,
    /// Multi-page objects freed so far: bumped (`Release`) before each is freed, so a
    /// per-thread cache of a decompressed object ([`GroupCache`]) is valid only while this has
    /// not moved (a freed handle may come back for another object).
    multi_frees: AtomicU64,
    /// This store's identity, for the per-thread caches.
    id: u64,
    stats: StoreStats,
    /// Where writeback puts pages, when a backing device was set before initialisation.
    target: Option<WbTarget>,
    /// Where slots' access times come from (the device's clock).
    clock: Arc<dyn Clock>,
    /// The clock's reading at initialisation: time zero for slots' access times.
    epoch: Duration,
}

/// Testing: every store of the process publishes a page's slot before copying its object's
/// bytes (see `Store::write_page_publishing_first`).
#[cfg(any(test, feature = "testing"))]
static PUBLISH_BEFORE_COPY: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Testing: makes every store of this process publish a page's slot before its object's
/// bytes are copied (`on`), the ordering bug the crash model test's canary must catch.
#[cfg(any(test, feature = "testing"))]
pub fn set_publish_before_copy(on: bool) {
    PUBLISH_BEFORE_COPY.store(on, Ordering::Relaxed);
}

/// A new store's identity (for the per-thread caches).
fn next_store_id() -> u64 {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Where a slot's page comes from, as seen under its lock.
pub(crate) enum Source<'a> {
    /// Already in the output buffer.
    Done,
    /// On the backing device: read through the pin after dropping the slot lock. With the
    /// value of `multi_frees` seen under the lock (for a multi-page object's cache key).
    Backing(WbPin<'a>, SlotState, u64),
}

impl Store {
    /// A store of `nr_pages` empty slots of `page_size_bytes`, compressing with `codecs`
    /// (the primary at priority 0, recompression codecs above) into `pool`, writing back into
    /// `target`; aligned groups of `multi_pages` pages written at once are stored as one object
    /// (`multi_page_size`; 1: off). The pool must take objects of a group's size. Access times
    /// are seconds of `clock` since now. A pool serving swap (`ZsPool::with_swap_reserve`)
    /// makes the slot table faulted in now, and the first of the handle table's words (the
    /// reserve's refiller faults in the others ahead of need).
    pub(crate) fn with_multi_pages(
        page_size_bytes: usize,
        multi_pages: usize,
        nr_pages: u64,
        codecs: Codecs,
        pool: ZsPool,
        target: Option<WbTarget>,
        clock: Arc<dyn Clock>,
    ) -> Result<Store> {
        let slots = SlotTable::with_faulting(nr_pages, pool.serves_swap())?;
        if pool.serves_swap() {
            // The handle table's words are faulted in ahead of need as objects are stored.
            pool.keep_handles_ahead();
        }
        let multi_pages = multi_pages.max(1);
        if multi_pages > 1 && pool.page_size_bytes() < multi_pages * page_size_bytes {
            return Err(Error::invalid("the pool cannot hold multi-page objects"));
        }
        // Where an object costs as much as the raw pages (see `huge_class_size_bytes`).
        let huge =
            |bytes: usize| bytes - POOL_PAGE_BYTES + pool.class_table().huge_class_size_bytes();
        let groups = if multi_pages > 1 {
            nr_pages / multi_pages as u64
        } else {
            0
        };
        Ok(Store {
            page_size_bytes,
            huge_threshold_bytes: huge(page_size_bytes),
            multi_pages,
            huge_group_bytes: huge(multi_pages * page_size_bytes),
            group_refs: (0..groups).map(|_| AtomicU8::new(0)).collect(),
            multi_frees: AtomicU64::new(0),
            id: next_store_id(),
            slots,
            pool,
            codecs,
            stats: StoreStats::default(),
            target,
            epoch: clock.now(),
            clock,
        })
    }

    /// The page size.
    pub(crate) fn page_size_bytes(&self) -> usize {
        self.page_size_bytes
    }

    /// Pages per multi-page object (1: off).
    pub(crate) fn multi_pages(&self) -> usize {
        self.multi_pages
    }

    /// Pages (slots) in the store.
    pub(crate) fn nr_pages(&self) -> u64 {
        self.slots.len()
    }

    /// The store's size in bytes: pages × page size.
    pub(crate) fn size_bytes(&self) -> u64 {
        self.slots.len() * self.page_size_bytes as u64
    }

    /// Seconds since initialisation, for slots' access times.
    #[inline]
    fn now_secs(&self) -> u32 {
        let since = self.clock.now().saturating_sub(self.epoch);
        u32::try_from(since.as_secs()).unwrap_or(u32::MAX)
    }

    // ---------------------------------------------------------------------------------------
    // The page paths.

    /// Reads page `index` into `out` (one page); `scratch` (a page) holds a written-back block
    /// that needs decompressing. An access: clears IDLE and PP_SLOT.
    pub(crate) fn read_page(
        &self,
        index: SlotIndex,
        out: &mut [u8],
        scratch: &mut [u8],
    ) -> Result<()> {
        let mut g = self.slots.lock(index);
        g.touch(self.now_secs());
        let source = self.read_slot(&g, out);
        drop(g);
        match source? {
            Source::Done => Ok(()),
            Source::Backing(pin, st, frees) => {
                self.read_backing(index, &pin, st, frees, out, scratch)
            }
        }
    }

    /// Compresses `page` and stores it in the pool, outside any slot lock (`dst`: at least
    /// `compress_bound(page size)` bytes of scratch). `ENOMEM` when the pool is over
    /// `limit_pages` (0: no limit) after the allocation, as zram checks; nothing is held then.
    pub(crate) fn prepare(
        &self,
        page: &[u8],
        dst: &mut [u8],
        limit_pages: u64,
    ) -> Result<Prepared> {
        if let Some(word) = same_filled_word(page) {
            return Ok(Prepared::Same(word));
        }
        let comp_len = self.codecs.primary().compress(page, dst)?;
        let (src, huge) = if comp_len >= self.huge_threshold_bytes {
            (page, true)
        } else {
            (&dst[..comp_len], false)
        };
        let handle = self.store_object(src, limit_pages)?;
        Ok(Prepared::Object {
            handle,
            size_bytes: src.len(),
            huge,
        })
    }

    /// Allocates an object for `src` and copies it in. `ENOMEM` when the pool is over
    /// `limit_pages` (device pages; 0: no limit) after the allocation, as zram checks.
    fn store_object(&self, src: &[u8], limit_pages: u64) -> Result<Handle> {
        let handle = self.pool.malloc(src.len())?;
        // As zram: allocate, then check the pool against the limit; over it, give the object
        // back. The pool counts 4 KiB pages; the limit is in device pages.
        let limit_pages = limit_pages * (self.page_size_bytes / POOL_PAGE_BYTES) as u64;
        let mut total_pages = self.pool.total_pages();
        self.stats.update_max_used(total_pages);
        if limit_pages != 0 && total_pages > limit_pages && self.pool.deferred_stats().pending > 0 {
            // Objects of released pages still hold memory: free them before refusing the write.
            self.pool.flush();
            total_pages = self.pool.total_pages();
        }
        if limit_pages != 0 && total_pages > limit_pages {
            self.pool.free(handle);
            return Err(Error::no_memory(format!(
                "mem_limit reached ({limit_pages} pages)"
            )));
        }
        self.pool.write(handle, src);
        Ok(handle)
    }

    /// Stores a whole page: [`prepare`](Self::prepare)s it outside the slot lock, then
    /// publishes it under the lock, freeing what the slot held. A failure leaves the old
    /// contents.
    pub(crate) fn write_page(
        &self,
        index: SlotIndex,
        page: &[u8],
        dst: &mut [u8],
        limit_pages: u64,
    ) -> Result<()> {
        #[cfg(any(test, feature = "testing"))]
        if PUBLISH_BEFORE_COPY.load(Ordering::Relaxed) {
            return self.write_page_publishing_first(index, page, dst, limit_pages);
        }
        let prepared = self.prepare(page, dst, limit_pages)?;
        let mut g = self.slots.lock(index);
        self.publish(&mut g, prepared);
        Ok(())
    }

    /// [`write_page`](Self::write_page) in the wrong order (testing): the slot is published
    /// before the object's bytes are copied in, the ordering bug the crash model test's canary
    /// must catch (`tests/restart.rs`).
    #[cfg(any(test, feature = "testing"))]
    fn write_page_publishing_first(
        &self,
        index: SlotIndex,
        page: &[u8],
        dst: &mut [u8],
        limit_pages: u64,
    ) -> Result<()> {
        if same_filled_word(page).is_some() {
            let prepared = self.prepare(page, dst, limit_pages)?;
            self.publish(&mut self.slots.lock(index), prepared);
            return Ok(());
        }
        let comp_len = self.codecs.primary().compress(page, dst)?;
        let (src, huge) = if comp_len >= self.huge_threshold_bytes {
            (page, true)
        } else {
            (&dst[..comp_len], false)
        };
        let handle = self.pool.malloc(src.len())?;
        let prepared = Prepared::Object {
            handle,
            size_bytes: src.len(),
            huge,
        };
        self.publish(&mut self.slots.lock(index), prepared);
        self.pool.write(handle, src);
        Ok(())
    }

    /// Read-modify-write of page `index`: reads it into `page` (a page of scratch), applies
    /// `patch`, compresses and publishes it, with the slot locked from the read to the
    /// publish, so two writes to different parts of one page never lose each other's data. A
    /// written-back page is read with the lock dropped (see the module docs). A failure
    /// leaves the old contents.
    pub(crate) fn write_partial(
        &self,
        index: SlotIndex,
        patch: impl FnOnce(&mut [u8]),
        page: &mut [u8],
        dst: &mut [u8],
        limit_pages: u64,
    ) -> Result<()> {
        loop {
            let mut g = self.slots.lock(index);
            let _pin = match self.read_slot(&g, page)? {
                Source::Done => None,
                Source::Backing(pin, st, frees) => {
                    drop(g);
                    self.read_backing(index, &pin, st, frees, page, dst)?;
                    g = self.slots.lock(index);
                    if g.state().wb_location() != Some(pin.location()) {
                        continue;
                    }
                    // Held until the publish, only to keep the location pinned.
                    Some(pin)
                }
            };
            patch(page);
            let prepared = self.prepare(page, dst, limit_pages)?;
            self.publish(&mut g, prepared);
            return Ok(());
        }
    }

    /// Releases page `index` (a release path: discard), freeing its allocator object as `how`
    /// says. The slot's metadata and counters are cleared under its lock, so the page reads
    /// back as zeroes, and `mm_stat` drops, before this returns.
    pub(crate) fn release(&self, index: SlotIndex, how: Free) {
        // Counted per page released, as zram's `zram_bio_discard` counts `notify_free`.
        StoreStats::add(&self.stats.notify_free, 1);
        let mut g = self.slots.lock(index);
        self.release_slot(&mut g, how);
    }

    /// A swap frontend's free notification for page `index` (zram's `zram_slot_free_notify`):
    /// released as `how` says if its lock is free right now; otherwise dropped and counted in
    /// `miss_free` (the page stays stored until it is overwritten or discarded). Never waits.
    pub(crate) fn free_notify(&self, index: SlotIndex, how: Free) {
        StoreStats::add(&self.stats.notify_free, 1);
        match self.slots.try_lock(index) {
            Some(mut g) => self.release_slot(&mut g, how),
            None => StoreStats::add(&self.stats.miss_free, 1),
        }
    }

    /// Empties page `index` (it reads back as zeroes) and records an access: write-zeroes of a
    /// whole page.
    pub(crate) fn free_page(&self, index: SlotIndex) {
        // Write-zeroes goes through zram's discard path, which counts `notify_free`.
        StoreStats::add(&self.stats.notify_free, 1);
        let mut g = self.slots.lock(index);
        self.release_slot(&mut g, Free::Sync);
        g.touch(self.now_secs());
    }

    /// Counts a failed read request (`io_stat`).
    pub(crate) fn note_failed_read(&self) {
        StoreStats::add(&self.stats.failed_reads, 1);
    }

    /// Counts a failed write request (`io_stat`).
    pub(crate) fn note_failed_write(&self) {
        StoreStats::add(&self.stats.failed_writes, 1);
    }

    /// Reads the slot's page into `out` (one page) if it is in RAM; for a WB slot pins its
    /// location and returns the pin. The caller holds the slot lock.
    pub(crate) fn read_slot<'a>(&'a self, g: &SlotGuard<'_>, out: &mut [u8]) -> Result<Source<'a>> {
        let st = g.state();
        if st.is_empty() {
            out.fill(0);
            return Ok(Source::Done);
        }
        if let Some(word) = st.same_word() {
            fill_same(out, word);
            return Ok(Source::Done);
        }
        if let Some(location) = st.wb_location() {
            let Some(target) = self.target.as_ref() else {
                // A store without a target never makes a slot WB.
                return Err(Error::io(format!(
                    "slot {} is written back but the device has no backing device",
                    g.index().0
                )));
            };
            let frees = self.multi_frees.load(Ordering::Acquire);
            return Ok(Source::Backing(target.pin(location), st, frees));
        }
        let handle = Handle::from_raw(st.value).expect("non-empty slot has a handle");
        if st.has(SlotFlags::MULTI) {
            let k = (g.index().0 % self.multi_pages as u64) as usize;
            self.read_multi(handle, st.codec(), k, out)?;
            return Ok(Source::Done);
        }
        self.pool.read(handle, |obj| {
            if st.has(SlotFlags::HUGE) {
                out.copy_from_slice(obj);
                Ok(())
            } else {
                self.codecs.get(st.codec())?.decompress(obj, out)
            }
        })?;
        Ok(Source::Done)
    }

    /// Reads a written-back page through its pin (no slot lock held) and counts `bd_reads`.
    /// A page of a written-back multi-page object comes from this thread's [`GroupCache`], or
    /// the whole object is read (counted once) and decompressed into it; `frees` is the
    /// `multi_frees` seen under the slot lock.
    fn read_backing(
        &self,
        index: SlotIndex,
        pin: &WbPin<'_>,
        st: SlotState,
        frees: u64,
        out: &mut [u8],
        scratch: &mut [u8],
    ) -> Result<()> {
        let codec = self.codecs.get(st.codec())?;
        if st.has(SlotFlags::MULTI) {
            let n = self.multi_pages as u64;
            let first = index.0 - index.0 % n;
            let k = (index.0 % n) as usize;
            return self.with_group_cache(
                GroupWhere::Backing(st.value),
                frees,
                k,
                out,
                |group, raw, _| {
                    // Whole: a later read of another page would cost another backing read.
                    let valid = pin.read_group(first, st, &*codec, group, raw, group.len())?;
                    StoreStats::add(&self.stats.bd_reads, 1);
                    Ok(valid)
                },
            );
        }
        pin.read_page(index.0, st, &*codec, out, scratch)?;
        StoreStats::add(&self.stats.bd_reads, 1);
        Ok(())
    }

    /// Replaces the slot's contents with `prepared`, then releases what it held: in that
    /// order, so a process stopped in between leaves an object no slot references (garbage
    /// that recovery frees), never a slot naming a freed object (`docs/restart.md`). The
    /// caller holds the slot lock.
    fn publish(&self, g: &mut SlotGuard<'_>, prepared: Prepared) {
        let old = g.state();
        let s = &self.stats;
        match prepared {
            Prepared::Same(word) => {
                g.set_same(word);
                StoreStats::add(&s.same_pages, 1);
            }
            Prepared::Object {
                handle,
                size_bytes,
                huge,
            } => {
                let flags = if huge {
                    SlotFlags::HUGE
                } else {
                    SlotFlags::NONE
                };
                g.set_handle(handle.to_raw(), size_bytes, flags, 0);
                StoreStats::add(&s.compr_data_size_bytes, size_bytes as u64);
                if huge {
                    StoreStats::add(&s.huge_pages, 1);
                    StoreStats::add(&s.huge_pages_since, 1);
                }
            }
        }
        StoreStats::add(&s.pages_stored, 1);
        g.touch(self.now_secs());
        self.release_contents(g.index(), old, Free::Sync);
    }

    /// Releases whatever the slot holds and empties it (zram's `zram_free_page`), freeing its
    /// allocator object as `how` says. The slot's metadata and the counters are always updated
    /// here, under the slot lock; with [`Free::Deferred`] only the object's memory comes back
    /// later. The caller holds the slot lock.
    fn release_slot(&self, g: &mut SlotGuard<'_>, how: Free) {
        let st = g.state();
        // Emptied first: see `publish`.
        g.set_empty();
        self.release_contents(g.index(), st, how);
    }

    /// Releases `st`, what slot `index` held before it was emptied or replaced (its object,
    /// backing location, codec generation and counters). The caller holds the slot lock.
    fn release_contents(&self, index: SlotIndex, st: SlotState, how: Free) {
        if st.is_empty() {
            return;
        }
        let s = &self.stats;
        if st.has(SlotFlags::SAME) {
            StoreStats::sub(&s.same_pages, 1);
        } else if let Some(location) = st.wb_location() {
            // Only writeback makes a slot WB, into this store's target. Exactly once: the slot
            // is emptied below under the same lock (for a multi-page object, by the last slot
            // of its group pointing at it).
            if let Some(target) = self.target.as_ref() {
                if st.has(SlotFlags::MULTI) {
                    self.release_wb_group(index, st, target);
                } else {
                    target.release(location, 1);
                }
            }
        } else {
            self.release_object(index, st, how);
        }
        // A recompressed page (in RAM or written back) no longer holds its codec's generation.
        self.codecs.release(st.codec());
        StoreStats::sub(&s.pages_stored, 1);
    }

    /// A slot pointing at a written-back multi-page object lets go of it: the last one of the
    /// group releases its location. The caller holds the slot lock and empties the slot.
    fn release_wb_group(&self, index: SlotIndex, st: SlotState, target: &WbTarget) {
        let s = &self.stats;
        let group = (index.0 / self.multi_pages as u64) as usize;
        StoreStats::sub(&s.multi_wb_pages, 1);
        if self.group_refs[group].fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let blocks = WbTarget::group_blocks(st.size_bytes(), self.page_size_bytes);
        StoreStats::sub(&s.multi_wb_objects, 1);
        StoreStats::sub(&s.multi_wb_blocks, blocks);
        // A location given back may be another object's next: the caches of this one go.
        self.multi_frees.fetch_add(1, Ordering::Release);
        target.release(st.value, blocks);
    }

    /// Frees the slot's pool object and takes it out of `compr_data_size` and `huge_pages`
    /// (`pages_stored` is the caller's). The caller holds the slot lock and then either empties
    /// the slot or points it elsewhere (writeback).
    fn release_object(&self, index: SlotIndex, st: SlotState, how: Free) {
        let s = &self.stats;
        let handle = Handle::from_raw(st.value).expect("non-empty slot has a handle");
        if st.has(SlotFlags::MULTI) {
            // Only the last slot of the group pointing at the object frees it.
            let group = (index.0 / self.multi_pages as u64) as usize;
            StoreStats::sub(&s.multi_pages, 1);
            if self.group_refs[group].fetch_sub(1, Ordering::AcqRel) != 1 {
                return;
            }
            StoreStats::sub(&s.multi_objects, 1);
            self.multi_frees.fetch_add(1, Ordering::Release);
        }
        match how {
            Free::Sync => self.pool.free(handle),
            Free::Deferred => self.pool.free_deferred(handle),
        }
        StoreStats::sub(&s.compr_data_size_bytes, st.size_bytes() as u64);
        if st.has(SlotFlags::HUGE) {
            StoreStats::sub(&s.huge_pages, 1);
        }
    }

    // ---------------------------------------------------------------------------------------
    // Idle marking.

    /// Marks slots idle. Same-filled and written-back slots are skipped, as in zram: neither
    /// writeback nor recompression can do anything for them.
    pub(crate) fn mark_idle(&self, cutoff: IdleCutoff) {
        let now = u64::from(self.now_secs());
        for i in 0..self.slots.len() {
            let index = SlotIndex(i);
            // An unlocked look first, so empty slots cost no lock and their table pages stay
            // uncommitted; the decision is re-made under the lock.
            if self.slots.entry(index).state_unlocked().is_empty() {
                continue;
            }
            let mut g = self.slots.lock(index);
            let st = g.state();
            if st.is_empty() || st.has(SlotFlags::SAME) || st.has(SlotFlags::WB) {
                continue;
            }
            let idle = match cutoff {
                IdleCutoff::All => true,
                IdleCutoff::OlderThanSecs(age) => {
                    now.saturating_sub(u64::from(st.ac_time_secs)) >= age
                }
            };
            if idle {
                g.set_flags(SlotFlags::IDLE);
            } else {
                g.clear_flags(SlotFlags::IDLE);
            }
        }
    }

    /// What slot `index` holds, for block status: [`Allocation::Hole`] (empty),
    /// [`Allocation::Zero`] (same-filled with zero bytes) or [`Allocation::Data`]. Data is
    /// answered from the unlocked state; the two answers that say the page reads as zeroes are
    /// confirmed under the slot lock (an unlocked look may catch a rewrite half-published).
    pub(crate) fn allocation(&self, index: SlotIndex) -> Allocation {
        fn of(st: SlotState) -> Allocation {
            if st.is_empty() {
                Allocation::Hole
            } else if st.same_word() == Some(0) {
                Allocation::Zero
            } else {
                Allocation::Data
            }
        }
        match of(self.slots.entry(index).state_unlocked()) {
            Allocation::Data => Allocation::Data,
            _ => of(self.slots.lock(index).state()),
        }
    }

    /// debugfs's `block_state`: a line per slot holding data (in RAM, same-filled or written
    /// back), `%12zd %12u.%06d %c%c%c%c%c%c\n` as the kernel prints it: index, last access
    /// (seconds since initialisation; microseconds 0, as the kernel's seconds-resolution
    /// `ac_time`), then `s` same-filled, `w` written back, `h` huge, `i` idle, `r` recompressed
    /// (a priority above 0), `n` incompressible, or `.`. Each slot is read under its lock.
    pub(crate) fn block_state(&self) -> String {
        let mut out = String::new();
        for i in 0..self.slots.len() {
            let index = SlotIndex(i);
            if self.slots.entry(index).state_unlocked().is_empty() {
                continue;
            }
            let g = self.slots.lock(index);
            let st = g.state();
            if st.is_empty() {
                continue;
            }
            let f = |flag: SlotFlags, c: char| if st.has(flag) { c } else { '.' };
            out.push_str(&format!(
                "{:12} {:12}.{:06} {}{}{}{}{}{}\n",
                i,
                st.ac_time_secs,
                0,
                f(SlotFlags::SAME, 's'),
                f(SlotFlags::WB, 'w'),
                f(SlotFlags::HUGE, 'h'),
                f(SlotFlags::IDLE, 'i'),
                if st.prio() > 0 { 'r' } else { '.' },
                f(SlotFlags::INCOMPRESSIBLE, 'n'),
            ));
        }
        out
    }

    /// Number of slots currently marked idle (read without the slot locks).
    pub(crate) fn idle_pages(&self) -> u64 {
        (0..self.slots.len())
            .filter(|&i| {
                self.slots
                    .entry(SlotIndex(i))
                    .state_unlocked()
                    .has(SlotFlags::IDLE)
            })
            .count() as u64
    }

    // ---------------------------------------------------------------------------------------
    // Writeback's steps.

    /// The writeback target, when the device has a backing device.
    pub(crate) fn target(&self) -> Option<&WbTarget> {
        self.target.as_ref()
    }

    // ---------------------------------------------------------------------------------------
    // The zoned target's GC.

    // ---------------------------------------------------------------------------------------
    // The pool and the counters.

    /// Drains the deferred-free queue; returns the objects this call freed.
    pub(crate) fn flush_deferred(&self) -> usize {
        self.pool.flush()
    }

    /// Compacts the pool (zram's `compact`) after draining the deferred-free queue: moving
    /// objects that are about to be freed is wasted work, and their frees may empty zspages by
    /// themselves. Returns pages freed.
    pub(crate) fn compact(&self) -> u64 {
        self.compact_with_progress(&mut |_, _| {})
    }

    /// Like [`compact`](Self::compact), calling `progress(freed, estimate)` (see
    /// [`crate::zsmalloc::PoolCore::compact_with_progress`]).
    pub(crate) fn compact_with_progress(&self, progress: &mut dyn FnMut(u64, u64)) -> u64 {
        self.pool.flush();
        self.pool.compact_with_progress(progress)
    }

    /// The deferred-free queue's counters.
    pub(crate) fn deferred_stats(&self) -> DeferredStats {
        self.pool.deferred_stats()
    }

    /// The allocator's per-class counters.
    pub(crate) fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// The memory the store holds besides the pool's zspages (`meta_stat`).
    pub(crate) fn meta_stats(&self) -> MetaStats {
        let pool = self.pool.meta();
        MetaStats {
            slot_table_bytes: self.slots.size_bytes(),
            handle_table_bytes: pool.handle_table_bytes,
            zspage_meta_bytes: pool.zspage_meta_bytes,
            frame_cache_bytes: pool.frame_cache_bytes,
            deferred_queue_bytes: pool.deferred_queue_bytes,
            swap_reserve_bytes: pool
                .swap_reserve
                .map_or(0, |r| r.held_pages * POOL_PAGE_BYTES as u64),
            swap_reserve_size_bytes: pool
                .swap_reserve
                .map_or(0, |r| r.high_pages * POOL_PAGE_BYTES as u64),
            swap_reserve_misses: pool.swap_reserve.map_or(0, |r| r.misses),
        }
    }

    /// Resets `mem_used_max` to the pool's current size.
    pub(crate) fn reset_mem_used_max(&self) {
        let total = self.pool.total_pages();
        self.stats
            .max_used_pages
            .store(total, std::sync::atomic::Ordering::Relaxed);
    }

    /// The counters, with `mem_limit_bytes` left 0 (a device setting).
    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        let page = self.page_size_bytes as u64;
        // The pool counts its own pages (4 KiB whatever the device's page size).
        let pool_page = POOL_PAGE_BYTES as u64;
        let s = &self.stats;
        let get = StoreStats::get;
        // bd_stat counts 4 KiB units whatever the page size.
        let units = units_per_page(self.page_size_bytes);
        let bd_count = self.target.as_ref().map_or(0, WbTarget::pages_stored);
        let total_pages = self.pool.total_pages();
        s.update_max_used(total_pages);
        StatsSnapshot {
            orig_data_size_bytes: get(&s.pages_stored) * page,
            compr_data_size_bytes: get(&s.compr_data_size_bytes),
            mem_used_total_bytes: total_pages * pool_page,
            mem_limit_bytes: 0,
            mem_used_max_bytes: get(&s.max_used_pages) * pool_page,
            same_pages: get(&s.same_pages),
            pages_compacted: self.pool.pages_compacted(),
            huge_pages: get(&s.huge_pages),
            huge_pages_since: get(&s.huge_pages_since),
            failed_reads: get(&s.failed_reads),
            failed_writes: get(&s.failed_writes),
            notify_free: get(&s.notify_free),
            miss_free: get(&s.miss_free),
            pages_stored: get(&s.pages_stored),
            bd_count: bd_count * units,
            bd_reads: get(&s.bd_reads) * units,
            bd_writes: get(&s.bd_writes) * units,
            recomp_tried: get(&s.recomp_tried),
            recomp_done: get(&s.recomp_done),
            recomp_incompressible: get(&s.recomp_incompressible),
            bd_checksum_errors: self.target.as_ref().map_or(0, WbTarget::checksum_errors),
            multi_objects: get(&s.multi_objects),
            multi_pages: get(&s.multi_pages),
            multi_wb_objects: get(&s.multi_wb_objects),
            multi_wb_pages: get(&s.multi_wb_pages),
            multi_wb_blocks: get(&s.multi_wb_blocks),
            group_cache_hits: get(&s.group_cache_hits),
            group_cache_misses: get(&s.group_cache_misses),
        }
    }

    // ---------------------------------------------------------------------------------------
    // Testing hooks.

    /// Swaps the contents of slots `a` and `b`, corrupting the store on purpose (the model
    /// test's canary). `EINVAL` for indexes out of range or equal.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn debug_swap_slots(&self, a: u64, b: u64) -> Result<()> {
        let n = self.slots.len();
        if a >= n || b >= n || a == b {
            return Err(Error::invalid("bad slot indexes"));
        }
        let (lo, hi) = (a.min(b), a.max(b));
        let mut g1 = self.slots.lock(SlotIndex(lo));
        let mut g2 = self.slots.lock(SlotIndex(hi));
        let (s1, s2) = (g1.state(), g2.state());
        g1.restore(s2);
        g2.restore(s1);
        Ok(())
    }

    /// Marks backing blocks allocated as if slots held them (see
    /// `Device::debug_reserve_backing_blocks`); returns how many were free. `ENODEV` without a
    /// bitmap target, `ERANGE` for a block past its end.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn debug_reserve_blocks(
        &self,
        blocks: impl IntoIterator<Item = u64>,
    ) -> Result<u64> {
        let Some(WbTarget::Bitmap(t)) = self.target.as_ref() else {
            return Err(Error::new(
                ErrorKind::NoDevice,
                "no backing device with the bitmap layout",
            ));
        };
        let mut n = 0;
        for b in blocks {
            if b >= t.bitmap().blocks() {
                return Err(Error::new(ErrorKind::OutOfRange, format!("no block {b}")));
            }
            n += u64::from(t.bitmap().reserve(BlockIndex(b)));
        }
        Ok(n)
    }

    /// Stops checksumming written-back blocks (the benchmark's baseline; see
    /// `Device::bench_skip_block_checksums`). `ENODEV` without a bitmap target.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn bench_skip_block_checksums(&self) -> Result<()> {
        let Some(WbTarget::Bitmap(t)) = self.target.as_ref() else {
            return Err(Error::new(
                ErrorKind::NoDevice,
                "no backing device with the bitmap layout",
            ));
        };
        t.skip_checksums();
        Ok(())
    }

    /// Checks the zoned store's bookkeeping (panics on a mismatch); nothing without one.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn debug_check_zones(&self) {
        if let Some(z) = self.zoned() {
            z.store().check();
        }
    }
}
