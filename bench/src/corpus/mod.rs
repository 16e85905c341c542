//! Page corpora: snapshots of the anonymous memory of real running programs, the data the
//! benchmarks compress (never only random or zero bytes).
//!
//! Two halves:
//! - [`snapshot_pid`] reads one process's anonymous pages (the memory zram would be handed when
//!   that process is swapped out) through `/proc/PID/{maps,pagemap,mem}`.
//! - [`Corpus`] holds pages from one or more named sources in memory and reads and writes the
//!   corpus file (format below, also in `bench/notes.md`).
//!
//! # Which memory is snapshotted
//!
//! Writable mappings of anonymous memory, the memory that goes to swap:
//! - private (`p`) mappings with no path, or `[heap]`, `[stack]`, `[anon:NAME]`;
//! - shared (`s`) anonymous memory: `/dev/zero (deleted)` (`mmap(MAP_SHARED|MAP_ANONYMOUS)`,
//!   e.g. PostgreSQL's shared buffers), `/SYSV…` (System V shm) and `[anon_shmem:NAME]`. Shared
//!   anonymous memory is shmem, which the kernel swaps too.
//!
//! File-backed mappings, `[vdso]`, `[vvar]` and read-only memory are never read. Corpus pages
//! are aligned to `page_size_bytes` in the process's address space (as a kernel with that page
//! size would lay them out); a mapping's head and tail that do not fill a whole corpus page are
//! skipped. A corpus page is kept only if `/proc/PID/pagemap` says at least one of its system
//! pages is present or swapped (memory never touched is not memory zram would ever see); if
//! pagemap cannot be read, every page is kept. When there are more candidate pages than
//! `max_pages`, an evenly spaced subset across the whole address space is taken, so a cap does
//! not bias the sample towards low addresses (the first mappings).
//!
//! Reading another process's memory needs ptrace access to it (`PTRACE_MODE_ATTACH`): root, or
//! the same user with Yama's `ptrace_scope` allowing it (a parent may always read its children).
//!
//! # Corpus file format (`UZRAMCP1`), all integers little-endian
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `UZRAMCP1` |
//! | 8 | 4 | `page_size_bytes` (u32: 4096, 16384 or 65536) |
//! | 12 | 4 | `source_count` (u32) |
//! | 16 | 8 | `page_count` (u64), the sum of the sources' page counts |
//! | 24 | … | `source_count` records: `page_count` (u64), `name_len` (u16), `name` (UTF-8) |
//! | … | … | zero padding up to `data_offset` = header length rounded up to 4096 |
//! | `data_offset` | `page_count * page_size_bytes` | the pages, source after source, in record order |
//!
//! The file is exactly `data_offset + page_count * page_size_bytes` bytes; anything else is
//! rejected. Pages start on a 4 KiB boundary so the file can be mapped or read with `O_DIRECT`.
//!
//! [`build`] is the `uzram corpus` command: the workloads whose memory is snapshotted.

pub mod build;

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use uzram::error::{Error, ErrorKind, Result};
use uzram::units::SUPPORTED_PAGE_SIZES_BYTES;

/// The corpus file's magic number.
pub const CORPUS_MAGIC: &[u8; 8] = b"UZRAMCP1";

/// Pages start at a multiple of this in the corpus file (the common system page size, so the
/// page data is mappable and `O_DIRECT`-readable).
const DATA_ALIGN_BYTES: usize = 4096;

/// Fixed part of the header: magic, page size, source count, page count.
const FIXED_HEADER_BYTES: usize = 8 + 4 + 4 + 8;

/// Longest source name stored (the name length is a u16).
const MAX_SOURCE_NAME_BYTES: usize = u16::MAX as usize;

/// pagemap entry bit: the page is present in RAM.
const PAGEMAP_PRESENT: u64 = 1 << 63;
/// pagemap entry bit: the page is swapped out.
const PAGEMAP_SWAPPED: u64 = 1 << 62;
/// pagemap entries read per `pread` (8 bytes each: 512 KiB, covering 256 MiB of 4 KiB pages).
const PAGEMAP_CHUNK_ENTRIES: usize = 64 * 1024;

/// An error for an operation on `path`, keeping the OS error's kind (and so its errno).
fn path_error(path: &str, e: std::io::Error) -> Error {
    let kind = e
        .raw_os_error()
        .map(ErrorKind::from_errno)
        .unwrap_or(ErrorKind::Io);
    Error::new(kind, format!("{path}: {e}"))
}

/// One line of `/proc/PID/maps` that [`snapshot_pid`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mapping {
    start: u64,
    end: u64,
}

/// Parses one `/proc/PID/maps` line and returns the mapping if it is writable anonymous memory
/// (see the module docs for the exact rule).
fn parse_anonymous_mapping(line: &str) -> Option<Mapping> {
    // "start-end perms offset dev inode [path]"; the path may contain spaces.
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?.as_bytes();
    let _offset = fields.next()?;
    let _dev = fields.next()?;
    let _inode = fields.next()?;
    let path = fields.next().unwrap_or("").trim_start();
    let (start, end) = range.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    if perms.len() < 4 || perms[0] != b'r' || perms[1] != b'w' || end <= start {
        return None;
    }
    let anonymous = match perms[3] {
        b'p' => {
            path.is_empty()
                || path == "[heap]"
                || path == "[stack]"
                || (path.starts_with("[anon:") && path.ends_with(']'))
        }
        b's' => {
            path == "/dev/zero (deleted)"
                || path.starts_with("/SYSV")
                || path.starts_with("[anon_shmem:")
        }
        _ => false,
    };
    anonymous.then_some(Mapping { start, end })
}

/// The system page size, from the ELF auxiliary vector (`AT_PAGESZ`), read from
/// `/proc/self/auxv` so no `unsafe` call is needed; 4096 if that fails.
fn system_page_size_bytes() -> usize {
    const AT_PAGESZ: u64 = 6;
    const WORD: usize = std::mem::size_of::<usize>();
    let Ok(auxv) = std::fs::read("/proc/self/auxv") else {
        return 4096;
    };
    for pair in auxv.chunks_exact(2 * WORD) {
        let word = |b: &[u8]| {
            let mut w = [0u8; WORD];
            w.copy_from_slice(b);
            usize::from_ne_bytes(w) as u64
        };
        if word(&pair[..WORD]) == AT_PAGESZ {
            return usize::try_from(word(&pair[WORD..])).unwrap_or(4096);
        }
    }
    4096
}

/// Addresses of the corpus pages of `m` that were ever touched (or all of them, without
/// pagemap), appended to `out`.
fn touched_pages(
    m: &Mapping,
    page_size_bytes: u64,
    sys_page_bytes: u64,
    pagemap: Option<&File>,
    out: &mut Vec<u64>,
) {
    let first = m.start.div_ceil(page_size_bytes) * page_size_bytes;
    let last_end = m.end / page_size_bytes * page_size_bytes;
    if first >= last_end {
        return;
    }
    let Some(pagemap) = pagemap else {
        out.extend((first..last_end).step_by(page_size_bytes as usize));
        return;
    };
    // Walk the mapping in chunks of pagemap entries; a corpus page covers the entries of the
    // system pages [addr / sys, (addr + page_size - 1) / sys].
    let chunk_span = PAGEMAP_CHUNK_ENTRIES as u64 * sys_page_bytes;
    let chunk_span = chunk_span.max(page_size_bytes) / page_size_bytes * page_size_bytes;
    let mut entries = Vec::new();
    let mut chunk_start = first;
    while chunk_start < last_end {
        let chunk_end = (chunk_start + chunk_span).min(last_end);
        let first_entry = chunk_start / sys_page_bytes;
        let end_entry = (chunk_end - 1) / sys_page_bytes + 1;
        let n_bytes = ((end_entry - first_entry) * 8) as usize;
        if entries.len() < n_bytes {
            entries.resize(n_bytes, 0);
        }
        let buf = &mut entries[..n_bytes];
        if pagemap.read_exact_at(buf, first_entry * 8).is_err() {
            // The range vanished or cannot be inspected: keep its pages, as without pagemap.
            out.extend((chunk_start..chunk_end).step_by(page_size_bytes as usize));
        } else {
            let entry = |i: u64| {
                let off = ((i - first_entry) * 8) as usize;
                let mut e = [0u8; 8];
                e.copy_from_slice(&buf[off..off + 8]);
                u64::from_ne_bytes(e)
            };
            for addr in (chunk_start..chunk_end).step_by(page_size_bytes as usize) {
                let lo = addr / sys_page_bytes;
                let hi = (addr + page_size_bytes - 1) / sys_page_bytes;
                if (lo..=hi).any(|i| entry(i) & (PAGEMAP_PRESENT | PAGEMAP_SWAPPED) != 0) {
                    out.push(addr);
                }
            }
        }
        chunk_start = chunk_end;
    }
}

/// `count` indices evenly spread over `0..len` (all of them if `count >= len`).
fn evenly_spaced(len: usize, count: usize) -> impl Iterator<Item = usize> {
    let count = count.min(len);
    (0..count).map(move |k| (k as u128 * len as u128 / count as u128) as usize)
}

/// What [`snapshot_pid_stats`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotStats {
    /// Touched anonymous pages in the process (the candidates the sample is drawn from).
    pub touched_pages: usize,
    /// Sampled pages that could not be read (unmapped meanwhile, or not readable).
    pub unreadable_pages: usize,
    /// Pages written.
    pub written_pages: usize,
}

/// Snapshots the anonymous memory of process `pid`: writes up to `max_pages` whole pages of
/// `page_size_bytes` to `out` and returns how many it wrote.
///
/// Pages that cannot be read (a range unmapped meanwhile, a guard page) are skipped. Errors:
/// `pid` gone or `/proc/PID/mem` not readable (no ptrace access) → the OS error's kind;
/// `page_size_bytes` not a power of two of at least 512 → `EINVAL`; a failed write to `out`.
pub fn snapshot_pid(
    pid: u32,
    page_size_bytes: usize,
    max_pages: usize,
    out: &mut impl Write,
) -> Result<usize> {
    snapshot_pid_stats(pid, page_size_bytes, max_pages, out).map(|s| s.written_pages)
}

/// [`snapshot_pid`], also reporting how many pages were candidates and how many unreadable.
pub fn snapshot_pid_stats(
    pid: u32,
    page_size_bytes: usize,
    max_pages: usize,
    out: &mut impl Write,
) -> Result<SnapshotStats> {
    if page_size_bytes < 512 || !page_size_bytes.is_power_of_two() {
        return Err(Error::invalid(format!(
            "page size {page_size_bytes} is not a power of two of at least 512"
        )));
    }
    let maps_path = format!("/proc/{pid}/maps");
    let maps = File::open(&maps_path).map_err(|e| path_error(&maps_path, e))?;
    let mut mappings = Vec::new();
    for line in BufReader::new(maps).lines() {
        let line = line.map_err(|e| path_error(&maps_path, e))?;
        mappings.extend(parse_anonymous_mapping(&line));
    }
    let mem_path = format!("/proc/{pid}/mem");
    let mem = File::open(&mem_path).map_err(|e| path_error(&mem_path, e))?;
    // pagemap is optional: without it untouched pages are kept (they read as zeroes).
    let pagemap = File::open(format!("/proc/{pid}/pagemap")).ok();
    let sys_page_bytes = system_page_size_bytes() as u64;

    let mut candidates = Vec::new();
    for m in &mappings {
        touched_pages(
            m,
            page_size_bytes as u64,
            sys_page_bytes,
            pagemap.as_ref(),
            &mut candidates,
        );
    }

    let mut stats = SnapshotStats {
        touched_pages: candidates.len(),
        ..SnapshotStats::default()
    };
    let mut page = vec![0u8; page_size_bytes];
    for i in evenly_spaced(candidates.len(), max_pages) {
        if mem.read_exact_at(&mut page, candidates[i]).is_err() {
            stats.unreadable_pages += 1;
            continue;
        }
        out.write_all(&page)
            .map_err(|e| Error::new(ErrorKind::Io, format!("writing snapshot of {pid}: {e}")))?;
        stats.written_pages += 1;
    }
    Ok(stats)
}

/// The pages of one source (a program) inside a [`Corpus`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorpusSource {
    /// Where the pages came from (`python`, `postgres`, …).
    pub name: String,
    /// Index of the source's first page in the corpus.
    pub first_page: usize,
    /// How many pages the source has.
    pub page_count: usize,
}

/// A page corpus in memory: pages of one size from named sources, stored back to back.
///
/// Invariants: `pages.len() == len() * page_size_bytes`; the sources cover `0..len()` in order,
/// without gaps or overlap; `page_size_bytes` is one of
/// [`SUPPORTED_PAGE_SIZES_BYTES`](uzram::units::SUPPORTED_PAGE_SIZES_BYTES).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corpus {
    page_size_bytes: usize,
    pages: Vec<u8>,
    sources: Vec<CorpusSource>,
}

impl Corpus {
    /// An empty corpus of pages of `page_size_bytes` (4096, 16384 or 65536; else `EINVAL`).
    pub fn new(page_size_bytes: usize) -> Result<Corpus> {
        if !SUPPORTED_PAGE_SIZES_BYTES.contains(&page_size_bytes) {
            return Err(Error::invalid(format!(
                "corpus page size {page_size_bytes} is not one of {SUPPORTED_PAGE_SIZES_BYTES:?}"
            )));
        }
        Ok(Corpus {
            page_size_bytes,
            pages: Vec::new(),
            sources: Vec::new(),
        })
    }

    /// Appends the source `name` with `pages` (whole pages back to back; else `EINVAL`).
    pub fn add_source(&mut self, name: &str, pages: &[u8]) -> Result<()> {
        if pages.len() % self.page_size_bytes != 0 {
            return Err(Error::invalid(format!(
                "{} bytes of pages for {name:?} are not whole {}-byte pages",
                pages.len(),
                self.page_size_bytes
            )));
        }
        if name.len() > MAX_SOURCE_NAME_BYTES {
            return Err(Error::invalid("corpus source name too long"));
        }
        self.sources.push(CorpusSource {
            name: name.to_owned(),
            first_page: self.len(),
            page_count: pages.len() / self.page_size_bytes,
        });
        self.pages.extend_from_slice(pages);
        Ok(())
    }

    /// Reads a corpus file (format in the module docs). A short, long or malformed file is
    /// `EINVAL`; a read failure keeps its OS error kind.
    pub fn load(path: impl AsRef<Path>) -> Result<Corpus> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let file = File::open(path).map_err(|e| path_error(&shown, e))?;
        Corpus::read_from(&mut BufReader::new(file))
            .map_err(|e| Error::new(e.kind(), format!("corpus {shown}: {}", e.message())))
    }

    /// Reads a corpus in the file format from `r`, which must end where the corpus ends.
    pub fn read_from(r: &mut impl Read) -> Result<Corpus> {
        let read_err = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Error::invalid("file is truncated"),
            _ => Error::from(e),
        };
        let mut fixed = [0u8; FIXED_HEADER_BYTES];
        r.read_exact(&mut fixed).map_err(read_err)?;
        if &fixed[..8] != CORPUS_MAGIC {
            return Err(Error::invalid("not a corpus file (bad magic)"));
        }
        let page_size_bytes = u32::from_le_bytes(fixed[8..12].try_into().unwrap()) as usize;
        let source_count = u32::from_le_bytes(fixed[12..16].try_into().unwrap()) as usize;
        let page_count = u64::from_le_bytes(fixed[16..24].try_into().unwrap());
        let mut corpus = Corpus::new(page_size_bytes)?;
        let data_len = usize::try_from(page_count)
            .ok()
            .and_then(|n| n.checked_mul(page_size_bytes))
            .ok_or_else(|| Error::invalid(format!("page count {page_count} too large")))?;

        let mut header_len = FIXED_HEADER_BYTES;
        let mut first_page = 0usize;
        for _ in 0..source_count {
            let mut rec = [0u8; 10];
            r.read_exact(&mut rec).map_err(read_err)?;
            let count = u64::from_le_bytes(rec[..8].try_into().unwrap());
            let name_len = u16::from_le_bytes(rec[8..10].try_into().unwrap()) as usize;
            let mut name = vec![0u8; name_len];
            r.read_exact(&mut name).map_err(read_err)?;
            let name =
                String::from_utf8(name).map_err(|_| Error::invalid("source name is not UTF-8"))?;
            let count = usize::try_from(count)
                .ok()
                .filter(|c| {
                    first_page
                        .checked_add(*c)
                        .is_some_and(|e| e as u64 <= page_count)
                })
                .ok_or_else(|| Error::invalid("source page counts exceed the page count"))?;
            corpus.sources.push(CorpusSource {
                name,
                first_page,
                page_count: count,
            });
            first_page += count;
            header_len += 10 + name_len;
        }
        if first_page as u64 != page_count {
            return Err(Error::invalid(format!(
                "sources hold {first_page} pages, header says {page_count}"
            )));
        }
        let mut padding = vec![0u8; header_len.next_multiple_of(DATA_ALIGN_BYTES) - header_len];
        r.read_exact(&mut padding).map_err(read_err)?;
        corpus.pages = vec![0u8; data_len];
        r.read_exact(&mut corpus.pages).map_err(read_err)?;
        let mut extra = [0u8; 1];
        if r.read(&mut extra).map_err(Error::from)? != 0 {
            return Err(Error::invalid("trailing bytes after the last page"));
        }
        Ok(corpus)
    }

    /// Writes the corpus in the file format to `w`.
    pub fn write_to(&self, w: &mut impl Write) -> Result<()> {
        let mut header = Vec::with_capacity(DATA_ALIGN_BYTES);
        header.extend_from_slice(CORPUS_MAGIC);
        header.extend_from_slice(&(self.page_size_bytes as u32).to_le_bytes());
        let source_count = u32::try_from(self.sources.len())
            .map_err(|_| Error::invalid("too many corpus sources"))?;
        header.extend_from_slice(&source_count.to_le_bytes());
        header.extend_from_slice(&(self.len() as u64).to_le_bytes());
        for s in &self.sources {
            header.extend_from_slice(&(s.page_count as u64).to_le_bytes());
            // `add_source` bounds the name length.
            header.extend_from_slice(&(s.name.len() as u16).to_le_bytes());
            header.extend_from_slice(s.name.as_bytes());
        }
        header.resize(header.len().next_multiple_of(DATA_ALIGN_BYTES), 0);
        w.write_all(&header)?;
        w.write_all(&self.pages)?;
        w.flush()?;
        Ok(())
    }

    /// Writes the corpus to `path` atomically (a temporary file in the same directory, then
    /// rename), so a reader never sees a half-written corpus.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let mut tmp_name = path.file_name().unwrap_or_default().to_owned();
        tmp_name.push(format!(".tmp{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let result = File::create(&tmp)
            .map_err(|e| path_error(&tmp.display().to_string(), e))
            .and_then(|f| {
                let mut w = std::io::BufWriter::new(f);
                self.write_to(&mut w)?;
                w.into_inner()
                    .map_err(|e| Error::from(e.into_error()))?
                    .sync_all()?;
                Ok(())
            })
            .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| path_error(&shown, e)));
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// The page size of every page.
    pub fn page_size_bytes(&self) -> usize {
        self.page_size_bytes
    }

    /// The number of pages.
    pub fn len(&self) -> usize {
        self.pages.len() / self.page_size_bytes
    }

    /// Whether the corpus has no pages.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Page `i` (panics if `i >= len()`, like slice indexing).
    pub fn page(&self, i: usize) -> &[u8] {
        &self.pages[i * self.page_size_bytes..(i + 1) * self.page_size_bytes]
    }

    /// All pages, back to back.
    pub fn pages_bytes(&self) -> &[u8] {
        &self.pages
    }

    /// The sources, in page order.
    pub fn sources(&self) -> &[CorpusSource] {
        &self.sources
    }

    /// The pages of one source, back to back.
    pub fn source_pages(&self, source: &CorpusSource) -> &[u8] {
        let start = source.first_page * self.page_size_bytes;
        &self.pages[start..start + source.page_count * self.page_size_bytes]
    }

    /// `n` pages: the corpus's pages in order, starting again from the first when they run
    /// out (for workloads larger than the corpus). Empty if the corpus is.
    pub fn cycle(&self, n: usize) -> impl Iterator<Item = &[u8]> + '_ {
        self.pages
            .chunks_exact(self.page_size_bytes)
            .cycle()
            .take(if self.is_empty() { 0 } else { n })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_select_anonymous_writable_memory() {
        let yes = [
            "7f0000000000-7f0000021000 rw-p 00000000 00:00 0 ",
            "55d0c0a00000-55d0c0b00000 rw-p 00000000 00:00 0                          [heap]",
            "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]",
            "7f0000000000-7f0000001000 rw-p 00000000 00:00 0    [anon:v8 heap]",
            "7f1000000000-7f1008000000 rw-s 00000000 00:01 1234 /dev/zero (deleted)",
            "7f1000000000-7f1008000000 rw-s 00000000 00:01 1234 /SYSV0052e2c1 (deleted)",
        ];
        for line in yes {
            assert!(parse_anonymous_mapping(line).is_some(), "{line}");
        }
        let no = [
            "7f0000000000-7f0000021000 r--p 00000000 00:00 0 ",
            "7f0000000000-7f0000021000 ---p 00000000 00:00 0 ",
            "7f0000000000-7f0000021000 rw-p 00001000 08:01 42 /usr/lib/libc.so.6",
            "7f0000000000-7f0000021000 rw-s 00000000 08:01 42 /dev/shm/foo",
            "ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0  [vsyscall]",
            "7ffd00000000-7ffd00002000 r--p 00000000 00:00 0                          [vvar]",
            "garbage",
            "",
        ];
        for line in no {
            assert!(parse_anonymous_mapping(line).is_none(), "{line}");
        }
        assert_eq!(
            parse_anonymous_mapping("1000-3000 rw-p 00000000 00:00 0"),
            Some(Mapping {
                start: 0x1000,
                end: 0x3000
            })
        );
    }

    #[test]
    fn evenly_spaced_spreads_over_the_whole_range() {
        let v: Vec<_> = evenly_spaced(10, 3).collect();
        assert_eq!(v, [0, 3, 6]);
        assert_eq!(evenly_spaced(3, 10).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(evenly_spaced(0, 10).count(), 0);
        assert_eq!(evenly_spaced(1000, 0).count(), 0);
    }

    #[test]
    fn system_page_size_is_a_power_of_two() {
        let p = system_page_size_bytes();
        assert!(p >= 4096 && p.is_power_of_two());
    }

    fn sample_corpus() -> Corpus {
        let mut c = Corpus::new(4096).unwrap();
        let a: Vec<u8> = (0..3 * 4096).map(|i| (i % 253) as u8).collect();
        c.add_source("alpha", &a).unwrap();
        c.add_source("", &[]).unwrap();
        c.add_source("béta", &vec![7u8; 4096]).unwrap();
        c
    }

    #[test]
    fn corpus_round_trips_through_the_file_format() {
        let c = sample_corpus();
        let mut bytes = Vec::new();
        c.write_to(&mut bytes).unwrap();
        assert_eq!(bytes.len(), 4096 + 4 * 4096);
        assert_eq!(&bytes[..8], CORPUS_MAGIC);
        let back = Corpus::read_from(&mut &bytes[..]).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.len(), 4);
        assert_eq!(back.page(3), &[7u8; 4096][..]);
        assert_eq!(back.sources()[2].first_page, 3);
        assert_eq!(back.source_pages(&back.sources()[0]).len(), 3 * 4096);
    }

    #[test]
    fn malformed_corpus_files_are_einval() {
        let c = sample_corpus();
        let mut good = Vec::new();
        c.write_to(&mut good).unwrap();
        let mut cases: Vec<Vec<u8>> = vec![
            good[..good.len() - 1].to_vec(),
            [&good[..], &[0u8][..]].concat(),
            good[..10].to_vec(),
            Vec::new(),
        ];
        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        cases.push(bad_magic);
        let mut bad_size = good.clone();
        bad_size[8..12].copy_from_slice(&1000u32.to_le_bytes());
        cases.push(bad_size);
        let mut bad_count = good.clone();
        bad_count[16..24].copy_from_slice(&5u64.to_le_bytes());
        cases.push(bad_count);
        for (i, bytes) in cases.iter().enumerate() {
            let err = Corpus::read_from(&mut &bytes[..]).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "case {i}: {err}");
        }
    }

    #[test]
    fn cycle_repeats_pages() {
        let c = sample_corpus();
        let pages: Vec<&[u8]> = c.cycle(9).collect();
        assert_eq!(pages.len(), 9);
        assert_eq!(pages[4], c.page(0));
        assert_eq!(pages[8], c.page(0));
        assert_eq!(Corpus::new(4096).unwrap().cycle(5).count(), 0);
    }

    #[test]
    fn bad_page_sizes_are_einval() {
        assert!(Corpus::new(1000).is_err());
        let mut c = Corpus::new(4096).unwrap();
        assert!(c.add_source("x", &[0u8; 100]).is_err());
        let mut sink = Vec::new();
        assert!(snapshot_pid(std::process::id(), 1000, 1, &mut sink).is_err());
    }

    #[test]
    fn snapshot_of_self_finds_a_known_buffer() {
        // 64 pages of a recognisable pattern, in a Box so it stays put.
        let marker: Box<[u64]> = (0..64 * 512u64)
            .map(|i| 0x5a5a_0000_0000_0000 | i)
            .collect();
        let mut out = Vec::new();
        let n = snapshot_pid(std::process::id(), 4096, usize::MAX, &mut out).unwrap();
        assert_eq!(out.len(), n * 4096);
        let hits = out
            .chunks_exact(4096)
            .filter(|p| {
                p.chunks_exact(8)
                    .all(|w| u64::from_ne_bytes(w.try_into().unwrap()) >> 48 == 0x5a5a)
            })
            .count();
        // The buffer may start mid-page: at least 63 of its pages are whole.
        assert!(hits >= 63, "found {hits} marker pages");
        assert_eq!(std::hint::black_box(&marker).len(), 64 * 512);
    }
}
