//! Compression dictionaries (`algorithm_params ... dict=PATH`, the kernel's `comp_params`
//! `dict`): the bytes of a dictionary file, loaded once and shared.
//!
//! A [`Dictionary`] is the file's content behind an `Arc`: the settings keep it (so a
//! `disksize` after a `reset`-free reconfiguration does not reread the file), and each codec
//! that uses it digests it once when the store is built (zstd's `CDict`/`DDict`), a form every
//! thread then reads without copying. Nothing is copied per page or per thread.
//!
//! zstd takes two kinds: a dictionary made by zstd's trainer (it starts with zstd's dictionary
//! magic, `37 a4 30 ec`, and carries entropy tables and an ID), or any other bytes, used as
//! raw content to match against (zstd's `ZSTD_dct_auto`, as the kernel's backend loads it). A
//! file with the magic whose tables do not parse is corrupt: `EINVAL`.

use crate::error::{Error, Result};
use std::path::Path;
use std::sync::Arc;

/// The largest dictionary file accepted: zstd's trainer makes 110 KiB by default and the
/// kernel suggests up to a few hundred KiB; 4 MiB bounds what one attribute write can make the
/// server hold (it keeps the file and each codec's digested copy) while leaving room for
/// every dictionary a page-sized input can use.
pub const MAX_DICT_BYTES: u64 = 4 << 20;

/// zstd's dictionary magic (`ZSTD_MAGIC_DICTIONARY`), little-endian.
pub(super) const ZSTD_DICT_MAGIC: [u8; 4] = [0x37, 0xa4, 0x30, 0xec];

/// The bytes of a dictionary, shared. Equal when the bytes are.
#[derive(Clone, PartialEq, Eq)]
pub struct Dictionary {
    bytes: Arc<[u8]>,
}

impl std::fmt::Debug for Dictionary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dictionary")
            .field("len_bytes", &self.bytes.len())
            .field("zstd_id", &self.zstd_id())
            .finish()
    }
}

impl Dictionary {
    /// Reads the dictionary file at `path`. `EINVAL` (what the kernel's `algorithm_params`
    /// returns for any failure to read it) when it cannot be read, is empty, or is larger than
    /// [`MAX_DICT_BYTES`]; the message says which.
    pub fn load(path: &Path) -> Result<Dictionary> {
        let fail = |why: String| Error::invalid(format!("dict={}: {why}", path.display()));
        let meta = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?;
        if !meta.is_file() {
            return Err(fail("not a regular file".into()));
        }
        if meta.len() > MAX_DICT_BYTES {
            return Err(fail(format!(
                "{} bytes, more than the {MAX_DICT_BYTES} a dictionary may have",
                meta.len()
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
        Dictionary::from_bytes(bytes).map_err(|e| fail(e.message().to_string()))
    }

    /// A dictionary of `bytes`; `EINVAL` when empty or too large.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Dictionary> {
        if bytes.is_empty() {
            return Err(Error::invalid("the dictionary is empty"));
        }
        if bytes.len() as u64 > MAX_DICT_BYTES {
            return Err(Error::invalid(format!(
                "{} bytes, more than the {MAX_DICT_BYTES} a dictionary may have",
                bytes.len()
            )));
        }
        Ok(Dictionary {
            bytes: bytes.into(),
        })
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Its size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.bytes.len()
    }

    /// The ID a zstd-trained dictionary carries (after the magic), `None` for raw content.
    pub fn zstd_id(&self) -> Option<u32> {
        if self.bytes.len() < 8 || self.bytes[..4] != ZSTD_DICT_MAGIC {
            return None;
        }
        Some(u32::from_le_bytes(self.bytes[4..8].try_into().ok()?))
    }
}
