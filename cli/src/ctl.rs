//! `uzram ctl`: a running device's attributes through its control socket
//! (`NAME.ctl` next to the export socket, see `uzram::frontend::control`).

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;
use uzram::frontend::control::{self, ControlClient, Request, WireError, LONG_OPERATIONS};

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
    /// new device's id) and `hot_remove ID`: the server's, as zram's /sys/class/zram-control.
    pub attr: String,
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
    let d = crate::serve::default_socket_dir();
    if std::fs::symlink_metadata(&d).is_ok() {
        uzram::frontend::unix_socket::check_private_dir(&d)
            .map_err(|e| (e.errno(), format!("uzram: {}", e.message())))?;
    }
    Ok(d)
}

/// How a long operation's progress lines reach the person who started it: on a terminal
/// (stderr), an indicatif spinner with the elapsed time and the server's latest line, redrawn
/// in place and cleared when the operation ends; anywhere else (a pipe, a file, a log) each
/// line as it comes, `uzram: LINE` on stderr, unchanged for scripts that read it.
enum Progress {
    /// Lines on stderr.
    Lines,
    /// A spinner on the terminal.
    Bar(ProgressBar),
}

/// How often the spinner moves between the server's lines (one a second).
const SPINNER_TICK: Duration = Duration::from_millis(120);

impl Progress {
    /// The bar for storing `attr` when stderr is a terminal and `attr` is a long operation.
    fn for_store(attr: &str) -> Progress {
        if !LONG_OPERATIONS.contains(&attr) || !std::io::stderr().is_terminal() {
            return Progress::Lines;
        }
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner} {elapsed:>4} {wide_msg}")
                .expect("a valid template"),
        );
        bar.set_message(format!("{attr}: waiting for the server"));
        bar.enable_steady_tick(SPINNER_TICK);
        Progress::Bar(bar)
    }

    fn line(&self, text: &str) {
        match self {
            Progress::Lines => eprintln!("uzram: {text}"),
            Progress::Bar(b) => b.set_message(text.to_string()),
        }
    }

    fn finish(self) {
        if let Progress::Bar(b) = self {
            b.finish_and_clear();
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
    let (req, progress) = if args.value.is_empty() {
        let req = Request::Show {
            attr: args.attr.clone(),
        };
        (req, Progress::Lines)
    } else {
        let req = Request::Store {
            attr: args.attr.clone(),
            value: args.value.join(" "),
        };
        (req, Progress::for_store(&args.attr))
    };
    let answer = client.call(&req, &mut |p| progress.line(p));
    progress.finish();
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
