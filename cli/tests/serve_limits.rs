//! The bugs as an attacker or a careless operator meets them, against the built
//! `uzram serve`: header-only requests that used to pin 32 MiB each, connection floods, clients
//! that stop reading replies, signals with socket files gone, a second local user preparing
//! the socket directory. Memory is checked from `/proc/PID/status` (deterministic amounts, no
//! timing asserted); stops are checked to end within seconds.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use uzram_nbd_proto::*;
use uzram_testkit::nbd::RawClient;
use uzram_testkit::pages::pattern;
use uzram_testkit::process::{is_root, proc_field, require, run};
use uzram_testkit::serve::{uzram_bin, Running, Serve};

const MIB: u64 = 1 << 20;
/// `uzram serve`'s default request memory budget (`Limits::default().max_inflight_bytes`).
const BUDGET: u64 = 128 * MIB;

/// Starts `uzram serve --disksize 256M --socket DIR/zram0.sock ARGS`; waits until it serves.
fn serve(args: &[&str]) -> Running {
    Serve::args(&["--disksize", "256M", "--socket", "{dir}/zram0.sock"])
        .arg(args)
        .start()
}

/// A field of /proc/PID/status in KiB (or a count).
fn status_field(pid: u32, field: &str) -> u64 {
    proc_field(&format!("/proc/{pid}/status"), field)
}

fn rss_bytes(pid: u32) -> u64 {
    status_field(pid, "VmRSS") * 1024
}

/// Waits until the server runs `n` connection threads or fewer (connections end
/// asynchronously after their clients close).
fn wait_threads_at_most(pid: u32, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while status_field(pid, "Threads") > n {
        if Instant::now() > deadline {
            let names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
                .unwrap()
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .map(|n| n.trim().to_string())
                .collect();
            panic!("connection threads did not end: {names:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / MIB as f64
}

/// 64 connections each send one 32 MiB WRITE header and nothing else; then 64 connections
/// each ask for two 32 MiB READs and take the replies; then idle; then all close. Returns
/// (RSS before, most RSS while the headers wait, most RSS while reading, RSS when idle, RSS
/// after they closed).
fn flood_round(r: &Running) -> [u64; 5] {
    let pid = r.pid();
    let threads_at_rest = status_field(pid, "Threads");
    let start = rss_bytes(pid);
    let mut headers = Vec::new();
    for i in 0..64u64 {
        let (mut c, _) = RawClient::handshake(&r.socket("zram0"), false);
        c.send_request(CMD_WRITE, 0, i, 0, 32 << 20);
        headers.push(c);
    }
    // The server has read every header once each connection's reader waits for the payload;
    // give it a moment, then sample (memory, not time, is what is checked).
    std::thread::sleep(Duration::from_millis(500));
    let with_headers = rss_bytes(pid);
    // Meanwhile a legitimate client is served.
    let (mut legit, _) = RawClient::handshake(&r.socket("zram0"), false);
    let data = pattern(1 << 20, 7);
    assert_eq!(legit.write(1, 64 * MIB, &data), 0);
    assert_eq!(legit.read(2, 64 * MIB, 1 << 20).data, data);
    drop(legit);
    // Reads: 64 connections × 2 × 32 MiB, all replies taken (in parallel).
    let path = r.socket("zram0");
    let peak_reading = std::thread::scope(|s| {
        let socket = &path;
        let readers: Vec<_> = (0..64u64)
            .map(|i| {
                s.spawn(move || {
                    let (mut c, _) = RawClient::handshake(socket, false);
                    c.send_request(CMD_READ, 0, 2 * i, 0, 32 << 20);
                    c.send_request(CMD_READ, 0, 2 * i + 1, 32 << 20, 32 << 20);
                    // Simple replies: 16-byte header, then the data, streamed through 1 MiB.
                    let mut chunk = vec![0u8; 1 << 20];
                    for _ in 0..2 {
                        let mut h = [0u8; 16];
                        c.s.read_exact(&mut h).unwrap();
                        assert_eq!(u32::from_be_bytes(h[4..8].try_into().unwrap()), 0);
                        for _ in 0..32 {
                            c.s.read_exact(&mut chunk).unwrap();
                            assert!(chunk.iter().all(|&b| b == 0));
                        }
                    }
                    c
                })
            })
            .collect();
        let mut peak = 0;
        while readers.iter().any(|t| !t.is_finished()) {
            peak = peak.max(rss_bytes(pid));
            std::thread::sleep(Duration::from_millis(5));
        }
        let clients: Vec<_> = readers.into_iter().map(|t| t.join().unwrap()).collect();
        // Idle: the recycled buffers are given back (1 s of idleness; sampled after 3).
        std::thread::sleep(Duration::from_secs(3));
        peak = peak.max(rss_bytes(pid));
        drop(clients);
        peak
    });
    let idle = rss_bytes(pid);
    drop(headers);
    wait_threads_at_most(pid, threads_at_rest);
    std::thread::sleep(Duration::from_millis(200));
    [start, with_headers, peak_reading, idle, rss_bytes(pid)]
}

/// The figure, twice: the first round warms the process up (thread stacks the C
/// library caches, its arenas), the second must return to where the first left it.
fn flood_keeps_memory_within_the_budget(args: &[&str]) {
    let r = serve(args);
    let rounds = [flood_round(&r), flood_round(&r)];
    for (i, [start, headers, reading, idle, end]) in rounds.iter().copied().enumerate() {
        eprintln!(
            "round {i} ({args:?}): RSS start {:.1} MiB, 64 header-only writes {:.1}, reading \
             peak {:.1}, idle {:.1}, closed {:.1}",
            mib(start),
            mib(headers),
            mib(reading),
            mib(idle),
            mib(end)
        );
        assert!(
            headers <= start + 16 * MIB,
            "header-only writes pinned {:.1} MiB",
            mib(headers - start)
        );
        assert!(
            reading <= start + BUDGET + 16 * MIB,
            "reads held {:.1} MiB over the start",
            mib(reading - start)
        );
        assert!(
            idle <= start + 16 * MIB,
            "idle connections kept {:.1} MiB",
            mib(idle.saturating_sub(start))
        );
    }
    let [warm, .., end] = rounds[1];
    assert!(
        end <= warm + warm / 10,
        "RSS {:.1} MiB after the clients left, {:.1} MiB before",
        mib(end),
        mib(warm)
    );
}

#[test]
fn header_only_writes_and_large_reads_stay_within_the_budget() {
    flood_keeps_memory_within_the_budget(&["--max-connections", "200"]);
}

#[test]
fn header_only_writes_and_large_reads_stay_within_the_budget_under_swap() {
    assert!(
        is_root(),
        "--swap locks memory only as root (CI runs as root)"
    );
    flood_keeps_memory_within_the_budget(&["--swap", "--max-connections", "200"]);
}

#[test]
fn sigterm_stops_when_the_socket_files_are_gone() {
    let mut r = serve(&[]);
    let (mut c, _) = RawClient::handshake(&r.socket("zram0"), false);
    assert_eq!(c.write(1, 0, &pattern(4096, 1)), 0);
    std::fs::remove_file(r.dir().join("zram0.ctl")).unwrap();
    std::fs::remove_file(r.socket("zram0")).unwrap();
    let t = Instant::now();
    r.signal("-TERM");
    let s = r.wait_exit(Duration::from_secs(10));
    assert!(s.success(), "{s:?}");
    eprintln!("stopped in {:?}", t.elapsed());
}

#[test]
fn sighup_stops_cleanly_and_removes_the_sockets() {
    let mut r = serve(&[]);
    r.signal("-HUP");
    assert!(r.wait_exit(Duration::from_secs(10)).success());
    assert!(!r.socket("zram0").exists() && !r.dir().join("zram0.ctl").exists());
}

/// Sends 400 READs of 1 MiB and reads no reply.
fn stall_with_reads(mut s: impl Write) {
    for i in 0..400u64 {
        let h = RequestHeader {
            flags: 0,
            command: CMD_READ,
            cookie: i,
            offset: (i % 200) * MIB,
            length: 1 << 20,
        };
        if s.write_all(&h.encode()).is_err() {
            break; // The server stopped reading (budget spent): enough.
        }
    }
}

#[test]
fn a_client_that_stops_reading_replies_does_not_hold_the_stop() {
    for tcp in [false, true] {
        let mut r = serve(&["--listen", "127.0.0.1:0"]);
        let (c, _) = RawClient::handshake(&r.socket("zram0"), false);
        let staller = if tcp {
            let mut s = std::net::TcpStream::connect(r.tcp_addr()).unwrap();
            nbd_handshake(&mut s);
            s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
            stall_with_reads(&s);
            Some(s)
        } else {
            c.s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
            stall_with_reads(&c.s);
            None
        };
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        r.signal("-TERM");
        let s = r.wait_exit(Duration::from_secs(10));
        assert!(s.success(), "{s:?}");
        assert!(!r.socket("zram0").exists());
        eprintln!(
            "tcp {tcp}: stopped in {:?} with a client not reading",
            t.elapsed()
        );
        drop((c, staller));
    }
}

#[test]
fn a_second_signal_forces_the_exit() {
    let mut r = serve(&[]);
    let (c, _) = RawClient::handshake(&r.socket("zram0"), false);
    c.s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    stall_with_reads(&c.s);
    r.signal("-TERM");
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    r.signal("-INT");
    let s = r.wait_exit(Duration::from_secs(5));
    assert_eq!(s.code(), Some(128 + libc::SIGINT), "{}", r.log());
    assert!(r.log().contains("SIGINT again: exiting now"), "{}", r.log());
    assert!(!r.socket("zram0").exists() && !r.dir().join("zram0.ctl").exists());
    eprintln!("forced exit in {:?}", t.elapsed());
    drop(c);
}

/// The client side of a fixed newstyle handshake with GO on `zram0` (no structured replies).
fn nbd_handshake(s: &mut (impl Read + Write)) {
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    let data = RawClient::go_data("zram0", &[]);
    let mut o = IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&OPT_GO.to_be_bytes());
    o.extend_from_slice(&(data.len() as u32).to_be_bytes());
    o.extend_from_slice(&data);
    s.write_all(&o).unwrap();
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        s.read_exact(&mut d).unwrap();
        if ty == REP_ACK {
            return;
        }
        assert_eq!(ty, REP_INFO, "GO failed");
    }
}

#[test]
fn a_connection_flood_is_refused_and_the_served_client_goes_on() {
    let r = serve(&["--max-connections", "8"]);
    let pid = r.pid();
    let (mut legit, _) = RawClient::handshake(&r.socket("zram0"), true);
    let mut held = Vec::new();
    let mut refused = 0;
    for i in 0..300u64 {
        let mut s = UnixStream::connect(r.socket("zram0")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut g = [0u8; 18];
        match s.read(&mut g) {
            Ok(0) | Err(_) => refused += 1, // Closed at once, no greeting.
            Ok(_) => held.push(s),          // Within the cap: greeted, left hanging.
        }
        if i % 50 == 0 {
            // The served client is served all along.
            let data = pattern(65536, i);
            assert_eq!(legit.write(i, i * 65536, &data), 0);
            assert_eq!(legit.read(i + 1000, i * 65536, 65536).data, data);
        }
    }
    assert_eq!(held.len(), 7, "the cap is 8, one is the served client");
    assert_eq!(refused, 293);
    // 8 connections: a reader and 2+ workers each at most, plus the accept and main threads.
    let threads = status_field(pid, "Threads");
    assert!(threads <= 8 * 9 + 8, "{threads} threads");
    assert!(
        r.log()
            .contains("connection refused: 8 connections already"),
        "{}",
        r.log()
    );
    let data = pattern(4096, 99);
    assert_eq!(legit.write(9, 0, &data), 0);
    assert_eq!(legit.read(10, 0, 4096).data, data);
}

#[test]
fn the_control_socket_is_capped_and_a_silent_client_is_dropped() {
    let r = serve(&[]);
    let ctl = r.dir().join("zram0.ctl");
    let mut silent = Vec::new();
    for _ in 0..16 {
        silent.push(UnixStream::connect(&ctl).unwrap());
    }
    std::thread::sleep(Duration::from_millis(200));
    let mut extra = UnixStream::connect(&ctl).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut b = [0u8; 1];
    assert!(
        matches!(extra.read(&mut b), Ok(0) | Err(_)),
        "the 17th is closed"
    );
    // A client that sends half a request line is dropped after the request deadline (10 s).
    let mut half = silent.pop().unwrap();
    half.write_all(b"{\"op\":\"sh").unwrap();
    half.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let t = Instant::now();
    assert!(matches!(half.read(&mut b), Ok(0) | Err(_)));
    let waited = t.elapsed();
    assert!(waited < Duration::from_secs(15), "dropped after {waited:?}");
    drop(silent);
    std::thread::sleep(Duration::from_millis(200));
    let out = Command::new(uzram_bin())
        .args(["ctl", "--dir"])
        .arg(r.dir())
        .arg("disksize")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "268435456");
}

#[test]
fn listening_beyond_loopback_without_tls_warns() {
    let r = serve(&["--listen", "0.0.0.0:0"]);
    assert!(
        r.log().contains("without TLS: anyone who can reach it"),
        "{}",
        r.log()
    );
    let r = serve(&["--listen", "127.0.0.1:0"]);
    assert!(!r.log().contains("warning"), "{}", r.log());
}

#[test]
fn a_socket_directory_writable_by_others_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let socket = open.join("zram0.sock");
    let err = Serve::args(&["--disksize", "16M", "--socket", socket.to_str().unwrap()])
        .refused()
        .stderr;
    assert!(err.contains("writable by others"), "{err}");
}

/// A system user for the test, created once (`useradd`; CI runs as root): (uid, gid).
fn user(name: &str) -> (u32, u32) {
    let id = |flag: &str| {
        Command::new("id")
            .args([flag, name])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .trim()
                    .parse::<u32>()
                    .unwrap()
            })
    };
    if id("-u").is_none() {
        let out = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                name,
            ])
            .output()
            .unwrap();
        // Another test process may have created it meanwhile.
        assert!(
            out.status.success() || id("-u").is_some(),
            "useradd {name}: {out:?}"
        );
    }
    (id("-u").unwrap(), id("-g").unwrap())
}

/// Runs `BIN ARGS` as `(uid, gid)` without XDG_RUNTIME_DIR (a copy of the binary in a
/// world-readable place, since the build directory may be private to root).
fn as_user(who: (u32, u32), bin: &Path, args: &[&str]) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        &format!("--reuid={}", who.0),
        &format!("--regid={}", who.1),
        "--clear-groups",
        "--inh-caps=-all",
    ])
    .arg(bin)
    .args(args)
    .env_remove("XDG_RUNTIME_DIR")
    .env("TMPDIR", "/tmp");
    c
}

#[test]
fn another_users_socket_directory_is_refused() {
    assert!(is_root(), "this test creates users (CI runs as root)");
    require("setpriv");
    let victim = user("uzram-test-victim");
    let attacker = user("uzram-test-attacker");
    let bin_dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(bin_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = bin_dir.path().join("uzram");
    std::fs::copy(uzram_bin(), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = PathBuf::from(format!("/tmp/uzram-{}", victim.0));
    let _ = std::fs::remove_dir_all(&dir);
    // The attacker prepares the victim's fallback directory, open to all.
    let out = as_user(attacker, Path::new("/bin/mkdir"), &["-m", "0777"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = as_user(victim, &bin, &["serve", "--disksize", "16M"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served in the attacker's directory");
    assert!(err.contains("refusing the socket directory"), "{err}");
    assert!(
        err.contains(&format!("belongs to uid {}", attacker.0)),
        "{err}"
    );
    // `uzram ctl` will not talk to a socket there either.
    let out = as_user(victim, &bin, &["ctl", "mm_stat"]).output().unwrap();
    assert!(!out.status.success());
    assert_eq!(out.status.code(), Some(libc::EACCES));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("refusing the socket directory"),
        "{out:?}"
    );
    // With the directory gone, the victim makes its own (0700) and serves.
    std::fs::remove_dir_all(&dir).unwrap();
    let mut child = as_user(victim, &bin, &["serve", "--disksize", "16M"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    while !line.starts_with("serving") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the server exited");
    }
    let meta = std::fs::symlink_metadata(&dir).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (victim.0, 0o700));
    run(Command::new("kill").args(["-TERM", &child.id().to_string()]));
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}
