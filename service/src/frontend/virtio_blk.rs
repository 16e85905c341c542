//! virtio-blk requests (virtio 1.2, 5.2.6 "Device Operation") parsed from what a descriptor
//! chain holds, by one pure function: [`parse`]. The vhost-user frontend reads a chain's
//! descriptors out of guest memory (checking each lies in it), hands this module their sizes,
//! directions and first bytes, and serves what [`parse`] returns; nothing here touches memory
//! or the device, so every rule is tested on its own and fuzzed (`tests/vhost_user_fuzz.rs`).
//!
//! A request is a chain of device-readable descriptors (the 16-byte header, then a write's
//! data or a discard's segment) followed by device-writable ones (a read's data, then the
//! status byte, the last byte of the last non-empty one). The rules, each refusing with the
//! status the device answers (`VIRTIO_BLK_S_IOERR` for a malformed request,
//! `VIRTIO_BLK_S_UNSUPP` for one it does not offer), or with no status at all when the chain
//! has nowhere to put one:
//!
//! 1. a device-writable byte for the status (else the chain goes back unused);
//! 2. no more descriptors than `seg_max` data segments and the header or status;
//! 3. every device-readable descriptor before every device-writable one;
//! 4. a whole header;
//! 5. a type the device offers: read, write, flush, get-id, discard, write-zeroes;
//! 6. data in the direction of the type: a read's device-writable, a write's, a discard's and
//!    a write-zeroes' device-readable, none for a flush, device-writable for get-id;
//! 7. exactly one discard or write-zeroes segment (the device offers `max_discard_seg` =
//!    `max_write_zeroes_seg` = 1);
//! 8. sectors inside the device, with no overflow of the byte offset;
//! 9. no discard flags, and no write-zeroes flag but `unmap`.

use virtio_bindings::virtio_blk as blk;

/// `struct virtio_blk_outhdr`: type (le32), ioprio (le32), sector (le64).
pub const OUTHDR_BYTES: usize = 16;
/// `struct virtio_blk_discard_write_zeroes`: sector (le64), num_sectors (le32), flags (le32).
pub const SEGMENT_BYTES: usize = 16;
/// A virtio-blk sector is 512 bytes, whatever the device's block size.
pub const SECTOR_SHIFT: u32 = 9;
/// How many of the device-readable stream's first bytes [`parse`] looks at: the header and
/// one segment.
pub const HEAD_BYTES: usize = OUTHDR_BYTES + SEGMENT_BYTES;

/// What [`parse`] sees of a descriptor chain.
#[derive(Debug, Clone, Copy, Default)]
pub struct Chain<'a> {
    /// The first bytes of the device-readable stream: [`HEAD_BYTES`] of them, or all of it
    /// when it is shorter.
    pub head: &'a [u8],
    /// The device-readable bytes, header included.
    pub readable_bytes: u64,
    /// The device-writable bytes but the status byte.
    pub writable_bytes: u64,
    /// A device-writable byte is there for the status.
    pub has_status: bool,
    /// Some device-readable descriptor comes after a device-writable one.
    pub readable_after_writable: bool,
    /// More descriptors of one direction than `seg_max` segments and the header or status.
    pub too_many_segments: bool,
}

/// A well-formed request, its range checked against the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlkRequest {
    /// `len` bytes at byte `offset` of the device into the device-writable stream.
    Read {
        offset: u64,
        len: u64,
    },
    /// The `len` bytes after the header in the device-readable stream to byte `offset`.
    Write {
        offset: u64,
        len: u64,
    },
    Flush,
    /// The device's id string, into the first `len` bytes of the device-writable stream (as
    /// much of its `VIRTIO_BLK_ID_BYTES` as that holds).
    GetId {
        len: u64,
    },
    Discard {
        offset: u64,
        len: u64,
    },
    /// Zeroes, `unmap` allowed (uzram frees zeroed pages either way).
    WriteZeroes {
        offset: u64,
        len: u64,
    },
}

/// Why a chain is no request the device serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// No device-writable byte for the status: the chain goes back unused.
    NoStatus,
    /// Malformed: `VIRTIO_BLK_S_IOERR`.
    Malformed(&'static str),
    /// A type or flag the device does not offer: `VIRTIO_BLK_S_UNSUPP`.
    Unsupported(&'static str),
}

impl Refused {
    /// The status byte the device answers with (none for [`Refused::NoStatus`]).
    pub fn status(self) -> Option<u8> {
        match self {
            Refused::NoStatus => None,
            Refused::Malformed(_) => Some(blk::VIRTIO_BLK_S_IOERR as u8),
            Refused::Unsupported(_) => Some(blk::VIRTIO_BLK_S_UNSUPP as u8),
        }
    }
}

/// Parses the request `chain` holds for a device of `device_bytes`, by the rules of the module
/// documentation, in their order.
pub fn parse(chain: &Chain<'_>, device_bytes: u64) -> Result<BlkRequest, Refused> {
    use Refused::{Malformed, Unsupported};
    if !chain.has_status {
        return Err(Refused::NoStatus);
    }
    if chain.too_many_segments {
        return Err(Malformed("more descriptors than seg_max allows"));
    }
    if chain.readable_after_writable {
        return Err(Malformed(
            "a device-readable descriptor after a device-writable one",
        ));
    }
    let head = chain.head;
    if head.len() < OUTHDR_BYTES || chain.readable_bytes < OUTHDR_BYTES as u64 {
        return Err(Malformed("no whole header"));
    }
    let kind = le32(&head[0..4]);
    let sector = le64(&head[8..16]);
    // The device-readable bytes after the header (a write's data, a segment).
    let payload = chain.readable_bytes - OUTHDR_BYTES as u64;
    let writable = chain.writable_bytes;
    match kind {
        blk::VIRTIO_BLK_T_IN => {
            if payload != 0 {
                return Err(Malformed("a read with device-readable data"));
            }
            let offset = range(sector, writable, device_bytes)?;
            Ok(BlkRequest::Read {
                offset,
                len: writable,
            })
        }
        blk::VIRTIO_BLK_T_OUT => {
            if writable != 0 {
                return Err(Malformed("a write with device-writable data"));
            }
            let offset = range(sector, payload, device_bytes)?;
            Ok(BlkRequest::Write {
                offset,
                len: payload,
            })
        }
        blk::VIRTIO_BLK_T_FLUSH => {
            if payload != 0 || writable != 0 {
                return Err(Malformed("a flush with data"));
            }
            Ok(BlkRequest::Flush)
        }
        blk::VIRTIO_BLK_T_GET_ID => {
            if payload != 0 {
                return Err(Malformed("a get-id with device-readable data"));
            }
            Ok(BlkRequest::GetId {
                len: writable.min(u64::from(blk::VIRTIO_BLK_ID_BYTES)),
            })
        }
        blk::VIRTIO_BLK_T_DISCARD | blk::VIRTIO_BLK_T_WRITE_ZEROES => {
            if writable != 0 {
                return Err(Malformed(
                    "a discard or write-zeroes with device-writable data",
                ));
            }
            if payload != SEGMENT_BYTES as u64 || head.len() < HEAD_BYTES {
                return Err(Malformed("not exactly one segment"));
            }
            let seg = &head[OUTHDR_BYTES..HEAD_BYTES];
            let sector = le64(&seg[0..8]);
            let len = u64::from(le32(&seg[8..12])) << SECTOR_SHIFT;
            let flags = le32(&seg[12..16]);
            let offset = range(sector, len, device_bytes)?;
            if kind == blk::VIRTIO_BLK_T_DISCARD {
                if flags != 0 {
                    return Err(Unsupported("discard flags (the spec: they must be zero)"));
                }
                Ok(BlkRequest::Discard { offset, len })
            } else {
                if flags & !blk::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 {
                    return Err(Unsupported("write-zeroes flags other than unmap"));
                }
                Ok(BlkRequest::WriteZeroes { offset, len })
            }
        }
        _ => Err(Unsupported("request type")),
    }
}

/// The byte offset of `len` bytes at `sector`, when they lie in a device of `device_bytes`.
fn range(sector: u64, len: u64, device_bytes: u64) -> Result<u64, Refused> {
    let outside = Refused::Malformed("sectors outside the device");
    let offset = sector.checked_mul(1 << SECTOR_SHIFT).ok_or(outside)?;
    match offset.checked_add(len) {
        Some(end) if end <= device_bytes => Ok(offset),
        _ => Err(outside),
    }
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().expect("4 bytes"))
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEVICE: u64 = 1 << 20;
    const SECTORS: u64 = DEVICE >> SECTOR_SHIFT;

    /// The head of a request of `kind` at `sector`, with `seg` after the header.
    fn head(kind: u32, sector: u64, seg: &[u8]) -> Vec<u8> {
        let mut h = kind.to_le_bytes().to_vec();
        h.extend_from_slice(&7u32.to_le_bytes()); // ioprio: ignored
        h.extend_from_slice(&sector.to_le_bytes());
        h.extend_from_slice(seg);
        h
    }

    fn segment(sector: u64, sectors: u32, flags: u32) -> Vec<u8> {
        [
            &sector.to_le_bytes()[..],
            &sectors.to_le_bytes(),
            &flags.to_le_bytes(),
        ]
        .concat()
    }

    /// A well-formed chain's view: `head`, `payload` more device-readable bytes than it holds
    /// past the header, `writable` device-writable data bytes, and a status byte.
    fn chain(head: &[u8], payload: u64, writable: u64) -> Chain<'_> {
        Chain {
            head: &head[..head.len().min(HEAD_BYTES)],
            readable_bytes: OUTHDR_BYTES as u64 + payload,
            writable_bytes: writable,
            has_status: true,
            ..Chain::default()
        }
    }

    fn malformed(r: Result<BlkRequest, Refused>) {
        assert!(matches!(r, Err(Refused::Malformed(_))), "{r:?}");
        assert_eq!(r.unwrap_err().status(), Some(blk::VIRTIO_BLK_S_IOERR as u8));
    }

    fn unsupported(r: Result<BlkRequest, Refused>) {
        assert!(matches!(r, Err(Refused::Unsupported(_))), "{r:?}");
        assert_eq!(
            r.unwrap_err().status(),
            Some(blk::VIRTIO_BLK_S_UNSUPP as u8)
        );
    }

    #[test]
    fn well_formed_requests_parse() {
        let h = head(blk::VIRTIO_BLK_T_IN, 8, &[]);
        assert_eq!(
            parse(&chain(&h, 0, 4096), DEVICE),
            Ok(BlkRequest::Read {
                offset: 4096,
                len: 4096
            })
        );
        let h = head(blk::VIRTIO_BLK_T_OUT, 16, &[]);
        assert_eq!(
            parse(&chain(&h, 8192, 0), DEVICE),
            Ok(BlkRequest::Write {
                offset: 8192,
                len: 8192
            })
        );
        let h = head(blk::VIRTIO_BLK_T_FLUSH, 0, &[]);
        assert_eq!(parse(&chain(&h, 0, 0), DEVICE), Ok(BlkRequest::Flush));
        let h = head(blk::VIRTIO_BLK_T_GET_ID, 0, &[]);
        assert_eq!(
            parse(&chain(&h, 0, 20), DEVICE),
            Ok(BlkRequest::GetId { len: 20 })
        );
        // A longer buffer gets the 20 bytes; a shorter one what fits.
        assert_eq!(
            parse(&chain(&h, 0, 512), DEVICE),
            Ok(BlkRequest::GetId { len: 20 })
        );
        assert_eq!(
            parse(&chain(&h, 0, 3), DEVICE),
            Ok(BlkRequest::GetId { len: 3 })
        );
        let h = head(blk::VIRTIO_BLK_T_DISCARD, 0, &segment(2, 8, 0));
        assert_eq!(
            parse(&chain(&h, 16, 0), DEVICE),
            Ok(BlkRequest::Discard {
                offset: 1024,
                len: 4096
            })
        );
        for flags in [0, blk::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP] {
            let h = head(blk::VIRTIO_BLK_T_WRITE_ZEROES, 0, &segment(0, 8, flags));
            assert_eq!(
                parse(&chain(&h, 16, 0), DEVICE),
                Ok(BlkRequest::WriteZeroes {
                    offset: 0,
                    len: 4096
                })
            );
        }
        // A zero-length read or write is a request too (of nothing).
        let h = head(blk::VIRTIO_BLK_T_IN, SECTORS, &[]);
        assert_eq!(
            parse(&chain(&h, 0, 0), DEVICE),
            Ok(BlkRequest::Read {
                offset: DEVICE,
                len: 0
            })
        );
    }

    #[test]
    fn a_chain_without_a_status_byte_has_no_status() {
        let h = head(blk::VIRTIO_BLK_T_IN, 0, &[]);
        let c = Chain {
            has_status: false,
            ..chain(&h, 0, 4096)
        };
        assert_eq!(parse(&c, DEVICE), Err(Refused::NoStatus));
        assert_eq!(Refused::NoStatus.status(), None);
        // Whatever else is wrong with it.
        let c = Chain {
            has_status: false,
            too_many_segments: true,
            head: &[],
            ..Chain::default()
        };
        assert_eq!(parse(&c, DEVICE), Err(Refused::NoStatus));
    }

    #[test]
    fn too_many_segments_is_an_io_error() {
        let h = head(blk::VIRTIO_BLK_T_IN, 0, &[]);
        malformed(parse(
            &Chain {
                too_many_segments: true,
                ..chain(&h, 0, 4096)
            },
            DEVICE,
        ));
    }

    #[test]
    fn readable_after_writable_is_an_io_error() {
        let h = head(blk::VIRTIO_BLK_T_OUT, 0, &[]);
        malformed(parse(
            &Chain {
                readable_after_writable: true,
                ..chain(&h, 4096, 0)
            },
            DEVICE,
        ));
    }

    #[test]
    fn a_short_header_is_an_io_error() {
        let h = head(blk::VIRTIO_BLK_T_IN, 0, &[]);
        for n in [0, 1, 8, 15] {
            let c = Chain {
                head: &h[..n],
                readable_bytes: n as u64,
                writable_bytes: 4096,
                has_status: true,
                ..Chain::default()
            };
            malformed(parse(&c, DEVICE));
        }
        // Even of a type the device does not offer: the type is in the header.
        let h = head(99, 0, &[]);
        let c = Chain {
            head: &h[..12],
            readable_bytes: 12,
            ..chain(&h, 0, 0)
        };
        malformed(parse(&c, DEVICE));
    }

    #[test]
    fn unknown_types_are_unsupported() {
        for kind in [2, 3, 5, 9, 10, 14, 99, u32::MAX] {
            let h = head(kind, 0, &[]);
            unsupported(parse(&chain(&h, 0, 0), DEVICE));
            unsupported(parse(&chain(&h, 512, 512), DEVICE));
        }
    }

    #[test]
    fn data_in_the_wrong_direction_is_an_io_error() {
        let read = head(blk::VIRTIO_BLK_T_IN, 0, &[]);
        malformed(parse(&chain(&read, 512, 4096), DEVICE));
        let write = head(blk::VIRTIO_BLK_T_OUT, 0, &[]);
        malformed(parse(&chain(&write, 4096, 512), DEVICE));
        let flush = head(blk::VIRTIO_BLK_T_FLUSH, 0, &[]);
        malformed(parse(&chain(&flush, 512, 0), DEVICE));
        malformed(parse(&chain(&flush, 0, 512), DEVICE));
        let id = head(blk::VIRTIO_BLK_T_GET_ID, 0, &[]);
        malformed(parse(&chain(&id, 20, 20), DEVICE));
        for kind in [blk::VIRTIO_BLK_T_DISCARD, blk::VIRTIO_BLK_T_WRITE_ZEROES] {
            let h = head(kind, 0, &segment(0, 8, 0));
            malformed(parse(&chain(&h, 16, 16), DEVICE));
        }
    }

    #[test]
    fn discard_and_write_zeroes_take_exactly_one_segment() {
        for kind in [blk::VIRTIO_BLK_T_DISCARD, blk::VIRTIO_BLK_T_WRITE_ZEROES] {
            let two = [segment(0, 8, 0), segment(8, 8, 0)].concat();
            let h = head(kind, 0, &two);
            malformed(parse(&chain(&h, 32, 0), DEVICE));
            malformed(parse(&chain(&h[..28], 12, 0), DEVICE));
            malformed(parse(&chain(&h[..16], 0, 0), DEVICE));
            // The stream says 16 bytes follow the header but the head holds fewer.
            let c = Chain {
                head: &h[..20],
                ..chain(&h, 16, 0)
            };
            malformed(parse(&c, DEVICE));
        }
    }

    #[test]
    fn sectors_outside_the_device_are_an_io_error() {
        // The last page is inside; a sector further, or a byte more, is not.
        let last = head(blk::VIRTIO_BLK_T_OUT, SECTORS - 8, &[]);
        assert!(parse(&chain(&last, 4096, 0), DEVICE).is_ok());
        malformed(parse(&chain(&last, 4097, 0), DEVICE));
        for sector in [SECTORS - 7, SECTORS, u64::MAX >> 1, u64::MAX] {
            let w = head(blk::VIRTIO_BLK_T_OUT, sector, &[]);
            malformed(parse(&chain(&w, 4096, 0), DEVICE));
            let r = head(blk::VIRTIO_BLK_T_IN, sector, &[]);
            malformed(parse(&chain(&r, 0, 4096), DEVICE));
        }
        // The offset that wraps: sector * 512 overflows, or offset + len does.
        let r = head(blk::VIRTIO_BLK_T_IN, u64::MAX / 512, &[]);
        malformed(parse(&chain(&r, 0, u64::MAX), DEVICE));
        for kind in [blk::VIRTIO_BLK_T_DISCARD, blk::VIRTIO_BLK_T_WRITE_ZEROES] {
            let h = head(kind, 0, &segment(SECTORS - 4, 8, 0));
            malformed(parse(&chain(&h, 16, 0), DEVICE));
            let h = head(kind, 0, &segment(u64::MAX, u32::MAX, 0));
            malformed(parse(&chain(&h, 16, 0), DEVICE));
        }
        // The header's sector is not a discard's: the segment's is.
        let h = head(blk::VIRTIO_BLK_T_DISCARD, u64::MAX, &segment(0, 8, 0));
        assert!(parse(&chain(&h, 16, 0), DEVICE).is_ok());
    }

    #[test]
    fn discard_flags_and_write_zeroes_flags_but_unmap_are_unsupported() {
        for flags in [1, 2, u32::MAX] {
            let h = head(blk::VIRTIO_BLK_T_DISCARD, 0, &segment(0, 8, flags));
            unsupported(parse(&chain(&h, 16, 0), DEVICE));
        }
        for flags in [2, 3, u32::MAX] {
            let h = head(blk::VIRTIO_BLK_T_WRITE_ZEROES, 0, &segment(0, 8, flags));
            unsupported(parse(&chain(&h, 16, 0), DEVICE));
        }
        // A range outside the device is checked first.
        let h = head(blk::VIRTIO_BLK_T_DISCARD, 0, &segment(SECTORS, 8, 1));
        malformed(parse(&chain(&h, 16, 0), DEVICE));
    }
}
