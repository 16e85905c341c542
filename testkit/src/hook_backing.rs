//! A memory backing with hooks, for tests that must act at one exact point of a writeback: a
//! hook run right after each submit (the write is done, its completion not yet reaped: a test
//! changes a slot "while its write is in flight"), and waits that fail (a queue the kernel
//! cannot be waited on). Everything else goes to the [`MemBacking`] inside.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use uzram::backing::{Backing, IoCompletion, IoOp, IoQueue, MemBacking, SubmitResult, SyncQueue};

/// Run after each submit, with the op's offset, on the thread that submitted it.
pub type SubmitHook = Box<dyn FnMut(u64) + Send>;

/// A [`MemBacking`] whose queues run hooks.
pub struct HookBacking {
    inner: MemBacking,
    on_submit: Mutex<Option<SubmitHook>>,
    fail_waits: AtomicU32,
}

impl std::fmt::Debug for HookBacking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HookBacking")
    }
}

impl HookBacking {
    /// `bytes` of memory, no hook set.
    pub fn new(bytes: u64) -> HookBacking {
        HookBacking {
            inner: MemBacking::new(bytes).unwrap(),
            on_submit: Mutex::new(None),
            fail_waits: AtomicU32::new(0),
        }
    }

    /// Sets (or, with `None`, clears) the hook run after each submit.
    pub fn on_submit(&self, hook: Option<SubmitHook>) {
        *self.on_submit.lock().unwrap() = hook;
    }

    /// Runs `hook` once, after the next submit (then no hook is set).
    pub fn on_first_submit(&self, hook: impl FnOnce(u64) + Send + 'static) {
        let mut hook = Some(hook);
        self.on_submit(Some(Box::new(move |offset| {
            if let Some(h) = hook.take() {
                h(offset);
            }
        })));
    }

    /// The next `n` waits on any of its queues fail with `EIO` (the writes themselves were
    /// done, synchronously).
    pub fn fail_next_waits(&self, n: u32) {
        self.fail_waits.store(n, Ordering::Relaxed);
    }
}

impl Backing for HookBacking {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> uzram::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn writev_at(&self, bufs: &[&[u8]], offset: u64) -> uzram::Result<()> {
        self.inner.writev_at(bufs, offset)
    }
    fn flush(&self) -> uzram::Result<()> {
        Ok(())
    }
    fn describe(&self) -> String {
        "hook".into()
    }
    fn new_queue(&self, depth: usize) -> uzram::Result<Box<dyn IoQueue + '_>> {
        Ok(Box::new(HookQueue {
            backing: self,
            inner: SyncQueue::new(&self.inner, depth)?,
        }))
    }
}

#[derive(Debug)]
struct HookQueue<'a> {
    backing: &'a HookBacking,
    inner: SyncQueue<'a>,
}

impl IoQueue for HookQueue<'_> {
    fn depth(&self) -> usize {
        self.inner.depth()
    }
    fn submit(&mut self, op: IoOp) -> SubmitResult {
        let offset = op.offset;
        let r = self.inner.submit(op);
        if let Some(h) = self.backing.on_submit.lock().unwrap().as_mut() {
            h(offset);
        }
        r
    }
    fn wait(&mut self, min: usize) -> uzram::Result<Vec<IoCompletion>> {
        let fail = self
            .backing
            .fail_waits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            return Err(uzram::Error::io("the queue cannot be waited on"));
        }
        self.inner.wait(min)
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
}
