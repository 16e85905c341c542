//! A device's state for a new process (`docs/restart.md`): the files that hold it, the
//! settings header written at `disksize`, and recovery.
//!
//! The header is a memfd of its own holding the settings the store was built with, as text:
//! a magic line with the format's version, then `key value` lines (a last `recomp` line,
//! which headers of earlier binaries lack, read as none). Recovery reads it, refuses settings
//! whose state it cannot rebuild yet (the zoned layout, a dictionary), rebuilds the codecs
//! (the primary and the recompression ones) and then the store from its files,
//! checking everything (`store::restore`, `zsmalloc::restore`).

use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::{Device, Settings, MULTI_PAGE_SIZES_BYTES};
use crate::backing::Backing;
use crate::clock::SystemClock;
use crate::compress::{CodecParams, MAX_COMPS};
use crate::error::{Error, Result};
use crate::memory::SwapReserve;
use crate::shm::ShmFile;
pub use crate::store::RecoveryReport;
use crate::store::{BackingLayout, Store, StoreFiles, WbTarget};
use crate::zsmalloc::PoolFiles;

/// The header's first line: the format and its version.
const MAGIC: &str = "uzram-device-state 1";
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
    /// What recovery cannot rebuild yet, if anything (`None`: all of it).
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
}

impl Header {
    fn encode(&self) -> String {
        format!(
            "{MAGIC}\npage_size {}\npages {}\nmulti_page_size {}\ncomp_algorithm {}\nlevel {}\n\
             unsupported {}\nswap_pool {}\nbacking {}\nrecomp {}\nzoned {}\n",
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
        if lines.next() != Some(MAGIC) {
            return Err(bad(&format!("does not start with {MAGIC:?}")));
        }
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
        let sum = fnv1a(body.as_bytes());
        format!("{body}sum {sum:016x}\n")
    }

    /// The record in `bytes`, or `None` if the slot holds none or a torn one.
    fn decode(bytes: &[u8]) -> Option<Limits> {
        let text = std::str::from_utf8(bytes.split(|&b| b == 0).next()?).ok()?;
        let (body, sum_line) = text.trim_end_matches('\n').rsplit_once('\n')?;
        let body = format!("{body}\n");
        let sum = u64::from_str_radix(sum_line.strip_prefix("sum ")?, 16).ok()?;
        if sum != fnv1a(body.as_bytes()) {
            return None;
        }
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

/// What a device's settings hold that recovery cannot rebuild yet.
fn unsupported(settings: &Settings) -> Option<String> {
    let mut what = Vec::new();
    if settings.comp_params.dict.is_some()
        || settings.recomp_params.iter().any(|p| p.dict.is_some())
    {
        what.push("a dictionary");
    }
    (!what.is_empty()).then(|| what.join(", "))
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
            unsupported: unsupported(settings),
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
        Ok(file)
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
    /// the store rebuilt and checked (`docs/restart.md`, "Recovery"). `EINVAL` naming what is
    /// wrong if any check fails, if the device had settings whose state cannot be recovered
    /// yet, or if it served swap or wrote back (those take
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
        if let Some(what) = &header.unsupported {
            return Err(Error::invalid(format!(
                "recovery: the device had {what}, whose state is not recoverable yet"
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
        let codecs = Device::new_codecs(&settings)?;
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
        if let Some(l) = limits {
            use std::sync::atomic::Ordering::Relaxed;
            dev.limits_gen.store(l.gen, Relaxed);
            dev.mem_limit_pages.store(l.mem_limit_pages, Relaxed);
            dev.wb_limit.set_enabled(l.wb_limit_enabled);
            dev.wb_limit.set_limit_units(l.wb_limit_units);
            dev.wb_batch_size.store(l.wb_batch_size, Relaxed);
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
            ..h.clone()
        };
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
        assert!(Header::decode(&[0u8; 64]).is_err());
        let text = h.encode().replace("pages 12345", "pages x");
        assert!(Header::decode(text.as_bytes()).is_err());
    }
}
