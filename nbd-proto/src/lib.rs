//! The NBD wire format: constants, message layouts and pure parsing and encoding, shared by
//! uzram's NBD server (`uzram-service`) and its NBD backing client (`uzram::backing::nbd`),
//! and the loading of x509 credentials both sides use for TLS ([`tls`]).
//!
//! Everything here follows `doc/proto.md` of the NetworkBlockDevice project (fixed newstyle
//! negotiation, simple and structured replies). All integers on the wire are big-endian.
//! Nothing at the crate root does I/O or keeps state, so it can be fed arbitrary bytes: parsers
//! return a value or an error, they never panic (the fuzz test `service/tests/nbd_fuzz.rs`
//! holds them to that).

pub mod tls;

/// A sector: the unit of NBD's minimum block size here.
const SECTOR_SIZE_BYTES: usize = 512;

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle magic the server sends, and the magic of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// The magic of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// The magic of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// The magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// The magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: omit the 124 zero bytes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;
/// Every client flag this server knows; any other bit set means the connection is dropped.
pub const KNOWN_CLIENT_FLAGS: u32 = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;

/// Transmission flag: MUST always be set.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: the export is read-only (never set by uzram).
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: `NBD_CMD_FLUSH` is supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: `NBD_CMD_FLAG_FUA` is supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: `NBD_CMD_TRIM` is supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: `NBD_CMD_WRITE_ZEROES` (and `NBD_CMD_FLAG_NO_HOLE`) are supported.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: `NBD_CMD_FLAG_DF` is supported (only with structured replies).
pub const TFLAG_SEND_DF: u16 = 1 << 7;
/// Transmission flag: several connections may be used at once; flushes are visible to all.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag: `NBD_CMD_CACHE` is supported.
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
/// Transmission flag: `NBD_CMD_FLAG_FAST_ZERO` is supported.
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

/// Option: choose an export and enter transmission (no error reply possible).
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option: end the negotiation.
pub const OPT_ABORT: u32 = 2;
/// Option: list the exports.
pub const OPT_LIST: u32 = 3;
/// Option: upgrade to TLS (TCP listeners with `--tls`).
pub const OPT_STARTTLS: u32 = 5;
/// Option: describe an export.
pub const OPT_INFO: u32 = 6;
/// Option: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// Option: use structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// Option: list the metadata contexts matching the queries.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Option: select metadata contexts for `NBD_CMD_BLOCK_STATUS`.
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option reply: success (or end of a list).
pub const REP_ACK: u32 = 1;
/// Option reply: one export of `NBD_OPT_LIST`.
pub const REP_SERVER: u32 = 2;
/// Option reply: one piece of information for `NBD_OPT_INFO`/`NBD_OPT_GO`.
pub const REP_INFO: u32 = 3;
/// Option reply: a metadata context (id, name).
pub const REP_META_CONTEXT: u32 = 4;
/// Option error: the option is unknown to this server.
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
/// Option error: known but forbidden by policy.
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
/// Option error: syntactically or semantically invalid.
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
/// Option error: TLS must be negotiated first.
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
/// Option error: the export does not exist.
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
/// Option error: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
/// Option error: the request is too large to process.
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

/// Information type: export size and transmission flags (always sent).
pub const INFO_EXPORT: u16 = 0;
/// Information type: the canonical export name.
pub const INFO_NAME: u16 = 1;
/// Information type: a human-readable description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Information type: block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command: read.
pub const CMD_READ: u16 = 0;
/// Command: write (payload follows the header).
pub const CMD_WRITE: u16 = 1;
/// Command: soft disconnect (no reply).
pub const CMD_DISC: u16 = 2;
/// Command: flush.
pub const CMD_FLUSH: u16 = 3;
/// Command: trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Command: cache hint (answered as a no-op; some clients send it unadvertised).
pub const CMD_CACHE: u16 = 5;
/// Command: write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// Command: block status of a range, in the selected metadata contexts.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flag: force unit access (persist before replying).
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag: `NBD_CMD_WRITE_ZEROES` must not create a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag: do not fragment the read reply.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag: `NBD_CMD_BLOCK_STATUS` answers one extent, no longer than the request.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag: fail `NBD_CMD_WRITE_ZEROES` with `ENOTSUP` unless it is fast.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Structured reply flag: the last chunk of a reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// Structured reply type: no payload; final chunk of a successful reply.
pub const REPLY_TYPE_NONE: u16 = 0;
/// Structured reply type: data at an offset.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Structured reply type: a hole (zeros) at an offset.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// Structured reply type: block status (only with a negotiated metadata context).
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Structured reply type: an error with a message.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
/// Structured reply type: an error with a message and the offset it happened at.
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;
/// Structured reply types with this bit are errors (known or not).
pub const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;

/// NBD error: operation not permitted.
pub const NBD_EPERM: u32 = 1;
/// NBD error: I/O error.
pub const NBD_EIO: u32 = 5;
/// NBD error: out of memory (the spec asks servers to avoid it).
pub const NBD_ENOMEM: u32 = 12;
/// NBD error: invalid argument.
pub const NBD_EINVAL: u32 = 22;
/// NBD error: no space left.
pub const NBD_ENOSPC: u32 = 28;
/// NBD error: value too large.
pub const NBD_EOVERFLOW: u32 = 75;
/// NBD error: operation not supported.
pub const NBD_ENOTSUP: u32 = 95;
/// NBD error: the server is shutting down.
pub const NBD_ESHUTDOWN: u32 = 108;

/// The minimum block size advertised: a sector, the device's own unit (sub-page requests go
/// through its read-modify-write path). A client that asks for block sizes keeps to it; one
/// that does not may send any byte offset and length ([`ExportLimits::min_block_bytes`] 1, as
/// the protocol asks of a server then), served by the device's byte-granular forms.
pub const MIN_BLOCK_SIZE_BYTES: u32 = SECTOR_SIZE_BYTES as u32;
/// The maximum payload of one `NBD_CMD_READ`/`NBD_CMD_WRITE`: 64 MiB, nbdkit's (the protocol
/// asks servers to take at least 32 MiB); every payload is charged to the server's memory
/// budget, whose minimum is one such request.
pub const MAX_PAYLOAD_BYTES: u32 = 64 << 20;
/// The largest option request accepted. The largest legal option this server understands is
/// `NBD_OPT_GO` with a 4096-byte name and every information type listed a few times; 64 KiB is
/// far above that and still harmless to buffer.
pub const MAX_OPTION_BYTES: u32 = 64 << 10;
/// The longest string (export name, description) the protocol allows.
pub const MAX_STRING_BYTES: usize = 4096;

/// The size of a transmission request header.
pub const REQUEST_HEADER_BYTES: usize = 28;
/// The size of a simple reply header.
pub const SIMPLE_REPLY_HEADER_BYTES: usize = 16;
/// The size of a structured reply chunk header.
pub const STRUCTURED_REPLY_HEADER_BYTES: usize = 20;
/// The size of an option request header (after which `length` data bytes follow).
pub const OPTION_HEADER_BYTES: usize = 16;

/// The server's greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub fn encode_greeting() -> [u8; 18] {
    let mut b = [0u8; 18];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    b
}

/// An option request header (`IHAVEOPT`, option, data length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// The option code.
    pub option: u32,
    /// The length of the data that follows.
    pub length: u32,
}

impl OptionHeader {
    /// Parses an option header; `None` if the magic is wrong (a protocol violation).
    pub fn parse(b: &[u8; OPTION_HEADER_BYTES]) -> Option<OptionHeader> {
        if be_u64(&b[0..8]) != IHAVEOPT {
            return None;
        }
        Some(OptionHeader {
            option: be_u32(&b[8..12]),
            length: be_u32(&b[12..16]),
        })
    }
}

/// Appends an option reply (header and data) to `out`.
pub fn encode_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[u8]) {
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// The one metadata context served: `base:allocation` (holes and zeroes).
pub const META_BASE_ALLOCATION: &str = "base:allocation";
/// Its context id in `NBD_REP_META_CONTEXT` and block status replies.
pub const META_BASE_ALLOCATION_ID: u32 = 1;
/// `base:allocation` flag: the extent is not allocated (a hole).
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` flag: the extent reads as zeroes.
pub const STATE_ZERO: u32 = 1 << 1;

/// The data of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`: the export, then the
/// queries (context names or namespace wildcards such as `base:`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    /// The export name (empty: the default export).
    pub name: String,
    /// The queries, in order.
    pub queries: Vec<String>,
}

impl MetaContextRequest {
    /// Parses the option data; `None` if it is malformed (lengths that do not add up, strings
    /// over 4096 bytes or not UTF-8): the caller answers `NBD_REP_ERR_INVALID`. The option's
    /// data is bounded by [`MAX_OPTION_BYTES`], so the queries are too.
    pub fn parse(data: &[u8]) -> Option<MetaContextRequest> {
        fn string(data: &[u8], at: usize) -> Option<(String, usize)> {
            let len = be_u32(data.get(at..at.checked_add(4)?)?) as usize;
            if len > MAX_STRING_BYTES {
                return None;
            }
            let start = at + 4;
            let s = std::str::from_utf8(data.get(start..start.checked_add(len)?)?).ok()?;
            Some((s.to_string(), start + len))
        }
        let (name, mut at) = string(data, 0)?;
        let count = be_u32(data.get(at..at + 4)?) as usize;
        at += 4;
        let mut queries = Vec::new();
        for _ in 0..count {
            let (q, next) = string(data, at)?;
            queries.push(q);
            at = next;
        }
        (at == data.len()).then_some(MetaContextRequest { name, queries })
    }
}

/// `NBD_REP_META_CONTEXT`'s payload: the context id, then its name.
pub fn encode_meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut d = Vec::with_capacity(4 + name.len());
    d.extend_from_slice(&id.to_be_bytes());
    d.extend_from_slice(name.as_bytes());
    d
}

/// The data of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// The export name (empty: the default export).
    pub name: String,
    /// The information types the client asked for.
    pub requests: Vec<u16>,
}

impl InfoRequest {
    /// Parses the option data; `None` if it is malformed (lengths that do not add up, a name
    /// over 4096 bytes or not UTF-8): the caller answers `NBD_REP_ERR_INVALID`.
    pub fn parse(data: &[u8]) -> Option<InfoRequest> {
        let name_len = be_u32(data.get(0..4)?) as usize;
        if name_len > MAX_STRING_BYTES {
            return None;
        }
        let name_end = 4usize.checked_add(name_len)?;
        let name = std::str::from_utf8(data.get(4..name_end)?).ok()?;
        let count = usize::from(be_u16(data.get(name_end..name_end + 2)?));
        let list = data.get(name_end + 2..)?;
        if list.len() != count * 2 {
            return None;
        }
        let requests = list.chunks_exact(2).map(be_u16).collect();
        Some(InfoRequest {
            name: name.to_string(),
            requests,
        })
    }
}

/// `NBD_INFO_EXPORT`'s payload: type, size, transmission flags.
pub fn encode_info_export(size_bytes: u64, transmission_flags: u16) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
    b[2..10].copy_from_slice(&size_bytes.to_be_bytes());
    b[10..12].copy_from_slice(&transmission_flags.to_be_bytes());
    b
}

/// `NBD_INFO_BLOCK_SIZE`'s payload: type, minimum, preferred, maximum.
pub fn encode_info_block_size(min: u32, preferred: u32, max: u32) -> [u8; 14] {
    let mut b = [0u8; 14];
    b[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b[2..6].copy_from_slice(&min.to_be_bytes());
    b[6..10].copy_from_slice(&preferred.to_be_bytes());
    b[10..14].copy_from_slice(&max.to_be_bytes());
    b
}

/// `NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION`'s payload: type and string.
pub fn encode_info_string(info_type: u16, s: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(2 + s.len());
    b.extend_from_slice(&info_type.to_be_bytes());
    b.extend_from_slice(s.as_bytes());
    b
}

/// A transmission request header, as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub command: u16,
    /// The client's cookie ("handle"), echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length (for writes, the payload that follows).
    pub length: u32,
}

impl RequestHeader {
    /// Parses a request header; `None` if the magic is wrong (the stream is out of sync and
    /// the connection must be dropped).
    pub fn parse(b: &[u8; REQUEST_HEADER_BYTES]) -> Option<RequestHeader> {
        if be_u32(&b[0..4]) != REQUEST_MAGIC {
            return None;
        }
        Some(RequestHeader {
            flags: be_u16(&b[4..6]),
            command: be_u16(&b[6..8]),
            cookie: be_u64(&b[8..16]),
            offset: be_u64(&b[16..24]),
            length: be_u32(&b[24..28]),
        })
    }

    /// Encodes the header (used by tests and clients).
    pub fn encode(&self) -> [u8; REQUEST_HEADER_BYTES] {
        let mut b = [0u8; REQUEST_HEADER_BYTES];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// What a connection must do with one request, decided from its header alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Read `length` bytes at `offset`.
    Read { offset: u64, length: u32 },
    /// Write the `length`-byte payload at `offset`; flush afterwards if `fua`.
    Write { offset: u64, length: u32, fua: bool },
    /// Flush.
    Flush,
    /// Discard the whole pages of the range; flush afterwards if `fua`.
    Trim { offset: u64, length: u32, fua: bool },
    /// Zero the range; flush afterwards if `fua`.
    WriteZeroes { offset: u64, length: u32, fua: bool },
    /// Nothing to do but reply success (zero-length requests, `NBD_CMD_CACHE`).
    Noop,
    /// The allocation of the range in `base:allocation`; one extent only if `req_one`.
    BlockStatus {
        offset: u64,
        length: u32,
        req_one: bool,
    },
    /// Reply with this NBD error. `discard_payload` bytes of write payload follow the header
    /// and must be read and thrown away to stay in sync.
    Reject { error: u32, discard_payload: u32 },
    /// Soft disconnect: finish the requests in flight, then close.
    Disconnect,
    /// A write payload too large to swallow: reply is impossible without reading it, so the
    /// connection is dropped (the protocol allows a hard disconnect here).
    HardDisconnect,
}

/// What the connection negotiated, as far as request validation cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportLimits {
    /// The export size in bytes.
    pub size_bytes: u64,
    /// Whether structured replies were negotiated (`NBD_CMD_FLAG_DF` is valid only then).
    pub structured: bool,
    /// The alignment of offsets and lengths: [`MIN_BLOCK_SIZE_BYTES`] for a client that asked
    /// for block sizes (`NBD_INFO_BLOCK_SIZE` in `NBD_OPT_GO`), 1 for one that did not.
    pub min_block_bytes: u32,
    /// Whether a metadata context was selected (`NBD_CMD_BLOCK_STATUS` is valid only then).
    pub block_status: bool,
    /// A read-only export: writes, trims and write-zeroes get `EPERM`.
    pub read_only: bool,
}

/// The largest invalid write payload that is read and thrown away (to answer `EINVAL` and keep
/// the connection) rather than dropping the connection: twice the maximum, so a client that
/// overshoots the advertised limit by a little gets an error, and one that announces gigabytes
/// is cut off at once.
pub const MAX_DISCARDED_PAYLOAD_BYTES: u32 = 2 * MAX_PAYLOAD_BYTES;

/// Decides what to do with a request: validates command, flags, alignment, length and range.
/// Pure and total: any header gives an [`Action`].
pub fn classify(h: &RequestHeader, limits: ExportLimits) -> Action {
    let write_payload = if h.command == CMD_WRITE { h.length } else { 0 };
    let reject = |error: u32| {
        if write_payload > MAX_DISCARDED_PAYLOAD_BYTES {
            Action::HardDisconnect
        } else {
            Action::Reject {
                error,
                discard_payload: write_payload,
            }
        }
    };
    let allowed_flags = match h.command {
        CMD_READ if limits.structured => CMD_FLAG_FUA | CMD_FLAG_DF,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_DISC | CMD_CACHE => CMD_FLAG_FUA,
        CMD_BLOCK_STATUS if limits.block_status => CMD_FLAG_REQ_ONE,
        _ => return reject(NBD_EINVAL),
    };
    if h.flags & !allowed_flags != 0 {
        return reject(NBD_EINVAL);
    }
    let fua = h.flags & CMD_FLAG_FUA != 0;
    match h.command {
        CMD_DISC => return Action::Disconnect,
        // Offset and length are reserved for FLUSH; accept any, as other servers do.
        CMD_FLUSH => return Action::Flush,
        _ => {}
    }
    if limits.read_only && matches!(h.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES) {
        return reject(NBD_EPERM);
    }
    if h.command == CMD_BLOCK_STATUS && h.length == 0 {
        return reject(NBD_EINVAL);
    }
    let align = u64::from(limits.min_block_bytes.max(1));
    if h.offset % align != 0 || u64::from(h.length) % align != 0 {
        return reject(NBD_EINVAL);
    }
    if matches!(h.command, CMD_READ | CMD_WRITE) && h.length > MAX_PAYLOAD_BYTES {
        return reject(NBD_EINVAL);
    }
    let in_range = h
        .offset
        .checked_add(u64::from(h.length))
        .is_some_and(|end| end <= limits.size_bytes);
    if !in_range {
        // The spec asks for ENOSPC on writes past the end, EINVAL otherwise.
        let error = match h.command {
            CMD_WRITE | CMD_WRITE_ZEROES => NBD_ENOSPC,
            _ => NBD_EINVAL,
        };
        return reject(error);
    }
    let (offset, length) = (h.offset, h.length);
    if length == 0 {
        // The spec leaves zero-length requests unspecified but asks not to disconnect.
        return Action::Noop;
    }
    match h.command {
        CMD_READ => Action::Read { offset, length },
        CMD_WRITE => Action::Write {
            offset,
            length,
            fua,
        },
        CMD_TRIM => Action::Trim {
            offset,
            length,
            fua,
        },
        CMD_WRITE_ZEROES => Action::WriteZeroes {
            offset,
            length,
            fua,
        },
        CMD_BLOCK_STATUS => Action::BlockStatus {
            offset,
            length,
            req_one: h.flags & CMD_FLAG_REQ_ONE != 0,
        },
        _ => Action::Noop, // CMD_CACHE
    }
}

/// Maps an errno from the device to one of the errors the protocol allows.
///
/// `ENOMEM` (zram's answer when `mem_limit` is reached) becomes `ENOSPC` on the commands that
/// store data, which is what it means to a client (a full disk; qemu's `werror=enospc` acts on
/// it), and `EIO` elsewhere: the protocol asks servers not to send `ENOMEM`.
pub fn nbd_error_from_errno(errno: i32, stores_data: bool) -> u32 {
    match errno {
        libc::EPERM | libc::EACCES | libc::EROFS => NBD_EPERM,
        libc::EINVAL | libc::ERANGE => NBD_EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NBD_ENOSPC,
        libc::ENOMEM if stores_data => NBD_ENOSPC,
        libc::EOVERFLOW => NBD_EOVERFLOW,
        libc::EOPNOTSUPP => NBD_ENOTSUP,
        libc::ESHUTDOWN => NBD_ESHUTDOWN,
        _ => NBD_EIO,
    }
}

/// A simple reply header.
pub fn encode_simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_HEADER_BYTES] {
    let mut b = [0u8; SIMPLE_REPLY_HEADER_BYTES];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// A structured reply chunk header; `length` is the payload length that follows.
pub fn encode_structured_header(
    flags: u16,
    reply_type: u16,
    cookie: u64,
    length: u32,
) -> [u8; STRUCTURED_REPLY_HEADER_BYTES] {
    let mut b = [0u8; STRUCTURED_REPLY_HEADER_BYTES];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&reply_type.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&length.to_be_bytes());
    b
}

/// Appends a complete `NBD_REPLY_TYPE_ERROR` chunk (flag `DONE`) to `out`.
pub fn encode_structured_error(out: &mut Vec<u8>, cookie: u64, error: u32, message: &str) {
    // The message length field is 16 bits; messages are short, but never let one overflow it.
    let msg = &message.as_bytes()[..message.len().min(MAX_STRING_BYTES)];
    let length = 6 + msg.len() as u32;
    out.extend_from_slice(&encode_structured_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        cookie,
        length,
    ));
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
}

/// A human-readable name for an NBD error, for error chunk messages.
pub fn nbd_error_name(error: u32) -> &'static str {
    match error {
        NBD_EPERM => "EPERM",
        NBD_EIO => "EIO",
        NBD_ENOMEM => "ENOMEM",
        NBD_EINVAL => "EINVAL",
        NBD_ENOSPC => "ENOSPC",
        NBD_EOVERFLOW => "EOVERFLOW",
        NBD_ENOTSUP => "ENOTSUP",
        NBD_ESHUTDOWN => "ESHUTDOWN",
        _ => "error",
    }
}

fn be_u16(b: &[u8]) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[..2]);
    u16::from_be_bytes(a)
}

fn be_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_be_bytes(a)
}

fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ExportLimits = ExportLimits {
        block_status: false,
        read_only: false,
        min_block_bytes: MIN_BLOCK_SIZE_BYTES,
        size_bytes: 1 << 20,
        structured: false,
    };

    fn req(command: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags,
            command,
            cookie: 7,
            offset,
            length,
        }
    }

    #[test]
    fn request_header_round_trips() {
        let h = req(CMD_WRITE, CMD_FLAG_FUA, 4096, 512);
        assert_eq!(RequestHeader::parse(&h.encode()), Some(h));
        let mut bad = h.encode();
        bad[0] ^= 1;
        assert_eq!(RequestHeader::parse(&bad), None);
    }

    #[test]
    fn classify_validates() {
        assert_eq!(
            classify(&req(CMD_READ, 0, 512, 512), LIMITS),
            Action::Read {
                offset: 512,
                length: 512
            }
        );
        // Unaligned.
        assert_eq!(
            classify(&req(CMD_READ, 0, 1, 512), LIMITS),
            Action::Reject {
                error: NBD_EINVAL,
                discard_payload: 0
            }
        );
        // Past the end: EINVAL for reads, ENOSPC for writes, payload swallowed.
        assert_eq!(
            classify(&req(CMD_READ, 0, 1 << 20, 512), LIMITS),
            Action::Reject {
                error: NBD_EINVAL,
                discard_payload: 0
            }
        );
        assert_eq!(
            classify(&req(CMD_WRITE, 0, 1 << 20, 512), LIMITS),
            Action::Reject {
                error: NBD_ENOSPC,
                discard_payload: 512
            }
        );
        // Offset overflow.
        assert_eq!(
            classify(&req(CMD_TRIM, 0, u64::MAX - 511, 1024), LIMITS),
            Action::Reject {
                error: NBD_EINVAL,
                discard_payload: 0
            }
        );
        // DF only with structured replies.
        assert!(matches!(
            classify(&req(CMD_READ, CMD_FLAG_DF, 0, 512), LIMITS),
            Action::Reject { .. }
        ));
        let structured = ExportLimits {
            structured: true,
            ..LIMITS
        };
        assert!(matches!(
            classify(&req(CMD_READ, CMD_FLAG_DF, 0, 512), structured),
            Action::Read { .. }
        ));
        // NO_HOLE only on WRITE_ZEROES.
        assert!(matches!(
            classify(&req(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 0, 512), LIMITS),
            Action::WriteZeroes { .. }
        ));
        assert!(matches!(
            classify(&req(CMD_WRITE, CMD_FLAG_NO_HOLE, 0, 512), LIMITS),
            Action::Reject {
                discard_payload: 512,
                ..
            }
        ));
        // Oversize writes: swallowed up to twice the maximum, then the connection drops.
        let big = ExportLimits {
            size_bytes: 1 << 40,
            ..LIMITS
        };
        assert_eq!(
            classify(&req(CMD_WRITE, 0, 0, MAX_PAYLOAD_BYTES + 512), big),
            Action::Reject {
                error: NBD_EINVAL,
                discard_payload: MAX_PAYLOAD_BYTES + 512
            }
        );
        assert_eq!(
            classify(&req(CMD_WRITE, 0, 0, 3 * MAX_PAYLOAD_BYTES), big),
            Action::HardDisconnect
        );
        assert_eq!(
            classify(&req(CMD_DISC, 0, 0, 0), LIMITS),
            Action::Disconnect
        );
        // A client that negotiated no block size: any byte offset and length.
        let bytes = ExportLimits {
            min_block_bytes: 1,
            ..LIMITS
        };
        assert!(matches!(
            classify(&req(CMD_READ, 0, 1, 511), LIMITS),
            Action::Reject { .. }
        ));
        assert_eq!(
            classify(&req(CMD_READ, 0, 1, 511), bytes),
            Action::Read {
                offset: 1,
                length: 511
            }
        );
        assert!(matches!(
            classify(&req(CMD_WRITE, 0, 4095, 3), bytes),
            Action::Write {
                offset: 4095,
                length: 3,
                ..
            }
        ));
        assert!(matches!(
            classify(&req(CMD_WRITE, 0, (1 << 20) - 1, 2), bytes),
            Action::Reject {
                error: NBD_ENOSPC,
                ..
            }
        ));
        // Block status: only with a context selected; REQ_ONE its only flag; never zero-length.
        let status = ExportLimits {
            block_status: true,
            ..LIMITS
        };
        assert!(matches!(
            classify(&req(CMD_BLOCK_STATUS, 0, 0, 4096), LIMITS),
            Action::Reject {
                error: NBD_EINVAL,
                ..
            }
        ));
        assert_eq!(
            classify(&req(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 512, 4096), status),
            Action::BlockStatus {
                offset: 512,
                length: 4096,
                req_one: true
            }
        );
        assert!(matches!(
            classify(&req(CMD_BLOCK_STATUS, CMD_FLAG_FUA, 0, 4096), status),
            Action::Reject { .. }
        ));
        assert!(matches!(
            classify(&req(CMD_BLOCK_STATUS, 0, 0, 0), status),
            Action::Reject { .. }
        ));
        // Read-only: every command that changes data gets EPERM (a write's payload swallowed).
        let ro = ExportLimits {
            read_only: true,
            ..LIMITS
        };
        assert_eq!(
            classify(&req(CMD_WRITE, 0, 0, 512), ro),
            Action::Reject {
                error: NBD_EPERM,
                discard_payload: 512
            }
        );
        for cmd in [CMD_TRIM, CMD_WRITE_ZEROES] {
            assert!(matches!(
                classify(&req(cmd, 0, 0, 512), ro),
                Action::Reject {
                    error: NBD_EPERM,
                    discard_payload: 0
                }
            ));
        }
        assert!(matches!(
            classify(&req(CMD_READ, 0, 0, 512), ro),
            Action::Read { .. }
        ));
        assert_eq!(classify(&req(CMD_FLUSH, 0, 0, 0), ro), Action::Flush);
        assert_eq!(classify(&req(99, 0, 0, 0), LIMITS).clone(), {
            Action::Reject {
                error: NBD_EINVAL,
                discard_payload: 0,
            }
        });
    }

    #[test]
    fn info_request_parses_strictly() {
        let mut d = Vec::new();
        d.extend_from_slice(&5u32.to_be_bytes());
        d.extend_from_slice(b"zram0");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&INFO_NAME.to_be_bytes());
        let r = InfoRequest::parse(&d).unwrap();
        assert_eq!(r.name, "zram0");
        assert_eq!(r.requests, vec![INFO_BLOCK_SIZE, INFO_NAME]);
        assert_eq!(InfoRequest::parse(&d[..d.len() - 1]), None);
        let mut long = d.clone();
        long.push(0);
        assert_eq!(InfoRequest::parse(&long), None);
        let mut huge = d.clone();
        huge[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(InfoRequest::parse(&huge), None);
    }

    #[test]
    fn errno_mapping() {
        assert_eq!(nbd_error_from_errno(libc::ENOMEM, true), NBD_ENOSPC);
        assert_eq!(nbd_error_from_errno(libc::ENOMEM, false), NBD_EIO);
        assert_eq!(nbd_error_from_errno(libc::EINVAL, false), NBD_EINVAL);
        assert_eq!(nbd_error_from_errno(libc::EBUSY, false), NBD_EIO);
        assert_eq!(nbd_error_from_errno(libc::EOPNOTSUPP, false), NBD_ENOTSUP);
    }
}
