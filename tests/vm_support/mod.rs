//! Tests in a VM with a real kernel (`mod vm_support;`): on a zoned block device, or with
//! kernel modules this host lacks (`ublk_drv`, `nbd`).
//!
//! The kernel this suite runs on may have no zoned block device support (the CI machines'
//! has none), so a test that needs one boots a small VM (`scripts/zoned-vm`: a Debian kernel
//! under QEMU, a host-managed zoned `null_blk` in it) and runs *itself* inside: the same test
//! binary, filtered to the one test, with `UZRAM_ZONED_DEV` naming the device. Inside the VM
//! [`zoned_device_or_boot`] returns that device and the test body runs; outside it boots the
//! VM, passes its output through, and fails the test unless the inner run passed.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::Command;

/// `scripts/zoned-vm` options for a device that completes I/O after 100 us from a timer, with
/// 4 request slots and no I/O scheduler: there Linux 6.1 reorders several writes in flight to
/// one zone, so only a writer that keeps one write per zone at the device gets through.
#[allow(dead_code)]
pub const REORDERING_DEVICE: &[&str] = &[
    "--scheduler",
    "none",
    "--nullb-attr",
    "hw_queue_depth=4",
    "--nullb-attr",
    "irqmode=2",
    "--nullb-attr",
    "completion_nsec=100000",
];

/// Inside the VM: the zoned device to test. Outside: boots the VM with `vm_args` (see
/// `scripts/zoned-vm --help`), runs test `name` of this binary in it, asserts that it passed,
/// and returns `None` (the caller's test is then done).
#[allow(dead_code)]
pub fn zoned_device_or_boot(name: &str, vm_args: &[&str]) -> Option<PathBuf> {
    if let Some(dev) = std::env::var_os("UZRAM_ZONED_DEV") {
        return Some(PathBuf::from(dev));
    }
    boot_test(name, vm_args, &[]);
    None
}

/// The VM script: `scripts/zoned-vm` of this repository (found from the crate's directory,
/// the root or a member such as `cli/`).
fn vm_script() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    dir.ancestors()
        .map(|d| d.join("scripts/zoned-vm"))
        .find(|p| p.exists())
        .expect("scripts/zoned-vm above the crate's directory")
}

/// For tests that need only a kernel with modules this host may lack (`ublk_drv`, `nbd`):
/// inside the VM (`UZRAM_VM` set by `scripts/zoned-vm`) returns true and the caller's body
/// runs; outside it boots the VM with `vm_args` (e.g. `--kernel 6.12 --no-zoned`), runs test
/// `name` of this binary in it, asserts that it ran and passed, and returns false.
#[allow(dead_code)]
pub fn in_vm_or_boot(name: &str, vm_args: &[String]) -> bool {
    if std::env::var_os("UZRAM_VM").is_some() {
        return true;
    }
    boot_test(name, vm_args, &[]);
    false
}

/// Outside the VM: boots it with `vm_args`, runs test `name` of this binary in it with the
/// environment variables `env` (whose names must start with `UZRAM_` to reach the VM),
/// asserts that it ran and passed, and returns the VM's standard output.
#[allow(dead_code)]
pub fn boot_test<S: AsRef<OsStr>>(name: &str, vm_args: &[S], env: &[(&str, &str)]) -> String {
    let mut cmd = test_command(name, vm_args, env);
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--- {name} in the VM: stdout ---\n{stdout}");
    eprintln!("--- {name} in the VM: stderr ---\n{stderr}");
    assert!(
        out.status.success(),
        "{name} failed in the VM ({}); its output is above",
        out.status
    );
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "{name} did not run in the VM; its output is above"
    );
    stdout.into_owned()
}

/// Outside the VM: boots it with `vm_args` in the background, running test `name` of this
/// binary with the environment `env` (names starting with `UZRAM_`), its standard output
/// piped (the guest's output as it comes): for tests that act on the host while the guest
/// runs.
#[allow(dead_code)]
pub fn spawn_test(name: &str, vm_args: &[String], env: &[(&str, &str)]) -> std::process::Child {
    let mut cmd = test_command(name, vm_args, env);
    cmd.stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

/// `scripts/zoned-vm VM_ARGS -- EXE NAME --exact --nocapture --test-threads=1` with `env`: the
/// VM running test `name` of this test binary (`EXE`), alone.
fn test_command<S: AsRef<OsStr>>(name: &str, vm_args: &[S], env: &[(&str, &str)]) -> Command {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(vm_script());
    cmd.args(vm_args)
        .arg("--")
        .arg(&exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied());
    cmd
}
