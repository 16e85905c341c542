//! The request paths: read, write, discard, write-zeroes (zram's `zram_bio_read`,
//! `zram_bio_write`, `zram_bio_discard`).
//!
//! A request is validated whole before anything changes: offset and length multiples of 512
//! (any bytes for the `*_bytes*` forms, which NBD clients that negotiated no block size use),
//! length not 0, the range inside the device. It is then split into pages, and each page goes
//! to the [store](crate::store): a full-page write compresses and allocates *outside* the slot
//! lock and publishes under it; a partial page is read, patched, compressed and published with
//! the slot lock held throughout, so two requests touching different sectors of one page never
//! lose each other's data. Reads of written-back pages pin their location and read it without
//! the slot lock (see the store's docs).
//!
//! Failure of one page (no memory, `mem_limit`, a backing read error) leaves that page's old
//! contents intact and fails the request; pages before it in the same request stay written, as
//! with any block device.
//!
//! Lock order: init lock (shared) → slot lock → the store's leaf locks.

use super::block_stat::Op;
use super::Device;
use crate::compress;
use crate::error::{Error, Result};
use crate::slot::SlotIndex;
use crate::store::Store;
use crate::units::SECTOR_SIZE_BYTES;
use crate::Extent;
use std::cell::RefCell;
use std::sync::atomic::Ordering;

/// Per-thread buffers for the hot path: allocated once per thread, never per page.
#[derive(Debug, Default)]
struct Scratch {
    /// Compression output: at least `compress_bound(page size)` bytes.
    dst: Vec<u8>,
    /// One page, for read-modify-write and partial reads.
    page: Vec<u8>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch sized for `page_size` pages.
fn with_scratch<R>(page_size: usize, f: impl FnOnce(&mut [u8], &mut [u8]) -> R) -> R {
    SCRATCH.with(|cell| {
        let mut s = cell.borrow_mut();
        let bound = compress::compress_bound(page_size);
        if s.dst.len() < bound {
            s.dst.resize(bound, 0);
        }
        if s.page.len() < page_size {
            s.page.resize(page_size, 0);
        }
        let Scratch { dst, page } = &mut *s;
        f(&mut dst[..bound], &mut page[..page_size])
    })
}

/// One page's part of a request.
#[derive(Debug, Clone, Copy)]
struct Segment {
    index: SlotIndex,
    /// Offset inside the page.
    offset_bytes: usize,
    len_bytes: usize,
}

fn segments(offset: u64, len: u64, page: usize) -> impl Iterator<Item = Segment> {
    let page64 = page as u64;
    let end = offset + len;
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let index = pos / page64;
        let in_page = (pos % page64) as usize;
        let n = ((page - in_page) as u64).min(end - pos) as usize;
        pos += n as u64;
        Some(Segment {
            index: SlotIndex(index),
            offset_bytes: in_page,
            len_bytes: n,
        })
    })
}

/// The alignment a request's offset and length must have: a sector (zram's), or a byte.
const SECTOR: u64 = SECTOR_SIZE_BYTES as u64;
const BYTE: u64 = 1;

impl Device {
    fn check_io(&self, store: &Store, offset: u64, len: u64, align: u64) -> Result<()> {
        if len == 0 {
            return Err(Error::invalid("zero-length I/O"));
        }
        if offset % align != 0 || len % align != 0 {
            return Err(Error::invalid(format!(
                "I/O at {offset}+{len} is not aligned to 512-byte sectors"
            )));
        }
        match offset.checked_add(len) {
            Some(end) if end <= store.size_bytes() => Ok(()),
            _ => Err(Error::invalid(format!(
                "I/O at {offset}+{len} is past the end of the device ({} bytes)",
                store.size_bytes()
            ))),
        }
    }

    /// Reads `buf.len()` bytes at byte `offset` (both multiples of 512).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read(buf, offset, SECTOR)
    }

    /// Reads `buf.len()` bytes at byte `offset`, any of either.
    pub fn read_bytes_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read(buf, offset, BYTE)
    }

    fn read(&self, buf: &mut [u8], offset: u64, align: u64) -> Result<()> {
        let store = self.store()?;
        self.check_io(&store, offset, buf.len() as u64, align)?;
        let _io = self.block_stat.start(Op::Read, buf.len() as u64);
        let page = self.page_size_bytes;
        let mut done = 0;
        for seg in segments(offset, buf.len() as u64, page) {
            let out = &mut buf[done..done + seg.len_bytes];
            done += seg.len_bytes;
            let r = with_scratch(page, |blk, tmp| {
                if seg.len_bytes == page {
                    return store.read_page(seg.index, out, blk);
                }
                store.read_page(seg.index, tmp, blk)?;
                out.copy_from_slice(&tmp[seg.offset_bytes..seg.offset_bytes + seg.len_bytes]);
                Ok(())
            });
            if let Err(e) = r {
                store.note_failed_read();
                return Err(e);
            }
        }
        Ok(())
    }

    /// Writes `buf` at byte `offset` (both multiples of 512).
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write(buf, offset, SECTOR)
    }

    /// Writes `buf` at byte `offset`, any of either: partial pages take the read-modify-write
    /// path under their slot lock, as partial sectors do.
    pub fn write_bytes_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write(buf, offset, BYTE)
    }

    fn write(&self, buf: &[u8], offset: u64, align: u64) -> Result<()> {
        let store = self.store()?;
        self.check_io(&store, offset, buf.len() as u64, align)?;
        let _io = self.block_stat.start(Op::Write, buf.len() as u64);
        let page = self.page_size_bytes;
        let limit = self.mem_limit_pages.load(Ordering::Relaxed);
        // With `multi_page_size`, an aligned group of `n` pages inside the request is stored as
        // one object; `skip` counts the group's remaining segments.
        let n = store.multi_pages();
        let mut skip = 0;
        let mut done = 0;
        for seg in segments(offset, buf.len() as u64, page) {
            if skip > 0 {
                skip -= 1;
                continue;
            }
            let group_bytes = n * page;
            if n > 1
                && seg.offset_bytes == 0
                && seg.index.0 % n as u64 == 0
                && buf.len() - done >= group_bytes
            {
                let data = &buf[done..done + group_bytes];
                done += group_bytes;
                skip = n - 1;
                let r = with_scratch(group_bytes, |dst, _| {
                    store.write_group(seg.index, data, dst, limit)
                });
                if let Err(e) = r {
                    store.note_failed_write();
                    return Err(e);
                }
                continue;
            }
            let data = &buf[done..done + seg.len_bytes];
            done += seg.len_bytes;
            let r = if seg.len_bytes == page {
                with_scratch(page, |dst, _| store.write_page(seg.index, data, dst, limit))
            } else {
                write_partial(&store, seg, |p| p.copy_from_slice(data), limit)
            };
            if let Err(e) = r {
                store.note_failed_write();
                return Err(e);
            }
        }
        Ok(())
    }

    /// Frees the whole pages inside the range (TRIM); partial pages are left alone, as zram
    /// does (freeing memory is the point of a discard; rewriting part of a page is not).
    ///
    /// A release path: each slot's metadata and counters are cleared under its lock (so the
    /// page reads back as zeroes, and `mm_stat` drops, before this returns), and only the
    /// allocator free is deferred ([`ZsPool::free_deferred`](crate::zsmalloc::ZsPool)).
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let store = self.store()?;
        self.check_io(&store, offset, len, SECTOR)?;
        let _io = self.block_stat.start(Op::Discard, len);
        for seg in segments(offset, len, self.page_size_bytes) {
            if seg.len_bytes == self.page_size_bytes {
                store.release(seg.index, self.release);
            }
        }
        Ok(())
    }

    /// A swap frontend's notification that page `index` was freed (zram's
    /// `zram_slot_free_notify`, called when a process exits or swaps a page back in for good).
    /// A release path like [`discard`](Self::discard): the slot is emptied under its lock and
    /// the object freed through the deferred-free queue. Never waits: if the slot is locked the
    /// notification is dropped and counted in `miss_free` (the page stays stored until it is
    /// overwritten or discarded, as in zram). `EINVAL` for an index past the end.
    pub fn slot_free_notify(&self, index: u64) -> Result<()> {
        let store = self.store()?;
        if index >= store.nr_pages() {
            return Err(Error::invalid(format!(
                "slot {index} is past the end of the device ({} slots)",
                store.nr_pages()
            )));
        }
        store.free_notify(SlotIndex(index), self.release);
        Ok(())
    }

    /// Makes the range read back as zeroes: whole pages are freed, partial pages rewritten.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.zero(offset, len, SECTOR)
    }

    /// [`write_zeroes`](Self::write_zeroes) at any byte offset and length.
    pub fn write_zeroes_bytes(&self, offset: u64, len: u64) -> Result<()> {
        self.zero(offset, len, BYTE)
    }

    fn zero(&self, offset: u64, len: u64, align: u64) -> Result<()> {
        let store = self.store()?;
        self.check_io(&store, offset, len, align)?;
        let _io = self.block_stat.start(Op::Write, len);
        let limit = self.mem_limit_pages.load(Ordering::Relaxed);
        for seg in segments(offset, len, self.page_size_bytes) {
            if seg.len_bytes == self.page_size_bytes {
                store.free_page(seg.index);
            } else if let Err(e) = write_partial(&store, seg, |p| p.fill(0), limit) {
                store.note_failed_write();
                return Err(e);
            }
        }
        Ok(())
    }

    /// What `[offset, offset + len)` holds, a run per change of allocation, at most
    /// `max_extents` runs (see [`BlockDevice::allocation`](crate::BlockDevice::allocation)).
    /// A page is a hole when its slot is empty and zero when it is same-filled with zero
    /// bytes; both are read again under the slot lock before they are reported (the unlocked
    /// look only skips the lock for pages holding data), so a page written before the call
    /// is never reported as one that reads as zeroes.
    pub fn allocation(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> Result<()> {
        out.clear();
        let store = self.store()?;
        self.check_io(&store, offset, len, BYTE)?;
        let page = self.page_size_bytes as u64;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let index = pos / page;
            let next = ((index + 1) * page).min(end);
            let allocation = store.allocation(SlotIndex(index));
            if let Some(e) = out.last_mut().filter(|e| e.allocation == allocation) {
                e.len_bytes += next - pos;
            } else if out.len() >= max_extents.max(1) {
                break;
            } else {
                out.push(Extent {
                    len_bytes: next - pos,
                    allocation,
                });
            }
            pos = next;
        }
        Ok(())
    }

    /// Makes completed writes durable: nothing to do for RAM. It also drains the allocator's
    /// deferred-free queue, so the memory of pages discarded before the flush is returned when
    /// it completes (a natural point: clients flush after trimming).
    pub fn flush(&self) -> Result<()> {
        let store = self.store()?;
        let _io = self.block_stat.start(Op::Flush, 0);
        store.flush_deferred();
        Ok(())
    }
}

/// Read-modify-write of the part of one page `seg` covers: `patch` gets that part.
fn write_partial(
    store: &Store,
    seg: Segment,
    patch: impl FnOnce(&mut [u8]),
    limit_pages: u64,
) -> Result<()> {
    let page_size = store.page_size_bytes();
    with_scratch(page_size, |dst, page| {
        store.write_partial(
            seg.index,
            |p| patch(&mut p[seg.offset_bytes..seg.offset_bytes + seg.len_bytes]),
            page,
            dst,
            limit_pages,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_split_at_page_boundaries() {
        let segs: Vec<_> = segments(4096 - 512, 4096 + 1024, 4096)
            .map(|s| (s.index.0, s.offset_bytes, s.len_bytes))
            .collect();
        assert_eq!(segs, vec![(0, 3584, 512), (1, 0, 4096), (2, 0, 512)]);
    }
}
