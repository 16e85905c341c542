//! Waiting on a socket with a total deadline and the quit fd.
//!
//! Frontends put their sockets in non-blocking mode and wait with [`wait_fd`] before each
//! `read` or `write` that would block, so no wait outlasts its [`Deadline`], and a stop
//! ([`QuitFd`]) interrupts waits that are allowed to be interrupted.

use super::QuitFd;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// The instant a whole exchange (a handshake, a request, a reply) must be over by, computed once
/// when it starts; `None` means no limit (a connection idle between requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline(pub Option<Instant>);

impl Deadline {
    /// No limit.
    pub const NONE: Deadline = Deadline(None);

    /// `within` from now.
    pub fn after(within: Duration) -> Deadline {
        Deadline(Instant::now().checked_add(within))
    }

    /// The `poll` timeout in milliseconds: -1 for none, else what is left, rounded up so a
    /// wait never ends a little early and spins.
    fn poll_timeout_ms(self) -> i32 {
        match self.0 {
            None => -1,
            Some(t) => {
                let left = t.saturating_duration_since(Instant::now());
                let ms = left.as_micros().div_ceil(1000);
                i32::try_from(ms).unwrap_or(i32::MAX)
            }
        }
    }

    /// Whether it has passed.
    pub fn passed(self) -> bool {
        self.0.is_some_and(|t| Instant::now() >= t)
    }

    /// The earlier of the two.
    pub fn min(self, other: Deadline) -> Deadline {
        match (self.0, other.0) {
            (Some(a), Some(b)) => Deadline(Some(a.min(b))),
            (a, b) => Deadline(a.or(b)),
        }
    }
}

/// What to wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Readable (or closed, or an error pending: the next `read` says which).
    Read,
    /// Writable (or an error pending).
    Write,
}

/// Waits until `fd` is ready, the deadline passes (`TimedOut`), or `quit` is raised
/// (`ConnectionAborted`, with the message "stopping": not `Interrupted`, which `read_exact`
/// and friends would retry forever). Signals interrupting `poll` are retried.
pub fn wait_fd(
    fd: &impl AsRawFd,
    what: Readiness,
    deadline: Deadline,
    quit: Option<&QuitFd>,
) -> io::Result<()> {
    let events = match what {
        Readiness::Read => libc::POLLIN,
        Readiness::Write => libc::POLLOUT,
    };
    let mut fds = [
        libc::pollfd {
            fd: fd.as_raw_fd(),
            events,
            revents: 0,
        },
        libc::pollfd {
            fd: quit.map_or(-1, |q| q.as_raw_fd()),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        if quit.is_some_and(|q| q.is_raised()) {
            return Err(stopping());
        }
        let timeout = deadline.poll_timeout_ms();
        // SAFETY: `fds` is an array of two initialised pollfd that outlives the call, and its
        // length is passed; a negative fd is ignored by poll.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            return Err(stopping());
        }
        if fds[0].revents != 0 {
            return Ok(());
        }
        if deadline.passed() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
    }
}

fn stopping() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "stopping")
}

/// Puts a descriptor in non-blocking mode (reads and writes return `WouldBlock` rather than
/// wait; the frontend waits with [`wait_fd`] instead).
pub fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL takes no argument and only reads the descriptor's flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: F_SETFL takes an int of flags; it changes only the descriptor's status flags.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn waits_end_at_the_deadline_or_on_quit() {
        let (a, _b) = UnixStream::pair().unwrap();
        let t = Instant::now();
        let e = wait_fd(
            &a,
            Readiness::Read,
            Deadline::after(Duration::from_millis(50)),
            None,
        )
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() >= Duration::from_millis(50));
        let quit = QuitFd::new().unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                quit.raise();
            });
            let e = wait_fd(&a, Readiness::Read, Deadline::NONE, Some(&quit)).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
        });
        // Raised stays raised.
        let e = wait_fd(&a, Readiness::Read, Deadline::NONE, Some(&quit)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
        // Writable at once.
        wait_fd(&a, Readiness::Write, Deadline::NONE, None).unwrap();
    }
}
