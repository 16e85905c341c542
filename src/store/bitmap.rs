//! The bitmap block store: one backing block per written-back slot, as zram does
//! (`alloc_block_bdev` / `free_block_bdev`).
//!
//! The backing device is cut into blocks of one device page; bit `b` of the bitmap is set while
//! block `b` belongs to a slot (or to a writeback request that reserved it). Allocation takes
//! the **first free block**, like the kernel's `find_next_zero_bit` from 0: on a fresh backing a
//! writeback lays its pages out sequentially, which is what makes batching pay; on a long-lived
//! device the bitmap fragments and writeback becomes random I/O (the writeback benchmark's
//! `fragmented` layout measures that case). A search hint (the lowest block that may be free) keeps
//! allocation O(1) amortised on the sequential path without changing which block is chosen.
//!
//! # Read pins
//!
//! A read of a written-back slot records the slot's block under the slot lock, drops the slot
//! lock, and only then reads the backing device (no slot lock is ever held across I/O). To make
//! that safe, the reader **pins** the block first: a pinned block that is released (the slot
//! was overwritten, discarded or reset meanwhile) stays allocated until the last pin goes, so it
//! cannot be handed to another slot and rewritten under the reader. The reader therefore reads
//! exactly the data the slot held when it looked.
//!
//! # Invariants
//! - A block is released exactly once per allocation; releasing a free block (or releasing a
//!   pinned block twice) panics: it would mean two slots shared a block.
//! - `bd_count` equals the number of set bits.
//! - Everything is behind one mutex (`inner`), a leaf lock: it may be taken with a slot lock
//!   held, and nothing is taken while it is held.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// A block of the backing device, in device pages (zram's `blk_idx`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockIndex(pub u64);

/// A pinned block's bookkeeping.
#[derive(Debug, Default)]
struct Pin {
    /// Readers holding the pin.
    readers: u32,
    /// The owner released the block (and the `released` - 1 blocks after it, a multi-page
    /// object's) while it was pinned: free them when the last reader goes. 0: not released.
    released: u64,
}

#[derive(Debug)]
struct Inner {
    words: Vec<u64>,
    /// Every block below this is allocated (a lower bound for the first free block).
    hint: u64,
    pins: HashMap<u64, Pin>,
}

/// The allocation bitmap of a backing device. See the module docs.
#[derive(Debug)]
pub struct BlockBitmap {
    blocks: u64,
    /// Protected by its mutex (a leaf lock).
    inner: Mutex<Inner>,
    /// Blocks allocated (zram's `bd_count`). Changed only with `inner` held; read without it.
    bd_count: AtomicU64,
}

/// A reader's pin on a block; unpins on drop.
#[derive(Debug)]
pub struct BlockPin<'a> {
    bitmap: &'a BlockBitmap,
    block: BlockIndex,
}

impl BlockPin<'_> {
    /// The pinned block.
    pub fn block(&self) -> BlockIndex {
        self.block
    }
}

impl Drop for BlockPin<'_> {
    fn drop(&mut self) {
        self.bitmap.unpin(self.block);
    }
}

impl BlockBitmap {
    /// A bitmap of `blocks` free blocks.
    pub fn new(blocks: u64) -> BlockBitmap {
        let words = usize::try_from(blocks.div_ceil(64)).expect("bitmap fits in memory");
        BlockBitmap {
            blocks,
            inner: Mutex::new(Inner {
                words: vec![0; words],
                hint: 0,
                pins: HashMap::new(),
            }),
            bd_count: AtomicU64::new(0),
        }
    }

    /// Number of blocks.
    #[cfg(any(test, feature = "testing"))]
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Number of blocks (what recovery checks a location against).
    pub fn blocks_total(&self) -> u64 {
        self.blocks
    }

    /// Blocks allocated now.
    pub fn bd_count(&self) -> u64 {
        self.bd_count.load(Ordering::Relaxed)
    }

    /// Allocates the first `count` adjacent free blocks (a written-back multi-page object's),
    /// or `None` when no such range is free. O(blocks) in the worst case: extents are written
    /// back far less often than pages, and mostly at the sequential end of the bitmap.
    pub fn alloc_extent(&self, count: u64) -> Option<BlockIndex> {
        if count <= 1 {
            return self.alloc();
        }
        let mut g = self.inner.lock();
        let is_set = |g: &Inner, b: u64| g.words[(b / 64) as usize] & (1 << (b % 64)) != 0;
        let mut start = g.hint;
        let mut b = start;
        while b < self.blocks {
            if is_set(&g, b) {
                b += 1;
                start = b;
                continue;
            }
            b += 1;
            if b - start == count {
                for x in start..b {
                    g.words[(x / 64) as usize] |= 1 << (x % 64);
                }
                if g.hint == start {
                    g.hint = b;
                }
                self.bd_count.fetch_add(count, Ordering::Relaxed);
                return Some(BlockIndex(start));
            }
        }
        None
    }

    /// Allocates the first free block, or `None` when the backing device is full.
    pub fn alloc(&self) -> Option<BlockIndex> {
        let mut g = self.inner.lock();
        let start_word = (g.hint / 64) as usize;
        for w in start_word..g.words.len() {
            let word = g.words[w];
            if word == u64::MAX {
                continue;
            }
            let bit = (!word).trailing_zeros() as u64;
            let b = w as u64 * 64 + bit;
            if b >= self.blocks {
                break;
            }
            g.words[w] |= 1 << bit;
            g.hint = b + 1;
            self.bd_count.fetch_add(1, Ordering::Relaxed);
            return Some(BlockIndex(b));
        }
        g.hint = self.blocks;
        None
    }

    /// Recovery: marks the `count` blocks from `block` allocated (a written-back slot's, or a
    /// multi-page object's extent) if they are in range and all free; `false` (nothing
    /// changed) otherwise: two slots claiming a block, or a location past the device.
    pub fn claim_extent(&self, block: BlockIndex, count: u64) -> bool {
        let Some(end) = block.0.checked_add(count).filter(|&e| e <= self.blocks) else {
            return false;
        };
        let mut g = self.inner.lock();
        let is_set = |g: &Inner, b: u64| g.words[(b / 64) as usize] & (1 << (b % 64)) != 0;
        if (block.0..end).any(|b| is_set(&g, b)) {
            return false;
        }
        for b in block.0..end {
            g.words[(b / 64) as usize] |= 1 << (b % 64);
        }
        self.bd_count.fetch_add(count, Ordering::Relaxed);
        true
    }

    /// Marks `block` allocated if it is free (the benchmark's `fragmented` layout reserves every
    /// other block this way, through `Device::debug_reserve_backing_blocks`). Returns whether
    /// it was free.
    #[cfg(any(test, feature = "testing"))]
    pub fn reserve(&self, block: BlockIndex) -> bool {
        assert!(block.0 < self.blocks, "block {} out of range", block.0);
        let mut g = self.inner.lock();
        let (w, bit) = ((block.0 / 64) as usize, block.0 % 64);
        if g.words[w] & (1 << bit) != 0 {
            return false;
        }
        g.words[w] |= 1 << bit;
        self.bd_count.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Releases `block` (zram's `free_block_bdev`). A pinned block is freed when its last reader
    /// unpins it. Panics if the block is not allocated or was already released: each block is
    /// released exactly once.
    pub fn release(&self, block: BlockIndex) {
        self.release_extent(block, 1);
    }

    /// Releases `count` blocks from `block` (a written-back multi-page object's, allocated by
    /// [`alloc_extent`](Self::alloc_extent); it is pinned by its first block), as
    /// [`release`](Self::release) does one.
    pub fn release_extent(&self, block: BlockIndex, count: u64) {
        let mut g = self.inner.lock();
        if let Some(pin) = g.pins.get_mut(&block.0) {
            assert!(pin.released == 0, "block {} released twice", block.0);
            pin.released = count;
            return;
        }
        for b in block.0..block.0 + count {
            Self::clear_bit(&mut g, BlockIndex(b));
        }
        self.bd_count.fetch_sub(count, Ordering::Relaxed);
    }

    fn clear_bit(g: &mut Inner, block: BlockIndex) {
        let (w, bit) = ((block.0 / 64) as usize, block.0 % 64);
        assert!(
            g.words[w] & (1 << bit) != 0,
            "block {} released but not allocated",
            block.0
        );
        g.words[w] &= !(1 << bit);
        g.hint = g.hint.min(block.0);
    }

    /// Pins an allocated block for a read (see the module docs). The caller holds the lock of
    /// the slot that owns it, so it cannot be released before the pin is taken.
    pub fn pin(&self, block: BlockIndex) -> BlockPin<'_> {
        let mut g = self.inner.lock();
        let (w, bit) = ((block.0 / 64) as usize, block.0 % 64);
        assert!(
            g.words[w] & (1 << bit) != 0,
            "pinning free block {}",
            block.0
        );
        let pin = g.pins.entry(block.0).or_default();
        assert!(pin.released == 0, "pinning released block {}", block.0);
        pin.readers += 1;
        BlockPin {
            bitmap: self,
            block,
        }
    }

    fn unpin(&self, block: BlockIndex) {
        let mut g = self.inner.lock();
        let pin = g.pins.get_mut(&block.0).expect("pinned block has a pin");
        pin.readers -= 1;
        if pin.readers == 0 {
            let released = pin.released;
            g.pins.remove(&block.0);
            for b in block.0..block.0 + released {
                Self::clear_bit(&mut g, BlockIndex(b));
            }
            self.bd_count.fetch_sub(released, Ordering::Relaxed);
        }
    }

    /// True if `block` is allocated (for tests).
    #[cfg(test)]
    pub fn is_allocated(&self, block: BlockIndex) -> bool {
        let g = self.inner.lock();
        g.words[(block.0 / 64) as usize] & (1 << (block.0 % 64)) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_free_and_full() {
        let b = BlockBitmap::new(130);
        for i in 0..130 {
            assert_eq!(b.alloc(), Some(BlockIndex(i)));
        }
        assert_eq!(b.alloc(), None);
        assert_eq!(b.bd_count(), 130);
        b.release(BlockIndex(70));
        b.release(BlockIndex(3));
        assert_eq!(b.alloc(), Some(BlockIndex(3)));
        assert_eq!(b.alloc(), Some(BlockIndex(70)));
        assert_eq!(b.alloc(), None);
    }

    #[test]
    fn reserve_makes_holes_for_fragmented_layouts() {
        let b = BlockBitmap::new(8);
        for i in (0..8).step_by(2) {
            assert!(b.reserve(BlockIndex(i)));
        }
        assert!(!b.reserve(BlockIndex(0)));
        let got: Vec<u64> = std::iter::from_fn(|| b.alloc()).map(|x| x.0).collect();
        assert_eq!(got, vec![1, 3, 5, 7]);
        assert_eq!(b.bd_count(), 8);
    }

    #[test]
    #[should_panic(expected = "released but not allocated")]
    fn double_release_panics() {
        let b = BlockBitmap::new(4);
        let x = b.alloc().unwrap();
        b.release(x);
        b.release(x);
    }

    #[test]
    fn pinned_block_is_freed_by_the_last_reader() {
        let b = BlockBitmap::new(2);
        let x = b.alloc().unwrap();
        let p1 = b.pin(x);
        let p2 = b.pin(x);
        b.release(x);
        // Still allocated: a reader may be reading it.
        assert!(b.is_allocated(x));
        assert_eq!(b.alloc(), Some(BlockIndex(1)));
        assert_eq!(b.alloc(), None);
        drop(p1);
        assert!(b.is_allocated(x));
        drop(p2);
        assert!(!b.is_allocated(x));
        assert_eq!(b.bd_count(), 1);
        assert_eq!(b.alloc(), Some(x));
    }

    #[test]
    fn extents_take_the_first_free_range_and_are_released_whole() {
        let b = BlockBitmap::new(200);
        let one = b.alloc().unwrap();
        assert_eq!(b.alloc_extent(3), Some(BlockIndex(1)));
        b.release(one);
        // Block 0 is free but too short for 2: the extent goes after the first one.
        assert_eq!(b.alloc_extent(2), Some(BlockIndex(4)));
        assert_eq!(b.alloc(), Some(BlockIndex(0)));
        // Across a word boundary, then none left that long.
        assert_eq!(b.alloc_extent(100), Some(BlockIndex(6)));
        assert_eq!(b.alloc_extent(100), None);
        assert_eq!(b.bd_count(), 106);
        // A pinned extent is freed whole by its last reader.
        let p = b.pin(BlockIndex(1));
        b.release_extent(BlockIndex(1), 3);
        assert!(b.is_allocated(BlockIndex(3)));
        drop(p);
        assert!(!b.is_allocated(BlockIndex(1)) && !b.is_allocated(BlockIndex(3)));
        assert_eq!(b.bd_count(), 103);
        assert_eq!(b.alloc_extent(3), Some(BlockIndex(1)));
    }

    #[test]
    fn pin_without_release_keeps_the_block() {
        let b = BlockBitmap::new(1);
        let x = b.alloc().unwrap();
        drop(b.pin(x));
        assert!(b.is_allocated(x));
        b.release(x);
        assert!(!b.is_allocated(x));
    }
}
