//! `uzram bench vm` at a tiny size, so the benchmark keeps working: one guest (QEMU, Debian's
//! 6.12 kernel) runs fio on the vhost-user disk, the NBD disk and its own kernel zram, and the
//! host writes the tables (IOPS, and the host's CPU per I/O) and the JSON. No timing is
//! asserted.

use std::process::Command;

#[test]
fn bench_vm_measures_three_disks_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("vm.json");
    let out = Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args([
            "bench",
            "vm",
            "--runtime",
            "1",
            "--repeats",
            "1",
            "--size",
            "32M",
            "--mem-mb",
            "384",
            "--json",
            json.to_str().unwrap(),
            "--plot",
            dir.path().join("vm.png").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("vhost/nbd"), "{text}");
    assert!(text.contains("CPU µs per I/O"), "{text}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let points = doc["points"].as_array().unwrap();
    assert_eq!(points.len(), 4, "{doc}");
    for p in points {
        for t in ["vhost-user", "nbd", "guest-zram"] {
            assert!(p["iops"][t].as_f64().unwrap() > 0.0, "{t}: {p}");
        }
        assert!(p["ratio_vhost_over_nbd"].as_f64().unwrap() > 0.0, "{p}");
        // The host's CPU per I/O, from the marks around each run: QEMU's for every target,
        // the server's for the two on the uzram device.
        for t in ["vhost-user", "nbd", "guest-zram"] {
            assert!(
                p["cpu_us_per_io"][t]["qemu"].as_f64().unwrap() > 0.0,
                "{t}: {p}"
            );
        }
        for t in ["vhost-user", "nbd"] {
            assert!(
                p["cpu_us_per_io"][t]["server"].as_f64().unwrap() > 0.0,
                "{t}: {p}"
            );
        }
        assert!(p["cpu_ratio_nbd_over_vhost"].as_f64().unwrap() > 0.0, "{p}");
    }
    // --plot: a PNG (its pixels are checked for every chart in bench_smoke.rs).
    let png = std::fs::read(dir.path().join("vm.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}
