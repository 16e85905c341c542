//! A seeded fuzzer for the NBD message parsers and the control protocol, on the stable
//! toolchain: random and mutated byte streams through the handshake and the transmission
//! phase in memory, and the same against a running server over its sockets (with the control
//! socket beside it). Nothing may panic or hang, whatever the server answers must itself be
//! well-formed protocol, and afterwards the server is alive and 16 reference pages written
//! before the storm read back intact.
//!
//! The seeds are fixed so a failure replays; set `UZRAM_FUZZ_ITERS` to run longer
//! (`scripts/fuzz-nbd` does).

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::io::{Cursor, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use uzram_nbd_proto::*;
use uzram_service::frontend::limits::{Deadline, Limits, MemoryBudget};
use uzram_service::frontend::nbd::handshake::{negotiate, PlainIo};
use uzram_service::frontend::nbd::transmission::{transmission, Channel, Context};
use uzram_service::frontend::nbd::Export;
use uzram_testkit::device::new_device;

fn iterations() -> usize {
    std::env::var("UZRAM_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1500)
}

/// A well-formed client session: flags, some options, GO, requests, DISC.
fn valid_session(rng: &mut SmallRng) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
    let opt = |b: &mut Vec<u8>, o: u32, d: &[u8]| {
        b.extend_from_slice(&IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&o.to_be_bytes());
        b.extend_from_slice(&(d.len() as u32).to_be_bytes());
        b.extend_from_slice(d);
    };
    let go = |name: &str, infos: &[u16]| {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    };
    if rng.gen_bool(0.5) {
        opt(&mut b, OPT_LIST, &[]);
    }
    if rng.gen_bool(0.7) {
        opt(&mut b, OPT_STRUCTURED_REPLY, &[]);
    }
    if rng.gen_bool(0.5) {
        opt(
            &mut b,
            OPT_INFO,
            &go("zram0", &[INFO_NAME, INFO_BLOCK_SIZE]),
        );
    }
    if rng.gen_bool(0.8) {
        opt(
            &mut b,
            OPT_GO,
            &go("zram0", &[INFO_BLOCK_SIZE, INFO_DESCRIPTION]),
        );
    } else {
        opt(&mut b, OPT_EXPORT_NAME, b"zram0");
    }
    for i in 0..rng.gen_range(1..20u64) {
        let command = [
            CMD_READ,
            CMD_WRITE,
            CMD_FLUSH,
            CMD_TRIM,
            CMD_WRITE_ZEROES,
            CMD_CACHE,
        ][rng.gen_range(0..6)];
        let length = 512 * rng.gen_range(0..16u32);
        let h = RequestHeader {
            flags: if rng.gen_bool(0.2) { CMD_FLAG_FUA } else { 0 },
            command,
            cookie: i,
            offset: 512 * rng.gen_range(0..600u64),
            length,
        };
        b.extend_from_slice(&h.encode());
        if command == CMD_WRITE {
            b.extend((0..length).map(|_| rng.gen::<u8>()));
        }
    }
    if rng.gen_bool(0.5) {
        b.extend_from_slice(
            &RequestHeader {
                flags: 0,
                command: CMD_DISC,
                cookie: 0,
                offset: 0,
                length: 0,
            }
            .encode(),
        );
    }
    b
}

fn mutate(rng: &mut SmallRng, mut b: Vec<u8>) -> Vec<u8> {
    for _ in 0..rng.gen_range(1..6) {
        if b.is_empty() {
            b.push(rng.gen());
            continue;
        }
        let at = rng.gen_range(0..b.len());
        match rng.gen_range(0..6) {
            0 => b[at] ^= 1 << rng.gen_range(0..8),
            1 => b[at] = rng.gen(),
            2 => {
                // A length-like field set to something extreme.
                let v: u32 =
                    [0, 1, 511, 513, u32::MAX, 1 << 25, (1 << 25) + 512][rng.gen_range(0..7)];
                for (i, x) in v.to_be_bytes().iter().enumerate() {
                    if at + i < b.len() {
                        b[at + i] = *x;
                    }
                }
            }
            3 => b.truncate(at),
            4 => {
                let n = rng.gen_range(1..32);
                let junk: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                b.splice(at..at, junk);
            }
            _ => {
                let end = (at + rng.gen_range(1..32)).min(b.len());
                b.drain(at..end);
            }
        }
    }
    b
}

/// Checks that `out` is a sequence of well-formed structured reply chunks or simple replies
/// with no data (reads without structured replies are not context-free, so only structured
/// sessions are checked).
fn check_structured_replies(out: &[u8]) {
    let mut p = 0;
    while p < out.len() {
        let magic = u32::from_be_bytes(out[p..p + 4].try_into().unwrap());
        match magic {
            SIMPLE_REPLY_MAGIC => p += SIMPLE_REPLY_HEADER_BYTES,
            STRUCTURED_REPLY_MAGIC => {
                let ty = u16::from_be_bytes([out[p + 6], out[p + 7]]);
                let len = u32::from_be_bytes(out[p + 16..p + 20].try_into().unwrap()) as usize;
                let payload = &out[p + 20..p + 20 + len];
                match ty {
                    REPLY_TYPE_NONE => assert_eq!(len, 0),
                    REPLY_TYPE_OFFSET_DATA => assert!(len >= 9),
                    REPLY_TYPE_ERROR => {
                        assert!(len >= 6);
                        let err = u32::from_be_bytes(payload[..4].try_into().unwrap());
                        assert_ne!(err, 0);
                        let mlen = u16::from_be_bytes([payload[4], payload[5]]) as usize;
                        assert_eq!(mlen + 6, len);
                    }
                    t => panic!("unexpected chunk type {t}"),
                }
                p += 20 + len;
            }
            m => panic!("bad reply magic {m:#x} at {p}"),
        }
    }
    assert_eq!(p, out.len());
}

/// The transmission phase's channel, in memory: requests from a byte string, replies into a
/// vector.
struct MemChannel {
    input: Mutex<Cursor<Vec<u8>>>,
    output: Mutex<Vec<u8>>,
    killed: AtomicBool,
}

impl Channel for MemChannel {
    fn recv(&self, buf: &mut [u8], _: Deadline) -> std::io::Result<usize> {
        if self.killed.load(Ordering::SeqCst) {
            return Ok(0);
        }
        self.input.lock().unwrap().read(buf)
    }
    fn recv_idle(&self, buf: &mut [u8], _: Option<Duration>) -> std::io::Result<Option<usize>> {
        self.recv(buf, Deadline::NONE).map(Some)
    }
    fn wait_readable(&self, _: Deadline) -> std::io::Result<()> {
        Ok(())
    }
    fn send_all(&self, buf: &[u8], _: Deadline) -> std::io::Result<()> {
        self.output.lock().unwrap().extend_from_slice(buf);
        Ok(())
    }
    fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
    }
}

/// Runs one session; true if it reached the transmission phase.
fn run_session(input: &[u8], exports: &[Export], budget: &MemoryBudget) -> bool {
    let stop = AtomicBool::new(false);
    let mut io = PlainIo {
        reader: Cursor::new(input),
        writer: Vec::new(),
    };
    let Ok(Some(neg)) = negotiate(&mut io, exports, Some(0), &stop, &mut |_| true) else {
        return false;
    };
    let rest = input[io.reader.position() as usize..].to_vec();
    let ch = MemChannel {
        input: Mutex::new(Cursor::new(rest)),
        output: Mutex::new(Vec::new()),
        killed: AtomicBool::new(false),
    };
    let limits = Limits::default();
    let cx = Context {
        limits: &limits,
        budget,
        stop: &stop,
        workers: 2,
    };
    let device = &*exports[neg.export].device;
    let _ = transmission(&ch, device, &neg, &cx);
    if neg.structured {
        check_structured_replies(&ch.output.lock().unwrap());
    }
    assert_eq!(budget.stats().charged_bytes, 0, "every buffer given back");
    true
}

fn budget() -> MemoryBudget {
    let l = Limits::default();
    MemoryBudget::new(l.max_inflight_bytes, 0, 0, l.idle_release).unwrap()
}

#[test]
fn fuzz_handshake_and_requests_with_mutated_sessions() {
    let exports = vec![Export::new("zram0", new_device(1 << 20))];
    let budget = budget();
    let mut reached = 0;
    for seed in 0..iterations() as u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let session = valid_session(&mut rng);
        let input = if seed % 10 == 0 {
            session
        } else {
            mutate(&mut rng, session)
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_session(&input, &exports, &budget)
        }));
        match r {
            Ok(t) => reached += usize::from(t),
            Err(_) => panic!("seed {seed} failed (UZRAM_FUZZ_ITERS replays it)"),
        }
    }
    // The harness must reach the request parser often, or it tests only the handshake.
    assert!(
        reached > iterations() / 4,
        "only {reached} sessions reached transmission"
    );
}

#[test]
fn fuzz_random_bytes() {
    let exports = vec![Export::new("zram0", new_device(1 << 20))];
    let budget = budget();
    for seed in 0..iterations() as u64 {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0xfeed);
        let len = rng.gen_range(0..512);
        let mut input: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        // Half the time start with a valid flags word so the option parser is reached.
        if seed % 2 == 0 && input.len() >= 12 {
            input[..4].copy_from_slice(&1u32.to_be_bytes());
            input[4..12].copy_from_slice(&IHAVEOPT.to_be_bytes());
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_session(&input, &exports, &budget)
        }));
        assert!(r.is_ok(), "seed {seed} failed");
    }
}

#[test]
fn fuzz_request_classification() {
    // Every header classifies without panicking, and accepted I/O lies inside the export and
    // within the payload limit.
    let mut rng = SmallRng::seed_from_u64(7);
    for _ in 0..200_000 {
        let mut b = [0u8; REQUEST_HEADER_BYTES];
        rng.fill(&mut b[..]);
        b[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        if rng.gen_bool(0.5) {
            b[6] = 0;
            b[7] = rng.gen_range(0..8);
            b[4] = 0;
            b[5] &= 0x1f;
        }
        let h = RequestHeader::parse(&b).unwrap();
        let min_block_bytes = if rng.gen() { MIN_BLOCK_SIZE_BYTES } else { 1 };
        let limits = ExportLimits {
            size_bytes: 512 * rng.gen_range(0..1u64 << 40),
            structured: rng.gen(),
            min_block_bytes,
            block_status: rng.gen(),
            read_only: rng.gen(),
        };
        match classify(&h, limits) {
            Action::Read { offset, length }
            | Action::Write { offset, length, .. }
            | Action::Trim { offset, length, .. }
            | Action::WriteZeroes { offset, length, .. }
            | Action::BlockStatus { offset, length, .. } => {
                if limits.read_only {
                    assert!(!matches!(
                        h.command,
                        CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES
                    ));
                }
                assert!(offset + u64::from(length) <= limits.size_bytes);
                let align = u64::from(min_block_bytes);
                assert!(offset % align == 0 && u64::from(length) % align == 0 && length > 0);
                if matches!(h.command, CMD_READ | CMD_WRITE) {
                    assert!(length <= MAX_PAYLOAD_BYTES);
                }
            }
            Action::Reject {
                error,
                discard_payload,
            } => {
                assert_ne!(error, 0);
                assert!(discard_payload <= MAX_DISCARDED_PAYLOAD_BYTES);
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Against a running server, over its sockets.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;
use uzram_service::frontend::control::ControlServer;
use uzram_service::frontend::nbd::{Listen, Server, ServerConfig};

/// Control requests to mutate: every kind of show, and stores that change nothing lasting
/// (no paths: a mutated `backing_dev` must not name a real file).
const CONTROL_LINES: &[&str] = &[
    r#"{"op":"show","attr":"mm_stat"}"#,
    r#"{"op":"show","attr":"io_stat"}"#,
    r#"{"op":"show","attr":"comp_algorithm"}"#,
    r#"{"op":"show","attr":"disksize"}"#,
    r#"{"op":"store","attr":"idle","value":"all"}"#,
    r#"{"op":"store","attr":"compact","value":"1"}"#,
    r#"{"op":"store","attr":"mem_limit","value":"64M"}"#,
    r#"{"op":"store","attr":"reset","value":"1"}"#,
    r#"{"op":"store","attr":"recompress","value":"type=idle"}"#,
];

fn fuzz_control(rng: &mut SmallRng, socket: &std::path::Path) {
    let Ok(mut s) = UnixStream::connect(socket) else {
        panic!("the control socket is gone");
    };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut input = Vec::new();
    for _ in 0..rng.gen_range(1..5) {
        let line = CONTROL_LINES[rng.gen_range(0..CONTROL_LINES.len())]
            .as_bytes()
            .to_vec();
        let mut line = if rng.gen_bool(0.3) {
            line
        } else {
            mutate(rng, line)
        };
        line.retain(|&b| b != b'\n');
        line.push(b'\n');
        input.extend_from_slice(&line);
    }
    if rng.gen_bool(0.1) {
        input.truncate(rng.gen_range(0..input.len()));
    }
    let _ = s.write_all(&input);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    // Every answer is a JSON line.
    for line in String::from_utf8_lossy(&out).lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON answer line");
        assert!(
            v.get("ok")
                .or(v.get("error"))
                .or(v.get("progress"))
                .is_some(),
            "{line}"
        );
    }
}

fn fuzz_nbd(input: &[u8], socket: &std::path::Path) {
    let mut s = UnixStream::connect(socket).expect("the NBD socket is gone");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("a greeting");
    // The server may close mid-way (a protocol violation): writes then fail, which is fine.
    let _ = s.write_all(input);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
}

#[test]
fn fuzz_a_running_server_and_its_control_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("zram0.sock");
    let fuzzed = Arc::new(
        uzram::device::Device::new(uzram::device::DeviceConfig {
            disksize_bytes: 1 << 20,
            ..Default::default()
        })
        .unwrap(),
    );
    let reference = Arc::new(
        uzram::device::Device::new(uzram::device::DeviceConfig {
            disksize_bytes: 1 << 20,
            ..Default::default()
        })
        .unwrap(),
    );
    let pages: Vec<Vec<u8>> = (0..16).map(|i| uzram_testkit::pages::page(i, 1)).collect();
    for (i, p) in pages.iter().enumerate() {
        reference.write_at(p, i as u64 * 4096).unwrap();
    }
    // Short deadlines, so that truncated sessions end quickly.
    let limits = Limits {
        handshake: Duration::from_secs(2),
        request: Duration::from_secs(2),
        reply: Duration::from_secs(2),
        ..Limits::default()
    };
    let server = Server::start(
        vec![
            Export::new("zram0", Arc::clone(&fuzzed) as Arc<dyn uzram::BlockDevice>),
            Export::new(
                "reference",
                Arc::clone(&reference) as Arc<dyn uzram::BlockDevice>,
            ),
        ],
        &[Listen::Unix {
            path: socket.clone(),
            export: "zram0".into(),
        }],
        ServerConfig {
            log_errors: false,
            limits,
            ..ServerConfig::default()
        },
    )
    .unwrap();
    let ctl = dir.path().join("zram0.ctl");
    let control = ControlServer::start(&ctl, Arc::clone(&fuzzed), server.openers("zram0")).unwrap();
    let iters = (iterations() / 5).max(50);
    for seed in 0..iters as u64 {
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x50c4e7);
        if seed % 8 == 7 {
            fuzz_control(&mut rng, &ctl);
            continue;
        }
        let session = valid_session(&mut rng);
        let input = if seed % 10 == 0 {
            session
        } else {
            mutate(&mut rng, session)
        };
        fuzz_nbd(&input, &socket);
    }
    // Alive: a new client negotiates, writes and reads back (after giving the device its size
    // again if a fuzzed `reset` took it).
    if fuzzed.disksize_bytes() == 0 {
        let mut cc = uzram_service::frontend::control::ControlClient::connect(&ctl).unwrap();
        let store = uzram_service::frontend::control::Request::Store {
            counts: false,
            attr: "disksize".into(),
            value: "1M".into(),
        };
        assert_eq!(cc.call(&store, &mut |_| {}).unwrap(), Ok(String::new()));
    }
    let (mut c, _) = uzram_testkit::nbd::RawClient::handshake(&socket, true);
    let data = uzram_testkit::pages::pattern(8192, 5);
    assert_eq!(c.write(1, 0, &data), 0);
    assert_eq!(c.read(2, 0, 8192).data, data);
    drop(c);
    // The reference pages, through the server, intact.
    let (mut r, _) = uzram_testkit::nbd::RawClient::handshake_export(&socket, "reference", true);
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(
            &r.read(10 + i as u64, i as u64 * 4096, 4096).data,
            p,
            "page {i}"
        );
    }
    drop(r);
    let mut cc = uzram_service::frontend::control::ControlClient::connect(&ctl).unwrap();
    assert!(cc.show("mm_stat").unwrap().is_ok());
    drop(cc);
    control.stop();
    server.stop();
}
