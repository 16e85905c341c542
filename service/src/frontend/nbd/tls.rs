//! NBD over TLS: `NBD_OPT_STARTTLS` with x509 certificates (rustls, aws-lc-rs provider).
//!
//! The server offers TLS on TCP listeners only (a unix socket is reachable by its owner alone,
//! mode 0600, so TLS adds nothing there). [`TlsMode::On`] lets a client choose;
//! [`TlsMode::Require`] answers every option but `STARTTLS` and `ABORT` with
//! `NBD_REP_ERR_TLS_REQD` until TLS is up, as the protocol's TLS document asks of a server in
//! "FORCEDTLS" mode. With a client CA, clients must present a certificate it signed.
//!
//! Certificates are PEM files: the server's certificate chain and private key (PKCS#8, PKCS#1
//! or SEC1; the kinds and sizes of [`uzram_nbd_proto::tls::USABLE_KEYS`], refused at load
//! otherwise with the key file and the reason), and optionally the CA that signs client
//! certificates. The file names of qemu's
//! `tls-creds-x509` directories (`server-cert.pem`, `server-key.pem`, `ca-cert.pem`) work as
//! they are.

use std::path::PathBuf;
use std::sync::Arc;
use uzram::error::{Error, Result};
use uzram_nbd_proto::tls::{load_certified_key, load_roots, provider, CredentialError};

fn invalid(e: CredentialError) -> Error {
    Error::invalid(e.to_string())
}

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

impl Tls {
    /// Loads the credentials (`EINVAL` naming the file that is wrong).
    pub fn load(mode: TlsMode, files: &TlsFiles) -> Result<Tls> {
        if mode == TlsMode::Off {
            return Err(Error::invalid("TLS is off"));
        }
        let certified = load_certified_key(&files.cert, &files.key).map_err(invalid)?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::invalid(format!("TLS: {e}")))?;
        let builder = match &files.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let roots = load_roots(ca).map_err(invalid)?;
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider(),
                )
                .build()
                .map_err(|e| Error::invalid(format!("{}: {e}", ca.display())))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let config =
            builder.with_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(certified)));
        Ok(Tls {
            mode,
            config: Arc::new(config),
        })
    }
}
