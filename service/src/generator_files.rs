//! zram-generator's files where zram-generator finds them, read as uzram's configuration
//! (`uzram serve --zram-generator`, `--zram-generator-conf FILE`): the root
//! (`$ZRAM_GENERATOR_ROOT`), the kernel command line's `systemd.zram`, the main file and the
//! drop-ins in its order. The parsing itself is [`crate::generator_conf`]'s. Warnings go to
//! stderr and what zram-generator would have done with the devices to stdout, as the server
//! prints them at start.

use crate::config::ServeConfig;
use crate::host::ram_bytes_from;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

/// zram-generator's root: `$ZRAM_GENERATOR_ROOT` when set (its tests' fixtures), else `/`.
pub fn root() -> PathBuf {
    match std::env::var_os("ZRAM_GENERATOR_ROOT") {
        Some(root) if !root.is_empty() => PathBuf::from(root),
        _ => PathBuf::from("/"),
    }
}

/// zram-generator's file as uzram's configuration; its warnings go to stderr and what it would
/// have done with the devices to stdout.
pub fn config(path: &std::path::Path) -> Result<ServeConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    fragments_config(&[(path.display().to_string(), text)])
}

/// `systemd.zram` on the kernel command line (`ROOT/proc/cmdline`), as zram-generator reads
/// it; a command line that cannot be read is a warning and counts as no option, as there.
pub fn kernel_option(root: &std::path::Path) -> Option<bool> {
    let path = root.join("proc/cmdline");
    match std::fs::read_to_string(&path) {
        Ok(text) => crate::generator_conf::kernel_zram_option(&text),
        Err(e) => {
            eprintln!(
                "uzram: warning: reading {}: {e}; systemd.zram ignored",
                path.display()
            );
            None
        }
    }
}

/// zram-generator's configuration where it finds it (`--zram-generator`; the kernel command
/// line's `systemd.zram=0` is handled before, by the caller).
pub fn system_config() -> Result<ServeConfig> {
    let root = root();
    let mut fragments = Vec::new();
    if kernel_option(&root) == Some(true) {
        // zram0 with zram-generator's defaults; the files may still set its keys.
        fragments.push((
            "the kernel command line (systemd.zram)".to_string(),
            "[zram0]\n".to_string(),
        ));
    }
    let files = crate::generator_conf::locate_fragments(&root);
    for path in &files {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        fragments.push((path.display().to_string(), text));
    }
    if fragments.is_empty() {
        bail!(
            "no zram-generator configuration under {}: none of {{{}}}/systemd/\
             zram-generator.conf{{,.d/*.conf}} exists, and the kernel command line has no \
             systemd.zram",
            root.display(),
            crate::generator_conf::CONFIG_DIRS.join(",")
        );
    }
    fragments_config(&fragments)
}

/// zram-generator's files (`(name, text)`, in reading order) as uzram's configuration; the
/// warnings go to stderr and what zram-generator would have done with the devices to stdout.
pub fn fragments_config(fragments: &[(String, String)]) -> Result<ServeConfig> {
    // zram-generator reads $ZRAM_GENERATOR_ROOT/proc/meminfo when that is set.
    let ram = ram_bytes_from(&root().join("proc/meminfo"))?;
    let gen = crate::generator_conf::parse_fragments(
        fragments,
        ram,
        &mut crate::generator_conf::run_set_program,
    )?;
    for w in &gen.warnings {
        eprintln!("uzram: warning: {w}");
    }
    for n in &gen.notes {
        println!("{n}");
    }
    // Sizes are bytes already (`disksize` takes a lone number as bytes).
    Ok(gen.config)
}
