//! The device's release paths and the allocator's deferred-free queue: discard and free
//! notifications clear the slot (and `mm_stat`'s data columns) at once and hand only the
//! object to the queue; the memory comes back at the worker's drain, `flush`, `compact`, a
//! write at `mem_limit`, or reset.

use uzram::device::Device;
use uzram::ErrorKind;
use uzram_testkit::device::DeviceBuilder;
use uzram_testkit::pages::{page_of, Kind, PAGE};

fn fill(dev: &Device, pages: u64) {
    for i in 0..pages {
        dev.write_at(&page_of(Kind::HalfRandom, i, 0, PAGE), i * PAGE as u64)
            .unwrap();
    }
}

fn deferred_cols(dev: &Device) -> Vec<u64> {
    dev.attr_show("deferred_stat")
        .unwrap()
        .split_whitespace()
        .map(|c| c.parse().unwrap())
        .collect()
}

/// A device of `pages` whose deferred-free queue holds `capacity` objects.
fn device(pages: u64, capacity: usize) -> Device {
    DeviceBuilder::pages(pages)
        .with(move |d| d.debug_set_deferred_capacity(capacity))
        .build()
}

#[test]
fn discard_clears_the_slot_now_and_defers_the_memory() {
    // Capacity 1024: 64 discarded pages stay queued (no worker wake-up below 512).
    let dev = device(64, 1024);
    fill(&dev, 64);
    let full = dev.stats();
    assert_eq!(full.pages_stored, 64);
    dev.discard(0, 64 * PAGE as u64).unwrap();
    let s = dev.stats();
    // The caller's view is exact at once: no data, no compressed bytes...
    assert_eq!(
        (
            s.pages_stored,
            s.orig_data_size_bytes,
            s.compr_data_size_bytes
        ),
        (0, 0, 0)
    );
    // ...while the pool still holds the objects' pages until the queue is drained.
    assert_eq!(s.mem_used_total_bytes, full.mem_used_total_bytes);
    let mut buf = vec![1u8; PAGE];
    dev.read_at(&mut buf, 5 * PAGE as u64).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    // queued fallback_contended fallback_full drains drained pending wakeups capacity
    assert_eq!(deferred_cols(&dev), [64, 0, 0, 0, 0, 64, 0, 1024]);
    dev.flush().unwrap();
    assert_eq!(dev.stats().mem_used_total_bytes, 0);
    assert_eq!(deferred_cols(&dev), [64, 0, 0, 1, 64, 0, 0, 1024]);
    let classes = dev.pool_stats().unwrap();
    assert!(classes.classes.iter().all(|c| c.objs_inuse == 0));
}

/// A release 16 times the queue's resting size (16 objects, in blocks of 8): the worker, woken
/// at 8, grows the queue as it drains; what it has not grown in time is freed by the caller.
/// Every object is freed exactly once either way.
#[test]
fn a_release_larger_than_the_resting_queue_is_freed_once() {
    let dev = device(256, 16);
    fill(&dev, 256);
    for i in 0..256u64 {
        dev.discard(i * PAGE as u64, PAGE as u64).unwrap();
    }
    dev.flush().unwrap();
    let c = deferred_cols(&dev);
    assert_eq!(
        c[0] + c[1] + c[2],
        256,
        "every object queued or freed: {c:?}"
    );
    assert_eq!(c[0], c[4], "queued == drained after flush: {c:?}");
    assert_eq!(c[5], 0);
    assert!(c[6] > 0, "the worker was woken: {c:?}");
    assert_eq!(dev.stats().mem_used_total_bytes, 0);
}

#[test]
fn free_notify_releases_like_discard() {
    let dev = device(8, 1024);
    fill(&dev, 8);
    dev.slot_free_notify(3).unwrap();
    dev.slot_free_notify(3).unwrap(); // an empty slot: counted, nothing to free
    let s = dev.stats();
    assert_eq!((s.pages_stored, s.notify_free, s.miss_free), (7, 2, 0));
    let mut buf = vec![1u8; PAGE];
    dev.read_at(&mut buf, 3 * PAGE as u64).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    dev.read_at(&mut buf, 4 * PAGE as u64).unwrap();
    assert_eq!(buf, page_of(Kind::HalfRandom, 4, 0, PAGE));
    assert_eq!(deferred_cols(&dev)[0], 1);
    let e = dev.slot_free_notify(8).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

#[test]
fn a_write_at_mem_limit_first_frees_what_is_queued() {
    let dev = device(64, 1024);
    fill(&dev, 32);
    let used = dev.stats().mem_used_total_bytes;
    dev.attr_store("mem_limit", &used.to_string()).unwrap();
    // The released pages' objects still hold the memory, but the writes must succeed.
    dev.discard(0, 32 * PAGE as u64).unwrap();
    assert_eq!(dev.stats().mem_used_total_bytes, used);
    for i in 32..48u64 {
        dev.write_at(&page_of(Kind::HalfRandom, i, 0, PAGE), i * PAGE as u64)
            .unwrap();
    }
    assert_eq!(deferred_cols(&dev)[5], 0, "the write flushed the queue");
}

#[test]
fn compact_and_reset_drain_the_queue() {
    let dev = device(64, 1024);
    fill(&dev, 64);
    dev.discard(0, 32 * PAGE as u64).unwrap();
    assert_eq!(deferred_cols(&dev)[5], 32);
    dev.compact();
    assert_eq!(deferred_cols(&dev)[5], 0);
    dev.discard(32 * PAGE as u64, 32 * PAGE as u64).unwrap();
    assert_eq!(deferred_cols(&dev)[5], 32);
    // Reset drops the pool, whose Drop stops the worker and frees the queue; a leak or a
    // double free would panic in the allocator's debug checks or here.
    dev.reset();
    assert_eq!(deferred_cols(&dev), [0; 8]);
    dev.init(64 * PAGE as u64).unwrap();
    fill(&dev, 4);
    assert_eq!(dev.stats().pages_stored, 4);
}
