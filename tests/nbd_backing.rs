//! The NBD backing (`backing_dev = nbd://…`) against real servers: nbdkit's `memory` and
//! `file` plugins and qemu-nbd. The client alone (handshake, sync and queued reads and writes,
//! bad requests), writeback and read-back through the device, and the errors of
//! `backing_dev` for bad URIs and servers that cannot serve.

use std::sync::Arc;
use uzram::backing::{AlignedBuf, Backing, IoOp, NbdBacking, NbdOptions};
use uzram::device::{Device, IdleCutoff};
use uzram::ErrorKind;

mod nbdkit_support;
mod page_support;

use nbdkit_support::NbdServer;
use page_support::{bd, check_all, fill, PAGE};

fn open(uri: &str) -> NbdBacking {
    NbdBacking::open(uri, &NbdOptions::default()).unwrap()
}

/// A block's test pattern.
fn block(i: u64, v: u64) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    for (k, c) in b.chunks_mut(8).enumerate() {
        c.copy_from_slice(&(i * 1_000_003 + v * 7 + k as u64).to_le_bytes());
    }
    b
}

/// Queued writes of every block (runs of 1..4 blocks, shuffled, depth 32), then queued and
/// synchronous reads of them.
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
                a.copy_from_slice(&block(i, 1));
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
    // Queued reads (as GC reads), two blocks each.
    let mut completions = Vec::new();
    for first in (0..blocks).step_by(8) {
        if q.in_flight() == q.depth() {
            completions.extend(q.wait(1).unwrap());
        }
        let bufs = vec![AlignedBuf::new_zeroed(2 * PAGE).unwrap()];
        q.submit(IoOp::read(first * PAGE as u64, bufs, first))
            .unwrap();
    }
    completions.extend(q.wait(usize::MAX).unwrap());
    assert_eq!(completions.len() as u64, blocks / 8);
    for c in completions {
        c.result.unwrap();
        let first = c.op.tag;
        assert!(c.op.bufs[0][..PAGE] == block(first, 1)[..], "block {first}");
    }
    drop(q);
    // Synchronous reads of whole blocks that were written (the first of every run).
    for run in 0..n {
        let mut buf = vec![0u8; PAGE];
        b.read_at(&mut buf, run * 4 * PAGE as u64).unwrap();
        assert!(buf == block(run * 4, 1), "block {}", run * 4);
    }
}

#[test]
fn client_speaks_to_nbdkit_memory_and_qemu_nbd() {
    let server = NbdServer::nbdkit(&["memory", "size=8M"]);
    let b = open(&server.uri());
    assert_eq!(b.size_bytes(), 8 << 20);
    assert_eq!(b.describe(), server.uri());
    // nbdkit's memory plugin allows multi-conn and flush.
    assert_eq!(b.connection_count(), NbdOptions::default().connections);
    assert!(b.has_write_cache());
    queued_round_trip(&b, 2048);
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
    queued_round_trip(&b, 1024);
    b.flush().unwrap();
    drop(b);
    // The bytes reached the file.
    let data = std::fs::read(&file).unwrap();
    assert!(data[..PAGE] == block(0, 1)[..]);
}

fn device_on(uri: &str, pages: u64, compressed: bool) -> Device {
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.attr_store("backing_dev", &format!("{uri}\n")).unwrap();
    assert_eq!(dev.attr_show("backing_dev").unwrap(), format!("{uri}\n"));
    dev.set_compressed_writeback(compressed).unwrap();
    dev.attr_store("disksize", &(pages * PAGE as u64).to_string())
        .unwrap();
    dev
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
    assert_eq!(errno("nbds://127.0.0.1/x"), libc::EOPNOTSUPP);
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
