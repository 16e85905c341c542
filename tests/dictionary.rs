//! Compression dictionaries (`algorithm_params ... dict=PATH`) and codec parameters: a zstd
//! dictionary on the primary and on a recompression priority (smaller objects, pages read
//! back), every bad dictionary (missing, empty, a directory, too large, corrupt, on an
//! algorithm without dictionaries) refused with zram's errno and changing nothing, lz4's
//! `level` as acceleration. The model test runs a dictionary beside every other path.

use std::path::PathBuf;
use uzram::compress::{new_codec, CodecParams, Dictionary, MAX_DICT_BYTES};
use uzram::device::{Device, RecompressSpec};
use uzram_testkit::device::{errno, DeviceBuilder};
use uzram_testkit::pages::{check_pages, program_pages, write_pages, Program, PAGE};

/// A raw-content dictionary: 64 KiB of the pages the device will hold (what zstd uses raw
/// content for: matches against typical data).
fn raw_dict(pages: &[Vec<u8>]) -> Vec<u8> {
    pages
        .iter()
        .step_by(8)
        .take(16)
        .flatten()
        .copied()
        .collect()
}

/// `pages` (those the device will hold) and a [`raw_dict`] of them in `dir`, as `name`.
fn pages_and_dict(dir: &tempfile::TempDir, name: &str, n: usize) -> (Vec<Vec<u8>>, PathBuf) {
    let pages = program_pages(n, 0, Program::Any);
    let path = dir.path().join(name);
    std::fs::write(&path, raw_dict(&pages)).unwrap();
    (pages, path)
}

#[test]
fn zstd_dictionary_on_primary_and_secondary_shrinks_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let (pages, path) = pages_and_dict(&dir, "pages.dict", 256);
    let compr = |dev: &Device| dev.stats().compr_data_size_bytes;

    // Primary zstd, without and with the dictionary.
    let zstd = || DeviceBuilder::bytes(1 << 20).attr("comp_algorithm", "zstd");
    let plain = zstd().build();
    write_pages(&plain, 0, &pages);
    let with = zstd()
        .attr(
            "algorithm_params",
            &format!("algo=zstd level=3 dict={}\n", path.display()),
        )
        .build();
    write_pages(&with, 0, &pages);
    assert!(
        compr(&with) < compr(&plain),
        "dictionary {} >= plain {}",
        compr(&with),
        compr(&plain)
    );
    check_pages(&with, 0, &pages);

    // lz4 primary, recompressed with zstd + dictionary at priority 1.
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.attr_store("recomp_algorithm", "algo=zstd").unwrap();
    dev.attr_store(
        "algorithm_params",
        &format!("priority=1 dict={}", path.display()),
    )
    .unwrap();
    dev.attr_store("disksize", "1M").unwrap();
    write_pages(&dev, 0, &pages);
    let r = dev.recompress(&RecompressSpec::default()).unwrap();
    assert!(r.recompressed > 0, "{r:?}");
    check_pages(&dev, 0, &pages);
    assert!(compr(&dev) <= compr(&with) + compr(&with) / 4);
}

#[test]
fn bad_dictionaries_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (pages, good) = pages_and_dict(&dir, "good.dict", 32);
    let empty = dir.path().join("empty.dict");
    std::fs::write(&empty, b"").unwrap();
    let big = dir.path().join("big.dict");
    std::fs::write(&big, vec![7u8; MAX_DICT_BYTES as usize + 1]).unwrap();
    // zstd's dictionary magic and an ID, then tables that do not parse.
    let corrupt = dir.path().join("corrupt.dict");
    let mut bytes = vec![0x37, 0xa4, 0x30, 0xec, 1, 0, 0, 0];
    bytes.extend(std::iter::repeat(0xff).take(2000));
    std::fs::write(&corrupt, &bytes).unwrap();

    let dev = Device::new_uninit(PAGE).unwrap();
    dev.attr_store("comp_algorithm", "zstd").unwrap();
    dev.attr_store("recomp_algorithm", "algo=deflate").unwrap();
    dev.attr_store("recomp_algorithm", "algo=lz4 priority=2")
        .unwrap();
    dev.attr_store("algorithm_params", "algo=zstd level=5")
        .unwrap();
    let p = |f: &std::path::Path| f.display().to_string();
    for (value, want) in [
        (
            format!("dict={}", p(&dir.path().join("missing"))),
            libc::EINVAL,
        ),
        (format!("dict={}", p(&empty)), libc::EINVAL),
        (format!("dict={}", p(dir.path())), libc::EINVAL),
        (format!("dict={}", p(&big)), libc::EINVAL),
        (format!("dict={}", p(&corrupt)), libc::EINVAL),
        (format!("algo=zstd dict={}", p(&corrupt)), libc::EINVAL),
        (format!("algo=deflate dict={}", p(&good)), libc::EOPNOTSUPP),
        (format!("priority=2 dict={}", p(&good)), libc::EOPNOTSUPP),
        ("dict=".to_string(), libc::EINVAL),
    ] {
        assert_eq!(
            errno(dev.attr_store("algorithm_params", &value)),
            want,
            "{value}"
        );
    }
    // The parameters set before the failures are still there, and a good dictionary then
    // loads. (Compressed sizes are not compared with a bare codec's: libzstd's output may
    // differ by a few bytes between a fresh context and a reused one.)
    assert_eq!(
        dev.algorithm_params(0),
        Some(CodecParams::with_level(Some(5)))
    );
    assert_eq!(dev.algorithm_params(1), Some(CodecParams::default()));
    dev.attr_store("disksize", "1M").unwrap();
    write_pages(&dev, 0, &pages);
    check_pages(&dev, 0, &pages);
    // Once initialised, a dictionary is taken as the kernel takes it (read, kept until the
    // reset that must come before the next disksize, which clears it) and changes nothing:
    // the pages written with the first one read back.
    dev.attr_store("algorithm_params", &format!("dict={}", p(&good)))
        .unwrap();
    check_pages(&dev, 0, &pages);
    dev.attr_store("reset", "1").unwrap();
    assert_eq!(dev.algorithm_params(0), Some(CodecParams::default()));
}

#[test]
fn dictionary_is_shared_not_copied() {
    let pages = program_pages(8, 0, Program::Any);
    let dict = Dictionary::from_bytes(raw_dict(&program_pages(128, 0, Program::Any))).unwrap();
    let params = CodecParams {
        level: Some(3),
        dict: Some(dict.clone()),
    };
    let codec = std::sync::Arc::new(new_codec("zstd", params).unwrap());
    // Every thread compresses and decompresses with the one codec (one digested dictionary).
    std::thread::scope(|s| {
        for t in 0..4 {
            let codec = codec.clone();
            let pages = &pages;
            s.spawn(move || {
                let mut dst = vec![0u8; uzram::compress::compress_bound(PAGE)];
                let mut out = vec![0u8; PAGE];
                for _ in 0..50 {
                    let p = &pages[t % pages.len()];
                    let n = codec.compress(p, &mut dst).unwrap();
                    codec.decompress(&dst[..n], &mut out).unwrap();
                    assert!(out == *p);
                }
            });
        }
    });
    // A frame made with the dictionary does not decode without it.
    let plain = new_codec("zstd", CodecParams::with_level(Some(3))).unwrap();
    let mut dst = vec![0u8; uzram::compress::compress_bound(PAGE)];
    let mut out = vec![0u8; PAGE];
    let n = codec.compress(&pages[0], &mut dst).unwrap();
    assert!(
        plain.decompress(&dst[..n], &mut out).is_err() || out != pages[0],
        "a dictionary frame decoded without its dictionary"
    );
}

#[test]
fn lz4_level_is_acceleration() {
    let pages = program_pages(64, 0, Program::Any);
    let compr = |level: &str| {
        let dev = DeviceBuilder::bytes(1 << 20)
            .attr("algorithm_params", &format!("level={level}"))
            .build();
        write_pages(&dev, 0, &pages);
        check_pages(&dev, 0, &pages);
        dev.stats().compr_data_size_bytes
    };
    let (one, fast) = (compr("1"), compr("64"));
    assert!(fast >= one, "acceleration 64 ({fast}) beat 1 ({one})");
    let dev = Device::new_uninit(PAGE).unwrap();
    for bad in ["0", "-3", "65538"] {
        assert_eq!(
            errno(dev.attr_store("algorithm_params", &format!("level={bad}"))),
            libc::EINVAL,
            "{bad}"
        );
    }
}
