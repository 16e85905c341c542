//! `uzram bench …`: the benchmarks. Each prints a table and writes JSON (`bench/results/`).

use crate::corpus::Corpus;
use crate::writeback::{Layout, Store, WritebackBenchOptions};
use crate::{free::FreeBenchOptions, store::StoreBenchOptions};
use anyhow::Context;
use clap::{Args, Subcommand};
use std::path::PathBuf;

/// Where `uzram corpus` writes by default, and where benchmarks look for pages.
pub const DEFAULT_CORPUS: &str = "bench/corpus/pages.bin";

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The page store: raw codec vs. store path, packing, and the kernel's zram on the same pages.
    Store(StoreArgs),
    /// Batched writeback: batch sizes against the one-page synchronous path and the backing
    /// file's own write ceiling, on a sequential and a fragmented backing.
    Writeback(WritebackArgs),
    /// Zoned GC: the scratch ring against bank switching, on a real backing file.
    Gc(GcArgs),
    /// Releasing pages: synchronous vs. deferred free, and the short class-lock section.
    Free(FreeArgs),
    /// A restart: the time from `kill -9` of `uzram serve --keeper`'s server to the first
    /// request served again, for a device holding real pages, against one holding nothing.
    Restart(RestartArgs),
    /// The NBD server with fio, against nbdkit's memory plugin and the kernel's zram.
    Nbd(NbdArgs),
    /// Copying a sparse device with nbdcopy, with and without block status, against nbdkit's
    /// memory plugin holding the same data.
    SparseCopy(SparseCopyArgs),
    /// Recompression: lz4 -> zstd, then zstd with a dictionary trained from the device, and
    /// reads of recompressed pages against raw decompression.
    Recompress(RecompressArgs),
    /// Multi-page objects (`multi_page_size`) against 4 KiB granularity and the kernel's zram.
    Multipage(MultipageArgs),
    /// vhost-user-blk without a VM: a virtio-blk driver against `uzram serve --vhost-user` and
    /// qemu-storage-daemon (null-co and a raw file on tmpfs), IOPS, latency, server CPU.
    Vhost(VhostArgs),
    /// A VM guest's disk: vhost-user-blk against QEMU's NBD client and the guest's own kernel
    /// zram, fio inside one guest.
    Vm(GuestArgs),
    /// A kernel block device: ublk against the guest kernel's NBD client and its own zram,
    /// uzram and fio inside one guest.
    Blk(GuestArgs),
    /// Draws the PNG of a benchmark's JSON written earlier (what `--plot` draws), e.g. from
    /// bench/results/.
    Plot(PlotArgs),
}

#[derive(Debug, Args)]
struct PlotArgs {
    /// A benchmark's JSON (bench/results/NAME-UNIXTIME.json).
    json: PathBuf,
    /// The PNG to write.
    #[arg(long, value_name = "FILE")]
    plot: PathBuf,
}

/// `bench vm` and `bench blk`: one guest, fio at each point on three devices.
#[derive(Debug, Args)]
struct GuestArgs {
    /// Seconds per point.
    #[arg(long, default_value_t = 10)]
    runtime: u64,
    /// Size of the device and of the guest's zram (K, M, G suffixes).
    #[arg(long, default_value = "256M")]
    size: String,
    /// Runs per point; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// The guest's RAM, MiB.
    #[arg(long, default_value_t = 1024)]
    mem_mb: u32,
    /// Inside the guest (what the host side boots): run the points, print the samples.
    #[arg(long, hide = true)]
    guest: bool,
    /// Where to write the JSON (default: bench/results/vm-UNIXTIME.json or blk-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct VhostArgs {
    /// Page corpus (from `uzram corpus`); built with default settings if missing.
    #[arg(long, default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Seconds per point (fractions taken).
    #[arg(long, default_value_t = 5.0)]
    runtime: f64,
    /// Size of every target (K, M, G suffixes).
    #[arg(long, default_value = "256M")]
    size: String,
    /// Runs per point; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Workloads, comma-separated: randread, randwrite.
    #[arg(long, value_delimiter = ',', default_value = "randread,randwrite")]
    rw: Vec<String>,
    /// Queue depths per queue, comma-separated (at most 32).
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    depths: Vec<u16>,
    /// Queue counts, comma-separated (at most 2).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    queues: Vec<u16>,
    /// qemu-storage-daemon's I/O engine for the tmpfs file: io_uring or threads.
    #[arg(long, default_value = "io_uring")]
    qsd_aio: String,
    /// Where to write the JSON (default: bench/results/vhost-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct RecompressArgs {
    /// Page corpus (from `uzram corpus`); built with default settings if missing.
    #[arg(long, default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Pages to use (the corpus is cycled); default: the whole corpus.
    #[arg(long)]
    pages: Option<usize>,
    /// zstd's level for recompression.
    #[arg(long, default_value_t = 3)]
    level: i32,
    /// Size of the trained dictionary (K/M suffixes).
    #[arg(long, default_value = "110K")]
    dict_size: String,
    /// Pages sampled from the device to train the dictionary.
    #[arg(long, default_value_t = 4096)]
    samples: usize,
    /// Timing repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Where to write the JSON (default: bench/results/recompress-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

/// Where `bench multipage` looks for its corpus (64 KiB pages), built if missing.
pub const DEFAULT_CORPUS_64K: &str = "bench/corpus/pages-64k.bin";

#[derive(Debug, Args)]
struct MultipageArgs {
    /// Page corpus of 64 KiB pages (`uzram corpus --page-size 65536`); built (1024 pages per
    /// program) if missing at the default path.
    #[arg(long, default_value = DEFAULT_CORPUS_64K)]
    corpus: PathBuf,
    /// Codecs, comma separated, for uzram and the kernel alike.
    #[arg(long, value_delimiter = ',', default_value = "lz4,zstd")]
    codecs: Vec<String>,
    /// `multi_page_size` values, comma separated (4096: off, the anchor; K suffixes taken).
    #[arg(long, value_delimiter = ',', default_value = "4096,16K,32K,64K")]
    multi_page_size: Vec<String>,
    /// Timing repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Skip the kernel zram anchor.
    #[arg(long)]
    no_kernel: bool,
    /// Where to write the JSON (default: bench/results/multipage-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct WritebackArgs {
    /// Backing file (created and written through once, removed at the end) or block device.
    /// Use a real disk: tmpfs has no O_DIRECT. Or an NBD URI (`nbd://HOST:PORT/EXPORT`,
    /// `nbd+unix:///EXPORT?socket=PATH`): writeback to that export against `--compare-file`
    /// written directly (bitmap store, sequential layout).
    #[arg(long, default_value = "/var/tmp/uzram-writeback-bench.img")]
    backing: PathBuf,
    /// With an NBD backing: the local file the same writeback goes to directly, for the ratio
    /// (created, written through, removed at the end); `none` to skip.
    #[arg(long, default_value = "/var/tmp/uzram-writeback-bench-direct.img")]
    compare_file: PathBuf,
    /// Page corpus (from `uzram corpus`); built with default settings if missing.
    #[arg(long, default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Pages in the device (the corpus is cycled).
    #[arg(long, default_value_t = 100_000)]
    pages: usize,
    /// Layouts of the backing's free blocks, comma separated: sequential, fragmented.
    #[arg(long, value_delimiter = ',', default_value = "sequential,fragmented")]
    layout: Vec<String>,
    /// Batch sizes, comma separated (1 runs on the synchronous engine).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64,128")]
    batch_sizes: Vec<usize>,
    /// Stores, comma separated: bitmap (on each layout), zoned (append-only log; the layout
    /// does not apply). Both by default, so the JSON has `zoned_pages_per_s` beside
    /// `bitmap_pages_per_s` and the batch-1 baseline of the fragmented layout.
    #[arg(long, value_delimiter = ',', default_value = "bitmap,zoned")]
    store: Vec<String>,
    /// Zone size of the zoned store (`K`/`M`/`G`; default 256M, or a quarter of the backing
    /// file when that is smaller).
    #[arg(long)]
    zone_size: Option<String>,
    /// Timing repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Never draw the progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Where to write the JSON (default: bench/results/writeback-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Measure what the CRC-32C of written-back blocks costs instead: writeback and read-back
    /// with and without it (bitmap, sequential, the largest batch size), same run.
    #[arg(long)]
    checksum_cost: bool,
}

#[derive(Debug, Args)]
struct GcArgs {
    /// Page corpus (from `uzram corpus`); built with default settings if missing.
    #[arg(long, default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Backing file to create (removed afterwards); put it on the disk to measure.
    #[arg(long, default_value = "/var/tmp/uzram-bench-gc.img")]
    backing: PathBuf,
    /// Zone size (K/M/G suffixes).
    #[arg(long, default_value = "256M")]
    zone_size: String,
    /// Zones in the backing file (all but two are filled).
    #[arg(long, default_value_t = 6)]
    zones: u64,
    /// Repetitions of each mode (even, so each goes first equally often); medians reported.
    #[arg(long, default_value_t = 4)]
    repeats: usize,
    /// Algorithm of the written-back objects.
    #[arg(long, default_value = "lz4")]
    codec: String,
    /// Largest GC chunk (K/M suffixes; at most a scratch buffer).
    #[arg(long, default_value = "1M")]
    chunk: String,
    /// Bytes per scratch buffer (K/M suffixes; two buffers in either design, as zoned XFS has).
    #[arg(long, default_value = "1M")]
    buffer_size: String,
    /// Queue depth of GC reads and writes (the device's GC uses 64).
    #[arg(long, default_value_t = 64)]
    depth: usize,
    /// How half the space is freed: `punch` (holes: runs of discarded slots between runs of
    /// kept ones, as holes punched in files leave them) or `scatter` (each slot
    /// discarded with probability 1/2).
    #[arg(long, default_value = "punch")]
    holes: String,
    /// Mean length in pages of a punched hole and of a kept run (each uniform in 1..2N).
    #[arg(long, default_value_t = 64)]
    hole_pages: u64,
    /// Make every request take the time this device would: `smr-hdd` (with its write-back
    /// cache), `smr-hdd-no-cache` or `ssd` (seek, rotation, media rate, one request at a
    /// time; uzram::backing::DeviceModel).
    #[arg(long)]
    device_model: Option<String>,
    /// Override the model's command queue: 1 serves requests in arrival order, N > 1 lets
    /// the device pick among the first N waiting (shortest positioning first, writes in
    /// order). Needs --device-model.
    #[arg(long)]
    model_queue_depth: Option<usize>,
    /// Where to write the JSON (default: bench/results/gc-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct FreeArgs {
    /// Page corpus (from `uzram corpus`); built with default settings if missing.
    #[arg(long, default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Pages to fill and release (the corpus's non-same-filled pages, cycled), comma separated
    /// for several sizes (the short critical section is measured at the first); default: each
    /// of them once.
    #[arg(long, value_delimiter = ',')]
    pages: Vec<usize>,
    /// Releasing thread counts, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Algorithm the device compresses with.
    #[arg(long, default_value = "lz4")]
    codec: String,
    /// Timing repetitions; the median is reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Where to write the JSON (default: bench/results/free-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct RestartArgs {
    /// Page corpus (from `uzram corpus`); built with default settings if missing.
    #[arg(long, default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Sizes of pages stored, one device each, comma separated (K, M, G suffixes); a device
    /// holding nothing is measured first, as the anchor.
    #[arg(long, value_delimiter = ',', default_value = "1G")]
    sizes: Vec<String>,
    /// Kills per size; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Algorithm the device compresses with.
    #[arg(long, default_value = "lz4")]
    codec: String,
    /// Measure a vhost-user front end reconnecting (the test kit's driver, with the inflight
    /// region) instead of a new NBD connection: kill to a read offered at the kill served.
    #[arg(long)]
    vhost_user: bool,
    /// Where to write the JSON (default: bench/results/restart-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct NbdArgs {
    /// Seconds per point.
    #[arg(long, default_value_t = 10)]
    runtime: u64,
    /// Size of each target (K, M, G suffixes).
    #[arg(long, default_value = "1G")]
    size: String,
    /// Runs per point; the median is reported.
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Workloads, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "randwrite,randread,randrw"
    )]
    rw: Vec<String>,
    /// Queue depths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    iodepths: Vec<u32>,
    /// Job counts (connections), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    jobs: Vec<u32>,
    /// Skip the kernel zram anchors.
    #[arg(long)]
    no_kernel: bool,
    /// Skip the nbdkit anchors.
    #[arg(long)]
    no_nbdkit: bool,
    /// Also a uzram device with this multi_page_size (target uzram-multi; K suffixes taken).
    #[arg(long)]
    multi_page_size: Option<String>,
    /// Where to write the JSON (default: bench/results/nbd-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct SparseCopyArgs {
    /// Page corpus (from `uzram corpus`); built with default settings if missing.
    #[arg(long, default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// The device's size (K, M, G suffixes).
    #[arg(long, default_value = "4G")]
    size: String,
    /// Data it holds: real pages, not same-filled (K, M, G suffixes).
    #[arg(long, default_value = "400M")]
    data: String,
    /// Bytes per run of data; runs are spread evenly, holes between (K, M suffixes).
    #[arg(long, default_value = "1M")]
    run: String,
    /// Copies per mode and server; the median is reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Where to write the JSON (default: bench/results/sparse-copy-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct StoreArgs {
    /// Page corpus (from `uzram corpus`); built with default settings if missing.
    #[arg(long, default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Algorithm, for uzram and the kernel alike.
    #[arg(long, default_value = "lz4")]
    codec: String,
    /// Pages to use (the corpus is cycled); default: the whole corpus.
    #[arg(long)]
    pages: Option<usize>,
    /// Timing repetitions; the median is reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Skip the kernel zram anchor.
    #[arg(long)]
    no_kernel: bool,
    /// Where to write the JSON (default: bench/results/store-UNIXTIME.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also draw the main comparison into this PNG (bench/README.md shows them).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.which {
        BenchCommand::Gc(a) => {
            let corpus = load_or_build_corpus(&a.corpus)?;
            let opts = crate::gc::GcBenchOptions {
                backing: a.backing,
                zone_size_bytes: uzram::units::parse_size_bytes(&a.zone_size)?,
                zones: a.zones,
                repeats: a.repeats,
                codec: a.codec,
                chunk_bytes: uzram::units::parse_size_bytes(&a.chunk)? as usize,
                buffer_bytes: uzram::units::parse_size_bytes(&a.buffer_size)? as usize,
                depth: a.depth,
                holes: crate::gc::Holes::parse(&a.holes, a.hole_pages)?,
                device_model: match (a.device_model.as_deref(), a.model_queue_depth) {
                    (None, None) => None,
                    (None, Some(_)) => {
                        return Err(uzram::error::Error::invalid(
                            "--model-queue-depth needs --device-model",
                        )
                        .into())
                    }
                    (Some(_), Some(0)) => {
                        return Err(uzram::error::Error::invalid(
                            "--model-queue-depth must be at least 1",
                        )
                        .into())
                    }
                    (Some(name), depth) => {
                        let mut m = uzram::backing::DeviceModel::by_name(name)?;
                        if let Some(d) = depth {
                            m.queue_depth = d;
                        }
                        Some(m)
                    }
                },
                ..Default::default()
            };
            let doc = crate::gc::run(&corpus, &opts)?;
            write_results(a.json.as_deref(), "gc", &doc, a.plot.as_deref())
        }
        BenchCommand::Store(a) => {
            let corpus = load_or_build_corpus(&a.corpus)?;
            let opts = StoreBenchOptions {
                codec: a.codec,
                pages: a.pages,
                repeats: a.repeats,
                no_kernel: a.no_kernel,
                ..Default::default()
            };
            let doc = crate::store::run(&corpus, &opts)?;
            write_results(a.json.as_deref(), "store", &doc, a.plot.as_deref())
        }
        BenchCommand::SparseCopy(a) => {
            let corpus = load_or_build_corpus(&a.corpus)?;
            let size = |s: &str| uzram::units::parse_size_bytes(s);
            let opts = crate::sparse_copy::SparseCopyOptions {
                size_bytes: size(&a.size)?,
                data_bytes: size(&a.data)?,
                run_bytes: size(&a.run)?,
                repeats: a.repeats,
            };
            let doc = crate::sparse_copy::run(&corpus, &opts)?;
            write_results(a.json.as_deref(), "sparse-copy", &doc, a.plot.as_deref())
        }
        BenchCommand::Free(a) => {
            let corpus = load_or_build_corpus(&a.corpus)?;
            let opts = FreeBenchOptions {
                codec: a.codec,
                pages: a.pages,
                threads: a.threads,
                repeats: a.repeats,
            };
            let doc = crate::free::run(&corpus, &opts)?;
            write_results(a.json.as_deref(), "free", &doc, a.plot.as_deref())
        }
        BenchCommand::Restart(a) => {
            let corpus = load_or_build_corpus(&a.corpus)?;
            let sizes_bytes = a
                .sizes
                .iter()
                .map(|s| uzram::units::parse_size_bytes(s).with_context(|| format!("--sizes {s}")))
                .collect::<anyhow::Result<Vec<u64>>>()?;
            let opts = crate::restart::RestartBenchOptions {
                sizes_bytes,
                repeats: a.repeats.max(1),
                codec: a.codec,
                vhost_user: a.vhost_user,
            };
            let doc = crate::restart::run(&corpus, &opts)?;
            write_results(a.json.as_deref(), "restart", &doc, a.plot.as_deref())
        }
        BenchCommand::Multipage(a) => {
            let path = a.corpus.as_path();
            if !path.exists() && path == std::path::Path::new(DEFAULT_CORPUS_64K) {
                eprintln!(
                    "no corpus at {}: building one of 64 KiB pages",
                    path.display()
                );
                crate::corpus::build::build_64k(path)?;
            }
            let corpus =
                Corpus::load(path).with_context(|| format!("loading corpus {}", path.display()))?;
            let sizes = a
                .multi_page_size
                .iter()
                .map(|s| uzram::units::parse_size_bytes(s).map(|v| v as usize))
                .collect::<uzram::Result<Vec<_>>>()?;
            let opts = crate::multipage::MultipageBenchOptions {
                codecs: a.codecs,
                sizes,
                repeats: a.repeats,
                no_kernel: a.no_kernel,
            };
            let doc = crate::multipage::run(&corpus, &opts)?;
            write_results(a.json.as_deref(), "multipage", &doc, a.plot.as_deref())
        }
        BenchCommand::Vhost(a) => {
            let corpus = load_or_build_corpus(&a.corpus)?;
            let opts = crate::vhost::VhostBenchOptions {
                runtime_secs: a.runtime,
                size_bytes: uzram::units::parse_size_bytes(&a.size)
                    .with_context(|| format!("--size {}", a.size))?,
                repeats: a.repeats,
                rws: a.rw,
                depths: a.depths,
                queues: a.queues,
                qsd_aio: a.qsd_aio,
            };
            let doc = crate::vhost::run(&corpus, &opts)?;
            write_results(a.json.as_deref(), "vhost", &doc, a.plot.as_deref())
        }
        BenchCommand::Blk(a) => run_guest_bench(&a, "blk", crate::blk::guest, crate::blk::run),
        BenchCommand::Vm(a) => run_guest_bench(&a, "vm", crate::vm::guest, crate::vm::run),
        BenchCommand::Plot(a) => {
            let bytes =
                std::fs::read(&a.json).with_context(|| format!("reading {}", a.json.display()))?;
            let doc: serde_json::Value = serde_json::from_slice(&bytes)
                .with_context(|| format!("{}: not JSON", a.json.display()))?;
            crate::plot::plot(&doc, &a.plot)?;
            println!("wrote {}", a.plot.display());
            Ok(())
        }
        BenchCommand::Nbd(a) => {
            for rw in &a.rw {
                if !["randwrite", "randread", "randrw"].contains(&rw.as_str()) {
                    anyhow::bail!("--rw {rw}: one of randwrite, randread, randrw");
                }
            }
            let opts = crate::nbd::NbdBenchOptions {
                runtime_secs: a.runtime.max(1),
                size_bytes: uzram::units::parse_size_bytes(&a.size)
                    .with_context(|| format!("--size {}", a.size))?,
                repeats: a.repeats,
                rws: a.rw,
                iodepths: a.iodepths,
                jobs: a.jobs,
                no_kernel: a.no_kernel,
                no_nbdkit: a.no_nbdkit,
                multi_page_size: a
                    .multi_page_size
                    .as_deref()
                    .map(uzram::units::parse_size_bytes)
                    .transpose()?
                    .map(|v| v as usize),
            };
            let doc = crate::nbd::run(&opts)?;
            write_results(a.json.as_deref(), "nbd", &doc, a.plot.as_deref())
        }
        BenchCommand::Recompress(a) => {
            let corpus = load_or_build_corpus(&a.corpus)?;
            let opts = crate::recompress::RecompressBenchOptions {
                pages: a.pages,
                level: a.level,
                dict_size_bytes: uzram::units::parse_size_bytes(&a.dict_size)
                    .with_context(|| format!("--dict-size {}", a.dict_size))?
                    as usize,
                samples: a.samples,
                repeats: a.repeats,
                ..Default::default()
            };
            let doc = crate::recompress::run(&corpus, &opts)?;
            write_results(a.json.as_deref(), "recompress", &doc, a.plot.as_deref())
        }
        BenchCommand::Writeback(a) => {
            let corpus = load_or_build_corpus(&a.corpus)?;
            let backing = a.backing.to_string_lossy().into_owned();
            if uzram::backing::nbd::uri::is_nbd_uri(&backing) {
                let opts = crate::remote::RemoteBenchOptions {
                    uri: backing,
                    compare_file: (a.compare_file.as_os_str() != "none").then_some(a.compare_file),
                    pages: a.pages,
                    batch_sizes: a.batch_sizes,
                    repeats: a.repeats,
                    progress: !a.no_progress,
                };
                let doc = crate::remote::run(&corpus, &opts)?;
                return write_results(a.json.as_deref(), "writeback-nbd", &doc, a.plot.as_deref());
            }
            let layouts = a
                .layout
                .iter()
                .map(|l| Layout::parse(l))
                .collect::<uzram::Result<Vec<_>>>()?;
            let stores = a
                .store
                .iter()
                .map(|s| Store::parse(s))
                .collect::<uzram::Result<Vec<_>>>()?;
            let zone_size_bytes = a
                .zone_size
                .as_deref()
                .map(uzram::units::parse_size_bytes)
                .transpose()?;
            let opts = WritebackBenchOptions {
                backing: a.backing,
                pages: a.pages,
                layouts,
                batch_sizes: a.batch_sizes,
                repeats: a.repeats,
                progress: !a.no_progress,
                stores,
                zone_size_bytes,
            };
            let (doc, name) = if a.checksum_cost {
                (
                    crate::writeback::run_checksum_cost(&corpus, &opts)?,
                    "writeback-checksum",
                )
            } else {
                (crate::writeback::run(&corpus, &opts)?, "writeback")
            };
            write_results(a.json.as_deref(), name, &doc, a.plot.as_deref())
        }
    }
}

/// `bench vm` and `bench blk`: inside the guest (`--guest`), run the points; on the host, boot
/// the guest and report.
fn run_guest_bench(
    a: &GuestArgs,
    name: &str,
    guest: fn(&crate::vm::GuestBenchOptions) -> uzram::Result<()>,
    run: fn(&crate::vm::GuestBenchOptions) -> uzram::Result<serde_json::Value>,
) -> anyhow::Result<()> {
    let opts = crate::vm::GuestBenchOptions {
        runtime_secs: a.runtime.max(1),
        size_bytes: uzram::units::parse_size_bytes(&a.size)
            .with_context(|| format!("--size {}", a.size))?,
        repeats: a.repeats.max(1),
        mem_mb: a.mem_mb,
    };
    if a.guest {
        guest(&opts)?;
        return Ok(());
    }
    let doc = run(&opts)?;
    write_results(a.json.as_deref(), name, &doc, a.plot.as_deref())
}

/// `--plot FILE`: draws the benchmark's main comparison (see [`crate::plot`]).
/// Writes a benchmark's JSON document where `--json` asked (by default
/// `bench/results/NAME-UNIXTIME.json`), and its plot where `--plot` asked; says where each
/// went.
fn write_results(
    json: Option<&std::path::Path>,
    name: &str,
    doc: &serde_json::Value,
    plot: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let path = crate::json_path(json, name);
    crate::write_json(&path, doc)?;
    println!("wrote {}", path.display());
    if let Some(path) = plot {
        crate::plot::plot(doc, path)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Loads the corpus at `path`, building it first (with the default programs) when it is the
/// default path and does not exist yet.
fn load_or_build_corpus(path: &std::path::Path) -> anyhow::Result<Corpus> {
    if !path.exists() && path == std::path::Path::new(DEFAULT_CORPUS) {
        eprintln!(
            "no corpus at {}: building one from running programs",
            path.display()
        );
        crate::corpus::build::build_default(path)?;
    }
    Corpus::load(path).with_context(|| format!("loading corpus {}", path.display()))
}
