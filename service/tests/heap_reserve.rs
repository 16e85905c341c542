//! The heap's reserve of a server backing swap (`uzram_service::frontend::swap`, step 1): once
//! the request paths have used a quarter of the pad at the top of the heap, the refiller's
//! `keep_heap_reserve` makes it resident again. Its own binary, without the test harness: a
//! server tunes malloc before any thread exists, and the harness's threads would allocate
//! from arenas of their own.

use uzram_service::frontend::swap::{
    fault_in_heap_reserve, keep_heap_reserve, tune_malloc, HEAP_RESERVE_BYTES,
    HEAP_RESERVE_REFRESH_BYTES,
};

/// The top chunk: its size (`mallinfo2().keepcost`) and how many of its pages are resident
/// (`mincore` over `[sbrk(0) - keepcost, sbrk(0))`, whole pages).
fn top_chunk() -> (usize, usize, usize) {
    // SAFETY: mallinfo2 takes no arguments and returns a struct by value.
    let keep = unsafe { libc::mallinfo2() }.keepcost;
    // SAFETY: sbrk(0) only reads the break; it moves nothing.
    let end = unsafe { libc::sbrk(0) } as usize;
    let start = (end - keep).next_multiple_of(4096);
    let pages = (end - start) / 4096;
    let mut vec = vec![0u8; pages];
    // SAFETY: the range is page aligned and inside the heap's mapping (the top chunk lies
    // below the break); mincore writes one byte per page into `vec`, which holds `pages`.
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, end - start, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    let resident = vec.iter().filter(|&&b| b & 1 == 1).count();
    (keep, pages, resident)
}

fn main() {
    the_heap_top_is_faulted_in_again_once_a_quarter_used();
    println!("test the_heap_top_is_faulted_in_again_once_a_quarter_used ... ok");
}

fn the_heap_top_is_faulted_in_again_once_a_quarter_used() {
    let line = tune_malloc();
    assert!(line.starts_with("malloc: one arena"), "{line}");
    fault_in_heap_reserve();
    let (keep, pages, resident) = top_chunk();
    assert!(keep >= HEAP_RESERVE_BYTES - (1 << 20), "top {keep} bytes");
    assert_eq!(resident, pages, "the pad is resident");
    // The request paths take three eighths of it, in blocks of 64 KiB.
    let held: Vec<Vec<u8>> = (0..HEAP_RESERVE_BYTES * 3 / 8 / (64 << 10))
        .map(|_| vec![7u8; 64 << 10])
        .collect();
    let (keep, _, _) = top_chunk();
    assert!(keep < HEAP_RESERVE_REFRESH_BYTES, "top {keep} bytes");
    keep_heap_reserve();
    let (keep, pages, resident) = top_chunk();
    assert!(keep >= HEAP_RESERVE_REFRESH_BYTES, "top {keep} bytes after");
    assert_eq!(resident, pages, "the new top is resident");
    assert!(held.iter().all(|b| b.iter().all(|&x| x == 7)));
}
