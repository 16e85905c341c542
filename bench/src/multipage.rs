//! `uzram bench multipage`: multi-page objects (`multi_page_size`) against 4 KiB
//! granularity and the kernel's zram, on real pages.
//!
//! The corpus must have 64 KiB pages (`uzram corpus --page-size 65536`): each is 64 KiB of a
//! program's contiguous memory, so groups of 16/32/64 KiB are what a swap-out of neighbouring
//! pages would hand over. For each codec and each `multi_page_size` (4096 is off: the anchor),
//! every repetition makes a fresh 4 KiB-page device, writes the whole corpus in 64 KiB requests
//! (one thread), then reads it back 4 KiB at a time in order (neighbours: the per-thread cache
//! of the last decompressed group serves them) and in a random order (each read decompresses a
//! whole group), then overwrites every page once, 4 KiB at a time in a random order (each write
//! breaks its page out of its group; `mem_used_max` says how far the pool grew meanwhile).
//! Rates are of the thread's CPU time (steady under other load; wall clock beside),
//! medians of the repetitions; sizes are from `mm_stat` after the first fill, and every page is
//! checked once. As root with `/sys/block/zram0`, the same bytes go through the kernel's zram
//! with the same codec (O_DIRECT, 128 KiB writes), which is reset afterwards.

use crate::corpus::Corpus;
use crate::kernel_zram::{AlignedBuf, KernelZram};
use crate::{f, mbps, median, time, time_cpu, Table};
use serde_json::json;
use uzram::device::Device;
use uzram::error::{Error, Result};

/// The device's page size: multi-page objects are a 4 KiB device's.
const PAGE: usize = 4096;
/// Bytes per write request: a whole corpus page.
const WRITE_BYTES: usize = 65536;

/// Options of the benchmark.
#[derive(Debug, Clone)]
pub struct MultipageBenchOptions {
    /// Codecs, for uzram and the kernel alike.
    pub codecs: Vec<String>,
    /// `multi_page_size` values (4096: off, the anchor).
    pub sizes: Vec<usize>,
    /// Timing repetitions; the median is reported.
    pub repeats: usize,
    /// Skip the kernel zram anchor.
    pub no_kernel: bool,
}

/// One configuration's figures.
#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    codec: String,
    multi_page_size: usize,
    compr_data_size_bytes: u64,
    mem_used_total_bytes: u64,
    multi_objects: u64,
    multi_pages: u64,
    huge_pages: u64,
    same_pages: u64,
    write_mbps_cpu: f64,
    write_mbps_wall: f64,
    seq_read_mbps_cpu: f64,
    rand_read_mbps_cpu: f64,
    /// 4 KiB overwrites of every page once, in a random order, of the full device: each breaks
    /// its page out of its group (the 4 KiB write into a group).
    rand_write_mbps_cpu: f64,
    /// `mem_used_max` after the overwrite pass, against `mem_used_total` before it: how far the
    /// pool grew while groups kept their objects for the pages not yet overwritten.
    rand_write_mem_used_max_bytes: u64,
    /// Share of the 4 KiB reads of a multi-page object the thread's group cache served, in the
    /// ordered and the random pass (the last repetition; 0 without multi-page objects).
    seq_cache_hit_rate: f64,
    rand_cache_hit_rate: f64,
}

/// A fresh device holding the corpus' bytes.
fn device(codec: &str, multi_page_size: usize, size_bytes: usize) -> Result<Device> {
    let dev = Device::new_uninit(PAGE)?;
    dev.attr_store("comp_algorithm", codec)?;
    dev.attr_store("multi_page_size", &multi_page_size.to_string())?;
    dev.attr_store("disksize", &size_bytes.to_string())?;
    Ok(dev)
}

fn run_one(data: &[u8], codec: &str, mps: usize, repeats: usize) -> Result<Row> {
    let pages = data.len() / PAGE;
    // A fixed random order of the pages (xorshift Fisher–Yates), the same for every run.
    let mut order: Vec<usize> = (0..pages).collect();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..pages).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let (mut w_cpu, mut w_wall, mut sr, mut rr, mut rw) = (vec![], vec![], vec![], vec![], vec![]);
    let mut rw_max = 0;
    let mut stats = None;
    let mut buf = vec![0u8; PAGE];
    let (mut seq_hits, mut rand_hits) = (0.0, 0.0);
    // Hits over all grouped reads between two stats snapshots.
    let hit_rate = |a: &uzram::store::StatsSnapshot, b: &uzram::store::StatsSnapshot| {
        let hits = b.group_cache_hits - a.group_cache_hits;
        let all = hits + b.group_cache_misses - a.group_cache_misses;
        if all == 0 {
            0.0
        } else {
            hits as f64 / all as f64
        }
    };
    for rep in 0..repeats.max(1) {
        let dev = device(codec, mps, data.len())?;
        let (r, wall, cpu) = time_cpu(|| -> Result<()> {
            for (i, chunk) in data.chunks(WRITE_BYTES).enumerate() {
                dev.write_at(chunk, (i * WRITE_BYTES) as u64)?;
            }
            Ok(())
        });
        r?;
        w_cpu.push(mbps(data.len() as u64, cpu));
        w_wall.push(mbps(data.len() as u64, wall));
        if rep == 0 {
            stats = Some(dev.stats());
            for (i, want) in data.chunks(PAGE).enumerate() {
                dev.read_at(&mut buf, (i * PAGE) as u64)?;
                if buf != want {
                    return Err(Error::io(format!(
                        "{codec} multi_page_size {mps}: page {i} reads back wrong"
                    )));
                }
            }
        }
        let s0 = dev.stats();
        let (r, _, cpu) = time_cpu(|| -> Result<()> {
            for i in 0..pages {
                dev.read_at(&mut buf, (i * PAGE) as u64)?;
            }
            Ok(())
        });
        r?;
        sr.push(mbps(data.len() as u64, cpu));
        let s1 = dev.stats();
        let (r, _, cpu) = time_cpu(|| -> Result<()> {
            for &i in &order {
                dev.read_at(&mut buf, (i * PAGE) as u64)?;
            }
            Ok(())
        });
        r?;
        rr.push(mbps(data.len() as u64, cpu));
        seq_hits = hit_rate(&s0, &s1);
        rand_hits = hit_rate(&s1, &dev.stats());
        // Page order[j] gets page j's bytes (another real page, mostly of another group).
        dev.attr_store("mem_used_max", "0")?;
        let (r, _, cpu) = time_cpu(|| -> Result<()> {
            for (j, &i) in order.iter().enumerate() {
                dev.write_at(&data[j * PAGE..(j + 1) * PAGE], (i * PAGE) as u64)?;
            }
            Ok(())
        });
        r?;
        rw.push(mbps(data.len() as u64, cpu));
        rw_max = dev.stats().mem_used_max_bytes;
        if rep == 0 {
            for (j, &i) in order.iter().enumerate() {
                dev.read_at(&mut buf, (i * PAGE) as u64)?;
                if buf[..] != data[j * PAGE..(j + 1) * PAGE] {
                    return Err(Error::io(format!(
                        "{codec} multi_page_size {mps}: page {i} reads back wrong after the \
                         4 KiB overwrites"
                    )));
                }
            }
        }
    }
    let s = stats.expect("at least one repetition");
    Ok(Row {
        codec: codec.to_string(),
        multi_page_size: mps,
        compr_data_size_bytes: s.compr_data_size_bytes,
        mem_used_total_bytes: s.mem_used_total_bytes,
        multi_objects: s.multi_objects,
        multi_pages: s.multi_pages,
        huge_pages: s.huge_pages,
        same_pages: s.same_pages,
        write_mbps_cpu: median(&w_cpu),
        write_mbps_wall: median(&w_wall),
        seq_read_mbps_cpu: median(&sr),
        rand_read_mbps_cpu: median(&rr),
        rand_write_mbps_cpu: median(&rw),
        rand_write_mem_used_max_bytes: rw_max,
        seq_cache_hit_rate: seq_hits,
        rand_cache_hit_rate: rand_hits,
    })
}

/// The kernel's zram with `codec` on the same bytes: `(compr_data_size, mem_used_total, write
/// MB/s by wall clock)`.
fn kernel_one(k: &KernelZram, data: &[u8], codec: &str) -> Result<(u64, u64, f64)> {
    const CHUNK: usize = 128 << 10;
    k.store("comp_algorithm", codec)?;
    k.store("disksize", &data.len().to_string())?;
    let result = (|| {
        let file = k.open_direct()?;
        let mut buf = AlignedBuf::new(CHUNK);
        let (r, d) = time(|| -> Result<()> {
            for (i, chunk) in data.chunks(CHUNK).enumerate() {
                buf[..chunk.len()].copy_from_slice(chunk);
                KernelZram::write_all_at(&file, &buf[..chunk.len()], (i * CHUNK) as u64)?;
            }
            Ok(())
        });
        r?;
        let mm = k.mm_stat()?;
        Ok((mm[1], mm[2], mbps(data.len() as u64, d)))
    })();
    k.store("reset", "1")?;
    result
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / f64::from(1 << 20))
}

fn pct(v: u64, anchor: u64) -> String {
    format!("{:+.1}%", (v as f64 / anchor as f64 - 1.0) * 100.0)
}

/// Runs the benchmark on `corpus` (64 KiB pages), prints the table and returns the JSON.
pub fn run(corpus: &Corpus, opts: &MultipageBenchOptions) -> Result<serde_json::Value> {
    if corpus.page_size_bytes() != WRITE_BYTES {
        return Err(Error::invalid(format!(
            "bench multipage needs a corpus of 64 KiB pages (uzram corpus --page-size 65536), \
             not {}-byte pages",
            corpus.page_size_bytes()
        )));
    }
    let data = corpus.pages_bytes();
    let kernel = if opts.no_kernel {
        None
    } else {
        KernelZram::open()
    };
    let kernel_note = match (&kernel, opts.no_kernel) {
        (_, true) => "skipped (--no-kernel)".to_string(),
        (None, false) => KernelZram::unavailable_reason(),
        (Some(_), false) => "zram0".to_string(),
    };
    println!(
        "{} MiB of real pages ({} pages of 64 KiB), 4 KiB device pages, 64 KiB writes, median \
         of {} groups, rates of the thread's CPU time",
        data.len() >> 20,
        corpus.len(),
        opts.repeats
    );
    let mut table = Table::new(&[
        "codec",
        "multi_page_size",
        "compr MiB",
        "vs 4K",
        "mem_used MiB",
        "vs 4K",
        "write MB/s",
        "x 4K",
        "seq read MB/s",
        "rand read MB/s",
        "rand 4K write MB/s",
        "x 4K",
        "max mem MiB",
        "cache hits seq/rand",
        "objects",
    ])
    .left_align(&[1]);
    let mut rows = Vec::new();
    let mut kernels = Vec::new();
    for codec in &opts.codecs {
        let mut anchor: Option<Row> = None;
        for &mps in &opts.sizes {
            let row = run_one(data, codec, mps, opts.repeats)?;
            let a = anchor.get_or_insert_with(|| row.clone()).clone();
            table.row(vec![
                codec.clone(),
                if mps == PAGE {
                    "4096 (off)".into()
                } else {
                    mps.to_string()
                },
                mib(row.compr_data_size_bytes),
                pct(row.compr_data_size_bytes, a.compr_data_size_bytes),
                mib(row.mem_used_total_bytes),
                pct(row.mem_used_total_bytes, a.mem_used_total_bytes),
                f(row.write_mbps_cpu),
                f(row.write_mbps_cpu / a.write_mbps_cpu),
                f(row.seq_read_mbps_cpu),
                f(row.rand_read_mbps_cpu),
                f(row.rand_write_mbps_cpu),
                f(row.rand_write_mbps_cpu / a.rand_write_mbps_cpu),
                mib(row.rand_write_mem_used_max_bytes),
                format!(
                    "{:.0}%/{:.1}%",
                    100.0 * row.seq_cache_hit_rate,
                    100.0 * row.rand_cache_hit_rate
                ),
                row.multi_objects.to_string(),
            ]);
            rows.push(row);
        }
        if let Some(k) = &kernel {
            if k.has_algorithm(codec) {
                let (compr, used, w) = kernel_one(k, data, codec)?;
                let a = anchor.as_ref().expect("at least one size");
                table.row(vec![
                    codec.clone(),
                    "kernel zram".into(),
                    mib(compr),
                    pct(compr, a.compr_data_size_bytes),
                    mib(used),
                    pct(used, a.mem_used_total_bytes),
                    format!("{} (wall)", f(w)),
                    String::new(),
                    String::new(),
                    String::new(),
                    String::new(),
                    String::new(),
                    String::new(),
                    String::new(),
                    String::new(),
                ]);
                kernels.push(json!({"codec": codec, "compr_data_size_bytes": compr,
                    "mem_used_total_bytes": used, "write_mbps_wall": w}));
            }
        }
    }
    print!("{}", table.render());
    println!("kernel zram anchor: {kernel_note}");
    Ok(json!({
        "benchmark": "multipage",
        "corpus_pages_64k": corpus.len(),
        "bytes": data.len(),
        "repeats": opts.repeats,
        "rows": rows,
        "kernel": kernels,
        "kernel_note": kernel_note,
    }))
}
