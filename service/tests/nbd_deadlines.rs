//! Deadlines are totals, measured as a raw client meets them: a handshake trickled one byte at
//! a time, a request whose payload stops arriving, a client that does not take its replies;
//! and a connection idle between requests is legitimate and stays. The server runs in this
//! process with short deadlines (1 s) so the tests take seconds.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};
use uzram_nbd_proto::*;
use uzram_service::frontend::limits::Limits;
use uzram_service::frontend::nbd::{Export, Listen, Server, ServerConfig};
use uzram_testkit::device::new_device;
use uzram_testkit::nbd::{RawClient, Served};
use uzram_testkit::pages::pattern;

const DEADLINE: Duration = Duration::from_secs(1);

fn served() -> (Server, tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("zram0.sock");
    let server = Server::start(
        vec![Export::new("zram0", new_device(64 << 20))],
        &[Listen::Unix {
            path: socket.clone(),
            export: "zram0".into(),
        }],
        ServerConfig {
            log_errors: false,
            limits: Limits {
                handshake: DEADLINE,
                request: DEADLINE,
                reply: DEADLINE,
                ..Limits::default()
            },
            ..ServerConfig::default()
        },
    )
    .unwrap();
    (server, dir, socket)
}

/// Waits until the server closes `s` (reads return 0 or fail); returns how long it took.
fn time_to_close(s: &mut UnixStream) -> Duration {
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return t.elapsed(),
            Ok(_) => {}
        }
    }
}

#[test]
fn a_trickled_handshake_ends_at_the_total_deadline() {
    let (server, _d, socket) = served();
    let mut c = RawClient::connect(&socket);
    let t = Instant::now();
    // One byte of the client flags every 300 ms: each read is quick, the whole is not.
    let flags = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes();
    let mut closed = false;
    for b in flags
        .iter()
        .chain(IHAVEOPT.to_be_bytes().iter())
        .cycle()
        .take(40)
    {
        std::thread::sleep(Duration::from_millis(300));
        if c.s.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
        if t.elapsed() > 3 * DEADLINE {
            break;
        }
    }
    let waited = if closed {
        t.elapsed()
    } else {
        time_to_close(&mut c.s) + t.elapsed()
    };
    assert!(
        waited < 3 * DEADLINE,
        "the handshake went on for {waited:?} (deadline {DEADLINE:?})"
    );
    // Others are served meanwhile and after.
    let (mut ok, _) = RawClient::handshake(&socket, false);
    assert_eq!(ok.write(1, 0, &pattern(4096, 1)), 0);
    drop(ok);
    server.stop();
}

#[test]
fn a_stalled_payload_is_dropped_and_writes_nothing() {
    let (server, _d, socket) = served();
    let (mut c, _) = RawClient::handshake(&socket, false);
    c.send_request(CMD_WRITE, 0, 1, 0, 1 << 20);
    c.s.write_all(&pattern(100 << 10, 3)).unwrap();
    let waited = time_to_close(&mut c.s);
    assert!(
        waited < 3 * DEADLINE,
        "a stalled write held its connection {waited:?}"
    );
    assert_eq!(
        server.budget().stats().charged_bytes,
        0,
        "its buffer was given back"
    );
    // Nothing of it was written.
    let (mut r, _) = RawClient::handshake(&socket, false);
    assert!(r.read(2, 0, 1 << 20).data.iter().all(|&b| b == 0));
    drop(r);
    server.stop();
}

#[test]
fn a_header_trickled_across_the_deadline_is_dropped() {
    let (server, _d, socket) = served();
    let (mut c, _) = RawClient::handshake(&socket, false);
    let h = RequestHeader {
        flags: 0,
        command: CMD_READ,
        cookie: 1,
        offset: 0,
        length: 4096,
    }
    .encode();
    let t = Instant::now();
    let mut closed = false;
    for b in h {
        std::thread::sleep(Duration::from_millis(200));
        if c.s.write_all(&[b]).is_err() {
            closed = true;
            break;
        }
    }
    let waited = if closed {
        t.elapsed()
    } else {
        t.elapsed() + time_to_close(&mut c.s)
    };
    // 28 bytes × 200 ms is far past the deadline, counted from the first byte.
    assert!(waited < 3 * DEADLINE, "the header went on for {waited:?}");
    drop(c);
    server.stop();
}

#[test]
fn an_idle_connection_stays_and_is_served_later() {
    let (server, _d, socket) = served();
    let (mut c, _) = RawClient::handshake(&socket, true);
    let data = pattern(65536, 9);
    assert_eq!(c.write(1, 4096, &data), 0);
    // Idle for three deadlines: legitimate (a swap device may sit unused for hours).
    std::thread::sleep(3 * DEADLINE);
    assert_eq!(c.read(2, 4096, 65536).data, data);
    assert_eq!(server.connections(), 1);
    // Idle, it gave its buffers back.
    std::thread::sleep(2 * DEADLINE);
    assert_eq!(server.budget().stats().held_bytes, 0);
    drop(c);
    server.stop();
}

#[test]
fn a_client_not_taking_its_replies_is_dropped_at_the_reply_deadline() {
    let (server, _d, socket) = served();
    let (c, _) = RawClient::handshake(&socket, false);
    // 64 reads of 1 MiB and no reply taken: the socket fills, the reply waits, the deadline
    // ends it.
    for i in 0..64u64 {
        let h = RequestHeader {
            flags: 0,
            command: CMD_READ,
            cookie: i,
            offset: i << 20,
            length: 1 << 20,
        };
        (&c.s).write_all(&h.encode()).unwrap();
    }
    let t = Instant::now();
    let deadline = t + Duration::from_secs(20);
    while server.connections() > 0 {
        assert!(Instant::now() < deadline, "still connected");
        std::thread::sleep(Duration::from_millis(20));
    }
    let waited = t.elapsed();
    assert!(waited < 4 * DEADLINE, "dropped after {waited:?}");
    assert_eq!(server.budget().stats().charged_bytes, 0);
    drop(c);
    server.stop();
}

#[test]
fn a_stop_ends_handshakes_at_once() {
    // Default limits: a 10 s handshake deadline, so only the quit fd can end these quickly.
    let served = Served::new(16 << 20);
    let mut waiting: Vec<RawClient> = (0..3).map(|_| RawClient::connect(&served.socket)).collect();
    // One is half-way through its options.
    waiting[0].send_client_flags(FLAG_C_FIXED_NEWSTYLE);
    let mut served = served;
    let t = Instant::now();
    served.stop();
    let took = t.elapsed();
    assert!(took < Duration::from_millis(1500), "stop took {took:?}");
    for c in &mut waiting {
        assert!(c.is_closed());
    }
}
