//! `uzram ctl metrics` and `uzram serve --metrics-listen` as users run them: the built binary,
//! data written by real NBD clients (nbdcopy, qemu-io), the text checked by Prometheus's own
//! `promtool check metrics`, fetched over HTTP by curl, and compared with the attributes
//! `uzram ctl` shows.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use uzram_testkit::nbd::RawClient;
use uzram_testkit::process::{require, run};
use uzram_testkit::serve::{uzram_bin, Serve};

/// `promtool check metrics` on `text`: it must pass without a single lint problem.
fn promtool_check(text: &str) {
    require("promtool");
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool: {out:?}\n{text}"
    );
}

/// The value of the sample `name{LABELS}` in `text`.
fn sample_of(text: &str, name: &str, labels: &str) -> u64 {
    let prefix = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
        .parse()
        .unwrap()
}

/// The value of `name{device="dev"}` in `text`.
fn sample(text: &str, name: &str, dev: &str) -> u64 {
    sample_of(text, name, &format!("device=\"{dev}\""))
}

/// The value of `name{device="dev",policy="policy"}` in `text`.
fn policy_sample(text: &str, name: &str, dev: &str, policy: &str) -> u64 {
    sample_of(text, name, &format!("device=\"{dev}\",policy=\"{policy}\""))
}

fn column(attr_text: &str, i: usize) -> u64 {
    attr_text
        .split_whitespace()
        .nth(i)
        .unwrap()
        .parse()
        .unwrap()
}

fn curl(args: &[&str]) -> Output {
    require("curl");
    Command::new("curl")
        .args(["-sS", "--max-time", "20"])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn ctl_and_http_metrics_pass_promtool_and_equal_the_attributes() {
    // A file with two devices whose sockets are in the server's temporary directory
    // (`{dir}`, replaced by the harness).
    let r = Serve::config(
        "[server]\nmetrics_listen = \"127.0.0.1:0\"\n\
         [[device]]\nname = \"zram0\"\ndisksize = \"64M\"\ncomp_algorithm = \"zstd\"\n\
         socket = \"{dir}/zram0.sock\"\n\
         policy = \"idle_age_s=3600 period_s=3600\"\n\
         [[device]]\nname = \"zram1\"\ndisksize = \"32M\"\npage_size = 16384\n\
         socket = \"{dir}/zram1.sock\"\n",
    )
    .start();

    // Real pages (this test's own executable) through nbdcopy, and a same-filled MiB.
    require("nbdcopy");
    require("qemu-io");
    let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let img = tempfile::NamedTempFile::new().unwrap();
    let len = (exe.len().min(8 << 20) / 65536) * 65536;
    std::fs::write(img.path(), &exe[..len]).unwrap();
    run(Command::new("nbdcopy").args([
        "--no-extents",
        img.path().to_str().unwrap(),
        &r.uri("zram0"),
    ]));
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x5a 16M 1M",
        "-c",
        "discard 0 64k",
        &r.uri("zram0"),
    ]));

    // The clients above have gone once the server notices (on its own schedule); then an NBD
    // client on zram1 while the figures are taken (uzram_nbd_connections).
    let deadline = Instant::now() + Duration::from_secs(20);
    while r.show("zram0", "nbd_connections") != "0\n" {
        assert!(
            Instant::now() < deadline,
            "the NBD clients stayed connected"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (client, _) = RawClient::handshake_export(&r.dir().join("zram1.sock"), "zram1", true);
    let out = r.ctl(&["metrics"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    promtool_check(&text);

    // Every family once, a sample per device.
    assert_eq!(
        text.matches("# TYPE uzram_mem_used_total_bytes gauge\n")
            .count(),
        1
    );
    let mm0 = r.show("zram0", "mm_stat");
    let mm1 = r.show("zram1", "mm_stat");
    for (i, name) in [
        "uzram_orig_data_size_bytes",
        "uzram_compr_data_size_bytes",
        "uzram_mem_used_total_bytes",
        "uzram_mem_limit_bytes",
        "uzram_mem_used_max_bytes",
        "uzram_same_pages",
        "uzram_pages_compacted_total",
        "uzram_huge_pages",
        "uzram_huge_pages_since_total",
    ]
    .iter()
    .enumerate()
    {
        assert_eq!(sample(&text, name, "zram0"), column(&mm0, i), "{name}");
        assert_eq!(sample(&text, name, "zram1"), column(&mm1, i), "{name}");
    }
    // The executable's pages (less the 64 KiB discarded, less zero pages nbdcopy writes as
    // zeroes, which store nothing) and the same-filled MiB.
    let orig = sample(&text, "uzram_orig_data_size_bytes", "zram0");
    assert!(
        orig <= (len as u64 - 65536) + (1 << 20) && orig > (len as u64) / 2,
        "{orig}"
    );
    assert!(sample(&text, "uzram_same_pages", "zram0") >= 256);
    let io = r.show("zram0", "io_stat");
    assert_eq!(
        sample(&text, "uzram_notify_free_total", "zram0"),
        column(&io, 3)
    );
    assert_eq!(
        sample(&text, "uzram_failed_reads_total", "zram0"),
        column(&io, 0)
    );
    let bd = r.show("zram0", "bd_stat");
    assert_eq!(
        sample(&text, "uzram_bd_writes_bytes_total", "zram0"),
        column(&bd, 2) * 4096
    );
    let dbg = r.show("zram0", "debug_stat");
    assert_eq!(
        sample(&text, "uzram_miss_free_total", "zram0"),
        column(&dbg, 3)
    );
    assert_eq!(sample(&text, "uzram_disksize_bytes", "zram1"), 32 << 20);
    assert_eq!(sample(&text, "uzram_nbd_connections", "zram0"), 0);
    assert_eq!(sample(&text, "uzram_nbd_connections", "zram1"), 1);
    assert!(text.contains("uzram_device_info{device=\"zram0\",comp_algorithm=\"zstd\","));
    // The policies' counters (policy_stat), labelled by device and policy: zram0's idle aging
    // is on and ran once when the server started (its period is an hour), zram1 has none on.
    let policy_stat = r.show("zram0", "policy_stat");
    let idle = policy_stat
        .lines()
        .find(|l| l.starts_with("idle "))
        .unwrap();
    assert!(
        idle.split_whitespace().nth(1) == Some("on"),
        "{policy_stat}"
    );
    for (i, family) in [
        "uzram_policy_runs_total",
        "uzram_policy_pages_total",
        "uzram_policy_errors_total",
    ]
    .iter()
    .enumerate()
    {
        assert_eq!(
            policy_sample(&text, family, "zram0", "idle"),
            column(idle, i + 2),
            "{family}"
        );
    }
    assert_eq!(
        policy_sample(&text, "uzram_policy_runs_total", "zram0", "idle"),
        1
    );
    assert_eq!(
        policy_sample(&text, "uzram_policy_enabled", "zram0", "idle"),
        1
    );
    assert_eq!(
        policy_sample(&text, "uzram_policy_enabled", "zram1", "idle"),
        0
    );
    assert_eq!(
        policy_sample(&text, "uzram_policy_runs_total", "zram1", "compact"),
        0
    );

    // The same text over HTTP, read by curl, also passing promtool.
    let url = r.metrics_url();
    let http = curl(&[&url]);
    assert!(http.status.success(), "{http:?}");
    let body = String::from_utf8(http.stdout).unwrap();
    promtool_check(&body);
    assert_eq!(body, text, "ctl and HTTP give the same figures");
    drop(client);
    let head = curl(&["-I", &url]);
    let head = String::from_utf8(head.stdout).unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(head.contains("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
    let code = |args: &[&str]| {
        let mut a = vec!["-o", "/dev/null", "-w", "%{http_code}"];
        a.extend_from_slice(args);
        String::from_utf8(curl(&a).stdout).unwrap()
    };
    let base = url.trim_end_matches("/metrics");
    assert_eq!(code(&[&format!("{base}/")]), "404");
    assert_eq!(code(&["-X", "POST", &url]), "405");
    assert_eq!(
        code(&["-H", &format!("X-Big: {}", "a".repeat(9000)), &url]),
        "431"
    );

    // Bad bytes on the wire: 400, and the server goes on.
    let addr = base.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"\x00\x01 nonsense\r\n\r\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 400 "), "{reply}");

    // More connections than the cap (8), all idle: the next is closed unanswered; the server
    // still stops at once with them open.
    let idle: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut extra = TcpStream::connect(addr).unwrap();
    let _ = extra.write_all(b"GET /metrics HTTP/1.1\r\n\r\n");
    let mut got = Vec::new();
    let _ = extra.read_to_end(&mut got);
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    assert!(
        r.log().contains("uzram metrics: connection refused"),
        "{}",
        r.log()
    );
    r.stop_within(Duration::from_secs(5));
    drop(idle);
}

#[test]
fn metrics_stay_on_loopback_unless_allowed() {
    let remote = [
        "--socket",
        "{dir}/zram0.sock",
        "--disksize",
        "1M",
        "--metrics-listen",
        "0.0.0.0:0",
    ];
    let e = Serve::args(&remote)
        .try_start()
        .expect_err("refused")
        .stderr;
    assert!(e.contains("not a loopback address"), "{e}");
    let r = Serve::args(&remote)
        .arg(&["--metrics-allow-remote"])
        .start();
    let url = r.metrics_url();
    let port = url.rsplit(':').next().unwrap().trim_end_matches("/metrics");
    let out = curl(&[&format!("http://127.0.0.1:{port}/metrics")]);
    assert!(out.status.success(), "{out:?}");
    let body = String::from_utf8(out.stdout).unwrap();
    assert_eq!(sample(&body, "uzram_disksize_bytes", "zram0"), 1 << 20);
    // `uzram ctl metrics` with no server: an empty exposition (no device), exit 0.
    let empty = tempfile::tempdir().unwrap();
    let out = Command::new(uzram_bin())
        .args(["ctl", "--dir", empty.path().to_str().unwrap(), "metrics"])
        .output()
        .unwrap();
    assert!(out.status.success() && out.stdout.is_empty(), "{out:?}");
    // A control socket left by a server that died: reported on stderr and skipped; the live
    // device's figures are still printed.
    drop(std::os::unix::net::UnixListener::bind(r.dir().join("zram9.ctl")).unwrap());
    let out = r.ctl(&["metrics"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(sample(&text, "uzram_disksize_bytes", "zram0"), 1 << 20);
    assert!(!text.contains("zram9"), "{text}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("zram9") && err.contains("cannot reach"),
        "{err}"
    );
    std::fs::remove_file(r.dir().join("zram9.ctl")).unwrap();
    r.stop_within(Duration::from_secs(5));
}

/// A real Prometheus server (Debian's `prometheus`) scrapes `--metrics-listen` once a second:
/// the target is healthy with no scrape error, and a query returns the device's figures.
#[test]
fn a_prometheus_server_scrapes_the_endpoint() {
    require("prometheus");
    let r = Serve::args(&[
        "--socket",
        "{dir}/zram0.sock",
        "--disksize",
        "16M",
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .start();
    let url = r.metrics_url();
    let target = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .to_string();
    let work = tempfile::tempdir().unwrap();
    let config = work.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: uzram\n    \
             static_configs:\n      - targets: [\"{target}\"]\n"
        ),
    )
    .unwrap();
    // A free port for Prometheus's own API (taken and released: a race another process would
    // have to win within milliseconds).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = std::fs::File::create(work.path().join("prometheus.log")).unwrap();
    let mut prom = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            work.path().join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _prom = Kill(&mut prom);
    let api = format!("http://127.0.0.1:{port}/api/v1");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = curl(&[&format!("{api}/query?query=uzram_disksize_bytes")]);
        let body = String::from_utf8_lossy(&out.stdout).into_owned();
        if body.contains("\"device\":\"zram0\"") {
            assert!(body.contains("\"16777216\""), "{body}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus did not scrape uzram: {body}\n{}",
            std::fs::read_to_string(work.path().join("prometheus.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let targets = String::from_utf8(curl(&[&format!("{api}/targets")]).stdout).unwrap();
    assert!(targets.contains("\"health\":\"up\""), "{targets}");
    assert!(targets.contains("\"lastError\":\"\""), "{targets}");
    r.stop_within(Duration::from_secs(5));
}
