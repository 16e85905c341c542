//! Writeback into the zoned store (`backing_layout=zoned`): the same candidates, PP_SLOT
//! ticket and limit as the bitmap engine ([`super::batch`]), but every page becomes a record
//! appended by a [`ZoneWriter`] and written in large sequential stages.
//!
//! For each candidate (largest object first), in the writeback task:
//! 1. check the limit has a page's worth (exhausted: stop with `EIO`);
//! 2. under the slot lock, if PP_SLOT is still set, copy the zsmalloc object as stored (a
//!    compressed object: record flag [`FLAG_COMPRESSED`], codec priority from the slot; a HUGE
//!    page: flags 0) and note its handle; unlock;
//! 3. **charge** the limit, then [`ZoneWriter::append`] the record (pending in the store).
//!    `ENOSPC` (no zone left for writeback): refund, clear PP_SLOT, stop with `ENOSPC`; the page
//!    stays in RAM;
//! 4. queue every stage the writer closed ([`StagedWrite`], at least 128 KiB unless it is the
//!    last of the pass) on the backing's queue, waiting for a completion while the queue is full.
//!
//! At the end of the candidates the writer's open stage is closed and written too, and
//! everything in flight is drained. A completed stage finishes each of its records under the
//! record's slot lock:
//! - write failed: [`ZoneStore::abort`], refund the charge, clear PP_SLOT (the page stays in
//!   RAM);
//! - the slot still has PP_SLOT and the same handle: free the object, point the slot at the
//!   record (WB, value `ZoneLoc::to_raw`, size, HUGE/INCOMPRESSIBLE and priority kept) and
//!   [`ZoneStore::commit`] it — under the same lock, so a release that follows always finds it
//!   live;
//! - otherwise (read, overwritten, discarded meanwhile): [`ZoneStore::abort`]; the charge stays.
//!
//! As in the bitmap engine, nothing runs in a completion context and no slot lock is held while
//! waiting for I/O. If the queue itself cannot be waited on, the records in flight stay pending
//! (their zone is then never chosen by GC: the kernel may still be writing into it) and their
//! slots keep their pages in RAM.
//!
//! After the pass, if the store is short of empty zones ([`ZoneStore::needs_gc`]), GC runs in
//! the same task with a queue of its own (see [`Device::run_gc`]).

use std::collections::HashMap;

use super::candidates::{clear_pp, PpCtl};
use super::limit::{Charge, WbLimit};
use super::{WbStore, WritebackProgress, WritebackReport};
use crate::backing::{IoCompletion, IoQueue};
use crate::device::Inner;
use crate::error::{Error, ErrorKind, Result};
use crate::slot::{SlotFlags, SlotIndex};
use crate::zoned::{
    StagedWrite, ZoneLoc, ZoneStore, ZoneWriter, DEFAULT_STAGE_BYTES, FLAG_COMPRESSED,
};

/// The deepest queue of stage writes: 16 stages of 256 KiB (4 MiB) in flight is far past what
/// a sequential writer needs to keep a device busy, and bounds the buffers a writeback holds.
pub(crate) const MAX_ZONED_DEPTH: usize = 16;

/// What a pending record stands for.
#[derive(Debug, Clone, Copy)]
struct RecMeta {
    slot: SlotIndex,
    /// The zsmalloc handle that was copied: the slot must still hold it.
    handle: u64,
    charge: Charge,
}

struct ZonedEngine<'a> {
    inner: &'a Inner,
    wb: &'a WbStore,
    store: &'a ZoneStore,
    limit: &'a WbLimit,
    units: u64,
    queue: Box<dyn IoQueue + 'a>,
    writer: ZoneWriter,
    /// Pending records by `ZoneLoc::to_raw`.
    pending: HashMap<u64, RecMeta>,
    /// Records of each stage in flight, by op tag.
    in_flight: HashMap<u64, Vec<(u64, ZoneLoc)>>,
    in_flight_recs: usize,
    next_tag: u64,
    report: WritebackReport,
    stop: Option<Error>,
    write_error: Option<Error>,
    /// The kernel queue failed: stop waiting on it.
    queue_broken: bool,
}

/// Writes back the candidates of `ctl` into `wb`'s zoned store with up to `depth` stage writes
/// in flight. Returns the report; its `error` says why the writeback failed, if it did.
pub(crate) fn run(
    inner: &Inner,
    wb: &WbStore,
    limit: &WbLimit,
    ctl: &mut PpCtl,
    depth: usize,
    progress: &mut dyn FnMut(&WritebackProgress),
) -> Result<WritebackReport> {
    let store = wb
        .zoned
        .as_ref()
        .expect("the zoned layout has a zoned store");
    let depth = depth.clamp(1, MAX_ZONED_DEPTH);
    let mut e = ZonedEngine {
        inner,
        wb,
        store,
        limit,
        units: super::limit::units_per_page(wb.page_size_bytes),
        queue: wb.backing.new_queue(depth)?,
        writer: store.writer(DEFAULT_STAGE_BYTES)?,
        pending: HashMap::new(),
        in_flight: HashMap::new(),
        in_flight_recs: 0,
        next_tag: 0,
        report: WritebackReport {
            candidates: ctl.total(),
            batch_size: depth,
            ..Default::default()
        },
        stop: None,
        write_error: None,
        queue_broken: false,
    };
    let mut payload = vec![0u8; wb.page_size_bytes];
    while e.stop.is_none() && !e.queue_broken {
        let Some(index) = ctl.select() else {
            break;
        };
        e.take(index, &mut payload);
        e.submit_ready(progress);
    }
    e.writer.finish();
    e.submit_ready(progress);
    while e.in_flight_recs > 0 && !e.queue_broken {
        e.reap(progress);
    }
    progress(&e.progress());
    let mut report = e.report;
    report.error = e.stop.or(e.write_error);
    Ok(report)
}

impl ZonedEngine<'_> {
    fn progress(&self) -> WritebackProgress {
        self.report.progress(self.in_flight_recs)
    }

    /// Appends the record of candidate `index` (see the module docs, steps 1-3).
    fn take(&mut self, index: SlotIndex, payload: &mut [u8]) {
        let inner = self.inner;
        if !self.limit.has_budget(self.units) {
            clear_pp(inner, index);
            self.stop = Some(Error::io("writeback_limit exhausted"));
            return;
        }
        // Copy the object under the slot lock, if the slot is still a candidate.
        let (handle, len, prio, flags) = {
            let mut g = inner.slots.lock(index);
            let st = g.state();
            if !st.has(SlotFlags::PP_SLOT) {
                self.report.skipped += 1;
                return;
            }
            let Some(handle) = st.handle_raw() else {
                g.clear_flags(SlotFlags::PP_SLOT);
                self.report.skipped += 1;
                return;
            };
            let h = crate::zsmalloc::Handle::from_raw(handle).expect("a PP_SLOT slot's handle");
            let len = inner.pool.read(h, |obj| {
                payload[..obj.len()].copy_from_slice(obj);
                obj.len()
            });
            let flags = if st.has(SlotFlags::HUGE) {
                0
            } else {
                FLAG_COMPRESSED
            };
            (handle, len, st.prio(), flags)
        };
        let Some(charge) = self.limit.charge(self.units) else {
            clear_pp(inner, index);
            self.stop = Some(Error::io("writeback_limit exhausted"));
            return;
        };
        match self.writer.append(index.0, prio, flags, &payload[..len]) {
            Ok(loc) => {
                self.pending.insert(
                    loc.to_raw(),
                    RecMeta {
                        slot: index,
                        handle,
                        charge,
                    },
                );
            }
            Err(err) => {
                self.limit.refund(charge);
                clear_pp(inner, index);
                self.report.failed += 1;
                self.stop = Some(if err.kind() == ErrorKind::NoSpace {
                    err
                } else {
                    Error::io(format!("zoned writeback: {err}"))
                });
            }
        }
    }

    /// Queues every stage the writer closed, reaping while the queue is full.
    fn submit_ready(&mut self, progress: &mut dyn FnMut(&WritebackProgress)) {
        while let Some(sw) = self.writer.take_ready() {
            while self.queue.in_flight() >= self.queue.depth() && !self.queue_broken {
                self.reap(progress);
            }
            if self.queue_broken {
                self.fail_stage(sw.records);
                continue;
            }
            self.submit(sw);
        }
    }

    fn submit(&mut self, sw: StagedWrite) {
        let StagedWrite { mut op, records } = sw;
        op.tag = self.next_tag;
        self.next_tag += 1;
        let n = records.len();
        match self.queue.submit(op) {
            Ok(()) => {
                self.in_flight.insert(self.next_tag - 1, records);
                self.in_flight_recs += n;
                self.report.ops += 1;
            }
            Err((err, op)) => {
                self.writer.recycle(op);
                self.fail_stage(records);
                self.note_write_error(err);
            }
        }
    }

    /// Undoes records whose write did not happen: aborted, charge refunded, PP_SLOT cleared.
    /// The zone takes no more appends: on a zoned device its write pointer is not where the
    /// next stage would go.
    fn fail_stage(&mut self, records: Vec<(u64, ZoneLoc)>) {
        if let Some((_, loc)) = records.first() {
            self.store.write_failed(loc.zone);
        }
        for (_, loc) in records {
            let m = self
                .pending
                .remove(&loc.to_raw())
                .expect("every staged record is pending");
            self.store.abort(loc);
            self.limit.refund(m.charge);
            clear_pp(self.inner, m.slot);
            self.report.failed += 1;
        }
    }

    fn note_write_error(&mut self, err: Error) {
        super::note_write_error(&mut self.stop, &mut self.write_error, err);
    }

    /// Waits for at least one completion and finishes it.
    fn reap(&mut self, progress: &mut dyn FnMut(&WritebackProgress)) {
        match self.queue.wait(1) {
            Ok(done) => {
                for c in done {
                    self.complete(c);
                }
            }
            Err(err) => {
                // See the module docs: the records in flight stay pending, their pages in RAM.
                for (_, records) in self.in_flight.drain() {
                    for (_, loc) in records {
                        if let Some(m) = self.pending.remove(&loc.to_raw()) {
                            clear_pp(self.inner, m.slot);
                            self.report.failed += 1;
                        }
                    }
                }
                self.in_flight_recs = 0;
                self.queue_broken = true;
                self.stop = Some(err);
            }
        }
        progress(&self.progress());
    }

    /// Finishes the records of one completed stage (module docs).
    fn complete(&mut self, c: IoCompletion) {
        let records = self
            .in_flight
            .remove(&c.op.tag)
            .expect("every completion belongs to a stage in flight");
        self.in_flight_recs -= records.len();
        self.writer.recycle(c.op);
        if let Err(err) = c.result {
            self.fail_stage(records);
            self.note_write_error(err);
            return;
        }
        let inner = self.inner;
        for (_, loc) in records {
            let m = self
                .pending
                .remove(&loc.to_raw())
                .expect("every staged record is pending");
            super::add(&self.wb.bd_writes, 1);
            let mut g = inner.slots.lock(m.slot);
            let st = g.state();
            if !st.has(SlotFlags::PP_SLOT) || st.handle_raw() != Some(m.handle) {
                g.clear_flags(SlotFlags::PP_SLOT);
                drop(g);
                self.store.abort(loc);
                self.report.changed += 1;
                continue;
            }
            super::set_written_back(inner, &mut g, st, loc.to_raw());
            self.store.commit(loc);
            super::add(&self.wb.zoned_pages, 1);
            drop(g);
            self.report.written += 1;
        }
    }
}
