//! One connection's life: the handshake under its total deadline, then transmission.
//!
//! Runs on the connection's own thread (started by [`listener`](super::listener)), holding a
//! [`ConnectionSlot`](crate::frontend::limits::ConnectionSlot) for its whole life.

use super::handshake::{negotiate, HandshakeIo, TlsPolicy};
use super::server::{lock, ExportEntry, Shared};
use super::tls::TlsMode;
use super::transmission::{transmission, Context};
use super::wire::Wire;
use super::Export;
use crate::frontend::limits::{Deadline, QuitFd};
use std::io::{self, Read, Write};
use std::sync::atomic::Ordering;

/// The handshake's view of a wire: every read and write bounded by the handshake deadline and
/// interrupted by the quit fd.
struct HandshakeStream<'a> {
    wire: &'a Wire,
    deadline: Deadline,
    quit: &'a QuitFd,
    shared: &'a Shared,
}

impl Read for HandshakeStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.wire.recv_until(buf, self.deadline, Some(self.quit))
    }
}

impl Write for HandshakeStream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.wire.send_until(buf, self.deadline)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl HandshakeIo for HandshakeStream<'_> {
    fn tls_policy(&self) -> TlsPolicy {
        match &self.shared.config.tls {
            Some(t) if self.wire.socket().is_tcp() => match t.mode {
                TlsMode::Require => TlsPolicy::Required,
                TlsMode::On => TlsPolicy::Optional,
                TlsMode::Off => TlsPolicy::Unavailable,
            },
            _ => TlsPolicy::Unavailable,
        }
    }

    fn tls_active(&self) -> bool {
        self.wire.is_tls()
    }

    fn start_tls(&mut self) -> io::Result<()> {
        let tls = self
            .shared
            .config
            .tls
            .as_ref()
            .ok_or(io::ErrorKind::Unsupported)?;
        self.wire
            .start_tls(tls.config.clone(), self.deadline, Some(self.quit))
    }
}

/// Serves one connection to the end: handshake, then transmission on the chosen export. The
/// empty export name means `default_export` (`None`: the first export).
pub(crate) fn serve_connection(
    shared: &Shared,
    wire: &Wire,
    default_export: Option<&str>,
) -> io::Result<()> {
    let limits = &shared.config.limits;
    let mut hs = HandshakeStream {
        wire,
        deadline: Deadline::after(limits.handshake),
        quit: &shared.quit,
        shared,
    };
    // The exports as they are now: one removed during the handshake refuses the open below.
    let entries: Vec<ExportEntry> = lock(&shared.exports).clone();
    let exports: Vec<Export> = entries.iter().map(|e| e.export.clone()).collect();
    let default_index = match default_export {
        Some(name) => exports.iter().position(|e| e.name == name),
        None => (!exports.is_empty()).then_some(0),
    };
    // The export is opened before the handshake's last reply (`negotiate`), so a client that
    // has finished its handshake holds it open; dropped with the connection.
    let mut open = None;
    let negotiated = negotiate(
        &mut hs,
        &exports,
        default_index,
        &shared.stopping,
        &mut |i: usize| {
            open = entries[i].openers.open();
            open.is_some()
        },
    )?;
    let Some(neg) = negotiated else {
        wire.close_tls(Deadline::after(limits.reply));
        return Ok(());
    };
    debug_assert!(open.is_some(), "negotiate opens the export it chose");
    let _open = open;
    let entry = &entries[neg.export];
    let device = &*entry.export.device;
    if device.size_bytes() != neg.size_bytes {
        // Reset (and perhaps resized) between the size being sent and now: the client's idea
        // of the export is wrong, so it must reconnect.
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the device was reset during the handshake",
        ));
    }
    if shared.stopping.load(Ordering::SeqCst) {
        return Ok(());
    }
    let cx = Context {
        limits,
        budget: &shared.budget,
        stop: &shared.stopping,
        workers: shared.config.workers_per_connection,
    };
    let r = transmission(wire, device, &neg, &cx);
    wire.close_tls(Deadline::after(limits.reply.min(limits.stop_grace)));
    r
}
