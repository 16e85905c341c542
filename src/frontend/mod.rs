//! Frontends: the ways users reach a [`BlockDevice`](crate::BlockDevice).
//!
//! Each frontend talks only to the narrow `BlockDevice` trait (and, for control, to the
//! device's attributes); nothing below knows about it.
//!
//! - [`nbd`]: a Network Block Device server (fixed newstyle, structured replies), reachable by
//!   QEMU, qemu-img/qemu-io, libnbd's tools, fio's nbd engine, and the kernel through nbdfuse.

pub mod nbd;
