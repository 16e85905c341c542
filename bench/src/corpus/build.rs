//! `uzram corpus`: builds a page corpus from the anonymous memory of real programs.
//!
//! Each workload (Python, Node.js, Java, PostgreSQL) is started, builds a realistic heap of
//! roughly 20–100 MiB (parsed JSON records, indexes, strings, collections; PostgreSQL loads and
//! queries tables), prints `READY <pid>` naming the process to snapshot, is snapshotted with
//! [`snapshot_pid`] and then stopped. Every process and temporary directory is owned by a guard
//! that stops or removes it on every exit path, errors included. A program that is not installed
//! is reported and skipped; if none is installed, that is an error. PostgreSQL refuses to run as
//! root, so as root it runs as the `postgres` user (or `nobody`).

use super::{snapshot_pid_stats, Corpus};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uzram::compress::{compress_bound, new_codec, same_filled_word, CodecParams};

/// Arguments of `uzram corpus`.
#[derive(Debug, Args)]
pub struct CorpusArgs {
    /// Where to write the corpus file.
    #[arg(long, default_value = "bench/corpus/pages.bin")]
    out: PathBuf,
    /// Pages to keep per program (an evenly spaced sample if it has more).
    #[arg(long, default_value_t = 4096)]
    pages_per_program: usize,
    /// Page size in bytes: 4096, 16384 or 65536.
    #[arg(long, default_value_t = 4096)]
    page_size: usize,
    /// Programs to run, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "python,node,java,postgres"
    )]
    programs: Vec<Program>,
    /// How long a workload may take to build its heap.
    #[arg(long, default_value_t = 300)]
    ready_timeout_secs: u64,
}

/// The workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Program {
    Python,
    Node,
    Java,
    Postgres,
}

impl Program {
    fn name(self) -> &'static str {
        match self {
            Program::Python => "python",
            Program::Node => "node",
            Program::Java => "java",
            Program::Postgres => "postgres",
        }
    }
}

/// Builds the corpus `uzram bench multipage` uses: every program, 1024 pages of 64 KiB each.
pub fn build_64k(out: &Path) -> Result<()> {
    run(CorpusArgs {
        out: out.to_path_buf(),
        pages_per_program: 1024,
        page_size: 65536,
        programs: vec![
            Program::Python,
            Program::Node,
            Program::Java,
            Program::Postgres,
        ],
        ready_timeout_secs: 300,
    })
}

/// Builds the default corpus at `out`: every installed program, 4096 pages each.
pub fn build_default(out: &Path) -> Result<()> {
    run(CorpusArgs {
        out: out.to_path_buf(),
        pages_per_program: 4096,
        page_size: 4096,
        programs: vec![
            Program::Python,
            Program::Node,
            Program::Java,
            Program::Postgres,
        ],
        ready_timeout_secs: 300,
    })
}

/// Runs `uzram corpus`.
pub fn run(args: CorpusArgs) -> Result<()> {
    let mut corpus = Corpus::new(args.page_size)?;
    let timeout = Duration::from_secs(args.ready_timeout_secs);
    let mut skipped = Vec::new();
    let mut pids = Vec::new();
    for &program in &args.programs {
        let name = program.name();
        let tmp = TempDir::new(name)?;
        let started = Instant::now();
        eprintln!("{name}: starting");
        let mut session = match start(program, &tmp) {
            Ok(Some(session)) => session,
            Ok(None) => {
                eprintln!("{name}: not installed, skipped");
                skipped.push(name);
                continue;
            }
            Err(e) => return Err(e.context(format!("{name}: starting the workload"))),
        };
        let pid = session
            .wait_ready(timeout)
            .with_context(|| format!("{name}: waiting for the workload"))?;
        eprintln!(
            "{name}: ready after {:.1} s, snapshotting pid {pid} ({})",
            started.elapsed().as_secs_f64(),
            memory_summary(pid)
        );
        // Let concurrent garbage collectors finish (V8 and the JVM unmap pages right after a
        // burst of allocation), then freeze the process so its mappings hold still.
        std::thread::sleep(SETTLE);
        send_signal(pid, "STOP");
        let mut pages = Vec::with_capacity(args.pages_per_program * args.page_size);
        let snapshot = snapshot_pid_stats(pid, args.page_size, args.pages_per_program, &mut pages);
        send_signal(pid, "CONT");
        let stats = snapshot.with_context(|| format!("{name}: snapshotting pid {pid}"))?;
        corpus.add_source(name, &pages)?;
        pids.push(pid);
        eprintln!(
            "{name}: {} pages sampled of {} touched ({} unreadable)",
            stats.written_pages, stats.touched_pages, stats.unreadable_pages
        );
        drop(session);
    }
    if corpus.sources().is_empty() {
        bail!(
            "none of the programs ({}) is installed",
            args.programs
                .iter()
                .map(|p| p.name())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    print_table(&corpus, &pids)?;
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    corpus.save(&args.out)?;
    println!(
        "wrote {} pages of {} bytes to {}{}",
        corpus.len(),
        corpus.page_size_bytes(),
        args.out.display(),
        if skipped.is_empty() {
            String::new()
        } else {
            format!(" (skipped, not installed: {})", skipped.join(", "))
        }
    );
    Ok(())
}

/// Prints pages, zero and same-filled shares, and lz4/zstd ratios per source.
///
/// Ratios are over the pages that are not same-filled (those cost no compressed bytes in zram):
/// their bytes divided by their compressed bytes, a page that does not shrink counted at its
/// full size (zram stores it raw, as a huge page).
fn print_table(corpus: &Corpus, pids: &[u32]) -> Result<()> {
    let ps = corpus.page_size_bytes();
    let lz4 = new_codec("lz4", CodecParams::default())?;
    let zstd = new_codec("zstd", CodecParams::default())?;
    let mut dst = vec![0u8; compress_bound(ps)];
    println!(
        "{:<10} {:>8} {:>6} {:>7} {:>7} {:>9} {:>10}",
        "program", "pid", "pages", "zero%", "same%", "lz4 x", "zstd x"
    );
    for (source, pid) in corpus.sources().iter().zip(pids) {
        let (mut zero, mut same, mut raw, mut lz4_bytes, mut zstd_bytes) = (0, 0, 0, 0, 0);
        for page in corpus.source_pages(source).chunks_exact(ps) {
            match same_filled_word(page) {
                Some(0) => zero += 1,
                Some(_) => same += 1,
                None => {
                    raw += ps;
                    lz4_bytes += lz4.compress(page, &mut dst)?.min(ps);
                    zstd_bytes += zstd.compress(page, &mut dst)?.min(ps);
                }
            }
        }
        let n = source.page_count.max(1) as f64;
        let ratio = |c: usize| if c == 0 { 0.0 } else { raw as f64 / c as f64 };
        println!(
            "{:<10} {:>8} {:>6} {:>6.1}% {:>6.1}% {:>9.2} {:>10.2}",
            source.name,
            pid,
            source.page_count,
            100.0 * zero as f64 / n,
            100.0 * same as f64 / n,
            ratio(lz4_bytes),
            ratio(zstd_bytes)
        );
    }
    Ok(())
}

/// How long a workload may run after `READY` before it is frozen and snapshotted.
const SETTLE: Duration = Duration::from_secs(1);

/// Sends `signal` (a name such as `STOP`) to `pid` with kill(1), so no `unsafe` is needed. A
/// failure only affects the snapshot's consistency, so it is ignored.
fn send_signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// A temporary directory removed (with its contents) when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Result<TempDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path =
            std::env::temp_dir().join(format!("uzram-corpus-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(TempDir(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process stopped when dropped: first with `stop_signal` (if any) and a grace period,
/// then with SIGKILL; always reaped.
struct Proc {
    child: Child,
    name: String,
    stop_signal: Option<&'static str>,
    /// The last lines of its stderr, for error messages.
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
}

/// Lines of stderr kept per process for error messages.
const STDERR_TAIL_LINES: usize = 20;
/// How long a process stopped with a signal gets to exit before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(15);

impl Proc {
    /// Spawns `cmd` with stdout piped into the returned channel (line by line) and stderr kept
    /// in a tail buffer; stdin is piped (and kept open) when `stdin` is true, else null.
    fn spawn(name: &str, mut cmd: Command, stdin: bool) -> Result<(Proc, Receiver<String>)> {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.stdin(if stdin { Stdio::piped() } else { Stdio::null() });
        let mut child = cmd
            .spawn()
            .with_context(|| format!("{name}: spawning {cmd:?}"))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if tx.send(line).is_err() {
                    // Nobody listens any more: keep draining so the child never blocks.
                    continue;
                }
            }
        });
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let tail_writer = Arc::clone(&tail);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                let mut t = tail_writer.lock().unwrap_or_else(|p| p.into_inner());
                if t.len() == STDERR_TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(line);
            }
        });
        let proc = Proc {
            child,
            name: name.to_owned(),
            stop_signal: None,
            stderr_tail: tail,
        };
        Ok((proc, rx))
    }

    fn stderr_tail(&self) -> String {
        let t = self.stderr_tail.lock().unwrap_or_else(|p| p.into_inner());
        t.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// Waits for a `READY <pid>` line on `rx`; fails if the process exits or times out first.
    fn wait_ready(&mut self, rx: &Receiver<String>, deadline: Instant) -> Result<u32> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(line) => {
                    if let Some((_, pid)) = line.split_once("READY ") {
                        return pid
                            .trim()
                            .parse()
                            .with_context(|| format!("{}: bad READY line {line:?}", self.name));
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait()?;
                    bail!(
                        "{} exited ({status}) before it was ready; stderr:\n{}",
                        self.name,
                        self.stderr_tail()
                    );
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Some(status) = self.child.try_wait()? {
                        // Give the reader a moment to deliver lines printed just before exit.
                        if let Ok(line) = rx.recv_timeout(Duration::from_millis(500)) {
                            if let Some((_, pid)) = line.split_once("READY ") {
                                return Ok(pid.trim().parse()?);
                            }
                        }
                        bail!(
                            "{} exited ({status}) before it was ready; stderr:\n{}",
                            self.name,
                            self.stderr_tail()
                        );
                    }
                    if Instant::now() >= deadline {
                        bail!(
                            "{} not ready in time; stderr:\n{}",
                            self.name,
                            self.stderr_tail()
                        );
                    }
                }
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let (Some(signal), Ok(None)) = (self.stop_signal, self.child.try_wait()) {
            send_signal(self.child.id(), signal);
            let until = Instant::now() + STOP_GRACE;
            while Instant::now() < until {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A started workload: the processes (dropped last-started first) and the READY channel.
struct Session {
    /// The process whose stdout carries `READY <pid>`, and the processes it needs (a server).
    /// Dropped in reverse order: the client first, then the server.
    procs: Vec<Proc>,
    ready: Receiver<String>,
    /// Kept until the processes are stopped.
    _stdin: Option<std::process::ChildStdin>,
}

impl Session {
    /// Waits until the last process (the one that prints `READY <pid>`) is ready.
    fn wait_ready(&mut self, timeout: Duration) -> Result<u32> {
        let deadline = Instant::now() + timeout;
        let proc = self
            .procs
            .last_mut()
            .ok_or_else(|| anyhow!("empty session"))?;
        proc.wait_ready(&self.ready, deadline)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Close stdin first (workloads exit on EOF), then stop processes newest first.
        self._stdin.take();
        while let Some(p) = self.procs.pop() {
            drop(p);
        }
    }
}

/// Starts `program`'s workload, or `None` if it is not installed.
fn start(program: Program, tmp: &TempDir) -> Result<Option<Session>> {
    match program {
        Program::Python => start_script(program, &["python3", "python"], "-c", PYTHON_WORKLOAD),
        Program::Node => start_script(program, &["node", "nodejs"], "-e", NODE_WORKLOAD),
        Program::Java => start_java(tmp),
        Program::Postgres => start_postgres(tmp),
    }
}

fn start_script(
    program: Program,
    names: &[&str],
    flag: &str,
    script: &str,
) -> Result<Option<Session>> {
    let Some(exe) = names.iter().find_map(|n| find_in_path(n)) else {
        return Ok(None);
    };
    let mut cmd = Command::new(exe);
    cmd.args([flag, script]);
    let (mut proc, ready) = Proc::spawn(program.name(), cmd, true)?;
    let stdin = proc.child.stdin.take();
    Ok(Some(Session {
        procs: vec![proc],
        ready,
        _stdin: stdin,
    }))
}

fn start_java(tmp: &TempDir) -> Result<Option<Session>> {
    let (Some(java), Some(javac)) = (find_in_path("java"), find_in_path("javac")) else {
        return Ok(None);
    };
    let src = tmp.path().join("Main.java");
    std::fs::write(&src, JAVA_WORKLOAD)?;
    let out = Command::new(javac)
        .arg("-d")
        .arg(tmp.path())
        .arg(&src)
        .output()
        .context("running javac")?;
    if !out.status.success() {
        bail!("javac failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let mut cmd = Command::new(java);
    // A 256 MiB cap keeps the heap in the size range every workload targets.
    cmd.args(["-Xmx256m", "-cp"]).arg(tmp.path()).arg("Main");
    let (mut proc, ready) = Proc::spawn("java", cmd, true)?;
    let stdin = proc.child.stdin.take();
    Ok(Some(Session {
        procs: vec![proc],
        ready,
        _stdin: stdin,
    }))
}

/// Rows in the PostgreSQL workload's `customers` table (~150 bytes each, ~50 MiB with the
/// index) and `orders` table (~50 bytes each): together they fill most of the 128 MiB of
/// shared buffers the server is started with.
const PG_CUSTOMERS: u32 = 300_000;
const PG_ORDERS: u32 = 400_000;

fn start_postgres(tmp: &TempDir) -> Result<Option<Session>> {
    let Some(bin) = postgres_bin_dir() else {
        return Ok(None);
    };
    let psql = [bin.join("psql")]
        .into_iter()
        .find(|p| p.is_file())
        .or_else(|| find_in_path("psql"))
        .ok_or_else(|| anyhow!("postgres: psql not found"))?;
    // PostgreSQL refuses to run as root: run initdb and the server as an unprivileged user.
    let user = if effective_uid()? == 0 {
        let user = ["postgres", "nobody"]
            .iter()
            .find_map(|name| lookup_user(name))
            .ok_or_else(|| anyhow!("postgres: running as root and no postgres/nobody user"))?;
        Some(user)
    } else {
        None
    };
    let dir = tmp.path().join("pg");
    let data = dir.join("data");
    std::fs::create_dir(&dir)?;
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
            .context("postgres: chown of the temporary directory")?;
    }
    let as_user = |cmd: &mut Command| {
        cmd.env("LC_ALL", "C").env_remove("PGDATA");
        if let Some((uid, gid)) = user {
            // std drops the supplementary groups when changing the uid.
            cmd.uid(uid).gid(gid);
        }
    };

    let mut initdb = Command::new(bin.join("initdb"));
    initdb
        .arg("-D")
        .arg(&data)
        .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
        .current_dir(&dir);
    as_user(&mut initdb);
    let out = initdb.output().context("postgres: running initdb")?;
    if !out.status.success() {
        bail!(
            "postgres: initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // A unix socket in our directory only (no TCP), so the port only names the socket file.
    let port = "5432";
    let mut server = Command::new(bin.join("postgres"));
    server
        .arg("-D")
        .arg(&data)
        .arg("-k")
        .arg(&dir)
        .args([
            "-p",
            port,
            "-c",
            "listen_addresses=",
            "-c",
            "shared_buffers=128MB",
        ])
        .args([
            "-c",
            "huge_pages=off",
            "-c",
            "fsync=off",
            "-c",
            "logging_collector=off",
        ])
        .current_dir(&dir);
    as_user(&mut server);
    let (mut server, _server_out) = Proc::spawn("postgres server", server, false)?;
    // SIGINT: PostgreSQL's fast shutdown (backends are told to exit, shared memory removed).
    server.stop_signal = Some("INT");

    // Wait until the server accepts connections.
    let psql_cmd = |args: &[&str]| {
        let mut c = Command::new(&psql);
        c.arg("-h")
            .arg(&dir)
            .args([
                "-p", port, "-U", "postgres", "-d", "postgres", "-X", "-q", "-A", "-t",
            ])
            .args(args)
            .env("LC_ALL", "C");
        c
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ok = psql_cmd(&["-c", "SELECT 1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            break;
        }
        if let Some(status) = server.child.try_wait()? {
            bail!(
                "postgres server exited ({status}); stderr:\n{}",
                server.stderr_tail()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "postgres server not accepting connections; stderr:\n{}",
                server.stderr_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }

    let mut client = psql_cmd(&["-v", "ON_ERROR_STOP=1"]);
    client.stdin(Stdio::piped());
    let (mut client, ready) = Proc::spawn("postgres client", client, true)?;
    let mut stdin = client.child.stdin.take().expect("stdin is piped");
    let sql = PG_WORKLOAD
        .replace("{customers}", &PG_CUSTOMERS.to_string())
        .replace("{orders}", &PG_ORDERS.to_string());
    stdin
        .write_all(sql.as_bytes())
        .and_then(|()| stdin.flush())
        .context("postgres: sending the workload to psql")?;
    Ok(Some(Session {
        procs: vec![server, client],
        ready,
        _stdin: Some(stdin),
    }))
}

/// The directory holding `initdb` and `postgres`: Debian's `/usr/lib/postgresql/N/bin`
/// (newest N first; not on `PATH`), else the directory of `initdb` on `PATH`.
fn postgres_bin_dir() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse().ok()?;
            Some((v, e.path().join("bin")))
        })
        .collect();
    versions.sort();
    let has_server = |d: &Path| d.join("initdb").is_file() && d.join("postgres").is_file();
    if let Some((_, dir)) = versions.into_iter().rev().find(|(_, d)| has_server(d)) {
        return Some(dir);
    }
    let initdb = find_in_path("initdb")?.canonicalize().ok()?;
    let dir = initdb.parent()?.to_path_buf();
    has_server(&dir).then_some(dir)
}

/// `RssAnon` and `RssShmem` of `pid` from `/proc/PID/status`, for the progress output.
fn memory_summary(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .filter(|l| l.starts_with("RssAnon:") || l.starts_with("RssShmem:"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The first executable file called `name` in `PATH`.
fn find_in_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// This process's effective uid, from `/proc/self/status` (no `unsafe` `geteuid` call).
fn effective_uid() -> Result<u32> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|euid| euid.parse().ok())
        .ok_or_else(|| anyhow!("no Uid line in /proc/self/status"))
}

/// `(uid, gid)` of `name` in `/etc/passwd`.
fn lookup_user(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 4 && f[0] == name).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}

/// Python: generates customer records, round-trips them through JSON, indexes them (by id, by
/// city, an inverted word index), keeps a sorted top list, a set of emails and a float matrix,
/// then frees half of the JSON strings (a heap with holes, as long-running programs have).
/// About 50 MiB of anonymous memory.
const PYTHON_WORKLOAD: &str = r#"
import collections, json, os, random, sys
random.seed(12345)
FIRST = "james mary robert patricia john jennifer michael linda david elizabeth william barbara richard susan joseph jessica thomas sarah charles karen".split()
LAST = "smith johnson williams brown jones garcia miller davis rodriguez martinez hernandez lopez gonzalez wilson anderson thomas taylor moore jackson martin".split()
CITIES = "berlin paris london madrid rome vienna prague warsaw lisbon dublin oslo helsinki athens zurich amsterdam".split()
STREETS = "main oak pine maple cedar elm washington lake hill park".split()
TAGS = "new vip churned trial enterprise smb partner beta internal test".split()
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore et dolore magna aliqua enim ad minim veniam quis nostrud exercitation ullamco laboris nisi aliquip ex ea commodo consequat".split()
def record(i):
    first, last = random.choice(FIRST), random.choice(LAST)
    return {
        "id": i, "uuid": "%032x" % random.getrandbits(128),
        "name": first.title() + " " + last.title(), "email": "%s.%s%d@example.com" % (first, last, i),
        "age": random.randint(18, 90), "balance": round(random.uniform(-1000, 100000), 2),
        "created": "2024-%02d-%02dT%02d:%02d:%02dZ" % (random.randint(1, 12), random.randint(1, 28), random.randint(0, 23), random.randint(0, 59), random.randint(0, 59)),
        "tags": random.sample(TAGS, random.randint(1, 4)),
        "address": {"street": "%d %s st" % (random.randint(1, 999), random.choice(STREETS)), "city": random.choice(CITIES), "zip": "%05d" % random.randint(0, 99999)},
        "bio": " ".join(random.choice(WORDS) for _ in range(random.randint(5, 30))),
        "active": random.random() < 0.7,
    }
N = 12000
lines = [json.dumps(record(i)) for i in range(N)]
records = [json.loads(l) for l in lines]
by_id = {r["id"]: r for r in records}
by_city = collections.defaultdict(list)
for r in records:
    by_city[r["address"]["city"]].append(r["id"])
word_counts = collections.Counter(w for r in records for w in r["bio"].split())
inverted = collections.defaultdict(set)
for r in records[:20000]:
    for w in set(r["bio"].split()):
        inverted[w].add(r["id"])
top = sorted(records, key=lambda r: r["balance"], reverse=True)[:2000]
emails = {r["email"].upper() for r in records}
matrix = [[random.random() for _ in range(100)] for _ in range(1000)]
del lines[::2]
print("READY", os.getpid(), flush=True)
sys.stdin.read()
"#;

/// Node.js: the same kind of records as objects, JSON strings parsed back, Maps and Sets as
/// indexes, a Float64Array of balances, string building, then half the strings dropped.
/// About 100 MiB of RSS.
const NODE_WORKLOAD: &str = r#"
let seed = 12345;
function rnd() { seed = (seed + 0x6d2b79f5) | 0; let t = seed; t = Math.imul(t ^ (t >>> 15), t | 1); t ^= t + Math.imul(t ^ (t >>> 7), t | 61); return ((t ^ (t >>> 14)) >>> 0) / 4294967296; }
const pick = (a) => a[Math.floor(rnd() * a.length)];
const FIRST = "james mary robert patricia john jennifer michael linda david elizabeth".split(" ");
const LAST = "smith johnson williams brown jones garcia miller davis rodriguez martinez".split(" ");
const CITIES = "berlin paris london madrid rome vienna prague warsaw lisbon dublin".split(" ");
const WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore et dolore magna aliqua".split(" ");
const N = 40000;
const lines = [];
for (let i = 0; i < N; i++) {
  const first = pick(FIRST), last = pick(LAST);
  const bio = []; for (let k = 0, n = 5 + Math.floor(rnd() * 25); k < n; k++) bio.push(pick(WORDS));
  lines.push(JSON.stringify({ id: i, name: first + " " + last, email: `${first}.${last}${i}@example.com`,
    age: 18 + Math.floor(rnd() * 70), balance: Math.round(rnd() * 10000000) / 100,
    created: new Date(1700000000000 + Math.floor(rnd() * 3e10)).toISOString(),
    tags: ["new", "vip", "trial", "smb"].filter(() => rnd() < 0.4),
    address: { street: `${1 + Math.floor(rnd() * 999)} main st`, city: pick(CITIES), zip: String(Math.floor(rnd() * 99999)).padStart(5, "0") },
    bio: bio.join(" "), active: rnd() < 0.7 }));
}
const records = lines.map((l) => JSON.parse(l));
const byId = new Map(records.map((r) => [r.id, r]));
const byCity = new Map();
for (const r of records) { if (!byCity.has(r.address.city)) byCity.set(r.address.city, []); byCity.get(r.address.city).push(r.id); }
const words = new Map();
for (const r of records) for (const w of r.bio.split(" ")) words.set(w, (words.get(w) || 0) + 1);
const emails = new Set(records.map((r) => r.email.toUpperCase()));
const balances = new Float64Array(records.map((r) => r.balance));
const top = [...records].sort((a, b) => b.balance - a.balance).slice(0, 2000);
const report = records.slice(0, 20000).map((r) => `${r.id};${r.name};${r.address.city};${r.balance.toFixed(2)}`).join("\n");
for (let i = 0; i < lines.length; i += 2) lines[i] = null;
globalThis.keep = { records, byId, byCity, words, emails, balances, top, report, lines };
console.log("READY " + process.pid);
process.stdin.resume();
process.stdin.on("end", () => process.exit(0));
"#;

/// Java: customer objects in an ArrayList, HashMap and TreeMap indexes, JSON-like strings built
/// with StringBuilder, primitive arrays; half the strings dropped. About 100 MiB of heap.
const JAVA_WORKLOAD: &str = r#"
import java.util.*;

public class Main {
    record Address(String street, String city, String zip) {}
    static final class Customer {
        long id; String name; String email; int age; double balance; List<String> tags; Address address; String bio; boolean active;
    }
    public static void main(String[] args) throws Exception {
        Random r = new Random(12345);
        String[] first = "james mary robert patricia john jennifer michael linda david elizabeth".split(" ");
        String[] last = "smith johnson williams brown jones garcia miller davis rodriguez martinez".split(" ");
        String[] cities = "berlin paris london madrid rome vienna prague warsaw lisbon dublin".split(" ");
        String[] words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore".split(" ");
        String[] tags = "new vip churned trial enterprise smb partner beta".split(" ");
        int n = 40000;
        List<Customer> all = new ArrayList<>();
        Map<Long, Customer> byId = new HashMap<>();
        Map<String, List<Long>> byCity = new HashMap<>();
        TreeMap<String, Integer> wordCounts = new TreeMap<>();
        List<String> json = new ArrayList<>();
        for (int i = 0; i < n; i++) {
            Customer c = new Customer();
            String f = first[r.nextInt(first.length)], l = last[r.nextInt(last.length)];
            c.id = i; c.name = f + " " + l; c.email = f + "." + l + i + "@example.com";
            c.age = 18 + r.nextInt(70); c.balance = Math.round(r.nextDouble() * 10000000) / 100.0;
            c.tags = new ArrayList<>();
            for (String t : tags) if (r.nextInt(4) == 0) c.tags.add(t);
            c.address = new Address((1 + r.nextInt(999)) + " main st", cities[r.nextInt(cities.length)], String.format("%05d", r.nextInt(99999)));
            StringBuilder bio = new StringBuilder();
            for (int k = 0, m = 5 + r.nextInt(25); k < m; k++) { if (k > 0) bio.append(' '); String w = words[r.nextInt(words.length)]; bio.append(w); wordCounts.merge(w, 1, Integer::sum); }
            c.bio = bio.toString(); c.active = r.nextInt(10) < 7;
            all.add(c); byId.put(c.id, c);
            byCity.computeIfAbsent(c.address.city(), k -> new ArrayList<>()).add(c.id);
            json.add("{\"id\":" + c.id + ",\"name\":\"" + c.name + "\",\"email\":\"" + c.email + "\",\"balance\":" + c.balance + ",\"city\":\"" + c.address.city() + "\",\"bio\":\"" + c.bio + "\"}");
        }
        double[] balances = all.stream().mapToDouble(c -> c.balance).toArray();
        long[] ids = all.stream().mapToLong(c -> c.id).toArray();
        List<Customer> top = new ArrayList<>(all);
        top.sort(Comparator.comparingDouble((Customer c) -> -c.balance));
        top = new ArrayList<>(top.subList(0, 2000));
        for (int i = 0; i < json.size(); i += 2) json.set(i, null);
        Object[] keep = { all, byId, byCity, wordCounts, json, balances, ids, top };
        System.out.println("READY " + ProcessHandle.current().pid());
        System.out.flush();
        while (System.in.read() != -1) { }
        System.out.println(keep.length);
    }
}
"#;

/// PostgreSQL: loads two tables into shared buffers, indexes and analyses them, runs
/// aggregations, a join and a sort with a large `work_mem`, keeps a temporary table in the
/// backend's local buffers (`temp_buffers`, private memory), then prints `READY <backend pid>`.
/// `{customers}` and `{orders}` are replaced with row counts.
const PG_WORKLOAD: &str = r#"
SET temp_buffers = '64MB';
SET work_mem = '64MB';
SELECT setseed(0.5);
CREATE TABLE customers (id int PRIMARY KEY, name text, email text, city text, balance numeric(12,2), created timestamptz, tags text[], bio text);
INSERT INTO customers
  SELECT i, 'name_' || (i::bigint * 7919 % 100000), 'user' || i || '@example.com',
         (ARRAY['berlin','paris','london','madrid','rome','vienna','prague','warsaw'])[1 + i % 8],
         round((random() * 100000)::numeric, 2), timestamptz '2024-01-01' + (i || ' minutes')::interval,
         ARRAY['t' || (i % 13), 't' || (i % 7)], repeat(md5(i::text), 1 + i % 3)
  FROM generate_series(1, {customers}) i;
CREATE INDEX ON customers (city, balance);
CREATE TABLE orders AS
  SELECT g AS id, (g::bigint * 31 % {customers})::int + 1 AS customer_id, round((random() * 500)::numeric, 2) AS amount,
         timestamptz '2024-01-01' + (g || ' seconds')::interval AS at
  FROM generate_series(1, {orders}) g;
CREATE INDEX ON orders (customer_id);
ANALYZE;
SELECT city, count(*), avg(balance) FROM customers GROUP BY city;
SELECT c.city, sum(o.amount), count(DISTINCT o.customer_id) FROM orders o JOIN customers c ON c.id = o.customer_id GROUP BY c.city;
SELECT id, bio FROM customers ORDER BY bio, id LIMIT 5;
SELECT count(*) FROM customers WHERE city = 'paris' AND balance > 50000;
CREATE TEMP TABLE rich AS SELECT * FROM customers WHERE balance > 40000;
SELECT count(*), sum(balance) FROM rich;
SELECT 'READY ' || pg_backend_pid();
"#;
