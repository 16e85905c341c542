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

/// qemu-io running `cmds` (`-c` each) against the export: no failure or error reported, and
/// every read (`read`, `aio_read`) reporting success; its output (stdout and stderr).
fn qemu_io(srv: &Served, cmds: &[&str]) -> String {
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
        !text.contains("failed") && !text.contains("rror"),
        "qemu-io reported a failure:\n{text}"
    );
    assert_eq!(
        text.matches("read ").count(),
        cmds.iter().filter(|c| c.contains("read")).count(),
        "every read should report success:\n{text}"
    );
    text
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
    qemu_io(&srv, &cmds);
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

/// qemu-io at byte offsets and lengths (qemu turns them into whole sectors, the minimum block
/// it was told, and does the read-modify-write itself), and 64 MiB each way.
#[test]
fn qemu_io_unaligned_bytes_and_the_largest_request() {
    require("qemu-io");
    let srv = Served::new(80 * MIB);
    let cmds = [
        "write -P 0x5a 1 3",
        "write -P 0x6b 4095 2",
        "write -P 0x7c 8191 8195",
        "read -P 0x00 0 1",
        "read -P 0x5a 1 3",
        "read -P 0x00 4 4091",
        "read -P 0x6b 4095 2",
        "read -P 0x7c 8191 8195",
        "read -P 0x00 16386 100",
        "write -P 0x66 8M 64M",
        "read -P 0x66 8M 64M",
        "read -P 0x00 72M 8M",
    ];
    let text = qemu_io(&srv, &cmds);
    assert!(text.contains("wrote 67108864/67108864"), "{text}");
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
    assert_eq!(export["block_size_maximum"], 64 * MIB, "{info}");
    assert_eq!(export["can_cache"], true, "{info}");
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

/// The layout block status is checked against: 64 MiB with data at [8, 12) MiB but a hole at
/// [9, 10) MiB (discarded), a run of zero-filled pages at [20, 21) MiB, holes elsewhere.
fn sparse_layout() -> Served {
    let srv = Served::new(64 * MIB);
    srv.device
        .write_at(&pattern(4 * MIB as usize, 5), 8 * MIB)
        .unwrap();
    srv.device.discard(9 * MIB, MIB).unwrap();
    srv.device
        .write_at(&vec![0u8; MIB as usize], 20 * MIB)
        .unwrap();
    srv
}

/// Bytes the device has read (its `stat`'s read sectors × 512).
fn bytes_read(srv: &Served) -> u64 {
    let stat = srv.device.attr_show("stat").unwrap();
    let f: Vec<u64> = stat
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    f[2] * 512
}

/// `NBD_CMD_BLOCK_STATUS` with `base:allocation`: nbdinfo --map and qemu-img map show holes
/// where nothing is stored, zeroes where pages are zero-filled and data where data is, and
/// nbdcopy reads only the data.
#[test]
fn block_status_maps_holes_zeroes_and_data() {
    for p in ["nbdinfo", "qemu-img", "nbdcopy"] {
        require(p);
    }
    let srv = sparse_layout();
    let out = run(Command::new("nbdinfo").args(["--map", "--json", &srv.uri()]));
    let map: serde_json::Value = serde_json::from_slice(&out.stdout).expect("nbdinfo json");
    let got: Vec<(u64, u64, u64)> = map
        .as_array()
        .expect("an array of extents")
        .iter()
        .map(|e| {
            (
                e["offset"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["type"].as_u64().unwrap(),
            )
        })
        .collect();
    // type: 3 hole and zero, 2 zero, 0 data.
    let want = vec![
        (0, 8 * MIB, 3),
        (8 * MIB, MIB, 0),
        (9 * MIB, MIB, 3),
        (10 * MIB, 2 * MIB, 0),
        (12 * MIB, 8 * MIB, 3),
        (20 * MIB, MIB, 2),
        (21 * MIB, 43 * MIB, 3),
    ];
    assert_eq!(got, want, "{map}");

    // qemu-img map: data exactly where data is.
    let out = run(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw", &srv.uri()]));
    let map: serde_json::Value = serde_json::from_slice(&out.stdout).expect("qemu-img json");
    let data: Vec<(u64, u64)> = map
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["data"] == true && e["zero"] == false)
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(data, vec![(8 * MIB, MIB), (10 * MIB, 2 * MIB)], "{map}");

    // nbdcopy reads the 3 MiB of data and nothing else.
    let before = bytes_read(&srv);
    run(Command::new("nbdcopy").arg(srv.uri()).arg("null:"));
    assert_eq!(bytes_read(&srv) - before, 3 * MIB);
    // qemu-img convert to a file copies the same bytes.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("copy.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", &srv.uri()])
        .arg(&copy));
    let mut all = vec![0u8; 64 * MIB as usize];
    uzram::BlockDevice::read_at(&*srv.device, &mut all, 0).unwrap();
    assert!(
        std::fs::read(&copy).unwrap() == all,
        "qemu-img convert's copy differs"
    );
}

/// A read-only export: the flags say so (no trim or zero), libnbd and qemu see it, and the
/// server answers writes, trims and write-zeroes with EPERM, changing nothing.
#[test]
fn read_only_export_refuses_changes_with_eperm() {
    use uzram_testkit::nbd::RawClient;
    require("nbdinfo");
    require("qemu-io");
    let device = std::sync::Arc::new(uzram_testkit::device::DeviceBuilder::bytes(16 * MIB).build());
    let data = pattern(MIB as usize, 9);
    uzram::BlockDevice::write_at(&*device, &data, 0).unwrap();
    let srv = Served::with_device(device, true);
    let out = run(Command::new("nbdinfo").args(["--json", &srv.uri()]));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("nbdinfo json");
    let export = &info["exports"][0];
    assert_eq!(export["is_read_only"], true, "{info}");
    assert_eq!(export["can_trim"], false, "{info}");
    assert_eq!(export["can_zero"], false, "{info}");
    // qemu-io reads it (-r), and will not open it for writing.
    run(Command::new("qemu-io")
        .args(["-r", "-f", "raw", "-c", "read 0 1M"])
        .arg(srv.uri()));
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x11 0 4k"])
        .arg(srv.uri())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!text.contains("wrote"), "{text}");
    // The server itself refuses: EPERM for each command that changes data.
    let (mut c, _) = RawClient::handshake(&srv.socket, true);
    assert_eq!(c.write(1, 0, &[7u8; 4096]), uzram_nbd_proto::NBD_EPERM);
    for (cookie, cmd) in [
        (2, uzram_nbd_proto::CMD_TRIM),
        (3, uzram_nbd_proto::CMD_WRITE_ZEROES),
    ] {
        c.send_request(cmd, 0, cookie, 0, 4096);
        assert_eq!(c.read_reply(0).error, uzram_nbd_proto::NBD_EPERM);
    }
    let r = c.read(4, 0, MIB as u32);
    assert!(r.data == data, "a refused command changed data");
}
