//! Raw pages: reserved address space carved into zspage frames.
//!
//! This is one of the two modules of `zsmalloc` allowed to use `unsafe` (with `zspage`): it
//! calls `mmap`, `madvise`, `munmap` and `mincore`, and turns frame addresses into byte slices.
//!
//! # Why frames
//!
//! A zspage is 1–8 *contiguous* pages, so an object never straddles two mappings and can be
//! handed to the caller as one slice. Mapping each zspage separately would create one VMA per
//! zspage and hit `vm.max_map_count` (65530 by default) at a few hundred MiB. Instead the frames
//! live in one memfd (`crate::shm`, so they outlive the process: `docs/restart.md`), mapped in
//! chunks of [`CHUNK_BYTES`] with one `mmap(PROT_READ|PROT_WRITE, MAP_SHARED|MAP_NORESERVE)`
//! each at consecutive offsets of the file, and cut every
//! chunk into *frames* of `MAX_PAGES_PER_ZSPAGE` pages (or more: a pool for 16 or 64 KiB device
//! pages makes frames of a device page, so a *span*, an object larger than a page stored on whole
//! pages, fits one; see `span`). A zspage of `k` pages owns one frame and touches only its first
//! `k` pages; the untouched tail costs address space, not memory.
//!
//! # Life of a frame
//!
//! [`FrameAllocator::alloc`] pops a free frame or carves the next one from the newest chunk
//! (mapping a new chunk when it is used up). [`FrameAllocator::release`] consumes the [`Frame`]
//! token and keeps the frame resident in a small cache, or punches the pages the zspage used out
//! of the file (the next touch faults in a zero page) and puts the frame on the free list.
//! Chunks are unmapped only when the allocator drops.
//!
//! A frame's *index* numbers it in the order of the chunks (each chunk's frames follow the
//! previous chunk's), the same in every process that maps the file. Each frame has a 16-byte
//! *record* in a second memfd, written by the pool when it gives the frame a zspage or a span
//! and cleared when it takes it back ([`FrameAllocator::set_record`]): what a new process needs
//! to find, from a location word, the frame holding the object (`docs/restart.md`).
//!
//! # Single-page frames
//!
//! Zspages of one page (the huge class: every incompressible page) and one-page spans get
//! frames of one page, carved from chunks of their own; every other page count gets a full
//! frame. A process pays a page-table page for each 2 MiB of address space it touches, and the
//! kernel does not free it while the mapping lives: with full frames only, each stored
//! incompressible page made a 32 KiB (64 KiB when serving swap) frame resident for 4 KiB,
//! so page tables grew by 1/64 (1/32) of a page per such page, against 1/512 for dense pages:
//! 8.6 MB for 360 MB stored in a 512 MiB guest swapping a hog whose pages were a third random. Single-page chunks pack those
//! pages as densely as the kernel's own page tables do.
//!
//! Every chunk is [`chunk_stride_bytes`](FrameAllocator) long in the file, at `chunk number ×
//! stride`, whatever its kind; its kind is a byte of the *chunk kinds' table* after the
//! records, written before the file grows to hold the chunk, so a new process cuts every chunk
//! as its maker did. A records' file without that table (written before chunks had kinds)
//! has full chunks only, and an allocator recovered from it adds full chunks only.
//!
//! # The reserve
//!
//! A new zspage's pages are fresh pages of the frames' file: allocated, zeroed and charged to
//! the cgroup on first touch, work the kernel's zsmalloc (taking pages from the buddy allocator's
//! free lists) does not do on the store path. So the pool keeps a *reserve*: frames whose first
//! `k` pages are already faulted in, `reserve[k]` by page count, filled by a background thread
//! (the *refiller*, `uzram-zs-reserve`) off the writers' path. A new zspage takes, in order, a
//! frame of its page count from the frame cache, one from the reserve, else a fresh frame it
//! faults in itself. One design serves two needs, by each list's *target* (frames) and *low
//! mark* (the refiller is woken when a list holds no more than that):
//!
//! - **Speed** (every pool, [`FrameAllocator::with_reserve`]): [`FRAME_RESERVE_PAGES`] pages
//!   per page count, only for page counts that were asked for, woken at half; the refiller is
//!   spawned on demand and exits after [`REFILLER_IDLE`] without work (a device that stopped
//!   growing keeps no thread), and compaction's [`FrameAllocator::trim`] empties the reserve.
//! - **Swap** (`uzram serve --swap`, [`FrameAllocator::set_reserve`]): a server backing swap
//!   stores the pages the kernel writes out to free memory, so a request must not wait for
//!   memory: its page faults would enter direct reclaim, which (the server being an I/O
//!   flusher, `PF_MEMALLOC_NOIO`) cannot swap anything out, and wait for the very writes it is
//!   serving (seen in a VM: both queue threads looping in `try_to_free_pages` under
//!   `madvise(MADV_POPULATE_WRITE)` of a new zspage, kswapd and the memory hog waiting in
//!   `mempool_alloc` for swap bios that never completed). So one allocator serves every pool
//!   of the server (`crate::memory::SwapReserve`), with a reserve of `--swap-reserve` worth of
//!   pages, faulted in before the pools serve, never trimmed; a zspage takes a frame of its
//!   page count, else a *larger* one (the extra pages are dropped: that needs no memory).
//!   When the reserve has none, the writer wakes the refiller and waits for it at most
//!   [`SWAP_MISS_WAIT`], then fails (`ENOMEM`, as zram's write when zsmalloc gets no page: the
//!   kernel keeps the page); counted. Frames released by emptied zspages go back to the
//!   reserve first. The refiller (one thread for the server, never exits) keeps the reserve
//!   between watermarks that follow the write rate ([`SwapMarks`]). It is the one thread that
//!   waits for memory, and the one that is not an I/O flusher ([`leave_io_flusher`]): its
//!   reclaim swaps pages out like any process's (to the queue threads, which store them from
//!   the reserve) and, when nothing is left to reclaim, calls the OOM killer. Pages are faulted
//!   in by touching them, not by `MADV_POPULATE_WRITE` (which holds the mmap lock a request
//!   thread's `mmap` then waits for). It runs under `SCHED_DEADLINE` where the kernel allows
//!   ([`set_refiller_deadline`]): its faults may then take pages below the `min` watermark,
//!   where the processes filling memory stop, so the pages swap-outs free reach the reserve
//!   first (without it, the refiller lost that race and the reserve starved long before memory
//!   ran out). And before it takes fresh pages it compacts the pools sharing the reserve
//!   ([`Shrinker`], as reclaim calls the kernel's zsmalloc shrinker): emptied zspages' frames
//!   come back to the reserve without asking the kernel for anything.
//!
//! # Locked memory
//!
//! A server backing swap locks its memory (`uzram serve --swap`: `mlockall(MCL_FUTURE |
//! MCL_ONFAULT)`, see `frontend::swap`), so every chunk mapped afterwards is locked, page by page
//! as it is touched. Pages are given back by punching a hole in the file
//! (`fallocate(PUNCH_HOLE)`), which frees them whether or not a mapping locks them, and leaves
//! the lock in place: the range stays "locked on fault", so the frame's next zspage is locked
//! as its pages are faulted in again. No VMA changes. (`MADV_DONTNEED` would only unmap a
//! shared file's pages, and `MADV_REMOVE` refuses a locked range.)
//!
//! # Ownership
//!
//! A [`Frame`] is an owned, non-`Copy` token: whoever holds it (a zspage descriptor, under its
//! migrate lock) is the only one who can hand out slices into it, and slices borrow the token,
//! so a frame cannot be released while any slice into it is alive. Which thread may touch which
//! bytes of a frame is decided by the zspage protocol (see `zspage`): shared borrows read,
//! exclusive borrows write, and the one exception, [`Frame::reserved_slot_mut`], is `unsafe`.

#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

use super::size_class::MAX_PAGES_PER_ZSPAGE;
use crate::error::{Error, Result};
use crate::shm::{ShmFile, ShmMap};

/// Address space reserved per `mmap`: 128 MiB, i.e. 4096 frames of 8 4-KiB pages, 1024 frames
/// for 16 KiB pages, 256 for 64 KiB. Big enough that the chunk count stays small (a 64 GiB pool
/// is 512 VMAs), small enough that even strict overcommit accounting of a fresh chunk is cheap.
pub(crate) const CHUNK_BYTES: usize = 128 << 20;

/// Most chunks an allocator maps (16 TiB of frames' file at [`CHUNK_BYTES`]): the size of the
/// chunk kinds' table in the records' file.
pub(crate) const MAX_CHUNKS: usize = 1 << 17;

/// A chunk's kind, in the records' file's kind table: frames of the allocator's frame size
/// (the zero a new file reads as)...
const CHUNK_FULL: u8 = 0;
/// ...or single-page frames, for zspages (and spans) of one page.
const CHUNK_SMALL: u8 = 1;

/// One frame of address space, owned by at most one zspage. See the module docs.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Frame {
    base: NonNull<u8>,
    len_bytes: usize,
    /// The frame's number, which its record is kept under (module docs, "Life of a frame").
    index: u32,
    /// The frame's place in the frames' file.
    offset: u64,
}

// SAFETY: a `Frame` is the address of memory owned by its `FrameAllocator` (which outlives every
// frame: the pool owns both and drops frames' owners first). Moving the token to another thread
// moves nothing but the address; all byte access goes through borrows of the token.
unsafe impl Send for Frame {}
// SAFETY: `&Frame` only allows reading through `bytes` (sound while no `&mut` to the same bytes
// exists, which `&mut Frame` and the contract of `reserved_slot_mut` ensure).
unsafe impl Sync for Frame {}

impl Frame {
    /// The frame's base address.
    #[cfg(test)]
    pub(crate) fn addr(&self) -> usize {
        self.base.as_ptr() as usize
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.len_bytes),
            "frame access {offset}+{len} beyond {} bytes",
            self.len_bytes
        );
    }

    /// Bytes `[offset, offset + len)` of the frame.
    pub(crate) fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        self.check(offset, len);
        // SAFETY: the range is inside the frame (checked above), which is inside a live mapping
        // (chunks are unmapped only when the allocator drops, after every frame's owner). The
        // memory is a shared mapping of the frames' memfd, always initialised (zeroes where a
        // page was never written or was punched out, else written bytes). No `&mut`
        // aliases it: mutable slices come from `&mut Frame` (excluded by this shared borrow) or
        // from `reserved_slot_mut`, whose callers guarantee nobody reads that slot.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset), len) }
    }

    /// Bytes `[offset, offset + len)` of the frame, writable.
    pub(crate) fn bytes_mut(&mut self, offset: usize, len: usize) -> &mut [u8] {
        self.check(offset, len);
        // SAFETY: in bounds of a live, initialised mapping as in `bytes`; the exclusive borrow of
        // the token excludes every other slice into this frame for the returned lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), len) }
    }

    /// Bytes `[offset, offset + len)` writable through a shared borrow: compaction copies an
    /// object into a free slot of a zspage whose other objects are being read concurrently.
    ///
    /// # Safety
    ///
    /// For the returned lifetime no other slice (shared or mutable) into this range may exist:
    /// the caller owns the range (a free slot it reserved under its class lock, which no handle
    /// points to yet, so no reader or writer can reach it).
    // A `&mut` from `&self` is the point: the slot's exclusivity comes from the caller's
    // reservation, not from the borrow (stated in the safety contract).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn reserved_slot_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        self.check(offset, len);
        // SAFETY: in bounds of a live, initialised mapping as in `bytes`; the caller guarantees
        // that nothing else accesses this range while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), len) }
    }
}

/// One reserved chunk of address space: frames `first_index..first_index + frames`, all of
/// one kind, at file offset `chunk number * chunk_stride_bytes`.
#[derive(Debug)]
struct Chunk {
    map: ShmMap,
    small: bool,
    first_index: u32,
    frames: u32,
}

impl Chunk {
    fn base(&self) -> NonNull<u8> {
        self.map.base()
    }
}

#[derive(Debug)]
struct FrameState {
    chunks: Vec<Chunk>,
    /// The memfd the chunks map, made with the first chunk.
    file: Option<Arc<ShmFile>>,
    /// Frames released and not yet reused (their pages were punched out, or, if the kernel
    /// refused, kept: see [`FrameAllocator::discard`]), by frame number (4 bytes each, a
    /// frame's token being made again from its chunk when it is taken); `free[1]` single-page
    /// frames, `free[0]` the others.
    free: [Vec<u32>; 2],
    /// Released frames kept resident for reuse, by the number of pages their zspage used (the
    /// only pages of the frame that can be resident): `cached[k]` holds frames with `k` pages
    /// (`k <= frame_pages`).
    cached: Vec<Vec<Frame>>,
    /// Sum of the pages of the frames in `cached` (at most `cache_limit_pages`).
    cached_pages: usize,
    /// Released frames the cache had no room for, still resident, waiting to be dropped
    /// together once they hold [`DROP_BATCH_PAGES`] (see there).
    dropping_batch: Vec<(Frame, usize)>,
    /// Sum of the pages of the frames in `dropping_batch` (below `DROP_BATCH_PAGES`).
    dropping_batch_pages: usize,
    /// Per kind (`[full, small]`): the chunk frames are carved from (the last one made of that
    /// kind, while it has uncarved frames) and how many it has handed out so far.
    carving: [Option<(usize, usize)>; 2],
    /// Frame numbers given to the chunks made so far (the next chunk's first).
    next_index: u32,
    /// The reserve (module docs): fresh frames whose first `k` pages are faulted in,
    /// `reserve[k]`, at most `reserve_target[k]` each.
    reserve: Vec<Vec<Frame>>,
    /// Frames `reserve[k]` holds when full.
    reserve_target: Vec<usize>,
    /// `reserve[k]` is refilled once it holds no more than `reserve_low[k]` frames.
    reserve_low: Vec<usize>,
    /// Serving swap ([`FrameAllocator::set_reserve`]): the reserve is never trimmed, the
    /// refiller never exits idle, a zspage may take a larger reserve frame, an allocation the
    /// reserve cannot serve fails at once, and released frames go back to the reserve.
    reserve_resident: bool,
    /// Serving swap: the watermarks and counters of the reserve ([`SwapMarks`]).
    swap: SwapMarks,
    /// Sum of the pages of the frames in `reserve`.
    reserve_pages: usize,
    /// Bit `k`: `reserve[k]` is below its target and the refiller should fill it.
    refill_wanted: u64,
    /// Bumped by [`FrameAllocator::trim`]: a frame the refiller populated under an older epoch
    /// is discarded instead of joining the reserve (so a trim really empties it).
    reserve_epoch: u64,
    /// The refiller must exit ([`FrameAllocator::stop_refiller`]).
    refill_stop: bool,
    /// Tests: the swap refiller keeps running but adds nothing (a refiller stuck in reclaim).
    refill_paused: bool,
    /// A refiller thread is running (or being spawned). It clears this itself, under this
    /// mutex, when it exits after [`REFILLER_IDLE`] without work, so a writer that finds it
    /// false spawns a new one and no wake-up is lost.
    refiller_running: bool,
}

/// A hook: [`FrameAllocator::on_starved`]'s, and the tests' inside the making of a chunk.
struct Hook(Box<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hook")
    }
}

/// Hands out frames of `frame_pages` pages (at least `MAX_PAGES_PER_ZSPAGE`); see the module
/// docs.
#[derive(Debug)]
pub(crate) struct FrameAllocator {
    page_size_bytes: usize,
    /// Pages per frame: the most a zspage or a span may use.
    frame_pages: usize,
    /// `frame_pages * page_size`, rounded up to the system page size (so `madvise` never
    /// reaches into a neighbouring frame).
    frame_bytes: usize,
    frames_per_chunk: usize,
    /// Bytes of the frames' file per chunk (`frames_per_chunk * frame_bytes`): chunk `c` of
    /// either kind starts at `c * chunk_stride_bytes`.
    chunk_stride_bytes: usize,
    /// Whether zspages and spans of one page get single-page frames of their own chunks
    /// (module docs, "Single-page frames"): not for frames of one page already, nor for the
    /// files of a process whose records' file has no chunk kinds' table.
    small_frames: bool,
    /// Bytes of a single-page frame: a page, rounded up to the system page size.
    small_frame_bytes: usize,
    sys_page_bytes: usize,
    /// Protects the chunk list, the free list and the carving cursor. Nothing that may wait
    /// for memory (a fault, a mapping) is done under it: writers serving swap take it.
    state: Mutex<FrameState>,
    /// Held by the one thread making a new chunk (mapping it, faulting its records in),
    /// outside `state`; chunks are added under it only.
    grow: Mutex<()>,
    /// Tests: called while a chunk is being made, after its mapping and before it is added.
    #[cfg(test)]
    grow_hook: Mutex<Option<Hook>>,
    /// Whether the kernel accepts `MADV_POPULATE_WRITE` (cleared on the first `EINVAL`).
    populate: AtomicBool,
    /// Serving swap: pages are faulted in by touching them, never by `MADV_POPULATE_WRITE`
    /// (set by [`set_reserve`](FrameAllocator::set_reserve)).
    touch_only: AtomicBool,
    /// The frame records (module docs), made with the first chunk.
    records: OnceLock<FrameRecords>,
    /// Most pages the frame cache keeps resident ([`FRAME_CACHE_BYTES`] worth).
    cache_limit_pages: usize,
    /// Released frames beyond the cache are dropped once this many pages wait
    /// ([`DROP_BATCH_PAGES`] for the pool's allocator, 1, i.e. at once, by default).
    drop_batch_pages: usize,
    /// Whether [`alloc_populated`](FrameAllocator::alloc_populated) keeps a reserve filled by
    /// a background thread (the pool's allocator does; the unit tests' allocators do not).
    reserve_enabled: bool,
    /// Signals the refiller (with `state`): a reserve list fell below half its target, or stop.
    refill_cond: Condvar,
    /// Serving swap: signals writers waiting for a frame of the reserve (with `state`): the
    /// refiller added one, or stops.
    reserve_cond: Condvar,
    /// Serving swap: called by a writer whose allocation failed when the reserve has gained no
    /// frame for [`SWAP_STARVED`] (at most once per that time).
    starved: std::sync::OnceLock<Hook>,
    /// Serving swap: called by the refiller every [`SWAP_TICK`], no lock held
    /// ([`FrameAllocator::on_refill_tick`]).
    tick_hook: std::sync::OnceLock<Hook>,
    /// Serving swap: the pools taking frames from this allocator, which the refiller compacts
    /// before it takes fresh pages ([`Shrinker`]); dead ones are dropped as they are found.
    shrinkers: Mutex<Vec<std::sync::Weak<dyn Shrinker>>>,
    /// Serving swap: whether the refiller runs under `SCHED_DEADLINE` (set once, by the
    /// refiller; the error number of the refusal otherwise).
    refiller_deadline: OnceLock<std::result::Result<(), i32>>,
    /// The last refiller thread spawned, joined by `stop_refiller` (or by the next spawn).
    refiller: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The record tags of the pools sharing this allocator (`record`, "pool tag"), in use now.
    pool_tags: Mutex<std::collections::BTreeSet<u16>>,
    /// A shared allocator being recovered (`SwapReserve::recover`): the frames its pools'
    /// recoveries claimed so far; `None` once recovery is finished (or for any other
    /// allocator).
    recovering: Mutex<Option<Vec<u32>>>,
}

/// Pages the reserve keeps populated per zspage size (per page count `k`): 64 pages, 256 KiB,
/// i.e. 64 zspages of one page, 16 of four. At most 2 MiB over the eight sizes of 4 KiB-page
/// pools (4 MiB over the sixteen page counts spans use in 64 KiB-page pools), and only sizes that
/// were asked for are refilled. Why it exists: on a fresh device each new zspage's pages are
/// fresh pages of the frames' file, faulted in, zeroed and charged to the cgroup
/// (`MADV_POPULATE_WRITE`), a fifth of the store path's CPU time on the corpus
/// (bench/notes.md); the kernel's zsmalloc
/// takes pages from the buddy allocator's free lists instead. The reserve moves that work to a
/// background thread, off the writer's path. Why 64: a writer on this machine allocates about
/// 30,000 pool pages a second (1 GB/s of pages at a 2.7 compression ratio spread over the
/// sizes, see `uzram bench store`), the refiller populates several hundred thousand pages a
/// second, and it is woken when a list falls to half: 32 pages are about a millisecond of one
/// size's demand, longer than a wake-up takes even on the loaded 2-core machine, and the bound
/// on resident memory stays that of the frame cache.
pub(crate) const FRAME_RESERVE_PAGES: usize = 64;

/// The refiller exits after this long without work (a device that stopped growing keeps no
/// thread) and is spawned again by the next allocation that wants the reserve refilled.
const REFILLER_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

/// What an allocation asks of the refiller (ordered: the stronger wins).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Wake {
    No,
    Signal,
    Spawn,
}

/// A pool sharing the swap reserve ([`FrameAllocator::add_shrinker`]). It can give frames back
/// by compacting itself: the kernel's zsmalloc registers a shrinker that reclaim calls; the
/// refiller asks every pool sharing the reserve before it takes fresh pages from the kernel.
/// And the refiller keeps the pool's other memory ahead of need (its handle table's words).
pub(crate) trait Shrinker: Send + Sync {
    /// Pages compaction could free now (the sum of `zs_can_compact` over the classes).
    fn freeable_pages(&self) -> u64;
    /// Compacts the classes that can free a zspage; returns the pages freed.
    fn shrink(&self) -> u64;
    /// Faults in what the pool's writers will need next, outside the reserve's frames (the
    /// handle table's words: `handle`, "Serving swap"); at a `tick`, the amount follows the
    /// pool's use since the last. Called by the refiller only, no lock held.
    fn keep_ahead(&self, tick: bool);
}

/// Serving swap, the refiller compacts a pool only when compaction could free at least this
/// many pages (512 KiB): below that a compaction costs more than the pages it gives back.
const SHRINK_MIN_PAGES: u64 = 128;

/// Serving swap, the refiller runs under `SCHED_DEADLINE` with this much CPU time...
const REFILL_RUNTIME_NS: u64 = 10_000_000;
/// ... in every period of this length (a third of a CPU at most).
const REFILL_PERIOD_NS: u64 = 30_000_000;

/// `SCHED_DEADLINE` from `include/uapi/linux/sched.h`.
const SCHED_DEADLINE: u32 = 6;

/// `struct sched_attr` of `sched_setattr(2)` (its first version, 48 bytes).
#[repr(C)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime_ns: u64,
    deadline_ns: u64,
    period_ns: u64,
}

/// Puts the calling thread under `SCHED_DEADLINE` ([`REFILL_RUNTIME_NS`] per
/// [`REFILL_PERIOD_NS`]); the error number when the kernel refuses (`EPERM` without
/// `CAP_SYS_NICE`, `EBUSY` when the CPUs' deadline bandwidth is taken).
///
/// Why: the page allocator lets real-time and deadline tasks take pages down to half of each
/// zone's `min` watermark (`ALLOC_MIN_RESERVE` in `gfp_to_alloc_flags`), where every other
/// process's page fault stops and reclaims. So under memory pressure the refiller gets the
/// pages that swap-outs free ahead of the processes filling memory, as kernel zram's
/// allocations from the reclaimer's own context (`PF_MEMALLOC`) do. Its bandwidth is bounded,
/// so a refiller that reclaims (or compacts) never starves the queue threads or a process the
/// OOM killer chose.
fn set_refiller_deadline() -> std::result::Result<(), i32> {
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: SCHED_DEADLINE,
        flags: 0,
        nice: 0,
        priority: 0,
        runtime_ns: REFILL_RUNTIME_NS,
        deadline_ns: REFILL_PERIOD_NS,
        period_ns: REFILL_PERIOD_NS,
    };
    // SAFETY: sched_setattr reads one `struct sched_attr` of `attr.size` bytes through the
    // pointer, which points at `attr` (laid out as the kernel's first version, `repr(C)`);
    // pid 0 is the calling thread.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL))
    }
}

/// How often the swap refiller looks at the write rate and moves its watermarks.
const SWAP_TICK: std::time::Duration = std::time::Duration::from_millis(100);

/// The swap reserve's watermarks and counters (under the allocator's state mutex), as the
/// kernel's kswapd keeps free pages between its `min`/`low`/`high` marks:
///
/// - `high_pages`: the reserve's size (`uzram serve --swap-reserve`); the refiller, once woken,
///   fills the reserve to it and stops.
/// - `low_pages`: the refiller is woken when the reserve holds no more than this (or a list a
///   zspage asked for is empty). It follows the write rate: every [`SWAP_TICK`] it becomes
///   [`SWAP_LOW_TICKS`] ticks' worth of the pages taken in the last one, between an eighth and
///   three quarters of `high_pages`; so a burst wakes the refiller early, a trickle seldom.
/// - per page count `k`, `reserve_target[k]` frames: a quarter of `high_pages` shared evenly
///   by the page counts in use, the rest in proportion to what each was asked for lately.
///
/// An allocation the reserve cannot serve waits for the refiller at most [`SWAP_MISS_WAIT`],
/// then fails (counted in `misses`); it never faults a frame in itself.
#[derive(Debug)]
struct SwapMarks {
    high_pages: usize,
    low_pages: usize,
    /// Pages taken from the reserve, ever.
    taken_pages: u64,
    /// Allocations the reserve had no frame for at once (each waited for the refiller, at
    /// most [`SWAP_MISS_WAIT`], then failed: zram's `failed_writes`), ever.
    misses: u64,
    /// Pages asked for by page count since the last tick (taken or refused).
    asked_pages: Vec<u64>,
    /// Pages asked for by page count, decayed by half every tick.
    demand_pages: Vec<u64>,
    /// Page counts the reserve serves (those of the pool's classes, and any asked for since).
    in_use: Vec<bool>,
    /// A writer asked the refiller to run (cleared by the refiller when it starts filling).
    kicked: bool,
    /// A writer asked the refiller to keep the pools' other memory ahead of need
    /// ([`Shrinker::keep_ahead`]) now rather than at its next tick.
    ahead_wanted: bool,
    /// When the reserve last gained a frame (refilled or released into it).
    added_at: std::time::Instant,
    /// When a writer last called the starved hook ([`FrameAllocator::on_starved`]).
    starved_at: Option<std::time::Instant>,
}

/// Serving swap, the longest a writer waits for the refiller when the reserve has no frame
/// for it, before its write fails (`ENOMEM`): long enough for a refiller that is merely late
/// (woken at the low mark, faulting pages in); short, because when memory has run out the
/// refiller's own reclaim waits for swap-outs, hence for this writer (seen in the VM: at 1 s
/// the queue served one request a second, the refiller and kswapd waiting for bios that only
/// its completions free, the hog stopped); failing instead completes the request, and the
/// refiller's reclaim, making no progress, ends in the OOM killer as the kernel's zram does.
const SWAP_MISS_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Serving swap: a reserve that has gained no frame for this long while writers fail is
/// starved (see [`FrameAllocator::on_starved`]).
const SWAP_STARVED: std::time::Duration = std::time::Duration::from_secs(10);

/// The low mark is this many ticks of the last tick's consumption (see [`SwapMarks`]).
const SWAP_LOW_TICKS: usize = 4;

impl SwapMarks {
    fn new(frame_pages: usize) -> SwapMarks {
        SwapMarks {
            high_pages: 0,
            low_pages: 0,
            taken_pages: 0,
            misses: 0,
            asked_pages: vec![0; frame_pages + 1],
            demand_pages: vec![0; frame_pages + 1],
            in_use: vec![false; frame_pages + 1],
            kicked: false,
            ahead_wanted: false,
            added_at: std::time::Instant::now(),
            starved_at: None,
        }
    }
}

/// What the swap reserve holds and has done (a snapshot: [`FrameAllocator::swap_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwapReserveStats {
    /// Pool pages (4 KiB) faulted in and waiting in the reserve now.
    pub held_pages: u64,
    /// The reserve's size, in pool pages (its high mark).
    pub high_pages: u64,
    /// Its low mark now: the refiller is woken at or below it.
    pub low_pages: u64,
    /// Pages taken from the reserve, ever.
    pub taken_pages: u64,
    /// Allocations the reserve had no frame for at once, or whose pool had no handle word
    /// faulted in ahead of need, ever: each waited for the refiller (at most a tenth of a
    /// second), and failed (`ENOMEM`) if it brought none.
    pub misses: u64,
}

/// `PR_SET_IO_FLUSHER` from `include/uapi/linux/prctl.h` (the libc crate has it only for
/// Android).
const PR_SET_IO_FLUSHER: libc::c_int = 57;

/// Clears the calling thread's I/O-flusher mark (`PF_MEMALLOC_NOIO`), which a server backing
/// swap sets before it starts its threads, so they inherit it. The swap refiller is the one
/// thread that should not have it: its page faults then reclaim as any process's do, swapping
/// pages out (to the queue threads, which store them from the reserve, never from this thread)
/// and calling the OOM killer when nothing is left to reclaim, where with the mark they could
/// only drop clean pages and retry forever (the kernel does not OOM-kill for an allocation
/// without `__GFP_FS`). Without `CAP_SYS_RESOURCE` (or the mark) this changes nothing.
fn leave_io_flusher() {
    // SAFETY: prctl with PR_SET_IO_FLUSHER takes integer arguments only; it changes the
    // calling thread's flags.
    unsafe { libc::prctl(PR_SET_IO_FLUSHER, 0 as libc::c_ulong, 0, 0, 0) };
}

/// Marks the calling thread an I/O flusher again, whether or not it was one: returns whether
/// the kernel agreed (it needs `CAP_SYS_RESOURCE`). The swap refiller does so while it
/// compacts ([`FrameAllocator::shrink_pools`]): compaction holds class locks, and a page
/// fault under one (malloc growing a list) must not reclaim by swapping out to the queue
/// threads that wait for that lock.
fn enter_io_flusher() -> bool {
    // SAFETY: prctl with PR_SET_IO_FLUSHER takes integer arguments only; it changes the
    // calling thread's flags.
    unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1 as libc::c_ulong, 0, 0, 0) == 0 }
}

/// Frames `reserve[k]` holds when full, for speed ([`FRAME_RESERVE_PAGES`]).
fn reserve_target_frames(k: usize) -> usize {
    (FRAME_RESERVE_PAGES / k).max(1)
}

/// Resident memory the frame cache may hold: 2 MiB (512 pages of 4 KiB, 128 of 16 KiB, 32 of
/// 64 KiB). When objects are overwritten, zspages empty and new ones are needed at about the same
/// rate; keeping a few emptied frames resident saves a `madvise` and a page fault, zeroing and
/// cgroup charge per page, the price of fresh memory that the kernel's zsmalloc (which
/// takes pages from the buddy allocator's free lists) does not pay. The cache is bounded so the
/// pool's resident set stays within 2 MiB of `mem_used_total`, and [`FrameAllocator::trim`]
/// (called by compaction) empties it.
pub(crate) const FRAME_CACHE_BYTES: usize = 2 << 20;

/// Released frames the frame cache has no room for are dropped from the resident set in
/// batches of this many pages (1 MiB of 4 KiB pages), sorted by address, with one `madvise` per
/// range of adjacent frames rather than one per zspage. Each hole punched in the frames' file
/// unmaps the pages from the process's page tables and flushes the TLB of every CPU running the
/// process (an IPI), as `madvise(MADV_DONTNEED)` did, which made it about 90% of the cost of a
/// free that empties a zspage (`bench/notes.md`, "Releasing pages"); a batch pays the flush
/// once per range.
/// Frames are carved in address order, so zspages created together (a fill) and freed together
/// (a process exit, a TRIM of a range) are mostly neighbours. Why 256 pages: it bounds the
/// extra resident memory (at most 1 MiB beyond `mem_used_total`, on top of the cache) while a
/// batch spans 32 to 256 frames (zspages of 8 to 1 pages), enough that the per-call costs fade;
/// `compact` drops a partial batch.
pub(crate) const DROP_BATCH_PAGES: usize = 256;

/// `MADV_POPULATE_WRITE` (Linux 5.14, include/uapi/asm-generic/mman-common.h).
const MADV_POPULATE_WRITE: libc::c_int = 23;
/// Frames an allocator can hand out: 2^26, 2 TiB of 32 KiB frames (4 TiB of 64 KiB ones), so
/// the frame records take at most 1 GiB of address space (sparse: a page of records is
/// committed when a frame on it is first carved).
pub(crate) const MAX_FRAMES: usize = 1 << 26;

/// A frame's record: what its pages hold, for a process that maps the frames again
/// (`docs/restart.md`). Two words, written by the pool ([`FrameAllocator::set_record`]): 0 and
/// 0 while the frame holds nothing; see `zsmalloc::restore` for the encoding.
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct FrameRecord {
    pub(crate) what: AtomicU64,
    pub(crate) extra: AtomicU64,
}

/// The frame records: one [`FrameRecord`] per frame index, in a memfd of their own, followed
/// by the chunk kinds' table: a byte per chunk ([`CHUNK_FULL`] or [`CHUNK_SMALL`]), written
/// before any frame of the chunk is handed out.
#[derive(Debug)]
struct FrameRecords {
    map: ShmMap,
    file: ShmFile,
    /// Whether the file has the chunk kinds' table (files made by earlier binaries have none:
    /// every chunk of theirs holds full frames, and so do the chunks added to them).
    kinds: bool,
}

/// Bytes of the records proper, at the start of the records' file.
const RECORDS_BYTES: usize = MAX_FRAMES * std::mem::size_of::<FrameRecord>();

impl FrameRecords {
    fn file_bytes(kinds: bool) -> usize {
        RECORDS_BYTES + if kinds { MAX_CHUNKS } else { 0 }
    }

    fn new() -> Result<FrameRecords> {
        let file = ShmFile::create("frame-records")?;
        file.set_len(Self::file_bytes(true) as u64)?;
        let map = file.map(0, Self::file_bytes(true))?;
        Ok(FrameRecords {
            map,
            file,
            kinds: true,
        })
    }

    /// The kind of chunk `chunk` ([`CHUNK_FULL`] in a file without the table).
    fn kind(&self, chunk: usize) -> u8 {
        if !self.kinds {
            return CHUNK_FULL;
        }
        self.kind_byte(chunk).load(Ordering::Acquire)
    }

    /// Records the kind of chunk `chunk`, made now (a file without the table takes full
    /// chunks only).
    fn set_kind(&self, chunk: usize, kind: u8) {
        if !self.kinds {
            assert_eq!(kind, CHUNK_FULL, "no chunk kinds' table");
            return;
        }
        self.kind_byte(chunk).store(kind, Ordering::Release);
    }

    fn kind_byte(&self, chunk: usize) -> &std::sync::atomic::AtomicU8 {
        assert!(chunk < MAX_CHUNKS);
        // SAFETY: `chunk < MAX_CHUNKS`, so the byte lies inside the mapping (which has the
        // table: callers checked `kinds`) and lives as long as `self`; any byte is a valid
        // `AtomicU8`.
        unsafe {
            &*self
                .map
                .base()
                .as_ptr()
                .add(RECORDS_BYTES + chunk)
                .cast::<std::sync::atomic::AtomicU8>()
        }
    }

    /// Faults in the records of frames `[from, to)`, so that writing them (under a class
    /// lock, on a writer's path) never waits for a page.
    fn populate(&self, from: usize, to: usize) {
        let size = std::mem::size_of::<FrameRecord>();
        self.map.populate_range(from * size, (to - from) * size);
    }

    fn get(&self, index: u32) -> &FrameRecord {
        assert!((index as usize) < MAX_FRAMES);
        // SAFETY: `index < MAX_FRAMES`, so the record lies inside the mapping (page aligned,
        // records of 16 bytes are aligned), which lives as long as `self`; any bit pattern is
        // a valid pair of atomics.
        unsafe {
            &*self
                .map
                .base()
                .as_ptr()
                .cast::<FrameRecord>()
                .add(index as usize)
        }
    }
}

fn sys_page_bytes() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

impl FrameAllocator {
    /// An allocator for zspages of `page_size_bytes` pages; reserves nothing yet.
    #[cfg(test)]
    pub(crate) fn new(page_size_bytes: usize) -> FrameAllocator {
        FrameAllocator::with_cache_bytes(page_size_bytes, FRAME_CACHE_BYTES)
    }

    /// An allocator whose frame cache holds at most `cache_bytes` (0: no cache).
    #[cfg(test)]
    pub(crate) fn with_cache_bytes(page_size_bytes: usize, cache_bytes: usize) -> FrameAllocator {
        FrameAllocator::with_frame_pages(page_size_bytes, MAX_PAGES_PER_ZSPAGE, cache_bytes)
    }

    /// An allocator of frames of `frame_pages` pages (at least `MAX_PAGES_PER_ZSPAGE`) whose
    /// frame cache holds at most `cache_bytes`.
    pub(crate) fn with_frame_pages(
        page_size_bytes: usize,
        frame_pages: usize,
        cache_bytes: usize,
    ) -> FrameAllocator {
        let frame_pages = frame_pages.max(MAX_PAGES_PER_ZSPAGE);
        let sys_page_bytes = sys_page_bytes();
        let frame_bytes = (frame_pages * page_size_bytes).next_multiple_of(sys_page_bytes);
        let frames_per_chunk = (CHUNK_BYTES / frame_bytes).max(1);
        let chunk_stride_bytes = frames_per_chunk * frame_bytes;
        let small_frame_bytes = page_size_bytes.next_multiple_of(sys_page_bytes);
        FrameAllocator {
            page_size_bytes,
            frame_pages,
            frame_bytes,
            frames_per_chunk,
            chunk_stride_bytes,
            small_frames: small_frame_bytes < frame_bytes
                && chunk_stride_bytes % small_frame_bytes == 0,
            small_frame_bytes,
            sys_page_bytes,
            state: Mutex::new(FrameState {
                chunks: Vec::new(),
                file: None,
                free: [Vec::new(), Vec::new()],
                cached: (0..=frame_pages).map(|_| Vec::new()).collect(),
                cached_pages: 0,
                dropping_batch: Vec::new(),
                dropping_batch_pages: 0,
                carving: [None, None],
                next_index: 0,
                reserve: (0..=frame_pages).map(|_| Vec::new()).collect(),
                reserve_target: vec![0; frame_pages + 1],
                reserve_low: vec![0; frame_pages + 1],
                reserve_resident: false,
                swap: SwapMarks::new(frame_pages),
                reserve_pages: 0,
                refill_wanted: 0,
                reserve_epoch: 0,
                refill_stop: false,
                refill_paused: false,
                refiller_running: false,
            }),
            populate: AtomicBool::new(true),
            touch_only: AtomicBool::new(false),
            grow: Mutex::new(()),
            #[cfg(test)]
            grow_hook: Mutex::new(None),
            records: OnceLock::new(),
            cache_limit_pages: cache_bytes / page_size_bytes,
            drop_batch_pages: 1,
            reserve_enabled: false,
            refill_cond: Condvar::new(),
            reserve_cond: Condvar::new(),
            starved: std::sync::OnceLock::new(),
            tick_hook: std::sync::OnceLock::new(),
            refiller: Mutex::new(None),
            shrinkers: Mutex::new(Vec::new()),
            refiller_deadline: OnceLock::new(),
            pool_tags: Mutex::new(std::collections::BTreeSet::new()),
            recovering: Mutex::new(None),
        }
    }

    /// The allocator a previous process left in `frames` and `records` (`docs/restart.md`),
    /// for frames of `frame_pages` pages: every frame of the file counts as carved, none is
    /// handed out; the caller takes the recorded ones with [`claim`](Self::claim) and gives
    /// the rest back with [`release_unclaimed`](Self::release_unclaimed). A records' file
    /// without the chunk kinds' table (an earlier binary's) has full chunks only, and the
    /// allocator adds only full ones to it.
    pub(crate) fn with_files(
        mut self,
        frames: ShmFile,
        records: ShmFile,
    ) -> Result<FrameAllocator> {
        let stride = self.chunk_stride_bytes as u64;
        let len = frames.len()?;
        if len % stride != 0 || len / stride > MAX_CHUNKS as u64 {
            return Err(Error::invalid(format!(
                "zsmalloc: the frames' file holds {len} bytes, not a whole number of \
                 {stride}-byte chunks (at most {MAX_CHUNKS})"
            )));
        }
        let records_len = records.len()?;
        let kinds = match records_len {
            n if n == FrameRecords::file_bytes(true) as u64 => true,
            n if n == FrameRecords::file_bytes(false) as u64 => false,
            n => {
                return Err(Error::invalid(format!(
                    "zsmalloc: the frame records' file holds {n} bytes, not {} (or {}, as \
                     written before chunks had kinds)",
                    FrameRecords::file_bytes(true),
                    FrameRecords::file_bytes(false)
                )));
            }
        };
        let map = records.map(0, FrameRecords::file_bytes(kinds))?;
        let records = FrameRecords {
            map,
            file: records,
            kinds,
        };
        self.small_frames &= kinds;
        let mut chunks = Vec::new();
        let mut next_index = 0u64;
        for chunk in 0..(len / stride) as usize {
            let small = match records.kind(chunk) {
                CHUNK_FULL => false,
                CHUNK_SMALL if self.small_frames => true,
                kind => {
                    return Err(Error::invalid(format!(
                        "zsmalloc: chunk {chunk} of the frames' file has kind {kind}, which \
                         this pool's frames cannot have"
                    )));
                }
            };
            let frames_in = self.frames_in(small);
            if next_index + frames_in as u64 > MAX_FRAMES as u64 {
                return Err(Error::invalid(format!(
                    "zsmalloc: the frames' file holds more than {MAX_FRAMES} frames"
                )));
            }
            let map = frames.map(chunk as u64 * stride, self.chunk_stride_bytes)?;
            chunks.push(Chunk {
                map,
                small,
                first_index: next_index as u32,
                frames: frames_in as u32,
            });
            next_index += frames_in as u64;
        }
        let _ = self.records.set(records);
        let st = self.state.get_mut();
        st.chunks = chunks;
        st.next_index = next_index as u32;
        st.file = Some(Arc::new(frames));
        Ok(self)
    }

    /// Frames per chunk of single-page frames (`small`) or of full ones.
    fn frames_in(&self, small: bool) -> usize {
        if small {
            self.chunk_stride_bytes / self.small_frame_bytes
        } else {
            self.frames_per_chunk
        }
    }

    /// Bytes of frame records of the chunks made so far (whole pages).
    pub(crate) fn records_bytes(&self) -> usize {
        (self.carved_frames() as usize * std::mem::size_of::<FrameRecord>()).next_multiple_of(4096)
    }

    /// Frame numbers given out so far, to the chunks made: every frame number below this
    /// belongs to a chunk (its record reads as empty until the frame is first handed out).
    pub(crate) fn carved_frames(&self) -> u32 {
        self.state.lock().next_index
    }

    /// Pages frame `index` can hold: 1 for a single-page frame, else the frame size.
    pub(crate) fn frame_pages_of(&self, index: u32) -> usize {
        let st = self.state.lock();
        if Self::chunk_of(&st, index).1.small {
            1
        } else {
            self.frame_pages
        }
    }

    /// The chunk (number and chunk) holding frame `index`, which a chunk holds.
    fn chunk_of(st: &FrameState, index: u32) -> (usize, &Chunk) {
        let c = st.chunks.partition_point(|c| c.first_index <= index);
        assert!(
            c > 0 && index - st.chunks[c - 1].first_index < st.chunks[c - 1].frames,
            "frame {index} was never carved"
        );
        (c - 1, &st.chunks[c - 1])
    }

    /// Frame `n` (counted from 0) of chunk number `c`.
    fn frame_in(&self, c: usize, chunk: &Chunk, n: usize) -> Frame {
        assert!(n < chunk.frames as usize);
        let len_bytes = if chunk.small {
            self.small_frame_bytes
        } else {
            self.frame_bytes
        };
        // SAFETY: `n < chunk.frames`, so `n * len_bytes + len_bytes <= chunk_stride_bytes`, the
        // chunk's length: the frame lies inside the chunk's mapping.
        let base = unsafe { chunk.base().add(n * len_bytes) };
        Frame {
            base,
            len_bytes,
            index: chunk.first_index + n as u32,
            offset: (c * self.chunk_stride_bytes + n * len_bytes) as u64,
        }
    }

    /// The token of carved frame `index`, for recovery, which claims each recorded frame
    /// once (two tokens of one frame would let two owners write it).
    pub(crate) fn claim(&self, index: u32) -> Frame {
        let st = self.state.lock();
        let (c, chunk) = Self::chunk_of(&st, index);
        self.frame_in(c, chunk, (index - chunk.first_index) as usize)
    }

    /// Recovery: every carved frame not in `claimed` (sorted) goes on the free list, its pages
    /// punched out (whatever a dead process left in them) and its record cleared.
    pub(crate) fn release_unclaimed(&self, claimed: &[u32]) -> Result<()> {
        let carved = self.carved_frames();
        let mut next = claimed.iter().peekable();
        let mut free = Vec::new();
        for index in 0..carved {
            if next.peek() == Some(&&index) {
                next.next();
                continue;
            }
            let frame = self.claim(index);
            self.clear_record(&frame);
            free.push(frame);
        }
        // One hole per range of adjacent free frames (frame numbers follow file offsets).
        let mut i = 0;
        while i < free.len() {
            let mut j = i;
            while j + 1 < free.len()
                && free[j].offset + free[j].len_bytes as u64 == free[j + 1].offset
            {
                j += 1;
            }
            let end = free[j].offset + free[j].len_bytes as u64;
            self.punch(free[i].offset, end - free[i].offset)?;
            i = j + 1;
        }
        let mut st = self.state.lock();
        for frame in free.into_iter().rev() {
            let kind = usize::from(frame.len_bytes == self.small_frame_bytes && self.small_frames);
            st.free[kind].push(frame.index);
        }
        Ok(())
    }

    /// New descriptors of the frames' and the records' files (to hand to another process).
    pub(crate) fn files(&self) -> Result<(ShmFile, ShmFile)> {
        let file = self.state.lock().file.clone();
        let frames = match file {
            Some(f) => f.try_clone_fd()?,
            None => {
                // Nothing carved yet: make the file now, so there is one to hand over.
                self.alloc_nothing()?;
                return self.files();
            }
        };
        let records = self
            .records
            .get()
            .expect("made with the frames' file")
            .file
            .try_clone_fd()?;
        Ok((ShmFile::from_fd(frames), ShmFile::from_fd(records)))
    }

    /// A record tag for a new pool sharing this allocator: `want` (a recovered pool's, `EINVAL`
    /// if another pool has it), else the lowest free one. `ENOSPC`-like `ENOMEM` once
    /// [`MAX_POOL_TAG`](super::record::MAX_POOL_TAG) pools share it.
    pub(crate) fn take_pool_tag(&self, want: Option<u16>) -> Result<u16> {
        let mut tags = self.pool_tags.lock();
        let tag = match want {
            Some(t) if t == 0 || t > super::record::MAX_POOL_TAG || tags.contains(&t) => {
                return Err(Error::invalid(format!(
                    "zsmalloc: pool tag {t} is not free in the shared frame allocator"
                )));
            }
            Some(t) => t,
            None => (1..=super::record::MAX_POOL_TAG)
                .find(|t| !tags.contains(t))
                .ok_or_else(|| {
                    Error::no_memory("zsmalloc: every pool tag of the shared allocator is taken")
                })?,
        };
        tags.insert(tag);
        Ok(tag)
    }

    /// Gives `tag` back (a pool that dropped, after clearing its records); 0 is ignored.
    pub(crate) fn give_back_pool_tag(&self, tag: u16) {
        self.pool_tags.lock().remove(&tag);
    }

    /// Starts recovering a shared allocator: until [`finish_recovery`](Self::finish_recovery),
    /// the pools' recoveries add the frames they claim ([`add_claimed`](Self::add_claimed))
    /// instead of releasing the others.
    pub(crate) fn begin_recovery(&self) {
        *self.recovering.lock() = Some(Vec::new());
    }

    /// Whether the allocator is being recovered (see [`begin_recovery`](Self::begin_recovery)).
    pub(crate) fn is_recovering(&self) -> bool {
        self.recovering.lock().is_some()
    }

    /// A pool's recovery claimed `frames` (`EINVAL` if another pool's did already: two pools'
    /// records claiming a frame cannot be, each record holds one tag).
    pub(crate) fn add_claimed(&self, frames: &[u32]) -> Result<()> {
        let mut rec = self.recovering.lock();
        let Some(claimed) = rec.as_mut() else {
            return Err(Error::invalid(
                "zsmalloc: the shared frame allocator is not being recovered",
            ));
        };
        claimed.extend_from_slice(frames);
        Ok(())
    }

    /// Ends recovery: every carved frame no pool claimed is released
    /// ([`release_unclaimed`](Self::release_unclaimed): its record cleared, its pages punched
    /// out), including frames of pools nobody recovered.
    pub(crate) fn finish_recovery(&self) -> Result<()> {
        let Some(mut claimed) = self.recovering.lock().take() else {
            return Ok(());
        };
        claimed.sort_unstable();
        if let Some(w) = claimed.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::invalid(format!(
                "zsmalloc recovery: frame {} claimed by two pools",
                w[0]
            )));
        }
        self.release_unclaimed(&claimed)
    }

    /// Whether `frames` and `records` are this allocator's files (the same open files, as
    /// `fstat` says), for a pool recovered onto a shared allocator.
    pub(crate) fn has_files(&self, frames: &ShmFile, records: &ShmFile) -> Result<bool> {
        let mine = self.files()?;
        Ok(mine.0.same_file(frames)? && mine.1.same_file(records)?)
    }

    /// Makes the files (with the first chunk) without handing a frame out.
    fn alloc_nothing(&self) -> Result<()> {
        let frame = self.alloc()?;
        self.state.lock().free[0].push(frame.index);
        Ok(())
    }

    /// Drops released frames beyond the cache in batches of [`DROP_BATCH_PAGES`] pages.
    pub(crate) fn with_drop_batches(mut self) -> FrameAllocator {
        self.drop_batch_pages = DROP_BATCH_PAGES;
        self
    }

    /// Turns the reserve of populated frames on (see [`FRAME_RESERVE_PAGES`]); its thread
    /// starts on the first allocation that finds it empty.
    pub(crate) fn with_reserve(mut self) -> FrameAllocator {
        assert!(
            self.frame_pages < 64,
            "refill_wanted has a bit per page count"
        );
        self.reserve_enabled = true;
        let st = self.state.get_mut();
        for k in 1..=self.frame_pages {
            st.reserve_target[k] = reserve_target_frames(k);
            st.reserve_low[k] = reserve_target_frames(k) / 2;
        }
        self
    }

    /// Bytes of address space per frame.
    #[cfg(test)]
    pub(crate) fn frame_bytes(&self) -> usize {
        self.frame_bytes
    }

    /// A full frame whose pages read as zeroes or as leftovers of its previous zspage's unused
    /// tail (never touched, so zeroes too). `ENOMEM` if the kernel refuses a new chunk.
    pub(crate) fn alloc(&self) -> Result<Frame> {
        self.alloc_kind(false)
    }

    /// A frame for a zspage (or span) of `pages` pages, as [`alloc`](Self::alloc): a
    /// single-page frame for one page where the allocator has them, else a full one.
    fn alloc_for(&self, pages: usize) -> Result<Frame> {
        self.alloc_kind(pages == 1 && self.small_frames)
    }

    /// Which free list and carving cursor `frame` belongs to: 1 for a single-page frame.
    fn kind_of(&self, frame: &Frame) -> usize {
        usize::from(self.small_frames && frame.len_bytes == self.small_frame_bytes)
    }

    /// A frame of the kind asked (`small`: single-page), from the free list, the chunk being
    /// carved, or a new chunk.
    fn alloc_kind(&self, small: bool) -> Result<Frame> {
        loop {
            if let Some(frame) = self.take_carved(&mut self.state.lock(), small) {
                return Ok(frame);
            }
            // A new chunk, made without the state mutex: making it may wait for memory (the
            // mapping, the records' pages), and writers serving swap take that mutex for the
            // reserve, so holding it here would stop them behind the very reclaim that waits
            // on them. `grow` lets one thread at a time make a chunk.
            let _grow = self.grow.lock();
            let (chunk, first_index, file) = {
                let mut st = self.state.lock();
                if let Some(frame) = self.take_carved(&mut st, small) {
                    return Ok(frame);
                }
                (st.chunks.len(), st.next_index as usize, st.file.clone())
            };
            let frames_in = self.frames_in(small);
            let len_bytes = self.chunk_stride_bytes;
            if first_index + frames_in > MAX_FRAMES || chunk >= MAX_CHUNKS {
                return Err(Error::no_memory(format!(
                    "zsmalloc: {MAX_FRAMES} frames ({MAX_CHUNKS} chunks) reserved for zspages \
                     already"
                )));
            }
            let file = match file {
                Some(file) => file,
                None => {
                    if self.records.get().is_none() {
                        let _ = self.records.set(FrameRecords::new()?);
                    }
                    let file = Arc::new(ShmFile::create("frames")?);
                    self.state.lock().file = Some(Arc::clone(&file));
                    file
                }
            };
            // The chunk's kind first: a process that finds the chunk in the file (the file's
            // length grows next) must know how its frames are cut.
            let records = self.records.get().expect("made with the first chunk");
            records.set_kind(chunk, if small { CHUNK_SMALL } else { CHUNK_FULL });
            let offset = (chunk * len_bytes) as u64;
            file.set_len(offset + len_bytes as u64)?;
            let map = file.map(offset, len_bytes).map_err(|e| {
                Error::no_memory(format!(
                    "zsmalloc: cannot reserve {len_bytes} bytes for zspages: {}",
                    e.message()
                ))
            })?;
            // The new frames' records (a page per 256 frames), faulted in now, where the chunk
            // is made (serving swap, by the refiller), not on a writer's path under the class
            // lock, where a fault could wait for memory.
            records.populate(first_index, first_index + frames_in);
            #[cfg(test)]
            if let Some(hook) = &*self.grow_hook.lock() {
                (hook.0)();
            }
            let mut st = self.state.lock();
            debug_assert_eq!(st.chunks.len(), chunk, "chunks are added under `grow` only");
            st.chunks.push(Chunk {
                map,
                small,
                first_index: first_index as u32,
                frames: frames_in as u32,
            });
            st.next_index += frames_in as u32;
            st.carving[usize::from(small)] = Some((chunk, 0));
            if let Some(frame) = self.take_carved(&mut st, small) {
                return Ok(frame);
            }
        }
    }

    /// A frame of the kind asked from its free list, else the next uncarved frame of the chunk
    /// being carved for that kind; `None` when a new chunk is needed.
    fn take_carved(&self, st: &mut FrameState, small: bool) -> Option<Frame> {
        let kind = usize::from(small);
        if let Some(index) = st.free[kind].pop() {
            let (c, chunk) = Self::chunk_of(st, index);
            return Some(self.frame_in(c, chunk, (index - chunk.first_index) as usize));
        }
        let (c, carved) = st.carving[kind]?;
        let frame = self.frame_in(c, &st.chunks[c], carved);
        st.carving[kind] = (carved + 1 < st.chunks[c].frames as usize).then_some((c, carved + 1));
        Some(frame)
    }

    /// Writes `frame`'s record (module docs): `what` last, with `Release`, so a reader that
    /// sees it sees `extra` too. The pool writes it before anything that names the frame is
    /// published, and clears it ([`clear_record`](Self::clear_record)) before the frame goes
    /// back.
    pub(crate) fn set_record(&self, frame: &Frame, what: u64, extra: u64) {
        let r = self.record(frame.index);
        r.extra.store(extra, Ordering::Relaxed);
        r.what.store(what, Ordering::Release);
    }

    /// Clears `frame`'s record: it holds nothing any more.
    pub(crate) fn clear_record(&self, frame: &Frame) {
        let r = self.record(frame.index);
        r.what.store(0, Ordering::Release);
        r.extra.store(0, Ordering::Relaxed);
    }

    /// The record of frame `index` (a frame handed out, so the records exist).
    pub(crate) fn record(&self, index: u32) -> &FrameRecord {
        self.records
            .get()
            .expect("frame records are made with the first frame")
            .get(index)
    }

    /// Gives the bytes `[offset, offset + len_bytes)` of the frames' file back to the kernel
    /// (punched out); `Err` if the kernel refused (the pages stay, and are kept, never lost).
    fn punch(&self, offset: u64, len_bytes: u64) -> Result<()> {
        let file = self
            .state
            .lock()
            .file
            .clone()
            .expect("a frame was carved, so the file exists");
        file.punch(offset, len_bytes)
    }

    /// A frame whose first `pages` pages are resident, for a new zspage (or span) that writes
    /// them at once. In order: a frame released with the same page count and kept in the frame
    /// cache (resident, holding stale bytes of freed objects); one from the reserve (faulted in
    /// by the refiller; serving swap, a larger one if none of this count is left), waking the
    /// refiller when a list reaches its low mark; else a fresh frame faulted in here
    /// ([`populate`](Self::populate)). Serving swap, not that last: the writer waits for the
    /// refiller at most [`SWAP_MISS_WAIT`], then fails with `ENOMEM` (counted,
    /// [`SwapReserveStats::misses`]); only once the refiller has stopped does it fault a frame
    /// in.
    pub(crate) fn alloc_populated(self: &Arc<Self>, pages: usize) -> Result<Frame> {
        let mut wake = Wake::No;
        let mut taken = None;
        {
            let mut st = self.state.lock();
            if let Some(frame) = st.cached[pages].pop() {
                st.cached_pages -= pages;
                return Ok(frame);
            }
            if st.reserve_resident {
                // Serving swap: the reserve, else (counted) a frame faulted in here.
                st.swap.asked_pages[pages] += pages as u64;
                let have = (pages..=self.frame_pages).find(|&k| !st.reserve[k].is_empty());
                let wake = st.reserve_pages <= st.swap.low_pages
                    || st.reserve[pages].len() <= 1
                    || have.is_none();
                if wake && !st.swap.kicked {
                    st.swap.kicked = true;
                    self.refill_cond.notify_one();
                }
                let mut have = have;
                if have.is_none() {
                    st.swap.misses += 1;
                    // Wait for the refiller (woken above), at most SWAP_MISS_WAIT: it reclaims
                    // as any process does, which a writer must not (module docs, "The
                    // reserve"). Still none: the write fails, as zram's when zsmalloc gets no
                    // page, and the kernel keeps the page. Not if the refiller stopped: then
                    // nobody refills, and the writer faults a frame in itself.
                    let deadline = std::time::Instant::now() + SWAP_MISS_WAIT;
                    while have.is_none() && !st.refill_stop {
                        let out = self.reserve_cond.wait_until(&mut st, deadline);
                        have = (pages..=self.frame_pages).find(|&k| !st.reserve[k].is_empty());
                        if out.timed_out() {
                            break;
                        }
                    }
                    if have.is_none() && !st.refill_stop {
                        let now = std::time::Instant::now();
                        let starved = now.duration_since(st.swap.added_at) >= SWAP_STARVED
                            && !st
                                .swap
                                .starved_at
                                .is_some_and(|t| now.duration_since(t) < SWAP_STARVED);
                        if starved {
                            st.swap.starved_at = Some(now);
                        }
                        drop(st);
                        if let Some(hook) = self.starved.get().filter(|_| starved) {
                            (hook.0)();
                        }
                        return Err(Error::no_memory(
                            "zsmalloc: the swap reserve is empty and was not refilled in time"
                                .to_string(),
                        ));
                    }
                }
                if let Some(have) = have {
                    let frame = st.reserve[have].pop().expect("found non-empty");
                    st.reserve_pages -= have;
                    st.swap.taken_pages += have as u64;
                    taken = Some((frame, have));
                }
            } else if self.reserve_enabled {
                // Lists without a target (0) are never refilled (`want_refill`).
                if let Some(frame) = st.reserve[pages].pop() {
                    st.reserve_pages -= pages;
                    taken = Some((frame, pages));
                }
                wake = wake.max(Self::want_refill(&mut st, pages));
            }
        }
        self.wake_refiller(wake);
        if let Some((frame, have)) = taken {
            if have > pages {
                // Pages the zspage will not use go back to the kernel (no memory needed).
                self.drop_pages(&frame, pages, have);
            }
            return Ok(frame);
        }
        let frame = self.alloc_for(pages)?;
        self.populate(&frame, pages);
        Ok(frame)
    }

    /// Marks `reserve[k]` for the refiller if it is at its low mark and not marked yet; says
    /// what the caller must do to the refiller after dropping the lock.
    fn want_refill(st: &mut FrameState, k: usize) -> Wake {
        let bit = 1u64 << k;
        if st.reserve_target[k] == 0
            || st.reserve[k].len() > st.reserve_low[k]
            || st.refill_wanted & bit != 0
            || st.refill_stop
        {
            return Wake::No;
        }
        st.refill_wanted |= bit;
        if st.refiller_running {
            Wake::Signal
        } else {
            st.refiller_running = true;
            Wake::Spawn
        }
    }

    /// Faults the first `pages` pages of `frame` in with one `madvise(MADV_POPULATE_WRITE)`
    /// instead of one page fault per page on first write (a new zspage is written at once, so
    /// they would be faulted in anyway). Kernels before 5.14 lack the advice: then, and when
    /// serving swap, each page is touched instead.
    fn populate(&self, frame: &Frame, pages: usize) {
        // Serving swap, pages are touched one by one instead: a page fault holds only the
        // mapping's own lock while it waits for memory, where MADV_POPULATE_WRITE holds the
        // process's mmap lock, which a request thread's mmap then waits for (seen in the VM:
        // the refill thread reclaiming inside madvise, a queue thread blocked in mmap).
        if self.populate.load(Ordering::Relaxed) && !self.touch_only.load(Ordering::Relaxed) {
            let len_bytes = (pages * self.page_size_bytes)
                .next_multiple_of(self.sys_page_bytes)
                .min(frame.len_bytes);
            // SAFETY: the range lies inside the frame (clamped to its length; frames are
            // system-page aligned), a mapping of the frames' file that we own and nobody else
            // references: the caller holds the token and has handed out no slice of it.
            // Populating only pre-faults the pages (zero-filled, or keeping what is there); it
            // never changes their contents.
            let rc = unsafe {
                libc::madvise(frame.base.as_ptr().cast(), len_bytes, MADV_POPULATE_WRITE)
            };
            if rc == 0 {
                return;
            }
            // Unknown advice (kernel < 5.14): stop asking. ENOMEM/EFAULT/EINTR: the first write
            // faults the pages in (or fails there, as it would have without populating).
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
                self.populate.store(false, Ordering::Relaxed);
            } else {
                return;
            }
        }
        // No MADV_POPULATE_WRITE, or serving swap: touch each page (a zero written to zeroed
        // memory; the frame is ours alone, so nobody reads these bytes meanwhile).
        let len_bytes = (pages * self.page_size_bytes).min(frame.len_bytes);
        for off in (0..len_bytes).step_by(self.sys_page_bytes) {
            // SAFETY: `off < len_bytes <= frame.len_bytes`: inside the frame, which we own.
            unsafe { frame.base.as_ptr().add(off).write_volatile(0) };
        }
    }

    /// Drops pages `[from, to)` of `frame` (whose token we hold) from the resident set.
    fn drop_pages(&self, frame: &Frame, from: usize, to: usize) {
        let start = (from * self.page_size_bytes).next_multiple_of(self.sys_page_bytes);
        let end = (to * self.page_size_bytes)
            .next_multiple_of(self.sys_page_bytes)
            .min(frame.len_bytes);
        if start >= end {
            return;
        }
        // Refused (never seen): the pages stay with the frame, whose next release drops them.
        let r = self.punch(frame.offset + start as u64, (end - start) as u64);
        debug_assert!(r.is_ok(), "{r:?}");
    }

    /// Serving swap: keeps a reserve of `target_pages` resident pages (module docs, "The
    /// reserve"; [`SwapMarks`]), shared at first evenly by the page counts `page_counts` (those
    /// of the size classes), never trimmed; faults them in now, so call it before a pool
    /// serves, and starts the refiller, which stays until
    /// [`stop_refiller`](Self::stop_refiller).
    pub(crate) fn set_reserve(
        self: &Arc<Self>,
        target_pages: usize,
        page_counts: &[usize],
    ) -> Result<()> {
        assert!(
            self.frame_pages < 64,
            "refill_wanted has a bit per page count"
        );
        self.touch_only.store(true, Ordering::Relaxed);
        {
            let mut st = self.state.lock();
            st.reserve_resident = true;
            st.swap.high_pages = target_pages;
            st.swap.low_pages = target_pages / 8;
            for &k in page_counts {
                if (1..=self.frame_pages).contains(&k) {
                    st.swap.in_use[k] = true;
                }
            }
            Self::swap_retarget(&mut st);
        }
        // Faulted in now, in the caller, so the first writes find it full.
        loop {
            // (A statement of its own: the guard must not live through the loop's body.)
            let deficit = {
                let st = self.state.lock();
                Self::swap_deficit(&st).filter(|&k| st.reserve_pages + k <= st.swap.high_pages)
            };
            let Some(k) = deficit else { break };
            let frame = self.alloc_for(k)?;
            self.populate(&frame, k);
            let mut st = self.state.lock();
            st.reserve[k].push(frame);
            st.reserve_pages += k;
        }
        let spawn = {
            let mut st = self.state.lock();
            !std::mem::replace(&mut st.refiller_running, true)
        };
        if spawn {
            self.spawn_refiller().map_err(|e| {
                self.state.lock().refiller_running = false;
                Error::no_memory(format!("zsmalloc: starting the reserve thread: {e}"))
            })?;
        }
        Ok(())
    }

    /// Serving swap: `reserve_target` from the high mark and the recent demand by page count
    /// ([`SwapMarks`]): a quarter of the high mark evenly over the page counts in use, the rest
    /// in proportion to `demand_pages` (evenly too while nothing was asked).
    fn swap_retarget(st: &mut FrameState) {
        let counts: Vec<usize> = (1..st.swap.in_use.len())
            .filter(|&k| st.swap.in_use[k])
            .collect();
        if counts.is_empty() {
            return;
        }
        let high = st.swap.high_pages;
        let demand: u64 = counts.iter().map(|&k| st.swap.demand_pages[k]).sum();
        let floor = high / 4 / counts.len();
        let rest = high - floor * counts.len();
        for &k in &counts {
            let share = if demand == 0 {
                rest / counts.len()
            } else {
                (rest as u128 * st.swap.demand_pages[k] as u128 / demand as u128) as usize
            };
            st.reserve_target[k] = ((floor + share) / k).max(1);
        }
    }

    /// Serving swap: the page count whose reserve list lacks the most pages below its target,
    /// or `None` when every list is at its target.
    fn swap_deficit(st: &FrameState) -> Option<usize> {
        (1..st.reserve.len())
            .filter(|&k| st.reserve[k].len() < st.reserve_target[k])
            .max_by_key(|&k| (st.reserve_target[k] - st.reserve[k].len()) * k)
    }

    /// Serving swap: the page count whose reserve list holds the most pages above its target,
    /// or `None` when no list is above its target.
    fn swap_surplus(st: &FrameState) -> Option<usize> {
        (1..st.reserve.len())
            .filter(|&k| st.reserve[k].len() > st.reserve_target[k])
            .max_by_key(|&k| (st.reserve[k].len() - st.reserve_target[k]) * k)
    }

    /// Serving swap: one tick of [`SwapMarks`]: the demand decays and takes in what was asked
    /// since the last tick, the targets follow it, and the low mark follows the pages taken
    /// (`taken_pages`, the tick's consumption).
    fn swap_tick(st: &mut FrameState, taken_pages: u64) {
        let swap = &mut st.swap;
        for k in 1..swap.asked_pages.len() {
            let asked = std::mem::take(&mut swap.asked_pages[k]);
            if asked > 0 {
                swap.in_use[k] = true;
            }
            swap.demand_pages[k] = swap.demand_pages[k] / 2 + asked;
        }
        let high = swap.high_pages;
        swap.low_pages = (taken_pages as usize)
            .saturating_mul(SWAP_LOW_TICKS)
            .clamp(high / 8, high * 3 / 4);
        Self::swap_retarget(st);
    }

    /// Serving swap: `hook` is called (on a writer's thread, no lock held) when a write fails
    /// because the reserve is empty and has gained no frame for [`SWAP_STARVED`], at most once
    /// per that time: memory has run out and the refiller cannot get any. Only the first hook
    /// set is kept.
    pub(crate) fn on_starved(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.starved.set(Hook(hook));
    }

    /// Serving swap: `hook` is called by the refiller every [`SWAP_TICK`] with no lock held,
    /// for other memory the server keeps faulted in ahead of need. Only the first hook set is
    /// kept.
    pub(crate) fn on_refill_tick(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.tick_hook.set(Hook(hook));
    }

    /// What the swap reserve holds and has done.
    pub(crate) fn swap_stats(&self) -> SwapReserveStats {
        let st = self.state.lock();
        SwapReserveStats {
            held_pages: st.reserve_pages as u64,
            high_pages: st.swap.high_pages as u64,
            low_pages: st.swap.low_pages as u64,
            taken_pages: st.swap.taken_pages,
            misses: st.swap.misses,
        }
    }

    /// The swap refiller: every [`SWAP_TICK`] moves the watermarks ([`swap_tick`]); woken at
    /// the low mark (or by a writer), fills the reserve list by list to the targets, one frame
    /// at a time with the state mutex dropped while it faults the pages in (this is the one
    /// thread of the server that waits for memory), then sleeps again. Exits when stopped.
    ///
    /// [`swap_tick`]: Self::swap_tick
    fn swap_refill_loop(&self) {
        leave_io_flusher();
        let _ = self.refiller_deadline.set(set_refiller_deadline());
        let mut st = self.state.lock();
        let mut tick = std::time::Instant::now();
        let mut taken_at_tick = st.swap.taken_pages;
        let mut filling = false;
        // Compact the pools before taking fresh pages: when a fill starts, and every tick of
        // a fill that goes on.
        let mut shrink = false;
        loop {
            if st.refill_stop {
                st.refiller_running = false;
                return;
            }
            if tick.elapsed() >= SWAP_TICK {
                tick = std::time::Instant::now();
                let taken = st.swap.taken_pages - taken_at_tick;
                taken_at_tick = st.swap.taken_pages;
                shrink |= filling;
                Self::swap_tick(&mut st, taken);
                st.swap.ahead_wanted = false;
                drop(st);
                if let Some(Hook(hook)) = self.tick_hook.get() {
                    hook();
                }
                self.pools_ahead(true);
                st = self.state.lock();
                self.reserve_cond.notify_all();
                // A list left empty under a target (a page count first asked for since the
                // last tick) is filled now: the kick of the writer that asked came before the
                // target, and no other writer may ask again soon.
                if (1..st.reserve.len())
                    .any(|k| st.reserve[k].is_empty() && st.reserve_target[k] > 0)
                {
                    filling = true;
                }
            }
            if std::mem::take(&mut st.swap.ahead_wanted) {
                drop(st);
                self.pools_ahead(false);
                st = self.state.lock();
                self.reserve_cond.notify_all();
                continue;
            }
            if st.swap.kicked || st.reserve_pages <= st.swap.low_pages {
                st.swap.kicked = false;
                shrink |= !filling;
                filling = true;
            }
            if std::mem::take(&mut shrink) && !st.refill_paused {
                drop(st);
                self.shrink_pools();
                st = self.state.lock();
                continue;
            }
            let k = if filling && !st.refill_paused {
                Self::swap_deficit(&st)
            } else {
                None
            };
            // The reserve holds at most its size: when a list under its target has no room
            // left (the targets moved with demand), a frame of a list above its target is
            // given back first; with none, filling stops.
            let k = match k {
                Some(k) if st.reserve_pages + k > st.swap.high_pages => {
                    match Self::swap_surplus(&st) {
                        Some(j) => {
                            let frame = st.reserve[j].pop().expect("above its target");
                            st.reserve_pages -= j;
                            drop(st);
                            self.discard(frame, j);
                            st = self.state.lock();
                            continue;
                        }
                        None => None,
                    }
                }
                k => k,
            };
            let Some(k) = k else {
                filling = false;
                let left = SWAP_TICK.saturating_sub(tick.elapsed());
                self.refill_cond.wait_for(&mut st, left);
                continue;
            };
            drop(st);
            let frame = self.alloc_for(k);
            if let Ok(frame) = &frame {
                self.populate(frame, k);
            }
            st = self.state.lock();
            match frame {
                Ok(frame) => {
                    st.reserve[k].push(frame);
                    st.reserve_pages += k;
                    st.swap.added_at = std::time::Instant::now();
                    self.reserve_cond.notify_all();
                }
                // No address space: try again at the next tick rather than spin.
                Err(_) => {
                    self.refill_cond.wait_for(&mut st, SWAP_TICK);
                }
            }
        }
    }

    /// Serving swap: `pool` takes frames from this allocator, and the refiller may compact it
    /// to get frames back before it takes fresh pages ([`Shrinker`]).
    pub(crate) fn add_shrinker(&self, pool: std::sync::Weak<dyn Shrinker>) {
        self.shrinkers.lock().push(pool);
    }

    /// Serving swap: a writer's pool ran low on memory kept ahead of need
    /// ([`Shrinker::keep_ahead`]); the refiller looks now rather than at its next tick.
    pub(crate) fn want_ahead(&self) {
        let mut st = self.state.lock();
        if st.reserve_resident && !st.swap.ahead_wanted {
            st.swap.ahead_wanted = true;
            self.refill_cond.notify_one();
        }
    }

    /// Serving swap: a writer found none of its pool's memory kept ahead of need
    /// ([`Shrinker::keep_ahead`]) left; it asks the refiller and waits for it at most
    /// [`SWAP_MISS_WAIT`] until `ready` (checked under the state mutex, which the refiller
    /// takes to signal), as an allocation the reserve cannot serve does, and is counted in the
    /// misses as it is. `false` when it is still not ready; `true` at once when not serving swap or when
    /// the refiller has stopped (nobody keeps memory ahead then: the writer faults it in).
    pub(crate) fn wait_ahead(&self, ready: impl Fn() -> bool) -> bool {
        let mut st = self.state.lock();
        if !st.reserve_resident || st.refill_stop {
            return true;
        }
        if ready() {
            return true;
        }
        st.swap.misses += 1;
        let deadline = std::time::Instant::now() + SWAP_MISS_WAIT;
        while !ready() {
            if st.refill_stop {
                return true;
            }
            if !st.swap.ahead_wanted {
                st.swap.ahead_wanted = true;
                self.refill_cond.notify_one();
            }
            if self.reserve_cond.wait_until(&mut st, deadline).timed_out() {
                return ready();
            }
        }
        true
    }

    /// The refiller's look at the memory each pool keeps ahead of need ([`Shrinker::keep_ahead`]);
    /// no lock held.
    fn pools_ahead(&self, tick: bool) {
        let pools: Vec<Arc<dyn Shrinker>> = {
            let list = self.shrinkers.lock();
            list.iter().filter_map(|w| w.upgrade()).collect()
        };
        for pool in pools {
            pool.keep_ahead(tick);
        }
    }

    /// The refiller's compaction of the pools ([`Shrinker`]): each one that could free at
    /// least [`SHRINK_MIN_PAGES`] is compacted, its emptied zspages' frames going back to the
    /// reserve ([`release`](Self::release)) before the refiller faults in any. Returns the
    /// pages freed. Called with no lock held; it runs as an I/O flusher where the kernel
    /// allows ([`enter_io_flusher`]): it takes the locks writers take.
    fn shrink_pools(&self) -> u64 {
        let pools: Vec<Arc<dyn Shrinker>> = {
            let mut list = self.shrinkers.lock();
            list.retain(|w| w.strong_count() > 0);
            list.iter().filter_map(|w| w.upgrade()).collect()
        };
        let flusher = enter_io_flusher();
        let freed = pools
            .iter()
            .filter(|p| p.freeable_pages() >= SHRINK_MIN_PAGES)
            .map(|p| p.shrink())
            .sum();
        if flusher {
            leave_io_flusher();
        }
        freed
    }

    /// Serving swap: whether the refiller runs under `SCHED_DEADLINE` (`None` until it has
    /// started; the error number of the kernel's refusal otherwise).
    pub(crate) fn refiller_deadline(&self) -> Option<std::result::Result<(), i32>> {
        self.refiller_deadline.get().copied()
    }

    /// Pages per frame: the most a zspage or a span may use.
    pub(crate) fn frame_pages(&self) -> usize {
        self.frame_pages
    }

    /// Pages held resident by the reserve.
    pub(crate) fn reserve_pages(&self) -> usize {
        self.state.lock().reserve_pages
    }

    /// Starts a refiller thread (the caller set `refiller_running`), joining the previous one
    /// (which cleared `refiller_running` just before returning).
    fn spawn_refiller(self: &Arc<Self>) -> std::io::Result<()> {
        let mut slot = self.refiller.lock();
        if let Some(old) = slot.take() {
            let _ = old.join();
        }
        let me = Arc::clone(self);
        *slot = Some(
            std::thread::Builder::new()
                .name("uzram-zs-reserve".into())
                .spawn(move || me.refill_loop())?,
        );
        Ok(())
    }

    /// Signals the refiller, or spawns one (`Wake::Spawn`: the caller set `refiller_running`).
    fn wake_refiller(self: &Arc<Self>, wake: Wake) {
        match wake {
            Wake::No => {}
            Wake::Signal => {
                self.refill_cond.notify_one();
            }
            Wake::Spawn => {
                if self.spawn_refiller().is_err() {
                    // No thread (the process's limit): the reserve stays empty and every zspage
                    // is populated by its writer, as without a reserve; a later miss retries.
                    let mut st = self.state.lock();
                    st.refiller_running = false;
                    st.refill_wanted = 0;
                }
            }
        }
    }

    /// The refiller: fills every wanted reserve list to its target, one frame at a time with
    /// the state mutex dropped while it faults pages in, then sleeps until woken; exits when
    /// stopped or after [`REFILLER_IDLE`] without work. Serving swap, the refiller is
    /// [`swap_refill_loop`](Self::swap_refill_loop) instead.
    fn refill_loop(&self) {
        if self.state.lock().reserve_resident {
            return self.swap_refill_loop();
        }
        let mut st = self.state.lock();
        loop {
            if st.refill_stop {
                st.refiller_running = false;
                return;
            }
            if st.refill_wanted == 0 {
                if self
                    .refill_cond
                    .wait_for(&mut st, REFILLER_IDLE)
                    .timed_out()
                    && st.refill_wanted == 0
                {
                    st.refiller_running = false;
                    return;
                }
                continue;
            }
            let k = st.refill_wanted.trailing_zeros() as usize;
            if st.reserve[k].len() >= st.reserve_target[k] {
                st.refill_wanted &= !(1u64 << k);
                continue;
            }
            let epoch = st.reserve_epoch;
            drop(st);
            let frame = self.alloc_for(k);
            if let Ok(frame) = &frame {
                self.populate(frame, k);
            }
            st = self.state.lock();
            match frame {
                Ok(frame) if st.reserve_epoch == epoch && !st.refill_stop => {
                    st.reserve[k].push(frame);
                    st.reserve_pages += k;
                }
                Ok(frame) => {
                    // Trimmed (or stopping) meanwhile: give the pages back.
                    drop(st);
                    self.discard(frame, k);
                    st = self.state.lock();
                }
                // No address space: stop refilling; the writers report ENOMEM themselves.
                Err(_) => st.refill_wanted = 0,
            }
        }
    }

    /// Stops the refiller and waits for it (the pool's `Drop`). The reserve's frames stay
    /// mapped until the allocator drops.
    pub(crate) fn stop_refiller(&self) {
        self.state.lock().refill_stop = true;
        self.refill_cond.notify_all();
        self.reserve_cond.notify_all();
        if let Some(t) = self.refiller.lock().take() {
            let _ = t.join();
        }
    }

    /// Returns `frame`, whose zspage used its first `pages` pages. Taking the token by value
    /// proves nobody can still read it. The frame stays resident in the frame cache if that
    /// has room for `pages` more pages (see [`FRAME_CACHE_BYTES`]); otherwise it joins the batch
    /// of frames to drop, and the release that completes the batch drops it (see
    /// [`DROP_BATCH_PAGES`]).
    pub(crate) fn release(&self, frame: Frame, pages: usize) {
        assert!((1..=self.frame_pages).contains(&pages), "{pages} pages");
        // Lists by page count hold frames that can take that many pages: a single-page frame
        // is released as one page, as it was handed out.
        assert!(
            pages * self.page_size_bytes <= frame.len_bytes,
            "{pages} pages released in a frame of {} bytes",
            frame.len_bytes
        );
        let batch = {
            let mut st = self.state.lock();
            // Serving swap: the reserve takes it back first (its pages are resident), up to
            // its list's target and the reserve's size (targets follow demand, so a list may
            // be under its target while the reserve as a whole is full).
            if st.reserve_resident
                && st.reserve[pages].len() < st.reserve_target[pages]
                && st.reserve_pages + pages <= st.swap.high_pages
            {
                st.reserve[pages].push(frame);
                st.reserve_pages += pages;
                st.swap.added_at = std::time::Instant::now();
                return;
            }
            if st.cached_pages + pages <= self.cache_limit_pages {
                st.cached_pages += pages;
                st.cached[pages].push(frame);
                return;
            }
            st.dropping_batch.push((frame, pages));
            st.dropping_batch_pages += pages;
            if st.dropping_batch_pages < self.drop_batch_pages {
                return;
            }
            st.dropping_batch_pages = 0;
            std::mem::take(&mut st.dropping_batch)
        };
        self.discard_batch(batch);
    }

    /// Drops the used pages of every frame of `batch` from the resident set: sorted by frame
    /// index, one hole punched over each range of adjacent frames (from the first frame's start
    /// to the last one's used pages: the unused tails in between hold no pages, so punching
    /// them costs nothing and changes nothing); a refused range goes frame by frame through
    /// [`discard`](Self::discard).
    fn discard_batch(&self, mut batch: Vec<(Frame, usize)>) {
        batch.sort_unstable_by_key(|(f, _)| f.offset);
        let mut frames = batch.into_iter().peekable();
        while let Some(first) = frames.next() {
            let mut range = vec![first];
            while let Some((next, _)) = frames.peek() {
                let (last, _) = range.last().expect("a range has a frame");
                if last.offset + last.len_bytes as u64 != next.offset {
                    break;
                }
                range.push(frames.next().expect("peeked"));
            }
            let (start, _) = &range[0];
            let (last, last_pages) = range.last().expect("a range has a frame");
            let last_len = (last_pages * self.page_size_bytes)
                .next_multiple_of(self.sys_page_bytes)
                .min(last.len_bytes);
            // One hole from the first frame's start to the end of the last one's used pages:
            // the unused tails in between hold no pages, so punching them changes nothing.
            let to = last.offset + last_len as u64;
            if self.punch(start.offset, to - start.offset).is_ok() {
                let mut st = self.state.lock();
                for (frame, _) in range {
                    st.free[self.kind_of(&frame)].push(frame.index);
                }
            } else {
                for (frame, pages) in range {
                    self.discard(frame, pages);
                }
            }
        }
    }

    /// Empties the frame cache, the reserve (unless serving swap) and the batch waiting to be
    /// dropped, returning their pages to the operating system. The reserve is refilled only
    /// when writers ask for frames again.
    pub(crate) fn trim(&self) {
        let cached: Vec<(Frame, usize)> = {
            let mut st = self.state.lock();
            st.cached_pages = 0;
            st.dropping_batch_pages = 0;
            let mut out = std::mem::take(&mut st.dropping_batch);
            for (pages, list) in st.cached.iter_mut().enumerate() {
                out.extend(list.drain(..).map(|f| (f, pages)));
            }
            // Serving swap, the reserve stays: it is what keeps writes from faulting.
            if !st.reserve_resident {
                st.reserve_pages = 0;
                st.refill_wanted = 0;
                st.reserve_epoch += 1;
                for (pages, list) in st.reserve.iter_mut().enumerate() {
                    out.extend(list.drain(..).map(|f| (f, pages)));
                }
            }
            out
        };
        self.discard_batch(cached);
    }

    /// Pages held resident by the frame cache.
    pub(crate) fn cached_pages(&self) -> usize {
        self.state.lock().cached_pages
    }

    /// Pages of released frames still resident in the batch waiting to be dropped (below
    /// [`DROP_BATCH_PAGES`]).
    pub(crate) fn dropping_batch_pages(&self) -> usize {
        self.state.lock().dropping_batch_pages
    }

    /// Drops the first `pages` pages of `frame` from the resident set (punched out of the
    /// file: see the module docs, "Locked memory") and puts it on the free list. If the kernel
    /// refuses, the pages stay with the frame (kept, never lost).
    fn discard(&self, frame: Frame, pages: usize) {
        let len_bytes = (pages * self.page_size_bytes)
            .next_multiple_of(self.sys_page_bytes)
            .min(frame.len_bytes);
        let r = self.punch(frame.offset, len_bytes as u64);
        debug_assert!(r.is_ok(), "{r:?}");
        let kind = self.kind_of(&frame);
        self.state.lock().free[kind].push(frame.index);
    }

    /// Bytes of address space reserved so far.
    pub(crate) fn reserved_bytes(&self) -> usize {
        self.state
            .lock()
            .chunks
            .iter()
            .map(|c| c.map.len_bytes())
            .sum()
    }

    /// Resident bytes of the reserved chunks, measured with `mincore` (exact for this pool,
    /// unlike the process RSS). O(reserved address space): for tests.
    #[cfg(test)]
    pub(crate) fn resident_bytes(&self) -> usize {
        let st = self.state.lock();
        let mut resident = 0;
        let mut vec = Vec::new();
        for chunk in &st.chunks {
            let pages = chunk.map.len_bytes() / self.sys_page_bytes;
            vec.clear();
            vec.resize(pages, 0u8);
            // SAFETY: `base..base+len_bytes` is a live mapping we own; `vec` has one byte per
            // system page of it, as mincore requires.
            let rc = unsafe {
                libc::mincore(
                    chunk.base().as_ptr().cast(),
                    chunk.map.len_bytes(),
                    vec.as_mut_ptr(),
                )
            };
            assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
            resident += vec.iter().filter(|&&b| b & 1 != 0).count() * self.sys_page_bytes;
        }
        resident
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_distinct_aligned_and_reused() {
        let a = FrameAllocator::with_cache_bytes(4096, 0);
        assert_eq!(a.frame_bytes(), 8 * 4096);
        let mut frames: Vec<Frame> = (0..5000).map(|_| a.alloc().unwrap()).collect();
        assert_eq!(a.reserved_bytes(), 2 * CHUNK_BYTES);
        let mut addrs: Vec<usize> = frames.iter().map(Frame::addr).collect();
        addrs.sort_unstable();
        addrs.dedup();
        assert_eq!(addrs.len(), 5000);
        assert!(addrs.iter().all(|a| a % 4096 == 0));
        let f = frames.pop().unwrap();
        let addr = f.addr();
        a.release(f, 1);
        assert_eq!(a.alloc().unwrap().addr(), addr);
    }

    /// Zspages of one page get single-page frames, packed in chunks of their own (so their
    /// page tables are as dense as the pages); the other page counts get full frames; each
    /// kind is reused only as its kind, and a frame released is punched out whole.
    #[test]
    fn one_page_zspages_get_single_page_frames() {
        let a = Arc::new(FrameAllocator::with_cache_bytes(4096, 0));
        let n = 3000;
        let small: Vec<Frame> = (0..n).map(|_| a.alloc_populated(1).unwrap()).collect();
        let full: Vec<Frame> = (0..10).map(|_| a.alloc_populated(3).unwrap()).collect();
        assert!(small.iter().all(|f| f.len_bytes == 4096));
        assert!(full.iter().all(|f| f.len_bytes == 8 * 4096));
        // The single-page frames are consecutive pages of one chunk.
        let first = small[0].addr();
        for (i, f) in small.iter().enumerate() {
            assert_eq!(f.addr(), first + i * 4096);
        }
        assert_eq!(a.reserved_bytes(), 2 * CHUNK_BYTES);
        assert_eq!(a.resident_bytes(), (n + 10 * 3) * 4096);
        // No two frames overlap, across kinds.
        let mut spans: Vec<(usize, usize)> = small
            .iter()
            .chain(&full)
            .map(|f| (f.addr(), f.addr() + f.len_bytes))
            .collect();
        spans.sort_unstable();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
        let mut small = small;
        let mut full = full;
        let s = small.pop().unwrap();
        let (s_addr, s_index) = (s.addr(), s.index);
        a.release(s, 1);
        let f = full.pop().unwrap();
        let f_addr = f.addr();
        a.release(f, 3);
        assert_eq!(a.resident_bytes(), (n - 1 + 9 * 3) * 4096);
        // A full frame is not handed to one page, nor a single page to three.
        let again = a.alloc_populated(1).unwrap();
        assert_eq!((again.addr(), again.index), (s_addr, s_index));
        assert_eq!(a.alloc_populated(3).unwrap().addr(), f_addr);
        // The records' numbers follow the chunks: the small chunk came first.
        assert!(small.iter().all(|f| f.index < 32768));
        assert!(full.iter().all(|f| f.index >= 32768));
    }

    /// The frames' files read back by another allocator give every frame the same place,
    /// size and bytes, whatever its kind; records' files without the kinds' table (an earlier
    /// binary's) read as full chunks only, and such an allocator adds full frames only.
    #[test]
    fn chunk_kinds_come_back_from_the_files() {
        let a = FrameAllocator::with_cache_bytes(4096, 0);
        let mut frames = Vec::new();
        for i in 0..40u8 {
            let mut f = a.alloc_for(if i % 3 == 0 { 4 } else { 1 }).unwrap();
            f.bytes_mut(0, 4096).fill(i);
            a.set_record(&f, u64::from(i) + 1, 0);
            frames.push(f);
        }
        let (frames_file, records_file) = a.files().unwrap();
        let b = FrameAllocator::with_cache_bytes(4096, 0)
            .with_files(frames_file, records_file)
            .unwrap();
        assert!(b.small_frames);
        assert_eq!(b.carved_frames(), a.carved_frames());
        for (i, f) in frames.iter().enumerate() {
            let g = b.claim(f.index);
            assert_eq!(
                (g.len_bytes, g.offset),
                (f.len_bytes, f.offset),
                "frame {i}"
            );
            assert_eq!(g.bytes(0, 4096), &[i as u8; 4096][..]);
            assert_eq!(b.frame_pages_of(f.index), f.len_bytes / 4096);
            assert_eq!(b.record(f.index).what.load(Ordering::Relaxed), i as u64 + 1);
        }
        // An earlier binary's files: a records' file without the table.
        let old_frames = ShmFile::create("frames").unwrap();
        old_frames.set_len(CHUNK_BYTES as u64).unwrap();
        let old_records = ShmFile::create("frame-records").unwrap();
        old_records
            .set_len(FrameRecords::file_bytes(false) as u64)
            .unwrap();
        let c = FrameAllocator::with_cache_bytes(4096, 0)
            .with_files(old_frames, old_records)
            .unwrap();
        assert!(!c.small_frames);
        assert_eq!(c.carved_frames() as usize, c.frames_per_chunk);
        assert_eq!(c.frame_pages_of(0), 8);
        c.release_unclaimed(&[]).unwrap();
        let one = c.alloc_for(1).unwrap();
        assert_eq!(one.len_bytes, 8 * 4096);
    }

    /// A thread making a new chunk (which may wait for memory) holds no lock that frees,
    /// reuses or the reserve need: while one waits inside the making, another releases a
    /// frame, gets it back and takes one from the reserve; and the chunk made is added whole.
    #[test]
    fn making_a_chunk_holds_up_no_free_or_reserve_path() {
        let a = Arc::new(FrameAllocator::with_cache_bytes(4096, 0));
        a.set_reserve(8, &[1]).unwrap();
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while a.state.lock().reserve[1].is_empty() {
            assert!(
                std::time::Instant::now() < end,
                "the refiller filled nothing"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // The refiller left out: the one chunk made below is the grower's.
        a.state.lock().refill_paused = true;
        // Every full frame of the chunks made so far carved: the next alloc makes a chunk.
        let mut frames = vec![a.alloc().unwrap()];
        loop {
            let mut st = a.state.lock();
            if st.free[0].is_empty() && st.carving[0].is_none() {
                break;
            }
            frames.push(a.take_carved(&mut st, false).unwrap());
        }
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let go_rx = Mutex::new(go_rx);
        *a.grow_hook.lock() = Some(Hook(Box::new(move || {
            entered_tx.send(()).unwrap();
            let _ = go_rx.lock().recv();
        })));
        let grower = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || a.alloc().unwrap())
        };
        entered_rx.recv().unwrap();
        // The grower waits inside the making of a chunk; these go on regardless.
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        {
            let a = Arc::clone(&a);
            let f = frames.pop().unwrap();
            let addr = f.addr();
            std::thread::spawn(move || {
                a.release(f, 1);
                let again = a.alloc().unwrap();
                let reserved = a.alloc_populated(1).unwrap();
                done_tx
                    .send((again.addr() == addr, reserved.addr()))
                    .unwrap();
            });
        }
        let (reused, _) = done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("a free, a reuse and a reserve take waited for the thread making a chunk");
        assert!(reused, "the released frame came back");
        go_tx.send(()).unwrap();
        let made = grower.join().unwrap();
        let st = a.state.lock();
        let last = st.chunks.last().unwrap();
        assert!(!last.small);
        assert_eq!(made.index, last.first_index);
        drop(st);
        a.stop_refiller();
    }

    /// Serving swap, a writer that finds the reserve empty waits for the refiller: served
    /// when it adds a frame, failed (`ENOMEM`, nothing faulted in) when it adds none in
    /// [`SWAP_MISS_WAIT`]; counted either way; the starved hook called once the reserve has
    /// gained nothing for [`SWAP_STARVED`].
    #[test]
    fn swap_reserve_miss_waits_for_the_refiller_then_fails() {
        let a = Arc::new(FrameAllocator::with_cache_bytes(4096, 0));
        a.set_reserve(8, &[1]).unwrap();
        a.state.lock().refill_paused = true;
        let mut taken: Vec<Frame> = (0..8).map(|_| a.alloc_populated(1).unwrap()).collect();
        assert_eq!(a.reserve_pages(), 0);
        let resident = a.resident_bytes();
        let t = std::time::Instant::now();
        let e = a.alloc_populated(1).unwrap_err();
        assert!(t.elapsed() >= SWAP_MISS_WAIT, "{:?}", t.elapsed());
        assert!(e.to_string().contains("swap reserve is empty"), "{e}");
        assert_eq!(
            a.resident_bytes(),
            resident,
            "nothing faulted in by the writer"
        );
        assert_eq!(a.swap_stats().misses, 1);
        // Starved (no frame gained for SWAP_STARVED): a failing writer calls the hook, at
        // most once per SWAP_STARVED.
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = Arc::clone(&calls);
        a.on_starved(Box::new(move || {
            c.fetch_add(1, Ordering::Relaxed);
        }));
        a.state.lock().swap.added_at -= SWAP_STARVED;
        assert!(a.alloc_populated(1).is_err());
        assert!(a.alloc_populated(1).is_err());
        assert_eq!(calls.load(Ordering::Relaxed), 1);
        assert_eq!(a.swap_stats().misses, 3);
        // The refiller resumes while a writer waits: the writer gets its frame.
        let waiter = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || a.alloc_populated(1))
        };
        std::thread::sleep(SWAP_MISS_WAIT / 4);
        a.state.lock().refill_paused = false;
        a.state.lock().swap.kicked = true;
        a.refill_cond.notify_all();
        taken.push(
            waiter
                .join()
                .unwrap()
                .expect("served once the refiller added a frame"),
        );
        assert_eq!(a.swap_stats().misses, 4);
        a.stop_refiller();
        for f in taken {
            a.release(f, 1);
        }
    }

    #[test]
    fn swap_reserve_hands_out_resident_frames_and_is_refilled() {
        let a = Arc::new(FrameAllocator::with_cache_bytes(4096, 0));
        // 64 pages shared evenly by two page counts: 32 frames of 1 page, 8 of 4.
        a.set_reserve(64, &[1, 4]).unwrap();
        assert_eq!(a.reserve_pages(), 64);
        assert_eq!(a.resident_bytes(), 64 * 4096);
        assert!(a.state.lock().refiller_running, "started with the reserve");
        let f = a.alloc_populated(4).unwrap();
        // No frame of 2 pages: a 4-page one, whose last 2 pages go back to the kernel. Taken
        // under the lock with the refiller's work: it may have replaced the first already.
        let mut g = a.alloc_populated(2).unwrap();
        g.bytes_mut(0, 2 * 4096).fill(7);
        assert_eq!(a.swap_stats().taken_pages, 8);
        // At its next tick the refiller gives 2-page frames a target (they were asked for);
        // the next ask finds their list empty and wakes it, and it fills that list too.
        std::thread::sleep(3 * SWAP_TICK);
        let g2 = a.alloc_populated(2).unwrap();
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while a.state.lock().reserve[2].is_empty() && std::time::Instant::now() < end {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            !a.state.lock().reserve[2].is_empty(),
            "{:?}",
            a.swap_stats()
        );
        a.release(g2, 2);
        // Compaction's trim keeps the swap reserve; the refiller does not leave when idle.
        let held = a.reserve_pages();
        a.trim();
        assert_eq!(a.reserve_pages(), held);
        std::thread::sleep(REFILLER_IDLE + std::time::Duration::from_millis(300));
        assert!(a.state.lock().refiller_running, "the swap refiller stays");
        a.stop_refiller();
        assert!(!a.state.lock().refiller_running);
        // Without the refiller the reserve runs out: then a zspage is faulted in by its
        // writer, counted.
        let held = a.reserve_pages();
        let mut taken = Vec::new();
        while a.reserve_pages() > 0 {
            taken.push(a.alloc_populated(1).unwrap());
            assert!(taken.len() <= held, "more frames than the reserve held");
        }
        assert_eq!(a.swap_stats().misses, 0);
        let resident = a.resident_bytes();
        let extra = a.alloc_populated(4).unwrap();
        assert_eq!(a.swap_stats().misses, 1);
        assert_eq!(
            a.resident_bytes(),
            resident + 4 * 4096,
            "faulted in by the writer"
        );
        a.release(extra, 4);
        assert_eq!(a.reserve_pages(), 4, "back to the reserve");
        let extra = a.alloc_populated(4).unwrap();
        // Released frames go back to the reserve, resident, and serve the next allocation.
        a.release(f, 4);
        assert_eq!(a.reserve_pages(), 4);
        let f = a.alloc_populated(4).unwrap();
        assert_eq!(a.reserve_pages(), 0);
        a.release(extra, 4);
        assert!(g.bytes(0, 2 * 4096).iter().all(|&b| b == 7));
        a.release(f, 4);
        a.release(g, 2);
        for frame in taken {
            a.release(frame, 1);
        }
    }

    /// Serving swap, the reserve never holds more than its size: when demand moves from one
    /// page count to another, the lists follow it by giving back frames of the list above its
    /// new target, and released frames rejoin it only while it has room.
    #[test]
    fn swap_reserve_follows_demand_within_its_size() {
        let a = Arc::new(FrameAllocator::with_cache_bytes(4096, 0));
        // 32 frames of 1 page and 8 of 4 at first.
        a.set_reserve(64, &[1, 4]).unwrap();
        let mut most = a.reserve_pages();
        let end = std::time::Instant::now() + 12 * SWAP_TICK;
        while std::time::Instant::now() < end {
            // Only 4-page zspages are asked for, seven at a time (the list runs low: the
            // refiller is woken).
            let frames: Vec<Frame> = (0..7).map(|_| a.alloc_populated(4).unwrap()).collect();
            most = most.max(a.reserve_pages() + 7 * 4);
            for f in frames {
                a.release(f, 4);
            }
            most = most.max(a.reserve_pages());
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        std::thread::sleep(3 * SWAP_TICK);
        let st = a.state.lock();
        let (one, four) = (st.reserve[1].len(), st.reserve[4].len());
        assert!(st.reserve_target[4] > 8, "targets follow demand");
        assert_eq!(four, st.reserve_target[4], "the 4-page list is filled");
        assert!(
            one <= st.reserve_target[1].max(1),
            "{one} one-page frames kept"
        );
        assert!(st.reserve_pages <= 64, "{} pages held", st.reserve_pages);
        drop(st);
        assert!(
            most <= 64 + 7 * 4,
            "{most} pages held at most, with the 7 frames taken"
        );
        a.stop_refiller();
    }

    #[test]
    fn release_zeroes_and_drops_residency() {
        let a = FrameAllocator::with_cache_bytes(4096, 0);
        let mut f = a.alloc().unwrap();
        assert_eq!(a.resident_bytes(), 0);
        f.bytes_mut(0, 3 * 4096).fill(0xa5);
        assert_eq!(a.resident_bytes(), 3 * 4096);
        assert!(f.bytes(4096, 10).iter().all(|&b| b == 0xa5));
        a.release(f, 3);
        assert_eq!(a.resident_bytes(), 0);
        let f = a.alloc().unwrap();
        assert!(f.bytes(0, 3 * 4096).iter().all(|&b| b == 0));
    }

    #[test]
    #[should_panic(expected = "beyond")]
    fn out_of_frame_access_panics() {
        let a = FrameAllocator::with_cache_bytes(4096, 0);
        let f = a.alloc().unwrap();
        f.bytes(8 * 4096 - 4, 8);
    }

    #[test]
    fn large_page_sizes() {
        for page in [16384, 65536] {
            let a = FrameAllocator::with_cache_bytes(page, 0);
            assert_eq!(a.frame_bytes(), 8 * page);
            let mut f = a.alloc().unwrap();
            f.bytes_mut(8 * page - 1, 1)[0] = 1;
            a.release(f, 8);
            assert_eq!(a.resident_bytes(), 0);
        }
    }

    #[test]
    fn frame_cache_keeps_frames_resident_bounded_and_by_page_count() {
        let a = Arc::new(FrameAllocator::with_cache_bytes(4096, 4 * 4096));
        let mut f = a.alloc_populated(3).unwrap();
        assert_eq!(a.resident_bytes(), 3 * 4096, "populated up front");
        f.bytes_mut(0, 3 * 4096).fill(0x5a);
        let addr = f.addr();
        a.release(f, 3);
        assert_eq!(a.cached_pages(), 3);
        assert_eq!(a.resident_bytes(), 3 * 4096, "cached frames stay resident");
        // A different page count does not take it; the same page count does, stale bytes and all.
        let g = a.alloc_populated(2).unwrap();
        assert_ne!(g.addr(), addr);
        let f = a.alloc_populated(3).unwrap();
        assert_eq!(f.addr(), addr);
        assert_eq!(a.cached_pages(), 0);
        assert!(f.bytes(0, 3 * 4096).iter().all(|&b| b == 0x5a));
        // Over the limit: the second frame is discarded, not cached.
        a.release(f, 3);
        a.release(g, 2);
        assert_eq!(a.cached_pages(), 3);
        assert_eq!(a.resident_bytes(), 3 * 4096);
        a.trim();
        assert_eq!(a.cached_pages(), 0);
        assert_eq!(a.resident_bytes(), 0);
    }

    /// Pages of `[addr, addr + len)` that are present and mlocked, from `/proc/self/pagemap`
    /// (the frame number, bits 0–54, needs root) and `/proc/kpageflags` (`KPF_MLOCKED`, bit 33).
    fn mlocked_pages(addr: usize, len: usize) -> usize {
        use std::os::unix::fs::FileExt;
        let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
        let kpageflags = std::fs::File::open("/proc/kpageflags").unwrap();
        let page = sys_page_bytes();
        let mut locked = 0;
        for p in (addr..addr + len).step_by(page) {
            let mut entry = [0u8; 8];
            pagemap
                .read_exact_at(&mut entry, (p / page * 8) as u64)
                .unwrap();
            let entry = u64::from_le_bytes(entry);
            if entry >> 63 == 0 {
                continue; // not present
            }
            let pfn = entry & ((1 << 55) - 1);
            assert_ne!(pfn, 0, "pagemap hides frame numbers: run as root");
            let mut flags = [0u8; 8];
            kpageflags.read_exact_at(&mut flags, pfn * 8).unwrap();
            locked += usize::from(u64::from_le_bytes(flags) >> 33 & 1 == 1);
        }
        locked
    }

    /// VMAs of this process overlapping `[addr, addr + len)`, from `/proc/self/maps`.
    fn vmas_over(addr: usize, len: usize) -> usize {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter(|l| {
                let range = l.split_whitespace().next().unwrap();
                let (start, end) = range.split_once('-').unwrap();
                let start = usize::from_str_radix(start, 16).unwrap();
                let end = usize::from_str_radix(end, 16).unwrap();
                start < addr + len && addr < end
            })
            .count()
    }

    /// What `uzram serve --swap` relies on: in a process locked as the server locks itself
    /// (`mlockall(MCL_FUTURE | MCL_ONFAULT)`), a frame's pages are locked as they are faulted
    /// in, leave the process when the frame is released, and are locked again when it is
    /// reused (holes punched in the frames' file free locked pages and change no VMA). In a
    /// child process: locking changes the whole process.
    #[test]
    fn locked_frames_leave_the_process_and_are_locked_again() {
        if !super::super::tests::isolated(
            "zsmalloc::page_alloc::tests::locked_frames_leave_the_process_and_are_locked_again",
        ) {
            return;
        }
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        assert_eq!(uid, 0, "needs root (CI runs as root)");
        // SAFETY: mlockall takes flags only.
        let rc = unsafe { libc::mlockall(libc::MCL_FUTURE | libc::MCL_ONFAULT) };
        assert_eq!(rc, 0, "mlockall: {}", std::io::Error::last_os_error());
        const FRAMES: usize = 256;
        const PAGES: usize = 3;
        let page = 4096;
        let a = Arc::new(FrameAllocator::with_cache_bytes(page, 0));
        let mut frames: Vec<Frame> = (0..FRAMES)
            .map(|_| a.alloc_populated(PAGES).unwrap())
            .collect();
        for f in &mut frames {
            f.bytes_mut(0, PAGES * page).fill(0x5a);
        }
        let chunk = a.state.lock().chunks[0].base().as_ptr() as usize;
        let span = FRAMES * a.frame_bytes();
        let vmas = vmas_over(chunk, span);
        assert_eq!(a.resident_bytes(), FRAMES * PAGES * page);
        assert_eq!(
            mlocked_pages(chunk, span),
            FRAMES * PAGES,
            "locked on fault"
        );

        // Every other frame, then the rest: nothing of them stays resident, and punching
        // holes changes no VMA.
        let (odd, even): (Vec<_>, Vec<_>) = frames
            .into_iter()
            .enumerate()
            .partition(|(i, _)| i % 2 == 1);
        for (_, f) in odd {
            a.release(f, PAGES);
        }
        assert_eq!(a.resident_bytes(), FRAMES / 2 * PAGES * page);
        assert_eq!(mlocked_pages(chunk, span), FRAMES / 2 * PAGES);
        assert_eq!(vmas_over(chunk, span), vmas);
        for (_, f) in even {
            a.release(f, PAGES);
        }
        assert_eq!(a.resident_bytes(), 0, "released frames stay resident");

        // Reused: zeroes, faulted in and locked again.
        let frames: Vec<Frame> = (0..FRAMES)
            .map(|_| a.alloc_populated(PAGES).unwrap())
            .collect();
        assert!(frames
            .iter()
            .all(|f| f.bytes(0, PAGES * page).iter().all(|&b| b == 0)));
        assert_eq!(a.resident_bytes(), FRAMES * PAGES * page);
        assert_eq!(mlocked_pages(chunk, span), FRAMES * PAGES, "relocked");
        assert_eq!(vmas_over(chunk, span), vmas);
        for f in frames {
            a.release(f, PAGES);
        }
        assert_eq!(a.resident_bytes(), 0);
    }

    #[test]
    fn reserve_hands_out_populated_zero_frames_and_trims() {
        let a = Arc::new(FrameAllocator::with_cache_bytes(4096, 0).with_reserve());
        // The first allocation misses (populated here) and starts the refiller.
        let first = a.alloc_populated(2).unwrap();
        let target = reserve_target_frames(2);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while a.reserve_pages() < target * 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "refiller never filled"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(
            a.reserve_pages(),
            target * 2,
            "filled to its target, no further"
        );
        assert_eq!(a.resident_bytes(), (target + 1) * 2 * 4096);
        // Frames from the reserve: resident and zero; using them refills the list.
        let mut taken: Vec<Frame> = (0..target).map(|_| a.alloc_populated(2).unwrap()).collect();
        for f in &mut taken {
            assert!(f.bytes(0, 2 * 4096).iter().all(|&b| b == 0));
            f.bytes_mut(0, 2 * 4096).fill(0x33);
        }
        while a.reserve_pages() < target * 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "refiller never refilled"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Trim empties the reserve and it stays empty until asked again.
        a.trim();
        assert_eq!(a.reserve_pages(), 0);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(a.reserve_pages(), 0);
        for f in taken {
            a.release(f, 2);
        }
        a.release(first, 2);
        assert_eq!(a.resident_bytes(), 0);
        // Idle for REFILLER_IDLE: the thread exits; the next miss spawns another.
        while a.state.lock().refiller_running {
            assert!(
                std::time::Instant::now() < deadline + REFILLER_IDLE,
                "refiller never left"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let again = a.alloc_populated(2).unwrap();
        while a.reserve_pages() < target * 2 {
            assert!(
                std::time::Instant::now() < deadline + 2 * REFILLER_IDLE,
                "no new refiller"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        a.release(again, 2);
        a.stop_refiller();
        assert!(!a.state.lock().refiller_running);
        a.trim();
        // Stopped: a miss populates in the caller and nothing refills.
        let f = a.alloc_populated(1).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(a.reserve_pages(), 0);
        a.release(f, 1);
    }

    #[test]
    fn drop_batches_wait_for_a_batch_then_drop_everything_coalesced() {
        let a = FrameAllocator::with_cache_bytes(4096, 0).with_drop_batches();
        let pages = 4;
        let n = DROP_BATCH_PAGES / pages;
        let mut frames: Vec<Frame> = (0..n + 2).map(|_| a.alloc().unwrap()).collect();
        for f in &mut frames {
            f.bytes_mut(0, pages * 4096).fill(0x77);
        }
        let spare = frames.pop().unwrap();
        let lonely = frames.pop().unwrap();
        assert_eq!(a.resident_bytes(), (n + 2) * pages * 4096);
        // Released in a scrambled order: the batch sorts them.
        let mut order: Vec<usize> = (0..n).collect();
        order.reverse();
        order.swap(1, n / 2);
        let mut frames: Vec<Option<Frame>> = frames.into_iter().map(Some).collect();
        for (k, &i) in order.iter().enumerate() {
            a.release(frames[i].take().unwrap(), pages);
            if k + 1 < n {
                assert_eq!(a.dropping_batch_pages(), (k + 1) * pages, "waits");
            }
        }
        assert_eq!(a.dropping_batch_pages(), 0);
        assert_eq!(
            a.resident_bytes(),
            2 * pages * 4096,
            "the batch was dropped"
        );
        // Dropped frames are reused and read as zeroes.
        let reused = a.alloc().unwrap();
        assert!(reused.bytes(0, pages * 4096).iter().all(|&b| b == 0));
        // A partial batch is dropped by trim.
        a.release(lonely, pages);
        assert_eq!(a.dropping_batch_pages(), pages);
        a.trim();
        assert_eq!(a.dropping_batch_pages(), 0);
        // Left: `spare`, and `reused`, whose pages reading mapped (the zero page).
        assert_eq!(a.resident_bytes(), 2 * pages * 4096);
        a.release(spare, pages);
        a.release(reused, pages);
        a.trim();
        assert_eq!(a.resident_bytes(), 0);
    }
}
