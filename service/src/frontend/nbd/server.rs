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
use uzram::error::{Error, ErrorKind, Result};

use super::wire::Wire;
use uzram_nbd_proto::MAX_STRING_BYTES;

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
/// and `hot_remove` are `EBUSY` while the disk has openers; the control socket runs `reset`
/// under [`Openers::while_unused`], and [`Server::remove_export`] marks the export removed
/// under the same lock, after which no connection can open it).
#[derive(Debug, Default)]
pub struct Openers {
    state: Mutex<OpenState>,
}

/// Protected by `Openers::state`.
#[derive(Debug, Default)]
struct OpenState {
    /// Connections in transmission on the export.
    count: usize,
    /// The export was removed: no connection may open it any more.
    removed: bool,
}

impl Openers {
    /// Connections in transmission on the export now.
    pub fn count(&self) -> usize {
        lock(&self.state).count
    }

    /// Runs `f` with no connection in transmission and none able to start until it returns;
    /// `Err(n)` with the number of openers instead if there are any.
    pub fn while_unused<R>(&self, f: impl FnOnce() -> R) -> std::result::Result<R, usize> {
        let g = lock(&self.state);
        if g.count > 0 {
            return Err(g.count);
        }
        let r = f();
        drop(g);
        Ok(r)
    }

    /// Marks the export removed if no connection has it open (`Err(n)` with the openers
    /// otherwise); from then on [`open`](Self::open) fails.
    fn remove_if_unused(&self) -> std::result::Result<(), usize> {
        let mut g = lock(&self.state);
        if g.count > 0 {
            return Err(g.count);
        }
        g.removed = true;
        Ok(())
    }

    /// A connection's hold on the export; `None` once the export is removed.
    pub(crate) fn open(&self) -> Option<OpenGuard<'_>> {
        let mut g = lock(&self.state);
        if g.removed {
            return None;
        }
        g.count += 1;
        Some(OpenGuard(self))
    }
}

/// One connection's hold on an export; released when dropped.
pub(crate) struct OpenGuard<'a>(&'a Openers);

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        lock(&self.0.state).count -= 1;
    }
}

/// An export and who has it open.
#[derive(Clone)]
pub(crate) struct ExportEntry {
    pub(crate) export: Export,
    pub(crate) openers: Arc<Openers>,
}

/// State shared by the accept threads and connections.
pub(crate) struct Shared {
    /// The exports, in the order they were added ([`Server::add_export`] and
    /// [`Server::remove_export`] change it while the server runs). A connection takes a copy
    /// for its handshake and then holds its export's [`Openers`], not this lock.
    pub(crate) exports: Mutex<Vec<ExportEntry>>,
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
    /// Every listener; exports added while running bring their own unix listener. Never held
    /// while joining an accept thread of a listener still in the list.
    listeners: Mutex<Vec<Listener>>,
    stopped: AtomicBool,
}

/// One listener and its accept thread.
struct Listener {
    /// Where it is, for the URIs.
    endpoint: Endpoint,
    /// A unix socket file to remove on stop, with what it was when bound.
    socket_file: Option<(PathBuf, SocketId)>,
    /// Ends this accept loop alone (an export removed); a stop raises every listener's.
    quit: Arc<QuitFd>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    /// Ends the accept loop and removes the socket file if it is still ours.
    fn stop(&mut self) {
        self.quit.raise();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some((path, id)) = &self.socket_file {
            remove_if_ours(path, *id);
        }
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("endpoints", &self.endpoints())
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
    /// Serves one export on the unix socket `path`, with the default limits and without
    /// logging what clients do wrong: the server of a benchmark or a test.
    pub fn start_unix(export: Export, path: PathBuf) -> Result<Server> {
        let name = export.name.clone();
        let config = ServerConfig {
            log_errors: false,
            ..ServerConfig::default()
        };
        Server::start(vec![export], &[Listen::Unix { path, export: name }], config)
    }

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
                Listen::Unix { export, .. } => {
                    if !exports.iter().any(|e| &e.name == export) {
                        return Err(Error::invalid(format!("no export named {export:?}")));
                    }
                    Some(export.clone())
                }
                Listen::Tcp(_) => None,
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
            exports: Mutex::new(
                exports
                    .into_iter()
                    .map(|export| ExportEntry {
                        export,
                        openers: Arc::default(),
                    })
                    .collect(),
            ),
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
        let server = Server {
            shared: Arc::clone(&shared),
            listeners: Mutex::new(Vec::new()),
            stopped: AtomicBool::new(false),
        };
        for ((b, default_export), endpoint) in bound.into_iter().zip(endpoints) {
            let socket_file = match (&b, &endpoint) {
                (Bound::Unix(_, id), Endpoint::Unix { path, .. }) => Some((path.clone(), *id)),
                _ => None,
            };
            let quit = Arc::new(QuitFd::new().map_err(Error::from)?);
            // Dropping `server` on an error stops the listeners started so far.
            let mut listener = Listener {
                endpoint,
                socket_file,
                quit: Arc::clone(&quit),
                thread: None,
            };
            match spawn_accept(&shared, b, quit, default_export) {
                Ok(t) => listener.thread = Some(t),
                Err(e) => {
                    listener.stop();
                    return Err(e);
                }
            }
            lock(&server.listeners).push(listener);
        }
        Ok(server)
    }

    /// Adds an export while the server runs (zram's `hot_add`), reachable by name on every
    /// TCP listener and, with `unix`, on a unix socket of its own (whose empty export name
    /// means it). `EEXIST`-like `EINVAL` if the name is taken or bad.
    pub fn add_export(&self, export: Export, unix: Option<PathBuf>) -> Result<()> {
        if export.name.is_empty()
            || export.name.len() > MAX_STRING_BYTES
            || export.name.contains('\0')
        {
            return Err(Error::invalid(format!("bad export name {:?}", export.name)));
        }
        let name = export.name.clone();
        let mut listener = None;
        if let Some(path) = unix {
            let l = Listen::Unix {
                path,
                export: name.clone(),
            };
            let (b, endpoint) = bind(&l)?;
            let socket_file = match (&b, &endpoint) {
                (Bound::Unix(_, id), Endpoint::Unix { path, .. }) => Some((path.clone(), *id)),
                _ => None,
            };
            let quit = Arc::new(QuitFd::new().map_err(Error::from)?);
            listener = Some((
                b,
                Listener {
                    endpoint,
                    socket_file,
                    quit,
                    thread: None,
                },
            ));
        }
        {
            let mut exports = lock(&self.shared.exports);
            if exports.iter().any(|e| e.export.name == name) {
                drop(exports);
                if let Some((_, mut l)) = listener {
                    l.stop();
                }
                return Err(Error::invalid(format!("export {name:?} exists")));
            }
            exports.push(ExportEntry {
                export,
                openers: Arc::default(),
            });
        }
        if let Some((b, mut l)) = listener {
            match spawn_accept(&self.shared, b, Arc::clone(&l.quit), Some(name.clone())) {
                Ok(t) => l.thread = Some(t),
                Err(e) => {
                    l.stop();
                    lock(&self.shared.exports).retain(|e| e.export.name != name);
                    return Err(e);
                }
            }
            let mut listeners = lock(&self.listeners);
            if self.shared.stopping.load(Ordering::SeqCst) {
                drop(listeners);
                l.stop();
                return Err(Error::io("the server is stopping"));
            }
            listeners.push(l);
        }
        Ok(())
    }

    /// Removes export `name` (zram's `hot_remove`): `EBUSY` while a connection has it open
    /// (as zram refuses while its disk is open), `ENODEV` if there is none. Connections in the
    /// handshake that chose it fail; its own unix listeners stop and their sockets go.
    pub fn remove_export(&self, name: &str) -> Result<()> {
        let openers = self
            .openers(name)
            .ok_or_else(|| Error::new(ErrorKind::NoDevice, format!("no export named {name:?}")))?;
        openers
            .remove_if_unused()
            .map_err(|n| Error::busy(format!("{name} is open by {n} NBD connection(s)")))?;
        lock(&self.shared.exports).retain(|e| !Arc::ptr_eq(&e.openers, &openers));
        let mine: Vec<Listener> = {
            let mut listeners = lock(&self.listeners);
            let (mine, rest) = listeners.drain(..).partition(|l: &Listener| {
                matches!(&l.endpoint, Endpoint::Unix { default_export, .. } if default_export == name)
            });
            *listeners = rest;
            mine
        };
        for mut l in mine {
            l.stop();
        }
        Ok(())
    }

    /// The openers of export `name` (for the control socket's `reset`).
    pub fn openers(&self, name: &str) -> Option<Arc<Openers>> {
        lock(&self.shared.exports)
            .iter()
            .find(|e| e.export.name == name)
            .map(|e| Arc::clone(&e.openers))
    }

    /// Where the server listens.
    pub fn endpoints(&self) -> Vec<Endpoint> {
        lock(&self.listeners)
            .iter()
            .map(|l| l.endpoint.clone())
            .collect()
    }

    /// The unix socket files and what they were when bound (for removing them on a forced
    /// exit with [`remove_if_ours`]).
    pub fn socket_files(&self) -> Vec<(PathBuf, SocketId)> {
        lock(&self.listeners)
            .iter()
            .filter_map(|l| l.socket_file.clone())
            .collect()
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
        let names: Vec<String> = lock(&self.shared.exports)
            .iter()
            .map(|e| e.export.name.clone())
            .collect();
        let mut v = Vec::new();
        for ep in &self.endpoints() {
            match ep {
                Endpoint::Unix {
                    path,
                    default_export,
                } => v.push((
                    default_export.clone(),
                    format!("nbd+unix:///{default_export}?socket={}", path.display()),
                )),
                Endpoint::Tcp(addr) => {
                    for n in &names {
                        v.push((n.clone(), format!("{scheme}://{addr}/{n}")));
                    }
                }
            }
        }
        v
    }

    /// Stops, bounded (see the module documentation). Returns when every connection thread
    /// has ended, or when the stragglers' time is up.
    pub fn stop(self) {
        self.shutdown();
    }

    /// As [`stop`](Self::stop), for a server shared with the threads that add and remove
    /// exports (those fail from then on). Later calls do nothing.
    pub fn shutdown(&self) {
        if self.stopped.swap(true, Ordering::SeqCst) {
            return;
        }
        let shared = &self.shared;
        {
            let conns = lock(&shared.conns);
            shared.stopping.store(true, Ordering::SeqCst);
            shared.quit.raise();
            for w in conns.values() {
                w.socket().shutdown(Shutdown::Read);
            }
        }
        // add_export sees `stopping` under the listeners' lock and adds none after this. The
        // listeners stay listed (with their socket files, for a forced exit meanwhile) until
        // their files are removed below; the lock is not held while joining.
        let threads: Vec<JoinHandle<()>> = {
            let mut listeners = lock(&self.listeners);
            for l in listeners.iter() {
                l.quit.raise();
            }
            listeners
                .iter_mut()
                .filter_map(|l| l.thread.take())
                .collect()
        };
        for t in threads {
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
        let mut listeners: Vec<Listener> = lock(&self.listeners).drain(..).collect();
        for l in &mut listeners {
            l.stop();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
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
