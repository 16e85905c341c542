//! lz4 in the LZ4 *block* format (no frame header, no checksum): zram's `lz4` backend, through
//! liblz4 (the reference C library, the `lz4` crate's safe block API over `lz4-sys`).
//!
//! The block format carries no length: the page size is the caller's `dst.len()`, and
//! decompression that does not produce exactly that many bytes is an `EIO` error.
//!
//! # Why liblz4 and not `lz4_flex`
//!
//! Measured side by side on the page corpus (`uzram bench store` prints the table "lz4
//! implementations"; figures in `bench/notes.md`): liblz4's `LZ4_compress_fast` compresses the
//! corpus's pages faster than `lz4_flex` 0.11 with its safe encoder (which also allocates and
//! zeroes an 8 KiB hash table per call: its block API takes no caller-owned table), and
//! `LZ4_decompress_safe` decodes them faster than `lz4_flex`'s safe decoder. Both write the same
//! block format, so pages written by either read back through the other (tested).
//!
//! Safety, argued: no `unsafe` is written here; the `lz4` crate's block functions pass each
//! slice's pointer with its own length. `LZ4_compress_fast` writes at most `dstCapacity` bytes
//! (we always pass at least `LZ4_compressBound`: [`check_dst`]) and reads exactly `srcSize`.
//! `LZ4_decompress_safe` is liblz4's decoder for untrusted input: it "will never write outside
//! `dst`, nor read outside `source`" (lz4.h), whatever the bytes (it is fuzzed by OSS-Fuzz);
//! corrupt input is a negative return, mapped to `EIO`. The per-call state (a 16 KiB hash table)
//! lives on the C stack (liblz4 is built with `LZ4_HEAPMODE=0`) and is cleared per call; the
//! fast-reset variant (`LZ4_compress_fast_extState_fastReset`, a caller-kept state) clears it
//! too for inputs of 4 KiB or more (`LZ4_prepareTable`), so it would save nothing for pages.
//! Nothing is allocated per call.
//!
//! Levels: the kernel's lz4 backend reads `level` as LZ4's *acceleration* (`LZ4_compress_fast`:
//! 1, the default, compresses best; higher trades ratio for speed, up to liblz4's
//! `LZ4_ACCELERATION_MAX`, 65537). uzram does the same. Levels below 1 or above 65537 are
//! `EINVAL` (liblz4 would silently replace them).
//!
//! Dictionaries: not supported (`EOPNOTSUPP`), as the kernel's lz4 backend before 6.12.

use super::{check_dst, Codec, CodecParams};
use crate::error::{Error, Result};

/// The name in `comp_algorithm`.
pub(super) const NAME: &str = "lz4";

/// liblz4's `LZ4_ACCELERATION_MAX`.
pub const MAX_ACCELERATION: i32 = 65537;

/// LZ4 block compression: liblz4's `LZ4_compress_fast` with the acceleration.
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
        lz4::block::compress_to_buffer(
            src,
            Some(lz4::block::CompressionMode::FAST(self.acceleration)),
            false,
            dst,
        )
        .map_err(|e| Error::io(format!("lz4 compress: {e}")))
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

/// Decodes one LZ4 block into exactly `dst.len()` bytes with liblz4's `LZ4_decompress_safe`.
/// Shared with `lz4hc`, whose output is the same block format. Corrupt input is an error, never
/// an out-of-bounds access (see the module docs).
pub(super) fn decompress_block(name: &str, src: &[u8], dst: &mut [u8]) -> Result<()> {
    let want = i32::try_from(dst.len())
        .map_err(|_| Error::invalid(format!("{name}: page of {} bytes", dst.len())))?;
    match lz4::block::decompress_to_buffer(src, Some(want), dst) {
        Ok(n) if n == dst.len() => Ok(()),
        Ok(n) => Err(Error::io(format!(
            "{name}: decompressed {n} bytes, expected {}",
            dst.len()
        ))),
        Err(e) => Err(Error::io(format!("{name} decompress: {e}"))),
    }
}
