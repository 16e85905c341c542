//! zstd (the `zstd` crate over libzstd), one zstd frame per page.
//!
//! Contexts: one decompression context and one compression context per level per thread, in
//! the [`context`](super::context) caches (libzstd sizes a compression context's workspace
//! for its level). After warm-up neither direction allocates (libzstd's allocations are C
//! `malloc`, reused).
//!
//! Levels: `zstd_safe::min_c_level()..=max_c_level()` (negative levels are zstd's fast modes);
//! default 3 (`ZSTD_CLEVEL_DEFAULT`). Level 0 means libzstd's default, as in libzstd.
//!
//! Dictionaries (`algorithm_params ... dict=PATH`): digested once, when the codec is made, into
//! a `CDict` (at the codec's level) and a `DDict`, held behind an `Arc` and read by every
//! thread's contexts (`ZSTD_compress_usingCDict`, `ZSTD_decompress_usingDDict`): one copy per
//! codec, none per thread or page. A codec with a dictionary only decompresses frames made with
//! it; which codec made a page is the slot's priority.

use super::context::{with_context, ContextCache, NO_LEVEL};
use super::dict::ZSTD_DICT_MAGIC;
use super::{check_dst, Codec, CodecParams, Dictionary};
use crate::error::{Error, Result};
use std::cell::RefCell;
use std::sync::Arc;
use zstd::zstd_safe::{self, CCtx, CDict, DCtx, DDict};

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

/// zstd frame compression at a fixed level, with or without a dictionary.
#[derive(Debug, Clone)]
pub struct Zstd {
    level: i32,
    dict: Option<Arc<PreparedDict>>,
}

/// A dictionary digested for compression (at the codec's level) and decompression; shared by
/// every thread (libzstd's `CDict` and `DDict` are read-only once made).
struct PreparedDict {
    cdict: CDict<'static>,
    ddict: DDict<'static>,
    len_bytes: usize,
}

impl std::fmt::Debug for PreparedDict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedDict")
            .field("len_bytes", &self.len_bytes)
            .finish_non_exhaustive()
    }
}

impl PreparedDict {
    /// Digests `dict` at `level`; `EINVAL` for a zstd dictionary (it has the magic) whose
    /// tables do not parse.
    fn new(dict: &Dictionary, level: i32) -> Result<PreparedDict> {
        let corrupt = || {
            let kind = if dict.bytes().starts_with(&ZSTD_DICT_MAGIC) {
                "a zstd dictionary whose tables do not parse (corrupt or truncated)"
            } else {
                "raw content zstd cannot use"
            };
            Error::invalid(format!(
                "zstd: the dictionary ({} bytes) is {kind}",
                dict.len_bytes()
            ))
        };
        let cdict = CDict::try_create(dict.bytes(), level).ok_or_else(corrupt)?;
        let ddict = DDict::try_create(dict.bytes()).ok_or_else(corrupt)?;
        Ok(PreparedDict {
            cdict,
            ddict,
            len_bytes: dict.len_bytes(),
        })
    }
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
        let dict = match &params.dict {
            Some(d) => Some(Arc::new(PreparedDict::new(d, level)?)),
            None => None,
        };
        Ok(Zstd { level, dict })
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
            match &self.dict {
                Some(d) => cctx.compress_using_cdict(dst, src, &d.cdict),
                None => cctx.compress(dst, src, self.level),
            }
            .map_err(|code| {
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
            let n = match &self.dict {
                Some(d) => dctx.decompress_using_ddict(dst, src, &d.ddict),
                None => dctx.decompress(dst, src),
            };
            match n {
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
