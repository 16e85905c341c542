//! `uzram serve --vhost-user`: a device as a VM's virtio-blk disk over vhost-user-blk.
//!
//! The server runs here, on the host; a real QEMU guest (`scripts/zoned-vm --vhost-user-blk`,
//! Debian's 6.12 kernel under TCG, the guest's memory a shared memfd) attaches the socket and
//! runs this same test binary inside, which checks what the guest's virtio_blk driver sees
//! and drives the disks with the real fio, e2fsprogs and the kernel's swap. Three guests, one
//! after the other, on one server (`--swap`, two devices): the first makes a filesystem on
//! zram0, resets the device as a reboot does and finds it intact, reboots (`reboot -f`, the
//! same QEMU and server) and finds it intact again, and swaps on zram1 with a memory hog
//! larger than its RAM; the second is killed (-9) with fio writing to zram1; the
//! third (a new QEMU, new connections) finds the filesystem, is served on zram1, and stays
//! connected while the server is stopped (in seconds).
//!
//! `vhost_user_keeper_kills`: a kept server (`--keeper`) killed 25 times and upgraded once
//! under a guest's fio rounds, then ext4, then its swap, QEMU reconnecting each time (docs/vhost-user.md,
//! "Across a restart").

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uzram_testkit::pages::PAGE;
use uzram_testkit::process::{host_program, proc_field, run_stdout as run, wait_timeout};
use uzram_testkit::vm::{mem_total_bytes, swap_under_hog};

const UZRAM: &str = env!("CARGO_BIN_EXE_uzram");
const DISK_BYTES: u64 = 256 << 20;
/// The swap disk: more than the hog pushes out of a 384 MiB guest.
const SWAP_DISK_BYTES: u64 = 1 << 30;
const QUEUES: usize = 2;

/// A running `uzram serve --swap --config` of two devices with vhost-user sockets:
/// `zram0` (a filesystem's disk) and `zram1` (a swap disk).
struct Server {
    child: Child,
    dir: tempfile::TempDir,
    /// The vhost-user sockets of zram0 and zram1.
    sockets: [PathBuf; 2],
    /// The server's standard error so far: a thread reads it as it comes (so a server that
    /// logs much never blocks on a full pipe), passes each line on as `server: LINE` (shown
    /// with the test's output when it fails), and keeps it here.
    stderr: Arc<Mutex<String>>,
    stderr_reader: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// The server's standard error, complete once it has exited.
    fn stderr_text(&mut self) -> String {
        if self.child.try_wait().ok().flatten().is_some() {
            if let Some(t) = self.stderr_reader.take() {
                let _ = t.join();
            }
        }
        self.stderr.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("uzram.toml");
    let mut text = String::new();
    for (name, size) in [("zram0", DISK_BYTES), ("zram1", SWAP_DISK_BYTES)] {
        text.push_str(&format!(
            "[[device]]\nname = \"{name}\"\ndisksize = \"{size}\"\nsocket = \"{}\"\n\
             vhost_user = true\n",
            dir.path().join(format!("{name}.sock")).display()
        ));
    }
    std::fs::write(&config, text).unwrap();
    // --swap as a host serving its guests' swap would run it: memory locked, an I/O flusher.
    let mut child = Command::new(UZRAM)
        .args(["serve", "--swap", "--config"])
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("uzram serve starts");
    let mut sockets = Vec::new();
    let mut printed = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        printed.push_str(&line);
        printed.push('\n');
        if let Some(rest) = line.trim().strip_prefix("vhost-user-blk: ") {
            sockets.extend(rest.split_whitespace().next().map(PathBuf::from));
        }
        if line.starts_with("serving") || Instant::now() > deadline {
            break;
        }
    }
    let stderr = Arc::new(Mutex::new(String::new()));
    let err_pipe = child.stderr.take().unwrap();
    let stderr2 = Arc::clone(&stderr);
    let stderr_reader = std::thread::spawn(move || {
        for line in BufReader::new(err_pipe).lines() {
            let Ok(line) = line else { break };
            println!("server: {line}");
            let mut s = stderr2.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    });
    // Its standard output stays read too: a line printed after "serving" must not meet a
    // closed pipe.
    std::thread::spawn(move || {
        for line in lines.map_while(|l| l.ok()) {
            println!("server (stdout): {line}");
        }
    });
    if sockets.len() != 2 {
        let _ = child.kill();
        let _ = child.wait();
        let _ = stderr_reader.join();
        let err = stderr.lock().unwrap().clone();
        panic!("uzram serve --vhost-user printed no sockets:\n{printed}{err}");
    }
    // Beside the NBD sockets, and the QEMU options that attach them.
    assert_eq!(sockets[0], dir.path().join("zram0.vhost.sock"));
    assert_eq!(sockets[1], dir.path().join("zram1.vhost.sock"));
    assert!(
        printed.contains("-device vhost-user-blk-pci,chardev=zram0"),
        "{printed}"
    );
    assert!(printed.contains("memory-backend-memfd"), "{printed}");
    Server {
        child,
        dir,
        sockets: [sockets[0].clone(), sockets[1].clone()],
        stderr,
        stderr_reader: Some(stderr_reader),
    }
}

/// Files of real pages (the running server's own memory and its code), plus same-filled and
/// zero pages, written under `dir`; their names.
fn write_real_files(server_pid: u32, dir: &Path) -> Vec<&'static str> {
    let mut memory = Vec::new();
    // At most 4 MiB: the files travel in the guest's initramfs, which the 384 MiB guest must
    // unpack into its RAM (a --swap server's snapshot reaches the cap since its frame reserve and
    // heap pad are resident: 16 MiB of it made the unpacking fail with 'write error').
    let pages =
        uzram_bench::corpus::snapshot_pid(server_pid, 4096, 1024, &mut memory).expect("snapshot");
    assert!(pages > 100, "only {pages} pages of the server's memory");
    // The first 4 MiB of our own code (more would crowd the guest's initramfs, which is in
    // its RAM).
    let mut code = std::fs::read(UZRAM).unwrap();
    code.truncate(4 << 20);
    let mut same = Vec::new();
    for i in 0..1024u32 {
        same.extend_from_slice(&[(i % 7) as u8 * 0x11; 4096]);
    }
    let files = [
        ("memory", memory),
        ("code", code),
        ("same-filled", same),
        ("zeroes", vec![0; 3 << 20]),
    ];
    std::fs::create_dir_all(dir).unwrap();
    for (name, data) in &files {
        std::fs::write(dir.join(name), data).unwrap();
    }
    files.iter().map(|(n, _)| *n).collect()
}

/// Inside the guest: the disk whose serial (GET_ID) is `name`, as /dev/vdX.
fn disk_with_serial(name: &str) -> PathBuf {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        for e in std::fs::read_dir("/sys/block").unwrap() {
            let e = e.unwrap();
            let serial = std::fs::read_to_string(e.path().join("serial")).unwrap_or_default();
            if serial.trim() == name {
                let dev = Path::new("/dev").join(e.file_name());
                if dev.exists() {
                    return dev;
                }
            }
        }
        assert!(Instant::now() < end, "no disk with serial {name}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn sysfs(dev: &Path, attr: &str) -> String {
    let name = dev.file_name().unwrap().to_string_lossy();
    std::fs::read_to_string(format!("/sys/block/{name}/{attr}"))
        .unwrap_or_else(|e| panic!("/sys/block/{name}/{attr}: {e}"))
        .trim()
        .to_string()
}

/// fio with a checksum in every block: two jobs on both queues, depth 16, random writes of
/// 4 KiB–256 KiB, then every block read back and verified.
fn fio_verify(dev: &Path, size_mib: u64) {
    let fio = run(Command::new("fio")
        .args([
            "--name=verify",
            "--thread",
            "--direct=1",
            "--ioengine=libaio",
            "--iodepth=16",
            "--numjobs=2",
            "--rw=randwrite",
            "--bssplit=4k/60:16k/20:64k/15:256k/5",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--group_reporting",
        ])
        .arg(format!("--filename={}", dev.display()))
        .arg(format!("--size={size_mib}M"))
        .arg(format!("--offset_increment={}M", size_mib + 16)));
    println!("{fio}");
    assert!(fio.contains("err= 0"), "{fio}");
}

/// Mounts the ext4 on `dev` at /tmp/mnt, returned.
fn mount_ext4(dev: &Path) -> &'static Path {
    let mnt = Path::new("/tmp/mnt");
    std::fs::create_dir_all(mnt).unwrap();
    run(Command::new("mount").args(["-t", "ext4"]).arg(dev).arg(mnt));
    mnt
}

/// The names of the four files of real pages in `pages`.
fn page_file_names(pages: &Path) -> Vec<std::ffi::OsString> {
    let names: Vec<_> = std::fs::read_dir(pages)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 4, "{names:?}");
    names
}

/// Mounts `dev` and checks that it holds exactly the files of `pages`, the same bytes.
fn check_files(dev: &Path, pages: &Path) {
    run(Command::new("e2fsck").args(["-f", "-n"]).arg(dev));
    let mnt = mount_ext4(dev);
    let mut n = 0;
    for e in std::fs::read_dir(pages).unwrap() {
        let name = e.unwrap().file_name();
        let back = std::fs::read(mnt.join(&name)).unwrap();
        assert!(
            back == std::fs::read(pages.join(&name)).unwrap(),
            "{name:?} differs"
        );
        n += 1;
    }
    assert_eq!(n, 4);
    run(Command::new("umount").arg(mnt));
}

/// The first block of zram1 while the first guest reboots: the boot after the reboot finds it
/// (zram1 is fresh when the server starts, and the swap that follows overwrites it).
const REBOOT_MARK: &[u8] = b"UZRAM-VHOST: rebooting, zram0 holds the files\n";

/// Whether zram1 starts with [`REBOOT_MARK`]: the first guest's second boot.
fn rebooted(swap: &Path) -> bool {
    let mut head = vec![0u8; REBOOT_MARK.len()];
    std::fs::File::open(swap)
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    head == REBOOT_MARK
}

/// The first guest: zram0 is checked, written with fio, discarded, given a filesystem of real
/// pages, reset as at a reboot; then the guest really reboots (`reboot -f`: the machine
/// resets in the same QEMU, the server keeps running, the kernel boots again and runs this
/// test again), finds the filesystem intact and swaps on zram1.
fn guest_first(pages: &Path) {
    let _watchdog = Watchdog::start(WATCHDOG_SECS);
    let swap = disk_with_serial("zram1");
    if rebooted(&swap) {
        // The second boot: the virtio-blk disks were negotiated anew on the same vhost-user
        // connections (a machine reset stops the rings; the new kernel sets them up again).
        let dev = disk_with_serial("zram0");
        assert_eq!(sysfs(&dev, "size"), (DISK_BYTES >> 9).to_string());
        check_files(&dev, pages);
        println!("zram0 intact after a reboot");
        guest_swap(&swap);
        return;
    }
    let dev = disk_with_serial("zram0");
    // The virtio-blk config space: size, zram's 4 KiB blocks, discard in pages, the serial
    // (GET_ID) is the device's name, one hardware queue per virtqueue, a write-back cache.
    assert_eq!(sysfs(&dev, "size"), (DISK_BYTES >> 9).to_string());
    assert_eq!(sysfs(&dev, "queue/logical_block_size"), "4096");
    assert_eq!(sysfs(&dev, "queue/discard_granularity"), "4096");
    assert_ne!(sysfs(&dev, "queue/write_zeroes_max_bytes"), "0");
    assert_eq!(sysfs(&dev, "queue/write_cache"), "write back");
    let mq = format!(
        "/sys/block/{}/mq",
        dev.file_name().unwrap().to_string_lossy()
    );
    assert_eq!(
        std::fs::read_dir(mq).unwrap().count(),
        QUEUES,
        "hardware queues"
    );

    fio_verify(&dev, 48);
    // Discard and write-zeroes reach the device: the range reads back as zeroes.
    run(Command::new("blkdiscard")
        .args(["-o", "0", "-l", "1048576"])
        .arg(&dev));
    let mut head = vec![1u8; 1 << 20];
    std::fs::File::open(&dev)
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    assert!(
        head.iter().all(|&b| b == 0),
        "discarded range is not zeroes"
    );

    // A filesystem of real pages: mkfs (which discards the disk), files, fsck, reread after
    // dropping the guest's caches.
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&dev));
    let mnt = mount_ext4(&dev);
    let names = page_file_names(pages);
    for n in &names {
        std::fs::copy(pages.join(n), mnt.join(n)).unwrap();
    }
    run(Command::new("umount").arg(mnt));
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    check_files(&dev, pages);

    // The device reset a reboot does: the driver lets go of the device (virtio reset: QEMU
    // stops the vhost-user rings, GET_VRING_BASE) and probes it again (features, memory
    // table, rings anew, on the same connection); the filesystem is intact.
    let block = dev.file_name().unwrap().to_string_lossy().into_owned();
    let virtio = std::fs::read_link(format!("/sys/block/{block}/device")).unwrap();
    let virtio = virtio.file_name().unwrap().to_string_lossy().into_owned();
    let driver = "/sys/bus/virtio/drivers/virtio_blk";
    std::fs::write(format!("{driver}/unbind"), &virtio).unwrap();
    assert!(!dev.exists() || disk_serials().iter().all(|s| s != "zram0"));
    std::fs::write(format!("{driver}/bind"), &virtio).unwrap();
    let dev = disk_with_serial("zram0");
    check_files(&dev, pages);
    println!("zram0 intact after a device reset");

    // The reboot: the mark goes to zram1 (written through, flushed), then the machine resets
    // as `reboot` does once user space has stopped. scripts/zoned-vm --reboots 1 lets QEMU
    // boot again (and fails a second reboot or a panic).
    let mut block = vec![0u8; PAGE];
    block[..REBOOT_MARK.len()].copy_from_slice(REBOOT_MARK);
    let mut f = std::fs::OpenOptions::new().write(true).open(&swap).unwrap();
    std::io::Write::write_all(&mut f, &block).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert!(rebooted(&swap));
    println!("{REBOOT_PRINT}");
    // Our output is on a serial port (scripts/zoned-vm): let it leave the VM before the reset.
    // SAFETY: tcdrain only waits on file descriptor 1, which stays open.
    unsafe { libc::tcdrain(1) };
    run(Command::new("reboot").arg("-f"));
    std::thread::sleep(Duration::from_secs(120));
    panic!("the guest did not reboot");
}

const REBOOT_PRINT: &str = "UZRAM-VHOST: rebooting";

fn disk_serials() -> Vec<String> {
    std::fs::read_dir("/sys/block")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.unwrap().path().join("serial")).ok())
        .map(|s| s.trim().to_string())
        .collect()
}

/// Swap on the vhost-user disk: a memory hog 1.25 times the guest's RAM, of same-filled,
/// compressible and random pages, every page verified, twice with different contents; swap
/// really used, both ways. (The server is outside the guest: the guest's memory pressure
/// cannot stall it, unlike a swap server inside the machine it serves.)
fn guest_swap(dev: &Path) {
    // 1.25 times RAM: well past it (about half the hog is out at any time, with the
    // initramfs's files in RAM), and small enough for TCG on a loaded machine (1.5 times a
    // 640 MiB guest took 9 minutes a round there).
    let pages = (mem_total_bytes() * 5 / 4) as usize / PAGE;
    let (out, inn) = swap_under_hog(dev, pages, false, false);
    assert!(out as usize > pages / 4, "pswpout {out} for {pages} pages");
    assert!(inn > 0, "pswpin {inn}");
}

/// The second guest: fio writing to zram1 when its QEMU is killed.
fn guest_killed() {
    let dev = disk_with_serial("zram1");
    let mut fio = Command::new("fio")
        .args([
            "--name=killed",
            "--direct=1",
            "--ioengine=libaio",
            "--iodepth=32",
            "--rw=randrw",
            "--bs=4k",
            "--size=64M",
            "--time_based",
            "--runtime=600",
        ])
        .arg(format!("--filename={}", dev.display()))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert!(fio.try_wait().unwrap().is_none(), "fio ended early");
    println!("{KILL_MARK}");
    let _ = fio.wait();
    panic!("the guest was not killed");
}

/// The last guest: a new QEMU finds zram0's filesystem and is served on zram1 (whose last
/// front end was killed); then it stays connected while the server is stopped.
fn guest_last(pages: &Path) {
    let watchdog = Watchdog::start(WATCHDOG_SECS);
    println!("checking zram0's files");
    check_files(&disk_with_serial("zram0"), pages);
    println!("fio on zram1");
    fio_verify(&disk_with_serial("zram1"), 32);
    drop(watchdog);
    println!("{CONNECTED_MARK}");
    std::thread::sleep(Duration::from_secs(600));
    panic!("the guest was not stopped");
}

/// Inside the guest: after [`WATCHDOG_SECS`] (well before the host gives up on a step, at
/// [`GUEST_MARK_SECS`]) and every [`WATCHDOG_SECS`] after, until dropped, prints on stderr
/// what the guest's disks and blocked tasks are doing: each virtio disk's requests in flight
/// (`inflight`, and blk-mq's debugfs: requests the driver holds, `busy`, and those waiting to
/// be dispatched) and the kernel stack of every task in uninterruptible sleep. So a step that
/// hangs shows whether the guest waits for the disk (a request the server never completed)
/// or for something else.
struct Watchdog {
    done: Arc<std::sync::atomic::AtomicBool>,
}

const WATCHDOG_SECS: u64 = 300;

impl Watchdog {
    fn start(secs: u64) -> Watchdog {
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done2 = Arc::clone(&done);
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut next = secs;
            while !done2.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_secs(1));
                if start.elapsed().as_secs() >= next {
                    next += secs;
                    eprintln!("{}", guest_state(start.elapsed().as_secs()));
                }
            }
        });
        Watchdog { done }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Inside the guest: its disks' requests in flight and its tasks in D state (see [`Watchdog`]).
fn guest_state(secs: u64) -> String {
    let debugfs = Path::new("/sys/kernel/debug/block");
    if !debugfs.exists() {
        let _ = Command::new("mount")
            .args(["-t", "debugfs", "debugfs", "/sys/kernel/debug"])
            .status();
    }
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let mut out = format!("---- guest watchdog: this step has run {secs} s\n");
    let mut disks: Vec<_> = std::fs::read_dir("/sys/block")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("vd"))
        .collect();
    disks.sort();
    for d in disks {
        let serial = read(&Path::new("/sys/block").join(&d).join("serial"));
        let inflight = read(&Path::new("/sys/block").join(&d).join("inflight"));
        out += &format!(
            "{d} ({}): inflight (reads writes) {}\n",
            serial.trim(),
            inflight.split_whitespace().collect::<Vec<_>>().join(" ")
        );
        for hctx in std::fs::read_dir(debugfs.join(&d))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = hctx.file_name().to_string_lossy().into_owned();
            if !name.starts_with("hctx") {
                continue;
            }
            for f in ["busy", "dispatch", "state"] {
                let text = read(&hctx.path().join(f));
                if !text.trim().is_empty() {
                    out += &format!("  {name}/{f}:\n{}\n", text.trim_end());
                }
            }
        }
    }
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.parse::<u32>().is_err() {
            continue;
        }
        let stat = read(&e.path().join("stat"));
        if stat
            .rsplit_once(") ")
            .is_some_and(|(_, r)| r.starts_with('D'))
        {
            out += &format!(
                "task {name} {} in D:\n{}\n",
                read(&e.path().join("comm")).trim(),
                read(&e.path().join("stack")).trim_end()
            );
        }
    }
    out + "---- end of guest watchdog"
}

const KILL_MARK: &str = "UZRAM-VHOST: fio running";
const CONNECTED_MARK: &str = "UZRAM-VHOST: checked, staying connected";

/// `scripts/zoned-vm` arguments for a guest of `mem_mb` with `sockets` as its disks that may
/// reboot `reboots` times.
fn vm_args(sockets: &[&Path], mem_mb: u32, pages: &Path, reboots: u32) -> Vec<String> {
    // A generous timeout: the first guest's swap rounds take minutes under TCG on a busy
    // machine.
    let mut args: Vec<String> = [
        "--kernel",
        "6.12",
        "--no-zoned",
        "--timeout-s",
        "1500",
        "--mem-mb",
    ]
    .map(String::from)
    .to_vec();
    args.push(mem_mb.to_string());
    args.push("--reboots".into());
    args.push(reboots.to_string());
    for s in sockets {
        args.push("--vhost-user-blk".into());
        args.push(s.to_string_lossy().into_owned());
    }
    args.push("--vhost-queues".into());
    args.push(QUEUES.to_string());
    for inc in [
        host_program("mkfs.ext4"),
        host_program("e2fsck"),
        host_program("fio"),
        "/etc/mke2fs.conf".to_string(),
        pages.to_string_lossy().into_owned(),
    ] {
        args.push("--include".into());
        args.push(inc);
    }
    args
}

/// The QEMU attached to `socket` (its command line names it).
fn qemu_pid(socket: &Path) -> u32 {
    find_qemu(socket).unwrap_or_else(|| panic!("no QEMU attached to {}", socket.display()))
}

fn find_qemu(socket: &Path) -> Option<u32> {
    let want = socket.to_string_lossy().into_owned();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.starts_with("qemu-system") && cmdline.contains(&want) {
            return Some(pid);
        }
    }
    None
}

/// A guest running in the background: its output lines, as they come.
struct Guest {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Guest {
    fn start(name: &str, args: &[String], env: &[(&str, &str)]) -> Guest {
        let mut child = uzram_testkit::vm::spawn_test(name, args, env);
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                println!("guest: {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Guest { child, lines }
    }

    /// Waits for the guest to print `mark`, at most [`GUEST_MARK_SECS`]. When it does not,
    /// what the server's and QEMU's threads are doing is printed (the test fails; then the
    /// VM's console tail comes from `scripts/zoned-vm` as the guest is stopped).
    fn wait_for(&mut self, mark: &str, server: &mut Server, sockets: &[&Path]) {
        let pid = server.child.id();
        self.wait_for_mark(mark, pid, &mut || server.stderr_text(), sockets);
    }

    /// [`Guest::wait_for`] for a server known by its pid and its log.
    fn wait_for_mark(
        &mut self,
        mark: &str,
        server_pid: u32,
        server_log: &mut dyn FnMut() -> String,
        sockets: &[&Path],
    ) {
        let start = Instant::now();
        let end = start + Duration::from_secs(GUEST_MARK_SECS);
        let mut last_line = start;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(mark) => return,
                Ok(_) => last_line = Instant::now(),
                Err(e) => {
                    println!(
                        "the guest did not print {mark:?} in {} s ({e}); its last line came \
                         after {} s",
                        start.elapsed().as_secs(),
                        (last_line - start).as_secs()
                    );
                    print_threads("the server", server_pid);
                    for sock in sockets {
                        if let Some(pid) = find_qemu(sock) {
                            print_threads(&format!("QEMU on {}", sock.display()), pid);
                        }
                    }
                    panic!(
                        "the guest did not print {mark:?} in {} s: {e}; the \
                         guest's output, the server's (server: ...) and its threads are above, \
                         the VM's console follows on stderr; the server's stderr:\n{}",
                        start.elapsed().as_secs(),
                        server_log()
                    );
                }
            }
        }
    }
}

/// How long a guest may take to reach a mark (a boot, the checks and fio of the last step:
/// about a minute on a quiet machine, 3-4 at a load of 15).
const GUEST_MARK_SECS: u64 = 600;

/// For a failure: each thread of process `pid` (its name, state, where it sleeps in the kernel
/// and its kernel stack) and, with gdb installed, every thread's user-space backtrace.
fn print_threads(what: &str, pid: u32) {
    println!("---- {what} (pid {pid}): threads");
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        println!("(gone)");
        return;
    };
    for t in tasks.flatten() {
        let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
        let stat = read("stat");
        // The state is the field after the parenthesised name.
        let state = stat.rsplit_once(") ").map_or("?", |(_, r)| &r[..1]);
        println!(
            "{} {} {state} wchan={}\n{}",
            t.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan"),
            read("stack").trim_end()
        );
    }
    if Path::new("/usr/bin/gdb").exists() {
        let out = Command::new("timeout")
            .args([
                "60",
                "/usr/bin/gdb",
                "-p",
                &pid.to_string(),
                "-batch",
                "-nx",
            ])
            .args(["-ex", "thread apply all bt"])
            .output();
        if let Ok(out) = out {
            println!(
                "---- {what}: gdb\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    println!("---- end of {what}");
}

impl Drop for Guest {
    /// Stops the VM: SIGTERM to the VM script, which stops its QEMU (SIGKILL would leave the
    /// QEMU running, in a session of its own).
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        if wait_timeout(&mut self.child, Duration::from_secs(30)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The server's locked memory: its own (`VmLck`), and what of the guests' memfds is locked.
fn locked_kib(pid: u32) -> (u64, u64, u64) {
    let vm_lck = proc_field(&format!("/proc/{pid}/status"), "VmLck");
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let (mut guest_rss, mut guest_locked, mut in_guest) = (0, 0, false);
    for l in smaps.lines() {
        let field = |name: &str| -> Option<u64> {
            l.strip_prefix(name)?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()
        };
        if let Some(first) = l.split_whitespace().next() {
            if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
                // QEMU's guest memory is a memfd; the server's own device state is in
                // memfds too, named `uzram-*` (docs/restart.md), and locked under --swap.
                in_guest = l.contains("/memfd:") && !l.contains("/memfd:uzram-");
                continue;
            }
        }
        if in_guest {
            if let Some(v) = field("Rss:") {
                guest_rss += v;
            }
            if let Some(v) = field("Locked:") {
                guest_locked += v;
            }
        }
    }
    (vm_lck, guest_rss, guest_locked)
}

#[test]
fn vhost_user_guests() {
    const NAME: &str = "vhost_user_guests";
    if std::env::var_os("UZRAM_VM").is_some() {
        let pages = PathBuf::from(std::env::var("UZRAM_VHOST_PAGES").unwrap());
        match std::env::var("UZRAM_VHOST_STEP").unwrap().as_str() {
            "first" => guest_first(&pages),
            "killed" => guest_killed(),
            "last" => guest_last(&pages),
            s => panic!("step {s}"),
        }
        return;
    }
    let mut s = serve();
    let pages = s.dir.path().join("pages");
    write_real_files(s.child.id(), &pages);
    let pages_s = pages.to_str().unwrap();
    let [disk, swap] = [s.sockets[0].clone(), s.sockets[1].clone()];

    // 1. A guest uses zram0 as its disk (fio, discard, a filesystem, a device reset as at a
    // reboot, then a real reboot in the same QEMU) and zram1 as its swap.
    let out = uzram_testkit::vm::boot_test(
        NAME,
        &vm_args(&[&disk, &swap], 384, &pages, 1),
        &[
            ("UZRAM_VHOST_PAGES", pages_s),
            ("UZRAM_VHOST_STEP", "first"),
        ],
    );
    // It rebooted once, in the same QEMU, and found zram0 intact.
    let after = out
        .split_once(REBOOT_PRINT)
        .unwrap_or_else(|| panic!("the guest did not reboot:\n{out}"))
        .1;
    assert!(after.contains("zram0 intact after a reboot"), "{out}");
    assert!(s.child.try_wait().unwrap().is_none(), "the server died");

    // 2. A guest writing to zram1 when its QEMU is killed (-9): the server goes on.
    let mut g = Guest::start(
        NAME,
        &vm_args(&[&swap], 512, &pages, 0),
        &[
            ("UZRAM_VHOST_PAGES", pages_s),
            ("UZRAM_VHOST_STEP", "killed"),
        ],
    );
    g.wait_for(KILL_MARK, &mut s, &[&swap]);
    run(Command::new("kill").args(["-KILL", &qemu_pid(&swap).to_string()]));
    let st = wait_timeout(&mut g.child, Duration::from_secs(60)).expect("the VM script ended");
    assert!(!st.success(), "{st}");
    drop(g);
    assert!(s.child.try_wait().unwrap().is_none(), "the server died");

    // 3. A new QEMU: zram0's filesystem is intact, zram1 is served; it stays connected.
    let mut g = Guest::start(
        NAME,
        &vm_args(&[&disk, &swap], 512, &pages, 0),
        &[("UZRAM_VHOST_PAGES", pages_s), ("UZRAM_VHOST_STEP", "last")],
    );
    g.wait_for(CONNECTED_MARK, &mut s, &[&disk, &swap]);
    // --swap: the server's memory is locked, the guest's (mapped, and touched by requests)
    // is not.
    let (vm_lck, guest_rss, guest_locked) = locked_kib(s.child.id());
    println!("server: VmLck {vm_lck} kB; guest memory mapped: Rss {guest_rss} kB, Locked {guest_locked} kB");
    assert!(vm_lck > 0, "--swap locked nothing");
    assert!(guest_rss > 0, "no guest memory mapped in the server");
    assert_eq!(guest_locked, 0, "guest memory locked in the server");

    // The guests' data is in the devices, compressed.
    let dir = s.dir.path().to_path_buf();
    for (dev, at_least) in [("zram0", 8u64 << 20), ("zram1", 16 << 20)] {
        let mm = run(Command::new(UZRAM)
            .args(["ctl", "--dir"])
            .arg(&dir)
            .args(["--dev", dev, "mm_stat"]));
        let orig: u64 = mm.split_whitespace().next().unwrap().parse().unwrap();
        assert!(orig > at_least, "{dev} mm_stat {mm}");
    }

    // SIGTERM with a guest connected: the server exits 0 in seconds and removes its sockets.
    let t = Instant::now();
    run(Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .stdout(Stdio::null()));
    let st = wait_timeout(&mut s.child, Duration::from_secs(30)).expect("the server stopped");
    let stop_secs = t.elapsed().as_secs_f64();
    drop(g);
    let err = s.stderr_text();
    assert!(st.success(), "{st}: {err}");
    assert!(stop_secs < 10.0, "stopping took {stop_secs:.1} s");
    assert!(!err.contains("dropped"), "{err}");
    for sock in [&disk, &swap] {
        assert!(!sock.exists(), "{} is left", sock.display());
    }
}

const KEPT_MARK: &str = "UZRAM-VHOST: fio rounds running";
const KEPT_EXT4_MARK: &str = "UZRAM-VHOST: ext4 rounds running";
const KEPT_SWAP_MARK: &str = "UZRAM-VHOST: hog rounds running";
const KEPT_DONE: &str = "UZRAM-VHOST: kept rounds verified: ";
/// The kept server's disk (zram0) and swap disk (zram1), and where on the disk (its last page)
/// the host raises the flags that end the guest's fio rounds and then its hog rounds (through
/// the device's NBD socket: the host cannot reach into the guest).
const KEPT_DISK_BYTES: u64 = 512 << 20;
const KEPT_SWAP_BYTES: u64 = 1 << 30;
const FLAG_OFFSET: u64 = KEPT_DISK_BYTES - 4096;
const FLAG_FIO_DONE: u8 = 0x5a;
const FLAG_EXT4_DONE: u8 = 0x3c;
const FLAG_HOG_DONE: u8 = 0xa5;

/// The largest completion latency fio reports (`clat (UNIT): min=..., max=N`) in `out`, in
/// milliseconds.
fn fio_max_clat_ms(out: &str) -> f64 {
    out.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix("clat (")?;
            let (unit, rest) = rest.split_once("):")?;
            let max = rest.split("max=").nth(1)?.split(',').next()?.trim();
            let v: f64 = max.parse().ok()?;
            let scale = match unit {
                "nsec" => 1e-6,
                "usec" => 1e-3,
                "msec" => 1.0,
                _ => return None,
            };
            Some(v * scale)
        })
        .fold(0.0, f64::max)
}

/// Inside the guest, on a kept server's disks: fio rounds on zram0 with a checksum in every
/// block (each writing and then verifying its blocks, another seed each round) until the host
/// raises its first flag on the disk's last page; then ext4 on zram0 (all but that page),
/// rounds of the files of real pages `pages` copied in, synced and read back after dropping
/// the caches, until the second flag, and `e2fsck -fn`; then swap on zram1 under a memory hog
/// 1.25 times the guest's RAM, every page verified, round after round until the third flag;
/// then no I/O error may be in the kernel's log.
fn guest_kept(pages: &Path) {
    let dev = disk_with_serial("zram0");
    let swap = disk_with_serial("zram1");
    let bytes: u64 = sysfs(&dev, "size").parse::<u64>().unwrap() << 9;
    assert_eq!(bytes, KEPT_DISK_BYTES);
    let started = Instant::now();
    println!("{KEPT_MARK}");
    let mut rounds = 0u64;
    let mut max_clat_ms = 0f64;
    loop {
        let t = Instant::now();
        let out = run(Command::new("fio")
            .args([
                "--name=kept",
                "--thread",
                "--direct=1",
                "--ioengine=libaio",
                "--iodepth=16",
                "--numjobs=2",
                "--rw=randwrite",
                "--bssplit=4k/50:16k/20:64k/20:256k/10",
                "--size=24M",
                "--offset_increment=64M",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--buffer_compress_percentage=50",
                "--refill_buffers",
                "--group_reporting",
            ])
            .arg(format!("--randseed={}", rounds + 1))
            .arg(format!("--filename={}", dev.display())));
        assert!(out.contains("err= 0"), "fio round {rounds}: {out}");
        rounds += 1;
        let clat = fio_max_clat_ms(&out);
        max_clat_ms = max_clat_ms.max(clat);
        println!(
            "UZRAM-VHOST: fio round {rounds} verified in {:.1} s, longest request {clat:.0} ms",
            t.elapsed().as_secs_f64()
        );
        if flag(&dev) == FLAG_FIO_DONE {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1200),
            "no flag from the host after {rounds} fio rounds"
        );
    }
    println!("UZRAM-VHOST: {rounds} fio rounds, the longest request {max_clat_ms:.0} ms");

    let blocks = (KEPT_DISK_BYTES / 4096 - 1).to_string();
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096"])
        .arg(&dev)
        .arg(&blocks));
    let mnt = mount_ext4(&dev);
    let names = page_file_names(pages);
    println!("{KEPT_EXT4_MARK}");
    let mut ext4_rounds = 0;
    loop {
        ext4_rounds += 1;
        let t = Instant::now();
        let dir = mnt.join(ext4_rounds.to_string());
        std::fs::create_dir(&dir).unwrap();
        for n in &names {
            std::fs::copy(pages.join(n), dir.join(n)).unwrap();
        }
        // SAFETY: sync takes no arguments.
        unsafe { libc::sync() };
        std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
        for n in &names {
            let back = std::fs::read(dir.join(n)).unwrap();
            assert!(
                back == std::fs::read(pages.join(n)).unwrap(),
                "ext4 round {ext4_rounds}: {n:?} differs"
            );
        }
        if ext4_rounds > 1 {
            std::fs::remove_dir_all(mnt.join((ext4_rounds - 1).to_string())).unwrap();
        }
        println!(
            "UZRAM-VHOST: ext4 round {ext4_rounds} verified in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        if flag(&dev) == FLAG_EXT4_DONE {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1800),
            "no second flag from the host after {ext4_rounds} ext4 rounds"
        );
    }
    run(Command::new("umount").arg(mnt));
    run(Command::new("e2fsck").args(["-f", "-n"]).arg(&dev));
    println!("UZRAM-VHOST: {ext4_rounds} ext4 rounds, e2fsck -fn clean");

    run(Command::new("mkswap").arg(&swap));
    run(Command::new("swapon").arg(&swap));
    let (out0, in0) = (
        uzram_testkit::vm::vmstat("pswpout"),
        uzram_testkit::vm::vmstat("pswpin"),
    );
    let mut hog = uzram_testkit::vm::Hog::new((mem_total_bytes() * 5 / 4) as usize / PAGE);
    println!("{KEPT_SWAP_MARK}");
    let mut v = 0;
    loop {
        v += 1;
        let t = Instant::now();
        hog.fill(v);
        let bad = hog.bad_pages(v);
        assert_eq!(bad, 0, "hog round {v}: {bad} pages wrong");
        println!(
            "UZRAM-VHOST: hog round {v}: {} pages verified in {:.1} s",
            hog.pages(),
            t.elapsed().as_secs_f64()
        );
        if flag(&dev) == FLAG_HOG_DONE {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2400),
            "no third flag from the host after {v} hog rounds"
        );
    }
    drop(hog);
    let (out, inn) = (
        uzram_testkit::vm::vmstat("pswpout") - out0,
        uzram_testkit::vm::vmstat("pswpin") - in0,
    );
    println!("UZRAM-VHOST: {v} hog rounds, pswpout {out} pswpin {inn}");
    assert!(
        out > 50_000 && inn > 20_000,
        "too little swap: {out} out, {inn} in"
    );
    run(Command::new("swapoff").arg(&swap));
    let errors = uzram_testkit::vm::kernel_log_lines(&[
        "I/O error",
        "Buffer I/O",
        "blk_update_request",
        "error on swap-device",
    ]);
    assert!(errors.is_empty(), "the kernel logged errors: {errors:#?}");
    println!("{KEPT_DONE}{rounds} fio, {ext4_rounds} ext4, {v} hog");
}

/// The first byte of the disk's last page, where the host raises its flags (read past the
/// page cache).
fn flag(dev: &Path) -> u8 {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .unwrap();
    // O_DIRECT wants an aligned buffer.
    let mut buf = vec![0u8; 8192];
    let at = buf.as_ptr().align_offset(4096);
    let page = &mut buf[at..at + 4096];
    f.read_exact_at(page, FLAG_OFFSET).unwrap();
    page[0]
}

/// Whether a queue thread (`uzram-vqN`) of process `pid` is running now: a kill then likely
/// finds a request taken and not completed.
fn queue_thread_running(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|t| {
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        stat.contains("(uzram-vq")
            && stat
                .rsplit_once(") ")
                .is_some_and(|(_, r)| r.starts_with('R'))
    })
}

/// A guest's disk and swap from a kept server (`uzram serve --keeper --swap --vhost-user`),
/// QEMU reconnecting (`reconnect-ms`): while the guest runs fio rounds verifying every block
/// they write, the server is killed (`kill -9`) ten times and upgraded once (`uzram ctl
/// upgrade`); while it writes and reads back files of real pages on ext4 on the same disk,
/// five kills more (then `e2fsck -fn`); while a memory hog swaps on the second disk and
/// verifies every page, ten kills more. Each kill is sent while a queue thread runs, when it can. Each new server
/// listens on the same sockets, QEMU reconnects and hands it the inflight region, and the
/// requests the dead server had taken and not completed are served first: every round
/// verifies, and the guest's kernel logs no I/O error.
#[test]
fn vhost_user_keeper_kills() {
    const NAME: &str = "vhost_user_keeper_kills";
    if std::env::var_os("UZRAM_VM").is_some() {
        let pages = PathBuf::from(std::env::var("UZRAM_VHOST_PAGES").unwrap());
        match std::env::var("UZRAM_VHOST_STEP").unwrap().as_str() {
            "kept" => guest_kept(&pages),
            s => panic!("step {s}"),
        }
        return;
    }
    let mut config = String::new();
    for (name, size) in [("zram0", KEPT_DISK_BYTES), ("zram1", KEPT_SWAP_BYTES)] {
        config.push_str(&format!(
            "[[device]]\nname = \"{name}\"\ndisksize = \"{size}\"\n\
             socket = \"{{dir}}/{name}.sock\"\nvhost_user = true\n"
        ));
    }
    let k = uzram_testkit::serve::Kept::start(
        uzram_testkit::serve::Serve::config(&config).arg(&["--swap"]),
    );
    let socks = ["zram0", "zram1"].map(|n| k.r.dir().join(format!("{n}.vhost.sock")));
    for s in &socks {
        assert!(s.exists(), "{}: {:?}", s.display(), k.r.lines());
    }
    let pages = k.r.dir().join("pages");
    write_real_files(k.child(), &pages);
    let mut args = vm_args(&[&socks[0], &socks[1]], 512, &pages, 0);
    args.extend(["--vhost-reconnect-ms".to_string(), "500".to_string()]);
    let pages_s = pages.to_str().unwrap();
    let mut g = Guest::start(
        NAME,
        &args,
        &[("UZRAM_VHOST_STEP", "kept"), ("UZRAM_VHOST_PAGES", pages_s)],
    );
    let keeper = k.r.pid();
    let sockets = [socks[0].as_path(), socks[1].as_path()];
    g.wait_for_mark(KEPT_MARK, keeper, &mut || k.r.log(), &sockets);

    let mut took = Vec::new();
    let mut kills = |n: usize, what: &str| {
        for _ in 0..n {
            let t = k.kill_child_when(queue_thread_running);
            println!(
                "kill {} ({what}): the next server serves {:.3} s after the kill",
                k.kills(),
                t.as_secs_f64()
            );
            took.push(t.as_secs_f64());
            for s in &socks {
                assert!(s.exists(), "no {} after kill {}", s.display(), k.kills());
            }
        }
    };
    kills(10, "fio");
    let old = k.child();
    let o = k.r.ctl(&["upgrade"]);
    let said = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success() && said.starts_with("upgraded to uzram "),
        "{said}: {}",
        k.r.log()
    );
    assert_ne!(k.child(), old);
    // Let the upgraded server serve a round or so, then end the fio rounds.
    std::thread::sleep(Duration::from_secs(10));
    let raise = |byte: u8| {
        run(Command::new("qemu-io").args([
            "-f",
            "raw",
            "-c",
            &format!("write -P {byte} {FLAG_OFFSET} 4096"),
            &k.r.uri("zram0"),
        ]));
    };
    raise(FLAG_FIO_DONE);
    g.wait_for_mark(KEPT_EXT4_MARK, keeper, &mut || k.r.log(), &sockets);
    kills(5, "ext4");
    raise(FLAG_EXT4_DONE);
    g.wait_for_mark(KEPT_SWAP_MARK, keeper, &mut || k.r.log(), &sockets);
    kills(10, "swap");
    raise(FLAG_HOG_DONE);
    g.wait_for_mark(KEPT_DONE, keeper, &mut || k.r.log(), &sockets);
    let st = wait_timeout(&mut g.child, Duration::from_secs(120)).expect("the VM script ended");
    assert!(st.success(), "{st}");
    took.sort_by(f64::total_cmp);
    println!(
        "kill to serving over {} kills: median {:.3} s, max {:.3} s",
        took.len(),
        took[took.len() / 2],
        took[took.len() - 1]
    );
    // The keeper started a server 27 times (25 kills, an upgrade), and none dropped QEMU for
    // breaking the protocol.
    let log = k.r.log();
    assert_eq!(k.servings(), 27, "{log}");
    assert!(!log.contains("front end dropped"), "{log}");
    // How many queue starts found requests in flight to resubmit (a kill between two
    // requests leaves none; the test kit's test, service/tests/vhost_user_inflight.rs, makes
    // one every time).
    let resubmits: Vec<&str> = log.lines().filter(|l| l.contains("resubmitting")).collect();
    println!(
        "{} queue starts resubmitted requests: {resubmits:#?}",
        resubmits.len()
    );
    let mut k = k;
    k.r.signal("-TERM");
    let st = k.r.wait_exit(Duration::from_secs(30));
    assert!(st.success(), "{st}: {}", k.r.log());
}
