//! The devices of a running `uzram serve` and their frontends: those of the configuration,
//! started with the server, and those added by `hot_add` on the server's class socket
//! (`DIR/zram-control`, zram's `/sys/class/zram-control/`), until `hot_remove` or the stop.
//!
//! A device is an NBD export with its own unix socket `NAME.sock`, a control socket
//! `NAME.ctl`, its policies, and, when the server runs them, a ublk block device
//! `/dev/ublkbN` and a vhost-user socket `NAME.vhost.sock`. The last two need a size (a ublk
//! device's is fixed when it is added), so a device added by `hot_add`, uninitialised as
//! zram's, gets them when `disksize` is stored ([`DeviceAttachments`]).
//!
//! # Locks
//! `Devices::list` serialises `hot_add`, `hot_remove` and the stop (as zram's
//! `zram_index_mutex`); it is taken before a device's `DeviceAttachments::state`, never after.
//! A control connection takes only `state` (storing `disksize`).

use crate::fd_store::StateStore;
use crate::frontend::control::{self, Attachments, ControlServer, HotPlug, RemoveTarget};
use crate::frontend::metrics::{self, DeviceSamples};
use crate::frontend::nbd::{Export, Server};
use crate::frontend::ublk::{self, UblkConfig, UblkExport, UblkRecord};
use crate::frontend::unix_socket::SocketId;
use crate::frontend::vhost_user::{self, VhostUserConfig, VhostUserExport};
use crate::policy::{DevicePolicy, PolicySet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use uzram::device::Device;
use uzram::error::{Error, ErrorKind};
use uzram::BlockDevice;

/// The most devices a server holds, its configured ones included; `hot_add` past it is
/// `ENOSPC` (as the kernel's `max_num_devices` proposal for zram). Each device holds two
/// sockets and their threads, and with ublk a thread and up to 16 MiB of buffers per queue,
/// so this bounds what a client of the class socket can make the server hold.
pub const MAX_DEVICES: usize = 32;

/// The page size of a device added by `hot_add` (zram's devices have the kernel's).
pub const HOT_ADD_PAGE_SIZE_BYTES: usize = 4096;

/// A device's frontends that need a size: started once it has one, stopped on removal.
pub struct DeviceAttachments {
    name: String,
    device: Arc<Device>,
    /// Whether it gets a ublk block device, and how.
    ublk: Option<UblkConfig>,
    /// Where the server records which ublk device it serves the device as (`NAME.ublk`
    /// beside the control socket; [`UblkRecord`]), with user recovery on.
    ublk_record: PathBuf,
    /// The device was recovered from a previous process's state: the block device that
    /// process left is taken over.
    recovered: bool,
    /// Whether it gets a vhost-user socket, where, and how.
    vhost: Option<(PathBuf, VhostUserConfig)>,
    /// Where its state files go when it gets a size, and leave when it is reset.
    fd_store: Arc<StateStore>,
    state: Mutex<AttachState>,
}

/// Protected by `DeviceAttachments::state`.
#[derive(Default)]
struct AttachState {
    ublk: Option<UblkExport>,
    vhost: Option<VhostUserExport>,
    /// Removed (or the server stopping): nothing starts any more.
    removed: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DeviceAttachments {
    fn new(
        name: &str,
        device: Arc<Device>,
        ctl: &Path,
        recovered: bool,
        ublk: Option<UblkConfig>,
        vhost: Option<(PathBuf, VhostUserConfig)>,
        fd_store: Arc<StateStore>,
    ) -> DeviceAttachments {
        DeviceAttachments {
            name: name.to_string(),
            device,
            ublk,
            ublk_record: ctl.with_extension("ublk"),
            recovered,
            vhost,
            fd_store,
            state: Mutex::new(AttachState::default()),
        }
    }

    /// Starts the frontends not running yet, if the device has a size.
    pub fn start_missing(&self) -> uzram::Result<()> {
        let mut st = lock(&self.state);
        if st.removed || !self.device.is_initialised() {
            return Ok(());
        }
        if let (Some(cfg), None) = (&self.ublk, &st.ublk) {
            st.ublk = Some(self.start_ublk(cfg)?);
        }
        if let (Some((path, cfg)), None) = (&self.vhost, &st.vhost) {
            let dev = Arc::clone(&self.device) as Arc<dyn BlockDevice>;
            st.vhost = Some(VhostUserExport::start(&self.name, path, dev, cfg)?);
        }
        Ok(())
    }

    /// The device's ublk block device: with user recovery, the one a dead predecessor left
    /// (its [`UblkRecord`]) taken over if the device was recovered, deleted if not (its data
    /// is gone: the waiting requests fail); else, or if taking over fails, a new one. The
    /// record then names this process.
    fn start_ublk(&self, cfg: &UblkConfig) -> uzram::Result<UblkExport> {
        let dev = Arc::clone(&self.device) as Arc<dyn BlockDevice>;
        let tag = ublk::device_tag(&self.name);
        let me = std::process::id() as i32;
        let left = cfg
            .user_recovery
            .then(|| UblkRecord::read(&self.ublk_record))
            .flatten()
            .filter(|r| r.server_pid != me);
        let mut export = None;
        if let Some(r) = left {
            if self.recovered {
                match UblkExport::recover(
                    &self.name,
                    Arc::clone(&dev),
                    cfg,
                    r.dev_id,
                    r.server_pid,
                    tag,
                ) {
                    Ok(e) => {
                        eprintln!(
                            "uzram: {}: /dev/ublkb{} taken over from process {} (the requests it \
                             left are issued again; the kernel let its queues go after {:.2} s)",
                            self.name,
                            r.dev_id,
                            r.server_pid,
                            e.takeover_wait().unwrap_or_default().as_secs_f64()
                        );
                        export = Some(e);
                    }
                    Err(e) => eprintln!(
                        "uzram: {}: {}; a new block device instead",
                        self.name,
                        e.message()
                    ),
                }
            }
            if export.is_none() && ublk::delete_left_device(r.dev_id, r.server_pid, tag) {
                eprintln!(
                    "uzram: {}: deleted /dev/ublkb{}, left by process {} without its data",
                    self.name, r.dev_id, r.server_pid
                );
            }
        }
        let export = match export {
            Some(e) => e,
            None => UblkExport::start(&self.name, dev, cfg, tag)?,
        };
        if cfg.user_recovery {
            let record = UblkRecord {
                dev_id: export.dev_id(),
                server_pid: me,
            };
            if let Err(e) = record.write(&self.ublk_record) {
                eprintln!(
                    "uzram: {}: writing {}: {e} (a restart will not take /dev/ublkb{} over)",
                    self.name,
                    self.ublk_record.display(),
                    record.dev_id
                );
            }
        }
        Ok(export)
    }

    /// The vhost-user socket, if it is listening.
    pub fn vhost_path(&self) -> Option<PathBuf> {
        lock(&self.state)
            .vhost
            .as_ref()
            .map(|v| v.socket_path().to_path_buf())
    }

    fn socket_file(&self) -> Option<(PathBuf, SocketId)> {
        self.state
            .try_lock()
            .ok()?
            .vhost
            .as_ref()
            .map(|v| v.socket_file())
    }

    /// Stops the frontends for good; the block device removed, if there was one. With
    /// `leave_block_device` (a stop for a restart) a block device with user recovery is left
    /// to the next server instead ([`UblkExport::leave`]); `(path, left)`.
    fn stop(&self, leave_block_device: bool) -> Option<(PathBuf, bool)> {
        let mut st = lock(&self.state);
        st.removed = true;
        if let Some(v) = st.vhost.take() {
            v.stop();
        }
        let u = st.ublk.take()?;
        if leave_block_device && self.ublk.as_ref().is_some_and(|c| c.user_recovery) {
            return Some((u.leave(), true));
        }
        let path = u.block_dev_path();
        u.stop();
        let _ = std::fs::remove_file(&self.ublk_record);
        Some((path, false))
    }
}

impl Attachments for DeviceAttachments {
    fn block_dev(&self) -> Option<PathBuf> {
        lock(&self.state)
            .ublk
            .as_ref()
            .map(UblkExport::block_dev_path)
    }

    fn initialised(&self) -> uzram::Result<()> {
        self.fd_store.store(&self.name, &self.device);
        self.start_missing()
    }

    fn reset(&self) {
        self.fd_store.remove(&self.name);
    }
}

/// One device of the server.
pub struct Served {
    /// The device's (and export's) name.
    pub name: String,
    /// `zramN`'s N (what `hot_remove` takes); `None` for a configured name of another form
    /// (`hot_remove` takes that device's name instead).
    pub id: Option<u32>,
    pub device: Arc<Device>,
    /// The control socket.
    pub ctl: PathBuf,
    pub attach: Arc<DeviceAttachments>,
    pub policy: Arc<DevicePolicy>,
    control: Mutex<Option<ControlServer>>,
}

impl std::fmt::Debug for DeviceAttachments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceAttachments")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for ConfiguredDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfiguredDevice")
            .field("name", &self.name)
            .field("recovered", &self.recovered)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served")
            .field("name", &self.name)
            .field("ctl", &self.ctl)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for ServerFrontends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerFrontends")
            .field("dir", &self.dir)
            .field("ublk", &self.ublk.is_some())
            .field("vhost", &self.vhost.is_some())
            .finish()
    }
}

impl std::fmt::Debug for Devices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Devices").finish_non_exhaustive()
    }
}

/// `zramN`'s N.
fn zram_id(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("zram")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if digits.len() > 1 && digits.starts_with('0') {
        return None;
    }
    digits.parse().ok()
}

/// What every device of the server gets, for `hot_add`.
pub struct ServerFrontends {
    /// The directory of the sockets of devices added by `hot_add`.
    pub dir: PathBuf,
    /// Serving swap: the server's swap reserve, given to every device (`uzram::memory`).
    pub swap_reserve: Option<Arc<uzram::memory::SwapReserve>>,
    /// A ublk block device per device (the server was started with ublk).
    pub ublk: Option<UblkConfig>,
    /// A vhost-user socket per device.
    pub vhost: Option<VhostUserConfig>,
    /// Where the devices' state files go (`crate::fd_store`).
    pub fd_store: Arc<StateStore>,
}

/// A configured device, for [`Devices::add_configured`].
pub struct ConfiguredDevice {
    pub name: String,
    pub device: Arc<Device>,
    /// Its control socket.
    pub ctl: PathBuf,
    /// Recovered from a previous process's state (its block device is taken over).
    pub recovered: bool,
    /// Its ublk block device, if it gets one.
    pub ublk: Option<UblkConfig>,
    /// Its vhost-user socket and settings, if it gets one.
    pub vhost: Option<(PathBuf, VhostUserConfig)>,
    pub policy: Arc<DevicePolicy>,
}

/// The server's devices.
pub struct Devices {
    server: Arc<Server>,
    policies: PolicySet,
    frontends: ServerFrontends,
    list: Mutex<Vec<Arc<Served>>>,
    stopping: AtomicBool,
}

impl Devices {
    pub fn new(server: Arc<Server>, policies: PolicySet, frontends: ServerFrontends) -> Devices {
        Devices {
            server,
            policies,
            frontends,
            list: Mutex::new(Vec::new()),
            stopping: AtomicBool::new(false),
        }
    }

    pub fn server(&self) -> &Arc<Server> {
        &self.server
    }

    /// Adds a configured device, already an export of the server: starts its frontends that
    /// need a size and its control socket.
    pub fn add_configured(&self, c: ConfiguredDevice) -> anyhow::Result<Arc<Served>> {
        let attach = Arc::new(DeviceAttachments::new(
            &c.name,
            Arc::clone(&c.device),
            &c.ctl,
            c.recovered,
            c.ublk,
            c.vhost,
            Arc::clone(&self.frontends.fd_store),
        ));
        attach.start_missing()?;
        let mut list = lock(&self.list);
        self.finish_add(&mut list, &c.name, c.device, &c.ctl, attach, c.policy)
            .map_err(|e| anyhow::anyhow!("{}", e.message()))
    }

    /// Starts the control socket and lists the device in `list` (`Devices::list`, locked).
    fn finish_add(
        &self,
        list: &mut Vec<Arc<Served>>,
        name: &str,
        device: Arc<Device>,
        ctl: &Path,
        attach: Arc<DeviceAttachments>,
        policy: Arc<DevicePolicy>,
    ) -> uzram::Result<Arc<Served>> {
        let control = ControlServer::start_with_attachments(
            ctl,
            Arc::clone(&device),
            self.server.openers(name),
            Some(Arc::clone(&attach) as Arc<dyn Attachments>),
            Some(Arc::clone(&policy)),
        )
        .map_err(|e| {
            Error::new(
                e.kind(),
                format!(
                    "starting the control socket {}: {}",
                    ctl.display(),
                    e.message()
                ),
            )
        })?;
        let served = Arc::new(Served {
            name: name.to_string(),
            id: zram_id(name),
            device,
            ctl: ctl.to_path_buf(),
            attach,
            policy,
            control: Mutex::new(Some(control)),
        });
        list.push(Arc::clone(&served));
        Ok(served)
    }

    /// Adds a device a previous process of the server had added by `hot_add`, recovered from
    /// its state: served as `hot_add` serves a device, under its name.
    pub fn add_recovered(&self, name: &str, device: Arc<Device>) -> uzram::Result<()> {
        let mut list = lock(&self.list);
        if list.len() >= MAX_DEVICES {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("the server has {MAX_DEVICES} devices, its most"),
            ));
        }
        if list.iter().any(|s| s.name == name) {
            return Err(Error::busy(format!("a device {name} exists already")));
        }
        self.add_unconfigured(&mut list, name, device, "recovered")?;
        Ok(())
    }

    /// Serves `device` under `name` with every frontend the server runs, its sockets in the
    /// server's directory (`hot_add`'s way; `list` is `Devices::list`, locked). `how` names
    /// the way in the log.
    fn add_unconfigured(
        &self,
        list: &mut Vec<Arc<Served>>,
        name: &str,
        device: Arc<Device>,
        how: &str,
    ) -> uzram::Result<()> {
        let name = name.to_string();
        let dir = &self.frontends.dir;
        let export = Export {
            name: name.clone(),
            description: format!(
                "uzram {name} ({}, {} pages)",
                device.comp_algorithm(),
                device.page_size_bytes()
            ),
            device: Arc::clone(&device) as Arc<dyn BlockDevice>,
            read_only: false,
        };
        let socket = dir.join(format!("{name}.sock"));
        self.server.add_export(export, Some(socket.clone()))?;
        let ctl = control::socket_path(dir, &name);
        let attach = Arc::new(DeviceAttachments::new(
            &name,
            Arc::clone(&device),
            &ctl,
            how == "recovered",
            self.frontends.ublk.clone(),
            self.frontends
                .vhost
                .clone()
                .map(|c| (vhost_user::socket_path(dir, &name), c)),
            Arc::clone(&self.frontends.fd_store),
        ));
        let policy = Arc::new(DevicePolicy::new(name.clone(), Arc::clone(&device)));
        // A device recovered has its settings saved by the previous process, if any (one
        // added by hot_add: the configuration does not name it).
        match policy.restore(false, None) {
            Ok(restored) => restored.log(&name),
            Err(e) => eprintln!("uzram: {how}: {name}: policy: {}", e.message()),
        }
        let started = Arc::clone(&attach);
        let served = match attach
            .start_missing()
            .and_then(|()| self.finish_add(list, &name, device, &ctl, attach, Arc::clone(&policy)))
        {
            Ok(s) => s,
            Err(e) => {
                started.stop(false);
                let _ = self.server.remove_export(&name);
                return Err(e);
            }
        };
        self.policies.add(policy);
        eprintln!(
            "uzram: {how}: {name}: nbd+unix:///{name}?socket={}, control {}",
            socket.display(),
            served.ctl.display()
        );
        Ok(())
    }

    /// The devices now.
    pub fn snapshot(&self) -> Vec<Arc<Served>> {
        lock(&self.list).clone()
    }

    /// Every device's statistics, for the metrics endpoint.
    pub fn metrics(&self) -> uzram::Result<Vec<DeviceSamples>> {
        self.snapshot()
            .iter()
            .map(|s| {
                metrics::collect_device(
                    &s.name,
                    &s.device,
                    self.server.openers(&s.name).as_deref(),
                    Some(&s.policy),
                )
            })
            .collect()
    }

    /// The socket files of the devices' control and vhost-user sockets (for a forced exit;
    /// whatever is locked at that moment is skipped).
    pub fn socket_files(&self) -> Vec<(PathBuf, SocketId)> {
        let Ok(list) = self.list.try_lock() else {
            return Vec::new();
        };
        let mut v = Vec::new();
        for s in list.iter() {
            if let Ok(c) = s.control.try_lock() {
                v.extend(c.as_ref().map(ControlServer::socket_file));
            }
            v.extend(s.attach.socket_file());
        }
        v
    }

    /// Stops every device's control socket and frontends (not the NBD server); the block
    /// devices, each with whether it was left to the next server (`leave_block_devices`: a
    /// stop for a restart, user recovery on) rather than removed. `hot_add` fails from then
    /// on.
    pub fn stop(&self, leave_block_devices: bool) -> Vec<(PathBuf, bool)> {
        self.stopping.store(true, Ordering::SeqCst);
        let list: Vec<Arc<Served>> = lock(&self.list).drain(..).collect();
        for s in &list {
            if let Some(c) = lock(&s.control).take() {
                c.stop();
            }
        }
        list.iter()
            .filter_map(|s| s.attach.stop(leave_block_devices))
            .collect()
    }
}

impl HotPlug for Devices {
    fn hot_add(&self) -> uzram::Result<u32> {
        let mut list = lock(&self.list);
        if self.stopping.load(Ordering::SeqCst) {
            return Err(Error::new(ErrorKind::NoDevice, "the server is stopping"));
        }
        if list.len() >= MAX_DEVICES {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!("the server has {MAX_DEVICES} devices, its most"),
            ));
        }
        // zram's idr: the lowest free id.
        let taken: Vec<&str> = list.iter().map(|s| s.name.as_str()).collect();
        let id = (0u32..)
            .find(|i| !taken.contains(&format!("zram{i}").as_str()))
            .expect("fewer than MAX_DEVICES are taken");
        let name = format!("zram{id}");
        drop(taken);
        let device = Device::new_uninit(HOT_ADD_PAGE_SIZE_BYTES)?;
        device.set_swap_reserve(self.frontends.swap_reserve.clone())?;
        self.add_unconfigured(&mut list, &name, Arc::new(device), "hot_add")?;
        Ok(id)
    }

    fn hot_remove(&self, target: RemoveTarget<'_>) -> uzram::Result<()> {
        let mut list = lock(&self.list);
        let found = list.iter().position(|s| match target {
            RemoveTarget::Id(id) => s.id == Some(id),
            RemoveTarget::Name(name) => s.name == name,
        });
        let Some(i) = found else {
            let what = match target {
                RemoveTarget::Id(id) => format!("zram{id}"),
                RemoveTarget::Name(name) => format!("{name:?}"),
            };
            return Err(Error::new(ErrorKind::NoDevice, format!("no device {what}")));
        };
        let served = Arc::clone(&list[i]);
        let name = &served.name;
        {
            let st = lock(&served.attach.state);
            // Held until the NBD export is gone: no one can mount or swapon the block device
            // meanwhile (an exclusive open fails with EBUSY while we hold ours).
            let claim = match &st.ublk {
                Some(u) => claim_exclusive(&u.block_dev_path())?,
                None => None,
            };
            if st.vhost.as_ref().is_some_and(VhostUserExport::is_connected) {
                return Err(Error::busy(format!(
                    "{name} is in use by a vhost-user front end (a VM)"
                )));
            }
            self.server.remove_export(name)?;
            drop(claim);
        }
        list.remove(i);
        drop(list);
        self.frontends.fd_store.remove(name);
        if let Some(c) = lock(&served.control).take() {
            c.stop();
        }
        if let Some((path, _)) = served.attach.stop(false) {
            eprintln!("uzram: hot_remove: removed {}", path.display());
        }
        self.policies.remove(name);
        eprintln!("uzram: hot_remove: {name} removed");
        Ok(())
    }
}

/// Opens block device `path` exclusively, so that no mount or swapon can claim it while the
/// file is open; `EBUSY` if it is mounted, swapped on or claimed already (zram refuses
/// `hot_remove` while its disk is open), `None` if it cannot be opened at all (gone).
fn claim_exclusive(path: &Path) -> uzram::Result<Option<std::fs::File>> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(path)
    {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Err(Error::busy(format!(
            "{} is in use (mounted, swapped on or opened exclusively)",
            path.display()
        ))),
        Err(_) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_zram_numbers() {
        assert_eq!(zram_id("zram0"), Some(0));
        assert_eq!(zram_id("zram17"), Some(17));
        for other in [
            "zram",
            "zram01",
            "zram-1",
            "swap0",
            "zram1a",
            "zram99999999999",
        ] {
            assert_eq!(zram_id(other), None, "{other}");
        }
    }
}
