//! Where the policies learn that memory is short: the host's pressure-stall information.
//!
//! [`ProcPressure`] reads `/proc/pressure/memory` (the kernel's PSI, `CONFIG_PSI`): its `some`
//! line's `avg10` is the share of the last ten seconds in which at least one task waited for
//! memory, in percent. [`ManualPressure`] is a value a test sets: the controllable pressure
//! source of the policy tests (the host's real pressure cannot be driven from a test).

use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use uzram::error::{Error, Result};

/// A source of memory pressure readings.
pub trait PressureSource: Send + Sync + Debug {
    /// The current `some avg10` of memory, in percent (0.0..=100.0).
    fn memory_some_avg10(&self) -> Result<f64>;
}

/// The kernel's pressure-stall information for memory.
#[derive(Debug, Clone)]
pub struct ProcPressure {
    path: PathBuf,
}

/// Where the kernel publishes memory pressure.
pub const PROC_PRESSURE_MEMORY: &str = "/proc/pressure/memory";

impl ProcPressure {
    /// Reads [`PROC_PRESSURE_MEMORY`].
    pub fn new() -> ProcPressure {
        ProcPressure::at(PROC_PRESSURE_MEMORY)
    }

    /// Reads a file of the same format elsewhere (a cgroup's `memory.pressure`).
    pub fn at(path: impl Into<PathBuf>) -> ProcPressure {
        ProcPressure { path: path.into() }
    }
}

impl Default for ProcPressure {
    fn default() -> ProcPressure {
        ProcPressure::new()
    }
}

/// The `some` line's `avg10` of a PSI file's text:
/// `some avg10=0.00 avg60=0.00 avg300=0.00 total=0`.
pub fn parse_some_avg10(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    let v = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("avg10="))?;
    v.parse::<f64>().ok().filter(|p| p.is_finite())
}

impl PressureSource for ProcPressure {
    fn memory_some_avg10(&self) -> Result<f64> {
        let text = std::fs::read_to_string(&self.path).map_err(|e| {
            let msg = format!("reading {}: {e}", self.path.display());
            Error::new(Error::from(e).kind(), msg)
        })?;
        parse_some_avg10(&text).ok_or_else(|| {
            Error::io(format!(
                "{}: no `some avg10=` figure in {text:?}",
                self.path.display()
            ))
        })
    }
}

/// A pressure reading a test sets.
#[derive(Debug, Default)]
pub struct ManualPressure {
    /// `f64` bits.
    avg10_bits: AtomicU64,
}

impl ManualPressure {
    /// No pressure (0 %).
    pub fn new() -> ManualPressure {
        ManualPressure::default()
    }

    /// Sets the reading.
    pub fn set(&self, avg10: f64) {
        self.avg10_bits.store(avg10.to_bits(), Ordering::Relaxed);
    }
}

impl PressureSource for ManualPressure {
    fn memory_some_avg10(&self) -> Result<f64> {
        Ok(f64::from_bits(self.avg10_bits.load(Ordering::Relaxed)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_psi_text() {
        let t = "some avg10=12.50 avg60=3.00 avg300=1.00 total=12345\n\
                 full avg10=1.00 avg60=0.00 avg300=0.00 total=100\n";
        assert_eq!(parse_some_avg10(t), Some(12.5));
        assert_eq!(parse_some_avg10("full avg10=1.00\n"), None);
        assert_eq!(parse_some_avg10("some avg10=x\n"), None);
    }

    #[test]
    fn reads_the_hosts_pressure_or_says_why_not() {
        // The host's file, when the kernel has PSI; a clear error otherwise.
        match ProcPressure::new().memory_some_avg10() {
            Ok(p) => assert!((0.0..=100.0).contains(&p)),
            Err(e) => assert!(e.message().contains(PROC_PRESSURE_MEMORY), "{e}"),
        }
        let e = ProcPressure::at("/nonexistent/pressure")
            .memory_some_avg10()
            .unwrap_err();
        assert_eq!(e.errno(), libc::ENOENT);
    }
}
