//! Post-processing (zram's `struct zram_pp_ctl`): the candidate selection writeback and
//! recompression share.
//!
//! A scan walks the requested page range, skips empty, same-filled and written-back slots and
//! those the mode filters out, marks the rest PP_SLOT under their lock, and files each in the
//! bucket of its compressed size (64-byte buckets: `size / 64`, so a page-sized HUGE object is
//! in the last one). Writeback takes the **largest first**: each backing block frees one object,
//! and the largest objects free the most pool memory per block and per unit of the writeback
//! limit. Within a bucket, slots go in scan order.
//!
//! PP_SLOT is the slot's ticket: any read, write or free of the slot clears it (see
//! `SlotGuard::touch` and the store's release), and a writeback acts on a slot only if the flag
//! is still set under the slot lock (the store's `copy_candidate` and `finish_writeback`). Only one post-processing operation runs at a time per device (the
//! device's `pp_lock`), so a PP_SLOT flag always belongs to the current one. [`PpCtl::release`]
//! clears the flag of every candidate left when the writeback ends.

use crate::slot::{SlotFlags, SlotIndex, SlotState};
use crate::store::Store;

/// Which slots a writeback takes (zram's `IDLE_WRITEBACK`, `HUGE_WRITEBACK`,
/// `INCOMPRESSIBLE_WRITEBACK` bits; none set means every slot in the range).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ModeFilter {
    /// Only IDLE slots.
    pub idle: bool,
    /// Only HUGE slots.
    pub huge: bool,
    /// Only INCOMPRESSIBLE slots.
    pub incompressible: bool,
}

impl ModeFilter {
    fn accepts(self, flags: SlotFlags) -> bool {
        (!self.idle || flags.contains(SlotFlags::IDLE))
            && (!self.huge || flags.contains(SlotFlags::HUGE))
            && (!self.incompressible || flags.contains(SlotFlags::INCOMPRESSIBLE))
    }
}

/// Width of a size bucket in bytes (zram's `PP_BUCKET_SIZE_RANGE`).
pub const PP_BUCKET_BYTES: usize = 64;

/// Selected slots, bucketed by size. Owned by one writeback call.
#[derive(Debug)]
pub struct PpCtl {
    /// `buckets[i]`: slots whose object size is in `[64 i, 64 (i + 1))`, in scan order.
    buckets: Vec<Vec<u64>>,
    /// Next position to take in each bucket.
    taken: Vec<usize>,
    /// The highest bucket that may still hold candidates.
    top: usize,
    total: u64,
    /// Multi-page groups with a page filed already: a group is filed once (its object goes
    /// whole, see `Store::copy_group`), however many of its pages are marked.
    groups: std::collections::HashSet<u64>,
}

impl PpCtl {
    /// An empty control for pages of `page_size_bytes`.
    pub fn new(page_size_bytes: usize) -> PpCtl {
        let n = page_size_bytes / PP_BUCKET_BYTES + 1;
        PpCtl {
            buckets: vec![Vec::new(); n],
            taken: vec![0; n],
            top: n - 1,
            total: 0,
            groups: std::collections::HashSet::new(),
        }
    }

    /// Candidates selected so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Scans slots `lo..hi` with `mode`, marking and bucketing candidates (zram's
    /// `scan_slots_for_writeback`). A slot already PP_SLOT (selected by an earlier scan of the
    /// same call) is not selected twice.
    pub(crate) fn scan(&mut self, store: &Store, mode: ModeFilter, lo: u64, hi: u64) {
        self.scan_with(store, lo, hi, |st| mode.accepts(st.flags()));
    }

    /// Scans slots `lo..hi`, marking and bucketing those holding an object in RAM that
    /// `accepts` (shared by writeback and recompression, whose filters differ).
    pub(crate) fn scan_with(
        &mut self,
        store: &Store,
        lo: u64,
        hi: u64,
        accepts: impl Fn(&SlotState) -> bool,
    ) {
        for i in lo..hi.min(store.nr_pages()) {
            let Some(size_bytes) = store.mark_pp(SlotIndex(i), &accepts) else {
                continue;
            };
            self.total += 1;
            if store.multi_pages() > 1
                && store.is_multi(SlotIndex(i))
                && !self.groups.insert(store.group_first(SlotIndex(i)).0)
            {
                continue;
            }
            // A multi-page object is larger than a page: the last bucket, with the HUGE pages.
            let b = (size_bytes / PP_BUCKET_BYTES).min(self.buckets.len() - 1);
            self.buckets[b].push(i);
        }
    }

    /// The next candidate, largest bucket first (zram's `select_pp_slot`).
    pub fn select(&mut self) -> Option<SlotIndex> {
        loop {
            let b = self.top;
            if self.taken[b] < self.buckets[b].len() {
                self.taken[b] += 1;
                return Some(SlotIndex(self.buckets[b][self.taken[b] - 1]));
            }
            if b == 0 {
                return None;
            }
            self.top -= 1;
        }
    }

    /// Clears PP_SLOT on every candidate not taken yet (zram's `release_pp_ctl`). Slots that
    /// lost the flag (accessed or freed) are left as they are.
    pub(crate) fn release(&mut self, store: &Store) {
        while let Some(index) = self.select() {
            store.clear_pp(index);
        }
    }
}
