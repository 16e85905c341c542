//! Real NBD servers for the NBD backing tests: nbdkit and qemu-nbd on a unix socket in a
//! temporary directory, killed (and waited for) when dropped. A server program missing is a
//! failure, not a skip: scripts/debian-packages.txt installs them.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running server.
#[derive(Debug)]
pub struct NbdServer {
    child: Option<Child>,
    pub socket: PathBuf,
    pub export: String,
    pub dir: tempfile::TempDir,
}

use crate::device::real_tmpdir as tmpdir;

impl NbdServer {
    /// `nbdkit` with `args` (plugin, filters, parameters) on a new socket.
    pub fn nbdkit(args: &[&str]) -> NbdServer {
        NbdServer::nbdkit_in(tmpdir(), args)
    }

    /// `nbdkit` with `args` on `dir/nbd.sock` (restarting a server on the same socket).
    pub fn nbdkit_in(dir: tempfile::TempDir, args: &[&str]) -> NbdServer {
        let socket = dir.path().join("nbd.sock");
        let _ = std::fs::remove_file(&socket);
        // nbdkit writes its pid file once it listens: waiting for it (rather than probing the
        // socket) keeps its log free of probe connections.
        let pidfile = dir.path().join("nbdkit.pid");
        let _ = std::fs::remove_file(&pidfile);
        let mut cmd = Command::new("nbdkit");
        cmd.args(["--foreground", "--exit-with-parent", "--unix"])
            .arg(&socket)
            .arg("--pidfile")
            .arg(&pidfile)
            .args(args);
        NbdServer::start(cmd, dir, socket, "", Some(pidfile))
    }

    /// `nbdkit` with `args` on TCP 127.0.0.1 at a free port; returns the server and its port.
    pub fn nbdkit_tcp(args: &[&str]) -> (NbdServer, u16) {
        let dir = tmpdir();
        // A port the kernel just had free (a race with other processes is unlikely and fails
        // the start loudly).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let pidfile = dir.path().join("nbdkit.pid");
        let mut cmd = Command::new("nbdkit");
        cmd.args([
            "--foreground",
            "--exit-with-parent",
            "-i",
            "127.0.0.1",
            "-p",
        ])
        .arg(port.to_string())
        .arg("--pidfile")
        .arg(&pidfile)
        .args(args);
        let socket = dir.path().join("unused");
        (NbdServer::start(cmd, dir, socket, "", Some(pidfile)), port)
    }

    /// `qemu-nbd` serving the raw file `file` as export `export`, `connections` clients at once.
    pub fn qemu_nbd(file: &Path, export: &str, connections: u32) -> NbdServer {
        let dir = tmpdir();
        let socket = dir.path().join("nbd.sock");
        let mut cmd = Command::new("qemu-nbd");
        cmd.args(["--format=raw", "--cache=writeback", "--persistent"])
            .arg(format!("--shared={connections}"))
            .arg(format!("--export-name={export}"))
            .arg("--socket")
            .arg(&socket)
            .arg(file);
        NbdServer::start(cmd, dir, socket, export, None)
    }

    /// Runs `cmd` and waits until `ready` exists (when given) or the socket takes connections.
    fn start(
        mut cmd: Command,
        dir: tempfile::TempDir,
        socket: PathBuf,
        export: &str,
        ready: Option<PathBuf>,
    ) -> NbdServer {
        let program = cmd.get_program().to_string_lossy().into_owned();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("{program} must be installed (scripts/debian-packages.txt): {e}")
            });
        let mut s = NbdServer {
            child: Some(child),
            socket,
            export: export.to_string(),
            dir,
        };
        let start = Instant::now();
        let is_ready = |s: &NbdServer| match &ready {
            Some(p) => std::fs::metadata(p).is_ok_and(|m| m.len() > 0),
            None => UnixStream::connect(&s.socket).is_ok(),
        };
        while !is_ready(&s) {
            if let Some(status) = s.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("{program} exited early: {status}");
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "{program} did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    /// The export's URI.
    pub fn uri(&self) -> String {
        format!(
            "nbd+unix:///{}?socket={}",
            self.export,
            self.socket.display()
        )
    }

    /// Kills the server (SIGKILL) and waits for it; gives back its directory.
    pub fn kill(mut self) -> tempfile::TempDir {
        self.stop();
        let dir = tmpdir();
        std::mem::replace(&mut self.dir, dir)
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.stop();
    }
}
