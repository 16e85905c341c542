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
}

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
        })
    }

    /// Faults in the header and the words of the first `indices` handle indices (call it on a
    /// fresh table: a pool serving swap, so that handing out an index under memory pressure
    /// faults no page of the table).
    pub(crate) fn populate(&self, indices: u64) {
        let words = indices.min(MAX_HANDLES) as usize;
        let bytes = (HEADER_BYTES + words * 8).next_multiple_of(4096);
        self.map.populate(bytes);
        self.populated_bytes
            .fetch_max(bytes as u64, Ordering::Relaxed);
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

    /// A never-used index (its word is 0). Callers first try their class's free list.
    pub(crate) fn grow(&self) -> Result<u32> {
        let next = self.header(HEADER_NEXT_INDEX);
        let index = next.fetch_add(1, Ordering::Relaxed);
        if index >= MAX_HANDLES {
            next.fetch_sub(1, Ordering::Relaxed);
            return Err(Error::no_memory("zsmalloc: handle table full"));
        }
        Ok(index as u32)
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

    #[test]
    #[should_panic(expected = "use of freed")]
    fn load_of_free_handle_panics() {
        let t = HandleTable::new().unwrap();
        let i = t.grow().unwrap();
        t.load(Handle::from_index(i));
    }
}
