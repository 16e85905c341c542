//! [`AlignedBuf`]: an owned heap buffer aligned for direct I/O.
//!
//! # Contract
//!
//! - The memory starts on a [`BUF_ALIGN_BYTES`] (4096) boundary and its length is a non-zero
//!   multiple of [`SECTOR_SIZE_BYTES`] (512), so it satisfies `O_DIRECT`'s memory alignment on every
//!   device we know (logical blocks of 512 or 4096 bytes) and can be handed to the kernel as is.
//! - The buffer owns its memory exclusively (like a `Box<[u8]>`): it is `Send` and `Sync`, it
//!   dereferences to `[u8]`, and it frees the memory exactly once, in `Drop`.
//! - Moving an `AlignedBuf` does not move its bytes: a pointer taken from it (an iovec handed to
//!   io_uring) stays valid for as long as the `AlignedBuf` itself is alive, wherever it is moved.
//!   The queues rely on this: an op owns its buffers until its completion is reaped.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::units::{BLOCK_SIZE_BYTES, SECTOR_SIZE_BYTES};

/// The alignment of every buffer: one 4 KiB block. Direct I/O needs at most the device's
/// logical block size (512 or 4096) in memory; a block satisfies both, and it is the backing's
/// unit.
pub const BUF_ALIGN_BYTES: usize = BLOCK_SIZE_BYTES;

/// An owned, zero-initialised, 4096-aligned byte buffer whose length is a multiple of 512.
pub struct AlignedBuf {
    /// Start of the allocation, aligned to [`BUF_ALIGN_BYTES`]; owned by this value.
    ptr: NonNull<u8>,
    /// Length in bytes: non-zero, a multiple of [`SECTOR_SIZE_BYTES`]; the allocation's size.
    len: usize,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively (no aliasing pointers escape except
// through `&self`/`&mut self` borrows), exactly like `Box<[u8]>`, which is `Send`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`; mutation needs `&mut self`. Same as `Box<[u8]>`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zero-filled buffer of `len_bytes` (a non-zero multiple of 512).
    ///
    /// Fails with `InvalidArgument` for a bad length and `NoMemory` when the allocation fails.
    pub fn new_zeroed(len_bytes: usize) -> Result<AlignedBuf> {
        let layout = Self::layout(len_bytes)?;
        // SAFETY: `layout` has a non-zero size (checked by `layout`), as `alloc_zeroed` requires.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::no_memory(format!("cannot allocate a {len_bytes}-byte I/O buffer"))
        })?;
        Ok(AlignedBuf {
            ptr,
            len: len_bytes,
        })
    }

    /// A buffer holding a copy of `data` (its length a non-zero multiple of 512).
    pub fn from_slice(data: &[u8]) -> Result<AlignedBuf> {
        let mut buf = AlignedBuf::new_zeroed(data.len())?;
        buf.copy_from_slice(data);
        Ok(buf)
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer is never empty (kept for clippy's `len_without_is_empty`).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start of the buffer, for handing to the kernel. Valid while `self` is alive.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The start of the buffer, for the kernel to write into (reads). Valid while `self` is
    /// alive; derived from the allocation itself, not from a shared borrow.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn layout(len_bytes: usize) -> Result<Layout> {
        if len_bytes == 0 || len_bytes % SECTOR_SIZE_BYTES != 0 {
            return Err(Error::invalid(format!(
                "I/O buffer length {len_bytes} is not a non-zero multiple of {SECTOR_SIZE_BYTES}"
            )));
        }
        Layout::from_size_align(len_bytes, BUF_ALIGN_BYTES)
            .map_err(|_| Error::invalid(format!("I/O buffer length {len_bytes} is too large")))
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes (allocated zeroed) owned by `self`;
        // the returned borrow is tied to `&self`, so the memory outlives it and is not mutated
        // meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` guarantees this is the only live borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // `layout` succeeded for this length when the buffer was made.
        let layout = Layout::from_size_align(self.len, BUF_ALIGN_BYTES)
            .expect("layout was valid at allocation");
        // SAFETY: `ptr` came from `alloc_zeroed` with this same layout and is freed only here,
        // once; nothing borrows the buffer during `drop`.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> AlignedBuf {
        AlignedBuf::from_slice(self).expect("cloning an I/O buffer: out of memory")
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl PartialEq for AlignedBuf {
    fn eq(&self, other: &AlignedBuf) -> bool {
        self[..] == other[..]
    }
}

impl Eq for AlignedBuf {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn aligned_and_zeroed() {
        for len in [512, 4096, 8192 + 512, 1 << 20] {
            let buf = AlignedBuf::new_zeroed(len).unwrap();
            assert_eq!(buf.len(), len);
            assert_eq!(buf.as_ptr() as usize % BUF_ALIGN_BYTES, 0);
            assert!(buf.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn bad_lengths_rejected() {
        for len in [0, 1, 511, 4095] {
            let err = AlignedBuf::new_zeroed(len).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        }
    }

    #[test]
    fn copy_and_mutate_and_move() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let mut buf = AlignedBuf::from_slice(&data).unwrap();
        let ptr = buf.as_ptr();
        buf[0] = 0xAA;
        let moved = [buf];
        // Moving the owner does not move the bytes.
        assert_eq!(moved[0].as_ptr(), ptr);
        assert_eq!(moved[0][0], 0xAA);
        assert_eq!(moved[0][1..], data[1..]);
        assert_eq!(moved[0].clone(), moved[0]);
    }
}
