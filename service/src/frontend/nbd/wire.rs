//! [`Wire`]: one connection's byte stream, plain or TLS, with every wait bounded.
//!
//! Reads and writes are non-blocking per call (`MSG_DONTWAIT`); one that would block waits in
//! [`wait_fd`](crate::frontend::limits::wait_fd) until its deadline. The one exception is the
//! wait for the next request on a plain socket ([`Channel::recv_idle`]): a blocking `recv`
//! with `SO_RCVTIMEO`, one system call where `poll` then `recv` would take two (a queue-depth-1
//! client pays that on every request; measured, it was 1 µs of the server's 9 per request). A connection's reader
//! (one thread) and its repliers (the worker threads) use the wire at once:
//!
//! - Plain: reads and writes go straight to the socket; `send_lock` keeps each reply whole.
//! - TLS: one rustls connection is both directions' state, so it sits under a mutex that is
//!   held only to move bytes in and out of it, never across a wait on the socket. Encrypted
//!   output is taken out under `send_lock` and written before the next sender takes any, so
//!   records leave in the order they were made. A reader that needs to send (a TLS alert, a
//!   key update) goes through the same lock.
//!
//! Lock order: `send_lock` before `tls`; the reader takes `tls` alone.

use super::transmission::Channel;
use crate::frontend::limits::{wait_fd, Deadline, QuitFd, Readiness};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// Bytes moved between the socket and rustls per step.
const TLS_CHUNK_BYTES: usize = 64 << 10;

/// A connected socket.
#[derive(Debug)]
pub enum Socket {
    /// A unix socket.
    Unix(UnixStream),
    /// A TCP socket.
    Tcp(TcpStream),
}

impl Socket {
    /// `recv(2)` with `flags`.
    fn raw_recv(&self, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
        // SAFETY: `buf` is a live, writable slice of `buf.len()` bytes for the whole call, and
        // the descriptor is this socket's, open while `self` lives.
        let n = unsafe { libc::recv(self.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), flags) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn raw_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.raw_recv(buf, libc::MSG_DONTWAIT)
    }

    fn raw_write(&self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: `buf` is a live slice of `buf.len()` bytes for the whole call, and the
        // descriptor is this socket's, open while `self` lives.
        let n = unsafe {
            libc::send(
                self.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Unix(s) => s.set_read_timeout(t),
            Socket::Tcp(s) => s.set_read_timeout(t),
        }
    }

    /// Shuts one or both directions (fails only if the peer is gone: ignored).
    pub fn shutdown(&self, how: Shutdown) {
        let _ = match self {
            Socket::Unix(s) => s.shutdown(how),
            Socket::Tcp(s) => s.shutdown(how),
        };
    }

    /// Whether it is a TCP socket.
    pub fn is_tcp(&self) -> bool {
        matches!(self, Socket::Tcp(_))
    }

    /// Reads some bytes, waiting until the deadline (or the quit fd).
    fn recv(&self, buf: &mut [u8], deadline: Deadline, quit: Option<&QuitFd>) -> io::Result<usize> {
        loop {
            match self.raw_read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait_fd(self, Readiness::Read, deadline, quit)?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Writes all of `buf` by the deadline.
    fn send_all(&self, mut buf: &[u8], deadline: Deadline) -> io::Result<()> {
        while !buf.is_empty() {
            match self.raw_write(buf) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait_fd(self, Readiness::Write, deadline, None)?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Socket::Unix(s) => s.as_raw_fd(),
            Socket::Tcp(s) => s.as_raw_fd(),
        }
    }
}

/// The rustls side of a TLS connection and the TLS bytes read but not yet taken by it.
struct TlsState {
    conn: rustls::Connection,
    raw_in: Vec<u8>,
    raw_at: usize,
}

/// A connection's byte stream; see the module documentation.
pub struct Wire {
    socket: Socket,
    /// The `SO_RCVTIMEO` last set, in µs (0: none), so that it is set only when it changes.
    read_timeout_us: AtomicU64,
    /// Set once, by [`Wire::start_tls`], before transmission starts.
    tls: OnceLock<Mutex<TlsState>>,
    send_lock: Mutex<()>,
}

impl std::fmt::Debug for Wire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wire")
            .field("socket", &self.socket)
            .field("tls", &self.is_tls())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

impl Wire {
    /// Wraps an accepted socket (left blocking: non-blocking calls say so per call).
    pub fn new(socket: Socket) -> io::Result<Wire> {
        Ok(Wire {
            socket,
            read_timeout_us: AtomicU64::new(0),
            tls: OnceLock::new(),
            send_lock: Mutex::new(()),
        })
    }

    /// The socket.
    pub fn socket(&self) -> &Socket {
        &self.socket
    }

    /// Whether TLS is up.
    pub fn is_tls(&self) -> bool {
        self.tls.get().is_some()
    }

    /// Runs a TLS handshake as the server (after `NBD_REP_ACK` to `STARTTLS` was sent), by the
    /// deadline; from then on every byte goes through TLS.
    pub fn start_tls(
        &self,
        config: Arc<rustls::ServerConfig>,
        deadline: Deadline,
        quit: Option<&QuitFd>,
    ) -> io::Result<()> {
        let conn = rustls::ServerConnection::new(config).map_err(tls_error)?;
        let fresh = Mutex::new(TlsState {
            conn: rustls::Connection::Server(conn),
            raw_in: Vec::new(),
            raw_at: 0,
        });
        if self.tls.set(fresh).is_err() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "TLS is already up",
            ));
        }
        loop {
            self.flush_tls(deadline)?;
            let handshaking = lock(self.tls.get().expect("set above"))
                .conn
                .is_handshaking();
            if !handshaking {
                return Ok(());
            }
            if self.pull_tls(deadline, quit)? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// Reads TLS bytes from the socket into rustls and processes them; returns the number read
    /// (0: the socket closed). Sends whatever rustls wants to send in answer.
    fn pull_tls(&self, deadline: Deadline, quit: Option<&QuitFd>) -> io::Result<usize> {
        let tls = self.tls.get().expect("TLS is up");
        let mut chunk = vec![0u8; TLS_CHUNK_BYTES];
        let n = self.socket.recv(&mut chunk, deadline, quit)?;
        chunk.truncate(n);
        let wants_write = {
            let mut t = lock(tls);
            let consumed = t.raw_at;
            t.raw_in.drain(..consumed);
            t.raw_at = 0;
            t.raw_in.extend_from_slice(&chunk);
            Self::feed(&mut t, n == 0)?;
            t.conn.wants_write()
        };
        if wants_write {
            self.flush_tls(deadline)?;
        }
        Ok(n)
    }

    /// Hands buffered TLS bytes to rustls as far as it takes them (it stops taking while its
    /// plaintext buffer is full; the rest waits in `raw_in`).
    fn feed(t: &mut TlsState, eof: bool) -> io::Result<()> {
        loop {
            let TlsState {
                conn,
                raw_in,
                raw_at,
            } = t;
            if *raw_at == raw_in.len() {
                if eof {
                    // Tell rustls the stream ended (a close without close_notify is an error
                    // its reader reports).
                    let _ = conn.read_tls(&mut io::empty());
                }
                return Ok(());
            }
            let mut rest = &raw_in[*raw_at..];
            match conn.read_tls(&mut rest) {
                Ok(0) => return Ok(()),
                Ok(n) => *raw_at += n,
                Err(e) if e.kind() == io::ErrorKind::Other => {
                    // Plaintext buffer full: process what is there; the reader drains it.
                    conn.process_new_packets().map_err(tls_error)?;
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
            conn.process_new_packets().map_err(tls_error)?;
        }
    }

    /// Writes out whatever TLS bytes rustls has to send, under the send lock.
    fn flush_tls(&self, deadline: Deadline) -> io::Result<()> {
        let _g = lock(&self.send_lock);
        self.flush_tls_locked(deadline)
    }

    fn flush_tls_locked(&self, deadline: Deadline) -> io::Result<()> {
        let tls = self.tls.get().expect("TLS is up");
        loop {
            let mut out = Vec::new();
            {
                let mut t = lock(tls);
                while t.conn.wants_write() && out.len() < TLS_CHUNK_BYTES {
                    t.conn.write_tls(&mut out)?;
                }
            }
            if out.is_empty() {
                return Ok(());
            }
            self.socket.send_all(&out, deadline)?;
        }
    }

    /// Reads plaintext (0: the client closed), waiting until the deadline or the quit fd.
    pub fn recv_until(
        &self,
        buf: &mut [u8],
        deadline: Deadline,
        quit: Option<&QuitFd>,
    ) -> io::Result<usize> {
        let Some(tls) = self.tls.get() else {
            return self.socket.recv(buf, deadline, quit);
        };
        loop {
            {
                let mut t = lock(tls);
                match t.conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if t.raw_at < t.raw_in.len() {
                    Self::feed(&mut t, false)?;
                    continue;
                }
            }
            self.pull_tls(deadline, quit)?;
        }
    }

    /// Sends all of `buf` as one unit, by the deadline.
    pub fn send_until(&self, buf: &[u8], deadline: Deadline) -> io::Result<()> {
        let _g = lock(&self.send_lock);
        let Some(tls) = self.tls.get() else {
            return self.socket.send_all(buf, deadline);
        };
        let mut rest = buf;
        while !rest.is_empty() {
            {
                let mut t = lock(tls);
                let n = t
                    .conn
                    .writer()
                    .write(&rest[..rest.len().min(TLS_CHUNK_BYTES)])?;
                rest = &rest[n..];
            }
            self.flush_tls_locked(deadline)?;
        }
        Ok(())
    }

    /// Whether plaintext is waiting in rustls (the socket may then have nothing to read).
    fn has_plaintext(&self) -> bool {
        let Some(tls) = self.tls.get() else {
            return false;
        };
        let mut t = lock(tls);
        if t.raw_at < t.raw_in.len() {
            return true; // Not yet processed: the next recv will look.
        }
        // Ask rustls how much plaintext it holds (processing nothing new).
        t.conn
            .process_new_packets()
            .map(|s| s.plaintext_bytes_to_read() > 0)
            .unwrap_or(true)
    }

    /// Ends a TLS session politely (close_notify), best effort.
    pub fn close_tls(&self, deadline: Deadline) {
        if let Some(tls) = self.tls.get() {
            lock(tls).conn.send_close_notify();
            let _ = self.flush_tls(deadline);
        }
    }
}

impl Channel for Wire {
    fn recv(&self, buf: &mut [u8], deadline: Deadline) -> io::Result<usize> {
        self.recv_until(buf, deadline, None)
    }

    fn recv_idle(&self, buf: &mut [u8], wait: Option<Duration>) -> io::Result<Option<usize>> {
        if self.is_tls() {
            let deadline = wait.map_or(Deadline::NONE, Deadline::after);
            return match self.wait_readable(deadline) {
                Err(e) if e.kind() == io::ErrorKind::TimedOut => Ok(None),
                Err(e) => Err(e),
                Ok(()) => self.recv_until(buf, Deadline::NONE, None).map(Some),
            };
        }
        let us = wait.map_or(0, |w| (w.as_micros() as u64).max(1));
        if self.read_timeout_us.swap(us, Ordering::Relaxed) != us {
            self.socket
                .set_read_timeout(wait.filter(|w| !w.is_zero()))?;
        }
        loop {
            match self.socket.raw_recv(buf, 0) {
                Ok(n) => return Ok(Some(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn wait_readable(&self, deadline: Deadline) -> io::Result<()> {
        if self.has_plaintext() {
            return Ok(());
        }
        wait_fd(&self.socket, Readiness::Read, deadline, None)
    }

    fn send_all(&self, buf: &[u8], deadline: Deadline) -> io::Result<()> {
        self.send_until(buf, deadline)
    }

    fn kill(&self) {
        self.socket.shutdown(Shutdown::Both);
    }
}
