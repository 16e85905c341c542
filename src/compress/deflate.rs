//! deflate: raw deflate streams (RFC 1951, no zlib or gzip wrapper), like the kernel's
//! `deflate` backend, through `flate2` with its pure-Rust `miniz_oxide` backend.
//!
//! State: one `Decompress` and one `Compress` per level per thread, in the
//! [`context`](super::context) caches (the rust backend cannot change a compressor's level
//! after creation); every call starts with `reset()`, which clears the stream without freeing
//! its buffers, so after warm-up neither direction allocates.
//!
//! Levels 0..=9 (0 = stored blocks only), default 6 (zlib's `Z_DEFAULT_COMPRESSION`).

use super::context::{with_context, ContextCache, NO_LEVEL};
use super::{check_dst, Codec, CodecParams};
use crate::error::{Error, Result};
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use std::cell::RefCell;

/// The name in `comp_algorithm`.
pub(super) const NAME: &str = "deflate";

/// zlib's default level.
pub const DEFAULT_LEVEL: i32 = 6;
const MAX_LEVEL: i32 = 9;

/// Worst-case raw deflate output for `src_len` input bytes: deflate falls back to stored
/// blocks (5 header bytes per at most 65535 input bytes) when Huffman coding would expand the
/// data; zlib's `deflateBound` for a raw stream is `src_len + src_len/4096 + src_len/16384 +
/// src_len/2^25 + 7` plus block overhead. We take `src_len + src_len/64 + 64`: above both, and
/// leaving room for miniz_oxide ending a stream with a static block and bit padding.
pub(super) fn bound(src_len: usize) -> usize {
    src_len + src_len / 64 + 64
}

thread_local! {
    /// This thread's compressors, one per level used.
    static COMPRESSORS: RefCell<ContextCache<Compress>> = const { RefCell::new(ContextCache::new()) };
    /// This thread's decompressor (decompression has no level).
    static DECOMPRESSORS: RefCell<ContextCache<Decompress>> =
        const { RefCell::new(ContextCache::new()) };
}

/// Raw deflate at a fixed level.
#[derive(Debug, Clone, Copy)]
pub struct Deflate {
    level: i32,
}

impl Deflate {
    /// Creates the codec; a level outside 0..=9 is `EINVAL`.
    pub fn new(params: CodecParams) -> Result<Deflate> {
        super::refuse_dict(NAME, &params)?;
        let level = params.level.unwrap_or(DEFAULT_LEVEL);
        if !(0..=MAX_LEVEL).contains(&level) {
            return Err(Error::invalid(format!(
                "deflate: level {level} outside 0..={MAX_LEVEL}"
            )));
        }
        Ok(Deflate { level })
    }

    /// The compression level in use.
    pub fn level(&self) -> i32 {
        self.level
    }
}

impl Codec for Deflate {
    fn name(&self) -> &'static str {
        NAME
    }

    fn compress(&self, src: &[u8], dst: &mut [u8]) -> Result<usize> {
        check_dst(src.len(), dst)?;
        // The level was validated in `new`, so the cast cannot lose information.
        let create = || Ok(Compress::new(Compression::new(self.level as u32), false));
        with_context(&COMPRESSORS, self.level, create, |c| {
            c.reset();
            match c.compress(src, dst, FlushCompress::Finish) {
                Ok(Status::StreamEnd) => usize::try_from(c.total_out())
                    .map_err(|_| Error::io("deflate: output length overflow")),
                Ok(status) => Err(Error::io(format!(
                    "deflate compress: stream not finished ({status:?}); output buffer too small"
                ))),
                Err(e) => Err(Error::io(format!("deflate compress: {e}"))),
            }
        })
    }

    fn decompress(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        let create = || Ok(Decompress::new(false));
        with_context(&DECOMPRESSORS, NO_LEVEL, create, |d| {
            d.reset(false);
            match d.decompress(src, dst, FlushDecompress::Finish) {
                Ok(Status::StreamEnd) if d.total_out() == dst.len() as u64 => Ok(()),
                Ok(Status::StreamEnd) => Err(Error::io(format!(
                    "deflate: decompressed {} bytes, expected {}",
                    d.total_out(),
                    dst.len()
                ))),
                // Output full before the end of the stream (too long), or input exhausted
                // before it (truncated).
                Ok(status) => Err(Error::io(format!(
                    "deflate decompress: stream did not end within {} bytes ({status:?})",
                    dst.len()
                ))),
                Err(e) => Err(Error::io(format!("deflate decompress: {e}"))),
            }
        })
    }
}
