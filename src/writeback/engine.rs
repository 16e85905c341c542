//! The batched writeback engine (zram's `zram_writeback_slots` with its `zram_wb_ctl`): one
//! core for both writeback targets, with a [`Placement`] saying where pages go.
//!
//! One [`run`] per writeback call owns a queue of the target's backing and the books of the
//! pages between their copy and their completion: each placed page is *pending* under its
//! backing location (its slot, the object handle it copied, its limit charge), and each op in
//! flight is filed under its tag with the locations it carries. The op owns its buffers until
//! the queue hands them back with the completion.
//!
//! For each candidate (largest object first), in the writeback task:
//! 1. check the limit has a page's worth (exhausted: stop with `EIO`);
//! 2. let the placement reserve what the page needs (a block; `ENOSPC`: stop, the page stays in
//!    RAM);
//! 3. copy the candidate under its slot lock if it still has PP_SLOT ([`Store::copy_candidate`]:
//!    the object as stored, or the page decompressed, as the placement asks); a slot that
//!    changed is skipped and the reservation kept for the next candidate;
//! 4. **charge** the limit, then place the page (the placement returns its location; `ENOSPC`
//!    from the zone writer: refund, clear PP_SLOT, stop);
//! 5. submit the writes the placement has ready, waiting for completions while the queue is
//!    full.
//!
//! When no more candidates can be taken for now, the placement's remaining writes go out and the
//! engine reaps at least one completion, finishing the pages it carries **in this task**
//! (nothing runs in a completion context, so nothing a completion touches can have been freed:
//! an end-io handler touching a request the writeback task already freed, a use-after-free
//! upstream zram's batched writeback had, has no counterpart here):
//! - write failed: the location is given back ([`WbTarget::abort`]), the charge refunded,
//!   PP_SLOT cleared (the page stays in RAM); the error is sorted ([`note_write_error`]);
//! - the slot lost PP_SLOT or its object while in flight (read, overwritten, discarded): the
//!   location is given back, the charge stays (the I/O was done);
//! - otherwise [`Store::finish_writeback`] frees the object and points the slot at the location
//!   (WB), committing it under the slot lock.
//!
//! When the candidates run out (or the backing is full, or the limit exhausted) the engine
//! drains what is in flight and the placement gives back a reservation no page used (upstream
//! zram's batched writeback leaked that block until it was fixed). If the queue itself cannot be waited on, the pages in flight stay
//! reserved (their buffers with the queue, which leaks rather than frees them; a zone with
//! pending records is never chosen by GC, the kernel may still be writing into it) and their
//! slots keep their pages in RAM. No slot lock is held while waiting for I/O.
//!
//! With the synchronous engine ([`crate::backing::Engine::Sync`]) and a batch of 1, every
//! write completes at submit: the one-page-at-a-time path, kept for comparison.

use std::collections::HashMap;

use super::limit::{units_per_page, Charge, WbLimit};
use super::{WritebackProgress, WritebackReport};
use crate::backing::{IoCompletion, IoOp, IoQueue};
use crate::error::{Error, ErrorKind, Result};
use crate::pp::PpCtl;
use crate::slot::SlotIndex;
use crate::store::{Copied, Store, WbTarget};

/// Where a writeback puts pages: the bitmap target's extents of blocks, or the zoned target's
/// stages of records. The engine calls it from the writeback task only.
pub(super) trait Placement {
    /// The depth of the queue the engine opens (the report's `batch_size`).
    fn depth(&self) -> usize;
    /// Whether another candidate can be taken before reaping a completion.
    fn has_room(&self) -> bool;
    /// Reserves what the next page needs before it is copied (kept until a page is placed,
    /// or given back by [`release_reserved`](Self::release_reserved)). An error stops taking
    /// candidates with it.
    fn reserve(&mut self) -> Result<()>;
    /// Whether candidates are copied as stored objects (else as decompressed pages).
    fn as_stored(&self) -> bool;
    /// The buffer the next candidate is copied into: at least a page.
    fn buffer(&mut self) -> &mut [u8];
    /// Places the candidate of `slot` copied into [`buffer`](Self::buffer), using the
    /// reservation, and returns its backing location (what the slot will hold). An error
    /// stops taking candidates with it; nothing was placed.
    fn place(&mut self, slot: SlotIndex, copied: &Copied) -> Result<u64>;
    /// Places a multi-page object `obj` (compressed, `blocks` page-sized blocks' worth) of
    /// the group starting at slot `first`, with its own room (not the page reservation),
    /// and returns its location (what the group's slots will hold). An error (`ENOSPC`: no
    /// room that large) stops taking candidates; nothing was placed.
    fn place_group(&mut self, first: SlotIndex, obj: &[u8], codec: u8, blocks: u64) -> Result<u64>;
    /// The writes ready to submit. `all`: the engine takes no more candidates before it reaps,
    /// so everything placed goes out now.
    fn ready(&mut self, all: bool) -> Vec<PlacedWrite>;
    /// No more candidates for this pass: close what is open.
    fn finish(&mut self);
    /// An op's write completed (before its pages are finished): count what reached the device.
    fn written(&mut self, op: &IoOp);
    /// The buffers of an op that completed or was refused, for reuse.
    fn recycle(&mut self, op: IoOp);
    /// The write of `locations` failed (they are given back next): stop writing where it
    /// failed.
    fn write_failed(&mut self, locations: &[u64]);
    /// The pass is over: give back a reservation no page used.
    fn release_reserved(&mut self);
}

/// A write a placement made ready: the op (its tag is the engine's) and the backing locations
/// of the pages it carries.
#[derive(Debug)]
pub(super) struct PlacedWrite {
    pub(super) op: IoOp,
    pub(super) locations: Vec<u64>,
}

/// What a pending page (or multi-page object) stands for.
#[derive(Debug, Clone, Copy)]
struct Pending {
    /// The page's slot, or the first slot of the object's group.
    slot: SlotIndex,
    /// The zsmalloc handle that was copied: the slot (the group's slots) must still hold it.
    handle: u64,
    charge: Charge,
    /// Page-sized blocks the location spans: 1 for a page; a multi-page object's when `group`.
    blocks: u64,
    group: bool,
}

/// The state of one writeback call. Owned by the writeback task alone (no lock). Invariant:
/// every placed page is pending under its location until its write completes or fails, and
/// each location of an op in flight is pending; `in_flight_pages` counts those.
struct Engine<'a, P> {
    store: &'a Store,
    target: &'a WbTarget,
    limit: &'a WbLimit,
    /// Limit units one page costs.
    units: u64,
    /// A multi-page object copied out (empty without `multi_page_size`).
    group_buf: Vec<u8>,
    queue: Box<dyn IoQueue + 'a>,
    placement: P,
    pending: HashMap<u64, Pending>,
    /// Locations of each op in flight, by tag.
    in_flight: HashMap<u64, Vec<u64>>,
    in_flight_pages: usize,
    next_tag: u64,
    report: WritebackReport,
    /// Why the loop stopped taking candidates early (ENOSPC, exhausted limit, a broken queue).
    stop: Option<Error>,
    /// The most recent write error (the loop goes on after one).
    write_error: Option<Error>,
    /// The queue cannot be waited on: stop using it.
    broken: bool,
    /// A write failed with `ENOSPC`: submit nothing more.
    device_full: bool,
}

/// Writes back the candidates of `ctl` into `target` (the store's) through `placement`.
/// Returns the report; its `error` says why the writeback failed, if it did.
pub(super) fn run<P: Placement>(
    store: &Store,
    target: &WbTarget,
    limit: &WbLimit,
    ctl: &mut PpCtl,
    placement: P,
    progress: &mut dyn FnMut(&WritebackProgress),
) -> Result<WritebackReport> {
    let depth = placement.depth();
    let mut e = Engine {
        store,
        target,
        limit,
        units: units_per_page(store.page_size_bytes()),
        group_buf: if store.multi_pages() > 1 {
            vec![0; store.multi_pages() * store.page_size_bytes()]
        } else {
            Vec::new()
        },
        queue: target.backing().new_queue(depth)?,
        placement,
        pending: HashMap::with_capacity(depth),
        in_flight: HashMap::with_capacity(depth),
        in_flight_pages: 0,
        next_tag: 0,
        report: WritebackReport {
            candidates: ctl.total(),
            batch_size: depth,
            ..Default::default()
        },
        stop: None,
        write_error: None,
        broken: false,
        device_full: false,
    };
    let mut exhausted = false;
    loop {
        while e.stop.is_none() && e.placement.has_room() {
            let Some(index) = ctl.select() else {
                exhausted = true;
                break;
            };
            e.take(index);
            e.submit_ready(false, progress);
        }
        let done_taking = exhausted || e.stop.is_some();
        if done_taking {
            e.placement.finish();
        }
        e.submit_ready(true, progress);
        if e.in_flight_pages == 0 {
            if done_taking {
                break;
            }
            continue;
        }
        e.reap(progress);
    }
    e.placement.release_reserved();
    progress(&e.progress());
    let mut report = e.report;
    report.error = e.stop.or(e.write_error);
    Ok(report)
}

impl<P: Placement> Engine<'_, P> {
    fn progress(&self) -> WritebackProgress {
        self.report.progress(self.in_flight_pages)
    }

    /// Takes candidate `index` (see the module docs, steps 1-4).
    fn take(&mut self, index: SlotIndex) {
        if self.store.multi_pages() > 1 && self.store.is_multi(index) {
            return self.take_group(index);
        }
        if !self.limit.has_budget(self.units) {
            self.store.clear_pp(index);
            self.stop = Some(Error::io("writeback_limit exhausted"));
            return;
        }
        if let Err(err) = self.placement.reserve() {
            self.store.clear_pp(index);
            self.stop = Some(err);
            return;
        }
        let as_stored = self.placement.as_stored();
        let Some(copied) = self
            .store
            .copy_candidate(index, self.placement.buffer(), as_stored)
        else {
            // The slot changed since the scan: skipped; the reservation waits for the next.
            self.report.skipped += 1;
            return;
        };
        let Some(charge) = self.limit.charge(self.units) else {
            // The limit was lowered since the check above.
            self.store.clear_pp(index);
            self.stop = Some(Error::io("writeback_limit exhausted"));
            return;
        };
        match self.placement.place(index, &copied) {
            Ok(location) => {
                self.pending.insert(
                    location,
                    Pending {
                        slot: index,
                        handle: copied.handle,
                        charge,
                        blocks: 1,
                        group: false,
                    },
                );
            }
            Err(err) => {
                self.limit.refund(charge);
                self.store.clear_pp(index);
                self.report.failed += 1;
                self.stop = Some(err);
            }
        }
    }

    /// Takes the multi-page object of the group holding candidate `index`: the same steps as
    /// a page, with the object copied as stored (only when every page pointing into it is
    /// a candidate: `Store::copy_group`), charged for the blocks it takes, and placed in room
    /// of its own.
    fn take_group(&mut self, index: SlotIndex) {
        let first = self.store.group_first(index);
        if !self.limit.has_budget(self.units) {
            self.store.clear_group_pp(first);
            self.stop = Some(Error::io("writeback_limit exhausted"));
            return;
        }
        let Some(copied) = self.store.copy_group(index, &mut self.group_buf) else {
            self.report.skipped += 1;
            return;
        };
        let page = self.store.page_size_bytes();
        let blocks = WbTarget::group_blocks(copied.len_bytes, page);
        let Some(charge) = self.limit.charge(blocks * self.units) else {
            self.store.clear_group_pp(first);
            self.stop = Some(Error::io("writeback_limit exhausted"));
            return;
        };
        let obj = &self.group_buf[..copied.len_bytes];
        match self.placement.place_group(first, obj, copied.codec, blocks) {
            Ok(location) => {
                self.pending.insert(
                    location,
                    Pending {
                        slot: first,
                        handle: copied.handle,
                        charge,
                        blocks,
                        group: true,
                    },
                );
            }
            Err(err) => {
                self.limit.refund(charge);
                self.store.clear_group_pp(first);
                self.report.failed += 1;
                self.stop = Some(err);
            }
        }
    }

    /// Clears the PP_SLOT marks of a pending page, or of a pending object's group.
    fn clear_pending_pp(&self, p: &Pending) {
        if p.group {
            self.store.clear_group_pp(p.slot);
        } else {
            self.store.clear_pp(p.slot);
        }
    }

    /// Submits the placement's ready writes, reaping while the queue is full.
    fn submit_ready(&mut self, all: bool, progress: &mut dyn FnMut(&WritebackProgress)) {
        for w in self.placement.ready(all) {
            while self.queue.in_flight() >= self.queue.depth() && !self.broken {
                self.reap(progress);
            }
            if self.broken || self.device_full {
                // After the device's first ENOSPC nothing more is written: the pages stay in
                // RAM, their charges refunded (a full bitmap or zone store stops taking pages
                // too, but what was placed in it before has its room and is written).
                self.placement.recycle(w.op);
                self.fail(&w.locations);
                continue;
            }
            self.submit(w);
        }
    }

    fn submit(&mut self, w: PlacedWrite) {
        let PlacedWrite { mut op, locations } = w;
        let tag = self.next_tag;
        self.next_tag += 1;
        op.tag = tag;
        let n = locations.len();
        match self.queue.submit(op) {
            Ok(()) => {
                self.in_flight.insert(tag, locations);
                self.in_flight_pages += n;
                self.report.ops += 1;
            }
            Err((err, op)) => {
                self.placement.recycle(op);
                self.fail(&locations);
                self.note_write_error(err);
            }
        }
    }

    /// Undoes pages whose write did not happen: each location given back, charge refunded,
    /// PP_SLOT cleared. The pages stay in RAM.
    fn fail(&mut self, locations: &[u64]) {
        self.placement.write_failed(locations);
        for location in locations {
            let p = self
                .pending
                .remove(location)
                .expect("every placed location is pending");
            self.target.abort(*location, p.blocks);
            self.limit.refund(p.charge);
            self.clear_pending_pp(&p);
            self.report.failed += 1;
        }
    }

    fn note_write_error(&mut self, err: Error) {
        self.device_full |= err.kind() == ErrorKind::NoSpace;
        note_write_error(&mut self.stop, &mut self.write_error, err);
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
                // See the module docs: the pages in flight stay reserved, in RAM.
                let lost: Vec<u64> = self.in_flight.drain().flat_map(|(_, l)| l).collect();
                for location in lost {
                    if let Some(p) = self.pending.remove(&location) {
                        self.clear_pending_pp(&p);
                        self.report.failed += 1;
                    }
                }
                self.in_flight_pages = 0;
                self.broken = true;
                self.stop = Some(err);
            }
        }
        progress(&self.progress());
    }

    /// Finishes the pages of one completed op (in this task: see the module docs).
    fn complete(&mut self, c: IoCompletion) {
        let locations = self
            .in_flight
            .remove(&c.op.tag)
            .expect("every completion belongs to an op in flight");
        self.in_flight_pages -= locations.len();
        if let Err(err) = c.result {
            self.placement.recycle(c.op);
            self.fail(&locations);
            self.note_write_error(err);
            return;
        }
        self.placement.written(&c.op);
        self.placement.recycle(c.op);
        for location in locations {
            let p = self
                .pending
                .remove(&location)
                .expect("every location in flight is pending");
            let moved = if p.group {
                self.store
                    .finish_group_writeback(p.slot, p.handle, location)
            } else {
                self.store
                    .finish_writeback(p.slot, p.handle, location)
                    .then_some(1)
            };
            match moved {
                Some(pages) => self.report.written += pages,
                None => {
                    // Changed while in flight: its new contents stay; the location goes back.
                    self.target.abort(location, p.blocks);
                    self.report.changed += 1;
                }
            }
        }
    }
}

/// Sorts a failed write's error: `ENOSPC` (the backing device says it is full) stops taking
/// candidates; anything else is kept as the pass's error while the pass goes on.
fn note_write_error(stop: &mut Option<Error>, write_error: &mut Option<Error>, err: Error) {
    if err.kind() == ErrorKind::NoSpace {
        stop.get_or_insert(err);
    } else {
        *write_error = Some(err);
    }
}
