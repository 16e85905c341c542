//! `uzram serve`: create devices and export them over NBD until SIGINT, SIGTERM or SIGHUP (a
//! second one forces the exit).
//!
//! With no flags it needs no configuration, as zram-generator does: the embedded default
//! ([`uzram_service::config::DEFAULT_CONFIG_TOML`]) is one device `zram0` of min(RAM/2, 4 GiB), lz4,
//! 4 KiB pages, on a unix socket (mode 0600) at `/run/uzram/zram0.sock` as root,
//! `$XDG_RUNTIME_DIR/uzram/zram0.sock` otherwise (or `/tmp/uzram-$UID/zram0.sock` without
//! `XDG_RUNTIME_DIR`), with its control socket `zram0.ctl` beside it. Device flags change that
//! one device; `--config FILE` describes several, and so does zram-generator's configuration
//! with `--zram-generator-conf FILE` (docs/service.md). TCP only with `--listen`; a kernel block
//! device `/dev/ublkbN` per device with `--ublk` (`ublk = true` in the file; docs/ublk.md); a VM
//! guest's virtio-blk disk on `NAME.vhost.sock` with `--vhost-user` (`vhost_user = true`;
//! docs/vhost-user.md).

use anyhow::{Context, Result};
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use uzram_service::config::{ServeConfig, DEFAULT_CONFIG_TOML};
use uzram_service::fd_store;
use uzram_service::frontend::control::Attachments;
use uzram_service::frontend::nbd::TlsMode;
use uzram_service::frontend::unix_socket;
use uzram_service::generator_files;
use uzram_service::host::{server_config, Host};
use uzram_service::keeper::{self, KeeperConfig};
use uzram_service::policy::PolicyConfig;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A TOML file describing the server and its devices (see docs/serve.md); without it, the
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
    /// request buffers (docs/serve.md, "Serving swap").
    #[arg(long)]
    pub swap: bool,
    /// With --swap: the memory the server gets ahead of need for the pages it stores, one
    /// reserve for all its devices (a size, or an expression of `ram`; default: ram / 8,
    /// between 16M and 64M; docs/ublk.md, "Swap on ublk").
    #[arg(long, value_name = "SIZE")]
    pub swap_reserve: Option<String>,
    /// Also make every device a kernel block device /dev/ublkbN on this host (needs the
    /// ublk_drv module, Linux 6.0+, and root; docs/ublk.md).
    #[arg(long)]
    pub ublk: bool,
    /// Also give every device to VM guests on a vhost-user-blk socket NAME.vhost.sock beside
    /// its NBD socket (QEMU's vhost-user-blk-pci; docs/vhost-user.md).
    #[arg(long)]
    pub vhost_user: bool,
    /// Run as a keeper: a small process holding every device's state and a serving child,
    /// which it starts again, handing it the state, when it dies (a crash, kill -9, the OOM
    /// killer), and replaces by the binary now on disk on `uzram ctl upgrade` or SIGUSR2
    /// (docs/restart.md). Not needed under systemd: the unit keeps the state in systemd's
    /// file descriptor store.
    #[arg(long)]
    pub keeper: bool,
    /// Export every device read-only over NBD: clients may read; writes, trims and
    /// write-zeroes get EPERM (`read_only = true` per device in the file). Not with --ublk or
    /// --vhost-user.
    #[arg(long)]
    pub read_only: bool,
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
        None if args.zram_generator => generator_files::system_config()?,
        None if args.zram_generator_conf.is_some() => {
            generator_files::config(args.zram_generator_conf.as_deref().expect("checked"))?
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
    if args.read_only {
        for d in &mut cfg.devices {
            d.read_only = true;
        }
    }
    if args.vhost_user {
        for d in &mut cfg.devices {
            d.vhost_user = true;
        }
    }
    if let Some(d) = cfg
        .devices
        .iter()
        .find(|d| d.read_only && (d.ublk || d.vhost_user))
    {
        anyhow::bail!(
            "{}: read-only is for NBD exports: ublk and vhost-user would still write",
            d.name
        );
    }
    if args.listen.is_some() {
        cfg.listen = args.listen;
    }
    if args.metrics_listen.is_some() {
        cfg.metrics_listen = args.metrics_listen;
    }
    cfg.metrics_allow_remote |= args.metrics_allow_remote;
    cfg.swap |= args.swap;
    if let Some(r) = &args.swap_reserve {
        uzram_service::size_expr::eval_bytes(r, 1 << 30)
            .with_context(|| format!("--swap-reserve {r}"))?;
        cfg.swap_reserve = Some(r.clone());
    }
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

pub fn run(args: ServeArgs) -> Result<()> {
    if args.print_default_config {
        print!("{DEFAULT_CONFIG_TOML}");
        return Ok(());
    }
    if args.zram_generator
        && generator_files::kernel_option(&generator_files::root()) == Some(false)
    {
        // zram-generator creates no device then; neither does the server.
        println!("uzram: systemd.zram=0 on the kernel command line: no device; exiting");
        return Ok(());
    }
    let started_by_keeper = std::env::var_os(fd_store::KEEPER_FD_ENV).is_some();
    let keeper_mode = args.keeper && !started_by_keeper;
    // Where the devices' state goes (the keeper, systemd's fd store, or nowhere), and what a
    // previous process left: taken before anything runs a program (a configuration's `set!`
    // lines) or starts a thread (it changes the environment).
    let (fd_store, inherited) = if keeper_mode {
        (fd_store::StateStore::none(), fd_store::Inherited::new())
    } else {
        fd_store::from_env()
    };
    let cfg = config(&args)?;
    let server_config = server_config(&cfg)?;
    if keeper_mode {
        let exe = std::env::current_exe().context("the uzram binary's path")?;
        let code = keeper::run(KeeperConfig {
            exe,
            args: std::env::args_os().skip(1).collect(),
            socket_dir: uzram_service::host::socket_dir(&cfg)?,
            lock_memory: cfg.swap,
        })?;
        std::process::exit(code);
    }
    if started_by_keeper {
        set_process_name();
    }
    // A missing ublk_drv is one clear line, before anything is created.
    if cfg.devices.iter().any(|d| d.ublk) {
        if let Err(e) = uzram_service::frontend::ublk::check_driver() {
            eprintln!("uzram: {e}");
            std::process::exit(1);
        }
    }
    // SIGINT, SIGTERM and SIGHUP are taken by a handler that only writes a pipe
    // (signal-hook's self-pipe), read by the signal thread below. No thread yet: `Host::start`
    // marks the process an I/O flusher first when serving swap.
    // SIGUSR2 (under systemd's fd store): the same stop, then exit status 75, which systemd's
    // `Restart=on-failure` answers with a restart from the binary now on disk, the store kept.
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR2};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP, SIGUSR2])
        .context("installing signal handlers")?;
    let fd_store = std::sync::Arc::new(fd_store);
    // Under systemd's fd store or a keeper: SIGUSR2 stops for a restart (the keeper sends it
    // for an upgrade), leaving the block devices to the next server.
    let restartable = fd_store.keeps();
    let host = Host::start_keeping(
        &cfg,
        server_config,
        std::sync::Arc::clone(&fd_store),
        inherited,
    )?;

    // The first signal starts a bounded stop; a second one forces the exit at once (after
    // removing the sockets that are still ours).
    let (first_tx, first_rx) = std::sync::mpsc::channel();
    let socket_files = host.socket_files_fn();
    std::thread::Builder::new()
        .name("uzram-signals".into())
        .spawn(move || {
            let mut first = true;
            for sig in signals.forever() {
                if sig == SIGUSR2 && first && !restartable {
                    eprintln!(
                        "uzram: SIGUSR2 ignored: {}",
                        if started_by_keeper {
                            "send it to the keeper (uzram ctl upgrade)"
                        } else {
                            "nothing keeps the devices' state (uzram serve --keeper, or systemd's \
                             fd store)"
                        }
                    );
                    continue;
                }
                if first {
                    first = false;
                    let _ = first_tx.send(sig);
                    continue;
                }
                eprintln!("uzram: {} again: exiting now", signal_name(sig));
                for (path, id) in &socket_files() {
                    unix_socket::remove_if_ours(path, *id);
                }
                std::process::exit(128 + sig);
            }
        })
        .context("starting the signal thread")?;
    print_banner(&host);
    if let Some(report) = host.finish_swap_setup() {
        for line in report {
            eprintln!("uzram: --swap: {line}");
        }
    }
    if fd_store.keeps() {
        println!(
            "state: kept by {} across a crash or an upgrade (docs/restart.md)",
            fd_store.kind()
        );
    }
    println!("serving; stop with Ctrl-C or SIGTERM");
    use std::io::Write;
    std::io::stdout().flush().ok();
    fd_store.ready();

    let sig = first_rx.recv().unwrap_or(SIGTERM);
    eprintln!(
        "uzram: {} received: stopping (finishing requests in flight; a second signal exits at \
         once)",
        signal_name(sig)
    );
    if sig == SIGUSR2 {
        for (path, left) in host.stop_for_restart() {
            if left {
                eprintln!(
                    "uzram: left {} to the next server (its requests wait until it serves)",
                    path.display()
                );
            } else {
                eprintln!("uzram: removed {}", path.display());
            }
        }
        eprintln!(
            "uzram: stopped for a restart (exit status {RESTART_EXIT_STATUS}): {}",
            if started_by_keeper {
                "the keeper starts the next server with the devices' state"
            } else {
                "systemd starts the binary now on disk with the devices' state"
            }
        );
        std::process::exit(RESTART_EXIT_STATUS);
    }
    for path in host.stop() {
        eprintln!("uzram: removed {}", path.display());
    }
    eprintln!("uzram: stopped");
    Ok(())
}

/// Names this process `uzram` (the keeper starts it through `/proc/self/fd/N`, which would
/// name it `N` in `ps` and `top`).
fn set_process_name() {
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"uzram".as_ptr()) };
}

/// The exit status of a stop for a restart (SIGUSR2 under systemd's fd store): `EX_TEMPFAIL`.
const RESTART_EXIT_STATUS: i32 = 75;

fn signal_name(sig: i32) -> &'static str {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGUSR2};
    match sig {
        SIGINT => "SIGINT",
        SIGHUP => "SIGHUP",
        SIGUSR2 => "SIGUSR2",
        _ => "SIGTERM",
    }
}

/// What the server serves and where: a block per device, the class socket, the metrics.
fn print_banner(host: &Host) {
    let uris = host.uris();
    for s in host.served() {
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
            let u = host.ublk_config();
            println!(
                "  {} ({} queues of depth {})",
                b.display(),
                u.nr_queues,
                u.queue_depth
            );
        }
        if let Some(path) = s.attach.vhost_path() {
            let p = path.display();
            let q = host.vhost_config().nr_queues;
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
        host.class_path().display()
    );
    if let Some(addr) = host.metrics_addr() {
        println!("metrics: http://{addr}/metrics");
    }
}
