//! `uzram bench vm`: a VM guest's disk three ways, measured inside one guest in one run.
//!
//! The host side (this process) makes one uzram device (lz4, 4 KiB pages), serves it over NBD
//! on a unix socket and over vhost-user-blk, and boots one guest (`scripts/zoned-vm`:
//! Debian's 6.12 kernel under QEMU, 2 vCPUs, KVM when usable, else TCG) with two disks on that
//! same device: (a) `vhost-user-blk-pci` on the vhost-user socket (serial `zram0`), and (b)
//! a `virtio-blk-pci` disk whose drive is QEMU's own NBD client on the NBD socket (serial
//! `nbd`). Inside, this same binary (`uzram bench vm --guest`) also makes (c) the guest
//! kernel's own zram (`/dev/zram0`, lz4, the same size) and runs fio on each: 4 KiB
//! `randread` and `randwrite` at iodepth 1 and 32, `libaio`, `O_DIRECT`, one job,
//! 60%-compressible data (`buffer_compress_percentage=60`, as `bench nbd`), after a
//! sequential fill. Each point runs on the three targets in turn, `repeats` times, so drift
//! on the machine falls on all alike; the medians and the ratios vhost-user/NBD and
//! vhost-user/guest-zram are printed as a table and written as JSON. The targets:
//! vhost-user ≥ 2× NBD at iodepth 1, ≥ 0.7× the guest's kernel zram.
//!
//! Under TCG (no hardware virtualisation, as on the development machine) every guest
//! instruction is emulated: the guest's own share of each request (its block layer, virtio
//! driver, fio) costs far more than on KVM, so the ratios between the paths are compressed
//! towards 1 and say less than they would under KVM; the table says which was used.
//!
//! CPU per I/O: IOPS at depth 1 under TCG follow how much CPU the QEMU process gets (on a
//! loaded machine, a quarter of a core at times), so the same point can swing several times
//! between runs, and a ratio of IOPS says as much about the machine's load as about the paths.
//! So the host also measures the CPU each point costs: the guest prints a mark on its serial
//! stderr before and after each fio run, and at each mark the host reads the CPU time of all
//! of QEMU's threads and of all of its own (the server: the NBD and vhost-user threads)
//! from `/proc/*/task/*/schedstat` (nanoseconds). Divided by the run's I/Os, that is CPU µs
//! per I/O in QEMU (the emulated guest, its device models and QEMU's NBD client) and in the
//! server, which the machine's load changes far less than IOPS. (A mark reaches the host
//! within about 50 ms, `scripts/zoned-vm`'s polling; both ends of a window are late alike.)

use crate::{f, median, Table};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use uzram::device::{Device, DeviceConfig};
use uzram::error::{Error, Result};
use uzram::BlockDevice;
use uzram_service::frontend::nbd::{Export, Server};
use uzram_service::frontend::vhost_user::{VhostUserConfig, VhostUserExport};

/// What to run (`bench vm` and `bench blk`: one guest, fio at each point on three devices).
#[derive(Debug, Clone)]
pub struct GuestBenchOptions {
    /// Seconds per point.
    pub runtime_secs: u64,
    /// Size of the device (and of the guest's kernel zram), bytes.
    pub size_bytes: u64,
    /// Runs per point; the median is reported.
    pub repeats: usize,
    /// The guest's RAM, MiB.
    pub mem_mb: u32,
}

/// The targets, in the order they run and appear.
const TARGETS: [&str; 3] = ["vhost-user", "nbd", "guest-zram"];
/// The points: (rw, iodepth).
const POINTS: [(&str, u32); 4] = [
    ("randread", 1),
    ("randwrite", 1),
    ("randread", 32),
    ("randwrite", 32),
];
/// The line the guest prints its results on.
const RESULT_MARK: &str = "UZRAM-BENCH-VM ";
/// The lines the guest prints on stderr around each fio run of a point.
const RUN_START_MARK: &str = "UZRAM-BENCH-VM-RUN start";
const RUN_END_MARK: &str = "UZRAM-BENCH-VM-RUN end";

/// CPU time of all threads of process `pid` (`/proc/PID/task/*/schedstat`, its first field),
/// nanoseconds; 0 for a process that is gone.
fn process_cpu_ns(pid: &str) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// The QEMU whose command line names `socket`.
fn qemu_pid(socket: &Path) -> Option<String> {
    let want = socket.to_string_lossy().into_owned();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid = e.file_name().to_string_lossy().into_owned();
        pid.parse::<u32>().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmdline = String::from_utf8_lossy(&cmdline);
        (cmdline.starts_with("qemu-system") && cmdline.contains(&want)).then_some(pid)
    })
}

/// CPU nanoseconds of one fio run: QEMU's and the server's (this process's).
#[derive(Debug, Clone, Copy, Default)]
struct RunCpu {
    qemu_ns: u64,
    server_ns: u64,
}

/// The VM script of this repository (`scripts/zoned-vm`), found from the working directory
/// or from where this crate was built.
pub(crate) fn vm_script() -> Result<PathBuf> {
    let here = std::env::current_dir()?;
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .chain(built.ancestors())
        .map(|d| d.join("scripts/zoned-vm"))
        .find(|p| p.exists())
        .ok_or_else(|| Error::io("scripts/zoned-vm not found (run from the repository)"))
}

pub(crate) fn program(name: &str) -> Result<String> {
    for dir in ["/usr/bin", "/usr/sbin", "/bin", "/sbin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return Ok(p.to_string_lossy().into_owned());
        }
    }
    Err(Error::new(
        uzram::ErrorKind::NotFound,
        format!("{name} is not installed"),
    ))
}

/// On the host: serves the device, boots the guest, and reports.
pub fn run(opts: &GuestBenchOptions) -> Result<serde_json::Value> {
    let fio = program("fio")?;
    let dir = crate::nbd::tempfile_dir()?;
    let device: Arc<dyn BlockDevice> = Arc::new(Device::new(DeviceConfig {
        disksize_bytes: opts.size_bytes,
        ..Default::default()
    })?);
    let nbd_socket = dir.path.join("zram0.sock");
    let _server = Server::start_unix(
        Export::new("zram0", Arc::clone(&device)),
        nbd_socket.clone(),
    )?;
    let vhost_socket = dir.path.join("zram0.vhost.sock");
    let _vhost = VhostUserExport::start(
        "zram0",
        &vhost_socket,
        Arc::clone(&device),
        &VhostUserConfig {
            nr_queues: 2,
            swap: false,
        },
    )?;
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
    .arg("--vhost-user-blk")
    .arg(&vhost_socket)
    .args(["--vhost-queues", "2", "--include", &fio])
    .arg("--qemu-arg=-drive")
    .arg(format!(
        "--qemu-arg=driver=nbd,server.type=unix,server.path={},export=zram0,if=none,\
             id=nbd0,cache=none,aio=threads",
        nbd_socket.display()
    ))
    .arg("--qemu-arg=-device")
    .arg("--qemu-arg=virtio-blk-pci,drive=nbd0,serial=nbd,num-queues=2")
    .arg("--")
    .arg(&exe)
    .args(["bench", "vm", "--guest", "--runtime"])
    .arg(opts.runtime_secs.to_string())
    .arg("--size")
    .arg(opts.size_bytes.to_string())
    .arg("--repeats")
    .arg(opts.repeats.to_string());
    eprintln!("bench vm: booting the guest ({:?})", cmd);
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("running scripts/zoned-vm: {e}")))?;
    let mut child_out = child.stdout.take().expect("piped");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut child_out, &mut s);
        s
    });
    // The guest's stderr as it comes: at each run mark, the CPU times so far.
    let me = std::process::id().to_string();
    let mut qemu: Option<String> = None;
    let mut at_start: Option<RunCpu> = None;
    let mut runs_cpu = Vec::new();
    let mut stderr = String::new();
    for line in
        std::io::BufRead::lines(std::io::BufReader::new(child.stderr.take().expect("piped")))
    {
        let Ok(line) = line else { break };
        if line.contains(RUN_START_MARK) || line.contains(RUN_END_MARK) {
            if qemu.is_none() {
                qemu = qemu_pid(&vhost_socket);
            }
            let now = RunCpu {
                qemu_ns: qemu.as_deref().map_or(0, process_cpu_ns),
                server_ns: process_cpu_ns(&me),
            };
            if line.contains(RUN_START_MARK) {
                at_start = Some(now);
            } else if let Some(start) = at_start.take() {
                runs_cpu.push(RunCpu {
                    qemu_ns: now.qemu_ns.saturating_sub(start.qemu_ns),
                    server_ns: now.server_ns.saturating_sub(start.server_ns),
                });
            }
            continue;
        }
        // The guest's progress ("bench vm: run ..."), as it comes.
        eprintln!("{line}");
        stderr.push_str(&line);
        stderr.push('\n');
    }
    let status = child
        .wait()
        .map_err(|e| Error::io(format!("waiting for scripts/zoned-vm: {e}")))?;
    let stdout = out_reader.join().unwrap_or_default();
    let Some(line) = stdout.lines().find_map(|l| l.strip_prefix(RESULT_MARK)) else {
        return Err(Error::io(format!(
            "the guest printed no results ({status}):\n{stdout}{stderr}"
        )));
    };
    let guest: serde_json::Value =
        serde_json::from_str(line).map_err(|e| Error::io(format!("the guest's JSON: {e}")))?;
    // The runs in the guest's order (repeat, point, target), each with its CPU.
    let order: Vec<(usize, usize)> = (0..opts.repeats)
        .flat_map(|_| (0..POINTS.len()).flat_map(|p| (0..TARGETS.len()).map(move |t| (p, t))))
        .collect();
    if runs_cpu.len() != order.len() {
        return Err(Error::io(format!(
            "{} runs measured on the host, {} expected:\n{stderr}",
            runs_cpu.len(),
            order.len()
        )));
    }
    let mut cpu = vec![vec![Vec::new(); TARGETS.len()]; POINTS.len()];
    for ((p, t), c) in order.into_iter().zip(runs_cpu) {
        cpu[p][t].push(c);
    }
    report(opts, &guest, &cpu, accel())
}

/// How scripts/zoned-vm runs the guest (its kvm_usable): `kvm` when KVM is backed by
/// hardware virtualisation and ours to open, else `tcg`.
pub(crate) fn accel() -> &'static str {
    let kvm = ["kvm_intel", "kvm_amd"]
        .iter()
        .any(|m| Path::new("/sys/module").join(m).exists())
        && std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok();
    if kvm {
        "kvm"
    } else {
        "tcg"
    }
}

/// The medians, the table and the JSON document from the guest's samples.
fn report(
    opts: &GuestBenchOptions,
    guest: &serde_json::Value,
    cpu: &[Vec<Vec<RunCpu>>],
    accel: &str,
) -> Result<serde_json::Value> {
    let (table, mut points) = three_way_points(guest, TARGETS, &POINTS, "vhost", "vhost")?;
    let mut cpu_table = Table::new(&[
        "rw",
        "qd",
        "vhost-user: QEMU",
        "server",
        "nbd: QEMU",
        "server",
        "guest-zram: QEMU",
        "nbd/vhost",
    ])
    .left_align(&[0]);
    for (pi, (rw, qd)) in POINTS.into_iter().enumerate() {
        // Per target: median CPU µs per I/O of QEMU and of the server.
        let mut qemu_us = Vec::new();
        let mut server_us = Vec::new();
        for (ti, t) in TARGETS.into_iter().enumerate() {
            let samples = guest[t][format!("{rw}-{qd}")]
                .as_array()
                .ok_or_else(|| Error::io(format!("no samples for {t} {rw} {qd}")))?;
            let ios: Vec<f64> = samples.iter().filter_map(|s| s[2].as_f64()).collect();
            let per_io = |ns: fn(&RunCpu) -> u64| -> Vec<f64> {
                cpu[pi][ti]
                    .iter()
                    .zip(&ios)
                    .filter(|(_, &n)| n > 0.0)
                    .map(|(c, &n)| ns(c) as f64 / 1000.0 / n)
                    .collect()
            };
            qemu_us.push(median(&per_io(|c| c.qemu_ns)));
            server_us.push(median(&per_io(|c| c.server_ns)));
        }
        // The whole host CPU of an I/O on each path, NBD's over vhost-user's.
        let cpu_ratio = (qemu_us[1] + server_us[1]) / (qemu_us[0] + server_us[0]);
        cpu_table.row(vec![
            rw.into(),
            qd.to_string(),
            f(qemu_us[0]),
            f(server_us[0]),
            f(qemu_us[1]),
            f(server_us[1]),
            f(qemu_us[2]),
            format!("{cpu_ratio:.2}"),
        ]);
        let point = points[pi]
            .as_object_mut()
            .expect("three_way_points makes objects");
        point.insert(
            "cpu_us_per_io".into(),
            json!({
                "vhost-user": {"qemu": qemu_us[0], "server": server_us[0]},
                "nbd": {"qemu": qemu_us[1], "server": server_us[1]},
                "guest-zram": {"qemu": qemu_us[2]},
            }),
        );
        point.insert("cpu_ratio_nbd_over_vhost".into(), json!(cpu_ratio));
    }
    println!(
        "bench vm: one guest ({accel}, 2 vCPUs, {} MiB), fio 4 KiB libaio O_DIRECT, 1 job, \
         {} s per point, median of {}:",
        opts.mem_mb, opts.runtime_secs, opts.repeats
    );
    print!("{}", table.render());
    println!("targets: vhost/nbd >= 2 at qd 1; vhost/guest-zram >= 0.7");
    println!(
        "host CPU µs per I/O (median): QEMU's threads (the emulated guest, device models, \
         QEMU's NBD client) and the server's; nbd/vhost = NBD's total over vhost-user's:"
    );
    print!("{}", cpu_table.render());
    Ok(json!({
        "bench": "vm",
        "accel": accel,
        "runtime_secs": opts.runtime_secs,
        "size_bytes": opts.size_bytes,
        "repeats": opts.repeats,
        "guest_mem_mb": opts.mem_mb,
        "fio": "bs=4k ioengine=libaio direct=1 numjobs=1 buffer_compress_percentage=60 refill_buffers",
        "points": points,
    }))
}

/// Inside the guest: the disk whose serial is `serial`.
fn disk_with_serial(serial: &str) -> Result<PathBuf> {
    for e in std::fs::read_dir("/sys/block")? {
        let e = e?;
        let s = std::fs::read_to_string(e.path().join("serial")).unwrap_or_default();
        if s.trim() == serial {
            return Ok(Path::new("/dev").join(e.file_name()));
        }
    }
    Err(Error::io(format!(
        "no disk with serial {serial} in the guest"
    )))
}

/// Inside the guest: the guest kernel's zram0 of `size_bytes`, lz4.
pub(crate) fn guest_zram(size_bytes: u64) -> Result<PathBuf> {
    let sys = Path::new("/sys/block/zram0");
    if !sys.exists() {
        return Err(Error::io("no /sys/block/zram0 in the guest (zram module)"));
    }
    std::fs::write(sys.join("comp_algorithm"), "lz4")?;
    std::fs::write(sys.join("disksize"), size_bytes.to_string())?;
    Ok(PathBuf::from("/dev/zram0"))
}

pub(crate) fn fio_point(
    dev: &Path,
    rw: &str,
    qd: u32,
    runtime_secs: u64,
    size_bytes: u64,
) -> Result<(f64, f64, f64)> {
    let args = vec![
        "--name=uzram-bench-vm".to_string(),
        format!("--filename={}", dev.display()),
        "--ioengine=libaio".into(),
        "--direct=1".into(),
        format!("--rw={rw}"),
        "--bs=4k".into(),
        format!("--iodepth={qd}"),
        "--numjobs=1".into(),
        "--time_based".into(),
        format!("--runtime={runtime_secs}"),
        format!("--size={size_bytes}"),
        "--buffer_compress_percentage=60".into(),
        "--refill_buffers".into(),
        "--norandommap".into(),
        "--unified_rw_reporting=mixed".into(),
        "--output-format=json".into(),
    ];
    eprintln!("{RUN_START_MARK}");
    let v = crate::nbd::fio(&args);
    eprintln!("{RUN_END_MARK}");
    let v = v?;
    let mixed = &v["jobs"][0]["mixed"];
    let iops = mixed["iops"]
        .as_f64()
        .ok_or_else(|| Error::io("fio's JSON has no mixed.iops"))?;
    let p50 = mixed["clat_ns"]["percentile"]["50.000000"]
        .as_f64()
        .map_or(f64::NAN, |ns| ns / 1000.0);
    let ios = mixed["total_ios"]
        .as_f64()
        .ok_or_else(|| Error::io("fio's JSON has no mixed.total_ios"))?;
    Ok((iops, p50, ios))
}

/// Inside the guest: fills the targets, runs the points, prints the samples as one JSON line.
pub fn guest(opts: &GuestBenchOptions) -> Result<()> {
    let disks = [
        disk_with_serial("zram0")?,
        disk_with_serial("nbd")?,
        guest_zram(opts.size_bytes)?,
    ];
    // The vhost-user and NBD disks are the same uzram device: one fill serves both.
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
    for rep in 0..opts.repeats {
        for (rw, qd) in POINTS {
            for (t, dev) in disks.iter().enumerate() {
                let (iops, p50, ios) = fio_point(dev, rw, qd, opts.runtime_secs, opts.size_bytes)?;
                eprintln!(
                    "bench vm: run {rep}: {} {rw} qd {qd}: {iops:.0} IOPS, p50 {p50:.1} µs",
                    TARGETS[t]
                );
                samples[t]
                    .entry(format!("{rw}-{qd}"))
                    .or_insert_with(|| json!([]))
                    .as_array_mut()
                    .expect("an array")
                    .push(json!([iops, p50, ios]));
            }
        }
    }
    // The host reads QEMU's CPU time when the last run's end mark reaches it (zoned-vm
    // passes stderr on every 50 ms): the guest stays up a moment, or QEMU may already have
    // exited after printing the results, and that run's CPU read as 0.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let doc: serde_json::Map<String, serde_json::Value> = TARGETS
        .iter()
        .zip(samples)
        .map(|(t, s)| (t.to_string(), serde_json::Value::Object(s)))
        .collect();
    println!("{RESULT_MARK}{}", serde_json::Value::Object(doc));
    Ok(())
}

/// The table and the JSON points of a three-way guest benchmark (`bench vm`, `bench blk`):
/// per point the median IOPS and p50 of each of `targets` (the first is uzram's frontend, the
/// second the NBD path, the third the guest's zram) from the guest's samples, and the ratios of
/// the first over the other two, labelled `SHORT/nbd` in the table and `ratio_KEY_over_…` in
/// the JSON.
pub(crate) fn three_way_points(
    guest: &serde_json::Value,
    targets: [&str; 3],
    points: &[(&str, u32)],
    short: &str,
    key: &str,
) -> Result<(Table, Vec<serde_json::Value>)> {
    let names: Vec<String> = targets.iter().map(|t| format!("{t} IOPS")).collect();
    let (vs_nbd_col, vs_zram_col) = (format!("{short}/nbd"), format!("{short}/guest-zram"));
    let mut table = Table::new(&[
        "rw",
        "qd",
        &names[0],
        "p50 µs",
        &names[1],
        "p50 µs",
        &names[2],
        "p50 µs",
        &vs_nbd_col,
        &vs_zram_col,
    ])
    .left_align(&[0]);
    let mut out = Vec::new();
    for &(rw, qd) in points {
        let mut iops = Vec::new();
        let mut p50 = Vec::new();
        let mut runs = serde_json::Map::new();
        for t in targets {
            let samples = guest[t][format!("{rw}-{qd}")]
                .as_array()
                .ok_or_else(|| Error::io(format!("no samples for {t} {rw} {qd}")))?;
            let i: Vec<f64> = samples.iter().filter_map(|s| s[0].as_f64()).collect();
            let l: Vec<f64> = samples.iter().filter_map(|s| s[1].as_f64()).collect();
            iops.push(median(&i));
            p50.push(median(&l));
            runs.insert(t.into(), json!(samples));
        }
        let vs_nbd = iops[0] / iops[1];
        let vs_zram = iops[0] / iops[2];
        table.row(vec![
            rw.into(),
            qd.to_string(),
            f(iops[0]),
            f(p50[0]),
            f(iops[1]),
            f(p50[1]),
            f(iops[2]),
            f(p50[2]),
            format!("{vs_nbd:.2}"),
            format!("{vs_zram:.2}"),
        ]);
        let by_target = |v: &[f64]| -> serde_json::Map<String, serde_json::Value> {
            targets
                .iter()
                .zip(v)
                .map(|(t, x)| (t.to_string(), json!(x)))
                .collect()
        };
        let mut point = serde_json::Map::new();
        point.insert("rw".into(), json!(rw));
        point.insert("iodepth".into(), json!(qd));
        point.insert("iops".into(), by_target(&iops).into());
        point.insert("p50_us".into(), by_target(&p50).into());
        point.insert(format!("ratio_{key}_over_nbd"), json!(vs_nbd));
        point.insert(format!("ratio_{key}_over_guest_zram"), json!(vs_zram));
        point.insert("runs".into(), runs.into());
        out.push(point.into());
    }
    Ok((table, out))
}
