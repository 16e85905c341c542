//! What a frame holds, as its record says (`page_alloc::FrameRecord`): the link from a location
//! word to memory that a new process can follow (`docs/restart.md`).
//!
//! A location word names a zspage by its class (from the size) and its id within the class,
//! or a span by its id; the descriptors that map those ids to frames are volatile. Each frame's
//! record names the zspage or span it holds, so recovery rebuilds the descriptors from the
//! records, in one pass over the frames.
//!
//! # Encoding
//!
//! `what` (0: the frame holds nothing, whatever `extra` says: a write stores `extra` before
//! `what` and a clear `what` before `extra`, so a process stopped between the two leaves a
//! stale `extra` under a zero `what`):
//!
//! | bits | zspage | span |
//! |---|---|---|
//! | 62..=63 | `0b10` | `0b01` |
//! | 48..=61 | pool tag | pool tag |
//! | 32..=47 | class (position in the pool's class list) | whole pages |
//! | 0..=31 | zspage id | span id |
//!
//! The *pool tag* says which pool the frame's zspage or span belongs to when several pools
//! take frames from one allocator (the swap reserve: `crate::memory`): 1 to [`MAX_POOL_TAG`],
//! unique among the allocator's live pools, recorded in each device's header. A pool with
//! frames of its own has tag 0.
//!
//! `extra`: a span's tail handle (`Handle::to_raw`, 0: none); 0 for a zspage.
//!
//! # When records change
//!
//! A zspage's record is written when its frame is attached and cleared when it is detached,
//! both under the class lock, so no two frames ever claim one (class, id): the id goes back to
//! the class's unused ids only after the record is cleared, under the same lock. A span's
//! record is written before its handle's location word is published and cleared, under the
//! span table's mutex, after the word is cleared. Either way a record is written before any
//! location word can name its frame, and a location word naming a frame is cleared (or moved)
//! before the record goes.

/// What a frame holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameUse {
    /// A zspage: class position and id within the class.
    Zspage { class: u32, id: u32 },
    /// A span: id, whole pages, tail handle (raw, 0: none).
    Span { id: u32, pages: u32, tail_raw: u64 },
}

/// The largest pool tag (14 bits).
pub(crate) const MAX_POOL_TAG: u16 = (1 << 14) - 1;
const POOL_SHIFT: u32 = 48;

const ZSPAGE: u64 = 0b10 << 62;
const SPAN: u64 = 0b01 << 62;
const KIND: u64 = 0b11 << 62;

impl FrameUse {
    /// The record's two words, for a frame of the pool tagged `pool`.
    pub(crate) fn encode(self, pool: u16) -> (u64, u64) {
        debug_assert!(pool <= MAX_POOL_TAG);
        let tag = u64::from(pool) << POOL_SHIFT;
        match self {
            FrameUse::Zspage { class, id } => {
                debug_assert!(class < 1 << 16);
                (ZSPAGE | tag | u64::from(class) << 32 | u64::from(id), 0)
            }
            FrameUse::Span {
                id,
                pages,
                tail_raw,
            } => {
                debug_assert!(pages < 1 << 16);
                (
                    SPAN | tag | u64::from(pages) << 32 | u64::from(id),
                    tail_raw,
                )
            }
        }
    }

    /// What the words say and the pool tag; `Ok(None)` for a frame holding nothing, `Err`
    /// for words no writer makes.
    pub(crate) fn decode(what: u64, extra: u64) -> Result<Option<(u16, FrameUse)>, String> {
        let field = ((what >> 32) & 0xffff) as u32;
        let pool = ((what >> POOL_SHIFT) & u64::from(MAX_POOL_TAG)) as u16;
        let id = what as u32;
        match what & KIND {
            0 if what == 0 => Ok(None),
            ZSPAGE if extra == 0 => Ok(Some((pool, FrameUse::Zspage { class: field, id }))),
            SPAN => Ok(Some((
                pool,
                FrameUse::Span {
                    id,
                    pages: field,
                    tail_raw: extra,
                },
            ))),
            _ => Err(format!("record {what:#x}/{extra:#x} is no zspage nor span")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_junk_is_refused() {
        for u in [
            FrameUse::Zspage { class: 0, id: 0 },
            FrameUse::Zspage {
                class: 122,
                id: u32::MAX >> 1,
            },
            FrameUse::Span {
                id: 5,
                pages: 16,
                tail_raw: 0,
            },
            FrameUse::Span {
                id: 7,
                pages: 3,
                tail_raw: 99,
            },
        ] {
            for pool in [0, 1, MAX_POOL_TAG] {
                let (w, e) = u.encode(pool);
                assert_eq!(FrameUse::decode(w, e), Ok(Some((pool, u))));
            }
        }
        assert_eq!(FrameUse::decode(0, 0), Ok(None));
        // A stop between a record's two stores: nothing, whatever `extra` holds.
        assert_eq!(FrameUse::decode(0, 5), Ok(None));
        assert!(FrameUse::decode(KIND, 0).is_err());
        assert!(FrameUse::decode(ZSPAGE, 3).is_err());
    }
}
