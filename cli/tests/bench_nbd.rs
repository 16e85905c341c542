//! `uzram bench nbd` at a tiny size, so the benchmark keeps working: it runs fio against
//! uzram's server and nbdkit's two memory allocators and writes its JSON. No timing is
//! asserted; the kernel anchor is left out (it would reset a zram0 someone may be using).

use std::process::Command;
use uzram_testkit::process::{require, run};

#[test]
fn bench_nbd_measures_uzram_and_nbdkit_and_writes_json() {
    require("fio");
    require("nbdkit");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("nbd.json");
    let out = run(Command::new(env!("CARGO_BIN_EXE_uzram")).args([
        "bench",
        "nbd",
        "--runtime",
        "1",
        "--size",
        "16M",
        "--rw",
        "randrw",
        "--iodepths",
        "1,4",
        "--jobs",
        "1,2",
        "--no-kernel",
        "--json",
        json.to_str().unwrap(),
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("uzram/nbdkit-sparse"), "{text}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let points = doc["points"].as_array().unwrap();
    let count = |t: &str| points.iter().filter(|p| p["target"] == t).count();
    assert_eq!(count("uzram"), 4);
    assert_eq!(count("nbdkit-sparse"), 4);
    assert_eq!(count("nbdkit-zstd"), 2, "one connection only");
    for p in points {
        assert!(p["iops"].as_f64().unwrap() > 0.0, "{p}");
        assert!(
            p["p99_us"].as_f64().unwrap() >= p["p50_us"].as_f64().unwrap(),
            "{p}"
        );
    }
    let ratios = doc["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 4);
    assert!(
        ratios[0]["ratio_uzram_over"]["nbdkit-sparse"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(ratios[0]["ratio_uzram_over"]["kernel-psync"].is_null());
}
