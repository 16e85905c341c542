//! The swap reserve: memory a server backing swap (`uzram serve --swap`) gets ahead of need, so
//! that a request does not wait for memory while the reserve lasts.
//!
//! A server backing swap stores the pages the kernel writes out to free memory. Its own page
//! faults under memory pressure enter direct reclaim, which cannot swap anything out for it (it
//! is an I/O flusher: `PF_MEMALLOC_NOIO`) and may wait for the very writes it is serving
//! (docs/ublk.md, "Swap on ublk"). So a device serving swap is given the server's
//! [`SwapReserve`] when it is made (`Device::set_swap_reserve`), and then:
//!
//! - its slot table is faulted in whole when it is initialised (16 bytes a page, as the kernel's
//!   zram allocates its table at `disksize`);
//! - its pool's zspages come from the reserve's frames, already faulted in (and locked, the
//!   server having locked its memory): one zsmalloc frame allocator for every pool of the
//!   server (`zsmalloc::page_alloc`, "The reserve"), refilled by one thread
//!   (`uzram-zs-reserve`) off the request path between watermarks that follow the write rate;
//! - a write that needs a new zspage when the reserve has no frame for it waits for the
//!   refiller a tenth of a second at most, then fails with `ENOMEM` (as zram's write fails when
//!   zsmalloc gets no page; the kernel keeps the page); that is counted
//!   ([`SwapReserveStats::misses`]). The refiller is the one thread of the server that is not
//!   an I/O flusher: its reclaim swaps out and may call the OOM killer, as a process's does.
//!
//! The reserve is one per server, not one per device: its size (`--swap-reserve`) bounds the
//! memory held ahead of need whatever the number of devices.

use std::sync::Arc;

use crate::error::Result;
use crate::shm::ShmFile;
use crate::zsmalloc::page_alloc::FrameAllocator;
pub use crate::zsmalloc::page_alloc::SwapReserveStats;
use crate::zsmalloc::{ClassTable, POOL_PAGE_BYTES};

/// Frames of 16 pool pages: a run of the largest device page (64 KiB) fits one, so every
/// pool of the server, whatever its page size, takes frames from the one allocator.
const FRAME_PAGES: usize = 16;

/// The swap reserve's size when `--swap-reserve` is not given: a 64th of the RAM, between
/// 8 MiB and 32 MiB. The reserve covers the refiller's lag behind a burst of swap-outs; the
/// refiller takes pages ahead of other processes (`SCHED_DEADLINE`), so the reserve need not
/// cover the time the whole machine takes to reclaim, and every MiB it holds is a MiB the
/// pages swapped out cannot use (in a 512 MiB VM under a hog larger than RAM, 8 MiB missed no
/// write and let the pool grow 5 MB further than 16 MiB did).
pub fn default_swap_reserve_bytes(ram_bytes: u64) -> u64 {
    (ram_bytes / 64).clamp(8 << 20, 32 << 20)
}

/// The server's swap reserve; see the module docs. Shared (`Arc`) by every device serving
/// swap; its refiller thread stops when the last holder drops it.
#[derive(Debug)]
pub struct SwapReserve {
    frames: Arc<FrameAllocator>,
    bytes: usize,
}

impl SwapReserve {
    /// Faults in a reserve of `bytes` (rounded down to pool pages, at least one page per
    /// zspage size) and starts its refiller. `ENOMEM` when the address space or the thread
    /// cannot be had.
    pub fn new(bytes: usize) -> Result<Arc<SwapReserve>> {
        let frames = Arc::new(
            FrameAllocator::with_frame_pages(
                POOL_PAGE_BYTES,
                FRAME_PAGES,
                crate::zsmalloc::page_alloc::FRAME_CACHE_BYTES,
            )
            .with_drop_batches(),
        );
        frames.set_reserve(bytes / POOL_PAGE_BYTES, &Self::page_counts())?;
        Ok(Arc::new(SwapReserve { frames, bytes }))
    }

    /// The reserve a previous process left in `frames` and `records` (its
    /// [`files`](Self::files)), of `bytes` (as [`new`](Self::new)), in recovery: recover each
    /// device that served swap from it (`Device::recover_swap`), then call
    /// [`finish_recovery`](Self::finish_recovery), which releases the frames no device
    /// claimed, fills the reserve and starts its refiller. `EINVAL` if the files are not a
    /// reserve's.
    pub fn recover(bytes: usize, frames: ShmFile, records: ShmFile) -> Result<Arc<SwapReserve>> {
        let frames = FrameAllocator::with_frame_pages(
            POOL_PAGE_BYTES,
            FRAME_PAGES,
            crate::zsmalloc::page_alloc::FRAME_CACHE_BYTES,
        )
        .with_drop_batches()
        .with_files(frames, records)?;
        frames.begin_recovery();
        Ok(Arc::new(SwapReserve {
            frames: Arc::new(frames),
            bytes,
        }))
    }

    /// Ends recovery (see [`recover`](Self::recover)): frames no recovered device claimed are
    /// given back to the system, and the reserve is faulted in and refilled as a new one's.
    /// Nothing to do for a reserve that was not recovered.
    pub fn finish_recovery(&self) -> Result<()> {
        if !self.frames.is_recovering() {
            return Ok(());
        }
        self.frames.finish_recovery()?;
        self.frames
            .set_reserve(self.bytes / POOL_PAGE_BYTES, &Self::page_counts())
    }

    /// New descriptors of the files holding the reserve's frames and their records, to hand
    /// to a process that will [`recover`](Self::recover) it (each device serving swap hands
    /// the same files over with its own: `Device::state_files`).
    pub fn files(&self) -> Result<(ShmFile, ShmFile)> {
        self.frames.files()
    }

    /// The zspage page counts of the size classes (what the reserve keeps frames for).
    fn page_counts() -> Vec<usize> {
        ClassTable::new(POOL_PAGE_BYTES)
            .classes()
            .iter()
            .map(|c| c.pages_per_zspage)
            .collect()
    }

    /// Stops the refiller, as the death of the process does (tests that leave a "dead"
    /// process's devices in memory while another recovers their files).
    #[cfg(any(test, feature = "testing"))]
    pub fn stop_refiller(&self) {
        self.frames.stop_refiller();
    }

    /// Whether the refiller runs under `SCHED_DEADLINE`, which lets its page faults take
    /// pages below the `min` watermark where other processes' faults stop (`zsmalloc::page_alloc`,
    /// "The reserve"): `Err` with the error number of the kernel's refusal (`EPERM` without
    /// `CAP_SYS_NICE`), or `None` if the refiller has not said within a second (it says as it
    /// starts, which a reserve does as it is made or its recovery finishes).
    pub fn refiller_deadline(&self) -> Option<std::result::Result<(), i32>> {
        let start = std::time::Instant::now();
        loop {
            if let Some(r) = self.frames.refiller_deadline() {
                return Some(r);
            }
            if start.elapsed() > std::time::Duration::from_secs(1) {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// The size asked for, in bytes (the high mark).
    pub fn size_bytes(&self) -> usize {
        self.bytes
    }

    /// What the reserve holds and has done now.
    pub fn stats(&self) -> SwapReserveStats {
        self.frames.swap_stats()
    }

    /// `hook` is called when the reserve is starved: a write failed because it was empty, and
    /// it has gained no frame for ten seconds (memory has run out, and the refiller, whose
    /// reclaim waits for swap-outs that need the reserve, cannot get any); at most every ten
    /// seconds, on the failing writer's thread. The server asks the kernel's OOM killer to act
    /// (`uzram_service::frontend::swap`).
    pub fn on_starved(&self, hook: Box<dyn Fn() + Send + Sync>) {
        self.frames.on_starved(hook);
    }

    /// `hook` is called by the refiller every tenth of a second, no lock held: the one thread
    /// of the server that may wait for memory keeps other memory faulted in ahead of need
    /// there (`uzram_service::frontend::swap` keeps malloc's heap top resident). Only the first
    /// hook set is kept.
    pub fn on_refill_tick(&self, hook: Box<dyn Fn() + Send + Sync>) {
        self.frames.on_refill_tick(hook);
    }

    /// The frame allocator every pool serving swap takes its zspages from.
    pub(crate) fn frames(&self) -> &Arc<FrameAllocator> {
        &self.frames
    }
}

impl Drop for SwapReserve {
    fn drop(&mut self) {
        self.frames.stop_refiller();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zsmalloc::ZsPool;

    /// Two pools share one reserve: their zspages come from it; once it is empty (its
    /// refiller stopped) a zspage is faulted in by its writer and counted; a dropped pool's
    /// frames go back to the reserve.
    #[test]
    fn pools_share_one_reserve() {
        let reserve = SwapReserve::new(2 << 20).unwrap();
        let full = reserve.stats();
        assert_eq!(full.high_pages, 512);
        assert!(full.held_pages >= 400, "{full:?}");
        let a = ZsPool::with_swap_reserve(4096, None, &reserve).unwrap();
        let b = ZsPool::with_swap_reserve(4096, None, &reserve).unwrap();
        assert!(a.serves_swap() && b.serves_swap());
        // The refiller stops: what is taken now is not replaced.
        reserve.frames().stop_refiller();
        let mut handles = Vec::new();
        while reserve.stats().misses == 0 {
            let pool = if handles.len() % 2 == 0 { &a } else { &b };
            let h = pool.malloc(4096).unwrap();
            pool.write(h, &[0x5a; 4096]);
            handles.push(h);
            assert!(handles.len() < 10_000, "the reserve never ran out");
        }
        assert_eq!(reserve.stats().held_pages, 0);
        assert!(handles.len() > 64, "{}", handles.len());
        // Dropping a pool gives its frames back to the reserve (up to its targets).
        drop(b);
        assert!(reserve.stats().held_pages > 0, "{:?}", reserve.stats());
        for h in handles.into_iter().step_by(2) {
            assert!(a.read(h, |b| b == [0x5a; 4096]));
        }
    }

    /// Before it faults fresh pages in, the refiller compacts the pools that share the reserve
    /// (as reclaim calls zsmalloc's shrinker): a fragmented pool is compacted once writes
    /// draw on the reserve, and every object it kept reads back.
    #[test]
    fn the_refiller_compacts_before_taking_fresh_pages() {
        let reserve = SwapReserve::new(2 << 20).unwrap();
        let pool = ZsPool::with_swap_reserve(4096, None, &reserve).unwrap();
        let object = |i: usize| -> Vec<u8> { (0..1000).map(|j| (i * 31 + j) as u8).collect() };
        // About 4 MB of 1000-byte objects; three in four freed: far more than a zspage's
        // worth of free slots in their class.
        let mut all = Vec::new();
        for i in 0..4000 {
            let h = loop {
                match pool.malloc(1000) {
                    Ok(h) => break h,
                    // The reserve ran dry for a moment: the refiller is behind.
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
                }
            };
            pool.write(h, &object(i));
            all.push((i, h));
        }
        let mut kept = Vec::new();
        for (i, h) in all {
            if i % 4 == 0 {
                kept.push((i, h));
            } else {
                pool.free(h);
            }
        }
        assert_eq!(pool.pages_compacted(), 0);
        // Writes of another class draw the reserve down to its low mark: the refiller wakes.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut others = Vec::new();
        while pool.pages_compacted() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "no compaction: {:?}",
                reserve.stats()
            );
            if let Ok(h) = pool.malloc(3000) {
                pool.write(h, &[0xa5; 3000]);
                others.push(h);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        for (i, h) in kept {
            assert!(pool.read(h, |b| b == object(i)), "object {i}");
        }
        for h in others {
            assert!(pool.read(h, |b| b == [0xa5; 3000]));
        }
    }

    /// The refiller says whether it runs under `SCHED_DEADLINE` as it starts: done, or the
    /// kernel's refusal (not root, or the CPUs' deadline bandwidth taken by other tests).
    #[test]
    fn the_refiller_reports_its_scheduling() {
        let reserve = SwapReserve::new(1 << 20).unwrap();
        match reserve.refiller_deadline() {
            Some(Ok(())) | Some(Err(libc::EPERM | libc::EBUSY)) => {}
            other => panic!("the refiller reported {other:?}"),
        }
    }
}
