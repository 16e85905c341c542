//! `uzram serve --keeper` as a user runs it: real pages written with real NBD clients, the
//! serving process killed (`kill -9`) or upgraded (`uzram ctl upgrade`), everything read back
//! through a new connection; a client that reconnects by itself (QEMU's `reconnect-delay`)
//! carries on across a kill; a corrupt state file refuses its device and no other; restarts
//! are rate-limited; SIGTERM stops the keeper and its server in seconds.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use uzram_testkit::pages::{program_pages, Program};
use uzram_testkit::process::{require, run, wait_for, wait_timeout};
use uzram_testkit::serve::{uzram_bin, Kept, Running, Serve};

/// Two devices of different sizes, their sockets in the test's directory; the second with a
/// recompression codec.
const TWO_DEVICES: &str = "[[device]]\nname = \"zram0\"\ndisksize = \"64M\"\n\
                           socket = \"{dir}/zram0.sock\"\n\
                           [[device]]\nname = \"zram1\"\ndisksize = \"32M\"\n\
                           recomp_algorithm = \"algo=zstd\"\n\
                           socket = \"{dir}/zram1.sock\"\n";

fn kill9(pid: u32) {
    // SAFETY: kill has no memory preconditions.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
}

/// `n` pages of real program bytes (version `version`) in a file of `dir`.
fn pages_file(dir: &Path, name: &str, n: usize, version: u64) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, program_pages(n, version, Program::Any).concat()).unwrap();
    path
}

/// Writes `file` at the start of device `dev` with qemu-img.
fn write_file(r: &Running, dev: &str, file: &Path) {
    run(Command::new("qemu-img").args([
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        file.to_str().unwrap(),
        &r.uri(dev),
    ]));
}

/// Reads device `dev` with qemu-img (a new connection) and compares its start with `file`.
fn check_file(r: &Running, dev: &str, file: &Path) {
    let out = r.dir().join(format!("{dev}.read"));
    run(Command::new("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &r.uri(dev),
        out.to_str().unwrap(),
    ]));
    let want = std::fs::read(file).unwrap();
    let got = std::fs::read(&out).unwrap();
    assert!(
        got.len() >= want.len() && got[..want.len()] == want[..],
        "{dev}: what was written does not read back"
    );
    std::fs::remove_file(out).unwrap();
}

/// A TCP port free now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn kill_9_loses_nothing() {
    require("qemu-img");
    let port = free_port();
    let k =
        Kept::start(Serve::config(TWO_DEVICES).arg(&["--listen", &format!("127.0.0.1:{port}")]));
    let dir = k.r.dir();
    let a = pages_file(dir, "a", 4096, 1);
    let b = pages_file(dir, "b", 2048, 2);
    write_file(&k.r, "zram0", &a);
    write_file(&k.r, "zram1", &b);
    // zram1's pages recompressed with zstd: smaller, and so they stay.
    let before = k.r.columns("zram1", "mm_stat");
    assert!(k.r.ctl(&["--dev", "zram1", "idle", "all"]).status.success());
    let o = k.r.ctl(&["--dev", "zram1", "recompress", "type=idle"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let recompressed = k.r.columns("zram1", "mm_stat");
    assert!(
        recompressed[1] < before[1],
        "{before:?} -> {recompressed:?}"
    );
    let stored = k.r.columns("zram0", "mm_stat");
    for round in 0..3 {
        k.kill_child_now();
        check_file(&k.r, "zram0", &a);
        check_file(&k.r, "zram1", &b);
        // The recovered device holds what it held: same data bytes, same compressed bytes.
        let now = k.r.columns("zram0", "mm_stat");
        assert_eq!(now[..2], stored[..2], "round {round}: mm_stat {now:?}");
        let now = k.r.columns("zram1", "mm_stat");
        assert_eq!(
            now[..2],
            recompressed[..2],
            "round {round}: zram1 mm_stat {now:?}"
        );
    }
    let log = k.r.log();
    assert!(log.contains("zram0: recovered: 4096 pages stored"), "{log}");
    // Overwrites after a recovery are kept by the next one too.
    let c = pages_file(dir, "c", 1024, 3);
    write_file(&k.r, "zram1", &c);
    k.kill_child_now();
    check_file(&k.r, "zram1", &c);
    // The TCP port comes back too.
    let tcp = format!("nbd://127.0.0.1:{port}/zram0");
    let out = run(Command::new("qemu-img").args(["info", "--output=json", "-f", "raw", &tcp]));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["virtual-size"], 64u64 << 20);
}

#[test]
fn a_reconnecting_client_carries_on_across_a_kill() {
    require("qemu-io");
    require("qemu-img");
    let k = Kept::start(Serve::config(TWO_DEVICES));
    let dir = k.r.dir().to_path_buf();
    // 40 writes of 512 KiB of real pages, 50 ms apart, through one connection that
    // reconnects by itself; the server is killed in the middle.
    let chunks: Vec<PathBuf> = (0..40)
        .map(|i| pages_file(&dir, &format!("chunk{i}"), 128, 10 + i))
        .collect();
    let mut args = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        args.push("-c".into());
        args.push(format!("write -s {} {}K 512K", c.display(), i * 512));
        args.push("-c".into());
        args.push("sleep 50".into());
    }
    args.push(format!(
        "json:{{\"driver\":\"raw\",\"file\":{{\"driver\":\"nbd\",\"server\":{{\"type\":\
         \"unix\",\"path\":\"{}\"}},\"export\":\"zram0\",\"reconnect-delay\":30}}}}",
        k.r.socket("zram0").display()
    ));
    let mut qemu = Command::new("qemu-io")
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Killed once some writes were served and while the client is still writing.
    wait_for("the first writes", Duration::from_secs(30), || {
        k.r.columns("zram0", "mm_stat")[0] >= 1 << 20
    });
    assert!(qemu.try_wait().unwrap().is_none(), "qemu-io finished first");
    k.kill_child_now();
    assert!(
        wait_timeout(&mut qemu, Duration::from_secs(60)).is_some(),
        "qemu-io did not finish"
    );
    let out = qemu.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert_eq!(text.matches("wrote 524288/524288").count(), 40, "{text}");
    assert!(
        !text.contains("error") && !text.contains("failed"),
        "{text}"
    );
    let all = dir.join("all");
    let bytes: Vec<u8> = chunks
        .iter()
        .flat_map(|c| std::fs::read(c).unwrap())
        .collect();
    std::fs::write(&all, bytes).unwrap();
    check_file(&k.r, "zram0", &all);
}

/// A copy of the built binary at `path`, put there by a rename (as a package manager
/// installs one: the running file is not written).
fn install_copy(path: &Path) {
    let tmp = path.with_extension("new");
    std::fs::copy(uzram_bin(), &tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn upgrade(r: &Running) -> std::process::Output {
    r.ctl(&["upgrade"])
}

#[test]
fn upgrade_hands_the_pages_over_and_a_bad_binary_changes_nothing() {
    require("qemu-img");
    // The keeper runs a copy of the binary in the test's directory (`env` as the prefix).
    let k = Kept::start(Serve::config(TWO_DEVICES).prefix(&["env"]));
    let dir = k.r.dir().to_path_buf();
    let exe = dir.join("uzram");
    let a = pages_file(&dir, "a", 4096, 1);
    write_file(&k.r, "zram0", &a);

    // A new binary: the server is replaced, the pages are there.
    install_copy(&exe);
    let before = k.child();
    let o = upgrade(&k.r);
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{o:?}\n{}", k.r.log());
    assert!(said.starts_with("upgraded to uzram "), "{said}");
    assert_ne!(k.child(), before);
    check_file(&k.r, "zram0", &a);
    // SIGUSR2 to the keeper does the same.
    let (before, n) = (k.child(), k.servings());
    k.r.signal("-USR2");
    wait_for("the upgraded server", Duration::from_secs(60), || {
        k.servings() > n
    });
    assert_ne!(k.child(), before);
    assert_eq!(
        k.r.log()
            .matches("uzram keeper: upgraded to uzram ")
            .count(),
        2
    );
    check_file(&k.r, "zram0", &a);

    // A file that does not run: refused before the server is touched.
    std::fs::write(dir.join("uzram.new"), "not a program\n").unwrap();
    std::fs::set_permissions(
        dir.join("uzram.new"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    std::fs::rename(dir.join("uzram.new"), &exe).unwrap();
    let before = k.child();
    let o = upgrade(&k.r);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{o:?}");
    assert!(
        err.contains("does not run") && err.contains("serves on unchanged"),
        "{err}"
    );
    assert_eq!(k.child(), before, "the server was touched");
    check_file(&k.r, "zram0", &a);

    // A new binary whose server cannot start (its configuration broken meanwhile): the
    // keeper keeps the state and restarts until the configuration is mended.
    install_copy(&exe);
    let config = dir.join("uzram.toml");
    let good = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, "[[device]]\nname = 3\n").unwrap();
    let o = upgrade(&k.r);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{o:?}");
    assert!(err.contains("exited before it served"), "{err}");
    std::fs::write(&config, good).unwrap();
    let n = k.servings();
    wait_for("the server again", Duration::from_secs(30), || {
        k.servings() > n
    });
    check_file(&k.r, "zram0", &a);
}

/// The keeper's memfds named `uzram-NAME`: (path under /proc, size).
fn keeper_memfds(keeper: u32, name: &str) -> Vec<(PathBuf, u64)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{keeper}/fd")).unwrap() {
        let p = e.unwrap().path();
        let Ok(target) = std::fs::read_link(&p) else {
            continue;
        };
        if target
            .to_string_lossy()
            .starts_with(&format!("/memfd:uzram-{name} "))
        {
            v.push((p.clone(), std::fs::metadata(&p).unwrap().len()));
        }
    }
    v
}

#[test]
fn a_corrupt_state_file_refuses_its_device_and_no_other() {
    require("qemu-img");
    let k = Kept::start(Serve::config(TWO_DEVICES));
    let dir = k.r.dir();
    let a = pages_file(dir, "a", 1024, 1);
    let b = pages_file(dir, "b", 1024, 2);
    write_file(&k.r, "zram0", &a);
    write_file(&k.r, "zram1", &b);
    // zram1's slot table is the smaller one (32M: 8192 slots); flip the bits of page 5's
    // slot in the keeper's copy.
    let slots = keeper_memfds(k.r.pid(), "slots");
    assert_eq!(slots.len(), 2, "{slots:?}");
    let (path, _) = slots.iter().min_by_key(|(_, len)| *len).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let mut slot = [0u8; 16];
        f.read_exact_at(&mut slot, 5 * 16).unwrap();
        for b in &mut slot {
            *b ^= 0xff;
        }
        f.write_all_at(&slot, 5 * 16).unwrap();
    }
    k.kill_child_now();
    let log = k.r.log();
    let refusal = log
        .lines()
        .find(|l| l.starts_with("uzram: zram1: refused: "))
        .unwrap_or_else(|| panic!("no refusal of zram1: {log}"));
    assert!(refusal.contains("slot 5"), "{refusal}");
    assert!(!log.contains("zram0: refused"), "{log}");
    check_file(&k.r, "zram0", &a);
    // zram1 is not served: a client cannot connect.
    let o = Command::new("qemu-img")
        .args(["info", "-f", "raw", &k.r.uri("zram1")])
        .output()
        .unwrap();
    assert!(!o.status.success(), "zram1 served: {o:?}");
    // The keeper keeps zram1's state (nothing dropped), and refuses it again next time.
    assert!(!log.contains("dropped zram1"), "{log}");
    k.kill_child_now();
    assert_eq!(
        k.r.log().matches("uzram: zram1: refused: ").count(),
        2,
        "{}",
        k.r.log()
    );
    check_file(&k.r, "zram0", &a);
}

#[test]
fn restarts_are_rate_limited_and_sigterm_stops_everything() {
    let mut k = Kept::start(Serve::args(&[
        "--disksize",
        "16M",
        "--socket",
        "{dir}/zram0.sock",
    ]));
    // Every server killed as soon as it appears, for 4 s: a few restarts, not a tight loop.
    let mut seen = std::collections::BTreeSet::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(4) {
        for c in k.children() {
            if seen.insert(c) {
                kill9(c);
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        (3..=8).contains(&seen.len()),
        "{} servers in 4 s: {}",
        seen.len(),
        k.r.log()
    );
    assert!(k.r.log().contains("restarting in "), "{}", k.r.log());
    // The keeper serves again, then SIGTERM stops it and its server within seconds.
    let n = k.servings();
    wait_for("a server", Duration::from_secs(30), || k.servings() > n);
    let child = k.child();
    let t = Instant::now();
    k.r.signal("-TERM");
    let status = k.r.wait_exit(Duration::from_secs(10));
    assert!(status.success(), "{status:?}: {}", k.r.log());
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(
        !Path::new(&format!("/proc/{child}")).exists(),
        "the server outlived its keeper"
    );
    let left: Vec<_> = std::fs::read_dir(k.r.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".sock") || n.ends_with(".ctl") || n == "uzram-keeper")
        .collect();
    assert!(left.is_empty(), "sockets left behind: {left:?}");
}

#[test]
fn a_first_server_that_cannot_start_ends_the_keeper() {
    // Nothing to keep yet: the keeper exits with the server's status (no restart loop).
    let f = Serve::args(&["--keeper", "--disksize", "16M", "--algorithm", "nope"])
        .arg(&["--socket", "{dir}/zram0.sock"])
        .refused();
    assert!(f.stderr.contains("nope"), "{}", f.stderr);
    assert_eq!(
        f.stderr.matches("started the server").count(),
        1,
        "{}",
        f.stderr
    );
}

/// systemd's side of its fd store, as the notification socket and `LISTEN_FDS` make it: the
/// server hands every file over (`FDSTORE=1`, `FDNAME=`), is killed, and a new one started
/// with the files (`LISTEN_PID`, `LISTEN_FDS`, `LISTEN_FDNAMES`) serves the same pages.
#[test]
fn systemd_fd_store_keeps_the_pages() {
    use std::collections::BTreeMap;
    use std::io::{BufRead, BufReader};
    use std::os::fd::{AsFd, AsRawFd, OwnedFd};
    use std::os::unix::net::UnixDatagram;
    use std::os::unix::process::CommandExt;
    require("qemu-img");
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    // The store: names to descriptors, as systemd keeps them.
    let mut store: BTreeMap<String, OwnedFd> = BTreeMap::new();
    let receive = |store: &mut BTreeMap<String, OwnedFd>| loop {
        let mut buf = [0u8; 512];
        let (n, fds) = match uzram_service::scm::recv(sock.as_fd(), &mut buf) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) => panic!("{e}"),
        };
        let text = String::from_utf8_lossy(&buf[..n]).to_string();
        let name = text
            .lines()
            .find_map(|l| l.strip_prefix("FDNAME="))
            .unwrap_or_else(|| panic!("no FDNAME in {text:?}"))
            .to_string();
        if text.contains("FDSTOREREMOVE=1") {
            assert!(fds.is_empty(), "{text:?}");
            store.remove(&name);
        } else {
            assert!(text.contains("FDSTORE=1") && fds.len() == 1, "{text:?}");
            store.insert(name, fds.into_iter().next().unwrap());
        }
    };
    let r = Serve::args(&["--disksize", "16M", "--socket", "{dir}/zram0.sock"])
        .env("NOTIFY_SOCKET", &notify)
        .start();
    assert!(
        r.lines()
            .iter()
            .any(|l| l.contains("kept by systemd's fd store")),
        "{:?}",
        r.lines()
    );
    receive(&mut store);
    let names: Vec<&String> = store.keys().collect();
    assert_eq!(
        names,
        [
            "zram0/frames",
            "zram0/handles",
            "zram0/header",
            "zram0/records",
            "zram0/slots"
        ]
    );
    let a = pages_file(dir.path(), "a", 2048, 7);
    write_file(&r, "zram0", &a);
    kill9(r.pid());
    let mut r = r;
    r.child.wait().unwrap();

    // The new server, with the store's files from descriptor 3 on.
    let (names, fds): (Vec<String>, Vec<OwnedFd>) = store.into_iter().unzip();
    // Above the range they go to, so that moving one never overwrites another.
    let high: Vec<i32> = fds
        .iter()
        // SAFETY: F_DUPFD_CLOEXEC on an open descriptor: a new one, closed below.
        .map(|f| unsafe { libc::fcntl(f.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 64) })
        .collect();
    assert!(high.iter().all(|&f| f >= 64));
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "LISTEN_PID=$$ exec \"$0\" \"$@\""])
        .arg(uzram_bin())
        .args(["serve", "--disksize", "16M", "--socket"])
        .arg(r.socket("zram0"))
        .env("LISTEN_FDS", fds.len().to_string())
        .env("LISTEN_FDNAMES", names.join(":"))
        .env("NOTIFY_SOCKET", &notify)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("stderr2")).unwrap());
    let moved = high.clone();
    // SAFETY: between fork and exec only dup2 (async-signal-safe) on open descriptors.
    unsafe {
        cmd.pre_exec(move || {
            for (i, &f) in moved.iter().enumerate() {
                if libc::dup2(f, 3 + i as i32) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    for f in high {
        // SAFETY: the duplicates made above, not used any more.
        unsafe { libc::close(f) };
    }
    let out = child.stdout.take().unwrap();
    let serving = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .any(|l| l.starts_with("serving"));
    let log = std::fs::read_to_string(dir.path().join("stderr2")).unwrap();
    assert!(serving, "{log}");
    assert!(log.contains("zram0: recovered: 2048 pages stored"), "{log}");
    let read = dir.path().join("read");
    run(Command::new("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &r.uri("zram0"),
        read.to_str().unwrap(),
    ]));
    assert_eq!(
        std::fs::read(&read).unwrap()[..a.metadata().unwrap().len() as usize],
        std::fs::read(&a).unwrap()[..]
    );
    // SIGUSR2: a clean stop for systemd to restart (exit status 75, Restart=on-failure).
    // SAFETY: kill on our own child, not reaped yet.
    unsafe { libc::kill(child.id() as i32, libc::SIGUSR2) };
    let status = wait_timeout(&mut child, Duration::from_secs(20)).expect("stopped");
    assert_eq!(status.code(), Some(75));
}

/// A device added by `hot_add` comes back after a kill; `reset` drops a device's state; a
/// configuration that changed a device's `disksize` refuses that device only.
#[test]
fn hot_add_reset_and_a_changed_configuration() {
    require("qemu-img");
    let k = Kept::start(Serve::config(TWO_DEVICES));
    let dir = k.r.dir().to_path_buf();
    let o = k.r.ctl(&["hot_add"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "2");
    k.r.set("zram2", "disksize", "16M");
    // Settings changed while it serves, which no configuration gives again.
    k.r.set("zram2", "mem_limit", "12M");
    k.r.set("zram2", "writeback_limit_enable", "1");
    k.r.set("zram2", "writeback_limit", "321");
    k.r.set("zram2", "writeback_batch_size", "5");
    let a = pages_file(&dir, "a", 1024, 1);
    let b = pages_file(&dir, "b", 1024, 2);
    write_file(&k.r, "zram2", &a);
    write_file(&k.r, "zram1", &b);
    k.kill_child_now();
    assert!(
        k.r.log().contains("uzram: recovered: zram2: "),
        "{}",
        k.r.log()
    );
    check_file(&k.r, "zram2", &a);
    check_file(&k.r, "zram1", &b);
    assert_eq!(k.r.columns("zram2", "mm_stat")[3], 12 << 20);
    assert_eq!(k.r.show("zram2", "writeback_limit_enable"), "1\n");
    assert_eq!(k.r.show("zram2", "writeback_limit"), "321\n");
    assert_eq!(k.r.show("zram2", "writeback_batch_size"), "5\n");

    // reset drops the state: after a kill, zram2 is gone (it is not in the configuration).
    k.r.set("zram2", "reset", "1");
    wait_for("the keeper to drop zram2", Duration::from_secs(10), || {
        k.r.log().contains("dropped zram2's state")
    });
    // zram1 grows in the configuration: its saved state is refused, zram0 is served.
    let config = dir.join("uzram.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("\"32M\"", "\"48M\"")).unwrap();
    k.kill_child_now();
    let log = k.r.log();
    assert!(
        log.contains(
            "uzram: zram1: refused: its saved state has disksize 33554432, the configuration \
             50331648 (48M)"
        ),
        "{log}"
    );
    assert_eq!(log.matches("uzram: recovered: zram2").count(), 1, "{log}");
    assert!(!k.r.socket("zram2").exists() || qemu_img_fails(&k.r.uri("zram2")));
    assert!(qemu_img_fails(&k.r.uri("zram1")));
    assert!(!qemu_img_fails(&k.r.uri("zram0")));
}

fn qemu_img_fails(uri: &str) -> bool {
    !Command::new("qemu-img")
        .args(["info", "-f", "raw", uri])
        .output()
        .unwrap()
        .status
        .success()
}

/// A server serving swap (`--swap`: every device's frames in one reserve) keeps every device
/// across kills: the reserve is recovered with them.
#[test]
fn a_swap_server_keeps_its_devices() {
    require("qemu-img");
    let k = Kept::start(Serve::config(TWO_DEVICES).arg(&["--swap", "--swap-reserve", "16M"]));
    let dir = k.r.dir().to_path_buf();
    // The keeper's own memory is locked: a restart never waits for a page of it swapped out.
    let status = std::fs::read_to_string(format!("/proc/{}/status", k.r.pid())).unwrap();
    let locked_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    assert!(locked_kib > 0, "the keeper locked nothing: {status}");
    let a = pages_file(&dir, "a", 4096, 1);
    let b = pages_file(&dir, "b", 2048, 2);
    write_file(&k.r, "zram0", &a);
    write_file(&k.r, "zram1", &b);
    let stored = k.r.columns("zram1", "mm_stat");
    for _ in 0..2 {
        k.kill_child_now();
        check_file(&k.r, "zram0", &a);
        check_file(&k.r, "zram1", &b);
        assert_eq!(k.r.columns("zram1", "mm_stat")[..2], stored[..2]);
    }
    let log = k.r.log();
    assert!(!log.contains("refused"), "{log}");
    assert!(log.contains("zram0: recovered: 4096 pages stored"), "{log}");
    // Written after a recovery, kept by the next.
    let c = pages_file(&dir, "c", 1024, 3);
    write_file(&k.r, "zram0", &c);
    k.kill_child_now();
    check_file(&k.r, "zram0", &c);
    check_file(&k.r, "zram1", &b);
}

/// A device that wrote pages back to a backing file keeps them across kills: the file is
/// opened again from the configuration's `backing_dev` and the bitmap of its blocks rebuilt
/// from the slots; pages written back after a recovery are kept by the next one. A device
/// added by `hot_add` writing back in the zoned layout keeps them too, GC included.
#[test]
fn written_back_pages_come_back_after_a_kill() {
    require("qemu-img");
    let tmp = uzram_testkit::device::real_tmpdir();
    let backing = tmp.path().join("backing");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let k = Kept::start(Serve::zram0_over("32M", &backing, ""));
    let dir = k.r.dir().to_path_buf();
    let a = pages_file(&dir, "a", 4096, 1);
    write_file(&k.r, "zram0", &a);
    k.r.set("zram0", "idle", "all");
    k.r.set("zram0", "writeback", "idle");
    let bd = k.r.columns("zram0", "bd_stat");
    assert!(bd[0] > 2048, "most pages written back: bd_stat {bd:?}");
    k.kill_child_now();
    check_file(&k.r, "zram0", &a);
    assert_eq!(k.r.columns("zram0", "bd_stat")[0], bd[0], "bd_count");
    // Half overwritten (in memory again, their blocks freed) and written back once more
    // over the rebuilt bitmap: no block handed out twice.
    let b = pages_file(&dir, "b", 2048, 2);
    write_file(&k.r, "zram0", &b);
    k.r.set("zram0", "idle", "all");
    k.r.set("zram0", "writeback", "idle");
    k.kill_child_now();
    let mut want = std::fs::read(&b).unwrap();
    want.extend_from_slice(&std::fs::read(&a).unwrap()[want.len()..]);
    let both = dir.join("both");
    std::fs::write(&both, want).unwrap();
    check_file(&k.r, "zram0", &both);
    // A device added by hot_add, which no configuration names: its backing file is opened
    // again by the name its saved state recorded.
    let backing1 = tmp.path().join("backing1");
    std::fs::File::create(&backing1)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let o = k.r.ctl(&["hot_add"]);
    assert!(o.status.success(), "{o:?}");
    let added = format!("zram{}", String::from_utf8_lossy(&o.stdout).trim());
    k.r.set(&added, "backing_dev", backing1.to_str().unwrap());
    // In the zoned layout: its zones rebuilt from the slots at each recovery.
    k.r.set(&added, "backing_layout", "zoned");
    k.r.set(&added, "zone_size", "1M");
    k.r.set(&added, "disksize", "16M");
    let c = pages_file(&dir, "c", 2048, 3);
    write_file(&k.r, &added, &c);
    k.r.set(&added, "idle", "all");
    k.r.set(&added, "writeback", "idle");
    let bd1 = k.r.columns(&added, "bd_stat");
    assert!(bd1[0] > 1024, "bd_stat {bd1:?}");
    k.kill_child_now();
    check_file(&k.r, &added, &c);
    check_file(&k.r, "zram0", &both);
    assert_eq!(k.r.columns(&added, "bd_stat")[0], bd1[0], "bd_count");
    // Overwritten, written back again and collected by GC on the recovered zones; kept by the
    // next recovery too.
    let d = pages_file(&dir, "d", 1024, 4);
    write_file(&k.r, &added, &d);
    k.r.set(&added, "idle", "all");
    k.r.set(&added, "writeback", "idle");
    k.r.set(&added, "gc", "1");
    k.kill_child_now();
    let mut want = std::fs::read(&d).unwrap();
    want.extend_from_slice(&std::fs::read(&c).unwrap()[want.len()..]);
    let cd = dir.join("cd");
    std::fs::write(&cd, want).unwrap();
    check_file(&k.r, &added, &cd);
    let log = k.r.log();
    assert!(!log.contains("refused"), "{log}");
}

/// Column `n` of `policy`'s line in `dev`'s `policy_stat` (2: runs, 3: pages).
fn policy_column(r: &Running, dev: &str, policy: &str, n: usize) -> u64 {
    let text = r.show(dev, "policy_stat");
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(policy))
        .unwrap_or_else(|| panic!("{dev}: no {policy} in {text:?}"));
    line.split_whitespace().nth(n).unwrap().parse().unwrap()
}

/// The runs of `policy` in `dev`'s `policy_stat`.
fn policy_runs(r: &Running, dev: &str, policy: &str) -> u64 {
    policy_column(r, dev, policy, 2)
}

/// A device's `policy` set at runtime comes back after a kill and acts again: one added by
/// `hot_add`, and a configured one (the runtime settings over the configuration's, until the
/// configuration's `policy` is edited: then the configuration's).
#[test]
fn policies_set_at_runtime_come_back_after_a_kill() {
    let k = Kept::start(Serve::config(
        "[[device]]\nname = \"zram0\"\ndisksize = \"16M\"\n\
         socket = \"{dir}/zram0.sock\"\npolicy = \"idle_age_s=600\"\n",
    ));
    let dir = k.r.dir().to_path_buf();
    let o = k.r.ctl(&["hot_add"]);
    assert!(o.status.success(), "{o:?}");
    let added = format!("zram{}", String::from_utf8_lossy(&o.stdout).trim());
    k.r.set(&added, "disksize", "16M");
    // Idle aging every second: its runs count up while the device serves.
    k.r.set(&added, "policy", "idle_age_s=0 period_s=1");
    k.r.set("zram0", "policy", "compact_ratio=1.5 idle_age_s=off");
    let added_policy = k.r.show(&added, "policy");
    let zram0_policy = k.r.show("zram0", "policy");
    assert!(added_policy.contains("idle_age_s=0\n"), "{added_policy}");
    assert!(
        zram0_policy.contains("compact_ratio=1.5\n"),
        "{zram0_policy}"
    );
    k.kill_child_now();
    assert_eq!(k.r.show(&added, "policy"), added_policy);
    assert_eq!(k.r.show("zram0", "policy"), zram0_policy);
    let runs = policy_runs(&k.r, &added, "idle");
    wait_for(
        "the recovered device's idle policy to run",
        Duration::from_secs(20),
        || policy_runs(&k.r, &added, "idle") >= runs + 2,
    );
    // Kept by the next kill too (saved again by the recovered device).
    k.r.set(&added, "policy", "period_s=2");
    let added_policy = k.r.show(&added, "policy");
    assert!(added_policy.contains("period_s=2\n"), "{added_policy}");
    // The configuration's policy for zram0 edited: the configuration's comes back.
    let config = dir.join("uzram.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("idle_age_s=600", "idle_age_s=900")).unwrap();
    k.kill_child_now();
    assert_eq!(k.r.show(&added, "policy"), added_policy);
    let zram0_policy = k.r.show("zram0", "policy");
    assert!(zram0_policy.contains("idle_age_s=900\n"), "{zram0_policy}");
    assert!(
        zram0_policy.contains("compact_ratio=off\n"),
        "{zram0_policy}"
    );
    let log = k.r.log();
    assert!(
        log.contains("uzram: zram0: policy: the saved one is not taken"),
        "{log}"
    );
    assert!(!log.contains("refused"), "{log}");
}

/// A configured device whose `dict=` file is deleted, then replaced by another, after its
/// pages were written with it: each kill recovers it with the dictionary its saved state
/// holds, its pages read back, the log says which dictionary serves.
#[test]
fn a_deleted_dictionary_file_does_not_refuse_the_saved_state() {
    require("qemu-img");
    let dir = tempfile::tempdir().unwrap();
    let dict = dir.path().join("zram0.dict");
    std::fs::write(&dict, program_pages(16, 7, Program::Any).concat()).unwrap();
    let k = Kept::start(
        Serve::config(&format!(
            "[[device]]\nname = \"zram0\"\ndisksize = \"16M\"\nsocket = \"{{dir}}/zram0.sock\"\n\
             comp_algorithm = \"zstd\"\nalgorithm_params = \"level=3 dict={}\"\n",
            dict.display()
        ))
        .in_dir(dir),
    );
    let a = pages_file(k.r.dir(), "a", 1024, 8);
    write_file(&k.r, "zram0", &a);
    std::fs::remove_file(&dict).unwrap();
    k.kill_child_now();
    check_file(&k.r, "zram0", &a);
    let log = k.r.log();
    assert!(
        log.contains("zram0: algorithm_params = ")
            && log.contains("the dictionary its saved state holds serves"),
        "{log}"
    );
    // Another file in its place: the saved dictionary still serves.
    std::fs::write(&dict, program_pages(4, 9, Program::Any).concat()).unwrap();
    k.kill_child_now();
    check_file(&k.r, "zram0", &a);
    let log = k.r.log();
    assert!(
        log.contains("zram0: comp_algorithm's dictionary in the configuration (16384 bytes)"),
        "{log}"
    );
    assert!(!log.contains("refused"), "{log}");
}

/// A writeback budget spent before a kill stays spent after it (its budget period goes on),
/// and `policy_stat`'s counters go on from where they were.
#[test]
fn a_spent_writeback_budget_and_the_policy_counters_survive_a_kill() {
    require("qemu-img");
    let tmp = uzram_testkit::device::real_tmpdir();
    let backing = tmp.path().join("backing");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    // Every page idle at once, written back within a budget of 16 pages an hour.
    let k = Kept::start(Serve::zram0_over(
        "32M",
        &backing,
        "policy = \"idle_age_s=0 writeback_age_s=0 period_s=1 writeback_budget=64K \
         writeback_budget_period_s=3600\"",
    ));
    let a = pages_file(k.r.dir(), "a", 1024, 1);
    write_file(&k.r, "zram0", &a);
    let bd_count = || k.r.columns("zram0", "bd_stat")[0];
    wait_for("the budget spent", Duration::from_secs(30), || {
        bd_count() == 16
    });
    assert_eq!(k.r.show("zram0", "writeback_limit"), "0\n");
    assert_eq!(policy_column(&k.r, "zram0", "writeback", 3), 16);
    for round in 0..2 {
        let idle = policy_runs(&k.r, "zram0", "idle");
        k.kill_child_now();
        // Two periods of the new process: its runs counted on from the saved ones.
        wait_for(
            "the recovered device's policies to run",
            Duration::from_secs(30),
            || policy_runs(&k.r, "zram0", "idle") >= idle + 2,
        );
        assert_eq!(bd_count(), 16, "round {round}: a new budget after the kill");
        assert_eq!(k.r.show("zram0", "writeback_limit"), "0\n");
        assert_eq!(
            policy_column(&k.r, "zram0", "writeback", 3),
            16,
            "round {round}: the pages the policy wrote back"
        );
    }
    check_file(&k.r, "zram0", &a);
    let log = k.r.log();
    assert!(!log.contains("refused"), "{log}");
}
