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
/// changed bytes. `crc32c` uses the SSE 4.2 / ARMv8 CRC instructions when the CPU has them.
pub fn block_crc(block: u64, data: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&block.to_le_bytes()), data)
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
