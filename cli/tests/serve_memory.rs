//! `uzram serve`'s memory, with and without `--swap`: the real server binary with a
//! 2 GiB device, four connections opened first and kept open (each pipelines more requests than
//! its buffer pool keeps, then idles), 400 MiB of real program pages (the corpus of
//! `uzram corpus`) written by `nbdcopy --connections=4`, read back by `qemu-img compare`, then
//! every page discarded (`qemu-io`) and the pool compacted (`uzram ctl compact`); and, under
//! `--swap`, a server of 16 devices of 256 MiB, idle first, then the same 400 MiB split over
//! them (25 MiB each), read back, discarded and compacted.
//!
//! Checked, from memory figures only (VmRSS, `smaps_rollup`; never a timing), with `reserve`
//! the server's swap reserve as it reports it (`meta_stat`'s `swap_reserve_size`, and `uzram
//! status`'s `SWAP-RESERVE`; 0 without `--swap`) and `mem_used_total` summed over the devices:
//! - while full, RSS ≤ `mem_used_total` × 1.05 + reserve + 32 MiB (the target);
//! - after discard and compaction, `mem_used_total` is 0 and RSS ≤ reserve + 48 MiB;
//! - RSS is explained by what the server reports: the idle server's RSS, plus `mem_used_total`,
//!   plus `meta_stat`, plus the per-connection bound of docs/serve.md ("Memory") per open
//!   connection;
//! - under `--swap`, every anonymous page is locked (`Locked` ≥ `Anonymous`), and freed memory
//!   leaves the process all the same.
//!
//! The figures are printed (`--nocapture`) for the record, with RSS by mapping under `--swap`:
//! docs/serve.md ("Memory") quotes them.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use uzram_bench::corpus::Corpus;
use uzram_nbd_proto::{CMD_READ, CMD_WRITE};
use uzram_testkit::nbd::RawClient;
use uzram_testkit::process::{proc_field, require, run};
use uzram_testkit::serve::{corpus, Running, Serve};

const MIB: u64 = 1 << 20;
/// The device and fill.
const DISKSIZE_BYTES: u64 = 2 << 30;
const FILL_BYTES: u64 = 400 * MIB;
/// The many devices (an idle `serve --swap` of these held 1.1 GB once: a reserve of
/// 64 MiB per device); the fill is split over them.
const DEVICES: usize = 16;
const DEVICE_DISKSIZE_BYTES: u64 = 256 * MIB;
/// Connections held open through the whole run (besides nbdcopy's own four).
const HELD_CONNECTIONS: usize = 4;
/// Requests each held connection has in flight at once: 8 MiB of 128 KiB requests, twice what
/// its buffer pool keeps afterwards.
const HELD_DEPTH: usize = 64;
const HELD_REQUEST_BYTES: usize = 128 << 10;
/// The targets.
const FULL_SLACK_BYTES: u64 = 32 * MIB;
const EMPTY_LIMIT_BYTES: u64 = 48 * MIB;
/// docs/serve.md, "Memory": what one open connection may hold at most, idle (its 64 KiB receive
/// buffer, its threads' stacks as deep as they went and their share of malloc's arenas; request
/// buffers belong to the server-wide budget and are released once idle).
const CONNECTION_BOUND_BYTES: u64 =
    uzram_service::frontend::nbd::transmission::RECEIVE_BUFFER_BYTES as u64 + MIB;
/// Longer than the request budget's idle release (`Limits::idle_release`, 1 s): recycled request
/// buffers are unmapped once nothing has used them for that long, so a snapshot taken after
/// this much quiet shows what the server keeps, not what it is about to give back.
const QUIET: std::time::Duration = std::time::Duration::from_millis(2500);

/// The corpus (`uzram corpus`, every program it knows), made once per build directory.
fn corpus_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| corpus("pages.bin", &[], |p| Corpus::load(p).is_ok()))
}

/// `bytes` of corpus pages, in order from page `first_page`, starting over when they run out.
fn write_image(corpus: &Corpus, path: &Path, first_page: usize, bytes: u64) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let pages = (bytes / corpus.page_size_bytes() as u64) as usize;
    for p in first_page..first_page + pages {
        f.write_all(corpus.page(p % corpus.len())).unwrap();
    }
    f.into_inner().unwrap().sync_all().unwrap();
}

/// `uzram serve` of one device of [`DISKSIZE_BYTES`] (`--swap` if `swap`, with the default
/// swap reserve), killed however the test ends.
fn start(swap: bool) -> Running {
    let size = DISKSIZE_BYTES.to_string();
    let serve = Serve::args(&["--disksize", &size, "--socket", "{dir}/zram0.sock"]);
    if swap {
        serve.arg(&["--swap"]).start()
    } else {
        serve.start()
    }
}

/// A field of /proc/PID/status or /proc/PID/smaps_rollup of the server, in bytes.
fn proc_bytes(s: &Running, file: &str, field: &str) -> u64 {
    proc_field(&format!("/proc/{}/{file}", s.pid()), field) * 1024
}

/// The server's memory and its devices' books (summed over `devices`), now.
fn snapshot(s: &Running, devices: &[String]) -> Snapshot {
    let mut snap = Snapshot {
        rss_bytes: proc_bytes(s, "status", "VmRSS"),
        anon_bytes: proc_bytes(s, "smaps_rollup", "Anonymous"),
        locked_bytes: proc_bytes(s, "smaps_rollup", "Locked"),
        ..Snapshot::default()
    };
    for dev in devices {
        let mm = s.columns(dev, "mm_stat");
        let meta = s.columns(dev, "meta_stat");
        assert_eq!(meta.len(), 8);
        snap.mem_used_total_bytes += mm[2];
        // The device's own columns; the server's swap reserve is counted apart.
        snap.meta_bytes += meta[..5].iter().sum::<u64>();
        for (sum, col) in snap.meta_columns_bytes.iter_mut().zip(&meta[..5]) {
            *sum += col;
        }
        snap.slot_table_bytes += meta[0];
        // One reserve for the server: the same on every device.
        snap.reserve_held_bytes = meta[5];
    }
    snap
}

#[derive(Debug, Default, Clone, Copy)]
struct Snapshot {
    rss_bytes: u64,
    mem_used_total_bytes: u64,
    meta_bytes: u64,
    /// `meta_stat`'s first five columns, summed over the devices.
    meta_columns_bytes: [u64; 5],
    slot_table_bytes: u64,
    /// The swap reserve's pages faulted in and waiting now (`meta_stat`'s `swap_reserve`).
    reserve_held_bytes: u64,
    anon_bytes: u64,
    locked_bytes: u64,
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / MIB as f64)
}

/// The server's swap reserve size as it reports it: `meta_stat`'s `swap_reserve_size` (the same
/// on every device: one reserve for the server) and `uzram status`'s `SWAP-RESERVE` (held/size),
/// which must agree. 0 without `--swap`.
fn reported_swap_reserve(s: &Running, devices: &[String]) -> u64 {
    let sizes: Vec<u64> = devices
        .iter()
        .map(|d| s.columns(d, "meta_stat")[6])
        .collect();
    assert!(
        sizes.iter().all(|&b| b == sizes[0]),
        "one reserve for the server, but meta_stat says {sizes:?}"
    );
    let status = s.status(&["--bytes", "--raw", "-n", "-o", "NAME,SWAP-RESERVE"]);
    let mut seen = 0;
    for line in status.lines() {
        let (name, reserve) = line.split_once(' ').unwrap_or((line, ""));
        if !devices.iter().any(|d| d == name) {
            continue;
        }
        seen += 1;
        let size = reserve
            .split_once('/')
            .map_or(0, |(_, size)| size.parse().unwrap());
        assert_eq!(size, sizes[0], "{name}: uzram status {status:?}");
    }
    assert_eq!(seen, devices.len(), "uzram status {status:?}");
    sizes[0]
}

/// The server's RSS by mapping (/proc/PID/smaps): the swap reserve's and pools' frames, the
/// slot tables, the handle tables, other shared memory, malloc's heap, other anonymous memory
/// (request buffers, thread stacks, other arenas), and files (the program and its libraries).
fn rss_by_mapping(s: &Running) -> String {
    let smaps = std::fs::read_to_string(format!("/proc/{}/smaps", s.pid())).unwrap();
    let kinds = [
        "frames", "slots", "handles", "memfd", "heap", "anon", "files",
    ];
    let mut kb = [0u64; 7];
    let mut kind = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: ADDR-ADDR PERMS OFFSET DEV INODE [NAME].
            let name = line.split_whitespace().nth(5).unwrap_or("");
            kind = match name {
                n if n.starts_with("/memfd:uzram-frames") => 0,
                n if n.starts_with("/memfd:uzram-slots") => 1,
                n if n.starts_with("/memfd:uzram-handles") => 2,
                n if n.starts_with("/memfd:") => 3,
                "[heap]" => 4,
                n if n.is_empty() || n.starts_with('[') => 5,
                _ => 6,
            };
        } else if let Some(v) = line.strip_prefix("Rss:") {
            kb[kind] += v.split_whitespace().next().unwrap().parse::<u64>().unwrap();
        }
    }
    kinds
        .iter()
        .zip(kb)
        .map(|(k, kb)| format!("{k} {}", mib(kb * 1024)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `meta_stat`'s columns and RSS by mapping at `when`, a line each.
fn details(when: &str, s: Snapshot, map: &str) -> String {
    let [slots, handles, zspages, cache, queue] = s.meta_columns_bytes.map(mib);
    format!(
        "  {when}: meta_stat: slot_table {slots}, handle_table {handles}, zspage_meta {zspages}, \
         frame_cache {cache}, deferred_queue {queue}, swap_reserve held {}\n\
         \x20 {when}: RSS by mapping: {map}\n",
        mib(s.reserve_held_bytes)
    )
}

/// The targets, for a server whose swap reserve is `reserve` (0 without `--swap`):
/// RSS ≤ `mem_used_total` × 1.05 + reserve + 32 MiB while full, and, after discard and
/// compaction, no page left and RSS ≤ reserve + 48 MiB; under `--swap`, every anonymous page
/// locked. Without `--swap` both targets are asserted. Under `--swap` the server also keeps
/// faulted in, on purpose, memory the bound has no term for (docs/serve.md, "Memory";
/// docs/ublk.md, "Swap on ublk"): the slot tables whole (as kernel zram's table), the handle
/// tables and deferred-free queues (`meta_stat`'s second and fifth columns), malloc's heap reserve and the
/// NBD request buffers preallocated for swap; the bounds asserted add exactly those, and the
/// verdict against the issue's own bounds is printed.
fn check_targets(mode: &str, reserve: u64, full: Snapshot, empty: Snapshot) {
    assert!(
        full.mem_used_total_bytes >= FILL_BYTES / 4,
        "{mode}: the fill holds {} only",
        mib(full.mem_used_total_bytes)
    );
    assert_eq!(empty.mem_used_total_bytes, 0, "{mode}: pages left");
    let swap = reserve > 0;
    for (when, s) in [("full", full), ("empty", empty)] {
        if swap {
            assert!(
                s.locked_bytes >= s.anon_bytes,
                "{mode}, {when}: anonymous memory {} but only {} locked",
                mib(s.anon_bytes),
                mib(s.locked_bytes)
            );
        } else {
            assert_eq!(s.locked_bytes, 0, "{when}: locked without --swap");
        }
    }
    let full_limit = full.mem_used_total_bytes * 105 / 100 + reserve + FULL_SLACK_BYTES;
    let empty_limit = reserve + EMPTY_LIMIT_BYTES;
    let verdict = |rss: u64, limit: u64| {
        if rss <= limit {
            format!("holds ({} to spare)", mib(limit - rss))
        } else {
            format!("misses by {}", mib(rss - limit))
        }
    };
    let report = format!(
        "{mode}: the issue's bounds: while full, RSS {} ≤ mem_used_total {} x 1.05 + reserve {} \
         + 32 MiB = {}: {}; after discard and compact, RSS {} ≤ reserve {} + 48 MiB = {}: {}",
        mib(full.rss_bytes),
        mib(full.mem_used_total_bytes),
        mib(reserve),
        mib(full_limit),
        verdict(full.rss_bytes, full_limit),
        mib(empty.rss_bytes),
        mib(reserve),
        mib(empty_limit),
        verdict(empty.rss_bytes, empty_limit),
    );
    eprintln!("  {report}");
    if !swap {
        assert!(
            full.rss_bytes <= full_limit && empty.rss_bytes <= empty_limit,
            "{report}"
        );
        return;
    }
    // What --swap keeps faulted in on purpose, as the server reports it.
    let kept = |s: &Snapshot| {
        s.meta_columns_bytes[0]
            + s.meta_columns_bytes[1]
            + s.meta_columns_bytes[4]
            + uzram_service::frontend::swap::HEAP_RESERVE_BYTES as u64
            + uzram_service::frontend::limits::SWAP_PREALLOCATED_BYTES
    };
    let (full_swap, empty_swap) = (full_limit + kept(&full), empty_limit + kept(&empty));
    let report = format!(
        "{report}\n  {mode}: with what --swap keeps on purpose (slot and handle tables, deferred-free \
         queues, heap reserve, NBD buffers): full RSS {} ≤ {}: {}; empty RSS {} ≤ {}: {}",
        mib(full.rss_bytes),
        mib(full_swap),
        verdict(full.rss_bytes, full_swap),
        mib(empty.rss_bytes),
        mib(empty_swap),
        verdict(empty.rss_bytes, empty_swap),
    );
    eprintln!("  {}", report.lines().last().unwrap_or_default());
    assert!(
        full.rss_bytes <= full_swap && empty.rss_bytes <= empty_swap,
        "{report}"
    );
}

/// `image` written to the export at `uri` by `nbdcopy --connections=4`. Under `--swap` a write
/// the swap reserve cannot serve in time fails (`ENOSPC` over NBD: docs/serve.md, "Serving
/// swap"), as a swap-out the kernel then issues again; nbdcopy gives up instead, so the copy
/// is made again (the same bytes: idempotent), a few times at most. The test is about memory,
/// not about a burst outrunning the reserve's refiller on a loaded machine.
fn copy_in(image: &Path, uri: &str) {
    let attempt = || {
        Command::new("nbdcopy")
            .arg("--connections=4")
            .arg(image)
            .arg(uri)
            .output()
            .expect("nbdcopy runs")
    };
    for _ in 0..4 {
        let out = attempt();
        if out.status.success() {
            return;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("No space left on device"),
            "nbdcopy to {uri}: {err}"
        );
        eprintln!("  nbdcopy to {uri}: {} (made again)", err.trim());
        std::thread::sleep(QUIET);
    }
    run(Command::new("nbdcopy")
        .arg("--connections=4")
        .arg(image)
        .arg(uri));
}

/// `HELD_DEPTH` writes of corpus pages in flight at `offset`, then as many reads, each checked.
fn exercise(c: &mut RawClient, corpus: &Corpus, offset: u64, first_page: usize) {
    let pages_per_request = HELD_REQUEST_BYTES / corpus.page_size_bytes();
    let data: Vec<Vec<u8>> = (0..HELD_DEPTH)
        .map(|k| {
            let start = first_page + k * pages_per_request;
            (start..start + pages_per_request)
                .flat_map(|p| corpus.page(p % corpus.len()).iter().copied())
                .collect()
        })
        .collect();
    let at = |k: usize| offset + (k * HELD_REQUEST_BYTES) as u64;
    for (k, d) in data.iter().enumerate() {
        c.send_request(CMD_WRITE, 0, k as u64, at(k), d.len() as u32);
        c.s.write_all(d).unwrap();
    }
    for _ in 0..HELD_DEPTH {
        let r = c.read_reply(0);
        assert_eq!(r.error, 0, "write {}", r.cookie);
    }
    for k in 0..HELD_DEPTH {
        c.send_request(CMD_READ, 0, k as u64, at(k), HELD_REQUEST_BYTES as u32);
    }
    for _ in 0..HELD_DEPTH {
        let r = c.read_reply(HELD_REQUEST_BYTES);
        assert_eq!(r.error, 0, "read {}", r.cookie);
        assert!(
            r.data == data[r.cookie as usize],
            "read {} differs",
            r.cookie
        );
    }
}

fn memory_follows_the_pool(swap: bool) {
    require("nbdcopy");
    require("qemu-img");
    require("qemu-io");
    let mode = if swap { "--swap" } else { "without --swap" };
    let corpus = Corpus::load(corpus_path()).unwrap();
    let server = start(swap);
    let devices = ["zram0".to_string()];
    if swap {
        assert!(
            server.log().contains("--swap: memory locked"),
            "{}",
            server.log()
        );
    }
    let reserve = reported_swap_reserve(&server, &devices);
    assert_eq!(
        reserve > 0,
        swap,
        "{mode}: a swap reserve of {reserve} bytes"
    );
    let image = server.dir().join("fill.raw");
    write_image(&corpus, &image, 0, FILL_BYTES);

    let idle = snapshot(&server, &devices);
    let idle_map = rss_by_mapping(&server);
    let mut held: Vec<RawClient> = (0..HELD_CONNECTIONS)
        .map(|_| RawClient::handshake(&server.socket("zram0"), false).0)
        .collect();
    // One request each: the connection has set up everything it keeps (its buffer pool is made
    // after the handshake's last reply).
    for c in &mut held {
        assert_eq!(c.read(1, 0, 4096).error, 0);
    }
    let connected = snapshot(&server, &devices);
    let request_pages = HELD_REQUEST_BYTES / corpus.page_size_bytes();
    for (i, c) in held.iter_mut().enumerate() {
        let offset = (i * HELD_DEPTH * HELD_REQUEST_BYTES) as u64;
        exercise(c, &corpus, offset, i * HELD_DEPTH * request_pages);
    }
    std::thread::sleep(QUIET);
    let worked = snapshot(&server, &devices);

    copy_in(&image, &server.uri("zram0"));
    // Every page reads back (and the rest of the device as zeroes).
    run(Command::new("qemu-img")
        .args(["compare", "-q", "-f", "raw", "-F", "raw"])
        .arg(&image)
        .arg(server.uri("zram0")));
    std::thread::sleep(QUIET);
    let full = snapshot(&server, &devices);
    let full_map = rss_by_mapping(&server);

    // In two halves: qemu-io takes at most 2 GiB - 512 bytes per request.
    let half = DISKSIZE_BYTES / 2;
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        &format!("discard 0 {half}"),
        "-c",
        &format!("discard {half} {half}"),
        &server.uri("zram0"),
    ]));
    server.set("zram0", "compact", "1");
    std::thread::sleep(QUIET);
    let empty = snapshot(&server, &devices);
    let empty_map = rss_by_mapping(&server);
    // The held connections are still served.
    for c in &mut held {
        let r = c.read(7, 0, HELD_REQUEST_BYTES as u32);
        assert_eq!(r.error, 0);
        assert!(
            r.data.iter().all(|&b| b == 0),
            "discarded data reads as zeroes"
        );
    }

    // What a connection adds: the growth of RSS beyond the growth of the device's figures
    // (but the slot table's, which is fixed: the few slot-table pages the held connections'
    // writes touched, 16 bytes per 4 KiB page written, count as theirs), per connection.
    let per_conn_bytes = |s: Snapshot| {
        let device = |s: &Snapshot| s.mem_used_total_bytes + s.meta_bytes - s.slot_table_bytes;
        let grown = s.rss_bytes.saturating_sub(idle.rss_bytes);
        grown.saturating_sub(device(&s) - device(&idle)) / HELD_CONNECTIONS as u64
    };
    let per_conn = |s: Snapshot| mib(per_conn_bytes(s));
    eprintln!(
        "uzram serve {mode}, {} device, {} of corpus pages by nbdcopy --connections=4, \
         {HELD_CONNECTIONS} more connections held open; swap reserve {}:\n\
         \x20 RSS idle {}; per held connection: {} connected, {} after its burst\n\
         \x20 full:  RSS {}  mem_used_total {}  meta_stat {}  anon {}  locked {}\n\
         \x20 empty: RSS {}  mem_used_total {}  meta_stat {}  anon {}  locked {}",
        mib(DISKSIZE_BYTES),
        mib(FILL_BYTES),
        mib(reserve),
        mib(idle.rss_bytes),
        per_conn(connected),
        per_conn(worked),
        mib(full.rss_bytes),
        mib(full.mem_used_total_bytes),
        mib(full.meta_bytes),
        mib(full.anon_bytes),
        mib(full.locked_bytes),
        mib(empty.rss_bytes),
        mib(empty.mem_used_total_bytes),
        mib(empty.meta_bytes),
        mib(empty.anon_bytes),
        mib(empty.locked_bytes),
    );
    eprintln!(
        "{}{}{}",
        details("idle", idle, &idle_map),
        details("full", full, &full_map),
        details("empty", empty, &empty_map)
    );

    // Under --swap the server's preallocated request buffers are really there (resident, so
    // locked) from the start.
    if swap {
        let preallocated = uzram_service::frontend::limits::SWAP_PREALLOCATED_BYTES;
        assert!(
            idle.rss_bytes >= preallocated,
            "{mode}: the idle server holds {}, less than its {} of preallocated buffers",
            mib(idle.rss_bytes),
            mib(preallocated)
        );
    }

    check_targets(mode, reserve, full, empty);
    // RSS explained by the reported figures and the documented per-connection bound.
    for (when, s) in [("full", full), ("empty", empty)] {
        let explained = idle.rss_bytes
            + s.mem_used_total_bytes
            + s.meta_bytes
            + HELD_CONNECTIONS as u64 * CONNECTION_BOUND_BYTES;
        assert!(
            s.rss_bytes <= explained,
            "{mode}, {when}: RSS {} not explained: idle {} + mem_used_total {} + meta_stat {} + \
             {HELD_CONNECTIONS} connections x {}",
            mib(s.rss_bytes),
            mib(idle.rss_bytes),
            mib(s.mem_used_total_bytes),
            mib(s.meta_bytes),
            mib(CONNECTION_BOUND_BYTES)
        );
    }
    drop(held);
}

#[test]
fn memory_follows_the_pool_without_swap() {
    memory_follows_the_pool(false);
}

#[test]
fn memory_follows_the_pool_with_swap() {
    require_root();
    memory_follows_the_pool(true);
}

fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(
        uid, 0,
        "--swap locks memory, which needs root (CI runs as root)"
    );
}

/// `uzram serve --swap` of [`DEVICES`] devices of [`DEVICE_DISKSIZE_BYTES`] (one swap reserve,
/// the default, for all of them): its RSS idle, then with [`FILL_BYTES`] of corpus pages split
/// over the devices (`nbdcopy` to each, `qemu-img compare` back), then with every device
/// discarded and compacted; the targets with `mem_used_total` summed over the devices.
#[test]
fn memory_follows_the_pools_of_16_devices_with_swap() {
    require_root();
    require("nbdcopy");
    require("qemu-img");
    require("qemu-io");
    let mode = format!("--swap, {DEVICES} devices");
    let corpus = Corpus::load(corpus_path()).unwrap();
    let devices: Vec<String> = (0..DEVICES).map(|i| format!("zram{i}")).collect();
    let mut toml = String::from("[server]\nswap = true\n");
    for d in &devices {
        toml += &format!(
            "[[device]]\nname = \"{d}\"\ndisksize = \"{DEVICE_DISKSIZE_BYTES}\"\n\
             socket = \"{{dir}}/{d}.sock\"\n"
        );
    }
    let server = Serve::config(&toml).start();
    assert!(
        server.log().contains("--swap: memory locked"),
        "{}",
        server.log()
    );
    let reserve = reported_swap_reserve(&server, &devices);
    assert!(reserve > 0, "{mode}: no swap reserve");
    let idle = snapshot(&server, &devices);
    let idle_map = rss_by_mapping(&server);

    let per_device_bytes = FILL_BYTES / DEVICES as u64;
    let per_device_pages = (per_device_bytes / corpus.page_size_bytes() as u64) as usize;
    for (i, d) in devices.iter().enumerate() {
        let image = server.dir().join(format!("{d}.raw"));
        write_image(&corpus, &image, i * per_device_pages, per_device_bytes);
        copy_in(&image, &server.uri(d));
    }
    // Every page reads back, from every device (and the rest of each as zeroes).
    for d in &devices {
        run(Command::new("qemu-img")
            .args(["compare", "-q", "-f", "raw", "-F", "raw"])
            .arg(server.dir().join(format!("{d}.raw")))
            .arg(server.uri(d)));
    }
    std::thread::sleep(QUIET);
    let full = snapshot(&server, &devices);
    let full_map = rss_by_mapping(&server);

    for d in &devices {
        run(Command::new("qemu-io").args([
            "-f",
            "raw",
            "-c",
            &format!("discard 0 {DEVICE_DISKSIZE_BYTES}"),
            &server.uri(d),
        ]));
        server.set(d, "compact", "1");
    }
    std::thread::sleep(QUIET);
    let empty = snapshot(&server, &devices);
    let empty_map = rss_by_mapping(&server);

    eprintln!(
        "uzram serve --swap, {DEVICES} devices of {}, {} of corpus pages ({} each) by nbdcopy \
         --connections=4; swap reserve {}:\n\
         \x20 idle:  RSS {}  meta_stat {}  anon {}  locked {}\n\
         \x20 full:  RSS {}  mem_used_total {}  meta_stat {}  anon {}  locked {}\n\
         \x20 empty: RSS {}  mem_used_total {}  meta_stat {}  anon {}  locked {}\n\
         {}{}{}",
        mib(DEVICE_DISKSIZE_BYTES),
        mib(FILL_BYTES),
        mib(per_device_bytes),
        mib(reserve),
        mib(idle.rss_bytes),
        mib(idle.meta_bytes),
        mib(idle.anon_bytes),
        mib(idle.locked_bytes),
        mib(full.rss_bytes),
        mib(full.mem_used_total_bytes),
        mib(full.meta_bytes),
        mib(full.anon_bytes),
        mib(full.locked_bytes),
        mib(empty.rss_bytes),
        mib(empty.mem_used_total_bytes),
        mib(empty.meta_bytes),
        mib(empty.anon_bytes),
        mib(empty.locked_bytes),
        details("idle", idle, &idle_map),
        details("full", full, &full_map),
        details("empty", empty, &empty_map)
    );
    check_targets(&mode, reserve, full, empty);
}
