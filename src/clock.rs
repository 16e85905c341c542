//! Time as the device and the policies see it: a monotonic [`Clock`] injected where time
//! matters, so tests can move it by hand.
//!
//! The device stamps each slot's access time with its clock (`idle N` compares against it),
//! and the policy thread ([`crate::policy`]) decides when each policy is due with the same
//! kind of clock ([`BootClock`] in the server, so that their readings mean the same to the
//! next process). [`SystemClock`] is the real one (`Instant`, not the wall clock: a clock
//! set backwards never makes pages look younger); [`ManualClock`] only moves when a test
//! advances it, so a test can age pages by an hour in a microsecond while the real engine
//! acts on a real device.

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic clock: `now` never goes backwards. The origin is arbitrary (each clock's own).
pub trait Clock: Send + Sync + Debug {
    /// Time since the clock's origin.
    fn now(&self) -> Duration;
}

/// The real monotonic clock (`CLOCK_MONOTONIC` through `Instant`), from its creation.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    /// A clock starting at 0 now.
    pub fn new() -> SystemClock {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> SystemClock {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// The system's boot clock (`CLOCK_BOOTTIME`: monotonic, counting time suspended), from the
/// boot: every process of one boot reads the same, so a reading one server process saves in
/// a device's state (when its policies last ran) means the same to the next one (the state
/// does not outlive the boot: its memfds go with it). The server's policy thread's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct BootClock;

impl Clock for BootClock {
    fn now(&self) -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec for the call, which writes only it.
        let r = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
        // Fails only for a clock the kernel does not have (CLOCK_BOOTTIME: Linux 2.6.39).
        assert_eq!(r, 0, "clock_gettime(CLOCK_BOOTTIME)");
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }
}

/// A clock that moves only when [`advance`](ManualClock::advance)d: the controllable clock of
/// the policy tests. Shared through an `Arc` by the device and the policy runner.
#[derive(Debug, Default)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock at 0.
    pub fn new() -> ManualClock {
        ManualClock::default()
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let n = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(n, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let c = ManualClock::new();
        assert_eq!(c.now(), Duration::ZERO);
        c.advance(Duration::from_secs(3600));
        assert_eq!(c.now(), Duration::from_secs(3600));
        let s = SystemClock::new();
        let a = s.now();
        assert!(s.now() >= a);
        // The boot clock: since the boot (later than this process's start).
        let b = BootClock.now();
        assert!(BootClock.now() >= b && b > Duration::ZERO);
    }
}
