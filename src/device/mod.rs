//! The device: zram's `struct zram`.
//!
//! A [`Device`] starts uninitialised (like a fresh `/sys/block/zramN`: `initstate` 0), takes its
//! settings (`comp_algorithm`, `algorithm_params`, `mem_limit`, ...) and becomes initialised when
//! `disksize` is written; `reset` returns it to the uninitialised state and frees everything.
//! [`Device::new`] does both steps from a [`DeviceConfig`].
//!
//! The device keeps the settings, the init lock, the attributes and request splitting; an
//! initialised device's pages are a [`Store`](crate::store) (slots, pool, codec, counters,
//! writeback target), built by `disksize` and dropped by `reset`. Requests are validated and
//! cut into pages here ([`request`]) and each page goes to the store; writeback
//! ([`crate::writeback`]) runs on the store too, under the device's `pp_lock`.
//!
//! # Locks
//! - `state` is zram's `init_lock`: every request and most attribute accesses hold it shared;
//!   `disksize` (initialisation) and `reset` hold it exclusive, so they wait for requests in
//!   flight and no request sees a half-built or half-freed device.
//! - Each slot has its own lock ([`crate::slot`]); a slot's data and its share of the counters
//!   change only under it, inside the store.
//! - The allocator has its own per-class locks, never held while taking a slot lock.
//! - Writeback and recompression share `pp_lock` (one of them at a time, taken with `state`
//!   held shared and never waited for: a second one gets `EAGAIN`); writeback adds leaf locks:
//!   the writeback target's (the bitmap's, or the zone store's) and the writeback limit's.
//!
//! Lock order: `state` → `pp_lock` → slot lock → allocator locks, target lock, limit lock.
//! No slot lock is held while waiting for backing I/O.

pub mod attrs;
pub mod block_stat;
pub mod idle;
pub mod progress;
mod recompress;
pub mod request;
pub mod restart;
pub mod stats;
mod writeback;

pub use idle::IdleCutoff;
pub use progress::{OpProgress, ProgressUnit};
pub use stats::{MetaStats, StatsSnapshot};

use crate::backing::Backing;
use crate::clock::{Clock, SystemClock};
use crate::compress::{self, CodecParams, MAX_COMPS};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::SwapReserve;
pub use crate::recompress::{RecompressReport, RecompressSpec};
use crate::shm::ShmFile;
use crate::store::{BackingLayout, Codecs, Free, Store, WbTarget};
pub use crate::store::{GenStat, TrainReport, TrainSpec};
use crate::units::{BLOCK_SIZE_BYTES, DEFAULT_PAGE_SIZE_BYTES, SUPPORTED_PAGE_SIZES_BYTES};
use crate::writeback::{WbLimit, DEFAULT_WB_BATCH_SIZE};
use crate::zoned::DEFAULT_ZONE_SIZE_BYTES;
use crate::zsmalloc::{DeferredStats, PoolStats, ZsPool};
use crate::BlockDevice;
use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// The algorithm a new or reset device uses (zram-generator's and most distributions' choice).
pub const DEFAULT_COMP_ALGORITHM: &str = "lz4";

/// Everything needed to create an initialised device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Size of the device in bytes; rounded up to the page size. Must not be 0.
    pub disksize_bytes: u64,
    /// Page size: 4096 (default), 16384 or 65536.
    pub page_size_bytes: usize,
    /// The primary compression algorithm (`comp_algorithm`).
    pub comp_algorithm: String,
    /// Its parameters (`algorithm_params`).
    pub comp_params: CodecParams,
    /// Memory limit for the pool in bytes (0: none).
    pub mem_limit_bytes: u64,
}

impl Default for DeviceConfig {
    fn default() -> DeviceConfig {
        DeviceConfig {
            disksize_bytes: 0,
            page_size_bytes: DEFAULT_PAGE_SIZE_BYTES,
            comp_algorithm: DEFAULT_COMP_ALGORITHM.to_string(),
            comp_params: CodecParams::default(),
            mem_limit_bytes: 0,
        }
    }
}

/// Settings made before `disksize`, kept until reset.
#[derive(Debug, Clone)]
struct Settings {
    comp_algorithm: String,
    comp_params: CodecParams,
    /// `recomp_algorithm`: the recompression algorithm of priorities 1..=3 (`[0]` unused:
    /// the primary is `comp_algorithm`).
    recomp_algorithms: [Option<String>; MAX_COMPS],
    /// `algorithm_params priority=N` of priorities 1..=3 (`[0]` unused: `comp_params`). Kept
    /// when the priority's algorithm changes, as the kernel keeps them.
    recomp_params: [CodecParams; MAX_COMPS],
    /// `backing_dev`: where writeback puts pages (none until set).
    backing: Option<Arc<dyn Backing>>,
    /// `compressed_writeback`.
    compressed_writeback: bool,
    /// `backing_layout`.
    backing_layout: BackingLayout,
    /// `zone_size`: bytes per zone with the zoned layout.
    zone_size_bytes: u64,
    /// `multi_page_size`: aligned groups of this many bytes written at once are compressed as
    /// one object (4096: off).
    multi_page_size_bytes: usize,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            comp_algorithm: DEFAULT_COMP_ALGORITHM.to_string(),
            comp_params: CodecParams::default(),
            recomp_algorithms: Default::default(),
            recomp_params: Default::default(),
            backing: None,
            compressed_writeback: false,
            backing_layout: BackingLayout::Bitmap,
            zone_size_bytes: DEFAULT_ZONE_SIZE_BYTES,
            multi_page_size_bytes: MULTI_PAGE_SIZE_OFF_BYTES,
        }
    }
}

/// `multi_page_size` when off.
pub const MULTI_PAGE_SIZE_OFF_BYTES: usize = 4096;
/// The values `multi_page_size` takes (4096: off).
pub const MULTI_PAGE_SIZES_BYTES: [usize; 4] = [4096, 16384, 32768, 65536];

/// What the init lock protects.
#[derive(Debug, Default)]
struct State {
    settings: Settings,
    /// The initialised device's pages: built by `disksize`, dropped by `reset`.
    store: Option<Store>,
    /// The settings header of the store's state (`restart`), with the store.
    header: Option<ShmFile>,
    /// Serving swap: the server's swap reserve, which the pool takes its zspages from
    /// (`crate::memory`). Set before `disksize`; kept by reset.
    swap_reserve: Option<Arc<SwapReserve>>,
}

/// A compressed-RAM block device.
#[derive(Debug)]
pub struct Device {
    page_size_bytes: usize,
    /// zram's `init_lock`.
    state: RwLock<State>,
    /// `mem_limit` in pages (0: none). Settable at any time; cleared by reset.
    mem_limit_pages: AtomicU64,
    /// Capacity of the allocator's deferred-free queue for pools built from now on (0: the
    /// default, 128 MiB / page size). Survives reset; see
    /// [`debug_set_deferred_capacity`](Device::debug_set_deferred_capacity).
    #[cfg(any(test, feature = "testing"))]
    deferred_capacity: AtomicU64,
    /// How release paths (discard, free notifications) free allocator objects: deferred, or
    /// synchronously in the baseline of `uzram bench free`. Fixed at construction.
    release: Free,
    /// `writeback_limit` and `writeback_limit_enable`. Settable at any time; kept by reset.
    wb_limit: WbLimit,
    /// `writeback_batch_size` (at least 1), read when a writeback starts. Kept by reset.
    wb_batch_size: AtomicU32,
    /// Serialises [`save_limits`](Device::save_limits): each save takes the values and the
    /// next generation ([`limits_gen`](Device::limits_gen)) under it.
    limits_write: Mutex<()>,
    /// The generation of the last limits record written to the header file (restart.rs).
    limits_gen: AtomicU64,
    /// The install sequence of the last dictionary record written to the header file
    /// (restart.rs, `DictMeta`): set by `disksize` and recovery (the init lock exclusive),
    /// advanced by `train_dict` under `pp_lock`.
    dict_seq: AtomicU64,
    /// The server's policy texts (its settings, and its policies' state) as last saved or
    /// recovered, and each one's record generation in the header file (restart.rs,
    /// `PolicyRecord`). Taken after the init lock (shared by `save_policy` and
    /// `save_policy_state`, exclusive by `disksize`), held across each record's write so
    /// that each kind's records reach the file in generation order. Kept by reset.
    policy: Mutex<restart::SavedPolicy>,
    /// Held by the running writeback or recompression (zram's `pp_in_progress`).
    pp_lock: Mutex<()>,
    /// The block layer's `stat` counters (zeroed by reset, as the kernel's reset zeroes the
    /// disk's).
    block_stat: block_stat::BlockStat,
    /// The clock of slots' access times (`idle N`). Fixed at construction.
    clock: Arc<dyn Clock>,
}

/// A shared hold on an initialised device's store (the init lock taken shared).
pub(crate) struct StoreRef<'a> {
    guard: RwLockReadGuard<'a, State>,
}

impl std::ops::Deref for StoreRef<'_> {
    type Target = Store;
    fn deref(&self) -> &Store {
        self.guard.store.as_ref().expect("checked initialised")
    }
}

impl Device {
    /// A new, uninitialised device (initstate 0) with the given page size.
    pub fn new_uninit(page_size_bytes: usize) -> Result<Device> {
        Device::new_uninit_with_clock(page_size_bytes, Arc::new(SystemClock::new()))
    }

    /// A new, uninitialised device whose slots' access times (what `idle N` compares) come
    /// from `clock`: a [`ManualClock`](crate::clock::ManualClock) lets a test age pages
    /// without waiting.
    pub fn new_uninit_with_clock(page_size_bytes: usize, clock: Arc<dyn Clock>) -> Result<Device> {
        if !SUPPORTED_PAGE_SIZES_BYTES.contains(&page_size_bytes) {
            return Err(Error::invalid(format!(
                "page size {page_size_bytes} not supported (4096, 16384 or 65536)"
            )));
        }
        Ok(Device {
            page_size_bytes,
            state: RwLock::new(State::default()),
            mem_limit_pages: AtomicU64::new(0),
            #[cfg(any(test, feature = "testing"))]
            deferred_capacity: AtomicU64::new(0),
            release: Free::Deferred,
            wb_limit: WbLimit::default(),
            wb_batch_size: AtomicU32::new(DEFAULT_WB_BATCH_SIZE),
            limits_write: Mutex::new(()),
            limits_gen: AtomicU64::new(0),
            dict_seq: AtomicU64::new(0),
            policy: Mutex::new(restart::SavedPolicy::default()),
            pp_lock: Mutex::new(()),
            block_stat: block_stat::BlockStat::default(),
            clock,
        })
    }

    /// A new, initialised device.
    pub fn new(config: DeviceConfig) -> Result<Device> {
        Device::new_releasing(config, Free::Deferred, Arc::new(SystemClock::new()))
    }

    /// A new, initialised device whose access times come from `clock` (see
    /// [`new_uninit_with_clock`](Device::new_uninit_with_clock)).
    pub fn new_with_clock(config: DeviceConfig, clock: Arc<dyn Clock>) -> Result<Device> {
        Device::new_releasing(config, Free::Deferred, clock)
    }

    /// The clock of slots' access times.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Benchmark baseline (`testing`): a device like [`Device::new`]'s whose release paths
    /// (discard, free notifications) free allocator objects synchronously, as overwrites do:
    /// the anchor `uzram bench free` measures the deferred-free queue against. Fixed for the
    /// device's life.
    #[cfg(any(test, feature = "testing"))]
    pub fn bench_new_release_sync(config: DeviceConfig) -> Result<Device> {
        Device::new_releasing(config, Free::Sync, Arc::new(SystemClock::new()))
    }

    fn new_releasing(config: DeviceConfig, release: Free, clock: Arc<dyn Clock>) -> Result<Device> {
        let mut dev = Device::new_uninit_with_clock(config.page_size_bytes, clock)?;
        dev.release = release;
        {
            let mut st = dev.state.write();
            st.settings = Settings {
                comp_algorithm: config.comp_algorithm.clone(),
                comp_params: config.comp_params,
                ..Settings::default()
            };
        }
        dev.set_mem_limit_bytes(config.mem_limit_bytes);
        dev.init(config.disksize_bytes)?;
        Ok(dev)
    }

    /// The page size.
    pub fn page_size_bytes(&self) -> usize {
        self.page_size_bytes
    }

    /// True once `disksize` has been set (zram's `initstate`).
    pub fn is_initialised(&self) -> bool {
        self.state.read().store.is_some()
    }

    /// The state, locked for a change of setting `attr`, which only an uninitialised device
    /// takes: `EBUSY` otherwise, as zram answers.
    fn settings_for(&self, attr: &str) -> Result<RwLockWriteGuard<'_, State>> {
        let st = self.state.write();
        if st.store.is_some() {
            return Err(Error::busy(format!(
                "{attr} cannot change once initialised: reset first"
            )));
        }
        Ok(st)
    }

    /// Sets `multi_page_size` (bytes): 4096 (off), or 16384, 32768 or 65536 above the page
    /// size; aligned groups of that size written at once are then compressed as one object.
    /// `EINVAL` for another value, `EBUSY` once initialised.
    pub fn set_multi_page_size_bytes(&self, bytes: usize) -> Result<()> {
        let mut st = self.settings_for("multi_page_size")?;
        let page = self.page_size_bytes;
        if bytes != MULTI_PAGE_SIZE_OFF_BYTES
            && !(MULTI_PAGE_SIZES_BYTES.contains(&bytes) && bytes > page && bytes % page == 0)
        {
            return Err(Error::invalid(format!(
                "multi_page_size takes 4096 (off) or one of 16384, 32768, 65536 above the \
                 page size ({page}), not {bytes}"
            )));
        }
        st.settings.multi_page_size_bytes = bytes;
        Ok(())
    }

    /// The `multi_page_size` setting (4096: off).
    pub fn multi_page_size_bytes(&self) -> usize {
        self.state.read().settings.multi_page_size_bytes
    }

    /// The device size in bytes (0 when uninitialised).
    pub fn disksize_bytes(&self) -> u64 {
        self.state
            .read()
            .store
            .as_ref()
            .map_or(0, Store::size_bytes)
    }

    /// Serves swap from `reserve` (the server's, shared by its devices: `crate::memory`), or
    /// not (`None`): the pool built by the next `disksize` takes its zspages from the reserve
    /// and fails a write the reserve cannot serve at once, and the slot table is faulted in
    /// whole. `EBUSY` once initialised.
    pub fn set_swap_reserve(&self, reserve: Option<Arc<SwapReserve>>) -> Result<()> {
        let mut st = self.state.write();
        if st.store.is_some() {
            return Err(Error::busy(
                "device already initialised: set swap before disksize",
            ));
        }
        st.swap_reserve = reserve;
        Ok(())
    }

    /// The swap reserve the device serves swap from, if any.
    pub fn swap_reserve(&self) -> Option<Arc<SwapReserve>> {
        self.state.read().swap_reserve.clone()
    }

    /// Initialises the device with `disksize_bytes` (rounded up to a page), as writing
    /// `disksize` does. `EINVAL` for 0, `EBUSY` if already initialised.
    pub fn init(&self, disksize_bytes: u64) -> Result<()> {
        if disksize_bytes == 0 {
            return Err(Error::invalid("disksize must not be 0"));
        }
        let mut st = self.state.write();
        if st.store.is_some() {
            return Err(Error::busy("device already initialised: reset it first"));
        }
        let page = self.page_size_bytes as u64;
        let disksize_bytes = disksize_bytes
            .checked_add(page - 1)
            .ok_or_else(|| Error::invalid("disksize too large"))?
            / page
            * page;
        let codecs = Self::new_codecs(&st.settings)?;
        #[cfg(any(test, feature = "testing"))]
        let capacity = match self.deferred_capacity.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n as usize),
        };
        #[cfg(not(any(test, feature = "testing")))]
        let capacity = None;
        let (pool_page_bytes, capacity, multi_pages) = self.pool_shape(&st.settings, capacity);
        let pool = match &st.swap_reserve {
            Some(reserve) => ZsPool::with_swap_reserve(pool_page_bytes, capacity, reserve)?,
            None => ZsPool::with_deferred_capacity(pool_page_bytes, capacity)?,
        };
        let swap_pool = pool.serves_swap().then(|| pool.pool_tag());
        let header = self.write_header(&st.settings, disksize_bytes / page, swap_pool)?;
        let target = match st.settings.backing.clone() {
            Some(b) => Some(WbTarget::new(
                b,
                st.settings.backing_layout,
                st.settings.compressed_writeback,
                self.page_size_bytes,
                st.settings.zone_size_bytes,
            )?),
            None => None,
        };
        let store = Store::with_multi_pages(
            self.page_size_bytes,
            multi_pages,
            disksize_bytes / page,
            codecs,
            pool,
            target,
            Arc::clone(&self.clock),
        )?;
        st.store = Some(store);
        st.header = Some(header);
        Ok(())
    }

    /// The pool a store of `settings` needs: its page size (multi-page objects are up to
    /// `multi_page_size`: the pool then takes up to 64 KiB), its deferred-free queue's capacity
    /// (`capacity` if set; sized by the device's page either way) and the pages per
    /// multi-page object.
    fn pool_shape(
        &self,
        settings: &Settings,
        capacity: Option<usize>,
    ) -> (usize, Option<usize>, usize) {
        let mps = settings.multi_page_size_bytes.max(self.page_size_bytes);
        let multi_pages = mps / self.page_size_bytes;
        if multi_pages > 1 {
            let default = crate::zsmalloc::DEFERRED_FREE_BUDGET_BYTES / self.page_size_bytes;
            (
                MULTI_PAGE_SIZES_BYTES[3],
                capacity.or(Some(default)),
                multi_pages,
            )
        } else {
            (self.page_size_bytes, capacity, multi_pages)
        }
    }

    /// The codecs `settings` name, each with its parameters: `EINVAL` for parameters an
    /// algorithm refuses (kept from an earlier algorithm of the same priority).
    fn new_codecs(settings: &Settings) -> Result<Codecs> {
        let with_prio = |prio: usize, e: crate::Error| {
            Error::invalid(format!(
                "algorithm_params of priority {prio} do not suit its algorithm: {}",
                e.message()
            ))
        };
        let primary = compress::new_codec(&settings.comp_algorithm, settings.comp_params.clone())
            .map_err(|e| with_prio(0, e))?;
        let mut secondary: [Option<(Box<dyn compress::Codec>, CodecParams)>; MAX_COMPS] =
            Default::default();
        for (prio, alg) in settings.recomp_algorithms.iter().enumerate().skip(1) {
            if let Some(alg) = alg {
                let params = settings.recomp_params[prio].clone();
                let codec =
                    compress::new_codec(alg, params.clone()).map_err(|e| with_prio(prio, e))?;
                secondary[prio] = Some((codec, params));
            }
        }
        Ok(Codecs::new(primary, secondary))
    }

    /// Frees everything and returns to the uninitialised state with default settings, as
    /// writing `reset` does: the backing device is detached (every block it held is dropped with
    /// the bitmap) and `compressed_writeback` is cleared. Waits for requests and a writeback in
    /// flight. Dropping the pool stops its deferred-free worker and frees what is still queued
    /// (see `ZsPool`'s `Drop`). `writeback_limit`, `writeback_limit_enable` and
    /// `writeback_batch_size` are kept, as zram keeps them.
    pub fn reset(&self) {
        let mut st = self.state.write();
        st.store = None;
        st.header = None;
        st.settings = Settings::default();
        self.mem_limit_pages.store(0, Ordering::Relaxed);
        // The kernel's reset zeroes the disk's `stat` too (`part_stat_set_all`); no request
        // is in flight while the init lock is held exclusive.
        self.block_stat.reset();
    }

    /// Attaches a backing device for writeback (what writing `backing_dev` does with a path).
    /// Only before initialisation (`EBUSY`); the backing must hold at least one page.
    pub fn set_backing(&self, backing: Arc<dyn Backing>) -> Result<()> {
        let mut st = self.settings_for("backing_dev")?;
        let page = self.page_size_bytes as u64;
        if backing.size_bytes() < page || backing.block_size_bytes() != BLOCK_SIZE_BYTES {
            return Err(Error::invalid(format!(
                "backing device {} holds {} bytes: less than one {page}-byte page",
                backing.describe(),
                backing.size_bytes()
            )));
        }
        if let Some(g) = backing.zone_geometry() {
            // A zoned block device is written through its own zones: the zoned layout with
            // the device's zone size (changing either afterwards is EINVAL).
            if !crate::zoned::is_valid_zone_size(g.zone_size_bytes) {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "backing device {} has zones of {} bytes; zoned writeback supports \
                         multiples of 1 MiB up to {}",
                        backing.describe(),
                        g.zone_size_bytes,
                        crate::zoned::MAX_ZONE_SIZE_BYTES
                    ),
                ));
            }
            st.settings.backing_layout = BackingLayout::Zoned;
            st.settings.zone_size_bytes = g.zone_size_bytes;
        }
        st.settings.backing = Some(backing);
        Ok(())
    }

    /// The zone size of the backing device when it is a zoned block device (its zones are
    /// used as they are).
    fn backing_zone_size_bytes(st: &State) -> Option<u64> {
        st.settings
            .backing
            .as_ref()
            .and_then(|b| b.zone_geometry())
            .map(|g| g.zone_size_bytes)
    }

    /// The backing device set (`backing_dev`), if any: what a recovery of this device's saved
    /// state needs opened again (`Device::recover_with`).
    pub fn backing(&self) -> Option<Arc<dyn Backing>> {
        self.state.read().settings.backing.clone()
    }

    /// What `backing_dev` shows: the backing's path, or `none`.
    pub fn backing_dev(&self) -> String {
        self.state
            .read()
            .settings
            .backing
            .as_ref()
            .map_or_else(|| "none".to_string(), |b| b.describe())
    }

    /// Sets `compressed_writeback`: written-back pages are stored as their compressed object and
    /// decompressed when read. Only before initialisation (`EBUSY`).
    pub fn set_compressed_writeback(&self, on: bool) -> Result<()> {
        let mut st = self.settings_for("compressed_writeback")?;
        st.settings.compressed_writeback = on;
        Ok(())
    }

    /// The `compressed_writeback` setting.
    pub fn compressed_writeback(&self) -> bool {
        self.state.read().settings.compressed_writeback
    }

    /// Sets `backing_layout`: how writeback lays pages out on the backing device (the zoned
    /// layout always stores compressed objects, whatever `compressed_writeback` says). Only
    /// before initialisation (`EBUSY`).
    pub fn set_backing_layout(&self, layout: BackingLayout) -> Result<()> {
        let mut st = self.settings_for("backing_layout")?;
        if layout != BackingLayout::Zoned && Self::backing_zone_size_bytes(&st).is_some() {
            return Err(Error::invalid(
                "the backing device is a zoned block device: it takes only backing_layout=zoned",
            ));
        }
        st.settings.backing_layout = layout;
        Ok(())
    }

    /// The `backing_layout` setting.
    pub fn backing_layout(&self) -> BackingLayout {
        self.state.read().settings.backing_layout
    }

    /// Sets `zone_size` for the zoned layout. Only before initialisation (`EBUSY`); `EINVAL`
    /// unless it is a non-zero multiple of 1 MiB of at most 2 GiB and, when a backing device is
    /// set, it holds at least 3 such zones (checked again at `disksize`, as the backing may be
    /// set afterwards).
    pub fn set_zone_size_bytes(&self, bytes: u64) -> Result<()> {
        let mut st = self.settings_for("zone_size")?;
        if !crate::zoned::is_valid_zone_size(bytes) {
            return Err(Error::invalid(format!(
                "zone_size {bytes}: must be a non-zero multiple of 1 MiB, at most {}",
                crate::zoned::MAX_ZONE_SIZE_BYTES
            )));
        }
        if let Some(zs) = Self::backing_zone_size_bytes(&st) {
            if bytes != zs {
                return Err(Error::invalid(format!(
                    "zone_size {bytes}: the backing device is a zoned block device with zones \
                     of {zs} bytes"
                )));
            }
        }
        if let Some(b) = st.settings.backing.as_ref() {
            if b.size_bytes() / bytes < 3 {
                return Err(Error::invalid(format!(
                    "zone_size {bytes}: the backing device ({} bytes) would hold {} zones; \
                     zoned writeback needs at least 3",
                    b.size_bytes(),
                    b.size_bytes() / bytes
                )));
            }
        }
        st.settings.zone_size_bytes = bytes;
        Ok(())
    }

    /// The `zone_size` setting in bytes.
    pub fn zone_size_bytes(&self) -> u64 {
        self.state.read().settings.zone_size_bytes
    }

    /// `writeback_limit_enable`.
    pub fn set_writeback_limit_enable(&self, on: bool) {
        self.wb_limit.set_enabled(on);
        self.save_limits();
    }

    /// `writeback_limit` in 4 KiB units.
    pub fn set_writeback_limit(&self, units: u64) {
        self.wb_limit.set_limit_units(units);
        self.save_limits();
    }

    /// The `writeback_limit_enable` setting.
    pub fn writeback_limit_enable(&self) -> bool {
        self.wb_limit.enabled()
    }

    /// The remaining `writeback_limit` in 4 KiB units.
    pub fn writeback_limit(&self) -> u64 {
        self.wb_limit.limit_units()
    }

    /// `writeback_batch_size`: requests in flight per writeback (`EINVAL` for 0).
    pub fn set_writeback_batch_size(&self, n: u32) -> Result<()> {
        if n == 0 {
            return Err(Error::invalid("writeback_batch_size must be at least 1"));
        }
        self.wb_batch_size.store(n, Ordering::Relaxed);
        self.save_limits();
        Ok(())
    }

    /// The `writeback_batch_size` setting.
    pub fn writeback_batch_size(&self) -> u32 {
        self.wb_batch_size.load(Ordering::Relaxed)
    }

    /// Sets `mem_limit` (bytes, rounded up to pages; 0 removes the limit).
    pub fn set_mem_limit_bytes(&self, limit_bytes: u64) {
        let page = self.page_size_bytes as u64;
        self.mem_limit_pages
            .store(limit_bytes.div_ceil(page), Ordering::Relaxed);
        self.save_limits();
    }

    /// Runs compaction of the pool (zram's `compact`); returns pages freed. Drains the
    /// deferred-free queue first: moving objects that are about to be freed is wasted work,
    /// and their frees may empty zspages by themselves.
    pub fn compact(&self) -> u64 {
        self.store().map_or(0, |store| store.compact())
    }

    /// Frees every allocator object queued by release paths (discard, free notifications)
    /// before this call; `mem_used_total` then counts only live data. Returns how many objects
    /// it freed. A no-op on an uninitialised device.
    pub fn flush_deferred(&self) -> u64 {
        self.store()
            .map_or(0, |store| store.flush_deferred() as u64)
    }

    /// The allocator's deferred-free counters (`deferred_stat`); all 0 when uninitialised.
    pub fn deferred_stats(&self) -> DeferredStats {
        self.store()
            .map_or_else(|_| DeferredStats::default(), |store| store.deferred_stats())
    }

    /// The device's memory besides `mem_used_total` (`meta_stat`); all 0 when uninitialised.
    pub fn meta_stats(&self) -> MetaStats {
        self.store()
            .map_or_else(|_| MetaStats::default(), |store| store.meta_stats())
    }

    /// The allocator's per-class counters (the kernel's debugfs `classes`), when initialised.
    pub fn pool_stats(&self) -> Option<PoolStats> {
        self.store().ok().map(|store| store.pool_stats())
    }

    /// Sets the deferred-free queue's capacity (entries, at least 2; 0: the default) for the
    /// pools built by later initialisations (`testing`). For tests, which need a small queue to
    /// make the worker run; the default is upstream's budget.
    #[cfg(any(test, feature = "testing"))]
    pub fn debug_set_deferred_capacity(&self, entries: usize) {
        self.deferred_capacity
            .store(entries as u64, Ordering::Relaxed);
    }

    /// A consistent-enough snapshot of the statistics (exact when no request is in flight).
    pub fn stats(&self) -> StatsSnapshot {
        let page = self.page_size_bytes as u64;
        let mem_limit_bytes = self.mem_limit_pages.load(Ordering::Relaxed) * page;
        let st = self.state.read();
        let snapshot = st.store.as_ref().map(Store::snapshot).unwrap_or_default();
        StatsSnapshot {
            mem_limit_bytes,
            ..snapshot
        }
    }

    /// Resets `mem_used_max` to the pool's current size (a no-op when uninitialised).
    pub(crate) fn reset_mem_used_max(&self) {
        if let Ok(store) = self.store() {
            store.reset_mem_used_max();
        }
    }

    /// The initialised device's store, held shared, or "not initialised" as `InvalidArgument`:
    /// an uninitialised device has size 0, so all I/O is out of range.
    pub(crate) fn store(&self) -> Result<StoreRef<'_>> {
        let guard = self.state.read();
        if guard.store.is_none() {
            return Err(Error::invalid("device not initialised: set disksize first"));
        }
        Ok(StoreRef { guard })
    }

    /// The parameters `algorithm_params` set for priority `prio` (0: the primary; 1..=3 the
    /// recompression algorithms), used by the next `disksize`. `None` outside 0..=3.
    pub fn algorithm_params(&self, prio: usize) -> Option<CodecParams> {
        let st = self.state.read();
        match prio {
            0 => Some(st.settings.comp_params.clone()),
            p => st.settings.recomp_params.get(p).cloned(),
        }
    }

    /// The current algorithm name.
    pub fn comp_algorithm(&self) -> String {
        self.state.read().settings.comp_algorithm.clone()
    }

    /// Testing hook for the model test's canary (`testing`): swaps the contents of two slots,
    /// corrupting the device on purpose. Never call it outside tests.
    #[cfg(any(test, feature = "testing"))]
    pub fn debug_swap_slots(&self, a: u64, b: u64) -> Result<()> {
        self.store()?.debug_swap_slots(a, b)
    }
}

impl BlockDevice for Device {
    fn size_bytes(&self) -> u64 {
        self.disksize_bytes()
    }
    fn page_size_bytes(&self) -> usize {
        self.page_size_bytes
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Device::read_at(self, buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        Device::write_at(self, buf, offset)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        Device::discard(self, offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        Device::write_zeroes(self, offset, len)
    }
    fn flush(&self) -> Result<()> {
        Device::flush(self)
    }
    fn read_bytes_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Device::read_bytes_at(self, buf, offset)
    }
    fn write_bytes_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        Device::write_bytes_at(self, buf, offset)
    }
    fn write_zeroes_bytes(&self, offset: u64, len: u64) -> Result<()> {
        Device::write_zeroes_bytes(self, offset, len)
    }
    fn allocation(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<crate::Extent>,
    ) -> Result<()> {
        Device::allocation(self, offset, len, max_extents, out)
    }
}
