//! lz4hc: LZ4's high-compression encoder (liblz4's `LZ4_compress_HC`, through the `lz4` crate's
//! block API), producing the same LZ4 block format as [`lz4`](super::lz4): decompression is
//! shared with it (liblz4's `LZ4_decompress_safe`).
//!
//! Levels 1..=12 (liblz4's `LZ4HC_CLEVEL_MAX`), default 9 (`LZ4HC_CLEVEL_DEFAULT`, the kernel's
//! default too).
//!
//! Known allocation: `LZ4_compress_HC` allocates its ~256 KiB state with C `malloc` and zeroes
//! it on every call (liblz4 is built with `LZ4HC_HEAPMODE=1`); the `lz4` crate exposes no
//! external-state variant. That is invisible to Rust's allocator but costs a memset per page.
//! lz4hc is a recompression (secondary) codec in zram, not the write path, so the safe API is
//! kept; `bench/notes.md` has the measured throughput.

use super::{check_dst, Codec, CodecParams};
use crate::error::{Error, Result};
use lz4::block::CompressionMode;

/// The name in `comp_algorithm`.
pub(super) const NAME: &str = "lz4hc";

/// liblz4's `LZ4HC_CLEVEL_DEFAULT`.
pub const DEFAULT_LEVEL: i32 = 9;
/// liblz4's `LZ4HC_CLEVEL_MIN`; below it liblz4 silently uses the default.
const MIN_LEVEL: i32 = 1;
/// liblz4's `LZ4HC_CLEVEL_MAX`; above it liblz4 silently clamps.
const MAX_LEVEL: i32 = 12;

/// LZ4 high-compression block encoder.
#[derive(Debug, Clone, Copy)]
pub struct Lz4Hc {
    level: i32,
}

impl Lz4Hc {
    /// Creates the codec; a level outside 1..=12 is `EINVAL`.
    pub fn new(params: CodecParams) -> Result<Lz4Hc> {
        super::refuse_dict(NAME, &params)?;
        let level = params.level.unwrap_or(DEFAULT_LEVEL);
        if !(MIN_LEVEL..=MAX_LEVEL).contains(&level) {
            return Err(Error::invalid(format!(
                "lz4hc: level {level} outside {MIN_LEVEL}..={MAX_LEVEL}"
            )));
        }
        Ok(Lz4Hc { level })
    }

    /// The compression level in use.
    pub fn level(&self) -> i32 {
        self.level
    }
}

impl Codec for Lz4Hc {
    fn name(&self) -> &'static str {
        NAME
    }

    fn compress(&self, src: &[u8], dst: &mut [u8]) -> Result<usize> {
        check_dst(src.len(), dst)?;
        lz4::block::compress_to_buffer(
            src,
            Some(CompressionMode::HIGHCOMPRESSION(self.level)),
            false,
            dst,
        )
        .map_err(|e| Error::io(format!("lz4hc compress: {e}")))
    }

    fn decompress(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        super::lz4::decompress_block(NAME, src, dst)
    }

    fn decompress_prefix(&self, src: &[u8], dst: &mut [u8], prefix_bytes: usize) -> Result<usize> {
        super::lz4::decompress_block_prefix(NAME, src, dst, prefix_bytes)
    }
}
