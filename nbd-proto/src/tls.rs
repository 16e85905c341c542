//! x509 credentials for NBD over TLS, as both ends load them: PEM files in the layout of
//! qemu's `tls-creds-x509` and libnbd's certificate directories (`ca-cert.pem`,
//! `server-cert.pem`/`server-key.pem`, `client-cert.pem`/`client-key.pem`), and the one crypto
//! provider every TLS configuration of uzram uses (aws-lc-rs).
//!
//! The keys it signs with are those nbdkit and qemu-nbd (GnuTLS) serve with in practice: RSA
//! of any size from 2048 to 8192 bits, ECDSA on P-256, P-384 and P-521, Ed25519; unencrypted
//! PEM as PKCS#8, PKCS#1 or SEC1. Any other key is refused when the credentials are loaded,
//! with the key file, what the key is (kind and size, read from its DER) and what is usable.
//!
//! Errors name the file that is missing or wrong ([`CredentialError`]); callers turn them into
//! `EINVAL`.

use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The keys [`provider`] signs with, as the refusal of another one says.
pub const USABLE_KEYS: &str =
    "RSA of 2048 to 8192 bits, ECDSA on P-256, P-384 or P-521, or Ed25519";

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

/// The crypto provider every TLS configuration uses (aws-lc-rs), the server's and the backing
/// client's.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
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

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1), as it is written: whether
/// [`provider`] can sign with it is [`load_certified_key`]'s question.
pub fn load_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, CredentialError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        let encrypted = std::fs::read(path).is_ok_and(|t| t.windows(9).any(|w| w == b"ENCRYPTED"));
        if encrypted {
            CredentialError::new(
                path,
                "an encrypted private key: give it unencrypted (PKCS#8, PKCS#1 or SEC1), as \
                 nbdkit and qemu-nbd take it",
            )
        } else {
            CredentialError::new(path, e)
        }
    })
}

/// A certificate chain (`cert`, leaf first) and its private key (`key`), ready to sign with:
/// the key must be one [`provider`] signs with ([`USABLE_KEYS`]; otherwise the error names
/// `key`, says what the key is and why it is refused) and must be the key of the leaf
/// certificate (otherwise the error names both files).
pub fn load_certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, CredentialError> {
    let chain = load_certs(cert)?;
    let der = load_private_key(key)?;
    let what = describe_key(&der);
    // rustls's own message ("failed to parse private key as RSA, ECDSA, or EdDSA") says no
    // more than that; what the key is says why.
    let signing = provider().key_provider.load_private_key(der).map_err(|_| {
        CredentialError::new(
            key,
            format!("{what}, which TLS cannot sign with: usable keys are {USABLE_KEYS}"),
        )
    })?;
    let certified = CertifiedKey::new(chain, signing);
    match certified.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
            Ok(certified)
        }
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            Err(CredentialError::new(
                key,
                format!("not the key of the certificate {}", cert.display()),
            ))
        }
        Err(e) => Err(CredentialError::new(cert, e)),
    }
}

/// What a private key is, for an error message: "an RSA key of 2432 bits", "an EC key on
/// P-256", "an Ed25519 key", or "a key of an unknown kind" (read from the DER: PKCS#1's
/// modulus, PKCS#8's algorithm and parameters, SEC1's curve).
pub fn describe_key(key: &PrivateKeyDer<'_>) -> String {
    let what = match key {
        PrivateKeyDer::Pkcs1(k) => rsa_bits(k.secret_pkcs1_der()).map(rsa),
        PrivateKeyDer::Sec1(k) => sec1_curve(k.secret_sec1_der()).map(|c| ec(&c)),
        PrivateKeyDer::Pkcs8(k) => pkcs8(k.secret_pkcs8_der()),
        _ => None,
    };
    what.unwrap_or_else(|| "a key of an unknown kind".to_string())
}

fn rsa(bits: usize) -> String {
    format!("an RSA key of {bits} bits")
}

fn ec(curve: &str) -> String {
    format!("an EC key on {curve}")
}

/// One DER element: `(tag, contents, the rest after it)`.
fn der(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |a, &b| (a << 8) | b as usize);
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

const SEQUENCE: u8 = 0x30;
const INTEGER: u8 = 0x02;
const OCTET_STRING: u8 = 0x04;
const OID: u8 = 0x06;

/// PKCS#1's `RSAPrivateKey ::= SEQUENCE { version INTEGER, modulus INTEGER, ... }`: the
/// modulus's bits.
fn rsa_bits(key: &[u8]) -> Option<usize> {
    let (SEQUENCE, body, _) = der(key)? else {
        return None;
    };
    let (INTEGER, _, body) = der(body)? else {
        return None;
    };
    let (INTEGER, n, _) = der(body)? else {
        return None;
    };
    let pos = n.iter().position(|&b| b != 0)?;
    Some((n.len() - pos) * 8 - n[pos].leading_zeros() as usize)
}

/// The name of a curve's object identifier (its DER contents).
fn curve_name(oid: &[u8]) -> String {
    match oid {
        [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07] => "P-256".into(),
        [0x2b, 0x81, 0x04, 0x00, 0x22] => "P-384".into(),
        [0x2b, 0x81, 0x04, 0x00, 0x23] => "P-521".into(),
        [0x2b, 0x81, 0x04, 0x00, 0x0a] => "secp256k1".into(),
        _ => format!("the curve of OID contents {oid:02x?}"),
    }
}

/// SEC1's `ECPrivateKey ::= SEQUENCE { version, privateKey OCTET STRING, [0] parameters, ... }`:
/// the curve, when the parameters name one.
fn sec1_curve(key: &[u8]) -> Option<String> {
    let (SEQUENCE, body, _) = der(key)? else {
        return None;
    };
    let (INTEGER, _, body) = der(body)? else {
        return None;
    };
    let (OCTET_STRING, _, body) = der(body)? else {
        return None;
    };
    let (0xa0, params, _) = der(body)? else {
        return None;
    };
    let (OID, oid, _) = der(params)? else {
        return None;
    };
    Some(curve_name(oid))
}

/// PKCS#8's `PrivateKeyInfo ::= SEQUENCE { version, algorithm AlgorithmIdentifier, privateKey
/// OCTET STRING, ... }`: the algorithm, and for RSA the modulus's bits, for EC the curve.
fn pkcs8(key: &[u8]) -> Option<String> {
    let (SEQUENCE, body, _) = der(key)? else {
        return None;
    };
    let (INTEGER, _, body) = der(body)? else {
        return None;
    };
    let (SEQUENCE, alg, body) = der(body)? else {
        return None;
    };
    let (OID, oid, params) = der(alg)? else {
        return None;
    };
    Some(match oid {
        // rsaEncryption
        [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01] => {
            let (OCTET_STRING, inner, _) = der(body)? else {
                return None;
            };
            rsa(rsa_bits(inner)?)
        }
        // RSASSA-PSS
        [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0a] => "an RSA-PSS key".into(),
        // id-ecPublicKey
        [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01] => match der(params) {
            Some((OID, curve, _)) => ec(&curve_name(curve)),
            _ => "an EC key on explicit parameters".into(),
        },
        [0x2b, 0x65, 0x70] => "an Ed25519 key".into(),
        [0x2b, 0x65, 0x71] => "an Ed448 key".into(),
        [0x2a, 0x86, 0x48, 0xce, 0x38, 0x04, 0x01] => "a DSA key".into(),
        _ => return None,
    })
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

    /// `openssl ARGS` in `dir` (a missing openssl fails: scripts/debian-packages.txt).
    fn openssl(dir: &Path, args: &[&str]) {
        let out = std::process::Command::new("openssl")
            .current_dir(dir)
            .args(args)
            .output()
            .expect("openssl must be installed (scripts/debian-packages.txt)");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    }

    /// Keys made by openssl, each with a self-signed certificate: the usable ones load, each
    /// other one is refused naming the key file, its kind and size; a key that is not the
    /// certificate's names both files; an encrypted key says so.
    #[test]
    fn keys_are_described_and_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("uzram-nbd-proto-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let make = |name: &str, genpkey: &[&str], traditional: bool| {
            let key = format!("{name}-key.pem");
            openssl(&dir, &[&["genpkey", "-out", &key][..], genpkey].concat());
            if traditional {
                let tmp = format!("{name}-pkcs8.pem");
                std::fs::rename(dir.join(&key), dir.join(&tmp)).unwrap();
                openssl(&dir, &["pkey", "-in", &tmp, "-out", &key, "-traditional"]);
            }
            let cert = format!("{name}-cert.pem");
            let subj = format!("/CN={name}");
            openssl(
                &dir,
                &[
                    "req", "-x509", "-key", &key, "-out", &cert, "-days", "1", "-subj", &subj,
                ],
            );
            (dir.join(cert), dir.join(key))
        };
        let rsa = |bits: &str| format!("rsa_keygen_bits:{bits}");
        let ec = |curve: &str| format!("ec_paramgen_curve:{curve}");
        let usable: Vec<(&str, Vec<String>, bool, &str)> = vec![
            (
                "rsa2432",
                vec![
                    "-algorithm".into(),
                    "RSA".into(),
                    "-pkeyopt".into(),
                    rsa("2432"),
                ],
                false,
                "an RSA key of 2432 bits",
            ),
            (
                "rsa2304",
                vec![
                    "-algorithm".into(),
                    "RSA".into(),
                    "-pkeyopt".into(),
                    rsa("2304"),
                ],
                true,
                "an RSA key of 2304 bits",
            ),
            (
                "p384",
                vec![
                    "-algorithm".into(),
                    "EC".into(),
                    "-pkeyopt".into(),
                    ec("P-384"),
                ],
                true,
                "an EC key on P-384",
            ),
            (
                "p521",
                vec![
                    "-algorithm".into(),
                    "EC".into(),
                    "-pkeyopt".into(),
                    ec("P-521"),
                ],
                false,
                "an EC key on P-521",
            ),
            (
                "ed25519",
                vec!["-algorithm".into(), "ED25519".into()],
                false,
                "an Ed25519 key",
            ),
        ];
        let mut certs = Vec::new();
        for (name, args, traditional, what) in &usable {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (cert, key) = make(name, &args, *traditional);
            assert_eq!(describe_key(&load_private_key(&key).unwrap()), *what);
            load_certified_key(&cert, &key).unwrap_or_else(|e| panic!("{what}: {e}"));
            certs.push((cert, key));
        }
        let refused: Vec<(&str, Vec<String>, bool, &str)> = vec![
            (
                "rsa1024",
                vec![
                    "-algorithm".into(),
                    "RSA".into(),
                    "-pkeyopt".into(),
                    rsa("1024"),
                ],
                true,
                "an RSA key of 1024 bits",
            ),
            (
                "k1",
                vec![
                    "-algorithm".into(),
                    "EC".into(),
                    "-pkeyopt".into(),
                    ec("secp256k1"),
                ],
                false,
                "an EC key on secp256k1",
            ),
            (
                "ed448",
                vec!["-algorithm".into(), "ED448".into()],
                false,
                "an Ed448 key",
            ),
        ];
        for (name, args, traditional, what) in &refused {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (cert, key) = make(name, &args, *traditional);
            let e = load_certified_key(&cert, &key).unwrap_err();
            assert_eq!(e.path, key, "{e}");
            assert!(e.reason.starts_with(what), "{e}");
            assert!(e.reason.contains(USABLE_KEYS), "{e}");
        }
        // Another certificate's key.
        let e = load_certified_key(&certs[0].0, &certs[2].1).unwrap_err();
        assert_eq!(e.path, certs[2].1);
        assert!(e.reason.contains(&certs[0].0.display().to_string()), "{e}");
        // An encrypted key.
        let enc = dir.join("enc-key.pem");
        let key = certs[0].1.to_str().unwrap();
        openssl(
            &dir,
            &[
                "pkey",
                "-in",
                key,
                "-out",
                enc.to_str().unwrap(),
                "-aes256",
                "-passout",
                "pass:x",
            ],
        );
        let e = load_certified_key(&certs[0].0, &enc).unwrap_err();
        assert_eq!(e.path, enc);
        assert!(e.reason.starts_with("an encrypted private key"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
