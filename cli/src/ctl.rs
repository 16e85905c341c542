//! `uzram ctl`: a running device's attributes through its control socket
//! (`NAME.ctl` next to the export socket, see `uzram_service::frontend::control`).

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;
use uzram_service::frontend::control::{
    self, ControlClient, ProgressUpdate, Request, WireError, LONG_OPERATIONS,
};

#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The device.
    #[arg(long, default_value = "zram0")]
    pub dev: String,
    /// The directory of the sockets [default: /run/uzram as root, else $XDG_RUNTIME_DIR/uzram].
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The attribute, with zram's name (`mm_stat`, `disksize`, `compact`, `writeback`, ...);
    /// `metrics`: every device's statistics in Prometheus's text format; `hot_add` (prints the
    /// new device's id) and `hot_remove ID` (or the device's name when it is not `zramN`): the
    /// server's, as zram's /sys/class/zram-control; `upgrade`: the keeper's (`uzram serve
    /// --keeper`) replaces the server by the binary now on disk, the devices' state handed over
    /// (docs/restart.md).
    pub attr: String,
    /// Print a long operation's progress lines on stderr (`uzram: LINE`) when stderr is not a
    /// terminal (on a terminal a progress bar is drawn; elsewhere nothing, by default).
    #[arg(short, long)]
    pub verbose: bool,
    /// Store this value (words are joined with spaces); without it, show the attribute.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub value: Vec<String>,
}

/// `strerror` without the ` (os error N)` std appends.
pub fn strerror(errno: i32) -> String {
    let s = std::io::Error::from_raw_os_error(errno).to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// The exit status for an errno (errnos are below 256; 1 if it is not one).
fn exit_code(errno: i32) -> i32 {
    if (1..=255).contains(&errno) {
        errno
    } else {
        1
    }
}

pub fn connect(dir: &Path, dev: &str) -> std::result::Result<ControlClient, (i32, String)> {
    let path = control::socket_path(dir, dev);
    ControlClient::connect(&path).map_err(|e| {
        let errno = e.raw_os_error().unwrap_or(libc::EIO);
        (
            errno,
            format!(
                "uzram: {dev}: cannot reach {}: {} (is `uzram serve` running?)",
                path.display(),
                strerror(errno)
            ),
        )
    })
}

/// The socket directory: `--dir`, or the default one once it is known to be this user's own
/// (mode 0700, not a symlink), so that no other user's socket answers in the server's name.
pub fn socket_dir(dir: Option<PathBuf>) -> std::result::Result<PathBuf, (i32, String)> {
    if let Some(d) = dir {
        return Ok(d);
    }
    let d = uzram_service::host::default_socket_dir();
    if std::fs::symlink_metadata(&d).is_ok() {
        uzram_service::frontend::unix_socket::check_private_dir(&d)
            .map_err(|e| (e.errno(), format!("uzram: {}", e.message())))?;
    }
    Ok(d)
}

/// How a long operation's progress reaches the person who started it: on a terminal (stderr,
/// where the bar is drawn), an indicatif bar of the work done of the operation's total (pages
/// or zones, counted by the server: the request asks for counts), with the elapsed time and
/// the server's latest line, redrawn in place and cleared when the operation ends; a spinner
/// until the total is known (or from a server too old to count). Anywhere else (a pipe, a
/// file, a log, cron) nothing, unless `--verbose`: then each line as it comes, `uzram: LINE`
/// on stderr.
enum Progress {
    /// Nothing.
    Quiet,
    /// Lines on stderr.
    Lines,
    /// A bar on the terminal; whether it has turned determinate yet.
    Bar(ProgressBar, bool),
}

/// How often the spinner moves between the server's lines.
const SPINNER_TICK: Duration = Duration::from_millis(120);

impl Progress {
    /// The progress of storing `attr`: a bar when stderr is a terminal and `attr` is a long
    /// operation, else lines if `verbose`, else nothing.
    fn for_store(attr: &str, verbose: bool) -> Progress {
        if !LONG_OPERATIONS.contains(&attr) || !std::io::stderr().is_terminal() {
            return if verbose {
                Progress::Lines
            } else {
                Progress::Quiet
            };
        }
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {elapsed:>4} {wide_msg}")
                .expect("a valid template"),
        );
        bar.set_message(format!("{attr}: waiting for the server"));
        bar.enable_steady_tick(SPINNER_TICK);
        Progress::Bar(bar, false)
    }

    /// Whether the request should ask the server for counts.
    fn wants_counts(&self) -> bool {
        matches!(self, Progress::Bar(..))
    }

    fn update(&mut self, u: ProgressUpdate<'_>) {
        match (self, u) {
            (Progress::Quiet, _) => {}
            (Progress::Lines, u) => eprintln!("uzram: {}", u.message()),
            (Progress::Bar(b, determinate), ProgressUpdate::Count(c)) if c.total > 0 => {
                if !*determinate {
                    // The unit is fixed for the operation: part of the template.
                    let template = format!(
                        "{{elapsed:>4}} [{{bar:30}}] {{pos}}/{{len}} {} ({{percent}}%) \
                         {{wide_msg}}",
                        c.unit
                    );
                    b.set_style(
                        ProgressStyle::with_template(&template)
                            .expect("a valid template")
                            .progress_chars("=> "),
                    );
                    *determinate = true;
                }
                b.set_length(c.total);
                b.set_position(c.done);
                b.set_message(c.message.clone());
            }
            (Progress::Bar(b, _), u) => b.set_message(u.message().to_string()),
        }
    }

    /// Ends the display: a bar that reached its total after a success stays on the screen,
    /// full (what was done, in how long); a spinner, or a bar after a failure, is cleared
    /// (the error follows).
    fn finish(self, success: bool) {
        match self {
            Progress::Bar(b, true) if success => b.finish(),
            Progress::Bar(b, _) => b.finish_and_clear(),
            _ => {}
        }
    }
}

/// Runs `uzram ctl`; returns the process's exit status (0, or the errno of the failure).
pub fn run_ctl(args: CtlArgs) -> i32 {
    let dir = match socket_dir(args.dir) {
        Ok(d) => d,
        Err((errno, msg)) => {
            eprintln!("{msg}");
            return exit_code(errno);
        }
    };
    if args.attr == "metrics" && args.value.is_empty() {
        // Every device's, not only --dev's: what a scraper wants in one go.
        return crate::metrics::run(&dir);
    }
    // `upgrade` is the keeper's (`uzram serve --keeper`).
    if args.attr == "upgrade" {
        return upgrade(&dir);
    }
    // zram's /sys/class/zram-control/ attributes are the server's, not a device's.
    let connected = if control::CLASS_ATTRS.contains(&args.attr.as_str()) {
        let path = control::class_socket_path(&dir);
        ControlClient::connect(&path).map_err(|e| {
            let errno = e.raw_os_error().unwrap_or(libc::EIO);
            (
                errno,
                format!(
                    "uzram: cannot reach {}: {} (is `uzram serve` running?)",
                    path.display(),
                    strerror(errno)
                ),
            )
        })
    } else {
        connect(&dir, &args.dev)
    };
    let mut client = match connected {
        Ok(c) => c,
        Err((errno, msg)) => {
            eprintln!("{msg}");
            return exit_code(errno);
        }
    };
    let (req, mut progress) = if args.value.is_empty() {
        let req = Request::Show {
            attr: args.attr.clone(),
        };
        (req, Progress::Quiet)
    } else {
        let progress = Progress::for_store(&args.attr, args.verbose);
        let req = Request::Store {
            attr: args.attr.clone(),
            value: args.value.join(" "),
            counts: progress.wants_counts(),
        };
        (req, progress)
    };
    let answer = client.call_with_progress(&req, &mut |u| progress.update(u));
    progress.finish(matches!(answer, Ok(Ok(_))));
    match answer {
        Ok(Ok(text)) => {
            print!("{text}");
            0
        }
        Ok(Err(WireError {
            errno,
            name,
            message,
        })) => {
            // As the shell reports a failed sysfs write, plus the symbolic name and why.
            eprintln!(
                "uzram: {}: {} ({name}): {message}",
                args.attr,
                strerror(errno)
            );
            exit_code(errno)
        }
        Err(e) => {
            eprintln!("uzram: {}: the server closed the connection: {e}", args.dev);
            exit_code(e.raw_os_error().unwrap_or(libc::EIO))
        }
    }
}

/// `uzram ctl upgrade`: asks the keeper to replace the server by the binary now on disk;
/// prints its answer, or its error (the server serves on unchanged, or again).
fn upgrade(dir: &Path) -> i32 {
    let path = uzram_service::keeper::socket_path(dir);
    let mut client = match ControlClient::connect(&path) {
        Ok(c) => c,
        Err(e) => {
            let errno = e.raw_os_error().unwrap_or(libc::EIO);
            eprintln!(
                "uzram: upgrade: cannot reach the keeper at {}: {} (is `uzram serve --keeper` \
                 running? under systemd: systemctl restart uzram)",
                path.display(),
                strerror(errno)
            );
            return exit_code(errno);
        }
    };
    let req = Request::Store {
        attr: "upgrade".into(),
        value: "1".into(),
        counts: false,
    };
    match client.call_with_progress(&req, &mut |_| {}) {
        Ok(Ok(text)) => {
            print!("{text}");
            0
        }
        Ok(Err(WireError {
            errno,
            name,
            message,
        })) => {
            eprintln!("uzram: upgrade: {} ({name}): {message}", strerror(errno));
            exit_code(errno)
        }
        Err(e) => {
            eprintln!("uzram: upgrade: the keeper closed the connection: {e}");
            exit_code(e.raw_os_error().unwrap_or(libc::EIO))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errnos_become_exit_codes() {
        assert_eq!(exit_code(libc::EBUSY), 16);
        assert_eq!(exit_code(0), 1);
        assert_eq!(strerror(libc::EBUSY), "Device or resource busy");
    }
}
