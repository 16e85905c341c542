//! [`FileFds`]: the descriptors of one backing file and the rule choosing between them, owned
//! by [`FileBacking`](super::FileBacking) and borrowed by its io_uring queue
//! ([`UringQueue`](super::UringQueue)), so neither needs the other.
//!
//! Two descriptors of the same file: `buffered` (always) and `direct` (`O_DIRECT`, when the
//! file system takes it). A request whose offset, length and memory are aligned to the
//! direct-I/O alignment goes through `direct`; anything else through `buffered` (the file
//! engine bounces memory-only misalignment through an aligned buffer first, see
//! [`can_bounce`](FileFds::can_bounce)). Linux keeps the two coherent for
//! non-overlapping-in-time requests: a direct read first writes back dirty cached pages of its
//! range, a direct write invalidates them.

use std::fs::File;

use super::BUF_ALIGN_BYTES;

/// The descriptors of a backing file. See the module docs.
#[derive(Debug)]
pub(crate) struct FileFds {
    /// Always open, read-write, through the page cache.
    buffered: File,
    /// Open with `O_DIRECT` when direct I/O is in use.
    direct: Option<File>,
    /// Memory, offset and length alignment of direct I/O (a power of two; 1 when not direct).
    dio_align_bytes: usize,
}

impl FileFds {
    /// `buffered`, and `direct` with its alignment when direct I/O is in use.
    pub(crate) fn new(buffered: File, direct: Option<(File, usize)>) -> FileFds {
        let (direct, dio_align_bytes) = match direct {
            Some((file, align)) => (Some(file), align),
            None => (None, 1),
        };
        FileFds {
            buffered,
            direct,
            dio_align_bytes,
        }
    }

    /// The page-cache descriptor (also for `fsync` and the block-device ioctls).
    pub(crate) fn buffered(&self) -> &File {
        &self.buffered
    }

    /// The `O_DIRECT` descriptor, when direct I/O is in use.
    pub(crate) fn direct(&self) -> Option<&File> {
        self.direct.as_ref()
    }

    /// The alignment direct I/O needs (offset, length and memory); 1 when buffered.
    pub(crate) fn dio_align_bytes(&self) -> usize {
        self.dio_align_bytes
    }

    /// The descriptor for a request at `offset` whose memory is `parts` (each buffer's address
    /// and length): `direct` when the offset and every part are aligned for direct I/O,
    /// `buffered` otherwise.
    pub(crate) fn fd_for(
        &self,
        offset: u64,
        mut parts: impl Iterator<Item = (usize, usize)>,
    ) -> &File {
        match &self.direct {
            Some(direct)
                if offset % self.dio_align_bytes as u64 == 0
                    && parts.all(|(addr, len)| self.is_dio_aligned(addr, len)) =>
            {
                direct
            }
            _ => &self.buffered,
        }
    }

    /// Whether `fd` is the page-cache descriptor.
    pub(crate) fn is_buffered(&self, fd: &File) -> bool {
        std::ptr::eq(fd, &self.buffered)
    }

    fn is_dio_aligned(&self, addr: usize, len: usize) -> bool {
        addr % self.dio_align_bytes == 0 && len % self.dio_align_bytes == 0
    }

    /// Whether a request of this offset and length could go direct with a bounce buffer (its
    /// memory is what is misaligned).
    pub(crate) fn can_bounce(&self, offset: u64, len_bytes: u64) -> bool {
        self.direct.is_some()
            && self.dio_align_bytes <= BUF_ALIGN_BYTES
            && offset % self.dio_align_bytes as u64 == 0
            && len_bytes % self.dio_align_bytes as u64 == 0
    }
}
