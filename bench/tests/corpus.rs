//! Snapshots a child process with a known heap and checks what `snapshot_pid` finds, then that
//! the corpus file round-trips.
//!
//! The child is this test binary itself, re-run with `UZRAM_CORPUS_CHILD=1` and a filter that
//! selects `child_heap`: it builds the heap, prints `READY <pid>` and waits for stdin to close.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use uzram::compress::same_filled_word;
use uzram_bench::corpus::{snapshot_pid, Corpus};

/// Pages of the child's marker buffer: every 8-byte word is `MARKER | word index`.
const MARKER_PAGES: usize = 2048;
const MARKER: u64 = 0xc0de_0000_0000_0000;
const CHILD_ENV: &str = "UZRAM_CORPUS_CHILD";

/// Not a real test: the body of the child process (a no-op in a normal test run).
#[test]
fn child_heap() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let marker: Vec<u64> = (0..(MARKER_PAGES * 512) as u64)
        .map(|i| MARKER | i)
        .collect();
    // Some realistic-looking small objects too.
    let strings: Vec<String> = (0..50_000)
        .map(|i| format!("record-{i}-{}", i * 7))
        .collect();
    println!("READY {}", std::process::id());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    std::hint::black_box((&marker, &strings));
}

/// Kills the child however the test ends.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_child() -> (ChildGuard, u32) {
    let exe = std::env::current_exe().unwrap();
    let mut child = ChildGuard(
        Command::new(exe)
            .args(["--exact", "child_heap", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stdout = child.0.stdout.take().unwrap();
    // Read on a thread so a child that never gets ready fails the test instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest may print "test child_heap ... " on the same line first.
            if let Some((_, pid)) = line.split_once("READY ") {
                let _ = tx.send(pid.trim().parse::<u32>().unwrap());
                return;
            }
        }
    });
    let pid = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("child did not print READY");
    (child, pid)
}

fn marker_pages(pages: &[u8]) -> usize {
    pages
        .chunks_exact(4096)
        .filter(|p| {
            p.chunks_exact(8).all(|w| {
                u64::from_ne_bytes(w.try_into().unwrap()) & 0xffff_0000_0000_0000 == MARKER
            })
        })
        .count()
}

#[test]
fn snapshot_of_a_child_finds_its_heap_and_round_trips() {
    let (child, pid) = start_child();
    assert_eq!(pid, child.0.id());

    // Everything: the marker buffer is there, whole (it may start mid-page).
    let mut all = Vec::new();
    let n_all = snapshot_pid(pid, 4096, usize::MAX, &mut all).unwrap();
    assert_eq!(all.len(), n_all * 4096);
    assert!(n_all >= MARKER_PAGES, "only {n_all} pages");
    let found = marker_pages(&all);
    assert!(
        found >= MARKER_PAGES - 1,
        "{found} marker pages of {MARKER_PAGES}"
    );
    // Untouched memory is skipped, so the snapshot is not mostly zero pages.
    let zero = all
        .chunks_exact(4096)
        .filter(|p| same_filled_word(p) == Some(0))
        .count();
    assert!(zero * 2 < n_all, "{zero} zero pages of {n_all}");
    // The small strings are in there too.
    let needle = b"record-4242-29694";
    assert!(all.windows(needle.len()).any(|w| w == needle));

    // A cap: exactly that many pages, spread over the address space (so the marker buffer,
    // a good share of the memory, is sampled but not all of it).
    let cap = 1000;
    let mut some = Vec::new();
    let n = snapshot_pid(pid, 4096, cap, &mut some).unwrap();
    assert_eq!(n, cap);
    let found = marker_pages(&some);
    assert!(
        found > 0 && found < cap,
        "{found} marker pages in a sample of {cap}"
    );

    // 16 KiB pages: whole pages, fewer of them.
    let mut big = Vec::new();
    let n16 = snapshot_pid(pid, 16384, usize::MAX, &mut big).unwrap();
    assert_eq!(big.len(), n16 * 16384);
    assert!(n16 >= MARKER_PAGES / 4 - 1 && n16 <= n_all);

    // The corpus file round-trips.
    let mut corpus = Corpus::new(4096).unwrap();
    corpus.add_source("child", &some).unwrap();
    corpus.add_source("child-again", &all[..4096 * 10]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pages.bin");
    corpus.save(&path).unwrap();
    let back = Corpus::load(&path).unwrap();
    assert_eq!(back, corpus);
    assert_eq!(back.len(), cap + 10);
    assert_eq!(back.sources()[1].name, "child-again");
    assert_eq!(back.page(cap), &all[..4096]);
    drop(child);
}

#[test]
fn snapshot_of_a_missing_process_is_an_error() {
    let mut out = Vec::new();
    // PIDs are below 2^22 on Linux.
    assert!(snapshot_pid(u32::MAX - 1, 4096, 10, &mut out).is_err());
    assert!(out.is_empty());
}
