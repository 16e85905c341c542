//! `uzram ctl metrics`: every running device's statistics in the Prometheus text exposition
//! format (`uzram_service::frontend::metrics`), read through the control sockets as `uzram status`
//! reads them; the same text `uzram serve --metrics-listen` serves at `/metrics`. For
//! node_exporter's textfile collector: `uzram ctl metrics > /var/lib/node_exporter/uzram.prom`.

use std::path::Path;
use uzram_service::frontend::metrics::{self, DeviceSamples};

/// Collects every device in `dir`; a socket nobody answers on (a server that died) is reported
/// on stderr and skipped, as `uzram status` does. Returns the exit status.
pub fn run(dir: &Path) -> i32 {
    let names = match crate::status::socket_device_names(dir) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("uzram: {e}");
            return 1;
        }
    };
    let mut devices: Vec<DeviceSamples> = Vec::new();
    for name in names {
        let mut client = match crate::ctl::connect(dir, &name) {
            Ok(c) => c,
            Err((_, msg)) => {
                eprintln!("{msg}");
                continue;
            }
        };
        let samples = metrics::collect(&name, &mut |attr| match client.show(attr) {
            Ok(Ok(t)) => Ok(Some(t)),
            Ok(Err(e)) if e.errno == libc::ENOENT => Ok(None),
            Ok(Err(e)) => Err(e.to_error()),
            Err(e) => Err(e.into()),
        });
        match samples {
            Ok(s) => devices.push(s),
            Err(e) => {
                eprintln!("uzram: {name}: {}", e.message());
                return 1;
            }
        }
    }
    print!("{}", metrics::render(&devices));
    0
}
