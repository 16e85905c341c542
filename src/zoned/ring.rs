//! GC scratch space: the ring over fixed buffers (as zoned XFS's GC manages its scratch since
//! `xfs: rework zone GC buffer management`, 2025) and the bank switching it replaced (kept as a
//! benchmark baseline).
//!
//! Both hold `nr_buffers` fixed buffers of `buffer_bytes`, each made of 4 KiB *pieces*
//! ([`PIECE_BYTES`], one [`AlignedBuf`] each, allocated once). A GC chunk reserves consecutive
//! pieces, which move into the chunk's I/O op: the read fills them, and the same op, payload
//! untouched, is resubmitted as the write (see `gc`). Pieces come back when the write completes.
//! A chunk is `n` pieces, so it may begin in one buffer and end in the next (a record spanning
//! two buffers), and in the ring it may wrap from the last buffer to the first.
//!
//! - [`ScratchRing`]: `head` advances when a chunk is reserved (its read is queued), `tail` when
//!   the oldest outstanding chunk's write completes; chunks finishing out of order wait for the
//!   ones before them. The free piece count is kept explicitly: `head == tail` alone cannot tell
//!   an empty ring from a full one (the later upstream fix).
//! - [`ScratchBank`]: two buffers used one at a time. Chunks fill the current buffer; when the
//!   next chunk does not fit in what is left, GC switches to the other buffer, which it may use
//!   only once every chunk in it has been written.

use std::collections::VecDeque;

use crate::backing::AlignedBuf;
use crate::error::{Error, Result};

/// The unit scratch space is handed out in: a 4 KiB block, so GC's reads and writes stay
/// block-aligned.
pub const PIECE_BYTES: usize = crate::units::BLOCK_SIZE_BYTES;

/// Which scratch-space design GC uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScratchMode {
    /// The ring over fixed buffers.
    #[default]
    Ring,
    /// Bank switching between two buffers (benchmark baseline).
    Bank,
}

/// A reservation: `count` pieces starting at piece `start` (in scratch order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Index of the first piece.
    pub start: usize,
    /// Number of pieces.
    pub count: usize,
}

/// Scratch space for GC chunks.
pub trait Scratch: Send {
    /// Bytes of all buffers together.
    fn capacity_bytes(&self) -> usize;
    /// The largest chunk [`reserve`](Scratch::reserve) can ever grant.
    fn max_chunk_bytes(&self) -> usize;
    /// Reserves `len_bytes` (rounded up to whole pieces), moving the pieces out; `None` when
    /// there is not room now (complete writes first). Panics if `len_bytes` is 0 or larger than
    /// [`max_chunk_bytes`](Scratch::max_chunk_bytes).
    fn reserve(&mut self, len_bytes: usize) -> Option<(Span, Vec<AlignedBuf>)>;
    /// Gives back the pieces of `span`, whose write completed (or failed).
    fn complete(&mut self, span: Span, pieces: Vec<AlignedBuf>);
    /// Bytes free for new reservations right now.
    fn free_bytes(&self) -> usize;
    /// The largest chunk of at least `min_bytes` that [`reserve`](Scratch::reserve) would
    /// grant now (a multiple of [`PIECE_BYTES`]), or 0 when none would: GC sizes its next
    /// chunk to it, so each design fills the space it has (XFS clamps a GC chunk to the
    /// scratch space available the same way).
    fn grantable_bytes(&self, min_bytes: usize) -> usize;
}

/// Builds the scratch space of `mode`.
pub fn new_scratch(
    mode: ScratchMode,
    nr_buffers: usize,
    buffer_bytes: usize,
) -> Result<Box<dyn Scratch>> {
    if nr_buffers == 0 || buffer_bytes == 0 || buffer_bytes % PIECE_BYTES != 0 {
        return Err(Error::invalid(format!(
            "GC scratch of {nr_buffers} buffers of {buffer_bytes} bytes: need at least one \
             buffer of a non-zero multiple of {PIECE_BYTES} bytes"
        )));
    }
    Ok(match mode {
        ScratchMode::Ring => Box::new(ScratchRing::new(nr_buffers, buffer_bytes)?),
        ScratchMode::Bank => Box::new(ScratchBank::new(buffer_bytes)?),
    })
}

fn pieces(n: usize) -> Result<Vec<Option<AlignedBuf>>> {
    (0..n)
        .map(|_| AlignedBuf::new_zeroed(PIECE_BYTES).map(Some))
        .collect()
}

fn take(slots: &mut [Option<AlignedBuf>], start: usize, count: usize) -> Vec<AlignedBuf> {
    let n = slots.len();
    (0..count)
        .map(|i| {
            slots[(start + i) % n]
                .take()
                .expect("reserved piece is in place")
        })
        .collect()
}

fn put(slots: &mut [Option<AlignedBuf>], span: Span, pieces: Vec<AlignedBuf>) {
    assert_eq!(pieces.len(), span.count, "pieces returned for {span:?}");
    let n = slots.len();
    for (i, p) in pieces.into_iter().enumerate() {
        let slot = &mut slots[(span.start + i) % n];
        assert!(
            slot.is_none(),
            "piece {} returned twice",
            (span.start + i) % n
        );
        *slot = Some(p);
    }
}

/// The ring; see the module docs.
#[derive(Debug)]
pub struct ScratchRing {
    slots: Vec<Option<AlignedBuf>>,
    /// Next piece to reserve.
    head: usize,
    /// Oldest piece not yet free.
    tail: usize,
    /// Pieces free for reservation: `[head, tail)` in ring order, explicit because
    /// `head == tail` is both "empty" and "full".
    free: usize,
    /// Outstanding reservations in order, with whether their write has completed.
    outstanding: VecDeque<(Span, bool)>,
}

impl ScratchRing {
    /// A ring over `nr_buffers` buffers of `buffer_bytes`.
    pub fn new(nr_buffers: usize, buffer_bytes: usize) -> Result<ScratchRing> {
        let n = nr_buffers * buffer_bytes / PIECE_BYTES;
        Ok(ScratchRing {
            slots: pieces(n)?,
            head: 0,
            tail: 0,
            free: n,
            outstanding: VecDeque::new(),
        })
    }

    /// `(head, tail)` piece indices, for tests.
    pub fn head_tail(&self) -> (usize, usize) {
        (self.head, self.tail)
    }
}

impl Scratch for ScratchRing {
    fn capacity_bytes(&self) -> usize {
        self.slots.len() * PIECE_BYTES
    }

    fn max_chunk_bytes(&self) -> usize {
        self.capacity_bytes()
    }

    fn reserve(&mut self, len_bytes: usize) -> Option<(Span, Vec<AlignedBuf>)> {
        assert!(len_bytes > 0 && len_bytes <= self.max_chunk_bytes());
        let count = len_bytes.div_ceil(PIECE_BYTES);
        if count > self.free {
            return None;
        }
        let span = Span {
            start: self.head,
            count,
        };
        let taken = take(&mut self.slots, self.head, count);
        self.head = (self.head + count) % self.slots.len();
        self.free -= count;
        self.outstanding.push_back((span, false));
        Some((span, taken))
    }

    fn complete(&mut self, span: Span, pieces: Vec<AlignedBuf>) {
        put(&mut self.slots, span, pieces);
        let entry = self
            .outstanding
            .iter_mut()
            .find(|(s, done)| *s == span && !done)
            .expect("completing a span that is not outstanding");
        entry.1 = true;
        // The tail moves over the completed prefix only.
        while let Some(&(s, true)) = self.outstanding.front() {
            debug_assert_eq!(s.start, self.tail);
            self.tail = (self.tail + s.count) % self.slots.len();
            self.free += s.count;
            self.outstanding.pop_front();
        }
    }

    fn free_bytes(&self) -> usize {
        self.free * PIECE_BYTES
    }

    fn grantable_bytes(&self, min_bytes: usize) -> usize {
        // Any free pieces will do: a chunk may span buffers and wrap.
        let free = self.free_bytes();
        if free >= min_bytes {
            free
        } else {
            0
        }
    }
}

/// Bank switching between two buffers; see the module docs.
#[derive(Debug)]
pub struct ScratchBank {
    slots: Vec<Option<AlignedBuf>>,
    pieces_per_bank: usize,
    /// The bank being filled.
    current: usize,
    /// Per bank: pieces handed out since it was last empty (`offset`) and pieces given back
    /// (`freed`); a bank is reusable from its start when `freed == offset`.
    offset: [usize; 2],
    freed: [usize; 2],
}

impl ScratchBank {
    /// Two banks of `buffer_bytes` each.
    pub fn new(buffer_bytes: usize) -> Result<ScratchBank> {
        let per = buffer_bytes / PIECE_BYTES;
        Ok(ScratchBank {
            slots: pieces(2 * per)?,
            pieces_per_bank: per,
            current: 0,
            offset: [0; 2],
            freed: [0; 2],
        })
    }
}

impl Scratch for ScratchBank {
    fn capacity_bytes(&self) -> usize {
        self.slots.len() * PIECE_BYTES
    }

    fn max_chunk_bytes(&self) -> usize {
        self.pieces_per_bank * PIECE_BYTES
    }

    fn reserve(&mut self, len_bytes: usize) -> Option<(Span, Vec<AlignedBuf>)> {
        assert!(len_bytes > 0 && len_bytes <= self.max_chunk_bytes());
        let count = len_bytes.div_ceil(PIECE_BYTES);
        let mut b = self.current;
        if self.offset[b] + count > self.pieces_per_bank {
            // Does not fit: switch to the other bank, usable only once fully written.
            let other = 1 - b;
            if self.freed[other] != self.offset[other] {
                return None;
            }
            self.offset[other] = 0;
            self.freed[other] = 0;
            self.current = other;
            b = other;
        }
        let span = Span {
            start: b * self.pieces_per_bank + self.offset[b],
            count,
        };
        self.offset[b] += count;
        Some((span, take(&mut self.slots, span.start, count)))
    }

    fn complete(&mut self, span: Span, pieces: Vec<AlignedBuf>) {
        put(&mut self.slots, span, pieces);
        let b = span.start / self.pieces_per_bank;
        self.freed[b] += span.count;
        assert!(self.freed[b] <= self.offset[b]);
        if b == self.current && self.freed[b] == self.offset[b] {
            // Everything in the current bank is written: refill it from its start.
            self.offset[b] = 0;
            self.freed[b] = 0;
        }
    }

    fn free_bytes(&self) -> usize {
        let cur = self.pieces_per_bank - self.offset[self.current];
        let other = 1 - self.current;
        let other_free = if self.freed[other] == self.offset[other] {
            self.pieces_per_bank
        } else {
            0
        };
        cur.max(other_free) * PIECE_BYTES
    }

    fn grantable_bytes(&self, min_bytes: usize) -> usize {
        // What is left of the current bank first (the old XFS code filled a bank exactly),
        // then the other bank if it is completely written.
        let cur = (self.pieces_per_bank - self.offset[self.current]) * PIECE_BYTES;
        let other = 1 - self.current;
        let bank = self.pieces_per_bank * PIECE_BYTES;
        if cur >= min_bytes {
            cur
        } else if self.freed[other] == self.offset[other] && bank >= min_bytes {
            bank
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(pieces: &mut [AlignedBuf], v: u8) {
        for p in pieces {
            p.fill(v);
        }
    }

    #[test]
    fn ring_full_versus_empty_is_explicit() {
        let mut r = ScratchRing::new(2, 4 * PIECE_BYTES).unwrap();
        assert_eq!(r.free_bytes(), 8 * PIECE_BYTES);
        assert_eq!(r.head_tail(), (0, 0));
        let (a, pa) = r.reserve(8 * PIECE_BYTES).unwrap();
        // Full: head == tail again, and nothing more fits.
        assert_eq!(r.head_tail(), (0, 0));
        assert_eq!(r.free_bytes(), 0);
        assert!(r.reserve(1).is_none());
        r.complete(a, pa);
        assert_eq!(r.head_tail(), (0, 0));
        assert_eq!(r.free_bytes(), 8 * PIECE_BYTES);
    }

    #[test]
    fn ring_spans_buffers_and_wraps_and_frees_in_order() {
        let mut r = ScratchRing::new(2, 4 * PIECE_BYTES).unwrap();
        let (a, mut pa) = r.reserve(3 * PIECE_BYTES).unwrap();
        let (b, mut pb) = r.reserve(3 * PIECE_BYTES - 100).unwrap(); // pieces 3..6: spans buffers
        assert_eq!(
            (a, b),
            (Span { start: 0, count: 3 }, Span { start: 3, count: 3 })
        );
        mark(&mut pa, 1);
        mark(&mut pb, 2);
        assert!(r.reserve(3 * PIECE_BYTES).is_none(), "only 2 pieces free");
        // b completes first: the tail cannot pass a, so nothing is freed yet.
        r.complete(b, pb);
        assert_eq!(r.free_bytes(), 2 * PIECE_BYTES);
        r.complete(a, pa);
        assert_eq!(r.free_bytes(), 8 * PIECE_BYTES);
        assert_eq!(r.head_tail(), (6, 6));
        // Wraps: pieces 6, 7, 0, 1, handed out with the bytes they were given back with.
        let (c, pc) = r.reserve(4 * PIECE_BYTES).unwrap();
        assert_eq!(c, Span { start: 6, count: 4 });
        assert_eq!(
            pc.iter().map(|p| p[0]).collect::<Vec<_>>(),
            [0, 0, 1, 1],
            "pieces 6 and 7 (never used), then a's pieces 0 and 1, in ring order"
        );
        assert_eq!(r.head_tail(), (2, 6));
        r.complete(c, pc);
        assert_eq!(r.free_bytes(), 8 * PIECE_BYTES);
    }

    #[test]
    fn bank_waits_for_the_whole_other_bank() {
        let mut s = ScratchBank::new(4 * PIECE_BYTES).unwrap();
        assert_eq!(s.max_chunk_bytes(), 4 * PIECE_BYTES);
        let (a, pa) = s.reserve(3 * PIECE_BYTES).unwrap();
        // Does not fit in bank 0's last piece: switches to bank 1.
        let (b, pb) = s.reserve(2 * PIECE_BYTES).unwrap();
        assert_eq!(b.start, 4);
        let (c, pc) = s.reserve(2 * PIECE_BYTES).unwrap();
        assert_eq!(c.start, 6);
        // Bank 1 is full and bank 0 still has a's chunk outstanding: no room, though the ring
        // would have had 1 piece... and after b completes, still none (bank 1 not fully written).
        assert!(s.reserve(PIECE_BYTES).is_none());
        s.complete(b, pb);
        assert!(s.reserve(PIECE_BYTES).is_none());
        s.complete(a, pa);
        let (d, pd) = s.reserve(4 * PIECE_BYTES).unwrap();
        assert_eq!(
            d.start, 0,
            "bank 0, fully written, is reused from its start"
        );
        s.complete(c, pc);
        s.complete(d, pd);
        assert_eq!(s.free_bytes(), 4 * PIECE_BYTES);
    }

    #[test]
    fn grantable_fills_what_each_design_has() {
        let mut s = ScratchBank::new(4 * PIECE_BYTES).unwrap();
        let (a, pa) = s.reserve(3 * PIECE_BYTES).unwrap();
        // The bank's last piece first; a larger chunk needs the other bank.
        assert_eq!(s.grantable_bytes(PIECE_BYTES), PIECE_BYTES);
        assert_eq!(s.grantable_bytes(2 * PIECE_BYTES), 4 * PIECE_BYTES);
        let (b, pb) = s.reserve(4 * PIECE_BYTES).unwrap();
        assert_eq!(b.start, 4);
        // Bank 1 full, bank 0 not written yet: nothing.
        assert_eq!(s.grantable_bytes(PIECE_BYTES), 0);
        s.complete(a, pa);
        assert_eq!(s.grantable_bytes(PIECE_BYTES), 4 * PIECE_BYTES);
        assert_eq!(s.grantable_bytes(5 * PIECE_BYTES), 0);
        s.complete(b, pb);

        let mut r = ScratchRing::new(2, 2 * PIECE_BYTES).unwrap();
        let (a, pa) = r.reserve(3 * PIECE_BYTES).unwrap();
        let (b, pb) = r.reserve(PIECE_BYTES).unwrap();
        assert_eq!(r.grantable_bytes(PIECE_BYTES), 0);
        r.complete(a, pa);
        // a's three pieces are free at once, though b is still out (a bank would wait for b).
        assert_eq!(r.grantable_bytes(PIECE_BYTES), 3 * PIECE_BYTES);
        assert_eq!(r.grantable_bytes(4 * PIECE_BYTES), 0);
        r.complete(b, pb);
    }

    #[test]
    #[should_panic(expected = "returned twice")]
    fn pieces_cannot_come_back_twice() {
        let mut r = ScratchRing::new(1, 2 * PIECE_BYTES).unwrap();
        let (a, pa) = r.reserve(PIECE_BYTES).unwrap();
        let fake = vec![AlignedBuf::new_zeroed(PIECE_BYTES).unwrap()];
        r.complete(a, pa);
        r.complete(a, fake);
    }

    #[test]
    fn bad_sizes_are_einval() {
        assert!(new_scratch(ScratchMode::Ring, 0, 1 << 20).is_err());
        assert!(new_scratch(ScratchMode::Ring, 2, 1000).is_err());
        assert!(new_scratch(ScratchMode::Bank, 2, 0).is_err());
    }
}
