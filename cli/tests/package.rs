//! The Debian package, as a person installs it: `scripts/deb` builds it (with the binary `cargo
//! test` built, `--no-build`), `dpkg -i` installs it into a throwaway root (`--root`), and there
//! the installed `uzram --version` names the version and commit, `man -l` reads a page, the
//! default configuration is a conffile, the bash completion loads, and `systemd-analyze verify
//! --root` accepts the installed units: `ExecStart=uzram` found in the root's /usr/bin and their
//! `Documentation=man:` pages in the root's man directory.
//!
//! Needs cargo-deb (scripts/test installs it from crates.io), dpkg, man and systemd-analyze.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use uzram_testkit::process::{require, run, run_stdout};

const BIN: &str = env!("CARGO_BIN_EXE_uzram");
const UNITS: [&str; 2] = ["uzram.service", "uzram-swap.service"];

/// The package, built by scripts/deb from the binary under test into `out`.
fn build_package(out: &Path) -> PathBuf {
    let cargo_deb = Command::new("cargo").args(["deb", "--version"]).output();
    assert!(
        cargo_deb.is_ok_and(|o| o.status.success()),
        "cargo-deb is missing: `cargo install cargo-deb --locked` (scripts/test does)"
    );
    // The binary is TARGET/PROFILE/uzram: the package is made from it, in that profile.
    let bin = Path::new(BIN);
    let profile_dir = bin.parent().unwrap();
    let profile = profile_dir.file_name().unwrap().to_str().unwrap();
    let target = profile_dir.parent().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    run(Command::new(root.join("scripts/deb"))
        .arg("--no-build")
        .arg("--output")
        .arg(out)
        .env("PROFILE", profile)
        .env("CARGO_TARGET_DIR", target));
    let debs: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "deb"))
        .collect();
    assert_eq!(debs.len(), 1, "{debs:?}");
    debs.into_iter().next().unwrap()
}

/// A throwaway root with an empty dpkg database, and the package installed into it.
fn install(deb: &Path, root: &Path) {
    for d in ["var/lib/dpkg/info", "var/lib/dpkg/updates"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    // --force-depends: the root has no libc6 package; the files are all that is checked.
    run(Command::new("dpkg")
        .arg(format!("--root={}", root.display()))
        .args(["--force-depends", "-i"])
        .arg(deb));
    let status = run_stdout(
        Command::new("dpkg")
            .arg(format!("--root={}", root.display()))
            .args(["-s", "uzram"]),
    );
    assert!(status.contains("Status: install ok installed"), "{status}");
}

/// The commit `uzram --version` must name, when the sources are a git checkout.
fn git_commit() -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(env!("CARGO_MANIFEST_DIR"))
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `systemd-analyze verify --root=ROOT` of `units`, with ROOT's man pages; systemd's own units
/// (the targets and slices the units order against) are copied from the host into the root,
/// which has only the package's files.
fn verify(root: &Path, units: &[&str]) -> Output {
    Command::new("systemd-analyze")
        .arg("verify")
        .arg(format!("--root={}", root.display()))
        .args(units)
        .env("MANPATH", root.join("usr/share/man"))
        .output()
        .unwrap()
}

fn copy_systemd_units(root: &Path) {
    let dest = root.join("usr/lib/systemd/system");
    std::fs::create_dir_all(&dest).unwrap();
    for e in std::fs::read_dir("/lib/systemd/system").unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        let wanted = name.ends_with(".target")
            || name.ends_with(".slice")
            || name == "systemd-modules-load.service";
        if wanted && p.is_file() {
            std::fs::copy(&p, dest.join(&name)).unwrap();
        }
    }
}

#[test]
fn the_package_installs_and_what_it_installs_works() {
    for p in ["dpkg", "man", "systemd-analyze", "gzip"] {
        require(p);
    }
    let out = tempfile::tempdir().unwrap();
    let deb = build_package(out.path());
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    install(&deb, root);

    // The installed binary: version and commit.
    let installed = root.join("usr/bin/uzram");
    let version = run_stdout(Command::new(&installed).arg("--version"));
    assert!(
        version.starts_with(&format!("uzram {} (", env!("CARGO_PKG_VERSION"))),
        "{version}"
    );
    if let Some(commit) = git_commit() {
        assert!(version.contains(&commit), "{version} names no {commit}");
    }

    // Its man pages: one per command, readable by man.
    let man1 = root.join("usr/share/man/man1");
    let page = run_stdout(
        Command::new("man")
            .arg("-l")
            .arg(man1.join("uzram-serve.1.gz"))
            .env("MANWIDTH", "100"),
    );
    assert!(
        page.contains("uzram-serve") && page.contains("--config"),
        "{page}"
    );
    for cmd in ["uzram", "uzram-ctl", "uzram-status", "uzram-serve"] {
        assert!(man1.join(format!("{cmd}.1.gz")).is_file(), "{cmd}.1.gz");
    }

    // The default configuration, a conffile, as `serve --print-default-config` prints it.
    let conffiles =
        std::fs::read_to_string(root.join("var/lib/dpkg/info/uzram.conffiles")).unwrap();
    assert!(
        conffiles.lines().any(|l| l == "/etc/uzram/uzram.toml"),
        "{conffiles}"
    );
    let default = run_stdout(Command::new(&installed).args(["serve", "--print-default-config"]));
    assert_eq!(
        std::fs::read_to_string(root.join("etc/uzram/uzram.toml")).unwrap(),
        default
    );

    // The bash completion loads and completes `uzram`.
    let bash = root.join("usr/share/bash-completion/completions/uzram");
    let complete = run_stdout(
        Command::new("bash")
            .arg("-c")
            .arg(format!("source {} && complete -p uzram", bash.display())),
    );
    assert!(complete.contains("uzram"), "{complete}");
    for f in [
        "usr/share/zsh/vendor-completions/_uzram",
        "usr/share/fish/vendor_completions.d/uzram.fish",
    ] {
        assert!(root.join(f).is_file(), "{f}");
    }

    // The installed units pass verify with the root's binary and man pages...
    copy_systemd_units(root);
    for u in UNITS {
        assert!(root.join("lib/systemd/system").join(u).is_file(), "{u}");
    }
    let out = verify(root, &UNITS);
    assert!(
        out.status.success() && out.stderr.is_empty() && out.stdout.is_empty(),
        "{out:?}"
    );
    // ... and fail it without them (the check looks in the root, not at the host).
    std::fs::rename(&installed, root.join("uzram.moved")).unwrap();
    let out = verify(root, &UNITS[..1]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not executable"),
        "{out:?}"
    );
    std::fs::rename(root.join("uzram.moved"), &installed).unwrap();
    std::fs::remove_file(man1.join("uzram-serve.1.gz")).unwrap();
    let out = verify(root, &UNITS[..1]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("uzram-serve(1)"),
        "{out:?}"
    );
}

#[test]
fn version_names_the_commit() {
    let out = run_stdout(Command::new(BIN).arg("--version"));
    let expected = match git_commit() {
        Some(c) => c,
        None => "unknown commit".to_string(),
    };
    assert!(
        out.starts_with(&format!("uzram {} (", env!("CARGO_PKG_VERSION")))
            && out.contains(&expected),
        "{out}"
    );
}
