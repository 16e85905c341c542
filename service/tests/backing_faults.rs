//! Faults of real backing devices, in both layouts: nbdkit's `error` filter (every write, a
//! rate of writes, reads on a trigger file) and `delay` filter behind `nbdfuse -s -C 1` and a
//! loop device; `ENOSPC` from a small tmpfs; byte flips in a zoned backing file. Every case
//! ends by reading every page: identical, or `EIO` where the backing cannot give it back, never
//! other data; and checks that `bd_stat`, `io_stat`, `bd_checksum_errors`, `zone_stat` and the
//! writeback limit add up. (Truncation and flips of a bitmap backing file are in
//! `tests/writeback.rs`; GC over a changed record in `tests/zoned.rs`.)

use std::sync::Arc;
use uzram::backing::{FileBacking, FileOptions};
use uzram::device::Device;
use uzram::writeback::BackingLayout;
use uzram::ErrorKind;
use uzram_testkit::device::{bd, writeback_all, DeviceBuilder};
use uzram_testkit::faults::{NbdBacking, NbdFaults, SmallTmpfs};
use uzram_testkit::pages::{check_all, fill, identical_or_eio, page, PAGE};

const MIB: u64 = 1 << 20;
const LIMIT: u64 = 1_000_000;

/// Pages of `page` that writeback takes (all but the same-filled quarter).
fn stored(n: u64) -> u64 {
    n - n / 4
}

/// A device of `pages` over the backing at `path` (attribute `backing_dev`, as an operator
/// sets it), with 1 MiB zones for the zoned layout, the writeback limit enabled at [`LIMIT`].
fn device(layout: BackingLayout, path: &str, pages: u64) -> Device {
    let dev = DeviceBuilder::pages(pages).backing_dev(path);
    let dev = match layout {
        BackingLayout::Zoned => dev.zoned("1M"),
        _ => dev.attr("backing_layout", layout.name()),
    }
    .build();
    dev.set_writeback_limit_enable(true);
    dev.set_writeback_limit(LIMIT);
    dev
}

/// `zone_stat`'s `writeback_bytes` (0 without a zoned store).
fn writeback_bytes(dev: &Device) -> u64 {
    dev.zone_stats().map_or(0, |z| z.writeback_bytes)
}

/// The books after a writeback that wrote `r.written` pages in total so far: `bd_stat`, the
/// limit, and nothing counted for a failed write.
fn check_books(dev: &Device, written: u64, what: &str) {
    let [count, _, writes] = bd(dev);
    assert_eq!(count, written, "{what}: bd_count");
    assert_eq!(
        writes, written,
        "{what}: bd_writes counts completed writes only"
    );
    assert_eq!(
        dev.writeback_limit(),
        LIMIT - written,
        "{what}: the limit is charged for written pages only"
    );
}

#[test]
fn nbdkit_every_write_failing_then_reads_failing_loses_nothing() {
    for layout in [BackingLayout::Bitmap, BackingLayout::Zoned] {
        let nbd = NbdBacking::start(
            16 * MIB,
            &NbdFaults {
                write_error_percent: 100,
                read_error_percent: 100,
                ..NbdFaults::default()
            },
        );
        let n = 400;
        let dev = device(layout, nbd.path(), n);
        fill(&dev, n, 1);
        let what = format!("{layout:?}");
        // Every write fails: EIO, nothing written, every charge refunded, pages in RAM.
        nbd.fail_writes(true);
        let r = writeback_all(&dev, n);
        assert_eq!(
            r.error.as_ref().map(|e| e.kind()),
            Some(ErrorKind::Io),
            "{what}: {r:?}"
        );
        assert_eq!(r.written, 0, "{what}: {r:?}");
        check_books(&dev, 0, &what);
        assert_eq!(
            writeback_bytes(&dev),
            0,
            "{what}: failed stages count nothing"
        );
        check_all(&dev, n, 1);
        // The device recovers: the same pages go out.
        nbd.fail_writes(false);
        let r = writeback_all(&dev, n);
        assert!(r.error.is_none(), "{what}: {r:?}");
        assert_eq!(r.written, stored(n));
        check_books(&dev, stored(n), &what);
        // Reads fail: exactly the written-back pages are EIO (an I/O error, not a checksum
        // mismatch), the rest read from RAM; nothing changes.
        let before = dev.stats();
        nbd.fail_reads(true);
        let failed = identical_or_eio(&dev, n, 1).len() as u64;
        assert_eq!(failed, stored(n), "{what}");
        if layout == BackingLayout::Zoned {
            // GC cannot read its victims: EIO, nothing moves, no zone is reset.
            dev.discard(0, n / 2 * PAGE as u64).unwrap();
            let zs = dev.zone_stats().unwrap();
            if let Err(e) = dev.attr_store("gc", "1") {
                assert_eq!(e.errno(), libc::EIO, "{e}");
                assert_eq!(dev.zone_stats().unwrap().gc_runs, zs.gc_runs);
            }
        }
        nbd.fail_reads(false);
        let after = dev.stats();
        assert_eq!(after.failed_reads, before.failed_reads + failed, "{what}");
        assert_eq!(after.bd_checksum_errors, 0, "{what}");
        let first = if layout == BackingLayout::Zoned {
            n / 2
        } else {
            0
        };
        for i in first..n {
            uzram_testkit::pages::check(&dev, i, 1);
        }
        dev.attr_store("gc", "1").ok();
        for i in first..n {
            uzram_testkit::pages::check(&dev, i, 1);
        }
        dev.debug_check_zones();
    }
}

#[test]
fn nbdkit_a_rate_of_failing_slow_writes_loses_nothing_and_counts_what_happened() {
    for layout in [BackingLayout::Bitmap, BackingLayout::Zoned] {
        let nbd = NbdBacking::start(
            16 * MIB,
            &NbdFaults {
                write_error_percent: 10,
                write_delay_ms: 2,
                ..NbdFaults::default()
            },
        );
        let n = 600;
        let dev = device(layout, nbd.path(), n);
        dev.attr_store("writeback_batch_size", "4").unwrap();
        fill(&dev, n, 1);
        let what = format!("{layout:?}");
        nbd.fail_writes(true);
        // Rounds of new contents written back until some writes failed (10% of NBD writes:
        // the chance that 20 rounds of at least 4 writes each see none is below 1 in 4000).
        let (mut total, mut errors, mut version) = (0, 0, 1);
        while version <= 20 && (errors == 0 || version < 3) {
            if version > 1 {
                fill(&dev, n, version);
            }
            let r = writeback_all(&dev, n);
            if let Some(e) = &r.error {
                assert_eq!(e.kind(), ErrorKind::Io, "{what}: {r:?}");
                errors += 1;
            }
            total += r.written;
            let [count, _, writes] = bd(&dev);
            assert_eq!(count, r.written, "{what}: bd_count");
            assert_eq!(
                writes, total,
                "{what}: bd_writes counts completed writes only"
            );
            assert_eq!(dev.writeback_limit(), LIMIT - total, "{what}: limit");
            check_all(&dev, n, version);
            version += 1;
        }
        assert!(
            errors > 0,
            "{what}: 10% of writes failed, some writeback saw it"
        );
        nbd.fail_writes(false);
        let before = bd(&dev)[0];
        let r = writeback_all(&dev, n);
        assert!(r.error.is_none(), "{what}: {r:?}");
        assert_eq!(before + r.written, stored(n), "{what}");
        check_all(&dev, n, version - 1);
        if let Some(z) = dev.zone_stats() {
            assert!(
                z.writeback_bytes > 0 && z.write_amplification() >= 1.0,
                "{z:?}"
            );
        }
        dev.debug_check_zones();
    }
}

#[test]
fn enospc_from_a_small_tmpfs_stops_and_loses_nothing() {
    for layout in [BackingLayout::Bitmap, BackingLayout::Zoned] {
        let fs = SmallTmpfs::mount(3 * MIB);
        let path = fs.path("backing");
        // A sparse file larger than the file system holding it.
        FileBacking::create(&path, 16 * MIB, &FileOptions::default()).unwrap();
        let n = 2400;
        let dev = device(layout, path.to_str().unwrap(), n);
        fill(&dev, n, 1);
        let what = format!("{layout:?}");
        let r = writeback_all(&dev, n);
        assert_eq!(
            r.error.as_ref().map(|e| e.kind()),
            Some(ErrorKind::NoSpace),
            "{what}: {r:?}"
        );
        assert!(r.written > 0 && r.written < stored(n), "{what}: {r:?}");
        check_books(&dev, r.written, &what);
        let on_disk = std::fs::metadata(&path).map(|m| {
            use std::os::unix::fs::MetadataExt;
            m.blocks() * 512
        });
        assert!(writeback_bytes(&dev) <= on_disk.unwrap(), "{what}");
        check_all(&dev, n, 1);
        // Room again (pages discarded free blocks; GC reclaims zones): nothing was lost.
        dev.discard(0, n / 2 * PAGE as u64).unwrap();
        if layout == BackingLayout::Zoned {
            dev.attr_store("gc", "1").ok();
        }
        for i in n / 2..n {
            uzram_testkit::pages::check(&dev, i, 1);
        }
        dev.debug_check_zones();
    }
}

/// Byte flips in a zoned backing file (one in every 7th 4 KiB block of what was written):
/// every page identical or `EIO`, each `EIO` a checksum mismatch, and after the file is
/// restored every page reads back.
#[test]
fn flipped_bytes_in_a_zoned_backing_file_are_eio_never_other_data() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let path = dir.path().join("backing");
    FileBacking::create(&path, 8 * MIB, &FileOptions::default()).unwrap();
    let n = 600;
    let dev = device(BackingLayout::Zoned, path.to_str().unwrap(), n);
    fill(&dev, n, 1);
    writeback_all(&dev, n);
    let used = writeback_bytes(&dev);
    let good = std::fs::read(&path).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let mut flipped = 0;
    for b in (0..used / 4096).filter(|b| b % 7 == 3) {
        let at = b * 4096 + 1000;
        file.write_at(&[good[at as usize] ^ 0x20], at).unwrap();
        flipped += 1;
    }
    file.sync_all().unwrap();
    let failed = identical_or_eio(&dev, n, 1).len() as u64;
    assert!(failed > 0 && failed <= flipped, "{failed} of {flipped}");
    let s = dev.stats();
    assert_eq!(s.bd_checksum_errors, failed);
    file.write_at(&good, 0).unwrap();
    file.sync_all().unwrap();
    check_all(&dev, n, 1);
    assert_eq!(dev.stats().bd_checksum_errors, failed);
    dev.debug_check_zones();
}

/// The column names a statistics attribute's documentation gives, in order: the backticked
/// words of its row in `docs/attributes.md` (`bd_stat`), or of its numbered list
/// (`zone_stat`).
fn documented_columns(attr: &str) -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/attributes.md"
    ))
    .unwrap();
    let section = format!("### `{attr}` columns");
    if let Some(at) = doc.find(&section) {
        return doc[at..]
            .lines()
            .skip(1)
            .skip_while(|l| !l.starts_with("1. "))
            .take_while(|l| {
                l.is_empty()
                    || l.starts_with(' ')
                    || l.chars().next().is_some_and(|c| c.is_ascii_digit())
            })
            .filter(|l| l.chars().next().is_some_and(|c| c.is_ascii_digit()))
            .map(|l| l.split('`').nth(1).unwrap().to_string())
            .collect();
    }
    let row = doc
        .lines()
        .find(|l| l.starts_with(&format!("| `{attr}` |")))
        .unwrap_or_else(|| panic!("{attr} is not documented"));
    let shows = row.split('|').nth(3).unwrap();
    shows
        .split('`')
        .nth(1)
        .unwrap()
        .split_whitespace()
        .map(String::from)
        .collect()
}

/// Every counter this issue touches, against its documentation, in both layouts, over a
/// backing that counts what really reached it: the columns are the documented ones, and after
/// failed writes, reads, a failed read and a read answered with other bytes, releases and GC,
/// each value is what the documentation says it counts.
#[test]
fn every_backing_counter_matches_its_documentation() {
    use uzram::backing::{FaultKind, FaultPlan, FaultyBacking, MemBacking};
    assert_eq!(
        documented_columns("bd_stat"),
        ["bd_count", "bd_reads", "bd_writes"]
    );
    assert_eq!(
        documented_columns("io_stat"),
        ["failed_reads", "failed_writes", "0", "notify_free"]
    );
    let zone_cols = [
        "empty",
        "open",
        "full",
        "live_bytes",
        "writeback_bytes",
        "gc_runs",
        "gc_bytes_relocated",
        "gc_bytes_written",
        "write_amplification",
    ];
    assert_eq!(documented_columns("zone_stat"), zone_cols);
    let shown = |dev: &Device, attr: &str| -> Vec<String> {
        dev.attr_show(attr)
            .unwrap()
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    for layout in [BackingLayout::Bitmap, BackingLayout::Zoned] {
        let what = format!("{layout:?}");
        let backing = Arc::new(FaultyBacking::new(MemBacking::new(8 * MIB).unwrap()));
        let dev = Device::new_uninit(PAGE).unwrap();
        dev.set_backing(backing.clone()).unwrap();
        dev.set_backing_layout(layout).unwrap();
        dev.attr_store("zone_size", "1M").unwrap();
        let n = 800;
        dev.attr_store("disksize", &(n * PAGE as u64).to_string())
            .unwrap();
        dev.set_writeback_limit_enable(true);
        dev.set_writeback_limit(LIMIT);
        assert_eq!(shown(&dev, "bd_stat").len(), 3);
        assert_eq!(shown(&dev, "io_stat").len(), 4);
        assert_eq!(shown(&dev, "zone_stat").len(), zone_cols.len());
        assert_eq!(dev.attr_show("bd_checksum_errors").unwrap(), "0\n");
        fill(&dev, n, 1);
        // The third write fails: its pages stay in RAM, and nothing of it is counted.
        backing.set_plan(FaultPlan::new().fail_write(3, FaultKind::Eio));
        let r = writeback_all(&dev, n);
        assert!(
            r.error.is_some() && r.written > 0 && r.failed > 0,
            "{what}: {r:?}"
        );
        let w = r.written;
        let written_bytes = backing.counts().bytes_written;
        let s = dev.stats();
        // bd_count: blocks (pages) on the backing; bd_writes: pages written; bd_reads: none.
        assert_eq!([s.bd_count, s.bd_reads, s.bd_writes], [w, 0, w], "{what}");
        // writeback_limit: 4 KiB units left, charged per page written.
        assert_eq!(
            dev.attr_show("writeback_limit").unwrap(),
            format!("{}\n", LIMIT - w)
        );
        if layout == BackingLayout::Bitmap {
            // A block per page: what reached the device is a page per page written.
            assert_eq!(written_bytes, w * PAGE as u64, "{what}");
        }
        let z = dev.zone_stats().unwrap_or_default();
        if layout == BackingLayout::Zoned {
            // writeback_bytes: exactly the bytes of the stage writes that completed.
            assert_eq!(z.writeback_bytes, written_bytes, "{what}");
            assert_eq!(
                z.empty + z.open + z.full,
                8,
                "{what}: every zone in one state"
            );
            assert!(
                z.live_bytes > 0 && z.live_bytes <= z.writeback_bytes,
                "{z:?}"
            );
            assert_eq!(shown(&dev, "zone_stat")[8], "1.000", "{what}: no GC yet");
        } else {
            assert_eq!(
                z,
                Default::default(),
                "{what}: zone_stat all 0 without a zoned store"
            );
        }
        // bd_reads: pages read back (4 KiB units); a page read from RAM is not one.
        let wb_pages: Vec<u64> = (0..n)
            .filter(|&i| {
                let mut b = vec![0u8; PAGE];
                let before = dev.stats().bd_reads;
                dev.read_at(&mut b, i * PAGE as u64).unwrap();
                assert!(b == page(i, 1));
                dev.stats().bd_reads > before
            })
            .collect();
        assert_eq!(wb_pages.len() as u64, w, "{what}");
        assert_eq!(dev.stats().bd_reads, w);
        // A read the backing fails: failed_reads, no bd_reads, no checksum error.
        let mut buf = vec![0u8; PAGE];
        backing.set_plan(FaultPlan::new().fail_read(1));
        dev.read_at(&mut buf, wb_pages[0] * PAGE as u64)
            .unwrap_err();
        // A read answered with other bytes: failed_reads and bd_checksum_errors.
        backing.set_plan(FaultPlan::new().corrupt_read(1));
        let e = dev
            .read_at(&mut buf, wb_pages[1] * PAGE as u64)
            .unwrap_err();
        assert_eq!(e.errno(), libc::EIO);
        backing.clear_plan();
        let s = dev.stats();
        assert_eq!([s.failed_reads, s.failed_writes], [2, 0], "{what}");
        assert_eq!(shown(&dev, "io_stat")[0], "2");
        assert_eq!(s.bd_reads, w, "{what}: failed reads are not reads back");
        assert_eq!(dev.attr_show("bd_checksum_errors").unwrap(), "1\n");
        // Releases: bd_count drops with every written-back page overwritten or discarded.
        dev.discard(0, n / 2 * PAGE as u64).unwrap();
        let left = wb_pages.iter().filter(|&&i| i >= n / 2).count() as u64;
        assert_eq!(dev.stats().bd_count, left, "{what}");
        if layout == BackingLayout::Zoned {
            let before = dev.zone_stats().unwrap();
            let bytes_before = backing.counts().bytes_written;
            dev.attr_store("gc", "1").unwrap();
            let z = dev.zone_stats().unwrap();
            // GC's counters: what it reclaimed, moved and wrote; writeback_bytes unchanged.
            assert!(z.gc_runs > before.gc_runs, "{before:?} -> {z:?}");
            assert_eq!(z.writeback_bytes, before.writeback_bytes);
            assert_eq!(
                z.gc_bytes_written,
                backing.counts().bytes_written - bytes_before
            );
            assert!(z.gc_bytes_relocated <= z.gc_bytes_written, "{z:?}");
            let wa = (z.writeback_bytes + z.gc_bytes_written) as f64 / z.writeback_bytes as f64;
            assert_eq!(shown(&dev, "zone_stat")[8], format!("{wa:.3}"));
            assert_eq!(
                dev.stats().bd_count,
                left,
                "{what}: GC moves, keeps the count"
            );
        }
        dev.discard(0, n * PAGE as u64).unwrap();
        assert_eq!(dev.stats().bd_count, 0, "{what}");
        if let Some(z) = dev.zone_stats() {
            assert_eq!(z.live_bytes, 0, "{what}");
        }
        dev.debug_check_zones();
    }
}
