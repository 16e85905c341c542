//! What a backing device returns is checked, never trusted: the checksum of a written-back
//! block, and the count and log of data that failed a check.
//!
//! A backing device is a file, a shared block device or another machine: it can be truncated,
//! rewritten, or return other bytes than were written. Each layout keeps a CRC-32C of what it
//! wrote beside the location (the bitmap layout in the slot's value, see
//! `crate::store::target`; the zoned layout in each record's header, see
//! [`crate::zoned::record`]) and checks it on every read-back. A mismatch is `EIO` to the
//! reader, never other data; it is counted ([`Mismatches`], shown by `bd_checksum_errors`) and
//! logged once per device with the offset, so a failing device is visible without flooding the
//! log. Nothing else changes: the slot keeps pointing at its location, so a device that heals
//! (a remote one back from a bad state, a file restored) reads correctly again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::Error;

/// The CRC-32C of a written-back block: `block`'s index (little-endian) then its bytes.
/// Seeding with the index catches a block read from or written to the wrong place as well as
/// changed bytes.
pub fn block_crc(block: u64, data: &[u8]) -> u32 {
    crc32c_of(&[&block.to_le_bytes(), data])
}

/// The CRC-32C (Castagnoli, iSCSI) of `parts` in order: every checksum uzram keeps (blocks
/// here, zoned records in [`crate::zoned::record`]).
///
/// `crc-fast` folds with carry-less multiplication (PCLMULQDQ, VPCLMULQDQ with AVX-512, ARMv8
/// PMULL) when the CPU has it: 66-77 ns of CPU per 4 KiB page on this workplace's EPYC, where
/// the `crc32c` crate's SSE 4.2 `crc32` instructions took 157-190 ns (same run); the result is
/// the same CRC-32C (`tests::crc_fast_is_crc32c`).
pub fn crc32c_of(parts: &[&[u8]]) -> u32 {
    let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    for p in parts {
        d.update(p);
    }
    // A CRC-32 in the low 32 bits of the digest's u64.
    d.finalize() as u32
}

/// Reads whose data failed verification, for one backing device (one initialisation). The
/// first is logged to stderr with its offset; the rest only counted. Lock-free.
#[derive(Debug, Default)]
pub struct Mismatches {
    count: AtomicU64,
    logged: AtomicBool,
}

impl Mismatches {
    /// Counts a read of `what` at byte `offset` of `device` whose data did not verify
    /// (`why`), logs it if it is the device's first, and returns the `EIO` for the reader.
    pub fn note(&self, device: &str, offset: u64, what: &str, why: &str) -> Error {
        self.count.fetch_add(1, Ordering::Relaxed);
        let msg = format!(
            "{device}: {what} at byte offset {offset} failed verification ({why}): data \
             changed on the backing device"
        );
        if !self.logged.swap(true, Ordering::Relaxed) {
            eprintln!(
                "uzram: {msg} (the first on this device; further mismatches are counted in \
                 bd_checksum_errors, not logged)"
            );
        }
        Error::io(msg)
    }

    /// Mismatches so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_fast_is_crc32c() {
        // The CRC-32C check value (RFC 3720's polynomial, "123456789").
        assert_eq!(crc32c_of(&[b"123456789"]), 0xE306_9283);
        assert_eq!(crc32c_of(&[b"1234", b"56789"]), 0xE306_9283);
        assert_eq!(crc32c_of(&[]), 0);
    }

    #[test]
    fn crc_depends_on_block_and_every_byte() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
        let c = block_crc(7, &data);
        assert_ne!(c, block_crc(8, &data));
        for i in (0..data.len()).step_by(97) {
            let mut bad = data.clone();
            bad[i] ^= 1;
            assert_ne!(c, block_crc(7, &bad), "byte {i}");
        }
        assert_ne!(c, block_crc(7, &[0u8; 4096]));
    }

    #[test]
    fn counts_every_mismatch_and_says_eio() {
        let m = Mismatches::default();
        for i in 0..3 {
            let e = m.note("/dev/x", i * 4096, "block", "crc");
            assert_eq!(e.errno(), libc::EIO);
            assert!(e.message().contains(&format!("offset {}", i * 4096)));
        }
        assert_eq!(m.count(), 3);
    }
}
