//! Listeners: binding the sockets and the accept threads that start connections.
//!
//! One accept thread per listener runs [`accept_loop`]: it waits on the listener and the
//! server's quit fd, takes a connection slot (past `Limits::max_connections` the connection is
//! closed at once, with a log line), registers the connection with the server (so a stop can
//! shut it down) and starts its thread.

use super::connection::serve_connection;
use super::server::{lock, Endpoint, Shared};
use super::wire::{Socket, Wire};
use super::Listen;
use crate::frontend::limits::{accept_loop, set_nonblocking, ConnectionSlot, QuitFd};
use crate::frontend::unix_socket::{bind_unix, SocketId};
use std::io;
use std::net::{Shutdown, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use uzram::error::{Error, Result};

/// A bound listener.
#[derive(Debug)]
pub(crate) enum Bound {
    Unix(UnixListener, SocketId),
    Tcp(TcpListener),
}

/// Binds one listener (non-blocking); returns it and its endpoint.
pub(crate) fn bind(l: &Listen) -> Result<(Bound, Endpoint)> {
    let (bound, endpoint) = match l {
        Listen::Unix { path, export } => {
            let (listener, id) = bind_unix(path)?;
            (
                Bound::Unix(listener, id),
                Endpoint::Unix {
                    path: path.clone(),
                    default_export: export.clone(),
                },
            )
        }
        Listen::Tcp(addr) => {
            let listener = TcpListener::bind(addr).map_err(|e| {
                let e = Error::from(e);
                Error::new(
                    e.kind(),
                    format!("cannot listen on {addr}: {}", e.message()),
                )
            })?;
            let actual = listener.local_addr().map_err(Error::from)?;
            (Bound::Tcp(listener), Endpoint::Tcp(actual))
        }
    };
    let fd = match &bound {
        Bound::Unix(l, _) => l.as_raw_fd(),
        Bound::Tcp(l) => l.as_raw_fd(),
    };
    set_nonblocking(fd).map_err(Error::from)?;
    Ok((bound, endpoint))
}

/// Starts the accept thread of one listener; it ends when `quit` is raised. The empty export
/// name means `default_export` (`None`: the first export).
pub(crate) fn spawn_accept(
    shared: &Arc<Shared>,
    bound: Bound,
    quit: Arc<QuitFd>,
    default_export: Option<String>,
) -> Result<JoinHandle<()>> {
    let shared = Arc::clone(shared);
    std::thread::Builder::new()
        .name("nbd-accept".into())
        .spawn(move || {
            let log = shared.config.log_errors.then_some("uzram nbd");
            let start = |socket: Socket, slot: ConnectionSlot| {
                start_connection(&shared, socket, slot, default_export.clone())
            };
            match &bound {
                Bound::Unix(l, _) => accept_loop(l, &quit, &shared.cap, log, |s, slot| {
                    start(Socket::Unix(s), slot)
                }),
                Bound::Tcp(l) => accept_loop(l, &quit, &shared.cap, log, |s, slot| {
                    // NBD asks both ends to disable Nagle: replies are small and latency-bound.
                    let _ = s.set_nodelay(true);
                    start(Socket::Tcp(s), slot)
                }),
            }
        })
        .map_err(Error::from)
}

fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
    )
}

/// Registers an accepted connection and starts its thread; the slot is held until the thread
/// ends.
fn start_connection(
    shared: &Arc<Shared>,
    socket: Socket,
    slot: ConnectionSlot,
    default_export: Option<String>,
) {
    let wire = match Wire::new(socket) {
        Ok(w) => Arc::new(w),
        Err(_) => return,
    };
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    {
        let mut conns = lock(&shared.conns);
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        conns.insert(id, Arc::clone(&wire));
    }
    *lock(&shared.active) += 1;
    let shared2 = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name(format!("nbd-conn-{id}"))
        .spawn(move || {
            let _slot = slot;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                serve_connection(&shared2, &wire, default_export.as_deref())
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
            wire.socket().shutdown(Shutdown::Both);
            lock(&shared2.conns).remove(&id);
            shared2.connection_ended();
        });
    if spawned.is_err() {
        lock(&shared.conns).remove(&id);
        shared.connection_ended();
    }
}
