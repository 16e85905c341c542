//! The slot table: one packed 16-byte [`SlotEntry`] per page of the device, with its lock.
//!
//! zram's `struct zram_table_entry`. Each entry holds, in 16 bytes:
//!
//! | word | bits | field |
//! |---|---|---|
//! | `value: u64` | 64 | the zsmalloc handle, or the same-fill word (SAME), or the backing location (WB) |
//! | `meta: u32` | 0..=16 | object size in bytes (0..=65536: 17 bits) |
//! | | 17..=24 | flags: SAME, WB, PP_SLOT, HUGE, IDLE, INCOMPRESSIBLE, MULTI |
//! | | 25..=26 | compression priority (0 = primary codec, 1..=3 = recompression codecs) |
//! | | 27..=29 | dictionary generation of a recompression codec (0..=7) |
//! | | 30, 31 | the slot lock: LOCKED and PARKED (see [`lock`]) |
//! | `ac_time: u32` | 32 | last access, in seconds since the device was initialised |
//!
//! A zeroed entry is an empty slot (never written, or freed): it reads back as zeroes.
//!
//! # Invariants
//! - Every field but the lock bits changes only while the slot's lock is held ([`SlotTable::lock`]).
//!   Readers that need a consistent view take the lock; the idle scan reads `meta`/`ac_time`
//!   without it only to choose candidates, and re-checks under the lock.
//! - The table is one shared `MAP_NORESERVE` mapping of a memfd (`crate::shm`), so it outlives
//!   the process that wrote it (`docs/restart.md`): pages of it are committed only when a slot
//!   on them is first written, so a 100 GiB device costs nothing until used; except in a
//!   device serving swap (`crate::memory`), whose table is faulted in whole when it is made.

pub mod entry;
mod journal;
pub mod lock;

pub use entry::{codec_id, SlotEntry, SlotFlags, SlotState, MAX_GENS};
pub use lock::SlotGuard;

use crate::error::{Error, Result};
use crate::shm::{ShmFile, ShmMap};
use journal::{Journal, JournalEntry, JOURNAL_ENTRIES};

/// A page index on the device (zram's `index`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotIndex(pub u64);

/// The table of slot entries of one initialised device.
#[derive(Debug)]
pub struct SlotTable {
    /// The entries: `len` of them, zero-initialised (a fresh file) or as a previous process
    /// left them.
    map: ShmMap,
    len: usize,
    /// Where the journal starts in the mapping (after the entries).
    journal_offset: usize,
    /// The memfd holding the entries (`docs/restart.md`).
    file: ShmFile,
}

impl SlotTable {
    /// Reserves a table of `len` empty slots. Costs address space only.
    pub fn new(len: u64) -> Result<SlotTable> {
        SlotTable::with_faulting(len, false)
    }

    /// As [`new`](Self::new); with `fault_in`, the whole table is faulted in now (a server
    /// backing swap: `crate::memory`), so no write under memory pressure faults a page of it.
    pub fn with_faulting(len: u64, fault_in: bool) -> Result<SlotTable> {
        let file = ShmFile::create("slots")?;
        file.set_len(Self::file_bytes(len)? as u64)?;
        let table = SlotTable::map(file, len)?;
        if fault_in {
            table.fault_in();
        }
        Ok(table)
    }

    /// The table of `len` slots a previous process left in `file` (`docs/restart.md`); its
    /// entries are taken as they are (recovery checks them): the journal is rolled forward
    /// (`journal`), and the lock bits of slots locked when that process died and the PP_SLOT
    /// marks of its pending writeback or recompression are cleared.
    /// Returns the table and the number of entries rolled forward.
    pub fn from_file(file: ShmFile, len: u64) -> Result<(SlotTable, u64)> {
        let bytes = Self::file_bytes(len)?;
        let have = file.len()?;
        if have != bytes as u64 {
            return Err(Error::invalid(format!(
                "the slot table holds {have} bytes, not {bytes} for {len} slots"
            )));
        }
        let table = SlotTable::map(file, len)?;
        let replayed = table
            .journal()
            .replay(len, |i| table.entry(SlotIndex(i)))
            .map_err(Error::invalid)?;
        for i in 0..len {
            let e = table.entry(SlotIndex(i));
            e.clear_lock_bits();
            // No writeback or recompression survives the process that selected the slot.
            e.clear_flags_locked(SlotFlags::PP_SLOT);
        }
        Ok((table, replayed))
    }

    /// Bytes of the entries, rounded up to a page (the journal follows).
    fn entries_bytes(len: u64) -> Result<usize> {
        let len_usize = usize::try_from(len).map_err(|_| Error::invalid("too many slots"))?;
        Ok(len_usize
            .checked_mul(std::mem::size_of::<SlotEntry>())
            .ok_or_else(|| Error::invalid("too many slots"))?
            .next_multiple_of(4096))
    }

    /// Bytes of the table's file: the entries, then the journal.
    fn file_bytes(len: u64) -> Result<usize> {
        Ok(Self::entries_bytes(len)? + JOURNAL_ENTRIES * std::mem::size_of::<JournalEntry>())
    }

    fn map(file: ShmFile, len: u64) -> Result<SlotTable> {
        let bytes = Self::file_bytes(len)?;
        let map = file.map(0, bytes)?;
        Ok(SlotTable {
            map,
            len: len as usize,
            journal_offset: Self::entries_bytes(len)?,
            file,
        })
    }

    /// Faults the whole table and its journal in (serving swap, as the kernel's zram
    /// allocates its table at `disksize`), so no write under memory pressure faults a page of
    /// either in. Call it while nobody else writes the table (made or being recovered).
    pub fn fault_in(&self) {
        self.map.populate(self.map.len_bytes());
    }

    /// The memfd holding the entries.
    pub fn file(&self) -> &ShmFile {
        &self.file
    }

    /// The journal after the entries.
    fn journal(&self) -> Journal<'_> {
        let offset = self.journal_offset;
        // SAFETY: the journal's `JOURNAL_ENTRIES` entries lie at `offset` inside the mapping
        // (its length is `file_bytes`), page aligned; any bit pattern is valid for them (atomics
        // and padding integers); they live as long as `self`.
        let entries = unsafe {
            std::slice::from_raw_parts(
                self.map.base().as_ptr().add(offset).cast::<JournalEntry>(),
                JOURNAL_ENTRIES,
            )
        };
        Journal::new(entries)
    }

    /// Number of slots (the device's page count).
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// True for a table of no slots (a store always has at least one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The entry of slot `index`. Panics when out of range: callers validate indexes first.
    #[inline]
    pub fn entry(&self, index: SlotIndex) -> &SlotEntry {
        let i = usize::try_from(index.0).expect("slot index fits usize");
        assert!(i < self.len, "slot index {i} out of range {}", self.len);
        // SAFETY: `i < len`, the mapping holds `len` entries (its length is checked when it is
        // made) and lives as long as `self`; it is page aligned, and any bit pattern is a valid
        // SlotEntry (it is made of atomic integers).
        unsafe { &*self.map.base().as_ptr().cast::<SlotEntry>().add(i) }
    }

    /// Locks slot `index` (zram's `zram_slot_lock`).
    #[inline]
    pub fn lock(&self, index: SlotIndex) -> SlotGuard<'_> {
        SlotGuard::lock_in(self.entry(index), index, Some(self.journal()))
    }

    /// Locks slot `index` if it is free right now.
    #[inline]
    pub fn try_lock(&self, index: SlotIndex) -> Option<SlotGuard<'_>> {
        SlotGuard::try_lock_in(self.entry(index), index, Some(self.journal()))
    }

    /// Bytes of the table: 16 per slot, reserved when the device is initialised and held until
    /// reset (fixed overhead, as zram's `vzalloc`ed table; pages of it never touched are not
    /// resident), and its journal's 32 KiB.
    pub fn size_bytes(&self) -> u64 {
        (self.len * std::mem::size_of::<SlotEntry>()
            + JOURNAL_ENTRIES * std::mem::size_of::<JournalEntry>()) as u64
    }

    /// Bytes of slot metadata per page: the size of one entry.
    pub const fn metadata_bytes_per_page() -> usize {
        std::mem::size_of::<SlotEntry>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_is_16_bytes() {
        assert_eq!(SlotTable::metadata_bytes_per_page(), 16);
    }

    #[test]
    fn huge_table_costs_nothing_until_touched() {
        // LTP's zram02 sets a 100 GB disksize: 26M slots, 400 MB of address space.
        let t = SlotTable::new((100u64 << 30) / 4096).unwrap();
        assert_eq!(t.len(), 26_214_400);
        let e = t.entry(SlotIndex(t.len() - 1));
        assert!(e.state_unlocked().is_empty());
        let mut g = t.lock(SlotIndex(12345));
        g.set_same(7);
        assert_eq!(g.state().same_word(), Some(7));
    }
}
