//! `uzram bench writeback --backing nbd://…`: batched writeback to a backing on an NBD server
//! (docs/remote-backing.md) against the same writeback to a local file directly, in the same
//! run.
//!
//! For each batch size, on a fresh device each time: fill from the corpus, mark idle, time
//! `writeback idle` to the NBD export (bitmap store, sequential layout), then the same to
//! `compare_file` (prepared once: created and written through; batch 1 on the synchronous
//! engine, larger batches on io_uring, as `uzram bench writeback` does). Medians of `repeats`.
//! The file is written twice per batch size: as the writeback engine writes it (no flush: its
//! pages count as written back once the device has them, which may be in its cache), and with
//! the durability the NBD queue gives ([`FlushedBacking`]: a write counts once an `fdatasync`
//! after it returned, flushes batched by the NBD queue's own policy). The
//! second is the like-with-like anchor: NBD over it at each batch (nbdkit's `file` plugin on
//! the same disk: the protocol's cost). And NBD batched over NBD batch 1 (nbdkit's `delay`
//! filter at 1 ms a request: what requests in flight buy on a network round trip).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::corpus::Corpus;
use crate::writeback::{
    engine_for, open_backing, prepare_backing, timed_writeback, Layout, Sample, Target,
};
use crate::{f, median, Table};
use uzram::backing::{
    Backing, IoCompletion, IoKind, IoOp, IoQueue, NbdBacking, NbdOptions, SubmitResult,
};
use uzram::{Error, Result};

/// A backing whose queued writes complete only once a flush sent after them returned, with
/// the NBD queue's policy (`src/backing/nbd/mod.rs`): completed writes wait; one flush
/// (`fdatasync`) covers them all, made when the caller must wait and no write is left in
/// flight, or half the queue's depth waits for one; a failed flush fails them. The direct
/// file with the durability, and the flush count, the NBD queue gives a written-back page.
#[derive(Debug)]
struct FlushedBacking<B>(B);

impl<B: Backing> Backing for FlushedBacking<B> {
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0.read_at(buf, offset)
    }
    fn writev_at(&self, bufs: &[&[u8]], offset: u64) -> Result<()> {
        self.0.writev_at(bufs, offset)?;
        self.0.flush()
    }
    fn flush(&self) -> Result<()> {
        self.0.flush()
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn new_queue(&self, depth: usize) -> Result<Box<dyn IoQueue + '_>> {
        Ok(Box::new(FlushedQueue {
            inner: self.0.new_queue(depth)?,
            backing: &self.0,
            held: Vec::new(),
            ready: Vec::new(),
        }))
    }
}

/// [`FlushedBacking`]'s queue.
#[derive(Debug)]
struct FlushedQueue<'a> {
    inner: Box<dyn IoQueue + 'a>,
    backing: &'a dyn Backing,
    /// Writes completed, waiting for a flush.
    held: Vec<IoCompletion>,
    /// Finished, to be returned.
    ready: Vec<IoCompletion>,
}

impl FlushedQueue<'_> {
    fn file(&mut self, done: Vec<IoCompletion>) {
        for c in done {
            if c.op.kind == IoKind::Write && c.result.is_ok() {
                self.held.push(c);
            } else {
                self.ready.push(c);
            }
        }
    }

    fn flush_held(&mut self) {
        let result = self.backing.flush();
        for mut c in self.held.drain(..) {
            if let Err(e) = &result {
                c.result = Err(e.clone());
            }
            self.ready.push(c);
        }
    }
}

impl IoQueue for FlushedQueue<'_> {
    fn depth(&self) -> usize {
        self.inner.depth()
    }
    fn submit(&mut self, op: IoOp) -> SubmitResult {
        if self.in_flight() >= self.depth() {
            return Err((Error::invalid("queue full"), op));
        }
        self.inner.submit(op)
    }
    fn wait(&mut self, min_complete: usize) -> Result<Vec<IoCompletion>> {
        let done = self.inner.wait(0)?;
        self.file(done);
        loop {
            if self.ready.len() >= min_complete.min(self.in_flight()) {
                break;
            }
            let on_wire = self.inner.in_flight();
            if !self.held.is_empty() && (on_wire == 0 || 2 * self.held.len() >= self.depth()) {
                self.flush_held();
                continue;
            }
            let done = self.inner.wait(1)?;
            self.file(done);
        }
        Ok(std::mem::take(&mut self.ready))
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held.len() + self.ready.len()
    }
}

/// Options of the NBD writeback benchmark.
#[derive(Debug, Clone)]
pub struct RemoteBenchOptions {
    /// The export (`nbd://…` or `nbd+unix://…`).
    pub uri: String,
    /// The local file written directly for comparison (created, written through, removed at
    /// the end); `None`: no comparison.
    pub compare_file: Option<PathBuf>,
    /// Pages in the device (the corpus is cycled).
    pub pages: usize,
    /// Batch sizes.
    pub batch_sizes: Vec<usize>,
    /// Repetitions (medians reported).
    pub repeats: usize,
    /// Progress bar.
    pub progress: bool,
}

/// Runs it, prints the table, returns the JSON document.
pub fn run(corpus: &Corpus, opts: &RemoteBenchOptions) -> Result<Value> {
    let ps = corpus.page_size_bytes();
    if corpus.is_empty() || opts.pages == 0 {
        return Err(Error::invalid("no pages to write back"));
    }
    if opts.batch_sizes.is_empty() || opts.batch_sizes.contains(&0) {
        return Err(Error::invalid("batch sizes must be at least 1"));
    }
    let need_bytes = (opts.pages as u64 + 64) * ps as u64;
    let probe = NbdBacking::open(&opts.uri, &NbdOptions::default())?;
    if probe.size_bytes() < need_bytes {
        return Err(Error::invalid(format!(
            "the export {} holds {} bytes; {} pages need {need_bytes}",
            opts.uri,
            probe.size_bytes(),
            opts.pages
        )));
    }
    let info = probe.export_info();
    let connections = probe.connection_count();
    drop(probe);
    if let Some(file) = &opts.compare_file {
        prepare_backing(file, need_bytes)?;
    }
    let target = Target::Bitmap(Layout::Sequential);
    let reps = opts.repeats.max(1);
    // (backing, batch) -> samples
    let mut samples: BTreeMap<(&'static str, usize), Vec<Sample>> = BTreeMap::new();
    for rep in 0..reps {
        for &batch in &opts.batch_sizes {
            let nbd: Arc<dyn Backing> =
                Arc::new(NbdBacking::open(&opts.uri, &NbdOptions::default())?);
            let s = timed_writeback(corpus, opts.pages, opts.progress, nbd, target, batch, 0)?;
            eprintln!(
                "  run {}/{reps}: nbd  batch {batch:>3}: {:>9} pages/s, {} pages in {} writes",
                rep + 1,
                f(s.pages_per_s),
                s.written,
                s.ops
            );
            samples.entry(("nbd", batch)).or_default().push(s);
            if let Some(file) = &opts.compare_file {
                let b = Arc::new(open_backing(file, engine_for(batch))?);
                let s = timed_writeback(corpus, opts.pages, opts.progress, b, target, batch, 0)?;
                eprintln!(
                    "  run {}/{reps}: file batch {batch:>3} ({}): {:>9} pages/s",
                    rep + 1,
                    engine_for(batch).name(),
                    f(s.pages_per_s)
                );
                samples.entry(("file", batch)).or_default().push(s);
                let b = Arc::new(FlushedBacking(open_backing(file, engine_for(batch))?));
                let s = timed_writeback(corpus, opts.pages, opts.progress, b, target, batch, 0)?;
                eprintln!(
                    "  run {}/{reps}: file batch {batch:>3} ({}, batched fdatasync): {:>9} pages/s",
                    rep + 1,
                    engine_for(batch).name(),
                    f(s.pages_per_s)
                );
                samples.entry(("file+flush", batch)).or_default().push(s);
            }
        }
    }
    if let Some(file) = &opts.compare_file {
        let _ = std::fs::remove_file(file);
    }
    let med = |key: (&'static str, usize)| {
        samples
            .get(&key)
            .map(|v| median(&v.iter().map(|s| s.pages_per_s).collect::<Vec<_>>()))
    };
    let nbd1 = med(("nbd", 1));
    let mut table = Table::new(&[
        "batch",
        "nbd pages/s",
        "file pages/s",
        "file+flush pages/s",
        "nbd / file",
        "nbd / file+flush",
        "nbd x batch 1",
        "writes",
    ]);
    let (mut nbd_json, mut file_json, mut ratio_json, mut speedup_json) = (
        serde_json::Map::new(),
        serde_json::Map::new(),
        serde_json::Map::new(),
        serde_json::Map::new(),
    );
    let (mut flushed_json, mut flushed_ratio_json) =
        (serde_json::Map::new(), serde_json::Map::new());
    for &batch in &opts.batch_sizes {
        let n = med(("nbd", batch)).unwrap_or(f64::NAN);
        let file = med(("file", batch));
        let ratio = file.map_or(f64::NAN, |fl| n / fl);
        let flushed = med(("file+flush", batch));
        let flushed_ratio = flushed.map_or(f64::NAN, |fl| n / fl);
        if let Some(fl) = flushed {
            flushed_json.insert(batch.to_string(), json!(fl));
            flushed_ratio_json.insert(batch.to_string(), json!(flushed_ratio));
        }
        let x = nbd1.map_or(f64::NAN, |b| n / b);
        nbd_json.insert(batch.to_string(), json!(n));
        if let Some(fl) = file {
            file_json.insert(batch.to_string(), json!(fl));
            ratio_json.insert(batch.to_string(), json!(ratio));
        }
        if nbd1.is_some() {
            speedup_json.insert(batch.to_string(), json!(x));
        }
        table.row(vec![
            batch.to_string(),
            f(n),
            file.map_or("-".into(), f),
            flushed.map_or("-".into(), f),
            f(ratio),
            f(flushed_ratio),
            f(x),
            samples[&("nbd", batch)][0].ops.to_string(),
        ]);
    }
    let written = samples.values().next().map_or(0, |v| v[0].written);
    println!(
        "writeback of {} pages ({written} written) to {} ({} connection(s), flush {}), \
         against {}, median of {reps}",
        opts.pages,
        opts.uri,
        connections,
        if info.flags & uzram_nbd_proto::TFLAG_SEND_FLUSH != 0 {
            "before completion"
        } else {
            "not advertised"
        },
        opts.compare_file
            .as_ref()
            .map_or("nothing".to_string(), |p| p.display().to_string())
    );
    println!("{}", table.render());
    Ok(json!({
        "benchmark": "writeback-nbd",
        "uri": opts.uri,
        "connections": connections,
        "transmission_flags": info.flags,
        "compare_file": opts.compare_file.as_ref().map(|p| p.display().to_string()),
        "page_size_bytes": ps,
        "pages": opts.pages,
        "written_pages": written,
        "repeats": reps,
        "nbd_pages_per_s": nbd_json,
        "file_pages_per_s": file_json,
        "nbd_over_file": ratio_json,
        "file_flushed_pages_per_s": flushed_json,
        "nbd_over_file_flushed": flushed_ratio_json,
        "nbd_speedup_vs_batch1": speedup_json,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_run_against_nbdkit_writes_json() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap_or_else(|_| tempfile::tempdir().unwrap());
        let socket = dir.path().join("nbd.sock");
        let pidfile = dir.path().join("pid");
        let mut nbdkit = std::process::Command::new("nbdkit")
            .args(["--foreground", "--exit-with-parent", "--unix"])
            .arg(&socket)
            .arg("--pidfile")
            .arg(&pidfile)
            .args(["memory", "size=16M"])
            .spawn()
            .expect("nbdkit must be installed (scripts/debian-packages.txt)");
        let start = std::time::Instant::now();
        while !std::fs::metadata(&pidfile).is_ok_and(|m| m.len() > 0) {
            assert!(start.elapsed().as_secs() < 20, "nbdkit did not start");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let mut corpus = Corpus::new(4096).unwrap();
        let pages: Vec<u8> = (0..32 * 4096u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 | (i % 7 == 0) as u8)
            .collect();
        corpus.add_source("test", &pages).unwrap();
        let opts = RemoteBenchOptions {
            uri: format!("nbd+unix:///?socket={}", socket.display()),
            compare_file: Some(dir.path().join("direct")),
            pages: 200,
            batch_sizes: vec![1, 8],
            repeats: 1,
            progress: false,
        };
        let doc = run(&corpus, &opts);
        let _ = nbdkit.kill();
        let _ = nbdkit.wait();
        let doc = doc.unwrap();
        for key in [
            "nbd_pages_per_s",
            "file_pages_per_s",
            "nbd_over_file",
            "file_flushed_pages_per_s",
            "nbd_over_file_flushed",
        ] {
            for batch in ["1", "8"] {
                assert!(doc[key][batch].as_f64().unwrap() > 0.0, "{key} {batch}");
            }
        }
        assert!(doc["nbd_speedup_vs_batch1"]["8"].as_f64().unwrap() > 0.0);
        assert_eq!(doc["written_pages"].as_u64().unwrap(), 200);
        assert!(
            !dir.path().join("direct").exists(),
            "the compare file is removed"
        );
    }
}
