//! `uzram serve`: create devices and export them over NBD until SIGINT, SIGTERM or SIGHUP (a
//! second one forces the exit).
//!
//! With no flags it needs no configuration, as zram-generator does: the embedded default
//! ([`uzram::config::DEFAULT_CONFIG_TOML`]) is one device `zram0` of min(RAM/2, 4 GiB), lz4,
//! 4 KiB pages, on a unix socket (mode 0600) at `/run/uzram/zram0.sock` as root,
//! `$XDG_RUNTIME_DIR/uzram/zram0.sock` otherwise (or `/tmp/uzram-$UID/zram0.sock` without
//! `XDG_RUNTIME_DIR`), with its control socket `zram0.ctl` beside it. Device flags change that
//! one device; `--config FILE` describes several, and so does zram-generator's configuration
//! with `--zram-generator-conf FILE` (docs/service.md). TCP only with `--listen`; a kernel block
//! device `/dev/ublkbN` per device with `--ublk` (`ublk = true` in the file; docs/ublk.md); a VM
//! guest's virtio-blk disk on `NAME.vhost.sock` with `--vhost-user` (`vhost_user = true`;
//! docs/vhost-user.md).

use crate::devices::{Devices, ServerFrontends};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use uzram::clock::SystemClock;
use uzram::config::{ServeConfig, DEFAULT_CONFIG_TOML};
use uzram::frontend::control::{self, Attachments, ControlServer, HotPlug};
use uzram::frontend::metrics::{
    self,
    http::{MetricsLimits, MetricsServer, MetricsSource},
};
use uzram::frontend::nbd::{Export, Listen, Server, ServerConfig, Tls, TlsFiles, TlsMode};
use uzram::frontend::ublk::UblkConfig;
use uzram::frontend::unix_socket;
use uzram::frontend::vhost_user::{self, VhostUserConfig};
use uzram::policy::{DevicePolicy, PolicyConfig, PolicyRunner, PolicySet, ProcPressure};
use uzram::BlockDevice;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A TOML file describing the server and its devices (see docs/nbd.md); without it, the
    /// embedded default, changed by the device flags below.
    #[arg(long, short, value_name = "FILE",
          conflicts_with_all = ["name", "disksize", "algorithm", "mem_limit", "page_size",
                               "multi_page_size", "socket", "policy"])]
    pub config: Option<PathBuf>,
    /// zram-generator's configuration (`/etc/systemd/zram-generator.conf`, INI): a device per
    /// `[zramN]` section, with its keys and units (docs/service.md). Its `set!` lines run
    /// programs, as zram-generator runs them. MemTotal is read from
    /// `$ZRAM_GENERATOR_ROOT/proc/meminfo` when that is set, as zram-generator does.
    #[arg(long, value_name = "FILE",
          conflicts_with_all = ["config", "name", "disksize", "algorithm", "mem_limit",
                               "page_size", "multi_page_size", "socket"])]
    pub zram_generator_conf: Option<PathBuf>,
    /// zram-generator's configuration where zram-generator finds it: the main file
    /// `{/run,/etc,/usr/local/lib,/usr/lib}/systemd/zram-generator.conf` (the first that
    /// exists) and every `*.conf` of the `zram-generator.conf.d` directories beside them, by
    /// file name, with its precedence; and the kernel command line's `systemd.zram` (`=0`: no
    /// device, exit at once; `=1`: zram0 with the defaults even without a file). Under
    /// `$ZRAM_GENERATOR_ROOT` when that is set (docs/service.md).
    #[arg(long,
          conflicts_with_all = ["config", "zram_generator_conf", "name", "disksize", "algorithm",
                               "mem_limit", "page_size", "multi_page_size", "socket"])]
    pub zram_generator: bool,
    /// The directory of the sockets, for devices whose socket is not given [default:
    /// /run/uzram as root, else $XDG_RUNTIME_DIR/uzram].
    #[arg(long, value_name = "DIR", conflicts_with = "socket")]
    pub dir: Option<PathBuf>,
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
    /// Compress aligned runs of this size written at once as one object (the
    /// `multi_page_size` attribute): 4096 (off), 16K, 32K or 64K [default: 4096].
    #[arg(long, value_name = "SIZE")]
    pub multi_page_size: Option<String>,
    /// Automatic policies of the device: key=value words, as `uzram ctl policy` takes them
    /// (e.g. "idle_age_s=600 writeback_age_s=3600 compact_ratio=1.05"; docs/policies.md)
    /// [default: all off].
    #[arg(long, value_name = "KEY=VALUE...")]
    pub policy: Option<String>,
    /// Also listen on TCP at ADDR:PORT (e.g. 127.0.0.1:10809). Without --tls, unauthenticated
    /// and unencrypted: keep it on loopback.
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<SocketAddr>,
    /// TLS on TCP (NBD STARTTLS): off, on (clients choose) or require [default: off].
    #[arg(long, value_name = "MODE")]
    pub tls: Option<TlsMode>,
    /// The server's certificate chain, PEM (with --tls).
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The server's private key, PEM (with --tls).
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA, PEM (with --tls).
    #[arg(long, value_name = "FILE")]
    pub tls_client_ca: Option<PathBuf>,
    /// Connections served at once; more are refused [default: 100].
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Request memory budget, server-wide: payload bytes held at once [default: 128M].
    #[arg(long, value_name = "SIZE")]
    pub max_inflight: Option<String>,
    /// The unix socket path [default: /run/uzram/NAME.sock as root, else
    /// $XDG_RUNTIME_DIR/uzram/NAME.sock]. The control socket is NAME.ctl beside it.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Serve every device's statistics in Prometheus's text format at http://ADDR:PORT/metrics
    /// (docs/metrics.md). Loopback only unless --metrics-allow-remote.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_listen: Option<SocketAddr>,
    /// Allow a --metrics-listen address that is not loopback (anyone who reaches it learns
    /// the devices' sizes, memory and settings).
    #[arg(long)]
    pub metrics_allow_remote: bool,
    /// Serve swap safely: lock memory (mlockall), mark the server an I/O flusher, preallocate
    /// request buffers (docs/nbd.md, "Serving swap").
    #[arg(long)]
    pub swap: bool,
    /// Also make every device a kernel block device /dev/ublkbN on this host (needs the
    /// ublk_drv module, Linux 6.0+, and root; docs/ublk.md).
    #[arg(long)]
    pub ublk: bool,
    /// Also give every device to VM guests on a vhost-user-blk socket NAME.vhost.sock beside
    /// its NBD socket (QEMU's vhost-user-blk-pci; docs/vhost-user.md).
    #[arg(long)]
    pub vhost_user: bool,
}

/// Total RAM from /proc/meminfo.
fn ram_bytes() -> Result<u64> {
    ram_bytes_from(std::path::Path::new("/proc/meminfo"))
}

/// Total RAM from a meminfo file.
fn ram_bytes_from(path: &std::path::Path) -> Result<u64> {
    let meminfo =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
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
/// /tmp/uzram-UID (created and checked by `unix_socket::ensure_private_dir`: ours, 0700).
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

/// zram-generator's root: `$ZRAM_GENERATOR_ROOT` when set (its tests' fixtures), else `/`.
fn generator_root() -> PathBuf {
    match std::env::var_os("ZRAM_GENERATOR_ROOT") {
        Some(root) if !root.is_empty() => PathBuf::from(root),
        _ => PathBuf::from("/"),
    }
}

/// zram-generator's file as uzram's configuration; its warnings go to stderr and what it would
/// have done with the devices to stdout.
fn generator_config(path: &std::path::Path) -> Result<ServeConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    generator_fragments_config(&[(path.display().to_string(), text)])
}

/// `systemd.zram` on the kernel command line (`ROOT/proc/cmdline`), as zram-generator reads
/// it; a command line that cannot be read is a warning and counts as no option, as there.
fn generator_kernel_option(root: &std::path::Path) -> Option<bool> {
    let path = root.join("proc/cmdline");
    match std::fs::read_to_string(&path) {
        Ok(text) => uzram::generator_conf::kernel_zram_option(&text),
        Err(e) => {
            eprintln!(
                "uzram: warning: reading {}: {e}; systemd.zram ignored",
                path.display()
            );
            None
        }
    }
}

/// zram-generator's configuration where it finds it (`--zram-generator`; the kernel command
/// line's `systemd.zram=0` is handled before, in [`run`]).
fn generator_system_config() -> Result<ServeConfig> {
    let root = generator_root();
    let mut fragments = Vec::new();
    if generator_kernel_option(&root) == Some(true) {
        // zram0 with zram-generator's defaults; the files may still set its keys.
        fragments.push((
            "the kernel command line (systemd.zram)".to_string(),
            "[zram0]\n".to_string(),
        ));
    }
    let files = uzram::generator_conf::locate_fragments(&root);
    for path in &files {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        fragments.push((path.display().to_string(), text));
    }
    if fragments.is_empty() {
        anyhow::bail!(
            "no zram-generator configuration under {}: none of {{{}}}/systemd/\
             zram-generator.conf{{,.d/*.conf}} exists, and the kernel command line has no \
             systemd.zram",
            root.display(),
            uzram::generator_conf::CONFIG_DIRS.join(",")
        );
    }
    generator_fragments_config(&fragments)
}

/// zram-generator's files (`(name, text)`, in reading order) as uzram's configuration; the
/// warnings go to stderr and what zram-generator would have done with the devices to stdout.
fn generator_fragments_config(fragments: &[(String, String)]) -> Result<ServeConfig> {
    // zram-generator reads $ZRAM_GENERATOR_ROOT/proc/meminfo when that is set.
    let ram = ram_bytes_from(&generator_root().join("proc/meminfo"))?;
    let gen = uzram::generator_conf::parse_fragments(
        fragments,
        ram,
        &mut uzram::generator_conf::run_set_program,
    )?;
    for w in &gen.warnings {
        eprintln!("uzram: warning: {w}");
    }
    for n in &gen.notes {
        println!("{n}");
    }
    // Sizes are bytes already (`disksize` takes a lone number as bytes).
    Ok(gen.config)
}

/// The configuration: the file, or the embedded default with the device flags applied.
fn config(args: &ServeArgs) -> Result<ServeConfig> {
    let mut cfg = match &args.config {
        None if args.zram_generator => generator_system_config()?,
        None if args.zram_generator_conf.is_some() => {
            generator_config(args.zram_generator_conf.as_deref().expect("checked"))?
        }
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
            if let Some(m) = &args.multi_page_size {
                d.attrs.push(("multi_page_size".into(), m.clone()));
            }
            if let Some(p) = &args.policy {
                PolicyConfig::default()
                    .with(p)
                    .with_context(|| format!("--policy {p:?}"))?;
                d.policy = Some(p.clone());
            }
            cfg
        }
    };
    if let Some(dir) = &args.dir {
        for d in &mut cfg.devices {
            if d.socket.is_none() {
                d.socket = Some(dir.join(format!("{}.sock", d.name)));
            }
        }
    }
    if args.ublk {
        for d in &mut cfg.devices {
            d.ublk = true;
        }
    }
    if args.vhost_user {
        for d in &mut cfg.devices {
            d.vhost_user = true;
        }
    }
    if args.listen.is_some() {
        cfg.listen = args.listen;
    }
    if args.metrics_listen.is_some() {
        cfg.metrics_listen = args.metrics_listen;
    }
    cfg.metrics_allow_remote |= args.metrics_allow_remote;
    cfg.swap |= args.swap;
    if let Some(n) = args.max_connections {
        cfg.max_connections = Some(n);
    }
    if let Some(s) = &args.max_inflight {
        cfg.max_inflight_bytes =
            Some(uzram::units::parse_size_bytes(s).with_context(|| format!("--max-inflight {s}"))?);
    }
    if let Some(m) = args.tls {
        cfg.tls = Some(
            match m {
                TlsMode::Off => "off",
                TlsMode::On => "on",
                TlsMode::Require => "require",
            }
            .into(),
        );
    }
    for (flag, dst) in [
        (&args.tls_cert, &mut cfg.tls_cert),
        (&args.tls_key, &mut cfg.tls_key),
        (&args.tls_client_ca, &mut cfg.tls_client_ca),
    ] {
        if flag.is_some() {
            dst.clone_from(flag);
        }
    }
    Ok(cfg)
}

/// The server's settings from the configuration: limits and TLS.
fn server_config(cfg: &ServeConfig) -> Result<ServerConfig> {
    let mut sc = ServerConfig::default();
    if cfg.swap {
        sc = sc.for_swap();
    }
    if let Some(n) = cfg.max_connections {
        sc.limits.max_connections = n;
    }
    if let Some(n) = cfg.max_inflight_bytes {
        sc.limits.max_inflight_bytes = n;
    }
    sc.limits.validate()?;
    let mode: TlsMode = cfg.tls.as_deref().unwrap_or("off").parse()?;
    if mode != TlsMode::Off {
        let (Some(cert), Some(key)) = (&cfg.tls_cert, &cfg.tls_key) else {
            bail!(
                "--tls={} needs --tls-cert and --tls-key",
                cfg.tls.as_deref().unwrap_or("")
            );
        };
        if cfg.listen.is_none() {
            bail!("--tls is for TCP: give --listen too (the unix socket is owner-only)");
        }
        let files = TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: cfg.tls_client_ca.clone(),
        };
        sc.tls = Some(Tls::load(mode, &files).context("loading the TLS credentials")?);
    } else if cfg.tls_cert.is_some() || cfg.tls_key.is_some() || cfg.tls_client_ca.is_some() {
        bail!("TLS certificates given but --tls is off: add --tls=on or --tls=require");
    }
    if let Some(addr) = cfg.listen {
        if !addr.ip().is_loopback() && mode == TlsMode::Off {
            eprintln!(
                "uzram: warning: listening on {addr} without TLS: anyone who can reach it can \
                 read and write the device; use --tls=require (or a loopback address)"
            );
        }
    }
    Ok(sc)
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.print_default_config {
        print!("{DEFAULT_CONFIG_TOML}");
        return Ok(());
    }
    if args.zram_generator && generator_kernel_option(&generator_root()) == Some(false) {
        // zram-generator creates no device then; neither does the server.
        println!("uzram: systemd.zram=0 on the kernel command line: no device; exiting");
        return Ok(());
    }
    let cfg = config(&args)?;
    let server_config = server_config(&cfg)?;
    // Before any thread exists: the I/O-flusher mark is inherited by the threads created after.
    let swap = if cfg.swap {
        Some(uzram::frontend::swap::prepare())
    } else {
        None
    };
    // A missing ublk_drv is one clear line, before anything is created.
    if cfg.devices.iter().any(|d| d.ublk) {
        if let Err(e) = uzram::frontend::ublk::check_driver() {
            // Nothing exists yet; one line, no backtrace.
            eprintln!("uzram: {e}");
            std::process::exit(1);
        }
    }
    let ram = ram_bytes()?;
    let mut devices = Vec::new();
    let mut listen = Vec::new();
    let mut exports = Vec::new();
    let mut vhost_paths = Vec::new();
    let mut policies = Vec::new();
    let mut socket_dir = None;
    for spec in &cfg.devices {
        let device = Arc::new(spec.build(ram)?);
        let socket = match &spec.socket {
            Some(p) => {
                unix_socket::check_socket_parent(p)?;
                p.clone()
            }
            None => {
                let dir = default_socket_dir();
                unix_socket::ensure_private_dir(&dir)?;
                dir.join(format!("{}.sock", spec.name))
            }
        };
        let dir = socket.parent().unwrap_or(std::path::Path::new("."));
        socket_dir.get_or_insert_with(|| dir.to_path_buf());
        let ctl = control::socket_path(dir, &spec.name);
        vhost_paths.push(vhost_user::socket_path(dir, &spec.name));
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
        let policy = Arc::new(DevicePolicy::new(spec.name.clone(), Arc::clone(&device)));
        if let Some(p) = &spec.policy {
            policy
                .store(p)
                .with_context(|| format!("device {}: policy", spec.name))?;
        }
        policies.push(policy);
        devices.push((spec.name.clone(), device, ctl));
    }
    if let Some(addr) = cfg.listen {
        listen.push(Listen::Tcp(addr));
    }
    // The server's class socket, zram's /sys/class/zram-control: beside the first device's.
    let socket_dir = socket_dir.context("no devices")?;

    // SIGINT, SIGTERM and SIGHUP are taken by a handler that only writes a pipe
    // (signal-hook's self-pipe), read by the signal thread below.
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .context("installing signal handlers")?;

    let server = Arc::new(
        Server::start(exports, &listen, server_config).context("starting the NBD server")?,
    );
    // The frontends every device of the server gets (a device added by hot_add too).
    let ublk_config = UblkConfig {
        swap: cfg.swap,
        ..UblkConfig::default()
    };
    let vhost_config = VhostUserConfig {
        swap: cfg.swap,
        ..VhostUserConfig::default()
    };
    let policy_set = PolicySet::new(policies.clone());
    let registry = Arc::new(Devices::new(
        Arc::clone(&server),
        policy_set.clone(),
        ServerFrontends {
            dir: socket_dir.clone(),
            ublk: cfg
                .devices
                .iter()
                .any(|d| d.ublk)
                .then(|| ublk_config.clone()),
            vhost: cfg
                .devices
                .iter()
                .any(|d| d.vhost_user)
                .then(|| vhost_config.clone()),
        },
    ));
    // Each device's block device and vhost-user socket: after the NBD server (whose failure
    // to bind leaves no block device behind), before its control socket (which names them).
    let mut served = Vec::new();
    for (((name, device, ctl), spec), vpath) in devices.iter().zip(&cfg.devices).zip(&vhost_paths) {
        let policy = policies
            .iter()
            .find(|p| p.name() == name)
            .expect("one per device");
        served.push(
            registry
                .add_configured(
                    name,
                    Arc::clone(device),
                    ctl,
                    spec.ublk.then(|| ublk_config.clone()),
                    spec.vhost_user
                        .then(|| (vpath.clone(), vhost_config.clone())),
                    Arc::clone(policy),
                )
                .with_context(|| format!("device {name}"))?,
        );
    }
    let class_path = control::class_socket_path(&socket_dir);
    let class = ControlServer::start_class(&class_path, Arc::clone(&registry) as Arc<dyn HotPlug>)
        .with_context(|| format!("starting the control socket {}", class_path.display()))?;
    // One thread runs every device's policies (all off unless configured or stored).
    let runner = PolicyRunner::start_shared(
        policy_set,
        Arc::new(SystemClock::new()),
        Arc::new(ProcPressure::new()),
        uzram::policy::TICK,
    )
    .context("starting the policy thread")?;
    // The metrics endpoint reads the devices' attributes in this process.
    let metrics = match cfg.metrics_listen {
        Some(addr) => {
            let registry = Arc::clone(&registry);
            let source: MetricsSource = Arc::new(move || Ok(metrics::render(&registry.metrics()?)));
            Some(
                MetricsServer::start(
                    addr,
                    cfg.metrics_allow_remote,
                    source,
                    MetricsLimits::default(),
                )
                .with_context(|| format!("serving metrics on {addr}"))?,
            )
        }
        None => None,
    };
    // The first signal starts a bounded stop; a second one forces the exit at once (after
    // removing the sockets that are still ours).
    let (first_tx, first_rx) = std::sync::mpsc::channel();
    let class_file = class.socket_file();
    let registry2 = Arc::clone(&registry);
    std::thread::Builder::new()
        .name("uzram-signals".into())
        .spawn(move || {
            let name = |s| match s {
                SIGINT => "SIGINT",
                SIGHUP => "SIGHUP",
                _ => "SIGTERM",
            };
            let mut first = true;
            for sig in signals.forever() {
                if first {
                    first = false;
                    let _ = first_tx.send(sig);
                    continue;
                }
                eprintln!("uzram: {} again: exiting now", name(sig));
                let mut sockets = registry2.server().socket_files();
                sockets.extend(registry2.socket_files());
                sockets.push(class_file.clone());
                for (path, id) in &sockets {
                    unix_socket::remove_if_ours(path, *id);
                }
                std::process::exit(128 + sig);
            }
        })
        .context("starting the signal thread")?;
    let uris = server.uris();
    for s in &served {
        let (name, device) = (&s.name, &s.device);
        println!(
            "{name}: {}, {}, page size {} bytes",
            human(device.disksize_bytes()),
            device.comp_algorithm(),
            device.page_size_bytes()
        );
        for (_, uri) in uris.iter().filter(|(n, _)| n == name) {
            println!("  {uri}");
        }
        if let Some(b) = s.attach.block_dev() {
            println!(
                "  {} ({} queues of depth {})",
                b.display(),
                ublk_config.nr_queues,
                ublk_config.queue_depth
            );
        }
        if let Some(path) = s.attach.vhost_path() {
            let p = path.display();
            let q = vhost_config.nr_queues;
            println!("  vhost-user-blk: {p} ({q} queues); QEMU options (size = the guest's -m):");
            println!(
                "    -object memory-backend-memfd,id=mem,size=1G,share=on -numa node,memdev=mem"
            );
            println!(
                "    -chardev socket,id={name},path={p},reconnect-ms=1000 \
                 -device vhost-user-blk-pci,chardev={name},num-queues={q}"
            );
        }
        println!("  control: {}", s.ctl.display());
        let c = s.policy.config();
        if c.any_on() {
            let on: Vec<String> = c
                .show()
                .lines()
                .filter(|l| !l.ends_with("=off"))
                .map(str::to_string)
                .collect();
            println!("  policy: {}", on.join(" "));
        }
    }
    println!(
        "zram-control: {} (uzram ctl hot_add, uzram ctl hot_remove N)",
        class_path.display()
    );
    if let Some(m) = &metrics {
        println!("metrics: http://{}/metrics", m.local_addr());
    }
    if let Some(report) = &swap {
        // Everything allocated at start is: what the heap has free from here on is faulted
        // in for the request paths.
        uzram::frontend::swap::fault_in_heap_reserve();
        for line in report {
            eprintln!("uzram: --swap: {line}");
        }
    }
    println!("serving; stop with Ctrl-C or SIGTERM");
    use std::io::Write;
    std::io::stdout().flush().ok();

    let sig = first_rx.recv().unwrap_or(SIGTERM);
    eprintln!(
        "uzram: {} received: stopping (finishing requests in flight; a second signal exits at \
         once)",
        match sig {
            SIGINT => "SIGINT",
            SIGHUP => "SIGHUP",
            _ => "SIGTERM",
        }
    );
    runner.stop();
    if let Some(m) = metrics {
        m.stop();
    }
    // No hot_add or hot_remove from here on.
    class.stop();
    // The control sockets close; the vhost-user front ends are disconnected (their guests see
    // I/O errors from here on); the block devices' requests in flight complete, then they
    // are removed.
    drop(served);
    for path in registry.stop() {
        eprintln!("uzram: removed {}", path.display());
    }
    server.shutdown();
    drop(devices);
    eprintln!("uzram: stopped");
    Ok(())
}
