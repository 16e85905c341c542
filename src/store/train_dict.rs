//! `train_dict` (uzram's own): trains a zstd dictionary from the device's own pages and
//! installs it as a new dictionary generation of a recompression priority, so later
//! `recompress` runs use it; pages written with earlier generations stay readable (see
//! [`Codecs`](super::Codecs)).
//!
//! 1. The caller holds `pp_lock`: no recompression or writeback runs meanwhile.
//! 2. Sample: up to `samples` pages held in RAM, spread evenly over the device (every k-th
//!    such page), each decompressed under its slot lock into one sample buffer (same-filled,
//!    empty and written-back pages are skipped: they teach nothing, or cost backing I/O; a
//!    page of a multi-page object is sampled as a page, from its group decompressed once).
//! 3. Train with libzstd's trainer (`ZDICT_trainFromBuffer`) outside any lock, into a
//!    dictionary of at most `dict_size` bytes.
//! 4. Write it to `path` when one is given (created or truncated, mode 0600) before anything
//!    changes, so a write failure installs nothing.
//! 5. Build a zstd codec with it (the priority's level, or `level=`), have the device save it
//!    (the `save` closure: its dictionary written whole into the device's files, so the next
//!    process finds every generation a slot can name), and only then install it as the
//!    priority's new current generation.

use super::{Source, Store};
use crate::compress::{self, CodecParams, Dictionary, MAX_DICT_BYTES};
use crate::error::{Error, ErrorKind, Result};
use crate::slot::SlotIndex;
use crate::units::{kstrtou64, parse_size_bytes, strip_newline};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

/// The dictionary size `train_dict` makes by default: zstd's own default (`zstd --train`),
/// 110 KiB.
pub const DEFAULT_DICT_SIZE_BYTES: u64 = 112_640;

/// The smallest dictionary `train_dict` makes: below this libzstd's trainer has no room for
/// its tables and content.
pub const MIN_DICT_SIZE_BYTES: u64 = 1024;

/// Pages `train_dict` samples by default: 2048 pages (8 MiB of 4 KiB pages), about 100 times
/// the default dictionary, the ratio zstd's documentation suggests.
pub const DEFAULT_SAMPLES: u64 = 2048;

/// The most sample bytes `train_dict` holds (the pages are copied into one buffer for the
/// trainer): 64 MiB, so one attribute write cannot make the server hold more.
pub const MAX_SAMPLE_BYTES: u64 = 64 << 20;

/// What a `train_dict` write asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainSpec {
    /// `priority=N`: the recompression priority (its algorithm must be zstd); default the
    /// first zstd recompression priority. `algo=zstd` picks that one too.
    pub priority: Option<u32>,
    /// `dict_size=BYTES` (size suffixes allowed).
    pub dict_size_bytes: u64,
    /// `samples=N`: pages to sample at most.
    pub samples: u64,
    /// `level=N`: zstd level of the new generation; default the priority's.
    pub level: Option<i32>,
    /// `path=PATH`: where to save the dictionary.
    pub path: Option<PathBuf>,
}

impl TrainSpec {
    /// Parses `key=value` tokens (`priority`, `algo`, `dict_size`, `samples`, `level`, `path`;
    /// other keys ignored, as zram's attributes do). `EINVAL` for a token without a value, a
    /// malformed number, `algo` other than zstd, `dict_size` outside
    /// [`MIN_DICT_SIZE_BYTES`]..=[`MAX_DICT_BYTES`] or `samples` of 0.
    pub fn parse(value: &str) -> Result<TrainSpec> {
        let mut spec = TrainSpec {
            priority: None,
            dict_size_bytes: DEFAULT_DICT_SIZE_BYTES,
            samples: DEFAULT_SAMPLES,
            level: None,
            path: None,
        };
        for tok in strip_newline(value).split_ascii_whitespace() {
            let (key, val) = tok.split_once('=').unwrap_or((tok, ""));
            if val.is_empty() {
                return Err(Error::invalid(format!("train_dict: {key} has no value")));
            }
            match key {
                "priority" => {
                    spec.priority = Some(u32::try_from(kstrtou64(val, 10)?).map_err(|_| {
                        Error::new(ErrorKind::OutOfRange, format!("priority {val} too large"))
                    })?)
                }
                "algo" if val != "zstd" => {
                    return Err(Error::invalid(format!(
                        "train_dict: algo={val}: only zstd dictionaries are trained"
                    )))
                }
                "dict_size" => spec.dict_size_bytes = parse_size_bytes(val)?,
                "samples" => spec.samples = kstrtou64(val, 10)?,
                "level" => {
                    spec.level =
                        Some(val.parse().map_err(|_| {
                            Error::invalid(format!("train_dict: bad level {val:?}"))
                        })?)
                }
                "path" => spec.path = Some(PathBuf::from(val)),
                _ => {}
            }
        }
        if !(MIN_DICT_SIZE_BYTES..=MAX_DICT_BYTES).contains(&spec.dict_size_bytes) {
            return Err(Error::invalid(format!(
                "train_dict: dict_size={} outside {MIN_DICT_SIZE_BYTES}..={MAX_DICT_BYTES}",
                spec.dict_size_bytes
            )));
        }
        if spec.samples == 0 {
            return Err(Error::invalid("train_dict: samples=0"));
        }
        Ok(spec)
    }
}

/// A dictionary generation about to be installed: what the device saves of it before it
/// becomes current (see [`Store::train_dict`]).
#[derive(Debug)]
pub(crate) struct NewGeneration<'a> {
    /// The recompression priority.
    pub(crate) prio: u8,
    /// The generation it will be.
    pub(crate) gen: u8,
    /// Its codec's level (`None`: zstd's default).
    pub(crate) level: Option<i32>,
    /// The dictionary.
    pub(crate) dict: &'a [u8],
}

/// What one training did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainReport {
    /// The priority trained for.
    pub priority: u8,
    /// The generation installed.
    pub generation: u8,
    /// Pages sampled.
    pub samples: u64,
    /// Bytes of the dictionary.
    pub dict_bytes: usize,
}

impl Store {
    /// Trains and installs a dictionary (see the module docs), `save` saving the new
    /// generation before it becomes current; the caller holds `pp_lock`. `EINVAL` for a
    /// priority without zstd, too many sample bytes, or pages the trainer cannot learn from
    /// (too few or too alike); `EBUSY` when every generation is held; the error of writing
    /// `path`, or of `save` (nothing installed then).
    pub(crate) fn train_dict(
        &self,
        spec: &TrainSpec,
        save: &dyn Fn(&NewGeneration<'_>) -> Result<()>,
    ) -> Result<TrainReport> {
        let prio = match spec.priority {
            Some(p) => p as usize,
            None => (1..compress::MAX_COMPS)
                .find(|&p| self.codecs.name(p) == Some("zstd"))
                .ok_or_else(|| Error::invalid("train_dict: no recompression priority uses zstd"))?,
        };
        if prio == 0 || self.codecs.name(prio) != Some("zstd") {
            return Err(Error::invalid(format!(
                "train_dict: priority {prio} is not a zstd recompression algorithm"
            )));
        }
        let ps = self.page_size_bytes as u64;
        if spec.samples.saturating_mul(ps) > MAX_SAMPLE_BYTES {
            return Err(Error::invalid(format!(
                "train_dict: samples={} pages of {ps} bytes exceed {MAX_SAMPLE_BYTES} bytes",
                spec.samples
            )));
        }
        let (data, sizes) = self.sample_pages(spec.samples as usize);
        let trained = zstd::dict::from_continuous(&data, &sizes, spec.dict_size_bytes as usize)
            .map_err(|e| {
                Error::invalid(format!(
                    "train_dict: libzstd could not train on {} pages: {e} (too few pages, or \
                     too alike)",
                    sizes.len()
                ))
            })?;
        drop(data);
        if let Some(path) = &spec.path {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(path)?;
            f.write_all(&trained)?;
        }
        let dict_bytes = trained.len();
        let dict = Dictionary::from_bytes(trained)?;
        let base = self.codecs.params(prio).cloned().unwrap_or_default();
        let level = spec.level.or(base.level);
        let params = CodecParams {
            level,
            dict: Some(dict.clone()),
        };
        let codec = compress::new_codec("zstd", params)?;
        let generation = self.codecs.install(prio, codec, dict_bytes, |gen| {
            save(&NewGeneration {
                prio: prio as u8,
                gen,
                level,
                dict: dict.bytes(),
            })
        })?;
        Ok(TrainReport {
            priority: prio as u8,
            generation,
            samples: sizes.len() as u64,
            dict_bytes,
        })
    }

    /// Up to `max` pages held in RAM, spread over the device, decompressed into one buffer;
    /// with the size of each.
    fn sample_pages(&self, max: usize) -> (Vec<u8>, Vec<usize>) {
        let ps = self.page_size_bytes;
        let in_ram = |i: u64| {
            let st = self.slots.entry(SlotIndex(i)).state_unlocked();
            st.handle_raw().is_some()
        };
        let held = (0..self.nr_pages()).filter(|&i| in_ram(i)).count();
        let stride = (held / max.max(1)).max(1);
        let mut data = Vec::with_capacity(max.min(held) * ps);
        let mut sizes = Vec::new();
        let mut page = vec![0u8; ps];
        let mut seen = 0usize;
        for i in 0..self.nr_pages() {
            if sizes.len() >= max {
                break;
            }
            if !in_ram(i) {
                continue;
            }
            seen += 1;
            if (seen - 1) % stride != 0 {
                continue;
            }
            let g = self.slots.lock(SlotIndex(i));
            if g.state().handle_raw().is_none() {
                continue;
            }
            // The page as a read sees it (a page of a multi-page object through the thread's
            // group cache, so a group's sampled pages decompress it once), without an access.
            let ok = matches!(self.read_slot(&g, &mut page), Ok(Source::Done));
            drop(g);
            if ok && compress::same_filled_word(&page).is_none() {
                data.extend_from_slice(&page);
                sizes.push(ps);
            }
        }
        (data, sizes)
    }
}
