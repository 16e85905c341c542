//! `uzram bench blk` at a tiny size, so the benchmark keeps working: one guest (QEMU, Debian's
//! 6.12 kernel) serves a uzram device as ublk and NBD (the guest kernel's client) and runs fio
//! on both and on its own kernel zram; the host writes the table and the JSON. No timing is
//! asserted.

use std::process::Command;

#[test]
fn bench_blk_measures_three_block_devices_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("blk.json");
    let out = Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args([
            "bench",
            "blk",
            "--runtime",
            "1",
            "--repeats",
            "1",
            "--size",
            "32M",
            "--mem-mb",
            "512",
            "--json",
            json.to_str().unwrap(),
            "--plot",
            dir.path().join("blk.png").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("ublk/nbd"), "{text}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let points = doc["points"].as_array().unwrap();
    assert_eq!(points.len(), 6, "{doc}");
    for p in points {
        for t in ["ublk", "nbd", "guest-zram"] {
            assert!(p["iops"][t].as_f64().unwrap() > 0.0, "{t}: {p}");
        }
        assert!(p["ratio_ublk_over_nbd"].as_f64().unwrap() > 0.0, "{p}");
        // The queue threads' own timing: some time serving each request, at least one
        // request per wake-up.
        let server = &p["ublk_server"];
        assert!(
            server["serve_us_per_request"].as_f64().unwrap() > 0.0,
            "{p}"
        );
        assert!(server["requests_per_wake"].as_f64().unwrap() >= 1.0, "{p}");
    }
    assert!(text.contains("reqs/wake"), "{text}");
    // --plot: a PNG (its pixels are checked for every chart in bench_smoke.rs).
    let png = std::fs::read(dir.path().join("blk.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}
