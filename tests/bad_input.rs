//! Bad input gets its exact error and changes nothing: I/O out of range, misaligned, zero
//! length and over the memory limit; unknown algorithms; malformed attribute values; settings
//! changed after initialisation.

use uzram::device::{Device, DeviceConfig};
use uzram::{BlockDevice, ErrorKind};
use uzram_testkit::device::device;
use uzram_testkit::pages::{page_of, pattern, Kind, PAGE};

/// Reads the whole device.
fn image(dev: &Device) -> Vec<u8> {
    let mut buf = vec![0u8; dev.size_bytes() as usize];
    dev.read_at(&mut buf, 0).unwrap();
    buf
}

fn assert_err<T: std::fmt::Debug>(r: uzram::Result<T>, kind: ErrorKind, errno: i32) {
    let e = r.expect_err("must fail");
    assert_eq!(e.kind(), kind, "{e}");
    assert_eq!(e.errno(), errno, "{e}");
}

#[test]
fn io_out_of_range_misaligned_or_empty_is_einval_and_changes_nothing() {
    let dev = device(16);
    dev.write_at(&pattern(16 * PAGE, 1), 0).unwrap();
    let before = image(&dev);
    let stats = dev.stats();
    let size = dev.size_bytes();
    let page = pattern(PAGE, 9);
    let mut rbuf = vec![0u8; PAGE];
    let einval = (ErrorKind::InvalidArgument, libc::EINVAL);
    // Past the end, straddling the end, and offset overflow.
    assert_err(dev.write_at(&page, size), einval.0, einval.1);
    assert_err(dev.write_at(&page, size - 512), einval.0, einval.1);
    assert_err(dev.write_at(&page, u64::MAX - 511), einval.0, einval.1);
    assert_err(dev.read_at(&mut rbuf, size), einval.0, einval.1);
    assert_err(dev.discard(size - 512, 1024), einval.0, einval.1);
    assert_err(dev.write_zeroes(0, size + 512), einval.0, einval.1);
    // Misaligned offset or length.
    assert_err(dev.write_at(&page, 1), einval.0, einval.1);
    assert_err(dev.write_at(&page[..511], 0), einval.0, einval.1);
    assert_err(dev.read_at(&mut rbuf[..100], 0), einval.0, einval.1);
    assert_err(dev.discard(256, 4096), einval.0, einval.1);
    assert_err(dev.write_zeroes(0, 100), einval.0, einval.1);
    // Zero length.
    assert_err(dev.write_at(&[], 0), einval.0, einval.1);
    assert_err(dev.read_at(&mut [], 0), einval.0, einval.1);
    assert_err(dev.discard(0, 0), einval.0, einval.1);
    assert_eq!(image(&dev), before);
    let after = dev.stats();
    assert_eq!(after.failed_writes, stats.failed_writes);
    assert_eq!(after.orig_data_size_bytes, stats.orig_data_size_bytes);
}

#[test]
fn uninitialised_device_rejects_io() {
    let dev = Device::new_uninit(PAGE).unwrap();
    assert_eq!(dev.size_bytes(), 0);
    assert_err(
        dev.write_at(&pattern(PAGE, 1), 0),
        ErrorKind::InvalidArgument,
        libc::EINVAL,
    );
}

#[test]
fn over_mem_limit_is_enomem_and_keeps_old_contents() {
    let dev = device(64);
    // Incompressible pages: each takes a whole pool page.
    let old: Vec<u8> = (0..8)
        .flat_map(|i| page_of(Kind::Random, i, 0, PAGE))
        .collect();
    dev.write_at(&old, 0).unwrap();
    let used = dev.stats().mem_used_total_bytes;
    dev.attr_store("mem_limit", &used.to_string()).unwrap();
    let before = image(&dev);
    let failed_before = dev.stats().failed_writes;
    // Overwriting a stored page with another incompressible page needs a new object before the
    // old one is freed, so it must fail at the limit and keep the old page.
    let e = dev
        .write_at(&page_of(Kind::Random, 100, 0, PAGE), 0)
        .unwrap_err();
    assert_eq!(
        (e.kind(), e.errno()),
        (ErrorKind::NoMemory, libc::ENOMEM),
        "{e}"
    );
    assert_err(
        dev.write_at(&page_of(Kind::Random, 101, 0, PAGE), 20 * PAGE as u64),
        ErrorKind::NoMemory,
        libc::ENOMEM,
    );
    // A partial write needing a new object fails the same way.
    assert_err(
        dev.write_at(
            &page_of(Kind::Random, 102, 0, PAGE)[..512],
            30 * PAGE as u64 + 512,
        ),
        ErrorKind::NoMemory,
        libc::ENOMEM,
    );
    assert_eq!(image(&dev), before);
    assert_eq!(dev.stats().failed_writes, failed_before + 3);
    assert!(dev.stats().mem_used_total_bytes <= used);
    // Same-filled pages need no memory and still succeed at the limit.
    dev.write_at(&vec![7u8; PAGE], 40 * PAGE as u64).unwrap();
    // Lifting the limit lets the write through.
    dev.attr_store("mem_limit", "0").unwrap();
    dev.write_at(&page_of(Kind::Random, 100, 0, PAGE), 0)
        .unwrap();
    let mut got = vec![0u8; PAGE];
    dev.read_at(&mut got, 0).unwrap();
    assert_eq!(got, page_of(Kind::Random, 100, 0, PAGE));
}

#[test]
fn bad_page_size_and_unknown_algorithm_are_einval() {
    assert_err(
        Device::new_uninit(8192),
        ErrorKind::InvalidArgument,
        libc::EINVAL,
    );
    let r = Device::new(DeviceConfig {
        disksize_bytes: 1 << 20,
        comp_algorithm: "lz5".into(),
        ..Default::default()
    });
    assert_err(r, ErrorKind::InvalidArgument, libc::EINVAL);
    let dev = Device::new_uninit(PAGE).unwrap();
    assert_err(
        dev.attr_store("comp_algorithm", "lz5\n"),
        ErrorKind::InvalidArgument,
        libc::EINVAL,
    );
    assert_eq!(
        dev.attr_show("comp_algorithm")
            .unwrap()
            .matches('[')
            .count(),
        1
    );
    assert!(dev.attr_show("comp_algorithm").unwrap().contains("[lz4]"));
}

/// A check that storing a value into an attribute of `dev` fails with `kind` and `errno`.
fn refused_with(dev: &Device, kind: ErrorKind, errno: i32) -> impl Fn(&str, &str) + '_ {
    move |name, value| {
        let e = dev.attr_store(name, value).expect_err(value);
        assert_eq!(
            (e.kind(), e.errno()),
            (kind, errno),
            "{name}={value:?}: {e}"
        );
    }
}

#[test]
fn malformed_attribute_values_are_rejected_and_change_nothing() {
    let dev = Device::new_uninit(PAGE).unwrap();
    let einval = refused_with(&dev, ErrorKind::InvalidArgument, libc::EINVAL);
    einval("disksize", "0\n");
    einval("disksize", "foo\n");
    einval("disksize", " 1G"); // memparse takes no leading blank: 0
    einval("disksize", "");
    einval("mem_limit", "foo");
    einval("mem_used_max", "1");
    einval("mem_used_max", "x");
    einval("reset", "0");
    einval("reset", "1x");
    einval("reset", " 1 ");
    einval("idle", "recent");
    einval("idle", "-1");
    einval("algorithm_params", "level");
    einval("algorithm_params", "level=");
    einval("algorithm_params", "level=abc");
    einval("algorithm_params", "algo=zstd level=3"); // zstd is not the selected algorithm
    einval("algorithm_params", "priority=1 level=3"); // no recompression algorithm configured
    dev.attr_store("comp_algorithm", "zstd\n").unwrap();
    einval("algorithm_params", "algo=zstd level=99");
    assert_eq!(dev.attr_show("initstate").unwrap(), "0\n");
    assert_eq!(dev.attr_show("disksize").unwrap(), "0\n");
    // Unknown names, and reading write-only / writing read-only attributes.
    let e = dev.attr_show("no_such_attr").unwrap_err();
    assert_eq!((e.kind(), e.errno()), (ErrorKind::NotFound, libc::ENOENT));
    let e = dev.attr_show("reset").unwrap_err();
    assert_eq!(
        (e.kind(), e.errno()),
        (ErrorKind::PermissionDenied, libc::EACCES)
    );
    let e = dev.attr_store("mm_stat", "1").unwrap_err();
    assert_eq!(
        (e.kind(), e.errno()),
        (ErrorKind::PermissionDenied, libc::EACCES)
    );
    // Valid settings still work after all that.
    dev.attr_store("algorithm_params", "algo=zstd level=5\n")
        .unwrap();
    dev.attr_store("disksize", "1M\n").unwrap();
    assert_eq!(dev.attr_show("disksize").unwrap(), "1048576\n");
    assert_eq!(
        dev.attr_show("comp_algorithm").unwrap(),
        "lz4 lz4hc [zstd] deflate \n"
    );
}

#[test]
fn settings_after_init_are_ebusy_and_change_nothing() {
    let dev = device(16);
    dev.write_at(&pattern(PAGE, 3), 0).unwrap();
    let ebusy = refused_with(&dev, ErrorKind::Busy, libc::EBUSY);
    ebusy("disksize", "1G\n");
    ebusy("comp_algorithm", "zstd\n");
    // algorithm_params is taken after init, as the kernel takes it: kept for a disksize that
    // only a reset (which clears it) allows, so it changes nothing.
    dev.attr_store("algorithm_params", "level=3\n").unwrap();
    ebusy("multi_page_size", "64K\n");
    // disksize=0 is EINVAL before EBUSY, as in zram.
    assert_eq!(
        dev.attr_store("disksize", "0").unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // An unknown algorithm is EINVAL before EBUSY, as in zram.
    assert_eq!(
        dev.attr_store("comp_algorithm", "lz5").unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(dev.size_bytes(), 16 * PAGE as u64);
    assert!(dev.attr_show("comp_algorithm").unwrap().contains("[lz4]"));
    let mut got = vec![0u8; PAGE];
    dev.read_at(&mut got, 0).unwrap();
    assert_eq!(got, pattern(PAGE, 3));
}

#[test]
fn reset_returns_to_defaults() {
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.attr_store("comp_algorithm", "zstd").unwrap();
    dev.attr_store("mem_limit", "1M").unwrap();
    dev.attr_store("disksize", "64K").unwrap();
    dev.write_at(&pattern(PAGE, 5), 0).unwrap();
    assert_eq!(dev.attr_show("initstate").unwrap(), "1\n");
    dev.attr_store("reset", "1\n").unwrap();
    assert_eq!(dev.attr_show("initstate").unwrap(), "0\n");
    assert_eq!(dev.attr_show("disksize").unwrap(), "0\n");
    assert!(dev.attr_show("comp_algorithm").unwrap().contains("[lz4]"));
    assert_eq!(
        dev.attr_show("mm_stat").unwrap(),
        "       0        0        0        0        0        0        0        0        0\n"
    );
    dev.attr_store("disksize", "64K").unwrap();
    let mut got = vec![1u8; PAGE];
    dev.read_at(&mut got, 0).unwrap();
    assert!(got.iter().all(|&b| b == 0), "a reset device reads zeroes");
}

#[test]
fn bad_multi_page_sizes_are_einval_and_change_nothing() {
    let dev = Device::new_uninit(PAGE).unwrap();
    assert_eq!(dev.attr_show("multi_page_size").unwrap(), "4096\n");
    for bad in ["8192", "2048", "0", "128K", "64Kx", "-1", ""] {
        assert_err(
            dev.attr_store("multi_page_size", bad),
            ErrorKind::InvalidArgument,
            libc::EINVAL,
        );
        assert_eq!(dev.attr_show("multi_page_size").unwrap(), "4096\n", "{bad}");
    }
    for good in ["16384", "32K", "64K\n", "4096"] {
        dev.attr_store("multi_page_size", good).unwrap();
    }
    assert_eq!(dev.attr_show("multi_page_size").unwrap(), "4096\n");
    // Not above a 64 KiB page; off is still taken.
    let big = Device::new_uninit(65536).unwrap();
    assert_err(
        big.attr_store("multi_page_size", "64K"),
        ErrorKind::InvalidArgument,
        libc::EINVAL,
    );
    big.attr_store("multi_page_size", "4096").unwrap();
    // Reset turns it off.
    dev.attr_store("multi_page_size", "64K").unwrap();
    dev.attr_store("disksize", "1M").unwrap();
    dev.attr_store("reset", "1").unwrap();
    assert_eq!(dev.attr_show("multi_page_size").unwrap(), "4096\n");
}
