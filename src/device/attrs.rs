//! Attributes with zram's sysfs names, write syntax, output formats and errnos.
//!
//! [`Device::attr_show`] is `cat /sys/block/zramN/NAME`; [`Device::attr_store`] is
//! `echo VALUE > /sys/block/zramN/NAME`. Values may carry the trailing newline `echo` adds.
//! Reading a write-only attribute or writing a read-only one is `EACCES`, as sysfs gives root;
//! an unknown name is `ENOENT`. See `docs/attributes.md` for each attribute.

use super::{recompress, Device, IdleCutoff};
use crate::backing::{FileBacking, FileOptions, NbdBacking, NbdOptions};
use crate::compress::{self, CodecParams, MAX_COMPS};
use crate::error::{Error, ErrorKind, Result};
pub use crate::units::{kstrtobool, kstrtou64};
use crate::units::{memparse, parse_size_bytes, strip_newline};
use crate::writeback::BackingLayout;
use crate::zsmalloc::DeferredStats;
use std::sync::Arc;

/// How an attribute may be accessed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttrMode {
    /// `0444`.
    ReadOnly,
    /// `0200`.
    WriteOnly,
    /// `0644`.
    ReadWrite,
}

/// One attribute: its name, what reading it shows and what writing it does, declared together
/// as zram's `DEVICE_ATTR_RO`/`_WO`/`_RW` do. A missing `show` makes it write-only, a missing
/// `store` read-only. Each `store` returns zram's errno for bad input itself.
#[derive(Debug, Clone, Copy)]
pub struct Attr {
    /// The sysfs name.
    pub name: &'static str,
    /// Formats the value, with the trailing newline the kernel prints.
    show: Option<fn(&Device) -> String>,
    /// Formats the value or fails with zram's errno (`block_state` of an uninitialised device:
    /// `EINVAL`); an attribute has `show` or this, not both.
    try_show: Option<fn(&Device) -> Result<String>>,
    /// Parses and applies a value (which may carry `echo`'s trailing newline).
    store: Option<fn(&Device, &str) -> Result<()>>,
}

impl Attr {
    const fn ro(name: &'static str, show: fn(&Device) -> String) -> Attr {
        Attr {
            name,
            show: Some(show),
            try_show: None,
            store: None,
        }
    }

    const fn wo(name: &'static str, store: fn(&Device, &str) -> Result<()>) -> Attr {
        Attr {
            name,
            show: None,
            try_show: None,
            store: Some(store),
        }
    }

    const fn rw(
        name: &'static str,
        show: fn(&Device) -> String,
        store: fn(&Device, &str) -> Result<()>,
    ) -> Attr {
        Attr {
            name,
            show: Some(show),
            try_show: None,
            store: Some(store),
        }
    }

    const fn ro_try(name: &'static str, try_show: fn(&Device) -> Result<String>) -> Attr {
        Attr {
            name,
            show: None,
            try_show: Some(try_show),
            store: None,
        }
    }

    /// How it may be accessed.
    pub fn mode(&self) -> AttrMode {
        match (
            self.show.is_some() || self.try_show.is_some(),
            self.store.is_some(),
        ) {
            (true, false) => AttrMode::ReadOnly,
            (false, _) => AttrMode::WriteOnly,
            (true, true) => AttrMode::ReadWrite,
        }
    }
}

/// Every attribute, in the order `ls /sys/block/zram0` lists zram's.
pub const ATTRIBUTES: &[Attr] = &[
    Attr::wo("algorithm_params", Device::store_algorithm_params),
    Attr::rw(
        "backing_dev",
        |d| format!("{}\n", d.backing_dev()),
        store_backing_dev,
    ),
    Attr::rw(
        "backing_layout",
        |d| format!("{}\n", d.backing_layout().name()),
        |d, v| d.set_backing_layout(BackingLayout::parse(strip_newline(v).trim())?),
    ),
    Attr::ro("bd_checksum_errors", |d| d.stats().bd_checksum_errors()),
    Attr::ro("bd_stat", |d| d.stats().bd_stat()),
    // debugfs's /sys/kernel/debug/zram/zramN/block_state, as an attribute.
    Attr::ro_try("block_state", |d| Ok(d.store()?.block_state())),
    Attr::rw("comp_algorithm", show_comp_algorithm, store_comp_algorithm),
    Attr::wo("compact", |d, _| store_compact_with(d, &mut |_, _| {})),
    Attr::rw(
        "compressed_writeback",
        |d| format!("{}\n", u8::from(d.compressed_writeback())),
        |d, v| d.set_compressed_writeback(kstrtobool(v)?),
    ),
    Attr::ro("debug_stat", |d| d.stats().debug_stat()),
    Attr::ro("deferred_stat", |d| deferred_stat(&d.deferred_stats())),
    Attr::ro("dict_stat", recompress::show_dict_stat),
    Attr::rw(
        "disksize",
        |d| format!("{}\n", d.disksize_bytes()),
        |d, v| d.init(memparse(v)?),
    ),
    Attr::wo("gc", store_gc),
    Attr::wo("idle", store_idle),
    Attr::ro("initstate", |d| {
        format!("{}\n", u8::from(d.is_initialised()))
    }),
    Attr::ro("io_stat", |d| d.stats().io_stat()),
    Attr::wo("mem_limit", |d, v| {
        // The kernel's `buf == tmp` check: memparse must take at least one digit.
        if !v.as_bytes().first().is_some_and(u8::is_ascii_digit) {
            return Err(Error::invalid(format!("mem_limit: not a size: {v:?}")));
        }
        d.set_mem_limit_bytes(memparse(v)?);
        Ok(())
    }),
    Attr::wo("mem_used_max", store_mem_used_max),
    Attr::ro("meta_stat", |d| d.meta_stats().meta_stat()),
    Attr::ro("mm_stat", |d| d.stats().mm_stat()),
    Attr::rw(
        "multi_page_size",
        |d| format!("{}\n", d.multi_page_size_bytes()),
        store_multi_page_size,
    ),
    Attr::ro("multi_stat", |d| {
        let s = d.stats();
        format!(
            "{:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}\n",
            s.multi_objects,
            s.multi_pages,
            s.multi_wb_objects,
            s.multi_wb_pages,
            s.multi_wb_blocks,
            s.group_cache_hits,
            s.group_cache_misses
        )
    }),
    Attr::rw(
        "recomp_algorithm",
        recompress::show_recomp_algorithm,
        recompress::store_recomp_algorithm,
    ),
    Attr::ro("recomp_stat", recompress::show_recomp_stat),
    Attr::wo("recompress", Device::recompress_str),
    Attr::wo("reset", store_reset),
    // The block layer's /sys/block/zramN/stat, as an attribute (LTP's zram03 reads it).
    Attr::ro("stat", |d| d.block_stat.stat()),
    Attr::wo("train_dict", recompress::store_train_dict),
    Attr::wo("writeback", Device::writeback_str),
    Attr::rw(
        "writeback_batch_size",
        |d| format!("{}\n", d.writeback_batch_size()),
        store_writeback_batch_size,
    ),
    // `compressed_writeback`'s name while it was merged (kernel 6.19 rc), kept as an alias.
    Attr::rw(
        "writeback_compressed",
        |d| format!("{}\n", u8::from(d.compressed_writeback())),
        |d, v| d.set_compressed_writeback(kstrtobool(v)?),
    ),
    Attr::rw(
        "writeback_limit",
        |d| format!("{}\n", d.writeback_limit()),
        store_writeback_limit,
    ),
    Attr::rw(
        "writeback_limit_enable",
        |d| format!("{}\n", u8::from(d.writeback_limit_enable())),
        store_writeback_limit_enable,
    ),
    Attr::rw(
        "zone_size",
        |d| format!("{}\n", d.zone_size_bytes()),
        store_zone_size,
    ),
    Attr::ro("zone_stat", |d| {
        d.zone_stats().unwrap_or_default().to_line()
    }),
];

/// The attribute `name`; `ENOENT` if there is none.
fn attr(name: &str) -> Result<&'static Attr> {
    ATTRIBUTES
        .iter()
        .find(|a| a.name == name)
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("no attribute {name:?}")))
}

/// `deferred_stat` (uzram's own, no kernel counterpart): the allocator's deferred-free queue,
/// eight `%8llu` columns: `queued fallback_contended fallback_full drains drained pending
/// wakeups capacity`. See `docs/attributes.md`.
pub fn deferred_stat(s: &DeferredStats) -> String {
    format!(
        "{:8} {:8} {:8} {:8} {:8} {:8} {:8} {:8}\n",
        s.queued,
        s.fallback_contended,
        s.fallback_full,
        s.drains,
        s.drained,
        s.pending,
        s.wakeups,
        s.capacity
    )
}

impl Device {
    /// The names of every attribute this device has.
    pub fn attr_names(&self) -> impl Iterator<Item = &'static str> {
        ATTRIBUTES.iter().map(|a| a.name)
    }

    /// Shows an attribute, formatted as zram's sysfs file reads (with its trailing newline).
    pub fn attr_show(&self, name: &str) -> Result<String> {
        let a = attr(name)?;
        if let Some(try_show) = a.try_show {
            return try_show(self);
        }
        let show = a.show.ok_or_else(|| {
            Error::new(ErrorKind::PermissionDenied, format!("{name} is write-only"))
        })?;
        Ok(show(self))
    }

    /// Stores an attribute, with zram's syntax and errnos.
    pub fn attr_store(&self, name: &str, value: &str) -> Result<()> {
        let store = attr(name)?.store.ok_or_else(|| {
            Error::new(ErrorKind::PermissionDenied, format!("{name} is read-only"))
        })?;
        store(self, value)
    }

    /// `algorithm_params`: space-separated `key=value`: `algo=NAME` or `priority=N` selects
    /// the codec (default: the primary, priority 0; `algo` the first priority with that
    /// algorithm), `level=N` sets its level, `dict=PATH` loads a dictionary (zstd; `EINVAL` for
    /// a file that cannot be read, is empty, too large or corrupt; `EOPNOTSUPP` for other
    /// algorithms), `deflate.winbits=N` deflate's window (only 15,
    /// the one uzram's deflate uses, is accepted: anything else is `EOPNOTSUPP`, never
    /// ignored). The priority's parameters are replaced as a whole, as the kernel's
    /// `comp_params_store` does. Unknown keys are ignored, as in zram; a key without a value,
    /// a bad number, a priority outside 0..=3 or without an algorithm, or a level the
    /// algorithm refuses is `EINVAL`. Accepted after initialisation too, as the kernel accepts
    /// it: kept for the next `disksize`, which only comes after a `reset`, which clears
    /// parameters; so it changes nothing then, in both.
    fn store_algorithm_params(&self, value: &str) -> Result<()> {
        let mut prio: i64 = 0;
        let mut algo: Option<&str> = None;
        let mut level: Option<i32> = None;
        let mut winbits: Option<i32> = None;
        let mut dict_path: Option<&str> = None;
        for tok in strip_newline(value).split_ascii_whitespace() {
            let Some((key, val)) = tok.split_once('=') else {
                return Err(Error::invalid(format!("{tok:?} is not key=value")));
            };
            if val.is_empty() {
                return Err(Error::invalid(format!("{key} has no value")));
            }
            let int = |what: &str| {
                val.parse::<i32>()
                    .map_err(|_| Error::invalid(format!("bad {what} {val:?}")))
            };
            match key {
                "priority" => prio = int("priority")?.into(),
                "level" => level = Some(int("level")?),
                "deflate.winbits" => winbits = Some(int("deflate.winbits")?),
                "algo" => algo = Some(val),
                "dict" => dict_path = Some(val),
                _ => {}
            }
        }
        // Read before taking the init lock: file I/O must not hold up requests.
        let dict = match dict_path {
            Some(path) => Some(compress::Dictionary::load(std::path::Path::new(path))?),
            None => None,
        };
        let mut st = self.state.write();
        let configured = |st: &super::State, p: usize| -> Option<String> {
            if p == 0 {
                Some(st.settings.comp_algorithm.clone())
            } else {
                st.settings.recomp_algorithms.get(p)?.clone()
            }
        };
        let prio = match algo {
            Some(a) => (0..MAX_COMPS)
                .find(|&p| configured(&st, p).as_deref() == Some(a))
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "algorithm_params: {a} is neither comp_algorithm nor a recomp_algorithm"
                    ))
                })?,
            None => usize::try_from(prio)
                .ok()
                .filter(|&p| p < MAX_COMPS)
                .ok_or_else(|| {
                    Error::invalid(format!("algorithm_params: priority {prio} outside 0..=3"))
                })?,
        };
        let Some(alg) = configured(&st, prio) else {
            return Err(Error::invalid(format!(
                "algorithm_params: no algorithm at priority {prio} (set recomp_algorithm first)"
            )));
        };
        if let Some(w) = winbits {
            if alg != "deflate" {
                return Err(Error::invalid(format!(
                    "algorithm_params: deflate.winbits is for deflate, not {alg}"
                )));
            }
            if w != compress::DEFLATE_WINBITS {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "algorithm_params: deflate.winbits={w}: uzram's deflate uses a window of \
                         {} bits only",
                        compress::DEFLATE_WINBITS
                    ),
                ));
            }
        }
        let params = CodecParams { level, dict };
        // Validate now, so a bad level or dictionary fails here rather than at disksize.
        compress::new_codec(&alg, params.clone())?;
        if prio == 0 {
            st.settings.comp_params = params;
        } else {
            st.settings.recomp_params[prio] = params;
        }
        Ok(())
    }
}

/// Every algorithm, `selected` in brackets, each followed by a space, then a newline (the
/// kernel's `zcomp_available_show`).
pub(super) fn algorithm_list(selected: &str) -> String {
    let mut out = String::new();
    for a in compress::algorithms() {
        if *a == selected {
            out.push_str(&format!("[{a}] "));
        } else {
            out.push_str(&format!("{a} "));
        }
    }
    out.push('\n');
    out
}

/// `comp_algorithm`: every algorithm, the selected one in brackets.
fn show_comp_algorithm(d: &Device) -> String {
    algorithm_list(&d.comp_algorithm())
}

/// `comp_algorithm`: `EINVAL` for a name uzram does not have (the message lists those it
/// has), `EBUSY` once initialised. The parameters set by `algorithm_params` are kept, as the
/// kernel keeps them; a level the new algorithm refuses fails `disksize` with `EINVAL`.
fn store_comp_algorithm(d: &Device, value: &str) -> Result<()> {
    let algo = strip_newline(value);
    compress::check_algorithm(algo)?;
    let mut st = d.settings_for("comp_algorithm")?;
    st.settings.comp_algorithm = algo.to_string();
    Ok(())
}

/// `backing_dev`: a path, opened as a [`FileBacking`], or an NBD URI (`nbd://HOST[:PORT]/EXPORT`,
/// `nbd+unix:///EXPORT?socket=PATH`), connected as an [`NbdBacking`]. As zram: refused with `EBUSY` once
/// initialised before the path is even looked at.
fn store_backing_dev(d: &Device, value: &str) -> Result<()> {
    if d.is_initialised() {
        return Err(Error::busy(
            "backing_dev cannot change once initialised: reset first",
        ));
    }
    d.set_backing(open_backing_dev(strip_newline(value))?)
}

/// Opens what `backing_dev` names: an NBD URI, else a file or block device path.
pub(crate) fn open_backing_dev(value: &str) -> Result<Arc<dyn crate::backing::Backing>> {
    if crate::backing::nbd::uri::is_nbd_uri(value) {
        return Ok(Arc::new(NbdBacking::open(value, &NbdOptions::default())?));
    }
    Ok(Arc::new(FileBacking::open(value, &FileOptions::default())?))
}

/// `zone_size`: a size with zram's suffixes; `EBUSY` once initialised (checked first).
fn store_zone_size(d: &Device, value: &str) -> Result<()> {
    if d.is_initialised() {
        return Err(Error::busy(
            "zone_size cannot change once initialised: reset first",
        ));
    }
    d.set_zone_size_bytes(parse_size_bytes(value)?)
}

/// `multi_page_size`: a size with zram's suffixes (4096 = off, 16K, 32K, 64K); `EBUSY` once
/// initialised (checked first), `EINVAL` for another size.
fn store_multi_page_size(d: &Device, value: &str) -> Result<()> {
    if d.is_initialised() {
        return Err(Error::busy(
            "multi_page_size cannot change once initialised: reset first",
        ));
    }
    let bytes = parse_size_bytes(value)?;
    d.set_multi_page_size_bytes(usize::try_from(bytes).unwrap_or(usize::MAX))
}

/// `gc`: takes `1` only.
fn store_gc(d: &Device, value: &str) -> Result<()> {
    store_gc_with(d, value, &mut |_, _| {})
}

/// `gc`, calling `progress(reclaimed, victims)` (see `ZoneStore::gc_with_progress`).
pub(super) fn store_gc_with(
    d: &Device,
    value: &str,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let v =
        kstrtou64(value, 10).map_err(|_| Error::invalid(format!("gc takes 1, not {value:?}")))?;
    if v != 1 {
        return Err(Error::invalid(format!("gc takes 1, not {v}")));
    }
    d.store()?.gc_with_progress(progress).map(|_| ())
}

/// `compact` (any value, as zram), calling `progress(freed, estimate)` (see
/// `PoolCore::compact_with_progress`). `EINVAL` uninitialised.
pub(super) fn store_compact_with(d: &Device, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
    if !d.is_initialised() {
        return Err(Error::invalid("compact: the device is not initialised"));
    }
    if let Ok(store) = d.store() {
        store.compact_with_progress(progress);
    }
    Ok(())
}

/// `idle`: `all` or an age in seconds (`kstrtoull` with base detection).
fn store_idle(d: &Device, value: &str) -> Result<()> {
    if !d.is_initialised() {
        return Err(Error::invalid("idle: the device is not initialised"));
    }
    let cutoff =
        if strip_newline(value) == "all" {
            IdleCutoff::All
        } else {
            IdleCutoff::OlderThanSecs(kstrtou64(value, 0).map_err(|_| {
                Error::invalid(format!("idle takes \"all\" or seconds, not {value:?}"))
            })?)
        };
    d.mark_idle(cutoff);
    Ok(())
}

/// `mem_used_max`: only `0`, which resets it to the current pool size.
fn store_mem_used_max(d: &Device, value: &str) -> Result<()> {
    let v = kstrtou64(value, 10).map_err(|_| Error::invalid("mem_used_max takes 0"))?;
    if v != 0 {
        return Err(Error::invalid("mem_used_max can only be reset with 0"));
    }
    d.reset_mem_used_max();
    Ok(())
}

/// `reset`: any non-zero number.
fn store_reset(d: &Device, value: &str) -> Result<()> {
    let v =
        kstrtou64(value, 10).map_err(|e| Error::new(ErrorKind::InvalidArgument, e.message()))?;
    if v == 0 {
        return Err(Error::invalid("reset takes a non-zero value"));
    }
    d.reset();
    Ok(())
}

/// `writeback_batch_size`: a 32-bit number of at least 1.
fn store_writeback_batch_size(d: &Device, value: &str) -> Result<()> {
    let v = kstrtou64(value, 10).map_err(|_| {
        Error::invalid(format!(
            "writeback_batch_size takes a number, not {value:?}"
        ))
    })?;
    let v =
        u32::try_from(v).map_err(|_| Error::invalid("writeback_batch_size is a 32-bit number"))?;
    d.set_writeback_batch_size(v)
}

/// `writeback_limit`: the remaining budget in 4 KiB units.
fn store_writeback_limit(d: &Device, value: &str) -> Result<()> {
    let v = kstrtou64(value, 10)
        .map_err(|_| Error::invalid(format!("writeback_limit takes a number, not {value:?}")))?;
    d.set_writeback_limit(v);
    Ok(())
}

/// `writeback_limit_enable`: a number, non-zero enables.
fn store_writeback_limit_enable(d: &Device, value: &str) -> Result<()> {
    let v = kstrtou64(value, 10).map_err(|_| {
        Error::invalid(format!(
            "writeback_limit_enable takes 0 or 1, not {value:?}"
        ))
    })?;
    d.set_writeback_limit_enable(v != 0);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_attribute_is_declared_once_in_ls_order() {
        let names: Vec<&str> = ATTRIBUTES.iter().map(|a| a.name).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(names, sorted);
        let dev = Device::new_uninit(4096).unwrap();
        for a in ATTRIBUTES {
            let shown = dev.attr_show(a.name);
            let stored = dev.attr_store(a.name, "");
            let denied = |r: Result<()>| r.is_err_and(|e| e.kind() == ErrorKind::PermissionDenied);
            match a.mode() {
                AttrMode::ReadOnly => {
                    // `block_state` is EINVAL until initialised, as the kernel's.
                    let einval = |r: &Result<String>| {
                        r.as_ref()
                            .is_err_and(|e| e.kind() == ErrorKind::InvalidArgument)
                    };
                    let ok = shown.is_ok() || (a.try_show.is_some() && einval(&shown));
                    assert!(ok && denied(stored), "{}", a.name);
                }
                AttrMode::WriteOnly => {
                    assert!(denied(shown.map(|_| ())), "{}", a.name);
                }
                AttrMode::ReadWrite => assert!(shown.is_ok(), "{}", a.name),
            }
        }
        assert_eq!(
            dev.attr_show("no_such").unwrap_err().kind(),
            ErrorKind::NotFound
        );
    }

    #[test]
    fn deferred_stat_format() {
        assert_eq!(
            deferred_stat(&DeferredStats::default()),
            "       0        0        0        0        0        0        0        0\n"
        );
        let s = DeferredStats {
            queued: 40000,
            fallback_contended: 3,
            fallback_full: 7,
            drains: 2,
            drained: 39990,
            pending: 10,
            wakeups: 2,
            capacity: 32768,
        };
        assert_eq!(
            deferred_stat(&s),
            "   40000        3        7        2    39990       10        2    32768\n"
        );
    }

    /// `meta_stat` follows the device's bookkeeping: the slot table from `disksize`, the
    /// allocator's tables as objects come, its zspage slot tables and frame cache as they go.
    #[test]
    fn meta_stat_follows_the_device() {
        let cols = |dev: &Device| -> Vec<u64> {
            let text = dev.attr_show("meta_stat").unwrap();
            assert!(text.ends_with('\n'));
            text.split_whitespace()
                .map(|c| c.parse().unwrap())
                .collect()
        };
        let dev = Device::new_uninit(4096).unwrap();
        assert_eq!(cols(&dev), [0; 8], "uninitialised");
        dev.attr_store("disksize", "16M").unwrap();
        let empty = cols(&dev);
        assert_eq!(
            empty[0],
            (16 << 20) / 4096 * 16 + 32768,
            "slot table and its journal"
        );
        assert_eq!(empty[1..4], [0, 0, 0], "{empty:?}");
        let resting = (crate::zsmalloc::DEFERRED_FREE_BUDGET_BYTES / 4096) as u64 * 4;
        assert!(
            (resting..resting + 32 * 64).contains(&empty[4]),
            "the deferred-free queue: 32 resting blocks of 1024 slots of 4 bytes: {}",
            empty[4]
        );
        // 2000 pages of mixed compressibility: many zspages in several classes.
        let mut page = vec![0u8; 4096];
        for i in 0..2000u64 {
            let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            for (j, b) in page.iter_mut().enumerate() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = if j % 4096 < (i as usize % 7 + 1) * 500 {
                    x as u8
                } else {
                    b'a'
                };
            }
            crate::BlockDevice::write_at(&dev, &page, i * 4096).unwrap();
        }
        let full = cols(&dev);
        assert_eq!(full[0], empty[0]);
        assert!(full[1] >= 2000 * 8, "handle table {full:?}");
        // Counted: the zspages' slot tables, 4 bytes per object slot.
        let slots: u64 = dev
            .pool_stats()
            .unwrap()
            .classes
            .iter()
            .map(|c| c.objs_allocated)
            .sum();
        assert!(
            slots >= 2000 && full[2] >= slots * 4,
            "{slots} slots: {full:?}"
        );
        // Everything freed: the zspages' slot tables go, the tables that never shrink stay.
        crate::BlockDevice::discard(&dev, 0, 16 << 20).unwrap();
        dev.attr_store("compact", "1").unwrap();
        assert_eq!(dev.stats().mem_used_total_bytes, 0);
        let after = cols(&dev);
        assert_eq!(after[1], full[1], "the handle table never shrinks");
        assert_eq!(after[3], 0, "compaction empties the frame cache");
        dev.attr_store("reset", "1").unwrap();
        assert_eq!(cols(&dev), [0; 8], "reset");

        // Serving swap: the server's reserve in the last three columns, none in frame_cache;
        // pages stored from it read back.
        let reserve = crate::memory::SwapReserve::new(4 << 20).unwrap();
        let dev = Device::new_uninit(4096).unwrap();
        dev.set_swap_reserve(Some(Arc::clone(&reserve))).unwrap();
        dev.attr_store("disksize", "16M").unwrap();
        assert_eq!(
            dev.set_swap_reserve(None).unwrap_err().kind(),
            ErrorKind::Busy
        );
        let c = cols(&dev);
        assert_eq!(c[3], 0, "{c:?}");
        assert!(c[5] > 0 && c[5] <= 4 << 20, "held {c:?}");
        assert_eq!(c[6], 4 << 20, "size {c:?}");
        for i in 0..64u64 {
            page.fill(i as u8 + 1);
            page[..8].copy_from_slice(&(i * 7919).to_le_bytes());
            crate::BlockDevice::write_at(&dev, &page, i * 4096).unwrap();
        }
        let mut back = vec![0u8; 4096];
        for i in 0..64u64 {
            crate::BlockDevice::read_at(&dev, &mut back, i * 4096).unwrap();
            assert_eq!(back[..8], (i * 7919).to_le_bytes());
            assert!(back[8..].iter().all(|&b| b == i as u8 + 1));
        }
        assert!(reserve.stats().taken_pages > 0, "{:?}", reserve.stats());
    }
}
