//! zsmalloc: the allocator for compressed objects.
//!
//! A userspace port of the design of Linux's mm/zsmalloc.c. Objects of 1 byte to one page are
//! packed into *zspages* (1–8 contiguous 4 KiB pages) of per-size *classes*, named by
//! [`Handle`]s that stay valid while [`PoolCore::compact`] moves the objects to free whole
//! zspages. A pool for 16 or 64 KiB device pages stores an object larger than 4 KiB as a *span*:
//! whole 4 KiB pages plus a tail object in a class (`span`).
//! `docs/zsmalloc.md` tells the story; this page states the contracts.
//!
//! # Parts (one file per concept)
//!
//! - `size_class`: the class table (sizes, chain lengths, merging, the huge threshold).
//! - `page_alloc`: address space reserved in 128 MiB chunks, cut into 8-page *frames*, one per
//!   zspage, in a memfd (`docs/restart.md`); their pages punched out of it when a zspage is
//!   freed. Uses `unsafe`.
//! - `record`: what a frame holds (a zspage or a span), as its record in shared memory says.
//! - `restore`: recovery of a pool from its files by a new process.
//! - `zspage`: the per-zspage descriptor (the *migrate lock* guarding the frame) and slot
//!   metadata; object byte access. Uses `unsafe`.
//! - `handle`: handles, location words and the handle table (in a memfd). Uses `unsafe`.
//! - `arena`: the never-shrinking segmented arrays holding location words and descriptors.
//! - `fullness`: the fullness groups (in-use ratio buckets of 10 %).
//! - `class`: a class at run time: its lock and what it protects.
//! - `compact`: compaction.
//! - `span`: objects larger than a pool page (whole pages plus a tail object).
//! - `deferred_free`: the queue behind [`ZsPool::free_deferred`] (growing in blocks the worker
//!   allocates), drained by a worker thread (owned by [`ZsPool`], sharing the pool proper, [`PoolCore`], through an `Arc`;
//!   `ZsPool` derefs to it for every other operation).
//!
//! Everything else (this file, `class`, `compact`, ...) is `unsafe`-free (`deny(unsafe_code)`).
//!
//! # Locks and what they protect
//!
//! | lock | protects |
//! |------|----------|
//! | class lock (`SizeClass::state`, a mutex per class) | the class's slot metadata, fullness lists, unused zspage ids, free handle indices, counters; every *change* of a location word of the class's handles |
//! | migrate lock (`ZspageDesc`, an rwlock per zspage) | the zspage's frame (which memory backs it) and the bytes of its objects: shared to read an object or to copy into a reserved free slot, exclusive to write an object, to move objects out, or to install/take out the frame |
//! | span table mutex (`SpanTable::state`) | free span ids and span handle indices, span counters; every change of a span handle's location word |
//! | span descriptor (`SpanDesc`, an rwlock per span) | the span's frame and tail handle, and the bytes of its whole pages (shared to read, exclusive to write or to take the frame out) |
//! | frame allocator mutex | chunks and free frames |
//! | deferred-free queue lock (try-locked only by `free_deferred`) | the queued and spare blocks of handles |
//! | deferred-free drain mutex | the right to drain: held by a drainer (worker or `flush`) for its whole batch |
//! | deferred-free block stock (one per process, `deferred_free::BlockStock`) | empty blocks the pools' queues take when their own run out |
//!
//! Lock order: class lock → migrate lock of a compaction source → migrate lock of a destination
//! → frame allocator mutex; span table mutex → span descriptor → (a tail's) migrate lock. No span
//! lock is taken while a class lock is held. `read` and `write` take exactly one migrate lock and nothing else;
//! `free` takes one class lock (plus, if the zspage empties, its migrate lock briefly and then,
//! after the class lock is dropped, the frame allocator mutex). `free_deferred` try-locks the
//! queue lock and under it, when the queue needs a block, the stock's (or falls back to `free`). A drainer holds the
//! drain mutex, takes the queue lock only to take blocks or give one back, then calls `free` per
//! handle: drain mutex → class lock → ...
//!
//! # Finding an object while compaction moves it
//!
//! A handle's location word (zspage id within the class, slot, size) is loaded with `Acquire`;
//! the reader locks that zspage's descriptor shared and loads the word again. If it changed,
//! compaction moved the object: unlock and retry. If not, the object is in that zspage and
//! stays there while the lock is held (moving it out needs the lock exclusive), and the frame
//! cannot change either. Descriptors are never deallocated (only recycled), so locking a stale
//! one is harmless. Compaction copies an object *before* storing its new location with
//! `Release`, so a reader who sees the new location sees the copied bytes.
//!
//! # Caller contract
//!
//! A handle has one owner at a time; `read`/`write` of a handle never run concurrently with
//! `free` of the same handle, and no handle is used after `free`. Violations are detected when
//! cheap (use or free of a freed handle panics) and can never cause a data race: at worst they
//! read another object's bytes. The closure given to [`PoolCore::read`] runs under a migrate lock
//! and must not call back into the pool. `compact` may run concurrently with everything.
//! A handle given to `free_deferred` is given up exactly as one given to `free`; until it is
//! drained it is still allocated (compaction may move it; `total_pages` counts its memory).

#![deny(unsafe_code)]

mod arena;
mod class;
mod compact;
mod deferred_free;
mod fullness;
mod handle;
pub(crate) mod page_alloc;
mod record;
mod restore;
mod size_class;
mod span;
mod zspage;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use deferred_free::{DeferredStats, DEFERRED_FREE_BUDGET_BYTES, DEFERRED_STOCK_BYTES};
pub use handle::Handle;
pub use restore::{PoolFiles, RestoreReport};
pub use size_class::{
    ClassInfo, ClassTable, MAX_PAGES_PER_ZSPAGE, MIN_ALLOC_SIZE_BYTES, SUPPORTED_PAGE_SIZES_BYTES,
};
pub use span::POOL_PAGE_BYTES;

use class::{ClassState, Detached, SizeClass};
use deferred_free::DeferredQueue;
use fullness::NR_GROUPS;
use handle::{HandleTable, Location, MAX_ZSPAGES_PER_CLASS};
use page_alloc::{Frame, FrameAllocator, FRAME_CACHE_BYTES};
use record::FrameUse;
use span::{SpanObj, SpanTable};
use zspage::obj_offset;

use crate::error::{Error, Result};

/// The pool proper: every operation but [`ZsPool::free_deferred`], which may start the
/// deferred-free worker. Shared (`Arc`) between the [`ZsPool`], which derefs to it, and that
/// worker.
pub struct PoolCore {
    /// The largest object (the device's page size).
    page_size_bytes: usize,
    /// The classes, always of 4 KiB pages ([`POOL_PAGE_BYTES`]).
    table: ClassTable,
    /// One per merged class, ascending by size. Declared before `frames`: descriptors (the frame
    /// owners) drop before the chunks are unmapped.
    classes: Box<[SizeClass]>,
    handles: HandleTable,
    /// Objects larger than a pool page. Declared before `frames` (spans own frames).
    spans: SpanTable,
    /// Shared with its reserve's refiller thread (stopped by `ZsPool`'s `Drop`); or, serving
    /// swap, the server's one allocator and reserve (`crate::memory::SwapReserve`), shared by
    /// every pool of the server.
    frames: Arc<FrameAllocator>,
    /// `frames` is the server's: frames go back to it when the pool drops, and its refiller is
    /// not the pool's to stop.
    shared_frames: bool,
    /// The tag in this pool's frame records (`record`): 0 for frames of its own, else unique
    /// among the pools of the shared allocator (taken from it, given back when the pool drops).
    pool_tag: u16,
    /// Pool pages (4 KiB) of attached zspages and spans (incremented when a zspage or span is
    /// created, decremented when its pages were returned).
    total_pages: AtomicU64,
    /// Pages freed by compaction, cumulative.
    pages_compacted: AtomicU64,
    /// Handles waiting to be freed, as handle-table indices (4 bytes each; see
    /// `deferred_free`).
    deferred: DeferredQueue<u32>,
    /// Benchmark baseline, fixed at construction: return an emptied zspage's pages under the
    /// class lock, as zsmalloc did before the short critical section (the baseline of
    /// `uzram bench free`, [`ZsPool::bench_new_release_under_class_lock`]).
    #[cfg(any(test, feature = "testing"))]
    release_under_class_lock: bool,
}

impl fmt::Debug for PoolCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZsPool")
            .field("page_size_bytes", &self.page_size_bytes())
            .field("classes", &self.classes.len())
            .field("total_pages", &self.total_pages())
            .field("pages_compacted", &self.pages_compacted())
            .finish()
    }
}

impl PoolCore {
    fn new(
        page_size_bytes: usize,
        deferred_capacity: Option<usize>,
        shared_frames: Option<Arc<FrameAllocator>>,
    ) -> Result<PoolCore> {
        if !SUPPORTED_PAGE_SIZES_BYTES.contains(&page_size_bytes) {
            return Err(Error::invalid(format!(
                "zsmalloc: page size {page_size_bytes} not one of {SUPPORTED_PAGE_SIZES_BYTES:?}"
            )));
        }
        let table = ClassTable::new(POOL_PAGE_BYTES);
        let classes = table
            .classes()
            .iter()
            .enumerate()
            .map(|(i, &c)| SizeClass::new(c, i as u32))
            .collect();
        let deferred_capacity =
            deferred_capacity.unwrap_or_else(|| deferred_free::default_capacity(page_size_bytes));
        Ok(PoolCore {
            page_size_bytes,
            table,
            classes,
            handles: HandleTable::new()?,
            spans: SpanTable::default(),
            // Frames of at least a device page, so the largest span fits one.
            shared_frames: shared_frames.is_some(),
            pool_tag: match &shared_frames {
                Some(frames) => frames.take_pool_tag(None)?,
                None => 0,
            },
            frames: match shared_frames {
                Some(frames) => {
                    assert!(frames.frame_pages() * POOL_PAGE_BYTES >= page_size_bytes);
                    frames
                }
                None => Arc::new(
                    FrameAllocator::with_frame_pages(
                        POOL_PAGE_BYTES,
                        page_size_bytes / POOL_PAGE_BYTES,
                        FRAME_CACHE_BYTES,
                    )
                    .with_drop_batches()
                    .with_reserve(),
                ),
            },
            total_pages: AtomicU64::new(0),
            pages_compacted: AtomicU64::new(0),
            deferred: deferred_free::pool_queue(deferred_capacity),
            #[cfg(any(test, feature = "testing"))]
            release_under_class_lock: false,
        })
    }

    /// The page size the pool was built for: its largest object.
    pub fn page_size_bytes(&self) -> usize {
        self.page_size_bytes
    }

    /// The smallest object size that costs as much memory as a whole device page, so the
    /// device stores a page raw when its compressed size is at least this. For 4 KiB pages, the
    /// largest non-huge class size + 1 (3633: one object per zspage from there; the kernel's
    /// value is 8 bytes smaller because its objects carry their handle; ours do not). For 16
    /// and 64 KiB pages, a page less 4 KiB plus that: from there a span's tail would be huge, so
    /// the span takes as many pages as the raw page (61473 for 64 KiB).
    pub fn huge_class_size_bytes(&self) -> usize {
        self.page_size_bytes - POOL_PAGE_BYTES + self.table.huge_class_size_bytes()
    }

    /// The class table (always of 4 KiB pages: larger objects are spans).
    pub fn class_table(&self) -> &ClassTable {
        &self.table
    }

    /// Bytes an object of `size_bytes` (`1..=page size`) takes in the pool: its class's slot
    /// size, or for a span its whole pages plus its tail's slot size. Comparing footprints tells
    /// whether a smaller object saves memory (what the kernel's "smaller size class" test asks).
    pub fn footprint_bytes(&self, size_bytes: usize) -> usize {
        if size_bytes <= POOL_PAGE_BYTES {
            return self.table.classes()[self.table.class_of(size_bytes)].size_bytes;
        }
        let (pages, tail) = span::split(size_bytes, self.table.huge_class_size_bytes());
        let tail_bytes = if tail == 0 {
            0
        } else {
            self.table.classes()[self.table.class_of(tail)].size_bytes
        };
        pages * POOL_PAGE_BYTES + tail_bytes
    }

    fn class_for(&self, size_bytes: usize) -> &SizeClass {
        &self.classes[self.table.class_of(size_bytes)]
    }

    /// Allocates an object of `size_bytes` (`1..=page_size`, else `EINVAL`). Its bytes are
    /// unspecified until written. `ENOMEM` only if the kernel refuses address space (or the
    /// 2^31-handle table is full).
    pub fn malloc(&self, size_bytes: usize) -> Result<Handle> {
        let mut got = self.malloc_once(size_bytes);
        // Serving swap: no handle word was resident ahead of need; the refiller faults more in
        // (the writer must not), waited for as a reserve frame is.
        if got.is_err()
            && self.handles.headroom() == 0
            && self.frames.wait_ahead(|| self.handles.headroom() > 0)
        {
            got = self.malloc_once(size_bytes);
        }
        if self.handles.wants_refill() {
            self.frames.want_ahead();
        }
        got
    }

    /// [`malloc`](Self::malloc), once.
    fn malloc_once(&self, size_bytes: usize) -> Result<Handle> {
        if size_bytes == 0 || size_bytes > self.page_size_bytes() {
            return Err(Error::invalid(format!(
                "zsmalloc: cannot allocate {size_bytes} bytes (1..={})",
                self.page_size_bytes()
            )));
        }
        if size_bytes > POOL_PAGE_BYTES {
            return self.malloc_span(size_bytes);
        }
        let class = self.class_for(size_bytes);
        let pages = class.info.pages_per_zspage;
        let mut st = class.state.lock();
        // A new zspage's frame is allocated and its pages faulted in with the class lock
        // dropped, so neither the frame allocator's lock nor page faults extend the class-lock
        // section. Another thread may have made room meanwhile: then the spare frame goes back.
        let mut spare: Option<Frame> = None;
        while st.zspage_with_room().is_none() && spare.is_none() {
            drop(st);
            spare = Some(self.frames.alloc_populated(pages)?);
            st = class.state.lock();
        }
        let handle = match st.free_handles.pop() {
            Some(handle) => handle,
            None => match self.handles.grow() {
                Ok(handle) => handle,
                Err(e) => {
                    drop(st);
                    if let Some(frame) = spare {
                        self.frames.release(frame, pages);
                    }
                    return Err(e);
                }
            },
        };
        let id = match st.zspage_with_room() {
            Some(id) => id,
            None => {
                let frame = spare.take().expect("the loop above leaves a spare frame");
                match class.take_id(&mut st) {
                    Ok(id) => {
                        class.attach(&mut st, id, frame, &self.frames, self.pool_tag);
                        self.total_pages.fetch_add(pages as u64, Ordering::Relaxed);
                        id
                    }
                    Err(e) => {
                        st.free_handles.push(handle);
                        drop(st);
                        self.frames.release(frame, pages);
                        return Err(e);
                    }
                }
            }
        };
        let obj = st.reserve(class, id, handle).obj();
        let loc = Location {
            zspage: id,
            obj,
            size_bytes,
        };
        self.handles
            .word_at(handle)
            .store(loc.encode(), Ordering::Release);
        // The location is published before the class lock drops, so compaction (which takes
        // it) never sees the reserved object without its handle pointing at it.
        drop(st);
        if let Some(frame) = spare {
            self.frames.release(frame, pages);
        }
        Ok(Handle::from_index(handle))
    }

    /// Allocates a span (`size_bytes` > [`POOL_PAGE_BYTES`]): whole pages of a new frame, and a
    /// tail object when the rest is not a whole page.
    fn malloc_span(&self, size_bytes: usize) -> Result<Handle> {
        let (pages, tail_bytes) = span::split(size_bytes, self.table.huge_class_size_bytes());
        let frame = self.frames.alloc_populated(pages)?;
        let tail = if tail_bytes == 0 {
            None
        } else {
            match self.malloc_once(tail_bytes) {
                Ok(h) => Some(h),
                Err(e) => {
                    self.frames.release(frame, pages);
                    return Err(e);
                }
            }
        };
        let mut st = self.spans.state.lock();
        let ids = match st.free_handles.pop() {
            Some(index) => Ok(index),
            None => self.handles.grow(),
        }
        .and_then(|index| match st.free_ids.pop() {
            Some(id) => Ok((index, id)),
            None if u64::from(st.next_id) < MAX_ZSPAGES_PER_CLASS => {
                st.next_id += 1;
                Ok((index, st.next_id - 1))
            }
            None => {
                st.free_handles.push(index);
                Err(Error::no_memory("zsmalloc: too many spans"))
            }
        });
        let (index, id) = match ids {
            Ok(ids) => ids,
            Err(e) => {
                drop(st);
                self.frames.release(frame, pages);
                if let Some(t) = tail {
                    self.free(t);
                }
                return Err(e);
            }
        };
        let (what, extra) = FrameUse::Span {
            id,
            pages: pages as u32,
            tail_raw: tail.map_or(0, Handle::to_raw),
        }
        .encode(self.pool_tag);
        self.frames.set_record(&frame, what, extra);
        *self.spans.descs.get_or_grow(u64::from(id)).write() = Some(SpanObj { frame, pages, tail });
        st.spans += 1;
        st.pages += pages as u64;
        if tail.is_some() {
            st.tails += 1;
            st.tail_bytes += tail_bytes as u64;
        }
        let loc = Location {
            zspage: id,
            obj: 0,
            size_bytes,
        };
        self.handles
            .word_at(index)
            .store(loc.encode(), Ordering::Release);
        drop(st);
        self.total_pages.fetch_add(pages as u64, Ordering::Relaxed);
        Ok(Handle::from_index(index))
    }

    /// Copies `data` to the start of `h`'s object. `data.len()` must not exceed the size asked
    /// at `malloc` (panics otherwise); bytes past `data.len()` keep their value.
    pub fn write(&self, h: Handle, data: &[u8]) {
        loop {
            let (word, loc) = self.handles.load(h);
            assert!(
                data.len() <= loc.size_bytes,
                "zsmalloc: writing {} bytes into a {}-byte object",
                data.len(),
                loc.size_bytes
            );
            if loc.size_bytes > POOL_PAGE_BYTES {
                // A span never moves: its descriptor holds it until `free`.
                let mut guard = self.spans.desc(loc.zspage).write();
                let span = guard.as_mut().expect("a live span has a frame");
                let whole = (span.pages * POOL_PAGE_BYTES).min(data.len());
                span.frame
                    .bytes_mut(0, whole)
                    .copy_from_slice(&data[..whole]);
                if let (Some(tail), true) = (span.tail, data.len() > whole) {
                    self.write(tail, &data[whole..]);
                }
                return;
            }
            let class = self.class_for(loc.size_bytes);
            let mut guard = class.desc(loc.zspage).write();
            if self.handles.word(h).load(Ordering::Acquire) != word {
                continue; // moved by compaction
            }
            let frame = guard
                .as_mut()
                .expect("a zspage holding an object has a frame");
            let offset = obj_offset(class.info.size_bytes, loc.obj);
            frame.bytes_mut(offset, data.len()).copy_from_slice(data);
            return;
        }
    }

    /// Calls `f` with exactly the bytes of `h`'s object (its `malloc` size). The object cannot
    /// move while `f` runs; `f` must not call into the pool.
    pub fn read<R>(&self, h: Handle, f: impl FnOnce(&[u8]) -> R) -> R {
        let (_, loc) = self.handles.load(h);
        if loc.size_bytes > POOL_PAGE_BYTES {
            return self.read_span(loc, f);
        }
        self.read_small(h, f)
    }

    /// [`read`](Self::read) of an object in a class (not a span).
    fn read_small<R>(&self, h: Handle, f: impl FnOnce(&[u8]) -> R) -> R {
        loop {
            let (word, loc) = self.handles.load(h);
            let class = self.class_for(loc.size_bytes);
            let guard = class.desc(loc.zspage).read();
            if self.handles.word(h).load(Ordering::Acquire) != word {
                continue; // moved by compaction
            }
            let frame = guard
                .as_ref()
                .expect("a zspage holding an object has a frame");
            let offset = obj_offset(class.info.size_bytes, loc.obj);
            return f(frame.bytes(offset, loc.size_bytes));
        }
    }

    /// [`read`](Self::read) of a span: its whole pages are handed out in place when it has no
    /// tail; otherwise pages and tail are copied into a per-thread buffer first.
    fn read_span<R>(&self, loc: Location, f: impl FnOnce(&[u8]) -> R) -> R {
        thread_local! {
            static RUN_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let guard = self.spans.desc(loc.zspage).read();
        let span = guard.as_ref().expect("a live span has a frame");
        let Some(tail) = span.tail else {
            return f(span.frame.bytes(0, loc.size_bytes));
        };
        let whole = span.pages * POOL_PAGE_BYTES;
        RUN_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < loc.size_bytes {
                buf.resize(loc.size_bytes, 0);
            }
            buf[..whole].copy_from_slice(span.frame.bytes(0, whole));
            self.read_small(tail, |t| buf[whole..loc.size_bytes].copy_from_slice(t));
            f(&buf[..loc.size_bytes])
        })
    }

    /// Frees a span: its handle and descriptor under the span table's mutex, then its pages and
    /// its tail.
    fn free_span(&self, h: Handle) {
        let (span, size_bytes) = {
            let mut st = self.spans.state.lock();
            let word = self.handles.word(h);
            // Every writer of a span's word holds this mutex, so this load sees the last store.
            let loc = Location::decode(word.load(Ordering::Relaxed))
                .unwrap_or_else(|| panic!("zsmalloc: double free of {h:?}"));
            let span = self
                .spans
                .desc(loc.zspage)
                .write()
                .take()
                .expect("a live span has a frame");
            word.store(0, Ordering::Release);
            // After the word (nothing names the span now), before the id can be taken again.
            self.frames.clear_record(&span.frame);
            st.free_ids.push(loc.zspage);
            st.free_handles.push(h.index());
            st.spans -= 1;
            st.pages -= span.pages as u64;
            if span.tail.is_some() {
                st.tails -= 1;
                st.tail_bytes -= (loc.size_bytes - span.pages * POOL_PAGE_BYTES) as u64;
            }
            (span, loc.size_bytes)
        };
        debug_assert!(size_bytes > POOL_PAGE_BYTES);
        self.frames.release(span.frame, span.pages);
        self.total_pages
            .fetch_sub(span.pages as u64, Ordering::Relaxed);
        if let Some(tail) = span.tail {
            self.free(tail);
        }
    }

    /// Frees `h` now. Holds `h`'s class lock only to unlink the object (and, if its zspage
    /// emptied, the zspage); the pages of an emptied zspage are returned after the lock is
    /// dropped. Callable from any thread. Panics on a double free.
    ///
    /// The class lock covers only the bookkeeping: unlinking the object from its zspage (slot
    /// metadata, handle word, free handle index), deciding the zspage's new fullness group and,
    /// if it emptied, unlinking the zspage and taking its frame and slot table out
    /// ([`SizeClass::detach`]). Everything that costs more, or takes a lock shared by the whole
    /// pool, happens after the class lock is dropped ([`PoolCore::release_detached`]):
    /// `madvise`, the frame allocator's mutex, the heap free of the slot table, and the
    /// `total_pages` update. Nothing on this path takes a pool-wide lock while a class lock is
    /// held.
    pub fn free(&self, h: Handle) {
        let (_, loc) = self.handles.load(h);
        if loc.size_bytes > POOL_PAGE_BYTES {
            return self.free_span(h);
        }
        let class = self.class_for(loc.size_bytes);
        let mut st = class.state.lock();
        let detached = self.unlink(class, &mut st, h);
        #[cfg(any(test, feature = "testing"))]
        if self.release_under_class_lock {
            // The benchmark's baseline: pages returned with the class lock held.
            if let Some(d) = detached {
                self.release_detached(class, d);
            }
            drop(st);
            return;
        }
        drop(st);
        if let Some(d) = detached {
            self.release_detached(class, d);
        }
    }

    /// With `class`'s lock held (`st`): unlinks `h`'s object from its zspage (slot metadata,
    /// handle word, free handle index) and, if the zspage emptied, detaches it; the caller
    /// returns its memory ([`release_detached`](Self::release_detached)) after dropping the
    /// lock. Panics on a double free.
    fn unlink(&self, class: &SizeClass, st: &mut ClassState, h: Handle) -> Option<Detached> {
        let word = self.handles.word(h);
        // Every writer of the word holds this class lock, so this load sees the last store.
        let loc = Location::decode(word.load(Ordering::Relaxed))
            .unwrap_or_else(|| panic!("zsmalloc: double free of {h:?}"));
        assert!(
            std::ptr::eq(self.class_for(loc.size_bytes), class),
            "zsmalloc: {h:?} changed class while being freed"
        );
        let emptied = st.release(class, loc.zspage, loc.obj, h.index());
        word.store(0, Ordering::Release);
        st.free_handles.push(h.index());
        emptied.then(|| class.detach(st, loc.zspage, &self.frames))
    }

    /// Frees a batch of handles taken from the deferred-free queue: as [`free`](Self::free)
    /// each, but grouped by class, so a class lock is taken once per group of up to
    /// [`FREE_GROUP_OBJECTS`] objects of that class instead of once per object. The handles'
    /// location words are read in one pass first (no lock between the loads, so their cache
    /// misses overlap), then bucketed by class in release order (a counting sort: O(n)), then
    /// freed class by class; an emptied zspage's memory is returned after its group's lock is
    /// dropped, as `free` does. Spans are freed one by one.
    fn free_many(&self, indices: &[u32], scratch: &mut FreeScratch) {
        let FreeScratch {
            classes,
            sorted,
            counts,
            detached,
        } = scratch;
        classes.clear();
        counts.clear();
        counts.resize(self.classes.len() + 1, 0);
        for &index in indices {
            let h = Handle::from_index(index);
            let (_, loc) = self.handles.load(h);
            if loc.size_bytes > POOL_PAGE_BYTES {
                self.free_span(h);
                classes.push(u32::MAX);
                continue;
            }
            let class = self.table.class_of(loc.size_bytes);
            counts[class + 1] += 1;
            classes.push(class as u32);
        }
        // counts[c] becomes the start of class c's bucket.
        for c in 1..counts.len() {
            counts[c] += counts[c - 1];
        }
        let total = counts[self.classes.len()];
        sorted.clear();
        sorted.resize(total, None);
        for (&index, &class) in indices.iter().zip(classes.iter()) {
            if class != u32::MAX {
                let at = &mut counts[class as usize];
                sorted[*at] = Some(Handle::from_index(index));
                *at += 1;
            }
        }
        // counts[c] is now the end of class c's bucket, i.e. the start of c + 1's.
        let mut start = 0;
        for (c, class) in self.classes.iter().enumerate() {
            let end = counts[c];
            for group in sorted[start..end].chunks(FREE_GROUP_OBJECTS) {
                let mut st = class.state.lock();
                for h in group {
                    let h = h.expect("every bucket slot filled");
                    if let Some(d) = self.unlink(class, &mut st, h) {
                        detached.push(d);
                    }
                }
                drop(st);
                for d in detached.drain(..) {
                    self.release_detached(class, d);
                }
            }
            start = end;
        }
    }

    /// Returns a detached zspage's memory. Called without the class lock (except by the
    /// benchmark-only baseline).
    fn release_detached(&self, class: &SizeClass, detached: Detached) {
        let pages = class.info.pages_per_zspage;
        self.frames.release(detached.frame, pages);
        drop(detached.owners);
        self.total_pages.fetch_sub(pages as u64, Ordering::Relaxed);
    }

    /// Queues `h` for a deferred free; see [`ZsPool::free_deferred`]. `true`: the worker must
    /// be woken.
    fn enqueue_deferred(&self, h: Handle) -> bool {
        // Catch a deferred free of a freed handle here, in the caller, not in the worker.
        self.handles.load(h);
        match self.deferred.try_enqueue(h.index()) {
            Ok(wake) => wake,
            Err(_) => {
                self.free(h);
                false
            }
        }
    }

    /// Frees every handle queued by [`ZsPool::free_deferred`] calls that returned before this
    /// call began, waiting for a drain in progress (handles queued concurrently may stay
    /// queued). Returns the handles this call freed itself.
    ///
    /// A flush runs on a request path (a frontend's FLUSH), which allocates nothing: the
    /// handles are freed one by one, not through the worker's class-grouped path, whose
    /// scratch buffers would be allocated on the caller's thread.
    pub fn flush(&self) -> usize {
        self.deferred.drain(|hs| {
            for &index in hs {
                self.free(Handle::from_index(index));
            }
        })
    }

    /// The deferred-free queue's counters.
    pub fn deferred_stats(&self) -> DeferredStats {
        self.deferred.stats()
    }

    /// The size asked at `malloc` for `h`.
    pub fn obj_size_bytes(&self, h: Handle) -> usize {
        self.handles.load(h).1.size_bytes
    }

    /// Moves objects out of sparse zspages into fuller ones, class by class (largest first), and
    /// frees the emptied zspages, then empties the frame cache. Returns the pages freed by this
    /// call (not counting the cache, which `mem_used_total` never included).
    pub fn compact(&self) -> u64 {
        self.compact_with_progress(&mut |_, _| {})
    }

    /// Like [`compact`](Self::compact), calling `progress(freed, estimate)` after each size class:
    /// pages freed so far, and the pages compaction could free when it started (the sum of
    /// every class's `zs_can_compact` figure, each read under its class lock; frees during
    /// the compaction can make it free more, and `estimate` then grows to match).
    pub fn compact_with_progress(&self, progress: &mut dyn FnMut(u64, u64)) -> u64 {
        let mut estimate: u64 = self
            .classes
            .iter()
            .map(|class| class.state.lock().freeable_pages(&class.info))
            .sum();
        progress(0, estimate);
        let mut freed_pages = 0;
        for class in self.classes.iter().rev() {
            let freed = self.compact_class(class);
            self.pages_compacted.fetch_add(freed, Ordering::Relaxed);
            freed_pages += freed;
            estimate = estimate.max(freed_pages);
            if freed > 0 {
                progress(freed_pages, estimate);
            }
        }
        // Compaction is how users give memory back: the frame cache goes too.
        self.frames.trim();
        freed_pages
    }

    /// Pool pages ([`POOL_PAGE_BYTES`], whatever the device's page size) currently held by
    /// zspages and spans (`mem_used_total / 4096`), including those of objects still waiting in
    /// the deferred-free queue.
    pub fn total_pages(&self) -> u64 {
        self.total_pages.load(Ordering::Relaxed)
    }

    /// Pages freed by compaction since the pool was created.
    pub fn pages_compacted(&self) -> u64 {
        self.pages_compacted.load(Ordering::Relaxed)
    }

    /// A snapshot of per-class counters (each class is read under its lock, one at a time).
    pub fn stats(&self) -> PoolStats {
        let classes = self
            .classes
            .iter()
            .map(|class| {
                let st = class.state.lock();
                let info = class.info;
                let groups = st.group_counts();
                ClassStats {
                    index: info.index,
                    size_bytes: info.size_bytes,
                    pages_per_zspage: info.pages_per_zspage,
                    objs_per_zspage: info.objs_per_zspage,
                    zspages: st.zspages,
                    objs_allocated: st.zspages * info.objs_per_zspage as u64,
                    objs_inuse: st.objs_inuse,
                    pages_used: st.zspages * info.pages_per_zspage as u64,
                    freeable_pages: st.freeable_pages(&info),
                    inuse_ratio_zspages: std::array::from_fn(|g| groups[g + 1]),
                }
            })
            .collect();
        let spans = {
            let st = self.spans.state.lock();
            SpanStats {
                spans: st.spans,
                pages: st.pages,
                tails: st.tails,
                tail_bytes: st.tail_bytes,
            }
        };
        PoolStats {
            page_size_bytes: self.page_size_bytes(),
            huge_class_size_bytes: self.huge_class_size_bytes(),
            spans,
            total_pages: self.total_pages(),
            pages_compacted: self.pages_compacted(),
            handles: self.handles.indices(),
            reserved_bytes: self.frames.reserved_bytes() as u64,
            classes,
        }
    }

    /// The pool's memory besides its zspages; see [`PoolMeta`].
    pub fn meta(&self) -> PoolMeta {
        let mut zspage_meta_bytes = 0;
        for class in self.classes.iter() {
            zspage_meta_bytes += class.descs.allocated_bytes() + class.state.lock().heap_bytes();
        }
        zspage_meta_bytes += self.spans.heap_bytes();
        // The frame records of a shared allocator (the server's swap reserve) are the server's,
        // not this pool's: counted in no device's figure.
        if !self.shared_frames {
            zspage_meta_bytes += self.frames.records_bytes();
        }
        PoolMeta {
            handle_table_bytes: self.handles.allocated_bytes() as u64,
            zspage_meta_bytes: zspage_meta_bytes as u64,
            // A shared allocator's cache is the server's, shown with its reserve.
            frame_cache_bytes: if self.shared_frames {
                0
            } else {
                ((self.frames.cached_pages()
                    + self.frames.reserve_pages()
                    + self.frames.dropping_batch_pages())
                    * POOL_PAGE_BYTES) as u64
            },
            deferred_queue_bytes: self.deferred.heap_bytes() as u64,
            swap_reserve: self.shared_frames.then(|| self.frames.swap_stats()),
        }
    }

    /// Checks every class's invariants (expensive; tests).
    #[cfg(test)]
    fn check(&self) {
        let mut pages = self.spans.state.lock().pages;
        for class in self.classes.iter() {
            let st = class.state.lock();
            st.check(class);
            pages += st.zspages * class.info.pages_per_zspage as u64;
        }
        assert_eq!(
            pages,
            self.total_pages(),
            "zspage and span pages vs total_pages"
        );
    }
}

/// Objects of one class freed under one hold of its lock by [`PoolCore::free_many`]: 32, a
/// few microseconds of bookkeeping, so a writer waiting for the class lock waits no longer
/// than for a handful of frees.
const FREE_GROUP_OBJECTS: usize = 32;

/// Buffers [`PoolCore::free_many`] reuses from batch to batch (the worker keeps one for its
/// life, so its frees allocate nothing once they have grown).
#[derive(Debug, Default)]
struct FreeScratch {
    /// Each handle's class index (`u32::MAX`: a span, already freed).
    classes: Vec<u32>,
    /// The handles bucketed by class, in release order within a class.
    sorted: Vec<Option<Handle>>,
    /// Bucket bounds per class.
    counts: Vec<usize>,
    /// Zspages emptied under the current group's lock.
    detached: Vec<Detached>,
}

/// A pool of compressed objects; see the module docs. `Send + Sync`: share it as
/// `Arc<ZsPool>`.
///
/// It owns the pool proper ([`PoolCore`], shared with the deferred-free worker; every operation
/// but [`free_deferred`](Self::free_deferred) is `PoolCore`'s, through `Deref`) and the
/// worker's thread, started with the pool. Dropping the pool stops the worker and
/// flushes the deferred-free queue, so no queued handle is left unfreed.
pub struct ZsPool {
    core: Arc<PoolCore>,
    /// The deferred-free worker (started with the pool). Locked only to start it and to stop
    /// it.
    worker: parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl fmt::Debug for ZsPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.core.fmt(f)
    }
}

impl ZsPool {
    /// A pool for pages of `page_size_bytes` (4096, 16384 or 65536; otherwise `EINVAL`).
    /// Reserves nothing until the first `malloc`. Its deferred-free queue rests at
    /// [`DEFERRED_FREE_BUDGET_BYTES`] / page size handles.
    pub fn new(page_size_bytes: usize) -> Result<ZsPool> {
        ZsPool::with_deferred_capacity(page_size_bytes, None)
    }

    /// As [`new`](Self::new), with a deferred-free queue resting at `capacity` handles (at
    /// least 2; blocks of up to half that) instead of the default: tests use a small one so the
    /// worker runs and grows it often.
    pub fn with_deferred_capacity(
        page_size_bytes: usize,
        capacity: Option<usize>,
    ) -> Result<ZsPool> {
        Ok(ZsPool::with_core(PoolCore::new(
            page_size_bytes,
            capacity,
            None,
        )?))
    }

    /// A pool serving swap: its zspages come from the server's swap reserve `reserve` (one for
    /// every pool of the server), and an allocation the reserve cannot serve fails with
    /// `ENOMEM` at once instead of waiting for memory (`page_alloc`, "The reserve").
    pub fn with_swap_reserve(
        page_size_bytes: usize,
        capacity: Option<usize>,
        reserve: &crate::memory::SwapReserve,
    ) -> Result<ZsPool> {
        Ok(ZsPool::with_core(PoolCore::new(
            page_size_bytes,
            capacity,
            Some(Arc::clone(reserve.frames())),
        )?))
    }

    /// A pool serving swap: its handle table's words are faulted in ahead of need, by the swap
    /// reserve's refiller, in proportion to the objects it holds and the rate it takes new ones
    /// (`handle`, "Serving swap"), so that handing out a handle under memory pressure faults no
    /// page of the table in on a writer's path; this faults in the first ones. A writer that
    /// finds none left waits for the refiller as for a reserve frame (at most a tenth of a
    /// second, then `ENOMEM`).
    pub fn keep_handles_ahead(&self) {
        self.core.handles.keep_ahead(false);
    }

    /// Whether the pool serves swap ([`with_swap_reserve`](Self::with_swap_reserve)).
    pub fn serves_swap(&self) -> bool {
        self.core.shared_frames
    }

    /// Pages the reserve holds faulted in now (`page_alloc`, "The reserve").
    pub fn reserve_pages(&self) -> usize {
        self.core.frames.reserve_pages()
    }

    /// Benchmark baseline (`testing`): a pool whose `free` returns an emptied zspage's pages
    /// while still holding the class lock, as zsmalloc did before the short critical section,
    /// with one `madvise` per zspage (no drop batches). The baseline of `uzram bench free`;
    /// fixed for the pool's life.
    #[cfg(any(test, feature = "testing"))]
    pub fn bench_new_release_under_class_lock(page_size_bytes: usize) -> Result<ZsPool> {
        let mut core = PoolCore::new(page_size_bytes, None, None)?;
        core.release_under_class_lock = true;
        // And one `madvise` per emptied zspage (no drop batches).
        core.frames = Arc::new(
            FrameAllocator::with_frame_pages(
                POOL_PAGE_BYTES,
                page_size_bytes / POOL_PAGE_BYTES,
                FRAME_CACHE_BYTES,
            )
            .with_reserve(),
        );
        Ok(ZsPool::with_core(core))
    }

    fn with_core(core: PoolCore) -> ZsPool {
        let pool = ZsPool {
            core: Arc::new(core),
            worker: parking_lot::Mutex::new(None),
        };
        if pool.core.shared_frames {
            let weak: std::sync::Weak<PoolCore> = Arc::downgrade(&pool.core);
            pool.core.frames.add_shrinker(weak);
        }
        // Started now rather than at the first wake-up: a release that begins on a fresh pool
        // must not outrun the queue's resting blocks while the thread is being created.
        pool.start_worker(&mut pool.worker.lock());
        pool
    }

    /// Frees `h` later (upstream's `zs_free_deferred()`), for release paths that must return
    /// quickly. `h` goes into the pool's queue if its lock is free right now and it has a free
    /// slot (the worker grows it ahead of the releasers); otherwise it is freed synchronously,
    /// here. Never allocates. The queue is drained by a background worker once it holds
    /// `DEFERRED_WAKE_ITEMS` handles (or half its resting capacity), by
    /// [`flush`](PoolCore::flush), and when the pool is dropped. Until then the object still
    /// holds its memory (`total_pages` counts it).
    ///
    /// `h` is given up: using or freeing it again is a use after free, as after
    /// [`free`](PoolCore::free) (a deferred free of a freed handle panics here).
    pub fn free_deferred(&self, h: Handle) {
        if self.core.enqueue_deferred(h) {
            self.wake_worker();
        }
    }

    /// Wakes the worker, starting it first if it is not running.
    fn wake_worker(&self) {
        let mut worker = self.worker.lock();
        if worker.is_none() && !self.start_worker(&mut worker) {
            return;
        }
        drop(worker);
        self.core.deferred.wake();
    }

    /// Starts the deferred-free worker into `worker` (the `worker` mutex held); false if the
    /// thread could not be created. Then the queue only holds its resting blocks (enqueues
    /// fall back once they are full) and is drained by `flush` and `Drop`; nothing is lost, and
    /// the next wake-up tries again.
    fn start_worker(&self, worker: &mut Option<std::thread::JoinHandle<()>>) -> bool {
        let core = self.core.clone();
        let spawned = std::thread::Builder::new()
            .name("uzram-zs-free".into())
            .spawn(move || {
                let mut scratch = FreeScratch::default();
                while core.deferred.wait_for_work() {
                    core.deferred
                        .drain_resizing(|indices| core.free_many(indices, &mut scratch));
                }
            });
        match spawned {
            Ok(handle) => {
                *worker = Some(handle);
                true
            }
            Err(_) => false,
        }
    }

    #[cfg(test)]
    fn frames(&self) -> &FrameAllocator {
        &self.core.frames
    }
}

/// Serving swap, the reserve's refiller compacts the pool before it takes fresh pages, as
/// reclaim calls the kernel's zsmalloc shrinker.
impl page_alloc::Shrinker for PoolCore {
    fn freeable_pages(&self) -> u64 {
        self.classes
            .iter()
            .map(|class| class.state.lock().freeable_pages(&class.info))
            .sum()
    }

    fn shrink(&self) -> u64 {
        let mut freed_pages = 0;
        for class in self.classes.iter().rev() {
            if class.state.lock().freeable_pages(&class.info) == 0 {
                continue;
            }
            let freed = self.compact_class(class);
            self.pages_compacted.fetch_add(freed, Ordering::Relaxed);
            freed_pages += freed;
        }
        freed_pages
    }

    fn keep_ahead(&self, tick: bool) {
        self.handles.keep_ahead(tick);
    }
}

impl std::ops::Deref for ZsPool {
    type Target = PoolCore;
    fn deref(&self) -> &PoolCore {
        &self.core
    }
}

impl Drop for ZsPool {
    /// Stops the worker (waiting for the batch it is freeing), then frees what is still queued.
    fn drop(&mut self) {
        if !self.core.shared_frames {
            self.core.frames.stop_refiller();
        }
        self.core.deferred.stop();
        if let Some(worker) = self.worker.get_mut().take() {
            if let Err(panic) = worker.join() {
                if !std::thread::panicking() {
                    std::panic::resume_unwind(panic);
                }
            }
        }
        self.core.flush();
    }
}

impl Drop for PoolCore {
    /// A pool of the server's shared allocator gives every frame back to it (its own allocator
    /// unmaps everything when it drops instead).
    fn drop(&mut self) {
        if !self.shared_frames {
            return;
        }
        for class in self.classes.iter() {
            let ids = class.state.lock().zspage_ids();
            for id in 0..ids {
                let Some(desc) = class.descs.get(id) else {
                    continue;
                };
                if let Some(frame) = desc.write().take() {
                    self.frames.clear_record(&frame);
                    self.frames.release(frame, class.info.pages_per_zspage);
                }
            }
        }
        let spans = self.spans.state.get_mut().next_id;
        for id in 0..u64::from(spans) {
            let Some(desc) = self.spans.descs.get(id) else {
                continue;
            };
            if let Some(span) = desc.write().take() {
                self.frames.clear_record(&span.frame);
                self.frames.release(span.frame, span.pages);
            }
        }
        // Every record naming the tag is cleared: another pool may take it.
        self.frames.give_back_pool_tag(self.pool_tag);
    }
}

/// The memory a pool holds besides its zspages (`total_pages`, the device's `mem_used_total`),
/// in bytes: its bookkeeping, which the kernel's zsmalloc keeps in slab caches that
/// `mem_used_total` does not count either, and the frame cache. See `docs/zsmalloc.md`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolMeta {
    /// The handle table: 8 bytes per handle index ever used (whole pages of them) and a header
    /// page; never shrinks (the kernel: its `zs_handle` slab).
    pub handle_table_bytes: u64,
    /// Zspage and span descriptors (never shrink), slot tables of live zspages (4 bytes per
    /// object slot), fullness lists, free ids and handle indices, and the frame records (16
    /// bytes per frame ever carved: `docs/restart.md`) (the kernel: its `zspage` slab).
    pub zspage_meta_bytes: u64,
    /// Frames of freed zspages kept resident for reuse (at most 2 MiB; emptied by compaction).
    /// 0 when serving swap: the server's allocator is shown in `swap_reserve`.
    pub frame_cache_bytes: u64,
    /// The deferred-free queue's blocks (8 bytes per slot, touched): its resting blocks, and
    /// more while a release larger than them is pending.
    pub deferred_queue_bytes: u64,
    /// Serving swap: the server's swap reserve, which this pool shares with every other.
    pub swap_reserve: Option<crate::memory::SwapReserveStats>,
}

/// Counters of one merged class (a row of the kernel's
/// `/sys/kernel/debug/zsmalloc/zramN/classes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassStats {
    /// The kernel's class index (the largest candidate merged into this class).
    pub index: usize,
    /// Slot size.
    pub size_bytes: usize,
    /// Pages per zspage.
    pub pages_per_zspage: usize,
    /// Objects per zspage.
    pub objs_per_zspage: usize,
    /// Zspages of this class.
    pub zspages: u64,
    /// Object slots in those zspages (`obj_allocated`).
    pub objs_allocated: u64,
    /// Objects in use (`obj_used`).
    pub objs_inuse: u64,
    /// Pages of those zspages (`pages_used`).
    pub pages_used: u64,
    /// Pages compaction could free now (`freeable`).
    pub freeable_pages: u64,
    /// Zspages per in-use ratio group: `<10%`, `<20%`, ..., `<100%` (the kernel's `99%`
    /// column), `100%`.
    pub inuse_ratio_zspages: [u64; NR_GROUPS - 1],
}

/// Counters of the spans (objects larger than a pool page; see `span`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpanStats {
    /// Spans allocated.
    pub spans: u64,
    /// Their whole 4 KiB pages (counted in `total_pages`).
    pub pages: u64,
    /// Spans with a tail object (counted in its class, as any object).
    pub tails: u64,
    /// Bytes of those tails.
    pub tail_bytes: u64,
}

/// A snapshot of the pool's counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    /// Largest object (the device's page size); classes are of 4 KiB pages.
    pub page_size_bytes: usize,
    /// See [`PoolCore::huge_class_size_bytes`].
    pub huge_class_size_bytes: usize,
    /// Objects larger than a pool page.
    pub spans: SpanStats,
    /// See [`PoolCore::total_pages`].
    pub total_pages: u64,
    /// See [`PoolCore::pages_compacted`].
    pub pages_compacted: u64,
    /// Handle-table entries ever used (its high-water mark; 8 bytes each).
    pub handles: u64,
    /// Address space reserved for zspages.
    pub reserved_bytes: u64,
    /// Every merged class, ascending by size.
    pub classes: Vec<ClassStats>,
}

impl fmt::Display for PoolStats {
    /// The kernel's debugfs `classes` table.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, " class  size")?;
        for pc in [
            "10%", "20%", "30%", "40%", "50%", "60%", "70%", "80%", "90%", "99%", "100%",
        ] {
            write!(f, " {pc:>9}")?;
        }
        writeln!(
            f,
            " obj_allocated   obj_used pages_used pages_per_zspage freeable"
        )?;
        let mut total = ClassStats {
            index: 0,
            size_bytes: 0,
            pages_per_zspage: 0,
            objs_per_zspage: 0,
            zspages: 0,
            objs_allocated: 0,
            objs_inuse: 0,
            pages_used: 0,
            freeable_pages: 0,
            inuse_ratio_zspages: [0; NR_GROUPS - 1],
        };
        for c in &self.classes {
            write!(f, "{:>6} {:>5}", c.index, c.size_bytes)?;
            for (i, n) in c.inuse_ratio_zspages.iter().enumerate() {
                write!(f, " {n:>9}")?;
                total.inuse_ratio_zspages[i] += n;
            }
            writeln!(
                f,
                " {:>13} {:>10} {:>10} {:>16} {:>8}",
                c.objs_allocated, c.objs_inuse, c.pages_used, c.pages_per_zspage, c.freeable_pages
            )?;
            total.objs_allocated += c.objs_allocated;
            total.objs_inuse += c.objs_inuse;
            total.pages_used += c.pages_used;
            total.freeable_pages += c.freeable_pages;
        }
        write!(f, "{:>6} {:>5}", "Total", "")?;
        for n in total.inuse_ratio_zspages {
            write!(f, " {n:>9}")?;
        }
        writeln!(
            f,
            " {:>13} {:>10} {:>10} {:>16} {:>8}",
            total.objs_allocated, total.objs_inuse, total.pages_used, "", total.freeable_pages
        )?;
        if self.page_size_bytes > POOL_PAGE_BYTES {
            let r = &self.spans;
            writeln!(
                f,
                "spans {} pages_used {} tails {} tail_bytes {}",
                r.spans, r.pages, r.tails, r.tail_bytes
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use std::sync::{Arc, Mutex};

    /// Tests that measure memory or run long hold this, so they do not disturb each other.
    pub(crate) static HEAVY: Mutex<()> = Mutex::new(());

    pub(crate) fn heavy() -> std::sync::MutexGuard<'static, ()> {
        HEAVY.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A pool serving swap keeps its handle table's words ahead of need, in proportion to the
    /// objects it took rather than to a device's pages: every index handed out has its word
    /// resident (a writer never faults one in), a burst past the window waits for the
    /// refiller, and what is held stays near the objects taken.
    #[test]
    fn handle_words_are_kept_ahead_of_need_serving_swap() {
        let _heavy = heavy();
        let reserve = crate::memory::SwapReserve::new(8 << 20).unwrap();
        let pool = ZsPool::with_swap_reserve(4096, None, &reserve).unwrap();
        pool.keep_handles_ahead();
        let t = &pool.core.handles;
        assert!(t.headroom() >= handle::HANDLES_AHEAD_MIN);
        assert!(
            t.headroom() < 2 * handle::HANDLES_AHEAD_MIN,
            "a window, not a device"
        );
        // Three windows of small objects, as fast as one thread goes; a write the refiller
        // could not keep up with (a loaded machine) fails with ENOMEM and is made again, as
        // the kernel issues a swap-out again.
        let n = 3 * handle::HANDLES_AHEAD_MIN;
        let mut held = Vec::new();
        let mut refused = 0;
        while (held.len() as u64) < n {
            match pool.malloc(100) {
                Ok(h) => {
                    assert!(
                        t.indices() <= t.resident_words(),
                        "index {} handed out past the resident words {}",
                        t.indices(),
                        t.resident_words()
                    );
                    pool.write(h, &pattern(held.len() as u64, 100));
                    held.push(h);
                }
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::NoMemory, "{e}");
                    refused += 1;
                    assert!(refused < 1000, "the refiller never kept up");
                }
            }
        }
        for (i, h) in held.iter().enumerate() {
            assert!(pool.read(*h, |b| b == pattern(i as u64, 100)));
        }
        let words = t.resident_words();
        assert!(
            words <= n * (1 + handle::HANDLES_AHEAD_TICKS) + handle::HANDLES_AHEAD_MIN + 512,
            "{words} words resident for {n} objects"
        );
    }

    /// Position- and seed-dependent bytes: a misplaced or shifted object is caught.
    pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
        (0..len as u64)
            .map(|i| {
                let x = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ i.wrapping_mul(0x2545_F491_4F6C_DD1D))
                .wrapping_add(i >> 3);
                (x >> 56) as u8 ^ (i as u8)
            })
            .collect()
    }

    pub(crate) fn check_obj(pool: &ZsPool, h: Handle, seed: u64, len: usize) {
        let want = pattern(seed, len);
        pool.read(h, |got| {
            assert_eq!(got.len(), len, "{h:?}");
            assert!(
                got == want.as_slice(),
                "{h:?} (seed {seed}, {len} bytes) corrupted"
            );
        });
    }

    /// Canary: the checker used by every test does catch a single wrong byte.
    #[test]
    #[should_panic(expected = "corrupted")]
    fn checker_catches_one_wrong_byte() {
        let pool = ZsPool::new(4096).unwrap();
        let h = pool.malloc(1000).unwrap();
        let mut data = pattern(7, 1000);
        data[999] ^= 1;
        pool.write(h, &data);
        check_obj(&pool, h, 7, 1000);
    }

    #[test]
    fn pool_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ZsPool>();
        assert_send_sync::<Handle>();
    }

    #[test]
    fn new_rejects_bad_page_sizes() {
        for p in [0, 512, 4095, 8192, 1 << 20] {
            assert_eq!(
                ZsPool::new(p).unwrap_err().kind(),
                ErrorKind::InvalidArgument
            );
        }
        for p in SUPPORTED_PAGE_SIZES_BYTES {
            let pool = ZsPool::new(p).unwrap();
            assert_eq!(pool.page_size_bytes(), p);
            assert_eq!(pool.total_pages(), 0);
        }
        assert_eq!(ZsPool::new(4096).unwrap().huge_class_size_bytes(), 3633);
    }

    #[test]
    fn malloc_rejects_bad_sizes() {
        let pool = ZsPool::new(4096).unwrap();
        assert_eq!(
            pool.malloc(0).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            pool.malloc(4097).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(pool.total_pages(), 0);
    }

    fn round_trip(page: usize, sizes: impl Iterator<Item = usize>, copies: usize) {
        let pool = ZsPool::new(page).unwrap();
        let mut live = Vec::new();
        for (n, size) in sizes.enumerate() {
            for c in 0..copies {
                let seed = (n * copies + c) as u64;
                let h = pool.malloc(size).unwrap();
                pool.write(h, &pattern(seed, size));
                assert_eq!(pool.obj_size_bytes(h), size);
                live.push((h, seed, size));
            }
        }
        pool.check();
        for &(h, seed, size) in &live {
            check_obj(&pool, h, seed, size);
        }
        let stats = pool.stats();
        // Objects up to a pool page are in classes; larger ones are spans, whose tails are
        // objects in classes too.
        let spans = live.iter().filter(|l| l.2 > POOL_PAGE_BYTES).count() as u64;
        assert_eq!(stats.spans.spans, spans);
        let inuse: u64 = stats.classes.iter().map(|c| c.objs_inuse).sum();
        assert_eq!(inuse, live.len() as u64 - spans + stats.spans.tails);
        let pages: u64 = stats.classes.iter().map(|c| c.pages_used).sum();
        assert_eq!(pages + stats.spans.pages, pool.total_pages());
        // Free every other object, check the rest, then free them too.
        for &(h, _, _) in live.iter().step_by(2) {
            pool.free(h);
        }
        pool.check();
        for &(h, seed, size) in live.iter().skip(1).step_by(2) {
            check_obj(&pool, h, seed, size);
            pool.free(h);
        }
        pool.check();
        assert_eq!(pool.total_pages(), 0);
        assert_only_the_frame_cache_stays(&pool);
    }

    #[test]
    fn round_trip_every_size_4k() {
        round_trip(4096, 1..=4096, 3);
    }

    #[test]
    fn round_trip_16k() {
        round_trip(
            16384,
            (1..=16384).step_by(7).chain([
                16384,
                4096,
                4097,
                4096 + 3632,
                4096 + 3633,
                12288 + 3633,
            ]),
            2,
        );
    }

    #[test]
    fn round_trip_64k() {
        round_trip(
            65536,
            (1..=65536)
                .step_by(61)
                .chain([65536, 4096, 4097, 61472, 61473, 65535]),
            2,
        );
    }

    #[test]
    fn footprint_is_the_class_or_the_run() {
        let pool = ZsPool::new(65536).unwrap();
        assert_eq!(pool.footprint_bytes(1), 32);
        assert_eq!(pool.footprint_bytes(3633), 4096);
        assert_eq!(pool.footprint_bytes(4096), 4096);
        assert_eq!(pool.footprint_bytes(4097), 4096 + 32);
        assert_eq!(pool.footprint_bytes(8192 + 100), 8192 + 112);
        assert_eq!(pool.footprint_bytes(4096 + 3633), 8192);
        assert_eq!(pool.footprint_bytes(65536), 65536);
        // Monotone: a smaller object never takes more.
        let mut last = 0;
        for size in 1..=65536 {
            let f = pool.footprint_bytes(size);
            assert!(f >= last && f >= size, "{size}: {f}");
            last = f;
        }
    }

    #[test]
    fn partial_write_keeps_the_tail() {
        let pool = ZsPool::new(4096).unwrap();
        let h = pool.malloc(100).unwrap();
        pool.write(h, &[1; 100]);
        pool.write(h, &[2; 10]);
        pool.read(h, |b| {
            assert_eq!(b, [[2u8; 10].as_slice(), &[1; 90]].concat())
        });
        pool.free(h);
    }

    #[test]
    #[should_panic(expected = "writing 101 bytes")]
    fn oversized_write_panics() {
        let pool = ZsPool::new(4096).unwrap();
        let h = pool.malloc(100).unwrap();
        pool.write(h, &[0; 101]);
    }

    #[test]
    #[should_panic(expected = "use of freed")]
    fn double_free_panics() {
        let pool = ZsPool::new(4096).unwrap();
        let h = pool.malloc(100).unwrap();
        pool.free(h);
        pool.free(h);
    }

    #[test]
    fn handles_are_reused_within_a_class() {
        let pool = ZsPool::new(4096).unwrap();
        let a = pool.malloc(100).unwrap();
        pool.free(a);
        let b = pool.malloc(100).unwrap();
        assert_eq!(a, b);
        assert_eq!(Handle::from_raw(b.to_raw()), Some(b));
        pool.free(b);
    }

    #[test]
    fn total_pages_follow_zspages() {
        let pool = ZsPool::new(4096).unwrap();
        // 3632-byte class: 9 objects on 8 pages.
        let hs: Vec<Handle> = (0..9).map(|_| pool.malloc(3632).unwrap()).collect();
        assert_eq!(pool.total_pages(), 8);
        let tenth = pool.malloc(3632).unwrap();
        assert_eq!(pool.total_pages(), 16);
        pool.free(tenth);
        assert_eq!(pool.total_pages(), 8);
        // Huge objects take a page each.
        let huge: Vec<Handle> = (0..3).map(|_| pool.malloc(3633).unwrap()).collect();
        assert_eq!(pool.total_pages(), 11);
        for h in hs.into_iter().chain(huge) {
            pool.free(h);
        }
        assert_eq!(pool.total_pages(), 0);
        let s = pool.stats();
        assert!(s
            .classes
            .iter()
            .all(|c| c.zspages == 0 && c.objs_inuse == 0));
        assert!(s.to_string().contains("obj_allocated"));
    }

    #[test]
    fn deferred_free_holds_memory_until_flush() {
        // Capacity 64: half full at 32, so 20 handles never wake the worker.
        let pool = ZsPool::with_deferred_capacity(4096, Some(64)).unwrap();
        let hs: Vec<Handle> = (0..20).map(|_| pool.malloc(3000).unwrap()).collect();
        let held = pool.total_pages();
        for &h in &hs {
            pool.free_deferred(h);
        }
        let s = pool.deferred_stats();
        assert_eq!(
            (s.queued, s.pending, s.wakeups, s.capacity),
            (20, 20, 0, 64)
        );
        // Still allocated: memory and objects are counted until the queue is drained.
        assert_eq!(pool.total_pages(), held);
        let inuse: u64 = pool.stats().classes.iter().map(|c| c.objs_inuse).sum();
        assert_eq!(inuse, 20);
        assert_eq!(pool.flush(), 20);
        assert_eq!(pool.flush(), 0);
        pool.check();
        assert_eq!(pool.total_pages(), 0);
        let s = pool.deferred_stats();
        assert_eq!((s.drains, s.drained, s.pending), (1, 20, 0));
    }

    #[test]
    fn deferred_free_falls_back_when_full_and_worker_drains() {
        let pool = ZsPool::with_deferred_capacity(4096, Some(8)).unwrap();
        // Allocate everything first, so handles are not recycled between rounds.
        let hs: Vec<Handle> = (0..4000u64)
            .map(|s| {
                let h = pool.malloc(100 + (s as usize % 3000)).unwrap();
                pool.write(h, &pattern(s, 100 + (s as usize % 3000)));
                h
            })
            .collect();
        for (s, &h) in hs.iter().enumerate() {
            if s % 2 == 0 {
                pool.free_deferred(h);
            }
        }
        for (s, &h) in hs.iter().enumerate() {
            if s % 2 == 1 {
                check_obj(&pool, h, s as u64, 100 + (s % 3000));
                pool.free(h);
            }
        }
        pool.flush();
        pool.check();
        assert_eq!(pool.total_pages(), 0);
        let s = pool.deferred_stats();
        assert_eq!(
            s.queued + s.fallback_contended + s.fallback_full,
            2000,
            "{s:?}"
        );
        assert_eq!(s.queued, s.drained);
        assert!(s.wakeups > 0, "{s:?}");
    }

    #[test]
    #[should_panic(expected = "use of freed")]
    fn deferred_free_of_a_freed_handle_panics() {
        let pool = ZsPool::new(4096).unwrap();
        let h = pool.malloc(100).unwrap();
        pool.free(h);
        pool.free_deferred(h);
    }

    /// Threads defer frees of their objects while others compact and flush; the worker runs
    /// (small queue). Objects queued may be moved by compaction before they are freed. In the
    /// end the pool is empty and every object read back intact before it was released.
    #[test]
    fn deferred_free_races_compaction_and_flush() {
        let _heavy = heavy();
        let pool = Arc::new(ZsPool::with_deferred_capacity(4096, Some(16)).unwrap());
        std::thread::scope(|s| {
            for t in 0..2u64 {
                let pool = &pool;
                s.spawn(move || {
                    let mut live = Vec::new();
                    for i in 0..30_000u64 {
                        let seed = t << 32 | i;
                        let size = 1 + (seed.wrapping_mul(2654435761) % 2000) as usize;
                        let h = pool.malloc(size).unwrap();
                        pool.write(h, &pattern(seed, size));
                        live.push((h, seed, size));
                        if live.len() > 300 {
                            for (h, seed, size) in live.drain(..200) {
                                check_obj(pool, h, seed, size);
                                pool.free_deferred(h);
                            }
                        }
                    }
                    for (h, _, _) in live {
                        pool.free_deferred(h);
                    }
                });
            }
            let pool = &pool;
            s.spawn(move || {
                for _ in 0..200 {
                    pool.compact();
                    pool.flush();
                }
            });
        });
        pool.flush();
        pool.check();
        assert_eq!(pool.total_pages(), 0);
        let s = pool.deferred_stats();
        assert_eq!(s.queued, s.drained);
        assert_eq!(s.queued + s.fallback_contended + s.fallback_full, 60_000);
    }

    #[test]
    fn drop_flushes_the_queue() {
        // The pages of queued objects go back before the frame allocator is unmapped; a leak
        // would trip the descriptor's frame assertions only in debug, so count instead.
        let pool = ZsPool::with_deferred_capacity(4096, Some(1024)).unwrap();
        let core = pool.core.clone();
        for _ in 0..100 {
            pool.free_deferred(pool.malloc(2000).unwrap());
        }
        assert!(core.total_pages() > 0);
        drop(pool);
        assert_eq!(core.total_pages(), 0);
        assert_eq!(core.deferred.stats().pending, 0);
    }

    /// A release larger than the queue while its worker cannot drain: the queue fills its own
    /// blocks, then the stock's, then the rest is freed by the caller; once the worker runs,
    /// everything queued is freed, and a pool dropped with a second release queued frees it.
    /// A handle freed twice would panic (its word is 0); one lost would keep pages.
    #[test]
    fn a_release_past_the_queue_and_its_stock_is_freed_once() {
        // Blocks of 8, 2 at rest, and a stock of 2 blocks of its own.
        let pool = ZsPool::with_deferred_capacity(4096, Some(16)).unwrap();
        let core = pool.core.clone();
        let hs: Vec<Handle> = (0..100u64)
            .map(|s| {
                let h = pool.malloc(500 + s as usize * 30).unwrap();
                pool.write(h, &pattern(s, 500 + s as usize * 30));
                h
            })
            .collect();
        let inuse =
            |pool: &ZsPool| -> u64 { pool.stats().classes.iter().map(|c| c.objs_inuse).sum() };
        let held = core.deferred.hold_drains();
        for &h in &hs[..60] {
            pool.free_deferred(h);
        }
        let s = pool.deferred_stats();
        assert_eq!(
            (s.queued, s.fallback_full, s.pending),
            (32, 28, 32),
            "{s:?}"
        );
        assert_eq!(s.capacity, 32, "2 own blocks and 2 of the stock");
        assert_eq!(inuse(&pool), 100 - 28, "the fallbacks were freed at once");
        for (s, &h) in hs.iter().enumerate().skip(60) {
            check_obj(&pool, h, s as u64, 500 + s * 30);
        }
        drop(held);
        pool.flush();
        pool.check();
        assert_eq!(inuse(&pool), 40);
        let s = pool.deferred_stats();
        assert_eq!((s.drained, s.pending), (32, 0));
        let held = core.deferred.hold_drains();
        for &h in &hs[60..] {
            pool.free_deferred(h);
        }
        assert_eq!(pool.deferred_stats().pending, 32);
        drop(held);
        // Reset: the pool drops with 32 handles queued.
        drop(pool);
        assert_eq!(core.total_pages(), 0);
        assert_eq!(core.deferred.stats().pending, 0);
        assert_eq!(
            core.deferred.stats().queued + core.deferred.stats().fallback_full,
            100
        );
    }

    #[test]
    fn baseline_switch_frees_the_same_way() {
        let pool = ZsPool::bench_new_release_under_class_lock(4096).unwrap();
        let hs: Vec<Handle> = (0..500).map(|_| pool.malloc(3632).unwrap()).collect();
        assert!(pool.total_pages() > 0);
        for h in hs {
            pool.free(h);
        }
        pool.check();
        assert_eq!(pool.total_pages(), 0);
        assert_only_the_frame_cache_stays(&pool);
    }

    /// With every object freed, only the frame cache (at most `FRAME_CACHE_BYTES`) and the
    /// reserve are still resident, and compaction gives those back too.
    fn assert_only_the_frame_cache_stays(pool: &ZsPool) {
        assert_eq!(pool.total_pages(), 0);
        let cached = pool.frames().cached_pages() * POOL_PAGE_BYTES;
        assert!(cached <= page_alloc::FRAME_CACHE_BYTES);
        // The refiller may still be populating; stop it so the count is exact.
        pool.frames().stop_refiller();
        let reserve = pool.frames().reserve_pages() * POOL_PAGE_BYTES;
        assert!(reserve <= 16 * page_alloc::FRAME_RESERVE_PAGES * POOL_PAGE_BYTES);
        let batch = pool.frames().dropping_batch_pages() * POOL_PAGE_BYTES;
        assert!(batch < page_alloc::DROP_BATCH_PAGES * POOL_PAGE_BYTES);
        assert_eq!(
            pool.frames().resident_bytes(),
            cached + reserve + batch,
            "only the frame cache, the reserve and a partial drop batch stay"
        );
        pool.compact();
        assert_eq!(
            pool.frames().resident_bytes(),
            0,
            "compaction trims the frame cache"
        );
    }

    /// The process's resident set, from `/proc/self/smaps_rollup`.
    fn rss_bytes() -> u64 {
        let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap();
        let line = rollup.lines().find(|l| l.starts_with("Rss:")).unwrap();
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib * 1024
    }

    /// Runs the test `name` alone in a child process (the test binary re-executed with
    /// `--exact`), so process-wide measurements are not disturbed by concurrent tests. Returns
    /// true in the child, which should then do the work.
    pub(crate) fn isolated(name: &str) -> bool {
        const CHILD: &str = "UZRAM_ZSMALLOC_ISOLATED_CHILD";
        if std::env::var_os(CHILD).is_some() {
            return true;
        }
        // argv[0] rather than current_exe(): under valgrind, /proc/self/exe is the tool.
        let exe = std::env::args_os()
            .next()
            .map(std::path::PathBuf::from)
            .filter(|p| p.is_file())
            .unwrap_or_else(|| std::env::current_exe().unwrap());
        let out = std::process::Command::new(exe)
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "isolated {name} failed:\n{stdout}\n{stderr}"
        );
        false
    }

    #[test]
    fn freeing_returns_memory_to_the_os() {
        if !isolated("zsmalloc::tests::freeing_returns_memory_to_the_os") {
            return;
        }
        const TOTAL_BYTES: usize = 64 << 20;
        let pool = ZsPool::new(4096).unwrap();
        let sizes = [700usize, 1500, 2900, 3633, 64];
        let mut hs = Vec::with_capacity(TOTAL_BYTES / 64);
        let before = rss_bytes();
        let mut bytes = 0;
        let mut seed = 0u64;
        while bytes < TOTAL_BYTES {
            let size = sizes[hs.len() % sizes.len()];
            let h = pool.malloc(size).unwrap();
            pool.write(h, &pattern(seed, size));
            hs.push(h);
            bytes += size;
            seed += 1;
        }
        // Stopped so the reserve does not change between the two counts.
        pool.frames().stop_refiller();
        let resident = pool.frames().resident_bytes() as u64;
        let held = (pool.total_pages() + pool.frames().reserve_pages() as u64) * 4096;
        assert!(resident >= TOTAL_BYTES as u64, "resident {resident}");
        assert!(resident <= held, "resident {resident} > held {held}");
        let full = rss_bytes();
        assert!(
            full >= before + TOTAL_BYTES as u64 * 9 / 10,
            "rss {before} -> {full}"
        );
        for h in hs.drain(..) {
            pool.free(h);
        }
        assert_eq!(pool.total_pages(), 0);
        assert_only_the_frame_cache_stays(&pool);
        let after = rss_bytes();
        eprintln!("rss: {before} before, {full} with 64 MiB of objects, {after} after free");
        assert!(
            full.saturating_sub(after) >= TOTAL_BYTES as u64 * 9 / 10,
            "rss {before} -> {full} -> {after}: freed zspages still resident"
        );
    }
}
