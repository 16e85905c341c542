//! Compression backends (zram's `zcomp`): one file per algorithm behind the [`Codec`] trait,
//! plus same-filled page detection.
//!
//! Contract of every codec:
//! - `compress` and `decompress` take `&self` and are called from many threads at once; any
//!   per-call state (a zstd context, a deflate stream) lives in per-thread contexts created
//!   once per thread and level and reused (`context`: one cache for every codec), so the hot
//!   path allocates nothing per page.
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
    /// Decompresses at least the first `prefix_bytes` of `src`'s output into `dst` (as long as
    /// the whole output) and returns how many leading bytes of `dst` are valid
    /// (`prefix_bytes..=dst.len()`), or fails with `ErrorKind::Io`. For a page early in a
    /// multi-page object, whose reader needs only the run's prefix. A codec that cannot stop
    /// early (zstd decodes a whole block, and a run is one block) decompresses everything.
    fn decompress_prefix(&self, src: &[u8], dst: &mut [u8], prefix_bytes: usize) -> Result<usize> {
        let _ = prefix_bytes;
        self.decompress(src, dst).map(|()| dst.len())
    }
}

/// Parameters set through `algorithm_params` (`level=N`, `dict=PATH`); `None` means the
/// algorithm's default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CodecParams {
    /// Compression level (zstd, deflate, lz4hc; lz4's acceleration).
    pub level: Option<i32>,
    /// A compression dictionary (zstd only).
    pub dict: Option<Dictionary>,
}

impl CodecParams {
    /// Parameters with a level only.
    pub fn with_level(level: Option<i32>) -> CodecParams {
        CodecParams { level, dict: None }
    }
}

mod context;
mod deflate;
mod dict;
mod lz4;
mod lz4hc;
mod same_filled;
mod zstd;

pub use self::deflate::Deflate;
pub use self::dict::{Dictionary, MAX_DICT_BYTES};
pub use self::lz4::Lz4;
pub use self::lz4hc::Lz4Hc;
pub use self::same_filled::{fill_same, same_filled_word};
pub use self::zstd::Zstd;

use crate::error::Error;

/// The algorithms `comp_algorithm` lists, in its order (the kernel's backend order, minus the
/// ones uzram does not implement: lzo, lzo-rle, 842).
const ALGORITHMS: [&str; 4] = [lz4::NAME, lz4hc::NAME, zstd::NAME, deflate::NAME];

/// The algorithms [`new_codec`] accepts, in the order `comp_algorithm` lists them.
pub fn algorithms() -> &'static [&'static str] {
    &ALGORITHMS
}

/// Codec priorities: 0 is the primary codec (`comp_algorithm`), 1..=3 the recompression
/// codecs (`recomp_algorithm priority=N`), as zram's `ZRAM_MAX_COMPS`. A slot's two priority
/// bits say which one wrote it.
pub const MAX_COMPS: usize = 4;

/// The deflate window uzram's deflate compresses with, in bits (`deflate.winbits`):
/// `miniz_oxide`, the pure-Rust backend, always uses a 32 KiB window and cannot take a smaller
/// one, so this is the only value `algorithm_params` accepts.
pub const DEFLATE_WINBITS: i32 = 15;

/// The kernel's algorithms uzram leaves out on purpose: every implementation of lzo and
/// lzo-rle found is GPL-only, and the crate is MIT OR Apache-2.0; 842 has no Rust
/// implementation.
const NOT_PROVIDED: [&str; 3] = ["lzo", "lzo-rle", "842"];

/// Checks that `name` is an algorithm [`new_codec`] accepts; `EINVAL` otherwise, with a message
/// listing what is supported (and why lzo and lzo-rle, the kernel's defaults, are not).
pub fn check_algorithm(name: &str) -> Result<()> {
    let name = name.trim();
    if ALGORITHMS.contains(&name) {
        return Ok(());
    }
    let why = if NOT_PROVIDED.contains(&name) {
        " is not provided by uzram (lzo and lzo-rle exist only under the GPL, 842 not in Rust; \
         uzram is MIT OR Apache-2.0)"
    } else {
        " is not a known compression algorithm"
    };
    Err(Error::invalid(format!(
        "{name:?}{why}; supported: {}",
        ALGORITHMS.join(" ")
    )))
}

/// Creates the codec `name` with `params`.
///
/// An unknown name, or a level the algorithm does not accept, is `EINVAL` (what zram's
/// `comp_algorithm` and `algorithm_params` return).
pub fn new_codec(name: &str, params: CodecParams) -> Result<Box<dyn Codec>> {
    // zram's attribute stores arrive with a trailing newline ("echo zstd > comp_algorithm").
    match name.trim() {
        lz4::NAME => Ok(Box::new(Lz4::new(params)?)),
        lz4hc::NAME => Ok(Box::new(Lz4Hc::new(params)?)),
        zstd::NAME => Ok(Box::new(Zstd::new(params)?)),
        deflate::NAME => Ok(Box::new(Deflate::new(params)?)),
        other => Err(check_algorithm(other).expect_err("not one of the names matched above")),
    }
}

/// A `dst` length that holds every codec's worst case on `src_len` bytes: the maximum of the
/// bounds each format's library documents.
///
/// - lz4 (lz4_flex): `16 + 4 + src_len * 110 / 100` (`get_maximum_output_size`), the largest of
///   all; liblz4's own `LZ4_compressBound` (`src_len + src_len / 255 + 16`, used for lz4hc) is
///   smaller.
/// - zstd: `ZSTD_compressBound`: `src_len + src_len / 256 + (128 KiB - src_len) / 2048` below
///   128 KiB.
/// - deflate: stored blocks cost 5 bytes per 65535 input bytes, plus a final empty block and
///   bit padding; [`deflate::bound`] adds a margin on top of that.
pub fn compress_bound(src_len: usize) -> usize {
    let lz4_flex = lz4_flex::block::get_maximum_output_size(src_len);
    let liblz4 = src_len + src_len / 255 + 16;
    let zstd = ::zstd::zstd_safe::compress_bound(src_len);
    lz4_flex.max(liblz4).max(zstd).max(deflate::bound(src_len))
}

/// `EOPNOTSUPP` when `params` carry a dictionary, for codecs that take none: the message names
/// the codec and the one that does.
fn refuse_dict(name: &str, params: &CodecParams) -> Result<()> {
    if params.dict.is_some() {
        return Err(Error::new(
            crate::error::ErrorKind::Unsupported,
            format!("{name}: dictionaries are not supported (zstd takes dict=PATH)"),
        ));
    }
    Ok(())
}

/// Checks that `dst` is large enough for compressing `src_len` bytes, so a too-small buffer is a
/// clear `EINVAL` instead of a codec-specific failure deep inside a library.
fn check_dst(src_len: usize, dst: &[u8]) -> Result<()> {
    let need = compress_bound(src_len);
    if dst.len() < need {
        return Err(Error::invalid(format!(
            "compression buffer of {} bytes is smaller than compress_bound({src_len}) = {need}",
            dst.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
