//! `uzram serve`'s configuration: a TOML file describing the server and its devices, and the
//! embedded default that needs no file (one device of min(RAM/2, 4 GiB), lz4, as
//! zram-generator makes).
//!
//! ```toml
//! [server]                       # optional
//! listen = "127.0.0.1:10809"     # also serve TCP (off unless given)
//! swap = true                    # lock memory, mark the server an I/O flusher (docs/serve.md)
//! swap_reserve = "64M"           # with swap: memory got ahead of need, server-wide (docs/ublk.md)
//! max_connections = 100          # connections served at once
//! max_inflight = "128M"          # request memory budget, server-wide
//! tls = "require"                # off | on | require (TCP), with:
//! tls_cert = "/etc/uzram/server-cert.pem"
//! tls_key = "/etc/uzram/server-key.pem"
//! tls_client_ca = "/etc/uzram/ca-cert.pem"   # optional: verify client certificates
//! metrics_listen = "127.0.0.1:9437"  # Prometheus metrics at /metrics (docs/metrics.md)
//! metrics_allow_remote = false   # true to allow a non-loopback metrics_listen
//!
//! [[device]]
//! name = "zram0"                 # required: device and export name
//! disksize = "min(ram / 2, 4G)"  # required: a size, or an expression of `ram`
//! page_size = 4096               # optional: 4096, 16384 or 65536
//! socket = "/run/uzram/zram0.sock"   # optional: where to listen (default: next to the others)
//! ublk = true                    # optional: also a kernel block device /dev/ublkbN (docs/ublk.md)
//! vhost_user = true              # optional: also a VM disk on NAME.vhost.sock (docs/vhost-user.md)
//! read_only = true               # optional: NBD clients may only read (writes get EPERM)
//! comp_algorithm = "zstd"        # every other key is an attribute, stored in file order
//! algorithm_params = "level=8"   # before disksize, exactly as `echo VALUE > ATTR` would
//! multi_page_size = "64K"        # runs written at once compressed as one object
//! mem_limit = "2G"
//! policy = "idle_age_s=600 compact_ratio=1.05"   # optional: automatic policies (docs/policies.md);
//!                                # also a table: policy = { idle_age_s = 600, compact_ratio = 1.05 }
//! ```
//!
//! Attribute keys are not interpreted here: each is stored through
//! [`Device::attr_store`](uzram::device::Device::attr_store), so settings the device gains
//! later (`backing_dev`, `writeback_limit`, ...) work in the file as soon as the device has
//! them, and a key the device does not have fails with its errno (`ENOENT`) and the key's name,
//! never silently. Integers and booleans are written as zram's files take them (`1`, `0`).

use std::net::SocketAddr;
use std::path::PathBuf;
use uzram::device::Device;
use uzram::error::{Error, Result};
use uzram::units::{parse_size_bytes, DEFAULT_PAGE_SIZE_BYTES};

/// The configuration used when `uzram serve` is given neither a file nor device flags.
pub const DEFAULT_CONFIG_TOML: &str = r#"# uzram's embedded default configuration: one device, as zram-generator creates by default.
[[device]]
name = "zram0"
disksize = "min(ram / 2, 4G)"
comp_algorithm = "lz4"
"#;

/// Keys of a `[[device]]` table that are not attributes.
const DEVICE_KEYS: &[&str] = &[
    "name",
    "disksize",
    "page_size",
    "socket",
    "ublk",
    "vhost_user",
    "read_only",
    "policy",
];

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServeConfig {
    /// Also listen on TCP here.
    pub listen: Option<SocketAddr>,
    /// Serve swap safely (lock memory, I/O flusher).
    pub swap: bool,
    /// With `swap`: the server's swap reserve, a size or an expression of `ram` (`None`: the
    /// default, `uzram::memory::default_swap_reserve_bytes`).
    pub swap_reserve: Option<String>,
    /// Connections served at once (`None`: the default).
    pub max_connections: Option<usize>,
    /// The request memory budget in bytes (`None`: the default).
    pub max_inflight_bytes: Option<u64>,
    /// TLS for TCP: `off`, `on` or `require` (`None`: off).
    pub tls: Option<String>,
    /// The server's certificate chain (PEM).
    pub tls_cert: Option<PathBuf>,
    /// The server's private key (PEM).
    pub tls_key: Option<PathBuf>,
    /// The CA that client certificates must be signed by (PEM); none: clients are not asked.
    pub tls_client_ca: Option<PathBuf>,
    /// Serve the metrics over HTTP here (docs/metrics.md).
    pub metrics_listen: Option<SocketAddr>,
    /// Allow a `metrics_listen` that is not a loopback address.
    pub metrics_allow_remote: bool,
    /// The devices, in file order.
    pub devices: Vec<DeviceSpec>,
}

/// One `[[device]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Device and export name.
    pub name: String,
    /// The size: a size (`4G`) or an expression of `ram` (`min(ram / 2, 4G)`).
    pub disksize: String,
    /// Page size in bytes.
    pub page_size_bytes: usize,
    /// The export socket, if not the default.
    pub socket: Option<PathBuf>,
    /// Also a kernel block device `/dev/ublkbN` (`uzram serve --ublk`; docs/ublk.md).
    pub ublk: bool,
    /// Also a vhost-user-blk socket `NAME.vhost.sock` for VM guests (`uzram serve
    /// --vhost-user`; docs/vhost-user.md).
    pub vhost_user: bool,
    /// The NBD export is read-only: its flags say so and writes, trims and write-zeroes get
    /// `EPERM` (docs/nbd.md). Not with `ublk` or `vhost_user`, which would still write.
    pub read_only: bool,
    /// Attributes to store before `disksize`, in order: (name, value).
    pub attrs: Vec<(String, String)>,
    /// The device's policies, as `uzram ctl DEV policy` takes them (`key=value` tokens);
    /// checked when the file is read.
    pub policy: Option<String>,
}

fn bad(msg: impl Into<String>) -> Error {
    Error::invalid(msg)
}

impl ServeConfig {
    /// Parses a configuration file's text. `what` names it in errors.
    pub fn parse(text: &str, what: &str) -> Result<ServeConfig> {
        let doc: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| bad(format!("{what}: {e}")))?;
        let mut cfg = ServeConfig::default();
        for (key, value) in &doc {
            match key.as_str() {
                "server" => {
                    let t = value
                        .as_table()
                        .ok_or_else(|| bad(format!("{what}: [server] must be a table")))?;
                    for (k, v) in t {
                        match k.as_str() {
                            "listen" => {
                                let s = v.as_str().ok_or_else(|| {
                                    bad(format!("{what}: server.listen must be a string"))
                                })?;
                                cfg.listen = Some(s.parse().map_err(|_| {
                                    bad(format!("{what}: server.listen = {s:?} is not ADDR:PORT"))
                                })?);
                            }
                            "metrics_listen" => {
                                let s = v.as_str().ok_or_else(|| {
                                    bad(format!("{what}: server.metrics_listen must be a string"))
                                })?;
                                cfg.metrics_listen = Some(s.parse().map_err(|_| {
                                    bad(format!(
                                        "{what}: server.metrics_listen = {s:?} is not ADDR:PORT"
                                    ))
                                })?);
                            }
                            "metrics_allow_remote" => {
                                cfg.metrics_allow_remote = v.as_bool().ok_or_else(|| {
                                    bad(format!(
                                        "{what}: server.metrics_allow_remote must be true or false"
                                    ))
                                })?
                            }
                            "swap" => {
                                cfg.swap = v.as_bool().ok_or_else(|| {
                                    bad(format!("{what}: server.swap must be true or false"))
                                })?
                            }
                            "swap_reserve" => {
                                let e = v
                                    .as_str()
                                    .filter(|e| crate::size_expr::eval_bytes(e, 1 << 30).is_ok())
                                    .ok_or_else(|| {
                                        bad(format!(
                                            "{what}: server.swap_reserve must be a size (\"64M\") \
                                             or an expression of ram (\"ram / 16\")"
                                        ))
                                    })?;
                                cfg.swap_reserve = Some(e.to_string());
                            }
                            "max_connections" => {
                                cfg.max_connections = Some(
                                    v.as_integer()
                                        .and_then(|n| usize::try_from(n).ok())
                                        .filter(|&n| n > 0)
                                        .ok_or_else(|| {
                                            bad(format!(
                                                "{what}: server.max_connections must be a \
                                                 positive integer"
                                            ))
                                        })?,
                                )
                            }
                            "max_inflight" => {
                                let n = match v {
                                    toml::Value::Integer(n) => u64::try_from(*n).ok(),
                                    toml::Value::String(s) => parse_size_bytes(s).ok(),
                                    _ => None,
                                };
                                cfg.max_inflight_bytes = Some(n.ok_or_else(|| {
                                    bad(format!("{what}: server.max_inflight must be a size"))
                                })?)
                            }
                            "tls" | "tls_cert" | "tls_key" | "tls_client_ca" => {
                                let s = v.as_str().ok_or_else(|| {
                                    bad(format!("{what}: server.{k} must be a string"))
                                })?;
                                match k.as_str() {
                                    "tls" => cfg.tls = Some(s.to_string()),
                                    "tls_cert" => cfg.tls_cert = Some(s.into()),
                                    "tls_key" => cfg.tls_key = Some(s.into()),
                                    _ => cfg.tls_client_ca = Some(s.into()),
                                }
                            }
                            _ => {
                                return Err(bad(format!(
                                    "{what}: unknown key server.{k} (known: listen, swap, \
                                     swap_reserve, max_connections, max_inflight, tls, \
                                     tls_cert, tls_key, tls_client_ca, metrics_listen, \
                                     metrics_allow_remote)"
                                )))
                            }
                        }
                    }
                }
                "device" => {
                    let arr = value
                        .as_array()
                        .ok_or_else(|| bad(format!("{what}: devices are [[device]] tables")))?;
                    for (i, d) in arr.iter().enumerate() {
                        let t = d
                            .as_table()
                            .ok_or_else(|| bad(format!("{what}: devices are [[device]] tables")))?;
                        cfg.devices.push(DeviceSpec::from_table(t, what, i)?);
                    }
                }
                _ => {
                    return Err(bad(format!(
                        "{what}: unknown key {key:?} (known: [server], [[device]])"
                    )))
                }
            }
        }
        if cfg.devices.is_empty() {
            return Err(bad(format!("{what}: no [[device]]")));
        }
        for (i, d) in cfg.devices.iter().enumerate() {
            if cfg.devices[..i].iter().any(|o| o.name == d.name) {
                return Err(bad(format!("{what}: device {:?} twice", d.name)));
            }
        }
        Ok(cfg)
    }

    /// The embedded default.
    pub fn embedded_default() -> ServeConfig {
        ServeConfig::parse(DEFAULT_CONFIG_TOML, "the embedded default").expect("valid")
    }
}

impl DeviceSpec {
    fn from_table(t: &toml::Table, what: &str, index: usize) -> Result<DeviceSpec> {
        let name = t
            .get("name")
            .and_then(|v| v.as_str())
            .ok_or_else(|| bad(format!("{what}: device #{} has no name", index + 1)))?
            .to_string();
        let at = |k: &str| format!("{what}: device {name}: {k}");
        if name.is_empty() || name.contains(['/', '\0']) || name.starts_with('.') {
            return Err(bad(format!("{what}: bad device name {name:?}")));
        }
        let disksize = match t.get("disksize") {
            Some(toml::Value::String(s)) => s.clone(),
            Some(toml::Value::Integer(n)) if *n > 0 => n.to_string(),
            Some(_) => return Err(bad(format!("{}: a size or an expression", at("disksize")))),
            None => return Err(bad(format!("{what}: device {name} has no disksize"))),
        };
        let page_size_bytes = match t.get("page_size") {
            None => DEFAULT_PAGE_SIZE_BYTES,
            Some(v) => v
                .as_integer()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| bad(format!("{}: an integer", at("page_size"))))?,
        };
        let socket = match t.get("socket") {
            None => None,
            Some(v) => Some(PathBuf::from(
                v.as_str()
                    .ok_or_else(|| bad(format!("{}: a path", at("socket"))))?,
            )),
        };
        let ublk = match t.get("ublk") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(format!("{}: true or false", at("ublk"))))?,
        };
        let vhost_user = match t.get("vhost_user") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(format!("{}: true or false", at("vhost_user"))))?,
        };
        let read_only = match t.get("read_only") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(format!("{}: true or false", at("read_only"))))?,
        };
        if read_only && (ublk || vhost_user) {
            return Err(bad(format!(
                "{}: an NBD export only: ublk and vhost_user would still write",
                at("read_only")
            )));
        }
        let policy = match t.get("policy") {
            None => None,
            Some(toml::Value::String(s)) => Some(s.clone()),
            Some(toml::Value::Table(p)) => {
                let mut words = Vec::new();
                for (k, v) in p {
                    let v = match v {
                        toml::Value::String(s) => s.clone(),
                        toml::Value::Integer(n) => n.to_string(),
                        toml::Value::Float(f) => f.to_string(),
                        toml::Value::Boolean(false) => "off".to_string(),
                        _ => {
                            return Err(bad(format!(
                                "{}: values are strings, numbers or false (off)",
                                at(&format!("policy.{k}"))
                            )))
                        }
                    };
                    words.push(format!("{k}={v}"));
                }
                Some(words.join(" "))
            }
            Some(_) => {
                return Err(bad(format!(
                    "{}: a string of key=value words or a table",
                    at("policy")
                )))
            }
        };
        if let Some(p) = &policy {
            crate::policy::PolicyConfig::default()
                .with(p)
                .map_err(|e| bad(format!("{}: {}", at("policy"), e.message())))?;
        }
        let mut attrs = Vec::new();
        for (k, v) in t {
            if DEVICE_KEYS.contains(&k.as_str()) {
                continue;
            }
            let value = match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(n) => n.to_string(),
                toml::Value::Boolean(b) => u8::from(*b).to_string(),
                _ => {
                    return Err(bad(format!(
                        "{}: attribute values are strings, integers or booleans",
                        at(k)
                    )))
                }
            };
            attrs.push((k.clone(), value));
        }
        Ok(DeviceSpec {
            name,
            disksize,
            page_size_bytes,
            socket,
            ublk,
            vhost_user,
            read_only,
            attrs,
            policy,
        })
    }

    /// Creates the device: stores each attribute in order, then `disksize` (evaluated with
    /// `ram_bytes` of RAM). Errors name the device and key and keep the device's errno.
    pub fn build(&self, ram_bytes: u64) -> Result<Device> {
        self.build_with_swap(ram_bytes, None)
    }

    /// As [`build`](Self::build), the device serving swap from `swap_reserve` (the server's,
    /// `uzram::memory`) when given.
    pub fn build_with_swap(
        &self,
        ram_bytes: u64,
        swap_reserve: Option<&std::sync::Arc<uzram::memory::SwapReserve>>,
    ) -> Result<Device> {
        let ctx = |k: &str, v: &str, e: Error| {
            Error::new(
                e.kind(),
                format!("device {}: {k} = {v:?}: {}", self.name, e.message()),
            )
        };
        let dev = Device::new_uninit(self.page_size_bytes)
            .map_err(|e| ctx("page_size", &self.page_size_bytes.to_string(), e))?;
        dev.set_swap_reserve(swap_reserve.cloned())?;
        for (k, v) in &self.attrs {
            dev.attr_store(k, v).map_err(|e| ctx(k, v, e))?;
        }
        let size =
            eval_size(&self.disksize, ram_bytes).map_err(|e| ctx("disksize", &self.disksize, e))?;
        dev.attr_store("disksize", &size.to_string())
            .map_err(|e| ctx("disksize", &self.disksize, e))?;
        Ok(dev)
    }
}

impl DeviceSpec {
    /// The device a previous process left in `files`, checked against this configuration
    /// (docs/restart.md, "The server"): recovered and its invariants checked
    /// ([`Device::recover_with`]: from the server's swap reserve in recovery, if it serves
    /// swap; over its backing device, opened again from the configuration's `backing_dev`),
    /// then its page size, `disksize` and every attribute that can
    /// only be set before `disksize` (`comp_algorithm`, `multi_page_size`, ...) compared with
    /// the configuration's, and the attributes that can change on a live device (`mem_limit`,
    /// ...) stored again. `EINVAL` naming what differs or what is wrong; a write-only
    /// attribute that can only be set before `disksize` (`algorithm_params`) keeps the saved
    /// state's value.
    ///
    /// Dictionaries: the saved state's always serve (its pages were compressed with them, and
    /// it holds every generation), so a `dict=` file of the configuration that is gone or
    /// does not load does not refuse the device: its `algorithm_params` is compared without
    /// the `dict=`. Each such file, and each codec whose configured dictionary is not the
    /// saved one (the file changed since), gives a line of the returned notes, for the log;
    /// the configuration's dictionary is taken at the next start without saved state.
    pub fn recover(
        &self,
        files: uzram::device::restart::DeviceFiles,
        ram_bytes: u64,
        swap_reserve: Option<&std::sync::Arc<uzram::memory::SwapReserve>>,
    ) -> Result<(Device, uzram::device::restart::RecoveryReport, Vec<String>)> {
        let differs = |what: &str, saved: &dyn std::fmt::Display, cfg: &dyn std::fmt::Display| {
            Error::invalid(format!(
                "its saved state has {what} {saved}, the configuration {cfg}"
            ))
        };
        // The configuration's device before its disksize: what the settings fixed at
        // disksize read as there, and its backing device, opened again for the recovery.
        let template = Device::new_uninit(self.page_size_bytes)?;
        let mut notes = Vec::new();
        // The `algorithm_params` whose dictionary file did not load (indices into `attrs`).
        let mut unread = Vec::new();
        for (i, (k, v)) in self.attrs.iter().enumerate() {
            let Err(e) = template.attr_store(k, v) else {
                continue;
            };
            let retried = match without_dict(k, v) {
                Some(rest) => template.attr_store(k, &rest).is_ok(),
                None => false,
            };
            if !retried {
                return Err(Error::new(
                    e.kind(),
                    format!("{k} = {v:?}: {}", e.message()),
                ));
            }
            notes.push(format!(
                "{k} = {v:?}: {}: the dictionary its saved state holds serves",
                e.message()
            ));
            unread.push(i);
        }
        let with = uzram::device::restart::Recover {
            swap_reserve: swap_reserve.cloned(),
            backing: template.backing(),
        };
        let (dev, report) = Device::recover_with(files, with)?;
        if dev.page_size_bytes() != self.page_size_bytes {
            return Err(differs(
                "page_size",
                &dev.page_size_bytes(),
                &self.page_size_bytes,
            ));
        }
        let size = eval_size(&self.disksize, ram_bytes)?;
        let page = self.page_size_bytes as u64;
        let want = size.div_ceil(page) * page;
        if dev.disksize_bytes() != want {
            return Err(differs(
                "disksize",
                &dev.disksize_bytes(),
                &format!("{want} ({})", self.disksize),
            ));
        }
        for prio in 0..uzram::compress::MAX_COMPS {
            let dict = |d: &Device| d.algorithm_params(prio).and_then(|p| p.dict);
            let (cfg, saved) = (dict(&template), dict(&dev));
            // A codec whose file did not load is in the notes already.
            if cfg == saved || (cfg.is_none() && !unread.is_empty()) {
                continue;
            }
            let bytes = |d: &Option<uzram::compress::Dictionary>| match d {
                Some(d) => format!("{} bytes", d.bytes().len()),
                None => "none".to_string(),
            };
            notes.push(format!(
                "{}'s dictionary in the configuration ({}) is not the one its saved state holds \
                 ({}{}): the saved one serves, as the stored pages need it (the \
                 configuration's is taken at the next start without saved state)",
                if prio == 0 {
                    "comp_algorithm".to_string()
                } else {
                    format!("recompression priority {prio}")
                },
                bytes(&cfg),
                bytes(&saved),
                if prio > 0 && saved.is_none() {
                    ", or trained over since"
                } else {
                    ""
                },
            ));
        }
        for (i, (k, v)) in self.attrs.iter().enumerate() {
            if unread.contains(&i) {
                continue;
            }
            match dev.attr_store(k, v) {
                Ok(()) => {}
                Err(e) if e.kind() == uzram::ErrorKind::Busy => {
                    let (Ok(saved), Ok(cfg)) = (dev.attr_show(k), template.attr_show(k)) else {
                        continue;
                    };
                    if saved != cfg {
                        return Err(differs(k, &saved.trim_end(), &cfg.trim_end()));
                    }
                }
                Err(e) => {
                    return Err(Error::new(
                        e.kind(),
                        format!("{k} = {v:?}: {}", e.message()),
                    ))
                }
            }
        }
        Ok((dev, report, notes))
    }
}

/// An `algorithm_params` value `v` (attribute `k`) without its `dict=` words; `None` for
/// another attribute, or a value without one.
fn without_dict(k: &str, v: &str) -> Option<String> {
    if k != "algorithm_params" {
        return None;
    }
    let words: Vec<&str> = v.split_ascii_whitespace().collect();
    let kept: Vec<&str> = words
        .iter()
        .copied()
        .filter(|w| !w.starts_with("dict="))
        .collect();
    (kept.len() < words.len()).then(|| kept.join(" "))
}

/// Evaluates a `disksize`: a size with zram's suffixes (`4G`), or an expression of `ram`
/// (total RAM in bytes) with explicit units: `ram * 0.5`, `min(ram / 2, 4096M)`,
/// `max(ram / 4, 512M) + 64M` (see [`crate::size_expr`], [`crate::size_expr::Units::Bytes`]).
/// zram-generator's `min(ram / 2, 4096)` (MiB) is refused with a message saying to write
/// `4096M`, rather than read as 4096 bytes.
pub fn eval_size(expr: &str, ram_bytes: u64) -> Result<u64> {
    crate::size_expr::eval_bytes(expr, ram_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use uzram::ErrorKind;

    const G: u64 = 1 << 30;

    #[test]
    fn sizes_and_expressions() {
        assert_eq!(eval_size("4G", 0).unwrap(), 4 * G);
        assert_eq!(eval_size("4096", 0).unwrap(), 4096);
        assert_eq!(eval_size("ram / 2", 16 * G).unwrap(), 8 * G);
        assert_eq!(eval_size("ram*3/4", 16 * G).unwrap(), 12 * G);
        assert_eq!(eval_size("min(ram / 2, 4G)", 16 * G).unwrap(), 4 * G);
        assert_eq!(eval_size("min(ram / 2, 4G)", 2 * G).unwrap(), G);
        assert_eq!(eval_size("max(min(ram, 1G), 2G)", 16 * G).unwrap(), 2 * G);
        assert_eq!(eval_size("ram * 0.5", 16 * G).unwrap(), 8 * G);
        assert_eq!(eval_size("min(ram / 2, 4096M)", 16 * G).unwrap(), 4 * G);
        let e = eval_size("min(ram / 2, 4096)", 16 * G).unwrap_err();
        assert!(e.message().contains("4096M"), "{e}");
        for bad in [
            "",
            "ram /",
            "ram / 0",
            "ram / x",
            "min(ram, 1)",
            "rom",
            "1G * ram",
            "* 2",
        ] {
            assert!(eval_size(bad, G).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_embedded_default_is_zram_generators() {
        let c = ServeConfig::embedded_default();
        assert_eq!(c.devices.len(), 1);
        let d = &c.devices[0];
        assert_eq!(d.name, "zram0");
        assert_eq!(eval_size(&d.disksize, 3 * G).unwrap(), 3 * G / 2);
        assert_eq!(eval_size(&d.disksize, 64 * G).unwrap(), 4 * G);
        assert_eq!(d.attrs, vec![("comp_algorithm".into(), "lz4".into())]);
        let dev = d.build(G).unwrap();
        assert_eq!(dev.disksize_bytes(), G / 2);
        assert!(dev.attr_show("comp_algorithm").unwrap().contains("[lz4]"));
    }

    #[test]
    fn a_file_with_two_devices_keeps_attribute_order() {
        let c = ServeConfig::parse(
            r#"
            [server]
            listen = "127.0.0.1:10809"
            swap = true
            max_connections = 7
            max_inflight = "256M"
            tls = "on"
            tls_cert = "/c.pem"
            tls_key = "/k.pem"
            metrics_listen = "127.0.0.1:9437"
            [[device]]
            name = "zram0"
            disksize = "64M"
            comp_algorithm = "zstd"
            algorithm_params = "level=8"
            mem_limit = "32M"
            [[device]]
            name = "zram1"
            disksize = 16777216
            page_size = 16384
            "#,
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.listen, Some("127.0.0.1:10809".parse().unwrap()));
        assert!(c.swap);
        assert_eq!(c.max_connections, Some(7));
        assert_eq!(c.max_inflight_bytes, Some(256 << 20));
        assert_eq!(c.tls.as_deref(), Some("on"));
        assert_eq!(c.tls_cert, Some("/c.pem".into()));
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9437".parse().unwrap()));
        assert!(!c.metrics_allow_remote);
        let d0 = &c.devices[0];
        let keys: Vec<_> = d0.attrs.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["comp_algorithm", "algorithm_params", "mem_limit"]);
        let dev = d0.build(G).unwrap();
        assert!(dev.attr_show("comp_algorithm").unwrap().contains("[zstd]"));
        assert_eq!(dev.disksize_bytes(), 64 << 20);
        assert_eq!(
            dev.attr_show("mm_stat").unwrap().split_whitespace().nth(3),
            Some("33554432")
        );
        let dev1 = c.devices[1].build(G).unwrap();
        assert_eq!(dev1.page_size_bytes(), 16384);
        assert_eq!(dev1.disksize_bytes(), 16 << 20);
    }

    #[test]
    fn unknown_attributes_and_bad_values_are_clear_errors() {
        let one = |body: &str| {
            ServeConfig::parse(&format!("[[device]]\nname = \"zram0\"\n{body}"), "t.toml")
        };
        // An attribute the device does not have: its errno and the key, never ignored.
        let c = one("disksize = \"1M\"\nbacking_dev_typo = \"/dev/vdb\"").unwrap();
        let e = c.devices[0].build(G).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert!(e.message().contains("backing_dev_typo"), "{e}");
        // A read-only attribute.
        let e = one("disksize = \"1M\"\nmm_stat = 1").unwrap().devices[0]
            .build(G)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        // A bad value keeps the attribute's errno.
        let e = one("disksize = \"1M\"\ncomp_algorithm = \"lzo9\"")
            .unwrap()
            .devices[0]
            .build(G)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("comp_algorithm"), "{e}");
        assert!(one("").is_err(), "no disksize");
        assert!(ServeConfig::parse("[[device]]\ndisksize = \"1M\"", "t").is_err());
        assert!(ServeConfig::parse("", "t").is_err(), "no device");
        assert!(ServeConfig::parse("[server]\nlisten = \"nowhere\"\n", "t").is_err());
        assert!(ServeConfig::parse("[server]\ntls = 1\n", "t").is_err());
        assert!(ServeConfig::parse("[server]\nmetrics_listen = \"9437\"\n", "t").is_err());
        assert!(ServeConfig::parse("[server]\nmax_connections = 0\n", "t").is_err());
        assert!(ServeConfig::parse("[server]\nmax_inflight = \"lots\"\n", "t").is_err());
        assert!(ServeConfig::parse(
            "[[device]]\nname=\"a\"\ndisksize=\"1M\"\n[[device]]\nname=\"a\"\ndisksize=\"1M\"\n",
            "t"
        )
        .is_err());
        assert!(
            ServeConfig::parse("[[device]\n", "t").is_err(),
            "TOML syntax"
        );
    }

    /// Pages written with a `dict=` file's dictionary read back after a recovery whatever
    /// became of the file: gone, or changed (the saved dictionary serves, each said in a
    /// note), or as it was (no note).
    #[test]
    fn a_dictionary_file_gone_or_changed_does_not_refuse_the_saved_state() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dict");
        let words = |seed: u64, n: usize| -> Vec<u8> {
            let w = [
                "page ",
                "slot ",
                "zspage ",
                "handle ",
                "idle ",
                "huge ",
                "writeback ",
            ];
            (0..)
                .flat_map(|i: u64| w[((i * 7 + seed) % w.len() as u64) as usize].bytes())
                .take(n)
                .collect()
        };
        let dict = words(1, 16384);
        std::fs::write(&path, &dict).unwrap();
        let text = format!(
            "[[device]]\nname = \"zram0\"\ndisksize = \"1M\"\ncomp_algorithm = \"zstd\"\n\
             algorithm_params = \"level=3 dict={}\"\n",
            path.display()
        );
        let spec = ServeConfig::parse(&text, "t").unwrap().devices.remove(0);
        let dev = spec.build(G).unwrap();
        let pages: Vec<Vec<u8>> = (0..32).map(|i| words(i, 4096)).collect();
        for (i, p) in pages.iter().enumerate() {
            dev.write_at(p, i as u64 * 4096).unwrap();
        }
        let check = |back: &Device| {
            for (i, p) in pages.iter().enumerate() {
                let mut got = vec![0u8; 4096];
                back.read_at(&mut got, i as u64 * 4096).unwrap();
                assert!(got == *p, "page {i}");
            }
            let saved = back.algorithm_params(0).unwrap().dict.unwrap();
            assert_eq!(saved.bytes(), &dict[..]);
        };
        // Gone.
        std::fs::remove_file(&path).unwrap();
        let (back, _, notes) = spec.recover(dev.state_files().unwrap(), G, None).unwrap();
        check(&back);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("dict=") && notes[0].contains("saved state holds serves"),
            "{notes:?}"
        );
        drop(back);
        // Changed.
        std::fs::write(&path, words(2, 8192)).unwrap();
        let (back, _, notes) = spec.recover(dev.state_files().unwrap(), G, None).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("comp_algorithm's dictionary in the configuration (8192 bytes)")
                && notes[0].contains("(16384 bytes)"),
            "{notes:?}"
        );
        drop(back);
        // As it was.
        std::fs::write(&path, &dict).unwrap();
        let (back, _, notes) = spec.recover(dev.state_files().unwrap(), G, None).unwrap();
        check(&back);
        assert!(notes.is_empty(), "{notes:?}");
        // Any other attribute that does not store still refuses the device.
        let bad = text.replace("level=3", "level=x");
        let spec = ServeConfig::parse(&bad, "t").unwrap().devices.remove(0);
        std::fs::remove_file(&path).unwrap();
        assert!(spec.recover(dev.state_files().unwrap(), G, None).is_err());
    }
}
