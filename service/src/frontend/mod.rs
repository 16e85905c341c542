//! Frontends: the ways users reach a [`BlockDevice`](uzram::BlockDevice).
//!
//! Each frontend talks only to the narrow `BlockDevice` trait (and, for control, to the
//! device's attributes); nothing below knows about it.
//!
//! - [`nbd`]: a Network Block Device server (fixed newstyle, structured replies), reachable by
//!   QEMU, qemu-img/qemu-io, libnbd's tools, fio's nbd engine, and the kernel through nbdfuse.
//! - [`swap`]: what a server backing swap does to itself (locked memory, I/O flusher).
//! - `ublk` (feature `ublk`, on by default): the device as a kernel block device
//!   `/dev/ublkbN` on this host, through `ublk_drv` (docs/ublk.md).
//! - `vhost_user` (feature `vhost-user`, on by default): the device as a VM's virtio-blk disk
//!   through a vhost-user-blk socket (docs/vhost-user.md); `virtio_blk`: its requests parsed
//!   by the virtio-blk spec's rules, one pure function.
//! - [`metrics`]: every device's statistics in Prometheus's text format, and the HTTP endpoint
//!   that serves them (`uzram serve --metrics-listen`; docs/metrics.md).
//! - [`control`]: a running device's attributes over a unix socket (`uzram ctl`, `uzram status`).
//! - [`limits`]: what every frontend bounds and how (connection caps, the request memory
//!   budget, deadlines, the quit fd its accept loops wait on); [`unix_socket`]: sockets and
//!   socket directories only their owner controls.

pub mod control;
pub mod limits;
pub mod metrics;
pub mod nbd;
pub mod swap;
#[cfg(feature = "ublk")]
pub mod ublk;
pub mod unix_socket;
#[cfg(feature = "vhost-user")]
pub mod vhost_inflight;
#[cfg(feature = "vhost-user")]
pub mod vhost_user;
#[cfg(feature = "vhost-user")]
pub mod virtio_blk;
