//! What a package installs beside the binary, made from the command's own definition so that it
//! cannot drift from it: a man page per command (clap_mangen: `uzram.1`, `uzram-serve.1`,
//! `uzram-ctl.1`, ...; `uzram bench` runs the harness, which the package does not ship), shell
//! completions (clap_complete) and the default configuration. `uzram package-files DIR` (hidden) writes them all for `scripts/deb`;
//! `uzram completions SHELL` prints one shell's completions for an install without a package.

use anyhow::{Context, Result};
use clap::Args;
use clap_complete::Shell;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    shell: Shell,
}

#[derive(Debug, Args)]
pub struct PackageFilesArgs {
    /// The directory to write into (made when missing): man/man1/*.1, completions/{uzram.bash,
    /// _uzram,uzram.fish} and uzram.toml (`serve --print-default-config`).
    dir: PathBuf,
}

/// The shells a package installs completions for, and each file's name.
const PACKAGED_SHELLS: [(Shell, &str); 3] = [
    (Shell::Bash, "uzram.bash"),
    (Shell::Zsh, "_uzram"),
    (Shell::Fish, "uzram.fish"),
];

/// Prints `args.shell`'s completion script for `cmd` on stdout.
pub fn completions(mut cmd: clap::Command, args: CompletionsArgs) -> Result<()> {
    clap_complete::generate(args.shell, &mut cmd, "uzram", &mut std::io::stdout());
    Ok(())
}

/// Writes the man pages, completions and default configuration under `args.dir`.
pub fn package_files(cmd: clap::Command, args: PackageFilesArgs) -> Result<()> {
    let man = args.dir.join("man/man1");
    let completions = args.dir.join("completions");
    for d in [&man, &completions] {
        std::fs::create_dir_all(d).with_context(|| format!("{}", d.display()))?;
    }
    write_man_pages(cmd.clone(), &man)?;
    for (shell, name) in PACKAGED_SHELLS {
        let mut text = Vec::new();
        clap_complete::generate(shell, &mut cmd.clone(), "uzram", &mut text);
        write(&completions.join(name), &text)?;
    }
    write(
        &args.dir.join("uzram.toml"),
        uzram_service::config::DEFAULT_CONFIG_TOML.as_bytes(),
    )?;
    Ok(())
}

/// One page per visible command and subcommand, section 1, named as man finds them
/// (`uzram-serve.1` for `uzram serve`). Hidden commands (this one) get none.
fn write_man_pages(cmd: clap::Command, dir: &Path) -> Result<()> {
    let cmd = cmd.disable_help_subcommand(true);
    clap_mangen::generate_to(cmd, dir).with_context(|| format!("man pages in {}", dir.display()))
}

fn write(path: &Path, data: &[u8]) -> Result<()> {
    std::fs::write(path, data).with_context(|| format!("{}", path.display()))
}
