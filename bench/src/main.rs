//! `uzram-bench`: the harness's own binary, run as `uzram bench …` and `uzram corpus …` (the
//! `uzram` command hands those subcommands to this binary beside it). It links the engine with
//! its `testing` parts (the in-memory and fault-injecting backings, the device model, the
//! `bench_*` hooks), which the product binary never carries.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "uzram-bench",
    version,
    about = "uzram's benchmarks and page corpus (run as `uzram bench` and `uzram corpus`)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start: the size of a benchmark's flags costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run a benchmark (prints a table, writes JSON to bench/results/).
    Bench(uzram_bench::command::BenchArgs),
    /// Snapshot the memory of real programs into a page corpus for the benchmarks.
    Corpus(uzram_bench::corpus::build::CorpusArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Bench(a) => uzram_bench::command::run(a),
        Command::Corpus(a) => uzram_bench::corpus::build::run(a),
    }
}
