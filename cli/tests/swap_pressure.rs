//! Swap under real pressure, in a VM (Debian's 6.12 kernel under QEMU, `scripts/zoned-vm`, 1
//! GiB, 1 vCPU): a harsh memory hog larger than the guest's RAM (3 pages in 8 random, the rest
//! program code and text), every page verified twice, on `/dev/ublkb0` served by `uzram serve
//! --ublk --swap` (and first, on request, on the guest kernel's own zram: the control). A
//! watchdog in the guest prints the kernel stacks of the hog's and the server's threads
//! (from /proc, and blocked tasks by sysrq `w` on the console) whenever the hog has made no
//! progress for [`STUCK_S`] seconds. docs/ublk.md, "Swap on ublk", has what it found.
//!
//! The hog and the watchdog are this binary run again with an environment variable set
//! ([`swap_hog_child`], [`swap_watchdog_child`]), so the OOM killer can take the hog without
//! taking the test.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use uzram_testkit::process::{run_stdout as run, wait_timeout};

const UZRAM: &str = env!("CARGO_BIN_EXE_uzram");
const PAGE: usize = 4096;

/// The guest: RAM (`UZRAM_GUEST_MB`, else this: the guest) and CPUs.
const GUEST_RAM_MB: u64 = 1024;
const GUEST_CPUS: u32 = 1;

/// Nothing moved for this long: the watchdog prints where everybody waits.
const STUCK_S: u64 = 30;

/// The hog's size, in percent of the guest's RAM (`UZRAM_HOG_PCT`, else 127).
fn hog_pct() -> u64 {
    env_u64("UZRAM_HOG_PCT").unwrap_or(127)
}

/// Pages in eight that are random (`UZRAM_HOG_RANDOM_EIGHTHS`, else 3).
fn random_eighths() -> u64 {
    env_u64("UZRAM_HOG_RANDOM_EIGHTHS").unwrap_or(3)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn vmstat(name: &str) -> u64 {
    let v = std::fs::read_to_string("/proc/vmstat").unwrap();
    v.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}

fn meminfo_kib(key: &str) -> u64 {
    let m = std::fs::read_to_string("/proc/meminfo").unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Real-looking bytes for the hog: 2 MiB of this program's own code and data.
fn code_sample() -> Vec<u8> {
    let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let start = (exe.len() / 4).min(exe.len().saturating_sub(2 << 20));
    exe[start..(start + (2 << 20)).min(exe.len())].to_vec()
}

/// Page `i` of the hog, version `v`: [`random_eighths`] of every eight pages random, the rest
/// alternately a page of program code (`code`) and text lines; each stamped with its index and
/// version in its first 16 bytes (a misplaced or stale page shows).
fn hog_page(i: usize, v: u64, random: u64, code: &[u8], out: &mut [u8]) {
    let mut x =
        (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ v.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1;
    let kind = (i % 8) as u64;
    if kind < random {
        for c in out.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes());
        }
    } else if kind % 2 == 0 {
        let pages = code.len() / PAGE;
        let p = (i.wrapping_mul(7919) ^ v as usize) % pages;
        out.copy_from_slice(&code[p * PAGE..(p + 1) * PAGE]);
    } else {
        let mut line = *b"swap page 000000000 v0 line 00\n.";
        let digits = format!("{i:09}");
        line[10..19].copy_from_slice(digits.as_bytes());
        line[21] = b'0' + (v % 10) as u8;
        for (k, c) in out.chunks_mut(32).enumerate() {
            line[28] = b'0' + (k / 10 % 10) as u8;
            line[29] = b'0' + (k % 10) as u8;
            c.copy_from_slice(&line);
        }
    }
    out[..8].copy_from_slice(&(i as u64).to_le_bytes());
    out[8..16].copy_from_slice(&v.to_le_bytes());
}

/// Not a test of its own: the hog, run by [`run_hog`] as a child (`UZRAM_HOG_PAGES` set). Maps
/// that many pages, then twice: fills them (version 1, then 2), asks the kernel to page the
/// whole mapping out (`MADV_PAGEOUT`) and verifies every page. Counts its pages in the first 8
/// bytes of `UZRAM_HOG_PROGRESS` (for the watchdog). Exits 0 when every page was right.
#[test]
fn swap_hog_child() {
    let Some(pages) = env_u64("UZRAM_HOG_PAGES") else {
        return;
    };
    let pages = pages as usize;
    let random = random_eighths();
    let code = code_sample();
    let progress = counter_file("UZRAM_HOG_PROGRESS");
    wait_for_go();
    let mut done = 0u64;
    let tick = |done: &mut u64| {
        *done += 1;
        if *done % 256 == 0 {
            let _ = progress.write_all_at(&done.to_le_bytes(), 0);
        }
    };
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
    // SAFETY: the mapping is `pages * PAGE` bytes, lives to the end of this process, and this
    // slice is the only reference to it.
    let mem = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u8>(), pages * PAGE) };
    let mut want = vec![0u8; PAGE];
    let mut bad_total = 0;
    for v in 1..=2u64 {
        let t = Instant::now();
        for (i, page) in mem.chunks_mut(PAGE).enumerate() {
            hog_page(i, v, random, &code, page);
            tick(&mut done);
        }
        let filled = t.elapsed();
        // In steps of 16 MiB, each counted as progress (for the watchdog).
        for start in (0..pages).step_by(4096) {
            let len = (pages - start).min(4096);
            // SAFETY: the range lies inside the mapping.
            let rc = unsafe {
                libc::madvise(
                    ptr.cast::<u8>().add(start * PAGE).cast(),
                    len * PAGE,
                    libc::MADV_PAGEOUT,
                )
            };
            assert_eq!(rc, 0, "MADV_PAGEOUT: {}", std::io::Error::last_os_error());
            for _ in 0..256 {
                tick(&mut done);
            }
        }
        let paged_out = t.elapsed();
        let mut bad = 0;
        for (i, page) in mem.chunks(PAGE).enumerate() {
            hog_page(i, v, random, &code, &mut want);
            if page != &want[..] {
                bad += 1;
            }
            tick(&mut done);
        }
        println!(
            "hog: round {v}: {pages} pages filled in {:.1} s, paged out by {:.1} s, verified by \
             {:.1} s: {bad} bad",
            filled.as_secs_f64(),
            paged_out.as_secs_f64(),
            t.elapsed().as_secs_f64()
        );
        bad_total += bad;
    }
    std::io::stdout().flush().unwrap();
    if bad_total > 0 {
        std::process::exit(1);
    }
}

/// Kernel stack, state and wait channel of every thread of `pid`, appended to `out`.
fn thread_stacks(pid: u32, out: &mut String) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        out.push_str(&format!("  pid {pid}: gone\n"));
        return;
    };
    for t in tasks.flatten() {
        let p = t.path();
        let read = |n: &str| std::fs::read_to_string(p.join(n)).unwrap_or_default();
        let stat = read("stat");
        let state = stat
            .rsplit_once(") ")
            .map(|(_, r)| r.chars().next().unwrap_or('?'))
            .unwrap_or('?');
        out.push_str(&format!(
            "  {pid}/{} {} state {state} wchan {}\n",
            t.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan").trim()
        ));
        for l in read("stack").lines() {
            out.push_str("      ");
            out.push_str(l);
            out.push('\n');
        }
    }
}

/// A `/proc` file opened once and read again from its start: after the first read the kernel
/// keeps its buffer (seq_file), so reading it allocates nothing, where an open under memory
/// pressure waits for memory as everybody else does.
struct ProcFile {
    file: Option<std::fs::File>,
    buf: Vec<u8>,
}

impl ProcFile {
    fn open(path: &str) -> ProcFile {
        let mut f = ProcFile {
            file: std::fs::File::open(path).ok(),
            buf: vec![0; 64 << 10],
        };
        f.read();
        f
    }

    /// The file's text now (empty if it could not be opened).
    fn read(&mut self) -> &str {
        let Some(file) = &self.file else { return "" };
        let n = file.read_at(&mut self.buf, 0).unwrap_or(0);
        std::str::from_utf8(&self.buf[..n]).unwrap_or("")
    }

    /// The number after `key` (`key N`, `key: N kB`), 0 if absent.
    fn field(&mut self, key: &str) -> u64 {
        self.read()
            .lines()
            .find_map(|l| {
                let rest = l.strip_prefix(key)?;
                rest.trim_start_matches(':')
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    }
}

/// Pids of kernel threads named `kswapd*`.
fn kswapd_pids() -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.starts_with("kswapd") {
            pids.push(pid);
        }
    }
    pids
}

/// Not a test of its own: the watchdog of [`run_hog`] (`UZRAM_WATCH_PIDS` set: the hog's pid,
/// then the server's if any). Locks its memory and keeps a heap in reserve, then every 5 s
/// reads the hog's progress and the swap counters; every 10 s prints them with MemFree, PSI
/// and the server's RSS; when the hog made no progress for [`STUCK_S`] s (swap-outs do not
/// count: failed ones are counted too) prints every thread's kernel stack (the hog's, the
/// server's, kswapd's) and repeats that every [`STUCK_S`] s while stuck.
/// The longest time nothing moved goes to the first 8 bytes of `UZRAM_WATCH_STUCK`. With
/// `UZRAM_WATCH_CTL` (a control directory), a thread prints the server's `mm_stat` every 10 s.
#[test]
fn swap_watchdog_child() {
    let Ok(pids) = std::env::var("UZRAM_WATCH_PIDS") else {
        return;
    };
    let pids: Vec<u32> = pids.split(',').filter_map(|p| p.parse().ok()).collect();
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt takes integers only; no other thread exists yet.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
    }
    // A heap faulted in, then everything mapped now locked. Not MCL_FUTURE: a thread's
    // mapping (the stack of a child being spawned) would be populated under the mmap lock,
    // waiting for memory (seen: the whole watchdog stopped so).
    drop(std::hint::black_box(vec![1u8; 16 << 20]));
    // SAFETY: mlockall takes flags only.
    let rc = unsafe { libc::mlockall(libc::MCL_CURRENT) };
    assert_eq!(rc, 0, "mlockall: {}", std::io::Error::last_os_error());
    let progress = std::fs::File::open(std::env::var("UZRAM_WATCH_PROGRESS").unwrap()).unwrap();
    // The progress counter's page mapped and locked: reading it never waits.
    // SAFETY: a shared read-only mapping of the first page of a file we opened; the hog
    // writes 8 bytes at its start, which we read with a volatile load.
    let progress_map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            std::os::fd::AsRawFd::as_raw_fd(&progress),
            0,
        )
    };
    assert_ne!(progress_map, libc::MAP_FAILED, "mmap progress");
    // SAFETY: the mapping is one page, lives to the end of this process, and is only read.
    unsafe { libc::mlock(progress_map, PAGE) };
    let read_progress =
        // SAFETY: the mapping is at least 8 bytes, page aligned, alive for the process.
        || unsafe { std::ptr::read_volatile(progress_map.cast::<u64>()) };
    let mut vmstat_f = ProcFile::open("/proc/vmstat");
    let mut meminfo_f = ProcFile::open("/proc/meminfo");
    let mut psi_f = ProcFile::open("/proc/pressure/memory");
    let mut server_f = pids
        .get(1)
        .map(|p| ProcFile::open(&format!("/proc/{p}/status")));
    // Stacks also go to the kernel console (the host's console.log) by sysrq: `8` (console
    // log level 8, or sysrq's output stays in the ring buffer), then `w` (blocked tasks).
    let _ = std::fs::write("/proc/sys/kernel/sysrq", "1");
    let sysrq = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/sysrq-trigger")
        .ok();
    let stuck_file = counter_file("UZRAM_WATCH_STUCK");
    // Locked and with its files open: the hog may start (`u64::MAX` in the stuck counter).
    stuck_file.write_all_at(&u64::MAX.to_le_bytes(), 0).unwrap();
    if let Ok(dir) = std::env::var("UZRAM_WATCH_CTL") {
        std::thread::spawn(move || {
            let t0 = Instant::now();
            loop {
                std::thread::sleep(Duration::from_secs(10));
                let child = Command::new(UZRAM)
                    .args(["ctl", "--dir", &dir, "meta_stat"])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn();
                let Ok(mut child) = child else { continue };
                let t = Instant::now();
                match wait_timeout(&mut child, Duration::from_secs(20)) {
                    Some(_) => {
                        let mut s = String::new();
                        let _ = child.stdout.take().unwrap().read_to_string(&mut s);
                        eprintln!(
                            "watch: {:.0} s: server meta_stat {} (ctl {:.1} s)",
                            t0.elapsed().as_secs_f64(),
                            s.trim(),
                            t.elapsed().as_secs_f64()
                        );
                    }
                    None => {
                        let _ = child.kill();
                        let _ = child.wait();
                        eprintln!(
                            "watch: {:.0} s: uzram ctl meta_stat no answer in 20 s",
                            t0.elapsed().as_secs_f64()
                        );
                    }
                }
            }
        });
    }
    let kswapd = kswapd_pids();
    let t0 = Instant::now();
    let mut last = (u64::MAX, 0, 0);
    let mut last_move = Instant::now();
    let mut last_dump = Instant::now();
    let mut longest = 0u64;
    let mut out = String::with_capacity(1 << 20);
    let mut tick = 0u64;
    loop {
        std::thread::sleep(Duration::from_secs(5));
        tick += 1;
        let now = (
            read_progress(),
            vmstat_f.field("pswpout"),
            vmstat_f.field("pswpin"),
        );
        if now.0 != last.0 {
            last_move = Instant::now();
        }
        last = now;
        let still = last_move.elapsed().as_secs();
        if still > longest {
            longest = still;
            let _ = stuck_file.write_all_at(&longest.to_le_bytes(), 0);
        }
        out.clear();
        if tick % 2 == 0 || still >= STUCK_S {
            let psi = psi_f.read().replace('\n', " | ");
            let rss = server_f
                .as_mut()
                .map_or("-".into(), |f| f.field("VmRSS").to_string());
            out.push_str(&format!(
                "watch: {:.0} s: hog pages {} pswpout {} pswpin {} MemFree {} kB Mlocked {} kB \
                 server RSS {rss} kB allocstall {} oom_kill {}; psi {psi}\n",
                t0.elapsed().as_secs_f64(),
                now.0,
                now.1,
                now.2,
                meminfo_f.field("MemFree"),
                meminfo_f.field("Mlocked"),
                vmstat_f.field("allocstall_normal") + vmstat_f.field("allocstall_dma32"),
                vmstat_f.field("oom_kill"),
            ));
        }
        if still >= STUCK_S && last_dump.elapsed().as_secs() >= STUCK_S {
            last_dump = Instant::now();
            out.push_str(&format!("watch: STUCK: nothing moved for {still} s\n"));
            if let Some(mut t) = sysrq.as_ref() {
                let _ = t.write_all(b"8");
                let _ = t.write_all(b"w");
            }
            for &p in pids.iter().chain(&kswapd) {
                thread_stacks(p, &mut out);
            }
        }
        let _ = std::io::stderr().write_all(out.as_bytes());
    }
}

/// How a hog ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// Every page verified, both rounds.
    Verified,
    /// Killed by the kernel's OOM killer.
    OomKilled,
    /// Bad pages, or another failure.
    Failed(String),
    /// Not finished in the time allowed.
    TimedOut,
}

struct HogRun {
    outcome: Outcome,
    wall_s: f64,
    pswpout: u64,
    pswpin: u64,
    longest_stuck_s: u64,
    /// Requests the swap device completed during the hog: reads, writes
    /// (`/sys/block/NAME/stat`).
    requests: (u64, u64),
}

/// Reads and writes completed by block device `dev` so far (`/sys/block/NAME/stat`, fields 1
/// and 5).
fn device_requests(dev: &Path) -> (u64, u64) {
    let name = dev.file_name().unwrap().to_string_lossy();
    let stat = std::fs::read_to_string(format!("/sys/block/{name}/stat")).unwrap();
    let f: Vec<u64> = stat
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    (f[0], f[4])
}

/// The mean time of a 4 KiB request on block device `dev` at queue depth 1, in µs, as
/// (read, write): random writes, then random reads of what they wrote, within the first 64 MiB,
/// direct I/O, 3 s each, every page half random and half zeroes (compressible to about half).
/// Done here rather than by fio, whose libraries (80 MiB) would take that much of the guest's
/// RAM in its initramfs. The difference between two devices in the same boot is what a request
/// costs on one beyond the other.
fn request_latency_us(dev: &Path) -> (f64, f64) {
    use rand::{Rng, SeedableRng};
    use std::os::unix::fs::OpenOptionsExt;
    const SPAN_PAGES: u64 = (64 << 20) / PAGE as u64;
    const RUN: Duration = Duration::from_secs(3);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .unwrap();
    // O_DIRECT wants an aligned buffer.
    let mut buf = vec![0u8; 2 * PAGE];
    let at = buf.as_ptr().align_offset(PAGE);
    let page = &mut buf[at..at + PAGE];
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut mean_us = [0.0; 2];
    for (i, write) in [true, false].into_iter().enumerate() {
        let (mut n, start) = (0u64, Instant::now());
        while start.elapsed() < RUN {
            let offset = rng.gen_range(0..SPAN_PAGES) * PAGE as u64;
            if write {
                rng.fill(&mut page[..PAGE / 2]);
                page[PAGE / 2..].fill(0);
                f.write_all_at(page, offset).unwrap();
            } else {
                f.read_exact_at(page, offset).unwrap();
            }
            n += 1;
        }
        mean_us[i] = start.elapsed().as_secs_f64() * 1e6 / n as f64;
    }
    (mean_us[1], mean_us[0])
}

/// A file in the guest's /tmp, fresh.
fn scratch(name: &str) -> PathBuf {
    let p = Path::new("/tmp").join(name);
    std::fs::write(&p, [0u8; 8]).unwrap();
    p
}

/// Swaps on `dev` (`mkswap`, `swapon --discard`) and runs the hog of [`hog_pct`] of RAM with
/// the watchdog beside it (watching `server` too, and its control directory `ctl`); waits at
/// most `limit`; `swapoff`.
fn run_hog(label: &str, dev: &Path, server: Option<(u32, &Path)>, limit: Duration) -> HogRun {
    let ram = meminfo_kib("MemTotal") << 10;
    let pages = (ram * hog_pct() / 100) as usize / PAGE;
    run(Command::new("mkswap").arg(dev));
    run(Command::new("swapon").arg("-d").arg(dev));
    let progress = scratch("hog-progress");
    let stuck = scratch("watch-stuck");
    let (out0, in0, oom0) = (vmstat("pswpout"), vmstat("pswpin"), vmstat("oom_kill"));
    let requests0 = device_requests(dev);
    eprintln!(
        "{label}: hog of {pages} pages ({} MiB, {}% of RAM {} MiB, {} of 8 pages random) on {}",
        (pages * PAGE) >> 20,
        hog_pct(),
        ram >> 20,
        random_eighths(),
        dev.display()
    );
    let exe = std::env::current_exe().unwrap();
    // The hog starts paused (it waits for `go`), so the watchdog is locked in memory and
    // watching before the first page of pressure: started later, it could itself wait for the
    // memory it is there to watch.
    let go = scratch("hog-go");
    let mut hog = Command::new(&exe)
        .args([
            "swap_hog_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("UZRAM_HOG_PAGES", pages.to_string())
        .env("UZRAM_HOG_PROGRESS", &progress)
        .env("UZRAM_HOG_GO", &go)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut watched = hog.id().to_string();
    if let Some((pid, _)) = server {
        watched.push_str(&format!(",{pid}"));
    }
    let mut watch = Command::new(&exe);
    watch
        .args([
            "swap_watchdog_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("UZRAM_WATCH_PIDS", watched)
        .env("UZRAM_WATCH_PROGRESS", &progress)
        .env("UZRAM_WATCH_STUCK", &stuck)
        .stdout(Stdio::null());
    if let Some((_, ctl)) = server {
        watch.env("UZRAM_WATCH_CTL", ctl);
    }
    let mut watch = watch.spawn().unwrap();
    let ready = Instant::now();
    while read_counter(&stuck) != u64::MAX {
        assert!(
            ready.elapsed() < Duration::from_secs(60),
            "the watchdog did not start in 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let t = Instant::now();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&go)
        .unwrap()
        .write_all_at(&1u64.to_le_bytes(), 0)
        .unwrap();
    let status = wait_timeout(&mut hog, limit);
    let wall_s = t.elapsed().as_secs_f64();
    let _ = watch.kill();
    let _ = watch.wait();
    let mut hog_out = String::new();
    let outcome = match status {
        None => {
            let _ = hog.kill();
            let _ = hog.wait();
            Outcome::TimedOut
        }
        Some(st) => {
            let _ = hog.stdout.take().unwrap().read_to_string(&mut hog_out);
            if st.success() && hog_out.contains("test result: ok. 1 passed") {
                Outcome::Verified
            } else if vmstat("oom_kill") > oom0 {
                Outcome::OomKilled
            } else {
                Outcome::Failed(format!("{st}"))
            }
        }
    };
    for l in hog_out.lines().filter(|l| l.starts_with("hog:")) {
        eprintln!("{label}: {l}");
    }
    let longest_stuck_s = match read_counter(&stuck) {
        u64::MAX => 0,
        s => s,
    };
    let r = HogRun {
        outcome,
        wall_s,
        pswpout: vmstat("pswpout") - out0,
        pswpin: vmstat("pswpin") - in0,
        longest_stuck_s,
        requests: {
            let now = device_requests(dev);
            (now.0 - requests0.0, now.1 - requests0.1)
        },
    };
    eprintln!(
        "{label}: {:?} in {:.1} s, pswpout {} pswpin {}, longest without progress {} s",
        r.outcome, r.wall_s, r.pswpout, r.pswpin, r.longest_stuck_s
    );
    let lines = uzram_testkit::vm::kernel_log_lines(&[
        "Out of memory",
        "Killed process",
        "oom-kill",
        "error on swap",
        // The OOM killer's report: memory by kind, and every task's resident pages.
        "active_anon:",
        "rss_anon",
        "]     0 ",
    ]);
    // The last 60 at most.
    for l in &lines[lines.len().saturating_sub(60)..] {
        eprintln!("{label}: kernel: {l}");
    }
    let sw = Instant::now();
    run(Command::new("swapoff").arg(dev));
    eprintln!("{label}: swapoff in {:.1} s", sw.elapsed().as_secs_f64());
    r
}

/// A running `uzram serve --ublk --swap` and its control directory.
struct Server {
    child: Child,
    dir: tempfile::TempDir,
    block_dev: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(extra: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(UZRAM)
        .args(["serve", "--ublk", "--swap", "--socket"])
        .arg(dir.path().join("zram0.sock"))
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .expect("uzram serve starts");
    let mut block_dev = None;
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        eprintln!("uzram serve: {line}");
        if let Some(p) = line
            .split_whitespace()
            .find(|w| w.starts_with("/dev/ublkb"))
        {
            block_dev = Some(PathBuf::from(p));
        }
        if line.starts_with("serving") {
            break;
        }
    }
    // Its later lines are drained, so a full pipe never blocks it.
    std::thread::spawn(move || lines.for_each(drop));
    Server {
        child,
        dir,
        block_dev: block_dev.expect("uzram serve --ublk printed no /dev/ublkbN"),
    }
}

/// The hog of [`hog_pct`] (1.27x the RAM, 3 random pages in 8 by default) on `/dev/ublkb0`
/// served by `uzram serve --ublk --swap`: every page verified twice, or the hog killed by the
/// OOM killer (where memory runs out: the server's own memory, locked, is part of it), and
/// never stuck for [`STUCK_S`] s or more; and verified wherever the kernel's zram completes
/// the same hog: when the control ran, if it completed; without it, in the default case (a
/// 1 GiB guest, the default hog), which the kernel's zram completes. With
/// `UZRAM_SWAP_CONTROL` set the same hog runs first on the guest kernel's zram (lz4, same
/// size) in the same boot, the control for the wall times (not in CI: it doubles the run).
/// `UZRAM_SERVE_ARGS` adds `uzram serve` arguments (`--swap-reserve 16M`).
#[test]
fn swap_pressure_in_vm() {
    let mut args: Vec<String> = ["--kernel", "6.12", "--no-zoned", "--timeout-s", "900"]
        .map(String::from)
        .to_vec();
    let ram_mb = env_u64("UZRAM_GUEST_MB").unwrap_or(GUEST_RAM_MB);
    args.extend(["--mem-mb".into(), ram_mb.to_string()]);
    args.extend(["--cpus".into(), GUEST_CPUS.to_string()]);
    args.extend(["--include".into(), UZRAM.into()]);
    let mut env = Vec::new();
    for name in [
        "UZRAM_HOG_PCT",
        "UZRAM_HOG_RANDOM_EIGHTHS",
        "UZRAM_SWAP_CONTROL",
        "UZRAM_HOG_LIMIT_S",
        "UZRAM_SERVE_ARGS",
    ] {
        if let Ok(v) = std::env::var(name) {
            env.push((name, v));
        }
    }
    if std::env::var_os("UZRAM_VM").is_none() {
        let env: Vec<(&str, &str)> = env.iter().map(|(n, v)| (*n, v.as_str())).collect();
        uzram_testkit::vm::boot_test("swap_pressure_in_vm", &args, &env);
        return;
    }
    let _ = std::fs::write("/proc/sys/kernel/hung_task_timeout_secs", "30");
    // The kernel's own reports (hung tasks, with their stacks; the OOM killer) on the console,
    // which the host prints when the VM is stopped: they get out when no process can.
    let _ = std::fs::write("/proc/sys/kernel/printk", "7");
    let limit = Duration::from_secs(env_u64("UZRAM_HOG_LIMIT_S").unwrap_or(600));
    // Swap of twice the RAM (rounded up to 512 MiB): room for the whole hog whatever stays
    // resident.
    let disksize = format!(
        "{}M",
        (meminfo_kib("MemTotal") * 2).div_ceil(512 << 10) * 512
    );
    let control = std::env::var_os("UZRAM_SWAP_CONTROL").map(|_| {
        std::fs::write("/sys/block/zram0/comp_algorithm", "lz4").unwrap();
        std::fs::write("/sys/block/zram0/disksize", &disksize).unwrap();
        let r = run_hog("kernel zram", Path::new("/dev/zram0"), None, limit);
        eprintln!(
            "kernel zram mm_stat: {}",
            std::fs::read_to_string("/sys/block/zram0/mm_stat").unwrap()
        );
        let latency = request_latency_us(Path::new("/dev/zram0"));
        std::fs::write("/sys/block/zram0/reset", "1").unwrap();
        (r, latency)
    });
    let (control, control_latency) = match control {
        Some((r, latency)) => (Some(r), Some(latency)),
        None => (None, None),
    };
    let extra = std::env::var("UZRAM_SERVE_ARGS").unwrap_or_default();
    let mut serve_args = vec!["--disksize", disksize.as_str()];
    serve_args.extend(extra.split_whitespace());
    let s = serve(&serve_args);
    let uzram = run_hog(
        "uzram ublk",
        &s.block_dev,
        Some((s.child.id(), s.dir.path())),
        limit,
    );
    let mm = run(Command::new(UZRAM)
        .args(["ctl", "--dir"])
        .arg(s.dir.path())
        .arg("mm_stat"));
    eprintln!("uzram mm_stat after the hog: {}", mm.trim());
    // The ublk handoff's share of uzram's wall time, with the control: each of uzram's requests
    // during the hog at what a request costs on /dev/ublkb0 beyond /dev/zram0 (same boot,
    // depth 1; the difference is the trip through ublk to the server and back, the server's
    // own work being the kernel's: lz4 on the same page).
    if let Some((zram_read_us, zram_write_us)) = control_latency {
        let (read_us, write_us) = request_latency_us(&s.block_dev);
        let (reads, writes) = uzram.requests;
        let handoff_s = (reads as f64 * (read_us - zram_read_us).max(0.0)
            + writes as f64 * (write_us - zram_write_us).max(0.0))
            / 1e6;
        println!(
            "swap_pressure: 4 KiB at depth 1: kernel zram read {zram_read_us:.1} µs write \
             {zram_write_us:.1} µs; uzram ublk read {read_us:.1} µs write {write_us:.1} µs; \
             uzram's {reads} reads and {writes} writes during the hog: about {handoff_s:.1} s of \
             its {:.1} s ({:.0}%) in the handoff",
            uzram.wall_s,
            100.0 * handoff_s / uzram.wall_s
        );
    }
    for (label, r) in [
        ("kernel zram", control.as_ref()),
        ("uzram ublk", Some(&uzram)),
    ] {
        if let Some(r) = r {
            println!(
                "swap_pressure: {label}: {:?}, {:.1} s, longest without progress {} s",
                r.outcome, r.wall_s, r.longest_stuck_s
            );
        }
    }
    assert!(
        matches!(uzram.outcome, Outcome::Verified | Outcome::OomKilled),
        "swap on {}: {:?}",
        s.block_dev.display(),
        uzram.outcome
    );
    // Where the kernel's zram completes, uzram must: the control's outcome when it ran, else
    // the default case (a 1 GiB guest, a 1.27x hog of 3 random pages in 8, no extra server
    // arguments), which the kernel's zram completes (docs/ublk.md, "Swap on ublk").
    let default_case = [
        "UZRAM_HOG_PCT",
        "UZRAM_HOG_RANDOM_EIGHTHS",
        "UZRAM_SERVE_ARGS",
    ]
    .iter()
    .all(|n| std::env::var_os(n).is_none())
        && meminfo_kib("MemTotal") > 768 << 10;
    let kernel_completes = match &control {
        Some(r) => r.outcome == Outcome::Verified,
        None => default_case,
    };
    if kernel_completes {
        assert_eq!(
            uzram.outcome,
            Outcome::Verified,
            "the kernel's zram completes this hog; swap on {} did not",
            s.block_dev.display()
        );
    }
    assert!(
        uzram.longest_stuck_s < STUCK_S,
        "the hog made no progress for {} s (its stacks are above)",
        uzram.longest_stuck_s
    );
}

/// The first 8 bytes of file `path`, a little-endian counter.
fn read_counter(path: &Path) -> u64 {
    let mut buf = [0u8; 8];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut buf, 0)
        .unwrap();
    u64::from_le_bytes(buf)
}

/// In the hog: waits until the file `UZRAM_HOG_GO` holds a non-zero counter (the watchdog is
/// ready).
fn wait_for_go() {
    let go = PathBuf::from(std::env::var_os("UZRAM_HOG_GO").unwrap());
    while read_counter(&go) == 0 {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The file named by environment variable `var`, opened for writing without truncating it:
/// where a guest program leaves a counter the watcher reads.
fn counter_file(var: &str) -> std::fs::File {
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(std::env::var(var).unwrap())
        .unwrap()
}
