//! zstd (the `zstd` crate over libzstd), one zstd frame per page.
//!
//! Contexts: one decompression context and one compression context per level per thread, in
//! the [`context`](super::context) caches (libzstd sizes a compression context's workspace
//! for its level). After warm-up neither direction allocates (libzstd's allocations are C
//! `malloc`, reused).
//!
//! Levels: `zstd_safe::min_c_level()..=max_c_level()` (negative levels are zstd's fast modes);
//! default 3 (`ZSTD_CLEVEL_DEFAULT`). Level 0 means libzstd's default, as in libzstd.

use super::context::{with_context, ContextCache, NO_LEVEL};
use super::{check_dst, Codec, CodecParams};
use crate::error::{Error, Result};
use std::cell::RefCell;
use zstd::zstd_safe::{self, CCtx, DCtx};

/// The name in `comp_algorithm`.
pub(super) const NAME: &str = "zstd";

/// `ZSTD_CLEVEL_DEFAULT`.
pub const DEFAULT_LEVEL: i32 = 3;

thread_local! {
    /// This thread's compression contexts, one per level used.
    static CCTXS: RefCell<ContextCache<CCtx<'static>>> = const { RefCell::new(ContextCache::new()) };
    /// This thread's decompression context (decompression has no level).
    static DCTXS: RefCell<ContextCache<DCtx<'static>>> = const { RefCell::new(ContextCache::new()) };
}

/// zstd frame compression at a fixed level.
#[derive(Debug, Clone, Copy)]
pub struct Zstd {
    level: i32,
}

impl Zstd {
    /// Creates the codec; a level outside libzstd's range is `EINVAL`.
    pub fn new(params: CodecParams) -> Result<Zstd> {
        let level = params.level.unwrap_or(DEFAULT_LEVEL);
        let (min, max) = (zstd_safe::min_c_level(), zstd_safe::max_c_level());
        if !(min..=max).contains(&level) {
            return Err(Error::invalid(format!(
                "zstd: level {level} outside {min}..={max}"
            )));
        }
        Ok(Zstd { level })
    }

    /// The compression level in use.
    pub fn level(&self) -> i32 {
        self.level
    }
}

impl Codec for Zstd {
    fn name(&self) -> &'static str {
        NAME
    }

    fn compress(&self, src: &[u8], dst: &mut [u8]) -> Result<usize> {
        check_dst(src.len(), dst)?;
        let create =
            || CCtx::try_create().ok_or_else(|| Error::no_memory("zstd: cannot create a context"));
        with_context(&CCTXS, self.level, create, |cctx| {
            cctx.compress(dst, src, self.level).map_err(|code| {
                Error::io(format!(
                    "zstd compress: {}",
                    zstd_safe::get_error_name(code)
                ))
            })
        })
    }

    fn decompress(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        let create =
            || DCtx::try_create().ok_or_else(|| Error::no_memory("zstd: cannot create a context"));
        with_context(&DCTXS, NO_LEVEL, create, |dctx| {
            match dctx.decompress(dst, src) {
                Ok(n) if n == dst.len() => Ok(()),
                Ok(n) => Err(Error::io(format!(
                    "zstd: decompressed {n} bytes, expected {}",
                    dst.len()
                ))),
                Err(code) => Err(Error::io(format!(
                    "zstd decompress: {}",
                    zstd_safe::get_error_name(code)
                ))),
            }
        })
    }
}
