//! The kernel's zram as a benchmark anchor: `/sys/block/zram0` driven through sysfs and
//! `/dev/zram0` with O_DIRECT, when it exists and we are root. Always reset afterwards.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use uzram::error::{Error, Result};

/// A handle on `/sys/block/zram0`, reset when dropped.
#[derive(Debug)]
pub struct KernelZram {
    sys: PathBuf,
    dev: PathBuf,
}

impl KernelZram {
    /// The kernel's zram0, if it exists, is unused (`initstate` 0) and we are root.
    pub fn open() -> Option<KernelZram> {
        let sys = PathBuf::from("/sys/block/zram0");
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        if !root || !sys.exists() {
            return None;
        }
        let k = KernelZram {
            sys,
            dev: PathBuf::from("/dev/zram0"),
        };
        match k.show("initstate") {
            Ok(s) if s.trim() == "0" => Some(k),
            _ => None,
        }
    }

    /// Why [`open`](Self::open) gave nothing, for the report.
    pub fn unavailable_reason() -> String {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            "not root".into()
        } else if !std::path::Path::new("/sys/block/zram0").exists() {
            "no /sys/block/zram0".into()
        } else {
            "zram0 is in use (initstate 1)".into()
        }
    }

    /// Reads an attribute.
    pub fn show(&self, name: &str) -> Result<String> {
        Ok(std::fs::read_to_string(self.sys.join(name))?)
    }

    /// Writes an attribute.
    pub fn store(&self, name: &str, value: &str) -> Result<()> {
        std::fs::write(self.sys.join(name), value)
            .map_err(|e| Error::new(Error::from(e).kind(), format!("zram0 {name}={value}")))
    }

    /// True if the kernel offers `algo`.
    pub fn has_algorithm(&self, algo: &str) -> bool {
        self.show("comp_algorithm")
            .map(|s| {
                s.split_whitespace()
                    .any(|a| a.trim_matches(|c| c == '[' || c == ']') == algo)
            })
            .unwrap_or(false)
    }

    /// `mm_stat` as numbers.
    pub fn mm_stat(&self) -> Result<Vec<u64>> {
        self.show("mm_stat")?
            .split_whitespace()
            .map(|t| t.parse().map_err(|_| Error::io("bad mm_stat")))
            .collect()
    }

    /// Opens `/dev/zram0` for O_DIRECT I/O.
    pub fn open_direct(&self) -> Result<File> {
        Ok(OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&self.dev)?)
    }

    /// Discards `[offset, offset + len)` (BLKDISCARD).
    pub fn discard(file: &File, offset: u64, len: u64) -> Result<()> {
        use std::os::fd::AsRawFd;
        const BLKDISCARD: libc::c_ulong = 0x1277; // _IO(0x12, 119)
        let range = [offset, len];
        // SAFETY: BLKDISCARD reads two u64s from the pointer, which points at `range`, alive for
        // the call; the fd is open.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKDISCARD, range.as_ptr()) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(())
    }

    /// Writes `buf` (aligned, see [`AlignedBuf`]) at `offset`.
    pub fn write_all_at(file: &File, buf: &[u8], offset: u64) -> Result<()> {
        Ok(file.write_all_at(buf, offset)?)
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> Result<()> {
        Ok(file.read_exact_at(buf, offset)?)
    }
}

impl Drop for KernelZram {
    fn drop(&mut self) {
        let _ = std::fs::write(self.sys.join("reset"), "1");
    }
}

/// A heap buffer aligned for O_DIRECT.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes aligned to 4096.
    pub fn new(len: usize) -> AlignedBuf {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).expect("layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points at `layout.size()` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
