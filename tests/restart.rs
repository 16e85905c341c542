//! A restart loses nothing (`docs/restart.md`): a device's state lives in memfds, and a new
//! process recovers it.
//!
//! - `recovers_a_quiet_device`: a device written, discarded, compacted, then recovered from
//!   its files in the same process: every page reads back, the counters match, and the
//!   recovered device takes writes again.
//! - `recovers_*`: the same for multi-page objects and large pages, recompressed pages,
//!   dictionaries and their trained generations, pages written back, devices serving swap,
//!   the limits.
//! - `refuses_*`: state that fails a check is refused with an error naming what is wrong.
//! - The crash model (`crash_model_*`), in the spirit of TigerBeetle's simulator: a child
//!   process (this test binary run again) builds a device, hands its files to the parent over
//!   a unix socket (`SCM_RIGHTS`) and runs random writes, overwrites, discards, multi-page
//!   writes and compaction from several threads (and, by configuration, recompression with
//!   dictionary training, writeback, GC), with a thread changing the limits (`mem_limit`,
//!   `writeback_limit`) and the policy texts at random, logging each operation before it
//!   starts and when it is acknowledged in shared memory; the parent kills it (`SIGKILL`) at
//!   a random moment, recovers the device and checks every page against the log: an
//!   acknowledged write reads back exactly, the one a thread had in flight reads as before or
//!   after, nothing else; and each setting is its last acknowledged value or the one in
//!   flight, never an older or a torn one. Many crash points per configuration; the seed of
//!   a failing one is printed.
//! - `crash_model_canary`: the same with the store publishing a slot before its object's bytes
//!   are copied (a testing switch): it must find a mismatch, or the harness proves nothing.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use uzram::backing::{FileBacking, FileOptions};
use uzram::device::restart::{DeviceFiles, Recover, DEVICE_FILES};
use uzram::device::Device;
use uzram::memory::SwapReserve;
use uzram::scm;
use uzram::shm::{ShmFile, ShmMap};
use uzram_testkit::device::{bd, real_tmpdir, writeback_all, DeviceBuilder};
use uzram_testkit::pages::{fill_page, program_pages, write_pages, Kind, Program, PAGE};

// ------------------------------------------------------------------------------------------
// Pages of the model: page `i`, version `v` (0: zeroes, never written or discarded).

fn kind_of(i: u64, v: u64) -> Kind {
    [
        Kind::Text,
        Kind::HalfRandom,
        Kind::Random,
        Kind::SameFilled,
        Kind::Text,
    ][((i ^ v.wrapping_mul(7)) % 5) as usize]
}

fn fill(i: u64, v: u64, out: &mut [u8]) {
    if v == 0 {
        out.fill(0);
    } else {
        fill_page(kind_of(i, v), i, v, out);
    }
}

/// Writes version `v` of each page of `pages` to `dev` (pages of `page` bytes) and records it
/// in `want`.
fn write_version(
    dev: &Device,
    page: usize,
    pages: impl IntoIterator<Item = u64>,
    v: u64,
    want: &mut [u64],
) {
    let mut buf = vec![0u8; page];
    for i in pages {
        fill(i, v, &mut buf);
        dev.write_at(&buf, i * page as u64).unwrap();
        want[i as usize] = v;
    }
}

// ------------------------------------------------------------------------------------------
// In-process recovery.

#[test]
fn recovers_a_quiet_device() {
    let page = 4096usize;
    let n = 2048u64;
    let dev = DeviceBuilder::pages(n).build();
    let mut buf = vec![0u8; page];
    let mut want = vec![0u64; n as usize];
    for i in 0..n {
        fill(i, 1, &mut buf);
        dev.write_at(&buf, i * page as u64).unwrap();
        want[i as usize] = 1;
    }
    for i in (0..n).step_by(3) {
        dev.discard(i * page as u64, page as u64).unwrap();
        want[i as usize] = 0;
    }
    for i in (0..n).step_by(5) {
        fill(i, 2, &mut buf);
        dev.write_at(&buf, i * page as u64).unwrap();
        want[i as usize] = 2;
    }
    dev.compact();
    let rec = recover_as_it_was(dev, "4 KiB");
    check_pages(&rec, page, &want, &[]).unwrap();
    exercise(&rec, page, n);
}

/// Drops `dev` once its deferred frees are flushed and recovers it from its files (which
/// outlive it; dropping it changes none of them): nothing to replay or collect, and the same
/// counters as before.
fn recover_as_it_was(dev: Device, what: &str) -> Device {
    dev.flush_deferred();
    let before = dev.stats();
    let files = dev.state_files().unwrap();
    drop(dev);
    let (rec, report) = Device::recover(files).unwrap();
    assert_eq!(report.garbage, 0, "{what}: {report:?}");
    assert_eq!(report.journal_replayed, 0, "{what}");
    let after = rec.stats();
    let counters = |s: &uzram::store::StatsSnapshot| {
        (
            s.pages_stored,
            s.compr_data_size_bytes,
            s.same_pages,
            s.huge_pages,
            s.multi_objects,
            s.mem_used_total_bytes,
        )
    };
    assert_eq!(counters(&after), counters(&before), "{what}");
    rec
}

#[test]
fn recovers_multi_page_objects_and_large_pages() {
    for (page, mps) in [(4096usize, "64K"), (16384, "4096"), (65536, "4096")] {
        let n = 256u64;
        let dev = DeviceBuilder::pages(n)
            .page_size(page)
            .attr("multi_page_size", mps)
            .build();
        let mut buf = vec![0u8; 16 * page];
        let mut want = vec![0u64; n as usize];
        for g in 0..n / 16 {
            for k in 0..16u64 {
                let i = g * 16 + k;
                fill(
                    i,
                    1 + g % 3,
                    &mut buf[k as usize * page..(k as usize + 1) * page],
                );
                want[i as usize] = 1 + g % 3;
            }
            dev.write_at(&buf, g * 16 * page as u64).unwrap();
        }
        // Break some pages out of their groups.
        for i in (0..n).step_by(7) {
            fill(i, 9, &mut buf[..page]);
            dev.write_at(&buf[..page], i * page as u64).unwrap();
            want[i as usize] = 9;
        }
        let rec = recover_as_it_was(dev, &format!("{page} {mps}"));
        check_pages(&rec, page, &want, &[]).unwrap();
        exercise(&rec, page, n);
    }
}

/// Recompression codecs come back: pages recompressed with two secondary codecs (single pages
/// and 64 KiB groups) read back after recovery, the codecs are the ones set before
/// `disksize`, releasing and recompressing recovered pages works (the per-codec counts were
/// rebuilt).
#[test]
fn recovers_recompressed_pages() {
    let page = 4096usize;
    for mps in ["4096", "64K"] {
        let n = 512u64;
        let dev = DeviceBuilder::pages(n)
            .attr("comp_algorithm", "lz4")
            .attr("recomp_algorithm", "algo=zstd priority=1")
            .attr("recomp_algorithm", "algo=deflate priority=2")
            .attr("algorithm_params", "priority=1 level=9")
            .attr("multi_page_size", mps)
            .build();
        let mut want = vec![0u64; n as usize];
        write_version(&dev, page, 0..n, 1, &mut want);
        dev.attr_store("recompress", "type=huge_idle priority=1")
            .ok();
        dev.attr_store("idle", "all").unwrap();
        dev.attr_store("recompress", "type=idle priority=1")
            .unwrap();
        let recompressed = |d: &Device| {
            (0..n)
                .filter(|&i| d.debug_slot_priority(i).unwrap_or(0) > 0)
                .count()
        };
        let before = recompressed(&dev);
        assert!(before > 0, "{mps}: nothing was recompressed");
        let recomp_alg = dev.attr_show("recomp_algorithm").unwrap();
        let rec = recover_as_it_was(dev, &format!("recompressed, multi_page_size {mps}"));
        assert_eq!(recompressed(&rec), before, "{mps}");
        assert_eq!(rec.attr_show("recomp_algorithm").unwrap(), recomp_alg);
        check_pages(&rec, page, &want, &[]).unwrap();
        // Released (overwritten, discarded) and recompressed again, on the recovered device.
        write_version(&rec, page, (0..n).step_by(3), 2, &mut want);
        for i in (1..n).step_by(5) {
            rec.discard(i * page as u64, page as u64).unwrap();
            want[i as usize] = 0;
        }
        rec.attr_store("idle", "all").unwrap();
        rec.attr_store("recompress", "type=idle priority=2")
            .unwrap();
        check_pages(&rec, page, &want, &[]).unwrap();
        exercise(&rec, page, n);
    }
}

/// Where the dictionary record of recompression priority `prio`'s generation `gen` lives in
/// the header file (docs/restart.md, "What lives where"): after the header page and the two
/// limits pages, the primary's record, then 8 generations of each priority, each a page of
/// text and room for 4 MiB of dictionary.
fn dict_record_at(prio: u64, gen: u64) -> u64 {
    let room = 4096 + (4u64 << 20);
    3 * 4096 + (1 + (prio - 1) * 8 + gen) * room
}

/// Set `k` (of `SET` pages, from page `k × SET`) of [`recovers_dictionaries_and_their_generations`],
/// version `v`: real program pages, written to `dev` and recorded in `want`; then, with
/// `prio`, every page marked idle and the idle ones recompressed with that priority only.
/// Returns the pages recompressed.
fn put_set(dev: &Device, want: &mut [Vec<u8>], k: usize, v: u64, prio: Option<u32>) -> u64 {
    const SET: usize = 64;
    let pages = program_pages(SET, 10 * v + k as u64, Program::ZstdBeatsLz4);
    write_pages(dev, k * SET, &pages);
    want[k * SET..(k + 1) * SET].clone_from_slice(&pages);
    let Some(prio) = prio else {
        return 0;
    };
    dev.attr_store("idle", "all").unwrap();
    let spec = uzram::device::RecompressSpec {
        idle: true,
        priority: Some(prio),
        ..Default::default()
    };
    dev.recompress(&spec).unwrap().recompressed
}

/// Every page of `dev` reads back as `want`'s.
fn check_all(dev: &Device, want: &[Vec<u8>], what: &str) {
    let mut buf = vec![0u8; PAGE];
    for (i, w) in want.iter().enumerate() {
        dev.read_at(&mut buf, (i * PAGE) as u64)
            .unwrap_or_else(|e| panic!("{what}: page {i}: {e}"));
        assert!(buf == *w, "{what}: page {i} differs");
    }
}

/// What the codecs of `dev` hold: each recompression priority's generations (current, and
/// pages and dictionary bytes of each) and `dict_stat`, `recomp_algorithm`.
fn codec_state(dev: &Device) -> (Vec<Option<uzram::device::GenStat>>, String, String) {
    (
        (1..=3).map(|p| dev.dict_generations(p)).collect(),
        dev.attr_show("dict_stat").unwrap(),
        dev.attr_show("recomp_algorithm").unwrap(),
    )
}

/// Dictionaries come back: a device whose primary codec (zstd) and recompression priority 2
/// were given `dict=` files, and whose priority 1 holds three trained generations (five
/// trainings: the second reuses generation 0, the one `disksize` made, and the fourth
/// generation 1, their records replaced; generation 0 then dropped, its record left), is
/// recovered from its files with every page identical and the same generations, current ones
/// and page counts (`dict_stat`); it trains and recompresses again and is recovered again. A generation's record torn where no slot
/// names it is ignored (and its room reused by the next training); torn where slots name it,
/// the device is refused naming a slot, the generation and why.
#[test]
fn recovers_dictionaries_and_their_generations() {
    let dir = tempfile::tempdir().unwrap();
    let raw = |version: u64| -> Vec<u8> {
        program_pages(64, version, Program::Any)
            .iter()
            .step_by(4)
            .flatten()
            .copied()
            .collect()
    };
    let (primary_dict, prio2_dict) = (dir.path().join("primary"), dir.path().join("prio2"));
    std::fs::write(&primary_dict, raw(900)).unwrap();
    std::fs::write(&prio2_dict, raw(901)).unwrap();
    let n = 7 * 64u64;
    let dev = DeviceBuilder::pages(n)
        .attr("comp_algorithm", "zstd")
        .attr(
            "algorithm_params",
            &format!("level=1 dict={}", primary_dict.display()),
        )
        .attr("recomp_algorithm", "algo=zstd priority=1")
        .attr("recomp_algorithm", "algo=zstd priority=2")
        .attr("algorithm_params", "priority=1 level=19")
        .attr(
            "algorithm_params",
            &format!("priority=2 level=19 dict={}", prio2_dict.display()),
        )
        .build();
    let mut want = vec![vec![0u8; PAGE]; n as usize];
    let train = |d: &Device| {
        d.attr_store("train_dict", "priority=1 dict_size=8K samples=256")
            .unwrap()
    };
    let current = |d: &Device| d.dict_generations(1).unwrap().current;
    // Set 0: priority 2, its `dict=`.
    assert!(put_set(&dev, &mut want, 0, 1, Some(2)) > 0);
    // Training 1: generation 1 (dropping generation 0, which holds no page); training 2
    // reuses generation 0 (its record from `disksize` replaced); training 3: generation 2.
    // Each recompresses a set.
    for (k, gen) in [(1, 1), (2, 0), (3, 2)] {
        train(&dev);
        assert_eq!(current(&dev), gen);
        assert!(put_set(&dev, &mut want, k, 1, Some(1)) > 0, "set {k}");
    }
    // Set 1 overwritten drops generation 1, which training 4 reuses; training 5: generation
    // 3. Then set 2 overwritten drops generation 0, whose record stays (valid, of an older
    // install) until a training reuses or punches its room.
    put_set(&dev, &mut want, 1, 2, None);
    for (k, gen) in [(4, 1), (5, 3)] {
        train(&dev);
        assert_eq!(current(&dev), gen);
        assert!(put_set(&dev, &mut want, k, 1, Some(1)) > 0, "set {k}");
    }
    put_set(&dev, &mut want, 2, 2, None);
    // Set 6: the primary's `dict=` only.
    put_set(&dev, &mut want, 6, 1, None);
    let state = codec_state(&dev);
    let gens = state.0[0].clone().unwrap();
    assert_eq!(
        gens.held.iter().map(|h| h.0).collect::<Vec<_>>(),
        [1, 2, 3],
        "{gens:?}"
    );
    assert!(gens.held.iter().all(|h| h.1 > 0 && h.2 > 0), "{gens:?}");
    assert!(
        state.0[1].as_ref().unwrap().held[0].2 > 0,
        "{:?}",
        state.0[1]
    );

    dev.flush_deferred();
    let files = dev.state_files().unwrap();
    let keep = dup_files(&files);
    let rec = recover_as_it_was(dev, "dictionaries");
    assert_eq!(codec_state(&rec), state);
    check_all(&rec, &want, "recovered");

    // A torn record in a room no slot names (a training killed while writing generation
    // 4's: its text written, its dictionary not, over the bytes of another record): ignored.
    let header = &keep.header;
    let text = header.read_at(dict_record_at(1, 2), 4096).unwrap();
    let text = String::from_utf8(text)
        .unwrap()
        .replace("gen 2\n", "gen 4\n");
    header
        .write_at(dict_record_at(1, 4), text.as_bytes())
        .unwrap();
    drop(rec);
    let (rec, _) = Device::recover(dup_files(&keep)).unwrap();
    assert_eq!(codec_state(&rec), state);
    check_all(&rec, &want, "a torn record no slot names");

    // The recovered device trains (generation 0 again, its stale record replaced),
    // recompresses, and is recovered again with everything.
    train(&rec);
    assert_eq!(current(&rec), 0);
    assert!(put_set(&rec, &mut want, 6, 2, Some(1)) > 0);
    let state = codec_state(&rec);
    let rec = recover_as_it_was(rec, "trained again after recovery");
    assert_eq!(codec_state(&rec), state);
    check_all(&rec, &want, "recovered twice");
    drop(rec);

    // Generation 2's dictionary changed by one byte (of its content, which zstd would load
    // all the same): its record fails its checksum, and set 3's pages name it.
    let text = String::from_utf8(header.read_at(dict_record_at(1, 2), 4096).unwrap()).unwrap();
    let len: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("bytes "))
        .unwrap()
        .parse()
        .unwrap();
    let at = dict_record_at(1, 2) + 4096 + len - 100;
    let byte = header.read_at(at, 1).unwrap()[0];
    header.write_at(at, &[byte ^ 0x10]).unwrap();
    let e = Device::recover(dup_files(&keep)).unwrap_err();
    let msg = e.message();
    let slot: Option<usize> = msg
        .split("slot ")
        .nth(1)
        .and_then(|t| t.split(':').next()?.parse().ok());
    assert!(
        slot.is_some_and(|s| (3 * 64..4 * 64).contains(&s))
            && msg.contains("generation 2")
            && msg.contains("torn")
            && msg.contains("checksum"),
        "{msg}"
    );
    header.write_at(at, &[byte]).unwrap();
    Device::recover(keep).unwrap();
}

/// A header written by a binary from before the dictionary records (version 1: none after
/// its limits slots) recovers as before, its codecs without dictionaries; a training then
/// makes it keep its dictionaries (version 2, every codec's generation 0 recorded before the
/// new generation), and the next recovery brings them back.
#[test]
fn a_header_from_before_dictionary_records_keeps_them_once_trained() {
    let n = 3 * 64u64;
    let dev = DeviceBuilder::pages(n)
        .attr("recomp_algorithm", "algo=zstd priority=1")
        .build();
    let mut want = vec![vec![0u8; PAGE]; n as usize];
    assert!(put_set(&dev, &mut want, 0, 1, Some(1)) > 0);
    dev.flush_deferred();
    let files = dev.state_files().unwrap();
    drop(dev);
    // What an earlier binary wrote: version 1, nothing after the limits pages.
    files.header.write_at(19, b"1").unwrap();
    files.header.set_len(3 * 4096).unwrap();
    let (dev, _) = Device::recover(files).unwrap();
    check_all(&dev, &want, "version 1");
    dev.attr_store("train_dict", "dict_size=4K samples=64")
        .unwrap();
    assert!(put_set(&dev, &mut want, 1, 1, Some(1)) > 0);
    let state = codec_state(&dev);
    assert_eq!(
        state.0[0].as_ref().unwrap().held.len(),
        2,
        "{:?}",
        state.0[0]
    );
    let files = dev.state_files().unwrap();
    assert_eq!(
        files.header.read_at(0, 20).unwrap(),
        b"uzram-device-state 2"
    );
    let rec = recover_as_it_was(dev, "version 1, trained");
    assert_eq!(codec_state(&rec), state);
    check_all(&rec, &want, "version 1, trained");
    drop(files);
}

/// `zone_stat` as numbers (`empty open full live_bytes writeback_bytes gc_runs ...`).
fn zone_stat(dev: &Device) -> Vec<u64> {
    dev.attr_show("zone_stat")
        .unwrap()
        .split_whitespace()
        .take(8)
        .map(|v| v.parse().unwrap())
        .collect()
}

/// The zoned layout over a file: pages written back (single pages and 64 KiB groups), some
/// overwritten and written back again, GC run; then recovered from the files and the backing
/// file opened again: every page reads back, the zones hold the same live bytes, and the
/// recovered device writes back, runs GC and reads back again. A zoned block device is
/// refused (not recoverable yet).
#[test]
fn recovers_pages_written_back_in_the_zoned_layout() {
    let page = 4096usize;
    for mps in ["4096", "64K"] {
        let n = 2048u64;
        let dir = real_tmpdir();
        let path = dir.path().join("zones");
        let dev = DeviceBuilder::pages(n)
            .backing(backing_file(&path, 8 << 20))
            .zoned("1M")
            .attr("multi_page_size", mps)
            .build();
        let mut want = vec![0u64; n as usize];
        write_version(&dev, page, 0..n, 1, &mut want);
        writeback_all(&dev, n);
        // Half overwritten and written back again: the first records die, GC has work.
        write_version(&dev, page, (0..n).step_by(2), 2, &mut want);
        writeback_all(&dev, n);
        dev.attr_store("gc", "1").unwrap();
        for i in (0..n).step_by(7) {
            dev.discard(i * page as u64, page as u64).unwrap();
            want[i as usize] = 0;
        }
        dev.flush_deferred();
        let zones = zone_stat(&dev);
        let bd_before = bd(&dev)[0];
        assert!(bd_before > 0 && zones[5] > 0, "{mps}: zone_stat {zones:?}");
        let files = dev.state_files().unwrap();
        drop(dev);
        let (rec, _) =
            Device::recover_with(files, reopened(&path)).unwrap_or_else(|e| panic!("{mps}: {e}"));
        check_pages(&rec, page, &want, &[]).unwrap();
        assert_eq!(bd(&rec)[0], bd_before, "{mps}: bd_count");
        let now = zone_stat(&rec);
        assert_eq!(now[3], zones[3], "{mps}: live bytes {zones:?} -> {now:?}");
        let layout = rec.attr_show("backing_layout").unwrap();
        assert!(
            layout.contains("[zoned]") || layout.trim() == "zoned",
            "{layout}"
        );
        // The recovered device goes on: overwrites, writeback, GC, everything reads back.
        write_version(&rec, page, (1..n).step_by(3), 3, &mut want);
        writeback_all(&rec, n);
        rec.attr_store("gc", "1").unwrap();
        check_pages(&rec, page, &want, &[]).unwrap();
        exercise(&rec, page, n);
    }
}

#[test]
fn refuses_a_slot_naming_a_free_handle_and_a_foreign_header() {
    let page = 4096usize;
    let dev = DeviceBuilder::pages(64).build();
    let mut buf = vec![0u8; page];
    fill(1, 1, &mut buf);
    assert_ne!(kind_of(1, 1), Kind::SameFilled);
    dev.write_at(&buf, page as u64).unwrap();
    let files = dev.state_files().unwrap();
    // Slot 1 names handle 1 (the first one); point it at handle 1000, never handed out.
    let [header, slots, handles, frames, records] = files.into_fds();
    let slots = ShmFile::from_fd(slots);
    let entry = slots.read_at(16, 16).unwrap();
    assert_eq!(u64::from_le_bytes(entry[..8].try_into().unwrap()), 1);
    slots.write_at(16, &1000u64.to_le_bytes()).unwrap();
    let fds = [header, slots.into_fd(), handles, frames, records];
    let err = Device::recover(DeviceFiles::from_fds(fds)).unwrap_err();
    assert!(err.message().contains("slot 1"), "{err}");
    // A header that is not one.
    let [header, slots, handles, frames, records] = dev.state_files().unwrap().into_fds();
    let header = ShmFile::from_fd(header);
    header.write_at(0, b"not a header").unwrap();
    let fds = [header.into_fd(), slots, handles, frames, records];
    let err = Device::recover(DeviceFiles::from_fds(fds)).unwrap_err();
    assert!(err.message().contains("header"), "{err}");
}

/// A backing file of `bytes` at `path`.
fn backing_file(path: &std::path::Path, bytes: u64) -> Arc<FileBacking> {
    Arc::new(FileBacking::create(path, bytes, &FileOptions::default()).unwrap())
}

/// What recovering a device that wrote back to the file at `path` needs: the file opened again.
fn reopened(path: &std::path::Path) -> Recover {
    Recover {
        backing: Some(Arc::new(
            FileBacking::open(path, &FileOptions::default()).unwrap(),
        )),
        ..Recover::default()
    }
}

/// The settings a device changes while it serves come back: `mem_limit` (`mm_stat`'s fourth
/// column), `writeback_limit_enable`, `writeback_limit` as writebacks used it, and
/// `writeback_batch_size`, whether set before `disksize` or after.
#[test]
fn recovers_the_limits_set_while_serving() {
    let page = 4096usize;
    let n = 256u64;
    let dir = real_tmpdir();
    let path = dir.path().join("backing");
    let dev = DeviceBuilder::pages(n)
        .backing(backing_file(&path, 2 * n * page as u64))
        .attr("writeback_batch_size", "7")
        .build();
    dev.attr_store("mem_limit", "64M").unwrap();
    dev.attr_store("writeback_limit_enable", "1").unwrap();
    dev.attr_store("writeback_limit", "100").unwrap();
    let mut buf = vec![0u8; page];
    let mut want = vec![0u64; n as usize];
    for i in 0..n {
        fill(i, 1, &mut buf);
        dev.write_at(&buf, i * page as u64).unwrap();
        want[i as usize] = 1;
    }
    // Writeback takes what the limit allows: 100 pages, leaving it at 0.
    writeback_all(&dev, n);
    assert_eq!(dev.attr_show("writeback_limit").unwrap(), "0\n");
    dev.attr_store("writeback_limit", "40").unwrap();
    let mem_limit = |d: &Device| {
        d.attr_show("mm_stat")
            .unwrap()
            .split_whitespace()
            .nth(3)
            .map(str::to_string)
    };
    let before = mem_limit(&dev);
    assert_eq!(before.as_deref(), Some((64u64 << 20).to_string().as_str()));
    let files = dev.state_files().unwrap();
    drop(dev);
    let (rec, _) = Device::recover_with(files, reopened(&path)).unwrap();
    assert_eq!(mem_limit(&rec), before);
    assert_eq!(rec.attr_show("writeback_limit_enable").unwrap(), "1\n");
    assert_eq!(rec.attr_show("writeback_limit").unwrap(), "40\n");
    assert_eq!(rec.attr_show("writeback_batch_size").unwrap(), "7\n");
    check_pages(&rec, page, &want, &[]).unwrap();
}

/// Pages written back to a backing file (bitmap layout, plain and compressed blocks, single
/// pages and 64 KiB multi-page objects) read back after recovery with the file opened again;
/// the bitmap is rebuilt from the slots (`bd_count` as before, every block claimed once), and
/// the recovered device writes back again. Without the backing file, or with another, the
/// device is refused.
#[test]
fn recovers_written_back_pages() {
    let page = 4096usize;
    let n = 512u64;
    for (mps, compressed) in [("4096", false), ("4096", true), ("64K", false)] {
        let what = format!("multi_page_size {mps}, compressed_writeback {compressed}");
        let dir = real_tmpdir();
        let path = dir.path().join("backing");
        let options = FileOptions::default();
        let dev = DeviceBuilder::pages(n)
            .backing(backing_file(&path, 2 * n * page as u64))
            .compressed_writeback(compressed)
            .attr("multi_page_size", mps)
            .build();
        let mut buf = vec![0u8; 16 * page];
        let mut want = vec![0u64; n as usize];
        for g in 0..n / 16 {
            for k in 0..16u64 {
                let i = g * 16 + k;
                let at = k as usize * page;
                fill(i, 1 + g % 3, &mut buf[at..at + page]);
                want[i as usize] = 1 + g % 3;
            }
            dev.write_at(&buf, g * 16 * page as u64).unwrap();
        }
        writeback_all(&dev, n);
        // Some written-back pages overwritten (in memory now) or discarded (blocks freed).
        for i in (0..n).step_by(5) {
            fill(i, 7, &mut buf[..page]);
            dev.write_at(&buf[..page], i * page as u64).unwrap();
            want[i as usize] = 7;
        }
        for i in (3..n).step_by(11) {
            dev.discard(i * page as u64, page as u64).unwrap();
            want[i as usize] = 0;
        }
        dev.flush_deferred();
        let bd_before = bd(&dev);
        assert!(bd_before[0] > n / 4, "{what}: {bd_before:?}");
        let stored = dev.stats().pages_stored;
        let files = dev.state_files().unwrap();
        let again = dup_files(&files);
        drop(dev);

        let err = Device::recover(dup_files(&files)).unwrap_err();
        assert!(
            err.message().contains("give its backing device"),
            "{what}: {err}"
        );
        let other =
            FileBacking::create(dir.path().join("other"), page as u64 * 64, &options).unwrap();
        let with_other = Recover {
            backing: Some(Arc::new(other)),
            ..Recover::default()
        };
        let err = Device::recover_with(dup_files(&files), with_other).unwrap_err();
        assert!(err.message().contains("wrote back to"), "{what}: {err}");

        let (rec, report) = Device::recover_with(again, reopened(&path)).unwrap();
        assert_eq!(report.garbage, 0, "{what}: {report:?}");
        assert_eq!(rec.stats().pages_stored, stored, "{what}");
        assert_eq!(bd(&rec)[0], bd_before[0], "{what}: bd_count");
        check_pages(&rec, page, &want, &[]).unwrap();
        // Written back again, over the rebuilt bitmap: no block is handed out twice.
        writeback_all(&rec, n);
        check_pages(&rec, page, &want, &[]).unwrap();
        exercise(&rec, page, n);
    }
}

/// A write as the kernel makes it to a device serving swap (the same as a plain write to any
/// other device): one the swap reserve cannot serve
/// in time (its refiller starved of CPU on a loaded machine) fails with `ENOMEM`, as zram's
/// write when zsmalloc gets no page, and is issued again; any other error fails the test.
fn write_swap(dev: &Device, buf: &[u8], offset: u64) {
    for _ in 0..50 {
        match dev.write_at(buf, offset) {
            Ok(_) => return,
            Err(e) if e.errno() == libc::ENOMEM => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            Err(e) => panic!("write at {offset}: {e}"),
        }
    }
    panic!("write at {offset}: ENOMEM 50 times in a row");
}

/// Devices serving swap share the server's swap reserve: two of them recover from its files
/// (each pool claims only the frames its records are tagged with), a third that was not handed
/// over loses its frames to the reserve when its recovery finishes, and the recovered devices
/// take writes from the refilled reserve. Recovering one without the reserve, or with another
/// reserve, is refused.
#[test]
fn recovers_devices_serving_swap() {
    let page = 4096usize;
    let n = 1024u64;
    let reserve_bytes = 8 << 20;
    let reserve = SwapReserve::new(reserve_bytes).unwrap();
    let devs: Vec<Device> = (0..3)
        .map(|_| {
            let r = Arc::clone(&reserve);
            DeviceBuilder::pages(n)
                .with(move |d| d.set_swap_reserve(Some(r)).unwrap())
                .build()
        })
        .collect();
    let mut buf = vec![0u8; page];
    let mut wants = Vec::new();
    for (d, dev) in devs.iter().enumerate() {
        let mut want = vec![0u64; n as usize];
        for i in 0..n {
            let v = 1 + (i + d as u64) % 3;
            fill(i, v, &mut buf);
            write_swap(dev, &buf, i * page as u64);
            want[i as usize] = v;
        }
        for i in (d as u64..n).step_by(4) {
            dev.discard(i * page as u64, page as u64).unwrap();
            want[i as usize] = 0;
        }
        dev.compact();
        dev.flush_deferred();
        wants.push(want);
    }
    let (frames, records) = reserve.files().unwrap();
    let files: Vec<DeviceFiles> = devs[..2].iter().map(|d| d.state_files().unwrap()).collect();
    let stored: Vec<u64> = devs.iter().map(|d| d.stats().pages_stored).collect();
    // The process "dies": its devices and reserve are left as they are (dropping them would
    // clear their records), the refiller stops, the files stay.
    reserve.stop_refiller();
    std::mem::forget(devs);
    drop(reserve);

    let other = SwapReserve::new(1 << 20).unwrap();
    let mut files = files.into_iter();
    let a = files.next().unwrap();
    let err = Device::recover(dup_files(&a)).unwrap_err();
    assert!(err.message().contains("served swap"), "{err}");
    let err = Device::recover_swap(dup_files(&a), &other).unwrap_err();
    assert!(err.message().contains("not being recovered"), "{err}");

    let rec = SwapReserve::recover(reserve_bytes, frames, records).unwrap();
    let mut recovered = Vec::new();
    for (d, f) in [a, files.next().unwrap()].into_iter().enumerate() {
        let (dev, report) = Device::recover_swap(f, &rec).unwrap();
        assert_eq!(report.garbage, 0, "device {d}: {report:?}");
        assert_eq!(dev.stats().pages_stored, stored[d], "device {d}");
        check_pages(&dev, page, &wants[d], &[]).unwrap();
        recovered.push(dev);
    }
    let before = rec.stats().held_pages;
    rec.finish_recovery().unwrap();
    assert!(
        rec.stats().held_pages > before,
        "the reserve is faulted in again: {:?}",
        rec.stats()
    );
    for (d, dev) in recovered.iter().enumerate() {
        check_pages(dev, page, &wants[d], &[]).unwrap();
        exercise(dev, page, n);
        assert!(dev.swap_reserve().is_some(), "device {d} serves swap");
    }
}

/// New descriptors of the same files.
fn dup_files(f: &DeviceFiles) -> DeviceFiles {
    let dup = |s: &ShmFile| s.try_clone_fd().unwrap();
    DeviceFiles::from_fds([
        dup(&f.header),
        dup(&f.store.slots),
        dup(&f.store.pool.handles),
        dup(&f.store.pool.frames),
        dup(&f.store.pool.records),
    ])
}

/// Reads every page of `dev` and compares it with version `want[i]`, or (for the pages
/// `in_flight` names) either of two versions. `Err` lists the mismatches.
fn check_pages(
    dev: &Device,
    page: usize,
    want: &[u64],
    in_flight: &[(u64, u64)],
) -> Result<(), String> {
    let mut got = vec![0u8; page];
    let mut exp = vec![0u8; page];
    let mut bad = Vec::new();
    for (i, &v) in want.iter().enumerate() {
        let i = i as u64;
        if let Err(e) = dev.read_at(&mut got, i * page as u64) {
            bad.push(format!("page {i}: read failed: {e}"));
            continue;
        }
        fill(i, v, &mut exp);
        if got == exp {
            continue;
        }
        let alt = in_flight.iter().find(|f| f.0 == i).map(|f| f.1);
        if let Some(alt) = alt {
            fill(i, alt, &mut exp);
            if got == exp {
                continue;
            }
        }
        bad.push(format!(
            "page {i}: neither version {v} nor {alt:?} (starts {:02x?})",
            &got[..16]
        ));
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} mismatches: {}",
            bad.len(),
            bad[..bad.len().min(8)].join("; ")
        ))
    }
}

/// The recovered allocator works: overwrite, discard and compact, every page read back.
fn exercise(dev: &Device, page: usize, n: u64) {
    let mut buf = vec![0u8; page];
    let mut want = vec![0u64; n as usize];
    for i in 0..n {
        fill(i, 100 + i % 4, &mut buf);
        write_swap(dev, &buf, i * page as u64);
        want[i as usize] = 100 + i % 4;
    }
    for i in (0..n).step_by(2) {
        dev.discard(i * page as u64, page as u64).unwrap();
        want[i as usize] = 0;
    }
    dev.compact();
    check_pages(dev, page, &want, &[]).unwrap();
}

// ------------------------------------------------------------------------------------------
// The crash model.

/// A configuration of the crash model.
#[derive(Debug, Clone, Copy)]
struct Config {
    name: &'static str,
    page_size: usize,
    pages: u64,
    /// `multi_page_size` (4096: off).
    multi_page_size: usize,
    /// Pages written at once by a group write (the multi-page group, or 4).
    group_pages: u64,
    threads: u64,
    /// Serving swap: the device takes its frames from a swap reserve, which a second device
    /// (not handed over, written by a thread of its own) shares.
    swap: bool,
    /// Writing back: the device has a backing file, and a thread writes every page back
    /// again and again (bitmap layout).
    writeback: bool,
    /// Recompressing: the device has two recompression codecs (zstd at priority 1, deflate
    /// at 2), and a thread marks every page idle and recompresses the idle ones with one or
    /// the other, again and again, training a new dictionary generation of priority 1 before
    /// every third pass from the second, which then recompresses with it (`train_dict`:
    /// generations made, made current and reused while writers run, their records written
    /// into the header file; not before the first pass, so that recompression starts as early
    /// as without).
    recompress: bool,
    /// With `writeback`: the zoned layout (zones of 1 MiB over the file), GC run after each
    /// writeback pass.
    zoned: bool,
}

/// The swap configuration's reserve.
const SWAP_RESERVE_BYTES: usize = 8 << 20;

const CONFIGS: [Config; 6] = [
    Config {
        name: "4k",
        page_size: 4096,
        pages: 1024,
        multi_page_size: 4096,
        group_pages: 4,
        threads: 3,
        swap: false,
        writeback: false,
        recompress: true,
        zoned: false,
    },
    Config {
        name: "4k-multi",
        page_size: 4096,
        pages: 1024,
        multi_page_size: 65536,
        group_pages: 16,
        threads: 3,
        swap: false,
        writeback: false,
        recompress: true,
        zoned: false,
    },
    Config {
        name: "16k",
        page_size: 16384,
        pages: 256,
        multi_page_size: 4096,
        group_pages: 2,
        threads: 2,
        swap: false,
        writeback: false,
        recompress: false,
        zoned: false,
    },
    Config {
        name: "4k-swap",
        page_size: 4096,
        pages: 1024,
        multi_page_size: 4096,
        group_pages: 4,
        threads: 2,
        swap: true,
        writeback: false,
        recompress: false,
        zoned: false,
    },
    Config {
        name: "4k-multi-writeback",
        page_size: 4096,
        pages: 1024,
        multi_page_size: 65536,
        group_pages: 16,
        threads: 2,
        swap: false,
        writeback: true,
        recompress: false,
        zoned: false,
    },
    Config {
        name: "4k-multi-zoned",
        page_size: 4096,
        pages: 1024,
        multi_page_size: 65536,
        group_pages: 16,
        threads: 2,
        swap: false,
        writeback: true,
        recompress: false,
        zoned: true,
    },
];

/// Log entries per writer thread (16 bytes each); a thread that fills its log stops.
const LOG_ENTRIES: usize = 1 << 15;
const BEGUN: u64 = 1;
const ACKED: u64 = 2;
/// Operation kinds in a log entry's top byte.
const OP_WRITE: u64 = 1;
const OP_DISCARD: u64 = 2;
const OP_GROUP: u64 = 3;

fn op_word(kind: u64, target: u64, version: u64) -> u64 {
    kind << 56 | target << 32 | version
}

/// Log entries of the settings thread, after the writers' (it stops once they are used).
const SETTINGS_ENTRIES: usize = 1 << 14;
/// The settings thread's operations: `mem_limit`, `writeback_limit`, the `policy` text
/// (`Device::save_policy`) and the policies' state text (`Device::save_policy_state`), each
/// set to the value of its entry's version ([`setting_value`]).
const OP_MEM_LIMIT: u64 = 4;
const OP_WB_LIMIT: u64 = 5;
const OP_POLICY: u64 = 6;
const OP_POLICY_STATE: u64 = 7;
const SETTINGS: [u64; 4] = [OP_MEM_LIMIT, OP_WB_LIMIT, OP_POLICY, OP_POLICY_STATE];

/// The value the settings thread sets for `kind` at version `v`, as the device shows it
/// (`mem_limit` in bytes as `mm_stat` shows it: 0 or 64 MiB and more, never reached by the
/// model's 4 MiB of pages; `writeback_limit` in 4 KiB units, never enabled, so nothing
/// uses it; the texts of lengths up to most of a record's slot).
fn setting_value(kind: u64, v: u64) -> String {
    let text = |what: &str| {
        let pad = "x".repeat((v * 131 % 3500) as usize);
        format!("{what} {v}\npad {pad}\n")
    };
    match kind {
        OP_MEM_LIMIT if v % 5 == 0 => "0".to_string(),
        OP_MEM_LIMIT => ((64 + v % 512) << 20).to_string(),
        OP_WB_LIMIT => (v * 7919 % 1_000_000).to_string(),
        OP_POLICY => text("policy"),
        _ => text("state"),
    }
}

/// Sets `kind` to `value` ([`setting_value`]) on `dev`.
fn set_setting(dev: &Device, kind: u64, value: &str) {
    match kind {
        OP_MEM_LIMIT => dev.attr_store("mem_limit", value).unwrap(),
        OP_WB_LIMIT => dev.attr_store("writeback_limit", value).unwrap(),
        OP_POLICY => dev.save_policy(value).unwrap(),
        _ => dev.save_policy_state(value).unwrap(),
    }
}

/// What `dev` shows of `kind`, as [`setting_value`] gives it (`None`: no text saved).
fn shown_setting(dev: &Device, kind: u64) -> Option<String> {
    match kind {
        OP_MEM_LIMIT => dev
            .attr_show("mm_stat")
            .unwrap()
            .split_whitespace()
            .nth(3)
            .map(str::to_string),
        OP_WB_LIMIT => Some(dev.attr_show("writeback_limit").unwrap().trim().to_string()),
        OP_POLICY => dev.saved_policy(),
        _ => dev.saved_policy_state(),
    }
}

/// The child's fds, at fixed numbers.
const CHILD_SOCK_FD: RawFd = 100;
const CHILD_LOG_FD: RawFd = 101;
const CHILD_ENV: &str = "UZRAM_RESTART_CHILD";

/// The child's side: not a test of its own (returns at once unless run as the child).
#[test]
fn crash_model_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.split(',');
    let name = parts.next().unwrap();
    let seed: u64 = parts.next().unwrap().parse().unwrap();
    let canary = parts.next() == Some("canary");
    let cfg = *CONFIGS.iter().find(|c| c.name == name).unwrap();
    if canary {
        uzram::store::set_publish_before_copy(true);
    }
    let reserve = cfg
        .swap
        .then(|| SwapReserve::new(SWAP_RESERVE_BYTES).unwrap());
    let backing_path = parts.next().filter(|p| !p.is_empty()).map(str::to_string);
    let swap_device = || {
        let r = reserve.clone();
        let mut b = DeviceBuilder::pages(cfg.pages)
            .page_size(cfg.page_size)
            .with(move |d| d.set_swap_reserve(r).unwrap())
            .attr("multi_page_size", &cfg.multi_page_size.to_string());
        if cfg.recompress {
            b = b
                .attr("recomp_algorithm", "algo=zstd priority=1")
                .attr("recomp_algorithm", "algo=deflate priority=2");
        }
        if let Some(path) = &backing_path {
            // Zoned: room for GC to keep up with writeback passes of every page.
            let size = if cfg.zoned { 4 } else { 2 } * cfg.pages * cfg.page_size as u64;
            b = b.backing(Arc::new(
                FileBacking::create(path, size, &FileOptions::default()).unwrap(),
            ));
            if cfg.zoned {
                b = b.zoned("1M");
            }
        }
        b.build()
    };
    let dev = Arc::new(swap_device());
    // Serving swap, a neighbour shares the reserve: its frames are not this device's.
    let neighbour = cfg.swap.then(|| Arc::new(swap_device()));
    // SAFETY: the parent placed the socket at this number for us.
    let sock = unsafe { OwnedFd::from_raw_fd(CHILD_SOCK_FD) };
    let fds = dev.state_files().unwrap().into_fds();
    send_fds(&sock, &fds);
    // SAFETY: the parent placed the log's memfd at this number for us.
    let log = ShmFile::from_fd(unsafe { OwnedFd::from_raw_fd(CHILD_LOG_FD) });
    let log_map = Arc::new(log.map(0, log_bytes(&cfg)).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for t in 0..cfg.threads {
        let (dev, log_map) = (Arc::clone(&dev), Arc::clone(&log_map));
        threads.push(std::thread::spawn(move || {
            // This thread's pairs: written only by it.
            let entries = &log_entries(&log_map)[t as usize * LOG_ENTRIES..][..LOG_ENTRIES];
            writer(&dev, &cfg, t, seed, entries);
        }));
    }
    {
        let (dev, log_map) = (Arc::clone(&dev), Arc::clone(&log_map));
        threads.push(std::thread::spawn(move || {
            // The settings thread's pairs follow the writers': written only by it.
            let entries = &log_entries(&log_map)[cfg.threads as usize * LOG_ENTRIES..];
            settings(&dev, seed, &entries[..SETTINGS_ENTRIES]);
        }));
    }
    if cfg.writeback && !cfg.zoned {
        let dev = Arc::clone(&dev);
        threads.push(std::thread::spawn(move || loop {
            writeback_all(&dev, cfg.pages);
        }));
    }
    if cfg.zoned {
        // Writeback passes and GC; a pass may find the zones full until GC ran (ENOSPC).
        let dev = Arc::clone(&dev);
        threads.push(std::thread::spawn(move || loop {
            let spec = uzram::writeback::WritebackSpec::pages(0, cfg.pages - 1);
            if let Err(e) = dev.writeback_with_progress(&spec, &mut |_| {}) {
                assert_eq!(e.errno(), libc::ENOSPC, "writeback: {e}");
            }
            dev.attr_store("gc", "1").unwrap();
        }));
    }
    if cfg.recompress {
        let dev = Arc::clone(&dev);
        threads.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(seed ^ 0x7e);
            for pass in 0u64.. {
                std::thread::sleep(Duration::from_micros(rng.gen_range(100..2000)));
                dev.attr_store("idle", "all").unwrap();
                let mut prio = rng.gen_range(1..=2);
                if pass % 3 == 1 {
                    // Too few pages, or too alike, to learn from (EINVAL); every generation
                    // held by pages (EBUSY): nothing installed.
                    match dev.attr_store("train_dict", "priority=1 dict_size=1K samples=16") {
                        Ok(()) => prio = 1,
                        Err(e) if [libc::EINVAL, libc::EBUSY].contains(&e.errno()) => {}
                        Err(e) => panic!("train_dict: {e}"),
                    }
                }
                dev.attr_store("recompress", &format!("type=idle priority={prio}"))
                    .unwrap();
            }
        }));
    }
    if let Some(nb) = neighbour {
        threads.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(seed ^ 0x5a);
            let mut buf = vec![0u8; cfg.page_size];
            for v in 1.. {
                let i = rng.gen_range(0..cfg.pages);
                fill(i, v, &mut buf);
                write_retrying(&nb, &buf, i * cfg.page_size as u64);
                if v % 16 == 0 {
                    nb.discard(i * cfg.page_size as u64, cfg.page_size as u64)
                        .unwrap();
                }
            }
        }));
    }
    {
        let dev = Arc::clone(&dev);
        let stop = Arc::clone(&stop);
        threads.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(seed ^ 0xc0);
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_micros(rng.gen_range(200..3000)));
                dev.compact();
            }
        }));
    }
    // Run until killed (the parent kills within seconds; this bounds a lost parent).
    std::thread::sleep(Duration::from_secs(60));
    stop.store(true, Ordering::Relaxed);
    std::process::exit(3);
}

/// One writer: random operations on the groups it owns (group `g` is thread `g % threads`'s),
/// each logged before it starts and when it returns.
fn writer(dev: &Device, cfg: &Config, t: u64, seed: u64, log: &[[AtomicU64; 2]]) {
    let mut rng = SmallRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(t));
    let page = cfg.page_size;
    let groups = cfg.pages / cfg.group_pages;
    let mine: Vec<u64> = (0..groups).filter(|g| g % cfg.threads == t).collect();
    let mut buf = vec![0u8; cfg.group_pages as usize * page];
    for (n, entry) in log.iter().enumerate() {
        let version = n as u64 + 1;
        let g = mine[rng.gen_range(0..mine.len())];
        let first = g * cfg.group_pages;
        let (kind, target) = match rng.gen_range(0..10) {
            0..=5 => (OP_WRITE, first + rng.gen_range(0..cfg.group_pages)),
            6 => (OP_DISCARD, first + rng.gen_range(0..cfg.group_pages)),
            _ => (OP_GROUP, g),
        };
        entry[0].store(op_word(kind, target, version), Ordering::Relaxed);
        entry[1].store(BEGUN, Ordering::Release);
        // Nothing of the operation may be stored before the log says it began.
        std::sync::atomic::fence(Ordering::SeqCst);
        match kind {
            OP_WRITE => {
                fill(target, version, &mut buf[..page]);
                write_retrying(dev, &buf[..page], target * page as u64);
            }
            OP_DISCARD => dev.discard(target * page as u64, page as u64).unwrap(),
            _ => {
                for k in 0..cfg.group_pages {
                    let at = k as usize * page;
                    fill(first + k, version, &mut buf[at..at + page]);
                }
                write_retrying(dev, &buf, first * page as u64);
            }
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        entry[1].store(ACKED, Ordering::Release);
    }
}

/// Writes `buf` at `offset`, again while the swap reserve has no frame for it (`ENOMEM`, as a
/// swap-out the kernel retries later: nothing was stored).
fn write_retrying(dev: &Device, buf: &[u8], offset: u64) {
    loop {
        match dev.write_at(buf, offset) {
            Ok(_) => return,
            Err(e) if e.errno() == libc::ENOMEM => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => panic!("write at {offset}: {e}"),
        }
    }
}

fn log_bytes(cfg: &Config) -> usize {
    (cfg.threads as usize * LOG_ENTRIES + SETTINGS_ENTRIES) * 16
}

/// The log's pairs of words: every pair `map` covers (`log_bytes`: the writers' `LOG_ENTRIES`
/// each, then the settings thread's `SETTINGS_ENTRIES`).
fn log_entries(map: &ShmMap) -> &[[AtomicU64; 2]] {
    // SAFETY: the mapping is page aligned, `len_bytes` long and lives as long as the borrow;
    // shared memory of atomics, any bit pattern of which is a valid `AtomicU64`.
    unsafe {
        std::slice::from_raw_parts(
            map.base().as_ptr().cast::<[AtomicU64; 2]>(),
            map.len_bytes() / 16,
        )
    }
}

/// The settings thread: random changes of the limits and the policy texts, each logged before
/// it starts and when it returns, as the writers' operations are.
fn settings(dev: &Device, seed: u64, log: &[[AtomicU64; 2]]) {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x5e7);
    for (n, entry) in log.iter().enumerate() {
        std::thread::sleep(Duration::from_micros(rng.gen_range(0..300)));
        let version = n as u64 + 1;
        let kind = SETTINGS[rng.gen_range(0..SETTINGS.len())];
        entry[0].store(op_word(kind, 0, version), Ordering::Relaxed);
        entry[1].store(BEGUN, Ordering::Release);
        std::sync::atomic::fence(Ordering::SeqCst);
        set_setting(dev, kind, &setting_value(kind, version));
        std::sync::atomic::fence(Ordering::SeqCst);
        entry[1].store(ACKED, Ordering::Release);
    }
}

/// Checks the settings `dev` recovered against the settings thread's log `entries`: each is
/// the value of its last acknowledged change (`defaults`' before any), or of the change in
/// flight at the kill, never another (an older one, a torn one). Returns how many of them
/// came back changed and whether a change was in flight.
fn check_settings(
    dev: &Device,
    entries: &[[AtomicU64; 2]],
    defaults: &[Option<String>; 4],
) -> Result<(u64, bool), String> {
    let mut acked = defaults.clone();
    let mut in_flight = None;
    for e in entries {
        let state = e[1].load(Ordering::Acquire);
        if state == 0 {
            break;
        }
        let w = e[0].load(Ordering::Relaxed);
        let (kind, version) = (w >> 56, w & 0xffff_ffff);
        let i = SETTINGS.iter().position(|&k| k == kind).unwrap();
        if state == ACKED {
            acked[i] = Some(setting_value(kind, version));
        } else {
            in_flight = Some((i, setting_value(kind, version)));
        }
    }
    let mut changed = 0;
    for (i, &kind) in SETTINGS.iter().enumerate() {
        let got = shown_setting(dev, kind);
        let flying = in_flight.as_ref().filter(|f| f.0 == i).map(|f| &f.1);
        if got != acked[i] && got.as_ref() != flying {
            let short = |v: Option<&String>| {
                v.map_or("none".to_string(), |v| {
                    v.replace('\n', " ").chars().take(40).collect()
                })
            };
            let name = ["mem_limit", "writeback_limit", "policy", "policy state"][i];
            return Err(format!(
                "{name}: recovered {}, neither the last acknowledged {} nor the one in \
                 flight {}",
                short(got.as_ref()),
                short(acked[i].as_ref()),
                short(flying)
            ));
        }
        changed += u64::from(got != defaults[i]);
    }
    Ok((changed, in_flight.is_some()))
}

/// Sends the device's files to the parent (one message, `uzram::scm`).
fn send_fds(sock: &OwnedFd, fds: &[OwnedFd; DEVICE_FILES]) {
    let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
    scm::send(sock.as_fd(), None, b"files", &borrowed).unwrap();
}

/// Receives what [`send_fds`] sent; `None` if the socket closed first.
fn recv_fds(sock: &OwnedFd) -> Option<[OwnedFd; DEVICE_FILES]> {
    let mut buf = [0u8; 16];
    match scm::recv(sock.as_fd(), &mut buf) {
        Ok((0, _)) | Err(_) => None,
        Ok((_, fds)) => Some(fds.try_into().expect("a device's files")),
    }
}

/// What one crash point found.
struct Point {
    mismatches: Result<(), String>,
    ops_acked: u64,
    /// Pages the recovered device had on the backing device (`bd_count`).
    written_back: u64,
    /// Slots recovery repointed to finish a group's half-done publish or writeback.
    repointed: u64,
    /// Pages the recovered device held recompressed (a secondary codec's).
    recompressed: u64,
    /// Dictionary generations trained by `train_dict` the recovered device held (the current
    /// one among them even without pages), and pages naming them.
    trained: (u64, u64),
    /// Settings (limits, policy texts) the recovered device held changed, and whether a
    /// change was in flight at the kill.
    settings: (u64, bool),
}

/// One crash point: a child runs `cfg` with `seed` and is killed after `run`; the parent
/// recovers and checks.
fn crash_point(cfg: &Config, seed: u64, run: Duration, canary: bool) -> Point {
    let dir = real_tmpdir();
    let backing_path = cfg.writeback.then(|| dir.path().join("backing"));
    let (ours, theirs) = scm::seqpacket_pair().unwrap();
    let log = ShmFile::create("crash-log").unwrap();
    log.set_len(log_bytes(cfg) as u64).unwrap();
    let (their_sock, their_log) = (theirs.as_raw_fd(), log.as_fd().as_raw_fd());
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "crash_model_child",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(
        CHILD_ENV,
        format!(
            "{},{seed},{},{}",
            cfg.name,
            if canary { "canary" } else { "-" },
            backing_path
                .as_ref()
                .map_or(String::new(), |p| p.display().to_string())
        ),
    )
    .stdout(std::process::Stdio::null());
    // SAFETY: dup2 is async-signal-safe; it puts the socket and the log at the numbers the
    // child expects (without CLOEXEC).
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(their_sock, CHILD_SOCK_FD) < 0 || libc::dup2(their_log, CHILD_LOG_FD) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    drop(theirs);
    let fds = recv_fds(&ours);
    let started = Instant::now();
    let Some(fds) = fds else {
        let status = child.wait().unwrap();
        panic!(
            "{} seed {seed}: the child sent no state ({status})",
            cfg.name
        );
    };
    let left = run.saturating_sub(started.elapsed());
    std::thread::sleep(left);
    child.kill().unwrap();
    child.wait().unwrap();
    // The log, as the child left it.
    let map = log.map(0, log_bytes(cfg)).unwrap();
    let entries = log_entries(&map);
    let (entries, settings_log) = entries.split_at(cfg.threads as usize * LOG_ENTRIES);
    let settings_log = &settings_log[..SETTINGS_ENTRIES];
    let mut want = vec![0u64; cfg.pages as usize];
    let mut in_flight = Vec::new();
    let mut ops_acked = 0;
    for e in entries {
        let state = e[1].load(Ordering::Acquire);
        if state == 0 {
            continue;
        }
        let w = e[0].load(Ordering::Relaxed);
        let (kind, target, version) = (w >> 56, (w >> 32) & 0xff_ffff, w & 0xffff_ffff);
        let pages: Vec<u64> = match kind {
            OP_GROUP => (target * cfg.group_pages..(target + 1) * cfg.group_pages).collect(),
            _ => vec![target],
        };
        let v = if kind == OP_DISCARD { 0 } else { version };
        for p in pages {
            if state == ACKED {
                want[p as usize] = v;
            } else {
                in_flight.push((p, v));
            }
        }
        ops_acked += u64::from(state == ACKED);
    }
    let files = DeviceFiles::from_fds(fds);
    let recovered = if cfg.swap {
        let dup = |f: &ShmFile| ShmFile::from_fd(f.try_clone_fd().unwrap());
        let (frames, records) = (
            dup(&files.store.pool.frames),
            dup(&files.store.pool.records),
        );
        SwapReserve::recover(SWAP_RESERVE_BYTES, frames, records).and_then(|reserve| {
            let dev = Device::recover_swap(files, &reserve)?;
            // The neighbour's frames go back to the reserve.
            reserve.finish_recovery()?;
            Ok(dev)
        })
    } else if let Some(path) = &backing_path {
        let backing = FileBacking::open(path, &FileOptions::default()).unwrap();
        Device::recover_with(
            files,
            Recover {
                backing: Some(Arc::new(backing)),
                ..Recover::default()
            },
        )
    } else {
        Device::recover(files)
    };
    let mut written_back = 0;
    let mut repointed = 0;
    let mut recompressed = 0;
    let mut trained = (0, 0);
    let mut settings = (0, false);
    // What a device shows of each setting before any change.
    let fresh = DeviceBuilder::pages(1).page_size(cfg.page_size).build();
    let defaults = SETTINGS.map(|k| shown_setting(&fresh, k));
    let mismatches = match recovered {
        Err(e) => Err(format!("recovery refused: {e}")),
        Ok((dev, report)) => check_pages(&dev, cfg.page_size, &want, &in_flight)
            .and_then(|()| {
                settings = check_settings(&dev, settings_log, &defaults)?;
                Ok(())
            })
            .map(|()| {
                repointed = report.group_repointed;
                written_back = bd(&dev)[0];
                recompressed = (0..cfg.pages)
                    .filter(|&i| dev.debug_slot_priority(i).unwrap_or(0) > 0)
                    .count() as u64;
                if let Some(g) = dev.dict_generations(1) {
                    let held = g.held.iter().filter(|h| h.2 > 0);
                    trained = (held.clone().count() as u64, held.map(|h| h.1).sum());
                }
                // The recovered allocator takes writes again.
                exercise(&dev, cfg.page_size, cfg.pages.min(64));
            }),
    };
    Point {
        mismatches,
        ops_acked,
        written_back,
        repointed,
        recompressed,
        trained,
        settings,
    }
}

/// Crash points per configuration (`UZRAM_CRASH_POINTS` overrides): 3 configurations of 170,
/// over 500 per run.
fn points() -> u64 {
    std::env::var("UZRAM_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(170)
}

fn crash_model(cfg: &Config) {
    let base: u64 = std::env::var("UZRAM_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| rand::random::<u32>().into());
    let mut acked = 0;
    let mut with_wb = 0;
    let mut with_recomp = 0;
    let (mut with_trained, mut with_trained_pages) = (0, 0);
    let mut repointed = 0;
    let (mut with_settings, mut settings_in_flight) = (0, 0);
    let mut runs = SmallRng::seed_from_u64(base);
    for n in 0..points() {
        let seed = base + n;
        // Mostly early (the first operations, fresh zspages), some later; recompressing, one
        // in eight late enough for a dictionary trained beside the writers (tens of
        // milliseconds on a loaded machine) to be used by a recompression.
        let micros = match n % 8 {
            4 if cfg.recompress => 60_000..300_000,
            0 | 4 => 200..60_000,
            _ => 200..8_000,
        };
        let run = Duration::from_micros(runs.gen_range(micros));
        let p = crash_point(cfg, seed, run, false);
        if let Err(e) = p.mismatches {
            panic!(
                "{}: crash point {n} (UZRAM_CRASH_SEED={seed} UZRAM_CRASH_POINTS=1, killed \
                 after {run:?}): {e}",
                cfg.name
            );
        }
        acked += p.ops_acked;
        with_wb += u64::from(p.written_back > 0);
        with_recomp += u64::from(p.recompressed > 0);
        with_trained += u64::from(p.trained.0 > 0);
        with_trained_pages += u64::from(p.trained.1 > 0);
        repointed += p.repointed;
        with_settings += u64::from(p.settings.0 > 0);
        settings_in_flight += u64::from(p.settings.1);
    }
    eprintln!(
        "{}: {} crash points, 0 mismatches, {acked} operations acknowledged, {with_wb} \
         recovered with written-back pages, {with_recomp} with recompressed pages, \
         {with_trained} with a trained dictionary ({with_trained_pages} with pages using one), \
         {repointed} slots of half-done group operations repointed, {with_settings} with \
         limits or policy texts changed ({settings_in_flight} killed while changing one) \
         (seeds from {base})",
        cfg.name,
        points()
    );
    assert!(acked > 0, "no operation ever completed before a kill");
    assert!(
        with_settings > 0,
        "no crash point recovered a limit or a policy text changed"
    );
    assert!(
        !cfg.writeback || with_wb > 0,
        "no crash point recovered a page written back"
    );
    assert!(
        !cfg.recompress || with_recomp > 0,
        "no crash point recovered a recompressed page"
    );
    // Pages using a trained dictionary are fewer: the writers overwrite every page within
    // milliseconds, and 64 KiB groups seldom shrink by another size class with one.
    assert!(
        !cfg.recompress || with_trained > 0,
        "no crash point recovered a trained dictionary"
    );
}

#[test]
fn crash_model_4k() {
    crash_model(&CONFIGS[0]);
}

#[test]
fn crash_model_4k_multi_page() {
    crash_model(&CONFIGS[1]);
}

#[test]
fn crash_model_16k() {
    crash_model(&CONFIGS[2]);
}

#[test]
fn crash_model_4k_swap() {
    crash_model(&CONFIGS[3]);
}

#[test]
fn crash_model_4k_multi_page_writeback() {
    crash_model(&CONFIGS[4]);
}

#[test]
fn crash_model_4k_multi_page_zoned_writeback() {
    crash_model(&CONFIGS[5]);
}

/// The harness can fail: with slots published before their objects' bytes are copied, some
/// crash point finds a page that is neither its old nor its new contents.
#[test]
fn crash_model_canary() {
    let cfg = &CONFIGS[0];
    let base: u64 = rand::random::<u32>().into();
    for n in 0..60 {
        let p = crash_point(cfg, base + n, Duration::from_millis(5 + n % 20), true);
        if let Err(e) = p.mismatches {
            eprintln!("canary caught at crash point {n}: {e}");
            return;
        }
    }
    panic!("60 crash points with slots published before their bytes found nothing");
}
