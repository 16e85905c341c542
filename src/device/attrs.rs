//! Attributes with zram's sysfs names, write syntax, output formats and errnos.
//!
//! [`Device::attr_show`] is `cat /sys/block/zramN/NAME`; [`Device::attr_store`] is
//! `echo VALUE > /sys/block/zramN/NAME`. Values may carry the trailing newline `echo` adds.
//! Reading a write-only attribute or writing a read-only one is `EACCES`, as sysfs gives root;
//! an unknown name is `ENOENT`. See `docs/attributes.md` for each attribute.

use super::{Device, IdleCutoff};
use crate::backing::{FileBacking, FileOptions};
use crate::compress::{self, CodecParams};
use crate::error::{Error, ErrorKind, Result};
pub use crate::units::{kstrtobool, kstrtou64};
use crate::units::{parse_size_bytes, strip_newline};
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

/// Every attribute, with its mode, in the order `ls /sys/block/zram0` lists zram's.
pub const ATTRIBUTES: &[(&str, AttrMode)] = &[
    ("algorithm_params", AttrMode::WriteOnly),
    ("backing_dev", AttrMode::ReadWrite),
    ("backing_layout", AttrMode::ReadWrite),
    ("bd_stat", AttrMode::ReadOnly),
    ("comp_algorithm", AttrMode::ReadWrite),
    ("compact", AttrMode::WriteOnly),
    ("compressed_writeback", AttrMode::ReadWrite),
    ("debug_stat", AttrMode::ReadOnly),
    ("deferred_stat", AttrMode::ReadOnly),
    ("disksize", AttrMode::ReadWrite),
    ("gc", AttrMode::WriteOnly),
    ("idle", AttrMode::WriteOnly),
    ("initstate", AttrMode::ReadOnly),
    ("io_stat", AttrMode::ReadOnly),
    ("mem_limit", AttrMode::WriteOnly),
    ("mem_used_max", AttrMode::WriteOnly),
    ("meta_stat", AttrMode::ReadOnly),
    ("mm_stat", AttrMode::ReadOnly),
    ("reset", AttrMode::WriteOnly),
    ("writeback", AttrMode::WriteOnly),
    ("writeback_batch_size", AttrMode::ReadWrite),
    ("writeback_limit", AttrMode::ReadWrite),
    ("writeback_limit_enable", AttrMode::ReadWrite),
    ("zone_size", AttrMode::ReadWrite),
    ("zone_stat", AttrMode::ReadOnly),
];

fn mode_of(name: &str) -> Result<AttrMode> {
    ATTRIBUTES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, m)| *m)
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
        ATTRIBUTES.iter().map(|(n, _)| *n)
    }

    /// Shows an attribute, formatted as zram's sysfs file reads (with its trailing newline).
    pub fn attr_show(&self, name: &str) -> Result<String> {
        if mode_of(name)? == AttrMode::WriteOnly {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                format!("{name} is write-only"),
            ));
        }
        Ok(match name {
            "backing_dev" => format!("{}\n", self.backing_dev()),
            "backing_layout" => format!("{}\n", self.backing_layout().name()),
            "zone_size" => format!("{}\n", self.zone_size_bytes()),
            "zone_stat" => self.zone_stats().unwrap_or_default().to_line(),
            "bd_stat" => self.stats().bd_stat(),
            "compressed_writeback" => format!("{}\n", u8::from(self.compressed_writeback())),
            "writeback_batch_size" => format!("{}\n", self.writeback_batch_size()),
            "writeback_limit" => format!("{}\n", self.writeback_limit()),
            "writeback_limit_enable" => format!("{}\n", u8::from(self.writeback_limit_enable())),
            "comp_algorithm" => {
                let selected = self.comp_algorithm();
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
            "debug_stat" => self.stats().debug_stat(),
            "deferred_stat" => deferred_stat(&self.deferred_stats()),
            "disksize" => format!("{}\n", self.disksize_bytes()),
            "initstate" => format!("{}\n", u8::from(self.is_initialised())),
            "io_stat" => self.stats().io_stat(),
            "mm_stat" => self.stats().mm_stat(),
            "meta_stat" => self.meta_stats().meta_stat(),
            _ => unreachable!("every readable attribute is listed"),
        })
    }

    /// Stores an attribute, with zram's syntax and errnos.
    pub fn attr_store(&self, name: &str, value: &str) -> Result<()> {
        if mode_of(name)? == AttrMode::ReadOnly {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                format!("{name} is read-only"),
            ));
        }
        match name {
            "algorithm_params" => self.store_algorithm_params(value),
            "backing_dev" => {
                // As zram: refused once initialised before the path is even looked at.
                if self.is_initialised() {
                    return Err(Error::busy(
                        "backing_dev cannot change once initialised: reset first",
                    ));
                }
                let path = strip_newline(value);
                let backing = FileBacking::open(path, &FileOptions::default())?;
                self.set_backing(Arc::new(backing))
            }
            "compressed_writeback" => self.set_compressed_writeback(kstrtobool(value)?),
            "backing_layout" => {
                let layout = BackingLayout::parse(strip_newline(value).trim())?;
                self.set_backing_layout(layout)
            }
            "zone_size" => {
                if self.is_initialised() {
                    return Err(Error::busy(
                        "zone_size cannot change once initialised: reset first",
                    ));
                }
                self.set_zone_size_bytes(parse_size_bytes(value)?)
            }
            "gc" => {
                let v = kstrtou64(value, 10)
                    .map_err(|_| Error::invalid(format!("gc takes 1, not {value:?}")))?;
                if v != 1 {
                    return Err(Error::invalid(format!("gc takes 1, not {v}")));
                }
                self.gc().map(|_| ())
            }
            "writeback" => self.writeback_str(value),
            "writeback_batch_size" => {
                let v = kstrtou64(value, 10).map_err(|_| {
                    Error::invalid(format!(
                        "writeback_batch_size takes a number, not {value:?}"
                    ))
                })?;
                let v = u32::try_from(v)
                    .map_err(|_| Error::invalid("writeback_batch_size is a 32-bit number"))?;
                self.set_writeback_batch_size(v)
            }
            "writeback_limit" => {
                let v = kstrtou64(value, 10).map_err(|_| {
                    Error::invalid(format!("writeback_limit takes a number, not {value:?}"))
                })?;
                self.set_writeback_limit(v);
                Ok(())
            }
            "writeback_limit_enable" => {
                let v = kstrtou64(value, 10).map_err(|_| {
                    Error::invalid(format!(
                        "writeback_limit_enable takes 0 or 1, not {value:?}"
                    ))
                })?;
                self.set_writeback_limit_enable(v != 0);
                Ok(())
            }
            "comp_algorithm" => {
                let algo = strip_newline(value);
                if !compress::algorithms().contains(&algo) {
                    return Err(Error::invalid(format!("unknown algorithm {algo:?}")));
                }
                let mut st = self.settings_for("comp_algorithm")?;
                if st.settings.comp_algorithm != algo {
                    st.settings.comp_algorithm = algo.to_string();
                    st.settings.comp_params = CodecParams::default();
                }
                Ok(())
            }
            "compact" => {
                self.compact();
                Ok(())
            }
            "disksize" => {
                let size = parse_size_bytes(value)?;
                self.init(size)
            }
            "idle" => {
                let cutoff = if strip_newline(value) == "all" {
                    IdleCutoff::All
                } else {
                    IdleCutoff::OlderThanSecs(kstrtou64(value, 0).map_err(|_| {
                        Error::invalid(format!("idle takes \"all\" or seconds, not {value:?}"))
                    })?)
                };
                self.mark_idle(cutoff);
                Ok(())
            }
            "mem_limit" => {
                let limit = parse_size_bytes(value)?;
                self.set_mem_limit_bytes(limit);
                Ok(())
            }
            "mem_used_max" => {
                let v = kstrtou64(value, 10).map_err(|_| Error::invalid("mem_used_max takes 0"))?;
                if v != 0 {
                    return Err(Error::invalid("mem_used_max can only be reset with 0"));
                }
                self.reset_mem_used_max();
                Ok(())
            }
            "reset" => {
                let v = kstrtou64(value, 10)
                    .map_err(|e| Error::new(ErrorKind::InvalidArgument, e.message()))?;
                if v == 0 {
                    return Err(Error::invalid("reset takes a non-zero value"));
                }
                self.reset();
                Ok(())
            }
            _ => unreachable!("every writable attribute is listed"),
        }
    }

    /// `algorithm_params`: space-separated `key=value`: `algo=NAME` or `priority=N` selects
    /// the codec (default: the primary), `level=N` sets its level. Unknown keys are ignored, as
    /// in zram; a key without a value is `EINVAL`. Only before initialisation (`EBUSY`).
    fn store_algorithm_params(&self, value: &str) -> Result<()> {
        let mut prio: i64 = 0;
        let mut algo: Option<&str> = None;
        let mut level: Option<i32> = None;
        for tok in strip_newline(value).split_ascii_whitespace() {
            let Some((key, val)) = tok.split_once('=') else {
                return Err(Error::invalid(format!("{tok:?} is not key=value")));
            };
            if val.is_empty() {
                return Err(Error::invalid(format!("{key} has no value")));
            }
            match key {
                "priority" => {
                    prio = val
                        .parse()
                        .map_err(|_| Error::invalid(format!("bad priority {val:?}")))?
                }
                "level" => {
                    level = Some(
                        val.parse()
                            .map_err(|_| Error::invalid(format!("bad level {val:?}")))?,
                    )
                }
                "algo" => algo = Some(val),
                "dict" => {
                    return Err(Error::new(
                        ErrorKind::Unsupported,
                        "compression dictionaries are not supported",
                    ))
                }
                _ => {}
            }
        }
        let mut st = self.state.write();
        if let Some(a) = algo {
            // The priority of the codec with that name; only the primary (0) exists until
            // recompression algorithms are configured.
            prio = if st.settings.comp_algorithm == a {
                0
            } else {
                -1
            };
        }
        if prio != 0 {
            return Err(Error::invalid(
                "no such algorithm or priority (only the primary algorithm is configured)",
            ));
        }
        if st.store.is_some() {
            return Err(Error::busy(
                "algorithm_params cannot change once initialised",
            ));
        }
        let params = CodecParams { level };
        // Validate now, so a bad level fails here rather than at disksize.
        compress::new_codec(&st.settings.comp_algorithm, params)?;
        st.settings.comp_params = params;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(cols(&dev), [0; 5], "uninitialised");
        dev.attr_store("disksize", "16M").unwrap();
        let empty = cols(&dev);
        assert_eq!(empty[0], (16 << 20) / 4096 * 16, "slot table");
        assert_eq!(empty[1..4], [0, 0, 0], "{empty:?}");
        assert_eq!(
            empty[4],
            2 * (crate::zsmalloc::DEFERRED_FREE_BUDGET_BYTES / 4096) as u64 * 8,
            "the deferred-free queue: two buffers of 32768 entries of 8 bytes"
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
        assert_eq!(cols(&dev), [0; 5], "reset");
    }
}
