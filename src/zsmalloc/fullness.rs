//! Fullness groups: a class's zspages bucketed by the share of their slots in use.
//!
//! The kernel's groups since Linux 6.2 (`ZS_INUSE_RATIO_*`): group 0 holds empty zspages,
//! groups 1..=10 hold zspages whose in-use ratio is in `(0,10)%`, `[10,20)%`, ..., `[90,100)%`
//! (`ratio / 10 + 1`, so one object out of 127 is group 1, not 0), group 11 holds full ones.
//! Ten buckets are enough to pick "the fullest zspage with room" (malloc, compaction
//! destination) and "the sparsest" (compaction source) in O(1) without sorting; an empty zspage
//! never stays in a list (it is released at once), so group 0 stays empty.
//!
//! The lists live in the class state and are protected by the class lock. Removal is O(1):
//! each zspage id remembers its group and position, and a removal swaps the last entry in.

/// Number of groups.
pub(crate) const NR_GROUPS: usize = 12;
/// Group of empty zspages.
pub(crate) const GROUP_EMPTY: usize = 0;
/// Group of full zspages.
pub(crate) const GROUP_FULL: usize = NR_GROUPS - 1;

/// The group of a zspage with `inuse` of `objs` slots in use (the kernel's
/// `get_fullness_group()`).
pub(crate) fn group_of(inuse: usize, objs: usize) -> usize {
    if inuse == 0 {
        GROUP_EMPTY
    } else if inuse == objs {
        GROUP_FULL
    } else {
        100 * inuse / objs / 10 + 1
    }
}

const UNLINKED: (u8, u32) = (u8::MAX, u32::MAX);

/// Per-group lists of zspage ids.
#[derive(Debug, Default)]
pub(crate) struct FullnessLists {
    lists: [Vec<u32>; NR_GROUPS],
    /// Per zspage id: (group, position in that group's list), or `UNLINKED`.
    place: Vec<(u8, u32)>,
}

impl FullnessLists {
    /// The group `id` is linked in, if any.
    pub(crate) fn group(&self, id: u32) -> Option<usize> {
        match self.place.get(id as usize) {
            Some(&(g, _)) if (g as usize) < NR_GROUPS => Some(g as usize),
            _ => None,
        }
    }

    /// Heap bytes of the lists (their capacities).
    pub(crate) fn heap_bytes(&self) -> usize {
        let lists: usize = self.lists.iter().map(Vec::capacity).sum();
        lists * std::mem::size_of::<u32>()
            + self.place.capacity() * std::mem::size_of::<(u8, u32)>()
    }

    /// Links `id` (not linked now) into `group`.
    pub(crate) fn insert(&mut self, id: u32, group: usize) {
        assert!(self.group(id).is_none(), "zspage {id} linked twice");
        if self.place.len() <= id as usize {
            self.place.resize(id as usize + 1, UNLINKED);
        }
        let list = &mut self.lists[group];
        self.place[id as usize] = (group as u8, list.len() as u32);
        list.push(id);
    }

    /// Unlinks `id` (must be linked); returns its group.
    pub(crate) fn remove(&mut self, id: u32) -> usize {
        let (group, pos) = self.place[id as usize];
        assert!((group as usize) < NR_GROUPS, "zspage {id} not linked");
        let list = &mut self.lists[group as usize];
        list.swap_remove(pos as usize);
        if let Some(&moved) = list.get(pos as usize) {
            self.place[moved as usize].1 = pos;
        }
        self.place[id as usize] = UNLINKED;
        group as usize
    }

    /// Moves `id` (linked) to `group`, if it is elsewhere.
    pub(crate) fn set(&mut self, id: u32, group: usize) {
        if self.group(id) != Some(group) {
            self.remove(id);
            self.insert(id, group);
        }
    }

    /// Number of zspages in `group`.
    pub(crate) fn count(&self, group: usize) -> usize {
        self.lists[group].len()
    }

    /// The most recently linked zspage of the first non-empty group of `groups`, other than
    /// `except`.
    pub(crate) fn first_in(
        &self,
        groups: impl Iterator<Item = usize>,
        except: Option<u32>,
    ) -> Option<u32> {
        groups
            .flat_map(|g| self.lists[g].iter().rev().take(2))
            .copied()
            .find(|&id| Some(id) != except)
    }

    /// The fullest zspage with a free slot (malloc's and compaction's destination choice).
    pub(crate) fn fullest_with_room(&self, except: Option<u32>) -> Option<u32> {
        self.first_in((1..GROUP_FULL).rev(), except)
    }

    /// The sparsest non-empty zspage (compaction's source choice).
    pub(crate) fn sparsest(&self, except: Option<u32>) -> Option<u32> {
        self.first_in(1..GROUP_FULL, except)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_match_the_kernel() {
        assert_eq!(group_of(0, 127), GROUP_EMPTY);
        assert_eq!(group_of(1, 127), 1);
        assert_eq!(group_of(13, 127), 2);
        assert_eq!(group_of(126, 127), 10);
        assert_eq!(group_of(127, 127), GROUP_FULL);
        assert_eq!(group_of(1, 1), GROUP_FULL);
        assert_eq!(group_of(8, 9), 9);
    }

    #[test]
    fn insert_remove_set_keep_positions() {
        let mut f = FullnessLists::default();
        for id in 0..10 {
            f.insert(id, (id % 3) as usize + 1);
        }
        assert_eq!(f.count(1), 4);
        f.remove(0);
        f.remove(6);
        assert_eq!(f.count(1), 2);
        assert_eq!(f.group(0), None);
        assert_eq!(f.group(3), Some(1));
        f.set(3, 10);
        assert_eq!(f.fullest_with_room(None), Some(3));
        assert_eq!(f.fullest_with_room(Some(3)), Some(8));
        assert_eq!(f.sparsest(None), Some(9));
        for id in [1, 2, 3, 4, 5, 7, 8, 9] {
            f.remove(id);
        }
        assert_eq!(f.sparsest(None), None);
        assert!((0..NR_GROUPS).all(|g| f.count(g) == 0));
    }
}
