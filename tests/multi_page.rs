//! `multi_page_size`: an aligned group written at once is one object its pages point
//! into; a 4 KiB write, a sub-page write, a discard or a free notification inside it breaks
//! only that page out (`multi_stat` counts the objects and the pages still pointing into
//! them); the last page out frees the object. Same-filled and incompressible groups are stored
//! page by page. The model test (`model_4k_*_multi_*`) mixes all of it under concurrency.

use std::sync::Arc;

use uzram::backing::MemBacking;
use uzram::device::Device;
use uzram_testkit::device::{mem_backing, DeviceBuilder};
use uzram_testkit::pages::{page_of, Kind, PAGE};

const GROUP: usize = 16;

/// Compressible, distinct pages (text with the page number in it).
fn text_page(i: usize) -> Vec<u8> {
    page_of(Kind::Text, i as u64, 0, PAGE)
}

fn random_page(seed: u64) -> Vec<u8> {
    page_of(Kind::Random, seed, 0, PAGE)
}

fn device(multi_page_size: &str) -> Device {
    DeviceBuilder::pages(4 * GROUP as u64)
        .attr("multi_page_size", multi_page_size)
        .build()
}

fn multi_stat(dev: &Device) -> (u64, u64) {
    let s = dev.stats();
    (s.multi_objects, s.multi_pages)
}

/// `multi_stat`'s written-back columns: objects, pages pointing at them, blocks they take.
fn multi_wb_stat(dev: &Device) -> (u64, u64, u64) {
    let s = dev.stats();
    (s.multi_wb_objects, s.multi_wb_pages, s.multi_wb_blocks)
}

fn check(dev: &Device, want: &[Vec<u8>]) {
    let mut got = vec![0u8; want.len() * PAGE];
    dev.read_at(&mut got, 0).unwrap();
    for (i, w) in want.iter().enumerate() {
        assert!(&got[i * PAGE..(i + 1) * PAGE] == w.as_slice(), "page {i}");
    }
    // Page by page too, in reverse (each read after another object's).
    for (i, w) in want.iter().enumerate().rev() {
        let mut p = vec![0u8; PAGE];
        dev.read_at(&mut p, (i * PAGE) as u64).unwrap();
        assert!(&p == w, "page {i} alone");
    }
}

#[test]
fn a_run_is_one_object_and_small_writes_break_out_only_their_page() {
    let dev = device("64K");
    assert_eq!(dev.attr_show("multi_page_size").unwrap(), "65536\n");
    let mut want: Vec<Vec<u8>> = (0..2 * GROUP).map(text_page).collect();
    // Two aligned runs in one request, then a 4 KiB page write and a run shifted by a page.
    dev.write_at(&want.concat(), 0).unwrap();
    assert_eq!(multi_stat(&dev), (2, 32));
    assert_eq!(
        dev.attr_show("multi_stat").unwrap(),
        "       2       32        0        0        0        0        0\n"
    );
    let s = dev.stats();
    assert_eq!(s.pages_stored, 32);
    assert_eq!(s.orig_data_size_bytes, 32 * PAGE as u64);
    let one_object = s.compr_data_size_bytes;
    check(&dev, &want);

    // A 4 KiB write inside the first group: only that page leaves it.
    want[3] = text_page(1003);
    dev.write_at(&want[3], 3 * PAGE as u64).unwrap();
    assert_eq!(multi_stat(&dev), (2, 31));
    // A sub-page write (read-modify-write of that page only).
    want[5][512..1024].fill(0xab);
    dev.write_at(&want[5][512..1024], (5 * PAGE + 512) as u64)
        .unwrap();
    assert_eq!(multi_stat(&dev), (2, 30));
    // A discard and a free notification.
    want[7] = vec![0; PAGE];
    dev.discard(7 * PAGE as u64, PAGE as u64).unwrap();
    dev.slot_free_notify(8).unwrap();
    want[8] = vec![0; PAGE];
    assert_eq!(multi_stat(&dev), (2, 28));
    assert_eq!(dev.stats().pages_stored, 30);
    check(&dev, &want);
    assert!(dev.stats().compr_data_size_bytes >= one_object);

    // Rewriting the second group whole replaces its object.
    for (i, p) in want.iter_mut().enumerate().skip(GROUP) {
        *p = text_page(5000 + i);
    }
    dev.write_at(&want[GROUP..].concat(), (GROUP * PAGE) as u64)
        .unwrap();
    assert_eq!(multi_stat(&dev), (2, 28));
    check(&dev, &want);

    // Breaking every page of the first group out frees its object.
    for (i, w) in want.iter_mut().enumerate().take(GROUP) {
        *w = text_page(9000 + i);
        dev.write_at(w, (i * PAGE) as u64).unwrap();
    }
    assert_eq!(multi_stat(&dev), (1, 16));
    check(&dev, &want);
    dev.flush().unwrap();
    dev.discard(0, (4 * GROUP * PAGE) as u64).unwrap();
    dev.flush().unwrap();
    let s = dev.stats();
    assert_eq!(
        (
            s.pages_stored,
            s.compr_data_size_bytes,
            s.mem_used_total_bytes
        ),
        (0, 0, 0)
    );
    assert_eq!(multi_stat(&dev), (0, 0));
}

#[test]
fn unaligned_short_same_filled_and_incompressible_groups_are_stored_page_by_page() {
    let dev = device("16K");
    let group = 4;
    // Unaligned: starts a page into a group; only the aligned group inside it is one object.
    let want: Vec<Vec<u8>> = (0..2 * group).map(text_page).collect();
    dev.write_at(&want[1..].concat(), PAGE as u64).unwrap();
    assert_eq!(multi_stat(&dev), (1, 4));
    // Shorter than a group: page by page.
    dev.write_at(&want[..3].concat(), 8 * PAGE as u64).unwrap();
    assert_eq!(multi_stat(&dev), (1, 4));
    // Same-filled group: same-filled pages.
    dev.write_at(&vec![0u8; group * PAGE], 12 * PAGE as u64)
        .unwrap();
    assert_eq!(dev.stats().same_pages, 4);
    // Incompressible group: raw (HUGE) pages.
    let random: Vec<u8> = (0..group as u64).flat_map(random_page).collect();
    dev.write_at(&random, 16 * PAGE as u64).unwrap();
    assert_eq!(dev.stats().huge_pages, 4);
    assert_eq!(multi_stat(&dev), (1, 4));
    let mut got = vec![0u8; group * PAGE];
    dev.read_at(&mut got, 16 * PAGE as u64).unwrap();
    assert!(got == random);
    dev.read_at(&mut got, 4 * PAGE as u64).unwrap();
    assert!(got == want[4..8].concat());
}

/// A device of 8 groups of 16 pages with a backing device in `layout`.
fn device_with_backing(layout: &str) -> Device {
    let dev = DeviceBuilder::pages(8 * GROUP as u64).backing(mem_backing(2048));
    let dev = match layout {
        "zoned" => dev.zoned("1M"),
        _ => dev.attr("backing_layout", layout),
    };
    dev.attr("multi_page_size", "64K").build()
}

/// Writeback takes a multi-page object whole (one write of its compressed bytes) when every
/// page still pointing into it was selected, and only then; its pages read back through the
/// backing device (one read, decompressed once); a page written or discarded inside it
/// breaks out alone; the last page out gives its blocks back. Both layouts.
#[test]
fn writeback_takes_whole_groups_and_reads_them_back() {
    for layout in ["bitmap", "zoned"] {
        let dev = device_with_backing(layout);
        let mut want: Vec<Vec<u8>> = (0..4 * GROUP).map(text_page).collect();
        dev.write_at(&want.concat(), 0).unwrap();
        // Page 20 leaves the second group before the writeback: that group's live pages are the
        // other 15.
        want[20] = text_page(7020);
        dev.write_at(&want[20], 20 * PAGE as u64).unwrap();
        assert_eq!(multi_stat(&dev), (4, 63));
        let ram = dev.stats();

        // One page of a group selected: the group stays in RAM (the other pages are not).
        dev.attr_store("writeback", "page_index=3").unwrap();
        assert_eq!(multi_wb_stat(&dev), (0, 0, 0), "{layout}");
        assert_eq!(dev.stats().bd_count, 0);
        // The whole of group 0 and the live pages of group 1 (page 20 is written back on its
        // own), and half of group 2: groups 0 and 1 go.
        dev.attr_store("writeback", "page_indexes=0-39").unwrap();
        let s = dev.stats();
        let (objects, pages, blocks) = multi_wb_stat(&dev);
        assert_eq!((objects, pages), (2, 31), "{layout}");
        assert!((2..=32).contains(&blocks), "{layout}: {blocks} blocks");
        assert_eq!(s.bd_count, blocks + 1, "{layout}");
        assert_eq!(multi_stat(&dev), (2, 32));
        assert!(s.compr_data_size_bytes < ram.compr_data_size_bytes);
        assert_eq!(s.pages_stored, ram.pages_stored);
        // Idle writeback: after `idle all`, every group goes.
        dev.attr_store("idle", "all").unwrap();
        dev.attr_store("writeback", "idle").unwrap();
        assert_eq!(multi_stat(&dev), (0, 0), "{layout}");
        assert_eq!(multi_wb_stat(&dev).0, 4, "{layout}");
        check(&dev, &want);
        let reads = dev.stats().bd_reads;
        // check() reads every page twice: once in order (one backing read per group, the
        // others from the thread's cache), once in reverse (again one per group).
        assert!(reads <= 2 * 4 + 2, "{layout}: {reads} backing reads");

        // Break-outs from a written-back group: a page write, a sub-page write, a discard.
        want[1] = text_page(9001);
        dev.write_at(&want[1], PAGE as u64).unwrap();
        want[2][512..1024].fill(0x5a);
        dev.write_at(&want[2][512..1024], (2 * PAGE + 512) as u64)
            .unwrap();
        dev.discard(3 * PAGE as u64, PAGE as u64).unwrap();
        want[3] = vec![0; PAGE];
        assert_eq!(multi_wb_stat(&dev).1, 63 - 3, "{layout}");
        check(&dev, &want);
        // Rewriting group 3 whole replaces its written-back object with one in RAM.
        for (i, w) in want.iter_mut().enumerate().skip(3 * GROUP) {
            *w = text_page(11000 + i);
        }
        dev.write_at(&want[3 * GROUP..].concat(), (3 * GROUP * PAGE) as u64)
            .unwrap();
        assert_eq!(multi_stat(&dev), (1, 16));
        assert_eq!(multi_wb_stat(&dev).0, 3);
        check(&dev, &want);
        if layout == "zoned" {
            // GC moves a group's record and every page pointing at it.
            dev.attr_store("gc", "1").unwrap();
            check(&dev, &want);
        }
        // Everything out: no block is left.
        dev.discard(0, (8 * GROUP * PAGE) as u64).unwrap();
        dev.flush().unwrap();
        let s = dev.stats();
        assert_eq!((s.pages_stored, s.bd_count), (0, 0), "{layout}");
        assert_eq!(multi_wb_stat(&dev), (0, 0, 0));
    }
}

/// Pages of words drawn at random from a small vocabulary: lz4 halves them, zstd does better
/// (so recompression with zstd lands in a smaller size class).
fn word_page(seed: u64) -> Vec<u8> {
    const WORDS: [&str; 24] = [
        "slot",
        "zspage",
        "handle",
        "writeback",
        "idle",
        "huge",
        "compact",
        "backing",
        "zone",
        "record",
        "class",
        "object",
        "page",
        "group",
        "pool",
        "frees",
        "group",
        "block",
        "crc",
        "codec",
        "lz4",
        "zstd",
        "limit",
        "queue",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(PAGE + 16);
    while out.len() < PAGE {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(WORDS[(x % WORDS.len() as u64) as usize].as_bytes());
        out.push(if x & 0x100 == 0 { b' ' } else { b'\n' });
    }
    out.truncate(PAGE);
    out
}

/// Recompression takes a multi-page object whole when every page still pointing into it was
/// selected, with the secondary codec (and a dictionary `train_dict` sampled from groups); its
/// pages read back with the new codec, from RAM and after a writeback.
#[test]
fn recompression_and_train_dict_take_whole_runs() {
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.set_backing(Arc::new(MemBacking::new(8 << 20).unwrap()))
        .unwrap();
    dev.attr_store("comp_algorithm", "lz4").unwrap();
    dev.attr_store("recomp_algorithm", "algo=zstd").unwrap();
    dev.attr_store("multi_page_size", "64K").unwrap();
    dev.attr_store("disksize", &(8 * GROUP * PAGE).to_string())
        .unwrap();
    let mut want: Vec<Vec<u8>> = (0..4 * GROUP as u64).map(word_page).collect();
    dev.write_at(&want.concat(), 0).unwrap();
    want[5] = word_page(1005);
    dev.write_at(&want[5], 5 * PAGE as u64).unwrap();
    check(&dev, &want);
    assert_eq!(multi_stat(&dev), (4, 63));

    // The dictionary is trained from the groups' pages (each group decompressed once).
    dev.attr_store("train_dict", "dict_size=4K samples=64")
        .unwrap();
    assert_eq!(dev.dict_generations(1).unwrap().current, 1);

    // Idle pages of group 1 only half: that group stays as it was; groups 0, 2 and 3 (all idle) go.
    dev.attr_store("idle", "all").unwrap();
    let mut p = vec![0u8; PAGE];
    dev.read_at(&mut p, 20 * PAGE as u64).unwrap();
    let before = dev.stats().compr_data_size_bytes;
    dev.attr_store("recompress", "type=idle").unwrap();
    let after = dev.stats();
    assert!(
        after.compr_data_size_bytes < before,
        "{before} -> {after:?}"
    );
    assert_eq!(after.recomp_done, 3 + 1, "3 groups and page 5");
    for (i, want_prio) in [(0, 1), (5, 1), (16, 0), (32, 1), (63, 1)] {
        assert_eq!(dev.debug_slot_priority(i), Some(want_prio), "page {i}");
    }
    // Every page of groups 0, 2, 3 and page 5 name the new generation.
    let g = dev.dict_generations(1).unwrap();
    let gen1 = g.held.iter().find(|h| h.0 == 1).map(|h| h.1);
    assert_eq!(gen1, Some(15 + 1 + 32), "{g:?}");
    check(&dev, &want);

    // A recompressed group is written back with its codec and reads back through it.
    dev.attr_store("writeback", "page_indexes=0-15").unwrap();
    assert_eq!(dev.stats().multi_wb_objects, 1);
    check(&dev, &want);
    // Breaking pages out of recompressed groups, in RAM and written back, keeps the counts.
    for i in [2usize, 40] {
        want[i] = word_page(5000 + i as u64);
        dev.write_at(&want[i], (i * PAGE) as u64).unwrap();
    }
    check(&dev, &want);
    dev.discard(0, (8 * GROUP * PAGE) as u64).unwrap();
    dev.flush().unwrap();
    let s = dev.stats();
    assert_eq!(
        (s.pages_stored, s.compr_data_size_bytes, s.bd_count),
        (0, 0, 0)
    );
    // No slot names a generation any more.
    assert!(dev
        .dict_generations(1)
        .unwrap()
        .held
        .iter()
        .all(|&(_, slots, _)| slots == 0));
}

/// The group cache, as `multi_stat`'s last two columns count it: lz4 decodes a first read's
/// prefix only (up to its page), so an ordered pass costs two decompressions per group (the
/// first page's prefix, then the whole) and a read of a group's last page one; zstd decodes
/// whole groups.
#[test]
fn run_cache_hits_and_partial_decompression() {
    for (codec, misses_per_ordered_group) in [("lz4", 2), ("zstd", 1)] {
        let dev = Device::new_uninit(PAGE).unwrap();
        dev.attr_store("comp_algorithm", codec).unwrap();
        dev.attr_store("multi_page_size", "64K").unwrap();
        dev.attr_store("disksize", &(4 * GROUP * PAGE).to_string())
            .unwrap();
        let want: Vec<Vec<u8>> = (0..2 * GROUP as u64).map(word_page).collect();
        dev.write_at(&want.concat(), 0).unwrap();
        let cache = |dev: &Device| {
            let s = dev.stats();
            (s.group_cache_hits, s.group_cache_misses)
        };
        let mut p = vec![0u8; PAGE];
        for (i, w) in want.iter().enumerate() {
            dev.read_at(&mut p, (i * PAGE) as u64).unwrap();
            assert!(&p == w, "{codec} page {i}");
        }
        let m = misses_per_ordered_group;
        assert_eq!(cache(&dev), (2 * (16 - m), 2 * m), "{codec}");
        // Page 3 of group 0 (a prefix), then page 15 of it (the whole), then page 9 (cached).
        for i in [3usize, 15, 9] {
            dev.read_at(&mut p, (i * PAGE) as u64).unwrap();
            assert!(p == want[i], "{codec} page {i}");
        }
        let (hits, misses) = cache(&dev);
        assert_eq!((hits, misses), (2 * (16 - m) + 3 - m, 2 * m + m), "{codec}");
    }
}
