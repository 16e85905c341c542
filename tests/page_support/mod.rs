//! Test pages shared by the writeback and zoned tests (`mod page_support;`).

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
