//! TLS credentials for the NBD TLS tests (`cli/tests/nbd_tls.rs`, the NBD backing's in
//! `tests/nbd_backing.rs`), made with `openssl`: a CA, a server certificate for `localhost` and
//! 127.0.0.1, a client certificate, in the file names qemu, libnbd and nbdkit look for. A
//! missing `openssl` is a failure (scripts/debian-packages.txt installs it).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Credentials: `dir/server` (server-cert.pem, server-key.pem, ca-cert.pem), `dir/client`
/// (ca-cert.pem, client-cert.pem, client-key.pem) and `dir/anonymous` (ca-cert.pem only).
#[derive(Debug)]
pub struct Creds {
    pub dir: tempfile::TempDir,
}

impl Creds {
    /// The server's files.
    pub fn server(&self) -> PathBuf {
        self.dir.path().join("server")
    }
    /// A client's files, with its certificate.
    pub fn client(&self) -> PathBuf {
        self.dir.path().join("client")
    }
    /// An anonymous client's files: the CA only.
    pub fn anonymous(&self) -> PathBuf {
        self.dir.path().join("anonymous")
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("openssl must be installed (scripts/debian-packages.txt): {e}"));
    assert!(out.status.success(), "openssl {args:?}: {out:?}");
}

/// The kind of the server's and the client's keys (the CA's is always ECDSA on P-256).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// ECDSA on the named curve (openssl's name: `prime256v1`, `secp384r1`, `secp256k1`...),
    /// PKCS#8.
    Ec(&'static str),
    /// RSA of so many bits, PKCS#8 (openssl's default).
    Rsa(u32),
    /// RSA of so many bits, PKCS#1 (`BEGIN RSA PRIVATE KEY`, as certtool and older openssl
    /// write it).
    RsaPkcs1(u32),
    /// Ed25519.
    Ed25519,
}

impl KeyKind {
    /// `openssl req`'s arguments making a new key of this kind.
    fn newkey(self) -> Vec<String> {
        let v: Vec<String> = match self {
            KeyKind::Ec(curve) => vec![
                "-newkey".into(),
                "ec".into(),
                "-pkeyopt".into(),
                format!("ec_paramgen_curve:{curve}"),
            ],
            KeyKind::Rsa(bits) | KeyKind::RsaPkcs1(bits) => {
                vec!["-newkey".into(), format!("rsa:{bits}")]
            }
            KeyKind::Ed25519 => vec!["-newkey".into(), "ed25519".into()],
        };
        [v, vec!["-nodes".into()]].concat()
    }
}

/// New credentials in a temporary directory, with ECDSA P-256 keys.
pub fn make_creds() -> Creds {
    make_creds_with(KeyKind::Ec("prime256v1"))
}

/// New credentials in a temporary directory, the server's and the client's keys of `kind`.
pub fn make_creds_with(kind: KeyKind) -> Creds {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ec = KeyKind::Ec("prime256v1").newkey();
    let ec: Vec<&str> = ec.iter().map(String::as_str).collect();
    let leaf = kind.newkey();
    let leaf: Vec<&str> = leaf.iter().map(String::as_str).collect();
    openssl(
        d,
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca-key.pem",
                "-out",
                "ca-cert.pem",
                "-days",
                "2",
                "-subj",
                "/CN=uzram test CA",
            ],
        ]
        .concat(),
    );
    for (who, usage) in [("server", "serverAuth"), ("client", "clientAuth")] {
        std::fs::write(
            d.join(format!("{who}.ext")),
            format!(
                "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage={usage}\n\
                 keyUsage=digitalSignature\n"
            ),
        )
        .unwrap();
        openssl(
            d,
            &[
                &["req"][..],
                &leaf,
                &[
                    "-keyout",
                    &format!("{who}-key.pem"),
                    "-out",
                    &format!("{who}.csr"),
                    "-subj",
                    &format!("/CN={who}"),
                ],
            ]
            .concat(),
        );
        if let KeyKind::RsaPkcs1(_) = kind {
            let key = format!("{who}-key.pem");
            let pkcs8 = format!("{who}-key.pkcs8.pem");
            std::fs::rename(d.join(&key), d.join(&pkcs8)).unwrap();
            openssl(d, &["pkey", "-in", &pkcs8, "-out", &key, "-traditional"]);
        }
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                &format!("{who}.csr"),
                "-CA",
                "ca-cert.pem",
                "-CAkey",
                "ca-key.pem",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                &format!("{who}-cert.pem"),
                "-extfile",
                &format!("{who}.ext"),
            ],
        );
    }
    for (sub, files) in [
        (
            "server",
            &["ca-cert.pem", "server-cert.pem", "server-key.pem"][..],
        ),
        (
            "client",
            &["ca-cert.pem", "client-cert.pem", "client-key.pem"][..],
        ),
        ("anonymous", &["ca-cert.pem"][..]),
    ] {
        std::fs::create_dir(d.join(sub)).unwrap();
        for f in files {
            std::fs::copy(d.join(f), d.join(sub).join(f)).unwrap();
        }
    }
    Creds { dir }
}
