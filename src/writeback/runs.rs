//! The bitmap target's placement: one block per page, runs of adjacent blocks written as one
//! vectored write.
//!
//! A pool of `writeback_batch_size` page-sized request buffers: a candidate is copied into an
//! idle buffer (the object as stored with `compressed_writeback`, else the page decompressed;
//! a HUGE page raw either way) and placed in the **first free block** of the bitmap, reserved
//! before the copy (a candidate that turns out to have changed leaves its block reserved for
//! the next one, given back when the pass ends). The page's location is the block with the
//! CRC-32C of the whole block buffer (checked on read-back, see `crate::store::target`). When every buffer is taken (or no more
//! candidates come) the placed pages are sorted by block and go out as runs of adjacent blocks,
//! up to [`max_run_pages`] per write; a completed write's buffers become idle again.

use super::engine::{PlacedWrite, Placement};
use crate::backing::{AlignedBuf, IoOp, MAX_OP_BUFS};
use crate::error::{Error, ErrorKind, Result};
use crate::slot::SlotIndex;
use crate::store::{BitmapTarget, BlockIndex, Copied};

/// The longest vectored write, in pages, for a pool of `batch` requests: half the pool, so that
/// when the pool is full at least two writes are in flight and the device has the second one
/// while the task reaps the first and refills (a single pool-sized write makes the loop
/// alternate between a busy device and an idle one). Never above `IOV_MAX` buffers.
///
/// Chosen with `uzram bench writeback --layout sequential --pages 20000 --repeats 3` on the
/// shared VM (ext4 on virtio, O_DIRECT), pages/s at batch 32 / 128 by divisor:
/// 1 (whole pool): 50k / 72k; 2: 64k / 92k; 4: 54k / 79k; 8: 56k / 68k. Noisy (the file's
/// own d32 ceiling moved between 30k and 44k across those runs), but 1 is clearly worst.
pub(crate) fn max_run_pages(batch: usize) -> usize {
    (batch / 2).clamp(1, MAX_OP_BUFS)
}

/// Pages placed in blocks, waiting for their write. Invariant: every request buffer is in
/// exactly one place: `idle`, `placed`, or in an op (in flight, or handed to the engine).
pub(super) struct Runs<'a> {
    target: &'a BitmapTarget,
    batch: usize,
    /// Idle request buffers.
    idle: Vec<AlignedBuf>,
    /// A block reserved for the next page.
    reserved: Option<BlockIndex>,
    /// Placed pages: block, location (the block with the CRC of the buffer) and buffer.
    placed: Vec<(BlockIndex, u64, AlignedBuf)>,
    max_run: usize,
}

impl<'a> Runs<'a> {
    /// A pool of `batch` request buffers over `target`.
    pub(super) fn new(target: &'a BitmapTarget, batch: usize) -> Result<Runs<'a>> {
        let page = target.page_size_bytes();
        let mut idle = Vec::with_capacity(batch);
        for _ in 0..batch {
            idle.push(AlignedBuf::new_zeroed(page)?);
        }
        Ok(Runs {
            target,
            batch,
            idle,
            reserved: None,
            placed: Vec::with_capacity(batch),
            max_run: max_run_pages(batch),
        })
    }
}

impl Placement for Runs<'_> {
    fn depth(&self) -> usize {
        self.batch
    }

    fn has_room(&self) -> bool {
        !self.idle.is_empty()
    }

    fn reserve(&mut self) -> Result<()> {
        if self.reserved.is_none() {
            let block = self
                .target
                .bitmap()
                .alloc()
                .ok_or_else(|| Error::new(ErrorKind::NoSpace, "the backing device is full"))?;
            self.reserved = Some(block);
        }
        Ok(())
    }

    fn as_stored(&self) -> bool {
        self.target.compressed()
    }

    fn buffer(&mut self) -> &mut [u8] {
        self.idle.last_mut().expect("taken only with room")
    }

    fn place(&mut self, _slot: SlotIndex, copied: &Copied) -> Result<u64> {
        let mut buf = self.idle.pop().expect("placed only with room");
        buf[copied.len_bytes..].fill(0);
        let block = self.reserved.take().expect("reserved before the copy");
        // The checksum covers the whole block as written, padding included: what a read-back
        // reads.
        let location = self.target.location(block, &buf);
        self.placed.push((block, location, buf));
        Ok(location)
    }

    fn ready(&mut self, all: bool) -> Vec<PlacedWrite> {
        if !all || self.placed.is_empty() {
            return Vec::new();
        }
        let mut placed = std::mem::take(&mut self.placed);
        placed.sort_by_key(|(block, _, _)| *block);
        let page = self.target.page_size_bytes() as u64;
        let mut writes = Vec::new();
        let mut it = placed.into_iter().peekable();
        while let Some((first, location, buf)) = it.next() {
            let mut last = first;
            let mut locations = vec![location];
            let mut bufs = vec![buf];
            while locations.len() < self.max_run {
                match it.peek() {
                    Some((b, _, _)) if b.0 == last.0 + 1 => {
                        let (b, location, buf) = it.next().expect("peeked");
                        last = b;
                        locations.push(location);
                        bufs.push(buf);
                    }
                    _ => break,
                }
            }
            writes.push(PlacedWrite {
                op: IoOp::new(first.0 * page, bufs, 0),
                locations,
            });
        }
        writes
    }

    fn finish(&mut self) {}

    fn written(&mut self, _op: &IoOp) {}

    fn recycle(&mut self, op: IoOp) {
        self.idle.extend(op.bufs);
    }

    fn write_failed(&mut self, _locations: &[u64]) {}

    fn release_reserved(&mut self) {
        if let Some(block) = self.reserved.take() {
            self.target.bitmap().release(block);
        }
    }
}
