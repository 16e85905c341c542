//! zram-generator's files where zram-generator finds them, read as uzram's configuration
//! (`uzram serve --zram-generator`, `--zram-generator-conf FILE`): the root
//! (`$ZRAM_GENERATOR_ROOT`), the kernel command line's `systemd.zram`, the main file and the
//! drop-ins in its order ([`locate_fragments`], with liboverdrop, as zram-generator finds
//! them). The parsing itself is [`crate::generator_conf`]'s. Warnings go to
//! stderr and what zram-generator would have done with the devices to stdout, as the server
//! prints them at start.

use crate::config::ServeConfig;
use crate::host::ram_bytes_from;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

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

/// The directories zram-generator reads its configuration from, under `root`, lowest
/// precedence first (zram-generator.conf(5)).
pub const CONFIG_DIRS: [&str; 4] = ["usr/lib", "usr/local/lib", "etc", "run"];

/// zram-generator's configuration files under `root` (`/`, or `$ZRAM_GENERATOR_ROOT`), in
/// the order it reads them, found as its `locate_fragments` finds them: first the main file
/// `systemd/zram-generator.conf` of the highest-precedence directory of [`CONFIG_DIRS`] that
/// has one (`run`, then `etc`, `usr/local/lib`, `usr/lib`; only that one), then the `*.conf`
/// files of the `systemd/zram-generator.conf.d` directories as liboverdrop's `scan` gives
/// them: sorted by file name whichever directory holds it; of files with the same name, the
/// one in the highest-precedence directory replaces the others, and a symlink to `/dev/null`
/// there masks them all; names starting with `.`, and what is not a regular file, are skipped;
/// unreadable directories count as empty.
pub fn locate_fragments(root: &Path) -> Vec<PathBuf> {
    let dirs = CONFIG_DIRS.map(|dir| root.join(dir));
    let dropins = liboverdrop::scan(&dirs, "systemd/zram-generator.conf.d", &["conf"], true);
    let main = dirs
        .iter()
        .rev()
        .map(|dir| dir.join("systemd/zram-generator.conf"))
        .find(|p| p.exists());
    main.into_iter().chain(dropins.into_values()).collect()
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
    let files = locate_fragments(&root);
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
            CONFIG_DIRS.join(",")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_are_found_in_zram_generators_order() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../cli/tests/fixtures/zram-generator/04-dropins");
        let got: Vec<String> = locate_fragments(&root)
            .iter()
            .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
            .collect();
        assert_eq!(
            got,
            [
                "usr/lib/systemd/zram-generator.conf",
                "usr/lib/systemd/zram-generator.conf.d/01-drop1.conf",
                "usr/lib/systemd/zram-generator.conf.d/02-drop2.conf",
                "etc/systemd/zram-generator.conf.d/03-drop3.conf",
                "etc/systemd/zram-generator.conf.d/04-drop4.conf",
                "etc/systemd/zram-generator.conf.d/zram-generator.conf",
            ]
        );
        // /etc's main file wins over /usr/lib's (only one main file is read).
        let dir = tempfile::tempdir().unwrap();
        for d in ["usr/lib/systemd", "etc/systemd"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
            std::fs::write(dir.path().join(d).join("zram-generator.conf"), "").unwrap();
        }
        assert_eq!(
            locate_fragments(dir.path()),
            [dir.path().join("etc/systemd/zram-generator.conf")]
        );
        assert!(locate_fragments(&dir.path().join("nowhere")).is_empty());
        // liboverdrop's rules: a symlink to /dev/null in a higher directory masks a drop-in of
        // that name; names starting with `.`, other extensions and directories are skipped.
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("usr/lib/systemd/zram-generator.conf.d");
        let etc = dir.path().join("etc/systemd/zram-generator.conf.d");
        for d in [&lib, &etc] {
            std::fs::create_dir_all(d).unwrap();
        }
        for name in ["10-a.conf", "20-b.conf", ".30-c.conf", "40-d.txt"] {
            std::fs::write(lib.join(name), "").unwrap();
        }
        std::os::unix::fs::symlink("/dev/null", etc.join("10-a.conf")).unwrap();
        std::fs::create_dir(etc.join("50-e.conf")).unwrap();
        assert_eq!(locate_fragments(dir.path()), [lib.join("20-b.conf")]);
    }
}
