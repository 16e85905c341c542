//! Append-only (zoned) backing storage with garbage collection, after zoned XFS's GC.
//!
//! The backing device is cut into zones of `zone_size_bytes` (256 MiB by default), each
//! *empty*, *open* (being appended to at its write pointer) or *full*. Writeback appends
//! [records](record) — header, checksum, compressed object — back to back into the open zone
//! and writes them out in large sequential writes ([`ZoneWriter`]); a slot then points at its
//! record's [`ZoneLoc`]. Overwrite, discard and reset lower the zone's live-byte count
//! ([`ZoneStore::release`]). Garbage collection ([`gc`]) picks the full zone with the fewest
//! live bytes, relocates its live records through a scratch [ring](ring) into the GC zone, and
//! resets the victim once every live record is durable and re-pointed.
//!
//! Over a regular file or an ordinary block device the zones are emulated (a zone is a fixed
//! range of it, written only sequentially). Over a zoned block device (host-managed SMR, ZNS,
//! zoned `null_blk`: see [`crate::backing::blkzoned`]) they are the device's own zones: the
//! zone size is the device's, a zone holds its *capacity*, non-empty zones are reset when the
//! store is set up, a zone GC emptied is reset on the device (`BLKRESETZONE`) before it is
//! written again, and a zone the store stops writing before it is full is finished
//! (`BLKFINISHZONE`) once its last write completed, so it stops counting against the device's
//! open and active zone limits. The layout is in `docs/format.md`.
//!
//! # Record states
//! A record is *pending* from [`ZoneWriter::append`] (or a GC reservation) until its write
//! completes and its owner either [`commit`](ZoneStore::commit)s it (*live*: a slot points at
//! it) or [`abort`](ZoneStore::abort)s it (*dead*: the write failed or the slot changed
//! meanwhile). A live record dies exactly once, through [`release`](ZoneStore::release) or by
//! being relocated by GC. Only live records count in `live_bytes`; a zone with pending records
//! is never chosen as a GC victim, so a record cannot become live in a zone being reset.
//!
//! # Read pins
//! A record's bytes stay valid until its zone is reset, and only GC resets zones. A reader
//! that found a slot pointing at a [`ZoneLoc`] takes a [`ZonePin`] on its zone *under the slot
//! lock* (so the record is live when pinned), drops the slot lock and reads. GC resets a victim
//! only once its reader count is 0; after GC re-pointed every slot away from the victim no new
//! pin on it can be taken (a pin needs a slot pointing into the zone), so the wait is short
//! and the bytes a pinned reader reads are exactly those its slot pointed at.
//!
//! # Locks
//! `zones` (one mutex) protects every zone's state, write pointer, counters, reader count and
//! record list; it is held only for bookkeeping, never across I/O. GC is serialised by
//! `gc_lock`. The caller's slot locks come before `zones` (the device calls
//! `release`/`commit`/`pin` under a slot lock); GC calls [`GcOwner::repoint`] (which takes a
//! slot lock, then `zones` inside the `moved` callback) without holding `zones`.
//! Lock order: `gc_lock` → slot lock → `zones`.

pub mod gc;
pub mod record;
pub mod ring;

pub use gc::{GcOwner, GcReport};
pub use record::HEADER_BYTES;
pub use record::{RecordHeader, FLAG_COMPRESSED};
pub use ring::{ScratchMode, PIECE_BYTES};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::backing::verify::Mismatches;
use crate::backing::{AlignedBuf, Backing, IoOp};
use crate::error::{Error, Result};
use record::{record_span_bytes, RECORD_ALIGN_BYTES};

/// Default zone size: 256 MiB, the zone size of host-managed SMR HDDs (and of the benchmark
/// zoned XFS's GC ring was measured with).
pub const DEFAULT_ZONE_SIZE_BYTES: u64 = 256 << 20;
/// Largest zone a [`ZoneLoc`] can address: 2 GiB.
pub const MAX_ZONE_SIZE_BYTES: u64 = (1 << 22) * RECORD_ALIGN_BYTES as u64;
/// Zone sizes are multiples of this (1 MiB): every zoned block device's zone size is, and GC's
/// chunk bound (an eighth of a zone) then stays a whole number of 4 KiB pieces.
pub const ZONE_SIZE_ALIGN_BYTES: u64 = 1 << 20;

/// Whether the zoned store takes zones of `bytes`: a non-zero multiple of
/// [`ZONE_SIZE_ALIGN_BYTES`], at most [`MAX_ZONE_SIZE_BYTES`].
pub fn is_valid_zone_size(bytes: u64) -> bool {
    bytes != 0 && bytes % ZONE_SIZE_ALIGN_BYTES == 0 && bytes <= MAX_ZONE_SIZE_BYTES
}
/// Writeback writes go out in stages of this many bytes (the "at least 128 KiB").
pub const DEFAULT_STAGE_BYTES: usize = 256 << 10;
/// Default GC scratch: 2 buffers of 1 MiB (zoned XFS's `XFS_GC_NR_BUFS`, `XFS_GC_BUF_SIZE`).
pub const DEFAULT_GC_BUFFERS: usize = 2;
/// See [`DEFAULT_GC_BUFFERS`].
pub const DEFAULT_GC_BUFFER_BYTES: usize = 1 << 20;
/// Largest GC chunk (one read, then one write): a whole scratch buffer, as in XFS, where the
/// buffer size is also the upper bound of each GC I/O.
pub const DEFAULT_GC_CHUNK_BYTES: usize = 1 << 20;
/// Queue depth of GC reads and writes: deep enough that the scratch space, not the queue,
/// bounds the I/O in flight (chunks are extents of live records, down to one record, so 2 MiB
/// of scratch may hold many small ones).
pub const GC_QUEUE_DEPTH: usize = 64;

/// Settings of a zoned store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZoneConfig {
    /// Bytes per zone: a multiple of 1 MiB, at most [`MAX_ZONE_SIZE_BYTES`].
    pub zone_size_bytes: u64,
    /// GC runs when fewer zones than this are empty (see [`ZoneStore::needs_gc`]).
    pub gc_free_zones: usize,
    /// Scratch buffers and their size.
    pub gc_buffers: usize,
    /// See `gc_buffers`.
    pub gc_buffer_bytes: usize,
    /// Ring or bank switching (benchmark baseline).
    pub scratch_mode: ScratchMode,
    /// Largest GC chunk.
    pub gc_chunk_bytes: usize,
}

impl Default for ZoneConfig {
    fn default() -> ZoneConfig {
        ZoneConfig {
            zone_size_bytes: DEFAULT_ZONE_SIZE_BYTES,
            gc_free_zones: 2,
            gc_buffers: DEFAULT_GC_BUFFERS,
            gc_buffer_bytes: DEFAULT_GC_BUFFER_BYTES,
            scratch_mode: ScratchMode::Ring,
            gc_chunk_bytes: DEFAULT_GC_CHUNK_BYTES,
        }
    }
}

/// Where a record lives: zone, byte offset in the zone and span (both multiples of 512).
/// Packs into a `u64` (zone 32 bits, offset / 512 22 bits, span / 512 10 bits) for the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ZoneLoc {
    /// Zone index.
    pub zone: u32,
    /// Byte offset of the record inside the zone.
    pub offset_bytes: u64,
    /// Bytes the record spans (header, payload, padding).
    pub span_bytes: u32,
}

impl ZoneLoc {
    /// The packed form.
    pub fn to_raw(self) -> u64 {
        let a = RECORD_ALIGN_BYTES as u64;
        (u64::from(self.zone) << 32)
            | ((self.offset_bytes / a) << 10)
            | (u64::from(self.span_bytes) / a)
    }

    /// Unpacks [`to_raw`](Self::to_raw).
    pub fn from_raw(raw: u64) -> ZoneLoc {
        let a = RECORD_ALIGN_BYTES as u64;
        ZoneLoc {
            zone: (raw >> 32) as u32,
            offset_bytes: ((raw >> 10) & ((1 << 22) - 1)) * a,
            span_bytes: ((raw & 0x3ff) * a) as u32,
        }
    }
}

/// A zone's condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZoneCondition {
    /// Write pointer at the start, nothing live.
    Empty,
    /// Being appended to (by the writeback writer or by GC).
    Open,
    /// Closed for appends; waits for GC.
    Full,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecState {
    Pending,
    Live,
    Dead,
}

#[derive(Debug, Clone, Copy)]
struct Rec {
    offset_bytes: u64,
    span_bytes: u32,
    slot: u64,
    state: RecState,
}

#[derive(Debug)]
struct Zone {
    cond: ZoneCondition,
    /// Next byte to hand out (records are placed below it; stages are written below it).
    wp_bytes: u64,
    live_bytes: u64,
    pending: u32,
    /// Readers holding a [`ZonePin`] on this zone: it is not reset while non-zero.
    readers: u32,
    /// The GC pass ([`Zones::gc_pass`]) that last wrote into this zone: a pass never picks a
    /// zone it wrote as a victim (it would chase its own tail forever).
    gc_pass: u64,
    /// In offset order.
    records: Vec<Rec>,
    /// A zone the store stopped writing below its capacity, on a zoned device: it is finished
    /// once `pending` is 0 (no write into it is in flight any more).
    finish_due: bool,
}

impl Zone {
    fn empty() -> Zone {
        Zone {
            cond: ZoneCondition::Empty,
            wp_bytes: 0,
            live_bytes: 0,
            pending: 0,
            readers: 0,
            gc_pass: 0,
            records: Vec::new(),
            finish_due: false,
        }
    }

    fn rec_mut(&mut self, loc: ZoneLoc) -> &mut Rec {
        let i = self
            .records
            .binary_search_by_key(&loc.offset_bytes, |r| r.offset_bytes)
            .unwrap_or_else(|_| panic!("no record at {loc:?}"));
        let r = &mut self.records[i];
        assert_eq!(r.span_bytes, loc.span_bytes, "record span at {loc:?}");
        r
    }
}

/// Who appends to an open zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opener {
    Writer,
    Gc,
}

#[derive(Debug)]
struct Zones {
    zones: Vec<Zone>,
    writer_zone: Option<u32>,
    gc_zone: Option<u32>,
    /// Number of the running (or last) [`ZoneStore::gc`] call, from 1.
    gc_pass: u64,
}

/// Counters shown by `zone_stat`.
#[derive(Debug, Default)]
struct Counters {
    writeback_bytes: AtomicU64,
    /// Victim zones GC reset.
    gc_runs: AtomicU64,
    gc_bytes_relocated: AtomicU64,
    gc_bytes_written: AtomicU64,
    /// Record reads that did not verify (`bd_checksum_errors`).
    mismatches: Mismatches,
}

/// A snapshot for `zone_stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ZoneStats {
    /// Zones by condition.
    pub empty: u64,
    /// See `empty`.
    pub open: u64,
    /// See `empty`.
    pub full: u64,
    /// Bytes of live records (headers and padding included).
    pub live_bytes: u64,
    /// Bytes written by writeback (records, padding included).
    pub writeback_bytes: u64,
    /// Victims reclaimed by GC.
    pub gc_runs: u64,
    /// Bytes of live records GC moved.
    pub gc_bytes_relocated: u64,
    /// Bytes GC wrote (chunks rounded up to 4 KiB).
    pub gc_bytes_written: u64,
}

impl ZoneStats {
    /// (writeback + GC bytes written) / writeback bytes written; 1.0 before any writes.
    pub fn write_amplification(&self) -> f64 {
        if self.writeback_bytes == 0 {
            1.0
        } else {
            (self.writeback_bytes + self.gc_bytes_written) as f64 / self.writeback_bytes as f64
        }
    }

    /// `zone_stat`'s line: `empty open full live_bytes writeback_bytes gc_runs
    /// gc_bytes_relocated gc_bytes_written write_amplification`.
    pub fn to_line(&self) -> String {
        format!(
            "{:8} {:8} {:8} {:12} {:12} {:8} {:12} {:12} {:.3}\n",
            self.empty,
            self.open,
            self.full,
            self.live_bytes,
            self.writeback_bytes,
            self.gc_runs,
            self.gc_bytes_relocated,
            self.gc_bytes_written,
            self.write_amplification()
        )
    }
}

/// The zoned store over one backing device. See the module docs.
#[derive(Debug)]
pub struct ZoneStore {
    backing: Arc<dyn Backing>,
    config: ZoneConfig,
    /// Bytes written into a zone at most: the zone size, or a zoned device's zone capacity
    /// (rounded down to 4 KiB).
    capacity_bytes: u64,
    /// On a zoned block device: per zone, whether it has a write pointer to reset and finish
    /// (conventional zones have none). `None` when zones are emulated.
    device_seq: Option<Vec<bool>>,
    zones: Mutex<Zones>,
    counters: Counters,
    gc_lock: Mutex<()>,
    /// Signalled when a zone's reader count drops to 0 (GC waits on it before a reset).
    unpinned: Condvar,
}

/// A reader's pin on a zone (see the module docs): the zone is not reset until it drops.
#[derive(Debug)]
pub struct ZonePin<'a> {
    store: &'a ZoneStore,
    loc: ZoneLoc,
}

impl ZonePin<'_> {
    /// The pinned record's location.
    pub fn loc(&self) -> ZoneLoc {
        self.loc
    }
}

impl Drop for ZonePin<'_> {
    fn drop(&mut self) {
        let mut z = self.store.zones.lock();
        let zone = &mut z.zones[self.loc.zone as usize];
        zone.readers -= 1;
        if zone.readers == 0 {
            self.store.unpinned.notify_all();
        }
    }
}

impl ZoneStore {
    /// A store over `backing` cut into zones of `config.zone_size_bytes` (a trailing partial
    /// zone is not used). `EINVAL` for a bad zone size or fewer than 3 zones (one for
    /// writeback, one for GC, one to reclaim). On a zoned block device the zone size must be
    /// the device's, every zone must be usable (not read-only or offline), and the non-empty
    /// sequential zones are reset (whatever they held is discarded, as zram discards what a
    /// backing device held before).
    pub fn new(backing: Arc<dyn Backing>, config: ZoneConfig) -> Result<ZoneStore> {
        ZoneStore::open(backing, config, true)
    }

    /// [`new`](Self::new), resetting the zoned device's non-empty zones when `reset` (a new
    /// store), leaving them for [`finish_recovery`](Self::finish_recovery) when not.
    fn open(backing: Arc<dyn Backing>, config: ZoneConfig, reset: bool) -> Result<ZoneStore> {
        let zs = config.zone_size_bytes;
        if !is_valid_zone_size(zs) {
            return Err(Error::invalid(format!(
                "zone_size {zs}: must be a non-zero multiple of 1 MiB, at most {MAX_ZONE_SIZE_BYTES}"
            )));
        }
        let nr = backing.size_bytes() / zs;
        if nr < 3 {
            return Err(Error::invalid(format!(
                "backing device of {} bytes holds {nr} zones of {zs} bytes; zoned writeback needs \
                 at least 3",
                backing.size_bytes()
            )));
        }
        if config.gc_chunk_bytes == 0 || config.gc_chunk_bytes % PIECE_BYTES != 0 {
            return Err(Error::invalid(
                "gc chunk size must be a non-zero multiple of 4 KiB",
            ));
        }
        ring::new_scratch(
            config.scratch_mode,
            config.gc_buffers,
            config.gc_buffer_bytes,
        )?;
        let (capacity_bytes, device_seq) = match backing.zone_geometry() {
            None => (zs, None),
            Some(g) => {
                if g.zone_size_bytes != zs {
                    return Err(Error::invalid(format!(
                        "zone_size {zs}: the zoned backing device {} has zones of {} bytes",
                        backing.describe(),
                        g.zone_size_bytes
                    )));
                }
                let capacity = g.zone_capacity_bytes / PIECE_BYTES as u64 * PIECE_BYTES as u64;
                // GC's chunk bound (an eighth of a zone) and victim policy (a quarter of it
                // reclaimable) are fractions of the zone size: most of a zone must be usable.
                if capacity < zs / 2 {
                    return Err(Error::invalid(format!(
                        "the zoned backing device {} has zones of {zs} bytes holding only \
                         {capacity}: at least half a zone must be writable",
                        backing.describe()
                    )));
                }
                // Writeback's zone, GC's zone, and a zone just closed whose last writes are
                // still in flight (it is finished when they complete) may all be active.
                if (1..3).contains(&g.max_active_zones) {
                    return Err(Error::new(
                        crate::error::ErrorKind::Unsupported,
                        format!(
                            "the zoned backing device {} allows {} active zones; zoned \
                             writeback needs 3",
                            backing.describe(),
                            g.max_active_zones
                        ),
                    ));
                }
                let report = backing.report_zones()?;
                let mut seq = Vec::with_capacity(nr as usize);
                for (i, info) in report.iter().take(nr as usize).enumerate() {
                    if info.unusable {
                        return Err(Error::new(
                            crate::error::ErrorKind::Unsupported,
                            format!("zone {i} of {} is read-only or offline", backing.describe()),
                        ));
                    }
                    let has_wp = info.kind != crate::backing::ZoneKind::Conventional;
                    if reset && has_wp && !info.empty {
                        backing.reset_zone(info.start_bytes, info.len_bytes)?;
                    }
                    seq.push(has_wp);
                }
                if seq.len() < nr as usize {
                    return Err(Error::invalid(format!(
                        "{} reported {} zones, expected {nr}",
                        backing.describe(),
                        seq.len()
                    )));
                }
                (capacity, Some(seq))
            }
        };
        Ok(ZoneStore {
            capacity_bytes,
            device_seq,
            backing,
            zones: Mutex::new(Zones {
                zones: (0..nr).map(|_| Zone::empty()).collect(),
                writer_zone: None,
                gc_zone: None,
                gc_pass: 0,
            }),
            config,
            counters: Counters::default(),
            gc_lock: Mutex::new(()),
            unpinned: Condvar::new(),
        })
    }

    /// The store a previous process left on `backing` (`docs/restart.md`), its zones to be
    /// rebuilt from the slots: [`claim`](Self::claim) each live record, then
    /// [`finish_recovery`](Self::finish_recovery). A zoned device's zones are left as they are
    /// until then (not reset: they hold the records).
    pub fn recovering(backing: Arc<dyn Backing>, config: ZoneConfig) -> Result<ZoneStore> {
        ZoneStore::open(backing, config, false)
    }

    /// Recovery: slot `slot` (a multi-page object's: its group's first) points at the record
    /// at `loc`: it is live. `Err` naming what is wrong if it lies outside the zones.
    pub fn claim(&self, loc: ZoneLoc, slot: u64) -> std::result::Result<(), String> {
        let mut z = self.zones.lock();
        let nr = z.zones.len();
        let Some(zone) = z.zones.get_mut(loc.zone as usize) else {
            return Err(format!("record {loc:?} is in zone {} of {nr}", loc.zone));
        };
        if loc.span_bytes == 0 || loc.offset_bytes + u64::from(loc.span_bytes) > self.capacity_bytes
        {
            return Err(format!(
                "record {loc:?} does not fit a zone of {} bytes",
                self.capacity_bytes
            ));
        }
        zone.records.push(Rec {
            offset_bytes: loc.offset_bytes,
            span_bytes: loc.span_bytes,
            slot,
            state: RecState::Live,
        });
        zone.live_bytes += u64::from(loc.span_bytes);
        Ok(())
    }

    /// Recovery: every live record claimed. A zone holding any is *full* (nothing is appended
    /// to it; GC reclaims it as any other), every other zone *empty* (what a dead process left
    /// there is garbage: records no slot named). On a zoned device the first are finished
    /// (their write pointers moved to the end, so they count against no open or active limit)
    /// and the others reset. `Err` if two claimed records overlap, or the device refuses.
    pub fn finish_recovery(&self) -> std::result::Result<(), String> {
        let mut z = self.zones.lock();
        for (i, zone) in z.zones.iter_mut().enumerate() {
            zone.records.sort_unstable_by_key(|r| r.offset_bytes);
            for w in zone.records.windows(2) {
                if w[0].offset_bytes + u64::from(w[0].span_bytes) > w[1].offset_bytes {
                    return Err(format!(
                        "zone {i}: the records of slots {} and {} overlap at byte {}",
                        w[0].slot, w[1].slot, w[1].offset_bytes
                    ));
                }
            }
        }
        for (i, zone) in z.zones.iter_mut().enumerate() {
            let live = !zone.records.is_empty();
            if self.device_seq.as_ref().is_some_and(|seq| seq[i]) {
                let (base, len) = (self.zone_base(i as u32), self.config.zone_size_bytes);
                let r = if live {
                    self.backing.finish_zone(base, len)
                } else {
                    self.backing.reset_zone(base, len)
                };
                r.map_err(|e| format!("zone {i}: {}", e.message()))?;
            }
            if live {
                zone.cond = ZoneCondition::Full;
                zone.wp_bytes = self.capacity_bytes;
            } else {
                zone.cond = ZoneCondition::Empty;
                zone.wp_bytes = 0;
            }
        }
        Ok(())
    }

    /// The settings.
    pub fn config(&self) -> &ZoneConfig {
        &self.config
    }

    /// The backing device.
    pub fn backing(&self) -> &Arc<dyn Backing> {
        &self.backing
    }

    /// Number of zones.
    pub fn nr_zones(&self) -> usize {
        self.zones.lock().zones.len()
    }

    fn zone_base(&self, zone: u32) -> u64 {
        u64::from(zone) * self.config.zone_size_bytes
    }

    /// Bytes a zone takes at most (its capacity on a zoned device, else its size).
    pub fn zone_capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn has_device_wp(&self, zone: u32) -> bool {
        self.device_seq
            .as_ref()
            .is_some_and(|seq| seq[zone as usize])
    }

    /// Stops appending to `zone` (it becomes full). On a zoned device a zone left below its
    /// capacity is finished, at once when no write into it is in flight, else by the last
    /// [`commit`](Self::commit) or [`abort`](Self::abort). Called under `zones`.
    fn mark_full(&self, z: &mut Zones, zone: u32) {
        if z.writer_zone == Some(zone) {
            z.writer_zone = None;
        }
        if z.gc_zone == Some(zone) {
            z.gc_zone = None;
        }
        let zr = &mut z.zones[zone as usize];
        if zr.cond != ZoneCondition::Open {
            return;
        }
        zr.cond = ZoneCondition::Full;
        if self.has_device_wp(zone) && zr.wp_bytes < self.capacity_bytes {
            zr.finish_due = true;
        }
        self.finish_if_due(z, zone);
    }

    /// Finishes `zone` on the device if that is due and nothing is in flight into it. A
    /// failure is ignored: the zone stays open on the device until GC resets it (the device
    /// may then refuse to open another when its limit is low). Called under `zones`: the
    /// ioctl is a metadata command, and this happens once per zone.
    fn finish_if_due(&self, z: &mut Zones, zone: u32) {
        let zr = &mut z.zones[zone as usize];
        if zr.finish_due && zr.pending == 0 {
            zr.finish_due = false;
            let _ = self
                .backing
                .finish_zone(self.zone_base(zone), self.config.zone_size_bytes);
        }
    }

    /// A write into `zone` failed: nothing more is appended to it (on a zoned device its
    /// write pointer is no longer where the store would write next).
    pub fn write_failed(&self, zone: u32) {
        let mut z = self.zones.lock();
        self.mark_full(&mut z, zone);
    }

    /// Opens an empty zone for `who`. The writer may not take the last empty zone: it is
    /// GC's, so GC can always make progress.
    fn open_zone(&self, z: &mut Zones, who: Opener) -> Result<u32> {
        let empty: Vec<usize> = (0..z.zones.len())
            .filter(|&i| z.zones[i].cond == ZoneCondition::Empty)
            .collect();
        let keep = if who == Opener::Writer { 1 } else { 0 };
        if empty.len() <= keep {
            return Err(Error::new(
                crate::error::ErrorKind::NoSpace,
                format!(
                    "zoned backing device full: {} empty zones{}",
                    empty.len(),
                    if keep > 0 {
                        " (one is kept for GC)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        let i = empty[0];
        z.zones[i].cond = ZoneCondition::Open;
        Ok(i as u32)
    }

    /// Reserves up to `want` bytes (at least `min`; both multiples of 4 KiB) at the write
    /// pointer of `who`'s open zone, opening another zone when this one has less than `min`
    /// left (the old one becomes full). Returns the zone, the offset in it and the length.
    fn reserve(&self, z: &mut Zones, who: Opener, want: u64, min: u64) -> Result<(u32, u64, u64)> {
        let zs = self.capacity_bytes;
        assert!(min <= want && want <= zs && min > 0);
        let cur = match who {
            Opener::Writer => z.writer_zone,
            Opener::Gc => z.gc_zone,
        };
        let zone = match cur {
            Some(i) if z.zones[i as usize].wp_bytes + min <= zs => i,
            _ => {
                let i = self.open_zone(z, who)?;
                if let Some(old) = cur {
                    self.mark_full(z, old);
                }
                match who {
                    Opener::Writer => z.writer_zone = Some(i),
                    Opener::Gc => z.gc_zone = Some(i),
                }
                i
            }
        };
        let pass = z.gc_pass;
        let zr = &mut z.zones[zone as usize];
        if who == Opener::Gc {
            zr.gc_pass = pass;
        }
        let off = zr.wp_bytes;
        let len = want.min(zs - off);
        zr.wp_bytes += len;
        Ok((zone, off, len))
    }

    /// A writer for writeback, staging `stage_bytes` (a multiple of 4 KiB, at least 128 KiB
    /// is the point) per write.
    pub fn writer(self: &Arc<Self>, stage_bytes: usize) -> Result<ZoneWriter> {
        if stage_bytes == 0 || stage_bytes % PIECE_BYTES != 0 {
            return Err(Error::invalid(
                "stage size must be a non-zero multiple of 4 KiB",
            ));
        }
        Ok(ZoneWriter {
            store: Arc::clone(self),
            stage_bytes: stage_bytes.min(self.capacity_bytes as usize),
            stage: None,
            ready: std::collections::VecDeque::new(),
            spare: Vec::new(),
        })
    }

    /// Marks the pending record at `loc` live (its write completed and a slot points at it).
    pub fn commit(&self, loc: ZoneLoc) {
        let mut z = self.zones.lock();
        let zone = &mut z.zones[loc.zone as usize];
        let r = zone.rec_mut(loc);
        assert_eq!(r.state, RecState::Pending, "commit of {loc:?}");
        r.state = RecState::Live;
        zone.pending -= 1;
        zone.live_bytes += u64::from(loc.span_bytes);
        self.finish_if_due(&mut z, loc.zone);
    }

    /// Marks the pending record at `loc` dead (its write failed or its slot moved on).
    pub fn abort(&self, loc: ZoneLoc) {
        let mut z = self.zones.lock();
        let zone = &mut z.zones[loc.zone as usize];
        let r = zone.rec_mut(loc);
        assert_eq!(r.state, RecState::Pending, "abort of {loc:?}");
        r.state = RecState::Dead;
        zone.pending -= 1;
        self.finish_if_due(&mut z, loc.zone);
    }

    /// Releases the live record at `loc` (its slot was overwritten, discarded or reset).
    /// Panics if it is not live: every record is released exactly once.
    pub fn release(&self, loc: ZoneLoc) {
        let mut z = self.zones.lock();
        let zone = &mut z.zones[loc.zone as usize];
        let r = zone.rec_mut(loc);
        assert_eq!(r.state, RecState::Live, "release of {loc:?}");
        r.state = RecState::Dead;
        zone.live_bytes -= u64::from(loc.span_bytes);
    }

    /// Pins the zone of the live record at `loc` for a read (see the module docs). The caller
    /// holds the lock of the slot that points at `loc`. Panics if the record is not live.
    pub fn pin(&self, loc: ZoneLoc) -> ZonePin<'_> {
        let mut z = self.zones.lock();
        let zone = &mut z.zones[loc.zone as usize];
        assert_eq!(zone.rec_mut(loc).state, RecState::Live, "pin of {loc:?}");
        zone.readers += 1;
        ZonePin { store: self, loc }
    }

    /// Waits until no reader pins `zone`, and returns the locked zone table.
    fn wait_unpinned(&self, zone: u32) -> parking_lot::MutexGuard<'_, Zones> {
        let mut z = self.zones.lock();
        while z.zones[zone as usize].readers > 0 {
            self.unpinned.wait(&mut z);
        }
        z
    }

    /// Reads and verifies the record of `slot` at `loc`; returns its header and payload.
    /// The caller keeps the zone from being reset meanwhile: it holds a [`ZonePin`] taken
    /// while `slot` pointed at `loc`, or the slot's lock (GC re-points slots under it before
    /// resetting a victim). A bad record (magic, slot, length or CRC) is `EIO`, counted in
    /// [`checksum_errors`](Self::checksum_errors) and logged once per store.
    pub fn read_record(&self, loc: ZoneLoc, slot: u64) -> Result<(RecordHeader, Vec<u8>)> {
        let mut buf = AlignedBuf::new_zeroed(loc.span_bytes as usize)?;
        let offset = self.zone_base(loc.zone) + loc.offset_bytes;
        self.backing.read_at(&mut buf, offset)?;
        let (h, payload) = record::decode(&buf, slot).map_err(|e| {
            self.counters.mismatches.note(
                &self.backing.describe(),
                offset,
                &format!("zoned record of slot {slot}"),
                e.message(),
            )
        })?;
        Ok((h, payload.to_vec()))
    }

    /// Record reads whose record did not verify, since the store was made.
    pub fn checksum_errors(&self) -> u64 {
        self.counters.mismatches.count()
    }

    /// Whether GC should run: fewer than `gc_free_zones` zones are empty.
    pub fn needs_gc(&self) -> bool {
        let z = self.zones.lock();
        z.zones
            .iter()
            .filter(|zone| zone.cond == ZoneCondition::Empty)
            .count()
            < self.config.gc_free_zones
    }

    /// Counters for `zone_stat`.
    pub fn stats(&self) -> ZoneStats {
        let z = self.zones.lock();
        let mut s = ZoneStats::default();
        for zone in &z.zones {
            match zone.cond {
                ZoneCondition::Empty => s.empty += 1,
                ZoneCondition::Open => s.open += 1,
                ZoneCondition::Full => s.full += 1,
            }
            s.live_bytes += zone.live_bytes;
        }
        s.writeback_bytes = self.counters.writeback_bytes.load(Ordering::Relaxed);
        s.gc_runs = self.counters.gc_runs.load(Ordering::Relaxed);
        s.gc_bytes_relocated = self.counters.gc_bytes_relocated.load(Ordering::Relaxed);
        s.gc_bytes_written = self.counters.gc_bytes_written.load(Ordering::Relaxed);
        s
    }

    /// Each zone's condition, write pointer and live bytes (for tests and `zone_stat`'s
    /// detail).
    pub fn zone_report(&self) -> Vec<(ZoneCondition, u64, u64)> {
        let z = self.zones.lock();
        z.zones
            .iter()
            .map(|zone| (zone.cond, zone.wp_bytes, zone.live_bytes))
            .collect()
    }

    /// Checks the bookkeeping (live and pending counts agree with the record lists, records
    /// lie below the write pointer without overlapping) and, on a zoned block device, that
    /// the device agrees: an empty zone is empty there, an open one with nothing in flight has
    /// the same write pointer, a full one is full. For tests.
    pub fn check(&self) {
        let device = if self.device_seq.is_some() {
            Some(self.backing.report_zones().expect("reporting zones"))
        } else {
            None
        };
        let z = self.zones.lock();
        if let Some(report) = &device {
            for (i, zone) in z.zones.iter().enumerate() {
                if !self.has_device_wp(i as u32) || zone.pending > 0 {
                    continue;
                }
                let d = &report[i];
                match zone.cond {
                    ZoneCondition::Empty => assert!(d.empty, "zone {i}: empty here, {d:?}"),
                    ZoneCondition::Open => assert_eq!(
                        d.wp_bytes, zone.wp_bytes,
                        "zone {i}: write pointer here and on the device ({d:?})"
                    ),
                    // Nothing in flight: a zone left below its capacity has been finished.
                    ZoneCondition::Full => assert!(
                        d.full && !zone.finish_due,
                        "zone {i}: full here (wp {}), {d:?}",
                        zone.wp_bytes
                    ),
                }
            }
        }
        for (i, zone) in z.zones.iter().enumerate() {
            let live: u64 = zone
                .records
                .iter()
                .filter(|r| r.state == RecState::Live)
                .map(|r| u64::from(r.span_bytes))
                .sum();
            let pending = zone
                .records
                .iter()
                .filter(|r| r.state == RecState::Pending)
                .count();
            assert_eq!(live, zone.live_bytes, "zone {i} live bytes");
            assert_eq!(pending as u32, zone.pending, "zone {i} pending");
            let mut end = 0;
            for r in &zone.records {
                assert!(r.offset_bytes >= end, "zone {i}: overlapping records");
                end = r.offset_bytes + u64::from(r.span_bytes);
            }
            assert!(
                end <= zone.wp_bytes,
                "zone {i}: record past the write pointer"
            );
            if zone.cond == ZoneCondition::Empty {
                assert!(zone.records.is_empty() && zone.wp_bytes == 0, "zone {i}");
            }
        }
    }
}

/// A staged write: records placed in `buf`, to be written at `zone`/`offset`.
#[derive(Debug)]
struct Stage {
    zone: u32,
    offset_bytes: u64,
    /// Bytes reserved in the zone (the buffer may be larger).
    reserved_bytes: usize,
    buf: AlignedBuf,
    used: usize,
    records: Vec<(u64, ZoneLoc)>,
}

/// A write of staged records, ready for the batched engine. Once its op completes, the
/// caller commits or aborts each record and may give the buffers back with
/// [`ZoneWriter::recycle`].
#[derive(Debug)]
pub struct StagedWrite {
    /// The sequential write (absolute offset on the backing device), a multiple of 4 KiB.
    pub op: IoOp,
    /// The records it carries: slot and location.
    pub records: Vec<(u64, ZoneLoc)>,
}

/// Appends records to the writeback zone in stages; owned by one writeback task.
///
/// [`append`](Self::append) places a record in the current stage; a stage that cannot take
/// the next record is closed and queued as a [`StagedWrite`] ([`take_ready`](Self::take_ready));
/// [`finish`](Self::finish) closes the current stage at the end of a writeback pass. Every
/// record handed out must be committed or aborted once its write completes.
#[derive(Debug)]
pub struct ZoneWriter {
    store: Arc<ZoneStore>,
    stage_bytes: usize,
    stage: Option<Stage>,
    ready: std::collections::VecDeque<StagedWrite>,
    spare: Vec<AlignedBuf>,
}

impl ZoneWriter {
    /// Appends a record of `slot` to the current stage and returns its location (pending).
    /// `ENOSPC` when no zone has room; nothing is appended then (earlier stages stay ready).
    pub fn append(&mut self, slot: u64, prio: u8, flags: u8, payload: &[u8]) -> Result<ZoneLoc> {
        let span = record_span_bytes(payload.len());
        if self
            .stage
            .as_ref()
            .is_some_and(|s| s.used + span > s.reserved_bytes)
        {
            self.close_stage();
        }
        if self.stage.is_none() {
            let min = span.next_multiple_of(PIECE_BYTES) as u64;
            let (zone, off, len) = {
                let mut z = self.store.zones.lock();
                self.store
                    .reserve(&mut z, Opener::Writer, self.stage_bytes as u64, min)?
            };
            let buf = match self.spare.pop() {
                Some(b) => b,
                None => AlignedBuf::new_zeroed(self.stage_bytes)?,
            };
            self.stage = Some(Stage {
                zone,
                offset_bytes: off,
                reserved_bytes: len as usize,
                buf,
                used: 0,
                records: Vec::new(),
            });
        }
        let st = self.stage.as_mut().expect("a stage is open");
        let loc = ZoneLoc {
            zone: st.zone,
            offset_bytes: st.offset_bytes + st.used as u64,
            span_bytes: span as u32,
        };
        let header = RecordHeader {
            slot,
            len_bytes: payload.len() as u32,
            prio,
            flags,
        };
        record::encode(&header, payload, &mut st.buf[st.used..]);
        st.used += span;
        st.records.push((slot, loc));
        let mut z = self.store.zones.lock();
        let zone = &mut z.zones[loc.zone as usize];
        zone.records.push(Rec {
            offset_bytes: loc.offset_bytes,
            span_bytes: loc.span_bytes,
            slot,
            state: RecState::Pending,
        });
        zone.pending += 1;
        Ok(loc)
    }

    /// Closes the current stage: its unused reservation goes back to the zone (only the writer
    /// appends to its zone, so the stage is the zone's last reservation).
    fn close_stage(&mut self) {
        let Some(mut st) = self.stage.take() else {
            return;
        };
        let len = st.used.next_multiple_of(PIECE_BYTES);
        {
            let mut z = self.store.zones.lock();
            let zone = &mut z.zones[st.zone as usize];
            debug_assert_eq!(zone.wp_bytes, st.offset_bytes + st.reserved_bytes as u64);
            zone.wp_bytes = st.offset_bytes + len as u64;
        }
        if len == 0 {
            self.spare.push(st.buf);
            return;
        }
        st.buf[st.used..len].fill(0);
        let data = if len == st.buf.len() {
            st.buf
        } else {
            // The tail stage of a pass: write only what it holds (the buffer is reused).
            let copy = AlignedBuf::from_slice(&st.buf[..len]).expect("allocating a stage");
            self.spare.push(st.buf);
            copy
        };
        self.ready.push_back(StagedWrite {
            op: IoOp::new(
                self.store.zone_base(st.zone) + st.offset_bytes,
                vec![data],
                0,
            ),
            records: st.records,
        });
    }

    /// A stage's write of `bytes` completed: counted in `writeback_bytes` (only completed
    /// writes count, so `write_amplification` is of what reached the device).
    pub fn written(&self, bytes: u64) {
        self.store
            .counters
            .writeback_bytes
            .fetch_add(bytes, Ordering::Relaxed);
    }

    /// The next closed stage to write, if any.
    pub fn take_ready(&mut self) -> Option<StagedWrite> {
        self.ready.pop_front()
    }

    /// Closes the current stage (end of a writeback pass); its write comes from
    /// [`take_ready`](Self::take_ready).
    pub fn finish(&mut self) {
        self.close_stage();
    }

    /// Gives a completed write's buffers back for later stages.
    pub fn recycle(&mut self, op: IoOp) {
        for b in op.bufs {
            if b.len() == self.stage_bytes && self.spare.len() < 64 {
                self.spare.push(b);
            }
        }
    }
}

#[cfg(test)]
mod tests;
