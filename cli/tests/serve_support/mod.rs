//! `uzram serve` from a configuration file, for the tests of what a running server does
//! (`cli/tests/policy.rs`, `cli/tests/ctl_progress.rs`): started in a temporary directory
//! (`{dir}` in the file), `uzram ctl` against it, killed when dropped.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_uzram");

/// A running `uzram serve`.
pub struct Server {
    pub child: Child,
    pub dir: tempfile::TempDir,
}

impl Server {
    /// `uzram ctl --dir DIR ARGS...`.
    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .arg("ctl")
            .arg("--dir")
            .arg(self.dir.path())
            .args(args)
            .output()
            .unwrap()
    }

    /// `uzram ctl ATTR`, which must succeed.
    pub fn show(&self, attr: &str) -> String {
        let o = self.ctl(&[attr]);
        assert!(o.status.success(), "{o:?}");
        String::from_utf8(o.stdout).unwrap()
    }

    /// The NBD URI of device `zram0`.
    pub fn uri(&self) -> String {
        format!(
            "nbd+unix:///zram0?socket={}",
            self.dir.path().join("zram0.sock").display()
        )
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
    let mut out = String::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        out.push_str(&line);
        out.push('\n');
        if line.starts_with("serving") {
            return Server { child, dir };
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!(
        "uzram serve did not start: {out}{}",
        std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default()
    );
}
