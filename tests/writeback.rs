//! Writeback: attributes and their errnos, every mode and range syntax, read-back (plain and
//! compressed), block release on overwrite/discard/reset, the writeback limit, a slot changed
//! while its write is in flight, and one test per backing failure (EIO in the middle of a
//! batch, ENOSPC from a full bitmap and from the device, torn and short writes, failed reads, a
//! queue that cannot be waited on).

use std::sync::Arc;
use uzram::backing::{
    Backing, Engine, FaultKind, FaultPlan, FaultyBacking, FileBacking, FileOptions, MemBacking,
};
use uzram::device::{Device, DeviceConfig, IdleCutoff};
use uzram::writeback::{WritebackMode, WritebackSpec};
use uzram::ErrorKind;
use uzram_testkit::device::{
    bd, device_over, file_backing, mem_backing, real_tmpdir, writeback_all, DeviceBuilder,
};
use uzram_testkit::hook_backing::HookBacking;
use uzram_testkit::pages::{check_all, fill, identical_or_eio, page, PAGE};
use uzram_testkit::refused::{assert_refused, errno_of};

#[test]
fn attributes_syntax_and_errnos() {
    let dev = Device::new_uninit(PAGE).unwrap();
    assert_eq!(dev.attr_show("backing_dev").unwrap(), "none\n");
    assert_eq!(dev.attr_show("writeback_batch_size").unwrap(), "32\n");
    assert_eq!(dev.attr_show("writeback_limit").unwrap(), "0\n");
    assert_eq!(dev.attr_show("writeback_limit_enable").unwrap(), "0\n");
    assert_eq!(dev.attr_show("compressed_writeback").unwrap(), "0\n");
    assert_eq!(
        dev.attr_show("bd_stat").unwrap(),
        "       0        0        0\n"
    );
    // Uninitialised: writeback is EINVAL, as zram's.
    let e = dev.attr_store("writeback", "idle").unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    for (name, bad) in [
        ("writeback_batch_size", "0"),
        ("writeback_batch_size", "x"),
        ("writeback_batch_size", "4294967296"),
        ("writeback_limit", "-1"),
        ("writeback_limit_enable", "yes"),
        ("compressed_writeback", "maybe"),
    ] {
        let e = dev.attr_store(name, bad).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{name}={bad}: {e}");
    }
    assert_eq!(dev.attr_show("writeback_batch_size").unwrap(), "32\n");
    dev.attr_store("writeback_batch_size", "7\n").unwrap();
    dev.attr_store("writeback_limit", "123\n").unwrap();
    dev.attr_store("writeback_limit_enable", "1\n").unwrap();
    dev.attr_store("compressed_writeback", "1\n").unwrap();
    assert_eq!(dev.attr_show("writeback_batch_size").unwrap(), "7\n");
    assert_eq!(dev.attr_show("writeback_limit").unwrap(), "123\n");
    assert_eq!(dev.attr_show("writeback_limit_enable").unwrap(), "1\n");
    assert_eq!(dev.attr_show("compressed_writeback").unwrap(), "1\n");
    let e = dev
        .attr_store("backing_dev", "/nonexistent/backing\n")
        .unwrap_err();
    assert_eq!(e.errno(), libc::ENOENT);
    let dir = real_tmpdir();
    let path = dir.path().join("bd");
    FileBacking::create(&path, 64 * PAGE as u64, &FileOptions::default()).unwrap();
    dev.attr_store("backing_dev", &format!("{}\n", path.display()))
        .unwrap();
    assert_eq!(
        dev.attr_show("backing_dev").unwrap(),
        format!("{}\n", path.display())
    );
    dev.attr_store("disksize", "64K").unwrap();
    // Settings of the backing store are fixed once initialised.
    let e = dev
        .attr_store("backing_dev", &path.display().to_string())
        .unwrap_err();
    assert_eq!(e.errno(), libc::EBUSY);
    assert_eq!(
        dev.attr_store("compressed_writeback", "0")
            .unwrap_err()
            .errno(),
        libc::EBUSY
    );
    // The limit (enabled, 123 units) is untouched by rejected writebacks.
    assert_refused(
        &[
            (
                libc::EINVAL,
                &["bogus", "type=bogus", "page_indexes=5", "page_index=abc"],
            ),
            (
                libc::ERANGE,
                &["page_index=16", "page_indexes=3-16", "page_indexes=5-3"],
            ),
        ],
        |bad| errno_of(dev.attr_store("writeback", bad)),
        |bad| assert_eq!(dev.attr_show("writeback_limit").unwrap(), "123\n", "{bad}"),
    );
    // reset detaches the backing device, keeps the limit settings (as zram).
    dev.attr_store("reset", "1").unwrap();
    assert_eq!(dev.attr_show("backing_dev").unwrap(), "none\n");
    assert_eq!(dev.attr_show("compressed_writeback").unwrap(), "0\n");
    assert_eq!(dev.attr_show("writeback_limit").unwrap(), "123\n");
    dev.attr_store("disksize", "64K").unwrap();
    let e = dev.attr_store("writeback", "idle").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoDevice);
    assert_eq!(e.errno(), libc::ENODEV);
}

fn writeback_reads_back(backing: Arc<dyn Backing>, compressed: bool) {
    let n = 200;
    let dev = DeviceBuilder::pages(n)
        .backing(backing)
        .compressed_writeback(compressed)
        .build();
    fill(&dev, n, 1);
    let before = dev.stats();
    dev.mark_idle(IdleCutoff::All);
    dev.attr_store("writeback", "idle\n").unwrap();
    let after = dev.stats();
    // Same-filled pages (a quarter) stay in their slots; every other page went out.
    let written = n - n / 4;
    assert_eq!(bd(&dev), [written, 0, written]);
    assert_eq!(after.compr_data_size_bytes, 0);
    assert_eq!(after.huge_pages, 0);
    assert_eq!(after.pages_stored, before.pages_stored);
    assert_eq!(after.same_pages, before.same_pages);
    check_all(&dev, n, 1);
    assert_eq!(bd(&dev), [written, written, written]);
    // A second writeback finds nothing: WB slots are never candidates.
    dev.mark_idle(IdleCutoff::All);
    let r = dev
        .writeback(&WritebackSpec::mode(WritebackMode::Idle))
        .unwrap();
    assert_eq!(r.candidates, 0);
    // Overwrite and discard release blocks; reset releases the rest.
    dev.write_at(&page(0, 2), 0).unwrap();
    dev.discard(PAGE as u64, PAGE as u64).unwrap();
    // A partial write of a WB page reads it back, patches it and stores it in RAM.
    let mut p2 = page(2, 1);
    p2[512..1024].fill(0xAB);
    dev.write_at(&[0xABu8; 512], 2 * PAGE as u64 + 512).unwrap();
    let mut buf = vec![0u8; PAGE];
    dev.read_at(&mut buf, 2 * PAGE as u64).unwrap();
    assert!(buf == p2);
    assert_eq!(bd(&dev)[0], written - 3);
    assert_eq!(dev.stats().pages_stored, before.pages_stored - 1);
    dev.reset();
    assert_eq!(bd(&dev), [0, 0, 0]);
}

#[test]
fn writeback_idle_reads_back_from_memory_backing() {
    writeback_reads_back(mem_backing(1024), false);
}

#[test]
fn compressed_writeback_reads_back() {
    writeback_reads_back(mem_backing(1024), true);
}

#[test]
fn writeback_reads_back_from_file_with_uring_and_sync() {
    for engine in [Engine::Uring, Engine::Sync] {
        let dir = real_tmpdir();
        writeback_reads_back(Arc::new(file_backing(&dir, 1024, engine)), false);
        let dir = real_tmpdir();
        writeback_reads_back(Arc::new(file_backing(&dir, 1024, engine)), true);
    }
}

#[test]
fn modes_and_ranges_select_what_they_say() {
    let n = 64;
    let dev = device_over(n, mem_backing(256));
    fill(&dev, n, 1);
    // huge: only the random pages (i % 4 == 2).
    dev.attr_store("writeback", "huge").unwrap();
    assert_eq!(bd(&dev)[0], n / 4);
    assert_eq!(dev.stats().huge_pages, 0);
    // huge_idle finds nothing more; incompressible finds nothing (no recompression ran).
    dev.mark_idle(IdleCutoff::All);
    dev.attr_store("writeback", "type=huge_idle").unwrap();
    dev.attr_store("writeback", "incompressible").unwrap();
    assert_eq!(bd(&dev)[0], n / 4);
    // page_index: one page (page 0 is compressible text).
    dev.attr_store("writeback", "page_index=0").unwrap();
    assert_eq!(bd(&dev)[0], n / 4 + 1);
    // page_indexes, inclusive, several in one write: 4..=5 and 8..=9 (pages 4, 5, 8, 9).
    dev.attr_store("writeback", "page_indexes=4-5 page_indexes=8-9")
        .unwrap();
    assert_eq!(bd(&dev)[0], n / 4 + 5);
    // Idle marking after an access: only idle pages go. Touch page 12, then idle.
    dev.mark_idle(IdleCutoff::All);
    let mut buf = vec![0u8; PAGE];
    dev.read_at(&mut buf, 12 * PAGE as u64).unwrap();
    dev.attr_store("writeback", "idle").unwrap();
    // Left in RAM: same-filled pages and page 12.
    assert_eq!(bd(&dev)[0], n - n / 4 - 1);
    assert!(dev.stats().compr_data_size_bytes > 0);
    check_all(&dev, n, 1);
}

#[test]
fn largest_objects_go_first() {
    // With a limit of one page, the one written must be the HUGE page (the largest object).
    let dev = device_over(4, mem_backing(16));
    for i in 0..4 {
        dev.write_at(&page(i, 1), i * PAGE as u64).unwrap();
    }
    assert_eq!(dev.stats().huge_pages, 1);
    dev.attr_store("writeback_limit_enable", "1").unwrap();
    dev.attr_store("writeback_limit", "1").unwrap();
    let e = dev.attr_store("writeback", "page_indexes=0-3").unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "limit exhausted");
    assert_eq!(bd(&dev)[0], 1);
    assert_eq!(dev.stats().huge_pages, 0);
    assert_eq!(dev.attr_show("writeback_limit").unwrap(), "0\n");
    // Nothing left in the budget: EIO again, nothing written.
    assert_eq!(
        dev.attr_store("writeback", "page_indexes=0-3")
            .unwrap_err()
            .errno(),
        libc::EIO
    );
    // Raising the limit lets the rest go, half-random (bucket of ~2 KiB) before text.
    dev.attr_store("writeback_limit", "1").unwrap();
    let _ = dev.attr_store("writeback", "page_indexes=0-3");
    let s = dev.stats();
    // Page 1 (half random) went; page 0 (text) stayed.
    let mut buf = vec![0u8; PAGE];
    dev.read_at(&mut buf, PAGE as u64).unwrap();
    assert_eq!(bd(&dev), [2, 1, 2]);
    assert!(s.compr_data_size_bytes > 0 && s.compr_data_size_bytes < 1024);
    dev.attr_store("writeback_limit_enable", "0").unwrap();
    dev.attr_store("writeback", "page_indexes=0-3").unwrap();
    assert_eq!(bd(&dev)[0], 3);
    assert_eq!(dev.attr_show("writeback_limit").unwrap(), "0\n");
    check_all(&dev, 4, 1);
}

#[test]
fn limit_is_charged_per_page_and_stops_with_eio() {
    let n = 100;
    let dev = device_over(n, mem_backing(256));
    fill(&dev, n, 1);
    dev.set_writeback_limit_enable(true);
    dev.set_writeback_limit(10);
    let e = dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap_err();
    assert_eq!(e.errno(), libc::EIO);
    assert_eq!(bd(&dev), [10, 0, 10]);
    assert_eq!(dev.writeback_limit(), 0);
    check_all(&dev, n, 1);
}

/// A device of 8 pages (version 1 written) over a [`HookBacking`] of 64 blocks.
fn hooked_device() -> (Arc<HookBacking>, Arc<Device>) {
    let backing = Arc::new(HookBacking::new(64 * PAGE as u64));
    let dev = Arc::new(device_over(8, backing.clone()));
    fill(&dev, 8, 1);
    (backing, dev)
}

#[test]
fn slot_changed_while_in_flight_keeps_new_data_and_releases_the_block() {
    let (backing, dev) = hooked_device();
    dev.set_writeback_batch_size(1).unwrap();
    dev.set_writeback_limit_enable(true);
    dev.set_writeback_limit(100);
    // While page 0's write is in flight, overwrite page 0 (once).
    let weak = Arc::downgrade(&dev);
    backing.on_first_submit(move |_| {
        let d = weak.upgrade().unwrap();
        d.write_at(&page(0, 2), 0).unwrap();
        // One writeback at a time.
        let e = d.attr_store("writeback", "huge").unwrap_err();
        assert_eq!(e.errno(), libc::EAGAIN);
    });
    let r = dev.writeback(&WritebackSpec::pages(0, 0)).unwrap();
    assert_eq!((r.written, r.changed), (0, 1));
    // The block went back, the charge stayed, the I/O counted.
    assert_eq!(bd(&dev), [0, 0, 1]);
    assert_eq!(dev.writeback_limit(), 99);
    let mut buf = vec![0u8; PAGE];
    dev.read_at(&mut buf, 0).unwrap();
    assert!(buf == page(0, 2));
    backing.on_submit(None);
}

/// A device of `n` pages, version 1 written, over a fault-injecting backing file of 512 blocks
/// (io_uring) in a directory kept as long as the device.
fn faulty_device(n: u64) -> (tempfile::TempDir, Arc<FaultyBacking<FileBacking>>, Device) {
    let dir = real_tmpdir();
    let backing = Arc::new(FaultyBacking::new(file_backing(&dir, 512, Engine::Uring)));
    let dev = device_over(n, backing.clone());
    fill(&dev, n, 1);
    (dir, backing, dev)
}

#[test]
fn eio_in_the_middle_of_a_batch_keeps_pages_in_ram_and_refunds_the_limit() {
    let n = 256;
    let (_dir, backing, dev) = faulty_device(n);
    dev.set_writeback_limit_enable(true);
    dev.set_writeback_limit(10_000);
    // Pool of 32, runs of up to 16: fail the 3rd and 7th writes (each up to 16 pages).
    backing.set_plan(
        FaultPlan::new()
            .fail_write(3, FaultKind::Eio)
            .fail_write(7, FaultKind::Eio),
    );
    let stats_before = dev.stats();
    let r = writeback_all(&dev, n);
    assert_eq!(r.error.as_ref().map(|e| e.errno()), Some(libc::EIO));
    let candidates = n - n / 4;
    assert!(r.failed > 0, "{r:?}");
    assert_eq!(r.written + r.failed, candidates, "{r:?}");
    assert_eq!(bd(&dev), [r.written, 0, r.written]);
    // Refunded: only written pages were charged.
    assert_eq!(dev.writeback_limit(), 10_000 - r.written);
    assert_eq!(dev.stats().pages_stored, stats_before.pages_stored);
    check_all(&dev, n, 1);
    // The failed pages can be written back later.
    backing.clear_plan();
    dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
    assert_eq!(bd(&dev)[0], candidates);
    check_all(&dev, n, 1);
}

#[test]
fn torn_and_short_writes_are_never_success() {
    for kind in [FaultKind::Torn, FaultKind::Short] {
        let n = 64;
        let (_dir, backing, dev) = faulty_device(n);
        // Every write fails this way: nothing may become WB.
        backing.set_plan(FaultPlan::new().fail_writes_randomly(1, kind, 7));
        let e = dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap_err();
        assert_eq!(e.errno(), libc::EIO, "{kind:?}");
        assert_eq!(bd(&dev), [0, 0, 0], "{kind:?}");
        backing.clear_plan();
        check_all(&dev, n, 1);
        // Some writes torn, the rest fine: exactly the fine ones are WB and read back.
        backing.set_plan(FaultPlan::new().fail_writes_randomly(3, kind, 11));
        dev.set_writeback_batch_size(4).unwrap();
        let r = writeback_all(&dev, n);
        assert!(r.failed > 0 && r.written > 0, "{kind:?} {r:?}");
        backing.clear_plan();
        assert_eq!(bd(&dev)[0], r.written);
        check_all(&dev, n, 1);
    }
}

#[test]
fn enospc_from_a_full_bitmap_stops_and_loses_nothing() {
    let n = 100;
    let dev = device_over(n, mem_backing(20));
    fill(&dev, n, 1);
    let e = dev
        .attr_store("writeback", "page_indexes=0-99")
        .unwrap_err();
    assert_eq!(e.errno(), libc::ENOSPC);
    assert_eq!(bd(&dev), [20, 0, 20]);
    check_all(&dev, n, 1);
    // Freeing some blocks makes room again.
    dev.discard(0, 10 * PAGE as u64).unwrap();
    let freed = bd(&dev)[0];
    assert!(freed < 20);
    let e = dev
        .attr_store("writeback", "page_indexes=0-99")
        .unwrap_err();
    assert_eq!(e.errno(), libc::ENOSPC);
    assert_eq!(bd(&dev)[0], 20);
}

#[test]
fn enospc_from_the_device_stops_and_loses_nothing() {
    let n = 128;
    let (_dir, backing, dev) = faulty_device(n);
    backing.set_plan(FaultPlan::new().no_space_after_bytes(40 * PAGE as u64));
    let e = dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace);
    let w = bd(&dev)[0];
    assert!(w > 0 && w <= 40, "{w}");
    backing.clear_plan();
    check_all(&dev, n, 1);
}

#[test]
fn failed_read_back_is_eio_and_changes_nothing() {
    let backing = Arc::new(FaultyBacking::new(
        MemBacking::new(64 * PAGE as u64).unwrap(),
    ));
    let dev = device_over(8, backing.clone());
    fill(&dev, 8, 1);
    dev.writeback(&WritebackSpec::pages(0, 7)).unwrap();
    let before = dev.stats();
    let bd_before = bd(&dev);
    backing.set_plan(FaultPlan::new().fail_read(1));
    let mut buf = vec![0u8; PAGE];
    let e = dev.read_at(&mut buf, 0).unwrap_err();
    assert_eq!(e.errno(), libc::EIO);
    // A partial write of a WB page needs the read too: it fails and changes nothing.
    backing.set_plan(FaultPlan::new().fail_read(1));
    let e = dev.write_at(&[7u8; 512], PAGE as u64).unwrap_err();
    assert_eq!(e.errno(), libc::EIO);
    let after = dev.stats();
    assert_eq!(after.failed_reads, before.failed_reads + 1);
    assert_eq!(after.failed_writes, before.failed_writes + 1);
    assert_eq!(
        (after.pages_stored, after.compr_data_size_bytes),
        (before.pages_stored, before.compr_data_size_bytes)
    );
    assert_eq!(bd(&dev), bd_before);
    check_all(&dev, 8, 1);
}

#[test]
fn backing_must_hold_a_page_and_be_set_before_init() {
    let dev = Device::new_uninit(PAGE).unwrap();
    let tiny = Arc::new(MemBacking::new(4096).unwrap());
    // One page fits: accepted. A 16 KiB-page device needs 16 KiB.
    dev.set_backing(tiny.clone()).unwrap();
    let dev16 = Device::new_uninit(16384).unwrap();
    assert_eq!(dev16.set_backing(tiny).unwrap_err().errno(), libc::EINVAL);
    let d = Device::new(DeviceConfig {
        disksize_bytes: 1 << 20,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(
        d.set_backing(mem_backing(4)).unwrap_err().errno(),
        libc::EBUSY
    );
}

#[test]
fn sixteen_k_pages_write_back_and_count_in_4k_units() {
    let dev = DeviceBuilder::pages(16)
        .page_size(16384)
        .backing(mem_backing(4 * 64))
        .build();
    let mut expect = Vec::new();
    for i in 0..16u64 {
        let p: Vec<u8> = (0..4).flat_map(|k| page(i * 4 + k, 3)).collect();
        dev.write_at(&p, i * 16384).unwrap();
        expect.push(p);
    }
    dev.set_writeback_limit_enable(true);
    dev.set_writeback_limit(4 * 5 + 3);
    let e = dev
        .attr_store("writeback", "page_indexes=0-15")
        .unwrap_err();
    assert_eq!(e.errno(), libc::EIO);
    assert_eq!(bd(&dev), [20, 0, 20]);
    assert_eq!(dev.writeback_limit(), 3);
    for (i, p) in expect.iter().enumerate() {
        let mut buf = vec![0u8; 16384];
        dev.read_at(&mut buf, i as u64 * 16384).unwrap();
        assert!(&buf == p, "page {i}");
    }
    assert_eq!(bd(&dev)[1], 20);
}

#[test]
fn block_reserved_for_a_skipped_candidate_is_released_at_the_end() {
    let (backing, dev) = hooked_device();
    dev.set_writeback_batch_size(1).unwrap();
    // Pages 2 and 6 are both HUGE (same bucket, scan order). While page 2's write is in
    // flight, page 6 is overwritten: when its turn comes it is skipped, and the block the loop
    // had already reserved for it must go back when the loop ends.
    let weak = Arc::downgrade(&dev);
    backing.on_first_submit(move |_| {
        let d = weak.upgrade().unwrap();
        d.write_at(&page(6, 2), 6 * PAGE as u64).unwrap();
    });
    let r = dev
        .writeback(&WritebackSpec::pages(2, 2).and(None, 6, 6))
        .unwrap();
    assert_eq!((r.candidates, r.written, r.skipped), (2, 1, 1), "{r:?}");
    assert_eq!(bd(&dev), [1, 0, 1]);
    backing.on_submit(None);
    let mut buf = vec![0u8; PAGE];
    dev.read_at(&mut buf, 6 * PAGE as u64).unwrap();
    assert!(buf == page(6, 2));
    dev.read_at(&mut buf, 2 * PAGE as u64).unwrap();
    assert!(buf == page(2, 1));
}

/// A queue that cannot be waited on stops the writeback: what was in flight counts as failed and
/// stays in RAM (its locations stay reserved: the kernel might still write them), nothing is
/// lost, and the next writeback works. Both layouts: one engine core.
#[test]
fn a_queue_that_cannot_be_waited_on_stops_the_writeback_and_loses_nothing() {
    for zoned in [false, true] {
        let backing = Arc::new(HookBacking::new(4 << 20));
        backing.fail_next_waits(1);
        let mut dev = DeviceBuilder::pages(64).backing(backing.clone());
        if zoned {
            dev = dev.zoned("1M");
        }
        let dev = dev.build();
        fill(&dev, 64, 1);
        dev.set_writeback_batch_size(4).unwrap();
        let spec = WritebackSpec::pages(0, 63);
        let report = dev.writeback_with_progress(&spec, &mut |_| {}).unwrap();
        let what = if zoned { "zoned" } else { "bitmap" };
        assert_eq!(
            report.error.as_ref().map(|e| e.kind()),
            Some(ErrorKind::Io),
            "{what}"
        );
        assert_eq!(report.written, 0, "{what}");
        // The bitmap engine had its 4 requests in flight; the zoned one its whole stage.
        let in_flight = if zoned { 48 } else { 4 };
        assert_eq!(report.failed, in_flight, "{what}: {report:?}");
        check_all(&dev, 64, 1);
        // The queue works again: the next writeback takes every page (48 are not same-filled).
        let again = dev.writeback(&spec).unwrap();
        assert_eq!(again.written, 48, "{what}");
        check_all(&dev, 64, 1);
        fill(&dev, 64, 2);
        check_all(&dev, 64, 2);
        dev.debug_check_zones();
    }
}

/// The two cases on a file backing, plain and compressed writeback: flip a byte in
/// every 7th written block, then truncate the file below every written block and extend it
/// again. Every page reads back identical or `EIO` (exactly the changed ones), each `EIO`
/// counts in `bd_checksum_errors` and `failed_reads`, nothing else changes, and once the file
/// holds its old bytes again every page reads back identical.
#[test]
fn a_changed_backing_file_reads_as_eio_never_other_data_and_heals() {
    use std::os::unix::fs::FileExt;
    for compressed in [false, true] {
        let dir = real_tmpdir();
        let path = dir.path().join("backing");
        let blocks = 512;
        let backing =
            FileBacking::create(&path, blocks * PAGE as u64, &FileOptions::default()).unwrap();
        let n = 280;
        let dev = DeviceBuilder::pages(n)
            .backing(Arc::new(backing))
            .compressed_writeback(compressed)
            .build();
        assert_eq!(dev.attr_show("bd_checksum_errors").unwrap(), "0\n");
        fill(&dev, n, 1);
        dev.attr_store("writeback", &format!("page_indexes=0-{}", n - 1))
            .unwrap();
        let written = bd(&dev)[0];
        assert_eq!(written, n - n / 4);
        let good = std::fs::read(&path).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let flipped: Vec<u64> = (0..written).filter(|b| b % 7 == 3).collect();
        for &b in &flipped {
            // A byte well inside the block: in a compressed block it may be padding, which the
            // checksum covers too.
            let at = b * PAGE as u64 + 100 + (b * 37) % 3000;
            file.write_at(&[good[at as usize] ^ 0x01], at).unwrap();
        }
        file.sync_all().unwrap();
        let before = dev.stats();
        let failed = identical_or_eio(&dev, n, 1);
        assert_eq!(failed.len(), flipped.len(), "compressed {compressed}");
        let after = dev.stats();
        assert_eq!(after.bd_checksum_errors, flipped.len() as u64);
        assert_eq!(
            after.failed_reads,
            before.failed_reads + flipped.len() as u64
        );
        assert_eq!(
            dev.attr_show("bd_checksum_errors").unwrap(),
            format!("{}\n", flipped.len())
        );
        // Nothing moved: same blocks, same pages stored, same memory.
        assert_eq!(
            (
                after.bd_count,
                after.pages_stored,
                after.compr_data_size_bytes
            ),
            (
                before.bd_count,
                before.pages_stored,
                before.compr_data_size_bytes
            )
        );
        // A partial write of a page that does not verify fails too and changes nothing.
        let e = dev
            .write_at(&[9u8; 512], failed[0] * PAGE as u64 + 512)
            .unwrap_err();
        assert_eq!(e.errno(), libc::EIO);
        // Healed: the file holds what was written again.
        file.write_at(&good, 0).unwrap();
        file.sync_all().unwrap();
        check_all(&dev, n, 1);
        // Truncated below every written block and extended again: zeros where pages were.
        file.set_len(0).unwrap();
        file.set_len(good.len() as u64).unwrap();
        let failed = identical_or_eio(&dev, n, 1);
        assert_eq!(failed.len() as u64, written, "compressed {compressed}");
        assert_eq!(
            dev.stats().bd_checksum_errors,
            (flipped.len() + 1) as u64 + written
        );
        file.write_at(&good, 0).unwrap();
        file.sync_all().unwrap();
        check_all(&dev, n, 1);
        // Overwriting a page drops its block and its checksum with it.
        fill(&dev, n, 2);
        check_all(&dev, n, 2);
        assert_eq!(bd(&dev)[0], 0);
    }
}

/// The checksum lives in the slot: a 16 KiB page's block is checked whole.
#[test]
fn sixteen_k_pages_are_checked_whole() {
    let page16 = 16384;
    let backing = Arc::new(FaultyBacking::new(
        MemBacking::new(64 * page16 as u64).unwrap(),
    ));
    let dev = DeviceBuilder::pages(8)
        .page_size(page16)
        .backing(backing.clone())
        .build();
    let data: Vec<u8> = (0..8 * page16).map(|i| (i * 7 % 253) as u8).collect();
    dev.write_at(&data, 0).unwrap();
    dev.attr_store("writeback", "page_indexes=0-7").unwrap();
    assert_eq!(bd(&dev)[0], 8 * 4);
    // The last byte of the third page's block.
    let at = 3 * page16 as u64 - 1;
    let mut b = [0u8; 512];
    backing.inner().read_at(&mut b, at + 1 - 512).unwrap();
    b[511] ^= 0x80;
    backing.inner().write_at(&b, at + 1 - 512).unwrap();
    let mut buf = vec![0u8; page16];
    for i in 0..8u64 {
        let r = dev.read_at(&mut buf, i * page16 as u64);
        if i == 2 {
            assert_eq!(r.unwrap_err().errno(), libc::EIO);
        } else {
            r.unwrap();
            assert!(buf[..] == data[i as usize * page16..][..page16], "page {i}");
        }
    }
    assert_eq!(dev.stats().bd_checksum_errors, 1);
}
