//! `uzram ctl` and `uzram status`: a running device's attributes through its control socket
//! (`NAME.ctl` next to the export socket, see `uzram::frontend::control`).

use anyhow::{bail, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use uzram::frontend::control::{self, ControlClient, Request, WireError};

#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The device.
    #[arg(long, default_value = "zram0")]
    pub dev: String,
    /// The directory of the sockets [default: /run/uzram as root, else $XDG_RUNTIME_DIR/uzram].
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The attribute, with zram's name (`mm_stat`, `disksize`, `compact`, `writeback`, ...).
    pub attr: String,
    /// Store this value (words are joined with spaces); without it, show the attribute.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub value: Vec<String>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The directory of the sockets [default: as for `ctl`].
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print sizes in bytes (zramctl's --bytes).
    #[arg(short, long)]
    pub bytes: bool,
}

/// `strerror` without the ` (os error N)` std appends.
fn strerror(errno: i32) -> String {
    let s = std::io::Error::from_raw_os_error(errno).to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// The exit status for an errno (errnos are below 256; 1 if it is not one).
fn exit_code(errno: i32) -> i32 {
    if (1..=255).contains(&errno) {
        errno
    } else {
        1
    }
}

fn connect(dir: &Path, dev: &str) -> std::result::Result<ControlClient, (i32, String)> {
    let path = control::socket_path(dir, dev);
    ControlClient::connect(&path).map_err(|e| {
        let errno = e.raw_os_error().unwrap_or(libc::EIO);
        (
            errno,
            format!(
                "uzram: {dev}: cannot reach {}: {} (is `uzram serve` running?)",
                path.display(),
                strerror(errno)
            ),
        )
    })
}

/// The socket directory: `--dir`, or the default one once it is known to be this user's own
/// (mode 0700, not a symlink), so that no other user's socket answers in the server's name.
fn socket_dir(dir: Option<PathBuf>) -> std::result::Result<PathBuf, (i32, String)> {
    if let Some(d) = dir {
        return Ok(d);
    }
    let d = crate::serve::default_socket_dir();
    if std::fs::symlink_metadata(&d).is_ok() {
        uzram::frontend::unix_socket::check_private_dir(&d)
            .map_err(|e| (e.errno(), format!("uzram: {}", e.message())))?;
    }
    Ok(d)
}

/// Runs `uzram ctl`; returns the process's exit status (0, or the errno of the failure).
pub fn run_ctl(args: CtlArgs) -> i32 {
    let dir = match socket_dir(args.dir) {
        Ok(d) => d,
        Err((errno, msg)) => {
            eprintln!("{msg}");
            return exit_code(errno);
        }
    };
    let mut client = match connect(&dir, &args.dev) {
        Ok(c) => c,
        Err((errno, msg)) => {
            eprintln!("{msg}");
            return exit_code(errno);
        }
    };
    let req = if args.value.is_empty() {
        Request::Show {
            attr: args.attr.clone(),
        }
    } else {
        Request::Store {
            attr: args.attr.clone(),
            value: args.value.join(" "),
        }
    };
    let answer = client.call(&req, &mut |p| eprintln!("uzram: {p}"));
    match answer {
        Ok(Ok(text)) => {
            print!("{text}");
            0
        }
        Ok(Err(WireError {
            errno,
            name,
            message,
        })) => {
            // As the shell reports a failed sysfs write, plus the symbolic name and why.
            eprintln!(
                "uzram: {}: {} ({name}): {message}",
                args.attr,
                strerror(errno)
            );
            exit_code(errno)
        }
        Err(e) => {
            eprintln!("uzram: {}: the server closed the connection: {e}", args.dev);
            exit_code(e.raw_os_error().unwrap_or(libc::EIO))
        }
    }
}

/// A size as zramctl prints it (util-linux's `size_to_human_string`: powers of 1024, one
/// letter, at most one decimal, none when it is 0): `0B`, `4K`, `1.5M`, `4G`.
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

/// One device's row.
struct Row {
    name: String,
    algorithm: String,
    disksize: u64,
    data: u64,
    compr: u64,
    total: u64,
    /// The sum of `meta_stat`'s columns.
    meta: u64,
    backing: Option<String>,
    bd_used: Option<u64>,
    /// The kernel block device (`/dev/ublkbN`), when the server made one.
    block_dev: Option<String>,
}

fn query(client: &mut ControlClient, name: &str) -> Result<Row> {
    let mut show =
        |attr: &str| -> Result<std::result::Result<String, WireError>> { Ok(client.show(attr)?) };
    let text = |r: std::result::Result<String, WireError>, attr: &str| -> Result<String> {
        r.map_err(|e| anyhow::anyhow!("{attr}: {} ({})", e.message, e.name))
    };
    let algorithm = text(show("comp_algorithm")?, "comp_algorithm")?
        .split_whitespace()
        .find_map(|a| a.strip_prefix('[')?.strip_suffix(']').map(str::to_string))
        .unwrap_or_else(|| "-".into());
    let disksize: u64 = text(show("disksize")?, "disksize")?.trim().parse()?;
    let mm: Vec<u64> = text(show("mm_stat")?, "mm_stat")?
        .split_whitespace()
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()?;
    if mm.len() < 3 {
        bail!("mm_stat has {} columns", mm.len());
    }
    let meta = text(show("meta_stat")?, "meta_stat")?
        .split_whitespace()
        .map(str::parse::<u64>)
        .sum::<std::result::Result<u64, _>>()?;
    // Devices without writeback attributes have no backing device (ENOENT); "none" is
    // zram's text for none configured.
    let backing = match show("backing_dev")? {
        Ok(t) if t.trim() != "none" && !t.trim().is_empty() => Some(t.trim().to_string()),
        Ok(_) => None,
        Err(e) if e.errno == libc::ENOENT => None,
        Err(e) => bail!("backing_dev: {} ({})", e.message, e.name),
    };
    let bd_used = match &backing {
        None => None,
        // bd_stat's first column, bd_count, is in 4 KiB units as in zram.
        Some(_) => Some(
            text(show("bd_stat")?, "bd_stat")?
                .split_whitespace()
                .next()
                .unwrap_or("0")
                .parse::<u64>()?
                * 4096,
        ),
    };
    let block_dev = match show(uzram::frontend::control::BLOCK_DEV_ATTR)? {
        Ok(t) => Some(t.trim().to_string()),
        Err(e) if e.errno == libc::ENOENT => None,
        Err(e) => bail!("block_dev: {} ({})", e.message, e.name),
    };
    Ok(Row {
        name: name.to_string(),
        algorithm,
        disksize,
        data: mm[0],
        compr: mm[1],
        total: mm[2],
        meta,
        backing,
        bd_used,
        block_dev,
    })
}

/// Runs `uzram status`: every device with a control socket in the directory, as a table.
pub fn run_status(args: StatusArgs) -> Result<()> {
    let dir = match socket_dir(args.dir) {
        Ok(d) => d,
        Err((_, msg)) => bail!("{}", msg.trim_start_matches("uzram: ")),
    };
    let mut names: Vec<String> = match std::fs::read_dir(&dir) {
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
        Err(e) => bail!("reading {}: {e}", dir.display()),
    };
    // zram0, zram1, ..., zram10: by length, then text.
    names.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
    let mut rows = Vec::new();
    for name in names {
        match connect(&dir, &name) {
            Ok(mut c) => rows.push(query(&mut c, &name)?),
            Err((_, msg)) => eprintln!("{msg}"),
        }
    }
    if rows.is_empty() {
        return Ok(());
    }
    let size = |b: u64| {
        if args.bytes {
            b.to_string()
        } else {
            human_size(b)
        }
    };
    let mut t = uzram_bench::Table::new(&[
        "NAME",
        "ALGORITHM",
        "DISKSIZE",
        "DATA",
        "COMPR",
        "TOTAL",
        "META",
        "BACKING-DEV",
        "BD-USED",
        "BLOCK-DEV",
    ])
    .left_align(&[1, 7, 9]);
    for r in rows {
        t.row(vec![
            r.name,
            r.algorithm,
            size(r.disksize),
            size(r.data),
            size(r.compr),
            size(r.total),
            size(r.meta),
            r.backing.unwrap_or_else(|| "-".into()),
            r.bd_used.map_or_else(|| "-".into(), size),
            r.block_dev.unwrap_or_else(|| "-".into()),
        ]);
    }
    print!("{}", t.render_plain());
    Ok(())
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
    fn errnos_become_exit_codes() {
        assert_eq!(exit_code(libc::EBUSY), 16);
        assert_eq!(exit_code(0), 1);
        assert_eq!(strerror(libc::EBUSY), "Device or resource busy");
    }
}
