//! uzram's harness: the benchmarks and the page corpus they run on, apart from the product.
//!
//! Benchmarks are programs that measure their anchor in the same run, print a table and write
//! JSON to `bench/results/`. No test asserts a timing; the suite runs them at tiny sizes so they
//! keep working. [`corpus`] is the page corpus of real programs' memory (its file format, the
//! snapshot of a process's anonymous memory, and the `uzram corpus` workloads). The `uzram`
//! command runs both through [`command`] and [`corpus::build`].

// `uzram bench store`'s JSON document is one `json!` literal deeper than the default limit.
#![recursion_limit = "256"]

pub mod blk;
pub mod codec_impls;
pub mod command;
pub mod corpus;
pub mod free;
pub mod gc;
pub mod kernel_zram;
pub mod multipage;
pub mod nbd;
pub mod plot;
pub mod recompress;
pub mod remote;
pub mod restart;
pub mod sparse_copy;
pub mod store;
pub mod vhost;
pub mod vm;
pub mod writeback;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use uzram::error::{Error, Result};

/// The median of some samples (the mean of the two middle ones for an even count).
pub fn median(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The `p`-th percentile (0..=100) by nearest rank.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// Runs `f` and returns how long it took.
pub fn time<R>(f: impl FnOnce() -> R) -> (R, Duration) {
    let start = Instant::now();
    let r = f();
    (r, start.elapsed())
}

/// CPU time (user + system) the calling thread has used so far.
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime: {}", std::io::Error::last_os_error());
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Runs `f` and returns its result, the wall time and the calling thread's CPU time it took.
/// On a shared machine CPU time is the steadier measure of work done on one thread: it does not
/// count time spent waiting for a core.
pub fn time_cpu<R>(f: impl FnOnce() -> R) -> (R, Duration, Duration) {
    let (start, cpu_start) = (Instant::now(), thread_cpu_time());
    let r = f();
    (r, start.elapsed(), thread_cpu_time() - cpu_start)
}

/// MB/s (10^6 bytes per second) for `bytes` in `d`.
pub fn mbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e6
}

/// A table printed with aligned columns: the first and those named by
/// [`left_align`](Table::left_align) to the left, the rest (numbers) to the right.
#[derive(Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    left: Vec<usize>,
}

impl Table {
    /// A table with these column names.
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
            left: vec![0],
        }
    }
    /// Aligns these columns (by index) to the left too, as `zramctl` does its text columns.
    pub fn left_align(mut self, columns: &[usize]) -> Table {
        self.left.extend_from_slice(columns);
        self
    }
    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }
    /// Renders the table with a rule under the header.
    pub fn render(&self) -> String {
        self.render_with(true)
    }

    /// Renders the table without the rule, as `zramctl` and `lsblk` print theirs.
    pub fn render_plain(&self) -> String {
        self.render_with(false)
    }

    fn render_with(&self, rule: bool) -> String {
        let ncol = self.header.len();
        let mut width = vec![0; ncol];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(ncol) {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        let line = |r: &Vec<String>, out: &mut String| {
            let mut cells = String::new();
            for (i, c) in r.iter().enumerate().take(ncol) {
                if i > 0 {
                    cells.push_str("  ");
                }
                if self.left.contains(&i) {
                    cells.push_str(&format!("{c:<w$}", w = width[i]));
                } else {
                    cells.push_str(&format!("{c:>w$}", w = width[i]));
                }
            }
            out.push_str(cells.trim_end());
            out.push('\n');
        };
        line(&self.header, &mut out);
        if rule {
            out.push_str(&"-".repeat(width.iter().sum::<usize>() + 2 * ncol.saturating_sub(1)));
            out.push('\n');
        }
        for r in &self.rows {
            line(r, &mut out);
        }
        out
    }
}

/// Formats a float for a table: 3 significant-ish digits.
pub fn f(v: f64) -> String {
    if v.is_nan() {
        "n/a".to_string()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// Where a benchmark writes its JSON: the path asked for, or `bench/results/NAME-UNIXTIME.json`.
pub fn json_path(asked: Option<&Path>, name: &str) -> PathBuf {
    asked.map(Path::to_path_buf).unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from(format!("bench/results/{name}-{secs}.json"))
    })
}

/// Writes `value` as pretty JSON to `path`, creating its directory.
pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir)?;
        }
    }
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::io(format!("cannot encode JSON: {e}")))?;
    std::fs::write(path, text + "\n")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_percentiles() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
    }

    #[test]
    fn table_aligns() {
        let mut t = Table::new(&["what", "MB/s"]);
        t.row(vec!["lz4 compress".into(), f(812.345)]);
        let s = t.render();
        assert!(s.contains("lz4 compress   812"), "{s}");
    }
}
