//! The deferred-free queue (upstream's `zs_free_deferred()`, 2026).
//!
//! Freeing an object costs a class lock and, when its zspage empties, returning pages. On a
//! release path (TRIM of a range, a swap area's pages freed on process exit) that cost lands on
//! the releasing task. [`DeferredQueue`] lets such a caller hand the handle over instead: it is
//! freed later, in a batch, by a background worker (woken once the queue holds
//! [`DEFERRED_WAKE_ITEMS`] items or is half full, whichever comes first) or by
//! [`DeferredQueue::drain`] (the pool's `flush()`), which also runs when the pool is dropped.
//!
//! The queue is generic over its items (the pool queues `Handle`s, the loom model plain
//! integers) and never frees anything itself: draining calls a closure on each item.
//!
//! # Protocol
//!
//! - **Enqueue** ([`try_enqueue`](DeferredQueue::try_enqueue)) only *try*-locks the queue. If
//!   the lock is busy (another enqueuer, or a drainer swapping the buffer out) or the queue
//!   holds `capacity` items, the item is handed back and the caller frees it synchronously: a
//!   caller never waits for the queue, and the queue never grows past its capacity.
//! - **Wake**: the enqueue that finds the queue at its wake mark (`wake_at`: the smaller of
//!   [`DEFERRED_WAKE_ITEMS`] and half the capacity) or past it after its push, and no wake
//!   already requested (`wake_requested`), asks its caller to [`wake`](DeferredQueue::wake) the
//!   worker. The worker clears `wake_requested` *before* it drains, so items arriving during a
//!   drain can request the next one; a wake is recorded under the signal mutex, which the
//!   worker checks before sleeping, so none is lost.
//! - **Drain** takes the drain mutex (one drainer at a time; it owns the spare buffer), swaps
//!   the queue's buffer with the empty spare under the queue lock (the only time a drainer holds
//!   it: O(1)), then frees the batch *with only the drain mutex held*. Buffers keep their
//!   capacity, so steady-state enqueues never allocate.
//! - **Flush** is a drain. Because a drainer holds the drain mutex until its whole batch is
//!   freed, a drain that returns has freed everything enqueued before it was called: each such
//!   item was either in the queue when this drain swapped it out, or in the batch of an earlier
//!   drain that finished before this one got the drain mutex.
//!
//! Exactly once: an item is in exactly one place at a time (handed back to the caller, in the
//! queue's buffer, or in one drainer's batch), moved between them under the lock that protects
//! both ends, and a batch is emptied by the drainer that took it. The loom model
//! (`loom_model` below, run by `scripts/test` with `--cfg loom`) checks this with a worker,
//! enqueuers and a flusher in every interleaving within its bounds.
//!
//! # Locks
//!
//! | lock | protects |
//! |------|----------|
//! | `queue` | the pending items (`Vec`), `queued` is bumped under it |
//! | `drain` | the spare buffer, i.e. the batch being freed; held for the whole batch |
//! | `signal` | the worker's `wake` and `stop` flags (with `cond`) |
//!
//! Order: `drain` → `queue`. `signal` is never held with another. The closure given to `drain`
//! runs with `drain` held and must not call back into this queue.

#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(loom)]
use loom::sync::{Condvar, Mutex, MutexGuard};
// loom's `Mutex::try_lock` returns std's `TryLockResult`.
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(loom)]
use std::sync::TryLockError;
#[cfg(not(loom))]
use std::sync::{Condvar, Mutex, MutexGuard, TryLockError};

/// The queue's budget in *uncompressed* bytes: 128 MiB, upstream's choice (its capacity is
/// `128 MiB >> PAGE_SHIFT` handles). Each queued handle stands for one page that was released,
/// so at most this much released data waits for its memory to come back; 32768 entries
/// (256 KiB of handles per buffer) for 4 KiB pages, 2048 for 64 KiB pages.
pub const DEFERRED_FREE_BUDGET_BYTES: usize = 128 << 20;

/// The worker is woken once this many items wait (or the queue is half full, if that comes
/// first): 1024 handles, two 2 MiB discards of 4 KiB pages. Before issue 14 it waited for half
/// the capacity (16384 handles), so during a release larger than the queue it started late,
/// the queue filled while it freed its first batch, and a fifth of the frees fell back to the
/// releasing callers (`uzram bench free` at 100,000 pages). Woken this early it drains while
/// the releasers still enqueue, in batches large enough that the frame allocator drops emptied
/// zspages in whole batches (`page_alloc::DROP_BATCH_PAGES`), for one wake-up (a futex call)
/// per 1024 handles.
pub const DEFERRED_WAKE_ITEMS: usize = 1024;

/// The default capacity (entries) for a pool of `page_size_bytes` pages.
pub fn default_capacity(page_size_bytes: usize) -> usize {
    DEFERRED_FREE_BUDGET_BYTES / page_size_bytes
}

/// Counters of a deferred-free queue; shown by the device's `deferred_stat` attribute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeferredStats {
    /// Items put into the queue, cumulative.
    pub queued: u64,
    /// Items freed synchronously because the queue lock was busy.
    pub fallback_contended: u64,
    /// Items freed synchronously because the queue was full.
    pub fallback_full: u64,
    /// Drain passes (worker or flush) that freed at least one item.
    pub drains: u64,
    /// Items freed by drains, cumulative.
    pub drained: u64,
    /// Items queued and not yet freed (`queued - drained`).
    pub pending: u64,
    /// Worker wake-ups requested (crossings of the wake mark).
    pub wakeups: u64,
    /// Capacity in items.
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

/// A bounded queue of items to free later; see the module docs.
#[derive(Debug)]
pub(crate) struct DeferredQueue<T> {
    /// Items the queue holds at most (at least 2).
    capacity: usize,
    /// The enqueue that brings the length to this (or past it) requests a drain.
    wake_at: usize,
    /// The queue lock and the pending items. Enqueuers only try-lock it.
    queue: Mutex<Vec<T>>,
    /// The drain mutex and the spare buffer (the batch being freed while it is held).
    drain: Mutex<Vec<T>>,
    /// A wake-up was requested and the worker has not started draining since. Lets enqueuers
    /// past the wake mark skip the signal mutex.
    wake_requested: AtomicBool,
    signal: Mutex<Signal>,
    cond: Condvar,
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
    /// A queue holding up to `capacity` items (raised to 2, so half full is at least 1).
    pub(crate) fn new(capacity: usize) -> DeferredQueue<T> {
        let capacity = capacity.max(2);
        DeferredQueue {
            capacity,
            wake_at: (capacity / 2).min(DEFERRED_WAKE_ITEMS),
            queue: Mutex::new(Vec::new()),
            drain: Mutex::new(Vec::new()),
            wake_requested: AtomicBool::new(false),
            signal: Mutex::new(Signal::default()),
            cond: Condvar::new(),
            queued: AtomicU64::new(0),
            fallback_contended: AtomicU64::new(0),
            fallback_full: AtomicU64::new(0),
            drains: AtomicU64::new(0),
            drained: AtomicU64::new(0),
            wakeups: AtomicU64::new(0),
        }
    }

    /// The capacity in items.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Queues `item` if the queue lock is free right now and the queue is not full; otherwise
    /// hands it back (`Err`), and the caller must free it itself. `Ok(true)`: the queue reached
    /// its wake mark and the caller must call [`wake`](Self::wake).
    pub(crate) fn try_enqueue(&self, item: T) -> Result<bool, T> {
        let mut q = match self.queue.try_lock() {
            Ok(q) => q,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                self.fallback_contended.fetch_add(1, Ordering::Relaxed);
                return Err(item);
            }
        };
        if q.len() >= self.capacity {
            drop(q);
            self.fallback_full.fetch_add(1, Ordering::Relaxed);
            return Err(item);
        }
        q.push(item);
        let len = q.len();
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

    /// Frees (with `free`) everything queued when it is called, and waits for a drain already
    /// in progress; returns how many items it freed itself. Blocking: for the worker and for
    /// `flush`, never for a release path.
    pub(crate) fn drain(&self, mut free: impl FnMut(T)) -> usize {
        let mut batch = lock(&self.drain);
        debug_assert!(batch.is_empty(), "a previous drain left items behind");
        std::mem::swap(&mut *lock(&self.queue), &mut *batch);
        let n = batch.len();
        for item in batch.drain(..) {
            free(item);
        }
        if n > 0 {
            self.drains.fetch_add(1, Ordering::Relaxed);
            self.drained.fetch_add(n as u64, Ordering::Relaxed);
        }
        n
    }

    /// Heap bytes the queue's two buffers (the queue and the batch being freed) take when
    /// full: the most it holds (a buffer never grows past `capacity` items, as an enqueue into
    /// a full queue is refused). Not measured, so reading it never contends with enqueuers.
    pub(crate) fn max_heap_bytes(&self) -> usize {
        2 * self.capacity.next_power_of_two() * std::mem::size_of::<T>()
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
            capacity: self.capacity as u64,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Arc;

    #[test]
    fn capacity_follows_the_page_size() {
        assert_eq!(default_capacity(4096), 32768);
        assert_eq!(default_capacity(16384), 8192);
        assert_eq!(default_capacity(65536), 2048);
        assert_eq!(DeferredQueue::<u32>::new(0).capacity(), 2);
    }

    #[test]
    fn wakes_once_at_half_full_and_falls_back_when_full() {
        let q = DeferredQueue::new(8);
        let wakes: Vec<bool> = (0..8).map(|i| q.try_enqueue(i).unwrap()).collect();
        assert_eq!(
            wakes,
            [false, false, false, true, false, false, false, false]
        );
        assert_eq!(q.try_enqueue(8), Err(8));
        let mut freed = Vec::new();
        assert_eq!(q.drain(|i| freed.push(i)), 8);
        assert_eq!(freed, (0..8).collect::<Vec<_>>());
        let s = q.stats();
        assert_eq!(
            (s.queued, s.fallback_full, s.drains, s.drained, s.pending),
            (8, 1, 1, 8, 0)
        );
        // The wake was never consumed by a worker, so no second one is requested.
        assert!((0..8).all(|i| !q.try_enqueue(i).unwrap()));
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
    fn worker_wait_sees_wake_and_stop() {
        let q = DeferredQueue::<u32>::new(4);
        q.wake();
        assert!(q.wait_for_work());
        q.stop();
        assert!(!q.wait_for_work());
    }

    /// Enqueuers, a worker and flushers on real threads: every item is freed exactly once.
    #[test]
    fn threads_free_every_item_exactly_once() {
        let q = Arc::new(DeferredQueue::new(64));
        let freed = Arc::new(std::sync::Mutex::new(HashSet::new()));
        let free = {
            let freed = freed.clone();
            move |i: u64| assert!(freed.lock().unwrap().insert(i), "{i} freed twice")
        };
        let worker = {
            let (q, free) = (q.clone(), free.clone());
            std::thread::spawn(move || {
                while q.wait_for_work() {
                    q.drain(&free);
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
                            Err(item) => free(item),
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
    }
}

/// The loom model of the protocol: `RUSTFLAGS="--cfg loom" cargo test --lib loom_model`
/// (`scripts/test` runs it with a preemption bound).
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::sync::atomic::AtomicUsize;
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

    fn worker(q: Arc<DeferredQueue<usize>>, pool: Arc<Pool>) -> thread::JoinHandle<()> {
        thread::spawn(move || {
            while q.wait_for_work() {
                q.drain(|i| pool.free(i));
            }
        })
    }

    /// Two releasers (two items each, capacity 2: half full at 1, so wake-ups, full-queue and
    /// contended fallbacks all happen) race the worker; then flush and stop, as `Drop` does.
    /// Every item is freed exactly once, and the flush leaves nothing pending.
    #[test]
    fn enqueue_drain_fallback_flush() {
        loom::model(|| {
            let q = Arc::new(DeferredQueue::new(2));
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
            q.drain(|i| pool.free(i));
            assert_eq!(pool.leaked(), Vec::<usize>::new());
            assert_eq!(q.stats().pending, 0);
            q.stop();
            w.join().unwrap();
        });
    }

    /// A flush that runs concurrently with a release and the worker: once the releaser has
    /// finished and the flush returned, an item queued before the flush began is freed even if
    /// the worker's batch held it (flush waits for that batch).
    #[test]
    fn flush_waits_for_the_workers_batch() {
        loom::model(|| {
            let q = Arc::new(DeferredQueue::new(2));
            let pool = Arc::new(Pool::new(2));
            let w = worker(q.clone(), pool.clone());
            release(&q, &pool, 0); // half full: wakes the worker
            let flusher = {
                let (q, pool) = (q.clone(), pool.clone());
                thread::spawn(move || {
                    q.drain(|i| pool.free(i));
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
            q.drain(|i| pool.free(i));
            assert_eq!(pool.leaked(), Vec::<usize>::new());
            q.stop();
            w.join().unwrap();
        });
    }
}
