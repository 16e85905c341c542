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

/// With user recovery: the block layer's request timeout for `/dev/ublkbN`
/// (`queue/io_timeout`), in milliseconds. While the server lives, ublk's timeout handler only
/// restarts the timer; once it has died with every tag of a queue dispatched to it (swap
/// under pressure keeps them all busy), that handler is what notices and lets the queue be
/// quiesced, so the next server can take the device over after this long rather than the
/// kernel's default 30 s (seen: one takeover in ten took 31 s).
const RECOVERY_IO_TIMEOUT_MS: u32 = 1000;

fn short_io_timeout(dev_id: u32) {
    let attr = format!("/sys/block/ublkb{dev_id}/queue/io_timeout");
    let _ = std::fs::write(attr, RECOVERY_IO_TIMEOUT_MS.to_string());
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
    /// The devices' state outlives the server (a keeper or systemd's fd store holds it):
    /// block devices are added with user recovery (`UBLK_F_USER_RECOVERY` with
    /// `UBLK_F_USER_RECOVERY_REISSUE`), so that when the server dies `/dev/ublkbN` stays, its
    /// I/O waits, and the next server takes it over ([`UblkExport::recover`]).
    pub user_recovery: bool,
}

impl Default for UblkConfig {
    fn default() -> UblkConfig {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        UblkConfig {
            nr_queues: cpus.clamp(1, MAX_DEFAULT_QUEUES as usize) as u16,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            io_buf_bytes: IO_BUF_BYTES,
            swap: false,
            user_recovery: false,
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
    /// Taken over from a dead server: how long the kernel took to let its queues go.
    takeover_wait: Option<Duration>,
}

impl std::fmt::Debug for UblkExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UblkExport")
            .field("dev_id", &self.dev_id)
            .finish_non_exhaustive()
    }
}

/// How [`UblkExport::run`] adds or recovers a device.
#[derive(Debug, Clone, Copy)]
struct Setup {
    /// The device number to add (-1: the kernel picks) or to recover.
    id: i32,
    nr_queues: u16,
    depth: u16,
    io_buf_bytes: u32,
    /// `UBLK_F_*` flags for the driver.
    ctrl_flags: u64,
    /// [`device_tag`], in `ublksrv_flags`.
    tag: u64,
    /// libublk's: add or recover.
    flags: UblkFlags,
    swap: bool,
}

/// A device that can be a ublk device: initialised, its page size a power of two from 4 KiB.
fn check_device(name: &str, device: &dyn BlockDevice) -> Result<()> {
    let page = device.page_size_bytes() as u64;
    if device.size_bytes() == 0 {
        return Err(Error::invalid(format!(
            "ublk: {name}: the device has no disksize"
        )));
    }
    if !page.is_power_of_two() || page < 4096 {
        return Err(Error::invalid(format!(
            "ublk: {name}: page size {page} is not a power of two of at least 4096"
        )));
    }
    Ok(())
}

/// What uzram writes into a ublk device's `ublksrv_flags` (the server's own word, kept by the
/// kernel for the device's life) for the device named `name`: `uzrm` in the high 32 bits, a
/// hash of the name (FNV-1a) in the low ones. [`UblkExport::recover`] takes over only a
/// device with the tag of the one it serves.
pub fn device_tag(name: &str) -> u64 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    (u64::from(u32::from_be_bytes(*b"uzrm")) << 32) | u64::from(h)
}

/// Which ublk device a server process serves a device as, kept in a file beside the device's
/// control socket (`NAME.ublk`) while user recovery is on, so that the next process finds the
/// block device to take over ([`UblkExport::recover`]): `ublk_dev_id N` and `server_pid P`
/// lines. Written whole to a temporary file and renamed, so a crash leaves the old record or
/// the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UblkRecord {
    /// `/dev/ublkbN`'s N.
    pub dev_id: u32,
    /// The process that served it.
    pub server_pid: i32,
}

impl UblkRecord {
    /// The record at `path`; `None` if there is none or it does not parse.
    pub fn read(path: &Path) -> Option<UblkRecord> {
        fn field<T: std::str::FromStr>(text: &str, key: &str) -> Option<T> {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
        }
        let text = std::fs::read_to_string(path).ok()?;
        Some(UblkRecord {
            dev_id: field(&text, "ublk_dev_id")?,
            server_pid: field(&text, "server_pid")?,
        })
    }

    /// Writes the record to `path` (a temporary file beside it, renamed over it).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("ublk.tmp");
        std::fs::write(
            &tmp,
            format!(
                "ublk_dev_id {}\nserver_pid {}\n",
                self.dev_id, self.server_pid
            ),
        )?;
        std::fs::rename(&tmp, path)
    }
}

/// Deletes ublk device `dev_id` if it is one a dead server left for user recovery under
/// `tag`, served by `server_pid` (its requests waiting for a server that will not come: they
/// fail now); anything else is left alone. Whether it deleted it.
pub fn delete_left_device(dev_id: u32, server_pid: i32, tag: u64) -> bool {
    if check_driver().is_err() {
        return false;
    }
    ensure_ctrl_ring();
    let Ok(id) = i32::try_from(dev_id) else {
        return false;
    };
    let Ok(ctrl) = UblkCtrl::new_simple(id) else {
        return false;
    };
    let info = ctrl.dev_info();
    if info.ublksrv_flags != tag || info.ublksrv_pid != server_pid || process_alive(server_pid) {
        return false;
    }
    let _ = ctrl.kill_dev();
    ctrl.del_dev().is_ok()
}

/// Whether process `pid` exists (signal 0 reaches it, or it is another user's).
fn process_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// log2 of a power of two.
fn shift(n: u64) -> u8 {
    debug_assert!(n.is_power_of_two());
    n.trailing_zeros() as u8
}

impl UblkExport {
    /// Adds a ublk device serving `device` and starts it; returns once `/dev/ublkbN` exists.
    /// The device must be initialised (a nonzero `disksize`): a ublk device's size is fixed
    /// while it runs. `tag` ([`device_tag`]) is written into the device's `ublksrv_flags`,
    /// where [`recover`](Self::recover) checks it.
    pub fn start(
        name: &str,
        device: Arc<dyn BlockDevice>,
        cfg: &UblkConfig,
        tag: u64,
    ) -> Result<UblkExport> {
        check_driver()?;
        check_device(name, &*device)?;
        if cfg.nr_queues == 0 || cfg.queue_depth == 0 {
            return Err(Error::invalid(format!(
                "ublk: {name}: queues and queue depth must be positive"
            )));
        }
        let ctrl_flags = if cfg.user_recovery {
            u64::from(sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE)
        } else {
            0
        };
        let setup = Setup {
            id: -1,
            nr_queues: cfg.nr_queues,
            depth: cfg.queue_depth,
            io_buf_bytes: cfg.io_buf_bytes,
            ctrl_flags,
            tag,
            flags: UblkFlags::UBLK_DEV_F_ADD_DEV,
            swap: cfg.swap,
        };
        Self::run(name, device, setup, "adding the device")
    }

    /// Takes over ublk device `dev_id`, which a server of this device left when it died
    /// (`/dev/ublkbN` stayed, its I/O waiting): checks that it is that server's (its process
    /// `server_pid`, [`device_tag`] `tag`, user recovery, `device`'s size), then
    /// `START_USER_RECOVERY`, new queue threads with the device's own queue count and depth,
    /// `END_USER_RECOVERY`: the requests the dead server had not completed are issued again
    /// (`UBLK_F_USER_RECOVERY_REISSUE`), then the waiting ones. Returns once it serves.
    pub fn recover(
        name: &str,
        device: Arc<dyn BlockDevice>,
        cfg: &UblkConfig,
        dev_id: u32,
        server_pid: i32,
        tag: u64,
    ) -> Result<UblkExport> {
        check_driver()?;
        check_device(name, &*device)?;
        ensure_ctrl_ring();
        // From here to START_USER_RECOVERY's success: the kernel letting the dead server's
        // queues go (control commands wait for it too).
        let waited = Instant::now();
        let what = format!("{name}: taking over /dev/ublkb{dev_id}");
        let id = i32::try_from(dev_id).map_err(|_| Error::invalid("ublk: no such device"))?;
        let old = UblkCtrl::new_simple(id).map_err(|e| ublk_error(&what, e))?;
        let info = old.dev_info();
        let mut params = sys::ublk_params::default();
        old.get_params(&mut params)
            .map_err(|e| ublk_error(&what, e))?;
        let size = params.basic.dev_sectors << 9;
        let recovery = u64::from(sys::UBLK_F_USER_RECOVERY);
        let wrong = if process_alive(server_pid) {
            Some(format!(
                "its server, process {server_pid}, is still running"
            ))
        } else if info.ublksrv_flags != tag {
            Some("it is not this device's (another tag)".to_string())
        } else if info.ublksrv_pid != server_pid {
            Some(format!(
                "it was served by process {}, not {server_pid}",
                info.ublksrv_pid
            ))
        } else if info.flags & recovery == 0 {
            Some("it was added without user recovery".to_string())
        } else if size != device.size_bytes() {
            Some(format!(
                "its size is {size} bytes, the device's {}",
                device.size_bytes()
            ))
        } else if u32::from(info.state) == sys::UBLK_S_DEV_DEAD {
            Some("it is stopped".to_string())
        } else {
            None
        };
        if let Some(why) = wrong {
            return Err(Error::invalid(format!("ublk: {what}: {why}")));
        }
        // Waits (EBUSY, up to 30 s) until the kernel has let the dead server's queues go.
        let rc = old
            .start_user_recover()
            .map_err(|e| ublk_error(&format!("{what}: START_USER_RECOVERY"), e))?;
        if rc < 0 {
            return Err(ublk_error(
                &format!("{what}: START_USER_RECOVERY"),
                UblkError::OtherError(rc),
            ));
        }
        let setup = Setup {
            id,
            nr_queues: info.nr_hw_queues,
            depth: info.queue_depth,
            io_buf_bytes: info.max_io_buf_bytes,
            ctrl_flags: info.flags
                & u64::from(sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE),
            tag,
            flags: UblkFlags::UBLK_DEV_F_RECOVER_DEV,
            swap: cfg.swap,
        };
        let waited = waited.elapsed();
        let mut export = Self::run(name, device, setup, "recovering the device")?;
        export.takeover_wait = Some(waited);
        Ok(export)
    }

    /// For a device taken over ([`recover`](Self::recover)): how long `START_USER_RECOVERY`
    /// waited for the kernel to let the dead server's queues go.
    pub fn takeover_wait(&self) -> Option<Duration> {
        self.takeover_wait
    }

    /// Adds or recovers a device as `setup` says and runs its queues on a thread of its own;
    /// returns once it serves.
    fn run(
        name: &str,
        device: Arc<dyn BlockDevice>,
        setup: Setup,
        doing: &'static str,
    ) -> Result<UblkExport> {
        let size = device.size_bytes();
        let page = device.page_size_bytes() as u64;
        let mut flags = setup.flags;
        if setup.swap {
            flags |= UblkFlags::UBLK_DEV_F_MLOCK_IO_BUFFER;
        }
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
                    .id(setup.id)
                    .nr_queues(setup.nr_queues)
                    .depth(setup.depth)
                    .io_buf_bytes(setup.io_buf_bytes)
                    .ctrl_flags(setup.ctrl_flags)
                    .ctrl_target_flags(setup.tag)
                    .dev_flags(flags)
                    .build()
                {
                    Ok(c) => Arc::new(c),
                    Err(e) => {
                        let _ = tx.send(Err(ublk_error(&format!("{name2}: {doing}"), e)));
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
                if setup.swap {
                    no_writeback_throttling(dev_id);
                }
                if setup.ctrl_flags & u64::from(sys::UBLK_F_USER_RECOVERY) != 0 {
                    short_io_timeout(dev_id);
                }
                Ok(UblkExport {
                    dev_id,
                    ctrl,
                    counters,
                    thread: Some(thread),
                    takeover_wait: None,
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

    /// Leaves the device to the next server of this device (a stop for a restart, with user
    /// recovery on): nothing is stopped or deleted; the queue threads serve on until the
    /// process exits, when the kernel quiesces the device (`/dev/ublkbN` stays, its requests
    /// wait) for the next server to take over ([`recover`](Self::recover)). Returns
    /// `/dev/ublkbN`.
    pub fn leave(mut self) -> PathBuf {
        self.ctrl.disown();
        let path = self.block_dev_path();
        // Detached: the thread runs until the process ends.
        self.thread.take();
        path
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

    #[test]
    fn the_record_reads_back_and_a_broken_one_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("zram0.ublk");
        assert_eq!(UblkRecord::read(&path), None);
        let r = UblkRecord {
            dev_id: 7,
            server_pid: 4242,
        };
        r.write(&path).unwrap();
        assert_eq!(UblkRecord::read(&path), Some(r));
        assert!(!path.with_extension("ublk.tmp").exists());
        std::fs::write(&path, "ublk_dev_id 7\n").unwrap();
        assert_eq!(UblkRecord::read(&path), None, "no server_pid");
        std::fs::write(&path, "ublk_dev_id x\nserver_pid 1\n").unwrap();
        assert_eq!(UblkRecord::read(&path), None, "not a number");
    }

    #[test]
    fn tags_carry_uzrm_and_tell_names_apart() {
        let t = device_tag("zram0");
        assert_eq!(t >> 32, u64::from(u32::from_be_bytes(*b"uzrm")));
        assert_ne!(t, device_tag("zram1"));
        assert_eq!(t, device_tag("zram0"));
    }

    #[test]
    fn a_live_process_is_alive_and_a_reaped_one_is_not() {
        assert!(process_alive(std::process::id() as i32));
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id() as i32;
        c.wait().unwrap();
        assert!(!process_alive(pid));
        assert!(!process_alive(0));
    }
}
