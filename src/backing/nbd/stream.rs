//! A connection's byte stream: a TCP or unix socket, plain or TLS (rustls's client side, after
//! `NBD_OPT_STARTTLS`).
//!
//! The reader thread and the senders use one stream at once:
//!
//! - Plain: reads and writes go straight to the socket (`Conn::send_lock` keeps a request
//!   whole on the wire).
//! - TLS: one rustls connection holds both directions' state, so it sits under a mutex held
//!   only to move bytes in and out of it, never across a wait on the socket. The reader reads
//!   raw bytes without it and feeds them in (what rustls cannot take yet waits in
//!   `TlsState::received`, at most one socket read beyond a record); a sender encrypts under
//!   it and writes the records after releasing it, still under `send_lock`, so records leave
//!   in the order they were made. TLS output the reader causes (an alert, the answer to a key
//!   update) leaves with the next request.
//!
//! Lock order: `Conn::send_lock` before `tls`; the reader takes `tls` alone.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection};

use super::conn::lock;
use crate::error::{Error, Result};

/// Plaintext handed to rustls per step when sending: one TLS record.
const TLS_PIECE_BYTES: usize = 16 << 10;
/// Encrypted bytes gathered before they go to the socket (one system call per 64 KiB, as the
/// server's TLS replies).
const TLS_SEND_BYTES: usize = 64 << 10;
/// Raw bytes read from the socket per step on a TLS connection: a record and its header.
const TLS_READ_BYTES: usize = 17 << 10;

/// A connected socket.
#[derive(Debug)]
pub(super) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => (&*s).read(buf),
            Socket::Unix(s) => (&*s).read(buf),
        }
    }

    fn write_some(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => (&*s).write_vectored(bufs),
            Socket::Unix(s) => (&*s).write_vectored(bufs),
        }
    }

    /// Writes all of `parts` back to back (vectored, resuming after short writes).
    fn write_all_parts(&self, parts: &[&[u8]]) -> io::Result<()> {
        let (mut idx, mut at) = (0usize, 0usize);
        while idx < parts.len() {
            let slices: Vec<IoSlice<'_>> = std::iter::once(&parts[idx][at..])
                .chain(parts[idx + 1..].iter().copied())
                .take(crate::backing::MAX_OP_BUFS)
                .map(IoSlice::new)
                .collect();
            let mut n = match self.write_some(&slices) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            while idx < parts.len() && n >= parts[idx].len() - at {
                n -= parts[idx].len() - at;
                idx += 1;
                at = 0;
            }
            at += n;
        }
        Ok(())
    }
}

/// `Read` and `Write` on a shared socket, for rustls's handshake loop.
struct SocketIo<'a>(&'a Socket);

impl Read for SocketIo<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read_some(buf)
    }
}

impl Write for SocketIo<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write_some(&[IoSlice::new(buf)])
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// rustls's state and the raw bytes it has not taken yet.
struct TlsState {
    conn: ClientConnection,
    received: Vec<u8>,
}

/// A connection's stream. See the module docs.
pub(super) struct Stream {
    sock: Socket,
    tls: Option<Mutex<TlsState>>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("sock", &self.sock)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

impl Stream {
    pub fn plain(sock: Socket) -> Stream {
        Stream { sock, tls: None }
    }

    /// Runs the TLS handshake (after the server acknowledged `NBD_OPT_STARTTLS`); every byte
    /// after it is encrypted. Each wait is bounded by the socket's timeouts.
    pub fn start_tls(
        &mut self,
        config: Arc<ClientConfig>,
        name: ServerName<'static>,
    ) -> Result<()> {
        let mut conn =
            ClientConnection::new(config, name).map_err(|e| Error::io(format!("TLS: {e}")))?;
        let mut io = SocketIo(&self.sock);
        while conn.is_handshaking() {
            conn.complete_io(&mut io)
                .map_err(|e| Error::io(format!("TLS handshake: {e}")))?;
        }
        while conn.wants_write() {
            conn.write_tls(&mut io)
                .map_err(|e| Error::io(format!("TLS handshake: {e}")))?;
        }
        self.tls = Some(Mutex::new(TlsState {
            conn,
            received: Vec::new(),
        }));
        Ok(())
    }

    pub fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        match &self.sock {
            Socket::Tcp(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            Socket::Unix(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
        }
    }

    pub fn shutdown(&self) {
        let _ = match &self.sock {
            Socket::Tcp(s) => s.shutdown(Shutdown::Both),
            Socket::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    /// Reads what is there (plaintext on TLS): `Ok(0)` at the end of the stream; a socket
    /// timeout comes back as `WouldBlock` or `TimedOut`.
    pub fn read_some(&self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(tls) = &self.tls else {
            return self.sock.read_some(buf);
        };
        // Allocated only when the plaintext at hand does not do.
        let mut raw = Vec::new();
        loop {
            {
                let mut guard = lock(tls);
                let st = &mut *guard;
                while !st.received.is_empty() && st.conn.wants_read() {
                    let n = st.conn.read_tls(&mut &st.received[..])?;
                    if n == 0 {
                        break;
                    }
                    st.received.drain(..n);
                    st.conn.process_new_packets().map_err(tls_error)?;
                }
                match st.conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if !st.received.is_empty() {
                    // rustls wants no more and has no plaintext: it cannot make progress.
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "TLS: stuck with unprocessed input",
                    ));
                }
            }
            raw.resize(TLS_READ_BYTES, 0);
            let n = self.sock.read_some(&mut raw)?;
            if n == 0 {
                return Ok(0);
            }
            lock(tls).received.extend_from_slice(&raw[..n]);
        }
    }

    /// Writes all of `parts` back to back (the caller keeps other writers out).
    pub fn write_all_parts(&self, parts: &[&[u8]]) -> io::Result<()> {
        let Some(tls) = &self.tls else {
            return self.sock.write_all_parts(parts);
        };
        let mut out = Vec::new();
        for piece in parts.iter().flat_map(|p| p.chunks(TLS_PIECE_BYTES)) {
            {
                let mut st = lock(tls);
                st.conn.writer().write_all(piece)?;
                while st.conn.wants_write() {
                    st.conn.write_tls(&mut out)?;
                }
            }
            if out.len() >= TLS_SEND_BYTES {
                self.sock.write_all_parts(&[&out])?;
                out.clear();
            }
        }
        {
            // Whatever the reader left to send (an alert, a key update's answer).
            let mut st = lock(tls);
            while st.conn.wants_write() {
                st.conn.write_tls(&mut out)?;
            }
        }
        if !out.is_empty() {
            self.sock.write_all_parts(&[&out])?;
        }
        Ok(())
    }

    /// Reads exactly `buf` (the handshake: the socket's read timeout bounds each wait).
    pub fn read_exact_plain(&self, buf: &mut [u8]) -> io::Result<()> {
        let mut at = 0;
        while at < buf.len() {
            match self.read_some(&mut buf[at..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Sends TLS's `close_notify` (best effort; the caller keeps other writers out).
    pub fn close_notify(&self) {
        if let Some(tls) = &self.tls {
            lock(tls).conn.send_close_notify();
            let _ = self.write_all_parts(&[]);
        }
    }
}

/// The client's TLS configuration from a certificate directory in libnbd's and qemu's layout:
/// `ca-cert.pem` (the CA the server's certificate must chain to) and, for a server that asks
/// for client certificates, `client-cert.pem` and `client-key.pem`. `EINVAL` naming the file
/// that is missing or wrong.
pub(super) fn client_config(dir: &Path) -> Result<Arc<ClientConfig>> {
    use uzram_nbd_proto::tls::{load_certified_key, load_roots, provider};
    let invalid = |e: uzram_nbd_proto::tls::CredentialError| Error::invalid(e.to_string());
    let roots = load_roots(&dir.join("ca-cert.pem")).map_err(invalid)?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::invalid(format!("TLS: {e}")))?
        .with_root_certificates(roots);
    let (cert, key) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
    let config = if cert.exists() {
        let certified = load_certified_key(&cert, &key).map_err(invalid)?;
        builder.with_client_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(certified)))
    } else {
        builder.with_no_client_auth()
    };
    Ok(Arc::new(config))
}
