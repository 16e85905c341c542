//! The slot journal: makes a slot entry's two-word update one step for a process that stops
//! at any instruction.
//!
//! A slot entry's data is two words (`value`, then `meta`: size, flags, codec), written one
//! after the other under the slot's lock. In memory that outlives the process
//! (`docs/restart.md`), a stop between the two stores would leave a torn entry: a new handle
//! under the old entry's SAME flag reads as a same-filled page of the handle's number. So every
//! update (`SlotEntry::store_locked` through a guard of a table) is journaled:
//!
//! 1. take journal entry `slot % JOURNAL_ENTRIES` (a spin lock in its `state` word: two slots
//!    that share an entry wait for each other for a few stores, never while blocking);
//! 2. write the new `value` and `meta` into it, then `state = BUSY | VALID | slot` (`Release`);
//! 3. write the slot entry's two words (`Release` each, so neither moves before the mark);
//! 4. `state = 0` (`Release`, after the slot's words).
//!
//! Recovery rolls every entry with VALID forward: its slot gets the journaled words, whatever
//! it held (old, torn or already new). The object a journaled value names is complete before
//! step 2 (its bytes were copied before the slot was locked), so rolling forward is safe.
//!
//! The journal lives after the slot entries in the slot table's file; 1024 entries of 32 bytes
//! (32 KiB, of which only the pages of entries used are committed).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::entry::{SlotEntry, LOCK_BITS};

/// Journal entries: slots map to `index % JOURNAL_ENTRIES`. Enough that two writers rarely
/// share one (the store's threads are a few per CPU).
pub(crate) const JOURNAL_ENTRIES: usize = 1024;

const BUSY: u64 = 1 << 63;
const VALID: u64 = 1 << 62;
const SLOT_MASK: u64 = VALID - 1;

/// One journal entry (32 bytes).
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct JournalEntry {
    /// 0: free; `BUSY`: taken; `BUSY | VALID | slot`: the words below are that slot's next.
    state: AtomicU64,
    value: AtomicU64,
    meta: AtomicU32,
    _pad: [u32; 3],
}

/// The journal: `JOURNAL_ENTRIES` entries in shared memory (see the module docs).
#[derive(Debug)]
pub(crate) struct Journal<'a> {
    entries: &'a [JournalEntry],
}

impl<'a> Journal<'a> {
    pub(crate) fn new(entries: &'a [JournalEntry]) -> Journal<'a> {
        debug_assert_eq!(entries.len(), JOURNAL_ENTRIES);
        Journal { entries }
    }

    /// Stores `value` and the data bits `data` (no lock bits) into `entry`, slot `index`,
    /// through the journal. The caller holds the slot's lock.
    pub(crate) fn store(&self, index: u64, entry: &SlotEntry, value: u64, data: u32) {
        debug_assert_eq!(data & LOCK_BITS, 0);
        debug_assert!(index <= SLOT_MASK);
        let j = &self.entries[(index % JOURNAL_ENTRIES as u64) as usize];
        while j
            .state
            .compare_exchange_weak(0, BUSY, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        j.value.store(value, Ordering::Relaxed);
        j.meta.store(data, Ordering::Relaxed);
        j.state.store(BUSY | VALID | index, Ordering::Release);
        entry.store_data(value, data, Ordering::Release);
        j.state.store(0, Ordering::Release);
    }

    /// Recovery: rolls every valid entry forward into `slot(index)` (which must exist: `Err`
    /// names a slot out of range), then clears the journal.
    pub(crate) fn replay(
        &self,
        len: u64,
        slot: impl Fn(u64) -> &'a SlotEntry,
    ) -> Result<u64, String> {
        let mut replayed = 0;
        for j in self.entries {
            let state = j.state.load(Ordering::Acquire);
            if state & VALID != 0 {
                let index = state & SLOT_MASK;
                if index >= len {
                    return Err(format!("the slot journal names slot {index} of {len}"));
                }
                let data = j.meta.load(Ordering::Relaxed);
                if data & LOCK_BITS != 0 {
                    return Err(format!(
                        "the slot journal's entry for slot {index} is corrupt"
                    ));
                }
                slot(index).store_data(j.value.load(Ordering::Relaxed), data, Ordering::Release);
                replayed += 1;
            }
            j.state.store(0, Ordering::Relaxed);
            j.value.store(0, Ordering::Relaxed);
            j.meta.store(0, Ordering::Relaxed);
        }
        Ok(replayed)
    }
}
