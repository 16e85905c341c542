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

/// `nbdinfo --json` of `uri`: the first export's `is_read_only`.
fn is_read_only(uri: &str) -> bool {
    let out = run(Command::new("nbdinfo").args(["--json", uri]));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    info["exports"][0]["is_read_only"].as_bool().unwrap()
}

/// `--read-only` exports every device read-only, `read_only = true` one device of a config:
/// libnbd sees the flag, qemu-io reads and cannot write, the server answers a write with
/// EPERM; the other device stays writable. With ublk it is refused before anything starts.
#[test]
fn read_only_exports_from_the_flag_and_the_config() {
    require("nbdinfo");
    require("qemu-io");
    let r = serve(&["--read-only"]);
    assert!(is_read_only(&r.uri("zram0")));
    let (mut c, _) = RawClient::handshake(&r.socket("zram0"), true);
    assert_eq!(c.write(1, 0, &[9u8; 4096]), NBD_EPERM);
    assert_eq!(c.read(2, 0, 4096).data, vec![0u8; 4096]);
    drop(r);

    let r = Serve::config(
        "[[device]]\nname = \"zram0\"\ndisksize = \"16M\"\nsocket = \"{dir}/zram0.sock\"\n\
         read_only = true\n\
         [[device]]\nname = \"zram1\"\ndisksize = \"16M\"\nsocket = \"{dir}/zram1.sock\"\n",
    )
    .start();
    assert!(is_read_only(&r.uri("zram0")));
    assert!(!is_read_only(&r.uri("zram1")));
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x11 0 4k", &r.uri("zram0")])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("wrote"));
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x11 0 4k", &r.uri("zram1")]));
    let out = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-r",
        "-c",
        "read -P 0 0 4k",
        &r.uri("zram0"),
    ]));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("fail"));
    drop(r);

    let e = Serve::args(&["--disksize", "1M", "--read-only", "--ublk"])
        .refused()
        .stderr;
    assert!(e.contains("read-only is for NBD exports"), "{e}");
}
