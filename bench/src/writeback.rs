//! `uzram bench writeback`: batched writeback against the one-page path and the device's own
//! ceiling, on real program memory.
//!
//! The backing file is created once and written through (zeroes, 1 MiB at a time) before any
//! measurement, so that every measured write is an overwrite of allocated blocks, as on the
//! block device zram normally writes back to. (Writes into a sparse ext4 file allocate blocks
//! and journal metadata; truncating or removing a large written file took seconds on a
//! contended disk. Both made runs incomparable.)
//!
//! For each layout and batch size, on a fresh device: fill the device from the corpus (cycled to `pages`), mark every page idle, and time
//! `writeback idle`. Batch size 1 runs on the synchronous engine (one `pwritev` at a time:
//! zram's writeback before batching); larger batches on io_uring. `fragmented` first reserves
//! every other backing block (the worst case of a long-lived bitmap with holes), so no two
//! written blocks are adjacent. In the same run, the ceiling of the same file with the same engine:
//! 4 KiB sequential and random writes at queue depths 1 and 32 (`backing::ceiling`, fio's
//! `rw=write|randwrite bs=4k`), plus the synchronous engine at depth 1. Each figure is the
//! median of `repeats` runs. Same-filled pages are never written back, so pages/s counts the
//! pages actually written.
//!
//! A sample of pages (every 61st) is read back after each run and compared with the corpus.
//!
//! With `--checksum-cost`, [`run_checksum_cost`] instead measures what verifying written-back
//! pages costs: the same writeback and a full read-back with and without block checksums.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use crate::corpus::Corpus;
use crate::{f, median, Table};
use uzram::backing::ceiling::{self, Pattern};
use uzram::backing::{Backing, Engine, FileBacking, FileOptions, MemBacking};
use uzram::device::{Device, IdleCutoff};
use uzram::error::{Error, Result};
use uzram::writeback::{BackingLayout, WritebackMode, WritebackProgress, WritebackSpec};
use uzram::zoned::DEFAULT_ZONE_SIZE_BYTES;

/// How the backing device's free blocks are laid out when the writeback starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// A fresh bitmap: blocks 0, 1, 2, ... (sequential I/O, adjacent blocks merge).
    Sequential,
    /// Every other block taken: blocks 1, 3, 5, ... (no two adjacent).
    Fragmented,
}

impl Layout {
    /// The name used on the command line and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Sequential => "sequential",
            Layout::Fragmented => "fragmented",
        }
    }
    /// Parses `sequential` or `fragmented`.
    pub fn parse(s: &str) -> Result<Layout> {
        match s {
            "sequential" => Ok(Layout::Sequential),
            "fragmented" => Ok(Layout::Fragmented),
            _ => Err(Error::invalid(format!(
                "layout {s:?}: sequential or fragmented"
            ))),
        }
    }
    /// The ceiling pattern it is compared with.
    fn pattern(self) -> Pattern {
        match self {
            Layout::Sequential => Pattern::Sequential,
            Layout::Fragmented => Pattern::Random,
        }
    }
}

/// Where writeback puts pages (`--store`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// The bitmap (one block per page), on each `--layout`.
    Bitmap,
    /// The zoned store (`backing_layout=zoned`): records appended in 256 KiB sequential
    /// stages. The free-block layout does not apply (the log only appends), so it runs once per
    /// batch size, on the same backing file; its rows are labelled `zoned`.
    Zoned,
}

impl Store {
    /// `bitmap` or `zoned`.
    pub fn name(self) -> &'static str {
        match self {
            Store::Bitmap => "bitmap",
            Store::Zoned => "zoned",
        }
    }
    /// Parses `bitmap` or `zoned`.
    pub fn parse(s: &str) -> Result<Store> {
        match s {
            "bitmap" => Ok(Store::Bitmap),
            "zoned" => Ok(Store::Zoned),
            _ => Err(Error::invalid(format!("store {s:?}: bitmap or zoned"))),
        }
    }
}

/// Options of `uzram bench writeback`.
#[derive(Debug, Clone)]
pub struct WritebackBenchOptions {
    /// The backing file (created, or truncated and resized, for every run) or block device.
    pub backing: PathBuf,
    /// Pages in the device (the corpus is cycled).
    pub pages: usize,
    /// Layouts to run.
    pub layouts: Vec<Layout>,
    /// Batch sizes to run (1 runs on the synchronous engine).
    pub batch_sizes: Vec<usize>,
    /// Repetitions (medians are reported).
    pub repeats: usize,
    /// Show a progress bar (on a terminal, for runs longer than a second).
    pub progress: bool,
    /// Stores to run (default both).
    pub stores: Vec<Store>,
    /// Zone size for the zoned store (None: 256 MiB, or a quarter of the backing file rounded
    /// down to 1 MiB if that is smaller, so small runs still have several zones).
    pub zone_size_bytes: Option<u64>,
}

impl Default for WritebackBenchOptions {
    fn default() -> Self {
        WritebackBenchOptions {
            backing: PathBuf::from("/var/tmp/uzram-writeback-bench.img"),
            pages: 100_000,
            layouts: vec![Layout::Sequential, Layout::Fragmented],
            batch_sizes: vec![1, 2, 4, 8, 16, 32, 64, 128],
            repeats: 3,
            progress: true,
            stores: vec![Store::Bitmap, Store::Zoned],
            zone_size_bytes: None,
        }
    }
}

/// The engine a batch size runs on.
pub(crate) fn engine_for(batch: usize) -> Engine {
    if batch == 1 {
        Engine::Sync
    } else {
        Engine::Uring
    }
}

fn is_block_device(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
        .unwrap_or(false)
}

/// Creates the backing file at `size_bytes` and writes it through with zeroes (see the module
/// docs). A block device is used as it is.
pub(crate) fn prepare_backing(path: &Path, size_bytes: u64) -> Result<()> {
    if is_block_device(path) {
        return Ok(());
    }
    let b = FileBacking::create(path, size_bytes, &FileOptions::with_engine(Engine::Sync))?;
    let chunk = uzram::backing::AlignedBuf::new_zeroed(1 << 20)?;
    let mut off = 0;
    while off < b.size_bytes() {
        let n = (b.size_bytes() - off).min(chunk.len() as u64) as usize;
        b.write_at(&chunk[..n], off)?;
        off += n as u64;
    }
    b.flush()
}

/// Opens the prepared backing with `engine`.
pub(crate) fn open_backing(path: &Path, engine: Engine) -> Result<FileBacking> {
    FileBacking::open(path, &FileOptions::with_engine(engine))
}

/// One timed writeback.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub(crate) pages_per_s: f64,
    pub(crate) written: u64,
    pub(crate) ops: u64,
}

/// A progress bar on stderr, drawn only on a terminal and only once a run passed a second.
struct Bar {
    enabled: bool,
    label: String,
    start: Instant,
    last: Option<Instant>,
}

impl Bar {
    fn new(enabled: bool, label: String) -> Bar {
        Bar {
            enabled: enabled && std::io::stderr().is_terminal(),
            label,
            start: Instant::now(),
            last: None,
        }
    }
    fn update(&mut self, p: &WritebackProgress) {
        if !self.enabled || self.start.elapsed().as_secs_f64() < 1.0 {
            return;
        }
        if self.last.is_some_and(|t| t.elapsed().as_millis() < 200) {
            return;
        }
        self.last = Some(Instant::now());
        let done = p.written + p.failed + p.changed;
        let frac = if p.candidates == 0 {
            1.0
        } else {
            done as f64 / p.candidates as f64
        };
        let width = 30;
        let filled = ((frac * width as f64) as usize).min(width);
        eprint!(
            "\r  {} [{}{}] {:3.0}% {}/{}",
            self.label,
            "#".repeat(filled),
            " ".repeat(width - filled),
            frac * 100.0,
            done,
            p.candidates
        );
        let _ = std::io::stderr().flush();
    }
    fn finish(&self) {
        if self.last.is_some() {
            eprintln!();
        }
    }
}

/// The zone size a run of the zoned store uses (see [`WritebackBenchOptions::zone_size_bytes`]).
fn zone_size_for(opts: &WritebackBenchOptions, backing_bytes: u64) -> u64 {
    opts.zone_size_bytes.unwrap_or_else(|| {
        (backing_bytes / 4 / (1 << 20) * (1 << 20)).clamp(1 << 20, DEFAULT_ZONE_SIZE_BYTES)
    })
}

/// Where one run writes back: the bitmap on a layout, or the zoned store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    Bitmap(Layout),
    Zoned,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Bitmap(l) => l.name(),
            Target::Zoned => "zoned",
        }
    }
    /// The ceiling pattern it is compared with.
    fn pattern(self) -> Pattern {
        match self {
            Target::Bitmap(l) => l.pattern(),
            Target::Zoned => Pattern::Sequential,
        }
    }
}

fn run_one(
    corpus: &Corpus,
    opts: &WritebackBenchOptions,
    target: Target,
    batch: usize,
    io_mode: &mut String,
) -> Result<Sample> {
    let backing = open_backing(&opts.backing, engine_for(batch))?;
    *io_mode = backing.io_mode().to_string();
    let zone_size_bytes = zone_size_for(opts, backing.size_bytes());
    timed_writeback(
        corpus,
        opts.pages,
        opts.progress,
        Arc::new(backing),
        target,
        batch,
        zone_size_bytes,
    )
}

/// On a fresh device over `backing`: fills `n` pages from the corpus, marks them idle, times
/// `writeback idle` at `batch`, and checks a sample reads back identical.
pub(crate) fn timed_writeback(
    corpus: &Corpus,
    n: usize,
    progress: bool,
    backing: Arc<dyn Backing>,
    target: Target,
    batch: usize,
    zone_size_bytes: u64,
) -> Result<Sample> {
    let ps = corpus.page_size_bytes();
    let blocks = backing.size_bytes() / ps as u64;
    let dev = Device::new_uninit(ps)?;
    dev.set_backing(backing)?;
    if target == Target::Zoned {
        dev.set_backing_layout(BackingLayout::Zoned)?;
        dev.set_zone_size_bytes(zone_size_bytes)?;
    }
    dev.set_writeback_batch_size(u32::try_from(batch).map_err(|_| Error::invalid("batch"))?)?;
    dev.init((n * ps) as u64)?;
    for i in 0..n {
        dev.write_at(corpus.page(i % corpus.len()), (i * ps) as u64)?;
    }
    dev.mark_idle(IdleCutoff::All);
    if target == Target::Bitmap(Layout::Fragmented) {
        let need = 2 * n as u64;
        if blocks < need {
            return Err(Error::invalid(format!(
                "the backing holds {blocks} blocks; the fragmented layout needs {need}"
            )));
        }
        dev.debug_reserve_backing_blocks((0..need).step_by(2))?;
    }
    let mut bar = Bar::new(progress, format!("{} batch {batch:>3}", target.name()));
    let start = Instant::now();
    let report = dev
        .writeback_with_progress(&WritebackSpec::mode(WritebackMode::Idle), &mut |p| {
            bar.update(p)
        })?;
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    bar.finish();
    if let Some(e) = report.error {
        return Err(e);
    }
    if report.written != report.candidates {
        return Err(Error::io(format!(
            "wrote back {} of {} candidates",
            report.written, report.candidates
        )));
    }
    // Untimed: a sample reads back identical.
    let mut buf = vec![0u8; ps];
    for i in (0..n).step_by(61) {
        dev.read_at(&mut buf, (i * ps) as u64)?;
        if buf != corpus.page(i % corpus.len()) {
            return Err(Error::io(format!("page {i} read back different")));
        }
    }
    Ok(Sample {
        pages_per_s: report.written as f64 / secs,
        written: report.written,
        ops: report.ops,
    })
}

/// Runs the benchmark, prints its tables, and returns the JSON document.
pub fn run(corpus: &Corpus, opts: &WritebackBenchOptions) -> Result<Value> {
    let ps = corpus.page_size_bytes();
    if corpus.is_empty() || opts.pages == 0 {
        return Err(Error::invalid("no pages to write back"));
    }
    if opts.batch_sizes.is_empty() || opts.batch_sizes.contains(&0) {
        return Err(Error::invalid("batch sizes must be at least 1"));
    }
    if opts.stores.is_empty() {
        return Err(Error::invalid("no store to run"));
    }
    let mut targets: Vec<Target> = Vec::new();
    if opts.stores.contains(&Store::Bitmap) {
        targets.extend(opts.layouts.iter().map(|&l| Target::Bitmap(l)));
    }
    if opts.stores.contains(&Store::Zoned) {
        targets.push(Target::Zoned);
    }
    let reps = opts.repeats.max(1);
    let mut io_mode = String::new();
    // (layout, batch) -> samples
    let mut samples: BTreeMap<(&'static str, usize), Vec<Sample>> = BTreeMap::new();
    // (engine, pattern, depth) -> pages/s samples
    let mut ceilings: BTreeMap<(&'static str, &'static str, usize), Vec<f64>> = BTreeMap::new();
    let ceiling_blocks = opts.pages as u64;
    // Room for the fragmented layout (every other block taken) plus slack.
    let mut backing_bytes = (2 * opts.pages as u64 + 64) * ps as u64;
    if opts.stores.contains(&Store::Zoned) {
        // The zoned store needs at least 3 zones (of at least 1 MiB): 4 for small runs.
        backing_bytes = backing_bytes.max(4 << 20);
    }
    let prep = Instant::now();
    prepare_backing(&opts.backing, backing_bytes)?;
    eprintln!(
        "  backing {} prepared ({} MiB written through) in {:.1} s",
        opts.backing.display(),
        backing_bytes >> 20,
        prep.elapsed().as_secs_f64()
    );
    for rep in 0..reps {
        for &target in &targets {
            for &batch in &opts.batch_sizes {
                let s = run_one(corpus, opts, target, batch, &mut io_mode)?;
                eprintln!(
                    "  run {}/{reps}: {:10} batch {batch:>3} ({}): {:>9} pages/s, {} pages in {} writes",
                    rep + 1,
                    target.name(),
                    engine_for(batch).name(),
                    f(s.pages_per_s),
                    s.written,
                    s.ops
                );
                samples.entry((target.name(), batch)).or_default().push(s);
            }
        }
        // The ceiling of the same file, in the same state the writeback runs found it.
        for (engine, depths) in [(Engine::Uring, &[1usize, 32][..]), (Engine::Sync, &[1][..])] {
            for pattern in [Pattern::Sequential, Pattern::Random] {
                for &depth in depths {
                    let b = open_backing(&opts.backing, engine)?;
                    let mut q = b.new_queue_with(engine, depth)?;
                    let c = ceiling::measure_queue(
                        q.as_mut(),
                        b.size_bytes(),
                        pattern,
                        ceiling_blocks,
                    )?;
                    ceilings
                        .entry((engine.name(), pattern.name(), depth))
                        .or_default()
                        .push(c.pages_per_s);
                }
            }
        }
    }
    if !is_block_device(&opts.backing) {
        let _ = std::fs::remove_file(&opts.backing);
    }

    let ceiling = |engine: &str, pattern: &str, depth: usize| {
        ceilings
            .get(&(engine, pattern, depth))
            .map_or(f64::NAN, |v| median(v))
    };
    let mut pages_per_s = serde_json::Map::new();
    let mut speedup = serde_json::Map::new();
    let mut fraction = serde_json::Map::new();
    let mut ops = serde_json::Map::new();
    let mut table = Table::new(&[
        "layout",
        "batch",
        "engine",
        "pages/s",
        "x batch 1",
        "of d32 ceiling",
        "writes",
    ]);
    for &target in &targets {
        let name = target.name();
        let base = samples
            .get(&(name, 1))
            .map(|v| median(&v.iter().map(|s| s.pages_per_s).collect::<Vec<_>>()));
        let ceil32 = ceiling("uring", target.pattern().name(), 32);
        let (mut p, mut sp, mut fr, mut op) = (
            serde_json::Map::new(),
            serde_json::Map::new(),
            serde_json::Map::new(),
            serde_json::Map::new(),
        );
        for &batch in &opts.batch_sizes {
            let v = &samples[&(name, batch)];
            let pps = median(&v.iter().map(|s| s.pages_per_s).collect::<Vec<_>>());
            let writes = v[0].ops;
            let x = base.map_or(f64::NAN, |b| pps / b);
            p.insert(batch.to_string(), json!(pps));
            if base.is_some() {
                sp.insert(batch.to_string(), json!(x));
            }
            fr.insert(batch.to_string(), json!(pps / ceil32));
            op.insert(batch.to_string(), json!(writes));
            table.row(vec![
                name.to_string(),
                batch.to_string(),
                engine_for(batch).name().to_string(),
                f(pps),
                f(x),
                f(pps / ceil32),
                writes.to_string(),
            ]);
        }
        pages_per_s.insert(name.into(), Value::Object(p));
        speedup.insert(name.into(), Value::Object(sp));
        fraction.insert(name.into(), Value::Object(fr));
        ops.insert(name.into(), Value::Object(op));
    }
    let mut ctable = Table::new(&["engine", "pattern", "depth", "pages/s"]);
    let mut ceiling_json = serde_json::Map::new();
    let mut ceiling_sync = serde_json::Map::new();
    for ((engine, pattern, depth), v) in &ceilings {
        let m = median(v);
        ctable.row(vec![
            engine.to_string(),
            pattern.to_string(),
            depth.to_string(),
            f(m),
        ]);
        let target = if *engine == "uring" {
            &mut ceiling_json
        } else {
            &mut ceiling_sync
        };
        target
            .entry(pattern.to_string())
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("object")
            .insert(depth.to_string(), json!(m));
    }
    // The comparison: the zoned store against batch-1 synchronous and batched bitmap
    // writeback on the fragmented layout (the bitmap's best batch size: the fairest anchor).
    let med = |key: (&'static str, usize)| {
        samples
            .get(&key)
            .map(|v| median(&v.iter().map(|s| s.pages_per_s).collect::<Vec<_>>()))
    };
    let best = |name: &'static str, batched_only: bool| {
        opts.batch_sizes
            .iter()
            .filter(|&&b| !batched_only || b > 1)
            .filter_map(|&b| med((name, b)).map(|v| (b, v)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
    };
    let frag = Layout::Fragmented.name();
    let batch1 = med((frag, 1));
    let bitmap_best = best(frag, true);
    let zoned_best = best("zoned", false);
    let mut comparison = serde_json::Map::new();
    if let Some(b1) = batch1 {
        comparison.insert("batch1_sync_pages_per_s".into(), json!(b1));
    }
    if let Some((b, v)) = bitmap_best {
        comparison.insert("bitmap_pages_per_s".into(), json!(v));
        comparison.insert("bitmap_batch_size".into(), json!(b));
    }
    if let Some((b, v)) = zoned_best {
        comparison.insert("zoned_pages_per_s".into(), json!(v));
        comparison.insert("zoned_batch_size".into(), json!(b));
        if let Some(b1) = batch1 {
            comparison.insert("zoned_vs_batch1".into(), json!(v / b1));
        }
        if let Some((_, bm)) = bitmap_best {
            comparison.insert("zoned_vs_bitmap".into(), json!(v / bm));
        }
    }
    if let Some(zs) = opts
        .stores
        .contains(&Store::Zoned)
        .then(|| zone_size_for(opts, backing_bytes))
    {
        comparison.insert("zone_size_bytes".into(), json!(zs));
    }
    println!(
        "writeback of {} pages ({} of them written: same-filled pages stay), backing {} ({io_mode}), median of {reps}",
        opts.pages,
        samples.values().next().map_or(0, |v| v[0].written),
        opts.backing.display()
    );
    println!("{}", table.render());
    if let (Some((zb, z)), Some(b1), Some((bb, bm))) = (zoned_best, batch1, bitmap_best) {
        println!(
            "zoned (batch {zb}) {} pages/s: {} x fragmented batch 1 (sync, {} pages/s), {} x \
             fragmented bitmap batch {bb} ({} pages/s)",
            f(z),
            f(z / b1),
            f(b1),
            f(z / bm),
            f(bm)
        );
    }
    println!("ceiling of the same file (4 KiB writes):");
    println!("{}", ctable.render());
    let mut doc = json!({
        "benchmark": "writeback",
        "backing": opts.backing.display().to_string(),
        "io_mode": io_mode,
        "page_size_bytes": ps,
        "pages": opts.pages,
        "written_pages": samples.values().next().map_or(0, |v| v[0].written),
        "repeats": reps,
        "batch1_engine": "sync",
        "batched_engine": "uring",
        "pages_per_s": pages_per_s,
        "speedup_vs_batch1": speedup,
        "fraction_of_ceiling_d32": fraction,
        "writes": ops,
        "ceiling_pages_per_s": ceiling_json,
        "ceiling_sync_pages_per_s": ceiling_sync,
        "ceiling_compared_with": {"sequential": "sequential", "fragmented": "random", "zoned": "sequential"},
        "stores": opts.stores.iter().map(|s| s.name()).collect::<Vec<_>>(),
    });
    doc.as_object_mut().expect("object").extend(comparison);
    Ok(doc)
}

/// Which figure of a [`CostSample`] a row of the comparison shows.
type Pick = fn(&CostSample) -> f64;

/// One writeback and read-back of the checksum-cost comparison: wall and CPU seconds of each.
#[derive(Debug, Clone, Copy)]
struct CostSample {
    written: u64,
    wb_secs: f64,
    wb_cpu_secs: f64,
    read_secs: f64,
    read_cpu_secs: f64,
}

/// A fresh bitmap device over the sequential backing (or, `in_memory`, a `MemBacking`: no
/// device time, so the checksum's share is the largest it can be), batch `batch`, filled from the corpus and
/// marked idle; `checked`: with block checksums (the product), else the baseline without.
/// Times `writeback idle`, then reading every page back (every written-back one from the
/// backing, verified when `checked`), and checks what it read.
fn run_cost_one(
    corpus: &Corpus,
    opts: &WritebackBenchOptions,
    batch: usize,
    checked: bool,
    in_memory: bool,
) -> Result<CostSample> {
    let ps = corpus.page_size_bytes();
    let n = opts.pages;
    let backing: Arc<dyn Backing> = if in_memory {
        Arc::new(MemBacking::new((n as u64 + 64) * ps as u64)?)
    } else {
        Arc::new(open_backing(&opts.backing, engine_for(batch))?)
    };
    let dev = Device::new_uninit(ps)?;
    dev.set_backing(backing)?;
    dev.set_writeback_batch_size(u32::try_from(batch).map_err(|_| Error::invalid("batch"))?)?;
    dev.init((n * ps) as u64)?;
    if !checked {
        dev.bench_skip_block_checksums()?;
    }
    for i in 0..n {
        dev.write_at(corpus.page(i % corpus.len()), (i * ps) as u64)?;
    }
    dev.mark_idle(IdleCutoff::All);
    let (cpu0, t0) = (crate::free::process_cpu_secs(), Instant::now());
    let report =
        dev.writeback_with_progress(&WritebackSpec::mode(WritebackMode::Idle), &mut |_| {})?;
    let (wb_secs, wb_cpu_secs) = (
        t0.elapsed().as_secs_f64(),
        crate::free::process_cpu_secs() - cpu0,
    );
    if let Some(e) = report.error {
        return Err(e);
    }
    let mut buf = vec![0u8; ps];
    let (cpu0, t0) = (crate::free::process_cpu_secs(), Instant::now());
    let mut same = true;
    for i in 0..n {
        dev.read_at(&mut buf, (i * ps) as u64)?;
        same &= buf == corpus.page(i % corpus.len());
    }
    let (read_secs, read_cpu_secs) = (
        t0.elapsed().as_secs_f64(),
        crate::free::process_cpu_secs() - cpu0,
    );
    if !same {
        return Err(Error::io("a page read back different"));
    }
    Ok(CostSample {
        written: report.written,
        wb_secs,
        wb_cpu_secs,
        read_secs,
        read_cpu_secs,
    })
}

/// `uzram bench writeback --checksum-cost`: what the CRC-32C of every written-back block costs
/// (the goal: at most 3%), measured against the same device without it in the same run.
/// For each repetition, on the sequential layout at the largest batch size asked for, one run
/// with and one without (the order alternating between repetitions, so neither always runs
/// on a warmer cache), each timing `writeback idle` and the read-back of every page: wall and
/// process CPU seconds. Reports medians and the ratios with / without.
pub fn run_checksum_cost(corpus: &Corpus, opts: &WritebackBenchOptions) -> Result<Value> {
    let ps = corpus.page_size_bytes();
    if corpus.is_empty() || opts.pages == 0 {
        return Err(Error::invalid("no pages to write back"));
    }
    let batch = opts.batch_sizes.iter().copied().max().unwrap_or(32).max(1);
    let reps = opts.repeats.max(1);
    let backing_bytes = (opts.pages as u64 + 64) * ps as u64;
    prepare_backing(&opts.backing, backing_bytes)?;
    let mut table = Table::new(&[
        "backing",
        "measure",
        "checksum on",
        "checksum off",
        "on / off",
    ]);
    let mut doc = serde_json::Map::new();
    let mut written = 0;
    for (backing_name, in_memory) in [("file", false), ("memory", true)] {
        let mut with: Vec<CostSample> = Vec::new();
        let mut without: Vec<CostSample> = Vec::new();
        for rep in 0..reps {
            let order = if rep % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            };
            for checked in order {
                let s = run_cost_one(corpus, opts, batch, checked, in_memory)?;
                eprintln!(
                    "  run {}/{reps}: {backing_name:6} checksum {:3}: writeback {:.3} s ({:.3} s CPU), read-back {:.3} s ({:.3} s CPU), {} pages",
                    rep + 1,
                    if checked { "on" } else { "off" },
                    s.wb_secs,
                    s.wb_cpu_secs,
                    s.read_secs,
                    s.read_cpu_secs,
                    s.written
                );
                if checked { &mut with } else { &mut without }.push(s);
            }
        }
        written = with[0].written;
        let med = |v: &[CostSample], pick: Pick| median(&v.iter().map(pick).collect::<Vec<_>>());
        let metrics: [(&str, Pick); 4] = [
            ("writeback_secs", |s| s.wb_secs),
            ("writeback_cpu_secs", |s| s.wb_cpu_secs),
            ("read_back_secs", |s| s.read_secs),
            ("read_back_cpu_secs", |s| s.read_cpu_secs),
        ];
        let mut doc_on = serde_json::Map::new();
        let mut doc_off = serde_json::Map::new();
        let mut ratios = serde_json::Map::new();
        for (name, pick) in metrics {
            let (on, off) = (med(&with, pick), med(&without, pick));
            table.row(vec![
                backing_name.to_string(),
                name.to_string(),
                format!("{on:.4}"),
                format!("{off:.4}"),
                format!("{:.4}", on / off),
            ]);
            doc_on.insert(name.into(), json!(on));
            doc_off.insert(name.into(), json!(off));
            ratios.insert(name.into(), json!(on / off));
        }
        // The checksum's own cost per page: the CPU-time difference of the medians.
        let per_page_ns =
            |pick: Pick| (med(&with, pick) - med(&without, pick)) * 1e9 / written as f64;
        doc.insert(
            backing_name.into(),
            json!({
                "checksum_on": doc_on,
                "checksum_off": doc_off,
                "on_over_off": ratios,
                "writeback_cpu_ns_per_page_added": per_page_ns(|s| s.wb_cpu_secs),
                "read_back_cpu_ns_per_page_added": per_page_ns(|s| s.read_cpu_secs),
                "writeback_pages_per_s_on": written as f64 / med(&with, |s| s.wb_secs),
                "writeback_pages_per_s_off": written as f64 / med(&without, |s| s.wb_secs),
                "read_back_pages_per_s_on": written as f64 / med(&with, |s| s.read_secs),
                "read_back_pages_per_s_off": written as f64 / med(&without, |s| s.read_secs),
            }),
        );
    }
    if !is_block_device(&opts.backing) {
        let _ = std::fs::remove_file(&opts.backing);
    }
    println!(
        "checksum cost: writeback idle of {} pages ({written} written) and read-back of every page, bitmap, sequential, batch {batch}, file {} and in memory, median of {reps}",
        opts.pages,
        opts.backing.display()
    );
    println!("{}", table.render());
    let mut out = json!({
        "benchmark": "writeback_checksum_cost",
        "backing": opts.backing.display().to_string(),
        "page_size_bytes": ps,
        "pages": opts.pages,
        "written_pages": written,
        "batch_size": batch,
        "repeats": reps,
    });
    out.as_object_mut().expect("object").extend(doc);
    Ok(out)
}

/// The top-level JSON keys comparing the stores, present (positive) when both stores ran on
/// the fragmented layout with batch 1 and a larger batch.
pub const COMPARISON_KEYS: [&str; 5] = [
    "zoned_pages_per_s",
    "bitmap_pages_per_s",
    "batch1_sync_pages_per_s",
    "zoned_vs_batch1",
    "zoned_vs_bitmap",
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of several kinds (text-like, half random, random), none same-filled, so every
    /// page is a candidate.
    fn test_corpus() -> Corpus {
        let mut corpus = Corpus::new(4096).unwrap();
        let mut pages = vec![0u8; 64 * 4096];
        let mut x = 0x1234_5678_9abc_def1u64;
        for (i, p) in pages.chunks_mut(4096).enumerate() {
            let random_bytes = [64, 2048, 4096][i % 3];
            for (k, b) in p.iter_mut().enumerate() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = if k < random_bytes {
                    x as u8
                } else {
                    b"zram "[k % 5]
                };
            }
        }
        corpus.add_source("test", &pages).unwrap();
        corpus
    }

    #[test]
    fn tiny_checksum_cost_run_reads_back_and_reports_both_backings() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap_or_else(|_| tempfile::tempdir().unwrap());
        let opts = WritebackBenchOptions {
            backing: dir.path().join("bd"),
            pages: 200,
            batch_sizes: vec![8],
            repeats: 2,
            progress: false,
            ..Default::default()
        };
        let doc = run_checksum_cost(&test_corpus(), &opts).unwrap();
        assert_eq!(doc["written_pages"].as_u64().unwrap(), 200);
        for backing in ["file", "memory"] {
            for side in ["checksum_on", "checksum_off", "on_over_off"] {
                for m in ["writeback_secs", "writeback_cpu_secs", "read_back_secs"] {
                    assert!(
                        doc[backing][side][m].as_f64().unwrap() > 0.0,
                        "{backing} {side} {m}"
                    );
                }
            }
        }
    }

    #[test]
    fn tiny_run_writes_json_with_the_required_keys() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap_or_else(|_| tempfile::tempdir().unwrap());
        let corpus = test_corpus();
        let opts = WritebackBenchOptions {
            backing: dir.path().join("bd"),
            pages: 300,
            batch_sizes: vec![1, 8],
            repeats: 1,
            progress: false,
            ..Default::default()
        };
        let doc = run(&corpus, &opts).unwrap();
        for layout in ["sequential", "fragmented"] {
            assert!(doc["pages_per_s"][layout]["8"].as_f64().unwrap() > 0.0);
            assert!(doc["speedup_vs_batch1"][layout]["8"].as_f64().unwrap() > 0.0);
        }
        for pattern in ["sequential", "random"] {
            for depth in ["1", "32"] {
                assert!(doc["ceiling_pages_per_s"][pattern][depth].as_f64().unwrap() > 0.0);
            }
        }
        // The zoned store: packed records, a few large writes; the comparison keys.
        assert!(doc["pages_per_s"]["zoned"]["8"].as_f64().unwrap() > 0.0);
        assert!(
            doc["writes"]["zoned"]["8"].as_u64().unwrap() * 8
                < doc["written_pages"].as_u64().unwrap()
        );
        for key in COMPARISON_KEYS {
            assert!(doc[key].as_f64().unwrap() > 0.0, "{key}");
        }
        // Fragmented: no two written blocks adjacent, so one write per page.
        let written = doc["written_pages"].as_u64().unwrap();
        assert_eq!(doc["writes"]["fragmented"]["8"].as_u64().unwrap(), written);
        assert!(doc["writes"]["sequential"]["8"].as_u64().unwrap() < written);
    }
}
