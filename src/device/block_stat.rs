//! The block layer's `stat` file (`/sys/block/zram0/stat`, Documentation/block/stat.rst) for a
//! uzram device: requests counted as they enter and leave the request paths.
//!
//! The counters belong to the device, not to its store, and `reset` zeroes them as the kernel's
//! `zram_reset_device` does (`part_stat_set_all`). Each is an
//! atomic updated without a lock; `in_flight` and `io_ticks` are kept with one atomic each, so
//! `io_ticks` (time with at least one request in flight) may miss a few microseconds when
//! requests start and end at the same moment on several threads: a statistic, not an invariant.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The kind of a request, as the block layer groups them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A read.
    Read,
    /// A write (write-zeroes included, as the block layer counts `REQ_OP_WRITE_ZEROES`).
    Write,
    /// A discard.
    Discard,
    /// A flush.
    Flush,
}

/// One kind's counters.
#[derive(Debug, Default)]
struct OpCounters {
    ios: AtomicU64,
    sectors: AtomicU64,
    ticks_ms: AtomicU64,
}

/// The counters of the `stat` file.
#[derive(Debug)]
pub struct BlockStat {
    epoch: Instant,
    read: OpCounters,
    write: OpCounters,
    discard: OpCounters,
    flush: OpCounters,
    in_flight: AtomicU64,
    /// When `in_flight` last went from 0 to 1, in µs since `epoch`.
    busy_since_us: AtomicU64,
    io_ticks_us: AtomicU64,
}

impl Default for BlockStat {
    fn default() -> BlockStat {
        BlockStat {
            epoch: Instant::now(),
            read: OpCounters::default(),
            write: OpCounters::default(),
            discard: OpCounters::default(),
            flush: OpCounters::default(),
            in_flight: AtomicU64::new(0),
            busy_since_us: AtomicU64::new(0),
            io_ticks_us: AtomicU64::new(0),
        }
    }
}

/// A request being counted: ends when dropped (whatever its result, as the block layer counts
/// failed requests too).
#[derive(Debug)]
pub struct InFlight<'a> {
    stat: &'a BlockStat,
    op: Op,
    start: Instant,
}

impl BlockStat {
    fn counters(&self, op: Op) -> &OpCounters {
        match op {
            Op::Read => &self.read,
            Op::Write => &self.write,
            Op::Discard => &self.discard,
            Op::Flush => &self.flush,
        }
    }

    fn now_us(&self) -> u64 {
        self.us_at(Instant::now())
    }

    /// `t` in µs since `epoch`.
    fn us_at(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_micros() as u64
    }

    /// Counts a request of `bytes` starting now; it is accounted as done when the result is
    /// dropped.
    /// One clock read here and one when the request ends (profiled on the store path: the
    /// clock was 2.8% of a page write's CPU with four reads per request and the slot's
    /// access time; bench/notes.md, "Where write_vs_raw's missing tenth goes").
    pub fn start(&self, op: Op, bytes: u64) -> InFlight<'_> {
        let c = self.counters(op);
        c.ios.fetch_add(1, Ordering::Relaxed);
        c.sectors.fetch_add(bytes / 512, Ordering::Relaxed);
        let start = Instant::now();
        if self.in_flight.fetch_add(1, Ordering::AcqRel) == 0 {
            self.busy_since_us
                .store(self.us_at(start), Ordering::Release);
        }
        InFlight {
            stat: self,
            op,
            start,
        }
    }

    /// Zeroes every counter (`reset`; nothing may be in flight).
    pub fn reset(&self) {
        for c in [&self.read, &self.write, &self.discard, &self.flush] {
            c.ios.store(0, Ordering::Relaxed);
            c.sectors.store(0, Ordering::Relaxed);
            c.ticks_ms.store(0, Ordering::Relaxed);
        }
        self.io_ticks_us.store(0, Ordering::Relaxed);
    }

    /// The `stat` file: 17 fields as the kernel prints them (`%8lu ...`): reads (I/Os,
    /// merges, sectors, ticks ms), writes (the same), in_flight, io_ticks ms, time_in_queue ms,
    /// discards (I/Os, merges, sectors, ticks), flushes (I/Os, ticks). Merges are always 0.
    pub fn stat(&self) -> String {
        let f = |c: &OpCounters| {
            (
                c.ios.load(Ordering::Relaxed),
                c.sectors.load(Ordering::Relaxed),
                c.ticks_ms.load(Ordering::Relaxed),
            )
        };
        let (r, w, d, fl) = (
            f(&self.read),
            f(&self.write),
            f(&self.discard),
            f(&self.flush),
        );
        let in_flight = self.in_flight.load(Ordering::Acquire);
        let mut io_ticks_us = self.io_ticks_us.load(Ordering::Relaxed);
        if in_flight > 0 {
            io_ticks_us += self
                .now_us()
                .saturating_sub(self.busy_since_us.load(Ordering::Acquire));
        }
        let time_in_queue = r.2 + w.2 + d.2 + fl.2;
        format!(
            "{:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8}\n",
            r.0,
            0,
            r.1,
            r.2,
            w.0,
            0,
            w.1,
            w.2,
            in_flight,
            io_ticks_us / 1000,
            time_in_queue,
            d.0,
            0,
            d.1,
            d.2,
            fl.0,
            fl.2
        )
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let s = self.stat;
        let end = Instant::now();
        s.counters(self.op).ticks_ms.fetch_add(
            end.saturating_duration_since(self.start).as_millis() as u64,
            Ordering::Relaxed,
        );
        if s.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            let busy = s
                .us_at(end)
                .saturating_sub(s.busy_since_us.load(Ordering::Acquire));
            s.io_ticks_us.fetch_add(busy, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_requests_and_sectors_in_the_kernels_format() {
        let s = BlockStat::default();
        assert_eq!(s.stat().split_whitespace().count(), 17);
        assert!(s.stat().split_whitespace().all(|w| w == "0"));
        drop(s.start(Op::Read, 8192));
        drop(s.start(Op::Read, 4096));
        {
            let _w = s.start(Op::Write, 4096);
            let f: Vec<u64> = s
                .stat()
                .split_whitespace()
                .map(|w| w.parse().unwrap())
                .collect();
            assert_eq!(f[8], 1, "in flight");
        }
        drop(s.start(Op::Discard, 1 << 20));
        drop(s.start(Op::Flush, 0));
        let f: Vec<u64> = s
            .stat()
            .split_whitespace()
            .map(|w| w.parse().unwrap())
            .collect();
        assert_eq!((f[0], f[2]), (2, 24));
        assert_eq!((f[4], f[6]), (1, 8));
        assert_eq!(f[8], 0);
        assert_eq!((f[11], f[13]), (1, 2048));
        assert_eq!(f[15], 1);
        assert_eq!(s.stat().len(), 17 * 9);
        s.reset();
        assert!(s.stat().split_whitespace().all(|w| w == "0"));
    }
}
