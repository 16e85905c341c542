//! The write ceiling of a backing: how many 4 KiB blocks per second its queue takes at a given
//! depth, sequentially or at random offsets. The writeback benchmark measures this on the same
//! file with the same engine in the same run, and reports its own throughput as a fraction of
//! it (fio's `rw=write|randwrite bs=4k iodepth=N`, without needing fio).
//!
//! Each block is written once (random: distinct blocks in random order), with `depth` writes
//! kept in flight; the clock covers the first submit to the last completion, not a flush (the
//! writeback path does not flush either).

use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use super::{AlignedBuf, Backing, IoOp, IoQueue, BLOCK_SIZE_BYTES};
use crate::error::{Error, Result};

/// Where the writes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pattern {
    /// Blocks 0, 1, 2, ... in order.
    Sequential,
    /// Distinct blocks chosen uniformly over the whole backing, in random order.
    Random,
}

impl Pattern {
    /// The name the benchmark's JSON uses.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Sequential => "sequential",
            Pattern::Random => "random",
        }
    }
}

/// One measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ceiling {
    /// The access pattern.
    pub pattern: Pattern,
    /// Writes kept in flight.
    pub depth: usize,
    /// 4 KiB blocks written.
    pub blocks: u64,
    /// Wall time from the first submit to the last completion.
    pub elapsed_secs: f64,
    /// `blocks / elapsed_secs`.
    pub pages_per_s: f64,
}

/// The seed of the random pattern: fixed, so two runs write the same blocks.
const SEED: u64 = 0x005E_ED0F_CE11;

/// Measures `block_count` 4 KiB writes to `backing` through its own queue at `depth`.
pub fn measure(
    backing: &dyn Backing,
    pattern: Pattern,
    depth: usize,
    block_count: u64,
) -> Result<Ceiling> {
    let mut queue = backing.new_queue(depth)?;
    measure_queue(queue.as_mut(), backing.size_bytes(), pattern, block_count)
}

/// Measures through a given queue (to compare engines on one file) over a backing of
/// `size_bytes`. The queue must be empty.
pub fn measure_queue(
    queue: &mut dyn IoQueue,
    size_bytes: u64,
    pattern: Pattern,
    block_count: u64,
) -> Result<Ceiling> {
    let block = BLOCK_SIZE_BYTES as u64;
    let total_blocks = size_bytes / block;
    if block_count == 0 || block_count > total_blocks {
        return Err(Error::invalid(format!(
            "ceiling of {block_count} blocks on a backing of {total_blocks} blocks"
        )));
    }
    if queue.in_flight() != 0 {
        return Err(Error::invalid(
            "ceiling measured on a queue with ops in flight",
        ));
    }
    let mut rng = SmallRng::seed_from_u64(SEED);
    let order: Vec<u64> = match pattern {
        Pattern::Sequential => (0..block_count).collect(),
        Pattern::Random => {
            let count =
                usize::try_from(block_count).map_err(|_| Error::invalid("too many blocks"))?;
            let total =
                usize::try_from(total_blocks).map_err(|_| Error::invalid("backing too large"))?;
            rand::seq::index::sample(&mut rng, total, count)
                .into_iter()
                .map(|b| b as u64)
                .collect()
        }
    };
    let depth = queue.depth();
    let mut free = Vec::with_capacity(depth);
    for _ in 0..depth.min(order.len()) {
        let mut buf = AlignedBuf::new_zeroed(BLOCK_SIZE_BYTES)?;
        rng.fill_bytes(&mut buf);
        free.push(buf);
    }

    let start = Instant::now();
    let mut next = 0;
    let mut completed = 0;
    while completed < order.len() {
        while next < order.len() {
            let Some(buf) = free.pop() else { break };
            let op = IoOp::new(order[next] * block, vec![buf], next as u64);
            queue.submit(op).map_err(|(e, _op)| e)?;
            next += 1;
        }
        for c in queue.wait(1)? {
            c.result?;
            let mut op = c.op;
            free.extend(op.bufs.pop());
            completed += 1;
        }
    }
    let elapsed_secs = start.elapsed().as_secs_f64().max(1e-9);
    Ok(Ceiling {
        pattern,
        depth,
        blocks: block_count,
        elapsed_secs,
        pages_per_s: block_count as f64 / elapsed_secs,
    })
}
