//! The real-page corpus the packing and policy tests store (`cli/tests/packing.rs`,
//! `cli/tests/policy.rs`): one file in one place, made once per build directory.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use uzram_bench::corpus::Corpus;

/// A 64 KiB-page corpus of every program `uzram corpus` knows (1024 pages each, about 240 MiB),
/// made by the built `uzram corpus` the first time a test asks, in the build directory's
/// temporary directory, and kept there for the next run.
pub fn corpus_64k_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("packing");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pages-64k.bin");
        if Corpus::load(&path).is_err() {
            let out = Command::new(env!("CARGO_BIN_EXE_uzram"))
                .args([
                    "corpus",
                    "--page-size",
                    "65536",
                    "--pages-per-program",
                    "1024",
                ])
                .arg("--out")
                .arg(&path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "uzram corpus failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        path
    })
}
