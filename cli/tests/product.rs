//! The product binary carries none of the engine's test-only parts (the `testing` feature: the
//! in-memory and fault-injecting backings, the device model, the `debug_*`/`bench_*` hooks),
//! and `uzram bench` still reaches the harness, which does.

use std::path::Path;
use std::process::Command;
use uzram_testkit::process::run_stdout;

/// The workspace's root manifest.
fn root_manifest() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml")
}

/// The features of the `uzram` library that `cargo build` would turn on for `packages`
/// (cargo's own resolution, without building): `cargo tree` over normal and build edges.
fn engine_features(packages: &[&str]) -> String {
    run_stdout(
        Command::new(env!("CARGO"))
            .args([
                "tree",
                "--offline",
                "-e",
                "normal,build,features",
                "-i",
                "uzram",
            ])
            .arg("--manifest-path")
            .arg(root_manifest())
            .args(packages),
    )
}

#[test]
fn the_product_build_leaves_testing_off() {
    // `cargo build --release` and `cargo run -- serve` at the root: the default members.
    let product = engine_features(&[]);
    assert!(
        !product.contains("feature \"testing\""),
        "the product build turns on the engine's test-only parts:\n{product}"
    );
    // The same for the `uzram` binary's own package.
    let cli = engine_features(&["-p", "uzram-cli"]);
    assert!(!cli.contains("feature \"testing\""), "{cli}");
    // The check can fail: the whole workspace (the harness among it) does turn it on.
    let all = engine_features(&["--workspace"]);
    assert!(all.contains("feature \"testing\""), "{all}");
}

#[test]
fn uzram_bench_runs_the_harness() {
    let stdout = run_stdout(Command::new(env!("CARGO_BIN_EXE_uzram")).args(["bench", "--help"]));
    assert!(stdout.contains("store"), "{stdout}");
    assert!(stdout.contains("writeback"), "{stdout}");
}
