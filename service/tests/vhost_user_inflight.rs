//! Requests in flight when the vhost-user-blk server dies are served by the next server,
//! through the inflight region the front end keeps (`src/frontend/vhost_inflight.rs`), with
//! the test kit's virtio-blk driver (`uzram_testkit::virtio_blk`) playing QEMU: it asks for
//! the region, and after the "crash" reconnects to a new server as QEMU does with
//! `reconnect-ms` (the region handed back, each queue's base its used index).
//!
//! The crash: the first server's device blocks every write once `frozen` is set, for good;
//! the server takes a request, marks it in the region and blocks in the device, as a process
//! killed mid-request would leave it (it never completes it). That server is leaked, and a
//! second one is started over the same device pages, as the keeper's next server would be.
//! The order of stores at every step of the bookkeeping is the unit test's
//! (`vhost_inflight::tests`): a crash after any one of them.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uzram::error::Result;
use uzram::{BlockDevice, Extent};
use uzram_service::frontend::vhost_user::{VhostUserConfig, VhostUserExport};
use uzram_testkit::device::new_device;
use uzram_testkit::pages::pattern;
use uzram_testkit::virtio_blk::{Completion, DriverConfig, Request, VhostUserBlk, S_OK};

const DEVICE_BYTES: u64 = 8 << 20;

/// A device that logs the offset of every write and, once `frozen`, blocks every write for
/// good (after counting it in `blocked`).
struct Gate {
    inner: Arc<dyn BlockDevice>,
    frozen: AtomicBool,
    blocked: AtomicUsize,
    writes: Mutex<Vec<u64>>,
}

impl Gate {
    fn new(inner: &Arc<dyn BlockDevice>) -> Arc<Gate> {
        Arc::new(Gate {
            inner: Arc::clone(inner),
            frozen: AtomicBool::new(false),
            blocked: AtomicUsize::new(0),
            writes: Mutex::new(Vec::new()),
        })
    }
}

impl BlockDevice for Gate {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn page_size_bytes(&self) -> usize {
        self.inner.page_size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        if self.frozen.load(Ordering::Acquire) {
            self.blocked.fetch_add(1, Ordering::AcqRel);
            loop {
                std::thread::park();
            }
        }
        self.writes.lock().unwrap().push(offset);
        self.inner.write_at(buf, offset)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.write_zeroes(offset, len)
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
    fn read_bytes_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read_bytes_at(buf, offset)
    }
    fn write_bytes_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.inner.write_bytes_at(buf, offset)
    }
    fn write_zeroes_bytes(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.write_zeroes_bytes(offset, len)
    }
    fn allocation(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> Result<()> {
        self.inner.allocation(offset, len, max_extents, out)
    }
}

fn export(dir: &Path, name: &str, dev: Arc<dyn BlockDevice>) -> VhostUserExport {
    let cfg = VhostUserConfig {
        nr_queues: 2,
        swap: false,
    };
    VhostUserExport::start("zram0", &dir.join(name), dev, &cfg).unwrap()
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_request_in_flight_at_a_crash_is_resubmitted_by_the_next_server() {
    let dir = tempfile::tempdir().unwrap();
    let dev = new_device(DEVICE_BYTES);
    let gate = Gate::new(&dev);
    let first = export(
        dir.path(),
        "a.vhost.sock",
        Arc::clone(&gate) as Arc<dyn BlockDevice>,
    );
    let cfg = DriverConfig {
        queues: 2,
        queue_size: 64,
        data_bytes: 16 << 10,
        event_idx: true,
        inflight: true,
    };
    let (mut blk, mut queues) = VhostUserBlk::connect(first.socket_path(), &cfg).unwrap();
    assert!(blk.inflight_file().is_some(), "no inflight region offered");
    let mut done: Vec<Completion> = Vec::new();

    // Served before the crash, on both queues: completed, never served again.
    let before: Vec<Vec<u8>> = (0..4).map(|i| pattern(16 << 10, 100 + i)).collect();
    for (i, data) in before.iter().enumerate() {
        let c = queues[i % 2]
            .run(&Request::write(i as u64 * 32, data))
            .unwrap();
        assert_eq!(c.status, S_OK);
    }
    // A read completed, so that the used index and the available one move apart from the
    // writes.
    let c = queues[0].run(&Request::read(0, 16 << 10)).unwrap();
    assert_eq!(c.status, S_OK);
    assert!(queues[0].data(c.slot, 16 << 10) == before[0]);
    let writes_before = gate.writes.lock().unwrap().len();

    // The crash: queue 0's server thread takes the next write and never finishes it; two
    // more wait behind it in the ring (not taken). Queue 1 has one taken and stuck too.
    gate.frozen.store(true, Ordering::Release);
    let stuck: Vec<Vec<u8>> = (0..4).map(|i| pattern(16 << 10, 200 + i)).collect();
    // Queue 0: sectors 1000, 1032, 1064; queue 1: sector 2000.
    let mut slots = Vec::new();
    for (i, data) in stuck[..3].iter().enumerate() {
        let slot = queues[0]
            .submit(&Request::write(1000 + 32 * i as u64, data))
            .unwrap();
        slots.push((0usize, slot, 1000 + 32 * i as u64, i));
        if i == 0 {
            queues[0].notify().unwrap();
            wait_until("the first server to take queue 0's write", || {
                gate.blocked.load(Ordering::Acquire) == 1
            });
        }
    }
    queues[0].notify().unwrap();
    let slot = queues[1].submit(&Request::write(2000, &stuck[3])).unwrap();
    slots.push((1, slot, 2000, 3));
    queues[1].notify().unwrap();
    wait_until("the first server to take queue 1's write", || {
        gate.blocked.load(Ordering::Acquire) == 2
    });
    // Nothing completes: the server is "dead".
    std::thread::sleep(Duration::from_millis(100));
    for q in queues.iter_mut() {
        assert_eq!(q.reap(&mut done).unwrap(), 0, "a stuck request completed");
    }
    // Its threads stay blocked (a dead process's would be gone): never stopped or joined.
    std::mem::forget(first);

    // The next server, over the same pages; the front end reconnects with the region.
    let log = Gate::new(&dev);
    let second = export(
        dir.path(),
        "b.vhost.sock",
        Arc::clone(&log) as Arc<dyn BlockDevice>,
    );
    blk.reconnect(second.socket_path(), &mut queues).unwrap();
    let mut got = Vec::new();
    let end = Instant::now() + Duration::from_secs(20);
    while got.len() < slots.len() {
        assert!(
            Instant::now() < end,
            "only {} of {} completed",
            got.len(),
            slots.len()
        );
        for q in queues.iter_mut().filter(|q| q.in_flight() > 0) {
            done.clear();
            match q.wait(&mut done, Duration::from_millis(50)) {
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                r => {
                    r.unwrap();
                }
            }
            for c in &done {
                got.push((q.index(), c.slot, c.status));
            }
        }
    }
    for &(q, slot, _, _) in &slots {
        let c = got
            .iter()
            .find(|&&(gq, gs, _)| gq == q && gs == slot)
            .unwrap_or_else(|| panic!("queue {q} slot {slot} never completed"));
        assert_eq!(c.2, S_OK, "queue {q} slot {slot}");
    }
    // The taken ones first on their queue, exactly once each; the ones never taken after;
    // the requests completed before the crash were not served again.
    let writes = log.writes.lock().unwrap().clone();
    let sectors: Vec<u64> = writes.iter().map(|o| o >> 9).collect();
    let q0: Vec<u64> = sectors.iter().copied().filter(|&s| s < 2000).collect();
    assert_eq!(q0, vec![1000, 1032, 1064], "queue 0's order: {sectors:?}");
    assert_eq!(sectors.iter().filter(|&&s| s == 2000).count(), 1);
    assert_eq!(sectors.len(), 4, "served again: {sectors:?}");
    assert_eq!(gate.writes.lock().unwrap().len(), writes_before);
    // Every page holds what was written, read through the new server.
    for (i, data) in before.iter().enumerate() {
        let c = queues[i % 2]
            .run(&Request::read(i as u64 * 32, 16 << 10))
            .unwrap();
        assert!(c.status == S_OK && queues[i % 2].data(c.slot, 16 << 10) == *data);
    }
    for &(q, _, sector, i) in &slots {
        let c = queues[q].run(&Request::read(sector, 16 << 10)).unwrap();
        assert!(
            c.status == S_OK && queues[q].data(c.slot, 16 << 10) == stuck[i],
            "sector {sector}"
        );
    }

    // The server stops with nothing in flight and the front end comes back to another: the
    // region is handed over again and nothing is served twice.
    let n = log.writes.lock().unwrap().len();
    drop(second);
    let third = export(
        dir.path(),
        "c.vhost.sock",
        Arc::clone(&log) as Arc<dyn BlockDevice>,
    );
    blk.reconnect(third.socket_path(), &mut queues).unwrap();
    let c = queues[1].run(&Request::write(3000, &before[0])).unwrap();
    assert_eq!(c.status, S_OK);
    assert_eq!(log.writes.lock().unwrap()[n..], [3000 << 9]);
    drop(third);
}

/// A region the server did not make (not sealed against shrinking: the front end could cut
/// it short under the server's mapping) is refused, as is one of another size; the front end
/// is dropped and the next one served.
#[test]
fn an_inflight_region_that_does_not_fit_is_refused() {
    use std::os::fd::AsRawFd;
    use vhost::vhost_user::message::VhostUserInflight;
    use vhost::vhost_user::VhostUserFrontend;
    use vhost::VhostBackend;
    let dir = tempfile::tempdir().unwrap();
    let dev = new_device(DEVICE_BYTES);
    let server = export(dir.path(), "a.vhost.sock", Arc::clone(&dev));
    let cfg = DriverConfig {
        queues: 1,
        queue_size: 64,
        inflight: true,
        ..Default::default()
    };
    // 16 bytes of header and 16 per descriptor, rounded up to 64.
    let bytes = (16 + 16 * 64u64).next_multiple_of(64);
    for (what, len, size) in [("unsealed", bytes, bytes), ("short", bytes, bytes - 64)] {
        let (mut blk, _queues) = VhostUserBlk::connect(server.socket_path(), &cfg).unwrap();
        let plain = tempfile::tempfile().unwrap();
        plain.set_len(len).unwrap();
        let info = VhostUserInflight::new(size, 0, 1, 64);
        let r = blk.frontend().set_inflight_fd(&info, plain.as_raw_fd());
        assert!(r.is_err(), "{what} region accepted");
        assert!(
            blk.frontend().get_features().is_err(),
            "{what}: still connected"
        );
    }
    let (_blk, mut queues) = VhostUserBlk::connect(server.socket_path(), &cfg).unwrap();
    let data = pattern(4096, 9);
    let c = queues[0].run(&Request::write(8, &data)).unwrap();
    assert_eq!(c.status, S_OK);
}
