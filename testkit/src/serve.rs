//! A running `uzram serve`, as a user starts it: the built binary in a temporary directory
//! (`{dir}` in an argument or a configuration becomes that directory), its standard output read
//! up to its line `serving` (and drained after, so a later line never meets a closed pipe), its
//! standard error in `DIR/stderr`; `uzram ctl` and `uzram status` against it, the NBD URI of
//! its devices, signals and a clean stop. Killed when dropped, so a failing assertion leaves
//! nothing running.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::process::{kill, run, wait_timeout};

/// The `uzram` binary cargo built beside the running test (`target/PROFILE/uzram`; the test is
/// `target/PROFILE/deps/NAME-HASH`). Only a test of the `uzram-cli` package can count on it
/// being built (cargo builds a package's binaries before its integration tests).
pub fn uzram_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("uzram"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| panic!("no uzram binary beside {}", exe.display()));
    bin
}

/// A page corpus of real programs' memory, `uzram corpus ARGS`, made once per build directory
/// (in `target/tmp/corpus/NAME`) and kept for the next run; made again when `valid` refuses
/// the file there (a corpus of an older format). Written under another name and renamed, so a
/// run stopped half-way never leaves a corpus that looks complete.
pub fn corpus(name: &str, args: &[&str], valid: impl Fn(&Path) -> bool) -> PathBuf {
    static MAKING: Mutex<()> = Mutex::new(());
    let _one_at_a_time = MAKING.lock().unwrap_or_else(|e| e.into_inner());
    let target = uzram_bin()
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    let dir = target.join("tmp").join("corpus");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    if !valid(&path) {
        let part = dir.join(format!("{name}.{}.part", std::process::id()));
        run(Command::new(uzram_bin())
            .arg("corpus")
            .args(args)
            .arg("--out")
            .arg(&part));
        std::fs::rename(&part, &path).unwrap();
    }
    path
}

/// `uzram ctl --dir DIR ARGS...` against the server whose directory is `dir`.
pub fn ctl_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(uzram_bin())
        .arg("ctl")
        .arg("--dir")
        .arg(dir)
        .args(args)
        .output()
        .unwrap()
}

/// The NBD URI of device `name` of the server whose directory (where its sockets default to)
/// is `dir`.
pub fn uri_in(dir: &Path, name: &str) -> String {
    format!(
        "nbd+unix:///{name}?socket={}",
        dir.join(format!("{name}.sock")).display()
    )
}

/// Standard output as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Standard error as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// How to start `uzram serve`.
#[derive(Debug, Default)]
pub struct Serve {
    args: Vec<String>,
    env: Vec<(OsString, OsString)>,
    dir: Option<tempfile::TempDir>,
    config: Option<String>,
    prefix: Vec<String>,
}

/// A `uzram serve` that exited before it served.
#[derive(Debug)]
pub struct Failed {
    /// How it exited.
    pub status: ExitStatus,
    /// What it printed on its standard output.
    pub stdout: String,
    /// What it printed on its standard error.
    pub stderr: String,
}

impl Serve {
    /// `uzram serve ARGS`.
    pub fn args(args: &[&str]) -> Serve {
        Serve::default().arg(args)
    }

    /// `uzram serve --config DIR/uzram.toml` with `toml` written there (`{dir}` in it
    /// becomes the directory).
    pub fn config(toml: &str) -> Serve {
        Serve {
            config: Some(toml.to_string()),
            ..Serve::default()
        }
    }

    /// `uzram serve --config` of one device, zram0 of `disksize` on `{dir}/zram0.sock`, over
    /// the file `backing` (its `backing_dev`), with `more` (TOML keys of the device's table).
    pub fn zram0_over(disksize: &str, backing: &Path, more: &str) -> Serve {
        Serve::config(&format!(
            "[[device]]\nname = \"zram0\"\ndisksize = \"{disksize}\"\n\
             socket = \"{{dir}}/zram0.sock\"\nbacking_dev = \"{}\"\n{more}\n",
            backing.display()
        ))
    }

    /// More arguments.
    pub fn arg(mut self, args: &[&str]) -> Serve {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// An environment variable for the server.
    pub fn env(mut self, name: impl Into<OsString>, value: impl Into<OsString>) -> Serve {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Runs in `dir` instead of a new temporary directory.
    pub fn in_dir(mut self, dir: tempfile::TempDir) -> Serve {
        self.dir = Some(dir);
        self
    }

    /// Runs through `prefix` (a program and its options, e.g. `setpriv` dropping privileges).
    /// The prefix may drop privileges: it runs a copy of the binary in the (world-readable)
    /// directory, since the build directory may be private to root.
    pub fn prefix(mut self, prefix: &[&str]) -> Serve {
        self.prefix = prefix.iter().map(|a| a.to_string()).collect();
        self
    }

    /// Starts it and waits for its line `serving`; panics with its output if it exits first.
    pub fn start(self) -> Running {
        match self.try_start() {
            Ok(r) => r,
            Err(f) => panic!("uzram serve did not start:\n{}\n{}", f.stdout, f.stderr),
        }
    }

    /// Starts it and expects it to refuse: to exit with an error before it serves. Returns
    /// what it printed.
    pub fn refused(self) -> Failed {
        match self.try_start() {
            Ok(r) => panic!("uzram serve served: {:?}", r.lines()),
            Err(f) => {
                assert!(!f.status.success(), "exit 0 without serving: {f:?}");
                f
            }
        }
    }

    /// Starts it and waits for its line `serving`; `Err` with its output if it exits first.
    pub fn try_start(self) -> Result<Running, Failed> {
        let dir = match self.dir {
            Some(d) => d,
            None => tempfile::tempdir().unwrap(),
        };
        let d = dir.path().to_str().unwrap().to_string();
        let mut args: Vec<String> = Vec::new();
        if let Some(toml) = &self.config {
            let path = dir.path().join("uzram.toml");
            std::fs::write(&path, toml.replace("{dir}", &d)).unwrap();
            args.push("--config".into());
            args.push(path.to_str().unwrap().into());
        }
        args.extend(self.args.iter().map(|a| a.replace("{dir}", &d)));
        let bin = uzram_bin();
        let mut cmd = match self.prefix.split_first() {
            None => Command::new(&bin),
            Some((program, options)) => {
                let copy = dir.path().join("uzram");
                std::fs::copy(&bin, &copy).unwrap();
                std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
                let mut c = Command::new(program);
                c.args(options).arg(copy);
                c
            }
        };
        cmd.arg("serve")
            .args(&args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped());
        // A copy just written can be busy for exec (ETXTBSY) while another test thread's
        // child, forked while the copy's file was open for writing, has not exec'd yet and
        // still holds that descriptor: the prefix's exec then fails. A few tries, a moment
        // apart.
        let mut tries = 0;
        loop {
            tries += 1;
            let stderr = std::fs::File::create(dir.path().join("stderr")).unwrap();
            let mut child = cmd.stderr(stderr).spawn().unwrap();
            let (lines, serving) = read_until_serving(&mut child);
            if serving {
                return Ok(Running { child, dir, lines });
            }
            // It closed its output: it is exiting. Its status, or killed after 20 s.
            let status = wait_timeout(&mut child, Duration::from_secs(20)).unwrap_or_else(|| {
                kill(&mut child);
                child.wait().unwrap()
            });
            let log = std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default();
            if !self.prefix.is_empty() && log.contains("Text file busy") && tries < 5 {
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
            let lines = lines.lock().unwrap();
            return Err(Failed {
                status,
                stdout: lines.iter().map(|l| format!("{l}\n")).collect(),
                stderr: log,
            });
        }
    }
}

/// Reads `child`'s standard output up to its line `serving` (false: it closed its output
/// first, as it does when it exits), then goes on reading it on a thread of its own. Every line
/// is kept.
fn read_until_serving(child: &mut Child) -> (Arc<Mutex<Vec<String>>>, bool) {
    let out = Arc::new(Mutex::new(Vec::new()));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut serving = false;
    for line in lines.by_ref() {
        let Ok(line) = line else { break };
        serving = line.starts_with("serving");
        out.lock().unwrap().push(line);
        if serving {
            break;
        }
    }
    let rest = Arc::clone(&out);
    std::thread::spawn(move || {
        for line in lines.map_while(|l| l.ok()) {
            rest.lock().unwrap().push(line);
        }
    });
    (out, serving)
}

/// A running `uzram serve`.
#[derive(Debug)]
pub struct Running {
    /// The server's process.
    pub child: Child,
    dir: tempfile::TempDir,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Running {
    /// Its directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What it printed on its standard output so far (up to `serving`, and any line after).
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// What it printed before `serving`.
    pub fn banner(&self) -> Vec<String> {
        let lines = self.lines();
        let n = lines
            .iter()
            .position(|l| l.starts_with("serving"))
            .unwrap_or(lines.len());
        lines[..n].to_vec()
    }

    /// What it wrote to its standard error so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir().join("stderr")).unwrap_or_default()
    }

    /// The NBD URI of device `name` (its socket in the directory).
    pub fn uri(&self, name: &str) -> String {
        uri_in(self.dir(), name)
    }

    /// The NBD socket of device `name` in the directory.
    pub fn socket(&self, name: &str) -> PathBuf {
        self.dir().join(format!("{name}.sock"))
    }

    /// The URIs it printed (`nbd...`).
    pub fn uris(&self) -> Vec<String> {
        self.banner()
            .iter()
            .filter_map(|l| l.trim().strip_prefix("nbd").map(|u| format!("nbd{u}")))
            .collect()
    }

    /// The address (`HOST:PORT`) of the first TCP URI it printed.
    pub fn tcp_addr(&self) -> String {
        self.banner()
            .iter()
            .find_map(|l| l.trim().strip_prefix("nbd://"))
            .map(|r| r.split('/').next().unwrap().to_string())
            .expect("a TCP URI")
    }

    /// The port of the first URI on 127.0.0.1 it printed (`nbd://` or `nbds://`).
    pub fn tcp_port(&self) -> u16 {
        self.banner()
            .iter()
            .find_map(|l| l.trim().split("127.0.0.1:").nth(1))
            .and_then(|r| r.split('/').next()?.parse().ok())
            .expect("a TCP URI")
    }

    /// The metrics URL it printed.
    pub fn metrics_url(&self) -> String {
        self.banner()
            .iter()
            .find_map(|l| l.strip_prefix("metrics: "))
            .expect("a metrics line")
            .to_string()
    }

    /// `uzram ctl --dir DIR ARGS...`.
    pub fn ctl(&self, args: &[&str]) -> Output {
        ctl_in(self.dir(), args)
    }

    /// `uzram ctl --dev DEV ATTR` (`cat`), which must succeed.
    pub fn show(&self, dev: &str, attr: &str) -> String {
        let o = self.ctl(&["--dev", dev, attr]);
        assert!(o.status.success(), "{dev} {attr}: {o:?}");
        String::from_utf8(o.stdout).unwrap()
    }

    /// `uzram ctl --dev DEV ATTR VALUE` (`echo VALUE > ATTR`), which must succeed.
    pub fn set(&self, dev: &str, attr: &str, value: &str) {
        let o = self.ctl(&["--dev", dev, attr, value]);
        assert!(o.status.success(), "{dev} {attr} {value}: {o:?}");
    }

    /// An attribute's columns as numbers.
    pub fn columns(&self, dev: &str, attr: &str) -> Vec<u64> {
        let text = self.show(dev, attr);
        text.split_whitespace()
            .map(|c| {
                c.parse()
                    .unwrap_or_else(|_| panic!("{dev} {attr}: {c:?} in {text:?}"))
            })
            .collect()
    }

    /// `uzram status --dir DIR ARGS...`, which must succeed.
    pub fn status(&self, args: &[&str]) -> String {
        let o = Command::new(uzram_bin())
            .arg("status")
            .arg("--dir")
            .arg(self.dir())
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{o:?}");
        String::from_utf8(o.stdout).unwrap()
    }

    /// Its export and control sockets.
    pub fn sockets(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "sock" || x == "ctl"))
            .collect()
    }

    /// Sends it a signal (`-TERM`, `-INT`...).
    pub fn signal(&self, sig: &str) {
        run(Command::new("kill").args([sig, &self.pid().to_string()]));
    }

    /// Waits for it to exit; panics (with its log) after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        wait_timeout(&mut self.child, within)
            .unwrap_or_else(|| panic!("uzram serve did not stop within {within:?}: {}", self.log()))
    }

    /// SIGTERM: it exits 0 within `within`.
    pub fn stop_within(mut self, within: Duration) {
        self.terminate(within);
    }

    /// SIGTERM: it exits 0 within 20 s and removes its export and control sockets.
    pub fn stop(mut self) {
        assert!(!self.sockets().is_empty(), "no sockets before the stop");
        self.terminate(Duration::from_secs(20));
        assert_eq!(self.sockets(), Vec::<PathBuf>::new(), "sockets left behind");
    }

    fn terminate(&mut self, within: Duration) {
        self.signal("-TERM");
        let s = self.wait_exit(within);
        assert!(s.success(), "{s:?}: {}", self.log());
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        kill(&mut self.child);
    }
}

/// A `uzram serve --keeper` (the keeper holding the devices' files, its child serving), for
/// the tests that kill its server (`kill -9`) again and again.
#[derive(Debug)]
pub struct Kept {
    /// The keeper (its standard output and error are its children's too).
    pub r: Running,
    kills: std::sync::atomic::AtomicUsize,
}

impl Kept {
    /// Starts `serve` with `--keeper`, which must say it keeps the devices.
    pub fn start(serve: Serve) -> Kept {
        let r = serve.arg(&["--keeper"]).start();
        assert!(
            r.lines().iter().any(|l| l.contains("kept by the keeper")),
            "{:?}",
            r.lines()
        );
        Kept {
            r,
            kills: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// The keeper's children now.
    pub fn children(&self) -> Vec<u32> {
        crate::process::children(self.r.pid())
    }

    /// The keeper's serving child.
    pub fn child(&self) -> u32 {
        let c = self.children();
        assert_eq!(c.len(), 1, "the keeper's children {c:?}: {}", self.r.log());
        c[0]
    }

    /// `kill -9` the serving child now, however young (the keeper restarts a child that died
    /// within 10 s of its start later and later: what its tests of that back-off want), and
    /// waits until the next one serves.
    pub fn kill_child_now(&self) {
        let before = self.servings();
        let old = self.child();
        // SAFETY: kill has no memory preconditions.
        unsafe { libc::kill(old as libc::pid_t, libc::SIGKILL) };
        crate::process::wait_for("a new server", Duration::from_secs(30), || {
            self.servings() > before
        });
        assert_ne!(self.child(), old);
        self.kills
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// How many times a server printed `serving`.
    pub fn servings(&self) -> usize {
        self.r
            .lines()
            .iter()
            .filter(|l| l.starts_with("serving"))
            .count()
    }

    /// `kill -9` the serving child once it has served 10 s (the keeper restarts such a child
    /// at once; one that dies sooner, later and later), and waits until the next one serves;
    /// returns the time from the kill to its `serving`. A slow restart says where it is: the
    /// server's new log lines and the keeper's children's states, every 5 s from 3 s on.
    pub fn kill_child(&self) -> Duration {
        self.kill_child_when(|_| true)
    }

    /// [`Kept::kill_child`], the kill sent as soon as `now(child's pid)` holds (polled without
    /// a pause, for at most 5 s; then it is sent anyway): e.g. while one of its threads runs.
    pub fn kill_child_when(&self, mut now: impl FnMut(u32) -> bool) -> Duration {
        std::thread::sleep(Duration::from_secs(11));
        let before = self.servings();
        let old = self.child();
        let picking = std::time::Instant::now();
        while !now(old) && picking.elapsed() < Duration::from_secs(5) {}
        let killed = std::time::Instant::now();
        let mut seen = self.r.log().len();
        let mut probed = 0;
        // SAFETY: kill has no memory preconditions.
        unsafe { libc::kill(old as libc::pid_t, libc::SIGKILL) };
        crate::process::wait_for("a new server", Duration::from_secs(90), || {
            let t = killed.elapsed().as_secs();
            if t >= 3 + 5 * probed {
                probed += 1;
                let log = self.r.log();
                for l in log.get(seen..).unwrap_or("").lines() {
                    println!("  [{t} s after kill {}] {l}", self.kills() + 1);
                }
                seen = log.len();
                for c in crate::process::children(self.r.pid()) {
                    let read = |f: &str| std::fs::read_to_string(format!("/proc/{c}/{f}"));
                    let stat = read("stat").unwrap_or_default();
                    let state = stat.rsplit_once(") ").map_or("?", |(_, r)| &r[..1]);
                    println!(
                        "  [{t} s] child {c} state {state} wchan {}; stack: {}",
                        read("wchan").unwrap_or_default(),
                        read("stack").unwrap_or_default().replace('\n', " | ")
                    );
                }
            }
            self.servings() > before
        });
        let took = killed.elapsed();
        assert_ne!(self.child(), old);
        self.kills
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        took
    }

    /// The kills so far.
    pub fn kills(&self) -> usize {
        self.kills.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The keeper's children go with it (a keeper killed leaves its serving child running).
impl Drop for Kept {
    fn drop(&mut self) {
        for c in self.children() {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(c as libc::pid_t, libc::SIGKILL) };
        }
    }
}
