//! Zoned writeback on a real kernel zoned block device: a host-managed zoned `null_blk` in a
//! VM (see `uzram_testkit::vm`). The device's own zones are used: the layout and zone size
//! follow from the device, zones left dirty by an earlier user are reset at setup, writes
//! reach each zone in write-pointer order (the device refuses anything else), GC resets the
//! zones it empties and finishes the ones it stops writing, and every page reads back
//! identical through writeback, overwrite, discard, GC with readers running, a restart
//! (recovery from the state files, the device's zones kept) and reset. After each phase the
//! store's idea of every zone is checked against the device's zone report.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use uzram_testkit::pages::{check, fill, page, PAGE};
use uzram_testkit::vm::zoned_device_or_boot;

use uzram::backing::{Backing, Engine, FileBacking, FileOptions, ZoneKind};
use uzram::device::Device;
use uzram::writeback::WritebackSpec;
use uzram::ErrorKind;

fn open(path: &Path) -> Arc<FileBacking> {
    Arc::new(FileBacking::open(path, &FileOptions::with_engine(Engine::Uring)).unwrap())
}

fn zone_stat(dev: &Device) -> Vec<u64> {
    let s = dev.attr_show("zone_stat").unwrap();
    s.split_whitespace()
        .take(8)
        .map(|x| x.parse().unwrap())
        .collect()
}

/// Version of page `i` after `rounds` of [`churn`].
fn expected(i: u64, rounds: u64) -> u64 {
    if i % 3 == 0 {
        1
    } else {
        1 + rounds
    }
}

fn setup(backing: &Arc<FileBacking>, pages: u64) -> Device {
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.set_backing(backing.clone()).unwrap();
    dev.attr_store("disksize", &(pages * PAGE as u64).to_string())
        .unwrap();
    dev
}

fn exercise(path: &Path) {
    let backing = open(path);
    let g = backing
        .zone_geometry()
        .cloned()
        .expect("the VM's device is zoned");
    let zone = g.zone_size_bytes;
    eprintln!("{}: {g:?}", path.display());
    let report = backing.report_zones().unwrap();
    let seq: Vec<usize> = (0..report.len())
        .filter(|&i| report[i].kind != ZoneKind::Conventional)
        .collect();

    // Leave the first two sequential zones dirty, as an earlier user would have: setup resets
    // them.
    let block = uzram::backing::AlignedBuf::from_slice(&[0x5a; 4096]).unwrap();
    for &i in &seq[..2] {
        backing.write_at(&block, report[i].start_bytes).unwrap();
    }
    // And the device refuses a write away from the write pointer: it really is zoned.
    let e = backing
        .write_at(&block, report[seq[2]].start_bytes + 8192)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    assert!(!backing.report_zones().unwrap()[seq[0]].empty);

    // The layout and zone size follow from the device; other values are EINVAL.
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.set_backing(backing.clone()).unwrap();
    assert_eq!(dev.attr_show("backing_layout").unwrap(), "zoned\n");
    assert_eq!(dev.attr_show("zone_size").unwrap(), format!("{zone}\n"));
    let e = dev.attr_store("backing_layout", "bitmap").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let e = dev
        .attr_store("zone_size", &(2 * zone).to_string())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    dev.attr_store("zone_size", &zone.to_string()).unwrap();
    drop(dev);

    // A quarter of the device's capacity rewritten per round (two thirds of the pages, a
    // little over 2 KiB each compressed): six rounds write the device over one and a half
    // times, so zones fill, GC reclaims them, and zones are left short of their capacity
    // (finished on the device). Pages live: under a third of the device.
    let usable = g.zone_capacity_bytes * report.len() as u64;
    let n = usable / 6000;
    let dev = Arc::new(setup(&backing, n));
    for &i in &seq[..2] {
        assert!(
            backing.report_zones().unwrap()[i].empty,
            "zone {i} was reset at setup"
        );
    }
    fill(&dev, n, 1);
    let r = dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
    assert_eq!(r.error, None, "{r:?}");
    assert!(r.written > n / 2, "{r:?}");
    dev.debug_check_zones();
    for i in 0..n {
        check(&dev, i, 1);
    }

    // Rewrite two thirds of the pages and write them back, six times, while a reader checks
    // the pages that do not change and GC runs from the attribute.
    let rounds = 6;
    let stop = AtomicBool::new(false);
    /// Stops the reader however the scope's body ends (a failed assertion must not leave it
    /// spinning while the scope waits for it).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        {
            let dev = &dev;
            let stop = &stop;
            s.spawn(move || {
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    let i = k % n;
                    // Pages kept at version 1 never change; the others may be mid-rewrite.
                    if i % 3 == 0 {
                        check(dev, i, 1);
                    }
                    k += 5;
                }
            });
        }
        for v in 2..2 + rounds {
            for i in (0..n).filter(|i| i % 3 != 0) {
                dev.write_at(&page(i, v), i * PAGE as u64).unwrap();
            }
            let r = dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
            assert_eq!(r.error, None, "round {v}: {r:?}");
            dev.attr_store("gc", "1").unwrap();
        }
    });
    let zs = zone_stat(&dev);
    eprintln!("zone_stat after churn: {zs:?}");
    assert!(zs[5] > 0, "GC reclaimed zones: {zs:?}");
    assert!(zs[6] > 0, "GC relocated records: {zs:?}");
    dev.debug_check_zones();
    for i in 0..n {
        check(&dev, i, expected(i, rounds));
    }

    // Discard half; GC again; everything left reads back.
    dev.discard(0, n / 2 * PAGE as u64).unwrap();
    dev.attr_store("gc", "1").unwrap();
    dev.debug_check_zones();
    for i in n / 2..n {
        check(&dev, i, expected(i, rounds));
    }

    // A restart: a new device recovered from the state files over the same zoned device
    // (`docs/restart.md`). The zones come back from the slots, the device's zones holding
    // records finished, the others reset; every page reads back, and writeback and GC go on.
    dev.flush_deferred();
    let files = dev.state_files().unwrap();
    let (zones_before, bd_before) = (zone_stat(&dev), dev.attr_show("bd_stat").unwrap());
    drop(dev);
    let (dev, _) = Device::recover_with(
        files,
        uzram::device::restart::Recover {
            backing: Some(backing.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    dev.debug_check_zones();
    assert_eq!(zone_stat(&dev)[3], zones_before[3], "live bytes");
    assert_eq!(
        dev.attr_show("bd_stat").unwrap().split_whitespace().next(),
        bd_before.split_whitespace().next(),
        "bd_count"
    );
    for i in n / 2..n {
        check(&dev, i, expected(i, rounds));
    }
    for i in (n / 2..n).filter(|i| i % 3 != 0) {
        dev.write_at(&page(i, 50), i * PAGE as u64).unwrap();
    }
    let r = dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
    assert_eq!(r.error, None, "after recovery: {r:?}");
    dev.attr_store("gc", "1").unwrap();
    dev.debug_check_zones();
    for i in n / 2..n {
        check(&dev, i, if i % 3 == 0 { 1 } else { 50 });
    }

    // Reset and set up again: every sequential zone is empty on the device.
    dev.attr_store("reset", "1").unwrap();
    drop(dev);
    let dev = setup(&backing, n);
    let report = backing.report_zones().unwrap();
    for &i in &seq {
        assert!(
            report[i].empty,
            "zone {i} after a new setup: {:?}",
            report[i]
        );
    }
    fill(&dev, n, 9);
    dev.writeback(&WritebackSpec::pages(0, n - 1)).unwrap();
    dev.debug_check_zones();
    for i in 0..n {
        check(&dev, i, 9);
    }
}

/// 1 MiB zones, eight of them, all sequential-write-required, on a device that completes
/// I/O after 100 us from a timer with 4 request slots and no I/O scheduler: there Linux 6.1
/// reorders several writes in flight to one zone, so this fails (writeback errors) unless
/// uzram keeps one write per zone at the device.
#[test]
fn zoned_null_blk_small_zones() {
    if let Some(dev) = zoned_device_or_boot(
        "zoned_null_blk_small_zones",
        &[
            &["--zone-size-mb", "1", "--zones", "8", "--block-size", "512"],
            uzram_testkit::vm::REORDERING_DEVICE,
        ]
        .concat(),
    ) {
        exercise(&dev);
    }
}

/// 4 MiB zones that hold only 3 MiB (ZNS-style capacity), two conventional zones first, and
/// at most three zones open and three active (open or closed) at a time: a zone left below
/// its capacity must be finished, or the device refuses to open the next.
#[test]
fn zoned_null_blk_capacity_conventional_and_open_limit() {
    if let Some(dev) = zoned_device_or_boot(
        "zoned_null_blk_capacity_conventional_and_open_limit",
        &[
            "--zone-size-mb",
            "4",
            "--zone-capacity-mb",
            "3",
            "--zones",
            "6",
            "--conv-zones",
            "2",
            "--max-open",
            "3",
            "--max-active",
            "3",
            "--block-size",
            "512",
        ],
    ) {
        let backing = open(&dev);
        let g = backing.zone_geometry().cloned().unwrap();
        assert_eq!(g.zone_capacity_bytes, 3 << 20, "{g:?}");
        assert_eq!(g.max_open_zones, 3, "{g:?}");
        assert_eq!(g.max_active_zones, 3, "{g:?}");
        drop(backing);
        exercise(&dev);
    }
}

/// A zoned device that allows only two active zones is refused at `disksize` with
/// `EOPNOTSUPP` (writeback's zone, GC's and one being closed may be active at once), and the
/// device is left as it was.
#[test]
fn zoned_null_blk_two_active_zones_are_refused() {
    if let Some(dev) = zoned_device_or_boot(
        "zoned_null_blk_two_active_zones_are_refused",
        &[
            "--zone-size-mb",
            "1",
            "--zones",
            "4",
            "--block-size",
            "512",
            "--max-active",
            "2",
        ],
    ) {
        let backing = open(&dev);
        assert_eq!(backing.zone_geometry().unwrap().max_active_zones, 2);
        let dev = Device::new_uninit(PAGE).unwrap();
        dev.set_backing(backing.clone()).unwrap();
        let e = dev.attr_store("disksize", "1M").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains("active zones"), "{e}");
        assert_eq!(dev.attr_show("disksize").unwrap(), "0\n");
    }
}

/// A zoned device with 4096-byte logical blocks is refused with a clear error (records are
/// 512-byte aligned), and nothing is written to it.
#[test]
fn zoned_null_blk_4kn_is_refused() {
    if let Some(dev) = zoned_device_or_boot(
        "zoned_null_blk_4kn_is_refused",
        &[
            "--zone-size-mb",
            "1",
            "--zones",
            "4",
            "--block-size",
            "4096",
        ],
    ) {
        let e = FileBacking::open(&dev, &FileOptions::with_engine(Engine::Uring)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains("512-byte logical blocks"), "{e}");
    }
}
