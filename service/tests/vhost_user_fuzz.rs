//! A seeded fuzzer for the vhost-user-blk request parser (`frontend::virtio_blk::parse`), on
//! the stable toolchain: well-formed requests of every type, the same mutated (a flipped bit,
//! a length off by a little, a descriptor in the wrong direction, a missing status byte) and
//! random chains. Nothing may panic; what parses must obey every rule (a range inside the
//! device, data in the direction of its type, the lengths the chain has); what is refused
//! must be refused with the status the rules give.
//!
//! The seeds are fixed so a failure replays; set `UZRAM_FUZZ_ITERS` to run longer.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use uzram_service::frontend::virtio_blk::{
    parse, BlkRequest, Chain, Refused, HEAD_BYTES, OUTHDR_BYTES, SECTOR_SHIFT,
};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD as T_DISCARD, VIRTIO_BLK_T_FLUSH as T_FLUSH,
    VIRTIO_BLK_T_GET_ID as T_GET_ID, VIRTIO_BLK_T_IN as T_IN, VIRTIO_BLK_T_OUT as T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES as T_WRITE_ZEROES,
};

const TYPES: [u32; 6] = [T_IN, T_OUT, T_FLUSH, T_GET_ID, T_DISCARD, T_WRITE_ZEROES];

fn iterations() -> usize {
    std::env::var("UZRAM_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200_000)
}

/// A chain as the frontend sees one: the first bytes of its device-readable stream and the
/// rest of what [`Chain`] says of it.
#[derive(Debug, Clone)]
struct Case {
    head: Vec<u8>,
    readable_bytes: u64,
    writable_bytes: u64,
    has_status: bool,
    readable_after_writable: bool,
    too_many_segments: bool,
}

impl Case {
    fn chain(&self) -> Chain<'_> {
        Chain {
            head: &self.head[..self.head.len().min(HEAD_BYTES)],
            readable_bytes: self.readable_bytes,
            writable_bytes: self.writable_bytes,
            has_status: self.has_status,
            readable_after_writable: self.readable_after_writable,
            too_many_segments: self.too_many_segments,
        }
    }

    fn kind(&self) -> Option<u32> {
        let h = self.head.get(0..4)?;
        Some(u32::from_le_bytes(h.try_into().unwrap()))
    }

    fn sector(&self) -> u64 {
        u64::from_le_bytes(self.head[8..16].try_into().unwrap())
    }

    fn payload(&self) -> u64 {
        self.readable_bytes - OUTHDR_BYTES as u64
    }
}

/// A sector near the device's end (or anywhere, or an extreme) for a device of `sectors`.
fn sector(rng: &mut SmallRng, sectors: u64) -> u64 {
    match rng.gen_range(0..4) {
        0 => rng.gen_range(0..sectors),
        1 => sectors.saturating_sub(rng.gen_range(0..16)),
        2 => sectors + rng.gen_range(0..16),
        _ => u64::MAX - rng.gen_range(0..16),
    }
}

/// A well-formed request of a random type for a device of `device_bytes`.
fn valid(rng: &mut SmallRng, device_bytes: u64) -> Case {
    let sectors = device_bytes >> SECTOR_SHIFT;
    let kind = TYPES[rng.gen_range(0..TYPES.len())];
    let mut head = kind.to_le_bytes().to_vec();
    head.extend_from_slice(&rng.gen::<u32>().to_le_bytes());
    let data_sectors = rng.gen_range(0..=sectors.min(64));
    let data = 512 * data_sectors;
    let at = rng.gen_range(0..=sectors - data_sectors);
    let (readable, writable) = match kind {
        T_IN => (0, data),
        T_OUT => (data, 0),
        T_FLUSH => (0, 0),
        T_GET_ID => (0, rng.gen_range(0..64)),
        _ => (16, 0),
    };
    head.extend_from_slice(&(if readable == 16 { 0 } else { at }).to_le_bytes());
    if kind == T_DISCARD || kind == T_WRITE_ZEROES {
        let at = at.min(sectors - 1);
        let n = rng.gen_range(0..=(sectors - at).min(1 << 12)) as u32;
        let flags = if kind == T_WRITE_ZEROES {
            rng.gen_range(0..2u32)
        } else {
            0
        };
        head.extend_from_slice(&at.to_le_bytes());
        head.extend_from_slice(&n.to_le_bytes());
        head.extend_from_slice(&flags.to_le_bytes());
    }
    Case {
        head,
        readable_bytes: OUTHDR_BYTES as u64 + readable,
        writable_bytes: writable,
        has_status: true,
        readable_after_writable: false,
        too_many_segments: false,
    }
}

/// `case` changed in one way or a few.
fn mutate(rng: &mut SmallRng, case: &mut Case, device_bytes: u64) {
    for _ in 0..rng.gen_range(1..4) {
        match rng.gen_range(0..10) {
            0 if !case.head.is_empty() => {
                let i = rng.gen_range(0..case.head.len());
                case.head[i] ^= 1 << rng.gen_range(0..8);
            }
            1 => {
                let n = rng.gen_range(0..=case.head.len());
                case.head.truncate(n);
                case.readable_bytes = case.readable_bytes.min(n as u64);
            }
            2 => case.readable_bytes += rng.gen_range(1..1024),
            3 => case.writable_bytes += rng.gen_range(1..1024),
            4 => case.writable_bytes = case.writable_bytes.saturating_sub(rng.gen_range(1..64)),
            5 => case.has_status = false,
            6 => case.readable_after_writable = true,
            7 => case.too_many_segments = true,
            8 if case.head.len() >= 16 => {
                let s = sector(rng, device_bytes >> SECTOR_SHIFT);
                case.head[8..16].copy_from_slice(&s.to_le_bytes());
            }
            _ => {
                let k: u32 = rng.gen_range(0..20);
                if case.head.len() >= 4 {
                    case.head[0..4].copy_from_slice(&k.to_le_bytes());
                }
            }
        }
    }
}

/// A random chain: random head bytes, lengths and flags.
fn random(rng: &mut SmallRng) -> Case {
    let n = rng.gen_range(0..=HEAD_BYTES + 8);
    let head: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
    let readable_bytes = if rng.gen_bool(0.5) {
        n as u64
    } else {
        n as u64 + rng.gen_range(0..1 << 20)
    };
    Case {
        head,
        readable_bytes,
        writable_bytes: if rng.gen_bool(0.1) {
            rng.gen()
        } else {
            rng.gen_range(0..1 << 20)
        },
        has_status: rng.gen_bool(0.9),
        readable_after_writable: rng.gen_bool(0.1),
        too_many_segments: rng.gen_bool(0.1),
    }
}

/// The rules, checked against what `parse` answered for `case`.
fn check(case: &Case, device_bytes: u64, got: Result<BlkRequest, Refused>) {
    let inside = |offset: u64, len: u64| {
        offset
            .checked_add(len)
            .is_some_and(|end| end <= device_bytes)
    };
    let ctx = || format!("{case:?} -> {got:?}");
    if !case.has_status {
        assert_eq!(got, Err(Refused::NoStatus), "{}", ctx());
        return;
    }
    if case.too_many_segments || case.readable_after_writable {
        assert!(matches!(got, Err(Refused::Malformed(_))), "{}", ctx());
        return;
    }
    if case.head.len() < OUTHDR_BYTES || case.readable_bytes < OUTHDR_BYTES as u64 {
        assert!(matches!(got, Err(Refused::Malformed(_))), "{}", ctx());
        return;
    }
    let kind = case.kind().unwrap();
    if !TYPES.contains(&kind) {
        assert!(matches!(got, Err(Refused::Unsupported(_))), "{}", ctx());
        return;
    }
    match got {
        Ok(BlkRequest::Read { offset, len }) => {
            assert_eq!(kind, T_IN, "{}", ctx());
            assert_eq!(case.payload(), 0, "{}", ctx());
            assert_eq!(len, case.writable_bytes, "{}", ctx());
            assert_eq!(Some(offset), case.sector().checked_mul(512), "{}", ctx());
            assert!(inside(offset, len), "{}", ctx());
        }
        Ok(BlkRequest::Write { offset, len }) => {
            assert_eq!(kind, T_OUT, "{}", ctx());
            assert_eq!(case.writable_bytes, 0, "{}", ctx());
            assert_eq!(len, case.payload(), "{}", ctx());
            assert_eq!(Some(offset), case.sector().checked_mul(512), "{}", ctx());
            assert!(inside(offset, len), "{}", ctx());
        }
        Ok(BlkRequest::Flush) => {
            assert_eq!(kind, T_FLUSH, "{}", ctx());
            assert_eq!((case.payload(), case.writable_bytes), (0, 0), "{}", ctx());
        }
        Ok(BlkRequest::GetId { len }) => {
            assert_eq!(kind, T_GET_ID, "{}", ctx());
            assert_eq!(case.payload(), 0, "{}", ctx());
            assert_eq!(len, case.writable_bytes.min(20), "{}", ctx());
        }
        Ok(BlkRequest::Discard { offset, len } | BlkRequest::WriteZeroes { offset, len }) => {
            let discard = matches!(got, Ok(BlkRequest::Discard { .. }));
            assert_eq!(
                kind,
                if discard { T_DISCARD } else { T_WRITE_ZEROES },
                "{}",
                ctx()
            );
            assert_eq!(case.writable_bytes, 0, "{}", ctx());
            assert_eq!(case.payload(), 16, "{}", ctx());
            let seg = &case.head[16..32];
            let at = u64::from_le_bytes(seg[0..8].try_into().unwrap());
            let n = u32::from_le_bytes(seg[8..12].try_into().unwrap());
            let flags = u32::from_le_bytes(seg[12..16].try_into().unwrap());
            assert_eq!(Some(offset), at.checked_mul(512), "{}", ctx());
            assert_eq!(len, u64::from(n) << SECTOR_SHIFT, "{}", ctx());
            assert!(inside(offset, len), "{}", ctx());
            assert!(flags == 0 || (!discard && flags == 1), "{}", ctx());
        }
        Err(Refused::NoStatus) => panic!("a status byte was there: {}", ctx()),
        // A known type is unsupported only for its flags.
        Err(Refused::Unsupported(_)) => {
            assert!(kind == T_DISCARD || kind == T_WRITE_ZEROES, "{}", ctx());
        }
        Err(Refused::Malformed(_)) => {}
    }
}

#[test]
fn parser_survives_mutated_and_random_chains() {
    let mut rng = SmallRng::seed_from_u64(0x7669_7274_696f);
    let mut parsed = [0usize; 3];
    for i in 0..iterations() {
        let device_bytes = 512 * rng.gen_range(1..1u64 << 24);
        let case = match i % 3 {
            0 => valid(&mut rng, device_bytes),
            1 => {
                let mut c = valid(&mut rng, device_bytes);
                mutate(&mut rng, &mut c, device_bytes);
                c
            }
            _ => random(&mut rng),
        };
        let got = parse(&case.chain(), device_bytes);
        if i % 3 == 0 {
            assert!(
                got.is_ok(),
                "a well-formed request refused: {case:?} -> {got:?}"
            );
        }
        parsed[i % 3] += usize::from(got.is_ok());
        check(&case, device_bytes, got);
    }
    // The mutations keep some requests well-formed and break others: the fuzzer reaches both.
    let n = iterations() / 3;
    assert!(parsed[1] > 0 && parsed[1] < n, "{parsed:?}");
}
