//! The kernel's own zram tests, translated to `uzram ctl`: the steps of
//! tools/testing/selftests/zram (zram01, zram02) and of LTP's zram01, zram02 and zram03, each
//! `echo VALUE > /sys/block/zramN/ATTR` an `uzram ctl --dev zramN ATTR VALUE`, each
//! `/dev/zramN` the device through NBD (nbdfuse and a loop device where a file system or
//! swap signature goes on it), and the zram parity details found while translating them
//!. The built binary, real clients (qemu-io, nbdfuse, losetup, mkfs, mount,
//! dd, mkswap, blkid), as root.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use uzram_testkit::nbd::NbdLoop;
use uzram_testkit::process::{require, run, wait_for};
use uzram_testkit::serve::{Running, Serve};

const MIB: u64 = 1 << 20;

/// `uzram serve` with `n` devices zram0.. of 1 MiB, each then reset, as a freshly loaded zram
/// module's devices are (uninitialised).
fn serve(n: usize) -> Running {
    let mut toml = String::new();
    for i in 0..n {
        toml.push_str(&format!(
            "[[device]]\nname = \"zram{i}\"\ndisksize = \"1M\"\n"
        ));
    }
    let r = Serve::config(&toml).arg(&["--dir", "{dir}"]).start();
    for i in 0..n {
        r.set(&format!("zram{i}"), "reset", "1");
    }
    r
}

/// `echo VALUE > ATTR`, which must fail with `errno` (uzram ctl's exit status).
fn set_fails(r: &Running, dev: &str, attr: &str, value: &str, errno: i32) {
    let out = r.ctl(&["--dev", dev, attr, value]);
    assert_eq!(out.status.code(), Some(errno), "{attr} {value}: {out:?}");
}

/// zram_cleanup's `echo 1 > reset` once the clients are gone: a client that exited (qemu-io,
/// nbdfuse) has closed its socket, but the server notices the close on its own thread a moment
/// later, and reset while a connection is open is EBUSY as in zram. Waits (10 s at most) for
/// `nbd_connections` to read 0, then resets.
fn reset_when_closed(r: &Running, dev: &str) {
    wait_for(
        &format!("{dev}: NBD connections closed after the clients left"),
        Duration::from_secs(10),
        || r.show(dev, "nbd_connections").trim() == "0",
    );
    r.set(dev, "reset", "1");
}

fn qemu_io(uri: &str, cmds: &[&str]) {
    require("qemu-io");
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let out = run(c.arg(uri));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("Pattern verification failed"), "{text}");
}

/// `/dev/zramN` for the kernel: the export through nbdfuse and a loop device, and a mount
/// point `DIR/mnt` for it. Unmounts, detaches and stops on drop.
fn block_dev(uri: &str, size: u64, dir: &Path) -> (NbdLoop, PathBuf) {
    for p in ["mount", "umount"] {
        require(p);
    }
    let fuse_dir = dir.join("fuse");
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mut b = NbdLoop::attach(
        Command::new("nbdfuse").arg(&fuse_dir).arg(uri),
        &fuse_dir,
        size,
        &[],
    );
    b.mnt = Some(mnt.clone());
    (b, mnt)
}

/// zram_lib.sh's zram_compress_alg, zram_set_disksizes and zram_set_memlimit, then zram01's
/// zram_makefs, zram_mount and zram_fill_fs (LTP's ratio check), for one device.
#[test]
fn ltp_and_selftest_zram01() {
    let r = serve(2);
    // zram_compress_alg: every algorithm `sed 's/[][]//g' comp_algorithm` lists can be set.
    let algs = r.show("zram0", "comp_algorithm").replace(['[', ']'], "");
    assert!(algs.split_whitespace().count() >= 4, "{algs}");
    for dev in ["zram0", "zram1"] {
        for alg in algs.split_whitespace() {
            r.set(dev, "comp_algorithm", alg);
            assert!(r.show(dev, "comp_algorithm").contains(&format!("[{alg}]")));
        }
    }
    // The selftest's algorithm is lzo, which uzram does not have: EINVAL (the selftest
    // reports it and goes on).
    set_fails(&r, "zram1", "comp_algorithm", "lzo", libc::EINVAL);
    // zram_set_disksizes: bytes (26214400, LTP; 2097152, the selftest); zram_set_memlimit.
    r.set("zram0", "disksize", "26214400");
    r.set("zram1", "disksize", "2097152");
    r.set("zram0", "mem_limit", "25M");
    r.set("zram1", "mem_limit", "2M");
    assert_eq!(r.columns("zram0", "mm_stat")[3], 25 * MIB);
    assert_eq!(r.columns("zram1", "mm_stat")[3], 2 * MIB);

    // zram_makefs, zram_mount, zram_fill_fs on zram0: ext2, filled with zeros 1 KiB at a time
    // until full (one dd of 1 KiB blocks, as the loop of dd count=1 writes the same).
    for p in ["mkfs.ext2", "dd"] {
        require(p);
    }
    let work = tempfile::tempdir().unwrap();
    let (b, mnt) = block_dev(&r.uri("zram0"), 26214400, work.path());
    run(Command::new("mkfs.ext2").args(["-q", "-F", b.dev()]));
    run(Command::new("mount").arg(b.dev()).arg(&mnt));
    let out = Command::new("dd")
        .args(["if=/dev/zero", "bs=1024", "status=none", "conv=notrunc"])
        .arg(format!("of={}", mnt.join("file").display()))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "dd stops when the file system is full"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("No space left"),
        "{out:?}"
    );
    run(&mut Command::new("sync"));
    let kib = std::fs::metadata(mnt.join("file")).unwrap().len() / 1024;
    assert!(kib > 20_000, "filled {kib} KiB");
    // LTP: v = 100 * 1024 * b / compr_size must be at least 100 (ratio 1:1).
    let compr = r.columns("zram0", "mm_stat")[1];
    assert!(
        compr > 0,
        "the file system's metadata compresses to something"
    );
    let v = 100 * 1024 * kib / compr;
    assert!(v >= 100, "compression ratio {v}/100");
    drop(b);
    // zram_cleanup.
    reset_when_closed(&r, "zram0");
    reset_when_closed(&r, "zram1");
    assert_eq!(r.show("zram0", "initstate"), "0\n");
}

/// zram02: the device as swap (zram_makeswap's mkswap; swapon itself is left out: the test
/// machine's kernel would then page out to a server the test owns).
#[test]
fn ltp_and_selftest_zram02() {
    for p in ["mkswap", "blkid"] {
        require(p);
    }
    let r = serve(1);
    r.set("zram0", "disksize", "1048576");
    let work = tempfile::tempdir().unwrap();
    let (b, _) = block_dev(&r.uri("zram0"), MIB, work.path());
    run(Command::new("mkswap").arg(b.dev()));
    let out = run(Command::new("blkid").args(["-p", "-o", "value", "-s", "TYPE", b.dev()]));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "swap");
    drop(b);
    reset_when_closed(&r, "zram0");
}

/// LTP's zram03: a 512 MiB device filled with 'a' but its last byte 0, the block layer's `stat`
/// (reads, writes) and mm_stat printed, the contents verified, reset, printed again.
#[test]
fn ltp_zram03() {
    let r = serve(1);
    const SIZE: u64 = 512 * MIB;
    r.set("zram0", "disksize", &SIZE.to_string());
    let uri = r.uri("zram0");
    qemu_io(
        &uri,
        &[
            &format!("write -P 0x61 0 {SIZE}"),
            &format!("write -P 0 {} 1", SIZE - 1),
        ],
    );
    // dump_info: initstate, disksize, mm_stat's orig_data_size compr_data_size mem_used_total
    // same_pages, stat's reads (field 1) and writes (field 5).
    assert_eq!(r.show("zram0", "initstate"), "1\n");
    assert_eq!(r.show("zram0", "disksize"), format!("{SIZE}\n"));
    assert_eq!(r.columns("zram0", "mm_stat")[0], SIZE);
    // Every page but the last is one byte repeated.
    assert_eq!(r.columns("zram0", "mm_stat")[5], SIZE / 4096 - 1);
    let writes = r.columns("zram0", "stat")[4];
    assert!(writes >= 2, "{}", r.show("zram0", "stat"));
    assert_eq!(r.show("zram0", "stat").split_whitespace().count(), 17);
    // verify_device.
    qemu_io(
        &uri,
        &[
            &format!("read -P 0x61 0 {}", SIZE - 1),
            &format!("read -P 0 {} 1", SIZE - 1),
        ],
    );
    assert!(
        r.columns("zram0", "stat")[0] >= 2,
        "{}",
        r.show("zram0", "stat")
    );
    // writes' sectors: at least the whole device.
    assert!(r.columns("zram0", "stat")[6] >= SIZE / 512);
    // reset, dump_info again: uninitialised, and the block layer's counters zeroed as the
    // kernel's reset zeroes them.
    reset_when_closed(&r, "zram0");
    assert_eq!(r.show("zram0", "initstate"), "0\n");
    assert_eq!(r.show("zram0", "disksize"), "0\n");
    assert!(r.show("zram0", "stat").split_whitespace().all(|w| w == "0"));
}

/// The parity details, each as the kernel behaves.
#[test]
fn zram_parity_details() {
    let r = serve(1);
    let d = "zram0";
    // idle and compact on an uninitialised device: EINVAL (zram's init_done checks).
    set_fails(&r, d, "idle", "all", libc::EINVAL);
    set_fails(&r, d, "compact", "1", libc::EINVAL);
    let out = r.ctl(&["--dev", d, "-v", "compact", "1"]);
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("started"),
        "refused at once, without a progress line: {out:?}"
    );
    // debugfs's block_state of an uninitialised device: EINVAL.
    let out = r.ctl(&["--dev", d, "block_state"]);
    assert_eq!(out.status.code(), Some(libc::EINVAL), "{out:?}");
    // writeback_compressed: compressed_writeback's early name, an alias.
    r.set(d, "writeback_compressed", "1");
    assert_eq!(r.show(d, "compressed_writeback"), "1\n");
    assert_eq!(r.show(d, "writeback_compressed"), "1\n");
    r.set(d, "compressed_writeback", "0");
    assert_eq!(r.show(d, "writeback_compressed"), "0\n");
    // Parameters survive a change of algorithm: zstd's level 20 kept for lz4hc (1..=12), so
    // disksize fails; with a level both take, it works.
    r.set(d, "comp_algorithm", "zstd");
    r.set(d, "algorithm_params", "level=20");
    r.set(d, "comp_algorithm", "lz4hc");
    set_fails(&r, d, "disksize", "1M", libc::EINVAL);
    r.set(d, "algorithm_params", "level=9");
    r.set(d, "comp_algorithm", "zstd");
    r.set(d, "comp_algorithm", "lz4hc");
    // Sizes as memparse reads them: a suffix after the number, anything after it ignored,
    // leading 0 octal.
    r.set(d, "disksize", "010M trailing words");
    assert_eq!(r.show(d, "disksize"), format!("{}\n", 8 * MIB));
    r.set(d, "mem_limit", "1.5G");
    assert_eq!(
        r.columns(d, "mm_stat")[3],
        4096,
        "1.5G is 1 byte, rounded up to a page"
    );
    r.set(d, "mem_limit", "0");
    // algorithm_params after initialisation: accepted, as the kernel accepts it.
    r.set(d, "algorithm_params", "level=3");
    // notify_free counts discarded and zeroed pages (zram_bio_discard), free notifications
    // aside.
    let uri = r.uri(d);
    qemu_io(
        &uri,
        &[
            "write -P 0x11 0 64k",
            "write -s /proc/self/exe 64k 64k",
            "discard 0 32k",
            "write -z 32k 16k",
        ],
    );
    assert_eq!(r.columns(d, "io_stat")[3], 8 + 4);
    // block_state: a line per page holding data, zram's format and flags.
    r.set(d, "idle", "all");
    let state = r.show(d, "block_state");
    let lines: Vec<&str> = state.lines().collect();
    // Pages 12..16 same-filled (0x11), 16..32 the executable's bytes.
    assert_eq!(lines.len(), 4 + 16, "{state}");
    let first = lines[0];
    assert_eq!(first.len(), 12 + 1 + 12 + 1 + 6 + 1 + 6, "{first:?}");
    let f: Vec<&str> = first.split_whitespace().collect();
    assert_eq!(f[0], "12");
    assert_eq!(
        f[2], "s.....",
        "same-filled pages are not idle candidates: {first}"
    );
    assert!(
        lines[4..]
            .iter()
            .all(|l| l.ends_with("i..") || l.ends_with("i.n")),
        "{state}"
    );
    assert!(lines[4].trim_start().starts_with("16 "));
    // compact on an initialised device works.
    r.set(d, "compact", "1");
    // The block layer's stat counted the requests: writes (4 incl. write-zeroes), discards.
    let stat: Vec<u64> = r
        .show(d, "stat")
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    assert!(stat[4] >= 3 && stat[11] >= 1, "{stat:?}");
}
