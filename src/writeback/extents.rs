//! The bitmap target's placement: one block per page, extents of adjacent blocks written as one
//! vectored write.
//!
//! A pool of `writeback_batch_size` page-sized request buffers: a candidate is copied into an
//! idle buffer (the object as stored with `compressed_writeback`, else the page decompressed;
//! a HUGE page raw either way) and placed in the **first free block** of the bitmap, reserved
//! before the copy (a candidate that turns out to have changed leaves its block reserved for
//! the next one, given back when the pass ends). The page's location is the block with the
//! CRC-32C of the whole block buffer (checked on read-back, see `crate::store::target`). When every buffer is taken (or no more
//! candidates come) the placed pages are sorted by block and go out as extents of adjacent blocks,
//! up to [`max_extent_pages`] per write; a completed write's buffers become idle again.
//!
//! A multi-page object (`multi_page_size`) goes whole, as stored: it takes the first range of
//! adjacent free blocks it fits in (`BlockBitmap::alloc_extent`), a buffer of those blocks (zero
//! padded; the CRC-32C covers them all) and one place of the pool, and is written with its
//! neighbours like a page.

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
pub(crate) fn max_extent_pages(batch: usize) -> usize {
    (batch / 2).clamp(1, MAX_OP_BUFS)
}

/// Pages placed in blocks, waiting for their write. Invariant: every request buffer is in
/// exactly one place: `idle`, `placed`, or in an op (in flight, or handed to the engine).
pub(super) struct Extents<'a> {
    target: &'a BitmapTarget,
    batch: usize,
    /// Idle request buffers.
    idle: Vec<AlignedBuf>,
    /// A block reserved for the next page.
    reserved: Option<BlockIndex>,
    /// Placed pages: block, location (the block with the CRC of the buffer) and buffer (a
    /// page, or a multi-page object's blocks).
    placed: Vec<(BlockIndex, u64, AlignedBuf)>,
    max_extent: usize,
    /// Page buffers standing for multi-page objects' buffers while those are placed or in
    /// flight: each object takes one place of the pool (so at most `batch` requests are out,
    /// each at most an extent of 64 KiB) and its own buffer, dropped when it completes.
    parked: Vec<AlignedBuf>,
}

impl<'a> Extents<'a> {
    /// A pool of `batch` request buffers over `target`.
    pub(super) fn new(target: &'a BitmapTarget, batch: usize) -> Result<Extents<'a>> {
        let page = target.page_size_bytes();
        let mut idle = Vec::with_capacity(batch);
        for _ in 0..batch {
            idle.push(AlignedBuf::new_zeroed(page)?);
        }
        Ok(Extents {
            target,
            batch,
            idle,
            reserved: None,
            placed: Vec::with_capacity(batch),
            max_extent: max_extent_pages(batch),
            parked: Vec::new(),
        })
    }
}

impl Placement for Extents<'_> {
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

    fn place_group(
        &mut self,
        _first: SlotIndex,
        obj: &[u8],
        _codec: u8,
        blocks: u64,
    ) -> Result<u64> {
        let page = self.target.page_size_bytes();
        let block = self.target.bitmap().alloc_extent(blocks).ok_or_else(|| {
            Error::new(
                ErrorKind::NoSpace,
                format!("no {blocks} adjacent free blocks on the backing device"),
            )
        })?;
        let mut buf = match AlignedBuf::new_zeroed(blocks as usize * page) {
            Ok(buf) => buf,
            Err(err) => {
                self.target.bitmap().release_extent(block, blocks);
                return Err(err);
            }
        };
        buf[..obj.len()].copy_from_slice(obj);
        self.parked
            .push(self.idle.pop().expect("placed only with room"));
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
            // One past the last block written so far.
            let mut end = first.0 + (buf.len() as u64).div_ceil(page);
            let mut locations = vec![location];
            let mut bufs = vec![buf];
            while locations.len() < self.max_extent {
                match it.peek() {
                    Some((b, _, _)) if b.0 == end => {
                        let (b, location, buf) = it.next().expect("peeked");
                        end = b.0 + (buf.len() as u64).div_ceil(page);
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
        let page = self.target.page_size_bytes();
        for buf in op.bufs {
            if buf.len() == page {
                self.idle.push(buf);
            } else {
                // A multi-page object's buffer: its place in the pool comes back.
                self.idle.push(
                    self.parked
                        .pop()
                        .expect("an extent's buffer parks a page buffer"),
                );
            }
        }
    }

    fn write_failed(&mut self, _locations: &[u64]) {}

    fn release_reserved(&mut self) {
        if let Some(block) = self.reserved.take() {
            self.target.bitmap().release(block);
        }
    }
}
