//! x509 credentials for NBD over TLS, as both ends load them: PEM files in the layout of
//! qemu's `tls-creds-x509` and libnbd's certificate directories (`ca-cert.pem`,
//! `server-cert.pem`/`server-key.pem`, `client-cert.pem`/`client-key.pem`), and the one crypto
//! provider every TLS configuration of uzram uses.
//!
//! Errors name the file that is missing or wrong ([`CredentialError`]); callers turn them into
//! `EINVAL`.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A credential file that could not be used: which file, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub reason: String,
}

impl CredentialError {
    /// An error about `path`.
    pub fn new(path: &Path, reason: impl std::fmt::Display) -> CredentialError {
        CredentialError {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        }
    }
}

impl std::fmt::Display for CredentialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.reason)
    }
}

impl std::error::Error for CredentialError {}

/// The crypto provider every TLS configuration uses (ring), the server's and the backing
/// client's.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file (an error naming it when it holds none or is bad).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, CredentialError> {
    let v = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| CredentialError::new(path, e))?;
    if v.is_empty() {
        return Err(CredentialError::new(path, "no certificate in it"));
    }
    Ok(v)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, CredentialError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| CredentialError::new(path, e))
}

/// A root store of the certificates in the PEM file `ca`.
pub fn load_roots(ca: &Path) -> Result<rustls::RootCertStore, CredentialError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in load_certs(ca)? {
        roots.add(c).map_err(|e| CredentialError::new(ca, e))?;
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_empty_file_is_named() {
        let dir = std::env::temp_dir().join(format!("uzram-nbd-proto-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        let e = load_certs(&missing).unwrap_err();
        assert_eq!(e.path, missing);
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let e = load_certs(&empty).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("{}: no certificate in it", empty.display())
        );
        assert!(load_private_key(&empty).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
