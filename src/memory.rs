//! Process-wide memory policy: whether this process serves swap (`uzram serve --swap`), and
//! so must never wait for memory on a request path.
//!
//! A server backing swap stores the pages the kernel writes out to free memory. Its own page
//! faults under memory pressure enter direct reclaim, which cannot swap anything out for it (it
//! is an I/O flusher: `PF_MEMALLOC_NOIO`) and would wait for the very writes it is serving: a
//! deadlock (docs/ublk.md, "Swap on ublk"). So in swap mode what a device needs is faulted in
//! when it is created, not when a write first touches it: the slot table (16 bytes a page, as
//! the kernel's zram allocates its table at `disksize`), and a reserve of zsmalloc frames
//! (`zsmalloc::page_alloc`, "The reserve"), refilled off the request path.
//!
//! Set once by the server before it creates devices ([`set_swap_reserve_bytes`]); devices
//! created afterwards follow it. An atomic, read when a device is initialised.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes of zsmalloc frames each pool keeps faulted in (0: not serving swap).
static SWAP_RESERVE_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Serve swap: every device initialised from now on faults its slot table in at once and
/// keeps a reserve of `bytes` of zsmalloc frames (0 turns this off again).
pub fn set_swap_reserve_bytes(bytes: usize) {
    SWAP_RESERVE_BYTES.store(bytes, Ordering::Relaxed);
}

/// The reserve set by [`set_swap_reserve_bytes`] (0: not serving swap).
pub fn swap_reserve_bytes() -> usize {
    SWAP_RESERVE_BYTES.load(Ordering::Relaxed)
}

/// Whether this process serves swap (memory is faulted in when a device is created).
pub fn serving_swap() -> bool {
    swap_reserve_bytes() > 0
}
