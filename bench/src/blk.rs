//! `uzram bench blk`: a device as a kernel block device three ways, measured inside one guest
//! in one run.
//!
//! The host side (this process) boots one guest (`scripts/zoned-vm`: Debian's 6.12 kernel
//! under QEMU, 2 vCPUs, KVM when usable, else TCG) that runs this same binary
//! (`uzram bench blk --guest`). Inside, it makes one uzram device (lz4, 4 KiB pages) and
//! serves it in-process as `uzram serve --ublk` does: (a) as `/dev/ublkbN` (ublk, one queue
//! per vCPU, depth 128), and (b) over NBD on a unix socket, which the guest kernel's own NBD
//! client attaches as `/dev/nbd0` (`nbd-client -unix`, one connection, 4 KiB blocks); and
//! (c) the guest kernel's zram (`/dev/zram0`, lz4, the same size). fio runs on each: 4 KiB
//! `randread`, `randwrite` and `randrw` at iodepth 1 and 32, `libaio`, `O_DIRECT`, one job,
//! 60%-compressible data (as `bench vm` and `bench nbd`), after a sequential fill. Each
//! point runs on the three targets in turn, `repeats` times, so drift on the machine falls
//! on all alike; the medians and the ratios ublk/NBD and ublk/guest-zram are printed as a
//! table and written as JSON on the host. The targets: ublk ≥ 0.5× the guest's zram
//! at iodepth 1 and ≥ 0.8× at 32; ublk ≥ 3× NBD at iodepth 1.
//!
//! Under TCG every guest instruction is emulated, uzram's included (it runs in the guest
//! here, unlike `bench vm`'s host-side server), so compression costs far more than on real
//! hardware for uzram and the guest's zram alike; the table says which was used.

use crate::vm::{
    accel, fio_point, guest_zram, program, three_way_points, vm_script, GuestBenchOptions,
};
use crate::{f, median, Table};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use uzram::device::{Device, DeviceConfig};
use uzram::error::{Error, Result};
use uzram::BlockDevice;
use uzram_service::frontend::nbd::{Export, Server};
use uzram_service::frontend::ublk::{UblkConfig, UblkExport};

/// The targets, in the order they run and appear.
const TARGETS: [&str; 3] = ["ublk", "nbd", "guest-zram"];
/// The points: (rw, iodepth).
const POINTS: [(&str, u32); 6] = [
    ("randread", 1),
    ("randwrite", 1),
    ("randrw", 1),
    ("randread", 32),
    ("randwrite", 32),
    ("randrw", 32),
];
/// The guest's samples of the ublk queue threads' own timing, per point: `[µs serving a
/// request, requests per wake-up]` (`UblkStats`).
const SERVER_KEY: &str = "ublk-server";
/// The line the guest prints its results on.
const RESULT_MARK: &str = "UZRAM-BENCH-BLK ";
/// The guest kernel's NBD device the benchmark attaches.
const NBD_DEV: &str = "/dev/nbd0";

/// On the host: boots the guest and reports.
pub fn run(opts: &GuestBenchOptions) -> Result<serde_json::Value> {
    let fio = program("fio")?;
    let nbd_client = program("nbd-client")?;
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(vm_script()?);
    cmd.args([
        "--kernel",
        "6.12",
        "--no-zoned",
        "--timeout-s",
        "3600",
        "--mem-mb",
    ])
    .arg(opts.mem_mb.to_string())
    .args(["--include", &fio, "--include", &nbd_client])
    .arg("--")
    .arg(&exe)
    .args(["bench", "blk", "--guest", "--runtime"])
    .arg(opts.runtime_secs.to_string())
    .arg("--size")
    .arg(opts.size_bytes.to_string())
    .arg("--repeats")
    .arg(opts.repeats.to_string());
    eprintln!("bench blk: booting the guest ({cmd:?})");
    let out = cmd
        .output()
        .map_err(|e| Error::io(format!("running scripts/zoned-vm: {e}")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let Some(line) = stdout.lines().find_map(|l| l.strip_prefix(RESULT_MARK)) else {
        return Err(Error::io(format!(
            "the guest printed no results ({}):\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    };
    let guest: serde_json::Value =
        serde_json::from_str(line).map_err(|e| Error::io(format!("the guest's JSON: {e}")))?;
    report(opts, &guest, accel())
}

/// The medians, the table and the JSON document from the guest's samples.
fn report(
    opts: &GuestBenchOptions,
    guest: &serde_json::Value,
    accel: &str,
) -> Result<serde_json::Value> {
    let (table, points) = three_way_points(guest, TARGETS, &POINTS, "ublk", "ublk")?;
    println!(
        "bench blk: one guest ({accel}, 2 vCPUs, {} MiB), uzram in the guest; fio 4 KiB libaio \
         O_DIRECT, 1 job, {} s per point, median of {}:",
        opts.mem_mb, opts.runtime_secs, opts.repeats
    );
    print!("{}", table.render());
    println!(
        "targets: ublk/guest-zram >= 0.5 at qd 1, >= 0.8 at qd 32; ublk/nbd >= 3 at \
         qd 1"
    );
    let (server_table, server) = server_points(guest, &points)?;
    println!(
        "ublk's queue threads (medians): time serving a request (the device's work) against \
         fio's latency (mean = iodepth / IOPS), and requests per wake-up of a queue thread (one \
         io_uring_enter each):"
    );
    print!("{}", server_table.render());
    let mut points = points;
    for (p, s) in points.iter_mut().zip(server) {
        p["ublk_server"] = s;
    }
    Ok(json!({
        "bench": "blk",
        "accel": accel,
        "runtime_secs": opts.runtime_secs,
        "size_bytes": opts.size_bytes,
        "repeats": opts.repeats,
        "guest_mem_mb": opts.mem_mb,
        "fio": "bs=4k ioengine=libaio direct=1 numjobs=1 buffer_compress_percentage=60 refill_buffers",
        "points": points,
    }))
}

/// The table and JSON of the ublk queue threads' timing ([`SERVER_KEY`]) beside fio's
/// latencies from `points` (as [`three_way_points`] made them, in [`POINTS`]' order): the p50
/// and the mean (Little's law: iodepth / IOPS, what the IOPS ratio follows) of ublk, and the
/// guest zram's mean, whose whole request is the device's work.
fn server_points(
    guest: &serde_json::Value,
    points: &[serde_json::Value],
) -> Result<(Table, Vec<serde_json::Value>)> {
    let mut table = Table::new(&[
        "rw",
        "qd",
        "ublk p50 µs",
        "ublk mean µs",
        "zram mean µs",
        "serve µs/req",
        "serve/mean",
        "reqs/wake",
    ])
    .left_align(&[0]);
    let mut out = Vec::new();
    for (&(rw, qd), point) in POINTS.iter().zip(points) {
        let samples = guest[SERVER_KEY][format!("{rw}-{qd}")]
            .as_array()
            .ok_or_else(|| Error::io(format!("no ublk server samples for {rw} {qd}")))?;
        let col = |k: usize| -> f64 {
            median(
                &samples
                    .iter()
                    .filter_map(|s| s[k].as_f64())
                    .collect::<Vec<_>>(),
            )
        };
        let (serve_us, per_wake) = (col(0), col(1));
        let p50 = point["p50_us"]["ublk"].as_f64().unwrap_or(f64::NAN);
        let mean = |t: &str| f64::from(qd) * 1e6 / point["iops"][t].as_f64().unwrap_or(f64::NAN);
        let (ublk_mean, zram_mean) = (mean("ublk"), mean("guest-zram"));
        table.row(vec![
            rw.into(),
            qd.to_string(),
            f(p50),
            f(ublk_mean),
            f(zram_mean),
            format!("{serve_us:.1}"),
            format!("{:.2}", serve_us / ublk_mean),
            format!("{per_wake:.2}"),
        ]);
        out.push(json!({
            "serve_us_per_request": serve_us,
            "requests_per_wake": per_wake,
            "ublk_mean_us": ublk_mean,
            "guest_zram_mean_us": zram_mean,
            "runs": samples,
        }));
    }
    Ok((table, out))
}

/// The guest kernel's NBD client on `socket`, as `NBD_DEV`; disconnected when dropped.
struct NbdClient;

impl NbdClient {
    fn connect(socket: &Path) -> Result<NbdClient> {
        let out = Command::new("nbd-client")
            .args(["-N", "zram0", "-b", "4096", "-unix"])
            .arg(socket)
            .arg(NBD_DEV)
            .output()
            .map_err(|e| Error::io(format!("running nbd-client: {e}")))?;
        if !out.status.success() {
            return Err(Error::io(format!(
                "nbd-client failed: {}{}",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            )));
        }
        Ok(NbdClient)
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        let _ = Command::new("nbd-client").args(["-d", NBD_DEV]).output();
    }
}

/// Inside the guest: serves a device as ublk and NBD, fills the targets, runs the points,
/// prints the samples as one JSON line.
pub fn guest(opts: &GuestBenchOptions) -> Result<()> {
    let device: Arc<dyn BlockDevice> = Arc::new(Device::new(DeviceConfig {
        disksize_bytes: opts.size_bytes,
        ..Default::default()
    })?);
    let dir = crate::nbd::tempfile_dir()?;
    let socket = dir.path.join("zram0.sock");
    let server = Server::start_unix(Export::new("zram0", Arc::clone(&device)), socket.clone())?;
    let ublk = UblkExport::start(
        "zram0",
        Arc::clone(&device),
        &UblkConfig::default(),
        uzram_service::frontend::ublk::device_tag("zram0"),
    )?;
    let nbd = NbdClient::connect(&socket)?;
    let disks: [PathBuf; 3] = [
        ublk.block_dev_path(),
        PathBuf::from(NBD_DEV),
        guest_zram(opts.size_bytes)?,
    ];
    // The ublk and NBD devices are the same uzram device: one fill serves both.
    for dev in [&disks[0], &disks[2]] {
        let args = vec![
            "--name=fill".to_string(),
            format!("--filename={}", dev.display()),
            "--ioengine=libaio".into(),
            "--direct=1".into(),
            "--rw=write".into(),
            "--bs=1M".into(),
            "--iodepth=4".into(),
            format!("--size={}", opts.size_bytes),
            "--buffer_compress_percentage=60".into(),
            "--refill_buffers".into(),
            "--output-format=json".into(),
        ];
        crate::nbd::fio(&args)?;
    }
    let mut samples: Vec<serde_json::Map<String, serde_json::Value>> =
        vec![serde_json::Map::new(); TARGETS.len()];
    let mut queue_samples = serde_json::Map::new();
    for rep in 0..opts.repeats {
        for (rw, qd) in POINTS {
            for (t, dev) in disks.iter().enumerate() {
                let before = ublk.stats();
                let (iops, p50, _ios) = fio_point(dev, rw, qd, opts.runtime_secs, opts.size_bytes)?;
                eprintln!(
                    "bench blk: run {rep}: {} {rw} qd {qd}: {iops:.0} IOPS, p50 {p50:.1} µs",
                    TARGETS[t]
                );
                if t == 0 {
                    let d = ublk.stats().since(&before);
                    let serve_us = d.serve_ns as f64 / 1000.0 / d.requests.max(1) as f64;
                    let per_wake = d.requests as f64 / d.wakes.max(1) as f64;
                    eprintln!(
                        "bench blk: run {rep}: ublk {rw} qd {qd}: {} requests, {} wake-ups, \
                         {serve_us:.1} µs serving each",
                        d.requests, d.wakes
                    );
                    queue_samples
                        .entry(format!("{rw}-{qd}"))
                        .or_insert_with(|| json!([]))
                        .as_array_mut()
                        .expect("an array")
                        .push(json!([serve_us, per_wake]));
                }
                samples[t]
                    .entry(format!("{rw}-{qd}"))
                    .or_insert_with(|| json!([]))
                    .as_array_mut()
                    .expect("an array")
                    .push(json!([iops, p50]));
            }
        }
    }
    drop(nbd);
    ublk.stop();
    server.stop();
    let _ = std::fs::write("/sys/block/zram0/reset", "1");
    let mut doc: serde_json::Map<String, serde_json::Value> = TARGETS
        .iter()
        .zip(samples)
        .map(|(t, s)| (t.to_string(), serde_json::Value::Object(s)))
        .collect();
    doc.insert(SERVER_KEY.into(), serde_json::Value::Object(queue_samples));
    println!("{RESULT_MARK}{}", serde_json::Value::Object(doc));
    Ok(())
}
