//! Recompression: `recomp_algorithm` (syntax, kernel show format, errnos), `algorithm_params`
//! of secondary priorities, `recompress` with every option (type, max_pages, threshold, algo,
//! priority), INCOMPRESSIBLE marking and `writeback incompressible`, read-back of recompressed
//! pages in RAM and written back (plain, compressed and zoned), the counters, and bad input
//! that changes nothing. Concurrency with every other path is the model test's
//! (`service/tests/model.rs`).

use std::sync::Arc;
use uzram::backing::MemBacking;
use uzram::device::{Device, RecompressSpec};
use uzram_testkit::device::{errno, DeviceBuilder};
use uzram_testkit::pages::{check_pages, page_of, program_pages, write_pages, Kind, Program, PAGE};
use uzram_testkit::refused::{assert_refused, errno_of};

/// A device of `pages` with the recompression algorithms `recomp`, priorities 1, 2...
fn device(pages: u64, recomp: &[&str]) -> Device {
    let mut dev = DeviceBuilder::pages(pages);
    for (i, a) in recomp.iter().enumerate() {
        dev = dev.attr(
            "recomp_algorithm",
            &format!("algo={a} priority={}\n", i + 1),
        );
    }
    dev.build()
}

/// `recomp_stat` as numbers: tried, recompressed, incompressible.
fn recomp_stat(dev: &Device) -> [u64; 3] {
    let s = dev.attr_show("recomp_stat").unwrap();
    let v: Vec<u64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();
    [v[0], v[1], v[2]]
}

#[test]
fn recomp_algorithm_syntax_show_and_errnos() {
    let dev = Device::new_uninit(PAGE).unwrap();
    assert_eq!(dev.attr_show("recomp_algorithm").unwrap(), "");
    dev.attr_store("recomp_algorithm", "algo=zstd\n").unwrap();
    dev.attr_store("recomp_algorithm", "algo=deflate priority=3")
        .unwrap();
    // The kernel's format: "#N: " then the list with the selected one in brackets.
    assert_eq!(
        dev.attr_show("recomp_algorithm").unwrap(),
        "#1: lz4 lz4hc [zstd] deflate \n#3: lz4 lz4hc zstd [deflate] \n"
    );
    for bad in [
        "",
        "priority=1",
        "algo=",
        "algo",
        "algo=zstd priority=0",
        "algo=zstd priority=4",
        "algo=zstd priority=-1",
        "algo=zstd priority=x",
        "algo=lz5",
    ] {
        assert_eq!(
            errno(dev.attr_store("recomp_algorithm", bad)),
            libc::EINVAL,
            "{bad:?}"
        );
    }
    // lzo and lzo-rle (the kernel's defaults) are refused with a message saying why and what
    // is supported; as the primary algorithm too.
    for name in ["lzo", "lzo-rle"] {
        for (attr, value) in [
            ("recomp_algorithm", format!("algo={name}")),
            ("comp_algorithm", name.to_string()),
        ] {
            let e = dev.attr_store(attr, &value).unwrap_err();
            assert_eq!(e.errno(), libc::EINVAL);
            assert!(
                e.message().contains("GPL") && e.message().contains("lz4 lz4hc zstd deflate"),
                "{attr}: {e}"
            );
        }
    }
    // Nothing above changed the settings.
    assert_eq!(
        dev.attr_show("recomp_algorithm").unwrap(),
        "#1: lz4 lz4hc [zstd] deflate \n#3: lz4 lz4hc zstd [deflate] \n"
    );
    // Parameters of a secondary priority: by priority or by name; kept when the priority's
    // algorithm changes (as the kernel keeps them), checked against it at disksize.
    dev.attr_store("algorithm_params", "priority=1 level=9")
        .unwrap();
    dev.attr_store("algorithm_params", "algo=deflate level=9")
        .unwrap();
    // deflate.winbits: honoured (15, the window uzram's deflate uses) or refused.
    dev.attr_store(
        "algorithm_params",
        "algo=deflate level=9 deflate.winbits=15",
    )
    .unwrap();
    // Refused, changing no priority's parameters.
    let params = [1, 3].map(|priority| dev.algorithm_params(priority));
    assert_refused(
        &[
            (
                libc::EINVAL,
                &[
                    "priority=2 level=1",           // no algorithm at priority 2
                    "priority=4 level=1",           // nor at 4
                    "algo=lz4hc level=1",           // lz4hc is at no priority
                    "priority=1 level=99",          // zstd's levels end at 22
                    "algo=zstd deflate.winbits=15", // winbits is deflate's
                ],
            ),
            // A window uzram's deflate does not use.
            (libc::EOPNOTSUPP, &["algo=deflate deflate.winbits=11"]),
        ],
        |value| errno_of(dev.attr_store("algorithm_params", value)),
        |value| {
            let now = [1, 3].map(|priority| dev.algorithm_params(priority));
            assert_eq!(now, params, "{value}");
        },
    );
    // A zstd level kept across a change to lz4hc (which takes 1..=12, so 9 still works),
    // then a negative zstd level kept across a change to lz4, which refuses it (its
    // acceleration starts at 1) at disksize.
    dev.attr_store("recomp_algorithm", "algo=lz4hc priority=1")
        .unwrap();
    assert_eq!(
        dev.algorithm_params(1),
        Some(uzram::compress::CodecParams::with_level(Some(9)))
    );
    dev.attr_store("recomp_algorithm", "algo=zstd").unwrap();
    dev.attr_store("algorithm_params", "priority=1 level=-5")
        .unwrap();
    dev.attr_store("recomp_algorithm", "algo=lz4").unwrap();
    let e = dev.attr_store("disksize", "1M").unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(e.message().contains("priority 1"), "{e}");
    assert_eq!(dev.attr_show("initstate").unwrap(), "0\n");
    dev.attr_store("algorithm_params", "priority=1").unwrap(); // back to defaults
    dev.attr_store("disksize", "1M").unwrap();
    // Once initialised: EBUSY, after the algorithm is checked (EINVAL first, as the kernel).
    assert_eq!(
        errno(dev.attr_store("recomp_algorithm", "algo=zstd")),
        libc::EBUSY
    );
    assert_eq!(
        errno(dev.attr_store("recomp_algorithm", "algo=lzo")),
        libc::EINVAL
    );
    // Reset forgets the recompression algorithms and their parameters.
    dev.attr_store("reset", "1").unwrap();
    assert_eq!(dev.attr_show("recomp_algorithm").unwrap(), "");
}

#[test]
fn recompress_idle_shrinks_and_reads_back() {
    let pages = program_pages(256, 0, Program::Lz4Halves);
    let dev = device(256, &["zstd"]);
    write_pages(&dev, 0, &pages);
    let before = dev.stats();
    dev.attr_store("idle", "all").unwrap();
    let report = dev
        .recompress(&RecompressSpec::parse("type=idle").unwrap())
        .unwrap();
    let after = dev.stats();
    assert!(report.recompressed > 0, "{report:?}");
    assert_eq!(
        before.compr_data_size_bytes - after.compr_data_size_bytes,
        report.saved_bytes,
        "compr_data_size moves by what was saved"
    );
    assert!(
        after.compr_data_size_bytes * 10 < before.compr_data_size_bytes * 9,
        "zstd should save over 10% against lz4 on program pages: {before:?} {after:?}"
    );
    assert_eq!(after.orig_data_size_bytes, before.orig_data_size_bytes);
    assert_eq!(after.pages_stored, before.pages_stored);
    assert_eq!(
        recomp_stat(&dev),
        [report.tried, report.recompressed, report.incompressible]
    );
    check_pages(&dev, 0, &pages);
    // Recompressed pages lost IDLE: a second type=idle run finds nothing.
    dev.attr_store("recompress", "type=idle").unwrap();
    assert_eq!(recomp_stat(&dev)[0], report.tried);
    // Marked idle again, pages already at the highest priority are not candidates; the rest
    // (those zstd did not shrink) are INCOMPRESSIBLE and skipped too.
    dev.attr_store("idle", "all").unwrap();
    let again = dev
        .recompress(&RecompressSpec::parse("type=idle").unwrap())
        .unwrap();
    assert_eq!(again.tried, 0, "{again:?}");
    check_pages(&dev, 0, &pages);
    // Overwriting a recompressed page stores it with the primary codec again.
    dev.write_at(&pages[1], 0).unwrap();
    let mut buf = vec![0u8; PAGE];
    dev.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, pages[1]);
}

#[test]
fn incompressible_pages_are_marked_skipped_and_written_back() {
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.set_backing(Arc::new(MemBacking::new(64 * PAGE as u64).unwrap()))
        .unwrap();
    dev.attr_store("recomp_algorithm", "algo=zstd").unwrap();
    dev.attr_store("recomp_algorithm", "algo=deflate priority=2")
        .unwrap();
    dev.attr_store("disksize", &(32 * PAGE).to_string())
        .unwrap();
    // Text pages (compressible whatever the build) with every fourth one random.
    let mut pages: Vec<Vec<u8>> = (0..32u64)
        .map(|i| {
            let text = format!("page {i} of text that compresses well; ");
            text.bytes().cycle().take(PAGE).collect()
        })
        .collect();
    for i in (0..32).step_by(4) {
        pages[i] = page_of(Kind::Random, i as u64, 0, PAGE);
    }
    write_pages(&dev, 0, &pages);
    let huge = dev.stats().huge_pages;
    assert_eq!(huge, 8);
    // Only HUGE pages: none shrinks, all become INCOMPRESSIBLE.
    let r = dev
        .recompress(&RecompressSpec::parse("type=huge").unwrap())
        .unwrap();
    assert_eq!((r.tried, r.recompressed, r.incompressible), (8, 0, 8));
    assert_eq!(dev.stats().huge_pages, 8);
    // Skipped next time.
    let r = dev
        .recompress(&RecompressSpec::parse("type=huge").unwrap())
        .unwrap();
    assert_eq!(r.candidates, 0);
    // `writeback incompressible` takes exactly them.
    dev.attr_store("writeback", "incompressible").unwrap();
    assert_eq!(dev.stats().bd_count, 8);
    check_pages(&dev, 0, &pages);
}

#[test]
fn only_the_last_priority_marks_incompressible() {
    let dev = device(8, &["zstd", "deflate"]);
    let p = page_of(Kind::Random, 1, 0, PAGE);
    dev.write_at(&p, 0).unwrap();
    // Priority 1 alone is not the last codec: no mark, tried again later.
    let r = dev
        .recompress(&RecompressSpec::parse("priority=1").unwrap())
        .unwrap();
    assert_eq!((r.tried, r.incompressible), (1, 0));
    let r = dev
        .recompress(&RecompressSpec::parse("algo=deflate").unwrap())
        .unwrap();
    assert_eq!((r.tried, r.incompressible), (1, 1));
    let r = dev.recompress(&RecompressSpec::default()).unwrap();
    assert_eq!(r.candidates, 0);
}

#[test]
fn max_pages_threshold_algo_and_priority() {
    let pages = program_pages(64, 0, Program::Lz4Halves);
    let dev = device(64, &["lz4hc", "zstd"]);
    write_pages(&dev, 0, &pages);
    // max_pages bounds the pages tried; the largest objects go first.
    let r = dev
        .recompress(&RecompressSpec::parse("max_pages=5").unwrap())
        .unwrap();
    assert_eq!(r.tried, 5, "{r:?}");
    // max_pages=0 tries nothing.
    let r = dev
        .recompress(&RecompressSpec::parse("max_pages=0").unwrap())
        .unwrap();
    assert_eq!(r.tried, 0);
    // threshold: only objects at least that large are tried.
    let big = 3000;
    let r = dev
        .recompress(&RecompressSpec::parse(&format!("threshold={big} algo=zstd")).unwrap())
        .unwrap();
    let sizes_at_least = r.tried;
    assert!(r.candidates >= sizes_at_least);
    // algo=zstd is priority 2: every page now at priority 2 is no candidate any more, for
    // either priority.
    let r = dev
        .recompress(&RecompressSpec::parse("algo=zstd").unwrap())
        .unwrap();
    assert!(r.tried > 0);
    let r1 = dev
        .recompress(&RecompressSpec::parse("priority=1").unwrap())
        .unwrap();
    let r2 = dev
        .recompress(&RecompressSpec::parse("priority=2").unwrap())
        .unwrap();
    // Pages zstd could not shrink are INCOMPRESSIBLE now; the others are at priority 2.
    assert_eq!((r1.tried, r2.tried), (0, 0), "{r1:?} {r2:?}");
    check_pages(&dev, 0, &pages);
}

#[test]
fn recompressed_pages_read_back_after_writeback() {
    for (layout, compressed) in [("bitmap", false), ("bitmap", true), ("zoned", true)] {
        let dev = Device::new_uninit(PAGE).unwrap();
        let blocks = if layout == "zoned" { 3 << 8 } else { 128 };
        dev.set_backing(Arc::new(MemBacking::new(blocks * PAGE as u64).unwrap()))
            .unwrap();
        dev.attr_store("backing_layout", layout).unwrap();
        if layout == "zoned" {
            dev.attr_store("zone_size", "1M").unwrap();
        }
        dev.set_compressed_writeback(compressed).unwrap();
        dev.attr_store("recomp_algorithm", "algo=deflate").unwrap();
        dev.attr_store("recomp_algorithm", "algo=zstd priority=2")
            .unwrap();
        dev.attr_store("disksize", &(64 * PAGE).to_string())
            .unwrap();
        let pages = program_pages(64, 0, Program::Lz4Halves);
        write_pages(&dev, 0, &pages);
        // Half the pages at priority 1, the rest at priority 2.
        dev.attr_store("recompress", "algo=deflate max_pages=32")
            .unwrap();
        dev.attr_store("recompress", "priority=2").unwrap();
        dev.attr_store("idle", "all").unwrap();
        dev.attr_store("writeback", "idle").unwrap();
        assert!(dev.stats().bd_count > 0, "{layout} {compressed}");
        check_pages(&dev, 0, &pages);
    }
}

#[test]
fn bad_input_changes_nothing() {
    // Uninitialised: EINVAL.
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.attr_store("recomp_algorithm", "algo=zstd").unwrap();
    assert_eq!(
        errno(dev.attr_store("recompress", "type=idle")),
        libc::EINVAL
    );
    // Initialised without a recompression algorithm: EINVAL.
    let plain = device(4, &[]);
    assert_eq!(errno(plain.attr_store("recompress", "")), libc::EINVAL);

    let pages = program_pages(32, 0, Program::Lz4Halves);
    let dev = device(32, &["zstd"]);
    write_pages(&dev, 0, &pages);
    dev.attr_store("idle", "all").unwrap();
    let mm = dev.attr_show("mm_stat").unwrap();
    assert_refused(
        &[
            (
                libc::EINVAL,
                &[
                    "type=cold",
                    "type=",
                    "type",
                    "max_pages=x",
                    "max_pages=-1",
                    "threshold=abc",
                    "threshold=4096",
                    "threshold=100000",
                    "algo=lz4hc",
                    "algo=lzo-rle",
                    "priority=2",
                    "priority=3",
                    "priority=x",
                ],
            ),
            (libc::ERANGE, &["threshold=99999999999"]),
        ],
        |value| errno_of(dev.attr_store("recompress", value)),
        |value| {
            assert_eq!(dev.attr_show("mm_stat").unwrap(), mm, "{value:?}");
            assert_eq!(recomp_stat(&dev), [0, 0, 0], "{value:?}");
        },
    );
    // Read-only and write-only.
    assert_eq!(errno(dev.attr_show("recompress")), libc::EACCES);
    assert_eq!(errno(dev.attr_store("recomp_stat", "1")), libc::EACCES);
    // Unknown keys are ignored, as in zram; priority=0 means 1.
    dev.attr_store("recompress", "type=idle colour=blue priority=0")
        .unwrap();
    assert!(recomp_stat(&dev)[1] > 0);
    check_pages(&dev, 0, &pages);
}
