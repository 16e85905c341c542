//! The `uzram` command: serve devices, inspect and change their attributes, build page corpora
//! and run the benchmarks.

mod ctl;
mod dist;
mod harness;
mod metrics;
mod serve;
mod status;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// `uzram --version`: the package's version and the commit it is built from (build.rs).
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("UZRAM_COMMIT"), ")");

#[derive(Debug, Parser)]
#[command(
    name = "uzram",
    version = VERSION,
    about = "A compressed-RAM block device in userspace"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start: the size of `serve`'s many flags costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run a benchmark (prints a table, writes JSON to bench/results/; `uzram bench --help`).
    #[command(disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Snapshot the memory of real programs into a page corpus for the benchmarks.
    #[command(disable_help_flag = true)]
    Corpus {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Create devices and export them over NBD (a unix socket by default).
    Serve(serve::ServeArgs),
    /// Show or store an attribute of a running device, as `cat`/`echo >` on zram's sysfs.
    Ctl(ctl::CtlArgs),
    /// A table of the running devices with zramctl's options, columns and formats.
    Status(status::StatusArgs),
    /// Delete ublk device ID (/dev/ublkcID) left behind by a server that died (docs/ublk.md).
    UblkDelete {
        /// The device number: N of /dev/ublkbN, /dev/ublkcN.
        id: u32,
    },
    /// Print a shell's completion script (bash: save it as
    /// /usr/share/bash-completion/completions/uzram).
    Completions(dist::CompletionsArgs),
    /// Write the man pages, shell completions and default configuration a package installs.
    #[command(hide = true)]
    PackageFiles(dist::PackageFilesArgs),
}

/// The command line's definition, with what is added at run time (the status columns' help).
fn cli_command() -> clap::Command {
    Cli::command().mut_subcommand("status", |c| c.after_help(status::columns_help()))
}

fn main() -> anyhow::Result<()> {
    let cli = match cli_command()
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m))
    {
        Ok(cli) => cli,
        Err(e) => {
            // `uzram status` exits 1 on bad options, as zramctl (clap's usage errors are 2).
            let status = std::env::args().nth(1).as_deref() == Some("status");
            if status && e.use_stderr() {
                let _ = e.print();
                std::process::exit(1);
            }
            e.exit()
        }
    };
    match cli.command {
        Command::Bench { args } => harness::exec("bench", args),
        Command::Corpus { args } => harness::exec("corpus", args),
        Command::Serve(a) => serve::run(a),
        Command::Ctl(a) => std::process::exit(ctl::run_ctl(a)),
        Command::Status(a) => std::process::exit(status::run(a)),
        Command::UblkDelete { id } => {
            uzram_service::frontend::ublk::delete_device(id)?;
            println!("deleted ublk device {id}");
            Ok(())
        }
        Command::Completions(a) => dist::completions(cli_command(), a),
        Command::PackageFiles(a) => dist::package_files(cli_command(), a),
    }
}
