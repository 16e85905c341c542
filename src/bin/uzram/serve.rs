//! `uzram serve`: create a device and export it over NBD until SIGINT/SIGTERM.
//!
//! With no flags it needs no configuration, as zram-generator does: one device `zram0` of
//! min(RAM/2, 4 GiB), lz4, 4 KiB pages, on a unix socket (mode 0600) at
//! `/run/uzram/zram0.sock` as root, `$XDG_RUNTIME_DIR/uzram/zram0.sock` otherwise (or
//! `/tmp/uzram-$UID/zram0.sock` without `XDG_RUNTIME_DIR`). TCP only with `--listen`.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use uzram::device::{Device, DeviceConfig};
use uzram::frontend::nbd::{Export, Listen, Server, ServerConfig};
use uzram::units::parse_size_bytes;
use uzram::BlockDevice;

/// The largest default disksize: 4 GiB, zram-generator's default cap.
const DEFAULT_MAX_DISKSIZE_BYTES: u64 = 4 << 30;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Device and export name.
    #[arg(long, default_value = "zram0")]
    pub name: String,
    /// Device size (K, M, G suffixes) [default: min(RAM/2, 4G)].
    #[arg(long)]
    pub disksize: Option<String>,
    /// Compression algorithm (zram's comp_algorithm).
    #[arg(long, default_value = "lz4")]
    pub algorithm: String,
    /// Memory limit for compressed data (zram's mem_limit; 0: none).
    #[arg(long, default_value = "0")]
    pub mem_limit: String,
    /// Page size in bytes: 4096, 16384 or 65536.
    #[arg(long, default_value_t = 4096)]
    pub page_size: usize,
    /// Also listen on TCP at ADDR:PORT (e.g. 127.0.0.1:10809). Unauthenticated: keep it local.
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<SocketAddr>,
    /// The unix socket path [default: /run/uzram/NAME.sock as root, else
    /// $XDG_RUNTIME_DIR/uzram/NAME.sock].
    #[arg(long)]
    pub socket: Option<PathBuf>,
}

/// Total RAM from /proc/meminfo.
fn ram_bytes() -> Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    for line in meminfo.lines() {
        if let Some(rest) = line.strip_prefix("MemTotal:") {
            let kib: u64 = rest
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .context("parsing MemTotal")?;
            return Ok(kib * 1024);
        }
    }
    bail!("no MemTotal in /proc/meminfo")
}

/// min(RAM/2, 4 GiB), rounded down to a whole page.
fn default_disksize_bytes(page_size: usize) -> Result<u64> {
    let size = (ram_bytes()? / 2).min(DEFAULT_MAX_DISKSIZE_BYTES);
    Ok(size / page_size as u64 * page_size as u64)
}

/// The directory for sockets: /run/uzram as root, $XDG_RUNTIME_DIR/uzram otherwise.
fn default_socket_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        return PathBuf::from("/run/uzram");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("uzram"),
        _ => PathBuf::from(format!("/tmp/uzram-{uid}")),
    }
}

fn socket_path(args: &ServeArgs) -> Result<PathBuf> {
    if let Some(p) = &args.socket {
        return Ok(p.clone());
    }
    let dir = default_socket_dir();
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir.join(format!("{}.sock", args.name)))
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

pub fn run(args: ServeArgs) -> Result<()> {
    let disksize_bytes = match &args.disksize {
        Some(s) => parse_size_bytes(s).with_context(|| format!("--disksize {s}"))?,
        None => default_disksize_bytes(args.page_size)?,
    };
    let mem_limit_bytes = parse_size_bytes(&args.mem_limit)
        .with_context(|| format!("--mem-limit {}", args.mem_limit))?;
    let device = Device::new(DeviceConfig {
        disksize_bytes,
        page_size_bytes: args.page_size,
        comp_algorithm: args.algorithm.clone(),
        mem_limit_bytes,
        ..Default::default()
    })
    .with_context(|| format!("creating device {}", args.name))?;
    let device: Arc<dyn BlockDevice> = Arc::new(device);
    let description = format!(
        "uzram {} ({}, {} pages)",
        args.name, args.algorithm, args.page_size
    );
    let export = Export {
        name: args.name.clone(),
        description,
        device: Arc::clone(&device),
    };
    let socket = socket_path(&args)?;
    let mut listen = vec![Listen::Unix {
        path: socket,
        export: args.name.clone(),
    }];
    if let Some(addr) = args.listen {
        listen.push(Listen::Tcp(addr));
    }

    // Block SIGINT/SIGTERM delivery to a handler thread before any thread starts.
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
    ])
    .context("installing signal handlers")?;

    let server = Server::start(vec![export], &listen, ServerConfig::default())
        .context("starting the NBD server")?;
    println!(
        "{}: {}, {}, page size {} bytes",
        args.name,
        human(device.size_bytes()),
        args.algorithm,
        args.page_size
    );
    for (_, uri) in server.uris() {
        println!("  {uri}");
    }
    println!("serving; stop with Ctrl-C or SIGTERM");
    use std::io::Write;
    std::io::stdout().flush().ok();

    let sig = signals.forever().next();
    eprintln!(
        "uzram: {} received: stopping (finishing requests in flight)",
        match sig {
            Some(signal_hook::consts::SIGINT) => "SIGINT",
            _ => "SIGTERM",
        }
    );
    server.stop();
    eprintln!("uzram: stopped");
    Ok(())
}
