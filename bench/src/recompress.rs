//! `uzram bench recompress`: what recompression saves on real program memory, and what it
//! costs.
//!
//! 1. **lz4 → zstd**: a device with the primary lz4 and zstd (at `--level`) as recompression
//!    priority 1 is filled with the corpus, every page marked idle and `recompress type=idle`
//!    run: `compr_data_size` and `mem_used_total` (after `compact`) before and after, pages
//!    tried and recompressed, and the recompression's CPU time per page (the calling thread's:
//!    recompression runs on it).
//! 2. **zstd + a dictionary trained from the device**: `--samples` pages read back from that
//!    device train a zstd dictionary of `--dict-size` bytes (libzstd's trainer); a second
//!    device, the same but with the dictionary on priority 1 (`algorithm_params priority=1
//!    dict=PATH`), is filled, marked idle and recompressed the same way. The figure is its
//!    `compr_data_size` against step 1's after recompression, at the same level.
//! 3. **Reads of recompressed pages** against raw decompression of the same pages: the pages
//!    each device holds at priority 1 are read through the device (one page per read) and,
//!    as the anchor in the same repetition, their zstd frames (made by the same codec, with the
//!    same dictionary) decompressed by the bare codec into one buffer.
//!
//! Targets from the issue: step 1 saves ≥ 30% of `compr_data_size`, step 2 a further ≥ 10%,
//! reads ≥ 0.9× the raw decompression. Timings are medians over `--repeats`; sizes do not vary.

use crate::corpus::Corpus;
use crate::{f, mbps, median, time, time_cpu, Table};
use std::path::PathBuf;
use uzram::compress::{self, CodecParams, Dictionary};
use uzram::device::{Device, RecompressSpec, StatsSnapshot};
use uzram::error::{Error, Result};

/// What to run.
#[derive(Debug, Clone)]
pub struct RecompressBenchOptions {
    /// Pages to use (the corpus is cycled); default: the whole corpus.
    pub pages: Option<usize>,
    /// zstd's level for recompression.
    pub level: i32,
    /// Bytes of the trained dictionary.
    pub dict_size_bytes: usize,
    /// Pages sampled to train it (at most the pages stored).
    pub samples: usize,
    /// Timing repetitions.
    pub repeats: usize,
    /// Where the trained dictionary is written (removed afterwards).
    pub dict_path: PathBuf,
}

impl Default for RecompressBenchOptions {
    fn default() -> RecompressBenchOptions {
        RecompressBenchOptions {
            pages: None,
            level: 3,
            dict_size_bytes: 110 << 10,
            samples: 4096,
            repeats: 3,
            dict_path: std::env::temp_dir().join(format!(
                "uzram-bench-recompress-{}.dict",
                std::process::id()
            )),
        }
    }
}

/// One device's run: sizes before and after, and the recompression's work.
#[derive(Debug, Clone, Default)]
struct Stage {
    before: StatsSnapshot,
    after: StatsSnapshot,
    mem_before_compact: u64,
    mem_after_compact: u64,
    tried: u64,
    recompressed: u64,
    cpu_us_per_tried: Vec<f64>,
    cpu_us_per_recompressed: Vec<f64>,
    read_mbps: Vec<f64>,
    raw_mbps: Vec<f64>,
    read_vs_raw: Vec<f64>,
}

/// A device with lz4 as primary and zstd at `level` (with `dict`) as priority 1, filled with
/// `pages`.
fn filled_device(
    pages: &[&[u8]],
    ps: usize,
    level: i32,
    dict: Option<&std::path::Path>,
) -> Result<Device> {
    let dev = Device::new_uninit(ps)?;
    dev.attr_store("comp_algorithm", "lz4")?;
    dev.attr_store("recomp_algorithm", "algo=zstd priority=1")?;
    let mut params = format!("priority=1 level={level}");
    if let Some(d) = dict {
        params.push_str(&format!(" dict={}", d.display()));
    }
    dev.attr_store("algorithm_params", &params)?;
    dev.attr_store("disksize", &(pages.len() * ps).to_string())?;
    for (i, p) in pages.iter().enumerate() {
        dev.write_at(p, (i * ps) as u64)?;
    }
    Ok(dev)
}

/// Compacts and returns `mem_used_total`.
fn compacted_mem(dev: &Device) -> u64 {
    dev.compact();
    dev.stats().mem_used_total_bytes
}

/// One repetition of a stage: fill, mark idle, recompress (timed), then the read comparison.
fn run_stage(
    stage: &mut Stage,
    pages: &[&[u8]],
    ps: usize,
    level: i32,
    dict: Option<(&std::path::Path, &Dictionary)>,
    first: bool,
) -> Result<Device> {
    let dev = filled_device(pages, ps, level, dict.map(|d| d.0))?;
    if first {
        stage.before = dev.stats();
        stage.mem_before_compact = compacted_mem(&dev);
    }
    dev.attr_store("idle", "all")?;
    let spec = RecompressSpec::parse("type=idle")?;
    let (report, _, cpu) = time_cpu(|| dev.recompress(&spec));
    let report = report?;
    if report.recompressed == 0 {
        return Err(Error::invalid(
            "recompression shrank no page: is the corpus all same-filled or incompressible?",
        ));
    }
    let cpu_us = cpu.as_secs_f64() * 1e6;
    stage.cpu_us_per_tried.push(cpu_us / report.tried as f64);
    stage
        .cpu_us_per_recompressed
        .push(cpu_us / report.recompressed as f64);
    if first {
        stage.after = dev.stats();
        stage.mem_after_compact = compacted_mem(&dev);
        stage.tried = report.tried;
        stage.recompressed = report.recompressed;
    }
    verify(&dev, pages)?;

    // Reads of the pages now at priority 1, against the bare codec on their frames.
    let recompressed: Vec<usize> = (0..pages.len())
        .filter(|&i| dev.debug_slot_priority(i as u64) == Some(1))
        .collect();
    let codec = compress::new_codec(
        "zstd",
        CodecParams {
            level: Some(level),
            dict: dict.map(|d| d.1.clone()),
        },
    )?;
    let bound = compress::compress_bound(ps);
    let mut frames = vec![0u8; bound * recompressed.len()];
    let mut lens = Vec::with_capacity(recompressed.len());
    for (k, &i) in recompressed.iter().enumerate() {
        lens.push(codec.compress(pages[i], &mut frames[k * bound..(k + 1) * bound])?);
    }
    let bytes = (recompressed.len() * ps) as u64;
    let mut out = vec![0u8; ps];
    let (r, raw) = time(|| -> Result<()> {
        for (k, len) in lens.iter().enumerate() {
            codec.decompress(&frames[k * bound..k * bound + len], &mut out)?;
        }
        Ok(())
    });
    r?;
    let (r, read) = time(|| -> Result<()> {
        for &i in &recompressed {
            dev.read_at(&mut out, (i * ps) as u64)?;
        }
        Ok(())
    });
    r?;
    let (raw, read) = (mbps(bytes, raw), mbps(bytes, read));
    stage.raw_mbps.push(raw);
    stage.read_mbps.push(read);
    stage.read_vs_raw.push(read / raw);
    Ok(dev)
}

/// Every page reads back as written.
fn verify(dev: &Device, pages: &[&[u8]]) -> Result<()> {
    let ps = dev.page_size_bytes();
    let mut out = vec![0u8; ps];
    for (i, p) in pages.iter().enumerate() {
        dev.read_at(&mut out, (i * ps) as u64)?;
        if out != *p {
            return Err(Error::io(format!("page {i} read back wrong")));
        }
    }
    Ok(())
}

/// Trains a zstd dictionary of `size` bytes from up to `samples` pages read back from `dev`
/// (evenly spread; same-filled pages skipped: they teach nothing).
fn train(dev: &Device, npages: usize, samples: usize, size: usize) -> Result<Vec<u8>> {
    let ps = dev.page_size_bytes();
    let stride = (npages / samples.max(1)).max(1);
    let mut data = Vec::new();
    let mut sizes = Vec::new();
    let mut out = vec![0u8; ps];
    for i in (0..npages).step_by(stride).take(samples) {
        dev.read_at(&mut out, (i * ps) as u64)?;
        if compress::same_filled_word(&out).is_none() {
            data.extend_from_slice(&out);
            sizes.push(ps);
        }
    }
    zstd::dict::from_continuous(&data, &sizes, size)
        .map_err(|e| Error::invalid(format!("training a dictionary: {e}")))
}

/// Runs the benchmark, prints its table, and returns the JSON document.
pub fn run(corpus: &Corpus, opts: &RecompressBenchOptions) -> Result<serde_json::Value> {
    let ps = corpus.page_size_bytes();
    let n = opts.pages.unwrap_or(corpus.len());
    if corpus.is_empty() || n == 0 {
        return Err(Error::invalid("the corpus has no pages"));
    }
    let pages: Vec<&[u8]> = (0..n).map(|i| corpus.page(i % corpus.len())).collect();
    let reps = opts.repeats.max(1);

    let mut zstd = Stage::default();
    let mut dict = Stage::default();
    let mut dict_bytes = 0;
    let mut train_secs = Vec::new();
    for rep in 0..reps {
        let dev = run_stage(&mut zstd, &pages, ps, opts.level, None, rep == 0)?;
        let (trained, d) = time(|| train(&dev, n, opts.samples, opts.dict_size_bytes));
        let trained = trained?;
        train_secs.push(d.as_secs_f64());
        drop(dev);
        dict_bytes = trained.len();
        std::fs::write(&opts.dict_path, &trained)?;
        let dictionary = Dictionary::from_bytes(trained)?;
        let r = run_stage(
            &mut dict,
            &pages,
            ps,
            opts.level,
            Some((&opts.dict_path, &dictionary)),
            rep == 0,
        );
        let _ = std::fs::remove_file(&opts.dict_path);
        drop(r?);
    }

    let lz4_compr = zstd.before.compr_data_size_bytes as f64;
    let zstd_compr = zstd.after.compr_data_size_bytes as f64;
    let dict_compr = dict.after.compr_data_size_bytes as f64;
    let zstd_saving = 1.0 - zstd_compr / lz4_compr;
    let dict_saving = 1.0 - dict_compr / zstd_compr;

    let mut t = Table::new(&[
        "stage",
        "compr_data_size",
        "mem_used_total",
        "saved vs previous",
        "pages tried",
        "recompressed",
        "CPU µs/recompressed page",
        "read MB/s",
        "raw zstd MB/s",
        "read / raw",
    ])
    .left_align(&[0]);
    t.row(vec![
        "lz4 (filled)".into(),
        zstd.before.compr_data_size_bytes.to_string(),
        zstd.mem_before_compact.to_string(),
        "".into(),
        "".into(),
        "".into(),
        "".into(),
        "".into(),
        "".into(),
        "".into(),
    ]);
    for (name, s, saving) in [
        (format!("zstd level {}", opts.level), &zstd, zstd_saving),
        (
            format!("zstd level {} + {dict_bytes} B dictionary", opts.level),
            &dict,
            dict_saving,
        ),
    ] {
        t.row(vec![
            name,
            s.after.compr_data_size_bytes.to_string(),
            s.mem_after_compact.to_string(),
            format!("{:.1}%", saving * 100.0),
            s.tried.to_string(),
            s.recompressed.to_string(),
            f(median(&s.cpu_us_per_recompressed)),
            f(median(&s.read_mbps)),
            f(median(&s.raw_mbps)),
            format!("{:.2}", median(&s.read_vs_raw)),
        ]);
    }
    println!(
        "uzram bench recompress: {n} pages of {ps} bytes ({} same-filled), {reps} repetitions \
         (medians)\n{}",
        zstd.before.same_pages,
        t.render()
    );
    println!(
        "targets: lz4 -> zstd saves {:.1}% of compr_data_size (>= 30%), the dictionary a \
         further {:.1}% (>= 10%), reads of recompressed pages {:.2}x / {:.2}x raw zstd \
         decompression (>= 0.9)",
        zstd_saving * 100.0,
        dict_saving * 100.0,
        median(&zstd.read_vs_raw),
        median(&dict.read_vs_raw)
    );
    let stage_json = |s: &Stage| {
        serde_json::json!({
            "compr_data_size": s.after.compr_data_size_bytes,
            "mem_used_total": s.mem_after_compact,
            "pages_tried": s.tried,
            "pages_recompressed": s.recompressed,
            "cpu_us_per_tried_page": median(&s.cpu_us_per_tried),
            "cpu_us_per_recompressed_page": median(&s.cpu_us_per_recompressed),
            "read_mbps": median(&s.read_mbps),
            "raw_decompress_mbps": median(&s.raw_mbps),
            "read_vs_raw": median(&s.read_vs_raw),
        })
    };
    Ok(serde_json::json!({
        "bench": "recompress",
        "pages": n,
        "page_size": ps,
        "same_pages": zstd.before.same_pages,
        "repeats": reps,
        "level": opts.level,
        "dict_size": dict_bytes,
        "dict_samples": opts.samples,
        "dict_train_secs": median(&train_secs),
        "lz4": {
            "compr_data_size": zstd.before.compr_data_size_bytes,
            "mem_used_total": zstd.mem_before_compact,
        },
        "zstd": stage_json(&zstd),
        "zstd_dict": stage_json(&dict),
        "zstd_vs_lz4_saving": zstd_saving,
        "dict_vs_zstd_saving": dict_saving,
        "read_vs_raw": median(&zstd.read_vs_raw),
        "dict_read_vs_raw": median(&dict.read_vs_raw),
        "cpu_us_per_recompressed_page": median(&zstd.cpu_us_per_recompressed),
    }))
}
