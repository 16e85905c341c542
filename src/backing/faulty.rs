//! [`FaultyBacking`]: wraps any [`Backing`] and injects failures, for the fault tests and the
//! model test.
//!
//! # Faults
//!
//! A [`FaultPlan`] is installed at run time ([`FaultyBacking::set_plan`]); op numbers in it
//! count from 1 among the reads or writes made *after* it was installed. Every write (a
//! `write_at`, a `writev_at` or an op submitted to a queue) takes the next write number when it
//! starts; reads likewise. Faults:
//!
//! - [`FaultKind::Eio`]: nothing is written; the write fails with `Io`.
//! - [`FaultKind::NoSpace`]: nothing is written; the write fails with `NoSpace`. Also injected
//!   for every write that would push the bytes written since the plan past
//!   [`FaultPlan::no_space_after_bytes`], or that ends past
//!   [`FaultPlan::no_space_beyond_offset`].
//! - [`FaultKind::Short`]: the first half of the data (rounded down to a 512-byte sector) is
//!   written, the rest is not; the write fails with `Io` ("short write"). What a backing does
//!   when the OS reports a short count it cannot complete.
//! - [`FaultKind::Torn`]: every second 512-byte sector (the 2nd, 4th, ...) is written, the others
//!   keep their old contents; the write fails with `Io`. Not a prefix, so a test cannot mistake
//!   it for a short write.
//!
//! Reads fail with `Io` (nothing read) when their number is in the plan. With
//! [`FaultPlan::corrupt_read`] or [`FaultPlan::corrupt_reads_randomly`] a read succeeds but one
//! byte of what it returns is flipped (the backing's data is untouched): a device that returns
//! other bytes than were written, which only a checksum can tell. A corrupted queued read is
//! carried out synchronously at submit, like a faulted write.
//!
//! # Queues
//!
//! [`Backing::new_queue`] wraps the inner backing's queue: a write without a fault goes to the
//! inner queue (io_uring or synchronous, as the inner backing chooses); a faulted write is
//! carried out synchronously at submit time (its partial data written through the inner
//! backing) and its failed completion is returned by the next `wait`. Faults therefore apply
//! to queued writes exactly as to synchronous ones, and an injected op's buffers are never
//! with the kernel.
//!
//! The plan and the counters since it are behind one mutex (`state`), taken briefly per op;
//! the lifetime totals are atomics.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::check_submit;
use super::{
    check_range, total_len, Backing, IoCompletion, IoKind, IoOp, IoQueue, SubmitResult,
    SECTOR_SIZE_BYTES,
};
use crate::error::{Error, ErrorKind, Result};

/// What an injected write fault does. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// Nothing written, `Io`.
    Eio,
    /// Nothing written, `NoSpace`.
    NoSpace,
    /// The first half written, `Io`.
    Short,
    /// Every second sector written, `Io`.
    Torn,
}

/// Which operations fail and how. Built with the methods; installed with
/// [`FaultyBacking::set_plan`]. The default plan injects nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Write number (from 1, since the plan was installed) → fault.
    write_faults: BTreeMap<u64, FaultKind>,
    /// Read numbers (from 1) that fail with `Io`.
    read_faults: BTreeSet<u64>,
    no_space_after_bytes: Option<u64>,
    no_space_beyond_offset: Option<u64>,
    /// `(one_in, kind, seed)`: each write fails with `kind` with probability 1/`one_in`,
    /// decided by a hash of the seed and the write number (so a seed replays exactly).
    random_writes: Option<(u64, FaultKind, u64)>,
    /// `(one_in, seed)`: each read returns one flipped byte with probability 1/`one_in`,
    /// decided like `random_writes`.
    corrupt_reads: Option<(u64, u64)>,
    /// Read numbers (from 1) that return one flipped byte.
    corrupt_read_nths: BTreeSet<u64>,
}

impl FaultPlan {
    /// A plan that injects nothing.
    pub fn new() -> FaultPlan {
        FaultPlan::default()
    }

    /// The `nth` write (from 1) fails with `kind`.
    pub fn fail_write(mut self, nth: u64, kind: FaultKind) -> FaultPlan {
        self.write_faults.insert(nth, kind);
        self
    }

    /// The `nth` read (from 1) fails with `Io`.
    pub fn fail_read(mut self, nth: u64) -> FaultPlan {
        self.read_faults.insert(nth);
        self
    }

    /// Writes fail with `NoSpace` once they would take the bytes written since the plan was
    /// installed past `limit_bytes` (the write that would cross it writes nothing).
    pub fn no_space_after_bytes(mut self, limit_bytes: u64) -> FaultPlan {
        self.no_space_after_bytes = Some(limit_bytes);
        self
    }

    /// Writes that end past `limit_offset` fail with `NoSpace` (a backing smaller than it
    /// claims).
    pub fn no_space_beyond_offset(mut self, limit_offset: u64) -> FaultPlan {
        self.no_space_beyond_offset = Some(limit_offset);
        self
    }

    /// Each write fails with `kind` with probability `1 / one_in`, chosen by `seed` and the
    /// write's number, so the same seed injects the same faults.
    pub fn fail_writes_randomly(mut self, one_in: u64, kind: FaultKind, seed: u64) -> FaultPlan {
        self.random_writes = Some((one_in.max(1), kind, seed));
        self
    }
}

impl FaultPlan {
    /// Each read (synchronous or queued) succeeds with one byte of its data flipped with
    /// probability `1 / one_in`, chosen by `seed` and the read's number; the stored data stays
    /// intact, so the next read of it may be correct.
    pub fn corrupt_reads_randomly(mut self, one_in: u64, seed: u64) -> FaultPlan {
        self.corrupt_reads = Some((one_in.max(1), seed));
        self
    }

    /// The `nth` read (from 1) succeeds with one byte of its data flipped.
    pub fn corrupt_read(mut self, nth: u64) -> FaultPlan {
        self.corrupt_read_nths.insert(nth);
        self
    }
}

/// Operation counts of a [`FaultyBacking`] since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Reads started.
    pub reads: u64,
    /// Writes started (synchronous and queued).
    pub writes: u64,
    /// Bytes of writes that were passed on without a fault.
    pub bytes_written: u64,
    /// Faults injected (reads and writes).
    pub injected: u64,
}

/// The installed plan and the counters relative to it. Protected by `FaultyBacking::state`.
#[derive(Debug, Default)]
struct PlanState {
    plan: FaultPlan,
    reads_since_plan: u64,
    writes_since_plan: u64,
    bytes_since_plan: u64,
}

/// A backing that injects the faults of its plan into the operations on `inner`.
pub struct FaultyBacking<B: Backing> {
    inner: B,
    state: Mutex<PlanState>,
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_written: AtomicU64,
    injected: AtomicU64,
}

impl<B: Backing> FaultyBacking<B> {
    /// Wraps `inner` with an empty plan.
    pub fn new(inner: B) -> FaultyBacking<B> {
        FaultyBacking {
            inner,
            state: Mutex::new(PlanState::default()),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            injected: AtomicU64::new(0),
        }
    }

    /// Installs `plan`; its op numbers count from the next operation.
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.state.lock() = PlanState {
            plan,
            ..PlanState::default()
        };
    }

    /// Removes every fault.
    pub fn clear_plan(&self) {
        self.set_plan(FaultPlan::new());
    }

    /// Operation counts since the backing was made.
    pub fn counts(&self) -> FaultCounts {
        FaultCounts {
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            injected: self.injected.load(Ordering::Relaxed),
        }
    }

    /// The wrapped backing.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Numbers a write and decides its fate. `None`: pass it on (its bytes are counted now, so
    /// concurrent writes cannot overshoot a byte limit together).
    /// Counts a read and fails it with an injected `EIO` if the plan says so; otherwise
    /// returns the byte to flip in what it reads, if the plan corrupts it (the caller counts
    /// it as injected when it does).
    fn decide_read(&self, offset: u64, len_bytes: u64) -> Result<Option<u64>> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let (fail, corrupt) = {
            let mut st = self.state.lock();
            st.reads_since_plan += 1;
            let nth = st.reads_since_plan;
            let (one_in, seed) = st.plan.corrupt_reads.unwrap_or((0, 0));
            let h = splitmix64(seed ^ nth.wrapping_mul(0xD6E8_FEB8_6659_FD93));
            let corrupt = (st.plan.corrupt_read_nths.contains(&nth)
                || (one_in > 0 && h % one_in == 0))
                .then(|| (h >> 20) % len_bytes.max(1));
            (st.plan.read_faults.contains(&nth), corrupt)
        };
        if fail {
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(Error::io(format!(
                "injected EIO: read of {len_bytes} bytes at offset {offset}"
            )));
        }
        Ok(corrupt)
    }

    fn decide_write(&self, offset: u64, len_bytes: u64) -> Option<FaultKind> {
        self.writes.fetch_add(1, Ordering::Relaxed);
        let mut st = self.state.lock();
        st.writes_since_plan += 1;
        let nth = st.writes_since_plan;
        let plan = &st.plan;
        let fault = plan.write_faults.get(&nth).copied().or_else(|| {
            let beyond = plan
                .no_space_beyond_offset
                .is_some_and(|limit| offset + len_bytes > limit);
            let over = plan
                .no_space_after_bytes
                .is_some_and(|limit| st.bytes_since_plan + len_bytes > limit);
            if beyond || over {
                return Some(FaultKind::NoSpace);
            }
            plan.random_writes.and_then(|(one_in, kind, seed)| {
                (splitmix64(seed ^ nth.wrapping_mul(0x9E37_79B9_7F4A_7C15)) % one_in == 0)
                    .then_some(kind)
            })
        });
        match fault {
            None => {
                st.bytes_since_plan += len_bytes;
                self.bytes_written.fetch_add(len_bytes, Ordering::Relaxed);
            }
            Some(_) => {
                self.injected.fetch_add(1, Ordering::Relaxed);
            }
        }
        fault
    }

    /// Flips byte `at` of the bytes of `bufs` taken in order (an injected corrupt read).
    fn flip(&self, bufs: &mut [&mut [u8]], mut at: u64) {
        self.injected.fetch_add(1, Ordering::Relaxed);
        for b in bufs.iter_mut() {
            if let Some(byte) = b.get_mut(at as usize) {
                *byte ^= 0x5a;
                return;
            }
            at -= b.len() as u64;
        }
    }

    /// Un-counts the bytes of a write that was decided `None` but never issued (its submit
    /// was refused), so a byte limit is not consumed by it.
    fn refund_write(&self, len_bytes: u64) {
        let mut st = self.state.lock();
        st.bytes_since_plan = st.bytes_since_plan.saturating_sub(len_bytes);
        self.bytes_written.fetch_sub(len_bytes, Ordering::Relaxed);
    }

    /// Carries out a faulted write: writes the part `kind` lets through, returns the error.
    fn inject_write(&self, kind: FaultKind, bufs: &[&[u8]], offset: u64) -> Error {
        let len_bytes = total_len(bufs);
        let what = format!("{len_bytes} bytes at offset {offset}");
        match kind {
            FaultKind::Eio => Error::io(format!("injected EIO: write of {what}")),
            FaultKind::NoSpace => Error::new(
                ErrorKind::NoSpace,
                format!("injected ENOSPC: write of {what}"),
            ),
            FaultKind::Short | FaultKind::Torn => {
                let data: Vec<u8> = bufs.concat();
                let sector = SECTOR_SIZE_BYTES;
                let partial = if kind == FaultKind::Short {
                    let written = data.len() / 2 / sector * sector;
                    if written > 0 {
                        if let Err(e) = self.inner.write_at(&data[..written], offset) {
                            return e;
                        }
                    }
                    format!("injected short write: {written} of {len_bytes} bytes at {offset}")
                } else {
                    for (i, chunk) in data.chunks(sector).enumerate().skip(1).step_by(2) {
                        let at = offset + (i * sector) as u64;
                        if let Err(e) = self.inner.write_at(chunk, at) {
                            return e;
                        }
                    }
                    format!("injected torn write: every second sector of {what}")
                };
                Error::io(partial)
            }
        }
    }
}

/// The splitmix64 finaliser: a cheap, well-mixed hash for the random fault plan.
fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl<B: Backing> Backing for FaultyBacking<B> {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn block_size_bytes(&self) -> usize {
        self.inner.block_size_bytes()
    }

    fn readv_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> Result<()> {
        // One vectored read counts as one read for the plan.
        let len_bytes: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        check_range(self.inner.size_bytes(), offset, len_bytes, "read")?;
        let corrupt = self.decide_read(offset, len_bytes)?;
        self.inner.readv_at(bufs, offset)?;
        if let Some(at) = corrupt {
            self.flip(bufs, at);
        }
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let corrupt = self.decide_read(offset, buf.len() as u64)?;
        self.inner.read_at(buf, offset)?;
        if let Some(at) = corrupt {
            self.injected.fetch_add(1, Ordering::Relaxed);
            buf[at as usize] ^= 0x5a;
        }
        Ok(())
    }

    fn writev_at(&self, bufs: &[&[u8]], offset: u64) -> Result<()> {
        let len_bytes = total_len(bufs);
        // Invalid requests fail as the inner backing would, without using up a fault.
        check_range(self.inner.size_bytes(), offset, len_bytes, "write")?;
        match self.decide_write(offset, len_bytes) {
            None => self.inner.writev_at(bufs, offset),
            Some(kind) => Err(self.inject_write(kind, bufs, offset)),
        }
    }

    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn zone_geometry(&self) -> Option<&super::ZoneGeometry> {
        self.inner.zone_geometry()
    }

    fn report_zones(&self) -> Result<Vec<super::ZoneInfo>> {
        self.inner.report_zones()
    }

    fn reset_zone(&self, start_bytes: u64, len_bytes: u64) -> Result<()> {
        self.inner.reset_zone(start_bytes, len_bytes)
    }

    fn finish_zone(&self, start_bytes: u64, len_bytes: u64) -> Result<()> {
        self.inner.finish_zone(start_bytes, len_bytes)
    }

    fn new_queue(&self, depth: usize) -> Result<Box<dyn IoQueue + '_>> {
        Ok(Box::new(FaultyQueue {
            faulty: self,
            inner: self.inner.new_queue(depth)?,
            injected: VecDeque::new(),
        }))
    }
}

impl<B: Backing> fmt::Debug for FaultyBacking<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyBacking")
            .field("inner", &self.inner)
            .field("plan", &self.state.lock().plan)
            .field("counts", &self.counts())
            .finish()
    }
}

/// The queue of a [`FaultyBacking`]: the inner queue plus the failed completions of injected
/// faults, which count as in flight until reaped.
struct FaultyQueue<'a, B: Backing> {
    faulty: &'a FaultyBacking<B>,
    inner: Box<dyn IoQueue + 'a>,
    injected: VecDeque<IoCompletion>,
}

impl<B: Backing> IoQueue for FaultyQueue<'_, B> {
    fn depth(&self) -> usize {
        self.inner.depth()
    }

    fn submit(&mut self, mut op: IoOp) -> SubmitResult {
        let size_bytes = self.faulty.inner.size_bytes();
        if let Err(e) = check_submit(&op, self.in_flight(), self.depth(), size_bytes) {
            return Err((e, op));
        }
        let len_bytes = op.len_bytes();
        if op.kind == IoKind::Read {
            // Reads fail or are corrupted as the synchronous ones are (a corrupted one is
            // carried out now, its completion returned by the next `wait`), else go through.
            let result = match self.faulty.decide_read(op.offset, len_bytes) {
                Ok(None) => return self.inner.submit(op),
                Ok(Some(at)) => {
                    let offset = op.offset;
                    let mut slices = op.slices_mut();
                    let r = self.faulty.inner.readv_at(&mut slices, offset);
                    if r.is_ok() {
                        self.faulty.flip(&mut slices, at);
                    }
                    r
                }
                Err(err) => Err(err),
            };
            self.injected.push_back(IoCompletion { op, result });
            return Ok(());
        }
        match self.faulty.decide_write(op.offset, len_bytes) {
            None => self.inner.submit(op).inspect_err(|_| {
                self.faulty.refund_write(len_bytes);
            }),
            Some(kind) => {
                let slices = op.slices();
                let err = self.faulty.inject_write(kind, &slices, op.offset);
                self.injected.push_back(IoCompletion {
                    op,
                    result: Err(err),
                });
                Ok(())
            }
        }
    }

    fn wait(&mut self, min_complete: usize) -> Result<Vec<IoCompletion>> {
        let mut out: Vec<IoCompletion> = self.injected.drain(..).collect();
        let more = self.inner.wait(min_complete.saturating_sub(out.len()));
        match more {
            Ok(more) => out.extend(more),
            Err(e) if out.is_empty() => return Err(e),
            Err(_) => {}
        }
        Ok(out)
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.injected.len()
    }
}

impl<B: Backing> fmt::Debug for FaultyQueue<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyQueue")
            .field("inner", &self.inner)
            .field("injected", &self.injected.len())
            .finish()
    }
}
