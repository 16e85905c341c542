//! The deferred-free queue (upstream's `zs_free_deferred()`, 2026), grown past upstream's bound.
//!
//! Freeing an object costs a class lock and, when its zspage empties, returning pages. On a
//! release path (TRIM of a range, a swap area's pages freed on process exit) that cost lands on
//! the releasing task. [`DeferredQueue`] lets such a caller hand the handle over instead: it is
//! freed later, in blocks, by a background worker (woken once the queue holds
//! [`DEFERRED_WAKE_ITEMS`] items, or half its resting capacity if that is smaller) or by
//! [`DeferredQueue::drain`] (the pool's `flush()`), which also runs when the pool is dropped.
//!
//! The queue is generic over its items (the pool queues `Handle`s, the loom model plain
//! integers) and never frees anything itself: draining calls a closure on each block of items.
//!
//! # Blocks
//!
//! Items live in *blocks* of `block_items` slots ([`DEFERRED_BLOCK_ITEMS`] for the pool): the
//! block being filled (`current`), a list of full blocks, and a list of *spare* (empty) blocks.
//! A block's buffer is allocated, and its pages touched, by the worker; an enqueue never
//! allocates, it only moves a spare block in when `current` is full. So the queue's size is
//! not fixed: it is the blocks the worker has made. The worker keeps at least twice as many
//! spare blocks as queued ones (checked before each block it frees), so while releasers outrun
//! it the queue triples ahead of them, and a release of any size is queued whole
//! unless the worker falls that far behind. An enqueue that finds no spare block first takes
//! one from the queue's *stock* ([`BlockStock`]: the pools of a process share one of
//! [`DEFERRED_STOCK_BYTES`]), which covers the start of a release while the scheduler has not
//! yet run the worker; with none there either, enqueues fall back to freeing synchronously
//! until the worker catches up. At rest the queue keeps `rest_blocks` blocks (upstream's
//! budget, [`DEFERRED_FREE_BUDGET_BYTES`] of released pages); a worker drain that leaves the
//! queue empty gives the blocks beyond that to the stock (up to its size, freeing the rest)
//! and tops the stock up; a dropped queue gives its blocks to the stock too.
//!
//! Bound: every queued item is an object the pool still holds, and the worker allocates only
//! while the blocks would not exceed three times those holding pending items (queued or in its
//! batch), so the queue takes at most three slots per pending object plus its resting blocks
//! and those it took from the stock, which never holds more than its size
//! (docs/zsmalloc.md, "Deferred free").
//!
//! # Protocol
//!
//! - **Enqueue** ([`try_enqueue`](DeferredQueue::try_enqueue)) only *try*-locks the queue. If
//!   the lock is busy (another enqueuer, or a drainer taking blocks), the queue holds
//!   `max_items`, or `current` is full and no spare block is left (nor one in the stock, whose
//!   lock is only try-locked too), the item is handed back and the caller frees it
//!   synchronously: a caller never waits for the queue and never allocates.
//! - **Wake**: the enqueue that finds the queue at its wake mark (`wake_at`) or past it after
//!   its push, and no wake already requested (`wake_requested`), asks its caller to
//!   [`wake`](DeferredQueue::wake) the worker. The worker clears `wake_requested` *before* it
//!   drains, so items arriving during a drain can request the next one; a wake is recorded under
//!   the signal mutex, which the worker checks before sleeping, so none is lost. An enqueue
//!   refused for want of a spare block needs no wake of its own: with no spare block, every
//!   block is either queued (at least one full block: past the wake mark, so a wake is
//!   requested or the worker is draining, and it grows the queue before its next block) or in
//!   a drainer's batch (which returns its blocks as it frees them).
//! - **Drain** takes the drain mutex (one drainer at a time), takes every queued block (full
//!   ones and `current`) under the queue lock (O(1): a list head and a block), then frees them
//!   oldest first *with only the drain mutex held*, giving each block back to the spare list
//!   (under the queue lock, O(1)) as soon as it is empty. The worker's drain
//!   ([`drain_resizing`](DeferredQueue::drain_resizing)) also grows the spare list before each
//!   block and shrinks the queue back to its resting blocks when it ends with the queue empty;
//!   allocation and deallocation happen with no queue lock held.
//! - **Flush** is a drain. Because a drainer holds the drain mutex until its whole batch is
//!   freed, a drain that returns has freed everything enqueued before it was called: each such
//!   item was either queued when this drain took the blocks, or in the batch of an earlier
//!   drain that finished before this one got the drain mutex.
//!
//! Exactly once: an item is in exactly one place at a time (handed back to the caller, in a
//! queued block, or in one drainer's batch), moved between them under the lock that protects
//! both ends, and a batch is emptied by the drainer that took it. The loom model
//! (`loom_model` below, run by `scripts/test` with `--cfg loom`) checks this with a worker that
//! grows and shrinks the queue, enqueuers and a flusher in every interleaving within its bounds.
//!
//! # Locks
//!
//! | lock | protects |
//! |------|----------|
//! | `queue` | the queued blocks, the spare blocks, the item count; `queued` is bumped under it |
//! | `drain` | nothing but the right to drain: held for a whole batch |
//! | `signal` | the worker's `wake` and `stop` flags (with `cond`) |
//! | the stock's `blocks` | the stock's empty blocks |
//!
//! Order: `drain` → `queue` → stock (the stock's lock is only try-locked under `queue`;
//! blocks are given back with no queue lock held). `signal` is never held with another. The
//! closure given to `drain` runs with `drain` held and must not call back into this queue.

#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
use loom::sync::{Condvar, Mutex, MutexGuard};
use std::mem::MaybeUninit;
use std::sync::Arc;
// loom's `Mutex::try_lock` returns std's `TryLockResult`.
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
use std::sync::TryLockError;
#[cfg(not(loom))]
use std::sync::{Condvar, Mutex, MutexGuard, TryLockError};

/// The queue's resting budget in *uncompressed* bytes: 128 MiB, upstream's whole capacity (its
/// queue holds `128 MiB >> PAGE_SHIFT` handles). Each queued handle stands for one page that
/// was released; the queue keeps blocks for this many at rest (32768 handles, 128 KiB of
/// handle indices, for 4 KiB pages; 2048 for 64 KiB pages) and grows past it during a larger
/// release.
pub const DEFERRED_FREE_BUDGET_BYTES: usize = 128 << 20;

/// Slots per block: 1024 handles (4 KiB of handle indices: one page), two 2 MiB discards of
/// 4 KiB pages. A block is the
/// unit the worker allocates, frees and gives back, and the granularity at which it looks at
/// the queue's growth.
pub const DEFERRED_BLOCK_ITEMS: usize = 1024;

/// The process-wide stock of empty blocks ([`BlockStock`]): 2 MiB, 512 blocks of
/// [`DEFERRED_BLOCK_ITEMS`] handle indices, enough for 2 GiB of released 4 KiB pages. A queue
/// whose own spare blocks ran out takes blocks from it before it falls back to freeing
/// synchronously, so a release outruns its pool's worker without falling back for the first
/// 524,288 handles beyond the queue's own blocks (about 11 ms of one releasing thread), however
/// late the scheduler runs the worker.
pub const DEFERRED_STOCK_BYTES: usize = 2 << 20;

/// The worker is woken once this many items wait (or half the resting capacity, if that comes
/// first): 1024 handles, one block. Woken this early it drains while the releasers still
/// enqueue, in batches large enough that the frame allocator drops emptied zspages in whole
/// batches (`page_alloc::DROP_BATCH_PAGES`), for one wake-up (a futex call) per 1024 handles.
pub const DEFERRED_WAKE_ITEMS: usize = 1024;

/// The default resting capacity (items) for a pool of `page_size_bytes` pages.
pub fn default_capacity(page_size_bytes: usize) -> usize {
    DEFERRED_FREE_BUDGET_BYTES / page_size_bytes
}

/// A pool's queue, resting at `capacity` handle indices: with blocks of
/// [`DEFERRED_BLOCK_ITEMS`] slots it takes blocks from the process's stock
/// ([`DEFERRED_STOCK_BYTES`], shared by every such pool); a smaller queue (a test's) has
/// smaller blocks and a stock of its own, as many blocks as it rests with. The stock is topped
/// up here, off any release path.
#[cfg(not(loom))]
pub(crate) fn pool_queue(capacity: usize) -> DeferredQueue<u32> {
    static STOCK: std::sync::OnceLock<Arc<BlockStock<u32>>> = std::sync::OnceLock::new();
    let queue = DeferredQueue::new(capacity);
    let stock = if queue.block_items == DEFERRED_BLOCK_ITEMS {
        Arc::clone(STOCK.get_or_init(|| {
            let block_bytes = DEFERRED_BLOCK_ITEMS * std::mem::size_of::<u32>();
            Arc::new(BlockStock::new(
                DEFERRED_BLOCK_ITEMS,
                DEFERRED_STOCK_BYTES / block_bytes,
            ))
        }))
    } else {
        Arc::new(BlockStock::new(queue.block_items, queue.rest_blocks))
    };
    stock.top_up();
    queue.with_stock(stock)
}

/// Under loom (where the pool is never built, and a static cannot hold loom's locks) every
/// queue has a stock of its own.
#[cfg(loom)]
pub(crate) fn pool_queue(capacity: usize) -> DeferredQueue<u32> {
    let queue = DeferredQueue::new(capacity);
    let stock = Arc::new(BlockStock::new(queue.block_items, queue.rest_blocks));
    queue.with_stock(stock)
}

/// Counters of a deferred-free queue; shown by the device's `deferred_stat` attribute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeferredStats {
    /// Items put into the queue, cumulative.
    pub queued: u64,
    /// Items freed synchronously because the queue lock was busy.
    pub fallback_contended: u64,
    /// Items freed synchronously because the queue had no free slot (no spare block yet, or at
    /// its maximum).
    pub fallback_full: u64,
    /// Drain passes (worker or flush) that freed at least one item.
    pub drains: u64,
    /// Items freed by drains, cumulative.
    pub drained: u64,
    /// Items queued and not yet freed (`queued - drained`).
    pub pending: u64,
    /// Worker wake-ups requested (crossings of the wake mark).
    pub wakeups: u64,
    /// Slots the queue's blocks hold now (it grows during large releases and shrinks back).
    pub capacity: u64,
}

/// The worker's flags, under `DeferredQueue::signal`.
#[derive(Debug, Default)]
struct Signal {
    /// A drain was requested and the worker has not started it.
    wake: bool,
    /// The worker must exit.
    stop: bool,
}

/// A block of slots: a buffer of fixed capacity (it never reallocates: nobody pushes into a
/// full block) and the link of the list it is on.
#[derive(Debug)]
struct Block<T> {
    items: Vec<T>,
    next: Option<Box<Block<T>>>,
}

impl<T> Block<T> {
    /// An empty block of `slots` slots whose pages are touched, so the enqueues that fill it
    /// take no page faults.
    fn new(slots: usize) -> Box<Block<T>> {
        let mut items = Vec::with_capacity(slots);
        for slot in items.spare_capacity_mut() {
            *slot = MaybeUninit::zeroed();
        }
        Box::new(Block { items, next: None })
    }
}

/// A singly linked list of blocks (a stack: O(1) push and pop, never allocates).
#[derive(Debug)]
struct BlockList<T> {
    head: Option<Box<Block<T>>>,
    len: usize,
}

impl<T> Default for BlockList<T> {
    fn default() -> Self {
        BlockList { head: None, len: 0 }
    }
}

impl<T> BlockList<T> {
    fn push(&mut self, mut block: Box<Block<T>>) {
        block.next = self.head.take();
        self.head = Some(block);
        self.len += 1;
    }

    fn pop(&mut self) -> Option<Box<Block<T>>> {
        let mut block = self.head.take()?;
        self.head = block.next.take();
        self.len -= 1;
        Some(block)
    }

    /// The list in the opposite order (the oldest of a stack of full blocks first).
    fn reversed(mut self) -> BlockList<T> {
        let mut out = BlockList::default();
        while let Some(b) = self.pop() {
            out.push(b);
        }
        out
    }
}

impl<T> Drop for BlockList<T> {
    /// Iteratively: a long list dropped recursively could overflow the stack.
    fn drop(&mut self) {
        while self.pop().is_some() {}
    }
}

/// A stock of empty blocks shared by several queues (the pools of a process share one:
/// [`DEFERRED_STOCK_BYTES`]). A queue with no spare block left takes one from it (try-locked:
/// an enqueue never waits for it); workers give blocks back when their queue shrinks, and top
/// it up to its size, off the release path. It never holds more than `size_blocks` blocks, so
/// it bounds what the queues can hold beyond their own growth.
#[derive(Debug)]
pub(crate) struct BlockStock<T> {
    /// Slots per block (every queue using the stock has blocks of this size).
    block_items: usize,
    /// Blocks the stock holds at most (and is topped up to).
    size_blocks: usize,
    /// The empty blocks.
    blocks: Mutex<BlockList<T>>,
    /// Blocks taken by queues, cumulative.
    taken: AtomicU64,
}

impl<T> BlockStock<T> {
    /// An empty stock of at most `size_blocks` blocks of `block_items` (at least 1) slots;
    /// [`top_up`](Self::top_up) fills it.
    pub(crate) fn new(block_items: usize, size_blocks: usize) -> BlockStock<T> {
        BlockStock {
            block_items: block_items.max(1),
            size_blocks,
            blocks: Mutex::new(BlockList::default()),
            taken: AtomicU64::new(0),
        }
    }

    /// Allocates blocks (with no lock held) until the stock holds its size. Never on a release
    /// path: called when a pool is made and by workers.
    pub(crate) fn top_up(&self) {
        let want = self.size_blocks.saturating_sub(lock(&self.blocks).len);
        if want == 0 {
            return;
        }
        let mut fresh = BlockList::default();
        for _ in 0..want {
            fresh.push(Block::new(self.block_items));
        }
        // Whatever another top-up or a queue's give-back filled meanwhile is dropped here.
        drop(self.give(fresh));
    }

    /// A block, if the stock's lock is free right now and it has one. Never waits, never
    /// allocates.
    fn try_take(&self) -> Option<Box<Block<T>>> {
        let mut blocks = match self.blocks.try_lock() {
            Ok(b) => b,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        let block = blocks.pop()?;
        drop(blocks);
        self.taken.fetch_add(1, Ordering::Relaxed);
        Some(block)
    }

    /// Takes empty blocks back up to the stock's size; returns those that did not fit (the
    /// caller frees them, outside any lock).
    fn give(&self, mut back: BlockList<T>) -> BlockList<T> {
        let mut blocks = lock(&self.blocks);
        while blocks.len < self.size_blocks {
            match back.pop() {
                Some(b) => blocks.push(b),
                None => break,
            }
        }
        back
    }

    /// Blocks the stock holds now.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn len(&self) -> usize {
        lock(&self.blocks).len
    }

    /// Blocks taken by queues so far.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn taken(&self) -> u64 {
        self.taken.load(Ordering::Relaxed)
    }
}

/// What the queue lock protects.
#[derive(Debug)]
struct Pending<T> {
    /// The block being filled (`None` once a drainer took it and no enqueue has needed one).
    current: Option<Box<Block<T>>>,
    /// Full blocks, newest first.
    full: BlockList<T>,
    /// Empty blocks, ready to become `current`.
    spare: BlockList<T>,
    /// Items in `current` and `full`.
    len: usize,
}

impl<T> Pending<T> {
    /// Blocks holding queued items.
    fn queued_blocks(&self) -> usize {
        self.full.len + usize::from(self.current.is_some())
    }
}

/// A queue of items to free later; see the module docs.
#[derive(Debug)]
pub(crate) struct DeferredQueue<T> {
    /// Slots per block (at least 1).
    block_items: usize,
    /// Blocks kept at rest (at least 2).
    rest_blocks: usize,
    /// Items the queue holds at most (its blocks never exceed what that needs, twice over).
    max_items: usize,
    /// The enqueue that brings the length to this (or past it) requests a drain.
    wake_at: usize,
    /// Where an enqueue takes a block when no spare one is left (blocks of `block_items`
    /// slots), and where the worker gives back blocks beyond the resting ones.
    stock: Option<Arc<BlockStock<T>>>,
    /// The queue lock: the queued and spare blocks. Enqueuers only try-lock it.
    queue: Mutex<Pending<T>>,
    /// The drain mutex: one drainer at a time, for its whole batch.
    drain: Mutex<()>,
    /// A wake-up was requested and the worker has not started draining since. Lets enqueuers
    /// past the wake mark skip the signal mutex.
    wake_requested: AtomicBool,
    signal: Mutex<Signal>,
    cond: Condvar,
    /// Blocks allocated (queued, spare, or in a drainer's batch).
    blocks: AtomicUsize,
    queued: AtomicU64,
    fallback_contended: AtomicU64,
    fallback_full: AtomicU64,
    drains: AtomicU64,
    drained: AtomicU64,
    wakeups: AtomicU64,
}

/// Locks `m`, ignoring poisoning: a panic while freeing a batch (a double free caught by the
/// allocator) must not turn every later flush into a second panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T> DeferredQueue<T> {
    /// A queue resting at `capacity` slots (raised to 2) that grows without a set maximum: in
    /// blocks of [`DEFERRED_BLOCK_ITEMS`], or of half the capacity if that is smaller.
    pub(crate) fn new(capacity: usize) -> DeferredQueue<T> {
        let capacity = capacity.max(2);
        let block_items = DEFERRED_BLOCK_ITEMS.min(capacity / 2);
        DeferredQueue::with_blocks(block_items, capacity.div_ceil(block_items), usize::MAX)
    }

    /// A queue of `rest_blocks` (raised to 2) blocks of `block_items` (raised to 1) slots at
    /// rest, holding at most `max_items` items. Its blocks are allocated here.
    pub(crate) fn with_blocks(
        block_items: usize,
        rest_blocks: usize,
        max_items: usize,
    ) -> DeferredQueue<T> {
        let block_items = block_items.max(1);
        let rest_blocks = rest_blocks.max(2);
        let mut spare = BlockList::default();
        for _ in 0..rest_blocks {
            spare.push(Block::new(block_items));
        }
        DeferredQueue {
            block_items,
            rest_blocks,
            max_items,
            wake_at: (rest_blocks * block_items / 2).clamp(1, DEFERRED_WAKE_ITEMS),
            stock: None,
            queue: Mutex::new(Pending {
                current: None,
                full: BlockList::default(),
                spare,
                len: 0,
            }),
            drain: Mutex::new(()),
            wake_requested: AtomicBool::new(false),
            signal: Mutex::new(Signal::default()),
            cond: Condvar::new(),
            blocks: AtomicUsize::new(rest_blocks),
            queued: AtomicU64::new(0),
            fallback_contended: AtomicU64::new(0),
            fallback_full: AtomicU64::new(0),
            drains: AtomicU64::new(0),
            drained: AtomicU64::new(0),
            wakeups: AtomicU64::new(0),
        }
    }

    /// The queue, taking blocks from `stock` when its own spare ones run out. Panics if the
    /// stock's blocks are not the queue's size.
    pub(crate) fn with_stock(mut self, stock: Arc<BlockStock<T>>) -> DeferredQueue<T> {
        assert_eq!(stock.block_items, self.block_items, "stock of other blocks");
        self.stock = Some(stock);
        self
    }

    /// Holds the drain mutex: no drain (the worker's, a flush) starts until the guard is
    /// dropped, so a test can make a release outrun a worker that never runs.
    #[cfg(test)]
    pub(crate) fn hold_drains(&self) -> MutexGuard<'_, ()> {
        lock(&self.drain)
    }

    /// Slots the queue's blocks hold now.
    pub(crate) fn capacity(&self) -> usize {
        self.blocks.load(Ordering::Relaxed) * self.block_items
    }

    /// Queues `item` if the queue lock is free right now and the queue has a free slot;
    /// otherwise hands it back (`Err`), and the caller must free it itself. `Ok(true)`: the
    /// queue reached its wake mark and the caller must call [`wake`](Self::wake). Never
    /// allocates.
    pub(crate) fn try_enqueue(&self, item: T) -> Result<bool, T> {
        let mut q = match self.queue.try_lock() {
            Ok(q) => q,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                self.fallback_contended.fetch_add(1, Ordering::Relaxed);
                return Err(item);
            }
        };
        let room = q
            .current
            .as_ref()
            .is_some_and(|b| b.items.len() < self.block_items);
        if !room && q.spare.len == 0 && q.len < self.max_items {
            // Lock order: queue, then stock (only try-locked).
            if let Some(b) = self.stock.as_ref().and_then(|s| s.try_take()) {
                self.blocks.fetch_add(1, Ordering::Relaxed);
                q.spare.push(b);
            }
        }
        if q.len >= self.max_items || (!room && q.spare.len == 0) {
            drop(q);
            self.fallback_full.fetch_add(1, Ordering::Relaxed);
            return Err(item);
        }
        if !room {
            let fresh = q.spare.pop().expect("a spare block (checked above)");
            if let Some(full) = q.current.replace(fresh) {
                q.full.push(full);
            }
        }
        let current = q.current.as_mut().expect("a current block (just ensured)");
        debug_assert!(current.items.len() < current.items.capacity());
        current.items.push(item);
        q.len += 1;
        let len = q.len;
        // Under the queue lock, so a drainer (which takes the items under it) counts them as
        // drained only after they were counted as queued.
        self.queued.fetch_add(1, Ordering::Relaxed);
        drop(q);
        let wake = len >= self.wake_at
            && !self.wake_requested.load(Ordering::Relaxed)
            && !self.wake_requested.swap(true, Ordering::AcqRel);
        Ok(wake)
    }

    /// Wakes the worker (after `try_enqueue` returned `Ok(true)`).
    pub(crate) fn wake(&self) {
        self.wakeups.fetch_add(1, Ordering::Relaxed);
        lock(&self.signal).wake = true;
        self.cond.notify_one();
    }

    /// Tells the worker to exit (it returns from [`wait_for_work`](Self::wait_for_work) with
    /// false). Items still queued stay queued: the owner drains them.
    pub(crate) fn stop(&self) {
        lock(&self.signal).stop = true;
        self.cond.notify_all();
    }

    /// The worker's wait: blocks until a wake-up (true) or [`stop`](Self::stop) (false).
    pub(crate) fn wait_for_work(&self) -> bool {
        let mut s = lock(&self.signal);
        loop {
            if s.stop {
                return false;
            }
            if s.wake {
                s.wake = false;
                drop(s);
                // Before draining: an enqueue that reaches the wake mark during this drain must be
                // able to request the next one.
                self.wake_requested.store(false, Ordering::Release);
                return true;
            }
            s = self.cond.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Frees (with `free`, called on each block's items, oldest block first) everything queued
    /// when it is called, and waits for a drain already in progress; returns how many items it
    /// freed itself. Blocking: for `flush`, never for a release path.
    pub(crate) fn drain(&self, free: impl FnMut(&[T])) -> usize {
        self.drain_inner(free, false)
    }

    /// The worker's [`drain`](Self::drain): also keeps twice as many spare blocks as queued
    /// ones (allocating before each block it frees), and, if the queue is empty when it ends, frees
    /// the blocks beyond the resting ones.
    pub(crate) fn drain_resizing(&self, free: impl FnMut(&[T])) -> usize {
        self.drain_inner(free, true)
    }

    fn drain_inner(&self, mut free: impl FnMut(&[T]), resize: bool) -> usize {
        let _drainer = lock(&self.drain);
        if resize {
            self.grow();
        }
        let mut batch = {
            let mut q = lock(&self.queue);
            let mut batch = std::mem::take(&mut q.full);
            if let Some(current) = q.current.take() {
                batch.push(current);
            }
            q.len = 0;
            batch
        }
        .reversed();
        let mut n = 0;
        while let Some(mut block) = batch.pop() {
            if resize {
                self.grow();
            }
            free(&block.items);
            n += block.items.len();
            self.drained
                .fetch_add(block.items.len() as u64, Ordering::Relaxed);
            block.items.clear();
            lock(&self.queue).spare.push(block);
        }
        if n > 0 {
            self.drains.fetch_add(1, Ordering::Relaxed);
        }
        if resize {
            self.shrink();
        }
        n
    }

    /// Tops the spare list up to twice the queued blocks (at least the resting number), within
    /// what `max_items` can use. The blocks are made with no lock but the drain mutex.
    fn grow(&self) {
        let want = {
            let q = lock(&self.queue);
            let queued = q.queued_blocks();
            let most = (self.max_items.div_ceil(self.block_items))
                .saturating_add(1)
                .saturating_mul(2)
                .max(self.rest_blocks);
            let room = most.saturating_sub(self.blocks.load(Ordering::Relaxed));
            (2 * queued)
                .max(self.rest_blocks)
                .saturating_sub(q.spare.len)
                .min(room)
        };
        if want == 0 {
            return;
        }
        let mut fresh = BlockList::default();
        for _ in 0..want {
            fresh.push(Block::new(self.block_items));
        }
        self.blocks.fetch_add(want, Ordering::Relaxed);
        let mut q = lock(&self.queue);
        while let Some(b) = fresh.pop() {
            q.spare.push(b);
        }
    }

    /// If nothing is queued, frees the spare blocks beyond the resting number (outside the
    /// queue lock). Called by the worker with the drain mutex held, so no block is in a batch.
    fn shrink(&self) {
        let extra = {
            let mut q = lock(&self.queue);
            if q.len > 0 {
                return;
            }
            let mut extra = BlockList::default();
            while q.queued_blocks() + q.spare.len > self.rest_blocks {
                match q.spare.pop() {
                    Some(b) => extra.push(b),
                    None => break,
                }
            }
            extra
        };
        self.blocks.fetch_sub(extra.len, Ordering::Relaxed);
        if let Some(stock) = &self.stock {
            // Back to the stock first (what it took from it during the release, and more if
            // other queues took some), then topped up; the rest is freed here.
            drop(stock.give(extra));
            stock.top_up();
        } else {
            drop(extra);
        }
    }

    /// Heap bytes the queue's blocks take now (touched: blocks are made with their pages
    /// touched). Read without the queue lock, so it never contends with enqueuers.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.blocks.load(Ordering::Relaxed)
            * (self.block_items * std::mem::size_of::<T>() + std::mem::size_of::<Block<T>>())
    }

    /// The counters. Exact when no queue operation is in flight.
    pub(crate) fn stats(&self) -> DeferredStats {
        let queued = self.queued.load(Ordering::Relaxed);
        let drained = self.drained.load(Ordering::Relaxed);
        DeferredStats {
            queued,
            fallback_contended: self.fallback_contended.load(Ordering::Relaxed),
            fallback_full: self.fallback_full.load(Ordering::Relaxed),
            drains: self.drains.load(Ordering::Relaxed),
            drained,
            pending: queued.saturating_sub(drained),
            wakeups: self.wakeups.load(Ordering::Relaxed),
            capacity: self.capacity() as u64,
        }
    }
}

impl<T> Drop for DeferredQueue<T> {
    /// Gives the queue's empty blocks back to its stock (up to the stock's size). The owner
    /// drains the queue first, so every block is then empty and spare.
    fn drop(&mut self) {
        if let Some(stock) = &self.stock {
            let spare = std::mem::take(&mut lock(&self.queue).spare);
            drop(stock.give(spare));
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Arc;

    impl<T> DeferredQueue<T> {
        /// Blocks on the lists (no drainer running) against the `blocks` count.
        fn check_blocks(&self) {
            let q = lock(&self.queue);
            assert_eq!(
                q.queued_blocks() + q.spare.len,
                self.blocks.load(Ordering::Relaxed),
                "blocks on the lists vs counted"
            );
        }
    }

    #[test]
    fn capacity_follows_the_page_size() {
        assert_eq!(default_capacity(4096), 32768);
        assert_eq!(default_capacity(16384), 8192);
        assert_eq!(default_capacity(65536), 2048);
        assert_eq!(DeferredQueue::<u32>::new(0).capacity(), 2);
        let q = DeferredQueue::<u32>::new(32768);
        assert_eq!((q.block_items, q.rest_blocks, q.wake_at), (1024, 32, 1024));
        assert_eq!(q.capacity(), 32768);
        assert_eq!(
            q.heap_bytes(),
            32 * (4096 + std::mem::size_of::<Block<u32>>())
        );
    }

    #[test]
    fn wakes_once_at_half_full_and_falls_back_when_full() {
        let q = DeferredQueue::new(8);
        let wakes: Vec<bool> = (0..8).map(|i| q.try_enqueue(i).unwrap()).collect();
        assert_eq!(
            wakes,
            [false, false, false, true, false, false, false, false]
        );
        // No spare block left, and nobody has grown the queue.
        assert_eq!(q.try_enqueue(8), Err(8));
        let mut freed = Vec::new();
        assert_eq!(q.drain(|b| freed.extend_from_slice(b)), 8);
        assert_eq!(freed, (0..8).collect::<Vec<_>>());
        let s = q.stats();
        assert_eq!(
            (s.queued, s.fallback_full, s.drains, s.drained, s.pending),
            (8, 1, 1, 8, 0)
        );
        // The wake was never consumed by a worker, so no second one is requested.
        assert!((0..8).all(|i| !q.try_enqueue(i).unwrap()));
        q.check_blocks();
    }

    #[test]
    fn contended_lock_falls_back() {
        let q = DeferredQueue::new(8);
        let held = q.queue.lock().unwrap();
        assert_eq!(q.try_enqueue(1), Err(1));
        drop(held);
        assert_eq!(q.try_enqueue(2), Ok(false));
        assert_eq!(q.stats().fallback_contended, 1);
        assert_eq!(q.stats().pending, 1);
    }

    #[test]
    fn a_maximum_refuses_with_spare_blocks_left() {
        let q = DeferredQueue::with_blocks(2, 4, 5);
        assert!((0..5).all(|i| q.try_enqueue(i).is_ok()));
        assert_eq!(q.try_enqueue(5), Err(5));
        assert_eq!(q.stats().fallback_full, 1);
        // Growing never goes past what the maximum can use (twice over).
        q.grow();
        assert!(q.capacity() <= 2 * 2 * 4, "{}", q.capacity());
        q.check_blocks();
    }

    /// The worker's drain grows the queue ahead of the queued blocks and shrinks it back to
    /// its resting blocks once it ends with the queue empty; blocks are never lost or counted
    /// twice.
    #[test]
    fn the_worker_grows_the_queue_and_shrinks_it_back() {
        let q = DeferredQueue::new(8); // blocks of 4, 2 at rest
        assert!((0..8).all(|i| q.try_enqueue(i).is_ok()));
        assert!(q.try_enqueue(8).is_err());
        q.grow();
        assert_eq!(
            q.capacity(),
            24,
            "twice as many spare blocks as queued ones"
        );
        q.check_blocks();
        assert!((8..24).all(|i| q.try_enqueue(i).is_ok()));
        assert!(q.try_enqueue(24).is_err());
        let mut freed = Vec::new();
        // Before its batch the worker grows to 12 spare blocks (6 queued); it ends with the
        // queue empty and shrinks back to 2 blocks.
        assert_eq!(q.drain_resizing(|b| freed.extend_from_slice(b)), 24);
        assert_eq!(freed, (0..24).collect::<Vec<_>>(), "oldest block first");
        assert_eq!(q.capacity(), 8);
        q.check_blocks();
        assert_eq!(
            q.heap_bytes(),
            2 * (4 * 4 + std::mem::size_of::<Block<i32>>())
        );
        // A drain that leaves items queued keeps the blocks.
        assert!((0..8).all(|i| q.try_enqueue(i).is_ok()));
        q.grow();
        assert!((8..12).all(|i| q.try_enqueue(i).is_ok()));
        let before = q.capacity();
        q.drain_inner(
            |_| {
                q.try_enqueue(99).unwrap();
            },
            true,
        );
        assert!(q.capacity() >= before);
        assert_eq!(q.stats().pending, 3, "enqueued during the drain");
        q.check_blocks();
    }

    /// A queue out of spare blocks takes the stock's before it falls back; its worker gives
    /// them back (and the stock is topped up) once a drain empties the queue, and a dropped
    /// queue gives its spare blocks back. Every item is freed once, in order.
    #[test]
    fn a_queue_out_of_spare_blocks_takes_the_stocks() {
        let stock = Arc::new(BlockStock::new(2, 3));
        stock.top_up();
        assert_eq!(stock.len(), 3);
        let q = DeferredQueue::with_blocks(2, 2, usize::MAX).with_stock(stock.clone());
        // 2 own blocks, then 3 from the stock, then nothing left: the 11th falls back.
        assert!((0..10).all(|i| q.try_enqueue(i).is_ok()));
        assert_eq!(q.try_enqueue(10), Err(10));
        assert_eq!((stock.len(), stock.taken()), (0, 3));
        assert_eq!(q.capacity(), 10);
        let s = q.stats();
        assert_eq!((s.queued, s.fallback_full, s.pending), (10, 1, 10));
        q.check_blocks();
        let mut freed = Vec::new();
        assert_eq!(q.drain_resizing(|b| freed.extend_from_slice(b)), 10);
        assert_eq!(
            freed,
            (0..10).collect::<Vec<_>>(),
            "each once, oldest first"
        );
        // Shrunk to its 2 resting blocks; the stock is full again.
        assert_eq!((q.capacity(), stock.len()), (4, 3));
        q.check_blocks();
        // The stock is taken from again, then the dropped queue's spare blocks go back to it.
        assert!((0..6).all(|i| q.try_enqueue(i).is_ok()));
        assert_eq!(stock.len(), 2);
        assert_eq!(q.drain(|_| {}), 6);
        drop(q);
        assert_eq!(stock.len(), 3, "given back, up to the stock's size");
    }

    /// Two queues share a stock of a few blocks; enqueuers, their workers and flushers on real
    /// threads: every item is freed exactly once, and the stock never holds more than its size.
    #[test]
    fn queues_sharing_a_stock_free_every_item_exactly_once() {
        let stock = Arc::new(BlockStock::new(4, 4));
        stock.top_up();
        let freed = Arc::new(std::sync::Mutex::new(HashSet::new()));
        let free = {
            let freed = freed.clone();
            move |b: &[u64]| {
                let mut f = freed.lock().unwrap();
                for &i in b {
                    assert!(f.insert(i), "{i} freed twice");
                }
            }
        };
        let queues: Vec<_> = (0..2)
            .map(|_| {
                Arc::new(DeferredQueue::with_blocks(4, 2, usize::MAX).with_stock(stock.clone()))
            })
            .collect();
        let workers: Vec<_> = queues
            .iter()
            .map(|q| {
                let (q, free) = (q.clone(), free.clone());
                std::thread::spawn(move || {
                    while q.wait_for_work() {
                        q.drain_resizing(&free);
                    }
                })
            })
            .collect();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (q, free) = (&queues[t as usize % 2], free.clone());
                s.spawn(move || {
                    for i in 0..20_000 {
                        let item = t << 32 | i;
                        match q.try_enqueue(item) {
                            Ok(true) => q.wake(),
                            Ok(false) => {}
                            Err(item) => free(&[item]),
                        }
                        if i % 7000 == 0 {
                            q.drain(&free);
                        }
                    }
                });
            }
        });
        for (q, w) in queues.iter().zip(workers) {
            q.drain(&free);
            q.stop();
            w.join().unwrap();
            let s = q.stats();
            assert_eq!((s.pending, s.queued), (0, s.drained));
            q.check_blocks();
        }
        assert_eq!(freed.lock().unwrap().len(), 80_000);
        assert!(stock.taken() > 0, "the stock was used");
        assert!(stock.len() <= 4);
    }

    #[test]
    fn worker_wait_sees_wake_and_stop() {
        let q = DeferredQueue::<u32>::new(4);
        q.wake();
        assert!(q.wait_for_work());
        q.stop();
        assert!(!q.wait_for_work());
    }

    /// Enqueuers, a worker (growing and shrinking the queue) and flushers on real threads:
    /// every item is freed exactly once.
    #[test]
    fn threads_free_every_item_exactly_once() {
        let q = Arc::new(DeferredQueue::new(64));
        let freed = Arc::new(std::sync::Mutex::new(HashSet::new()));
        let free = {
            let freed = freed.clone();
            move |b: &[u64]| {
                let mut f = freed.lock().unwrap();
                for &i in b {
                    assert!(f.insert(i), "{i} freed twice");
                }
            }
        };
        let worker = {
            let (q, free) = (q.clone(), free.clone());
            std::thread::spawn(move || {
                while q.wait_for_work() {
                    q.drain_resizing(&free);
                }
            })
        };
        std::thread::scope(|s| {
            for t in 0..3u64 {
                let (q, free) = (&q, free.clone());
                s.spawn(move || {
                    for i in 0..20_000 {
                        let item = t << 32 | i;
                        match q.try_enqueue(item) {
                            Ok(true) => q.wake(),
                            Ok(false) => {}
                            Err(item) => free(&[item]),
                        }
                        if i % 5000 == 0 {
                            q.drain(&free);
                        }
                    }
                });
            }
        });
        q.drain(&free);
        q.stop();
        worker.join().unwrap();
        assert_eq!(freed.lock().unwrap().len(), 60_000);
        let s = q.stats();
        assert_eq!(s.pending, 0);
        assert_eq!(s.queued, s.drained);
        assert_eq!(s.queued + s.fallback_contended + s.fallback_full, 60_000);
        q.check_blocks();
    }
}

/// The loom model of the protocol: `RUSTFLAGS="--cfg loom" cargo test --lib loom_model`
/// (`scripts/test` runs it with a preemption bound).
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// A fake allocator: `live[i]` is 1 while item `i` is allocated; freeing a freed item
    /// panics (a double free), and the model checks at the end that every item was freed.
    struct Pool {
        live: Vec<AtomicUsize>,
    }

    impl Pool {
        fn new(n: usize) -> Pool {
            Pool {
                live: (0..n).map(|_| AtomicUsize::new(1)).collect(),
            }
        }
        fn free(&self, i: usize) {
            let was = self.live[i].fetch_sub(1, Ordering::Relaxed);
            assert_eq!(was, 1, "item {i} freed twice");
        }
        fn free_block(&self, b: &[usize]) {
            b.iter().for_each(|&i| self.free(i));
        }
        fn leaked(&self) -> Vec<usize> {
            (0..self.live.len())
                .filter(|&i| self.live[i].load(Ordering::Relaxed) != 0)
                .collect()
        }
    }

    fn release(q: &DeferredQueue<usize>, pool: &Pool, i: usize) {
        match q.try_enqueue(i) {
            Ok(true) => q.wake(),
            Ok(false) => {}
            Err(i) => pool.free(i),
        }
    }

    /// The pool's worker: drains, growing the queue before each block and shrinking it when it
    /// ends empty.
    fn worker(q: Arc<DeferredQueue<usize>>, pool: Arc<Pool>) -> thread::JoinHandle<()> {
        thread::spawn(move || {
            while q.wait_for_work() {
                q.drain_resizing(|b| pool.free_block(b));
            }
        })
    }

    /// After everything stopped: the blocks on the lists are the blocks counted.
    fn blocks_consistent(q: &DeferredQueue<usize>) {
        let p = lock(&q.queue);
        assert_eq!(
            p.queued_blocks() + p.spare.len,
            q.blocks.load(Ordering::Relaxed)
        );
    }

    /// Two releasers (two items each; blocks of one item, two at rest, so the queue is full
    /// after two items: wake-ups, growth by the worker, no-spare and contended fallbacks all
    /// happen) race the worker; then flush and stop, as `Drop` does. Every item is freed
    /// exactly once, the flush leaves nothing pending, and no block is lost.
    #[test]
    fn enqueue_grow_drain_fallback_flush() {
        loom::model(|| {
            let q = Arc::new(DeferredQueue::with_blocks(1, 2, usize::MAX));
            let pool = Arc::new(Pool::new(4));
            let w = worker(q.clone(), pool.clone());
            let releasers: Vec<_> = (0..2)
                .map(|t| {
                    let (q, pool) = (q.clone(), pool.clone());
                    thread::spawn(move || {
                        release(&q, &pool, 2 * t);
                        release(&q, &pool, 2 * t + 1);
                    })
                })
                .collect();
            for r in releasers {
                r.join().unwrap();
            }
            q.drain(|b| pool.free_block(b));
            assert_eq!(pool.leaked(), Vec::<usize>::new());
            assert_eq!(q.stats().pending, 0);
            q.stop();
            w.join().unwrap();
            blocks_consistent(&q);
        });
    }

    /// One releaser queues three items (more than the resting blocks) while the worker grows
    /// and shrinks the queue: the items and blocks the worker moves under the releaser's feet
    /// are neither lost nor freed twice; a flush afterwards leaves nothing.
    #[test]
    fn grow_and_shrink_race_an_enqueuer() {
        loom::model(|| {
            let q = Arc::new(DeferredQueue::with_blocks(1, 2, usize::MAX));
            let pool = Arc::new(Pool::new(3));
            let w = worker(q.clone(), pool.clone());
            for i in 0..3 {
                release(&q, &pool, i);
            }
            q.drain(|b| pool.free_block(b));
            assert_eq!(pool.leaked(), Vec::<usize>::new());
            q.stop();
            w.join().unwrap();
            blocks_consistent(&q);
        });
    }

    /// Two queues share a stock of one block (blocks of one item, two at rest): each releaser
    /// queues three items, so one of them needs a block beyond its queue's own before its
    /// worker can grow it, and the stock's one block goes to whichever gets it first (the
    /// other falls back) and back to the stock when a worker shrinks its queue. Every item is
    /// freed exactly once, and the blocks each queue counts are the blocks on its lists.
    #[test]
    fn queues_take_from_and_give_back_to_a_shared_stock() {
        loom::model(|| {
            let stock = std::sync::Arc::new(BlockStock::new(1, 1));
            stock.top_up();
            let pool = Arc::new(Pool::new(6));
            let queues: Vec<_> = (0..2)
                .map(|_| {
                    Arc::new(DeferredQueue::with_blocks(1, 2, usize::MAX).with_stock(stock.clone()))
                })
                .collect();
            let w = worker(queues[0].clone(), pool.clone());
            let releaser = {
                let (q, pool) = (queues[1].clone(), pool.clone());
                thread::spawn(move || {
                    for i in 3..6 {
                        release(&q, &pool, i);
                    }
                    q.drain(|b| pool.free_block(b));
                })
            };
            for i in 0..3 {
                release(&queues[0], &pool, i);
            }
            releaser.join().unwrap();
            queues[0].drain(|b| pool.free_block(b));
            assert_eq!(pool.leaked(), Vec::<usize>::new());
            queues[0].stop();
            w.join().unwrap();
            for q in &queues {
                blocks_consistent(q);
            }
            assert!(lock(&stock.blocks).len <= 1);
        });
    }

    /// A flush that runs concurrently with a release and the worker: once the releaser has
    /// finished and the flush returned, an item queued before the flush began is freed even if
    /// the worker's batch held it (flush waits for that batch).
    #[test]
    fn flush_waits_for_the_workers_batch() {
        loom::model(|| {
            let q = Arc::new(DeferredQueue::with_blocks(1, 2, usize::MAX));
            let pool = Arc::new(Pool::new(2));
            let w = worker(q.clone(), pool.clone());
            release(&q, &pool, 0); // the wake mark is 1: wakes the worker
            let flusher = {
                let (q, pool) = (q.clone(), pool.clone());
                thread::spawn(move || {
                    q.drain(|b| pool.free_block(b));
                    // Item 0 was queued before this flush began.
                    assert_eq!(
                        pool.live[0].load(Ordering::Relaxed),
                        0,
                        "flush returned early"
                    );
                })
            };
            release(&q, &pool, 1);
            flusher.join().unwrap();
            q.drain(|b| pool.free_block(b));
            assert_eq!(pool.leaked(), Vec::<usize>::new());
            q.stop();
            w.join().unwrap();
        });
    }
}
