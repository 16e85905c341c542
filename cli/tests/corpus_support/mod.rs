//! The real-page corpus the packing and policy tests store (`cli/tests/packing.rs`,
//! `cli/tests/policy.rs`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use uzram_bench::corpus::Corpus;

/// A 64 KiB-page corpus of every program `uzram corpus` knows (1024 pages each, about 240 MiB),
/// made by the built `uzram corpus` the first time a test asks ([`uzram_testkit::serve::corpus`]).
pub fn corpus_64k_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        uzram_testkit::serve::corpus(
            "pages-64k.bin",
            &["--page-size", "65536", "--pages-per-program", "1024"],
            |p| Corpus::load(p).is_ok(),
        )
    })
}
