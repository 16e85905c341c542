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
//! - The table is one anonymous `MAP_NORESERVE` mapping: pages of it are committed only when a
//!   slot on them is first written, so a 100 GiB device costs nothing until used; except in a
//!   device serving swap (`crate::memory`), whose table is faulted in whole when it is made.

pub mod entry;
pub mod lock;

pub use entry::{codec_id, SlotEntry, SlotFlags, SlotState, MAX_GENS};
pub use lock::SlotGuard;

use crate::error::{Error, Result};
use std::ptr::NonNull;

/// A page index on the device (zram's `index`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SlotIndex(pub u64);

/// The table of slot entries of one initialised device.
#[derive(Debug)]
pub struct SlotTable {
    /// Start of the mapping: `len` entries, zero-initialised by the kernel.
    base: NonNull<SlotEntry>,
    len: usize,
    map_bytes: usize,
}

// SAFETY: the table is an array of atomics (SlotEntry is made only of atomic words), so shared
// access from many threads is sound; the raw pointer is owned by the table and unmapped on drop.
unsafe impl Send for SlotTable {}
// SAFETY: as above: every access goes through `&SlotEntry`, whose fields are atomics.
unsafe impl Sync for SlotTable {}

impl SlotTable {
    /// Reserves a table of `len` empty slots. Costs address space only.
    pub fn new(len: u64) -> Result<SlotTable> {
        SlotTable::with_faulting(len, false)
    }

    /// As [`new`](Self::new); with `fault_in`, the whole table is faulted in now (a server
    /// backing swap: `crate::memory`), so no write under memory pressure faults a page of it.
    pub fn with_faulting(len: u64, fault_in: bool) -> Result<SlotTable> {
        let len_usize = usize::try_from(len).map_err(|_| Error::invalid("too many slots"))?;
        let bytes = len_usize
            .checked_mul(std::mem::size_of::<SlotEntry>())
            .ok_or_else(|| Error::invalid("too many slots"))?
            .max(1);
        // SAFETY: an anonymous private mapping with no address hint has no preconditions; the
        // result is checked against MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::no_memory(format!(
                "cannot reserve {bytes} bytes for the slot table: {}",
                std::io::Error::last_os_error()
            )));
        }
        let base = NonNull::new(ptr.cast::<SlotEntry>())
            .ok_or_else(|| Error::no_memory("mmap returned null"))?;
        if fault_in {
            // Serving swap: the whole table now (as the kernel's zram allocates its table at
            // `disksize`), so no write under memory pressure faults a page of it in.
            // SAFETY: the range is exactly the fresh mapping; populating writes nothing visible
            // (the pages stay zero).
            let rc = unsafe {
                libc::madvise(ptr, bytes, 23 /* MADV_POPULATE_WRITE */)
            };
            if rc != 0 {
                // Kernels before 5.14: touch a word of every page (zero over zero).
                for off in (0..bytes).step_by(4096) {
                    // SAFETY: `off < bytes`, inside the mapping, which nobody else uses yet.
                    unsafe { ptr.cast::<u8>().add(off).write_volatile(0) };
                }
            }
        }
        Ok(SlotTable {
            base,
            len: len_usize,
            map_bytes: bytes,
        })
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
        // SAFETY: `i < len`, the mapping holds `len` entries and lives as long as `self`; an
        // all-zero SlotEntry is valid (it is made of atomic integers).
        unsafe { &*self.base.as_ptr().add(i) }
    }

    /// Locks slot `index` (zram's `zram_slot_lock`).
    #[inline]
    pub fn lock(&self, index: SlotIndex) -> SlotGuard<'_> {
        SlotGuard::lock(self.entry(index), index)
    }

    /// Bytes of the table: 16 per slot, reserved when the device is initialised and held until
    /// reset (fixed overhead, as zram's `vzalloc`ed table; pages of it never touched are not
    /// resident).
    pub fn size_bytes(&self) -> u64 {
        (self.len * std::mem::size_of::<SlotEntry>()) as u64
    }

    /// Bytes of slot metadata per page: the size of one entry.
    pub const fn metadata_bytes_per_page() -> usize {
        std::mem::size_of::<SlotEntry>()
    }
}

impl Drop for SlotTable {
    fn drop(&mut self) {
        // SAFETY: `base`/`map_bytes` describe the mapping made in `new`; no reference into it
        // outlives `self` (entries are borrowed from `&self`).
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.map_bytes);
        }
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
