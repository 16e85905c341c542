//! The request paths: read, write, discard, write-zeroes (zram's `zram_bio_read`,
//! `zram_bio_write`, `zram_bio_discard`).
//!
//! A request is validated whole before anything changes: offset and length multiples of 512,
//! length not 0, the range inside the device. It is then split into pages. A full-page write
//! compresses and allocates *outside* the slot lock and publishes under it; a partial page is
//! read, patched, compressed and published with the slot lock held throughout, so two requests
//! touching different sectors of one page never lose each other's data.
//!
//! Failure of one page (no memory, `mem_limit`, a backing read error) leaves that page's old
//! contents intact and fails the request; pages before it in the same request stay written, as
//! with any block device.
//!
//! # Read-back of written-back (WB) slots
//!
//! No slot lock is held across backing I/O. A read of a WB slot pins the slot's block under the
//! slot lock (so the block cannot be reused while it is read, see
//! [`crate::writeback::BlockBitmap`]), drops the lock, reads the block (decompressing it when it
//! was written compressed) and counts `bd_reads`. A failed backing read fails the request with
//! `EIO` and changes nothing. A partial write of a WB slot reads the block the same way, then
//! retakes the slot lock and goes on only if the slot still points at that block (a pinned
//! block cannot come back to the slot, so this check is exact); otherwise it starts over.
//!
//! With the zoned layout the slot points at a record (`ZoneLoc`); the read pins the record's
//! *zone* under the slot lock instead ([`crate::zoned::ZonePin`]: GC does not reset a pinned
//! zone, and zones are append-only, so the record's bytes cannot change under the read), drops
//! the lock, reads and verifies the record (a checksum, magic, slot or length mismatch is
//! `EIO`, never wrong data) and decompresses it with the slot's codec when its flags say it is
//! compressed. The partial-write recheck is exact for the same reason: while the zone is
//! pinned, no other record can appear at that location.
//!
//! Lock order: init lock (shared) → slot lock → zone store mutex (pin, release, commit).

use super::stats::DeviceStats;
use super::{Device, Inner};
use crate::compress::{self, fill_same, same_filled_word};
use crate::error::{Error, Result};
use crate::slot::{SlotFlags, SlotGuard, SlotIndex};
use crate::units::SECTOR_SIZE_BYTES;
use crate::writeback::{BlockIndex, BlockPin};
use crate::zoned::{ZoneLoc, ZonePin};
use crate::zsmalloc::Handle;
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

/// A page made ready for a slot outside its lock.
#[derive(Debug)]
enum Prepared {
    Same(u64),
    Object {
        handle: Handle,
        size_bytes: usize,
        huge: bool,
    },
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

impl Device {
    fn check_io(&self, inner: &Inner, offset: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Err(Error::invalid("zero-length I/O"));
        }
        if offset % SECTOR_SIZE_BYTES != 0 || len % SECTOR_SIZE_BYTES != 0 {
            return Err(Error::invalid(format!(
                "I/O at {offset}+{len} is not aligned to 512-byte sectors"
            )));
        }
        match offset.checked_add(len) {
            Some(end) if end <= inner.disksize_bytes => Ok(()),
            _ => Err(Error::invalid(format!(
                "I/O at {offset}+{len} is past the end of the device ({} bytes)",
                inner.disksize_bytes
            ))),
        }
    }

    /// Reads `buf.len()` bytes at byte `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let inner = self.inner()?;
        self.check_io(&inner, offset, buf.len() as u64)?;
        let page = self.page_size_bytes;
        let mut done = 0;
        for seg in segments(offset, buf.len() as u64, page) {
            let out = &mut buf[done..done + seg.len_bytes];
            done += seg.len_bytes;
            let r = with_scratch(page, |blk, tmp| {
                let full = seg.len_bytes == page;
                let mut g = inner.slots.lock(seg.index);
                g.touch(inner.now_secs());
                let target: &mut [u8] = if full { &mut *out } else { &mut *tmp };
                let source = read_slot(&inner, &g, target);
                drop(g);
                match source? {
                    Source::Done => {}
                    Source::Backing(pin, st) => read_backing(&inner, &pin, st, target, blk)?,
                    Source::Zoned(pin, st) => read_zoned(&inner, seg.index.0, &pin, st, target)?,
                }
                if !full {
                    out.copy_from_slice(&tmp[seg.offset_bytes..seg.offset_bytes + seg.len_bytes]);
                }
                Ok(())
            });
            if let Err(e) = r {
                DeviceStats::add(&inner.stats.failed_reads, 1);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Writes `buf` at byte `offset`.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let inner = self.inner()?;
        self.check_io(&inner, offset, buf.len() as u64)?;
        let page = self.page_size_bytes;
        let limit = self.mem_limit_pages.load(Ordering::Relaxed);
        let mut done = 0;
        for seg in segments(offset, buf.len() as u64, page) {
            let data = &buf[done..done + seg.len_bytes];
            done += seg.len_bytes;
            let r = if seg.len_bytes == page {
                with_scratch(page, |dst, _| {
                    let prepared = prepare(&inner, data, dst, limit)?;
                    let mut g = inner.slots.lock(seg.index);
                    publish(&inner, &mut g, prepared);
                    Ok(())
                })
            } else {
                self.write_partial(&inner, seg, |p| p.copy_from_slice(data), limit)
            };
            if let Err(e) = r {
                DeviceStats::add(&inner.stats.failed_writes, 1);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Read-modify-write of part of one page, with the slot locked from the read to the
    /// publish. A written-back page is read with the lock dropped (see the module docs).
    fn write_partial(
        &self,
        inner: &Inner,
        seg: Segment,
        patch: impl FnOnce(&mut [u8]),
        limit_pages: u64,
    ) -> Result<()> {
        with_scratch(self.page_size_bytes, |dst, page| loop {
            let mut g = inner.slots.lock(seg.index);
            let _pin = match read_slot(inner, &g, page)? {
                Source::Done => None,
                Source::Backing(pin, st) => {
                    drop(g);
                    read_backing(inner, &pin, st, page, dst)?;
                    g = inner.slots.lock(seg.index);
                    if g.state().wb_location() != Some(pin.block().0) {
                        continue;
                    }
                    Some(Pin::Block(pin))
                }
                Source::Zoned(pin, st) => {
                    drop(g);
                    read_zoned(inner, seg.index.0, &pin, st, page)?;
                    g = inner.slots.lock(seg.index);
                    if g.state().wb_location() != Some(pin.loc().to_raw()) {
                        continue;
                    }
                    Some(Pin::Zone(pin))
                }
            };
            patch(&mut page[seg.offset_bytes..seg.offset_bytes + seg.len_bytes]);
            let prepared = prepare(inner, page, dst, limit_pages)?;
            publish(inner, &mut g, prepared);
            return Ok(());
        })
    }

    /// Frees the whole pages inside the range (TRIM); partial pages are left alone, as zram
    /// does (freeing memory is the point of a discard; rewriting part of a page is not).
    ///
    /// A release path: each slot's metadata and counters are cleared under its lock (so the
    /// page reads back as zeroes, and `mm_stat` drops, before this returns), and only the
    /// allocator free is deferred ([`ZsPool::free_deferred`](crate::zsmalloc::ZsPool)).
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let inner = self.inner()?;
        self.check_io(&inner, offset, len)?;
        let how = self.release;
        for seg in segments(offset, len, self.page_size_bytes) {
            if seg.len_bytes == self.page_size_bytes {
                let mut g = inner.slots.lock(seg.index);
                release_slot(&inner, &mut g, how);
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
        let inner = self.inner()?;
        if index >= inner.slots.len() {
            return Err(Error::invalid(format!(
                "slot {index} is past the end of the device ({} slots)",
                inner.slots.len()
            )));
        }
        DeviceStats::add(&inner.stats.notify_free, 1);
        let index = SlotIndex(index);
        let Some(mut g) = SlotGuard::try_lock(inner.slots.entry(index), index) else {
            DeviceStats::add(&inner.stats.miss_free, 1);
            return Ok(());
        };
        release_slot(&inner, &mut g, self.release);
        Ok(())
    }

    /// Makes the range read back as zeroes: whole pages are freed, partial pages rewritten.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let inner = self.inner()?;
        self.check_io(&inner, offset, len)?;
        let limit = self.mem_limit_pages.load(Ordering::Relaxed);
        for seg in segments(offset, len, self.page_size_bytes) {
            if seg.len_bytes == self.page_size_bytes {
                let mut g = inner.slots.lock(seg.index);
                free_slot(&inner, &mut g);
                g.touch(inner.now_secs());
            } else if let Err(e) = self.write_partial(&inner, seg, |p| p.fill(0), limit) {
                DeviceStats::add(&inner.stats.failed_writes, 1);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Makes completed writes durable: nothing to do for RAM. It also drains the allocator's
    /// deferred-free queue, so the memory of pages discarded before the flush is returned when
    /// it completes (a natural point: clients flush after trimming).
    pub fn flush(&self) -> Result<()> {
        let inner = self.inner()?;
        inner.pool.flush();
        Ok(())
    }
}

/// Where a slot's page comes from.
enum Source<'a> {
    /// Already in `out`.
    Done,
    /// On the backing device: read the pinned block after dropping the slot lock.
    Backing(BlockPin<'a>, crate::slot::SlotState),
    /// A record in the zoned store: read it after dropping the slot lock.
    Zoned(ZonePin<'a>, crate::slot::SlotState),
}

/// A pin held by a partial write until it publishes (only to keep it alive).
enum Pin<'a> {
    Block(#[allow(dead_code)] BlockPin<'a>),
    Zone(#[allow(dead_code)] ZonePin<'a>),
}

/// Reads the slot's page into `out` (one page) if it is in RAM; for a WB slot pins its block
/// and returns it. The caller holds the slot lock.
fn read_slot<'a>(inner: &'a Inner, g: &SlotGuard<'_>, out: &mut [u8]) -> Result<Source<'a>> {
    let st = g.state();
    if st.is_empty() {
        out.fill(0);
        return Ok(Source::Done);
    }
    if let Some(word) = st.same_word() {
        fill_same(out, word);
        return Ok(Source::Done);
    }
    if let Some(location) = st.wb_location() {
        let wb = inner
            .wb
            .as_ref()
            .expect("a WB slot implies a backing device");
        if let Some(store) = wb.zoned.as_ref() {
            return Ok(Source::Zoned(store.pin(ZoneLoc::from_raw(location)), st));
        }
        return Ok(Source::Backing(wb.bitmap.pin(BlockIndex(location)), st));
    }
    let handle = Handle::from_raw(st.value).expect("non-empty slot has a handle");
    inner.pool.read(handle, |obj| {
        if st.has(SlotFlags::HUGE) {
            out.copy_from_slice(obj);
            Ok(())
        } else {
            inner.codec.decompress(obj, out)
        }
    })?;
    Ok(Source::Done)
}

/// Reads a written-back page from its pinned block into `out` (one page), decompressing it if
/// it was written compressed (`blk` is a page of scratch for that). No slot lock is held.
/// Counts `bd_reads`; a backing error is `EIO` and changes nothing.
fn read_backing(
    inner: &Inner,
    pin: &BlockPin<'_>,
    st: crate::slot::SlotState,
    out: &mut [u8],
    blk: &mut [u8],
) -> Result<()> {
    let wb = inner
        .wb
        .as_ref()
        .expect("a WB slot implies a backing device");
    let page = out.len();
    let offset = wb.offset(pin.block());
    let io_err = |e: Error| {
        Error::io(format!(
            "reading written-back page from block {} of {}: {e}",
            pin.block().0,
            wb.backing.describe()
        ))
    };
    if wb.compressed && !st.has(SlotFlags::HUGE) {
        let blk = &mut blk[..page];
        wb.backing.read_at(blk, offset).map_err(io_err)?;
        let size = st.size_bytes();
        inner
            .codec
            .decompress(&blk[..size], out)
            .map_err(|e| Error::io(format!("written-back object does not decompress: {e}")))?;
    } else {
        wb.backing.read_at(out, offset).map_err(io_err)?;
    }
    crate::writeback::add(&wb.bd_reads, 1);
    Ok(())
}

/// Reads a written-back page from its record in the zoned store into `out` (one page): the
/// record is verified (magic, slot, length, checksum) and decompressed with the codec of its
/// priority when it holds a compressed object. No slot lock is held; `pin` keeps the zone from
/// being reset. Counts `bd_reads`; any failure is `EIO` and changes nothing.
fn read_zoned(
    inner: &Inner,
    slot: u64,
    pin: &ZonePin<'_>,
    st: crate::slot::SlotState,
    out: &mut [u8],
) -> Result<()> {
    let wb = inner
        .wb
        .as_ref()
        .expect("a WB slot implies a backing device");
    let store = wb
        .zoned
        .as_ref()
        .expect("a zoned pin implies a zoned store");
    let io_err = |e: Error| {
        Error::io(format!(
            "reading written-back page {slot} from {:?} of {}: {e}",
            pin.loc(),
            wb.backing.describe()
        ))
    };
    let (h, payload) = store.read_record(pin.loc(), slot).map_err(io_err)?;
    if h.is_compressed() {
        // Only the primary codec exists (no recompression yet): priority 0 is all a record can
        // hold; anything else would be a record this device did not write.
        if h.prio != 0 || h.prio != st.prio() {
            return Err(io_err(Error::io(format!(
                "record compressed with priority {}, slot says {}",
                h.prio,
                st.prio()
            ))));
        }
        inner
            .codec
            .decompress(&payload, out)
            .map_err(|e| io_err(Error::io(format!("record does not decompress: {e}"))))?;
    } else {
        if payload.len() != out.len() {
            return Err(io_err(Error::io(format!(
                "raw record of {} bytes for a {}-byte page",
                payload.len(),
                out.len()
            ))));
        }
        out.copy_from_slice(&payload);
    }
    crate::writeback::add(&wb.bd_reads, 1);
    Ok(())
}

/// Compresses and stores `page` in the pool, outside any slot lock. On error nothing is held.
fn prepare(inner: &Inner, page: &[u8], dst: &mut [u8], limit_pages: u64) -> Result<Prepared> {
    if let Some(word) = same_filled_word(page) {
        return Ok(Prepared::Same(word));
    }
    let comp_len = inner.codec.compress(page, dst)?;
    let (src, huge) = if comp_len >= inner.huge_threshold_bytes {
        (page, true)
    } else {
        (&dst[..comp_len], false)
    };
    let handle = inner.pool.malloc(src.len())?;
    // As zram: allocate, then check the pool against the limit; over it, give the object back.
    let mut total_pages = inner.pool.total_pages();
    inner.stats.update_max_used(total_pages);
    if limit_pages != 0 && total_pages > limit_pages && inner.pool.deferred_stats().pending > 0 {
        // Objects of released pages still hold memory: free them before refusing the write.
        inner.pool.flush();
        total_pages = inner.pool.total_pages();
    }
    if limit_pages != 0 && total_pages > limit_pages {
        inner.pool.free(handle);
        return Err(Error::no_memory(format!(
            "mem_limit reached ({limit_pages} pages)"
        )));
    }
    inner.pool.write(handle, src);
    Ok(Prepared::Object {
        handle,
        size_bytes: src.len(),
        huge,
    })
}

/// Replaces the slot's contents with `prepared`. The caller holds the slot lock.
fn publish(inner: &Inner, g: &mut SlotGuard<'_>, prepared: Prepared) {
    free_slot(inner, g);
    let s = &inner.stats;
    match prepared {
        Prepared::Same(word) => {
            g.set_same(word);
            DeviceStats::add(&s.same_pages, 1);
        }
        Prepared::Object {
            handle,
            size_bytes,
            huge,
        } => {
            let flags = if huge {
                SlotFlags::HUGE
            } else {
                SlotFlags::NONE
            };
            g.set_handle(handle.to_raw(), size_bytes, flags, 0);
            DeviceStats::add(&s.compr_data_size_bytes, size_bytes as u64);
            if huge {
                DeviceStats::add(&s.huge_pages, 1);
                DeviceStats::add(&s.huge_pages_since, 1);
            }
        }
    }
    DeviceStats::add(&s.pages_stored, 1);
    g.touch(inner.now_secs());
}

/// How [`release_slot`] frees the slot's allocator object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Free {
    /// `ZsPool::free` (overwrites, write-zeroes, every path but the release paths).
    Sync,
    /// `ZsPool::free_deferred`: release paths (discard, free notifications).
    Deferred,
}

/// Releases whatever the slot holds and empties it (zram's `zram_free_page`). The caller holds
/// the slot lock.
pub(crate) fn free_slot(inner: &Inner, g: &mut SlotGuard<'_>) {
    release_slot(inner, g, Free::Sync)
}

/// [`free_slot`], choosing how the allocator object is freed. The slot's metadata and the
/// counters are always updated here, under the slot lock; with [`Free::Deferred`] only the
/// object's memory comes back later.
pub(crate) fn release_slot(inner: &Inner, g: &mut SlotGuard<'_>, how: Free) {
    let st = g.state();
    if st.is_empty() {
        return;
    }
    let s = &inner.stats;
    if st.has(SlotFlags::SAME) {
        DeviceStats::sub(&s.same_pages, 1);
    } else if let Some(location) = st.wb_location() {
        let wb = inner
            .wb
            .as_ref()
            .expect("a WB slot implies a backing device");
        match wb.zoned.as_ref() {
            Some(store) => {
                // Exactly once: the slot is emptied below under the same lock.
                store.release(ZoneLoc::from_raw(location));
                wb.zoned_pages
                    .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            }
            None => wb.bitmap.release(BlockIndex(location)),
        }
    } else {
        release_object(inner, st, how);
    }
    DeviceStats::sub(&s.pages_stored, 1);
    g.set_empty();
}

/// Frees the slot's pool object and takes it out of `compr_data_size` and `huge_pages`
/// (`pages_stored` is the caller's). The caller holds the slot lock and then either empties
/// the slot or points it elsewhere (writeback).
pub(crate) fn release_object(inner: &Inner, st: crate::slot::SlotState, how: Free) {
    let s = &inner.stats;
    let handle = Handle::from_raw(st.value).expect("non-empty slot has a handle");
    match how {
        Free::Sync => inner.pool.free(handle),
        Free::Deferred => inner.pool.free_deferred(handle),
    }
    DeviceStats::sub(&s.compr_data_size_bytes, st.size_bytes() as u64);
    if st.has(SlotFlags::HUGE) {
        DeviceStats::sub(&s.huge_pages, 1);
    }
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
