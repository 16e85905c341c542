//! `uzram serve` as a user runs it: the built binary, its printed URIs, real clients, and a
//! clean stop on SIGTERM and SIGINT (requests in flight answered, socket removed, exit 0).

#[path = "../../tests/nbd_support/mod.rs"]
mod nbd_support;

use nbd_support::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use uzram::frontend::nbd::protocol::*;

struct Running {
    child: Child,
    uris: Vec<String>,
    _dir: tempfile::TempDir,
    socket: std::path::PathBuf,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `uzram serve` with `extra` flags on a temporary socket; waits for its URIs.
fn serve(extra: &[&str]) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("zram0.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args(["serve", "--disksize", "64M", "--socket"])
        .arg(&socket)
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .expect("uzram serve starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut uris = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(u) = line.trim().strip_prefix("nbd") {
            uris.push(format!("nbd{u}"));
        }
        if line.starts_with("serving") || Instant::now() > deadline {
            break;
        }
    }
    assert!(!uris.is_empty(), "uzram serve printed no URI");
    Running {
        child,
        uris,
        _dir: dir,
        socket,
    }
}

fn signal(r: &Running, sig: &str) {
    run(Command::new("kill").args([sig, &r.child.id().to_string()]));
}

fn wait_exit(r: &mut Running) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = r.child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "uzram serve did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serve_prints_uris_and_real_clients_reach_it() {
    require("qemu-img");
    require("qemu-io");
    let mut r = serve(&["--listen", "127.0.0.1:0"]);
    let unix_uri = format!("nbd+unix:///zram0?socket={}", r.socket.display());
    assert!(r.uris.contains(&unix_uri), "{:?}", r.uris);
    let tcp_uri = r
        .uris
        .iter()
        .find(|u| u.starts_with("nbd://127.0.0.1:"))
        .unwrap();
    let out = run(Command::new("qemu-img").args(["info", "--output=json", "-f", "raw", &unix_uri]));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["virtual-size"], 64u64 << 20);
    // Written over TCP, read back over the unix socket.
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x5a 1M 64k", tcp_uri]));
    let out =
        run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x5a 1M 64k", &unix_uri]));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("fail"));
    signal(&r, "-TERM");
    assert!(wait_exit(&mut r).success());
    assert!(!r.socket.exists(), "socket left behind");
}

#[test]
fn sigint_answers_requests_in_flight_then_stops() {
    let mut r = serve(&[]);
    let (mut c, _) = RawClient::handshake(&r.socket, true);
    for i in 0..64u64 {
        c.send_request(CMD_WRITE, 0, i, i * 65536, 65536);
        std::io::Write::write_all(&mut c.s, &pattern(65536, i)).unwrap();
    }
    let first = c.read_reply(0);
    assert_eq!(first.error, 0);
    signal(&r, "-INT");
    // Every reply that arrives is a success; then the server closes the connection.
    let mut n = 1;
    loop {
        let mut m = [0u8; 16];
        if std::io::Read::read_exact(&mut c.s, &mut m).is_err() {
            break;
        }
        assert_eq!(u32::from_be_bytes(m[4..8].try_into().unwrap()), 0);
        n += 1;
    }
    assert!(n >= 1);
    assert!(wait_exit(&mut r).success());
    assert!(!r.socket.exists(), "socket left behind");
}

#[test]
fn serve_refuses_a_socket_in_use() {
    let r = serve(&[]);
    let out = Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args(["serve", "--disksize", "1M", "--socket"])
        .arg(&r.socket)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("in use"));
    assert!(r.socket.exists(), "the running server's socket must stay");
}
