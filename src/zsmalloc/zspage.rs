//! Zspages: a descriptor (migrate lock + frame) readable without any other lock, and metadata
//! (who owns each object slot) protected by the class lock.
//!
//! This is, with `page_alloc`, one of the two modules of `zsmalloc` allowed to use `unsafe`.
//!
//! # Descriptor ([`ZspageDesc`])
//!
//! Each class keeps its descriptors in a never-shrinking `SegArray`, indexed by zspage id (the
//! id is per class and is what a handle's location word stores). A descriptor is recycled, never
//! deallocated, so a reader holding a (possibly stale) id can always lock it. Its only field is
//! the *migrate lock*, an `RwLock<Option<Frame>>`:
//!
//! - `read(h)` holds it shared while it gives the caller a slice of the object;
//! - `write(h)` holds it exclusive (so a misbehaving caller racing `read`/`write` on one handle
//!   still cannot cause a data race; the cost is a memcpy of exclusion per write);
//! - compaction holds the *source* exclusive while moving its objects out, and the
//!   *destination* shared while copying into slots it reserved (see [`move_object`]);
//! - installing a frame (new zspage) and taking it out (empty zspage) hold it exclusive.
//!
//! Lock order: class lock → source descriptor → destination descriptor. Readers and writers
//! take one descriptor and nothing else, so they never close a cycle.
//!
//! # Metadata ([`ZspageMeta`], protected by the class lock)
//!
//! `owners[i]` is the handle index owning object slot `i`, or, for a free slot, `FREE | next`
//! threading the free slots into a LIFO list headed by `first_free` (the kernel threads that
//! list through the free objects themselves; we keep it beside them so objects are exactly the
//! caller's bytes and a stray write cannot corrupt the allocator). It is the back-pointer
//! compaction needs to update a moved object's handle.

#![allow(unsafe_code)]

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::page_alloc::Frame;

/// A zspage descriptor; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct ZspageDesc {
    /// The migrate lock, guarding the frame (None while the zspage id is unused).
    frame: RwLock<Option<Frame>>,
}

impl ZspageDesc {
    /// Shared: read objects, or copy into reserved slots.
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Option<Frame>> {
        self.frame.read()
    }

    /// Exclusive: write an object, move objects out, install or take out the frame.
    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, Option<Frame>> {
        self.frame.write()
    }
}

/// Byte offset of object slot `obj` in a zspage of `class_size_bytes` slots.
pub(crate) fn obj_offset(class_size_bytes: usize, obj: u32) -> usize {
    obj as usize * class_size_bytes
}

/// A free slot reserved for a handle under the class lock, not yet published in the handle's
/// location word: nobody but the reserver can reach it. Consumed by [`move_object`] or
/// [`Reserved::obj`].
#[derive(Debug)]
#[must_use]
pub(crate) struct Reserved {
    obj: u32,
}

impl Reserved {
    /// The slot index, giving up the right to write it through a shared borrow.
    pub(crate) fn obj(self) -> u32 {
        self.obj
    }
}

/// Copies `len_bytes` of object `src_obj` of `src` into the reserved slot `dst_obj` of `dst`,
/// both zspages of the class with `class_size_bytes` slots; returns the slot index.
///
/// The caller holds the class lock, `src`'s migrate lock exclusive (no one writes the source)
/// and `dst`'s shared (other objects of `dst` may be read meanwhile), and publishes the new
/// location (`Release`) only after this returns.
pub(crate) fn move_object(
    src: &Frame,
    src_obj: u32,
    dst: &Frame,
    dst_obj: Reserved,
    class_size_bytes: usize,
    len_bytes: usize,
) -> u32 {
    assert!(len_bytes <= class_size_bytes);
    let from = src.bytes(obj_offset(class_size_bytes, src_obj), len_bytes);
    // SAFETY: `dst_obj` is a `Reserved` slot: free in `dst`'s metadata until just now, reserved
    // under the class lock (which we hold), and no handle's location word points at it yet, so
    // no reader, writer or other compactor can form a slice into it. The range is exactly that
    // slot (`len_bytes <= class_size_bytes`), so it does not overlap the objects others read.
    let to = unsafe { dst.reserved_slot_mut(obj_offset(class_size_bytes, dst_obj.obj), len_bytes) };
    to.copy_from_slice(from);
    dst_obj.obj
}

/// Marks a free slot in `ZspageMeta::owners`; the low 31 bits link to the next free slot.
const FREE: u32 = 1 << 31;
/// End of the free list (in `first_free`, and in the link of the last free slot).
const NIL: u32 = u32::MAX;

/// A zspage's slot table: per slot, the owner handle index (< 2^31), or `FREE | next free
/// slot`. A zspage of one slot (the huge class: every incompressible page) keeps it inline, so
/// storing such a page allocates nothing on the heap.
#[derive(Debug, Default)]
pub(crate) enum Slots {
    /// The zspage id is unused.
    #[default]
    Unused,
    One(u32),
    Many(Box<[u32]>),
}

impl Slots {
    fn as_slice(&self) -> &[u32] {
        match self {
            Slots::Unused => &[],
            Slots::One(o) => std::slice::from_ref(o),
            Slots::Many(b) => b,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u32] {
        match self {
            Slots::Unused => &mut [],
            Slots::One(o) => std::slice::from_mut(o),
            Slots::Many(b) => b,
        }
    }

    fn from_vec(v: Vec<u32>) -> Slots {
        match v.len() {
            0 => Slots::Unused,
            1 => Slots::One(v[0]),
            _ => Slots::Many(v.into_boxed_slice()),
        }
    }

    fn is_empty(&self) -> bool {
        matches!(self, Slots::Unused)
    }

    /// Heap bytes held (only a table of several slots has any).
    fn heap_bytes(&self) -> usize {
        match self {
            Slots::Many(b) => std::mem::size_of_val(&**b),
            _ => 0,
        }
    }
}

/// Per-zspage bookkeeping, kept in the class state (protected by the class lock).
#[derive(Debug, Default)]
pub(crate) struct ZspageMeta {
    /// The slot table ([`Slots::Unused`] while the zspage id is unused).
    owners: Slots,
    /// Head of the free-slot list, `NIL` if full.
    first_free: u32,
    /// Slots in use.
    inuse: u32,
}

impl ZspageMeta {
    /// Starts a zspage life with `objs` free slots.
    pub(crate) fn attach(&mut self, objs: usize) {
        assert!(self.owners.is_empty(), "zspage attached twice");
        assert!(objs >= 1 && objs < FREE as usize);
        self.owners = if objs == 1 {
            Slots::One(NIL)
        } else {
            Slots::from_vec(
                (1..=objs as u32)
                    .map(|next| {
                        if next as usize == objs {
                            NIL
                        } else {
                            FREE | next
                        }
                    })
                    .collect(),
            )
        };
        self.first_free = 0;
        self.inuse = 0;
    }

    /// Recovery: starts a zspage life with `objs` slots, `used` (slot, owner handle index;
    /// slots distinct and below `objs`, at least one) in use and the rest free.
    pub(crate) fn rebuild(&mut self, objs: usize, used: &[(u32, u32)]) {
        assert!(self.owners.is_empty(), "zspage attached twice");
        assert!(!used.is_empty() && objs < FREE as usize);
        let mut owners = vec![NIL; objs];
        for &(obj, handle) in used {
            assert!(handle < FREE && owners[obj as usize] == NIL);
            owners[obj as usize] = handle;
        }
        let taken: Vec<bool> = (0..objs).map(|i| owners[i] != NIL).collect();
        // Free slots threaded in ascending order, so the next reserve takes the lowest.
        let mut next = NIL;
        for i in (0..objs).rev() {
            if !taken[i] {
                owners[i] = if next == NIL { NIL } else { FREE | next };
                next = i as u32;
            }
        }
        self.owners = Slots::from_vec(owners);
        self.first_free = next;
        self.inuse = used.len() as u32;
    }

    /// Ends a zspage life (it must be empty), returning the slot table so the caller can drop
    /// it (a heap free, for a table of several slots) after the class lock.
    pub(crate) fn detach(&mut self) -> Slots {
        assert_eq!(self.inuse, 0, "detaching a zspage with live objects");
        self.first_free = NIL;
        std::mem::take(&mut self.owners)
    }

    /// Heap bytes of the slot table (0 while the id is unused).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.owners.heap_bytes()
    }

    /// Whether the zspage id is in use.
    #[cfg(test)]
    pub(crate) fn is_attached(&self) -> bool {
        !self.owners.is_empty()
    }

    /// Slots in use.
    pub(crate) fn inuse(&self) -> usize {
        self.inuse as usize
    }

    /// Takes a free slot for handle index `handle`, or `None` if full.
    pub(crate) fn reserve(&mut self, handle: u32) -> Option<Reserved> {
        assert!(handle < FREE);
        let obj = self.first_free;
        if obj == NIL {
            return None;
        }
        let owners = self.owners.as_mut_slice();
        let link = owners[obj as usize];
        debug_assert!(link & FREE != 0, "free list reached a used slot");
        self.first_free = if link == NIL { NIL } else { link & !FREE };
        owners[obj as usize] = handle;
        self.inuse += 1;
        Some(Reserved { obj })
    }

    /// Frees slot `obj`, which `handle` must own (checked: a mismatch is a double free or a
    /// corrupted handle).
    pub(crate) fn release(&mut self, obj: u32, handle: u32) {
        let owners = self.owners.as_mut_slice();
        let owner = owners[obj as usize];
        assert_eq!(
            owner, handle,
            "zsmalloc: slot {obj} is not owned by handle index {handle}"
        );
        owners[obj as usize] = if self.first_free == NIL {
            NIL
        } else {
            FREE | self.first_free
        };
        self.first_free = obj;
        self.inuse -= 1;
    }

    /// Slots in use and their owner handle indices.
    pub(crate) fn used(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.owners
            .as_slice()
            .iter()
            .enumerate()
            .filter(|(_, &o)| o & FREE == 0)
            .map(|(i, &o)| (i as u32, o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zsmalloc::page_alloc::FrameAllocator;

    #[test]
    fn meta_reserve_release_lifo() {
        let mut m = ZspageMeta::default();
        assert!(!m.is_attached());
        m.attach(3);
        let a = m.reserve(10).unwrap().obj();
        let b = m.reserve(11).unwrap().obj();
        let c = m.reserve(12).unwrap().obj();
        assert_eq!((a, b, c), (0, 1, 2));
        assert!(m.reserve(13).is_none());
        assert_eq!(m.inuse(), 3);
        m.release(1, 11);
        m.release(0, 10);
        assert_eq!(m.used().collect::<Vec<_>>(), vec![(2, 12)]);
        assert_eq!(m.reserve(20).unwrap().obj(), 0);
        assert_eq!(m.reserve(21).unwrap().obj(), 1);
        assert!(m.reserve(22).is_none());
        for (obj, h) in [(0, 20), (1, 21), (2, 12)] {
            m.release(obj, h);
        }
        m.detach();
        assert!(!m.is_attached());
    }

    #[test]
    #[should_panic(expected = "not owned")]
    fn meta_double_release_panics() {
        let mut m = ZspageMeta::default();
        m.attach(2);
        let o = m.reserve(5).unwrap().obj();
        m.release(o, 5);
        m.release(o, 5);
    }

    #[test]
    fn move_copies_only_the_object() {
        let frames = FrameAllocator::new(4096);
        let mut src = frames.alloc().unwrap();
        let dst = frames.alloc().unwrap();
        src.bytes_mut(obj_offset(48, 2), 48).fill(7);
        src.bytes_mut(obj_offset(48, 2), 40)
            .copy_from_slice(&[9; 40]);
        let mut meta = ZspageMeta::default();
        meta.attach(85);
        meta.reserve(1).unwrap().obj();
        let slot = meta.reserve(2).unwrap();
        let obj = move_object(&src, 2, &dst, slot, 48, 40);
        assert_eq!(obj, 1);
        assert_eq!(
            dst.bytes(48, 48),
            [[9u8; 40].as_slice(), &[0u8; 8]].concat()
        );
    }
}
