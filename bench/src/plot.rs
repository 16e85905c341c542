//! `uzram bench … --plot FILE`: a PNG of a benchmark's main comparison, drawn from the JSON the
//! benchmark writes (so a plot always shows exactly the published figures).
//!
//! One kind of chart for every benchmark: horizontal bars, one per figure, the anchor (the
//! baseline the benchmark measures against: kernel zram, synchronous free, batch size 1, bank
//! switching, lz4, 4 KiB objects, nbdkit, the local file) in grey and uzram in blue, each bar
//! labelled with its value. Text is drawn with plotters' `ab_glyph` renderer from DejaVu Sans,
//! read at run time from Debian's `fonts-dejavu-core` ([`FONT_PATH`]): no fontconfig, no
//! system font lookup, the same pixels on every machine that has the package.

use anyhow::{anyhow, bail, Context, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;
use std::path::Path;
use std::sync::OnceLock;

/// The font every label is drawn with (Debian's `fonts-dejavu-core`).
pub const FONT_PATH: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// The family name the font is registered under.
const FAMILY: &str = "sans-serif";

/// Chart width in pixels; the height grows with the bars.
const WIDTH_PX: u32 = 1000;
/// Pixels per bar: room for a 15-pixel label with a gap.
const BAR_PX: u32 = 30;

/// One bar.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// What it measures.
    pub label: String,
    /// The figure.
    pub value: f64,
    /// A baseline the benchmark compares with (grey), not uzram (blue).
    pub anchor: bool,
}

/// A chart: a title, the unit of the values, the bars.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    /// Above the bars.
    pub title: String,
    /// Under the axis.
    pub unit: String,
    /// Top to bottom.
    pub bars: Vec<Bar>,
}

fn bar(label: impl Into<String>, value: Option<f64>, anchor: bool) -> Option<Bar> {
    let value = value.filter(|v| v.is_finite())?;
    Some(Bar {
        label: label.into(),
        value,
        anchor,
    })
}

fn num(doc: &Value, pointer: &str) -> Option<f64> {
    doc.pointer(pointer)?.as_f64()
}

/// The figures of a map of maps (`{"sequential": {"1": 512.0, "32": 9000.0}}`) as
/// `("sequential batch 1", 512.0)`, in the document's order.
fn nested(doc: &Value, pointer: &str, join: &str) -> Vec<(String, String, f64)> {
    let mut out = Vec::new();
    if let Some(m) = doc.pointer(pointer).and_then(Value::as_object) {
        for (outer, v) in m {
            if let Some(inner) = v.as_object() {
                // Batch sizes in numeric order ("8" before "32"), other keys as they come.
                let mut entries: Vec<(&String, &Value)> = inner.iter().collect();
                entries.sort_by_key(|(k, _)| k.parse::<u64>().unwrap_or(u64::MAX));
                for (k, x) in entries {
                    if let Some(x) = x.as_f64() {
                        out.push((outer.clone(), format!("{join}{k}"), x));
                    }
                }
            }
        }
    }
    out
}

/// The main comparison of the benchmark whose JSON is `doc`.
pub fn chart_for(doc: &Value) -> Result<Chart> {
    let name = doc
        .get("benchmark")
        .or_else(|| doc.get("bench"))
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("not a benchmark's JSON (no \"benchmark\" key)"))?;
    let s = |p: &str| doc.pointer(p).and_then(Value::as_str).unwrap_or("");
    let (title, unit, bars): (String, &str, Vec<Option<Bar>>) = match name {
        "store" => (
            format!("uzram bench store: uzram vs kernel zram ({})", s("/codec")),
            "MB/s (higher is better)",
            vec![
                bar("uzram: fill", num(doc, "/fill_mbps"), false),
                bar("kernel zram: fill", num(doc, "/kernel_write_mbps"), true),
                bar("uzram: read (1 thread)", num(doc, "/read_mbps"), false),
                bar(
                    "kernel zram: read-back",
                    num(doc, "/kernel_read_mbps"),
                    true,
                ),
                bar("uzram: write (1 thread)", num(doc, "/write_mbps"), false),
                bar(
                    format!("raw {}: compress", s("/codec")),
                    num(doc, "/raw_compress_mbps"),
                    true,
                ),
            ],
        ),
        "free" => (
            "uzram bench free: deferred vs synchronous free".to_string(),
            "ms (lower is better)",
            vec![
                bar("deferred: release", num(doc, "/release_ms_deferred"), false),
                bar("synchronous: release", num(doc, "/release_ms_sync"), true),
                bar(
                    "deferred: memory back",
                    num(doc, "/memory_back_ms_deferred"),
                    false,
                ),
                bar(
                    "synchronous: memory back",
                    num(doc, "/memory_back_ms_sync"),
                    true,
                ),
            ],
        ),
        "restart" => (
            "uzram bench restart: kill -9 to the first request served again".to_string(),
            "ms (lower is better)",
            doc.get("sizes")
                .and_then(Value::as_array)
                .map(|rows| {
                    rows.iter()
                        .flat_map(|r| {
                            let gib = r.get("stored_gib").and_then(Value::as_f64).unwrap_or(0.0);
                            let ms = |k: &str| r.get(k).and_then(Value::as_f64).map(|s| s * 1e3);
                            let stored = format!("{gib:.2} GiB stored");
                            [
                                bar(stored.clone(), ms("restart_median_s"), gib == 0.0),
                                bar(format!("target at {stored}"), ms("target_s"), true)
                                    .filter(|_| gib > 0.0),
                            ]
                        })
                        .collect()
                })
                .unwrap_or_default(),
        ),
        "writeback" => (
            "uzram bench writeback: batch sizes vs batch 1".to_string(),
            "pages/s (higher is better)",
            nested(doc, "/pages_per_s", "batch ")
                .into_iter()
                .map(|(layout, batch, v)| {
                    bar(format!("{layout} {batch}"), Some(v), batch == "batch 1")
                })
                .collect(),
        ),
        "writeback_checksum_cost" => (
            "uzram bench writeback --checksum-cost: CRC-32C on vs off".to_string(),
            "pages/s (higher is better)",
            vec![
                bar(
                    "writeback, checksums on",
                    num(doc, "/writeback_pages_per_s_on"),
                    false,
                ),
                bar(
                    "writeback, checksums off",
                    num(doc, "/writeback_pages_per_s_off"),
                    true,
                ),
                bar(
                    "read-back, checksums on",
                    num(doc, "/read_back_pages_per_s_on"),
                    false,
                ),
                bar(
                    "read-back, checksums off",
                    num(doc, "/read_back_pages_per_s_off"),
                    true,
                ),
            ],
        ),
        "writeback-nbd" => (
            "uzram bench writeback (NBD backing) vs a local file".to_string(),
            "pages/s (higher is better)",
            nested(doc, "/nbd_pages_per_s", "batch ")
                .into_iter()
                .map(|(k, b, v)| bar(format!("NBD {k} {b}"), Some(v), false))
                .chain(
                    nested(doc, "/file_pages_per_s", "batch ")
                        .into_iter()
                        .map(|(k, b, v)| bar(format!("file {k} {b}"), Some(v), true)),
                )
                .collect(),
        ),
        "gc" => (
            "uzram bench gc: scratch ring vs bank switching".to_string(),
            "ms (lower is better)",
            vec![
                bar("ring: GC", num(doc, "/gc_ms_ring"), false),
                bar("bank switching: GC", num(doc, "/gc_ms_bank"), true),
                bar("ring: relocating", num(doc, "/relocate_ms_ring"), false),
                bar(
                    "bank switching: relocating",
                    num(doc, "/relocate_ms_bank"),
                    true,
                ),
            ],
        ),
        "nbd" => (
            "uzram bench nbd: fio IOPS by target".to_string(),
            "IOPS (higher is better)",
            doc.get("points")
                .and_then(Value::as_array)
                .map(|ps| {
                    ps.iter()
                        .map(|p| {
                            let target = p["target"].as_str().unwrap_or("?");
                            bar(
                                format!(
                                    "{target} {} d{} j{}",
                                    p["rw"].as_str().unwrap_or("?"),
                                    p["iodepth"],
                                    p["jobs"]
                                ),
                                p["iops"].as_f64(),
                                !target.starts_with("uzram"),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
        ),
        "vhost" => (
            "uzram bench vhost: vhost-user-blk IOPS, no VM".to_string(),
            "IOPS (higher is better)",
            doc.get("points")
                .and_then(Value::as_array)
                .map(|ps| {
                    ps.iter()
                        .map(|p| {
                            let target = p["target"].as_str().unwrap_or("?");
                            bar(
                                format!(
                                    "{target} {} d{} q{}",
                                    p["rw"].as_str().unwrap_or("?"),
                                    p["depth"],
                                    p["queues"]
                                ),
                                p["iops"].as_f64(),
                                target != "uzram",
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
        ),
        "recompress" => (
            "uzram bench recompress: compressed size".to_string(),
            "MiB of compr_data_size (lower is better)",
            vec![
                bar(
                    "lz4 (written)",
                    num(doc, "/lz4/compr_data_size").map(mib),
                    true,
                ),
                bar(
                    "recompressed with zstd",
                    num(doc, "/zstd/compr_data_size").map(mib),
                    false,
                ),
                bar(
                    "zstd with a trained dictionary",
                    num(doc, "/zstd_dict/compr_data_size").map(mib),
                    false,
                ),
            ],
        ),
        "multipage" => (
            "uzram bench multipage: memory by multi_page_size".to_string(),
            "MiB of mem_used_total (lower is better)",
            doc.get("rows")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|r| {
                    let mps = r["multi_page_size"].as_u64().unwrap_or(0);
                    bar(
                        format!("{} {}", r["codec"].as_str().unwrap_or("?"), size_name(mps)),
                        r["mem_used_total_bytes"].as_f64().map(mib),
                        mps == 4096,
                    )
                })
                .chain(
                    doc.get("kernel")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .map(|k| {
                            bar(
                                format!("{} kernel zram", k["codec"].as_str().unwrap_or("?")),
                                k["mem_used_total_bytes"].as_f64().map(mib),
                                true,
                            )
                        }),
                )
                .collect(),
        ),
        "vm" | "blk" => {
            let (what, ours) = if name == "vm" {
                (
                    "vhost-user-blk vs QEMU's NBD and the guest's zram",
                    [
                        ("vhost-user", "uzram vhost-user"),
                        ("nbd", "uzram via QEMU NBD"),
                    ],
                )
            } else {
                (
                    "ublk vs the guest kernel's NBD client and its zram",
                    [("ublk", "uzram ublk"), ("nbd", "uzram via kernel NBD")],
                )
            };
            (
                format!("uzram bench {name}: fio in a guest, {what}"),
                "IOPS (higher is better)",
                doc.get("points")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .flat_map(|p| {
                        let point = format!(
                            "{} QD{}",
                            p["rw"].as_str().unwrap_or("?"),
                            p["iodepth"].as_u64().unwrap_or(0)
                        );
                        [
                            (ours[0].0, ours[0].1, false),
                            (ours[1].0, ours[1].1, true),
                            ("guest-zram", "guest kernel zram", true),
                        ]
                        .map(|(key, label, anchor)| {
                            bar(format!("{label}: {point}"), p["iops"][key].as_f64(), anchor)
                        })
                    })
                    .collect(),
            )
        }
        "sparse-copy" => (
            format!(
                "uzram bench sparse-copy: nbdcopy of {} MiB holding {} MiB, vs nbdkit memory",
                num(doc, "/options/size_bytes").map_or(0.0, mib),
                num(doc, "/options/data_bytes").map_or(0.0, mib)
            ),
            "seconds (lower is better)",
            vec![
                bar(
                    "uzram: block status",
                    num(doc, "/uzram_median_s_block_status"),
                    false,
                ),
                bar(
                    "nbdkit: block status",
                    num(doc, "/nbdkit_median_s_block_status"),
                    true,
                ),
                bar(
                    "uzram: --no-extents",
                    num(doc, "/uzram_median_s_no_extents"),
                    false,
                ),
                bar(
                    "nbdkit: --no-extents",
                    num(doc, "/nbdkit_median_s_no_extents"),
                    true,
                ),
            ],
        ),
        other => bail!("no plot for benchmark {other:?}"),
    };
    let bars: Vec<Bar> = bars.into_iter().flatten().collect();
    if bars.is_empty() {
        bail!("{name}: no figures to plot");
    }
    Ok(Chart {
        title,
        unit: unit.to_string(),
        bars,
    })
}

fn mib(bytes: f64) -> f64 {
    bytes / f64::from(1u32 << 20)
}

fn size_name(bytes: u64) -> String {
    match bytes {
        4096 => "4 KiB (off)".to_string(),
        b if b % 1024 == 0 => format!("{} KiB", b / 1024),
        b => format!("{b} B"),
    }
}

/// Registers [`FONT_PATH`] with plotters once.
fn register_font() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = std::fs::read(FONT_PATH).map_err(|e| {
            format!("{FONT_PATH}: {e} (the plots' font: install Debian's fonts-dejavu-core)")
        })?;
        // The renderer keeps the font for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font(FAMILY, FontStyle::Normal, bytes)
            .map_err(|_| format!("{FONT_PATH}: not a font plotters can read"))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

/// Draws `chart` into the PNG `path`.
pub fn draw(chart: &Chart, path: &Path) -> Result<()> {
    register_font()?;
    let n = chart.bars.len();
    let height = 110 + BAR_PX * n as u32;
    let max = chart
        .bars
        .iter()
        .map(|b| b.value)
        .fold(0.0_f64, f64::max)
        .max(f64::MIN_POSITIVE);
    let label_px = chart
        .bars
        .iter()
        .map(|b| b.label.chars().count() as u32 * 8 + 16)
        .max()
        .unwrap_or(0)
        .min(WIDTH_PX / 2);
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("drawing {}: {e:?}", path.display());
    {
        let root = BitMapBackend::new(path, (WIDTH_PX, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut c = ChartBuilder::on(&root)
            .caption(&chart.title, (FAMILY, 20))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(label_px)
            .build_cartesian_2d(0.0..max * 1.18, (0..n).into_segmented())
            .map_err(err)?;
        let labels: Vec<String> = chart.bars.iter().map(|b| b.label.clone()).collect();
        c.configure_mesh()
            .disable_y_mesh()
            .y_labels(n)
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) if *i < n => labels[n - 1 - i].clone(),
                _ => String::new(),
            })
            .x_desc(chart.unit.as_str())
            .label_style((FAMILY, 14))
            .axis_desc_style((FAMILY, 15))
            .draw()
            .map_err(err)?;
        let blue = RGBColor(47, 98, 168);
        let grey = RGBColor(150, 150, 150);
        // The first bar on top (the y axis counts upwards).
        c.draw_series(chart.bars.iter().enumerate().map(|(i, b)| {
            let mut r = Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(n - 1 - i)),
                    (b.value, SegmentValue::Exact(n - i)),
                ],
                if b.anchor { grey } else { blue }.filled(),
            );
            r.set_margin(4, 4, 0, 0);
            r
        }))
        .map_err(err)?;
        c.draw_series(chart.bars.iter().enumerate().map(|(i, b)| {
            Text::new(
                format!(" {}", crate::f(b.value)),
                (b.value, SegmentValue::CenterOf(n - 1 - i)),
                TextStyle::from((FAMILY, 14).into_font()).pos(Pos::new(HPos::Left, VPos::Center)),
            )
        }))
        .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(())
}

/// `--plot FILE`: the chart of `doc`, drawn into `path`.
pub fn plot(doc: &Value, path: &Path) -> Result<()> {
    let chart = chart_for(doc)?;
    draw(&chart, path).with_context(|| format!("--plot {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The benchmarks' JSON shapes (the keys `chart_for` reads, as each benchmark writes them).
    fn docs() -> Vec<Value> {
        vec![
            json!({"benchmark": "store", "codec": "lz4", "fill_mbps": 900.0,
                   "kernel_write_mbps": 700.0, "read_mbps": 2000.0, "kernel_read_mbps": null,
                   "write_mbps": 800.0, "raw_compress_mbps": 1200.0}),
            json!({"bench": "free", "release_ms_deferred": 2.0, "release_ms_sync": 9.0,
                   "memory_back_ms_deferred": 4.0, "memory_back_ms_sync": 9.5}),
            json!({"benchmark": "writeback", "pages_per_s": {
                "sequential": {"1": 5000.0, "32": 90000.0},
                "fragmented": {"1": 4000.0, "32": 60000.0}}}),
            json!({"benchmark": "writeback_checksum_cost", "writeback_pages_per_s_on": 9.0e4,
                   "writeback_pages_per_s_off": 9.5e4, "read_back_pages_per_s_on": 2.0e5,
                   "read_back_pages_per_s_off": 2.1e5}),
            json!({"benchmark": "writeback-nbd", "nbd_pages_per_s": {"all": {"1": 800.0, "32": 20000.0}},
                   "file_pages_per_s": {"all": {"1": 900.0, "32": 40000.0}}}),
            json!({"benchmark": "gc", "gc_ms_ring": 10.0, "gc_ms_bank": 14.0,
                   "relocate_ms_ring": 8.0, "relocate_ms_bank": 12.0}),
            json!({"benchmark": "nbd", "points": [
                {"target": "uzram", "rw": "randwrite", "iodepth": 32, "jobs": 1, "iops": 90000.0},
                {"target": "nbdkit-memory", "rw": "randwrite", "iodepth": 32, "jobs": 1, "iops": 70000.0}]}),
            json!({"bench": "recompress", "lz4": {"compr_data_size": 40_000_000.0},
                   "zstd": {"compr_data_size": 30_000_000.0},
                   "zstd_dict": {"compr_data_size": 27_000_000.0}}),
            json!({"benchmark": "multipage", "rows": [
                {"codec": "lz4", "multi_page_size": 4096, "mem_used_total_bytes": 50_000_000},
                {"codec": "lz4", "multi_page_size": 65536, "mem_used_total_bytes": 38_000_000}],
                "kernel": [{"codec": "lz4", "mem_used_total_bytes": 52_000_000}]}),
            json!({"benchmark": "vhost", "points": [
                {"target": "uzram", "rw": "randread", "depth": 1, "queues": 1, "iops": 60000.0},
                {"target": "qsd-tmpfs", "rw": "randread", "depth": 1, "queues": 1, "iops": 40000.0}]}),
            json!({"benchmark": "sparse-copy",
                   "options": {"size_bytes": 4u64 << 30, "data_bytes": 400u64 << 20},
                   "uzram_median_s_block_status": 0.7, "nbdkit_median_s_block_status": 0.6,
                   "uzram_median_s_no_extents": 2.1, "nbdkit_median_s_no_extents": 1.5}),
            json!({"bench": "vm", "points": [
                {"rw": "randread", "iodepth": 1,
                 "iops": {"vhost-user": 9000.0, "nbd": 3000.0, "guest-zram": 12000.0}},
                {"rw": "randwrite", "iodepth": 32,
                 "iops": {"vhost-user": 30000.0, "nbd": 9000.0, "guest-zram": 40000.0}}]}),
            json!({"bench": "blk", "points": [
                {"rw": "randread", "iodepth": 1,
                 "iops": {"ublk": 900.0, "nbd": 200.0, "guest-zram": 6000.0}}]}),
        ]
    }

    #[test]
    fn every_benchmark_has_its_chart_with_anchors_marked() {
        for doc in docs() {
            let c = chart_for(&doc).unwrap();
            assert!(c.bars.iter().any(|b| b.anchor), "{doc}: no anchor");
            assert!(c.bars.iter().any(|b| !b.anchor), "{doc}: no uzram bar");
            assert!(c.bars.iter().all(|b| b.value.is_finite()));
        }
        // A figure the run did not measure (null: the kernel skipped) is left out, not 0.
        let store = chart_for(&docs()[0]).unwrap();
        assert!(!store.bars.iter().any(|b| b.label.contains("read-back")));
        let all = docs();
        let vm = chart_for(&all[all.len() - 2]).unwrap();
        assert_eq!(vm.bars.len(), 6);
        assert_eq!(vm.bars[0].label, "uzram vhost-user: randread QD1");
        assert!(!vm.bars[0].anchor && vm.bars[1].anchor && vm.bars[2].anchor);
        let blk = chart_for(all.last().unwrap()).unwrap();
        assert_eq!(blk.bars.len(), 3);
        assert_eq!(blk.bars[0].label, "uzram ublk: randread QD1");
        assert_eq!(blk.bars[0].value, 900.0);
        assert!(!blk.bars[0].anchor && blk.bars[1].anchor && blk.bars[2].anchor);
        assert!(chart_for(&json!({"benchmark": "nope"})).is_err());
        assert!(chart_for(&json!({"x": 1})).is_err());
        assert!(
            chart_for(&json!({"benchmark": "gc"})).is_err(),
            "no figures"
        );
    }

    #[test]
    fn draws_a_png_with_text() {
        let dir = tempfile::tempdir().unwrap();
        for (i, doc) in docs().iter().enumerate() {
            let path = dir.path().join(format!("{i}.png"));
            plot(doc, &path).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
        }
    }
}
