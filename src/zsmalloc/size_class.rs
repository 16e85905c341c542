//! The size-class table: which object sizes share a zspage layout.
//!
//! # Derivation (the kernel's `zs_create_pool()`, mm/zsmalloc.c)
//!
//! 1. **Candidate sizes.** `delta = page_size / 256` (the kernel's `PAGE_SIZE >> CLASS_BITS`,
//!    `CLASS_BITS = 8`): 16 bytes for 4 KiB pages, 64 for 16 KiB, 256 for 64 KiB. Candidate `i`
//!    has size `32 + i * delta`, clamped to the page size, for
//!    `i in 0..=ceil((page_size - 32) / delta)`: 255 candidates for 4 KiB pages, 257 for 16 KiB
//!    and 65536 (the last one is clamped to the page size). 32 bytes is the kernel's
//!    `ZS_MIN_ALLOC_SIZE` on 64-bit machines.
//! 2. **Chain length.** For each size pick `pages_per_zspage` in `1..=8` maximising the integer
//!    used percentage `(k*page - (k*page) % size) * 100 / (k*page)`; only a strictly greater
//!    percentage replaces the best so far, so the shortest chain wins ties. This is the rule of
//!    the kernel's `get_pages_per_zspage()` (which `calculate_zspage_chain_size()` replaced in
//!    Linux 6.3 by "least wasted bytes"; a test checks that our choice never wastes a larger
//!    percentage than that rule). `objs_per_zspage = k * page / size`.
//!    Zspages are at most 8 pages (`ZS_MAX_PAGES_PER_ZSPAGE` since 6.3) because a zspage
//!    occupies one 8-page frame of reserved address space (see `page_alloc`).
//! 3. **Merging.** Walking from the largest candidate down, a candidate whose
//!    `(pages_per_zspage, objs_per_zspage)` equals the last class created is merged into it
//!    (the kernel's `can_merge()`): it would produce zspages with the same number of objects on
//!    the same number of pages, so the larger slot size costs nothing. A request of `s` bytes is
//!    served by the smallest candidate with size `>= s`, i.e. by the class that candidate was
//!    merged into.
//! 4. **Huge.** Candidates with one object on one page are *huge*; they all merge into the
//!    page-size class. The kernel's `huge_class_size` is the size of the largest non-huge class
//!    minus `ZS_HANDLE_SIZE - 1` because its objects carry an 8-byte handle inside the slot. Our
//!    handles live outside the objects (see `handle`), so the threshold is simply
//!    `largest non-huge class size + 1`: every object at least that big lands in a huge zspage
//!    and takes a whole page, so the device might as well store the page uncompressed. For
//!    4 KiB pages that is 3633 (the kernel's 3625 + 8).
//!
//! Resulting facts (guarded by tests):
//!
//! | page size | candidates | merged classes | largest non-huge class      | huge from |
//! |-----------|------------|----------------|-----------------------------|-----------|
//! | 4096      | 255        | 123            | 3632 B, 8 pages, 9 objects  | 3633 B    |
//! | 16384     | 257        | 123            | 14560 B, 8 pages, 9 objects | 14561 B   |
//! | 65536     | 257        | 123            | 58144 B, 8 pages, 9 objects | 58145 B   |
//!
//! (With the 6.3 "least wasted bytes" rule the counts would be 119, 121 and 123 classes and the
//! huge thresholds the same.)

/// Smallest class size (the kernel's `ZS_MIN_ALLOC_SIZE` on 64-bit machines).
pub const MIN_ALLOC_SIZE_BYTES: usize = 32;
/// Longest zspage chain (the kernel's `ZS_MAX_PAGES_PER_ZSPAGE`).
pub const MAX_PAGES_PER_ZSPAGE: usize = 8;
/// `delta = page_size >> CLASS_BITS`.
const CLASS_BITS: u32 = 8;
/// Page sizes the pool supports (the kernel's common `PAGE_SIZE`s): the device's.
pub use crate::units::SUPPORTED_PAGE_SIZES_BYTES;

/// Number of merged classes for 4 KiB pages.
#[cfg(test)]
const CLASSES_4K: usize = 123;
/// Number of merged classes for 16 KiB pages.
#[cfg(test)]
const CLASSES_16K: usize = 123;
/// Number of merged classes for 64 KiB pages.
#[cfg(test)]
const CLASSES_64K: usize = 123;

/// One (merged) size class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassInfo {
    /// Candidate index (the kernel's `class->index`): the largest candidate merged here.
    pub index: usize,
    /// Slot size: every object of this class occupies this many bytes of its zspage.
    pub size_bytes: usize,
    /// Pages in one zspage of this class.
    pub pages_per_zspage: usize,
    /// Objects in one zspage of this class.
    pub objs_per_zspage: usize,
}

impl ClassInfo {
    /// One object on one page: the object is (nearly) page-sized.
    pub fn is_huge(&self) -> bool {
        self.pages_per_zspage == 1 && self.objs_per_zspage == 1
    }
}

/// Integer percentage of a `pages`-page zspage that objects of `size_bytes` use.
pub(crate) fn used_percent(size_bytes: usize, pages: usize, page_size_bytes: usize) -> usize {
    let zspage_bytes = pages * page_size_bytes;
    let waste_bytes = zspage_bytes % size_bytes;
    (zspage_bytes - waste_bytes) * 100 / zspage_bytes
}

/// Chain length for `size_bytes`: the `k in 1..=8` with the highest integer used percentage,
/// the smallest `k` on ties.
pub(crate) fn chain_size_pages(size_bytes: usize, page_size_bytes: usize) -> usize {
    let mut best_pages = 1;
    let mut best_percent = 0;
    for pages in 1..=MAX_PAGES_PER_ZSPAGE {
        let percent = used_percent(size_bytes, pages, page_size_bytes);
        if percent > best_percent {
            best_percent = percent;
            best_pages = pages;
        }
    }
    best_pages
}

/// The size classes of one page size, merged, with an O(1) size lookup.
#[derive(Debug, Clone)]
pub struct ClassTable {
    page_size_bytes: usize,
    delta_bytes: usize,
    /// Merged classes, ascending by size.
    classes: Vec<ClassInfo>,
    /// Candidate index -> position in `classes`.
    lookup: Vec<u16>,
    huge_class_size_bytes: usize,
}

impl ClassTable {
    /// Builds the table for `page_size_bytes` (a power of two, at least 4096).
    pub fn new(page_size_bytes: usize) -> ClassTable {
        assert!(page_size_bytes.is_power_of_two() && page_size_bytes >= 4096);
        let delta_bytes = page_size_bytes >> CLASS_BITS;
        let candidates = (page_size_bytes - MIN_ALLOC_SIZE_BYTES).div_ceil(delta_bytes) + 1;
        // Walk from the largest candidate down, merging into the last class created.
        let mut descending: Vec<ClassInfo> = Vec::new();
        let mut candidate_to_desc = vec![0usize; candidates];
        for index in (0..candidates).rev() {
            let size_bytes = (MIN_ALLOC_SIZE_BYTES + index * delta_bytes).min(page_size_bytes);
            let pages_per_zspage = chain_size_pages(size_bytes, page_size_bytes);
            let objs_per_zspage = pages_per_zspage * page_size_bytes / size_bytes;
            match descending.last() {
                Some(prev)
                    if prev.pages_per_zspage == pages_per_zspage
                        && prev.objs_per_zspage == objs_per_zspage => {}
                _ => descending.push(ClassInfo {
                    index,
                    size_bytes,
                    pages_per_zspage,
                    objs_per_zspage,
                }),
            }
            candidate_to_desc[index] = descending.len() - 1;
        }
        let n = descending.len();
        let lookup = candidate_to_desc
            .iter()
            .map(|&d| u16::try_from(n - 1 - d).expect("fewer than 65536 classes"))
            .collect();
        descending.reverse();
        let classes = descending;
        let huge_class_size_bytes = classes
            .iter()
            .rev()
            .find(|c| !c.is_huge())
            .map_or(MIN_ALLOC_SIZE_BYTES, |c| c.size_bytes + 1);
        ClassTable {
            page_size_bytes,
            delta_bytes,
            classes,
            lookup,
            huge_class_size_bytes,
        }
    }

    /// The page size the table was built for.
    pub fn page_size_bytes(&self) -> usize {
        self.page_size_bytes
    }

    /// Distance between candidate sizes (`page_size / 256`).
    pub fn delta_bytes(&self) -> usize {
        self.delta_bytes
    }

    /// The merged classes, ascending by size.
    pub fn classes(&self) -> &[ClassInfo] {
        &self.classes
    }

    /// Number of candidate sizes before merging (the kernel's `ZS_SIZE_CLASSES`).
    pub fn candidates(&self) -> usize {
        self.lookup.len()
    }

    /// Position (in [`classes`](Self::classes)) of the class serving `size_bytes`
    /// (`1..=page_size`).
    pub fn class_of(&self, size_bytes: usize) -> usize {
        debug_assert!(size_bytes >= 1 && size_bytes <= self.page_size_bytes);
        let candidate = if size_bytes <= MIN_ALLOC_SIZE_BYTES {
            0
        } else {
            (size_bytes - MIN_ALLOC_SIZE_BYTES).div_ceil(self.delta_bytes)
        };
        self.lookup[candidate.min(self.lookup.len() - 1)] as usize
    }

    /// Smallest object size served by a huge (one page, one object) zspage.
    pub fn huge_class_size_bytes(&self) -> usize {
        self.huge_class_size_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chain length Linux >= 6.3 picks (`calculate_zspage_chain_size()`): least wasted bytes,
    /// shortest chain on ties, one page for powers of two. Written from the algorithm, for
    /// comparison only.
    fn kernel_chain_size_pages(size_bytes: usize, page_size_bytes: usize) -> usize {
        if size_bytes.is_power_of_two() {
            return 1;
        }
        let mut best_pages = 1;
        let mut min_waste = usize::MAX;
        for pages in 1..=MAX_PAGES_PER_ZSPAGE {
            let waste = (pages * page_size_bytes) % size_bytes;
            if waste < min_waste {
                min_waste = waste;
                best_pages = pages;
            }
        }
        best_pages
    }

    fn tables() -> Vec<ClassTable> {
        SUPPORTED_PAGE_SIZES_BYTES
            .iter()
            .map(|&p| ClassTable::new(p))
            .collect()
    }

    #[test]
    fn facts_per_page_size() {
        let facts = [
            (4096, 255, CLASSES_4K, 3633),
            (16384, 257, CLASSES_16K, 14561),
            (65536, 257, CLASSES_64K, 58145),
        ];
        for (page, candidates, classes, huge) in facts {
            let t = ClassTable::new(page);
            assert_eq!(t.candidates(), candidates, "page {page}");
            assert_eq!(t.classes().len(), classes, "page {page}");
            assert_eq!(t.huge_class_size_bytes(), huge, "page {page}");
        }
    }

    /// The same table built with the 6.3 chain rule has fewer classes (documented numbers).
    #[test]
    fn kernel_6_3_rule_class_counts() {
        for (page, classes) in [(4096, 119), (16384, 121), (65536, 123)] {
            let delta = page >> CLASS_BITS;
            let candidates = (page - MIN_ALLOC_SIZE_BYTES).div_ceil(delta) + 1;
            let mut layouts: Vec<(usize, usize)> = Vec::new();
            for i in (0..candidates).rev() {
                let size = (MIN_ALLOC_SIZE_BYTES + i * delta).min(page);
                let pages = kernel_chain_size_pages(size, page);
                let layout = (pages, pages * page / size);
                if layouts.last() != Some(&layout) {
                    layouts.push(layout);
                }
            }
            assert_eq!(layouts.len(), classes, "page {page}");
        }
    }

    #[test]
    fn sizes_monotone_and_end_at_page_size() {
        for t in tables() {
            let c = t.classes();
            assert!(c[0].size_bytes >= MIN_ALLOC_SIZE_BYTES);
            for w in c.windows(2) {
                assert!(w[0].size_bytes < w[1].size_bytes);
                assert!(w[0].index < w[1].index);
            }
            let last = c.last().unwrap();
            assert_eq!(last.size_bytes, t.page_size_bytes());
            assert!(last.is_huge());
            assert_eq!(last.index, t.candidates() - 1);
        }
    }

    #[test]
    fn merged_classes_are_well_formed() {
        for t in tables() {
            let p = t.page_size_bytes();
            let c = t.classes();
            for (i, class) in c.iter().enumerate() {
                assert!((1..=MAX_PAGES_PER_ZSPAGE).contains(&class.pages_per_zspage));
                assert_eq!(
                    class.objs_per_zspage,
                    class.pages_per_zspage * p / class.size_bytes
                );
                assert_eq!(
                    class.pages_per_zspage,
                    chain_size_pages(class.size_bytes, p)
                );
                if i > 0 {
                    let prev = c[i - 1];
                    assert!(
                        (prev.pages_per_zspage, prev.objs_per_zspage)
                            != (class.pages_per_zspage, class.objs_per_zspage),
                        "adjacent classes {prev:?} {class:?} should have merged"
                    );
                }
            }
            // Every candidate merged into a class shares that class's layout.
            for cand in 0..t.candidates() {
                let size = (MIN_ALLOC_SIZE_BYTES + cand * t.delta_bytes()).min(p);
                let class = c[t.lookup[cand] as usize];
                let pages = chain_size_pages(size, p);
                assert_eq!(pages, class.pages_per_zspage, "candidate {size}");
                assert_eq!(pages * p / size, class.objs_per_zspage, "candidate {size}");
                assert!(class.size_bytes >= size);
            }
            // Exactly one huge class, the last.
            assert_eq!(c.iter().filter(|c| c.is_huge()).count(), 1);
        }
    }

    #[test]
    fn every_size_maps_to_the_smallest_fitting_class() {
        for t in tables() {
            let c = t.classes();
            for size in 1..=t.page_size_bytes() {
                let i = t.class_of(size);
                assert!(c[i].size_bytes >= size, "size {size}");
                if i > 0 {
                    assert!(
                        c[i - 1].size_bytes < size,
                        "size {size} not in smallest class"
                    );
                }
                let huge = c[i].is_huge();
                assert_eq!(huge, size >= t.huge_class_size_bytes(), "size {size}");
            }
        }
    }

    #[test]
    fn chain_choice_is_optimal_and_never_worse_than_the_kernel() {
        for t in tables() {
            let p = t.page_size_bytes();
            for cand in 0..t.candidates() {
                let size = (MIN_ALLOC_SIZE_BYTES + cand * t.delta_bytes()).min(p);
                let chosen = chain_size_pages(size, p);
                let best = used_percent(size, chosen, p);
                for k in 1..=MAX_PAGES_PER_ZSPAGE {
                    let pc = used_percent(size, k, p);
                    assert!(pc <= best, "size {size}: {k} pages beat {chosen}");
                    if k < chosen {
                        assert!(pc < best, "size {size}: tie must pick the shorter chain");
                    }
                }
                let kernel = kernel_chain_size_pages(size, p);
                assert!(
                    used_percent(size, kernel, p) <= best,
                    "size {size}: kernel's {kernel} pages waste less than our {chosen}"
                );
            }
        }
    }

    #[test]
    fn known_4k_classes() {
        let t = ClassTable::new(4096);
        let find = |size| *t.classes().iter().find(|c| c.size_bytes == size).unwrap();
        // 3632 * 9 = 32688 of 32768 bytes: 99 % used on 8 pages.
        assert_eq!(find(3632).pages_per_zspage, 8);
        assert_eq!(find(3632).objs_per_zspage, 9);
        assert_eq!(t.classes()[t.class_of(3633)].size_bytes, 4096);
        assert_eq!(find(32).objs_per_zspage, 128);
        assert_eq!(t.class_of(1), 0);
        assert_eq!(t.class_of(32), 0);
    }
}
