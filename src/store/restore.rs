//! Recovery of a store a previous process left in its files (`docs/restart.md`): the slot
//! table (its journal rolled forward) and the pool, checked against each other; the counters
//! and multi-page references rebuilt from the slots.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use super::stats::StoreStats;
use super::target::WbTarget;
use super::{Codecs, Store};
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::shm::ShmFile;
use crate::slot::{SlotFlags, SlotIndex, SlotTable};
use crate::zsmalloc::{Handle, PoolFiles, ZsPool, POOL_PAGE_BYTES};

/// The files of a store's state.
#[derive(Debug)]
pub struct StoreFiles {
    /// The slot table (entries and journal).
    pub slots: ShmFile,
    /// The pool's files.
    pub pool: PoolFiles,
}

/// What a recovery found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Slot updates in flight when the process stopped, rolled forward from the journal.
    pub journal_replayed: u64,
    /// Slots of a group publish in flight (a group write or recompression) pointed at the
    /// group's new object.
    pub group_repointed: u64,
    /// Slots holding data.
    pub pages_stored: u64,
    /// Objects kept in the pool.
    pub objects: u64,
    /// Objects no slot referenced (written but not yet published, or released but not yet
    /// freed), freed.
    pub garbage: u64,
}

fn corrupt(msg: String) -> Error {
    Error::invalid(format!("recovery: {msg}"))
}

/// Who references a handle (per handle index): 0 nobody, else slot + 1; `MULTI_REF` marks a
/// multi-page object (then the slot is the group's first referencing one).
const MULTI_REF: u64 = 1 << 63;

impl Store {
    /// Finishes a group publish a stopped process left half done. A group write, a group
    /// recompression or a group's writeback points the group's slots at its new object (in
    /// memory, or its location on the backing device) one by one in ascending order, all under
    /// the group's locks, so a stop in the middle leaves two multi-page objects in one group:
    /// the new one, named by the lowest slot of the two, and the old one, named by slots
    /// above. The rest of the old one's slots are pointed at the new one (journaled), which
    /// leaves every page of the group as the operation in flight would have, and the old
    /// object to be freed as garbage (or its backing blocks left unclaimed). Three objects in
    /// a group are refused (only one operation can be in flight in a group). Returns the
    /// slots repointed.
    fn finish_group_publish(slots: &SlotTable, nr_pages: u64, multi_pages: usize) -> Result<u64> {
        if multi_pages == 1 {
            return Ok(0);
        }
        let n = multi_pages as u64;
        let mut repointed = 0;
        for first in (0..nr_pages / n * n).step_by(multi_pages) {
            let mut objects: Vec<(u64, crate::slot::SlotState)> = Vec::new();
            for i in first..first + n {
                let st = slots.entry(SlotIndex(i)).state_unlocked();
                let held = st.handle_raw().is_some() || st.wb_location().is_some();
                let same = |o: &(u64, crate::slot::SlotState)| {
                    o.1.value == st.value && o.1.has(SlotFlags::WB) == st.has(SlotFlags::WB)
                };
                if st.has(SlotFlags::MULTI) && held && !objects.iter().any(same) {
                    objects.push((i, st));
                }
            }
            match objects.len() {
                0 | 1 => continue,
                2 => {}
                _ => {
                    return Err(corrupt(format!(
                        "the group of slot {first} shares {} multi-page objects",
                        objects.len()
                    )))
                }
            }
            let (new, old) = (objects[0].1, objects[1].1);
            for i in first..first + n {
                let mut g = slots.lock(SlotIndex(i));
                let st = g.state();
                if st.has(SlotFlags::MULTI)
                    && st.value == old.value
                    && st.has(SlotFlags::WB) == old.has(SlotFlags::WB)
                {
                    if new.has(SlotFlags::WB) {
                        g.set_wb(new.value, new.size_bytes(), new.flags(), new.codec());
                    } else {
                        g.set_handle(new.value, new.size_bytes(), new.flags(), new.codec());
                    }
                    repointed += 1;
                }
            }
        }
        Ok(repointed)
    }

    /// New descriptors of the files holding the store's state (serving swap, the pool's
    /// frames and records are the server's swap reserve's).
    pub(crate) fn files(&self) -> Result<StoreFiles> {
        Ok(StoreFiles {
            slots: ShmFile::from_fd(self.slots.file().try_clone_fd()?),
            pool: self.pool.files()?,
        })
    }

    /// The store a previous process left in `files`, as [`Store::with_multi_pages`] would
    /// make it, writing back into `target` (a fresh target over the backing device the store
    /// wrote back to; without one, written-back slots are refused): every WB slot's location
    /// is claimed in it, once. Every slot is checked:
    /// its handle live, of the slot's size, referenced by no other slot (a multi-page object:
    /// only by slots of its group), its codec known (for a recompression codec, a dictionary
    /// generation `codecs` was recovered with: counted, and the generations no slot names
    /// dropped at the end but the current ones); objects no slot references are freed. A
    /// failed check refuses the store, naming the slot or handle. `swap`: the store served
    /// swap, its pool under this tag in this swap reserve (being recovered); its slot table
    /// and handle table are then faulted in, as a new one's.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn recover(
        page_size_bytes: usize,
        multi_pages: usize,
        nr_pages: u64,
        codecs: Codecs,
        pool_page_bytes: usize,
        capacity: Option<usize>,
        files: StoreFiles,
        swap: Option<(&crate::memory::SwapReserve, u16)>,
        target: Option<WbTarget>,
        clock: Arc<dyn Clock>,
    ) -> Result<(Store, RecoveryReport)> {
        let (slots, journal_replayed) = SlotTable::from_file(files.slots, nr_pages)?;
        if swap.is_some() {
            slots.fault_in();
        }
        let multi_pages = multi_pages.max(1);
        let group_repointed = Self::finish_group_publish(&slots, nr_pages, multi_pages)?;
        // 1. Who references which handle.
        let mut refs: Vec<u64> = Vec::new();
        for i in 0..nr_pages {
            let st = slots.entry(SlotIndex(i)).state_unlocked();
            if st.is_empty() {
                if st.size_bytes() != 0 || st.flags().bits() & !SlotFlags::IDLE.bits() != 0 {
                    return Err(corrupt(format!(
                        "slot {i} holds no data but size {} and flags {:#x}",
                        st.size_bytes(),
                        st.flags().bits()
                    )));
                }
                continue;
            }
            if st.has(SlotFlags::WB) {
                if target.is_none() {
                    return Err(corrupt(format!(
                        "slot {i} is written back, and no backing device was given"
                    )));
                }
                if st.has(SlotFlags::MULTI) && multi_pages == 1 {
                    return Err(corrupt(format!(
                        "slot {i} shares a written-back multi-page object, but multi-page \
                         objects are off"
                    )));
                }
                continue; // its location: claimed below
            }
            let Some(raw) = st.handle_raw() else {
                continue; // SAME
            };
            let Some(index) = raw.checked_sub(1).filter(|&x| x < u64::from(u32::MAX >> 1)) else {
                return Err(corrupt(format!(
                    "slot {i} names handle {raw}, out of range"
                )));
            };
            let index = index as usize;
            if refs.len() <= index {
                refs.resize(index + 1, 0);
            }
            let multi = st.has(SlotFlags::MULTI);
            if multi && multi_pages == 1 {
                return Err(corrupt(format!(
                    "slot {i} shares a multi-page object, but multi-page objects are off"
                )));
            }
            match refs[index] {
                0 => refs[index] = (i + 1) | if multi { MULTI_REF } else { 0 },
                other => {
                    let first = (other & !MULTI_REF) - 1;
                    let same_group = first / multi_pages as u64 == i / multi_pages as u64;
                    if !(multi && other & MULTI_REF != 0 && same_group) {
                        return Err(corrupt(format!(
                            "slots {first} and {i} both name handle {raw}"
                        )));
                    }
                }
            }
        }
        // 2. The pool, keeping what the slots reference.
        let wanted = |index: u32| refs.get(index as usize).is_some_and(|&r| r != 0);
        let (pool, pool_report) =
            ZsPool::restore(pool_page_bytes, capacity, files.pool, swap, &wanted)?;
        if swap.is_some() {
            pool.keep_handles_ahead();
        }
        // 3. Each slot against its object; the counters.
        let groups = if multi_pages > 1 {
            nr_pages / multi_pages as u64
        } else {
            0
        };
        let group_refs: Box<[AtomicU8]> = (0..groups).map(|_| AtomicU8::new(0)).collect();
        let stats = StoreStats::default();
        let mut group_handle: Vec<u64> = vec![0; groups as usize];
        let mut group_wb: Vec<Option<u64>> = vec![None; groups as usize];
        for i in 0..nr_pages {
            let st = slots.entry(SlotIndex(i)).state_unlocked();
            if st.is_empty() {
                continue;
            }
            StoreStats::add(&stats.pages_stored, 1);
            if st.has(SlotFlags::SAME) {
                StoreStats::add(&stats.same_pages, 1);
                continue;
            }
            if let Some(location) = st.wb_location() {
                let target = target.as_ref().expect("checked above");
                codecs
                    .get(st.codec())
                    .map_err(|e| corrupt(format!("slot {i}: {}", e.message())))?;
                // The slot names its codec: counted, as when it was published.
                codecs.acquire(st.codec());
                if !st.has(SlotFlags::MULTI) {
                    target
                        .claim(location, 1, i)
                        .map_err(|e| corrupt(format!("slot {i}: {e}")))?;
                    continue;
                }
                let group = (i / multi_pages as u64) as usize;
                if group >= groups as usize {
                    return Err(corrupt(format!("slot {i} is MULTI outside a whole group")));
                }
                let blocks = WbTarget::group_blocks(st.size_bytes(), page_size_bytes);
                match group_wb[group] {
                    None => {
                        target
                            .claim(location, blocks, group as u64 * multi_pages as u64)
                            .map_err(|e| corrupt(format!("slot {i}: {e}")))?;
                        group_wb[group] = Some(location);
                        StoreStats::add(&stats.multi_wb_objects, 1);
                        StoreStats::add(&stats.multi_wb_blocks, blocks);
                    }
                    Some(seen) if seen == location => {}
                    _ => {
                        return Err(corrupt(format!(
                            "group of slot {i} points at two written-back locations"
                        )))
                    }
                }
                group_refs[group].fetch_add(1, Ordering::Relaxed);
                StoreStats::add(&stats.multi_wb_pages, 1);
                continue;
            }
            let raw = st.value;
            let h = Handle::from_raw(raw).expect("checked above");
            if !pool.is_live(h) {
                return Err(corrupt(format!(
                    "slot {i} names handle {raw}, which is free"
                )));
            }
            let size = pool.obj_size_bytes(h);
            if size != st.size_bytes() {
                return Err(corrupt(format!(
                    "slot {i} says {} bytes, its handle {raw} holds {size}",
                    st.size_bytes()
                )));
            }
            codecs
                .get(st.codec())
                .map_err(|e| corrupt(format!("slot {i}: {}", e.message())))?;
            codecs.acquire(st.codec());
            if st.has(SlotFlags::HUGE) {
                StoreStats::add(&stats.huge_pages, 1);
                StoreStats::add(&stats.huge_pages_since, 1);
            }
            if st.has(SlotFlags::MULTI) {
                let group = (i / multi_pages as u64) as usize;
                if group >= groups as usize {
                    return Err(corrupt(format!("slot {i} is MULTI outside a whole group")));
                }
                match group_handle[group] {
                    0 => {
                        group_handle[group] = raw;
                        StoreStats::add(&stats.compr_data_size_bytes, size as u64);
                        StoreStats::add(&stats.multi_objects, 1);
                    }
                    other if other == raw => {}
                    other => {
                        return Err(corrupt(format!(
                            "group of slot {i} shares two objects, handles {other} and {raw}"
                        )))
                    }
                }
                group_refs[group].fetch_add(1, Ordering::Relaxed);
                StoreStats::add(&stats.multi_pages, 1);
            } else {
                if st.has(SlotFlags::HUGE) && size != page_size_bytes {
                    return Err(corrupt(format!(
                        "slot {i} is HUGE but holds {size} bytes, not a page"
                    )));
                }
                StoreStats::add(&stats.compr_data_size_bytes, size as u64);
            }
        }
        if let Some(g) =
            (0..groups as usize).find(|&g| group_wb[g].is_some() && group_handle[g] != 0)
        {
            return Err(corrupt(format!(
                "group {g} holds a multi-page object both in memory and written back"
            )));
        }
        if let Some(t) = &target {
            t.finish_recovery().map_err(corrupt)?;
        }
        // Every slot's generation counted: the ones no slot names go, but the current ones.
        codecs.finish_recovery();
        let total_pages = pool.total_pages();
        stats.update_max_used(total_pages);
        let report = RecoveryReport {
            journal_replayed,
            group_repointed,
            pages_stored: StoreStats::get(&stats.pages_stored),
            objects: pool_report.objects,
            garbage: pool_report.garbage,
        };
        let huge =
            |bytes: usize| bytes - POOL_PAGE_BYTES + pool.class_table().huge_class_size_bytes();
        let store = Store {
            page_size_bytes,
            huge_threshold_bytes: huge(page_size_bytes),
            multi_pages,
            huge_group_bytes: huge(multi_pages * page_size_bytes),
            group_refs,
            multi_frees: AtomicU64::new(0),
            id: super::next_store_id(),
            slots,
            pool,
            codecs,
            stats,
            target,
            epoch: clock.now(),
            clock,
        };
        Ok((store, report))
    }
}
