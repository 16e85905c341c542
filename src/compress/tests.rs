//! Tests every codec through the [`Codec`] trait: round trips on each kind of page at every
//! page size, corrupt input, level validation and concurrent use.

use super::*;
use crate::error::ErrorKind;
use crate::units::SUPPORTED_PAGE_SIZES_BYTES;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn all_codecs() -> Vec<Box<dyn Codec>> {
    algorithms()
        .iter()
        .map(|name| new_codec(name, CodecParams::default()).unwrap())
        .collect()
}

/// A page of JSON-like records: repetitive structure, varying values, like program heaps.
fn text_page(size: usize, seed: u64) -> Vec<u8> {
    const WORDS: [&str; 12] = [
        "alpha",
        "user_id",
        "timestamp",
        "name",
        "value",
        "status",
        "ok",
        "error",
        "count",
        "address",
        "price",
        "items",
    ];
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut page = Vec::with_capacity(size + 64);
    while page.len() < size {
        let line = format!(
            "{{\"{}\": {}, \"{}\": \"{}-{}\"}}\n",
            WORDS[rng.gen_range(0..WORDS.len())],
            rng.gen_range(0..100_000),
            WORDS[rng.gen_range(0..WORDS.len())],
            WORDS[rng.gen_range(0..WORDS.len())],
            rng.gen_range(0..1000),
        );
        page.extend_from_slice(line.as_bytes());
    }
    page.truncate(size);
    page
}

fn random_page(size: usize, seed: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut page = vec![0u8; size];
    rng.fill(&mut page[..]);
    page
}

fn same_page(size: usize, word: u64) -> Vec<u8> {
    let mut page = vec![0u8; size];
    fill_same(&mut page, word);
    page
}

/// Every kind of page the tests use, named for failure messages.
fn sample_pages(size: usize) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("zero", vec![0u8; size]),
        ("same 0xff", same_page(size, u64::MAX)),
        ("same pattern", same_page(size, 0x0123_4567_89ab_cdef)),
        ("text", text_page(size, 1)),
        ("random", random_page(size, 2)),
        ("half random", {
            let mut p = random_page(size, 3);
            p[size / 2..].fill(0);
            p
        }),
    ]
}

fn round_trip(codec: &dyn Codec, page: &[u8]) -> usize {
    let mut dst = vec![0u8; compress_bound(page.len())];
    let n = codec.compress(page, &mut dst).unwrap();
    assert!(n > 0 && n <= dst.len());
    let mut out = vec![0xa5u8; page.len()];
    codec.decompress(&dst[..n], &mut out).unwrap();
    assert!(out == page, "{} round trip differs", codec.name());
    n
}

#[test]
fn algorithms_are_listed_in_comp_algorithm_order() {
    assert_eq!(algorithms(), &["lz4", "lz4hc", "zstd", "deflate"]);
    for (codec, name) in all_codecs().iter().zip(algorithms()) {
        assert_eq!(codec.name(), *name);
    }
}

#[test]
fn round_trip_every_kind_of_page_at_every_page_size() {
    for codec in all_codecs() {
        for size in SUPPORTED_PAGE_SIZES_BYTES {
            for (kind, page) in sample_pages(size) {
                let n = round_trip(codec.as_ref(), &page);
                match kind {
                    "zero" | "same 0xff" | "same pattern" => assert!(
                        n < size / 16,
                        "{}: {kind} page of {size} compressed to {n}",
                        codec.name()
                    ),
                    "text" => assert!(n < size, "{}: text page did not compress", codec.name()),
                    _ => {}
                }
            }
        }
    }
}

#[test]
fn incompressible_pages_fit_compress_bound() {
    for codec in all_codecs() {
        for size in SUPPORTED_PAGE_SIZES_BYTES {
            for seed in 0..4 {
                let page = random_page(size, 100 + seed);
                let n = round_trip(codec.as_ref(), &page);
                // Random data expands: the bound is what makes that safe.
                assert!(n <= compress_bound(size));
            }
        }
    }
}

#[test]
fn every_level_round_trips() {
    let page = text_page(4096, 7);
    let levels: [(&str, Vec<i32>); 4] = [
        ("lz4", vec![1, 2, 17, 65537]),
        ("lz4hc", (1..=12).collect()),
        ("zstd", vec![-5, -1, 0, 1, 3, 9, 19, 22]),
        ("deflate", (0..=9).collect()),
    ];
    for (name, levels) in levels {
        for level in levels {
            let codec = new_codec(name, CodecParams::with_level(Some(level))).unwrap();
            round_trip(codec.as_ref(), &page);
        }
    }
}

#[test]
fn invalid_names_and_levels_are_einval() {
    let bad: [(&str, Option<i32>); 10] = [
        ("lzo", None),
        ("", None),
        ("LZ4", None),
        ("lz4", Some(0)),
        ("lz4", Some(65538)),
        ("lz4hc", Some(0)),
        ("lz4hc", Some(13)),
        ("zstd", Some(23)),
        ("deflate", Some(-1)),
        ("deflate", Some(10)),
    ];
    for (name, level) in bad {
        let err = new_codec(name, CodecParams::with_level(level)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{name} {level:?}");
        assert_eq!(err.errno(), libc::EINVAL);
    }
    // A trailing newline, as `echo zstd > comp_algorithm` writes, is accepted.
    assert_eq!(
        new_codec("zstd\n", CodecParams::default()).unwrap().name(),
        "zstd"
    );
}

#[test]
fn too_small_dst_is_an_error_not_a_panic() {
    for codec in all_codecs() {
        let page = random_page(4096, 9);
        let mut dst = vec![0u8; 100];
        let err = codec.compress(&page, &mut dst).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{}", codec.name());
    }
}

#[test]
fn truncated_input_is_an_io_error() {
    for codec in all_codecs() {
        for (kind, page) in sample_pages(4096) {
            let mut dst = vec![0u8; compress_bound(page.len())];
            let n = codec.compress(&page, &mut dst).unwrap();
            let mut out = vec![0u8; page.len()];
            for len in 0..n {
                let err = codec.decompress(&dst[..len], &mut out).unwrap_err();
                assert_eq!(
                    err.kind(),
                    ErrorKind::Io,
                    "{}: {kind} truncated to {len} of {n}",
                    codec.name()
                );
            }
        }
    }
}

#[test]
fn wrong_output_size_is_an_io_error() {
    for codec in all_codecs() {
        let page = text_page(4096, 11);
        let mut dst = vec![0u8; compress_bound(page.len())];
        let n = codec.compress(&page, &mut dst).unwrap();
        for out_len in [0, 1, 4095, 4097, 8192] {
            let mut out = vec![0u8; out_len];
            let err = codec.decompress(&dst[..n], &mut out).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Io, "{} into {out_len}", codec.name());
        }
    }
}

/// Garbage and bit-flipped input must never panic. A flipped bit may still decode to a page of
/// the right length (no codec here carries a checksum), so success is allowed; a short or long
/// result is not.
#[test]
fn garbage_and_corrupted_input_never_panics() {
    let mut rng = SmallRng::seed_from_u64(42);
    for codec in all_codecs() {
        for size in SUPPORTED_PAGE_SIZES_BYTES {
            let mut out = vec![0u8; size];
            for len in [1, 2, 7, 16, 100, 1000, size, size + 100] {
                let garbage = random_page(len, rng.gen());
                if codec.decompress(&garbage, &mut out).is_ok() {
                    // Only possible if the garbage happens to be a valid stream of `size`.
                    assert_eq!(out.len(), size);
                }
            }
            for (_, page) in sample_pages(size) {
                let mut dst = vec![0u8; compress_bound(size)];
                let n = codec.compress(&page, &mut dst).unwrap();
                for _ in 0..64 {
                    let mut bad = dst[..n].to_vec();
                    let pos = rng.gen_range(0..n);
                    bad[pos] ^= 1 << rng.gen_range(0..8);
                    let _ = codec.decompress(&bad, &mut out);
                    let pos = rng.gen_range(0..n);
                    bad[pos] = rng.gen();
                    let _ = codec.decompress(&bad, &mut out);
                }
            }
        }
    }
}

#[test]
fn concurrent_use_from_four_threads() {
    let codecs = all_codecs();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let codecs = &codecs;
            s.spawn(move || {
                let mut dst = vec![0u8; compress_bound(65536)];
                for i in 0..40u64 {
                    let size = SUPPORTED_PAGE_SIZES_BYTES[(i % 3) as usize];
                    let page = if i % 2 == 0 {
                        text_page(size, t * 1000 + i)
                    } else {
                        random_page(size, t * 1000 + i)
                    };
                    for codec in codecs {
                        let n = codec.compress(&page, &mut dst).unwrap();
                        let mut out = vec![0u8; size];
                        codec.decompress(&dst[..n], &mut out).unwrap();
                        assert!(out == page, "{} thread {t} page {i}", codec.name());
                    }
                }
            });
        }
    });
}

#[test]
fn levels_on_one_thread_do_not_share_state_wrongly() {
    // Alternate levels on one thread: each must produce what a fresh context at that level
    // produces (compression is deterministic for a given level and input).
    let page = text_page(16384, 5);
    for name in ["zstd", "deflate", "lz4hc"] {
        let low = new_codec(name, CodecParams::with_level(Some(1))).unwrap();
        let high = new_codec(name, CodecParams::with_level(Some(9))).unwrap();
        let mut a = vec![0u8; compress_bound(page.len())];
        let mut b = a.clone();
        let first_low = low.compress(&page, &mut a).unwrap();
        let first = a[..first_low].to_vec();
        for _ in 0..3 {
            let nh = high.compress(&page, &mut b).unwrap();
            let nl = low.compress(&page, &mut a).unwrap();
            assert_eq!(&a[..nl], &first[..], "{name}: level 1 output changed");
            assert!(
                nh <= nl + 16,
                "{name}: level 9 ({nh}) much worse than level 1 ({nl})"
            );
        }
    }
}

#[test]
fn compress_bound_covers_every_library_bound() {
    for len in [0usize, 1, 8, 4096, 16384, 65536, 1 << 20] {
        let b = compress_bound(len);
        assert!(b >= lz4_flex::block::get_maximum_output_size(len));
        assert!(b >= ::lz4::block::compress_bound(len).unwrap());
        assert!(b >= ::zstd::zstd_safe::compress_bound(len));
        assert!(b >= len + 5 * (len / 65535 + 1));
    }
}

#[test]
fn same_filled_word_finds_same_pages_only() {
    for size in SUPPORTED_PAGE_SIZES_BYTES {
        assert_eq!(same_filled_word(&vec![0u8; size]), Some(0));
        for word in [1u64, u64::MAX, 0x0123_4567_89ab_cdef, 0x8000_0000_0000_0000] {
            let page = same_page(size, word);
            assert_eq!(same_filled_word(&page), Some(word));
            // One differing byte anywhere (first, last, middle, the remainder) is caught.
            for pos in [
                0,
                7,
                8,
                size / 2,
                size / 2 + 3,
                size - 70,
                size - 9,
                size - 1,
            ] {
                let mut p = page.clone();
                p[pos] ^= 0x10;
                assert_eq!(same_filled_word(&p), None, "size {size} pos {pos}");
            }
        }
        assert_eq!(same_filled_word(&text_page(size, 3)), None);
    }
    // Lengths that are not whole words, and lengths that are not whole cache lines.
    assert_eq!(same_filled_word(&[]), None);
    assert_eq!(same_filled_word(&[0u8; 12]), None);
    assert_eq!(
        same_filled_word(&[7u8; 8]),
        Some(u64::from_ne_bytes([7; 8]))
    );
    assert_eq!(
        same_filled_word(&[7u8; 72]),
        Some(u64::from_ne_bytes([7; 8]))
    );
    let mut p = [7u8; 72];
    p[67] = 0;
    assert_eq!(same_filled_word(&p), None);
}

#[test]
fn fill_same_inverts_same_filled_word() {
    for word in [0u64, 0x4242_4242_4242_4242, 0x0102_0304_0506_0708] {
        let mut page = vec![0xeeu8; 4096];
        fill_same(&mut page, word);
        assert_eq!(same_filled_word(&page), Some(word));
        assert_eq!(&page[..8], &word.to_ne_bytes());
    }
    let mut odd = [0u8; 11];
    fill_same(&mut odd, 0x0102_0304_0506_0708);
    assert_eq!(&odd[8..], &0x0102_0304_0506_0708u64.to_ne_bytes()[..3]);
}

/// `decompress_prefix` of a 64 KiB run: every codec gives at least the prefix asked for,
/// identical to the input; lz4 and lz4hc stop early (less than the whole for an early page);
/// corrupt input is `EIO`, never wrong bytes passed off as valid.
#[test]
fn prefix_decompression_of_a_run() {
    let run: Vec<u8> = (0..16).flat_map(|i| text_page(4096, 100 + i)).collect();
    for codec in all_codecs() {
        let mut comp = vec![0u8; compress_bound(run.len())];
        let len = codec.compress(&run, &mut comp).unwrap();
        for k in [0usize, 1, 7, 15] {
            let want = (k + 1) * 4096;
            let mut out = vec![0u8; run.len()];
            let valid = codec
                .decompress_prefix(&comp[..len], &mut out, want)
                .unwrap();
            assert!(
                (want..=run.len()).contains(&valid),
                "{}: {valid}",
                codec.name()
            );
            assert!(out[..valid] == run[..valid], "{} page {k}", codec.name());
            if codec.name().starts_with("lz4") && k == 0 {
                assert!(
                    valid < run.len() / 2,
                    "{} did not stop early: {valid}",
                    codec.name()
                );
            }
        }
        // Truncated input cannot reach a late prefix.
        let mut out = vec![0u8; run.len()];
        let e = codec
            .decompress_prefix(&comp[..len / 2], &mut out, run.len() - 4096)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{}", codec.name());
    }
}

#[test]
fn lz4_blocks_cross_between_liblz4_and_lz4_flex() {
    // The lz4 codec is liblz4; pages written by uzram builds that used lz4_flex (and any other
    // LZ4 block encoder) must still read back, and the other way round.
    let codec = new_codec("lz4", CodecParams::default()).unwrap();
    for size in SUPPORTED_PAGE_SIZES_BYTES {
        for (kind, page) in sample_pages(size) {
            let mut ours = vec![0u8; compress_bound(size)];
            let n = codec.compress(&page, &mut ours).unwrap();
            let mut out = vec![0u8; size];
            assert_eq!(
                lz4_flex::block::decompress_into(&ours[..n], &mut out).unwrap(),
                size,
                "{kind} {size}"
            );
            assert!(out == page, "{kind} {size}: liblz4 -> lz4_flex");
            let theirs = lz4_flex::block::compress(&page);
            out.fill(0);
            codec.decompress(&theirs, &mut out).unwrap();
            assert!(out == page, "{kind} {size}: lz4_flex -> liblz4");
        }
    }
}
