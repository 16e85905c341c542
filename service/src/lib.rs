//! uzram's service: everything that turns the engine (the `uzram` crate: devices, the
//! allocator, writeback, the backing stores) into a running server.
//!
//! Calls only go down: this crate uses the engine through its public API (and the
//! [`uzram::BlockDevice`] trait), and nothing in the engine knows this crate exists.
//!
//! - [`frontend`]: the ways users reach a device: the NBD server, ublk, vhost-user-blk, the
//!   control socket (`uzram ctl`, `uzram status`), the metrics endpoint, the limits every
//!   frontend keeps, and what a server backing swap does to itself.
//! - [`policy`]: the automatic policies (idle aging, writeback, recompression, compaction,
//!   zoned GC), which only store attributes, as a user could.
//! - Configuration: [`config`] (uzram's TOML), [`generator_conf`] (zram-generator's INI; [`generator_files`]: its files where it finds them) and
//!   [`size_expr`] (their size expressions).
//! - [`devices`]: the registry of a running server's devices, hot-plug (`hot_add`,
//!   `hot_remove`) and each device's frontends.
//! - Restarts: [`fd_store`] (where a serving process keeps its devices' state files, and the
//!   files it inherits), [`keeper`] (`uzram serve --keeper`: the process holding them and
//!   restarting the server), [`scm`] (descriptors over unix sockets).
//! - [`host`]: a running server as a type, [`host::Host::start`] and [`host::Host::stop`], and
//!   the defaults it starts from (RAM, the socket directory, the NBD server's settings).

pub mod config;
pub mod devices;
pub mod fd_store;
pub mod frontend;
pub mod generator_conf;
pub mod generator_files;
pub mod host;
pub mod keeper;
pub mod policy;
pub use uzram::scm;
pub mod size_expr;
