//! Zoned block devices (`linux/blkzoned.h`): finding a device's zones and resetting and
//! finishing them.
//!
//! A host-managed zoned block device (an SMR disk, a ZNS namespace, a zoned `null_blk`) is cut
//! into zones of a fixed size; a *sequential-write-required* zone takes writes only at its
//! write pointer, which a reset moves back to the zone's start. The zoned store
//! ([`crate::zoned`]) uses such a device's own zones instead of emulating them: it writes each
//! zone strictly in order, resets a zone after GC emptied it, and finishes a zone it stops
//! writing before it is full (so the zone does not count against the device's limit of open or
//! active zones).
//!
//! Writes to one zone must reach the device in write-pointer order: [`ZonePlugQueue`] keeps at
//! most one write per zone in flight and holds the rest back, in order (what the kernel's zone
//! write plugging does from Linux 6.10; older kernels keep order only with the mq-deadline
//! scheduler).

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use super::{IoCompletion, IoKind, IoOp, IoQueue, SubmitResult, SECTOR_SIZE_BYTES};
use crate::error::{Error, ErrorKind, Result};

/// `struct blk_zone`: one zone of a report (64 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct BlkZone {
    start: u64,
    len: u64,
    wp: u64,
    kind: u8,
    cond: u8,
    non_seq: u8,
    reset: u8,
    resv: [u8; 4],
    capacity: u64,
    reserved: [u8; 24],
}

/// `struct blk_zone_report`: the header before the zones (16 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct BlkZoneReportHeader {
    sector: u64,
    nr_zones: u32,
    flags: u32,
}

/// `struct blk_zone_range`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct BlkZoneRange {
    sector: u64,
    nr_sectors: u64,
}

const fn ioc(dir: u64, nr: u64, size: u64) -> u64 {
    (dir << 30) | (size << 16) | (0x12 << 8) | nr
}
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;
const BLKREPORTZONE: u64 = ioc(IOC_READ | IOC_WRITE, 130, 16);
const BLKRESETZONE: u64 = ioc(IOC_WRITE, 131, 16);
const BLKGETZONESZ: u64 = ioc(IOC_READ, 132, 4);
const BLKGETNRZONES: u64 = ioc(IOC_READ, 133, 4);
const BLKFINISHZONE: u64 = ioc(IOC_WRITE, 136, 16);

const BLK_ZONE_TYPE_CONVENTIONAL: u8 = 1;
const BLK_ZONE_TYPE_SEQWRITE_REQ: u8 = 2;
const BLK_ZONE_TYPE_SEQWRITE_PREF: u8 = 3;
const BLK_ZONE_COND_EMPTY: u8 = 1;
const BLK_ZONE_COND_READONLY: u8 = 0xd;
const BLK_ZONE_COND_FULL: u8 = 0xe;
const BLK_ZONE_COND_OFFLINE: u8 = 0xf;
/// `blk_zone_report.flags`: the zones' `capacity` is valid.
const BLK_ZONE_REP_CAPACITY: u32 = 1;

/// Zones asked for per `BLKREPORTZONE` call.
const REPORT_BATCH: usize = 256;

/// What kind of zone, as the device reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZoneKind {
    /// Written anywhere (no write pointer).
    Conventional,
    /// Written only at the write pointer.
    SequentialRequired,
    /// Best written sequentially (host-aware devices); random writes are allowed.
    SequentialPreferred,
}

/// One zone of a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZoneInfo {
    /// First byte of the zone on the device.
    pub start_bytes: u64,
    /// Bytes the zone spans.
    pub len_bytes: u64,
    /// Bytes of it that can be written (ZNS zones may be shorter than their span).
    pub capacity_bytes: u64,
    /// Write pointer as a byte offset from the zone's start.
    pub wp_bytes: u64,
    /// Its kind.
    pub kind: ZoneKind,
    /// Empty (write pointer at the start).
    pub empty: bool,
    /// Full (written to its capacity, or finished).
    pub full: bool,
    /// Read-only or offline: unusable.
    pub unusable: bool,
}

/// A zoned block device's zone layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZoneGeometry {
    /// Bytes per zone (every zone but possibly a smaller last one).
    pub zone_size_bytes: u64,
    /// Writable bytes per zone: the smallest capacity among the whole-size zones.
    pub zone_capacity_bytes: u64,
    /// Zones on the device.
    pub nr_zones: u64,
    /// The device's limit of open zones (`queue/max_open_zones`; 0: none).
    pub max_open_zones: u64,
    /// The device's limit of open plus closed zones (`queue/max_active_zones`; 0: none).
    pub max_active_zones: u64,
}

/// The zone size of the block device open as `file`, or `None` when it is not zoned.
pub(crate) fn zone_size_bytes(file: &File) -> io::Result<Option<u64>> {
    let mut sectors: u32 = 0;
    // SAFETY: BLKGETZONESZ writes one u32 through the pointer, which points to `sectors`,
    // alive for the call; the fd is open while `file` is borrowed.
    let rc = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            BLKGETZONESZ as _,
            &mut sectors as *mut u32,
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        // Kernels built without zoned support do not know the ioctl.
        return match e.raw_os_error() {
            Some(libc::ENOTTY) | Some(libc::EINVAL) => Ok(None),
            _ => Err(e),
        };
    }
    Ok((sectors != 0).then(|| u64::from(sectors) * SECTOR_SIZE_BYTES as u64))
}

/// Reads the zone layout of the zoned block device open as `file`.
pub(crate) fn geometry(file: &File, zone_size_bytes: u64) -> io::Result<ZoneGeometry> {
    let mut nr: u32 = 0;
    // SAFETY: BLKGETNRZONES writes one u32 through the pointer, which points to `nr`, alive
    // for the call; the fd is open while `file` is borrowed.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETNRZONES as _, &mut nr as *mut u32) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    let zones = report(file, 0, nr as usize)?;
    let zone_capacity_bytes = zones
        .iter()
        .filter(|z| z.len_bytes == zone_size_bytes)
        .map(|z| z.capacity_bytes)
        .min()
        .unwrap_or(zone_size_bytes);
    Ok(ZoneGeometry {
        zone_size_bytes,
        zone_capacity_bytes,
        nr_zones: u64::from(nr),
        max_open_zones: queue_limit(file, "max_open_zones"),
        max_active_zones: queue_limit(file, "max_active_zones"),
    })
}

/// A number from the device's `/sys/dev/block/MAJ:MIN/queue/NAME`; 0 when unreadable.
fn queue_limit(file: &File, name: &str) -> u64 {
    let Ok(meta) = file.metadata() else {
        return 0;
    };
    let rdev = meta.rdev();
    let path = format!(
        "/sys/dev/block/{}:{}/queue/{name}",
        libc::major(rdev),
        libc::minor(rdev)
    );
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Reports up to `count` zones from the zone holding byte `from_bytes`.
pub(crate) fn report(file: &File, from_bytes: u64, count: usize) -> io::Result<Vec<ZoneInfo>> {
    let header = std::mem::size_of::<BlkZoneReportHeader>();
    let zone = std::mem::size_of::<BlkZone>();
    let mut out = Vec::with_capacity(count);
    let mut sector = from_bytes / SECTOR_SIZE_BYTES as u64;
    while out.len() < count {
        let batch = (count - out.len()).min(REPORT_BATCH);
        // u64 words keep the buffer aligned for the header and the zones.
        let mut buf = vec![0u64; (header + batch * zone).div_ceil(8)];
        let head = BlkZoneReportHeader {
            sector,
            nr_zones: batch as u32,
            flags: 0,
        };
        // SAFETY: `buf` is at least `header` bytes and 8-byte aligned; the header is plain data.
        unsafe { std::ptr::write(buf.as_mut_ptr().cast::<BlkZoneReportHeader>(), head) };
        // SAFETY: BLKREPORTZONE reads the header and writes at most `nr_zones` (= `batch`)
        // zones after it, all inside `buf`, which is alive and exclusively borrowed for the
        // call; the fd is open while `file` is borrowed.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKREPORTZONE as _, buf.as_mut_ptr()) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the header lies at the start of `buf` (aligned, initialised by the kernel or
        // by us).
        let got = unsafe { std::ptr::read(buf.as_ptr().cast::<BlkZoneReportHeader>()) };
        let n = (got.nr_zones as usize).min(batch);
        if n == 0 {
            break;
        }
        let has_capacity = got.flags & BLK_ZONE_REP_CAPACITY != 0;
        for i in 0..n {
            // SAFETY: zone `i < n <= batch` lies inside `buf` after the 16-byte header, at an
            // 8-byte aligned offset; `BlkZone` is plain data, any bytes are valid.
            let z = unsafe {
                std::ptr::read(
                    buf.as_ptr()
                        .cast::<u8>()
                        .add(header + i * zone)
                        .cast::<BlkZone>(),
                )
            };
            let s = SECTOR_SIZE_BYTES as u64;
            let kind = match z.kind {
                BLK_ZONE_TYPE_CONVENTIONAL => ZoneKind::Conventional,
                BLK_ZONE_TYPE_SEQWRITE_REQ => ZoneKind::SequentialRequired,
                BLK_ZONE_TYPE_SEQWRITE_PREF => ZoneKind::SequentialPreferred,
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("zone at sector {} has unknown type {other}", z.start),
                    ))
                }
            };
            out.push(ZoneInfo {
                start_bytes: z.start * s,
                len_bytes: z.len * s,
                capacity_bytes: if has_capacity { z.capacity } else { z.len } * s,
                wp_bytes: z.wp.saturating_sub(z.start) * s,
                kind,
                empty: z.cond == BLK_ZONE_COND_EMPTY,
                full: z.cond == BLK_ZONE_COND_FULL,
                unusable: matches!(z.cond, BLK_ZONE_COND_READONLY | BLK_ZONE_COND_OFFLINE),
            });
            sector = z.start + z.len;
        }
    }
    Ok(out)
}

fn zone_op(file: &File, request: u64, start_bytes: u64, len_bytes: u64) -> io::Result<()> {
    let range = BlkZoneRange {
        sector: start_bytes / SECTOR_SIZE_BYTES as u64,
        nr_sectors: len_bytes / SECTOR_SIZE_BYTES as u64,
    };
    // SAFETY: the zone-management ioctls read one `blk_zone_range` through the pointer, which
    // points to `range`, alive for the call; the fd is open while `file` is borrowed.
    let rc = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            request as _,
            &range as *const BlkZoneRange,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Moves the write pointers of the zones in `start_bytes..start_bytes + len_bytes` back to
/// their starts (`BLKRESETZONE`).
pub(crate) fn reset(file: &File, start_bytes: u64, len_bytes: u64) -> io::Result<()> {
    zone_op(file, BLKRESETZONE, start_bytes, len_bytes)
}

/// Makes the zones in the range full (`BLKFINISHZONE`): they stop counting as open.
pub(crate) fn finish(file: &File, start_bytes: u64, len_bytes: u64) -> io::Result<()> {
    zone_op(file, BLKFINISHZONE, start_bytes, len_bytes)
}

/// A queue in front of another that keeps at most one write per zone in flight, holding the
/// zone's later writes back in submission order until it completes. Reads pass through.
///
/// Invariant: a zone is a key of `plugged` exactly while one of its writes is in the queue
/// below; the writes held under it were submitted after that one and go out in submission
/// order. `in_flight` counts the held writes too.
#[derive(Debug)]
pub struct ZonePlugQueue<'a> {
    inner: Box<dyn IoQueue + 'a>,
    zone_size_bytes: u64,
    /// Per zone with a write in flight: the writes waiting behind it.
    plugged: HashMap<u64, VecDeque<IoOp>>,
    /// Completions of held writes whose submission failed, returned by the next `wait`.
    failed: Vec<IoCompletion>,
}

impl<'a> ZonePlugQueue<'a> {
    /// Plugs `inner`, a queue of a device with zones of `zone_size_bytes`.
    pub fn new(inner: Box<dyn IoQueue + 'a>, zone_size_bytes: u64) -> ZonePlugQueue<'a> {
        ZonePlugQueue {
            inner,
            zone_size_bytes,
            plugged: HashMap::new(),
            failed: Vec::new(),
        }
    }

    fn zone_of(&self, op: &IoOp) -> u64 {
        op.offset / self.zone_size_bytes
    }

    /// A write of `zone` completed: sends the next held one, if any.
    fn unplug(&mut self, zone: u64) {
        loop {
            let Some(queue) = self.plugged.get_mut(&zone) else {
                return;
            };
            let Some(op) = queue.pop_front() else {
                self.plugged.remove(&zone);
                return;
            };
            match self.inner.submit(op) {
                Ok(()) => return,
                Err((e, op)) => {
                    // Reported as that write's completion; the next one may still go.
                    self.failed.push(IoCompletion { op, result: Err(e) });
                }
            }
        }
    }
}

impl IoQueue for ZonePlugQueue<'_> {
    fn depth(&self) -> usize {
        self.inner.depth()
    }

    fn submit(&mut self, op: IoOp) -> SubmitResult {
        if self.in_flight() >= self.depth() {
            return Err((
                Error::new(ErrorKind::Busy, "queue full: reap completions first"),
                op,
            ));
        }
        if op.kind == IoKind::Write {
            let zone = self.zone_of(&op);
            if let Some(queue) = self.plugged.get_mut(&zone) {
                queue.push_back(op);
                return Ok(());
            }
            self.inner.submit(op)?;
            self.plugged.insert(zone, VecDeque::new());
            return Ok(());
        }
        self.inner.submit(op)
    }

    fn wait(&mut self, min_complete: usize) -> Result<Vec<IoCompletion>> {
        let mut out = std::mem::take(&mut self.failed);
        loop {
            let want = min_complete.saturating_sub(out.len());
            if (want == 0 && min_complete > 0) || self.inner.in_flight() == 0 {
                break;
            }
            let done = match self.inner.wait(want) {
                Ok(done) => done,
                // What was reaped before the error is returned; the rest stays in flight.
                Err(e) if out.is_empty() => return Err(e),
                Err(_) => break,
            };
            for c in done {
                if c.op.kind == IoKind::Write {
                    let zone = self.zone_of(&c.op);
                    self.unplug(zone);
                }
                out.push(c);
            }
            out.append(&mut self.failed);
            if min_complete == 0 {
                break; // one non-blocking pass
            }
        }
        Ok(out)
    }

    fn in_flight(&self) -> usize {
        let held: usize = self.plugged.values().map(VecDeque::len).sum();
        self.inner.in_flight() + held + self.failed.len()
    }
}

#[cfg(test)]
mod unit {
    use super::*;
    use crate::backing::{AlignedBuf, Backing, Engine, FileBacking, FileOptions};
    use parking_lot::Mutex;
    use std::sync::Arc;

    const ZONE: u64 = 64 << 10;

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // From linux/blkzoned.h on x86_64 (and every architecture with the generic encoding).
        assert_eq!(BLKREPORTZONE, 0xc010_1282);
        assert_eq!(BLKRESETZONE, 0x4010_1283);
        assert_eq!(BLKGETZONESZ, 0x8004_1284);
        assert_eq!(BLKGETNRZONES, 0x8004_1285);
        assert_eq!(BLKFINISHZONE, 0x4010_1288);
        assert_eq!(std::mem::size_of::<BlkZone>(), 64);
        assert_eq!(std::mem::size_of::<BlkZoneReportHeader>(), 16);
    }

    /// A file of four [`ZONE`]s written through io_uring (it has no zones itself: the plug
    /// only needs the zone size).
    fn four_zones() -> (tempfile::TempDir, FileBacking) {
        let dir = tempfile::tempdir().unwrap();
        let file = FileBacking::create(
            dir.path().join("b"),
            4 * ZONE,
            &FileOptions::with_engine(Engine::Uring),
        )
        .unwrap();
        (dir, file)
    }

    fn block(v: u8) -> AlignedBuf {
        AlignedBuf::from_slice(&[v; 4096]).unwrap()
    }

    /// Passes ops to a real queue and logs, per write submitted to it, its offset and how
    /// many writes of its zone were already in flight.
    #[derive(Debug)]
    struct Recorder<'a> {
        inner: Box<dyn IoQueue + 'a>,
        in_flight_by_zone: HashMap<u64, usize>,
        log: Arc<Mutex<Vec<(u64, usize)>>>,
    }

    impl IoQueue for Recorder<'_> {
        fn depth(&self) -> usize {
            self.inner.depth()
        }
        fn submit(&mut self, op: IoOp) -> SubmitResult {
            let n = self.in_flight_by_zone.entry(op.offset / ZONE).or_default();
            self.log.lock().push((op.offset, *n));
            *n += 1;
            self.inner.submit(op)
        }
        fn wait(&mut self, min_complete: usize) -> Result<Vec<IoCompletion>> {
            let done = self.inner.wait(min_complete)?;
            for c in &done {
                *self
                    .in_flight_by_zone
                    .get_mut(&(c.op.offset / ZONE))
                    .unwrap() -= 1;
            }
            Ok(done)
        }
        fn in_flight(&self) -> usize {
            self.inner.in_flight()
        }
    }

    #[test]
    fn plug_keeps_one_write_per_zone_in_flight_in_order() {
        let (_dir, file) = four_zones();
        let mut q = ZonePlugQueue::new(file.new_queue(8).unwrap(), ZONE);
        // Four writes into zone 0 and two into zone 2, interleaved, plus a read of zone 1.
        let plan = [
            (0, 1u8),
            (2 * ZONE, 2),
            (4096, 3),
            (8192, 4),
            (2 * ZONE + 4096, 5),
            (12288, 6),
        ];
        for (i, &(off, v)) in plan.iter().enumerate() {
            q.submit(IoOp::new(off, vec![block(v)], i as u64)).unwrap();
        }
        q.submit(IoOp::read(ZONE, vec![block(0)], 99)).unwrap();
        // Held writes count as in flight.
        assert_eq!(q.in_flight(), 7);
        let mut done = Vec::new();
        while q.in_flight() > 0 {
            done.extend(q.wait(1).unwrap());
        }
        assert_eq!(done.len(), 7);
        assert!(done.iter().all(|c| c.result.is_ok()));
        // Completion order within a zone is submission order.
        let zone0: Vec<u64> = done
            .iter()
            .filter(|c| c.op.kind == IoKind::Write && c.op.offset < ZONE)
            .map(|c| c.op.tag)
            .collect();
        assert_eq!(zone0, vec![0, 2, 3, 5]);
        for &(off, v) in &plan {
            let mut b = [0u8; 4096];
            file.read_at(&mut b, off).unwrap();
            assert_eq!(b, [v; 4096], "block at {off}");
        }
        // The queue-full check counts held writes.
        let mut q = ZonePlugQueue::new(file.new_queue(2).unwrap(), ZONE);
        q.submit(IoOp::new(0, vec![block(7)], 0)).unwrap();
        q.submit(IoOp::new(4096, vec![block(8)], 1)).unwrap();
        let (e, _) = q.submit(IoOp::new(8192, vec![block(9)], 2)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Busy);
        assert_eq!(q.wait(usize::MAX).unwrap().len(), 2);
    }

    #[test]
    fn plug_never_has_two_writes_of_a_zone_at_the_device() {
        let (_dir, file) = four_zones();
        let log = Arc::new(Mutex::new(Vec::new()));
        let recorder = Recorder {
            inner: file.new_queue(16).unwrap(),
            in_flight_by_zone: HashMap::new(),
            log: log.clone(),
        };
        let mut q = ZonePlugQueue::new(Box::new(recorder), ZONE);
        let mut next = [0u64; 4];
        for i in 0..64u64 {
            let z = (i * 7 % 4) as usize;
            if next[z] == ZONE {
                continue;
            }
            let off = z as u64 * ZONE + next[z];
            next[z] += 4096;
            while q.in_flight() >= q.depth() {
                q.wait(1).unwrap();
            }
            q.submit(IoOp::new(off, vec![block(0)], i)).unwrap();
        }
        q.wait(usize::MAX).unwrap();
        let log = log.lock().clone();
        assert!(log.len() >= 60, "{}", log.len());
        assert!(
            log.iter().all(|&(_, others)| others == 0),
            "a write reached the device while another of its zone was in flight: {log:?}"
        );
        // And per zone, the device saw the offsets in increasing order.
        for z in 0..4u64 {
            let offs: Vec<u64> = log
                .iter()
                .map(|&(o, _)| o)
                .filter(|o| o / ZONE == z)
                .collect();
            assert!(offs.windows(2).all(|w| w[0] < w[1]), "zone {z}: {offs:?}");
        }
    }

    #[test]
    fn a_regular_file_is_not_zoned() {
        let f = tempfile::tempfile().unwrap();
        // Not a block device: the ioctl fails with ENOTTY, which means "not zoned".
        assert_eq!(zone_size_bytes(&f).unwrap(), None);
    }
}
