//! The NBD server driven by real clients: qemu-img, qemu-io, nbdinfo, nbdcopy, fio's nbd
//! engine, and the kernel (ext4 on a loop device over nbdfuse).
//!
//! Every client must be installed (scripts/debian-packages.txt): a missing one fails the test
//! with the package to install; nothing is skipped.

use std::path::{Path, PathBuf};
use std::process::Command;
use uzram_testkit::nbd::{NbdLoop, Served};
use uzram_testkit::pages::pattern;
use uzram_testkit::process::{require, run};

const MIB: u64 = 1 << 20;

/// An export of `size` bytes, and an image `src` of `size` bytes of [`pattern`] `seed` (`data`)
/// to copy into it and back out to the image `back`.
struct RoundTrip {
    srv: Served,
    data: Vec<u8>,
    src: PathBuf,
    back: PathBuf,
    _dir: tempfile::TempDir,
}

impl RoundTrip {
    fn new(size: u64, seed: u64) -> RoundTrip {
        let dir = tempfile::tempdir().unwrap();
        let data = pattern(size as usize, seed);
        let (src, back) = (dir.path().join("src.img"), dir.path().join("back.img"));
        std::fs::write(&src, &data).unwrap();
        RoundTrip {
            srv: Served::new(size),
            data,
            src,
            back,
            _dir: dir,
        }
    }

    /// Asserts that `back` holds exactly what `src` held.
    fn assert_back(&self, client: &str) {
        let got = std::fs::read(&self.back).unwrap();
        assert_eq!(got.len(), self.data.len(), "{client}");
        assert!(got == self.data, "{client} round trip differs");
    }
}

#[test]
fn qemu_img_info_shows_the_export() {
    require("qemu-img");
    let srv = Served::new(64 * MIB);
    let out =
        run(Command::new("qemu-img").args(["info", "--output=json", "-f", "raw", &srv.uri()]));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("qemu-img json");
    assert_eq!(info["virtual-size"], 64 * MIB, "{info}");
    assert_eq!(info["format"], "raw", "{info}");
}

#[test]
fn qemu_img_convert_round_trips() {
    require("qemu-img");
    let t = RoundTrip::new(24 * MIB, 1);
    // Into the export (-n: the target exists), then out of it into a new file.
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&t.src)
        .arg(t.srv.uri()));
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(t.srv.uri())
        .arg(&t.back));
    t.assert_back("qemu-img convert");
    // And what qemu wrote is what the device holds.
    let mut direct = vec![0u8; 1 << 20];
    t.srv.device.read_at(&mut direct, 5 * MIB).unwrap();
    assert!(
        direct[..] == t.data[5 << 20..6 << 20],
        "device contents differ"
    );
    // qemu-img compare reads both through their own paths.
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&t.src)
        .arg(t.srv.uri()));
}

#[test]
fn qemu_io_patterns_including_sub_page_io() {
    require("qemu-io");
    let srv = Served::new(16 * MIB);
    // 512-byte I/O at odd sectors (sub-page: the device's read-modify-write), I/O that
    // straddles pages, FUA writes, write-zeroes, discard, flush, and many requests in flight
    // (aio_*). Every read verifies its pattern (-P).
    let cmds = [
        "write -P 0xab 512 512",
        "write -P 0xcd 1536 512",
        "write -P 0x11 4096 4096",
        "write -P 0x22 7680 1536",
        "read -P 0xab 512 512",
        "read -P 0xcd 1536 512",
        "read -P 0x00 0 512",
        "read -P 0x00 1024 512",
        "read -P 0x11 4096 3584",
        "read -P 0x22 7680 1536",
        "write -f -P 0x33 1M 64k",
        "read -P 0x33 1M 64k",
        "write -z 1M 4k",
        "read -P 0x00 1M 4k",
        "read -P 0x33 1028k 60k",
        "write -P 0x44 2M 1M",
        "discard 2M 512k",
        "write -P 0x55 2M 512k",
        "read -P 0x55 2M 512k",
        "read -P 0x44 2560k 512k",
        "flush",
        "aio_write -P 0x61 4M 64k",
        "aio_write -P 0x62 5M 64k",
        "aio_write -P 0x63 6M 64k",
        "aio_flush",
        "aio_read -P 0x61 4M 64k",
        "aio_read -P 0x62 5M 64k",
        "aio_read -P 0x63 6M 64k",
        "aio_flush",
        "read -P 0x00 16383k 1k",
    ];
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    cmd.arg(srv.uri());
    let out = run(&mut cmd);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        !text.contains("failed") && !text.contains("error") && !text.contains("Error"),
        "qemu-io reported a failure:\n{text}"
    );
    assert_eq!(
        text.matches("read ").count(),
        cmds.iter().filter(|c| c.contains("read")).count(),
        "every read should report success:\n{text}"
    );
    // A read past the end fails cleanly, and the connection survives for the next command.
    let out = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "read 16M 4k",
            "-c",
            "read -P 0xab 512 512",
        ])
        .arg(srv.uri())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("read 512/512"), "{text}");
}

#[test]
fn nbdinfo_lists_exports_and_block_sizes() {
    require("nbdinfo");
    let srv = Served::new(32 * MIB);
    let list_uri = format!("nbd+unix:///?socket={}", srv.socket.display());
    let out = run(Command::new("nbdinfo").args(["--list", &list_uri]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("export=\"zram0\""), "{text}");

    let out = run(Command::new("nbdinfo").args(["--json", &srv.uri()]));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("nbdinfo json");
    let export = &info["exports"][0];
    assert_eq!(export["export-name"], "zram0", "{info}");
    assert_eq!(export["export-size"], 32 * MIB, "{info}");
    assert_eq!(export["block_size_minimum"], 512, "{info}");
    assert_eq!(export["block_size_preferred"], 4096, "{info}");
    assert_eq!(export["block_size_maximum"], 32 * MIB, "{info}");
    assert_eq!(export["can_multi_conn"], true, "{info}");
    assert_eq!(export["can_flush"], true, "{info}");
    assert_eq!(export["can_fua"], true, "{info}");
    assert_eq!(export["can_trim"], true, "{info}");
    assert_eq!(export["can_zero"], true, "{info}");
    assert_eq!(export["can_fast_zero"], true, "{info}");
    assert_eq!(export["is_read_only"], false, "{info}");
    assert_eq!(info["protocol"], "newstyle-fixed", "{info}");

    // The human-readable form shows the size too.
    let out = run(Command::new("nbdinfo").arg(srv.uri()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("export-size: 33554432"), "{text}");
}

#[test]
fn nbdcopy_with_four_connections_round_trips() {
    require("nbdcopy");
    let t = RoundTrip::new(48 * MIB, 2);
    std::fs::write(&t.back, b"").unwrap();
    run(Command::new("nbdcopy")
        .args(["--connections=4", "--requests=16", "--flush"])
        .arg(&t.src)
        .arg(t.srv.uri()));
    run(Command::new("nbdcopy")
        .args(["--connections=4"])
        .arg(t.srv.uri())
        .arg(&t.back));
    t.assert_back("nbdcopy");
}

#[test]
fn fio_nbd_engine_verifies_crc32c() {
    require("fio");
    let srv = Served::new(64 * MIB);
    let dir = tempfile::tempdir().unwrap();
    let uri = format!("--uri={}", srv.uri());
    // Random 4 KiB and 64 KiB writes with 32 in flight, then verification reads (crc32c in
    // every block); a second job verifies with two jobs on separate halves.
    for (bs, jobs) in [("4k", "1"), ("64k", "1"), ("16k", "2")] {
        let out = run(Command::new("fio").current_dir(dir.path()).args([
            "--name=uzram",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            &format!("--bs={bs}"),
            "--size=16M",
            "--iodepth=32",
            &format!("--numjobs={jobs}"),
            "--offset_increment=24M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--buffer_compress_percentage=60",
            "--refill_buffers",
            "--randrepeat=1",
            "--group_reporting",
        ]));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("err= 0"), "fio reported errors:\n{text}");
        assert!(
            !text.contains("verify failed") && !text.contains("bad magic"),
            "fio verify failure:\n{text}"
        );
        // The verification pass read everything back.
        assert!(text.contains("READ: bw="), "no verification reads:\n{text}");
    }
}

fn sha256(path: &Path) -> String {
    let out = run(Command::new("sha256sum").arg(path));
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

#[test]
fn kernel_block_device_via_nbdfuse_and_loop_ext4() {
    for p in [
        "nbdfuse",
        "fusermount3",
        "losetup",
        "mkfs.ext4",
        "mount",
        "umount",
    ] {
        require(p);
    }
    let srv = Served::new(128 * MIB);
    let dir = tempfile::tempdir().unwrap();
    let fuse_dir = dir.path().join("fuse");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&fuse_dir).unwrap();
    std::fs::create_dir(&mnt).unwrap();
    // nbdfuse in the foreground (as a child we own), exposing the export as fuse/nbd, with
    // several connections (the export allows multi-conn).
    let mut k = NbdLoop::attach(
        Command::new("nbdfuse")
            .args(["-C", "2"])
            .arg(&fuse_dir)
            .arg(srv.uri()),
        &fuse_dir,
        128 * MIB,
        &[],
    );
    k.mnt = Some(mnt.clone());
    let loop_dev = k.dev().to_string();

    run(Command::new("mkfs.ext4").args(["-q", "-F", &loop_dev]));
    run(Command::new("mount").arg(&loop_dev).arg(&mnt));
    let mut sums = Vec::new();
    for i in 0..8u64 {
        let p = mnt.join(format!("file{i}"));
        std::fs::write(&p, pattern(((i + 1) * 700_000) as usize, 10 + i)).unwrap();
        sums.push((p, None::<String>));
    }
    for (p, s) in sums.iter_mut() {
        *s = Some(sha256(p));
    }
    run(&mut Command::new("sync"));
    run(Command::new("umount").arg(&mnt));
    // Drop the loop device's page cache so the remount reads through NBD again.
    run(Command::new("blockdev").args(["--flushbufs", &loop_dev]));
    run(Command::new("mount").arg(&loop_dev).arg(&mnt));
    for (i, (p, s)) in sums.iter().enumerate() {
        assert_eq!(
            Some(sha256(p)),
            *s,
            "file{i} changed across unmount and remount"
        );
        let data = std::fs::read(p).unwrap();
        assert!(data == pattern(((i as u64 + 1) * 700_000) as usize, 10 + i as u64));
    }
    run(Command::new("umount").arg(&mnt));
    // A clean filesystem after all that.
    run(Command::new("e2fsck").args(["-f", "-n", &loop_dev]));
}
