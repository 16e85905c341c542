//! The transmission phase and the server's life: listeners, connections, clean stop.
//!
//! # Threads
//! - One accept thread per listener (unix socket or TCP). It blocks in `accept`; [`Server::stop`]
//!   wakes it by connecting to the listener itself after raising the stop flag.
//! - One thread per connection: it runs the handshake, then reads requests. Each request is
//!   validated from its header alone ([`classify`]); invalid ones are answered at once (a write's
//!   payload is read and thrown away first), valid ones go to the connection's worker pool.
//! - A small worker pool per connection (scoped threads, [`ServerConfig::workers_per_connection`])
//!   executes requests on the device and sends each reply as soon as it is ready, so replies
//!   leave in completion order, not request order (the protocol allows it).
//!
//! # Invariants
//! - Replies are written whole under the connection's writer mutex: a reply is one contiguous
//!   buffer (header and data together), so replies of different requests never interleave.
//! - A request is acknowledged only after the device call returned (and, with FUA, after a
//!   flush), so a client that vanishes loses nothing it was told was written.
//! - In-flight work per connection is bounded ([`MAX_INFLIGHT_REQUESTS`],
//!   [`MAX_INFLIGHT_BYTES`]): the reader waits before reading more payload.
//! - On stop, listeners stop accepting, every connection's read side is shut down (the client
//!   can send nothing more), requests already read are executed and answered, then the
//!   connections close and the unix socket files are removed.
//!
//! # Lock order
//! `Shared::conns` is never held while taking a connection's locks; a connection's `inflight`
//! lock is never held while writing a reply.

use super::handshake::{negotiate, Negotiated};
use super::protocol::*;
use super::{Export, Listen};
use crate::error::{Error, Result};
use crate::BlockDevice;
use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Requests in flight per connection before the reader stops reading: above qemu's 16 and
/// libnbd's default 64 per connection, so neither is ever throttled.
pub const MAX_INFLIGHT_REQUESTS: usize = 128;
/// Payload bytes in flight per connection (write payloads read, read buffers allocated): two
/// maximum-size requests, or 256 requests of 256 KiB (nbdcopy's default request size).
pub const MAX_INFLIGHT_BYTES: u64 = 2 * MAX_PAYLOAD_BYTES as u64;
/// How long a client may stay silent during the handshake (real clients take milliseconds);
/// a connection that never negotiates must not hold a thread forever.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one reply may wait for the client to make room in its socket: a client that stops
/// reading replies for this long is dropped, so it cannot hold workers (or a clean stop) forever.
pub const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(120);
/// Buffered reading of request headers: one `read` call fetches many small requests.
const READ_BUFFER_BYTES: usize = 256 << 10;

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Worker threads per connection. Requests are CPU-bound (compression), so more workers
    /// than cores gains little; two at least let one request's reply go out while the next
    /// compresses.
    pub workers_per_connection: usize,
    /// Print connection errors (protocol violations, I/O errors) to stderr.
    pub log_errors: bool,
    /// Fill each connection's buffer pool when it starts ([`PREALLOCATED_BUFFERS`] of
    /// [`PREALLOCATED_BUFFER_BYTES`]) rather than as requests arrive: for serving swap, where
    /// the request path should not take fresh memory (`uzram serve --swap`).
    pub preallocate: bool,
}

/// Buffers preallocated per connection with [`ServerConfig::preallocate`]: what qemu's NBD
/// client (a guest's swap disk) can have in flight (`MAX_NBD_REQUESTS`, 16). 2 MiB per
/// connection, locked under `--swap`; a deeper queue (the kernel's nbd driver has 128 tags)
/// takes more buffers as it goes, kept up to [`POOL_RETAINED_BYTES`].
pub const PREALLOCATED_BUFFERS: usize = 16;
/// Their data size: 128 KiB (the kernel's default `max_sectors_kb` for most devices, so the
/// usual largest swap request); each also has room for a reply header.
pub const PREALLOCATED_BUFFER_BYTES: usize = 128 << 10;
/// What a connection's buffer pool keeps between requests: 4 MiB, twice the preallocation,
/// i.e. 32 buffers of 128 KiB or 16 of nbdcopy's 256 KiB. Buffers beyond it are freed when their
/// request is answered (and, being at least malloc's mmap threshold under `--swap`, unmapped),
/// so an idle connection holds at most this much whatever burst it served: the memory a server
/// with N connections holds beyond its devices is N times this, not N times the 64 MiB
/// in-flight budget (docs/nbd.md, "Memory").
pub const POOL_RETAINED_BYTES: usize = 4 << 20;

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        ServerConfig {
            workers_per_connection: cores.clamp(2, 8),
            log_errors: true,
            preallocate: false,
        }
    }
}

/// A connected byte stream: a unix or a TCP socket. `&Stream` reads and writes, so the reader
/// and the writer of a connection share one socket without duplicating the descriptor.
#[derive(Debug)]
enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn shutdown(&self, how: Shutdown) {
        // Fails only if the peer is already gone, which is what we want anyway.
        let _ = match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        };
    }
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match *self {
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tcp(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match *self {
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Tcp(s) => (&*s).write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[derive(Debug)]
enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

/// Who has an export open: the count of connections in transmission on it, under a mutex that
/// also serialises operations that must not happen while the export is open (zram's `reset`
/// is `EBUSY` while the disk has openers; the control socket runs it under
/// [`Openers::while_unused`]).
#[derive(Debug, Default)]
pub struct Openers {
    count: Mutex<usize>,
}

impl Openers {
    /// Connections in transmission on the export now.
    pub fn count(&self) -> usize {
        *lock(&self.count)
    }

    /// Runs `f` with no connection in transmission and none able to start until it returns;
    /// `Err(n)` with the number of openers instead if there are any.
    pub fn while_unused<R>(&self, f: impl FnOnce() -> R) -> std::result::Result<R, usize> {
        let g = lock(&self.count);
        if *g > 0 {
            return Err(*g);
        }
        let r = f();
        drop(g);
        Ok(r)
    }

    fn open(&self) -> OpenGuard<'_> {
        *lock(&self.count) += 1;
        OpenGuard(self)
    }
}

/// One connection's hold on an export; released when dropped.
struct OpenGuard<'a>(&'a Openers);

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        *lock(&self.0.count) -= 1;
    }
}

/// State shared by the accept threads and connections.
struct Shared {
    exports: Vec<Export>,
    /// One per export, same order.
    openers: Vec<Arc<Openers>>,
    config: ServerConfig,
    /// Raised once by [`Server::stop`]; read everywhere.
    stopping: AtomicBool,
    /// Live connections, for shutting their read side on stop. Protected by its mutex; the
    /// stop flag is raised under it so that no connection registers after the sweep.
    conns: Mutex<HashMap<u64, Arc<Stream>>>,
    next_conn: AtomicU64,
    /// Number of connection threads alive; stop waits for it to reach 0.
    active: Mutex<usize>,
    active_cv: Condvar,
}

/// A running NBD server. Dropping it stops it (as [`Server::stop`]).
pub struct Server {
    shared: Arc<Shared>,
    accept_threads: Vec<JoinHandle<()>>,
    /// Where each listener is, for waking its accept thread and for the URIs.
    endpoints: Vec<Endpoint>,
    stopped: bool,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

/// One bound listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A unix socket and the export its empty name means.
    Unix {
        /// The socket file.
        path: PathBuf,
        /// The default export's name.
        default_export: String,
    },
    /// A TCP address (the actual port if 0 was asked for).
    Tcp(SocketAddr),
}

fn err_io(what: &str, path: &Path, e: io::Error) -> Error {
    let kind = Error::from(e);
    Error::new(
        kind.kind(),
        format!("{what} {}: {}", path.display(), kind.message()),
    )
}

/// Binds a unix socket with mode 0600 without a window where it is reachable with looser
/// permissions: bind under a temporary name, chmod, then rename into place. A stale socket
/// (nobody accepting) at `path` is replaced; a live one is an error (`EBUSY`).
pub(crate) fn bind_unix(path: &Path) -> Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(Error::busy(format!(
                "{} exists and is not a socket",
                path.display()
            )));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(Error::busy(format!(
                "{} is in use by a running server",
                path.display()
            )));
        }
        std::fs::remove_file(path).map_err(|e| err_io("cannot remove stale", path, e))?;
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let file = path
        .file_name()
        .map_or_else(|| "uzram.sock".into(), |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{file}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let l = UnixListener::bind(&tmp).map_err(|e| err_io("cannot bind", &tmp, e))?;
    let done = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(err_io("cannot place socket", path, e));
    }
    Ok(l)
}

impl Server {
    /// Binds every listener and starts serving `exports`. A unix listener's default export
    /// (the empty name) is the one named in its [`Listen::Unix`]; TCP's is the first export.
    pub fn start(exports: Vec<Export>, listen: &[Listen], config: ServerConfig) -> Result<Server> {
        if exports.is_empty() {
            return Err(Error::invalid("no exports"));
        }
        for (i, e) in exports.iter().enumerate() {
            if e.name.is_empty() || e.name.len() > MAX_STRING_BYTES || e.name.contains('\0') {
                return Err(Error::invalid(format!("bad export name {:?}", e.name)));
            }
            if exports[..i].iter().any(|o| o.name == e.name) {
                return Err(Error::invalid(format!("duplicate export {:?}", e.name)));
            }
        }
        let mut bound = Vec::new();
        let mut endpoints = Vec::new();
        let cleanup = |bound: &Vec<(Listener, Option<usize>)>| {
            for (l, _) in bound {
                if let Listener::Unix(_, p) = l {
                    let _ = std::fs::remove_file(p);
                }
            }
        };
        for l in listen {
            let r = match l {
                Listen::Unix { path, export } => {
                    let idx = exports.iter().position(|e| &e.name == export);
                    match idx {
                        None => Err(Error::invalid(format!(
                            "no export {export:?} to listen for"
                        ))),
                        Some(idx) => bind_unix(path).map(|u| {
                            endpoints.push(Endpoint::Unix {
                                path: path.clone(),
                                default_export: export.clone(),
                            });
                            (Listener::Unix(u, path.clone()), Some(idx))
                        }),
                    }
                }
                Listen::Tcp(addr) => TcpListener::bind(addr)
                    .and_then(|t| {
                        endpoints.push(Endpoint::Tcp(t.local_addr()?));
                        Ok((Listener::Tcp(t), Some(0)))
                    })
                    .map_err(|e| {
                        let e = Error::from(e);
                        Error::new(
                            e.kind(),
                            format!("cannot listen on {addr}: {}", e.message()),
                        )
                    }),
            };
            match r {
                Ok(b) => bound.push(b),
                Err(e) => {
                    cleanup(&bound);
                    return Err(e);
                }
            }
        }
        let shared = Arc::new(Shared {
            openers: exports.iter().map(|_| Arc::default()).collect(),
            exports,
            config,
            stopping: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            active: Mutex::new(0),
            active_cv: Condvar::new(),
        });
        let mut accept_threads = Vec::new();
        for (listener, default_export) in bound {
            let shared = Arc::clone(&shared);
            let t = std::thread::Builder::new()
                .name("nbd-accept".into())
                .spawn(move || accept_loop(&shared, &listener, default_export))
                .map_err(Error::from)?;
            accept_threads.push(t);
        }
        Ok(Server {
            shared,
            accept_threads,
            endpoints,
            stopped: false,
        })
    }

    /// Who has the export `name` open (`None`: no such export).
    pub fn openers(&self, name: &str) -> Option<Arc<Openers>> {
        let i = self.shared.exports.iter().position(|e| e.name == name)?;
        Some(Arc::clone(&self.shared.openers[i]))
    }

    /// The bound listeners.
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// The NBD URI of every export on every listener (`nbd+unix:///NAME?socket=PATH`,
    /// `nbd://HOST:PORT/NAME`), each with its export name.
    pub fn uris(&self) -> Vec<(String, String)> {
        let mut v = Vec::new();
        for ep in &self.endpoints {
            match ep {
                Endpoint::Unix {
                    path,
                    default_export,
                } => v.push((
                    default_export.clone(),
                    format!("nbd+unix:///{default_export}?socket={}", path.display()),
                )),
                Endpoint::Tcp(addr) => {
                    for e in &self.shared.exports {
                        v.push((e.name.clone(), format!("nbd://{addr}/{}", e.name)));
                    }
                }
            }
        }
        v
    }

    /// Stops cleanly: no new connections; every connection stops reading, answers the
    /// requests it has read, and closes; the unix socket files are removed. Returns when all
    /// connection threads have ended.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        {
            let conns = lock(&self.shared.conns);
            self.shared.stopping.store(true, Ordering::SeqCst);
            for s in conns.values() {
                s.shutdown(Shutdown::Read);
            }
        }
        // Wake the accept threads: each sees the flag after its accept returns.
        for ep in &self.endpoints {
            match ep {
                Endpoint::Unix { path, .. } => drop(UnixStream::connect(path)),
                Endpoint::Tcp(addr) => {
                    let mut a = *addr;
                    if a.ip().is_unspecified() {
                        a.set_ip(match a {
                            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                        });
                    }
                    drop(TcpStream::connect_timeout(&a, Duration::from_secs(1)));
                }
            }
        }
        for t in self.accept_threads.drain(..) {
            let _ = t.join();
        }
        let mut active = lock(&self.shared.active);
        while *active > 0 {
            active = self
                .shared
                .active_cv
                .wait(active)
                .unwrap_or_else(|p| p.into_inner());
        }
        drop(active);
        for ep in &self.endpoints {
            if let Endpoint::Unix { path, .. } = ep {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// Locks a mutex, ignoring poisoning: the data behind these mutexes (sockets, counters) stays
/// consistent even if a thread panicked while holding one.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn accept_loop(shared: &Arc<Shared>, listener: &Listener, default_export: Option<usize>) {
    loop {
        let accepted = match listener {
            Listener::Unix(l, _) => l.accept().map(|(s, _)| Stream::Unix(s)),
            Listener::Tcp(l) => l.accept().map(|(s, _)| {
                // NBD asks both ends to disable Nagle: replies are small and latency-bound.
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }),
        };
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let stream = match accepted {
            Ok(s) => Arc::new(s),
            Err(e) => {
                if shared.config.log_errors {
                    eprintln!("uzram nbd: accept: {e}");
                }
                // EMFILE and the like: back off rather than spin.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        {
            let mut conns = lock(&shared.conns);
            if shared.stopping.load(Ordering::SeqCst) {
                return;
            }
            conns.insert(id, Arc::clone(&stream));
        }
        *lock(&shared.active) += 1;
        let shared2 = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    serve_connection(&shared2, &stream, default_export)
                }));
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        if shared2.config.log_errors && !is_disconnect(&e) {
                            eprintln!("uzram nbd: connection {id}: {e}");
                        }
                    }
                    Err(_) => eprintln!("uzram nbd: connection {id}: internal error (panic)"),
                }
                stream.shutdown(Shutdown::Both);
                lock(&shared2.conns).remove(&id);
                let mut active = lock(&shared2.active);
                *active -= 1;
                shared2.active_cv.notify_all();
            });
        if spawned.is_err() {
            lock(&shared.conns).remove(&id);
            *lock(&shared.active) -= 1;
            shared.active_cv.notify_all();
        }
    }
}

fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::WouldBlock
            | io::ErrorKind::TimedOut
    )
}

fn serve_connection(
    shared: &Shared,
    stream: &Arc<Stream>,
    default_export: Option<usize>,
) -> io::Result<()> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(REPLY_WRITE_TIMEOUT))?;
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, &**stream);
    let mut writer = &**stream;
    let Some(neg) = negotiate(
        &mut reader,
        &mut writer,
        &shared.exports,
        default_export,
        &shared.stopping,
    )?
    else {
        return Ok(());
    };
    stream.set_read_timeout(None)?;
    let device = &*shared.exports[neg.export].device;
    let pool = BufPool::new(if shared.config.preallocate {
        PREALLOCATED_BUFFERS
    } else {
        0
    });
    let _open = shared.openers[neg.export].open();
    if device.size_bytes() != neg.size_bytes {
        // Reset (and perhaps resized) between the size being sent and now: the client's idea
        // of the export is wrong, so it must reconnect.
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the device was reset during the handshake",
        ));
    }
    let kill = || stream.shutdown(Shutdown::Both);
    transmission_with_pool(
        &mut reader,
        &**stream,
        device,
        &neg,
        shared.config.workers_per_connection,
        &shared.stopping,
        &kill,
        &pool,
    )
}

/// Room for a reply header in front of read data, so a pooled buffer of a class holds a
/// reply of that class's data size.
const POOL_HEADROOM_BYTES: usize = 64;
/// What preallocated buffers are filled with: anything but zero (see [`BufPool::new`]).
const POOL_PREFILL_BYTE: u8 = 0xa5;
/// Size classes: 4 KiB << k of data (plus headroom) for k = 0..=13, up to the 32 MiB maximum
/// payload.
const POOL_CLASSES: usize = 14;

fn pool_class_of_len(len: usize) -> usize {
    let pages = len
        .saturating_sub(POOL_HEADROOM_BYTES)
        .div_ceil(4096)
        .max(1);
    pages.next_power_of_two().trailing_zeros() as usize
}

fn pool_class_capacity(class: usize) -> usize {
    (4096 << class) + POOL_HEADROOM_BYTES
}

/// A connection's request buffers (write payloads, read replies), recycled: a buffer returns
/// here when its request is answered and a later request it can hold reuses it, so the steady
/// state allocates nothing. Buffers are kept in power-of-two size classes (a lookup is a few
/// vector pops, not a search) and the pool holds at most [`POOL_RETAINED_BYTES`].
struct BufPool {
    inner: Mutex<PoolInner>,
}

struct PoolInner {
    classes: [Vec<Vec<u8>>; POOL_CLASSES],
    held_bytes: usize,
}

impl BufPool {
    /// A pool holding `prefill` buffers of [`PREALLOCATED_BUFFER_BYTES`].
    fn new(prefill: usize) -> BufPool {
        let pool = BufPool {
            inner: Mutex::new(PoolInner {
                classes: Default::default(),
                held_bytes: 0,
            }),
        };
        for _ in 0..prefill {
            let class = pool_class_of_len(PREALLOCATED_BUFFER_BYTES);
            // Filled with a nonzero byte: zeroes would let the compiler turn allocation and
            // fill into calloc (it does), whose fresh mapping stays unpopulated, and the point
            // is to have every page faulted in (and, under mlockall, locked) up front. `take`
            // zeroes what it hands out.
            let b = vec![POOL_PREFILL_BYTE; pool_class_capacity(class)];
            pool.give(b);
        }
        pool
    }

    /// A zeroed buffer of `len` bytes: a pooled one of its class or larger, else a new one.
    fn take(&self, len: usize) -> Vec<u8> {
        let class = pool_class_of_len(len);
        let found = {
            let mut p = lock(&self.inner);
            let mut found = None;
            for k in class..POOL_CLASSES {
                if let Some(b) = p.classes[k].pop() {
                    p.held_bytes -= b.capacity();
                    found = Some(b);
                    break;
                }
            }
            found
        };
        let mut b = found.unwrap_or_else(|| Vec::with_capacity(pool_class_capacity(class)));
        b.clear();
        b.resize(len, 0);
        b
    }

    /// Returns a buffer for reuse (dropped if the pool is full or the buffer is too small).
    fn give(&self, buf: Vec<u8>) {
        let cap = buf.capacity();
        if cap < pool_class_capacity(0) {
            return;
        }
        // The largest class whose capacity it has.
        let class = (((cap - POOL_HEADROOM_BYTES) / 4096).ilog2() as usize).min(POOL_CLASSES - 1);
        let mut p = lock(&self.inner);
        if p.held_bytes + cap <= POOL_RETAINED_BYTES {
            p.held_bytes += cap;
            p.classes[class].push(buf);
        }
    }
}

/// One request handed to a worker.
struct Job {
    header: RequestHeader,
    action: Action,
    /// The write payload (empty for other commands).
    payload: Vec<u8>,
    /// Bytes charged to the in-flight budget.
    charge: u64,
}

#[derive(Default)]
struct InFlight {
    requests: usize,
    bytes: u64,
}

/// The per-connection state the reader and the workers share.
struct Conn<'a, W> {
    writer: Mutex<W>,
    pool: &'a BufPool,
    device: &'a dyn BlockDevice,
    structured: bool,
    /// Set when a reply could not be sent: the client is gone, stop reading.
    failed: AtomicBool,
    inflight: Mutex<InFlight>,
    inflight_cv: Condvar,
    kill: &'a (dyn Fn() + Sync),
}

impl<W: Write> Conn<'_, W> {
    fn send(&self, buf: &[u8]) {
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        let r = {
            let mut w = lock(&self.writer);
            w.write_all(buf).and_then(|()| w.flush())
        };
        if r.is_err() {
            self.failed.store(true, Ordering::Relaxed);
            (self.kill)();
        }
    }

    /// Sends an error reply: a structured error chunk with a message when negotiated, else a
    /// simple reply.
    fn send_error(&self, cookie: u64, error: u32, message: &str) {
        if self.structured {
            let mut out = Vec::with_capacity(64);
            encode_structured_error(&mut out, cookie, error, message);
            self.send(&out);
        } else {
            self.send(&encode_simple_reply(error, cookie));
        }
    }

    fn send_ok(&self, h: &RequestHeader) {
        if self.structured && h.command == CMD_READ {
            // A read must never get a simple reply once structured replies are on.
            self.send(&encode_structured_header(
                REPLY_FLAG_DONE,
                REPLY_TYPE_NONE,
                h.cookie,
                0,
            ));
        } else {
            self.send(&encode_simple_reply(0, h.cookie));
        }
    }

    /// Waits until `bytes` more fit in the budget (a request always fits when none is in
    /// flight, so a maximum-size request cannot wait forever).
    fn charge(&self, bytes: u64) {
        let mut f = lock(&self.inflight);
        while f.requests > 0
            && (f.requests >= MAX_INFLIGHT_REQUESTS || f.bytes + bytes > MAX_INFLIGHT_BYTES)
        {
            f = self.inflight_cv.wait(f).unwrap_or_else(|p| p.into_inner());
        }
        f.requests += 1;
        f.bytes += bytes;
    }

    fn refund(&self, bytes: u64) {
        let mut f = lock(&self.inflight);
        f.requests -= 1;
        f.bytes -= bytes;
        self.inflight_cv.notify_all();
    }

    fn execute(&self, job: Job) {
        let h = job.header;
        let dev = self.device;
        let fail = |e: &Error, stores: bool| {
            let err = nbd_error_from_errno(e.errno(), stores);
            self.send_error(h.cookie, err, e.message());
        };
        let with_fua =
            |r: Result<()>, fua: bool| r.and_then(|()| if fua { dev.flush() } else { Ok(()) });
        match job.action {
            Action::Read { offset, length } => {
                let prefix = if self.structured {
                    STRUCTURED_REPLY_HEADER_BYTES + 8
                } else {
                    SIMPLE_REPLY_HEADER_BYTES
                };
                let mut buf = self.pool.take(prefix + length as usize);
                match dev.read_at(&mut buf[prefix..], offset) {
                    Ok(()) => {
                        if self.structured {
                            // The whole read is one data chunk, final: every error that can
                            // happen has happened before the first byte is sent.
                            let hdr = encode_structured_header(
                                REPLY_FLAG_DONE,
                                REPLY_TYPE_OFFSET_DATA,
                                h.cookie,
                                8 + length,
                            );
                            buf[..STRUCTURED_REPLY_HEADER_BYTES].copy_from_slice(&hdr);
                            buf[STRUCTURED_REPLY_HEADER_BYTES..prefix]
                                .copy_from_slice(&offset.to_be_bytes());
                        } else {
                            buf[..prefix].copy_from_slice(&encode_simple_reply(0, h.cookie));
                        }
                        self.send(&buf);
                    }
                    Err(e) => fail(&e, false),
                }
                self.pool.give(buf);
            }
            Action::Write { offset, fua, .. } => {
                match with_fua(dev.write_at(&job.payload, offset), fua) {
                    Ok(()) => self.send_ok(&h),
                    Err(e) => fail(&e, true),
                }
                self.pool.give(job.payload);
            }
            Action::Trim {
                offset,
                length,
                fua,
            } => match with_fua(dev.discard(offset, u64::from(length)), fua) {
                Ok(()) => self.send_ok(&h),
                Err(e) => fail(&e, true),
            },
            Action::WriteZeroes {
                offset,
                length,
                fua,
            } => {
                // NO_HOLE and FAST_ZERO need nothing special: see `transmission_flags` and
                // docs/nbd.md (a zero page is a same-filled slot either way).
                match with_fua(dev.write_zeroes(offset, u64::from(length)), fua) {
                    Ok(()) => self.send_ok(&h),
                    Err(e) => fail(&e, true),
                }
            }
            Action::Flush => match dev.flush() {
                Ok(()) => self.send_ok(&h),
                Err(e) => fail(&e, true),
            },
            Action::Noop => self.send_ok(&h),
            Action::Reject { error, .. } => {
                self.send_error(h.cookie, error, nbd_error_name(error));
            }
            Action::Disconnect | Action::HardDisconnect => {}
        }
    }
}

/// Runs the transmission phase on one connection until the client disconnects, breaks the
/// protocol, vanishes, or `stop` is raised; returns after every request read has been
/// answered (or the client is known to be gone). `kill` must make further reads of `reader`
/// fail or end (for a socket: shut it down); it is called when a reply cannot be sent.
///
/// Generic over the byte streams so tests can drive it from memory.
pub fn transmission<R: Read, W: Write + Send>(
    reader: &mut R,
    writer: W,
    device: &dyn BlockDevice,
    neg: &Negotiated,
    workers: usize,
    stop: &AtomicBool,
    kill: &(dyn Fn() + Sync),
) -> io::Result<()> {
    let pool = BufPool::new(0);
    transmission_with_pool(reader, writer, device, neg, workers, stop, kill, &pool)
}

#[allow(clippy::too_many_arguments)]
fn transmission_with_pool<R: Read, W: Write + Send>(
    reader: &mut R,
    writer: W,
    device: &dyn BlockDevice,
    neg: &Negotiated,
    workers: usize,
    stop: &AtomicBool,
    kill: &(dyn Fn() + Sync),
    pool: &BufPool,
) -> io::Result<()> {
    let limits = ExportLimits {
        size_bytes: device.size_bytes(),
        structured: neg.structured,
    };
    let conn = Conn {
        writer: Mutex::new(writer),
        pool,
        device,
        structured: neg.structured,
        failed: AtomicBool::new(false),
        inflight: Mutex::new(InFlight::default()),
        inflight_cv: Condvar::new(),
        kill,
    };
    let (tx, rx) = mpsc::channel::<Job>();
    let rx = Mutex::new(rx);
    std::thread::scope(|s| {
        for _ in 0..workers.max(1) {
            s.spawn(|| loop {
                let job = lock(&rx).recv();
                let Ok(job) = job else { return };
                let charge = job.charge;
                conn.execute(job);
                conn.refund(charge);
            });
        }
        let r = read_requests(reader, &conn, &tx, limits, stop);
        drop(tx);
        r
    })
}

fn read_requests<R: Read, W: Write>(
    reader: &mut R,
    conn: &Conn<'_, W>,
    tx: &mpsc::Sender<Job>,
    limits: ExportLimits,
    stop: &AtomicBool,
) -> io::Result<()> {
    loop {
        if stop.load(Ordering::Relaxed) || conn.failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut hb = [0u8; REQUEST_HEADER_BYTES];
        match read_full_or_eof(reader, &mut hb)? {
            ReadOutcome::Eof => return Ok(()), // The client hung up between requests.
            ReadOutcome::Full => {}
        }
        let Some(header) = RequestHeader::parse(&hb) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad request magic",
            ));
        };
        let action = classify(&header, limits);
        let (payload_len, charge) = match action {
            Action::Disconnect => return Ok(()),
            Action::HardDisconnect => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("write payload of {} bytes refused", header.length),
                ))
            }
            Action::Reject {
                discard_payload, ..
            } => {
                let n = u64::from(discard_payload);
                if io::copy(&mut reader.take(n), &mut io::sink())? != n {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                (0, 0)
            }
            Action::Write { length, .. } => (length as usize, u64::from(length)),
            Action::Read { length, .. } => (0, u64::from(length)),
            _ => (0, 0),
        };
        conn.charge(charge);
        let mut payload = Vec::new();
        if payload_len > 0 {
            payload = conn.pool.take(payload_len);
            if let Err(e) = reader.read_exact(&mut payload) {
                // The client vanished mid-request: nothing of it was written or acknowledged.
                conn.refund(charge);
                conn.pool.give(payload);
                return Err(e);
            }
        }
        let job = Job {
            header,
            action,
            payload,
            charge,
        };
        if lock(&conn.inflight).requests == 1 {
            // Nothing else in flight (a client at queue depth 1, or the first of a burst):
            // answer it from this thread. Handing it to a worker would add a thread wake-up
            // (tens of µs on an idle VM CPU) to a round trip whose whole point is latency;
            // with requests already in flight the workers take them, so a pipelining client
            // waits at most one request's service time for the reader.
            conn.execute(job);
            conn.refund(charge);
            continue;
        }
        if let Err(mpsc::SendError(job)) = tx.send(job) {
            // No worker left (cannot happen while `tx` lives, but never lose the request).
            conn.execute(job);
            conn.refund(charge);
        }
    }
}

enum ReadOutcome {
    Full,
    Eof,
}

/// Reads exactly `buf.len()` bytes; a clean end of stream before the first byte is `Eof`, in
/// the middle an error.
fn read_full_or_eof<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<ReadOutcome> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(ReadOutcome::Eof),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(ReadOutcome::Full)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_pool_recycles_by_class_and_stays_bounded() {
        assert_eq!(pool_class_of_len(1), 0);
        assert_eq!(pool_class_of_len(4096 + POOL_HEADROOM_BYTES), 0);
        assert_eq!(pool_class_of_len(4097 + POOL_HEADROOM_BYTES), 1);
        assert_eq!(pool_class_of_len(MAX_PAYLOAD_BYTES as usize + 32), 13);
        let pool = BufPool::new(2);
        let held = |p: &BufPool| lock(&p.inner).held_bytes;
        assert_eq!(held(&pool), 2 * pool_class_capacity(5));
        // A small request takes a preallocated buffer when its own class is empty.
        let mut b = pool.take(4096);
        assert_eq!(b.len(), 4096);
        assert!(b.iter().all(|&x| x == 0));
        b[0] = 7;
        let ptr = b.as_ptr();
        pool.give(b);
        let b = pool.take(100);
        assert_eq!(b.as_ptr(), ptr, "the same buffer, reused");
        assert_eq!(b[0], 0, "and zeroed again");
        pool.give(b);
        // A burst is given back down to what the pool retains: a maximum-size buffer is
        // never kept, and of 64 buffers of 128 KiB only as many as fit in the retained bytes.
        let big: Vec<_> = (0..5)
            .map(|_| pool.take(MAX_PAYLOAD_BYTES as usize))
            .collect();
        for b in big {
            pool.give(b);
        }
        assert_eq!(held(&pool), 2 * pool_class_capacity(5));
        let burst: Vec<_> = (0..64).map(|_| pool.take(128 << 10)).collect();
        for b in burst {
            pool.give(b);
        }
        let kept = POOL_RETAINED_BYTES / pool_class_capacity(5);
        assert_eq!(held(&pool), kept * pool_class_capacity(5));
        assert_eq!(lock(&pool.inner).classes[5].len(), kept);
    }
}
