//! lz4 in the LZ4 *block* format (no frame header, no checksum), through `lz4_flex`'s safe
//! encoder and decoder: zram's `lz4` backend.
//!
//! The block format carries no length: the page size is the caller's `dst.len()`, and
//! decompression that does not produce exactly that many bytes is an `EIO` error.
//!
//! Known allocation: `lz4_flex` 0.11's block API has no way to pass in a caller-owned hash
//! table, so `lz4_flex::block::compress_into` allocates a zeroed 8 KiB table (16 KiB for inputs
//! of 64 KiB and more) per call. A reused table would have to be zeroed per page as well, so the
//! extra cost is the allocator call itself (not measured separately; `bench/README.md` has the
//! codec's throughput with it). The counting-allocator test in `tests/compress_alloc.rs` pins it
//! at exactly one allocation per call so a change is noticed.
//! Decompression allocates nothing.
//!
//! Levels: the kernel's lz4 backend reads `level` as LZ4's acceleration factor; `lz4_flex` has
//! no acceleration setting, so only the default (`level=1`, or no level) is accepted.

use super::{check_dst, Codec, CodecParams};
use crate::error::{Error, Result};

/// The name in `comp_algorithm`.
pub(super) const NAME: &str = "lz4";

/// LZ4 block compression (`lz4_flex`, safe Rust).
#[derive(Debug, Clone, Copy)]
pub struct Lz4;

impl Lz4 {
    /// Creates the codec. Any level other than LZ4's default acceleration (1) is `EINVAL`.
    pub fn new(params: CodecParams) -> Result<Lz4> {
        match params.level {
            None | Some(1) => Ok(Lz4),
            Some(level) => Err(Error::invalid(format!(
                "lz4: level {level} not supported (lz4_flex has no acceleration setting; only 1)"
            ))),
        }
    }
}

impl Codec for Lz4 {
    fn name(&self) -> &'static str {
        NAME
    }

    fn compress(&self, src: &[u8], dst: &mut [u8]) -> Result<usize> {
        check_dst(src.len(), dst)?;
        lz4_flex::block::compress_into(src, dst)
            .map_err(|e| Error::io(format!("lz4 compress: {e}")))
    }

    fn decompress(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        decompress_block(NAME, src, dst)
    }
}

/// Decodes one LZ4 block into exactly `dst.len()` bytes. Shared with `lz4hc`, whose output is
/// the same block format. The safe decoder bounds-checks every literal and match copy, so
/// corrupt input is an error, never a panic or an out-of-bounds access.
pub(super) fn decompress_block(name: &str, src: &[u8], dst: &mut [u8]) -> Result<()> {
    match lz4_flex::block::decompress_into(src, dst) {
        Ok(n) if n == dst.len() => Ok(()),
        Ok(n) => Err(Error::io(format!(
            "{name}: decompressed {n} bytes, expected {}",
            dst.len()
        ))),
        Err(e) => Err(Error::io(format!("{name} decompress: {e}"))),
    }
}
