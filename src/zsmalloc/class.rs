//! A size class at run time: its lock, its zspages and its free handle indices.
//!
//! [`SizeClass::state`] (the *class lock*, a `parking_lot::Mutex`) protects everything in
//! [`ClassState`]: the zspages' slot metadata, the fullness lists, the unused zspage ids, the
//! class's free handle indices and its counters. It also serialises every change of a location
//! word of this class's handles (malloc, free, compaction). It is held for short, bounded
//! critical sections: one object's bookkeeping, or (compaction) the moves out of one zspage.
//!
//! [`SizeClass::descs`] is read without the class lock (see `zspage`).
//!
//! # Invariants (under the class lock)
//!
//! - A zspage id is either *attached* (its meta has a slot table, its descriptor a frame, it is
//!   linked in exactly the fullness group of its in-use ratio, and it is not in `free_ids`) or
//!   *unused* (no slot table, no frame, unlinked, in `free_ids` or `>= metas.len()`).
//! - An attached zspage is never empty at the end of a critical section: the operation that
//!   frees its last object detaches it (takes its frame out under the descriptor lock) before
//!   dropping the class lock. The frame is then returned to the frame allocator (the
//!   `madvise`) *after* the class lock is dropped.
//! - `zspages` = attached zspages; `objs_inuse` = sum of their in-use counts = this class's
//!   handles whose location word is nonzero.

use parking_lot::Mutex;

use super::arena::{ChunkVec, SegArray};
use super::fullness::{group_of, FullnessLists, GROUP_EMPTY, NR_GROUPS};
use super::handle::MAX_ZSPAGES_PER_CLASS;
use super::page_alloc::{Frame, FrameAllocator};
use super::record::FrameUse;
use super::size_class::ClassInfo;
use super::zspage::{Reserved, Slots, ZspageDesc, ZspageMeta};
use crate::error::{Error, Result};

/// One merged size class. Aligned to a cache line pair so neighbouring class locks do not share
/// a line.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct SizeClass {
    pub(crate) info: ClassInfo,
    /// The class's place in the pool's class list (what frame records name).
    pub(crate) position: u32,
    /// Descriptors by zspage id: 16 in the first segment, doubling.
    pub(crate) descs: SegArray<ZspageDesc, 4>,
    /// The class lock.
    pub(crate) state: Mutex<ClassState>,
}

/// What is left of a detached zspage: its frame (pages to return) and its slot table (heap
/// memory to free), owned by the caller of [`SizeClass::detach`] and released after the class
/// lock is dropped.
#[derive(Debug)]
#[must_use = "the frame must go back to the frame allocator"]
pub(crate) struct Detached {
    pub(crate) frame: Frame,
    pub(crate) owners: Slots,
}

/// Everything the class lock protects; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct ClassState {
    /// Slot metadata by zspage id (in chunks: growing it never copies the rest).
    metas: ChunkVec<ZspageMeta>,
    /// Unused zspage ids below `metas.len()`, reused before new ids.
    free_ids: Vec<u32>,
    pub(crate) fullness: FullnessLists,
    /// Handle indices freed by this class, reused by its next mallocs.
    pub(crate) free_handles: Vec<u32>,
    /// Attached zspages.
    pub(crate) zspages: u64,
    /// Objects in use.
    pub(crate) objs_inuse: u64,
}

impl ClassState {
    /// Zspage ids ever handed out (used or not): every id is below this.
    pub(crate) fn zspage_ids(&self) -> u64 {
        self.metas.len() as u64
    }

    /// Heap bytes of the class's bookkeeping: zspage metadata and slot tables, fullness lists,
    /// unused ids, free handle indices (capacities, as allocated). Not the descriptors.
    pub(crate) fn heap_bytes(&self) -> usize {
        let u32_bytes = std::mem::size_of::<u32>();
        self.metas.heap_bytes()
            + self.metas.iter().map(ZspageMeta::heap_bytes).sum::<usize>()
            + self.fullness.heap_bytes()
            + (self.free_ids.capacity() + self.free_handles.capacity()) * u32_bytes
    }
}

impl SizeClass {
    pub(crate) fn new(info: ClassInfo, position: u32) -> SizeClass {
        SizeClass {
            info,
            position,
            descs: SegArray::new(),
            state: Mutex::new(ClassState::default()),
        }
    }

    /// The descriptor of an id that has been attached at least once.
    pub(crate) fn desc(&self, id: u32) -> &ZspageDesc {
        self.descs
            .get(u64::from(id))
            .expect("zspage id was attached, so its descriptor exists")
    }

    /// Takes an unused zspage id (under the class lock `st`) for [`attach`](Self::attach); if
    /// the caller cannot attach it, it gives it back with [`put_id`](Self::put_id).
    pub(crate) fn take_id(&self, st: &mut ClassState) -> Result<u32> {
        if let Some(id) = st.free_ids.pop() {
            return Ok(id);
        }
        let id = st.metas.len() as u64;
        if id >= MAX_ZSPAGES_PER_CLASS {
            return Err(Error::no_memory("zsmalloc: too many zspages in one class"));
        }
        st.metas.push(ZspageMeta::default());
        self.descs.get_or_grow(id);
        Ok(id as u32)
    }

    /// Attaches a zspage with `frame` under id `id` (from [`take_id`](Self::take_id)), writing
    /// the frame's record (`record`) for the pool tagged `pool`. The caller reserves a slot in
    /// it before dropping the class lock.
    pub(crate) fn attach(
        &self,
        st: &mut ClassState,
        id: u32,
        frame: Frame,
        frames: &FrameAllocator,
        pool: u16,
    ) {
        let (what, extra) = FrameUse::Zspage {
            class: self.position,
            id,
        }
        .encode(pool);
        frames.set_record(&frame, what, extra);
        let previous = self.desc(id).write().replace(frame);
        assert!(previous.is_none(), "unused zspage {id} still had a frame");
        st.metas[id as usize].attach(self.info.objs_per_zspage);
        st.fullness.insert(id, GROUP_EMPTY);
        st.zspages += 1;
    }

    /// Detaches zspage `id`, emptied (and unlinked) by [`ClassState::release`], taking its frame
    /// out under its migrate lock (so the caller must not hold that lock; nobody else holds it
    /// long: the zspage has no objects, so only a reader with a stale location can be there,
    /// and it lets go at once). The caller releases what is returned after dropping the class
    /// lock. The id goes back to `free_ids` now: its descriptor has no frame and its meta no
    /// slot table, so the next `attach` of it is valid at once.
    pub(crate) fn detach(&self, st: &mut ClassState, id: u32, frames: &FrameAllocator) -> Detached {
        let owners = st.metas[id as usize].detach();
        let frame = self
            .desc(id)
            .write()
            .take()
            .expect("attached zspage has a frame");
        // Before the id can be taken again (under this lock): no two records claim it.
        frames.clear_record(&frame);
        st.free_ids.push(id);
        st.zspages -= 1;
        Detached { frame, owners }
    }
}

/// A zspage recovery attaches: its id, its frame, and its used slots as (slot, handle index).
pub(crate) type RestoredZspage = (u32, Frame, Vec<(u32, u32)>);

impl SizeClass {
    /// Recovery: attaches the zspages a previous process left (`(id, frame, used slots as
    /// (slot, handle index))`, ids distinct), makes every other id below the largest unused,
    /// and takes `free_handles` as the class's free handle indices. The class must be fresh.
    pub(crate) fn restore(
        &self,
        st: &mut ClassState,
        zspages: Vec<RestoredZspage>,
        free_handles: Vec<u32>,
    ) {
        assert_eq!(st.metas.len(), 0, "restoring a class in use");
        let ids = zspages.iter().map(|z| z.0 + 1).max().unwrap_or(0);
        st.metas.resize_with(ids as usize, ZspageMeta::default);
        for (id, frame, used) in zspages {
            let previous = self.descs.get_or_grow(u64::from(id)).write().replace(frame);
            assert!(previous.is_none(), "zspage {id} restored twice");
            st.metas[id as usize].rebuild(self.info.objs_per_zspage, &used);
            st.fullness
                .insert(id, group_of(used.len(), self.info.objs_per_zspage));
            st.zspages += 1;
            st.objs_inuse += used.len() as u64;
        }
        for id in (0..ids).rev() {
            if self
                .descs
                .get(u64::from(id))
                .map_or(true, |d| d.read().is_none())
            {
                self.descs.get_or_grow(u64::from(id));
                st.free_ids.push(id);
            }
        }
        st.free_handles = free_handles;
    }
}

impl ClassState {
    /// The fullest attached zspage with a free slot.
    pub(crate) fn zspage_with_room(&self) -> Option<u32> {
        self.fullness.fullest_with_room(None)
    }

    fn regroup(&mut self, id: u32, objs_per_zspage: usize) {
        let group = group_of(self.metas[id as usize].inuse(), objs_per_zspage);
        self.fullness.set(id, group);
    }

    /// Reserves a slot of zspage `id` (with room) for handle index `handle`.
    pub(crate) fn reserve(&mut self, class: &SizeClass, id: u32, handle: u32) -> Reserved {
        self.try_reserve(class, id, handle)
            .expect("zspage chosen for room has a free slot")
    }

    /// Reserves a slot of zspage `id` for handle index `handle`, or `None` if it is full.
    pub(crate) fn try_reserve(
        &mut self,
        class: &SizeClass,
        id: u32,
        handle: u32,
    ) -> Option<Reserved> {
        let slot = self.metas[id as usize].reserve(handle)?;
        self.objs_inuse += 1;
        self.regroup(id, class.info.objs_per_zspage);
        Some(slot)
    }

    /// Frees slot `obj` of zspage `id`, owned by handle index `handle`. Returns true if the
    /// zspage became empty: it is then unlinked, and the caller must
    /// [`detach`](SizeClass::detach) it before dropping the class lock.
    pub(crate) fn release(&mut self, class: &SizeClass, id: u32, obj: u32, handle: u32) -> bool {
        let meta = &mut self.metas[id as usize];
        meta.release(obj, handle);
        self.objs_inuse -= 1;
        if meta.inuse() == 0 {
            self.fullness.remove(id);
            true
        } else {
            self.regroup(id, class.info.objs_per_zspage);
            false
        }
    }

    /// Used slots of zspage `id` and their owner handle indices, into `out`.
    pub(crate) fn used_slots(&self, id: u32, out: &mut Vec<(u32, u32)>) {
        out.clear();
        out.extend(self.metas[id as usize].used());
    }

    /// Pages compaction could free: whole zspages' worth of free slots (the kernel's
    /// `zs_can_compact()`).
    pub(crate) fn freeable_pages(&self, info: &ClassInfo) -> u64 {
        let allocated = self.zspages * info.objs_per_zspage as u64;
        let wasted = allocated - self.objs_inuse;
        wasted / info.objs_per_zspage as u64 * info.pages_per_zspage as u64
    }

    /// Zspages per fullness group.
    pub(crate) fn group_counts(&self) -> [u64; NR_GROUPS] {
        std::array::from_fn(|g| self.fullness.count(g) as u64)
    }

    /// Checks the invariants of the module docs (expensive; tests).
    #[cfg(test)]
    pub(crate) fn check(&self, class: &SizeClass) {
        let mut zspages = 0;
        let mut inuse = 0;
        for (id, meta) in self.metas.iter().enumerate() {
            let id = id as u32;
            let has_frame = class
                .descs
                .get(u64::from(id))
                .is_some_and(|d| d.read().is_some());
            if meta.is_attached() {
                zspages += 1;
                inuse += meta.inuse() as u64;
                assert!(meta.inuse() > 0, "attached zspage {id} is empty");
                assert!(has_frame);
                assert_eq!(
                    self.fullness.group(id),
                    Some(group_of(meta.inuse(), class.info.objs_per_zspage))
                );
                assert!(!self.free_ids.contains(&id));
            } else {
                assert!(!has_frame);
                assert_eq!(self.fullness.group(id), None);
                assert!(self.free_ids.contains(&id));
            }
        }
        assert_eq!(zspages, self.zspages);
        assert_eq!(inuse, self.objs_inuse);
    }
}
