//! Shared memory that outlives the process: memfd files and their mappings.
//!
//! A device's state (the slot table, the allocator's handle table, frame records and frames)
//! lives in memfd files mapped `MAP_SHARED`, so a process that holds the files' descriptors
//! (a new server, handed them by a keeper or systemd's fd store) finds every byte the old one
//! wrote, at offsets, never at addresses. `docs/restart.md` tells what lives where.
//!
//! - [`ShmFile`]: a memfd (`memfd_create(MFD_CLOEXEC)`), sparse: pages exist only once written
//!   (and are charged only then: the kernel makes memfds `VM_NORESERVE`, so even strict
//!   overcommit charges page by page). [`ShmFile::punch`] gives pages back
//!   (`fallocate(PUNCH_HOLE)`): `MADV_DONTNEED` would only unmap them from this process (the
//!   file keeps them), and `MADV_REMOVE` refuses a locked range, while a hole is punched
//!   whether or not the range is locked by a mapping, and a later touch of a locked-on-fault
//!   mapping faults a zero page in, locked again.
//! - [`ShmMap`]: one `mmap(PROT_READ|PROT_WRITE, MAP_SHARED|MAP_NORESERVE)` of a range of a
//!   file, unmapped on drop. Touching a page beyond the file's end is `SIGBUS`: owners size
//!   the file (`set_len`) before they map past it.
//!
//! Writes through a shared mapping are in the file the moment the store instruction retires,
//! so a process killed at any instruction leaves exactly the stores it made (the write paths'
//! ordering does the rest: see `docs/restart.md`).

#![allow(unsafe_code)]

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// A memfd file; see the module docs.
#[derive(Debug)]
pub struct ShmFile {
    fd: OwnedFd,
}

impl ShmFile {
    /// A new, empty memfd named `name` (shown in `/proc/PID/fd` as `/memfd:NAME`).
    pub fn create(name: &str) -> Result<ShmFile> {
        let cname = CString::new(format!("uzram-{name}"))
            .map_err(|_| Error::invalid("memfd name with a NUL byte"))?;
        // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::no_memory(format!(
                "memfd_create({name}): {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(ShmFile { fd })
    }

    /// The file of a descriptor another process handed over.
    pub fn from_fd(fd: OwnedFd) -> ShmFile {
        ShmFile { fd }
    }

    /// The file's descriptor.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// A second descriptor of the same file (to hand to another process).
    pub fn try_clone_fd(&self) -> Result<OwnedFd> {
        self.fd
            .try_clone()
            .map_err(|e| Error::no_memory(format!("dup of a memfd: {e}")))
    }

    /// The file's size in bytes.
    pub fn len(&self) -> Result<u64> {
        // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open and `st` is a valid, writable `stat`.
        if unsafe { libc::fstat(self.fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::io(format!(
                "fstat of a memfd: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(st.st_size as u64)
    }

    /// True for a file of no bytes.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Sets the file's size (a sparse file: growing it costs nothing until pages are written).
    pub fn set_len(&self, len_bytes: u64) -> Result<()> {
        // SAFETY: `fd` is open; ftruncate has no memory-safety preconditions.
        if unsafe { libc::ftruncate(self.fd.as_raw_fd(), len_bytes as libc::off_t) } != 0 {
            return Err(Error::no_memory(format!(
                "ftruncate of a memfd to {len_bytes} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(())
    }

    /// Gives the pages of `[offset, offset + len_bytes)` back (`fallocate(PUNCH_HOLE)`): they
    /// read as zeroes after. Offsets and lengths should be page multiples (partial pages are
    /// zeroed, not freed).
    pub fn punch(&self, offset: u64, len_bytes: u64) -> Result<()> {
        if len_bytes == 0 {
            return Ok(());
        }
        // SAFETY: `fd` is open; fallocate has no memory-safety preconditions. Mappings of the
        // range see zeroes afterwards, which is what every caller wants of a released range.
        let rc = unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len_bytes as libc::off_t,
            )
        };
        if rc != 0 {
            return Err(Error::io(format!(
                "punching {len_bytes} bytes at {offset} of a memfd: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(())
    }

    /// Writes `bytes` at `offset` (growing the file if needed).
    pub fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        std::fs::File::from(self.try_clone_fd()?)
            .write_all_at(bytes, offset)
            .map_err(|e| Error::io(format!("writing a memfd: {e}")))
    }

    /// Reads `len_bytes` at `offset` (short if the file ends first).
    pub fn read_at(&self, offset: u64, len_bytes: usize) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::from(self.try_clone_fd()?);
        let mut out = Vec::with_capacity(len_bytes);
        let mut buf = vec![0u8; len_bytes];
        let mut at = offset;
        while out.len() < len_bytes {
            let n = f
                .read_at(&mut buf[..len_bytes - out.len()], at)
                .map_err(|e| Error::io(format!("reading a memfd: {e}")))?;
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
            at += n as u64;
        }
        Ok(out)
    }

    /// Whether `other` is the same file (device and inode), e.g. a descriptor of it handed
    /// over by another process.
    pub fn same_file(&self, other: &ShmFile) -> Result<bool> {
        Ok(self.stat()? == other.stat()?)
    }

    /// The file's device and inode.
    fn stat(&self) -> Result<(u64, u64)> {
        // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open and `st` is a valid, writable `stat`.
        if unsafe { libc::fstat(self.fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::io(format!(
                "fstat of a memfd: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok((st.st_dev, st.st_ino))
    }

    /// Maps `len_bytes` of the file from `offset` (a multiple of the system page size).
    pub fn map(&self, offset: u64, len_bytes: usize) -> Result<ShmMap> {
        ShmMap::new(self.fd.as_fd(), offset, len_bytes)
    }
}

impl AsFd for ShmFile {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A shared mapping of a range of an [`ShmFile`]; unmapped on drop.
#[derive(Debug)]
pub struct ShmMap {
    base: NonNull<u8>,
    len_bytes: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value (unmapped only by its `Drop`);
// what may be read or written through it, and by whom, is decided by its owners' protocols
// (atomics, locks), exactly as for a heap allocation.
unsafe impl Send for ShmMap {}
// SAFETY: as above; `&ShmMap` hands out only the address.
unsafe impl Sync for ShmMap {}

impl ShmMap {
    fn new(fd: BorrowedFd<'_>, offset: u64, len_bytes: usize) -> Result<ShmMap> {
        let len_bytes = len_bytes.max(1);
        // SAFETY: a shared mapping of an open file at an address of the kernel's choosing
        // aliases nothing of ours; the result is checked against MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::no_memory(format!(
                "cannot map {len_bytes} bytes of a memfd at {offset}: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(ShmMap {
            base: NonNull::new(p.cast::<u8>()).expect("mmap never returns null on success"),
            len_bytes,
        })
    }

    /// The mapping's first byte.
    pub fn base(&self) -> NonNull<u8> {
        self.base
    }

    /// The mapping's length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Faults the first `len_bytes` in, writable. Contents never change, and others may use
    /// the range meanwhile through atomics.
    pub fn populate(&self, len_bytes: usize) {
        self.populate_range(0, len_bytes);
    }

    /// As [`populate`](Self::populate), for `[offset, offset + len_bytes)` (clamped to the
    /// mapping; `offset` rounded down to a page).
    ///
    /// Each page is touched with an atomic add of zero to its first byte (a write fault that
    /// changes nothing, whoever else writes the page), not with `MADV_POPULATE_WRITE`: that
    /// holds the process's mmap lock while it waits for memory, and serving swap, the memory
    /// may come only from swap-outs that this process serves (`docs/ublk.md`, "Swap on
    /// ublk"). A page fault waits under the mapping's own (per-VMA) lock only.
    pub fn populate_range(&self, offset: usize, len_bytes: usize) {
        let start = (offset & !4095).min(self.len_bytes);
        let end = offset.saturating_add(len_bytes).min(self.len_bytes);
        for off in (start..end).step_by(4096) {
            // SAFETY: `off < end <= len_bytes`, so the byte lies inside the mapping, which is
            // writable and lives as long as `self`; every access to the shared state is
            // atomic or through it, and an atomic add of zero leaves any value as it is.
            unsafe {
                std::sync::atomic::AtomicU8::from_ptr(self.base.as_ptr().add(off))
                    // `black_box`: an add the compiler knows is of zero it turns into a load
                    // (a read fault, or none at all).
                    .fetch_add(
                        std::hint::black_box(0),
                        std::sync::atomic::Ordering::Relaxed,
                    );
            }
        }
    }
}

#[cfg(test)]
impl ShmMap {
    /// Pages of the first `len_bytes` resident now (`mincore`).
    pub(crate) fn resident_pages(&self, len_bytes: usize) -> usize {
        let len_bytes = len_bytes.min(self.len_bytes);
        let mut vec = vec![0u8; len_bytes.div_ceil(4096)];
        // SAFETY: the range is inside the mapping; `vec` has a byte per page.
        let rc = unsafe { libc::mincore(self.base.as_ptr().cast(), len_bytes, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 != 0).count()
    }
}

impl Drop for ShmMap {
    fn drop(&mut self) {
        // SAFETY: `base`/`len_bytes` describe the mapping made in `new`; its owners borrow it
        // (`&self`), so nothing refers into it any more.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len_bytes) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resident(map: &ShmMap, len: usize) -> usize {
        map.resident_pages(len)
    }

    #[test]
    fn a_second_mapping_sees_the_bytes_and_a_hole_frees_them() {
        let f = ShmFile::create("test").unwrap();
        f.set_len(1 << 20).unwrap();
        let a = f.map(0, 1 << 20).unwrap();
        // SAFETY: inside the fresh mapping, which only this test uses.
        unsafe { a.base().as_ptr().add(8192).write_bytes(7, 8192) };
        let b = ShmFile::from_fd(f.try_clone_fd().unwrap())
            .map(8192, 8192)
            .unwrap();
        // SAFETY: inside `b`, a mapping of the same file written above.
        let seen = unsafe { std::slice::from_raw_parts(b.base().as_ptr(), 8192) };
        assert!(seen.iter().all(|&x| x == 7));
        assert_eq!(resident(&a, 1 << 20), 2);
        f.punch(8192, 4096).unwrap();
        assert_eq!(resident(&a, 1 << 20), 1);
        assert!(seen[..4096].iter().all(|&x| x == 0));
        assert!(seen[4096..].iter().all(|&x| x == 7));
        assert_eq!(f.len().unwrap(), 1 << 20);
    }

    #[test]
    fn populate_range_faults_in_the_pages_it_covers_and_keeps_their_bytes() {
        let f = ShmFile::create("test").unwrap();
        f.set_len(1 << 20).unwrap();
        let m = f.map(0, 1 << 20).unwrap();
        // SAFETY: inside the fresh mapping, which only this test uses.
        unsafe { m.base().as_ptr().add(5 * 4096 + 7).write(9) };
        assert_eq!(resident(&m, 1 << 20), 1);
        // From the middle of page 4 to the middle of page 6: pages 4, 5 and 6.
        m.populate_range(4 * 4096 + 100, 2 * 4096);
        assert_eq!(resident(&m, 1 << 20), 3);
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { m.base().as_ptr().add(5 * 4096 + 7).read() }, 9);
        // Past the end: clamped.
        m.populate_range((1 << 20) - 4096, 1 << 30);
        assert_eq!(resident(&m, 1 << 20), 4);
        m.populate(2 * 4096);
        assert_eq!(resident(&m, 1 << 20), 6);
    }
}
