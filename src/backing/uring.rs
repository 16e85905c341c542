//! [`UringQueue`]: the io_uring engine of [`FileBacking`](super::FileBacking).
//!
//! # Ownership (the invariant everything here rests on)
//!
//! An op accepted by [`IoQueue::submit`] moves into `slots[i]` (its SQE carries `user_data =
//! i`) together with the iovec array its SQE points to. Both stay there, untouched, until the
//! kernel posts the CQE for that SQE; only then is the slot emptied and the op handed back in an
//! [`IoCompletion`]. The [`AlignedBuf`](super::AlignedBuf)s' memory does not move when the op
//! moves, and the iovec array is a boxed slice whose heap memory does not move either, so every
//! pointer the kernel holds stays valid for as long as the kernel may use it.
//!
//! - Each in-flight op has exactly one SQE outstanding (in the SQ ring or in the kernel), and
//!   at most `depth` ops are in flight; the rings hold at least `depth` SQEs and `2 * depth`
//!   CQEs, so pushing never finds the SQ ring full and the CQ ring never overflows.
//! - A short write is resubmitted for the rest (new iovecs, built only after the CQE of the
//!   previous SQE was reaped); a write that makes no progress completes with `ErrorKind::Io`.
//! - `Drop` with ops in flight waits for all of them. If the kernel cannot be waited on, the
//!   in-flight ops are leaked (never freed) so the kernel cannot write from freed memory.
//! - The queue borrows the file's descriptors ([`FileFds`], owned by the [`FileBacking`]), so
//!   they outlive every SQE naming them.
//!
//! Writes use `IORING_OP_WRITEV` (no buffer registration: buffers come and go with ops, and
//! registering per op would cost more than the page pinning it saves at these depths).

use std::fmt;
use std::io;

use io_uring::{opcode, types, IoUring};

use super::fds::FileFds;
use super::sys::{io_error, iovecs_after, IOV_MAX};
use super::{check_depth, check_submit, IoCompletion, IoKind, IoOp, IoQueue, SubmitResult};
use crate::error::{Error, ErrorKind, Result};

/// How many times one op is resubmitted after `EINTR`/`EAGAIN` before it fails. io_uring retries
/// regular-file writes itself, so this only guards against a livelock, never a normal path.
const MAX_RETRIES: u32 = 64;

/// The iovec array of one SQE. Heap-allocated once per (re)submission; its address is what the
/// SQE holds.
struct IoVecs(Box<[libc::iovec]>);

// SAFETY: the raw pointers inside point into the `AlignedBuf`s of the same `InFlight`'s op,
// which are `Send` and move with it; nothing else aliases them. Sending the array to another
// thread is the same as sending the buffers.
unsafe impl Send for IoVecs {}

/// An op between submit and the reaping of its final CQE.
struct InFlight {
    op: IoOp,
    /// What the outstanding SQE points to; replaced only after that SQE's CQE is reaped.
    iovecs: IoVecs,
    total_bytes: u64,
    done_bytes: u64,
    retries: u32,
}

/// An io_uring queue over a backing file's descriptors. See the module docs for the ownership
/// rules. Made by [`FileBacking::new_queue`](super::Backing::new_queue).
pub struct UringQueue<'a> {
    fds: &'a FileFds,
    /// The backing's usable size: ops past it are refused.
    size_bytes: u64,
    ring: IoUring,
    depth: usize,
    /// In-flight ops by `user_data`; `None` slots are listed in `free`.
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    /// `slots` that are `Some`.
    in_flight: usize,
    /// Short writes resubmitted so far (for tests and curiosity).
    short_writes: u64,
}

impl<'a> UringQueue<'a> {
    /// A ring of `depth` entries doing I/O through `fds` on a backing of `size_bytes`. Fails
    /// with `Unsupported` when io_uring is not available (old kernel, disabled by sysctl or a
    /// seccomp filter).
    pub(crate) fn new(fds: &'a FileFds, size_bytes: u64, depth: usize) -> Result<UringQueue<'a>> {
        check_depth(depth)?;
        let ring = IoUring::builder()
            .setup_cqsize(2 * depth as u32)
            .build(depth as u32)
            .map_err(|e| {
                Error::new(
                    ErrorKind::Unsupported,
                    format!("io_uring is not available: {e}"),
                )
            })?;
        Ok(UringQueue {
            fds,
            size_bytes,
            ring,
            depth,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            in_flight: 0,
            short_writes: 0,
        })
    }

    /// Short writes whose rest was resubmitted.
    pub fn short_writes(&self) -> u64 {
        self.short_writes
    }

    /// Builds the iovecs for the rest of `slots[idx]`'s op and pushes its SQE.
    fn push(&mut self, idx: usize) -> Result<()> {
        let f = self.slots[idx]
            .as_mut()
            .expect("pushing a slot that is in flight");
        let iovecs = match f.op.kind {
            IoKind::Write => iovecs_after(f.op.slices(), f.done_bytes, IOV_MAX),
            IoKind::Read => f.op.iovecs_mut(f.done_bytes, IOV_MAX),
        };
        f.iovecs = IoVecs(iovecs.into_boxed_slice());
        let offset = f.op.offset + f.done_bytes;
        let fd = self.fds.fd_for(
            offset,
            f.iovecs.0.iter().map(|v| (v.iov_base as usize, v.iov_len)),
        );
        let fd = types::Fd(std::os::fd::AsRawFd::as_raw_fd(fd));
        let (iov, n) = (f.iovecs.0.as_ptr(), f.iovecs.0.len() as u32);
        let entry = match f.op.kind {
            IoKind::Write => opcode::Writev::new(fd, iov, n).offset(offset).build(),
            IoKind::Read => opcode::Readv::new(fd, iov, n).offset(offset).build(),
        }
        .user_data(idx as u64);
        // SAFETY: the SQE points to `f.iovecs` and, through it, to `f.op.bufs`; both live in
        // `self.slots[idx]` until this SQE's CQE is reaped (see the module docs), and neither's
        // heap memory moves. For reads the kernel writes into the buffers: the queue owns the
        // op, so nothing else touches them until the CQE is reaped, and the iovecs were built
        // from the buffers' own mutable pointers. The fd belongs to `self.fds`, borrowed for
        // the queue's life.
        unsafe { self.ring.submission().push(&entry) }.map_err(|_| {
            Error::busy("io_uring submission ring full (more SQEs than ops in flight)")
        })
    }

    /// Hands pushed SQEs to the kernel without waiting. Transient refusals leave them queued in
    /// the SQ ring for the next call.
    fn enter(&mut self, want: usize) -> io::Result<()> {
        loop {
            let r = if want == 0 {
                self.ring.submit()
            } else {
                self.ring.submit_and_wait(want)
            };
            match r {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => {
                    // Out of kernel resources for now, or completions to reap first: the
                    // caller reaps and comes back.
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Processes every posted CQE: finished ops go to `out`, short ones are resubmitted.
    fn reap(&mut self, out: &mut Vec<IoCompletion>) {
        let cqes: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (user_data, res) in cqes {
            let idx = user_data as usize;
            let f = self.slots[idx]
                .as_mut()
                .expect("a CQE for a slot that is not in flight");
            let offset = f.op.offset + f.done_bytes;
            let left = f.total_bytes - f.done_bytes;
            let what = match f.op.kind {
                IoKind::Write => "write",
                IoKind::Read => "read",
            };
            let result = if res < 0 {
                let errno = -res;
                if matches!(errno, libc::EINTR | libc::EAGAIN) && f.retries < MAX_RETRIES {
                    f.retries += 1;
                    self.resubmit(idx, out);
                    continue;
                }
                Err(io_error(
                    io::Error::from_raw_os_error(errno),
                    what,
                    offset,
                    left,
                ))
            } else if res == 0 {
                Err(Error::io(format!(
                    "backing {what} at offset {offset} moved nothing with {left} bytes left"
                )))
            } else {
                f.done_bytes += res as u64;
                if f.done_bytes < f.total_bytes {
                    self.short_writes += 1;
                    self.resubmit(idx, out);
                    continue;
                }
                Ok(())
            };
            self.complete(idx, result, out);
        }
    }

    fn resubmit(&mut self, idx: usize, out: &mut Vec<IoCompletion>) {
        if let Err(e) = self.push(idx) {
            self.complete(idx, Err(e), out);
        }
    }

    fn complete(&mut self, idx: usize, result: Result<()>, out: &mut Vec<IoCompletion>) {
        let f = self.slots[idx].take().expect("completing a slot in flight");
        self.free.push(idx);
        self.in_flight -= 1;
        out.push(IoCompletion { op: f.op, result });
    }
}

impl IoQueue for UringQueue<'_> {
    fn depth(&self) -> usize {
        self.depth
    }

    fn submit(&mut self, op: IoOp) -> SubmitResult {
        if let Err(e) = check_submit(&op, self.in_flight, self.depth, self.size_bytes) {
            return Err((e, op));
        }
        let idx = self.free.pop().expect("a free slot when below depth");
        let total_bytes = op.len_bytes();
        self.slots[idx] = Some(InFlight {
            op,
            iovecs: IoVecs(Box::new([])),
            total_bytes,
            done_bytes: 0,
            retries: 0,
        });
        if let Err(e) = self.push(idx) {
            let f = self.slots[idx].take().expect("just filled");
            self.free.push(idx);
            return Err((e, f.op));
        }
        self.in_flight += 1;
        // The SQE is published: from here on the op belongs to the kernel until reaped, so an
        // error entering the kernel is reported by the next `wait`, not by handing it back.
        let _ = self.enter(0);
        Ok(())
    }

    fn wait(&mut self, min_complete: usize) -> Result<Vec<IoCompletion>> {
        let mut out = Vec::new();
        loop {
            self.reap(&mut out);
            if out.len() >= min_complete || self.in_flight == 0 {
                break;
            }
            let want = (min_complete - out.len()).min(self.in_flight);
            if let Err(e) = self.enter(want) {
                if out.is_empty() {
                    return Err(Error::from(e));
                }
                break;
            }
        }
        // Resubmissions pushed while reaping must reach the kernel even if nobody waits again.
        if self.in_flight > 0 {
            let _ = self.enter(0);
        }
        Ok(out)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

impl Drop for UringQueue<'_> {
    fn drop(&mut self) {
        while self.in_flight > 0 {
            if self.wait(usize::MAX).is_err() {
                // The kernel cannot be waited on: it may still read these buffers, so they must
                // never be freed. Leak them (and their iovecs).
                for slot in self.slots.drain(..).flatten() {
                    std::mem::forget(slot);
                }
                self.in_flight = 0;
            }
        }
    }
}

impl fmt::Debug for UringQueue<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringQueue")
            .field("fds", &self.fds)
            .field("depth", &self.depth)
            .field("in_flight", &self.in_flight)
            .field("short_writes", &self.short_writes)
            .finish()
    }
}
