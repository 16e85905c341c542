//! The `uzram` command: serve devices, inspect and change their attributes, build page corpora
//! and run the benchmarks.

mod corpus;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "uzram",
    version,
    about = "A compressed-RAM block device in userspace"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Build a page corpus from the anonymous memory of real programs.
    Corpus(corpus::CorpusArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Corpus(args) => corpus::run(args),
    }
}
