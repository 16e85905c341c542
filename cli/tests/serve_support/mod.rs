//! `uzram serve` from a configuration file, for the tests of what a running server does
//! (`cli/tests/policy.rs`, `cli/tests/ctl_progress.rs`): started in a temporary directory
//! (`{dir}` in the file), `uzram ctl` against it, killed when dropped. And the pieces the
//! tests that start `uzram serve` their own way share (`cli/tests/ctl.rs`, `metrics.rs`,
//! `zram_generator.rs`): `uzram ctl` and the NBD URI of a server's directory, and the wait for
//! its `serving` line.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Output, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_uzram");

/// A running `uzram serve`.
pub struct Server {
    pub child: Child,
    pub dir: tempfile::TempDir,
}

/// `uzram ctl --dir DIR ARGS...` against the server whose directory is `dir`.
pub fn ctl_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("ctl")
        .arg("--dir")
        .arg(dir)
        .args(args)
        .output()
        .unwrap()
}

/// The NBD URI of device `name` of the server whose directory (where its sockets default to)
/// is `dir`.
pub fn uri_in(dir: &Path, name: &str) -> String {
    format!(
        "nbd+unix:///{name}?socket={}",
        dir.join(format!("{name}.sock")).display()
    )
}

/// Reads a starting `uzram serve`'s standard output up to its line `serving`: the lines before
/// that one, and whether it came (false: the server closed its output first, as it does when
/// it exits).
pub fn wait_serving(stdout: ChildStdout) -> (Vec<String>, bool) {
    let mut banner = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if line.starts_with("serving") {
            return (banner, true);
        }
        banner.push(line);
    }
    (banner, false)
}

impl Server {
    /// `uzram ctl --dir DIR ARGS...`.
    pub fn ctl(&self, args: &[&str]) -> Output {
        ctl_in(self.dir.path(), args)
    }

    /// `uzram ctl ATTR`, which must succeed.
    pub fn show(&self, attr: &str) -> String {
        let o = self.ctl(&[attr]);
        assert!(o.status.success(), "{o:?}");
        String::from_utf8(o.stdout).unwrap()
    }

    /// The NBD URI of device `zram0`.
    pub fn uri(&self) -> String {
        uri_in(self.dir.path(), "zram0")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `uzram serve --config FILE` with `toml` (`{dir}` becomes the temporary directory);
/// returns once it prints `serving`.
pub fn serve_config(toml: &str) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let cfg = dir.path().join("uzram.toml");
    std::fs::write(&cfg, toml.replace("{dir}", &d)).unwrap();
    let stderr = std::fs::File::create(dir.path().join("stderr")).unwrap();
    let mut child = Command::new(BIN)
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let (banner, serving) = wait_serving(child.stdout.take().unwrap());
    if serving {
        return Server { child, dir };
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!(
        "uzram serve did not start: {}\n{}",
        banner.join("\n"),
        std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default()
    );
}
