//! [`FileBacking`]: a regular file or a block device.
//!
//! # What it owns
//!
//! Two descriptors of the same file, in a [`FileFds`] its io_uring queues borrow: `buffered`
//! (always) and `direct` (`O_DIRECT`, when the file system takes it). Requests whose offset,
//! length and memory are aligned to the direct-I/O alignment go through `direct`; memory-only
//! misalignment is bounced through an [`AlignedBuf`]; anything else (a 512-byte request on a
//! 4Kn device) goes through `buffered`.
//!
//! A block device is opened with `O_EXCL` (like zram's `backing_dev`), so a mounted or otherwise
//! claimed device is refused with `EBUSY` instead of being overwritten.
//!
//! # Size
//!
//! A regular file's size is its length when opened ([`FileBacking::create`] sizes a sparse
//! file); a block device's comes from `BLKGETSIZE64`. Either is rounded down to a whole
//! number of 4 KiB blocks; an empty backing is refused.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::blkzoned::{self, ZoneGeometry, ZoneInfo, ZonePlugQueue};
use super::fds::FileFds;
use super::sync::SyncQueue;
use super::sys::{self, io_error, with_context};
use super::uring::UringQueue;
use super::{
    check_depth, check_range, total_len, AlignedBuf, Backing, Engine, IoQueue, BLOCK_SIZE_BYTES,
    BUF_ALIGN_BYTES, SECTOR_SIZE_BYTES,
};
use crate::error::{Error, ErrorKind, Result};

/// Whether to use `O_DIRECT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DirectIo {
    /// Direct I/O when the file system supports it, buffered I/O otherwise (noted in
    /// [`FileBacking::io_mode`]).
    #[default]
    Auto,
    /// Always buffered I/O (through the page cache).
    Off,
    /// Direct I/O or fail to open.
    Required,
}

/// How to open a [`FileBacking`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FileOptions {
    /// The engine [`Backing::new_queue`] gives.
    pub engine: Engine,
    /// `O_DIRECT` policy.
    pub direct_io: DirectIo,
}

impl FileOptions {
    /// Options with `engine` and automatic direct I/O.
    pub fn with_engine(engine: Engine) -> FileOptions {
        FileOptions {
            engine,
            ..FileOptions::default()
        }
    }
}

/// A backing file or block device. See the module docs.
pub struct FileBacking {
    path: PathBuf,
    /// The page-cache and `O_DIRECT` descriptors.
    fds: FileFds,
    size_bytes: u64,
    engine: Engine,
    is_block_device: bool,
    /// How I/O is done, for people: "O_DIRECT" or "buffered (reason)".
    io_mode: String,
    /// The zones of a zoned block device (then `direct` is always open: a sequential zone
    /// takes no writes through the page cache).
    zones: Option<ZoneGeometry>,
}

impl FileBacking {
    /// Opens an existing file or block device, read-write.
    pub fn open(path: impl AsRef<Path>, options: &FileOptions) -> Result<FileBacking> {
        let path = path.as_ref();
        let what = || format!("backing device {}", path.display());
        let meta = std::fs::metadata(path).map_err(|e| with_context(e, &what()))?;
        let is_block_device = meta.file_type().is_block_device();
        if !is_block_device && !meta.file_type().is_file() {
            return Err(Error::invalid(format!(
                "{} is neither a regular file nor a block device",
                what()
            )));
        }
        let mut open = OpenOptions::new();
        open.read(true).write(true);
        if is_block_device {
            open.custom_flags(libc::O_EXCL);
        }
        let buffered = open.open(path).map_err(|e| with_context(e, &what()))?;
        let raw_size_bytes = if is_block_device {
            sys::block_device_size_bytes(&buffered).map_err(|e| with_context(e, &what()))?
        } else {
            buffered
                .metadata()
                .map_err(|e| with_context(e, &what()))?
                .len()
        };
        let size_bytes = raw_size_bytes - raw_size_bytes % BLOCK_SIZE_BYTES as u64;
        if size_bytes == 0 {
            return Err(Error::invalid(format!(
                "{} holds {raw_size_bytes} bytes, less than one {BLOCK_SIZE_BYTES}-byte block",
                what()
            )));
        }

        let zone_size_bytes = if is_block_device {
            blkzoned::zone_size_bytes(&buffered).map_err(|e| with_context(e, &what()))?
        } else {
            None
        };
        let zones = match zone_size_bytes {
            Some(zs) => {
                if options.direct_io == DirectIo::Off {
                    return Err(Error::invalid(format!(
                        "{} is a zoned block device: it needs direct I/O",
                        what()
                    )));
                }
                Some(blkzoned::geometry(&buffered, zs).map_err(|e| with_context(e, &what()))?)
            }
            None => None,
        };
        let direct_io = if zones.is_some() {
            DirectIo::Required
        } else {
            options.direct_io
        };
        let (direct, dio_align_bytes, io_mode) = match direct_io {
            DirectIo::Off => (None, 1, "buffered (direct I/O off)".to_string()),
            DirectIo::Auto | DirectIo::Required => {
                match open_direct(path, &buffered, is_block_device) {
                    Ok((file, align)) => (Some(file), align, "O_DIRECT".to_string()),
                    Err(reason) if direct_io == DirectIo::Auto => {
                        (None, 1, format!("buffered ({reason})"))
                    }
                    Err(reason) => {
                        return Err(Error::new(
                            ErrorKind::Unsupported,
                            format!("{}: direct I/O required but {reason}", what()),
                        ))
                    }
                }
            }
        };
        if zones.is_some() && dio_align_bytes != SECTOR_SIZE_BYTES {
            // Records and GC's segments are 512-byte aligned; on a 4Kn device they would fall
            // back to the page cache, which a sequential zone does not take.
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{} is a zoned block device with {dio_align_bytes}-byte logical blocks; \
                     zoned writeback supports 512-byte logical blocks only",
                    what()
                ),
            ));
        }
        Ok(FileBacking {
            path: path.to_path_buf(),
            fds: FileFds::new(buffered, direct.map(|d| (d, dio_align_bytes))),
            size_bytes,
            engine: options.engine,
            is_block_device,
            io_mode,
            zones,
        })
    }

    /// Creates (or truncates) a regular file of `size_bytes` (sparse) and opens it.
    pub fn create(
        path: impl AsRef<Path>,
        size_bytes: u64,
        options: &FileOptions,
    ) -> Result<FileBacking> {
        let path = path.as_ref();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| with_context(e, &format!("creating {}", path.display())))?;
        file.set_len(size_bytes)
            .map_err(|e| with_context(e, &format!("sizing {}", path.display())))?;
        drop(file);
        FileBacking::open(path, options)
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `O_DIRECT` is in use.
    pub fn is_direct(&self) -> bool {
        self.fds.direct().is_some()
    }

    /// How I/O is done: `"O_DIRECT"`, or `"buffered (why)"` (for example when tmpfs refused
    /// `O_DIRECT`).
    pub fn io_mode(&self) -> &str {
        &self.io_mode
    }

    /// The alignment direct I/O needs (offset, length and memory); 1 when buffered.
    pub fn dio_align_bytes(&self) -> usize {
        self.fds.dio_align_bytes()
    }

    /// Whether this is a block device (rather than a regular file).
    pub fn is_block_device(&self) -> bool {
        self.is_block_device
    }

    /// The engine [`Backing::new_queue`] uses.
    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// A queue of `depth` on a given engine, whatever the default is (the benchmark compares
    /// both on one file).
    pub fn new_queue_with(&self, engine: Engine, depth: usize) -> Result<Box<dyn IoQueue + '_>> {
        check_depth(depth)?;
        let queue: Box<dyn IoQueue + '_> = match engine {
            Engine::Uring => Box::new(UringQueue::new(&self.fds, self.size_bytes, depth)?),
            Engine::Sync => Box::new(SyncQueue::new(self, depth)?),
        };
        Ok(match &self.zones {
            // Writes to a zone must reach it in write-pointer order.
            Some(g) => Box::new(ZonePlugQueue::new(queue, g.zone_size_bytes)),
            None => queue,
        })
    }
}

/// Opens `path` again with `O_DIRECT` and finds its alignment, or says why not.
fn open_direct(
    path: &Path,
    buffered: &File,
    is_block_device: bool,
) -> std::result::Result<(File, usize), String> {
    let direct = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| format!("O_DIRECT refused: {e}"))?;
    let align = if is_block_device {
        sys::block_device_logical_block_bytes(buffered)
            .map_err(|e| format!("cannot read the logical block size: {e}"))?
    } else {
        match sys::statx_dio_align(&direct) {
            Some((0, _)) | Some((_, 0)) => {
                return Err("the file system does not support direct I/O on it".into())
            }
            Some((mem, offset)) => mem.max(offset) as usize,
            // The kernel does not say: probe with one aligned read of each candidate size.
            None => probe_dio_align(&direct)?,
        }
    };
    if !align.is_power_of_two() || align > BUF_ALIGN_BYTES {
        return Err(format!(
            "direct I/O needs {align}-byte alignment, more than our {BUF_ALIGN_BYTES}-byte buffers"
        ));
    }
    Ok((direct, align))
}

/// The smallest of 512 and 4096 that an aligned direct read at offset 0 accepts.
fn probe_dio_align(direct: &File) -> std::result::Result<usize, String> {
    for align in [SECTOR_SIZE_BYTES, BUF_ALIGN_BYTES] {
        let mut buf = AlignedBuf::new_zeroed(align).map_err(|e| e.to_string())?;
        match direct.read_at(&mut buf, 0) {
            Ok(_) => return Ok(align),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue,
            Err(e) => return Err(format!("direct read probe failed: {e}")),
        }
    }
    Err("direct reads fail with EINVAL at every alignment".into())
}

impl Backing for FileBacking {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size_bytes, offset, buf.len() as u64, "read")?;
        let fds = &self.fds;
        let fd = fds.fd_for(offset, std::iter::once((buf.as_ptr() as usize, buf.len())));
        let direct_needs_bounce = fds.is_buffered(fd) && fds.can_bounce(offset, buf.len() as u64);
        if direct_needs_bounce {
            let mut bounce = AlignedBuf::new_zeroed(buf.len())?;
            fds.fd_for(
                offset,
                std::iter::once((bounce.as_ptr() as usize, bounce.len())),
            )
            .read_exact_at(&mut bounce, offset)
            .map_err(|e| io_error(e, "read", offset, buf.len() as u64))?;
            buf.copy_from_slice(&bounce);
            return Ok(());
        }
        fd.read_exact_at(buf, offset)
            .map_err(|e| io_error(e, "read", offset, buf.len() as u64))
    }

    fn readv_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> Result<()> {
        let len_bytes: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        check_range(self.size_bytes, offset, len_bytes, "read")?;
        // Direct when every piece is aligned, else through the page cache (coherent with
        // direct writes: they invalidate the cached range).
        let fd = (self.fds).fd_for(offset, bufs.iter().map(|b| (b.as_ptr() as usize, b.len())));
        sys::preadv_all(fd, bufs, offset).map_err(|e| io_error(e, "read", offset, len_bytes))
    }

    fn writev_at(&self, bufs: &[&[u8]], offset: u64) -> Result<()> {
        let len_bytes = total_len(bufs);
        check_range(self.size_bytes, offset, len_bytes, "write")?;
        let fds = &self.fds;
        let fd = fds.fd_for(offset, bufs.iter().map(|b| (b.as_ptr() as usize, b.len())));
        if fds.is_buffered(fd) && fds.can_bounce(offset, len_bytes) {
            let len = usize::try_from(len_bytes)
                .map_err(|_| Error::invalid("write larger than the address space"))?;
            let mut bounce = AlignedBuf::new_zeroed(len)?;
            let mut at = 0;
            for b in bufs {
                bounce[at..at + b.len()].copy_from_slice(b);
                at += b.len();
            }
            let direct = fds.direct().expect("can_bounce implies direct");
            return sys::pwritev_all(direct, &[&bounce], offset)
                .map_err(|e| io_error(e, "write", offset, len_bytes));
        }
        sys::pwritev_all(fd, bufs, offset).map_err(|e| io_error(e, "write", offset, len_bytes))
    }

    fn flush(&self) -> Result<()> {
        // fdatasync acts on the inode (or the block device), whichever descriptor is used.
        self.fds
            .buffered()
            .sync_data()
            .map_err(|e| with_context(e, &format!("flushing {}", self.path.display())))
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn new_queue(&self, depth: usize) -> Result<Box<dyn IoQueue + '_>> {
        self.new_queue_with(self.engine, depth)
    }

    fn zone_geometry(&self) -> Option<&ZoneGeometry> {
        self.zones.as_ref()
    }

    fn report_zones(&self) -> Result<Vec<ZoneInfo>> {
        match &self.zones {
            Some(g) => blkzoned::report(self.fds.buffered(), 0, g.nr_zones as usize).map_err(|e| {
                with_context(
                    e,
                    &format!("reporting the zones of {}", self.path.display()),
                )
            }),
            None => Ok(Vec::new()),
        }
    }

    fn reset_zone(&self, start_bytes: u64, len_bytes: u64) -> Result<()> {
        if self.zones.is_none() {
            return Ok(());
        }
        blkzoned::reset(self.fds.buffered(), start_bytes, len_bytes)
            .map_err(|e| io_error(e, "zone reset", start_bytes, len_bytes))
    }

    fn finish_zone(&self, start_bytes: u64, len_bytes: u64) -> Result<()> {
        if self.zones.is_none() {
            return Ok(());
        }
        blkzoned::finish(self.fds.buffered(), start_bytes, len_bytes)
            .map_err(|e| io_error(e, "zone finish", start_bytes, len_bytes))
    }
}

impl fmt::Debug for FileBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileBacking")
            .field("path", &self.path)
            .field("size_bytes", &self.size_bytes)
            .field("engine", &self.engine)
            .field("io_mode", &self.io_mode)
            .field("dio_align_bytes", &self.fds.dio_align_bytes())
            .field("is_block_device", &self.is_block_device)
            .field("zones", &self.zones)
            .finish()
    }
}
