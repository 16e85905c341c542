//! A never-shrinking segmented array with lock-free lookup.
//!
//! Each class's zspage descriptors (and the run descriptors) live in a [`SegArray`]: element `i`
//! keeps its address for the life of the array, so a thread that found an index (in a handle
//! word, say) can always dereference it, even if the element was recycled meanwhile. That is
//! what lets readers lock a zspage descriptor without holding any other lock first.
//!
//! Layout: segment 0 holds `2^BASE_SHIFT` elements; segment `k >= 1` holds `2^(BASE_SHIFT+k-1)`
//! elements and covers indices `[2^(BASE_SHIFT+k-1), 2^(BASE_SHIFT+k))`. Sizes double, so
//! [`SEGMENTS`] = 32 fixed slots cover `2^(BASE_SHIFT+31)` elements while a small array costs one
//! small segment. Each slot is a [`OnceLock`]: lookup is one acquire load, and concurrent growers
//! race safely (exactly one initialiser wins, the others wait for it).

use std::sync::OnceLock;

/// Fixed number of segment slots (each doubles the capacity).
pub(crate) const SEGMENTS: usize = 32;

/// A segmented, never-shrinking array of `T`, indexed by `u64`.
pub(crate) struct SegArray<T, const BASE_SHIFT: u32> {
    segments: [OnceLock<Box<[T]>>; SEGMENTS],
}

impl<T, const BASE_SHIFT: u32> std::fmt::Debug for SegArray<T, BASE_SHIFT> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let allocated = self.segments.iter().filter(|s| s.get().is_some()).count();
        f.debug_struct("SegArray")
            .field("segments_allocated", &allocated)
            .finish()
    }
}

impl<T: Default, const BASE_SHIFT: u32> Default for SegArray<T, BASE_SHIFT> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Default, const BASE_SHIFT: u32> SegArray<T, BASE_SHIFT> {
    /// One past the largest index the array can hold.
    pub(crate) const CAPACITY: u64 = 1 << (BASE_SHIFT + SEGMENTS as u32 - 1);

    /// An empty array; no segment is allocated until [`get_or_grow`](Self::get_or_grow).
    pub(crate) fn new() -> Self {
        SegArray {
            segments: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// Segment number and offset inside it for `index`.
    fn locate(index: u64) -> (usize, usize) {
        debug_assert!(index < Self::CAPACITY);
        if index < (1 << BASE_SHIFT) {
            return (0, index as usize);
        }
        let bits = 64 - index.leading_zeros();
        let segment = (bits - BASE_SHIFT) as usize;
        (segment, (index - (1u64 << (bits - 1))) as usize)
    }

    fn segment_len(segment: usize) -> usize {
        if segment == 0 {
            1 << BASE_SHIFT
        } else {
            1 << (BASE_SHIFT as usize + segment - 1)
        }
    }

    /// The element at `index`, if its segment exists.
    pub(crate) fn get(&self, index: u64) -> Option<&T> {
        if index >= Self::CAPACITY {
            return None;
        }
        let (segment, offset) = Self::locate(index);
        self.segments[segment].get().map(|s| &s[offset])
    }

    /// Bytes of element storage in the segments allocated so far (what the array holds on the
    /// heap; never shrinks).
    pub(crate) fn allocated_bytes(&self) -> usize {
        self.segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.get().is_some())
            .map(|(k, _)| Self::segment_len(k) * std::mem::size_of::<T>())
            .sum()
    }

    /// The element at `index`, allocating its segment (default elements) if needed.
    ///
    /// Panics if `index >= CAPACITY` (callers bound their counters far below it).
    pub(crate) fn get_or_grow(&self, index: u64) -> &T {
        assert!(
            index < Self::CAPACITY,
            "SegArray index {index} out of range"
        );
        let (segment, offset) = Self::locate(index);
        let seg = self.segments[segment].get_or_init(|| {
            (0..Self::segment_len(segment))
                .map(|_| T::default())
                .collect()
        });
        &seg[offset]
    }
}

/// The first chunk of a [`ChunkVec`] holds `2^CHUNK_FIRST_SHIFT` elements; each next one
/// twice as many, up to `2^CHUNK_LAST_SHIFT`, and every later one that many.
const CHUNK_FIRST_SHIFT: u32 = 4;
const CHUNK_LAST_SHIFT: u32 = 10;
/// Elements in the chunks that double (indices below this).
const CHUNK_DOUBLING_ELEMS: usize = (1 << (CHUNK_LAST_SHIFT + 1)) - (1 << CHUNK_FIRST_SHIFT);

/// A growable array in chunks (16 elements, doubling up to 1024, then 1024 each), for
/// bookkeeping that grows under a lock on the store path (a class's zspage metadata): growing
/// it allocates one chunk (at most tens of KiB), never a doubled copy of everything
/// (megabytes, copied under the lock, taken from malloc's heap reserve in one go when serving
/// swap); a small array stays small, and a large one holds at most one chunk beyond its
/// length.
#[derive(Debug)]
pub(crate) struct ChunkVec<T> {
    chunks: Vec<Box<[T]>>,
    len: usize,
    /// Elements the chunks hold (used or not).
    cap: usize,
}

impl<T> Default for ChunkVec<T> {
    fn default() -> Self {
        ChunkVec {
            chunks: Vec::new(),
            len: 0,
            cap: 0,
        }
    }
}

/// Elements of chunk `c`.
fn chunk_len(c: usize) -> usize {
    1 << (CHUNK_FIRST_SHIFT + (c as u32).min(CHUNK_LAST_SHIFT - CHUNK_FIRST_SHIFT))
}

/// The chunk holding element `i`, and its place there.
fn locate(i: usize) -> (usize, usize) {
    if i < CHUNK_DOUBLING_ELEMS {
        let j = i + (1 << CHUNK_FIRST_SHIFT);
        let k = usize::BITS - 1 - j.leading_zeros();
        ((k - CHUNK_FIRST_SHIFT) as usize, j - (1 << k))
    } else {
        let r = i - CHUNK_DOUBLING_ELEMS;
        (
            (CHUNK_LAST_SHIFT - CHUNK_FIRST_SHIFT + 1) as usize + (r >> CHUNK_LAST_SHIFT),
            r & ((1 << CHUNK_LAST_SHIFT) - 1),
        )
    }
}

impl<T: Default> ChunkVec<T> {
    /// Elements held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends `value`, allocating a chunk when the last one is full.
    pub(crate) fn push(&mut self, value: T) {
        if self.len == self.cap {
            let n = chunk_len(self.chunks.len());
            self.chunks.push((0..n).map(|_| T::default()).collect());
            self.cap += n;
        }
        let i = self.len;
        self.len += 1;
        self[i] = value;
    }

    /// Grows to `len` elements made by `f` (only from empty: recovery).
    pub(crate) fn resize_with(&mut self, len: usize, mut f: impl FnMut() -> T) {
        assert_eq!(
            self.len, 0,
            "ChunkVec::resize_with grows an empty array only"
        );
        for _ in 0..len {
            self.push(f());
        }
    }

    /// The elements, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.chunks.iter().flat_map(|c| c.iter()).take(self.len)
    }

    /// Heap bytes of the chunks and of the chunk list (as allocated).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.cap * std::mem::size_of::<T>()
            + self.chunks.capacity() * std::mem::size_of::<Box<[T]>>()
    }
}

impl<T> std::ops::Index<usize> for ChunkVec<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        assert!(i < self.len, "index {i} of {}", self.len);
        let (c, at) = locate(i);
        &self.chunks[c][at]
    }
}

impl<T> std::ops::IndexMut<usize> for ChunkVec<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        assert!(i < self.len, "index {i} of {}", self.len);
        let (c, at) = locate(i);
        &mut self.chunks[c][at]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn locate_covers_indices_without_gaps() {
        type A = SegArray<u8, 3>;
        let mut expected = (0usize, 0usize);
        for i in 0..10_000u64 {
            let got = A::locate(i);
            if got.0 != expected.0 {
                // Moving to the next segment: the previous one must have been full.
                assert_eq!(expected.1, A::segment_len(expected.0), "index {i}");
                expected = (expected.0 + 1, 0);
            }
            assert_eq!(got, expected, "index {i}");
            expected.1 += 1;
        }
    }

    #[test]
    fn elements_are_stable_and_shared() {
        let a: SegArray<AtomicU64, 2> = SegArray::new();
        assert!(a.get(0).is_none());
        for i in 0..1000 {
            a.get_or_grow(i).store(i * 3, Ordering::Relaxed);
        }
        let p = a.get(500).unwrap() as *const AtomicU64;
        a.get_or_grow(5000);
        assert_eq!(p, a.get(500).unwrap() as *const AtomicU64);
        for i in 0..1000 {
            assert_eq!(a.get(i).unwrap().load(Ordering::Relaxed), i * 3);
        }
        assert!(a.get(SegArray::<AtomicU64, 2>::CAPACITY).is_none());
    }

    #[test]
    fn concurrent_growth_agrees() {
        let a: SegArray<AtomicU64, 1> = SegArray::new();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let a = &a;
                s.spawn(move || {
                    for i in (t..4000).step_by(4) {
                        a.get_or_grow(i).store(i + 1, Ordering::Relaxed);
                    }
                });
            }
        });
        for i in 0..4000 {
            assert_eq!(a.get(i).unwrap().load(Ordering::Relaxed), i + 1);
        }
    }

    /// A chunked array indexes, iterates and counts like a vector, growing a chunk at a time:
    /// small chunks first, then chunks of 1024 elements, never a copy.
    #[test]
    fn chunk_vec_grows_by_chunks() {
        let mut v: ChunkVec<u64> = ChunkVec::default();
        assert_eq!(v.heap_bytes(), 0);
        v.push(5);
        let list = v.chunks.capacity() * std::mem::size_of::<Box<[u64]>>();
        assert_eq!(v.heap_bytes(), 16 * 8 + list, "a small first chunk");
        let mut covered = 0;
        for c in 0..12 {
            for at in 0..chunk_len(c) {
                assert_eq!(locate(covered + at), (c, at));
            }
            covered += chunk_len(c);
        }
        for i in 1..5000u64 {
            v.push(i * 3);
        }
        assert_eq!(v.len(), 5000);
        assert_eq!(v[0], 5);
        assert_eq!(v[4999], 4999 * 3);
        v[2032] = 7;
        assert_eq!(v[2032], 7);
        assert_eq!(v.iter().count(), 5000);
        assert_eq!(v.iter().nth(1023), Some(&(1023 * 3)));
        assert_eq!(v.iter().nth(4000), Some(&(4000 * 3)));
        // At most one chunk (1024 elements) beyond the length.
        assert!(v.heap_bytes() < (5000 + 1024) * 8 + 1024);
        let mut w: ChunkVec<u32> = ChunkVec::default();
        w.resize_with(5, || 9);
        assert_eq!(w.iter().copied().collect::<Vec<_>>(), vec![9; 5]);
    }
}
