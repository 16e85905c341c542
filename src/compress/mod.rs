//! Compression backends (zram's `zcomp`): one file per algorithm behind the [`Codec`] trait,
//! plus same-filled page detection.
//!
//! Contract of every codec:
//! - `compress` and `decompress` take `&self` and are called from many threads at once; any
//!   per-call state (a zstd context, an lz4 hash table) lives in per-thread scratch that is
//!   created once per thread and reused, so the hot path allocates nothing per page.
//! - `compress` writes into `dst`, which is at least [`compress_bound`]`(src.len())` bytes, and
//!   returns the compressed length. The caller decides what counts as incompressible (the huge
//!   threshold); the codec never refuses a page.
//! - `decompress` must fill `dst` exactly (`dst.len()` is the page size); any other outcome
//!   (corrupt input, short output) is an [`ErrorKind::Io`](crate::ErrorKind::Io) error, never
//!   partially-filled data passed off as success.

use crate::error::Result;

/// A compression algorithm as zram's `comp_algorithm` names it.
pub trait Codec: Send + Sync + std::fmt::Debug {
    /// The name shown in `comp_algorithm` (`lz4`, `lz4hc`, `zstd`, `deflate`).
    fn name(&self) -> &'static str;
    /// Compresses `src` into `dst` (at least `compress_bound(src.len())` bytes long) and returns
    /// the compressed length.
    fn compress(&self, src: &[u8], dst: &mut [u8]) -> Result<usize>;
    /// Decompresses `src` into exactly `dst.len()` bytes, or fails with `ErrorKind::Io`.
    fn decompress(&self, src: &[u8], dst: &mut [u8]) -> Result<()>;
}

/// Parameters set through `algorithm_params` (`level=N`); `None` means the algorithm's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CodecParams {
    /// Compression level (zstd, deflate, lz4hc).
    pub level: Option<i32>,
}
