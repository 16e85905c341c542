//! The one public error type.
//!
//! Every area (codecs, allocator, device, attributes, backing, frontends) reports an [`Error`]
//! with a small matchable [`ErrorKind`] and the errno that zram's sysfs (or the NBD protocol)
//! would return for it. Callers match on [`Error::kind`] or [`Error::errno`], never on the text.

use std::fmt;

/// What went wrong, in the granularity callers act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A malformed value, an unknown name, misaligned or zero-length I/O, I/O past the end. `EINVAL`.
    InvalidArgument,
    /// A page index beyond the device (zram's writeback `page_index=`). `ERANGE`.
    OutOfRange,
    /// The device is initialised (or in use) and the setting can no longer change. `EBUSY`.
    Busy,
    /// `mem_limit` reached, or the operating system refused memory. `ENOMEM`.
    NoMemory,
    /// No backing device is configured for an operation that needs one. `ENODEV`.
    NoDevice,
    /// The backing device is full. `ENOSPC`.
    NoSpace,
    /// A backing read or write failed, or data failed its checksum, or the writeback limit is
    /// exhausted (zram returns `EIO` there too). `EIO`.
    Io,
    /// The operation is not supported by this device or algorithm. `EOPNOTSUPP`.
    Unsupported,
    /// The attribute cannot be read (write-only in zram's sysfs) or written (read-only).
    /// `EACCES`, as `cat` of a write-only sysfs file gives root.
    PermissionDenied,
    /// No such attribute or device. `ENOENT`.
    NotFound,
    /// Another post-processing operation (a writeback) is running; try again. `EAGAIN`, as
    /// zram's `writeback` returns while one is in progress.
    Again,
}

impl ErrorKind {
    /// The errno zram (or the kernel's block layer) reports for this kind.
    pub fn errno(self) -> i32 {
        match self {
            ErrorKind::InvalidArgument => libc::EINVAL,
            ErrorKind::OutOfRange => libc::ERANGE,
            ErrorKind::Busy => libc::EBUSY,
            ErrorKind::NoMemory => libc::ENOMEM,
            ErrorKind::NoDevice => libc::ENODEV,
            ErrorKind::NoSpace => libc::ENOSPC,
            ErrorKind::Io => libc::EIO,
            ErrorKind::Unsupported => libc::EOPNOTSUPP,
            ErrorKind::PermissionDenied => libc::EACCES,
            ErrorKind::NotFound => libc::ENOENT,
            ErrorKind::Again => libc::EAGAIN,
        }
    }

    /// The kind an operating-system errno maps to.
    pub fn from_errno(errno: i32) -> ErrorKind {
        match errno {
            libc::EINVAL => ErrorKind::InvalidArgument,
            libc::ERANGE => ErrorKind::OutOfRange,
            libc::EBUSY => ErrorKind::Busy,
            libc::ENOMEM => ErrorKind::NoMemory,
            libc::ENODEV | libc::ENXIO => ErrorKind::NoDevice,
            libc::ENOENT => ErrorKind::NotFound,
            libc::ENOSPC | libc::EDQUOT | libc::EFBIG => ErrorKind::NoSpace,
            libc::EOPNOTSUPP => ErrorKind::Unsupported,
            libc::EPERM | libc::EACCES => ErrorKind::PermissionDenied,
            libc::EAGAIN => ErrorKind::Again,
            _ => ErrorKind::Io,
        }
    }
}

/// uzram's error: a kind, and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    msg: String,
}

impl Error {
    /// An error of `kind` with a human-readable message.
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Error {
        Error {
            kind,
            msg: msg.into(),
        }
    }
    /// `EINVAL`.
    pub fn invalid(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidArgument, msg)
    }
    /// `EBUSY`.
    pub fn busy(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::Busy, msg)
    }
    /// `ENOMEM`.
    pub fn no_memory(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::NoMemory, msg)
    }
    /// `EIO`.
    pub fn io(msg: impl Into<String>) -> Error {
        Error::new(ErrorKind::Io, msg)
    }
    /// The matchable kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    /// The errno for attribute writes and NBD replies.
    pub fn errno(&self) -> i32 {
        self.kind.errno()
    }
    /// The message, for people.
    pub fn message(&self) -> &str {
        &self.msg
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = errno_name(self.errno());
        write!(f, "{} ({name})", self.msg)
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        let kind = e
            .raw_os_error()
            .map(ErrorKind::from_errno)
            .unwrap_or(ErrorKind::Io);
        Error::new(kind, e.to_string())
    }
}

/// The symbolic name of an errno, as `strerror`'s users know it (`EINVAL`, ...).
pub fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::EINVAL => "EINVAL",
        libc::ERANGE => "ERANGE",
        libc::EBUSY => "EBUSY",
        libc::ENOMEM => "ENOMEM",
        libc::ENODEV => "ENODEV",
        libc::ENOSPC => "ENOSPC",
        libc::EIO => "EIO",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EPERM => "EPERM",
        libc::EACCES => "EACCES",
        libc::ENOENT => "ENOENT",
        libc::EAGAIN => "EAGAIN",
        _ => "errno",
    }
}

/// uzram's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
