//! NBD URIs (the NBD project's `doc/uri.md`): `nbd://HOST[:PORT]/EXPORT`,
//! `nbd+unix:///EXPORT?socket=PATH`, and their TLS forms `nbds://` and `nbds+unix://` with
//! libnbd's query parameters `tls-certificates=DIR` (required: `ca-cert.pem`, and
//! `client-cert.pem` with `client-key.pem` when the server asks for a client certificate) and
//! `tls-hostname=NAME` (the name the server's certificate must carry: by default the TCP host,
//! `localhost` on a unix socket). `tls-psk-file` is refused with `EOPNOTSUPP`: rustls has no
//! TLS-PSK.

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

/// TLS settings of an `nbds` URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsParams {
    /// The certificate directory (`tls-certificates`).
    pub certificates: PathBuf,
    /// The name the server's certificate must carry (`tls-hostname`, else the TCP host, else
    /// `localhost`).
    pub hostname: String,
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// The server.
    pub address: Address,
    /// The export name (percent-decoded; empty for the server's default export).
    pub export: String,
    /// TLS (`nbds://`, `nbds+unix://`).
    pub tls: Option<TlsParams>,
}

/// Whether `value` names an NBD server rather than a path (an `nbd` scheme).
pub fn is_nbd_uri(value: &str) -> bool {
    ["nbd://", "nbd+unix://", "nbds://", "nbds+unix://"]
        .iter()
        .any(|s| value.starts_with(s))
}

impl NbdUri {
    /// Parses an NBD URI; `EINVAL` with the reason for a malformed one, `EOPNOTSUPP` for
    /// TLS-PSK.
    pub fn parse(uri: &str) -> Result<NbdUri> {
        let bad = |why: &str| Error::invalid(format!("NBD URI {uri:?}: {why}"));
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| bad("no scheme (nbd:// or nbd+unix://)"))?;
        let (unix, tls) = match scheme {
            "nbd" => (false, false),
            "nbd+unix" => (true, false),
            "nbds" => (false, true),
            "nbds+unix" => (true, true),
            _ => return Err(bad("the scheme must be nbd, nbd+unix, nbds or nbds+unix")),
        };
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
        let (mut socket, mut certificates, mut hostname) = (None, None, None);
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let value = || percent_decode(v).ok_or_else(|| bad("bad percent-encoding"));
            match k {
                "socket" if unix => socket = Some(value()?),
                "tls-certificates" if tls => certificates = Some(value()?),
                "tls-hostname" if tls => hostname = Some(value()?),
                "tls-psk-file" if tls => {
                    return Err(Error::new(
                        ErrorKind::Unsupported,
                        format!(
                            "NBD URI {uri:?}: TLS-PSK is not supported (rustls has no \
                             pre-shared keys); use certificates: ?tls-certificates=DIR"
                        ),
                    ))
                }
                _ => return Err(bad(&format!("unsupported query parameter {k:?}"))),
            }
        }
        let address = if unix {
            if !authority.is_empty() {
                return Err(bad(
                    "a unix socket URI takes no host (nbd+unix:///EXPORT?socket=PATH)",
                ));
            }
            match socket {
                Some(s) if !s.is_empty() => Address::Unix(PathBuf::from(s)),
                _ => return Err(bad("a unix socket URI needs ?socket=PATH")),
            }
        } else {
            let (host, port) = split_host_port(authority).ok_or_else(|| bad("bad host or port"))?;
            if host.is_empty() {
                return Err(bad("no host"));
            }
            Address::Tcp { host, port }
        };
        let tls = match (tls, certificates) {
            (false, _) => None,
            (true, None) => {
                return Err(bad(
                    "nbds needs ?tls-certificates=DIR (ca-cert.pem; client-cert.pem and \
                     client-key.pem if the server asks for a client certificate)",
                ))
            }
            (true, Some(dir)) if dir.is_empty() => return Err(bad("empty tls-certificates")),
            (true, Some(dir)) => Some(TlsParams {
                certificates: PathBuf::from(dir),
                hostname: match (hostname, &address) {
                    (Some(h), _) => h,
                    (None, Address::Tcp { host, .. }) => host.clone(),
                    (None, Address::Unix(_)) => "localhost".to_string(),
                },
            }),
        };
        Ok(NbdUri {
            address,
            export,
            tls,
        })
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
        for bad in [
            "nbds://h/x",
            "nbds://h/x?tls-certificates=",
            "nbd://h/x?tls-certificates=/d",
            "nbds+unix:///x?tls-certificates=/d",
            "nbds://h/x?tls-certificates=/d&tls-verify-peer=false",
        ] {
            let e = NbdUri::parse(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad}: {e}");
        }
        let e = NbdUri::parse("nbds://h/x?tls-psk-file=/k").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
    }

    #[test]
    fn parses_tls_forms() {
        let u = NbdUri::parse("nbds://10.0.0.2/wb?tls-certificates=/etc/pki/c%20d").unwrap();
        assert_eq!(
            u.tls,
            Some(TlsParams {
                certificates: "/etc/pki/c d".into(),
                hostname: "10.0.0.2".into()
            })
        );
        let u = NbdUri::parse("nbds+unix:///wb?socket=/s&tls-certificates=/c").unwrap();
        assert_eq!(u.address, Address::Unix("/s".into()));
        assert_eq!(u.tls.unwrap().hostname, "localhost");
        let u =
            NbdUri::parse("nbds://h/?tls-hostname=storage.example&tls-certificates=/c").unwrap();
        assert_eq!(u.tls.unwrap().hostname, "storage.example");
        assert_eq!(NbdUri::parse("nbd://h/").unwrap().tls, None);
    }
}
