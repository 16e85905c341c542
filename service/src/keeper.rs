//! The keeper (`uzram serve --keeper`): a small process that holds every device's state
//! files and a serving child, and starts a new child, handing it the files, when the child
//! dies (docs/restart.md, "The server"). The child is the same `uzram serve` command; it finds
//! the keeper's socket and the files in its environment ([`crate::fd_store`]) and recovers
//! each device before serving it on the same sockets.
//!
//! # The keeper's loop
//! One thread polls the child's socket (its `store`, `remove` and `ready` messages), the
//! child's pidfd (its exit), and the pipes of the signals and of `uzram ctl upgrade`
//! requests; nothing else wakes it, and it sleeps until a restart is due.
//!
//! - **A child dies** (a signal, or an exit status other than 0): a new one is started from
//!   the same binary (the file the keeper holds open, whatever the path now holds). Restarts
//!   are rate-limited: immediately after a child that served for [`STABLE`], then after
//!   250 ms, 500 ms... up to [`MAX_RESTART_DELAY`] while children keep dying early.
//! - **A child exits 0** (it was stopped: SIGTERM to it, or its configuration serves nothing):
//!   the keeper exits too, and the files with it. So does a first child that fails before it
//!   serves and before it handed any file over (a bad configuration: nothing to keep).
//! - **SIGTERM, SIGINT or SIGHUP**: SIGTERM to the child, which stops as `uzram serve` does;
//!   SIGKILL after [`STOP_TIMEOUT`] or at a second signal; then the keeper exits 0.
//! - **Upgrade** (`uzram ctl upgrade` on the socket `DIR/uzram-keeper`, or SIGUSR2): the
//!   binary now at the path the keeper was started from is checked (`--version`), the child
//!   stopped for a restart (SIGUSR2: its requests in flight finish, its sockets go, its ublk
//!   block devices are left for the next server to take over), and a child of the new binary
//!   started with the files; once it serves, the new binary is the one restarts run. If it
//!   does not serve within [`START_TIMEOUT`], it is killed and a child of the previous binary
//!   started again; the upgrade's answer says so.
//!
//! The files are replaced by a `store NAME` of the same name and dropped by `remove NAME`
//! (reset, `hot_remove`); at most [`MAX_HELD`] devices' files are held.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use uzram::device::restart::DEVICE_FILES;
use uzram::error::{Error, ErrorKind};

use crate::fd_store::{self, storable_name, FILE_NAMES, MAX_MESSAGE_BYTES};
use crate::frontend::control::{ControlServer, Request};
use crate::scm;

/// A child that served this long before it died is restarted at once.
pub const STABLE: Duration = Duration::from_secs(10);
/// The longest wait before restarting a child that keeps dying early.
pub const MAX_RESTART_DELAY: Duration = Duration::from_secs(10);
/// How long a child stopping (SIGTERM) may take before it is killed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a new binary may take to serve, in an upgrade.
pub const START_TIMEOUT: Duration = Duration::from_secs(120);
/// The most devices whose files the keeper holds (the server's own limit, `MAX_DEVICES`).
pub const MAX_HELD: usize = crate::devices::MAX_DEVICES;

/// The keeper's socket's file name in the server's socket directory.
pub const KEEPER_SOCKET_NAME: &str = "uzram-keeper";

/// The keeper's socket in `dir` (`uzram ctl upgrade`).
pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join(KEEPER_SOCKET_NAME)
}

/// What the keeper runs.
#[derive(Debug, Clone)]
pub struct KeeperConfig {
    /// The serving binary's path: read again at each upgrade.
    pub exe: PathBuf,
    /// The child's arguments (after the program's name).
    pub args: Vec<OsString>,
    /// The server's socket directory (the keeper's socket goes there).
    pub socket_dir: PathBuf,
    /// Serving swap: the keeper locks its memory, so that restarting the server never waits
    /// for a page of the keeper swapped out to the very device the server serves.
    pub lock_memory: bool,
}

/// A running child.
struct Child {
    proc: std::process::Child,
    pidfd: OwnedFd,
    /// The keeper's end of the child's socket; `None` once the child closed its end.
    sock: Option<OwnedFd>,
    started: Instant,
    ready: bool,
}

/// What waiting on a child ended with.
enum Waited {
    Ready,
    Exited(ExitStatus),
    TimedOut,
    Stop,
}

/// An upgrade request: where its answer goes.
type UpgradeReply = mpsc::Sender<std::result::Result<String, String>>;

struct Keeper {
    cfg: KeeperConfig,
    /// The binary the children run (open: a path may hold another file by now).
    exe: File,
    /// Device name → its files, in [`FILE_NAMES`]' order.
    files: BTreeMap<String, [OwnedFd; DEVICE_FILES]>,
    child: Option<Child>,
    /// Whether any child has served yet.
    served: bool,
    /// Children that died early in a row.
    early_deaths: u32,
    restart_at: Option<Instant>,
    stop_pipe: UnixStream,
    upgrade_pipe: UnixStream,
    requests: mpsc::Receiver<UpgradeReply>,
}

fn log(msg: impl std::fmt::Display) {
    eprintln!("uzram keeper: {msg}");
}

/// How a process ended, in words.
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (_, Some(s)) => format!("signal {s}"),
        _ => format!("{status}"),
    }
}

/// Runs the keeper until it is stopped; the exit status for the process.
pub fn run(cfg: KeeperConfig) -> Result<i32> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR2};
    if cfg.lock_memory {
        // SAFETY: mlockall takes flags only. Not inherited by the children (a fork's memory
        // locks are not, and exec clears MCL_FUTURE): the server locks its own.
        if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) } == 0 {
            log("--swap: memory locked (restarting the server never waits for a swap-in)");
        } else {
            log(format!(
                "--swap: cannot lock memory ({}): a restart under memory pressure may wait for a \
                 swap-in from the device it restarts",
                io::Error::last_os_error()
            ));
        }
    }
    let (stop_pipe, stop_w) = UnixStream::pair().context("a signal pipe")?;
    let (upgrade_pipe, upgrade_w) = UnixStream::pair().context("a signal pipe")?;
    stop_pipe.set_nonblocking(true)?;
    upgrade_pipe.set_nonblocking(true)?;
    for sig in [SIGTERM, SIGINT, SIGHUP] {
        signal_hook::low_level::pipe::register(sig, stop_w.try_clone()?)
            .context("installing signal handlers")?;
    }
    let upgrade_w = Arc::new(upgrade_w);
    signal_hook::low_level::pipe::register(SIGUSR2, upgrade_w.try_clone()?)
        .context("installing signal handlers")?;
    let exe = File::open(&cfg.exe).with_context(|| format!("opening {}", cfg.exe.display()))?;
    let (req_tx, requests) = mpsc::channel::<UpgradeReply>();
    let path = socket_path(&cfg.socket_dir);
    let wake = Arc::clone(&upgrade_w);
    let handler = move |req: Request| -> uzram::Result<String> {
        match req {
            Request::Store { attr, .. } if attr == "upgrade" => {
                let (tx, rx) = mpsc::channel();
                req_tx
                    .send(tx)
                    .map_err(|_| Error::new(ErrorKind::NoDevice, "the keeper is stopping"))?;
                let _ = wake.write_byte();
                match rx.recv() {
                    Ok(Ok(s)) => Ok(s),
                    Ok(Err(e)) => Err(Error::new(ErrorKind::Io, e)),
                    Err(_) => Err(Error::new(ErrorKind::NoDevice, "the keeper is stopping")),
                }
            }
            Request::Show { attr } | Request::Store { attr, .. } => Err(Error::new(
                ErrorKind::NotFound,
                format!("no attribute {attr:?} in the keeper (upgrade)"),
            )),
        }
    };
    let control = ControlServer::start_fn(&path, Arc::new(handler))
        .with_context(|| format!("starting the keeper's socket {}", path.display()))?;
    log(format!(
        "holding the devices' state; upgrade with `uzram ctl upgrade` ({}) or SIGUSR2",
        path.display()
    ));
    let mut k = Keeper {
        cfg,
        exe,
        files: BTreeMap::new(),
        child: None,
        served: false,
        early_deaths: 0,
        restart_at: Some(Instant::now()),
        stop_pipe,
        upgrade_pipe,
        requests,
    };
    let code = k.main_loop();
    // The keeper first (an upgrade request still queued is answered "stopping" as its reply
    // channel drops), then the socket's threads.
    drop(k);
    control.stop();
    Ok(code)
}

trait WriteByte {
    fn write_byte(&self) -> io::Result<()>;
}

impl WriteByte for UnixStream {
    fn write_byte(&self) -> io::Result<()> {
        use std::io::Write;
        (&*self).write_all(&[1])
    }
}

/// Empties a non-blocking pipe; whether it held anything.
fn drain(pipe: &UnixStream) -> bool {
    let mut buf = [0u8; 64];
    let mut any = false;
    while let Ok(n) = (&*pipe).read(&mut buf) {
        if n == 0 {
            break;
        }
        any = true;
    }
    any
}

/// `poll` on `fds` for input, up to `timeout` (`None`: no limit); which are readable.
fn poll_in(fds: &[RawFd], timeout: Option<Duration>) -> Vec<bool> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    // SAFETY: `p` is a valid array of pollfd of the length given.
    let rc = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
    if rc <= 0 {
        return vec![false; fds.len()];
    }
    p.iter().map(|x| x.revents != 0).collect()
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags; it returns a new descriptor or -1.
    let rc = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor (close-on-exec, as pidfds are), owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as RawFd) })
}

impl Keeper {
    fn main_loop(&mut self) -> i32 {
        loop {
            if let Some(at) = self.restart_at {
                if Instant::now() >= at {
                    self.restart_at = None;
                    let exe = match self.exe.try_clone() {
                        Ok(e) => e,
                        Err(e) => {
                            log(format!("cannot start the server: {e}"));
                            return 1;
                        }
                    };
                    if let Err(e) = self.spawn(&exe) {
                        log(format!("cannot start the server: {e}"));
                        self.schedule_restart();
                    }
                }
            }
            let timeout = self
                .restart_at
                .map(|at| at.saturating_duration_since(Instant::now()));
            let mut fds = vec![self.stop_pipe.as_raw_fd(), self.upgrade_pipe.as_raw_fd()];
            if let Some(c) = &self.child {
                fds.push(c.pidfd.as_raw_fd());
                fds.extend(c.sock.as_ref().map(AsRawFd::as_raw_fd));
            }
            let ready = poll_in(&fds, timeout);
            if ready[0] && drain(&self.stop_pipe) {
                self.stop_child("stop requested", libc::SIGTERM);
                log("stopped");
                return 0;
            }
            if ready.get(3).copied().unwrap_or(false) {
                self.read_messages();
            }
            if ready.get(2).copied().unwrap_or(false) {
                if let Some(code) = self.reap() {
                    return code;
                }
            }
            if ready[1] {
                let signalled = drain(&self.upgrade_pipe);
                let mut replies: Vec<UpgradeReply> = self.requests.try_iter().collect();
                if signalled || !replies.is_empty() {
                    let answer = self.upgrade();
                    match &answer {
                        Ok(s) => log(s.trim_end()),
                        Err(e) => log(format!("upgrade failed: {e}")),
                    }
                    for r in replies.drain(..) {
                        let _ = r.send(answer.clone());
                    }
                    if self.child.is_none() && self.restart_at.is_none() {
                        // Stopped during the upgrade.
                        return 0;
                    }
                }
            }
        }
    }

    /// Starts a child running `exe` with the files held.
    fn spawn(&mut self, exe: &File) -> io::Result<()> {
        let (mine, theirs) = scm::seqpacket_pair()?;
        let mut names = Vec::new();
        let mut raw = Vec::new();
        for (dev, fds) in &self.files {
            for (file, fd) in FILE_NAMES.iter().zip(fds) {
                names.push(format!("{dev}/{file}"));
                raw.push(fd.as_raw_fd());
            }
        }
        let numbers: Vec<String> = raw.iter().map(|r| r.to_string()).collect();
        raw.push(theirs.as_raw_fd());
        let mut cmd = Command::new(format!("/proc/self/fd/{}", exe.as_raw_fd()));
        cmd.arg0("uzram")
            .args(&self.cfg.args)
            .env(fd_store::KEEPER_FD_ENV, theirs.as_raw_fd().to_string())
            .env(fd_store::STATE_FDS_ENV, numbers.join(" "))
            .env(fd_store::STATE_FDNAMES_ENV, names.join(":"))
            .env_remove("LISTEN_PID")
            .env_remove("LISTEN_FDS")
            .env_remove("LISTEN_FDNAMES")
            .env_remove("NOTIFY_SOCKET")
            .stdin(Stdio::null())
            // Its own process group: a terminal's Ctrl-C reaches the keeper, which stops it.
            .process_group(0);
        // SAFETY: between fork and exec the closure only calls fcntl (async-signal-safe) on
        // descriptors this process holds open, clearing close-on-exec so the child inherits
        // exactly them.
        unsafe {
            cmd.pre_exec(move || {
                for &fd in &raw {
                    if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let proc = cmd.spawn()?;
        drop(theirs);
        let pidfd = match pidfd_open(proc.id()) {
            Ok(p) => p,
            Err(e) => {
                let mut proc = proc;
                let _ = proc.kill();
                let _ = proc.wait();
                return Err(e);
            }
        };
        // SAFETY: fcntl on an open descriptor this process owns.
        unsafe {
            let fl = libc::fcntl(mine.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(mine.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        log(format!(
            "started the server, pid {}, with the state of {} device(s)",
            proc.id(),
            self.files.len()
        ));
        self.child = Some(Child {
            proc,
            pidfd,
            sock: Some(mine),
            started: Instant::now(),
            ready: false,
        });
        Ok(())
    }

    /// Handles every message waiting on the child's socket.
    fn read_messages(&mut self) {
        let mut buf = [0u8; MAX_MESSAGE_BYTES];
        loop {
            let Some(sock) = self.child.as_ref().and_then(|c| c.sock.as_ref()) else {
                return;
            };
            match scm::recv(sock.as_fd(), &mut buf) {
                Ok((0, _)) => {
                    if let Some(c) = &mut self.child {
                        c.sock = None;
                    }
                    return;
                }
                Ok((n, fds)) => self.handle(&buf[..n], fds),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => log(format!("a message from the server refused: {e}")),
            }
        }
    }

    fn handle(&mut self, msg: &[u8], fds: Vec<OwnedFd>) {
        let text = String::from_utf8_lossy(msg);
        let (verb, name) = text.split_once(' ').unwrap_or((&text, ""));
        match verb {
            "store" if storable_name(name) && fds.len() == DEVICE_FILES => {
                if !self.files.contains_key(name) && self.files.len() >= MAX_HELD {
                    log(format!(
                        "{name}: not held: already {MAX_HELD} devices' state"
                    ));
                    return;
                }
                let fds: [OwnedFd; DEVICE_FILES] = fds.try_into().expect("length checked");
                self.files.insert(name.to_string(), fds);
                log(format!("holding {name}'s state"));
            }
            "remove" if fds.is_empty() => {
                if self.files.remove(name).is_some() {
                    log(format!("dropped {name}'s state"));
                }
            }
            "ready" if fds.is_empty() => {
                if let Some(c) = &mut self.child {
                    c.ready = true;
                }
                self.served = true;
            }
            _ => log(format!(
                "a message from the server refused: {text:?} with {} descriptor(s)",
                fds.len()
            )),
        }
    }

    /// The child exited: reaps it and decides what follows; `Some(code)` to exit.
    fn reap(&mut self) -> Option<i32> {
        self.read_messages();
        let mut c = self.child.take()?;
        let status = match c.proc.wait() {
            Ok(s) => s,
            Err(e) => {
                log(format!("waiting for the server: {e}"));
                return Some(1);
            }
        };
        let ran = c.started.elapsed();
        if !self.served && self.files.is_empty() {
            log(format!(
                "the server exited before it served ({}): nothing to keep; exiting",
                describe(status)
            ));
            return Some(status.code().filter(|&c| c != 0).unwrap_or(1));
        }
        if status.success() {
            log("the server stopped (exit status 0): exiting, the devices' state with it");
            return Some(0);
        }
        if ran < STABLE {
            self.early_deaths += 1;
        } else {
            self.early_deaths = 0;
        }
        log(format!(
            "the server (pid {}) died after {:.1} s ({}): restarting {} with the state of {} \
             device(s)",
            c.proc.id(),
            ran.as_secs_f64(),
            describe(status),
            match self.delay() {
                d if d.is_zero() => "now".to_string(),
                d => format!("in {:.2} s", d.as_secs_f64()),
            },
            self.files.len()
        ));
        self.schedule_restart();
        None
    }

    /// The wait before the next restart: none after a child that served long enough (or the
    /// first early death), then doubling from 250 ms.
    fn delay(&self) -> Duration {
        match self.early_deaths {
            0 | 1 => Duration::ZERO,
            n => (Duration::from_millis(250) * (1u32 << (n - 2).min(10))).min(MAX_RESTART_DELAY),
        }
    }

    fn schedule_restart(&mut self) {
        self.restart_at = Some(Instant::now() + self.delay());
    }

    /// Waits for the child to serve (`for_ready`) or to exit, up to `deadline`, handling its
    /// messages; a stop signal ends the wait.
    fn wait_child(&mut self, for_ready: bool, deadline: Instant) -> Waited {
        loop {
            let Some(c) = &self.child else {
                return Waited::TimedOut;
            };
            if for_ready && c.ready {
                return Waited::Ready;
            }
            let now = Instant::now();
            if now >= deadline {
                return Waited::TimedOut;
            }
            let mut fds = vec![self.stop_pipe.as_raw_fd(), c.pidfd.as_raw_fd()];
            fds.extend(c.sock.as_ref().map(AsRawFd::as_raw_fd));
            let r = poll_in(&fds, Some(deadline - now));
            if r.get(2).copied().unwrap_or(false) {
                self.read_messages();
            }
            if r[1] {
                self.read_messages();
                let mut c = self.child.take().expect("checked");
                let status = c
                    .proc
                    .wait()
                    .unwrap_or_else(|_| ExitStatus::from_raw(1 << 8));
                return Waited::Exited(status);
            }
            if r[0] && drain(&self.stop_pipe) {
                return Waited::Stop;
            }
        }
    }

    /// Stops the child with `signal` (SIGTERM; SIGUSR2 for an upgrade: the server stops for a
    /// restart, leaving its block devices to the next one); SIGKILL after [`STOP_TIMEOUT`] or
    /// a second stop signal.
    fn stop_child(&mut self, why: &str, signal: libc::c_int) {
        let Some(c) = &self.child else {
            return;
        };
        let pid = c.proc.id();
        log(format!("{why}: stopping the server (pid {pid})"));
        // SAFETY: kill on our own child's pid, not reaped yet (so not reused).
        unsafe { libc::kill(pid as libc::pid_t, signal) };
        match self.wait_child(false, Instant::now() + STOP_TIMEOUT) {
            Waited::Exited(s) => log(format!("the server stopped ({})", describe(s))),
            _ => {
                log("the server did not stop: killing it");
                if let Some(mut c) = self.child.take() {
                    let _ = c.proc.kill();
                    let _ = c.proc.wait();
                }
            }
        }
    }

    /// Replaces the child by one of the binary now at the path; the answer for the caller.
    fn upgrade(&mut self) -> std::result::Result<String, String> {
        let path = self.cfg.exe.clone();
        let new = File::open(&path).map_err(|e| format!("opening {}: {e}", path.display()))?;
        let version = check_binary(&new).map_err(|e| {
            format!(
                "{} does not run ({e}): the server serves on unchanged",
                path.display()
            )
        })?;
        self.stop_child(&format!("upgrading to {version}"), libc::SIGUSR2);
        self.restart_at = None;
        let failed = match self.spawn(&new) {
            Err(e) => format!("did not start ({e})"),
            Ok(()) => match self.wait_child(true, Instant::now() + START_TIMEOUT) {
                Waited::Ready => {
                    self.exe = new;
                    self.early_deaths = 0;
                    let pid = self.child.as_ref().map_or(0, |c| c.proc.id());
                    return Ok(format!("upgraded to {version}: the server is pid {pid}\n"));
                }
                Waited::Stop => {
                    self.stop_child("stop requested", libc::SIGTERM);
                    return Err("the keeper is stopping".into());
                }
                Waited::Exited(s) => format!("exited before it served ({})", describe(s)),
                Waited::TimedOut => {
                    if let Some(mut c) = self.child.take() {
                        let _ = c.proc.kill();
                        let _ = c.proc.wait();
                    }
                    format!("did not serve within {} s: killed", START_TIMEOUT.as_secs())
                }
            },
        };
        let back = match self.exe.try_clone().and_then(|old| self.spawn(&old)) {
            Ok(()) => match self.wait_child(true, Instant::now() + START_TIMEOUT) {
                Waited::Ready => "the previous binary serves again".to_string(),
                _ => {
                    self.schedule_restart();
                    "the previous binary did not serve again either: restarting it".to_string()
                }
            },
            Err(e) => {
                self.schedule_restart();
                format!("the previous binary did not start ({e}): restarting it")
            }
        };
        Err(format!("the new binary ({version}) {failed}; {back}"))
    }
}

/// `BINARY --version` (at most 10 s): its first line, or why it failed.
fn check_binary(exe: &File) -> std::result::Result<String, String> {
    let mut child = Command::new(format!("/proc/self/fd/{}", exe.as_raw_fd()))
        .arg0("uzram")
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let pidfd = pidfd_open(child.id()).map_err(|e| e.to_string())?;
    if !poll_in(&[pidfd.as_raw_fd()], Some(Duration::from_secs(10)))[0] {
        let _ = child.kill();
        let _ = child.wait();
        return Err("--version did not answer within 10 s".into());
    }
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let line = out.lines().next().unwrap_or("").trim().to_string();
    if !status.success() || !line.starts_with("uzram ") {
        return Err(format!("--version: {}, {line:?}", describe(status)));
    }
    Ok(line)
}
