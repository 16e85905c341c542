//! Test pages shared by the writeback and zoned tests (`mod page_support;`), and the device
//! helpers that write and check them. Not every test file uses every helper.
#![allow(dead_code)]

use uzram::device::Device;

/// The page size these tests use.
pub const PAGE: usize = 4096;

/// Page `i` of a test: kinds cycle through compressible text, half-random, random
/// (incompressible: HUGE) and same-filled; every non-same page is stamped with its index and
/// `version` so a misplaced or stale page is caught.
pub fn page(i: u64, version: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE];
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match i % 4 {
        0 => {
            for (k, c) in p.chunks_mut(16).enumerate() {
                let s = format!("page {i:6} v{version:3} {:4}", k % 97);
                c.copy_from_slice(&s.as_bytes()[..16]);
            }
        }
        1 => {
            for c in p[..PAGE / 2].chunks_mut(8) {
                c.copy_from_slice(&rnd().to_le_bytes());
            }
        }
        2 => {
            for c in p.chunks_mut(8) {
                c.copy_from_slice(&rnd().to_le_bytes());
            }
        }
        _ => {
            p.fill((i as u8) | 1);
            return p;
        }
    }
    p[..8].copy_from_slice(&i.to_le_bytes());
    p[8..16].copy_from_slice(&version.to_le_bytes());
    p
}

/// Writes version `version` of pages `0..pages`.
pub fn fill(dev: &Device, pages: u64, version: u64) {
    for i in 0..pages {
        dev.write_at(&page(i, version), i * PAGE as u64).unwrap();
    }
}

/// Asserts that page `i` reads back as its version `version`.
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

/// `bd_stat` as numbers: bd_count, bd_reads, bd_writes.
pub fn bd(dev: &Device) -> [u64; 3] {
    let s = dev.attr_show("bd_stat").unwrap();
    let v: Vec<u64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();
    [v[0], v[1], v[2]]
}
