//! Serving swap safely (`uzram serve --swap`).
//!
//! A server that backs the swap device the kernel is writing to under memory pressure must not
//! itself wait on that pressure: if its pages are swapped out (to itself) or its allocations
//! wait for reclaim that needs its own I/O, the machine deadlocks. So, before any thread starts:
//!
//! 1. Lock memory, so none of the server's pages is ever swapped out (possibly to itself):
//!    `mlockall(MCL_CURRENT)`, then `mlockall(MCL_FUTURE | MCL_ONFAULT)`. The mappings present
//!    at start (the program's code and static data, the main stack: a few MiB) are faulted in
//!    and locked whole, so no code path first run under memory pressure has to be read back
//!    from disk then; every later mapping (heap, thread stacks, zsmalloc's chunks, buffers) is
//!    locked page by page as it is touched (`MCL_ONFAULT`, Linux 4.4), so address space that
//!    is reserved but never touched costs nothing. (`MCL_FUTURE` alone populates and locks each
//!    new mapping whole: zsmalloc's 128 MiB chunks, 2 MiB thread stacks, malloc's 64 MiB arena
//!    heaps.) Only done when the process may lock without limit (`CAP_IPC_LOCK`, or
//!    `RLIMIT_MEMLOCK` unlimited): under a finite limit `MCL_FUTURE` turns the first mapping
//!    past it into an allocation failure, which would take the server down mid-request.
//!
//!    Memory given back must still leave the process, and `MADV_DONTNEED` refuses locked
//!    pages (`EINVAL`). zsmalloc drops freed zspages with `MADV_DONTNEED_LOCKED` (see
//!    `zsmalloc::page_alloc`, "Locked memory"). malloc (glibc) is set up so that the heap
//!    never needs a fresh page on a request path while a reserve lasts, and still shrinks
//!    ([`tune_malloc`]): one arena (`M_ARENA_MAX` 1: every thread allocates from the main
//!    heap), blocks up to 32 MiB from that heap rather than mappings of their own
//!    (`M_MMAP_THRESHOLD`: a 128 KiB block mapped on its own is a `mmap`, waiting for the
//!    process's mmap lock, and fresh pages, faulted in on first touch), and a top pad of
//!    [`HEAP_RESERVE_BYTES`] (`M_TOP_PAD`) kept when the heap is trimmed, faulted in (hence
//!    locked) at start: the zsmalloc bookkeeping that grows with the pages stored (handle
//!    table segments, zspage lists, doubling vectors) comes from there. The swap reserve's
//!    refiller faults it in again whenever the request paths have used a quarter of it
//!    ([`keep_heap_reserve`]): without that, a 1 GiB guest's hog grew the bookkeeping past
//!    the pad and a queue thread hung in reclaim faulting in the heap's next page table. Seen in the VM before
//!    this: a queue thread faulting in the header of a freshly mapped 132 KiB block (a handle
//!    table segment) waited in reclaim forever. Freed blocks at the top of the heap beyond the
//!    pad go back to the kernel (`brk`), as before.
//! 2. `oom_score_adj` -1000 (needs `CAP_SYS_RESOURCE`): the OOM killer never chooses the
//!    server. The pages swapped out to it live in its memory, so it looks like the largest
//!    process when memory runs out; killing it loses every one of them (seen in the VM: the
//!    server, 414 MiB locked under a hog larger than RAM, killed without a word, then
//!    swap-outs and swap-ins failing, init killed by the read errors, the guest panicking),
//!    where the kernel's zram keeps its memory out of the OOM killer's reach. The OOM killer
//!    then takes the hog, as with zram.
//! 3. `prctl(PR_SET_IO_FLUSHER)` (Linux 5.6, needs `CAP_SYS_RESOURCE`): the kernel treats the
//!    process as part of the I/O path (as it does loop and nbd's own threads): its allocations
//!    never start I/O to reclaim memory (`PF_MEMALLOC_NOIO`) and it is not throttled for
//!    dirty pages it does not own (`PF_LOCAL_THROTTLE`). Threads created afterwards inherit
//!    it, which is why this runs first; the swap reserve's refiller alone clears it for itself
//!    (step 5).
//! 4. The NBD server preallocates request buffers (4 MiB server-wide, 256 of a page and 15 of
//!    128 KiB, faulted in, hence locked, inside its request memory budget:
//!    [`ServerConfig::for_swap`](super::nbd::ServerConfig::for_swap)) and recycles them; a
//!    request takes any free one before it maps a new buffer, so the request path of a swap
//!    client takes no fresh memory from the kernel while fewer requests than that are in
//!    flight. Not when every device is a ublk block device (`uzram serve --ublk`): swap goes
//!    through ublk's own buffers, locked at start, and buffers held for NBD would only be
//!    memory the pages swapped out cannot use.
//!
//! 5. The devices' memory is got ahead of need, not on a write under pressure
//!    (`uzram::memory`): each device's slot table whole when it is initialised, and zsmalloc's
//!    zspages from one swap reserve for the whole server (`uzram serve --swap-reserve`),
//!    refilled by one thread off the request path; when it is empty a write waits for the
//!    refiller a tenth of a second at most, then fails (counted), and never faults memory in.
//!    Without a reserve a VM running a memory hog over swap on `/dev/ublkb0` deadlocked at the
//!    first swap-out: both queue threads looped in direct reclaim faulting in a new zspage
//!    (`madvise(MADV_POPULATE_WRITE)` → `try_to_free_pages`), which as I/O flushers they could
//!    only satisfy from the swap-outs they were serving. The refiller is not an I/O flusher:
//!    its reclaim swaps out and, when nothing is left, calls the OOM killer (which the kernel
//!    never calls for an allocation that may not start I/O); marked, it waited forever in the
//!    same VM.
//!
//! Thread stacks keep their default size (2 MiB of address space): locked on fault, a stack
//! costs the pages its thread has touched (8–12 KiB measured for a connection's threads under
//! nbdcopy), so a smaller reservation would save nothing resident and risk an overflow on a
//! deep path (a codec, a panic's backtrace).
//!
//! What could not be done is reported, never fatal: a server that is not locked is still a
//! working server, and its log says why.

/// `PR_SET_IO_FLUSHER` from `include/uapi/linux/prctl.h` (the libc crate has it only for
/// Android).
const PR_SET_IO_FLUSHER: libc::c_int = 57;
/// `CAP_IPC_LOCK`'s bit in the capability sets (`include/uapi/linux/capability.h`).
const CAP_IPC_LOCK: u32 = 14;

/// Whether the effective capability set of this process has `cap`, from /proc/self/status.
fn has_capability(cap: u32) -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << cap) != 0)
}

/// The soft `RLIMIT_MEMLOCK`, `None` when unlimited.
fn memlock_limit_bytes() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through the pointer, which points at `lim`.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(lim.rlim_cur)
}

/// Heap kept faulted in at the top of the heap for the request paths of a server backing swap
/// (step 1 of the module docs): 8 MiB, faulted in again by the swap reserve's refiller as it
/// is used ([`keep_heap_reserve`]). In the VM test (a hog larger than RAM on a 1 GiB device)
/// the bookkeeping that grows with the pages stored (`meta_stat`'s `zspage_meta`) grew from
/// 1.8 MB to 6.2 MB in 10 s as the pool reached 350 MB, about 1.3% of the pool: a tick's
/// growth is far below this.
pub const HEAP_RESERVE_BYTES: usize = 8 << 20;

/// The top chunk left below which [`keep_heap_reserve`] faults the pad in again: three
/// quarters of it.
pub const HEAP_RESERVE_REFRESH_BYTES: usize = HEAP_RESERVE_BYTES * 3 / 4;

/// malloc was tuned as step 1 of the module docs says ([`tune_malloc`]): the heap keeps a
/// top pad of [`HEAP_RESERVE_BYTES`], which [`keep_heap_reserve`] keeps resident.
static MALLOC_TUNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `vm.min_free_kbytes` when the server started, in bytes: the sum of the zones' `min`
/// watermarks (0 if unreadable: [`keep_heap_reserve`] then always goes ahead).
static MIN_FREE_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// glibc's largest mmap threshold on 64-bit (`DEFAULT_MMAP_THRESHOLD_MAX`): 32 MiB.
const MMAP_THRESHOLD_MAX_BYTES: usize = 32 << 20;

/// `mlockall(flags)`, as an `io::Result`.
fn mlockall(flags: libc::c_int) -> std::io::Result<()> {
    // SAFETY: mlockall takes flags only and touches no memory of ours.
    if unsafe { libc::mlockall(flags) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Step 1 of the module docs: what is mapped now whole, what is mapped later as it is touched,
/// and malloc's heap. Returns the log lines.
fn lock_memory() -> Vec<String> {
    let (future_locked, line) = lock_mappings();
    let mut report = vec![line];
    if future_locked {
        report.push(tune_malloc());
    }
    report
}

/// malloc as step 1 of the module docs says, and its reserve faulted in. Returns the log line.
#[cfg(target_env = "gnu")]
pub fn tune_malloc() -> String {
    let set = |param, value: usize| {
        // SAFETY: mallopt takes integers only; called before any thread exists (it is
        // thread-safe anyway: it takes the main arena's lock).
        unsafe { libc::mallopt(param, value as libc::c_int) == 1 }
    };
    let ok = set(libc::M_ARENA_MAX, 1)
        && set(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX_BYTES)
        && set(libc::M_TOP_PAD, HEAP_RESERVE_BYTES);
    if !ok {
        return "malloc NOT tuned (mallopt refused): the heap may need fresh pages under memory \
                pressure"
            .into();
    }
    MALLOC_TUNED.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(kib) = std::fs::read_to_string("/proc/sys/vm/min_free_kbytes")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
    {
        MIN_FREE_BYTES.store(kib << 10, std::sync::atomic::Ordering::Relaxed);
    }

    format!(
        "malloc: one arena, blocks up to {} MiB from the heap, {} MiB of it kept faulted in \
         once the server has started",
        MMAP_THRESHOLD_MAX_BYTES >> 20,
        HEAP_RESERVE_BYTES >> 20
    )
}

/// Faults in the heap's reserve ([`HEAP_RESERVE_BYTES`], step 1 of the module docs): call once
/// everything the server allocates at start is allocated (the ublk queues' and NBD's request
/// buffers would take it otherwise), in swap mode only. Freed, the block stays faulted in (and
/// locked) as the heap's top pad.
pub fn fault_in_heap_reserve() {
    let warm = vec![1u8; HEAP_RESERVE_BYTES];
    drop(std::hint::black_box(warm));
}

/// Faults the heap's reserve in again once the request paths have used a quarter of it
/// ([`HEAP_RESERVE_REFRESH_BYTES`] left: the store path's bookkeeping grows in steps of up to
/// a few MiB, the doubling of a large class's lists)
/// (`mallinfo2().keepcost`, the top chunk, resident since it was last faulted in). Called by
/// the swap reserve's refiller every tick ([`uzram::memory::SwapReserve::on_refill_tick`]),
/// the one thread of the server that may wait for memory.
///
/// `malloc` faults in one page under the arena's lock (the new top's header), which a queue
/// thread may be waiting for: so this goes ahead only while the machine's free memory is
/// above the `min` watermarks (the refiller, under `SCHED_DEADLINE`, may fault down to half
/// of them without reclaiming), and as an I/O flusher, so that even a fault that does reclaim
/// never waits for a swap-out to this server. The block's other pages are touched after
/// `malloc` returns, with no lock held.
#[cfg(target_env = "gnu")]
pub fn keep_heap_reserve() {
    use std::sync::atomic::Ordering::Relaxed;
    // Untuned (not locked, or mallopt refused), the heap keeps no pad to keep resident.
    if !MALLOC_TUNED.load(Relaxed) {
        return;
    }
    // SAFETY: mallinfo2 takes no arguments and returns a struct by value; it takes the main
    // arena's lock itself.
    let top_bytes = unsafe { libc::mallinfo2() }.keepcost;
    if top_bytes >= HEAP_RESERVE_REFRESH_BYTES {
        return;
    }
    // SAFETY: `struct sysinfo` is plain integers, for which all zeroes is a valid value.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: sysinfo writes one `struct sysinfo` through the pointer, which points at ours.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return;
    }
    let free_bytes = info.freeram as u64 * info.mem_unit.max(1) as u64;
    if free_bytes <= MIN_FREE_BYTES.load(Relaxed) {
        return;
    }
    // SAFETY: prctl with PR_SET_IO_FLUSHER takes integer arguments only; it changes this
    // thread's flags.
    let flusher = unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1 as libc::c_ulong, 0, 0, 0) } == 0;
    let mut block: Vec<u8> = Vec::with_capacity(HEAP_RESERVE_BYTES);
    if flusher {
        // SAFETY: as above: back to the refiller's own setting (not an I/O flusher).
        unsafe { libc::prctl(PR_SET_IO_FLUSHER, 0 as libc::c_ulong, 0, 0, 0) };
    }
    for page in block.spare_capacity_mut().chunks_mut(4096) {
        page[0].write(1);
    }
    drop(std::hint::black_box(block));
}

/// Other C libraries: the heap is not tuned (see [`tune_malloc`]), nothing to keep.
#[cfg(not(target_env = "gnu"))]
pub fn keep_heap_reserve() {}

/// Other C libraries: nothing to tune that we know of; said in the log.
#[cfg(not(target_env = "gnu"))]
pub fn tune_malloc() -> String {
    "not glibc: malloc left as it is; the heap may need fresh pages under memory pressure".into()
}

/// `mlockall` as step 1 of the module docs says. Returns whether later mappings are locked,
/// and the log line.
fn lock_mappings() -> (bool, String) {
    // First the mappings of now (code, static data, the main stack): populated and locked
    // whole, so no code path (an error path first run under memory pressure, say) has to be
    // read back from the filesystem then. A call without MCL_FUTURE clears the process's
    // future-lock setting, so this one comes first.
    if let Err(e) = mlockall(libc::MCL_CURRENT) {
        return (
            false,
            format!("memory NOT locked: mlockall(MCL_CURRENT): {e}"),
        );
    }
    // Then every later mapping, page by page as it is touched (MCL_ONFAULT, Linux 4.4). Without
    // MCL_CURRENT in this call the current mappings keep their whole lock.
    let e = match mlockall(libc::MCL_FUTURE | libc::MCL_ONFAULT) {
        Ok(()) => {
            return (
                true,
                "memory locked (mlockall: MCL_CURRENT, then MCL_FUTURE|MCL_ONFAULT: later \
                 mappings are locked as they are touched)"
                    .into(),
            )
        }
        Err(e) => e,
    };
    if e.raw_os_error() != Some(libc::EINVAL) {
        return (
            false,
            format!("memory locked only as mapped at start: mlockall(MCL_FUTURE|MCL_ONFAULT): {e}"),
        );
    }
    // A kernel without MCL_ONFAULT: lock later mappings whole, as before.
    match mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) {
        Ok(()) => (
            true,
            "memory locked (mlockall MCL_CURRENT|MCL_FUTURE: this kernel lacks MCL_ONFAULT, so \
             every later mapping is locked whole)"
                .into(),
        ),
        Err(e) => (
            false,
            format!("memory locked only as mapped at start: mlockall(MCL_FUTURE): {e}"),
        ),
    }
}

/// What a server backing swap does when its swap reserve is starved (`SwapReserve::on_starved`:
/// writes failing, no frame gained for ten seconds): asks the kernel's OOM killer to act, as
/// root may through `/proc/sysrq-trigger` (`f`: the kernel picks the process by its OOM score,
/// never this server, whose score is -1000). Why: then memory has run out and nothing else
/// ends it. Kernel zram's swap-out is synchronous, so reclaim keeps failing quickly and the
/// kernel calls the OOM killer itself; a swap-out to ublk is a bio in flight, and when the
/// server cannot store it every reclaimer (kswapd, the memory hog, the reserve's refiller)
/// waits in `mempool_alloc` for a bio that only the server's completions free, so the kernel
/// never gets to the OOM killer (seen in the VM: a hog stopped for minutes, PSI `full` 90%).
/// The file is opened now, so that asking allocates nothing; `None` when it cannot be opened
/// (not root), and then nothing is asked.
pub fn oom_trigger() -> Option<Box<dyn Fn() + Send + Sync>> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/sysrq-trigger")
        .ok()?;
    Some(Box::new(move || {
        use std::io::Write;
        eprintln!(
            "uzram: --swap: writes fail for want of a frame of the swap reserve, which has \
             gained none for 10 s: memory has run out; asking the kernel's OOM killer to act \
             (sysrq f)"
        );
        let _ = (&file).write_all(b"f");
    }))
}

/// How often the reclaim watchdog ([`spawn_reclaim_watchdog`]) looks at the server's threads.
const RECLAIM_WATCH_PERIOD: std::time::Duration = std::time::Duration::from_millis(500);
/// Looks in a row a thread must be found in direct reclaim, with no swap-in or swap-out
/// started anywhere meanwhile, before the watchdog acts (ten seconds).
const RECLAIM_STUCK_LOOKS: u32 = 20;
/// Least time between two OOM kills the watchdog asks for.
const RECLAIM_COOLDOWN: std::time::Duration = std::time::Duration::from_secs(10);

/// Serving swap, a last resort against a stall the server cannot otherwise end: a thread of
/// the server (other than the swap reserve's refiller, which may wait for memory) that sits in
/// direct reclaim (`__alloc_pages_slowpath` on its kernel stack) for ten seconds while the
/// machine starts no swap-in or swap-out at all (`/proc/vmstat`'s `pswpin` and `pswpout` stand
/// still) is faulting in a page the server did not get ahead of need (the heap past its pad, when free memory
/// stayed below `min` so long that the refiller could not fault the pad in again). As an I/O
/// flusher its reclaim cannot swap anything out, and the kernel calls no OOM killer for
/// I/O-less reclaim: it loops, while every other reclaimer waits for the swap-outs it would
/// serve (seen in the VM: a queue thread running in `evict_folios` under a fault in `malloc`,
/// kswapd and the hog in `mempool_alloc`, for minutes). Memory has run out then, as when
/// the swap reserve starves, and the watchdog asks the kernel's OOM killer to act (sysrq
/// `f`, at most every ten seconds), as the kernel would for its own zram.
///
/// The watchdog reads `/proc/self/task/*/stack` (root) into fixed buffers through descriptors
/// and syscalls only: it allocates nothing after it starts, so it never waits on the heap it
/// watches. Returns why not when it cannot run (not root, no `/proc`, no sysrq).
pub fn spawn_reclaim_watchdog() -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let trigger = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/sysrq-trigger")
        .map_err(|e| format!("/proc/sysrq-trigger: {e}"))?;
    let tasks =
        std::fs::File::open("/proc/self/task").map_err(|e| format!("/proc/self/task: {e}"))?;
    // A readable stack file says the kernel shows kernel stacks to this process (root).
    let me = format!("/proc/self/task/{}/stack", gettid());
    std::fs::read(&me).map_err(|e| format!("{me}: {e}"))?;
    std::thread::Builder::new()
        .name("uzram-swap-watch".into())
        .spawn(move || {
            let self_tid = gettid();
            // (tid, looks in a row in reclaim), for the threads seen in reclaim.
            let mut seen = [(0i32, 0u32); 64];
            let mut last_kill: Option<std::time::Instant> = None;
            let mut dents = [0u8; 8192];
            let mut stack = [0u8; 8192];
            let mut vmstat = [0u8; 16384];
            let mut swapped = swap_events(&mut vmstat);
            loop {
                std::thread::sleep(RECLAIM_WATCH_PERIOD);
                // Swap I/O started since the last look: the machine makes progress, and a
                // thread in reclaim now waits for it rather than for nothing.
                let now_swapped = swap_events(&mut vmstat);
                let moved = now_swapped != swapped;
                swapped = now_swapped;
                let mut now_seen = [(0i32, 0u32); 64];
                let mut n_now = 0;
                let mut stuck = false;
                for_each_tid(tasks.as_raw_fd(), &mut dents, |tid| {
                    if tid == self_tid || !in_reclaim(tid, &mut stack) {
                        return;
                    }
                    let before = seen.iter().find(|(t, _)| *t == tid).map_or(0, |&(_, n)| n);
                    let looks = if moved { 1 } else { before + 1 };
                    if looks >= RECLAIM_STUCK_LOOKS {
                        stuck = true;
                    }
                    if n_now < now_seen.len() {
                        now_seen[n_now] = (tid, looks);
                        n_now += 1;
                    }
                });
                seen = now_seen;
                if stuck && !last_kill.is_some_and(|t| t.elapsed() < RECLAIM_COOLDOWN) {
                    last_kill = Some(std::time::Instant::now());
                    eprintln!(
                        "uzram: --swap: a thread of the server has been in reclaim for 10 s \
                         with no swap I/O anywhere (a page it did not get ahead of need): memory \
                         has run out; asking the kernel's OOM killer to act (sysrq f)"
                    );
                    use std::io::Write;
                    let _ = (&trigger).write_all(b"f");
                }
            }
        })
        .map_err(|e| format!("starting its thread: {e}"))?;
    Ok(())
}

/// The swap-ins and swap-outs started so far (`/proc/vmstat`'s `pswpin` + `pswpout`), read
/// into `buf`; 0 if unreadable.
fn swap_events(buf: &mut [u8]) -> u64 {
    let n = read_file(b"/proc/vmstat\0", buf);
    let text = &buf[..n];
    [&b"\npswpin "[..], &b"\npswpout "[..]]
        .iter()
        .map(|key| {
            text.windows(key.len())
                .position(|w| w == *key)
                .map_or(0, |at| {
                    text[at + key.len()..]
                        .iter()
                        .take_while(|b| b.is_ascii_digit())
                        .fold(0u64, |v, &d| v * 10 + u64::from(d - b'0'))
                })
        })
        .sum()
}

/// This thread's id.
fn gettid() -> i32 {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// Calls `f` with each thread id listed in the directory `dir` (`/proc/self/task`, open),
/// reading it again from its start with `getdents64` into `buf`.
fn for_each_tid(dir: i32, buf: &mut [u8], mut f: impl FnMut(i32)) {
    // SAFETY: lseek on a descriptor we own; no memory is involved.
    if unsafe { libc::lseek(dir, 0, libc::SEEK_SET) } != 0 {
        return;
    }
    loop {
        // SAFETY: getdents64 writes at most `buf.len()` bytes into `buf`, which we own.
        let n = unsafe {
            libc::syscall(
                libc::SYS_getdents64,
                dir,
                buf.as_mut_ptr(),
                buf.len() as libc::c_ulong,
            )
        };
        if n <= 0 {
            return;
        }
        let mut at = 0usize;
        while at + 19 < n as usize {
            // struct linux_dirent64: u64 ino, i64 off, u16 reclen, u8 type, name (NUL-ended).
            let reclen = u16::from_ne_bytes([buf[at + 16], buf[at + 17]]) as usize;
            if reclen == 0 || at + reclen > n as usize {
                return;
            }
            let name = &buf[at + 19..at + reclen];
            let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
            if let Some(tid) = std::str::from_utf8(name)
                .ok()
                .and_then(|s| s.parse::<i32>().ok())
            {
                f(tid);
            }
            at += reclen;
        }
    }
}

/// Whether thread `tid` of this process is in direct reclaim now, from its kernel stack
/// (read into `buf`); the swap reserve's refiller, which may wait for memory, never counts.
fn in_reclaim(tid: i32, buf: &mut [u8]) -> bool {
    let mut path = [0u8; 64];
    let Some(len) = proc_task_path(&mut path, tid, b"comm") else {
        return false;
    };
    let n = read_file(&path[..len], buf);
    if buf[..n].starts_with(b"uzram-zs-reserv") {
        return false;
    }
    let Some(len) = proc_task_path(&mut path, tid, b"stack") else {
        return false;
    };
    let n = read_file(&path[..len], buf);
    buf[..n]
        .windows(b"__alloc_pages_slowpath".len())
        .any(|w| w == b"__alloc_pages_slowpath")
}

/// `/proc/self/task/TID/FILE` NUL-terminated in `path`; its length with the NUL.
fn proc_task_path(path: &mut [u8; 64], tid: i32, file: &[u8]) -> Option<usize> {
    use std::io::Write;
    let mut c = std::io::Cursor::new(&mut path[..]);
    write!(c, "/proc/self/task/{tid}/").ok()?;
    c.write_all(file).ok()?;
    c.write_all(&[0]).ok()?;
    Some(c.position() as usize)
}

/// Reads the file at the NUL-terminated `path` into `buf` (as much as fits); the bytes read.
fn read_file(path: &[u8], buf: &mut [u8]) -> usize {
    // SAFETY: `path` is NUL-terminated (built by `proc_task_path`); open reads it only.
    let fd = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return 0;
    }
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: read writes at most `buf.len() - got` bytes at `buf[got..]`, which we own.
        let n = unsafe { libc::read(fd, buf[got..].as_mut_ptr().cast(), buf.len() - got) };
        if n <= 0 {
            break;
        }
        got += n as usize;
    }
    // SAFETY: `fd` is ours, opened above, closed once.
    unsafe { libc::close(fd) };
    got
}

/// Locks memory and marks the process an I/O flusher where permitted. Call before any thread
/// is created. Returns one line per step saying what was done or why not, for the log
/// (`nbd_buffers`: whether the NBD server preallocates its request buffers, step 4).
pub fn prepare(nbd_buffers: bool) -> Vec<String> {
    let mut report = Vec::new();
    let may_lock = has_capability(CAP_IPC_LOCK);
    match memlock_limit_bytes() {
        Some(limit) if !may_lock => report.push(format!(
            "memory NOT locked: RLIMIT_MEMLOCK is {limit} bytes and the process lacks \
             CAP_IPC_LOCK (run as root, or raise the limit: `ulimit -l unlimited`, systemd \
             LimitMEMLOCK=infinity); its pages may be swapped out"
        )),
        _ => report.extend(lock_memory()),
    }
    // SAFETY: prctl with PR_SET_IO_FLUSHER takes integer arguments only.
    let rc = unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1 as libc::c_ulong, 0, 0, 0) };
    if rc == 0 {
        report.push("marked an I/O flusher (PR_SET_IO_FLUSHER)".into());
    } else {
        let e = std::io::Error::last_os_error();
        let why = match e.raw_os_error() {
            Some(libc::EPERM) => " (needs CAP_SYS_RESOURCE)",
            Some(libc::EINVAL) => " (needs Linux 5.6 or later)",
            _ => "",
        };
        report.push(format!(
            "NOT marked an I/O flusher: PR_SET_IO_FLUSHER: {e}{why}; allocations may wait \
             on reclaim that needs this server's own I/O"
        ));
    }
    // Never the OOM killer's choice: the pages swapped out to this server live in its memory
    // (the kernel's zram memory is not a process the OOM killer could take); killing it loses
    // them all and fails every process whose pages were there.
    match std::fs::write("/proc/self/oom_score_adj", "-1000") {
        Ok(()) => report.push("never chosen by the OOM killer (oom_score_adj -1000)".into()),
        Err(e) => report.push(format!(
            "oom_score_adj NOT set to -1000: {e}; under memory pressure the OOM killer may \
             choose this server, and every page swapped out to it is lost"
        )),
    }
    report.push(if nbd_buffers {
        format!(
            "request buffers preallocated ({} MiB, server-wide, inside the request memory \
             budget) and recycled",
            super::limits::SWAP_PREALLOCATED_BYTES >> 20
        )
    } else {
        "NBD request buffers not preallocated: every device is a ublk block device, which \
         swap is served through (its buffers are locked at start)"
            .into()
    });
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// The watchdog's view of the process: every thread's id from `/proc/self/task` read with
    /// fixed buffers, and a thread asleep is not in reclaim.
    #[test]
    fn the_reclaim_watchdog_lists_the_threads_and_reads_their_state() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let sleeper = std::thread::spawn(move || {
            tx.send(gettid()).unwrap();
            let _ = stop_rx.recv();
        });
        let other = rx.recv().unwrap();
        let tasks = std::fs::File::open("/proc/self/task").unwrap();
        let mut dents = [0u8; 256];
        let mut tids = Vec::new();
        for_each_tid(tasks.as_raw_fd(), &mut dents, |t| tids.push(t));
        let listed: Vec<i32> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .map(|e| e.unwrap().file_name().to_str().unwrap().parse().unwrap())
            .collect();
        assert!(
            tids.contains(&gettid()) && tids.contains(&other),
            "{tids:?}"
        );
        assert!(
            listed.iter().all(|t| tids.contains(t)),
            "{tids:?} {listed:?}"
        );
        let mut path = [0u8; 64];
        let len = proc_task_path(&mut path, other, b"comm").unwrap();
        assert_eq!(
            &path[..len],
            format!("/proc/self/task/{other}/comm\0").as_bytes()
        );
        let mut buf = [0u8; 8192];
        assert!(read_file(&path[..len], &mut buf) > 0);
        assert!(!in_reclaim(other, &mut buf));
        // The machine's swap counters, as /proc/vmstat has them.
        let vmstat = std::fs::read_to_string("/proc/vmstat").unwrap();
        let field = |k: &str| -> u64 {
            vmstat
                .lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix(' ')?.parse().ok())
                .unwrap()
        };
        let before = field("pswpin") + field("pswpout");
        let mut big = [0u8; 16384];
        let got = swap_events(&mut big);
        assert!(got >= before, "{got} < {before}");
        stop_tx.send(()).unwrap();
        sleeper.join().unwrap();
    }
}
