//! Serving swap safely (`uzram serve --swap`).
//!
//! A server that backs the swap device the kernel is writing to under memory pressure must not
//! itself wait on that pressure: if its pages are swapped out (to itself) or its allocations
//! wait for reclaim that needs its own I/O, the machine deadlocks. So, before any thread starts:
//!
//! 1. `mlockall(MCL_CURRENT | MCL_FUTURE)`: every page the process has and will map stays in
//!    RAM. Only done when the process may lock without limit (`CAP_IPC_LOCK`, or
//!    `RLIMIT_MEMLOCK` unlimited): under a finite limit `MCL_FUTURE` turns the first mapping
//!    past it into an allocation failure, which would take the server down mid-request.
//! 2. `prctl(PR_SET_IO_FLUSHER)` (Linux 5.6, needs `CAP_SYS_RESOURCE`): the kernel treats the
//!    process as part of the I/O path (as it does loop and nbd's own threads): its allocations
//!    never start I/O to reclaim memory (`PF_MEMALLOC_NOIO`) and it is not throttled for
//!    dirty pages it does not own (`PF_LOCAL_THROTTLE`). Threads created afterwards inherit
//!    it, which is why this runs first.
//! 3. The NBD server preallocates request buffers per connection and recycles them
//!    ([`ServerConfig::preallocate`](super::nbd::ServerConfig)), so the request path takes
//!    no fresh memory from the kernel in the steady state.
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

/// Locks memory and marks the process an I/O flusher where permitted. Call before any thread
/// is created. Returns one line per step saying what was done or why not, for the log.
pub fn prepare() -> Vec<String> {
    let mut report = Vec::new();
    let may_lock = has_capability(CAP_IPC_LOCK);
    match memlock_limit_bytes() {
        Some(limit) if !may_lock => report.push(format!(
            "memory NOT locked: RLIMIT_MEMLOCK is {limit} bytes and the process lacks \
             CAP_IPC_LOCK (run as root, or raise the limit: `ulimit -l unlimited`, systemd \
             LimitMEMLOCK=infinity); its pages may be swapped out"
        )),
        _ => {
            // SAFETY: mlockall takes flags only and touches no memory of ours.
            let rc = unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) };
            if rc == 0 {
                report.push("memory locked (mlockall MCL_CURRENT|MCL_FUTURE)".into());
            } else {
                report.push(format!(
                    "memory NOT locked: mlockall: {}",
                    std::io::Error::last_os_error()
                ));
            }
        }
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
    report.push(
        "request buffers preallocated per connection and recycled; the device's compressed \
         pages are still allocated on writes, as in zram"
            .into(),
    );
    report
}
