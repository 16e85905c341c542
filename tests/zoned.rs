//! Zoned writeback through the device (`backing_layout=zoned`): attributes and errnos,
//! write-back and read-back (memory and io_uring file), release on overwrite/discard/reset,
//! GC (the `gc` attribute and the trigger after a writeback) while readers run, a corrupted
//! record read as `EIO`, and faults: write errors (pages stay in RAM, limit refunded), `ENOSPC`
//! (nothing lost), `EIO` in the middle of GC (nothing lost, no zone reset).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use uzram::backing::{
    Backing, Engine, FaultKind, FaultPlan, FaultyBacking, FileBacking, FileOptions, MemBacking,
};
use uzram::device::Device;
use uzram::writeback::{BackingLayout, WritebackSpec};
use uzram::ErrorKind;
use uzram_testkit::device::{bd, writeback_all, zoned_device, DeviceBuilder};
use uzram_testkit::pages::{check, check_all, fill, page, PAGE};

const ZONE: u64 = 1 << 20;

/// Pages of `page` that are not same-filled (the ones writeback takes).
fn stored(n: u64) -> u64 {
    n - n / 4
}

/// `zone_stat` as numbers: empty open full live_bytes writeback_bytes gc_runs
/// gc_bytes_relocated gc_bytes_written (write amplification left out).
fn zone_stat(dev: &Device) -> [u64; 8] {
    let s = dev.attr_show("zone_stat").unwrap();
    let v: Vec<&str> = s.split_whitespace().collect();
    assert_eq!(v.len(), 9, "{s:?}");
    let mut out = [0u64; 8];
    for (o, x) in out.iter_mut().zip(&v) {
        *o = x.parse().unwrap();
    }
    out
}

fn mem_zones(zones: u64) -> Arc<MemBacking> {
    Arc::new(MemBacking::new(zones * ZONE).unwrap())
}

#[test]
fn attributes_syntax_and_errnos() {
    let dev = Device::new_uninit(PAGE).unwrap();
    assert_eq!(dev.attr_show("backing_layout").unwrap(), "bitmap\n");
    assert_eq!(dev.attr_show("zone_size").unwrap(), "268435456\n");
    let e = |r: uzram::Result<()>| r.unwrap_err().errno();
    assert_eq!(e(dev.attr_store("backing_layout", "log")), libc::EINVAL);
    assert_eq!(e(dev.attr_store("zone_size", "0")), libc::EINVAL);
    assert_eq!(e(dev.attr_store("zone_size", "1536K")), libc::EINVAL);
    assert_eq!(e(dev.attr_store("zone_size", "4G")), libc::EINVAL);
    assert_eq!(e(dev.attr_store("zone_size", "x")), libc::EINVAL);
    assert_eq!(dev.attr_show("gc").unwrap_err().errno(), libc::EACCES);
    assert_eq!(e(dev.attr_store("zone_stat", "1")), libc::EACCES);
    // Too few zones for the backing: 4 MiB holds two zones of 2 MiB.
    dev.set_backing(mem_zones(4)).unwrap();
    assert_eq!(e(dev.attr_store("zone_size", "2M")), libc::EINVAL);
    dev.attr_store("zone_size", "1M\n").unwrap();
    assert_eq!(dev.attr_show("zone_size").unwrap(), "1048576\n");
    // With the newline `echo` adds.
    dev.attr_store("backing_layout", "zoned\n").unwrap();
    assert_eq!(dev.attr_show("backing_layout").unwrap(), "zoned\n");
    assert_eq!(
        dev.attr_show("zone_stat").unwrap(),
        "       0        0        0            0            0        0            0            0 1.000\n"
    );
    dev.attr_store("disksize", "1M").unwrap();
    assert_eq!(e(dev.attr_store("backing_layout", "bitmap")), libc::EBUSY);
    assert_eq!(e(dev.attr_store("zone_size", "1M")), libc::EBUSY);
    assert_eq!(zone_stat(&dev)[0], 4, "four empty zones");
    assert_eq!(e(dev.attr_store("gc", "2")), libc::EINVAL);
    assert_eq!(e(dev.attr_store("gc", "yes")), libc::EINVAL);
    dev.attr_store("gc", "1\n").unwrap();
    // Reset restores the defaults.
    dev.attr_store("reset", "1").unwrap();
    assert_eq!(dev.attr_show("backing_layout").unwrap(), "bitmap\n");
    assert_eq!(dev.attr_show("zone_size").unwrap(), "268435456\n");
    // gc without a zoned backing: ENODEV (bitmap layout, or no backing at all).
    dev.set_backing(mem_zones(4)).unwrap();
    dev.attr_store("disksize", "1M").unwrap();
    assert_eq!(e(dev.attr_store("gc", "1")), libc::ENODEV);
    dev.attr_store("reset", "1").unwrap();
    dev.attr_store("disksize", "1M").unwrap();
    assert_eq!(e(dev.attr_store("gc", "1")), libc::ENODEV);
    dev.attr_store("reset", "1").unwrap();
    // A zone size the backing cannot hold three of fails at disksize when the backing came
    // later; the device stays uninitialised.
    dev.attr_store("backing_layout", "zoned").unwrap();
    dev.attr_store("zone_size", "2M").unwrap();
    dev.set_backing(mem_zones(4)).unwrap();
    assert_eq!(e(dev.attr_store("disksize", "1M")), libc::EINVAL);
    assert_eq!(dev.attr_show("initstate").unwrap(), "0\n");
    assert_eq!(dev.backing_layout(), BackingLayout::Zoned);
}

fn writes_back_and_reads_back(backing: Arc<dyn Backing>) {
    let n = 512;
    let dev = zoned_device(n, backing, "1M");
    fill(&dev, n, 1);
    let before = dev.stats();
    let r = writeback_all(&dev, n);
    assert_eq!(r.error, None);
    assert_eq!(r.written, stored(n), "{r:?}");
    // Records are packed: far fewer writes than pages, each stage at least 128 KiB but the
    // last.
    assert!(r.ops * 8 < r.written, "{r:?}");
    let after = dev.stats();
    assert_eq!(after.pages_stored, before.pages_stored);
    assert_eq!(after.compr_data_size_bytes, 0, "every object left the pool");
    assert_eq!(bd(&dev), [stored(n), 0, stored(n)]);
    let zs = zone_stat(&dev);
    assert!(zs[3] > 0 && zs[4] >= zs[3], "{zs:?}");
    check_all(&dev, n, 1);
    assert_eq!(bd(&dev)[1], stored(n));
    dev.debug_check_zones();
    // Overwrite half, discard a quarter: their records are released exactly once.
    for i in (0..n).step_by(2) {
        dev.write_at(&page(i, 2), i * PAGE as u64).unwrap();
    }
    dev.discard(PAGE as u64 * (n / 2), PAGE as u64 * (n / 4))
        .unwrap();
    dev.debug_check_zones();
    for i in 0..n {
        let mut buf = vec![0u8; PAGE];
        dev.read_at(&mut buf, i * PAGE as u64).unwrap();
        let want = if (n / 2..3 * n / 4).contains(&i) {
            vec![0u8; PAGE]
        } else if i % 2 == 0 {
            page(i, 2)
        } else {
            page(i, 1)
        };
        assert!(buf == want, "page {i}");
    }
    // Partial writes of WB pages read the record, patch and store the page in RAM.
    dev.write_at(&[0xabu8; 512], PAGE as u64 + 512).unwrap();
    let mut want = page(1, 1);
    want[512..1024].fill(0xab);
    let mut buf = vec![0u8; PAGE];
    dev.read_at(&mut buf, PAGE as u64).unwrap();
    assert!(buf == want);
    // Everything released: no live bytes, bd_count 0.
    dev.discard(0, n * PAGE as u64).unwrap();
    assert_eq!(bd(&dev)[0], 0);
    assert_eq!(zone_stat(&dev)[3], 0);
    dev.debug_check_zones();
}

#[test]
fn writes_back_and_reads_back_from_memory() {
    writes_back_and_reads_back(mem_zones(8));
}

#[test]
fn writes_back_and_reads_back_from_a_file_with_uring() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap_or_else(|_| tempfile::tempdir().unwrap());
    let file = FileBacking::create(
        dir.path().join("backing"),
        8 * ZONE,
        &FileOptions::with_engine(Engine::Uring),
    )
    .unwrap();
    writes_back_and_reads_back(Arc::new(file));
}

/// Writes back all `n` pages, overwrites `fraction` of them and writes them back again, until
/// zones fill with dead records.
fn churn(dev: &Device, n: u64, rounds: u64) {
    for v in 2..2 + rounds {
        for i in (0..n).filter(|i| i % 3 != 0) {
            dev.write_at(&page(i, v), i * PAGE as u64).unwrap();
        }
        let _ = dev.writeback(&WritebackSpec::pages(0, n - 1));
    }
}

fn expected(i: u64, rounds: u64) -> u64 {
    if i % 3 == 0 {
        1
    } else {
        1 + rounds
    }
}

#[test]
fn gc_reclaims_zones_while_readers_run_and_keeps_every_page() {
    let n = 400;
    let rounds = 4;
    let dev = Arc::new(zoned_device(n, mem_zones(6), "1M"));
    fill(&dev, n, 1);
    dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
    churn(&dev, n, rounds);
    let before = zone_stat(&dev);
    assert!(before[0] >= 2, "no GC ran yet: {before:?}");
    // GC from the attribute while readers check every page and a writer rewrites some (same
    // contents: it releases records GC may be moving, and writes them back again).
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..3 {
            let dev = &dev;
            let stop = &stop;
            s.spawn(move || {
                let mut k = t;
                while !stop.load(Ordering::Relaxed) {
                    let i = k % n;
                    check(dev, i, expected(i, rounds));
                    k += 7;
                }
            });
        }
        let dev = &dev;
        let stop = &stop;
        s.spawn(move || {
            let mut k = 0;
            while !stop.load(Ordering::Relaxed) {
                let i = (k * 21) % n;
                if i % 3 == 0 && i % 7 == 0 {
                    dev.write_at(&page(i, 1), i * PAGE as u64).unwrap();
                    let _ = dev.writeback(&WritebackSpec::pages(i, i));
                }
                k += 1;
            }
        });
        for _ in 0..3 {
            dev.attr_store("gc", "1").unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    let after = zone_stat(&dev);
    assert!(
        after[5] > before[5],
        "GC reclaimed zones: {before:?} -> {after:?}"
    );
    assert!(after[6] > 0, "GC relocated live records: {after:?}");
    assert!(
        after[0] > before[0],
        "more empty zones: {before:?} -> {after:?}"
    );
    for i in 0..n {
        check(&dev, i, expected(i, rounds));
    }
    dev.debug_check_zones();
}

#[test]
fn writeback_triggers_gc_when_zones_run_low() {
    let n = 400;
    let rounds = 6;
    let dev = zoned_device(n, mem_zones(5), "1M");
    fill(&dev, n, 1);
    dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
    churn(&dev, n, rounds);
    let zs = zone_stat(&dev);
    assert!(zs[5] > 0, "writeback ran GC: {zs:?}");
    for i in 0..n {
        check(&dev, i, expected(i, rounds));
    }
    dev.debug_check_zones();
}

#[test]
fn a_corrupted_record_reads_as_eio_through_the_device() {
    let mem = mem_zones(4);
    let dev = zoned_device(8, mem.clone(), "1M");
    fill(&dev, 8, 1);
    dev.writeback(&WritebackSpec::pages(0, 7)).unwrap();
    // Page 2 is random, stored raw: find its record's payload by its stamp.
    let mut zone = vec![0u8; ZONE as usize];
    mem.read_at(&mut zone, 0).unwrap();
    let stamp2 = 2u64.to_le_bytes();
    let raw_at = zone
        .windows(16)
        .position(|w| w[..8] == stamp2 && w[8..16] == 1u64.to_le_bytes())
        .expect("the raw page is in zone 0");
    let mut sector = vec![0u8; 512];
    let sector_off = (raw_at as u64 + 600) / 512 * 512;
    mem.read_at(&mut sector, sector_off).unwrap();
    sector[(raw_at as u64 + 600 - sector_off) as usize] ^= 0x40;
    mem.write_at(&sector, sector_off).unwrap();
    let before = dev.stats();
    let mut buf = vec![0u8; PAGE];
    let e = dev.read_at(&mut buf, 2 * PAGE as u64).unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert_eq!(dev.stats().failed_reads, before.failed_reads + 1);
    assert_eq!(dev.attr_show("bd_checksum_errors").unwrap(), "1\n");
    // The other pages are fine; the bad one can still be overwritten.
    for i in [0, 1, 3, 4, 5, 6, 7] {
        check(&dev, i, 1);
    }
    dev.write_at(&page(2, 1), 2 * PAGE as u64).unwrap();
    check(&dev, 2, 1);
    dev.debug_check_zones();
}

#[test]
fn write_errors_keep_pages_in_ram_and_refund_the_limit() {
    for kind in [FaultKind::Eio, FaultKind::Torn, FaultKind::Short] {
        let backing = Arc::new(FaultyBacking::new(MemBacking::new(8 * ZONE).unwrap()));
        let n = 600;
        let dev = zoned_device(n, backing.clone(), "1M");
        fill(&dev, n, 1);
        dev.set_writeback_limit_enable(true);
        dev.set_writeback_limit(10_000);
        backing.set_plan(FaultPlan::new().fail_write(2, kind));
        let r = writeback_all(&dev, n);
        assert_eq!(
            r.error.as_ref().map(|e| e.kind()),
            Some(ErrorKind::Io),
            "{kind:?}"
        );
        assert!(r.failed > 0 && r.written > 0, "{kind:?}: {r:?}");
        assert_eq!(r.written + r.failed, stored(n), "{kind:?}: {r:?}");
        assert_eq!(dev.writeback_limit(), 10_000 - r.written, "{kind:?}");
        assert_eq!(bd(&dev)[0], r.written);
        check_all(&dev, n, 1);
        dev.debug_check_zones();
        backing.clear_plan();
        dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
        assert_eq!(bd(&dev)[0], stored(n));
        check_all(&dev, n, 1);
    }
}

#[test]
fn enospc_stops_and_loses_nothing() {
    // Three zones: the writer may use two (one is kept for GC); 2000 pages do not fit.
    let n = 2000;
    let dev = zoned_device(n, mem_zones(3), "1M");
    fill(&dev, n, 1);
    let e = dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
    let written = bd(&dev)[0];
    assert!(written > 0 && written < stored(n), "{written}");
    assert_eq!(zone_stat(&dev)[0], 1, "the GC zone stays empty");
    check_all(&dev, n, 1);
    dev.debug_check_zones();
    // Discarding written-back pages lets GC make room for more.
    dev.discard(0, PAGE as u64 * n / 2).unwrap();
    dev.attr_store("gc", "1").unwrap();
    let _ = dev.writeback(&WritebackSpec::pages(n / 2, n - 1));
    assert!(bd(&dev)[0] > 0);
    for i in n / 2..n {
        check(&dev, i, 1);
    }
    dev.debug_check_zones();
}

#[test]
fn eio_in_the_middle_of_gc_loses_nothing_and_resets_no_zone() {
    for plan in [
        // GC of these zones is one chunk per victim (1 MiB scratch buffers): fail the first
        // read or write.
        FaultPlan::new().fail_write(1, FaultKind::Eio),
        FaultPlan::new().fail_write(1, FaultKind::Torn),
        FaultPlan::new().fail_read(1),
    ] {
        // Eight zones: the churn leaves eligible victims without triggering GC by itself.
        let backing = Arc::new(FaultyBacking::new(MemBacking::new(8 * ZONE).unwrap()));
        let n = 400;
        let rounds = 4;
        let dev = zoned_device(n, backing.clone(), "1M");
        fill(&dev, n, 1);
        dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
        churn(&dev, n, rounds);
        let before = zone_stat(&dev);
        assert_eq!(before[5], 0, "no GC ran yet: {before:?}");
        backing.set_plan(plan.clone());
        let e = dev.attr_store("gc", "1").unwrap_err();
        assert_eq!(e.errno(), libc::EIO, "{plan:?}: {e}");
        backing.clear_plan();
        let after = zone_stat(&dev);
        // A victim with nothing live may have been reset before the fault (no I/O needed);
        // the one being moved was not: every live byte is still counted and every page reads
        // back from where its slot points.
        assert_eq!(after[3], before[3], "{plan:?}: live bytes kept");
        for i in 0..n {
            check(&dev, i, expected(i, rounds));
        }
        dev.debug_check_zones();
        dev.attr_store("gc", "1").unwrap();
        assert!(zone_stat(&dev)[6] > 0, "{plan:?}: GC works again");
        for i in 0..n {
            check(&dev, i, expected(i, rounds));
        }
        dev.debug_check_zones();
    }
}

#[test]
fn large_pages_write_back_and_read_back() {
    for ps in [16384usize, 65536] {
        let n = 24u64;
        let dev = DeviceBuilder::pages(n)
            .page_size(ps)
            .backing(mem_zones(4))
            .zoned("1M")
            .build();
        // Random (stored raw: the largest records) and text-like pages, stamped.
        let pages: Vec<Vec<u8>> = (0..n)
            .map(|i| {
                let mut p: Vec<u8> = if i % 2 == 0 {
                    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                    (0..ps)
                        .map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            x as u8
                        })
                        .collect()
                } else {
                    (0..ps).map(|k| b"zoned record "[k % 13]).collect()
                };
                p[..8].copy_from_slice(&i.to_le_bytes());
                p
            })
            .collect();
        for (i, p) in pages.iter().enumerate() {
            dev.write_at(p, i as u64 * ps as u64).unwrap();
        }
        let r = writeback_all(&dev, n);
        assert_eq!(r.written, n, "{ps}: {r:?}");
        assert_eq!(bd(&dev)[0], n * ps as u64 / 4096, "bd_count in 4 KiB units");
        for (i, p) in pages.iter().enumerate() {
            let mut buf = vec![0u8; ps];
            dev.read_at(&mut buf, i as u64 * ps as u64).unwrap();
            assert!(&buf == p, "{ps}: page {i}");
        }
        dev.discard(0, n * ps as u64).unwrap();
        assert_eq!(zone_stat(&dev)[3], 0);
        dev.debug_check_zones();
    }
}

/// The device says ENOSPC part-way: `writeback_bytes` (and so `write_amplification`),
/// `bd_writes` and `bd_count` count only the writes that completed, the writeback limit is
/// refunded for every page that stayed in RAM, and after the first ENOSPC nothing more is
/// written (with one write in flight at a time, exactly one write sees it).
#[test]
fn enospc_from_the_device_counts_only_completed_writes() {
    for batch in [1, 16] {
        let backing = Arc::new(FaultyBacking::new(MemBacking::new(8 * ZONE).unwrap()));
        let n = 1200;
        let dev = zoned_device(n, backing.clone(), "1M");
        fill(&dev, n, 1);
        dev.attr_store("writeback_batch_size", &batch.to_string())
            .unwrap();
        dev.set_writeback_limit_enable(true);
        dev.set_writeback_limit(100_000);
        // Room for a little over 3 stages of 256 KiB.
        backing.set_plan(FaultPlan::new().no_space_after_bytes(800 << 10));
        let r = writeback_all(&dev, n);
        assert_eq!(
            r.error.as_ref().map(|e| e.kind()),
            Some(ErrorKind::NoSpace),
            "{r:?}"
        );
        let zs = zone_stat(&dev);
        let passed = backing.counts().bytes_written;
        assert_eq!(
            zs[4], passed,
            "writeback_bytes counts completed writes: {zs:?}"
        );
        assert!(
            passed > 512 << 10 && passed <= 800 << 10,
            "batch {batch}: {passed}"
        );
        assert!(r.written > 0 && r.written < stored(n), "{r:?}");
        assert_eq!(bd(&dev), [r.written, 0, r.written]);
        assert_eq!(dev.writeback_limit(), 100_000 - r.written);
        if batch == 1 {
            assert_eq!(backing.counts().injected, 1, "nothing written after ENOSPC");
        }
        let wa = dev.attr_show("zone_stat").unwrap();
        assert!(wa.trim_end().ends_with("1.000"), "{wa}");
        check_all(&dev, n, 1);
        dev.debug_check_zones();
    }
}

/// GC reads a victim holding a record whose bytes changed on the device: GC checks every
/// record it moves, counts and logs the mismatch, reads the record again and, still bad, stops
/// with `EIO` without moving anything or resetting the victim (its bytes are the only copy);
/// the page reads as `EIO`, never as other data, and the others stay intact. Once the device
/// holds the right bytes again, the page reads back and GC reclaims the zone.
#[test]
fn gc_verifies_what_it_moves_and_never_destroys_the_only_copy() {
    let n = 600;
    let mem = mem_zones(6);
    let dev = zoned_device(n, mem.clone(), "1M");
    fill(&dev, n, 1);
    dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
    assert!(
        zone_stat(&dev)[2] >= 1,
        "zone 0 is full: {:?}",
        zone_stat(&dev)
    );
    // Keep every other raw page; zone 0 is then mostly dead, a GC victim.
    let kept = |i: u64| i % 8 == 2;
    for i in (0..n).filter(|&i| !kept(i)) {
        dev.discard(i * PAGE as u64, PAGE as u64).unwrap();
    }
    let mut zone = vec![0u8; ZONE as usize];
    mem.read_at(&mut zone, 0).unwrap();
    let (bad, at) = (0..n)
        .filter(|&i| kept(i))
        .find_map(|i| {
            zone.windows(16)
                .position(|w| w[..8] == i.to_le_bytes() && w[8..16] == 1u64.to_le_bytes())
                .map(|at| (i, at as u64))
        })
        .expect("a kept raw page in zone 0");
    let mut sector = vec![0u8; 512];
    let sector_off = (at + 700) / 512 * 512;
    mem.read_at(&mut sector, sector_off).unwrap();
    let good = sector.clone();
    sector[(at + 700 - sector_off) as usize] ^= 0x04;
    mem.write_at(&sector, sector_off).unwrap();
    let before = zone_stat(&dev);
    let e = dev.attr_store("gc", "1").unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    let after = zone_stat(&dev);
    assert_eq!(
        after[5], before[5],
        "no zone reset: {before:?} -> {after:?}"
    );
    // The GC read and its second read both failed verification.
    assert_eq!(dev.stats().bd_checksum_errors, 2);
    let mut buf = vec![0u8; PAGE];
    for i in (0..n).filter(|&i| kept(i)) {
        if i == bad {
            let e = dev.read_at(&mut buf, i * PAGE as u64).unwrap_err();
            assert_eq!(e.errno(), libc::EIO);
        } else {
            check(&dev, i, 1);
        }
    }
    assert_eq!(dev.stats().bd_checksum_errors, 3);
    dev.debug_check_zones();
    // Healed: the page reads back, and GC moves it and reclaims the zone.
    mem.write_at(&good, sector_off).unwrap();
    check(&dev, bad, 1);
    dev.attr_store("gc", "1").unwrap();
    assert!(zone_stat(&dev)[5] > before[5], "{:?}", zone_stat(&dev));
    for i in (0..n).filter(|&i| kept(i)) {
        check(&dev, i, 1);
    }
    assert_eq!(dev.stats().bd_checksum_errors, 3);
    dev.debug_check_zones();
}

/// A read fault of the device while GC reads (one byte of the chunk flipped in transit, the
/// stored bytes intact): GC's check catches it, its second read of the record verifies, and
/// GC moves the good bytes: nothing is lost, the zone is reclaimed. A flip that lands between
/// live records (dead bytes a chunk reads over) is harmless and not counted; the flipped
/// position is a hash of the read's number, so the test moves the GC read along until one
/// lands in a record (deterministic: the same round every run).
#[test]
fn gc_rereads_a_record_corrupted_in_transit() {
    let n = 600;
    let kept = |i: u64| i % 4 == 2;
    let mut caught_in = None;
    for k in 0..16u64 {
        let backing = Arc::new(FaultyBacking::new(MemBacking::new(6 * ZONE).unwrap()));
        let dev = zoned_device(n, backing.clone(), "1M");
        fill(&dev, n, 1);
        dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
        for i in (0..n).filter(|&i| !kept(i)) {
            dev.discard(i * PAGE as u64, PAGE as u64).unwrap();
        }
        let before = zone_stat(&dev);
        backing.set_plan(FaultPlan::new().corrupt_read(k + 1));
        // k clean reads first, so GC's first chunk read is read k + 1.
        for r in 0..k {
            check(&dev, 2 + 4 * r, 1);
        }
        dev.attr_store("gc", "1").unwrap();
        backing.clear_plan();
        let after = zone_stat(&dev);
        assert!(
            after[5] > before[5],
            "GC reclaimed: {before:?} -> {after:?}"
        );
        assert_eq!(backing.counts().injected, 1);
        for i in (0..n).filter(|&i| kept(i)) {
            check(&dev, i, 1);
        }
        dev.debug_check_zones();
        let caught = dev.stats().bd_checksum_errors;
        assert!(caught <= 1, "{caught}");
        if caught == 1 {
            caught_in = Some(k);
            break;
        }
    }
    assert!(
        caught_in.is_some(),
        "no flipped byte landed in a live record"
    );
}
