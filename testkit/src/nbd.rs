//! NBD: a device served by the library's server on a temporary unix socket, a minimal raw NBD
//! client for protocol-level tests, and an export seen by the kernel as a block device (nbdfuse
//! and a loop device).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uzram::device::Device;
use uzram_nbd_proto::*;
use uzram_service::frontend::nbd::{Export, Server};

use crate::device::DeviceBuilder;

use crate::process::{require, run};

// ---------------------------------------------------------------------------------------------
// A served device.

/// A server on a temporary unix socket, exporting one device as `zram0`.
#[derive(Debug)]
pub struct Served {
    pub server: Option<Server>,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub device: Arc<Device>,
}

impl Served {
    /// Serves a fresh device of `size_bytes`.
    pub fn new(size_bytes: u64) -> Served {
        Served::with_device(Arc::new(DeviceBuilder::bytes(size_bytes).build()), false)
    }

    /// Serves `device`, read-only if asked.
    pub fn with_device(device: Arc<Device>, read_only: bool) -> Served {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("zram0.sock");
        let mut export = Export::new("zram0", device.clone());
        export.read_only = read_only;
        let server = Server::start_unix(export, socket.clone()).expect("server starts");
        Served {
            server: Some(server),
            dir,
            socket,
            device,
        }
    }

    /// The export's NBD URI.
    pub fn uri(&self) -> String {
        format!("nbd+unix:///zram0?socket={}", self.socket.display())
    }

    /// Stops the server cleanly (waits for connections to finish).
    pub fn stop(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// An export as the kernel's block device.

/// An NBD export seen by the kernel as a block device (the host has no `nbd` module): nbdfuse
/// exposes it as the file `nbd` of a FUSE directory, and a loop device attaches that file. On
/// drop, so a failing assertion leaves nothing behind: unmounts [`mnt`](Self::mnt) if set,
/// detaches the loop device, unmounts the FUSE directory and stops nbdfuse.
#[derive(Debug)]
pub struct NbdLoop {
    fuse_dir: PathBuf,
    nbdfuse: Option<Child>,
    loop_dev: Option<String>,
    /// Where a file system on the loop device is mounted: unmounted first on drop.
    pub mnt: Option<PathBuf>,
}

impl NbdLoop {
    /// Starts `nbdfuse` (the command with its options, the mount point `fuse_dir` and the
    /// export; its output as the caller wants it), waits up to 20 s for `fuse_dir/nbd` to be
    /// `size_bytes` long, and attaches it to a free loop device (`losetup --find --show` with
    /// `loop_options`).
    pub fn attach(
        nbdfuse: &mut Command,
        fuse_dir: &Path,
        size_bytes: u64,
        loop_options: &[&str],
    ) -> NbdLoop {
        for p in ["nbdfuse", "fusermount3", "losetup"] {
            require(p);
        }
        std::fs::create_dir_all(fuse_dir).unwrap();
        let mut me = NbdLoop {
            fuse_dir: fuse_dir.to_path_buf(),
            nbdfuse: None,
            loop_dev: None,
            mnt: None,
        };
        me.nbdfuse = Some(nbdfuse.spawn().expect("nbdfuse"));
        let file = fuse_dir.join("nbd");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::fs::metadata(&file).map_or(true, |m| m.len() != size_bytes) {
            assert!(
                Instant::now() < deadline,
                "nbdfuse did not expose {} in 20 s",
                file.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = run(Command::new("losetup")
            .args(["--find", "--show"])
            .args(loop_options)
            .arg(&file));
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(dev.starts_with("/dev/loop"), "losetup gave {dev:?}");
        me.loop_dev = Some(dev);
        me
    }

    /// The loop device.
    pub fn dev(&self) -> &str {
        self.loop_dev.as_deref().expect("attached")
    }
}

impl Drop for NbdLoop {
    fn drop(&mut self) {
        if let Some(m) = &self.mnt {
            let _ = Command::new("umount").arg(m).output();
        }
        if let Some(l) = &self.loop_dev {
            let _ = Command::new("losetup").args(["-d", l]).output();
        }
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.fuse_dir)
            .output();
        if let Some(mut c) = self.nbdfuse.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A minimal raw client, to send what real clients never send.

/// A raw client on a unix socket.
#[derive(Debug)]
pub struct RawClient {
    pub s: UnixStream,
    pub structured: bool,
}

/// One reply: its error, cookie and data (a read's).
#[derive(Debug)]
pub struct Reply {
    pub error: u32,
    pub cookie: u64,
    pub data: Vec<u8>,
}

impl RawClient {
    /// Connects and reads the greeting (asserting it).
    pub fn connect(socket: &Path) -> RawClient {
        let mut s = UnixStream::connect(socket).expect("connect");
        s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        let mut g = [0u8; 18];
        s.read_exact(&mut g).expect("greeting");
        assert_eq!(g, encode_greeting());
        RawClient {
            s,
            structured: false,
        }
    }

    /// [`connect`](Self::connect)ed, with the client flags `FIXED_NEWSTYLE` sent (the
    /// padding of `NBD_OPT_EXPORT_NAME`'s reply kept): ready for options.
    pub fn fixed_newstyle(socket: &Path) -> RawClient {
        let mut c = RawClient::connect(socket);
        c.send_client_flags(FLAG_C_FIXED_NEWSTYLE);
        c
    }

    pub fn send_client_flags(&mut self, flags: u32) {
        self.s.write_all(&flags.to_be_bytes()).unwrap();
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) {
        self.announce_option(option, data.len() as u32);
        self.s.write_all(data).unwrap();
    }

    /// The header of an option of `len` bytes of data, without the data (what a client that
    /// stops half-way, or lies about the length, sends).
    pub fn announce_option(&mut self, option: u32, len: u32) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        self.s.write_all(&b).unwrap();
    }

    /// Reads one option reply: (option, type, data).
    pub fn read_option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).expect("option reply");
        assert_eq!(
            u64::from_be_bytes(h[0..8].try_into().unwrap()),
            OPTION_REPLY_MAGIC
        );
        let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.s.read_exact(&mut d).unwrap();
        (opt, ty, d)
    }

    pub fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    /// Full handshake with GO on `zram0` (and structured replies if asked); returns the
    /// export size.
    pub fn handshake(socket: &Path, structured: bool) -> (RawClient, u64) {
        RawClient::handshake_export(socket, "zram0", structured)
    }

    /// Full handshake with GO on `export`.
    pub fn handshake_export(socket: &Path, export: &str, structured: bool) -> (RawClient, u64) {
        let mut c = RawClient::connect(socket);
        c.send_client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
        if structured {
            c.send_option(OPT_STRUCTURED_REPLY, &[]);
            let (_, ty, _) = c.read_option_reply();
            assert_eq!(ty, REP_ACK);
            c.structured = true;
        }
        c.send_option(OPT_GO, &RawClient::go_data(export, &[INFO_BLOCK_SIZE]));
        let mut size = None;
        loop {
            let (_, ty, d) = c.read_option_reply();
            match ty {
                REP_INFO => {
                    if u16::from_be_bytes([d[0], d[1]]) == INFO_EXPORT {
                        size = Some(u64::from_be_bytes(d[2..10].try_into().unwrap()));
                    }
                }
                REP_ACK => break,
                other => panic!("GO failed: reply type {other:#x}"),
            }
        }
        (c, size.expect("NBD_INFO_EXPORT"))
    }

    pub fn send_request(
        &mut self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u32,
    ) {
        let h = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        self.s.write_all(&h.encode()).unwrap();
    }

    /// Reads one complete reply. `read_len` is the data length expected for a successful
    /// simple read reply (the simple reply does not say).
    pub fn read_reply(&mut self, read_len: usize) -> Reply {
        let mut m = [0u8; 4];
        self.s.read_exact(&mut m).expect("reply");
        match u32::from_be_bytes(m) {
            SIMPLE_REPLY_MAGIC => {
                let mut h = [0u8; 12];
                self.s.read_exact(&mut h).unwrap();
                let error = u32::from_be_bytes(h[0..4].try_into().unwrap());
                let cookie = u64::from_be_bytes(h[4..12].try_into().unwrap());
                let mut data = vec![0u8; if error == 0 { read_len } else { 0 }];
                self.s.read_exact(&mut data).unwrap();
                Reply {
                    error,
                    cookie,
                    data,
                }
            }
            STRUCTURED_REPLY_MAGIC => {
                let mut error = 0;
                let mut data = Vec::new();
                let mut cookie;
                let mut magic_read = true;
                loop {
                    if !magic_read {
                        self.s.read_exact(&mut m).unwrap();
                        assert_eq!(u32::from_be_bytes(m), STRUCTURED_REPLY_MAGIC);
                    }
                    magic_read = false;
                    let mut h = [0u8; 16];
                    self.s.read_exact(&mut h).unwrap();
                    let flags = u16::from_be_bytes([h[0], h[1]]);
                    let ty = u16::from_be_bytes([h[2], h[3]]);
                    cookie = u64::from_be_bytes(h[4..12].try_into().unwrap());
                    let len = u32::from_be_bytes(h[12..16].try_into().unwrap());
                    let mut p = vec![0u8; len as usize];
                    self.s.read_exact(&mut p).unwrap();
                    match ty {
                        REPLY_TYPE_OFFSET_DATA => data.extend_from_slice(&p[8..]),
                        REPLY_TYPE_NONE => assert_eq!(len, 0),
                        t if t & 0x8000 != 0 => {
                            error = u32::from_be_bytes(p[0..4].try_into().unwrap());
                            let mlen = u16::from_be_bytes([p[4], p[5]]) as usize;
                            assert!(mlen + 6 <= p.len(), "error message overflows chunk");
                        }
                        t => panic!("unexpected chunk type {t}"),
                    }
                    if flags & REPLY_FLAG_DONE != 0 {
                        break;
                    }
                }
                Reply {
                    error,
                    cookie,
                    data,
                }
            }
            other => panic!("bad reply magic {other:#x}"),
        }
    }

    pub fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) -> u32 {
        self.send_request(CMD_WRITE, 0, cookie, offset, data.len() as u32);
        self.s.write_all(data).unwrap();
        let r = self.read_reply(0);
        assert_eq!(r.cookie, cookie);
        r.error
    }

    pub fn read(&mut self, cookie: u64, offset: u64, len: u32) -> Reply {
        self.send_request(CMD_READ, 0, cookie, offset, len);
        let r = self.read_reply(len as usize);
        assert_eq!(r.cookie, cookie);
        r
    }

    /// True if the server closed the connection (read returns end of stream or reset).
    pub fn is_closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }
}
