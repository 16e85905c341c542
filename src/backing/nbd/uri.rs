//! NBD URIs (the NBD project's `doc/uri.md`): `nbd://HOST[:PORT]/EXPORT` and
//! `nbd+unix:///EXPORT?socket=PATH`. The TLS schemes (`nbds://`, `nbds+unix://`) are recognised
//! and refused with `EOPNOTSUPP`: the client speaks plain NBD only.

use std::path::PathBuf;

use crate::error::{Error, ErrorKind, Result};

/// The IANA port of NBD.
pub const DEFAULT_PORT: u16 = 10809;

/// Where the server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// A TCP host (name or address; an IPv6 address without brackets) and port.
    Tcp { host: String, port: u16 },
    /// A unix socket path.
    Unix(PathBuf),
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// The server.
    pub address: Address,
    /// The export name (percent-decoded; empty for the server's default export).
    pub export: String,
}

/// Whether `value` names an NBD server rather than a path (an `nbd` scheme).
pub fn is_nbd_uri(value: &str) -> bool {
    ["nbd://", "nbd+unix://", "nbds://", "nbds+unix://"]
        .iter()
        .any(|s| value.starts_with(s))
}

impl NbdUri {
    /// Parses an NBD URI; `EINVAL` with the reason for a malformed one, `EOPNOTSUPP` for TLS.
    pub fn parse(uri: &str) -> Result<NbdUri> {
        let bad = |why: &str| Error::invalid(format!("NBD URI {uri:?}: {why}"));
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| bad("no scheme (nbd:// or nbd+unix://)"))?;
        match scheme {
            "nbd" | "nbd+unix" => {}
            "nbds" | "nbds+unix" => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "NBD URI {uri:?}: TLS to the backing server (nbds) is not supported; \
                         use nbd:// over a trusted network or a unix socket"
                    ),
                ))
            }
            _ => return Err(bad("the scheme must be nbd or nbd+unix")),
        }
        let (before_query, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        if before_query.contains('#') || query.is_some_and(|q| q.contains('#')) {
            return Err(bad("fragments are not allowed"));
        }
        let (authority, path) = match before_query.find('/') {
            Some(i) => (&before_query[..i], &before_query[i + 1..]),
            None => (before_query, ""),
        };
        let export =
            percent_decode(path).ok_or_else(|| bad("bad percent-encoding in the export"))?;
        let mut socket = None;
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "socket" if scheme == "nbd+unix" => {
                    socket = Some(percent_decode(v).ok_or_else(|| bad("bad percent-encoding"))?)
                }
                _ => return Err(bad(&format!("unsupported query parameter {k:?}"))),
            }
        }
        let address = if scheme == "nbd+unix" {
            if !authority.is_empty() {
                return Err(bad(
                    "nbd+unix takes no host (nbd+unix:///EXPORT?socket=PATH)",
                ));
            }
            match socket {
                Some(s) if !s.is_empty() => Address::Unix(PathBuf::from(s)),
                _ => return Err(bad("nbd+unix needs ?socket=PATH")),
            }
        } else {
            let (host, port) = split_host_port(authority).ok_or_else(|| bad("bad host or port"))?;
            if host.is_empty() {
                return Err(bad("no host"));
            }
            Address::Tcp { host, port }
        };
        Ok(NbdUri { address, export })
    }
}

/// `HOST`, `HOST:PORT`, `[V6]` or `[V6]:PORT`.
fn split_host_port(authority: &str) -> Option<(String, u16)> {
    if authority.contains('@') {
        return None;
    }
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (h, after) = rest.split_once(']')?;
        match after {
            "" => (h, None),
            p => (h, Some(p.strip_prefix(':')?)),
        }
    } else {
        match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p.parse().ok().filter(|&p| p != 0)?,
    };
    Some((host.to_string(), port))
}

/// Decodes `%XX` escapes; `None` for a malformed escape or bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_standard_forms() {
        let u = NbdUri::parse("nbd://example.com/disk").unwrap();
        assert_eq!(
            u.address,
            Address::Tcp {
                host: "example.com".into(),
                port: DEFAULT_PORT
            }
        );
        assert_eq!(u.export, "disk");
        let u = NbdUri::parse("nbd://127.0.0.1:10810/").unwrap();
        assert_eq!(u.export, "");
        assert!(matches!(u.address, Address::Tcp { port: 10810, .. }));
        let u = NbdUri::parse("nbd://[::1]:99/a%20b").unwrap();
        assert_eq!(
            u.address,
            Address::Tcp {
                host: "::1".into(),
                port: 99
            }
        );
        assert_eq!(u.export, "a b");
        let u = NbdUri::parse("nbd+unix:///exp?socket=/run/s.sock").unwrap();
        assert_eq!(u.address, Address::Unix("/run/s.sock".into()));
        assert_eq!(u.export, "exp");
        assert!(is_nbd_uri("nbd+unix:///?socket=x"));
        assert!(!is_nbd_uri("/dev/vdb"));
    }

    #[test]
    fn refuses_malformed_ones() {
        for bad in [
            "nbd:/x",
            "http://h/x",
            "nbd:///x",
            "nbd://h:0/x",
            "nbd://h:70000/x",
            "nbd://h/%zz",
            "nbd://h/x?socket=/s",
            "nbd+unix:///x",
            "nbd+unix://host/x?socket=/s",
            "nbd://u@h/x",
            "nbd://h/x#f",
        ] {
            let e = NbdUri::parse(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad}: {e}");
        }
        let e = NbdUri::parse("nbds://h/x").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
    }
}
