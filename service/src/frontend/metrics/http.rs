//! The metrics endpoint: `GET /metrics` over HTTP/1.1 (`uzram serve --metrics-listen`), for
//! Prometheus and anything that scrapes its format.
//!
//! One request per connection (`Connection: close`), answered with the text
//! [`super::render`] makes at that moment. Requests are parsed with `httparse`; `GET` and
//! `HEAD` of `/metrics` (any query) are answered 200, another path 404, another method 405, a
//! malformed request 400, a head over [`MetricsLimits::max_request_bytes`] 431, a head not in
//! by the deadline 408.
//!
//! Limits (the contract of [`crate::frontend::limits`]): at most
//! [`MetricsLimits::max_connections`] connections at once (more are closed at accept); each
//! connection is over within [`MetricsLimits::deadline`] from its accept, request and answer
//! together, whatever the client does (a slow sender or a reader that stops reading is cut
//! off); the server holds at most `max_request_bytes` of a request per connection. The accept
//! loop and every connection wait on one quit fd, so [`MetricsServer::stop`] takes no longer
//! than joining the threads, whose waits all end at once.
//!
//! Only loopback addresses are accepted unless the caller allows others: the figures say how
//! much memory and what algorithm each device has, which a host need not tell its network.

use super::super::limits::{
    accept_loop, set_nonblocking, wait_fd, ConnectionCap, Deadline, QuitFd, Readiness,
};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use uzram::error::{Error, Result};

/// What makes the body: the exposition text of every device now.
pub type MetricsSource = Arc<dyn Fn() -> Result<String> + Send + Sync>;

/// The endpoint's budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsLimits {
    /// Connections served at once. A Prometheus server scrapes one at a time; 8 leaves room
    /// for a second scraper and a person with curl, and bounds the threads to 8.
    pub max_connections: usize,
    /// The longest request head (request line and headers). A scraper's is about 300 bytes;
    /// 8 KiB is the usual servers' smallest limit (nginx's default header buffer is 1 KiB,
    /// its large one 8 KiB).
    pub max_request_bytes: usize,
    /// How long a connection may take from accept to the last byte of the answer. The answer
    /// is a few KiB per device and made in microseconds; 10 s is far above what a client on
    /// this host needs and bounds what a slow one holds.
    pub deadline: Duration,
}

impl Default for MetricsLimits {
    fn default() -> MetricsLimits {
        MetricsLimits {
            max_connections: 8,
            max_request_bytes: 8 << 10,
            deadline: Duration::from_secs(10),
        }
    }
}

/// A running metrics endpoint. Dropping it stops it.
pub struct MetricsServer {
    addr: SocketAddr,
    quit: Arc<QuitFd>,
    accept: Option<JoinHandle<()>>,
    /// Connection threads, joined at stop (finished ones are pruned at each accept).
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl MetricsServer {
    /// Listens on `addr` and answers `GET /metrics` with `source()`. A non-loopback `addr` is
    /// `EINVAL` unless `allow_remote`; a port in use is `EADDRINUSE`.
    pub fn start(
        addr: SocketAddr,
        allow_remote: bool,
        source: MetricsSource,
        limits: MetricsLimits,
    ) -> Result<MetricsServer> {
        if !addr.ip().is_loopback() && !allow_remote {
            return Err(Error::invalid(format!(
                "metrics on {addr}: not a loopback address (the figures describe this host's \
                 memory); allow it explicitly to serve them to the network"
            )));
        }
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        set_nonblocking(listener.as_raw_fd())?;
        let quit = Arc::new(QuitFd::new()?);
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (quit2, conns2) = (Arc::clone(&quit), Arc::clone(&conns));
        let cap = ConnectionCap::new(limits.max_connections, "uzram metrics");
        let accept = std::thread::Builder::new()
            .name("uzram-metrics".into())
            .spawn(move || {
                accept_loop(
                    &listener,
                    &quit2,
                    &cap,
                    Some("uzram metrics"),
                    |stream, slot| {
                        let deadline = Deadline::after(limits.deadline);
                        let quit = Arc::clone(&quit2);
                        let source = Arc::clone(&source);
                        let t = std::thread::Builder::new()
                            .name("uzram-metrics-conn".into())
                            .spawn(move || {
                                let _slot = slot;
                                let _ =
                                    serve_connection(&stream, &source, &limits, deadline, &quit);
                            });
                        let mut conns = conns2.lock().unwrap_or_else(|p| p.into_inner());
                        conns.retain(|t| !t.is_finished());
                        if let Ok(t) = t {
                            conns.push(t);
                        }
                    },
                )
            })?;
        Ok(MetricsServer {
            addr,
            quit,
            accept: Some(accept),
            conns,
        })
    }

    /// The address it listens on (with the port the system chose for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and ends every connection (their waits end at once on the quit fd).
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        let Some(t) = self.accept.take() else { return };
        self.quit.raise();
        let _ = t.join();
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(|p| p.into_inner()));
        for t in conns {
            let _ = t.join();
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// How a request head ended.
#[derive(Debug, PartialEq, Eq)]
enum Head {
    /// Complete: its bytes.
    Complete(Vec<u8>),
    /// Over the size limit.
    TooLarge,
    /// The client closed before finishing it.
    Closed,
}

/// Reads a request head (up to the blank line) by `deadline`.
fn read_head(
    stream: &TcpStream,
    max: usize,
    deadline: Deadline,
    quit: &QuitFd,
) -> io::Result<Head> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            return Ok(Head::Complete(head));
        }
        if head.len() > max {
            return Ok(Head::TooLarge);
        }
        wait_fd(stream, Readiness::Read, deadline, Some(quit))?;
        let room = (max + 1 - head.len()).min(buf.len());
        match (&mut &*stream).read(&mut buf[..room]) {
            Ok(0) => return Ok(Head::Closed),
            Ok(n) => head.extend_from_slice(&buf[..n]),
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Writes all of `bytes` by `deadline`.
fn write_all(
    stream: &TcpStream,
    mut bytes: &[u8],
    deadline: Deadline,
    quit: &QuitFd,
) -> io::Result<()> {
    while !bytes.is_empty() {
        wait_fd(stream, Readiness::Write, deadline, Some(quit))?;
        match (&mut &*stream).write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// An answer: status line, headers, and the body unless the request was `HEAD`.
fn response(status: &str, content_type: &str, extra: &str, body: &str, head_only: bool) -> Vec<u8> {
    let mut r = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         {extra}Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        r.extend_from_slice(body.as_bytes());
    }
    r
}

fn plain(status: &str, extra: &str, body: &str, head_only: bool) -> Vec<u8> {
    response(status, "text/plain; charset=utf-8", extra, body, head_only)
}

/// The answer to a request head.
fn answer(head: &[u8], source: &MetricsSource) -> Vec<u8> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) | Err(_) => {
            return plain("400 Bad Request", "", "malformed request\n", false)
        }
    }
    let method = req.method.unwrap_or("");
    let path = req.path.unwrap_or("");
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        return plain(
            "405 Method Not Allowed",
            "Allow: GET, HEAD\r\n",
            "only GET and HEAD\n",
            false,
        );
    }
    let target = path.split_once('?').map_or(path, |(p, _)| p);
    if target != "/metrics" {
        return plain(
            "404 Not Found",
            "",
            "the metrics are at /metrics\n",
            head_only,
        );
    }
    match source() {
        Ok(body) => response(
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            "",
            &body,
            head_only,
        ),
        Err(e) => plain(
            "500 Internal Server Error",
            "",
            &format!("{}\n", e.message()),
            head_only,
        ),
    }
}

fn serve_connection(
    stream: &TcpStream,
    source: &MetricsSource,
    limits: &MetricsLimits,
    deadline: Deadline,
    quit: &QuitFd,
) -> io::Result<()> {
    set_nonblocking(stream.as_raw_fd())?;
    let reply = match read_head(stream, limits.max_request_bytes, deadline, quit) {
        Ok(Head::Complete(head)) => answer(&head, source),
        Ok(Head::TooLarge) => plain(
            "431 Request Header Fields Too Large",
            "",
            "request head too large\n",
            false,
        ),
        Ok(Head::Closed) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::TimedOut => {
            // Told why, if it still reads; the connection ends either way.
            let _ = write_all(
                stream,
                &plain(
                    "408 Request Timeout",
                    "",
                    "request not received in time\n",
                    false,
                ),
                Deadline::after(Duration::from_millis(100)).min(deadline),
                quit,
            );
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    write_all(stream, &reply, deadline, quit)?;
    let _ = stream.shutdown(std::net::Shutdown::Write);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn source() -> MetricsSource {
        Arc::new(|| Ok("# TYPE x gauge\nx 1\n".to_string()))
    }

    fn get(addr: SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(request).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn answers_and_refuses() {
        let server = MetricsServer::start(
            "127.0.0.1:0".parse().unwrap(),
            false,
            source(),
            MetricsLimits::default(),
        )
        .unwrap();
        let addr = server.local_addr();
        let ok = get(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
        assert!(ok.ends_with("\r\n\r\n# TYPE x gauge\nx 1\n"), "{ok}");
        let head = get(addr, b"HEAD /metrics?x=1 HTTP/1.0\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n") && head.ends_with("\r\n\r\n"));
        assert!(head.contains("Content-Length: 19\r\n"), "{head}");
        assert!(get(addr, b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
        assert!(get(addr, b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
        assert!(get(addr, b"GARBAGE\r\n\r\n").starts_with("HTTP/1.1 400 "));
        let big = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(9000));
        assert!(get(addr, big.as_bytes()).starts_with("HTTP/1.1 431 "));
        let t = Instant::now();
        server.stop();
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn a_slow_client_is_cut_off_and_stop_is_prompt() {
        let limits = MetricsLimits {
            deadline: Duration::from_millis(300),
            max_connections: 2,
            ..MetricsLimits::default()
        };
        let server =
            MetricsServer::start("127.0.0.1:0".parse().unwrap(), false, source(), limits).unwrap();
        let addr = server.local_addr();
        // Never finishes its head: 408 at the deadline, then closed.
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
        let t = Instant::now();
        let mut out = String::new();
        slow.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 408 "), "{out}");
        assert!(t.elapsed() < Duration::from_secs(3));
        // Its slot is released as its thread ends, just after the close.
        std::thread::sleep(Duration::from_millis(100));
        // Two idle connections hold both slots: a third is closed at once, unanswered.
        let _a = TcpStream::connect(addr).unwrap();
        let _b = TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut c = TcpStream::connect(addr).unwrap();
        let _ = c.write_all(b"GET /metrics HTTP/1.1\r\n\r\n");
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        assert!(out.is_empty());
        // Stop does not wait for the idle ones' deadline.
        let server2 = MetricsServer::start(
            "127.0.0.1:0".parse().unwrap(),
            false,
            source(),
            MetricsLimits {
                deadline: Duration::from_secs(60),
                ..limits
            },
        )
        .unwrap();
        let _idle = TcpStream::connect(server2.local_addr()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        server2.stop();
        assert!(t.elapsed() < Duration::from_secs(2));
        drop(server);
    }

    #[test]
    fn non_loopback_needs_consent() {
        let e = MetricsServer::start(
            "0.0.0.0:0".parse().unwrap(),
            false,
            source(),
            MetricsLimits::default(),
        )
        .unwrap_err();
        assert_eq!(e.kind(), uzram::ErrorKind::InvalidArgument);
        assert!(e.message().contains("loopback"), "{e}");
    }
}
