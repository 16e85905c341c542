//! The device at byte granularity and its allocation map (what NBD's unaligned requests and
//! block status use): reads and writes at any offset and length match a plain byte array;
//! writes to different bytes of one page from many threads all stay; the sector-aligned forms
//! still refuse unaligned requests; `allocation` reports holes, zero pages and data as the
//! slots hold them, in merged runs, bounded in number.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use uzram::backing::MemBacking;
use uzram::device::{Device, DeviceConfig};
use uzram::{Allocation, BlockDevice, Extent};

const PAGE: usize = 4096;

fn device(pages: u64) -> Device {
    Device::new(DeviceConfig {
        disksize_bytes: pages * PAGE as u64,
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn byte_reads_and_writes_match_a_byte_array() {
    let pages = 64u64;
    let size = pages as usize * PAGE;
    for multi in [1usize, 4] {
        let dev = Device::new_uninit(PAGE).unwrap();
        if multi > 1 {
            dev.set_multi_page_size_bytes(multi * PAGE).unwrap();
        }
        dev.init(size as u64).unwrap();
        let mut model = vec![0u8; size];
        let mut rng = SmallRng::seed_from_u64(7 + multi as u64);
        for op in 0..3000 {
            let off = rng.gen_range(0..size);
            let len = rng.gen_range(1..=(size - off).min(3 * PAGE + 100));
            match rng.gen_range(0..4) {
                0 | 1 => {
                    // Compressible, incompressible and same-filled data alike.
                    let data: Vec<u8> = match op % 3 {
                        0 => (0..len).map(|i| (i / 7) as u8).collect(),
                        1 => (0..len).map(|_| rng.gen()).collect(),
                        _ => vec![0xa5; len],
                    };
                    dev.write_bytes_at(&data, off as u64).unwrap();
                    model[off..off + len].copy_from_slice(&data);
                }
                2 => {
                    dev.write_zeroes_bytes(off as u64, len as u64).unwrap();
                    model[off..off + len].fill(0);
                }
                _ => {
                    let mut buf = vec![0xeeu8; len];
                    dev.read_bytes_at(&mut buf, off as u64).unwrap();
                    assert!(buf == model[off..off + len], "op {op}: read {off}+{len}");
                }
            }
        }
        let mut all = vec![0u8; size];
        dev.read_at(&mut all, 0).unwrap();
        assert!(all == model, "multi {multi}: the whole device");
    }
}

#[test]
fn sector_forms_still_refuse_unaligned_requests() {
    let dev = device(4);
    let mut buf = [0u8; 100];
    for r in [
        dev.read_at(&mut buf, 0),
        dev.write_at(&buf, 0),
        dev.write_at(&[0u8; 512], 1),
        dev.write_zeroes(1, 511),
    ] {
        assert_eq!(r.unwrap_err().errno(), libc::EINVAL);
    }
    // The byte forms check the range as strictly: zero length and past the end are EINVAL.
    assert_eq!(
        dev.write_bytes_at(&[], 0).unwrap_err().errno(),
        libc::EINVAL
    );
    let end = 4 * PAGE as u64;
    assert_eq!(
        dev.write_bytes_at(&[1, 2], end - 1).unwrap_err().errno(),
        libc::EINVAL
    );
    assert_eq!(
        dev.read_bytes_at(&mut buf[..1], end).unwrap_err().errno(),
        libc::EINVAL
    );
    dev.write_bytes_at(&[9], end - 1).unwrap();
}

#[test]
fn concurrent_writes_to_different_bytes_of_a_page_all_stay() {
    let dev = Arc::new(device(2));
    let threads = 8;
    // Each thread owns every 8th byte of page 1 and writes them one at a time, many rounds.
    std::thread::scope(|s| {
        for t in 0..threads {
            let dev = &dev;
            s.spawn(move || {
                for round in 1..=20u8 {
                    for i in (t..PAGE).step_by(threads) {
                        let v = round.wrapping_mul(31).wrapping_add(i as u8);
                        dev.write_bytes_at(&[v], (PAGE + i) as u64).unwrap();
                    }
                }
            });
        }
    });
    let mut page = vec![0u8; PAGE];
    dev.read_at(&mut page, PAGE as u64).unwrap();
    for (i, b) in page.iter().enumerate() {
        assert_eq!(*b, 20u8.wrapping_mul(31).wrapping_add(i as u8), "byte {i}");
    }
}

fn extents(dev: &dyn BlockDevice, offset: u64, len: u64, max: usize) -> Vec<(u64, Allocation)> {
    let mut out = vec![Extent {
        len_bytes: 1,
        allocation: Allocation::Data,
    }];
    dev.allocation(offset, len, max, &mut out).unwrap();
    out.iter().map(|e| (e.len_bytes, e.allocation)).collect()
}

#[test]
fn allocation_reports_holes_zero_pages_and_data() {
    use Allocation::*;
    let p = PAGE as u64;
    let dev = device(16);
    // Fresh: one hole (and `out` was cleared first).
    assert_eq!(extents(&dev, 0, 16 * p, 100), [(16 * p, Hole)]);
    dev.write_at(&vec![0u8; PAGE], 2 * p).unwrap(); // same-filled with zeroes
    dev.write_at(&vec![0xffu8; PAGE], 3 * p).unwrap(); // same-filled, another word
    dev.write_at(&(0..PAGE).map(|i| i as u8).collect::<Vec<_>>(), 4 * p)
        .unwrap();
    dev.write_bytes_at(&[1], 6 * p + 100).unwrap(); // one byte: the page holds data
    dev.write_at(&vec![7u8; 3 * PAGE], 9 * p).unwrap();
    dev.discard(10 * p, p).unwrap(); // discarded: a hole again
    dev.write_zeroes(11 * p, p).unwrap(); // zeroed whole: freed, a hole
    assert_eq!(
        extents(&dev, 0, 16 * p, 100),
        [
            (2 * p, Hole),
            (p, Zero),
            (2 * p, Data),
            (p, Hole),
            (p, Data),
            (2 * p, Hole),
            (p, Data),
            (6 * p, Hole),
        ]
    );
    // Any byte range: the first run starts at the offset, the last ends at its end.
    assert_eq!(
        extents(&dev, 2 * p + 10, p + 20, 100),
        [(p - 10, Zero), (30, Data)]
    );
    // At most `max` runs (at least one), covering less.
    assert_eq!(
        extents(&dev, 0, 16 * p, 3),
        [(2 * p, Hole), (p, Zero), (2 * p, Data)]
    );
    assert_eq!(extents(&dev, 0, 16 * p, 0), [(2 * p, Hole)]);
    // The range is checked as a request's.
    let mut out = Vec::new();
    assert_eq!(
        dev.allocation(0, 17 * p, 10, &mut out).unwrap_err().errno(),
        libc::EINVAL
    );
    assert_eq!(
        dev.allocation(0, 0, 10, &mut out).unwrap_err().errno(),
        libc::EINVAL
    );
}

#[test]
fn written_back_pages_are_data() {
    let p = PAGE as u64;
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.set_backing(Arc::new(MemBacking::new(8 * p).unwrap()))
        .unwrap();
    dev.attr_store("disksize", &(8 * p).to_string()).unwrap();
    let data: Vec<u8> = (0..PAGE).map(|i| (i * 13 % 251) as u8).collect();
    dev.write_at(&data, p).unwrap();
    dev.attr_store("idle", "all").unwrap();
    dev.attr_store("writeback", "idle").unwrap();
    assert!(dev.attr_show("bd_stat").unwrap().split_whitespace().next() == Some("1"));
    assert_eq!(
        extents(&dev, 0, 8 * p, 10),
        [
            (p, Allocation::Hole),
            (p, Allocation::Data),
            (6 * p, Allocation::Hole)
        ]
    );
}
