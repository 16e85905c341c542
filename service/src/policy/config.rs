//! A device's policy settings: what `uzram ctl DEV policy` shows and stores, and the
//! `policy` key of a `[[device]]` in the configuration file.
//!
//! The text is whitespace-separated `key=value` tokens, as `algorithm_params` takes them.
//! Storing changes only the keys given (`policy idle_age_s=600` leaves the rest); `off`
//! turns one off; the single word `off` turns every policy off and restores the defaults.
//! Showing gives every key, one per line, in a form that stores back unchanged. A malformed
//! token or an unknown key is `EINVAL` and changes nothing.

use uzram::error::{Error, Result};
use uzram::units::parse_size_bytes;

/// Which pages the writeback policy writes back (a `writeback` mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritebackType {
    /// Idle pages (`writeback idle`).
    Idle,
    /// Pages both idle and huge (`writeback huge_idle`).
    HugeIdle,
    /// Huge pages whatever their age (`writeback huge`).
    Huge,
}

impl WritebackType {
    fn name(self) -> &'static str {
        match self {
            WritebackType::Idle => "idle",
            WritebackType::HugeIdle => "huge_idle",
            WritebackType::Huge => "huge",
        }
    }
}

/// The default period: the window of the kernel's `some avg10` pressure figure, so that a
/// pressure reading is new at each period, and short enough that compaction follows a large
/// discard within seconds.
pub const DEFAULT_PERIOD_SECS: u64 = 10;

/// The default age of pages written back early when memory is short: a minute without an
/// access, long enough that pages a running program is using stay in RAM.
pub const DEFAULT_WRITEBACK_PRESSURE_AGE_SECS: u64 = 60;

/// The default period of the writeback budget: a day, as Android's `writeback_limit`.
pub const DEFAULT_WRITEBACK_BUDGET_PERIOD_SECS: u64 = 86_400;

/// The longest period or age taken (access times are `u32` seconds).
pub const MAX_SECS: u64 = u32::MAX as u64;

/// A device's policies. Each `Option` is one policy's switch (`None`: off); everything is off
/// by default.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// `period_s`: how often the policies run (and compaction and GC are checked).
    pub period_secs: u64,
    /// `idle_age_s`: mark pages idle once they have gone this long without an access
    /// (`idle N` each period).
    pub idle_age_secs: Option<u64>,
    /// `writeback_age_s`: write back pages of `writeback_type` idle this long, each period.
    pub writeback_age_secs: Option<u64>,
    /// `writeback_type`: which pages (default `idle`).
    pub writeback_type: WritebackType,
    /// `writeback_pressure_age_s`: under memory pressure, write back pages idle this long at
    /// once (at most once per period).
    pub writeback_pressure_age_secs: u64,
    /// `pressure_avg10`: memory is short when the host's `/proc/pressure/memory` `some avg10`
    /// (percent) is above this.
    pub pressure_some_avg10: Option<f64>,
    /// `mem_used_watermark`: memory is short when the device's `mem_used_total` is above this.
    pub mem_used_watermark_bytes: Option<u64>,
    /// `writeback_budget`: bytes the policy may write back per budget period (it owns
    /// `writeback_limit` then: it enables the limit and sets it to this at each period start).
    pub writeback_budget_bytes: Option<u64>,
    /// `writeback_budget_period_s`.
    pub writeback_budget_period_secs: u64,
    /// `recompress_age_s`: recompress pages idle this long with the recompression algorithms.
    pub recompress_age_secs: Option<u64>,
    /// `recompress_max_pages`: pages tried per run at most.
    pub recompress_max_pages: Option<u64>,
    /// `compact_ratio`: compact when `mem_used_total / compr_data_size` is above this.
    pub compact_ratio: Option<f64>,
    /// `gc_free_zones`: run zoned GC when fewer zones than this are empty.
    pub gc_free_zones: Option<u64>,
}

impl Default for PolicyConfig {
    fn default() -> PolicyConfig {
        PolicyConfig {
            period_secs: DEFAULT_PERIOD_SECS,
            idle_age_secs: None,
            writeback_age_secs: None,
            writeback_type: WritebackType::Idle,
            writeback_pressure_age_secs: DEFAULT_WRITEBACK_PRESSURE_AGE_SECS,
            pressure_some_avg10: None,
            mem_used_watermark_bytes: None,
            writeback_budget_bytes: None,
            writeback_budget_period_secs: DEFAULT_WRITEBACK_BUDGET_PERIOD_SECS,
            recompress_age_secs: None,
            recompress_max_pages: None,
            compact_ratio: None,
            gc_free_zones: None,
        }
    }
}

/// The keys, in the order `show` lists them.
pub const POLICY_KEYS: &[&str] = &[
    "period_s",
    "idle_age_s",
    "writeback_age_s",
    "writeback_type",
    "writeback_pressure_age_s",
    "pressure_avg10",
    "mem_used_watermark",
    "writeback_budget",
    "writeback_budget_period_s",
    "recompress_age_s",
    "recompress_max_pages",
    "compact_ratio",
    "gc_free_zones",
];

fn bad(key: &str, value: &str, why: &str) -> Error {
    Error::invalid(format!("policy {key}={value}: {why}"))
}

fn secs(key: &str, value: &str, min: u64) -> Result<u64> {
    let n: u64 = value
        .parse()
        .map_err(|_| bad(key, value, "seconds, a decimal integer"))?;
    if n < min || n > MAX_SECS {
        return Err(bad(
            key,
            value,
            &format!("must be {min}..={MAX_SECS} seconds"),
        ));
    }
    Ok(n)
}

fn opt<T>(value: &str, f: impl FnOnce() -> Result<T>) -> Result<Option<T>> {
    if value == "off" {
        Ok(None)
    } else {
        f().map(Some)
    }
}

fn show_opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map_or_else(|| "off".to_string(), |v| v.to_string())
}

impl PolicyConfig {
    /// True when any policy is on.
    pub fn any_on(&self) -> bool {
        self.idle_age_secs.is_some()
            || self.writeback_age_secs.is_some()
            || self.recompress_age_secs.is_some()
            || self.compact_ratio.is_some()
            || self.gc_free_zones.is_some()
    }

    /// This configuration with the tokens of `text` applied (see the module documentation).
    /// `EINVAL` for a malformed token, an unknown key or a value out of range; `self` is not
    /// changed either way.
    pub fn with(&self, text: &str) -> Result<PolicyConfig> {
        let words: Vec<&str> = text.split_whitespace().collect();
        if words == ["off"] {
            return Ok(PolicyConfig::default());
        }
        let mut c = self.clone();
        for w in words {
            let Some((key, value)) = w.split_once('=') else {
                return Err(Error::invalid(format!(
                    "policy: {w:?} is not key=value (keys: {}), or the single word off",
                    POLICY_KEYS.join(" ")
                )));
            };
            match key {
                "period_s" => c.period_secs = secs(key, value, 1)?,
                "idle_age_s" => c.idle_age_secs = opt(value, || secs(key, value, 0))?,
                "writeback_age_s" => c.writeback_age_secs = opt(value, || secs(key, value, 0))?,
                "writeback_type" => {
                    c.writeback_type = match value {
                        "idle" => WritebackType::Idle,
                        "huge_idle" => WritebackType::HugeIdle,
                        "huge" => WritebackType::Huge,
                        _ => return Err(bad(key, value, "idle, huge_idle or huge")),
                    }
                }
                "writeback_pressure_age_s" => c.writeback_pressure_age_secs = secs(key, value, 0)?,
                "pressure_avg10" => {
                    c.pressure_some_avg10 = opt(value, || {
                        value
                            .parse::<f64>()
                            .ok()
                            .filter(|p| (0.0..=100.0).contains(p))
                            .ok_or_else(|| bad(key, value, "a percentage, 0 to 100"))
                    })?
                }
                "mem_used_watermark" => {
                    c.mem_used_watermark_bytes = opt(value, || {
                        parse_size_bytes(value).map_err(|e| bad(key, value, e.message()))
                    })?
                }
                "writeback_budget" => {
                    c.writeback_budget_bytes = opt(value, || {
                        parse_size_bytes(value).map_err(|e| bad(key, value, e.message()))
                    })?
                }
                "writeback_budget_period_s" => {
                    c.writeback_budget_period_secs = secs(key, value, 1)?
                }
                "recompress_age_s" => c.recompress_age_secs = opt(value, || secs(key, value, 0))?,
                "recompress_max_pages" => {
                    c.recompress_max_pages = opt(value, || {
                        value
                            .parse::<u64>()
                            .ok()
                            .filter(|&n| n > 0)
                            .ok_or_else(|| bad(key, value, "a positive integer"))
                    })?
                }
                "compact_ratio" => {
                    c.compact_ratio = opt(value, || {
                        value
                            .parse::<f64>()
                            .ok()
                            .filter(|r| r.is_finite() && *r > 1.0)
                            .ok_or_else(|| {
                                bad(
                                    key,
                                    value,
                                    "a ratio above 1 (mem_used_total / compr_data_size)",
                                )
                            })
                    })?
                }
                "gc_free_zones" => {
                    c.gc_free_zones = opt(value, || {
                        value
                            .parse::<u64>()
                            .ok()
                            .filter(|&n| n > 0)
                            .ok_or_else(|| bad(key, value, "a positive number of zones"))
                    })?
                }
                _ => {
                    return Err(Error::invalid(format!(
                        "policy: unknown key {key:?} (keys: {})",
                        POLICY_KEYS.join(" ")
                    )))
                }
            }
        }
        Ok(c)
    }

    /// Every key, one `key=value` per line, as `policy` reads.
    pub fn show(&self) -> String {
        let lines = [
            format!("period_s={}", self.period_secs),
            format!("idle_age_s={}", show_opt(&self.idle_age_secs)),
            format!("writeback_age_s={}", show_opt(&self.writeback_age_secs)),
            format!("writeback_type={}", self.writeback_type.name()),
            format!(
                "writeback_pressure_age_s={}",
                self.writeback_pressure_age_secs
            ),
            format!("pressure_avg10={}", show_opt(&self.pressure_some_avg10)),
            format!(
                "mem_used_watermark={}",
                show_opt(&self.mem_used_watermark_bytes)
            ),
            format!(
                "writeback_budget={}",
                show_opt(&self.writeback_budget_bytes)
            ),
            format!(
                "writeback_budget_period_s={}",
                self.writeback_budget_period_secs
            ),
            format!("recompress_age_s={}", show_opt(&self.recompress_age_secs)),
            format!(
                "recompress_max_pages={}",
                show_opt(&self.recompress_max_pages)
            ),
            format!("compact_ratio={}", show_opt(&self.compact_ratio)),
            format!("gc_free_zones={}", show_opt(&self.gc_free_zones)),
        ];
        let mut s = lines.join("\n");
        s.push('\n');
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_merges_and_show_round_trips() {
        let c = PolicyConfig::default();
        assert!(!c.any_on());
        let c = c
            .with("idle_age_s=600 compact_ratio=1.05 writeback_budget=1G\n")
            .unwrap();
        assert_eq!(c.idle_age_secs, Some(600));
        assert_eq!(c.compact_ratio, Some(1.05));
        assert_eq!(c.writeback_budget_bytes, Some(1 << 30));
        assert!(c.any_on());
        let c2 = c.with("writeback_age_s=3600").unwrap();
        assert_eq!(c2.idle_age_secs, Some(600), "other keys kept");
        assert_eq!(PolicyConfig::default().with(&c2.show()).unwrap(), c2);
        assert_eq!(c2.with("idle_age_s=off").unwrap().idle_age_secs, None);
        assert_eq!(c2.with(" off\n").unwrap(), PolicyConfig::default());
    }

    #[test]
    fn bad_tokens_are_einval_and_change_nothing() {
        let c = PolicyConfig::default().with("idle_age_s=5").unwrap();
        for bad in [
            "idle_age_s",
            "idle_age=5",
            "idle_age_s=-1",
            "idle_age_s=5s",
            "period_s=0",
            "period_s=off",
            "compact_ratio=1",
            "compact_ratio=0.5",
            "compact_ratio=nan",
            "pressure_avg10=101",
            "writeback_type=incompressible",
            "mem_used_watermark=12 MB",
            "gc_free_zones=0",
            "recompress_max_pages=0",
            "idle_age_s=99999999999",
            "idle_age_s=7 bogus",
        ] {
            let e = c.with(bad).unwrap_err();
            assert_eq!(e.errno(), libc::EINVAL, "{bad}");
        }
        assert_eq!(c.idle_age_secs, Some(5));
    }
}
