//! `uzram serve --zram-generator-conf` with zram-generator's own example configuration (its
//! `set!` directive running a stub `xenstore-read`, as zram-generator's test 10-example does,
//! and MemTotal from `ZRAM_GENERATOR_ROOT/proc/meminfo`), and the same size expressions with
//! units in uzram's TOML configuration: the built binary, what `uzram ctl` shows afterwards.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use uzram_testkit::serve::{uzram_bin, Running, Serve};

const MIB: u64 = 1 << 20;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/zram-generator")
}

/// `uzram serve --dir TMP ARGS` with `env`, until "serving"; `Err((stdout, stderr))` if it
/// exits first.
fn serve(args: &[&str], env: &[(&str, String)]) -> Result<Running, (String, String)> {
    let mut serve = Serve::args(&["--dir", "{dir}"]).arg(args);
    for (k, v) in env {
        serve = serve.env(k, v);
    }
    serve.try_start().map_err(|f| (f.stdout, f.stderr))
}

/// Asserts that `uzram serve` printed `text` before "serving".
fn assert_said(r: &Running, text: &str) {
    let banner = banner(r);
    assert!(banner.contains(text), "{text:?} not in:\n{banner}");
}

/// What `uzram serve` printed before "serving".
fn banner(r: &Running) -> String {
    r.banner().iter().map(|l| format!("{l}\n")).collect()
}

/// A PATH with a stub `xenstore-read` first, printing what zram-generator's test 10-example's
/// stub prints (8 GiB of hotplug memory, in MiB).
fn stub_path(dir: &Path) -> String {
    let stub = dir.join("xenstore-read");
    std::fs::write(&stub, "#!/bin/sh\necho '8 * 1024'  # MB\n").unwrap();
    std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

fn column(text: &str, i: usize) -> u64 {
    text.split_whitespace().nth(i).unwrap().parse().unwrap()
}

#[test]
fn the_manuals_example_configures_what_zram_generator_would() {
    let stubs = tempfile::tempdir().unwrap();
    let env = [
        ("PATH", stub_path(stubs.path())),
        (
            "ZRAM_GENERATOR_ROOT",
            fixtures().join("root").display().to_string(),
        ),
    ];
    let example = fixtures().join("zram-generator.conf.example");

    // As shipped, its writeback device does not exist here: refused, naming file and key.
    let (_, err) = serve(&["--zram-generator-conf", example.to_str().unwrap()], &env)
        .expect_err("a missing writeback device is an error");
    assert!(
        err.contains("zram-generator.conf.example: zram0: backing_dev = \"/dev/zvol/tarta-zoot/swap-writeback\""),
        "{err}"
    );

    // With a writeback file that exists, everything else as shipped.
    let backing = tempfile::NamedTempFile::new().unwrap();
    backing.as_file().set_len(64 * MIB).unwrap();
    let conf = stubs.path().join("zram-generator.conf");
    let text = std::fs::read_to_string(&example).unwrap().replace(
        "/dev/zvol/tarta-zoot/swap-writeback",
        backing.path().to_str().unwrap(),
    );
    std::fs::write(&conf, text).unwrap();
    let r = serve(&["--zram-generator-conf", conf.to_str().unwrap()], &env).unwrap();
    let err = r.log();
    // lzo-rle is not in uzram: a warning with the file and key, the device keeps lz4.
    assert!(
        err.contains("zram-generator.conf: zram0: compression-algorithm"),
        "{err}"
    );
    assert!(r.show("zram0", "comp_algorithm").contains("[lz4]"));
    assert!(
        r.show("zram0", "recomp_algorithm").starts_with("#1: ")
            && r.show("zram0", "recomp_algorithm").contains("[zstd]"),
        "{}",
        r.show("zram0", "recomp_algorithm")
    );
    // MemTotal 801322 kB is 782 MiB: zram-size = min(ram / 10, 2048) = 78.2 MiB, as
    // zram-generator computes it (a float, truncated to bytes), rounded up to pages by disksize.
    let size = (782.0f64 / 10.0 * MIB as f64) as u64;
    assert_eq!(
        r.show("zram0", "disksize").trim(),
        (size.div_ceil(4096) * 4096).to_string()
    );
    // zram-resident-limit = maxhotplug * 3/4, maxhotplug from the stub: 6144 MiB.
    assert_eq!(column(&r.show("zram0", "mm_stat"), 3), 6144 * MIB);
    assert_eq!(
        r.show("zram0", "backing_dev").trim(),
        backing.path().to_str().unwrap()
    );
    assert_eq!(
        r.show("zram1", "disksize").trim(),
        r.show("zram0", "disksize").trim()
    );
    // What zram-generator would have done next, said on stdout.
    assert_said(
        &r,
        "zram0: zram-generator would make it swap: mkswap DEV && swapon --priority 100 DEV",
    );
    assert_said(&r, "recompress type=idle");
    assert_said(&r, "zram1: zram-generator would make a file system and mount it: mkfs.ext2 DEV && mount -o discard DEV /run/compressed-mount-point");
    r.stop();

    // On a host with more RAM than host-memory-limit (9048 MiB), zram0 is left out.
    let big = stubs.path().join("root/proc");
    std::fs::create_dir_all(&big).unwrap();
    std::fs::write(big.join("meminfo"), "MemTotal:       16384000 kB\n").unwrap();
    let env = [
        ("PATH", stub_path(stubs.path())),
        (
            "ZRAM_GENERATOR_ROOT",
            stubs.path().join("root").display().to_string(),
        ),
    ];
    let r = serve(&["--zram-generator-conf", conf.to_str().unwrap()], &env).unwrap();
    assert_said(&r, "zram0: not created");
    assert!(!r.dir().join("zram0.ctl").exists());
    // 16000 MiB / 10.
    assert_eq!(
        r.show("zram1", "disksize").trim(),
        (((1600.0 * MIB as f64) as u64).div_ceil(4096) * 4096).to_string()
    );
    r.stop();
}

#[test]
fn toml_sizes_take_the_same_expressions_with_units() {
    let conf = tempfile::NamedTempFile::new().unwrap();
    let write = |disksize: &str| {
        std::fs::write(
            conf.path(),
            format!("[[device]]\nname = \"zram0\"\ndisksize = \"{disksize}\"\n"),
        )
        .unwrap();
    };
    // zram-generator's default, in MiB without a unit: refused, saying which unit to give.
    write("min(ram / 2, 4096)");
    let (_, err) = serve(&["--config", conf.path().to_str().unwrap()], &[]).expect_err("refused");
    assert!(err.contains("disksize") && err.contains("4096M"), "{err}");
    // With units: the smaller of half the RAM and 48 MiB, plus a fraction of 16M.
    write("min(ram / 2, 48M) + 16M * 0.25");
    let r = serve(&["--config", conf.path().to_str().unwrap()], &[]).unwrap();
    assert_eq!(r.show("zram0", "disksize").trim(), (52 * MIB).to_string());
    r.stop();
}

/// `uzram serve --zram-generator` under `ZRAM_GENERATOR_ROOT=ROOT` (one of zram-generator's own
/// test roots, copied in the fixtures).
fn serve_root(root: &str) -> Result<Running, (String, String)> {
    serve(
        &["--zram-generator"],
        &[(
            "ZRAM_GENERATOR_ROOT",
            fixtures().join(root).display().to_string(),
        )],
    )
}

/// `bytes` rounded up to pages, as `disksize` stores it.
fn pages(bytes: f64) -> String {
    ((bytes as u64).div_ceil(4096) * 4096).to_string()
}

/// zram-generator's test 04-dropins: the main file from /usr/lib, drop-ins from /usr/lib and
/// /etc sorted by name, /etc's 03-drop3.conf (empty) masking /usr/lib's, and a drop-in named
/// like the main file that is only a drop-in. zram-generator creates zram0 (its
/// host-memory-limit is 1235 from 02-drop2, above the host's 782 MiB) and zram2 (ram * 0.8,
/// swap priority 200, no options), and no zram1 (only the masked file had it).
#[test]
fn drop_ins_follow_zram_generators_precedence() {
    let r = serve_root("04-dropins").unwrap();
    assert_eq!(
        r.show("zram0", "disksize").trim(),
        pages(391.0 * MIB as f64)
    );
    assert_eq!(
        r.show("zram2", "disksize").trim(),
        pages(782.0 * 0.8 * MIB as f64)
    );
    assert!(!r.dir().join("zram1.ctl").exists(), "{}", banner(&r));
    assert_said(
        &r,
        "zram2: zram-generator would make it swap: mkswap DEV && swapon --priority 200 DEV,",
    );
    assert_said(&r, "swapon --priority 100 --options discard DEV");
    r.stop();
}

/// zram-generator's tests 05-kernel-disabled and 06-kernel-enabled: `systemd.zram=0` on the
/// kernel command line creates nothing even with a configuration (the server says so and
/// exits 0 at once); a bare `systemd.zram` creates zram0 with the defaults without one.
#[test]
fn the_kernel_command_line_turns_devices_off_and_on() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(uzram_bin())
        .args(["serve", "--zram-generator", "--dir"])
        .arg(dir.path())
        .env("ZRAM_GENERATOR_ROOT", fixtures().join("05-kernel-disabled"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("systemd.zram=0"),
        "{out:?}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    // MemTotal 8013220 kB is 7825 MiB: min(ram / 2, 4096) = 3912.5 MiB.
    let r = serve_root("06-kernel-enabled").unwrap();
    assert_eq!(
        r.show("zram0", "disksize").trim(),
        pages(3912.5 * MIB as f64)
    );
    assert_said(&r, "swapon --priority 100");
    r.stop();

    // No configuration and no option: an error naming where zram-generator looks.
    let empty = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(empty.path().join("proc")).unwrap();
    std::fs::write(empty.path().join("proc/meminfo"), "MemTotal: 1048576 kB\n").unwrap();
    std::fs::write(empty.path().join("proc/cmdline"), "quiet\n").unwrap();
    let (_, err) = serve(
        &["--zram-generator"],
        &[("ZRAM_GENERATOR_ROOT", empty.path().display().to_string())],
    )
    .expect_err("nothing to serve");
    assert!(
        err.contains("no zram-generator configuration under")
            && err.contains("{usr/lib,usr/local/lib,etc,run}/systemd/zram-generator.conf"),
        "{err}"
    );
}
