//! The vhost-user *inflight region* (the vhost-user spec's "Inflight I/O tracking",
//! `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`), split virtqueues only: shared memory in which the
//! back end records which requests it has taken from a queue and not yet completed, so that a
//! back end started after a crash resubmits them. The front end (QEMU) asks for the region
//! once (`GET_INFLIGHT_FD`: we make a memfd of zeroes and hand it over), keeps it, and hands
//! it back on every start of the device, a reconnection to a new back end included
//! (`SET_INFLIGHT_FD`); the back end keeps nothing itself.
//!
//! Layout (the spec's, per queue, each queue's part at `q * queue_region_bytes(size)`):
//!
//! ```text
//! u64 features (0)   u16 version   u16 desc_num   u16 last_batch_head   u16 used_idx
//! desc_num × { u8 inflight, u8 padding[5], u16 next, u64 counter }
//! ```
//!
//! `inflight` is 1 while descriptor head `i`'s request is taken and not used; `counter` orders
//! the taken requests (resubmitted in that order); `used_idx` is the used ring's index as of
//! the last completion this region recorded; `last_batch_head` is the head of the completion
//! being published. `version` is 0 in a fresh region, 1 once a back end has started the queue.
//!
//! The order of the stores (each `Release`, so each is in the file before the next: a killed
//! process stops at an instruction boundary, and a store to shared memory is in the file once
//! it retires), which makes a crash at any instruction safe:
//!
//! 1. **take**: the request's head is read from the available ring, then
//!    `desc[head].counter` and `desc[head].inflight = 1`, before the next head is read (one
//!    request at a time per queue). Stopped before the mark: the next back end computes its
//!    next available index as `used_idx + requests marked` and takes the request again from
//!    the ring; stopped after: the request is resubmitted.
//! 2. **complete**: `last_batch_head = head`; the used entry and then the used ring's index
//!    (the guest sees the completion); `desc[head].inflight = 0`; `used_idx` = the ring's
//!    index. Stopped before the ring's index moved: the request is still marked and the
//!    region's `used_idx` equals the ring's: resubmitted (the guest never saw it complete).
//!    Stopped after it moved: the region's `used_idx` is behind the ring's, so the next back
//!    end clears `desc[last_batch_head]` (that completion reached the guest) and catches
//!    `used_idx` up.
//!
//! A resubmitted request is served again from the start: every virtio-blk request is
//! idempotent (a write writes the same bytes, a read reads them again, discard and
//! write-zeroes are the same), and the guest has not seen it complete, so it issued nothing
//! that depends on it.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// The layout's version this code writes and reads.
pub const VERSION: u16 = 1;

/// Bytes of a queue's header (`features`, `version`, `desc_num`, `last_batch_head`,
/// `used_idx`).
const HEADER_BYTES: usize = 16;
/// Bytes of one descriptor's state.
const DESC_BYTES: usize = 16;
/// Each queue's part starts at a multiple of this.
const QUEUE_ALIGN: usize = 64;

const OFF_VERSION: usize = 8;
const OFF_DESC_NUM: usize = 10;
const OFF_LAST_BATCH_HEAD: usize = 12;
const OFF_USED_IDX: usize = 14;
const DESC_OFF_INFLIGHT: usize = 0;
const DESC_OFF_COUNTER: usize = 8;

/// Bytes of one queue's part for queues of `queue_size` descriptors.
pub fn queue_region_bytes(queue_size: u16) -> usize {
    (HEADER_BYTES + DESC_BYTES * usize::from(queue_size)).next_multiple_of(QUEUE_ALIGN)
}

/// Bytes of a region for `num_queues` queues of `queue_size` descriptors.
pub fn region_bytes(num_queues: u16, queue_size: u16) -> usize {
    usize::from(num_queues) * queue_region_bytes(queue_size)
}

/// A new region: a sealed memfd (it cannot shrink, so a mapping of it never faults past its
/// end) of `region_bytes(num_queues, queue_size)` zeroes, for `GET_INFLIGHT_FD`.
pub fn create(num_queues: u16, queue_size: u16) -> io::Result<File> {
    let bytes = region_bytes(num_queues, queue_size);
    // SAFETY: the name is a NUL-terminated string; memfd_create only reads it.
    let fd = unsafe {
        libc::memfd_create(
            c"uzram-vhost-inflight".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(bytes as u64)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl(F_ADD_SEALS) on a descriptor we own; no memory is passed.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// A region handed over by `SET_INFLIGHT_FD`, mapped shared. Its memory is only accessed
/// through atomics (the front end maps it too, and a previous back end may have left any
/// bytes in it: every value read is checked before use).
#[derive(Debug)]
pub struct Region {
    ptr: *mut u8,
    len: usize,
    num_queues: u16,
    queue_size: u16,
}

// SAFETY: the mapping is plain shared memory owned by this value until drop, accessed only
// through atomics.
unsafe impl Send for Region {}
// SAFETY: as above: every access is atomic.
unsafe impl Sync for Region {}

impl Region {
    /// Maps `file` as described by `SET_INFLIGHT_FD`: `mmap_size` bytes at `mmap_offset` for
    /// `num_queues` queues of `queue_size` descriptors. Refused unless the size is exactly
    /// ours for those numbers, the offset page-aligned, and the file sealed against shrinking
    /// and that long (an access past a file's end would raise SIGBUS in the server).
    pub fn map(
        file: &File,
        mmap_size: u64,
        mmap_offset: u64,
        num_queues: u16,
        queue_size: u16,
    ) -> io::Result<Region> {
        let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
        if num_queues == 0 || queue_size == 0 {
            return Err(invalid(format!(
                "inflight region of {num_queues} queues of {queue_size}"
            )));
        }
        let want = region_bytes(num_queues, queue_size);
        if mmap_size != want as u64 {
            return Err(invalid(format!(
                "inflight region of {mmap_size} bytes, {want} expected for {num_queues} \
                 queues of {queue_size}"
            )));
        }
        // SAFETY: sysconf reads no memory of ours.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
        if mmap_offset % page != 0 {
            return Err(invalid(format!(
                "inflight region at unaligned offset {mmap_offset}"
            )));
        }
        // SAFETY: fcntl(F_GET_SEALS) on a descriptor we hold; no memory is passed.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(invalid(
                "inflight region not sealed against shrinking".to_string(),
            ));
        }
        let file_len = file.metadata()?.len();
        if mmap_offset
            .checked_add(mmap_size)
            .map_or(true, |end| end > file_len)
        {
            return Err(invalid(format!(
                "inflight region of {mmap_size} bytes at {mmap_offset} past the end of its \
                 file ({file_len} bytes)"
            )));
        }
        // SAFETY: a new shared mapping of `want` bytes of the file at a page-aligned offset
        // within it (checked above; the file cannot shrink); nothing else is at the address
        // the kernel picks.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                want,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                mmap_offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Region {
            ptr: ptr.cast(),
            len: want,
            num_queues,
            queue_size,
        })
    }

    /// Queues the region covers.
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// Descriptors per queue it covers.
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    fn at<T>(&self, off: usize) -> &T {
        assert!(off % std::mem::align_of::<T>() == 0 && off + std::mem::size_of::<T>() <= self.len);
        // SAFETY: in bounds and aligned (checked above; the mapping is page-aligned); the
        // atomic types have the layout of their integers and any bytes are valid for them;
        // the mapping lives as long as `self`.
        unsafe { &*self.ptr.add(off).cast::<T>() }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly our mapping; no reference into it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// One queue's part of a [`Region`]. Used by the queue's own thread only (under its queue's
/// lock), and by the connection thread while the queue is stopped.
#[derive(Debug, Clone)]
pub struct QueueInflight {
    region: Arc<Region>,
    base: usize,
    size: u16,
}

/// What [`QueueInflight::start`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Start {
    /// A fresh region (nothing was ever taken with it): the queue starts where the front end
    /// says (`SET_VRING_BASE`).
    Fresh,
    /// A region a back end used before: the next request to take from the available ring is
    /// at `next_avail`, after resubmitting the heads listed; `next_counter` is the counter
    /// for the next request taken.
    Used { next_avail: u16, next_counter: u64 },
}

impl QueueInflight {
    /// Queue `q`'s part of `region`, if it covers that queue.
    pub fn new(region: &Arc<Region>, q: usize) -> Option<QueueInflight> {
        if q >= usize::from(region.num_queues) {
            return None;
        }
        Some(QueueInflight {
            region: Arc::clone(region),
            base: q * queue_region_bytes(region.queue_size),
            size: region.queue_size,
        })
    }

    fn u16_at(&self, off: usize) -> &AtomicU16 {
        self.region.at(self.base + off)
    }

    fn desc_inflight(&self, head: u16) -> &AtomicU8 {
        self.region
            .at(self.base + HEADER_BYTES + usize::from(head) * DESC_BYTES + DESC_OFF_INFLIGHT)
    }

    fn desc_counter(&self, head: u16) -> &AtomicU64 {
        self.region
            .at(self.base + HEADER_BYTES + usize::from(head) * DESC_BYTES + DESC_OFF_COUNTER)
    }

    /// Whether head `head` is tracked (it is below the queue size the region was made for).
    pub fn covers(&self, head: u16) -> bool {
        head < self.size
    }

    /// The queue starts (its kick descriptor given, the rings' addresses known) with its used
    /// ring at index `ring_used_idx` and `queue_size` descriptors. A fresh region is
    /// initialised; a used one is brought up to date after a crash (completion step 2's last
    /// completion finished) and its requests taken and not completed are listed in
    /// `resubmit` (cleared first; at most the queue size), oldest first. An error when the
    /// region does not fit the queue (another size, a version we do not know).
    pub fn start(
        &self,
        queue_size: u16,
        ring_used_idx: u16,
        resubmit: &mut Vec<u16>,
    ) -> io::Result<Start> {
        resubmit.clear();
        let version = self.u16_at(OFF_VERSION).load(Ordering::Acquire);
        if version == 0 {
            if queue_size != self.size {
                return Err(io::Error::other(format!(
                    "inflight region for queues of {}, the queue has {queue_size}",
                    self.size
                )));
            }
            self.u16_at(OFF_DESC_NUM)
                .store(self.size, Ordering::Release);
            self.u16_at(OFF_USED_IDX)
                .store(ring_used_idx, Ordering::Release);
            self.u16_at(OFF_VERSION).store(VERSION, Ordering::Release);
            return Ok(Start::Fresh);
        }
        let desc_num = self.u16_at(OFF_DESC_NUM).load(Ordering::Acquire);
        if version != VERSION || desc_num != self.size || queue_size != self.size {
            return Err(io::Error::other(format!(
                "inflight region of version {version} for {desc_num} descriptors, the queue \
                 has {queue_size}"
            )));
        }
        let used_idx = self.u16_at(OFF_USED_IDX).load(Ordering::Acquire);
        if used_idx != ring_used_idx {
            // The last completion reached the used ring and not this region: it is done.
            let last = self.u16_at(OFF_LAST_BATCH_HEAD).load(Ordering::Acquire);
            if self.covers(last) {
                self.desc_inflight(last).store(0, Ordering::Release);
            }
            self.u16_at(OFF_USED_IDX)
                .store(ring_used_idx, Ordering::Release);
        }
        let mut taken: u16 = 0;
        let mut max_counter = 0u64;
        for head in 0..self.size {
            if self.desc_inflight(head).load(Ordering::Acquire) == 1 {
                taken += 1;
                max_counter = max_counter.max(self.desc_counter(head).load(Ordering::Acquire));
                resubmit.push(head);
            }
        }
        resubmit.sort_unstable_by_key(|&h| self.desc_counter(h).load(Ordering::Acquire));
        let next_counter = if resubmit.is_empty() {
            0
        } else {
            max_counter.wrapping_add(1)
        };
        Ok(Start::Used {
            next_avail: ring_used_idx.wrapping_add(taken),
            next_counter,
        })
    }

    /// Step 1: head `head`'s request was taken from the available ring, the `counter`-th.
    pub fn take(&self, head: u16, counter: u64) {
        if !self.covers(head) {
            return;
        }
        self.desc_counter(head).store(counter, Ordering::Release);
        self.desc_inflight(head).store(1, Ordering::Release);
    }

    /// Step 2, before the used entry is published: `head` is the completion in progress.
    pub fn completing(&self, head: u16) {
        if self.covers(head) {
            self.u16_at(OFF_LAST_BATCH_HEAD)
                .store(head, Ordering::Release);
        }
    }

    /// Step 2, after the used ring's index moved to `used_idx` with `head`'s entry.
    pub fn completed(&self, head: u16, used_idx: u16) {
        if self.covers(head) {
            self.desc_inflight(head).store(0, Ordering::Release);
        }
        self.u16_at(OFF_USED_IDX).store(used_idx, Ordering::Release);
    }

    /// Whether head `head` is marked taken (for tests and checks).
    pub fn is_taken(&self, head: u16) -> bool {
        self.covers(head) && self.desc_inflight(head).load(Ordering::Acquire) == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(queues: u16, size: u16) -> (File, Arc<Region>) {
        let f = create(queues, size).unwrap();
        let r = Region::map(&f, region_bytes(queues, size) as u64, 0, queues, size).unwrap();
        (f, Arc::new(r))
    }

    #[test]
    fn layout_and_checks() {
        assert_eq!(queue_region_bytes(128), 2112);
        assert_eq!(queue_region_bytes(256), 4160);
        let f = create(2, 128).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 2 * 2112);
        assert!(Region::map(&f, 100, 0, 2, 128).is_err(), "size");
        assert!(
            Region::map(&f, region_bytes(2, 128) as u64, 4096, 2, 128).is_err(),
            "end"
        );
        assert!(
            Region::map(&f, region_bytes(2, 128) as u64, 1, 2, 128).is_err(),
            "align"
        );
        assert!(f.set_len(10).is_err(), "sealed");
        // An unsealed file is refused.
        let plain = tempfile::tempfile().unwrap();
        plain.set_len(region_bytes(1, 16) as u64).unwrap();
        assert!(Region::map(&plain, region_bytes(1, 16) as u64, 0, 1, 16).is_err());
        let (_f, r) = region(2, 16);
        assert!(QueueInflight::new(&r, 2).is_none());
        let q = QueueInflight::new(&r, 1).unwrap();
        let mut list = Vec::new();
        assert!(q.start(32, 0, &mut list).is_err(), "another queue size");
    }

    /// The steps of one request, as the queue thread runs them, numbered so that a "crash"
    /// can stop after any of them: take (counter, mark), completing, the used ring's index,
    /// completed.
    struct Sim {
        q: QueueInflight,
        /// The guest's used ring index.
        ring_used: u16,
        /// Heads the guest saw completed.
        seen: Vec<u16>,
        counter: u64,
    }

    impl Sim {
        /// One step, unless the crash comes first (`steps` left is 0); whether it ran.
        fn step(&mut self, steps: &mut usize, f: impl FnOnce(&mut Sim)) -> bool {
            if *steps == 0 {
                return false;
            }
            *steps -= 1;
            f(self);
            true
        }

        /// Takes `head` (counter, mark); whether it ran.
        fn take(&mut self, head: u16, steps: &mut usize) -> bool {
            self.step(steps, |s| {
                s.q.take(head, s.counter);
                s.counter += 1;
            })
        }

        /// Completes `head`: completing, the used ring's index, completed; whether all ran.
        fn complete(&mut self, head: u16, steps: &mut usize) -> bool {
            self.step(steps, |s| s.q.completing(head))
                && self.step(steps, |s| {
                    s.ring_used = s.ring_used.wrapping_add(1);
                    s.seen.push(head);
                })
                && self.step(steps, |s| s.q.completed(head, s.ring_used))
        }
    }

    /// A crash after every step of a sequence of requests (some taken together, completed out
    /// of order): the next start resubmits exactly the requests taken and not seen completed,
    /// in the order taken, and points the available index past every request taken.
    #[test]
    fn a_crash_at_any_step_resubmits_exactly_the_requests_not_completed() {
        // Requests: heads taken in this order; the first two are held while the others
        // complete, then complete in reverse.
        let heads = [3u16, 7, 1, 12, 0, 15];
        for crash_at in 0..=heads.len() * 4 + 4 {
            let (_f, r) = region(1, 16);
            let q = QueueInflight::new(&r, 0).unwrap();
            let mut list = Vec::new();
            assert_eq!(q.start(16, 1000, &mut list).unwrap(), Start::Fresh);
            let mut sim = Sim {
                q: q.clone(),
                ring_used: 1000,
                seen: Vec::new(),
                counter: 0,
            };
            let mut steps = crash_at;
            let mut taken = Vec::new();
            // Take 3 and 7 (held), then take and complete the others one by one, then
            // complete 7 and 3.
            'run: {
                for &h in &heads[..2] {
                    if !sim.take(h, &mut steps) {
                        break 'run;
                    }
                    taken.push(h);
                }
                for &h in &heads[2..] {
                    if !sim.take(h, &mut steps) {
                        break 'run;
                    }
                    taken.push(h);
                    if !sim.complete(h, &mut steps) {
                        break 'run;
                    }
                }
                for &h in heads[..2].iter().rev() {
                    if !sim.complete(h, &mut steps) {
                        break 'run;
                    }
                }
            }
            // The next back end, over the same region.
            let q2 = QueueInflight::new(&r, 0).unwrap();
            let start = q2.start(16, sim.ring_used, &mut list).unwrap();
            let want: Vec<u16> = taken
                .iter()
                .copied()
                .filter(|h| !sim.seen.contains(h))
                .collect();
            assert_eq!(list, want, "crash after {crash_at} steps");
            let Start::Used {
                next_avail,
                next_counter,
            } = start
            else {
                panic!("crash after {crash_at}: a fresh region");
            };
            // Every request taken is either seen used or resubmitted; those the ring has
            // not handed out yet are after next_avail.
            assert_eq!(
                next_avail,
                sim.ring_used.wrapping_add(want.len() as u16),
                "crash after {crash_at}"
            );
            assert_eq!(next_avail.wrapping_sub(1000) as usize, taken.len());
            // Requests taken later count on from the last one resubmitted (counters are the
            // order of taking).
            if let Some(last) = want.last() {
                let pos = taken.iter().position(|h| h == last).unwrap();
                assert_eq!(next_counter, pos as u64 + 1, "crash after {crash_at}");
            }
            // Starting again (a second crash before anything moved) finds the same.
            let again = q2.start(16, sim.ring_used, &mut Vec::new()).unwrap();
            assert_eq!(again, start);
        }
    }
}
