//! A running server as a type: [`Host::start`] creates the configured devices and every
//! frontend they get, in the order that leaves nothing behind when a step fails, and
//! [`Host::stop`] takes them down in the reverse order, bounded in time whatever clients do.
//!
//! # Start order
//! The swap preparations (before any thread exists: the I/O-flusher mark is inherited by the
//! threads created afterwards), the ublk driver check (before anything is created), the
//! devices, the NBD server (its failure to bind leaves no block device behind), each device's
//! block device and vhost-user socket, then its control socket (which names them), the class
//! socket (`hot_add`, `hot_remove`), the policy thread, the metrics endpoint.
//!
//! # Stop order
//! The policy thread, the metrics endpoint, the class socket (no `hot_add` or `hot_remove`
//! from then on), the devices' control sockets, vhost-user front ends (their guests see I/O
//! errors from then on) and block devices (their requests in flight complete first), the NBD
//! server, the devices.

use crate::config::ServeConfig;
use crate::devices::{ConfiguredDevice, Devices, Served, ServerFrontends};
use crate::fd_store::{Inherited, StateStore};
use crate::frontend::control::{self, ControlServer, HotPlug};
use crate::frontend::metrics::{
    self,
    http::{MetricsLimits, MetricsServer, MetricsSource},
};
use crate::frontend::nbd::{Export, Listen, Server, ServerConfig, Tls, TlsFiles, TlsMode};
use crate::frontend::ublk::UblkConfig;
use crate::frontend::unix_socket::{self, SocketId};
use crate::frontend::vhost_user::{self, VhostUserConfig};
use crate::policy::{DevicePolicy, PolicyRunner, PolicySet, ProcPressure};
use anyhow::{bail, Context, Result};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use uzram::clock::BootClock;
use uzram::shm::ShmFile;
use uzram::BlockDevice;

/// Total RAM from /proc/meminfo.
pub fn ram_bytes() -> Result<u64> {
    ram_bytes_from(Path::new("/proc/meminfo"))
}

/// Total RAM from a meminfo file.
pub fn ram_bytes_from(path: &Path) -> Result<u64> {
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
    bail!("no MemTotal in {}", path.display())
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

/// The server's socket directory: the first device's socket's (the default one created and
/// checked when it is that).
pub fn socket_dir(cfg: &ServeConfig) -> Result<PathBuf> {
    let first = cfg.devices.first().context("no devices")?;
    match &first.socket {
        Some(p) => Ok(p.parent().unwrap_or(Path::new(".")).to_path_buf()),
        None => {
            let dir = default_socket_dir();
            unix_socket::ensure_private_dir(&dir)?;
            Ok(dir)
        }
    }
}

/// Whether every device is also a ublk block device: swap is then served through ublk, not
/// NBD, and the NBD request buffers need not be preallocated for it.
fn swap_on_ublk_only(cfg: &ServeConfig) -> bool {
    !cfg.devices.is_empty() && cfg.devices.iter().all(|d| d.ublk)
}

/// The NBD server's settings from the configuration: limits and TLS. Warns on stderr about a
/// TCP address off loopback without TLS.
pub fn server_config(cfg: &ServeConfig) -> Result<ServerConfig> {
    let mut sc = ServerConfig::default();
    if cfg.swap && !swap_on_ublk_only(cfg) {
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

/// The swap reserve's files a previous process left, from the first device handed back
/// (every device of a swap server hands the reserve's files over with its own).
fn saved_reserve(inherited: &Inherited) -> Option<(ShmFile, ShmFile)> {
    let files = inherited.values().find_map(|f| f.as_ref().ok())?;
    let dup = |f: &ShmFile| f.try_clone_fd().map(ShmFile::from_fd).ok();
    Some((
        dup(&files.store.pool.frames)?,
        dup(&files.store.pool.records)?,
    ))
}

/// Logs a device recovered from a previous process's state.
fn log_recovered(
    name: &str,
    r: &uzram::device::restart::RecoveryReport,
    took: std::time::Duration,
) {
    eprintln!(
        "uzram: {name}: recovered: {} pages stored in {} objects ({} garbage objects freed, {} \
         journal entries rolled forward) in {} ms",
        r.pages_stored,
        r.objects,
        r.garbage,
        r.journal_replayed,
        took.as_millis()
    );
}

/// Logs a device refused at start: its saved state failed a check (`why`).
fn refuse(name: &str, why: &str, fd_store: &StateStore) {
    eprintln!(
        "uzram: {name}: refused: {why}; the device is not served (its saved state stays with \
         {}, untouched: stop the keeper, or remove it from systemd's fd store, to start it \
         anew)",
        fd_store.kind()
    );
}

/// A running server: its devices, the NBD server, the class socket, the policy thread and
/// the metrics endpoint. Dropping it without [`Host::stop`] leaves the threads running.
pub struct Host {
    registry: Arc<Devices>,
    served: Vec<Arc<Served>>,
    class: ControlServer,
    class_path: PathBuf,
    runner: PolicyRunner,
    metrics: Option<MetricsServer>,
    swap_report: Option<Vec<String>>,
    ublk_config: UblkConfig,
    vhost_config: VhostUserConfig,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("class_path", &self.class_path)
            .field("devices", &self.served.len())
            .finish_non_exhaustive()
    }
}

impl Host {
    /// Starts the server the configuration describes (see the module's start order), with
    /// new devices whose state nothing keeps.
    pub fn start(cfg: &ServeConfig, server_config: ServerConfig) -> Result<Host> {
        Self::start_keeping(
            cfg,
            server_config,
            Arc::new(StateStore::none()),
            Inherited::new(),
        )
    }

    /// As [`start`](Self::start), recovering the devices whose files a previous process left
    /// (`inherited`: docs/restart.md, "The server"), and handing every device's files to
    /// `fd_store`. A configured device whose saved state fails a check, or differs from the
    /// configuration, is refused: not served, its error in the log; a device of the saved
    /// state the configuration does not name (added by `hot_add`) is served as `hot_add`
    /// serves one. Fails if every configured device is refused.
    pub fn start_keeping(
        cfg: &ServeConfig,
        server_config: ServerConfig,
        fd_store: Arc<StateStore>,
        mut inherited: Inherited,
    ) -> Result<Host> {
        let nbd_buffers = !swap_on_ublk_only(cfg);
        let mut swap_report = cfg
            .swap
            .then(|| crate::frontend::swap::prepare(nbd_buffers));
        if cfg.devices.iter().any(|d| d.ublk) {
            crate::frontend::ublk::check_driver()?;
        }
        let ram = ram_bytes()?;
        // Serving swap: the one reserve of every device, faulted in (and locked) now.
        let swap_reserve = match &mut swap_report {
            Some(report) => {
                let bytes = match &cfg.swap_reserve {
                    Some(e) => crate::size_expr::eval_bytes(e, ram)
                        .with_context(|| format!("swap_reserve {e}"))?,
                    None => uzram::memory::default_swap_reserve_bytes(ram),
                };
                let bytes = usize::try_from(bytes).context("swap_reserve too large")?;
                let reserve = match saved_reserve(&inherited) {
                    // The previous process's reserve, in recovery until every device is.
                    Some((frames, records)) => {
                        match uzram::memory::SwapReserve::recover(bytes, frames, records) {
                            Ok(r) => r,
                            Err(e) => {
                                eprintln!(
                                    "uzram: the saved swap reserve is refused: {}; its devices \
                                     are refused with it",
                                    e.message()
                                );
                                uzram::memory::SwapReserve::new(bytes)
                                    .context("faulting in the swap reserve")?
                            }
                        }
                    }
                    None => uzram::memory::SwapReserve::new(bytes)
                        .context("faulting in the swap reserve")?,
                };
                reserve.on_refill_tick(Box::new(crate::frontend::swap::keep_heap_reserve));
                match crate::frontend::swap::spawn_reclaim_watchdog() {
                    Ok(()) => report.push(
                        "a thread of the server stuck in reclaim for 10 s with no swap I/O (memory run out) asks \
                         the kernel's OOM killer to act (sysrq f)"
                            .into(),
                    ),
                    Err(why) => report.push(format!(
                        "no watchdog of the server's threads in reclaim ({why}): when memory \
                         runs out, swap on this server may stall instead of the OOM killer \
                         acting"
                    )),
                }
                match crate::frontend::swap::oom_trigger() {
                    Some(hook) => {
                        reserve.on_starved(hook);
                        report.push(
                            "when the swap reserve stays empty (memory run out), the kernel's \
                             OOM killer is asked to act (sysrq f)"
                                .into(),
                        );
                    }
                    None => report.push(
                        "cannot open /proc/sysrq-trigger: when memory runs out, swap on this \
                         server may stall instead of the OOM killer acting"
                            .into(),
                    ),
                }
                report.push(format!(
                    "a swap reserve of {} MiB for every device, faulted in and refilled off the \
                     request path (--swap-reserve)",
                    bytes >> 20
                ));
                report.push(match reserve.refiller_deadline() {
                    Some(Ok(())) => "the swap reserve's refiller runs under SCHED_DEADLINE: \
                                     under memory pressure it gets pages ahead of other \
                                     processes"
                        .into(),
                    Some(Err(errno)) => format!(
                        "the swap reserve's refiller NOT under SCHED_DEADLINE ({}): under \
                         memory pressure it competes for pages with every other process and \
                         swap writes may fail earlier",
                        std::io::Error::from_raw_os_error(errno)
                    ),
                    None => "the swap reserve's refiller has not started: its reserve is \
                             still being recovered"
                        .into(),
                });
                Some(reserve)
            }
            None => None,
        };
        let mut devices = Vec::new();
        let mut listen = Vec::new();
        let mut exports = Vec::new();
        let mut policies = Vec::new();
        let mut socket_dir = None;
        let mut refused = Vec::new();
        for spec in &cfg.devices {
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
            let dir = socket.parent().unwrap_or(Path::new(".")).to_path_buf();
            socket_dir.get_or_insert_with(|| dir.clone());
            let started = std::time::Instant::now();
            let inherited_files = inherited.remove(&spec.name);
            let recovered = inherited_files.is_some();
            let device = match inherited_files {
                None => spec.build_with_swap(ram, swap_reserve.as_ref())?,
                Some(files) => match files.and_then(|f| {
                    spec.recover(f, ram, swap_reserve.as_ref())
                        .map_err(|e| e.message().to_string())
                }) {
                    Ok((device, report, notes)) => {
                        log_recovered(&spec.name, &report, started.elapsed());
                        for note in notes {
                            eprintln!("uzram: {}: {note}", spec.name);
                        }
                        device
                    }
                    Err(e) => {
                        refuse(&spec.name, &e, &fd_store);
                        refused.push(spec.name.clone());
                        continue;
                    }
                },
            };
            let device = Arc::new(device);
            exports.push(Export {
                name: spec.name.clone(),
                description: format!(
                    "uzram {} ({}, {} pages)",
                    spec.name,
                    device.comp_algorithm(),
                    spec.page_size_bytes
                ),
                device: Arc::clone(&device) as Arc<dyn BlockDevice>,
                read_only: spec.read_only,
            });
            listen.push(Listen::Unix {
                path: socket,
                export: spec.name.clone(),
            });
            let policy = Arc::new(DevicePolicy::new(spec.name.clone(), Arc::clone(&device)));
            // The settings saved by the previous process (set at runtime) if the
            // configuration's are still the ones they were saved over; else the
            // configuration's.
            let restored = policy
                .restore(true, spec.policy.as_deref())
                .with_context(|| format!("device {}: policy", spec.name))?;
            restored.log(&spec.name);
            policies.push(Arc::clone(&policy));
            devices.push((spec, device, dir, policy, recovered));
        }
        if let Some(addr) = cfg.listen {
            listen.push(Listen::Tcp(addr));
        }
        // The devices a previous process had added by hot_add (served once the registry
        // exists).
        let mut hot_added = Vec::new();
        for (name, files) in std::mem::take(&mut inherited) {
            let started = std::time::Instant::now();
            let recovered = files.and_then(|f| {
                // No configuration names it: its backing device, if it wrote back, is
                // opened again by the name its header recorded.
                let with = |backing| uzram::device::restart::Recover {
                    swap_reserve: swap_reserve.clone(),
                    backing,
                };
                f.open_recorded_backing()
                    .and_then(|b| uzram::device::Device::recover_with(f, with(b)))
                    .map_err(|e| e.message().to_string())
            });
            match recovered {
                Ok((device, report)) => {
                    log_recovered(&name, &report, started.elapsed());
                    hot_added.push((name, Arc::new(device)));
                }
                Err(e) => refuse(&name, &e, &fd_store),
            }
        }
        // Every device recovered: the frames of a saved swap reserve no device claimed are
        // released, and the reserve is filled, before anything is served.
        if let Some(reserve) = &swap_reserve {
            reserve
                .finish_recovery()
                .context("finishing the swap reserve's recovery")?;
        }
        // The server's class socket, zram's /sys/class/zram-control: beside the first device's.
        let socket_dir = socket_dir.context("no devices")?;
        if exports.is_empty() {
            bail!(
                "every configured device was refused ({}): nothing to serve",
                refused.join(", ")
            );
        }

        let server = Arc::new(
            Server::start(exports, &listen, server_config).context("starting the NBD server")?,
        );
        // The frontends every device of the server gets (a device added by hot_add too).
        let ublk_config = UblkConfig {
            // A block device outlives a crash of the server only if its state does.
            user_recovery: fd_store.keeps(),
            ..UblkConfig::new(cfg.swap)
        };
        let vhost_config = VhostUserConfig {
            swap: cfg.swap,
            ..VhostUserConfig::default()
        };
        let policy_set = PolicySet::new(policies);
        let registry = Arc::new(Devices::new(
            Arc::clone(&server),
            policy_set.clone(),
            ServerFrontends {
                dir: socket_dir.clone(),
                swap_reserve,
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
                fd_store: Arc::clone(&fd_store),
            },
        ));
        // Each device's block device and vhost-user socket: after the NBD server, before its
        // control socket (which names them).
        let mut served = Vec::new();
        for (spec, device, dir, policy, recovered) in devices {
            let name = &spec.name;
            fd_store.store(name, &device);
            let ctl = control::socket_path(&dir, name);
            served.push(
                registry
                    .add_configured(ConfiguredDevice {
                        name: name.clone(),
                        device,
                        ctl,
                        recovered,
                        ublk: spec.ublk.then(|| ublk_config.clone()),
                        vhost: spec
                            .vhost_user
                            .then(|| (vhost_user::socket_path(&dir, name), vhost_config.clone())),
                        policy,
                    })
                    .with_context(|| format!("device {name}"))?,
            );
        }
        for (name, device) in hot_added {
            if let Err(e) = registry.add_recovered(&name, device) {
                refuse(&name, e.message(), &fd_store);
            }
        }
        let class_path = control::class_socket_path(&socket_dir);
        let class =
            ControlServer::start_class(&class_path, Arc::clone(&registry) as Arc<dyn HotPlug>)
                .with_context(|| format!("starting the control socket {}", class_path.display()))?;
        // One thread runs every device's policies (all off unless configured or stored).
        let runner = PolicyRunner::start_shared(
            policy_set,
            Arc::new(BootClock),
            Arc::new(ProcPressure::new()),
            crate::policy::TICK,
        )
        .context("starting the policy thread")?;
        // The metrics endpoint reads the devices' attributes in this process.
        let metrics = match cfg.metrics_listen {
            Some(addr) => {
                let registry = Arc::clone(&registry);
                let source: MetricsSource =
                    Arc::new(move || Ok(metrics::render(&registry.metrics()?)));
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
        Ok(Host {
            registry,
            served,
            class,
            class_path,
            runner,
            metrics,
            swap_report,
            ublk_config,
            vhost_config,
        })
    }

    /// The devices configured at start (not those added by `hot_add`).
    pub fn served(&self) -> &[Arc<Served>] {
        &self.served
    }

    /// The NBD URIs of the exports, `(export, uri)`.
    pub fn uris(&self) -> Vec<(String, String)> {
        self.registry.server().uris()
    }

    /// The class socket (`hot_add`, `hot_remove`).
    pub fn class_path(&self) -> &Path {
        &self.class_path
    }

    /// Where the metrics endpoint listens.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(|m| m.local_addr())
    }

    /// What the swap preparations did, a line per step (`None`: not serving swap). Also
    /// faults in the heap's reserve for the request paths: call once, after start, when
    /// everything the start allocates is allocated.
    pub fn finish_swap_setup(&self) -> Option<&[String]> {
        let report = self.swap_report.as_deref()?;
        crate::frontend::swap::fault_in_heap_reserve();
        Some(report)
    }

    /// The queues and depth of a ublk device (for the start's banner).
    pub fn ublk_config(&self) -> &UblkConfig {
        &self.ublk_config
    }

    /// The queues of a vhost-user device (for the start's banner).
    pub fn vhost_config(&self) -> &VhostUserConfig {
        &self.vhost_config
    }

    /// A function listing every socket file the server made that is still its own, for an
    /// exit that cannot wait for [`Host::stop`] (a second signal): the caller removes them.
    pub fn socket_files_fn(&self) -> impl Fn() -> Vec<(PathBuf, SocketId)> + Send + 'static {
        let registry = Arc::clone(&self.registry);
        let class_file = self.class.socket_file();
        move || {
            let mut sockets = registry.server().socket_files();
            sockets.extend(registry.socket_files());
            sockets.push(class_file.clone());
            sockets
        }
    }

    /// Stops everything (see the module's stop order). Returns the block devices removed.
    pub fn stop(self) -> Vec<PathBuf> {
        self.stop_leaving(false)
            .into_iter()
            .map(|(path, _)| path)
            .collect()
    }

    /// As [`stop`](Self::stop), for a restart: block devices with user recovery are left
    /// to the next server (`UblkExport::leave`), their requests waiting from the exit on.
    /// Returns each block device and whether it was left (else removed).
    pub fn stop_for_restart(self) -> Vec<(PathBuf, bool)> {
        self.stop_leaving(true)
    }

    fn stop_leaving(self, leave_block_devices: bool) -> Vec<(PathBuf, bool)> {
        self.runner.stop();
        if let Some(m) = self.metrics {
            m.stop();
        }
        self.class.stop();
        drop(self.served);
        let stopped = self.registry.stop(leave_block_devices);
        self.registry.server().shutdown();
        stopped
    }
}
