//! `uzram serve --ublk`: the device as a kernel block device `/dev/ublkbN`.
//!
//! This host has no `ublk_drv`, so the block device tests boot Debian's 6.12 kernel in a VM
//! (`scripts/zoned-vm --kernel 6.12 --no-zoned`, see `tests/vm_support`) and run themselves
//! inside, with the built `uzram` and the real e2fsprogs. Here, on the host, a missing
//! `ublk_drv` must be one clear line.

#[path = "../../tests/vm_support/mod.rs"]
mod vm_support;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod process_support;

use process_support::{run, wait_timeout};

const UZRAM: &str = env!("CARGO_BIN_EXE_uzram");

/// A host program the VM needs, by its absolute path.
fn host_program(name: &str) -> String {
    for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return p.to_string_lossy().into_owned();
        }
    }
    panic!("{name} is not installed (scripts/debian-packages.txt lists its package)")
}

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
        "/etc/mke2fs.conf".to_string(),
    ] {
        a.push("--include".into());
        a.push(inc);
    }
    a
}

/// A running `uzram serve --ublk` and what it printed.
struct Server {
    child: Child,
    dir: tempfile::TempDir,
    block_dev: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(extra: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(UZRAM)
        .args(["serve", "--ublk", "--socket"])
        .arg(dir.path().join("zram0.sock"))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("uzram serve starts");
    let mut block_dev = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        println!("uzram serve: {line}");
        if let Some(p) = line
            .split_whitespace()
            .find(|w| w.starts_with("/dev/ublkb"))
        {
            block_dev = Some(PathBuf::from(p));
        }
        if line.starts_with("serving") || Instant::now() > deadline {
            break;
        }
    }
    let Some(block_dev) = block_dev else {
        let mut err = String::new();
        let _ = child.stderr.take().unwrap().read_to_string(&mut err);
        panic!("uzram serve --ublk printed no /dev/ublkbN: {err}");
    };
    Server {
        child,
        dir,
        block_dev,
    }
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
    if !vm_support::in_vm_or_boot("ublk_filesystem_in_vm", &vm_args(1024)) {
        return;
    }
    let mut s = serve(&["--disksize", "256M"]);
    let dev = s.block_dev.clone();
    let dir = s.dir.path().to_path_buf();
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
    let files = real_files(s.child.id());
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

    // SIGTERM: the server removes the block device and exits 0, in seconds.
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
    assert!(err.contains(&format!("removed {}", dev.display())), "{err}");
    assert!(!dev.exists(), "{} still exists", dev.display());
}

/// SIGTERM: the server removes the block device and exits 0, in seconds.
fn stop(mut s: Server) {
    let dev = s.block_dev.clone();
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
    assert!(err.contains(&format!("removed {}", dev.display())), "{err}");
    assert!(!dev.exists(), "{} still exists", dev.display());
}

/// fio's verifying writers at depth 32 on the device, then a server killed with I/O in
/// flight: the I/O fails, nothing hangs, the block device goes away and the device left
/// behind is deleted by `uzram ublk-delete`.
#[test]
fn ublk_fio_and_kill_in_vm() {
    if !vm_support::in_vm_or_boot("ublk_fio_and_kill_in_vm", &vm_args(1024)) {
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
    s.child.kill().unwrap();
    s.child.wait().unwrap();
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
