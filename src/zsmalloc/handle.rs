//! Handles and the handle table.
//!
//! A [`Handle`] names one allocated object for its whole life, however often compaction moves
//! it. It is `index + 1` into the handle table, a [`SegArray`] of `AtomicU64` *location words*.
//! A location word encodes where the object is now and how big it is ([`Location`]); 0 means
//! the handle is free.
//!
//! The kernel keeps each object's handle in the first 8 bytes of its slot (so compaction can
//! find the handle from the object). We keep that back-pointer in the zspage's metadata
//! (`zspage::ZspageMeta::owners`) instead, so objects are exactly the bytes the caller asked
//! for and the huge threshold needs no handle correction.
//!
//! # Protocol
//!
//! - A location word is written only under its object's class lock: by `malloc` (publish),
//!   `free` (clear to 0) and compaction (move). Writers use `Release`, readers `Acquire`, so a
//!   reader that sees a location also sees the zspage descriptor segment and, for a moved object,
//!   the bytes copied before the store.
//! - The size bits never change while the handle is allocated, so `free` can find the class
//!   (and its lock) from an unlocked load.
//! - Free handle indices are kept on a free list per class (under the class lock); new indices
//!   come from an atomic counter. The free path never takes a pool-wide lock.
//!
//! # Serving swap: words faulted in ahead of need
//!
//! A pool serving swap must not fault a page of the table in on a writer's path (the request
//! path never waits for memory: `crate::memory`). Its table is *bounded*
//! ([`HandleTable::keep_ahead`]): a fresh index is handed out only below `limit`, the words
//! faulted in so far, and the swap reserve's refiller keeps `limit` ahead of the indices handed
//! out by [`HANDLES_AHEAD_MIN`] or [`HANDLES_AHEAD_TICKS`] ticks of the last tick's use, if more
//! (watermarks that follow the write rate, as the reserve's own). So the table holds words in
//! proportion to the objects the pool has held, not to its device's size. `limit` only grows,
//! and only after the words below it are resident.

#![allow(unsafe_code)]

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::shm::{ShmFile, ShmMap};

/// An allocated object. Copy it freely; use it from one owner at a time (see `ZsPool`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle(NonZeroU64);

impl Handle {
    /// The handle as a nonzero integer, to store in 8 bytes of a slot entry.
    pub fn to_raw(self) -> u64 {
        self.0.get()
    }

    /// The handle stored by [`to_raw`](Self::to_raw); `None` for 0.
    pub fn from_raw(raw: u64) -> Option<Handle> {
        NonZeroU64::new(raw).map(Handle)
    }

    /// The handle-table index.
    pub(crate) fn index(self) -> u32 {
        u32::try_from(self.0.get() - 1).expect("handle index out of range")
    }

    /// The handle for table index `index`.
    pub(crate) fn from_index(index: u32) -> Handle {
        Handle(NonZeroU64::new(u64::from(index) + 1).expect("index + 1 is nonzero"))
    }
}

/// Handle indices must fit in 31 bits: `ZspageMeta::owners` uses the top bit of a `u32` to mark
/// free slots.
pub(crate) const MAX_HANDLES: u64 = (1 << 31) - 1;

const OBJ_BITS: u32 = 16;
const SIZE_BITS: u32 = 17;
const ZSPAGE_BITS: u32 = 64 - OBJ_BITS - SIZE_BITS;
/// Zspage ids (per class) must fit in the location word.
pub(crate) const MAX_ZSPAGES_PER_CLASS: u64 = 1 << ZSPAGE_BITS;

/// Where an object lives: zspage id (within its class), object index in the zspage, and the
/// size asked at `malloc`. Encoded as `zspage << 33 | size << 16 | obj`; never 0 because the
/// size is at least 1. Object indices fit 16 bits (at most 8 * 65536 / 32 = 16384 objects per
/// zspage), sizes 17 bits (at most 65536), zspage ids the remaining 31.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Location {
    pub(crate) zspage: u32,
    pub(crate) obj: u32,
    pub(crate) size_bytes: usize,
}

impl Location {
    pub(crate) fn encode(self) -> u64 {
        debug_assert!(u64::from(self.zspage) < MAX_ZSPAGES_PER_CLASS);
        debug_assert!(self.obj < 1 << OBJ_BITS);
        debug_assert!(self.size_bytes >= 1 && self.size_bytes < 1 << SIZE_BITS);
        (u64::from(self.zspage) << (OBJ_BITS + SIZE_BITS))
            | ((self.size_bytes as u64) << OBJ_BITS)
            | u64::from(self.obj)
    }

    /// `None` for a free word.
    pub(crate) fn decode(word: u64) -> Option<Location> {
        if word == 0 {
            return None;
        }
        Some(Location {
            zspage: (word >> (OBJ_BITS + SIZE_BITS)) as u32,
            obj: (word & ((1 << OBJ_BITS) - 1)) as u32,
            size_bytes: ((word >> OBJ_BITS) & ((1 << SIZE_BITS) - 1)) as usize,
        })
    }
}

/// Bytes before the first location word in the handle table's file: the header.
const HEADER_BYTES: usize = 4096;
/// Header word 0: indices ever handed out (the next fresh index).
const HEADER_NEXT_INDEX: usize = 0;

/// The table of location words: a memfd (`crate::shm`), so it outlives the process
/// (`docs/restart.md`). Its file holds a header page (word 0: the next fresh index) and then
/// one `AtomicU64` per handle index, up to [`MAX_HANDLES`]: 16 GiB of address space, sparse
/// (a page of words is committed when a handle on it is first handed out). A word is found by
/// arithmetic, with no lock and no indirection.
#[derive(Debug)]
pub(crate) struct HandleTable {
    map: ShmMap,
    file: ShmFile,
    /// Bytes of the file faulted in ahead of need by [`populate`](HandleTable::populate)
    /// (serving swap), counted by [`allocated_bytes`](HandleTable::allocated_bytes).
    populated_bytes: AtomicU64,
    /// Fresh indices are handed out only below this: [`MAX_HANDLES`], or for a bounded table
    /// (serving swap) the words resident now. Only grows, and only after the words below it
    /// were faulted in (module docs).
    limit: AtomicU64,
    /// Bounded tables: indices handed out at the refiller's last tick, and the indices kept
    /// faulted in beyond those handed out (moved at each tick). Written by the refiller only.
    ahead_at_tick: AtomicU64,
    ahead: AtomicU64,
}

/// Serving swap, the fewest handle indices kept faulted in beyond those handed out: 64 KiB of
/// words (a burst of writes between two of the refiller's looks).
pub(crate) const HANDLES_AHEAD_MIN: u64 = 8192;
/// ... or this many refiller ticks of the indices handed out in the last tick, if more.
pub(crate) const HANDLES_AHEAD_TICKS: u64 = 4;

impl HandleTable {
    /// The file's size: the header and a word per possible handle.
    fn file_bytes() -> u64 {
        HEADER_BYTES as u64 + MAX_HANDLES * 8
    }

    pub(crate) fn new() -> Result<HandleTable> {
        let file = ShmFile::create("handles")?;
        file.set_len(Self::file_bytes())?;
        HandleTable::map(file)
    }

    /// The table a previous process left in `file` (`docs/restart.md`), taken as it is.
    #[allow(dead_code)]
    pub(crate) fn from_file(file: ShmFile) -> Result<HandleTable> {
        let have = file.len()?;
        if have != Self::file_bytes() {
            return Err(Error::invalid(format!(
                "zsmalloc: the handle table holds {have} bytes, not {}",
                Self::file_bytes()
            )));
        }
        HandleTable::map(file)
    }

    fn map(file: ShmFile) -> Result<HandleTable> {
        let map = file.map(0, Self::file_bytes() as usize)?;
        Ok(HandleTable {
            map,
            file,
            populated_bytes: AtomicU64::new(0),
            limit: AtomicU64::new(MAX_HANDLES),
            ahead_at_tick: AtomicU64::new(0),
            ahead: AtomicU64::new(HANDLES_AHEAD_MIN),
        })
    }

    /// Faults in the header and the words of the first `indices` handle indices (those not
    /// faulted in by an earlier call).
    pub(crate) fn populate(&self, indices: u64) {
        let words = indices.min(MAX_HANDLES) as usize;
        let bytes = (HEADER_BYTES + words * 8).next_multiple_of(4096);
        let done = self.populated_bytes.load(Ordering::Relaxed) as usize;
        if bytes > done {
            self.map.populate_range(done, bytes - done);
            self.populated_bytes
                .fetch_max(bytes as u64, Ordering::Relaxed);
        }
    }

    /// Words resident ahead of need: those on the pages [`populate`](Self::populate) faulted in.
    pub(crate) fn resident_words(&self) -> u64 {
        (self.populated_bytes.load(Ordering::Relaxed) as usize).saturating_sub(HEADER_BYTES) as u64
            / 8
    }

    /// Makes the table bounded (module docs, "Serving swap") if it is not yet, and faults in
    /// the words its use asks for: at a `tick` of the refiller, the window ahead follows the
    /// indices handed out since the last tick. Returns whether a fresh index can be had now.
    /// Only the swap reserve's refiller calls this (it is the thread that may wait for
    /// memory), and once as a pool serving swap is made.
    pub(crate) fn keep_ahead(&self, tick: bool) -> bool {
        let next = self.indices();
        if tick {
            let used = next.saturating_sub(self.ahead_at_tick.swap(next, Ordering::Relaxed));
            self.ahead.store(
                used.saturating_mul(HANDLES_AHEAD_TICKS)
                    .max(HANDLES_AHEAD_MIN),
                Ordering::Relaxed,
            );
        }
        let want = next
            .saturating_add(self.ahead.load(Ordering::Relaxed))
            .min(MAX_HANDLES);
        // Whole pages of words: the last one faulted in is used to its end.
        if want > self.resident_words() || self.limit.load(Ordering::Relaxed) == MAX_HANDLES {
            self.populate(want);
            let resident = self.resident_words();
            // Release: a writer that sees the new limit finds its word's page resident.
            if self.limit.load(Ordering::Relaxed) == MAX_HANDLES {
                self.limit.store(resident, Ordering::Release);
            } else {
                self.limit.fetch_max(resident, Ordering::Release);
            }
        }
        self.headroom() > 0
    }

    /// Fresh indices that can be handed out now without faulting a page of the table in
    /// (bounded tables); `MAX_HANDLES` less those handed out otherwise.
    pub(crate) fn headroom(&self) -> u64 {
        self.limit
            .load(Ordering::Acquire)
            .saturating_sub(self.indices())
    }

    /// A bounded table whose headroom fell below half its window ahead: the refiller is
    /// asked to look now rather than at its next tick.
    pub(crate) fn wants_refill(&self) -> bool {
        self.limit.load(Ordering::Relaxed) < MAX_HANDLES
            && self.headroom() < self.ahead.load(Ordering::Relaxed) / 2
    }

    /// The memfd holding the table.
    #[allow(dead_code)]
    pub(crate) fn file(&self) -> &ShmFile {
        &self.file
    }

    /// Header word `i`.
    fn header(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < HEADER_BYTES / 8);
        // SAFETY: the header page lies inside the mapping (which is page aligned, so the word
        // is aligned), lives as long as `self`, and any bit pattern is a valid AtomicU64.
        unsafe { &*self.map.base().as_ptr().cast::<AtomicU64>().add(i) }
    }

    /// The word of `index`, which must be below [`MAX_HANDLES`].
    fn slot(&self, index: u64) -> &AtomicU64 {
        assert!(index < MAX_HANDLES, "handle index {index} out of range");
        // SAFETY: `HEADER_BYTES + index * 8 < file_bytes()`, the mapping's length; aligned
        // (page-aligned base, 8-byte steps); lives as long as `self`; any bit pattern is a
        // valid AtomicU64.
        unsafe {
            &*self
                .map
                .base()
                .as_ptr()
                .add(HEADER_BYTES)
                .cast::<AtomicU64>()
                .add(index as usize)
        }
    }

    /// Bytes of the table holding words handed out so far, and the header page once one has
    /// been, or the bytes faulted in ahead of need if more (never shrinks).
    pub(crate) fn allocated_bytes(&self) -> usize {
        let used = match self.indices() {
            0 => 0,
            n => HEADER_BYTES + (n as usize * 8).next_multiple_of(4096),
        };
        used.max(self.populated_bytes.load(Ordering::Relaxed) as usize)
    }

    /// A never-used index (its word is 0). Callers first try their class's free list. `ENOMEM`
    /// when the table is full, or bounded (serving swap) and no word is resident beyond those
    /// handed out ([`keep_ahead`](Self::keep_ahead)): then [`headroom`](Self::headroom) is 0.
    pub(crate) fn grow(&self) -> Result<u32> {
        let next = self.header(HEADER_NEXT_INDEX);
        // Acquire: pairs with `keep_ahead`'s Release (the words below the limit are resident).
        let limit = self.limit.load(Ordering::Acquire).min(MAX_HANDLES);
        let mut index = next.load(Ordering::Relaxed);
        loop {
            if index >= MAX_HANDLES {
                return Err(Error::no_memory("zsmalloc: handle table full"));
            }
            if index >= limit {
                return Err(Error::no_memory(
                    "zsmalloc: no handle word faulted in ahead of need (serving swap)",
                ));
            }
            match next.compare_exchange_weak(index, index + 1, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Ok(index as u32),
                Err(now) => index = now,
            }
        }
    }

    /// The location word of an index handed out by [`grow`](Self::grow).
    pub(crate) fn word_at(&self, index: u32) -> &AtomicU64 {
        self.slot(u64::from(index))
    }

    /// The location word of `h`; panics if `h` was never allocated by this pool.
    pub(crate) fn word(&self, h: Handle) -> &AtomicU64 {
        let index = u64::from(h.index());
        assert!(
            index < self.indices(),
            "zsmalloc: {h:?} was not allocated by this pool"
        );
        self.slot(index)
    }

    /// Where `h` is now (`Acquire`). Panics if `h` is free: a use after free.
    pub(crate) fn load(&self, h: Handle) -> (u64, Location) {
        let word = self.word(h).load(Ordering::Acquire);
        match Location::decode(word) {
            Some(loc) => (word, loc),
            None => panic!("zsmalloc: use of freed {h:?}"),
        }
    }

    /// Number of indices ever handed out (the table's high-water mark).
    pub(crate) fn indices(&self) -> u64 {
        self.header(HEADER_NEXT_INDEX).load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn populate_faults_in_the_header_and_the_words_asked_for() {
        let t = HandleTable::new().unwrap();
        assert_eq!(t.map.resident_pages(1 << 20), 0);
        t.populate(1000);
        // The header page and 8000 bytes of words: two pages.
        assert_eq!(t.map.resident_pages(1 << 20), 3);
        assert_eq!(t.allocated_bytes(), 3 * 4096, "counted in meta_stat");
        assert_eq!(t.indices(), 0, "populating hands nothing out");
    }

    #[test]
    fn raw_round_trip() {
        assert!(Handle::from_raw(0).is_none());
        let h = Handle::from_index(41);
        assert_eq!(h.to_raw(), 42);
        assert_eq!(Handle::from_raw(42), Some(h));
        assert_eq!(h.index(), 41);
    }

    #[test]
    fn location_round_trip() {
        for (zspage, obj, size_bytes) in [
            (0, 0, 1),
            (1, 16383, 65536),
            ((MAX_ZSPAGES_PER_CLASS - 1) as u32, 65535, 131071),
            (12345, 7, 3633),
        ] {
            let loc = Location {
                zspage,
                obj,
                size_bytes,
            };
            let word = loc.encode();
            assert_ne!(word, 0);
            assert_eq!(Location::decode(word), Some(loc));
        }
        assert_eq!(Location::decode(0), None);
    }

    #[test]
    fn table_grows_with_zeroed_words() {
        let t = HandleTable::new().unwrap();
        for i in 0..10_000u32 {
            assert_eq!(t.grow().unwrap(), i);
            assert_eq!(t.word_at(i).load(Ordering::Relaxed), 0);
        }
        assert_eq!(t.indices(), 10_000);
    }

    /// A bounded table hands out only indices whose words are resident, and the refiller's
    /// window ahead follows the indices handed out per tick.
    #[test]
    fn a_bounded_table_hands_out_only_resident_words() {
        let t = HandleTable::new().unwrap();
        assert!(t.keep_ahead(true));
        let limit = t.headroom();
        assert!(limit >= HANDLES_AHEAD_MIN, "{limit}");
        // The header page and the words below the limit, no more.
        let pages = 1 + (limit * 8).div_ceil(4096) as usize;
        assert_eq!(t.map.resident_pages(1 << 30), pages);
        for i in 0..limit {
            assert_eq!(u64::from(t.grow().unwrap()), i);
        }
        assert_eq!(t.headroom(), 0);
        assert!(t.grow().is_err(), "past the resident words");
        assert_eq!(t.indices(), limit, "a refused index is not handed out");
        assert!(t.wants_refill());
        // A tick after `limit` indices were used keeps 4 ticks of that use ahead.
        assert!(t.keep_ahead(true));
        assert_eq!(t.headroom(), limit * HANDLES_AHEAD_TICKS);
        assert!(!t.wants_refill());
        assert_eq!(u64::from(t.grow().unwrap()), limit);
        // A quiet tick shrinks the window (resident words stay).
        assert!(t.keep_ahead(true));
        assert_eq!(t.ahead.load(Ordering::Relaxed), HANDLES_AHEAD_MIN);
        assert_eq!(t.headroom(), limit * HANDLES_AHEAD_TICKS - 1);
    }

    /// Unbounded tables (not serving swap) grow by fault, as far as the table goes.
    #[test]
    fn an_unbounded_table_grows_past_its_resident_words() {
        let t = HandleTable::new().unwrap();
        t.populate(10);
        for i in 0..HANDLES_AHEAD_MIN as u32 * 2 {
            assert_eq!(t.grow().unwrap(), i);
        }
        assert!(!t.wants_refill());
    }

    #[test]
    #[should_panic(expected = "use of freed")]
    fn load_of_free_handle_panics() {
        let t = HandleTable::new().unwrap();
        let i = t.grow().unwrap();
        t.load(Handle::from_index(i));
    }
}
