//! The control socket: a running device's attributes (zram's `/sys/block/zramN/` files) over a
//! unix socket, for `uzram ctl` and `uzram status`.
//!
//! One socket per device, `NAME.ctl` next to its export socket (`/run/uzram/zram0.ctl` as
//! root), created like the export sockets with mode 0600. The protocol is JSON lines, one
//! request after another on a connection, each answered in order:
//!
//! ```text
//! → {"op":"show","attr":"mm_stat"}
//! ← {"ok":"    4096      61 ...\n"}
//! → {"op":"store","attr":"compact","value":"1"}
//! ← {"progress":"compact: started"}
//! ← {"progress":"compact: 12 pages freed so far, mem_used_total 1048576"}
//! ← {"ok":""}
//! → {"op":"store","attr":"disksize","value":"1G"}
//! ← {"error":{"errno":16,"name":"EBUSY","message":"device already initialised: reset it first"}}
//! ```
//!
//! A `show` answers the attribute's text exactly as zram's file reads; a `store` takes the value
//! as `echo VALUE >` would write it. Long operations ([`LONG_OPERATIONS`]) first send a
//! `progress` line at once, then one per [`PROGRESS_INTERVAL`] until the final `ok` or `error`;
//! a client that goes away does not stop the operation (nor does a shell's Ctrl-C stop a sysfs
//! write). Every `error` carries the errno the sysfs write would have failed with.
//!
//! A client that can draw a determinate bar asks for counts (`"counts":true` in the store);
//! it then gets `count` lines instead of `progress` lines, one per [`COUNT_INTERVAL`]: how much
//! of the operation's work is done, of what total, in what unit (see
//! [`uzram::device::progress`] for what each operation counts), and the same text:
//!
//! ```text
//! → {"op":"store","attr":"writeback","value":"idle","counts":true}
//! ← {"count":{"done":0,"total":0,"unit":"pages","message":"writeback: started"}}
//! ← {"count":{"done":5120,"total":65536,"unit":"pages","message":"writeback: bd_writes ..."}}
//! ← {"count":{"done":65536,"total":65536,"unit":"pages","message":"writeback: bd_writes ..."}}
//! ← {"ok":""}
//! ```
//!
//! Old clients are unaffected: without `counts` the lines are exactly as before, and an old
//! server ignores the key (a new client then shows the text lines as they come). The counts
//! are two atomics per operation ([`OpProgress`]): nothing grows with the operation.
//!
//! `reset` is refused with `EBUSY` while an NBD client has the device open, as zram refuses it
//! while the disk is open; the check and the reset happen under the export's [`Openers`] lock,
//! so no client can connect in between.
//!
//! Limits (the contract of [`crate::frontend::limits`]): at most [`MAX_CONNECTIONS`] at once
//! (more are closed at accept); each request line must arrive whole within [`REQUEST_DEADLINE`]
//! of the connection starting to wait for it, and each answer line must be taken within the
//! same; the accept loop waits on a quit fd, so a stop never depends on the socket's path.

use super::limits::{accept_loop, set_nonblocking, ConnectionCap, QuitFd};
use super::nbd::Openers;
use super::unix_socket::{bind_unix, remove_if_ours, SocketId};
use crate::policy::DevicePolicy;
use serde::{Deserialize, Serialize};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use uzram::device::attrs::kstrtou64;
use uzram::device::{Device, OpProgress, ProgressUnit};
use uzram::error::{errno_name, Error, ErrorKind, Result};
use uzram::units::kstrtoint;

/// Attributes whose store may take long: they report progress.
pub const LONG_OPERATIONS: &[&str] = &["compact", "writeback", "recompress", "gc"];

/// How often a long operation reports progress: often enough that a person sees it move,
/// rarely enough that the log of a long writeback stays readable.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);

/// How often a long operation reports its counts to a client that asked for them: a bar
/// redrawn five times a second moves smoothly, and a line of about 150 bytes that often costs
/// nothing.
pub const COUNT_INTERVAL: Duration = Duration::from_millis(200);

/// The longest request line accepted: attribute values are short (the longest, a writeback
/// `page_indexes=` list or `algorithm_params`, is far below this).
pub const MAX_REQUEST_BYTES: u64 = 64 << 10;

/// Control connections served at once: `uzram ctl` and `uzram status` open one each and close
/// it after a request or two; 16 leaves room for scripts running in parallel.
pub const MAX_CONNECTIONS: usize = 16;

/// How long a control client has to send a whole request line (from when the server starts
/// waiting for it), and to take each answer line. `uzram ctl` sends its request at once.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);

/// A request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    /// `cat ATTR`.
    Show {
        /// The attribute.
        attr: String,
    },
    /// `echo VALUE > ATTR`.
    Store {
        /// The attribute.
        attr: String,
        /// The value.
        value: String,
        /// The client takes `count` lines (done of total) for a long operation instead of
        /// `progress` lines. Left out (false) by old clients; ignored by old servers.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        counts: bool,
    },
}

/// How far a long operation has got, for a client that asked for counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressCount {
    /// Work done so far (at most `total`).
    pub done: u64,
    /// The operation's work, once it has counted it; 0 until then, or when there is none.
    pub total: u64,
    /// What `done` and `total` count (`pages`, `zones`: [`ProgressUnit::name`]).
    pub unit: String,
    /// The same text a `progress` line carries.
    pub message: String,
}

/// An error as it travels: the errno and a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    /// The errno the sysfs access would have failed with.
    pub errno: i32,
    /// Its symbolic name (`EBUSY`).
    pub name: String,
    /// What happened, for people.
    pub message: String,
}

/// One line of an answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Response {
    /// A long operation is under way.
    Progress(String),
    /// A long operation is under way: how far it has got (only to a client that asked with
    /// `counts`).
    Count(ProgressCount),
    /// Done: the attribute's text for `show`, empty for `store`.
    Ok(String),
    /// Failed.
    Error(WireError),
}

impl From<&Error> for WireError {
    fn from(e: &Error) -> WireError {
        WireError {
            errno: e.errno(),
            name: errno_name(e.errno()).to_string(),
            message: e.message().to_string(),
        }
    }
}

/// A running control socket for one device. Dropping it stops it.
pub struct ControlServer {
    path: PathBuf,
    id: SocketId,
    quit: Arc<QuitFd>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl ControlServer {
    /// Binds `path` (mode 0600; a stale socket is replaced, a live one is `EBUSY`) and serves
    /// `device`'s attributes. `openers` guards `reset` (see the module documentation).
    pub fn start(
        path: &Path,
        device: Arc<Device>,
        openers: Option<Arc<Openers>>,
    ) -> Result<ControlServer> {
        Self::start_with_block_dev(path, device, openers, None)
    }

    /// As [`start`](Self::start), for a device that is also the kernel block device
    /// `block_dev` (`/dev/ublkbN`): `show block_dev` answers its path (for `uzram status`),
    /// and `reset` is `EBUSY` while the block device is open exclusively (mounted, swapped
    /// on, or held by another exclusive opener), as zram refuses it while the disk is open.
    pub fn start_with_block_dev(
        path: &Path,
        device: Arc<Device>,
        openers: Option<Arc<Openers>>,
        block_dev: Option<PathBuf>,
    ) -> Result<ControlServer> {
        Self::start_with_policy(path, device, openers, block_dev, None)
    }

    /// As [`start_with_block_dev`](Self::start_with_block_dev), also serving the device's
    /// policies (`policy`, `policy_stat`: see [`crate::policy`]).
    pub fn start_with_policy(
        path: &Path,
        device: Arc<Device>,
        openers: Option<Arc<Openers>>,
        block_dev: Option<PathBuf>,
        policy: Option<Arc<DevicePolicy>>,
    ) -> Result<ControlServer> {
        let attachments = block_dev.map(|p| Arc::new(FixedBlockDev(p)) as Arc<dyn Attachments>);
        Self::start_with_attachments(path, device, openers, attachments, policy)
    }

    /// As [`start_with_policy`](Self::start_with_policy), with the device's [`Attachments`]
    /// (its block device, which may appear only once `disksize` is set).
    pub fn start_with_attachments(
        path: &Path,
        device: Arc<Device>,
        openers: Option<Arc<Openers>>,
        attachments: Option<Arc<dyn Attachments>>,
        policy: Option<Arc<DevicePolicy>>,
    ) -> Result<ControlServer> {
        let handler: Arc<Handler> =
            Arc::new(move |req: Request, progress: &mut dyn FnMut(Response)| {
                let frontends = Frontends {
                    openers: openers.as_deref(),
                    attachments: attachments.as_deref(),
                    policy: policy.as_deref(),
                };
                handle_device(&device, &frontends, req, progress)
            });
        Self::start_handler(path, handler)
    }

    /// Binds `path` as zram's `/sys/class/zram-control/`: `show hot_add` adds a device and
    /// answers its id, `store hot_remove ID` removes one, through `hotplug`.
    pub fn start_class(path: &Path, hotplug: Arc<dyn HotPlug>) -> Result<ControlServer> {
        let handler: Arc<Handler> =
            Arc::new(move |req: Request, _: &mut dyn FnMut(Response)| handle_class(&*hotplug, req));
        Self::start_handler(path, handler)
    }

    /// Binds `path` (as [`start`](Self::start)) and answers each request with `handler` (no
    /// progress lines): a socket of the server's own beyond the devices' and the class's
    /// (the keeper's `upgrade`).
    pub fn start_fn(
        path: &Path,
        handler: Arc<dyn Fn(Request) -> Result<String> + Send + Sync>,
    ) -> Result<ControlServer> {
        let handler: Arc<Handler> =
            Arc::new(move |req: Request, _: &mut dyn FnMut(Response)| handler(req));
        Self::start_handler(path, handler)
    }

    /// Binds `path` (mode 0600; a stale socket is replaced, a live one is `EBUSY`) and answers
    /// each request with `handler`.
    fn start_handler(path: &Path, handler: Arc<Handler>) -> Result<ControlServer> {
        let (listener, id) = bind_unix(path)?;
        let fail = |e: io::Error| {
            remove_if_ours(path, id);
            Error::from(e)
        };
        set_nonblocking(listener.as_raw_fd()).map_err(fail)?;
        let quit = Arc::new(QuitFd::new().map_err(fail)?);
        let quit2 = Arc::clone(&quit);
        let cap = ConnectionCap::new(MAX_CONNECTIONS, "uzram ctl");
        let accept = std::thread::Builder::new()
            .name("uzram-ctl".into())
            .spawn(move || {
                accept_loop(
                    &listener,
                    &quit2,
                    &cap,
                    Some("uzram ctl"),
                    |stream, slot| {
                        let handler = Arc::clone(&handler);
                        let _ = std::thread::Builder::new()
                            .name("uzram-ctl-conn".into())
                            .spawn(move || {
                                let _slot = slot;
                                let _ = serve_connection(stream, &*handler);
                            });
                    },
                )
            })
            .map_err(fail)?;
        Ok(ControlServer {
            path: path.to_path_buf(),
            id,
            quit,
            accept: Some(accept),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The socket's path and what it was when bound (for
    /// [`remove_if_ours`](super::unix_socket::remove_if_ours)).
    pub fn socket_file(&self) -> (PathBuf, SocketId) {
        (self.path.clone(), self.id)
    }

    /// Stops accepting (at once: the accept loop waits on a quit fd) and removes the socket if
    /// it is still ours. Connections already open finish the request they are serving on their
    /// own threads, within their deadlines.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        let Some(t) = self.accept.take() else { return };
        self.quit.raise();
        let _ = t.join();
        remove_if_ours(&self.path, self.id);
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// Sends one answer line; the client has [`REQUEST_DEADLINE`] to take it.
fn send(w: &UnixStream, r: &Response) -> io::Result<()> {
    let mut line = serde_json::to_vec(r).map_err(io::Error::other)?;
    line.push(b'\n');
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let mut rest = &line[..];
    while !rest.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        w.set_write_timeout(Some(left))?;
        match (&mut &*w).write(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one request line (newline included; shorter only at the end of the stream or past
/// [`MAX_REQUEST_BYTES`]), all of it by `deadline`.
fn read_line(
    stream: &UnixStream,
    reader: &mut BufReader<&UnixStream>,
    deadline: Instant,
) -> io::Result<Vec<u8>> {
    let mut line = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let room = MAX_REQUEST_BYTES + 1 - line.len() as u64;
        match reader.by_ref().take(room).read_until(b'\n', &mut line) {
            Ok(0) => return Ok(line),
            Ok(_) if line.last() == Some(&b'\n') || line.len() as u64 > MAX_REQUEST_BYTES => {
                return Ok(line)
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::ErrorKind::TimedOut.into())
            }
            Err(e) => return Err(e),
        }
    }
}

/// Answers one request; progress (`progress` or `count` lines) of a long operation goes to the
/// second argument.
type Handler = dyn Fn(Request, &mut dyn FnMut(Response)) -> Result<String> + Send + Sync;

/// What the server attached to a device besides its attributes: its kernel block device, and
/// frontends that start only once the device has a size (a ublk device's size is fixed when
/// it is added, so a device added by `hot_add` gets its `/dev/ublkbN` at `disksize`).
pub trait Attachments: Send + Sync {
    /// The kernel block device (`/dev/ublkbN`), if it exists now.
    fn block_dev(&self) -> Option<PathBuf>;
    /// Called after `disksize` was stored: start what needs a size. An error is the store's.
    fn initialised(&self) -> Result<()>;
    /// Called after a `reset` emptied the device.
    fn reset(&self) {}
}

/// A block device that exists for the whole life of the control socket.
struct FixedBlockDev(PathBuf);

impl Attachments for FixedBlockDev {
    fn block_dev(&self) -> Option<PathBuf> {
        Some(self.0.clone())
    }
    fn initialised(&self) -> Result<()> {
        Ok(())
    }
}

/// zram's `/sys/class/zram-control/` for a server: adds and removes devices.
pub trait HotPlug: Send + Sync {
    /// Adds an uninitialised device with every frontend the server runs; its id (`zramN`'s N).
    fn hot_add(&self) -> Result<u32>;
    /// Removes the device `target` names: `EBUSY` while it is open (an NBD connection, a
    /// mounted or swapped-on block device, a connected VM), `ENODEV` if there is no such
    /// device.
    fn hot_remove(&self, target: RemoveTarget<'_>) -> Result<()>;
}

/// The device `hot_remove` is to remove.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveTarget<'a> {
    /// zram's id: `zramN`'s N.
    Id(u32),
    /// A device's name, for devices not named `zramN` (which have no id): uzram's extension.
    Name(&'a str),
}

/// The server's control socket, as zram's class directory `/sys/class/zram-control/`
/// (`DIR/zram-control`, beside the devices' `NAME.ctl`).
pub fn class_socket_path(dir: &Path) -> PathBuf {
    dir.join(CLASS_SOCKET_NAME)
}

/// The file name of [`class_socket_path`].
pub const CLASS_SOCKET_NAME: &str = "zram-control";

/// The class socket's attributes: reading `hot_add` adds a device, writing `hot_remove`
/// removes one.
pub const CLASS_ATTRS: &[&str] = &["hot_add", "hot_remove"];

/// One request on the class socket, with zram's errnos: `hot_add` is read-only and
/// `hot_remove` write-only (`EACCES` otherwise, as opening the sysfs file the wrong way
/// fails); `hot_remove` takes an `int` (`kstrtoint`: `EINVAL`, `ERANGE`), negative is
/// `EINVAL`, or (uzram's extension, since a device named otherwise than `zramN` has no id) a
/// device's name, where a value that is neither a number nor a device's name is kstrtoint's
/// `EINVAL`; an unknown attribute is `ENOENT`.
fn handle_class(hotplug: &dyn HotPlug, req: Request) -> Result<String> {
    let denied = |what: &str| Err(Error::new(ErrorKind::PermissionDenied, what.to_string()));
    match req {
        Request::Show { attr } if attr == "hot_add" => Ok(format!("{}\n", hotplug.hot_add()?)),
        Request::Store { attr, .. } if attr == "hot_add" => {
            denied("hot_add is read-only: read it to add a device")
        }
        Request::Show { attr } if attr == "hot_remove" => {
            denied("hot_remove is write-only: write a device id to it")
        }
        Request::Store { attr, value, .. } if attr == "hot_remove" => {
            let id = match kstrtoint(&value, 10) {
                Ok(id) => id,
                Err(not_int) => {
                    // A device's name; any other word stays kstrtoint's EINVAL.
                    let name = value.trim_end_matches('\n');
                    return match hotplug.hot_remove(RemoveTarget::Name(name)) {
                        Err(e) if e.kind() == ErrorKind::NoDevice => Err(not_int),
                        r => r.map(|()| String::new()),
                    };
                }
            };
            let id = u32::try_from(id)
                .map_err(|_| Error::invalid(format!("not a device id: {value:?}")))?;
            hotplug
                .hot_remove(RemoveTarget::Id(id))
                .map(|()| String::new())
        }
        Request::Show { attr } | Request::Store { attr, .. } => Err(Error::new(
            ErrorKind::NotFound,
            format!("no attribute {attr:?} in zram-control (hot_add, hot_remove)"),
        )),
    }
}

/// The frontends a control connection knows of: the NBD export's openers and the kernel
/// block device.
struct Frontends<'a> {
    openers: Option<&'a Openers>,
    attachments: Option<&'a dyn Attachments>,
    policy: Option<&'a DevicePolicy>,
}

/// The attribute of the device's policy settings (the server's, not zram's).
pub const POLICY_ATTR: &str = "policy";
/// The attribute of the policies' counters.
pub const POLICY_STAT_ATTR: &str = "policy_stat";

/// The name `show` answers the block device's path to (not a zram attribute: zram's device is
/// its own block device).
pub const BLOCK_DEV_ATTR: &str = "block_dev";

/// The name `show` answers the number of NBD connections using the device now to (`%u\n`;
/// the NBD frontend's, for `uzram ctl metrics`).
pub const NBD_CONNECTIONS_ATTR: &str = "nbd_connections";

/// `Some(EBUSY)` when `block_dev` is open exclusively: mounted, swapped on, or claimed by an
/// `O_EXCL` opener (the kernel refuses an exclusive open then).
fn block_dev_busy(block_dev: &Path) -> Option<Error> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(block_dev)
    {
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Some(Error::busy(format!(
            "{} is in use (mounted, swapped on or opened exclusively)",
            block_dev.display()
        ))),
        _ => None,
    }
}

fn serve_connection(stream: UnixStream, handler: &Handler) -> io::Result<()> {
    let mut reader = BufReader::new(&stream);
    let w = &stream;
    loop {
        let line = read_line(&stream, &mut reader, Instant::now() + REQUEST_DEADLINE)?;
        if line.is_empty() {
            return Ok(());
        }
        if line.last() != Some(&b'\n') {
            let e = Error::invalid("request too long or not ended by a newline");
            send(w, &Response::Error((&e).into()))?;
            return Ok(());
        }
        let req: Request = match serde_json::from_slice(&line) {
            Ok(r) => r,
            Err(e) => {
                let e = Error::invalid(format!("malformed request: {e}"));
                send(w, &Response::Error((&e).into()))?;
                continue;
            }
        };
        let result = handler(req, &mut |p| {
            // A client gone mid-operation does not stop the operation.
            let _ = send(w, &p);
        });
        let r = match result {
            Ok(text) => Response::Ok(text),
            Err(e) => Response::Error((&e).into()),
        };
        send(w, &r)?;
    }
}

/// One request on a device's control socket.
fn handle_device(
    device: &Device,
    frontends: &Frontends,
    req: Request,
    progress: &mut dyn FnMut(Response),
) -> Result<String> {
    match req {
        Request::Show { attr } => {
            let block_dev = frontends.attachments.and_then(|a| a.block_dev());
            match (block_dev, frontends.openers, frontends.policy) {
                (Some(b), _, _) if attr == BLOCK_DEV_ATTR => Ok(format!("{}\n", b.display())),
                (_, Some(o), _) if attr == NBD_CONNECTIONS_ATTR => Ok(format!("{}\n", o.count())),
                (_, _, Some(p)) if attr == POLICY_ATTR => Ok(p.show()),
                (_, _, Some(p)) if attr == POLICY_STAT_ATTR => Ok(p.show_stat()),
                _ => device.attr_show(&attr),
            }
        }
        Request::Store {
            attr,
            value,
            counts,
        } => {
            let was_initialised = device.is_initialised();
            store(device, frontends, &attr, &value, counts, progress)?;
            if let Some(a) = frontends.attachments {
                if attr == "disksize" {
                    a.initialised()?;
                } else if attr == "reset" && was_initialised && !device.is_initialised() {
                    a.reset();
                }
            }
            Ok(String::new())
        }
    }
}

/// Stores `attr`, reporting progress of long operations through `progress`: `count` lines
/// when `counts`, else `progress` lines.
fn store(
    device: &Device,
    frontends: &Frontends,
    attr: &str,
    value: &str,
    counts: bool,
    progress: &mut dyn FnMut(Response),
) -> Result<()> {
    if let Some(p) = frontends.policy {
        match attr {
            POLICY_ATTR => return p.store(value),
            POLICY_STAT_ATTR => {
                return Err(Error::new(
                    ErrorKind::PermissionDenied,
                    format!("{attr} is read-only"),
                ))
            }
            _ => {}
        }
    }
    if attr == "reset" {
        // zram checks the value first, then refuses while the disk is open.
        if kstrtou64(value, 10).is_ok_and(|v| v != 0) {
            let block_dev = frontends.attachments.and_then(|a| a.block_dev());
            if let Some(e) = block_dev.as_deref().and_then(block_dev_busy) {
                return Err(e);
            }
            if let Some(o) = frontends.openers {
                return o
                    .while_unused(|| device.attr_store(attr, value))
                    .unwrap_or_else(|n| {
                        Err(Error::busy(format!(
                            "the device is open by {n} NBD connection(s)"
                        )))
                    });
            }
        }
        return device.attr_store(attr, value);
    }
    if !LONG_OPERATIONS.contains(&attr)
        || !device.attr_names().any(|n| n == attr)
        || !device.is_initialised()
    {
        // Short, not an attribute of this device, or refused at once (every long operation
        // is EINVAL on an uninitialised device): its errno comes without a "started".
        return device.attr_store(attr, value);
    }
    let start = Instant::now();
    let before = device.stats();
    let op = OpProgress::new();
    let unit = ProgressUnit::of(attr).unwrap_or(ProgressUnit::Pages);
    let line = |message: String| {
        if counts {
            let (done, total) = op.get();
            Response::Count(ProgressCount {
                done,
                total,
                unit: unit.name().to_string(),
                message,
            })
        } else {
            Response::Progress(message)
        }
    };
    progress(line(format!("{attr}: started")));
    let interval = if counts {
        COUNT_INTERVAL
    } else {
        PROGRESS_INTERVAL
    };
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        let op = &op;
        s.spawn(move || {
            let _ = tx.send(device.attr_store_with_progress(attr, value, op));
        });
        loop {
            match rx.recv_timeout(interval) {
                Ok(r) => {
                    if counts && r.is_ok() {
                        // The final figures (all done: `OpProgress::finish`), so a bar ends
                        // full.
                        progress(line(progress_line(device, attr, &before, start)));
                    }
                    return r;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    progress(line(progress_line(device, attr, &before, start)))
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Error::io(format!("{attr}: the operation ended abnormally")))
                }
            }
        }
    })
}

/// What a long operation has done so far, from the statistics it moves.
fn progress_line(
    device: &Device,
    attr: &str,
    before: &uzram::device::StatsSnapshot,
    start: Instant,
) -> String {
    let now = device.stats();
    let secs = start.elapsed().as_secs();
    match attr {
        "compact" => format!(
            "compact: {} pages freed so far, mem_used_total {} ({secs} s)",
            now.pages_compacted.saturating_sub(before.pages_compacted),
            now.mem_used_total_bytes
        ),
        "recompress" => format!(
            "recompress: {} pages tried, {} recompressed, {} incompressible, compr_data_size {} \
             ({secs} s)",
            now.recomp_tried.saturating_sub(before.recomp_tried),
            now.recomp_done.saturating_sub(before.recomp_done),
            now.recomp_incompressible
                .saturating_sub(before.recomp_incompressible),
            now.compr_data_size_bytes
        ),
        "gc" => {
            let z = device.zone_stats().unwrap_or_default();
            format!(
                "gc: {} zones reclaimed, {} bytes relocated in all, {} zones empty ({secs} s)",
                z.gc_runs, z.gc_bytes_relocated, z.empty
            )
        }
        _ => {
            // Writeback moves bd_stat and mm_stat; bd_stat's third column is bd_writes
            // (4 KiB units, as zram's FOUR_K).
            let bd_writes = device
                .attr_show("bd_stat")
                .ok()
                .and_then(|s| s.split_whitespace().nth(2)?.parse::<u64>().ok());
            match bd_writes {
                Some(w) if attr == "writeback" => format!(
                    "writeback: bd_writes {w} (4 KiB units), mem_used_total {} ({secs} s)",
                    now.mem_used_total_bytes
                ),
                _ => format!(
                    "{attr}: running, mem_used_total {} ({secs} s)",
                    now.mem_used_total_bytes
                ),
            }
        }
    }
}

/// The control socket of device `name` whose export socket lives in `dir`.
pub fn socket_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.ctl"))
}

/// A connection to a control socket.
#[derive(Debug)]
pub struct ControlClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl ControlClient {
    /// Connects to the control socket at `path`.
    pub fn connect(path: &Path) -> io::Result<ControlClient> {
        let s = UnixStream::connect(path)?;
        Ok(ControlClient {
            writer: s.try_clone()?,
            reader: BufReader::new(s),
        })
    }

    /// Sends `req` and returns the final answer; each progress line's text goes to `progress`
    /// first. `Ok(Err(..))` is the device's error; `Err` a broken connection.
    pub fn call(
        &mut self,
        req: &Request,
        progress: &mut dyn FnMut(&str),
    ) -> io::Result<std::result::Result<String, WireError>> {
        self.call_with_progress(req, &mut |u| progress(u.message()))
    }

    /// As [`call`](Self::call), each progress line whole: a `count` line (when the request
    /// asked for counts and the server knows them) or a `progress` line's text.
    pub fn call_with_progress(
        &mut self,
        req: &Request,
        progress: &mut dyn FnMut(ProgressUpdate<'_>),
    ) -> io::Result<std::result::Result<String, WireError>> {
        let mut line = serde_json::to_vec(req).map_err(io::Error::other)?;
        line.push(b'\n');
        self.writer.write_all(&line)?;
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let r: Response = serde_json::from_str(&line)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            match r {
                Response::Progress(p) => progress(ProgressUpdate::Text(&p)),
                Response::Count(c) => progress(ProgressUpdate::Count(&c)),
                Response::Ok(text) => return Ok(Ok(text)),
                Response::Error(e) => return Ok(Err(e)),
            }
        }
    }

    /// Shows `attr` (no progress).
    pub fn show(&mut self, attr: &str) -> io::Result<std::result::Result<String, WireError>> {
        self.call(
            &Request::Show {
                attr: attr.to_string(),
            },
            &mut |_| {},
        )
    }
}

/// A progress line as a client receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressUpdate<'a> {
    /// A `progress` line: text only.
    Text(&'a str),
    /// A `count` line.
    Count(&'a ProgressCount),
}

impl ProgressUpdate<'_> {
    /// The line's text.
    pub fn message(&self) -> &str {
        match self {
            ProgressUpdate::Text(t) => t,
            ProgressUpdate::Count(c) => &c.message,
        }
    }
}

impl WireError {
    /// The error as uzram's own.
    pub fn to_error(&self) -> Error {
        Error::new(ErrorKind::from_errno(self.errno), self.message.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device with a file backing and `pages` idle pages of position-dependent data, and
    /// its control socket.
    fn served(dir: &Path, pages: u64) -> (Arc<Device>, ControlServer) {
        let dev = Arc::new(Device::new_uninit(4096).unwrap());
        let backing = dir.join("backing");
        std::fs::write(&backing, vec![0u8; (pages as usize + 64) * 4096]).unwrap();
        dev.attr_store("backing_dev", backing.to_str().unwrap())
            .unwrap();
        dev.attr_store("disksize", &format!("{}", pages * 4096))
            .unwrap();
        for i in 0..pages {
            dev.write_at(&page(i), i * 4096).unwrap();
        }
        dev.attr_store("idle", "all").unwrap();
        let ctl = ControlServer::start(&dir.join("zram0.ctl"), Arc::clone(&dev), None).unwrap();
        (dev, ctl)
    }

    fn page(i: u64) -> Vec<u8> {
        (0..4096u64).map(|b| ((b / 32 + i) % 13) as u8).collect()
    }

    /// Sends `line` raw and returns every answer line, up to the final one.
    fn raw_call(path: &Path, line: &str) -> Vec<serde_json::Value> {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        (&s).write_all(line.as_bytes()).unwrap();
        let mut out = Vec::new();
        for l in BufReader::new(&s).lines() {
            let v: serde_json::Value = serde_json::from_str(&l.unwrap()).unwrap();
            let last = v.get("ok").is_some() || v.get("error").is_some();
            out.push(v);
            if last {
                break;
            }
        }
        out
    }

    #[test]
    fn a_client_that_asks_gets_counts_and_an_old_one_text() {
        let dir = tempfile::tempdir().unwrap();
        let (dev, ctl) = served(dir.path(), 2048);
        // An old client's request (no `counts`): `progress` lines only, as before.
        let old = raw_call(
            ctl.path(),
            "{\"op\":\"store\",\"attr\":\"compact\",\"value\":\"1\"}\n",
        );
        assert_eq!(old.last().unwrap()["ok"], "", "{old:?}");
        assert!(old[..old.len() - 1].iter().all(|v| v["progress"]
            .as_str()
            .is_some_and(|t| t.starts_with("compact: "))));
        // `counts` leaves an old client's serialisation alone.
        let req = Request::Store {
            attr: "writeback".into(),
            value: "idle".into(),
            counts: false,
        };
        assert!(!serde_json::to_string(&req).unwrap().contains("counts"));
        // A new client: count lines, done never past total nor going back, the last one full.
        let mut client = ControlClient::connect(ctl.path()).unwrap();
        let req = Request::Store {
            attr: "writeback".into(),
            value: "idle".into(),
            counts: true,
        };
        let mut seen: Vec<ProgressCount> = Vec::new();
        let r = client
            .call_with_progress(&req, &mut |u| match u {
                ProgressUpdate::Count(c) => seen.push(c.clone()),
                ProgressUpdate::Text(t) => panic!("a text line {t:?} after asking for counts"),
            })
            .unwrap();
        assert_eq!(r, Ok(String::new()));
        assert_eq!(seen[0].message, "writeback: started");
        assert!(seen.iter().all(|c| c.unit == "pages" && c.done <= c.total));
        assert!(seen.windows(2).all(|w| w[0].done <= w[1].done), "{seen:?}");
        let last = seen.last().unwrap();
        assert_eq!((last.done, last.total), (2048, 2048), "{seen:?}");
        // Every page reads back identical from the backing device.
        for i in 0..2048 {
            let mut got = vec![0u8; 4096];
            dev.read_at(&mut got, i * 4096).unwrap();
            assert!(got == page(i), "page {i}");
        }
        // An error of a long operation asked with counts: count lines with nothing done (a
        // timed one may come before the error on a loaded machine), no final full one, then
        // the errno (gc needs a zoned store).
        let req = Request::Store {
            attr: "gc".into(),
            value: "1".into(),
            counts: true,
        };
        let mut seen: Vec<ProgressCount> = Vec::new();
        let r = client
            .call_with_progress(&req, &mut |u| match u {
                ProgressUpdate::Count(c) => seen.push(c.clone()),
                ProgressUpdate::Text(t) => panic!("a text line {t:?}"),
            })
            .unwrap();
        assert_eq!(r.unwrap_err().errno, libc::ENODEV);
        assert_eq!(seen[0].message, "gc: started");
        assert!(
            seen.iter()
                .all(|c| c.unit == "zones" && c.done == 0 && c.total == 0),
            "{seen:?}"
        );
        // A short attribute with counts: no progress at all.
        let req = Request::Store {
            attr: "mem_limit".into(),
            value: "1G".into(),
            counts: true,
        };
        let mut n = 0;
        assert_eq!(
            client.call_with_progress(&req, &mut |_| n += 1).unwrap(),
            Ok(String::new())
        );
        assert_eq!(n, 0);
        ctl.stop();
    }
}
