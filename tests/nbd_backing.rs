//! The NBD backing (`backing_dev = nbd://…`) against real servers: nbdkit's `memory` and
//! `file` plugins and qemu-nbd. The client alone (handshake, sync and queued reads and writes,
//! bad requests), writeback and read-back through the device, the errors of `backing_dev`
//! for bad URIs and servers that cannot serve, server errors (nbdkit's error filter) and a
//! server killed mid-writeback and started again.

use std::sync::Arc;
use uzram::backing::{AlignedBuf, Backing, IoOp, NbdBacking, NbdOptions};
use uzram::device::{Device, IdleCutoff};
use uzram::writeback::{WritebackMode, WritebackSpec};
use uzram::ErrorKind;
use uzram_testkit::device::{bd, DeviceBuilder};
use uzram_testkit::nbd_servers::NbdServer;
use uzram_testkit::pages::{check_all, fill, identical_or_eio, page, PAGE};

fn open(uri: &str) -> NbdBacking {
    NbdBacking::open(uri, &NbdOptions::default()).unwrap()
}

/// Queued writes of runs of 1..4 blocks (one run in every 4 blocks, shuffled, depth 32), then
/// queued reads of every block into buffers full of junk (a written block reads back as
/// written, one never written as zeros: a hole) and synchronous reads.
fn queued_round_trip(b: &NbdBacking, blocks: u64) {
    let mut order: Vec<u64> = (0..blocks / 4).collect();
    // A fixed permutation (multiplicative, coprime stride).
    let n = order.len() as u64;
    for (k, o) in order.iter_mut().enumerate() {
        *o = (k as u64 * 7919) % n;
    }
    let mut q = b.new_queue(32).unwrap();
    let mut done = 0;
    for (k, run) in order.iter().enumerate() {
        let len = 1 + k as u64 % 4;
        let first = run * 4;
        let bufs = (first..first + len)
            .map(|i| {
                let mut a = AlignedBuf::new_zeroed(PAGE).unwrap();
                a.copy_from_slice(&page(i, 1));
                a
            })
            .collect();
        while q.in_flight() == q.depth() {
            for c in q.wait(1).unwrap() {
                c.result.unwrap();
                done += 1;
            }
        }
        q.submit(IoOp::new(first * PAGE as u64, bufs, first))
            .unwrap();
    }
    for c in q.wait(usize::MAX).unwrap() {
        c.result.unwrap();
        done += 1;
    }
    assert_eq!(done, order.len());
    let written = |i: u64| {
        let k = order.iter().position(|&r| r == i / 4).unwrap() as u64;
        i % 4 < 1 + k % 4
    };
    // Queued reads (as GC reads), eight blocks each in two buffers.
    let mut completions = Vec::new();
    for first in (0..blocks).step_by(8) {
        if q.in_flight() == q.depth() {
            completions.extend(q.wait(1).unwrap());
        }
        let bufs = (0..2)
            .map(|_| {
                let mut a = AlignedBuf::new_zeroed(4 * PAGE).unwrap();
                a.fill(0xAA);
                a
            })
            .collect();
        q.submit(IoOp::read(first * PAGE as u64, bufs, first))
            .unwrap();
    }
    completions.extend(q.wait(usize::MAX).unwrap());
    assert_eq!(completions.len() as u64, blocks / 8);
    for c in completions {
        c.result.unwrap();
        let first = c.op.tag;
        for k in 0..8u64 {
            let got = &c.op.bufs[k as usize / 4][(k as usize % 4) * PAGE..][..PAGE];
            let i = first + k;
            if written(i) {
                assert!(got == &page(i, 1)[..], "block {i}");
            } else {
                assert!(got.iter().all(|&x| x == 0), "block {i} was never written");
            }
        }
    }
    drop(q);
    // Synchronous reads of whole blocks that were written (the first of every run).
    for run in 0..n {
        let mut buf = vec![0u8; PAGE];
        b.read_at(&mut buf, run * 4 * PAGE as u64).unwrap();
        assert!(buf == page(run * 4, 1), "block {}", run * 4);
    }
}

#[test]
fn client_speaks_to_nbdkit_memory_and_qemu_nbd() {
    let server = NbdServer::nbdkit(&["memory", "size=8M"]);
    let b = open(&server.uri());
    assert_eq!(b.size_bytes(), 8 << 20);
    assert_eq!(b.describe(), server.uri());
    // nbdkit's memory plugin allows multi-conn and flush; nbdkit sends structured replies
    // (reads in data chunks).
    assert_eq!(b.connection_count(), NbdOptions::default().connections);
    assert!(b.has_write_cache());
    assert!(b.structured_replies());
    queued_round_trip(&b, 2048);
    let [data, _, errors] = b.chunk_counts();
    assert!(data > 0 && errors == 0, "{:?}", b.chunk_counts());
    // Synchronous vectored and sector-sized writes.
    b.writev_at(&[&[1u8; 512], &[2u8; 1024]], 512).unwrap();
    let mut buf = vec![0u8; 2048];
    b.read_at(&mut buf, 0).unwrap();
    assert!(buf[512..1024].iter().all(|&x| x == 1));
    assert!(buf[1024..2048].iter().all(|&x| x == 2));
    b.flush().unwrap();
    // Bad requests touch nothing and keep the connection.
    for (off, len) in [(1u64, 512usize), (0, 511), (8 << 20, 512)] {
        let e = b.read_at(&mut vec![0u8; len], off).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{off} {len}");
    }
    let mut q = b.new_queue(4).unwrap();
    let op = IoOp::new(8 << 20, vec![AlignedBuf::new_zeroed(PAGE).unwrap()], 0);
    let (e, back) = q.submit(op).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(back.offset, 8 << 20);
    drop(q);
    assert_eq!(b.connects(), b.connection_count() as u64, "no reconnection");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("disk.raw");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    // qemu-nbd advertises multi-conn but takes two clients: the pool stays at two.
    let qemu = NbdServer::qemu_nbd(&file, "wb", 2);
    let b = open(&qemu.uri());
    assert_eq!(b.connection_count(), 2);
    assert_eq!(b.size_bytes(), 4 << 20);
    assert!(b.structured_replies());
    queued_round_trip(&b, 1024);
    // qemu-nbd answers reads of the sparse file's unwritten blocks with hole chunks (the
    // round trip reads pairs of blocks, some never written, and checks the written ones).
    let [data, holes, errors] = b.chunk_counts();
    assert!(
        data > 0 && holes > 0 && errors == 0,
        "{:?}",
        b.chunk_counts()
    );
    b.flush().unwrap();
    drop(b);
    // The bytes reached the file.
    let data = std::fs::read(&file).unwrap();
    assert!(data[..PAGE] == page(0, 1)[..]);
}

/// Without structured replies (nbdkit --no-sr) the client reads simple replies; with them or
/// without, a server's read error (nbdkit's error filter: an error chunk, or a simple error
/// reply) is EIO and ENOSPC on a write stays ENOSPC, on the same connections.
#[test]
fn simple_replies_and_error_chunks() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let (rerr, werr) = (dir.path().join("rerr"), dir.path().join("werr"));
    let filter = |sr: bool| {
        let mut a = vec![
            "--filter=error".to_string(),
            "memory".into(),
            "size=4M".into(),
            "error-pread=EIO".into(),
            "error-pread-rate=100%".into(),
            format!("error-pread-file={}", rerr.display()),
            "error-pwrite=ENOSPC".into(),
            "error-pwrite-rate=100%".into(),
            format!("error-pwrite-file={}", werr.display()),
        ];
        if !sr {
            a.insert(0, "--no-sr".into());
        }
        a
    };
    for sr in [true, false] {
        let args = filter(sr);
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let server = NbdServer::nbdkit(&args);
        let b = open(&server.uri());
        assert_eq!(b.structured_replies(), sr);
        queued_round_trip(&b, 1024);
        std::fs::write(&rerr, b"").unwrap();
        let e = b.read_at(&mut vec![0u8; PAGE], 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        let mut q = b.new_queue(4).unwrap();
        q.submit(IoOp::read(
            0,
            vec![AlignedBuf::new_zeroed(PAGE).unwrap()],
            7,
        ))
        .unwrap();
        let done = q.wait(1).unwrap();
        assert_eq!(done[0].op.tag, 7);
        assert_eq!(done[0].result.as_ref().unwrap_err().kind(), ErrorKind::Io);
        drop(q);
        std::fs::remove_file(&rerr).unwrap();
        std::fs::write(&werr, b"").unwrap();
        let e = b.write_at(&[3u8; PAGE], 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
        std::fs::remove_file(&werr).unwrap();
        let mut buf = vec![0u8; PAGE];
        b.read_at(&mut buf, 0).unwrap();
        assert!(buf == page(0, 1), "the failed write changed nothing");
        let [data, holes, errors] = b.chunk_counts();
        if sr {
            assert!(data > 0 && errors >= 2, "{:?}", b.chunk_counts());
        } else {
            assert_eq!(data + holes + errors, 0);
        }
        assert_eq!(b.connects(), b.connection_count() as u64, "no reconnection");
    }
}

fn device_on(uri: &str, pages: u64, compressed: bool) -> Device {
    let uri = format!("{uri}\n");
    DeviceBuilder::pages(pages)
        .backing_dev(&uri)
        .with(move |d| assert_eq!(d.attr_show("backing_dev").unwrap(), uri))
        .compressed_writeback(compressed)
        .build()
}

fn writeback_round_trip(dev: &Device, pages: u64) {
    fill(dev, pages, 1);
    dev.mark_idle(IdleCutoff::All);
    dev.attr_store("writeback", "idle").unwrap();
    let written = pages - pages / 4;
    assert_eq!(bd(dev), [written, 0, written]);
    assert_eq!(dev.stats().compr_data_size_bytes, 0);
    check_all(dev, pages, 1);
    assert_eq!(bd(dev), [written, written, written]);
    // Overwrites land in RAM and release their blocks.
    fill(dev, pages / 2, 2);
    check_all(dev, pages / 2, 2);
}

#[test]
fn writeback_and_read_back_through_nbdkit_and_qemu_nbd() {
    let pages = 400;
    let mem = NbdServer::nbdkit(&["memory", "size=4M"]);
    writeback_round_trip(&device_on(&mem.uri(), pages, false), pages);
    writeback_round_trip(&device_on(&mem.uri(), pages, true), pages);

    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let file = dir.path().join("backing.raw");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let f = format!("file={}", file.display());
    let nbdkit_file = NbdServer::nbdkit(&["file", &f]);
    writeback_round_trip(&device_on(&nbdkit_file.uri(), pages, false), pages);
    drop(nbdkit_file);

    let qemu = NbdServer::qemu_nbd(&file, "backing", 4);
    let dev = device_on(&qemu.uri(), pages, true);
    writeback_round_trip(&dev, pages);
    dev.reset();
}

#[test]
fn backing_dev_refuses_bad_uris_and_unusable_servers() {
    let dev = Device::new_uninit(PAGE).unwrap();
    let errno = |v: &str| dev.attr_store("backing_dev", v).unwrap_err().errno();
    assert_eq!(errno("nbd+unix:///x"), libc::EINVAL);
    assert_eq!(errno("nbd://host:notaport/x"), libc::EINVAL);
    assert_eq!(errno("nbds://127.0.0.1/x"), libc::EINVAL);
    let dir = tempfile::tempdir().unwrap();
    let nowhere = format!("nbd+unix:///x?socket={}", dir.path().join("none").display());
    assert_eq!(errno(&nowhere), libc::EIO);
    // Nothing listens on port 1.
    assert_eq!(errno("nbd://127.0.0.1:1/x"), libc::EIO);
    // A read-only export, an export that does not exist.
    let ro = NbdServer::nbdkit(&["--readonly", "memory", "size=1M"]);
    assert_eq!(errno(&ro.uri()), libc::EACCES);
    let file = dir.path().join("d.raw");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let q = NbdServer::qemu_nbd(&file, "there", 1);
    let other = format!("nbd+unix:///elsewhere?socket={}", q.socket.display());
    assert_eq!(errno(&other), libc::ENOENT);
    // A too-small export.
    let tiny = NbdServer::nbdkit(&["memory", "size=2048"]);
    assert_eq!(errno(&tiny.uri()), libc::EINVAL);
    assert_eq!(dev.attr_show("backing_dev").unwrap(), "none\n");
    // Once initialised: EBUSY before the URI is looked at.
    let mem = NbdServer::nbdkit(&["memory", "size=1M"]);
    dev.attr_store("backing_dev", &mem.uri()).unwrap();
    dev.attr_store("disksize", "1M").unwrap();
    assert_eq!(errno(&mem.uri()), libc::EBUSY);
    let _ = Arc::new(());
}

fn raw_file(dir: &tempfile::TempDir, bytes: u64) -> std::path::PathBuf {
    let file = dir.path().join("backing.raw");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(bytes)
        .unwrap();
    file
}

/// nbdkit's error filter fails writes, then reads, on demand (while a trigger file exists):
/// failed writes keep their pages in RAM and refund the limit; failed reads are EIO and change
/// nothing; both work again once the errors stop, on the same connections.
#[test]
fn server_errors_keep_pages_in_ram_and_writeback_resumes() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let file = raw_file(&dir, 4 << 20);
    let (werr, rerr) = (dir.path().join("werr"), dir.path().join("rerr"));
    let args = [
        "--filter=error".to_string(),
        "file".into(),
        format!("file={}", file.display()),
        "error-pwrite=EIO".into(),
        "error-pwrite-rate=100%".into(),
        format!("error-pwrite-file={}", werr.display()),
        "error-pread=EIO".into(),
        "error-pread-rate=100%".into(),
        format!("error-pread-file={}", rerr.display()),
    ];
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let server = NbdServer::nbdkit(&args);
    let n = 256;
    let dev = device_on(&server.uri(), n, false);
    fill(&dev, n, 1);
    dev.set_writeback_limit_enable(true);
    dev.set_writeback_limit(10_000);
    let stats = dev.stats();

    std::fs::write(&werr, b"").unwrap();
    dev.mark_idle(IdleCutoff::All);
    let r = dev
        .writeback_with_progress(&WritebackSpec::mode(WritebackMode::Idle), &mut |_| {})
        .unwrap();
    assert_eq!(
        r.error.as_ref().map(|e| e.errno()),
        Some(libc::EIO),
        "{r:?}"
    );
    assert_eq!(r.written, 0, "{r:?}");
    assert!(r.failed > 0, "{r:?}");
    assert_eq!(bd(&dev), [0, 0, 0]);
    assert_eq!(dev.writeback_limit(), 10_000);
    assert_eq!(
        dev.stats().compr_data_size_bytes,
        stats.compr_data_size_bytes
    );
    check_all(&dev, n, 1);

    std::fs::remove_file(&werr).unwrap();
    dev.mark_idle(IdleCutoff::All);
    dev.attr_store("writeback", "idle").unwrap();
    let written = n - n / 4;
    assert_eq!(bd(&dev), [written, 0, written]);
    assert_eq!(dev.writeback_limit(), 10_000 - written);

    std::fs::write(&rerr, b"").unwrap();
    assert_eq!(identical_or_eio(&dev, n, 1).len() as u64, written);
    assert_eq!(bd(&dev), [written, 0, written]);
    std::fs::remove_file(&rerr).unwrap();
    check_all(&dev, n, 1);
    assert_eq!(bd(&dev), [written, written, written]);
}

/// The server is killed in the middle of a writeback: the pages not yet written stay in RAM
/// (usable, as are all RAM pages while the server is gone; written-back pages are EIO), the
/// limit is refunded for them, writebacks fail fast; once the server is back (same file, same
/// socket) the client reconnects, every page reads back and writeback resumes.
#[test]
fn server_killed_mid_writeback_then_back() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let file = raw_file(&dir, 8 << 20);
    let f = format!("file={}", file.display());
    let server = NbdServer::nbdkit(&["file", &f]);
    let uri = server.uri();
    let n = 1024;
    let dev = device_on(&uri, n, false);
    dev.attr_store("writeback_batch_size", "8").unwrap();
    fill(&dev, n, 1);
    dev.set_writeback_limit_enable(true);
    dev.set_writeback_limit(100_000);
    dev.mark_idle(IdleCutoff::All);
    let mut server = Some(server);
    let mut sockdir = None;
    let r = dev
        .writeback_with_progress(&WritebackSpec::mode(WritebackMode::Idle), &mut |p| {
            if p.written >= 64 {
                if let Some(s) = server.take() {
                    sockdir = Some(s.kill());
                }
            }
        })
        .unwrap();
    let sockdir = sockdir.expect("killed mid-writeback");
    let candidates = n - n / 4;
    assert_eq!(
        r.error.as_ref().map(|e| e.errno()),
        Some(libc::EIO),
        "{r:?}"
    );
    assert!(r.written >= 64 && r.written < candidates, "{r:?}");
    assert_eq!(bd(&dev)[0], r.written);
    assert_eq!(dev.writeback_limit(), 100_000 - r.written);

    // Gone: RAM pages read and write; written-back pages are EIO; writeback fails at once.
    assert_eq!(identical_or_eio(&dev, n, 1).len() as u64, r.written);
    dev.write_at(&uzram_testkit::pages::page(3, 1), 3 * PAGE as u64)
        .unwrap();
    let start = std::time::Instant::now();
    dev.mark_idle(IdleCutoff::All);
    let e = dev.attr_store("writeback", "idle").unwrap_err();
    assert_eq!(e.errno(), libc::EIO);
    assert!(start.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(bd(&dev)[0], r.written);

    // Back, on the same socket and file: reads come back after the backoff.
    let back = NbdServer::nbdkit_in(sockdir, &["file", &f]);
    assert_eq!(back.uri(), uri);
    let start = std::time::Instant::now();
    while !identical_or_eio(&dev, n, 1).is_empty() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "no reconnection"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    dev.mark_idle(IdleCutoff::All);
    dev.attr_store("writeback", "idle").unwrap();
    assert_eq!(bd(&dev)[0], candidates);
    check_all(&dev, n, 1);
}

/// A server that stalls (nbdkit's delay filter holds writes for 30 s) misses the request
/// deadline: the write fails with EIO within the deadline and a tick, queued or synchronous;
/// reads work again on a new connection.
#[test]
fn a_stalled_server_misses_its_deadline() {
    use std::time::{Duration, Instant};
    let s = NbdServer::nbdkit(&["--filter=delay", "memory", "size=1M", "delay-write=30"]);
    let opts = NbdOptions {
        request_timeout: Duration::from_secs(1),
        backoff_min: Duration::from_millis(50),
        // One connection: the next request after the deadline must reconnect.
        connections: 1,
        ..NbdOptions::default()
    };
    let b = NbdBacking::open(&s.uri(), &opts).unwrap();
    let start = Instant::now();
    let e = b.write_at(&[7u8; PAGE], 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );

    let read_again = || {
        let start = Instant::now();
        let mut buf = vec![1u8; PAGE];
        while b.read_at(&mut buf, 0).is_err() {
            assert!(start.elapsed() < Duration::from_secs(10), "no reconnection");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            buf.iter().all(|&x| x == 0),
            "the stalled write never happened"
        );
    };
    read_again();
    let mut q = b.new_queue(4).unwrap();
    let start = Instant::now();
    let mut buf = AlignedBuf::new_zeroed(PAGE).unwrap();
    buf.fill(9);
    q.submit(IoOp::new(0, vec![buf], 5)).unwrap();
    let done = q.wait(1).unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].op.tag, 5);
    assert_eq!(done[0].result.as_ref().unwrap_err().kind(), ErrorKind::Io);
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
    drop(q);
    read_again();
    assert!(b.connects() > b.connection_count() as u64);
}

/// Bytes the export at `uri` holds as data (not holes), from `nbdinfo --map`.
fn allocated_bytes(uri: &str) -> u64 {
    let out = std::process::Command::new("nbdinfo")
        .args(["--map", uri])
        .output()
        .expect("nbdinfo must be installed (scripts/debian-packages.txt)");
    assert!(out.status.success(), "{out:?}");
    let mut data = 0;
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (len, kind): (u64, u32) = (f[1].parse().unwrap(), f[2].parse().unwrap());
        if kind & 1 == 0 {
            data += len;
        }
    }
    data
}

/// The zoned layout over NBD: every zone GC resets is trimmed on the server, whole and at its
/// start (nbdkit's log filter shows the requests), and the server gives the space back
/// (`nbdinfo --map` of the memory plugin: the empty zones hold no data).
#[test]
fn zoned_gc_trims_reset_zones_on_the_server() {
    const ZONE: u64 = 1 << 20;
    let zones = 6;
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let log = dir.path().join("nbdkit.log");
    let logfile = format!("logfile={}", log.display());
    let size = format!("size={}", zones * ZONE);
    let server = NbdServer::nbdkit(&["--filter=log", "memory", &size, &logfile]);
    let n = 400;
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.attr_store("backing_dev", &server.uri()).unwrap();
    dev.attr_store("backing_layout", "zoned").unwrap();
    dev.attr_store("zone_size", "1M").unwrap();
    dev.attr_store("disksize", &(n * PAGE as u64).to_string())
        .unwrap();
    fill(&dev, n, 1);
    dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
    let written = allocated_bytes(&server.uri());
    assert!(written > 0, "{written}");
    // Overwrite two pages in three and write them back, four times: zones fill with dead
    // records (writeback starts GC itself when zones run low).
    let version = |i: u64| if i % 3 == 0 { 1 } else { 5 };
    for v in 2..=5 {
        for i in (0..n).filter(|i| i % 3 != 0) {
            dev.write_at(&uzram_testkit::pages::page(i, v), i * PAGE as u64)
                .unwrap();
        }
        let _ = dev.writeback(&WritebackSpec::pages(0, n - 1));
    }
    dev.attr_store("gc", "1").unwrap();
    let stat = dev.attr_show("zone_stat").unwrap();
    let stat: Vec<u64> = stat
        .split_whitespace()
        .take(8)
        .map(|x| x.parse().unwrap())
        .collect();
    let (empty, gc_runs) = (stat[0], stat[5]);
    assert!(gc_runs > 0, "GC reclaimed no zone: {stat:?}");
    let allocated = allocated_bytes(&server.uri());
    assert!(
        allocated <= (zones - empty) * ZONE,
        "{allocated} bytes held on the server with {empty} of {zones} zones empty: {stat:?}"
    );
    let log = std::fs::read_to_string(&log).unwrap();
    let hex = |line: &str, key: &str| {
        let v = line.split(key).nth(1).unwrap().split_whitespace().next();
        u64::from_str_radix(v.unwrap().trim_start_matches("0x"), 16).unwrap()
    };
    let trims: Vec<(u64, u64)> = log
        .lines()
        .filter(|l| l.contains(" Trim id="))
        .map(|l| (hex(l, " offset="), hex(l, " count=")))
        .collect();
    assert!(
        trims.len() as u64 >= gc_runs,
        "{trims:?} for {gc_runs} resets"
    );
    for (offset, count) in &trims {
        assert!(
            offset % ZONE == 0 && *count == ZONE,
            "{offset:#x} {count:#x}"
        );
    }
    for i in 0..n {
        uzram_testkit::pages::check(&dev, i, version(i));
    }
}

/// A reconnection blocks only the call that makes it: while one call waits on a server that
/// accepts but never answers the handshake (a listening socket nobody serves), another call
/// fails with EIO within about a second instead of waiting out the handshake deadline. Once a
/// server is back, calls work again.
#[test]
fn a_reconnection_blocks_no_other_call() {
    use std::time::{Duration, Instant};
    let server = NbdServer::nbdkit(&["memory", "size=1M"]);
    let opts = NbdOptions {
        request_timeout: Duration::from_secs(4),
        backoff_min: Duration::from_millis(10),
        connections: 1,
        ..NbdOptions::default()
    };
    let b = NbdBacking::open(&server.uri(), &opts).unwrap();
    b.write_at(&page(0, 1), 0).unwrap();
    let socket = server.socket.clone();
    let dir = server.kill();
    // The reader sees the connection close; a silent listener takes the socket's place.
    std::fs::remove_file(&socket).unwrap();
    let silent = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    std::thread::scope(|s| {
        let reconnecting = s.spawn(|| {
            let start = Instant::now();
            let e = b.read_at(&mut vec![0u8; PAGE], 0).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Io, "{e}");
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(300));
        let start = Instant::now();
        let e = b.read_at(&mut vec![0u8; PAGE], 0).unwrap_err();
        let other = start.elapsed();
        assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        assert!(other < Duration::from_millis(2500), "{other:?}: {e}");
        let blocked = reconnecting.join().unwrap();
        assert!(blocked >= Duration::from_secs(3), "{blocked:?}");
    });
    drop(silent);
    let _back = NbdServer::nbdkit_in(dir, &["memory", "size=1M"]);
    let start = Instant::now();
    let mut buf = vec![1u8; PAGE];
    while b.read_at(&mut buf, 0).is_err() {
        assert!(start.elapsed() < Duration::from_secs(10), "no reconnection");
        std::thread::sleep(Duration::from_millis(50));
    }
    // A new memory export: empty.
    assert!(buf.iter().all(|&x| x == 0));
}

/// `nbds://` and `nbds+unix://` against nbdkit --tls=require with x509 certificates (made with
/// openssl) that also demands a client certificate (--tls-verify-peer): the client alone and
/// writeback through the device over TLS, on a unix socket and on TCP; the errors: no client
/// certificate or a CA that did not sign the server's (the TLS handshake fails: EIO), plain
/// NBD to a server requiring TLS and TLS to a server without it (EOPNOTSUPP), a certificate
/// directory that does not exist (EINVAL), TLS-PSK (EOPNOTSUPP).
#[test]
fn tls_to_nbdkit_with_certificates() {
    let creds = uzram_testkit::tls::make_creds();
    let certs = format!("--tls-certificates={}", creds.server().display());
    let tls_args = ["--tls=require", &certs, "--tls-verify-peer"];
    let server = NbdServer::nbdkit(&[&tls_args[..], &["memory", "size=8M"]].concat());
    let unix = |dir: &std::path::Path| {
        format!(
            "nbds+unix:///?socket={}&tls-certificates={}",
            server.socket.display(),
            dir.display()
        )
    };
    let b = open(&unix(&creds.client()));
    assert!(b.is_tls() && b.structured_replies());
    queued_round_trip(&b, 2048);
    b.flush().unwrap();
    drop(b);
    let pages = 400;
    writeback_round_trip(&device_on(&unix(&creds.client()), pages, true), pages);

    let (tcp, port) = NbdServer::nbdkit_tcp(&[&tls_args[..], &["memory", "size=8M"]].concat());
    let uri = format!(
        "nbds://127.0.0.1:{port}/?tls-certificates={}",
        creds.client().display()
    );
    let b = open(&uri);
    assert_eq!(b.connection_count(), NbdOptions::default().connections);
    queued_round_trip(&b, 2048);
    drop(b);
    writeback_round_trip(&device_on(&uri, pages, false), pages);
    drop(tcp);

    let dev = Device::new_uninit(PAGE).unwrap();
    let errno = |v: &str| dev.attr_store("backing_dev", v).unwrap_err().errno();
    assert_eq!(errno(&unix(&creds.anonymous())), libc::EIO);
    let other = uzram_testkit::tls::make_creds();
    assert_eq!(errno(&unix(&other.client())), libc::EIO);
    assert_eq!(errno(&server.uri()), libc::EOPNOTSUPP);
    assert_eq!(
        errno(&unix(std::path::Path::new("/nonexistent"))),
        libc::EINVAL
    );
    let psk = format!("{}&tls-psk-file=/k", unix(&creds.client()));
    assert_eq!(errno(&psk), libc::EOPNOTSUPP);
    let plain = NbdServer::nbdkit(&["memory", "size=1M"]);
    let to_plain = format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        plain.socket.display(),
        creds.client().display()
    );
    assert_eq!(errno(&to_plain), libc::EOPNOTSUPP);
    assert_eq!(dev.attr_show("backing_dev").unwrap(), "none\n");
}

/// `nbds://` with the keys nbdkit takes: a server and a client certificate on RSA keys of
/// 2432 bits (PKCS#8) and 2304 bits (PKCS#1), against nbdkit --tls-verify-peer; a client key
/// the TLS library cannot sign with (RSA of 1024 bits) is refused with EINVAL naming
/// client-key.pem and what the key is, and the device keeps no backing.
#[test]
fn tls_client_keys_of_the_sizes_nbdkit_takes() {
    use uzram_testkit::tls::{make_creds_with, KeyKind};
    for kind in [KeyKind::Rsa(2432), KeyKind::RsaPkcs1(2304)] {
        let creds = make_creds_with(kind);
        let certs = format!("--tls-certificates={}", creds.server().display());
        let server =
            NbdServer::nbdkit(&["--tls=require", &certs, "--tls-verify-peer", "memory", "8M"]);
        let uri = format!(
            "nbds+unix:///?socket={}&tls-certificates={}",
            server.socket.display(),
            creds.client().display()
        );
        let b = open(&uri);
        assert!(b.is_tls(), "{kind:?}");
        queued_round_trip(&b, 256);
    }
    let creds = make_creds_with(KeyKind::RsaPkcs1(1024));
    let uri = format!(
        "nbds+unix:///?socket=/nonexistent.sock&tls-certificates={}",
        creds.client().display()
    );
    let dev = Device::new_uninit(PAGE).unwrap();
    let e = dev.attr_store("backing_dev", &uri).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    let key = creds.client().join("client-key.pem");
    assert!(
        e.to_string()
            .contains(&format!("{}: an RSA key of 1024 bits", key.display())),
        "{e}"
    );
    assert_eq!(dev.attr_show("backing_dev").unwrap(), "none\n");
}
