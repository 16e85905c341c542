//! The NBD server: exports [`BlockDevice`]s by name over unix sockets or TCP.
//!
//! The protocol is `doc/proto.md` of the NetworkBlockDevice project, written from the spec:
//!
//! - [`protocol`]: the wire format (constants, message layouts, request validation); pure.
//! - [`handshake`]: fixed newstyle negotiation (`GO`, `INFO`, `LIST`, `EXPORT_NAME`, `ABORT`,
//!   `STRUCTURED_REPLY`), over any byte stream.
//! - [`wire`]: a connection's byte stream, plain or TLS ([`tls`]), every wait bounded.
//! - [`listener`]: binding, and the accept loops (connection cap, quit fd).
//! - [`connection`]: one connection's life: the handshake under its deadline, then
//!   [`transmission`]: requests read under the memory budget, executed by a small worker
//!   pool, answered as they finish.
//! - [`server`]: starting, the shared state, a bounded stop.
//!
//! The limits every frontend shares (connections, request memory, deadlines, the quit fd) are
//! in [`crate::frontend::limits`].
//!
//! What is negotiated and why is in `docs/nbd.md`. Usage:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # fn demo(dev: Arc<dyn uzram::BlockDevice>) -> uzram::Result<()> {
//! use uzram_service::frontend::nbd::{Export, Listen, Server, ServerConfig};
//! let exports = vec![Export::new("zram0", dev)];
//! let listen = [Listen::Unix { path: "/run/uzram/zram0.sock".into(), export: "zram0".into() }];
//! let server = Server::start(exports, &listen, ServerConfig::default())?;
//! for (_, uri) in server.uris() {
//!     println!("{uri}");
//! }
//! server.stop();
//! # Ok(()) }
//! ```

mod connection;
pub mod handshake;
mod listener;
pub mod server;
pub mod tls;
pub mod transmission;
pub mod wire;

pub use server::{Endpoint, Openers, Server, ServerConfig};
pub use tls::{Tls, TlsFiles, TlsMode};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use uzram::BlockDevice;

/// One device offered under a name.
#[derive(Clone)]
pub struct Export {
    /// The export name clients ask for (`zram0`).
    pub name: String,
    /// Shown by `NBD_OPT_LIST` and `NBD_INFO_DESCRIPTION` (may be empty).
    pub description: String,
    /// The device behind it, shared by every connection.
    pub device: Arc<dyn BlockDevice>,
    /// Clients may only read: the transmission flags say `READ_ONLY`, and writes, trims and
    /// write-zeroes get `EPERM`.
    pub read_only: bool,
}

impl Export {
    /// An export with an empty description.
    pub fn new(name: impl Into<String>, device: Arc<dyn BlockDevice>) -> Export {
        Export {
            name: name.into(),
            description: String::new(),
            device,
            read_only: false,
        }
    }
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("description", &self.description)
            .field("size_bytes", &self.device.size_bytes())
            .finish()
    }
}

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A unix socket (created with mode 0600); the empty export name means `export`.
    Unix {
        /// The socket file.
        path: PathBuf,
        /// The default export's name.
        export: String,
    },
    /// A TCP address; every export is reachable by name, the empty name means the first.
    Tcp(SocketAddr),
}
