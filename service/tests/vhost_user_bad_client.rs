//! Bad input at the vhost-user-blk frontend (`src/frontend/vhost_user.rs`), from a front end
//! that misbehaves on purpose: not QEMU, but the `vhost` crate's own `Frontend` (and raw
//! messages where even it refuses to send them), with the "guest's" memory a memfd of ours
//! and split virtqueues laid out in it by hand. Each bad message is refused (a negative
//! reply-ack, or the connection closed) and each bad request gets `VIRTIO_BLK_S_IOERR` or
//! `VIRTIO_BLK_S_UNSUPP` (or, when it has nowhere to put a status, comes back used with
//! length 0); after each, the server is still running (a fault in it would end this very
//! process), serves good requests on the same or a new connection, and another device's
//! connection goes on undisturbed. And serving good requests allocates nothing on the queue
//! threads (`requests_allocate_nothing`, with a counting global allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};
use uzram::BlockDevice;
use uzram_service::frontend::vhost_user::{VhostUserConfig, VhostUserExport};
use uzram_testkit::device::new_device;
use uzram_testkit::pages::pattern;
use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const DEVICE_BYTES: u64 = 8 << 20;
const QUEUES: u16 = 2;
/// The guest's memory: one region at guest-physical 0, "mapped" in the front end at
/// `USER_BASE` (an address only used to name it: vhost-user translates ring addresses
/// through it).
const MEM_BYTES: u64 = 2 << 20;
const USER_BASE: u64 = 0x7f00_0000_0000;
const QUEUE_SIZE: u16 = 16;

// Per queue `q`, the rings at `RING_BASE + q * RING_STRIDE`: descriptors, available, used.
const RING_BASE: u64 = 0;
const RING_STRIDE: u64 = 0x4000;
const DESC_OFF: u64 = 0;
const AVAIL_OFF: u64 = 0x1000;
const USED_OFF: u64 = 0x2000;
// Per queue, a request's header, status and data.
const REQ_BASE: u64 = 0x10000;
const REQ_STRIDE: u64 = 0x80000;
const HDR_OFF: u64 = 0;
const STATUS_OFF: u64 = 0x100;
const DATA_OFF: u64 = 0x1000;
/// The most data one request here carries (the rest of its area).
const DATA_MAX: u64 = REQ_STRIDE - DATA_OFF;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;

const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;
const S_OK: u8 = 0;
const S_IOERR: u8 = 1;
const S_UNSUPP: u8 = 2;
/// What the status byte holds before the server writes it.
const S_UNTOUCHED: u8 = 0xee;

/// A device served on a vhost-user socket in a temporary directory.
struct Served {
    export: Option<VhostUserExport>,
    device: Arc<dyn BlockDevice>,
    _dir: tempfile::TempDir,
    socket: std::path::PathBuf,
}

fn serve(name: &str) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join(format!("{name}.vhost.sock"));
    let device = new_device(DEVICE_BYTES);
    let cfg = VhostUserConfig {
        nr_queues: QUEUES,
        swap: false,
    };
    let export = VhostUserExport::start(name, &socket, Arc::clone(&device), &cfg).unwrap();
    Served {
        export: Some(export),
        device,
        _dir: dir,
        socket,
    }
}

/// A memfd of `bytes` (zeroes).
fn memfd(bytes: u64) -> File {
    // SAFETY: the name is a NUL-terminated string; memfd_create only reads it.
    let fd = unsafe { libc::memfd_create(c"uzram-test-guest".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and nothing else owns it.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(bytes).unwrap();
    f
}

/// An indirect descriptor table of a 4 KiB write as Linux sends it: the header at `hdr`, the
/// data at `data`, the status byte at `status`, each descriptor chained to the next.
fn indirect_write_table(hdr: u64, data: u64, status: u64) -> Vec<u8> {
    let mut table = Vec::new();
    for (i, (a, l, f)) in [
        (hdr, 16u32, F_NEXT),
        (data, 4096, F_NEXT),
        (status, 1, F_WRITE),
    ]
    .into_iter()
    .enumerate()
    {
        table.extend_from_slice(&a.to_le_bytes());
        table.extend_from_slice(&l.to_le_bytes());
        table.extend_from_slice(&f.to_le_bytes());
        table.extend_from_slice(&((i + 1) as u16).to_le_bytes());
    }
    table
}

/// One descriptor: guest address, length, flags (`F_NEXT` is added by [`Guest::submit`]).
#[derive(Clone, Copy)]
struct Desc(u64, u32, u16);

/// A connected front end with its guest memory and the rings of its queues.
struct Guest {
    fe: Frontend,
    mem: File,
    kicks: Vec<EventFd>,
    calls: Vec<EventFd>,
    /// Per queue: the next available index.
    avail_idx: Vec<u16>,
    /// Per queue: the used index expected after the last request offered.
    used_idx: Vec<u16>,
}

fn ring(q: usize) -> u64 {
    RING_BASE + q as u64 * RING_STRIDE
}

fn req_area(q: usize) -> u64 {
    REQ_BASE + q as u64 * REQ_STRIDE
}

impl Guest {
    /// Connects and negotiates as QEMU does (features, protocol features with REPLY_ACK, a
    /// reply asked for every message), without memory or queues yet.
    fn negotiate(socket: &Path) -> Guest {
        let mut fe = Frontend::connect(socket, u64::from(QUEUES)).expect("connect");
        fe.set_owner().unwrap();
        let features = fe.get_features().unwrap();
        let want = (1u64 << 32) // VERSION_1
            | (1 << 29) // EVENT_IDX
            | (1 << 28) // INDIRECT_DESC
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        assert_eq!(features & want, want, "features {features:#x}");
        let proto = fe.get_protocol_features().unwrap();
        assert!(
            proto.contains(VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::MQ)
        );
        fe.set_protocol_features(
            VhostUserProtocolFeatures::REPLY_ACK
                | VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::CONFIG,
        )
        .unwrap();
        fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        assert_eq!(fe.get_queue_num().unwrap(), u64::from(QUEUES));
        fe.set_features(want).unwrap();
        Guest {
            fe,
            mem: memfd(MEM_BYTES),
            kicks: Vec::new(),
            calls: Vec::new(),
            avail_idx: vec![0; QUEUES.into()],
            used_idx: vec![0; QUEUES.into()],
        }
    }

    /// Negotiates, gives the memory table, and starts every queue.
    fn connect(socket: &Path) -> Guest {
        let mut g = Guest::negotiate(socket);
        g.set_mem_table().unwrap();
        for q in 0..usize::from(QUEUES) {
            g.start_queue(q);
        }
        g
    }

    fn region(&self, size: u64) -> VhostUserMemoryRegionInfo {
        VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: size,
            userspace_addr: USER_BASE,
            mmap_offset: 0,
            mmap_handle: self.mem.as_raw_fd(),
        }
    }

    fn set_mem_table(&self) -> vhost::Result<()> {
        self.fe.set_mem_table(&[self.region(MEM_BYTES)]).map(|_| ())
    }

    fn vring_config(q: usize) -> VringConfigData {
        VringConfigData {
            queue_max_size: QUEUE_SIZE,
            queue_size: QUEUE_SIZE,
            flags: 0,
            desc_table_addr: USER_BASE + ring(q) + DESC_OFF,
            used_ring_addr: USER_BASE + ring(q) + USED_OFF,
            avail_ring_addr: USER_BASE + ring(q) + AVAIL_OFF,
            log_addr: None,
        }
    }

    fn start_queue(&mut self, q: usize) {
        self.fe.set_vring_num(q, QUEUE_SIZE).unwrap();
        self.fe.set_vring_base(q, 0).unwrap();
        self.fe.set_vring_addr(q, &Guest::vring_config(q)).unwrap();
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        let call = EventFd::new(EFD_NONBLOCK).unwrap();
        self.fe.set_vring_kick(q, &kick).unwrap();
        self.fe.set_vring_call(q, &call).unwrap();
        self.fe.set_vring_enable(q, true).unwrap();
        self.kicks.push(kick);
        self.calls.push(call);
    }

    fn write_mem(&self, gpa: u64, data: &[u8]) {
        self.mem.write_all_at(data, gpa).unwrap();
    }

    fn read_mem(&self, gpa: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_exact_at(&mut v, gpa).unwrap();
        v
    }

    fn u16_at(&self, gpa: u64) -> u16 {
        u16::from_le_bytes(self.read_mem(gpa, 2).try_into().unwrap())
    }

    /// Writes `descs` as a chain at descriptor index 0 of queue `q`, offers `head` (0, or a
    /// bad index), kicks, and waits for the used entry: (id, len).
    fn submit_head(&mut self, q: usize, descs: &[Desc], head: u16) -> (u32, u32) {
        let r = ring(q);
        for (i, d) in descs.iter().enumerate() {
            let mut flags = d.2;
            if i + 1 < descs.len() {
                flags |= F_NEXT;
            }
            let mut raw = Vec::with_capacity(16);
            raw.extend_from_slice(&d.0.to_le_bytes());
            raw.extend_from_slice(&d.1.to_le_bytes());
            raw.extend_from_slice(&flags.to_le_bytes());
            raw.extend_from_slice(&((i + 1) as u16).to_le_bytes());
            self.write_mem(r + DESC_OFF + 16 * i as u64, &raw);
        }
        self.offer(q, head)
    }

    /// Writes `descs` as a chain from descriptor index 0 of queue `q`, each one's `next` the
    /// following index and `F_NEXT` as given: for chains that break the rules.
    fn write_descs(&self, q: usize, descs: &[Desc]) {
        for (i, d) in descs.iter().enumerate() {
            let raw = [
                &d.0.to_le_bytes()[..],
                &d.1.to_le_bytes(),
                &d.2.to_le_bytes(),
                &((i + 1) as u16).to_le_bytes(),
            ]
            .concat();
            self.write_mem(ring(q) + DESC_OFF + 16 * i as u64, &raw);
        }
    }

    /// Puts `head` in queue `q`'s available ring and kicks.
    fn offer_only(&mut self, q: usize, head: u16) {
        let r = ring(q);
        let idx = self.avail_idx[q];
        let slot = u64::from(idx % QUEUE_SIZE);
        self.write_mem(r + AVAIL_OFF + 4 + 2 * slot, &head.to_le_bytes());
        let idx = idx.wrapping_add(1);
        self.avail_idx[q] = idx;
        self.write_mem(r + AVAIL_OFF + 2, &idx.to_le_bytes());
        self.kicks[q].write(1).unwrap();
    }

    /// Puts `head` in queue `q`'s available ring, kicks, and waits for its used entry.
    fn offer(&mut self, q: usize, head: u16) -> (u32, u32) {
        self.offer_only(q, head);
        self.used_idx[q] = self.used_idx[q].wrapping_add(1);
        self.wait_used(q, self.used_idx[q])
    }

    /// Waits until queue `q`'s used index reaches `idx`; its last entry.
    fn wait_used(&self, q: usize, idx: u16) -> (u32, u32) {
        let r = ring(q);
        let end = Instant::now() + Duration::from_secs(10);
        while self.u16_at(r + USED_OFF + 2) != idx {
            assert!(Instant::now() < end, "queue {q}: no used entry for {idx}");
            std::thread::sleep(Duration::from_micros(200));
        }
        let slot = u64::from(idx.wrapping_sub(1) % QUEUE_SIZE);
        let e = self.read_mem(r + USED_OFF + 4 + 8 * slot, 8);
        (
            u32::from_le_bytes(e[0..4].try_into().unwrap()),
            u32::from_le_bytes(e[4..8].try_into().unwrap()),
        )
    }

    fn submit(&mut self, q: usize, descs: &[Desc]) -> (u32, u32) {
        self.submit_head(q, descs, 0)
    }

    /// Writes a request header in queue `q`'s area and resets its status byte.
    fn header(&self, q: usize, kind: u32, sector: u64) -> (u64, u64) {
        let a = req_area(q);
        let mut h = Vec::with_capacity(16);
        h.extend_from_slice(&kind.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&sector.to_le_bytes());
        self.write_mem(a + HDR_OFF, &h);
        self.write_mem(a + STATUS_OFF, &[S_UNTOUCHED]);
        (a + HDR_OFF, a + STATUS_OFF)
    }

    fn status(&self, q: usize) -> u8 {
        self.read_mem(req_area(q) + STATUS_OFF, 1)[0]
    }

    /// A well-formed request of `kind` at `sector` with `data` (read by the device for
    /// writes, or `data.len()` bytes written by it for reads); its status and used length.
    fn request(&mut self, q: usize, kind: u32, sector: u64, data: &[u8]) -> (u8, u32) {
        let (hdr, status) = self.header(q, kind, sector);
        let data_at = req_area(q) + DATA_OFF;
        assert!(data.len() as u64 <= DATA_MAX);
        self.write_mem(data_at, data);
        let mut descs = vec![Desc(hdr, 16, 0)];
        if !data.is_empty() {
            let flags = if kind == T_IN || kind == T_GET_ID {
                F_WRITE
            } else {
                0
            };
            descs.push(Desc(data_at, data.len() as u32, flags));
        }
        descs.push(Desc(status, 1, F_WRITE));
        let (id, len) = self.submit(q, &descs);
        assert_eq!(id, 0);
        (self.status(q), len)
    }

    fn write(&mut self, q: usize, sector: u64, data: &[u8]) -> u8 {
        let (s, len) = self.request(q, T_OUT, sector, data);
        assert_eq!(len, 1, "a write's used length is the status byte");
        s
    }

    fn read(&mut self, q: usize, sector: u64, len: usize) -> (u8, Vec<u8>) {
        let (s, used) = self.request(q, T_IN, sector, &vec![0x5a; len]);
        if s == S_OK {
            assert_eq!(used as usize, len + 1);
        }
        (s, self.read_mem(req_area(q) + DATA_OFF, len))
    }

    /// A write and a read back on every queue: this connection is served.
    fn assert_served(&mut self, seed: u64) {
        for q in 0..usize::from(QUEUES) {
            let data = pattern(16 << 10, seed + q as u64);
            let sector = 64 + 64 * q as u64;
            assert_eq!(self.write(q, sector, &data), S_OK);
            let (s, back) = self.read(q, sector, data.len());
            assert_eq!(s, S_OK);
            assert!(back == data, "queue {q}: read back differs");
        }
    }
}

/// A message the back end must refuse: an error now (a negative reply-ack, or a closed
/// socket), or, when it was sent without waiting for an answer, the connection found closed
/// by the next message.
fn assert_refused(g: &Guest, r: vhost::Result<()>, what: &str) {
    if r.is_ok() {
        assert!(
            g.fe.get_features().is_err(),
            "{what}: accepted, and the connection goes on"
        );
    }
}

/// A raw vhost-user message (header: request, flags = version 1 | extra, size; then the
/// body), for what `Frontend` will not send.
fn raw_message(request: u32, flags: u32, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&request.to_le_bytes());
    m.extend_from_slice(&(1 | flags).to_le_bytes());
    m.extend_from_slice(&(body.len() as u32).to_le_bytes());
    m.extend_from_slice(body);
    m
}

/// Sends `bytes` on a fresh connection; the server must close it (read returns 0 or fails)
/// within seconds.
fn assert_raw_closed(socket: &Path, bytes: &[u8], what: &str) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(bytes);
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            // A reply (e.g. a negative ack) may come first; the close follows.
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                panic!("{what}: the connection is still open after 10 s")
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                panic!("{what}: the connection is still open after 10 s")
            }
            Err(_) => break,
        }
    }
}

/// Another device's front end keeps working while this test abuses the first device.
struct Bystander {
    served: Served,
    guest: Guest,
    seed: u64,
}

impl Bystander {
    fn new() -> Bystander {
        let served = serve("zram1");
        let mut guest = Guest::connect(&served.socket);
        guest.assert_served(1000);
        Bystander {
            served,
            guest,
            seed: 1000,
        }
    }

    fn check(&mut self) {
        self.seed += 10;
        self.guest.assert_served(self.seed);
    }
}

#[test]
fn messages_out_of_order_are_refused() {
    let _shared = shared();
    let s = serve("zram0");
    let mut other = Bystander::new();

    // Ring addresses before any memory table: nothing to translate them through.
    let g = Guest::negotiate(&s.socket);
    let r = g.fe.set_vring_addr(0, &Guest::vring_config(0));
    assert_refused(&g, r, "SET_VRING_ADDR before SET_MEM_TABLE");
    drop(g);
    other.check();

    // Ring addresses outside the memory table.
    let g = Guest::negotiate(&s.socket);
    g.set_mem_table().unwrap();
    let mut cfg = Guest::vring_config(0);
    cfg.used_ring_addr = USER_BASE + MEM_BYTES + 0x1000;
    let r = g.fe.set_vring_addr(0, &cfg);
    assert_refused(&g, r, "SET_VRING_ADDR outside memory");
    drop(g);

    // A queue bigger than offered, a queue that does not exist.
    let g = Guest::negotiate(&s.socket);
    let r = g.fe.set_vring_num(0, 1024);
    assert_refused(&g, r, "SET_VRING_NUM 1024");
    drop(g);
    let g = Guest::negotiate(&s.socket);
    let r = g.fe.set_vring_num(0, 0);
    assert_refused(&g, r, "SET_VRING_NUM 0");
    drop(g);
    other.check();

    // Features we do not offer.
    let g = Guest::negotiate(&s.socket);
    let r = g.fe.set_features(1 << 40 | 1 << 32);
    assert_refused(&g, r, "SET_FEATURES with an unoffered bit");
    drop(g);

    // A memory table whose region is larger than its file: mapping it would fault on the
    // first access past the end (the whole server would die of SIGBUS).
    let g = Guest::negotiate(&s.socket);
    let small = memfd(64 << 10);
    let mut region = g.region(MEM_BYTES);
    region.mmap_handle = small.as_raw_fd();
    let r = g.fe.set_mem_table(&[region]).map(|_| ());
    assert_refused(&g, r, "SET_MEM_TABLE past the end of its file");
    drop(g);
    // The same, but with the rings set up on a good table first, then the bad one, then a
    // kick: the queue must not touch the bad memory.
    let mut g = Guest::connect(&s.socket);
    g.assert_served(1);
    let mut region = g.region(MEM_BYTES);
    region.mmap_handle = small.as_raw_fd();
    let r = g.fe.set_mem_table(&[region]).map(|_| ());
    let _ = g.kicks[0].write(1);
    assert_refused(&g, r, "a second SET_MEM_TABLE past the end of its file");
    drop(g);
    other.check();

    // Raw messages the `vhost` crate will not send: SET_VRING_ENABLE before features are
    // negotiated, an unknown request, a body larger than any message, a message cut short.
    let enable = [0u32.to_le_bytes(), 1u32.to_le_bytes()].concat();
    assert_raw_closed(
        &s.socket,
        &raw_message(18, 0, &enable),
        "SET_VRING_ENABLE first",
    );
    assert_raw_closed(&s.socket, &raw_message(9999, 0, &[]), "unknown request");
    let mut huge = raw_message(9, 0, &[]);
    huge[8..12].copy_from_slice(&(1u32 << 20).to_le_bytes());
    huge.extend_from_slice(&[0u8; 4096]);
    assert_raw_closed(&s.socket, &huge, "a 1 MiB message");
    assert_raw_closed(
        &s.socket,
        &raw_message(5, 0, &[1, 2, 3]),
        "SET_MEM_TABLE cut short",
    );
    // SET_OWNER twice on one connection.
    let g = Guest::negotiate(&s.socket);
    let r = g.fe.set_owner();
    assert_refused(&g, r, "a second SET_OWNER");
    drop(g);
    other.check();

    // After all that, a well-behaved front end is served, and finds what it wrote before.
    let mut g = Guest::connect(&s.socket);
    g.assert_served(7);
    let (st, back) = g.read(0, 64, 16 << 10);
    assert_eq!(st, S_OK);
    assert!(back == pattern(16 << 10, 7));
    drop(g);
    other.check();
    drop(s);
    other.check();
    drop(other.served.export.take());
}

#[test]
fn bad_requests_get_errors() {
    let _shared = shared();
    let s = serve("zram0");
    let mut other = Bystander::new();
    let mut g = Guest::connect(&s.socket);
    g.assert_served(1);
    let sectors = DEVICE_BYTES >> 9;
    let page = vec![0x11u8; 4096];

    // Out-of-range sectors: the last page is fine, one sector past it is not; a sector
    // whose byte offset overflows; a range that ends past the end.
    assert_eq!(g.write(0, sectors - 8, &page), S_OK);
    assert_eq!(g.write(0, sectors - 7, &page), S_IOERR);
    assert_eq!(g.write(0, sectors, &page), S_IOERR);
    assert_eq!(g.read(1, sectors, 4096).0, S_IOERR);
    assert_eq!(g.read(1, u64::MAX >> 1, 4096).0, S_IOERR);
    assert_eq!(g.write(1, u64::MAX, &page), S_IOERR);
    // Nothing was written by the refused ones: the last page is still 0x11.
    assert!(g.read(0, sectors - 8, 4096).1 == page);

    // Unknown request types.
    for kind in [2, 3, 9, 99, u32::MAX] {
        assert_eq!(g.request(0, kind, 0, &[]).0, S_UNSUPP, "type {kind}");
    }
    // Flush and GET_ID.
    assert_eq!(g.request(0, T_FLUSH, 0, &[]).0, S_OK);
    let (st, used) = g.request(0, T_GET_ID, 0, &[0u8; 20]);
    assert_eq!((st, used), (S_OK, 21));
    assert_eq!(&g.read_mem(req_area(0) + DATA_OFF, 6), b"zram0\0");
    // GET_ID into a too-short buffer: what fits.
    assert_eq!(g.request(0, T_GET_ID, 0, &[0u8; 3]).0, S_OK);

    // Discard and write-zeroes: a segment of the wrong size, discard flags, unknown
    // write-zeroes flags, a range past the end.
    let seg = |sector: u64, n: u32, flags: u32| {
        [
            &sector.to_le_bytes()[..],
            &n.to_le_bytes(),
            &flags.to_le_bytes(),
        ]
        .concat()
    };
    assert_eq!(g.request(0, T_DISCARD, 0, &seg(0, 8, 0)).0, S_OK);
    assert_eq!(g.request(0, T_DISCARD, 0, &seg(0, 8, 0)[..12]).0, S_IOERR);
    assert_eq!(
        g.request(0, T_DISCARD, 0, &[seg(0, 8, 0), seg(8, 8, 0)].concat())
            .0,
        S_IOERR
    );
    assert_eq!(g.request(0, T_DISCARD, 0, &seg(0, 8, 1)).0, S_UNSUPP);
    assert_eq!(g.request(0, T_WRITE_ZEROES, 0, &seg(0, 8, 1)).0, S_OK);
    assert_eq!(g.request(0, T_WRITE_ZEROES, 0, &seg(0, 8, 2)).0, S_UNSUPP);
    assert_eq!(
        g.request(0, T_DISCARD, 0, &seg(sectors - 4, 8, 0)).0,
        S_IOERR
    );
    assert_eq!(
        g.request(0, T_WRITE_ZEROES, 0, &seg(u64::MAX, u32::MAX, 0))
            .0,
        S_IOERR
    );
    other.check();

    // A chain too short for the header: 8 bytes of it, then the status.
    let (hdr, status) = g.header(0, T_IN, 0);
    let (_, len) = g.submit(0, &[Desc(hdr, 8, 0), Desc(status, 1, F_WRITE)]);
    assert_eq!((g.status(0), len), (S_IOERR, 1));
    // The header write-only (the device must not take it as a request: it reads nothing).
    let (hdr, status) = g.header(0, T_OUT, 0);
    let (_, len) = g.submit(0, &[Desc(hdr, 16, F_WRITE), Desc(status, 1, F_WRITE)]);
    assert_eq!((g.status(0), len), (S_IOERR, 1));
    // Data in the wrong direction: a read with device-readable data, a write with
    // device-writable data; and a device-readable descriptor after the device-writable ones.
    let data = Desc(req_area(0) + DATA_OFF, 4096, 0);
    let data_w = Desc(req_area(0) + DATA_OFF, 4096, F_WRITE);
    for (kind, wrong) in [(T_IN, "read"), (T_OUT, "write"), (T_OUT, "order")] {
        let (hdr, status) = g.header(0, kind, 0);
        let (hdr, status) = (Desc(hdr, 16, 0), Desc(status, 1, F_WRITE));
        let chain = match wrong {
            "read" => [hdr, data, status],
            "write" => [hdr, data_w, status],
            _ => [hdr, status, data],
        };
        let (_, len) = g.submit(0, &chain);
        assert_eq!((g.status(0), len), (S_IOERR, 1), "{wrong}");
    }
    // No writable byte for the status: returned used, length 0, nothing written.
    let (hdr, status) = g.header(0, T_IN, 0);
    let (_, len) = g.submit(0, &[Desc(hdr, 16, 0), Desc(status, 1, 0)]);
    assert_eq!((g.status(0), len), (S_UNTOUCHED, 0));
    // A zero-length chain element and nothing else.
    let (_, len) = g.submit(0, &[Desc(hdr, 0, 0)]);
    assert_eq!(len, 0);

    // Data outside guest memory: just past it, straddling its end, at the top of the
    // address space, and a length that wraps.
    let data_at = req_area(0) + DATA_OFF;
    for (addr, dlen) in [
        (MEM_BYTES, 4096u32),
        (MEM_BYTES - 2048, 4096),
        (u64::MAX - 4095, 4096),
        (data_at, u32::MAX),
    ] {
        for (kind, flags) in [(T_IN, F_WRITE), (T_OUT, 0)] {
            let (hdr, status) = g.header(0, kind, 0);
            let (_, len) = g.submit(
                0,
                &[
                    Desc(hdr, 16, 0),
                    Desc(addr, dlen, flags),
                    Desc(status, 1, F_WRITE),
                ],
            );
            assert_eq!(
                (g.status(0), len),
                (S_UNTOUCHED, 0),
                "type {kind} data at {addr:#x}+{dlen:#x}"
            );
        }
    }
    // The header outside guest memory.
    let (_, status) = g.header(0, T_IN, 0);
    let (_, len) = g.submit(0, &[Desc(MEM_BYTES + 64, 16, 0), Desc(status, 1, F_WRITE)]);
    assert_eq!((g.status(0), len), (S_UNTOUCHED, 0));
    other.check();

    // A huge request inside guest memory: 12 descriptors of 1 MiB over the same memory is a
    // 12 MiB read of an 8 MiB device (refused), 8 of them the whole device (served).
    for (n, want) in [(12u32, S_IOERR), (8, S_OK)] {
        let (hdr, status) = g.header(0, T_IN, 0);
        let mut descs = vec![Desc(hdr, 16, 0)];
        for _ in 0..n {
            descs.push(Desc(0x100000, 1 << 20, F_WRITE));
        }
        descs.push(Desc(status, 1, F_WRITE));
        let (_, len) = g.submit(0, &descs);
        assert_eq!(g.status(0), want, "{n} MiB read");
        if want == S_OK {
            assert_eq!(len, (n << 20) + 1);
        }
    }
    // (That data went to 1..2 MiB: above queue 0's rings and request area.)

    // A descriptor chain that loops (next = itself): it ends after a queue's worth of
    // descriptors, none writable, so it comes back unused.
    let (hdr, _) = g.header(0, T_IN, 0);
    let r = ring(0);
    let raw = [
        &hdr.to_le_bytes()[..],
        &16u32.to_le_bytes(),
        &F_NEXT.to_le_bytes(),
        &0u16.to_le_bytes(),
    ]
    .concat();
    g.write_mem(r + DESC_OFF, &raw);
    let (_, len) = g.offer(0, 0);
    assert_eq!((g.status(0), len), (S_UNTOUCHED, 0), "a looping chain");
    // A chain whose last `next` points past the table: it comes back (what it holds is
    // served as far as it goes).
    let (hdr, status) = g.header(0, T_IN, 0);
    g.write_descs(
        0,
        &[Desc(hdr, 16, F_NEXT), Desc(status, 1, F_WRITE | F_NEXT)],
    );
    g.write_mem(r + DESC_OFF + 16 + 14, &QUEUE_SIZE.to_le_bytes());
    g.offer(0, 0);

    // Indirect tables: outside memory, not a multiple of a descriptor, nested.
    let ind = req_area(0) + 0x800;
    for (addr, tlen) in [(MEM_BYTES, 48u32), (ind, 40)] {
        g.header(0, T_IN, 0);
        let (_, len) = g.submit(0, &[Desc(addr, tlen, F_INDIRECT)]);
        assert_eq!(
            (g.status(0), len),
            (S_UNTOUCHED, 0),
            "indirect {addr:#x}+{tlen}"
        );
    }
    // A good indirect table (as Linux uses them): header, data, status.
    let (hdr, status) = g.header(0, T_OUT, 8);
    let data = pattern(4096, 42);
    g.write_mem(req_area(0) + DATA_OFF, &data);
    let mut table = indirect_write_table(hdr, req_area(0) + DATA_OFF, status);
    g.write_mem(ind, &table);
    let (_, len) = g.submit(0, &[Desc(ind, 48, F_INDIRECT)]);
    assert_eq!((g.status(0), len), (S_OK, 1), "a good indirect request");
    assert!(g.read(1, 8, 4096).1 == data);
    // An indirect table that holds another indirect descriptor.
    table[12..14].copy_from_slice(&(F_INDIRECT | F_NEXT).to_le_bytes());
    g.write_mem(ind, &table);
    g.write_mem(status, &[S_UNTOUCHED]);
    let (_, len) = g.submit(0, &[Desc(ind, 48, F_INDIRECT)]);
    assert_eq!((g.status(0), len), (S_UNTOUCHED, 0), "nested indirect");

    // An indirect table of more descriptors than seg_max allows (header, 300 data segments
    // of 16 bytes, status): an I/O error, the status found all the same.
    let (hdr, status) = g.header(0, T_OUT, 8);
    let mut table = Vec::new();
    let mut descs = vec![(hdr, 16u32, F_NEXT)];
    descs.extend((0..300u64).map(|i| (req_area(0) + DATA_OFF + 16 * i, 16u32, F_NEXT)));
    descs.push((status, 1, F_WRITE));
    for (i, (a, l, f)) in descs.into_iter().enumerate() {
        table.extend_from_slice(&a.to_le_bytes());
        table.extend_from_slice(&l.to_le_bytes());
        table.extend_from_slice(&f.to_le_bytes());
        table.extend_from_slice(&((i + 1) as u16).to_le_bytes());
    }
    let big = req_area(0) + DATA_OFF + 0x2000;
    g.write_mem(big, &table);
    let (_, len) = g.submit(0, &[Desc(big, table.len() as u32, F_INDIRECT)]);
    assert_eq!((g.status(0), len), (S_IOERR, 1), "a chain past seg_max");
    assert!(
        g.read(1, 8, 4096).1 == pattern(4096, 42),
        "the refused write changed the data"
    );

    // A head index past the queue: that entry is dropped (it has no used entry to take),
    // and the next good request on the queue is served.
    g.offer_only(1, QUEUE_SIZE);
    let data = pattern(4096, 43);
    let (hdr, status) = g.header(1, T_OUT, 16);
    g.write_mem(req_area(1) + DATA_OFF, &data);
    g.write_descs(
        1,
        &[
            Desc(hdr, 16, F_NEXT),
            Desc(req_area(1) + DATA_OFF, 4096, F_NEXT),
            Desc(status, 1, F_WRITE),
        ],
    );
    let (id, len) = g.offer(1, 0);
    assert_eq!((id, len, g.status(1)), (0, 1, S_OK));
    assert!(g.read(0, 16, 4096).1 == data);

    // Everything still works, on both queues, here and on the other device.
    g.assert_served(9);
    other.check();
    // The device holds what the good requests wrote and nothing of the bad ones.
    let mut back = vec![0u8; 4096];
    s.device.read_at(&mut back, 8 << 9).unwrap();
    assert!(back == pattern(4096, 42));
    drop(g);
    drop(s);
    other.check();
}

/// Counts the heap allocations made on the server's queue threads (named `uzram-vqN`), for `requests_allocate_nothing`; every other thread's allocations
/// pass through uncounted.
struct QueueThreadAllocs;

static QUEUE_THREAD_ALLOCS: AtomicU64 = AtomicU64::new(0);

fn on_queue_thread() -> bool {
    let mut name = [0u8; 16];
    // SAFETY: the buffer is 16 bytes, the most a thread name takes with its NUL; for the
    // calling thread glibc asks the kernel (prctl), which allocates nothing here.
    let rc = unsafe {
        libc::pthread_getname_np(libc::pthread_self(), name.as_mut_ptr().cast(), name.len())
    };
    rc == 0 && name.starts_with(b"uzram-vq")
}

// SAFETY: forwards every call to `System` unchanged; the count is an atomic, and finding the
// thread's name neither allocates nor re-enters the allocator.
unsafe impl GlobalAlloc for QueueThreadAllocs {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if on_queue_thread() {
            QUEUE_THREAD_ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if on_queue_thread() {
            QUEUE_THREAD_ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if on_queue_thread() {
            QUEUE_THREAD_ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: QueueThreadAllocs = QueueThreadAllocs;

/// Every other test holds this shared for its whole run (servers included: the guard is
/// dropped last), `requests_allocate_nothing` holds it alone.
static EXCLUSIVE: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    EXCLUSIVE.read().unwrap_or_else(|e| e.into_inner())
}

/// `--swap`'s promise for vhost-user: serving a request allocates nothing
/// beyond what the device itself does; here the device's steady state (pages overwritten with
/// the same data, read, discarded and zeroed again) allocates nothing either, so the queue
/// threads' count stays put over hundreds of requests of every kind, of one to many segments
/// and through indirect tables. A front end's data path that allocated per request (as
/// `virtio-queue`'s Reader and Writer do) fails it.
#[test]
fn requests_allocate_nothing() {
    // Alone: the other tests' queue threads (same name) must not allocate meanwhile.
    let _alone = EXCLUSIVE.write().unwrap_or_else(|e| e.into_inner());
    let s = serve("zram0");
    let mut g = Guest::connect(&s.socket);
    let data = pattern(64 << 10, 7);
    let round = |g: &mut Guest| {
        for q in 0..usize::from(QUEUES) {
            let sector = 128 * q as u64;
            assert_eq!(g.write(q, sector, &data[..4096]), S_OK);
            assert_eq!(g.write(q, sector + 8, &data), S_OK);
            let (st, back) = g.read(q, sector + 8, data.len());
            assert!(st == S_OK && back == data);
            assert_eq!(g.request(q, T_FLUSH, 0, &[]).0, S_OK);
            let (st, _) = g.request(q, T_GET_ID, 0, &[0; 20]);
            assert_eq!(st, S_OK);
            // Out of range: an error costs nothing either.
            let (st, _) = g.read(q, DEVICE_BYTES >> 9, 4096);
            assert_eq!(st, S_IOERR);
            // Discard and write-zeroes of 8 sectors.
            let mut seg = (sector + 512).to_le_bytes().to_vec();
            seg.extend_from_slice(&8u32.to_le_bytes());
            seg.extend_from_slice(&0u32.to_le_bytes());
            assert_eq!(g.request(q, T_DISCARD, 0, &seg).0, S_OK);
            assert_eq!(g.request(q, T_WRITE_ZEROES, 0, &seg).0, S_OK);
            // A write through an indirect table, as Linux sends them.
            let (hdr, status) = g.header(q, T_OUT, sector + 512);
            let at = req_area(q) + DATA_OFF;
            g.write_mem(at, &data[..4096]);
            let table = indirect_write_table(hdr, at, status);
            let ind = at + 0x20000;
            g.write_mem(ind, &table);
            let (_, len) = g.submit(q, &[Desc(ind, 48, F_INDIRECT)]);
            assert_eq!((g.status(q), len), (S_OK, 1));
            // Data in 8 segments of 8 KiB (the ring holds 16 descriptors), written then read.
            let (hdr, status) = g.header(q, T_OUT, sector + 256);
            g.write_mem(at, &data);
            let mut descs = vec![Desc(hdr, 16, 0)];
            descs.extend((0..8u64).map(|i| Desc(at + 8192 * i, 8192, 0)));
            descs.push(Desc(status, 1, F_WRITE));
            let (_, len) = g.submit(q, &descs);
            assert_eq!((g.status(q), len), (S_OK, 1));
            let (hdr, status) = g.header(q, T_IN, sector + 256);
            let mut descs = vec![Desc(hdr, 16, 0)];
            descs.extend((0..8u64).map(|i| Desc(at + 8192 * i, 8192, F_WRITE)));
            descs.push(Desc(status, 1, F_WRITE));
            let (_, len) = g.submit(q, &descs);
            assert_eq!((g.status(q), len), (S_OK, (64 << 10) + 1));
        }
    };
    // Warm-up: the device's first writes place pages; the threads' first use of anything.
    for _ in 0..3 {
        round(&mut g);
    }
    let before = QUEUE_THREAD_ALLOCS.load(Ordering::Relaxed);
    for _ in 0..50 {
        round(&mut g);
    }
    let after = QUEUE_THREAD_ALLOCS.load(Ordering::Relaxed);
    assert!(
        before > 0,
        "no allocation counted at all: the counter does not see the threads"
    );
    assert_eq!(
        after - before,
        0,
        "allocations on the queue threads serving 1100 requests"
    );
}

/// A guest whose call eventfd cannot take a kick (its counter at the maximum: the server's
/// write fails, EAGAIN) is still served: the queue thread reports it and goes on (a handler
/// error would end vhost-user-backend's queue thread for good, silently).
#[test]
fn a_guest_that_cannot_be_kicked_is_still_served() {
    let _shared = shared();
    let s = serve("zram0");
    let mut g = Guest::connect(&s.socket);
    // The first used entry of a queue is signalled (used_event is 0 in this guest's memory).
    g.calls[0].write(u64::MAX - 1).unwrap();
    for seed in 0..4 {
        let data = pattern(4096, seed);
        assert_eq!(g.write(0, 8, &data), S_OK);
        let (st, back) = g.read(0, 8, data.len());
        assert!(st == S_OK && back == data, "request {seed}");
    }
    g.calls[0].read().unwrap();
    g.assert_served(11);
}

#[test]
fn a_front_end_that_vanishes_mid_request_leaves_the_socket_serving() {
    let _shared = shared();
    let s = serve("zram0");
    // Connections that leave at every step of the set-up.
    for step in 0..5 {
        let mut g = Guest::negotiate(&s.socket);
        if step >= 1 {
            g.set_mem_table().unwrap();
        }
        if step >= 2 {
            g.start_queue(0);
        }
        if step >= 3 {
            // A request offered and kicked, and the front end gone before its answer.
            let (hdr, status) = g.header(0, T_IN, 0);
            g.write_descs(
                0,
                &[
                    Desc(hdr, 16, F_NEXT),
                    Desc(req_area(0) + DATA_OFF, 256 << 10, F_NEXT | F_WRITE),
                    Desc(status, 1, F_WRITE),
                ],
            );
            g.offer_only(0, 0);
        }
        if step >= 4 {
            // Stopping the ring while it may be serving (GET_VRING_BASE).
            let _ = g.fe.get_vring_base(0);
        }
        drop(g);
    }
    let mut g = Guest::connect(&s.socket);
    g.assert_served(3);
    // Stop with a front end connected: in seconds, the socket removed.
    let t = Instant::now();
    let mut s = s;
    s.export.take().unwrap().stop();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "stop took {:?}",
        t.elapsed()
    );
    assert!(!s.socket.exists());
    assert!(g.fe.get_features().is_err(), "still connected after stop");
}

/// A guest that keeps its ring from ever running empty: a queue of 256 entries, and a thread
/// that offers the same write of 480 KiB (about a millisecond of compression each) again each
/// time one is used, so that a full ring is a few hundred milliseconds of work and the feeder
/// refills it long before the server could empty it (the guest's memory stays mapped in the
/// server after its front end leaves, so it can go on after that too). The queue thread
/// serves it without end; yet a front end that leaves is followed by a new one that is served
/// (the old ring is served no more), and stop ends in seconds: each waits for the queue
/// threads of the connection that ended, which must not keep serving a ring that is never
/// empty.
#[test]
fn a_guest_that_never_lets_its_ring_run_empty_cannot_hold_the_server() {
    let _shared = shared();
    const SIZE: u16 = 256;
    const LEN: usize = 480 << 10;
    let s = serve("zram0");
    let mut g = Guest::negotiate(&s.socket);
    g.set_mem_table().unwrap();
    g.fe.set_vring_num(0, SIZE).unwrap();
    g.fe.set_vring_base(0, 0).unwrap();
    let mut cfg = Guest::vring_config(0);
    cfg.queue_max_size = SIZE;
    cfg.queue_size = SIZE;
    g.fe.set_vring_addr(0, &cfg).unwrap();
    let kick = EventFd::new(EFD_NONBLOCK).unwrap();
    let call = EventFd::new(EFD_NONBLOCK).unwrap();
    g.fe.set_vring_kick(0, &kick).unwrap();
    g.fe.set_vring_call(0, &call).unwrap();
    g.fe.set_vring_enable(0, true).unwrap();
    // Head 0: a write of LEN bytes at sector 0.
    let (hdr, status) = g.header(0, T_OUT, 0);
    g.write_mem(req_area(0) + DATA_OFF, &pattern(LEN, 9));
    g.write_descs(
        0,
        &[
            Desc(hdr, 16, F_NEXT),
            Desc(req_area(0) + DATA_OFF, LEN as u32, F_NEXT),
            Desc(status, 1, F_WRITE),
        ],
    );
    let mem = g.mem.try_clone().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let used_at = ring(0) + USED_OFF + 2;
    let feeder = std::thread::spawn(move || {
        let r = ring(0);
        let (mut avail, mut offered) = (0u16, 0u64);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < deadline {
            let mut used = [0u8; 2];
            mem.read_exact_at(&mut used, used_at).unwrap();
            let used = u16::from_le_bytes(used);
            // The ring full (more would be a broken ring, which the server stops at), then a
            // kick.
            let mut more = false;
            while avail.wrapping_sub(used) < SIZE {
                let slot = u64::from(avail % SIZE);
                mem.write_all_at(&0u16.to_le_bytes(), r + AVAIL_OFF + 4 + 2 * slot)
                    .unwrap();
                avail = avail.wrapping_add(1);
                mem.write_all_at(&avail.to_le_bytes(), r + AVAIL_OFF + 2)
                    .unwrap();
                more = true;
                offered += 1;
            }
            if more {
                let _ = kick.write(1);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        offered
    });
    // The queue thread is serving the endless ring.
    std::thread::sleep(Duration::from_millis(500));
    let used_then = g.u16_at(used_at);
    std::thread::sleep(Duration::from_millis(300));
    assert_ne!(
        g.u16_at(used_at),
        used_then,
        "the endless ring is not being served"
    );
    assert_eq!(g.status(0), S_OK);

    // The front end leaves while the ring is still fed: the next one is served. (On another
    // thread, as the stop below: a server that never took the next front end would hang
    // this test, not fail it.)
    let probe = g.mem.try_clone().unwrap();
    let used_now = move || {
        let mut used = [0u8; 2];
        probe.read_exact_at(&mut used, used_at).unwrap();
        u16::from_le_bytes(used)
    };
    drop(g);
    let socket = s.socket.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut g2 = Guest::connect(&socket);
        g2.assert_served(6);
        let _ = tx.send(());
        // Connected until the stop below.
        std::thread::sleep(Duration::from_secs(30));
    });
    if rx.recv_timeout(Duration::from_secs(10)).is_err() {
        // (The feeder stops first: the server's teardown as this test unwinds waits for it.)
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        panic!("the next front end was not served in 10 s after one left with its guest feeding its ring");
    }
    // The old ring, still fed, is served no more.
    let used_then = used_now();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(used_now(), used_then, "the old ring is still served");

    // And stop, with the old guest still feeding its ring, ends in seconds. (On another
    // thread: a stop that hung would hang this test, not fail it.)
    let mut s = s;
    let export = s.export.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        export.stop();
        let _ = tx.send(());
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(10)).is_ok(),
        "stop did not end in 10 s with a guest feeding its ring"
    );
    assert!(!s.socket.exists());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let offered = feeder.join().unwrap();
    assert!(offered > 300, "only {offered} requests offered");
}
