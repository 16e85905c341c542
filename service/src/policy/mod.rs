//! Automatic policies: what kernel zram leaves to cron jobs and Android's userspace, done by
//! the server itself, per device, off by default (see `docs/policies.md`).
//!
//! - **idle aging** (`idle_age_s`): each period, `idle N`: pages not accessed for N seconds
//!   are marked idle, the others lose the mark;
//! - **writeback** (`writeback_age_s`, `writeback_type`): each period, pages idle that long
//!   are written back with the batched engine (`writeback idle`); when memory is short (the
//!   host's PSI `some avg10` above `pressure_avg10`, or `mem_used_total` above
//!   `mem_used_watermark`) pages idle `writeback_pressure_age_s` go at once; everything the
//!   policy writes is bounded by `writeback_budget` per `writeback_budget_period_s`, kept in
//!   the device's own `writeback_limit` as Android keeps its daily budget;
//! - **recompression** (`recompress_age_s`): pages idle that long are recompressed with the
//!   recompression algorithms (`recompress type=idle`);
//! - **compaction** (`compact_ratio`): when `mem_used_total / compr_data_size` is above the
//!   ratio, `compact`;
//! - **zoned GC** (`gc_free_zones`): when fewer zones are empty, `gc`.
//!
//! A policy does only what a user could do through the device's public interface (the same
//! calls the attributes make), from one thread per server ([`PolicyRunner`]) that runs the
//! policies of every device in turn: one action at a time, so the policies never take more
//! than one core, and a second writeback never queues behind the first (a policy finding
//! the device busy, `EAGAIN`, tries again next period). Each policy counts its runs, the
//! pages it acted on and its errors, with the last one (`policy_stat`).
//!
//! # Locks
//! [`DevicePolicy::config`] (the settings, taken for a moment by the control socket and by
//! the runner, which clones them; a change holds it while it saves the settings in the
//! device's state, taking the device's init lock shared and its policy record mutex under
//! it), [`DevicePolicy::counters`] (a moment, by the runner and
//! by readers) and [`DevicePolicy::schedule`] (the runner, and the start's restore; held
//! across the device's calls, so it is taken before any device lock and nothing is taken
//! under it but the device's own and `counters`, for a moment: to count a run, and to save
//! the counters with it). Nothing is taken under `counters`; `config` is never held with
//! either.

pub mod config;
pub mod pressure;

pub use config::{PolicyConfig, WritebackType, POLICY_KEYS};
pub use pressure::{ManualPressure, PressureSource, ProcPressure};

use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use uzram::clock::Clock;
use uzram::device::{Device, IdleCutoff, RecompressSpec};
use uzram::error::{errno_name, Error, ErrorKind, Result};
use uzram::writeback::{WritebackMode, WritebackSpec};

/// How often the runner thread wakes to look at the clock: the resolution of every period and
/// age, and the longest a stop waits for an idle runner.
pub const TICK: Duration = Duration::from_secs(1);

/// The policies, in the order a period runs them and `policy_stat` lists them: writeback
/// first (the oldest pages leave RAM before recompression spends CPU on them), idle aging
/// after the policies that re-mark with their own ages (so the marks left for a user's
/// `writeback idle` follow `idle_age_s`), compaction after everything that freed memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// `writeback_age_s` and the pressure trigger.
    Writeback,
    /// `recompress_age_s`.
    Recompress,
    /// `idle_age_s`.
    Idle,
    /// `compact_ratio`.
    Compact,
    /// `gc_free_zones`.
    Gc,
}

impl PolicyKind {
    /// Every policy, in order.
    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::Writeback,
        PolicyKind::Recompress,
        PolicyKind::Idle,
        PolicyKind::Compact,
        PolicyKind::Gc,
    ];

    /// Its name in `policy_stat`.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Writeback => "writeback",
            PolicyKind::Recompress => "recompress",
            PolicyKind::Idle => "idle",
            PolicyKind::Compact => "compact",
            PolicyKind::Gc => "gc",
        }
    }

    /// Whether `config` turns it on.
    pub fn is_on(self, config: &PolicyConfig) -> bool {
        match self {
            PolicyKind::Writeback => config.writeback_age_secs.is_some(),
            PolicyKind::Recompress => config.recompress_age_secs.is_some(),
            PolicyKind::Idle => config.idle_age_secs.is_some(),
            PolicyKind::Compact => config.compact_ratio.is_some(),
            PolicyKind::Gc => config.gc_free_zones.is_some(),
        }
    }
}

/// One policy's counters (a line of `policy_stat`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyCounters {
    /// Times the policy acted (an action that failed counts too).
    pub runs: u64,
    /// Pages acted on: marked idle (idle pages after the run), written back, recompressed to
    /// a smaller object, freed by compaction, or relocated by GC (in 4 KiB units, as
    /// `bd_stat`).
    pub pages: u64,
    /// Runs that failed.
    pub errors: u64,
    /// The last failure: errno name and message.
    pub last_error: Option<String>,
}

/// Where a device's settings came from at the server's start ([`DevicePolicy::restore`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restored {
    /// The settings the previous process saved (set at runtime, or the configuration's).
    Saved,
    /// The configuration's: nothing was saved.
    Configured,
    /// The configuration's, or none: the saved ones were not taken, for this reason.
    Ignored(String),
    /// None: nothing saved, nothing configured.
    None,
}

impl Restored {
    /// Logs where device `name`'s settings came from, when the previous process's saved
    /// ones matter (taken, or not and why).
    pub fn log(&self, name: &str) {
        match self {
            Restored::Saved => eprintln!("uzram: {name}: policy: the saved one, as it was set"),
            Restored::Ignored(why) => eprintln!(
                "uzram: {name}: policy: the saved one is not taken ({why}): the \
                 configuration's, if any"
            ),
            Restored::Configured | Restored::None => {}
        }
    }
}

/// The words of `text` joined by one space.
fn words(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The saved text's two lines ([`DevicePolicy`]'s documentation): the configured `policy`
/// it was saved over (`None`: none) and the settings; `None` if it is not of that form.
fn parse_saved(text: &str) -> Option<(Option<String>, String)> {
    let mut lines = text.lines();
    let base = lines.next()?.strip_prefix("config ")?;
    let settings = lines.next()?.strip_prefix("policy ")?;
    if lines.next().is_some() {
        return None;
    }
    let base = (base != "none").then(|| base.to_string());
    Some((base, settings.to_string()))
}

/// When the runner last did what (its clock's readings).
#[derive(Debug, Default)]
struct Schedule {
    /// The last periodic run.
    last_period: Option<Duration>,
    /// The last writeback on pressure.
    last_pressure: Option<Duration>,
    /// The last look at memory pressure.
    last_check: Option<Duration>,
    /// The start of the current writeback budget period.
    budget_start: Option<Duration>,
}

impl Schedule {
    /// Forgets every reading later than `now`: one the runner's clock cannot have made
    /// (saved with another clock), which would hold a policy back until that time.
    fn forget_future(&mut self, now: Duration) {
        for t in [
            &mut self.last_period,
            &mut self.last_pressure,
            &mut self.last_check,
            &mut self.budget_start,
        ] {
            if t.is_some_and(|t| t > now) {
                *t = None;
            }
        }
    }
}

/// The longest last error a saved state keeps of each policy (its text is cut there, at a
/// character's boundary): five of them and the rest fit a record
/// ([`uzram::device::restart::MAX_POLICY_TEXT_BYTES`]) with room to spare.
const SAVED_ERROR_BYTES: usize = 512;

/// The text [`DevicePolicy`] saves of its counters and schedule: a line `schedule` with the
/// last periodic run, the last writeback on pressure and the budget period's start (the
/// runner's clock's readings in nanoseconds, or `none`), then a line per policy in
/// [`PolicyKind::ALL`]'s order: its name, runs, pages, errors and the last error (`-`: none).
fn encode_state(sched: &Schedule, counters: &[PolicyCounters; 5]) -> String {
    let reading = |t: Option<Duration>| t.map_or("none".to_string(), |t| t.as_nanos().to_string());
    let mut text = format!(
        "schedule {} {} {}\n",
        reading(sched.last_period),
        reading(sched.last_pressure),
        reading(sched.budget_start)
    );
    for k in PolicyKind::ALL {
        let c = &counters[k as usize];
        let error = match &c.last_error {
            None => "-".to_string(),
            Some(e) => {
                let mut cut = SAVED_ERROR_BYTES.min(e.len());
                while !e.is_char_boundary(cut) {
                    cut -= 1;
                }
                e[..cut].replace(['\n', '\0'], " ")
            }
        };
        text.push_str(&format!(
            "{} {} {} {} {error}\n",
            k.name(),
            c.runs,
            c.pages,
            c.errors
        ));
    }
    text
}

/// The schedule and counters of a text [`encode_state`] made; `None` if it is not one.
fn decode_state(text: &str) -> Option<(Schedule, [PolicyCounters; 5])> {
    let mut lines = text.lines();
    let mut words = lines.next()?.strip_prefix("schedule ")?.split(' ');
    let mut reading = || -> Option<Option<Duration>> {
        match words.next()? {
            "none" => Some(None),
            n => Some(Some(Duration::from_nanos(n.parse().ok()?))),
        }
    };
    let sched = Schedule {
        last_period: reading()?,
        last_pressure: reading()?,
        last_check: None,
        budget_start: reading()?,
    };
    if words.next().is_some() {
        return None;
    }
    let mut counters: [PolicyCounters; 5] = Default::default();
    for k in PolicyKind::ALL {
        let mut w = lines.next()?.splitn(5, ' ');
        if w.next()? != k.name() {
            return None;
        }
        let mut num = || w.next()?.parse::<u64>().ok();
        let (runs, pages, errors) = (num()?, num()?, num()?);
        let last_error = match w.next()? {
            "-" => None,
            e => Some(e.to_string()),
        };
        counters[k as usize] = PolicyCounters {
            runs,
            pages,
            errors,
            last_error,
        };
    }
    lines.next().is_none().then_some((sched, counters))
}

/// True when `period` has passed since `last` (or nothing happened yet).
fn elapsed(last: Option<Duration>, now: Duration, period: Duration) -> bool {
    match last {
        None => true,
        Some(t) => now >= t + period,
    }
}

/// How often memory pressure is looked at between periods: the window of `some avg10`, so
/// each look sees a figure mostly new.
pub const PRESSURE_CHECK_INTERVAL: Duration = Duration::from_secs(10);

/// A device's policies: its settings, counters and schedule.
///
/// # Across a restart
/// Every change of the settings ([`store`](Self::store), [`set_config`](Self::set_config))
/// is saved in the device's state for the next process ([`Device::save_policy`]: the header
/// file's policy record, two checksummed slots), under the `config` lock, so the records
/// reach the file in the order of the changes. The text saved is two lines: `config` and the
/// configuration's `policy` the device started with (its words, or `none`), then `policy` and
/// the settings now (every key, as `policy` reads, on one line). At the next start
/// [`restore`](Self::restore) brings the saved settings back, unless the configuration's
/// `policy` is no longer the one they were saved over (see there).
///
/// What the policies did and when is saved too, apart ([`Device::save_policy_state`]: two
/// slots of its own): `policy_stat`'s counters and the schedule (the last periodic run, the
/// last writeback on pressure, the writeback budget period's start), written by the runner
/// after each time it acts (never on a request's path), under the `schedule` lock, so the
/// records reach the file in order. The schedule's readings are the runner's clock's: the
/// server's is [`uzram::clock::BootClock`], whose readings every process of a boot shares,
/// so a budget period goes on across a restart (its use so far is the device's
/// `writeback_limit`, kept with the device's limits, saved before the schedule that starts
/// a period). [`restore`](Self::restore) brings both back, whichever settings come back
/// (as a change of settings on a running server keeps them).
#[derive(Debug)]
pub struct DevicePolicy {
    name: String,
    device: Arc<Device>,
    /// The configuration's `policy` the device started with, its words joined by one space
    /// (`None`: none, or a device the configuration does not name); set once by
    /// [`restore`](Self::restore), read by every save.
    configured: std::sync::OnceLock<Option<String>>,
    config: Mutex<PolicyConfig>,
    counters: Mutex<[PolicyCounters; 5]>,
    schedule: Mutex<Schedule>,
}

impl DevicePolicy {
    /// The policies of `device` (named `name` in messages), all off.
    pub fn new(name: impl Into<String>, device: Arc<Device>) -> DevicePolicy {
        DevicePolicy {
            name: name.into(),
            device,
            configured: std::sync::OnceLock::new(),
            config: Mutex::new(PolicyConfig::default()),
            counters: Mutex::new(Default::default()),
            schedule: Mutex::new(Schedule::default()),
        }
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The settings.
    pub fn config(&self) -> PolicyConfig {
        self.config.lock().clone()
    }

    /// Replaces the settings, and saves them for the next process. The next period starts
    /// from the runner's next tick.
    pub fn set_config(&self, config: PolicyConfig) {
        let mut c = self.config.lock();
        // Cannot fail: the text is far shorter than a record holds.
        let saved = self.save(&config);
        debug_assert!(saved.is_ok(), "{saved:?}");
        *c = config;
    }

    /// `policy` read: every key, one per line.
    pub fn show(&self) -> String {
        self.config().show()
    }

    /// `policy` write: applies `key=value` tokens (see [`config`]) and saves the result for
    /// the next process; `EINVAL` changes nothing.
    pub fn store(&self, text: &str) -> Result<()> {
        let mut c = self.config.lock();
        let new = c.with(text)?;
        self.save(&new)?;
        *c = new;
        Ok(())
    }

    /// Saves `config` in the device's state (see the type's documentation); the caller holds
    /// the `config` lock, taken before the device's (its init lock and policy record mutex).
    fn save(&self, config: &PolicyConfig) -> Result<()> {
        let configured = self.configured.get().cloned().flatten();
        let text = format!(
            "config {}\npolicy {}\n",
            configured.as_deref().unwrap_or("none"),
            words(&config.show())
        );
        self.device.save_policy(&text)
    }

    /// The settings at the server's start, for a device whose state may have been recovered:
    /// `configured` is the configuration's `policy` for the device (`None`: none, or a device
    /// the configuration does not name, such as one added by `hot_add` in a previous
    /// process). The settings saved by the previous process ([`Device::saved_policy`]) come
    /// back, as they were set at runtime, if they were saved over the same configured
    /// `policy` (compared word by word) or the configuration does not name the device
    /// (`named` false); otherwise (none saved, or the configuration's `policy` edited since)
    /// the configuration's are stored, and saved. The counters and the schedule saved come
    /// back in either case (see the type's documentation). Call it once, before the
    /// device's policies run. `EINVAL` if the configuration's text is refused.
    pub fn restore(&self, named: bool, configured: Option<&str>) -> Result<Restored> {
        // A text not understood (a later binary's) leaves them as new: nothing is lost but
        // the counts.
        if let Some((sched, counters)) = self
            .device
            .saved_policy_state()
            .and_then(|t| decode_state(&t))
        {
            *self.schedule.lock() = sched;
            *self.counters.lock() = counters;
        }
        let configured = configured.map(words).filter(|w| !w.is_empty());
        let _ = self.configured.set(configured.clone());
        let saved = self.device.saved_policy().map(|t| parse_saved(&t));
        let mut ignored = None;
        match saved {
            Some(Some((base, settings))) if !named || base == configured => {
                match PolicyConfig::default().with(&settings) {
                    Ok(c) => {
                        *self.config.lock() = c;
                        return Ok(Restored::Saved);
                    }
                    Err(e) => ignored = Some(e.message().to_string()),
                }
            }
            Some(Some(_)) => {
                ignored = Some("the configuration's policy changed since it was saved".into())
            }
            Some(None) => ignored = Some("it does not parse".into()),
            None => {}
        }
        if let Some(text) = &configured {
            self.store(text)?;
        }
        Ok(match ignored {
            Some(why) => Restored::Ignored(why),
            None if configured.is_some() => Restored::Configured,
            None => Restored::None,
        })
    }

    /// The counters of `kind`.
    pub fn counters(&self, kind: PolicyKind) -> PolicyCounters {
        self.counters.lock()[kind as usize].clone()
    }

    /// `policy_stat`: a line per policy in [`PolicyKind::ALL`]'s order: name, `on` or `off`,
    /// runs, pages, errors (`%8llu` each) and the last error (`-` for none).
    pub fn show_stat(&self) -> String {
        let config = self.config();
        let counters = self.counters.lock().clone();
        let mut s = String::new();
        for k in PolicyKind::ALL {
            let c = &counters[k as usize];
            s.push_str(&format!(
                "{:<10} {:<3} {:8} {:8} {:8} {}\n",
                k.name(),
                if k.is_on(&config) { "on" } else { "off" },
                c.runs,
                c.pages,
                c.errors,
                c.last_error.as_deref().unwrap_or("-")
            ));
        }
        s
    }

    fn record(&self, kind: PolicyKind, result: Result<u64>) {
        let mut all = self.counters.lock();
        let c = &mut all[kind as usize];
        c.runs += 1;
        match result {
            Ok(pages) => c.pages += pages,
            Err(e) => {
                c.errors += 1;
                c.last_error = Some(format!("{}: {}", errno_name(e.errno()), e.message()));
            }
        }
    }

    /// Runs whatever is due at `now` (the runner's clock): the periodic policies once per
    /// `period_s`, and writeback at once (at most once per period) when memory is short.
    /// Does nothing on an uninitialised device. `quit` is checked between actions.
    pub fn run_due(&self, now: Duration, pressure: &dyn PressureSource, quit: &dyn Fn() -> bool) {
        let config = self.config();
        if !config.any_on() || !self.device.is_initialised() {
            return;
        }
        let mut sched = self.schedule.lock();
        sched.forget_future(now);
        if self.act(&config, &mut sched, now, pressure, quit) {
            let text = encode_state(&sched, &self.counters.lock().clone());
            // Cannot fail: the text is cut to fit a record (SAVED_ERROR_BYTES).
            let saved = self.device.save_policy_state(&text);
            debug_assert!(saved.is_ok(), "{saved:?}");
        }
    }

    /// [`run_due`](Self::run_due)'s work, `sched` held: true if anything was due (and so
    /// the schedule or the counters may have changed).
    fn act(
        &self,
        config: &PolicyConfig,
        sched: &mut Schedule,
        now: Duration,
        pressure: &dyn PressureSource,
        quit: &dyn Fn() -> bool,
    ) -> bool {
        let period = Duration::from_secs(config.period_secs);
        let periodic = elapsed(sched.last_period, now, period);
        let mut short = None;
        if config.writeback_age_secs.is_some()
            && (periodic || elapsed(sched.last_check, now, PRESSURE_CHECK_INTERVAL))
        {
            sched.last_check = Some(now);
            short = self.memory_short(config, pressure);
        }
        let pressured = short.is_some() && elapsed(sched.last_pressure, now, period);
        if !periodic && !pressured {
            return false;
        }
        if periodic {
            sched.last_period = Some(now);
        }
        if let Some(wb_age) = config.writeback_age_secs {
            let age = if short.is_some() {
                sched.last_pressure = Some(now);
                config.writeback_pressure_age_secs.min(wb_age)
            } else {
                wb_age
            };
            if let Some(budget) = config.writeback_budget_bytes {
                let budget_period = Duration::from_secs(config.writeback_budget_period_secs);
                if elapsed(sched.budget_start, now, budget_period) {
                    sched.budget_start = Some(now);
                    self.device.set_writeback_limit_enable(true);
                    self.device.set_writeback_limit(budget / 4096);
                }
            }
            self.writeback(config, age);
        }
        if !periodic || quit() {
            return true;
        }
        if let Some(age) = config.recompress_age_secs {
            self.recompress(config, age);
        }
        if let Some(age) = config.idle_age_secs {
            self.device.mark_idle(IdleCutoff::OlderThanSecs(age));
            self.record(PolicyKind::Idle, Ok(self.device.idle_pages()));
        }
        if quit() {
            return true;
        }
        if let Some(ratio) = config.compact_ratio {
            let s = self.device.stats();
            if s.compr_data_size_bytes > 0
                && s.mem_used_total_bytes as f64 > ratio * s.compr_data_size_bytes as f64
            {
                let freed = self.device.compact();
                self.record(PolicyKind::Compact, Ok(freed));
            }
        }
        if let Some(min_empty) = config.gc_free_zones {
            if let Some(z) = self.device.zone_stats() {
                if z.empty < min_empty {
                    let r = self.device.gc().map(|g| g.bytes_relocated.div_ceil(4096));
                    self.record(PolicyKind::Gc, r);
                }
            }
        }
        true
    }

    /// Why memory is short, if it is: PSI above `pressure_avg10`, or `mem_used_total` above
    /// `mem_used_watermark`. A PSI file that cannot be read counts as an error of the
    /// writeback policy (and as no pressure).
    fn memory_short(&self, config: &PolicyConfig, pressure: &dyn PressureSource) -> Option<String> {
        if let Some(w) = config.mem_used_watermark_bytes {
            let used = self.device.stats().mem_used_total_bytes;
            if used > w {
                return Some(format!("mem_used_total {used} > {w}"));
            }
        }
        if let Some(limit) = config.pressure_some_avg10 {
            match pressure.memory_some_avg10() {
                Ok(p) if p > limit => return Some(format!("memory some avg10 {p} > {limit}")),
                Ok(_) => {}
                Err(e) => {
                    let mut all = self.counters.lock();
                    let c = &mut all[PolicyKind::Writeback as usize];
                    c.errors += 1;
                    c.last_error = Some(format!("{}: {}", errno_name(e.errno()), e.message()));
                }
            }
        }
        None
    }

    /// Marks pages idle `age` seconds and writes back those of the configured type. A device
    /// busy with another writeback or recompression (`EAGAIN`) or a spent budget is not an
    /// error: the policy tries again next period.
    fn writeback(&self, config: &PolicyConfig, age: u64) {
        let dev = &self.device;
        if config.writeback_budget_bytes.is_some()
            && dev.writeback_limit_enable()
            && dev.writeback_limit() == 0
        {
            return;
        }
        let mode = match config.writeback_type {
            WritebackType::Idle => WritebackMode::Idle,
            WritebackType::HugeIdle => WritebackMode::HugeIdle,
            WritebackType::Huge => WritebackMode::Huge,
        };
        if mode != WritebackMode::Huge {
            dev.mark_idle(IdleCutoff::OlderThanSecs(age));
        }
        let r = dev.writeback_with_progress(&WritebackSpec::mode(mode), &mut |_| {});
        let r = match r {
            Err(e) if e.kind() == ErrorKind::Again => return,
            Err(e) => Err(e),
            Ok(report) => match report.error {
                // The budget ran out during the pass: what fitted is written.
                Some(e)
                    if e.kind() == ErrorKind::Io
                        && dev.writeback_limit_enable()
                        && dev.writeback_limit() < 1 =>
                {
                    Ok(report.written)
                }
                Some(e) => Err(Error::new(
                    e.kind(),
                    format!("{} ({} pages written)", e.message(), report.written),
                )),
                None => Ok(report.written),
            },
        };
        self.record(PolicyKind::Writeback, r);
    }

    /// Marks pages idle `age` seconds and recompresses them.
    fn recompress(&self, config: &PolicyConfig, age: u64) {
        self.device.mark_idle(IdleCutoff::OlderThanSecs(age));
        let spec = RecompressSpec {
            idle: true,
            max_pages: config.recompress_max_pages,
            ..RecompressSpec::default()
        };
        match self.device.recompress(&spec) {
            Err(e) if e.kind() == ErrorKind::Again => {}
            r => self.record(PolicyKind::Recompress, r.map(|r| r.recompressed)),
        }
    }
}

/// Runs, at the clock's `now`, whatever is due for each of `policies` (see
/// [`DevicePolicy::run_due`]): what the runner thread does at each tick, and what a test
/// calls after moving a [`ManualClock`](uzram::clock::ManualClock).
pub fn run_due(
    policies: &[Arc<DevicePolicy>],
    clock: &dyn Clock,
    pressure: &dyn PressureSource,
    quit: &dyn Fn() -> bool,
) {
    for p in policies {
        if quit() {
            return;
        }
        p.run_due(clock.now(), pressure, quit);
    }
}

/// The devices whose policies a [`PolicyRunner`] runs, shared with the server that adds and
/// removes devices while it runs (`hot_add`, `hot_remove`).
#[derive(Clone, Default)]
pub struct PolicySet(Arc<Mutex<Vec<Arc<DevicePolicy>>>>);

impl std::fmt::Debug for PolicySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicySet")
            .field("devices", &self.0.lock().len())
            .finish()
    }
}

impl PolicySet {
    /// A set of these policies.
    pub fn new(policies: Vec<Arc<DevicePolicy>>) -> PolicySet {
        PolicySet(Arc::new(Mutex::new(policies)))
    }

    /// Adds a device's policies.
    pub fn add(&self, policy: Arc<DevicePolicy>) {
        self.0.lock().push(policy);
    }

    /// Removes device `name`'s policies (an action under way on it finishes).
    pub fn remove(&self, name: &str) {
        self.0.lock().retain(|p| p.name() != name);
    }

    /// The policies now.
    pub fn snapshot(&self) -> Vec<Arc<DevicePolicy>> {
        self.0.lock().clone()
    }
}

/// The policy thread of a server: one for every device. Dropping it stops it.
#[derive(Debug)]
pub struct PolicyRunner {
    quit: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl PolicyRunner {
    /// Starts the thread: every `tick` (of real time) it runs what is due at `clock`'s
    /// reading. A stop interrupts the wait at once, and the policies between actions.
    pub fn start(
        policies: Vec<Arc<DevicePolicy>>,
        clock: Arc<dyn Clock>,
        pressure: Arc<dyn PressureSource>,
        tick: Duration,
    ) -> std::io::Result<PolicyRunner> {
        Self::start_shared(PolicySet::new(policies), clock, pressure, tick)
    }

    /// As [`start`](Self::start), over a list the server changes as devices are added and
    /// removed (`hot_add`, `hot_remove`): each tick runs the devices listed then (the lock is
    /// held only to copy the list).
    pub fn start_shared(
        policies: PolicySet,
        clock: Arc<dyn Clock>,
        pressure: Arc<dyn PressureSource>,
        tick: Duration,
    ) -> std::io::Result<PolicyRunner> {
        let quit = Arc::new((Mutex::new(false), Condvar::new()));
        let q = Arc::clone(&quit);
        let thread = std::thread::Builder::new()
            .name("uzram-policy".into())
            .spawn(move || {
                let stopping = || *q.0.lock();
                loop {
                    let now = policies.snapshot();
                    run_due(&now, &*clock, &*pressure, &stopping);
                    let mut stop = q.0.lock();
                    if !*stop {
                        q.1.wait_for(&mut stop, tick);
                    }
                    if *stop {
                        return;
                    }
                }
            })?;
        Ok(PolicyRunner {
            quit,
            thread: Some(thread),
        })
    }

    /// Stops the thread: at once when it waits; after the action under way otherwise (a
    /// writeback pass, bounded by `writeback_budget`; a compaction; a GC run).
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        let Some(t) = self.thread.take() else { return };
        *self.quit.0.lock() = true;
        self.quit.1.notify_all();
        let _ = t.join();
    }
}

impl Drop for PolicyRunner {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device with `disksize` set, its policies and a second process's view: the device
    /// recovered from its files.
    fn recovered(dev: &Device) -> Arc<Device> {
        Arc::new(Device::recover(dev.state_files().unwrap()).unwrap().0)
    }

    fn new_device() -> Arc<Device> {
        let dev = Device::new_uninit(4096).unwrap();
        dev.attr_store("disksize", "1M").unwrap();
        Arc::new(dev)
    }

    #[test]
    fn saved_settings_come_back_unless_the_configuration_changed() {
        // Configured, changed at runtime: the runtime settings come back over the same
        // configuration (its words spaced otherwise), the configuration's over an edited one.
        let dev = new_device();
        let p = DevicePolicy::new("zram0", Arc::clone(&dev));
        assert_eq!(
            p.restore(true, Some("idle_age_s=600")).unwrap(),
            Restored::Configured
        );
        p.store("compact_ratio=1.5 idle_age_s=off").unwrap();
        let runtime = p.config();
        let again = DevicePolicy::new("zram0", recovered(&dev));
        assert_eq!(
            again.restore(true, Some("  idle_age_s=600 ")).unwrap(),
            Restored::Saved
        );
        assert_eq!(again.config(), runtime);

        // Not named by the configuration (added by hot_add): its saved settings, whatever
        // they were saved over; `off` at runtime comes back off.
        // (The files are the same: a second process of the first.)
        let hot = DevicePolicy::new("zram1", recovered(&dev));
        assert_eq!(hot.restore(false, None).unwrap(), Restored::Saved);
        assert_eq!(hot.config(), runtime);
        // The configuration edited: its settings, saved in turn.
        let edited = DevicePolicy::new("zram0", recovered(&dev));
        assert!(matches!(
            edited.restore(true, Some("idle_age_s=60")).unwrap(),
            Restored::Ignored(_)
        ));
        assert_eq!(edited.config().idle_age_secs, Some(60));
        assert_eq!(edited.config().compact_ratio, None);
        let hot_again = DevicePolicy::new("zram1", recovered(&dev));
        assert_eq!(hot_again.restore(false, None).unwrap(), Restored::Saved);
        assert_eq!(hot_again.config().idle_age_secs, Some(60));
        hot_again.store("off").unwrap();
        let hot_again = DevicePolicy::new("zram1", recovered(&dev));
        assert_eq!(hot_again.restore(false, None).unwrap(), Restored::Saved);
        assert_eq!(hot_again.config(), PolicyConfig::default());

        // Nothing saved: the configuration's, or nothing.
        let fresh = new_device();
        let p = DevicePolicy::new("zram2", recovered(&fresh));
        assert_eq!(p.restore(false, None).unwrap(), Restored::None);
        assert_eq!(p.config(), PolicyConfig::default());
        // A saved text this binary does not read: ignored.
        fresh
            .save_policy("config none\npolicy no_such_key=1\n")
            .unwrap();
        let p = DevicePolicy::new("zram2", recovered(&fresh));
        assert!(matches!(
            p.restore(true, Some("gc_free_zones=2")).unwrap(),
            Restored::Ignored(_)
        ));
        assert_eq!(p.config().gc_free_zones, Some(2));
    }

    #[test]
    fn the_saved_state_round_trips_cut_to_fit_and_junk_is_not_taken() {
        let sched = Schedule {
            last_period: Some(Duration::from_nanos(123_456_789_012)),
            last_pressure: None,
            last_check: Some(Duration::from_secs(5)),
            budget_start: Some(Duration::ZERO),
        };
        let mut counters: [PolicyCounters; 5] = Default::default();
        counters[PolicyKind::Writeback as usize] = PolicyCounters {
            runs: 7,
            pages: 1 << 40,
            errors: 2,
            last_error: Some("EIO: a line\nand another".into()),
        };
        // The longest errors, of characters of several bytes: cut at a boundary.
        for k in [PolicyKind::Recompress, PolicyKind::Gc, PolicyKind::Compact] {
            counters[k as usize].last_error = Some(format!("x{}", "é".repeat(SAVED_ERROR_BYTES)));
        }
        let text = encode_state(&sched, &counters);
        assert!(text.len() <= uzram::device::restart::MAX_POLICY_TEXT_BYTES);
        let (back, got) = decode_state(&text).unwrap();
        assert_eq!(back.last_period, sched.last_period);
        assert_eq!(back.last_pressure, None);
        assert_eq!(back.last_check, None, "not saved");
        assert_eq!(back.budget_start, Some(Duration::ZERO));
        let w = &got[PolicyKind::Writeback as usize];
        assert_eq!((w.runs, w.pages, w.errors), (7, 1 << 40, 2));
        assert_eq!(w.last_error.as_deref(), Some("EIO: a line and another"));
        let cut = got[PolicyKind::Gc as usize].last_error.clone().unwrap();
        assert_eq!(cut, format!("x{}", "é".repeat(SAVED_ERROR_BYTES / 2 - 1)));
        assert_eq!(got[PolicyKind::Idle as usize], PolicyCounters::default());
        for junk in [
            "",
            "schedule 1 2\n",
            &text.replace("writeback 7", "writeback x"),
            &text.replace("idle", "idol"),
            &format!("{text}more\n"),
        ] {
            assert!(decode_state(junk).is_none(), "{junk:?}");
        }
        // A reading from another clock, later than the runner's now: forgotten.
        let mut s = back;
        s.forget_future(Duration::from_secs(100));
        assert_eq!(s.last_period, None);
        assert_eq!(s.budget_start, Some(Duration::ZERO));
    }
}
