//! `uzram serve`'s memory, with and without `--swap`: the real server binary with a
//! 2 GiB device, four connections opened first and kept open (each pipelines more requests than
//! its buffer pool keeps, then idles), 400 MiB of real program pages (the corpus of
//! `uzram corpus`) written by `nbdcopy --connections=4`, read back by `qemu-img compare`, then
//! every page discarded (`qemu-io`) and the pool compacted (`uzram ctl compact`).
//!
//! Checked, from memory figures only (VmRSS, `smaps_rollup`; never a timing):
//! - while full, RSS ≤ `mem_used_total` × 1.05 + 32 MiB (the target);
//! - after discard and compaction, `mem_used_total` is 0 and RSS ≤ 48 MiB;
//! - RSS is explained by what the server reports: the idle server's RSS, plus `mem_used_total`,
//!   plus `meta_stat`, plus the per-connection bound of docs/serve.md ("Memory") per open
//!   connection;
//! - under `--swap`, every anonymous page is locked (`Locked` ≥ `Anonymous`), and freed memory
//!   leaves the process all the same.
//!
//! The figures are printed (`--nocapture`) for the record: docs/serve.md ("Memory") quotes them.

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

/// `FILL_BYTES` of corpus pages, in order, starting over when they run out.
fn write_image(corpus: &Corpus, path: &Path) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let pages = (FILL_BYTES / corpus.page_size_bytes() as u64) as usize;
    for page in corpus.cycle(pages) {
        f.write_all(page).unwrap();
    }
    f.into_inner().unwrap().sync_all().unwrap();
}

/// `uzram serve` of one device of [`DISKSIZE_BYTES`] (`--swap` if `swap`), killed however the
/// test ends.
fn start(swap: bool) -> Running {
    let size = DISKSIZE_BYTES.to_string();
    let serve = Serve::args(&["--disksize", &size, "--socket", "{dir}/zram0.sock"]);
    if swap {
        serve.arg(&["--swap", "--swap-reserve", "64M"]).start()
    } else {
        serve.start()
    }
}

/// A field of /proc/PID/status or /proc/PID/smaps_rollup of the server, in bytes.
fn proc_bytes(s: &Running, file: &str, field: &str) -> u64 {
    proc_field(&format!("/proc/{}/{file}", s.pid()), field) * 1024
}

/// The server's memory and the device's books, now.
fn snapshot(s: &Running) -> Snapshot {
    let mm = s.columns("zram0", "mm_stat");
    let meta = s.columns("zram0", "meta_stat");
    assert_eq!(meta.len(), 8);
    Snapshot {
        rss_bytes: proc_bytes(s, "status", "VmRSS"),
        mem_used_total_bytes: mm[2],
        // The device's own columns; the server's swap reserve is counted apart.
        meta_bytes: meta[..5].iter().sum(),
        slot_table_bytes: meta[0],
        handle_table_bytes: meta[1],
        anon_bytes: proc_bytes(s, "smaps_rollup", "Anonymous"),
        locked_bytes: proc_bytes(s, "smaps_rollup", "Locked"),
    }
}

#[derive(Debug, Clone, Copy)]
struct Snapshot {
    rss_bytes: u64,
    mem_used_total_bytes: u64,
    meta_bytes: u64,
    slot_table_bytes: u64,
    handle_table_bytes: u64,
    anon_bytes: u64,
    locked_bytes: u64,
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / MIB as f64)
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

/// The swap reserve the server is started with under `--swap` (`--swap-reserve`).
const SWAP_RESERVE_BYTES: u64 = 64 << 20;

fn memory_follows_the_pool(swap: bool) {
    require("nbdcopy");
    require("qemu-img");
    require("qemu-io");
    let mode = if swap { "--swap" } else { "without --swap" };
    let corpus = Corpus::load(corpus_path()).unwrap();
    let server = start(swap);
    if swap {
        assert!(
            server.log().contains("--swap: memory locked"),
            "{}",
            server.log()
        );
    }
    let image = server.dir().join("fill.raw");
    write_image(&corpus, &image);

    let idle = snapshot(&server);
    let mut held: Vec<RawClient> = (0..HELD_CONNECTIONS)
        .map(|_| RawClient::handshake(&server.socket("zram0"), false).0)
        .collect();
    // One request each: the connection has set up everything it keeps (its buffer pool is made
    // after the handshake's last reply).
    for c in &mut held {
        assert_eq!(c.read(1, 0, 4096).error, 0);
    }
    let connected = snapshot(&server);
    let request_pages = HELD_REQUEST_BYTES / corpus.page_size_bytes();
    for (i, c) in held.iter_mut().enumerate() {
        let offset = (i * HELD_DEPTH * HELD_REQUEST_BYTES) as u64;
        exercise(c, &corpus, offset, i * HELD_DEPTH * request_pages);
    }
    std::thread::sleep(QUIET);
    let worked = snapshot(&server);

    run(Command::new("nbdcopy")
        .arg("--connections=4")
        .arg(&image)
        .arg(server.uri("zram0")));
    // Every page reads back (and the rest of the device as zeroes).
    run(Command::new("qemu-img")
        .args(["compare", "-q", "-f", "raw", "-F", "raw"])
        .arg(&image)
        .arg(server.uri("zram0")));
    std::thread::sleep(QUIET);
    let full = snapshot(&server);

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
    let empty = snapshot(&server);
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
         {HELD_CONNECTIONS} more connections held open:\n\
         \x20 RSS idle {}; per held connection: {} connected, {} after its burst\n\
         \x20 full:  RSS {}  mem_used_total {}  meta_stat {}  anon {}  locked {}\n\
         \x20 empty: RSS {}  mem_used_total {}  meta_stat {}  anon {}  locked {}",
        mib(DISKSIZE_BYTES),
        mib(FILL_BYTES),
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

    // The targets; under --swap, plus what swap mode keeps faulted in on purpose
    // (docs/ublk.md, "Swap on ublk"): the slot table whole, the handle table for a handle per
    // page, the zsmalloc frame reserve and malloc's heap reserve.
    let swap_memory = if swap {
        full.slot_table_bytes
            + full.handle_table_bytes
            + SWAP_RESERVE_BYTES
            + uzram_service::frontend::swap::HEAP_RESERVE_BYTES as u64
    } else {
        0
    };
    let full_limit = full.mem_used_total_bytes * 105 / 100 + FULL_SLACK_BYTES + swap_memory;
    assert!(
        full.rss_bytes <= full_limit,
        "{mode}: RSS {} while full, over mem_used_total {} x 1.05 + 32 MiB",
        mib(full.rss_bytes),
        mib(full.mem_used_total_bytes)
    );
    assert!(
        full.mem_used_total_bytes >= FILL_BYTES / 4,
        "{mode}: the fill holds {} only",
        mib(full.mem_used_total_bytes)
    );
    assert_eq!(empty.mem_used_total_bytes, 0, "{mode}: pages left");
    assert!(
        empty.rss_bytes <= EMPTY_LIMIT_BYTES + swap_memory,
        "{mode}: RSS {} after discard and compact (swap mode's own: {})",
        mib(empty.rss_bytes),
        mib(swap_memory)
    );
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
    drop(held);
}

#[test]
fn memory_follows_the_pool_without_swap() {
    memory_follows_the_pool(false);
}

#[test]
fn memory_follows_the_pool_with_swap() {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(
        uid, 0,
        "--swap locks memory, which needs root (CI runs as root)"
    );
    memory_follows_the_pool(true);
}
