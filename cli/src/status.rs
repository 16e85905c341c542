//! `uzram status`: zramctl's status table (util-linux `zramctl [options] [<device>]`) for
//! uzram's devices, or with `--kernel` for the kernel's own zram devices.
//!
//! The same options, column names, defaults, formats, alignment and exit codes as zramctl, so
//! scripts written for zramctl's output read uzram's: `-o/--output LIST` (case-insensitive
//! names; a list starting with `+` adds to the default columns), `--output-all`, `--raw`,
//! `-n/--noheadings`, `-b/--bytes` and a device argument. Without a device, uninitialised
//! devices (`disksize` 0) are hidden; a named device is shown even then. Every failure exits
//! 1, as zramctl's `EXIT_FAILURE`.
//!
//! Each cell is computed from the attribute files as zramctl computes it (`mm_stat`'s columns,
//! `disksize`, the bracketed `comp_algorithm`, `max_comp_streams` when the device has it), then
//! laid out as libsmartcols lays out a table that does not go to a terminal: each column as
//! wide as its widest cell or header, one space between columns, sizes to the right, text to
//! the left, the last column not padded (zramctl on a terminal narrower than the table also
//! truncates MOUNTPOINT; this does not). `--raw` joins the cells with single spaces and writes
//! blanks, `\` and unprintable bytes as `\xHH`.

use anyhow::{anyhow, bail, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use uzram_service::frontend::control::{self, ControlClient};

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The directory of the sockets [default: as for `ctl`].
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Show the kernel's zram devices (/sys/block/zramN, named /dev/zramN) instead, as
    /// zramctl does; for comparing uzram's devices with the kernel's.
    #[arg(long)]
    pub kernel: bool,
    /// Print sizes in bytes rather than in human readable format.
    #[arg(short, long)]
    pub bytes: bool,
    /// Don't print headings.
    #[arg(short, long)]
    pub noheadings: bool,
    /// Columns to show, comma-separated (zramctl's names, see --help for the list); a list
    /// starting with `+` adds to the default columns.
    #[arg(short, long, value_name = "LIST")]
    pub output: Option<String>,
    /// Output all columns.
    #[arg(long)]
    pub output_all: bool,
    /// Use raw status output format.
    #[arg(long)]
    pub raw: bool,
    /// Show each device's automatic policies instead (docs/policies.md): a row per device
    /// and policy with its state (on/off), runs, pages acted on, errors and the last error,
    /// from `policy_stat`.
    #[arg(long, conflicts_with_all = ["kernel", "output", "output_all", "bytes"])]
    pub policies: bool,
    /// Only this device (shown even when uninitialised): a uzram device's name (`zram0`), or
    /// with --kernel `/dev/zramN` or `zramN`.
    pub device: Option<String>,
}

/// A status column: zramctl's, in zramctl's order, then uzram's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    Name,
    Disksize,
    Data,
    Compr,
    Algorithm,
    Streams,
    ZeroPages,
    Total,
    MemLimit,
    MemUsed,
    Migrated,
    CompRatio,
    Mountpoint,
    Meta,
    BackingDev,
    BdUsed,
    BlockDev,
    SwapReserve,
}

impl Column {
    /// Every column, in `--output-all`'s order.
    pub const ALL: [Column; 18] = [
        Column::Name,
        Column::Disksize,
        Column::Data,
        Column::Compr,
        Column::Algorithm,
        Column::Streams,
        Column::ZeroPages,
        Column::Total,
        Column::MemLimit,
        Column::MemUsed,
        Column::Migrated,
        Column::CompRatio,
        Column::Mountpoint,
        Column::Meta,
        Column::BackingDev,
        Column::BdUsed,
        Column::BlockDev,
        Column::SwapReserve,
    ];

    /// zramctl's default columns.
    pub const DEFAULT: [Column; 8] = [
        Column::Name,
        Column::Algorithm,
        Column::Disksize,
        Column::Data,
        Column::Compr,
        Column::Total,
        Column::Streams,
        Column::Mountpoint,
    ];

    /// The header, as zramctl spells it.
    pub fn name(self) -> &'static str {
        match self {
            Column::Name => "NAME",
            Column::Disksize => "DISKSIZE",
            Column::Data => "DATA",
            Column::Compr => "COMPR",
            Column::Algorithm => "ALGORITHM",
            Column::Streams => "STREAMS",
            Column::ZeroPages => "ZERO-PAGES",
            Column::Total => "TOTAL",
            Column::MemLimit => "MEM-LIMIT",
            Column::MemUsed => "MEM-USED",
            Column::Migrated => "MIGRATED",
            Column::CompRatio => "COMP-RATIO",
            Column::Mountpoint => "MOUNTPOINT",
            Column::Meta => "META",
            Column::BackingDev => "BACKING-DEV",
            Column::BdUsed => "BD-USED",
            Column::BlockDev => "BLOCK-DEV",
            Column::SwapReserve => "SWAP-RESERVE",
        }
    }

    /// What it shows (the help text).
    pub fn help(self) -> &'static str {
        match self {
            Column::Name => "zram device name",
            Column::Disksize => "limit on the uncompressed amount of data",
            Column::Data => "uncompressed size of stored data",
            Column::Compr => "compressed size of stored data",
            Column::Algorithm => "the selected compression algorithm",
            Column::Streams => "number of concurrent compress operations (max_comp_streams)",
            Column::ZeroPages => "empty pages with no allocated memory",
            Column::Total => "all memory including allocator fragmentation and metadata overhead",
            Column::MemLimit => "memory limit used to store compressed data",
            Column::MemUsed => "peak memory usage to store compressed data",
            Column::Migrated => "number of objects migrated by compaction",
            Column::CompRatio => "compression ratio: DATA/TOTAL",
            Column::Mountpoint => "where the device is mounted",
            Column::Meta => "uzram: metadata memory, the sum of meta_stat's first five columns",
            Column::BackingDev => "uzram: the backing device or file (backing_dev)",
            Column::BdUsed => "uzram: bytes held on the backing device (bd_stat's bd_count)",
            Column::BlockDev => "uzram: the kernel block device of serve --ublk",
            Column::SwapReserve => {
                "uzram: the server's swap reserve held now, of its size (serve --swap)"
            }
        }
    }

    /// libsmartcols's absolute width hint, zramctl's `whint` of 1 or more: a column whose
    /// cells are narrower than it and whose header is too is widened to it.
    fn width_hint(self) -> Option<usize> {
        match self {
            Column::Name | Column::Mountpoint | Column::BackingDev | Column::BlockDev => None,
            Column::Algorithm | Column::Streams | Column::ZeroPages => Some(3),
            _ => Some(5),
        }
    }

    /// Right-aligned (numbers), as zramctl's `SCOLS_FL_RIGHT`.
    fn right(self) -> bool {
        !matches!(
            self,
            Column::Name
                | Column::Algorithm
                | Column::Mountpoint
                | Column::BackingDev
                | Column::BlockDev
        )
    }

    /// The column called `name` (any case).
    pub fn parse(name: &str) -> Option<Column> {
        Column::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(name))
    }
}

/// The columns `-o`/`--output-all` select (zramctl's rules: `--output-all` selects all, a
/// list replaces the selection unless it starts with `+`, which appends to it).
fn columns(output: Option<&str>, output_all: bool) -> std::result::Result<Vec<Column>, String> {
    let mut cols: Vec<Column> = if output_all {
        Column::ALL.to_vec()
    } else {
        Column::DEFAULT.to_vec()
    };
    if let Some(list) = output {
        let list = match list.strip_prefix('+') {
            Some(rest) => rest,
            None => {
                cols.clear();
                list
            }
        };
        for name in list.split(',') {
            cols.push(Column::parse(name).ok_or_else(|| format!("unknown column: {name}"))?);
        }
    }
    Ok(cols)
}

/// A device's attribute files, read by name; `Ok(None)` when the device has no such file.
trait AttrFiles {
    fn read(&mut self, attr: &str) -> Result<Option<String>>;
}

/// A kernel zram device's sysfs directory.
struct Sysfs(PathBuf);

impl AttrFiles for Sysfs {
    fn read(&mut self, attr: &str) -> Result<Option<String>> {
        match std::fs::read_to_string(self.0.join(attr)) {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(anyhow!("{}: {e}", self.0.join(attr).display())),
        }
    }
}

impl AttrFiles for ControlClient {
    fn read(&mut self, attr: &str) -> Result<Option<String>> {
        match self.show(attr)? {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.errno == libc::ENOENT => Ok(None),
            Err(e) => Err(anyhow!("{attr}: {} ({})", e.message, e.name)),
        }
    }
}

/// A size as zramctl prints it (util-linux's `size_to_human_string` with
/// `SIZE_SUFFIX_1LETTER`: powers of 1024, one letter, at most one decimal, none when it is 0):
/// `0B`, `4K`, `1.5M`, `4G`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "K", "M", "G", "T", "P", "E"];
    let mut unit = 0;
    let mut div = 1u64;
    while unit + 1 < UNITS.len() && bytes / div >= 1024 {
        div *= 1024;
        unit += 1;
    }
    let whole = bytes / div;
    // Tenths, rounded to nearest.
    let tenths = ((bytes % div) as u128 * 10 + div as u128 / 2) / div as u128;
    let (whole, tenths) = if tenths == 10 {
        (whole + 1, 0)
    } else {
        (whole, tenths)
    };
    if tenths == 0 {
        format!("{whole}{}", UNITS[unit])
    } else {
        format!("{whole}.{tenths}{}", UNITS[unit])
    }
}

/// `DATA/TOTAL` as zramctl prints it (C's `%.4f` of a double; 0/0 is glibc's `-nan` on x86,
/// as zramctl shows for an empty device).
fn comp_ratio(data: u64, total: u64) -> String {
    if total == 0 {
        return if data == 0 { "-nan" } else { "inf" }.to_string();
    }
    format!("{:.4}", data as f64 / total as f64)
}

/// Where the kernel block device `dev` (`/dev/zram0`, whose sysfs directory is `sys`) is in
/// use: `[SWAP]` when it is an active swap device, else its first mount point, as zramctl's
/// `check_mount_point`.
fn kernel_mountpoint(dev: &str, sys: &Path) -> Option<String> {
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    if swaps
        .lines()
        .skip(1)
        .any(|l| l.split_whitespace().next() == Some(dev))
    {
        return Some("[SWAP]".into());
    }
    // mountinfo's third field is the mounted device's major:minor, as sysfs's `dev` file.
    let majmin = std::fs::read_to_string(sys.join("dev")).ok()?;
    let majmin = majmin.trim();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() > 4 && f[2] == majmin).then(|| unescape_mountinfo(f[4]))
    })
}

/// mountinfo writes space, tab, newline and `\` in paths as octal escapes (`\040`).
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) if b[i] == b'\\' => {
                out.push(d.iter().fold(0u8, |v, c| v.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One device's row of cells, computed as zramctl computes them.
fn row(
    name: &str,
    files: &mut dyn AttrFiles,
    cols: &[Column],
    bytes: bool,
    mountpoint: &dyn Fn() -> Option<String>,
) -> Result<Vec<String>> {
    let size = |b: u64| if bytes { b.to_string() } else { human_size(b) };
    let mut mm: Option<Vec<u64>> = None;
    let mut cells = Vec::with_capacity(cols.len());
    for &c in cols {
        // mm_stat: orig_data_size compr_data_size mem_used_total mem_limit mem_used_max
        // same_pages(zero_pages) pages_compacted(num_migrated) ...
        let mut mm_col = |i: usize| -> Result<u64> {
            if mm.is_none() {
                let text = files
                    .read("mm_stat")?
                    .ok_or_else(|| anyhow!("{name}: no mm_stat"))?;
                let v: Vec<u64> = text
                    .split_whitespace()
                    .map(str::parse)
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|e| anyhow!("{name}: failed to parse mm_stat: {e}"))?;
                if v.len() < 7 {
                    bail!("{name}: mm_stat has {} columns, not 7 or more", v.len());
                }
                mm = Some(v);
            }
            Ok(mm.as_ref().expect("read above")[i])
        };
        let cell = match c {
            Column::Name => name.to_string(),
            Column::Disksize => {
                let text = files.read("disksize")?.unwrap_or_default();
                if bytes {
                    text.trim_end_matches('\n').to_string()
                } else {
                    text.trim()
                        .parse::<u64>()
                        .map(human_size)
                        .unwrap_or_default()
                }
            }
            Column::Algorithm => {
                let text = files.read("comp_algorithm")?.unwrap_or_default();
                match (text.rfind('['), text.rfind(']')) {
                    (Some(l), Some(r)) if r > l + 1 => text[l + 1..r].to_string(),
                    _ => String::new(),
                }
            }
            Column::Streams => files
                .read("max_comp_streams")?
                .map(|s| s.trim_end_matches('\n').to_string())
                .unwrap_or_default(),
            Column::ZeroPages => mm_col(5)?.to_string(),
            Column::Data => size(mm_col(0)?),
            Column::Compr => size(mm_col(1)?),
            Column::Total => size(mm_col(2)?),
            Column::MemLimit => size(mm_col(3)?),
            Column::MemUsed => size(mm_col(4)?),
            // zramctl prints this count of objects as a size too.
            Column::Migrated => size(mm_col(6)?),
            Column::CompRatio => comp_ratio(mm_col(0)?, mm_col(2)?),
            Column::Mountpoint => mountpoint().unwrap_or_default(),
            // The device's own memory: the first five columns (the rest are the server's).
            Column::Meta => match files.read("meta_stat")? {
                Some(t) => size(
                    t.split_whitespace()
                        .take(5)
                        .map(str::parse::<u64>)
                        .sum::<std::result::Result<u64, _>>()
                        .map_err(|e| anyhow!("{name}: failed to parse meta_stat: {e}"))?,
                ),
                None => String::new(),
            },
            Column::BackingDev => match files.read("backing_dev")? {
                Some(t) if t.trim() != "none" => t.trim().to_string(),
                _ => String::new(),
            },
            Column::BdUsed => {
                let has_backing = files
                    .read("backing_dev")?
                    .is_some_and(|t| t.trim() != "none" && !t.trim().is_empty());
                match files.read("bd_stat")? {
                    // bd_count, in 4 KiB units as zram's FOUR_K.
                    Some(t) if has_backing => size(
                        t.split_whitespace()
                            .next()
                            .unwrap_or("0")
                            .parse::<u64>()
                            .map_err(|e| anyhow!("{name}: failed to parse bd_stat: {e}"))?
                            * 4096,
                    ),
                    _ => String::new(),
                }
            }
            Column::SwapReserve => match files.read("meta_stat")? {
                Some(t) => {
                    let cols: Vec<u64> = t
                        .split_whitespace()
                        .map(str::parse::<u64>)
                        .collect::<std::result::Result<_, _>>()
                        .map_err(|e| anyhow!("{name}: failed to parse meta_stat: {e}"))?;
                    match cols.get(5..7) {
                        Some(&[held, total]) if total > 0 => {
                            format!("{}/{}", size(held), size(total))
                        }
                        _ => String::new(),
                    }
                }
                None => String::new(),
            },
            Column::BlockDev => files
                .read(control::BLOCK_DEV_ATTR)?
                .map(|t| t.trim().to_string())
                .unwrap_or_default(),
        };
        cells.push(cell);
    }
    Ok(cells)
}

/// libsmartcols's raw encoding: blanks, `\` and unprintable bytes as `\xHH`.
fn raw_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if b == b' ' || b == b'\t' || b == b'\\' || !(0x21..0x7f).contains(&b) {
            out.push_str(&format!("\\x{b:02x}"));
        } else {
            out.push(b as char);
        }
    }
    out
}

/// Lays the table out as libsmartcols does for output that is not a terminal (see the module
/// documentation).
pub fn render(cols: &[Column], rows: &[Vec<String>], raw: bool, noheadings: bool) -> String {
    let header: Vec<String> = cols.iter().map(|c| c.name().to_string()).collect();
    let lines = std::iter::once(&header)
        .filter(|_| !noheadings)
        .chain(rows.iter());
    let mut out = String::new();
    if raw {
        for line in lines {
            let cells: Vec<String> = line.iter().map(|c| raw_escape(c)).collect();
            out.push_str(&cells.join(" "));
            out.push('\n');
        }
        return out;
    }
    let width = |s: &str| s.chars().count();
    // libsmartcols's count_column_width: the widest cell, at least the header (even with
    // --noheadings) and 1; a column narrower than its width hint and whose header is too
    // takes the hint.
    let widths: Vec<usize> = (0..cols.len())
        .map(|i| {
            let cells = rows.iter().map(|r| width(&r[i])).max().unwrap_or(0);
            let min = width(&header[i]).max(1);
            match cols[i].width_hint() {
                _ if cells < min => min,
                Some(h) if cells < h && min < h => h,
                _ => cells,
            }
        })
        .collect();
    for line in lines {
        for (i, cell) in line.iter().enumerate() {
            let last = i + 1 == cols.len();
            let pad = widths[i].saturating_sub(width(cell));
            if cols[i].right() && !cell.is_empty() {
                out.extend(std::iter::repeat(' ').take(pad));
                out.push_str(cell);
            } else {
                out.push_str(cell);
                if !last {
                    out.extend(std::iter::repeat(' ').take(pad));
                }
            }
            if !last {
                out.push(' ');
            }
        }
        out.push('\n');
    }
    out
}

/// A kernel zram device's name as zramctl prints it, from `/dev/zramN` or `zramN`.
fn kernel_name(arg: &str) -> String {
    let base = arg.strip_prefix("/dev/").unwrap_or(arg);
    format!("/dev/{base}")
}

/// The rows of the kernel's zram devices (`--kernel`).
fn kernel_rows(args: &StatusArgs, cols: &[Column]) -> Result<Vec<Vec<String>>> {
    let mut names: Vec<(u64, String)> = match &args.device {
        Some(d) => {
            let name = kernel_name(d);
            let sys = Path::new("/sys/block").join(&name["/dev/".len()..]);
            if !name["/dev/".len()..].starts_with("zram") || !sys.join("disksize").exists() {
                bail!("{name}: {}", super::ctl::strerror(libc::ENODEV));
            }
            vec![(0, name)]
        }
        None => std::fs::read_dir("/sys/block")
            .map_err(|e| anyhow!("cannot open /sys/block: {e}"))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                let num: u64 = n.strip_prefix("zram")?.parse().ok()?;
                Some((num, format!("/dev/{n}")))
            })
            .collect(),
    };
    names.sort();
    let mut rows = Vec::new();
    for (_, name) in names {
        let sys = Path::new("/sys/block").join(&name["/dev/".len()..]);
        let mut files = Sysfs(sys.clone());
        if args.device.is_none() && !is_used(&mut files)? {
            continue;
        }
        let mountpoint = || kernel_mountpoint(&name, &sys);
        rows.push(row(&name, &mut files, cols, args.bytes, &mountpoint)?);
    }
    Ok(rows)
}

/// Whether a device is in use: zramctl's rule, `disksize` above 0.
fn is_used(files: &mut dyn AttrFiles) -> Result<bool> {
    Ok(files
        .read("disksize")?
        .and_then(|t| t.trim().parse::<u64>().ok())
        .is_some_and(|s| s > 0))
}

/// The names of uzram's devices (those with a control socket in the socket directory), or
/// the one asked for; and the directory.
fn device_names(args: &StatusArgs) -> Result<(PathBuf, Vec<String>)> {
    let dir = super::ctl::socket_dir(args.dir.clone())
        .map_err(|(_, msg)| anyhow!("{}", msg.trim_start_matches("uzram: ")))?;
    let names: Vec<String> = match &args.device {
        Some(d) => {
            if std::fs::symlink_metadata(control::socket_path(&dir, d)).is_err() {
                bail!("{d}: {}", super::ctl::strerror(libc::ENODEV));
            }
            vec![d.clone()]
        }
        None => socket_device_names(&dir)?,
    };
    Ok((dir, names))
}

/// The devices with a control socket (`NAME.ctl`) in `dir`, in zramctl's order (zram0, zram1,
/// ..., zram10: by length, then text); none if `dir` does not exist. Also `uzram ctl
/// metrics`'s list.
pub fn socket_device_names(dir: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.strip_suffix(".ctl")
                    .filter(|s| !s.is_empty() && !s.starts_with('.'))
                    .map(str::to_string)
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => bail!("cannot open {}: {e}", dir.display()),
    };
    names.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
    Ok(names)
}

/// The headers of `--policies`.
const POLICY_HEADERS: [&str; 7] = [
    "NAME",
    "POLICY",
    "STATE",
    "RUNS",
    "PAGES",
    "ERRORS",
    "LAST-ERROR",
];

/// `--policies`: a row per device and policy, from `policy_stat` (every device, initialised
/// or not: policies are set before `disksize` too).
fn policy_table(args: &StatusArgs) -> Result<String> {
    let (dir, names) = device_names(args)?;
    let mut rows: Vec<Vec<String>> = Vec::new();
    for name in names {
        let mut client = match super::ctl::connect(&dir, &name) {
            Ok(c) => c,
            Err((_, msg)) if args.device.is_some() => {
                bail!("{}", msg.trim_start_matches("uzram: "))
            }
            Err((_, msg)) => {
                eprintln!("{msg}");
                continue;
            }
        };
        let Some(stat) = client.read(control::POLICY_STAT_ATTR)? else {
            bail!("{name}: the server has no policies (an older uzram serve?)");
        };
        for line in stat.lines() {
            let mut w = line.split_whitespace();
            let mut row = vec![name.clone()];
            row.extend(w.by_ref().take(5).map(str::to_string));
            row.push(w.collect::<Vec<_>>().join(" "));
            if row.len() != POLICY_HEADERS.len() {
                bail!("{name}: malformed policy_stat line {line:?}");
            }
            rows.push(row);
        }
    }
    let mut out = String::new();
    let mut all = Vec::new();
    if !args.noheadings {
        all.push(POLICY_HEADERS.iter().map(|h| h.to_string()).collect());
    }
    all.extend(rows);
    let widths: Vec<usize> = (0..POLICY_HEADERS.len())
        .map(|c| {
            all.iter()
                .map(|r: &Vec<String>| r[c].len())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in &all {
        let cells: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if args.raw {
                    raw_escape(cell)
                } else if c == r.len() - 1 {
                    cell.clone()
                } else if (3..=5).contains(&c) {
                    format!("{cell:>w$}", w = widths[c])
                } else {
                    format!("{cell:<w$}", w = widths[c])
                }
            })
            .collect();
        out.push_str(cells.join(" ").trim_end());
        out.push('\n');
    }
    Ok(out)
}

/// The rows of uzram's devices: those with a control socket in the socket directory.
fn uzram_rows(args: &StatusArgs, cols: &[Column]) -> Result<Vec<Vec<String>>> {
    let (dir, names) = device_names(args)?;
    let mut rows = Vec::new();
    for name in names {
        let mut client = match super::ctl::connect(&dir, &name) {
            Ok(c) => c,
            // A named device must answer; in a listing a stale socket is reported and skipped.
            Err((_, msg)) if args.device.is_some() => {
                bail!("{}", msg.trim_start_matches("uzram: "))
            }
            Err((_, msg)) => {
                eprintln!("{msg}");
                continue;
            }
        };
        if args.device.is_none() && !is_used(&mut client)? {
            continue;
        }
        // MOUNTPOINT: where the block device of `serve --ublk` is mounted or swapped on;
        // where an NBD export is mounted (through nbdfuse and a loop device, or in a VM) is
        // not known here.
        let block_dev = if cols.contains(&Column::Mountpoint) {
            client
                .read(control::BLOCK_DEV_ATTR)?
                .map(|t| t.trim().to_string())
        } else {
            None
        };
        let mountpoint = || {
            let dev = block_dev.as_deref()?;
            let sys = Path::new("/sys/block").join(Path::new(dev).file_name()?);
            kernel_mountpoint(dev, &sys)
        };
        rows.push(row(&name, &mut client, cols, args.bytes, &mountpoint)?);
    }
    Ok(rows)
}

/// Runs `uzram status`; returns the exit status (0, or 1 on any failure, as zramctl).
pub fn run(args: StatusArgs) -> i32 {
    let result = if args.policies {
        policy_table(&args)
    } else {
        columns(args.output.as_deref(), args.output_all)
            .map_err(|e| anyhow!(e))
            .and_then(|cols| {
                let rows = if args.kernel {
                    kernel_rows(&args, &cols)?
                } else {
                    uzram_rows(&args, &cols)?
                };
                Ok(render(&cols, &rows, args.raw, args.noheadings))
            })
    };
    match result {
        Ok(table) => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            if out
                .write_all(table.as_bytes())
                .and_then(|()| out.flush())
                .is_err()
            {
                eprintln!("uzram: write error");
                return 1;
            }
            0
        }
        Err(e) => {
            eprintln!("uzram: {e}");
            1
        }
    }
}

/// The column list for `uzram status --help`, as zramctl's "Available output columns".
pub fn columns_help() -> String {
    let mut s = String::from("Available output columns:\n");
    for c in Column::ALL {
        s.push_str(&format!(" {:>11}  {}\n", c.name(), c.help()));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_as_zramctl_prints_them() {
        assert_eq!(human_size(0), "0B");
        assert_eq!(human_size(1000), "1000B");
        assert_eq!(human_size(4096), "4K");
        assert_eq!(human_size(1536 << 10), "1.5M");
        assert_eq!(human_size(4 << 30), "4G");
        assert_eq!(human_size((4 << 30) - 1), "4G");
        assert_eq!(human_size(12_345_678), "11.8M");
    }

    #[test]
    fn column_lists_follow_zramctls_rules() {
        assert_eq!(columns(None, false).unwrap(), Column::DEFAULT);
        assert_eq!(columns(None, true).unwrap(), Column::ALL);
        assert_eq!(
            columns(Some("name,Data,BD-USED"), true).unwrap(),
            [Column::Name, Column::Data, Column::BdUsed]
        );
        let plus = columns(Some("+meta"), false).unwrap();
        assert_eq!(plus.len(), Column::DEFAULT.len() + 1);
        assert_eq!(plus.last(), Some(&Column::Meta));
        assert_eq!(
            columns(Some("NAME,FOO"), false).unwrap_err(),
            "unknown column: FOO"
        );
        assert_eq!(columns(Some(""), false).unwrap_err(), "unknown column: ");
    }

    #[test]
    fn layout_pads_all_but_the_last_column() {
        let cols = [
            Column::Name,
            Column::Streams,
            Column::Data,
            Column::Mountpoint,
        ];
        let rows = vec![vec![
            "/dev/zram0".to_string(),
            String::new(),
            "0B".into(),
            String::new(),
        ]];
        assert_eq!(
            render(&cols, &rows, false, false),
            "NAME       STREAMS DATA MOUNTPOINT\n/dev/zram0           0B \n"
        );
        assert_eq!(render(&cols, &rows, true, true), "/dev/zram0  0B \n");
        assert_eq!(raw_escape("/mnt/a b\\c"), "/mnt/a\\x20b\\x5cc");
        assert_eq!(unescape_mountinfo("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(comp_ratio(0, 0), "-nan");
        assert_eq!(comp_ratio(3, 2), "1.5000");
    }
}
