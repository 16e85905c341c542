//! NBD over TLS: `NBD_OPT_STARTTLS` with x509 certificates (rustls, ring provider).
//!
//! The server offers TLS on TCP listeners only (a unix socket is reachable by its owner alone,
//! mode 0600, so TLS adds nothing there). [`TlsMode::On`] lets a client choose;
//! [`TlsMode::Require`] answers every option but `STARTTLS` and `ABORT` with
//! `NBD_REP_ERR_TLS_REQD` until TLS is up, as the protocol's TLS document asks of a server in
//! "FORCEDTLS" mode. With a client CA, clients must present a certificate it signed.
//!
//! Certificates are PEM files: the server's certificate chain and private key (PKCS#8, PKCS#1
//! or SEC1), and optionally the CA that signs client certificates. The file names of qemu's
//! `tls-creds-x509` directories (`server-cert.pem`, `server-key.pem`, `ca-cert.pem`) work as
//! they are.

use crate::error::{Error, Result};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Whether TCP clients may or must use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// No TLS: `STARTTLS` is refused with `NBD_REP_ERR_POLICY`.
    #[default]
    Off,
    /// TLS offered: a client may upgrade with `STARTTLS` or go on in plain text.
    On,
    /// TLS required: nothing but `STARTTLS` and `ABORT` before the upgrade.
    Require,
}

impl std::str::FromStr for TlsMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<TlsMode> {
        match s {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            _ => Err(Error::invalid(format!(
                "tls = {s:?}: one of off, on, require"
            ))),
        }
    }
}

/// Where the server's credentials are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// The server's private key (PEM).
    pub key: PathBuf,
    /// If given, clients must present a certificate signed by this CA (PEM).
    pub client_ca: Option<PathBuf>,
}

/// TLS as a server runs it: the mode and the loaded configuration.
#[derive(Clone)]
pub struct Tls {
    /// On or required (never [`TlsMode::Off`]: that is no `Tls` at all).
    pub mode: TlsMode,
    /// The rustls configuration every connection starts from.
    pub config: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("mode", &self.mode).finish()
    }
}

/// The crypto provider every TLS configuration uses (ring), servers' and the NBD backing's.
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file (`EINVAL` naming it when it holds none or is bad).
pub(crate) fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let v = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| Error::invalid(format!("{}: {e}", path.display())))?;
    if v.is_empty() {
        return Err(Error::invalid(format!(
            "{}: no certificate in it",
            path.display()
        )));
    }
    Ok(v)
}

impl Tls {
    /// Loads the credentials (`EINVAL` naming the file that is wrong).
    pub fn load(mode: TlsMode, files: &TlsFiles) -> Result<Tls> {
        if mode == TlsMode::Off {
            return Err(Error::invalid("TLS is off"));
        }
        let chain = load_certs(&files.cert)?;
        let key = PrivateKeyDer::from_pem_file(&files.key)
            .map_err(|e| Error::invalid(format!("{}: {e}", files.key.display())))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::invalid(format!("TLS: {e}")))?;
        let builder = match &files.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in load_certs(ca)? {
                    roots
                        .add(c)
                        .map_err(|e| Error::invalid(format!("{}: {e}", ca.display())))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider(),
                )
                .build()
                .map_err(|e| Error::invalid(format!("{}: {e}", ca.display())))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let config = builder
            .with_single_cert(chain, key)
            .map_err(|e| Error::invalid(format!("{}: {e}", files.cert.display())))?;
        Ok(Tls {
            mode,
            config: Arc::new(config),
        })
    }
}
