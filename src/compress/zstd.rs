//! zstd (the `zstd` crate over libzstd), one zstd frame per page.
//!
//! Contexts: each thread keeps one decompression context and one compression context *per
//! level* it has used, created on first use and reused for every later page. Contexts are keyed
//! by level (not shared between levels) because libzstd sizes a context's workspace for the
//! parameters of the level (and the input size): a thread alternating between the primary
//! codec's level and a recompression level would otherwise keep resizing one workspace. After
//! warm-up neither direction allocates (libzstd's allocations are C `malloc`, reused).
//!
//! Levels: `zstd_safe::min_c_level()..=max_c_level()` (negative levels are zstd's fast modes);
//! default 3 (`ZSTD_CLEVEL_DEFAULT`). Level 0 means libzstd's default, as in libzstd.
//!
//! Invariant: a context's `RefCell` is borrowed only for the duration of one `compress` or
//! `decompress` call, which never calls back into a codec, so the borrow cannot fail.

use super::{check_dst, Codec, CodecParams};
use crate::error::{Error, Result};
use std::cell::RefCell;
use zstd::zstd_safe::{self, CCtx, DCtx};

/// The name in `comp_algorithm`.
pub(super) const NAME: &str = "zstd";

/// `ZSTD_CLEVEL_DEFAULT`.
pub const DEFAULT_LEVEL: i32 = 3;

thread_local! {
    /// This thread's compression contexts, one per level used (a handful at most: the primary
    /// codec's and the recompression codecs' levels), searched linearly.
    static CCTXS: RefCell<Vec<(i32, CCtx<'static>)>> = const { RefCell::new(Vec::new()) };
    /// This thread's decompression context (decompression has no level).
    static DCTX: RefCell<Option<DCtx<'static>>> = const { RefCell::new(None) };
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
        CCTXS.with(|cell| {
            let mut cctxs = cell.borrow_mut();
            let i = match cctxs.iter().position(|(l, _)| *l == self.level) {
                Some(i) => i,
                None => {
                    let cctx = CCtx::try_create()
                        .ok_or_else(|| Error::no_memory("zstd: cannot create a context"))?;
                    cctxs.push((self.level, cctx));
                    cctxs.len() - 1
                }
            };
            cctxs[i].1.compress(dst, src, self.level).map_err(|code| {
                Error::io(format!(
                    "zstd compress: {}",
                    zstd_safe::get_error_name(code)
                ))
            })
        })
    }

    fn decompress(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        DCTX.with(|cell| {
            let mut slot = cell.borrow_mut();
            if slot.is_none() {
                *slot = Some(
                    DCtx::try_create()
                        .ok_or_else(|| Error::no_memory("zstd: cannot create a context"))?,
                );
            }
            let dctx = slot.as_mut().expect("just created");
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
