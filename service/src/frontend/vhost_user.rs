//! The vhost-user-blk frontend: a device handed to a VM's virtio-blk driver through a
//! vhost-user socket (`uzram serve --vhost-user`), with the rust-vmm crates (`vhost`,
//! `vhost-user-backend`, `virtio-queue`, `vm-memory`). QEMU (or cloud-hypervisor) connects to
//! `NAME.vhost.sock`, shares the guest's memory (memfd) and gives us its virtqueues; we read
//! requests from the queues, serve them with the [`BlockDevice`] straight out of and into
//! guest memory, and kick the guest. Design and what is trusted: `docs/vhost-user.md`.
//!
//! Threads: one *connection thread* per device accepts one front end at a time and runs its
//! vhost-user messages (inside `vhost-user-backend`); one *queue thread* per virtqueue
//! ([`VhostUserConfig::nr_queues`], made for each connection and joined when it ends) serves
//! that queue's requests synchronously, until its ring is empty or the connection has ended.
//!
//! Nothing the guest gives is trusted: every descriptor is checked to lie in guest memory
//! (`vm-memory`'s `check_range`) before anything is served (a chain with one outside is
//! returned unused); then [`virtio_blk::parse`](super::virtio_blk::parse) applies the
//! virtio-blk spec's rules to the chain's shape and first bytes (a chain without a byte for the
//! status is returned unused, a malformed request gets `VIRTIO_BLK_S_IOERR`, one the device
//! does not offer `VIRTIO_BLK_S_UNSUPP`). Serving a request allocates nothing: its
//! descriptors go into two lists of a fixed capacity per queue and its data through one
//! bounce buffer per queue of [`BOUNCE_BYTES`] (all made when the export starts), a chunk at
//! a time, copied with `vm-memory`'s checked `read_slice`/`write_slice`.

use parking_lot::{Mutex, RwLock};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use uzram::error::{Error, Result};
use uzram::BlockDevice;

use super::virtio_blk::{self, BlkRequest, Chain, HEAD_BYTES, OUTHDR_BYTES, SECTOR_SHIFT};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserBackend, VhostUserDaemon, VringRwLock, VringT};
use virtio_bindings::virtio_blk as blk;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::{DescriptorChain, QueueT};
use vm_memory::{
    Bytes, GuestAddress, GuestAddressSpace, GuestMemory, GuestMemoryAtomic, GuestMemoryLoadGuard,
    GuestMemoryMmap, Permissions,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

/// Descriptors per virtqueue, at most (the guest picks up to this).
pub const MAX_QUEUE_SIZE: usize = 256;

/// Segments per request the guest may use (`seg_max`): a virtqueue of 256 less the header
/// and status descriptors.
pub const SEG_MAX: u32 = 254;

/// Each queue's bounce buffer: data moves between guest memory and the device this much at a
/// time.
pub const BOUNCE_BYTES: usize = 128 << 10;

/// The most queues by default (one per CPU up to this).
pub const MAX_DEFAULT_QUEUES: u16 = 16;

/// How a vhost-user-blk export is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VhostUserConfig {
    /// Virtqueues offered (the guest may use fewer), each served by its own thread.
    pub nr_queues: u16,
    /// Serving swap: the bounce buffers are locked with the rest of the server (`mlockall`),
    /// but not the guest's memory (see `unlock_guest_memory`).
    pub swap: bool,
}

impl Default for VhostUserConfig {
    fn default() -> VhostUserConfig {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        VhostUserConfig {
            nr_queues: cpus.clamp(1, MAX_DEFAULT_QUEUES as usize) as u16,
            swap: false,
        }
    }
}

/// The socket beside a device's NBD socket: `NAME.vhost.sock`.
pub fn socket_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.vhost.sock"))
}

type Mem = GuestMemoryAtomic<GuestMemoryMmap>;

/// The `VhostUserBackend`: the device, its virtio config space and the queues' buffers.
struct BlkBackend {
    device: Arc<dyn BlockDevice>,
    name: String,
    nr_queues: u16,
    /// `--swap`: the server's memory is locked (`mlockall`); the guest's is unlocked again.
    swap: bool,
    /// Guest memory, replaced by each `SET_MEM_TABLE` (`update_memory`).
    mem: RwLock<Option<Mem>>,
    event_idx: AtomicBool,
    /// Each queue's buffers; queue `i`'s are locked only by queue `i`'s thread.
    queue_buffers: Vec<Mutex<QueueBuffers>>,
    /// The notifiers that stop the current daemon's queue threads, one per thread.
    exits: Mutex<Vec<EventNotifier>>,
    /// Set when a front end's connection ends (`end_connection`), cleared by the connection
    /// thread before it accepts the next one (by then the old queue threads have been
    /// joined). A queue thread checks it before every request it takes: a guest that keeps
    /// its ring full (its memory is still mapped after its front end is gone) cannot keep the
    /// thread serving, and with it the connection's teardown (which joins the thread) or
    /// `stop` waiting, forever.
    conn_ended: AtomicBool,
}

impl BlkBackend {
    fn config_space(&self) -> Vec<u8> {
        let page = self.device.page_size_bytes() as u32;
        let mut c = vec![0u8; 60];
        let sectors = self.device.size_bytes() >> SECTOR_SHIFT;
        c[0..8].copy_from_slice(&sectors.to_le_bytes());
        c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        c[20..24].copy_from_slice(&page.to_le_bytes()); // blk_size
        c[32] = 1; // wce: a write-back cache (flush reaches the device's writeback)
        c[34..36].copy_from_slice(&self.nr_queues.to_le_bytes());
        let max = u32::MAX >> SECTOR_SHIFT;
        c[36..40].copy_from_slice(&max.to_le_bytes()); // max_discard_sectors
        c[40..44].copy_from_slice(&1u32.to_le_bytes()); // max_discard_seg
        c[44..48].copy_from_slice(&(page >> SECTOR_SHIFT).to_le_bytes()); // discard alignment
        c[48..52].copy_from_slice(&max.to_le_bytes()); // max_write_zeroes_sectors
        c[52..56].copy_from_slice(&1u32.to_le_bytes()); // max_write_zeroes_seg
        c[56] = 1; // write_zeroes_may_unmap
        c
    }

    /// After a front end left: stops its daemon's queue threads and drops its guest memory.
    fn end_connection(&self) {
        self.conn_ended.store(true, Ordering::Release);
        for n in self.exits.lock().drain(..) {
            let _ = n.notify();
        }
        *self.mem.write() = None;
    }

    /// Serves what queue `vring` holds; returns whether it took any request from the ring
    /// and whether the guest must be kicked.
    fn process_queue(&self, thread_id: usize, vring: &VringRwLock) -> Served {
        let mut served = Served::default();
        let Some(atomic) = self.mem.read().clone() else {
            return served;
        };
        let mem = atomic.memory();
        let Some(bufs) = self.queue_buffers.get(thread_id) else {
            return served;
        };
        let mut bufs = bufs.lock();
        // Not past the end of the connection (`conn_ended`): the ring may never run empty.
        while !self.conn_ended.load(Ordering::Acquire) {
            let chain = vring
                .get_mut()
                .get_queue_mut()
                .pop_descriptor_chain(mem.clone());
            let Some(chain) = chain else { break };
            served.taken = true;
            let head = chain.head_index();
            let len = self.serve_chain(&mem, chain, &mut bufs);
            // A head index past the queue (a broken driver) has no used entry to take: the
            // chain is consumed and dropped, and the requests after it are still served.
            if vring.add_used(head, len).is_ok() {
                served.used = true;
            }
        }
        served
    }

    /// Serves one request; returns the bytes written into guest memory (data and status).
    fn serve_chain(
        &self,
        mem: &GuestMemoryLoadGuard<GuestMemoryMmap>,
        chain: DescriptorChain<GuestMemoryLoadGuard<GuestMemoryMmap>>,
        bufs: &mut QueueBuffers,
    ) -> u32 {
        let QueueBuffers {
            bounce,
            readable,
            writable,
        } = bufs;
        readable.clear();
        writable.clear();
        // The chain's device-readable and device-writable descriptors, each checked to lie in
        // guest memory; the last byte of the writable ones is the status.
        let mut too_long = false;
        let (mut seen_writable, mut readable_after_writable) = (false, false);
        let mut last_writable: Option<Segment> = None;
        for desc in chain {
            let seg = Segment {
                addr: desc.addr().0,
                len: desc.len(),
            };
            let access = if desc.is_write_only() {
                Permissions::Write
            } else {
                Permissions::Read
            };
            if !mem.check_range(desc.addr(), desc.len() as usize, access) {
                // A descriptor outside guest memory: we cannot trust the chain to locate the
                // status byte, so the request is returned unused.
                return 0;
            }
            let list = if desc.is_write_only() {
                seen_writable = true;
                if seg.len > 0 {
                    last_writable = Some(seg);
                }
                &mut *writable
            } else {
                readable_after_writable |= seen_writable;
                &mut *readable
            };
            // Never past the capacity made at start: no allocation per request.
            if list.len() == list.capacity() {
                too_long = true;
            } else {
                list.push(seg);
            }
        }
        let Some(last) = last_writable else {
            // No writable byte: nowhere to put a status.
            return 0;
        };
        let status_addr = GuestAddress(last.addr + u64::from(last.len) - 1);
        // The data part of the writable descriptors: all but the status byte, which is the
        // last byte of the last non-empty one.
        if let Some(i) = writable.iter().rposition(|s| s.len > 0) {
            writable[i].len -= 1;
            writable.truncate(i + 1);
        }
        let req = Request {
            mem,
            readable,
            writable,
        };
        // The header and a segment, for the parser.
        let mut head = [0u8; HEAD_BYTES];
        let head_len = req.readable_bytes().min(HEAD_BYTES as u64) as usize;
        let mut written = 0u32;
        let code = match req.read(0, &mut head[..head_len]) {
            Err(()) => blk::VIRTIO_BLK_S_IOERR as u8,
            Ok(()) => {
                let chain = Chain {
                    head: &head[..head_len],
                    readable_bytes: req.readable_bytes(),
                    writable_bytes: req.writable_bytes(),
                    has_status: true,
                    readable_after_writable,
                    too_many_segments: too_long,
                };
                match virtio_blk::parse(&chain, self.device.size_bytes()) {
                    Ok(parsed) => match self.serve_request(parsed, &req, bounce, &mut written) {
                        Ok(()) => blk::VIRTIO_BLK_S_OK as u8,
                        Err(()) => blk::VIRTIO_BLK_S_IOERR as u8,
                    },
                    Err(refused) => match refused.status() {
                        Some(code) => code,
                        None => return 0,
                    },
                }
            }
        };
        if mem.write_slice(&[code], status_addr).is_err() {
            return written;
        }
        written + 1
    }

    /// Serves `parsed`, whose data is in `req`; `written` counts the data bytes written into
    /// guest memory. An error is the device's or guest memory's (`VIRTIO_BLK_S_IOERR`).
    fn serve_request(
        &self,
        parsed: BlkRequest,
        req: &Request<'_>,
        bounce: &mut [u8],
        written: &mut u32,
    ) -> std::result::Result<(), ()> {
        let dev = &*self.device;
        let err = |_| ();
        match parsed {
            BlkRequest::Read { mut offset, len } => {
                let mut done = 0u64;
                while done < len {
                    let n = (len - done).min(bounce.len() as u64) as usize;
                    dev.read_at(&mut bounce[..n], offset).map_err(err)?;
                    req.write(done, &bounce[..n])?;
                    *written += n as u32;
                    offset += n as u64;
                    done += n as u64;
                }
                Ok(())
            }
            BlkRequest::Write { mut offset, len } => {
                let mut done = 0u64;
                while done < len {
                    let n = (len - done).min(bounce.len() as u64) as usize;
                    req.read(OUTHDR_BYTES as u64 + done, &mut bounce[..n])?;
                    dev.write_at(&bounce[..n], offset).map_err(err)?;
                    offset += n as u64;
                    done += n as u64;
                }
                Ok(())
            }
            BlkRequest::Flush => dev.flush().map_err(err),
            BlkRequest::GetId { len } => {
                let mut id = [0u8; blk::VIRTIO_BLK_ID_BYTES as usize];
                let name = self.name.as_bytes();
                let n = name.len().min(id.len());
                id[..n].copy_from_slice(&name[..n]);
                let n = (id.len() as u64).min(len) as usize;
                req.write(0, &id[..n])?;
                *written += n as u32;
                Ok(())
            }
            BlkRequest::Discard { offset, len } => dev.discard(offset, len).map_err(err),
            BlkRequest::WriteZeroes { offset, len } => dev.write_zeroes(offset, len).map_err(err),
        }
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        usize::from(self.nr_queues)
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        let f = [
            VIRTIO_F_VERSION_1,
            VIRTIO_RING_F_EVENT_IDX,
            VIRTIO_RING_F_INDIRECT_DESC,
            blk::VIRTIO_BLK_F_SEG_MAX,
            blk::VIRTIO_BLK_F_BLK_SIZE,
            blk::VIRTIO_BLK_F_FLUSH,
            blk::VIRTIO_BLK_F_CONFIG_WCE,
            blk::VIRTIO_BLK_F_DISCARD,
            blk::VIRTIO_BLK_F_WRITE_ZEROES,
            blk::VIRTIO_BLK_F_MQ,
        ]
        .iter()
        .fold(0u64, |acc, &bit| acc | 1 << bit);
        f | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        // The front end asks for its own struct's size: answer exactly that many bytes,
        // zero past what we define.
        let space = self.config_space();
        let mut out = vec![0u8; size as usize];
        let start = (offset as usize).min(space.len());
        let end = (offset as usize)
            .saturating_add(size as usize)
            .min(space.len());
        out[..end - start].copy_from_slice(&space[start..end]);
        out
    }

    fn set_config(&self, _offset: u32, _buf: &[u8]) -> std::io::Result<()> {
        // The write-back cache setting: the device always has one; ignored.
        Ok(())
    }

    fn update_memory(&self, mem: Mem) -> std::io::Result<()> {
        // A region mapped past the end of its file would fault (SIGBUS, the whole server)
        // on the first access there: such a table is refused, and the queues stop until a
        // good one comes (the library has already swapped it into the vrings' view; the
        // refusal ends the connection).
        if let Err(e) = check_regions(&mem) {
            *self.mem.write() = None;
            return Err(e);
        }
        if self.swap {
            unlock_guest_memory(&mem);
        }
        *self.mem.write() = Some(mem);
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.nr_queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (consumer, notifier) = new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()?;
        self.exits.lock().push(notifier.try_clone().ok()?);
        Some((consumer, notifier))
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock],
        thread_id: usize,
    ) -> std::io::Result<()> {
        // Nothing here returns an error: vhost-user-backend's queue thread stops at the first
        // one for good, and the guest's requests on that queue would then wait forever (the
        // connection goes on). A kick's event set is IN (an eventfd has no other); anything
        // else only means the ring is looked at once more.
        let _ = evset;
        // `vrings` are this thread's (one: `queues_per_thread`), and `device_event` indexes
        // them; the thread's index is the queue's, and picks its bounce buffer.
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            return Ok(());
        };
        if self.mem.read().is_none() {
            // No guest memory we accepted (none yet, or a table refused by `update_memory`):
            // the queue's rings are not touched.
            return Ok(());
        }
        if self.event_idx.load(Ordering::Relaxed) {
            // Serve, re-enable notifications, and serve again what arrived in between.
            // The loop ends when a pass takes nothing from the ring: a queue stopped
            // (GET_VRING_BASE) between the kick and this pass pops nothing while its avail index
            // still differs from its next one, and an avail ring we cannot read pops nothing
            // either; neither may spin this thread (and with it the connection's teardown).
            loop {
                let _ = vring.disable_notification();
                let served = self.process_queue(thread_id, vring);
                if served.used && vring.needs_notification().unwrap_or(true) {
                    signal(vring);
                }
                if !served.taken {
                    let _ = vring.enable_notification();
                    break;
                }
                match vring.enable_notification() {
                    Ok(true) => continue,
                    _ => break,
                }
            }
        } else if self.process_queue(thread_id, vring).used {
            signal(vring);
        }
        Ok(())
    }
}

/// Kicks the guest (its call eventfd). A failure (the front end's eventfd gone or full) is
/// not the queue thread's end: the next used entry signals again. Reported once per process.
fn signal(vring: &VringRwLock) {
    static REPORTED: AtomicBool = AtomicBool::new(false);
    if let Err(e) = vring.signal_used_queue() {
        if !REPORTED.swap(true, Ordering::Relaxed) {
            eprintln!("uzram: vhost-user: signalling the guest: {e} (reported once)");
        }
    }
}

/// The most descriptors of each direction a request may have: `SEG_MAX` data segments plus
/// the header (readable) or the status (writable).
pub const CHAIN_SEGMENTS_MAX: usize = SEG_MAX as usize + 2;

/// One descriptor's buffer in guest memory, checked to lie in it when the chain was read.
#[derive(Debug, Clone, Copy)]
struct Segment {
    addr: u64,
    len: u32,
}

/// A queue's buffers, made when the export starts and reused by every request (nothing is
/// allocated per request): the bounce buffer and a request's descriptor lists.
struct QueueBuffers {
    bounce: Box<[u8]>,
    /// The device-readable descriptors of the request being served (capacity
    /// [`CHAIN_SEGMENTS_MAX`], never grown).
    readable: Vec<Segment>,
    /// Its device-writable descriptors less the status byte (same capacity).
    writable: Vec<Segment>,
}

impl QueueBuffers {
    fn new() -> QueueBuffers {
        QueueBuffers {
            bounce: vec![0u8; BOUNCE_BYTES].into_boxed_slice(),
            readable: Vec::with_capacity(CHAIN_SEGMENTS_MAX),
            writable: Vec::with_capacity(CHAIN_SEGMENTS_MAX),
        }
    }
}

/// A request's buffers as one readable and one writable byte stream.
struct Request<'a> {
    mem: &'a GuestMemoryMmap,
    readable: &'a [Segment],
    writable: &'a [Segment],
}

impl Request<'_> {
    fn readable_bytes(&self) -> u64 {
        self.readable.iter().map(|s| u64::from(s.len)).sum()
    }

    fn writable_bytes(&self) -> u64 {
        self.writable.iter().map(|s| u64::from(s.len)).sum()
    }

    /// Bytes `[at, at + buf.len())` of the readable stream into `buf`; an error when the
    /// stream is shorter.
    fn read(&self, at: u64, buf: &mut [u8]) -> std::result::Result<(), ()> {
        let mut done = 0;
        for_each_part(self.readable, at, buf.len(), |addr, n| {
            let r = self.mem.read_slice(&mut buf[done..done + n], addr);
            done += n;
            r.map_err(|_| ())
        })
    }

    /// `data` into bytes `[at, at + data.len())` of the writable stream; an error when the
    /// stream is shorter.
    fn write(&self, at: u64, data: &[u8]) -> std::result::Result<(), ()> {
        let mut done = 0;
        for_each_part(self.writable, at, data.len(), |addr, n| {
            let r = self.mem.write_slice(&data[done..done + n], addr);
            done += n;
            r.map_err(|_| ())
        })
    }
}

/// Calls `f(address, length)` for each piece of `segs` that bytes `[at, at + len)` of their
/// concatenation cover, in order; an error when they end before `at + len`.
fn for_each_part(
    segs: &[Segment],
    mut at: u64,
    len: usize,
    mut f: impl FnMut(GuestAddress, usize) -> std::result::Result<(), ()>,
) -> std::result::Result<(), ()> {
    let mut left = len;
    for s in segs {
        if left == 0 {
            break;
        }
        let seg_len = u64::from(s.len);
        if at >= seg_len {
            at -= seg_len;
            continue;
        }
        let n = ((seg_len - at) as usize).min(left);
        f(GuestAddress(s.addr + at), n)?;
        left -= n;
        at = 0;
    }
    if left == 0 {
        Ok(())
    } else {
        Err(())
    }
}

/// What one pass over a queue did.
#[derive(Default)]
struct Served {
    /// Some request was taken from the avail ring.
    taken: bool,
    /// Some request got a used entry: the guest is to be kicked.
    used: bool,
}

/// Every region of `mem` lies inside its file (`SET_MEM_TABLE` gives sizes and offsets that
/// `mmap` does not check against the file: an access past the end raises SIGBUS).
fn check_regions(mem: &Mem) -> std::io::Result<()> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    for region in mem.memory().iter() {
        let Some(fo) = region.file_offset() else {
            return Err(std::io::Error::other(
                "a guest memory region without a file",
            ));
        };
        let file_bytes = fo.file().metadata()?.len();
        let end = fo.start().checked_add(region.len());
        if !matches!(end, Some(end) if end <= file_bytes) {
            return Err(std::io::Error::other(format!(
                "a guest memory region of {} bytes at file offset {} past the end of its \
                 file ({file_bytes} bytes)",
                region.len(),
                fo.start()
            )));
        }
    }
    Ok(())
}

/// Under `--swap` (`mlockall(MCL_FUTURE | MCL_ONFAULT)`, `frontend::swap`) every new mapping
/// is locked as it is touched, the guest's memory too: each page a request's data passed
/// through would stay locked in RAM for as long as the guest runs, up to the whole guest,
/// charged to the server. The guest's memory is the front end's (QEMU locks it or not:
/// `-overcommit mem-lock=on`), and the server needs none of it locked to make progress (a
/// fault on it is a fault QEMU's own threads take too), so its regions are unlocked
/// (`munlock` clears the lock-on-fault mark). Best effort: a failure only leaves them locked.
fn unlock_guest_memory(mem: &Mem) {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
    for region in mem.memory().iter() {
        let Ok(addr) = region.get_host_address(MemoryRegionAddress(0)) else {
            continue;
        };
        // SAFETY: munlock only changes the locking of the pages of [addr, addr + len), which
        // is exactly this region's mapping (made by vm-memory, alive while `mem` is); it
        // reads and writes no memory.
        let rc = unsafe { libc::munlock(addr.cast(), region.len() as usize) };
        if rc != 0 {
            eprintln!(
                "uzram: vhost-user: munlock of guest memory: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

type Daemon = VhostUserDaemon<Arc<BlkBackend>>;

fn new_daemon(name: &str, backend: &Arc<BlkBackend>) -> Result<Daemon> {
    VhostUserDaemon::new(
        format!("uzram-vhost-{name}"),
        Arc::clone(backend),
        GuestMemoryAtomic::new(GuestMemoryMmap::new()),
    )
    .map_err(|e| Error::io(format!("vhost-user: {name}: {e}")))
}

/// A device served on a vhost-user-blk socket. Dropping it stops it, as
/// [`VhostUserExport::stop`] does.
pub struct VhostUserExport {
    path: PathBuf,
    socket_id: crate::frontend::unix_socket::SocketId,
    stopping: Arc<AtomicBool>,
    /// Shuts the connected front end down; set while one is connected.
    connected: Arc<Mutex<Option<ShutdownHandle>>>,
    backend: Arc<BlkBackend>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for VhostUserExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserExport")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl VhostUserExport {
    /// Listens on `path` (a socket only we control) for a front end serving `device`.
    pub fn start(
        name: &str,
        path: &Path,
        device: Arc<dyn BlockDevice>,
        cfg: &VhostUserConfig,
    ) -> Result<VhostUserExport> {
        let page = device.page_size_bytes();
        if device.size_bytes() == 0 {
            return Err(Error::invalid(format!(
                "vhost-user: {name}: the device has no disksize"
            )));
        }
        if cfg.nr_queues == 0 || cfg.nr_queues > 64 || !page.is_power_of_two() {
            return Err(Error::invalid(format!(
                "vhost-user: {name}: 1 to 64 queues and a power-of-two page size"
            )));
        }
        let (listener, socket_id) = crate::frontend::unix_socket::bind_unix(path)?;
        let backend = Arc::new(BlkBackend {
            device,
            name: name.to_string(),
            nr_queues: cfg.nr_queues,
            swap: cfg.swap,
            mem: RwLock::new(None),
            event_idx: AtomicBool::new(false),
            queue_buffers: (0..cfg.nr_queues)
                .map(|_| Mutex::new(QueueBuffers::new()))
                .collect(),
            exits: Mutex::new(Vec::new()),
            conn_ended: AtomicBool::new(false),
        });
        // A daemon (its message handler and queue threads) per connection: the library's
        // handler keeps a front end's ownership after it disconnects, so a new front end is
        // given a new one. The first is made here, so that failing to make one is an error
        // of start().
        let first = new_daemon(name, &backend)?;
        let stopping = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stopping);
        let connected = Arc::new(Mutex::new(None));
        let connected2 = Arc::clone(&connected);
        let name2 = name.to_string();
        let backend2 = Arc::clone(&backend);
        let thread = std::thread::Builder::new()
            .name("uzram-vhost".into())
            .spawn(move || {
                let mut listener = Listener::from(listener);
                let mut next = Some(first);
                // One front end at a time; after it leaves (a guest that powers off, a QEMU
                // that restarts) the next one is accepted with the data kept.
                while !stop2.load(Ordering::Acquire) {
                    let mut daemon = match next
                        .take()
                        .map_or_else(|| new_daemon(&name2, &backend2), Ok)
                    {
                        Ok(d) => d,
                        Err(e) => {
                            eprintln!("uzram: {e}");
                            break;
                        }
                    };
                    // The previous connection's queue threads were joined when its daemon was
                    // dropped: the new ones may serve.
                    backend2.conn_ended.store(false, Ordering::Release);
                    if let Err(e) = daemon.start(&mut listener) {
                        // accept() failed (e.g. out of file descriptors, or a connection that
                        // aborted): the socket goes on accepting, after a pause so that a
                        // lasting failure does not spin.
                        backend2.end_connection();
                        if stop2.load(Ordering::Acquire) {
                            break;
                        }
                        eprintln!("uzram: vhost-user {name2}: accepting: {e}");
                        std::thread::sleep(std::time::Duration::from_millis(100));
                        continue;
                    }
                    {
                        // Under the lock: either stop() sees the handle, or we see `stopping`.
                        let mut c = connected2.lock();
                        *c = daemon.shutdown_handle();
                        if stop2.load(Ordering::Acquire) {
                            daemon.request_shutdown();
                        }
                    }
                    let r = daemon.wait();
                    *connected2.lock() = None;
                    match r {
                        // A front end that leaves (guest powered off, QEMU stopped or
                        // restarting) is the normal end of a connection.
                        Ok(())
                        | Err(vhost_user_backend::Error::HandleRequest(
                            vhost::vhost_user::Error::Disconnected
                            | vhost::vhost_user::Error::PartialMessage,
                        )) => {}
                        Err(e) if !stop2.load(Ordering::Acquire) => {
                            // A front end that broke the protocol: it is dropped, the
                            // socket goes on accepting.
                            eprintln!("uzram: vhost-user {name2}: front end dropped: {e}");
                        }
                        Err(_) => {}
                    }
                    // This connection's queue threads end, and its guest memory is unmapped.
                    backend2.end_connection();
                }
                drop(next);
                backend2.end_connection();
            })
            .map_err(|e| Error::io(format!("vhost-user: starting a thread: {e}")))?;
        Ok(VhostUserExport {
            path: path.to_path_buf(),
            socket_id,
            stopping,
            connected,
            backend,
            thread: Some(thread),
        })
    }

    /// The socket's path.
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// The socket file and its identity (for removal on a forced exit).
    pub fn socket_file(&self) -> (PathBuf, crate::frontend::unix_socket::SocketId) {
        (self.path.clone(), self.socket_id)
    }

    /// Whether a front end (a QEMU) is connected now (`hot_remove` is `EBUSY` then).
    pub fn is_connected(&self) -> bool {
        self.connected.lock().is_some()
    }

    /// Disconnects the front end, ends the threads and removes the socket.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        let Some(t) = self.thread.take() else { return };
        self.stopping.store(true, Ordering::Release);
        if let Some(h) = self.connected.lock().take() {
            h.shutdown();
        }
        // Wake the connection thread: a connection of our own ends a blocked accept (and is
        // dropped at once); a connected front end is shut down by the thread.
        let _ = UnixStream::connect(&self.path);
        let _ = t.join();
        self.backend.end_connection();
        crate::frontend::unix_socket::remove_if_ours(&self.path, self.socket_id);
    }
}

impl Drop for VhostUserExport {
    fn drop(&mut self) {
        self.stop_inner();
    }
}
