//! [`QuitFd`]: the pipe-to-self a server stops through.
//!
//! An `eventfd` that is written once and never read: after [`QuitFd::raise`] it stays readable,
//! so every `poll` that includes it returns at once, however many threads wait on it and
//! whenever they start waiting. Raising it is one `write(2)`, which is async-signal-safe, so a
//! signal handler may do it directly.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// A stop flag that `poll` can wait on.
#[derive(Debug)]
pub struct QuitFd {
    fd: OwnedFd,
    raised: AtomicBool,
}

impl QuitFd {
    /// A new, lowered quit fd.
    pub fn new() -> io::Result<QuitFd> {
        // SAFETY: eventfd takes an initial value and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(QuitFd {
            fd,
            raised: AtomicBool::new(false),
        })
    }

    /// Raises it: every waiter wakes, now and later. Idempotent.
    pub fn raise(&self) {
        self.raised.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from `one`, which lives across the call, to our own eventfd.
        // It cannot block (EFD_NONBLOCK) and fails only if the counter would overflow, which
        // would take 2^64 raises; the flag above is set either way.
        let _ = unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Whether it has been raised.
    pub fn is_raised(&self) -> bool {
        self.raised.load(Ordering::SeqCst)
    }
}

impl AsRawFd for QuitFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
