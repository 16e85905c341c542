//! The per-slot lock: two bits (LOCKED, PARKED) of the entry's `meta` word.
//!
//! zram locks each table entry with a bit lock that sleeps when contended. Here the lock bits
//! live in the same 32-bit word as the slot's size and flags, so every change to `meta` keeps
//! them (see `SlotEntry::store_locked`). Contended waiters spin briefly, then sleep in
//! `parking_lot_core`'s parking lot keyed by the word's address, as `parking_lot::RawMutex` does:
//! a waiter sets PARKED and sleeps only if LOCKED and PARKED are still both set when checked
//! under the parking lot's bucket lock; the unlocker clears PARKED (under that same bucket lock)
//! when it wakes the last waiter. So no wake-up is lost.
//!
//! Acquiring uses `Acquire` and releasing `Release`, so every data field read or written under
//! the lock (with `Relaxed`) is ordered by it.

use super::entry::{SlotEntry, SlotFlags, SlotState, LOCKED, PARKED};
use super::journal::Journal;
use super::SlotIndex;
use parking_lot_core::{
    ParkToken, SpinWait, UnparkToken, DEFAULT_PARK_TOKEN, DEFAULT_UNPARK_TOKEN,
};
use std::sync::atomic::Ordering;

/// Holds a slot's lock; unlocks on drop. All mutation of a slot goes through a guard.
#[derive(Debug)]
pub struct SlotGuard<'a> {
    entry: &'a SlotEntry,
    index: SlotIndex,
    /// The table's journal, through which every data change goes (none for a lone entry).
    journal: Option<Journal<'a>>,
}

impl<'a> SlotGuard<'a> {
    /// Locks `entry`, sleeping if another thread holds it.
    #[inline]
    pub fn lock(entry: &'a SlotEntry, index: SlotIndex) -> SlotGuard<'a> {
        Self::lock_in(entry, index, None)
    }

    /// Locks `entry`, slot `index` of a table whose changes go through `journal`.
    #[inline]
    pub(crate) fn lock_in(
        entry: &'a SlotEntry,
        index: SlotIndex,
        journal: Option<Journal<'a>>,
    ) -> SlotGuard<'a> {
        let prev = entry.meta.fetch_or(LOCKED, Ordering::Acquire);
        if prev & LOCKED != 0 {
            lock_slow(entry);
        }
        SlotGuard {
            entry,
            index,
            journal,
        }
    }

    /// Locks `entry` if it is free right now.
    #[inline]
    pub fn try_lock(entry: &'a SlotEntry, index: SlotIndex) -> Option<SlotGuard<'a>> {
        Self::try_lock_in(entry, index, None)
    }

    /// [`try_lock`](Self::try_lock) of slot `index` of a table with `journal`.
    #[inline]
    pub(crate) fn try_lock_in(
        entry: &'a SlotEntry,
        index: SlotIndex,
        journal: Option<Journal<'a>>,
    ) -> Option<SlotGuard<'a>> {
        let prev = entry.meta.fetch_or(LOCKED, Ordering::Acquire);
        // Not `then_some`: that would build (and drop, unlocking) a guard even on failure.
        if prev & LOCKED == 0 {
            Some(SlotGuard {
                entry,
                index,
                journal,
            })
        } else {
            None
        }
    }

    /// Replaces the slot's data (value, size, flags, codec) in one step for a process that
    /// stops at any instruction (through the journal, if the table has one).
    fn store(&mut self, value: u64, size_bytes: u32, flags: SlotFlags, codec: u8) {
        let data = SlotEntry::data_bits(size_bytes, flags, codec);
        match &self.journal {
            Some(j) => j.store(self.index.0, self.entry, value, data),
            None => self.entry.store_data(value, data, Ordering::Relaxed),
        }
    }

    /// Which slot this is.
    pub fn index(&self) -> SlotIndex {
        self.index
    }

    /// The slot's current contents.
    #[inline]
    pub fn state(&self) -> SlotState {
        self.entry.state_unlocked()
    }

    /// Empties the slot (zram's `zram_free_page` after the data is released): no data, no flags.
    /// The access time is kept.
    pub fn set_empty(&mut self) {
        self.store(0, 0, SlotFlags::NONE, 0);
    }

    /// Stores a same-filled page.
    pub fn set_same(&mut self, word: u64) {
        self.store(word, 0, SlotFlags::SAME, 0);
    }

    /// Stores a pool object: its raw handle, size and flags (HUGE), compressed with codec
    /// `codec` (a [`codec_id`](super::codec_id)).
    pub fn set_handle(&mut self, handle_raw: u64, size_bytes: usize, flags: SlotFlags, codec: u8) {
        debug_assert_ne!(handle_raw, 0);
        self.store(handle_raw, size_bytes as u32, flags, codec);
    }

    /// Points the slot at a backing location (WB), keeping its size, HUGE/INCOMPRESSIBLE flags
    /// and priority so that read-back knows how it was stored.
    pub fn set_wb(&mut self, location: u64, size_bytes: usize, flags: SlotFlags, codec: u8) {
        self.store(location, size_bytes as u32, flags | SlotFlags::WB, codec);
    }

    /// Puts back a state read earlier (used by testing hooks).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn restore(&mut self, state: SlotState) {
        self.store(
            state.value,
            state.size_bytes() as u32,
            state.flags(),
            state.codec(),
        );
        self.entry.restore_ac_time(state);
    }

    /// Sets flags.
    pub fn set_flags(&mut self, flags: SlotFlags) {
        self.entry.set_flags_locked(flags);
    }

    /// Clears flags.
    pub fn clear_flags(&mut self, flags: SlotFlags) {
        self.entry.clear_flags_locked(flags);
    }

    /// Records an access: clears IDLE and PP_SLOT (cancelling a pending writeback or
    /// recompression of this slot) and stamps the access time.
    #[inline]
    pub fn touch(&mut self, now_secs: u32) {
        self.entry
            .clear_flags_locked(SlotFlags::IDLE | SlotFlags::PP_SLOT);
        self.entry.ac_time_secs.store(now_secs, Ordering::Relaxed);
    }
}

impl Drop for SlotGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        let prev = self.entry.meta.fetch_and(!LOCKED, Ordering::Release);
        debug_assert!(prev & LOCKED != 0, "slot unlocked twice");
        if prev & PARKED != 0 {
            unlock_slow(self.entry);
        }
    }
}

fn key(entry: &SlotEntry) -> usize {
    &entry.meta as *const _ as usize
}

#[cold]
fn lock_slow(entry: &SlotEntry) {
    let mut spin = SpinWait::new();
    loop {
        let cur = entry.meta.load(Ordering::Relaxed);
        if cur & LOCKED == 0 {
            if entry.meta.fetch_or(LOCKED, Ordering::Acquire) & LOCKED == 0 {
                return;
            }
            continue;
        }
        if cur & PARKED == 0 && spin.spin() {
            continue;
        }
        if cur & PARKED == 0 {
            entry.meta.fetch_or(PARKED, Ordering::Relaxed);
        }
        let validate = || entry.meta.load(Ordering::Relaxed) & (LOCKED | PARKED) == LOCKED | PARKED;
        // SAFETY: the key is the address of this entry's meta word, which outlives the park (the
        // entry is borrowed); the callbacks only touch atomics: they neither panic nor call into
        // the parking lot.
        unsafe {
            parking_lot_core::park(
                key(entry),
                validate,
                || {},
                |_, _| {},
                ParkToken(DEFAULT_PARK_TOKEN.0),
                None,
            );
        }
        spin.reset();
    }
}

#[cold]
fn unlock_slow(entry: &SlotEntry) {
    // SAFETY: as in `lock_slow`: a valid key, and a callback that only does an atomic op.
    unsafe {
        parking_lot_core::unpark_one(key(entry), |result| {
            if !result.have_more_threads {
                entry.meta.fetch_and(!PARKED, Ordering::Relaxed);
            }
            UnparkToken(DEFAULT_UNPARK_TOKEN.0)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    #[test]
    fn lock_excludes_and_wakes() {
        // Four threads increment a non-atomic-style counter (load + store) under the slot lock;
        // any lost update means the lock failed to exclude.
        let entry = Arc::new(SlotEntry::default());
        let counter = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (entry, counter) = (entry.clone(), counter.clone());
                std::thread::spawn(move || {
                    for i in 0..20_000u32 {
                        let mut g = SlotGuard::lock(&entry, SlotIndex(0));
                        let v = counter.load(Ordering::Relaxed);
                        if i % 1000 == 0 {
                            std::thread::sleep(std::time::Duration::from_micros(50));
                        }
                        counter.store(v + 1, Ordering::Relaxed);
                        g.set_handle(v + 1, 1, SlotFlags::NONE, 0);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(counter.load(Ordering::Relaxed), 80_000);
        assert_eq!(entry.state_unlocked().value, 80_000);
        assert_eq!(entry.meta.load(Ordering::Relaxed) & (LOCKED | PARKED), 0);
    }

    #[test]
    fn try_lock_fails_while_held() {
        let e = SlotEntry::default();
        let g = SlotGuard::lock(&e, SlotIndex(1));
        assert!(SlotGuard::try_lock(&e, SlotIndex(1)).is_none());
        drop(g);
        assert!(SlotGuard::try_lock(&e, SlotIndex(1)).is_some());
    }
}
