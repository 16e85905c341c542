//! uzram: a compressed-RAM block device in userspace.
//!
//! The design of Linux zram (a compressed-RAM block device) and zsmalloc (its allocator), with
//! batched asynchronous writeback, low-latency deferred freeing and an append-only backing store.
//! The layers, top to bottom (calls only go down: device → writeback → store → {slot,
//! zsmalloc, compress, writeback target → backing}):
//!
//! - [`device`]: the [`Device`](device::Device): settings, the init lock, attributes with
//!   zram's names, request validation and splitting into pages, statistics' formats.
//! - [`writeback`]: moving idle or huge pages to a backing device in batches: the batched
//!   engine and its two placements, the limit.
//! - [`recompress`]: recompressing idle or huge pages with a second codec (`recompress`).
//! - [`pp`]: post-processing (zram's `zram_pp_ctl`): the candidate scan writeback and
//!   recompression share.
//! - [`store`]: an initialised device's pages: every slot-state change (write, read,
//!   read-back, release, idle, writeback's steps, GC's re-pointing), the counters, and the
//!   writeback target (the bitmap store or the [`zoned`] store).
//! - [`slot`]: the table of packed 16-byte slot entries and their per-slot locks.
//! - [`compress`]: the [`Codec`](compress::Codec) trait and one file per algorithm.
//! - [`zsmalloc`]: the allocator for compressed objects: size classes, zspages, handles,
//!   compaction, deferred free.
//! - [`zoned`]: the append-only backing store with GC; [`backing`]: the backing devices
//!   themselves.
//!
//! - [`shm`]: memfd files and their shared mappings, where a device's state outlives the
//!   process (`docs/restart.md`).
//! - [`memory`]: whether this process serves swap (faulting memory in ahead of need).
//!
//! This crate is the engine. The service (the `uzram-service` crate: frontends, policies,
//! configuration, the device registry) and the `uzram` command sit above it and talk to
//! devices through one narrow trait, [`BlockDevice`], and their attributes.

pub mod backing;
pub mod clock;
pub mod compress;
pub mod device;
pub mod error;
pub mod memory;
pub mod pp;
pub mod recompress;
pub mod scm;
pub mod shm;
pub mod slot;
pub mod store;
pub mod units;
pub mod writeback;
pub mod zoned;
pub mod zsmalloc;

pub use error::{Error, ErrorKind, Result};

/// What a range of a device holds, as block status reports it (NBD's `base:allocation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// Nothing stored: never written, discarded, or zeroed whole (reads as zeroes).
    Hole,
    /// A same-filled page of zero bytes (reads as zeroes; takes a slot and no object).
    Zero,
    /// Anything else: an object in RAM, a written-back page, a page filled with another word.
    Data,
}

/// A run of bytes of one [`Allocation`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// The run's length.
    pub len_bytes: u64,
    /// What it holds.
    pub allocation: Allocation,
}

/// The narrow interface every frontend (NBD, ublk, vhost-user-blk, the CLI) uses.
///
/// Offsets and lengths are in bytes and must be multiples of 512 (a sector), except in the
/// `*_bytes*` methods, which take any; requests smaller than a page are handled by the device
/// with read-modify-write. All methods take `&self` and may be called from many threads at
/// once. A failed request changes nothing.
pub trait BlockDevice: Send + Sync {
    /// The exported size in bytes (zram's `disksize`).
    fn size_bytes(&self) -> u64;
    /// The device's page size: the preferred I/O size.
    fn page_size_bytes(&self) -> usize;
    /// Reads `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// Writes `buf` at `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()>;
    /// Releases the whole pages inside `[offset, offset + len)` (TRIM). Partial pages at either
    /// end are left as they are, as zram does: their contents are unspecified to the caller but
    /// in practice unchanged.
    fn discard(&self, offset: u64, len: u64) -> Result<()>;
    /// Makes `[offset, offset + len)` read back as zeroes, freeing whole pages.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()>;
    /// Makes completed writes durable. Without a backing device there is nothing to do.
    fn flush(&self) -> Result<()>;
    /// [`read_at`](Self::read_at) at any byte offset and length (an NBD client that negotiated
    /// no block size may send them).
    fn read_bytes_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// [`write_at`](Self::write_at) at any byte offset and length: a partial page is read,
    /// patched and stored again under its slot lock, as zram's partial I/O, so writes to
    /// different bytes of one page never lose each other's.
    fn write_bytes_at(&self, buf: &[u8], offset: u64) -> Result<()>;
    /// [`write_zeroes`](Self::write_zeroes) at any byte offset and length.
    fn write_zeroes_bytes(&self, offset: u64, len: u64) -> Result<()>;
    /// What `[offset, offset + len)` (any bytes, inside the device, `len` > 0) holds, page by
    /// page, into `out` (cleared first): the first run starts at `offset`, each next run where
    /// the allocation changes; at most `max_extents` runs (at least 1), which then cover less
    /// than `len`. A page reported [`Hole`](Allocation::Hole) or [`Zero`](Allocation::Zero)
    /// read so under its slot lock; a page written concurrently may be reported either way.
    fn allocation(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> Result<()>;
}
