//! A store's codecs by priority (zram's `zram->comps[]`): the primary codec at priority 0 and
//! up to three recompression codecs at 1..=3 (`recomp_algorithm`).
//!
//! Invariant: the set is fixed when the store is built (`disksize`) and never changes while it
//! lives, so a slot's two priority bits always name a codec here: a slot gets priority `p > 0`
//! only from recompression with the codec at `p`. Reads decompress with the codec of the slot's
//! priority.

use crate::compress::{Codec, MAX_COMPS};
use crate::error::{Error, Result};

/// The codecs of one store, by priority. See the module docs.
#[derive(Debug)]
pub(crate) struct Codecs {
    by_prio: [Option<Box<dyn Codec>>; MAX_COMPS],
}

impl Codecs {
    /// The primary codec and the recompression codecs of priorities 1..=3 (`secondary[0]`
    /// is ignored: priority 0 is always `primary`).
    pub(crate) fn new(
        primary: Box<dyn Codec>,
        secondary: [Option<Box<dyn Codec>>; MAX_COMPS],
    ) -> Codecs {
        let [_, s1, s2, s3] = secondary;
        Codecs {
            by_prio: [Some(primary), s1, s2, s3],
        }
    }

    /// The primary codec: every write compresses with it.
    pub(crate) fn primary(&self) -> &dyn Codec {
        self.by_prio[0]
            .as_deref()
            .expect("priority 0 is always set")
    }

    /// The codec of priority `prio`, if one is configured.
    pub(crate) fn at(&self, prio: usize) -> Option<&dyn Codec> {
        self.by_prio.get(prio)?.as_deref()
    }

    /// The codec of a slot's priority; `EIO` if none (a slot this store did not write).
    pub(crate) fn get(&self, prio: u8) -> Result<&dyn Codec> {
        self.at(usize::from(prio))
            .ok_or_else(|| Error::io(format!("no codec of priority {prio} for a stored object")))
    }

    /// The highest configured priority (0 with no recompression codec).
    pub(crate) fn highest(&self) -> usize {
        (0..MAX_COMPS)
            .rev()
            .find(|&p| self.by_prio[p].is_some())
            .unwrap_or(0)
    }
}
