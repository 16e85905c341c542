//! `uzram bench vm` at a tiny size, so the benchmark keeps working: one guest (QEMU, Debian's
//! 6.12 kernel) runs fio on the vhost-user disk, the NBD disk and its own kernel zram, and the
//! host writes the tables (IOPS, and the host's CPU per I/O) and the JSON. No timing is
//! asserted.

mod guest_bench_support;

#[test]
fn bench_vm_measures_three_disks_and_writes_json() {
    let (_, doc) = guest_bench_support::run_guest_bench(
        "vm",
        384,
        "vhost/nbd",
        ["vhost-user", "nbd", "guest-zram"],
        4,
    );
    for p in doc["points"].as_array().unwrap() {
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
}
