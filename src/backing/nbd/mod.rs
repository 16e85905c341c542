//! [`NbdBacking`]: a backing device on an NBD server (`nbd://HOST[:PORT]/EXPORT`,
//! `nbd+unix:///EXPORT?socket=PATH`): Ceph RBD through `rbd-nbd` or `qemu-storage-daemon`, S3
//! through nbdkit, another host's disk through `qemu-nbd`, any NBD server.
//!
//! # Parts
//!
//! - [`uri`]: the URI forms (`nbds` with TLS: certificates, no PSK).
//! - `stream`: a connection's socket, plain or TLS (rustls's client side after
//!   `NBD_OPT_STARTTLS`).
//! - `conn`: one connection: the fixed-newstyle handshake with `NBD_OPT_GO` (export size, block
//!   size constraints, transmission flags), requests from any thread, a reader thread matching
//!   simple replies to waiters by cookie, and a deadline on every request.
//! - This file: the pool of connections (one, or up to [`NbdOptions::connections`] when the
//!   server advertises multi-conn: as many as it accepts when the pool is opened), reconnection
//!   with backoff (by one caller, without blocking the others), the synchronous calls, and
//!   [`NbdQueue`], the writeback engine's queue: its ops in flight are NBD requests in flight.
//!
//! # Durability
//!
//! A queued write completes only when the server acknowledged it and, when the server
//! advertises a write cache (`NBD_FLAG_SEND_FLUSH`), after an `NBD_CMD_FLUSH` sent after that
//! acknowledgement was acknowledged too. Flushes are batched: one covers every write
//! acknowledged before it was sent, and it is sent when the queue's caller must wait and no
//! write is left on the wire (or half the queue's depth waits for a flush). A write
//! whose connection died before its flush completed fails (the page stays in RAM).
//!
//! # Failures
//!
//! A connection that errors, closes or misses a deadline dies: every request on it fails with
//! `EIO` (writes: the writeback engine keeps the pages in RAM and refunds the limit; reads:
//! `EIO`, nothing changes). The next request opens a new connection, at most once per backoff
//! interval (doubling from [`NbdOptions::backoff_min`] to [`NbdOptions::backoff_max`]);
//! between attempts requests fail at once with `EIO`, so a server gone for good costs one
//! failed writeback, not a hang.
//!
//! # Bounds
//!
//! Memory: a reply fills only what its request asked for (a read's length is known before it
//! is sent), so a server cannot make the client hold more than the requests in flight: the
//! queue's depth, plus one per thread in a synchronous call. Threads: one reader per
//! connection. Time: every request has [`NbdOptions::request_timeout`], connecting and the
//! handshake too.

mod conn;
mod stream;
pub mod uri;

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use self::conn::{lock, Conn, Done, Job, Shared, Waiter};
pub use self::conn::{ChunkCounts, ExportInfo};
use self::uri::NbdUri;
use super::{
    check_depth, check_range, check_submit, total_len, Backing, IoCompletion, IoKind, IoOp,
    IoQueue, SubmitResult, BLOCK_SIZE_BYTES, SECTOR_SIZE_BYTES,
};
use crate::error::{Error, ErrorKind, Result};
use uzram_nbd_proto::*;

/// How long opening an extra connection of a multi-conn pool may take before the pool stays
/// smaller.
const EXTRA_CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);

/// How an [`NbdBacking`] behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NbdOptions {
    /// Every request, connect and handshake must finish within this.
    pub request_timeout: Duration,
    /// Connections opened when the server advertises multi-conn (else one).
    pub connections: usize,
    /// The first wait before reconnecting after a failure; it doubles up to `backoff_max`.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
}

impl Default for NbdOptions {
    fn default() -> NbdOptions {
        NbdOptions {
            request_timeout: Duration::from_secs(30),
            connections: 4,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
        }
    }
}

/// How long a call waits for another caller's reconnection of its connection before it
/// looks for another live connection or fails with `EIO`. A reconnection to a server that is
/// up takes a few round trips (milliseconds); one to a server that accepts but stalls its
/// handshake takes up to the request deadline (30 s), and only the caller that started it
/// waits that long.
const RECONNECT_WAIT: Duration = Duration::from_secs(1);

/// One connection of the pool and its reconnection state.
#[derive(Debug)]
struct Slot {
    conn: Option<Arc<Conn>>,
    reader: Option<JoinHandle<()>>,
    /// Set while a caller reconnects this slot (without holding its lock).
    connecting: bool,
    /// No reconnection before this.
    next_attempt: Instant,
    backoff: Duration,
    last_error: Option<String>,
}

/// A slot and the condition variable its reconnection's end is announced on.
#[derive(Debug)]
struct SlotCell {
    slot: Mutex<Slot>,
    reconnected: Condvar,
}

/// A backing on an NBD server. See the module docs.
pub struct NbdBacking {
    uri: NbdUri,
    /// The URI as given: what `backing_dev` shows.
    name: String,
    options: NbdOptions,
    /// What the first handshake said (a reconnection must find the same size).
    info: ExportInfo,
    size_bytes: u64,
    /// The pool (its length: 1, or `options.connections` with multi-conn). A slot's mutex is
    /// held only to look at it: a reconnection runs without it (`Slot::connecting`).
    slots: Vec<SlotCell>,
    next_slot: AtomicUsize,
    cookies: AtomicU64,
    /// Connections opened (the first included) and lost, for tests and stats.
    connects: AtomicU64,
    /// What the connections share: chunk counts (for tests and stats) and TLS.
    shared: Shared,
}

impl NbdBacking {
    /// Connects to the server at `uri` and negotiates the export. The export must be writable
    /// and hold at least one 4 KiB block; its size is rounded down to whole blocks.
    pub fn open(uri: &str, options: &NbdOptions) -> Result<NbdBacking> {
        let parsed = NbdUri::parse(uri)?;
        let mut shared = Shared::default();
        if let Some(t) = &parsed.tls {
            let config = stream::client_config(&t.certificates)?;
            let name =
                rustls::pki_types::ServerName::try_from(t.hostname.clone()).map_err(|e| {
                    Error::invalid(format!("NBD URI {uri}: TLS name {:?}: {e}", t.hostname))
                })?;
            shared.tls = Some((config, name));
        }
        if options.connections == 0 || options.request_timeout.is_zero() {
            return Err(Error::invalid(
                "NBD options: connections and timeout must be non-zero",
            ));
        }
        let first = conn::connect(&parsed, uri, options.request_timeout, &shared)?;
        let info = first.info;
        if info.has(TFLAG_READ_ONLY) {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                format!("NBD export {uri} is read-only"),
            ));
        }
        if info.min_block_bytes > BLOCK_SIZE_BYTES as u32 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "NBD export {uri} needs {}-byte blocks; writeback writes {BLOCK_SIZE_BYTES}",
                    info.min_block_bytes
                ),
            ));
        }
        if info.max_block_bytes < BLOCK_SIZE_BYTES as u32 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "NBD export {uri} takes at most {} bytes per request, less than a block",
                    info.max_block_bytes
                ),
            ));
        }
        let size_bytes = info.size_bytes - info.size_bytes % BLOCK_SIZE_BYTES as u64;
        if size_bytes == 0 {
            return Err(Error::invalid(format!(
                "NBD export {uri} holds {} bytes, less than one {BLOCK_SIZE_BYTES}-byte block",
                info.size_bytes
            )));
        }
        let wanted = if info.has(TFLAG_CAN_MULTI_CONN) {
            options.connections
        } else {
            1
        };
        // The extra connections are opened now; a server that takes fewer clients than it
        // advertises multi-conn for (qemu-nbd's --shared) leaves them hanging in the
        // handshake: the pool is then as large as the connections that got through.
        let extra_timeout = options.request_timeout.min(EXTRA_CONNECTION_TIMEOUT);
        let mut opened = vec![first];
        while opened.len() < wanted {
            match conn::connect(&parsed, uri, extra_timeout, &shared) {
                Ok(c) if c.info.size_bytes == info.size_bytes => opened.push(c),
                _ => break,
            }
        }
        let n = opened.len();
        let now = Instant::now();
        let slots = (0..n)
            .map(|_| SlotCell {
                slot: Mutex::new(Slot {
                    conn: None,
                    reader: None,
                    connecting: false,
                    next_attempt: now,
                    backoff: options.backoff_min,
                    last_error: None,
                }),
                reconnected: Condvar::new(),
            })
            .collect();
        let b = NbdBacking {
            uri: parsed,
            name: uri.to_string(),
            options: *options,
            info,
            size_bytes,
            slots,
            next_slot: AtomicUsize::new(0),
            cookies: AtomicU64::new(1),
            connects: AtomicU64::new(0),
            shared,
        };
        for (cell, c) in b.slots.iter().zip(opened) {
            b.install(&mut lock(&cell.slot), c);
        }
        Ok(b)
    }

    /// What the server announced at the first handshake.
    pub fn export_info(&self) -> ExportInfo {
        self.info
    }

    /// Connections in the pool.
    pub fn connection_count(&self) -> usize {
        self.slots.len()
    }

    /// Connections opened so far (the first included): more than the pool's size means
    /// reconnections.
    pub fn connects(&self) -> u64 {
        self.connects.load(Ordering::Relaxed)
    }

    /// Whether the connections run TLS (`nbds://`).
    pub fn is_tls(&self) -> bool {
        self.shared.tls.is_some()
    }

    /// Whether the server sends structured replies (negotiated at the first handshake).
    pub fn structured_replies(&self) -> bool {
        self.info.structured_replies
    }

    /// Structured reply chunks received so far: data, holes, errors.
    pub fn chunk_counts(&self) -> [u64; 3] {
        let c = &self.shared.counts;
        [&c.data, &c.hole, &c.error].map(|a| a.load(Ordering::Relaxed))
    }

    /// Whether completed writes need an `NBD_CMD_FLUSH` to be durable.
    pub fn has_write_cache(&self) -> bool {
        self.info.has(TFLAG_SEND_FLUSH)
    }

    fn install(&self, slot: &mut Slot, conn: Conn) {
        let conn = Arc::new(conn);
        let reader = Arc::clone(&conn);
        let handle = std::thread::Builder::new()
            .name("uzram-nbd-reader".into())
            .spawn(move || reader.run_reader());
        match handle {
            Ok(h) => {
                slot.conn = Some(conn);
                slot.reader = Some(h);
                slot.backoff = self.options.backoff_min;
                slot.last_error = None;
                self.connects.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                conn.kill("no reader thread");
                slot.last_error = Some(format!("spawning the reader thread: {e}"));
            }
        }
    }

    /// A live connection: the next slot's (round-robin). When it died and its backoff passed,
    /// this caller reconnects it, without the slot's lock; a caller that finds a reconnection
    /// under way waits for it up to [`RECONNECT_WAIT`], then takes another live connection or
    /// fails with `EIO` at once, so a reconnection blocks no other call for long.
    fn conn(&self) -> Result<Arc<Conn>> {
        let n = self.slots.len();
        let first = self.next_slot.fetch_add(1, Ordering::Relaxed) % n;
        let mut refusal = None;
        for k in 0..n {
            let cell = &self.slots[(first + k) % n];
            let mut slot = lock(&cell.slot);
            if k == 0 && slot.connecting {
                let until = Instant::now() + RECONNECT_WAIT;
                while slot.connecting {
                    let now = Instant::now();
                    if now >= until {
                        break;
                    }
                    slot = cell
                        .reconnected
                        .wait_timeout(slot, until - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
            if let Some(c) = &slot.conn {
                if !c.is_dead() {
                    return Ok(Arc::clone(c));
                }
            }
            if let Some(c) = slot.conn.take() {
                // The reader exits once its socket is shut (kill did that).
                c.kill("replaced");
                if let Some(h) = slot.reader.take() {
                    let _ = h.join();
                }
            }
            let now = Instant::now();
            if k == 0 && !slot.connecting && now >= slot.next_attempt {
                slot.connecting = true;
                drop(slot);
                return self.reconnect(cell);
            }
            refusal.get_or_insert_with(|| {
                let why = slot.last_error.as_deref().unwrap_or("connection lost");
                if slot.connecting {
                    Error::io(format!(
                        "NBD server {} unreachable ({why}); reconnecting",
                        self.name
                    ))
                } else {
                    Error::io(format!(
                        "NBD server {} unreachable ({why}); next attempt in {} ms",
                        self.name,
                        slot.next_attempt.saturating_duration_since(now).as_millis()
                    ))
                }
            });
        }
        Err(refusal.expect("the pool has a slot"))
    }

    /// Opens a new connection for `cell`, whose `connecting` this caller set; installs it (or
    /// backs off), clears `connecting` and wakes the callers waiting for it.
    fn reconnect(&self, cell: &SlotCell) -> Result<Arc<Conn>> {
        let result = conn::connect(
            &self.uri,
            &self.name,
            self.options.request_timeout,
            &self.shared,
        )
        .and_then(|c| {
            if c.info.size_bytes < self.size_bytes {
                return Err(Error::io(format!(
                    "NBD export {} shrank to {} bytes",
                    self.name, c.info.size_bytes
                )));
            }
            Ok(c)
        });
        let mut slot = lock(&cell.slot);
        slot.connecting = false;
        let out = match result {
            Ok(c) => {
                self.install(&mut slot, c);
                match &slot.conn {
                    Some(c) => Ok(Arc::clone(c)),
                    None => Err(Error::io(slot.last_error.clone().unwrap_or_default())),
                }
            }
            Err(e) => {
                slot.last_error = Some(e.message().to_string());
                slot.next_attempt = Instant::now() + slot.backoff;
                slot.backoff = (slot.backoff * 2).min(self.options.backoff_max);
                Err(e)
            }
        };
        drop(slot);
        cell.reconnected.notify_all();
        out
    }

    fn cookie(&self) -> u64 {
        self.cookies.fetch_add(1, Ordering::Relaxed)
    }

    fn header(&self, command: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags: 0,
            command,
            cookie: self.cookie(),
            offset,
            length,
        }
    }

    /// Sends one request and waits for its reply (the synchronous calls).
    fn call(&self, header: RequestHeader, payload: &[&[u8]], job: Job) -> Result<Job> {
        let conn = self.conn()?;
        let (tx, rx) = channel();
        let read = (header.command == CMD_READ).then_some((header.offset, header.length));
        let deadline = Instant::now() + self.options.request_timeout;
        let waiter = Waiter::new(Some(job), false, read, deadline, tx);
        conn.send(header, payload, waiter).map_err(|(e, _)| e)?;
        // The reader answers every waiter by its deadline (or kills the connection, which
        // answers them all); the margin covers its tick.
        let limit = self.options.request_timeout + 4 * conn::READER_TICK;
        match rx.recv_timeout(limit) {
            Ok(done) => done.result.map(|()| done.job),
            Err(_) => {
                conn.kill("a synchronous request got no answer");
                Err(Error::io(format!(
                    "NBD server {}: request timed out",
                    self.name
                )))
            }
        }
    }

    /// The largest request, a multiple of 4 KiB.
    fn max_request_bytes(&self) -> u64 {
        let m = u64::from(self.info.max_block_bytes.min(MAX_PAYLOAD_BYTES));
        (m - m % BLOCK_SIZE_BYTES as u64).max(BLOCK_SIZE_BYTES as u64)
    }

    /// Whether `offset` and `len` meet the server's minimum block size.
    fn check_min_block(&self, offset: u64, len: u64, what: &str) -> Result<()> {
        let min = u64::from(self.info.min_block_bytes).max(1);
        if offset % min != 0 || len % min != 0 {
            return Err(Error::invalid(format!(
                "backing {what} of {len} bytes at {offset}: NBD export {} needs {min}-byte \
                 alignment",
                self.name
            )));
        }
        Ok(())
    }

    /// Sends `NBD_CMD_FLUSH` (when the server has a write cache) and waits.
    fn flush_now(&self) -> Result<()> {
        if !self.has_write_cache() {
            return Ok(());
        }
        let h = self.header(CMD_FLUSH, 0, 0);
        self.call(h, &[], Job::Plain).map(|_| ())
    }
}

impl Backing for NbdBacking {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size_bytes, offset, buf.len() as u64, "read")?;
        self.check_min_block(offset, buf.len() as u64, "read")?;
        let max = self.max_request_bytes() as usize;
        let mut at = 0usize;
        while at < buf.len() {
            let n = (buf.len() - at).min(max);
            let h = self.header(CMD_READ, offset + at as u64, n as u32);
            match self.call(h, &[], Job::Bytes(vec![0u8; n]))? {
                Job::Bytes(b) => buf[at..at + n].copy_from_slice(&b),
                _ => unreachable!("a read's job is its buffer"),
            }
            at += n;
        }
        Ok(())
    }

    fn writev_at(&self, bufs: &[&[u8]], offset: u64) -> Result<()> {
        let len = total_len(bufs);
        check_range(self.size_bytes, offset, len, "write")?;
        self.check_min_block(offset, len, "write")?;
        let max = self.max_request_bytes();
        if len <= max {
            let h = self.header(CMD_WRITE, offset, len as u32);
            return self.call(h, bufs, Job::Plain).map(|_| ());
        }
        let joined: Vec<u8> = bufs.concat();
        for (i, chunk) in joined.chunks(max as usize).enumerate() {
            let h = self.header(CMD_WRITE, offset + i as u64 * max, chunk.len() as u32);
            self.call(h, &[chunk], Job::Plain)?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.flush_now()
    }

    fn describe(&self) -> String {
        self.name.clone()
    }

    fn new_queue(&self, depth: usize) -> Result<Box<dyn IoQueue + '_>> {
        check_depth(depth)?;
        Ok(Box::new(NbdQueue::new(self, depth)))
    }

    /// Zones are emulated; a reset zone's bytes are trimmed when the server takes trims, so
    /// thin storage underneath gives the space back.
    fn reset_zone(&self, start_bytes: u64, len_bytes: u64) -> Result<()> {
        if !self.info.has(TFLAG_SEND_TRIM) {
            return Ok(());
        }
        check_range(self.size_bytes, start_bytes, len_bytes, "trim")?;
        let max = self.max_request_bytes().min(1 << 30);
        let mut at = 0;
        while at < len_bytes {
            let n = (len_bytes - at).min(max);
            let h = self.header(CMD_TRIM, start_bytes + at, n as u32);
            self.call(h, &[], Job::Plain)?;
            at += n;
        }
        Ok(())
    }
}

impl Drop for NbdBacking {
    fn drop(&mut self) {
        for cell in &self.slots {
            let mut s = lock(&cell.slot);
            if let Some(c) = s.conn.take() {
                c.disconnect();
            }
            if let Some(h) = s.reader.take() {
                let _ = h.join();
            }
        }
    }
}

impl fmt::Debug for NbdBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NbdBacking")
            .field("uri", &self.name)
            .field("size_bytes", &self.size_bytes)
            .field("info", &self.info)
            .field("connections", &self.slots.len())
            .finish()
    }
}

/// A write the server acknowledged, and the connection that did.
type Acked = (IoOp, Arc<Conn>);

/// The writeback engine's queue on an [`NbdBacking`]: each op is one NBD request in flight
/// (ops larger than the server's maximum request are refused). See the module docs for when a
/// write completes.
pub struct NbdQueue<'a> {
    backing: &'a NbdBacking,
    depth: usize,
    tx: Sender<Done>,
    rx: Receiver<Done>,
    /// Ops submitted and not yet returned by `wait`.
    in_flight: usize,
    /// Finished, waiting to be returned.
    ready: VecDeque<IoCompletion>,
    /// Writes acknowledged, waiting for a flush, with the connection that acknowledged them.
    acked: Vec<Acked>,
    /// The flush in flight: its cookie and the writes it covers.
    flushing: Option<(u64, Vec<Acked>)>,
}

impl fmt::Debug for NbdQueue<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NbdQueue")
            .field("backing", &self.backing.name)
            .field("depth", &self.depth)
            .field("in_flight", &self.in_flight)
            .field("acked", &self.acked.len())
            .finish()
    }
}

impl<'a> NbdQueue<'a> {
    fn new(backing: &'a NbdBacking, depth: usize) -> NbdQueue<'a> {
        let (tx, rx) = channel();
        NbdQueue {
            backing,
            depth,
            tx,
            rx,
            in_flight: 0,
            ready: VecDeque::new(),
            acked: Vec::new(),
            flushing: None,
        }
    }

    fn waiter(&self, held: bool, job: Option<Job>, read: Option<(u64, u32)>) -> Waiter {
        let deadline = Instant::now() + self.backing.options.request_timeout;
        Waiter::new(job, held, read, deadline, self.tx.clone())
    }

    /// Files a finished request.
    fn absorb(&mut self, done: Done) {
        if let Some((cookie, _)) = &self.flushing {
            if *cookie == done.cookie {
                let (_, batch) = self.flushing.take().expect("checked");
                for (op, conn) in batch {
                    let result = match &done.result {
                        Ok(()) if conn.is_dead() && !Arc::ptr_eq(&conn, &done.conn) => {
                            Err(Error::io(format!(
                                "NBD server {}: the connection that acknowledged the write \
                                 was lost before the flush",
                                self.backing.name
                            )))
                        }
                        Ok(()) => Ok(()),
                        Err(e) => Err(e.clone()),
                    };
                    self.ready.push_back(IoCompletion { op, result });
                }
                return;
            }
        }
        let Job::Op(op) = done.job else {
            unreachable!("a queue's requests carry ops");
        };
        if op.kind == IoKind::Write && done.result.is_ok() && self.backing.has_write_cache() {
            self.acked.push((op, done.conn));
        } else {
            self.ready.push_back(IoCompletion {
                op,
                result: done.result,
            });
        }
    }

    /// Sends a flush covering every acknowledged write, when none is in flight.
    fn start_flush(&mut self) {
        if self.acked.is_empty() || self.flushing.is_some() {
            return;
        }
        let batch = std::mem::take(&mut self.acked);
        let header = self.backing.header(CMD_FLUSH, 0, 0);
        let cookie = header.cookie;
        let sent = self.backing.conn().and_then(|c| {
            let w = self.waiter(false, Some(Job::Plain), None);
            c.send(header, &[], w).map_err(|(e, _)| e)
        });
        match sent {
            Ok(()) => self.flushing = Some((cookie, batch)),
            Err(e) => {
                for (op, _) in batch {
                    self.ready.push_back(IoCompletion {
                        op,
                        result: Err(e.clone()),
                    });
                }
            }
        }
    }
}

impl IoQueue for NbdQueue<'_> {
    fn depth(&self) -> usize {
        self.depth
    }

    fn submit(&mut self, op: IoOp) -> SubmitResult {
        let b = self.backing;
        if let Err(e) = check_submit(&op, self.in_flight, self.depth, b.size_bytes) {
            return Err((e, op));
        }
        let len = op.len_bytes();
        let what = if op.kind == IoKind::Read {
            "read"
        } else {
            "write"
        };
        if let Err(e) = b.check_min_block(op.offset, len, what) {
            return Err((e, op));
        }
        if len > b.max_request_bytes() {
            let e = Error::invalid(format!(
                "backing {what} of {len} bytes: NBD export {} takes at most {} per request",
                b.name,
                b.max_request_bytes()
            ));
            return Err((e, op));
        }
        let conn = match b.conn() {
            Ok(c) => c,
            Err(e) => return Err((e, op)),
        };
        debug_assert!(len % SECTOR_SIZE_BYTES as u64 == 0);
        match op.kind {
            IoKind::Read => {
                let header = b.header(CMD_READ, op.offset, len as u32);
                let read = Some((op.offset, len as u32));
                let w = self.waiter(false, Some(Job::Op(op)), read);
                match conn.send(header, &[], w) {
                    Ok(()) => {}
                    Err((e, Some(Job::Op(op)))) => return Err((e, op)),
                    // Already answered through the channel.
                    Err((_, _)) => {}
                }
            }
            IoKind::Write => {
                let header = b.header(CMD_WRITE, op.offset, len as u32);
                let w = self.waiter(true, None, None);
                let cookie = header.cookie;
                if let Err((e, _)) = conn.send(header, &op.slices(), w) {
                    return Err((e, op));
                }
                conn.attach(cookie, Job::Op(op));
            }
        }
        self.in_flight += 1;
        Ok(())
    }

    fn wait(&mut self, min_complete: usize) -> Result<Vec<IoCompletion>> {
        while let Ok(d) = self.rx.try_recv() {
            self.absorb(d);
        }
        loop {
            if self.ready.len() >= min_complete.min(self.in_flight) {
                break;
            }
            // One flush for as many writes as possible: once no write is left on the wire
            // (or half the queue waits for one).
            let flushing = self.flushing.as_ref().map_or(0, |(_, b)| b.len());
            let on_wire = self.in_flight - self.ready.len() - self.acked.len() - flushing;
            if self.flushing.is_none() && (on_wire == 0 || 2 * self.acked.len() >= self.depth) {
                self.start_flush();
                if self.ready.len() >= min_complete.min(self.in_flight) {
                    break;
                }
            }
            let limit = self.backing.options.request_timeout + 4 * conn::READER_TICK;
            match self.rx.recv_timeout(limit) {
                Ok(d) => self.absorb(d),
                Err(RecvTimeoutError::Timeout) => {
                    // Every reader answers by its deadline; if one did not, kill the pool's
                    // connections, which answers every request on them.
                    for cell in &self.backing.slots {
                        if let Some(c) = &lock(&cell.slot).conn {
                            c.kill("requests got no answer");
                        }
                    }
                }
                Err(RecvTimeoutError::Disconnected) => unreachable!("the queue holds a sender"),
            }
        }
        let out: Vec<IoCompletion> = self.ready.drain(..).collect();
        self.in_flight -= out.len();
        Ok(out)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

impl Drop for NbdQueue<'_> {
    fn drop(&mut self) {
        // The ops are owned by their waiters (never by a socket mid-send), so dropping them is
        // safe; wait so the server is done with them before their locations are reused.
        if self.in_flight > 0 {
            let _ = self.wait(usize::MAX);
        }
    }
}
