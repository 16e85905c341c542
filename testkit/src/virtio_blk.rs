//! A virtio-blk driver on a vhost-user-blk socket, without a VM: what QEMU's vhost-user front
//! end and a guest kernel's virtio-blk driver do together, in one small program.
//!
//! [`VhostUserBlk::connect`] speaks the vhost-user protocol as QEMU does, with the `vhost`
//! crate's `Frontend`: features (with `VIRTIO_RING_F_EVENT_IDX` when asked and offered),
//! protocol features (`MQ`, `REPLY_ACK`, `CONFIG`), the guest's memory as one memfd shared
//! with the server (`SET_MEM_TABLE`), then per queue `SET_VRING_NUM`, `_BASE`, `_ADDR`,
//! `_CALL`, `_KICK` and `_ENABLE`. The memory is mapped here too, so the region's userspace
//! address is this process's own, as QEMU's is.
//!
//! Each [`Virtqueue`] is a split virtqueue laid out in that memory (virtio 1.x, 2.7): the
//! descriptor table, the available ring (`flags`, `idx`, `ring[size]`, `used_event`) and the
//! used ring (`flags`, `idx`, `ring[size]` of `{id, len}`, `avail_event`). Requests live in
//! *slots*: slot `s` owns descriptors `[4s, 4s + 4)` and a request area (the 16-byte
//! `virtio_blk_outhdr`, the status byte, and `data_bytes` of data), so at most `size / 4`
//! requests are in flight. A request is the chain header (device-readable), its readable data
//! (a write's pages, a discard's segment), its writable data (a read's pages, GET_ID's 20
//! bytes), and the status byte (device-writable); [`Virtqueue::submit_chain`] writes any chain
//! of a slot's descriptors, for requests that break the rules on purpose.
//!
//! Notifications follow Linux's `virtio_ring.c`: [`Virtqueue::notify`] publishes the
//! available index (release), then (a full fence) reads the device's `avail_event` and kicks
//! the kick eventfd only when the new entries cross it (`vring_need_event`); without
//! EVENT_IDX it kicks unless the device set `VRING_USED_F_NO_NOTIFY`. [`Virtqueue::wait`]
//! reaps used entries (acquire), and when there are none, sets `used_event` to the next used
//! index (asking for a call on the next completion), fences, looks again, and only then sleeps
//! on the call eventfd.
//!
//! One thread owns a `Virtqueue` (it is `Send`); queues of one connection run on their own
//! threads, as a guest's vCPUs do. The memory is shared with the server: this side writes only
//! descriptors, the available ring and the readable parts of requests not in flight, and reads
//! the writable parts of a request only after its used entry.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;
use std::sync::atomic::{fence, AtomicU16, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserInflight, VhostUserProtocolFeatures,
    VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// `virtio_blk_outhdr.type` values (virtio 1.x, 5.2.6).
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;
/// Status byte values.
pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;
/// What a slot's status byte holds before the device writes it.
pub const S_UNTOUCHED: u8 = 0xee;
/// `VIRTIO_BLK_ID_BYTES`: GET_ID's answer.
pub const ID_BYTES: u32 = 20;

/// Feature bits (virtio 1.x, 5.2.3 and 6).
pub const F_SEG_MAX: u32 = 2;
pub const F_BLK_SIZE: u32 = 6;
pub const F_FLUSH: u32 = 9;
pub const F_CONFIG_WCE: u32 = 11;
pub const F_MQ: u32 = 12;
pub const F_DISCARD: u32 = 13;
pub const F_WRITE_ZEROES: u32 = 14;
pub const F_INDIRECT_DESC: u32 = 28;
pub const F_EVENT_IDX: u32 = 29;
pub const F_VERSION_1: u32 = 32;

const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;
/// `VRING_USED_F_NO_NOTIFY`: the device asks not to be kicked (without EVENT_IDX).
const USED_F_NO_NOTIFY: u16 = 1;

/// Descriptors per slot: header, readable data, writable data, status.
pub const DESCS_PER_SLOT: u16 = 4;
/// The request header's size (`virtio_blk_outhdr`).
pub const OUTHDR_BYTES: u32 = 16;
/// A slot's request area: the header at 0, the status byte at `STATUS_OFF`, data at
/// `DATA_OFF` (page-aligned, as a guest's page cache pages are).
const STATUS_OFF: u64 = 64;
const DATA_OFF: u64 = 4096;
const PAGE: u64 = 4096;

/// How to set a connection up.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// Virtqueues to start (at most what the device offers).
    pub queues: u16,
    /// Entries per virtqueue (a power of two, at most the device's maximum).
    pub queue_size: u16,
    /// Data bytes each slot holds (a request's largest payload).
    pub data_bytes: u32,
    /// Negotiate `VIRTIO_RING_F_EVENT_IDX` when the device offers it.
    pub event_idx: bool,
    /// Ask for an inflight region (`GET_INFLIGHT_FD`, then `SET_INFLIGHT_FD`, as QEMU does
    /// before the rings) when the device offers `INFLIGHT_SHMFD`, and keep it for
    /// [`VhostUserBlk::reconnect`].
    pub inflight: bool,
}

impl Default for DriverConfig {
    fn default() -> DriverConfig {
        DriverConfig {
            queues: 1,
            // QEMU's vhost-user-blk default (`queue-size=128`): 32 requests of 4 descriptors.
            queue_size: 128,
            data_bytes: 4096,
            event_idx: true,
            inflight: false,
        }
    }
}

/// The guest's memory: a memfd mapped shared here and handed to the server. Guest-physical
/// address 0 is the start of the file.
pub struct GuestRam {
    file: File,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory, valid until drop; every access goes through
// bounds-checked copies or atomics (`read`, `write`, `atomic_u16`), whichever thread makes it.
unsafe impl Send for GuestRam {}
// SAFETY: as for Send: no method hands out a reference that outlives the access.
unsafe impl Sync for GuestRam {}

impl std::fmt::Debug for GuestRam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestRam").field("len", &self.len).finish()
    }
}

impl GuestRam {
    /// A memfd of `len` bytes (zeroes), mapped shared.
    pub fn new(len: usize) -> io::Result<GuestRam> {
        // SAFETY: the name is a NUL-terminated string; memfd_create only reads it.
        let fd =
            unsafe { libc::memfd_create(c"uzram-virtio-blk-guest".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and nothing else owns it.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64)?;
        // SAFETY: a new shared mapping of the whole file, at an address the kernel picks; it is
        // unmapped only in drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(GuestRam {
            file,
            ptr: ptr.cast(),
            len,
        })
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// This process's address of guest-physical `gpa` (what vhost-user's ring addresses name).
    pub fn host_addr(&self, gpa: u64) -> u64 {
        self.ptr as u64 + gpa
    }

    fn check(&self, gpa: u64, len: usize) {
        assert!(
            gpa.checked_add(len as u64)
                .is_some_and(|end| end <= self.len as u64),
            "guest memory access {gpa:#x}+{len:#x} past its {:#x} bytes",
            self.len
        );
    }

    /// Copies `data` into guest memory at `gpa` (panics past its end).
    pub fn write(&self, gpa: u64, data: &[u8]) {
        self.check(gpa, data.len());
        // SAFETY: [gpa, gpa + len) lies in the mapping (checked); the server writes only into
        // buffers of requests in flight, which the driver does not write (module doc).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(gpa as usize), data.len())
        };
    }

    /// Copies guest memory at `gpa` into `buf` (panics past its end).
    pub fn read(&self, gpa: u64, buf: &mut [u8]) {
        self.check(gpa, buf.len());
        // SAFETY: [gpa, gpa + len) lies in the mapping (checked); `buf` is ours.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.add(gpa as usize), buf.as_mut_ptr(), buf.len())
        };
    }

    /// The little-endian u16 at `gpa` (2-aligned), as an atomic shared with the server.
    fn atomic_u16(&self, gpa: u64) -> &AtomicU16 {
        self.check(gpa, 2);
        assert_eq!(gpa % 2, 0, "unaligned ring field at {gpa:#x}");
        // SAFETY: in the mapping (checked) and 2-aligned (the mapping is page-aligned); the
        // reference lives no longer than `self`, which keeps the mapping; the server accesses
        // the same field atomically (ring indices and event fields, virtio 2.7.13).
        unsafe { &*(self.ptr.add(gpa as usize) as *const AtomicU16) }
    }

    fn u32_at(&self, gpa: u64) -> u32 {
        let mut b = [0u8; 4];
        self.read(gpa, &mut b);
        u32::from_le_bytes(b)
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, with its length; nothing refers to it any more
        // (references from `atomic_u16` borrow `self`).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// One descriptor of a chain: a guest-physical buffer, device-writable or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

/// A request: its type and sector, the bytes the device reads after the header (`out`), and
/// how many the device writes before the status (`in_len`).
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub kind: u32,
    pub sector: u64,
    pub out: &'a [u8],
    pub in_len: u32,
}

impl<'a> Request<'a> {
    /// A read of `len` bytes at `sector`.
    pub fn read(sector: u64, len: u32) -> Request<'static> {
        Request {
            kind: T_IN,
            sector,
            out: &[],
            in_len: len,
        }
    }

    /// A write of `data` at `sector`.
    pub fn write(sector: u64, data: &'a [u8]) -> Request<'a> {
        Request {
            kind: T_OUT,
            sector,
            out: data,
            in_len: 0,
        }
    }

    /// A request without data (FLUSH, or a type the device does not know).
    pub fn bare(kind: u32) -> Request<'static> {
        Request {
            kind,
            sector: 0,
            out: &[],
            in_len: 0,
        }
    }
}

/// `virtio_blk_discard_write_zeroes`: one segment of a DISCARD or WRITE_ZEROES request.
pub fn segment(sector: u64, sectors: u32, flags: u32) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[0..8].copy_from_slice(&sector.to_le_bytes());
    s[8..12].copy_from_slice(&sectors.to_le_bytes());
    s[12..16].copy_from_slice(&flags.to_le_bytes());
    s
}

/// A used entry: the slot whose request it ends, the status byte, the used length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub slot: u16,
    pub status: u8,
    pub used_len: u32,
}

/// Guest-physical addresses of one slot's request area.
#[derive(Debug, Clone, Copy)]
pub struct SlotArea {
    pub header: u64,
    pub status: u64,
    pub data: u64,
}

/// `vring_need_event`: whether moving an index from `old` to `new` crosses `event`.
fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// A split virtqueue driven from one thread.
pub struct Virtqueue {
    ram: Arc<GuestRam>,
    index: usize,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    slots: u64,
    slot_stride: u64,
    data_bytes: u32,
    kick: EventFd,
    call: EventFd,
    event_idx: bool,
    /// The available index after the entries written so far (published by `notify`).
    next_avail: u16,
    /// The available index at the last `notify`.
    notified_avail: u16,
    /// The used index up to which entries have been reaped.
    last_used: u16,
    free: Vec<u16>,
    in_flight: Vec<bool>,
    /// Kicks written, and sleeps on the call eventfd: the driver's side of the notification
    /// cost.
    pub kicks: u64,
    pub sleeps: u64,
}

impl std::fmt::Debug for Virtqueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Virtqueue")
            .field("index", &self.index)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl Virtqueue {
    /// Its index on the device.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Requests it can have in flight.
    pub fn slots(&self) -> u16 {
        self.size / DESCS_PER_SLOT
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        usize::from(self.slots()) - self.free.len()
    }

    /// The guest's memory (for requests written by hand).
    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// Where slot `slot`'s request lives.
    pub fn area(&self, slot: u16) -> SlotArea {
        assert!(slot < self.slots(), "slot {slot} of {}", self.slots());
        let base = self.slots + u64::from(slot) * self.slot_stride;
        SlotArea {
            header: base,
            status: base + STATUS_OFF,
            data: base + DATA_OFF,
        }
    }

    /// Data bytes a slot holds.
    pub fn data_bytes(&self) -> u32 {
        self.data_bytes
    }

    /// Takes a free slot, if any.
    pub fn take_slot(&mut self) -> Option<u16> {
        let s = self.free.pop()?;
        self.in_flight[usize::from(s)] = true;
        Some(s)
    }

    /// Writes slot `slot`'s header (type, ioprio 0, sector) and resets its status byte to
    /// [`S_UNTOUCHED`].
    pub fn write_header(&self, slot: u16, kind: u32, sector: u64) {
        let a = self.area(slot);
        let mut h = [0u8; OUTHDR_BYTES as usize];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.ram.write(a.header, &h);
        self.ram.write(a.status, &[S_UNTOUCHED]);
    }

    /// Puts `req` in a free slot and on the available ring (published by [`notify`]); the
    /// slot, or `None` when every slot is in flight.
    ///
    /// [`notify`]: Virtqueue::notify
    pub fn submit(&mut self, req: &Request<'_>) -> Option<u16> {
        let data_len = req.out.len() as u64 + u64::from(req.in_len);
        assert!(
            data_len <= u64::from(self.data_bytes),
            "{data_len} data bytes in a slot of {}",
            self.data_bytes
        );
        let slot = self.take_slot()?;
        self.write_header(slot, req.kind, req.sector);
        let a = self.area(slot);
        let mut chain = [Desc {
            addr: a.header,
            len: OUTHDR_BYTES,
            write: false,
        }; DESCS_PER_SLOT as usize];
        let mut n = 1;
        if !req.out.is_empty() {
            self.ram.write(a.data, req.out);
            chain[n] = Desc {
                addr: a.data,
                len: req.out.len() as u32,
                write: false,
            };
            n += 1;
        }
        if req.in_len > 0 {
            chain[n] = Desc {
                addr: a.data + req.out.len() as u64,
                len: req.in_len,
                write: true,
            };
            n += 1;
        }
        chain[n] = Desc {
            addr: a.status,
            len: 1,
            write: true,
        };
        self.offer(slot, &chain[..=n]);
        Some(slot)
    }

    /// Puts the chain `descs` (at most [`DESCS_PER_SLOT`], linked in order) in slot `slot`
    /// (taken with [`take_slot`](Virtqueue::take_slot)) and on the available ring: for
    /// requests written by hand.
    pub fn submit_chain(&mut self, slot: u16, descs: &[Desc]) {
        assert!(self.in_flight[usize::from(slot)], "slot {slot} not taken");
        self.offer(slot, descs);
    }

    fn offer(&mut self, slot: u16, descs: &[Desc]) {
        assert!(!descs.is_empty() && descs.len() <= usize::from(DESCS_PER_SLOT));
        let first = slot * DESCS_PER_SLOT;
        for (i, d) in descs.iter().enumerate() {
            let idx = first + i as u16;
            let mut flags = if d.write { DESC_F_WRITE } else { 0 };
            if i + 1 < descs.len() {
                flags |= DESC_F_NEXT;
            }
            let mut raw = [0u8; 16];
            raw[0..8].copy_from_slice(&d.addr.to_le_bytes());
            raw[8..12].copy_from_slice(&d.len.to_le_bytes());
            raw[12..14].copy_from_slice(&flags.to_le_bytes());
            raw[14..16].copy_from_slice(&(idx + 1).to_le_bytes());
            self.ram.write(self.desc + 16 * u64::from(idx), &raw);
        }
        let pos = u64::from(self.next_avail % self.size);
        self.ram
            .write(self.avail + 4 + 2 * pos, &first.to_le_bytes());
        self.next_avail = self.next_avail.wrapping_add(1);
    }

    /// Publishes the entries offered since the last call and kicks the device if it asked
    /// for it; returns whether it kicked.
    pub fn notify(&mut self) -> io::Result<bool> {
        let old = self.notified_avail;
        let new = self.next_avail;
        if old == new {
            return Ok(false);
        }
        // The descriptors and ring entries before the index (virtio 2.7.13.3: a write barrier).
        self.ram
            .atomic_u16(self.avail + 2)
            .store(new.to_le(), Ordering::Release);
        self.notified_avail = new;
        // The index before the device's event field (a full barrier, as Linux's
        // virtqueue_kick_prepare): otherwise a device that just went idle is missed.
        fence(Ordering::SeqCst);
        let kick = if self.event_idx {
            let event = u16::from_le(
                self.ram
                    .atomic_u16(self.used + 4 + 8 * u64::from(self.size))
                    .load(Ordering::Acquire),
            );
            need_event(event, new, old)
        } else {
            let flags = u16::from_le(self.ram.atomic_u16(self.used).load(Ordering::Acquire));
            flags & USED_F_NO_NOTIFY == 0
        };
        if kick {
            self.kick.write(1)?;
            self.kicks += 1;
        }
        Ok(kick)
    }

    fn used_idx(&self) -> u16 {
        u16::from_le(self.ram.atomic_u16(self.used + 2).load(Ordering::Acquire))
    }

    /// Reaps the used entries there are into `out` (their slots become free; a slot's data
    /// stays as the device left it until the slot is used again); how many.
    pub fn reap(&mut self, out: &mut Vec<Completion>) -> io::Result<usize> {
        let used = self.used_idx();
        let mut n = 0;
        while self.last_used != used {
            let pos = u64::from(self.last_used % self.size);
            let id = self.ram.u32_at(self.used + 4 + 8 * pos);
            let len = self.ram.u32_at(self.used + 8 + 8 * pos);
            let slot = (id / u32::from(DESCS_PER_SLOT)) as u16;
            if id % u32::from(DESCS_PER_SLOT) != 0
                || u32::from(slot) >= u32::from(self.slots())
                || !self.in_flight[usize::from(slot)]
            {
                return Err(io::Error::other(format!(
                    "queue {}: a used entry for descriptor {id}, no request in flight there",
                    self.index
                )));
            }
            self.in_flight[usize::from(slot)] = false;
            self.free.push(slot);
            let mut status = [0u8];
            self.ram.read(self.area(slot).status, &mut status);
            out.push(Completion {
                slot,
                status: status[0],
                used_len: len,
            });
            self.last_used = self.last_used.wrapping_add(1);
            n += 1;
        }
        Ok(n)
    }

    /// Waits for at least one used entry (reaped into `out`), at most `timeout`; how many.
    pub fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> io::Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.reap(out)?;
            if n > 0 {
                return Ok(n);
            }
            // Ask for a call at the next used entry, then look again before sleeping: an
            // entry added between the look above and this request would bring no call.
            if self.event_idx {
                self.ram
                    .atomic_u16(self.avail + 4 + 2 * u64::from(self.size))
                    .store(self.last_used.to_le(), Ordering::Release);
            }
            fence(Ordering::SeqCst);
            if self.used_idx() != self.last_used {
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "queue {}: no used entry within {timeout:?} ({} in flight)",
                        self.index,
                        self.in_flight()
                    ),
                ));
            }
            let mut pfd = libc::pollfd {
                fd: self.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd, for the duration of the call.
            let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            self.sleeps += 1;
            // Clears the counter (non-blocking: nothing to clear after a timeout).
            let _ = self.call.read();
        }
    }

    /// The used index up to which entries have been reaped.
    pub fn last_used(&self) -> u16 {
        self.last_used
    }

    /// Writes the driver's `used_event` (EVENT_IDX): the device is to call when its used index
    /// moves past `idx`. [`wait`](Self::wait) sets it too, before it sleeps.
    pub fn set_used_event(&self, idx: u16) {
        self.ram
            .atomic_u16(self.avail + 4 + 2 * u64::from(self.size))
            .store(idx.to_le(), Ordering::Release);
        fence(Ordering::SeqCst);
    }

    /// The calls the device made since the last look (the call eventfd's counter, cleared).
    pub fn take_calls(&mut self) -> u64 {
        self.call.read().unwrap_or(0)
    }

    /// Waits up to `timeout` for a call, then as [`take_calls`](Self::take_calls) (0 when
    /// none came).
    pub fn wait_calls(&mut self, timeout: Duration) -> io::Result<u64> {
        let mut pfd = libc::pollfd {
            fd: self.call.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().clamp(0, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd, for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        Ok(self.take_calls())
    }

    /// Submits `req`, notifies, and waits for its completion (nothing else in flight).
    pub fn run(&mut self, req: &Request<'_>) -> io::Result<Completion> {
        assert_eq!(self.in_flight(), 0, "run() with requests in flight");
        self.submit(req).expect("a free slot");
        self.notify()?;
        let mut out = Vec::with_capacity(1);
        self.wait(&mut out, Duration::from_secs(30))?;
        Ok(out[0])
    }

    /// The first `len` data bytes of slot `slot` (after its request completed).
    pub fn data(&self, slot: u16, len: usize) -> Vec<u8> {
        assert!(len <= self.data_bytes as usize);
        let mut v = vec![0u8; len];
        self.ram.read(self.area(slot).data, &mut v);
        v
    }

    /// Copies the first `buf.len()` data bytes of slot `slot` into `buf`.
    pub fn read_data(&self, slot: u16, buf: &mut [u8]) {
        assert!(buf.len() <= self.data_bytes as usize);
        self.ram.read(self.area(slot).data, buf);
    }
}

/// A connected vhost-user-blk front end: the socket (closing it ends the connection) and
/// what was negotiated. Its queues are handed out by [`VhostUserBlk::connect`].
pub struct VhostUserBlk {
    fe: Frontend,
    ram: Arc<GuestRam>,
    /// The protocol features acked.
    proto: VhostUserProtocolFeatures,
    /// The inflight region the device handed over, if asked for and offered: what
    /// `GET_INFLIGHT_FD` answered, and the file.
    inflight: Option<(VhostUserInflight, File)>,
    /// The virtio features acked (`F_*` bits, and vhost-user's PROTOCOL_FEATURES bit).
    pub features: u64,
    /// The device's capacity in 512-byte sectors (its config space).
    pub capacity_sectors: u64,
}

impl std::fmt::Debug for VhostUserBlk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserBlk")
            .field("features", &format_args!("{:#x}", self.features))
            .field("capacity_sectors", &self.capacity_sectors)
            .finish_non_exhaustive()
    }
}

fn vhost_err(what: &str, e: vhost::Error) -> io::Error {
    io::Error::other(format!("vhost-user {what}: {e}"))
}

impl VhostUserBlk {
    /// Connects to `socket`, negotiates as QEMU does and starts `cfg.queues` virtqueues.
    pub fn connect(
        socket: &Path,
        cfg: &DriverConfig,
    ) -> io::Result<(VhostUserBlk, Vec<Virtqueue>)> {
        assert!(cfg.queue_size.is_power_of_two() && cfg.queue_size >= DESCS_PER_SLOT);
        assert!(cfg.queues >= 1);
        let mut fe = Frontend::connect(socket, u64::from(cfg.queues))
            .map_err(|e| vhost_err("connect", e))?;
        fe.set_owner().map_err(|e| vhost_err("SET_OWNER", e))?;
        let offered = fe
            .get_features()
            .map_err(|e| vhost_err("GET_FEATURES", e))?;
        let protocol_bit = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if offered & protocol_bit == 0 || offered & (1 << F_VERSION_1) == 0 {
            return Err(io::Error::other(format!(
                "the device offers neither VERSION_1 nor PROTOCOL_FEATURES: {offered:#x}"
            )));
        }
        let mut want = (1u64 << F_VERSION_1)
            | (1 << F_SEG_MAX)
            | (1 << F_BLK_SIZE)
            | (1 << F_FLUSH)
            | (1 << F_CONFIG_WCE)
            | (1 << F_DISCARD)
            | (1 << F_WRITE_ZEROES)
            | protocol_bit;
        if cfg.event_idx {
            want |= 1 << F_EVENT_IDX;
        }
        if cfg.queues > 1 {
            want |= 1 << F_MQ;
        }
        let features = offered & want;
        let proto_offered = fe
            .get_protocol_features()
            .map_err(|e| vhost_err("GET_PROTOCOL_FEATURES", e))?;
        let mut proto_wanted = VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG;
        if cfg.inflight {
            proto_wanted |= VhostUserProtocolFeatures::INFLIGHT_SHMFD;
        }
        let proto = proto_offered & proto_wanted;
        fe.set_protocol_features(proto)
            .map_err(|e| vhost_err("SET_PROTOCOL_FEATURES", e))?;
        if proto.contains(VhostUserProtocolFeatures::REPLY_ACK) {
            // Every message answered, as QEMU asks: a refusal is seen where it happens.
            fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        if cfg.queues > 1 {
            let n = if proto.contains(VhostUserProtocolFeatures::MQ) {
                fe.get_queue_num()
                    .map_err(|e| vhost_err("GET_QUEUE_NUM", e))?
            } else {
                1
            };
            if n < u64::from(cfg.queues) {
                return Err(io::Error::other(format!(
                    "the device has {n} queues, {} asked",
                    cfg.queues
                )));
            }
        }
        fe.set_features(features)
            .map_err(|e| vhost_err("SET_FEATURES", e))?;
        let mut capacity_sectors = 0;
        if proto.contains(VhostUserProtocolFeatures::CONFIG) {
            // `capacity` is the config space's first field.
            let (_, payload) = fe
                .get_config(0, 8, VhostUserConfigFlags::empty(), &[0u8; 8])
                .map_err(|e| vhost_err("GET_CONFIG", e))?;
            capacity_sectors = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"));
        }
        let mut inflight = None;
        if proto.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD) {
            let ask = VhostUserInflight::new(0, 0, cfg.queues, cfg.queue_size);
            let (info, file) = fe
                .get_inflight_fd(&ask)
                .map_err(|e| vhost_err("GET_INFLIGHT_FD", e))?;
            fe.set_inflight_fd(&info, file.as_raw_fd())
                .map_err(|e| vhost_err("SET_INFLIGHT_FD", e))?;
            inflight = Some((info, file));
        }

        // The layout of each queue: its rings (each ring page-aligned), then its slots.
        let size = u64::from(cfg.queue_size);
        let round = |n: u64| n.div_ceil(PAGE) * PAGE;
        let desc_bytes = round(16 * size);
        let avail_bytes = round(6 + 2 * size);
        let used_bytes = round(6 + 8 * size);
        let rings_bytes = desc_bytes + avail_bytes + used_bytes;
        let slots = size / u64::from(DESCS_PER_SLOT);
        let slot_stride = DATA_OFF + round(u64::from(cfg.data_bytes));
        let queue_bytes = rings_bytes + slots * slot_stride;
        let ram_bytes = queue_bytes * u64::from(cfg.queues);
        let ram = Arc::new(GuestRam::new(ram_bytes as usize)?);
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: ram_bytes,
            userspace_addr: ram.host_addr(0),
            mmap_offset: 0,
            mmap_handle: ram.file.as_raw_fd(),
        };
        fe.set_mem_table(&[region])
            .map_err(|e| vhost_err("SET_MEM_TABLE", e))?;

        let event_idx = features & (1 << F_EVENT_IDX) != 0;
        let mut queues = Vec::with_capacity(usize::from(cfg.queues));
        for q in 0..usize::from(cfg.queues) {
            let base = q as u64 * queue_bytes;
            let (desc, avail, used) = (base, base + desc_bytes, base + desc_bytes + avail_bytes);
            fe.set_vring_num(q, cfg.queue_size)
                .map_err(|e| vhost_err("SET_VRING_NUM", e))?;
            fe.set_vring_base(q, 0)
                .map_err(|e| vhost_err("SET_VRING_BASE", e))?;
            fe.set_vring_addr(
                q,
                &VringConfigData {
                    queue_max_size: cfg.queue_size,
                    queue_size: cfg.queue_size,
                    flags: 0,
                    desc_table_addr: ram.host_addr(desc),
                    used_ring_addr: ram.host_addr(used),
                    avail_ring_addr: ram.host_addr(avail),
                    log_addr: None,
                },
            )
            .map_err(|e| vhost_err("SET_VRING_ADDR", e))?;
            let kick = EventFd::new(EFD_NONBLOCK)?;
            let call = EventFd::new(EFD_NONBLOCK)?;
            fe.set_vring_call(q, &call)
                .map_err(|e| vhost_err("SET_VRING_CALL", e))?;
            fe.set_vring_kick(q, &kick)
                .map_err(|e| vhost_err("SET_VRING_KICK", e))?;
            fe.set_vring_enable(q, true)
                .map_err(|e| vhost_err("SET_VRING_ENABLE", e))?;
            let nslots = slots as u16;
            queues.push(Virtqueue {
                ram: Arc::clone(&ram),
                index: q,
                size: cfg.queue_size,
                desc,
                avail,
                used,
                slots: base + rings_bytes,
                slot_stride,
                data_bytes: cfg.data_bytes,
                kick,
                call,
                event_idx,
                next_avail: 0,
                notified_avail: 0,
                last_used: 0,
                // Popped from the end: slot 0 first.
                free: (0..nslots).rev().collect(),
                in_flight: vec![false; usize::from(nslots)],
                kicks: 0,
                sleeps: 0,
            });
        }
        Ok((
            VhostUserBlk {
                fe,
                ram,
                proto,
                inflight,
                features,
                capacity_sectors,
            },
            queues,
        ))
    }

    /// Connects to `socket` again, as QEMU does after its back end died (`reconnect-ms`): a
    /// new connection negotiates the same features, hands the device the inflight region
    /// kept from the first (`SET_INFLIGHT_FD`) and the same memory, and starts `queues` (the
    /// ones `connect` gave, with their requests still in flight) on the same rings with new
    /// eventfds; each queue's base is its used index, which is all QEMU knows of a back end
    /// that did not answer `GET_VRING_BASE` (the device finds the rest in the region).
    /// One attempt: an error when nothing listens yet (the caller retries at its own pace;
    /// the `vhost` crate's own `connect` sleeps 100 ms between its attempts).
    pub fn reconnect(&mut self, socket: &Path, queues: &mut [Virtqueue]) -> io::Result<()> {
        let stream = std::os::unix::net::UnixStream::connect(socket)?;
        let mut fe = Frontend::from_stream(stream, queues.len().max(1) as u64);
        fe.set_owner().map_err(|e| vhost_err("SET_OWNER", e))?;
        let offered = fe
            .get_features()
            .map_err(|e| vhost_err("GET_FEATURES", e))?;
        if offered & self.features != self.features {
            return Err(io::Error::other(format!(
                "the device no longer offers {:#x}",
                self.features & !offered
            )));
        }
        let proto_offered = fe
            .get_protocol_features()
            .map_err(|e| vhost_err("GET_PROTOCOL_FEATURES", e))?;
        if !proto_offered.contains(self.proto) {
            return Err(io::Error::other(
                "the device no longer offers the protocol features",
            ));
        }
        fe.set_protocol_features(self.proto)
            .map_err(|e| vhost_err("SET_PROTOCOL_FEATURES", e))?;
        if self.proto.contains(VhostUserProtocolFeatures::REPLY_ACK) {
            fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        if self.proto.contains(VhostUserProtocolFeatures::MQ) {
            fe.get_queue_num()
                .map_err(|e| vhost_err("GET_QUEUE_NUM", e))?;
        }
        fe.set_features(self.features)
            .map_err(|e| vhost_err("SET_FEATURES", e))?;
        if let Some((info, file)) = &self.inflight {
            fe.set_inflight_fd(info, file.as_raw_fd())
                .map_err(|e| vhost_err("SET_INFLIGHT_FD", e))?;
        }
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: self.ram.len() as u64,
            userspace_addr: self.ram.host_addr(0),
            mmap_offset: 0,
            mmap_handle: self.ram.file.as_raw_fd(),
        };
        fe.set_mem_table(&[region])
            .map_err(|e| vhost_err("SET_MEM_TABLE", e))?;
        for vq in queues.iter_mut() {
            let q = vq.index;
            fe.set_vring_num(q, vq.size)
                .map_err(|e| vhost_err("SET_VRING_NUM", e))?;
            fe.set_vring_base(q, vq.used_idx())
                .map_err(|e| vhost_err("SET_VRING_BASE", e))?;
            fe.set_vring_addr(
                q,
                &VringConfigData {
                    queue_max_size: vq.size,
                    queue_size: vq.size,
                    flags: 0,
                    desc_table_addr: self.ram.host_addr(vq.desc),
                    used_ring_addr: self.ram.host_addr(vq.used),
                    avail_ring_addr: self.ram.host_addr(vq.avail),
                    log_addr: None,
                },
            )
            .map_err(|e| vhost_err("SET_VRING_ADDR", e))?;
            vq.kick = EventFd::new(EFD_NONBLOCK)?;
            vq.call = EventFd::new(EFD_NONBLOCK)?;
            fe.set_vring_call(q, &vq.call)
                .map_err(|e| vhost_err("SET_VRING_CALL", e))?;
            fe.set_vring_kick(q, &vq.kick)
                .map_err(|e| vhost_err("SET_VRING_KICK", e))?;
            fe.set_vring_enable(q, true)
                .map_err(|e| vhost_err("SET_VRING_ENABLE", e))?;
        }
        self.fe = fe;
        Ok(())
    }

    /// The inflight region's file, if the device gave one.
    pub fn inflight_file(&self) -> Option<&File> {
        self.inflight.as_ref().map(|(_, f)| f)
    }

    /// Whether feature bit `bit` (`F_*`) was negotiated.
    pub fn has(&self, bit: u32) -> bool {
        self.features & (1 << bit) != 0
    }

    /// The guest's memory.
    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// The vhost-user front end (for messages of a test's own).
    pub fn frontend(&mut self) -> &mut Frontend {
        &mut self.fe
    }
}
