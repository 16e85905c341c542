//! Same-filled pages (zram's `ZRAM_SAME`): pages whose every 8-byte word is equal are stored
//! as that word in the slot, with no compression and no allocation. Zero pages are the common
//! case; pages filled with one repeated pointer or pattern are the rest.
//!
//! Words are read in native byte order, so `fill_same(page, same_filled_word(page)?)` rebuilds
//! the page exactly on the same machine (the word never leaves the process).

/// Bytes per word compared.
const WORD_BYTES: usize = 8;
/// Words compared per step of the main loop: 8 words = 64 bytes, one cache line. Folding a
/// whole line with `|` and testing once lets the compiler vectorise the inner loop while
/// keeping the early exit within a cache line of the first difference.
const WORDS_PER_STEP: usize = 8;

/// `Some(w)` if every native-endian 8-byte word of `page` equals `w`; `None` otherwise, or if
/// `page` is empty or its length is not a multiple of 8.
///
/// Like the kernel's `page_same_filled`, the last word is compared first: a page that is not
/// same-filled usually differs there, so most pages are rejected after two loads.
pub fn same_filled_word(page: &[u8]) -> Option<u64> {
    if page.is_empty() || page.len() % WORD_BYTES != 0 {
        return None;
    }
    let word_at = |pos: usize| {
        let mut w = [0u8; WORD_BYTES];
        w.copy_from_slice(&page[pos..pos + WORD_BYTES]);
        u64::from_ne_bytes(w)
    };
    let first = word_at(0);
    if word_at(page.len() - WORD_BYTES) != first {
        return None;
    }
    let mut lines = page.chunks_exact(WORD_BYTES * WORDS_PER_STEP);
    for line in &mut lines {
        let diff = line.chunks_exact(WORD_BYTES).fold(0u64, |acc, w| {
            acc | (u64::from_ne_bytes(w.try_into().unwrap()) ^ first)
        });
        if diff != 0 {
            return None;
        }
    }
    let all_same = lines
        .remainder()
        .chunks_exact(WORD_BYTES)
        .all(|w| u64::from_ne_bytes(w.try_into().unwrap()) == first);
    all_same.then_some(first)
}

/// Fills `dst` with `word` repeated (native byte order): the inverse of [`same_filled_word`].
/// A trailing part shorter than a word (not produced by uzram's page sizes) gets the word's
/// leading bytes.
pub fn fill_same(dst: &mut [u8], word: u64) {
    let bytes = word.to_ne_bytes();
    if bytes.iter().all(|&b| b == bytes[0]) {
        // Zero pages and byte patterns: a plain memset.
        dst.fill(bytes[0]);
        return;
    }
    let mut words = dst.chunks_exact_mut(WORD_BYTES);
    for w in &mut words {
        w.copy_from_slice(&bytes);
    }
    let tail = words.into_remainder();
    let n = tail.len();
    tail.copy_from_slice(&bytes[..n]);
}
