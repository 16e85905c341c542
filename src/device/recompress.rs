//! The device's recompression entry points: the `recomp_algorithm`, `recompress` and
//! `recomp_stat` attributes. The device's part is its settings and locks (the init lock held
//! shared for the whole run, so `reset` waits for it; `pp_lock`, one post-processing operation
//! at a time, `EAGAIN` for a second); the work is the store's ([`crate::store`]'s
//! `recompress`).

use super::Device;
use crate::compress::{self, MAX_COMPS};
use crate::error::{Error, ErrorKind, Result};
use crate::recompress::{RecompressReport, RecompressSpec};
use crate::store::{GenStat, TrainReport, TrainSpec};
use crate::units::strip_newline;

impl Device {
    /// Recompresses what `spec` selects, as writing `recompress` does. Errors, in the kernel's
    /// order: `threshold` at or above the huge threshold or an uninitialised device `EINVAL`;
    /// a writeback or recompression running `EAGAIN`; no recompression algorithm at the
    /// priorities asked for, or an `algo` not configured, `EINVAL`. A codec or allocation
    /// failure stops the run with its error, the pages done so far kept.
    pub fn recompress(&self, spec: &RecompressSpec) -> Result<RecompressReport> {
        self.recompress_with_progress(spec, &mut |_| {})
    }

    /// Like [`Device::recompress`], calling `progress` after every page tried. The callback
    /// must not call into this device (the run holds the init lock shared).
    pub fn recompress_with_progress(
        &self,
        spec: &RecompressSpec,
        progress: &mut dyn FnMut(&RecompressReport),
    ) -> Result<RecompressReport> {
        let store = self.store()?;
        store.check_threshold(spec.threshold_bytes)?;
        let Some(_pp) = self.pp_lock.try_lock() else {
            return Err(Error::new(
                ErrorKind::Again,
                "a writeback or recompression is in progress",
            ));
        };
        crate::recompress::run(&store, spec, progress)
    }

    /// Trains a zstd dictionary from the device's pages and installs it as the new dictionary
    /// generation of a recompression priority, as writing `train_dict` does (see
    /// `docs/attributes.md`). `EINVAL` uninitialised or a bad spec; `EAGAIN` while a writeback
    /// or recompression runs; `EBUSY` when the priority holds every generation.
    pub fn train_dict(&self, spec: &TrainSpec) -> Result<TrainReport> {
        let store = self.store()?;
        let Some(_pp) = self.pp_lock.try_lock() else {
            return Err(Error::new(
                ErrorKind::Again,
                "a writeback or recompression is in progress",
            ));
        };
        let header = store
            .guard
            .header
            .as_ref()
            .ok_or_else(|| Error::invalid("the device has no state header"))?;
        // The new generation is saved for the next process before it becomes current.
        store.train_dict(spec, &|new| self.save_generation(header, &store, new))
    }

    /// The dictionary generations of recompression priority `prio` (`None` without one, or
    /// uninitialised).
    pub fn dict_generations(&self, prio: usize) -> Option<GenStat> {
        self.store().ok()?.codecs_gen_stat(prio)
    }

    /// The `recompress` attribute: parse, then run.
    pub(crate) fn recompress_str(&self, value: &str) -> Result<()> {
        self.recompress_str_with(value, &mut |_, _| {})
    }

    /// The `recompress` attribute, calling `progress(report so far, max_pages)` as
    /// [`Device::recompress_with_progress`] does.
    pub(crate) fn recompress_str_with(
        &self,
        value: &str,
        progress: &mut dyn FnMut(&RecompressReport, Option<u64>),
    ) -> Result<()> {
        let spec = RecompressSpec::parse(value)?;
        let max_pages = spec.max_pages;
        self.recompress_with_progress(&spec, &mut |r| progress(r, max_pages))
            .map(|_| ())
    }

    /// The codec priority of page `index` when it is held in RAM as an object (`testing`: for
    /// benchmarks that measure reads of recompressed pages); `None` for empty, same-filled,
    /// written-back or out-of-range pages and an uninitialised device.
    #[cfg(any(test, feature = "testing"))]
    pub fn debug_slot_priority(&self, index: u64) -> Option<u8> {
        self.store().ok()?.debug_slot_priority(index)
    }

    /// The recompression algorithm of priority `prio` (1..=3), if set.
    pub fn recomp_algorithm(&self, prio: usize) -> Option<String> {
        self.state
            .read()
            .settings
            .recomp_algorithms
            .get(prio)?
            .clone()
    }
}

/// `recomp_algorithm` shows, for each priority with an algorithm, `#N: ` and the list of
/// algorithms with the selected one in brackets (the kernel's `recomp_algorithm_show`); nothing
/// when none is set.
pub(super) fn show_recomp_algorithm(d: &Device) -> String {
    let mut out = String::new();
    for prio in 1..MAX_COMPS {
        if let Some(alg) = d.recomp_algorithm(prio) {
            out.push_str(&format!("#{prio}: "));
            out.push_str(&super::attrs::algorithm_list(&alg));
        }
    }
    out
}

/// `recomp_algorithm` takes `algo=NAME [priority=N]` (priority default 1, range 1..=3; other
/// keys ignored). `EINVAL` for a token without value, no `algo`, a bad or out-of-range
/// priority, or an algorithm uzram does not have (checked before `EBUSY`, as the kernel
/// does); `EBUSY` once initialised. The priority's `algorithm_params` are kept.
pub(super) fn store_recomp_algorithm(d: &Device, value: &str) -> Result<()> {
    let mut algo = None;
    let mut prio: i64 = 1;
    for tok in strip_newline(value).split_ascii_whitespace() {
        let (key, val) = tok.split_once('=').unwrap_or((tok, ""));
        if val.is_empty() {
            return Err(Error::invalid(format!(
                "recomp_algorithm: {key} has no value"
            )));
        }
        match key {
            "algo" => algo = Some(val),
            "priority" => {
                prio = val.parse().map_err(|_| {
                    Error::invalid(format!("recomp_algorithm: bad priority {val:?}"))
                })?
            }
            _ => {}
        }
    }
    let algo = algo.ok_or_else(|| Error::invalid("recomp_algorithm: algo=NAME is required"))?;
    if !(1..MAX_COMPS as i64).contains(&prio) {
        return Err(Error::invalid(format!(
            "recomp_algorithm: priority {prio} outside 1..={}",
            MAX_COMPS - 1
        )));
    }
    compress::check_algorithm(algo)?;
    let mut st = d.settings_for("recomp_algorithm")?;
    st.settings.recomp_algorithms[prio as usize] = Some(algo.to_string());
    Ok(())
}

/// `train_dict`: parse, then train.
pub(super) fn store_train_dict(d: &Device, value: &str) -> Result<()> {
    d.train_dict(&TrainSpec::parse(value)?).map(|_| ())
}

/// `dict_stat` (uzram's own): one line per recompression priority of an initialised device,
/// `#N: current=G` then `GEN:PAGES:BYTES` for each generation held (its slots, its dictionary
/// bytes).
pub(super) fn show_dict_stat(d: &Device) -> String {
    let mut out = String::new();
    for prio in 1..MAX_COMPS {
        if let Some(g) = d.dict_generations(prio) {
            out.push_str(&format!("#{prio}: current={}", g.current));
            for (gen, pages, bytes) in g.held {
                out.push_str(&format!(" {gen}:{pages}:{bytes}"));
            }
            out.push('\n');
        }
    }
    out
}

/// `recomp_stat` (uzram's own): `tried recompressed incompressible`, `%8llu` each, pages since
/// initialisation.
pub(super) fn show_recomp_stat(d: &Device) -> String {
    let s = d.stats();
    format!(
        "{:8} {:8} {:8}\n",
        s.recomp_tried, s.recomp_done, s.recomp_incompressible
    )
}
