//! `uzram bench vhost`: vhost-user-blk servers driven without a VM, against QEMU's storage
//! daemon in the same run.
//!
//! The driver is the test kit's virtio-blk driver (`uzram_testkit::virtio_blk`): the
//! vhost-user front end as QEMU speaks it (guest memory in a memfd shared with the server,
//! split virtqueues with EVENT_IDX, kick and call eventfds) and a guest's virtio-blk requests
//! (header, data, status). No guest runs, so what is measured is the server's part of a
//! request and the transport's, which under an emulated guest (TCG: about 200 µs per I/O)
//! cannot be seen.
//!
//! Targets, each a process of its own, all offering 2 queues:
//!
//! - **uzram**: `uzram serve --vhost-user` (the binary beside this one; lz4, 4 KiB pages).
//! - **qsd-null**: `qemu-storage-daemon` exporting a `null-co` node (reads return without
//!   touching the buffer, writes are dropped): the transport's floor, no data.
//! - **qsd-tmpfs**: `qemu-storage-daemon` exporting a raw file on tmpfs (`/dev/shm`): a RAM
//!   disk that only copies.
//!
//! qemu-storage-daemon serves its export in an iothread (`--object iothread`, with QEMU's
//! default adaptive polling of up to 32 µs), as a VM host set up for speed runs it.
//!
//! Every point is 4 KiB random reads or writes of page-aligned pages, at queue depth 1 and 32
//! per queue, on 1 and 2 queues (a thread per queue, as a guest's vCPUs), for `runtime`
//! seconds, on a fresh connection. Writes carry pages of the corpus (real programs' memory,
//! `uzram corpus`), so uzram compresses what it would hold. Each target is filled first with
//! corpus pages. Each point runs on every target in turn, and the whole sequence `repeats`
//! times, so drift on the machine falls on all alike; medians are reported.
//!
//! Reported per point: IOPS, p50 and p99 latency (submit to reap, µs), and the server's CPU
//! per request: the CPU time of all its threads (`/proc/PID/task/*/schedstat`) over the
//! point, divided by the requests. Beside them the codec's own time on the same pages
//! (lz4 compress and decompress of each, one thread, measured raw in this process), and the
//! ratios uzram/qsd-tmpfs. The targets: uzram ≥ 1.0× qsd-tmpfs IOPS for reads and ≥ 0.8× for
//! writes; uzram's CPU per request ≤ qsd-null's plus the codec's time.
//!
//! After the points, every page of uzram and qsd-tmpfs is read back and compared with the
//! last page written there: the run fails on any difference.

use crate::corpus::Corpus;
use crate::{f, median, percentile, Table};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};
use uzram::compress::{self, CodecParams};
use uzram::error::{Error, Result};
use uzram_testkit::virtio_blk::{Completion, DriverConfig, Request, VhostUserBlk, S_OK};

const PAGE_BYTES: u64 = 4096;
/// Queues every server offers (the most a point uses).
const SERVER_QUEUES: u16 = 2;
/// How long a request may take before the run fails (a server that stopped answering).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// What to run.
#[derive(Debug, Clone)]
pub struct VhostBenchOptions {
    /// Seconds per point.
    pub runtime_secs: f64,
    /// Size of every target in bytes.
    pub size_bytes: u64,
    /// Runs per point; the median is reported.
    pub repeats: usize,
    /// Workloads: `randread`, `randwrite`.
    pub rws: Vec<String>,
    /// Queue depths (per queue).
    pub depths: Vec<u16>,
    /// Queue counts.
    pub queues: Vec<u16>,
    /// qemu-storage-daemon's `aio` for the tmpfs file: `threads` or `io_uring`.
    pub qsd_aio: String,
}

impl Default for VhostBenchOptions {
    fn default() -> VhostBenchOptions {
        VhostBenchOptions {
            runtime_secs: 5.0,
            size_bytes: 256 << 20,
            repeats: 3,
            rws: vec!["randread".into(), "randwrite".into()],
            depths: vec![1, 32],
            queues: vec![1, 2],
            qsd_aio: "io_uring".into(),
        }
    }
}

/// A server process; killed when dropped.
struct ServerProcess {
    name: &'static str,
    child: Child,
    socket: PathBuf,
    /// How it was started.
    command: String,
    /// Whether its pages are kept (read back at the end).
    keeps_data: bool,
    /// The corpus page index last written at each page (`u32::MAX`: never written).
    expected: Vec<u32>,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ServerProcess {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

fn wait_for_socket(child: &mut Child, socket: &Path, what: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        if let Some(status) = child.try_wait()? {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            return Err(Error::io(format!("{what} exited ({status}): {err}")));
        }
        if Instant::now() > deadline {
            return Err(Error::io(format!(
                "{what} did not create {}",
                socket.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// `uzram serve --vhost-user`, the binary beside this one.
fn start_uzram(dir: &Path, size_bytes: u64) -> Result<ServerProcess> {
    let exe = std::env::current_exe()?;
    let uzram = exe
        .parent()
        .map(|d| d.join("uzram"))
        .filter(|p| p.is_file())
        .ok_or_else(|| {
            Error::new(
                uzram::ErrorKind::NotFound,
                format!(
                    "no uzram binary beside {} (build it: cargo build --release -p uzram-cli)",
                    exe.display()
                ),
            )
        })?;
    let nbd_socket = dir.join("zram0.sock");
    let args = vec![
        "serve".to_string(),
        "--vhost-user".into(),
        "--name".into(),
        "zram0".into(),
        "--disksize".into(),
        size_bytes.to_string(),
        "--socket".into(),
        nbd_socket.display().to_string(),
    ];
    let mut child = Command::new(&uzram)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("starting {}: {e}", uzram.display())))?;
    let socket = dir.join("zram0.vhost.sock");
    wait_for_socket(&mut child, &socket, "uzram serve")?;
    Ok(ServerProcess {
        name: "uzram",
        child,
        socket,
        command: format!("{} {}", uzram.display(), args.join(" ")),
        keeps_data: true,
        expected: Vec::new(),
    })
}

/// `qemu-storage-daemon` exporting `blockdev` (whose node is `disk`) on a vhost-user-blk
/// socket, in an iothread.
fn start_qsd(
    name: &'static str,
    dir: &Path,
    blockdevs: &[String],
    keeps_data: bool,
) -> Result<ServerProcess> {
    let qsd = crate::vm::program("qemu-storage-daemon").map_err(|_| {
        Error::new(
            uzram::ErrorKind::NotFound,
            "qemu-storage-daemon is not installed (Debian package qemu-utils)",
        )
    })?;
    let socket = dir.join(format!("{name}.vhost.sock"));
    let mut args = Vec::new();
    for b in blockdevs {
        args.push("--blockdev".to_string());
        args.push(b.clone());
    }
    args.extend([
        "--object".to_string(),
        "iothread,id=io0".into(),
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=exp0,node-name=disk,addr.type=unix,addr.path={},\
             writable=on,num-queues={SERVER_QUEUES},logical-block-size=512,iothread=io0",
            socket.display()
        ),
    ]);
    let mut child = Command::new(&qsd)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("starting qemu-storage-daemon: {e}")))?;
    wait_for_socket(&mut child, &socket, "qemu-storage-daemon")?;
    Ok(ServerProcess {
        name,
        child,
        socket,
        command: format!("{qsd} {}", args.join(" ")),
        keeps_data,
        expected: Vec::new(),
    })
}

/// The CPU time of each thread of process `pid` (`/proc/PID/task/TID/schedstat`'s first
/// field, ns), by thread id, with its name.
fn thread_cpu(pid: u32) -> BTreeMap<u32, (String, u64)> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let ns = std::fs::read_to_string(t.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()));
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if let Some(ns) = ns {
            out.insert(tid, (comm.trim().to_string(), ns));
        }
    }
    out
}

/// CPU used between two [`thread_cpu`] readings, by thread name (a thread that started in
/// between counts from 0; one that ended in between is lost, and the total says so by being
/// low); and the total.
fn cpu_between(
    before: &BTreeMap<u32, (String, u64)>,
    after: &BTreeMap<u32, (String, u64)>,
) -> (BTreeMap<String, u64>, u64) {
    let mut by_name = BTreeMap::new();
    let mut total = 0;
    for (tid, (name, ns)) in after {
        let start = before.get(tid).map_or(0, |b| b.1);
        let d = ns.saturating_sub(start);
        *by_name.entry(name.clone()).or_insert(0) += d;
        total += d;
    }
    (by_name, total)
}

/// A small, fast, seeded generator (xorshift64*): the pages and sectors each queue thread
/// picks.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What one queue thread did.
struct QueueRun {
    requests: u64,
    latencies_ns: Vec<u64>,
    /// (page, corpus index) of each write that completed with S_OK.
    written: Vec<(u64, u32)>,
    errors: u64,
    kicks: u64,
    sleeps: u64,
}

/// What each queue thread of a point runs.
#[derive(Clone, Copy)]
struct Workload<'a> {
    corpus: &'a Corpus,
    write: bool,
    /// Requests in flight per queue.
    depth: u16,
    /// Pages each queue owns.
    pages_per_queue: u64,
    /// Queues of the point.
    nq: u64,
}

/// Runs `w` on one queue until `stop`: pages `q, q + nq, q + 2nq, …` of the device (each
/// queue its own, so writes in flight never overlap), never two requests on one page at
/// once.
fn queue_worker(
    vq: &mut uzram_testkit::virtio_blk::Virtqueue,
    w: Workload<'_>,
    stop: &AtomicBool,
    start: &Barrier,
) -> Result<QueueRun> {
    let Workload {
        corpus,
        write,
        depth,
        pages_per_queue,
        nq,
    } = w;
    let q = vq.index() as u64;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (q + 1).wrapping_mul(0x1234_5678_9abc_def1));
    let depth = depth.min(vq.slots());
    let npages = corpus.len() as u64;
    let mut run = QueueRun {
        requests: 0,
        latencies_ns: Vec::with_capacity(1 << 20),
        written: Vec::new(),
        errors: 0,
        kicks: 0,
        sleeps: 0,
    };
    // Per slot: when it was submitted, its page, its corpus index.
    let slots = usize::from(vq.slots());
    let mut started = vec![Instant::now(); slots];
    let mut page_of = vec![u64::MAX; slots];
    let mut corpus_of = vec![0u32; slots];
    let mut done: Vec<Completion> = Vec::with_capacity(slots);
    let submit = |vq: &mut uzram_testkit::virtio_blk::Virtqueue,
                  rng: &mut Rng,
                  page_of: &mut Vec<u64>,
                  started: &mut Vec<Instant>,
                  corpus_of: &mut Vec<u32>| {
        // A page no request in flight has.
        let page = loop {
            let p = q + nq * rng.below(pages_per_queue);
            if !page_of.contains(&p) {
                break p;
            }
        };
        let sector = page * (PAGE_BYTES >> 9);
        let (slot, ci) = if write {
            let ci = rng.below(npages) as u32;
            let slot = vq
                .submit(&Request::write(sector, corpus.page(ci as usize)))
                .expect("a free slot");
            (slot, ci)
        } else {
            (
                vq.submit(&Request::read(sector, PAGE_BYTES as u32))
                    .expect("a free slot"),
                0,
            )
        };
        page_of[usize::from(slot)] = page;
        corpus_of[usize::from(slot)] = ci;
        started[usize::from(slot)] = Instant::now();
    };
    start.wait();
    for _ in 0..depth {
        submit(vq, &mut rng, &mut page_of, &mut started, &mut corpus_of);
    }
    vq.notify()?;
    while vq.in_flight() > 0 {
        done.clear();
        vq.wait(&mut done, REQUEST_TIMEOUT)?;
        let now = Instant::now();
        let more = !stop.load(Ordering::Relaxed);
        for c in &done {
            let s = usize::from(c.slot);
            run.requests += 1;
            run.latencies_ns
                .push(now.duration_since(started[s]).as_nanos() as u64);
            if c.status != S_OK {
                run.errors += 1;
            } else if write {
                run.written.push((page_of[s], corpus_of[s]));
            }
            page_of[s] = u64::MAX;
        }
        // Only after every completion is booked: a new request may take any of their slots.
        if more {
            for _ in 0..done.len() {
                submit(vq, &mut rng, &mut page_of, &mut started, &mut corpus_of);
            }
        }
        vq.notify()?;
    }
    run.kicks = vq.kicks;
    run.sleeps = vq.sleeps;
    Ok(run)
}

/// One run of a point on a server.
#[derive(Debug, Clone, serde::Serialize)]
struct Sample {
    iops: f64,
    p50_us: f64,
    p99_us: f64,
    /// The server's CPU per request, µs.
    server_cpu_us: f64,
    /// Its split by thread name, µs per request.
    server_cpu_us_by_thread: BTreeMap<String, f64>,
    kicks_per_request: f64,
    sleeps_per_request: f64,
}

fn io_err(e: std::io::Error) -> Error {
    Error::io(e.to_string())
}

/// Runs one point on `server`: a fresh connection of `nq` queues, a thread each.
fn run_point(
    server: &mut ServerProcess,
    corpus: &Corpus,
    write: bool,
    depth: u16,
    nq: u16,
    runtime: Duration,
    size_bytes: u64,
) -> Result<Sample> {
    let cfg = DriverConfig {
        queues: nq,
        ..Default::default()
    };
    let (conn, queues) = VhostUserBlk::connect(&server.socket, &cfg).map_err(io_err)?;
    let pages = size_bytes / PAGE_BYTES;
    let pages_per_queue = pages / u64::from(nq);
    let stop = AtomicBool::new(false);
    let start = Barrier::new(usize::from(nq) + 1);
    let pid = server.pid();
    let w = Workload {
        corpus,
        write,
        depth,
        pages_per_queue,
        nq: u64::from(nq),
    };
    let (runs, cpu, elapsed) = std::thread::scope(|s| {
        let handles: Vec<_> = queues
            .into_iter()
            .map(|mut vq| {
                let (stop, start) = (&stop, &start);
                s.spawn(move || queue_worker(&mut vq, w, stop, start))
            })
            .collect();
        let before = thread_cpu(pid);
        let t0 = Instant::now();
        start.wait();
        std::thread::sleep(runtime);
        stop.store(true, Ordering::Relaxed);
        let runs: Vec<Result<QueueRun>> = handles
            .into_iter()
            .map(|h| h.join().expect("a queue thread panicked"))
            .collect();
        let elapsed = t0.elapsed();
        let after = thread_cpu(pid);
        (runs, cpu_between(&before, &after), elapsed)
    });
    drop(conn);
    let runs = runs.into_iter().collect::<Result<Vec<_>>>()?;
    let requests: u64 = runs.iter().map(|r| r.requests).sum();
    let errors: u64 = runs.iter().map(|r| r.errors).sum();
    if errors > 0 {
        return Err(Error::io(format!(
            "{}: {errors} of {requests} requests failed",
            server.name
        )));
    }
    if server.keeps_data {
        for r in &runs {
            for &(page, ci) in &r.written {
                server.expected[page as usize] = ci;
            }
        }
    }
    let lat: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.latencies_ns.iter().map(|&ns| ns as f64 / 1000.0))
        .collect();
    let per_req = |ns: u64| ns as f64 / 1000.0 / requests.max(1) as f64;
    Ok(Sample {
        iops: requests as f64 / elapsed.as_secs_f64(),
        p50_us: percentile(&lat, 50.0),
        p99_us: percentile(&lat, 99.0),
        server_cpu_us: per_req(cpu.1),
        server_cpu_us_by_thread: cpu
            .0
            .iter()
            .map(|(k, &v)| (k.clone(), per_req(v)))
            .collect(),
        kicks_per_request: runs.iter().map(|r| r.kicks).sum::<u64>() as f64
            / requests.max(1) as f64,
        sleeps_per_request: runs.iter().map(|r| r.sleeps).sum::<u64>() as f64
            / requests.max(1) as f64,
    })
}

/// Writes every page of `server` once with corpus pages (depth 32 on one queue).
fn fill(server: &mut ServerProcess, corpus: &Corpus, size_bytes: u64) -> Result<()> {
    let pages = size_bytes / PAGE_BYTES;
    server.expected = vec![u32::MAX; pages as usize];
    let (conn, mut queues) =
        VhostUserBlk::connect(&server.socket, &DriverConfig::default()).map_err(io_err)?;
    if conn.capacity_sectors != size_bytes >> 9 {
        return Err(Error::io(format!(
            "{}: capacity {} sectors, {} expected",
            server.name,
            conn.capacity_sectors,
            size_bytes >> 9
        )));
    }
    let vq = &mut queues[0];
    let mut next = 0u64;
    let mut page_of = vec![0u64; usize::from(vq.slots())];
    let mut done = Vec::new();
    loop {
        while next < pages {
            let ci = (next % corpus.len() as u64) as usize;
            let Some(slot) = vq.submit(&Request::write(next * (PAGE_BYTES >> 9), corpus.page(ci)))
            else {
                break;
            };
            page_of[usize::from(slot)] = next;
            next += 1;
        }
        vq.notify().map_err(io_err)?;
        if vq.in_flight() == 0 {
            break;
        }
        done.clear();
        vq.wait(&mut done, REQUEST_TIMEOUT).map_err(io_err)?;
        for c in &done {
            if c.status != S_OK {
                return Err(Error::io(format!(
                    "{}: filling page {}: status {}",
                    server.name,
                    page_of[usize::from(c.slot)],
                    c.status
                )));
            }
            let page = page_of[usize::from(c.slot)];
            server.expected[page as usize] = (page % corpus.len() as u64) as u32;
        }
    }
    Ok(())
}

/// Reads every page of `server` back and compares it with the last corpus page written
/// there; the number of pages compared.
fn verify(server: &ServerProcess, corpus: &Corpus) -> Result<u64> {
    let (_conn, mut queues) =
        VhostUserBlk::connect(&server.socket, &DriverConfig::default()).map_err(io_err)?;
    let vq = &mut queues[0];
    let pages = server.expected.len() as u64;
    let mut next = 0u64;
    let mut page_of = vec![0u64; usize::from(vq.slots())];
    let mut done = Vec::new();
    let mut buf = vec![0u8; PAGE_BYTES as usize];
    loop {
        while next < pages {
            let Some(slot) = vq.submit(&Request::read(next * (PAGE_BYTES >> 9), PAGE_BYTES as u32))
            else {
                break;
            };
            page_of[usize::from(slot)] = next;
            next += 1;
        }
        vq.notify().map_err(io_err)?;
        if vq.in_flight() == 0 {
            break;
        }
        done.clear();
        vq.wait(&mut done, REQUEST_TIMEOUT).map_err(io_err)?;
        for c in &done {
            let page = page_of[usize::from(c.slot)];
            vq.read_data(c.slot, &mut buf);
            let ci = server.expected[page as usize];
            let want = if ci == u32::MAX {
                &[0u8; PAGE_BYTES as usize][..]
            } else {
                corpus.page(ci as usize)
            };
            if c.status != S_OK || buf != want {
                return Err(Error::io(format!(
                    "{}: page {page} reads back different (status {}, corpus page {ci} \
                     expected)",
                    server.name, c.status
                )));
            }
        }
    }
    Ok(pages)
}

/// The codec's own time on the corpus's pages, one thread, CPU time: (compress µs/page,
/// decompress µs/page), each the median of `repeats`.
fn codec_time(corpus: &Corpus, repeats: usize) -> Result<(f64, f64)> {
    let codec = compress::new_codec("lz4", CodecParams::default())?;
    let ps = corpus.page_size_bytes();
    let bound = compress::compress_bound(ps);
    let n = corpus.len();
    let mut comp = vec![0u8; bound * n];
    let mut lens = vec![0usize; n];
    let mut out = vec![0u8; ps];
    let (mut c, mut d) = (Vec::new(), Vec::new());
    for _ in 0..repeats.max(1) {
        let (r, _, cpu) = crate::time_cpu(|| -> Result<()> {
            for (i, len) in lens.iter_mut().enumerate() {
                *len = codec.compress(corpus.page(i), &mut comp[i * bound..(i + 1) * bound])?;
            }
            Ok(())
        });
        r?;
        c.push(cpu.as_secs_f64() * 1e6 / n as f64);
        let (r, _, cpu) = crate::time_cpu(|| -> Result<()> {
            for (i, &len) in lens.iter().enumerate() {
                codec.decompress(&comp[i * bound..i * bound + len], &mut out)?;
            }
            Ok(())
        });
        r?;
        d.push(cpu.as_secs_f64() * 1e6 / n as f64);
    }
    Ok((median(&c), median(&d)))
}

/// A point: (rw, depth, queues).
type PointKey = (String, u16, u16);

/// Runs the benchmark; prints progress and the tables, returns the JSON document.
pub fn run(corpus: &Corpus, opts: &VhostBenchOptions) -> Result<serde_json::Value> {
    if corpus.page_size_bytes() as u64 != PAGE_BYTES {
        return Err(Error::invalid("bench vhost needs a corpus of 4 KiB pages"));
    }
    for rw in &opts.rws {
        if rw != "randread" && rw != "randwrite" {
            return Err(Error::invalid(format!("--rw {rw}: randread or randwrite")));
        }
    }
    if opts.queues.iter().any(|&q| q == 0 || q > SERVER_QUEUES)
        || opts.depths.iter().any(|&d| d == 0 || d > 32)
    {
        return Err(Error::invalid(format!(
            "queues 1 to {SERVER_QUEUES}, depths 1 to 32"
        )));
    }
    if opts.qsd_aio != "threads" && opts.qsd_aio != "io_uring" {
        return Err(Error::invalid("--qsd-aio: threads or io_uring"));
    }
    let size_bytes = opts.size_bytes / PAGE_BYTES * PAGE_BYTES;
    if size_bytes < PAGE_BYTES * 64 {
        return Err(Error::invalid("--size: at least 256K"));
    }
    let progress = |s: &str| eprintln!("bench vhost: {s}");
    let dir = crate::nbd::tempfile_dir()?;
    // The RAM disk: a file on tmpfs, removed at the end.
    let shm = PathBuf::from(format!(
        "/dev/shm/uzram-bench-vhost-{}.img",
        std::process::id()
    ));
    let _shm_guard = RemoveOnDrop(shm.clone());
    std::fs::File::create(&shm)?.set_len(size_bytes)?;

    let mut servers = vec![
        start_uzram(&dir.path, size_bytes)?,
        start_qsd(
            "qsd-null",
            &dir.path,
            &[format!("driver=null-co,node-name=disk,size={size_bytes}")],
            false,
        )?,
        start_qsd(
            "qsd-tmpfs",
            &dir.path,
            &[
                format!(
                    "driver=file,node-name=file0,filename={},cache.direct=off,aio={}",
                    shm.display(),
                    opts.qsd_aio
                ),
                "driver=raw,node-name=disk,file=file0".to_string(),
            ],
            true,
        )?,
    ];
    for s in servers.iter_mut() {
        progress(&format!("{}: filling {} MiB", s.name, size_bytes >> 20));
        fill(s, corpus, size_bytes)?;
    }
    progress("the codec's own time on the corpus's pages");
    let (compress_us, decompress_us) = codec_time(corpus, opts.repeats.max(3))?;

    let runtime = Duration::from_secs_f64(opts.runtime_secs.max(0.05));
    let mut samples: Vec<(usize, PointKey, Vec<Sample>)> = Vec::new();
    for rep in 0..opts.repeats.max(1) {
        for rw in &opts.rws {
            for &depth in &opts.depths {
                for &nq in &opts.queues {
                    for (si, server) in servers.iter_mut().enumerate() {
                        let s = run_point(
                            server,
                            corpus,
                            rw == "randwrite",
                            depth,
                            nq,
                            runtime,
                            size_bytes,
                        )?;
                        progress(&format!(
                            "run {}: {} {rw} depth {depth} queues {nq}: {:.0} IOPS, p50 {:.1} \
                             µs, p99 {:.1} µs, server CPU {:.2} µs/request",
                            rep + 1,
                            server.name,
                            s.iops,
                            s.p50_us,
                            s.p99_us,
                            s.server_cpu_us
                        ));
                        let key = (rw.clone(), depth, nq);
                        match samples.iter_mut().find(|(i, k, _)| *i == si && *k == key) {
                            Some((_, _, v)) => v.push(s),
                            None => samples.push((si, key, vec![s])),
                        }
                    }
                }
            }
        }
    }
    let mut verified = serde_json::Map::new();
    for s in servers.iter().filter(|s| s.keeps_data) {
        progress(&format!("{}: reading every page back", s.name));
        let n = verify(s, corpus)?;
        verified.insert(s.name.to_string(), json!(n));
    }
    let names: Vec<&str> = servers.iter().map(|s| s.name).collect();
    let commands: serde_json::Map<String, serde_json::Value> = servers
        .iter()
        .map(|s| (s.name.to_string(), json!(s.command)))
        .collect();
    drop(servers);

    // Medians per point and server.
    let med = |v: &[Sample], f: fn(&Sample) -> f64| median(&v.iter().map(f).collect::<Vec<_>>());
    let mut table = Table::new(&[
        "target",
        "rw",
        "depth",
        "queues",
        "IOPS",
        "p50 µs",
        "p99 µs",
        "server CPU µs/req",
    ])
    .left_align(&[1]);
    let mut points = Vec::new();
    samples.sort_by_key(|(si, _, _)| *si);
    for (si, (rw, depth, nq), runs) in &samples {
        let mut by_thread: BTreeMap<String, f64> = BTreeMap::new();
        for name in runs.iter().flat_map(|r| r.server_cpu_us_by_thread.keys()) {
            let v: Vec<f64> = runs
                .iter()
                .map(|r| r.server_cpu_us_by_thread.get(name).copied().unwrap_or(0.0))
                .collect();
            by_thread.insert(name.clone(), median(&v));
        }
        let p = json!({
            "target": names[*si],
            "rw": rw,
            "depth": depth,
            "queues": nq,
            "iops": med(runs, |s| s.iops),
            "p50_us": med(runs, |s| s.p50_us),
            "p99_us": med(runs, |s| s.p99_us),
            "server_cpu_us_per_request": med(runs, |s| s.server_cpu_us),
            "server_cpu_us_by_thread": by_thread,
            "kicks_per_request": med(runs, |s| s.kicks_per_request),
            "sleeps_per_request": med(runs, |s| s.sleeps_per_request),
            "runs": runs,
        });
        table.row(vec![
            names[*si].to_string(),
            rw.clone(),
            depth.to_string(),
            nq.to_string(),
            f(p["iops"].as_f64().unwrap_or(f64::NAN)),
            f(p["p50_us"].as_f64().unwrap_or(f64::NAN)),
            f(p["p99_us"].as_f64().unwrap_or(f64::NAN)),
            f(p["server_cpu_us_per_request"].as_f64().unwrap_or(f64::NAN)),
        ]);
        points.push(p);
    }
    let at = |target: &str, rw: &str, depth: u16, nq: u16| {
        points.iter().find(|p| {
            p["target"] == target && p["rw"] == rw && p["depth"] == depth && p["queues"] == nq
        })
    };
    let num =
        |p: Option<&serde_json::Value>, k: &str| p.and_then(|p| p[k].as_f64()).unwrap_or(f64::NAN);
    let mut ratios = Table::new(&[
        "rw",
        "depth",
        "queues",
        "uzram/qsd-tmpfs IOPS",
        "target",
        "uzram CPU µs/req",
        "qsd-null + codec µs/req",
        "CPU target",
    ])
    .left_align(&[0]);
    let mut ratio_rows = Vec::new();
    let mut met = 0;
    let mut targets = 0;
    for rw in &opts.rws {
        for &depth in &opts.depths {
            for &nq in &opts.queues {
                let u = at("uzram", rw, depth, nq);
                let t = at("qsd-tmpfs", rw, depth, nq);
                let n = at("qsd-null", rw, depth, nq);
                let ratio = num(u, "iops") / num(t, "iops");
                let want = if rw == "randread" { 1.0 } else { 0.8 };
                let codec_us = if rw == "randread" {
                    decompress_us
                } else {
                    compress_us
                };
                let cpu = num(u, "server_cpu_us_per_request");
                let bound = num(n, "server_cpu_us_per_request") + codec_us;
                let (iops_met, cpu_met) = (ratio >= want, cpu <= bound);
                targets += 2;
                met += usize::from(iops_met) + usize::from(cpu_met);
                ratios.row(vec![
                    rw.clone(),
                    depth.to_string(),
                    nq.to_string(),
                    format!("{ratio:.2}"),
                    format!(">= {want} {}", if iops_met { "met" } else { "not met" }),
                    f(cpu),
                    f(bound),
                    if cpu_met { "met" } else { "not met" }.to_string(),
                ]);
                ratio_rows.push(json!({
                    "rw": rw, "depth": depth, "queues": nq,
                    "iops_ratio_uzram_over_qsd_tmpfs": ratio,
                    "iops_target": want, "iops_target_met": iops_met,
                    "iops_ratio_uzram_over_qsd_null": num(u, "iops") / num(n, "iops"),
                    "uzram_cpu_us_per_request": cpu,
                    "qsd_null_plus_codec_cpu_us_per_request": bound,
                    "qsd_tmpfs_cpu_us_per_request": num(t, "server_cpu_us_per_request"),
                    "cpu_target_met": cpu_met,
                }));
            }
        }
    }
    println!(
        "bench vhost: 4 KiB random I/O of corpus pages through a vhost-user-blk driver (no \
         VM), {} s per point, median of {}, {} MiB targets, {} cores",
        opts.runtime_secs,
        opts.repeats.max(1),
        size_bytes >> 20,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    print!("{}", table.render());
    println!(
        "\nthe codec's own time on the same pages (lz4, one thread): compress {compress_us:.2} \
         µs/page, decompress {decompress_us:.2} µs/page"
    );
    println!(
        "uzram against qemu-storage-daemon on tmpfs (IOPS) and against its null-co floor plus \
         the codec (server CPU per request):"
    );
    print!("{}", ratios.render());
    println!("targets met: {met} of {targets}");
    Ok(json!({
        "benchmark": "vhost",
        "options": {
            "runtime_secs": opts.runtime_secs,
            "size_bytes": size_bytes,
            "repeats": opts.repeats.max(1),
            "rw": opts.rws,
            "depths": opts.depths,
            "queues": opts.queues,
            "qsd_aio": opts.qsd_aio,
            "block_size_bytes": PAGE_BYTES,
            "corpus_pages": corpus.len(),
        },
        "environment": {
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
            "qemu_storage_daemon": crate::nbd::program_version("qemu-storage-daemon", "--version"),
        },
        "commands": commands,
        "codec": {"name": "lz4", "compress_us_per_page": compress_us, "decompress_us_per_page": decompress_us},
        "points": points,
        "ratios": ratio_rows,
        "targets_met": met,
        "targets": targets,
        "verified_pages": verified,
    }))
}

/// Removes a file when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
