//! [`ModelBacking`]: wraps any [`Backing`] and makes each request take the time a modelled
//! device would: seek time from the distance between requests, rotational latency, a media
//! transfer rate, one request at a time per actuator. For benchmarks of I/O patterns whose
//! cost depends on the device (`uzram bench gc --device-model smr-hdd|smr-hdd-no-cache|ssd`): the zoned GC's
//! scratch ring pays where the scratch is smaller than the device's bandwidth-delay product,
//! which the host's virtual SSD never shows (bench/notes.md, "Under a device model").
//!
//! # The model
//!
//! A request of `len` bytes at `offset` is served after the previous one (requests queue
//! behind the *actuator*, a mutex held for the whole service time, synchronous calls and
//! queued ops alike). Queued ops are served by one thread per queue. With `queue_depth` 1 it
//! serves them in submission order; above 1 it is a drive's command queue (SATA NCQ holds 32):
//! of the first `queue_depth` ops waiting, it serves the one with the shortest positioning
//! time from the head (rotational position ordering), except that writes keep their order
//! among themselves (the only one eligible is the oldest), as writes into a sequential zone of
//! an SMR drive must. Its service time is
//!
//! - `command_overhead` (controller time, every request), plus
//! - positioning, from the distance `d` between `offset` and where the last request ended
//!   (the head):
//!   - `d == 0` (sequential): nothing;
//!   - `0 < d <= track_bytes` forward: the gap passes under the head, `d / media_rate` (or
//!     the seek below if that is quicker);
//!   - otherwise a seek and the average rotational latency (half a revolution):
//!     `single_track_seek + (full_stroke_seek - single_track_seek) * sqrt(d / capacity)`
//!     (the usual square-root seek curve: the arm accelerates for half the distance) plus
//!     `30 / rpm` seconds;
//! - plus the transfer, `len / media_rate`.
//!
//! The inner backing really does the I/O meanwhile (the data are real); the request returns
//! when both the inner I/O and the modelled time are over, so the inner device's own time is
//! hidden unless it is slower than the model. Times are slept, not simulated: the code under
//! test runs as it would against a slow device. The media (and the interface) keep a modelled
//! clock: an access starts when the previous one ends in modelled time or when its request
//! arrived (was submitted), whichever is later, so a sleep that overshoots on a loaded host
//! (0.5–1 ms per request here) delays that request's completion but not the device's schedule
//! for the requests already queued behind it.
//!
//! # Write-back cache
//!
//! With `write_cache_bytes > 0` (a drive's volatile write cache, on by default in SATA and SAS
//! drives), a write of at most that size does not wait for the media: it costs
//! `command_overhead` plus its bytes over the interface (`interface_bytes_per_sec`), is
//! written to the inner backing, and is acknowledged once its bytes are counted dirty in the
//! cache. If the cache has no room the write waits until the destager makes some (the
//! drive's "cache full": its queue stalls; reads queued behind it wait too, a simplification).
//! A read whose every byte is dirty in the cache is served from it (`command_overhead` plus
//! the interface time); any other read goes to the media, after whatever media access is in
//! progress.
//!
//! The *destager*, a thread of its own, writes dirty bytes to the media oldest first, up to
//! `destage_bytes` per media access (positioning from the head, then the transfer; contiguous
//! writes were merged into one extent, so a sequential zone's writes destage at the media
//! rate), once the head has been idle (no read submitted and not yet served) for
//! `destage_idle`, and at once while a write waits for room or a `flush` for the cache to
//! empty (SYNCHRONIZE CACHE: `flush` returns when nothing is dirty). A read arriving during a destage waits for that access to
//! end, as on a drive that finishes the segment it is writing. Without a cache `flush` adds
//! nothing: a write is on the media when it completes.
//!
//! # Presets ([`DeviceModel::by_name`])
//!
//! - `smr-hdd`: a 3.5" 7200 rpm capacity drive, the mechanics of the Western Digital Ultrastar
//!   DC HC310 OEM specification (rev. 1.4, 2018, section 4.5.1: average seek 7.4 ms read /
//!   8.2 ms write, single-track 0.23 / 0.32 ms, average latency 4.16 ms at 7200 rpm), which
//!   the host-managed SMR Ultrastar DC HC620 shares; 14 TB (the HC620's capacity) for the seek
//!   curve; a media rate of 200 MB/s, the figure the zoned XFS GC measurements were described
//!   with (SMR drives of this class quote 200–255 MB/s sustained); track 1.6 MB
//!   (200 MB/s × 8.33 ms per revolution). The full-stroke seek is derived from the average:
//!   for uniformly random pairs of positions `E[sqrt(d/capacity)] = 8/15`, so
//!   `full = single + (average - single) * 15/8` (13.7 ms read, 15.0 ms write). Reads and
//!   writes use the write figures (GC writes as much as it reads; the 10% difference is below
//!   what the benchmark resolves). Write-back cache of 512 MiB: the HC620's (Ultrastar Hs14
//!   at its launch, 2017: a 512 MB cache, twice the 256 MB of the CMR drives of its family,
//!   "because SMR slows writes down", with 233 MB/s sustained; how much of the buffer the
//!   firmware gives to dirty writes is not published: all of it is the optimistic end); the
//!   link at 600 MB/s (SATA 6 Gb/s after 8b/10b coding; the HC620's SAS 12 Gb/s would be
//!   twice that, which changes nothing at a 200 MB/s media rate); destaged 1 MiB per media
//!   access (an assumption: about a sixth of a track, so a read waits at most ~5 ms behind a
//!   destage); destaging on its own after 2 ms without a read (an assumption too: data sheets
//!   say only that a drive destages "when idle"; 2 ms is long against a host's turnaround
//!   from one read's completion to the next submission, tens of microseconds, so the model
//!   does not destage into those gaps; `bench gc` prints the destages it saw).
//! - `smr-hdd-no-cache`: the same drive with its write cache off (writes complete on the
//!   media; what `smr-hdd` was before the cache was modelled, kept for comparison).
//! - `ssd`: a SATA SSD: 520 MB/s (the SATA 6 Gb/s link's practical ceiling, what SATA SSD
//!   datasheets quote sequentially) and 80 µs per command (a 4 KiB read at queue depth 1 in
//!   about 90 µs); no seek, no rotation; no write cache modelled (an SSD's is its flash
//!   translation layer's business: the 520 MB/s is already what the host sees).
//!
//! [`ModelBacking::stats`] counts requests, seeks, the modelled busy time and the cache's
//! work (writes acknowledged from it, waits for room, reads served from it, destages), so a
//! benchmark can check the model did what it claims.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{check_depth, check_range, check_submit, total_len};
use super::{Backing, IoCompletion, IoKind, IoOp, IoQueue, SubmitResult};
use crate::error::{Error, Result};

/// A device's timing parameters (see the module docs for the formulas and the presets'
/// sources).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceModel {
    /// The preset's name, or `custom`.
    pub name: String,
    /// Controller time per request.
    pub command_overhead: Duration,
    /// A seek to the next track (the shortest seek), settling included.
    pub single_track_seek: Duration,
    /// A seek across the whole `capacity_bytes`.
    pub full_stroke_seek: Duration,
    /// Spindle speed; 0: no rotational latency (solid state).
    pub rpm: f64,
    /// Media transfer rate, bytes per second.
    pub media_bytes_per_sec: f64,
    /// Bytes under the head in one revolution: a forward skip up to this far costs the time
    /// the gap takes to pass, not a seek.
    pub track_bytes: u64,
    /// The modelled device's capacity, for the seek curve (the wrapped backing may be much
    /// smaller: a few zones of a large disk).
    pub capacity_bytes: u64,
    /// Queued ops the device chooses among (its command queue); 1: in submission order.
    pub queue_depth: usize,
    /// Write-back cache: a write no larger than this is acknowledged once its bytes crossed
    /// the interface, and destaged to the media later (module docs, "Write-back cache"); 0:
    /// no cache, a write completes when it is on the media.
    pub write_cache_bytes: u64,
    /// The host interface's rate, bytes per second: what a write into the cache or a read
    /// served from it costs besides `command_overhead`.
    pub interface_bytes_per_sec: f64,
    /// The most the cache destages in one go (one media access; a read that arrives meanwhile
    /// waits for it to end).
    pub destage_bytes: u64,
    /// How long the head must have been idle (no read pending) before the cache destages on
    /// its own (a full cache or a flush destages at once).
    pub destage_idle: Duration,
}

impl DeviceModel {
    /// A host-managed SMR hard disk with its write-back cache (module docs, "Presets").
    pub fn smr_hdd() -> DeviceModel {
        DeviceModel {
            name: "smr-hdd".into(),
            write_cache_bytes: 512 << 20,
            ..DeviceModel::smr_hdd_no_cache()
        }
    }

    /// The same disk with its write cache off: a write completes once it is on the media
    /// (module docs, "Presets").
    pub fn smr_hdd_no_cache() -> DeviceModel {
        let single = Duration::from_micros(320);
        let average = Duration::from_micros(8200);
        DeviceModel {
            name: "smr-hdd-no-cache".into(),
            command_overhead: Duration::from_micros(50),
            single_track_seek: single,
            full_stroke_seek: single + (average - single) * 15 / 8,
            rpm: 7200.0,
            media_bytes_per_sec: 200e6,
            track_bytes: 1_600_000,
            capacity_bytes: 14_000_000_000_000,
            queue_depth: 32,
            write_cache_bytes: 0,
            interface_bytes_per_sec: 600e6,
            destage_bytes: 1 << 20,
            destage_idle: Duration::from_millis(2),
        }
    }

    /// A SATA SSD (module docs, "Presets").
    pub fn ssd() -> DeviceModel {
        DeviceModel {
            name: "ssd".into(),
            command_overhead: Duration::from_micros(80),
            single_track_seek: Duration::ZERO,
            full_stroke_seek: Duration::ZERO,
            rpm: 0.0,
            media_bytes_per_sec: 520e6,
            track_bytes: u64::MAX,
            capacity_bytes: 1 << 40,
            queue_depth: 1,
            write_cache_bytes: 0,
            interface_bytes_per_sec: 600e6,
            destage_bytes: 1 << 20,
            destage_idle: Duration::from_millis(2),
        }
    }

    /// The preset called `name` (`smr-hdd`, `smr-hdd-no-cache`, `ssd`); `EINVAL` for others.
    pub fn by_name(name: &str) -> Result<DeviceModel> {
        match name {
            "smr-hdd" => Ok(DeviceModel::smr_hdd()),
            "smr-hdd-no-cache" => Ok(DeviceModel::smr_hdd_no_cache()),
            "ssd" => Ok(DeviceModel::ssd()),
            _ => Err(Error::invalid(format!(
                "unknown device model {name:?}: smr-hdd, smr-hdd-no-cache or ssd"
            ))),
        }
    }

    /// Time to move `len_bytes` over the host interface.
    pub fn interface_time(&self, len_bytes: u64) -> Duration {
        Duration::from_secs_f64(len_bytes as f64 / self.interface_bytes_per_sec)
    }

    /// Half a revolution: the average wait for the sector after a seek.
    pub fn average_rotational_latency(&self) -> Duration {
        if self.rpm > 0.0 {
            Duration::from_secs_f64(30.0 / self.rpm)
        } else {
            Duration::ZERO
        }
    }

    /// Time to move `len_bytes` past the head.
    pub fn transfer_time(&self, len_bytes: u64) -> Duration {
        Duration::from_secs_f64(len_bytes as f64 / self.media_bytes_per_sec)
    }

    /// Positioning time from a head at `head` to `offset` (module docs), and whether it was a
    /// seek.
    pub fn positioning_time(&self, head: u64, offset: u64) -> (Duration, bool) {
        if offset == head {
            return (Duration::ZERO, false);
        }
        let d = offset.abs_diff(head).min(self.capacity_bytes) as f64;
        let frac = (d / self.capacity_bytes as f64).sqrt();
        let seek = self.single_track_seek
            + (self.full_stroke_seek.saturating_sub(self.single_track_seek)).mul_f64(frac)
            + self.average_rotational_latency();
        if offset > head && offset - head <= self.track_bytes {
            // Waiting for the gap to pass, unless a seek is quicker.
            let pass = self.transfer_time(offset - head);
            if pass <= seek {
                return (pass, false);
            }
        }
        (seek, true)
    }

    /// The whole service time of a request of `len_bytes` at `offset` with the head at `head`.
    pub fn service_time(&self, head: u64, offset: u64, len_bytes: u64) -> (Duration, bool) {
        let (pos, seek) = self.positioning_time(head, offset);
        (
            self.command_overhead + pos + self.transfer_time(len_bytes),
            seek,
        )
    }
}

/// What the model has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelStats {
    /// Requests served (synchronous and queued), from the media or the cache.
    pub requests: u64,
    /// Of them, those that needed a seek and rotational latency (destages included).
    pub seeks: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Modelled time the media was busy (requests and destages), in microseconds.
    pub busy_us: u64,
    /// Writes acknowledged from the write-back cache.
    pub cached_writes: u64,
    /// Of them, writes that first waited for the cache to make room.
    pub cache_full_waits: u64,
    /// Reads served from the write-back cache (every byte still dirty there).
    pub cache_read_hits: u64,
    /// Media accesses that destaged the cache, and the bytes they wrote.
    pub destages: u64,
    /// Bytes destaged.
    pub destaged_bytes: u64,
}

/// The actuator: where the head is. Its mutex is held for a media access's whole service
/// time, so the media serves one request (or one destage) at a time.
#[derive(Debug)]
struct Actuator {
    head: u64,
    /// When the last media access ends in modelled time. The next one starts then (or now,
    /// if that is later): a sleep that overshoots on a loaded host does not delay the accesses
    /// queued behind it.
    busy_until: Instant,
}

/// The write-back cache's books (module docs, "Write-back cache"). Protected by
/// [`Shared::cache`]; [`Shared::cache_cv`] is signalled on every change.
#[derive(Debug, Default)]
struct Cache {
    /// Dirty extents `(offset, len)` in the order they were written; contiguous appends
    /// merge into the last one. Only the destager removes from the front.
    dirty: std::collections::VecDeque<(u64, u64)>,
    /// Bytes in `dirty` (never above `write_cache_bytes`).
    dirty_bytes: u64,
    /// Reads submitted and not yet served: while any is, the head is not idle and the
    /// destager waits (unless a write waits for room or a flush for the cache to empty).
    reads_pending: usize,
    /// Writes waiting for room.
    space_waiters: usize,
    /// Flushes waiting for the cache to empty.
    flush_waiters: usize,
    /// When `reads_pending` last fell to 0 (the head's idle time starts).
    idle_since: Option<Instant>,
    /// Set when the backing drops: the destager ends.
    shutdown: bool,
}

impl Cache {
    /// Whether `offset..offset + len` lies inside one dirty extent.
    fn holds(&self, offset: u64, len: u64) -> bool {
        self.dirty
            .iter()
            .any(|&(o, l)| o <= offset && offset + len <= o + l)
    }
}

/// How long a write waits for cache room, or a flush for the cache to empty, before failing
/// with `EIO` (the destager is gone or stuck; cannot happen while it runs: the longest wait
/// is destaging the whole cache, about 2.7 s for 512 MiB at 200 MB/s plus a seek per extent).
const CACHE_WAIT_LIMIT: Duration = Duration::from_secs(120);

/// State shared by the backing, its queues' service threads and the destager.
#[derive(Debug)]
struct Shared {
    model: DeviceModel,
    actuator: Mutex<Actuator>,
    /// When the host interface is free again in modelled time (writes into the cache and
    /// reads from it cross it one at a time; the same clock as the actuator's).
    link_busy_until: Mutex<Instant>,
    cache: Mutex<Cache>,
    cache_cv: Condvar,
    requests: AtomicU64,
    seeks: AtomicU64,
    bytes: AtomicU64,
    busy_us: AtomicU64,
    cached_writes: AtomicU64,
    cache_full_waits: AtomicU64,
    cache_read_hits: AtomicU64,
    destages: AtomicU64,
    destaged_bytes: AtomicU64,
}

/// Sleeps until `start + service`.
fn sleep_until(start: Instant, service: Duration) {
    let deadline = start + service;
    let now = Instant::now();
    if deadline > now {
        std::thread::sleep(deadline - now);
    }
}

impl Shared {
    fn cached(&self) -> bool {
        self.model.write_cache_bytes > 0
    }

    /// Serves one request that reached the device at `arrival` from the media: takes the
    /// actuator, runs `io` (the inner backing's real I/O), then sleeps out the rest of the
    /// modelled service time, which starts when the media is free in modelled time or at
    /// `arrival`, whichever is later (module docs: the modelled clock).
    fn serve<T>(&self, arrival: Instant, offset: u64, len_bytes: u64, io: impl FnOnce() -> T) -> T {
        let mut act = self.actuator.lock();
        let start = act.busy_until.max(arrival);
        let (service, seek) = self.model.service_time(act.head, offset, len_bytes);
        let out = io();
        sleep_until(start, service);
        act.busy_until = start + service;
        act.head = offset + len_bytes;
        drop(act);
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.seeks.fetch_add(u64::from(seek), Ordering::Relaxed);
        self.bytes.fetch_add(len_bytes, Ordering::Relaxed);
        self.busy_us
            .fetch_add(service.as_micros() as u64, Ordering::Relaxed);
        out
    }

    /// Crosses the interface: `command_overhead` plus `len_bytes` at the interface's rate,
    /// on the link's modelled clock, running `io` meanwhile.
    fn over_link<T>(&self, arrival: Instant, len_bytes: u64, io: impl FnOnce() -> T) -> T {
        let mut link = self.link_busy_until.lock();
        let start = (*link).max(arrival);
        let service = self.model.command_overhead + self.model.interface_time(len_bytes);
        let out = io();
        sleep_until(start, service);
        *link = start + service;
        out
    }

    /// Counts a read as pending (`delta` 1, at submission) or no longer (-1, served): the
    /// destager treats the head as busy while any is.
    fn note_read(&self, pending: bool) {
        if !self.cached() {
            return;
        }
        let mut c = self.cache.lock();
        if pending {
            c.reads_pending += 1;
        } else {
            c.reads_pending -= 1;
            if c.reads_pending == 0 {
                c.idle_since = Some(Instant::now());
                self.cache_cv.notify_all();
            }
        }
    }

    /// Serves a read, counted pending by the caller ([`note_read`](Self::note_read)): from
    /// the cache when every byte is dirty there, else from the media.
    fn read<T>(&self, arrival: Instant, offset: u64, len_bytes: u64, io: impl FnOnce() -> T) -> T {
        let hit = self.cached() && self.cache.lock().holds(offset, len_bytes);
        let out = if hit {
            let out = self.over_link(arrival, len_bytes, io);
            self.requests.fetch_add(1, Ordering::Relaxed);
            self.bytes.fetch_add(len_bytes, Ordering::Relaxed);
            self.cache_read_hits.fetch_add(1, Ordering::Relaxed);
            out
        } else {
            self.serve(arrival, offset, len_bytes, io)
        };
        self.note_read(false);
        out
    }

    /// Serves a write: into the cache when there is one and the write fits in it (the bytes
    /// cross the interface, then the write is acknowledged; it waits for room first if the
    /// cache is full), else to the media. `ok` says whether `io`'s result is a success (a
    /// failed write leaves nothing dirty).
    fn write<T>(
        &self,
        arrival: Instant,
        offset: u64,
        len_bytes: u64,
        io: impl FnOnce() -> T,
        ok: impl FnOnce(&T) -> bool,
    ) -> std::result::Result<T, (Error, T)> {
        if !self.cached() || len_bytes > self.model.write_cache_bytes {
            return Ok(self.serve(arrival, offset, len_bytes, io));
        }
        let out = self.over_link(arrival, len_bytes, io);
        if !ok(&out) {
            return Ok(out);
        }
        let mut c = self.cache.lock();
        let limit = Instant::now() + CACHE_WAIT_LIMIT;
        if c.dirty_bytes + len_bytes > self.model.write_cache_bytes {
            self.cache_full_waits.fetch_add(1, Ordering::Relaxed);
            c.space_waiters += 1;
            self.cache_cv.notify_all();
            while c.dirty_bytes + len_bytes > self.model.write_cache_bytes {
                if self.cache_cv.wait_until(&mut c, limit).timed_out() || c.shutdown {
                    c.space_waiters -= 1;
                    return Err((Error::io("device model: the write cache made no room"), out));
                }
            }
            c.space_waiters -= 1;
        }
        match c.dirty.back_mut() {
            Some((o, l)) if *o + *l == offset => *l += len_bytes,
            _ => c.dirty.push_back((offset, len_bytes)),
        }
        c.dirty_bytes += len_bytes;
        self.cache_cv.notify_all();
        drop(c);
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(len_bytes, Ordering::Relaxed);
        self.cached_writes.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }

    /// Waits until the cache holds nothing dirty (a flush: SYNCHRONIZE CACHE); the destager
    /// works meanwhile whatever reads are pending.
    fn drain_cache(&self) -> Result<()> {
        if !self.cached() {
            return Ok(());
        }
        let mut c = self.cache.lock();
        let limit = Instant::now() + CACHE_WAIT_LIMIT;
        c.flush_waiters += 1;
        self.cache_cv.notify_all();
        let mut result = Ok(());
        while c.dirty_bytes > 0 {
            if self.cache_cv.wait_until(&mut c, limit).timed_out() || c.shutdown {
                result = Err(Error::io("device model: the write cache did not drain"));
                break;
            }
        }
        c.flush_waiters -= 1;
        result
    }

    /// The destager: while anything is dirty, writes the oldest dirty bytes to the media, up
    /// to `destage_bytes` at a time, when the head is idle (no read pending) or a write waits
    /// for room or a flush for the cache to empty. Ends at shutdown.
    fn destage(&self) {
        loop {
            let (offset, len) = {
                let mut c = self.cache.lock();
                loop {
                    if c.shutdown {
                        return;
                    }
                    let urgent = c.space_waiters > 0 || c.flush_waiters > 0;
                    if c.dirty_bytes > 0 && urgent {
                        break;
                    }
                    if c.dirty_bytes > 0 && c.reads_pending == 0 {
                        // Idle long enough?
                        let Some(since) = c.idle_since else {
                            break; // no read yet: idle from the start
                        };
                        let due = since + self.model.destage_idle;
                        if Instant::now() >= due {
                            break;
                        }
                        self.cache_cv.wait_until(&mut c, due);
                        continue;
                    }
                    self.cache_cv.wait(&mut c);
                }
                let (o, l) = *c.dirty.front().expect("dirty bytes are in extents");
                (o, l.min(self.model.destage_bytes))
            };
            // The media access: no command overhead (the drive's own work), the positioning
            // from wherever the head is, and the transfer.
            let mut act = self.actuator.lock();
            let start = act.busy_until.max(Instant::now());
            let (pos, seek) = self.model.positioning_time(act.head, offset);
            let service = pos + self.model.transfer_time(len);
            sleep_until(start, service);
            act.busy_until = start + service;
            act.head = offset + len;
            drop(act);
            self.seeks.fetch_add(u64::from(seek), Ordering::Relaxed);
            self.busy_us
                .fetch_add(service.as_micros() as u64, Ordering::Relaxed);
            self.destages.fetch_add(1, Ordering::Relaxed);
            self.destaged_bytes.fetch_add(len, Ordering::Relaxed);
            let mut c = self.cache.lock();
            let front = c.dirty.front_mut().expect("only the destager removes");
            front.0 += len;
            front.1 -= len;
            if front.1 == 0 {
                c.dirty.pop_front();
            }
            c.dirty_bytes -= len;
            self.cache_cv.notify_all();
        }
    }
}

/// A backing whose requests take the time a [`DeviceModel`] says (module docs).
pub struct ModelBacking {
    inner: Arc<dyn Backing>,
    shared: Arc<Shared>,
    /// The write cache's destager thread (models with a cache); joined on drop.
    destager: Option<std::thread::JoinHandle<()>>,
}

impl fmt::Debug for ModelBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelBacking")
            .field("inner", &self.inner)
            .field("model", &self.shared.model)
            .finish()
    }
}

impl ModelBacking {
    /// Wraps `inner` in `model`; the head starts at offset 0. A model with a write cache
    /// starts its destager thread (`EIO` if it cannot).
    pub fn new(inner: Arc<dyn Backing>, model: DeviceModel) -> Result<ModelBacking> {
        let cached = model.write_cache_bytes > 0;
        let shared = Arc::new(Shared {
            model,
            actuator: Mutex::new(Actuator {
                head: 0,
                busy_until: Instant::now(),
            }),
            link_busy_until: Mutex::new(Instant::now()),
            cache: Mutex::new(Cache::default()),
            cache_cv: Condvar::new(),
            requests: AtomicU64::new(0),
            seeks: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            busy_us: AtomicU64::new(0),
            cached_writes: AtomicU64::new(0),
            cache_full_waits: AtomicU64::new(0),
            cache_read_hits: AtomicU64::new(0),
            destages: AtomicU64::new(0),
            destaged_bytes: AtomicU64::new(0),
        });
        let destager = if cached {
            let s = Arc::clone(&shared);
            Some(
                std::thread::Builder::new()
                    .name("uzram-model-destage".into())
                    .spawn(move || s.destage())
                    .map_err(|e| Error::io(format!("device model: starting its destager: {e}")))?,
            )
        } else {
            None
        };
        Ok(ModelBacking {
            inner,
            shared,
            destager,
        })
    }

    /// The model in force.
    pub fn model(&self) -> &DeviceModel {
        &self.shared.model
    }

    /// Counters since creation.
    pub fn stats(&self) -> ModelStats {
        let s = &self.shared;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ModelStats {
            requests: get(&s.requests),
            seeks: get(&s.seeks),
            bytes: get(&s.bytes),
            busy_us: get(&s.busy_us),
            cached_writes: get(&s.cached_writes),
            cache_full_waits: get(&s.cache_full_waits),
            cache_read_hits: get(&s.cache_read_hits),
            destages: get(&s.destages),
            destaged_bytes: get(&s.destaged_bytes),
        }
    }

    /// Bytes in the write cache not yet on the media.
    pub fn dirty_bytes(&self) -> u64 {
        self.shared.cache.lock().dirty_bytes
    }
}

impl Drop for ModelBacking {
    /// Stops the destager (what is still dirty is in the inner backing already: the model
    /// only times the media).
    fn drop(&mut self) {
        self.shared.cache.lock().shutdown = true;
        self.shared.cache_cv.notify_all();
        if let Some(t) = self.destager.take() {
            let _ = t.join();
        }
    }
}

impl Backing for ModelBacking {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size_bytes(), offset, buf.len() as u64, "read")?;
        self.shared.note_read(true);
        self.shared
            .read(Instant::now(), offset, buf.len() as u64, || {
                self.inner.read_at(buf, offset)
            })
    }

    fn readv_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> Result<()> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        check_range(self.size_bytes(), offset, total, "read")?;
        self.shared.note_read(true);
        self.shared.read(Instant::now(), offset, total, || {
            self.inner.readv_at(bufs, offset)
        })
    }

    fn writev_at(&self, bufs: &[&[u8]], offset: u64) -> Result<()> {
        let total = total_len(bufs);
        check_range(self.size_bytes(), offset, total, "write")?;
        match self.shared.write(
            Instant::now(),
            offset,
            total,
            || self.inner.writev_at(bufs, offset),
            |r| r.is_ok(),
        ) {
            Ok(r) => r,
            Err((e, _)) => Err(e),
        }
    }

    /// Drains the write cache (every dirty byte to the media, in the modelled time), then
    /// flushes the inner backing.
    fn flush(&self) -> Result<()> {
        self.shared.drain_cache()?;
        self.inner.flush()
    }

    fn describe(&self) -> String {
        format!(
            "{} (modelled as {})",
            self.inner.describe(),
            self.shared.model.name
        )
    }

    fn new_queue(&self, depth: usize) -> Result<Box<dyn IoQueue + '_>> {
        check_depth(depth)?;
        let (to_server, requests) = mpsc::channel::<(IoOp, Instant)>();
        let (done, completions) = mpsc::channel::<IoCompletion>();
        let inner = Arc::clone(&self.inner);
        let shared = Arc::clone(&self.shared);
        let server = std::thread::Builder::new()
            .name("uzram-model-io".into())
            .spawn(move || serve_queue(inner.as_ref(), &shared, &requests, &done))
            .map_err(|e| Error::io(format!("device model: starting its queue thread: {e}")))?;
        Ok(Box::new(ModelQueue {
            depth,
            size_bytes: self.size_bytes(),
            shared: Arc::clone(&self.shared),
            in_flight: 0,
            to_server: Some(to_server),
            completions,
            server: Some(server),
        }))
    }
}

/// The service thread of one [`ModelQueue`]: serves ops through the inner backing's own
/// queue (depth 1: one request at a time), until the queue drops. Of the first
/// `queue_depth` ops waiting it picks, with a write cache, the oldest write (accepting a
/// write takes no head movement), else the op with the shortest positioning time from the
/// head, writes kept in their order (module docs).
fn serve_queue(
    inner: &dyn Backing,
    shared: &Shared,
    requests: &mpsc::Receiver<(IoOp, Instant)>,
    done: &mpsc::Sender<IoCompletion>,
) {
    let mut queue = match inner.new_queue(1) {
        Ok(q) => q,
        Err(e) => {
            // Every op fails with the reason, so nothing waits forever.
            let msg = e.to_string();
            for (op, _) in requests.iter() {
                if op.kind == IoKind::Read {
                    shared.note_read(false);
                }
                let _ = done.send(IoCompletion {
                    op,
                    result: Err(Error::io(format!("device model: inner queue: {msg}"))),
                });
            }
            return;
        }
    };
    let depth = shared.model.queue_depth.max(1);
    let mut waiting: std::collections::VecDeque<(IoOp, Instant)> =
        std::collections::VecDeque::new();
    loop {
        if waiting.is_empty() {
            match requests.recv() {
                Ok(op) => waiting.push_back(op),
                Err(_) => return, // the queue dropped and everything was served
            }
        }
        while waiting.len() < depth {
            match requests.try_recv() {
                Ok(op) => waiting.push_back(op),
                Err(_) => break,
            }
        }
        let first_write = waiting.iter().position(|(op, _)| op.kind == IoKind::Write);
        let pick = match first_write {
            Some(w) if shared.cached() => w,
            _ => {
                let head = shared.actuator.lock().head;
                (0..waiting.len())
                    .filter(|&i| waiting[i].0.kind != IoKind::Write || Some(i) == first_write)
                    .min_by_key(|&i| shared.model.positioning_time(head, waiting[i].0.offset).0)
                    .expect("a waiting op is eligible")
            }
        };
        let (op, arrival) = waiting.remove(pick).expect("picked from the list");
        let (offset, len) = (op.offset, op.len_bytes());
        let completion = if op.kind == IoKind::Read {
            shared.read(arrival, offset, len, || run_one(queue.as_mut(), op))
        } else {
            match shared.write(
                arrival,
                offset,
                len,
                || run_one(queue.as_mut(), op),
                |c| c.result.is_ok(),
            ) {
                Ok(c) => c,
                Err((e, c)) => IoCompletion {
                    op: c.op,
                    result: Err(e),
                },
            }
        };
        if done.send(completion).is_err() {
            return;
        }
    }
}

/// Runs `op` on `queue` (depth 1) to completion.
fn run_one(queue: &mut dyn IoQueue, op: IoOp) -> IoCompletion {
    if let Err((e, op)) = queue.submit(op) {
        return IoCompletion { op, result: Err(e) };
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match queue.wait(1) {
            Ok(mut done) if !done.is_empty() => return done.remove(0),
            // The inner queue could not be waited on: its op stays with it (never freed
            // while the kernel may use it). Retry for a while, then end the thread: the
            // queue's `wait` then fails ("its queue thread ended") instead of hanging.
            Ok(_) | Err(_) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(_) | Err(_) => panic!("device model: the inner queue gives no completion"),
        }
    }
}

/// Queued ops for a [`ModelBacking`]: handed to its service thread, completed as it serves
/// them.
struct ModelQueue {
    depth: usize,
    size_bytes: u64,
    shared: Arc<Shared>,
    in_flight: usize,
    /// `None` once dropping (the service thread then ends after the ops it has). Each op
    /// goes with the time it was submitted (its arrival at the device).
    to_server: Option<mpsc::Sender<(IoOp, Instant)>>,
    completions: mpsc::Receiver<IoCompletion>,
    server: Option<std::thread::JoinHandle<()>>,
}

impl fmt::Debug for ModelQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelQueue")
            .field("depth", &self.depth)
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl IoQueue for ModelQueue {
    fn depth(&self) -> usize {
        self.depth
    }

    fn submit(&mut self, op: IoOp) -> SubmitResult {
        if let Err(e) = check_submit(&op, self.in_flight, self.depth, self.size_bytes) {
            return Err((e, op));
        }
        let read = op.kind == IoKind::Read;
        if read {
            // Pending from now: the drive knows of it once it is queued.
            self.shared.note_read(true);
        }
        let tx = self.to_server.as_ref().expect("set until drop");
        if let Err(mpsc::SendError((op, _))) = tx.send((op, Instant::now())) {
            if read {
                self.shared.note_read(false);
            }
            return Err((Error::io("device model: its queue thread ended"), op));
        }
        self.in_flight += 1;
        Ok(())
    }

    fn wait(&mut self, min_complete: usize) -> Result<Vec<IoCompletion>> {
        let mut out = Vec::new();
        let want = min_complete.min(self.in_flight);
        while out.len() < want {
            match self.completions.recv() {
                Ok(c) => out.push(c),
                Err(_) => return Err(Error::io("device model: its queue thread ended")),
            }
        }
        out.extend(self.completions.try_iter());
        self.in_flight -= out.len();
        Ok(out)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

impl Drop for ModelQueue {
    /// Waits for the ops in flight (the service thread finishes them, then ends).
    fn drop(&mut self) {
        self.to_server = None;
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::{AlignedBuf, MemBacking};

    #[test]
    fn positioning_follows_the_model() {
        let m = DeviceModel::smr_hdd();
        assert_eq!(m.positioning_time(4096, 4096), (Duration::ZERO, false));
        // A short forward skip: the gap passes under the head (64 KiB at 200 MB/s).
        let (t, seek) = m.positioning_time(0, 65536);
        assert!(!seek);
        assert_eq!(t, Duration::from_secs_f64(65536.0 / 200e6));
        // Backwards, or far: a seek plus half a revolution (4.1667 ms at 7200 rpm).
        let (back, seek) = m.positioning_time(1 << 20, 0);
        assert!(seek);
        let half_rev = Duration::from_secs_f64(30.0 / 7200.0);
        assert!(back > m.single_track_seek + half_rev);
        let (far, _) = m.positioning_time(0, m.capacity_bytes);
        assert_eq!(far, m.full_stroke_seek + half_rev);
        // The seek curve's mean over random pairs is the datasheet's average seek.
        let mut rng_state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng_state ^= rng_state << 13;
            rng_state ^= rng_state >> 7;
            rng_state ^= rng_state << 17;
            rng_state % m.capacity_bytes
        };
        let n = 20000;
        let mean: f64 = (0..n)
            .map(|_| {
                let (a, b) = (next(), next());
                (m.positioning_time(a, b).0.saturating_sub(half_rev)).as_secs_f64()
            })
            .sum::<f64>()
            / n as f64;
        assert!((mean * 1e3 - 8.2).abs() < 0.3, "mean seek {mean}");
        assert!(DeviceModel::by_name("floppy").is_err());
        assert_eq!(DeviceModel::by_name("ssd").unwrap(), DeviceModel::ssd());
    }

    /// Real data through the model, in the modelled time: sequential requests cost transfer
    /// only, a backwards request a seek; queued ops complete in order with their data.
    #[test]
    fn requests_take_the_modelled_time_and_keep_their_data() {
        let mut m = DeviceModel::smr_hdd_no_cache();
        m.queue_depth = 1;
        // Slow enough to measure on a loaded machine: 10 MB/s, 20 ms half revolution.
        m.media_bytes_per_sec = 10e6;
        m.rpm = 1500.0;
        let b = ModelBacking::new(Arc::new(MemBacking::new(8 << 20).unwrap()), m.clone()).unwrap();
        let data: Vec<u8> = (0..65536u32).map(|i| (i * 7) as u8).collect();
        let t = Instant::now();
        b.write_at(&data, 0).unwrap(); // head at 0: sequential, 6.5 ms
        b.write_at(&data, 65536).unwrap(); // sequential again
        let seq = t.elapsed();
        assert!(seq >= 2 * m.transfer_time(65536), "{seq:?}");
        let t = Instant::now();
        let mut back = vec![0u8; 65536];
        b.read_at(&mut back, 0).unwrap(); // backwards: seek + 20 ms
        assert!(t.elapsed() >= Duration::from_millis(20) + m.transfer_time(65536));
        assert_eq!(back, data);
        let s = b.stats();
        assert_eq!((s.requests, s.seeks, s.bytes), (3, 1, 3 * 65536));

        let mut q = b.new_queue(4).unwrap();
        for i in 0..4u64 {
            let mut buf = AlignedBuf::new_zeroed(4096).unwrap();
            buf.fill(i as u8 + 1);
            q.submit(IoOp::new((1 << 20) + i * 4096, vec![buf], i))
                .map_err(|(e, _)| e)
                .unwrap();
        }
        assert!(q
            .submit(IoOp::new(0, vec![AlignedBuf::new_zeroed(4096).unwrap()], 9))
            .is_err());
        let done = q.wait(usize::MAX).unwrap();
        let tags: Vec<u64> = done.iter().map(|c| c.op.tag).collect();
        assert_eq!(tags, [0, 1, 2, 3]);
        assert!(done.iter().all(|c| c.result.is_ok()));
        let read = IoOp::read(1 << 20, vec![AlignedBuf::new_zeroed(16384).unwrap()], 7);
        q.submit(read).map_err(|(e, _)| e).unwrap();
        let c = q.wait(1).unwrap().remove(0);
        c.result.unwrap();
        for i in 0..4 {
            assert!(c.op.bufs[0][i * 4096..(i + 1) * 4096]
                .iter()
                .all(|&x| x == i as u8 + 1));
        }
        drop(q);
        assert_eq!(b.stats().requests, 3 + 4 + 1);
        // Bad requests are refused before the model (nothing served).
        assert!(b.read_at(&mut [0u8; 100], 0).is_err());
        assert_eq!(b.stats().requests, 8);
    }

    /// With a command queue, reads are served nearest first and writes in their order.
    #[test]
    fn the_command_queue_reorders_reads_not_writes() {
        let mut m = DeviceModel::smr_hdd_no_cache();
        m.media_bytes_per_sec = 100e6;
        m.rpm = 60_000.0; // 0.5 ms half revolution: keeps the test short
        m.track_bytes = 100_000; // what passes the head in a revolution at that rate
        m.queue_depth = 32;
        let b = ModelBacking::new(Arc::new(MemBacking::new(64 << 20).unwrap()), m).unwrap();
        let mut q = b.new_queue(16).unwrap();
        // Occupy the device so the rest queue up behind it, then: reads far, near, middle;
        // writes at 40 MiB then 8 MiB (kept in that order although 8 MiB is nearer).
        let buf = || vec![AlignedBuf::new_zeroed(4096).unwrap()];
        q.submit(IoOp::new(
            0,
            vec![AlignedBuf::new_zeroed(1 << 20).unwrap()],
            0,
        ))
        .map_err(|(e, _)| e)
        .unwrap();
        for (tag, at, read) in [
            (1, 60u64 << 20, true),
            (2, 2 << 20, true),
            (3, 30 << 20, true),
            (4, 40 << 20, false),
            (5, 8 << 20, false),
        ] {
            let op = if read {
                IoOp::read(at, buf(), tag)
            } else {
                IoOp::new(at, buf(), tag)
            };
            q.submit(op).map_err(|(e, _)| e).unwrap();
        }
        let mut order = Vec::new();
        while order.len() < 6 {
            for c in q.wait(1).unwrap() {
                c.result.unwrap();
                order.push(c.op.tag);
            }
        }
        assert_eq!(order[0], 0);
        let pos = |t| order.iter().position(|&x| x == t).unwrap();
        assert!(pos(4) < pos(5), "writes reordered: {order:?}");
        assert!(
            pos(2) < pos(3) && pos(3) < pos(1),
            "reads not nearest first: {order:?}"
        );
    }

    /// With a write cache: writes are acknowledged in the interface's time, a flush waits
    /// for the destage, a full cache makes a write wait, reads of dirty bytes come from the
    /// cache, the destager writes while no read is pending; the data stay right throughout.
    #[test]
    fn the_write_cache_acknowledges_then_destages() {
        let mut m = DeviceModel::smr_hdd();
        // Scaled so the times are measurable on a loaded machine and the test stays short:
        // media 10 MB/s (1 MiB takes 105 ms), interface 1 GB/s, a 2 MiB cache.
        m.media_bytes_per_sec = 10e6;
        m.interface_bytes_per_sec = 1e9;
        m.write_cache_bytes = 2 << 20;
        m.destage_bytes = 1 << 20;
        m.rpm = 60_000.0;
        m.track_bytes = 10_000;
        let b = ModelBacking::new(Arc::new(MemBacking::new(64 << 20).unwrap()), m.clone()).unwrap();
        let mib: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
        // Two 1 MiB writes fill the cache at the interface's rate, far quicker than the media.
        let t = Instant::now();
        b.write_at(&mib, 0).unwrap();
        b.write_at(&mib, 1 << 20).unwrap();
        let ack = t.elapsed();
        assert!(ack < m.transfer_time(1 << 20), "acknowledged in {ack:?}");
        // A read of dirty bytes is a cache hit; its data are the written ones.
        let mut back = vec![0u8; 4096];
        b.read_at(&mut back, 4096).unwrap();
        assert_eq!(back, mib[4096..8192]);
        assert_eq!(b.stats().cache_read_hits, 1);
        // The cache is full unless the destager already freed a MiB: a third write waits for
        // room (or finds it), and a flush returns only once nothing is dirty, which takes the
        // media time of all three MiB from the first write on.
        b.write_at(&mib, 2 << 20).unwrap();
        b.flush().unwrap();
        assert!(t.elapsed() >= m.transfer_time(3 << 20), "{:?}", t.elapsed());
        assert_eq!(b.dirty_bytes(), 0);
        let s = b.stats();
        assert_eq!((s.cached_writes, s.destaged_bytes), (3, 3 << 20));
        // Contiguous writes merged: destaged 1 MiB at a time, one seek at most (the first).
        assert_eq!(s.destages, 3);
        assert!(s.seeks <= 1, "{s:?}");
        // Queued: a write into the cache completes at once; a read behind it comes from the
        // media (not dirty any more) with the right bytes.
        let mut q = b.new_queue(4).unwrap();
        let mut buf = AlignedBuf::new_zeroed(1 << 20).unwrap();
        buf.copy_from_slice(&mib);
        buf[0] = 0xEE;
        q.submit(IoOp::new(8 << 20, vec![buf], 1))
            .map_err(|(e, _)| e)
            .unwrap();
        q.submit(IoOp::read(
            1 << 20,
            vec![AlignedBuf::new_zeroed(4096).unwrap()],
            2,
        ))
        .map_err(|(e, _)| e)
        .unwrap();
        let mut done = Vec::new();
        while done.len() < 2 {
            done.extend(q.wait(1).unwrap());
        }
        assert_eq!(done[0].op.tag, 1, "the write is acknowledged first");
        for c in &done {
            c.result.as_ref().unwrap();
        }
        assert_eq!(done[1].op.bufs[0][..], mib[..4096]);
        drop(q);
        b.flush().unwrap();
        let mut first = vec![0u8; 4096];
        b.read_at(&mut first, 8 << 20).unwrap();
        assert_eq!(first[..2], [0xEE, mib[1]]);
        assert_eq!(b.stats().destaged_bytes, 4 << 20);
    }
}
