//! `uzram bench sparse-copy`: copying a sparse device with `nbdcopy`, with and without block
//! status, against nbdkit's memory plugin holding the same data, in the same run.
//!
//! - **The device**: `size` bytes (4 GiB) holding `data` bytes (400 MiB) of real pages (the
//!   corpus's pages that are not same-filled, cycled) in runs of `run` bytes (1 MiB) spread
//!   evenly over it, each starting on a multiple of its size, holes between: what a VM image or a swap device of a mostly idle machine
//!   looks like. It is served by uzram's NBD server (the one `uzram serve` runs, in this
//!   process) on a unix socket.
//! - **The anchor**: `nbdkit memory` (its sparse allocator) of the same size, filled by
//!   `nbdcopy` from the uzram export, so it holds the same bytes at the same offsets.
//! - **A copy**: `nbdcopy URI null:` (libnbd's copier: four connections, 256 KiB requests),
//!   with block status (`base:allocation`: it reads only the extents that hold data) and with
//!   `--no-extents` (it reads everything). Each repeat runs the four copies in turn (uzram and
//!   nbdkit, each mode), so load from elsewhere drifts over all alike; the medians of wall time
//!   (process start to exit) are reported, with the ratio uzram/nbdkit per mode and the ratio
//!   with/without block status per server.
//! - **Bytes read**: uzram's are the device's own count (`stat`'s sectors read × 512) around
//!   each copy; nbdkit's come from its log filter (every `Read` and its count), on a twin of
//!   the anchor holding the same data and copied once per mode, so the timed nbdkit runs
//!   without a filter.

use crate::corpus::Corpus;
use crate::nbd::{have, program_version, start_nbdkit_with, tempfile_dir, Nbdkit};
use crate::{f, median, Table};
use serde_json::json;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;
use uzram::compress::same_filled_word;
use uzram::device::{Device, DeviceConfig};
use uzram::error::{Error, ErrorKind, Result};
use uzram::BlockDevice;
use uzram_service::frontend::nbd::{Export, Server};

/// Options of `uzram bench sparse-copy`.
#[derive(Debug, Clone)]
pub struct SparseCopyOptions {
    /// The device's size.
    pub size_bytes: u64,
    /// Bytes of data it holds (a multiple of the page size).
    pub data_bytes: u64,
    /// Bytes per run of data (a multiple of the page size).
    pub run_bytes: u64,
    /// Copies per mode and server; the median is reported.
    pub repeats: usize,
}

impl Default for SparseCopyOptions {
    fn default() -> SparseCopyOptions {
        SparseCopyOptions {
            size_bytes: 4 << 30,
            data_bytes: 400 << 20,
            run_bytes: 1 << 20,
            repeats: 5,
        }
    }
}

/// The two ways nbdcopy reads a source.
const MODES: [(&str, &[&str]); 2] = [("block-status", &[]), ("no-extents", &["--no-extents"])];

/// `nbdcopy ARGS URI null:`: its wall time in seconds.
fn copy_to_null(uri: &str, args: &[&str]) -> Result<f64> {
    let start = Instant::now();
    let out = Command::new("nbdcopy")
        .args(args)
        .arg(uri)
        .arg("null:")
        .output()
        .map_err(|e| Error::io(format!("running nbdcopy: {e}")))?;
    let secs = start.elapsed().as_secs_f64();
    if !out.status.success() {
        return Err(Error::io(format!(
            "nbdcopy {args:?} {uri} null: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(secs)
}

/// Bytes the device has read since it was made (`stat`'s sectors read × 512).
fn device_bytes_read(device: &Device) -> Result<u64> {
    let stat = device.attr_show("stat")?;
    stat.split_whitespace()
        .nth(2)
        .and_then(|s| s.parse::<u64>().ok())
        .map(|sectors| sectors * 512)
        .ok_or_else(|| Error::io(format!("unreadable stat: {stat:?}")))
}

/// Bytes nbdkit's log filter logged as read (the `count=` of every `Read`).
fn logged_bytes_read(log: &Path) -> Result<u64> {
    let text = std::fs::read_to_string(log)?;
    let mut total = 0;
    for line in text.lines().filter(|l| l.contains(" Read id=")) {
        let count = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("count=0x"))
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or_else(|| Error::io(format!("nbdkit log: no count in {line:?}")))?;
        total += count;
    }
    Ok(total)
}

/// nbdkit's memory plugin of `size_bytes` on `socket`, its log filter writing to `log` if
/// given.
fn nbdkit_memory(socket: &Path, size_bytes: u64, log: Option<&Path>) -> Result<Nbdkit> {
    let mut args = Vec::new();
    if log.is_some() {
        args.push("--filter=log".to_string());
    }
    args.extend([
        "memory".to_string(),
        format!("size={size_bytes}"),
        "allocator=sparse".to_string(),
    ]);
    if let Some(log) = log {
        args.push(format!("logfile={}", log.display()));
    }
    start_nbdkit_with(socket, &args)
}

/// Runs the benchmark on the pages of `corpus`; prints progress and the table, returns the
/// JSON document.
pub fn run(corpus: &Corpus, opts: &SparseCopyOptions) -> Result<serde_json::Value> {
    for program in ["nbdcopy", "nbdkit"] {
        if !have(program) {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("{program} is not installed (Debian packages libnbd-bin, nbdkit)"),
            ));
        }
    }
    let ps = corpus.page_size_bytes() as u64;
    if opts.run_bytes == 0
        || opts.run_bytes % ps != 0
        || opts.data_bytes % opts.run_bytes != 0
        || opts.data_bytes > opts.size_bytes
        || opts.size_bytes % ps != 0
        || opts.repeats == 0
    {
        return Err(Error::invalid(format!(
            "--data ({}) must be a multiple of --run ({}), a multiple of the page size ({ps}), \
             and at most --size ({}), itself a multiple of the page size; --repeats at least 1",
            opts.data_bytes, opts.run_bytes, opts.size_bytes
        )));
    }
    let pages: Vec<&[u8]> = (0..corpus.len())
        .map(|i| corpus.page(i))
        .filter(|p| same_filled_word(p).is_none())
        .collect();
    if pages.is_empty() {
        return Err(Error::invalid(
            "the corpus has no pages that are not same-filled",
        ));
    }
    let progress = |s: &str| eprintln!("bench sparse-copy: {s}");
    let dir = tempfile_dir()?;

    // The device: runs of real pages spread evenly, holes between.
    let device = Arc::new(Device::new(DeviceConfig {
        disksize_bytes: opts.size_bytes,
        page_size_bytes: ps as usize,
        ..Default::default()
    })?);
    let runs = opts.data_bytes / opts.run_bytes;
    // Runs start on multiples of their own size, as a file system's allocation groups do (a
    // run straddling nbdcopy's 256 KiB requests makes it read the whole requests).
    let stride = opts.size_bytes.checked_div(runs).unwrap_or(0);
    let stride = stride / opts.run_bytes * opts.run_bytes;
    let mut next_page = 0;
    let mut buf = Vec::with_capacity(opts.run_bytes as usize);
    for r in 0..runs {
        buf.clear();
        for _ in 0..opts.run_bytes / ps {
            buf.extend_from_slice(pages[next_page % pages.len()]);
            next_page += 1;
        }
        device.write_at(&buf, r * stride)?;
    }
    progress(&format!(
        "{} MiB of real pages in {runs} runs of {} KiB over {} MiB",
        opts.data_bytes >> 20,
        opts.run_bytes >> 10,
        opts.size_bytes >> 20
    ));
    let uzram_socket = dir.path.join("uzram.sock");
    let _server = Server::start_unix(
        Export::new("zram0", device.clone() as Arc<dyn BlockDevice>),
        uzram_socket.clone(),
    )?;
    let uzram_uri = format!("nbd+unix:///zram0?socket={}", uzram_socket.display());

    // The anchor and its logging twin, filled from the uzram export.
    let nbdkit_socket = dir.path.join("nbdkit.sock");
    let _nbdkit = nbdkit_memory(&nbdkit_socket, opts.size_bytes, None)?;
    let nbdkit_uri = format!("nbd+unix:///?socket={}", nbdkit_socket.display());
    let twin_socket = dir.path.join("nbdkit-log.sock");
    let log = dir.path.join("nbdkit.log");
    let twin = nbdkit_memory(&twin_socket, opts.size_bytes, Some(&log))?;
    let twin_uri = format!("nbd+unix:///?socket={}", twin_socket.display());
    for dest in [&nbdkit_uri, &twin_uri] {
        let out = Command::new("nbdcopy")
            .args([&uzram_uri, dest])
            .output()
            .map_err(|e| Error::io(format!("running nbdcopy: {e}")))?;
        if !out.status.success() {
            return Err(Error::io(format!(
                "filling nbdkit: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
    }
    progress("nbdkit memory filled with the same bytes");

    // nbdkit's bytes read per mode, counted once on the twin.
    let mut nbdkit_bytes = Vec::new();
    for (_, args) in MODES {
        let before = logged_bytes_read(&log)?;
        copy_to_null(&twin_uri, args)?;
        nbdkit_bytes.push(logged_bytes_read(&log)? - before);
    }
    drop(twin);

    // The timed copies, interleaved.
    let mut secs = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
    let mut uzram_bytes = [Vec::new(), Vec::new()];
    for rep in 0..opts.repeats {
        for (m, (mode, args)) in MODES.iter().enumerate() {
            let before = device_bytes_read(&device)?;
            secs[0][m].push(copy_to_null(&uzram_uri, args)?);
            uzram_bytes[m].push(device_bytes_read(&device)? - before);
            secs[1][m].push(copy_to_null(&nbdkit_uri, args)?);
            progress(&format!(
                "repeat {}/{}, {mode}: uzram {:.3} s, nbdkit {:.3} s",
                rep + 1,
                opts.repeats,
                secs[0][m][rep],
                secs[1][m][rep]
            ));
        }
    }

    let med = |v: &[f64]| median(v);
    let mut table = Table::new(&[
        "server",
        "mode",
        "bytes read",
        "median s",
        "MB/s of device",
        "vs nbdkit",
    ])
    .left_align(&[1]);
    let mut rows = Vec::new();
    for (s, server) in ["uzram", "nbdkit"].iter().enumerate() {
        for (m, (mode, _)) in MODES.iter().enumerate() {
            let t = med(&secs[s][m]);
            let bytes = if s == 0 {
                // Every copy of a mode reads the same; the median guards against none.
                median(&uzram_bytes[m].iter().map(|&b| b as f64).collect::<Vec<_>>()) as u64
            } else {
                nbdkit_bytes[m]
            };
            let vs = t / med(&secs[1][m]);
            table.row(vec![
                server.to_string(),
                mode.to_string(),
                bytes.to_string(),
                f(t),
                f(opts.size_bytes as f64 / t / 1e6),
                if s == 0 { f(vs) } else { "anchor".into() },
            ]);
            rows.push(json!({
                "server": server,
                "mode": mode,
                "bytes_read": bytes,
                "median_s": t,
                "runs_s": secs[s][m],
                "uzram_over_nbdkit": if s == 0 { Some(vs) } else { None },
            }));
        }
    }
    print!("{}", table.render());
    let speedup = |s: usize| med(&secs[s][1]) / med(&secs[s][0]);
    println!(
        "block status makes the copy {}x faster on uzram, {}x on nbdkit; uzram read {} of {} \
         bytes with it",
        f(speedup(0)),
        f(speedup(1)),
        rows[0]["bytes_read"],
        opts.size_bytes
    );
    Ok(json!({
        "benchmark": "sparse-copy",
        "options": {
            "size_bytes": opts.size_bytes,
            "data_bytes": opts.data_bytes,
            "run_bytes": opts.run_bytes,
            "repeats": opts.repeats,
            "page_size_bytes": ps,
            "command": "nbdcopy [--no-extents] URI null:",
        },
        "environment": {
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "nbdcopy": program_version("nbdcopy", "--version"),
            "nbdkit": program_version("nbdkit", "--version"),
        },
        "rows": rows,
        "uzram_bytes_read_block_status": rows[0]["bytes_read"],
        "uzram_bytes_read_no_extents": rows[1]["bytes_read"],
        "uzram_median_s_block_status": med(&secs[0][0]),
        "uzram_median_s_no_extents": med(&secs[0][1]),
        "nbdkit_bytes_read_block_status": nbdkit_bytes[0],
        "nbdkit_bytes_read_no_extents": nbdkit_bytes[1],
        "nbdkit_median_s_block_status": med(&secs[1][0]),
        "nbdkit_median_s_no_extents": med(&secs[1][1]),
        "block_status_speedup_uzram": speedup(0),
        "block_status_speedup_nbdkit": speedup(1),
    }))
}
