//! uzram's test kit: the fixtures every test shares, one path to each.
//!
//! - [`process`]: running commands and real client programs (a missing one fails the test).
//! - [`pages`]: the one page generator (text, half-random, random, same-filled and real program
//!   pages), each page stamped with its index and version so a misplaced or stale page shows.
//! - [`device`]: the device fixture, one builder over every way a device is made.
//! - [`hook_backing`]: a memory backing whose queues run hooks (on submit, on wait).
//! - [`nbd`]: a device served over NBD on a unix socket, a raw NBD client, an export as the
//!   kernel's block device; [`nbd_servers`]: nbdkit and qemu-nbd; [`faults`]: faulty disks.
//! - [`refused`]: tables of bad input, each errno with the values refused with it.
//! - [`tls`]: certificates for the TLS tests.
//! - [`serve`]: a running `uzram serve` (spawn, wait, ctl, URI, stop).
//! - [`virtio_blk`]: a virtio-blk driver on a vhost-user-blk socket (the vhost-user front end
//!   and the guest's split virtqueues, no VM), for the request-path tests and `uzram bench
//!   vhost`.
//! - [`vm`]: tests inside a VM with a real kernel, and the swap kit run there (`Hog`,
//!   `/proc/meminfo`, `/proc/vmstat`, the host's programs).
//!
//! Dev-only: the other members use it as a dev-dependency (and the harness, `uzram-bench`,
//! which is no part of the product either), never in what they ship.

pub mod device;
pub mod faults;
pub mod hook_backing;
pub mod nbd;
pub mod nbd_servers;
pub mod pages;
pub mod process;
pub mod refused;
pub mod serve;
pub mod tls;
pub mod virtio_blk;
pub mod vm;
