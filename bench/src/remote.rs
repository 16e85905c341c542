//! `uzram bench writeback --backing nbd://…`: batched writeback to a backing on an NBD server
//! (docs/remote-backing.md) against the same writeback to a local file directly, in the same
//! run.
//!
//! For each batch size, on a fresh device each time: fill from the corpus, mark idle, time
//! `writeback idle` to the NBD export (bitmap store, sequential layout), then the same to
//! `compare_file` (prepared once: created and written through; batch 1 on the synchronous
//! engine, larger batches on io_uring, as `uzram bench writeback` does). Medians of `repeats`.
//! The figures asked for: NBD over the file at each batch (nbdkit's `file` plugin on the same
//! disk: the protocol's cost), and NBD batched over NBD batch 1 (nbdkit's `delay` filter at
//! 1 ms a request: what requests in flight buy on a network round trip).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::corpus::Corpus;
use crate::writeback::{
    engine_for, open_backing, prepare_backing, timed_writeback, Layout, Sample, Target,
};
use crate::{f, median, Table};
use uzram::backing::{Backing, NbdBacking, NbdOptions};
use uzram::{Error, Result};

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
        "nbd / file",
        "nbd x batch 1",
        "writes",
    ]);
    let (mut nbd_json, mut file_json, mut ratio_json, mut speedup_json) = (
        serde_json::Map::new(),
        serde_json::Map::new(),
        serde_json::Map::new(),
        serde_json::Map::new(),
    );
    for &batch in &opts.batch_sizes {
        let n = med(("nbd", batch)).unwrap_or(f64::NAN);
        let file = med(("file", batch));
        let ratio = file.map_or(f64::NAN, |fl| n / fl);
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
            f(ratio),
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
        if info.flags & uzram::frontend::nbd::protocol::TFLAG_SEND_FLUSH != 0 {
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
        "nbd_speedup_vs_batch1": speedup_json,
    }))
}
