//! `uzram serve` as a user runs it: the built binary, its printed URIs, real clients, and a
//! clean stop on SIGTERM and SIGINT (requests in flight answered, socket removed, exit 0).

use std::process::Command;
use std::time::Duration;
use uzram_nbd_proto::*;
use uzram_testkit::nbd::RawClient;
use uzram_testkit::pages::pattern;
use uzram_testkit::process::{require, run};
use uzram_testkit::serve::{Running, Serve};

/// Starts `uzram serve --disksize 64M --socket DIR/zram0.sock EXTRA`; waits until it serves.
fn serve(extra: &[&str]) -> Running {
    let r = Serve::args(&["--disksize", "64M", "--socket", "{dir}/zram0.sock"])
        .arg(extra)
        .start();
    assert!(!r.uris().is_empty(), "uzram serve printed no URI");
    r
}

#[test]
fn serve_prints_uris_and_real_clients_reach_it() {
    require("qemu-img");
    require("qemu-io");
    let mut r = serve(&["--listen", "127.0.0.1:0"]);
    let unix_uri = format!("nbd+unix:///zram0?socket={}", r.socket("zram0").display());
    assert!(r.uris().contains(&unix_uri), "{:?}", r.uris());
    let uris = r.uris();
    let tcp_uri = uris
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
    r.signal("-TERM");
    assert!(r.wait_exit(Duration::from_secs(20)).success());
    assert!(!r.socket("zram0").exists(), "socket left behind");
}

#[test]
fn sigint_answers_requests_in_flight_then_stops() {
    let mut r = serve(&[]);
    let (mut c, _) = RawClient::handshake(&r.socket("zram0"), true);
    for i in 0..64u64 {
        c.send_request(CMD_WRITE, 0, i, i * 65536, 65536);
        std::io::Write::write_all(&mut c.s, &pattern(65536, i)).unwrap();
    }
    let first = c.read_reply(0);
    assert_eq!(first.error, 0);
    r.signal("-INT");
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
    assert!(r.wait_exit(Duration::from_secs(20)).success());
    assert!(!r.socket("zram0").exists(), "socket left behind");
}

#[test]
fn serve_refuses_a_socket_in_use() {
    let r = serve(&[]);
    let socket = r.socket("zram0");
    let e = Serve::args(&["--disksize", "1M", "--socket", socket.to_str().unwrap()])
        .refused()
        .stderr;
    assert!(e.contains("in use"), "{e}");
    assert!(
        r.socket("zram0").exists(),
        "the running server's socket must stay"
    );
}
