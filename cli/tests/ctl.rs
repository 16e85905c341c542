//! `uzram ctl`, `uzram status`, `uzram serve --config` and `--swap` as a user runs them: the
//! built binary, a real NBD client (qemu-img, qemu-io), exit codes and messages.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};
use uzram_testkit::nbd::RawClient;
use uzram_testkit::process::{assert_private, is_root, proc_field, require, run};
use uzram_testkit::refused::assert_refused;
use uzram_testkit::serve::{stderr, stdout, uzram_bin, Running, Serve};
use uzram_testkit::vm::mem_total_bytes;

fn mm_stat(r: &Running, dev: &str) -> Vec<u64> {
    let o = r.ctl(&["--dev", dev, "mm_stat"]);
    assert!(o.status.success(), "{o:?}");
    let v: Vec<u64> = stdout(&o)
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(v.len(), 9, "{o:?}");
    v
}

fn qemu_img_size(uri: &str) -> u64 {
    let out = run(Command::new("qemu-img").args(["info", "--output=json", "-f", "raw", uri]));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    info["virtual-size"].as_u64().unwrap()
}

/// `uzram serve` of one 64 MiB device, zram0, on a unix socket, for qemu-io and qemu-img;
/// its control sockets (the device's, and zram-control's for hot_add) are private.
fn serve_zram0_for_qemu() -> Running {
    require("qemu-io");
    require("qemu-img");
    let r = Serve::args(&["--disksize", "64M", "--socket", "{dir}/zram0.sock"]).start();
    assert_private(&r.dir().join("zram0.ctl"));
    assert_private(&r.dir().join("zram-control"));
    r
}

#[test]
fn ctl_shows_and_stores_attributes_with_zrams_errnos() {
    let r = serve_zram0_for_qemu();

    // Show, exactly as sysfs reads.
    let o = r.ctl(&["disksize"]);
    assert!(o.status.success());
    assert_eq!(stdout(&o), format!("{}\n", 64u64 << 20));
    assert_eq!(
        stdout(&r.ctl(&["comp_algorithm"])),
        "[lz4] lz4hc zstd deflate \n"
    );
    assert_eq!(mm_stat(&r, "zram0")[0], 0);

    // Data written by a client shows in mm_stat.
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x5a 0 1M", &r.uri("zram0")]));
    let mm = mm_stat(&r, "zram0");
    assert_eq!(mm[0], 1 << 20, "orig_data_size");
    assert_eq!(mm[5], 256, "same_pages: a 0x5a fill is same-filled");

    // Errors: the shell's words, the symbolic name, and the errno as exit status.
    let o = r.ctl(&["disksize", "1G"]);
    assert_eq!(o.status.code(), Some(libc::EBUSY), "{o:?}");
    assert!(
        stderr(&o).starts_with("uzram: disksize: Device or resource busy (EBUSY)"),
        "{}",
        stderr(&o)
    );
    let o = r.ctl(&["comp_algorithm", "nosuch"]);
    assert_eq!(o.status.code(), Some(libc::EINVAL), "{o:?}");
    assert!(stderr(&o).starts_with("uzram: comp_algorithm: Invalid argument (EINVAL)"));
    let o = r.ctl(&["no_such_attribute"]);
    assert_eq!(o.status.code(), Some(libc::ENOENT), "{o:?}");
    let o = r.ctl(&["reset"]);
    assert_eq!(
        o.status.code(),
        Some(libc::EACCES),
        "reading a write-only attribute"
    );
    let o = r.ctl(&["mm_stat", "1"]);
    assert_eq!(
        o.status.code(),
        Some(libc::EACCES),
        "writing a read-only attribute"
    );
    let o = r.ctl(&["--dev", "zram9", "mm_stat"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("is `uzram serve` running?"), "{o:?}");

    let o = r.ctl(&["idle", "all"]);
    assert!(o.status.success(), "{o:?}");

    // A long operation off a terminal: quiet; with -v its progress lines before its result.
    let o = r.ctl(&["compact", "1"]);
    assert!(o.status.success(), "{o:?}");
    assert!(o.stderr.is_empty() && o.stdout.is_empty(), "{o:?}");
    let o = r.ctl(&["-v", "compact", "1"]);
    assert!(o.status.success(), "{o:?}");
    assert!(stderr(&o).starts_with("uzram: compact: started\n"), "{o:?}");

    // reset is refused while a client has the device open, as zram refuses it while the disk
    // is open; then works, and a new disksize is what new clients see.
    let (client, _) = RawClient::handshake(&r.dir().join("zram0.sock"), true);
    let o = r.ctl(&["reset", "1"]);
    assert_eq!(o.status.code(), Some(libc::EBUSY), "{o:?}");
    assert!(stderr(&o).contains("open by 1 NBD connection"), "{o:?}");
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = r.ctl(&["reset", "1"]);
        if o.status.success() {
            break;
        }
        // The server notices the client's hang-up on its own schedule.
        assert_eq!(o.status.code(), Some(libc::EBUSY), "{o:?}");
        assert!(
            Instant::now() < deadline,
            "reset stayed busy after the client left"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(stdout(&r.ctl(&["initstate"])), "0\n");
    assert!(r.ctl(&["comp_algorithm", "zstd"]).status.success());
    // Values of several words are one value, as `echo algo=zstd level=3 >` writes.
    let o = r.ctl(&["algorithm_params", "algo=zstd", "level=3"]);
    assert!(o.status.success(), "{o:?}");
    let o = r.ctl(&["algorithm_params", "algo=zstd", "level=x"]);
    assert_eq!(o.status.code(), Some(libc::EINVAL), "{o:?}");
    assert!(r.ctl(&["disksize", "32M"]).status.success());
    assert_eq!(qemu_img_size(&r.uri("zram0")), 32 << 20);
    assert_eq!(
        stdout(&r.ctl(&["comp_algorithm"])),
        "lz4 lz4hc [zstd] deflate \n"
    );
    r.stop();
}

#[test]
fn status_is_a_zramctl_table_of_every_device() {
    require("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("uzram.toml");
    let d = dir.path().display();
    std::fs::write(
        &cfg,
        format!(
            r#"
[[device]]
name = "zram0"
disksize = "64M"
socket = "{d}/zram0.sock"
comp_algorithm = "zstd"
algorithm_params = "level=5"
mem_limit = "32M"

[[device]]
name = "zram1"
disksize = "16M"
page_size = 16384
socket = "{d}/zram1.sock"
"#
        ),
    )
    .unwrap();
    let r = Serve::args(&["--config", cfg.to_str().unwrap()])
        .in_dir(dir)
        .start();
    assert_eq!(qemu_img_size(&r.uri("zram0")), 64 << 20);
    assert_eq!(qemu_img_size(&r.uri("zram1")), 16 << 20);
    assert_eq!(mm_stat(&r, "zram0")[3], 32 << 20, "mem_limit from the file");
    assert_eq!(
        stdout(&r.ctl(&["--dev", "zram0", "comp_algorithm"])),
        "lz4 lz4hc [zstd] deflate \n"
    );
    // Position-dependent data, so a compressible but not same-filled page.
    let data = r.dir().join("data");
    let bytes: Vec<u8> = (0..4u32 << 20).map(|i| (i / 7 % 251) as u8).collect();
    std::fs::write(&data, &bytes).unwrap();
    run(Command::new("qemu-img").args([
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        data.to_str().unwrap(),
        &r.uri("zram1"),
    ]));
    let s = r.status(&[]);
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines.len(), 3, "{s}");
    let cols = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
    // zramctl's default columns; no mount point or STREAMS for uzram's devices: empty cells.
    assert_eq!(
        lines[0], "NAME  ALGORITHM DISKSIZE DATA  COMPR TOTAL STREAMS MOUNTPOINT",
        "{s}"
    );
    assert_eq!(cols(lines[1])[..4], ["zram0", "zstd", "64M", "0B"]);
    // zramctl's alignment: text columns to the left, sizes to the right.
    let algo = lines[0].find("ALGORITHM").unwrap();
    assert_eq!(lines[1].find("zstd"), Some(algo), "{s}");
    assert_eq!(lines[2].find("lz4"), Some(algo), "{s}");
    let disksize_end = lines[0].find("DISKSIZE").unwrap() + "DISKSIZE".len();
    assert_eq!(
        lines[1].find("64M").map(|i| i + 3),
        Some(disksize_end),
        "{s}"
    );
    let z1 = cols(lines[2]);
    assert_eq!(z1[..4], ["zram1", "lz4", "16M", "4M"], "{s}");
    // Every figure as mm_stat has it (nothing is written meanwhile).
    let all = "NAME,DISKSIZE,DATA,COMPR,ALGORITHM,STREAMS,ZERO-PAGES,TOTAL,MEM-LIMIT,MEM-USED,\
               MIGRATED,COMP-RATIO,MOUNTPOINT,META,BACKING-DEV,BD-USED,BLOCK-DEV,SWAP-RESERVE";
    let b = r.status(&["--bytes", "--raw", "-n", "-o", all, "zram1"]);
    assert_eq!(
        b,
        r.status(&["--bytes", "--raw", "--noheadings", "--output-all", "zram1"])
    );
    let z1b: Vec<&str> = b.trim_end_matches('\n').split(' ').collect();
    let mm = mm_stat(&r, "zram1");
    let figure = |i: usize| z1b[i].parse::<u64>().unwrap();
    assert_eq!(z1b.len(), 18, "{b}");
    assert_eq!(z1b[0], "zram1");
    assert_eq!(figure(1), 16 << 20);
    assert_eq!(
        [figure(2), figure(3), figure(7), figure(8), figure(9)],
        [mm[0], mm[1], mm[2], mm[3], mm[4]],
        "{b}"
    );
    assert_eq!(figure(6), mm[5], "ZERO-PAGES is same_pages");
    assert_eq!(figure(10), mm[6], "MIGRATED is pages_compacted");
    assert_eq!(z1b[11], format!("{:.4}", mm[0] as f64 / mm[2] as f64));
    assert_eq!([z1b[4], z1b[5], z1b[12]], ["lz4", "", ""], "{b}");
    assert_eq!(mm[0], 4 << 20);
    assert!(mm[1] > 0 && mm[1] < mm[0], "{b}");
    // META is the sum of meta_stat's first five columns (the device's own memory), the first
    // of which is the slot table: 16 bytes per page of the 16 MiB device of 16 KiB pages, and
    // the slot journal's 32 KiB after it; the last three are the server's swap reserve, 0
    // without --swap.
    let meta_stat = stdout(&r.ctl(&["--dev", "zram1", "meta_stat"]));
    let meta_cols: Vec<u64> = meta_stat
        .split_whitespace()
        .map(|c| c.parse().unwrap())
        .collect();
    assert_eq!(meta_cols.len(), 8, "{meta_stat}");
    assert_eq!(meta_cols[5..], [0, 0, 0], "{meta_stat}");
    assert_eq!(meta_cols[0], (16 << 20) / 16384 * 16 + 32768, "{meta_stat}");
    assert_eq!(
        figure(13),
        meta_cols.iter().sum::<u64>(),
        "{b}\n{meta_stat}"
    );
    assert_eq!(
        z1b[14..],
        ["", "", "", ""],
        "no backing device, no --ublk, no --swap"
    );
    // Human sizes, column choice and order, '+' adding to the defaults.
    assert_eq!(
        r.status(&["-o", "name,data,BD-USED", "zram1"]),
        "NAME  DATA BD-USED\nzram1   4M \n"
    );
    assert_eq!(
        cols(r.status(&["-o", "+META"]).lines().next().unwrap())
            .last()
            .unwrap(),
        "META"
    );
    // An uninitialised device: hidden from the listing, shown when named.
    assert!(r.ctl(&["--dev", "zram1", "reset", "1"]).status.success());
    let s = r.status(&["--raw"]);
    assert_eq!(s.lines().count(), 2, "{s}");
    assert!(s.lines().nth(1).unwrap().starts_with("zram0 "), "{s}");
    assert_eq!(
        r.status(&["--raw", "-n", "zram1"]),
        "zram1 lz4 0B 0B 0B 0B  \n"
    );
    // zramctl's errors and exit status 1.
    let status = |args: &[&str]| {
        Command::new(uzram_bin())
            .arg("status")
            .arg("--dir")
            .arg(r.dir())
            .args(args)
            .output()
            .unwrap()
    };
    let o = status(&["zram7"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert_eq!(stderr(&o), "uzram: zram7: No such device\n");
    let o = status(&["-o", "NAME,NOPE"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert_eq!(stderr(&o), "uzram: unknown column: NOPE\n");
    let o = status(&["--no-such-option"]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    r.stop();
}

#[test]
fn a_config_with_an_unknown_attribute_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nname = \"zram0\"\ndisksize = \"16M\"\nsocket = \"{}/zram0.sock\"\nno_such_attribute = \"/dev/vdb\"\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let e = Serve::args(&["--config", cfg.to_str().unwrap()])
        .refused()
        .stderr;
    assert!(
        e.contains("no_such_attribute") && e.contains("ENOENT"),
        "{e}"
    );
    assert!(!dir.path().join("zram0.sock").exists());
    // Device flags and a file do not mix.
    Serve::args(&["--config", cfg.to_str().unwrap(), "--disksize", "1M"]).refused();
}

#[test]
fn the_embedded_default_is_min_half_ram_4g_lz4() {
    require("qemu-img");
    let r = Serve::args(&["--socket", "{dir}/zram0.sock"]).start();
    let want = (mem_total_bytes() / 2).min(4 << 30).div_ceil(4096) * 4096;
    assert_eq!(qemu_img_size(&r.uri("zram0")), want);
    assert_eq!(
        stdout(&r.ctl(&["comp_algorithm"])),
        "[lz4] lz4hc zstd deflate \n"
    );
    let out = Command::new(uzram_bin())
        .args(["serve", "--print-default-config"])
        .output()
        .unwrap();
    assert!(stdout(&out).contains("disksize = \"min(ram / 2, 4G)\""));
    r.stop();
}

fn vm_lck_kib(pid: u32) -> u64 {
    proc_field(&format!("/proc/{pid}/status"), "VmLck")
}

/// Whether this process's effective capabilities include `cap` (CAP_SYS_RESOURCE is 24).
fn has_capability(cap: u32) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap();
    u64::from_str_radix(hex.trim(), 16).unwrap() & (1 << cap) != 0
}

#[test]
fn swap_locks_memory_and_marks_an_io_flusher_as_root() {
    assert!(is_root(), "this test needs root (CI runs as root)");
    require("qemu-io");
    let r = Serve::args(&[
        "--swap",
        "--disksize",
        "64M",
        "--socket",
        "{dir}/zram0.sock",
    ])
    .start();
    let log = r.log();
    assert!(log.contains("--swap: memory locked"), "{log}");
    // PR_SET_IO_FLUSHER needs CAP_SYS_RESOURCE, which some containers withhold even from
    // root: the log must say which happened.
    if has_capability(24) {
        assert!(log.contains("--swap: marked an I/O flusher"), "{log}");
    } else {
        assert!(log.contains("NOT marked an I/O flusher"), "{log}");
        assert!(log.contains("(needs CAP_SYS_RESOURCE)"), "{log}");
    }
    // /proc/sysrq-trigger is root's, but a container may mount /proc read-only: the log says
    // whether the server can ask the OOM killer to act.
    let sysrq = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/sysrq-trigger")
        .is_ok();
    if sysrq {
        assert!(
            log.contains("the kernel's OOM killer is asked to act (sysrq f)"),
            "{log}"
        );
    } else {
        assert!(log.contains("cannot open /proc/sysrq-trigger"), "{log}");
    }
    assert!(vm_lck_kib(r.child.id()) > 0, "nothing locked");
    // The preallocated buffers are used: a connection's requests are served and read back.
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x33 64k 256k",
        &r.uri("zram0"),
    ]));
    let o = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read -P 0x33 64k 256k",
        &r.uri("zram0"),
    ]));
    assert!(!stdout(&o).contains("fail"), "{}", stdout(&o));
    r.stop();
}

#[test]
fn swap_without_privileges_says_what_it_could_not_do_and_serves() {
    assert!(
        is_root(),
        "this test drops root's privileges, so it needs them first"
    );
    require("setpriv");
    require("prlimit");
    require("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    // Writable by the unprivileged user, and sticky so that no other user could replace its
    // socket (the server refuses a socket directory others can write without the sticky bit).
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let r = Serve::args(&[
        "--swap",
        "--disksize",
        "16M",
        "--socket",
        "{dir}/zram0.sock",
    ])
    .in_dir(dir)
    .prefix(&[
        "prlimit",
        "--memlock=65536:65536",
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
    ])
    .start();
    let log = r.log();
    assert!(
        log.contains("memory NOT locked: RLIMIT_MEMLOCK is 65536 bytes"),
        "{log}"
    );
    assert!(log.contains("NOT marked an I/O flusher"), "{log}");
    assert!(log.contains("cannot open /proc/sysrq-trigger"), "{log}");
    assert_eq!(vm_lck_kib(r.child.id()), 0);
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x44 0 64k", &r.uri("zram0")]));
    r.stop();
}

/// Polls `uzram ctl --dev DEV nbd_connections` until it reads `n` (a client that hung up is
/// noticed by its connection thread a moment later), for at most 20 s.
fn wait_nbd_connections(r: &Running, dev: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = r.ctl(&["--dev", dev, "nbd_connections"]);
        if stdout(&o).trim() == n.to_string() {
            return;
        }
        assert!(Instant::now() < deadline, "{dev}: nbd_connections {o:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn hot_add_and_hot_remove_as_zram_control() {
    let r = serve_zram0_for_qemu();

    // `cat /sys/class/zram-control/hot_add`: the new id, an uninitialised device.
    let o = r.ctl(&["hot_add"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(stdout(&o), "1\n");
    assert!(r.dir().join("zram1.sock").exists() && r.dir().join("zram1.ctl").exists());
    assert_eq!(stdout(&r.ctl(&["--dev", "zram1", "disksize"])), "0\n");
    assert_eq!(qemu_img_size(&r.uri("zram1")), 0, "no disksize yet");
    // Set up as zram's: algorithm, then disksize.
    assert!(r
        .ctl(&["--dev", "zram1", "comp_algorithm", "zstd"])
        .status
        .success());
    assert!(r
        .ctl(&["--dev", "zram1", "disksize", "32M"])
        .status
        .success());
    assert_eq!(qemu_img_size(&r.uri("zram1")), 32 << 20);
    // Position-dependent data through a real client, read back and compared; zram0 untouched.
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x3c 1M 2M", &r.uri("zram1")]));
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read -P 0x3c 1M 2M",
        "-c",
        "read -P 0 0 1M",
        &r.uri("zram1"),
    ]));
    assert_eq!(mm_stat(&r, "zram1")[0], 2 << 20);
    assert_eq!(mm_stat(&r, "zram0")[0], 0);
    let s = r.status(&[]);
    let row = s
        .lines()
        .find(|l| l.starts_with("zram1 "))
        .unwrap_or_else(|| panic!("{s}"));
    assert!(row.contains("zstd") && row.contains("32M"), "{s}");

    // EBUSY while an NBD client has it open; nothing changes.
    let (client, size) = RawClient::handshake_export(&r.dir().join("zram1.sock"), "zram1", false);
    assert_eq!(size, 32 << 20);
    let o = r.ctl(&["hot_remove", "1"]);
    assert_eq!(o.status.code(), Some(libc::EBUSY), "{o:?}");
    assert!(stderr(&o).starts_with("uzram: hot_remove: Device or resource busy (EBUSY)"));
    assert_eq!(mm_stat(&r, "zram1")[0], 2 << 20);
    drop(client);
    wait_nbd_connections(&r, "zram1", 0);

    // zram's errnos: kstrtoint's, negative ids, a missing device, the wrong direction.
    assert_refused(
        &[
            (libc::EINVAL, &["abc", "-1", "1x"]),
            (libc::ERANGE, &["99999999999"]),
            (libc::ENODEV, &["7"]),
        ],
        |value| r.ctl(&["hot_remove", value]).status.code(),
        |_| {},
    );
    assert_eq!(r.ctl(&["hot_remove"]).status.code(), Some(libc::EACCES));
    assert_eq!(r.ctl(&["hot_add", "1"]).status.code(), Some(libc::EACCES));
    assert_eq!(
        stdout(&r.ctl(&["--dev", "zram1", "disksize"])),
        format!("{}\n", 32 << 20)
    );

    // Removed: its sockets go, status forgets it, a second removal is ENODEV.
    let o = r.ctl(&["hot_remove", "1"]);
    assert!(o.status.success(), "{o:?}");
    assert!(!r.dir().join("zram1.sock").exists() && !r.dir().join("zram1.ctl").exists());
    assert!(!r.status(&[]).contains("zram1"));
    assert!(!r.ctl(&["--dev", "zram1", "mm_stat"]).status.success());
    assert_eq!(
        r.ctl(&["hot_remove", "1"]).status.code(),
        Some(libc::ENODEV)
    );
    assert!(r.log().contains("hot_remove: zram1 removed"), "{}", r.log());

    // The configured device is removable too, and ids are reused lowest first, as zram's.
    assert!(r.ctl(&["hot_remove", "0"]).status.success());
    assert_eq!(stdout(&r.ctl(&["hot_add"])), "0\n");
    assert_eq!(stdout(&r.ctl(&["--dev", "zram0", "disksize"])), "0\n");
    assert_eq!(stdout(&r.ctl(&["hot_add"])), "1\n");
    // A bounded number of devices: ENOSPC past it.
    let mut added = 2;
    loop {
        let o = r.ctl(&["hot_add"]);
        if o.status.code() == Some(libc::ENOSPC) {
            break;
        }
        assert!(o.status.success(), "{o:?}");
        assert_eq!(stdout(&o), format!("{added}\n"));
        added += 1;
        assert!(added <= 64, "no limit on devices");
    }
    assert_eq!(added, 32, "MAX_DEVICES");
    r.stop();
}

/// A device named otherwise than `zramN` has no id: `hot_remove` takes its name (uzram's
/// extension), still `EBUSY` while it is open; a word that names no device stays `EINVAL`.
#[test]
fn hot_remove_by_name() {
    let r = Serve::args(&[
        "--name",
        "swap",
        "--disksize",
        "16M",
        "--socket",
        "{dir}/swap.sock",
    ])
    .start();
    assert_eq!(
        r.ctl(&["hot_remove", "0"]).status.code(),
        Some(libc::ENODEV)
    );
    assert_eq!(
        r.ctl(&["hot_remove", "swap0"]).status.code(),
        Some(libc::EINVAL)
    );
    let (client, size) = RawClient::handshake_export(&r.dir().join("swap.sock"), "swap", false);
    assert_eq!(size, 16 << 20);
    let o = r.ctl(&["hot_remove", "swap"]);
    assert_eq!(o.status.code(), Some(libc::EBUSY), "{o:?}");
    assert!(r.dir().join("swap.sock").exists());
    drop(client);
    wait_nbd_connections(&r, "swap", 0);
    let o = r.ctl(&["hot_remove", "swap"]);
    assert!(o.status.success(), "{o:?}");
    assert!(!r.dir().join("swap.sock").exists() && !r.dir().join("swap.ctl").exists());
    assert!(r.log().contains("hot_remove: swap removed"), "{}", r.log());
    assert_eq!(
        r.ctl(&["hot_remove", "swap"]).status.code(),
        Some(libc::EINVAL)
    );
    // hot_add still starts at zram0.
    assert_eq!(stdout(&r.ctl(&["hot_add"])), "0\n");
    r.stop();
}
