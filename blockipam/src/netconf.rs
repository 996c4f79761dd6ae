//! The network configuration blockipam reads, with its defaults and validation.
//!
//! The network configuration blockipam reads: calico-ipam's keys (top level or inside `ipam`, the
//! `ipam` object winning), blockipam's own, and the CNI conventions (`args`, `runtimeConfig`,
//! `prevResult`, `cni.dev/valid-attachments`). Unknown keys are ignored; a known key with the
//! wrong type is code 7 (6 for `name` and `cniVersion`, as libcni's skeleton does).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use blockipam_store::{
    agent_socket_from_text, seconds_from_f64, DatastoreSettings, DatastoreType,
    RawDatastoreSettings, Secret, SettingsError, MAX_SECONDS,
};
use ipam_core::{Ipam, IpamError, Pool, PoolSpec};
use ipnet::IpNet;
use serde_json::{Map, Value};

use crate::protocol::{codes, parse_ip_maybe_prefixed, CniError};

/// Where the host lock lives by default.
pub const DEFAULT_LOCK_FILE: &str = "/var/run/blockipam/ipam.lock";
/// How long a call waits for the host lock by default.
pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(10);
/// The whole call's deadline by default, counted once the host lock is held.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(90);
/// The node-name file Calico writes (read when `nodename` is not set).
pub use blockipam_store::node_name::DEFAULT_NODENAME_FILE;

/// How much the plugin logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum LogLevel {
    /// Nothing.
    Off,
    /// Errors only.
    Error,
    /// Warnings and errors.
    Warn,
    /// One line per call and notable events (the default).
    #[default]
    Info,
    /// Decisions and store round trips.
    Debug,
    /// Everything.
    Trace,
}

impl LogLevel {
    /// Parses calico's (logrus) level names, case-insensitively.
    ///
    /// # Errors
    /// A message listing the accepted names.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "off" | "none" => Ok(LogLevel::Off),
            "panic" | "fatal" | "error" => Ok(LogLevel::Error),
            "warn" | "warning" => Ok(LogLevel::Warn),
            "info" => Ok(LogLevel::Info),
            "debug" => Ok(LogLevel::Debug),
            "trace" => Ok(LogLevel::Trace),
            _ => {
                Err("expected one of trace, debug, info, warning, error, fatal, panic, none".into())
            }
        }
    }
}

/// One route to hand back (host-local style).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteConf {
    /// Destination.
    pub dst: IpNet,
    /// Next hop (the main plugin uses the gateway when absent).
    pub gw: Option<IpAddr>,
}

/// One attachment GC must keep.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Attachment {
    /// `containerID`.
    pub container_id: String,
    /// `ifname`.
    pub ifname: String,
}

/// Everything the plugin takes from its network configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    /// `cniVersion` (`0.1.0` when absent, as libcni assumes).
    pub cni_version: String,
    /// `name`: the network; part of every handle id.
    pub name: String,
    /// `nodename` (`ipam` wins over the top level).
    pub nodename: Option<String>,
    /// `nodename_file`: read when `nodename` is not set.
    pub nodename_file: PathBuf,
    /// Which store, where, how to reach it.
    pub datastore: DatastoreSettings,
    /// `log_level`.
    pub log_level: LogLevel,
    /// `log_file_path`: logs go there instead of stderr.
    pub log_file_path: Option<PathBuf>,
    /// `ipam_lock_file`: the host lock.
    pub lock_file: PathBuf,
    /// `ipam_lock_timeout_seconds`: how long to wait for the host lock.
    pub lock_wait: Duration,
    /// `timeout_seconds`: the call's deadline once the lock is held.
    pub timeout: Duration,
    /// `ipam.assign_ipv4` (default on).
    pub assign_ipv4: bool,
    /// `ipam.assign_ipv6` (default off).
    pub assign_ipv6: bool,
    /// `ipam.ipv4_pools`: names or CIDRs.
    pub ipv4_pools: Vec<String>,
    /// `ipam.ipv6_pools`: names or CIDRs.
    pub ipv6_pools: Vec<String>,
    /// `ipam.pools`: created when absent.
    pub pools: Vec<PoolSpec>,
    /// `ipam.gateway`: one or more gateways.
    pub gateways: Vec<IpAddr>,
    /// `ipam.routes`: when set, exactly these routes are returned.
    pub routes: Option<Vec<RouteConf>>,
    /// `args.cni.ips` when the key is present (an empty list included): then `CNI_ARGS` `IP` is
    /// ignored, as the CNI conventions require.
    pub args_ips: Option<Vec<IpAddr>>,
    /// `runtimeConfig.ips` (the `ips` capability).
    pub runtime_ips: Vec<IpAddr>,
    /// Calico's pod annotations, from `runtimeConfig["io.kubernetes.cri.pod-annotations"]` (the
    /// pod-annotations capability of containerd's and CRI-O's CNI callers).
    pub pod_annotations: PodAnnotations,
    /// `prevResult`, as given.
    pub prev_result: Option<Value>,
    /// `cni.dev/valid-attachments` (or the older `cni.dev/attachments`); `null` is an empty list
    /// (what libcni and ocicni send for a network with no live attachment), a missing key `None`.
    pub valid_attachments: Option<Vec<Attachment>>,
}

/// Where a key may appear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// Top level or `ipam`; `ipam` wins.
    Both,
    /// Only inside `ipam`.
    Ipam,
    /// Only at the top level.
    Top,
}

struct Source<'a> {
    top: &'a Map<String, Value>,
    ipam: Option<&'a Map<String, Value>>,
}

fn type_error(path: &str, expected: &str, found: &Value) -> CniError {
    CniError::config(format!(
        "netconf key {path:?} must be {expected}, found {found}"
    ))
}

/// A secret string key (an empty string counts as absent): kept exactly as given (no trimming),
/// and never echoed in an error.
fn secret(source: &Source<'_>, key: &str) -> Result<Option<Secret>, CniError> {
    match source.lookup(key, Scope::Both) {
        None => Ok(None),
        Some((_, Value::String(text))) if text.is_empty() => Ok(None),
        Some((_, Value::String(text))) => Ok(Some(Secret::new(text.clone()))),
        Some((path, _)) => Err(CniError::config(format!(
            "netconf key {path:?} must be a string (its value is not shown: it is a secret)"
        ))),
    }
}

/// Store settings that name no store, worded with the netconf's keys.
fn settings_error(error: &SettingsError) -> CniError {
    CniError::config(match error {
        SettingsError::NoEtcdEndpoints => {
            "datastore_type etcdv3 needs etcd_endpoints (for example \"http://127.0.0.1:2379\")"
                .to_owned()
        }
        SettingsError::UnpairedClientCertificate => {
            "etcd_cert_file and etcd_key_file must be given together".to_owned()
        }
        SettingsError::UnpairedCredentials => {
            "etcd_username and etcd_password must be given together".to_owned()
        }
        other => other.to_string(),
    })
}

fn unsupported(path: &str, value: &str, why: impl std::fmt::Display) -> CniError {
    CniError::with_details(
        codes::UNSUPPORTED_FIELD,
        format!("unsupported value for netconf key {path:?}: {value:?}"),
        why.to_string(),
    )
}

impl<'a> Source<'a> {
    /// The value of `key` and its path (`ipam.key` or `key`); `null` counts as absent.
    fn lookup(&self, key: &str, scope: Scope) -> Option<(String, &'a Value)> {
        let in_ipam = || {
            self.ipam
                .and_then(|m| m.get(key))
                .filter(|v| !v.is_null())
                .map(|v| (format!("ipam.{key}"), v))
        };
        let in_top = || {
            self.top
                .get(key)
                .filter(|v| !v.is_null())
                .map(|v| (key.to_owned(), v))
        };
        match scope {
            Scope::Both => in_ipam().or_else(in_top),
            Scope::Ipam => in_ipam(),
            Scope::Top => in_top(),
        }
    }

    fn string(&self, key: &str, scope: Scope) -> Result<Option<String>, CniError> {
        match self.lookup(key, scope) {
            None => Ok(None),
            Some((path, value)) => value
                .as_str()
                .map(|s| Some(s.to_owned()))
                .ok_or_else(|| type_error(&path, "a string", value)),
        }
    }

    fn nonempty_string(&self, key: &str, scope: Scope) -> Result<Option<String>, CniError> {
        Ok(self
            .string(key, scope)?
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty()))
    }

    fn strings(&self, key: &str, scope: Scope) -> Result<Vec<String>, CniError> {
        match self.lookup(key, scope) {
            None => Ok(Vec::new()),
            Some((path, value)) => string_list(&path, value),
        }
    }

    fn seconds(
        &self,
        key: &str,
        default: Duration,
        allow_zero: bool,
    ) -> Result<Duration, CniError> {
        let Some((path, value)) = self.lookup(key, Scope::Both) else {
            return Ok(default);
        };
        let seconds = value
            .as_f64()
            .ok_or_else(|| type_error(&path, "a number of seconds", value))?;
        // A positive value below one nanosecond is a zero deadline.
        seconds_from_f64(seconds, allow_zero).map_err(|_| {
            CniError::config(format!(
                "netconf key {path:?} must be {} and at most {MAX_SECONDS} seconds, found {value}",
                if allow_zero {
                    "zero or more"
                } else {
                    "at least one nanosecond"
                }
            ))
        })
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool, CniError> {
        let Some((path, value)) = self.lookup(key, Scope::Ipam) else {
            return Ok(default);
        };
        match value {
            Value::Bool(b) => Ok(*b),
            Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
                "true" => Ok(true),
                "false" => Ok(false),
                _ => Err(unsupported(&path, s, "expected \"true\" or \"false\"")),
            },
            other => Err(type_error(&path, "the string \"true\" or \"false\"", other)),
        }
    }
}

fn string_list(path: &str, value: &Value) -> Result<Vec<String>, CniError> {
    let list = value
        .as_array()
        .ok_or_else(|| type_error(path, "a list of strings", value))?;
    list.iter()
        .enumerate()
        .map(|(i, item)| {
            item.as_str()
                .map(str::to_owned)
                .ok_or_else(|| type_error(&format!("{path}[{i}]"), "a string", item))
        })
        .collect()
}

fn address_list(path: &str, value: &Value) -> Result<Vec<IpAddr>, CniError> {
    string_list(path, value)?
        .iter()
        .enumerate()
        .map(|(i, text)| {
            parse_ip_maybe_prefixed(text)
                .map_err(|e| CniError::config(format!("netconf key {path}[{i}]: {e}")))
        })
        .collect()
}

fn object<'a>(path: &str, value: &'a Value) -> Result<&'a Map<String, Value>, CniError> {
    value
        .as_object()
        .ok_or_else(|| type_error(path, "an object", value))
}

fn parse_net(path: &str, text: &str) -> Result<IpNet, CniError> {
    text.trim()
        .parse::<IpNet>()
        .map_err(|_| CniError::config(format!("netconf key {path}: {text:?} is not a CIDR")))
}

/// Reads just `name` and `cniVersion`, as libcni's skeleton does before anything else.
///
/// # Errors
/// Code 6 when stdin is not a JSON object or `name` / `cniVersion` is not a string; code 7 when
/// `name` is missing or has characters outside `[a-zA-Z0-9_.-]` (first one alphanumeric).
pub fn parse_header(stdin: &[u8]) -> Result<(Value, String, String), CniError> {
    let value: Value = serde_json::from_slice(stdin).map_err(|e| {
        CniError::new(
            codes::DECODING_FAILURE,
            format!("error unmarshalling network config: {e}"),
        )
    })?;
    let top = value.as_object().ok_or_else(|| {
        CniError::new(
            codes::DECODING_FAILURE,
            "error unmarshalling network config: not a JSON object",
        )
    })?;
    let name = match top.get("name") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(CniError::new(
                codes::DECODING_FAILURE,
                format!("error unmarshalling network config: name must be a string, found {other}"),
            ))
        }
    };
    if name.is_empty() {
        return Err(CniError::config("missing network name"));
    }
    if !is_valid_cni_name(&name) {
        return Err(CniError::with_details(
            codes::INVALID_NETWORK_CONFIG,
            "invalid characters found in network name",
            name,
        ));
    }
    let version = match top.get("cniVersion") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(CniError::new(
                codes::DECODING_FAILURE,
                format!(
                "decoding version from network config: cniVersion must be a string, found {other}"
            ),
            ))
        }
    };
    let version = if version.is_empty() {
        "0.1.0".to_owned()
    } else {
        version
    };
    Ok((value, name, version))
}

/// libcni's rule for network names and container ids: `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`.
pub fn is_valid_cni_name(text: &str) -> bool {
    let mut chars = text.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// Parses the whole network configuration (after [`parse_header`]).
///
/// # Errors
/// Code 7 for a known key of the wrong type or an invalid value (bad CIDR, bad pool, bad
/// address); code 2 for a value blockipam does not support (`datastore_type`, `log_level`,
/// `assign_ipv4` / `assign_ipv6`).
pub fn parse_netconf(
    value: &Value,
    name: String,
    cni_version: String,
) -> Result<NetConf, CniError> {
    let top = object("(netconf)", value)?;
    let ipam = match top.get("ipam") {
        None | Some(Value::Null) => None,
        Some(v) => Some(object("ipam", v)?),
    };
    let source = Source { top, ipam };

    // Absent: etcd when etcd_endpoints are given (Calico's default), sled otherwise.
    let datastore_type = match source.lookup("datastore_type", Scope::Both) {
        None => None,
        Some((path, value)) => {
            let text = value
                .as_str()
                .ok_or_else(|| type_error(&path, "a string", value))?;
            Some(
                text.parse::<DatastoreType>()
                    .map_err(|why| unsupported(&path, text, why))?,
            )
        }
    };
    // One string (comma-separated) or a list; split and trimmed by `DatastoreSettings::from_raw`.
    let etcd_endpoints = match source.lookup("etcd_endpoints", Scope::Both) {
        None => Vec::new(),
        Some((_, Value::String(s))) => vec![s.clone()],
        Some((path, value @ Value::Array(_))) => string_list(&path, value)?,
        Some((path, value)) => {
            return Err(type_error(
                &path,
                "a comma-separated string or a list of strings",
                value,
            ))
        }
    };
    let path_of = |key: &str| -> Result<Option<PathBuf>, CniError> {
        Ok(source.nonempty_string(key, Scope::Both)?.map(PathBuf::from))
    };
    let lock_wait = source.seconds("ipam_lock_timeout_seconds", DEFAULT_LOCK_WAIT, true)?;
    // As given: `DatastoreSettings::from_raw` reads them as every entry point does.
    let raw_path = |key: &str| -> Result<Option<PathBuf>, CniError> {
        Ok(source.string(key, Scope::Both)?.map(PathBuf::from))
    };
    let raw = RawDatastoreSettings {
        datastore_type,
        path: raw_path("datastore_path")?,
        etcd_endpoints,
        etcd_ca_cert_file: raw_path("etcd_ca_cert_file")?,
        etcd_cert_file: raw_path("etcd_cert_file")?,
        etcd_key_file: raw_path("etcd_key_file")?,
        etcd_prefix: source.string("etcd_prefix", Scope::Both)?,
        etcd_username: source.string("etcd_username", Scope::Both)?,
        etcd_password: secret(&source, "etcd_password")?,
        // Set per call from `timeout_seconds` (see `with_store`).
        etcd_request_timeout: None,
    };
    // `agent_socket`: the node agent's socket; "" (or "none") never uses an agent.
    let agent_socket = match source.string("agent_socket", Scope::Both)? {
        None => DatastoreSettings::default().agent_socket,
        Some(text) => agent_socket_from_text(&text),
    };
    // The etcd certificate and credentials come in pairs whatever the datastore type.
    let selected = DatastoreSettings::from_raw(raw.clone())
        .and_then(|settings| raw.check_etcd_pairs().map(|()| settings))
        .map_err(|e| settings_error(&e))?;
    let mut datastore = DatastoreSettings {
        lock_wait,
        // Decided per call from `pools` (see `with_store`): only a netconf listing pools may
        // create a missing embedded store.
        create_if_missing: false,
        agent_socket,
        ..selected
    };
    if let Some(etcd) = datastore.etcd_mut() {
        // Every round trip counts in a CNI call: no probe read at open (see the field).
        etcd.lazy_connect = true;
    }

    let log_level = match source.lookup("log_level", Scope::Both) {
        None => LogLevel::default(),
        Some((path, value)) => {
            let text = value
                .as_str()
                .ok_or_else(|| type_error(&path, "a string", value))?;
            LogLevel::parse(text).map_err(|why| unsupported(&path, text, why))?
        }
    };

    let mut pools = Vec::new();
    if let Some((path, value)) = source.lookup("pools", Scope::Ipam) {
        let list = value.as_array().ok_or_else(|| {
            type_error(&path, "a list of {cidr, block_size, name} objects", value)
        })?;
        let mut parsed: Vec<Pool> = Vec::new();
        for (i, item) in list.iter().enumerate() {
            let item_path = format!("{path}[{i}]");
            let (spec, pool) = parse_pool(&item_path, item)?;
            check_pool_fits_the_others(&path, &item_path, &pool, &parsed)?;
            parsed.push(pool);
            pools.push(spec);
        }
    }

    let gateways = match source.lookup("gateway", Scope::Ipam) {
        None => Vec::new(),
        Some((path, Value::String(s))) => vec![parse_ip_maybe_prefixed(s)
            .map_err(|e| CniError::config(format!("netconf key {path}: {e}")))?],
        Some((path, value @ Value::Array(_))) => address_list(&path, value)?,
        Some((path, value)) => {
            return Err(type_error(
                &path,
                "an address or a list of addresses",
                value,
            ))
        }
    };

    let routes = match source.lookup("routes", Scope::Ipam) {
        None => None,
        Some((path, value)) => {
            let list = value
                .as_array()
                .ok_or_else(|| type_error(&path, "a list of {dst, gw} objects", value))?;
            let mut routes = Vec::new();
            for (i, item) in list.iter().enumerate() {
                routes.push(parse_route(&format!("{path}[{i}]"), item)?);
            }
            Some(routes)
        }
    };

    let mut args_ips = None;
    if let Some(args) = top.get("args").filter(|v| !v.is_null()) {
        let args = object("args", args)?;
        if let Some(cni) = args.get("cni").filter(|v| !v.is_null()) {
            let cni = object("args.cni", cni)?;
            if let Some(ips) = cni.get("ips").filter(|v| !v.is_null()) {
                args_ips = Some(address_list("args.cni.ips", ips)?);
            }
        }
    }
    let mut runtime_ips = Vec::new();
    let mut pod_annotations = PodAnnotations::default();
    if let Some(runtime) = top.get("runtimeConfig").filter(|v| !v.is_null()) {
        let runtime = object("runtimeConfig", runtime)?;
        if let Some(ips) = runtime.get("ips").filter(|v| !v.is_null()) {
            runtime_ips = address_list("runtimeConfig.ips", ips)?;
        }
        if let Some(annotations) = runtime
            .get(POD_ANNOTATIONS_CAPABILITY)
            .filter(|v| !v.is_null())
        {
            pod_annotations = PodAnnotations::parse(annotations)?;
        }
    }

    let prev_result = match source.lookup("prevResult", Scope::Top) {
        None => None,
        Some((path, value)) => Some(Value::Object(object(&path, value)?.clone())),
    };

    // The spec makes the key mandatory for GC, so a missing key stays `None` (GC refuses it);
    // `null` is how Go runtimes marshal an empty list, so it is one.
    let valid_attachments = match ["cni.dev/valid-attachments", "cni.dev/attachments"]
        .into_iter()
        .find_map(|key| top.get(key).map(|value| (key, value)))
    {
        None => None,
        Some((_, Value::Null)) => Some(Vec::new()),
        Some((path, value)) => Some(parse_attachments(path, value)?),
    };

    Ok(NetConf {
        cni_version,
        name,
        nodename: source.nonempty_string("nodename", Scope::Both)?,
        nodename_file: path_of("nodename_file")?
            .unwrap_or_else(|| PathBuf::from(DEFAULT_NODENAME_FILE)),
        datastore,
        log_level,
        log_file_path: path_of("log_file_path")?,
        lock_file: path_of("ipam_lock_file")?.unwrap_or_else(|| PathBuf::from(DEFAULT_LOCK_FILE)),
        lock_wait,
        timeout: source.seconds("timeout_seconds", DEFAULT_TIMEOUT, false)?,
        assign_ipv4: source.flag("assign_ipv4", true)?,
        assign_ipv6: source.flag("assign_ipv6", false)?,
        ipv4_pools: source.strings("ipv4_pools", Scope::Ipam)?,
        ipv6_pools: source.strings("ipv6_pools", Scope::Ipam)?,
        pools,
        gateways,
        routes,
        args_ips,
        runtime_ips,
        pod_annotations,
        prev_result,
        valid_attachments,
    })
}

/// The `runtimeConfig` key (and capability) under which containerd and CRI-O pass a pod's
/// annotations to plugins that declare it.
pub const POD_ANNOTATIONS_CAPABILITY: &str = "io.kubernetes.cri.pod-annotations";
/// Pod annotation: the IPv4 pools to use (a JSON list of pool names or CIDRs), as in Calico.
pub const ANNOTATION_IPV4_POOLS: &str = "cni.projectcalico.org/ipv4pools";
/// Pod annotation: the IPv6 pools to use.
pub const ANNOTATION_IPV6_POOLS: &str = "cni.projectcalico.org/ipv6pools";
/// Pod annotation: the specific addresses to assign (a JSON list of addresses).
pub const ANNOTATION_IP_ADDRS: &str = "cni.projectcalico.org/ipAddrs";

/// Calico's pod annotations that choose addresses, when present (other annotations are ignored).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodAnnotations {
    /// `cni.projectcalico.org/ipv4pools`.
    pub ipv4_pools: Option<Vec<String>>,
    /// `cni.projectcalico.org/ipv6pools`.
    pub ipv6_pools: Option<Vec<String>>,
    /// `cni.projectcalico.org/ipAddrs`.
    pub ip_addrs: Option<Vec<IpAddr>>,
}

impl PodAnnotations {
    /// Reads the annotations object: each value a string holding JSON, as Kubernetes stores it.
    /// Malformed JSON, a wrong type, or pools together with `ipAddrs` is code 7, naming the
    /// annotation.
    ///
    /// # Errors
    /// [`CniError`] with code 7.
    pub fn parse(value: &Value) -> Result<Self, CniError> {
        let path = format!("runtimeConfig[{POD_ANNOTATIONS_CAPABILITY:?}]");
        let annotations = object(&path, value)?;
        let list = |name: &str| -> Result<Option<Vec<String>>, CniError> {
            let Some(raw) = annotations.get(name) else {
                return Ok(None);
            };
            let text = raw
                .as_str()
                .ok_or_else(|| type_error(&format!("pod annotation {name}"), "a string", raw))?;
            let items: Vec<String> = serde_json::from_str(text).map_err(|e| {
                CniError::config(format!(
                    "pod annotation {name}: {text:?} is not a JSON list of strings: {e}"
                ))
            })?;
            Ok(Some(
                items.into_iter().map(|s| s.trim().to_owned()).collect(),
            ))
        };
        let ipv4_pools = list(ANNOTATION_IPV4_POOLS)?;
        let ipv6_pools = list(ANNOTATION_IPV6_POOLS)?;
        let ip_addrs = match list(ANNOTATION_IP_ADDRS)? {
            None => None,
            Some(items) => Some(
                items
                    .iter()
                    .map(|text| {
                        text.parse::<IpAddr>().map_err(|_| {
                            CniError::config(format!(
                                "pod annotation {ANNOTATION_IP_ADDRS}: {text:?} is not an IP address"
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        if ip_addrs.is_some() && (ipv4_pools.is_some() || ipv6_pools.is_some()) {
            return Err(CniError::config(format!(
                "pod annotations {ANNOTATION_IP_ADDRS} and {ANNOTATION_IPV4_POOLS}/{ANNOTATION_IPV6_POOLS} \
                 cannot be used together (as in Calico)"
            )));
        }
        Ok(PodAnnotations {
            ipv4_pools,
            ipv6_pools,
            ip_addrs,
        })
    }
}

fn parse_pool(path: &str, item: &Value) -> Result<(PoolSpec, Pool), CniError> {
    let fields = object(path, item)?;
    let cidr_text = match fields.get("cidr") {
        Some(Value::String(s)) => s,
        None | Some(Value::Null) => {
            return Err(CniError::config(format!(
                "netconf key {path}.cidr is missing"
            )))
        }
        Some(other) => return Err(type_error(&format!("{path}.cidr"), "a CIDR string", other)),
    };
    let cidr = parse_net(&format!("{path}.cidr"), cidr_text)?;
    let block_size = match fields.get("block_size") {
        None | Some(Value::Null) => None,
        Some(value) => Some(
            value
                .as_u64()
                .and_then(|n| u8::try_from(n).ok())
                .ok_or_else(|| {
                    type_error(&format!("{path}.block_size"), "a prefix length", value)
                })?,
        ),
    };
    let name = match fields.get("name") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => return Err(type_error(&format!("{path}.name"), "a string", other)),
    };
    let spec = PoolSpec {
        cidr,
        name,
        block_size,
        disabled: false,
    };
    let pool = Ipam::pool_from_spec(&spec).map_err(|e| match e {
        IpamError::InvalidArgument(why) => CniError::config(format!("netconf key {path}: {why}")),
        other => CniError::config(format!("netconf key {path}: {other}")),
    })?;
    Ok((spec, pool))
}

/// Refuses a netconf pool that no store could hold beside the netconf's earlier ones (`earlier`,
/// listed under `list_path`): one overlapping an earlier pool without being the same pool (same
/// CIDR and block size), or taking an earlier, different pool's name. Such a netconf would fail
/// every ADD after creating its first pools.
fn check_pool_fits_the_others(
    list_path: &str,
    path: &str,
    pool: &Pool,
    earlier: &[Pool],
) -> Result<(), CniError> {
    for (i, other) in earlier.iter().enumerate() {
        if other.cidr == pool.cidr && other.block_size == pool.block_size {
            continue;
        }
        if other.cidr.contains(&pool.cidr.network()) || pool.cidr.contains(&other.cidr.network()) {
            return Err(CniError::config(format!(
                "netconf key {path}: pool {} (/{} blocks) overlaps {list_path}[{i}], pool {} (/{} \
                 blocks); pools of one network overlap only when they are the same pool (same \
                 CIDR and block size)",
                pool.cidr, pool.block_size, other.cidr, other.block_size
            )));
        }
        if other.name == pool.name {
            return Err(CniError::config(format!(
                "netconf key {path}: pool name {:?} is also the name of {list_path}[{i}], a \
                 different pool ({})",
                pool.name, other.cidr
            )));
        }
    }
    Ok(())
}

fn parse_route(path: &str, item: &Value) -> Result<RouteConf, CniError> {
    let fields = object(path, item)?;
    let dst = match fields.get("dst") {
        Some(Value::String(s)) => parse_net(&format!("{path}.dst"), s)?.trunc(),
        None | Some(Value::Null) => {
            return Err(CniError::config(format!(
                "netconf key {path}.dst is missing"
            )))
        }
        Some(other) => return Err(type_error(&format!("{path}.dst"), "a CIDR string", other)),
    };
    let gw = match fields.get("gw") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) => Some(s.trim().parse::<IpAddr>().map_err(|_| {
            CniError::config(format!("netconf key {path}.gw: {s:?} is not an IP address"))
        })?),
        Some(other) => {
            return Err(type_error(
                &format!("{path}.gw"),
                "an IP address string",
                other,
            ))
        }
    };
    if let Some(gw) = gw {
        if gw.is_ipv4() != dst.addr().is_ipv4() {
            return Err(CniError::config(format!(
                "netconf key {path}: gateway {gw} is not of the same family as {dst}"
            )));
        }
    }
    Ok(RouteConf { dst, gw })
}

fn parse_attachments(path: &str, value: &Value) -> Result<Vec<Attachment>, CniError> {
    let list = value
        .as_array()
        .ok_or_else(|| type_error(path, "a list of {containerID, ifname} objects", value))?;
    list.iter()
        .enumerate()
        .map(|(i, item)| {
            let item_path = format!("{path}[{i}]");
            let fields = object(&item_path, item)?;
            let field = |key: &str| -> Result<String, CniError> {
                match fields.get(key) {
                    Some(Value::String(s)) => Ok(s.clone()),
                    other => Err(type_error(
                        &format!("{item_path}.{key}"),
                        "a string",
                        other.unwrap_or(&Value::Null),
                    )),
                }
            };
            Ok(Attachment {
                container_id: field("containerID")?,
                ifname: field("ifname")?,
            })
        })
        .collect()
}

/// The node this call allocates for: `nodename`, else the node-name file, else the OS host name
/// (lower-cased, as Calico does).
///
/// # Errors
/// Code 5 when none of them gives a name.
pub fn resolve_nodename(conf: &NetConf) -> Result<String, CniError> {
    if let Some(name) = &conf.nodename {
        return Ok(name.clone());
    }
    blockipam_store::node_name::from_file_or_host(&conf.nodename_file).ok_or_else(|| {
        CniError::new(
            codes::IO_FAILURE,
            format!(
                "cannot determine the node name: no nodename in the netconf, nothing in {}, and no host name",
                conf.nodename_file.display()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(value: Value) -> Result<NetConf, CniError> {
        parse_netconf(&value, "net".into(), "1.0.0".into())
    }

    /// `base`, an object, with the keys of `extra` added (or replaced).
    fn with_keys(base: &Value, extra: Value) -> Value {
        let mut out = base.clone();
        if let (Some(out), Value::Object(extra)) = (out.as_object_mut(), extra) {
            out.extend(extra);
        }
        out
    }

    /// An empty `etcd_prefix` is the default prefix, the same store the agent's `--etcd-prefix ""`
    /// and blockipamctl's name (`DatastoreSettings::from_raw`).
    #[test]
    fn an_empty_etcd_prefix_is_the_default_prefix() {
        let etcd = |extra: Value| {
            let ipam = json!({"datastore_type": "etcdv3", "etcd_endpoints": "127.0.0.1:2379"});
            parse(json!({ "ipam": with_keys(&ipam, extra) }))
                .expect("parse")
                .datastore
        };
        let default = etcd(json!({}));
        for empty in ["", " "] {
            let settings = etcd(json!({ "etcd_prefix": empty }));
            assert_eq!(settings.etcd().expect("etcd").prefix, None, "{empty:?}");
            assert_eq!(settings.identity(), default.identity(), "{empty:?}");
        }
        assert_eq!(
            default.identity().etcd_prefix.as_deref(),
            Some("/blockipam/")
        );
    }

    #[test]
    fn ipam_object_wins_over_top_level_and_defaults_apply() {
        let conf = parse(json!({
            "nodename": "top", "datastore_path": "/top",
            "ipam": {"type": "blockipam", "nodename": "inner"}
        }))
        .expect("parse");
        assert_eq!(conf.nodename.as_deref(), Some("inner"));
        assert_eq!(conf.datastore.path(), Some(std::path::Path::new("/top")));
        assert_eq!(conf.datastore.datastore_type(), DatastoreType::Sled);
        assert!(conf.assign_ipv4 && !conf.assign_ipv6);
        assert_eq!(conf.lock_file, PathBuf::from(DEFAULT_LOCK_FILE));
        assert_eq!(conf.timeout, DEFAULT_TIMEOUT);
        assert_eq!(conf.lock_wait, DEFAULT_LOCK_WAIT);
    }

    #[test]
    fn lock_wait_and_agent_socket_reach_the_store_settings() {
        let conf = parse(json!({
            "ipam_lock_timeout_seconds": 0.2,
            "ipam": {"type": "blockipam", "agent_socket": "/run/other/agent.sock"}
        }))
        .expect("parse");
        // The host lock and the store open both wait what the netconf says.
        assert_eq!(conf.lock_wait, Duration::from_millis(200));
        assert_eq!(conf.datastore.lock_wait, Duration::from_millis(200));
        assert_eq!(
            conf.datastore.agent_socket.as_deref(),
            Some(std::path::Path::new("/run/other/agent.sock"))
        );
        // Nothing given: the defaults; "none": never an agent.
        let conf = parse(json!({"ipam": {"type": "blockipam"}})).expect("parse");
        assert_eq!(conf.datastore.lock_wait, DEFAULT_LOCK_WAIT);
        assert_eq!(
            conf.datastore.agent_socket,
            DatastoreSettings::default().agent_socket
        );
        let conf =
            parse(json!({"ipam": {"type": "blockipam", "agent_socket": "none"}})).expect("parse");
        assert_eq!(conf.datastore.agent_socket, None);
    }

    #[test]
    fn wrong_types_for_known_keys_are_invalid_config_naming_the_key() {
        for (value, key) in [
            (json!({"ipam": {"nodename": 5}}), "ipam.nodename"),
            (json!({"ipam": {"ipv4_pools": "a"}}), "ipam.ipv4_pools"),
            (
                json!({"ipam": {"pools": [{"cidr": 10}]}}),
                "ipam.pools[0].cidr",
            ),
            (
                json!({"ipam": {"routes": [{"dst": "10.0.0.0/8", "gw": 1}]}}),
                "ipam.routes[0].gw",
            ),
            (json!({"timeout_seconds": "ten"}), "timeout_seconds"),
            (json!({"ipam": "blockipam"}), "ipam"),
        ] {
            let err = parse(value).expect_err(key);
            assert_eq!(err.code, codes::INVALID_NETWORK_CONFIG, "{key}");
            assert!(err.msg.contains(key), "{key}: {}", err.msg);
        }
    }

    #[test]
    fn unsupported_values_are_code_2_naming_key_and_value() {
        for (value, key, shown) in [
            (
                json!({"datastore_type": "kubernetes"}),
                "datastore_type",
                "kubernetes",
            ),
            (
                json!({"ipam": {"assign_ipv4": "maybe"}}),
                "ipam.assign_ipv4",
                "maybe",
            ),
            (json!({"log_level": "loud"}), "log_level", "loud"),
        ] {
            let err = parse(value).expect_err(key);
            assert_eq!(err.code, codes::UNSUPPORTED_FIELD, "{key}");
            assert!(
                err.msg.contains(key) && err.msg.contains(shown),
                "{}",
                err.msg
            );
        }
    }

    #[test]
    fn bad_pool_cidrs_and_block_sizes_are_invalid_config() {
        for pool in [
            json!({"cidr": "10.0.0.0/33"}),
            json!({"cidr": "10.0.0.1/24"}),
            json!({"cidr": "10.0.0.0/24", "block_size": 19}),
            json!({"cidr": "10.0.0.0/24", "block_size": 300}),
        ] {
            let err = parse(json!({"ipam": {"pools": [pool.clone()]}})).expect_err("bad pool");
            assert_eq!(err.code, codes::INVALID_NETWORK_CONFIG, "{pool}");
        }
    }

    #[test]
    fn pools_that_could_not_all_exist_together_are_invalid_config() {
        for (pools, shown) in [
            (
                json!([{"cidr": "10.0.0.0/24"}, {"cidr": "10.0.0.128/25"}]),
                "overlaps ipam.pools[0]",
            ),
            (
                json!([{"cidr": "10.0.0.0/24"}, {"cidr": "10.0.0.0/23"}]),
                "overlaps ipam.pools[0]",
            ),
            (
                json!([{"cidr": "10.0.0.0/24"}, {"cidr": "10.0.0.0/24", "block_size": 28}]),
                "(/28 blocks) overlaps ipam.pools[0], pool 10.0.0.0/24 (/26 blocks)",
            ),
            (
                json!([{"cidr": "10.0.0.0/24", "name": "a"}, {"cidr": "10.0.1.0/24", "name": "a"}]),
                "name \"a\" is also the name of ipam.pools[0]",
            ),
            (
                json!([{"cidr": "10.0.1.0/24"}, {"cidr": "10.0.0.0/24", "name": "10.0.1.0-24"}]),
                "is also the name of ipam.pools[0]",
            ),
            (
                json!([{"cidr": "fd00::/64"}, {"cidr": "10.0.0.0/24"}, {"cidr": "fd00::/48"}]),
                "ipam.pools[2]: pool fd00::/48 (/122 blocks) overlaps ipam.pools[0]",
            ),
        ] {
            let err = parse(json!({"ipam": {"pools": pools.clone()}})).expect_err("refused");
            assert_eq!(err.code, codes::INVALID_NETWORK_CONFIG, "{pools}");
            assert!(err.msg.contains(shown), "{pools}: {}", err.msg);
        }
        // The same pool twice (same CIDR and block size), under two names: it is one pool.
        let conf = parse(json!({"ipam": {"pools": [
            {"cidr": "10.0.0.0/24", "name": "a"},
            {"cidr": "10.0.0.0/24", "block_size": 26, "name": "b"},
            {"cidr": "10.0.1.0/24", "name": "c"}
        ]}}))
        .expect("pools that can exist together");
        assert_eq!(conf.pools.len(), 3);
    }

    #[test]
    fn calico_string_flags_and_comma_endpoints_are_understood() {
        let conf = parse(json!({
            "datastore_type": "etcdv3",
            "etcd_endpoints": "http://127.0.0.1:1, http://127.0.0.1:2",
            "ipam": {"assign_ipv4": "false", "assign_ipv6": "true", "gateway": ["10.0.0.1", "fd00::1"]}
        }))
        .expect("parse");
        assert!(!conf.assign_ipv4 && conf.assign_ipv6);
        assert_eq!(conf.datastore.etcd().expect("etcd").endpoints.len(), 2);
        assert_eq!(conf.gateways.len(), 2);
    }

    #[test]
    fn etcd_credentials_are_read_verbatim_in_pairs_and_never_echoed() {
        let conf = parse(json!({
            "datastore_type": "etcdv3",
            "etcd_endpoints": "http://127.0.0.1:1",
            "ipam": {"etcd_username": "blockipam", "etcd_password": " s3cret "}
        }))
        .expect("parse");
        let etcd = conf.datastore.etcd().expect("etcd");
        assert_eq!(etcd.username.as_deref(), Some("blockipam"));
        let password = etcd.password.as_ref().expect("password");
        assert_eq!(password.expose(), " s3cret ");
        assert!(!format!("{conf:?}").contains("s3cret"));

        let err = parse(json!({"etcd_password": "s3cret"})).expect_err("password alone");
        assert_eq!(err.code, codes::INVALID_NETWORK_CONFIG);
        assert!(err.msg.contains("together"), "{}", err.msg);
        let err = parse(json!({"etcd_username": "u", "etcd_password": 918273})).expect_err("type");
        assert_eq!(err.code, codes::INVALID_NETWORK_CONFIG);
        assert!(!err.msg.contains("918273"), "{}", err.msg);
    }

    /// Calico's default: a netconf with `etcd_endpoints` and no `datastore_type` is on etcd, not on
    /// each node's own embedded store; a type that contradicts the other keys is refused.
    #[test]
    fn etcd_endpoints_without_a_type_mean_etcd_and_a_contradicting_type_is_refused() {
        let conf = parse(json!({"ipam": {"etcd_endpoints": "http://10.0.0.1:2379"}}))
            .expect("endpoints alone");
        assert_eq!(conf.datastore.datastore_type(), DatastoreType::Etcdv3);
        assert_eq!(
            conf.datastore.etcd().expect("etcd").endpoints,
            ["http://10.0.0.1:2379"]
        );
        let conf = parse(json!({"ipam": {"etcd_endpoints": " ", "datastore_type": "redb"}}))
            .expect("blank endpoints are not given");
        assert_eq!(conf.datastore.datastore_type(), DatastoreType::Redb);
        for (ipam, names) in [
            (
                json!({"datastore_type": "sled", "etcd_endpoints": "10.0.0.1:2379"}),
                "etcd endpoints",
            ),
            (
                json!({"etcd_endpoints": ["10.0.0.1:2379"], "datastore_path": "/var/lib/x"}),
                "no datastore type",
            ),
        ] {
            let err = parse(json!({ "ipam": ipam })).expect_err("contradiction");
            assert_eq!(err.code, codes::INVALID_NETWORK_CONFIG, "{ipam}");
            assert!(err.msg.contains(names), "{ipam}: {}", err.msg);
        }
    }

    #[test]
    fn etcd_without_endpoints_is_invalid_config() {
        let err = parse(json!({"datastore_type": "etcdv3"})).expect_err("no endpoints");
        assert_eq!(err.code, codes::INVALID_NETWORK_CONFIG);
    }

    #[test]
    fn etcd_endpoints_of_commas_alone_are_invalid_config_not_the_local_store() {
        for endpoints in [json!(","), json!(" , ,"), json!([","])] {
            let err = parse(json!({"etcd_endpoints": endpoints.clone()}))
                .expect_err("commas alone name no endpoint");
            assert_eq!(err.code, codes::INVALID_NETWORK_CONFIG, "{endpoints}");
            assert!(err.msg.contains("commas alone"), "{endpoints}: {}", err.msg);
        }
    }

    #[test]
    fn header_rules_follow_libcni() {
        assert_eq!(
            parse_header(b"{").expect_err("syntax").code,
            codes::DECODING_FAILURE
        );
        assert_eq!(
            parse_header(b"{}").expect_err("no name").code,
            codes::INVALID_NETWORK_CONFIG
        );
        assert_eq!(
            parse_header(br#"{"name": "a b"}"#)
                .expect_err("bad name")
                .code,
            codes::INVALID_NETWORK_CONFIG
        );
        let (_, _, version) = parse_header(br#"{"name": "n"}"#).expect("ok");
        assert_eq!(version, "0.1.0");
    }

    /// Every level name Calico's logrus accepts, in any case.
    #[test]
    fn log_levels_are_calicos_names_in_any_case() {
        for (names, level) in [
            (&["off", "none", "NONE"][..], LogLevel::Off),
            (&["panic", "fatal", "error", "Error"][..], LogLevel::Error),
            (&["warn", "warning", "WARNING"][..], LogLevel::Warn),
            (&["info", "Info"][..], LogLevel::Info),
            (&["debug", "DEBUG"][..], LogLevel::Debug),
            (&["trace", "Trace"][..], LogLevel::Trace),
        ] {
            for name in names {
                assert_eq!(LogLevel::parse(name), Ok(level), "{name}");
                let conf = parse(json!({ "log_level": name })).expect(name);
                assert_eq!(conf.log_level, level, "{name}");
            }
        }
        assert!(LogLevel::parse("verbose").is_err());
    }

    /// An empty password is no password: alone it is accepted, beside a user name it is the user
    /// name without its pair.
    #[test]
    fn an_empty_etcd_password_counts_as_absent() {
        let etcd = json!({"datastore_type": "etcdv3", "etcd_endpoints": "http://127.0.0.1:1"});
        let conf = parse(json!({"ipam": with_keys(&etcd, json!({"etcd_password": ""}))}))
            .expect("an empty password alone");
        assert!(conf.datastore.etcd().expect("etcd").password.is_none());
        let err = parse(
            json!({"ipam": with_keys(&etcd, json!({"etcd_username": "u", "etcd_password": ""}))}),
        )
        .expect_err("a user name whose password is empty");
        assert_eq!(err.code, codes::INVALID_NETWORK_CONFIG);
        assert!(err.msg.contains("together"), "{}", err.msg);
    }

    #[test]
    fn cni_names_follow_libcni() {
        for good in ["n", "net1", "k8s-pod-network", "a.b_c-d", "9"] {
            assert!(is_valid_cni_name(good), "{good}");
        }
        for bad in ["", "-net", ".net", "_net", "net/1", "net 1", "nét"] {
            assert!(!is_valid_cni_name(bad), "{bad}");
        }
    }

    /// The addresses a runtime asks for, through `args.cni.ips`, `runtimeConfig.ips` and the pod
    /// annotations: read when given, and `null` at any level is the key absent.
    #[test]
    fn requested_addresses_are_read_and_null_is_absent() {
        let conf = parse(json!({
            "args": {"cni": {"ips": ["10.0.0.5"]}},
            "runtimeConfig": {
                "ips": ["10.0.0.6/24"],
                POD_ANNOTATIONS_CAPABILITY: {ANNOTATION_IPV4_POOLS: "[\"pool-a\"]"}
            }
        }))
        .expect("parse");
        assert_eq!(conf.args_ips, Some(vec!["10.0.0.5".parse().expect("ip")]));
        assert_eq!(
            conf.runtime_ips,
            vec!["10.0.0.6".parse::<IpAddr>().expect("ip")]
        );
        assert_eq!(
            conf.pod_annotations.ipv4_pools,
            Some(vec!["pool-a".to_owned()])
        );
        for absent in [
            json!({"args": null, "runtimeConfig": null}),
            json!({"args": {"cni": null}, "runtimeConfig": {"ips": null, POD_ANNOTATIONS_CAPABILITY: null}}),
            json!({"args": {"cni": {"ips": null}}}),
        ] {
            let conf = parse(absent.clone()).expect("null is absent");
            assert_eq!(conf.args_ips, None, "{absent}");
            assert!(conf.runtime_ips.is_empty(), "{absent}");
            assert_eq!(conf.pod_annotations, PodAnnotations::default(), "{absent}");
        }
    }

    /// As in Calico: `ipAddrs` alone or pools alone, never both.
    #[test]
    fn pod_annotations_choose_addresses_or_pools_never_both() {
        let annotations =
            |pairs: Value| json!({"runtimeConfig": {POD_ANNOTATIONS_CAPABILITY: pairs}});
        let conf = parse(annotations(
            json!({ANNOTATION_IP_ADDRS: "[\"10.0.0.7\", \" fd00::7 \"]"}),
        ))
        .expect("addresses alone");
        assert_eq!(
            conf.pod_annotations.ip_addrs,
            Some(vec![
                "10.0.0.7".parse().expect("ip"),
                "fd00::7".parse().expect("ip")
            ])
        );
        let conf = parse(annotations(json!({
            ANNOTATION_IPV4_POOLS: "[\"a\"]",
            ANNOTATION_IPV6_POOLS: "[\" b \"]",
            "unrelated/annotation": 5
        })))
        .expect("pools of both families");
        assert_eq!(conf.pod_annotations.ipv4_pools, Some(vec!["a".to_owned()]));
        assert_eq!(conf.pod_annotations.ipv6_pools, Some(vec!["b".to_owned()]));
        for (pairs, shown) in [
            (
                json!({ANNOTATION_IP_ADDRS: "[\"10.0.0.7\"]", ANNOTATION_IPV4_POOLS: "[\"a\"]"}),
                "cannot be used together",
            ),
            (
                json!({ANNOTATION_IP_ADDRS: "[\"10.0.0.7\"]", ANNOTATION_IPV6_POOLS: "[\"b\"]"}),
                "cannot be used together",
            ),
            (
                json!({ANNOTATION_IP_ADDRS: "[\"ten\"]"}),
                "\"ten\" is not an IP address",
            ),
            (
                json!({ANNOTATION_IPV4_POOLS: "a"}),
                "is not a JSON list of strings",
            ),
            (json!({ANNOTATION_IPV4_POOLS: ["a"]}), "must be a string"),
        ] {
            let err = parse(annotations(pairs.clone())).expect_err("refused");
            assert_eq!(err.code, codes::INVALID_NETWORK_CONFIG, "{pairs}");
            assert!(err.msg.contains(shown), "{pairs}: {}", err.msg);
        }
    }

    #[test]
    fn routes_keep_their_gateway_of_the_same_family_and_an_empty_one_is_none() {
        let conf = parse(json!({"ipam": {"routes": [
            {"dst": "0.0.0.0/0"},
            {"dst": "192.168.0.0/16", "gw": " 10.0.0.254 "},
            {"dst": "fd01::/64", "gw": "fd00::1"},
            {"dst": "10.1.0.0/16", "gw": ""}
        ]}}))
        .expect("parse");
        let gw = |text: &str| Some(text.parse::<IpAddr>().expect("ip"));
        let routes: Vec<_> = conf
            .routes
            .expect("routes")
            .into_iter()
            .map(|route| (route.dst.to_string(), route.gw))
            .collect();
        assert_eq!(
            routes,
            [
                ("0.0.0.0/0".to_owned(), None),
                ("192.168.0.0/16".to_owned(), gw("10.0.0.254")),
                ("fd01::/64".to_owned(), gw("fd00::1")),
                ("10.1.0.0/16".to_owned(), None),
            ]
        );
        let err = parse(json!({"ipam": {"routes": [{"dst": "fd01::/64", "gw": "10.0.0.1"}]}}))
            .expect_err("a gateway of the other family");
        assert!(err.msg.contains("not of the same family"), "{}", err.msg);
    }

    /// GC's list of attachments to keep: read in order under either key; `null` is an empty
    /// list, a missing key no list at all.
    #[test]
    fn gc_attachments_are_read_under_either_key() {
        let attachment = |id: &str, ifname: &str| Attachment {
            container_id: id.to_owned(),
            ifname: ifname.to_owned(),
        };
        for key in ["cni.dev/valid-attachments", "cni.dev/attachments"] {
            let conf = parse(json!({ key: [
                {"containerID": "c1", "ifname": "eth0"},
                {"containerID": "c2", "ifname": "net1"}
            ]}))
            .expect(key);
            assert_eq!(
                conf.valid_attachments,
                Some(vec![attachment("c1", "eth0"), attachment("c2", "net1")]),
                "{key}"
            );
            let conf = parse(json!({ key: null })).expect(key);
            assert_eq!(conf.valid_attachments, Some(Vec::new()), "{key}");
            let err = parse(json!({ key: [{"containerID": "c1"}] })).expect_err(key);
            assert!(err.msg.contains(&format!("{key}[0].ifname")), "{}", err.msg);
        }
        assert_eq!(parse(json!({})).expect("parse").valid_attachments, None);
    }

    /// The netconf's `nodename`, else the node-name file's text trimmed.
    #[test]
    fn the_node_name_comes_from_the_netconf_then_the_node_name_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("nodename");
        std::fs::write(&file, "  Node-From-File\n").expect("write");
        let conf = parse(json!({"nodename": "node-a", "nodename_file": file})).expect("parse");
        assert_eq!(resolve_nodename(&conf).expect("name"), "node-a");
        let conf = parse(json!({"nodename_file": file})).expect("parse");
        assert_eq!(resolve_nodename(&conf).expect("name"), "Node-From-File");
    }
}
