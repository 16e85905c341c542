//! `uzram bench nbd`: fio against uzram's NBD server and its anchors, in the same run.
//!
//! Every point is fio, 4 KiB random I/O on data that is 60% compressible
//! (`buffer_compress_percentage=60`, `refill_buffers`), `randwrite`, `randread` and 70/30
//! `randrw`, at iodepth 1 and 32, with 1 and 2 jobs, time-based. The targets:
//!
//! - **uzram**: this crate's device (lz4, 4 KiB pages) behind its NBD server on a unix socket,
//!   fio's `nbd` engine (one connection per job).
//! - **uzram-multi** (with `--multi-page-size N`): the same with `multi_page_size` N, filled
//!   by the same 1 MiB writes, so its pages sit in multi-page objects (4 KiB random
//!   I/O at QD1 against `uzram`'s).
//! - **nbdkit-sparse**, **nbdkit-zstd**: nbdkit's memory plugin (`allocator=sparse`, and
//!   `allocator=zstd`, which compresses like uzram but crashes with several connections, so
//!   it gets one job only), the same fio engine, when nbdkit is installed.
//! - **kernel-psync**, **kernel-io_uring**: the kernel's `/dev/zram0` (lz4) with `O_DIRECT`,
//!   fio's `psync` (iodepth 1 only: it is synchronous) and `io_uring` engines, when run as root
//!   and zram0 exists unused; it is reset afterwards.
//!
//! Every target is set up and filled sequentially first (so reads hit data); then each point
//! runs on every target in turn, and the whole sequence is repeated `repeats` times, so load
//! from elsewhere drifts over all targets alike. The two kernel targets share one zram0.
//! Reported per point: IOPS (reads and writes together: fio's
//! `unified_rw_reporting=mixed`), completion latency p50 and p99 (µs), each the median of
//! `repeats` runs, and the ratios uzram/anchor on the same point. The targets: uzram at
//! least nbdkit sparse's IOPS; at least 1/3 of the kernel's psync iodepth-1 IOPS.

use crate::kernel_zram::KernelZram;
use crate::{f, median, Table};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uzram::device::{Device, DeviceConfig};
use uzram::error::{Error, Result};
use uzram::BlockDevice;
use uzram_service::frontend::nbd::{Export, Server};

/// What to run.
#[derive(Debug, Clone)]
pub struct NbdBenchOptions {
    /// Seconds per point.
    pub runtime_secs: u64,
    /// Size of every target in bytes.
    pub size_bytes: u64,
    /// Runs per point; the median is reported.
    pub repeats: usize,
    /// Workloads (`randwrite`, `randread`, `randrw`).
    pub rws: Vec<String>,
    /// Queue depths.
    pub iodepths: Vec<u32>,
    /// Job counts (one connection or file descriptor each).
    pub jobs: Vec<u32>,
    /// Skip the kernel anchors.
    pub no_kernel: bool,
    /// Skip the nbdkit anchors.
    pub no_nbdkit: bool,
    /// Also a uzram device with this `multi_page_size` (target `uzram-multi`: its
    /// 4 KiB random I/O against `uzram`'s, and the 1 MiB prefill taking the multi-page path).
    pub multi_page_size: Option<usize>,
}

impl Default for NbdBenchOptions {
    fn default() -> NbdBenchOptions {
        NbdBenchOptions {
            // Long enough for fio's rate to settle past start-up (connection, first
            // allocations), short enough that the 48 points take about 8 minutes.
            runtime_secs: 10,
            // Larger than the CPU caches by far, small enough for any CI machine's RAM.
            size_bytes: 1 << 30,
            repeats: 1,
            rws: vec!["randwrite".into(), "randread".into(), "randrw".into()],
            iodepths: vec![1, 32],
            jobs: vec![1, 2],
            no_kernel: false,
            no_nbdkit: false,
            multi_page_size: None,
        }
    }
}

/// One measured point.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NbdPoint {
    /// Target name.
    pub target: String,
    /// fio's `rw`.
    pub rw: String,
    /// Queue depth.
    pub iodepth: u32,
    /// Jobs.
    pub jobs: u32,
    /// IOPS, reads and writes together (median of the runs).
    pub iops: f64,
    /// Completion latency p50, µs.
    pub p50_us: f64,
    /// Completion latency p99, µs.
    pub p99_us: f64,
    /// Every run's IOPS.
    pub runs_iops: Vec<f64>,
}

/// A point on a target: (target index, rw, iodepth, jobs).
type PointKey = (usize, String, u32, u32);
/// One run's (IOPS, p50 µs, p99 µs).
type Sample = (f64, f64, f64);

/// How fio reaches a target.
enum Access {
    Nbd(String),
    Block(PathBuf, &'static str),
}

impl Access {
    fn fio_args(&self) -> Vec<String> {
        match self {
            Access::Nbd(uri) => vec!["--ioengine=nbd".into(), format!("--uri={uri}")],
            Access::Block(path, engine) => vec![
                format!("--ioengine={engine}"),
                format!("--filename={}", path.display()),
                "--direct=1".into(),
            ],
        }
    }
}

pub(crate) fn fio(args: &[String]) -> Result<serde_json::Value> {
    let out = Command::new("fio")
        .args(args)
        .output()
        .map_err(|e| Error::io(format!("running fio: {e}")))?;
    if !out.status.success() {
        return Err(Error::io(format!(
            "fio failed: {}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        )));
    }
    // fio may print warnings before the JSON.
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text.find('{').unwrap_or(0);
    serde_json::from_str(&text[start..]).map_err(|e| Error::io(format!("fio's JSON: {e}")))
}

/// Fills the target sequentially with 60%-compressible data.
fn prefill(access: &Access, size_bytes: u64) -> Result<()> {
    let mut args = vec![
        "--name=prefill".to_string(),
        "--rw=write".into(),
        "--bs=1M".into(),
        "--iodepth=4".into(),
        format!("--size={size_bytes}"),
        "--buffer_compress_percentage=60".into(),
        "--refill_buffers".into(),
        "--output-format=json".into(),
    ];
    if let Access::Block(_, _) = access {
        args.push("--ioengine=psync".into());
        args.extend(access.fio_args().into_iter().skip(1));
    } else {
        args.extend(access.fio_args());
    }
    fio(&args).map(|_| ())
}

fn run_point(
    access: &Access,
    rw: &str,
    iodepth: u32,
    jobs: u32,
    opts: &NbdBenchOptions,
) -> Result<(f64, f64, f64)> {
    let mut args = vec![
        "--name=uzram-bench".to_string(),
        format!("--rw={rw}"),
        "--rwmixread=70".into(),
        "--bs=4k".into(),
        format!("--iodepth={iodepth}"),
        format!("--numjobs={jobs}"),
        "--group_reporting".into(),
        "--time_based".into(),
        format!("--runtime={}", opts.runtime_secs),
        format!("--size={}", opts.size_bytes),
        "--buffer_compress_percentage=60".into(),
        "--refill_buffers".into(),
        "--norandommap".into(),
        "--unified_rw_reporting=mixed".into(),
        "--output-format=json".into(),
    ];
    args.extend(access.fio_args());
    let v = fio(&args)?;
    let mixed = &v["jobs"][0]["mixed"];
    let iops = mixed["iops"]
        .as_f64()
        .ok_or_else(|| Error::io("fio's JSON has no mixed.iops"))?;
    let pct = |p: &str| {
        mixed["clat_ns"]["percentile"][p]
            .as_f64()
            .map_or(f64::NAN, |ns| ns / 1000.0)
    };
    Ok((iops, pct("50.000000"), pct("99.000000")))
}

/// A target: its name, how fio reaches it, and which points make sense for it.
struct Target {
    name: &'static str,
    access: Access,
    max_jobs: u32,
    max_iodepth: u32,
    /// Fill it before the points (false when another target shares its storage).
    fill: bool,
}

/// What keeps a target alive; dropping it stops the server, kills nbdkit, resets zram0.
#[allow(dead_code)] // Held for its Drop only.
enum Guard {
    Server(Server),
    Nbdkit(Nbdkit),
    Kernel(KernelZram),
}

/// nbdkit on a unix socket, killed when dropped.
pub(crate) struct Nbdkit {
    child: Child,
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_nbdkit(socket: &Path, size_bytes: u64, allocator: &str) -> Result<Nbdkit> {
    start_nbdkit_with(
        socket,
        &[
            "memory".to_string(),
            format!("size={size_bytes}"),
            format!("allocator={allocator}"),
        ],
    )
}

/// `nbdkit ARGS` (filters, the plugin and its parameters) on the unix socket `socket`, in the
/// foreground, exiting with this process; returns once the socket exists.
pub(crate) fn start_nbdkit_with(socket: &Path, args: &[String]) -> Result<Nbdkit> {
    let child = Command::new("nbdkit")
        .args(["--foreground", "--exit-with-parent", "-U"])
        .arg(socket)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("starting nbdkit: {e}")))?;
    let mut k = Nbdkit { child };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        if let Some(status) = k.child.try_wait()? {
            let mut err = String::new();
            if let Some(mut e) = k.child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            return Err(Error::io(format!("nbdkit exited ({status}): {err}")));
        }
        if Instant::now() > deadline {
            return Err(Error::io("nbdkit did not create its socket"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(k)
}

pub(crate) fn program_version(program: &str, arg: &str) -> String {
    Command::new(program)
        .arg(arg)
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_else(|| "not installed".into())
}

pub(crate) fn have(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Serves `device` as export `zram0` on the unix socket `DIR/NAME.sock`, with the server
/// `uzram serve` runs (in this process): the guard that stops it, and the target `name`.
fn serve_device(dir: &Path, name: &'static str, device: Arc<Device>) -> Result<(Guard, Target)> {
    let socket = dir.join(format!("{name}.sock"));
    let server = Server::start_unix(
        Export::new("zram0", device as Arc<dyn BlockDevice>),
        socket.clone(),
    )?;
    let target = Target {
        name,
        access: Access::Nbd(format!("nbd+unix:///zram0?socket={}", socket.display())),
        max_jobs: u32::MAX,
        max_iodepth: u32::MAX,
        fill: true,
    };
    Ok((Guard::Server(server), target))
}

/// Runs the benchmark; prints progress and the tables, returns the JSON document.
pub fn run(opts: &NbdBenchOptions) -> Result<serde_json::Value> {
    if !have("fio") {
        return Err(Error::new(
            uzram::ErrorKind::NotFound,
            "fio is not installed (Debian package fio)",
        ));
    }
    let dir = tempfile_dir()?;
    let mut skipped: Vec<(String, String)> = Vec::new();
    let progress = |s: &str| eprintln!("bench nbd: {s}");
    // Every target is set up and filled first, then the points run interleaved (each point
    // on every target in turn, repeat after repeat), so load from elsewhere on the machine
    // drifts over all targets alike and the ratios compare like with like.
    let mut guards = Vec::new();
    let mut targets = Vec::new();

    // uzram, in this process: the same server `uzram serve` runs.
    let device = Arc::new(Device::new(DeviceConfig {
        disksize_bytes: opts.size_bytes,
        ..Default::default()
    })?);
    let (guard, target) = serve_device(&dir.path, "uzram", device)?;
    guards.push(guard);
    targets.push(target);
    let mut multi_device = None;
    if let Some(mps) = opts.multi_page_size {
        let device = Arc::new(Device::new_uninit(4096)?);
        device.attr_store("multi_page_size", &mps.to_string())?;
        device.attr_store("disksize", &opts.size_bytes.to_string())?;
        multi_device = Some(device.clone());
        let (guard, target) = serve_device(&dir.path, "uzram-multi", device)?;
        guards.push(guard);
        targets.push(target);
    }

    if opts.no_nbdkit {
        skipped.push(("nbdkit".into(), "--no-nbdkit".into()));
    } else if !have("nbdkit") {
        skipped.push(("nbdkit".into(), "nbdkit is not installed".into()));
    } else {
        for (name, allocator, max_jobs) in [
            ("nbdkit-sparse", "sparse", u32::MAX),
            // One connection: nbdkit's zstd allocator crashes with several.
            ("nbdkit-zstd", "zstd", 1),
        ] {
            let socket = dir.path.join(format!("{name}.sock"));
            match start_nbdkit(&socket, opts.size_bytes, allocator) {
                Ok(kit) => {
                    guards.push(Guard::Nbdkit(kit));
                    targets.push(Target {
                        name,
                        access: Access::Nbd(format!("nbd+unix:///?socket={}", socket.display())),
                        max_jobs,
                        max_iodepth: u32::MAX,
                        fill: true,
                    });
                }
                Err(e) => skipped.push((name.into(), e.to_string())),
            }
        }
    }

    if opts.no_kernel {
        skipped.push(("kernel".into(), "--no-kernel".into()));
    } else {
        match KernelZram::open() {
            None => skipped.push(("kernel".into(), KernelZram::unavailable_reason())),
            Some(k) if !k.has_algorithm("lz4") => {
                skipped.push(("kernel".into(), "the kernel's zram has no lz4".into()))
            }
            Some(k) => {
                k.store("comp_algorithm", "lz4")?;
                k.store("disksize", &opts.size_bytes.to_string())?;
                // Reset when dropped, on every exit path.
                guards.push(Guard::Kernel(k));
                let zram0 = PathBuf::from("/dev/zram0");
                targets.push(Target {
                    name: "kernel-psync",
                    access: Access::Block(zram0.clone(), "psync"),
                    max_jobs: u32::MAX,
                    // psync is synchronous: iodepth is always 1.
                    max_iodepth: 1,
                    fill: true,
                });
                targets.push(Target {
                    name: "kernel-io_uring",
                    access: Access::Block(zram0, "io_uring"),
                    max_jobs: u32::MAX,
                    max_iodepth: u32::MAX,
                    // The same zram0, filled through psync already.
                    fill: false,
                });
            }
        }
    }

    for t in targets.iter().filter(|t| t.fill) {
        progress(&format!("{}: filling {} bytes", t.name, opts.size_bytes));
        prefill(&t.access, opts.size_bytes)?;
    }
    // How the 1 MiB prefill writes arrived: pages stored in multi-page objects.
    let multi_after_fill = multi_device.as_ref().map(|d| {
        let s = d.stats();
        json!({"pages_stored": s.pages_stored, "multi_objects": s.multi_objects,
               "multi_pages": s.multi_pages, "same_pages": s.same_pages,
               "compr_data_size_bytes": s.compr_data_size_bytes,
               "mem_used_total_bytes": s.mem_used_total_bytes})
    });
    if let Some(m) = &multi_after_fill {
        println!("uzram-multi after the 1 MiB prefill: {m}");
    }
    let mut samples: Vec<(PointKey, Vec<Sample>)> = Vec::new();
    for rep in 0..opts.repeats.max(1) {
        for rw in &opts.rws {
            for &iodepth in &opts.iodepths {
                for &jobs in &opts.jobs {
                    for (ti, t) in targets.iter().enumerate() {
                        if iodepth > t.max_iodepth || jobs > t.max_jobs {
                            continue;
                        }
                        let r = run_point(&t.access, rw, iodepth, jobs, opts)?;
                        progress(&format!(
                            "run {}: {} {rw} iodepth {iodepth} jobs {jobs}: {:.0} IOPS, \
                             p50 {:.1} µs, p99 {:.1} µs",
                            rep + 1,
                            t.name,
                            r.0,
                            r.1,
                            r.2
                        ));
                        let key = (ti, rw.clone(), iodepth, jobs);
                        match samples.iter_mut().find(|(k, _)| *k == key) {
                            Some((_, v)) => v.push(r),
                            None => samples.push((key, vec![r])),
                        }
                    }
                }
            }
        }
    }
    drop(guards);
    // Target by target, in the order of the options.
    samples.sort_by_key(|((ti, _, _, _), _)| *ti);
    let points: Vec<NbdPoint> = samples
        .into_iter()
        .map(|((ti, rw, iodepth, jobs), runs)| {
            let iops: Vec<f64> = runs.iter().map(|r| r.0).collect();
            NbdPoint {
                target: targets[ti].name.to_string(),
                rw,
                iodepth,
                jobs,
                iops: median(&iops),
                p50_us: median(&runs.iter().map(|r| r.1).collect::<Vec<_>>()),
                p99_us: median(&runs.iter().map(|r| r.2).collect::<Vec<_>>()),
                runs_iops: iops,
            }
        })
        .collect();

    let find = |target: &str, p: &NbdPoint| {
        points
            .iter()
            .find(|q| {
                q.target == target && q.rw == p.rw && q.iodepth == p.iodepth && q.jobs == p.jobs
            })
            .map(|q| q.iops)
    };
    let mut table = Table::new(&[
        "target", "rw", "iodepth", "jobs", "IOPS", "p50 µs", "p99 µs",
    ]);
    for p in &points {
        table.row(vec![
            p.target.clone(),
            p.rw.clone(),
            p.iodepth.to_string(),
            p.jobs.to_string(),
            f(p.iops),
            f(p.p50_us),
            f(p.p99_us),
        ]);
    }
    let anchors = [
        "nbdkit-sparse",
        "nbdkit-zstd",
        "kernel-psync",
        "kernel-io_uring",
    ];
    let mut ratio_header = vec!["rw", "iodepth", "jobs", "uzram IOPS"];
    let ratio_names: Vec<String> = anchors.iter().map(|a| format!("uzram/{a}")).collect();
    ratio_header.extend(ratio_names.iter().map(String::as_str));
    let mut ratios = Table::new(&ratio_header);
    let mut ratio_rows = Vec::new();
    for p in points.iter().filter(|p| p.target == "uzram") {
        let mut row = vec![
            p.rw.clone(),
            p.iodepth.to_string(),
            p.jobs.to_string(),
            f(p.iops),
        ];
        let mut j = serde_json::Map::new();
        for a in anchors {
            // kernel-psync is measured at iodepth 1 only: compare every uzram depth with it.
            let anchor_iops = if a == "kernel-psync" {
                points
                    .iter()
                    .find(|q| q.target == a && q.rw == p.rw && q.jobs == p.jobs)
                    .map(|q| q.iops)
            } else {
                find(a, p)
            };
            let r = anchor_iops.map(|x| p.iops / x);
            row.push(r.map_or_else(|| "-".into(), |r| format!("{r:.2}")));
            j.insert(a.to_string(), json!(r));
        }
        ratios.row(row);
        ratio_rows.push(json!({
            "rw": p.rw, "iodepth": p.iodepth, "jobs": p.jobs, "uzram_iops": p.iops,
            "ratio_uzram_over": j,
        }));
    }
    println!(
        "fio 4 KiB random I/O, 60% compressible, {} s per point, {} run(s) each (median), \
         {} MiB targets",
        opts.runtime_secs,
        opts.repeats.max(1),
        opts.size_bytes >> 20
    );
    print!("{}", table.render());
    println!(
        "\nuzram's IOPS over each anchor's on the same point (kernel-psync: its iodepth-1 figure):"
    );
    print!("{}", ratios.render());
    for (what, why) in &skipped {
        println!("skipped {what}: {why}");
    }
    // The targets.
    let beats_sparse: Vec<bool> = points
        .iter()
        .filter(|p| p.target == "uzram")
        .filter_map(|p| find("nbdkit-sparse", p).map(|s| p.iops >= s))
        .collect();
    if !beats_sparse.is_empty() {
        println!(
            "target uzram >= nbdkit-sparse IOPS: met on {} of {} points",
            beats_sparse.iter().filter(|&&b| b).count(),
            beats_sparse.len()
        );
    }
    for rw in &opts.rws {
        let u = points
            .iter()
            .find(|p| p.target == "uzram" && &p.rw == rw && p.iodepth == 1 && p.jobs == 1);
        let k = points
            .iter()
            .find(|p| p.target == "kernel-psync" && &p.rw == rw && p.iodepth == 1 && p.jobs == 1);
        if let (Some(u), Some(k)) = (u, k) {
            let r = u.iops / k.iops;
            println!(
                "target uzram >= 1/3 kernel psync, {rw} iodepth 1 jobs 1: {:.2} ({})",
                r,
                if r >= 1.0 / 3.0 { "met" } else { "not met" }
            );
        }
    }
    let mut multi_ratios = Vec::new();
    for rw in &opts.rws {
        let at = |name: &str| {
            points
                .iter()
                .find(|p| p.target == name && &p.rw == rw && p.iodepth == 1 && p.jobs == 1)
        };
        if let (Some(u), Some(m)) = (at("uzram"), at("uzram-multi")) {
            let r = m.iops / u.iops;
            // Runs made back to back compared pairwise: load from elsewhere on a shared
            // machine moves both runs of a pair alike, so the median of the pairs' ratios
            // scatters less than the ratio of the medians.
            let pairs: Vec<f64> = m
                .runs_iops
                .iter()
                .zip(&u.runs_iops)
                .map(|(m, u)| m / u)
                .collect();
            let paired = median(&pairs);
            println!(
                "target uzram-multi >= 0.9x uzram, {rw} iodepth 1 jobs 1: {:.2} ({}); \
                 median of the {} paired runs' ratios {:.2}, p50 latency {:.1} vs {:.1} µs",
                r,
                if r >= 0.9 { "met" } else { "not met" },
                pairs.len(),
                paired,
                m.p50_us,
                u.p50_us
            );
            multi_ratios.push(json!({
                "rw": rw,
                "ratio_of_medians": r,
                "median_paired_ratio": paired,
            }));
        }
    }
    Ok(json!({
        "benchmark": "nbd",
        "multi_page_size": opts.multi_page_size,
        "multi_after_fill": multi_after_fill,
        "multi_ratios": multi_ratios,
        "options": {
            "runtime_secs": opts.runtime_secs,
            "size_bytes": opts.size_bytes,
            "repeats": opts.repeats.max(1),
            "rw": opts.rws,
            "iodepths": opts.iodepths,
            "jobs": opts.jobs,
            "block_size_bytes": 4096,
            "buffer_compress_percentage": 60,
            "rwmixread": 70,
        },
        "environment": {
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
            "fio": program_version("fio", "--version"),
            "nbdkit": program_version("nbdkit", "--version"),
        },
        "points": points,
        "ratios": ratio_rows,
        "skipped": skipped.iter().map(|(w, r)| json!({"target": w, "reason": r})).collect::<Vec<_>>(),
    }))
}

/// A temporary directory for sockets, removed when dropped (the library has no tempfile).
pub(crate) struct TempDir {
    pub(crate) path: PathBuf,
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

pub(crate) fn tempfile_dir() -> Result<TempDir> {
    let base = std::env::temp_dir();
    for i in 0..100u32 {
        let path = base.join(format!("uzram-bench-nbd-{}-{i}", std::process::id()));
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => return Ok(TempDir { path }),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(Error::io("cannot create a temporary directory"))
}
