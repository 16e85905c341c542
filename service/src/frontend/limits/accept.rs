//! [`accept_loop`]: the one accept loop every listening frontend runs.
//!
//! It waits on the listener and the quit fd together, so a stop ends it at once (never by
//! connecting to the socket's path, which may be gone or someone else's), and it takes a
//! [`ConnectionSlot`] for each connection before handing it on: past the cap the connection
//! is closed at once (the cap logs it).

use super::{wait_fd, ConnectionCap, ConnectionSlot, Deadline, QuitFd, Readiness};
use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

/// After an accept error (EMFILE, ENOMEM), wait this long before the next: such errors last,
/// and retrying at once would spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

/// A listening socket.
pub trait Listener: AsRawFd {
    /// An accepted connection.
    type Conn;
    /// Accepts one connection (the listener is non-blocking: `WouldBlock` when none waits).
    fn accept_one(&self) -> io::Result<Self::Conn>;
}

impl Listener for UnixListener {
    type Conn = UnixStream;
    fn accept_one(&self) -> io::Result<UnixStream> {
        self.accept().map(|(s, _)| s)
    }
}

impl Listener for TcpListener {
    type Conn = TcpStream;
    fn accept_one(&self) -> io::Result<TcpStream> {
        self.accept().map(|(s, _)| s)
    }
}

/// Accepts connections until `quit` is raised, handing each with its slot to `on_conn`.
/// The listener must be non-blocking. Accept errors are logged (if `log`) and retried after a
/// short pause.
pub fn accept_loop<L: Listener>(
    listener: &L,
    quit: &QuitFd,
    cap: &ConnectionCap,
    log: Option<&str>,
    mut on_conn: impl FnMut(L::Conn, ConnectionSlot),
) {
    loop {
        match wait_fd(listener, Readiness::Read, Deadline::NONE, Some(quit)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => return, // Stopping.
            Err(e) => {
                if let Some(what) = log {
                    eprintln!("{what}: poll: {e}");
                }
                return;
            }
        }
        match listener.accept_one() {
            Ok(conn) => match cap.try_acquire(log.is_some()) {
                Some(slot) => on_conn(conn, slot),
                None => drop(conn), // Closed at once; the cap logged it.
            },
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                if let Some(what) = log {
                    eprintln!("{what}: accept: {e}");
                }
                let _ = wait_fd(
                    quit,
                    Readiness::Read,
                    Deadline::after(ACCEPT_ERROR_BACKOFF),
                    None,
                );
                if quit.is_raised() {
                    return;
                }
            }
        }
    }
}
