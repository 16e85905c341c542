//! `uzram status` against the real zramctl (util-linux) on a real kernel zram device: the
//! same columns, figures, formats, alignment, messages and exit codes, byte for byte.
//!
//! The test adds its own kernel device through `/sys/class/zram-control/hot_add` (so that it
//! does not disturb `/dev/zram0`, which the benchmarks use as their anchor), fills it with an
//! ext4 file system holding real program text and zero pages, mounts it at a path with a space
//! (MOUNTPOINT and --raw's escaping), and compares `zramctl ARGS /dev/zramN` with
//! `uzram status --kernel ARGS /dev/zramN` for each option. The device is unmounted, reset
//! and removed afterwards, also when the test fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use uzram_testkit::process::{is_root, require, run};

const BIN: &str = env!("CARGO_BIN_EXE_uzram");

/// A hot-added kernel zram device with a mounted ext4; removed on drop.
struct KernelZram {
    num: u32,
    mnt: Option<PathBuf>,
    _dir: tempfile::TempDir,
}

impl KernelZram {
    fn dev(&self) -> String {
        format!("/dev/zram{}", self.num)
    }
    fn sys(&self, attr: &str) -> PathBuf {
        Path::new("/sys/block")
            .join(format!("zram{}", self.num))
            .join(attr)
    }
}

impl Drop for KernelZram {
    fn drop(&mut self) {
        if let Some(m) = self.mnt.take() {
            let _ = Command::new("umount").arg(&m).status();
        }
        let _ = std::fs::write(self.sys("reset"), "1");
        let _ = std::fs::write("/sys/class/zram-control/hot_remove", self.num.to_string());
    }
}

fn add_kernel_zram() -> KernelZram {
    assert!(
        Path::new("/sys/class/zram-control").exists(),
        "no kernel zram: load it first (modprobe zram)"
    );
    let num: u32 = std::fs::read_to_string("/sys/class/zram-control/hot_add")
        .expect("hot_add a kernel zram device")
        .trim()
        .parse()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut z = KernelZram {
        num,
        mnt: None,
        _dir: dir,
    };
    std::fs::write(z.sys("comp_algorithm"), "lz4").unwrap();
    std::fs::write(z.sys("disksize"), "64M").unwrap();
    // The inode tables and journal written now, so that no background writer moves the
    // figures between the two commands.
    run(Command::new("mkfs.ext4").args([
        "-q",
        "-F",
        "-E",
        "lazy_itable_init=0,lazy_journal_init=0",
        &z.dev(),
    ]));
    let mnt = z._dir.path().join("mount point");
    std::fs::create_dir(&mnt).unwrap();
    run(Command::new("mount").arg(z.dev()).arg(&mnt));
    z.mnt = Some(mnt.clone());
    // A real program (compressible, not same-filled; perl-base is essential in Debian) and
    // zero pages.
    std::fs::copy("/usr/bin/perl", mnt.join("perl")).unwrap();
    std::fs::write(mnt.join("zeros"), vec![0u8; 1 << 20]).unwrap();
    run(&mut Command::new("sync"));
    z
}

fn out(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}stderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// zramctl's and uzram's answers to the same options, the program's name in messages
/// (`zramctl:`, `uzram:`) made the same.
fn both(args: &[&str]) -> (String, String) {
    let z = Command::new("zramctl").args(args).output().unwrap();
    let u = Command::new(BIN)
        .args(["status", "--kernel"])
        .args(args)
        .output()
        .unwrap();
    (out(&z), out(&u).replace("uzram: ", "zramctl: "))
}

/// zramctl's column names, from its --help ("Available output columns:").
fn zramctl_columns() -> Vec<String> {
    let help = String::from_utf8(run(Command::new("zramctl").arg("--help")).stdout).unwrap();
    let (_, cols) = help
        .split_once("Available output columns:\n")
        .expect("zramctl --help lists its columns");
    cols.lines()
        .map_while(|l| l.split_whitespace().next().filter(|w| !w.is_empty()))
        .filter(|w| w.chars().all(|c| c.is_ascii_uppercase() || c == '-'))
        .map(str::to_string)
        .collect()
}

#[test]
fn status_prints_what_zramctl_prints_for_a_kernel_device() {
    assert!(is_root(), "kernel zram needs root (CI runs as root)");
    require("zramctl");
    require("mkfs.ext4");
    let z = add_kernel_zram();
    let dev = z.dev();
    let zcols = zramctl_columns();
    assert!(zcols.len() >= 12, "{zcols:?}");
    let all = zcols.join(",");
    let cases: Vec<Vec<&str>> = vec![
        vec![],
        vec!["--raw"],
        vec!["-n"],
        vec!["--noheadings", "--raw"],
        vec!["--bytes"],
        vec!["-b", "--raw", "-n"],
        vec!["-o", &all],
        vec!["-o", &all, "--bytes"],
        vec!["-o", &all, "--raw"],
        vec!["-o", "name,Zero-Pages,MIGRATED,mountpoint,DATA"],
        vec!["--output", "MOUNTPOINT,TOTAL"],
        vec!["-o", "STREAMS"],
    ];
    for case in &cases {
        let mut args: Vec<&str> = case.clone();
        args.push(&dev);
        // The figures may move between the two commands (the kernel compacts and frees on
        // its own); a difference must persist to count.
        let mut tries = 0;
        loop {
            let (zr, ur) = both(&args);
            if zr == ur {
                break;
            }
            tries += 1;
            assert!(tries < 5, "{args:?}:\n--- zramctl\n{zr}--- uzram\n{ur}");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
    // The device is mounted, with zero pages and data in it.
    let (_, table) = both(&[
        "-o",
        "MOUNTPOINT,ZERO-PAGES,DATA",
        "--raw",
        "-n",
        "-b",
        &dev,
    ]);
    let cells: Vec<&str> = table.lines().nth(2).unwrap().split(' ').collect();
    assert!(cells[0].ends_with("/mount\\x20point"), "{table}");
    assert!(cells[1].parse::<u64>().unwrap() > 0, "{table}");
    assert!(cells[2].parse::<u64>().unwrap() > 1 << 20, "{table}");
    // --output-all: zramctl's columns in its order (this zramctl may predate COMP-RATIO),
    // then uzram's own.
    let header = |args: &[&str]| -> Vec<String> {
        let o = Command::new(BIN)
            .args(["status", "--kernel"])
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", out(&o));
        String::from_utf8(o.stdout)
            .unwrap()
            .lines()
            .next()
            .unwrap()
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    let ours = header(&["--output-all", &dev]);
    let known: Vec<&String> = ours.iter().filter(|c| zcols.contains(c)).collect();
    assert_eq!(known, zcols.iter().collect::<Vec<_>>(), "{ours:?}");
    assert_eq!(
        ours[ours.len() - 5..],
        [
            "META",
            "BACKING-DEV",
            "BD-USED",
            "BLOCK-DEV",
            "SWAP-RESERVE"
        ],
        "{ours:?}"
    );
    // The ratio is DATA/TOTAL with four decimals.
    let (_, t) = both(&["-o", "DATA,TOTAL,COMP-RATIO", "-b", "--raw", "-n", &dev]);
    let c: Vec<&str> = t.lines().nth(2).unwrap().split(' ').collect();
    let (data, total): (f64, f64) = (c[0].parse().unwrap(), c[1].parse().unwrap());
    assert_eq!(c[2], format!("{:.4}", data / total), "{t}");

    // Errors: the same messages and exit status 1.
    let missing = format!("/dev/zram{}", z.num + 1000);
    let (zr, ur) = both(&[&missing]);
    assert_eq!(zr, ur);
    assert!(zr.starts_with("exit Some(1)"), "{zr}");
    let (zr, ur) = both(&["-o", "NAME,FOO", &dev]);
    assert_eq!(zr, ur);
    assert!(zr.contains("unknown column: FOO"), "{zr}");
    let (zr, ur) = both(&["--no-such-option"]);
    assert_eq!(zr.lines().next(), ur.lines().next(), "{zr}\n{ur}");
    assert!(zr.starts_with("exit Some(1)"), "{zr}");
    let (zr, ur) = both(&[&dev, &dev]);
    assert!(
        zr.starts_with("exit Some(1)") && ur.starts_with("exit Some(1)"),
        "{zr}\n{ur}"
    );

    // An uninitialised device is shown when named, hidden from the listing.
    drop(z);
    let z = add_kernel_zram_bare();
    let (zr, ur) = both(&["--raw", &z.dev()]);
    assert_eq!(zr, ur);
    assert!(zr.contains(&format!("{} lz", z.dev())), "{zr}");
    let listed = out(&Command::new(BIN)
        .args(["status", "--kernel"])
        .output()
        .unwrap());
    assert!(!listed.contains(&z.dev()), "{listed}");
}

/// A hot-added kernel device left uninitialised.
fn add_kernel_zram_bare() -> KernelZram {
    let num: u32 = std::fs::read_to_string("/sys/class/zram-control/hot_add")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    KernelZram {
        num,
        mnt: None,
        _dir: tempfile::tempdir().unwrap(),
    }
}
