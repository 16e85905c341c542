//! zram-generator's configuration (`/etc/systemd/zram-generator.conf`, its INI format) read
//! into uzram's: `uzram serve --zram-generator-conf FILE`. The files are found and read with
//! the crates zram-generator itself uses, so both read the same files the same way:
//! liboverdrop for the drop-in directories ([`crate::generator_files::locate_fragments`]) and
//! rust-ini, with its
//! default options, for the INI (quotes, `\` escapes, comments only at the start of a line).
//!
//! Each `[zramN]` section becomes a device `zramN`; other sections are ignored with a warning,
//! as zram-generator does, and so are unknown keys. The keys, as zram-generator(8) and
//! zram-generator.conf(5) define them (their values, defaults and units kept):
//!
//! | key | becomes |
//! |---|---|
//! | `zram-size` (default `min(ram / 2, 4096)`) | `disksize`: the expression in MiB over `ram` (MemTotal in MiB) in zram-generator's language ([`crate::size_expr`]); 0 drops the device |
//! | `zram-resident-limit` (default 0) | `mem_limit`, the same way |
//! | `host-memory-limit` / `memory-limit` (MiB or `none`) | the device is left out on a host with more RAM |
//! | `zram-fraction`, `max-zram-size` (obsolete) | `disksize` = fraction × ram, at most max (MiB) |
//! | `compression-algorithm = A(p=v,...) B(...) (params)` | `comp_algorithm` A, `recomp_algorithm` B at priority 1 (then 2, 3), each one's parameters as its `algorithm_params` (`level=`, `dict=` for `dictionary=`); a list without an algorithm is the global recompression parameters (reported) |
//! | `writeback-device` | `backing_dev` (an absolute, normalised path) |
//! | `swap-priority`, `fs-type`, `mount-point`, `options` | checked and reported as what to do with the device ([`GeneratorConf::notes`]) |
//!
//! Global `set!NAME = PROGRAM` lines run `/bin/sh -c PROGRAM` and evaluate its output as an
//! expression into the variable NAME, usable in later `set!`s and in sizes, as zram-generator
//! does (the caller supplies the runner: the file is root's configuration, and running it is
//! what the format means).
//!
//! Where zram-generator warns and goes on (an algorithm the kernel lacks, an unknown key), a
//! warning names the file, section and key and the device keeps its default; where it fails
//! (a malformed line, a bad number, an expression that does not evaluate), so does this,
//! naming the file and key (and, for a line rust-ini cannot parse, its line and column).
//! Attribute values are also stored on a scratch device while reading, so a writeback device
//! that cannot be opened fails here with its key, not later.

use crate::config::{DeviceSpec, ServeConfig};
use crate::size_expr::{self, Units};
use ini::Ini;
use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use uzram::device::Device;
use uzram::error::{Error, Result};

/// zram-generator's default `zram-size`.
pub const DEFAULT_ZRAM_SIZE: &str = "min(ram / 2, 4096)";

/// zram-generator's default swap priority.
pub const DEFAULT_SWAP_PRIORITY: i32 = 100;

/// The most recompression algorithms (zram's `ZRAM_MAX_COMPS` - 1).
const MAX_RECOMP: usize = 3;

/// What a configuration file gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratorConf {
    /// The devices, as uzram's configuration (sockets and server settings at their defaults).
    pub config: ServeConfig,
    /// Per device, what zram-generator would have done with it besides creating it (format as
    /// swap and enable it, or make a file system and mount it), as commands for the user.
    pub notes: Vec<String>,
    /// Keys or sections ignored and settings not applied, each naming the file and key.
    pub warnings: Vec<String>,
}

/// Where a value came from: the file that set it (rust-ini, like zram-generator, keeps no line
/// numbers of values), or every file read for a default.
#[derive(Debug, Clone)]
struct Place {
    what: std::rc::Rc<str>,
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.what)
    }
}

/// A value and the place it came from.
#[derive(Debug, Clone)]
struct At {
    value: String,
    place: Place,
}

/// One `[zramN]` section, merged over every place it appears.
#[derive(Debug, Default, Clone)]
struct Section {
    keys: BTreeMap<&'static str, At>,
}

/// Keys a section may have, with their canonical name (aliases map onto it).
fn canonical(key: &str) -> Option<&'static str> {
    Some(match key {
        "zram-size" => "zram-size",
        "zram-resident-limit" => "zram-resident-limit",
        "host-memory-limit" | "memory-limit" => "host-memory-limit",
        "compression-algorithm" => "compression-algorithm",
        "writeback-device" => "writeback-device",
        "swap-priority" => "swap-priority",
        "mount-point" => "mount-point",
        "fs-type" => "fs-type",
        "options" => "options",
        "zram-fraction" => "zram-fraction",
        "max-zram-size" => "max-zram-size",
        _ => return None,
    })
}

/// `none` or a whole number of MiB.
fn optional_mib(key: &str, at: &At) -> Result<Option<u64>> {
    if at.value == "none" {
        return Ok(None);
    }
    at.value.parse().map(Some).map_err(|_| {
        Error::invalid(format!(
            "{}: {key} = {:?}: not a number of MiB or `none`",
            at.place, at.value
        ))
    })
}

/// zram-generator's check of `mount-point` and `writeback-device`: absolute, no `..`;
/// normalised (`//`, `/./` and a trailing `/` removed).
fn absolute_path(key: &str, at: &At) -> Result<PathBuf> {
    let p = Path::new(&at.value);
    if p.is_relative() {
        return Err(Error::invalid(format!(
            "{}: {key} = {:?} is not absolute",
            at.place, at.value
        )));
    }
    if p.components().any(|c| c == Component::ParentDir) {
        return Err(Error::invalid(format!(
            "{}: {key} = {:?} is not normalised (has ..)",
            at.place, at.value
        )));
    }
    Ok(p.components().collect())
}

/// `ALGO(k=v,k2=v2)` → (`ALGO`, `k=v k2=v2`), as zram-generator splits them.
fn algorithm_and_params(word: &str) -> (String, String) {
    match word.find('(') {
        Some(i) => {
            let params = &word[i + 1..];
            let params = params.strip_suffix(')').unwrap_or(params);
            (word[..i].to_string(), params.replace(',', " "))
        }
        None => (word.to_string(), String::new()),
    }
}

/// zram-generator's parameter names as the attribute takes them: `dictionary=` is the
/// kernel's `dict=`.
fn attribute_params(params: &str) -> String {
    params
        .split_whitespace()
        .map(|p| match p.strip_prefix("dictionary=") {
            Some(path) => format!("dict={path}"),
            None => p.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Reads a zram-generator configuration. `what` names the file in messages; `ram_bytes` is
/// MemTotal; `run_set` runs a `set!` program and returns its standard output.
pub fn parse(
    text: &str,
    what: &str,
    ram_bytes: u64,
    run_set: &mut dyn FnMut(&str) -> Result<String>,
) -> Result<GeneratorConf> {
    parse_fragments(&[(what.to_string(), text.to_string())], ram_bytes, run_set)
}

/// Reads zram-generator's configuration from several files (`(name, text)`, in the order
/// [`locate_fragments`](crate::generator_files::locate_fragments) gives), each parsed by rust-ini: read one after another, as
/// zram-generator does, so a key set in a later file (or later in a file) replaces the same key
/// of the same `[zramN]` section in an earlier one, and `set!` variables carry over. Messages
/// name the file.
pub fn parse_fragments(
    fragments: &[(String, String)],
    ram_bytes: u64,
    run_set: &mut dyn FnMut(&str) -> Result<String>,
) -> Result<GeneratorConf> {
    // zram-generator's `ram`: MemTotal in whole MiB.
    let ram_mib = (ram_bytes / 1024 / 1024) as f64;
    let mut vars: BTreeMap<String, f64> = BTreeMap::new();
    let mut sections: BTreeMap<u64, Section> = BTreeMap::new();
    let mut warnings = Vec::new();
    let all: String = fragments
        .iter()
        .map(|(w, _)| w.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    for (what, text) in fragments {
        let what = what.as_str();
        let place = Place { what: what.into() };
        // As zram-generator's `Ini::load_from_file`: rust-ini's default options, after a UTF-8
        // byte order mark.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let ini = Ini::load_from_str(text)
            .map_err(|e| Error::invalid(format!("{what}:{}:{}: {}", e.line, e.col, e.msg)))?;
        // Each file's keys before its first section come first (rust-ini's general section).
        for (name, props) in ini.iter() {
            let Some(name) = name else {
                for (key, value) in props.iter() {
                    let Some(var) = key.strip_prefix("set!") else {
                        warnings.push(format!(
                            "{what}: {key}: not a set! directive outside a section, ignored"
                        ));
                        continue;
                    };
                    let out = run_set(value)
                        .map_err(|e| Error::new(e.kind(), format!("{what}: {key}: {e}")))?;
                    let vars_now = vars.clone();
                    let v = size_expr::eval_signed(out.trim(), Units::GeneratorMib, &|n| {
                        if n == "ram" {
                            Some(ram_mib)
                        } else {
                            vars_now.get(n).copied()
                        }
                    })
                    .map_err(|e| {
                        Error::invalid(format!(
                            "{what}: {key} = {value:?}: its output {:?}: {}",
                            out.trim(),
                            e.message()
                        ))
                    })?;
                    vars.insert(var.to_string(), v);
                }
                continue;
            };
            let Some(n) = name
                .strip_prefix("zram")
                .and_then(|n| n.parse::<u64>().ok())
            else {
                warnings.push(format!("{what}: ignoring section [{name}]"));
                continue;
            };
            let section = sections.entry(n).or_default();
            for (key, value) in props.iter() {
                let Some(k) = canonical(key) else {
                    warnings.push(format!("{what}: zram{n}: unknown key {key}, ignored"));
                    continue;
                };
                section.keys.insert(
                    k,
                    At {
                        value: value.to_string(),
                        place: place.clone(),
                    },
                );
            }
        }
    }
    // Where a default comes from.
    let default_place = Place {
        what: all.as_str().into(),
    };

    let mut config = ServeConfig::default();
    let mut notes = Vec::new();
    let var = |n: &str| {
        if n == "ram" {
            Some(ram_mib)
        } else {
            vars.get(n).copied()
        }
    };
    for (n, section) in &sections {
        let name = format!("zram{n}");
        let get = |k: &str| section.keys.get(k);
        // The size in MiB of an expression key, or its default.
        let size_mib = |key: &str, default: &str| -> Result<(f64, Place)> {
            let (expr, line) = match get(key) {
                Some(at) => (at.value.as_str(), at.place.clone()),
                None => (default, default_place.clone()),
            };
            let v = size_expr::eval(expr, Units::GeneratorMib, &var)
                .map_err(|e| Error::invalid(format!("{line}: {name}: {key} = {}", e.message())))?;
            Ok((v, line))
        };
        if let Some(at) = get("host-memory-limit") {
            if let Some(limit) = optional_mib("host-memory-limit", at)? {
                if limit < ram_mib as u64 {
                    notes.push(format!(
                        "{name}: not created: this host has {ram_mib} MiB, more than \
                         host-memory-limit = {limit} ({})",
                        at.place
                    ));
                    continue;
                }
            }
        }
        let disksize_bytes = if get("zram-fraction").is_some() || get("max-zram-size").is_some() {
            let fraction = match get("zram-fraction") {
                Some(at) => at
                    .value
                    .parse::<f64>()
                    .ok()
                    .filter(|f| *f >= 0.0 && f.is_finite())
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "{}: {name}: zram-fraction = {:?}: not a fraction",
                            at.place, at.value
                        ))
                    })?,
                None => 0.5,
            };
            let max = match get("max-zram-size") {
                Some(at) => optional_mib("max-zram-size", at)?,
                None => None,
            };
            ((fraction * ram_mib) as u64).min(max.unwrap_or(u64::MAX)) << 20
        } else {
            let (mib, line) = size_mib("zram-size", DEFAULT_ZRAM_SIZE)?;
            mib_to_bytes(mib).ok_or_else(|| {
                Error::invalid(format!("{line}: {name}: zram-size = {mib} MiB: too large"))
            })?
        };
        if disksize_bytes == 0 {
            notes.push(format!("{name}: not created: its size is 0"));
            continue;
        }
        let mut attrs: Vec<(String, String, Place)> = Vec::new();
        let mut recomp_params = None;
        if let Some(at) = get("compression-algorithm") {
            let mut prio = 0;
            for word in at.value.split_whitespace() {
                let (algo, params) = algorithm_and_params(word);
                if algo.is_empty() {
                    recomp_params = Some(params);
                    continue;
                }
                let this = prio;
                prio += 1;
                if this > MAX_RECOMP {
                    warnings.push(format!(
                        "{}: {name}: compression-algorithm: {algo}: at most {MAX_RECOMP} \
                         recompression algorithms, ignored",
                        at.place
                    ));
                    continue;
                }
                if let Err(e) = uzram::compress::check_algorithm(&algo) {
                    warnings.push(format!(
                        "{}: {name}: compression-algorithm: {}; {}",
                        at.place,
                        e.message(),
                        if this == 0 {
                            "the default (lz4) is used".to_string()
                        } else {
                            format!("no recompression at priority {this}")
                        }
                    ));
                    continue;
                }
                if this == 0 {
                    attrs.push(("comp_algorithm".into(), algo.clone(), at.place.clone()));
                } else {
                    attrs.push((
                        "recomp_algorithm".into(),
                        format!("algo={algo} priority={this}"),
                        at.place.clone(),
                    ));
                }
                if !params.is_empty() {
                    attrs.push((
                        "algorithm_params".into(),
                        format!("priority={this} {}", attribute_params(&params)),
                        at.place.clone(),
                    ));
                }
            }
        }
        if let Some(at) = get("writeback-device") {
            let p = absolute_path("writeback-device", at)?;
            attrs.push((
                "backing_dev".into(),
                p.display().to_string(),
                at.place.clone(),
            ));
        }
        let (limit_mib, limit_line) = size_mib("zram-resident-limit", "0")?;
        let mem_limit_bytes = mib_to_bytes(limit_mib).ok_or_else(|| {
            Error::invalid(format!(
                "{limit_line}: {name}: zram-resident-limit = {limit_mib} MiB: too large"
            ))
        })?;
        if mem_limit_bytes > 0 {
            attrs.push(("mem_limit".into(), mem_limit_bytes.to_string(), limit_line));
        }
        // What zram-generator would do after creating the device.
        let swap_priority = match get("swap-priority") {
            Some(at) => at
                .value
                .parse::<i32>()
                .ok()
                .filter(|p| (-1..=0x7fff).contains(p))
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "{}: {name}: swap-priority = {:?}: not in -1..=32767",
                        at.place, at.value
                    ))
                })?,
            None => DEFAULT_SWAP_PRIORITY,
        };
        let mount_point = match get("mount-point") {
            Some(at) => Some(absolute_path("mount-point", at)?),
            None => None,
        };
        let fs_type = get("fs-type").map(|a| a.value.clone());
        let options = get("options").map_or("discard".to_string(), |a| a.value.clone());
        let swap = mount_point.is_none() && fs_type.as_deref().unwrap_or("swap") == "swap";
        let dev = format!("/dev/ublkbN of `uzram serve --ublk` (or nbdfuse + losetup) for {name}");
        notes.push(if swap {
            let opts = if options.is_empty() {
                String::new()
            } else {
                format!(" --options {options}")
            };
            format!(
                "{name}: zram-generator would make it swap: mkswap DEV && swapon --priority \
                 {swap_priority}{opts} DEV, where DEV is the {dev}; run the server with --swap"
            )
        } else {
            let fs = fs_type.unwrap_or_else(|| "ext2".into());
            let opts = if options.is_empty() {
                String::new()
            } else {
                format!(" -o {options}")
            };
            match &mount_point {
                Some(m) => format!(
                    "{name}: zram-generator would make a file system and mount it: mkfs.{fs} DEV \
                     && mount{opts} DEV {}, where DEV is the {dev}",
                    m.display()
                ),
                None => format!(
                    "{name}: zram-generator would make a file system: mkfs.{fs} DEV, where DEV \
                     is the {dev}"
                ),
            }
        });
        if let Some(p) = recomp_params {
            notes.push(format!(
                "{name}: global recompression parameters ({p}): recompress with `uzram ctl --dev \
                 {name} recompress {p}` (after `idle`) when wanted"
            ));
        }
        // Each attribute on a scratch device, so that a value uzram refuses fails with its line.
        let scratch = Device::new_uninit(uzram::units::DEFAULT_PAGE_SIZE_BYTES)?;
        for (k, v, line) in &attrs {
            scratch.attr_store(k, v).map_err(|e| {
                Error::new(
                    e.kind(),
                    format!("{line}: {name}: {k} = {v:?}: {}", e.message()),
                )
            })?;
        }
        drop(scratch);
        config.devices.push(DeviceSpec {
            name,
            disksize: disksize_bytes.to_string(),
            page_size_bytes: uzram::units::DEFAULT_PAGE_SIZE_BYTES,
            socket: None,
            ublk: false,
            vhost_user: false,
            read_only: false,
            attrs: attrs.into_iter().map(|(k, v, _)| (k, v)).collect(),
            // zram-generator has no policies (its users run `idle`/`writeback` from timers).
            policy: None,
        });
    }
    if config.devices.is_empty() {
        return Err(Error::invalid(format!(
            "{all}: no device to create{}",
            if notes.is_empty() {
                " (no [zramN] section)".to_string()
            } else {
                format!(": {}", notes.join("; "))
            }
        )));
    }
    Ok(GeneratorConf {
        config,
        notes,
        warnings,
    })
}

/// zram-generator's `systemd.zram` kernel command-line option in `cmdline` (the text of
/// `/proc/cmdline`): the last `systemd.zram`, `systemd.zram=1|yes|true|on` (`Some(true)`:
/// create `zram0` with the defaults even without configuration) or
/// `systemd.zram=0|no|false|off` (`Some(false)`: create no device at all); `None` without
/// one. Words with another value are skipped, as zram-generator skips them.
pub fn kernel_zram_option(cmdline: &str) -> Option<bool> {
    const WORD: &str = "systemd.zram";
    cmdline
        .split_whitespace()
        .rev()
        .filter_map(|w| w.strip_prefix(WORD))
        .find_map(|rest| match rest {
            "" | "=1" | "=yes" | "=true" | "=on" => Some(true),
            "=0" | "=no" | "=false" | "=off" => Some(false),
            _ => None,
        })
}

/// MiB (a float, as zram-generator computes) to bytes, truncated as its `as u64` does; `None`
/// past u64.
fn mib_to_bytes(mib: f64) -> Option<u64> {
    let b = mib * 1024.0 * 1024.0;
    (b < u64::MAX as f64).then_some(b as u64)
}

/// Runs a `set!` program as zram-generator does: `/bin/sh -c PROGRAM` with standard input
/// from /dev/null and standard error inherited; a non-zero exit is reported on stderr and
/// its output used anyway. The output is capped at 64 KiB (an expression is a line).
pub fn run_set_program(program: &str) -> Result<String> {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let mut child = Command::new("/bin/sh")
        .args(["-c", "--", program])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut out = Vec::new();
    child
        .stdout
        .take()
        .expect("piped")
        .take(64 << 10)
        .read_to_end(&mut out)?;
    let status = child.wait()?;
    if !status.success() {
        eprintln!("uzram: set!: {program:?} exited with {status}");
    }
    String::from_utf8(out).map_err(|_| Error::invalid(format!("{program:?}: output not UTF-8")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn no_set(_: &str) -> Result<String> {
        panic!("no set! expected")
    }

    fn parse_ram(text: &str, ram_mib: u64) -> Result<GeneratorConf> {
        parse(text, "t.conf", ram_mib * MIB, &mut no_set)
    }

    fn attr<'a>(d: &'a DeviceSpec, k: &str) -> Vec<&'a str> {
        d.attrs
            .iter()
            .filter(|(a, _)| a == k)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    #[test]
    fn defaults_and_sizes() {
        let c = parse_ram("[zram0]\n", 782).unwrap();
        let d = &c.config.devices[0];
        assert_eq!(d.name, "zram0");
        assert_eq!(d.disksize, (391 * MIB).to_string());
        assert!(d.attrs.is_empty());
        let c = parse_ram("[zram0]\n", 16000).unwrap();
        assert_eq!(c.config.devices[0].disksize, (4096 * MIB).to_string());
        assert!(
            c.notes[0].contains("swapon --priority 100 --options discard"),
            "{:?}",
            c.notes
        );
        // A bare MiB count, and zram-generator's decimal suffix (500k MiB).
        let c = parse_ram(
            "[zram0]\nzram-size = 500\nzram-resident-limit = ram / 8\n",
            800,
        )
        .unwrap();
        let d = &c.config.devices[0];
        assert_eq!(d.disksize, (500 * MIB).to_string());
        assert_eq!(attr(d, "mem_limit"), [(100 * MIB).to_string()]);
        let c = parse_ram("[zram0]\nzram-size = 500k\n", 5000).unwrap();
        assert_eq!(c.config.devices[0].disksize, (500_000 * MIB).to_string());
        // 09-zram-size: min(0.75 * ram, 6000) with 782 MiB.
        let c = parse_ram("[zram0]\nzram-size = min(0.75 * ram, 6000)\n", 782).unwrap();
        assert_eq!(
            c.config.devices[0].disksize,
            ((586.5 * MIB as f64) as u64).to_string()
        );
    }

    #[test]
    fn obsolete_keys_and_host_memory_limit() {
        // zram-generator's test 11-obsolete, with 782 MiB.
        let text = "[zram0]\nzram-fraction = 0.10\nmax-zram-size = 2048\nmemory-limit = 100000\n\
                    [zram1]\nhost-memory-limit = 2\n[zram1]\nzram-fraction = 0.10\n\
                    max-zram-size = none\nmemory-limit = none\n\
                    [zram2]\nzram-fraction = 0.10\nmax-zram-size = 2048\nmemory-limit = 1\n";
        let c = parse_ram(text, 782).unwrap();
        let names: Vec<_> = c.config.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["zram0", "zram1"]);
        assert_eq!(c.config.devices[0].disksize, (78 * MIB).to_string());
        assert!(
            c.notes.iter().any(|n| n.starts_with("zram2: not created")),
            "{:?}",
            c.notes
        );
        // 03-too-much-memory: nothing to create is an error that says why.
        let e = parse_ram("[zram0]\nhost-memory-limit=7824\n", 7825).unwrap_err();
        assert!(e.message().contains("host-memory-limit = 7824"), "{e}");
        assert!(parse_ram("[zram0]\nzram-size = 0\n", 100).is_err());
    }

    #[test]
    fn algorithms_and_their_parameters() {
        let c = parse_ram(
            "[zram0]\ncompression-algorithm = lz4 zstd(level=3,dictionary=/nonexistent) \
             deflate (type=idle)\n",
            1000,
        );
        // The dictionary is read when stored: a missing one fails with the file and key.
        let e = c.unwrap_err();
        assert!(
            e.message().contains("t.conf: zram0: algorithm_params"),
            "{e}"
        );
        let c = parse_ram(
            "[zram0]\ncompression-algorithm = lz4hc(level=9) zstd(level=3) deflate (type=idle)\n",
            1000,
        )
        .unwrap();
        let d = &c.config.devices[0];
        assert_eq!(attr(d, "comp_algorithm"), ["lz4hc"]);
        assert_eq!(
            attr(d, "recomp_algorithm"),
            ["algo=zstd priority=1", "algo=deflate priority=2"]
        );
        assert_eq!(
            attr(d, "algorithm_params"),
            ["priority=0 level=9", "priority=1 level=3"]
        );
        assert!(
            c.notes.iter().any(|n| n.contains("recompress type=idle")),
            "{:?}",
            c.notes
        );
        // The manual's lzo-rle: uzram has none; a warning with the file and key, lz4 kept.
        let c = parse_ram("[zram0]\n\ncompression-algorithm = lzo-rle zstd\n", 1000).unwrap();
        assert!(
            c.warnings[0].starts_with("t.conf: zram0: compression-algorithm"),
            "{:?}",
            c.warnings
        );
        assert_eq!(
            attr(&c.config.devices[0], "comp_algorithm"),
            Vec::<&str>::new()
        );
        assert_eq!(
            attr(&c.config.devices[0], "recomp_algorithm"),
            ["algo=zstd priority=1"]
        );
        // A level zstd refuses: an error naming the file and key.
        let e = parse_ram("[zram0]\ncompression-algorithm = zstd(level=99)\n", 1000).unwrap_err();
        assert!(
            e.message().starts_with("t.conf: zram0: algorithm_params"),
            "{e}"
        );
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let e = parse_ram("[zram0]\nzram-size = ram /\n", 100).unwrap_err();
        assert!(e.message().starts_with("t.conf: zram0: zram-size"), "{e}");
        let e = parse_ram("[zram0]\nswap-priority = 40000\n", 100).unwrap_err();
        assert!(
            e.message().starts_with("t.conf: zram0: swap-priority"),
            "{e}"
        );
        let e = parse_ram("[zram0]\n\nmount-point = relative/dir\n", 100).unwrap_err();
        assert!(e.message().starts_with("t.conf: mount-point"), "{e}");
        let e = parse_ram("[zram0]\nwriteback-device = /nonexistent/dev\n", 100).unwrap_err();
        assert!(e.message().starts_with("t.conf: zram0: backing_dev"), "{e}");
        // Lines rust-ini cannot parse: its line and column, where it found out (the end of
        // the file, looking for `]` or `=`).
        let e = parse_ram("[zram0\n", 100).unwrap_err();
        assert!(e.message().starts_with("t.conf:2:1: "), "{e}");
        let e = parse_ram("[zram0]\njust words\n", 100).unwrap_err();
        assert!(e.message().starts_with("t.conf:3:1: "), "{e}");
        // rust-ini's escapes: `\x` takes four hex digits (here it runs into the end).
        let e = parse_ram("[zram0]\nwriteback-device = C:\\x\n", 100).unwrap_err();
        assert!(e.message().starts_with("t.conf:3:1: "), "{e}");
        // Its quotes, double or single, around the value or a part of it.
        let c = parse_ram("[zram0]\nzram-size = \"ram / 4\"\nfs-type = 'ext4'\n", 800).unwrap();
        assert_eq!(c.config.devices[0].disksize, (200 * MIB).to_string());
        assert!(c.notes[0].contains("mkfs.ext4"), "{:?}", c.notes);
        // Unknown keys and sections: warnings, as zram-generator's.
        let c = parse_ram("[zram0]\nfoo = 1\n[swap]\nx = 1\n", 100).unwrap();
        assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
        assert!(c.warnings[0].contains("t.conf: zram0: unknown key foo"));
        assert!(c.warnings[1].contains("t.conf: ignoring section [swap]"));
    }

    #[test]
    fn set_directives_run_programs_into_variables() {
        // zram-generator's test 02-zstd: ratio = 3/4 through two earlier variables.
        let text = "set!top = echo 3\nset!bottom = echo 4\nset!ratio = ! echo top / bottom\n\n\
                    [zram0]\ncompression-algorithm = zstd\nhost-memory-limit = 2050\n\
                    zram-resident-limit = 9999\nzram-size = ram * ratio\n";
        let c = parse(text, "t.conf", 782 * MIB, &mut |p| run_set_program(p)).unwrap();
        let d = &c.config.devices[0];
        assert_eq!(d.disksize, ((586.5 * MIB as f64) as u64).to_string());
        assert_eq!(attr(d, "mem_limit"), [(9999 * MIB).to_string()]);
        assert_eq!(attr(d, "comp_algorithm"), ["zstd"]);
        let e = parse(
            "set!x = echo nonsense(\n[zram0]\n",
            "t.conf",
            MIB << 10,
            &mut |p| run_set_program(p),
        )
        .unwrap_err();
        assert!(e.message().starts_with("t.conf: set!x"), "{e}");
    }

    #[test]
    fn mount_points_are_reported() {
        // 07-mount-point and 08-plain-device.
        let c = parse_ram(
            "[zram11]\nmount-point = /foo//bar/baz/\nfs-type = ext4\noptions = discard,casefold\n\
             [zram12]\nfs-type = ext2\n",
            800,
        )
        .unwrap();
        assert!(
            c.notes[0].contains("mkfs.ext4 DEV && mount -o discard,casefold DEV /foo/bar/baz"),
            "{:?}",
            c.notes
        );
        assert!(c.notes[1].contains("mkfs.ext2 DEV,"), "{:?}", c.notes);
        assert_eq!(c.config.devices[0].name, "zram11");
    }

    #[test]
    fn later_fragments_override_earlier_keys() {
        let frags = [
            (
                "a.conf".to_string(),
                "[zram0]\nzram-size = 100\nswap-priority = 5\n".to_string(),
            ),
            (
                "b.conf".to_string(),
                "set!x = echo 7\n[zram0]\nzram-size = x\n[zram1]\nzram-size = x * 2\n".to_string(),
            ),
            (
                "c.conf".to_string(),
                "[zram1]\nzram-size = bad(\n".to_string(),
            ),
        ];
        let mut echo = |p: &str| Ok(p.trim_start_matches("echo ").to_string());
        // c.conf's bad expression: named with its file and key.
        let e = parse_fragments(&frags, 1024 * MIB, &mut echo).unwrap_err();
        assert!(e.message().starts_with("c.conf: zram1: zram-size"), "{e}");
        let g = parse_fragments(&frags[..2], 1024 * MIB, &mut echo).unwrap();
        assert_eq!(g.config.devices[0].disksize, (7 * MIB).to_string());
        assert_eq!(g.config.devices[1].disksize, (14 * MIB).to_string());
        // a.conf's swap-priority stays (b.conf did not set it).
        assert!(g.notes[0].contains("--priority 5"), "{:?}", g.notes);
    }

    #[test]
    fn the_kernel_option_is_read_as_zram_generator_reads_it() {
        assert_eq!(kernel_zram_option("quiet splash"), None);
        assert_eq!(kernel_zram_option("\n\nsystemd.zram\n\n"), Some(true));
        assert_eq!(
            kernel_zram_option("asfdasdf=foobar bar=foood systemd.zram=0"),
            Some(false)
        );
        // The last one wins; a value it does not know is skipped.
        assert_eq!(
            kernel_zram_option("systemd.zram=0 systemd.zram=on"),
            Some(true)
        );
        assert_eq!(
            kernel_zram_option("systemd.zram=yes systemd.zram=maybe"),
            Some(true)
        );
        assert_eq!(kernel_zram_option("systemd.zramx=1"), None);
    }
}
