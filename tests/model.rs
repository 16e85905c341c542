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
//!   Nothing else may fail.
//! - The canary corrupts the device on purpose (swaps two slots) and the harness must catch it.
//! - Release paths (discard, free notifications) hand objects to the allocator's deferred-free
//!   queue, made small (`deferred_capacity`) so its worker drains while the same slots are
//!   rewritten, compaction moves queued objects, and resets drop pools with objects queued.
//!   The chaos thread also flushes the queue. At the end, after a flush, the allocator's
//!   counters must match the slots exactly, and after discarding everything and flushing they
//!   must be back at zero (no object leaked, none freed twice: a double free panics).

use parking_lot::{Mutex, RwLock};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use uzram::device::{Device, IdleCutoff};
use uzram::ErrorKind;

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
}

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
    dev: Device,
    /// Ops hold it shared; reset holds it exclusive (reset and I/O don't mix on a real device).
    gate: RwLock<()>,
    regions: Vec<Mutex<Region>>,
    failed: AtomicBool,
    done: AtomicBool,
    resets: AtomicU64,
    enomem: AtomicU64,
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
        _ => {
            // text-like, compressible
            const WORDS: [&str; 8] = [
                "zram ", "page ", "slot ", "handle ", "zspage ", "idle ", "huge ", "compact ",
            ];
            let mut pos = 0;
            while pos < page_size {
                let w = WORDS[rng.gen_range(0..WORDS.len())].as_bytes();
                let n = w.len().min(page_size - pos);
                p[pos..pos + n].copy_from_slice(&w[..n]);
                pos += n;
            }
        }
    }
    if p.iter().any(|&b| b != p[0]) || rng.gen_bool(0.5) {
        let v: u64 = rng.gen();
        p[..8].copy_from_slice(&index.to_le_bytes());
        p[8..16].copy_from_slice(&v.to_le_bytes());
    }
    p
}

impl Harness {
    fn new(cfg: ModelConfig) -> Harness {
        let dev = Device::new_uninit(cfg.page_size).expect("create device");
        dev.debug_set_deferred_capacity(cfg.deferred_capacity);
        dev.attr_store("comp_algorithm", cfg.algorithm).unwrap();
        dev.init(disksize(&cfg)).expect("initialise device");
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
            gate: RwLock::new(()),
            regions,
            failed: AtomicBool::new(false),
            done: AtomicBool::new(false),
            resets: AtomicU64::new(0),
            enomem: AtomicU64::new(0),
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
                    let first = rng.gen_range(0..npages);
                    let n = rng.gen_range(1..=4u64).min(npages - first);
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
                // Sub-page and page-crossing writes, sector aligned.
                35..=49 => {
                    let sectors = (npages as usize * ps) / 512;
                    let start = rng.gen_range(0..sectors);
                    let len = rng.gen_range(1..=(ps / 512 + 2)).min(sectors - start);
                    let mut buf = vec![0u8; len * 512];
                    if rng.gen_bool(0.7) {
                        rng.fill(&mut buf[..]);
                    } else {
                        buf.fill(rng.gen());
                    }
                    let off = start * 512;
                    let r = self.dev.write_at(&buf, base * ps as u64 + off as u64);
                    let all_or_none = match &r {
                        Ok(()) => false,
                        Err(e) if e.kind() == ErrorKind::NoMemory => {
                            self.enomem.fetch_add(1, Ordering::Relaxed);
                            true
                        }
                        Err(e) => return self.fail(format!("partial write failed: {e}")),
                    };
                    apply(&mut region, ps, off, &buf, all_or_none);
                }
                // Reads, checked.
                50..=79 => {
                    let sectors = (npages as usize * ps) / 512;
                    let start = rng.gen_range(0..sectors);
                    let len = rng.gen_range(1..=(3 * ps / 512)).min(sectors - start);
                    let mut buf = vec![0u8; len * 512];
                    let off = start * 512;
                    if let Err(e) = self.dev.read_at(&mut buf, base * ps as u64 + off as u64) {
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
                // Write zeroes.
                87..=92 => {
                    let sectors = (npages as usize * ps) / 512;
                    let start = rng.gen_range(0..sectors);
                    let len = rng.gen_range(1..=(3 * ps / 512)).min(sectors - start);
                    let off = start * 512;
                    let zeros = vec![0u8; len * 512];
                    let r = self
                        .dev
                        .write_zeroes(base * ps as u64 + off as u64, (len * 512) as u64);
                    let all_or_none = match &r {
                        Ok(()) => false,
                        Err(e) if e.kind() == ErrorKind::NoMemory => true,
                        Err(e) => return self.fail(format!("write_zeroes failed: {e}")),
                    };
                    apply(&mut region, ps, off, &zeros, all_or_none);
                }
                // Overwrite with the same data as before (exercises free + republish).
                93..=96 => {
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

    /// Device-wide operations racing the workers: compaction, mem_limit changes, resets.
    fn chaos(&self) {
        let mut rng = SmallRng::seed_from_u64(self.cfg.seed.wrapping_add(1));
        while !self.done.load(Ordering::Relaxed) && !self.failed.load(Ordering::Relaxed) {
            match rng.gen_range(0..100) {
                0..=59 => {
                    self.dev.compact();
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
                    self.dev
                        .attr_store("comp_algorithm", self.cfg.algorithm)
                        .unwrap();
                    self.dev
                        .attr_store("disksize", &disksize(&self.cfg).to_string())
                        .unwrap();
                    self.resets.fetch_add(1, Ordering::Relaxed);
                }
                81..=85 => {
                    if rng.gen_bool(0.5) {
                        self.dev.flush_deferred();
                    } else {
                        let _ = uzram::BlockDevice::flush(&self.dev);
                    }
                }
                _ => {
                    let _ = self.dev.attr_show("mm_stat").unwrap();
                    let _ = self.dev.attr_show("deferred_stat").unwrap();
                }
            }
            std::thread::sleep(std::time::Duration::from_micros(rng.gen_range(0..500)));
        }
    }

    /// After a flush the allocator holds exactly one object per slot holding one, then, once
    /// every page is discarded and the queue flushed again, nothing at all.
    fn verify_no_leak(&self) -> Result<(), String> {
        let objects = |dev: &Device| -> u64 {
            dev.pool_stats()
                .expect("initialised")
                .classes
                .iter()
                .map(|c| c.objs_inuse)
                .sum()
        };
        self.dev.flush_deferred();
        let s = self.dev.stats();
        let d = self.dev.deferred_stats();
        if objects(&self.dev) != s.pages_stored - s.same_pages || d.pending != 0 {
            return self.fail(format!(
                "after flush: {} objects for {} stored pages ({} same-filled); {d:?}",
                objects(&self.dev),
                s.pages_stored,
                s.same_pages
            ));
        }
        self.dev
            .discard(0, disksize(&self.cfg))
            .map_err(|e| e.to_string())?;
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
        );
        if back != (0, 0, 0, 0, 0, 0, 0, 0) || d.queued != d.drained {
            return self.fail(format!(
                "after discarding everything and flushing, counters are not back to zero: \
                 mm_stat {} objects {} {d:?}",
                s.mm_stat().trim(),
                objects(&self.dev)
            ));
        }
        Ok(())
    }

    fn verify_all(&self) -> Result<(), String> {
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

/// Applies a write of `data` at byte `off` of a region to the model. When the write failed
/// (`failed_any`), each touched page may have it or not.
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
    result?;
    h.verify_all()?;
    let s = h.dev.stats();
    let d = h.dev.deferred_stats();
    h.verify_no_leak()?;
    Ok(format!(
        "seed {} ok: {} resets, {} ENOMEM writes, {} pages compacted, mm_stat {}, \
         deferred (since the last reset) {d:?}",
        cfg.seed,
        h.resets.load(Ordering::Relaxed),
        h.enomem.load(Ordering::Relaxed),
        s.pages_compacted,
        s.mm_stat().trim()
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
    run_or_panic(ModelConfig::new(4096, "lz4"));
}

#[test]
fn model_4k_zstd() {
    let mut cfg = ModelConfig::new(4096, "zstd");
    cfg.ops_per_thread /= 2;
    run_or_panic(cfg);
}

#[test]
fn model_16k_deflate() {
    let mut cfg = ModelConfig::new(16384, "deflate");
    cfg.pages_per_thread = 32;
    cfg.ops_per_thread /= 3;
    run_or_panic(cfg);
}

#[test]
fn model_64k_lz4() {
    let mut cfg = ModelConfig::new(65536, "lz4");
    cfg.pages_per_thread = 8;
    cfg.ops_per_thread /= 6;
    run_or_panic(cfg);
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
