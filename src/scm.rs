//! Descriptors passed over unix sockets (`SCM_RIGHTS`): a message of bytes with up to
//! [`MAX_FDS`] descriptors, sent on a connected socket or to a datagram socket's address.
//! Received descriptors are owned ([`OwnedFd`]) and close-on-exec. How a device's state files
//! (`crate::shm`) go from one process to another: the server to its keeper, a test's child to
//! its parent.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// The most descriptors one message carries here (a device's files fit many times over).
pub const MAX_FDS: usize = 16;

/// The control buffer for `n` descriptors, 8-byte aligned as `cmsghdr` needs.
fn control_buffer(n: usize) -> (Vec<u64>, usize) {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((n * std::mem::size_of::<RawFd>()) as u32) } as usize;
    (vec![0u64; space.div_ceil(8)], space)
}

/// Sends `bytes` (not empty) with `fds` on `sock`, to `addr` (a `sockaddr_un` and its length)
/// when given (an unconnected datagram socket), in one message.
pub fn send(
    sock: BorrowedFd<'_>,
    addr: Option<(&libc::sockaddr_un, libc::socklen_t)>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    assert!(!bytes.is_empty() && fds.len() <= MAX_FDS);
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let (mut cbuf, space) = control_buffer(raw.len());
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some((a, len)) = addr {
        msg.msg_name = a as *const libc::sockaddr_un as *mut libc::c_void;
        msg.msg_namelen = len;
    }
    if !raw.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` has a control buffer of `space` bytes, room for one header and the
        // descriptors.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(&raw[..]) as u32) as _;
            std::ptr::copy_nonoverlapping(raw.as_ptr(), libc::CMSG_DATA(cmsg).cast(), raw.len());
        }
    }
    loop {
        // SAFETY: `msg` describes valid buffers; `sock` is an open socket. The iovec's
        // pointer is only read (sendmsg).
        let rc = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if rc >= 0 {
            if rc as usize != bytes.len() {
                return Err(io::Error::new(io::ErrorKind::WriteZero, "a short message"));
            }
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives one message into `buf` on `sock` (a `SOCK_SEQPACKET` or datagram socket): its
/// length (0: the peer closed) and its descriptors. A message cut short (bytes or
/// descriptors beyond the buffers) is `InvalidData`, its descriptors closed.
pub fn recv(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let (mut cbuf, space) = control_buffer(MAX_FDS);
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: `msg` describes valid buffers; `sock` is an open socket.
        let rc = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if rc >= 0 {
            break rc as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled the control buffer up to `msg_controllen`; the descriptors of
    // an SCM_RIGHTS header are new ones this process now owns, each taken once.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a message longer than its buffer, or with too many descriptors",
        ));
    }
    Ok((n, fds))
}

/// A connected pair of `SOCK_SEQPACKET` unix sockets (messages keep their bounds), both
/// close-on-exec.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors socketpair writes.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair succeeded: two new descriptors, owned here.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn descriptors_pass_with_their_message() {
        let (a, b) = seqpacket_pair().unwrap();
        let f = crate::shm::ShmFile::create("scm-test").unwrap();
        f.set_len(4096).unwrap();
        f.write_at(0, b"hello").unwrap();
        send(a.as_fd(), None, b"store x", &[f.as_fd(), f.as_fd()]).unwrap();
        let mut buf = [0u8; 64];
        let (n, fds) = recv(b.as_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"store x");
        assert_eq!(fds.len(), 2);
        let g = crate::shm::ShmFile::from_fd(fds.into_iter().next().unwrap());
        assert_eq!(g.read_at(0, 5).unwrap(), b"hello");
        drop(a);
        assert_eq!(recv(b.as_fd(), &mut buf).unwrap().0, 0);
    }
}
