//! The batched writeback engine (zram's `zram_writeback_slots` with its `zram_wb_ctl`).
//!
//! One [`run`] per writeback call owns a pool of `writeback_batch_size` requests. A request is
//! a page-sized [`AlignedBuf`] plus, while in flight, the slot, the backing block and the limit
//! charge it stands for. Requests move between two lists:
//!
//! - **idle** (`Engine::idle`): buffers free for the next candidate;
//! - **in flight** (`Engine::in_flight`): keyed by the tag of the [`IoOp`] that carries their
//!   buffers. The op owns the buffers until the queue hands them back with the completion.
//!
//! The loop: take candidates while requests are idle (for each: check the limit, reserve the
//! first free block, lock the slot, check PP_SLOT, copy the object or the decompressed page into
//! the buffer, unlock, charge the limit); submit what was prepared, sorted by block, with runs
//! of adjacent blocks (up to half the pool, see [`max_run_pages`]) as one vectored write; then reap at least one completion and finish the
//! requests it carries, **in this task** (nothing runs in a completion context, so nothing a
//! completion touches can have been freed: the upstream use-after-free cannot happen here).
//!
//! Finishing a request, under its slot lock:
//! - write failed: release the block, refund the charge, clear PP_SLOT (the page stays in RAM);
//! - slot lost PP_SLOT while in flight (read, overwritten, discarded): release the block, keep
//!   the charge (the I/O was done);
//! - otherwise: free the zsmalloc object and point the slot at the block (WB).
//!
//! When the loop ends (candidates exhausted, backing full, limit exhausted) it drains what is in
//! flight and releases the block it reserved for a next request that never came (the second
//! upstream fix). No slot lock is held while waiting for I/O.
//!
//! With the synchronous engine ([`crate::backing::Engine::Sync`]) and a batch of 1, every
//! write completes at submit: this is the old one-page-at-a-time path, kept for comparison.

use std::collections::HashMap;

use super::candidates::{clear_pp, PpCtl};
use super::limit::{Charge, WbLimit};
use super::{WbStore, WritebackProgress, WritebackReport};
use crate::backing::{AlignedBuf, IoCompletion, IoOp, IoQueue, MAX_OP_BUFS};
use crate::device::Inner;
use crate::error::{Error, ErrorKind, Result};
use crate::slot::{SlotFlags, SlotIndex};
use crate::writeback::BlockIndex;
use crate::zsmalloc::Handle;

/// What an in-flight request stands for.
#[derive(Debug, Clone, Copy)]
struct ReqMeta {
    slot: SlotIndex,
    block: BlockIndex,
    charge: Charge,
}

/// A prepared request: its data is in `buf`, not yet submitted.
#[derive(Debug)]
struct Prepared {
    meta: ReqMeta,
    buf: AlignedBuf,
}

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

/// The state of one writeback call. Owned by the writeback task alone (no lock): the idle and
/// in-flight lists, the queue, the reserved block. Invariant: every request is in exactly one
/// place: `idle` (its buffer), or in flight (its buffer in an op held by `queue`, its
/// [`ReqMeta`] in `in_flight` under the op's tag); `in_flight_reqs` counts the latter.
struct Engine<'a> {
    inner: &'a Inner,
    wb: &'a WbStore,
    limit: &'a WbLimit,
    /// Limit units one page costs.
    units: u64,
    queue: Box<dyn IoQueue + 'a>,
    /// Idle requests' buffers.
    idle: Vec<AlignedBuf>,
    /// In-flight requests by op tag, in block order within an op.
    in_flight: HashMap<u64, Vec<ReqMeta>>,
    in_flight_reqs: usize,
    next_tag: u64,
    /// A block reserved for a request whose slot turned out to have changed; used by the next
    /// candidate, released when the loop ends.
    reserved: Option<BlockIndex>,
    max_run: usize,
    report: WritebackReport,
    /// Why the loop stopped taking candidates early (ENOSPC, exhausted limit).
    stop: Option<Error>,
    /// The most recent write error (the loop goes on after one).
    write_error: Option<Error>,
}

/// Writes back the candidates of `ctl` with a pool of `batch` requests. Returns the report; its
/// `error` says why the writeback failed, if it did.
pub(crate) fn run(
    inner: &Inner,
    wb: &WbStore,
    limit: &WbLimit,
    ctl: &mut PpCtl,
    batch: usize,
    progress: &mut dyn FnMut(&WritebackProgress),
) -> Result<WritebackReport> {
    let page = wb.page_size_bytes;
    let queue = wb.backing.new_queue(batch)?;
    let mut idle = Vec::with_capacity(batch);
    for _ in 0..batch {
        idle.push(AlignedBuf::new_zeroed(page)?);
    }
    let mut e = Engine {
        inner,
        wb,
        limit,
        units: super::limit::units_per_page(page),
        queue,
        idle,
        in_flight: HashMap::with_capacity(batch),
        in_flight_reqs: 0,
        next_tag: 0,
        reserved: None,
        max_run: max_run_pages(batch),
        report: WritebackReport {
            candidates: ctl.total(),
            batch_size: batch,
            ..Default::default()
        },
        stop: None,
        write_error: None,
    };
    let mut exhausted = false;
    loop {
        let prepared = e.fill(ctl, &mut exhausted);
        e.submit(prepared);
        if e.in_flight_reqs == 0 {
            if exhausted || e.stop.is_some() {
                break;
            }
            continue;
        }
        match e.queue.wait(1) {
            Ok(done) => {
                for c in done {
                    e.complete(c);
                }
            }
            Err(err) => {
                // The kernel cannot be waited on: the in-flight buffers stay with the queue
                // (which leaks rather than frees them) and their blocks stay allocated; their
                // slots keep their data in RAM.
                for metas in e.in_flight.drain() {
                    for m in metas.1 {
                        clear_pp(inner, m.slot);
                    }
                }
                e.in_flight_reqs = 0;
                e.stop = Some(err);
                break;
            }
        }
        progress(&e.progress());
    }
    if let Some(b) = e.reserved.take() {
        wb.bitmap.release(b);
    }
    progress(&e.progress());
    let mut report = e.report;
    report.error = e.stop.or(e.write_error);
    Ok(report)
}

impl Engine<'_> {
    fn progress(&self) -> WritebackProgress {
        self.report.progress(self.in_flight_reqs)
    }

    /// Prepares requests for candidates while requests are idle.
    fn fill(&mut self, ctl: &mut PpCtl, exhausted: &mut bool) -> Vec<Prepared> {
        let mut out = Vec::new();
        while self.stop.is_none() && !self.idle.is_empty() {
            let Some(index) = ctl.select() else {
                *exhausted = true;
                break;
            };
            if !self.limit.has_budget(self.units) {
                clear_pp(self.inner, index);
                self.stop = Some(Error::io("writeback_limit exhausted"));
                break;
            }
            let block = match self.reserved.take().or_else(|| self.wb.bitmap.alloc()) {
                Some(b) => b,
                None => {
                    clear_pp(self.inner, index);
                    self.stop = Some(Error::new(ErrorKind::NoSpace, "the backing device is full"));
                    break;
                }
            };
            let mut buf = self.idle.pop().expect("checked non-empty");
            if !self.copy_slot(index, &mut buf) {
                // The slot changed since the scan (or cannot be read): skip it, keep the block
                // for the next candidate.
                self.reserved = Some(block);
                self.idle.push(buf);
                self.report.skipped += 1;
                continue;
            }
            let Some(charge) = self.limit.charge(self.units) else {
                // The limit was lowered since the check above.
                clear_pp(self.inner, index);
                self.reserved = Some(block);
                self.idle.push(buf);
                self.stop = Some(Error::io("writeback_limit exhausted"));
                break;
            };
            out.push(Prepared {
                meta: ReqMeta {
                    slot: index,
                    block,
                    charge,
                },
                buf,
            });
        }
        out
    }

    /// Copies slot `index`'s data into `buf` under its lock, if it is still a candidate: the
    /// object as stored (compressed writeback) or the decompressed page. On `false` the slot is
    /// left without PP_SLOT.
    fn copy_slot(&self, index: SlotIndex, buf: &mut AlignedBuf) -> bool {
        let inner = self.inner;
        let mut g = inner.slots.lock(index);
        let st = g.state();
        if !st.has(SlotFlags::PP_SLOT) {
            return false;
        }
        let Some(handle) = st.handle_raw().and_then(Handle::from_raw) else {
            g.clear_flags(SlotFlags::PP_SLOT);
            return false;
        };
        let compressed = self.wb.compressed;
        let ok = inner.pool.read(handle, |obj| {
            if compressed || st.has(SlotFlags::HUGE) {
                buf[..obj.len()].copy_from_slice(obj);
                buf[obj.len()..].fill(0);
                true
            } else {
                inner.codec.decompress(obj, &mut buf[..]).is_ok()
            }
        });
        if !ok {
            g.clear_flags(SlotFlags::PP_SLOT);
        }
        ok
    }

    /// Submits prepared requests: sorted by block, adjacent blocks as one vectored write.
    fn submit(&mut self, mut prepared: Vec<Prepared>) {
        prepared.sort_by_key(|p| p.meta.block);
        let page = self.wb.page_size_bytes as u64;
        let mut it = prepared.into_iter().peekable();
        while let Some(first) = it.next() {
            let mut metas = vec![first.meta];
            let mut bufs = vec![first.buf];
            while metas.len() < self.max_run {
                match it.peek() {
                    Some(p) if p.meta.block.0 == metas[metas.len() - 1].block.0 + 1 => {
                        let p = it.next().expect("peeked");
                        metas.push(p.meta);
                        bufs.push(p.buf);
                    }
                    _ => break,
                }
            }
            let tag = self.next_tag;
            self.next_tag += 1;
            let n = metas.len();
            let op = IoOp::new(metas[0].block.0 * page, bufs, tag);
            match self.queue.submit(op) {
                Ok(()) => {
                    self.in_flight.insert(tag, metas);
                    self.in_flight_reqs += n;
                    self.report.ops += 1;
                }
                Err((err, op)) => {
                    self.idle.extend(op.bufs);
                    for m in metas {
                        self.fail(m);
                    }
                    self.note_write_error(err);
                }
            }
        }
    }

    /// Undoes a request whose write did not happen: block released, charge refunded, PP_SLOT
    /// cleared. The page stays in RAM.
    fn fail(&mut self, m: ReqMeta) {
        self.wb.bitmap.release(m.block);
        self.limit.refund(m.charge);
        clear_pp(self.inner, m.slot);
        self.report.failed += 1;
    }

    fn note_write_error(&mut self, err: Error) {
        super::note_write_error(&mut self.stop, &mut self.write_error, err);
    }

    /// Finishes the requests of one completed op (in this task: see the module docs).
    fn complete(&mut self, c: IoCompletion) {
        let metas = self
            .in_flight
            .remove(&c.op.tag)
            .expect("every completion belongs to an in-flight op");
        self.in_flight_reqs -= metas.len();
        self.idle.extend(c.op.bufs);
        if let Err(err) = c.result {
            for m in metas {
                self.fail(m);
            }
            self.note_write_error(err);
            return;
        }
        let inner = self.inner;
        for m in metas {
            super::add(&self.wb.bd_writes, 1);
            let mut g = inner.slots.lock(m.slot);
            let st = g.state();
            if !st.has(SlotFlags::PP_SLOT) {
                // Changed while in flight: its new contents stay; the block goes back.
                drop(g);
                self.wb.bitmap.release(m.block);
                self.report.changed += 1;
                continue;
            }
            super::set_written_back(inner, &mut g, st, m.block.0);
            self.report.written += 1;
        }
    }
}
