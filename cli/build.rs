//! Puts the commit the binary is built from in `uzram --version` (`UZRAM_COMMIT`, e.g.
//! `a9d7ded12345 2026-11-27`): from `UZRAM_COMMIT` in the build's environment when set (a
//! packager building from a tarball names the commit), else from git when the sources are a
//! git checkout, else `unknown commit` (a tarball: the version alone says what it is).
//!
//! Cargo runs this again when HEAD moves (a commit, a checkout): the files it watches are the
//! checkout's HEAD and the ref HEAD names, never a file that may not exist (cargo would then run
//! it, and rebuild the command, on every build).

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

fn watch(path: PathBuf) {
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=UZRAM_COMMIT");
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let commit = match std::env::var("UZRAM_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => match git(&dir, &["rev-parse", "--short=12", "HEAD"]) {
            Some(hash) => {
                for name in ["HEAD", "packed-refs"] {
                    if let Some(p) = git(
                        &dir,
                        &["rev-parse", "--path-format=absolute", "--git-path", name],
                    ) {
                        watch(PathBuf::from(p));
                    }
                }
                if let Some(r) = git(&dir, &["symbolic-ref", "-q", "HEAD"]) {
                    if let Some(p) = git(
                        &dir,
                        &["rev-parse", "--path-format=absolute", "--git-path", &r],
                    ) {
                        watch(PathBuf::from(p));
                    }
                }
                let date = git(&dir, &["log", "-1", "--format=%cs", "HEAD"]).unwrap_or_default();
                format!("{hash} {date}").trim().to_string()
            }
            None => "unknown commit".to_string(),
        },
    };
    println!("cargo:rustc-env=UZRAM_COMMIT={commit}");
}
