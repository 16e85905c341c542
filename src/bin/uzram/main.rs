//! The `uzram` command: serve devices, inspect and change their attributes, build page corpora
//! and run the benchmarks.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "uzram", version, about = "A compressed-RAM block device in userspace")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {}
}
