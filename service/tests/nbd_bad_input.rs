//! Bad input at the NBD server, byte by byte: each gets the protocol's error or a clean close
//! of that connection only; other clients go on; no acknowledged write is lost; no panic.

use std::io::{Read, Write};
use uzram::BlockDevice;
use uzram_nbd_proto::*;
use uzram_testkit::nbd::{RawClient, Served};
use uzram_testkit::pages::pattern;
use uzram_testkit::process::assert_private;

const MIB: u64 = 1 << 20;

/// After every bad client, a good one still works.
fn assert_still_serving(srv: &Served) {
    let (mut c, size) = RawClient::handshake(&srv.socket, true);
    assert_eq!(size, srv.device.size_bytes());
    let data = pattern(4096, 99);
    assert_eq!(c.write(1, 8192, &data), 0);
    let r = c.read(2, 8192, 4096);
    assert_eq!(r.error, 0);
    assert!(r.data == data);
}

#[test]
fn socket_is_private() {
    let srv = Served::new(MIB);
    assert_private(&srv.socket);
}

#[test]
fn malformed_handshakes_close_only_that_connection() {
    let srv = Served::new(4 * MIB);
    // Unknown client flags.
    let mut c = RawClient::connect(&srv.socket);
    c.send_client_flags(0x8000_0001);
    assert!(c.is_closed());
    // Bad option magic.
    let mut c = RawClient::fixed_newstyle(&srv.socket);
    c.s.write_all(&[0x55; 16]).unwrap();
    assert!(c.is_closed());
    // Truncated option data, then the client vanishes.
    let mut c = RawClient::fixed_newstyle(&srv.socket);
    c.announce_option(OPT_GO, 100);
    c.s.write_all(&[1, 2, 3]).unwrap();
    drop(c);
    // EXPORT_NAME of an unknown export: the only possible answer is a close.
    let mut c = RawClient::fixed_newstyle(&srv.socket);
    c.send_option(OPT_EXPORT_NAME, b"nope");
    assert!(c.is_closed());
    assert_still_serving(&srv);
}

#[test]
fn options_get_their_replies() {
    let srv = Served::new(4 * MIB);
    let mut c = RawClient::connect(&srv.socket);
    c.send_client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    // Unknown options, TLS, metadata contexts: refused, negotiation goes on.
    for opt in [99, 0, OPT_STARTTLS, 9, 10, 11, 0xffff_ffff] {
        c.send_option(opt, &[]);
        let (o, ty, _) = c.read_option_reply();
        assert_eq!(o, opt);
        assert!(
            ty & (1 << 31) != 0,
            "option {opt} should be refused, got {ty:#x}"
        );
    }
    // LIST with data is invalid; without, lists the export.
    c.send_option(OPT_LIST, b"x");
    assert_eq!(c.read_option_reply().1, REP_ERR_INVALID);
    c.send_option(OPT_LIST, &[]);
    let (_, ty, d) = c.read_option_reply();
    assert_eq!(ty, REP_SERVER);
    assert_eq!(&d[..4], &5u32.to_be_bytes());
    assert_eq!(&d[4..9], b"zram0");
    assert_eq!(c.read_option_reply().1, REP_ACK);
    // Malformed INFO data.
    c.send_option(OPT_INFO, &[0, 0, 0, 9, b'a']);
    assert_eq!(c.read_option_reply().1, REP_ERR_INVALID);
    // Unknown export.
    c.send_option(OPT_INFO, &RawClient::go_data("zram7", &[]));
    assert_eq!(c.read_option_reply().1, REP_ERR_UNKNOWN);
    // STRUCTURED_REPLY with data is invalid.
    c.send_option(OPT_STRUCTURED_REPLY, b"x");
    assert_eq!(c.read_option_reply().1, REP_ERR_INVALID);
    // Oversize option data is swallowed and refused...
    c.send_option(99, &vec![7u8; 100_000]);
    assert_eq!(c.read_option_reply().1, REP_ERR_TOO_BIG);
    // ...and INFO of the default export (empty name) answers with name and block sizes.
    c.send_option(
        OPT_INFO,
        &RawClient::go_data("", &[INFO_NAME, INFO_BLOCK_SIZE]),
    );
    let mut seen = Vec::new();
    loop {
        let (_, ty, d) = c.read_option_reply();
        if ty == REP_ACK {
            break;
        }
        assert_eq!(ty, REP_INFO);
        let info = u16::from_be_bytes([d[0], d[1]]);
        match info {
            INFO_EXPORT => {
                assert_eq!(d.len(), 12);
                assert_eq!(u64::from_be_bytes(d[2..10].try_into().unwrap()), 4 * MIB);
            }
            INFO_NAME => assert_eq!(&d[2..], b"zram0"),
            INFO_BLOCK_SIZE => {
                assert_eq!(d.len(), 14);
                assert_eq!(u32::from_be_bytes(d[2..6].try_into().unwrap()), 512);
                assert_eq!(u32::from_be_bytes(d[6..10].try_into().unwrap()), 4096);
                assert_eq!(u32::from_be_bytes(d[10..14].try_into().unwrap()), 64 << 20);
            }
            _ => {}
        }
        seen.push(info);
    }
    for i in [INFO_EXPORT, INFO_NAME, INFO_BLOCK_SIZE] {
        assert!(seen.contains(&i), "missing info {i}: {seen:?}");
    }
    // ABORT is acknowledged, then the connection closes.
    c.send_option(OPT_ABORT, &[]);
    assert_eq!(c.read_option_reply().1, REP_ACK);
    assert!(c.is_closed());

    // A huge option announcement is a denial of service: closed at once.
    let mut c = RawClient::fixed_newstyle(&srv.socket);
    c.announce_option(OPT_GO, u32::MAX);
    assert!(c.is_closed());
    assert_still_serving(&srv);
}

#[test]
fn export_name_enters_transmission_with_zero_padding() {
    let srv = Served::new(4 * MIB);
    let mut c = RawClient::fixed_newstyle(&srv.socket);
    c.send_option(OPT_EXPORT_NAME, b"");
    let mut b = [0u8; 8 + 2 + 124];
    c.s.read_exact(&mut b).unwrap();
    assert_eq!(u64::from_be_bytes(b[..8].try_into().unwrap()), 4 * MIB);
    let flags = u16::from_be_bytes([b[8], b[9]]);
    assert!(flags & TFLAG_HAS_FLAGS != 0 && flags & TFLAG_SEND_DF == 0);
    assert!(b[10..].iter().all(|&x| x == 0));
    let data = pattern(512, 5);
    assert_eq!(c.write(9, 3 * MIB, &data), 0);
    assert!(c.read(10, 3 * MIB, 512).data == data);
}

#[test]
fn bad_requests_get_errors_and_the_connection_goes_on() {
    for structured in [false, true] {
        let srv = Served::new(4 * MIB);
        let (mut c, size) = RawClient::handshake(&srv.socket, structured);
        let good = pattern(8192, 3);
        assert_eq!(c.write(1, 0, &good), 0);
        // Reads past the end, straddling the end, with offset overflow: EINVAL.
        assert_eq!(c.read(2, size, 512).error, NBD_EINVAL);
        assert_eq!(c.read(3, size - 512, 1024).error, NBD_EINVAL);
        assert_eq!(c.read(4, u64::MAX - 511, 1024).error, NBD_EINVAL);
        // Writes past the end: ENOSPC, and the payload is swallowed (the stream stays in sync).
        assert_eq!(c.write(5, size - 512, &[1u8; 1024]), NBD_ENOSPC);
        // Unaligned: EINVAL (payload swallowed).
        assert_eq!(c.read(6, 1, 512).error, NBD_EINVAL);
        assert_eq!(c.write(7, 512, &[1u8; 100]), NBD_EINVAL);
        // Unknown command, unknown flags, DF without structured replies.
        c.send_request(42, 0, 8, 0, 0);
        assert_eq!(c.read_reply(0).error, NBD_EINVAL);
        c.send_request(CMD_READ, 1 << 9, 9, 0, 512);
        assert_eq!(c.read_reply(512).error, NBD_EINVAL);
        c.send_request(CMD_WRITE, CMD_FLAG_NO_HOLE, 10, 0, 512);
        c.s.write_all(&[9u8; 512]).unwrap();
        assert_eq!(c.read_reply(0).error, NBD_EINVAL);
        c.send_request(CMD_READ, CMD_FLAG_DF, 11, 0, 512);
        let r = c.read_reply(512);
        assert_eq!(r.error, if structured { 0 } else { NBD_EINVAL });
        // Oversize read: EINVAL. Oversize write (a little over): EINVAL, payload swallowed.
        assert_eq!(c.read(12, 0, MAX_PAYLOAD_BYTES + 512).error, NBD_EINVAL);
        let big = vec![3u8; (MAX_PAYLOAD_BYTES + 512) as usize];
        assert_eq!(c.write(13, 0, &big), NBD_EINVAL);
        // Zero-length requests succeed and do nothing.
        assert_eq!(c.read(14, 0, 0).error, 0);
        // None of the refused writes changed anything.
        let r = c.read(15, 0, 8192);
        assert_eq!(r.error, 0);
        assert!(r.data == good, "a refused write changed data");
        let mut tail = vec![0u8; 512];
        srv.device.read_at(&mut tail, size - 512).unwrap();
        assert!(
            tail.iter().all(|&b| b == 0),
            "refused write past the end landed"
        );
        // FLUSH, TRIM, WRITE_ZEROES with their flags.
        c.send_request(CMD_FLUSH, 0, 16, 0, 0);
        assert_eq!(c.read_reply(0).error, 0);
        c.send_request(
            CMD_WRITE_ZEROES,
            CMD_FLAG_NO_HOLE | CMD_FLAG_FUA,
            17,
            4096,
            4096,
        );
        assert_eq!(c.read_reply(0).error, 0);
        c.send_request(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 18, 0, 512);
        assert_eq!(c.read_reply(0).error, 0);
        c.send_request(CMD_TRIM, CMD_FLAG_FUA, 19, MIB, 2 * MIB as u32);
        assert_eq!(c.read_reply(0).error, 0);
        let r = c.read(20, 0, 8192);
        assert!(r.data[..512].iter().all(|&b| b == 0));
        assert!(r.data[512..4096] == good[512..4096]);
        assert!(r.data[4096..].iter().all(|&b| b == 0));
        // A write announcing a gigabyte is cut off; so is a bad request magic.
        c.send_request(CMD_WRITE, 0, 21, 0, 1 << 30);
        assert!(c.is_closed());
        let (mut c, _) = RawClient::handshake(&srv.socket, structured);
        c.s.write_all(&[0xee; 28]).unwrap();
        assert!(c.is_closed());
        assert_still_serving(&srv);
    }
}

#[test]
fn a_client_vanishing_mid_write_loses_nothing_acknowledged() {
    let srv = Served::new(4 * MIB);
    let (mut a, _) = RawClient::handshake(&srv.socket, false);
    let old = pattern(65536, 7);
    assert_eq!(a.write(1, MIB, &old), 0);
    // Half a payload, then gone.
    a.send_request(CMD_WRITE, 0, 2, MIB, 65536);
    a.s.write_all(&[0xff; 30000]).unwrap();
    drop(a);
    // Pipelined writes without waiting for replies, then gone: whatever was acknowledged is
    // there; whatever was not is either entirely old or entirely new per request.
    let (mut b, _) = RawClient::handshake(&srv.socket, false);
    for i in 0..32u64 {
        b.send_request(CMD_WRITE, 0, 100 + i, 2 * MIB + i * 4096, 4096);
        b.s.write_all(&pattern(4096, 100 + i)).unwrap();
    }
    let mut acked = Vec::new();
    for _ in 0..10 {
        let r = b.read_reply(0);
        assert_eq!(r.error, 0);
        acked.push(r.cookie);
    }
    drop(b);
    let (mut c, _) = RawClient::handshake(&srv.socket, true);
    let r = c.read(3, MIB, 65536);
    assert!(
        r.data == old,
        "an unacknowledged partial write changed data"
    );
    for cookie in acked {
        let i = cookie - 100;
        let r = c.read(cookie, 2 * MIB + i * 4096, 4096);
        assert!(
            r.data == pattern(4096, cookie),
            "acknowledged write {i} lost"
        );
    }
}

#[test]
fn many_requests_in_flight_are_all_answered() {
    let srv = Served::new(16 * MIB);
    let (mut c, _) = RawClient::handshake(&srv.socket, true);
    let mut w = c.s.try_clone().unwrap();
    // Send 200 writes of varied sizes from another thread while reading replies here.
    let sender = std::thread::spawn(move || {
        for i in 0..200u64 {
            let len = 512 * (1 + (i % 16));
            let h = RequestHeader {
                flags: if i % 7 == 0 { CMD_FLAG_FUA } else { 0 },
                command: CMD_WRITE,
                cookie: i,
                offset: i * 65536,
                length: len as u32,
            };
            w.write_all(&h.encode()).unwrap();
            w.write_all(&pattern(len as usize, i)).unwrap();
        }
    });
    let mut seen = [false; 200];
    for _ in 0..200 {
        let r = c.read_reply(0);
        assert_eq!(r.error, 0);
        assert!(!seen[r.cookie as usize], "duplicate reply {}", r.cookie);
        seen[r.cookie as usize] = true;
    }
    sender.join().unwrap();
    // Pipelined reads, replies in any order.
    for i in 0..200u64 {
        let len = 512 * (1 + (i % 16));
        c.send_request(CMD_READ, 0, i, i * 65536, len as u32);
    }
    let mut got = 0;
    for _ in 0..200 {
        let r = c.read_reply(0);
        assert_eq!(r.error, 0);
        let len = 512 * (1 + (r.cookie % 16));
        assert!(
            r.data == pattern(len as usize, r.cookie),
            "read {} wrong",
            r.cookie
        );
        got += 1;
    }
    assert_eq!(got, 200);
}

#[test]
fn several_connections_at_once_while_bad_clients_come_and_go() {
    let srv = std::sync::Arc::new(Served::new(32 * MIB));
    let mut threads = Vec::new();
    for t in 0..4u64 {
        let srv = std::sync::Arc::clone(&srv);
        threads.push(std::thread::spawn(move || {
            let (mut c, _) = RawClient::handshake(&srv.socket, t % 2 == 0);
            for i in 0..100u64 {
                let off = (t * 8 + (i % 8)) * MIB;
                let data = pattern(16384, t * 1000 + i);
                assert_eq!(c.write(i, off, &data), 0);
                let r = c.read(i, off, 16384);
                assert!(r.data == data, "conn {t} read {i} wrong");
            }
        }));
    }
    for _ in 0..50 {
        let mut c = RawClient::connect(&srv.socket);
        c.s.write_all(&[0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0])
            .unwrap();
        drop(c);
        let (mut c, _) = RawClient::handshake(&srv.socket, false);
        c.send_request(CMD_WRITE, 0, 1, 0, 4096);
        drop(c);
    }
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn stop_answers_what_was_read_and_removes_the_socket() {
    let mut srv = Served::new(8 * MIB);
    let (mut c, _) = RawClient::handshake(&srv.socket, false);
    for i in 0..64u64 {
        c.send_request(CMD_WRITE, 0, i, i * 4096, 4096);
        c.s.write_all(&pattern(4096, i)).unwrap();
    }
    // Wait for the first reply so the server is surely busy with this connection.
    let first = c.read_reply(0);
    assert_eq!(first.error, 0);
    let device = std::sync::Arc::clone(&srv.device);
    let socket = srv.socket.clone();
    let stopper = std::thread::spawn(move || {
        srv.stop();
        srv
    });
    let mut acked = vec![first.cookie];
    loop {
        let mut m = [0u8; 16];
        match c.s.read_exact(&mut m) {
            Ok(()) => {
                assert_eq!(
                    u32::from_be_bytes(m[..4].try_into().unwrap()),
                    SIMPLE_REPLY_MAGIC
                );
                assert_eq!(u32::from_be_bytes(m[4..8].try_into().unwrap()), 0);
                acked.push(u64::from_be_bytes(m[8..16].try_into().unwrap()));
            }
            Err(_) => break,
        }
    }
    let _srv = stopper.join().unwrap();
    assert!(!socket.exists(), "socket file left behind");
    for i in acked {
        let mut buf = vec![0u8; 4096];
        device.read_at(&mut buf, i * 4096).unwrap();
        assert!(
            buf == pattern(4096, i),
            "acknowledged write {i} lost at stop"
        );
    }
}

/// A client that asked for no block sizes (GO without `NBD_INFO_BLOCK_SIZE`, or
/// `EXPORT_NAME`) may send any byte offset and length, as the protocol says a server should
/// then accept: reads and writes of odd bytes land exactly, against a byte model; trims and
/// zeroes of odd ranges work; the transmission flags offer `SEND_CACHE`; past the end is still
/// refused.
#[test]
fn unaligned_requests_from_a_client_without_block_sizes() {
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    for export_name in [false, true] {
        let srv = Served::new(MIB);
        let mut c = RawClient::connect(&srv.socket);
        c.send_client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
        let flags = if export_name {
            c.send_option(OPT_EXPORT_NAME, b"zram0");
            let mut b = [0u8; 10];
            c.s.read_exact(&mut b).unwrap();
            u16::from_be_bytes([b[8], b[9]])
        } else {
            c.send_option(OPT_GO, &RawClient::go_data("zram0", &[]));
            let mut flags = 0;
            loop {
                let (_, ty, d) = c.read_option_reply();
                if ty == REP_ACK {
                    break;
                }
                assert_eq!(ty, REP_INFO);
                if u16::from_be_bytes([d[0], d[1]]) == INFO_EXPORT {
                    flags = u16::from_be_bytes([d[10], d[11]]);
                }
            }
            flags
        };
        assert!(flags & TFLAG_SEND_CACHE != 0, "{flags:#x}");
        let mut model = vec![0u8; MIB as usize];
        let mut rng = SmallRng::seed_from_u64(export_name as u64);
        for cookie in 0..400u64 {
            let off = rng.gen_range(0..MIB - 1);
            let len = rng.gen_range(1..=(MIB - off).min(10_000)) as u32;
            let (o, l) = (off as usize, len as usize);
            match cookie % 4 {
                0 | 1 => {
                    let data: Vec<u8> = (0..l).map(|_| rng.gen()).collect();
                    assert_eq!(c.write(cookie, off, &data), 0, "write {off}+{len}");
                    model[o..o + l].copy_from_slice(&data);
                }
                2 => {
                    c.send_request(CMD_WRITE_ZEROES, 0, cookie, off, len);
                    assert_eq!(c.read_reply(0).error, 0, "zero {off}+{len}");
                    model[o..o + l].fill(0);
                }
                _ => {
                    let r = c.read(cookie, off, len);
                    assert_eq!(r.error, 0);
                    assert!(r.data == model[o..o + l], "read {off}+{len}");
                }
            }
        }
        // An odd trim succeeds; its partial pages keep their bytes (only whole pages go).
        c.send_request(CMD_TRIM, 0, 1000, 3, 3 * 4096 + 10);
        assert_eq!(c.read_reply(0).error, 0);
        model[4096..3 * 4096].fill(0);
        c.send_request(CMD_CACHE, 0, 1001, 7, 9);
        assert_eq!(c.read_reply(0).error, 0);
        let r = c.read(1002, 0, MIB as u32);
        assert!(r.data == model, "the whole export");
        assert_eq!(c.write(1003, MIB - 1, &[1, 2]), NBD_ENOSPC);
        assert_eq!(c.read(1005, 0, MAX_PAYLOAD_BYTES + 1).error, NBD_EINVAL);
        assert_eq!(c.read(1004, MIB, 1).error, NBD_EINVAL);
        assert_still_serving(&srv);
    }
}

/// The largest request the server takes, 64 MiB (nbdkit's maximum), each way in one request;
/// a byte more is refused and the connection goes on.
#[test]
fn the_largest_request_is_64_mib() {
    assert_eq!(MAX_PAYLOAD_BYTES, 64 << 20);
    let srv = Served::new(MAX_PAYLOAD_BYTES as u64 + MIB);
    let (mut c, _) = RawClient::handshake(&srv.socket, true);
    let data = pattern(MAX_PAYLOAD_BYTES as usize, 8);
    assert_eq!(c.write(1, MIB, &data), 0);
    let r = c.read(2, MIB, MAX_PAYLOAD_BYTES);
    assert_eq!(r.error, 0);
    assert!(r.data == data, "64 MiB read back differs");
    assert_eq!(c.read(3, 0, MAX_PAYLOAD_BYTES + 512).error, NBD_EINVAL);
    assert_still_serving(&srv);
}

/// A client whose handshake has ended holds the export open at once (as an opened zram disk:
/// `reset` and `hot_remove` are refused), by `GO` and by `EXPORT_NAME`: the server counts the
/// opener before its last handshake reply, not after. Many times over, as the gap this closes
/// was a race.
#[test]
fn a_finished_handshake_holds_the_export_open() {
    let srv = Served::new(MIB);
    let openers = srv.server.as_ref().unwrap().openers("zram0").unwrap();
    for i in 0..300 {
        let c = if i % 2 == 0 {
            RawClient::handshake(&srv.socket, true).0
        } else {
            let mut c = RawClient::fixed_newstyle(&srv.socket);
            c.send_option(OPT_EXPORT_NAME, b"");
            let mut b = [0u8; 8 + 2 + 124];
            c.s.read_exact(&mut b).unwrap();
            c
        };
        assert_eq!(
            openers.count(),
            1,
            "handshake {i} ended, the export not counted open"
        );
        drop(c);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while openers.count() != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the opener never left"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
