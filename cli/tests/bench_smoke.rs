//! `uzram bench store` end to end on a small corpus of real pages (this test process's own
//! memory, snapshotted like `uzram corpus` does): the command succeeds, prints its table and
//! writes JSON with every key the issue names, each a finite positive figure. No timing is
//! asserted.

use std::path::Path;
use std::process::Command;

/// A corpus file of real pages: a snapshot (at most `max_pages`) of this test process, which
/// holds a heap of mixed data built for the purpose. Returns its path inside `dir`.
fn self_corpus(dir: &Path, max_pages: usize) -> std::path::PathBuf {
    let heap: Vec<String> = (0..200_000)
        .map(|i| format!("entry {i} / {}", i * 31))
        .collect();
    let mut pages = Vec::new();
    let n =
        uzram_bench::corpus::snapshot_pid(std::process::id(), 4096, max_pages, &mut pages).unwrap();
    assert!(n >= 64, "only {n} pages in the snapshot");
    let mut corpus = uzram_bench::corpus::Corpus::new(4096).unwrap();
    corpus.add_source("self", &pages).unwrap();
    let path = dir.join("pages.bin");
    corpus.save(&path).unwrap();
    drop(heap);
    path
}

/// Runs `uzram bench ARGS... --corpus CORPUS [--backing BACKING] --json DIR/NAME.json`,
/// checks it succeeded and printed every string of `expect`, and returns the JSON it wrote.
fn run_bench(
    dir: &Path,
    name: &str,
    args: &[&str],
    corpus: &Path,
    backing: Option<&Path>,
    expect: &[&str],
) -> serde_json::Value {
    let json_path = dir.join(format!("{name}.json"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_uzram"));
    cmd.arg("bench").args(args).arg("--corpus").arg(corpus);
    if let Some(b) = backing {
        cmd.arg("--backing").arg(b);
    }
    let png_path = dir.join(format!("{name}.png"));
    let stdout = uzram_testkit::process::run_stdout(
        cmd.arg("--json")
            .arg(&json_path)
            .arg("--plot")
            .arg(&png_path),
    );
    for e in expect {
        assert!(stdout.contains(e), "{e:?} missing from: {stdout}");
    }
    check_plot(&png_path);
    serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap()
}

/// `--plot`'s PNG: 1000 pixels wide, white, with bars (uzram's blue) and text (dark pixels
/// left of the bars, where the labels are: the font was found and drawn).
fn check_plot(path: &Path) {
    let decoder = png::Decoder::new(std::fs::File::open(path).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.width, 1000, "{}", path.display());
    assert_eq!(info.color_type, png::ColorType::Rgb);
    let px = |x: u32, y: u32| {
        let i = ((y * info.width + x) * 3) as usize;
        (buf[i], buf[i + 1], buf[i + 2])
    };
    let (mut blue, mut dark_left) = (0, 0);
    for y in 0..info.height {
        for x in 0..info.width {
            let (r, g, b) = px(x, y);
            if (r, g, b) == (47, 98, 168) {
                blue += 1;
            }
            if x < 200 && r < 100 && g < 100 && b < 100 {
                dark_left += 1;
            }
        }
    }
    assert!(blue > 100, "{}: no bars", path.display());
    assert!(dark_left > 100, "{}: no labels", path.display());
}

#[test]
fn bench_store_writes_its_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let corpus_path = self_corpus(dir.path(), 512);

    let doc = run_bench(
        dir.path(),
        "store",
        &["store", "--repeats", "1", "--no-kernel"],
        &corpus_path,
        None,
        &["packing after compact"],
    );
    for key in [
        "raw_compress_mbps",
        "raw_decompress_mbps",
        "write_mbps",
        "read_mbps",
        "write_vs_raw",
        "read_vs_raw",
        "overwrite_vs_raw",
        "packing_filled",
        "packing_after_trim",
        "packing_after_compact",
        "metadata_bytes_per_page",
    ] {
        let v = doc[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing: {doc}"));
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    assert_eq!(doc["metadata_bytes_per_page"], 16);
    // The kernel anchor was skipped, and says so rather than inventing figures.
    assert!(doc["kernel_packing_filled"].is_null());
    // `uzram bench plot`: the same chart drawn again from the JSON written; a file that is
    // not a benchmark's JSON is an error naming it.
    let png = dir.path().join("replot.png");
    let out = Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args(["bench", "plot"])
        .arg(dir.path().join("store.json"))
        .arg("--plot")
        .arg(&png)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    check_plot(&png);
    let out = Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args(["bench", "plot"])
        .arg(&corpus_path)
        .arg("--plot")
        .arg(&png)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not JSON"),
        "{out:?}"
    );
}

/// `uzram bench writeback` end to end at a tiny size: a corpus of this process's memory, a
/// backing file on the local disk, both layouts, batch 1 (sync) and 8 (io_uring). The command
/// succeeds, prints its table and writes JSON with every key the issue names. No timing is
/// asserted.
#[test]
fn bench_writeback_writes_its_table_and_json() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap_or_else(|_| tempfile::tempdir().unwrap());
    let corpus_path = self_corpus(dir.path(), 256);

    let backing = dir.path().join("backing.img");
    let doc = run_bench(
        dir.path(),
        "writeback",
        &[
            "writeback",
            "--pages",
            "500",
            "--batch-sizes",
            "1,8",
            "--layout",
            "sequential,fragmented",
            "--repeats",
            "1",
            "--no-progress",
        ],
        &corpus_path,
        Some(&backing),
        &["ceiling of the same file", "zoned"],
    );
    for layout in ["sequential", "fragmented"] {
        for batch in ["1", "8"] {
            let v = doc["pages_per_s"][layout][batch].as_f64().unwrap();
            assert!(
                v.is_finite() && v > 0.0,
                "pages_per_s {layout} {batch} = {v}"
            );
        }
        let x = doc["speedup_vs_batch1"][layout]["8"].as_f64().unwrap();
        assert!(x.is_finite() && x > 0.0, "{x}");
    }
    for pattern in ["sequential", "random"] {
        for depth in ["1", "32"] {
            let v = doc["ceiling_pages_per_s"][pattern][depth].as_f64().unwrap();
            assert!(v.is_finite() && v > 0.0, "ceiling {pattern} {depth} = {v}");
        }
    }
    // The zoned store ran too (the default `--store bitmap,zoned`), with the comparison keys.
    for key in uzram_bench::writeback::COMPARISON_KEYS {
        let v = doc[key].as_f64().unwrap_or(f64::NAN);
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    // The backing file is removed afterwards.
    assert!(!backing.exists());
}

#[test]
fn bench_gc_writes_its_table_and_json() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap_or_else(|_| tempfile::tempdir().unwrap());
    let corpus_path = self_corpus(dir.path(), 512);

    let backing = dir.path().join("gc.img");
    let doc = run_bench(
        dir.path(),
        "gc",
        &["gc", "--zone-size", "2M", "--zones", "5", "--repeats", "2"],
        &corpus_path,
        Some(&backing),
        &["GC time ms"],
    );
    for key in ["gc_ms_ring", "gc_ms_bank", "gc_ratio", "seq_write_mbps"] {
        let v = doc[key].as_f64().unwrap_or_else(|| panic!("{key}: {doc}"));
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    // Each run reclaimed zones and relocated the surviving half.
    for run in doc["runs"].as_array().unwrap() {
        assert!(run["zones_reclaimed"].as_u64().unwrap() >= 1, "{run}");
    }
    assert!(!backing.exists(), "the backing file is removed");
}

/// `uzram bench gc --device-model smr-hdd` at a tiny size: the modelled write cache took the
/// writes and destaged them (the model's counters in the JSON), the table has the modelled
/// device's busy share, and a command-queue override without a model is refused.
#[test]
fn bench_gc_under_the_cached_hdd_model() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap_or_else(|_| tempfile::tempdir().unwrap());
    let corpus_path = self_corpus(dir.path(), 512);
    let backing = dir.path().join("gc-model.img");
    let doc = run_bench(
        dir.path(),
        "gc-model",
        &[
            "gc",
            "--zone-size",
            "2M",
            "--zones",
            "5",
            "--repeats",
            "1",
            "--device-model",
            "smr-hdd",
        ],
        &corpus_path,
        Some(&backing),
        &[
            "device model smr-hdd",
            "modelled device busy",
            "write cache",
        ],
    );
    let m = &doc["device_model"];
    assert_eq!(m["name"], "smr-hdd", "{doc}");
    assert_eq!(m["queue_depth"], 32);
    for key in [
        "cached_writes",
        "destaged_bytes",
        "destages",
        "write_cache_bytes",
    ] {
        assert!(m[key].as_u64().unwrap_or(0) > 0, "{key}: {m}");
    }
    for run in doc["runs"].as_array().unwrap() {
        let busy = run["device_busy_ms"].as_f64().unwrap();
        assert!(
            busy > 0.0 && busy <= run["gc_ms"].as_f64().unwrap() * 1.5,
            "{run}"
        );
    }
    assert!(!backing.exists(), "the backing file is removed");

    let out = Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args(["bench", "gc", "--model-queue-depth", "1", "--corpus"])
        .arg(&corpus_path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--model-queue-depth needs --device-model"),
        "{stderr}"
    );
}

/// `uzram bench recompress` end to end at a tiny size: the command succeeds, prints its table
/// and writes JSON with the figures, each finite and positive. No figure is asserted
/// against its target here (this process's memory is not the corpus the targets are for).
#[test]
fn bench_recompress_writes_its_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let corpus_path = self_corpus(dir.path(), 512);
    let doc = run_bench(
        dir.path(),
        "recompress",
        &[
            "recompress",
            "--repeats",
            "1",
            "--dict-size",
            "16K",
            "--samples",
            "256",
        ],
        &corpus_path,
        None,
        &["zstd level 3", "dictionary", "read / raw"],
    );
    for key in [
        "zstd_vs_lz4_saving",
        "read_vs_raw",
        "dict_read_vs_raw",
        "cpu_us_per_recompressed_page",
    ] {
        let v = doc[key].as_f64().unwrap_or_else(|| panic!("{key}: {doc}"));
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    for stage in ["zstd", "zstd_dict"] {
        for key in [
            "compr_data_size",
            "mem_used_total",
            "pages_recompressed",
            "read_mbps",
            "raw_decompress_mbps",
        ] {
            let v = doc[stage][key].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v > 0.0, "{stage}.{key} = {v}");
        }
    }
    assert!(doc["dict_vs_zstd_saving"].as_f64().unwrap().is_finite());
    assert!(doc["lz4"]["compr_data_size"].as_u64().unwrap() > 0);
}

/// `uzram bench multipage` end to end on 64 KiB pages of this process's memory: both rows
/// (off and 64K) have finite positive figures (the 4 KiB overwrite pass's too), every 64 KiB write of the 64K row made a
/// multi-page object, and a corpus of 4 KiB pages is refused.
#[test]
fn bench_multipage_writes_its_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let heap: Vec<String> = (0..400_000)
        .map(|i| format!("entry {i} / {}", i * 31))
        .collect();
    let mut pages = Vec::new();
    let n = uzram_bench::corpus::snapshot_pid(std::process::id(), 65536, 64, &mut pages).unwrap();
    assert!(n >= 8, "only {n} pages of 64 KiB in the snapshot");
    let mut corpus = uzram_bench::corpus::Corpus::new(65536).unwrap();
    corpus.add_source("self", &pages).unwrap();
    let path = dir.path().join("pages-64k.bin");
    corpus.save(&path).unwrap();
    drop(heap);

    let args = [
        "multipage",
        "--repeats",
        "1",
        "--no-kernel",
        "--codecs",
        "lz4",
        "--multi-page-size",
        "4096,64K",
    ];
    let doc = run_bench(
        dir.path(),
        "multipage",
        &args,
        &path,
        None,
        &["4096 (off)", "65536"],
    );
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{doc}");
    for row in rows {
        for key in [
            "compr_data_size_bytes",
            "mem_used_total_bytes",
            "write_mbps_cpu",
            "seq_read_mbps_cpu",
            "rand_read_mbps_cpu",
            "rand_write_mbps_cpu",
            "rand_write_mem_used_max_bytes",
        ] {
            let v = row[key].as_f64().unwrap_or_else(|| panic!("{key}: {row}"));
            assert!(v.is_finite() && v > 0.0, "{key} = {v}");
        }
    }
    assert_eq!(rows[0]["multi_objects"], 0);
    let objects = rows[1]["multi_objects"].as_u64().unwrap();
    let same_or_huge =
        rows[1]["same_pages"].as_u64().unwrap() + rows[1]["huge_pages"].as_u64().unwrap();
    assert!(
        objects > 0 && objects * 16 + same_or_huge >= 16 * n as u64 / 2,
        "{doc}"
    );

    let small = self_corpus(dir.path(), 64);
    let out = Command::new(env!("CARGO_BIN_EXE_uzram"))
        .args(["bench", "multipage", "--no-kernel", "--corpus"])
        .arg(&small)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("64 KiB pages"));
}

/// `uzram bench vhost` end to end at a tiny size: its vhost-user-blk driver against
/// `uzram serve --vhost-user` and qemu-storage-daemon (null-co and a raw file on tmpfs; a
/// missing qemu-storage-daemon fails), every point on every target, the read-back of every
/// page of uzram and of the tmpfs file, the ratio rows and the plot. No timing is asserted.
#[test]
fn bench_vhost_writes_its_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let corpus_path = self_corpus(dir.path(), 256);
    // `uzram serve` offers a vhost-user queue per CPU: 2 queues where there are 2 CPUs.
    let two_cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2;
    let (queues, points_per_target) = if two_cpus { ("1,2", 8) } else { ("1", 4) };
    let doc = run_bench(
        dir.path(),
        "vhost",
        &[
            "vhost",
            "--runtime",
            "0.2",
            "--size",
            "4M",
            "--repeats",
            "1",
            "--queues",
            queues,
        ],
        &corpus_path,
        None,
        &["uzram/qsd-tmpfs IOPS", "qsd-null + codec", "targets met:"],
    );
    let points = doc["points"].as_array().unwrap();
    for target in ["uzram", "qsd-null", "qsd-tmpfs"] {
        let mine: Vec<_> = points.iter().filter(|p| p["target"] == target).collect();
        // randread and randwrite, depth 1 and 32, 1 (and 2) queues.
        assert_eq!(mine.len(), points_per_target, "{target}: {doc}");
        for p in mine {
            for key in ["iops", "p50_us", "p99_us", "server_cpu_us_per_request"] {
                let v = p[key].as_f64().unwrap_or_else(|| panic!("{key}: {p}"));
                assert!(v.is_finite() && v > 0.0, "{key} = {v}: {p}");
            }
            assert!(p["p99_us"].as_f64() >= p["p50_us"].as_f64(), "{p}");
        }
    }
    assert_eq!(doc["ratios"].as_array().unwrap().len(), points_per_target);
    for key in ["compress_us_per_page", "decompress_us_per_page"] {
        let v = doc["codec"][key].as_f64().unwrap();
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    // Every page of the two targets that keep data was read back and matched.
    assert_eq!(doc["verified_pages"]["uzram"], 1024);
    assert_eq!(doc["verified_pages"]["qsd-tmpfs"], 1024);
    assert!(doc["commands"]["qsd-null"]
        .as_str()
        .unwrap()
        .contains("null-co"));
}

/// `uzram bench sparse-copy` end to end at a tiny size: a 64 MiB device holding 8 MiB of this
/// process's pages in runs of 256 KiB, copied by nbdcopy with and without block status, and
/// nbdkit memory holding the same data. The command succeeds, prints its table and writes
/// JSON; the bytes each server read are exact (the data alone with block status, everything
/// without), the times finite. No timing is asserted.
#[test]
fn bench_sparse_copy_writes_its_table_and_json() {
    uzram_testkit::process::require("nbdcopy");
    uzram_testkit::process::require("nbdkit");
    let dir = tempfile::tempdir().unwrap();
    let corpus_path = self_corpus(dir.path(), 512);
    let doc = run_bench(
        dir.path(),
        "sparse-copy",
        &[
            "sparse-copy",
            "--size",
            "64M",
            "--data",
            "8M",
            "--run",
            "256K",
            "--repeats",
            "1",
        ],
        &corpus_path,
        None,
        &["block-status", "no-extents", "anchor"],
    );
    for server in ["uzram", "nbdkit"] {
        assert_eq!(
            doc[format!("{server}_bytes_read_block_status")],
            8u64 << 20,
            "{doc}"
        );
        assert_eq!(
            doc[format!("{server}_bytes_read_no_extents")],
            64u64 << 20,
            "{doc}"
        );
        for mode in ["block_status", "no_extents"] {
            let v = doc[format!("{server}_median_s_{mode}")].as_f64().unwrap();
            assert!(v.is_finite() && v > 0.0, "{server} {mode} = {v}");
        }
    }
}

/// `uzram bench restart` end to end: a device of real pages and the empty anchor, one kill
/// each; the restart times are finite and positive and every page was verified.
#[test]
fn bench_restart_writes_its_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let corpus_path = self_corpus(dir.path(), 512);
    let doc = run_bench(
        dir.path(),
        "restart",
        &["restart", "--sizes", "8M", "--repeats", "1"],
        &corpus_path,
        None,
        &["kill to first read", "8 MiB"],
    );
    let sizes = doc["sizes"].as_array().unwrap();
    assert_eq!(sizes.len(), 2, "{doc}");
    assert_eq!(sizes[0]["stored_bytes"], 0);
    assert_eq!(sizes[1]["stored_bytes"], 8 << 20);
    assert_eq!(sizes[1]["verified_pages"], 2048);
    for s in sizes {
        let v = s["restart_median_s"].as_f64().unwrap();
        assert!(v.is_finite() && v > 0.0, "{s}");
    }
}
