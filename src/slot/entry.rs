//! The packed slot entry and a decoded snapshot of it. Layout: see the [module docs](super).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Bits 0..=16 of `meta`: object size in bytes (a 64 KiB page needs 17 bits).
const SIZE_MASK: u32 = (1 << 17) - 1;
const FLAGS_SHIFT: u32 = 17;
const FLAGS_MASK: u32 = 0xff << FLAGS_SHIFT;
/// Bits 25..=29: the codec that wrote the object, [`codec_id`]: its priority (25..=26) and, for
/// a recompression priority, its dictionary generation (27..=29).
const CODEC_SHIFT: u32 = 25;
const CODEC_MASK: u32 = 0b1_1111 << CODEC_SHIFT;

/// Dictionary generations a recompression priority can hold at once (3 bits of the slot).
pub const MAX_GENS: usize = 8;

/// The codec id a slot records: priority `prio` (0..=3) and generation `gen` (0..=7).
pub const fn codec_id(prio: u8, gen: u8) -> u8 {
    prio | (gen << 2)
}
/// The lock bits (owned by [`super::lock`]); everything else is data.
pub(crate) const LOCKED: u32 = 1 << 30;
pub(crate) const PARKED: u32 = 1 << 31;
pub(crate) const LOCK_BITS: u32 = LOCKED | PARKED;

/// Flags of a slot, zram's `enum zram_pageflags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotFlags(u8);

impl SlotFlags {
    /// The page is one repeated 8-byte word, stored in `value`; nothing is allocated.
    pub const SAME: SlotFlags = SlotFlags(1 << 0);
    /// The page lives on the backing device at the location in `value`.
    pub const WB: SlotFlags = SlotFlags(1 << 1);
    /// Selected for post-processing (writeback or recompression); any access clears it, which
    /// cancels the pending operation.
    pub const PP_SLOT: SlotFlags = SlotFlags(1 << 2);
    /// Stored raw: its compressed size reached the huge threshold.
    pub const HUGE: SlotFlags = SlotFlags(1 << 3);
    /// Not accessed since the last `idle` marking.
    pub const IDLE: SlotFlags = SlotFlags(1 << 4);
    /// Recompression could not make it smaller; don't try again.
    pub const INCOMPRESSIBLE: SlotFlags = SlotFlags(1 << 5);
    /// `value` is a multi-page object shared by the aligned group of `multi_page_size` slots
    /// this one belongs to (its page is number `index % pages per group` of the object); `size`
    /// is the whole object's.
    pub const MULTI: SlotFlags = SlotFlags(1 << 6);
    /// No flag.
    pub const NONE: SlotFlags = SlotFlags(0);

    /// The raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }
    /// True when every flag of `other` is set in `self`.
    pub const fn contains(self, other: SlotFlags) -> bool {
        self.0 & other.0 == other.0
    }
    /// The union.
    pub const fn union(self, other: SlotFlags) -> SlotFlags {
        SlotFlags(self.0 | other.0)
    }
}

impl std::ops::BitOr for SlotFlags {
    type Output = SlotFlags;
    fn bitor(self, rhs: SlotFlags) -> SlotFlags {
        self.union(rhs)
    }
}

/// One slot: 16 bytes, all atomics, valid when zeroed (the empty slot).
#[derive(Debug, Default)]
#[repr(C)]
pub struct SlotEntry {
    pub(crate) value: AtomicU64,
    pub(crate) meta: AtomicU32,
    pub(crate) ac_time_secs: AtomicU32,
}

impl SlotEntry {
    /// A snapshot taken without the lock: only for choosing candidates (idle scans,
    /// writeback selection); anything acted upon is re-read under the lock.
    pub fn state_unlocked(&self) -> SlotState {
        SlotState::load(self)
    }

    /// Sets `flags` if the slot holds data (used by the idle scan, which takes the lock).
    pub(crate) fn set_flags_locked(&self, flags: SlotFlags) {
        self.meta
            .fetch_or(u32::from(flags.0) << FLAGS_SHIFT, Ordering::Relaxed);
    }

    pub(crate) fn clear_flags_locked(&self, flags: SlotFlags) {
        self.meta
            .fetch_and(!(u32::from(flags.0) << FLAGS_SHIFT), Ordering::Relaxed);
    }

    /// Clears the lock bits: a slot locked by a process that died is unlocked for the process
    /// that recovers the table (nobody else can hold it).
    pub(crate) fn clear_lock_bits(&self) {
        self.meta.fetch_and(!LOCK_BITS, Ordering::Relaxed);
    }

    /// Puts back the access time of a state read earlier (for testing hooks).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn restore_ac_time(&self, state: SlotState) {
        self.ac_time_secs
            .store(state.ac_time_secs, Ordering::Relaxed);
    }

    /// The data bits of `meta` for `size_bytes`, `flags` and `codec` (a [`codec_id`]).
    pub(crate) fn data_bits(size_bytes: u32, flags: SlotFlags, codec: u8) -> u32 {
        debug_assert!(size_bytes <= SIZE_MASK);
        debug_assert!(codec < 32);
        (size_bytes & SIZE_MASK)
            | (u32::from(flags.0) << FLAGS_SHIFT)
            | (u32::from(codec) << CODEC_SHIFT)
    }

    /// Replaces every data field, keeping the lock bits (which waiters may set concurrently).
    /// `codec` is a [`codec_id`]. Not crash-atomic: a guard of a table goes through its
    /// journal (`super::journal`) instead.
    #[cfg(test)]
    pub(crate) fn store_locked(&self, value: u64, size_bytes: u32, flags: SlotFlags, codec: u8) {
        self.store_data(
            value,
            Self::data_bits(size_bytes, flags, codec),
            Ordering::Relaxed,
        );
    }

    /// Stores `value`, then `data` (no lock bits) into `meta` keeping its lock bits, each
    /// with `order`.
    pub(crate) fn store_data(&self, value: u64, data: u32, order: Ordering) {
        self.value.store(value, order);
        let mut cur = self.meta.load(Ordering::Relaxed);
        loop {
            let new = (cur & LOCK_BITS) | data;
            match self
                .meta
                .compare_exchange_weak(cur, new, order, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(actual) => cur = actual,
            }
        }
    }
}

/// A decoded copy of a slot entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotState {
    /// Handle, same-fill word or backing location, depending on the flags.
    pub value: u64,
    meta: u32,
    /// Last access, in seconds since the device was initialised.
    pub ac_time_secs: u32,
}

impl SlotState {
    fn load(e: &SlotEntry) -> SlotState {
        SlotState {
            value: e.value.load(Ordering::Relaxed),
            meta: e.meta.load(Ordering::Relaxed) & !LOCK_BITS,
            ac_time_secs: e.ac_time_secs.load(Ordering::Relaxed),
        }
    }

    /// The flags.
    pub fn flags(&self) -> SlotFlags {
        SlotFlags(((self.meta & FLAGS_MASK) >> FLAGS_SHIFT) as u8)
    }
    /// True if `flag` is set.
    pub fn has(&self, flag: SlotFlags) -> bool {
        self.flags().contains(flag)
    }
    /// Stored object size in bytes (compressed size, or the page size for HUGE; 0 for SAME).
    pub fn size_bytes(&self) -> usize {
        (self.meta & SIZE_MASK) as usize
    }
    /// The codec that wrote the stored object: a [`codec_id`] (priority and generation).
    pub fn codec(&self) -> u8 {
        ((self.meta & CODEC_MASK) >> CODEC_SHIFT) as u8
    }
    /// Compression priority of the stored object (0 = primary codec).
    pub fn prio(&self) -> u8 {
        self.codec() & 0b11
    }
    /// Dictionary generation of the stored object's codec (0 for the primary).
    pub fn gen(&self) -> u8 {
        self.codec() >> 2
    }
    /// True when the slot holds no data (zram's `!zram_allocated()`).
    pub fn is_empty(&self) -> bool {
        self.value == 0 && !self.has(SlotFlags::SAME) && !self.has(SlotFlags::WB)
    }
    /// The same-fill word, for a SAME slot.
    pub fn same_word(&self) -> Option<u64> {
        self.has(SlotFlags::SAME).then_some(self.value)
    }
    /// The backing location, for a WB slot.
    pub fn wb_location(&self) -> Option<u64> {
        self.has(SlotFlags::WB).then_some(self.value)
    }
    /// The zsmalloc handle, for a slot whose data is in the pool.
    pub fn handle_raw(&self) -> Option<u64> {
        (!self.has(SlotFlags::SAME) && !self.has(SlotFlags::WB) && self.value != 0)
            .then_some(self.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips() {
        let e = SlotEntry::default();
        assert!(e.state_unlocked().is_empty());
        let flags = SlotFlags::HUGE | SlotFlags::IDLE;
        e.store_locked(0xdead_beef, 65536, flags, codec_id(3, 7));
        let s = e.state_unlocked();
        assert_eq!(s.value, 0xdead_beef);
        assert_eq!(s.size_bytes(), 65536);
        assert_eq!(s.flags(), flags);
        assert_eq!((s.prio(), s.gen(), s.codec()), (3, 7, 31));
        assert_eq!(s.handle_raw(), Some(0xdead_beef));
        assert!(!s.is_empty());
        e.store_locked(0, 0, SlotFlags::SAME, 0);
        assert_eq!(e.state_unlocked().same_word(), Some(0));
        assert!(!e.state_unlocked().is_empty());
    }

    #[test]
    fn store_keeps_lock_bits() {
        let e = SlotEntry::default();
        e.meta.store(LOCKED | PARKED, Ordering::Relaxed);
        e.store_locked(1, 100, SlotFlags::NONE, 0);
        assert_eq!(e.meta.load(Ordering::Relaxed) & LOCK_BITS, LOCKED | PARKED);
        e.set_flags_locked(SlotFlags::IDLE);
        e.clear_flags_locked(SlotFlags::IDLE);
        assert_eq!(e.meta.load(Ordering::Relaxed) & LOCK_BITS, LOCKED | PARKED);
        assert_eq!(e.state_unlocked().size_bytes(), 100);
    }
}
