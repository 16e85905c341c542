//! Unix sockets only their owner can reach, in directories only their owner controls.
//!
//! Every frontend that listens on a unix socket (NBD exports, the control socket, and the
//! vhost-user socket to come) binds it with [`bind_unix`] inside a directory checked by
//! [`ensure_private_dir`] (the default directories) or [`check_socket_parent`] (a path the user
//! gave), and removes it with [`remove_if_ours`].
//!
//! Why both: a socket's own mode (0600) keeps other users from connecting, but whoever can
//! rename entries in its directory can move it aside and listen at its name, and then answers
//! our own clients (`uzram ctl`, the printed NBD URI) as if it were us. So a directory we create
//! for sockets must be ours, a real directory (not a symlink), mode 0700; and a directory given
//! to us must not be writable by anyone but us and root, unless sticky (as `/tmp`), where
//! nobody can rename or remove what another user owns.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use uzram::error::{Error, ErrorKind, Result};

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn err_io(what: &str, path: &Path, e: io::Error) -> Error {
    let kind = Error::from(e);
    Error::new(
        kind.kind(),
        format!("{what} {}: {}", path.display(), kind.message()),
    )
}

/// Creates `dir` (one level: its parent must exist) with mode 0700 if it is missing, then
/// checks with `lstat` that it is a real directory, owned by the effective user, of mode 0700.
/// Anything else is refused with `EACCES` and the reason (a directory another user made in a
/// shared `/tmp` is exactly what this refuses).
pub fn ensure_private_dir(dir: &Path) -> Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {
            // Whatever the umask made of it: we created it, so it is ours to set.
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| err_io("cannot set the mode of", dir, e))?;
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err_io("cannot create", dir, e)),
    }
    check_private_dir(dir)
}

/// Checks, without creating anything, that `dir` is a real directory owned by the effective
/// user with mode 0700 (what [`ensure_private_dir`] makes), before trusting sockets in it.
pub fn check_private_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(dir).map_err(|e| err_io("cannot inspect", dir, e))?;
    let refuse = |why: String| {
        Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "refusing the socket directory {}: {why}; remove it (or fix it) and start again",
                dir.display()
            ),
        ))
    };
    if !meta.file_type().is_dir() {
        return refuse("it is not a directory (a symlink or a file)".into());
    }
    if meta.uid() != euid() {
        return refuse(format!(
            "it belongs to uid {}, not to this user (uid {})",
            meta.uid(),
            euid()
        ));
    }
    if meta.mode() & 0o7777 != 0o700 {
        return refuse(format!("its mode is {:o}, not 700", meta.mode() & 0o7777));
    }
    Ok(())
}

/// Checks the directory a user-given socket path lives in: it must not be writable by another
/// user (owned by us or root; no group or other write bit) unless it is sticky.
pub fn check_socket_parent(socket: &Path) -> Result<()> {
    let parent = match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let meta = std::fs::metadata(parent).map_err(|e| err_io("cannot inspect", parent, e))?;
    let mode = meta.mode();
    let sticky = mode & libc::S_ISVTX != 0;
    let refuse = |why: String| {
        Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "refusing the socket {}: {why}, so another user could replace the socket",
                socket.display()
            ),
        ))
    };
    if !sticky && meta.uid() != euid() && meta.uid() != 0 {
        return refuse(format!(
            "its directory {} belongs to uid {}",
            parent.display(),
            meta.uid()
        ));
    }
    if !sticky && mode & 0o022 != 0 {
        return refuse(format!(
            "its directory {} is writable by others (mode {:o}) and not sticky",
            parent.display(),
            mode & 0o7777
        ));
    }
    Ok(())
}

/// Which file a socket is: device, inode and change time (inode numbers are reused at once on
/// tmpfs), to remove it only if it is still ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketId {
    dev: u64,
    ino: u64,
    ctime_ns: i128,
}

impl SocketId {
    fn of(m: &std::fs::Metadata) -> SocketId {
        SocketId {
            dev: m.dev(),
            ino: m.ino(),
            ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
        }
    }
}

/// Binds a unix socket with mode 0600 without a window where it is reachable with looser
/// permissions: bind under a temporary name, chmod, then rename into place. A stale socket
/// (nobody accepting) at `path` is replaced; a live one is an error (`EBUSY`), as is anything
/// that is not a socket.
pub fn bind_unix(path: &Path) -> Result<(UnixListener, SocketId)> {
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
    // The identity is taken after the rename (which changes the change time); the directory
    // is checked to be ours, so nobody else can have replaced the socket in between.
    let done = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path))
        .and_then(|()| std::fs::symlink_metadata(path));
    match done {
        Ok(m) => Ok((l, SocketId::of(&m))),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(err_io("cannot place socket", path, e))
        }
    }
}

/// Removes the socket at `path` if it is still the one we bound (never someone else's that
/// took its place).
pub fn remove_if_ours(path: &Path, id: SocketId) {
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if SocketId::of(&m) == id {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_dirs_are_created_and_checked() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("uzram");
        ensure_private_dir(&d).unwrap();
        ensure_private_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = ensure_private_dir(&d).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        assert!(e.message().contains("mode is 755"), "{e}");
        // A symlink to a good directory is refused too.
        let good = t.path().join("good");
        ensure_private_dir(&good).unwrap();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        assert!(ensure_private_dir(&link).is_err());
        // Not recursive.
        assert!(ensure_private_dir(&t.path().join("a/b")).is_err());
    }

    #[test]
    fn socket_parents_must_not_be_writable_by_others() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("open");
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(check_socket_parent(&d.join("s.sock")).is_err());
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
        check_socket_parent(&d.join("s.sock")).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        check_socket_parent(&d.join("s.sock")).unwrap();
    }

    #[test]
    fn a_socket_is_removed_only_while_it_is_ours() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("s.sock");
        let (l, id) = bind_unix(&p).unwrap();
        drop(l);
        std::fs::remove_file(&p).unwrap();
        let (_l2, _) = bind_unix(&p).unwrap();
        remove_if_ours(&p, id);
        assert!(p.exists(), "another socket took the name: it stays");
    }
}
