//! `uzram ctl`'s progress for long operations (`compact`, `writeback`, `recompress`, `gc`): a
//! spinner on a terminal (a real pseudo-terminal from util-linux's `script`), and off a
//! terminal the same `uzram: LINE` lines on stderr as before, nothing on stdout.

#[path = "../../tests/nbd_support/mod.rs"]
mod nbd_support;
mod serve_support;

use nbd_support::{require, run};
use serve_support::{serve_config, BIN};
use std::process::Command;

#[test]
fn long_operations_show_a_spinner_on_a_terminal_and_lines_elsewhere() {
    require("qemu-io");
    require("script");
    let s = serve_config(
        r#"
[[device]]
name = "zram0"
disksize = "16M"
socket = "{dir}/zram0.sock"
"#,
    );
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x33 0 4M", &s.uri()]));
    let dir = s.dir.path().display().to_string();

    // Not a terminal: stdout empty, stderr the server's progress lines as they came.
    let o = s.ctl(&["compact", "1"]);
    assert!(o.status.success(), "{o:?}");
    assert!(o.stdout.is_empty(), "{o:?}");
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(err.starts_with("uzram: compact: started\n"), "{err:?}");
    assert!(
        err.lines().all(|l| l.starts_with("uzram: compact: ")),
        "{err:?}"
    );
    assert!(!err.contains('\x1b') && !err.contains('\r'), "{err:?}");

    // On a terminal: the same operation drawn as a spinner line (redrawn in place with
    // carriage returns and erase sequences, cleared at the end), no `uzram: ` lines.
    let cmd = format!("{BIN} ctl --dir {dir} compact 1");
    let o = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let tty = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(tty.contains("compact: "), "{tty:?}");
    assert!(tty.contains('\x1b') || tty.contains('\r'), "{tty:?}");
    assert!(!tty.contains("uzram: compact: started"), "{tty:?}");

    // A short attribute on a terminal: no spinner, its text as always.
    let cmd = format!("{BIN} ctl --dir {dir} disksize");
    let o = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        (16u64 << 20).to_string()
    );
    // A failure on a terminal: the errno, the message, no spinner left behind.
    let cmd = format!("{BIN} ctl --dir {dir} writeback idle");
    let o = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(libc::ENODEV), "{o:?}");
    let tty = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(tty.contains("No such device (ENODEV)"), "{tty:?}");
}
