//! `uzram serve`: create devices and export them over NBD until SIGINT/SIGTERM.
//!
//! With no flags it needs no configuration, as zram-generator does: the embedded default
//! ([`uzram::config::DEFAULT_CONFIG_TOML`]) is one device `zram0` of min(RAM/2, 4 GiB), lz4,
//! 4 KiB pages, on a unix socket (mode 0600) at `/run/uzram/zram0.sock` as root,
//! `$XDG_RUNTIME_DIR/uzram/zram0.sock` otherwise (or `/tmp/uzram-$UID/zram0.sock` without
//! `XDG_RUNTIME_DIR`), with its control socket `zram0.ctl` beside it. Device flags change that
//! one device; `--config FILE` describes several. TCP only with `--listen`.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use uzram::config::{ServeConfig, DEFAULT_CONFIG_TOML};
use uzram::frontend::control::{self, ControlServer};
use uzram::frontend::nbd::{Export, Listen, Server, ServerConfig};
use uzram::BlockDevice;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A TOML file describing the server and its devices (see docs/nbd.md); without it, the
    /// embedded default, changed by the device flags below.
    #[arg(long, short, value_name = "FILE",
          conflicts_with_all = ["name", "disksize", "algorithm", "mem_limit", "page_size", "socket"])]
    pub config: Option<PathBuf>,
    /// Print the embedded default configuration and exit.
    #[arg(long)]
    pub print_default_config: bool,
    /// Device and export name [default: zram0].
    #[arg(long)]
    pub name: Option<String>,
    /// Device size: K, M, G suffixes, or an expression of ram [default: min(ram / 2, 4G)].
    #[arg(long)]
    pub disksize: Option<String>,
    /// Compression algorithm (zram's comp_algorithm) [default: lz4].
    #[arg(long)]
    pub algorithm: Option<String>,
    /// Memory limit for compressed data (zram's mem_limit) [default: 0, none].
    #[arg(long)]
    pub mem_limit: Option<String>,
    /// Page size in bytes: 4096, 16384 or 65536 [default: 4096].
    #[arg(long)]
    pub page_size: Option<usize>,
    /// Also listen on TCP at ADDR:PORT (e.g. 127.0.0.1:10809). Unauthenticated: keep it local.
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<SocketAddr>,
    /// The unix socket path [default: /run/uzram/NAME.sock as root, else
    /// $XDG_RUNTIME_DIR/uzram/NAME.sock]. The control socket is NAME.ctl beside it.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Serve swap safely: lock memory (mlockall), mark the server an I/O flusher, preallocate
    /// request buffers (docs/nbd.md, "Serving swap").
    #[arg(long)]
    pub swap: bool,
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

/// The directory for sockets: /run/uzram as root, $XDG_RUNTIME_DIR/uzram otherwise, else
/// /tmp/uzram-UID.
pub fn default_socket_dir() -> PathBuf {
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

/// The configuration: the file, or the embedded default with the device flags applied.
fn config(args: &ServeArgs) -> Result<ServeConfig> {
    let mut cfg = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            ServeConfig::parse(&text, &path.display().to_string())?
        }
        None => {
            let mut cfg = ServeConfig::embedded_default();
            let d = &mut cfg.devices[0];
            if let Some(n) = &args.name {
                d.name = n.clone();
            }
            if let Some(s) = &args.disksize {
                d.disksize = s.clone();
            }
            if let Some(p) = args.page_size {
                d.page_size_bytes = p;
            }
            d.socket = args.socket.clone();
            if let Some(a) = &args.algorithm {
                for (k, v) in &mut d.attrs {
                    if k == "comp_algorithm" {
                        *v = a.clone();
                    }
                }
            }
            if let Some(m) = &args.mem_limit {
                d.attrs.push(("mem_limit".into(), m.clone()));
            }
            cfg
        }
    };
    if args.listen.is_some() {
        cfg.listen = args.listen;
    }
    cfg.swap |= args.swap;
    Ok(cfg)
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.print_default_config {
        print!("{DEFAULT_CONFIG_TOML}");
        return Ok(());
    }
    let cfg = config(&args)?;
    // Before any thread exists: the I/O-flusher mark is inherited by the threads created after.
    let swap = if cfg.swap {
        Some(uzram::frontend::swap::prepare())
    } else {
        None
    };
    let ram = ram_bytes()?;
    let mut devices = Vec::new();
    let mut listen = Vec::new();
    let mut exports = Vec::new();
    for spec in &cfg.devices {
        let device = Arc::new(spec.build(ram)?);
        let socket = match &spec.socket {
            Some(p) => p.clone(),
            None => {
                let dir = default_socket_dir();
                use std::os::unix::fs::DirBuilderExt;
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                dir.join(format!("{}.sock", spec.name))
            }
        };
        let dir = socket.parent().unwrap_or(std::path::Path::new("."));
        let ctl = control::socket_path(dir, &spec.name);
        exports.push(Export {
            name: spec.name.clone(),
            description: format!(
                "uzram {} ({}, {} pages)",
                spec.name,
                device.comp_algorithm(),
                spec.page_size_bytes
            ),
            device: Arc::clone(&device) as Arc<dyn BlockDevice>,
        });
        listen.push(Listen::Unix {
            path: socket,
            export: spec.name.clone(),
        });
        devices.push((spec.name.clone(), device, ctl));
    }
    if let Some(addr) = cfg.listen {
        listen.push(Listen::Tcp(addr));
    }

    // Block SIGINT/SIGTERM delivery to a handler thread before any thread starts.
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
    ])
    .context("installing signal handlers")?;

    let server_config = ServerConfig {
        preallocate: cfg.swap,
        ..ServerConfig::default()
    };
    let server =
        Server::start(exports, &listen, server_config).context("starting the NBD server")?;
    let mut controls = Vec::new();
    for (name, device, ctl) in &devices {
        let c = ControlServer::start(ctl, Arc::clone(device), server.openers(name))
            .with_context(|| format!("starting the control socket {}", ctl.display()))?;
        controls.push(c);
    }
    let uris = server.uris();
    for (name, device, ctl) in &devices {
        println!(
            "{name}: {}, {}, page size {} bytes",
            human(device.disksize_bytes()),
            device.comp_algorithm(),
            device.page_size_bytes()
        );
        for (_, uri) in uris.iter().filter(|(n, _)| n == name) {
            println!("  {uri}");
        }
        println!("  control: {}", ctl.display());
    }
    if let Some(report) = &swap {
        for line in report {
            eprintln!("uzram: --swap: {line}");
        }
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
    for c in controls {
        c.stop();
    }
    server.stop();
    drop(devices);
    eprintln!("uzram: stopped");
    Ok(())
}
