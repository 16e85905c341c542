//! A store's codecs (zram's `zram->comps[]`): the primary codec at priority 0 and up to three
//! recompression codecs at 1..=3 (`recomp_algorithm`), each recompression priority with
//! **dictionary generations**.
//!
//! A slot records the codec that wrote it as a [`codec_id`]: its priority and, for a
//! recompression priority, a generation 0..=7. Generation 0 of a priority is the codec
//! `disksize` built (with the dictionary `algorithm_params dict=` gave it, or none);
//! `train_dict` installs a new codec (a trained dictionary) as a new generation, which becomes
//! the priority's **current** one: recompression compresses with the current generation only,
//! and every read decompresses with the generation its slot names.
//!
//! # Invariants
//! - The primary codec never changes while the store lives.
//! - `live[p][g]` counts the slots (in RAM or written back) whose codec id is `(p, g)`: raised
//!   when recompression publishes a slot with it, lowered when the slot is released or
//!   recompressed again ([`Codecs::acquire`], [`Codecs::release`], both under the slot's
//!   lock). So a generation some slot names is never freed.
//! - A generation that is not current is dropped when its count reaches 0 (its dictionary's
//!   memory goes back), and its index can then be reused by a later `train_dict`. The current
//!   generation is kept even with no slot.
//! - A new generation is installed only under the device's `pp_lock` (no recompression runs
//!   meanwhile), so recompression never publishes a slot with a generation that stopped being
//!   current under it.
//!
//! # Locks
//! Each recompression priority's table is behind an `RwLock`: reads and recompression take it
//! shared for a moment to clone the codec's `Arc`; installing a generation and dropping a
//! released one take it exclusive. It is a leaf, taken under slot locks or none.

use crate::compress::{Codec, CodecParams, MAX_COMPS};
use crate::error::{Error, Result};
use crate::slot::{codec_id, MAX_GENS};
use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A codec borrowed for one call: the primary by reference (no shared counter touched on the
/// hot path), a recompression generation by `Arc` (it may be dropped meanwhile).
pub(crate) enum CodecRef<'a> {
    /// The primary codec.
    Primary(&'a (dyn Codec + 'static)),
    /// A recompression codec's generation.
    Gen(Arc<dyn Codec>),
}

impl std::ops::Deref for CodecRef<'_> {
    type Target = dyn Codec;
    fn deref(&self) -> &Self::Target {
        match self {
            CodecRef::Primary(c) => *c,
            CodecRef::Gen(c) => c.as_ref(),
        }
    }
}

/// One recompression priority: its generations.
#[derive(Debug)]
struct Generations {
    /// The algorithm's name (fixed: a new generation is the same algorithm).
    name: &'static str,
    /// The parameters of generation 0 (level; a trained generation takes the level unless
    /// `train_dict` gives one).
    params: CodecParams,
    table: RwLock<GenTable>,
    /// Slots naming each generation. See the module docs.
    live: [AtomicU64; MAX_GENS],
}

#[derive(Debug)]
struct GenTable {
    codecs: [Option<Arc<dyn Codec>>; MAX_GENS],
    /// Dictionary bytes of each generation (0 without one).
    dict_bytes: [usize; MAX_GENS],
    current: u8,
}

/// What one priority holds (`dict_stat`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenStat {
    /// The generation recompression uses.
    pub current: u8,
    /// Every generation held: (generation, slots naming it, dictionary bytes).
    pub held: Vec<(u8, u64, usize)>,
}

/// The codecs of one store. See the module docs.
#[derive(Debug)]
pub(crate) struct Codecs {
    primary: Box<dyn Codec>,
    secondary: [Option<Generations>; MAX_COMPS],
}

impl Codecs {
    /// The primary codec and the recompression codecs of priorities 1..=3 with their
    /// parameters (`secondary[0]` is ignored: priority 0 is always `primary`), each as
    /// generation 0.
    pub(crate) fn new(
        primary: Box<dyn Codec>,
        secondary: [Option<(Box<dyn Codec>, CodecParams)>; MAX_COMPS],
    ) -> Codecs {
        let [_, s1, s2, s3] = secondary;
        let gens = |s: Option<(Box<dyn Codec>, CodecParams)>| {
            s.map(|(codec, params)| {
                let mut codecs: [Option<Arc<dyn Codec>>; MAX_GENS] = Default::default();
                let mut dict_bytes = [0; MAX_GENS];
                dict_bytes[0] = params.dict.as_ref().map_or(0, |d| d.len_bytes());
                let name = codec.name();
                codecs[0] = Some(Arc::from(codec));
                Generations {
                    name,
                    params,
                    table: RwLock::new(GenTable {
                        codecs,
                        dict_bytes,
                        current: 0,
                    }),
                    live: Default::default(),
                }
            })
        };
        Codecs {
            primary,
            secondary: [None, gens(s1), gens(s2), gens(s3)],
        }
    }

    /// The primary codec: every write compresses with it.
    pub(crate) fn primary(&self) -> &dyn Codec {
        self.primary.as_ref()
    }

    /// The algorithm of priority `prio`, if one is configured.
    pub(crate) fn name(&self, prio: usize) -> Option<&'static str> {
        match prio {
            0 => Some(self.primary.name()),
            p => Some(self.secondary.get(p)?.as_ref()?.name),
        }
    }

    /// The parameters priority `prio` (1..=3) was configured with.
    pub(crate) fn params(&self, prio: usize) -> Option<&CodecParams> {
        Some(&self.secondary.get(prio)?.as_ref()?.params)
    }

    /// The codec a slot's codec id names; `EIO` if none (a slot this store did not write).
    pub(crate) fn get(&self, codec: u8) -> Result<CodecRef<'_>> {
        let (prio, gen) = (usize::from(codec & 0b11), usize::from(codec >> 2));
        if prio == 0 {
            return Ok(CodecRef::Primary(self.primary.as_ref()));
        }
        self.secondary[prio]
            .as_ref()
            .and_then(|g| g.table.read().codecs.get(gen)?.clone())
            .map(CodecRef::Gen)
            .ok_or_else(|| {
                Error::io(format!(
                    "no codec of priority {prio} generation {gen} for a stored object"
                ))
            })
    }

    /// The current generation of recompression priority `prio`: its codec id and codec.
    pub(crate) fn current(&self, prio: usize) -> Option<(u8, Arc<dyn Codec>)> {
        let g = self.secondary.get(prio)?.as_ref()?;
        let t = g.table.read();
        let codec = t.codecs[usize::from(t.current)].clone()?;
        Some((codec_id(prio as u8, t.current), codec))
    }

    /// The highest configured priority (0 with no recompression codec).
    pub(crate) fn highest(&self) -> usize {
        (1..MAX_COMPS)
            .rev()
            .find(|&p| self.secondary[p].is_some())
            .unwrap_or(0)
    }

    /// A slot now names `codec` (a recompression publishing it). Under the slot's lock.
    pub(crate) fn acquire(&self, codec: u8) {
        if let Some(g) = self.secondary_of(codec) {
            g.live[usize::from(codec >> 2)].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A slot no longer names `codec` (released, or recompressed again); drops the generation
    /// if it was the last slot and it is not current. Under the slot's lock.
    pub(crate) fn release(&self, codec: u8) {
        let Some(g) = self.secondary_of(codec) else {
            return;
        };
        let gen = usize::from(codec >> 2);
        let prev = g.live[gen].fetch_sub(1, Ordering::Relaxed);
        debug_assert!(prev > 0, "codec {codec} released more often than acquired");
        if prev == 1 {
            let mut t = g.table.write();
            // Nothing can raise a non-current generation's count, so 0 now is 0 for good.
            if usize::from(t.current) != gen && g.live[gen].load(Ordering::Relaxed) == 0 {
                t.codecs[gen] = None;
                t.dict_bytes[gen] = 0;
            }
        }
    }

    /// Installs `codec` (with a dictionary of `dict_bytes`) as the new current generation of
    /// priority `prio`; the old current one is dropped at once if no slot names it. Returns
    /// the new generation. `EBUSY` when all [`MAX_GENS`] generations are held by slots (rewrite
    /// or recompress the pages of old generations first); `EINVAL` for a priority without a
    /// recompression algorithm. The caller holds `pp_lock` (see the module docs).
    pub(crate) fn install(
        &self,
        prio: usize,
        codec: Box<dyn Codec>,
        dict_bytes: usize,
    ) -> Result<u8> {
        let g = self
            .secondary
            .get(prio)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                Error::invalid(format!("no recompression algorithm at priority {prio}"))
            })?;
        let mut t = g.table.write();
        let cur = usize::from(t.current);
        let free = (0..MAX_GENS)
            .find(|&i| i != cur && t.codecs[i].is_none())
            .ok_or_else(|| {
                Error::busy(format!(
                    "priority {prio} holds {MAX_GENS} dictionary generations, each still used \
                     by pages: rewrite or recompress them first"
                ))
            })?;
        t.codecs[free] = Some(Arc::from(codec));
        t.dict_bytes[free] = dict_bytes;
        t.current = free as u8;
        if g.live[cur].load(Ordering::Relaxed) == 0 {
            t.codecs[cur] = None;
            t.dict_bytes[cur] = 0;
        }
        Ok(free as u8)
    }

    /// What priority `prio` holds.
    pub(crate) fn gen_stat(&self, prio: usize) -> Option<GenStat> {
        let g = self.secondary.get(prio)?.as_ref()?;
        let t = g.table.read();
        let held = (0..MAX_GENS)
            .filter(|&i| t.codecs[i].is_some())
            .map(|i| (i as u8, g.live[i].load(Ordering::Relaxed), t.dict_bytes[i]))
            .collect();
        Some(GenStat {
            current: t.current,
            held,
        })
    }

    /// The generations of the recompression priority `codec` names (none for the primary).
    fn secondary_of(&self, codec: u8) -> Option<&Generations> {
        match codec & 0b11 {
            0 => None,
            p => self.secondary[usize::from(p)].as_ref(),
        }
    }
}
