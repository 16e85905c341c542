//! What a client can make a server hold, written once for every frontend (the NBD server, the
//! control socket, and the ublk and vhost-user frontends being added beside them).
//!
//! # The contract
//!
//! A frontend that accepts connections from clients it does not trust uses these parts, and
//! with them promises the following; `docs/nbd.md` ("Limits") gives the figures users see.
//!
//! 1. **Connections are counted** ([`ConnectionCap`]): an accept loop takes a
//!    [`ConnectionSlot`] for every connection before it spends anything on it (a thread, a
//!    buffer); when none is left the connection is closed at once and a line is logged (at most
//!    one a second, with the count refused since). The slot is released when the connection's
//!    thread ends, whatever ended it.
//! 2. **Request memory is a budget** ([`MemoryBudget`]): every byte of request or reply payload
//!    a frontend holds is charged to one server-wide budget before it is taken, and refunded when
//!    the buffer is given back; recycled buffers kept for reuse count against the same budget
//!    and are dropped first when a charge needs room. A frontend that cannot charge stops
//!    reading requests (backpressure) rather than allocating. Payloads are received into buffers
//!    that are never zero-filled ([`ReqBuf`]: fresh anonymous memory is the kernel's zero page
//!    until written), so the resident memory of a request is what its client actually sent.
//!    Buffers kept for reuse are released once nothing has used them for
//!    [`Limits::idle_release`] (the budget's floor, preallocated for `--swap`, stays).
//! 3. **Deadlines are totals** ([`Deadline`]): the handshake from accept to its end, a request
//!    from its first byte to its last, a reply from its first byte to its last. Each is one
//!    instant computed once; every wait on the way ([`wait_fd`]) is bounded by what is left of
//!    it, so a client trickling one byte at a time cannot restart the clock. Idle time *between*
//!    requests has no deadline: a swap device may sit unused for hours.
//! 4. **Stopping is a pipe to itself** ([`QuitFd`]): every accept loop and every handshake
//!    waits on the server's quit fd beside its socket, so raising it stops them at once, whether
//!    or not the socket file still exists and whatever clients do. Connections in transmission
//!    are then given [`Limits::stop_grace`] to answer the requests they have read (their read
//!    side is shut, so they read nothing new), after which their sockets are shut down in both
//!    directions and a blocked reply fails at once. A stop therefore ends within
//!    `stop_grace` plus the longest single device call.
//!
//! Lock order: [`MemoryBudget`]'s mutex is a leaf (nothing else is taken under it);
//! [`ConnectionCap`] is an atomic counter.

mod accept;
mod budget;
mod buf;
mod io;
mod quit;

pub use accept::{accept_loop, Listener};
pub use budget::{BudgetStats, MemoryBudget};
pub use buf::ReqBuf;
pub use io::{set_nonblocking, wait_fd, Deadline, Readiness};
pub use quit::QuitFd;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uzram::error::{Error, Result};

/// The limits of one server. Every field is a named budget or deadline with its default here;
/// `uzram serve` exposes the ones operators tune (`--max-connections`, `--max-inflight`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; the excess is refused at accept. Default 100, qemu's NBD
    /// server's default (`NBD_DEFAULT_MAX_CONNECTIONS`): far more than any client opens
    /// (nbdcopy 4, qemu 1 per disk, the kernel's nbd-client one per queue) and few enough that
    /// a flood costs at most 100 threads' worth of stacks.
    pub max_connections: usize,
    /// Bytes of request and reply payload held at once, server-wide (buffers kept for reuse
    /// included). Default 128 MiB: twice what the busiest client in the tests keeps in flight
    /// (nbdcopy, 4 connections × 64 requests × 256 KiB = 64 MiB), four maximum-size requests.
    pub max_inflight_bytes: u64,
    /// The whole handshake, from accept to the start of transmission (TLS included): 10 s, as
    /// qemu after CVE-2024-7409 (`NBD_DEFAULT_HANDSHAKE_MAX_SECS`); real clients take
    /// milliseconds.
    pub handshake: Duration,
    /// One request, from its first byte to its last payload byte. 30 s: a 64 MiB payload at
    /// 2 MB/s, far slower than any link a block device is served over.
    pub request: Duration,
    /// One reply, from its first byte to its last: a client that does not take its replies for
    /// this long is disconnected. 30 s, as [`Limits::request`].
    pub reply: Duration,
    /// On stop, how long connections may go on answering the requests they have read before
    /// their sockets are shut down. 2 s: a request in flight takes milliseconds (a 64 MiB write
    /// compresses in about 100 ms); only a client that stopped reading needs longer, and it is
    /// not waited for.
    pub stop_grace: Duration,
    /// Buffers kept for reuse that nothing has used for this long are released. 1 s: a busy
    /// client reuses its buffers within microseconds; an idle one gives them back quickly.
    pub idle_release: Duration,
    /// Buffers preallocated at start and never released (`--swap`: the request path takes no
    /// fresh memory in the steady state); 0 otherwise.
    pub preallocated_bytes: u64,
}

/// The smallest budget accepted: one maximum-size request (64 MiB of payload and a reply
/// header), so every request the server allows can be served.
pub const MIN_INFLIGHT_BYTES: u64 = (64 << 20) + 4096;

/// The buffers `--swap` preallocates, 4 MiB server-wide: half in buffers of one page of data
/// (a swap-out of one page, the most common request: 256 of them), half in buffers of 128 KiB
/// (the kernel's usual largest swap request, `max_sectors_kb`: 15 of them). A request takes
/// any free one of them before it maps a new buffer.
pub const SWAP_PREALLOCATED_BYTES: u64 = 4 << 20;

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 100,
            max_inflight_bytes: 128 << 20,
            handshake: Duration::from_secs(10),
            request: Duration::from_secs(30),
            reply: Duration::from_secs(30),
            stop_grace: Duration::from_secs(2),
            idle_release: Duration::from_secs(1),
            preallocated_bytes: 0,
        }
    }
}

impl Limits {
    /// Checks the settings (`EINVAL` with the reason).
    pub fn validate(&self) -> Result<()> {
        if self.max_connections == 0 {
            return Err(Error::invalid("max_connections must be at least 1"));
        }
        if self.max_inflight_bytes < MIN_INFLIGHT_BYTES {
            return Err(Error::invalid(format!(
                "max_inflight must be at least {MIN_INFLIGHT_BYTES} bytes (one 64 MiB request)"
            )));
        }
        if self.preallocated_bytes > self.max_inflight_bytes / 2 {
            return Err(Error::invalid(
                "the preallocated buffers must leave half of max_inflight for requests",
            ));
        }
        Ok(())
    }
}

/// A cap on connections served at once. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct ConnectionCap {
    inner: Arc<CapInner>,
}

#[derive(Debug)]
struct CapInner {
    max: usize,
    /// Connections holding a slot now.
    live: AtomicUsize,
    /// Refused since the last log line, and when that line was printed (ms since `epoch`).
    refused: AtomicU64,
    last_log_ms: AtomicU64,
    epoch: Instant,
    /// Who is logging (`uzram nbd`, `uzram ctl`).
    what: &'static str,
}

/// One connection's hold on a [`ConnectionCap`]; released when dropped.
#[derive(Debug)]
pub struct ConnectionSlot {
    inner: Arc<CapInner>,
}

impl ConnectionCap {
    /// A cap of `max` connections; refusals are logged as `what: ...`.
    pub fn new(max: usize, what: &'static str) -> ConnectionCap {
        ConnectionCap {
            inner: Arc::new(CapInner {
                max,
                live: AtomicUsize::new(0),
                refused: AtomicU64::new(0),
                last_log_ms: AtomicU64::new(0),
                epoch: Instant::now(),
                what,
            }),
        }
    }

    /// A slot, or `None` when `max` connections hold one (the refusal is counted and logged
    /// if `log`, at most once a second).
    pub fn try_acquire(&self, log: bool) -> Option<ConnectionSlot> {
        let c = &self.inner;
        let mut live = c.live.load(Ordering::Relaxed);
        loop {
            if live >= c.max {
                let n = c.refused.fetch_add(1, Ordering::Relaxed) + 1;
                let now = c.epoch.elapsed().as_millis() as u64;
                let last = c.last_log_ms.load(Ordering::Relaxed);
                if log
                    && (last == 0 || now >= last + 1000)
                    && c.last_log_ms
                        .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                {
                    c.refused.store(0, Ordering::Relaxed);
                    eprintln!(
                        "{}: connection refused: {} connections already (the maximum); \
                         {n} refused in the last second",
                        c.what, c.max
                    );
                }
                return None;
            }
            match c
                .live
                .compare_exchange_weak(live, live + 1, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Some(ConnectionSlot {
                        inner: Arc::clone(c),
                    })
                }
                Err(now) => live = now,
            }
        }
    }

    /// Connections holding a slot now.
    pub fn live(&self) -> usize {
        self.inner.live.load(Ordering::Relaxed)
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.inner.live.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_refuses_past_its_maximum_and_frees_on_drop() {
        let cap = ConnectionCap::new(2, "test");
        let a = cap.try_acquire(false).unwrap();
        let b = cap.try_acquire(false).unwrap();
        assert!(cap.try_acquire(false).is_none());
        assert_eq!(cap.live(), 2);
        drop(a);
        let c = cap.try_acquire(false).unwrap();
        assert!(cap.try_acquire(false).is_none());
        drop((b, c));
        assert_eq!(cap.live(), 0);
    }

    #[test]
    fn limits_are_validated() {
        assert!(Limits::default().validate().is_ok());
        let bad = |f: fn(&mut Limits)| {
            let mut l = Limits::default();
            f(&mut l);
            l.validate().is_err()
        };
        assert!(bad(|l| l.max_connections = 0));
        assert!(bad(|l| l.max_inflight_bytes = 1 << 20));
        assert!(bad(|l| l.preallocated_bytes = l.max_inflight_bytes));
    }
}
