//! [`MemoryBudget`]: one server-wide budget for the bytes of request and reply payloads, with
//! the recycled buffers inside it.
//!
//! # Invariants (under the one mutex)
//! - `charged + held <= max` at all times, except that a single charge is granted when nothing
//!   else is charged (so a request larger than a tiny budget cannot wait forever; the minimum
//!   budget, [`MIN_INFLIGHT_BYTES`](super::MIN_INFLIGHT_BYTES), makes that moot for NBD).
//! - `charged` is the capacity of every buffer handed out by [`MemoryBudget::take`] and not yet
//!   given back; `held` the capacity of the buffers kept for reuse in `classes`.
//! - A buffer kept for reuse is released (unmapped) when a charge needs its room, or by
//!   [`MemoryBudget::release_idle`] once unused for the idle time, except the floor: as many
//!   buffers of each class as were preallocated (for `--swap`) stay.
//! - With a floor, a request takes any free buffer of the floor before it maps a new one
//!   (serving swap, the request path takes no fresh memory while a preallocated buffer is free).
//!
//! Buffers come in power-of-two size classes (4 KiB << k of data plus a page for a reply
//! header, k = 0..=14, up to the 64 MiB maximum payload), so a lookup is a few vector pops and
//! a buffer's capacity is at most twice its request's size.

use super::ReqBuf;
use std::io;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The size classes: 4 KiB << k of data, k = 0..=14 (4 KiB to 64 MiB).
const CLASSES: usize = 15;
/// Room for a reply header in front of read data.
const HEADROOM_BYTES: usize = 4096;
/// A request takes a recycled buffer up to this many classes larger than its own (at most 8
/// times its size) before it maps a new one.
const REUSE_CLASSES_ABOVE: usize = 3;
/// How often a charge that has to wait looks at its cancel condition.
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// The capacity of class `k`'s buffers.
fn class_capacity(k: usize) -> usize {
    (4096 << k) + HEADROOM_BYTES
}

/// The smallest class whose capacity holds `len` bytes (the last class for anything larger).
fn class_of(len: usize) -> usize {
    (0..CLASSES)
        .find(|&k| class_capacity(k) >= len)
        .unwrap_or(CLASSES - 1)
}

/// A budget for request memory; see the module documentation.
#[derive(Debug)]
pub struct MemoryBudget {
    state: Mutex<State>,
    /// Signalled when bytes are refunded and a charge is waiting (`State::waiting`: std's
    /// `notify_all` is a system call even with no waiter, and this is every request's path).
    refunded: Condvar,
    max_bytes: u64,
    /// The floor: this many buffers of each class are never released when idle.
    floor_counts: [usize; CLASSES],
    idle_release: Duration,
}

#[derive(Debug, Default)]
struct State {
    charged: u64,
    held: u64,
    peak_charged: u64,
    /// Charges waiting for room.
    waiting: usize,
    /// Recycled buffers by class, each with the time it was given back (newest last).
    classes: [Vec<(ReqBuf, Instant)>; CLASSES],
}

/// A snapshot of a budget, for tests and statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetStats {
    /// Bytes of buffers handed out now.
    pub charged_bytes: u64,
    /// Bytes of buffers kept for reuse now.
    pub held_bytes: u64,
    /// The most ever charged at once.
    pub peak_charged_bytes: u64,
    /// The budget.
    pub max_bytes: u64,
}

impl MemoryBudget {
    /// A budget of `max_bytes`, with about `floor_bytes` preallocated and kept for good: half
    /// in buffers of one page of data (most swap requests), half in buffers of
    /// `floor_buffer_bytes` (the largest usual request). Recycled buffers idle for
    /// `idle_release` are released.
    pub fn new(
        max_bytes: u64,
        floor_bytes: u64,
        floor_buffer_bytes: usize,
        idle_release: Duration,
    ) -> io::Result<MemoryBudget> {
        let mut b = MemoryBudget {
            state: Mutex::new(State::default()),
            refunded: Condvar::new(),
            max_bytes,
            floor_counts: [0; CLASSES],
            idle_release,
        };
        let large = class_of(floor_buffer_bytes);
        let shares = if large == 0 {
            [(0, floor_bytes), (0, 0)]
        } else {
            [(0, floor_bytes / 2), (large, floor_bytes - floor_bytes / 2)]
        };
        let mut st = b.lock();
        for (k, bytes) in shares {
            let mut made = 0u64;
            while made + class_capacity(k) as u64 <= bytes {
                let mut buf = ReqBuf::with_capacity(class_capacity(k))?;
                // Touch every page now, so it is mapped (and, under mlockall, locked) up front.
                for page in buf.whole_mut().chunks_mut(4096) {
                    page[0] = 0;
                    std::hint::black_box(&page[0]);
                }
                made += buf.capacity() as u64;
                st.held += buf.capacity() as u64;
                st.classes[k].push((buf, Instant::now()));
            }
        }
        let counts = std::array::from_fn(|k| st.classes[k].len());
        drop(st);
        b.floor_counts = counts;
        Ok(b)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer for `len` bytes (its `len` set to `len`, contents unspecified), charged to the
    /// budget: a recycled one when there is one of a fitting class, else a new mapping. Waits
    /// while the budget is spent; returns `Ok(None)` if `cancel` becomes true meanwhile, and
    /// the error if a new mapping cannot be made (nothing is charged then).
    pub fn take(&self, len: usize, cancel: &dyn Fn() -> bool) -> io::Result<Option<ReqBuf>> {
        let want = class_of(len);
        let mut evicted = Vec::new();
        let mut st = self.lock();
        let (pooled, cap) = loop {
            if cancel() {
                return Ok(None);
            }
            let found = (want..(want + REUSE_CLASSES_ABOVE + 1).min(CLASSES))
                .find(|&k| !st.classes[k].is_empty())
                .or_else(|| {
                    // Any free buffer of the floor, however large, before a new mapping.
                    ((want + REUSE_CLASSES_ABOVE + 1)..CLASSES)
                        .find(|&k| self.floor_counts[k] > 0 && !st.classes[k].is_empty())
                });
            let cap = class_capacity(found.unwrap_or(want)) as u64;
            if st.charged == 0 || st.charged + cap <= self.max_bytes {
                let pooled = found.and_then(|k| st.classes[k].pop()).map(|(b, _)| b);
                if pooled.is_some() {
                    st.held -= cap;
                }
                // Make room by releasing recycled buffers, largest first.
                while st.charged + cap + st.held > self.max_bytes && st.held > 0 {
                    let Some(k) = (0..CLASSES).rev().find(|&k| !st.classes[k].is_empty()) else {
                        break;
                    };
                    let (b, _) = st.classes[k].remove(0);
                    st.held -= b.capacity() as u64;
                    evicted.push(b);
                }
                st.charged += cap;
                st.peak_charged = st.peak_charged.max(st.charged);
                break (pooled, cap);
            }
            st.waiting += 1;
            st = self
                .refunded
                .wait_timeout(st, WAIT_SLICE)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            st.waiting -= 1;
        };
        drop(st);
        drop(evicted);
        let mut buf = match pooled {
            Some(b) => b,
            None => match ReqBuf::with_capacity(cap as usize) {
                Ok(b) => b,
                Err(e) => {
                    self.refund(cap);
                    return Err(e);
                }
            },
        };
        debug_assert_eq!(buf.capacity() as u64, cap);
        buf.set_len(len.min(buf.capacity()));
        Ok(Some(buf))
    }

    fn refund(&self, cap: u64) {
        let mut st = self.lock();
        st.charged -= cap;
        let wake = st.waiting > 0;
        drop(st);
        if wake {
            self.refunded.notify_all();
        }
    }

    /// Gives a buffer from [`MemoryBudget::take`] back: its charge is refunded and it is kept
    /// for reuse (it fits: it was charged a moment ago).
    pub fn give(&self, buf: ReqBuf) {
        let cap = buf.capacity() as u64;
        let k = (0..CLASSES)
            .find(|&k| class_capacity(k) as u64 == cap)
            .expect("a buffer of the budget's classes");
        let mut st = self.lock();
        st.charged -= cap;
        st.held += cap;
        st.classes[k].push((buf, Instant::now()));
        debug_assert!(st.charged + st.held <= self.max_bytes.max(cap));
        let wake = st.waiting > 0;
        drop(st);
        if wake {
            self.refunded.notify_all();
        }
    }

    /// How many buffers of class `k` are the floor's.
    fn floor_of(&self, k: usize) -> usize {
        self.floor_counts[k]
    }

    /// Releases recycled buffers given back more than the idle time ago (all of them with
    /// `all`), except the floor. Cheap when there is nothing to release.
    pub fn release_idle(&self, all: bool) {
        let now = Instant::now();
        let mut released = Vec::new();
        let mut st = self.lock();
        for k in 0..CLASSES {
            // Oldest first: buffers are pushed as given back.
            while let Some((b, at)) = st.classes[k].first() {
                let old = all || now.duration_since(*at) >= self.idle_release;
                let cap = b.capacity() as u64;
                if !old || st.classes[k].len() <= self.floor_of(k) {
                    break;
                }
                let (b, _) = st.classes[k].remove(0);
                st.held -= cap;
                released.push(b);
            }
        }
        drop(st);
        drop(released);
    }

    /// Whether recycled buffers above the floor are kept (which [`MemoryBudget::release_idle`]
    /// will release once they are old enough).
    pub fn has_idle_buffers(&self) -> bool {
        let st = self.lock();
        (0..CLASSES).any(|k| st.classes[k].len() > self.floor_of(k))
    }

    /// Where the budget stands.
    pub fn stats(&self) -> BudgetStats {
        let st = self.lock();
        BudgetStats {
            charged_bytes: st.charged,
            held_bytes: st.held,
            peak_charged_bytes: st.peak_charged,
            max_bytes: self.max_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    const MIB: u64 = 1 << 20;

    #[test]
    fn classes_cover_every_payload() {
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(8192), 0);
        assert_eq!(class_of(8193), 1);
        assert_eq!(class_of((32 << 20) + 20), 13);
        assert_eq!(class_of((64 << 20) + 20), 14);
        assert_eq!(class_capacity(14) as u64, super::super::MIN_INFLIGHT_BYTES);
    }

    #[test]
    fn charges_wait_for_room_and_recycled_buffers_make_room() {
        let b = MemoryBudget::new(40 * MIB, 0, 0, Duration::from_secs(3600)).unwrap();
        let never = || false;
        let x = b.take(16 << 20, &never).unwrap().unwrap();
        assert_eq!(x.len(), 16 << 20);
        let y = b.take(16 << 20, &never).unwrap().unwrap();
        assert_eq!(b.stats().charged_bytes, 2 * class_capacity(12) as u64);
        // A third does not fit: it waits until cancelled.
        let cancel = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                cancel.store(true, Ordering::SeqCst);
            });
            let r = b.take(16 << 20, &|| cancel.load(Ordering::SeqCst)).unwrap();
            assert!(r.is_none());
        });
        // Given back, both are kept; a large charge then releases them to make room.
        b.give(x);
        b.give(y);
        assert_eq!(b.stats().held_bytes, 2 * class_capacity(12) as u64);
        let big = b.take(32 << 20, &never).unwrap().unwrap();
        let s = b.stats();
        assert!(s.charged_bytes + s.held_bytes <= 40 * MIB, "{s:?}");
        b.give(big);
        // A small request reuses a recycled buffer of a class up to 8 times larger only.
        let small = b.take(4096, &never).unwrap().unwrap();
        assert_eq!(small.capacity(), class_capacity(0));
        b.give(small);
    }

    #[test]
    fn the_floor_stays_even_after_evictions() {
        let b = MemoryBudget::new(40 * MIB, 2 * MIB, 128 << 10, Duration::ZERO).unwrap();
        let never = || false;
        // Two large charges evict some of the floor's buffers to make room.
        let x = b.take(32 << 20, &never).unwrap().unwrap();
        assert!(b.stats().held_bytes < 2 * MIB);
        b.give(x);
        b.release_idle(false);
        // The large buffer goes; what is left of the floor stays.
        let s = b.stats();
        assert!(s.held_bytes < 2 * MIB, "{s:?}");
        assert!(!b.has_idle_buffers());
    }

    /// With a floor, a page-sized request takes a small buffer of the floor, then a large one,
    /// and maps a new buffer only once every buffer of the floor is taken.
    #[test]
    fn requests_take_the_floor_before_a_new_mapping() {
        let b = MemoryBudget::new(64 * MIB, 2 * MIB, 128 << 10, Duration::ZERO).unwrap();
        let small = b.floor_of(0);
        let large = b.floor_of(class_of(128 << 10));
        assert_eq!(small, MIB as usize / class_capacity(0));
        assert!(large >= 7, "{large}");
        let floor = b.stats().held_bytes;
        let never = || false;
        let mut taken = Vec::new();
        for i in 0..small + large {
            let buf = b.take(4096, &never).unwrap().unwrap();
            let want = if i < small { 0 } else { class_of(128 << 10) };
            assert_eq!(buf.capacity(), class_capacity(want), "request {i}");
            taken.push(buf);
        }
        assert_eq!(b.stats().held_bytes, 0, "the whole floor is in use");
        // Then a new mapping, of the request's own class.
        let extra = b.take(4096, &never).unwrap().unwrap();
        assert_eq!(extra.capacity(), class_capacity(0));
        taken.push(extra);
        for buf in taken {
            b.give(buf);
        }
        b.release_idle(true);
        assert_eq!(b.stats().held_bytes, floor, "back to the floor");
    }

    #[test]
    fn idle_buffers_are_released_down_to_the_floor() {
        let b = MemoryBudget::new(64 * MIB, 2 * MIB, 128 << 10, Duration::ZERO).unwrap();
        let floor = b.stats().held_bytes;
        assert!(floor > MIB && floor <= 2 * MIB, "{floor}");
        let never = || false;
        let x = b.take(4 << 20, &never).unwrap().unwrap();
        b.give(x);
        assert!(b.stats().held_bytes > floor);
        b.release_idle(false);
        assert_eq!(b.stats().held_bytes, floor);
        b.release_idle(true);
        assert_eq!(b.stats().held_bytes, floor);
    }
}
