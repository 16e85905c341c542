//! The zoned target's placement (`backing_layout=zoned`): every page becomes a record appended
//! by a [`ZoneWriter`] and written in large sequential stages.
//!
//! A candidate is copied as its stored object (a compressed object: record flag
//! [`FLAG_COMPRESSED`], codec priority from the slot; a HUGE page: flags 0) and appended to the
//! writer's open stage (pending in the zone store); `ENOSPC` when no zone is left for
//! writeback (the writer may not take GC's last empty zone). Every stage the writer closes (at
//! least 128 KiB unless it is the last of the pass) is ready to go out at once; at the end of
//! the candidates the open stage is closed and written too. A completed record is committed
//! under its slot lock by the store ([`crate::store::Store::finish_writeback`]), so a release
//! that follows always finds it live; a record whose write failed or whose slot changed is
//! aborted. A failed stage also stops appends to its zone: on a zoned device the write
//! pointer is no longer where the next stage would go.
//!
//! After the pass, if the zone store is short of empty zones, GC runs in the same task with a
//! queue of its own (see [`crate::writeback`]'s `run`).

use super::engine::{PlacedWrite, Placement};
use crate::backing::IoOp;
use crate::error::{Error, ErrorKind, Result};
use crate::slot::SlotIndex;
use crate::store::{Copied, ZonedTarget};
use crate::zoned::{ZoneLoc, ZoneWriter, DEFAULT_STAGE_BYTES, FLAG_COMPRESSED};

/// The deepest queue of stage writes: 16 stages of 256 KiB (4 MiB) in flight is far past what
/// a sequential writer needs to keep a device busy, and bounds the buffers a writeback holds.
pub(crate) const MAX_ZONED_DEPTH: usize = 16;

/// The zone writer of one pass and the buffer candidates are copied into.
pub(super) struct Stages<'a> {
    target: &'a ZonedTarget,
    writer: ZoneWriter,
    depth: usize,
    /// One page: the copied object.
    payload: Vec<u8>,
}

impl<'a> Stages<'a> {
    /// A writer over `target` with up to `batch` stage writes in flight (at most
    /// [`MAX_ZONED_DEPTH`]), for pages of `page_size_bytes`.
    pub(super) fn new(
        target: &'a ZonedTarget,
        batch: usize,
        page_size_bytes: usize,
    ) -> Result<Stages<'a>> {
        Ok(Stages {
            target,
            writer: target.store().writer(DEFAULT_STAGE_BYTES)?,
            depth: batch.clamp(1, MAX_ZONED_DEPTH),
            payload: vec![0u8; page_size_bytes],
        })
    }
}

impl Placement for Stages<'_> {
    fn depth(&self) -> usize {
        self.depth
    }

    fn has_room(&self) -> bool {
        // Stages go out as they close; the queue's depth bounds them.
        true
    }

    fn reserve(&mut self) -> Result<()> {
        // The record's room is reserved when it is appended.
        Ok(())
    }

    fn as_stored(&self) -> bool {
        true
    }

    fn buffer(&mut self) -> &mut [u8] {
        &mut self.payload
    }

    fn place(&mut self, slot: SlotIndex, copied: &Copied) -> Result<u64> {
        let flags = if copied.huge { 0 } else { FLAG_COMPRESSED };
        let payload = &self.payload[..copied.len_bytes];
        match self.writer.append(slot.0, copied.codec, flags, payload) {
            Ok(loc) => Ok(loc.to_raw()),
            Err(err) if err.kind() == ErrorKind::NoSpace => Err(err),
            Err(err) => Err(Error::io(format!("zoned writeback: {err}"))),
        }
    }

    fn place_group(
        &mut self,
        first: SlotIndex,
        obj: &[u8],
        codec: u8,
        _blocks: u64,
    ) -> Result<u64> {
        // A multi-page object's record names the first slot of its group (read-back and GC
        // look for it there).
        match self.writer.append(first.0, codec, FLAG_COMPRESSED, obj) {
            Ok(loc) => Ok(loc.to_raw()),
            Err(err) if err.kind() == ErrorKind::NoSpace => Err(err),
            Err(err) => Err(Error::io(format!("zoned writeback: {err}"))),
        }
    }

    fn ready(&mut self, _all: bool) -> Vec<PlacedWrite> {
        std::iter::from_fn(|| self.writer.take_ready())
            .map(|sw| PlacedWrite {
                op: sw.op,
                locations: sw.records.iter().map(|(_, loc)| loc.to_raw()).collect(),
            })
            .collect()
    }

    fn finish(&mut self) {
        self.writer.finish();
    }

    fn written(&mut self, op: &IoOp) {
        self.writer.written(op.len_bytes());
    }

    fn recycle(&mut self, op: IoOp) {
        self.writer.recycle(op);
    }

    fn write_failed(&mut self, locations: &[u64]) {
        if let Some(&first) = locations.first() {
            self.target
                .store()
                .write_failed(ZoneLoc::from_raw(first).zone);
        }
    }

    fn release_reserved(&mut self) {}
}
