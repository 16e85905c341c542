//! One NBD client connection: the fixed-newstyle handshake ([`connect`]), requests sent by
//! any thread under `send_lock`, and a reader thread that matches simple replies to their
//! waiters by cookie.
//!
//! # Waiters
//!
//! Every request in flight has a [`Waiter`] in `Pending::waiters`, filed under its cookie
//! before its header is sent (so a reply can never find no waiter). It owns what the reply
//! fills (a read's buffers) and the channel its [`Done`] goes to. A queued write's op is not in
//! its waiter while its bytes are being sent (`sending`): the sender holds it, and a result
//! that arrives meanwhile (an early error reply, or the connection dying) is parked in
//! `early` for the sender to deliver once it has finished with the buffers. So no op is ever
//! handed back while this connection still reads its bytes. (The reply to a write can come
//! before its sender returns from the system call that sent its last bytes.)
//!
//! # Deadlines and death
//!
//! The reader wakes every [`READER_TICK`] and kills the connection when the oldest waiter is
//! past its deadline. A dead connection (`Pending::dead` set, socket shut down) fails every
//! waiter with `EIO` and takes no more requests; the backing opens a new one.
//!
//! Lock order: `send_lock` before `pending`; the reader takes `pending` alone.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::uri::{Address, NbdUri};
use crate::backing::IoOp;
use crate::error::{Error, ErrorKind, Result};
use crate::frontend::nbd::protocol::*;

/// How often the reader checks deadlines while it waits for a reply.
pub(super) const READER_TICK: Duration = Duration::from_millis(200);

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
}

impl ExportInfo {
    /// Whether the server advertises `flag`.
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// A connected socket.
#[derive(Debug)]
pub(super) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            Stream::Unix(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
        }
    }

    fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }

    fn write_some(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).write_vectored(bufs),
            Stream::Unix(s) => (&*s).write_vectored(bufs),
        }
    }

    /// Writes all of `parts` back to back (vectored, resuming after short writes).
    fn write_all_parts(&self, parts: &[&[u8]]) -> io::Result<()> {
        let (mut idx, mut at) = (0usize, 0usize);
        while idx < parts.len() {
            let slices: Vec<IoSlice<'_>> = std::iter::once(&parts[idx][at..])
                .chain(parts[idx + 1..].iter().copied())
                .take(crate::backing::MAX_OP_BUFS)
                .map(IoSlice::new)
                .collect();
            let mut n = match self.write_some(&slices) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            while idx < parts.len() && n >= parts[idx].len() - at {
                n -= parts[idx].len() - at;
                idx += 1;
                at = 0;
            }
            at += n;
        }
        Ok(())
    }

    /// Reads exactly `buf` (the handshake: the socket's read timeout bounds each wait).
    fn read_exact_plain(&self, buf: &mut [u8]) -> io::Result<()> {
        let mut at = 0;
        while at < buf.len() {
            match self.read_some(&mut buf[at..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
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
    /// `None` while a queued write's bytes are being sent (the sender holds the op).
    pub job: Option<Job>,
    /// Set while the sender holds the op: a result arriving meanwhile waits in `early`.
    pub sending: bool,
    pub early: Option<Result<()>>,
    /// For reads: the payload length the reply carries.
    pub read_len: Option<u32>,
    pub deadline: Instant,
    pub tx: Sender<Done>,
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
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn io_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::io(format!("{what}: {e}"))
}

/// Connects to `uri` and runs the fixed-newstyle handshake with `NBD_OPT_GO`, every step by
/// `timeout`. Returns the connection (its reader not yet started).
pub(super) fn connect(uri: &NbdUri, name: &str, timeout: Duration) -> Result<Conn> {
    let what = format!("NBD server {name}");
    let stream = match &uri.address {
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
            Stream::Tcp(s)
        }
        Address::Unix(path) => Stream::Unix(
            UnixStream::connect(path)
                .map_err(|e| io_err(&format!("{what}: connecting to {}", path.display()), e))?,
        ),
    };
    stream
        .set_timeouts(Some(timeout), Some(timeout))
        .map_err(|e| io_err(&what, e))?;
    let info = handshake(&stream, &uri.export).map_err(|e| match e.kind() {
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

/// The client side of the fixed-newstyle handshake: greeting, client flags, `NBD_OPT_GO` for
/// `export` asking for `NBD_INFO_BLOCK_SIZE`, then the info replies up to `NBD_REP_ACK`.
fn handshake(s: &Stream, export: &str) -> Result<ExportInfo> {
    let rd = |buf: &mut [u8]| s.read_exact_plain(buf).map_err(|e| io_err("reading", e));
    let mut greeting = [0u8; 18];
    rd(&mut greeting)?;
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
    let mut msg = Vec::new();
    msg.extend_from_slice(&client_flags.to_be_bytes());
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
    let (mut min, mut pref, mut max) = (1u32, 4096u32, MAX_PAYLOAD_BYTES);
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
                    REP_ERR_TLS_REQD => (ErrorKind::Unsupported, "the server requires TLS"),
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
    })
}

impl Conn {
    /// Whether the connection has died.
    pub fn is_dead(&self) -> bool {
        lock(&self.pending).dead.is_some()
    }

    /// Kills the connection: marks it dead, shuts the socket (the reader wakes) and fails
    /// every waiter (a `sending` one gets its result parked for its sender).
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
            if w.sending {
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

    /// After [`send`](Self::send) of a waiter with `sending` set: hands the op to the waiter,
    /// or delivers it at once if its result came while it was being sent.
    pub fn attach(self: &Arc<Self>, cookie: u64, op: IoOp) {
        let mut p = lock(&self.pending);
        let Some(w) = p.waiters.get_mut(&cookie) else {
            unreachable!("a sending waiter stays filed until attached");
        };
        if let Some(result) = w.early.take() {
            let w = p.waiters.remove(&cookie).expect("present");
            drop(p);
            let _ = w.tx.send(Done {
                cookie,
                job: Job::Op(op),
                result,
                conn: Arc::clone(self),
            });
            return;
        }
        w.job = Some(Job::Op(op));
        w.sending = false;
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
        let proto = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
        loop {
            let mut h = [0u8; SIMPLE_REPLY_HEADER_BYTES];
            self.read_full(&mut h)?;
            if be_u32(&h[0..4]) != SIMPLE_REPLY_MAGIC {
                return Err(proto(format!("bad reply magic {:#x}", be_u32(&h[0..4]))));
            }
            let error = be_u32(&h[4..8]);
            let cookie = be_u64(&h[8..16]);
            let (job, read_len, tx, sending) = {
                let mut p = lock(&self.pending);
                let Some(w) = p.waiters.get_mut(&cookie) else {
                    return Err(proto(format!("reply to unknown cookie {cookie}")));
                };
                if w.sending {
                    // The reply to a write whose sender has not yet returned from sending it
                    // (the server had all its bytes): park it for the sender.
                    w.early = Some(match error {
                        0 => Ok(()),
                        e => Err(nbd_error(e, &self.name)),
                    });
                    continue;
                }
                let w = p.waiters.remove(&cookie).expect("present");
                (w.job, w.read_len, w.tx, w.sending)
            };
            debug_assert!(!sending);
            let mut job = job.unwrap_or(Job::Plain);
            let result = if error != 0 {
                Err(nbd_error(error, &self.name))
            } else {
                if read_len.is_some() {
                    let filled = match &mut job {
                        Job::Op(op) => {
                            let mut r = Ok(());
                            for s in op.slices_mut() {
                                r = self.read_full(s);
                                if r.is_err() {
                                    break;
                                }
                            }
                            r
                        }
                        Job::Bytes(b) => self.read_full(b),
                        Job::Plain => Ok(()),
                    };
                    if let Err(e) = filled {
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
                Ok(())
            };
            let _ = tx.send(Done {
                cookie,
                job,
                result,
                conn: Arc::clone(self),
            });
        }
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
        }
        self.kill("disconnected");
    }
}

/// The error of an NBD error reply: `ENOSPC` stays `NoSpace`, the rest is `EIO`.
fn nbd_error(error: u32, name: &str) -> Error {
    let kind = match error {
        NBD_ENOSPC => ErrorKind::NoSpace,
        _ => ErrorKind::Io,
    };
    Error::new(
        kind,
        format!(
            "NBD server {name} replied {} ({error})",
            nbd_error_name(error)
        ),
    )
}
