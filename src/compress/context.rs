//! Per-thread codec contexts: the one cache every codec with state (zstd's contexts, deflate's
//! streams) keeps its per-call state in, so the hot path allocates nothing per page.
//!
//! Each thread keeps its own contexts, created on first use and reused for every later page,
//! one per *level* (decompression, which has none, uses [`NO_LEVEL`]). Contexts are keyed by
//! level, not shared between levels, because a library sizes a context's workspace for the
//! parameters of the level (libzstd) or cannot change the level of one at all (miniz_oxide): a
//! thread alternating between the primary codec's level and a recompression level would
//! otherwise keep rebuilding one. A thread uses a handful of levels at most (the primary
//! codec's and the recompression codecs'), so the list is searched linearly.
//!
//! Invariant: a cache's `RefCell` is borrowed only for the duration of one `compress` or
//! `decompress` call, which never calls back into a codec, so the borrow cannot fail.

use std::cell::RefCell;
use std::thread::LocalKey;

use crate::error::Result;

/// The key of contexts that have no level (decompression).
pub(super) const NO_LEVEL: i32 = i32::MIN;

/// One thread's contexts of one kind, by level. Declared in a `thread_local!` by each codec.
#[derive(Debug)]
pub(super) struct ContextCache<T> {
    contexts: Vec<(i32, T)>,
}

impl<T> ContextCache<T> {
    /// An empty cache (`const`: a `thread_local!` initialiser).
    pub(super) const fn new() -> ContextCache<T> {
        ContextCache {
            contexts: Vec::new(),
        }
    }
}

/// Runs `f` with this thread's context for `level` from `cache`, made by `create` on the
/// thread's first use of that level (an error there is returned, and nothing is cached).
pub(super) fn with_context<T: 'static, R>(
    cache: &'static LocalKey<RefCell<ContextCache<T>>>,
    level: i32,
    create: impl FnOnce() -> Result<T>,
    f: impl FnOnce(&mut T) -> Result<R>,
) -> Result<R> {
    cache.with(|cell| {
        let mut cache = cell.borrow_mut();
        let i = match cache.contexts.iter().position(|(l, _)| *l == level) {
            Some(i) => i,
            None => {
                let context = create()?;
                cache.contexts.push((level, context));
                cache.contexts.len() - 1
            }
        };
        f(&mut cache.contexts[i].1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    thread_local! {
        static CACHE: RefCell<ContextCache<Vec<i32>>> = const { RefCell::new(ContextCache::new()) };
    }

    #[test]
    fn one_context_per_level_made_once() {
        let mut made = 0;
        for level in [3, 3, 5, 3, NO_LEVEL, 5] {
            with_context(
                &CACHE,
                level,
                || {
                    made += 1;
                    Ok(Vec::new())
                },
                |c| {
                    c.push(level);
                    Ok(())
                },
            )
            .unwrap();
        }
        assert_eq!(made, 3);
        let threes = with_context(&CACHE, 3, || Ok(Vec::new()), |c| Ok(c.len())).unwrap();
        assert_eq!(threes, 3);
        // A failed creation is returned and caches nothing.
        let r: Result<()> = with_context(&CACHE, 9, || Err(Error::no_memory("x")), |_| Ok(()));
        assert!(r.is_err());
        let fresh = with_context(&CACHE, 9, || Ok(vec![7]), |c| Ok(c.clone())).unwrap();
        assert_eq!(fresh, vec![7]);
    }
}
