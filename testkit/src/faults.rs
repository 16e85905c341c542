//! Real faulty backing devices for the fault tests: an NBD server with
//! nbdkit's `error` and `delay` filters, seen by the kernel as a block device through
//! `nbdfuse -s -C 1` and a loop device (the host has no `nbd` module), and a small tmpfs for
//! `ENOSPC`. Each is torn down on drop, so a failing assertion leaves nothing behind.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::nbd::NbdLoop;
use crate::process::{require, run, wait_for};

/// What the nbdkit stack injects.
#[derive(Debug, Clone, Default)]
pub struct NbdFaults {
    /// Writes fail with `EIO` at this rate (percent) while the write trigger file exists
    /// ([`NbdBacking::fail_writes`]); 0: never.
    pub write_error_percent: u32,
    /// Reads fail with `EIO` at this rate while the read trigger file exists
    /// ([`NbdBacking::fail_reads`]); 0: never.
    pub read_error_percent: u32,
    /// Every write is delayed this long (the `delay` filter's `wdelay`).
    pub write_delay_ms: u32,
}

/// nbdkit's `memory` plugin behind the `error` and `delay` filters, mounted as a file by
/// `nbdfuse -s -C 1` (single-threaded, one connection: requests reach nbdkit in order), and that
/// file attached to a loop device with direct I/O (so reads and writes reach nbdkit, not the
/// page cache). [`path`](Self::path) is the loop device, a real block device to use as
/// `backing_dev`.
#[derive(Debug)]
pub struct NbdBacking {
    dir: tempfile::TempDir,
    nbdkit: Option<Child>,
    stack: Option<NbdLoop>,
}

impl NbdBacking {
    /// Starts the stack over `size_bytes` of memory with `faults` (triggers off).
    pub fn start(size_bytes: u64, faults: &NbdFaults) -> NbdBacking {
        require("nbdkit");
        let dir = tempfile::tempdir().expect("tempdir");
        let mut me = NbdBacking {
            dir,
            nbdkit: None,
            stack: None,
        };
        let sock = me.dir.path().join("sock");
        let trig_w = me.trigger("writes");
        let trig_r = me.trigger("reads");
        let mut cmd = Command::new("nbdkit");
        cmd.args(["-f", "--exit-with-parent", "-U"])
            .arg(&sock)
            .args(["--filter=error", "--filter=delay", "memory"])
            .arg(size_bytes.to_string())
            .arg("error-pwrite=EIO")
            .arg(format!("error-pwrite-rate={}%", faults.write_error_percent))
            .arg(format!("error-pwrite-file={}", trig_w.display()))
            .arg("error-pread=EIO")
            .arg(format!("error-pread-rate={}%", faults.read_error_percent))
            .arg(format!("error-pread-file={}", trig_r.display()))
            .arg(format!("wdelay={}ms", faults.write_delay_ms))
            .stdout(Stdio::null())
            .stderr(log_file(me.dir.path(), "nbdkit.log"));
        me.nbdkit = Some(cmd.spawn().expect("nbdkit"));
        wait_for("nbdkit's socket", Duration::from_secs(20), || sock.exists());
        let fuse_dir = me.dir.path().join("fuse");
        me.stack = Some(NbdLoop::attach(
            Command::new("nbdfuse")
                .args(["-s", "-C", "1"])
                .arg(fuse_dir.join("nbd"))
                .arg("--unix")
                .arg(&sock)
                .stdout(Stdio::null())
                .stderr(log_file(me.dir.path(), "nbdfuse.log")),
            &fuse_dir,
            size_bytes,
            &["--direct-io=on"],
        ));
        me
    }

    fn trigger(&self, what: &str) -> PathBuf {
        self.dir.path().join(format!("fail-{what}"))
    }

    /// The loop device.
    pub fn path(&self) -> &str {
        self.stack.as_ref().expect("attached").dev()
    }

    /// Turns write faults (at the configured rate) on or off.
    pub fn fail_writes(&self, on: bool) {
        set_trigger(&self.trigger("writes"), on);
    }

    /// Turns read faults (at the configured rate) on or off.
    pub fn fail_reads(&self, on: bool) {
        set_trigger(&self.trigger("reads"), on);
    }
}

/// A log file in `dir` for a child's stderr (the injected errors it reports would fill the test
/// output).
fn log_file(dir: &Path, name: &str) -> Stdio {
    std::fs::File::create(dir.join(name)).map_or(Stdio::null(), Stdio::from)
}

fn set_trigger(path: &Path, on: bool) {
    if on {
        std::fs::write(path, b"").unwrap();
    } else {
        let _ = std::fs::remove_file(path);
    }
}

impl Drop for NbdBacking {
    fn drop(&mut self) {
        // The loop device and nbdfuse first, then the server they talk to.
        drop(self.stack.take());
        if let Some(mut c) = self.nbdkit.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A tmpfs of `size_bytes` mounted on a temporary directory: a file system that fills up.
#[derive(Debug)]
pub struct SmallTmpfs {
    dir: tempfile::TempDir,
    mounted: bool,
}

impl SmallTmpfs {
    /// Mounts it (needs root).
    pub fn mount(size_bytes: u64) -> SmallTmpfs {
        require("mount");
        let dir = tempfile::tempdir().expect("tempdir");
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={size_bytes}"))
            .arg("tmpfs")
            .arg(dir.path()));
        SmallTmpfs { dir, mounted: true }
    }

    /// A path inside it.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg(self.dir.path()).output();
        }
    }
}
