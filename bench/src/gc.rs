//! `uzram bench gc`: the experiment zoned XFS's ring of GC scratch buffers was measured with
//! (256 MiB HDD zones, holes punched to free half the space, GC timed). Fill zones of a real backing file with written-back
//! pages from the corpus, free half the space by discarding random slots, then garbage-collect
//! until every victim is reclaimed; the scratch ring and the bank-switching baseline in the same
//! run, on the same data, alternating, each repetition from a freshly filled store. Reported:
//! GC time, MB/s relocated, and the fraction of the file's sequential bandwidth (write, and
//! the read-then-write bound `1 / (1/read + 1/write)` that relocation cannot exceed), measured
//! in the same run with the same chunk size.
//!
//! With `--device-model smr-hdd|ssd` the file is wrapped in a [`ModelBacking`]: every request
//! takes the time the modelled device would (seek from the distance, rotational latency, media
//! rate, one request at a time; `uzram::backing::DeviceModel` documents the parameters and
//! their sources). The run then also checks the model: sequential bandwidth and random 4 KiB
//! reads through it, against what its parameters predict.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::corpus::Corpus;
use crate::{f, median, Table};
use uzram::backing::{
    AlignedBuf, Backing, DeviceModel, FileBacking, FileOptions, IoOp, ModelBacking,
};
use uzram::compress::{self, same_filled_word, CodecParams};
use uzram::error::{Error, Result};
use uzram::zoned::{
    GcOwner, ScratchMode, ZoneConfig, ZoneLoc, ZoneStore, DEFAULT_STAGE_BYTES, FLAG_COMPRESSED,
};

/// Options of `uzram bench gc`.
#[derive(Debug, Clone)]
pub struct GcBenchOptions {
    /// The backing file (created, sized and removed afterwards).
    pub backing: PathBuf,
    /// Zone size.
    pub zone_size_bytes: u64,
    /// Zones in the file; all but two are filled.
    pub zones: u64,
    /// Repetitions of each mode (medians reported).
    pub repeats: usize,
    /// Codec for the written-back objects.
    pub codec: String,
    /// Seed for the discarded half.
    pub seed: u64,
    /// Queue depth of GC reads and writes.
    pub depth: usize,
    /// Largest GC chunk.
    pub chunk_bytes: usize,
    /// Bytes per scratch buffer (two buffers in either design).
    pub buffer_bytes: usize,
    /// How half the space is freed.
    pub holes: Holes,
    /// Wrap the file in this device model (`None`: the plain file).
    pub device_model: Option<DeviceModel>,
}

/// How the benchmark frees half the space before GC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holes {
    /// Alternating runs of kept and discarded slots, each uniform in `1..2 * mean_pages`
    /// pages: holes punched in the zones, as that benchmark punches holes in files, so the live
    /// data left is extents of varying length.
    Punch {
        /// Mean run length in pages.
        mean_pages: u64,
    },
    /// Each slot discarded with probability 1/2: live records scattered one or two at a time.
    Scatter,
}

impl Holes {
    /// From the command line's `--holes` and `--hole-pages`.
    pub fn parse(name: &str, mean_pages: u64) -> Result<Holes> {
        match name {
            "punch" if mean_pages > 0 => Ok(Holes::Punch { mean_pages }),
            "punch" => Err(Error::invalid("--hole-pages must be at least 1")),
            "scatter" => Ok(Holes::Scatter),
            other => Err(Error::invalid(format!(
                "--holes {other}: expected punch or scatter"
            ))),
        }
    }

    fn describe(&self) -> String {
        match self {
            Holes::Punch { mean_pages } => {
                format!("holes punched (runs of 1..{} pages)", 2 * mean_pages - 1)
            }
            Holes::Scatter => "random half of the slots discarded".into(),
        }
    }

    /// Which slots of `n` to discard.
    fn discards(&self, n: usize, rng: &mut impl Rng) -> Vec<bool> {
        match *self {
            Holes::Scatter => (0..n).map(|_| rng.gen_bool(0.5)).collect(),
            Holes::Punch { mean_pages } => {
                let mut out = Vec::with_capacity(n);
                let mut discard = rng.gen_bool(0.5);
                while out.len() < n {
                    let run = rng.gen_range(1..2 * mean_pages) as usize;
                    let run = run.min(n - out.len());
                    out.resize(out.len() + run, discard);
                    discard = !discard;
                }
                out
            }
        }
    }
}

impl Default for GcBenchOptions {
    fn default() -> GcBenchOptions {
        GcBenchOptions {
            backing: PathBuf::from("/var/tmp/uzram-bench-gc.img"),
            zone_size_bytes: uzram::zoned::DEFAULT_ZONE_SIZE_BYTES,
            zones: 6,
            repeats: 4,
            codec: "lz4".into(),
            seed: 1,
            depth: uzram::zoned::GC_QUEUE_DEPTH,
            chunk_bytes: uzram::zoned::DEFAULT_GC_CHUNK_BYTES,
            buffer_bytes: uzram::zoned::DEFAULT_GC_BUFFER_BYTES,
            holes: Holes::Punch { mean_pages: 64 },
            device_model: None,
        }
    }
}

/// Slots point at records through one atomic word each (the device's slot table in small).
struct Owner {
    locs: Vec<AtomicU64>,
}

const NO_LOC: u64 = u64::MAX;

impl GcOwner for Owner {
    /// A compare-and-swap stands for the slot lock: the benchmark releases slots only before
    /// GC starts, so nothing can release `new` between the swap and `moved`.
    fn repoint(&self, slot: u64, old: ZoneLoc, new: ZoneLoc, moved: &dyn Fn()) -> bool {
        let ok = self.locs[slot as usize]
            .compare_exchange(
                old.to_raw(),
                new.to_raw(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        if ok {
            moved();
        }
        ok
    }
}

/// Fills all but two zones with records of `objects` (cycled), written through the backing's
/// queue; returns the owner with every slot's location.
fn fill(store: &Arc<ZoneStore>, objects: &[(Vec<u8>, u8)], depth: usize) -> Result<Owner> {
    let target_full = store.nr_zones() as u64 - 2;
    let mut w = store.writer(DEFAULT_STAGE_BYTES)?;
    let mut locs: Vec<AtomicU64> = Vec::new();
    let backing = store.backing().clone();
    let mut queue = backing.new_queue(depth)?;
    let mut slot = 0u64;
    let mut pending: Vec<Option<Vec<(u64, ZoneLoc)>>> = Vec::new();
    let finish = |c: uzram::backing::IoCompletion,
                  pending: &mut Vec<Option<Vec<(u64, ZoneLoc)>>>,
                  locs: &mut Vec<AtomicU64>|
     -> Result<()> {
        c.result?;
        for (s, loc) in pending[c.op.tag as usize].take().expect("in flight") {
            locs[s as usize].store(loc.to_raw(), Ordering::Release);
            store.commit(loc);
        }
        Ok(())
    };
    loop {
        let done = store.stats().full >= target_full;
        if done {
            w.finish();
        } else {
            let (obj, flags) = &objects[slot as usize % objects.len()];
            w.append(slot, 0, *flags, obj)?;
            locs.push(AtomicU64::new(NO_LOC));
            slot += 1;
        }
        while let Some(mut sw) = w.take_ready() {
            while queue.in_flight() >= queue.depth() {
                for c in queue.wait(1)? {
                    finish(c, &mut pending, &mut locs)?;
                }
            }
            sw.op.tag = pending.len() as u64;
            pending.push(Some(sw.records));
            queue.submit(sw.op).map_err(|(e, _)| e)?;
        }
        if done {
            break;
        }
    }
    for c in queue.wait(usize::MAX)? {
        finish(c, &mut pending, &mut locs)?;
    }
    Ok(Owner { locs })
}

/// Sequential bandwidth of `backing` in MB/s with `chunk` byte I/Os over `bytes`: (write at
/// queue depth `depth`, read one at a time as GC reads).
fn seq_bandwidth(
    backing: &dyn Backing,
    chunk: usize,
    bytes: u64,
    depth: usize,
) -> Result<(f64, f64)> {
    let write = write_sequential(backing, chunk, bytes, depth)?;
    // Untimed: a modelled write cache destages before the reads are timed.
    backing.flush()?;
    let n = bytes / chunk as u64;
    let mut buf = AlignedBuf::new_zeroed(chunk)?;
    let start = Instant::now();
    for i in 0..n {
        backing.read_at(&mut buf, i * chunk as u64)?;
    }
    let read = (n * chunk as u64) as f64 / start.elapsed().as_secs_f64() / 1e6;
    Ok((write, read))
}

/// Writes the first `bytes` of `backing` in `chunk`-byte writes at queue depth `depth`;
/// returns MB/s.
fn write_sequential(backing: &dyn Backing, chunk: usize, bytes: u64, depth: usize) -> Result<f64> {
    let n = bytes / chunk as u64;
    let mut queue = backing.new_queue(depth)?;
    let mut spare: Vec<AlignedBuf> = Vec::new();
    let start = Instant::now();
    for i in 0..n {
        while queue.in_flight() >= depth {
            for c in queue.wait(1)? {
                c.result?;
                spare.extend(c.op.bufs);
            }
        }
        let mut buf = match spare.pop() {
            Some(b) => b,
            None => AlignedBuf::new_zeroed(chunk)?,
        };
        buf[..8].copy_from_slice(&i.to_le_bytes());
        queue
            .submit(IoOp::new(i * chunk as u64, vec![buf], i))
            .map_err(|(e, _)| e)?;
    }
    for c in queue.wait(usize::MAX)? {
        c.result?;
    }
    Ok((n * chunk as u64) as f64 / start.elapsed().as_secs_f64() / 1e6)
}

/// Runs the benchmark, prints its table, and returns the JSON document.
pub fn run(corpus: &Corpus, opts: &GcBenchOptions) -> Result<serde_json::Value> {
    let ps = corpus.page_size_bytes();
    let codec = compress::new_codec(&opts.codec, CodecParams::default())?;
    let mut dst = vec![0u8; compress::compress_bound(ps)];
    let mut objects = Vec::new();
    for i in 0..corpus.len() {
        let page = corpus.page(i);
        if same_filled_word(page).is_some() {
            continue; // same-filled pages are never written back
        }
        let n = codec.compress(page, &mut dst)?;
        objects.push(if n < ps {
            (dst[..n].to_vec(), FLAG_COMPRESSED)
        } else {
            (page.to_vec(), 0)
        });
    }
    if objects.is_empty() {
        return Err(Error::invalid(
            "the corpus has no pages that are not same-filled",
        ));
    }
    let size = opts.zone_size_bytes * opts.zones;
    let file = FileBacking::create(&opts.backing, size, &FileOptions::default())?;
    let io_mode = file.io_mode().to_string();
    let file: Arc<dyn Backing> = Arc::new(file);
    // Write the whole file once, untimed (and not through the model): a sparse file's first
    // write into a block allocates it, and the flush before each victim reset would then
    // commit file system metadata (up to 0.7 s per flush here), which a block device has none
    // of.
    let prepared = write_sequential(file.as_ref(), 1 << 20, size, 8).and_then(|_| file.flush());
    let model = match opts.device_model.clone() {
        Some(m) => match ModelBacking::new(file.clone(), m) {
            Ok(b) => Some(Arc::new(b)),
            Err(e) => {
                drop(file);
                let _ = std::fs::remove_file(&opts.backing);
                return Err(e);
            }
        },
        None => None,
    };
    let backing: Arc<dyn Backing> = match &model {
        Some(m) => m.clone(),
        None => file.clone(),
    };
    let result = prepared.and_then(|_| run_on(&backing, model.as_deref(), &objects, opts));
    let check = match (&model, &result) {
        (Some(m), Ok((_, (seq_w, seq_r)))) => Some(check_model(m, *seq_w, *seq_r)),
        _ => None,
    };
    drop(backing);
    drop(model);
    drop(file);
    let _ = std::fs::remove_file(&opts.backing);
    let (rows, bw) = result?;
    let check = check.transpose()?;

    let (ring, bank): (Vec<&Row>, Vec<&Row>) =
        rows.iter().partition(|r| r.mode == ScratchMode::Ring);
    let med =
        |rs: &[&Row], f: fn(&Row) -> f64| median(&rs.iter().map(|r| f(r)).collect::<Vec<_>>());
    let gc_ms_ring = med(&ring, |r| r.gc_ms);
    let gc_ms_bank = med(&bank, |r| r.gc_ms);
    let ratio = median(
        &ring
            .iter()
            .zip(&bank)
            .map(|(r, b)| r.gc_ms / b.gc_ms)
            .collect::<Vec<_>>(),
    );
    let reloc_ms_ring = med(&ring, |r| r.relocate_ms);
    let reloc_ms_bank = med(&bank, |r| r.relocate_ms);
    let reloc_ratio = median(
        &ring
            .iter()
            .zip(&bank)
            .map(|(r, b)| r.relocate_ms / b.relocate_ms)
            .collect::<Vec<_>>(),
    );
    let mbps_ring = med(&ring, |r| r.relocated_mb / (r.gc_ms / 1e3));
    let mbps_bank = med(&bank, |r| r.relocated_mb / (r.gc_ms / 1e3));
    let (seq_w, seq_r) = bw;
    let rw_bound = 1.0 / (1.0 / seq_r + 1.0 / seq_w);
    if let Some(c) = &check {
        println!("{}", c.summary);
    }
    let first = &rows[0];
    let mut t = Table::new(&["gc benchmark", "ring", "bank switching", "ring/bank"]);
    t.row(vec![
        "GC time ms (median)".into(),
        f(gc_ms_ring),
        f(gc_ms_bank),
        format!("{ratio:.3}"),
    ]);
    t.row(vec![
        "  of which relocating (no flush)".into(),
        f(reloc_ms_ring),
        f(reloc_ms_bank),
        format!("{reloc_ratio:.3}"),
    ]);
    if ring.iter().chain(&bank).all(|r| r.device_busy_ms.is_some()) {
        let busy = |rs: &[&Row]| {
            median(
                &rs.iter()
                    .map(|r| r.device_busy_ms.unwrap_or(0.0) / r.gc_ms)
                    .collect::<Vec<_>>(),
            )
        };
        t.row(vec![
            "modelled device busy, of GC time".into(),
            format!("{:.1}%", 100.0 * busy(&ring)),
            format!("{:.1}%", 100.0 * busy(&bank)),
            String::new(),
        ]);
    }
    t.row(vec![
        "relocated MB/s".into(),
        f(mbps_ring),
        f(mbps_bank),
        f(mbps_ring / mbps_bank),
    ]);
    t.row(vec![
        "of sequential write bandwidth".into(),
        format!("{:.1}%", 100.0 * mbps_ring / seq_w),
        format!("{:.1}%", 100.0 * mbps_bank / seq_w),
        String::new(),
    ]);
    t.row(vec![
        "of read-then-write bound".into(),
        format!("{:.1}%", 100.0 * mbps_ring / rw_bound),
        format!("{:.1}%", 100.0 * mbps_bank / rw_bound),
        String::new(),
    ]);
    println!(
        "{} zones of {} MiB on {} ({io_mode}), {} filled from {} objects ({}), {}; \
         GC scratch 2 x {} KiB, chunks up to {} KiB, queue depth {}; median of {} runs each",
        opts.zones,
        opts.zone_size_bytes >> 20,
        opts.backing.display(),
        opts.zones - 2,
        objects.len(),
        opts.codec,
        opts.holes.describe(),
        opts.buffer_bytes >> 10,
        opts.chunk_bytes.min(opts.buffer_bytes) >> 10,
        opts.depth,
        opts.repeats
    );
    print!("{}", t.render());
    println!(
        "per run: {} zones reclaimed, {:.1} MB relocated, {} records; sequential write {:.0} MB/s, \
         read {:.0} MB/s (256 KiB I/Os)",
        first.zones_reclaimed, first.relocated_mb, first.records, seq_w, seq_r
    );
    Ok(json!({
        "benchmark": "gc",
        "zone_size_bytes": opts.zone_size_bytes,
        "zones": opts.zones,
        "repeats": opts.repeats,
        "codec": opts.codec,
        "chunk_bytes": opts.chunk_bytes.min(opts.buffer_bytes),
        "buffer_bytes": opts.buffer_bytes,
        "depth": opts.depth,
        "holes": opts.holes.describe(),
        "io_mode": io_mode,
        "device_model": check.as_ref().map(|c| c.json.clone()),
        "gc_ms_ring": gc_ms_ring,
        "gc_ms_bank": gc_ms_bank,
        "gc_ratio": ratio,
        "relocate_ms_ring": reloc_ms_ring,
        "relocate_ms_bank": reloc_ms_bank,
        "relocate_ratio": reloc_ratio,
        "relocated_mbps_ring": mbps_ring,
        "relocated_mbps_bank": mbps_bank,
        "seq_write_mbps": seq_w,
        "seq_read_mbps": seq_r,
        "fraction_of_seq_write_ring": mbps_ring / seq_w,
        "fraction_of_read_write_bound_ring": mbps_ring / rw_bound,
        "runs": rows.iter().map(|r| json!({
            "mode": format!("{:?}", r.mode).to_lowercase(),
            "gc_ms": r.gc_ms,
            "relocate_ms": r.relocate_ms,
            "relocated_mb": r.relocated_mb,
            "zones_reclaimed": r.zones_reclaimed,
            "records": r.records,
            "device_busy_ms": r.device_busy_ms,
        })).collect::<Vec<_>>(),
    }))
}

/// What [`check_model`] found.
struct ModelCheck {
    summary: String,
    json: serde_json::Value,
}

/// Checks the model in use: sequential bandwidth (measured by `run_on` through it, 1 MiB I/Os)
/// and random 4 KiB reads at queue depth 1 against what its parameters predict.
fn check_model(backing: &ModelBacking, seq_w: f64, seq_r: f64) -> Result<ModelCheck> {
    let m = backing.model().clone();
    let chunk = uzram::zoned::DEFAULT_GC_CHUNK_BYTES as u64;
    // Predicted: per 1 MiB sequential request, the command overhead and the transfer (the
    // media's for reads; the interface's for writes into a write cache that holds them all:
    // `run_on` writes 256 MiB).
    let seq_pred = chunk as f64 / (m.command_overhead + m.transfer_time(chunk)).as_secs_f64() / 1e6;
    let seq_w_pred = if m.write_cache_bytes >= 256 << 20 {
        chunk as f64 / (m.command_overhead + m.interface_time(chunk)).as_secs_f64() / 1e6
    } else {
        seq_pred
    };
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut buf = AlignedBuf::new_zeroed(4096)?;
    let blocks = backing.size_bytes() / 4096;
    let n = 100;
    let before = backing.stats();
    let mut head = None::<u64>;
    let mut predicted = std::time::Duration::ZERO;
    let start = Instant::now();
    for _ in 0..n {
        let off = rng.gen_range(0..blocks) * 4096;
        backing.read_at(&mut buf, off)?;
        // The model's head is wherever the last request ended.
        if let Some(h) = head {
            predicted += m.service_time(h, off, 4096).0;
        }
        head = Some(off + 4096);
    }
    let measured_ms = start.elapsed().as_secs_f64() * 1e3 / n as f64;
    let predicted_ms = predicted.as_secs_f64() * 1e3 / (n - 1) as f64;
    let stats = backing.stats();
    let seeks = stats.seeks - before.seeks;
    let cache = if m.write_cache_bytes > 0 {
        format!(
            "; write cache {} MiB: {} writes acknowledged from it, {} waited for room, {} MB \
             destaged in {} media accesses",
            m.write_cache_bytes >> 20,
            stats.cached_writes,
            stats.cache_full_waits,
            stats.destaged_bytes / 1_000_000,
            stats.destages
        )
    } else {
        String::new()
    };
    let summary = format!(
        "device model {} (command queue {}): sequential write / read {:.0} / {:.0} MB/s (predicted {:.0} / {:.0}); \
         random 4 KiB reads {:.2} ms each (predicted {:.2}; {} of {} seeks){cache}",
        m.name, m.queue_depth, seq_w, seq_r, seq_w_pred, seq_pred, measured_ms, predicted_ms, seeks, n
    );
    Ok(ModelCheck {
        summary,
        json: json!({
            "name": m.name,
            "queue_depth": m.queue_depth,
            "command_overhead_us": m.command_overhead.as_secs_f64() * 1e6,
            "single_track_seek_ms": m.single_track_seek.as_secs_f64() * 1e3,
            "full_stroke_seek_ms": m.full_stroke_seek.as_secs_f64() * 1e3,
            "rpm": m.rpm,
            "media_mbps": m.media_bytes_per_sec / 1e6,
            "track_bytes": m.track_bytes,
            "capacity_bytes": m.capacity_bytes,
            "seq_predicted_mbps": seq_pred,
            "seq_write_predicted_mbps": seq_w_pred,
            "write_cache_bytes": m.write_cache_bytes,
            "interface_mbps": m.interface_bytes_per_sec / 1e6,
            "destage_bytes": m.destage_bytes,
            "cached_writes": stats.cached_writes,
            "cache_full_waits": stats.cache_full_waits,
            "destaged_bytes": stats.destaged_bytes,
            "destages": stats.destages,
            "rand_read_4k_ms": measured_ms,
            "rand_read_4k_predicted_ms": predicted_ms,
        }),
    })
}

struct Row {
    mode: ScratchMode,
    gc_ms: f64,
    /// `gc_ms` without the flushes before victim resets.
    relocate_ms: f64,
    relocated_mb: f64,
    zones_reclaimed: u64,
    records: u64,
    /// With a device model: the modelled media's busy time during the GC (reads, writes
    /// without a cache, destages).
    device_busy_ms: Option<f64>,
}

fn run_on(
    backing: &Arc<dyn Backing>,
    model: Option<&ModelBacking>,
    objects: &[(Vec<u8>, u8)],
    opts: &GcBenchOptions,
) -> Result<(Vec<Row>, (f64, f64))> {
    let mut rows = Vec::new();
    // Repetition 0 is a warm-up (the first GC on a fresh file ran up to 1.5x slower than the
    // rest, whichever mode it was), not reported.
    for rep in 0..=opts.repeats.max(1) {
        // Alternate which mode goes first, so neither always runs on a warmer device.
        let modes = if rep % 2 == 0 {
            [ScratchMode::Ring, ScratchMode::Bank]
        } else {
            [ScratchMode::Bank, ScratchMode::Ring]
        };
        for mode in modes {
            let store = Arc::new(ZoneStore::new(
                backing.clone(),
                ZoneConfig {
                    zone_size_bytes: opts.zone_size_bytes,
                    scratch_mode: mode,
                    gc_chunk_bytes: opts.chunk_bytes,
                    gc_buffer_bytes: opts.buffer_bytes,
                    ..ZoneConfig::default()
                },
            )?);
            let owner = fill(&store, objects, 32)?;
            // Untimed: what the fill left in a modelled write cache goes to the media first,
            // so each GC starts on a clean cache.
            backing.flush()?;
            let mut rng = rand::rngs::SmallRng::seed_from_u64(opts.seed + rep as u64);
            let discards = opts.holes.discards(owner.locs.len(), &mut rng);
            for (loc, _) in owner.locs.iter().zip(discards).filter(|(_, d)| *d) {
                let raw = loc.swap(NO_LOC, Ordering::AcqRel);
                if raw != NO_LOC {
                    store.release(ZoneLoc::from_raw(raw));
                }
            }
            let mut queue = backing.new_queue(opts.depth)?;
            let busy_before = model.map(|m| m.stats().busy_us);
            let report = store.gc(&owner, queue.as_mut(), usize::MAX)?;
            drop(queue);
            let device_busy_ms = model
                .zip(busy_before)
                .map(|(m, b)| (m.stats().busy_us - b) as f64 / 1e3);
            // Untimed: a sample of the survivors reads back identical.
            for (slot, loc) in owner.locs.iter().enumerate().step_by(97) {
                let raw = loc.load(Ordering::Acquire);
                if raw == NO_LOC {
                    continue;
                }
                let (_, payload) = store.read_record(ZoneLoc::from_raw(raw), slot as u64)?;
                if payload != objects[slot % objects.len()].0 {
                    return Err(Error::io(format!(
                        "slot {slot} read back different after GC"
                    )));
                }
            }
            store.check();
            if rep == 0 {
                break; // warm-up: one mode is enough
            }
            rows.push(Row {
                mode,
                gc_ms: report.elapsed.as_secs_f64() * 1e3,
                relocate_ms: (report.elapsed - report.flush).as_secs_f64() * 1e3,
                relocated_mb: report.bytes_relocated as f64 / 1e6,
                zones_reclaimed: report.zones_reclaimed,
                records: report.records_relocated,
                device_busy_ms,
            });
        }
    }
    let bw = seq_bandwidth(
        backing.as_ref(),
        uzram::zoned::DEFAULT_GC_CHUNK_BYTES,
        (256u64 << 20).min(backing.size_bytes()),
        opts.depth,
    )?;
    Ok((rows, bw))
}
