//! Recompression (zram's `recompress_store`): pages stored with the
//! primary codec are compressed again with the recompression codecs (`recomp_algorithm`), in
//! priority order, and replaced when that saves memory.
//!
//! # Life of one recompression
//!
//! 1. Only one post-processing operation (writeback or recompression) runs at a time: the
//!    device's `pp_lock`, taken by the caller, so PP_SLOT belongs to this run.
//! 2. Scan: every slot holding an object in RAM that the spec accepts (IDLE for `type=idle`,
//!    HUGE for `type=huge`, both for `huge_idle`; never INCOMPRESSIBLE; never one already
//!    written by the highest priority asked for) is marked PP_SLOT and bucketed by size
//!    ([`PpCtl`], the selection writeback uses too): the largest objects are tried first, as the
//!    kernel does, so `max_pages` spends its budget where most memory is.
//! 3. For each candidate, under its slot lock: if it still has PP_SLOT and its object is at
//!    least `threshold` bytes, decompress it (or copy a HUGE page) into a page buffer and clear
//!    IDLE (recompression touched it, as the kernel says: a later `writeback idle` must not
//!    take it for an old page). The lock is dropped.
//! 4. Outside any lock, compress the page with each configured codec from the first priority
//!    above the slot's own (and at least the spec's) up to the last one asked for, stopping at
//!    the first whose object lands in a **smaller size class** than the old one, below the
//!    huge threshold, and below `threshold` when one is given (a smaller object in the same
//!    class saves no memory). Every page that gets this far counts against `max_pages`,
//!    shrunk or not, as in the kernel.
//! 5. Success: allocate and fill the new object, retake the slot lock and, only if the slot
//!    still has PP_SLOT and still holds the old handle (any read, write or free in between
//!    clears PP_SLOT: the access wins and the new object is freed), free the old object and
//!    point the slot at the new one with the new priority (flags cleared, as zram's
//!    `zram_free_page` + `zram_set_priority`; the access time is kept: recompression is not
//!    an access). `compr_data_size` and `huge_pages` move as for any replacement.
//! 6. No codec shrank it: if the codecs tried included the highest configured one, the slot is
//!    marked INCOMPRESSIBLE (so later recompressions skip it and `writeback incompressible`
//!    takes it); otherwise it is left as it was.
//! 7. At the end every candidate not reached loses PP_SLOT.
//!
//! A multi-page object (`multi_page_size`) goes through the same steps as one candidate
//! (`Store::recompress_group`), under the locks of its group's slots (ascending) where a page
//! takes its slot's: only when every page still pointing into it is marked (writeback's
//! rule); the group is decompressed whole; a result must also stay below the size above which a
//! group is stored page by page, and `threshold` compares bytes per page; the new object and its
//! codec id go to every page still pointing at the old one, and the old handle's cached groups
//! are invalidated (`multi_frees`) before it is freed.
//!
//! The scan and this loop are here; each candidate's slot-state change is the store's
//! (`Store::recompress_slot`, `Store::recompress_group`).

use crate::compress::compress_bound;
use crate::error::{Error, ErrorKind, Result};
use crate::pp::PpCtl;
use crate::slot::{SlotFlags, SlotState};
use crate::store::{Outcome, Store};
use crate::units::{kstrtou64, strip_newline};

/// What a `recompress` write asks for (zram's `recompress_store` arguments).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecompressSpec {
    /// Only IDLE slots (`type=idle`, `type=huge_idle`).
    pub idle: bool,
    /// Only HUGE slots (`type=huge`, `type=huge_idle`).
    pub huge: bool,
    /// Pages to try at most (`max_pages=N`); `None`: no limit.
    pub max_pages: Option<u64>,
    /// `threshold=BYTES`: only objects at least this large, and only results smaller than
    /// it; 0: no threshold. Must be below the huge threshold.
    pub threshold_bytes: u64,
    /// `algo=NAME`: only this recompression algorithm.
    pub algo: Option<String>,
    /// `priority=N`: only this priority (0 means 1, as in the kernel).
    pub priority: Option<u32>,
}

impl RecompressSpec {
    /// Parses the value written to `recompress`: space-separated `key=value` tokens (`type`,
    /// `max_pages`, `threshold`, `algo`, `priority`; other keys are ignored, as in zram). A
    /// token without a value, an unknown type or a malformed number is `EINVAL`; a number too
    /// large for its field `ERANGE` (the kernel's `kstrtouint`).
    pub fn parse(value: &str) -> Result<RecompressSpec> {
        let mut spec = RecompressSpec::default();
        for tok in strip_newline(value).split_ascii_whitespace() {
            let (key, val) = tok.split_once('=').unwrap_or((tok, ""));
            if val.is_empty() {
                return Err(Error::invalid(format!("recompress: {key} has no value")));
            }
            match key {
                "type" => {
                    (spec.idle, spec.huge) = match val {
                        "idle" => (true, false),
                        "huge" => (false, true),
                        "huge_idle" => (true, true),
                        _ => {
                            return Err(Error::invalid(format!(
                                "recompress: type={val}: idle, huge or huge_idle"
                            )))
                        }
                    }
                }
                "max_pages" => spec.max_pages = Some(kstrtou64(val, 10)?),
                "threshold" => spec.threshold_bytes = kstrtou32(val)?.into(),
                "algo" => spec.algo = Some(val.to_string()),
                "priority" => spec.priority = Some(kstrtou32(val)?),
                _ => {}
            }
        }
        Ok(spec)
    }
}

/// The kernel's `kstrtouint(val, 10)`: `EINVAL` malformed, `ERANGE` above `u32::MAX`.
fn kstrtou32(val: &str) -> Result<u32> {
    let v = kstrtou64(val, 10)?;
    u32::try_from(v)
        .map_err(|_| Error::new(ErrorKind::OutOfRange, format!("{val} is over {}", u32::MAX)))
}

/// What one recompression did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecompressReport {
    /// Slots selected by the scan.
    pub candidates: u64,
    /// Pages the codecs were tried on (what `max_pages` counts).
    pub tried: u64,
    /// Pages replaced with a smaller object.
    pub recompressed: u64,
    /// Pages marked INCOMPRESSIBLE.
    pub incompressible: u64,
    /// Pages accessed (read, written, freed) while being recompressed: left as the access left
    /// them.
    pub raced: u64,
    /// Candidates not tried (no longer a candidate, below the threshold, or already at a
    /// priority as high as asked); they do not count against `max_pages`.
    pub skipped: u64,
    /// Bytes of `compr_data_size` saved.
    pub saved_bytes: u64,
}

/// Runs a recompression (see the module docs); the caller holds `pp_lock`. `progress` is
/// called after every candidate tried or skipped. Returns `Err` for a bad spec (nothing done) or, with the
/// work done so far kept, for a codec or allocation failure, which stops the run (zram
/// returns it from the write).
pub(crate) fn run(
    store: &Store,
    spec: &RecompressSpec,
    progress: &mut dyn FnMut(&RecompressReport),
) -> Result<RecompressReport> {
    let threshold = store.check_threshold(spec.threshold_bytes)?;
    let range = store.prio_range(spec.priority, spec.algo.as_deref())?;
    let mut ctl = PpCtl::new(store.page_size_bytes());
    ctl.scan_with(store, 0, store.nr_pages(), |st: &SlotState| {
        (!spec.idle || st.has(SlotFlags::IDLE))
            && (!spec.huge || st.has(SlotFlags::HUGE))
            && !st.has(SlotFlags::INCOMPRESSIBLE)
            && usize::from(st.prio()) + 1 < range.hi
    });
    let mut report = RecompressReport {
        candidates: ctl.total(),
        ..RecompressReport::default()
    };
    let mut budget = spec.max_pages.unwrap_or(u64::MAX);
    // A page, or a multi-page object's group.
    let group_bytes = store.multi_pages() * store.page_size_bytes();
    let mut page = vec![0u8; group_bytes];
    let mut dst = vec![0u8; compress_bound(group_bytes)];
    let mut result = Ok(());
    while budget > 0 {
        let Some(index) = ctl.select() else { break };
        let outcome = if store.multi_pages() > 1 && store.is_multi(index) {
            store.recompress_group(index, threshold, range, &mut page, &mut dst)
        } else {
            let ps = store.page_size_bytes();
            store.recompress_slot(index, threshold, range, &mut page[..ps], &mut dst)
        };
        let outcome = match outcome {
            Ok(o) => o,
            Err(e) => {
                report.tried += 1;
                result = Err(e);
                break;
            }
        };
        match outcome {
            Outcome::Skipped => {
                report.skipped += 1;
                progress(&report);
                continue;
            }
            Outcome::Recompressed(old, new) => {
                report.recompressed += 1;
                report.saved_bytes += (old - new) as u64;
            }
            Outcome::NotSmaller(marked) => report.incompressible += u64::from(marked),
            Outcome::Raced => report.raced += 1,
        }
        report.tried += 1;
        budget -= 1;
        progress(&report);
    }
    ctl.release(store);
    result.map(|()| report)
}
