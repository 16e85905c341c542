//! `uzram bench restart`: the time from a `kill -9` of the serving process to the first
//! request its successor serves, for a device holding real pages (docs/restart.md).
//!
//! `uzram serve --keeper` (the `uzram` binary beside this one) serves one device on a unix
//! socket; the device is filled over NBD with the corpus's pages (cycled) up to the size
//! asked; then, `repeats` times, the serving child is killed with SIGKILL and a new NBD
//! connection is tried every millisecond until a 4 KiB read at offset 0 succeeds: the time
//! from the kill to that read's reply is one sample (the keeper's restart, the new process's
//! start, the device's recovery, the socket bound, the handshake, the read). Each kill after
//! the first waits until the child has served for the keeper's `STABLE` time, so each gets the
//! keeper's immediate restart, as a crash after a while does. After the last restart every page is
//! read back and compared.
//!
//! The anchor, in the same run: the same for a device holding nothing (the fixed cost of a
//! restart); the target is 0.2 s + 0.1 s per GiB stored.
//!
//! With `--vhost-user` the sample is a VM guest's instead: the server also serves the device
//! on its vhost-user socket, to which the test kit's virtio-blk driver (QEMU's part and the
//! guest's, `uzram_testkit::virtio_blk`) is connected with an inflight region; at each kill,
//! once the child is gone, the driver offers a 4 KiB read at offset 0 on its ring, then
//! reconnects every millisecond (QEMU's `reconnect-ms`, at its shortest) handing over the
//! region, and the sample ends when the read completes (the new server's queue starts and
//! serves what waits in its ring).

use crate::corpus::Corpus;
use crate::nbd::tempfile_dir;
use crate::{f, median, Table};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use uzram::backing::nbd::{NbdBacking, NbdOptions};
use uzram::backing::Backing;
use uzram::error::{Error, Result};
use uzram_testkit::virtio_blk::{Completion, DriverConfig, Request, VhostUserBlk, Virtqueue, S_OK};

/// Options of `uzram bench restart`.
#[derive(Debug, Clone)]
pub struct RestartBenchOptions {
    /// Bytes of pages to store, one device per size; 0 (the anchor) is always measured first.
    pub sizes_bytes: Vec<u64>,
    /// Kills per size (the median is reported).
    pub repeats: usize,
    /// Algorithm the device compresses with.
    pub codec: String,
    /// Measure the first request served to a vhost-user front end reconnecting, instead of
    /// a new NBD connection's.
    pub vhost_user: bool,
}

impl Default for RestartBenchOptions {
    fn default() -> Self {
        RestartBenchOptions {
            sizes_bytes: vec![1 << 30],
            repeats: 3,
            codec: "lz4".into(),
            vhost_user: false,
        }
    }
}

/// Bytes per NBD write while filling.
const FILL_CHUNK_BYTES: usize = 1 << 20;

/// A running `uzram serve --keeper`; killed (with its child) when dropped.
struct Keeper {
    proc: Child,
    socket: PathBuf,
    /// The vhost-user socket (served with `--vhost-user`).
    vhost_socket: PathBuf,
}

impl Keeper {
    fn start(
        uzram: &Path,
        dir: &Path,
        disksize: u64,
        codec: &str,
        vhost_user: bool,
    ) -> Result<Keeper> {
        let socket = dir.join("zram0.sock");
        let vhost_socket = dir.join("zram0.vhost.sock");
        let log = std::fs::File::create(dir.join("log"))?;
        let mut proc = Command::new(uzram)
            .args(["serve", "--keeper", "--disksize"])
            .arg(disksize.to_string())
            .args(["--algorithm", codec, "--socket"])
            .arg(&socket)
            .args(vhost_user.then_some("--vhost-user"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()?;
        let out = proc.stdout.take().expect("piped");
        let mut keeper = Keeper {
            proc,
            socket,
            vhost_socket,
        };
        let mut lines = BufReader::new(out).lines();
        if !lines
            .by_ref()
            .map_while(|l| l.ok())
            .any(|l| l.starts_with("serving"))
        {
            let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
            keeper.stop();
            return Err(Error::io(format!(
                "uzram serve --keeper did not serve: {log}"
            )));
        }
        // Keep reading its output, so that a new child's banner never meets a full pipe.
        std::thread::spawn(move || for _ in lines.map_while(|l| l.ok()) {});
        Ok(keeper)
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///zram0?socket={}", self.socket.display())
    }

    /// The serving child's pid.
    fn child(&self) -> Result<u32> {
        let pid = self.proc.id();
        let text = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))?;
        text.split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| Error::io("the keeper has no child"))
    }

    fn stop(&mut self) {
        if let Ok(c) = self.child() {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(c as libc::pid_t, libc::SIGKILL) };
        }
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.stop();
    }
}

fn connect(uri: &str, timeout: Duration) -> Result<NbdBacking> {
    NbdBacking::open(
        uri,
        &NbdOptions {
            request_timeout: timeout,
            connections: 1,
            ..NbdOptions::default()
        },
    )
}

/// Kills the serving child; the time until a new connection's first read is answered.
fn restart_once(k: &Keeper) -> Result<Duration> {
    let child = k.child()?;
    let uri = k.uri();
    let mut page = vec![0u8; 4096];
    let start = Instant::now();
    // SAFETY: kill has no memory preconditions.
    unsafe { libc::kill(child as libc::pid_t, libc::SIGKILL) };
    loop {
        if let Ok(c) = connect(&uri, Duration::from_secs(30)) {
            if c.read_at(&mut page, 0).is_ok() {
                return Ok(start.elapsed());
            }
        }
        if start.elapsed() > Duration::from_secs(120) {
            return Err(Error::io("no server 120 s after the kill"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether process `pid` is gone (or a zombie): it serves nothing more.
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit_once(") ")
            .map_or(true, |(_, r)| r.starts_with('Z'))
    })
}

/// Kills the serving child; the time until a read offered on the driver's ring once the child
/// is gone completes, the driver reconnecting every millisecond.
fn restart_once_vhost(
    k: &Keeper,
    blk: &mut VhostUserBlk,
    queues: &mut [Virtqueue],
) -> Result<Duration> {
    let child = k.child()?;
    let start = Instant::now();
    let late = |what: &str| {
        if start.elapsed() > Duration::from_secs(120) {
            Err(Error::io(format!("{what} 120 s after the kill")))
        } else {
            Ok(())
        }
    };
    // SAFETY: kill has no memory preconditions.
    unsafe { libc::kill(child as libc::pid_t, libc::SIGKILL) };
    while !gone(child) {
        late("the killed server still runs")?;
        std::thread::sleep(Duration::from_micros(100));
    }
    let vq = &mut queues[0];
    let slot = vq
        .submit(&Request::read(0, 4096))
        .ok_or_else(|| Error::io("no free slot on the ring"))?;
    vq.notify()?;
    while blk.reconnect(&k.vhost_socket, queues).is_err() {
        late("no vhost-user server")?;
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut done: Vec<Completion> = Vec::new();
    loop {
        done.clear();
        queues[0].wait(&mut done, Duration::from_secs(30))?;
        if let Some(c) = done.iter().find(|c| c.slot == slot) {
            if c.status != S_OK {
                return Err(Error::io(format!(
                    "the read came back with status {}",
                    c.status
                )));
            }
            return Ok(start.elapsed());
        }
        late("the read offered at the kill not served")?;
    }
}

/// One size: fill, `repeats` restarts, verify. Its JSON row.
fn measure(
    uzram: &Path,
    corpus: &Corpus,
    bytes: u64,
    opts: &RestartBenchOptions,
) -> Result<serde_json::Value> {
    let ps = corpus.page_size_bytes();
    let pages = (bytes / ps as u64) as usize;
    let dir = tempfile_dir()?;
    let disksize = (bytes + (64 << 20)).next_multiple_of(1 << 20);
    let k = Keeper::start(uzram, &dir.path, disksize, &opts.codec, opts.vhost_user)?;
    let fill_start = Instant::now();
    {
        let c = connect(&k.uri(), Duration::from_secs(30))?;
        let mut buf = Vec::with_capacity(FILL_CHUNK_BYTES);
        let mut offset = 0u64;
        for p in corpus.cycle(pages) {
            buf.extend_from_slice(p);
            if buf.len() == FILL_CHUNK_BYTES {
                c.write_at(&buf, offset)?;
                offset += buf.len() as u64;
                buf.clear();
            }
        }
        if !buf.is_empty() {
            c.write_at(&buf, offset)?;
        }
        c.flush()?;
    }
    let fill_s = fill_start.elapsed().as_secs_f64();
    let mm = mm_stat(uzram, &dir.path)?;
    let mut vhost = if opts.vhost_user {
        let cfg = DriverConfig {
            queues: 1,
            inflight: true,
            ..DriverConfig::default()
        };
        Some(VhostUserBlk::connect(&k.vhost_socket, &cfg)?)
    } else {
        None
    };
    let mut samples = Vec::new();
    let mut restarted: Option<Instant> = None;
    for _ in 0..opts.repeats {
        // The keeper restarts at once a first child, or one that served for STABLE.
        if let Some(at) = restarted {
            let wait = uzram_service::keeper::STABLE + Duration::from_millis(200);
            std::thread::sleep(wait.saturating_sub(at.elapsed()));
        }
        let t = match &mut vhost {
            Some((blk, queues)) => restart_once_vhost(&k, blk, queues)?,
            None => restart_once(&k)?,
        };
        restarted = Some(Instant::now());
        eprintln!(
            "bench restart: {} MiB stored: kill to first read {:.1} ms{}",
            bytes >> 20,
            t.as_secs_f64() * 1e3,
            if opts.vhost_user { " (vhost-user)" } else { "" }
        );
        samples.push(t.as_secs_f64());
    }
    // Every page back, as written.
    let c = connect(&k.uri(), Duration::from_secs(30))?;
    let mut buf = vec![0u8; FILL_CHUNK_BYTES];
    let mut expected = corpus.cycle(pages);
    let mut offset = 0u64;
    let mut left = pages * ps;
    while left > 0 {
        let n = left.min(FILL_CHUNK_BYTES);
        c.read_at(&mut buf[..n], offset)?;
        for got in buf[..n].chunks(ps) {
            if got != expected.next().expect("as many pages as written") {
                return Err(Error::io(format!(
                    "a page near offset {offset} does not read back after the restarts"
                )));
            }
        }
        offset += n as u64;
        left -= n;
    }
    let gib = (pages * ps) as f64 / (1u64 << 30) as f64;
    Ok(json!({
        "stored_bytes": pages * ps,
        "stored_gib": gib,
        "orig_data_size": mm.first(),
        "compr_data_size": mm.get(1),
        "mem_used_total": mm.get(2),
        "fill_s": fill_s,
        "restart_s": samples,
        "restart_median_s": median(&samples),
        "target_s": 0.2 + 0.1 * gib,
        "verified_pages": pages,
    }))
}

fn mm_stat(uzram: &Path, dir: &Path) -> Result<Vec<u64>> {
    let o = Command::new(uzram)
        .arg("ctl")
        .arg("--dir")
        .arg(dir)
        .args(["--dev", "zram0", "mm_stat"])
        .output()?;
    Ok(String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect())
}

/// Runs the benchmark; prints progress and the table, returns the JSON document.
pub fn run(corpus: &Corpus, opts: &RestartBenchOptions) -> Result<serde_json::Value> {
    let uzram = std::env::current_exe()?
        .parent()
        .map(|d| d.join("uzram"))
        .filter(|p| p.is_file())
        .ok_or_else(|| {
            Error::io("no uzram binary beside uzram-bench (cargo build -p uzram-cli)")
        })?;
    let mut rows = Vec::new();
    for &bytes in std::iter::once(&0).chain(opts.sizes_bytes.iter().filter(|&&b| b > 0)) {
        rows.push(measure(&uzram, corpus, bytes, opts)?);
    }
    let mut t = Table::new(&[
        "stored",
        "mem_used",
        "fill s",
        "kill to first read ms (median)",
        "min..max ms",
        "target ms",
    ]);
    for r in &rows {
        let s: Vec<f64> = r["restart_s"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
            .unwrap_or_default();
        let min = s.iter().copied().fold(f64::INFINITY, f64::min);
        let max = s.iter().copied().fold(0.0, f64::max);
        t.row(vec![
            format!("{} MiB", r["stored_bytes"].as_u64().unwrap_or(0) >> 20),
            format!("{} MiB", r["mem_used_total"].as_u64().unwrap_or(0) >> 20),
            f(r["fill_s"].as_f64().unwrap_or(f64::NAN)),
            f(r["restart_median_s"].as_f64().unwrap_or(f64::NAN) * 1e3),
            format!("{}..{}", f(min * 1e3), f(max * 1e3)),
            f(r["target_s"].as_f64().unwrap_or(f64::NAN) * 1e3),
        ]);
    }
    print!("{}", t.render());
    Ok(json!({
        "benchmark": "restart",
        "codec": opts.codec,
        "repeats": opts.repeats,
        "frontend": if opts.vhost_user { "vhost-user" } else { "nbd" },
        "corpus_pages": corpus.len(),
        "anchor": "the same restart of a device holding nothing (stored 0)",
        "sizes": rows,
    }))
}
