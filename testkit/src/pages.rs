//! The one page generator. Every page is made by [`fill_page`] from its kind, its index and a
//! version; every kind but the same-filled one carries the index and the version in its first
//! 16 bytes, so a page read back from the wrong place or from an older write shows. The kinds
//! are what zram tells apart: compressible text, half-random (compresses to about half),
//! random (incompressible: HUGE), same-filled (no memory at all), and real program bytes.
//!
//! Byte streams for I/O that is not page-shaped (NBD requests, block devices) come from
//! [`pattern`], which stamps every 512-byte sector with its index instead.

use uzram::compress::{compress_bound, new_codec};
use uzram::device::Device;

/// The page size most tests use.
pub const PAGE: usize = 4096;

/// What a page holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One 16-byte line naming the page and its version, repeated: compresses to a few bytes.
    Text,
    /// The first half random, the rest zero: compresses to about half a page.
    HalfRandom,
    /// Random bytes: incompressible, a HUGE page.
    Random,
    /// One non-zero 64-bit word repeated: a same-filled page, never stored.
    SameFilled,
}

/// The kind of page `i` in [`page`]'s cycle: text, half-random, random, same-filled.
pub fn mixed(i: u64) -> Kind {
    [Kind::Text, Kind::HalfRandom, Kind::Random, Kind::SameFilled][(i % 4) as usize]
}

/// The kind of page `i` in the swap hog's mix: half same-filled, three eighths text, one eighth
/// random.
pub fn swap_mix(i: u64) -> Kind {
    match i % 8 {
        0..=3 => Kind::SameFilled,
        4..=6 => Kind::Text,
        _ => Kind::Random,
    }
}

/// xorshift64 from a seed made of the page's index and version (odd: never the fixed point 0).
fn rng(i: u64, version: u64) -> impl FnMut() -> u64 {
    let mut x =
        (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.wrapping_mul(0xD1B5_4A32_D192_ED03)) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Writes page `i`, version `version`, of `kind` into `out` (any multiple of 16 bytes, at least
/// 16). Allocates only for [`Kind::Text`]'s one line, so a swap hog can fill hundreds of MiB
/// with it under emulation.
pub fn fill_page(kind: Kind, i: u64, version: u64, out: &mut [u8]) {
    assert!(
        out.len() >= 16 && out.len() % 16 == 0,
        "{} bytes",
        out.len()
    );
    let mut rnd = rng(i, version);
    match kind {
        Kind::Text => {
            let line = format!("page {i:6} v{version:3}");
            for c in out.chunks_mut(16) {
                c.copy_from_slice(&line.as_bytes()[..16]);
            }
        }
        Kind::HalfRandom => {
            let half = out.len() / 2;
            for c in out[..half].chunks_mut(8) {
                c.copy_from_slice(&rnd().to_le_bytes());
            }
            out[half..].fill(0);
        }
        Kind::Random => {
            for c in out.chunks_mut(8) {
                c.copy_from_slice(&rnd().to_le_bytes());
            }
        }
        Kind::SameFilled => {
            let w = (i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ version.wrapping_mul(0xD1B5_4A32_D192_ED03))
                | 1;
            for c in out.chunks_mut(8) {
                c.copy_from_slice(&w.to_le_bytes());
            }
            return;
        }
    }
    out[..8].copy_from_slice(&i.to_le_bytes());
    out[8..16].copy_from_slice(&version.to_le_bytes());
}

/// Page `i` of `kind`, version `version`, `len` bytes.
pub fn page_of(kind: Kind, i: u64, version: u64, len: usize) -> Vec<u8> {
    let mut p = vec![0u8; len];
    fill_page(kind, i, version, &mut p);
    p
}

/// Page `i`, version `version`, of [`PAGE`] bytes, its kind from the [`mixed`] cycle.
pub fn page(i: u64, version: u64) -> Vec<u8> {
    page_of(mixed(i), i, version, PAGE)
}

/// Which pages of the running program [`program_pages`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    /// Any page that is not one byte repeated.
    Any,
    /// Pages lz4 compresses to under half a page (so none is HUGE whatever the build).
    Lz4Halves,
    /// Pages lz4 compresses to under half a page and zstd to at most 3/4 of lz4's bytes (so
    /// recompression with zstd replaces every one).
    ZstdBeatsLz4,
}

/// `n` pages of real program bytes (the running test binary's own file: code and data compress
/// as program memory does), of [`PAGE`] bytes, chosen by `which`; page `i` is stamped with `i`
/// and `version` in its first 16 bytes, and versions take different program pages.
pub fn program_pages(n: usize, version: u64, which: Program) -> Vec<Vec<u8>> {
    let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let lz4 = new_codec("lz4", Default::default()).unwrap();
    let zstd = new_codec("zstd", Default::default()).unwrap();
    let mut dst = vec![0u8; compress_bound(PAGE)];
    let usable: Vec<&[u8]> = exe
        .chunks_exact(PAGE)
        .filter(|p| match which {
            Program::Any => p.iter().any(|&b| b != p[0]),
            Program::Lz4Halves => lz4.compress(p, &mut dst).unwrap() < PAGE / 2,
            Program::ZstdBeatsLz4 => {
                let l = lz4.compress(p, &mut dst).unwrap();
                let z = zstd.compress(p, &mut dst).unwrap();
                l < PAGE / 2 && z * 4 <= l * 3
            }
        })
        .collect();
    assert!(
        usable.len() >= 64,
        "the test binary has only {} usable pages",
        usable.len()
    );
    (0..n)
        .map(|i| {
            let k = (i * 5 + version as usize * 3) % usable.len();
            let mut p = usable[k].to_vec();
            p[..8].copy_from_slice(&(i as u64).to_le_bytes());
            p[8..16].copy_from_slice(&version.to_le_bytes());
            p
        })
        .collect()
}

/// Position-dependent, partly compressible bytes for I/O of any shape: each 512-byte sector
/// carries its own index (so a misplaced block is caught), some text, and pseudo-random bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for (i, sector) in v.chunks_mut(512).enumerate() {
        let head = format!("sector {i:010} seed {seed} uzram nbd test data ");
        let n = head.len().min(sector.len());
        sector[..n].copy_from_slice(&head.as_bytes()[..n]);
        for b in sector[n..].iter_mut().skip(200) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
    }
    v
}

/// Writes version `version` of pages `0..pages` ([`page`]).
pub fn fill(dev: &Device, pages: u64, version: u64) {
    for i in 0..pages {
        dev.write_at(&page(i, version), i * PAGE as u64).unwrap();
    }
}

/// Asserts that page `i` reads back as its version `version` ([`page`]).
pub fn check(dev: &Device, i: u64, version: u64) {
    let mut buf = vec![0u8; PAGE];
    dev.read_at(&mut buf, i * PAGE as u64).unwrap();
    assert!(
        buf == page(i, version),
        "page {i} (version {version}) differs"
    );
}

/// [`check`] for pages `0..pages`.
pub fn check_all(dev: &Device, pages: u64, version: u64) {
    for i in 0..pages {
        check(dev, i, version);
    }
}

/// Reads pages `0..pages`: each must read back as its version `version` ([`page`]) or fail
/// with `EIO`, never as other data. Returns the pages that failed.
pub fn identical_or_eio(dev: &Device, pages: u64, version: u64) -> Vec<u64> {
    let mut failed = Vec::new();
    let mut buf = vec![0u8; PAGE];
    for i in 0..pages {
        match dev.read_at(&mut buf, i * PAGE as u64) {
            Ok(()) => assert!(buf == page(i, version), "page {i} read back as other data"),
            Err(e) => {
                assert_eq!(e.errno(), libc::EIO, "page {i}: {e}");
                failed.push(i);
            }
        }
    }
    failed
}

/// Writes `pages` from page `first` on.
pub fn write_pages(dev: &Device, first: usize, pages: &[Vec<u8>]) {
    for (i, p) in pages.iter().enumerate() {
        dev.write_at(p, ((first + i) * p.len()) as u64).unwrap();
    }
}

/// Asserts that the pages from page `first` on read back as `pages`.
pub fn check_pages(dev: &Device, first: usize, pages: &[Vec<u8>]) {
    for (i, p) in pages.iter().enumerate() {
        let mut buf = vec![0u8; p.len()];
        dev.read_at(&mut buf, ((first + i) * p.len()) as u64)
            .unwrap();
        assert!(buf == *p, "page {} differs", first + i);
    }
}
