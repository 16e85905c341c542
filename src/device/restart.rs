//! A device's state for a new process (`docs/restart.md`): the files that hold it, the
//! settings header written at `disksize`, and recovery.
//!
//! The header is a memfd of its own holding the settings the store was built with, as text:
//! a magic line with the format's version, then `key value` lines (the last ones, which
//! headers of earlier binaries lack, read as none). After the header page come the two limits
//! slots ([`Limits`]), then the dictionary records ([`DictMeta`]: every codec generation and
//! its dictionary), then the two policy slots and the two policy state slots
//! ([`PolicyRecord`]: the server's `policy`, and what its policies did and when). Recovery
//! reads them, refuses settings whose state it cannot rebuild (a
//! dictionary in a header of a binary from before the records), rebuilds the codecs (the
//! primary and the recompression ones, with their dictionaries and generations) and then the
//! store from its files, checking everything (`store::restore`, `zsmalloc::restore`).
//!
//! | bytes | what |
//! |---|---|
//! | 0..4 KiB | the header's text |
//! | 4..12 KiB | the two limits slots, a page each |
//! | 12 KiB.. | the dictionary records: the primary's, then 8 generations of each recompression priority, each 4 KiB of text and room for 4 MiB of dictionary (sparse: only what is written costs memory) |
//! | after the last dictionary room (100 MiB + 112 KiB).. +8 KiB | the two policy slots, a page each ([`PolicyRecord`]; written once a policy is saved, in headers with dictionary records or without) |
//! | +8 KiB.. +16 KiB | the two policy state slots, a page each (the same, for [`PolicyText::State`]: written once the server's policy thread has acted) |

use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::{Device, Settings, MULTI_PAGE_SIZES_BYTES};
use crate::backing::verify::crc32c_of;
use crate::backing::Backing;
use crate::clock::SystemClock;
use crate::compress::{self, Codec, CodecParams, Dictionary, MAX_COMPS, MAX_DICT_BYTES};
use crate::error::{Error, Result};
use crate::memory::SwapReserve;
use crate::shm::ShmFile;
use crate::slot::MAX_GENS;
pub use crate::store::RecoveryReport;
use crate::store::{BackingLayout, Codecs, NewGeneration, SavedGens, Store, StoreFiles, WbTarget};
use crate::zsmalloc::PoolFiles;

/// A slot record's text: `body` (whole lines) then a last line with its FNV-1a checksum.
fn seal(body: &str) -> String {
    let sum = fnv1a(body.as_bytes());
    format!("{body}sum {sum:016x}\n")
}

/// The body of a record [`seal`]ed into `bytes` (zero-padded to its slot), or `None` if the
/// slot holds none or a torn one (its checksum fails).
fn unseal(bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(bytes.split(|&b| b == 0).next()?).ok()?;
    let (body, sum_line) = text.trim_end_matches('\n').rsplit_once('\n')?;
    let body = format!("{body}\n");
    let sum = u64::from_str_radix(sum_line.strip_prefix("sum ")?, 16).ok()?;
    (sum == fnv1a(body.as_bytes())).then_some(body)
}

/// The header's first line without dictionary records: the format and its version 1, every
/// codec as the header's lines say, without a dictionary. Written for a device that cannot
/// hold a dictionary (no `dict=`, no zstd recompression priority for `train_dict`), so a
/// binary from before the records recovers it too.
const MAGIC_V1: &str = "uzram-device-state 1";
/// The header's first line with dictionary records (version 2): every codec generation is in
/// its record ([`DictMeta`]). A binary from before the records refuses it (its first line is
/// not the one it knows) rather than read a dictionary's pages without the dictionary. Differs
/// from [`MAGIC_V1`] in its last byte only, so a version 1 header becomes version 2 with one
/// byte written ([`Device::save_generation`]).
const MAGIC_V2: &str = "uzram-device-state 2";
/// The header's size.
const HEADER_BYTES: usize = 4096;

/// The files holding an initialised device's state: new descriptors of them, to hand to
/// another process ([`into_fds`](Self::into_fds) and [`from_fds`](Self::from_fds) fix their
/// order).
#[derive(Debug)]
pub struct DeviceFiles {
    /// The settings header.
    pub header: ShmFile,
    /// The store's files.
    pub store: StoreFiles,
}

/// How many descriptors a [`DeviceFiles`] is made of.
pub const DEVICE_FILES: usize = 5;

impl DeviceFiles {
    /// The descriptors, in the order [`from_fds`](Self::from_fds) takes them.
    pub fn into_fds(self) -> [OwnedFd; DEVICE_FILES] {
        [
            self.header.into_fd(),
            self.store.slots.into_fd(),
            self.store.pool.handles.into_fd(),
            self.store.pool.frames.into_fd(),
            self.store.pool.records.into_fd(),
        ]
    }

    /// The files of descriptors another process handed over, in [`into_fds`](Self::into_fds)'
    /// order.
    pub fn from_fds(fds: [OwnedFd; DEVICE_FILES]) -> DeviceFiles {
        let [header, slots, handles, frames, records] = fds.map(ShmFile::from_fd);
        DeviceFiles {
            header,
            store: StoreFiles {
                slots,
                pool: PoolFiles {
                    handles,
                    frames,
                    records,
                },
            },
        }
    }
}

impl DeviceFiles {
    /// The backing device the saved device wrote back to, opened again by the name its
    /// header recorded (a file or block device path, or an NBD URI, as `backing_dev` takes
    /// them), for [`Recover::backing`] when no configuration names the device (one added by
    /// `hot_add`); `Ok(None)` if it had none. `EINVAL` for a header that is not one, the
    /// open's error otherwise.
    pub fn open_recorded_backing(&self) -> Result<Option<Arc<dyn Backing>>> {
        let header = Header::decode(&self.header.read_at(0, HEADER_BYTES)?)?;
        header
            .backing
            .map(|(name, _, _)| super::attrs::open_backing_dev(&name))
            .transpose()
    }
}

/// The settings a header records.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Header {
    page_size_bytes: usize,
    pages: u64,
    multi_page_size_bytes: usize,
    comp_algorithm: String,
    level: Option<i32>,
    /// What the binary that wrote the header did not keep, if anything: binaries from before
    /// the dictionary records wrote `a dictionary` here (recovery refuses it); this one
    /// writes none.
    unsupported: Option<String>,
    /// Serving swap: its pool's record tag in the server's swap reserve.
    swap_pool: Option<u16>,
    /// The backing device written back to (`Backing::describe`), its size, and
    /// `compressed_writeback`; `None` without one.
    backing: Option<(String, u64, bool)>,
    /// The recompression codecs: priority (1 and up), algorithm, level.
    recomp: Vec<(usize, String, Option<i32>)>,
    /// Writing back in the zoned layout: its zone size (`None`: the bitmap layout).
    zoned: Option<u64>,
    /// Version 2: the codecs' dictionary records follow the limits slots.
    dicts: bool,
}

impl Header {
    fn encode(&self) -> String {
        format!(
            "{}\npage_size {}\npages {}\nmulti_page_size {}\ncomp_algorithm {}\nlevel {}\n\
             unsupported {}\nswap_pool {}\nbacking {}\nrecomp {}\nzoned {}\n",
            if self.dicts { MAGIC_V2 } else { MAGIC_V1 },
            self.page_size_bytes,
            self.pages,
            self.multi_page_size_bytes,
            self.comp_algorithm,
            self.level.map_or("none".to_string(), |l| l.to_string()),
            self.unsupported
                .as_deref()
                .unwrap_or("none")
                .replace('\n', " "),
            self.swap_pool.map_or("none".to_string(), |t| t.to_string()),
            self.backing
                .as_ref()
                .map_or("none".to_string(), |(name, bytes, compressed)| {
                    format!(
                        "{bytes} {} {}",
                        u8::from(*compressed),
                        name.replace('\n', " ")
                    )
                }),
            if self.recomp.is_empty() {
                "none".to_string()
            } else {
                self.recomp
                    .iter()
                    .map(|(prio, alg, level)| {
                        format!(
                            "{prio}:{alg}:{}",
                            level.map_or("none".to_string(), |l| l.to_string())
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            },
            self.zoned.map_or("none".to_string(), |z| z.to_string()),
        )
    }

    fn decode(bytes: &[u8]) -> Result<Header> {
        let bad = |what: &str| Error::invalid(format!("recovery: the device header {what}"));
        let text = std::str::from_utf8(bytes.split(|&b| b == 0).next().unwrap_or(&[]))
            .map_err(|_| bad("is not text"))?;
        let mut lines = text.lines();
        let dicts = match lines.next() {
            Some(MAGIC_V1) => false,
            Some(MAGIC_V2) => true,
            _ => {
                return Err(bad(&format!(
                    "does not start with {MAGIC_V1:?} or {MAGIC_V2:?}"
                )))
            }
        };
        let mut field = |key: &str| -> Result<String> {
            let line = lines.next().ok_or_else(|| bad(&format!("has no {key}")))?;
            line.strip_prefix(key)
                .and_then(|v| v.strip_prefix(' '))
                .map(str::to_string)
                .ok_or_else(|| bad(&format!("has {line:?} where {key} belongs")))
        };
        let num = |v: String, key: &str| -> Result<u64> {
            v.parse().map_err(|_| bad(&format!("has {key} {v:?}")))
        };
        let page_size_bytes = num(field("page_size")?, "page_size")? as usize;
        let pages = num(field("pages")?, "pages")?;
        let multi_page_size_bytes = num(field("multi_page_size")?, "multi_page_size")? as usize;
        let comp_algorithm = field("comp_algorithm")?;
        let level = match field("level")?.as_str() {
            "none" => None,
            v => Some(v.parse().map_err(|_| bad(&format!("has level {v:?}")))?),
        };
        let unsupported = match field("unsupported")? {
            v if v == "none" => None,
            v => Some(v),
        };
        let swap_pool = match field("swap_pool")?.as_str() {
            "none" => None,
            v => Some(
                v.parse()
                    .ok()
                    .filter(|&t| t != 0)
                    .ok_or_else(|| bad(&format!("has swap_pool {v:?}")))?,
            ),
        };
        let backing = match field("backing")?.as_str() {
            "none" => None,
            v => {
                let mut parts = v.splitn(3, ' ');
                let bytes = parts.next().and_then(|b| b.parse().ok());
                let compressed = match parts.next() {
                    Some("0") => Some(false),
                    Some("1") => Some(true),
                    _ => None,
                };
                match (bytes, compressed, parts.next()) {
                    (Some(b), Some(c), Some(name)) => Some((name.to_string(), b, c)),
                    _ => return Err(bad(&format!("has backing {v:?}"))),
                }
            }
        };
        // Written by this binary and later ones; a header without it has none.
        let recomp = match lines.next() {
            None => Vec::new(),
            Some(line) => {
                let v = line
                    .strip_prefix("recomp ")
                    .ok_or_else(|| bad(&format!("has {line:?} where recomp belongs")))?;
                if v == "none" {
                    Vec::new()
                } else {
                    v.split(',')
                        .map(|e| {
                            let mut parts = e.split(':');
                            let prio = parts
                                .next()
                                .and_then(|p| p.parse::<usize>().ok())
                                .filter(|p| (1..MAX_COMPS).contains(p));
                            let alg = parts.next().filter(|a| !a.is_empty());
                            let level = match parts.next() {
                                Some("none") => Some(None),
                                Some(l) => l.parse().ok().map(Some),
                                None => None,
                            };
                            match (prio, alg, level, parts.next()) {
                                (Some(p), Some(a), Some(l), None) => Ok((p, a.to_string(), l)),
                                _ => Err(bad(&format!("has recomp {v:?}"))),
                            }
                        })
                        .collect::<Result<Vec<_>>>()?
                }
            }
        };
        // Written by this binary and later ones; a header without it wrote back (if at all)
        // in the bitmap layout, as earlier binaries recovered only that one.
        let zoned = match lines.next() {
            None => None,
            Some(line) => match line.strip_prefix("zoned ") {
                Some("none") => None,
                Some(v) => Some(
                    v.parse::<u64>()
                        .ok()
                        .filter(|&z| crate::zoned::is_valid_zone_size(z))
                        .ok_or_else(|| bad(&format!("has zoned {v:?}")))?,
                ),
                None => return Err(bad(&format!("has {line:?} where zoned belongs"))),
            },
        };
        Ok(Header {
            page_size_bytes,
            pages,
            multi_page_size_bytes,
            comp_algorithm,
            level,
            unsupported,
            swap_pool,
            backing,
            recomp,
            zoned,
            dicts,
        })
    }
}

/// The limits record's first line.
const LIMITS_MAGIC: &str = "uzram-device-limits 1";

/// Bytes of each of the two limits slots after the header (a page each).
const LIMITS_SLOT_BYTES: usize = 4096;

/// The settings a device changes while it serves (`mem_limit`, `writeback_limit_enable`,
/// `writeback_limit` and its use by writebacks, `writeback_batch_size`), kept in two slots
/// after the header page: each save writes the slot of its generation's parity, its text
/// closed by a checksum, so a save stopped at any instruction leaves the other slot (the
/// previous generation) intact, and recovery takes the valid slot of the highest generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Limits {
    gen: u64,
    mem_limit_pages: u64,
    wb_limit_enabled: bool,
    wb_limit_units: u64,
    wb_batch_size: u32,
}

/// FNV-1a, 64 bits: the limits record's checksum (a torn write, not an adversary).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl Limits {
    fn encode(&self) -> String {
        let body = format!(
            "{LIMITS_MAGIC}\ngen {}\nmem_limit_pages {}\nwriteback_limit_enable {}\n\
             writeback_limit {}\nwriteback_batch_size {}\n",
            self.gen,
            self.mem_limit_pages,
            u8::from(self.wb_limit_enabled),
            self.wb_limit_units,
            self.wb_batch_size
        );
        seal(&body)
    }

    /// The record in `bytes`, or `None` if the slot holds none or a torn one.
    fn decode(bytes: &[u8]) -> Option<Limits> {
        let body = unseal(bytes)?;
        let mut lines = body.lines();
        if lines.next()? != LIMITS_MAGIC {
            return None;
        }
        let mut field = |key: &str| -> Option<u64> {
            lines
                .next()?
                .strip_prefix(key)?
                .strip_prefix(' ')?
                .parse()
                .ok()
        };
        let limits = Limits {
            gen: field("gen")?,
            mem_limit_pages: field("mem_limit_pages")?,
            wb_limit_enabled: match field("writeback_limit_enable")? {
                0 => false,
                1 => true,
                _ => return None,
            },
            wb_limit_units: field("writeback_limit")?,
            wb_batch_size: u32::try_from(field("writeback_batch_size")?)
                .ok()
                .filter(|&n| n >= 1)?,
        };
        Some(limits)
    }

    /// The newest valid record of the two slots of `header` (`None`: a header written before
    /// limits were kept, or both slots torn, which one save cannot do).
    fn read(header: &ShmFile) -> Result<Option<Limits>> {
        if header.len()? < (HEADER_BYTES + 2 * LIMITS_SLOT_BYTES) as u64 {
            return Ok(None);
        }
        let slots = header.read_at(HEADER_BYTES as u64, 2 * LIMITS_SLOT_BYTES)?;
        Ok(slots
            .chunks(LIMITS_SLOT_BYTES)
            .filter_map(Limits::decode)
            .max_by_key(|l| l.gen))
    }

    /// Writes the record into its slot of `header`, zero-padded to the slot.
    fn write(&self, header: &ShmFile) -> Result<()> {
        let mut slot = self.encode().into_bytes();
        slot.resize(LIMITS_SLOT_BYTES, 0);
        header.write_at(
            (HEADER_BYTES + (self.gen % 2) as usize * LIMITS_SLOT_BYTES) as u64,
            &slot,
        )
    }
}

/// A dictionary record's first line.
const DICT_MAGIC: &str = "uzram-device-dict 1";

/// Where the dictionary records start: after the header page and the two limits slots.
const DICTS_OFFSET_BYTES: u64 = (HEADER_BYTES + 2 * LIMITS_SLOT_BYTES) as u64;

/// Bytes of a dictionary record's text (a page; its dictionary follows).
const DICT_TEXT_BYTES: usize = 4096;

/// The room of each dictionary record: its text, then up to [`MAX_DICT_BYTES`] of dictionary.
const DICT_RECORD_BYTES: u64 = DICT_TEXT_BYTES as u64 + MAX_DICT_BYTES;

/// Where the record of priority `prio`'s generation `gen` lives: the primary's first (its
/// only generation, 0), then [`MAX_GENS`] for each recompression priority.
fn dict_record_offset(prio: u8, gen: u8) -> u64 {
    let index = match prio {
        0 => 0,
        p => 1 + u64::from(p - 1) * MAX_GENS as u64 + u64::from(gen),
    };
    DICTS_OFFSET_BYTES + index * DICT_RECORD_BYTES
}

/// A codec generation as a dictionary record keeps it, in a header of version 2
/// ([`MAGIC_V2`]): text (the priority, the generation, its install sequence, the codec's
/// level, the dictionary's length and CRC-32C, then a checksum of the rest) in a page at
/// [`dict_record_offset`], the dictionary's bytes (none: no dictionary) in the pages after it.
/// The algorithm is the priority's, in the header.
///
/// # Invariants
/// - Every generation a slot can name has its record, complete: `disksize` writes generation
///   0 of the primary and of each recompression priority before the store exists, and
///   `train_dict` writes a new generation's before it becomes current
///   ([`Device::save_generation`], under `pp_lock`: no recompression runs, and no other
///   training).
/// - A record is written whole in this order: its room punched out (the record there before,
///   of a generation no slot names any more, is gone), the dictionary, then the text, whose
///   checksums cover everything. So a write stopped at any instruction leaves an empty room
///   (read as no record) or one that fails a checksum (a *torn* record), never a record that
///   reads as valid with other bytes.
/// - A record is replaced (its generation reused by a training) or punched out (by the next
///   training after its generation was dropped) only while no slot names its generation: a
///   slot lets go of its generation only once it is published elsewhere, or under `pp_lock`
///   for a recompression, which the training holds.
/// - Install sequences grow: 0 for `disksize`'s generations, then one more for each training
///   of the device. A priority's current generation is the one installed last: its valid
///   record with the highest sequence (a record written by a training stopped before the
///   install is valid only once whole, and no slot names it yet: taking it as current is
///   the training done).
///
/// # Locks
/// Records are written under the init lock held exclusive (`disksize`) or under `pp_lock`
/// (a training, the init lock shared), so never two at once; recovery reads them before the
/// device exists. The limits slots, written meanwhile under `limits_write`, are other bytes.
///
/// Recovery builds every generation whose record is valid and keeps the ones some slot names
/// and the current ones ([`Codecs::finish_recovery`]); a torn record is ignored unless a slot
/// names its generation, which refuses the device (the store's recovery names the slot, the
/// generation and why).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DictMeta {
    prio: u8,
    gen: u8,
    /// The install sequence.
    seq: u64,
    level: Option<i32>,
}

/// What a record's room holds.
#[derive(Debug, PartialEq, Eq)]
enum SavedDict {
    /// Nothing: never written, or punched out.
    Empty,
    /// A record that fails a check: why.
    Torn(String),
    /// A record and its dictionary (empty: none).
    Valid(DictMeta, Vec<u8>),
}

impl DictMeta {
    fn text(&self, dict: &[u8]) -> String {
        let body = format!(
            "{DICT_MAGIC}\nprio {}\ngen {}\nseq {}\nlevel {}\nbytes {}\ncrc {:08x}\n",
            self.prio,
            self.gen,
            self.seq,
            self.level.map_or("none".to_string(), |l| l.to_string()),
            dict.len(),
            crc32c_of(&[dict]),
        );
        seal(&body)
    }

    /// Writes the record with `dict` (at most [`MAX_DICT_BYTES`]) into its room of `header`,
    /// in the order that makes a stopped write torn or empty (see the type's docs). The
    /// caller holds what keeps other writers of records out (the init lock exclusive, or
    /// `pp_lock`).
    fn write(&self, header: &ShmFile, dict: &[u8]) -> Result<()> {
        debug_assert!(dict.len() as u64 <= MAX_DICT_BYTES);
        let at = dict_record_offset(self.prio, self.gen);
        header.punch(at, DICT_RECORD_BYTES)?;
        if !dict.is_empty() {
            header.write_at(at + DICT_TEXT_BYTES as u64, dict)?;
        }
        let mut text = self.text(dict).into_bytes();
        text.resize(DICT_TEXT_BYTES, 0);
        header.write_at(at, &text)
    }

    /// What the room of priority `prio`'s generation `gen` holds.
    fn read(header: &ShmFile, prio: u8, gen: u8) -> Result<SavedDict> {
        let at = dict_record_offset(prio, gen);
        let page = header.read_at(at, DICT_TEXT_BYTES)?;
        if page.iter().all(|&b| b == 0) {
            return Ok(SavedDict::Empty);
        }
        let torn = |why: &str| Ok(SavedDict::Torn(why.to_string()));
        let Some(text) = std::str::from_utf8(page.split(|&b| b == 0).next().unwrap_or(&[]))
            .ok()
            .and_then(|t| t.trim_end_matches('\n').rsplit_once('\n'))
        else {
            return torn("its text does not parse");
        };
        let (body, sum_line) = text;
        let body = format!("{body}\n");
        let sum = sum_line
            .strip_prefix("sum ")
            .and_then(|v| u64::from_str_radix(v, 16).ok());
        if sum != Some(fnv1a(body.as_bytes())) {
            return torn("its text fails its checksum");
        }
        let mut lines = body.lines();
        if lines.next() != Some(DICT_MAGIC) {
            return torn("it does not start as a dictionary record");
        }
        let mut field =
            |key: &str| -> Option<&str> { lines.next()?.strip_prefix(key)?.strip_prefix(' ') };
        let fields = (|| {
            let p = field("prio")?.parse::<u8>().ok()?;
            let g = field("gen")?.parse::<u8>().ok()?;
            let seq = field("seq")?.parse::<u64>().ok()?;
            let level = match field("level")? {
                "none" => None,
                l => Some(l.parse::<i32>().ok()?),
            };
            let bytes = field("bytes")?.parse::<u64>().ok()?;
            let crc = u32::from_str_radix(field("crc")?, 16).ok()?;
            Some((
                DictMeta {
                    prio: p,
                    gen: g,
                    seq,
                    level,
                },
                bytes,
                crc,
            ))
        })();
        let Some((meta, bytes, crc)) = fields else {
            return torn("its fields do not parse");
        };
        if (meta.prio, meta.gen) != (prio, gen) {
            return Ok(SavedDict::Torn(format!(
                "its room holds priority {}'s generation {}",
                meta.prio, meta.gen
            )));
        }
        if bytes > MAX_DICT_BYTES {
            return torn("its dictionary is longer than any");
        }
        let dict = header.read_at(at + DICT_TEXT_BYTES as u64, bytes as usize)?;
        if dict.len() as u64 != bytes || crc32c_of(&[&dict]) != crc {
            return torn("its dictionary fails its checksum");
        }
        Ok(SavedDict::Valid(meta, dict))
    }
}

/// Where the two policy slots start: after the last dictionary record's room (the end of the
/// dictionary records' address space, whether the header has them or not: sparse, so a
/// header without dictionary records pays only the two pages), so no record before it moves.
const POLICY_OFFSET_BYTES: u64 =
    DICTS_OFFSET_BYTES + (1 + (MAX_COMPS as u64 - 1) * MAX_GENS as u64) * DICT_RECORD_BYTES;

/// Bytes of each of the two policy slots, and of each of the policy state's (a page each).
const POLICY_SLOT_BYTES: usize = 4096;

/// The longest policy text a record holds (its slot less room for the magic, the generation
/// and the checksum lines).
pub const MAX_POLICY_TEXT_BYTES: usize = POLICY_SLOT_BYTES - 256;

/// Which of the server's two texts a [`PolicyRecord`] keeps: each has two slots of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PolicyText {
    /// The settings (the `policy` attribute): changed by the user.
    Settings,
    /// What the policies did and when (`policy_stat`'s counters, their schedule): changed
    /// by the server's policy thread after it acts.
    State,
}

impl PolicyText {
    /// The record's first line.
    fn magic(self) -> &'static str {
        match self {
            PolicyText::Settings => "uzram-device-policy 1",
            PolicyText::State => "uzram-device-policy-state 1",
        }
    }

    /// Where its two slots start: the settings' right after the last dictionary room, the
    /// state's after those.
    fn offset(self) -> u64 {
        match self {
            PolicyText::Settings => POLICY_OFFSET_BYTES,
            PolicyText::State => POLICY_OFFSET_BYTES + 2 * POLICY_SLOT_BYTES as u64,
        }
    }

    /// Its name in errors.
    fn what(self) -> &'static str {
        match self {
            PolicyText::Settings => "policy",
            PolicyText::State => "policy state",
        }
    }
}

/// One of the server's texts about a device's policies ([`PolicyText`]: its settings, or
/// what the policies did and when), kept for the next process in two slots of the header
/// file (at [`PolicyText::offset`]), as the limits are ([`Limits`]): each save writes the
/// slot of its generation's parity whole, zero-padded, its text closed by a checksum of the
/// rest ([`seal`]), so a save stopped at any instruction leaves the other slot (the previous
/// generation) intact; recovery takes the valid slot of the highest generation. The text is
/// the server's (the engine only keeps it): lines, no NUL, at most [`MAX_POLICY_TEXT_BYTES`].
///
/// A header without the slots (written by a binary from before the record, or by this one
/// before any such text was saved) reads as no record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PolicyRecord {
    gen: u64,
    text: String,
}

impl PolicyRecord {
    fn encode(&self, kind: PolicyText) -> String {
        let mut body = format!("{}\ngen {}\n{}", kind.magic(), self.gen, self.text);
        if !body.ends_with('\n') {
            body.push('\n');
        }
        seal(&body)
    }

    /// The record of `kind` in `bytes`, or `None` if the slot holds none or a torn one.
    fn decode(bytes: &[u8], kind: PolicyText) -> Option<PolicyRecord> {
        let body = unseal(bytes)?;
        let rest = body.strip_prefix(kind.magic())?.strip_prefix('\n')?;
        let (gen_line, text) = rest.split_once('\n')?;
        let gen = gen_line.strip_prefix("gen ")?.parse().ok()?;
        Some(PolicyRecord {
            gen,
            text: text.to_string(),
        })
    }

    /// The newest valid record of `kind`'s two slots of `header` (`None`: none saved, or a
    /// header from before the record; both slots torn, which one save cannot do).
    fn read(header: &ShmFile, kind: PolicyText) -> Result<Option<PolicyRecord>> {
        let slots = header.read_at(kind.offset(), 2 * POLICY_SLOT_BYTES)?;
        Ok(slots
            .chunks(POLICY_SLOT_BYTES)
            .filter_map(|slot| PolicyRecord::decode(slot, kind))
            .max_by_key(|r| r.gen))
    }

    /// Writes the record into its slot of `kind` in `header`, zero-padded to the slot (the
    /// file grows to the slots if it ends before them: sparse). `EINVAL` for a text too long
    /// or holding a NUL, writing nothing.
    fn write(&self, header: &ShmFile, kind: PolicyText) -> Result<()> {
        check_policy_text(&self.text, kind)?;
        let mut slot = self.encode(kind).into_bytes();
        if slot.len() > POLICY_SLOT_BYTES {
            return Err(too_long(&self.text, kind));
        }
        slot.resize(POLICY_SLOT_BYTES, 0);
        header.write_at(
            kind.offset() + (self.gen % 2) * POLICY_SLOT_BYTES as u64,
            &slot,
        )
    }
}

fn too_long(text: &str, kind: PolicyText) -> Error {
    Error::invalid(format!(
        "a {} of {} bytes does not fit its saved record",
        kind.what(),
        text.len()
    ))
}

/// `EINVAL` unless `text` fits a [`PolicyRecord`]: at most [`MAX_POLICY_TEXT_BYTES`], no NUL.
fn check_policy_text(text: &str, kind: PolicyText) -> Result<()> {
    if text.len() > MAX_POLICY_TEXT_BYTES || text.contains('\0') {
        return Err(too_long(text, kind));
    }
    Ok(())
}

/// One of a device's policy texts as last saved or recovered, and the generation of its
/// last record.
#[derive(Debug, Default)]
pub(super) struct SavedText {
    gen: u64,
    text: Option<String>,
}

/// A device's policy texts ([`PolicyText`]), behind [`Device`]'s `policy` mutex.
#[derive(Debug, Default)]
pub(super) struct SavedPolicy {
    settings: SavedText,
    state: SavedText,
}

impl SavedPolicy {
    fn text(&mut self, kind: PolicyText) -> &mut SavedText {
        match kind {
            PolicyText::Settings => &mut self.settings,
            PolicyText::State => &mut self.state,
        }
    }
}

/// Whether a device of `settings` can hold a dictionary: `dict=` given to a codec, or a
/// zstd recompression priority (`train_dict` trains for those only). Its header is then of
/// version 2, with dictionary records.
fn can_hold_dictionaries(settings: &Settings) -> bool {
    settings.comp_params.dict.is_some()
        || settings
            .recomp_algorithms
            .iter()
            .zip(&settings.recomp_params)
            .skip(1)
            .any(|(alg, params)| {
                alg.as_deref().is_some_and(|a| a.trim() == "zstd") || params.dict.is_some()
            })
}

/// The codecs of a header of version 2, from its dictionary records: the primary from its
/// record, and each recompression priority's generations from theirs (see [`DictMeta`]);
/// `settings` gets the dictionaries `disksize` was given (a recompression priority's, while
/// generation 0 is still the one `disksize` made). Returns the codecs and the highest install
/// sequence found. `EINVAL` naming the record when the primary's is missing, torn or does not
/// load, or when a priority has no intact record or its current generation does not load.
fn recovered_codecs(
    file: &ShmFile,
    header: &Header,
    settings: &mut Settings,
) -> Result<(Codecs, u64)> {
    let refuse = |what: String| Error::invalid(format!("recovery: {what}"));
    let build =
        |alg: &str, meta: &DictMeta, dict: Vec<u8>| -> Result<(Box<dyn Codec>, CodecParams)> {
            let dict = if dict.is_empty() {
                None
            } else {
                Some(Dictionary::from_bytes(dict)?)
            };
            let params = CodecParams {
                level: meta.level,
                dict,
            };
            Ok((compress::new_codec(alg, params.clone())?, params))
        };
    let (primary, mut seq) = match DictMeta::read(file, 0, 0)? {
        SavedDict::Valid(meta, dict) => {
            let (codec, params) = build(&header.comp_algorithm, &meta, dict).map_err(|e| {
                refuse(format!(
                    "the primary codec's saved dictionary does not load: {}",
                    e.message()
                ))
            })?;
            settings.comp_params = params;
            (codec, meta.seq)
        }
        SavedDict::Empty => {
            return Err(refuse(
                "the primary codec's dictionary record is missing".to_string(),
            ))
        }
        SavedDict::Torn(why) => {
            return Err(refuse(format!(
                "the primary codec's dictionary record is torn: {why}"
            )))
        }
    };
    let mut secondary: [Option<SavedGens>; MAX_COMPS] = Default::default();
    for (prio, alg, level) in &header.recomp {
        let mut saved = SavedGens {
            params: CodecParams::with_level(*level),
            gens: Default::default(),
            current: 0,
            lost: Default::default(),
        };
        // The valid record installed last: (its sequence, its generation).
        let mut newest: Option<(u64, usize)> = None;
        for gen in 0..MAX_GENS {
            match DictMeta::read(file, *prio as u8, gen as u8)? {
                SavedDict::Empty => {}
                SavedDict::Torn(why) => {
                    saved.lost[gen] = Some(format!("its saved record is torn: {why}"));
                }
                SavedDict::Valid(meta, dict) => {
                    seq = seq.max(meta.seq);
                    match newest {
                        Some((s, other)) if s == meta.seq => {
                            return Err(refuse(format!(
                                "priority {prio}'s dictionary generations {other} and {gen} \
                                 have one install sequence, {s}"
                            )))
                        }
                        Some((s, _)) if s > meta.seq => {}
                        _ => newest = Some((meta.seq, gen)),
                    }
                    let bytes = dict.len();
                    match build(alg, &meta, dict) {
                        Ok((codec, params)) => {
                            if gen == 0 && meta.seq == 0 {
                                saved.params.dict = params.dict;
                            }
                            saved.gens[gen] = Some((codec, bytes));
                        }
                        Err(e) => {
                            saved.lost[gen] = Some(format!(
                                "its saved dictionary does not load: {}",
                                e.message()
                            ));
                        }
                    }
                }
            }
        }
        let Some((_, current)) = newest else {
            return Err(refuse(format!(
                "recompression priority {prio} has no intact dictionary record"
            )));
        };
        if saved.gens[current].is_none() {
            return Err(refuse(format!(
                "priority {prio}'s current dictionary generation {current}: {}",
                saved.lost[current].as_deref().unwrap_or("lost")
            )));
        }
        saved.current = current as u8;
        settings.recomp_params[*prio].dict = saved.params.dict.clone();
        secondary[*prio] = Some(saved);
    }
    Ok((Codecs::recovered(primary, secondary), seq))
}

impl Device {
    /// Writes the header of a store being built with `settings` and `pages` pages (called by
    /// `disksize`); `swap_pool`: serving swap, its pool's tag in the swap reserve.
    pub(super) fn write_header(
        &self,
        settings: &Settings,
        pages: u64,
        swap_pool: Option<u16>,
    ) -> Result<ShmFile> {
        let header = Header {
            page_size_bytes: self.page_size_bytes,
            pages,
            multi_page_size_bytes: settings.multi_page_size_bytes,
            comp_algorithm: settings.comp_algorithm.clone(),
            level: settings.comp_params.level,
            unsupported: None,
            swap_pool,
            backing: settings
                .backing
                .as_ref()
                .map(|b| (b.describe(), b.size_bytes(), settings.compressed_writeback)),
            zoned: (settings.backing.is_some() && settings.backing_layout == BackingLayout::Zoned)
                .then_some(settings.zone_size_bytes),
            recomp: settings
                .recomp_algorithms
                .iter()
                .enumerate()
                .filter_map(|(prio, alg)| {
                    Some((prio, alg.clone()?, settings.recomp_params[prio].level))
                })
                .collect(),
            dicts: can_hold_dictionaries(settings),
        };
        let file = ShmFile::create("device")?;
        let text = header.encode();
        if text.len() > HEADER_BYTES {
            return Err(Error::invalid(
                "the device's settings do not fit its header",
            ));
        }
        file.set_len((HEADER_BYTES + 2 * LIMITS_SLOT_BYTES) as u64)?;
        file.write_at(0, text.as_bytes())?;
        // Under the init lock (held exclusively by `disksize`): no save runs meanwhile.
        self.current_limits().write(&file)?;
        if header.dicts {
            // Every codec's generation 0, before the store exists (no slot names one yet).
            let dict = |p: &CodecParams| p.dict.as_ref().map(|d| d.bytes().to_vec());
            let gen0 = |prio: usize, params: &CodecParams| {
                let meta = DictMeta {
                    prio: prio as u8,
                    gen: 0,
                    seq: 0,
                    level: params.level,
                };
                meta.write(&file, &dict(params).unwrap_or_default())
            };
            gen0(0, &settings.comp_params)?;
            for (prio, _, _) in &header.recomp {
                gen0(*prio, &settings.recomp_params[*prio])?;
            }
        }
        self.dict_seq.store(0, std::sync::atomic::Ordering::Relaxed);
        // The policy texts saved so far (before this `disksize`, or before a reset), in the
        // new header's slots; the `policy` mutex after the init lock, as in `save_policy`.
        let mut policy = self.policy.lock();
        for kind in [PolicyText::Settings, PolicyText::State] {
            let saved = policy.text(kind);
            if let Some(text) = saved.text.clone() {
                saved.gen += 1;
                PolicyRecord {
                    gen: saved.gen,
                    text,
                }
                .write(&file, kind)?;
            }
        }
        Ok(file)
    }

    /// Keeps `text`, the server's policy settings for this device (its `policy` attribute, as
    /// the server encodes it), for the next process: written now as the next generation of
    /// the header file's policy record ([`PolicyRecord`]) if the device is initialised, and
    /// into the header `disksize` makes otherwise (after a reset too). Takes the init lock
    /// shared, then the `policy` mutex (which keeps saves apart and their generations in
    /// order); call it with neither held. `EINVAL` for a text over
    /// [`MAX_POLICY_TEXT_BYTES`] or holding a NUL, keeping nothing; a write the file refuses
    /// (never seen: a memfd's page) leaves the previous record, which recovery then takes.
    pub fn save_policy(&self, text: &str) -> Result<()> {
        self.save_policy_text(PolicyText::Settings, text)
    }

    /// The policy text last kept by [`save_policy`](Device::save_policy), or recovered from
    /// the header file's policy record ([`PolicyRecord`]); `None` when neither (a header
    /// from before the record, or no policy ever saved).
    pub fn saved_policy(&self) -> Option<String> {
        self.policy.lock().settings.text.clone()
    }

    /// As [`save_policy`](Device::save_policy), for the server's other text about the
    /// device's policies: what they did and when (`policy_stat`'s counters, their schedule),
    /// in two slots of its own, so that saving it never touches the settings' record. Called
    /// by the policy thread after it acts (never on a request's path).
    pub fn save_policy_state(&self, text: &str) -> Result<()> {
        self.save_policy_text(PolicyText::State, text)
    }

    /// The text last kept by [`save_policy_state`](Device::save_policy_state), or recovered;
    /// `None` when neither.
    pub fn saved_policy_state(&self) -> Option<String> {
        self.policy.lock().state.text.clone()
    }

    fn save_policy_text(&self, kind: PolicyText, text: &str) -> Result<()> {
        check_policy_text(text, kind)?;
        let st = self.state.read();
        let mut policy = self.policy.lock();
        let saved = policy.text(kind);
        saved.text = Some(text.to_string());
        if let Some(header) = st.header.as_ref() {
            saved.gen += 1;
            PolicyRecord {
                gen: saved.gen,
                text: text.to_string(),
            }
            .write(header, kind)?;
        }
        Ok(())
    }

    /// Saves the dictionary generation `train_dict` is about to install into the device's
    /// header file `header` (see [`DictMeta`]), before it becomes current; the caller holds
    /// `pp_lock` and the init lock shared. A header of version 1 (a device recovered from a
    /// binary from before the records, whose codecs have no dictionary) becomes version 2
    /// first: records of every codec's generation 0 as its header says, then its first line's
    /// last byte (one byte: a stop before it leaves version 1, whose slots name no trained
    /// generation yet). Then the records of the priority's generations no longer held are
    /// punched out (no slot names them: see [`DictMeta`]), and the new one is written under
    /// the next install sequence. An error leaves the previous records (the new one maybe
    /// torn, which a recovery ignores while no slot names its generation).
    pub(super) fn save_generation(
        &self,
        header: &ShmFile,
        store: &Store,
        new: &NewGeneration<'_>,
    ) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if header.read_at(0, MAGIC_V1.len())? == MAGIC_V1.as_bytes() {
            let h = Header::decode(&header.read_at(0, HEADER_BYTES)?)?;
            let gen0 = |prio: usize, level: Option<i32>| DictMeta {
                prio: prio as u8,
                gen: 0,
                seq: 0,
                level,
            };
            gen0(0, h.level).write(header, &[])?;
            for (prio, _, level) in &h.recomp {
                gen0(*prio, *level).write(header, &[])?;
            }
            header.write_at(
                MAGIC_V1.len() as u64 - 1,
                &MAGIC_V2.as_bytes()[MAGIC_V1.len() - 1..],
            )?;
        }
        if let Some(stat) = store.codecs_gen_stat(usize::from(new.prio)) {
            for gen in (0..MAX_GENS as u8).filter(|&g| g != new.gen) {
                if !stat.held.iter().any(|h| h.0 == gen) {
                    header.punch(dict_record_offset(new.prio, gen), DICT_RECORD_BYTES)?;
                }
            }
        }
        let seq = self.dict_seq.load(Relaxed) + 1;
        let meta = DictMeta {
            prio: new.prio,
            gen: new.gen,
            seq,
            level: new.level,
        };
        meta.write(header, new.dict)?;
        self.dict_seq.store(seq, Relaxed);
        Ok(())
    }

    /// The limits as they are now, under the next generation.
    fn current_limits(&self) -> Limits {
        use std::sync::atomic::Ordering::Relaxed;
        Limits {
            gen: self.limits_gen.fetch_add(1, Relaxed) + 1,
            mem_limit_pages: self.mem_limit_pages.load(Relaxed),
            wb_limit_enabled: self.wb_limit.enabled(),
            wb_limit_units: self.wb_limit.limit_units(),
            wb_batch_size: self.wb_batch_size.load(Relaxed),
        }
    }

    /// Records the settings a device changes while it serves in its header file, for the next
    /// process (see [`Limits`]); nothing before `disksize`. Takes `limits_write`, then the
    /// init lock shared: call it with neither held. A write the file refuses (never seen: a
    /// memfd's page) leaves the previous record, which recovery then takes.
    pub(super) fn save_limits(&self) {
        let _serial = self.limits_write.lock();
        let st = self.state.read();
        if let Some(header) = st.header.as_ref() {
            let _ = self.current_limits().write(header);
        }
    }

    /// New descriptors of the files holding this initialised device's state, to hand to a
    /// process that will [`recover`](Device::recover) it (serving swap: the frames and their
    /// records are the server's swap reserve's, the same files for every device;
    /// [`recover_swap`](Device::recover_swap)). `EINVAL` when uninitialised.
    pub fn state_files(&self) -> Result<DeviceFiles> {
        let st = self.state.read();
        let (Some(store), Some(header)) = (st.store.as_ref(), st.header.as_ref()) else {
            return Err(Error::invalid("the device is not initialised"));
        };
        Ok(DeviceFiles {
            header: ShmFile::from_fd(header.try_clone_fd()?),
            store: store.files()?,
        })
    }

    /// The initialised device a previous process left in `files`: the header's settings, then
    /// the codecs with their dictionaries and generations ([`DictMeta`]), then the store
    /// rebuilt and checked (`docs/restart.md`, "Recovery"). `EINVAL` naming what is wrong if
    /// any check fails (a slot naming a dictionary generation whose record is torn, say), if
    /// the binary that saved it did not keep all of its settings (a dictionary, before the
    /// dictionary records), or if it served swap or wrote back (those take
    /// [`recover_with`](Device::recover_with)); the files are not changed then, except for
    /// garbage freed and the journal rolled forward, which a second recovery finds done.
    pub fn recover(files: DeviceFiles) -> Result<(Device, RecoveryReport)> {
        Device::recover_with(files, Recover::default())
    }

    /// As [`recover`](Device::recover), for a device that served swap from the swap reserve
    /// `reserve` is recovering ([`SwapReserve::recover`], from the files this device's
    /// `state_files` gave too; `EINVAL` if they are another reserve's). Recover every such
    /// device, then finish the reserve's recovery ([`SwapReserve::finish_recovery`]).
    pub fn recover_swap(
        files: DeviceFiles,
        reserve: &Arc<SwapReserve>,
    ) -> Result<(Device, RecoveryReport)> {
        Device::recover_with(
            files,
            Recover {
                swap_reserve: Some(Arc::clone(reserve)),
                ..Recover::default()
            },
        )
    }

    /// As [`recover`](Device::recover), with what the device used beyond its files: the
    /// swap reserve it served swap from, the backing device it wrote back to (opened again by
    /// the caller; `EINVAL` unless its name and size are the ones the header recorded). Each
    /// is required exactly when the header says the device had it.
    pub fn recover_with(files: DeviceFiles, with: Recover) -> Result<(Device, RecoveryReport)> {
        let header = Header::decode(&files.header.read_at(0, HEADER_BYTES)?)?;
        let limits = Limits::read(&files.header)?;
        let policy = PolicyRecord::read(&files.header, PolicyText::Settings)?;
        let policy_state = PolicyRecord::read(&files.header, PolicyText::State)?;
        if let Some(what) = &header.unsupported {
            // Only binaries from before the dictionary records wrote this (for a dictionary,
            // which they did not keep).
            return Err(Error::invalid(format!(
                "recovery: the device had {what}, which the binary that saved it did not keep"
            )));
        }
        let reserve = with.swap_reserve.as_ref();
        let swap = match (header.swap_pool, reserve) {
            (Some(tag), Some(reserve)) => Some((reserve.as_ref(), tag)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(Error::invalid(
                    "recovery: the device served swap: recover it with the server's swap \
                     reserve",
                ))
            }
            (None, Some(_)) => {
                return Err(Error::invalid(
                    "recovery: the device did not serve swap, and a swap reserve was given",
                ))
            }
        };
        let (backing, compressed_writeback) = match (&header.backing, with.backing) {
            (None, None) => (None, false),
            (Some((name, bytes, compressed)), Some(b)) => {
                if b.describe() != *name || b.size_bytes() != *bytes {
                    return Err(Error::invalid(format!(
                        "recovery: the device wrote back to {name} ({bytes} bytes), not to {} \
                         ({} bytes)",
                        b.describe(),
                        b.size_bytes()
                    )));
                }
                (Some(b), *compressed)
            }
            (Some((name, _, _)), None) => {
                return Err(Error::invalid(format!(
                    "recovery: the device wrote back to {name}: give its backing device"
                )))
            }
            (None, Some(_)) => {
                return Err(Error::invalid(
                    "recovery: the device had no backing device, and one was given",
                ))
            }
        };
        let dev =
            Device::new_uninit_with_clock(header.page_size_bytes, Arc::new(SystemClock::new()))?;
        let mps = header.multi_page_size_bytes;
        if mps != super::MULTI_PAGE_SIZE_OFF_BYTES
            && !(MULTI_PAGE_SIZES_BYTES.contains(&mps) && mps > header.page_size_bytes)
        {
            return Err(Error::invalid(format!(
                "recovery: the device header has multi_page_size {mps}"
            )));
        }
        let layout = if header.zoned.is_some() {
            BackingLayout::Zoned
        } else {
            BackingLayout::Bitmap
        };
        let mut settings = Settings {
            comp_algorithm: header.comp_algorithm.clone(),
            comp_params: CodecParams::with_level(header.level),
            multi_page_size_bytes: mps,
            backing: backing.clone(),
            compressed_writeback,
            backing_layout: layout,
            ..Settings::default()
        };
        if let Some(z) = header.zoned {
            settings.zone_size_bytes = z;
        }
        for (prio, alg, level) in &header.recomp {
            settings.recomp_algorithms[*prio] = Some(alg.clone());
            settings.recomp_params[*prio] = CodecParams::with_level(*level);
        }
        let target = match backing {
            Some(b) => Some(WbTarget::recovering(
                b,
                layout,
                compressed_writeback,
                header.page_size_bytes,
                settings.zone_size_bytes,
            )?),
            None => None,
        };
        let (codecs, dict_seq) = if header.dicts {
            recovered_codecs(&files.header, &header, &mut settings)?
        } else {
            (Device::new_codecs(&settings)?, 0)
        };
        let (pool_page_bytes, capacity, multi_pages) = dev.pool_shape(&settings, None);
        let (store, report) = Store::recover(
            header.page_size_bytes,
            multi_pages,
            header.pages,
            codecs,
            pool_page_bytes,
            capacity,
            files.store,
            swap,
            target,
            Arc::clone(&dev.clock),
        )?;
        dev.dict_seq
            .store(dict_seq, std::sync::atomic::Ordering::Relaxed);
        if let Some(l) = limits {
            use std::sync::atomic::Ordering::Relaxed;
            dev.limits_gen.store(l.gen, Relaxed);
            dev.mem_limit_pages.store(l.mem_limit_pages, Relaxed);
            dev.wb_limit.set_enabled(l.wb_limit_enabled);
            dev.wb_limit.set_limit_units(l.wb_limit_units);
            dev.wb_batch_size.store(l.wb_batch_size, Relaxed);
        }
        {
            let mut saved = dev.policy.lock();
            for (kind, record) in [
                (PolicyText::Settings, policy),
                (PolicyText::State, policy_state),
            ] {
                if let Some(r) = record {
                    *saved.text(kind) = SavedText {
                        gen: r.gen,
                        text: Some(r.text),
                    };
                }
            }
        }
        {
            let mut st = dev.state.write();
            st.settings = settings;
            st.store = Some(store);
            st.header = Some(files.header);
            st.swap_reserve = with.swap_reserve;
        }
        Ok((dev, report))
    }
}

/// What a device used beyond its files, for [`Device::recover_with`].
#[derive(Default)]
pub struct Recover {
    /// The server's swap reserve, being recovered, if the device served swap.
    pub swap_reserve: Option<Arc<SwapReserve>>,
    /// The backing device, opened again, if the device wrote back.
    pub backing: Option<Arc<dyn Backing>>,
}

impl std::fmt::Debug for Recover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recover")
            .field("swap_reserve", &self.swap_reserve.is_some())
            .field("backing", &self.backing.as_ref().map(|b| b.describe()))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_round_trip_and_a_torn_slot_leaves_the_previous_record() {
        let file = ShmFile::create("limits-test").unwrap();
        file.set_len((HEADER_BYTES + 2 * LIMITS_SLOT_BYTES) as u64)
            .unwrap();
        assert_eq!(Limits::read(&file).unwrap(), None);
        let first = Limits {
            gen: 7,
            mem_limit_pages: 1234,
            wb_limit_enabled: true,
            wb_limit_units: 99,
            wb_batch_size: 16,
        };
        first.write(&file).unwrap();
        assert_eq!(Limits::read(&file).unwrap(), Some(first));
        let second = Limits {
            gen: 8,
            wb_limit_units: 42,
            ..first
        };
        second.write(&file).unwrap();
        assert_eq!(Limits::read(&file).unwrap(), Some(second));
        // A save stopped half way through the newer slot (generation 8's, the even one): one
        // byte of it changed.
        let at = HEADER_BYTES as u64 + 30;
        let byte = file.read_at(at, 1).unwrap()[0];
        file.write_at(at, &[byte ^ 0x01]).unwrap();
        assert_eq!(Limits::read(&file).unwrap(), Some(first));
        // A header written before limits were kept (one page): none.
        let old = ShmFile::create("limits-old").unwrap();
        old.set_len(HEADER_BYTES as u64).unwrap();
        assert_eq!(Limits::read(&old).unwrap(), None);
    }

    #[test]
    fn policy_round_trip_a_torn_slot_leaves_the_previous_record_newest_wins_each_kind_apart() {
        // The settings' slots, then the state's: each kind round trips in its own slots,
        // the settings' records left in place reading as no state record.
        // Headers without the slots: one of a binary from before the dictionary records (the
        // header page and the limits slots), one with dictionary records.
        let file = ShmFile::create("policy-test").unwrap();
        file.set_len((HEADER_BYTES + 2 * LIMITS_SLOT_BYTES) as u64)
            .unwrap();
        for k in [PolicyText::Settings, PolicyText::State] {
            let other = match k {
                PolicyText::Settings => PolicyText::State,
                PolicyText::State => PolicyText::Settings,
            };
            let others = file.read_at(other.offset(), 2 * POLICY_SLOT_BYTES).unwrap();
            assert_eq!(PolicyRecord::read(&file, k).unwrap(), None);
            // The slots start after the last dictionary room, and move nothing before them.
            assert_eq!(
                POLICY_OFFSET_BYTES,
                dict_record_offset(MAX_COMPS as u8 - 1, MAX_GENS as u8 - 1) + DICT_RECORD_BYTES
            );
            let limits = Limits {
                gen: 3,
                mem_limit_pages: 5,
                wb_limit_enabled: false,
                wb_limit_units: 0,
                wb_batch_size: 1,
            };
            limits.write(&file).unwrap();
            let first = PolicyRecord {
                gen: 1,
                text: "config none\npolicy idle_age_s=600 period_s=10\n".into(),
            };
            first.write(&file, k).unwrap();
            assert_eq!(PolicyRecord::read(&file, k).unwrap(), Some(first.clone()));
            assert_eq!(Limits::read(&file).unwrap(), Some(limits));
            let second = PolicyRecord {
                gen: 2,
                text: "config none\npolicy compact_ratio=1.05\n".into(),
            };
            second.write(&file, k).unwrap();
            assert_eq!(PolicyRecord::read(&file, k).unwrap(), Some(second.clone()));
            // The third replaces the first (same parity); the newest wins whichever slot holds it.
            let third = PolicyRecord {
                gen: 3,
                text: "anything\n".into(),
            };
            third.write(&file, k).unwrap();
            assert_eq!(PolicyRecord::read(&file, k).unwrap(), Some(third.clone()));
            // A save stopped half way through the newer slot (generation 3's, the odd one): one
            // byte of it changed, then the slot cut off after a few bytes.
            let at = k.offset() + POLICY_SLOT_BYTES as u64;
            let byte = file.read_at(at + 30, 1).unwrap()[0];
            file.write_at(at + 30, &[byte ^ 0x01]).unwrap();
            assert_eq!(PolicyRecord::read(&file, k).unwrap(), Some(second.clone()));
            file.write_at(at + 30, &[byte]).unwrap();
            assert_eq!(PolicyRecord::read(&file, k).unwrap(), Some(third.clone()));
            let mut cut = third.encode(k).into_bytes();
            cut.truncate(cut.len() - 10);
            cut.resize(POLICY_SLOT_BYTES, 0);
            file.write_at(at, &cut).unwrap();
            assert_eq!(PolicyRecord::read(&file, k).unwrap(), Some(second));
            // Too long, or a NUL: refused, nothing written.
            for text in ["x".repeat(MAX_POLICY_TEXT_BYTES + 1), "a\0b\n".to_string()] {
                let r = PolicyRecord { gen: 4, text };
                assert!(r.write(&file, k).is_err());
            }
            assert!(file.read_at(k.offset(), 1).unwrap()[0] != 0);
            assert_eq!(
                PolicyRecord::decode(
                    PolicyRecord {
                        gen: 9,
                        text: String::new()
                    }
                    .encode(k)
                    .as_bytes(),
                    k
                ),
                Some(PolicyRecord {
                    gen: 9,
                    text: String::new()
                })
            );
            // The other kind's slots are as they were.
            assert!(file.read_at(other.offset(), 2 * POLICY_SLOT_BYTES).unwrap() == others);
        }
        assert_eq!(
            PolicyText::State.offset(),
            PolicyText::Settings.offset() + 2 * POLICY_SLOT_BYTES as u64
        );
    }

    #[test]
    fn a_device_keeps_its_policy_across_disksize_and_recovery() {
        let dev = Device::new_uninit(4096).unwrap();
        assert_eq!(dev.saved_policy(), None);
        // Saved before disksize: kept, and written into the header disksize makes.
        dev.save_policy("before\n").unwrap();
        dev.attr_store("disksize", "1M").unwrap();
        let (back, _) = Device::recover(dev.state_files().unwrap()).unwrap();
        assert_eq!(back.saved_policy().as_deref(), Some("before\n"));
        // Saved on the live device, twice: the newest comes back, and again after a save on
        // the recovered device (its generations go on from the recovered one's).
        dev.save_policy("one\n").unwrap();
        dev.save_policy("two\n").unwrap();
        drop(back);
        let (back, _) = Device::recover(dev.state_files().unwrap()).unwrap();
        assert_eq!(back.saved_policy().as_deref(), Some("two\n"));
        back.save_policy("three\n").unwrap();
        let (again, _) = Device::recover(back.state_files().unwrap()).unwrap();
        assert_eq!(again.saved_policy().as_deref(), Some("three\n"));
        assert!(dev
            .save_policy(&"x".repeat(MAX_POLICY_TEXT_BYTES + 1))
            .is_err());
        assert_eq!(dev.saved_policy().as_deref(), Some("two\n"));
        // A device never given one recovers without one.
        let plain = Device::new_uninit(4096).unwrap();
        plain.attr_store("disksize", "1M").unwrap();
        let (back, _) = Device::recover(plain.state_files().unwrap()).unwrap();
        assert_eq!(back.saved_policy(), None);
        assert_eq!(back.saved_policy_state(), None);
    }

    #[test]
    fn a_device_keeps_its_policy_state_apart_from_its_settings() {
        let dev = Device::new_uninit(4096).unwrap();
        // Saved before disksize, then kept through a reset into the next header.
        dev.save_policy_state("runs 1\n").unwrap();
        dev.attr_store("disksize", "1M").unwrap();
        dev.reset();
        dev.attr_store("disksize", "1M").unwrap();
        let (back, _) = Device::recover(dev.state_files().unwrap()).unwrap();
        assert_eq!(back.saved_policy_state().as_deref(), Some("runs 1\n"));
        assert_eq!(back.saved_policy(), None);
        // Saves of one never change the other.
        dev.save_policy("settings\n").unwrap();
        for n in 2..6 {
            dev.save_policy_state(&format!("runs {n}\n")).unwrap();
        }
        let (back, _) = Device::recover(dev.state_files().unwrap()).unwrap();
        assert_eq!(back.saved_policy_state().as_deref(), Some("runs 5\n"));
        assert_eq!(back.saved_policy().as_deref(), Some("settings\n"));
        back.save_policy_state("runs 6\n").unwrap();
        back.save_policy("settings 2\n").unwrap();
        let (again, _) = Device::recover(back.state_files().unwrap()).unwrap();
        assert_eq!(again.saved_policy_state().as_deref(), Some("runs 6\n"));
        assert_eq!(again.saved_policy().as_deref(), Some("settings 2\n"));
        assert!(dev
            .save_policy_state(&"x".repeat(MAX_POLICY_TEXT_BYTES + 1))
            .is_err());
    }

    #[test]
    fn dict_records_round_trip_and_a_torn_one_is_told_from_an_empty_room() {
        let file = ShmFile::create("dict-test").unwrap();
        file.set_len(DICTS_OFFSET_BYTES).unwrap();
        let dict: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let meta = DictMeta {
            prio: 2,
            gen: 5,
            seq: 9,
            level: Some(-3),
        };
        assert_eq!(DictMeta::read(&file, 2, 5).unwrap(), SavedDict::Empty);
        meta.write(&file, &dict).unwrap();
        assert_eq!(
            DictMeta::read(&file, 2, 5).unwrap(),
            SavedDict::Valid(meta, dict.clone())
        );
        // Its neighbours' rooms, the primary's among them, are untouched.
        for (p, g) in [(2, 4), (2, 6), (0, 0), (1, 7), (3, 0)] {
            assert_eq!(DictMeta::read(&file, p, g).unwrap(), SavedDict::Empty);
        }
        let at = dict_record_offset(2, 5);
        let torn = |what: &str| match DictMeta::read(&file, 2, 5).unwrap() {
            SavedDict::Torn(why) => why,
            other => panic!("{what}: {other:?}"),
        };
        // One byte of the dictionary, then one of the text, changed.
        for (off, what) in [(DICT_TEXT_BYTES as u64 + 5000, "dictionary"), (30, "text")] {
            let byte = file.read_at(at + off, 1).unwrap()[0];
            file.write_at(at + off, &[byte ^ 0x01]).unwrap();
            assert!(torn(what).contains("checksum"), "{what}");
            file.write_at(at + off, &[byte]).unwrap();
        }
        // The dictionary cut short (the file ends inside it).
        file.set_len(at + DICT_TEXT_BYTES as u64 + 4096).unwrap();
        assert!(torn("cut").contains("checksum"));
        // Rewritten with a shorter dictionary and no level: nothing of the old one is left.
        let short = DictMeta {
            seq: 10,
            level: None,
            ..meta
        };
        short.write(&file, &dict[..100]).unwrap();
        assert_eq!(
            DictMeta::read(&file, 2, 5).unwrap(),
            SavedDict::Valid(short, dict[..100].to_vec())
        );
        assert!(file
            .read_at(at + DICT_TEXT_BYTES as u64 + 100, 4000)
            .unwrap()
            .iter()
            .all(|&b| b == 0));
        // A record in another's room.
        let text = file.read_at(at, DICT_TEXT_BYTES).unwrap();
        file.write_at(dict_record_offset(2, 6), &text).unwrap();
        assert!(matches!(
            DictMeta::read(&file, 2, 6).unwrap(),
            SavedDict::Torn(why) if why.contains("generation 5")
        ));
        // Without a dictionary: an empty one.
        let none = DictMeta {
            prio: 0,
            gen: 0,
            seq: 0,
            level: Some(1),
        };
        none.write(&file, &[]).unwrap();
        assert_eq!(
            DictMeta::read(&file, 0, 0).unwrap(),
            SavedDict::Valid(none, Vec::new())
        );
        assert_eq!(dict_record_offset(0, 0), DICTS_OFFSET_BYTES);
        assert_eq!(
            dict_record_offset(1, 0),
            DICTS_OFFSET_BYTES + DICT_RECORD_BYTES
        );
    }

    #[test]
    fn magic_versions_differ_in_the_last_byte_only() {
        assert_eq!(MAGIC_V1.len(), MAGIC_V2.len());
        let n = MAGIC_V1.len() - 1;
        assert_eq!(MAGIC_V1[..n], MAGIC_V2[..n]);
        assert_ne!(MAGIC_V1.as_bytes()[n], MAGIC_V2.as_bytes()[n]);
    }

    #[test]
    fn header_round_trips_and_junk_is_refused() {
        let h = Header {
            page_size_bytes: 16384,
            pages: 12345,
            multi_page_size_bytes: 65536,
            comp_algorithm: "zstd".into(),
            level: Some(-3),
            unsupported: None,
            swap_pool: None,
            backing: None,
            recomp: Vec::new(),
            zoned: None,
            dicts: false,
        };
        assert_eq!(Header::decode(h.encode().as_bytes()).unwrap(), h);
        // Headers of earlier binaries: no zoned line (the bitmap layout), then no recomp line
        // either (no recompression).
        let old = h.encode().replace("zoned none\n", "");
        assert_eq!(Header::decode(old.as_bytes()).unwrap(), h);
        let older = old.replace("recomp none\n", "");
        assert_eq!(Header::decode(older.as_bytes()).unwrap(), h);
        let h2 = Header {
            level: None,
            unsupported: Some("a backing device".into()),
            swap_pool: Some(3),
            backing: Some(("/var/tmp/wb file".into(), 1 << 30, true)),
            recomp: vec![(1, "zstd".into(), Some(19)), (3, "lz4hc".into(), None)],
            zoned: Some(16 << 20),
            dicts: true,
            ..h.clone()
        };
        assert!(h2.encode().starts_with(MAGIC_V2));
        assert_eq!(Header::decode(h2.encode().as_bytes()).unwrap(), h2);
        for junk in [
            "recomp 0:zstd:1",
            "recomp 1:zstd",
            "recomp 1::3",
            "recomp 9:zstd:1",
        ] {
            let text = h.encode().replace("recomp none", junk);
            assert!(Header::decode(text.as_bytes()).is_err(), "{junk}");
        }
        assert!(Header::decode(b"uzram-device-state 2\n").is_err());
        let text = h.encode().replacen(MAGIC_V1, "uzram-device-state 3", 1);
        assert!(Header::decode(text.as_bytes()).is_err());
        assert!(Header::decode(&[0u8; 64]).is_err());
        let text = h.encode().replace("pages 12345", "pages x");
        assert!(Header::decode(text.as_bytes()).is_err());
    }
}
