//! [`ReqBuf`]: a request or reply buffer of anonymous memory, never zero-filled by us.
//!
//! # Contract
//!
//! - The memory is a private anonymous mapping of `capacity` bytes (a whole number of pages)
//!   owned by this value alone, unmapped exactly once, in `Drop`. Unmapping returns its pages
//!   to the kernel at once, whatever the C allocator's thresholds (glibc keeps freed blocks of
//!   up to 32 MiB in its arenas once it has seen one that size, which is how a server that once
//!   served large requests kept hundreds of MiB after its clients left).
//! - Every byte of the mapping is initialised: the kernel maps fresh anonymous memory as
//!   zeroes (lazily: a page becomes resident when first written), and we only ever write it.
//!   So the whole capacity may be handed out as `&mut [u8]` without filling it first, and a
//!   payload takes resident memory only as its bytes arrive.
//! - `len` (≤ `capacity`) is the part that holds data; `Deref` shows only that part. A reused
//!   buffer keeps earlier bytes past `len`; they are never sent, since a reply is built from
//!   bytes written for it.

use std::fmt;
use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The unit of mapping sizes.
const PAGE_BYTES: usize = 4096;

/// An owned buffer of anonymous memory; see the module documentation.
pub struct ReqBuf {
    /// Start of the mapping; owned by this value.
    ptr: NonNull<u8>,
    /// Size of the mapping: a non-zero multiple of [`PAGE_BYTES`].
    capacity: usize,
    /// Bytes holding data: `len <= capacity`.
    len: usize,
}

// SAFETY: `ReqBuf` owns its mapping exclusively, as `Box<[u8]>` owns its allocation.
unsafe impl Send for ReqBuf {}
// SAFETY: shared access only hands out `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for ReqBuf {}

impl ReqBuf {
    /// A buffer of at least `capacity` bytes (rounded up to pages), with `len` 0.
    pub fn with_capacity(capacity: usize) -> io::Result<ReqBuf> {
        let capacity = capacity.max(1).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        // SAFETY: a new private anonymous mapping: no address hint, no file; the kernel picks
        // a free range, so nothing existing is replaced.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                capacity,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(ReqBuf {
            ptr,
            capacity,
            len: 0,
        })
    }

    /// The mapping's size.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The bytes holding data.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no bytes hold data.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets the length of the data part (bytes past the old length keep whatever they hold:
    /// zeroes, or an earlier request's bytes, which the caller overwrites).
    ///
    /// # Panics
    /// If `len` exceeds the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity, "{len} > capacity {}", self.capacity);
        self.len = len;
    }

    /// The whole mapping, to fill; every byte is initialised (see the module documentation).
    pub fn whole_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `capacity` bytes, owned by `self` (exclusively borrowed here),
        // and every byte is initialised (zeroes from the kernel or bytes we wrote).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity) }
    }
}

impl Deref for ReqBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len <= capacity`, the bytes are initialised and owned by `self`, borrowed
        // shared for the slice's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for ReqBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.whole_mut()[..len]
    }
}

impl Drop for ReqBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`capacity` are exactly the mapping made in `with_capacity`, unmapped
        // only here, once; no borrow of it outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.capacity) };
    }
}

impl fmt::Debug for ReqBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReqBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_buffer_is_zero_and_grows_only_as_written() {
        let mut b = ReqBuf::with_capacity(100).unwrap();
        assert_eq!(b.capacity(), 4096);
        assert!(b.is_empty());
        assert!(b.whole_mut().iter().all(|&x| x == 0));
        b.whole_mut()[..3].copy_from_slice(b"abc");
        b.set_len(3);
        assert_eq!(&b[..], b"abc");
        b[0] = b'x';
        assert_eq!(&b[..], b"xbc");
    }
}
