//! Compaction: move objects out of sparse zspages into full ones, and free the emptied zspages.
//!
//! Per class (the kernel's `__zs_compact()`), repeat while the class has at least one zspage's
//! worth of free slots (`zs_can_compact()`; otherwise moving cannot free a zspage):
//!
//! 1. under the class lock, pick the *destination*: the fullest zspage with room (fullness
//!    groups 90–99 % down to <10 %), and the *source*: the sparsest other one (<10 % up);
//!    if there is no such pair (they would meet), stop;
//! 2. lock the source's migrate lock exclusive (readers and writers of its objects wait; lock
//!    order: class lock → source → destination) and the destination's *shared*;
//! 3. for each object of the source, while the destination has room: reserve a slot in the
//!    destination for the object's handle, copy the bytes, store the new location in the
//!    handle word (`Release`, after the copy), free the source slot;
//! 4. if the source emptied, detach it; drop the locks, and return its pages (outside the class
//!    lock). Counted in `pages_compacted`.
//!
//! Why the destination is only held shared: readers of its other objects may go on, and the
//! copy writes only the reserved slot, which no handle points to until the copy is done (the
//! reservation happens under the class lock, which every location-word writer holds), so no one
//! else can touch those bytes; writers of the destination's objects take its lock exclusive and
//! therefore wait. See `zspage::move_object`.
//!
//! Progress: every round either empties the source (a zspage is freed) or fills the destination
//! (a full zspage is never picked again by this call, since compaction only adds objects), so a
//! call ends after at most as many rounds as the class has zspages plus concurrent frees. The
//! class lock is dropped between rounds, so one round (at most one zspage's objects) bounds the
//! latency compaction adds to `malloc`/`free` of that class.

use std::sync::atomic::Ordering;

use super::class::SizeClass;
use super::handle::Location;
use super::zspage::move_object;
use super::PoolCore;

impl PoolCore {
    /// Compacts one class; returns the pages it freed.
    pub(crate) fn compact_class(&self, class: &SizeClass) -> u64 {
        let info = class.info;
        let mut freed_pages = 0;
        let mut used = Vec::with_capacity(info.objs_per_zspage);
        loop {
            let mut st = class.state.lock();
            if st.freeable_pages(&info) == 0 {
                break;
            }
            let Some(dst) = st.fullness.fullest_with_room(None) else {
                break;
            };
            let Some(src) = st.fullness.sparsest(Some(dst)) else {
                break;
            };
            st.used_slots(src, &mut used);
            let mut emptied = false;
            {
                let src_guard = class.desc(src).write();
                let dst_guard = class.desc(dst).read();
                let src_frame = src_guard.as_ref().expect("attached zspage has a frame");
                let dst_frame = dst_guard.as_ref().expect("attached zspage has a frame");
                for &(obj, handle) in &used {
                    let Some(slot) = st.try_reserve(class, dst, handle) else {
                        break; // destination full
                    };
                    let word = self.handles.word_at(handle);
                    // Stable: its writers hold the class lock, which we hold.
                    let loc = Location::decode(word.load(Ordering::Relaxed))
                        .expect("a used slot's handle is live");
                    assert_eq!((loc.zspage, loc.obj), (src, obj), "handle/slot mismatch");
                    let new_obj = move_object(
                        src_frame,
                        obj,
                        dst_frame,
                        slot,
                        info.size_bytes,
                        loc.size_bytes,
                    );
                    let moved = Location {
                        zspage: dst,
                        obj: new_obj,
                        ..loc
                    };
                    word.store(moved.encode(), Ordering::Release);
                    emptied = st.release(class, src, obj, handle);
                }
            }
            let detached = emptied.then(|| class.detach(&mut st, src, &self.frames));
            drop(st);
            if let Some(d) = detached {
                self.release_detached(class, d);
                freed_pages += info.pages_per_zspage as u64;
            }
        }
        freed_pages
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{check_obj, heavy, pattern};
    use super::super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn fill_free_compact(page: usize, objects: usize, seed: u64) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let pool = ZsPool::new(page).unwrap();
        let mut live: Vec<(Handle, u64, usize)> = (0..objects as u64)
            .map(|s| {
                let size = rng.gen_range(1..=page);
                let h = pool.malloc(size).unwrap();
                pool.write(h, &pattern(s, size));
                (h, s, size)
            })
            .collect();
        // Free a random 70 %.
        let mut kept = Vec::new();
        for entry in live.drain(..) {
            if rng.gen_bool(0.7) {
                pool.free(entry.0);
            } else {
                kept.push(entry);
            }
        }
        pool.check();
        let before = pool.total_pages();
        let freeable: u64 = pool.stats().classes.iter().map(|c| c.freeable_pages).sum();
        assert!(freeable > 0, "test setup should leave something to compact");
        let freed = pool.compact();
        pool.check();
        assert!(
            freed >= freeable,
            "freed {freed} of {freeable} freeable pages"
        );
        assert_eq!(pool.total_pages(), before - freed);
        assert_eq!(pool.pages_compacted(), freed);
        assert!(pool.total_pages() < before);
        let after: u64 = pool.stats().classes.iter().map(|c| c.freeable_pages).sum();
        assert_eq!(after, 0, "a second pass would find nothing");
        assert_eq!(pool.compact(), 0);
        for &(h, s, size) in &kept {
            check_obj(&pool, h, s, size);
            assert_eq!(pool.obj_size_bytes(h), size);
        }
        for &(h, _, _) in &kept {
            pool.free(h);
        }
        assert_eq!(pool.total_pages(), 0);
        assert_eq!(pool.pages_compacted(), freed);
    }

    #[test]
    fn compaction_frees_pages_and_keeps_data_4k() {
        fill_free_compact(4096, 40_000, 1);
    }

    #[test]
    fn compaction_frees_pages_and_keeps_data_16k() {
        fill_free_compact(16384, 10_000, 2);
    }

    #[test]
    fn compaction_frees_pages_and_keeps_data_64k() {
        fill_free_compact(65536, 3_000, 3);
    }

    #[test]
    fn compaction_of_one_class_packs_it() {
        let pool = ZsPool::new(4096).unwrap();
        // 128 objects of 32 bytes per 1-page zspage: 10 zspages, then keep 1 in 10.
        let hs: Vec<Handle> = (0..1280).map(|_| pool.malloc(32).unwrap()).collect();
        for (i, &h) in hs.iter().enumerate() {
            pool.write(h, &pattern(i as u64, 32));
        }
        assert_eq!(pool.total_pages(), 10);
        let kept: Vec<(usize, Handle)> = hs
            .iter()
            .copied()
            .enumerate()
            .filter(|&(i, h)| {
                if i % 10 == 0 {
                    true
                } else {
                    pool.free(h);
                    false
                }
            })
            .collect();
        assert_eq!(pool.total_pages(), 10);
        assert_eq!(pool.compact(), 9);
        assert_eq!(pool.total_pages(), 1);
        for (i, h) in kept {
            check_obj(&pool, h, i as u64, 32);
            pool.free(h);
        }
        assert_eq!(pool.total_pages(), 0);
    }

    /// Workers malloc/write/read/free their own handles while another thread compacts in a loop,
    /// for `duration`, and longer (up to a minute) until compaction has freed something, so a
    /// slow machine (or valgrind) still exercises moves.
    fn stress(page: usize, threads: usize, duration: Duration) {
        const MAX_DURATION: Duration = Duration::from_secs(60);
        let _heavy = heavy();
        let pool = Arc::new(ZsPool::new(page).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let compacted = Arc::new(AtomicU64::new(0));
        let compactor = {
            let (pool, stop, compacted) = (pool.clone(), stop.clone(), compacted.clone());
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    compacted.fetch_add(pool.compact(), Ordering::Relaxed);
                    rounds += 1;
                }
                rounds
            })
        };
        let workers: Vec<_> = (0..threads as u64)
            .map(|t| {
                let (pool, compacted) = (pool.clone(), compacted.clone());
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(0x5eed + t);
                    let mut live: Vec<(Handle, u64, usize)> = Vec::new();
                    let mut next_seed = t << 40;
                    let start = Instant::now();
                    let mut ops = 0u64;
                    let keep_going = || {
                        let elapsed = start.elapsed();
                        elapsed < duration
                            || (compacted.load(Ordering::Relaxed) == 0 && elapsed < MAX_DURATION)
                    };
                    while keep_going() {
                        for _ in 0..64 {
                            ops += 1;
                            let r = rng.gen_range(0..100);
                            if r < 40 || live.len() < 64 {
                                // Mostly small objects, so many share zspages.
                                let size = if rng.gen_bool(0.9) {
                                    rng.gen_range(1..=page / 4)
                                } else {
                                    rng.gen_range(1..=page)
                                };
                                let h = pool.malloc(size).unwrap();
                                next_seed += 1;
                                pool.write(h, &pattern(next_seed, size));
                                live.push((h, next_seed, size));
                            } else if r < 75 {
                                let (h, s, size) = live[rng.gen_range(0..live.len())];
                                check_obj(&pool, h, s, size);
                            } else if r < 80 {
                                // Rewrite in place while it may be moving.
                                let i = rng.gen_range(0..live.len());
                                let (h, _, size) = live[i];
                                next_seed += 1;
                                pool.write(h, &pattern(next_seed, size));
                                live[i].1 = next_seed;
                            } else {
                                let i = rng.gen_range(0..live.len());
                                let (h, s, size) = live.swap_remove(i);
                                check_obj(&pool, h, s, size);
                                pool.free(h);
                            }
                            // Keep the working set bounded, freeing in bursts (sparse zspages).
                            if live.len() > 4000 {
                                live.retain(|&(h, _, _)| {
                                    let drop = rng.gen_bool(0.6);
                                    if drop {
                                        pool.free(h);
                                    }
                                    !drop
                                });
                            }
                        }
                    }
                    for (h, s, size) in live {
                        check_obj(&pool, h, s, size);
                        pool.free(h);
                    }
                    ops
                })
            })
            .collect();
        let ops: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
        stop.store(true, Ordering::Relaxed);
        let rounds = compactor.join().unwrap();
        pool.check();
        assert_eq!(pool.total_pages(), 0);
        assert_eq!(pool.pages_compacted(), compacted.load(Ordering::Relaxed));
        assert!(
            pool.pages_compacted() > 0,
            "compaction never freed anything"
        );
        eprintln!(
            "stress page {page}: {ops} ops, {rounds} compaction rounds, {} pages compacted",
            pool.pages_compacted()
        );
    }

    #[test]
    fn stress_concurrent_compaction_4k() {
        stress(4096, 3, Duration::from_secs(3));
    }

    #[test]
    fn stress_concurrent_compaction_64k() {
        stress(65536, 2, Duration::from_secs(1));
    }
}
