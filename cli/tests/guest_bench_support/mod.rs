//! Running `uzram bench vm` or `uzram bench blk` at a tiny size (1 s per point, one run, 32 MiB,
//! one guest boot) and the checks both smoke tests make: it succeeded, printed its ratio
//! column, wrote a JSON with every point measured on all three devices, and drew a PNG.

use std::process::Command;

/// Runs `uzram bench NAME` in a guest of `mem_mb` MiB; checks that it printed `ratio_column`
/// and that each of its `points` points has IOPS for every one of `targets`. Returns the
/// table it printed and its JSON document.
pub fn run_guest_bench(
    name: &str,
    mem_mb: u32,
    ratio_column: &str,
    targets: [&str; 3],
    points: usize,
) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join(format!("{name}.json"));
    let png = dir.path().join(format!("{name}.png"));
    let out = Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args(["bench", name, "--runtime", "1", "--repeats", "1"])
        .args(["--size", "32M", "--mem-mb", &mem_mb.to_string()])
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(&png)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(ratio_column), "{text}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let got = doc["points"].as_array().unwrap();
    assert_eq!(got.len(), points, "{doc}");
    for p in got {
        for t in targets {
            assert!(p["iops"][t].as_f64().unwrap() > 0.0, "{t}: {p}");
        }
    }
    // --plot: a PNG (its pixels are checked for every chart in bench_smoke.rs).
    let png = std::fs::read(&png).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    (text, doc)
}
