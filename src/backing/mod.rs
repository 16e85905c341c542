//! Backing devices: where written-back pages go. This layer moves bytes at offsets; it knows
//! nothing about pages, slots or zram.
//!
//! # Parts
//!
//! - [`Backing`]: synchronous reads and writes callable from many threads at once (the
//!   read-back path reads from many request threads), `flush`, and [`Backing::new_queue`] for
//!   asynchronous writes owned by one writeback task.
//! - [`IoQueue`]: a queue of in-flight [`IoOp`] writes with owned buffers; [`IoQueue::wait`]
//!   reaps [`IoCompletion`]s, each handing its op (and so its buffers) back.
//! - Engines: [`FileBacking`] (a regular file or a block device, `O_DIRECT` when the file system
//!   takes it) whose queues are [`UringQueue`] (io_uring, [`Engine::Uring`]) or [`SyncQueue`]
//!   (one `pwritev` per op at submit time, [`Engine::Sync`]: the old single-page path);
//!   and, with the `testing` feature, `MemBacking` (in memory) and `FaultyBacking` (wraps any
//!   backing and injects EIO, ENOSPC, short and torn writes, on synchronous and queued writes
//!   alike), and `ModelBacking` (wraps any backing and makes each request take the time a
//!   modelled hard disk or SSD would: `device_model`).
//! - [`verify`]: the checksum of a written-back block and the count (and once-per-device log)
//!   of data a backing returned that failed verification.
//! - [`ceiling`]: the 4 KiB write throughput of a backing at a queue depth, the anchor the
//!   writeback benchmark reports against.
//!
//! # Contracts
//!
//! - Offsets and lengths are multiples of [`SECTOR_SIZE_BYTES`](crate::units::SECTOR_SIZE_BYTES) (512), lengths are non-zero, and a
//!   request lies inside `[0, size_bytes())`; anything else fails with `InvalidArgument` and
//!   touches nothing. Buffers passed to the synchronous calls may have any memory alignment (the
//!   file engine bounces unaligned ones); queued ops use [`AlignedBuf`]s.
//! - **A short transfer is never success.** Every engine either completes the remainder itself
//!   (the file engines loop on short `pread`/`pwrite` and resubmit the rest of a short io_uring
//!   write) or reports `ErrorKind::Io`.
//! - **Buffer ownership.** An op submitted to a queue owns its buffers until its completion is
//!   reaped by [`IoQueue::wait`]: the caller cannot touch them meanwhile (they were moved into
//!   the queue), and a queue never frees a buffer the kernel may still read from. Dropping a
//!   queue with ops in flight waits for them; if the kernel cannot be waited on, their buffers
//!   are leaked, never freed.
//! - **Submit hands the op back.** [`IoQueue::submit`] fails only for an op that was not given
//!   to the kernel, and then returns it with the error so the caller can refund and release
//!   what the op stood for.
//! - Concurrent writes to overlapping ranges (or a read racing a write of the same range) have
//!   unspecified results; the stores above never issue them (a backing location belongs to
//!   one slot).
//! - Errors map errno to kind: `ENOSPC` (and `EDQUOT`, `EFBIG`) is `NoSpace`, `EIO` and
//!   anything unknown is `Io`.

mod aligned_buf;
pub mod blkzoned;
pub mod ceiling;
#[cfg(any(test, feature = "testing"))]
mod device_model;
#[cfg(any(test, feature = "testing"))]
mod faulty;
mod fds;
mod file;
#[cfg(any(test, feature = "testing"))]
mod mem;
pub mod nbd;
mod sync;
mod sys;
mod uring;
pub mod verify;

use std::fmt::Debug;
use std::sync::Arc;

pub use aligned_buf::{AlignedBuf, BUF_ALIGN_BYTES};
pub use blkzoned::{ZoneGeometry, ZoneInfo, ZoneKind, ZonePlugQueue};
#[cfg(any(test, feature = "testing"))]
pub use device_model::{DeviceModel, ModelBacking, ModelStats};
#[cfg(any(test, feature = "testing"))]
pub use faulty::{FaultCounts, FaultKind, FaultPlan, FaultyBacking};
pub use file::{DirectIo, FileBacking, FileOptions};
#[cfg(any(test, feature = "testing"))]
pub use mem::MemBacking;
pub use nbd::{NbdBacking, NbdOptions};
pub use sync::SyncQueue;
pub use uring::UringQueue;

use crate::error::{Error, Result};
use crate::units::SECTOR_SIZE_BYTES;

/// The writeback unit: one 4 KiB block. [`Backing::block_size_bytes`] of every engine.
pub use crate::units::BLOCK_SIZE_BYTES;

/// The largest queue depth [`Backing::new_queue`] accepts: io_uring's SQ ring holds at most
/// 32768 entries, and the writeback batch is far below this (default 32).
pub const MAX_QUEUE_DEPTH: usize = 4096;

/// The most buffers one [`IoOp`] may carry: Linux's `IOV_MAX`, the iovecs one `pwritev` or
/// `IORING_OP_WRITEV` takes.
pub const MAX_OP_BUFS: usize = sys::IOV_MAX;

/// Which engine runs a file backing's queued writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Engine {
    /// io_uring: up to `depth` vectored writes in flight, reaped by the owning task.
    #[default]
    Uring,
    /// One synchronous `pwritev` per op, performed at submit time; its completion is returned
    /// by the next `wait`. The old single-page path, kept for comparison.
    Sync,
}

impl Engine {
    /// The engine's name, as the benchmark prints it.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Uring => "uring",
            Engine::Sync => "sync",
        }
    }
}

/// A backing store: a fixed-size range of bytes.
///
/// All methods take `&self` and may be called from many threads at once. See the module docs
/// for the alignment, range and short-transfer contracts.
pub trait Backing: Send + Sync + Debug {
    /// The usable size in bytes (a multiple of [`BLOCK_SIZE_BYTES`]).
    fn size_bytes(&self) -> u64;
    /// The writeback unit, 4096 bytes.
    fn block_size_bytes(&self) -> usize {
        BLOCK_SIZE_BYTES
    }
    /// Reads `buf.len()` bytes at `offset`, all of them or an error.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// Fills `bufs` back to back from `offset` (their total a multiple of 512 bytes), all of
    /// them or an error. One `preadv` for files; the default reads buffer by buffer.
    fn readv_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> Result<()> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        check_range(self.size_bytes(), offset, total, "read")?;
        let mut at = offset;
        for b in bufs.iter_mut() {
            if !b.is_empty() {
                self.read_at(b, at)?;
            }
            at += b.len() as u64;
        }
        Ok(())
    }
    /// Writes all of `buf` at `offset`, or fails.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.writev_at(&[buf], offset)
    }
    /// Writes `bufs` back to back starting at `offset` (their total a multiple of 512 bytes),
    /// or fails. On failure any part of the range may have been written.
    fn writev_at(&self, bufs: &[&[u8]], offset: u64) -> Result<()>;
    /// Makes completed writes durable.
    fn flush(&self) -> Result<()>;
    /// What zram's `backing_dev` shows: the path (or a name for engines without one).
    fn describe(&self) -> String;
    /// A queue for asynchronous writes with up to `depth` ops in flight (1..=
    /// [`MAX_QUEUE_DEPTH`]), owned by one task. The queue borrows the backing.
    fn new_queue(&self, depth: usize) -> Result<Box<dyn IoQueue + '_>>;
    /// The zone layout when this is a zoned block device (see [`blkzoned`]); `None` for
    /// everything else, where the zoned store emulates zones.
    fn zone_geometry(&self) -> Option<&ZoneGeometry> {
        None
    }
    /// The device's zones at setup (a zoned block device only; empty otherwise).
    fn report_zones(&self) -> Result<Vec<ZoneInfo>> {
        Ok(Vec::new())
    }
    /// Moves the write pointer of the zone at `start_bytes` (of `len_bytes`) back to its
    /// start. Where zones are emulated the zone's bytes are dead: a backing may give their
    /// space back (an NBD export trims them); the default does nothing. GC calls it for
    /// emulated zones as advice (a failure is ignored) before the zone is reused.
    fn reset_zone(&self, start_bytes: u64, len_bytes: u64) -> Result<()> {
        let _ = (start_bytes, len_bytes);
        Ok(())
    }
    /// Makes the zone at `start_bytes` full, so it stops counting as open on the device.
    /// Nothing to do where zones are emulated.
    fn finish_zone(&self, start_bytes: u64, len_bytes: u64) -> Result<()> {
        let _ = (start_bytes, len_bytes);
        Ok(())
    }
}

/// A vectored write of all `bufs` (or of the `segments` of them), back to back, at `offset`.
/// The op owns its buffers.
#[derive(Debug, PartialEq, Eq)]
pub struct IoOp {
    /// Byte offset of the first byte written (a multiple of 512).
    pub offset: u64,
    /// The data, written in order with no gaps.
    pub bufs: Vec<AlignedBuf>,
    /// The caller's token, returned untouched with the completion.
    pub tag: u64,
    /// When set, only these parts of `bufs` are written, in this order (GC writes the live
    /// records of the buffers it read into, without copying them): each lies inside its
    /// buffer, is non-empty and 512-byte aligned in offset and length.
    pub segments: Option<Vec<Segment>>,
    /// Write (the default) or read.
    pub kind: IoKind,
}

/// What an [`IoOp`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoKind {
    /// Writes the op's bytes to the backing.
    #[default]
    Write,
    /// Fills the op's bytes (its buffers, or their segments) from the backing. GC reads a
    /// chunk this way and resubmits the same op as a write.
    Read,
}

/// A part of one of an op's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Index into `bufs`.
    pub buf: usize,
    /// Byte offset inside that buffer.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

impl IoOp {
    /// A write of `bufs` at `offset` tagged `tag`.
    pub fn new(offset: u64, bufs: Vec<AlignedBuf>, tag: u64) -> IoOp {
        IoOp {
            offset,
            bufs,
            tag,
            segments: None,
            kind: IoKind::Write,
        }
    }

    /// A read into `bufs` from `offset` tagged `tag`.
    pub fn read(offset: u64, bufs: Vec<AlignedBuf>, tag: u64) -> IoOp {
        IoOp {
            kind: IoKind::Read,
            ..IoOp::new(offset, bufs, tag)
        }
    }

    /// The parts of the buffers the op covers, as (buffer, offset, length).
    fn parts(&self) -> Vec<Segment> {
        match &self.segments {
            None => (0..self.bufs.len())
                .map(|buf| Segment {
                    buf,
                    offset: 0,
                    len: self.bufs[buf].len(),
                })
                .collect(),
            Some(segs) => segs.clone(),
        }
    }

    /// iovecs for the op's bytes after the first `skip_bytes`, at most `max` of them, built
    /// from the buffers' own (mutable) pointers so the kernel may write through them (reads).
    /// The iovecs stay valid while the op (and so its buffers, whose heap memory never moves)
    /// is alive and nothing else accesses the buffers.
    pub(crate) fn iovecs_mut(&mut self, mut skip_bytes: u64, max: usize) -> Vec<libc::iovec> {
        let mut out = Vec::new();
        for p in self.parts() {
            if out.len() == max {
                break;
            }
            if skip_bytes >= p.len as u64 {
                skip_bytes -= p.len as u64;
                continue;
            }
            let skip = skip_bytes as usize;
            skip_bytes = 0;
            let base = self.bufs[p.buf].as_mut_ptr();
            out.push(libc::iovec {
                // The offset stays inside the buffer: `p` was checked against it.
                iov_base: base.wrapping_add(p.offset + skip).cast(),
                iov_len: p.len - skip,
            });
        }
        out
    }

    /// Mutable slices over the op's bytes, in order (the synchronous engines' reads).
    pub(crate) fn slices_mut(&mut self) -> Vec<&mut [u8]> {
        match self.segments.clone() {
            None => self.bufs.iter_mut().map(|b| &mut b[..]).collect(),
            Some(segs) => {
                // Segments of one buffer may not overlap (checked), but several may name the
                // same buffer: split each buffer's slice at its segments in order.
                let mut per_buf: Vec<Vec<(usize, Segment)>> = vec![Vec::new(); self.bufs.len()];
                for (i, s) in segs.iter().enumerate() {
                    per_buf[s.buf].push((i, *s));
                }
                let mut out: Vec<Option<&mut [u8]>> = (0..segs.len()).map(|_| None).collect();
                for (buf, list) in self.bufs.iter_mut().zip(per_buf.iter_mut()) {
                    list.sort_by_key(|(_, s)| s.offset);
                    let mut rest: &mut [u8] = &mut buf[..];
                    let mut at = 0;
                    for (i, s) in list.iter() {
                        let (_, tail) = std::mem::take(&mut rest).split_at_mut(s.offset - at);
                        let (mine, tail) = tail.split_at_mut(s.len);
                        out[*i] = Some(mine);
                        rest = tail;
                        at = s.offset + s.len;
                    }
                }
                out.into_iter()
                    .map(|s| s.expect("every segment names a buffer"))
                    .collect()
            }
        }
    }

    /// The bytes the op writes, in order.
    pub fn slices(&self) -> Vec<&[u8]> {
        match &self.segments {
            None => self.bufs.iter().map(|b| &b[..]).collect(),
            Some(segs) => segs
                .iter()
                .map(|s| &self.bufs[s.buf][s.offset..s.offset + s.len])
                .collect(),
        }
    }

    /// The total number of bytes the op writes.
    pub fn len_bytes(&self) -> u64 {
        match &self.segments {
            None => self.bufs.iter().map(|b| b.len() as u64).sum(),
            Some(segs) => segs.iter().map(|s| s.len as u64).sum(),
        }
    }

    /// Checks `segments` against `bufs` (see the field's docs).
    fn check_segments(&self) -> Result<()> {
        let Some(segs) = &self.segments else {
            return Ok(());
        };
        let sector = SECTOR_SIZE_BYTES;
        for s in segs {
            let fits = self.bufs.get(s.buf).is_some_and(|b| {
                s.offset
                    .checked_add(s.len)
                    .is_some_and(|end| end <= b.len())
            });
            if !fits || s.len == 0 || s.offset % sector != 0 || s.len % sector != 0 {
                return Err(Error::invalid(format!(
                    "op segment {s:?} is empty, unaligned or outside its buffer"
                )));
            }
        }
        if self.kind == IoKind::Read {
            // A read must not fill the same bytes twice.
            let mut parts = segs.clone();
            parts.sort_by_key(|s| (s.buf, s.offset));
            if parts
                .windows(2)
                .any(|w| w[0].buf == w[1].buf && w[0].offset + w[0].len > w[1].offset)
            {
                return Err(Error::invalid("read op segments overlap"));
            }
        }
        Ok(())
    }

    /// Number of iovecs the op needs.
    fn iovec_count(&self) -> usize {
        self.segments.as_ref().map_or(self.bufs.len(), Vec::len)
    }
}

/// A reaped op: its buffers are the caller's again.
#[derive(Debug)]
pub struct IoCompletion {
    /// The op, with its buffers and tag.
    pub op: IoOp,
    /// `Ok` only if every byte was written.
    pub result: Result<()>,
}

/// What `submit` returns: `Err` only for an op the kernel never saw, handed back with the error.
pub type SubmitResult = std::result::Result<(), (Error, IoOp)>;

/// Asynchronous writes owned by one task (the writeback task). See the module docs for the
/// buffer-ownership invariant.
pub trait IoQueue: Send + Debug {
    /// The most ops that can be in flight (submitted and not yet reaped).
    fn depth(&self) -> usize;
    /// Queues `op`. Fails, handing `op` back, when the queue is full (`Busy`: reap first), the
    /// op is invalid (`InvalidArgument`), or the op could not be given to the kernel. A write
    /// error found later is reported in the op's completion.
    fn submit(&mut self, op: IoOp) -> SubmitResult;
    /// Reaps completions, blocking until at least `min_complete` are available or nothing is
    /// left in flight (so `wait(usize::MAX)` drains the queue and `wait(0)` never blocks).
    /// Completions come in the order they finished. `Err` means the kernel could not be waited
    /// on; the ops stay in flight.
    fn wait(&mut self, min_complete: usize) -> Result<Vec<IoCompletion>>;
    /// Ops submitted and not yet reaped.
    fn in_flight(&self) -> usize;
}

/// Checks a request against the contract: non-zero length, 512-multiples, inside the device.
pub(crate) fn check_range(size_bytes: u64, offset: u64, len_bytes: u64, what: &str) -> Result<()> {
    let sector = SECTOR_SIZE_BYTES as u64;
    if len_bytes == 0 || len_bytes % sector != 0 || offset % sector != 0 {
        return Err(Error::invalid(format!(
            "backing {what} of {len_bytes} bytes at offset {offset}: offset and length must be \
             multiples of {sector} and the length non-zero"
        )));
    }
    match offset.checked_add(len_bytes) {
        Some(end) if end <= size_bytes => Ok(()),
        _ => Err(Error::invalid(format!(
            "backing {what} of {len_bytes} bytes at offset {offset} ends past the backing \
             device's {size_bytes} bytes"
        ))),
    }
}

/// The checks every engine makes before taking an op: room in the queue, 1..=[`MAX_OP_BUFS`]
/// buffers (one `pwritev`/`IORING_OP_WRITEV`), a valid range.
pub(crate) fn check_submit(
    op: &IoOp,
    in_flight: usize,
    depth: usize,
    size_bytes: u64,
) -> Result<()> {
    if in_flight >= depth {
        return Err(Error::busy(format!(
            "backing queue full: {in_flight} of {depth} ops in flight; reap completions first"
        )));
    }
    let n = op.iovec_count();
    if n == 0 || n > MAX_OP_BUFS {
        return Err(Error::invalid(format!(
            "backing write of {n} buffers: an op has 1..={MAX_OP_BUFS}"
        )));
    }
    op.check_segments()?;
    let what = match op.kind {
        IoKind::Write => "write",
        IoKind::Read => "read",
    };
    check_range(size_bytes, op.offset, op.len_bytes(), what)
}

/// Checks a queue depth against `1..=MAX_QUEUE_DEPTH`.
pub(crate) fn check_depth(depth: usize) -> Result<()> {
    if depth == 0 || depth > MAX_QUEUE_DEPTH {
        return Err(Error::invalid(format!(
            "queue depth {depth} is outside 1..={MAX_QUEUE_DEPTH}"
        )));
    }
    Ok(())
}

/// The total length of `bufs` in bytes.
pub(crate) fn total_len(bufs: &[&[u8]]) -> u64 {
    bufs.iter().map(|b| b.len() as u64).sum()
}

macro_rules! forward_backing {
    ($ty:ty) => {
        impl<B: Backing + ?Sized> Backing for $ty {
            fn size_bytes(&self) -> u64 {
                (**self).size_bytes()
            }
            fn block_size_bytes(&self) -> usize {
                (**self).block_size_bytes()
            }
            fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
                (**self).read_at(buf, offset)
            }
            fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
                (**self).write_at(buf, offset)
            }
            fn writev_at(&self, bufs: &[&[u8]], offset: u64) -> Result<()> {
                (**self).writev_at(bufs, offset)
            }
            fn flush(&self) -> Result<()> {
                (**self).flush()
            }
            fn describe(&self) -> String {
                (**self).describe()
            }
            fn new_queue(&self, depth: usize) -> Result<Box<dyn IoQueue + '_>> {
                (**self).new_queue(depth)
            }
            fn readv_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> Result<()> {
                (**self).readv_at(bufs, offset)
            }
            fn zone_geometry(&self) -> Option<&ZoneGeometry> {
                (**self).zone_geometry()
            }
            fn report_zones(&self) -> Result<Vec<ZoneInfo>> {
                (**self).report_zones()
            }
            fn reset_zone(&self, start_bytes: u64, len_bytes: u64) -> Result<()> {
                (**self).reset_zone(start_bytes, len_bytes)
            }
            fn finish_zone(&self, start_bytes: u64, len_bytes: u64) -> Result<()> {
                (**self).finish_zone(start_bytes, len_bytes)
            }
        }
    };
}

forward_backing!(Box<B>);
forward_backing!(Arc<B>);
forward_backing!(&B);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn range_checks() {
        assert!(check_range(8192, 0, 8192, "write").is_ok());
        assert!(check_range(8192, 4096, 512, "write").is_ok());
        for (off, len) in [
            (0, 0),
            (1, 512),
            (0, 511),
            (4096, 8192),
            (u64::MAX - 511, 512),
        ] {
            let err = check_range(8192, off, len, "write").unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{off} {len}");
        }
        assert!(check_depth(0).is_err());
        assert!(check_depth(MAX_QUEUE_DEPTH + 1).is_err());
        assert!(check_depth(32).is_ok());
    }
}
