//! `uzram bench store`: the page store against its anchors, on real program memory.
//!
//! Measured in one run, on the same pages:
//! 1. the raw codec (compress and decompress every page, single thread): the ceiling;
//! 2. the store path: `Device::write_at` / `read_at` of one page per call, 1 and 2 threads,
//!    and its ratio to the raw codec;
//! 3. packing (`mem_used_total / compr_data_size`) after filling, after discarding a random half
//!    of the pages, and after compaction;
//! 4. the same corpus written with the same algorithm through the kernel's `/dev/zram0`
//!    (O_DIRECT), when it exists and we are root: its `mm_stat` at the same three points and its
//!    write/read MB/s. zram0 is reset afterwards.
//!
//! Throughput ratios are measured on the corpus's pages that are *not* same-filled: on those both
//! the raw codec and the store path do the same compression work (the store path skips the codec
//! for same-filled pages, which would flatter it). Packing uses every page. Each timing is the
//! median of `repeats` runs.
//!
//! Each repetition runs raw compress, store write, raw decompress, store read and store
//! overwrite back to back, and the ratios are medians of these paired ratios. The single-thread
//! ratios (`write_vs_raw`, `read_vs_raw`, `overwrite_vs_raw`) compare the thread's CPU time
//! (user + system: page faults and `madvise` count), which other load on a shared machine does
//! not inflate; the wall-clock ratios are reported beside them (`*_wall`).

use crate::corpus::Corpus;
use crate::kernel_zram::{AlignedBuf, KernelZram};
use crate::{f, mbps, median, thread_cpu_time, time, time_cpu, Table};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::json;
use std::sync::Barrier;
use std::time::Duration;
use uzram::compress::{self, same_filled_word, CodecParams};
use uzram::device::{Device, DeviceConfig, StatsSnapshot};
use uzram::error::{Error, Result};
use uzram::slot::SlotTable;

/// Options of `uzram bench store`.
#[derive(Debug, Clone)]
pub struct StoreBenchOptions {
    /// Algorithm for both uzram and the kernel.
    pub codec: String,
    /// Pages to use (the corpus is cycled if it has fewer); `None`: the whole corpus.
    pub pages: Option<usize>,
    /// Timing repetitions (the median is reported).
    pub repeats: usize,
    /// Seed for the random half discarded.
    pub seed: u64,
    /// Skip the kernel anchor even when available.
    pub no_kernel: bool,
}

impl Default for StoreBenchOptions {
    fn default() -> Self {
        StoreBenchOptions {
            codec: "lz4".into(),
            pages: None,
            repeats: 5,
            seed: 1,
            no_kernel: false,
        }
    }
}

/// `mem_used_total / compr_data_size`: pool bytes per byte of compressed data.
fn packing(s: &StatsSnapshot) -> f64 {
    s.mem_used_total_bytes as f64 / s.compr_data_size_bytes as f64
}

/// Kernel mm_stat columns → (orig, compr, mem_used).
fn kernel_packing(mm: &[u64]) -> f64 {
    mm[2] as f64 / mm[1] as f64
}

/// Per-repetition figures of the interleaved raw/store runs.
#[derive(Default)]
struct Samples {
    raw_c: Vec<f64>,
    raw_d: Vec<f64>,
    write: Vec<f64>,
    read: Vec<f64>,
    write_2t: Vec<f64>,
    read_2t: Vec<f64>,
    write_vs_raw: Vec<f64>,
    write_vs_raw_wall: Vec<f64>,
    read_vs_raw_wall: Vec<f64>,
    overwrite: Vec<f64>,
    overwrite_vs_raw: Vec<f64>,
    read_vs_raw: Vec<f64>,
    write_2t_vs_1t: Vec<f64>,
    read_2t_vs_1t: Vec<f64>,
}

/// Writes (or reads) page `i` of `work` at page `i` of `dev`, one page per call, split over
/// `threads` threads that start together; returns the slowest thread's wall time and the
/// largest CPU time of one thread.
fn store_pass(
    dev: &Device,
    work: &[&[u8]],
    threads: usize,
    read: bool,
) -> Result<(Duration, Duration)> {
    let ps = dev.page_size_bytes();
    let chunk = work.len().div_ceil(threads);
    let barrier = Barrier::new(threads);
    let results: Vec<Result<(Duration, Duration)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || -> Result<(Duration, Duration)> {
                    let lo = (t * chunk).min(work.len());
                    let hi = ((t + 1) * chunk).min(work.len());
                    let mut buf = vec![0u8; ps];
                    barrier.wait();
                    let (start, cpu_start) = (std::time::Instant::now(), thread_cpu_time());
                    for (i, p) in work.iter().enumerate().take(hi).skip(lo) {
                        let off = (i * ps) as u64;
                        if read {
                            dev.read_at(&mut buf, off)?;
                        } else {
                            dev.write_at(p, off)?;
                        }
                    }
                    Ok((start.elapsed(), thread_cpu_time() - cpu_start))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread"))
            .collect()
    });
    let (mut wall, mut cpu) = (Duration::ZERO, Duration::ZERO);
    for r in results {
        let (w, c) = r?;
        wall = wall.max(w);
        cpu = cpu.max(c);
    }
    Ok((wall, cpu))
}

/// Untimed: every page of `work` reads back identical.
fn verify(dev: &Device, work: &[&[u8]]) -> Result<()> {
    let ps = dev.page_size_bytes();
    let mut buf = vec![0u8; ps];
    for (i, p) in work.iter().enumerate() {
        dev.read_at(&mut buf, (i * ps) as u64)?;
        if buf != *p {
            return Err(Error::io(format!("page {i} read back different")));
        }
    }
    Ok(())
}

/// Runs the benchmark, prints its table, and returns the JSON document.
pub fn run(corpus: &Corpus, opts: &StoreBenchOptions) -> Result<serde_json::Value> {
    let ps = corpus.page_size_bytes();
    let n = opts.pages.unwrap_or(corpus.len());
    if corpus.is_empty() || n == 0 {
        return Err(Error::invalid("the corpus has no pages"));
    }
    let pages: Vec<&[u8]> = (0..n).map(|i| corpus.page(i % corpus.len())).collect();
    let work: Vec<&[u8]> = pages
        .iter()
        .copied()
        .filter(|p| same_filled_word(p).is_none())
        .collect();
    if work.is_empty() {
        return Err(Error::invalid("every page of the corpus is same-filled"));
    }
    let same_share = 1.0 - work.len() as f64 / pages.len() as f64;
    let work_bytes = (work.len() * ps) as u64;
    let reps = opts.repeats.max(1);

    // 0. The lz4 implementations and zstd side by side on the same pages (what chose liblz4).
    let impls = crate::codec_impls::run(&work, reps)?;

    // 1–2. The raw codec and the store path, interleaved: each repetition runs raw compress,
    // store write, raw decompress, store read back to back, so a noisy neighbour slows both
    // sides of a ratio alike; the ratios reported are medians of these paired ratios.
    let codec = compress::new_codec(&opts.codec, CodecParams::default())?;
    let bound = compress::compress_bound(ps);
    let mut comp = vec![0u8; bound * work.len()];
    let mut lens = vec![0usize; work.len()];
    let mut out = vec![0u8; ps];
    let new_dev = |npages: usize| {
        Device::new(DeviceConfig {
            disksize_bytes: (npages * ps) as u64,
            page_size_bytes: ps,
            comp_algorithm: opts.codec.clone(),
            ..Default::default()
        })
    };
    let mut s = Samples::default();
    for _ in 0..reps {
        let (r, d, raw_c_cpu) = time_cpu(|| -> Result<()> {
            for (i, p) in work.iter().enumerate() {
                lens[i] = codec.compress(p, &mut comp[i * bound..(i + 1) * bound])?;
            }
            Ok(())
        });
        r?;
        let raw_c = mbps(work_bytes, d);
        let dev = new_dev(work.len())?;
        let (d, w_cpu) = store_pass(&dev, &work, 1, false)?;
        let w = mbps(work_bytes, d);
        let (r, d, raw_d_cpu) = time_cpu(|| -> Result<()> {
            for (i, len) in lens.iter().enumerate() {
                codec.decompress(&comp[i * bound..i * bound + len], &mut out)?;
            }
            Ok(())
        });
        r?;
        let raw_d = mbps(work_bytes, d);
        let (d, rd_cpu) = store_pass(&dev, &work, 1, true)?;
        let rd = mbps(work_bytes, d);
        verify(&dev, &work)?;
        // Overwrite every page with another page of the corpus (the steady state of a swap
        // device: each store allocates a new object and frees the old one, so the pool's pages
        // are reused instead of faulted in fresh), against the raw compress of this repetition.
        let shifted: Vec<&[u8]> = (0..work.len())
            .map(|i| work[(i + 1) % work.len()])
            .collect();
        let (d, ow_cpu) = store_pass(&dev, &shifted, 1, false)?;
        let ow = mbps(work_bytes, d);
        verify(&dev, &shifted)?;
        drop(dev);
        // Two threads on a fresh device, compared with one thread of this repetition.
        let dev = new_dev(work.len())?;
        let w2 = mbps(work_bytes, store_pass(&dev, &work, 2, false)?.0);
        let rd2 = mbps(work_bytes, store_pass(&dev, &work, 2, true)?.0);
        verify(&dev, &work)?;
        drop(dev);
        s.raw_c.push(raw_c);
        s.raw_d.push(raw_d);
        s.write.push(w);
        s.read.push(rd);
        s.overwrite.push(ow);
        s.write_2t.push(w2);
        s.read_2t.push(rd2);
        s.write_vs_raw
            .push(raw_c_cpu.as_secs_f64() / w_cpu.as_secs_f64());
        s.read_vs_raw
            .push(raw_d_cpu.as_secs_f64() / rd_cpu.as_secs_f64());
        s.overwrite_vs_raw
            .push(raw_c_cpu.as_secs_f64() / ow_cpu.as_secs_f64());
        s.write_vs_raw_wall.push(w / raw_c);
        s.read_vs_raw_wall.push(rd / raw_d);
        s.write_2t_vs_1t.push(w2 / w);
        s.read_2t_vs_1t.push(rd2 / rd);
    }
    drop(comp);
    let raw_compress_mbps = median(&s.raw_c);
    let raw_decompress_mbps = median(&s.raw_d);
    let (write_mbps, read_mbps) = (median(&s.write), median(&s.read));
    let (write_mbps_2t, read_mbps_2t) = (median(&s.write_2t), median(&s.read_2t));
    let write_vs_raw = median(&s.write_vs_raw);
    let read_vs_raw = median(&s.read_vs_raw);

    // 3. Fill every page into a fresh device (`reps` times: wall and thread CPU time, medians),
    // then, on the last one, packing: fill, discard a random half, compact.
    let (mut fill_wall, mut fill_cpu, mut fill_proc) = (Vec::new(), Vec::new(), Vec::new());
    let mut dev = None;
    for _ in 0..reps {
        drop(dev.take());
        let d = new_dev(pages.len())?;
        let proc_start = crate::free::process_cpu_secs();
        let (r, wall, cpu) = time_cpu(|| -> Result<()> {
            for (i, p) in pages.iter().enumerate() {
                d.write_at(p, (i * ps) as u64)?;
            }
            Ok(())
        });
        r?;
        fill_wall.push(mbps((pages.len() * ps) as u64, wall));
        fill_cpu.push(mbps((pages.len() * ps) as u64, cpu));
        // Every thread of the process: the writer and the pool's reserve refiller.
        let proc_secs = crate::free::process_cpu_secs() - proc_start;
        fill_proc.push((pages.len() * ps) as f64 / proc_secs / 1e6);
        dev = Some(d);
    }
    let dev = dev.expect("at least one repetition");
    let filled = dev.stats();
    let mut order: Vec<usize> = (0..pages.len()).collect();
    order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(opts.seed));
    let trimmed_pages = &order[..pages.len() / 2];
    for &i in trimmed_pages {
        dev.discard((i * ps) as u64, ps as u64)?;
    }
    // Discard hands objects to the deferred-free queue; the kernel frees discarded pages at
    // once, so compare after the queue is drained.
    dev.flush_deferred();
    let trimmed = dev.stats();
    let (_, compact_time) = time(|| dev.compact());
    let compacted = dev.stats();
    drop(dev);

    // 4. The kernel's zram0 on the same pages.
    let kernel = if opts.no_kernel {
        Err("skipped (--no-kernel)".to_string())
    } else if ps != 4096 {
        Err(format!("page size {ps}: the kernel's is 4096"))
    } else {
        match KernelZram::open() {
            None => Err(KernelZram::unavailable_reason()),
            Some(k) if !k.has_algorithm(&opts.codec) => {
                Err(format!("the kernel's zram has no {}", opts.codec))
            }
            Some(k) => {
                kernel_run(&k, &pages, trimmed_pages, &opts.codec, reps).map_err(|e| e.to_string())
            }
        }
    };

    let mut t = Table::new(&["store benchmark", "uzram", "kernel zram", "ratio"]);
    let pct = |v: f64| format!("{:.1}%", v * 100.0);
    t.row(vec![
        format!("raw {} compress MB/s", opts.codec),
        f(raw_compress_mbps),
        String::new(),
        String::new(),
    ]);
    t.row(vec![
        format!("raw {} decompress MB/s", opts.codec),
        f(raw_decompress_mbps),
        String::new(),
        String::new(),
    ]);
    t.row(vec![
        "store write MB/s (1 thread)".into(),
        f(write_mbps),
        String::new(),
        format!(
            "{} of raw ({} by wall clock)",
            pct(write_vs_raw),
            pct(median(&s.write_vs_raw_wall))
        ),
    ]);
    t.row(vec![
        "store overwrite MB/s (1 thread)".into(),
        f(median(&s.overwrite)),
        String::new(),
        format!("{} of raw", pct(median(&s.overwrite_vs_raw))),
    ]);
    t.row(vec![
        "store read MB/s (1 thread)".into(),
        f(read_mbps),
        String::new(),
        format!(
            "{} of raw ({} by wall clock)",
            pct(read_vs_raw),
            pct(median(&s.read_vs_raw_wall))
        ),
    ]);
    t.row(vec![
        "store write MB/s (2 threads)".into(),
        f(write_mbps_2t),
        String::new(),
        format!("{}x 1 thread", f(median(&s.write_2t_vs_1t))),
    ]);
    t.row(vec![
        "store read MB/s (2 threads)".into(),
        f(read_mbps_2t),
        String::new(),
        format!("{}x 1 thread", f(median(&s.read_2t_vs_1t))),
    ]);
    let fill_mbps = median(&fill_wall);
    let fill_cpu_mbps = median(&fill_cpu);
    let fill_proc_mbps = median(&fill_proc);
    let k = kernel.as_ref().ok();
    t.row(vec![
        "fill MB/s (all pages, wall)".into(),
        f(fill_mbps),
        k.map_or("n/a".into(), |k| f(k.write_mbps)),
        k.map_or(String::new(), |k| f(fill_mbps / k.write_mbps)),
    ]);
    t.row(vec![
        "fill MB/s (all pages, CPU time)".into(),
        f(fill_cpu_mbps),
        k.map_or("n/a".into(), |k| f(k.write_cpu_mbps)),
        k.map_or(String::new(), |k| f(fill_cpu_mbps / k.write_cpu_mbps)),
    ]);
    t.row(vec![
        "fill MB/s (all pages, process CPU)".into(),
        f(fill_proc_mbps),
        k.map_or("n/a".into(), |k| f(k.write_cpu_mbps)),
        k.map_or(String::new(), |k| f(fill_proc_mbps / k.write_cpu_mbps)),
    ]);
    t.row(vec![
        "read-back MB/s (all pages)".into(),
        String::new(),
        k.map_or("n/a".into(), |k| f(k.read_mbps)),
        String::new(),
    ]);
    for (label, ours, theirs) in [
        (
            "packing after fill",
            packing(&filled),
            k.map(|k| kernel_packing(&k.filled)),
        ),
        (
            "packing after 50% trim",
            packing(&trimmed),
            k.map(|k| kernel_packing(&k.trimmed)),
        ),
        (
            "packing after compact",
            packing(&compacted),
            k.map(|k| kernel_packing(&k.compacted)),
        ),
    ] {
        t.row(vec![
            label.into(),
            format!("{ours:.4}"),
            theirs.map_or("n/a".into(), |v| format!("{v:.4}")),
            theirs.map_or(String::new(), |v| format!("{:.4}", ours / v)),
        ]);
    }
    t.row(vec![
        "mem_used_total MiB after fill".into(),
        f(filled.mem_used_total_bytes as f64 / 1048576.0),
        k.map_or("n/a".into(), |k| f(k.filled[2] as f64 / 1048576.0)),
        String::new(),
    ]);
    t.row(vec![
        "compr_data_size MiB after fill".into(),
        f(filled.compr_data_size_bytes as f64 / 1048576.0),
        k.map_or("n/a".into(), |k| f(k.filled[1] as f64 / 1048576.0)),
        String::new(),
    ]);
    t.row(vec![
        "slot metadata bytes/page".into(),
        SlotTable::metadata_bytes_per_page().to_string(),
        String::new(),
        String::new(),
    ]);
    println!(
        "{} pages of {} bytes ({} not same-filled: {} same-filled), {}, median of {} runs",
        pages.len(),
        ps,
        work.len(),
        pct(same_share),
        opts.codec,
        reps
    );
    print!("{}", t.render());
    let mut it = Table::new(&[
        "implementation",
        "compress MB/s",
        "decompress MB/s",
        "ratio",
    ]);
    for r in &impls {
        it.row(vec![
            r.name.into(),
            f(r.compress_mbps),
            f(r.decompress_mbps),
            format!("{:.3}", r.ratio),
        ]);
    }
    println!("codec implementations (1 thread, CPU time, median of {reps}):");
    print!("{}", it.render());
    if let Err(why) = &kernel {
        println!("kernel zram anchor: not measured: {why}");
    }
    println!(
        "compaction took {:.1} ms and freed {} pages",
        compact_time.as_secs_f64() * 1e3,
        compacted.pages_compacted
    );

    let mm = |s: &StatsSnapshot| s.mm_stat().trim().to_string();
    Ok(json!({
        "benchmark": "store",
        "codec": opts.codec,
        "page_size_bytes": ps,
        "pages": pages.len(),
        "timed_pages": work.len(),
        "same_filled_share": same_share,
        "repeats": reps,
        "raw_compress_mbps": raw_compress_mbps,
        "raw_decompress_mbps": raw_decompress_mbps,
        "write_mbps": write_mbps,
        "read_mbps": read_mbps,
        "write_mbps_2t": write_mbps_2t,
        "read_mbps_2t": read_mbps_2t,
        "write_vs_raw": write_vs_raw,
        "write_vs_raw_wall": median(&s.write_vs_raw_wall),
        "read_vs_raw_wall": median(&s.read_vs_raw_wall),
        "overwrite_mbps": median(&s.overwrite),
        "overwrite_vs_raw": median(&s.overwrite_vs_raw),
        "read_vs_raw": read_vs_raw,
        "fill_mbps": fill_mbps,
        "fill_cpu_mbps": fill_cpu_mbps,
        "fill_vs_kernel": k.map(|k| fill_mbps / k.write_mbps),
        "fill_cpu_vs_kernel": k.map(|k| fill_cpu_mbps / k.write_cpu_mbps),
        "fill_process_cpu_mbps": fill_proc_mbps,
        "fill_process_cpu_vs_kernel": k.map(|k| fill_proc_mbps / k.write_cpu_mbps),
        "codec_implementations": crate::codec_impls::to_json(&impls),
        "packing_filled": packing(&filled),
        "packing_after_trim": packing(&trimmed),
        "packing_after_compact": packing(&compacted),
        "mm_stat_filled": mm(&filled),
        "mm_stat_after_trim": mm(&trimmed),
        "mm_stat_after_compact": mm(&compacted),
        "compact_ms": compact_time.as_secs_f64() * 1e3,
        "metadata_bytes_per_page": SlotTable::metadata_bytes_per_page(),
        "kernel": match &kernel {
            Ok(k) => json!({
                "write_mbps": k.write_mbps,
                "write_cpu_mbps": k.write_cpu_mbps,
                "read_mbps": k.read_mbps,
                "mm_stat_filled": k.filled,
                "mm_stat_after_trim": k.trimmed,
                "mm_stat_after_compact": k.compacted,
            }),
            Err(why) => json!({ "unavailable": why }),
        },
        "kernel_packing_filled": k.map(|k| kernel_packing(&k.filled)),
        "kernel_packing_after_trim": k.map(|k| kernel_packing(&k.trimmed)),
        "kernel_packing_after_compact": k.map(|k| kernel_packing(&k.compacted)),
        "kernel_write_mbps": k.map(|k| k.write_mbps),
        "kernel_read_mbps": k.map(|k| k.read_mbps),
    }))
}

/// What the kernel's zram0 did with the corpus.
#[derive(Debug)]
struct KernelResult {
    write_mbps: f64,
    /// Of the writing thread's CPU time (zram compresses in the submitter's context).
    write_cpu_mbps: f64,
    read_mbps: f64,
    filled: Vec<u64>,
    trimmed: Vec<u64>,
    compacted: Vec<u64>,
}

fn kernel_run(
    k: &KernelZram,
    pages: &[&[u8]],
    trimmed: &[usize],
    algo: &str,
    reps: usize,
) -> Result<KernelResult> {
    const PS: usize = 4096;
    const CHUNK_PAGES: usize = 32; // 128 KiB O_DIRECT requests, as `dd bs=128k oflag=direct`
    let size = pages.len() * PS;
    let (mut w, mut wc, mut r) = (Vec::new(), Vec::new(), Vec::new());
    let mut buf = AlignedBuf::new(CHUNK_PAGES * PS);
    // Every page laid out once, outside the timing, so the kernel's figure holds no copying
    // that uzram's (which writes from the corpus directly) does not.
    let mut all = AlignedBuf::new(size);
    for (i, p) in pages.iter().enumerate() {
        all[i * PS..(i + 1) * PS].copy_from_slice(p);
    }
    let mut result = None;
    for rep in 0..reps.max(1) {
        k.store("comp_algorithm", algo)?;
        k.store("disksize", &size.to_string())?;
        let file = k.open_direct()?;
        let (res, d, cpu) = time_cpu(|| -> Result<()> {
            for (c, chunk) in all.chunks(CHUNK_PAGES * PS).enumerate() {
                KernelZram::write_all_at(&file, chunk, (c * CHUNK_PAGES * PS) as u64)?;
            }
            Ok(())
        });
        res?;
        w.push(mbps(size as u64, d));
        wc.push(mbps(size as u64, cpu));
        let filled = k.mm_stat()?;
        let (res, d) = time(|| -> Result<()> {
            for (c, chunk) in pages.chunks(CHUNK_PAGES).enumerate() {
                KernelZram::read_exact_at(
                    &file,
                    &mut buf[..chunk.len() * PS],
                    (c * CHUNK_PAGES * PS) as u64,
                )?;
            }
            Ok(())
        });
        res?;
        r.push(mbps(size as u64, d));
        if rep == 0 {
            for &i in trimmed {
                KernelZram::discard(&file, (i * PS) as u64, PS as u64)?;
            }
            let after_trim = k.mm_stat()?;
            k.store("compact", "1")?;
            let after_compact = k.mm_stat()?;
            result = Some((filled, after_trim, after_compact));
        }
        drop(file);
        k.store("reset", "1")?;
    }
    let (filled, trimmed, compacted) = result.expect("at least one repetition");
    Ok(KernelResult {
        write_mbps: median(&w),
        write_cpu_mbps: median(&wc),
        read_mbps: median(&r),
        filled,
        trimmed,
        compacted,
    })
}
