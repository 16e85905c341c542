//! [`SyncQueue`]: the synchronous engine. Each op is written with one [`Backing::writev_at`]
//! (`pwritev` for files) when it is submitted; its completion waits in a list until the next
//! [`IoQueue::wait`] reaps it. Nothing is ever in the kernel between calls, so dropping the
//! queue only drops reaped-or-finished ops.
//!
//! This is the old single-page writeback path (one blocking write at a time), kept so the
//! benchmark can compare it with the io_uring engine on the same file; it is also the queue of
//! [`MemBacking`](super::MemBacking).

use std::collections::VecDeque;
use std::fmt;

use super::{
    check_depth, check_submit, Backing, IoCompletion, IoKind, IoOp, IoQueue, SubmitResult,
};
use crate::error::Result;

/// A queue that performs each write at submit time. An op counts as in flight until its
/// completion is reaped, so `depth` bounds unreaped completions as on the io_uring engine.
pub struct SyncQueue<'a> {
    backing: &'a dyn Backing,
    depth: usize,
    /// Finished ops, oldest first, waiting to be reaped.
    done: VecDeque<IoCompletion>,
}

impl<'a> SyncQueue<'a> {
    /// A queue of `depth` over `backing`.
    pub fn new(backing: &'a dyn Backing, depth: usize) -> Result<SyncQueue<'a>> {
        check_depth(depth)?;
        Ok(SyncQueue {
            backing,
            depth,
            done: VecDeque::with_capacity(depth),
        })
    }
}

impl IoQueue for SyncQueue<'_> {
    fn depth(&self) -> usize {
        self.depth
    }

    fn submit(&mut self, op: IoOp) -> SubmitResult {
        if let Err(e) = check_submit(&op, self.done.len(), self.depth, self.backing.size_bytes()) {
            return Err((e, op));
        }
        let mut op = op;
        let result = match op.kind {
            IoKind::Write => self.backing.writev_at(&op.slices(), op.offset),
            IoKind::Read => {
                let offset = op.offset;
                self.backing.readv_at(&mut op.slices_mut(), offset)
            }
        };
        self.done.push_back(IoCompletion { op, result });
        Ok(())
    }

    fn wait(&mut self, min_complete: usize) -> Result<Vec<IoCompletion>> {
        // Everything submitted has already finished: `min_complete` is always satisfied.
        let _ = min_complete;
        Ok(self.done.drain(..).collect())
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }
}

impl fmt::Debug for SyncQueue<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncQueue")
            .field("backing", &self.backing.describe())
            .field("depth", &self.depth)
            .field("in_flight", &self.done.len())
            .finish()
    }
}
