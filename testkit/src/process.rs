//! Running commands and real client programs. A program a test needs and the machine lacks is
//! a failure that names its Debian package, never a skip (scripts/debian-packages.txt installs
//! them all).

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output};
use std::time::{Duration, Instant};

/// The Debian package that ships each program the tests run.
fn package_of(program: &str) -> &'static str {
    match program {
        "qemu-img" | "qemu-io" => "qemu-utils",
        "nbdinfo" | "nbdcopy" | "nbdfuse" => "libnbd-bin",
        "fio" => "fio",
        "nbdkit" => "nbdkit",
        "fusermount3" => "fuse3",
        "mkfs.ext4" | "mkfs.ext2" | "e2fsck" => "e2fsprogs",
        "promtool" | "prometheus" => "prometheus",
        "curl" => "curl",
        "systemd-analyze" => "systemd",
        "mkswap" | "blkid" => "util-linux",
        "losetup" | "mount" | "umount" => "util-linux (mount)",
        "nbd-client" => "nbd-client",
        "openssl" => "openssl",
        "man" => "man-db",
        "dpkg" | "dpkg-deb" => "dpkg",
        _ => "?",
    }
}

/// Fails the test (never skips) if `program` is not installed.
pub fn require(program: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false)
        || ["/usr/sbin", "/sbin"]
            .iter()
            .any(|d| Path::new(d).join(program).is_file());
    assert!(
        found,
        "the program `{program}` is missing: install Debian package {} (scripts/debian-packages.txt)",
        package_of(program)
    );
}

/// A program by its absolute path (for a VM, which gets the host's files by path); panics if
/// it is not installed.
pub fn host_program(name: &str) -> String {
    for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return p.to_string_lossy().into_owned();
        }
    }
    panic!(
        "{name} is not installed: install Debian package {} (scripts/debian-packages.txt)",
        package_of(name)
    )
}

/// Runs a command, asserting success; returns its output.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// [`run`], returning its standard output as text.
pub fn run_stdout(cmd: &mut Command) -> String {
    String::from_utf8_lossy(&run(cmd).stdout).into_owned()
}

/// `child`'s exit status, or `None` when it is still running after `limit`.
pub fn wait_timeout(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let end = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `ready` every 20 ms until it holds; fails the test with `what` after `limit`.
pub fn wait_for(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills a child and reaps it: for `Drop` of the fixtures that own one.
pub fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Field `field` of a `/proc` file of `Name: N [kB]` lines (`/proc/PID/status`,
/// `/proc/meminfo`, `/proc/PID/smaps_rollup`): N as written (KiB where the file says kB).
pub fn proc_field(path: &str, field: &str) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in {path}"))
}

/// Asserts that only its owner may read or write `path` (mode 0600): a socket that is the
/// device.
pub fn assert_private(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "{} mode {mode:o}", path.display());
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The children of process `pid` now (`/proc/PID/task/PID/children`; empty if it is gone).
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}
