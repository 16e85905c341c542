//! Counts Rust heap allocations on the codecs' hot paths with a counting global allocator
//! (its own test binary, so no other test's allocations interfere).
//!
//! After one warm-up call per thread and level, compress and decompress must not allocate,
//! (a zstd codec with a dictionary included: the dictionary is digested once, when the codec is
//! made). Allocations made by C libraries (libzstd, liblz4) go through `malloc` and are not seen
//! here; libzstd reuses its context workspace, liblz4's `LZ4_compress_fast` keeps its state on
//! the stack, its `LZ4_compress_HC` mallocs one per call (see `src/compress/lz4hc.rs`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use uzram::compress::{compress_bound, new_codec, same_filled_word, CodecParams, Dictionary};

struct Counting;

thread_local! {
    /// Allocations made by this thread (per thread, so the test harness's own threads do not
    /// interfere). `const` initialised: accessing it never allocates.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to `System` unchanged; the counter is a thread-local `Cell`,
// which neither allocates nor re-enters the allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

/// A page that compresses but is not trivial.
fn page(size: usize) -> Vec<u8> {
    (0..size)
        .map(|i| (((i * 7) % 251) ^ (i / 64)) as u8)
        .collect()
}

#[test]
fn hot_paths_do_not_allocate_after_warm_up() {
    const CALLS: u64 = 50;
    for size in [4096usize, 16384, 65536] {
        let src = page(size);
        let mut dst = vec![0u8; compress_bound(size)];
        let mut out = vec![0u8; size];
        // A zstd dictionary: digested once when the codec is made, shared by the calls.
        let dict =
            Dictionary::from_bytes((0..32768u32).map(|i| (i % 253) as u8).collect()).unwrap();
        for (name, level, dict) in [
            ("lz4", None, None),
            ("lz4", Some(8), None),
            ("lz4hc", Some(4), None),
            ("zstd", None, None),
            ("zstd", Some(1), None),
            ("zstd", Some(3), Some(dict.clone())),
            ("deflate", None, None),
            ("deflate", Some(1), None),
        ] {
            let codec = new_codec(name, CodecParams { level, dict }).unwrap();
            // Warm up: per-thread contexts are created here.
            let n = codec.compress(&src, &mut dst).unwrap();
            codec.decompress(&dst[..n], &mut out).unwrap();

            let before = allocs();
            for _ in 0..CALLS {
                codec.compress(&src, &mut dst).unwrap();
            }
            let compress_allocs = allocs() - before;
            assert_eq!(compress_allocs, 0, "{name} {level:?} compress, {size}");

            let before = allocs();
            for _ in 0..CALLS {
                codec.decompress(&dst[..n], &mut out).unwrap();
            }
            assert_eq!(allocs() - before, 0, "{name} {level:?} decompress, {size}");
            assert!(out == src);
        }
        let before = allocs();
        assert_eq!(same_filled_word(&src), None);
        assert_eq!(allocs() - before, 0);
    }
}
