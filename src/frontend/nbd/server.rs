//! The server's life: start, the state its threads share, and a bounded stop.
//!
//! # Threads
//! - One accept thread per listener ([`listener`](super::listener)), waiting on its socket and
//!   the server's quit fd.
//! - One thread per connection ([`connection`](super::connection)): the handshake, then the
//!   transmission phase ([`transmission`](super::transmission)) with a small worker pool.
//!
//! # Limits
//! Everything a client can make the server hold is bounded by [`Limits`] (shared with every
//! frontend; see [`crate::frontend::limits`]): connections, request memory (one server-wide
//! [`MemoryBudget`]), and the handshake, request and reply deadlines.
//!
//! # Stopping ([`Server::stop`])
//! 1. The quit fd is raised: accept loops and handshakes end at once.
//! 2. Every connection's read side is shut: clients can send nothing more; requests already
//!    read are executed and answered.
//! 3. After `Limits::stop_grace`, connections still open (a client not taking its replies) are
//!    shut down in both directions, so their blocked replies fail at once.
//! 4. The unix socket files are removed (each only if it is still the one bound).
//!
//! A stop is therefore bounded by the grace plus the longest single device call, whether or
//! not the socket files still exist and whatever the clients do.
//!
//! # Lock order
//! `Shared::conns` is never held while taking a connection's locks or `active`.

use super::listener::{bind, spawn_accept, Bound};
use super::tls::Tls;
use super::{Export, Listen};
use crate::error::{Error, Result};
use crate::frontend::limits::{
    ConnectionCap, Limits, MemoryBudget, QuitFd, SWAP_PREALLOCATED_BYTES,
};
use crate::frontend::unix_socket::{remove_if_ours, SocketId};
use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::protocol::MAX_STRING_BYTES;
use super::wire::Wire;

/// After the grace and the final shutdown, how long a stop waits for connection threads still
/// inside a device call before it returns without them (the process is ending anyway).
const STOP_STRAGGLERS: Duration = Duration::from_secs(5);

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Worker threads per connection. Requests are CPU-bound (compression), so more workers
    /// than cores gains little; two at least let one request's reply go out while the next
    /// compresses.
    pub workers_per_connection: usize,
    /// Print connection errors (protocol violations, I/O errors, refused connections).
    pub log_errors: bool,
    /// Connection cap, request memory budget, deadlines ([`Limits`]).
    pub limits: Limits,
    /// TLS for TCP listeners (`None`: off).
    pub tls: Option<Tls>,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        ServerConfig {
            workers_per_connection: cores.clamp(2, 8),
            log_errors: true,
            limits: Limits::default(),
            tls: None,
        }
    }
}

impl ServerConfig {
    /// For serving swap: request buffers preallocated ([`SWAP_PREALLOCATED_BYTES`], kept for
    /// good), so the request path takes no fresh memory in the steady state.
    pub fn for_swap(mut self) -> ServerConfig {
        self.limits.preallocated_bytes = SWAP_PREALLOCATED_BYTES;
        self
    }
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

    pub(crate) fn open(&self) -> OpenGuard<'_> {
        *lock(&self.count) += 1;
        OpenGuard(self)
    }
}

/// One connection's hold on an export; released when dropped.
pub(crate) struct OpenGuard<'a>(&'a Openers);

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        *lock(&self.0.count) -= 1;
    }
}

/// State shared by the accept threads and connections.
pub(crate) struct Shared {
    pub(crate) exports: Vec<Export>,
    /// One per export, same order.
    pub(crate) openers: Vec<Arc<Openers>>,
    pub(crate) config: ServerConfig,
    /// Raised once by [`Server::stop`]; accept loops and handshakes wait on it.
    pub(crate) quit: QuitFd,
    /// Raised with `quit`; read between requests.
    pub(crate) stopping: AtomicBool,
    pub(crate) cap: ConnectionCap,
    pub(crate) budget: MemoryBudget,
    /// Live connections, for shutting them down on stop. The stop flag is raised under this
    /// mutex so that no connection registers after the sweep.
    pub(crate) conns: Mutex<HashMap<u64, Arc<Wire>>>,
    pub(crate) next_conn: AtomicU64,
    /// Number of connection threads alive; stop waits for it to reach 0.
    pub(crate) active: Mutex<usize>,
    pub(crate) active_cv: Condvar,
}

impl Shared {
    /// Called by a connection thread as it ends.
    pub(crate) fn connection_ended(&self) {
        let mut active = lock(&self.active);
        *active -= 1;
        let none_left = *active == 0;
        self.active_cv.notify_all();
        drop(active);
        // A client gone: the buffers it gave back would otherwise wait for another
        // connection's idle timer, and one idle for long waits without one. Connections end
        // rarely, so releasing every recycled buffer now costs the others little.
        self.budget.release_idle(true);
        if none_left {
            release_heap();
        }
    }

    /// Waits until no connection thread is alive or `until`; true if none is.
    fn wait_connections(&self, until: Instant) -> bool {
        let mut active = lock(&self.active);
        while *active > 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            active = self
                .active_cv
                .wait_timeout(active, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
}

/// A running NBD server. Dropping it stops it (as [`Server::stop`]).
pub struct Server {
    shared: Arc<Shared>,
    accept_threads: Vec<JoinHandle<()>>,
    /// Where each listener is, for the URIs.
    endpoints: Vec<Endpoint>,
    /// The unix socket files to remove on stop, with what they were when bound.
    socket_files: Vec<(PathBuf, SocketId)>,
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
                return Err(Error::invalid(format!("export {:?} twice", e.name)));
            }
        }
        config.limits.validate()?;
        let limits = &config.limits;
        let budget = MemoryBudget::new(
            limits.max_inflight_bytes,
            limits.preallocated_bytes,
            128 << 10,
            limits.idle_release,
        )
        .map_err(Error::from)?;
        let mut bound = Vec::new();
        let mut endpoints = Vec::new();
        let mut socket_files: Vec<(PathBuf, SocketId)> = Vec::new();
        for l in listen {
            let default_export = match l {
                Listen::Unix { export, .. } => Some(
                    exports
                        .iter()
                        .position(|e| &e.name == export)
                        .ok_or_else(|| Error::invalid(format!("no export named {export:?}")))?,
                ),
                Listen::Tcp(_) => Some(0),
            };
            let (b, ep) = match bind(l) {
                Ok(x) => x,
                Err(e) => {
                    for (p, id) in &socket_files {
                        remove_if_ours(p, *id);
                    }
                    return Err(e);
                }
            };
            if let (Bound::Unix(_, id), Endpoint::Unix { path, .. }) = (&b, &ep) {
                socket_files.push((path.clone(), *id));
            }
            bound.push((b, default_export));
            endpoints.push(ep);
        }
        let shared = Arc::new(Shared {
            openers: exports.iter().map(|_| Arc::default()).collect(),
            exports,
            cap: ConnectionCap::new(config.limits.max_connections, "uzram nbd"),
            config,
            quit: QuitFd::new().map_err(Error::from)?,
            stopping: AtomicBool::new(false),
            budget,
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            active: Mutex::new(0),
            active_cv: Condvar::new(),
        });
        let mut server = Server {
            shared: Arc::clone(&shared),
            accept_threads: Vec::new(),
            endpoints,
            socket_files,
            stopped: false,
        };
        for (b, default_export) in bound {
            let t = spawn_accept(&shared, b, default_export)?;
            server.accept_threads.push(t);
        }
        Ok(server)
    }

    /// The openers of export `name` (for the control socket's `reset`).
    pub fn openers(&self, name: &str) -> Option<Arc<Openers>> {
        let i = self.shared.exports.iter().position(|e| e.name == name)?;
        Some(Arc::clone(&self.shared.openers[i]))
    }

    /// Where the server listens.
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// The unix socket files and what they were when bound (for removing them on a forced
    /// exit with [`remove_if_ours`]).
    pub fn socket_files(&self) -> Vec<(PathBuf, SocketId)> {
        self.socket_files.clone()
    }

    /// The server's request memory budget (for statistics and tests).
    pub fn budget(&self) -> &MemoryBudget {
        &self.shared.budget
    }

    /// Connections being served now.
    pub fn connections(&self) -> usize {
        self.shared.cap.live()
    }

    /// The NBD URI of every export on every listener (`nbd+unix:///NAME?socket=PATH`,
    /// `nbd://HOST:PORT/NAME`, `nbds://` when TLS is required), each with its export name.
    pub fn uris(&self) -> Vec<(String, String)> {
        let scheme = match &self.shared.config.tls {
            Some(t) if t.mode == super::tls::TlsMode::Require => "nbds",
            _ => "nbd",
        };
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
                        v.push((e.name.clone(), format!("{scheme}://{addr}/{}", e.name)));
                    }
                }
            }
        }
        v
    }

    /// Stops, bounded (see the module documentation). Returns when every connection thread
    /// has ended, or when the stragglers' time is up.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let shared = &self.shared;
        {
            let conns = lock(&shared.conns);
            shared.stopping.store(true, Ordering::SeqCst);
            shared.quit.raise();
            for w in conns.values() {
                w.socket().shutdown(Shutdown::Read);
            }
        }
        for t in self.accept_threads.drain(..) {
            let _ = t.join();
        }
        let grace_end = Instant::now() + shared.config.limits.stop_grace;
        if !shared.wait_connections(grace_end) {
            for w in lock(&shared.conns).values() {
                w.socket().shutdown(Shutdown::Both);
            }
            if !shared.wait_connections(Instant::now() + STOP_STRAGGLERS)
                && shared.config.log_errors
            {
                eprintln!("uzram nbd: stopping without connections still inside a device call");
            }
        }
        for (path, id) in &self.socket_files {
            remove_if_ours(path, *id);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// Returns the C heap's free memory to the kernel. The connection threads' small allocations
/// (handshake buffers, queues) spread over glibc's per-thread arenas, which keep freed memory
/// unless asked; once the last connection is gone nothing will reuse it soon.
fn release_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it takes its own locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Locks a mutex, ignoring poisoning: the data behind these mutexes (sockets, counters) stays
/// consistent even if a thread panicked while holding one.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
