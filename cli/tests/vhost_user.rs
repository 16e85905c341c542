//! `uzram serve --vhost-user`: a device as a VM's virtio-blk disk over vhost-user-blk.
//!
//! The server runs here, on the host; a real QEMU guest (`scripts/zoned-vm --vhost-user-blk`,
//! Debian's 6.12 kernel under TCG, the guest's memory a shared memfd) attaches the socket and
//! runs this same test binary inside, which checks what the guest's virtio_blk driver sees
//! and drives the disk with the real fio and e2fsprogs; a second guest (a new QEMU, a new
//! connection) then finds the filesystem the first one left.

#[path = "../../tests/vm_support/mod.rs"]
mod vm_support;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod process_support;

use process_support::{run, wait_timeout};

const UZRAM: &str = env!("CARGO_BIN_EXE_uzram");
const DISK_BYTES: u64 = 256 << 20;
const QUEUES: usize = 2;

fn host_program(name: &str) -> String {
    for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return p.to_string_lossy().into_owned();
        }
    }
    panic!("{name} is not installed (scripts/debian-packages.txt lists its package)")
}

/// A running `uzram serve --vhost-user` and the vhost-user socket it printed.
struct Server {
    child: Child,
    dir: tempfile::TempDir,
    vhost_socket: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(UZRAM)
        .args(["serve", "--vhost-user", "--disksize", "256M", "--socket"])
        .arg(dir.path().join("zram0.sock"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("uzram serve starts");
    let mut vhost_socket = None;
    let mut printed = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        printed.push_str(&line);
        printed.push('\n');
        if let Some(rest) = line.trim().strip_prefix("vhost-user-blk: ") {
            vhost_socket = rest.split_whitespace().next().map(PathBuf::from);
        }
        if line.starts_with("serving") || Instant::now() > deadline {
            break;
        }
    }
    let Some(vhost_socket) = vhost_socket else {
        let mut err = String::new();
        let _ = child.stderr.take().unwrap().read_to_string(&mut err);
        panic!("uzram serve --vhost-user printed no socket:\n{printed}{err}");
    };
    // Beside the NBD socket, and the QEMU options that attach it.
    assert_eq!(vhost_socket, dir.path().join("zram0.vhost.sock"));
    assert!(
        printed.contains("-device vhost-user-blk-pci,chardev=zram0"),
        "{printed}"
    );
    assert!(printed.contains("memory-backend-memfd"), "{printed}");
    Server {
        child,
        dir,
        vhost_socket,
    }
}

/// Files of real pages (the running server's own memory and its code), plus same-filled and
/// zero pages, written under `dir`; their names.
fn write_real_files(server_pid: u32, dir: &Path) -> Vec<&'static str> {
    let mut memory = Vec::new();
    let pages =
        uzram_bench::corpus::snapshot_pid(server_pid, 4096, 8192, &mut memory).expect("snapshot");
    assert!(pages > 100, "only {pages} pages of the server's memory");
    // The first 8 MiB of our own code (the whole of a debug build would crowd the guest's
    // initramfs).
    let mut code = std::fs::read(UZRAM).unwrap();
    code.truncate(8 << 20);
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

fn sysfs(attr: &str) -> String {
    std::fs::read_to_string(format!("/sys/block/vda/{attr}"))
        .unwrap_or_else(|e| panic!("/sys/block/vda/{attr}: {e}"))
        .trim()
        .to_string()
}

/// Inside the guest: /dev/vda is the uzram device.
fn guest_body() {
    let pages = PathBuf::from(std::env::var("UZRAM_VHOST_PAGES").expect("UZRAM_VHOST_PAGES"));
    let dev = Path::new("/dev/vda");
    if std::env::var_os("UZRAM_VHOST_REREAD").is_some() {
        // A second guest (a new QEMU, so a new vhost-user connection): the filesystem the
        // first one left is there, clean, with the same files.
        run(Command::new("e2fsck").args(["-f", "-n"]).arg(dev));
        let mnt = Path::new("/tmp/mnt");
        std::fs::create_dir_all(mnt).unwrap();
        run(Command::new("mount").args(["-t", "ext4"]).arg(dev).arg(mnt));
        let mut n = 0;
        for e in std::fs::read_dir(&pages).unwrap() {
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
        return;
    }
    assert!(dev.exists(), "no /dev/vda in the guest");
    // The virtio-blk config space: size, zram's 4 KiB blocks, discard in pages, the serial
    // (GET_ID) is the device's name, one hardware queue per virtqueue, a write-back cache.
    assert_eq!(sysfs("size"), (DISK_BYTES >> 9).to_string());
    assert_eq!(sysfs("queue/logical_block_size"), "4096");
    assert_eq!(sysfs("queue/discard_granularity"), "4096");
    assert_ne!(sysfs("queue/write_zeroes_max_bytes"), "0");
    assert_eq!(sysfs("queue/write_cache"), "write back");
    assert_eq!(sysfs("serial"), "zram0");
    let hw_queues = std::fs::read_dir("/sys/block/vda/mq").unwrap().count();
    assert_eq!(hw_queues, QUEUES, "hardware queues");

    // fio with a checksum in every block: two jobs on both queues, depth 16, then read back.
    let fio = run(Command::new("fio").args([
        "--name=verify",
        "--filename=/dev/vda",
        "--thread",
        "--direct=1",
        "--ioengine=libaio",
        "--iodepth=16",
        "--numjobs=2",
        "--size=48M",
        "--offset_increment=64M",
        "--rw=randwrite",
        "--bssplit=4k/60:16k/20:64k/15:256k/5",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--group_reporting",
    ]));
    println!("{fio}");
    assert!(fio.contains("err= 0"), "{fio}");
    // Discard and write-zeroes reach the device: the range reads back as zeroes.
    run(Command::new("blkdiscard")
        .args(["-o", "0", "-l", "1048576"])
        .arg(dev));
    let mut head = vec![1u8; 1 << 20];
    std::fs::File::open(dev)
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    assert!(
        head.iter().all(|&b| b == 0),
        "discarded range is not zeroes"
    );

    // A filesystem of real pages: mkfs (which discards the disk), files, fsck, reread after
    // dropping the guest's caches.
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(dev));
    let mnt = Path::new("/tmp/mnt");
    std::fs::create_dir_all(mnt).unwrap();
    let mount = || run(Command::new("mount").args(["-t", "ext4"]).arg(dev).arg(mnt));
    let umount = || run(Command::new("umount").arg(mnt));
    mount();
    let names: Vec<_> = std::fs::read_dir(&pages)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 4, "{names:?}");
    for n in &names {
        std::fs::copy(pages.join(n), mnt.join(n)).unwrap();
    }
    umount();
    run(Command::new("e2fsck").args(["-f", "-n"]).arg(dev));
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    mount();
    for n in &names {
        let back = std::fs::read(mnt.join(n)).unwrap();
        let orig = std::fs::read(pages.join(n)).unwrap();
        assert!(back == orig, "{n:?} differs after remount");
    }
    umount();
}

#[test]
fn vhost_user_guest_fio_and_filesystem() {
    const NAME: &str = "vhost_user_guest_fio_and_filesystem";
    if std::env::var_os("UZRAM_VM").is_some() {
        guest_body();
        return;
    }
    let mut s = serve();
    let pages = s.dir.path().join("pages");
    write_real_files(s.child.id(), &pages);
    let mut args: Vec<String> = ["--kernel", "6.12", "--no-zoned", "--mem-mb", "1024"]
        .map(String::from)
        .to_vec();
    args.push("--vhost-user-blk".into());
    args.push(s.vhost_socket.to_string_lossy().into_owned());
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
    vm_support::boot_test(
        NAME,
        &args,
        &[("UZRAM_VHOST_PAGES", pages.to_str().unwrap())],
    );

    // The guest's files are in the device, compressed.
    let dir = s.dir.path().to_path_buf();
    let mm = run(Command::new(UZRAM)
        .args(["ctl", "--dir"])
        .arg(&dir)
        .arg("mm_stat"));
    let orig: u64 = mm.split_whitespace().next().unwrap().parse().unwrap();
    assert!(orig > 8 << 20, "mm_stat {mm}");

    // The guest is gone; SIGTERM: the server exits 0 in seconds and removes its sockets.
    run(Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .stdout(Stdio::null()));
    let st = wait_timeout(&mut s.child, Duration::from_secs(30)).expect("the server stopped");
    let mut err = String::new();
    s.child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(st.success(), "{st}: {err}");
    assert!(!err.contains("dropped"), "{err}");
    assert!(!s.vhost_socket.exists(), "the vhost-user socket is left");
}
