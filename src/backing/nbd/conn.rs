//! One NBD client connection: the fixed-newstyle handshake ([`connect`]: structured replies
//! when the server has them, then `NBD_OPT_GO`), requests sent by any thread under
//! `send_lock`, and a reader thread that matches replies (simple, or structured chunks) to
//! their waiters by cookie.
//!
//! # Structured replies
//!
//! With `NBD_OPT_STRUCTURED_REPLY` negotiated, a read's reply comes in chunks: data at an
//! offset (`OFFSET_DATA`, read straight into the request's buffers), holes (`OFFSET_HOLE`,
//! zeroed), errors (`ERROR`, `ERROR_OFFSET`, and any type with the error bit) until one with
//! `NBD_REPLY_FLAG_DONE`. Every chunk must lie inside its request; the chunks of a successful
//! read must cover it exactly once (tracked in [`Chunks`]); a read with an error chunk fails
//! with `EIO` once its last chunk came. Anything else (a chunk outside its request, one that
//! overlaps another, an unknown non-error type, a payload of the wrong length) is a protocol
//! error: the connection dies. Other commands may get a simple reply or chunks.
//!
//! # Waiters
//!
//! Every request in flight has a [`Waiter`] in `Pending::waiters`, filed under its cookie
//! before its header is sent (so a reply can never find no waiter). It owns what the reply
//! fills (a read's buffers) and the channel its [`Done`] goes to. A queued write's op is not in
//! its waiter while its bytes are being sent (`held`): the sender holds it, and a result
//! that arrives meanwhile (an early error reply, or the connection dying) is parked in
//! `early` for the sender to deliver once it has finished with the buffers. So no op is ever
//! handed back while this connection still reads its bytes. (The reply to a write can come
//! before its sender returns from the system call that sent its last bytes.) The reader holds
//! a read's job the same way while it reads a data chunk into its buffers.
//!
//! # Deadlines and death
//!
//! The reader wakes every [`READER_TICK`] and kills the connection when the oldest waiter is
//! past its deadline. A dead connection (`Pending::dead` set, socket shut down) fails every
//! waiter with `EIO` and takes no more requests; the backing opens a new one.
//!
//! Lock order: `send_lock` before `pending`; the reader takes `pending` alone.

use std::collections::HashMap;
use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::stream::{Socket, Stream};
use super::uri::{Address, NbdUri};
use crate::backing::IoOp;
use crate::error::{Error, ErrorKind, Result};
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use uzram_nbd_proto::*;

/// How often the reader checks deadlines while it waits for a reply.
pub(super) const READER_TICK: Duration = Duration::from_millis(200);

/// A read answered in more separate pieces than this (chunks that are not adjacent to one
/// another) is a protocol error: it bounds what [`Chunks`] holds per read. Servers send
/// chunks in order (one piece), and even a read of the largest request (64 MiB) cut into
/// 4 KiB data and holes out of order stays far below it.
const MAX_READ_PIECES: usize = 4096;

/// The maximum payload when the server advertises none: the 32 MiB the protocol says every
/// server should take.
const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 32 << 20;

/// The largest error chunk payload: error (4), message length (2), a message of at most
/// 65535 bytes, an offset (8).
const MAX_ERROR_CHUNK_BYTES: u32 = 4 + 2 + u16::MAX as u32 + 8;

/// What the server said about the export in the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    /// The export's size in bytes, as the server announced it.
    pub size_bytes: u64,
    /// Transmission flags (`NBD_FLAG_*`).
    pub flags: u16,
    /// Minimum, preferred and maximum block sizes (the protocol's defaults when the server
    /// sent none: 1, 4096, 32 MiB).
    pub min_block_bytes: u32,
    pub preferred_block_bytes: u32,
    pub max_block_bytes: u32,
    /// Whether the server agreed to structured replies (`NBD_OPT_STRUCTURED_REPLY`).
    pub structured_replies: bool,
}

/// Structured reply chunks received, over every connection of a backing (for tests and
/// stats).
#[derive(Debug, Default)]
pub struct ChunkCounts {
    /// `NBD_REPLY_TYPE_OFFSET_DATA` chunks.
    pub data: AtomicU64,
    /// `NBD_REPLY_TYPE_OFFSET_HOLE` chunks.
    pub hole: AtomicU64,
    /// Error chunks.
    pub error: AtomicU64,
}

impl ExportInfo {
    /// Whether the server advertises `flag`.
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// What a waiter's reply fills, handed back in its [`Done`].
#[derive(Debug)]
pub(super) enum Job {
    /// A queued op: a read fills its buffers; a write's bytes were sent from it.
    Op(IoOp),
    /// A synchronous read's buffer.
    Bytes(Vec<u8>),
    /// Nothing to fill (a synchronous write, a flush, a trim).
    Plain,
}

/// A finished request.
#[derive(Debug)]
pub(super) struct Done {
    pub cookie: u64,
    pub job: Job,
    pub result: Result<()>,
    /// The connection it ran on (whether it died since decides what an unflushed write is
    /// worth).
    pub conn: Arc<Conn>,
}

/// A request in flight.
#[derive(Debug)]
pub(super) struct Waiter {
    /// `None` while the job is held elsewhere (see `held`).
    pub job: Option<Job>,
    /// Set while the job is out of the waiter: a queued write's sender is sending its bytes,
    /// or the reader is reading a data chunk into a read's buffers. A result arriving
    /// meanwhile waits in `early` for the holder to deliver.
    pub held: bool,
    pub early: Option<Result<()>>,
    /// For reads: the offset and length asked for (what the reply fills).
    pub read: Option<(u64, u32)>,
    /// A structured reply's chunks so far.
    pub chunks: Chunks,
    pub deadline: Instant,
    pub tx: Sender<Done>,
}

impl Waiter {
    pub fn new(
        job: Option<Job>,
        held: bool,
        read: Option<(u64, u32)>,
        deadline: Instant,
        tx: Sender<Done>,
    ) -> Waiter {
        Waiter {
            job,
            held,
            early: None,
            read,
            chunks: Chunks::default(),
            deadline,
            tx,
        }
    }
}

/// What the chunks of one structured reply said so far.
#[derive(Debug, Default)]
pub(super) struct Chunks {
    /// The byte ranges of a read (relative to its offset, `[start, end)`) that data and hole
    /// chunks filled: sorted, disjoint, adjacent ones merged; at most [`MAX_READ_PIECES`].
    filled: Vec<(u64, u64)>,
    /// The first error chunk's error.
    error: Option<Error>,
}

impl Chunks {
    /// Records that `[start, end)` of the read was filled. Fails (a protocol error) when it
    /// overlaps a range filled before or the read would be in too many pieces.
    fn fill(&mut self, start: u64, end: u64) -> std::result::Result<(), String> {
        debug_assert!(start < end);
        // The first range ending after `start`: the only one that can overlap.
        let i = self.filled.partition_point(|r| r.1 <= start);
        if let Some(r) = self.filled.get(i) {
            if r.0 < end {
                return Err(format!(
                    "chunk [{start}, {end}) overlaps [{}, {}) sent before",
                    r.0, r.1
                ));
            }
        }
        let after_prev = i > 0 && self.filled[i - 1].1 == start;
        let before_next = i < self.filled.len() && self.filled[i].0 == end;
        match (after_prev, before_next) {
            (true, true) => {
                self.filled[i - 1].1 = self.filled[i].1;
                self.filled.remove(i);
            }
            (true, false) => self.filled[i - 1].1 = end,
            (false, true) => self.filled[i].0 = start,
            (false, false) => {
                if self.filled.len() >= MAX_READ_PIECES {
                    return Err(format!("a read in more than {MAX_READ_PIECES} pieces"));
                }
                self.filled.insert(i, (start, end));
            }
        }
        Ok(())
    }

    /// Whether the chunks filled all of a read of `len` bytes.
    fn complete(&self, len: u64) -> bool {
        len == 0 || self.filled == [(0, len)]
    }
}

/// Where a data or hole chunk of `len` bytes at `offset` goes in a read of `req`: its start
/// relative to the read, or `None` when it does not lie inside it.
fn chunk_place(req: (u64, u32), offset: u64, len: u64) -> Option<u64> {
    let rel = offset.checked_sub(req.0)?;
    (len > 0 && rel.checked_add(len)? <= u64::from(req.1)).then_some(rel)
}

/// An error chunk's payload: the error, its message and (`ERROR_OFFSET`) its offset.
fn parse_error_chunk(
    reply_type: u16,
    d: &[u8],
) -> std::result::Result<(u32, String, Option<u64>), String> {
    if d.len() < 6 {
        return Err(format!("error chunk of {} bytes", d.len()));
    }
    let error = be_u32(&d[0..4]);
    let msg_len = usize::from(be_u16(&d[4..6]));
    let rest = &d[6..];
    let (message, offset) = match reply_type {
        REPLY_TYPE_ERROR if rest.len() == msg_len => (rest, None),
        REPLY_TYPE_ERROR_OFFSET if rest.len() == msg_len + 8 => {
            (&rest[..msg_len], Some(be_u64(&rest[msg_len..])))
        }
        REPLY_TYPE_ERROR | REPLY_TYPE_ERROR_OFFSET => {
            return Err(format!(
                "error chunk type {reply_type:#x}: {} bytes with a {msg_len}-byte message",
                d.len()
            ))
        }
        // An error type this client does not know: the error and, if it fits, the message.
        _ => (rest.get(..msg_len).unwrap_or(&[]), None),
    };
    Ok((error, String::from_utf8_lossy(message).into_owned(), offset))
}

#[derive(Debug, Default)]
pub(super) struct Pending {
    /// Why the connection died, once it has.
    pub dead: Option<String>,
    pub waiters: HashMap<u64, Waiter>,
}

/// One connection. See the module docs.
#[derive(Debug)]
pub(super) struct Conn {
    stream: Stream,
    /// Keeps each request (header and payload) whole on the wire.
    send_lock: Mutex<()>,
    pub(super) pending: Mutex<Pending>,
    /// What the server announced.
    pub info: ExportInfo,
    /// A description for messages: the URI.
    name: String,
    /// Chunks received (shared by the backing's connections).
    counts: Arc<ChunkCounts>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn io_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::io(format!("{what}: {e}"))
}

/// What every connection of a backing shares.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// Chunks received.
    pub counts: Arc<ChunkCounts>,
    /// With TLS: the client configuration and the name the server's certificate must carry.
    pub tls: Option<(Arc<ClientConfig>, ServerName<'static>)>,
}

/// Connects to `uri` and runs the fixed-newstyle handshake (TLS first when `shared` has it)
/// with `NBD_OPT_GO`, every step by `timeout`. Returns the connection (its reader not yet
/// started).
pub(super) fn connect(
    uri: &NbdUri,
    name: &str,
    timeout: Duration,
    shared: &Shared,
) -> Result<Conn> {
    let what = format!("NBD server {name}");
    let socket = match &uri.address {
        Address::Tcp { host, port } => {
            let addrs: Vec<_> = (host.as_str(), *port)
                .to_socket_addrs()
                .map_err(|e| io_err(&format!("{what}: resolving {host}"), e))?
                .collect();
            let mut last = None;
            let mut found = None;
            for a in addrs {
                match TcpStream::connect_timeout(&a, timeout) {
                    Ok(s) => {
                        found = Some(s);
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            let s = match (found, last) {
                (Some(s), _) => s,
                (None, Some(e)) => return Err(io_err(&format!("{what}: connecting"), e)),
                (None, None) => return Err(Error::io(format!("{what}: {host} has no address"))),
            };
            s.set_nodelay(true)
                .map_err(|e| io_err(&format!("{what}: TCP_NODELAY"), e))?;
            Socket::Tcp(s)
        }
        Address::Unix(path) => Socket::Unix(
            UnixStream::connect(path)
                .map_err(|e| io_err(&format!("{what}: connecting to {}", path.display()), e))?,
        ),
    };
    let mut stream = Stream::plain(socket);
    stream
        .set_timeouts(Some(timeout), Some(timeout))
        .map_err(|e| io_err(&what, e))?;
    let info =
        handshake(&mut stream, &uri.export, shared.tls.as_ref()).map_err(|e| match e.kind() {
            ErrorKind::Io => Error::io(format!("{what}: handshake: {}", e.message())),
            k => Error::new(k, format!("{what}: {}", e.message())),
        })?;
    // From now on reads wake every tick (deadline checks); a send blocked this long fails.
    stream
        .set_timeouts(Some(READER_TICK), Some(timeout))
        .map_err(|e| io_err(&what, e))?;
    Ok(Conn {
        stream,
        send_lock: Mutex::new(()),
        pending: Mutex::new(Pending::default()),
        info,
        name: name.to_string(),
        counts: Arc::clone(&shared.counts),
    })
}

fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// The client side of the fixed-newstyle handshake: greeting, client flags, with `tls`
/// `NBD_OPT_STARTTLS` and the TLS handshake, `NBD_OPT_STRUCTURED_REPLY`, `NBD_OPT_GO` for
/// `export` asking for `NBD_INFO_BLOCK_SIZE`, then the info replies up to `NBD_REP_ACK`.
fn handshake(
    s: &mut Stream,
    export: &str,
    tls: Option<&(Arc<ClientConfig>, ServerName<'static>)>,
) -> Result<ExportInfo> {
    let mut greeting = [0u8; 18];
    s.read_exact_plain(&mut greeting)
        .map_err(|e| io_err("reading", e))?;
    if be_u64(&greeting[0..8]) != NBDMAGIC {
        return Err(Error::io("not an NBD server (bad magic)"));
    }
    if be_u64(&greeting[8..16]) != IHAVEOPT {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "the server speaks oldstyle NBD; only fixed newstyle is supported",
        ));
    }
    let server_flags = be_u16(&greeting[16..18]);
    if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "the server does not offer fixed newstyle negotiation",
        ));
    }
    let no_zeroes = server_flags & FLAG_NO_ZEROES != 0;
    let client_flags = FLAG_C_FIXED_NEWSTYLE | if no_zeroes { FLAG_C_NO_ZEROES } else { 0 };
    if export.len() > MAX_STRING_BYTES {
        return Err(Error::invalid("export name longer than 4096 bytes"));
    }
    s.write_all_parts(&[&client_flags.to_be_bytes()])
        .map_err(|e| io_err("sending the client flags", e))?;
    if let Some((config, name)) = tls {
        start_tls(s)?;
        s.start_tls(Arc::clone(config), name.clone())?;
    }
    let s = &*s;
    let rd = |buf: &mut [u8]| s.read_exact_plain(buf).map_err(|e| io_err("reading", e));
    let structured_replies = negotiate_structured_replies(s)?;
    let mut msg = Vec::new();
    let mut data = Vec::new();
    data.extend_from_slice(&(export.len() as u32).to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
    msg.extend_from_slice(&OPT_GO.to_be_bytes());
    msg.extend_from_slice(&(data.len() as u32).to_be_bytes());
    msg.extend_from_slice(&data);
    s.write_all_parts(&[&msg])
        .map_err(|e| io_err("sending NBD_OPT_GO", e))?;

    let mut export_info = None;
    // The protocol's defaults: a server that sends no sizes takes 32 MiB (not this server's
    // own larger maximum, which another server need not take).
    let (mut min, mut pref, mut max) = (1u32, 4096u32, DEFAULT_MAX_PAYLOAD_BYTES);
    loop {
        let mut h = [0u8; 20];
        rd(&mut h)?;
        if be_u64(&h[0..8]) != OPTION_REPLY_MAGIC || be_u32(&h[8..12]) != OPT_GO {
            return Err(Error::io("bad option reply (magic or option)"));
        }
        let reply_type = be_u32(&h[12..16]);
        let len = be_u32(&h[16..20]);
        if len > MAX_OPTION_BYTES {
            return Err(Error::io(format!("option reply of {len} bytes")));
        }
        let mut d = vec![0u8; len as usize];
        rd(&mut d)?;
        match reply_type {
            REP_ACK => break,
            REP_INFO if d.len() >= 2 => match be_u16(&d[0..2]) {
                INFO_EXPORT if d.len() == 12 => {
                    export_info = Some((be_u64(&d[2..10]), be_u16(&d[10..12])));
                }
                INFO_BLOCK_SIZE if d.len() == 14 => {
                    (min, pref, max) = (be_u32(&d[2..6]), be_u32(&d[6..10]), be_u32(&d[10..14]));
                }
                INFO_EXPORT | INFO_BLOCK_SIZE => {
                    return Err(Error::io("malformed NBD_REP_INFO"));
                }
                _ => {} // Names, descriptions, anything newer: not needed.
            },
            t if t & (1 << 31) != 0 => {
                let text = String::from_utf8_lossy(&d).into_owned();
                let (kind, what) = match t {
                    REP_ERR_UNKNOWN => (ErrorKind::NotFound, "no such export"),
                    REP_ERR_TLS_REQD => (
                        ErrorKind::Unsupported,
                        "the server requires TLS (use nbds://)",
                    ),
                    REP_ERR_POLICY => (ErrorKind::PermissionDenied, "refused by policy"),
                    REP_ERR_UNSUP => (
                        ErrorKind::Unsupported,
                        "the server does not support NBD_OPT_GO",
                    ),
                    _ => (ErrorKind::Io, "NBD_OPT_GO failed"),
                };
                return Err(Error::new(
                    kind,
                    format!("export {export:?}: {what} ({text})"),
                ));
            }
            _ => {
                return Err(Error::io(format!(
                    "unexpected option reply type {reply_type}"
                )))
            }
        }
    }
    let (size_bytes, flags) =
        export_info.ok_or_else(|| Error::io("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT"))?;
    if !min.is_power_of_two() || min > 64 << 10 || max < min {
        return Err(Error::io(format!(
            "nonsensical block size constraints {min}/{pref}/{max}"
        )));
    }
    Ok(ExportInfo {
        size_bytes,
        flags: if flags & TFLAG_HAS_FLAGS != 0 {
            flags
        } else {
            0
        },
        min_block_bytes: min,
        preferred_block_bytes: pref,
        max_block_bytes: max,
        structured_replies,
    })
}

/// Sends `NBD_OPT_STARTTLS` and reads its answer: `NBD_REP_ACK`, or `EOPNOTSUPP` when the
/// server does not offer TLS.
fn start_tls(s: &Stream) -> Result<()> {
    let mut msg = Vec::with_capacity(16);
    msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
    msg.extend_from_slice(&OPT_STARTTLS.to_be_bytes());
    msg.extend_from_slice(&0u32.to_be_bytes());
    s.write_all_parts(&[&msg])
        .map_err(|e| io_err("sending NBD_OPT_STARTTLS", e))?;
    let mut h = [0u8; 20];
    s.read_exact_plain(&mut h)
        .map_err(|e| io_err("reading", e))?;
    let len = be_u32(&h[16..20]);
    if be_u64(&h[0..8]) != OPTION_REPLY_MAGIC
        || be_u32(&h[8..12]) != OPT_STARTTLS
        || len > MAX_OPTION_BYTES
    {
        return Err(Error::io("bad reply to NBD_OPT_STARTTLS"));
    }
    let mut d = vec![0u8; len as usize];
    s.read_exact_plain(&mut d)
        .map_err(|e| io_err("reading", e))?;
    match be_u32(&h[12..16]) {
        REP_ACK if len == 0 => Ok(()),
        t if t & (1 << 31) != 0 => Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "the server does not offer TLS ({})",
                String::from_utf8_lossy(&d)
            ),
        )),
        t => Err(Error::io(format!("reply type {t} to NBD_OPT_STARTTLS"))),
    }
}

/// Asks for structured replies: `NBD_REP_ACK` turns them on; an error reply (a server without
/// them answers `NBD_REP_ERR_UNSUP`) leaves simple replies.
fn negotiate_structured_replies(s: &Stream) -> Result<bool> {
    let mut msg = Vec::with_capacity(16);
    msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
    msg.extend_from_slice(&OPT_STRUCTURED_REPLY.to_be_bytes());
    msg.extend_from_slice(&0u32.to_be_bytes());
    s.write_all_parts(&[&msg])
        .map_err(|e| io_err("sending NBD_OPT_STRUCTURED_REPLY", e))?;
    let mut h = [0u8; 20];
    s.read_exact_plain(&mut h)
        .map_err(|e| io_err("reading", e))?;
    let len = be_u32(&h[16..20]);
    if be_u64(&h[0..8]) != OPTION_REPLY_MAGIC
        || be_u32(&h[8..12]) != OPT_STRUCTURED_REPLY
        || len > MAX_OPTION_BYTES
    {
        return Err(Error::io("bad reply to NBD_OPT_STRUCTURED_REPLY"));
    }
    let mut d = vec![0u8; len as usize];
    s.read_exact_plain(&mut d)
        .map_err(|e| io_err("reading", e))?;
    match be_u32(&h[12..16]) {
        REP_ACK if len == 0 => Ok(true),
        t if t & (1 << 31) != 0 => Ok(false),
        t => Err(Error::io(format!(
            "reply type {t} to NBD_OPT_STRUCTURED_REPLY"
        ))),
    }
}

impl Conn {
    /// Whether the connection has died.
    pub fn is_dead(&self) -> bool {
        lock(&self.pending).dead.is_some()
    }

    /// Kills the connection: marks it dead, shuts the socket (the reader wakes) and fails
    /// every waiter (a `held` one gets its result parked for its holder).
    pub fn kill(self: &Arc<Self>, why: &str) {
        let mut p = lock(&self.pending);
        if p.dead.is_none() {
            p.dead = Some(why.to_string());
        }
        let why = p.dead.clone().unwrap_or_default();
        self.stream.shutdown();
        let cookies: Vec<u64> = p.waiters.keys().copied().collect();
        for c in cookies {
            let w = p.waiters.get_mut(&c).expect("listed");
            let err = Error::io(format!("NBD server {}: connection lost: {why}", self.name));
            if w.held {
                w.early.get_or_insert(Err(err));
                continue;
            }
            let w = p.waiters.remove(&c).expect("listed");
            let _ = w.tx.send(Done {
                cookie: c,
                job: w.job.unwrap_or(Job::Plain),
                result: Err(err),
                conn: Arc::clone(self),
            });
        }
    }

    /// Files `waiter` under `cookie` and sends the request; `payload` follows the header.
    ///
    /// Fails (the request was not taken) when the connection is dead or the send fails; the
    /// connection is then dead, and the waiter's job is handed back if it is still here.
    pub fn send(
        self: &Arc<Self>,
        header: RequestHeader,
        payload: &[&[u8]],
        waiter: Waiter,
    ) -> std::result::Result<(), (Error, Option<Job>)> {
        let _send = lock(&self.send_lock);
        {
            let mut p = lock(&self.pending);
            if let Some(why) = &p.dead {
                let e = Error::io(format!("NBD server {}: connection lost: {why}", self.name));
                return Err((e, waiter.job));
            }
            p.waiters.insert(header.cookie, waiter);
        }
        let h = header.encode();
        let mut parts: Vec<&[u8]> = Vec::with_capacity(1 + payload.len());
        parts.push(&h);
        parts.extend_from_slice(payload);
        if let Err(e) = self.stream.write_all_parts(&parts) {
            let why = format!("sending a request: {e}");
            self.kill(&why);
            let job = lock(&self.pending)
                .waiters
                .remove(&header.cookie)
                .and_then(|w| w.job);
            return Err((Error::io(format!("NBD server {}: {why}", self.name)), job));
        }
        Ok(())
    }

    /// Gives a held job back to its waiter (after [`send`](Self::send) of a waiter with `held`
    /// set, or after the reader filled a read from a data chunk), or delivers it at once if
    /// its result came meanwhile. Returns whether it was delivered.
    pub fn attach(self: &Arc<Self>, cookie: u64, job: Job) -> bool {
        let mut p = lock(&self.pending);
        let Some(w) = p.waiters.get_mut(&cookie) else {
            unreachable!("a held waiter stays filed until its job is back");
        };
        if let Some(result) = w.early.take() {
            let w = p.waiters.remove(&cookie).expect("present");
            drop(p);
            let _ = w.tx.send(Done {
                cookie,
                job,
                result,
                conn: Arc::clone(self),
            });
            return true;
        }
        w.job = Some(job);
        w.held = false;
        false
    }

    /// Reads exactly `buf`, waking every tick to check the deadlines.
    fn read_full(self: &Arc<Self>, buf: &mut [u8]) -> io::Result<()> {
        let mut at = 0;
        while at < buf.len() {
            match self.stream.read_some(&mut buf[at..]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "server closed the connection",
                    ))
                }
                Ok(n) => at += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    self.check_deadlines()?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads `len` bytes from the socket into `job`'s buffers from byte `rel` on (`None`:
    /// zeroes them, a hole).
    fn fill_job(
        self: &Arc<Self>,
        job: &mut Job,
        mut rel: u64,
        len: u64,
        from_socket: bool,
    ) -> io::Result<()> {
        let mut left = len as usize;
        let mut put = |s: &mut [u8]| -> io::Result<()> {
            if left == 0 {
                return Ok(());
            }
            if rel >= s.len() as u64 {
                rel -= s.len() as u64;
                return Ok(());
            }
            let from = rel as usize;
            let n = (s.len() - from).min(left);
            let part = &mut s[from..from + n];
            if from_socket {
                self.read_full(part)?;
            } else {
                part.fill(0);
            }
            rel = 0;
            left -= n;
            Ok(())
        };
        match job {
            Job::Op(op) => {
                for s in op.slices_mut() {
                    put(s)?;
                }
            }
            Job::Bytes(b) => put(b)?,
            Job::Plain => {}
        }
        debug_assert_eq!(left, 0, "the chunk was checked to lie inside the read");
        Ok(())
    }

    fn check_deadlines(&self) -> io::Result<()> {
        let p = lock(&self.pending);
        if let Some(why) = &p.dead {
            return Err(io::Error::other(why.clone()));
        }
        let now = Instant::now();
        if p.waiters.values().any(|w| w.deadline <= now) {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "a request passed its deadline",
            ));
        }
        Ok(())
    }

    /// The reader thread: matches replies to waiters until the connection dies.
    pub fn run_reader(self: Arc<Self>) {
        let why = match self.read_replies() {
            Ok(()) => "closed".to_string(),
            Err(e) => e.to_string(),
        };
        self.kill(&why);
    }

    fn read_replies(self: &Arc<Self>) -> io::Result<()> {
        loop {
            let mut magic = [0u8; 4];
            self.read_full(&mut magic)?;
            match be_u32(&magic) {
                SIMPLE_REPLY_MAGIC => self.read_simple_reply()?,
                STRUCTURED_REPLY_MAGIC if self.info.structured_replies => self.read_chunk()?,
                m => return Err(protocol_error(format!("bad reply magic {m:#x}"))),
            }
        }
    }

    /// The rest of a simple reply (after its magic) and, for a successful read, its data.
    fn read_simple_reply(self: &Arc<Self>) -> io::Result<()> {
        let mut h = [0u8; SIMPLE_REPLY_HEADER_BYTES - 4];
        self.read_full(&mut h)?;
        let error = be_u32(&h[0..4]);
        let cookie = be_u64(&h[4..12]);
        let (job, read, tx) = {
            let mut p = lock(&self.pending);
            let Some(w) = p.waiters.get_mut(&cookie) else {
                return Err(protocol_error(format!("reply to unknown cookie {cookie}")));
            };
            if w.held {
                // The reply to a write whose sender has not yet returned from sending it
                // (the server had all its bytes): park it for the sender.
                w.early = Some(match error {
                    0 => Ok(()),
                    e => Err(nbd_error(e, &self.name, "")),
                });
                return Ok(());
            }
            let w = p.waiters.remove(&cookie).expect("present");
            (w.job, w.read, w.tx)
        };
        let mut job = job.unwrap_or(Job::Plain);
        let mut result = Ok(());
        if error != 0 {
            result = Err(nbd_error(error, &self.name, ""));
        } else if let Some((_, len)) = read {
            if let Err(e) = self.fill_job(&mut job, 0, u64::from(len), true) {
                let _ = tx.send(Done {
                    cookie,
                    job,
                    result: Err(Error::io(format!(
                        "NBD server {}: reading a reply: {e}",
                        self.name
                    ))),
                    conn: Arc::clone(self),
                });
                return Err(e);
            }
        }
        let _ = tx.send(Done {
            cookie,
            job,
            result,
            conn: Arc::clone(self),
        });
        Ok(())
    }

    /// The rest of a structured reply chunk (after its magic) and its payload.
    fn read_chunk(self: &Arc<Self>) -> io::Result<()> {
        let mut h = [0u8; STRUCTURED_REPLY_HEADER_BYTES - 4];
        self.read_full(&mut h)?;
        let flags = be_u16(&h[0..2]);
        let reply_type = be_u16(&h[2..4]);
        let cookie = be_u64(&h[4..12]);
        let length = be_u32(&h[12..16]);
        let read = {
            let p = lock(&self.pending);
            match p.waiters.get(&cookie) {
                Some(w) => w.read,
                None => return Err(protocol_error(format!("chunk for unknown cookie {cookie}"))),
            }
        };
        let bad = |what: &str| {
            protocol_error(format!(
                "chunk type {reply_type:#x} of {length} bytes for cookie {cookie}: {what}"
            ))
        };
        match reply_type {
            REPLY_TYPE_NONE if length == 0 => {}
            REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
                let Some(req) = read else {
                    return Err(bad("data or hole for a request that is not a read"));
                };
                let is_data = reply_type == REPLY_TYPE_OFFSET_DATA;
                let (offset, len) = if is_data {
                    if length <= 8 {
                        return Err(bad("no data"));
                    }
                    let mut o = [0u8; 8];
                    self.read_full(&mut o)?;
                    (be_u64(&o), u64::from(length - 8))
                } else {
                    if length != 12 {
                        return Err(bad("a hole chunk is 12 bytes"));
                    }
                    let mut o = [0u8; 12];
                    self.read_full(&mut o)?;
                    (be_u64(&o[0..8]), u64::from(be_u32(&o[8..12])))
                };
                let Some(rel) = chunk_place(req, offset, len) else {
                    return Err(bad(&format!(
                        "[{offset}, +{len}) is not inside the read [{}, +{})",
                        req.0, req.1
                    )));
                };
                let mut p = lock(&self.pending);
                let w = p
                    .waiters
                    .get_mut(&cookie)
                    .expect("filed until its last chunk");
                w.chunks.fill(rel, rel + len).map_err(|e| bad(&e))?;
                if is_data {
                    self.counts.data.fetch_add(1, Ordering::Relaxed);
                    // Hold the job while its buffers fill from the socket (a kill meanwhile
                    // parks its result for us).
                    let mut job = w.job.take().unwrap_or(Job::Plain);
                    w.held = true;
                    drop(p);
                    let filled = self.fill_job(&mut job, rel, len, true);
                    let delivered = self.attach(cookie, job);
                    filled?;
                    if delivered {
                        return Err(io::Error::other("connection killed"));
                    }
                } else {
                    self.counts.hole.fetch_add(1, Ordering::Relaxed);
                    if let Some(job) = w.job.as_mut() {
                        self.fill_job(job, rel, len, false)?;
                    }
                }
            }
            t if t & REPLY_TYPE_ERROR_BIT != 0 => {
                if !(6..=MAX_ERROR_CHUNK_BYTES).contains(&length) {
                    return Err(bad("error chunk length"));
                }
                let mut d = vec![0u8; length as usize];
                self.read_full(&mut d)?;
                let (error, message, offset) = parse_error_chunk(t, &d).map_err(|e| bad(&e))?;
                self.counts.error.fetch_add(1, Ordering::Relaxed);
                let at = offset
                    .map(|o| format!(" at offset {o}"))
                    .unwrap_or_default();
                let detail = format!("{at}: {message}");
                let mut p = lock(&self.pending);
                let w = p
                    .waiters
                    .get_mut(&cookie)
                    .expect("filed until its last chunk");
                // The first error is the request's; an error value of 0 is still an error.
                w.chunks
                    .error
                    .get_or_insert_with(|| nbd_error(error.max(1), &self.name, &detail));
            }
            _ => return Err(bad("unexpected type or length")),
        }
        if flags & REPLY_FLAG_DONE == 0 {
            return Ok(());
        }
        // The last chunk: the request's result.
        let mut p = lock(&self.pending);
        let w = p
            .waiters
            .get_mut(&cookie)
            .expect("filed until its last chunk");
        let result = match (w.chunks.error.take(), w.read) {
            (Some(e), _) => Err(e),
            (None, Some((_, len))) if !w.chunks.complete(u64::from(len)) => {
                return Err(bad("the chunks of a successful read do not cover it"));
            }
            (None, _) => Ok(()),
        };
        if w.held {
            // A write whose sender has not returned yet: it delivers.
            w.early = Some(result);
            return Ok(());
        }
        let w = p.waiters.remove(&cookie).expect("present");
        drop(p);
        let _ = w.tx.send(Done {
            cookie,
            job: w.job.unwrap_or(Job::Plain),
            result,
            conn: Arc::clone(self),
        });
        Ok(())
    }

    /// Best-effort `NBD_CMD_DISC` and shutdown (the backing is being dropped).
    pub fn disconnect(self: &Arc<Self>) {
        {
            let _send = lock(&self.send_lock);
            let h = RequestHeader {
                flags: 0,
                command: CMD_DISC,
                cookie: 0,
                offset: 0,
                length: 0,
            };
            let _ = self.stream.write_all_parts(&[&h.encode()]);
            self.stream.close_notify();
        }
        self.kill("disconnected");
    }
}

/// The error of an NBD error reply (`detail`: what an error chunk added): `ENOSPC` stays
/// `NoSpace`, the rest is `EIO`.
fn nbd_error(error: u32, name: &str, detail: &str) -> Error {
    let kind = match error {
        NBD_ENOSPC => ErrorKind::NoSpace,
        _ => ErrorKind::Io,
    };
    Error::new(
        kind,
        format!(
            "NBD server {name} replied {} ({error}){detail}",
            nbd_error_name(error)
        ),
    )
}

fn protocol_error(m: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_must_cover_a_read_once() {
        let mut c = Chunks::default();
        assert!(c.complete(0));
        assert!(!c.complete(4096));
        // Out of order, adjacent ones merge.
        c.fill(1024, 2048).unwrap();
        c.fill(3072, 4096).unwrap();
        assert_eq!(c.filled, [(1024, 2048), (3072, 4096)]);
        assert!(!c.complete(4096));
        c.fill(0, 1024).unwrap();
        c.fill(2048, 3072).unwrap();
        assert_eq!(c.filled, [(0, 4096)]);
        assert!(c.complete(4096));
        assert!(!c.complete(8192));
        // Overlaps, whole or partial, either side.
        let mut c = Chunks::default();
        c.fill(100, 200).unwrap();
        for (a, b) in [(100, 200), (50, 101), (199, 300), (0, 1000), (120, 130)] {
            assert!(c.fill(a, b).is_err(), "{a}..{b}");
        }
        assert_eq!(c.filled, [(100, 200)]);
        // Pieces are bounded.
        let mut c = Chunks::default();
        for i in 0..MAX_READ_PIECES as u64 {
            c.fill(2 * i, 2 * i + 1).unwrap();
        }
        assert!(c
            .fill(10 * MAX_READ_PIECES as u64, 10 * MAX_READ_PIECES as u64 + 1)
            .is_err());
        // Filling a gap merges two pieces into one and stays within the bound.
        c.fill(1, 2).unwrap();
        assert_eq!(c.filled.len(), MAX_READ_PIECES - 1);
    }

    #[test]
    fn chunk_place_keeps_chunks_inside_their_read() {
        let req = (4096, 8192);
        assert_eq!(chunk_place(req, 4096, 8192), Some(0));
        assert_eq!(chunk_place(req, 8192, 4096), Some(4096));
        assert_eq!(chunk_place(req, 8192, 4097), None);
        assert_eq!(chunk_place(req, 4095, 1), None);
        assert_eq!(chunk_place(req, 4096, 0), None);
        assert_eq!(chunk_place(req, u64::MAX, 1), None);
        assert_eq!(
            chunk_place((u64::MAX - 10, 10), u64::MAX - 1, u64::MAX),
            None
        );
    }

    #[test]
    fn error_chunks_parse_with_and_without_offsets() {
        let mut d = Vec::new();
        d.extend_from_slice(&NBD_EIO.to_be_bytes());
        d.extend_from_slice(&3u16.to_be_bytes());
        d.extend_from_slice(b"bad");
        assert_eq!(
            parse_error_chunk(REPLY_TYPE_ERROR, &d).unwrap(),
            (NBD_EIO, "bad".to_string(), None)
        );
        // The same payload is too short for ERROR_OFFSET.
        assert!(parse_error_chunk(REPLY_TYPE_ERROR_OFFSET, &d).is_err());
        let mut o = d.clone();
        o.extend_from_slice(&12345u64.to_be_bytes());
        assert_eq!(
            parse_error_chunk(REPLY_TYPE_ERROR_OFFSET, &o).unwrap(),
            (NBD_EIO, "bad".to_string(), Some(12345))
        );
        // ERROR with trailing bytes, a message longer than the chunk, a short chunk.
        assert!(parse_error_chunk(REPLY_TYPE_ERROR, &o).is_err());
        let mut long = d.clone();
        long[4..6].copy_from_slice(&9u16.to_be_bytes());
        assert!(parse_error_chunk(REPLY_TYPE_ERROR, &long).is_err());
        assert!(parse_error_chunk(REPLY_TYPE_ERROR, &d[..5]).is_err());
        // An unknown error type: its error, and its message when it fits.
        let unknown = REPLY_TYPE_ERROR_BIT | 77;
        assert_eq!(
            parse_error_chunk(unknown, &o).unwrap(),
            (NBD_EIO, "bad".to_string(), None)
        );
        assert_eq!(parse_error_chunk(unknown, &long).unwrap().1, "");
    }
}
