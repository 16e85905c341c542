//! [`MemBacking`]: a backing store in memory, for tests and the model test.
//!
//! The bytes live in one `Vec<u8>` behind a reader-writer lock: reads from many threads run
//! together, a write excludes them, so every request is atomic with respect to the others (a
//! stronger guarantee than a real device gives; [`FaultyBacking`](super::FaultyBacking) adds
//! torn writes back when a test wants them). Its queue is the synchronous [`SyncQueue`].

use std::fmt;

use parking_lot::RwLock;

use super::sync::SyncQueue;
use super::{check_range, total_len, Backing, IoQueue, BLOCK_SIZE_BYTES};
use crate::error::{Error, Result};

/// An in-memory backing of a fixed size, initially zero.
pub struct MemBacking {
    /// The device's bytes; its length is `size_bytes` and never changes.
    data: RwLock<Vec<u8>>,
    /// `data.len()`, kept outside the lock.
    size_bytes: u64,
    name: String,
}

impl MemBacking {
    /// A zero-filled backing of `size_bytes` (a non-zero multiple of 4096).
    pub fn new(size_bytes: u64) -> Result<MemBacking> {
        if size_bytes == 0 || size_bytes % BLOCK_SIZE_BYTES as u64 != 0 {
            return Err(Error::invalid(format!(
                "in-memory backing size {size_bytes} is not a non-zero multiple of \
                 {BLOCK_SIZE_BYTES}"
            )));
        }
        let len = usize::try_from(size_bytes)
            .map_err(|_| Error::invalid("in-memory backing larger than the address space"))?;
        let mut data = Vec::new();
        data.try_reserve_exact(len).map_err(|_| {
            Error::no_memory(format!(
                "cannot allocate an in-memory backing of {size_bytes} bytes"
            ))
        })?;
        data.resize(len, 0);
        Ok(MemBacking {
            data: RwLock::new(data),
            size_bytes,
            name: format!("mem:{size_bytes}"),
        })
    }

    /// A copy of the whole contents, for tests.
    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().clone()
    }
}

impl Backing for MemBacking {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let data = self.data.read();
        check_range(data.len() as u64, offset, buf.len() as u64, "read")?;
        let start = offset as usize;
        buf.copy_from_slice(&data[start..start + buf.len()]);
        Ok(())
    }

    fn writev_at(&self, bufs: &[&[u8]], offset: u64) -> Result<()> {
        let mut data = self.data.write();
        check_range(data.len() as u64, offset, total_len(bufs), "write")?;
        let mut at = offset as usize;
        for b in bufs {
            data[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn describe(&self) -> String {
        self.name.clone()
    }

    fn new_queue(&self, depth: usize) -> Result<Box<dyn IoQueue + '_>> {
        Ok(Box::new(SyncQueue::new(self, depth)?))
    }
}

impl fmt::Debug for MemBacking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemBacking")
            .field("size_bytes", &self.size_bytes)
            .finish()
    }
}
