//! Where a serving process keeps its devices' state files so that they outlive it
//! (docs/restart.md, "The server"), and the files a new process inherits.
//!
//! Two holders, whichever the process was started by:
//! - **uzram's keeper** (`uzram serve --keeper`, [`crate::keeper`]): `UZRAM_KEEPER_FD` names
//!   the serving process's end of a `SOCK_SEQPACKET` socket to it; each message is
//!   `store NAME` with the device's five descriptors, `remove NAME`, or `ready`.
//! - **systemd's file descriptor store** (`NOTIFY_SOCKET` set, no keeper): one datagram per
//!   file, `FDSTORE=1` and `FDNAME=NAME/FILE` with the descriptor; `FDSTOREREMOVE=1` and the
//!   same names to drop them. The unit needs `FileDescriptorStoreMax=` (contrib/uzram.service).
//!
//! A new process inherits the files as systemd hands them back: descriptors from 3 on, their
//! count and names in `LISTEN_FDS` and `LISTEN_FDNAMES` (colon-separated, with `LISTEN_PID`
//! the process's pid), or from the keeper in `UZRAM_STATE_FDS` and `UZRAM_STATE_FDNAMES` (the
//! same names; the descriptors' numbers listed, space-separated). A device's files are named
//! `NAME/header`, `NAME/slots`, `NAME/handles`, `NAME/frames` and `NAME/records`
//! ([`FILE_NAMES`], [`DeviceFiles::into_fds`]' order).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

use uzram::device::restart::{DeviceFiles, DEVICE_FILES};
use uzram::device::Device;

use crate::scm;

/// The names of a device's files after `NAME/`, in [`DeviceFiles::into_fds`]' order.
pub const FILE_NAMES: [&str; DEVICE_FILES] = ["header", "slots", "handles", "frames", "records"];

/// The keeper's socket in a serving process it started: the descriptor number.
pub const KEEPER_FD_ENV: &str = "UZRAM_KEEPER_FD";
/// How many state descriptors the keeper handed over (from 3 on).
pub const STATE_FDS_ENV: &str = "UZRAM_STATE_FDS";
/// Their names, colon-separated.
pub const STATE_FDNAMES_ENV: &str = "UZRAM_STATE_FDNAMES";

/// The first inherited descriptor (after standard input, output and error).
pub const FIRST_FD: RawFd = 3;

/// The longest message between a serving process and its keeper.
pub const MAX_MESSAGE_BYTES: usize = 512;

/// Whether `name` can name a device's files in an fd store: printable ASCII without `:`
/// (`LISTEN_FDNAMES`' separator) or `/`, short enough for systemd's 255-byte names.
pub fn storable_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 240
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b':' && b != b'/')
}

/// Where the state files go.
enum Holder {
    /// Nowhere: a restart loses the devices.
    None,
    /// uzram's keeper, over this socket.
    Keeper(OwnedFd),
    /// systemd's fd store, at this `NOTIFY_SOCKET` address, through this datagram socket.
    Systemd {
        sock: OwnedFd,
        addr: libc::sockaddr_un,
        len: libc::socklen_t,
    },
}

/// A serving process's fd store: hands each device's state files to the keeper or systemd
/// when the device gets a size, and drops them when it is reset or removed. Failures are
/// logged (the device is served all the same; a restart would not find it).
pub struct StateStore {
    /// Protected by the mutex: one message sequence at a time (systemd's are several).
    holder: Mutex<Holder>,
}

impl std::fmt::Debug for StateStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.kind())
    }
}

impl StateStore {
    /// A store that keeps nothing.
    pub fn none() -> StateStore {
        StateStore {
            holder: Mutex::new(Holder::None),
        }
    }

    /// The keeper's, through `sock`.
    pub fn keeper(sock: OwnedFd) -> StateStore {
        StateStore {
            holder: Mutex::new(Holder::Keeper(sock)),
        }
    }

    /// Who holds the files: `the keeper`, `systemd's fd store` or `nothing`.
    pub fn kind(&self) -> &'static str {
        match *self.lock() {
            Holder::None => "nothing",
            Holder::Keeper(_) => "the keeper",
            Holder::Systemd { .. } => "systemd's fd store",
        }
    }

    /// Whether systemd's fd store keeps the files.
    pub fn is_systemd(&self) -> bool {
        matches!(*self.lock(), Holder::Systemd { .. })
    }

    /// Whether anything keeps the files.
    pub fn keeps(&self) -> bool {
        !matches!(*self.lock(), Holder::None)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Holder> {
        self.holder.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands `device`'s files to the holder under `name` (replacing what it held under that
    /// name). Logs what fails.
    pub fn store(&self, name: &str, device: &Device) {
        if !self.keeps() {
            return;
        }
        if let Err(e) = self.try_store(name, device) {
            eprintln!(
                "uzram: {name}: cannot hand its state to {}: {e}: a restart will not keep it",
                self.kind()
            );
        }
    }

    fn try_store(&self, name: &str, device: &Device) -> io::Result<()> {
        if !storable_name(name) {
            return Err(io::Error::other(
                "its name is not printable ASCII without ':' (an fd store's names)",
            ));
        }
        let files = device
            .state_files()
            .map_err(|e| io::Error::other(e.message().to_string()))?;
        let fds = files.into_fds();
        match &*self.lock() {
            Holder::None => Ok(()),
            Holder::Keeper(sock) => {
                let fds: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
                scm::send(sock.as_fd(), None, format!("store {name}").as_bytes(), &fds)
            }
            Holder::Systemd { sock, addr, len } => {
                for (file, fd) in FILE_NAMES.iter().zip(&fds) {
                    let remove = format!("FDSTOREREMOVE=1\nFDNAME={name}/{file}\n");
                    scm::send(sock.as_fd(), Some((addr, *len)), remove.as_bytes(), &[])?;
                    let store = format!("FDSTORE=1\nFDNAME={name}/{file}\n");
                    scm::send(
                        sock.as_fd(),
                        Some((addr, *len)),
                        store.as_bytes(),
                        &[fd.as_fd()],
                    )?;
                }
                Ok(())
            }
        }
    }

    /// Drops the files held under `name` (the device was reset or removed). Logs what fails.
    pub fn remove(&self, name: &str) {
        let r = match &*self.lock() {
            Holder::None => Ok(()),
            _ if !storable_name(name) => Ok(()),
            Holder::Keeper(sock) => {
                scm::send(sock.as_fd(), None, format!("remove {name}").as_bytes(), &[])
            }
            Holder::Systemd { sock, addr, len } => FILE_NAMES.iter().try_for_each(|file| {
                let remove = format!("FDSTOREREMOVE=1\nFDNAME={name}/{file}\n");
                scm::send(sock.as_fd(), Some((addr, *len)), remove.as_bytes(), &[])
            }),
        };
        if let Err(e) = r {
            eprintln!(
                "uzram: {name}: cannot drop its state from {}: {e}",
                self.kind()
            );
        }
    }

    /// Tells the keeper the server is serving (nothing for systemd: the unit is `Type=exec`).
    pub fn ready(&self) {
        if let Holder::Keeper(sock) = &*self.lock() {
            if let Err(e) = scm::send(sock.as_fd(), None, b"ready", &[]) {
                eprintln!("uzram: cannot tell the keeper the server is ready: {e}");
            }
        }
    }
}

/// The state files a serving process inherited, by device name: a device's five files, or
/// what is wrong with what it was handed (a file missing).
pub type Inherited = BTreeMap<String, Result<DeviceFiles, String>>;

/// Reads (and unsets) the environment a keeper or systemd started this process with: where
/// its devices' state files go, and the files inherited from a previous process. Call at
/// start, before any thread exists (it changes the environment).
pub fn from_env() -> (StateStore, Inherited) {
    let var = |k: &str| std::env::var(k).ok();
    let keeper_fd = var(KEEPER_FD_ENV);
    // The descriptors: the keeper lists their numbers; systemd counts them from 3.
    let (fds, names): (Result<Vec<RawFd>, String>, String) = if keeper_fd.is_some() {
        let list = var(STATE_FDS_ENV).unwrap_or_default();
        let fds = list
            .split_whitespace()
            .map(|n| {
                n.parse::<RawFd>()
                    .map_err(|_| format!("{STATE_FDS_ENV}={list:?}"))
            })
            .collect();
        (fds, var(STATE_FDNAMES_ENV).unwrap_or_default())
    } else {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        match (var("LISTEN_PID"), var("LISTEN_FDS")) {
            (Some(p), Some(n)) if p == pid.to_string() => {
                let fds = match n.parse::<RawFd>() {
                    Ok(n) if (0..=4096).contains(&n) => Ok((FIRST_FD..FIRST_FD + n).collect()),
                    _ => Err(format!("LISTEN_FDS={n:?}")),
                };
                (fds, var("LISTEN_FDNAMES").unwrap_or_default())
            }
            _ => (Ok(Vec::new()), String::new()),
        }
    };
    let notify = var("NOTIFY_SOCKET");
    for k in [
        KEEPER_FD_ENV,
        STATE_FDS_ENV,
        STATE_FDNAMES_ENV,
        "LISTEN_PID",
        "LISTEN_FDS",
        "LISTEN_FDNAMES",
    ] {
        std::env::remove_var(k);
    }
    let inherited = match fds {
        Ok(fds) => take_inherited(&fds, &names),
        Err(what) => {
            eprintln!("uzram: ignoring inherited descriptors: {what} is not a list of them");
            Inherited::new()
        }
    };
    let store = match (keeper_fd, notify) {
        (Some(fd), _) => match fd.parse::<RawFd>() {
            Ok(fd) if fd >= FIRST_FD && set_cloexec(fd).is_ok() => {
                // SAFETY: the keeper started this process with its socket at `fd`, owned
                // here from now on (nothing else in this process knows the number).
                StateStore::keeper(unsafe { OwnedFd::from_raw_fd(fd) })
            }
            _ => {
                eprintln!("uzram: {KEEPER_FD_ENV}={fd:?} is not an open descriptor: ignored");
                StateStore::none()
            }
        },
        (None, Some(path)) => match systemd(&path) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("uzram: NOTIFY_SOCKET={path:?}: {e}: the devices' state is not kept");
                StateStore::none()
            }
        },
        (None, None) => StateStore::none(),
    };
    (store, inherited)
}

/// Takes ownership of inherited descriptors `fds` (close-on-exec from now on), named by
/// `names` (colon-separated, in order), and groups them by device.
fn take_inherited(fds: &[RawFd], names: &str) -> Inherited {
    let names: Vec<&str> = names.split(':').collect();
    let mut files: BTreeMap<String, [Option<OwnedFd>; DEVICE_FILES]> = BTreeMap::new();
    for (i, &raw) in fds.iter().enumerate() {
        if raw < FIRST_FD || set_cloexec(raw).is_err() {
            eprintln!("uzram: inherited descriptor {raw} is not open: ignored");
            continue;
        }
        // SAFETY: the process was started with these descriptors open, handed to it (the
        // environment says so); each is owned once, here.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let name = names.get(i).copied().unwrap_or("");
        let parsed = name.rsplit_once('/').and_then(|(dev, file)| {
            let index = FILE_NAMES.iter().position(|f| *f == file)?;
            Some((dev, index))
        });
        match parsed {
            Some((dev, index)) if storable_name(dev) => {
                files.entry(dev.to_string()).or_default()[index] = Some(fd);
            }
            _ => eprintln!("uzram: inherited descriptor {raw} named {name:?}: not uzram's, closed"),
        }
    }
    files
        .into_iter()
        .map(|(dev, fds)| {
            let missing: Vec<&str> = FILE_NAMES
                .iter()
                .zip(&fds)
                .filter(|(_, f)| f.is_none())
                .map(|(n, _)| *n)
                .collect();
            let r = if missing.is_empty() {
                Ok(DeviceFiles::from_fds(fds.map(|f| f.expect("checked"))))
            } else {
                Err(format!(
                    "its saved state lacks the file(s) {}",
                    missing.join(", ")
                ))
            };
            (dev, r)
        })
        .collect()
}

fn set_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFD/F_SETFD on a number: EBADF if it is not open, nothing else.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// systemd's notification socket at `path` (a file, or `@NAME` in the abstract namespace).
fn systemd(path: &str) -> io::Result<StateStore> {
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_bytes();
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::other("not a socket address"));
    }
    let (abstract_ns, name) = match bytes.strip_prefix(b"@") {
        Some(rest) => (true, rest),
        None if bytes[0] == b'/' => (false, bytes),
        None => return Err(io::Error::other("not a socket address")),
    };
    let offset = usize::from(abstract_ns);
    for (i, b) in name.iter().enumerate() {
        addr.sun_path[offset + i] = *b as libc::c_char;
    }
    let base = std::mem::offset_of!(libc::sockaddr_un, sun_path);
    // A path's address counts its terminating NUL; an abstract one its exact bytes.
    let len = base + offset + name.len() + usize::from(!abstract_ns);
    // SAFETY: socket has no memory preconditions.
    let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor, owned here.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    Ok(StateStore {
        holder: Mutex::new(Holder::Systemd {
            sock,
            addr,
            len: len as libc::socklen_t,
        }),
    })
}
