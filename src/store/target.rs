//! The writeback target: where written-back pages live on the backing device, laid out as
//! `backing_layout` says. One type, [`WbTarget`], with one variant per layout:
//!
//! - [`WbTarget::Bitmap`]: one page-sized block per slot from a [`BlockBitmap`] (zram's
//!   layout); a WB slot's value is a packed [`BlockLoc`]: the block index and the CRC-32C of
//!   the block as written ([`block_crc`]), checked on every read-back. With
//!   `compressed_writeback` a block holds the stored object (zero-padded to the block), else
//!   the page.
//! - [`WbTarget::Zoned`]: records appended to the zones of a [`ZoneStore`], with GC; a WB
//!   slot's value is a packed [`ZoneLoc`] (`ZoneLoc::to_raw`). A record holds the stored object
//!   (compressed, or the raw page of a HUGE slot).
//!
//! The layout is fixed for the life of an initialisation, so the variant tells how every WB
//! slot's value reads. Both variants answer the same questions: [`pin`](WbTarget::pin) a WB
//! slot's location for a read (under the slot lock), [`read_page`](WbPin::read_page) through
//! the pin (without it), [`release`](WbTarget::release) a location a slot gave up (under the
//! slot lock, exactly once), [`pages_stored`](WbTarget::pages_stored) (`bd_count`); and, for
//! writeback, [`commit`](WbTarget::commit) a written location a slot now points at (under the
//! slot lock) or [`abort`](WbTarget::abort) one no slot took. So read-back has one path.
//!
//! Every read-back is verified, in both layouts (see [`crate::backing::verify`]): a block
//! against the CRC in its slot, a record against its header's magic, slot, length and CRC. A
//! mismatch is `EIO`, counted in the target's [`Mismatches`] (`bd_checksum_errors`) and logged
//! once per device; the slot is left as it was.
//!
//! Locks: the bitmap's mutex and the zone store's `zones` mutex are leaves, taken under a slot
//! lock or without one; no slot lock is held across the backing I/O of `read_page`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::bitmap::{BlockBitmap, BlockIndex, BlockPin};
use crate::backing::verify::{block_crc, Mismatches};
use crate::backing::Backing;
use crate::compress::Codec;
use crate::error::{Error, Result};
use crate::slot::{SlotFlags, SlotState};
use crate::zoned::{ZoneConfig, ZoneLoc, ZonePin, ZoneStore};

/// How written-back pages are laid out on the backing device (`backing_layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackingLayout {
    /// One page-sized block per slot, from a bitmap (zram's layout).
    #[default]
    Bitmap,
    /// Append-only zones of records with garbage collection ([`crate::zoned`]).
    Zoned,
}

impl BackingLayout {
    /// `bitmap` or `zoned`.
    pub fn name(self) -> &'static str {
        match self {
            BackingLayout::Bitmap => "bitmap",
            BackingLayout::Zoned => "zoned",
        }
    }

    /// Parses [`name`](Self::name)'s output.
    pub fn parse(s: &str) -> Result<BackingLayout> {
        match s {
            "bitmap" => Ok(BackingLayout::Bitmap),
            "zoned" => Ok(BackingLayout::Zoned),
            _ => Err(Error::invalid(format!(
                "backing_layout {s:?}: bitmap or zoned"
            ))),
        }
    }
}

/// An initialised device's writeback target. See the module docs.
#[derive(Debug)]
pub(crate) enum WbTarget {
    /// One block per slot.
    Bitmap(BitmapTarget),
    /// Records in append-only zones.
    Zoned(ZonedTarget),
}

/// A bitmap-layout WB slot's value: the block in the low 32 bits, the CRC-32C of the block as
/// written ([`block_crc`]) in the high 32. A block index needs far fewer than 64 bits, so the
/// checksum costs the slot nothing (it stays 16 bytes); the price is at most 2^32 blocks (16 TiB
/// of 4 KiB pages) per backing device, which [`WbTarget::new`] enforces by using no more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockLoc {
    pub(crate) block: BlockIndex,
    pub(crate) crc: u32,
}

impl BlockLoc {
    /// Blocks a [`BlockLoc`] can address.
    pub(crate) const MAX_BLOCKS: u64 = 1 << 32;

    /// The slot value.
    pub(crate) fn to_raw(self) -> u64 {
        debug_assert!(self.block.0 < Self::MAX_BLOCKS);
        self.block.0 | u64::from(self.crc) << 32
    }

    /// Unpacks [`to_raw`](Self::to_raw)'s value.
    pub(crate) fn from_raw(raw: u64) -> BlockLoc {
        BlockLoc {
            block: BlockIndex(raw & (Self::MAX_BLOCKS - 1)),
            crc: (raw >> 32) as u32,
        }
    }
}

/// The bitmap layout: page-sized blocks of the backing device.
#[derive(Debug)]
pub(crate) struct BitmapTarget {
    backing: Arc<dyn Backing>,
    /// One bit per page-sized block of the backing device (at most [`BlockLoc::MAX_BLOCKS`]).
    bitmap: BlockBitmap,
    /// Read-backs whose block did not match its checksum.
    mismatches: Mismatches,
    /// Blocks are checksummed and verified: always, except in the benchmark's baseline
    /// (`Device::bench_skip_block_checksums`), which measures what the checksum costs.
    checked: AtomicBool,
    /// `compressed_writeback`: blocks hold the stored object (decompressed on read) rather than
    /// the page. Fixed for the life of the initialisation.
    compressed: bool,
    page_size_bytes: usize,
}

/// The zoned layout: records in the zones of a [`ZoneStore`].
#[derive(Debug)]
pub(crate) struct ZonedTarget {
    store: Arc<ZoneStore>,
    /// WB slots pointing at committed records (`bd_count`). Changed under the slot lock that
    /// commits or releases the record.
    pages: AtomicU64,
}

impl WbTarget {
    /// The target over `backing` for `layout`: a bitmap of its page-sized blocks, or a zoned
    /// store of zones of `zone_size_bytes` (`EINVAL` for zones the backing cannot hold).
    pub(crate) fn new(
        backing: Arc<dyn Backing>,
        layout: BackingLayout,
        compressed: bool,
        page_size_bytes: usize,
        zone_size_bytes: u64,
    ) -> Result<WbTarget> {
        WbTarget::open(
            backing,
            layout,
            compressed,
            page_size_bytes,
            zone_size_bytes,
            false,
        )
    }

    /// [`new`](Self::new), or with `recovering` [`recovering`](Self::recovering).
    fn open(
        backing: Arc<dyn Backing>,
        layout: BackingLayout,
        compressed: bool,
        page_size_bytes: usize,
        zone_size_bytes: u64,
        recovering: bool,
    ) -> Result<WbTarget> {
        Ok(match layout {
            BackingLayout::Bitmap => WbTarget::Bitmap(BitmapTarget {
                bitmap: BlockBitmap::new(
                    (backing.size_bytes() / page_size_bytes as u64).min(BlockLoc::MAX_BLOCKS),
                ),
                mismatches: Mismatches::default(),
                checked: AtomicBool::new(true),
                backing,
                compressed,
                page_size_bytes,
            }),
            BackingLayout::Zoned => {
                let config = ZoneConfig {
                    zone_size_bytes,
                    ..ZoneConfig::default()
                };
                let store = if recovering {
                    ZoneStore::recovering(backing, config)?
                } else {
                    ZoneStore::new(backing, config)?
                };
                WbTarget::Zoned(ZonedTarget {
                    store: Arc::new(store),
                    pages: AtomicU64::new(0),
                })
            }
        })
    }

    /// Pins the location of a WB slot whose value is `location`, for a read after the slot
    /// lock is dropped: the location cannot be reused (bitmap) or its zone reset (zoned) while
    /// the pin lives. The caller holds the slot's lock.
    pub(crate) fn pin(&self, location: u64) -> WbPin<'_> {
        match self {
            WbTarget::Bitmap(t) => {
                let loc = BlockLoc::from_raw(location);
                WbPin::Block(t, t.bitmap.pin(loc.block), loc.crc)
            }
            WbTarget::Zoned(t) => WbPin::Zone(t, t.store.pin(ZoneLoc::from_raw(location))),
        }
    }

    /// Releases the location a WB slot pointed at (it was overwritten, discarded or reset),
    /// `blocks` page-sized blocks long (1 for a page; a multi-page object's from
    /// [`group_blocks`](Self::group_blocks)). The caller holds the lock of the slot (the last one
    /// of a multi-page object's group pointing there) and empties it: exactly once per location.
    pub(crate) fn release(&self, location: u64, blocks: u64) {
        match self {
            WbTarget::Bitmap(t) => t
                .bitmap
                .release_extent(BlockLoc::from_raw(location).block, blocks),
            WbTarget::Zoned(t) => {
                t.store.release(ZoneLoc::from_raw(location));
                t.pages.fetch_sub(blocks, Ordering::Relaxed);
            }
        }
    }

    /// A location writeback wrote, `blocks` long, now belongs to a slot (or a multi-page
    /// object's group): the caller holds that slot's lock (the group's) and has just pointed it
    /// there, so a release (under the same lock) always follows this.
    pub(crate) fn commit(&self, location: u64, blocks: u64) {
        match self {
            // The block was allocated when writeback reserved it.
            WbTarget::Bitmap(_) => {}
            WbTarget::Zoned(t) => {
                t.store.commit(ZoneLoc::from_raw(location));
                t.pages.fetch_add(blocks, Ordering::Relaxed);
            }
        }
    }

    /// A location writeback reserved, `blocks` long, that no slot took (its write failed, or
    /// its slot changed meanwhile): given back. No slot lock is needed: no slot points there.
    pub(crate) fn abort(&self, location: u64, blocks: u64) {
        match self {
            WbTarget::Bitmap(t) => t
                .bitmap
                .release_extent(BlockLoc::from_raw(location).block, blocks),
            WbTarget::Zoned(t) => t.store.abort(ZoneLoc::from_raw(location)),
        }
    }

    /// The target a previous process left on `backing` (`docs/restart.md`), for recovery:
    /// as [`new`](Self::new), nothing on the backing device reset, its allocation rebuilt by
    /// [`claim`](Self::claim) and [`finish_recovery`](Self::finish_recovery).
    pub(crate) fn recovering(
        backing: Arc<dyn Backing>,
        layout: BackingLayout,
        compressed: bool,
        page_size_bytes: usize,
        zone_size_bytes: u64,
    ) -> Result<WbTarget> {
        WbTarget::open(
            backing,
            layout,
            compressed,
            page_size_bytes,
            zone_size_bytes,
            true,
        )
    }

    /// Recovery: every location claimed; `Err` naming what is wrong (two zoned records
    /// overlapping).
    pub(crate) fn finish_recovery(&self) -> std::result::Result<(), String> {
        match self {
            WbTarget::Bitmap(_) => Ok(()),
            WbTarget::Zoned(t) => t.store.finish_recovery(),
        }
    }

    /// Recovery: the location a WB slot `slot` (or a written-back multi-page object's group,
    /// `slot` its first) points at, `blocks` long, is in use: marked in the bitmap, or a live
    /// record of its zone. `Err` naming what is wrong if it is out of range or already claimed
    /// (two slots on one block; overlapping records show at
    /// [`finish_recovery`](Self::finish_recovery)).
    pub(crate) fn claim(
        &self,
        location: u64,
        blocks: u64,
        slot: u64,
    ) -> std::result::Result<(), String> {
        match self {
            WbTarget::Bitmap(t) => {
                let block = BlockLoc::from_raw(location).block;
                if t.bitmap.claim_extent(block, blocks) {
                    Ok(())
                } else {
                    Err(format!(
                        "block {} ({blocks} long) is past the backing device's {} blocks or \
                         named twice",
                        block.0,
                        t.bitmap.blocks_total()
                    ))
                }
            }
            WbTarget::Zoned(t) => {
                t.store.claim(ZoneLoc::from_raw(location), slot)?;
                t.pages.fetch_add(blocks, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// Page-sized blocks a written-back multi-page object of `size_bytes` takes: in the bitmap
    /// layout its blocks, in the zoned layout what `bd_count` counts for its record.
    pub(crate) fn group_blocks(size_bytes: usize, page_size_bytes: usize) -> u64 {
        size_bytes.div_ceil(page_size_bytes) as u64
    }

    /// Pages on the backing device (zram's `bd_count`, in pages): allocated blocks (those of
    /// writes in flight included), or committed records.
    pub(crate) fn pages_stored(&self) -> u64 {
        match self {
            WbTarget::Bitmap(t) => t.bitmap.bd_count(),
            WbTarget::Zoned(t) => t.pages.load(Ordering::Relaxed),
        }
    }

    /// Read-backs whose data failed verification (`bd_checksum_errors`).
    pub(crate) fn checksum_errors(&self) -> u64 {
        match self {
            WbTarget::Bitmap(t) => t.mismatches.count(),
            WbTarget::Zoned(t) => t.store.checksum_errors(),
        }
    }

    /// The backing device.
    pub(crate) fn backing(&self) -> &Arc<dyn Backing> {
        match self {
            WbTarget::Bitmap(t) => &t.backing,
            WbTarget::Zoned(t) => t.store.backing(),
        }
    }
}

impl BitmapTarget {
    /// The block allocator.
    pub(crate) fn bitmap(&self) -> &BlockBitmap {
        &self.bitmap
    }

    /// Whether blocks hold stored objects rather than pages (`compressed_writeback`).
    pub(crate) fn compressed(&self) -> bool {
        self.compressed
    }

    /// Bytes per block: the device's page size.
    pub(crate) fn page_size_bytes(&self) -> usize {
        self.page_size_bytes
    }

    /// The slot value for `block` holding `data` (the whole block as written, or the blocks
    /// of a multi-page object from `block` on).
    pub(crate) fn location(&self, block: BlockIndex, data: &[u8]) -> u64 {
        debug_assert_eq!(data.len() % self.page_size_bytes, 0);
        let crc = if self.checked.load(Ordering::Relaxed) {
            block_crc(block.0, data)
        } else {
            0
        };
        BlockLoc { block, crc }.to_raw()
    }

    /// Stops checksumming and verifying blocks, for good: the benchmark's baseline. Called
    /// before anything is written back (a block written with a checksum is then read without
    /// its check, never the other way round).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn skip_checksums(&self) {
        self.checked.store(false, Ordering::Relaxed);
    }

    /// Byte offset of `block` on the backing device.
    pub(crate) fn offset(&self, block: BlockIndex) -> u64 {
        block.0 * self.page_size_bytes as u64
    }
}

impl ZonedTarget {
    /// The zoned store.
    pub(crate) fn store(&self) -> &Arc<ZoneStore> {
        &self.store
    }
}

/// A read's pin on a WB slot's location (see [`WbTarget::pin`]), with the variant it belongs
/// to, so the read that follows needs no other lookup.
#[derive(Debug)]
pub(crate) enum WbPin<'a> {
    /// A block of the bitmap layout, and the CRC-32C it was written with.
    Block(&'a BitmapTarget, BlockPin<'a>, u32),
    /// A record of the zoned layout (its zone is pinned).
    Zone(&'a ZonedTarget, ZonePin<'a>),
}

impl WbPin<'_> {
    /// The pinned location, as a WB slot holds it.
    pub(crate) fn location(&self) -> u64 {
        match self {
            WbPin::Block(_, pin, crc) => BlockLoc {
                block: pin.block(),
                crc: *crc,
            }
            .to_raw(),
            WbPin::Zone(_, pin) => pin.loc().to_raw(),
        }
    }

    /// Reads the written-back page of `slot` (whose state, read under its lock when the pin was
    /// taken, is `st`) into `out` (one page), decompressing it with `codec` when it was written
    /// as a compressed object; `scratch` (at least a page) holds the block read for that. No
    /// slot lock is held. A backing error, a block or record that does not verify (a block's
    /// CRC; a record's magic, slot, length, CRC) or an object that does not decompress is
    /// `EIO`, never other data, and changes nothing.
    pub(crate) fn read_page(
        &self,
        slot: u64,
        st: SlotState,
        codec: &dyn Codec,
        out: &mut [u8],
        scratch: &mut [u8],
    ) -> Result<()> {
        match self {
            WbPin::Block(t, pin, crc) => read_block(t, pin, *crc, st, codec, out, scratch),
            WbPin::Zone(t, pin) => read_record(t, slot, pin, st, codec, out),
        }
    }

    /// Reads the written-back multi-page object of a MULTI slot of the group starting at slot
    /// `first` (its state, under its lock when the pin was taken, is `st`: the object's size
    /// and codec) and decompresses at least its first `want_bytes` into `out` (the whole group),
    /// returning how many leading bytes are valid; `scratch` is resized to hold its blocks.
    /// Verified as [`read_page`](Self::read_page) verifies; `EIO` otherwise.
    pub(crate) fn read_group(
        &self,
        first: u64,
        st: SlotState,
        codec: &dyn Codec,
        out: &mut [u8],
        scratch: &mut Vec<u8>,
        want_bytes: usize,
    ) -> Result<usize> {
        let size = st.size_bytes();
        let decompress = |obj: &[u8], out: &mut [u8]| {
            codec.decompress_prefix(obj, out, want_bytes).map_err(|e| {
                Error::io(format!(
                    "written-back multi-page object of slot {first} does not decompress: {e}"
                ))
            })
        };
        match self {
            WbPin::Block(t, pin, crc) => {
                let blocks = WbTarget::group_blocks(size, t.page_size_bytes) as usize;
                scratch.resize(blocks * t.page_size_bytes, 0);
                let offset = t.offset(pin.block());
                t.backing.read_at(scratch, offset).map_err(|e| {
                    Error::io(format!(
                        "reading written-back multi-page object from block {} of {}: {e}",
                        pin.block().0,
                        t.backing.describe()
                    ))
                })?;
                if t.checked.load(Ordering::Relaxed) {
                    let got = block_crc(pin.block().0, scratch);
                    if got != *crc {
                        return Err(t.mismatches.note(
                            &t.backing.describe(),
                            offset,
                            &format!("written-back blocks {}+{blocks}", pin.block().0),
                            &format!("CRC-32C {got:#010x}, written {crc:#010x}"),
                        ));
                    }
                }
                decompress(&scratch[..size], out)
            }
            WbPin::Zone(t, pin) => {
                let (h, payload) = t.store.read_record(pin.loc(), first).map_err(|e| {
                    Error::io(format!(
                        "reading written-back multi-page object of slot {first} from {:?} of \
                         {}: {e}",
                        pin.loc(),
                        t.store.backing().describe()
                    ))
                })?;
                if !h.is_compressed() || h.prio != st.codec() || payload.len() != size {
                    return Err(Error::io(format!(
                        "record of slot {first}: flags {}, codec {}, {} bytes; the slot says a \
                         multi-page object of codec {}, {size} bytes",
                        h.flags,
                        h.prio,
                        payload.len(),
                        st.codec()
                    )));
                }
                decompress(&payload, out)
            }
        }
    }
}

/// [`WbPin::read_page`] of a block, checked against `crc` before anything is decoded or
/// returned.
fn read_block(
    t: &BitmapTarget,
    pin: &BlockPin<'_>,
    crc: u32,
    st: SlotState,
    codec: &dyn Codec,
    out: &mut [u8],
    scratch: &mut [u8],
) -> Result<()> {
    let page = out.len();
    let offset = t.offset(pin.block());
    let io_err = |e: Error| {
        Error::io(format!(
            "reading written-back page from block {} of {}: {e}",
            pin.block().0,
            t.backing.describe()
        ))
    };
    let verify = |blk: &[u8]| {
        if !t.checked.load(Ordering::Relaxed) {
            return Ok(());
        }
        let got = block_crc(pin.block().0, blk);
        if got == crc {
            Ok(())
        } else {
            Err(t.mismatches.note(
                &t.backing.describe(),
                offset,
                &format!("written-back block {}", pin.block().0),
                &format!("CRC-32C {got:#010x}, written {crc:#010x}"),
            ))
        }
    };
    if t.compressed && !st.has(SlotFlags::HUGE) {
        let blk = &mut scratch[..page];
        t.backing.read_at(blk, offset).map_err(io_err)?;
        verify(blk)?;
        let size = st.size_bytes();
        codec
            .decompress(&blk[..size], out)
            .map_err(|e| Error::io(format!("written-back object does not decompress: {e}")))
    } else {
        t.backing.read_at(out, offset).map_err(io_err)?;
        verify(out).inspect_err(|_| {
            // `out` is the caller's page: leave none of the wrong bytes in it, even though a
            // failed read's buffer is never sent.
            out.fill(0);
        })
    }
}

/// [`WbPin::read_page`] of a record: verified by the zone store, decompressed with the codec of
/// its priority when its flags say it holds a compressed object. `pin` keeps the zone from
/// being reset.
fn read_record(
    t: &ZonedTarget,
    slot: u64,
    pin: &ZonePin<'_>,
    st: SlotState,
    codec: &dyn Codec,
    out: &mut [u8],
) -> Result<()> {
    let io_err = |e: Error| {
        Error::io(format!(
            "reading written-back page {slot} from {:?} of {}: {e}",
            pin.loc(),
            t.store.backing().describe()
        ))
    };
    let (h, payload) = t.store.read_record(pin.loc(), slot).map_err(io_err)?;
    if h.is_compressed() {
        // The record carries the codec (priority and generation) the slot had when it was
        // written back; the slot keeps it while WB, so a mismatch is a record this slot did
        // not write.
        if h.prio != st.codec() {
            return Err(io_err(Error::io(format!(
                "record compressed with codec {}, slot says {}",
                h.prio,
                st.codec()
            ))));
        }
        codec
            .decompress(&payload, out)
            .map_err(|e| io_err(Error::io(format!("record does not decompress: {e}"))))
    } else {
        if payload.len() != out.len() {
            return Err(io_err(Error::io(format!(
                "raw record of {} bytes for a {}-byte page",
                payload.len(),
                out.len()
            ))));
        }
        out.copy_from_slice(&payload);
        Ok(())
    }
}
