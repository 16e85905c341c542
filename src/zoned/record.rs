//! The on-disk record: one written-back page in a zone's log. Byte layout in `docs/format.md`.
//!
//! ```text
//! 0      4         12        16    17     18      20      24
//! +------+---------+---------+-----+------+-------+-------+-----------------+---------+
//! | UZR1 | slot    | len     | prio| flags| 0 0   | crc32c| payload (len)   | 0 pad   |
//! +------+---------+---------+-----+------+-------+-------+-----------------+---------+
//! ```
//! Little-endian integers. `crc32c` covers bytes 0..20 and the payload. Records start at
//! multiples of [`RECORD_ALIGN_BYTES`] inside their zone, so every record can be read, and every
//! run of records relocated, with sector-aligned direct I/O.

use crate::error::{Error, Result};

/// Magic at the start of every record.
pub const RECORD_MAGIC: [u8; 4] = *b"UZR1";
/// Bytes of the record header.
pub const HEADER_BYTES: usize = 24;
/// Records start at multiples of this inside a zone (one sector).
pub const RECORD_ALIGN_BYTES: usize = 512;
/// Flag: the payload is a compressed object (else a raw page).
pub const FLAG_COMPRESSED: u8 = 1;

/// The decoded header of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// The slot (page index) the record holds.
    pub slot: u64,
    /// Payload bytes.
    pub len_bytes: u32,
    /// The codec the payload was compressed with: the slot's codec id, priority (bits 0..=1,
    /// 0 = primary) and dictionary generation (bits 2..=4).
    pub prio: u8,
    /// [`FLAG_COMPRESSED`] or 0.
    pub flags: u8,
}

impl RecordHeader {
    /// Whether the payload is a compressed object.
    pub fn is_compressed(&self) -> bool {
        self.flags & FLAG_COMPRESSED != 0
    }
}

/// Bytes a record with `payload_bytes` of payload occupies in its zone, padding included.
pub fn record_span_bytes(payload_bytes: usize) -> usize {
    (HEADER_BYTES + payload_bytes).next_multiple_of(RECORD_ALIGN_BYTES)
}

fn crc(head: &[u8], payload: &[u8]) -> u32 {
    crate::backing::verify::crc32c_of(&[&head[..20], payload])
}

/// Writes the record for `header` and `payload` at the start of `out` (which must hold
/// [`record_span_bytes`]), zeroing the padding. Returns the span.
pub fn encode(header: &RecordHeader, payload: &[u8], out: &mut [u8]) -> usize {
    assert_eq!(header.len_bytes as usize, payload.len());
    let span = record_span_bytes(payload.len());
    let out = &mut out[..span];
    out[0..4].copy_from_slice(&RECORD_MAGIC);
    out[4..12].copy_from_slice(&header.slot.to_le_bytes());
    out[12..16].copy_from_slice(&header.len_bytes.to_le_bytes());
    out[16] = header.prio;
    out[17] = header.flags;
    out[18..20].fill(0);
    let c = crc(out, payload);
    out[20..24].copy_from_slice(&c.to_le_bytes());
    out[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(payload);
    out[HEADER_BYTES + payload.len()..].fill(0);
    span
}

/// Parses and verifies the record at the start of `bytes`, which must be the record that
/// `expect_slot` points at: a wrong magic, slot, length or checksum is `EIO` (never wrong
/// data). Returns the header and the payload.
pub fn decode(bytes: &[u8], expect_slot: u64) -> Result<(RecordHeader, &[u8])> {
    if bytes.len() < HEADER_BYTES || bytes[0..4] != RECORD_MAGIC {
        return Err(Error::io(format!(
            "zoned record of slot {expect_slot}: bad magic"
        )));
    }
    let word = |r: std::ops::Range<usize>| -> [u8; 4] { bytes[r].try_into().expect("4 bytes") };
    let header = RecordHeader {
        slot: u64::from_le_bytes(bytes[4..12].try_into().expect("8 bytes")),
        len_bytes: u32::from_le_bytes(word(12..16)),
        prio: bytes[16],
        flags: bytes[17],
    };
    if header.slot != expect_slot {
        return Err(Error::io(format!(
            "zoned record holds slot {} where slot {expect_slot} was expected",
            header.slot
        )));
    }
    let end = HEADER_BYTES + header.len_bytes as usize;
    if end > bytes.len() {
        return Err(Error::io(format!(
            "zoned record of slot {expect_slot}: length {} past the record",
            header.len_bytes
        )));
    }
    let payload = &bytes[HEADER_BYTES..end];
    let stored = u32::from_le_bytes(word(20..24));
    if stored != crc(bytes, payload) {
        return Err(Error::io(format!(
            "zoned record of slot {expect_slot}: checksum mismatch"
        )));
    }
    Ok((header, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_corruption_is_eio() {
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let h = RecordHeader {
            slot: 42,
            len_bytes: 1000,
            prio: 1,
            flags: FLAG_COMPRESSED,
        };
        let mut buf = vec![0xffu8; 2048];
        let span = encode(&h, &payload, &mut buf);
        assert_eq!(span, 1024);
        assert!(buf[HEADER_BYTES + 1000..1024].iter().all(|&b| b == 0));
        let (got, p) = decode(&buf[..span], 42).unwrap();
        assert_eq!(got, h);
        assert_eq!(p, &payload[..]);
        assert_eq!(
            decode(&buf, 43).unwrap_err().kind(),
            crate::error::ErrorKind::Io
        );
        // Flip each byte of header and payload in turn: always detected.
        for i in (0..HEADER_BYTES + 1000).step_by(7) {
            let mut bad = buf.clone();
            bad[i] ^= 0x10;
            assert!(decode(&bad[..span], 42).is_err(), "byte {i}");
        }
    }

    #[test]
    fn spans_are_sector_multiples() {
        assert_eq!(record_span_bytes(0), 512);
        assert_eq!(record_span_bytes(488), 512);
        assert_eq!(record_span_bytes(489), 1024);
        assert_eq!(record_span_bytes(4096), 4608);
    }
}
