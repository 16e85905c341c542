//! Tests in a VM with a real kernel: on a zoned block device, or with kernel modules this host
//! lacks (`ublk_drv`, `nbd`); and the kit of the swap tests run inside ([`Hog`],
//! [`mem_total_bytes`], [`vmstat`]).
//!
//! The kernel this suite runs on may have no zoned block device support (the CI machines'
//! has none), so a test that needs one boots a small VM (`scripts/zoned-vm`: a Debian kernel
//! under QEMU, a host-managed zoned `null_blk` in it) and runs *itself* inside: the same test
//! binary, filtered to the one test, with `UZRAM_ZONED_DEV` naming the device. Inside the VM
//! [`zoned_device_or_boot`] returns that device and the test body runs; outside it boots the
//! VM, passes its output through, and fails the test unless the inner run passed.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::pages::{fill_page, swap_mix, PAGE};
use crate::process::{proc_field, run};

/// `scripts/zoned-vm` options for a device that completes I/O after 100 us from a timer, with
/// 4 request slots and no I/O scheduler: there Linux 6.1 reorders several writes in flight to
/// one zone, so only a writer that keeps one write per zone at the device gets through.
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

// ---------------------------------------------------------------------------------------------
// Inside the VM: the swap kit.

/// The kernel log's lines since boot (`/dev/kmsg`, read without blocking) containing any of
/// `keys`, oldest first.
pub fn kernel_log_lines(keys: &[&str]) -> Vec<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(mut f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
    else {
        return Vec::new();
    };
    let mut buf = vec![0u8; 8192];
    let mut lines = Vec::new();
    // Each read is one record, "level,seq,time,flags;text\n"; EAGAIN at the end.
    while let Ok(n) = f.read(&mut buf) {
        if n == 0 {
            break;
        }
        let rec = String::from_utf8_lossy(&buf[..n]);
        let text = rec.split_once(';').map_or(&*rec, |(_, t)| t).trim_end();
        if keys.iter().any(|k| text.contains(k)) {
            lines.push(text.to_string());
        }
    }
    lines
}

/// A counter of `/proc/vmstat` (`pswpout`, `pswpin`...).
pub fn vmstat(name: &str) -> u64 {
    let v = std::fs::read_to_string("/proc/vmstat").unwrap();
    v.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /proc/vmstat"))
}

/// The machine's RAM in bytes.
pub fn mem_total_bytes() -> u64 {
    proc_field("/proc/meminfo", "MemTotal") << 10
}

/// Page `i` of the hog, version `v`: the [`swap_mix`] of the page generator (half same-filled,
/// three eighths text, one eighth random), stamped with its index and version.
pub fn hog_page(i: usize, v: u64, out: &mut [u8]) {
    fill_page(swap_mix(i as u64), i as u64, v, out);
}

/// A memory hog: an anonymous mapping of `pages` pages, filled with [`hog_page`]s and checked
/// page by page; unmapped when dropped.
#[derive(Debug)]
pub struct Hog {
    ptr: *mut u8,
    pages: usize,
}

impl Hog {
    /// Maps `pages` pages (not yet touched).
    pub fn new(pages: usize) -> Hog {
        // SAFETY: a fresh private anonymous mapping; no address hint, no file.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap");
        Hog {
            ptr: ptr.cast(),
            pages,
        }
    }

    /// Its size in pages.
    pub fn pages(&self) -> usize {
        self.pages
    }

    fn page(&mut self, i: usize) -> &mut [u8] {
        assert!(i < self.pages);
        // SAFETY: page i lies inside the mapping, which lives as long as `self`, and the
        // returned slice borrows `self` mutably, so no other slice of it exists meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * PAGE), PAGE) }
    }

    /// Writes version `v` of every page; says how far it got every 32 MiB (on standard error,
    /// with the swap-outs so far: a stalled fill shows where).
    pub fn fill(&mut self, v: u64) {
        let t = Instant::now();
        for i in 0..self.pages {
            hog_page(i, v, self.page(i));
            if i % (32 << 20 >> 12) == 0 {
                eprintln!(
                    "hog: filling v{v}: {} MiB at {:.1} s, pswpout {}",
                    i >> 8,
                    t.elapsed().as_secs_f64(),
                    vmstat("pswpout")
                );
            }
        }
    }

    /// Checks every page against version `v`; the number of bad pages. From the last page to
    /// the first: the pages filled last are the ones still in RAM, so they are checked before
    /// swapping the others in pushes them out (forwards, every page would go out and in).
    pub fn bad_pages(&mut self, v: u64) -> usize {
        let mut want = vec![0u8; PAGE];
        let mut bad = 0;
        for i in (0..self.pages).rev() {
            hog_page(i, v, &mut want);
            if self.page(i) != &want[..] {
                bad += 1;
            }
        }
        bad
    }

    /// Asks the kernel to swap the whole mapping out now (MADV_PAGEOUT, Linux 5.4).
    pub fn page_out(&mut self) {
        // SAFETY: the range is exactly the mapping.
        let rc = unsafe { libc::madvise(self.ptr.cast(), self.pages * PAGE, libc::MADV_PAGEOUT) };
        assert_eq!(rc, 0, "MADV_PAGEOUT: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, not used after this.
        unsafe { libc::munmap(self.ptr.cast(), self.pages * PAGE) };
    }
}

/// Swap on `dev` under memory pressure: `mkswap`, `swapon` (with `-d`, discard, if `discard`:
/// freed swap slots are discarded, so the device drops their pages), then a [`Hog`] of
/// `pages` pages filled and checked twice (versions 1 and 2; after each fill the whole hog is
/// pushed out with `MADV_PAGEOUT` if `page_out`), every page verified; then `swapoff`. Returns
/// the pages swapped out and in meanwhile (`pswpout`, `pswpin`).
pub fn swap_under_hog(dev: &Path, pages: usize, discard: bool, page_out: bool) -> (u64, u64) {
    run(Command::new("mkswap").arg(dev));
    let mut swapon = Command::new("swapon");
    if discard {
        swapon.arg("-d");
    }
    run(swapon.arg(dev));
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    assert!(swaps.contains(dev.to_str().unwrap()), "{swaps}");
    let ram = mem_total_bytes();
    let (out0, in0) = (vmstat("pswpout"), vmstat("pswpin"));
    let mut hog = Hog::new(pages);
    for v in 1..=2 {
        let t = Instant::now();
        hog.fill(v);
        if page_out {
            hog.page_out();
        }
        let bad = hog.bad_pages(v);
        println!(
            "swap on {} round {v}: {pages} pages ({} MiB, RAM {} MiB), {:.1} s, pswpout {} \
             pswpin {}",
            dev.display(),
            (pages * PAGE) >> 20,
            ram >> 20,
            t.elapsed().as_secs_f64(),
            vmstat("pswpout") - out0,
            vmstat("pswpin") - in0
        );
        assert_eq!(bad, 0, "{bad} bad pages in round {v} on {}", dev.display());
    }
    drop(hog);
    let swapped = (vmstat("pswpout") - out0, vmstat("pswpin") - in0);
    run(Command::new("swapoff").arg(dev));
    swapped
}
