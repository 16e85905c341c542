//! The transmission phase: reading requests, executing them, sending replies.
//!
//! One reader (the connection's thread) reads requests; each is validated from its header
//! alone ([`classify`]); invalid ones are answered at once (a write's payload is read and
//! thrown away first), valid ones go to a small worker pool (scoped threads), which executes
//! them on the device and sends each reply as soon as it is ready, so replies leave in
//! completion order (the protocol allows it).
//!
//! # Invariants
//! - A reply is one [`Channel::send_all`] of one contiguous buffer (header and data together),
//!   so replies of different requests never interleave.
//! - A request is acknowledged only after the device call returned (and, with FUA, after a
//!   flush), so a client that vanishes loses nothing it was told was written.
//! - Memory: a payload buffer is charged to the server's [`MemoryBudget`] before it is taken,
//!   and only once the payload's first byte has arrived (a header alone costs nothing); it is
//!   filled as bytes arrive, never zero-filled. A read's reply buffer is charged before the
//!   device fills it. When the budget is spent the reader waits: it reads no further request.
//! - At most [`MAX_INFLIGHT_REQUESTS`] requests per connection are in flight.
//! - Deadlines ([`Limits`]): a request's bytes, from its first to its last, within
//!   `Limits::request`; a reply within `Limits::reply`. Between requests there is no deadline.
//! - A connection idle between requests for `Limits::idle_release` releases its receive buffer
//!   and the budget's idle recycled buffers.
//!
//! # Lock order
//! A connection's `inflight` lock is never held while sending a reply.

use super::handshake::Negotiated;
use crate::frontend::limits::{Deadline, Limits, MemoryBudget, ReqBuf};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Condvar, Mutex};
use std::time::Duration;
use uzram::error::{Error, Result};
use uzram::BlockDevice;
use uzram_nbd_proto::*;

/// Requests in flight per connection before the reader stops reading: above qemu's 16 and
/// libnbd's default 64 per connection, so neither is ever throttled.
pub const MAX_INFLIGHT_REQUESTS: usize = 128;
/// A connection's receive buffer: one `read` fetches many small requests. 64 KiB: sixteen 4 KiB
/// writes with their headers; larger payloads are read straight into their own buffers.
pub const RECEIVE_BUFFER_BYTES: usize = 64 << 10;
/// Extents in one block status reply at most: a client asks again from where the reply ends.
/// 1024 runs cover a 4 GiB device of alternating pages in 256 replies, and one reply's memory
/// (its bytes and the run list, [`BLOCK_STATUS_BYTES_PER_EXTENT`] each) is charged to the
/// budget before it is taken.
pub const MAX_BLOCK_STATUS_EXTENTS: usize = 1024;
/// What one extent costs while a reply is built: 8 bytes on the wire, 16 in the run list.
const BLOCK_STATUS_BYTES_PER_EXTENT: usize = 8 + 16;

/// A connection's byte stream as the transmission phase uses it: the real socket (plain or
/// TLS, [`Wire`](super::wire::Wire)) or, in tests, memory.
pub trait Channel: Sync {
    /// Reads some bytes (0: the client closed), waiting at most until `deadline` (`TimedOut`).
    fn recv(&self, buf: &mut [u8], deadline: Deadline) -> io::Result<usize>;
    /// Reads some bytes between requests, waiting at most `wait` (`None`: as long as it takes);
    /// `Ok(None)` when that passed with nothing to read.
    fn recv_idle(&self, buf: &mut [u8], wait: Option<Duration>) -> io::Result<Option<usize>>;
    /// Waits until a read would not wait (bytes, the end of the stream, or an error).
    fn wait_readable(&self, deadline: Deadline) -> io::Result<()>;
    /// Sends all of `buf` as one unit (no other send interleaves), by `deadline`.
    fn send_all(&self, buf: &[u8], deadline: Deadline) -> io::Result<()>;
    /// Ends the connection: reads end, sends fail.
    fn kill(&self);
}

/// What the transmission phase shares with the rest of the server.
#[derive(Debug)]
pub struct Context<'a> {
    /// The server's limits.
    pub limits: &'a Limits,
    /// The server's request memory.
    pub budget: &'a MemoryBudget,
    /// Raised when the server stops: the reader stops reading.
    pub stop: &'a AtomicBool,
    /// Worker threads for this connection (at least 1).
    pub workers: usize,
}

/// The receive side: a small buffer in front of the channel, released when idle.
struct Inbound<'c, C: Channel> {
    ch: &'c C,
    buf: Option<ReqBuf>,
    start: usize,
    end: usize,
    /// The stream ended while waiting between requests.
    eof: bool,
}

impl<C: Channel> Inbound<'_, C> {
    fn buffered(&self) -> usize {
        self.end - self.start
    }

    fn read(&mut self, out: &mut [u8], deadline: Deadline) -> io::Result<usize> {
        if self.buffered() == 0 && self.eof {
            return Ok(0);
        }
        if self.buffered() == 0 {
            if out.len() >= RECEIVE_BUFFER_BYTES {
                return self.ch.recv(out, deadline);
            }
            if self.buf.is_none() {
                self.buf = Some(ReqBuf::with_capacity(RECEIVE_BUFFER_BYTES)?);
            }
            let buf = self.buf.as_mut().expect("set above");
            let n = self.ch.recv(buf.whole_mut(), deadline)?;
            self.start = 0;
            self.end = n;
            if n == 0 {
                return Ok(0);
            }
        }
        let n = out.len().min(self.buffered());
        let buf = self.buf.as_mut().expect("bytes are buffered");
        out[..n].copy_from_slice(&buf.whole_mut()[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }

    /// Fills `out`; `Ok(false)` if the stream ended before the first byte.
    fn read_exact(&mut self, out: &mut [u8], deadline: Deadline) -> io::Result<bool> {
        let mut got = 0;
        while got < out.len() {
            match self.read(&mut out[got..], deadline) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Reads and throws away `n` bytes.
    fn discard(&mut self, mut n: u64, deadline: Deadline) -> io::Result<()> {
        let mut scratch = [0u8; 4096];
        while n > 0 {
            let k = (n as usize).min(scratch.len());
            if !self.read_exact(&mut scratch[..k], deadline)? {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            n -= k as u64;
        }
        Ok(())
    }

    /// Waits until bytes are buffered (or the stream ended), by `deadline`. The wait is
    /// [`Inbound::fill_idle`]'s blocking receive in slices of `slice` (the same timeout as
    /// between requests, so the socket's timeout is not set again): one system call when the
    /// bytes come, where `poll` and then `recv` would be two.
    fn wait_for_bytes(&mut self, deadline: Deadline, slice: Duration) -> io::Result<()> {
        while !self.fill_idle(Some(slice))? {
            if deadline.passed() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
            }
        }
        Ok(())
    }

    /// Waits up to `wait` for the next request's first bytes, reading them into the buffer;
    /// `Ok(false)` if none came.
    fn fill_idle(&mut self, wait: Option<Duration>) -> io::Result<bool> {
        if self.buffered() > 0 {
            return Ok(true);
        }
        if self.buf.is_none() {
            // A fresh mapping: no memory is resident until bytes land in it.
            self.buf = Some(ReqBuf::with_capacity(RECEIVE_BUFFER_BYTES)?);
        }
        let buf = self.buf.as_mut().expect("set above");
        match self.ch.recv_idle(buf.whole_mut(), wait)? {
            None => Ok(false),
            Some(n) => {
                self.start = 0;
                self.end = n;
                // At the end of the stream (n == 0) the next read sees it.
                self.eof = n == 0;
                Ok(true)
            }
        }
    }

    /// Gives the receive buffer back when it holds nothing.
    fn release(&mut self) {
        if self.buffered() == 0 {
            self.buf = None;
        }
    }
}

/// One request handed to a worker.
struct Job {
    header: RequestHeader,
    action: Action,
    /// The write payload, or the read's reply buffer (charged to the budget).
    buf: Option<ReqBuf>,
}

/// The per-connection state the reader and the workers share.
struct Conn<'a, C: Channel> {
    ch: &'a C,
    cx: &'a Context<'a>,
    device: &'a dyn BlockDevice,
    structured: bool,
    /// Set when a reply could not be sent: the client is gone, stop reading.
    failed: AtomicBool,
    /// Requests in flight on this connection, and whether the reader waits for one to end
    /// (so that ending one wakes it only then: a condvar's notify is a system call).
    inflight: Mutex<(usize, bool)>,
    inflight_cv: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<C: Channel> Conn<'_, C> {
    fn send(&self, buf: &[u8]) {
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        if self
            .ch
            .send_all(buf, Deadline::after(self.cx.limits.reply))
            .is_err()
        {
            self.failed.store(true, Ordering::Relaxed);
            self.ch.kill();
        }
    }

    /// Sends an error reply: a structured error chunk with a message when negotiated, else a
    /// simple reply.
    fn send_error(&self, cookie: u64, error: u32, message: &str) {
        if self.structured {
            let mut out = Vec::with_capacity(64);
            encode_structured_error(&mut out, cookie, error, message);
            self.send(&out);
        } else {
            self.send(&encode_simple_reply(error, cookie));
        }
    }

    fn send_ok(&self, h: &RequestHeader) {
        if self.structured && h.command == CMD_READ {
            // A read must never get a simple reply once structured replies are on.
            self.send(&encode_structured_header(
                REPLY_FLAG_DONE,
                REPLY_TYPE_NONE,
                h.cookie,
                0,
            ));
        } else {
            self.send(&encode_simple_reply(0, h.cookie));
        }
    }

    fn cancelled(&self) -> bool {
        self.cx.stop.load(Ordering::Relaxed) || self.failed.load(Ordering::Relaxed)
    }

    /// Waits for a request slot on this connection; false if cancelled meanwhile.
    fn begin(&self) -> bool {
        let mut n = lock(&self.inflight);
        while n.0 >= MAX_INFLIGHT_REQUESTS {
            if self.cancelled() {
                n.1 = false;
                return false;
            }
            n.1 = true;
            n = self
                .inflight_cv
                .wait_timeout(n, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        n.0 += 1;
        n.1 = false;
        true
    }

    fn end(&self) {
        let mut n = lock(&self.inflight);
        n.0 -= 1;
        let wake = n.1;
        drop(n);
        if wake {
            self.inflight_cv.notify_all();
        }
    }

    fn inflight(&self) -> usize {
        lock(&self.inflight).0
    }

    /// Executes a request, replies, and gives its buffer back.
    fn execute(&self, job: Job) {
        let h = job.header;
        let dev = self.device;
        let fail = |e: &Error, stores: bool| {
            let err = nbd_error_from_errno(e.errno(), stores);
            self.send_error(h.cookie, err, e.message());
        };
        let with_fua =
            |r: Result<()>, fua: bool| r.and_then(|()| if fua { dev.flush() } else { Ok(()) });
        match job.action {
            Action::Read { offset, length } => {
                let mut buf = job.buf.expect("a read has its reply buffer");
                let prefix = buf.len() - length as usize;
                match dev.read_bytes_at(&mut buf[prefix..], offset) {
                    Ok(()) => {
                        if self.structured {
                            // The whole read is one data chunk, final: every error that can
                            // happen has happened before the first byte is sent.
                            let hdr = encode_structured_header(
                                REPLY_FLAG_DONE,
                                REPLY_TYPE_OFFSET_DATA,
                                h.cookie,
                                8 + length,
                            );
                            buf[..STRUCTURED_REPLY_HEADER_BYTES].copy_from_slice(&hdr);
                            buf[STRUCTURED_REPLY_HEADER_BYTES..prefix]
                                .copy_from_slice(&offset.to_be_bytes());
                        } else {
                            buf[..prefix].copy_from_slice(&encode_simple_reply(0, h.cookie));
                        }
                        self.send(&buf);
                    }
                    Err(e) => fail(&e, false),
                }
                self.cx.budget.give(buf);
            }
            Action::Write { offset, fua, .. } => {
                let buf = job.buf.expect("a write has its payload");
                match with_fua(dev.write_bytes_at(&buf, offset), fua) {
                    Ok(()) => self.send_ok(&h),
                    Err(e) => fail(&e, true),
                }
                self.cx.budget.give(buf);
            }
            Action::Trim {
                offset,
                length,
                fua,
            } => match with_fua(discard_sectors(dev, offset, u64::from(length)), fua) {
                Ok(()) => self.send_ok(&h),
                Err(e) => fail(&e, true),
            },
            Action::WriteZeroes {
                offset,
                length,
                fua,
            } => {
                // NO_HOLE and FAST_ZERO need nothing special: see `transmission_flags` and
                // docs/nbd.md (a zero page is a same-filled slot either way).
                match with_fua(dev.write_zeroes_bytes(offset, u64::from(length)), fua) {
                    Ok(()) => self.send_ok(&h),
                    Err(e) => fail(&e, true),
                }
            }
            Action::Flush => match dev.flush() {
                Ok(()) => self.send_ok(&h),
                Err(e) => fail(&e, true),
            },
            Action::BlockStatus {
                offset,
                length,
                req_one,
            } => {
                let mut buf = job.buf.expect("a block status has its reply buffer");
                let max = if req_one { 1 } else { MAX_BLOCK_STATUS_EXTENTS };
                let mut runs = Vec::with_capacity(max);
                match dev.allocation(offset, u64::from(length), max, &mut runs) {
                    Ok(()) => {
                        let n = encode_block_status(&mut buf, h.cookie, &runs, length, req_one);
                        self.send(&buf[..n]);
                    }
                    Err(e) => fail(&e, false),
                }
                self.cx.budget.give(buf);
            }
            Action::Noop => self.send_ok(&h),
            Action::Reject { error, .. } => {
                self.send_error(h.cookie, error, nbd_error_name(error));
            }
            Action::Disconnect | Action::HardDisconnect => {}
        }
    }
}

/// Writes the block status reply for `runs` into `buf` (one `NBD_REPLY_TYPE_BLOCK_STATUS`
/// chunk for `base:allocation`, flagged `DONE`) and returns its length. Holes read as zeroes,
/// so they are `HOLE | ZERO`; zero pages `ZERO`; data 0. With `req_one` the one extent is cut
/// to the request's `length`.
fn encode_block_status(
    buf: &mut [u8],
    cookie: u64,
    runs: &[uzram::Extent],
    length: u32,
    req_one: bool,
) -> usize {
    let payload = 4 + 8 * runs.len();
    let hdr = encode_structured_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_BLOCK_STATUS,
        cookie,
        payload as u32,
    );
    let mut at = STRUCTURED_REPLY_HEADER_BYTES;
    buf[..at].copy_from_slice(&hdr);
    buf[at..at + 4].copy_from_slice(&META_BASE_ALLOCATION_ID.to_be_bytes());
    at += 4;
    for r in runs {
        let len = if req_one {
            r.len_bytes.min(u64::from(length))
        } else {
            r.len_bytes
        };
        let flags = match r.allocation {
            uzram::Allocation::Hole => STATE_HOLE | STATE_ZERO,
            uzram::Allocation::Zero => STATE_ZERO,
            uzram::Allocation::Data => 0,
        };
        // A run is never longer than the request's length, a u32.
        buf[at..at + 4].copy_from_slice(&(len as u32).to_be_bytes());
        buf[at + 4..at + 8].copy_from_slice(&flags.to_be_bytes());
        at += 8;
    }
    at
}

/// Discards the whole sectors inside `[offset, offset + len)` (a range of any bytes, from a
/// client that negotiated no block size): the device frees whole pages only, so the partial
/// sectors at either end would be left as they are anyway.
fn discard_sectors(dev: &dyn BlockDevice, offset: u64, len: u64) -> Result<()> {
    let sector = u64::from(MIN_BLOCK_SIZE_BYTES);
    let start = offset.div_ceil(sector) * sector;
    let end = (offset + len) / sector * sector;
    if start >= end {
        return Ok(());
    }
    dev.discard(start, end - start)
}

/// Runs the transmission phase on one connection until the client disconnects, breaks the
/// protocol, vanishes, misses a deadline, or `cx.stop` is raised; returns after every request
/// read has been answered (or the client is known to be gone).
pub fn transmission<C: Channel>(
    ch: &C,
    device: &dyn BlockDevice,
    neg: &Negotiated,
    cx: &Context<'_>,
) -> io::Result<()> {
    let limits = ExportLimits {
        size_bytes: device.size_bytes(),
        structured: neg.structured,
        min_block_bytes: if neg.block_sizes {
            MIN_BLOCK_SIZE_BYTES
        } else {
            1
        },
        block_status: neg.block_status,
        read_only: neg.transmission_flags & TFLAG_READ_ONLY != 0,
    };
    let conn = Conn {
        ch,
        cx,
        device,
        structured: neg.structured,
        failed: AtomicBool::new(false),
        inflight: Mutex::new((0, false)),
        inflight_cv: Condvar::new(),
    };
    let (tx, rx) = mpsc::channel::<Job>();
    let rx = Mutex::new(rx);
    std::thread::scope(|s| {
        for _ in 0..cx.workers.max(1) {
            s.spawn(|| loop {
                let job = lock(&rx).recv();
                let Ok(job) = job else { return };
                conn.execute(job);
                conn.end();
            });
        }
        let mut inbound = Inbound {
            ch,
            buf: None,
            start: 0,
            end: 0,
            eof: false,
        };
        let r = read_requests(&mut inbound, &conn, &tx, limits);
        drop(tx);
        r
    })
}

/// Waits for the next request's first byte, with no deadline (an idle connection is
/// legitimate); every `Limits::idle_release` of idleness it releases the receive buffer (when
/// nothing is in flight) and the budget's idle recycled buffers, until none is left.
fn wait_for_request<C: Channel>(
    inbound: &mut Inbound<'_, C>,
    conn: &Conn<'_, C>,
) -> io::Result<()> {
    let mut all_released = false;
    loop {
        let wait = (!all_released).then_some(conn.cx.limits.idle_release);
        if inbound.fill_idle(wait)? {
            return Ok(());
        }
        if conn.inflight() == 0 {
            inbound.release();
        }
        conn.cx.budget.release_idle(false);
        all_released = inbound.buf.is_none() && !conn.cx.budget.has_idle_buffers();
    }
}

fn read_requests<C: Channel>(
    inbound: &mut Inbound<'_, C>,
    conn: &Conn<'_, C>,
    tx: &mpsc::Sender<Job>,
    limits: ExportLimits,
) -> io::Result<()> {
    let request_time = conn.cx.limits.request;
    loop {
        if conn.cancelled() {
            return Ok(());
        }
        wait_for_request(inbound, conn)?;
        if conn.cancelled() {
            return Ok(());
        }
        // From its first byte, the request must arrive whole within the request deadline.
        let mut deadline = Deadline::after(request_time);
        let mut hb = [0u8; REQUEST_HEADER_BYTES];
        if !inbound.read_exact(&mut hb, deadline)? {
            return Ok(()); // The client hung up between requests.
        }
        let Some(header) = RequestHeader::parse(&hb) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad request magic",
            ));
        };
        let action = classify(&header, limits);
        let buf_len = match action {
            Action::Disconnect => return Ok(()),
            Action::HardDisconnect => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("write payload of {} bytes refused", header.length),
                ))
            }
            Action::Reject {
                discard_payload, ..
            } => {
                inbound.discard(u64::from(discard_payload), deadline)?;
                0
            }
            Action::Write { length, .. } => {
                // Nothing is charged for a payload that has not started to arrive.
                inbound.wait_for_bytes(deadline, conn.cx.limits.idle_release)?;
                length as usize
            }
            Action::Read { length, .. } => {
                let prefix = if conn.structured {
                    STRUCTURED_REPLY_HEADER_BYTES + 8
                } else {
                    SIMPLE_REPLY_HEADER_BYTES
                };
                prefix + length as usize
            }
            Action::BlockStatus { req_one, .. } => {
                let n = if req_one { 1 } else { MAX_BLOCK_STATUS_EXTENTS };
                STRUCTURED_REPLY_HEADER_BYTES + 4 + n * BLOCK_STATUS_BYTES_PER_EXTENT
            }
            _ => 0,
        };
        if !conn.begin() {
            return Ok(());
        }
        let mut buf = None;
        if buf_len > 0 {
            match conn.cx.budget.take(buf_len, &|| conn.cancelled()) {
                Ok(Some(b)) => buf = Some(b),
                Ok(None) => {
                    conn.end();
                    return Ok(());
                }
                Err(e) => {
                    conn.end();
                    return Err(e);
                }
            }
        }
        if let (Action::Write { .. }, Some(payload)) = (action, buf.as_mut()) {
            // Time spent waiting for the budget is the server's, not the client's.
            deadline = Deadline::after(request_time);
            if let Err(e) = inbound.read_exact(payload, deadline).and_then(|full| {
                full.then_some(())
                    .ok_or(io::ErrorKind::UnexpectedEof.into())
            }) {
                // The client vanished or stalled mid-request: nothing of it was written or
                // acknowledged.
                conn.cx.budget.give(buf.take().expect("taken above"));
                conn.end();
                return Err(e);
            }
        }
        let job = Job {
            header,
            action,
            buf,
        };
        if conn.inflight() == 1 {
            // Nothing else in flight (a client at queue depth 1, or the first of a burst):
            // answer it from this thread. Handing it to a worker would add a thread wake-up
            // (tens of µs on an idle VM CPU) to a round trip whose whole point is latency;
            // with requests already in flight the workers take them, so a pipelining client
            // waits at most one request's service time for the reader.
            conn.execute(job);
            conn.end();
            continue;
        }
        if let Err(mpsc::SendError(job)) = tx.send(job) {
            // No worker left (cannot happen while `tx` lives, but never lose the request).
            conn.execute(job);
            conn.end();
        }
    }
}
