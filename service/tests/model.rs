//! The model test: seeded random operations from several threads against a [`Device`] and a
//! plain map of expected page contents, while compaction, idle marking and `mem_limit` changes
//! run concurrently. Every read is checked, and every page is checked at the end.
//!
//! - `UZRAM_MODEL_SEED=N` replays a run (the seed is printed on failure);
//!   `UZRAM_MODEL_OPS=N` sets the operations per thread.
//! - Each worker thread owns a contiguous region of pages, so its model of that region is exact;
//!   device-wide operations (compact, idle, mem_limit, reset) race with all of them.
//! - A write that fails with `ENOMEM` (the memory limit) may have written some of its pages and
//!   not others, so each page of it keeps both candidates until a read tells which one it is.
//! - Writeback (every mode and range syntax, from workers and from the chaos thread) runs
//!   against a backing device that injects faults: random EIO, torn and short writes, failed
//!   reads, a backing smaller than the device (ENOSPC), and writeback limit changes. A
//!   writeback may fail (`EIO`, `ENOSPC`, `EAGAIN` when another one runs) but must never change
//!   what a page reads back; a read may fail with `EIO` only while read faults are injected (and
//!   then teaches the model nothing; among them reads the backing answers with a flipped byte,
//!   which the checksum must turn into `EIO`), and a partial write that needs a backing read may fail
//!   with `EIO` like a failed `ENOMEM` write. Nothing else may fail.
//! - Zoned configurations (`backing_layout=zoned`, 1 MiB zones, four of them) write back into
//!   the append-only store and run garbage collection (`gc` writes from workers and the chaos
//!   thread, and the trigger after writebacks) under the same faults; GC may fail with `EIO` or
//!   `ENOSPC` but never change what a page reads back, and the store's books must balance (no
//!   live byte left after discarding everything).
//! - Writes, reads and write-zeroes come sector aligned (zram's rule) and at any byte offset
//!   and length (the device's byte-granular forms an NBD client without block sizes uses: a
//!   few bytes either side of a page boundary, runs over several pages); the allocation map
//!   is checked against the model (a page reported as a hole or zeroes must read as zeroes,
//!   the runs must cover the range).
//! - The canary corrupts the device on purpose (swaps two slots) and the harness must catch it.
//! - Release paths (discard, free notifications) hand objects to the allocator's deferred-free
//!   queue, made small (`deferred_capacity`) so its worker drains while the same slots are
//!   rewritten, compaction moves queued objects, and resets drop pools with objects queued.
//!   The chaos thread also flushes the queue. At the end, after a flush, the allocator's
//!   counters must match the slots exactly, and after discarding everything and flushing they
//!   must be back at zero (no object leaked, none freed twice: a double free panics). That last
//!   discard must count each page in `io_stat`'s `notify_free` and one request with all its
//!   sectors in the block layer's `stat`.
//! - With `policies`, the server's policy thread (`uzram_service::policy::PolicyRunner`) runs every
//!   policy on the device meanwhile (idle aging, writeback on age and on pressure that flips
//!   on and off, recompression, compaction, zoned GC), on a clock that a thread moves a
//!   second every few milliseconds (shared with the device's access times, so pages age):
//!   whatever they do, concurrently with I/O, resets and faults, must change no page.
//! - New zspages come from the allocator's reserve of populated frames (its refiller thread
//!   fills it while the workers write), so compaction trims the reserve under a running refill
//!   and resets drop pools whose refiller is running; pages must read back all the same.

use parking_lot::{Mutex, RwLock};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use uzram::backing::{
    Backing, Engine, FaultKind, FaultPlan, FaultyBacking, FileBacking, FileOptions, MemBacking,
    NbdBacking, NbdOptions,
};
use uzram::clock::{Clock, ManualClock};
use uzram::device::{Device, IdleCutoff};
use uzram::{Allocation, ErrorKind};
use uzram_service::policy::{
    DevicePolicy, ManualPressure, PolicyKind, PolicyRunner, PressureSource,
};

/// Where the model's device writes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WbBacking {
    /// A sparse file on the local disk through io_uring (O_DIRECT when supported).
    FileUring,
    /// In memory (synchronous queue).
    Mem,
    /// The real zoned block device `UZRAM_ZONED_DEV` names (inside the VM of
    /// `uzram_testkit::vm`), through io_uring: its own zones, reset and finished on it.
    ZonedDevice,
    /// nbdkit's `memory` plugin over a unix socket, through the NBD client (multi-conn pool,
    /// requests in flight, flushes before completion).
    Nbd,
}

#[derive(Debug, Clone)]
struct ModelConfig {
    seed: u64,
    threads: usize,
    pages_per_thread: u64,
    ops_per_thread: usize,
    page_size: usize,
    algorithm: &'static str,
    /// Swap two slots with different contents midway: the run must then fail.
    canary: bool,
    /// Let the chaos thread reset the device now and then.
    resets: bool,
    /// Capacity of the allocator's deferred-free queue (small: the worker runs often).
    deferred_capacity: usize,
    /// The backing device (always behind a fault injector).
    backing: WbBacking,
    /// `compressed_writeback`.
    compressed_writeback: bool,
    /// `backing_layout=zoned` with 1 MiB zones (the backing then holds [`ZONED_ZONES`] zones),
    /// and `gc` attribute writes from the workers and the chaos thread.
    zoned: bool,
    /// The recompression algorithms of priorities 1, 2, ... (`recomp_algorithm`), used by
    /// `recompress` writes from the workers and the chaos thread.
    recomp: &'static [&'static str],
    /// Give the first recompression priority (zstd) a dictionary (`algorithm_params dict=`).
    dict: bool,
    /// `multi_page_size` (4096: off); with it, half the full-page writes are aligned runs of
    /// one or two objects' worth of pages, some shifted by a page or a page longer.
    multi_page_size: usize,
    /// Run the policy thread with every policy on (see the module documentation).
    policies: bool,
}

/// Zones of the zoned configurations' backing: few, so that writeback fills them, GC has
/// victims and the writer runs into ENOSPC.
const ZONED_ZONES: u64 = 4;

impl ModelConfig {
    fn new(page_size: usize, algorithm: &'static str) -> ModelConfig {
        let seed = std::env::var("UZRAM_MODEL_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| rand::thread_rng().gen());
        let ops = std::env::var("UZRAM_MODEL_OPS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(10_000);
        ModelConfig {
            seed,
            threads: 4,
            pages_per_thread: 96,
            ops_per_thread: ops,
            page_size,
            algorithm,
            canary: false,
            resets: true,
            // 2..=32: from a queue that falls back at every other release to one that drains
            // in batches of 16.
            deferred_capacity: 2 << (seed % 5),
            backing: WbBacking::Mem,
            compressed_writeback: false,
            zoned: false,
            recomp: &["zstd", "deflate"],
            dict: false,
            multi_page_size: 4096,
            policies: false,
        }
    }
}

/// Expected contents of one page: one candidate, or two after a write that failed part-way.
type Candidates = Vec<Vec<u8>>;

struct Region {
    first_page: u64,
    pages: Vec<Candidates>,
}

struct Harness {
    cfg: ModelConfig,
    dev: Arc<Device>,
    /// The device's clock: moved by the policy configurations' clock thread.
    clock: Arc<ManualClock>,
    /// Ops hold it shared; reset holds it exclusive (reset and I/O don't mix on a real device).
    gate: RwLock<()>,
    regions: Vec<Mutex<Region>>,
    failed: AtomicBool,
    done: AtomicBool,
    resets: AtomicU64,
    enomem: AtomicU64,
    backing: Arc<dyn FaultControl>,
    /// Read faults may be injected right now (reads may then fail with EIO). Set before a plan
    /// with read faults is installed, cleared after it is removed.
    read_faults: AtomicBool,
    /// Bumped whenever `read_faults` changes, so an op that overlapped a change knows it.
    read_fault_epoch: AtomicU64,
    writebacks: AtomicU64,
    /// Recompressions that ran (not refused with EAGAIN).
    recompressions: AtomicU64,
    /// Dictionaries trained and installed.
    trainings: AtomicU64,
    written_back: AtomicU64,
    /// Most multi-page objects seen on the backing device after a writeback (a sign that
    /// runs were written back whole at all).
    runs_written_back: AtomicU64,
    wb_errors: AtomicU64,
    gcs: AtomicU64,
    gc_errors: AtomicU64,
    /// Zones reclaimed and records relocated by the chaos thread's library GC calls.
    gc_reclaimed: AtomicU64,
    gc_relocated: AtomicU64,
    read_eio: AtomicU64,
    _dir: Option<tempfile::TempDir>,
    /// The dictionary file (`ModelConfig::dict`), and the directory holding it.
    dict_path: Option<std::path::PathBuf>,
    _dict_dir: Option<tempfile::TempDir>,
    /// The NBD server of [`WbBacking::Nbd`] (killed when the harness drops).
    _server: Option<uzram_testkit::nbd_servers::NbdServer>,
}

/// The fault injector over either backing.
trait FaultControl: Send + Sync {
    fn set_plan(&self, plan: FaultPlan);
    fn backing(self: Arc<Self>) -> Arc<dyn Backing>;
}

impl<B: Backing + 'static> FaultControl for FaultyBacking<B> {
    fn set_plan(&self, plan: FaultPlan) {
        FaultyBacking::set_plan(self, plan)
    }
    fn backing(self: Arc<Self>) -> Arc<dyn Backing> {
        self
    }
}

fn disksize(cfg: &ModelConfig) -> u64 {
    cfg.threads as u64 * cfg.pages_per_thread * cfg.page_size as u64
}

/// Page contents of several kinds, stamped with page index and version where possible so a
/// misplaced page is caught.
fn gen_page(rng: &mut SmallRng, page_size: usize, index: u64) -> Vec<u8> {
    let mut p = vec![0u8; page_size];
    match rng.gen_range(0..10) {
        0 => {} // zero page
        1 => {
            // same-filled with a random word
            let w: u64 = rng.gen();
            for c in p.chunks_exact_mut(8) {
                c.copy_from_slice(&w.to_ne_bytes());
            }
        }
        2 | 3 => rng.fill(&mut p[..]), // incompressible: stored HUGE
        4 => {
            // half random: moderately compressible
            let half = page_size / 2;
            rng.fill(&mut p[..half]);
        }
        _ => p = gen_text(rng, page_size), // text-like, compressible
    }
    if p.iter().any(|&b| b != p[0]) || rng.gen_bool(0.5) {
        let v: u64 = rng.gen();
        p[..8].copy_from_slice(&index.to_le_bytes());
        p[8..16].copy_from_slice(&v.to_le_bytes());
    }
    p
}

/// `len` bytes of text-like data: random words.
fn gen_text(rng: &mut SmallRng, len: usize) -> Vec<u8> {
    const WORDS: [&str; 8] = [
        "zram ", "page ", "slot ", "handle ", "zspage ", "idle ", "huge ", "compact ",
    ];
    let mut p = vec![0u8; len];
    let mut pos = 0;
    while pos < len {
        let w = WORDS[rng.gen_range(0..WORDS.len())].as_bytes();
        let n = w.len().min(len - pos);
        p[pos..pos + n].copy_from_slice(&w[..n]);
        pos += n;
    }
    p
}

/// Sets a fresh device up (also after a reset): backing device, algorithms, dictionary, size.
fn init_device(
    dev: &Device,
    cfg: &ModelConfig,
    backing: &Arc<dyn FaultControl>,
    dict: Option<&std::path::Path>,
) {
    dev.set_backing(backing.clone().backing()).unwrap();
    dev.set_compressed_writeback(cfg.compressed_writeback)
        .unwrap();
    if cfg.zoned {
        dev.attr_store("backing_layout", "zoned").unwrap();
        dev.attr_store("zone_size", "1M").unwrap();
    }
    dev.attr_store("comp_algorithm", cfg.algorithm).unwrap();
    if cfg.multi_page_size != 4096 {
        dev.attr_store("multi_page_size", &cfg.multi_page_size.to_string())
            .unwrap();
    }
    for (i, algo) in cfg.recomp.iter().enumerate() {
        dev.attr_store(
            "recomp_algorithm",
            &format!("algo={algo} priority={}", i + 1),
        )
        .unwrap();
    }
    if let Some(path) = dict {
        dev.attr_store(
            "algorithm_params",
            &format!("priority=1 level=3 dict={}", path.display()),
        )
        .unwrap();
    }
    dev.attr_store("disksize", &disksize(cfg).to_string())
        .unwrap();
}

impl Harness {
    fn new(cfg: ModelConfig) -> Harness {
        // Three quarters of the device's pages fit on the backing: writeback runs out of space.
        let backing_bytes = if cfg.zoned {
            ZONED_ZONES << 20
        } else {
            disksize(&cfg) / 4 * 3
        };
        let mut server = None;
        let (backing, dir): (Arc<dyn FaultControl>, _) = match cfg.backing {
            WbBacking::Nbd => {
                let size = format!("size={backing_bytes}");
                let s = uzram_testkit::nbd_servers::NbdServer::nbdkit(&["memory", &size]);
                let nbd = NbdBacking::open(&s.uri(), &NbdOptions::default())
                    .expect("connecting to nbdkit");
                server = Some(s);
                (Arc::new(FaultyBacking::new(nbd)), None)
            }
            WbBacking::Mem => (
                Arc::new(FaultyBacking::new(MemBacking::new(backing_bytes).unwrap())),
                None,
            ),
            WbBacking::ZonedDevice => {
                let path = std::env::var_os("UZRAM_ZONED_DEV").expect("UZRAM_ZONED_DEV");
                let dev = FileBacking::open(path, &FileOptions::with_engine(Engine::Uring))
                    .expect("opening the zoned device");
                assert!(dev.zone_geometry().is_some(), "not a zoned device");
                (Arc::new(FaultyBacking::new(dev)), None)
            }
            WbBacking::FileUring => {
                let dir = tempfile::tempdir_in("/var/tmp")
                    .unwrap_or_else(|_| tempfile::tempdir().unwrap());
                let file = FileBacking::create(
                    dir.path().join("backing"),
                    backing_bytes,
                    &FileOptions::with_engine(Engine::Uring),
                )
                .unwrap();
                (Arc::new(FaultyBacking::new(file)), Some(dir))
            }
        };
        let clock = Arc::new(ManualClock::new());
        let dev = if cfg.policies {
            Device::new_uninit_with_clock(cfg.page_size, clock.clone() as Arc<dyn Clock>)
        } else {
            Device::new_uninit(cfg.page_size)
        };
        let dev = Arc::new(dev.expect("create device"));
        dev.debug_set_deferred_capacity(cfg.deferred_capacity);
        // A raw-content dictionary of the words text-like pages are made of.
        let dict_dir = cfg.dict.then(|| tempfile::tempdir().unwrap());
        let dict_path = dict_dir.as_ref().map(|d| {
            let path = d.path().join("model.dict");
            let mut rng = SmallRng::seed_from_u64(cfg.seed);
            std::fs::write(&path, gen_text(&mut rng, 16384)).unwrap();
            path
        });
        init_device(&dev, &cfg, &backing, dict_path.as_deref());
        let regions = (0..cfg.threads as u64)
            .map(|t| {
                Mutex::new(Region {
                    first_page: t * cfg.pages_per_thread,
                    pages: vec![vec![vec![0u8; cfg.page_size]]; cfg.pages_per_thread as usize],
                })
            })
            .collect();
        Harness {
            cfg,
            dev,
            clock,
            gate: RwLock::new(()),
            regions,
            failed: AtomicBool::new(false),
            done: AtomicBool::new(false),
            resets: AtomicU64::new(0),
            enomem: AtomicU64::new(0),
            backing,
            read_faults: AtomicBool::new(false),
            read_fault_epoch: AtomicU64::new(0),
            writebacks: AtomicU64::new(0),
            written_back: AtomicU64::new(0),
            runs_written_back: AtomicU64::new(0),
            wb_errors: AtomicU64::new(0),
            gcs: AtomicU64::new(0),
            gc_errors: AtomicU64::new(0),
            gc_reclaimed: AtomicU64::new(0),
            gc_relocated: AtomicU64::new(0),
            recompressions: AtomicU64::new(0),
            trainings: AtomicU64::new(0),
            read_eio: AtomicU64::new(0),
            _dir: dir,
            dict_path,
            _dict_dir: dict_dir,
            _server: server,
        }
    }

    fn fail(&self, msg: String) -> Result<(), String> {
        self.failed.store(true, Ordering::Relaxed);
        Err(msg)
    }

    /// Checks `got` (bytes at page `p`, offset `off` in it) against the candidates, and narrows
    /// them to those that match.
    fn check(
        &self,
        region: &mut Region,
        p: usize,
        off: usize,
        got: &[u8],
        what: &str,
    ) -> Result<(), String> {
        let cands = &mut region.pages[p];
        let before = cands.len();
        cands.retain(|c| &c[off..off + got.len()] == got);
        if cands.is_empty() {
            let page = region.first_page + p as u64;
            let first_bad = got.iter().position(|&b| b != 0).unwrap_or(0);
            return self.fail(format!(
                "{what}: page {page} bytes {off}..{} match none of {before} expected versions \
                 (first bytes read: {:02x?}, first nonzero at {first_bad})",
                off + got.len(),
                &got[..16.min(got.len())]
            ));
        }
        Ok(())
    }

    fn worker(&self, t: usize) -> Result<(), String> {
        let mut rng =
            SmallRng::seed_from_u64(self.cfg.seed ^ (t as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let ps = self.cfg.page_size;
        let npages = self.cfg.pages_per_thread;
        for op_no in 0..self.cfg.ops_per_thread {
            if self.failed.load(Ordering::Relaxed) {
                return Ok(());
            }
            let _gate = self.gate.read();
            let mut region = self.regions[t].lock();
            let base = region.first_page;
            let op = rng.gen_range(0..100);
            let rf = self.read_fault_snapshot();
            if self.cfg.canary && t == 0 && op_no == self.cfg.ops_per_thread / 2 {
                // Corrupt: swap two pages of this region whose expected contents differ.
                for a in 0..npages as usize {
                    for b in a + 1..npages as usize {
                        if region.pages[a].len() == 1
                            && region.pages[b].len() == 1
                            && region.pages[a][0] != region.pages[b][0]
                        {
                            self.dev
                                .debug_swap_slots(base + a as u64, base + b as u64)
                                .unwrap();
                            return Ok(());
                        }
                    }
                }
            }
            match op {
                // Full-page writes of 1..=4 pages.
                0..=34 => {
                    let mp = (self.cfg.multi_page_size / ps) as u64;
                    let (first, n) = if mp > 1 && rng.gen_bool(0.5) {
                        // Regions start on a run boundary (pages_per_thread is a multiple).
                        let first = (rng.gen_range(0..npages / mp) * mp)
                            .saturating_sub(rng.gen_range(0..4) / 3);
                        let n = mp * rng.gen_range(1..=2) + rng.gen_range(0..4) / 3;
                        (first, n.min(npages - first))
                    } else {
                        let first = rng.gen_range(0..npages);
                        (first, rng.gen_range(1..=4u64).min(npages - first))
                    };
                    let pages: Vec<Vec<u8>> = (0..n)
                        .map(|i| gen_page(&mut rng, ps, base + first + i))
                        .collect();
                    let buf = pages.concat();
                    match self.dev.write_at(&buf, (base + first) * ps as u64) {
                        Ok(()) => {
                            for (i, pg) in pages.into_iter().enumerate() {
                                region.pages[first as usize + i] = vec![pg];
                            }
                        }
                        Err(e) if e.kind() == ErrorKind::NoMemory => {
                            self.enomem.fetch_add(1, Ordering::Relaxed);
                            for (i, pg) in pages.into_iter().enumerate() {
                                let c = &mut region.pages[first as usize + i];
                                if !c.contains(&pg) {
                                    c.push(pg);
                                }
                            }
                        }
                        Err(e) => return self.fail(format!("write failed: {e}")),
                    }
                }
                // Sub-page and page-crossing writes, sector aligned or (as from an NBD client
                // that negotiated no block size) at any byte offset and length.
                35..=49 => {
                    let bytes = rng.gen_bool(0.4);
                    let (off, len) =
                        random_range(&mut rng, npages as usize * ps, ps, ps + 1024, bytes);
                    let mut buf = vec![0u8; len];
                    if rng.gen_bool(0.7) {
                        rng.fill(&mut buf[..]);
                    } else {
                        buf.fill(rng.gen());
                    }
                    let at = base * ps as u64 + off as u64;
                    let r = if bytes {
                        self.dev.write_bytes_at(&buf, at)
                    } else {
                        self.dev.write_at(&buf, at)
                    };
                    let all_or_none = match &r {
                        Ok(()) => false,
                        Err(e) if e.kind() == ErrorKind::NoMemory => {
                            self.enomem.fetch_add(1, Ordering::Relaxed);
                            true
                        }
                        Err(e) if self.read_eio_allowed(e, rf) => true,
                        Err(e) => return self.fail(format!("partial write failed: {e}")),
                    };
                    apply(&mut region, ps, off, &buf, all_or_none);
                }
                // The allocation map: a page reported as a hole or as zeroes must read as
                // zeroes, and the runs cover the range.
                50..=54 => {
                    let (off, len) = random_range(&mut rng, npages as usize * ps, ps, 3 * ps, true);
                    let at = base * ps as u64 + off as u64;
                    let mut extents = Vec::new();
                    if let Err(e) = self
                        .dev
                        .allocation(at, len as u64, usize::MAX, &mut extents)
                    {
                        return self.fail(format!("allocation failed: {e}"));
                    }
                    let covered: u64 = extents.iter().map(|e| e.len_bytes).sum();
                    if covered != len as u64 {
                        return self.fail(format!(
                            "allocation of {at}+{len} covers {covered} bytes: {extents:?}"
                        ));
                    }
                    let zero = vec![0u8; ps];
                    let mut pos = off;
                    for e in &extents {
                        let end = pos + e.len_bytes as usize;
                        if e.allocation != Allocation::Data {
                            while pos < end {
                                let (p, in_page) = (pos / ps, pos % ps);
                                let n = (ps - in_page).min(end - pos);
                                let what = format!("allocation {:?}", e.allocation);
                                self.check(&mut region, p, in_page, &zero[..n], &what)?;
                                pos += n;
                            }
                        }
                        pos = end;
                    }
                }
                // Reads, checked: sector aligned or at any byte offset and length.
                55..=79 => {
                    let bytes = rng.gen_bool(0.4);
                    let (off, len) =
                        random_range(&mut rng, npages as usize * ps, ps, 3 * ps, bytes);
                    let mut buf = vec![0u8; len];
                    let at = base * ps as u64 + off as u64;
                    let r = if bytes {
                        self.dev.read_bytes_at(&mut buf, at)
                    } else {
                        self.dev.read_at(&mut buf, at)
                    };
                    if let Err(e) = r {
                        if self.read_eio_allowed(&e, rf) {
                            continue;
                        }
                        return self.fail(format!("read failed: {e}"));
                    }
                    let mut pos = 0;
                    while pos < buf.len() {
                        let abs = off + pos;
                        let (p, in_page) = (abs / ps, abs % ps);
                        let n = (ps - in_page).min(buf.len() - pos);
                        self.check(&mut region, p, in_page, &buf[pos..pos + n], "read")?;
                        pos += n;
                    }
                }
                // Discard: whole pages in the range become zero, partial pages stay.
                80..=86 => {
                    let sectors = (npages as usize * ps) / 512;
                    let start = rng.gen_range(0..sectors);
                    let len = rng.gen_range(1..=(3 * ps / 512)).min(sectors - start);
                    let off = start * 512;
                    if let Err(e) = self
                        .dev
                        .discard(base * ps as u64 + off as u64, (len * 512) as u64)
                    {
                        return self.fail(format!("discard failed: {e}"));
                    }
                    let first_full = off.div_ceil(ps);
                    let end_full = (off + len * 512) / ps;
                    for p in first_full..end_full.max(first_full) {
                        region.pages[p] = vec![vec![0u8; ps]];
                    }
                }
                // Write zeroes, sector aligned or at any byte offset and length.
                87..=92 => {
                    let bytes = rng.gen_bool(0.4);
                    let (off, len) =
                        random_range(&mut rng, npages as usize * ps, ps, 3 * ps, bytes);
                    let zeros = vec![0u8; len];
                    let at = base * ps as u64 + off as u64;
                    let r = if bytes {
                        self.dev.write_zeroes_bytes(at, len as u64)
                    } else {
                        self.dev.write_zeroes(at, len as u64)
                    };
                    let all_or_none = match &r {
                        Ok(()) => false,
                        Err(e) if e.kind() == ErrorKind::NoMemory => true,
                        Err(e) if self.read_eio_allowed(e, rf) => true,
                        Err(e) => return self.fail(format!("write_zeroes failed: {e}")),
                    };
                    apply(&mut region, ps, off, &zeros, all_or_none);
                }
                // Overwrite with the same data as before (exercises free + republish).
                93..=95 => {
                    let p = rng.gen_range(0..npages as usize);
                    if region.pages[p].len() == 1 {
                        let data = region.pages[p][0].clone();
                        match self.dev.write_at(&data, (base + p as u64) * ps as u64) {
                            Ok(()) => {}
                            Err(e) if e.kind() == ErrorKind::NoMemory => {}
                            Err(e) => return self.fail(format!("rewrite failed: {e}")),
                        }
                    }
                }
                // A swap frontend's free notification: the page becomes zeroes, or (if the slot
                // was locked by an idle scan just then: miss_free) keeps its contents.
                97 => {
                    let p = rng.gen_range(0..npages as usize);
                    if let Err(e) = self.dev.slot_free_notify(base + p as u64) {
                        return self.fail(format!("free notify failed: {e}"));
                    }
                    let zero = vec![0u8; ps];
                    let c = &mut region.pages[p];
                    if !c.contains(&zero) {
                        c.push(zero);
                    }
                }
                // Writeback from a worker, racing the other workers' I/O (and their writebacks:
                // EAGAIN). Its own region is locked, so its pages change only through others'
                // writebacks, which must not change what they read back.
                96 | 98 => {
                    let spec = random_writeback(&mut rng, base, npages);
                    self.writeback(&spec)?;
                }
                // GC from a worker (zoned), racing everything else.
                _ if self.cfg.zoned && rng.gen_bool(0.5) => self.gc()?,
                // Recompression from a worker, racing the other workers' I/O, writebacks and
                // GC (EAGAIN while a writeback runs). Its own region is locked, so its pages
                // change only through others' recompressions, which must not change what they
                // read back.
                _ if rng.gen_bool(0.4) => {
                    let spec = random_recompress(&mut rng, &self.cfg);
                    self.recompress(&spec)?;
                }
                // Idle marking from a worker, racing other workers' I/O.
                _ => {
                    if rng.gen_bool(0.5) {
                        self.dev.mark_idle(IdleCutoff::All);
                    } else {
                        self.dev
                            .mark_idle(IdleCutoff::OlderThanSecs(rng.gen_range(0..3)));
                    }
                }
            }
        }
        Ok(())
    }

    /// Where the read-fault flag stood when an op started.
    fn read_fault_snapshot(&self) -> (bool, u64) {
        (
            self.read_faults.load(Ordering::SeqCst),
            self.read_fault_epoch.load(Ordering::SeqCst),
        )
    }

    /// Turns read faults on (before installing `plan`) or off (after removing them).
    fn set_fault_plan(&self, plan: FaultPlan, reads_fail: bool) {
        if reads_fail {
            self.read_faults.store(true, Ordering::SeqCst);
            self.read_fault_epoch.fetch_add(1, Ordering::SeqCst);
            self.backing.set_plan(plan);
        } else {
            self.backing.set_plan(plan);
            self.read_faults.store(false, Ordering::SeqCst);
            self.read_fault_epoch.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// True if `e` is a read failure a fault plan in force during the op (which started at
    /// `snap`) may have caused.
    fn read_eio_allowed(&self, e: &uzram::Error, snap: (bool, u64)) -> bool {
        let now = self.read_fault_snapshot();
        let ok = e.kind() == ErrorKind::Io && (snap.0 || now.0 || snap.1 != now.1);
        if ok {
            self.read_eio.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// Runs one writeback; the errors writeback may return are fine, anything else fails.
    fn writeback(&self, spec: &str) -> Result<(), String> {
        let before = self.dev.stats().bd_writes;
        match self.dev.attr_store("writeback", spec) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::Io | ErrorKind::NoSpace | ErrorKind::Again
                ) =>
            {
                self.wb_errors.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return self.fail(format!("writeback {spec:?} failed: {e}")),
        }
        self.writebacks.fetch_add(1, Ordering::Relaxed);
        let after = self.dev.stats();
        self.written_back
            .fetch_add(after.bd_writes.saturating_sub(before), Ordering::Relaxed);
        self.runs_written_back
            .fetch_max(after.multi_wb_objects, Ordering::Relaxed);
        Ok(())
    }

    /// Runs one recompression; only `EAGAIN` (a writeback or another recompression running)
    /// may fail it.
    fn recompress(&self, spec: &str) -> Result<(), String> {
        match self.dev.attr_store("recompress", spec) {
            Ok(()) => {
                self.recompressions.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) if e.kind() == ErrorKind::Again => {}
            Err(e) => return self.fail(format!("recompress {spec:?} failed: {e}")),
        }
        Ok(())
    }

    /// Runs the `gc` attribute (zoned configurations): it may fail with `EIO` (injected
    /// faults) or `ENOSPC` (the GC zone filled), never change what a page reads back.
    fn gc(&self) -> Result<(), String> {
        match self.dev.attr_store("gc", "1") {
            Ok(()) => {
                self.gcs.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) if matches!(e.kind(), ErrorKind::Io | ErrorKind::NoSpace) => {
                self.gc_errors.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => return self.fail(format!("gc failed: {e}")),
        }
        Ok(())
    }

    /// Device-wide operations racing the workers: compaction, mem_limit changes, writeback,
    /// writeback limits, backing faults, resets.
    fn chaos(&self) {
        let mut rng = SmallRng::seed_from_u64(self.cfg.seed.wrapping_add(1));
        let total_pages = self.cfg.threads as u64 * self.cfg.pages_per_thread;
        while !self.done.load(Ordering::Relaxed) && !self.failed.load(Ordering::Relaxed) {
            match rng.gen_range(0..100) {
                0..=39 => {
                    self.dev.compact();
                }
                40..=45 if self.cfg.zoned => {
                    // The attribute, or the library call (which reports what it moved).
                    if rng.gen_bool(0.5) {
                        if self.gc().is_err() {
                            return;
                        }
                    } else {
                        match self.dev.gc() {
                            Ok(r) => {
                                self.gcs.fetch_add(1, Ordering::Relaxed);
                                self.gc_reclaimed
                                    .fetch_add(r.zones_reclaimed, Ordering::Relaxed);
                                self.gc_relocated
                                    .fetch_add(r.records_relocated, Ordering::Relaxed);
                            }
                            Err(e) if matches!(e.kind(), ErrorKind::Io | ErrorKind::NoSpace) => {
                                self.gc_errors.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                let _ = self.fail(format!("gc failed: {e}"));
                                return;
                            }
                        }
                    }
                }
                40..=51 => {
                    let spec = random_writeback(&mut rng, 0, total_pages);
                    if self.writeback(&spec).is_err() {
                        return;
                    }
                }
                52..=55 => {
                    // Limit changes: off, generous, or nearly exhausted.
                    let (enable, limit) = match rng.gen_range(0..3) {
                        0 => ("0", 0),
                        1 => ("1", rng.gen_range(0..1000u64)),
                        _ => ("1", rng.gen_range(0..4u64)),
                    };
                    self.dev
                        .attr_store("writeback_limit", &limit.to_string())
                        .unwrap();
                    self.dev
                        .attr_store("writeback_limit_enable", enable)
                        .unwrap();
                    let batch = [1u32, 2, 4, 32, 64][rng.gen_range(0..5)];
                    self.dev
                        .attr_store("writeback_batch_size", &batch.to_string())
                        .unwrap();
                }
                56..=59 => {
                    // Backing faults: none, random write faults of one kind, corrupted reads, or
                    // read faults.
                    let seed = rng.gen();
                    let kind = [
                        FaultKind::Eio,
                        FaultKind::Torn,
                        FaultKind::Short,
                        FaultKind::NoSpace,
                    ][rng.gen_range(0..4)];
                    match rng.gen_range(0..5) {
                        0 | 1 => self.set_fault_plan(FaultPlan::new(), false),
                        2 => self.set_fault_plan(
                            FaultPlan::new().fail_writes_randomly(5, kind, seed),
                            false,
                        ),
                        // A backing that returns other bytes than were written (one read in
                        // four): the checksum must turn each into EIO, never wrong data.
                        3 => self
                            .set_fault_plan(FaultPlan::new().corrupt_reads_randomly(4, seed), true),
                        _ => {
                            let mut plan = FaultPlan::new();
                            for n in 0..64 {
                                if rng.gen_ratio(1, 4) {
                                    plan = plan.fail_read(n + 1);
                                }
                            }
                            self.set_fault_plan(plan, true);
                        }
                    }
                }
                60..=79 => {
                    // A limit a little above what is used now: some writes will hit it.
                    let used = self.dev.stats().mem_used_total_bytes;
                    let extra = rng.gen_range(0..8u64) * self.cfg.page_size as u64;
                    self.dev
                        .attr_store("mem_limit", &format!("{}\n", used + extra))
                        .unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    self.dev.attr_store("mem_limit", "0\n").unwrap();
                }
                // Rare: a reset wipes what compaction and idle marking need to work on.
                80 if self.cfg.resets && rng.gen_ratio(1, 5) => {
                    let _gate = self.gate.write();
                    for r in &self.regions {
                        let mut r = r.lock();
                        for p in r.pages.iter_mut() {
                            *p = vec![vec![0u8; self.cfg.page_size]];
                        }
                    }
                    self.dev.attr_store("reset", "1\n").unwrap();
                    init_device(
                        &self.dev,
                        &self.cfg,
                        &self.backing,
                        self.dict_path.as_deref(),
                    );
                    self.resets.fetch_add(1, Ordering::Relaxed);
                }
                86..=90 => {
                    let spec = random_recompress(&mut rng, &self.cfg);
                    if self.recompress(&spec).is_err() {
                        return;
                    }
                }
                // Retraining priority 1's dictionary from the pages now stored, racing every
                // other path: a new generation while pages of the older ones are read,
                // rewritten, written back, relocated and released.
                91..=93 if self.cfg.recomp.first() == Some(&"zstd") => {
                    let size = [1024, 4096, 16384][rng.gen_range(0..3)];
                    let spec = format!("dict_size={size} samples={}", rng.gen_range(8..256));
                    match self.dev.attr_store("train_dict", &spec) {
                        Ok(()) => {
                            self.trainings.fetch_add(1, Ordering::Relaxed);
                        }
                        // EAGAIN: a writeback or recompression runs; EBUSY: every generation
                        // still holds pages; EINVAL: too few or too alike pages to learn from.
                        Err(e)
                            if matches!(
                                e.kind(),
                                ErrorKind::Again | ErrorKind::Busy | ErrorKind::InvalidArgument
                            ) => {}
                        Err(e) => {
                            let _ = self.fail(format!("train_dict {spec:?} failed: {e}"));
                            return;
                        }
                    }
                }
                81..=85 => {
                    if rng.gen_bool(0.5) {
                        self.dev.flush_deferred();
                    } else {
                        let _ = uzram::BlockDevice::flush(&*self.dev);
                    }
                }
                _ => {
                    let _ = self.dev.attr_show("mm_stat").unwrap();
                    let _ = self.dev.attr_show("deferred_stat").unwrap();
                    // Takes every class lock in turn, while the other threads work.
                    let _ = self.dev.attr_show("meta_stat").unwrap();
                }
            }
            std::thread::sleep(std::time::Duration::from_micros(rng.gen_range(0..500)));
        }
    }

    /// After a flush the allocator holds exactly one object per slot holding one, then, once
    /// every page is discarded and the queue flushed again, nothing at all.
    fn verify_no_leak(&self) -> Result<(), String> {
        // Objects in classes, less the tails of runs (objects larger than 4 KiB, with 16 and
        // 64 KiB pages), plus the runs themselves.
        let objects = |dev: &Device| -> u64 {
            let p = dev.pool_stats().expect("initialised");
            p.classes.iter().map(|c| c.objs_inuse).sum::<u64>() - p.spans.tails + p.spans.spans
        };
        self.dev.flush_deferred();
        let s = self.dev.stats();
        let d = self.dev.deferred_stats();
        // Same-filled and written-back slots hold no allocator object (`bd_count` is in 4 KiB
        // units, as zram's bd_stat; a written-back page takes one page-sized block, a
        // written-back multi-page object the blocks `multi_wb_blocks` counts).
        let wb_pages =
            s.bd_count * 4096 / self.cfg.page_size as u64 - s.multi_wb_blocks + s.multi_wb_pages;
        // A multi-page object is one object for all the pages pointing into it.
        let expected = s.pages_stored - s.same_pages - wb_pages - s.multi_pages + s.multi_objects;
        if objects(&self.dev) != expected || d.pending != 0 {
            return self.fail(format!(
                "after flush: {} objects for {} stored pages ({} same-filled, {} written back); \
                 {d:?}",
                objects(&self.dev),
                s.pages_stored,
                s.same_pages,
                wb_pages
            ));
        }
        // zram counts every whole page of a discard in io_stat's notify_free, and the block
        // layer the request and its sectors in `stat`: read both around the last discard.
        let stat = |dev: &Device| -> Vec<u64> {
            let t = dev.attr_show("stat").unwrap();
            t.split_whitespace().map(|w| w.parse().unwrap()).collect()
        };
        let (freed0, stat0) = (self.dev.stats().notify_free, stat(&self.dev));
        self.dev
            .discard(0, disksize(&self.cfg))
            .map_err(|e| e.to_string())?;
        let (freed1, stat1) = (self.dev.stats().notify_free, stat(&self.dev));
        let pages = disksize(&self.cfg) / self.cfg.page_size as u64;
        if freed1 - freed0 != pages
            || stat1[11] - stat0[11] != 1
            || stat1[13] - stat0[13] != disksize(&self.cfg) / 512
        {
            return self.fail(format!(
                "discarding the {pages} pages: notify_free {freed0} -> {freed1}, stat {stat0:?}                  -> {stat1:?}"
            ));
        }
        self.dev.flush_deferred();
        let s = self.dev.stats();
        let d = self.dev.deferred_stats();
        let back = (
            s.pages_stored,
            s.orig_data_size_bytes,
            s.compr_data_size_bytes,
            s.mem_used_total_bytes,
            s.same_pages,
            s.huge_pages,
            objects(&self.dev),
            d.pending,
            s.bd_count,
        );
        self.dev.debug_check_zones();
        let live = self.dev.zone_stats().map_or(0, |z| z.live_bytes);
        if back != (0, 0, 0, 0, 0, 0, 0, 0, 0) || d.queued != d.drained || live != 0 {
            return self.fail(format!(
                "after discarding everything and flushing, counters are not back to zero: \
                 mm_stat {} bd_stat {} live zoned bytes {live} objects {} {d:?}",
                s.mm_stat().trim(),
                s.bd_stat().trim(),
                objects(&self.dev)
            ));
        }
        // No page names a dictionary generation any more: only each priority's current one is
        // held, by no page (a count left over is a generation leaked or released twice).
        for prio in 1..=self.cfg.recomp.len() {
            let g = self.dev.dict_generations(prio).expect("configured");
            if g.held.len() != 1 || (g.held[0].0, g.held[0].1) != (g.current, 0) {
                return self.fail(format!(
                    "after discarding everything, priority {prio} holds generations {g:?}"
                ));
            }
        }
        Ok(())
    }

    fn verify_all(&self) -> Result<(), String> {
        self.set_fault_plan(FaultPlan::new(), false);
        self.dev.debug_check_zones();
        let ps = self.cfg.page_size;
        for r in &self.regions {
            let mut r = r.lock();
            for p in 0..r.pages.len() {
                let mut buf = vec![0u8; ps];
                let off = (r.first_page + p as u64) * ps as u64;
                self.dev
                    .read_at(&mut buf, off)
                    .map_err(|e| format!("final read: {e}"))?;
                self.check(&mut r, p, 0, &buf, "final check")?;
            }
        }
        Ok(())
    }
}

/// A random `writeback` value: a mode over the device, a page or an inclusive range inside
/// `base..base + pages`, or several of them.
fn random_writeback(rng: &mut SmallRng, base: u64, pages: u64) -> String {
    const MODES: [&str; 4] = ["idle", "huge", "huge_idle", "incompressible"];
    let mode = MODES[rng.gen_range(0..MODES.len())];
    let page = |rng: &mut SmallRng| base + rng.gen_range(0..pages);
    match rng.gen_range(0..6) {
        0 => mode.to_string(),
        1 => format!("type={mode}"),
        2 => format!("page_index={}", page(rng)),
        3 => {
            let a = page(rng);
            let b = a + rng.gen_range(0..pages.min(32)).min(base + pages - 1 - a);
            format!("page_indexes={a}-{b}")
        }
        4 => {
            let a = page(rng);
            format!("page_index={} page_indexes={a}-{a} type={mode}", page(rng))
        }
        _ => {
            let a = page(rng);
            format!("page_indexes={a}-{}", base + pages - 1)
        }
    }
}

/// A random `recompress` value: any type or none, sometimes a page budget, a threshold, or one
/// algorithm (by name or priority) among those configured.
fn random_recompress(rng: &mut SmallRng, cfg: &ModelConfig) -> String {
    let mut spec = Vec::new();
    match rng.gen_range(0..4) {
        0 => {}
        1 => spec.push("type=idle".to_string()),
        2 => spec.push("type=huge".to_string()),
        _ => spec.push("type=huge_idle".to_string()),
    }
    if rng.gen_bool(0.3) {
        spec.push(format!("max_pages={}", rng.gen_range(0..64)));
    }
    if rng.gen_bool(0.3) {
        // Below the huge threshold (a little under 3/4 of a page for every page size).
        spec.push(format!("threshold={}", rng.gen_range(0..cfg.page_size / 2)));
    }
    match rng.gen_range(0..4) {
        0 => spec.push(format!(
            "algo={}",
            cfg.recomp[rng.gen_range(0..cfg.recomp.len())]
        )),
        1 => spec.push(format!("priority={}", rng.gen_range(0..=cfg.recomp.len()))),
        _ => {}
    }
    spec.join(" ")
}

/// Applies a write of `data` at byte `off` of a region to the model. When the write failed
/// (`failed_any`), each touched page may have it or not.
/// A range `(offset, len)` inside `region_bytes`, `len` at most `max_len`: whole sectors, or
/// any bytes (`bytes`), the offset then often a few bytes either side of a boundary of pages
/// of `page_bytes`, the length often a few bytes.
fn random_range(
    rng: &mut SmallRng,
    region_bytes: usize,
    page_bytes: usize,
    max_len: usize,
    bytes: bool,
) -> (usize, usize) {
    if !bytes {
        let sectors = region_bytes / 512;
        let start = rng.gen_range(0..sectors);
        let len = rng.gen_range(1..=max_len / 512).min(sectors - start);
        return (start * 512, len * 512);
    }
    let off = if rng.gen_bool(0.3) {
        let boundary = rng.gen_range(1..region_bytes / page_bytes) * page_bytes;
        (boundary + rng.gen_range(0..16)).saturating_sub(8)
    } else {
        rng.gen_range(0..region_bytes)
    };
    let len = if rng.gen_bool(0.3) {
        rng.gen_range(1..=16)
    } else {
        rng.gen_range(1..=max_len)
    };
    (off, len.min(region_bytes - off))
}

fn apply(region: &mut Region, ps: usize, off: usize, data: &[u8], failed_any: bool) {
    let mut pos = 0;
    while pos < data.len() {
        let abs = off + pos;
        let (p, in_page) = (abs / ps, abs % ps);
        let n = (ps - in_page).min(data.len() - pos);
        let cands = &mut region.pages[p];
        let mut new: Candidates = Vec::new();
        for c in cands.iter() {
            let mut m = c.clone();
            m[in_page..in_page + n].copy_from_slice(&data[pos..pos + n]);
            if !new.contains(&m) {
                new.push(m);
            }
        }
        if failed_any {
            for c in cands.iter() {
                if !new.contains(c) {
                    new.push(c.clone());
                }
            }
        }
        *cands = new;
        pos += n;
    }
}

fn run_model(cfg: ModelConfig) -> Result<String, String> {
    let h = Arc::new(Harness::new(cfg.clone()));
    let chaos = {
        let h = h.clone();
        std::thread::spawn(move || h.chaos())
    };
    let workers: Vec<_> = (0..cfg.threads)
        .map(|t| {
            let h = h.clone();
            std::thread::spawn(move || h.worker(t))
        })
        .collect();
    // The policy thread, and a thread moving its clock and flipping the memory pressure.
    let policies = cfg.policies.then(|| {
        let policy = Arc::new(DevicePolicy::new("model", Arc::clone(&h.dev)));
        let zoned_gc = if cfg.zoned { " gc_free_zones=3" } else { "" };
        policy
            .store(&format!(
                "period_s=2 idle_age_s=3 writeback_age_s=5 writeback_pressure_age_s=1 \
                 pressure_avg10=50 recompress_age_s=4 recompress_max_pages=32 \
                 compact_ratio=1.02{zoned_gc}"
            ))
            .unwrap();
        let pressure = Arc::new(ManualPressure::new());
        let runner = PolicyRunner::start(
            vec![Arc::clone(&policy)],
            h.clock.clone() as Arc<dyn Clock>,
            pressure.clone() as Arc<dyn PressureSource>,
            std::time::Duration::from_millis(1),
        )
        .unwrap();
        let h2 = h.clone();
        let mover = std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(h2.cfg.seed ^ 0x9011c7);
            while !h2.done.load(Ordering::Relaxed) {
                h2.clock.advance(std::time::Duration::from_secs(1));
                pressure.set(if rng.gen_ratio(1, 4) { 80.0 } else { 0.0 });
                std::thread::sleep(std::time::Duration::from_millis(3));
            }
        });
        (policy, runner, mover)
    });
    let mut result = Ok(());
    for w in workers {
        let r = w
            .join()
            .map_err(|_| "worker panicked".to_string())
            .and_then(|r| r);
        if result.is_ok() {
            result = r;
        }
    }
    h.done.store(true, Ordering::Relaxed);
    chaos
        .join()
        .map_err(|_| "chaos thread panicked".to_string())?;
    let policy_stat = match policies {
        Some((policy, runner, mover)) => {
            runner.stop();
            mover
                .join()
                .map_err(|_| "clock thread panicked".to_string())?;
            let runs: u64 = PolicyKind::ALL
                .iter()
                .map(|&k| policy.counters(k).runs)
                .sum();
            if runs == 0 {
                return Err("the policy thread never acted".to_string());
            }
            format!(", policy_stat {:?}", policy.show_stat())
        }
        None => String::new(),
    };
    result?;
    h.verify_all()?;
    let s = h.dev.stats();
    let d = h.dev.deferred_stats();
    let zone_stat = h.dev.attr_show("zone_stat").map_err(|e| e.to_string())?;
    h.verify_no_leak()?;
    Ok(format!(
        "seed {} ok: {} resets, {} ENOMEM writes, {} pages compacted, {} writebacks ({} failed) \
         wrote {} pages, {} gc ({} failed; chaos's reclaimed {} zones, relocated {} records), \
         {} recompressions (recomp_stat since the last reset {}), {} dictionaries trained \
         (dict_stat {:?}), {} reads failed by injected faults, mm_stat {}, multi_stat {} {} \
         (at most {} written back after a writeback), \
         bd_stat {}, bd_checksum_errors {} (since the last reset), zone_stat {}, deferred \
         (since the last reset) {d:?}{policy_stat}",
        cfg.seed,
        h.resets.load(Ordering::Relaxed),
        h.enomem.load(Ordering::Relaxed),
        s.pages_compacted,
        h.writebacks.load(Ordering::Relaxed),
        h.wb_errors.load(Ordering::Relaxed),
        h.written_back.load(Ordering::Relaxed),
        h.gcs.load(Ordering::Relaxed),
        h.gc_errors.load(Ordering::Relaxed),
        h.gc_reclaimed.load(Ordering::Relaxed),
        h.gc_relocated.load(Ordering::Relaxed),
        h.recompressions.load(Ordering::Relaxed),
        h.dev
            .attr_show("recomp_stat")
            .map_err(|e| e.to_string())?
            .trim(),
        h.trainings.load(Ordering::Relaxed),
        h.dev
            .attr_show("dict_stat")
            .map_err(|e| e.to_string())?
            .trim(),
        h.read_eio.load(Ordering::Relaxed),
        s.mm_stat().trim(),
        s.multi_objects,
        s.multi_pages,
        h.runs_written_back.load(Ordering::Relaxed),
        s.bd_stat().trim(),
        s.bd_checksum_errors,
        zone_stat.trim()
    ))
}

fn run_or_panic(cfg: ModelConfig) {
    let seed = cfg.seed;
    match run_model(cfg) {
        Ok(summary) => eprintln!("{summary}"),
        Err(e) => panic!("model test failed: {e}\nreplay with UZRAM_MODEL_SEED={seed}"),
    }
}

#[test]
fn model_4k_lz4() {
    let mut cfg = ModelConfig::new(4096, "lz4");
    cfg.backing = WbBacking::FileUring;
    cfg.dict = true;
    run_or_panic(cfg);
}

#[test]
fn model_4k_zstd() {
    let mut cfg = ModelConfig::new(4096, "zstd");
    cfg.ops_per_thread /= 2;
    cfg.compressed_writeback = true;
    // Secondaries that seldom beat zstd: most tries end INCOMPRESSIBLE.
    cfg.recomp = &["deflate", "lz4hc"];
    run_or_panic(cfg);
}

#[test]
fn model_4k_lz4_compressed_writeback_uring() {
    let mut cfg = ModelConfig::new(4096, "lz4");
    cfg.ops_per_thread /= 2;
    cfg.backing = WbBacking::FileUring;
    cfg.compressed_writeback = true;
    run_or_panic(cfg);
}

#[test]
fn model_16k_deflate() {
    let mut cfg = ModelConfig::new(16384, "deflate");
    cfg.pages_per_thread = 32;
    cfg.ops_per_thread /= 3;
    run_or_panic(cfg);
}

/// `multi_page_size` 64K on a 4 KiB device: runs of 16 pages as one object, broken up by 4 KiB
/// and sub-page writes, discards, frees, recompression, compaction and resets; written back
/// whole (runs of adjacent blocks; single pages compressed or not) and read back.
#[test]
fn model_4k_lz4_multi_64k() {
    let mut cfg = ModelConfig::new(4096, "lz4");
    cfg.multi_page_size = 65536;
    cfg.compressed_writeback = cfg.seed % 2 == 0;
    run_or_panic(cfg);
}

/// `multi_page_size` 16K with zstd, written back to the zoned layout (a run is one record
/// naming its group's first slot; GC moves the group's pages together).
#[test]
fn model_4k_zstd_multi_16k_zoned() {
    let mut cfg = ModelConfig::new(4096, "zstd");
    cfg.multi_page_size = 16384;
    cfg.pages_per_thread = 160;
    cfg.zoned = true;
    run_or_panic(cfg);
}

#[test]
fn model_64k_lz4() {
    let mut cfg = ModelConfig::new(65536, "lz4");
    cfg.pages_per_thread = 8;
    cfg.ops_per_thread /= 6;
    run_or_panic(cfg);
}

/// Writeback and read-back through the NBD client to nbdkit's memory plugin, with every
/// injected fault (above the client) and compressed writeback.
#[test]
fn model_4k_lz4_nbd() {
    let mut cfg = ModelConfig::new(4096, "lz4");
    cfg.ops_per_thread /= 2;
    cfg.backing = WbBacking::Nbd;
    cfg.compressed_writeback = cfg.seed % 2 == 0;
    run_or_panic(cfg);
}

/// Zoned writeback over NBD: GC's queued reads and writes, and trims of reset zones.
#[test]
fn model_4k_lz4_zoned_nbd() {
    let mut cfg = ModelConfig::new(4096, "lz4");
    cfg.ops_per_thread /= 3;
    cfg.pages_per_thread = 160;
    cfg.backing = WbBacking::Nbd;
    cfg.zoned = true;
    run_or_panic(cfg);
}

/// Zoned writeback, read-back and GC (attribute writes from workers and chaos, and the
/// trigger after writebacks) over memory, with every injected fault; and the policy thread
/// with every policy on, zoned GC among them.
#[test]
fn model_4k_lz4_zoned() {
    let mut cfg = ModelConfig::new(4096, "lz4");
    cfg.ops_per_thread /= 2;
    cfg.pages_per_thread = 160;
    cfg.zoned = true;
    cfg.dict = true;
    cfg.policies = true;
    run_or_panic(cfg);
}

/// The policy thread with every policy on (idle aging, writeback on age and pressure,
/// recompression, compaction) over a real file through io_uring, with every injected fault.
#[test]
fn model_4k_lz4_policies() {
    let mut cfg = ModelConfig::new(4096, "lz4");
    cfg.ops_per_thread /= 2;
    cfg.backing = WbBacking::FileUring;
    cfg.policies = true;
    run_or_panic(cfg);
}

/// The same over a real file through io_uring.
#[test]
fn model_4k_zstd_zoned_uring() {
    let mut cfg = ModelConfig::new(4096, "zstd");
    cfg.ops_per_thread /= 2;
    cfg.pages_per_thread = 160;
    cfg.backing = WbBacking::FileUring;
    cfg.zoned = true;
    run_or_panic(cfg);
}

/// The same on a real zoned block device (1 MiB zones, four of them, as above): a zoned
/// `null_blk` in a VM, its zones reset at every setup and by GC, finished when left early,
/// written strictly in write-pointer order, with every injected fault. The device completes
/// I/O after 100 us from a timer with 4 request slots and no I/O scheduler: the setting in
/// which Linux 6.1 reorders several writes in flight to one zone (uzram's queue must not let
/// it). Fewer operations: the VM may run under emulation.
#[test]
fn model_4k_lz4_zoned_blkdev() {
    if uzram_testkit::vm::zoned_device_or_boot(
        "model_4k_lz4_zoned_blkdev",
        &[
            &["--zone-size-mb", "1", "--zones", "4", "--block-size", "512"],
            uzram_testkit::vm::REORDERING_DEVICE,
        ]
        .concat(),
    )
    .is_some()
    {
        let mut cfg = ModelConfig::new(4096, "lz4");
        cfg.ops_per_thread /= 4;
        cfg.pages_per_thread = 160;
        cfg.backing = WbBacking::ZonedDevice;
        cfg.zoned = true;
        run_or_panic(cfg);
    }
}

/// The harness must be able to fail: a device corrupted on purpose is caught.
#[test]
fn model_canary_is_caught() {
    let mut cfg = ModelConfig::new(4096, "lz4");
    cfg.canary = true;
    cfg.resets = false;
    cfg.ops_per_thread = 400;
    let seed = cfg.seed;
    match run_model(cfg) {
        Ok(s) => {
            panic!("the canary corrupted the device but the model test passed: {s} (seed {seed})")
        }
        Err(e) => eprintln!("canary caught as it must be: {e}"),
    }
}
