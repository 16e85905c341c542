//! `uzram bench blk` at a tiny size, so the benchmark keeps working: one guest (QEMU, Debian's
//! 6.12 kernel) serves a uzram device as ublk and NBD (the guest kernel's client) and runs fio
//! on both and on its own kernel zram; the host writes the table and the JSON. No timing is
//! asserted.

mod guest_bench_support;

#[test]
fn bench_blk_measures_three_block_devices_and_writes_json() {
    let (text, doc) = guest_bench_support::run_guest_bench(
        "blk",
        512,
        "ublk/nbd",
        ["ublk", "nbd", "guest-zram"],
        6,
    );
    for p in doc["points"].as_array().unwrap() {
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
}
