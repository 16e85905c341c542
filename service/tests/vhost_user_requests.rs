//! The vhost-user-blk request path without QEMU: the test kit's virtio-blk driver
//! (`uzram_testkit::virtio_blk`: QEMU's side of the vhost-user protocol with guest memory in a
//! shared memfd, and a guest's side of split virtqueues with EVENT_IDX, kick and call
//! eventfds; the driver `uzram bench vhost` measures with) against the export
//! (`src/frontend/vhost_user.rs`) in this process.
//!
//! `every_kind_of_request_matches_a_model`: seeded requests of every kind the device offers
//! (IN, OUT, FLUSH, GET_ID, DISCARD, WRITE_ZEROES with and without unmap), of one sector to 16
//! pages at sector offsets, several in flight on each of two queues at once, each checked
//! against a plain byte array; at the end the whole device reads back as the model through the
//! driver and through the device itself. The seed is printed; `UZRAM_SEED=N` replays one.
//!
//! `bad_requests_get_an_error_and_lose_nothing`: requests that break the rules (a header too
//! short, the status byte not device-writable, sectors out of range, data in the wrong
//! direction, bad segments, unknown types) each get an error status, or, with nowhere to put
//! one, come back used with length 0; after each the device still holds exactly the model and
//! the queue serves the next good request.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use uzram::BlockDevice;
use uzram_service::frontend::vhost_user::{VhostUserConfig, VhostUserExport};
use uzram_testkit::device::new_device;
use uzram_testkit::pages::pattern;
use uzram_testkit::virtio_blk::{
    segment, Completion, Desc, DriverConfig, Request, VhostUserBlk, Virtqueue, F_DISCARD,
    F_EVENT_IDX, F_FLUSH, F_MQ, F_WRITE_ZEROES, ID_BYTES, OUTHDR_BYTES, S_IOERR, S_OK, S_UNSUPP,
    S_UNTOUCHED, T_DISCARD, T_FLUSH, T_GET_ID, T_IN, T_OUT, T_WRITE_ZEROES,
};

const DEVICE_BYTES: u64 = 4 << 20;
const SECTORS: u64 = DEVICE_BYTES >> 9;
const PAGE: u64 = 4096;
/// The most data one request carries here: 16 pages.
const DATA_BYTES: u32 = 64 << 10;
const WAIT: Duration = Duration::from_secs(30);

/// A device served on a vhost-user socket in a temporary directory, with 2 queues.
struct Served {
    _export: VhostUserExport,
    device: Arc<dyn BlockDevice>,
    _dir: tempfile::TempDir,
    socket: PathBuf,
}

fn serve() -> Served {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("zram0.vhost.sock");
    let device = new_device(DEVICE_BYTES);
    let cfg = VhostUserConfig {
        nr_queues: 2,
        swap: false,
    };
    let export = VhostUserExport::start("zram0", &socket, Arc::clone(&device), &cfg).unwrap();
    Served {
        _export: export,
        device,
        _dir: dir,
        socket,
    }
}

fn connect(socket: &std::path::Path) -> (VhostUserBlk, Vec<Virtqueue>) {
    connect_with(socket, true)
}

/// As [`connect`], with or without EVENT_IDX.
fn connect_with(socket: &std::path::Path, event_idx: bool) -> (VhostUserBlk, Vec<Virtqueue>) {
    let cfg = DriverConfig {
        queues: 2,
        queue_size: 64,
        data_bytes: DATA_BYTES,
        event_idx,
        inflight: false,
    };
    let (blk, queues) = VhostUserBlk::connect(socket, &cfg).unwrap();
    assert_eq!(blk.capacity_sectors, SECTORS);
    for bit in [F_FLUSH, F_DISCARD, F_WRITE_ZEROES, F_MQ] {
        assert!(blk.has(bit), "feature {bit} not negotiated: {blk:?}");
    }
    assert_eq!(blk.has(F_EVENT_IDX), event_idx, "{blk:?}");
    (blk, queues)
}

/// A request built for the model: what it does, and what the driver sends.
#[derive(Debug, Clone)]
enum Op {
    Read {
        sector: u64,
        sectors: u32,
    },
    Write {
        sector: u64,
        data: Vec<u8>,
    },
    Flush,
    GetId,
    Discard {
        sector: u64,
        sectors: u32,
    },
    WriteZeroes {
        sector: u64,
        sectors: u32,
        unmap: bool,
    },
}

impl Op {
    /// The sectors it touches (none for FLUSH and GET_ID).
    fn range(&self) -> Option<(u64, u64)> {
        match *self {
            Op::Read { sector, sectors }
            | Op::Discard { sector, sectors }
            | Op::WriteZeroes {
                sector, sectors, ..
            } => Some((sector, sector + u64::from(sectors))),
            Op::Write { sector, ref data } => Some((sector, sector + (data.len() as u64 >> 9))),
            Op::Flush | Op::GetId => None,
        }
    }

    fn submit(&self, vq: &mut Virtqueue) -> u16 {
        let seg;
        let req = match self {
            Op::Read { sector, sectors } => Request::read(*sector, sectors << 9),
            Op::Write { sector, data } => Request::write(*sector, data),
            Op::Flush => Request::bare(T_FLUSH),
            Op::GetId => Request {
                kind: T_GET_ID,
                sector: 0,
                out: &[],
                in_len: ID_BYTES,
            },
            Op::Discard { sector, sectors } => {
                seg = segment(*sector, *sectors, 0);
                Request {
                    kind: T_DISCARD,
                    sector: 0,
                    out: &seg,
                    in_len: 0,
                }
            }
            Op::WriteZeroes {
                sector,
                sectors,
                unmap,
            } => {
                seg = segment(*sector, *sectors, u32::from(*unmap));
                Request {
                    kind: T_WRITE_ZEROES,
                    sector: 0,
                    out: &seg,
                    in_len: 0,
                }
            }
        };
        vq.submit(&req).expect("a free slot")
    }
}

/// A random request: ranges at any sector, up to 16 pages; discards whole pages (the device
/// frees whole pages only, as zram does, and advertises a page's alignment).
fn random_op(rng: &mut SmallRng, seed: &mut u64) -> Op {
    let sectors = rng.gen_range(1..=(DATA_BYTES >> 9));
    let sector = rng.gen_range(0..=SECTORS - u64::from(sectors));
    match rng.gen_range(0..100) {
        0..=34 => Op::Read { sector, sectors },
        35..=74 => {
            *seed += 1;
            Op::Write {
                sector,
                data: pattern((sectors << 9) as usize, *seed),
            }
        }
        75..=79 => Op::Flush,
        80..=84 => Op::GetId,
        85..=92 => {
            let pages = rng.gen_range(1..=16u64);
            let first = rng.gen_range(0..=DEVICE_BYTES / PAGE - pages);
            Op::Discard {
                sector: first * (PAGE >> 9),
                sectors: (pages * (PAGE >> 9)) as u32,
            }
        }
        _ => Op::WriteZeroes {
            sector,
            sectors,
            unmap: rng.gen(),
        },
    }
}

/// Applies a completed `op` to the model and checks its answer.
fn check(op: &Op, c: &Completion, vq: &Virtqueue, model: &mut [u8], what: &str) {
    assert_eq!(c.status, S_OK, "{what}: {op:?}");
    match op {
        Op::Read { sector, sectors } => {
            let len = (*sectors as usize) << 9;
            assert_eq!(c.used_len as usize, len + 1, "{what}: {op:?}");
            let at = (*sector as usize) << 9;
            assert!(
                vq.data(c.slot, len) == model[at..at + len],
                "{what}: {op:?} read back other data"
            );
        }
        Op::Write { sector, data } => {
            assert_eq!(c.used_len, 1, "{what}");
            let at = (*sector as usize) << 9;
            model[at..at + data.len()].copy_from_slice(data);
        }
        Op::GetId => {
            assert_eq!(c.used_len, ID_BYTES + 1, "{what}");
            let mut id = [0u8; ID_BYTES as usize];
            id[..5].copy_from_slice(b"zram0");
            assert_eq!(vq.data(c.slot, id.len()), id, "{what}");
        }
        Op::Flush => assert_eq!(c.used_len, 1, "{what}"),
        Op::Discard { sector, sectors }
        | Op::WriteZeroes {
            sector, sectors, ..
        } => {
            assert_eq!(c.used_len, 1, "{what}");
            let at = (*sector as usize) << 9;
            model[at..at + ((*sectors as usize) << 9)].fill(0);
        }
    }
}

/// Reads the whole device through queue `vq` and compares it with `model`.
fn assert_device_is(vq: &mut Virtqueue, model: &[u8], what: &str) {
    for at in (0..DEVICE_BYTES).step_by(DATA_BYTES as usize) {
        let c = vq.run(&Request::read(at >> 9, DATA_BYTES)).unwrap();
        assert_eq!(c.status, S_OK, "{what}: reading at {at}");
        let a = at as usize;
        assert!(
            vq.data(c.slot, DATA_BYTES as usize) == model[a..a + DATA_BYTES as usize],
            "{what}: the device differs from the model in bytes {a}..{}",
            a + DATA_BYTES as usize
        );
    }
}

#[test]
fn every_kind_of_request_matches_a_model() {
    model_run(true);
}

/// The same without EVENT_IDX: the device calls after every pass that used any request, and
/// the driver kicks unless the device set `VRING_USED_F_NO_NOTIFY` (a device that left it set
/// before it sleeps would never be kicked again, and a batch would wait forever).
#[test]
fn every_kind_of_request_matches_a_model_without_event_idx() {
    model_run(false);
}

fn model_run(event_idx: bool) {
    let seed: u64 = std::env::var("UZRAM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen());
    println!("seed {seed} (replay with UZRAM_SEED={seed})");
    let mut rng = SmallRng::seed_from_u64(seed);
    let s = serve();
    let (_blk, mut queues) = connect_with(&s.socket, event_idx);
    let mut model = vec![0u8; DEVICE_BYTES as usize];
    let mut data_seed = seed.wrapping_mul(1000);
    let mut done = Vec::new();
    for round in 0..150 {
        // On each queue a batch of 1 to 8 requests whose ranges do not overlap (so the order
        // the device serves them in does not matter), offered together and waited for.
        let mut batches: Vec<Vec<(u16, Op)>> = vec![Vec::new(), Vec::new()];
        let mut taken: Vec<(u64, u64)> = Vec::new();
        for (q, vq) in queues.iter_mut().enumerate() {
            let n = rng.gen_range(1..=8);
            while batches[q].len() < n {
                let op = random_op(&mut rng, &mut data_seed);
                if let Some((a, b)) = op.range() {
                    if taken.iter().any(|&(x, y)| a < y && x < b) {
                        continue;
                    }
                    taken.push((a, b));
                }
                let slot = op.submit(vq);
                batches[q].push((slot, op));
            }
            vq.notify().unwrap();
        }
        for (q, vq) in queues.iter_mut().enumerate() {
            let mut left = batches[q].len();
            while left > 0 {
                done.clear();
                left -= vq.wait(&mut done, WAIT).unwrap();
                for c in &done {
                    let (_, op) = batches[q]
                        .iter()
                        .find(|(slot, _)| *slot == c.slot)
                        .expect("a used entry of a request offered");
                    check(op, c, vq, &mut model, &format!("seed {seed} round {round}"));
                }
            }
        }
    }
    assert_device_is(&mut queues[1], &model, &format!("seed {seed}"));
    let mut back = vec![0u8; DEVICE_BYTES as usize];
    s.device.read_at(&mut back, 0).unwrap();
    assert!(back == model, "seed {seed}: the device itself differs");
}

/// A chain of a slot's descriptors from its (header, data, status) addresses.
type Chain<'a> = Box<dyn Fn(u64, u64, u64) -> Vec<Desc> + 'a>;
/// A bad request: what it is, its type and sector, its chain, the status and used length it
/// gets.
type BadCase<'a> = (&'static str, u32, u64, Chain<'a>, u8, u32);

#[test]
fn bad_requests_get_an_error_and_lose_nothing() {
    let s = serve();
    let (_blk, mut queues) = connect(&s.socket);
    let vq = &mut queues[0];
    // Every page written, so that a request that loses data shows.
    let model = pattern(DEVICE_BYTES as usize, 7);
    for at in (0..DEVICE_BYTES).step_by(DATA_BYTES as usize) {
        let a = at as usize;
        let data = &model[a..a + DATA_BYTES as usize];
        assert_eq!(vq.run(&Request::write(at >> 9, data)).unwrap().status, S_OK);
    }
    let page = pattern(PAGE as usize, 99);
    let mut good = 0u64;
    // A chain of `descs` in a slot whose header says (kind, sector): its completion.
    let raw =
        |vq: &mut Virtqueue, kind: u32, sector: u64, descs: &dyn Fn(u64, u64, u64) -> Vec<Desc>| {
            let slot = vq.take_slot().unwrap();
            vq.write_header(slot, kind, sector);
            let a = vq.area(slot);
            vq.ram().write(a.data, &page);
            vq.submit_chain(slot, &descs(a.header, a.data, a.status));
            vq.notify().unwrap();
            let mut done = Vec::new();
            vq.wait(&mut done, WAIT).unwrap();
            assert_eq!(done.len(), 1);
            let mut status = [0u8];
            vq.ram().read(a.status, &mut status);
            (done[0], status[0])
        };
    let hdr = |h| Desc {
        addr: h,
        len: OUTHDR_BYTES,
        write: false,
    };
    let data = |d, write| Desc {
        addr: d,
        len: PAGE as u32,
        write,
    };
    let status = |st, write| Desc {
        addr: st,
        len: 1,
        write,
    };
    // Header, one page of data readable by the device (`false`) or writable, status.
    let in_order = |write| -> Chain {
        Box::new(move |h, d, st| vec![hdr(h), data(d, write), status(st, true)])
    };
    let cases: Vec<BadCase> = vec![
        (
            "a header of 15 bytes and nothing else readable (a flush)",
            T_FLUSH,
            0,
            Box::new(|h, _, st| {
                vec![
                    Desc {
                        addr: h,
                        len: 15,
                        write: false,
                    },
                    status(st, true),
                ]
            }),
            S_IOERR,
            1,
        ),
        (
            "a header of 8 bytes and nothing else readable",
            T_IN,
            0,
            Box::new(|h, _, st| {
                vec![
                    Desc {
                        addr: h,
                        len: 8,
                        write: false,
                    },
                    status(st, true),
                ]
            }),
            S_IOERR,
            1,
        ),
        (
            "the status byte not device-writable (a write)",
            T_OUT,
            8,
            Box::new(|h, d, st| vec![hdr(h), data(d, false), status(st, false)]),
            S_UNTOUCHED,
            0,
        ),
        // A read whose status byte is readable: the status is the last device-writable byte
        // (virtio frames a request by direction, not by descriptor), here the data's last,
        // and a read of the 4095 bytes before it is refused there (IOERR, used length 1);
        // the byte meant for the status is not touched.
        (
            "the status byte not device-writable (a read)",
            T_IN,
            8,
            Box::new(|h, d, st| vec![hdr(h), data(d, true), status(st, false)]),
            S_UNTOUCHED,
            1,
        ),
        (
            "a write one sector past the end",
            T_OUT,
            SECTORS - 7,
            in_order(false),
            S_IOERR,
            1,
        ),
        (
            "a write whose byte offset overflows",
            T_OUT,
            u64::MAX >> 2,
            in_order(false),
            S_IOERR,
            1,
        ),
        (
            "a read at the end",
            T_IN,
            SECTORS,
            in_order(true),
            S_IOERR,
            1,
        ),
        (
            "a read whose data is device-readable",
            T_IN,
            16,
            in_order(false),
            S_IOERR,
            1,
        ),
        (
            "a write whose data is device-writable",
            T_OUT,
            16,
            in_order(true),
            S_IOERR,
            1,
        ),
        (
            "a write whose data comes after the status",
            T_OUT,
            16,
            Box::new(|h, d, st| vec![hdr(h), status(st, true), data(d, false)]),
            S_IOERR,
            1,
        ),
        (
            "a discard of a 12-byte segment",
            T_DISCARD,
            0,
            Box::new(|h, d, st| {
                vec![
                    hdr(h),
                    Desc {
                        addr: d,
                        len: 12,
                        write: false,
                    },
                    status(st, true),
                ]
            }),
            S_IOERR,
            1,
        ),
        (
            "an unknown request type",
            99,
            0,
            in_order(false),
            S_UNSUPP,
            1,
        ),
    ];
    for (what, kind, sector, descs, want_status, want_len) in &cases {
        let (c, st) = raw(vq, *kind, *sector, descs.as_ref());
        assert_eq!(
            (st, c.used_len),
            (*want_status, *want_len),
            "{what}: status and used length"
        );
        // The next good request on the queue is served.
        good += 1;
        let c = vq.run(&Request::read(good * 8, PAGE as u32)).unwrap();
        assert_eq!(c.status, S_OK, "after {what}");
        let at = (good * PAGE) as usize;
        assert!(
            vq.data(c.slot, PAGE as usize) == model[at..at + PAGE as usize],
            "after {what}"
        );
    }
    // Segments of a discard and write-zeroes that the device refuses: out of range, discard
    // flags, unknown write-zeroes flags.
    for (what, kind, seg, want) in [
        (
            "a discard past the end",
            T_DISCARD,
            segment(SECTORS - 4, 8, 0),
            S_IOERR,
        ),
        (
            "a discard with flags",
            T_DISCARD,
            segment(0, 8, 1),
            S_UNSUPP,
        ),
        (
            "write-zeroes with unknown flags",
            T_WRITE_ZEROES,
            segment(0, 8, 2),
            S_UNSUPP,
        ),
        (
            "write-zeroes past the end",
            T_WRITE_ZEROES,
            segment(u64::MAX, u32::MAX, 0),
            S_IOERR,
        ),
    ] {
        let req = Request {
            kind,
            sector: 0,
            out: &seg,
            in_len: 0,
        };
        assert_eq!(vq.run(&req).unwrap().status, want, "{what}");
    }
    // A good write after all that lands, and nothing else changed.
    let mut model = model;
    assert_eq!(
        vq.run(&Request::write(SECTORS - 8, &page)).unwrap().status,
        S_OK
    );
    model[(DEVICE_BYTES - PAGE) as usize..].copy_from_slice(&page);
    assert_device_is(&mut queues[1], &model, "after the bad requests");
    let mut back = vec![0u8; DEVICE_BYTES as usize];
    s.device.read_at(&mut back, 0).unwrap();
    assert!(back == model, "the device itself differs");
}

/// Reaps `n` completions by looking at the used ring, never asking for a call (a driver that
/// polls); each must be `S_OK`.
fn reap_without_calls(vq: &mut Virtqueue, n: usize, what: &str) {
    let deadline = std::time::Instant::now() + WAIT;
    let mut done = Vec::new();
    let mut got = 0;
    while got < n {
        done.clear();
        got += vq.reap(&mut done).unwrap();
        for c in &done {
            assert_eq!(c.status, S_OK, "{what}");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: {got} of {n} completed within {WAIT:?}"
        );
        std::thread::yield_now();
    }
}

/// EVENT_IDX's `used_event`, however the device batches its completions into passes: a
/// driver that asks for a call at the last of a batch's completions gets exactly one, and a
/// driver that asks for none (its `used_event` left behind the used index: it polls the used
/// ring) gets none. The count is the call eventfd's, which sums every call: the one call
/// waited for at the end of each batch proves no other came before it.
#[test]
fn calls_follow_the_drivers_used_event() {
    let s = serve();
    let (_blk, mut queues) = connect(&s.socket);
    let vq = &mut queues[0];
    let n = vq.slots();
    let page = vec![0xa5u8; PAGE as usize];
    let _ = vq.take_calls();
    for round in 0..6u16 {
        let start = vq.last_used();
        // Even rounds: a call at the batch's last completion; odd rounds: no call at all.
        let ask = round % 2 == 0;
        let event = if ask {
            start.wrapping_add(n - 1)
        } else {
            start.wrapping_sub(1)
        };
        vq.set_used_event(event);
        for i in 0..n {
            let sector = u64::from(i) * (PAGE >> 9);
            vq.submit(&Request::write(sector, &page))
                .expect("a free slot");
        }
        vq.notify().unwrap();
        let what = format!("round {round}");
        reap_without_calls(vq, usize::from(n), &what);
        if ask {
            // Every completion of the batch (and of the batch before, which asked for none)
            // is in: exactly one call in all.
            assert_eq!(vq.wait_calls(WAIT).unwrap(), 1, "{what}");
        }
    }
    // And once more after a round that asked for none: the stray call it must not have made
    // would show here.
    let start = vq.last_used();
    vq.set_used_event(start);
    vq.submit(&Request::read(0, PAGE as u32))
        .expect("a free slot");
    vq.notify().unwrap();
    reap_without_calls(vq, 1, "the last read");
    assert_eq!(vq.wait_calls(WAIT).unwrap(), 1, "the last read");
}
