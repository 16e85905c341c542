//! The device fixture: one path to every way a test makes a [`Device`]: plain, over a backing
//! (an object or a `backing_dev` path), zoned, with compressed writeback, with attributes or
//! debug settings that must come before `disksize`.

use std::sync::Arc;

use uzram::backing::{Backing, Engine, FileBacking, FileOptions, MemBacking};
use uzram::clock::{Clock, SystemClock};
use uzram::device::Device;
use uzram::writeback::{WritebackReport, WritebackSpec};
use uzram::BlockDevice;

use crate::pages::PAGE;

/// A plain device of `pages` 4 KiB pages (lz4, no backing).
pub fn device(pages: u64) -> Device {
    DeviceBuilder::pages(pages).build()
}

/// A device of `pages` 4 KiB pages writing back to `backing` (the bitmap layout).
pub fn device_over(pages: u64, backing: Arc<dyn Backing>) -> Device {
    DeviceBuilder::pages(pages).backing(backing).build()
}

/// A device of `pages` 4 KiB pages writing back to `backing` in the zoned layout, zones of
/// `zone_size`.
pub fn zoned_device(pages: u64, backing: Arc<dyn Backing>, zone_size: &str) -> Device {
    DeviceBuilder::pages(pages)
        .backing(backing)
        .zoned(zone_size)
        .build()
}

/// A device of `size_bytes` to share (to serve, or to hand to threads).
pub fn new_device(size_bytes: u64) -> Arc<dyn BlockDevice> {
    Arc::new(DeviceBuilder::bytes(size_bytes).build())
}

/// A memory backing of `blocks` 4 KiB blocks.
pub fn mem_backing(blocks: u64) -> Arc<MemBacking> {
    Arc::new(MemBacking::new(blocks * PAGE as u64).unwrap())
}

/// A temporary directory on a real file system (`/var/tmp`, where O_DIRECT works; the
/// default temporary directory may be a tmpfs).
pub fn real_tmpdir() -> tempfile::TempDir {
    tempfile::tempdir_in("/var/tmp").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

/// A backing file `dir/backing` of `blocks` 4 KiB blocks, through `engine`.
pub fn file_backing(dir: &tempfile::TempDir, blocks: u64, engine: Engine) -> FileBacking {
    FileBacking::create(
        dir.path().join("backing"),
        blocks * PAGE as u64,
        &FileOptions::with_engine(engine),
    )
    .unwrap()
}

type Setup = Box<dyn FnOnce(&Device)>;

/// What a device is made of, set in the order zram takes it: everything but `disksize`
/// first, then `disksize` (which initialises the device).
pub struct DeviceBuilder {
    page_size: usize,
    disksize_bytes: u64,
    backing: Option<Arc<dyn Backing>>,
    clock: Option<Arc<dyn Clock>>,
    steps: Vec<Setup>,
}

impl std::fmt::Debug for DeviceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuilder({} bytes)", self.disksize_bytes)
    }
}

impl DeviceBuilder {
    /// A device of `pages` pages (of [`PAGE`] bytes unless [`page_size`](Self::page_size)
    /// says otherwise).
    pub fn pages(pages: u64) -> DeviceBuilder {
        DeviceBuilder {
            page_size: PAGE,
            disksize_bytes: pages * PAGE as u64,
            backing: None,
            clock: None,
            steps: Vec::new(),
        }
    }

    /// A device of `bytes`.
    pub fn bytes(bytes: u64) -> DeviceBuilder {
        DeviceBuilder {
            disksize_bytes: bytes,
            ..DeviceBuilder::pages(0)
        }
    }

    /// Pages of `bytes` (the page count given to [`pages`](Self::pages) stays).
    pub fn page_size(mut self, bytes: usize) -> DeviceBuilder {
        self.disksize_bytes = self.disksize_bytes / self.page_size as u64 * bytes as u64;
        self.page_size = bytes;
        self
    }

    /// Writes back to `backing` (set with `set_backing`, before the layout and `disksize`).
    pub fn backing(mut self, backing: Arc<dyn Backing>) -> DeviceBuilder {
        self.backing = Some(backing);
        self
    }

    /// Reads time from `clock` (a manual clock, for idle ages and policies).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> DeviceBuilder {
        self.clock = Some(clock);
        self
    }

    /// `echo PATH > backing_dev`, as an operator sets it.
    pub fn backing_dev(self, path: &str) -> DeviceBuilder {
        self.attr("backing_dev", path)
    }

    /// The zoned layout, zones of `zone_size` (`echo zoned > backing_layout`).
    pub fn zoned(self, zone_size: &str) -> DeviceBuilder {
        self.attr("backing_layout", "zoned")
            .attr("zone_size", zone_size)
    }

    /// Compressed writeback on.
    pub fn compressed_writeback(self, on: bool) -> DeviceBuilder {
        self.with(move |d| d.set_compressed_writeback(on).unwrap())
    }

    /// `echo VALUE > NAME` before `disksize`; must succeed.
    pub fn attr(self, name: &str, value: &str) -> DeviceBuilder {
        let (name, value) = (name.to_string(), value.to_string());
        self.with(move |d| {
            d.attr_store(&name, &value)
                .unwrap_or_else(|e| panic!("{name} {value}: {e}"))
        })
    }

    /// Any other setting, made before `disksize`.
    pub fn with(mut self, step: impl FnOnce(&Device) + 'static) -> DeviceBuilder {
        self.steps.push(Box::new(step));
        self
    }

    /// The device, initialised.
    pub fn build(self) -> Device {
        let clock = self.clock.unwrap_or_else(|| Arc::new(SystemClock::new()));
        let dev = Device::new_uninit_with_clock(self.page_size, clock).unwrap();
        if let Some(b) = self.backing {
            dev.set_backing(b).unwrap();
        }
        for step in self.steps {
            step(&dev);
        }
        dev.attr_store("disksize", &self.disksize_bytes.to_string())
            .unwrap();
        dev
    }
}

/// `bd_stat` as numbers: bd_count, bd_reads, bd_writes.
pub fn bd(dev: &Device) -> [u64; 3] {
    let v = columns(dev, "bd_stat");
    [v[0], v[1], v[2]]
}

/// An attribute's columns as numbers (every column must be one).
pub fn columns(dev: &Device, attr: &str) -> Vec<u64> {
    let s = dev.attr_show(attr).unwrap();
    s.split_whitespace()
        .map(|x| {
            x.parse()
                .unwrap_or_else(|_| panic!("{attr}: {x:?} is not a number in {s:?}"))
        })
        .collect()
}

/// Writes back every page of the first `pages` (`writeback page_indexes=0-N`); a failed write
/// is in the report, not an error.
pub fn writeback_all(dev: &Device, pages: u64) -> WritebackReport {
    dev.writeback_with_progress(&WritebackSpec::pages(0, pages - 1), &mut |_| {})
        .unwrap()
}

/// The errno of a call that must fail.
pub fn errno<T: std::fmt::Debug>(r: uzram::Result<T>) -> i32 {
    r.expect_err("should fail").errno()
}
