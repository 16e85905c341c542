//! The vhost-user-blk frontend: a device handed to a VM's virtio-blk driver through a
//! vhost-user socket (`uzram serve --vhost-user`), with the rust-vmm crates (`vhost`,
//! `vhost-user-backend`, `virtio-queue`, `vm-memory`). QEMU (or cloud-hypervisor) connects to
//! `NAME.vhost.sock`, shares the guest's memory (memfd) and gives us its virtqueues; we read
//! requests from the queues, serve them with the [`BlockDevice`] straight out of and into
//! guest memory, and kick the guest. Design and what is trusted: `docs/vhost-user.md`.
//!
//! The vhost-user messages are handled by our own [`Conn`] on the `vhost` crate's
//! `BackendReqHandler` (vhost-user-backend's handler answers `GET_INFLIGHT_FD` and
//! `SET_INFLIGHT_FD` as unsupported and cannot be extended); its `VringRwLock` holds each
//! queue's rings and eventfds.
//!
//! Threads: one *connection thread* per device accepts one front end at a time and runs its
//! vhost-user messages; one *queue thread* per virtqueue ([`VhostUserConfig::nr_queues`],
//! made for each connection and joined when it ends) serves that queue's requests
//! synchronously, until its ring is empty or the connection has ended.
//!
//! Across a restart of the server the front end keeps the *inflight region* (`vhost_inflight`)
//! and hands it to the next server, which serves the requests the dead one had taken and not
//! completed before any new one.
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

use parking_lot::Mutex;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use uzram::error::{Error, Result};
use uzram::BlockDevice;

use super::vhost_inflight as inflight;
use super::virtio_blk::{self, BlkRequest, Chain, HEAD_BYTES, OUTHDR_BYTES, SECTOR_SHIFT};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight,
    VhostUserLog, VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserSharedMsg, VhostUserSingleMemoryRegion, VhostUserVirtioFeatures,
    VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{
    BackendReqHandler, Error as VuError, GpuBackend, Result as VuResult,
    VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use vhost_user_backend::{VringRwLock, VringT};
use virtio_bindings::virtio_blk as blk;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueT;
use vm_memory::{
    Address, Bytes, GuestAddress, GuestAddressSpace, GuestMemory, GuestMemoryAtomic,
    GuestMemoryLoadGuard, GuestMemoryMmap, GuestRegionMmap, Permissions,
};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

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
    /// The connection's guest memory may be served: false between connections and after a
    /// table was refused. Each queue thread holds its own handle to that memory (a clone of
    /// the connection's `atomic_mem`, whose table each `SET_MEM_TABLE` replaces): serving
    /// reads this flag, not a lock and a reference count that every queue's thread would
    /// write.
    mem_accepted: AtomicBool,
    event_idx: AtomicBool,
    /// Each queue's state: locked by queue `i`'s thread for a whole pass, and by the
    /// connection thread while the queue starts or stops (so never while a request of it is
    /// being served).
    queues: Vec<Mutex<QueueState>>,
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

    /// After a front end left (its queue threads joined): drops its guest memory and its
    /// inflight region.
    fn end_connection(&self) {
        self.conn_ended.store(true, Ordering::Release);
        self.mem_accepted.store(false, Ordering::Release);
        for q in &self.queues {
            let mut st = q.lock();
            st.inflight = None;
            st.resubmit.clear();
            st.resubmit_next = 0;
        }
    }

    /// Serves what queue `vring` holds, requests to resubmit first; returns whether it took
    /// any request and whether the guest must be kicked. With an inflight region, each
    /// request is marked taken before it is served and before the next is read from the
    /// ring, and marked done around its used entry (the order `vhost_inflight` explains).
    fn process_queue(&self, q: usize, vring: &VringRwLock, atomic: &Mem) -> Served {
        let mut served = Served::default();
        if !self.mem_accepted.load(Ordering::Acquire) {
            return served;
        }
        // The queue thread's own handle (`arc-swap`'s load: no count shared with the other
        // queues moves), borrowed by every chain popped (a clone would move the mapping's
        // reference count, which every queue shares, twice per request).
        let mem = atomic.memory();
        let Some(st) = self.queues.get(q) else {
            return served;
        };
        let mut st = st.lock();
        let st = &mut *st;
        // Not past the end of the connection (`conn_ended`): the ring may never run empty.
        while !self.conn_ended.load(Ordering::Acquire) {
            let (ready, desc_table, size) = {
                let r = vring.get_ref();
                let queue = r.get_queue();
                (queue.ready(), queue.desc_table(), queue.size())
            };
            if !ready {
                break;
            }
            let head = if let Some(&head) = st.resubmit.get(st.resubmit_next) {
                // Taken by a previous back end and not completed: already marked.
                st.resubmit_next += 1;
                head
            } else {
                let chain = vring.get_mut().get_queue_mut().pop_descriptor_chain(&*mem);
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                if let Some(inflight) = &st.inflight {
                    inflight.take(head, st.counter);
                    st.counter = st.counter.wrapping_add(1);
                }
                head
            };
            served.taken = true;
            let chain = ChainWalker::new(&mem, desc_table, size, head);
            let len = self.serve_chain(&mem, chain, &mut st.bufs);
            if let Some(inflight) = &st.inflight {
                inflight.completing(head);
            }
            // A head index past the queue (a broken driver) has no used entry to take: the
            // chain is consumed and dropped, and the requests after it are still served.
            let used = {
                let mut w = vring.get_mut();
                let queue = w.get_queue_mut();
                queue
                    .add_used(&*mem, head, len)
                    .ok()
                    .map(|()| queue.next_used())
            };
            if let Some(used_idx) = used {
                served.used = true;
                if let Some(inflight) = &st.inflight {
                    inflight.completed(head, used_idx);
                }
            }
        }
        served
    }

    /// Serves one request; returns the bytes written into guest memory (data and status).
    fn serve_chain(
        &self,
        mem: &GuestMemoryLoadGuard<GuestMemoryMmap>,
        chain: ChainWalker<'_>,
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

impl BlkBackend {
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
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
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

    /// A pass of queue `q`'s thread, after a kick or a wake-up. Nothing here fails: a queue
    /// thread that stopped would leave the guest's requests on that queue waiting forever.
    fn run_queue(&self, q: usize, vring: &VringRwLock, mem: &Mem) {
        if !self.mem_accepted.load(Ordering::Acquire) {
            // No guest memory we accepted (none yet, or a table refused): the queue's rings
            // are not touched.
            return;
        }
        if self.event_idx.load(Ordering::Relaxed) {
            // Serve, re-enable notifications, and serve again what arrived in between.
            // The loop ends when a pass takes nothing from the ring: a queue stopped
            // (GET_VRING_BASE) between the kick and this pass pops nothing while its avail index
            // still differs from its next one, and an avail ring we cannot read pops nothing
            // either; neither may spin this thread (and with it the connection's teardown).
            loop {
                let _ = vring.disable_notification();
                let served = self.process_queue(q, vring, mem);
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
        } else if self.process_queue(q, vring, mem).used {
            signal(vring);
        }
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

/// The descriptors of the chain whose head is `head`, walked by the virtio spec's rules for
/// split virtqueues (2.7.5): `NEXT` links within the table, an `INDIRECT` descriptor switches
/// to its table (a multiple of 16 bytes, not nested); the walk ends at a descriptor it cannot
/// read, after as many descriptors as the table holds (a loop), or when the chain's bytes
/// would pass 2^32. Any head is accepted (a resubmitted request's is not popped from the
/// available ring); one past the table yields nothing.
struct ChainWalker<'a> {
    mem: &'a GuestMemoryMmap,
    table: GuestAddress,
    table_len: u16,
    next: u16,
    /// Descriptors left before the walk ends (the table's length: more is a loop).
    ttl: u16,
    indirect: bool,
    bytes: u32,
}

impl<'a> ChainWalker<'a> {
    fn new(mem: &'a GuestMemoryMmap, desc_table: u64, queue_size: u16, head: u16) -> Self {
        ChainWalker {
            mem,
            table: GuestAddress(desc_table),
            table_len: queue_size,
            next: head,
            ttl: queue_size,
            indirect: false,
            bytes: 0,
        }
    }
}

impl Iterator for ChainWalker<'_> {
    type Item = Descriptor;

    fn next(&mut self) -> Option<Descriptor> {
        loop {
            if self.ttl == 0 || self.next >= self.table_len {
                return None;
            }
            let at = self.table.checked_add(u64::from(self.next) * 16)?;
            let desc: Descriptor = self.mem.read_obj(at).ok()?;
            if desc.refers_to_indirect_table() {
                // Not within an indirect table, a whole number of descriptors, at most 2^16.
                if self.indirect || desc.len() % 16 != 0 || desc.len() / 16 > u32::from(u16::MAX) {
                    return None;
                }
                self.table = desc.addr();
                self.table_len = (desc.len() / 16) as u16;
                self.ttl = self.table_len;
                self.next = 0;
                self.indirect = true;
                continue;
            }
            self.bytes = self.bytes.checked_add(desc.len())?;
            if desc.has_next() {
                self.next = desc.next();
                self.ttl -= 1;
            } else {
                self.ttl = 0;
            }
            return Some(desc);
        }
    }
}

/// Epoll tokens of a queue thread.
const TOKEN_KICK: u64 = 0;
const TOKEN_WAKE: u64 = 1;

/// A queue thread of one connection: it waits on its epoll for the queue's kick eventfd
/// (registered while the queue is started and enabled) and its wake eventfd (a pass wanted
/// now, or `stop`).
struct Worker {
    epoll: Arc<Epoll>,
    wake: EventFd,
    stop: Arc<AtomicBool>,
    /// The kick descriptor registered on `epoll`, if any (by the connection thread only).
    registered: Option<RawFd>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts queue `q`'s thread, with its own handle to the connection's guest memory `mem`.
    fn spawn(
        backend: &Arc<BlkBackend>,
        q: usize,
        vring: &VringRwLock,
        mem: &Mem,
    ) -> std::io::Result<Worker> {
        let epoll = Arc::new(Epoll::new()?);
        let wake = EventFd::new(EFD_NONBLOCK)?;
        epoll.ctl(
            ControlOperation::Add,
            wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_WAKE),
        )?;
        let stop = Arc::new(AtomicBool::new(false));
        let (epoll2, wake2, stop2) = (Arc::clone(&epoll), wake.try_clone()?, Arc::clone(&stop));
        let (backend, vring, mem) = (Arc::clone(backend), vring.clone(), mem.clone());
        let thread = std::thread::Builder::new()
            .name(format!("uzram-vq{q}"))
            .spawn(move || {
                let mut events = [EpollEvent::default(); 4];
                loop {
                    let n = match epoll2.wait(-1, &mut events) {
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            eprintln!("uzram: vhost-user: queue {q}: epoll: {e}");
                            return;
                        }
                    };
                    for ev in &events[..n] {
                        if ev.data() == TOKEN_WAKE {
                            let _ = wake2.read();
                        } else {
                            let _ = vring.read_kick();
                        }
                    }
                    if stop2.load(Ordering::Acquire) {
                        return;
                    }
                    backend.run_queue(q, &vring, &mem);
                }
            })?;
        Ok(Worker {
            epoll,
            wake,
            stop,
            registered: None,
            thread: Some(thread),
        })
    }

    fn wake(&self) {
        let _ = self.wake.write(1);
    }

    fn end(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One front end's connection: the vhost-user messages' state (what was negotiated, the
/// rings, the guest's memory as the front end described it, the inflight region) and its
/// queue threads. Driven by the connection thread (`BackendReqHandler` holds it in a mutex);
/// the queue threads see only the vrings (each behind its own lock) and the backend.
struct Conn {
    backend: Arc<BlkBackend>,
    owned: bool,
    /// `SET_FEATURES`'s bits, once it came.
    acked_features: Option<u64>,
    acked_protocol_features: u64,
    /// The guest's memory as the vrings see it (replaced by `SET_MEM_TABLE`).
    atomic_mem: Mem,
    /// Front-end virtual address → guest-physical, from the memory table: (front end's
    /// address, size, guest-physical address) per region.
    mappings: Vec<(u64, u64, u64)>,
    vrings: Vec<VringRwLock>,
    workers: Vec<Worker>,
    /// The region `SET_INFLIGHT_FD` handed over, if any.
    inflight: Option<Arc<inflight::Region>>,
}

fn vu_err(e: impl std::fmt::Display) -> VuError {
    VuError::ReqHandlerError(std::io::Error::other(e.to_string()))
}

impl Conn {
    fn new(backend: &Arc<BlkBackend>) -> std::io::Result<Conn> {
        let atomic_mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let mut vrings = Vec::new();
        let mut workers = Vec::new();
        for q in 0..usize::from(backend.nr_queues) {
            let made = VringRwLock::new(atomic_mem.clone(), MAX_QUEUE_SIZE as u16)
                .map_err(|e| std::io::Error::other(format!("vring: {e}")))
                .and_then(|vring| Ok((Worker::spawn(backend, q, &vring, &atomic_mem)?, vring)));
            match made {
                Ok((w, vring)) => {
                    workers.push(w);
                    vrings.push(vring);
                }
                Err(e) => {
                    // The threads already started end before the error is returned.
                    for w in &mut workers {
                        w.end();
                    }
                    return Err(e);
                }
            }
        }
        Ok(Conn {
            backend: Arc::clone(backend),
            owned: false,
            acked_features: None,
            acked_protocol_features: 0,
            atomic_mem,
            mappings: Vec::new(),
            vrings,
            workers,
            inflight: None,
        })
    }

    /// Ends the queue threads (joined: none touches guest memory or the region after this).
    fn end(&mut self) {
        for w in &mut self.workers {
            w.end();
        }
    }

    fn vring(&self, index: u32) -> VuResult<&VringRwLock> {
        self.vrings.get(index as usize).ok_or(VuError::InvalidParam)
    }

    fn translate(&self, vmm_addr: u64) -> VuResult<u64> {
        self.mappings
            .iter()
            .find(|&&(va, size, _)| vmm_addr >= va && vmm_addr - va < size)
            .map(|&(va, _, gpa)| vmm_addr - va + gpa)
            .ok_or(VuError::InvalidParam)
    }

    /// Registers queue `q`'s kick eventfd on its thread's epoll while the queue is started
    /// and enabled, unregisters it otherwise; a queue that becomes live gets a pass at once
    /// (requests offered while no back end listened, and resubmitted ones, wait for no kick).
    fn update_registration(&mut self, q: usize) -> VuResult<()> {
        let (live, fd) = {
            let st = self.vrings[q].get_ref();
            let live = st.get_queue().ready() && st.is_enabled();
            (live, st.get_kick().as_ref().map(|k| k.as_raw_fd()))
        };
        let w = &mut self.workers[q];
        let want = if live { fd } else { None };
        if w.registered != want {
            if let Some(old) = w.registered.take() {
                let _ = w.epoll.ctl(
                    ControlOperation::Delete,
                    old,
                    EpollEvent::new(EventSet::IN, TOKEN_KICK),
                );
            }
            if let Some(fd) = want {
                w.epoll
                    .ctl(
                        ControlOperation::Add,
                        fd,
                        EpollEvent::new(EventSet::IN, TOKEN_KICK),
                    )
                    .map_err(VuError::ReqHandlerError)?;
                w.registered = Some(fd);
            }
        }
        if live {
            w.wake();
        }
        Ok(())
    }

    /// Unregisters queue `q`'s kick eventfd before it is replaced or dropped.
    fn unregister(&mut self, q: usize) {
        let w = &mut self.workers[q];
        if let Some(old) = w.registered.take() {
            let _ = w.epoll.ctl(
                ControlOperation::Delete,
                old,
                EpollEvent::new(EventSet::IN, TOKEN_KICK),
            );
        }
    }

    /// Queue `q` starts (its kick eventfd given, its rings set): with an inflight region,
    /// its part is initialised, or, handed back after a crash, read for the requests to
    /// resubmit and the next available index (the front end's `SET_VRING_BASE` after a
    /// crash is only a guess: QEMU sends the used index). A region that does not fit the
    /// queue is reported and not used for it: the queue is served without tracking rather
    /// than not at all.
    fn start_queue(&mut self, q: usize) {
        let vring = &self.vrings[q];
        let mut st = self.backend.queues[q].lock();
        st.resubmit.clear();
        st.resubmit_next = 0;
        st.counter = 0;
        st.inflight = self
            .inflight
            .as_ref()
            .and_then(|r| inflight::QueueInflight::new(r, q));
        if let Some(qi) = st.inflight.clone() {
            let size = vring.get_ref().get_queue().size();
            let started = vring
                .queue_used_idx()
                .map_err(|e| std::io::Error::other(format!("reading the used ring: {e}")))
                .and_then(|used_idx| {
                    qi.start(size, used_idx, &mut st.resubmit)
                        .map(|start| (used_idx, start))
                });
            match started {
                Ok((_, inflight::Start::Fresh)) => {}
                Ok((
                    used_idx,
                    inflight::Start::Used {
                        next_avail,
                        next_counter,
                    },
                )) => {
                    vring.set_queue_next_avail(next_avail);
                    vring.set_queue_next_used(used_idx);
                    st.counter = next_counter;
                    if !st.resubmit.is_empty() {
                        eprintln!(
                            "uzram: vhost-user {}: queue {q}: resubmitting {} request(s) a \
                             previous server took and did not complete",
                            self.backend.name,
                            st.resubmit.len()
                        );
                    }
                }
                Err(e) => {
                    eprintln!(
                        "uzram: vhost-user {}: queue {q}: inflight region not used: {e}",
                        self.backend.name
                    );
                    st.inflight = None;
                    st.resubmit.clear();
                }
            }
        }
        drop(st);
        vring.set_queue_ready(true);
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.end();
    }
}

impl VhostUserBackendReqHandlerMut for Conn {
    fn set_owner(&mut self) -> VuResult<()> {
        if self.owned {
            return Err(VuError::InvalidOperation("already claimed"));
        }
        self.owned = true;
        Ok(())
    }

    fn reset_owner(&mut self) -> VuResult<()> {
        self.owned = false;
        self.acked_features = None;
        self.acked_protocol_features = 0;
        Ok(())
    }

    fn reset_device(&mut self) -> VuResult<()> {
        for q in 0..self.vrings.len() {
            self.vrings[q].set_enabled(false);
            self.update_registration(q)?;
        }
        self.acked_features = None;
        Ok(())
    }

    fn get_features(&mut self) -> VuResult<u64> {
        Ok(self.backend.features())
    }

    fn set_features(&mut self, features: u64) -> VuResult<()> {
        if features & !self.backend.features() != 0 {
            return Err(VuError::InvalidParam);
        }
        self.acked_features = Some(features);
        // Without PROTOCOL_FEATURES the rings are enabled at once (the spec's "Ring states").
        if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0 {
            for q in 0..self.vrings.len() {
                self.vrings[q].set_enabled(true);
                self.update_registration(q)?;
            }
        }
        let event_idx = features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        for vring in &self.vrings {
            vring.set_queue_event_idx(event_idx);
        }
        self.backend.event_idx.store(event_idx, Ordering::Relaxed);
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy_listening: Option<bool>,
    ) -> VuResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        if postcopy_listening.is_some() {
            return Err(VuError::InvalidOperation("postcopy not supported"));
        }
        let mut regions = Vec::new();
        let mut mappings = Vec::new();
        for (region, file) in ctx.iter().zip(files) {
            let r = GuestRegionMmap::new(
                region.mmap_region(file)?,
                GuestAddress(region.guest_phys_addr),
            )
            .ok_or(VuError::InvalidParam)?;
            mappings.push((region.user_addr, region.memory_size, region.guest_phys_addr));
            regions.push(r);
        }
        let mem = GuestMemoryMmap::from_regions(regions).map_err(vu_err)?;
        // A region mapped past the end of its file would fault (SIGBUS, the whole server)
        // on the first access there: such a table is refused, and the queues stop (the
        // refusal ends the connection).
        if let Err(e) = check_regions(&mem) {
            self.backend.mem_accepted.store(false, Ordering::Release);
            return Err(VuError::ReqHandlerError(e));
        }
        self.atomic_mem.lock().map_err(vu_err)?.replace(mem);
        if self.backend.swap {
            unlock_guest_memory(&self.atomic_mem);
        }
        self.backend.mem_accepted.store(true, Ordering::Release);
        self.mappings = mappings;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        let vring = self.vring(index)?;
        if num == 0 || num as usize > MAX_QUEUE_SIZE {
            return Err(VuError::InvalidParam);
        }
        vring.set_queue_size(num as u16);
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VuResult<()> {
        let vring = self.vring(index)?;
        if self.mappings.is_empty() {
            return Err(VuError::InvalidParam);
        }
        let (desc, avail, used) = (
            self.translate(descriptor)?,
            self.translate(available)?,
            self.translate(used)?,
        );
        vring
            .set_queue_info(desc, avail, used)
            .map_err(|_| VuError::InvalidParam)?;
        // The used index is the ring's own (0 for a new ring, where a driver left it after a
        // reset of the front end); SET_VRING_BASE gives only the available one.
        let idx = vring
            .queue_used_idx()
            .map_err(|_| VuError::BackendInternalError)?;
        vring.set_queue_next_used(idx);
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VuResult<()> {
        self.vring(index)?.set_queue_next_avail(base as u16);
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VuResult<VhostUserVringState> {
        let q = index as usize;
        let vring = self.vring(index)?.clone();
        // The spec: the ring stops on GET_VRING_BASE. Nothing more is popped; the request
        // the queue thread is serving (if any) ends before we answer (its lock), so the
        // index we give is past every request completed, and none is completed after.
        vring.set_queue_ready(false);
        self.update_registration(q)?;
        drop(self.backend.queues[q].lock());
        let next_avail = vring.queue_next_avail();
        self.unregister(q);
        vring.set_kick(None);
        vring.set_call(None);
        Ok(VhostUserVringState::new(index, u32::from(next_avail)))
    }

    fn set_vring_kick(&mut self, index: u8, file: Option<File>) -> VuResult<()> {
        let q = usize::from(index);
        let vring = self.vring(u32::from(index))?.clone();
        self.unregister(q);
        vring.set_kick(file);
        let starting = {
            let st = vring.get_ref();
            !st.get_queue().ready() && st.get_kick().is_some()
        };
        if starting {
            self.start_queue(q);
        }
        self.update_registration(q)
    }

    fn set_vring_call(&mut self, index: u8, file: Option<File>) -> VuResult<()> {
        let vring = self.vring(u32::from(index))?;
        let given = file.is_some();
        vring.set_call(file);
        // After a reconnection, requests resubmitted (or completed by the old server just
        // before it died) may have been used before the front end gave this eventfd: one
        // call, which costs a spurious interrupt at worst, so the guest looks.
        if given && self.inflight.is_some() {
            signal(vring);
        }
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, file: Option<File>) -> VuResult<()> {
        self.vring(u32::from(index))?.set_err(file);
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VuResult<VhostUserProtocolFeatures> {
        Ok(self.backend.protocol_features())
    }

    fn set_protocol_features(&mut self, features: u64) -> VuResult<()> {
        self.acked_protocol_features = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> VuResult<u64> {
        Ok(u64::from(self.backend.nr_queues))
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        // Only with PROTOCOL_FEATURES negotiated (else the rings are enabled with the
        // features).
        let protocol = VhostUserVirtioFeatures::PROTOCOL_FEATURES;
        if self.acked_features.unwrap_or(0) & protocol.bits() == 0 {
            return Err(VuError::InactiveFeature(protocol));
        }
        self.vring(index)?.set_enabled(enable);
        self.update_registration(index as usize)
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VuResult<Vec<u8>> {
        Ok(self.backend.get_config(offset, size))
    }

    fn set_config(
        &mut self,
        _offset: u32,
        _buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VuResult<()> {
        // The write-back cache setting: the device always has one; ignored.
        Ok(())
    }

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VuResult<()> {
        Err(VuError::InvalidOperation("not supported"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VuResult<File> {
        Err(VuError::InvalidOperation("not supported"))
    }

    fn get_inflight_fd(&mut self, msg: &VhostUserInflight) -> VuResult<(VhostUserInflight, File)> {
        if msg.num_queues == 0
            || msg.num_queues > self.backend.nr_queues
            || msg.queue_size == 0
            || usize::from(msg.queue_size) > MAX_QUEUE_SIZE
        {
            return Err(VuError::InvalidParam);
        }
        let file =
            inflight::create(msg.num_queues, msg.queue_size).map_err(VuError::ReqHandlerError)?;
        let size = inflight::region_bytes(msg.num_queues, msg.queue_size) as u64;
        Ok((
            VhostUserInflight::new(size, 0, msg.num_queues, msg.queue_size),
            file,
        ))
    }

    fn set_inflight_fd(&mut self, msg: &VhostUserInflight, file: File) -> VuResult<()> {
        if msg.num_queues == 0
            || msg.num_queues > self.backend.nr_queues
            || msg.queue_size == 0
            || usize::from(msg.queue_size) > MAX_QUEUE_SIZE
        {
            return Err(VuError::InvalidParam);
        }
        let region = inflight::Region::map(
            &file,
            msg.mmap_size,
            msg.mmap_offset,
            msg.num_queues,
            msg.queue_size,
        )
        .map_err(VuError::ReqHandlerError)?;
        // Taken by each queue when it starts (its kick eventfd), as the front end sends it
        // before the rings.
        self.inflight = Some(Arc::new(region));
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> VuResult<u64> {
        Err(VuError::InvalidOperation("not supported"))
    }

    fn add_mem_region(
        &mut self,
        _region: &VhostUserSingleMemoryRegion,
        _fd: File,
        _postcopy_listening: Option<bool>,
    ) -> VuResult<Option<VhostUserMemoryRegionBase>> {
        Err(VuError::InvalidOperation("not supported"))
    }

    fn remove_mem_region(&mut self, _region: &VhostUserSingleMemoryRegion) -> VuResult<()> {
        Err(VuError::InvalidOperation("not supported"))
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VuResult<Option<File>> {
        Err(VuError::InvalidOperation("not supported"))
    }

    fn check_device_state(&mut self) -> VuResult<()> {
        Err(VuError::InvalidOperation("not supported"))
    }

    fn get_shmem_config(&mut self) -> VuResult<VhostUserShMemConfig> {
        Err(VuError::InvalidOperation("not supported"))
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VuResult<()> {
        Err(VuError::InvalidOperation("not supported"))
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

/// A queue's state across connections: its buffers and its inflight bookkeeping.
struct QueueState {
    bufs: QueueBuffers,
    /// This connection's part of the inflight region for the queue (set when the queue
    /// starts, dropped when the connection ends).
    inflight: Option<inflight::QueueInflight>,
    /// Heads to serve again before taking from the ring, oldest first (capacity
    /// [`MAX_QUEUE_SIZE`], made at start), and how many were served already.
    resubmit: Vec<u16>,
    resubmit_next: usize,
    /// The inflight counter of the next request taken.
    counter: u64,
}

impl QueueState {
    fn new() -> QueueState {
        QueueState {
            bufs: QueueBuffers::new(),
            inflight: None,
            resubmit: Vec::with_capacity(MAX_QUEUE_SIZE),
            resubmit_next: 0,
            counter: 0,
        }
    }
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
fn check_regions(mem: &GuestMemoryMmap) -> std::io::Result<()> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    for region in mem.iter() {
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

/// A device served on a vhost-user-blk socket. Dropping it stops it, as
/// [`VhostUserExport::stop`] does.
pub struct VhostUserExport {
    path: PathBuf,
    socket_id: crate::frontend::unix_socket::SocketId,
    stopping: Arc<AtomicBool>,
    /// The connected front end's socket (shut down to end the connection); set while one is
    /// connected.
    connected: Arc<Mutex<Option<UnixStream>>>,
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
            mem_accepted: AtomicBool::new(false),
            event_idx: AtomicBool::new(false),
            queues: (0..cfg.nr_queues)
                .map(|_| Mutex::new(QueueState::new()))
                .collect(),
            conn_ended: AtomicBool::new(false),
        });
        let stopping = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stopping);
        let connected = Arc::new(Mutex::new(None));
        let connected2 = Arc::clone(&connected);
        let name2 = name.to_string();
        let backend2 = Arc::clone(&backend);
        let thread = std::thread::Builder::new()
            .name("uzram-vhost".into())
            .spawn(move || {
                // One front end at a time; after it leaves (a guest that powers off, a QEMU
                // that restarts) the next one is accepted with the data kept.
                while !stop2.load(Ordering::Acquire) {
                    let stream = match listener.accept() {
                        Ok((stream, _)) => stream,
                        Err(e) => {
                            // E.g. out of file descriptors, or a connection that aborted: the
                            // socket goes on accepting, after a pause so that a lasting
                            // failure does not spin.
                            if stop2.load(Ordering::Acquire) {
                                break;
                            }
                            eprintln!("uzram: vhost-user {name2}: accepting: {e}");
                            std::thread::sleep(std::time::Duration::from_millis(100));
                            continue;
                        }
                    };
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    serve_connection(&name2, &backend2, stream, &stop2, &connected2);
                }
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
        if let Some(s) = self.connected.lock().take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
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

/// Runs one front end's connection on the connection thread until it leaves, breaks the
/// protocol or is shut down (`stop`); then its queue threads are joined and its guest memory
/// and inflight region dropped.
fn serve_connection(
    name: &str,
    backend: &Arc<BlkBackend>,
    stream: UnixStream,
    stopping: &AtomicBool,
    connected: &Mutex<Option<UnixStream>>,
) {
    // The previous connection's queue threads were joined when it ended: the new ones may
    // serve.
    backend.conn_ended.store(false, Ordering::Release);
    let conn = match Conn::new(backend) {
        Ok(c) => Arc::new(std::sync::Mutex::new(c)),
        Err(e) => {
            eprintln!("uzram: vhost-user {name}: starting queue threads: {e}");
            return;
        }
    };
    let mut handler = BackendReqHandler::from_stream(stream, Arc::clone(&conn));
    match handler.try_clone_connection() {
        Ok(s) => {
            // Under the lock: either stop() sees the socket, or we see `stopping`.
            let mut c = connected.lock();
            if stopping.load(Ordering::Acquire) {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            *c = Some(s);
        }
        Err(e) => {
            eprintln!("uzram: vhost-user {name}: {e}");
            conn.lock().unwrap_or_else(|e| e.into_inner()).end();
            backend.end_connection();
            return;
        }
    }
    let err = loop {
        if let Err(e) = handler.handle_request() {
            break e;
        }
    };
    *connected.lock() = None;
    match err {
        // A front end that leaves (guest powered off, QEMU stopped or restarting) is the
        // normal end of a connection.
        VuError::Disconnected | VuError::PartialMessage | VuError::SocketBroken(_) => {}
        e if !stopping.load(Ordering::Acquire) => {
            // A front end that broke the protocol: it is dropped, the socket goes on
            // accepting.
            eprintln!("uzram: vhost-user {name}: front end dropped: {e}");
        }
        _ => {}
    }
    // This connection's queue threads end, then its guest memory is unmapped.
    backend.conn_ended.store(true, Ordering::Release);
    conn.lock().unwrap_or_else(|e| e.into_inner()).end();
    drop(handler);
    backend.end_connection();
}
