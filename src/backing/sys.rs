//! The few system calls std does not wrap: `pwritev`, the block-device size and sector-size
//! ioctls, and `statx` for direct-I/O alignment; and the errors the engines make of failed
//! calls. Every `unsafe` here passes pointers that are borrowed for the duration of the call
//! only.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use crate::error::Error;

/// `BLKGETSIZE64` = `_IOR(0x12, 114, size_t)`: the device size in bytes (linux/fs.h). The libc
/// crate does not export it; the encoding (dir 2 << 30 | size 8 << 16 | 0x12 << 8 | 114) is the
/// same on every 64-bit architecture Linux uses the generic ioctl layout on (x86_64, aarch64,
/// riscv64).
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// `IOV_MAX` on Linux (`UIO_MAXIOV`): the most iovecs one `pwritev` or `IORING_OP_WRITEV` takes.
pub(crate) const IOV_MAX: usize = 1024;

/// An I/O error with the request in the message; the kind comes from the errno.
pub(crate) fn io_error(e: io::Error, what: &str, offset: u64, len_bytes: u64) -> Error {
    let err = Error::from(e);
    Error::new(
        err.kind(),
        format!(
            "backing {what} of {len_bytes} bytes at offset {offset}: {}",
            err.message()
        ),
    )
}

/// An error with `what` (the file and the step) in the message; the kind comes from the errno.
pub(crate) fn with_context(e: io::Error, what: &str) -> Error {
    let err = Error::from(e);
    Error::new(err.kind(), format!("{what}: {}", err.message()))
}

/// The iovecs describing `bufs` back to back, with the first `skip_bytes` bytes left out, and
/// at most `max_iovecs` entries. Used to resume a short vectored write.
pub(crate) fn iovecs_after<'b>(
    bufs: impl IntoIterator<Item = &'b [u8]>,
    mut skip_bytes: u64,
    max_iovecs: usize,
) -> Vec<libc::iovec> {
    let mut out = Vec::new();
    for buf in bufs {
        if out.len() == max_iovecs {
            break;
        }
        let len = buf.len() as u64;
        if skip_bytes >= len {
            skip_bytes -= len;
            continue;
        }
        let rest = &buf[skip_bytes as usize..];
        skip_bytes = 0;
        out.push(libc::iovec {
            iov_base: rest.as_ptr() as *mut libc::c_void,
            iov_len: rest.len(),
        });
    }
    out
}

/// Repeats one vectored call until `total` bytes moved from `offset` on: `call(done, pos)`
/// transfers the bytes after the first `done` at file position `pos` and returns what the
/// syscall returned. Retries `EINTR`, continues after short transfers, and fails with `zero`'s
/// kind when a call moves nothing.
fn transfer_all(
    total: u64,
    offset: u64,
    zero: (io::ErrorKind, &str),
    mut call: impl FnMut(u64, libc::off_t) -> isize,
) -> io::Result<()> {
    let mut done: u64 = 0;
    while done < total {
        let pos = libc::off_t::try_from(offset + done)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let n = call(done, pos);
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::Error::new(
                zero.0,
                format!(
                    "{} at offset {pos} with {} bytes left",
                    zero.1,
                    total - done
                ),
            ));
        }
        done += n as u64;
    }
    Ok(())
}

/// Writes all of `bufs` back to back at `offset` with `pwritev`, looping over short writes,
/// `EINTR` and more than [`IOV_MAX`] buffers. A write that makes no progress fails with
/// `WriteZero`.
pub(crate) fn pwritev_all(file: &File, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
    let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    let zero = (io::ErrorKind::WriteZero, "pwritev wrote nothing");
    transfer_all(total, offset, zero, |done, pos| {
        let iovecs = iovecs_after(bufs.iter().copied(), done, IOV_MAX);
        // SAFETY: `iovecs` points into `bufs`, which are borrowed (alive and unmodified) for
        // the whole call; `iovecs.len()` <= IOV_MAX fits a c_int; the fd is open while `file`
        // is borrowed.
        unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                iovecs.as_ptr(),
                iovecs.len() as libc::c_int,
                pos,
            )
        }
    })
}

/// Reads into all of `bufs` back to back from `offset` with `preadv`, looping over short reads,
/// `EINTR` and more than [`IOV_MAX`] buffers. End of file before the buffers are full fails
/// with `UnexpectedEof`.
pub(crate) fn preadv_all(file: &File, bufs: &mut [&mut [u8]], offset: u64) -> io::Result<()> {
    let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    let zero = (io::ErrorKind::UnexpectedEof, "preadv hit end of file");
    transfer_all(total, offset, zero, |done, pos| {
        // Built from mutable pointers: the kernel writes through them.
        let mut iovecs = Vec::new();
        let mut skip = done;
        for buf in bufs.iter_mut() {
            if iovecs.len() == IOV_MAX {
                break;
            }
            let len = buf.len() as u64;
            if skip >= len {
                skip -= len;
                continue;
            }
            let rest = &mut buf[skip as usize..];
            skip = 0;
            iovecs.push(libc::iovec {
                iov_base: rest.as_mut_ptr().cast(),
                iov_len: rest.len(),
            });
        }
        // SAFETY: `iovecs` points into `bufs`, mutably borrowed (alive, and not accessed by
        // anything else) for the whole call; `iovecs.len()` <= IOV_MAX fits a c_int; the fd is
        // open while `file` is borrowed.
        unsafe {
            libc::preadv(
                file.as_raw_fd(),
                iovecs.as_ptr(),
                iovecs.len() as libc::c_int,
                pos,
            )
        }
    })
}

/// The size of the block device open as `file`, in bytes.
pub(crate) fn block_device_size_bytes(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to `size`, alive
    // for the call; the fd is open while `file` is borrowed.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// The logical block size of the block device open as `file`: the alignment direct I/O needs.
pub(crate) fn block_device_logical_block_bytes(file: &File) -> io::Result<usize> {
    let mut size: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which points to `size`, alive for
    // the call; the fd is open while `file` is borrowed.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET as _, &mut size as *mut _) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size.max(1) as usize)
}

/// Direct-I/O alignment of the file open as `file` as `statx` reports it (Linux 6.1+):
/// `Some((memory, offset))`, `Some((0, 0))` when the file does not support direct I/O, or
/// `None` when the kernel or file system does not say.
pub(crate) fn statx_dio_align(file: &File) -> Option<(u32, u32)> {
    // SAFETY: `statx` is a plain C struct of integers, for which all-zero bytes are valid.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the path is a valid NUL-terminated empty string (with AT_EMPTY_PATH the fd is the
    // target), `stx` is a live, writable statx the call fills; the fd is open.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    Some((stx.stx_dio_mem_align, stx.stx_dio_offset_align))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iovecs_after_skips_and_limits() {
        let a = [1u8; 512];
        let b = [2u8; 1024];
        let c = [3u8; 512];
        let bufs: [&[u8]; 3] = [&a, &b, &c];
        let all = iovecs_after(bufs, 0, IOV_MAX);
        assert_eq!(
            all.iter().map(|v| v.iov_len).collect::<Vec<_>>(),
            [512, 1024, 512]
        );
        let mid = iovecs_after(bufs, 512 + 100, IOV_MAX);
        assert_eq!(
            mid.iter().map(|v| v.iov_len).collect::<Vec<_>>(),
            [924, 512]
        );
        assert_eq!(mid[0].iov_base as usize, b.as_ptr() as usize + 100);
        let two = iovecs_after(bufs, 512, 1);
        assert_eq!(two.len(), 1);
        assert_eq!(two[0].iov_len, 1024);
        assert!(iovecs_after(bufs, 2048, IOV_MAX).is_empty());
    }

    #[test]
    fn pwritev_all_writes_many_buffers() {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        // More buffers than IOV_MAX, so the loop must go round at least twice.
        let bufs: Vec<Vec<u8>> = (0..IOV_MAX + 5).map(|i| vec![i as u8; 512]).collect();
        let slices: Vec<&[u8]> = bufs.iter().map(|b| &b[..]).collect();
        pwritev_all(&file, &slices, 512).unwrap();
        let data = std::fs::read(dir.path().join("f")).unwrap();
        assert_eq!(data.len(), 512 * (IOV_MAX + 6));
        for (i, chunk) in data[512..].chunks(512).enumerate() {
            assert!(chunk.iter().all(|&b| b == i as u8), "buffer {i}");
        }
    }
}
