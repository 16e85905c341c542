//! The systemd units in contrib/: `systemd-analyze verify` accepts them (syntax, every setting,
//! dependencies, the executable, the man pages of `Documentation=`) with their `ExecStart`
//! pointed at the built binary and the man pages `uzram package-files` writes, the
//! offline security analysis rates their sandboxing "OK" or better, and the command lines they
//! run are ones `uzram serve` accepts. Nothing here needs a running systemd: CI containers have
//! none.

use std::path::Path;
use std::process::Command;
use uzram_testkit::process::require;

const BIN: &str = env!("CARGO_BIN_EXE_uzram");
const UNITS: [&str; 2] = ["uzram.service", "uzram-swap.service"];
/// How the units run the command: by name, as systemd finds it in /usr/local/bin (installed by
/// hand) or /usr/bin (the package).
const EXEC_START: &str = "ExecStart=uzram ";

/// The units, with the command replaced by the built binary, and the man pages (`man/`), in a
/// temporary directory.
fn units() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let contrib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../contrib");
    for u in UNITS {
        let text = std::fs::read_to_string(contrib.join(u)).unwrap();
        assert!(text.contains(EXEC_START), "{u} runs {EXEC_START}");
        let text = text.replace(EXEC_START, &format!("ExecStart={BIN} "));
        std::fs::write(dir.path().join(u), text).unwrap();
    }
    let out = Command::new(BIN)
        .arg("package-files")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    dir
}

#[test]
fn the_units_pass_systemd_analyze_verify() {
    require("systemd-analyze");
    let dir = units();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .args(UNITS.map(|u| dir.path().join(u)))
        .env("MANPATH", dir.path().join("man"))
        .output()
        .unwrap();
    // Unknown keys and bad values are only warnings to verify: none may be printed.
    assert!(
        out.status.success() && out.stderr.is_empty() && out.stdout.is_empty(),
        "{out:?}"
    );
    // A unit with a typo fails this check (the check can fail).
    let bad = dir.path().join("typo.service");
    std::fs::write(
        &bad,
        format!("[Service]\nExecStart={BIN} serve\nRestrat=always\n"),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.stderr.is_empty(), "{out:?}");
}

#[test]
fn the_units_sandboxing_rates_ok() {
    require("systemd-analyze");
    let dir = units();
    for u in UNITS {
        // Exposure at most 5.0 of 10 ("OK"); the figure is printed for the log.
        let out = Command::new("systemd-analyze")
            .args(["--offline=true", "--threshold=50", "security"])
            .arg(dir.path().join(u))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let last = text.lines().last().unwrap_or_default();
        println!("{last}");
        assert!(out.status.success(), "{u}: {last}\n{out:?}");
    }
}

#[test]
fn the_units_command_lines_are_accepted() {
    let dir = units();
    for u in UNITS {
        let text = std::fs::read_to_string(dir.path().join(u)).unwrap();
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .expect("ExecStart");
        let mut words = line.split_whitespace();
        assert_eq!(words.next(), Some(BIN));
        // Parsed by `uzram serve` (which then only prints its default configuration).
        let out = Command::new(BIN)
            .args(words)
            .arg("--print-default-config")
            .output()
            .unwrap();
        assert!(out.status.success(), "{u}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("[[device]]"));
    }
}
