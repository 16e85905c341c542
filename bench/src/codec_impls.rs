//! The lz4 implementations (and zstd with reused contexts) side by side on the corpus's pages:
//! the measurement that chose liblz4 for uzram's `lz4` codec (`src/compress/lz4.rs`).
//!
//! Each implementation compresses every page into its own buffer, then decompresses every page
//! and checks it, single thread; throughput is of the thread's CPU time (steady under other
//! load), MB/s of uncompressed bytes, the median over repetitions run round-robin (every
//! implementation once per repetition, so load from elsewhere falls on all alike). The ratio is
//! bytes in over bytes out, a page that does not shrink counted at full size (as zram stores it).
//!
//! - `lz4_flex 0.11 safe`: what uzram used before (`safe-encode`, `safe-decode`: bounds-checked
//!   Rust, an 8 KiB hash table allocated per call).
//! - `lz4_flex 0.10 unsafe`: the same crate with its unsafe encoder and decoder (pointer copies;
//!   `checked-decode` keeps the decoder's bounds checks). An older version, because Cargo unifies
//!   features per version and the library enables the safe ones on 0.11.
//! - `liblz4 1.10`: the reference C library through the `lz4` crate's block API
//!   (`LZ4_compress_fast`, `LZ4_decompress_safe`): uzram's `lz4` codec.
//! - `zstd 1` / `zstd 3`: uzram's zstd codec (per-thread contexts reused, no allocation per page).

use crate::{median, thread_cpu_time};
use serde_json::json;
use uzram::compress::{self, CodecParams};
use uzram::error::{Error, Result};

/// Compresses into a buffer of `compress_bound` bytes, returning the length.
type CompressFn = Box<dyn Fn(&[u8], &mut [u8]) -> Result<usize>>;
/// Decompresses into exactly the page.
type DecompressFn = Box<dyn Fn(&[u8], &mut [u8]) -> Result<()>>;

/// One implementation's functions: compress into a buffer of `compress_bound` bytes (returning
/// the length), decompress into exactly the page.
struct Implementation {
    name: &'static str,
    compress: CompressFn,
    decompress: DecompressFn,
}

fn io(what: &str, e: impl std::fmt::Display) -> Error {
    Error::io(format!("{what}: {e}"))
}

fn implementations() -> Result<Vec<Implementation>> {
    let codec = |name: &'static str, label: &'static str, level: Option<i32>| -> Result<_> {
        let c: std::sync::Arc<dyn compress::Codec> =
            compress::new_codec(name, CodecParams::with_level(level))?.into();
        let d = c.clone();
        Ok(Implementation {
            name: label,
            compress: Box::new(move |src, dst| c.compress(src, dst)),
            decompress: Box::new(move |src, dst| d.decompress(src, dst)),
        })
    };
    Ok(vec![
        Implementation {
            name: "lz4_flex 0.11 safe",
            compress: Box::new(|src, dst| {
                lz4_flex::block::compress_into(src, dst).map_err(|e| io("lz4_flex", e))
            }),
            decompress: Box::new(|src, dst| {
                let n =
                    lz4_flex::block::decompress_into(src, dst).map_err(|e| io("lz4_flex", e))?;
                (n == dst.len())
                    .then_some(())
                    .ok_or_else(|| Error::io("lz4_flex: short page"))
            }),
        },
        Implementation {
            name: "lz4_flex 0.10 unsafe",
            compress: Box::new(|src, dst| {
                lz4_flex_unsafe::block::compress_into(src, dst).map_err(|e| io("lz4_flex", e))
            }),
            decompress: Box::new(|src, dst| {
                let n = lz4_flex_unsafe::block::decompress_into(src, dst)
                    .map_err(|e| io("lz4_flex", e))?;
                (n == dst.len())
                    .then_some(())
                    .ok_or_else(|| Error::io("lz4_flex: short page"))
            }),
        },
        codec("lz4", "liblz4 1.10 (uzram lz4)", None)?,
        codec("zstd", "zstd 1 (reused contexts)", Some(1))?,
        codec("zstd", "zstd 3 (reused contexts)", Some(3))?,
    ])
}

/// Figures of one implementation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ImplResult {
    /// Its label.
    pub name: &'static str,
    /// Compression MB/s of CPU time (median).
    pub compress_mbps: f64,
    /// Decompression MB/s of CPU time (median).
    pub decompress_mbps: f64,
    /// Uncompressed over stored bytes.
    pub ratio: f64,
}

/// Runs every implementation over `pages` (not same-filled), `reps` times round-robin.
pub fn run(pages: &[&[u8]], reps: usize) -> Result<Vec<ImplResult>> {
    let impls = implementations()?;
    let ps = pages.first().map_or(4096, |p| p.len());
    let bound = compress::compress_bound(ps);
    let bytes = (pages.len() * ps) as f64;
    let mut comp = vec![0u8; bound * pages.len()];
    let mut lens = vec![0usize; pages.len()];
    let mut out = vec![0u8; ps];
    let mut c_mbps = vec![Vec::new(); impls.len()];
    let mut d_mbps = vec![Vec::new(); impls.len()];
    let mut ratio = vec![0.0; impls.len()];
    for _ in 0..reps.max(1) {
        for (k, imp) in impls.iter().enumerate() {
            let start = thread_cpu_time();
            for (i, p) in pages.iter().enumerate() {
                lens[i] = (imp.compress)(p, &mut comp[i * bound..(i + 1) * bound])?;
            }
            c_mbps[k].push(bytes / (thread_cpu_time() - start).as_secs_f64() / 1e6);
            let start = thread_cpu_time();
            for (i, len) in lens.iter().enumerate() {
                (imp.decompress)(&comp[i * bound..i * bound + len], &mut out)?;
            }
            d_mbps[k].push(bytes / (thread_cpu_time() - start).as_secs_f64() / 1e6);
            for (i, p) in pages.iter().enumerate() {
                (imp.decompress)(&comp[i * bound..i * bound + lens[i]], &mut out)?;
                if out != *p {
                    return Err(Error::io(format!("{}: page {i} differs", imp.name)));
                }
            }
            let stored: usize = lens.iter().map(|&l| l.min(ps)).sum();
            ratio[k] = bytes / stored as f64;
        }
    }
    Ok(impls
        .iter()
        .enumerate()
        .map(|(k, imp)| ImplResult {
            name: imp.name,
            compress_mbps: median(&c_mbps[k]),
            decompress_mbps: median(&d_mbps[k]),
            ratio: ratio[k],
        })
        .collect())
}

/// The JSON of a run's results.
pub fn to_json(results: &[ImplResult]) -> serde_json::Value {
    json!(results)
}
