//! The backing layer, end to end: the same helpers run over every engine (file with io_uring,
//! file with sync, file buffered, tmpfs, memory, faulty without faults), then the fault
//! engine's faults one by one, on synchronous and queued writes.
//!
//! Data is position-dependent (every 8-byte word is a hash of its byte offset and a salt), so
//! a block written to the wrong place, or read from the wrong place, is caught.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use uzram::backing::ceiling::{self, Pattern};
use uzram::backing::{
    AlignedBuf, Backing, DirectIo, Engine, FaultKind, FaultPlan, FaultyBacking, FileBacking,
    FileOptions, IoCompletion, IoOp, IoQueue, MemBacking, BLOCK_SIZE_BYTES, MAX_OP_BUFS,
};
use uzram::ErrorKind;

const BLOCK: usize = BLOCK_SIZE_BYTES;
const DEVICE_BLOCKS: u64 = 512;
const DEVICE_BYTES: u64 = DEVICE_BLOCKS * BLOCK as u64;

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The bytes that belong at `[offset, offset + len)` for `salt`.
fn expected(offset: u64, len: usize, salt: u64) -> Vec<u8> {
    assert_eq!(offset % 8, 0);
    (0..len as u64 / 8)
        .flat_map(|w| mix((offset / 8 + w) ^ salt.rotate_left(32)).to_le_bytes())
        .collect()
}

fn pattern_buf(offset: u64, len: usize, salt: u64) -> AlignedBuf {
    AlignedBuf::from_slice(&expected(offset, len, salt)).unwrap()
}

/// Reads `[offset, offset + len)` into deliberately misaligned memory (one byte into a Vec),
/// which makes the direct-I/O file engine bounce it.
fn read_back(b: &dyn Backing, offset: u64, len: usize) -> Vec<u8> {
    let mut raw = vec![0u8; len + 1];
    b.read_at(&mut raw[1..], offset).unwrap();
    raw.remove(0);
    raw
}

struct Case {
    name: String,
    backing: Box<dyn Backing>,
    _dir: Option<tempfile::TempDir>,
}

/// A directory on the file system the tests are built on (a real one, unlike /tmp on some
/// machines), so O_DIRECT is exercised where the file system supports it.
fn real_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// A file `name` of DEVICE_BYTES in `dir`, through io_uring.
fn uring_file(dir: &tempfile::TempDir, name: &str) -> FileBacking {
    FileBacking::create(
        dir.path().join(name),
        DEVICE_BYTES,
        &FileOptions::with_engine(Engine::Uring),
    )
    .unwrap()
}

fn file_case(name: &str, dir: tempfile::TempDir, options: FileOptions) -> Case {
    let path = dir.path().join("backing.img");
    let file = FileBacking::create(&path, DEVICE_BYTES, &options).unwrap();
    assert_eq!(file.size_bytes(), DEVICE_BYTES);
    assert_eq!(file.describe(), path.display().to_string());
    Case {
        name: format!(
            "{name} [{}, align {}]",
            file.io_mode(),
            file.dio_align_bytes()
        ),
        backing: Box::new(file),
        _dir: Some(dir),
    }
}

/// Every engine, each on a fresh zeroed device of DEVICE_BYTES.
fn cases() -> Vec<Case> {
    let mut cases = vec![
        file_case(
            "file+uring",
            real_dir(),
            FileOptions::with_engine(Engine::Uring),
        ),
        file_case(
            "file+sync",
            real_dir(),
            FileOptions::with_engine(Engine::Sync),
        ),
        file_case(
            "file+uring buffered",
            real_dir(),
            FileOptions {
                engine: Engine::Uring,
                direct_io: DirectIo::Off,
            },
        ),
        Case {
            name: "mem".into(),
            backing: Box::new(MemBacking::new(DEVICE_BYTES).unwrap()),
            _dir: None,
        },
        Case {
            name: "faulty(mem), no faults".into(),
            backing: Box::new(FaultyBacking::new(MemBacking::new(DEVICE_BYTES).unwrap())),
            _dir: None,
        },
    ];
    let dir = real_dir();
    let inner = uring_file(&dir, "faulty.img");
    cases.push(Case {
        name: "faulty(file+uring), no faults".into(),
        backing: Box::new(FaultyBacking::new(inner)),
        _dir: Some(dir),
    });
    // tmpfs: O_DIRECT was refused before Linux 6.6; either way the engine must work.
    if Path::new("/dev/shm").is_dir() {
        if let Ok(dir) = tempfile::tempdir_in("/dev/shm") {
            cases.push(file_case(
                "tmpfs file+uring",
                dir,
                FileOptions::with_engine(Engine::Uring),
            ));
        }
    }
    for c in &cases {
        eprintln!("engine: {}", c.name);
    }
    cases
}

/// Writes `ops` (offset, blocks) through a queue of `depth`, keeping it as full as it allows,
/// and checks each completion comes back with its own buffers and tag.
fn write_through_queue(q: &mut dyn IoQueue, ops: &[(u64, usize)], salt: u64, name: &str) {
    let depth = q.depth();
    let mut next = 0;
    let mut reaped = 0;
    let check = |c: IoCompletion| {
        let (offset, blocks) = ops[c.op.tag as usize];
        c.result
            .unwrap_or_else(|e| panic!("{name}: op {} failed: {e}", c.op.tag));
        assert_eq!(c.op.offset, offset, "{name}");
        assert_eq!(c.op.bufs.len(), blocks, "{name}");
        for (i, buf) in c.op.bufs.iter().enumerate() {
            let at = offset + (i * BLOCK) as u64;
            assert!(
                buf[..] == expected(at, BLOCK, salt)[..],
                "{name}: buffer changed"
            );
        }
    };
    while reaped < ops.len() {
        while next < ops.len() && q.in_flight() < depth {
            let (offset, blocks) = ops[next];
            let bufs = (0..blocks)
                .map(|i| pattern_buf(offset + (i * BLOCK) as u64, BLOCK, salt))
                .collect();
            q.submit(IoOp::new(offset, bufs, next as u64))
                .unwrap_or_else(|(e, _)| panic!("{name}: submit {next}: {e}"));
            next += 1;
        }
        assert!(q.in_flight() <= depth, "{name}");
        let done = q.wait(1).unwrap();
        assert!(!done.is_empty(), "{name}: wait(1) returned nothing");
        for c in done {
            check(c);
            reaped += 1;
        }
    }
    assert_eq!(q.in_flight(), 0, "{name}");
    assert!(q.wait(usize::MAX).unwrap().is_empty(), "{name}");
}

/// A scattered set of ops: single blocks and runs of 2..=4 adjacent blocks (vectored), over
/// distinct blocks in a shuffled order, covering `count` blocks.
fn scattered_ops(count: u64, seed: u64) -> Vec<(u64, usize)> {
    let mut ops = Vec::new();
    let mut block = 0;
    while block < count {
        let run = (1 + mix(seed ^ block) % 4).min(count - block);
        ops.push((block * BLOCK as u64, run as usize));
        block += run;
    }
    // Shuffle (Fisher-Yates with the hash) so completions land out of offset order.
    for i in (1..ops.len()).rev() {
        let j = (mix(seed.wrapping_add(i as u64)) % (i as u64 + 1)) as usize;
        ops.swap(i, j);
    }
    ops
}

#[test]
fn queued_writes_read_back_at_depths_1_8_32() {
    for case in cases() {
        let b = case.backing.as_ref();
        for (round, depth) in [1usize, 8, 32].into_iter().enumerate() {
            let salt = 1000 + round as u64;
            let ops = scattered_ops(DEVICE_BLOCKS, salt);
            let mut q = b.new_queue(depth).unwrap();
            assert_eq!(q.depth(), depth);
            write_through_queue(q.as_mut(), &ops, salt, &case.name);
            drop(q);
            for block in 0..DEVICE_BLOCKS {
                let at = block * BLOCK as u64;
                assert!(
                    read_back(b, at, BLOCK) == expected(at, BLOCK, salt),
                    "{}: depth {depth}: block {block} reads back wrong",
                    case.name
                );
            }
        }
        b.flush().unwrap();
    }
}

#[test]
fn synchronous_writes_vectored_and_unaligned_read_back() {
    for case in cases() {
        let b = case.backing.as_ref();
        let salt = 7;
        // write_at: one block, a 512-byte sector at an odd sector offset, a multi-block run.
        let one = expected(0, BLOCK, salt);
        b.write_at(&one, 0).unwrap();
        let sector_at = 3 * BLOCK as u64 + 512 * 3;
        b.write_at(&expected(sector_at, 512, salt), sector_at)
            .unwrap();
        // writev_at: adjacent blocks from separate (unaligned Vec) buffers.
        let v: Vec<Vec<u8>> = (0..3)
            .map(|i| expected(8 * BLOCK as u64 + (i * BLOCK) as u64, BLOCK, salt))
            .collect();
        let slices: Vec<&[u8]> = v.iter().map(|x| &x[..]).collect();
        b.writev_at(&slices, 8 * BLOCK as u64).unwrap();

        assert!(read_back(b, 0, BLOCK) == one, "{}", case.name);
        assert!(
            read_back(b, sector_at, 512) == expected(sector_at, 512, salt),
            "{}",
            case.name
        );
        // The sectors around the single sector are still zero.
        let around = read_back(b, 3 * BLOCK as u64, BLOCK);
        assert!(around[..1536].iter().all(|&x| x == 0), "{}", case.name);
        assert!(around[2048..].iter().all(|&x| x == 0), "{}", case.name);
        let run = read_back(b, 8 * BLOCK as u64, 3 * BLOCK);
        assert!(
            run == expected(8 * BLOCK as u64, 3 * BLOCK, salt),
            "{}: vectored write",
            case.name
        );
        // An aligned read into aligned memory (the direct path without a bounce).
        let mut aligned = AlignedBuf::new_zeroed(3 * BLOCK).unwrap();
        b.read_at(&mut aligned, 8 * BLOCK as u64).unwrap();
        assert!(aligned[..] == run[..], "{}", case.name);
    }
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    for case in cases() {
        let b = case.backing.as_ref();
        let mut buf = vec![0u8; BLOCK];
        for (offset, len) in [
            (DEVICE_BYTES, BLOCK),       // past the end
            (DEVICE_BYTES - 512, BLOCK), // straddling the end
            (100, BLOCK),                // unaligned offset
            (0, 100),                    // unaligned length
            (0, 0),                      // empty
            (u64::MAX - 511, 512),       // overflow
        ] {
            let e = b.read_at(&mut buf[..len], offset).unwrap_err();
            assert_eq!(
                e.kind(),
                ErrorKind::InvalidArgument,
                "{}: read {offset}+{len}",
                case.name
            );
            let e = b.write_at(&vec![0xAB; len], offset).unwrap_err();
            assert_eq!(
                e.kind(),
                ErrorKind::InvalidArgument,
                "{}: write {offset}+{len}",
                case.name
            );
        }
        assert!(read_back(b, DEVICE_BYTES - BLOCK as u64, BLOCK)
            .iter()
            .all(|&x| x == 0));
        assert_eq!(
            b.new_queue(0).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}

#[test]
fn failed_submit_hands_the_op_back() {
    for case in cases() {
        let b = case.backing.as_ref();
        let mut q = b.new_queue(2).unwrap();
        let op =
            |offset: u64, tag: u64| IoOp::new(offset, vec![pattern_buf(offset, BLOCK, 9)], tag);

        // Out of range: InvalidArgument, the op intact.
        let bad = op(DEVICE_BYTES, 77);
        let (e, back) = q.submit(bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{}", case.name);
        assert_eq!(back, op(DEVICE_BYTES, 77), "{}", case.name);
        // No buffers, and too many buffers.
        let (e, back) = q.submit(IoOp::new(0, Vec::new(), 5)).unwrap_err();
        assert_eq!((e.kind(), back.tag), (ErrorKind::InvalidArgument, 5));
        let many: Vec<AlignedBuf> = (0..=MAX_OP_BUFS)
            .map(|_| AlignedBuf::new_zeroed(512).unwrap())
            .collect();
        let (e, back) = q.submit(IoOp::new(0, many, 6)).unwrap_err();
        assert_eq!(
            (e.kind(), back.bufs.len()),
            (ErrorKind::InvalidArgument, MAX_OP_BUFS + 1)
        );
        assert_eq!(q.in_flight(), 0, "{}", case.name);

        // Full: Busy, the op intact, nothing written for it.
        q.submit(op(0, 1)).unwrap();
        q.submit(op(BLOCK as u64, 2)).unwrap();
        let (e, back) = q.submit(op(2 * BLOCK as u64, 3)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Busy, "{}", case.name);
        assert_eq!(back, op(2 * BLOCK as u64, 3), "{}", case.name);
        let mut tags: Vec<u64> = q
            .wait(usize::MAX)
            .unwrap()
            .into_iter()
            .map(|c| {
                c.result.unwrap();
                c.op.tag
            })
            .collect();
        tags.sort();
        assert_eq!(tags, [1, 2], "{}", case.name);
        // The refused op can be resubmitted as it came back.
        q.submit(back).unwrap();
        assert_eq!(q.wait(1).unwrap().len(), 1);
        drop(q);
        assert!(read_back(b, 2 * BLOCK as u64, BLOCK) == expected(2 * BLOCK as u64, BLOCK, 9));
    }
}

#[test]
fn dropping_a_queue_with_writes_in_flight_is_safe() {
    for case in cases() {
        let b = case.backing.as_ref();
        let salt = 31;
        {
            let mut q = b.new_queue(32).unwrap();
            for i in 0..32u64 {
                // Two-block vectored ops, so more bytes are in flight at the drop.
                let at = i * 2 * BLOCK as u64;
                let bufs = vec![
                    pattern_buf(at, BLOCK, salt),
                    pattern_buf(at + BLOCK as u64, BLOCK, salt),
                ];
                q.submit(IoOp::new(at, bufs, i)).unwrap();
            }
            // Dropped here without a wait: the drop must wait for the kernel before freeing.
        }
        let all = read_back(b, 0, 64 * BLOCK);
        assert!(
            all == expected(0, 64 * BLOCK, salt),
            "{}: data lost at drop",
            case.name
        );
    }
}

#[test]
fn concurrent_reads_from_many_threads() {
    for case in cases() {
        let b: Arc<dyn Backing> = Arc::from(case.backing);
        let salt = 55;
        let mut q = b.new_queue(16).unwrap();
        write_through_queue(
            q.as_mut(),
            &scattered_ops(DEVICE_BLOCKS, salt),
            salt,
            &case.name,
        );
        drop(q);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let b = Arc::clone(&b);
                s.spawn(move || {
                    for k in 0..200u64 {
                        let block = mix(t * 1000 + k) % DEVICE_BLOCKS;
                        let at = block * BLOCK as u64;
                        assert!(read_back(b.as_ref(), at, BLOCK) == expected(at, BLOCK, salt));
                    }
                });
            }
        });
    }
}

#[test]
fn file_backing_options_and_errors() {
    let dir = real_dir();
    let path = dir.path().join("img");
    // Buffered on request, with the reason in io_mode; describe() stays the path.
    let f = FileBacking::create(
        &path,
        10 * BLOCK as u64 + 100,
        &FileOptions {
            engine: Engine::Sync,
            direct_io: DirectIo::Off,
        },
    )
    .unwrap();
    assert!(!f.is_direct());
    assert!(f.io_mode().starts_with("buffered"), "{}", f.io_mode());
    assert_eq!(
        f.size_bytes(),
        10 * BLOCK as u64,
        "rounded down to whole blocks"
    );
    assert_eq!(f.describe(), path.display().to_string());
    assert_eq!(f.engine(), Engine::Sync);
    assert!(!f.is_block_device());
    // Required direct I/O either opens direct or says it is unsupported.
    match FileBacking::open(
        &path,
        &FileOptions {
            engine: Engine::Uring,
            direct_io: DirectIo::Required,
        },
    ) {
        Ok(f) => assert!(f.is_direct() && f.dio_align_bytes().is_power_of_two()),
        Err(e) => assert_eq!(e.kind(), ErrorKind::Unsupported),
    }
    // Missing file, a directory, an empty file.
    let e = FileBacking::open(dir.path().join("nope"), &FileOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    let e = FileBacking::open(dir.path(), &FileOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    std::fs::write(dir.path().join("empty"), b"").unwrap();
    let e = FileBacking::open(dir.path().join("empty"), &FileOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    // Both engines on one file.
    let f = FileBacking::open(&path, &FileOptions::default()).unwrap();
    for engine in [Engine::Uring, Engine::Sync] {
        let mut q = f.new_queue_with(engine, 4).unwrap();
        write_through_queue(q.as_mut(), &scattered_ops(10, 3), 3, engine.name());
    }
    assert!(read_back(&f, 0, 10 * BLOCK) == expected(0, 10 * BLOCK, 3));
}

// ---- faults ----------------------------------------------------------------------------

/// Faulty backings over memory and over a file with the io_uring engine (so injected faults
/// are checked on the kernel-backed queue too).
/// A named faulty backing and the directory its file lives in.
type FaultyCase = (
    String,
    Box<FaultyBacking<Box<dyn Backing>>>,
    Option<tempfile::TempDir>,
);

fn faulty_cases() -> Vec<FaultyCase> {
    let dir = real_dir();
    let file = uring_file(&dir, "f.img");
    vec![
        (
            "faulty(mem)".into(),
            Box::new(FaultyBacking::new(
                Box::new(MemBacking::new(DEVICE_BYTES).unwrap()) as Box<dyn Backing>,
            )),
            None,
        ),
        (
            "faulty(file+uring)".into(),
            Box::new(FaultyBacking::new(Box::new(file) as Box<dyn Backing>)),
            Some(dir),
        ),
    ]
}

/// Submits one single-block op per offset in order (depth 8) and returns results by tag.
fn queue_blocks(
    b: &dyn Backing,
    blocks: &[u64],
    salt: u64,
) -> HashMap<u64, Result<(), uzram::Error>> {
    let mut q = b.new_queue(8).unwrap();
    let mut results = HashMap::new();
    for (i, &block) in blocks.iter().enumerate() {
        if q.in_flight() == q.depth() {
            for c in q.wait(1).unwrap() {
                results.insert(c.op.tag, c.result);
            }
        }
        let at = block * BLOCK as u64;
        q.submit(IoOp::new(at, vec![pattern_buf(at, BLOCK, salt)], i as u64))
            .unwrap();
    }
    for c in q.wait(usize::MAX).unwrap() {
        results.insert(c.op.tag, c.result);
    }
    assert_eq!(results.len(), blocks.len());
    results
}

#[test]
fn eio_on_the_nth_write_fails_exactly_that_write() {
    for (name, b, _dir) in faulty_cases() {
        let salt = 41;
        // Queued: the 5th of 12 writes fails, nothing else.
        b.set_plan(FaultPlan::new().fail_write(5, FaultKind::Eio));
        let blocks: Vec<u64> = (0..12).collect();
        let results = queue_blocks(b.as_ref(), &blocks, salt);
        for (tag, r) in &results {
            if *tag == 4 {
                assert_eq!(r.as_ref().unwrap_err().kind(), ErrorKind::Io, "{name}");
                assert_eq!(r.as_ref().unwrap_err().errno(), libc::EIO);
            } else {
                assert!(r.is_ok(), "{name}: write {tag}: {r:?}");
            }
        }
        for block in 0..12u64 {
            let at = block * BLOCK as u64;
            let data = read_back(b.as_ref(), at, BLOCK);
            if block == 4 {
                assert!(
                    data.iter().all(|&x| x == 0),
                    "{name}: the failed write wrote"
                );
            } else {
                assert!(data == expected(at, BLOCK, salt), "{name}: block {block}");
            }
        }
        // Synchronous: the 2nd write after a new plan fails.
        b.set_plan(FaultPlan::new().fail_write(2, FaultKind::Eio));
        let at = 20 * BLOCK as u64;
        b.write_at(&expected(at, BLOCK, salt), at).unwrap();
        let e = b.write_at(&expected(at, BLOCK, 0), at).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io);
        b.write_at(&expected(at, BLOCK, 1), at).unwrap();
        assert!(read_back(b.as_ref(), at, BLOCK) == expected(at, BLOCK, 1));
        // Reads: the 2nd read fails, the 1st and 3rd succeed.
        b.set_plan(FaultPlan::new().fail_read(2));
        let mut buf = vec![0u8; BLOCK];
        b.read_at(&mut buf, at).unwrap();
        assert_eq!(b.read_at(&mut buf, at).unwrap_err().kind(), ErrorKind::Io);
        b.read_at(&mut buf, at).unwrap();
        let counts = b.counts();
        assert_eq!(counts.injected, 3, "{name}: {counts:?}");
        assert!(
            counts.writes >= 15 && counts.reads >= 3,
            "{name}: {counts:?}"
        );
    }
}

#[test]
fn no_space_surfaces_as_enospc() {
    for (name, b, _dir) in faulty_cases() {
        let salt = 43;
        // After 3 blocks' worth of bytes, every further write fails with ENOSPC.
        b.set_plan(FaultPlan::new().no_space_after_bytes(3 * BLOCK as u64));
        let results = queue_blocks(b.as_ref(), &[0, 1, 2, 3, 4], salt);
        for tag in 0..5u64 {
            match &results[&tag] {
                Ok(()) => assert!(tag < 3, "{name}: write {tag} should be out of space"),
                Err(e) => {
                    assert!(tag >= 3, "{name}: write {tag}: {e}");
                    assert_eq!(e.kind(), ErrorKind::NoSpace);
                    assert_eq!(e.errno(), libc::ENOSPC);
                }
            }
        }
        assert!(read_back(b.as_ref(), 3 * BLOCK as u64, 2 * BLOCK)
            .iter()
            .all(|&x| x == 0));
        // Beyond an offset: writes ending past it fail, writes before it succeed.
        b.set_plan(FaultPlan::new().no_space_beyond_offset(100 * BLOCK as u64));
        b.write_at(&expected(99 * BLOCK as u64, BLOCK, salt), 99 * BLOCK as u64)
            .unwrap();
        let e = b
            .write_at(
                &expected(99 * BLOCK as u64, 2 * BLOCK, salt),
                99 * BLOCK as u64,
            )
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace, "{name}");
        let r = queue_blocks(b.as_ref(), &[100], salt);
        assert_eq!(
            r[&0].as_ref().unwrap_err().kind(),
            ErrorKind::NoSpace,
            "{name}"
        );
    }
}

#[test]
fn short_and_torn_writes_are_errors_with_partial_data() {
    for (name, b, _dir) in faulty_cases() {
        let old = 47;
        let new = 48;
        let len = 2 * BLOCK;
        for (kind, at_block) in [(FaultKind::Short, 10u64), (FaultKind::Torn, 20)] {
            let at = at_block * BLOCK as u64;
            b.clear_plan();
            b.write_at(&expected(at, len, old), at).unwrap();
            for queued in [false, true] {
                b.set_plan(FaultPlan::new().fail_write(1, kind));
                let e = if queued {
                    let mut q = b.new_queue(4).unwrap();
                    let bufs = vec![
                        pattern_buf(at, BLOCK, new),
                        pattern_buf(at + BLOCK as u64, BLOCK, new),
                    ];
                    q.submit(IoOp::new(at, bufs, 0)).unwrap();
                    let mut done = q.wait(1).unwrap();
                    assert_eq!(done.len(), 1);
                    done.pop().unwrap().result.unwrap_err()
                } else {
                    b.write_at(&expected(at, len, new), at).unwrap_err()
                };
                assert_eq!(
                    e.kind(),
                    ErrorKind::Io,
                    "{name} {kind:?} queued={queued}: never success"
                );
                let data = read_back(b.as_ref(), at, len);
                let (was, now) = (expected(at, len, old), expected(at, len, new));
                for (s, chunk) in data.chunks(512).enumerate() {
                    let written = match kind {
                        FaultKind::Short => s < len / 512 / 2,
                        _ => s % 2 == 1,
                    };
                    let want = if written { &now } else { &was };
                    assert!(
                        chunk == &want[s * 512..(s + 1) * 512],
                        "{name} {kind:?} queued={queued}: sector {s} written={written}"
                    );
                }
                // Restore the old contents for the next round.
                b.clear_plan();
                b.write_at(&was, at).unwrap();
            }
        }
    }
}

#[test]
fn random_faults_replay_from_the_seed() {
    let run = |seed: u64| -> Vec<u64> {
        let b = FaultyBacking::new(MemBacking::new(DEVICE_BYTES).unwrap());
        b.set_plan(FaultPlan::new().fail_writes_randomly(4, FaultKind::Eio, seed));
        let blocks: Vec<u64> = (0..64).collect();
        let mut failed: Vec<u64> = queue_blocks(&b, &blocks, 1)
            .into_iter()
            .filter(|(_, r)| r.is_err())
            .map(|(t, _)| t)
            .collect();
        failed.sort();
        failed
    };
    let a = run(12345);
    assert_eq!(a, run(12345));
    assert_ne!(a, run(54321));
    assert!(!a.is_empty() && a.len() < 40, "about a quarter fail: {a:?}");
}

// ---- ceiling ---------------------------------------------------------------------------

#[test]
fn ceiling_smoke() {
    for case in cases() {
        for (pattern, depth) in [(Pattern::Sequential, 1), (Pattern::Random, 32)] {
            let c = ceiling::measure(case.backing.as_ref(), pattern, depth, 64).unwrap();
            assert_eq!((c.blocks, c.depth, c.pattern), (64, depth, pattern));
            assert!(
                c.pages_per_s > 0.0 && c.elapsed_secs > 0.0,
                "{}: {c:?}",
                case.name
            );
        }
        let e = ceiling::measure(case.backing.as_ref(), Pattern::Random, 1, DEVICE_BLOCKS + 1)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }
}

// ---- block devices -----------------------------------------------------------------------

/// A loop device over a file, detached on drop.
struct LoopDevice {
    dev: String,
}

impl LoopDevice {
    fn attach(file: &Path, sector_bytes: usize) -> LoopDevice {
        let out = std::process::Command::new("losetup")
            .args([
                "--find",
                "--show",
                "--sector-size",
                &sector_bytes.to_string(),
            ])
            .arg(file)
            .output()
            .expect("losetup (Debian package mount) is needed for the block-device test");
        assert!(
            out.status.success(),
            "losetup failed (the test needs root and loop devices): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        LoopDevice {
            dev: String::from_utf8(out.stdout).unwrap().trim().to_string(),
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .args(["-d", &self.dev])
            .status();
    }
}

#[test]
fn block_device_over_loop_with_512_and_4096_byte_sectors() {
    for sector_bytes in [512usize, 4096] {
        let dir = real_dir();
        let img = dir.path().join("loop.img");
        let size_bytes = 2 * 1024 * 1024u64;
        std::fs::File::create(&img)
            .unwrap()
            .set_len(size_bytes)
            .unwrap();
        let lo = LoopDevice::attach(&img, sector_bytes);
        let name = format!("{} ({sector_bytes}-byte sectors)", lo.dev);
        {
            let b = FileBacking::open(&lo.dev, &FileOptions::default()).unwrap();
            eprintln!("{name}: {} align {}", b.io_mode(), b.dio_align_bytes());
            assert!(b.is_block_device(), "{name}");
            assert_eq!(b.size_bytes(), size_bytes, "{name}: BLKGETSIZE64");
            assert_eq!(b.describe(), lo.dev);
            if b.is_direct() {
                assert_eq!(b.dio_align_bytes(), sector_bytes, "{name}: BLKSSZGET");
            }
            // Opened exclusively, like zram's backing_dev: a second open is refused.
            let e = FileBacking::open(&lo.dev, &FileOptions::default()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Busy, "{name}: {e}");

            let blocks = size_bytes / BLOCK as u64;
            let salt = 61;
            let mut q = b.new_queue(32).unwrap();
            write_through_queue(q.as_mut(), &scattered_ops(blocks, salt), salt, &name);
            // A queued op of 512-byte buffers at an odd sector: misaligned for a 4 KiB-sector
            // device's direct I/O, so the engine must take the buffered descriptor.
            let at = 5 * BLOCK as u64 + 512;
            let small = vec![pattern_buf(at, 512, 62), pattern_buf(at + 512, 512, 62)];
            q.submit(IoOp::new(at, small, 0)).unwrap();
            for c in q.wait(1).unwrap() {
                c.result.unwrap();
            }
            drop(q);
            // The same through the synchronous calls.
            let at2 = 9 * BLOCK as u64 + 1536;
            b.write_at(&expected(at2, 512, 63), at2).unwrap();
            b.flush().unwrap();

            let mut want = expected(0, size_bytes as usize, salt);
            want[at as usize..at as usize + 1024].copy_from_slice(&expected(at, 1024, 62));
            want[at2 as usize..at2 as usize + 512].copy_from_slice(&expected(at2, 512, 63));
            let mut aligned = AlignedBuf::new_zeroed(size_bytes as usize).unwrap();
            b.read_at(&mut aligned, 0).unwrap();
            assert!(aligned[..] == want[..], "{name}: aligned read-back");
            assert!(
                read_back(&b, at, 1024) == expected(at, 1024, 62),
                "{name}: small read-back"
            );
            drop(b);
            drop(lo);
            // And it reached the file under the loop device.
            assert!(
                std::fs::read(&img).unwrap() == want,
                "{name}: file contents"
            );
        }
    }
}

/// Queued reads (whole buffers and segments, in one op) and readv_at return exactly what was
/// written, on every engine; an op read and then resubmitted unchanged as a write (GC's
/// bio_reuse) copies those bytes elsewhere.
#[test]
fn queued_reads_segments_and_read_then_write_reuse() {
    use uzram::backing::{IoKind, Segment};
    for case in cases() {
        let b = case.backing.as_ref();
        let salt = 77;
        // 16 blocks of pattern at block 8.
        b.write_at(
            &expected(8 * BLOCK as u64, 16 * BLOCK, salt),
            8 * BLOCK as u64,
        )
        .unwrap();
        // readv_at into pieces.
        let mut p1 = vec![0u8; 3 * BLOCK];
        let mut p2 = vec![0u8; BLOCK];
        b.readv_at(&mut [&mut p1[..], &mut p2[..]], 9 * BLOCK as u64)
            .unwrap();
        assert_eq!(
            p1,
            expected(9 * BLOCK as u64, 3 * BLOCK, salt),
            "{}",
            case.name
        );
        assert_eq!(
            p2,
            expected(12 * BLOCK as u64, BLOCK, salt),
            "{}",
            case.name
        );
        let mut q = b.new_queue(4).unwrap();
        // A queued read of 2 whole buffers, and one filling segments of 3 buffers.
        let bufs = (0..2)
            .map(|_| AlignedBuf::new_zeroed(BLOCK).unwrap())
            .collect();
        q.submit(IoOp::read(8 * BLOCK as u64, bufs, 1)).unwrap();
        let bufs = (0..3)
            .map(|_| AlignedBuf::new_zeroed(BLOCK).unwrap())
            .collect();
        let mut op = IoOp::read(10 * BLOCK as u64, bufs, 2);
        op.segments = Some(vec![
            Segment {
                buf: 0,
                offset: 3584,
                len: 512,
            },
            Segment {
                buf: 1,
                offset: 0,
                len: BLOCK,
            },
            Segment {
                buf: 2,
                offset: 0,
                len: 3584,
            },
        ]);
        q.submit(op).unwrap();
        let mut done: Vec<IoCompletion> = q.wait(usize::MAX).unwrap();
        done.sort_by_key(|c| c.op.tag);
        assert_eq!(done.len(), 2);
        for c in &done {
            c.result.as_ref().unwrap();
            assert_eq!(c.op.kind, IoKind::Read);
        }
        let whole: Vec<u8> = done[0]
            .op
            .bufs
            .iter()
            .flat_map(|x| x.iter().copied())
            .collect();
        assert_eq!(
            whole,
            expected(8 * BLOCK as u64, 2 * BLOCK, salt),
            "{}",
            case.name
        );
        let segs: Vec<u8> = done[1].op.slices().concat();
        assert_eq!(
            segs,
            expected(10 * BLOCK as u64, 2 * BLOCK, salt),
            "{}",
            case.name
        );
        // Reuse the segmented read as the write to block 100: same op, same buffers.
        let mut op = done.pop().unwrap().op;
        op.kind = IoKind::Write;
        op.offset = 100 * BLOCK as u64;
        q.submit(op).unwrap();
        for c in q.wait(usize::MAX).unwrap() {
            c.result.unwrap();
        }
        assert_eq!(
            read_back(b, 100 * BLOCK as u64, 2 * BLOCK),
            expected(10 * BLOCK as u64, 2 * BLOCK, salt),
            "{}",
            case.name
        );
        // Overlapping read segments are refused, handing the op back.
        let bufs = vec![AlignedBuf::new_zeroed(BLOCK).unwrap()];
        let mut bad = IoOp::read(0, bufs, 3);
        bad.segments = Some(vec![
            Segment {
                buf: 0,
                offset: 0,
                len: 1024,
            },
            Segment {
                buf: 0,
                offset: 512,
                len: 512,
            },
        ]);
        let (e, _) = q.submit(bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{}", case.name);
    }
}

/// A planned read fault fails a queued read with EIO and leaves its buffers to the caller.
#[test]
fn queued_read_faults_are_eio() {
    let faulty = FaultyBacking::new(MemBacking::new(DEVICE_BYTES).unwrap());
    faulty.set_plan(FaultPlan::new().fail_read(2));
    let mut q = faulty.new_queue(4).unwrap();
    for tag in 0..3 {
        let bufs = vec![AlignedBuf::new_zeroed(BLOCK).unwrap()];
        q.submit(IoOp::read(tag * BLOCK as u64, bufs, tag)).unwrap();
    }
    let mut done = q.wait(usize::MAX).unwrap();
    done.sort_by_key(|c| c.op.tag);
    let kinds: Vec<Option<ErrorKind>> = done
        .iter()
        .map(|c| c.result.as_ref().err().map(|e| e.kind()))
        .collect();
    assert_eq!(kinds, [None, Some(ErrorKind::Io), None]);
    assert!(done.iter().all(|c| c.op.bufs.len() == 1));
}
