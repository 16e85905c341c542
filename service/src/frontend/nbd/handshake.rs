//! The handshake phase: fixed newstyle negotiation, up to the start of transmission.
//!
//! [`negotiate`] runs on the connection's own thread over any [`HandshakeIo`] (a socket, with
//! the handshake deadline, or in-memory bytes in the fuzz test). It answers every option the
//! protocol defines: `GO`, `INFO`, `EXPORT_NAME`, `LIST`, `ABORT`, `STRUCTURED_REPLY`,
//! `STARTTLS` (where the connection offers TLS: see [`TlsPolicy`]), `LIST_META_CONTEXT` and
//! `SET_META_CONTEXT` (the one context `base:allocation`); everything else (extended headers,
//! unknown codes) gets `NBD_REP_ERR_UNSUP` and the negotiation
//! goes on. While TLS is required and not yet up, every option but `STARTTLS` and `ABORT` gets
//! `NBD_REP_ERR_TLS_REQD` (and `EXPORT_NAME`, which cannot fail, closes the connection).
//! Protocol violations the spec says to drop the connection for (unknown client flags, a bad
//! option magic, an unknown export named by `EXPORT_NAME`) end it with an error; option data
//! over [`MAX_OPTION_BYTES`] is swallowed and refused, or, past 1 MiB, ends the connection.

use super::Export;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use uzram_nbd_proto::*;

/// What TLS a connection offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsPolicy {
    /// None: `STARTTLS` gets `NBD_REP_ERR_POLICY` (unix sockets; TCP without `--tls`).
    Unavailable,
    /// The client may upgrade.
    Optional,
    /// The client must upgrade before anything else.
    Required,
}

/// The byte stream of a handshake, and the TLS upgrade where it can happen.
pub trait HandshakeIo: Read + Write {
    /// What TLS this connection offers.
    fn tls_policy(&self) -> TlsPolicy;
    /// Whether TLS is up.
    fn tls_active(&self) -> bool;
    /// Runs the TLS handshake (after `NBD_REP_ACK` to `STARTTLS` was sent); every byte after
    /// it goes through TLS. Only called when the policy offers TLS and it is not yet up.
    fn start_tls(&mut self) -> io::Result<()>;
}

/// A plain byte stream with no TLS: a reader and a writer (tests, in-memory fuzzing).
#[derive(Debug)]
pub struct PlainIo<R, W> {
    /// Where the client's bytes come from.
    pub reader: R,
    /// Where the server's bytes go.
    pub writer: W,
}

impl<R: Read, W> Read for PlainIo<R, W> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
}

impl<R, W: Write> Write for PlainIo<R, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writer.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.writer.flush()
    }
}

impl<R: Read, W: Write> HandshakeIo for PlainIo<R, W> {
    fn tls_policy(&self) -> TlsPolicy {
        TlsPolicy::Unavailable
    }
    fn tls_active(&self) -> bool {
        false
    }
    fn start_tls(&mut self) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// What the client chose: the transmission phase starts on this export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// Index of the export in the server's list.
    pub export: usize,
    /// Whether structured replies were negotiated.
    pub structured: bool,
    /// The transmission flags sent to the client.
    pub transmission_flags: u16,
    /// The export size sent to the client: if the device no longer has it when transmission
    /// starts (it was reset in between), the connection is closed.
    pub size_bytes: u64,
    /// Whether the client asked for block sizes (`NBD_INFO_BLOCK_SIZE` in `NBD_OPT_GO`) and so
    /// keeps to the advertised minimum; otherwise it may send any byte offset and length.
    pub block_sizes: bool,
    /// Whether `base:allocation` was selected for this export (`NBD_OPT_SET_META_CONTEXT`, with
    /// structured replies): `NBD_CMD_BLOCK_STATUS` is valid.
    pub block_status: bool,
}

/// The transmission flags of every export (uzram's exports are all writable and share one
/// device between connections, so `CAN_MULTI_CONN` holds). `SEND_CACHE`: a cache request is
/// validated and answered at once (every page is in RAM or read back on demand). `SEND_DF` only with structured
/// replies, as the spec requires: a read reply is always one data chunk, so `DF` costs nothing.
/// `SEND_FAST_ZERO` is honest because zeroing never compresses anything: whole pages become
/// same-filled slots and partial pages take one read-modify-write, never slower than a write.
/// A read-only export has `READ_ONLY` and none of the flags of commands that change data.
pub fn transmission_flags(structured: bool, read_only: bool) -> u16 {
    let mut f = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_CAN_MULTI_CONN
        | TFLAG_SEND_CACHE;
    if read_only {
        f |= TFLAG_READ_ONLY;
    } else {
        f |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
    }
    if structured {
        f |= TFLAG_SEND_DF;
    }
    f
}

/// The preferred block size advertised for an export: its page size (I/O of whole pages avoids
/// the device's read-modify-write), clamped to what the protocol allows.
pub fn preferred_block_size(page_size_bytes: usize) -> u32 {
    let p = u32::try_from(page_size_bytes).unwrap_or(MAX_PAYLOAD_BYTES);
    p.clamp(MIN_BLOCK_SIZE_BYTES, MAX_PAYLOAD_BYTES)
        .next_power_of_two()
        .min(MAX_PAYLOAD_BYTES)
}

/// Option data past this is not even swallowed: the connection is dropped (a client sending
/// megabytes of option data is broken or hostile).
const MAX_SWALLOWED_OPTION_BYTES: u32 = 1 << 20;

fn protocol_error(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

fn find_export(exports: &[Export], name: &str, default_export: Option<usize>) -> Option<usize> {
    if name.is_empty() {
        // The empty name is the listener's default export.
        return default_export.filter(|&i| i < exports.len());
    }
    exports.iter().position(|e| e.name == name)
}

fn send<W: Write>(w: &mut W, buf: &[u8]) -> io::Result<()> {
    w.write_all(buf)?;
    w.flush()
}

fn reply<W: Write>(w: &mut W, option: u32, reply_type: u32, data: &[u8]) -> io::Result<()> {
    let mut out = Vec::with_capacity(20 + data.len());
    encode_option_reply(&mut out, option, reply_type, data);
    send(w, &out)
}

fn swallow<R: Read>(r: &mut R, len: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(len), &mut io::sink())?;
    if copied != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Runs the handshake. The empty export name means `default_export` (the export a unix socket
/// is named after). `Ok(Some(_))`: enter transmission. `Ok(None)`: the client ended the
/// session cleanly (`NBD_OPT_ABORT`, or hung up between options). `Err(_)`: an I/O error or a
/// protocol violation; the caller drops the connection.
///
/// `open` is called with the export a `GO` or `EXPORT_NAME` chose, before the reply that ends
/// the handshake, so the export is open (as zram's disk is open: `reset` is `EBUSY`) by the
/// time the client sees the handshake end. `false` means the export is gone (removed since the
/// list was taken): `GO` is answered `NBD_REP_ERR_UNKNOWN` and the handshake goes on;
/// `EXPORT_NAME`, which cannot fail, ends the connection.
pub fn negotiate<S: HandshakeIo>(
    io: &mut S,
    exports: &[Export],
    default_export: Option<usize>,
    shutting_down: &AtomicBool,
    open: &mut dyn FnMut(usize) -> bool,
) -> io::Result<Option<Negotiated>> {
    send(io, &encode_greeting())?;
    let mut flags = [0u8; 4];
    io.read_exact(&mut flags)?;
    let client_flags = u32::from_be_bytes(flags);
    if client_flags & !KNOWN_CLIENT_FLAGS != 0 {
        return Err(protocol_error("unknown client flags"));
    }
    // Fixed newstyle is honoured even if the client did not set the bit (the spec allows it;
    // a client that does not know it only ever sends EXPORT_NAME).
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;
    let mut structured = false;
    // The export `base:allocation` was selected for (`NBD_OPT_SET_META_CONTEXT`).
    let mut meta_export: Option<usize> = None;

    loop {
        let mut hdr = [0u8; OPTION_HEADER_BYTES];
        match io.read_exact(&mut hdr) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let opt = OptionHeader::parse(&hdr).ok_or_else(|| protocol_error("bad option magic"))?;
        if opt.length > MAX_OPTION_BYTES {
            if opt.length > MAX_SWALLOWED_OPTION_BYTES || opt.option == OPT_EXPORT_NAME {
                return Err(protocol_error("option data too large"));
            }
            swallow(io, u64::from(opt.length))?;
            reply(io, opt.option, REP_ERR_TOO_BIG, b"option data too large")?;
            continue;
        }
        let mut data = vec![0u8; opt.length as usize];
        io.read_exact(&mut data)?;

        if shutting_down.load(Ordering::Relaxed) {
            if opt.option == OPT_EXPORT_NAME {
                return Err(protocol_error("server shutting down"));
            }
            if opt.option != OPT_ABORT {
                reply(io, opt.option, REP_ERR_SHUTDOWN, b"server shutting down")?;
                continue;
            }
        }

        if io.tls_policy() == TlsPolicy::Required
            && !io.tls_active()
            && !matches!(opt.option, OPT_STARTTLS | OPT_ABORT)
        {
            if opt.option == OPT_EXPORT_NAME {
                return Err(protocol_error("EXPORT_NAME before the required TLS"));
            }
            reply(
                io,
                opt.option,
                REP_ERR_TLS_REQD,
                b"TLS is required: use STARTTLS",
            )?;
            continue;
        }

        match opt.option {
            OPT_ABORT => {
                // The client may already have closed; a failed ACK is of no consequence.
                let _ = reply(io, opt.option, REP_ACK, &[]);
                return Ok(None);
            }
            OPT_EXPORT_NAME => {
                let name = std::str::from_utf8(&data)
                    .map_err(|_| protocol_error("export name is not UTF-8"))?;
                let Some(export) = find_export(exports, name, default_export) else {
                    return Err(protocol_error("unknown export"));
                };
                if !open(export) {
                    return Err(protocol_error(
                        "the export was removed during the handshake",
                    ));
                }
                let tflags = transmission_flags(structured, exports[export].read_only);
                let size_bytes = exports[export].device.size_bytes();
                let mut out = Vec::with_capacity(134);
                out.extend_from_slice(&size_bytes.to_be_bytes());
                out.extend_from_slice(&tflags.to_be_bytes());
                if !no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                send(io, &out)?;
                return Ok(Some(Negotiated {
                    export,
                    structured,
                    transmission_flags: tflags,
                    size_bytes,
                    block_sizes: false,
                    block_status: structured && meta_export == Some(export),
                }));
            }
            OPT_LIST => {
                if !data.is_empty() {
                    reply(io, opt.option, REP_ERR_INVALID, b"LIST takes no data")?;
                    continue;
                }
                let mut out = Vec::new();
                for e in exports {
                    let mut d = Vec::with_capacity(4 + e.name.len() + e.description.len());
                    d.extend_from_slice(&(e.name.len() as u32).to_be_bytes());
                    d.extend_from_slice(e.name.as_bytes());
                    d.extend_from_slice(e.description.as_bytes());
                    encode_option_reply(&mut out, opt.option, REP_SERVER, &d);
                }
                encode_option_reply(&mut out, opt.option, REP_ACK, &[]);
                send(io, &out)?;
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    reply(
                        io,
                        opt.option,
                        REP_ERR_INVALID,
                        b"STRUCTURED_REPLY takes no data",
                    )?;
                    continue;
                }
                structured = true;
                reply(io, opt.option, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let Some(req) = InfoRequest::parse(&data) else {
                    reply(
                        io,
                        opt.option,
                        REP_ERR_INVALID,
                        b"malformed INFO/GO request",
                    )?;
                    continue;
                };
                let Some(export) = find_export(exports, &req.name, default_export) else {
                    let msg = format!("no export named {:?}", req.name);
                    reply(io, opt.option, REP_ERR_UNKNOWN, msg.as_bytes())?;
                    continue;
                };
                let e = &exports[export];
                let tflags = transmission_flags(structured, e.read_only);
                let mut out = Vec::new();
                let size_bytes = e.device.size_bytes();
                let info = encode_info_export(size_bytes, tflags);
                encode_option_reply(&mut out, opt.option, REP_INFO, &info);
                // Block sizes are sent even unasked (the spec allows it): every client that
                // shows them, and qemu and libnbd, ask anyway.
                let bs = encode_info_block_size(
                    MIN_BLOCK_SIZE_BYTES,
                    preferred_block_size(e.device.page_size_bytes()),
                    MAX_PAYLOAD_BYTES,
                );
                encode_option_reply(&mut out, opt.option, REP_INFO, &bs);
                if req.requests.contains(&INFO_NAME) {
                    let d = encode_info_string(INFO_NAME, &e.name);
                    encode_option_reply(&mut out, opt.option, REP_INFO, &d);
                }
                if req.requests.contains(&INFO_DESCRIPTION) && !e.description.is_empty() {
                    let d = encode_info_string(INFO_DESCRIPTION, &e.description);
                    encode_option_reply(&mut out, opt.option, REP_INFO, &d);
                }
                encode_option_reply(&mut out, opt.option, REP_ACK, &[]);
                if opt.option == OPT_GO && !open(export) {
                    let msg = format!("export {:?} was removed", e.name);
                    reply(io, opt.option, REP_ERR_UNKNOWN, msg.as_bytes())?;
                    continue;
                }
                send(io, &out)?;
                if opt.option == OPT_GO {
                    return Ok(Some(Negotiated {
                        export,
                        structured,
                        transmission_flags: tflags,
                        size_bytes,
                        block_sizes: req.requests.contains(&INFO_BLOCK_SIZE),
                        block_status: structured && meta_export == Some(export),
                    }));
                }
            }
            OPT_STARTTLS => {
                if io.tls_policy() == TlsPolicy::Unavailable {
                    reply(io, opt.option, REP_ERR_POLICY, b"TLS is not enabled here")?;
                } else if io.tls_active() || !data.is_empty() {
                    reply(
                        io,
                        opt.option,
                        REP_ERR_INVALID,
                        b"TLS already up, or data given",
                    )?;
                } else {
                    reply(io, opt.option, REP_ACK, &[])?;
                    io.start_tls()?;
                    // Whatever was negotiated in the clear could have been tampered with:
                    // start over, as the protocol's TLS document recommends.
                    structured = false;
                    meta_export = None;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let set = opt.option == OPT_SET_META_CONTEXT;
                let Some(req) = MetaContextRequest::parse(&data) else {
                    reply(
                        io,
                        opt.option,
                        REP_ERR_INVALID,
                        b"malformed meta context request",
                    )?;
                    continue;
                };
                if set && !structured {
                    reply(
                        io,
                        opt.option,
                        REP_ERR_INVALID,
                        b"SET_META_CONTEXT needs structured replies first",
                    )?;
                    continue;
                }
                let Some(export) = find_export(exports, &req.name, default_export) else {
                    let msg = format!("no export named {:?}", req.name);
                    reply(io, opt.option, REP_ERR_UNKNOWN, msg.as_bytes())?;
                    continue;
                };
                // `base:allocation` is the one context: named, or (listing only) matched by an
                // empty list or the `base:` wildcard; anything else is ignored, as the
                // protocol asks.
                let wanted = req.queries.iter().any(|q| q == META_BASE_ALLOCATION)
                    || (!set
                        && (req.queries.is_empty() || req.queries.iter().any(|q| q == "base:")));
                let mut out = Vec::new();
                if wanted {
                    let d = encode_meta_context(META_BASE_ALLOCATION_ID, META_BASE_ALLOCATION);
                    encode_option_reply(&mut out, opt.option, REP_META_CONTEXT, &d);
                }
                encode_option_reply(&mut out, opt.option, REP_ACK, &[]);
                send(io, &out)?;
                if set {
                    // A new selection replaces the old one.
                    meta_export = wanted.then_some(export);
                }
            }
            _ => reply(io, opt.option, REP_ERR_UNSUP, b"option not supported")?,
        }
    }
}
