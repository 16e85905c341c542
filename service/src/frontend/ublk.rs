//! The ublk frontend: a device as a kernel block device `/dev/ublkbN` on this host
//! (`uzram serve --ublk`), through Linux's userspace block driver `ublk_drv` (Linux 6.0+) and
//! the libublk library (by ublk's author). Design, life cycle and crash behaviour:
//! `docs/ublk.md`.
//!
//! Shape: one [`UblkExport`] per device. Starting it adds a ublk device (`ADD_DEV` on
//! `/dev/ublk-control`), sets its parameters (size, block sizes = the device's page size as
//! zram's, discard and write-zeroes limits, a volatile cache with FUA so flushes reach the
//! device) and runs one *queue thread* per hardware queue (by default one per CPU, each
//! [`DEFAULT_QUEUE_DEPTH`] tags deep). A queue thread owns its queue's io_uring and its
//! buffers: one buffer of [`IO_BUF_BYTES`] per tag, allocated before the device starts
//! (locked with `--swap`), used only for the request that holds that tag. The kernel copies a
//! write's data into the tag's buffer before the request reaches us, and a read's data out
//! of it when we commit the result, so no buffer is shared between threads and none is
//! allocated on the request path. Each request is served synchronously on its queue thread
//! by the [`BlockDevice`] (which is `Sync`: the queues run in parallel).
//!
//! Requests map one to one: READ → `read_at`, WRITE → `write_at` (then `flush` when the
//! request has FUA), FLUSH → `flush`, DISCARD → `discard`, WRITE_ZEROES → `write_zeroes`;
//! anything else is `EOPNOTSUPP`. An error is returned to the kernel as its errno (the
//! request fails with it; the server goes on).
//!
//! Stop ([`UblkExport::stop`], on SIGINT/SIGTERM): the device is stopped (`STOP_DEV`: the
//! kernel removes `/dev/ublkbN` after the requests in flight complete, then aborts the
//! queues), the queue threads end, and the device is deleted (`DEL_DEV`).

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::{sys, BufDesc, UblkError, UblkFlags, UblkIORes};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use uzram::error::{Error, ErrorKind, Result};
use uzram::BlockDevice;

/// The ublk control device; it exists when `ublk_drv` is loaded.
pub const CONTROL_PATH: &str = "/dev/ublk-control";

/// Tags per queue: requests the kernel may have in flight on one queue.
pub const DEFAULT_QUEUE_DEPTH: u16 = 128;

/// The largest request, and each tag's buffer: 128 KiB (the kernel splits larger I/O). So a
/// queue holds at most `depth × 128 KiB` of buffers (16 MiB at depth 128), allocated once.
pub const IO_BUF_BYTES: u32 = 128 << 10;

/// Serving swap (`--swap`): tags per queue and each tag's buffer, 32 × 64 KiB = 2 MiB a queue,
/// locked. Swap writes one page or a few adjacent ones and reads ahead 8 pages (32 KiB); a
/// queue thread serves its requests one by one from memory, so a deeper queue adds no speed,
/// and the locked buffers are memory taken from the machine exactly when it runs out (at the
/// defaults a 512 MiB guest lost 16 MiB a queue to them).
pub const SWAP_QUEUE_DEPTH: u16 = 32;
/// See [`SWAP_QUEUE_DEPTH`].
pub const SWAP_IO_BUF_BYTES: u32 = 64 << 10;

/// Serving swap: turns the block layer's writeback throttling off for `/dev/ublkbN`
/// (`queue/wbt_lat_usec` 0), as a kernel zram device (which has no request queue) never has
/// it. Swap-outs from reclaim are background writes to it, each waiting in `wbt_wait` while
/// the device's writes are slow; under memory pressure that held the swap reserve's refiller
/// (whose reclaim swaps out too) behind the very writes it refills for (seen in the VM: the
/// reserve drained, the hog stopped). Best effort: without it the device still works.
fn no_writeback_throttling(dev_id: u32) {
    let attr = format!("/sys/block/ublkb{dev_id}/queue/wbt_lat_usec");
    let _ = std::fs::write(attr, "0");
}

/// The most queues by default (one per CPU up to this).
pub const MAX_DEFAULT_QUEUES: u16 = 16;

/// How long starting a device may take before it is given up.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How a ublk device is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UblkConfig {
    /// Hardware queues, each served by its own thread.
    pub nr_queues: u16,
    /// Tags per queue.
    pub queue_depth: u16,
    /// Each tag's buffer: the largest request.
    pub io_buf_bytes: u32,
    /// Serving swap: lock the request buffers in memory (they are always preallocated).
    pub swap: bool,
}

impl Default for UblkConfig {
    fn default() -> UblkConfig {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        UblkConfig {
            nr_queues: cpus.clamp(1, MAX_DEFAULT_QUEUES as usize) as u16,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            io_buf_bytes: IO_BUF_BYTES,
            swap: false,
        }
    }
}

impl UblkConfig {
    /// The default, or for a server backing swap: its buffers locked, and smaller
    /// ([`SWAP_QUEUE_DEPTH`], [`SWAP_IO_BUF_BYTES`]).
    pub fn new(swap: bool) -> UblkConfig {
        let default = UblkConfig::default();
        if !swap {
            return default;
        }
        UblkConfig {
            queue_depth: SWAP_QUEUE_DEPTH,
            io_buf_bytes: SWAP_IO_BUF_BYTES,
            swap: true,
            ..default
        }
    }
}

/// Whether `ublk_drv` is loaded here; the error says how to load it if not.
pub fn check_driver() -> Result<()> {
    check_control(Path::new(CONTROL_PATH))
}

fn check_control(control: &Path) -> Result<()> {
    if control.exists() {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::NoDevice,
        format!(
            "ublk: {} is missing: the kernel module ublk_drv is not loaded \
             (load it with `modprobe ublk_drv` as root; Linux 6.0 or later)",
            control.display()
        ),
    ))
}

fn ublk_error(what: &str, e: UblkError) -> Error {
    let errno = match &e {
        UblkError::OtherError(n) | UblkError::UringIOError(n) => n.abs(),
        UblkError::IOError(io) => io.raw_os_error().unwrap_or(libc::EIO),
        UblkError::InvalidVal => libc::EINVAL,
        _ => libc::EIO,
    };
    Error::new(
        ErrorKind::from_errno(errno),
        format!(
            "ublk: {what}: {e} ({})",
            std::io::Error::from_raw_os_error(errno)
        ),
    )
}

/// Control commands go through a per-thread io_uring in libublk: makes this thread's.
fn ensure_ctrl_ring() {
    let _ = libublk::ctrl::ublk_init_ctrl_task_ring(|ring| {
        if ring.is_none() {
            *ring = Some(io_uring::IoUring::builder().build(4)?);
        }
        Ok(())
    });
}

/// Deletes ublk device `dev_id` left by a server that died (its control node `/dev/ublkcN`
/// outlives the server and keeps the number taken): stops it if the kernel has not, then
/// deletes it. `ENOENT` if there is no such device.
pub fn delete_device(dev_id: u32) -> Result<()> {
    check_driver()?;
    ensure_ctrl_ring();
    let id = i32::try_from(dev_id).map_err(|_| Error::invalid("ublk: no such device number"))?;
    let ctrl = UblkCtrl::new_simple(id).map_err(|e| ublk_error(&format!("device {dev_id}"), e))?;
    let _ = ctrl.kill_dev();
    ctrl.del_dev()
        .map(|_| ())
        .map_err(|e| ublk_error(&format!("deleting device {dev_id}"), e))
}

/// What a device's queue threads did since it started, all queues summed
/// ([`UblkExport::stats`]): the server's share of a request's latency, for profiling
/// (`uzram bench blk` prints it beside fio's latency).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UblkStats {
    /// Requests served.
    pub requests: u64,
    /// Wake-ups of a queue thread with work: each is one return from `io_uring_enter` (which
    /// also committed the previous batch's results) with one or more requests.
    pub wakes: u64,
    /// Time spent serving requests (from the request's descriptor to its result, the
    /// device's work), nanoseconds.
    pub serve_ns: u64,
}

impl UblkStats {
    /// The counts from `earlier` to `self`.
    pub fn since(&self, earlier: &UblkStats) -> UblkStats {
        UblkStats {
            requests: self.requests - earlier.requests,
            wakes: self.wakes - earlier.wakes,
            serve_ns: self.serve_ns - earlier.serve_ns,
        }
    }
}

/// The counters behind [`UblkStats`], shared by a device's queue threads. Plain counts: each
/// is added to with `Relaxed` and read without ordering against the others.
#[derive(Debug, Default)]
struct QueueCounters {
    requests: AtomicU64,
    wakes: AtomicU64,
    serve_ns: AtomicU64,
}

/// A device served as `/dev/ublkbN`. Dropping it stops it, as [`UblkExport::stop`] does.
pub struct UblkExport {
    ctrl: Arc<UblkCtrl>,
    dev_id: u32,
    counters: Arc<QueueCounters>,
    /// Runs libublk's `run_target`: it started the queue threads and returns once they end.
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for UblkExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UblkExport")
            .field("dev_id", &self.dev_id)
            .finish_non_exhaustive()
    }
}

/// log2 of a power of two.
fn shift(n: u64) -> u8 {
    debug_assert!(n.is_power_of_two());
    n.trailing_zeros() as u8
}

impl UblkExport {
    /// Adds a ublk device serving `device` and starts it; returns once `/dev/ublkbN` exists.
    /// The device must be initialised (a nonzero `disksize`): a ublk device's size is fixed
    /// while it runs.
    pub fn start(name: &str, device: Arc<dyn BlockDevice>, cfg: &UblkConfig) -> Result<UblkExport> {
        check_driver()?;
        let size = device.size_bytes();
        let page = device.page_size_bytes() as u64;
        if size == 0 {
            return Err(Error::invalid(format!(
                "ublk: {name}: the device has no disksize"
            )));
        }
        if !page.is_power_of_two() || page < 4096 {
            return Err(Error::invalid(format!(
                "ublk: {name}: page size {page} is not a power of two of at least 4096"
            )));
        }
        if cfg.nr_queues == 0 || cfg.queue_depth == 0 {
            return Err(Error::invalid(format!(
                "ublk: {name}: queues and queue depth must be positive"
            )));
        }
        let mut flags = UblkFlags::UBLK_DEV_F_ADD_DEV;
        if cfg.swap {
            flags |= UblkFlags::UBLK_DEV_F_MLOCK_IO_BUFFER;
        }
        let (nr_queues, depth, io_buf_bytes) = (cfg.nr_queues, cfg.queue_depth, cfg.io_buf_bytes);
        let counters = Arc::new(QueueCounters::default());
        let queue_counters = Arc::clone(&counters);
        let (tx, rx) = mpsc::channel::<Result<Arc<UblkCtrl>>>();
        let name2 = name.to_string();
        // libublk's control commands go through a per-thread io_uring: the device is added
        // and run on this thread (run_target returns when its queue threads end).
        let thread = std::thread::Builder::new()
            .name("uzram-ublk".into())
            .spawn(move || {
                let ctrl = match UblkCtrlBuilder::default()
                    .name("uzram")
                    .nr_queues(nr_queues)
                    .depth(depth)
                    .io_buf_bytes(io_buf_bytes)
                    .dev_flags(flags)
                    .build()
                {
                    Ok(c) => Arc::new(c),
                    Err(e) => {
                        let _ = tx.send(Err(ublk_error(&format!("{name2}: adding the device"), e)));
                        return;
                    }
                };
                let init = move |dev: &mut UblkDev| {
                    dev.set_default_params(size);
                    let p = &mut dev.tgt.params;
                    p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
                    // zram: logical blocks of 4 KiB, physical blocks of a page. The kernel
                    // takes logical blocks up to its own page size only.
                    p.basic.logical_bs_shift = shift(page.min(4096));
                    p.basic.physical_bs_shift = shift(page);
                    p.basic.io_min_shift = shift(page);
                    p.basic.io_opt_shift = shift(page);
                    p.basic.attrs = sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA;
                    p.discard.discard_granularity = page as u32;
                    p.discard.discard_alignment = 0;
                    p.discard.max_discard_sectors = u32::MAX >> 9;
                    p.discard.max_write_zeroes_sectors = u32::MAX >> 9;
                    p.discard.max_discard_segments = 1;
                    Ok(())
                };
                let queue =
                    move |qid: u16, dev: &UblkDev| serve_queue(qid, dev, &*device, &queue_counters);
                let started = {
                    let ctrl = Arc::clone(&ctrl);
                    let tx = tx.clone();
                    move |_: &UblkCtrl| {
                        let _ = tx.send(Ok(ctrl));
                    }
                };
                if let Err(e) = ctrl.run_target(init, queue, started) {
                    let _ = tx.send(Err(ublk_error(&format!("{name2}: starting"), e)));
                }
            })
            .map_err(|e| Error::io(format!("ublk: starting a thread: {e}")))?;
        match rx.recv_timeout(START_TIMEOUT) {
            Ok(Ok(ctrl)) => {
                let dev_id = ctrl.dev_info().dev_id;
                if cfg.swap {
                    no_writeback_throttling(dev_id);
                }
                Ok(UblkExport {
                    dev_id,
                    ctrl,
                    counters,
                    thread: Some(thread),
                })
            }
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(Error::io(format!(
                "ublk: {name}: the device did not start within {} s",
                START_TIMEOUT.as_secs()
            ))),
        }
    }

    /// The device's number: `/dev/ublkbN`'s N.
    pub fn dev_id(&self) -> u32 {
        self.dev_id
    }

    /// What the queue threads did so far.
    pub fn stats(&self) -> UblkStats {
        let c = &self.counters;
        UblkStats {
            requests: c.requests.load(Ordering::Relaxed),
            wakes: c.wakes.load(Ordering::Relaxed),
            serve_ns: c.serve_ns.load(Ordering::Relaxed),
        }
    }

    /// `/dev/ublkbN`.
    pub fn block_dev_path(&self) -> PathBuf {
        PathBuf::from(self.ctrl.get_bdev_path())
    }

    /// Stops the device (after the requests in flight complete), ends its queue threads and
    /// deletes it.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        let Some(t) = self.thread.take() else { return };
        ensure_ctrl_ring();
        // The device may already be gone (deleted by someone else): nothing to stop then.
        let _ = self.ctrl.kill_dev();
        let _ = t.join();
        let _ = self.ctrl.del_dev();
    }
}

impl Drop for UblkExport {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// A queue thread: fetches requests for queue `qid` and serves each with `device` until the
/// queue is stopped, counting in `counters`.
fn serve_queue(qid: u16, dev: &UblkDev, device: &dyn BlockDevice, counters: &QueueCounters) {
    // One buffer per tag, allocated (and locked under UBLK_DEV_F_MLOCK_IO_BUFFER) here, before
    // any request; the kernel addresses them by tag.
    let mut bufs = dev.alloc_queue_io_bufs();
    let queue = match UblkQueue::new(qid, dev)
        .and_then(|q| q.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs))))
    {
        Ok(q) => q,
        Err(e) => {
            eprintln!("uzram: ublk queue {qid}: {e}");
            return;
        }
    };
    queue.wait_and_handle_io(move |q: &UblkQueue, tag: u16, io: &UblkIOCtx| {
        if io.is_first_cqe() {
            counters.wakes.fetch_add(1, Ordering::Relaxed);
        }
        let buf = bufs[tag as usize].as_mut_slice();
        let started = Instant::now();
        let res = serve_request(device, q.get_iod(tag), buf);
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        counters.serve_ns.fetch_add(ns, Ordering::Relaxed);
        counters.requests.fetch_add(1, Ordering::Relaxed);
        q.complete_io_cmd_unified(
            tag,
            BufDesc::Slice(bufs[tag as usize].as_slice()),
            Ok(UblkIORes::Result(res)),
        )
        .unwrap_or_else(|e| eprintln!("uzram: ublk queue {qid}: completing tag {tag}: {e}"));
    });
}

/// Serves one request; the result for the kernel: bytes done, or a negative errno.
fn serve_request(device: &dyn BlockDevice, iod: &sys::ublksrv_io_desc, buf: &mut [u8]) -> i32 {
    let op = iod.op_flags & 0xff;
    let offset = iod.start_sector << 9;
    let len = u64::from(iod.nr_sectors) << 9;
    let data = |buf_len: usize| -> std::result::Result<usize, i32> {
        usize::try_from(len)
            .ok()
            .filter(|&n| n <= buf_len)
            .ok_or(-libc::EINVAL)
    };
    let done = |r: Result<()>, n: u64| match r {
        Ok(()) => i32::try_from(n).unwrap_or(i32::MAX),
        Err(e) => -e.errno(),
    };
    match op {
        sys::UBLK_IO_OP_READ => match data(buf.len()) {
            Ok(n) => done(device.read_at(&mut buf[..n], offset), len),
            Err(e) => e,
        },
        sys::UBLK_IO_OP_WRITE => match data(buf.len()) {
            Ok(n) => {
                let mut r = device.write_at(&buf[..n], offset);
                if r.is_ok() && iod.op_flags & sys::UBLK_IO_F_FUA != 0 {
                    r = device.flush();
                }
                done(r, len)
            }
            Err(e) => e,
        },
        sys::UBLK_IO_OP_FLUSH => done(device.flush(), 0),
        sys::UBLK_IO_OP_DISCARD => done(device.discard(offset, len), 0),
        sys::UBLK_IO_OP_WRITE_ZEROES => done(device.write_zeroes(offset, len), 0),
        _ => -libc::EOPNOTSUPP,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_driver_is_one_line_naming_the_module() {
        let e = check_control(Path::new("/dev/uzram-test-no-such-control")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoDevice);
        let text = e.to_string();
        assert!(!text.contains('\n'), "{text}");
        assert!(text.contains("modprobe ublk_drv"), "{text}");
        check_control(Path::new("/dev/null")).unwrap();
    }
}
