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
//! Levels: the kernel's lz4 backend reads `level` as LZ4's *acceleration* (`LZ4_compress_fast`:
//! 1, the default, compresses best; higher trades ratio for speed, up to liblz4's
//! `LZ4_ACCELERATION_MAX`, 65537). uzram does the same: no level or level 1 is `lz4_flex`'s
//! encoder (LZ4's default acceleration), a higher level is liblz4's `LZ4_compress_fast` with
//! that acceleration (through the `lz4` crate, as lz4hc; it keeps its state on the stack).
//! Both write the same block format, so decompression is the same. Levels below 1 or above
//! 65537 are `EINVAL` (liblz4 would silently replace them).
//!
//! Dictionaries: not supported (`EOPNOTSUPP`): `lz4_flex` would rebuild its hash table from
//! the dictionary on every page.

use super::{check_dst, Codec, CodecParams};
use crate::error::{Error, Result};

/// The name in `comp_algorithm`.
pub(super) const NAME: &str = "lz4";

/// liblz4's `LZ4_ACCELERATION_MAX`.
pub const MAX_ACCELERATION: i32 = 65537;

/// LZ4 block compression: `lz4_flex` (safe Rust) at the default acceleration, liblz4's
/// `LZ4_compress_fast` at a higher one.
#[derive(Debug, Clone, Copy)]
pub struct Lz4 {
    /// The acceleration (`level`), 1 = LZ4's default.
    acceleration: i32,
}

impl Lz4 {
    /// Creates the codec; `level` is the acceleration, 1..=65537 (default 1), `EINVAL`
    /// otherwise; a dictionary is `EOPNOTSUPP`.
    pub fn new(params: CodecParams) -> Result<Lz4> {
        super::refuse_dict(NAME, &params)?;
        let acceleration = params.level.unwrap_or(1);
        if !(1..=MAX_ACCELERATION).contains(&acceleration) {
            return Err(Error::invalid(format!(
                "lz4: level (acceleration) {acceleration} outside 1..={MAX_ACCELERATION}"
            )));
        }
        Ok(Lz4 { acceleration })
    }

    /// The acceleration in use.
    pub fn acceleration(&self) -> i32 {
        self.acceleration
    }
}

impl Codec for Lz4 {
    fn name(&self) -> &'static str {
        NAME
    }

    fn compress(&self, src: &[u8], dst: &mut [u8]) -> Result<usize> {
        check_dst(src.len(), dst)?;
        if self.acceleration == 1 {
            lz4_flex::block::compress_into(src, dst)
                .map_err(|e| Error::io(format!("lz4 compress: {e}")))
        } else {
            lz4::block::compress_to_buffer(
                src,
                Some(lz4::block::CompressionMode::FAST(self.acceleration)),
                false,
                dst,
            )
            .map_err(|e| Error::io(format!("lz4 compress: {e}")))
        }
    }

    fn decompress(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        decompress_block(NAME, src, dst)
    }

    fn decompress_prefix(&self, src: &[u8], dst: &mut [u8], prefix_bytes: usize) -> Result<usize> {
        decompress_block_prefix(NAME, src, dst, prefix_bytes)
    }
}

// liblz4's partial decoder (lz4.h, "LZ4_decompress_safe_partial"), in the liblz4 that `lz4-sys`
// builds and links (the `lz4` crate's block functions use it) but does not declare.
extern "C" {
    fn LZ4_decompress_safe_partial(
        src: *const std::ffi::c_char,
        dst: *mut std::ffi::c_char,
        src_size: std::ffi::c_int,
        target_output_size: std::ffi::c_int,
        dst_capacity: std::ffi::c_int,
    ) -> std::ffi::c_int;
}

/// Decodes one LZ4 block until at least `prefix_bytes` of its output are in `dst` (LZ4 stops
/// at the end of the sequence that passes them) and returns how many are. Asking for the
/// whole of `dst` is [`decompress_block`]. Shared with `lz4hc`.
pub(super) fn decompress_block_prefix(
    name: &str,
    src: &[u8],
    dst: &mut [u8],
    prefix_bytes: usize,
) -> Result<usize> {
    if prefix_bytes >= dst.len() {
        return decompress_block(name, src, dst).map(|()| dst.len());
    }
    let int = |n: usize| {
        std::ffi::c_int::try_from(n).map_err(|_| Error::io(format!("{name}: {n} bytes")))
    };
    let (src_size, capacity) = (int(src.len())?, int(dst.len())?);
    // SAFETY: liblz4 reads at most `src_size` bytes from `src` and writes at most `capacity`
    // bytes to `dst`, whatever the input holds ("safe" decoder: malformed input is a negative
    // return, never an access out of those bounds); both slices are that long and live for
    // the call; the function keeps no pointer after it returns.
    let n = unsafe {
        LZ4_decompress_safe_partial(
            src.as_ptr().cast(),
            dst.as_mut_ptr().cast(),
            src_size,
            int(prefix_bytes)?,
            capacity,
        )
    };
    match usize::try_from(n) {
        Ok(n) if n >= prefix_bytes && n <= dst.len() => Ok(n),
        _ => Err(Error::io(format!(
            "{name} decompress: {n} bytes of a {prefix_bytes}-byte prefix"
        ))),
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
