//! Recovery of a pool a previous process left in its files (`docs/restart.md`).
//!
//! The files hold everything that names memory: the handle table's location words, the frames
//! and the frame records (`record`). What the old process kept on its heap (descriptors,
//! zspage owners and free slots, fullness groups, free ids and handle indices, counters) is
//! rebuilt here in one pass over the records and one over the handles, and every invariant the
//! write paths keep is checked on the way:
//!
//! - a record decodes, names a class that exists, and no two frames claim one zspage or span;
//! - a live location word's size is 1..=page size, its zspage (of the size's class) or span is
//!   recorded, its object index is inside the zspage, no two words name one object; a span's
//!   record has the pages its size splits into and a tail exactly when the size has one.
//!
//! Which objects are wanted is the caller's to say (the slots that reference them); the
//! tails of wanted spans are wanted too. Every other live handle is garbage a write path left
//! when the process stopped (an object not yet published, or not yet freed) and is freed: its
//! word cleared *before* any record goes, so a recovery that stops half way can be span again.
//! A zspage or span left with no wanted object is released with every unrecorded frame.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::class::SizeClass;
use super::deferred_free;
use super::handle::{Handle, HandleTable, Location};
use super::page_alloc::{FrameAllocator, FRAME_CACHE_BYTES};
use super::record::FrameUse;
use super::size_class::{ClassTable, SUPPORTED_PAGE_SIZES_BYTES};
use super::span::{self, SpanObj, SpanTable};
use super::{PoolCore, ZsPool, POOL_PAGE_BYTES};
use crate::error::{Error, Result};
use crate::shm::ShmFile;

/// The files of a pool's state (`docs/restart.md`).
#[derive(Debug)]
pub struct PoolFiles {
    /// The handle table.
    pub handles: ShmFile,
    /// The frames.
    pub frames: ShmFile,
    /// The frame records.
    pub records: ShmFile,
}

/// What recovery found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Objects kept (wanted, plus the tails of wanted spans).
    pub objects: u64,
    /// Live objects nobody wanted, freed.
    pub garbage: u64,
    /// Zspages and spans kept.
    pub zspages: u64,
    /// Runs kept.
    pub spans: u64,
}

fn corrupt(msg: String) -> Error {
    Error::invalid(format!("zsmalloc recovery: {msg}"))
}

impl ZsPool {
    /// New descriptors of the files holding the pool's state, to hand to another process. A
    /// pool serving swap hands over the server's swap reserve's frames and records (shared
    /// by every pool of the server, each frame's record tagged with its pool).
    pub fn files(&self) -> Result<PoolFiles> {
        let (frames, records) = self.core.frames.files()?;
        Ok(PoolFiles {
            handles: ShmFile::from_fd(self.core.handles.file().try_clone_fd()?),
            frames,
            records,
        })
    }

    /// The pool a previous process left in `files`, for pages of `page_size_bytes` and a
    /// deferred-free queue of `capacity` (as [`ZsPool::with_deferred_capacity`]), keeping the
    /// live objects whose handle index `wanted` says yes to (and the tails of wanted spans),
    /// freeing the others. `shared`: the pool took its frames from the server's swap reserve
    /// under this record tag; the reserve must be being recovered
    /// ([`SwapReserve::recover`](crate::memory::SwapReserve::recover)) from the same files as
    /// `files.frames` and `files.records`, and the frames no pool claims are released when it
    /// finishes. Every check of the module docs that fails refuses the pool (`EINVAL`, naming
    /// what is wrong); no frame is claimed then.
    pub fn restore(
        page_size_bytes: usize,
        capacity: Option<usize>,
        files: PoolFiles,
        shared: Option<(&crate::memory::SwapReserve, u16)>,
        wanted: &dyn Fn(u32) -> bool,
    ) -> Result<(ZsPool, RestoreReport)> {
        if !SUPPORTED_PAGE_SIZES_BYTES.contains(&page_size_bytes) {
            return Err(Error::invalid(format!(
                "zsmalloc: page size {page_size_bytes} not one of {SUPPORTED_PAGE_SIZES_BYTES:?}"
            )));
        }
        let handles = HandleTable::from_file(files.handles)?;
        let (frames, pool_tag) = match shared {
            Some((reserve, tag)) => {
                let frames = Arc::clone(reserve.frames());
                if !frames.is_recovering() {
                    return Err(corrupt(
                        "the pool served swap, and the swap reserve given is not being recovered"
                            .into(),
                    ));
                }
                if !frames.has_files(&files.frames, &files.records)? {
                    return Err(corrupt(
                        "the pool served swap from another swap reserve than the one given".into(),
                    ));
                }
                let tag = frames.take_pool_tag(Some(tag))?;
                (frames, tag)
            }
            None => (
                Arc::new(
                    FrameAllocator::with_frame_pages(
                        POOL_PAGE_BYTES,
                        page_size_bytes / POOL_PAGE_BYTES,
                        FRAME_CACHE_BYTES,
                    )
                    .with_drop_batches()
                    .with_reserve()
                    .with_files(files.frames, files.records)?,
                ),
                0,
            ),
        };
        let table = ClassTable::new(POOL_PAGE_BYTES);
        let classes: Box<[SizeClass]> = table
            .classes()
            .iter()
            .enumerate()
            .map(|(i, &c)| SizeClass::new(c, i as u32))
            .collect();
        let capacity = capacity.unwrap_or_else(|| deferred_free::default_capacity(page_size_bytes));
        let core = PoolCore {
            page_size_bytes,
            table,
            classes,
            handles,
            spans: SpanTable::default(),
            shared_frames: shared.is_some(),
            pool_tag,
            frames,
            total_pages: AtomicU64::new(0),
            pages_compacted: AtomicU64::new(0),
            deferred: deferred_free::pool_queue(capacity),
            #[cfg(any(test, feature = "testing"))]
            release_under_class_lock: false,
        };
        let report = core.restore(wanted)?;
        Ok((ZsPool::with_core(core), report))
    }

    /// The record tag of a pool serving swap (0 for a pool with frames of its own): what its
    /// device's header records, for [`restore`](Self::restore).
    pub fn pool_tag(&self) -> u16 {
        self.core.pool_tag
    }
}

/// No frame holds this zspage id (in recovery's id-indexed tables).
const NO_FRAME: u32 = u32::MAX;

/// A span as its record says.
struct SpanRecord {
    frame: u32,
    pages: usize,
    tail_raw: u64,
}

impl PoolCore {
    /// Rebuilds a fresh core's volatile state from its files; see the module docs.
    fn restore(&self, wanted: &dyn Fn(u32) -> bool) -> Result<RestoreReport> {
        let frames = &self.frames;
        let carved = frames.carved_frames();
        // 1. Records: (class, id) -> frame; span id -> its record.
        // Per class, indexed by zspage id ([`NO_FRAME`]: none). Ids are dense: a live
        // zspage's id was taken while every lower one was in use, each with a frame, so an id
        // is below the frames carved (checked).
        let mut zspage_frames: Vec<Vec<u32>> = vec![Vec::new(); self.classes.len()];
        let mut span_records: HashMap<u32, SpanRecord> = HashMap::new();
        for index in 0..carved {
            let r = frames.record(index);
            let (what, extra) = (
                r.what.load(Ordering::Acquire),
                r.extra.load(Ordering::Relaxed),
            );
            let used = FrameUse::decode(what, extra)
                .map_err(|e| corrupt(format!("frame {index}: {e}")))?;
            let used = match used {
                None => None,
                // Another pool's frame (a shared allocator).
                Some((tag, _)) if tag != self.pool_tag && self.shared_frames => None,
                Some((tag, _)) if tag != self.pool_tag => {
                    return Err(corrupt(format!(
                        "frame {index} is tagged for pool {tag} in a pool of its own"
                    )));
                }
                Some((_, used)) => Some(used),
            };
            match used {
                None => {}
                Some(FrameUse::Zspage { class, id }) => {
                    let map = zspage_frames.get_mut(class as usize).ok_or_else(|| {
                        corrupt(format!(
                            "frame {index} names class {class}, which does not exist"
                        ))
                    })?;
                    let pages = self.classes[class as usize].info.pages_per_zspage;
                    if pages > frames.frame_pages_of(index) {
                        return Err(corrupt(format!(
                            "frame {index} holds a zspage of class {class} ({pages} pages) but \
                             has room for {}",
                            frames.frame_pages_of(index)
                        )));
                    }
                    if id >= carved {
                        return Err(corrupt(format!(
                            "frame {index} holds zspage {id} of class {class}, an id past the \
                             {carved} frames carved"
                        )));
                    }
                    if map.len() <= id as usize {
                        map.resize(id as usize + 1, NO_FRAME);
                    }
                    if map[id as usize] != NO_FRAME {
                        return Err(corrupt(format!(
                            "frames {} and {index} both hold zspage {id} of class {class}",
                            map[id as usize]
                        )));
                    }
                    map[id as usize] = index;
                }
                Some(FrameUse::Span {
                    id,
                    pages,
                    tail_raw,
                }) => {
                    let room = frames.frame_pages_of(index);
                    if pages == 0 || pages as usize > room {
                        return Err(corrupt(format!(
                            "frame {index} holds a span of {pages} pages (it has room for {room})"
                        )));
                    }
                    let rec = SpanRecord {
                        frame: index,
                        pages: pages as usize,
                        tail_raw,
                    };
                    if let Some(other) = span_records.insert(id, rec) {
                        return Err(corrupt(format!(
                            "frames {} and {index} both hold span {id}",
                            other.frame
                        )));
                    }
                }
            }
        }
        // 2. Location words.
        let indices = self.handles.indices();
        if indices > super::handle::MAX_HANDLES {
            return Err(corrupt(format!("{indices} handles handed out")));
        }
        // Per class: (zspage id, object index, handle index) of every live object, sorted below.
        let mut objects: Vec<Vec<(u32, u32, u32)>> = vec![Vec::new(); self.classes.len()];
        let mut span_handles: HashMap<u32, u32> = HashMap::new();
        let mut live: Vec<(u32, Location)> = Vec::new();
        let mut free_indices: Vec<u32> = Vec::new();
        for index in 0..indices as u32 {
            let word = self.handles.word_at(index).load(Ordering::Acquire);
            let Some(loc) = Location::decode(word) else {
                free_indices.push(index);
                continue;
            };
            if loc.size_bytes > self.page_size_bytes {
                return Err(corrupt(format!(
                    "handle {index} holds {} bytes, more than a page ({})",
                    loc.size_bytes, self.page_size_bytes
                )));
            }
            if loc.size_bytes > POOL_PAGE_BYTES {
                let rec = span_records.get(&loc.zspage).ok_or_else(|| {
                    corrupt(format!(
                        "handle {index} names span {}, which no frame holds",
                        loc.zspage
                    ))
                })?;
                let (pages, tail) = span::split(loc.size_bytes, self.table.huge_class_size_bytes());
                if pages != rec.pages || (tail != 0) != (rec.tail_raw != 0) || loc.obj != 0 {
                    return Err(corrupt(format!(
                        "handle {index} ({} bytes) does not fit span {} of {} pages",
                        loc.size_bytes, loc.zspage, rec.pages
                    )));
                }
                if let Some(other) = span_handles.insert(loc.zspage, index) {
                    return Err(corrupt(format!(
                        "handles {other} and {index} both name span {}",
                        loc.zspage
                    )));
                }
            } else {
                let c = self.table.class_of(loc.size_bytes);
                if zspage_frames[c]
                    .get(loc.zspage as usize)
                    .copied()
                    .unwrap_or(NO_FRAME)
                    == NO_FRAME
                {
                    return Err(corrupt(format!(
                        "handle {index} names zspage {} of class {c}, which no frame holds",
                        loc.zspage
                    )));
                }
                if loc.obj as usize >= self.classes[c].info.objs_per_zspage {
                    return Err(corrupt(format!(
                        "handle {index} names object {} of a zspage of {} objects",
                        loc.obj, self.classes[c].info.objs_per_zspage
                    )));
                }
                objects[c].push((loc.zspage, loc.obj, index));
            }
            live.push((index, loc));
        }
        for (c, objs) in objects.iter_mut().enumerate() {
            objs.sort_unstable();
            if let Some(w) = objs
                .windows(2)
                .find(|w| (w[0].0, w[0].1) == (w[1].0, w[1].1))
            {
                return Err(corrupt(format!(
                    "handles {} and {} both name object {} of zspage {} of class {c}",
                    w[0].2, w[1].2, w[0].1, w[0].0
                )));
            }
        }
        // 3. What is kept: wanted objects, and the tails of wanted spans.
        let mut keep = vec![false; indices as usize];
        for &(index, _) in &live {
            keep[index as usize] = wanted(index);
        }
        for &(index, loc) in &live {
            if !keep[index as usize] || loc.size_bytes <= POOL_PAGE_BYTES {
                continue;
            }
            let rec = &span_records[&loc.zspage];
            if rec.tail_raw == 0 {
                continue;
            }
            let tail = Handle::from_raw(rec.tail_raw).expect("nonzero");
            let tail_bytes = loc.size_bytes % POOL_PAGE_BYTES;
            let ok = u64::from(tail.index()) < indices
                && Location::decode(self.handles.word_at(tail.index()).load(Ordering::Acquire))
                    .is_some_and(|t| t.size_bytes == tail_bytes);
            if !ok {
                return Err(corrupt(format!(
                    "span {} (handle {index}) has tail handle {}, which does not hold its \
                     {tail_bytes} tail bytes",
                    loc.zspage,
                    tail.index()
                )));
            }
            if keep[tail.index() as usize] {
                return Err(corrupt(format!(
                    "handle {} is both span {}'s tail and wanted on its own (or another span's tail)",
                    tail.index(),
                    loc.zspage
                )));
            }
            keep[tail.index() as usize] = true;
        }
        // 4. Garbage: cleared before any record goes.
        let mut report = RestoreReport::default();
        for &(index, _) in &live {
            if keep[index as usize] {
                report.objects += 1;
            } else {
                self.handles.word_at(index).store(0, Ordering::Release);
                free_indices.push(index);
                report.garbage += 1;
            }
        }
        // 5. Zspages and spans that keep an object.
        let mut claimed: Vec<u32> = Vec::new();
        let mut total_pages = 0u64;
        let mut free_by_class: Vec<Vec<u32>> = vec![Vec::new(); self.classes.len()];
        free_indices.sort_unstable();
        for (n, index) in free_indices.into_iter().rev().enumerate() {
            free_by_class[n % self.classes.len()].push(index);
        }
        for (c, class) in self.classes.iter().enumerate() {
            let mut zspages = Vec::new();
            for run in objects[c].chunk_by(|a, b| a.0 == b.0) {
                let id = run[0].0;
                let used: Vec<(u32, u32)> = run
                    .iter()
                    .filter(|&&(_, _, h)| keep[h as usize])
                    .map(|&(_, obj, h)| (obj, h))
                    .collect();
                if used.is_empty() {
                    continue;
                }
                let frame_index = zspage_frames[c][id as usize];
                claimed.push(frame_index);
                zspages.push((id, frames.claim(frame_index), used));
            }
            report.zspages += zspages.len() as u64;
            total_pages += (zspages.len() * class.info.pages_per_zspage) as u64;
            let mut st = class.state.lock();
            class.restore(&mut st, zspages, std::mem::take(&mut free_by_class[c]));
        }
        {
            let mut st = self.spans.state.lock();
            for (&id, &index) in &span_handles {
                if !keep[index as usize] {
                    continue;
                }
                let rec = &span_records[&id];
                claimed.push(rec.frame);
                let tail = Handle::from_raw(rec.tail_raw);
                *self.spans.descs.get_or_grow(u64::from(id)).write() = Some(SpanObj {
                    frame: frames.claim(rec.frame),
                    pages: rec.pages,
                    tail,
                });
                let loc = Location::decode(self.handles.word_at(index).load(Ordering::Relaxed))
                    .expect("kept handles are live");
                st.spans += 1;
                st.pages += rec.pages as u64;
                if tail.is_some() {
                    st.tails += 1;
                    st.tail_bytes += (loc.size_bytes - rec.pages * POOL_PAGE_BYTES) as u64;
                }
                st.next_id = st.next_id.max(id + 1);
                total_pages += rec.pages as u64;
                report.spans += 1;
            }
            for id in (0..st.next_id).rev() {
                if self.spans.descs.get_or_grow(u64::from(id)).read().is_none() {
                    st.free_ids.push(id);
                }
            }
        }
        claimed.sort_unstable();
        if self.shared_frames {
            // The other pools' recoveries claim theirs; the reserve's recovery releases the
            // rest when it finishes.
            frames.add_claimed(&claimed)?;
        } else {
            frames.release_unclaimed(&claimed)?;
        }
        self.total_pages.store(total_pages, Ordering::Relaxed);
        Ok(report)
    }

    /// Whether `h` names a live object of this pool (recovery's check of a slot's handle).
    pub fn is_live(&self, h: Handle) -> bool {
        u64::from(h.index()) < self.handles.indices()
            && self.handles.word_at(h.index()).load(Ordering::Acquire) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::super::record::FrameUse;
    use super::*;

    /// An incompressible page's zspage sits in a single-page frame, which a new process finds
    /// again; a record naming a zspage of several pages in such a frame refuses the pool
    /// (claiming it would hand out a frame shorter than its zspage).
    #[test]
    fn a_zspage_recorded_in_a_frame_too_small_for_it_is_refused() {
        let pool = ZsPool::new(4096).unwrap();
        let h = pool.malloc(4096).unwrap();
        pool.write(h, &[7u8; 4096]);
        let frames = &pool.core.frames;
        let index = (0..frames.carved_frames())
            .find(|&i| frames.record(i).what.load(Ordering::Relaxed) != 0)
            .unwrap();
        assert_eq!(frames.frame_pages_of(index), 1);
        let record = frames.record(index);
        let (what, extra) = (
            record.what.load(Ordering::Relaxed),
            record.extra.load(Ordering::Relaxed),
        );
        let Some((tag, FrameUse::Zspage { id, .. })) = FrameUse::decode(what, extra).unwrap()
        else {
            panic!("a zspage's record");
        };
        let multi = pool
            .core
            .classes
            .iter()
            .position(|c| c.info.pages_per_zspage > 1)
            .unwrap();
        let (bad, bad_extra) = FrameUse::Zspage {
            class: multi as u32,
            id,
        }
        .encode(tag);
        record.extra.store(bad_extra, Ordering::Relaxed);
        record.what.store(bad, Ordering::Relaxed);
        let Err(err) = ZsPool::restore(4096, None, pool.files().unwrap(), None, &|_| true) else {
            panic!("restored a zspage into a frame too small for it");
        };
        assert!(err.to_string().contains("has room for 1"), "{err}");
    }
}
