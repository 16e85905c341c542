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

use super::kernel_zram::{AlignedBuf, KernelZram};
use super::{f, mbps, median, time, Table};
use crate::compress::{self, same_filled_word, CodecParams};
use crate::corpus::Corpus;
use crate::device::{Device, DeviceConfig, StatsSnapshot};
use crate::error::{Error, Result};
use crate::slot::SlotTable;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::json;
use std::sync::Barrier;

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

    // 1. The raw codec.
    let codec = compress::new_codec(&opts.codec, CodecParams::default())?;
    let bound = compress::compress_bound(ps);
    let mut comp = vec![0u8; bound * work.len()];
    let mut lens = vec![0usize; work.len()];
    let mut c_samples = Vec::new();
    let mut d_samples = Vec::new();
    let mut out = vec![0u8; ps];
    for _ in 0..reps {
        let (r, d) = time(|| -> Result<()> {
            for (i, p) in work.iter().enumerate() {
                lens[i] = codec.compress(p, &mut comp[i * bound..(i + 1) * bound])?;
            }
            Ok(())
        });
        r?;
        c_samples.push(mbps(work_bytes, d));
        let (r, d) = time(|| -> Result<()> {
            for (i, len) in lens.iter().enumerate() {
                codec.decompress(&comp[i * bound..i * bound + len], &mut out)?;
            }
            Ok(())
        });
        r?;
        d_samples.push(mbps(work_bytes, d));
    }
    let raw_compress_mbps = median(&c_samples);
    let raw_decompress_mbps = median(&d_samples);
    drop(comp);

    // 2. The store path, 1 and 2 threads, on a fresh device each time.
    let new_dev = |npages: usize| {
        Device::new(DeviceConfig {
            disksize_bytes: (npages * ps) as u64,
            page_size_bytes: ps,
            comp_algorithm: opts.codec.clone(),
            ..Default::default()
        })
    };
    let store = |threads: usize| -> Result<(f64, f64)> {
        let (mut w, mut r) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let dev = new_dev(work.len())?;
            let chunk = work.len().div_ceil(threads);
            let barrier = Barrier::new(threads);
            let run = |read: bool| -> Result<std::time::Duration> {
                let results: Vec<Result<std::time::Duration>> = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..threads)
                        .map(|t| {
                            let (dev, barrier, work) = (&dev, &barrier, &work);
                            s.spawn(move || -> Result<std::time::Duration> {
                                let lo = (t * chunk).min(work.len());
                                let hi = ((t + 1) * chunk).min(work.len());
                                let mut buf = vec![0u8; ps];
                                barrier.wait();
                                let start = std::time::Instant::now();
                                for (i, p) in work.iter().enumerate().take(hi).skip(lo) {
                                    let off = (i * ps) as u64;
                                    if read {
                                        dev.read_at(&mut buf, off)?;
                                    } else {
                                        dev.write_at(p, off)?;
                                    }
                                }
                                Ok(start.elapsed())
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().expect("bench thread"))
                        .collect()
                });
                let mut longest = std::time::Duration::ZERO;
                for d in results {
                    longest = longest.max(d?);
                }
                Ok(longest)
            };
            w.push(mbps(work_bytes, run(false)?));
            r.push(mbps(work_bytes, run(true)?));
            // Untimed: everything reads back identical.
            let mut buf = vec![0u8; ps];
            for (i, p) in work.iter().enumerate() {
                dev.read_at(&mut buf, (i * ps) as u64)?;
                if buf != *p {
                    return Err(Error::io(format!("page {i} read back different")));
                }
            }
        }
        Ok((median(&w), median(&r)))
    };
    let (write_mbps, read_mbps) = store(1)?;
    let (write_mbps_2t, read_mbps_2t) = store(2)?;

    // 3. Packing over every page: fill, discard a random half, compact.
    let dev = new_dev(pages.len())?;
    let (r, fill_time) = time(|| -> Result<()> {
        for (i, p) in pages.iter().enumerate() {
            dev.write_at(p, (i * ps) as u64)?;
        }
        Ok(())
    });
    r?;
    let filled = dev.stats();
    let mut order: Vec<usize> = (0..pages.len()).collect();
    order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(opts.seed));
    let trimmed_pages = &order[..pages.len() / 2];
    for &i in trimmed_pages {
        dev.discard((i * ps) as u64, ps as u64)?;
    }
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
        format!("{} of raw", pct(write_mbps / raw_compress_mbps)),
    ]);
    t.row(vec![
        "store read MB/s (1 thread)".into(),
        f(read_mbps),
        String::new(),
        format!("{} of raw", pct(read_mbps / raw_decompress_mbps)),
    ]);
    t.row(vec![
        "store write MB/s (2 threads)".into(),
        f(write_mbps_2t),
        String::new(),
        format!("{}x 1 thread", f(write_mbps_2t / write_mbps)),
    ]);
    t.row(vec![
        "store read MB/s (2 threads)".into(),
        f(read_mbps_2t),
        String::new(),
        format!("{}x 1 thread", f(read_mbps_2t / read_mbps)),
    ]);
    let fill_mbps = mbps((pages.len() * ps) as u64, fill_time);
    let k = kernel.as_ref().ok();
    t.row(vec![
        "fill MB/s (all pages)".into(),
        f(fill_mbps),
        k.map_or("n/a".into(), |k| f(k.write_mbps)),
        k.map_or(String::new(), |k| f(fill_mbps / k.write_mbps)),
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
        "write_vs_raw": write_mbps / raw_compress_mbps,
        "read_vs_raw": read_mbps / raw_decompress_mbps,
        "fill_mbps": fill_mbps,
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
    let (mut w, mut r) = (Vec::new(), Vec::new());
    let mut buf = AlignedBuf::new(CHUNK_PAGES * PS);
    let mut result = None;
    for rep in 0..reps.max(1) {
        k.store("comp_algorithm", algo)?;
        k.store("disksize", &size.to_string())?;
        let file = k.open_direct()?;
        let (res, d) = time(|| -> Result<()> {
            for (c, chunk) in pages.chunks(CHUNK_PAGES).enumerate() {
                for (i, p) in chunk.iter().enumerate() {
                    buf[i * PS..(i + 1) * PS].copy_from_slice(p);
                }
                KernelZram::write_all_at(
                    &file,
                    &buf[..chunk.len() * PS],
                    (c * CHUNK_PAGES * PS) as u64,
                )?;
            }
            Ok(())
        });
        res?;
        w.push(mbps(size as u64, d));
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
        read_mbps: median(&r),
        filled,
        trimmed,
        compacted,
    })
}
