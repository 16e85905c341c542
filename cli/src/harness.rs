//! `uzram bench …` and `uzram corpus …`: run by the harness's own binary, `uzram-bench`,
//! installed beside `uzram` (as git and cargo run their external subcommands). The harness
//! links the engine's test-only parts; keeping it a separate binary keeps them out of the
//! product.

use anyhow::{bail, Context, Result};
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;

/// The harness's binary name.
const HARNESS: &str = "uzram-bench";

/// Where the harness is: beside this binary, else on `PATH`.
fn harness_path() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let beside = exe.parent()?.join(HARNESS);
    if beside.is_file() {
        return Some(beside);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(HARNESS))
            .find(|p| p.is_file())
    })
}

/// Replaces this process with `uzram-bench SUBCOMMAND ARGS…`.
pub fn exec(subcommand: &str, args: Vec<OsString>) -> Result<()> {
    let Some(path) = harness_path() else {
        bail!(
            "uzram {subcommand}: the benchmark harness `{HARNESS}` is not installed beside this \
             binary or on PATH; build it with `cargo build --release -p uzram-bench` (it is \
             kept out of the product binary)"
        );
    };
    let e = std::process::Command::new(&path)
        .arg(subcommand)
        .args(args)
        .exec();
    Err(e).with_context(|| format!("running {}", path.display()))
}
