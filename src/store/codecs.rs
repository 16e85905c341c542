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
//! - A new generation is saved (its dictionary written to the device's files by the closure
//!   [`Codecs::install`] takes) before it becomes current, so no slot names a generation the
//!   next process cannot find (`docs/restart.md`).
//!
//! # Recovery
//! [`Codecs::recovered`] builds the codecs a previous process left (the generations its
//! dictionary records hold, which one was current, and why a generation whose record is
//! unusable is missing); the store's recovery then counts every slot's generation
//! ([`Codecs::acquire`]) and [`Codecs::finish_recovery`] drops the generations no slot names,
//! as [`Codecs::release`] would have.
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
    /// Recovering: why a generation is missing (its saved record torn, say), for the error
    /// naming a slot that names it; cleared by [`Codecs::finish_recovery`].
    lost: [Option<Box<str>>; MAX_GENS],
}

/// One recompression priority's generations as a previous process left them, for
/// [`Codecs::recovered`].
#[derive(Debug)]
pub(crate) struct SavedGens {
    /// The parameters the priority was configured with at `disksize` (generation 0's).
    pub(crate) params: CodecParams,
    /// Each generation whose record was read: its codec and dictionary bytes.
    pub(crate) gens: [Option<(Box<dyn Codec>, usize)>; MAX_GENS],
    /// The current generation (one of `gens`).
    pub(crate) current: u8,
    /// Why a generation is missing from `gens`, where something was found in its place.
    pub(crate) lost: [Option<String>; MAX_GENS],
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
        Codecs::recovered(
            primary,
            secondary.map(|s| {
                s.map(|(codec, params)| {
                    let mut gens: [Option<(Box<dyn Codec>, usize)>; MAX_GENS] = Default::default();
                    gens[0] = Some((codec, params.dict.as_ref().map_or(0, |d| d.len_bytes())));
                    SavedGens {
                        params,
                        gens,
                        current: 0,
                        lost: Default::default(),
                    }
                })
            }),
        )
    }

    /// The codecs a previous process left: the primary and, for priorities 1..=3
    /// (`secondary[0]` is ignored), the generations it held. The caller checked that each
    /// priority's current generation is in its `gens`. Slots are counted by the store's
    /// recovery, then [`finish_recovery`](Self::finish_recovery).
    pub(crate) fn recovered(
        primary: Box<dyn Codec>,
        secondary: [Option<SavedGens>; MAX_COMPS],
    ) -> Codecs {
        let [_, s1, s2, s3] = secondary;
        let gens = |s: Option<SavedGens>| {
            s.map(|saved| {
                let mut codecs: [Option<Arc<dyn Codec>>; MAX_GENS] = Default::default();
                let mut dict_bytes = [0; MAX_GENS];
                let mut name = "";
                for (i, g) in saved.gens.into_iter().enumerate() {
                    if let Some((codec, bytes)) = g {
                        name = codec.name();
                        codecs[i] = Some(Arc::from(codec));
                        dict_bytes[i] = bytes;
                    }
                }
                debug_assert!(codecs[usize::from(saved.current)].is_some());
                Generations {
                    name,
                    params: saved.params,
                    table: RwLock::new(GenTable {
                        codecs,
                        dict_bytes,
                        current: saved.current,
                        lost: saved.lost.map(|w| w.map(String::into_boxed_str)),
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

    /// Ends a recovery once every slot was counted: drops each generation no slot names
    /// (but the current ones), as [`release`](Self::release) would have when its last slot
    /// let go, and forgets why missing generations were missing.
    pub(crate) fn finish_recovery(&self) {
        for g in self.secondary.iter().flatten() {
            let mut t = g.table.write();
            for i in 0..MAX_GENS {
                if usize::from(t.current) != i && g.live[i].load(Ordering::Relaxed) == 0 {
                    t.codecs[i] = None;
                    t.dict_bytes[i] = 0;
                }
            }
            t.lost = Default::default();
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
        let Some(g) = self.secondary[prio].as_ref() else {
            return Err(Error::io(format!(
                "no codec of priority {prio} generation {gen} for a stored object"
            )));
        };
        let t = g.table.read();
        if let Some(codec) = t.codecs.get(gen).and_then(Clone::clone) {
            return Ok(CodecRef::Gen(codec));
        }
        Err(Error::io(
            match t.lost.get(gen).and_then(Option::as_deref) {
                Some(why) => {
                    format!("priority {prio}'s dictionary generation {gen} is lost: {why}")
                }
                None => format!("no codec of priority {prio} generation {gen} for a stored object"),
            },
        ))
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
    /// priority `prio`, once `save(generation)` has saved it (its dictionary complete in the
    /// device's files: an error from `save` installs nothing); the old current one is dropped
    /// at once if no slot names it. Returns the new generation. `EBUSY` when all [`MAX_GENS`]
    /// generations are held by slots (rewrite or recompress the pages of old generations
    /// first); `EINVAL` for a priority without a recompression algorithm. The caller holds
    /// `pp_lock` (see the module docs): no other install runs, so the free generation chosen
    /// before `save` (under the table's lock shared, released while saving, so reads go on)
    /// is still free after it (releases only free more).
    pub(crate) fn install(
        &self,
        prio: usize,
        codec: Box<dyn Codec>,
        dict_bytes: usize,
        save: impl FnOnce(u8) -> Result<()>,
    ) -> Result<u8> {
        let g = self
            .secondary
            .get(prio)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                Error::invalid(format!("no recompression algorithm at priority {prio}"))
            })?;
        let free = {
            let t = g.table.read();
            let cur = usize::from(t.current);
            (0..MAX_GENS)
                .find(|&i| i != cur && t.codecs[i].is_none())
                .ok_or_else(|| {
                    Error::busy(format!(
                        "priority {prio} holds {MAX_GENS} dictionary generations, each still \
                         used by pages: rewrite or recompress them first"
                    ))
                })?
        };
        save(free as u8)?;
        let mut t = g.table.write();
        let cur = usize::from(t.current);
        debug_assert!(
            free != cur && t.codecs[free].is_none(),
            "installs overlapped"
        );
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
