//! `uzram serve --ublk`: the device as a kernel block device `/dev/ublkbN`.
//!
//! This host has no `ublk_drv`, so the block device tests boot Debian's 6.12 kernel in a VM
//! (`scripts/zoned-vm --kernel 6.12 --no-zoned`, see `uzram_testkit::vm`) and run themselves
//! inside, with the built `uzram` and the real e2fsprogs. Here, on the host, a missing
//! `ublk_drv` must be one clear line.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use uzram_testkit::pages::PAGE;
use uzram_testkit::process::{host_program, run_stdout as run, wait_timeout};
use uzram_testkit::serve::{ctl_in, Running, Serve};
use uzram_testkit::vm::{mem_total_bytes, swap_under_hog};

const UZRAM: &str = env!("CARGO_BIN_EXE_uzram");

/// The VM: Linux 6.12 (ublk_drv), no zoned device, uzram and e2fsprogs inside.
fn vm_args(mem_mb: u32) -> Vec<String> {
    let mut a: Vec<String> = ["--kernel", "6.12", "--no-zoned", "--mem-mb"]
        .map(String::from)
        .to_vec();
    a.push(mem_mb.to_string());
    for inc in [
        UZRAM.to_string(),
        host_program("mkfs.ext4"),
        host_program("e2fsck"),
        host_program("fio"),
        host_program("nbd-client"),
        "/etc/mke2fs.conf".to_string(),
    ] {
        a.push("--include".into());
        a.push(inc);
    }
    a
}

/// A running `uzram serve --ublk` and its block device.
struct Server {
    r: Running,
    block_dev: PathBuf,
}

fn serve(extra: &[&str]) -> Server {
    let r = Serve::args(&["--ublk", "--socket", "{dir}/zram0.sock"])
        .arg(extra)
        .start();
    let lines = r.banner();
    for line in &lines {
        println!("uzram serve: {line}");
    }
    let block_dev = lines
        .iter()
        .flat_map(|l| l.split_whitespace())
        .find(|w| w.starts_with("/dev/ublkb"))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("uzram serve --ublk printed no /dev/ublkbN: {}", r.log()));
    Server { r, block_dev }
}

fn sysfs(dev: &Path, attr: &str) -> String {
    let name = dev.file_name().unwrap().to_str().unwrap();
    std::fs::read_to_string(format!("/sys/block/{name}/{attr}"))
        .unwrap_or_else(|e| panic!("/sys/block/{name}/{attr}: {e}"))
        .trim()
        .to_string()
}

#[test]
fn missing_ublk_drv_is_one_clear_line() {
    if Path::new("/dev/ublk-control").exists() {
        // This host has ublk_drv: the VM tests below are this test's counterpart.
        eprintln!("ublk_drv is loaded here; nothing to check");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(UZRAM)
        .args(["serve", "--ublk", "--disksize", "16M", "--socket"])
        .arg(dir.path().join("zram0.sock"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("ublk_drv") && err.contains("modprobe ublk_drv"),
        "{err}"
    );
    // Nothing was left behind: no socket.
    assert!(!dir.path().join("zram0.sock").exists());
}

/// Files of real pages: the running server's own memory (a real program's anonymous pages)
/// and its code, plus same-filled and zero pages; (name, contents).
fn real_files(server_pid: u32) -> Vec<(&'static str, Vec<u8>)> {
    let mut memory = Vec::new();
    let pages =
        uzram_bench::corpus::snapshot_pid(server_pid, 4096, 8192, &mut memory).expect("snapshot");
    assert!(pages > 100, "only {pages} pages of the server's memory");
    let code = std::fs::read(UZRAM).unwrap();
    let mut same = Vec::new();
    for i in 0..1024u32 {
        same.extend_from_slice(&[(i % 7) as u8 * 0x11; 4096]);
    }
    vec![
        ("memory", memory),
        ("code", code),
        ("same-filled", same),
        ("zeroes", vec![0; 3 << 20]),
    ]
}

#[test]
fn ublk_filesystem_in_vm() {
    if !uzram_testkit::vm::in_vm_or_boot("ublk_filesystem_in_vm", &vm_args(1024)) {
        return;
    }
    let s = serve(&["--disksize", "256M"]);
    let dev = s.block_dev.clone();
    let dir = s.r.dir().to_path_buf();
    assert!(dev.exists(), "{} does not exist", dev.display());
    // zram's geometry: 4 KiB blocks, discard in pages, the device's size.
    assert_eq!(sysfs(&dev, "size"), (256u64 << 20 >> 9).to_string());
    assert_eq!(sysfs(&dev, "queue/logical_block_size"), "4096");
    assert_eq!(sysfs(&dev, "queue/discard_granularity"), "4096");
    let status = run(Command::new(UZRAM)
        .args(["status", "-o", "NAME,BLOCK-DEV", "--dir"])
        .arg(&dir));
    assert!(status.contains(dev.to_str().unwrap()), "{status}");

    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&dev));
    let mnt = dir.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mount = || {
        run(Command::new("mount")
            .args(["-t", "ext4"])
            .arg(&dev)
            .arg(&mnt))
    };
    let umount = || run(Command::new("umount").arg(&mnt));
    mount();
    // zramctl's MOUNTPOINT, through the block device.
    let status = run(Command::new(UZRAM)
        .args(["status", "-o", "NAME,MOUNTPOINT", "--raw", "-n", "--dir"])
        .arg(&dir));
    assert_eq!(
        status.trim_end(),
        format!("zram0 {}", mnt.display()),
        "{status}"
    );
    let files = real_files(s.r.pid());
    for (name, data) in &files {
        std::fs::write(mnt.join(name), data).unwrap();
    }
    // While mounted, reset is EBUSY (uzram ctl exits with the errno), as zram's.
    let reset = Command::new(UZRAM)
        .args(["ctl", "--dir"])
        .arg(&dir)
        .args(["reset", "1"])
        .output()
        .unwrap();
    assert_eq!(
        reset.status.code(),
        Some(libc::EBUSY),
        "{}",
        String::from_utf8_lossy(&reset.stderr)
    );
    umount();
    run(Command::new("e2fsck").args(["-f", "-n"]).arg(&dev));
    // Nothing cached above the device: what is read next comes from uzram.
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    mount();
    for (name, data) in &files {
        let back = std::fs::read(mnt.join(name)).unwrap();
        assert!(back == *data, "{name} differs after remount");
    }
    umount();
    let mm = run(Command::new(UZRAM)
        .args(["ctl", "--dir"])
        .arg(&dir)
        .arg("mm_stat"));
    let orig: u64 = mm.split_whitespace().next().unwrap().parse().unwrap();
    assert!(orig > 8 << 20, "mm_stat {mm}");

    hot_add_and_remove_block_device(&dir);

    stop(s);
}

/// `uzram ctl --dir DIR ARGS...`: (exit status, stdout, stderr).
fn ctl(dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let o = ctl_in(dir, args);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `hot_add` on a `--ublk` server: the new device gets its `/dev/ublkbN` once `disksize` is
/// set (a ublk device's size is fixed when it is added); `hot_remove` is `EBUSY` while a
/// filesystem on it is mounted, then removes the block device with the rest.
fn hot_add_and_remove_block_device(dir: &Path) {
    let (code, id, err) = ctl(dir, &["hot_add"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(id, "1\n");
    let (code, _, err) = ctl(dir, &["--dev", "zram1", "block_dev"]);
    assert_ne!(code, Some(0), "a block device before disksize: {err}");
    let (code, _, err) = ctl(dir, &["--dev", "zram1", "disksize", "64M"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, path, err) = ctl(dir, &["--dev", "zram1", "block_dev"]);
    assert_eq!(code, Some(0), "{err}");
    let dev = PathBuf::from(path.trim());
    assert!(dev.exists(), "{} does not exist", dev.display());
    assert_eq!(sysfs(&dev, "size"), (64u64 << 20 >> 9).to_string());
    let status = run(Command::new(UZRAM)
        .args([
            "status",
            "-o",
            "NAME,DISKSIZE,BLOCK-DEV",
            "--raw",
            "-n",
            "--dir",
        ])
        .arg(dir));
    assert!(
        status.contains(&format!("zram1 64M {}", dev.display())),
        "{status}"
    );
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&dev));
    let mnt = dir.join("mnt1");
    std::fs::create_dir(&mnt).unwrap();
    run(Command::new("mount")
        .args(["-t", "ext4"])
        .arg(&dev)
        .arg(&mnt));
    std::fs::write(mnt.join("f"), vec![0x5a; 1 << 20]).unwrap();
    let (code, _, err) = ctl(dir, &["hot_remove", "1"]);
    assert_eq!(code, Some(libc::EBUSY), "hot_remove while mounted: {err}");
    run(Command::new("umount").arg(&mnt));
    run(Command::new("e2fsck").args(["-f", "-n"]).arg(&dev));
    let (code, _, err) = ctl(dir, &["hot_remove", "1"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!dev.exists(), "{} outlived hot_remove", dev.display());
    assert!(!dir.join("zram1.ctl").exists() && !dir.join("zram1.sock").exists());
    let (code, _, _) = ctl(dir, &["hot_remove", "1"]);
    assert_eq!(code, Some(libc::ENODEV));
}

/// SIGTERM: the server removes the block device and exits 0, in seconds.
fn stop(mut s: Server) {
    let dev = s.block_dev.clone();
    s.r.signal("-TERM");
    let st = s.r.wait_exit(Duration::from_secs(30));
    let err = s.r.log();
    assert!(st.success(), "{st}: {err}");
    assert!(err.contains(&format!("removed {}", dev.display())), "{err}");
    assert!(!dev.exists(), "{} still exists", dev.display());
}

/// Not a test of its own: the watch of [`swap_hog`]. Run as a separate process (this binary,
/// filtered to this name, `UZRAM_SYSRQ_HELPER` set), it locks all its memory, then every 20 s
/// copies `/proc/meminfo`'s first lines and `/proc/vmstat`'s swap counters to its standard
/// error, asks the kernel for the blocked tasks (sysrq `w`) and every CPU's backtrace (`l`),
/// and copies the kernel log (`/dev/kmsg`) there too: so a stalled swap shows where it waits.
/// Under memory pressure a thread of the hog could not: a new process, a string or a page of
/// its own may all wait for the memory that the stall holds; this loop allocates nothing
/// after its start (fixed buffers, files opened once).
#[test]
fn sysrq_helper() {
    use std::io::{Read, Seek, Write};
    if std::env::var_os("UZRAM_SYSRQ_HELPER").is_none() {
        return;
    }
    // SAFETY: mlockall takes flags only.
    let rc = unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) };
    assert_eq!(rc, 0, "mlockall: {}", std::io::Error::last_os_error());
    let open = |p: &str| std::fs::File::open(p).unwrap();
    let mut trigger = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/sysrq-trigger")
        .unwrap();
    let mut meminfo = open("/proc/meminfo");
    let mut vmstat = open("/proc/vmstat");
    let mut kmsg = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
        .unwrap();
    let _ = kmsg.seek(std::io::SeekFrom::End(0));
    let mut err = std::io::stderr().lock();
    let mut buf = vec![0u8; 64 << 10];
    let _ = err.write_all(b"watch: started\n");
    loop {
        std::thread::sleep(Duration::from_secs(20));
        for f in [&mut meminfo, &mut vmstat] {
            let _ = f.seek(std::io::SeekFrom::Start(0));
            let n = f.read(&mut buf).unwrap_or(0);
            for line in buf[..n].split(|&b| b == b'\n') {
                for key in [
                    &b"MemFree"[..],
                    b"MemAvail",
                    b"Mlocked",
                    b"SwapFree",
                    b"AnonPages",
                    b"pswp",
                ] {
                    if line.starts_with(key) {
                        let _ = err.write_all(line);
                        let _ = err.write_all(b"\n");
                    }
                }
            }
        }
        let _ = trigger.write_all(b"w");
        let _ = trigger.write_all(b"l");
        // Each read is one record: "level,seq,time,flags;text\n".
        let mut lines = 0;
        while let Ok(n) = kmsg.read(&mut buf) {
            if n == 0 || lines > 400 {
                break;
            }
            lines += 1;
            let text = buf[..n]
                .splitn(2, |&b| b == b';')
                .nth(1)
                .unwrap_or(&buf[..n]);
            let _ = err.write_all(text);
        }
    }
}

/// Starts [`sysrq_helper`]; the kernel console shows every message from here on.
fn start_sysrq_helper() -> Child {
    std::fs::write("/proc/sys/kernel/printk", "7").unwrap();
    std::fs::write("/proc/sys/kernel/sysrq", "1").unwrap();
    let _ = std::fs::write("/proc/sys/kernel/hung_task_timeout_secs", "30");
    Command::new(std::env::current_exe().unwrap())
        .args(["sysrq_helper", "--exact", "--nocapture"])
        .env("UZRAM_SYSRQ_HELPER", "1")
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// Swap on `dev`: `mkswap`, `swapon`, then a memory hog 1.05 times the guest's RAM of
/// same-filled, compressible and random pages, pushed out by pressure and `MADV_PAGEOUT`,
/// every page verified, twice with different contents; swap really used (pswpout, pswpin);
/// `swapoff`. [`sysrq_helper`] watches meanwhile.
fn swap_hog(dev: &Path) {
    let pages = (mem_total_bytes() * 21 / 20) as usize / PAGE;
    let mut helper = start_sysrq_helper();
    let (out, inn) = swap_under_hog(dev, pages, true, true);
    let _ = helper.kill();
    let _ = helper.wait();
    assert!(out as usize > pages / 2, "pswpout {out} for {pages} pages");
    assert!(inn > 0, "pswpin {inn}");
}

/// Swap on /dev/ublkb0 (`serve --swap`, docs/ublk.md "Swap on ublk"): [`swap_hog`], and reset
/// is EBUSY while swapped on; then the same over the guest kernel's NBD client
/// ([`nbd_client_swap`]). With `UZRAM_SWAP_CONTROL` set, the same hog runs first on the
/// guest's own kernel zram (lz4, same size): the control used to tell the hog's faults from
/// uzram's (not in CI: it doubles the run).
#[test]
fn ublk_swap_in_vm() {
    let mut args = vm_args(512);
    // Two rounds of a hog larger than RAM under emulation on ublk (3 minutes each on the
    // loaded 2-core machine), then on the kernel's NBD client, where the hog's cgroup makes it
    // swap more (11 minutes for both rounds).
    args.extend(["--timeout-s".to_string(), "2400".to_string()]);
    if !uzram_testkit::vm::in_vm_or_boot("ublk_swap_in_vm", &args) {
        return;
    }
    if std::env::var_os("UZRAM_SWAP_CONTROL").is_some() {
        std::fs::write("/sys/block/zram0/comp_algorithm", "lz4").unwrap();
        std::fs::write("/sys/block/zram0/disksize", "1G").unwrap();
        swap_hog(Path::new("/dev/zram0"));
        println!(
            "kernel zram mm_stat: {}",
            std::fs::read_to_string("/sys/block/zram0/mm_stat").unwrap()
        );
        std::fs::write("/sys/block/zram0/reset", "1").unwrap();
    }
    let s = serve(&["--disksize", "1G", "--swap"]);
    let dev = s.block_dev.clone();
    let dir = s.r.dir().to_path_buf();
    run(Command::new("mkswap").arg(&dev));
    run(Command::new("swapon").arg(&dev));
    // While swapped on, reset is EBUSY.
    let reset = Command::new(UZRAM)
        .args(["ctl", "--dir"])
        .arg(&dir)
        .args(["reset", "1"])
        .output()
        .unwrap();
    assert_eq!(reset.status.code(), Some(libc::EBUSY));
    run(Command::new("swapoff").arg(&dev));
    swap_hog(&dev);
    let mm = run(Command::new(UZRAM)
        .args(["ctl", "--dir"])
        .arg(&dir)
        .arg("mm_stat"));
    println!("uzram mm_stat after the hog: {mm}");
    stop(s);
    nbd_client_swap();
}

/// This process in a memory cgroup of its own (cgroup v2, mounted here if need be) whose
/// `memory.max` is `max_bytes`, until dropped: its memory is reclaimed (swapped out) within
/// the cgroup, while the rest of the machine (the server) keeps free memory.
struct HogCgroup {
    path: PathBuf,
}

impl HogCgroup {
    fn new(max_bytes: u64) -> HogCgroup {
        let root = Path::new("/sys/fs/cgroup");
        if !root.join("cgroup.controllers").exists() {
            run(Command::new("mount")
                .args(["-t", "cgroup2", "none"])
                .arg(root));
        }
        std::fs::write(root.join("cgroup.subtree_control"), "+memory").unwrap();
        let path = root.join("uzram-hog");
        let _ = std::fs::create_dir(&path);
        std::fs::write(path.join("memory.max"), max_bytes.to_string()).unwrap();
        std::fs::write(path.join("cgroup.procs"), std::process::id().to_string()).unwrap();
        HogCgroup { path }
    }
}

impl Drop for HogCgroup {
    fn drop(&mut self) {
        let root = Path::new("/sys/fs/cgroup");
        let _ = std::fs::write(root.join("cgroup.procs"), std::process::id().to_string());
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// The same hog over the guest kernel's own NBD client: `nbd-client` connects `/dev/nbd0` to
/// a `uzram serve --swap` (NBD only) on its unix socket, and the guest swaps on it.
fn nbd_client_swap() {
    let r = Serve::args(&["--disksize", "1G", "--swap", "--socket", "{dir}/zram0.sock"]).start();
    let socket = r.socket("zram0");
    let dev = Path::new("/dev/nbd0");
    // Netlink (the default): the kernel holds the socket, nbd-client exits once connected.
    run(Command::new("nbd-client")
        .args(["-N", "zram0", "-b", "4096", "-swap", "-unix"])
        .arg(&socket)
        .arg(dev));
    assert_eq!(sysfs(dev, "size"), (1u64 << 30 >> 9).to_string());
    // The hog in a cgroup whose memory.max is a quarter of the guest's RAM (docs/serve.md,
    // "Swap over the kernel's NBD client"): the server's reply to a swap-in or swap-out is a
    // unix-socket send, which allocates kernel memory (an skb) that no userspace server can
    // reserve ahead; without free memory it waits in direct reclaim for the swap-outs it
    // serves. Seen here with the hog at half the RAM (the server's locked memory being most
    // of the rest): the connection thread in `try_to_free_pages` under `alloc_skb_with_frags`
    // from `unix_stream_sendmsg`, MemFree 6 MiB, for minutes.
    let cgroup = HogCgroup::new(mem_total_bytes() / 4);
    swap_hog(dev);
    println!(
        "hog cgroup memory.events: {}",
        std::fs::read_to_string(cgroup.path.join("memory.events"))
            .unwrap_or_default()
            .replace('\n', ", ")
    );
    drop(cgroup);
    run(Command::new("nbd-client").arg("-d").arg(dev));
    r.stop_within(Duration::from_secs(30));
}

/// fio's verifying writers at depth 32 on the device, then a server killed with I/O in
/// flight: the I/O fails, nothing hangs, the block device goes away and the device left
/// behind is deleted by `uzram ublk-delete`.
#[test]
fn ublk_fio_and_kill_in_vm() {
    if !uzram_testkit::vm::in_vm_or_boot("ublk_fio_and_kill_in_vm", &vm_args(1024)) {
        return;
    }
    let s = serve(&["--disksize", "1G"]);
    let dev = s.block_dev.clone();
    // fio: four writers at queue depth 32, each on its own quarter, every block verified
    // (crc32c) after it is written; buffers half compressible.
    let fio = run(Command::new("fio")
        .args([
            "--name=verify",
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--numjobs=4",
            "--size=32M",
            "--offset_increment=256M",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
            "--buffer_compress_percentage=50",
            "--refill_buffers",
            "--group_reporting",
        ])
        .arg(format!("--filename={}", dev.display())));
    assert!(fio.contains("err= 0"), "{fio}");

    // kill -9 with I/O in flight: the I/O fails, nothing hangs, the block device goes away,
    // and the device left behind can be deleted.
    let mut s = s;
    let mut load = Command::new("fio")
        .args([
            "--name=load",
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=32",
            "--numjobs=2",
            "--time_based",
            "--runtime=60",
        ])
        .arg(format!("--filename={}", dev.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert!(load.try_wait().unwrap().is_none(), "fio ended early");
    s.r.child.kill().unwrap();
    s.r.child.wait().unwrap();
    let st = wait_timeout(&mut load, Duration::from_secs(30)).expect("fio ended after the kill");
    assert!(!st.success(), "fio saw no error after the server died");
    let end = Instant::now() + Duration::from_secs(30);
    while dev.exists() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!dev.exists(), "{} outlived its server", dev.display());
    let id = dev
        .to_str()
        .unwrap()
        .trim_start_matches("/dev/ublkb")
        .to_string();
    let cdev = format!("/dev/ublkc{id}");
    assert!(Path::new(&cdev).exists(), "{cdev}");
    run(Command::new(UZRAM).args(["ublk-delete", &id]));
    assert!(!Path::new(&cdev).exists(), "{cdev} was not deleted");
    // A new server gets a block device again.
    let s2 = serve(&["--disksize", "64M"]);
    stop(s2);
}

/// `uzram serve --keeper --ublk` (and `extra` arguments) with its block device, for the tests
/// that kill its server.
struct Kept {
    k: uzram_testkit::serve::Kept,
    dev: PathBuf,
}

impl Kept {
    fn start(extra: &[&str]) -> Kept {
        let k = uzram_testkit::serve::Kept::start(
            Serve::args(&["--ublk", "--socket", "{dir}/zram0.sock"]).arg(extra),
        );
        let dev =
            k.r.banner()
                .iter()
                .flat_map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
                .find(|w| w.starts_with("/dev/ublkb"))
                .map(PathBuf::from)
                .unwrap_or_else(|| panic!("no /dev/ublkbN: {:?} {}", k.r.lines(), k.r.log()));
        Kept { k, dev }
    }

    /// The keeper's serving child.
    fn child(&self) -> u32 {
        self.k.child()
    }

    /// `kill -9` the serving child once it has served 10 s, and waits until the next one
    /// serves, the block device still there.
    fn kill_child(&self) {
        let took = self.k.kill_child();
        // Under emulation (TCG): comparable only with other times of the same run.
        println!(
            "kill {}: the next server serves /dev/ublkb0 {:.2} s after the kill",
            self.kills(),
            took.as_secs_f64()
        );
        assert!(
            self.dev.exists(),
            "{} went away with its server",
            self.dev.display()
        );
    }

    /// The kills so far.
    fn kills(&self) -> usize {
        self.k.kills()
    }

    /// The keeper.
    fn r(&self) -> &Running {
        &self.k.r
    }

    /// SIGTERM to the keeper: its server stops and removes the block device.
    fn stop(mut self) {
        self.k.r.signal("-TERM");
        let st = self.k.r.wait_exit(Duration::from_secs(30));
        assert!(st.success(), "{st}: {}", self.k.r.log());
        assert!(
            !self.dev.exists(),
            "{} outlived the keeper's stop",
            self.dev.display()
        );
    }
}

/// A server kept by `uzram serve --keeper`, killed (`kill -9`) ten times and upgraded once
/// (`uzram ctl upgrade`) while fio's verifying writers, then an ext4 file system, use
/// `/dev/ublkb0` (and raw pages a second device added by `hot_add`, from the eighth kill on):
/// the block devices stay, each new server takes them over (ublk user recovery:
/// the requests in flight at the kill are issued again, the later ones waited), and no user of
/// the device sees an error: every fio round verifies every block it wrote, the files (real
/// pages) read back, `e2fsck -fn` is clean, and the kernel logs no I/O error.
#[test]
fn ublk_keeper_kill_in_vm() {
    if !uzram_testkit::vm::in_vm_or_boot("ublk_keeper_kill_in_vm", &vm_args(1024)) {
        return;
    }
    let k = Kept::start(&["--disksize", "1G"]);
    let (r, dev) = (k.r(), &k.dev);
    let child = || k.child();
    let kill_child = || k.kill_child();

    // fio rounds, each writing and verifying (crc32c) its blocks, one after another while the
    // server is killed seven times.
    let done = std::sync::atomic::AtomicBool::new(false);
    let rounds = std::thread::scope(|s| {
        let fio = s.spawn(|| {
            let mut rounds = 0;
            while rounds == 0 || !done.load(std::sync::atomic::Ordering::Relaxed) {
                let out = run(Command::new("fio")
                    .args([
                        "--name=verify",
                        "--ioengine=io_uring",
                        "--direct=1",
                        "--rw=randwrite",
                        "--bs=4k",
                        "--iodepth=16",
                        "--numjobs=2",
                        "--size=16M",
                        "--offset_increment=256M",
                        "--verify=crc32c",
                        "--verify_fatal=1",
                        "--do_verify=1",
                        "--buffer_compress_percentage=50",
                        "--refill_buffers",
                        "--group_reporting",
                    ])
                    .arg(format!("--randseed={rounds}"))
                    .arg(format!("--filename={}", dev.display())));
                assert!(out.contains("err= 0"), "fio round {rounds}: {out}");
                rounds += 1;
            }
            rounds
        });
        for _ in 0..7 {
            kill_child();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        fio.join().unwrap()
    });
    println!("fio: {rounds} rounds verified across 7 kills");

    // A device added by hot_add gets its own block device, written raw with real pages: it is
    // taken over at every later kill and the upgrade too.
    let dir = r.dir().to_path_buf();
    let (code, id, err) = ctl(&dir, &["hot_add"]);
    assert_eq!((code, id.as_str()), (Some(0), "1\n"), "{err}");
    let (code, _, err) = ctl(&dir, &["--dev", "zram1", "disksize", "64M"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, path, err) = ctl(&dir, &["--dev", "zram1", "block_dev"]);
    assert_eq!(code, Some(0), "{err}");
    let dev1 = PathBuf::from(path.trim());
    let (_, memory) = real_files(child()).swap_remove(0);
    let raw = &memory[..memory.len().min(32 << 20) / PAGE * PAGE];
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().write(true).open(&dev1).unwrap();
        f.write_all(raw).unwrap();
        f.sync_all().unwrap();
    }

    // ext4 with files of real pages, written and read back across three more kills.
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(dev));
    let mnt = r.dir().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    run(Command::new("mount")
        .args(["-t", "ext4"])
        .arg(dev)
        .arg(&mnt));
    let files = real_files(child());
    let (first, rest) = files.split_at(files.len() / 2);
    std::thread::scope(|s| {
        let w = s.spawn(|| {
            for (name, data) in first {
                std::fs::write(mnt.join(name), data).unwrap();
            }
            // SAFETY: sync takes no arguments.
            unsafe { libc::sync() };
        });
        kill_child();
        w.join().unwrap();
    });
    for (name, data) in rest {
        std::fs::write(mnt.join(name), data).unwrap();
    }
    // SAFETY: sync takes no arguments.
    unsafe { libc::sync() };
    kill_child();
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    for (name, data) in &files {
        let back = std::fs::read(mnt.join(name)).unwrap();
        assert!(back == *data, "{name} differs after the kills");
    }
    // An upgrade (to the binary now at the keeper's path: this one) while files are written:
    // the old server leaves the block device to the new one, which takes it over.
    let more = real_files(child());
    std::thread::scope(|s| {
        let w = s.spawn(|| {
            for (name, data) in &more {
                std::fs::write(mnt.join(format!("more-{name}")), data).unwrap();
            }
            // SAFETY: sync takes no arguments.
            unsafe { libc::sync() };
        });
        let old = child();
        let o = r.ctl(&["upgrade"]);
        let said = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(
            o.status.success() && said.starts_with("upgraded to uzram "),
            "{said}: {}",
            r.log()
        );
        assert_ne!(child(), old);
        assert!(dev.exists(), "{} went away in the upgrade", dev.display());
        w.join().unwrap();
    });
    assert!(r.log().contains("left /dev/ublkb"), "{}", r.log());
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    for (name, data) in &more {
        let back = std::fs::read(mnt.join(format!("more-{name}"))).unwrap();
        assert!(back == *data, "more-{name} differs after the upgrade");
    }
    run(Command::new("umount").arg(&mnt));
    kill_child();
    run(Command::new("e2fsck").args(["-f", "-n"]).arg(dev));
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    let back = std::fs::read(&dev1).unwrap();
    assert!(
        back[..raw.len()] == *raw,
        "{} (hot_add) does not read back",
        dev1.display()
    );
    assert_eq!(k.kills(), 10);
    let log = r.log();
    let taken = |name: &str| {
        log.lines()
            .filter(|l| l.contains(&format!("{name}: /dev/ublkb")) && l.contains("taken over"))
            .count()
    };
    assert_eq!(taken("zram0"), 11, "ten kills and an upgrade: {log}");
    assert_eq!(
        taken("zram1"),
        4,
        "three kills and an upgrade after hot_add: {log}"
    );
    let errors = uzram_testkit::vm::kernel_log_lines(&["I/O error", "EXT4-fs error", "Buffer I/O"]);
    assert!(errors.is_empty(), "the kernel logged errors: {errors:#?}");

    k.stop();
}

/// Swap on `/dev/ublkb0` of a kept server (`--keeper --swap`), killed (`kill -9`) ten times
/// while a hog twice its memory cgroup's `memory.max` fills its pages and checks every one,
/// round after round: each new server takes the block device over, the swap-outs and
/// swap-ins in flight at a kill are issued again and the others wait, and not one page is
/// wrong, nor a swap I/O error logged. (The hog's cgroup keeps the pressure to the hog, as on
/// a host whose workloads run in cgroups: a new server starts with the memory it needs.)
#[test]
fn ublk_keeper_swap_kill_in_vm() {
    if !uzram_testkit::vm::in_vm_or_boot("ublk_keeper_swap_kill_in_vm", &vm_args(1024)) {
        return;
    }
    let k = Kept::start(&["--disksize", "1G", "--swap"]);
    run(Command::new("mkswap").arg(&k.dev));
    run(Command::new("swapon").arg("-d").arg(&k.dev));
    let out0 = uzram_testkit::vm::vmstat("pswpout");
    let in0 = uzram_testkit::vm::vmstat("pswpin");
    let cgroup = HogCgroup::new(96 << 20);
    let done = std::sync::atomic::AtomicBool::new(false);
    let rounds = std::thread::scope(|s| {
        let hog = s.spawn(|| {
            let mut hog = uzram_testkit::vm::Hog::new((192 << 20) / PAGE);
            let mut v = 0;
            while v == 0 || !done.load(std::sync::atomic::Ordering::Relaxed) {
                v += 1;
                hog.fill(v);
                let bad = hog.bad_pages(v);
                assert_eq!(bad, 0, "round {v}: {bad} pages wrong");
            }
            v
        });
        for _ in 0..10 {
            k.kill_child();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        hog.join().unwrap()
    });
    let events = std::fs::read_to_string(cgroup.path.join("memory.events")).unwrap_or_default();
    drop(cgroup);
    let (out, inn) = (
        uzram_testkit::vm::vmstat("pswpout") - out0,
        uzram_testkit::vm::vmstat("pswpin") - in0,
    );
    println!(
        "swap: {rounds} hog rounds verified across 10 kills; pswpout {out} pswpin {inn}; hog \
         cgroup {}",
        events.replace('\n', ", ")
    );
    assert!(
        out > 20_000 && inn > 10_000,
        "pswpout {out} pswpin {inn}: too little swap"
    );
    run(Command::new("swapoff").arg(&k.dev));
    let log = k.r().log();
    let taken: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("taken over from process"))
        .collect();
    // The keeper's and the recoveries' lines: where a slow restart spent its time.
    for l in log
        .lines()
        .filter(|l| l.contains("keeper") || l.contains("recovered") || l.contains("taken over"))
    {
        println!("{l}");
    }
    assert_eq!(taken.len(), 10, "{log}");
    let errors = uzram_testkit::vm::kernel_log_lines(&["I/O error", "error on swap-device"]);
    assert!(errors.is_empty(), "the kernel logged errors: {errors:#?}");
    k.stop();
}
