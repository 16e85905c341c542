//! Garbage collection: relocate a victim zone's live records through the scratch ring, then
//! reset the victim (zoned XFS's GC with its ring of scratch buffers and reused read bios).
//!
//! 1. **Victim**: the full zone with the fewest live bytes among those with no pending records
//!    and at least a quarter of the zone reclaimable ([`MIN_RECLAIM_DIVISOR`]: copying a
//!    nearly all-live zone gains nothing, and every zone has some padding, so "anything dead"
//!    would make GC chase its own tail). Ties: the lowest index. A GC call never picks a zone
//!    it wrote into itself: with small zones, relocated records that do not pack into whole
//!    zones leave every GC zone under three quarters live, and GC would move them from zone
//!    to zone forever (the model test found this with 1 MiB zones). So one call reclaims at
//!    most the zones that were written by others, and always ends.
//! 2. Chunks are at most an eighth of a zone, so the space a GC zone leaves unused when the
//!    next chunk does not fit is small (it would otherwise make GC zones eligible again).
//! 3. **Chunks**: ranges of the victim holding live records, in offset order, of at most
//!    `gc_chunk_bytes` (a scratch buffer); a gap of more than 64 KiB of dead bytes starts a new
//!    chunk, so a chunk is an extent of live data, as in XFS. A chunk waits until the scratch
//!    can hold it whole ([`Scratch::grantable_bytes`]): in the ring, until enough of it is
//!    free; with bank switching, until it fits in what is left of the current bank or the
//!    other bank is completely written. (Cutting chunks down to whatever is free instead made
//!    the ring issue ever smaller I/Os: a chunk can only be as large as the space the last
//!    completion freed.) Records are sector aligned, so a chunk is one aligned read.
//! 4. **Read, then reuse the op as the write**: a chunk reserves scratch pieces at the ring's
//!    head and is queued as one asynchronous read [`IoOp`] owning them. When the read
//!    completes, the *same op* gets the GC zone's write pointer as its offset and, as its
//!    segments, the live records among the bytes it read (plus filler to keep writes 4 KiB
//!    aligned), and is resubmitted as the write: no copy, no rebuilt buffer (bio_reuse). Dead
//!    records read along with live ones are simply not named by the write.
//! 5. **Verify**: before the read becomes the write, every live record in it is checked
//!    (magic, slot, length, CRC-32C, as a reader checks it). One that fails is counted and
//!    logged like a reader's mismatch ([`crate::backing::verify`]) and read again on its own:
//!    if that copy verifies it replaces the bad bytes; if not, GC stops with `EIO` as for a
//!    failed read (nothing moves, the victim is not reset). So a fault of the device while GC
//!    reads never becomes permanent by being copied, and the victim's bytes, the only copy,
//!    stay for a device that heals (a page whose record stays bad reads as `EIO`; overwriting
//!    or discarding it lets GC reclaim the zone).
//! 6. **Complete**: when a write completes, each record in it is re-pointed through
//!    [`GcOwner::repoint`], which succeeds only if the slot still points at the old location
//!    (else the copy is dropped as dead); the pieces go back to the scratch (the tail moves).
//!    A failed write leaves the records where they were.
//! 7. **Reset**: after every chunk completed, the backing is flushed (the copies are durable)
//!    and, if nothing failed and nothing live is left, the victim is reset to empty.

use std::time::{Duration, Instant};

use super::record;
use super::ring::{new_scratch, Scratch, Span};
use super::{Opener, Rec, RecState, Zone, ZoneCondition, ZoneLoc, ZoneStore, PIECE_BYTES};
use crate::backing::{AlignedBuf, IoKind, IoOp, IoQueue, Segment};
use crate::error::{Error, Result};

/// A victim must have at least `zone_size / MIN_RECLAIM_DIVISOR` bytes that are not live.
pub const MIN_RECLAIM_DIVISOR: u64 = 4;

/// Whoever points slots at records: GC asks it to move a slot from `old` to `new`.
pub trait GcOwner: Sync {
    /// Re-points `slot` from `old` to `new` if it still points at `old` and returns whether it
    /// did. Both the check and the store happen under the slot's lock, and so does `moved`,
    /// which the owner calls right after storing `new` (it makes `new` live and `old` dead in
    /// the store's books): a release of the slot, which also happens under its lock, then
    /// always finds `new` live.
    fn repoint(&self, slot: u64, old: ZoneLoc, new: ZoneLoc, moved: &dyn Fn()) -> bool;
}

/// What one [`ZoneStore::gc`] call did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GcReport {
    /// Victim zones reset.
    pub zones_reclaimed: u64,
    /// Records moved and re-pointed.
    pub records_relocated: u64,
    /// Records copied whose slot had moved on meanwhile (dropped).
    pub records_dropped: u64,
    /// Bytes of live records moved.
    pub bytes_relocated: u64,
    /// Bytes written (chunks rounded up to 4 KiB).
    pub bytes_written: u64,
    /// Records whose bytes did not verify when GC read them (each counted in
    /// `bd_checksum_errors`).
    pub records_unverified: u64,
    /// Of those, records whose second read verified and was moved instead (when it did not,
    /// GC stopped with `EIO`).
    pub records_reread: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Part of `elapsed` spent flushing the backing before resetting victims.
    pub flush: Duration,
}

/// One chunk in flight: being read (`moves` empty), then being written.
struct Chunk {
    span: Span,
    plan: ChunkPlan,
    /// Slot, old location, new location (set when the read completed).
    moves: Vec<(u64, ZoneLoc, ZoneLoc)>,
}

impl ZoneStore {
    /// Picks the victim; see the module docs.
    fn pick_victim(&self) -> Option<u32> {
        let capacity = self.zone_capacity_bytes();
        let min_gain = capacity / MIN_RECLAIM_DIVISOR;
        let z = self.zones.lock();
        z.zones
            .iter()
            .enumerate()
            .filter(|(_, zone)| Self::eligible(zone, z.gc_pass, capacity, min_gain))
            .min_by_key(|(i, zone)| (zone.live_bytes, *i))
            .map(|(i, _)| i as u32)
    }

    /// Whether `zone` may be picked as a victim in GC pass `gc_pass`: full, nothing pending,
    /// not picked this pass, and at least `min_gain` of its `capacity` dead.
    fn eligible(zone: &Zone, gc_pass: u64, capacity: u64, min_gain: u64) -> bool {
        zone.cond == ZoneCondition::Full
            && zone.pending == 0
            && zone.gc_pass != gc_pass
            && capacity - zone.live_bytes >= min_gain
    }

    /// How many zones [`pick_victim`](Self::pick_victim) could pick now.
    fn eligible_victims(&self) -> usize {
        let capacity = self.zone_capacity_bytes();
        let min_gain = capacity / MIN_RECLAIM_DIVISOR;
        let z = self.zones.lock();
        z.zones
            .iter()
            .filter(|zone| Self::eligible(zone, z.gc_pass, capacity, min_gain))
            .count()
    }

    /// Reclaims up to `max_victims` zones (stopping early when no zone has anything dead),
    /// writing through `queue` (a queue of this store's backing). Runs while reads, writes,
    /// writeback and releases go on; one GC at a time. A read or write error stops GC with
    /// that error, after every chunk in flight completed; nothing is lost and the victim is
    /// not reset.
    pub fn gc(
        &self,
        owner: &dyn GcOwner,
        queue: &mut dyn IoQueue,
        max_victims: usize,
    ) -> Result<GcReport> {
        self.gc_with_progress(owner, queue, max_victims, &mut |_, _| {})
    }

    /// Like [`gc`](Self::gc), calling `progress(reclaimed, victims)` at the start and after
    /// each victim: zones reset so far, and the zones eligible as victims when the run began
    /// (at most `max_victims`; zones that fill during the run and are picked too make it grow
    /// to match).
    pub fn gc_with_progress(
        &self,
        owner: &dyn GcOwner,
        queue: &mut dyn IoQueue,
        max_victims: usize,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<GcReport> {
        let _one_at_a_time = self.gc_lock.lock();
        {
            let mut z = self.zones.lock();
            z.gc_pass += 1;
        }
        let mut victims = (self.eligible_victims() as u64).min(max_victims as u64);
        progress(0, victims);
        let start = Instant::now();
        let mut scratch = new_scratch(
            self.config.scratch_mode,
            self.config.gc_buffers,
            self.config.gc_buffer_bytes,
        )?;
        let mut report = GcReport::default();
        for _ in 0..max_victims {
            let Some(victim) = self.pick_victim() else {
                break;
            };
            let reclaimed = report.zones_reclaimed;
            self.gc_zone(owner, queue, scratch.as_mut(), victim, &mut report)?;
            if report.zones_reclaimed == reclaimed {
                // Records still live in the victim (cannot happen while the owner re-points
                // faithfully): stop rather than pick it again.
                break;
            }
            victims = victims.max(report.zones_reclaimed);
            progress(report.zones_reclaimed, victims);
        }
        report.elapsed = start.elapsed();
        Ok(report)
    }

    fn gc_zone(
        &self,
        owner: &dyn GcOwner,
        queue: &mut dyn IoQueue,
        scratch: &mut dyn Scratch,
        victim: u32,
        report: &mut GcReport,
    ) -> Result<()> {
        let live: Vec<Rec> = {
            let z = self.zones.lock();
            z.zones[victim as usize]
                .records
                .iter()
                .filter(|r| r.state == RecState::Live)
                .copied()
                .collect()
        };
        // Zones are at least 1 MiB, so an eighth (128 KiB) still holds the largest record (a
        // raw 64 KiB page and its header): a chunk is never smaller than one record.
        let eighth = (self.config.zone_size_bytes / 8) as usize / PIECE_BYTES * PIECE_BYTES;
        let max_chunk = self
            .config
            .gc_chunk_bytes
            .min(scratch.max_chunk_bytes())
            .min(eighth.max(PIECE_BYTES));
        let mut pass = GcPass {
            store: self,
            owner,
            queue,
            scratch,
            victim,
            report,
            in_flight: Vec::new(),
            first_error: None,
        };
        let mut next = 0;
        while next < live.len() && pass.first_error.is_none() {
            // Room in the scratch for the next chunk: the head advances when a read is queued,
            // the tail when a write completes; reap until the tail frees enough, and until the
            // queue has room.
            let need = (live[next].span_bytes as usize).next_multiple_of(PIECE_BYTES);
            if need > pass.scratch.max_chunk_bytes() {
                pass.first_error = Some(Error::invalid(format!(
                    "a {need}-byte record does not fit in the GC scratch ({} bytes per chunk)",
                    pass.scratch.max_chunk_bytes()
                )));
                break;
            }
            // A record larger than the chunk bound still moves, alone.
            let (plan, taken) = next_chunk(&live[next..], max_chunk.max(need) as u64);
            let range = (plan.end - plan.start) as usize;
            let pieces_bytes = range.next_multiple_of(PIECE_BYTES);
            while pass.scratch.grantable_bytes(pieces_bytes) < pieces_bytes
                || pass.queue.in_flight() >= pass.queue.depth()
            {
                pass.reap()?;
            }
            next += taken;
            let (span, pieces) = pass
                .scratch
                .reserve(range)
                .expect("the scratch grants what it offered");
            let mut op = IoOp::read(self.zone_base(victim) + plan.start, pieces, 0);
            let mut segs = Vec::new();
            add_segments(&mut segs, 0, range);
            op.segments = Some(segs);
            op.tag = pass.in_flight.len() as u64;
            pass.in_flight.push(Some(Chunk {
                span,
                plan,
                moves: Vec::new(),
            }));
            if let Err((e, op)) = pass.queue.submit(op) {
                let chunk = pass.in_flight[op.tag as usize].take().expect("just queued");
                pass.scratch.complete(chunk.span, op.bufs);
                pass.first_error = Some(e);
            }
        }
        // Drain.
        while pass.queue.in_flight() > 0 {
            pass.reap()?;
        }
        if let Some(e) = pass.first_error {
            return Err(e);
        }
        // Every copy is written and re-pointed; make them durable before the originals go.
        let flush_start = Instant::now();
        self.backing.flush()?;
        report.flush += flush_start.elapsed();
        let z = self.zones.lock();
        let zone = &z.zones[victim as usize];
        let reclaimable = zone.live_bytes == 0 && zone.pending == 0;
        drop(z);
        if reclaimable {
            // Readers that pinned the victim before their slot moved finish first. No new pin
            // can come (no slot points into the victim any more) and nothing can become live
            // in it (it is full with nothing pending), so the wait is bounded.
            let mut z = self.wait_unpinned(victim);
            debug_assert!({
                let zone = &z.zones[victim as usize];
                zone.live_bytes == 0 && zone.pending == 0
            });
            // On a zoned device the write pointer goes back first; if that fails the victim
            // stays full with nothing live, and a later GC tries again.
            if self.has_device_wp(victim) {
                self.backing
                    .reset_zone(self.zone_base(victim), self.config.zone_size_bytes)?;
            } else {
                // Emulated zones: the backing may give the space back (an NBD export: a trim),
                // a round trip, so not under `zones`. The victim stays full meanwhile: nothing
                // appends to it, no slot points into it (no reader can pin it) and GC, the
                // only one to reset zones, holds `gc_lock`; so the trim races with nothing.
                // It is advice: the victim's records are dead either way, and a failure only
                // leaves the space allocated on the server.
                drop(z);
                let _ = self
                    .backing
                    .reset_zone(self.zone_base(victim), self.config.zone_size_bytes);
                z = self.zones.lock();
            }
            z.zones[victim as usize] = super::Zone::empty();
            drop(z);
            report.zones_reclaimed += 1;
            self.counters
                .gc_runs
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }
}

/// One victim's GC in progress: the queue and scratch it uses, its chunks in flight (indexed
/// by their ops' tags) and the first error met (after which no new I/O starts).
struct GcPass<'a> {
    store: &'a ZoneStore,
    owner: &'a dyn GcOwner,
    queue: &'a mut dyn IoQueue,
    scratch: &'a mut dyn Scratch,
    victim: u32,
    report: &'a mut GcReport,
    in_flight: Vec<Option<Chunk>>,
    first_error: Option<Error>,
}

impl GcPass<'_> {
    /// Reaps at least one completion. A completed read becomes its chunk's write (the same
    /// op, buffers and bytes: bio_reuse); a completed write finishes its chunk.
    fn reap(&mut self) -> Result<()> {
        let victim = self.victim;
        for c in self.queue.wait(1)? {
            let tag = c.op.tag as usize;
            let mut chunk = self.in_flight[tag]
                .take()
                .expect("a completion for a chunk in flight");
            if c.op.kind == IoKind::Write {
                self.finish_chunk(chunk, c.result, c.op);
                continue;
            }
            let mut op = c.op;
            if let Err(e) = c.result {
                self.scratch.complete(chunk.span, op.bufs);
                self.first_error.get_or_insert(e);
                continue;
            }
            if self.first_error.is_some() {
                // Stopping: do not start new writes.
                self.scratch.complete(chunk.span, op.bufs);
                continue;
            }
            if let Err(e) = self.verify_chunk(&chunk.plan, &mut op.bufs) {
                self.scratch.complete(chunk.span, op.bufs);
                self.first_error.get_or_insert(e);
                continue;
            }
            let live_bytes: u64 = chunk
                .plan
                .recs
                .iter()
                .map(|r| u64::from(r.span_bytes))
                .sum();
            let padded = (live_bytes as usize).next_multiple_of(PIECE_BYTES);
            // Destination: the GC zone's write pointer, 4 KiB aligned.
            let dest = {
                let mut z = self.store.zones.lock();
                self.store
                    .reserve(&mut z, Opener::Gc, padded as u64, padded as u64)
            };
            let (dzone, doff, _) = match dest {
                Ok(d) => d,
                Err(e) => {
                    self.scratch.complete(chunk.span, op.bufs);
                    self.first_error.get_or_insert(e);
                    continue;
                }
            };
            let mut segments: Vec<Segment> = Vec::new();
            let mut at = 0u64;
            {
                let mut z = self.store.zones.lock();
                let dz = &mut z.zones[dzone as usize];
                for r in &chunk.plan.recs {
                    let new = ZoneLoc {
                        zone: dzone,
                        offset_bytes: doff + at,
                        span_bytes: r.span_bytes,
                    };
                    dz.records.push(Rec {
                        offset_bytes: new.offset_bytes,
                        span_bytes: new.span_bytes,
                        slot: r.slot,
                        state: RecState::Pending,
                    });
                    dz.pending += 1;
                    let old = ZoneLoc {
                        zone: victim,
                        offset_bytes: r.offset_bytes,
                        span_bytes: r.span_bytes,
                    };
                    chunk.moves.push((r.slot, old, new));
                    add_segments(
                        &mut segments,
                        (r.offset_bytes - chunk.plan.start) as usize,
                        r.span_bytes as usize,
                    );
                    at += u64::from(r.span_bytes);
                }
            }
            if padded > live_bytes as usize {
                // Keep the GC zone's writes 4 KiB aligned: the tail is filler (any bytes of
                // the chunk; no record points there).
                add_segments(&mut segments, 0, padded - live_bytes as usize);
            }
            // bio_reuse: the read's op and buffers become the write; the bytes stay where the
            // read put them and the write names the live records among them (no copy).
            op.kind = IoKind::Write;
            op.offset = self.store.zone_base(dzone) + doff;
            op.segments = Some(segments);
            self.in_flight[tag] = Some(chunk);
            if let Err((e, op)) = self.queue.submit(op) {
                let chunk = self.in_flight[tag].take().expect("just queued");
                self.finish_chunk(chunk, Err(e), op);
            }
        }
        Ok(())
    }

    /// Checks each live record of a chunk just read into `bufs` (step 5 of the module docs).
    fn verify_chunk(&mut self, plan: &ChunkPlan, bufs: &mut [AlignedBuf]) -> Result<()> {
        let store = self.store;
        for r in &plan.recs {
            let pos = (r.offset_bytes - plan.start) as usize;
            let mut bytes = vec![0u8; r.span_bytes as usize];
            copy_between(bufs, pos, &mut bytes, Dir::Out);
            let Err(e) = record::decode(&bytes, r.slot) else {
                continue;
            };
            let offset = store.zone_base(self.victim) + r.offset_bytes;
            let device = store.backing.describe();
            let what = format!("zoned record of slot {} (GC read)", r.slot);
            store
                .counters
                .mismatches
                .note(&device, offset, &what, e.message());
            self.report.records_unverified += 1;
            let mut again = AlignedBuf::new_zeroed(r.span_bytes as usize)?;
            store.backing.read_at(&mut again, offset)?;
            if let Err(e) = record::decode(&again, r.slot) {
                return Err(store
                    .counters
                    .mismatches
                    .note(&device, offset, &what, e.message()));
            }
            copy_between(bufs, pos, &mut again, Dir::In);
            self.report.records_reread += 1;
        }
        Ok(())
    }

    fn finish_chunk(&mut self, chunk: Chunk, result: Result<()>, op: IoOp) {
        let store = self.store;
        match result {
            Ok(()) => {
                let copied: u64 = chunk.moves.iter().map(|m| u64::from(m.1.span_bytes)).sum();
                self.report.bytes_relocated += copied;
                self.report.bytes_written += op.len_bytes();
                for (slot, old, new) in chunk.moves {
                    // The slot lock (taken by `repoint`, held across `moved`) orders this
                    // against overwrite and discard: either they see `new`, already live, and
                    // release it, or `repoint` fails.
                    let moved = || {
                        let mut z = store.zones.lock();
                        let nz = &mut z.zones[new.zone as usize];
                        let r = nz.rec_mut(new);
                        r.state = RecState::Live;
                        nz.pending -= 1;
                        nz.live_bytes += u64::from(new.span_bytes);
                        let oz = &mut z.zones[old.zone as usize];
                        let r = oz.rec_mut(old);
                        assert_eq!(r.state, RecState::Live, "relocated {old:?} was not live");
                        r.state = RecState::Dead;
                        oz.live_bytes -= u64::from(old.span_bytes);
                        // The GC zone's last pending record: finish it if it was left short.
                        store.finish_if_due(&mut z, new.zone);
                    };
                    if self.owner.repoint(slot, old, new, &moved) {
                        self.report.records_relocated += 1;
                    } else {
                        store.abort(new);
                        self.report.records_dropped += 1;
                    }
                }
                store
                    .counters
                    .gc_bytes_relocated
                    .fetch_add(copied, std::sync::atomic::Ordering::Relaxed);
                store
                    .counters
                    .gc_bytes_written
                    .fetch_add(op.len_bytes(), std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => {
                // The GC zone takes no more appends (on a zoned device its write pointer is
                // not where the next chunk would go).
                if let Some((_, _, new)) = chunk.moves.first() {
                    store.write_failed(new.zone);
                }
                for (_, _, new) in chunk.moves {
                    store.abort(new);
                }
                self.first_error.get_or_insert(e);
            }
        }
        self.scratch.complete(chunk.span, op.bufs);
    }
}

/// Which way [`copy_between`] copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// From the pieces into the slice.
    Out,
    /// From the slice into the pieces.
    In,
}

/// Copies between `bytes` and the range of the same length at byte `pos` of `bufs` taken as
/// one run of bytes (a chunk's scratch pieces, in order).
fn copy_between(bufs: &mut [AlignedBuf], mut pos: usize, bytes: &mut [u8], dir: Dir) {
    let mut done = 0;
    for b in bufs.iter_mut() {
        if done == bytes.len() {
            break;
        }
        if pos >= b.len() {
            pos -= b.len();
            continue;
        }
        let n = (b.len() - pos).min(bytes.len() - done);
        match dir {
            Dir::Out => bytes[done..done + n].copy_from_slice(&b[pos..pos + n]),
            Dir::In => b[pos..pos + n].copy_from_slice(&bytes[done..done + n]),
        }
        done += n;
        pos = 0;
    }
    assert_eq!(done, bytes.len(), "a record inside its chunk's pieces");
}

/// A GC chunk: a range of the victim read in one go, and the live records in it.
#[derive(Debug)]
struct ChunkPlan {
    start: u64,
    end: u64,
    recs: Vec<Rec>,
}

/// Dead bytes a chunk may read over to reach the next live record; a larger gap starts a new
/// chunk (reading it would cost more than another read).
const MAX_GAP_BYTES: u64 = 64 << 10;

/// The next chunk from `live` (in offset order, not empty): the first record and those after
/// it while the range stays within `max_chunk` bytes (rounded up to pieces) and no gap of dead
/// bytes exceeds [`MAX_GAP_BYTES`]. Returns it and how many records it took. The first record
/// is always taken (the caller made room for it).
fn next_chunk(live: &[Rec], max_chunk: u64) -> (ChunkPlan, usize) {
    let first = live[0];
    let mut c = ChunkPlan {
        start: first.offset_bytes,
        end: first.offset_bytes + u64::from(first.span_bytes),
        recs: vec![first],
    };
    for r in &live[1..] {
        let end = r.offset_bytes + u64::from(r.span_bytes);
        let range = (end - c.start).next_multiple_of(PIECE_BYTES as u64);
        if range > max_chunk || r.offset_bytes - c.end > MAX_GAP_BYTES {
            break;
        }
        c.end = end;
        c.recs.push(*r);
    }
    let n = c.recs.len();
    (c, n)
}

/// Appends segments naming bytes `pos..pos + len` of 4 KiB pieces, split at piece boundaries
/// and merged with the previous segment when contiguous.
fn add_segments(segs: &mut Vec<Segment>, pos: usize, len: usize) {
    let mut pos = pos;
    let mut left = len;
    while left > 0 {
        let buf = pos / PIECE_BYTES;
        let offset = pos % PIECE_BYTES;
        let n = (PIECE_BYTES - offset).min(left);
        match segs.last_mut() {
            Some(last) if last.buf == buf && last.offset + last.len == offset => last.len += n,
            _ => segs.push(Segment {
                buf,
                offset,
                len: n,
            }),
        }
        pos += n;
        left -= n;
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    fn rec(off: u64, span: u32) -> Rec {
        Rec {
            offset_bytes: off,
            span_bytes: span,
            slot: off,
            state: RecState::Live,
        }
    }

    /// Cuts all of `live` into chunks of at most `max_chunk` bytes.
    fn plan_chunks(live: &[Rec], max_chunk: u64) -> Vec<ChunkPlan> {
        let mut out = Vec::new();
        let mut next = 0;
        while next < live.len() {
            let (c, n) = next_chunk(&live[next..], max_chunk);
            next += n;
            out.push(c);
        }
        out
    }

    #[test]
    fn chunks_span_small_gaps_and_respect_the_size() {
        let live = [
            rec(0, 1024),
            rec(1024, 512),
            rec(4096, 2048),
            rec(6144, 4096),
            rec(200_000, 512),
        ];
        let chunks = plan_chunks(&live, 16384);
        let shape: Vec<(u64, u64, usize)> = chunks
            .iter()
            .map(|c| (c.start, c.end, c.recs.len()))
            .collect();
        // The 190 KB gap starts a new chunk; the 2.5 KB gap does not.
        assert_eq!(shape, vec![(0, 10240, 4), (200_000, 200_512, 1)]);
        let chunks = plan_chunks(&live, 8192);
        let shape: Vec<(u64, u64, usize)> = chunks
            .iter()
            .map(|c| (c.start, c.end, c.recs.len()))
            .collect();
        assert_eq!(
            shape,
            vec![(0, 6144, 3), (6144, 10240, 1), (200_000, 200_512, 1)]
        );
    }

    #[test]
    fn segments_split_at_pieces_and_merge_when_contiguous() {
        let mut segs = Vec::new();
        add_segments(&mut segs, 3584, 1024);
        add_segments(&mut segs, 4608, 512);
        add_segments(&mut segs, 8192, 512);
        assert_eq!(
            segs,
            vec![
                Segment {
                    buf: 0,
                    offset: 3584,
                    len: 512
                },
                Segment {
                    buf: 1,
                    offset: 0,
                    len: 1024
                },
                Segment {
                    buf: 2,
                    offset: 0,
                    len: 512
                },
            ]
        );
    }
}
