//! [`ModelBacking`]: wraps any [`Backing`] and makes each request take the time a modelled
//! device would: seek time from the distance between requests, rotational latency, a media
//! transfer rate, one request at a time per actuator. For benchmarks of I/O patterns whose
//! cost depends on the device (`uzram bench gc --device-model smr-hdd|ssd`): the zoned GC's
//! scratch ring pays where the scratch is smaller than the device's bandwidth-delay product,
//! which the host's virtual SSD never shows (bench/README.md, "bench gc").
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
//! test runs as it would against a slow device. `flush` adds nothing (the model has no write
//! cache: a write is on the media when it completes).
//!
//! # Presets ([`DeviceModel::by_name`])
//!
//! - `smr-hdd`: a 3.5" 7200 rpm capacity drive, the mechanics of the Western Digital Ultrastar
//!   DC HC310 OEM specification (rev. 1.4, 2018, section 4.5.1: average seek 7.4 ms read /
//!   8.2 ms write, single-track 0.23 / 0.32 ms, average latency 4.16 ms at 7200 rpm), which
//!   the host-managed SMR Ultrastar DC HC620 shares; 14 TB (the HC620's capacity) for the seek
//!   curve; a media rate of 200 MB/s, the figure the zoned XFS GC measurements were described
//!   with (issue 14; SMR drives of this class quote 200–255 MB/s sustained); track 1.6 MB
//!   (200 MB/s × 8.33 ms per revolution). The full-stroke seek is derived from the average:
//!   for uniformly random pairs of positions `E[sqrt(d/capacity)] = 8/15`, so
//!   `full = single + (average - single) * 15/8` (13.7 ms read, 15.0 ms write). Reads and
//!   writes use the write figures (GC writes as much as it reads; the 10% difference is below
//!   what the benchmark resolves).
//! - `ssd`: a SATA SSD: 520 MB/s (the SATA 6 Gb/s link's practical ceiling, what SATA SSD
//!   datasheets quote sequentially) and 80 µs per command (a 4 KiB read at queue depth 1 in
//!   about 90 µs); no seek, no rotation.
//!
//! [`ModelBacking::stats`] counts requests, seeks and the modelled busy time, so a benchmark
//! can check the model did what it claims.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

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
}

impl DeviceModel {
    /// A host-managed SMR hard disk (module docs, "Presets").
    pub fn smr_hdd() -> DeviceModel {
        let single = Duration::from_micros(320);
        let average = Duration::from_micros(8200);
        DeviceModel {
            name: "smr-hdd".into(),
            command_overhead: Duration::from_micros(50),
            single_track_seek: single,
            full_stroke_seek: single + (average - single) * 15 / 8,
            rpm: 7200.0,
            media_bytes_per_sec: 200e6,
            track_bytes: 1_600_000,
            capacity_bytes: 14_000_000_000_000,
            queue_depth: 32,
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
        }
    }

    /// The preset called `name` (`smr-hdd`, `ssd`); `EINVAL` for others.
    pub fn by_name(name: &str) -> Result<DeviceModel> {
        match name {
            "smr-hdd" => Ok(DeviceModel::smr_hdd()),
            "ssd" => Ok(DeviceModel::ssd()),
            _ => Err(Error::invalid(format!(
                "unknown device model {name:?}: smr-hdd or ssd"
            ))),
        }
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
    /// Requests served (synchronous and queued).
    pub requests: u64,
    /// Of them, those that needed a seek and rotational latency.
    pub seeks: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Modelled service time summed, in microseconds.
    pub busy_us: u64,
}

/// The actuator: where the head is. Its mutex is held for a request's whole service time, so
/// requests are served one at a time.
#[derive(Debug)]
struct Actuator {
    head: u64,
}

/// State shared by the backing and its queues' service threads.
#[derive(Debug)]
struct Shared {
    model: DeviceModel,
    actuator: Mutex<Actuator>,
    requests: AtomicU64,
    seeks: AtomicU64,
    bytes: AtomicU64,
    busy_us: AtomicU64,
}

impl Shared {
    /// Serves one request: takes the actuator, runs `io` (the inner backing's real I/O), then
    /// sleeps out the rest of the modelled service time.
    fn serve<T>(&self, offset: u64, len_bytes: u64, io: impl FnOnce() -> T) -> T {
        let mut act = self.actuator.lock();
        let start = Instant::now();
        let (service, seek) = self.model.service_time(act.head, offset, len_bytes);
        let out = io();
        let deadline = start + service;
        let now = Instant::now();
        if deadline > now {
            std::thread::sleep(deadline - now);
        }
        act.head = offset + len_bytes;
        drop(act);
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.seeks.fetch_add(u64::from(seek), Ordering::Relaxed);
        self.bytes.fetch_add(len_bytes, Ordering::Relaxed);
        self.busy_us
            .fetch_add(service.as_micros() as u64, Ordering::Relaxed);
        out
    }
}

/// A backing whose requests take the time a [`DeviceModel`] says (module docs).
pub struct ModelBacking {
    inner: Arc<dyn Backing>,
    shared: Arc<Shared>,
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
    /// Wraps `inner` in `model`; the head starts at offset 0.
    pub fn new(inner: Arc<dyn Backing>, model: DeviceModel) -> ModelBacking {
        ModelBacking {
            inner,
            shared: Arc::new(Shared {
                model,
                actuator: Mutex::new(Actuator { head: 0 }),
                requests: AtomicU64::new(0),
                seeks: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
                busy_us: AtomicU64::new(0),
            }),
        }
    }

    /// The model in force.
    pub fn model(&self) -> &DeviceModel {
        &self.shared.model
    }

    /// Counters since creation.
    pub fn stats(&self) -> ModelStats {
        let s = &self.shared;
        ModelStats {
            requests: s.requests.load(Ordering::Relaxed),
            seeks: s.seeks.load(Ordering::Relaxed),
            bytes: s.bytes.load(Ordering::Relaxed),
            busy_us: s.busy_us.load(Ordering::Relaxed),
        }
    }
}

impl Backing for ModelBacking {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size_bytes(), offset, buf.len() as u64, "read")?;
        self.shared
            .serve(offset, buf.len() as u64, || self.inner.read_at(buf, offset))
    }

    fn readv_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> Result<()> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        check_range(self.size_bytes(), offset, total, "read")?;
        self.shared
            .serve(offset, total, || self.inner.readv_at(bufs, offset))
    }

    fn writev_at(&self, bufs: &[&[u8]], offset: u64) -> Result<()> {
        let total = total_len(bufs);
        check_range(self.size_bytes(), offset, total, "write")?;
        self.shared
            .serve(offset, total, || self.inner.writev_at(bufs, offset))
    }

    fn flush(&self) -> Result<()> {
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
        let (to_server, requests) = mpsc::channel::<IoOp>();
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
            in_flight: 0,
            to_server: Some(to_server),
            completions,
            server: Some(server),
        }))
    }
}

/// The service thread of one [`ModelQueue`]: serves ops in submission order through the
/// inner backing's own queue (depth 1: one request at a time), until the queue drops.
fn serve_queue(
    inner: &dyn Backing,
    shared: &Shared,
    requests: &mpsc::Receiver<IoOp>,
    done: &mpsc::Sender<IoCompletion>,
) {
    let mut queue = match inner.new_queue(1) {
        Ok(q) => q,
        Err(e) => {
            // Every op fails with the reason, so nothing waits forever.
            let msg = e.to_string();
            for op in requests.iter() {
                let _ = done.send(IoCompletion {
                    op,
                    result: Err(Error::io(format!("device model: inner queue: {msg}"))),
                });
            }
            return;
        }
    };
    let depth = shared.model.queue_depth.max(1);
    let mut waiting: std::collections::VecDeque<IoOp> = std::collections::VecDeque::new();
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
        let head = shared.actuator.lock().head;
        let first_write = waiting.iter().position(|op| op.kind == IoKind::Write);
        let pick = (0..waiting.len())
            .filter(|&i| waiting[i].kind != IoKind::Write || Some(i) == first_write)
            .min_by_key(|&i| shared.model.positioning_time(head, waiting[i].offset).0)
            .expect("a waiting op is eligible");
        let op = waiting.remove(pick).expect("picked from the list");
        let (offset, len) = (op.offset, op.len_bytes());
        let completion = shared.serve(offset, len, || run_one(queue.as_mut(), op));
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

/// Queued ops for a [`ModelBacking`]: handed to its service thread, completed in order.
struct ModelQueue {
    depth: usize,
    size_bytes: u64,
    in_flight: usize,
    /// `None` once dropping (the service thread then ends after the ops it has).
    to_server: Option<mpsc::Sender<IoOp>>,
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
        let tx = self.to_server.as_ref().expect("set until drop");
        if let Err(mpsc::SendError(op)) = tx.send(op) {
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
        let mut m = DeviceModel::smr_hdd();
        m.queue_depth = 1;
        // Slow enough to measure on a loaded machine: 10 MB/s, 20 ms half revolution.
        m.media_bytes_per_sec = 10e6;
        m.rpm = 1500.0;
        let b = ModelBacking::new(Arc::new(MemBacking::new(8 << 20).unwrap()), m.clone());
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
        let mut m = DeviceModel::smr_hdd();
        m.media_bytes_per_sec = 100e6;
        m.rpm = 60_000.0; // 0.5 ms half revolution: keeps the test short
        m.track_bytes = 100_000; // what passes the head in a revolution at that rate
        m.queue_depth = 32;
        let b = ModelBacking::new(Arc::new(MemBacking::new(64 << 20).unwrap()), m);
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
}
