//! `uzram ctl`'s progress for long operations (`compact`, `writeback`, `recompress`, `gc`): a
//! determinate bar on a terminal (a real pseudo-terminal from util-linux's `script`), the
//! server counting the work; off a terminal nothing, or with `-v` the server's `uzram: LINE`
//! lines on stderr; nothing on stdout either way.

use std::process::{Command, Output};
use uzram_testkit::process::{require, run};
use uzram_testkit::serve::{uzram_bin, Serve};

/// `CMD` run on a real pseudo-terminal (`script -qec CMD /dev/null`): what it wrote there.
fn on_terminal(cmd: &str) -> Output {
    Command::new("script")
        .args(["-qec", cmd, "/dev/null"])
        .output()
        .unwrap()
}

#[test]
fn long_operations_show_a_bar_on_a_terminal_and_nothing_elsewhere() {
    require("qemu-io");
    require("nbdcopy");
    require("script");
    let bin = uzram_bin().display().to_string();
    let backing = tempfile::NamedTempFile::new().unwrap();
    backing.as_file().set_len(64 << 20).unwrap();
    let s = Serve::zram0_over("32M", backing.path(), "").start();
    // Real pages: the first 8 MiB of the uzram executable (2048 pages), through nbdcopy; and
    // a same-filled MiB after them.
    let exe = std::fs::read(&bin).unwrap();
    assert!(exe.len() >= 8 << 20, "{bin} is {} bytes", exe.len());
    let img = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(img.path(), &exe[..8 << 20]).unwrap();
    run(Command::new("nbdcopy").args([
        "--no-extents",
        img.path().to_str().unwrap(),
        &s.uri("zram0"),
    ]));
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x33 8M 1M", &s.uri("zram0")]));
    let dir = s.dir().display().to_string();

    // Not a terminal: nothing on stdout or stderr.
    let o = s.ctl(&["compact", "1"]);
    assert!(o.status.success(), "{o:?}");
    assert!(o.stdout.is_empty() && o.stderr.is_empty(), "{o:?}");
    // -v: the server's progress lines on stderr as they come.
    let o = s.ctl(&["-v", "compact", "1"]);
    assert!(o.status.success(), "{o:?}");
    assert!(o.stdout.is_empty(), "{o:?}");
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(err.starts_with("uzram: compact: started\n"), "{err:?}");
    assert!(
        err.lines().all(|l| l.starts_with("uzram: compact: ")),
        "{err:?}"
    );
    assert!(!err.contains('\x1b') && !err.contains('\r'), "{err:?}");

    // On a terminal: writeback of every idle page drawn as a bar of pages done of the pages
    // the scan selected, left full on the screen at the end, no `uzram: ` lines. The zero and
    // same-filled pages are not candidates: the total is the pages stored as objects.
    let o = s.ctl(&["idle", "all"]);
    assert!(o.status.success(), "{o:?}");
    let mm = s.show("zram0", "mm_stat");
    let o = on_terminal(&format!("{bin} ctl --dir {dir} writeback idle"));
    assert!(o.status.success(), "{o:?}");
    let tty = String::from_utf8_lossy(&o.stdout).into_owned();
    let bd_writes: u64 = s
        .show("zram0", "bd_stat")
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        bd_writes > 1000,
        "{bd_writes} pages written back; mm_stat {mm}"
    );
    assert!(
        tty.contains(&format!("{bd_writes}/{bd_writes} pages (100%)")),
        "{tty:?}"
    );
    assert!(tty.contains("] "), "{tty:?}");
    assert!(!tty.contains("uzram: writeback"), "{tty:?}");
    // Every page reads back identical (from the backing device now).
    let back = tempfile::NamedTempFile::new().unwrap();
    run(Command::new("nbdcopy").args([&s.uri("zram0"), back.path().to_str().unwrap()]));
    let got = std::fs::read(back.path()).unwrap();
    assert!(
        got[..8 << 20] == exe[..8 << 20],
        "the pages read back differ"
    );
    assert!(got[8 << 20..9 << 20].iter().all(|&b| b == 0x33));

    // compact on a terminal: a bar of pages freed of what compaction estimated (discard most
    // of the pool first so there is something to free), or a cleared spinner when there is
    // nothing; either way the exit status and no `uzram: ` lines.
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "discard 0 4M", &s.uri("zram0")]));
    let o = on_terminal(&format!("{bin} ctl --dir {dir} compact 1"));
    assert!(o.status.success(), "{o:?}");
    let tty = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(!tty.contains("uzram: compact: started"), "{tty:?}");

    // A short attribute on a terminal: no bar, its text as always.
    let o = on_terminal(&format!("{bin} ctl --dir {dir} disksize"));
    assert!(o.status.success(), "{o:?}");
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        (32u64 << 20).to_string()
    );
    // A failure on a terminal: the errno, the message, no bar left behind (gc needs a
    // zoned store).
    let o = on_terminal(&format!("{bin} ctl --dir {dir} gc 1"));
    assert_eq!(o.status.code(), Some(libc::ENODEV), "{o:?}");
    let tty = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(tty.contains("No such device (ENODEV)"), "{tty:?}");
    assert!(!tty.contains("(100%)"), "{tty:?}");
}
