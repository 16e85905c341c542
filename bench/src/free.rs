//! `uzram bench free`: releasing stored pages, synchronous against deferred free, and the
//! short class-lock critical section against freeing pages under the lock.
//!
//! Measured in one run, on the same corpus pages:
//!
//! 1. **Release** (the analogue of a process exiting, whose swapped-out pages are freed): a
//!    fresh device is filled with N corpus pages, then `T` threads discard all of it in 2 MiB
//!    ranges (contiguous shares, one `discard` call per range). Once with the release path
//!    freeing allocator objects synchronously (the anchor: `Device::bench_new_release_sync`), once
//!    through the deferred-free queue (the default). Reported per mode: the caller-visible
//!    release time (first range started to last range returned), p50/p99 of one range's
//!    `discard`, the process CPU time from the start until the memory is back (every thread,
//!    the queue's worker included), the time until the memory is back (`mem_used_total` at 0;
//!    for the deferred run the bench flushes the queue as soon as the callers return, as a
//!    frontend's flush after a TRIM would), and what the pool still held when the callers
//!    returned.
//! 2. **Short critical section**: a pool holds the corpus pages' compressed objects (in
//!    allocation order, so two freeing threads meet in the same classes and zspages); two
//!    threads free alternate handles. Once as built (an emptied zspage's pages returned after
//!    the class lock is dropped), once with the benchmark-only switch that returns them under
//!    the class lock (zsmalloc before upstream's change). Measured on the corpus's mix of
//!    objects (the headline `short_lock_speedup`), and again on its incompressible pages
//!    alone (`short_lock_speedup_huge`): huge objects live one per one-page zspage, so every
//!    free empties a zspage and both threads want the same class lock; the mix shows how
//!    often that happens in practice, the huge-only run what the change does when it does.
//!
//! Every time is the median of `repeats` runs; per-range percentiles pool the ranges of all
//! repeats. The two variants of a comparison run back to back in each repetition (in
//! alternating order), and each ratio is the median of the per-repetition ratios, so a change
//! of load on a shared machine between repetitions does not land on one side only. The short
//! critical section is compared over `3 * repeats` repetitions (a run is short). Same-filled
//! pages are stored as a word and free nothing, so they are left out of
//! both parts.

use crate::corpus::Corpus;
use crate::{f, median, percentile, Table};
use serde_json::json;
use std::sync::Barrier;
use std::time::{Duration, Instant};
use uzram::compress::{self, same_filled_word, CodecParams};
use uzram::device::{Device, DeviceConfig};
use uzram::error::{Error, Result};
use uzram::zsmalloc::{DeferredStats, Handle, ZsPool};

/// Bytes per release call: 2 MiB, the granularity of a process's swap release (one PMD's worth
/// of 4 KiB pages) and the choice.
pub const RANGE_BYTES: usize = 2 << 20;

/// Options of `uzram bench free`.
#[derive(Debug, Clone)]
pub struct FreeBenchOptions {
    /// Algorithm the device compresses with.
    pub codec: String,
    /// Page counts to fill and release, one after the other (the corpus's non-same-filled
    /// pages, cycled); empty: all of them once. The short critical section is measured at the
    /// first.
    pub pages: Vec<usize>,
    /// Releasing thread counts to measure.
    pub threads: Vec<usize>,
    /// Timing repetitions (the median is reported).
    pub repeats: usize,
}

impl Default for FreeBenchOptions {
    fn default() -> Self {
        FreeBenchOptions {
            codec: "lz4".into(),
            pages: Vec::new(),
            threads: vec![1, 2],
            repeats: 5,
        }
    }
}

/// CPU time of the whole process (all threads), in seconds.
pub(crate) fn process_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One release run.
#[derive(Debug)]
struct Release {
    /// First range started → last range returned.
    wall_ms: f64,
    /// Process CPU time from the start until the memory is back.
    cpu_ms: f64,
    /// Start → `mem_used_total` back at 0.
    back_ms: f64,
    /// `mem_used_total` when the callers returned.
    held_bytes: u64,
    /// `mem_used_total` when full.
    full_bytes: u64,
    /// Slots of the deferred-free queue when the callers returned (it grows during a release).
    queue_slots_at_return: u64,
    /// Duration of each `discard` call.
    range_ms: Vec<f64>,
    deferred: DeferredStats,
}

fn fill(dev: &Device, pages: &[&[u8]], ps: usize) -> Result<()> {
    let per_range = RANGE_BYTES / ps;
    let mut buf = Vec::with_capacity(RANGE_BYTES);
    for (r, chunk) in pages.chunks(per_range).enumerate() {
        buf.clear();
        for p in chunk {
            buf.extend_from_slice(p);
        }
        dev.write_at(&buf, (r * RANGE_BYTES) as u64)?;
    }
    Ok(())
}

fn release_once(
    pages: &[&[u8]],
    ps: usize,
    codec: &str,
    threads: usize,
    deferred: bool,
) -> Result<Release> {
    let config = DeviceConfig {
        disksize_bytes: (pages.len() * ps) as u64,
        page_size_bytes: ps,
        comp_algorithm: codec.to_string(),
        ..Default::default()
    };
    let dev = if deferred {
        Device::new(config)?
    } else {
        Device::bench_new_release_sync(config)?
    };
    fill(&dev, pages, ps)?;
    let full_bytes = dev.stats().mem_used_total_bytes;
    let total = (pages.len() * ps) as u64;
    let ranges = total.div_ceil(RANGE_BYTES as u64);
    let share = ranges.div_ceil(threads as u64);
    let barrier = Barrier::new(threads + 1);
    let cpu0 = process_cpu_secs();
    let (start, range_ms, wall) = std::thread::scope(|s| -> Result<_> {
        let workers: Vec<_> = (0..threads as u64)
            .map(|t| {
                let (dev, barrier) = (&dev, &barrier);
                s.spawn(move || -> Result<Vec<f64>> {
                    let mut lat = Vec::new();
                    barrier.wait();
                    for r in (t * share)..((t + 1) * share).min(ranges) {
                        let off = r * RANGE_BYTES as u64;
                        let len = (RANGE_BYTES as u64).min(total - off);
                        let t0 = Instant::now();
                        dev.discard(off, len)?;
                        lat.push(ms(t0.elapsed()));
                    }
                    Ok(lat)
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let mut all = Vec::new();
        for w in workers {
            all.extend(w.join().expect("release thread")?);
        }
        Ok((start, all, start.elapsed()))
    })?;
    let held_bytes = dev.stats().mem_used_total_bytes;
    let queue_slots_at_return = dev.deferred_stats().capacity;
    dev.flush_deferred();
    let back = start.elapsed();
    let cpu_ms = (process_cpu_secs() - cpu0) * 1e3;
    let s = dev.stats();
    if s.mem_used_total_bytes != 0 || s.pages_stored != 0 {
        return Err(Error::io(format!(
            "release left memory behind: mm_stat {}",
            s.mm_stat().trim()
        )));
    }
    Ok(Release {
        wall_ms: ms(wall),
        cpu_ms,
        back_ms: ms(back),
        held_bytes,
        full_bytes,
        queue_slots_at_return,
        range_ms,
        deferred: dev.deferred_stats(),
    })
}

/// The medians of a mode at one thread count.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct ReleaseSummary {
    release_ms: f64,
    range_p50_ms: f64,
    range_p99_ms: f64,
    cpu_ms: f64,
    memory_back_ms: f64,
    held_at_return_bytes: f64,
    full_bytes: f64,
    queue_slots_at_return: f64,
    queued: u64,
    fallback_contended: u64,
    fallback_full: u64,
    wakeups: u64,
}

fn summarise(runs: &[Release]) -> ReleaseSummary {
    let m = |g: fn(&Release) -> f64| median(&runs.iter().map(g).collect::<Vec<_>>());
    let ranges: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.range_ms.iter().copied())
        .collect();
    let last = runs.last().expect("at least one run").deferred;
    ReleaseSummary {
        release_ms: m(|r| r.wall_ms),
        range_p50_ms: percentile(&ranges, 50.0),
        range_p99_ms: percentile(&ranges, 99.0),
        cpu_ms: m(|r| r.cpu_ms),
        memory_back_ms: m(|r| r.back_ms),
        held_at_return_bytes: m(|r| r.held_bytes as f64),
        full_bytes: m(|r| r.full_bytes as f64),
        queue_slots_at_return: m(|r| r.queue_slots_at_return as f64),
        queued: last.queued,
        fallback_contended: last.fallback_contended,
        fallback_full: last.fallback_full,
        wakeups: last.wakeups,
    }
}

/// Two threads free alternate handles of a pool holding `objs`; returns the wall time in ms.
fn concurrent_free_ms(objs: &[Vec<u8>], ps: usize, under_lock: bool) -> Result<f64> {
    let pool = if under_lock {
        ZsPool::bench_new_release_under_class_lock(ps)?
    } else {
        ZsPool::new(ps)?
    };
    let handles: Vec<Handle> = objs
        .iter()
        .map(|o| {
            let h = pool.malloc(o.len())?;
            pool.write(h, o);
            Ok(h)
        })
        .collect::<Result<_>>()?;
    const THREADS: usize = 2;
    let barrier = Barrier::new(THREADS + 1);
    let wall = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (pool, handles, barrier) = (&pool, &handles, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    for &h in handles.iter().skip(t).step_by(THREADS) {
                        pool.free(h);
                    }
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        for w in workers {
            w.join().expect("free thread");
        }
        start.elapsed()
    });
    if pool.total_pages() != 0 {
        return Err(Error::io("concurrent free left pages behind"));
    }
    Ok(ms(wall))
}

/// Runs the benchmark, prints its table, and returns the JSON document.
pub fn run(corpus: &Corpus, opts: &FreeBenchOptions) -> Result<serde_json::Value> {
    let ps = corpus.page_size_bytes();
    let work: Vec<&[u8]> = (0..corpus.len())
        .map(|i| corpus.page(i))
        .filter(|p| same_filled_word(p).is_none())
        .collect();
    if work.is_empty() {
        return Err(Error::invalid(
            "the corpus has no pages that are not same-filled",
        ));
    }
    let sizes = if opts.pages.is_empty() {
        vec![work.len()]
    } else {
        opts.pages.clone()
    };
    if sizes.contains(&0) {
        return Err(Error::invalid("--pages must not be 0"));
    }
    if opts.threads.is_empty() || opts.threads.contains(&0) {
        return Err(Error::invalid(
            "--threads takes thread counts of at least 1",
        ));
    }
    let cycled = |n: usize| -> Vec<&[u8]> { (0..n).map(|i| work[i % work.len()]).collect() };
    let reps = opts.repeats.max(1);

    // 1. Release: sync and deferred, per page count and thread count, alternating so drift
    // hits both.
    let mut by_pages = Vec::new();
    let mut table = Table::new(&[
        "pages",
        "threads",
        "free",
        "release ms",
        "range p50 ms",
        "range p99 ms",
        "CPU ms",
        "memory back ms",
        "held at return MiB",
        "queue slots at return",
        "queued/fallback",
    ]);
    for &n in &sizes {
        let pages = cycled(n);
        let mut by_threads = Vec::new();
        for &t in &opts.threads {
            let (mut sync, mut deferred) = (Vec::new(), Vec::new());
            for rep in 0..reps {
                if rep % 2 == 0 {
                    sync.push(release_once(&pages, ps, &opts.codec, t, false)?);
                    deferred.push(release_once(&pages, ps, &opts.codec, t, true)?);
                } else {
                    deferred.push(release_once(&pages, ps, &opts.codec, t, true)?);
                    sync.push(release_once(&pages, ps, &opts.codec, t, false)?);
                }
            }
            let paired = |g: fn(&Release) -> f64| {
                let ratios: Vec<f64> = sync
                    .iter()
                    .zip(&deferred)
                    .map(|(s, d)| g(d) / g(s))
                    .collect();
                median(&ratios)
            };
            let release_ratio = paired(|r| r.wall_ms);
            let cpu_ratio = paired(|r| r.cpu_ms);
            let memory_back_ratio = paired(|r| r.back_ms);
            let (s, d) = (summarise(&sync), summarise(&deferred));
            for (name, m) in [("sync", &s), ("deferred", &d)] {
                table.row(vec![
                    n.to_string(),
                    t.to_string(),
                    name.into(),
                    f(m.release_ms),
                    f(m.range_p50_ms),
                    f(m.range_p99_ms),
                    f(m.cpu_ms),
                    f(m.memory_back_ms),
                    f(m.held_at_return_bytes / (1 << 20) as f64),
                    format!("{:.0}", m.queue_slots_at_return),
                    format!("{}/{}", m.queued, m.fallback_contended + m.fallback_full),
                ]);
            }
            by_threads.push(json!({
                "pages": n,
                "threads": t,
                "release_ms_sync": s.release_ms,
                "release_ms_deferred": d.release_ms,
                "release_ratio": release_ratio,
                "cpu_ms_sync": s.cpu_ms,
                "cpu_ms_deferred": d.cpu_ms,
                "cpu_ratio": cpu_ratio,
                "range_p50_ms_sync": s.range_p50_ms,
                "range_p99_ms_sync": s.range_p99_ms,
                "range_p50_ms_deferred": d.range_p50_ms,
                "range_p99_ms_deferred": d.range_p99_ms,
                "memory_back_ms_sync": s.memory_back_ms,
                "memory_back_ms_deferred": d.memory_back_ms,
                "memory_back_ratio": memory_back_ratio,
                "sync": s,
                "deferred": d,
            }));
        }
        by_pages.push(json!({"pages": n, "by_threads": by_threads}));
    }
    println!(
        "release in {} KiB ranges ({ps}-byte pages), median of {reps}:\n{}",
        RANGE_BYTES >> 10,
        table.render()
    );
    let n = sizes[0];
    let pages = cycled(n);

    // 2. The short critical section, 2 threads.
    let codec = compress::new_codec(&opts.codec, CodecParams::default())?;
    let huge = ZsPool::new(ps)?.huge_class_size_bytes();
    let mut dst = vec![0u8; compress::compress_bound(ps)];
    let objs: Vec<Vec<u8>> = pages
        .iter()
        .map(|p| {
            let len = codec.compress(p, &mut dst)?;
            Ok(if len >= huge {
                p.to_vec()
            } else {
                dst[..len].to_vec()
            })
        })
        .collect::<Result<_>>()?;
    let huge_objs: Vec<Vec<u8>> = {
        let huge: Vec<&Vec<u8>> = objs.iter().filter(|o| o.len() == ps).collect();
        if huge.is_empty() {
            Vec::new()
        } else {
            (0..objs.len())
                .map(|i| huge[i % huge.len()].clone())
                .collect()
        }
    };
    // (short ms, under-lock ms, median of the per-repetition speedups)
    let compare = |objs: &[Vec<u8>]| -> Result<(f64, f64, f64)> {
        if objs.is_empty() {
            return Ok((f64::NAN, f64::NAN, f64::NAN));
        }
        let (mut short, mut locked, mut speedup) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..3 * reps {
            let (s, l) = if rep % 2 == 0 {
                let s = concurrent_free_ms(objs, ps, false)?;
                (s, concurrent_free_ms(objs, ps, true)?)
            } else {
                let l = concurrent_free_ms(objs, ps, true)?;
                (concurrent_free_ms(objs, ps, false)?, l)
            };
            short.push(s);
            locked.push(l);
            speedup.push(l / s);
        }
        Ok((median(&short), median(&locked), median(&speedup)))
    };
    let (short_ms, locked_ms, short_lock_speedup) = compare(&objs)?;
    let (short_huge_ms, locked_huge_ms, short_lock_speedup_huge) = compare(&huge_objs)?;
    let mut t2 = Table::new(&[
        "2 threads free",
        "under class lock ms",
        "short section ms",
        "speedup",
    ]);
    t2.row(vec![
        format!("corpus mix ({} objects)", objs.len()),
        f(locked_ms),
        f(short_ms),
        format!("{}x", f(short_lock_speedup)),
    ]);
    t2.row(vec![
        format!("incompressible pages only ({} objects)", huge_objs.len()),
        f(locked_huge_ms),
        f(short_huge_ms),
        format!("{}x", f(short_lock_speedup_huge)),
    ]);
    println!("{}", t2.render());

    let first = &by_pages[0]["by_threads"][0];
    let doc = json!({
        "bench": "free",
        "codec": opts.codec,
        "page_size_bytes": ps,
        "pages": n,
        "page_counts": sizes,
        "range_bytes": RANGE_BYTES,
        "repeats": reps,
        "threads": opts.threads,
        "summary_threads": opts.threads[0],
        "release_ms_sync": first["release_ms_sync"],
        "release_ms_deferred": first["release_ms_deferred"],
        "release_ratio": first["release_ratio"],
        "cpu_ratio": first["cpu_ratio"],
        "range_p50_ms_sync": first["range_p50_ms_sync"],
        "range_p99_ms_sync": first["range_p99_ms_sync"],
        "range_p50_ms_deferred": first["range_p50_ms_deferred"],
        "range_p99_ms_deferred": first["range_p99_ms_deferred"],
        "memory_back_ms_sync": first["memory_back_ms_sync"],
        "memory_back_ms_deferred": first["memory_back_ms_deferred"],
        "memory_back_ratio": first["memory_back_ratio"],
        "short_lock_speedup": short_lock_speedup,
        "short_lock_free_ms": short_ms,
        "under_lock_free_ms": locked_ms,
        "short_lock_speedup_huge": short_lock_speedup_huge,
        "short_lock_free_ms_huge": short_huge_ms,
        "under_lock_free_ms_huge": locked_huge_ms,
        "by_threads": by_pages[0]["by_threads"],
        "by_pages": by_pages,
        "targets": {
            "release_ratio_max": 1.0 / 3.0,
            "cpu_ratio_max": 1.05,
            "memory_back_ratio_max": 1.0,
            "short_lock_speedup_min": 1.15,
        },
    });
    let mut summary = Table::new(&["figure", "pages", "threads", "value", "target"]);
    for v in doc["by_pages"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["by_threads"].as_array().into_iter().flatten())
    {
        for (k, target) in [
            ("release_ratio", "<= 0.333"),
            ("cpu_ratio", "<= 1.05"),
            ("memory_back_ratio", "<= 1.0"),
        ] {
            summary.row(vec![
                k.into(),
                v["pages"].to_string(),
                v["threads"].to_string(),
                f(v[k].as_f64().unwrap_or(f64::NAN)),
                target.into(),
            ]);
        }
    }
    summary.row(vec![
        "short_lock_speedup".into(),
        n.to_string(),
        "2".into(),
        f(short_lock_speedup),
        ">= 1.15".into(),
    ]);
    println!("{}", summary.render());
    Ok(doc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The benchmark runs end to end at a tiny size (no timing is checked).
    #[test]
    fn runs_at_a_tiny_size() {
        let mut corpus = Corpus::new(4096).unwrap();
        let mut pages = vec![0u8; 600 * 4096];
        for (i, p) in pages.chunks_mut(4096).enumerate() {
            for (j, b) in p.iter_mut().enumerate() {
                *b = ((i * 7 + j / 16) % 251) as u8 ^ (j as u8 & 3);
            }
        }
        corpus.add_source("synthetic", &pages).unwrap();
        let doc = run(
            &corpus,
            &FreeBenchOptions {
                repeats: 1,
                pages: vec![300, 1200],
                threads: vec![1, 2],
                ..Default::default()
            },
        )
        .unwrap();
        let by_pages = doc["by_pages"].as_array().unwrap();
        assert_eq!(by_pages.len(), 2);
        assert_eq!(by_pages[1]["pages"], 1200);
        for p in by_pages {
            for t in p["by_threads"].as_array().unwrap() {
                for k in ["release_ratio", "cpu_ratio", "memory_back_ratio"] {
                    assert!(t[k].as_f64().is_some_and(|v| v > 0.0), "{k}: {t}");
                }
            }
        }
        for k in [
            "release_ms_sync",
            "release_ms_deferred",
            "release_ratio",
            "cpu_ratio",
            "memory_back_ratio",
            "short_lock_speedup",
        ] {
            assert!(doc[k].as_f64().is_some_and(|v| v > 0.0), "{k}: {doc}");
        }
        assert_eq!(doc["by_threads"].as_array().unwrap().len(), 2);
    }
}
