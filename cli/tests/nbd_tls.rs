//! NBD over TLS (`uzram serve --tls`), with real clients: libnbd's `nbdinfo` and `nbdcopy`
//! with `nbds://` URIs, and `qemu-img` with a `tls-creds-x509` object. Certificates are made
//! in the test with `openssl` (a CA, a server certificate for 127.0.0.1, a client certificate),
//! in the file names qemu and libnbd look for.

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use uzram_nbd_proto::*;
use uzram_testkit::nbd::RawClient;
use uzram_testkit::nbd_servers::NbdServer;
use uzram_testkit::pages::pattern;
use uzram_testkit::process::{require, run};
use uzram_testkit::serve::{Running, Serve};
use uzram_testkit::tls::{make_creds, make_creds_with, Creds, KeyKind};

/// `uzram serve` of a 64 MiB device on a unix socket and TCP with TLS `tls` and the server's
/// certificate (and the CA to verify clients with, if `client_ca`).
fn serve(creds: &Creds, tls: &str, client_ca: bool) -> Running {
    let s = creds.server();
    let file = |f: &str| s.join(f).to_str().unwrap().to_string();
    let mut serve = Serve::args(&["--disksize", "64M", "--listen", "127.0.0.1:0"])
        .arg(&["--socket", "{dir}/zram0.sock", &format!("--tls={tls}")])
        .arg(&["--tls-cert", &file("server-cert.pem")])
        .arg(&["--tls-key", &file("server-key.pem")]);
    if client_ca {
        serve = serve.arg(&["--tls-client-ca", &file("ca-cert.pem")]);
    }
    serve.start()
}

fn nbds(port: u16, creds_dir: &Path) -> String {
    format!(
        "nbds://127.0.0.1:{port}/zram0?tls-certificates={}",
        creds_dir.display()
    )
}

/// `qemu-img ARGS` with a client `tls-creds-x509` object on `creds_dir`, the image given as
/// options: `qemu_img(&["info"], ...)`.
fn qemu_img_tls(verb: &[&str], port: u16, creds_dir: &Path, tail: &[&str]) -> Command {
    let mut c = Command::new("qemu-img");
    c.args(verb)
        .arg("--object")
        .arg(format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            creds_dir.display()
        ))
        .arg("--image-opts")
        .arg(format!(
            "driver=raw,file.driver=nbd,file.host=127.0.0.1,file.port={port},\
             file.export=zram0,file.tls-creds=tls0"
        ))
        .args(tail);
    c
}

#[test]
fn required_tls_serves_libnbd_and_qemu_clients_and_refuses_plain_ones() {
    require("nbdinfo");
    require("nbdcopy");
    require("qemu-img");
    let creds = make_creds();
    let r = serve(&creds, "require", false);
    let port = r.tcp_port();
    assert!(
        r.lines()
            .iter()
            .any(|l| l.contains(&format!("nbds://127.0.0.1:{port}/zram0"))),
        "the printed URI says TLS: {:?}",
        r.lines()
    );
    let uri = nbds(port, &creds.anonymous());
    let out = run(Command::new("nbdinfo").args(["--json", &uri]));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["exports"][0]["export-size"], 64u64 << 20);
    // nbdcopy both ways through TLS, with 4 connections.
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.raw");
    let back = t.path().join("back.raw");
    std::fs::write(&src, pattern(8 << 20, 42)).unwrap();
    run(Command::new("nbdcopy")
        .args(["--connections=4", "--flush"])
        .arg(&src)
        .arg(&uri));
    run(Command::new("nbdcopy").arg(&uri).arg(&back));
    let b = std::fs::read(&back).unwrap();
    assert_eq!(&b[..8 << 20], &std::fs::read(&src).unwrap()[..]);
    assert!(b[8 << 20..].iter().all(|&x| x == 0));
    // qemu-img reads what nbdcopy wrote, through its own TLS stack.
    let out = run(&mut qemu_img_tls(
        &["info", "--output=json"],
        port,
        &creds.anonymous(),
        &[],
    ));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["virtual-size"], 64u64 << 20);
    let q = t.path().join("q.raw");
    run(&mut qemu_img_tls(
        &["convert", "-O", "raw"],
        port,
        &creds.anonymous(),
        &[q.to_str().unwrap()],
    ));
    assert_eq!(std::fs::read(&q).unwrap(), b);
    // Without TLS: libnbd is refused, and a raw client gets NBD_REP_ERR_TLS_REQD.
    let out = Command::new("nbdinfo")
        .arg(format!("nbd://127.0.0.1:{port}/zram0"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "a plain client got in: {out:?}");
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).unwrap();
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    for (opt, data) in [
        (OPT_GO, RawClient::go_data("zram0", &[])),
        (OPT_LIST, vec![]),
        (OPT_STRUCTURED_REPLY, vec![]),
    ] {
        let mut o = IHAVEOPT.to_be_bytes().to_vec();
        o.extend_from_slice(&opt.to_be_bytes());
        o.extend_from_slice(&(data.len() as u32).to_be_bytes());
        o.extend_from_slice(&data);
        s.write_all(&o).unwrap();
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        assert_eq!(
            u32::from_be_bytes(h[12..16].try_into().unwrap()),
            REP_ERR_TLS_REQD
        );
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        s.read_exact(&mut d).unwrap();
    }
    // The unix socket (owner-only) stays plain.
    let (mut c, _) = RawClient::handshake(&r.socket("zram0"), true);
    assert_eq!(c.read(1, 0, 4096).data, &b[..4096]);
}

#[test]
fn client_certificates_are_verified_when_asked() {
    require("nbdinfo");
    require("qemu-img");
    let creds = make_creds();
    let r = serve(&creds, "require", true);
    let port = r.tcp_port();
    run(Command::new("nbdinfo").arg(nbds(port, &creds.client())));
    run(&mut qemu_img_tls(&["info"], port, &creds.client(), &[]));
    let out = Command::new("nbdinfo")
        .arg(nbds(port, &creds.anonymous()))
        .output()
        .unwrap();
    assert!(!out.status.success(), "no client certificate, yet: {out:?}");
}

#[test]
fn optional_tls_lets_clients_choose() {
    require("nbdinfo");
    let creds = make_creds();
    let r = serve(&creds, "on", false);
    let port = r.tcp_port();
    run(Command::new("nbdinfo").arg(nbds(port, &creds.anonymous())));
    run(Command::new("nbdinfo").arg(format!("nbd://127.0.0.1:{port}/zram0")));
}

#[test]
fn tls_needs_its_files_and_tcp() {
    let e = Serve::args(&[
        "--disksize",
        "1M",
        "--tls=require",
        "--listen",
        "127.0.0.1:0",
    ])
    .refused()
    .stderr;
    assert!(e.contains("needs --tls-cert and --tls-key"), "{e}");
    let t = tempfile::tempdir().unwrap();
    let bogus = t.path().join("bogus.pem");
    std::fs::write(&bogus, "not a certificate\n").unwrap();
    let bogus = bogus.to_str().unwrap();
    let e = Serve::args(&["--disksize", "1M", "--tls=on", "--listen", "127.0.0.1:0"])
        .arg(&["--tls-cert", bogus, "--tls-key", bogus])
        .arg(&["--socket", "{dir}/s.sock"])
        .refused()
        .stderr;
    assert!(e.contains("bogus.pem"), "{e}");
}

/// The server keys people have, as nbdkit serves with them: RSA of 2048, 2304 (PKCS#1),
/// 2432, 2560, 3072 and 4096 bits, ECDSA on P-256 and P-384, Ed25519 (made by openssl). For
/// each, nbdkit serves it (the anchor: nbdinfo reaches it) and so must uzram: nbdinfo over
/// `nbds://`, and qemu-img through its own TLS stack for the odd RSA sizes.
#[test]
fn server_keys_of_the_sizes_and_kinds_nbdkit_takes() {
    require("nbdinfo");
    require("qemu-img");
    require("nbdkit");
    for kind in [
        KeyKind::Rsa(2048),
        KeyKind::RsaPkcs1(2304),
        KeyKind::Rsa(2432),
        KeyKind::Rsa(2560),
        KeyKind::Rsa(3072),
        KeyKind::Rsa(4096),
        KeyKind::Ec("prime256v1"),
        KeyKind::Ec("secp384r1"),
        KeyKind::Ed25519,
    ] {
        let creds = make_creds_with(kind);
        let certs = format!("--tls-certificates={}", creds.server().display());
        let (nbdkit, port) = NbdServer::nbdkit_tcp(&["--tls=require", &certs, "memory", "1M"]);
        let uri = format!(
            "nbds://127.0.0.1:{port}/?tls-certificates={}",
            creds.anonymous().display()
        );
        run(Command::new("nbdinfo").arg(&uri));
        drop(nbdkit);

        let r = serve(&creds, "require", false);
        let port = r.tcp_port();
        let out = run(Command::new("nbdinfo").args(["--json", &nbds(port, &creds.anonymous())]));
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(info["exports"][0]["export-size"], 64u64 << 20, "{kind:?}");
        if matches!(kind, KeyKind::RsaPkcs1(_) | KeyKind::Rsa(2432 | 2560)) {
            run(&mut qemu_img_tls(&["info"], port, &creds.anonymous(), &[]));
        }
    }
}

/// A key the TLS library cannot sign with (RSA of 1024 bits, ECDSA on secp256k1) or that is
/// not the certificate's: `uzram serve` refuses to start, naming the key file and the reason.
#[test]
fn unusable_server_keys_are_refused_by_name() {
    let refused = |creds: &Creds, key: &Path| {
        let cert = creds.server().join("server-cert.pem");
        Serve::args(&[
            "--disksize",
            "1M",
            "--tls=require",
            "--listen",
            "127.0.0.1:0",
        ])
        .arg(&["--tls-cert", cert.to_str().unwrap()])
        .arg(&["--tls-key", key.to_str().unwrap()])
        .arg(&["--socket", "{dir}/s.sock"])
        .refused()
        .stderr
    };
    for (kind, what) in [
        (KeyKind::RsaPkcs1(1024), "an RSA key of 1024 bits"),
        (KeyKind::Ec("secp256k1"), "an EC key on secp256k1"),
    ] {
        let creds = make_creds_with(kind);
        let key = creds.server().join("server-key.pem");
        let e = refused(&creds, &key);
        assert!(
            e.contains(&format!("{}: {what}", key.display())),
            "{kind:?}: {e}"
        );
        assert!(e.contains("RSA of 2048 to 8192 bits"), "{e}");
    }
    let (a, b) = (make_creds(), make_creds());
    let e = refused(&a, &b.server().join("server-key.pem"));
    assert!(e.contains("not the key of the certificate"), "{e}");
}
