//! Metrics: every device's statistics in the Prometheus text exposition format (version 0.0.4),
//! for `uzram ctl metrics` and for `uzram serve --metrics-listen` ([`http`]).
//!
//! The figures are read from the attribute files, exactly as `cat` (or `uzram ctl`) reads them:
//! [`collect`] takes a reader of attributes, so the control socket's client and the server's
//! own devices give the same text, and each value is the attribute's column, scaled only where
//! the unit in the name says so (`bd_stat` and `writeback_limit` count 4 KiB units and are
//! shown in bytes). Names are `uzram_` then zram's column name then the unit (`_bytes`,
//! `_pages`); counters end in `_total`. Every sample carries a `device` label. An attribute a
//! device does not have (`ENOENT`) gives no samples; [`METRICS`] lists them all and
//! `docs/metrics.md` documents them.
//!
//! The server's policies (`policy_stat`, [`crate::policy`]) give [`POLICY_METRICS`]: one
//! sample per device and policy, labelled `device` and `policy`.
//!
//! Families are written whole (`# HELP`, `# TYPE`, then one sample per device), as the format
//! requires: a family's samples must not be split.

pub mod http;

use super::control::{NBD_CONNECTIONS_ATTR, POLICY_STAT_ATTR};
use super::nbd::Openers;
use crate::policy::DevicePolicy;
use uzram::device::Device;
use uzram::error::{Error, ErrorKind, Result};

/// A family's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// A value that goes up and down.
    Gauge,
    /// A count that only goes up (until `reset`).
    Counter,
}

impl MetricKind {
    fn name(self) -> &'static str {
        match self {
            MetricKind::Gauge => "gauge",
            MetricKind::Counter => "counter",
        }
    }
}

/// One metric family, read from column `column` (of the whitespace-separated words) of the
/// attribute `attr`, multiplied by `scale`.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    /// The family's name.
    pub name: &'static str,
    /// Gauge or counter.
    pub kind: MetricKind,
    /// The attribute it is read from.
    pub attr: &'static str,
    /// The word of the attribute's text (0-based).
    pub column: usize,
    /// What a unit of the column is worth in the name's unit (4096 for zram's "4K units").
    pub scale: u64,
    /// `# HELP`.
    pub help: &'static str,
}

const fn m(
    name: &'static str,
    kind: MetricKind,
    attr: &'static str,
    column: usize,
    scale: u64,
    help: &'static str,
) -> Metric {
    Metric {
        name,
        kind,
        attr,
        column,
        scale,
        help,
    }
}

use MetricKind::{Counter, Gauge};

/// zram's unit of `bd_stat` and `writeback_limit`.
const FOUR_K: u64 = uzram::units::BLOCK_SIZE_BYTES as u64;

/// Every family, in the order they are written.
pub const METRICS: &[Metric] = &[
    m("uzram_disksize_bytes", Gauge, "disksize", 0, 1, "Device size (disksize); 0 when uninitialised."),
    m("uzram_initstate", Gauge, "initstate", 0, 1, "1 when the device is initialised (initstate)."),
    // mm_stat
    m("uzram_orig_data_size_bytes", Gauge, "mm_stat", 0, 1, "Uncompressed size of the data stored (mm_stat orig_data_size)."),
    m("uzram_compr_data_size_bytes", Gauge, "mm_stat", 1, 1, "Compressed size of the data stored (mm_stat compr_data_size)."),
    m("uzram_mem_used_total_bytes", Gauge, "mm_stat", 2, 1, "Memory held by the allocator, fragmentation included (mm_stat mem_used_total)."),
    m("uzram_mem_limit_bytes", Gauge, "mm_stat", 3, 1, "Limit on mem_used_total, 0 for none (mm_stat mem_limit)."),
    m("uzram_mem_used_max_bytes", Gauge, "mm_stat", 4, 1, "Highest mem_used_total seen (mm_stat mem_used_max)."),
    m("uzram_same_pages", Gauge, "mm_stat", 5, 1, "Same-filled pages, stored without memory (mm_stat same_pages)."),
    m("uzram_pages_compacted_total", Counter, "mm_stat", 6, 1, "Pages freed by compaction (mm_stat pages_compacted)."),
    m("uzram_huge_pages", Gauge, "mm_stat", 7, 1, "Pages stored uncompressed (mm_stat huge_pages)."),
    m("uzram_huge_pages_since_total", Counter, "mm_stat", 8, 1, "Pages stored uncompressed since initialisation (mm_stat huge_pages_since)."),
    // io_stat (its third column is always 0)
    m("uzram_failed_reads_total", Counter, "io_stat", 0, 1, "Reads that failed (io_stat failed_reads)."),
    m("uzram_failed_writes_total", Counter, "io_stat", 1, 1, "Writes that failed (io_stat failed_writes)."),
    m("uzram_notify_free_total", Counter, "io_stat", 3, 1, "Pages released by discard, write-zeroes or free notification (io_stat notify_free)."),
    // debug_stat: "version: 1\n0 %8llu\n"
    m("uzram_miss_free_total", Counter, "debug_stat", 3, 1, "Free notifications that found the slot locked (debug_stat miss_free)."),
    // bd_stat, in 4 KiB units
    m("uzram_bd_count_bytes", Gauge, "bd_stat", 0, FOUR_K, "Backing device space in use (bd_stat bd_count)."),
    m("uzram_bd_reads_bytes_total", Counter, "bd_stat", 1, FOUR_K, "Bytes read back from the backing device (bd_stat bd_reads)."),
    m("uzram_bd_writes_bytes_total", Counter, "bd_stat", 2, FOUR_K, "Bytes written to the backing device (bd_stat bd_writes)."),
    m("uzram_bd_checksum_errors_total", Counter, "bd_checksum_errors", 0, 1, "Backing reads whose data failed verification (bd_checksum_errors)."),
    m("uzram_writeback_limit_bytes", Gauge, "writeback_limit", 0, FOUR_K, "Remaining writeback budget (writeback_limit)."),
    m("uzram_writeback_limit_enable", Gauge, "writeback_limit_enable", 0, 1, "1 when the writeback budget is enforced (writeback_limit_enable)."),
    // recomp_stat
    m("uzram_recomp_tried_pages_total", Counter, "recomp_stat", 0, 1, "Pages recompression tried a secondary algorithm on (recomp_stat tried)."),
    m("uzram_recomp_recompressed_pages_total", Counter, "recomp_stat", 1, 1, "Pages recompression replaced with a smaller object (recomp_stat recompressed)."),
    m("uzram_recomp_incompressible_pages_total", Counter, "recomp_stat", 2, 1, "Pages recompression marked incompressible (recomp_stat incompressible)."),
    // multi_stat
    m("uzram_multi_objects", Gauge, "multi_stat", 0, 1, "Multi-page objects stored (multi_stat objects)."),
    m("uzram_multi_pages", Gauge, "multi_stat", 1, 1, "Pages pointing into multi-page objects (multi_stat pages)."),
    // deferred_stat
    m("uzram_deferred_queued_total", Counter, "deferred_stat", 0, 1, "Objects put in the deferred-free queue (deferred_stat queued)."),
    m("uzram_deferred_fallback_contended_total", Counter, "deferred_stat", 1, 1, "Objects freed at once because the queue's lock was busy (deferred_stat fallback_contended)."),
    m("uzram_deferred_fallback_full_total", Counter, "deferred_stat", 2, 1, "Objects freed at once because the queue was full (deferred_stat fallback_full)."),
    m("uzram_deferred_drains_total", Counter, "deferred_stat", 3, 1, "Drain passes that freed at least one object (deferred_stat drains)."),
    m("uzram_deferred_drained_total", Counter, "deferred_stat", 4, 1, "Objects freed by drains (deferred_stat drained)."),
    m("uzram_deferred_pending", Gauge, "deferred_stat", 5, 1, "Objects queued and not yet freed (deferred_stat pending)."),
    m("uzram_deferred_wakeups_total", Counter, "deferred_stat", 6, 1, "Times the queue woke its worker (deferred_stat wakeups)."),
    m("uzram_deferred_capacity", Gauge, "deferred_stat", 7, 1, "The deferred-free queue's size in objects (deferred_stat capacity)."),
    // meta_stat
    m("uzram_meta_slot_table_bytes", Gauge, "meta_stat", 0, 1, "The slot table's reservation (meta_stat slot_table)."),
    m("uzram_meta_handle_table_bytes", Gauge, "meta_stat", 1, 1, "The allocator's handle table (meta_stat handle_table)."),
    m("uzram_meta_zspage_meta_bytes", Gauge, "meta_stat", 2, 1, "The allocator's bookkeeping (meta_stat zspage_meta)."),
    m("uzram_meta_frame_cache_bytes", Gauge, "meta_stat", 3, 1, "Pages of freed zspages kept for reuse (meta_stat frame_cache)."),
    m("uzram_meta_deferred_queue_bytes", Gauge, "meta_stat", 4, 1, "The deferred-free queue's buffers (meta_stat deferred_queue)."),
    m("uzram_swap_reserve_bytes", Gauge, "meta_stat", 5, 1, "The server's swap reserve held now, the same for every device (meta_stat swap_reserve)."),
    m("uzram_swap_reserve_size_bytes", Gauge, "meta_stat", 6, 1, "The server's swap reserve's size, --swap-reserve (meta_stat swap_reserve_size)."),
    m("uzram_swap_reserve_misses_total", Counter, "meta_stat", 7, 1, "New zspages of any device the swap reserve had no frame for at once; each writer waited for the refiller (0.1 s at most) and failed if none came (meta_stat swap_reserve_misses)."),
    // zone_stat
    m("uzram_zones_empty", Gauge, "zone_stat", 0, 1, "Zones of the zoned store with nothing in them (zone_stat empty)."),
    m("uzram_zones_open", Gauge, "zone_stat", 1, 1, "Zones being appended to (zone_stat open)."),
    m("uzram_zones_full", Gauge, "zone_stat", 2, 1, "Zones closed for appends, waiting for GC (zone_stat full)."),
    m("uzram_zone_live_bytes", Gauge, "zone_stat", 3, 1, "Bytes of live records in the zoned store (zone_stat live_bytes)."),
    m("uzram_zone_writeback_bytes_total", Counter, "zone_stat", 4, 1, "Bytes writeback wrote to the zoned store (zone_stat writeback_bytes)."),
    m("uzram_zone_gc_runs_total", Counter, "zone_stat", 5, 1, "Zones GC reclaimed (zone_stat gc_runs)."),
    m("uzram_zone_gc_relocated_bytes_total", Counter, "zone_stat", 6, 1, "Bytes of live records GC moved (zone_stat gc_bytes_relocated)."),
    m("uzram_zone_gc_written_bytes_total", Counter, "zone_stat", 7, 1, "Bytes GC wrote (zone_stat gc_bytes_written)."),
    m("uzram_zone_write_amplification_ratio", Gauge, "zone_stat", 8, 1, "(writeback_bytes + gc_bytes_written) / writeback_bytes (zone_stat write_amplification)."),
    // The NBD frontend's (the control socket's `nbd_connections`).
    m("uzram_nbd_connections", Gauge, NBD_CONNECTIONS_ATTR, 0, 1, "NBD connections using the device now."),
];

/// The families of `policy_stat` (a line per policy: name, `on`/`off`, runs, pages, errors,
/// last error): each sample labelled `device` and `policy`; `column` is the word of the
/// policy's line (1: `on` as 1, `off` as 0).
pub const POLICY_METRICS: &[Metric] = &[
    m("uzram_policy_enabled", Gauge, POLICY_STAT_ATTR, 1, 1, "1 when the policy is on (policy_stat on/off)."),
    m("uzram_policy_runs_total", Counter, POLICY_STAT_ATTR, 2, 1, "Times the policy acted, failed runs included (policy_stat runs)."),
    m("uzram_policy_pages_total", Counter, POLICY_STAT_ATTR, 3, 1, "Pages the policy acted on: idle after aging, written back, recompressed smaller, freed by compaction, relocated by GC in 4 KiB units (policy_stat pages)."),
    m("uzram_policy_errors_total", Counter, POLICY_STAT_ATTR, 4, 1, "Runs of the policy that failed (policy_stat errors)."),
];

/// One policy's line of `policy_stat`, as [`POLICY_METRICS`] samples it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySample {
    /// The policy's name (the `policy` label).
    pub policy: String,
    /// One per [`POLICY_METRICS`] entry.
    pub values: [u64; 4],
}

/// The family of settings shown as labels: `uzram_device_info{device, comp_algorithm,
/// backing_dev, backing_layout} 1`.
pub const INFO_METRIC: &str = "uzram_device_info";

/// One device's samples: its name, the value of each [`METRICS`] entry (`None` when the device
/// lacks the attribute), and its settings for [`INFO_METRIC`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSamples {
    /// The device's name (the `device` label).
    pub device: String,
    /// One per [`METRICS`] entry, as text (an integer, or `write_amplification`'s decimal).
    pub values: Vec<Option<String>>,
    /// (label, value) pairs of [`INFO_METRIC`].
    pub info: Vec<(&'static str, String)>,
    /// The lines of `policy_stat` (none when the device has no policies).
    pub policies: Vec<PolicySample>,
}

/// Parses `policy_stat` (see [`POLICY_METRICS`]); malformed text is `EIO`.
fn parse_policy_stat(device: &str, text: &str) -> Result<Vec<PolicySample>> {
    let bad = |line: &str| {
        Error::new(
            ErrorKind::Io,
            format!("{device}: {POLICY_STAT_ATTR}: malformed line {line:?}"),
        )
    };
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let words: Vec<&str> = line.split_whitespace().take(5).collect();
        let [policy, state, runs, pages, errors] = words[..] else {
            return Err(bad(line));
        };
        let on = match state {
            "on" => 1,
            "off" => 0,
            _ => return Err(bad(line)),
        };
        let n = |w: &str| w.parse::<u64>().map_err(|_| bad(line));
        out.push(PolicySample {
            policy: policy.to_string(),
            values: [on, n(runs)?, n(pages)?, n(errors)?],
        });
    }
    Ok(out)
}

/// Reads one attribute: `Ok(Some(text))`, `Ok(None)` if the device has no such attribute.
pub type AttrReader<'a> = dyn FnMut(&str) -> Result<Option<String>> + 'a;

/// Reads the attributes of `device` through `read` and takes every metric from them.
/// Malformed attribute text is `EIO` naming the attribute (it cannot happen with uzram's own).
pub fn collect(device: &str, read: &mut AttrReader) -> Result<DeviceSamples> {
    let mut texts: Vec<(&'static str, Option<String>)> = Vec::new();
    let mut values = Vec::with_capacity(METRICS.len());
    for metric in METRICS {
        let text = match texts.iter().find(|(a, _)| *a == metric.attr) {
            Some((_, t)) => t.clone(),
            None => {
                let t = read(metric.attr)?;
                texts.push((metric.attr, t.clone()));
                t
            }
        };
        let Some(text) = text else {
            values.push(None);
            continue;
        };
        let bad = |why: &str| {
            Error::new(
                ErrorKind::Io,
                format!("{device}: {}: {why} in {text:?}", metric.attr),
            )
        };
        let word = text
            .split_whitespace()
            .nth(metric.column)
            .ok_or_else(|| bad(&format!("no column {}", metric.column + 1)))?;
        let value = if word.contains('.') {
            word.parse::<f64>()
                .map_err(|_| bad(&format!("{word:?} is not a number")))?;
            word.to_string()
        } else {
            let n: u64 = word
                .parse()
                .map_err(|_| bad(&format!("{word:?} is not a number")))?;
            // Exact in text; Prometheus reads it as a float64 like every value.
            (u128::from(n) * u128::from(metric.scale)).to_string()
        };
        values.push(Some(value));
    }
    let mut info = Vec::new();
    if let Some(t) = read("comp_algorithm")? {
        let selected = match (t.rfind('['), t.rfind(']')) {
            (Some(l), Some(r)) if r > l => t[l + 1..r].to_string(),
            _ => String::new(),
        };
        info.push(("comp_algorithm", selected));
    }
    for attr in ["backing_dev", "backing_layout"] {
        if let Some(t) = read(attr)? {
            info.push((attr, t.trim().to_string()));
        }
    }
    let policies = match read(POLICY_STAT_ATTR)? {
        Some(t) => parse_policy_stat(device, &t)?,
        None => Vec::new(),
    };
    Ok(DeviceSamples {
        device: device.to_string(),
        values,
        info,
        policies,
    })
}

/// [`collect`] from a device in this process, with its NBD export's `openers` and its
/// `policy` if it has them (the same figures the control socket gives `uzram ctl metrics`).
pub fn collect_device(
    name: &str,
    device: &Device,
    openers: Option<&Openers>,
    policy: Option<&DevicePolicy>,
) -> Result<DeviceSamples> {
    collect(name, &mut |attr| match (attr, openers, policy) {
        (NBD_CONNECTIONS_ATTR, Some(o), _) => Ok(Some(format!("{}\n", o.count()))),
        (POLICY_STAT_ATTR, _, Some(p)) => Ok(Some(p.show_stat())),
        _ => match device.attr_show(attr) {
            Ok(t) => Ok(Some(t)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        },
    })
}

/// A label value as the format escapes it: `\`, `"` and newline.
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// The exposition text of `devices`: each family once, its samples one per device in order.
/// Families no device has are left out.
pub fn render(devices: &[DeviceSamples]) -> String {
    let mut out = String::new();
    for (i, metric) in METRICS.iter().enumerate() {
        if devices.iter().all(|d| d.values[i].is_none()) {
            continue;
        }
        out.push_str(&format!(
            "# HELP {} {}\n# TYPE {} {}\n",
            metric.name,
            metric.help,
            metric.name,
            metric.kind.name()
        ));
        for d in devices {
            if let Some(v) = &d.values[i] {
                out.push_str(&format!(
                    "{}{{device=\"{}\"}} {v}\n",
                    metric.name,
                    escape_label(&d.device)
                ));
            }
        }
    }
    for (i, metric) in POLICY_METRICS.iter().enumerate() {
        if devices.iter().all(|d| d.policies.is_empty()) {
            break;
        }
        out.push_str(&format!(
            "# HELP {} {}\n# TYPE {} {}\n",
            metric.name,
            metric.help,
            metric.name,
            metric.kind.name()
        ));
        for d in devices {
            for p in &d.policies {
                out.push_str(&format!(
                    "{}{{device=\"{}\",policy=\"{}\"}} {}\n",
                    metric.name,
                    escape_label(&d.device),
                    escape_label(&p.policy),
                    p.values[i]
                ));
            }
        }
    }
    if devices.iter().any(|d| !d.info.is_empty()) {
        out.push_str(&format!(
            "# HELP {INFO_METRIC} The device's settings as labels (comp_algorithm, backing_dev, \
             backing_layout); always 1.\n# TYPE {INFO_METRIC} gauge\n"
        ));
        for d in devices {
            out.push_str(&format!(
                "{INFO_METRIC}{{device=\"{}\"",
                escape_label(&d.device)
            ));
            for (k, v) in &d.info {
                out.push_str(&format!(",{k}=\"{}\"", escape_label(v)));
            }
            out.push_str("} 1\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_rules() {
        let all: Vec<&Metric> = METRICS.iter().chain(POLICY_METRICS).collect();
        for (i, metric) in all.iter().enumerate() {
            assert!(metric.name.starts_with("uzram_"), "{}", metric.name);
            assert!(
                metric
                    .name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{}",
                metric.name
            );
            assert_eq!(
                metric.kind == Counter,
                metric.name.ends_with("_total"),
                "{}: counters and only counters end in _total",
                metric.name
            );
            assert!(
                all[..i].iter().all(|o| o.name != metric.name),
                "{} twice",
                metric.name
            );
        }
    }

    #[test]
    fn values_are_the_attributes_columns() {
        let dev = Device::new_uninit(4096).unwrap();
        dev.attr_store("disksize", "1M").unwrap();
        let page: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        uzram::BlockDevice::write_at(&dev, &page, 8192).unwrap();
        let s = collect_device("zram0", &dev, None, None).unwrap();
        let text = render(std::slice::from_ref(&s));
        let mm: Vec<String> = dev
            .attr_show("mm_stat")
            .unwrap()
            .split_whitespace()
            .map(String::from)
            .collect();
        assert!(text.contains(&format!(
            "uzram_orig_data_size_bytes{{device=\"zram0\"}} {}\n",
            mm[0]
        )));
        assert!(text.contains("uzram_orig_data_size_bytes{device=\"zram0\"} 4096\n"));
        assert!(text.contains(&format!(
            "uzram_mem_used_total_bytes{{device=\"zram0\"}} {}\n",
            mm[2]
        )));
        assert!(text.contains("uzram_disksize_bytes{device=\"zram0\"} 1048576\n"));
        assert!(text.contains("# TYPE uzram_pages_compacted_total counter\n"));
        assert!(text.contains("uzram_zone_write_amplification_ratio{device=\"zram0\"} 1.000\n"));
        assert!(text.contains(
            "uzram_device_info{device=\"zram0\",comp_algorithm=\"lz4\",backing_dev=\"none\",\
             backing_layout=\"bitmap\"} 1\n"
        ));
        // Two devices: each family once, a sample per device.
        let mut t = s.clone();
        t.device = "a\"b".into();
        let two = render(&[s, t]);
        assert_eq!(two.matches("# TYPE uzram_same_pages gauge").count(), 1);
        assert!(two.contains("uzram_same_pages{device=\"a\\\"b\"} 0\n"));
    }

    #[test]
    fn missing_attributes_drop_their_families_and_bad_text_is_an_error() {
        let mut only_mm = |attr: &str| -> Result<Option<String>> {
            Ok((attr == "mm_stat").then(|| "1 2 3 4 5 6 7 8 9\n".to_string()))
        };
        let s = collect("x", &mut only_mm).unwrap();
        let text = render(&[s]);
        assert!(text.contains("uzram_huge_pages_since_total{device=\"x\"} 9\n"));
        assert!(!text.contains("io_stat"));
        assert!(!text.contains(INFO_METRIC));
        let mut short = |attr: &str| -> Result<Option<String>> {
            Ok((attr == "mm_stat").then(|| "1 2\n".to_string()))
        };
        let e = collect("x", &mut short).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io);
        assert!(e.message().contains("mm_stat"), "{e}");
        let mut scaled = |attr: &str| -> Result<Option<String>> {
            Ok((attr == "bd_stat").then(|| "       2        3        5\n".to_string()))
        };
        let text = render(&[collect("x", &mut scaled).unwrap()]);
        assert!(text.contains("uzram_bd_count_bytes{device=\"x\"} 8192\n"));
        assert!(text.contains("uzram_bd_writes_bytes_total{device=\"x\"} 20480\n"));
    }

    #[test]
    fn policy_stat_gives_a_sample_per_device_and_policy() {
        use crate::policy::{DevicePolicy, ManualPressure};
        use std::sync::Arc;
        let dev = Arc::new(Device::new_uninit(4096).unwrap());
        dev.attr_store("disksize", "1M").unwrap();
        let page: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        for i in 0..8 {
            uzram::BlockDevice::write_at(&*dev, &page, i * 4096).unwrap();
        }
        let policy = DevicePolicy::new("zram0", Arc::clone(&dev));
        policy.store("idle_age_s=0").unwrap();
        policy.run_due(
            std::time::Duration::from_secs(100),
            &ManualPressure::new(),
            &|| false,
        );
        let idle = policy.counters(crate::policy::PolicyKind::Idle);
        assert_eq!(idle.runs, 1);
        let s = collect_device("zram0", &dev, None, Some(&policy)).unwrap();
        let text = render(&[s]);
        assert_eq!(
            text.matches("# TYPE uzram_policy_runs_total counter\n")
                .count(),
            1
        );
        assert!(text.contains("uzram_policy_enabled{device=\"zram0\",policy=\"idle\"} 1\n"));
        assert!(text.contains("uzram_policy_enabled{device=\"zram0\",policy=\"gc\"} 0\n"));
        assert!(text.contains("uzram_policy_runs_total{device=\"zram0\",policy=\"idle\"} 1\n"));
        assert!(text.contains(&format!(
            "uzram_policy_pages_total{{device=\"zram0\",policy=\"idle\"}} {}\n",
            idle.pages
        )));
        assert!(
            text.contains("uzram_policy_errors_total{device=\"zram0\",policy=\"writeback\"} 0\n")
        );
        // Without policies: no policy family at all.
        let text = render(&[collect_device("zram0", &dev, None, None).unwrap()]);
        assert!(!text.contains("uzram_policy"), "{text}");
        // A malformed policy_stat is EIO naming it.
        let mut bad = |attr: &str| -> Result<Option<String>> {
            Ok((attr == POLICY_STAT_ATTR).then(|| "idle maybe 1 2 3 -\n".to_string()))
        };
        let e = collect("x", &mut bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io);
        assert!(e.message().contains("policy_stat"), "{e}");
    }
}
