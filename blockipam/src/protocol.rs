//! The CNI wire protocol: spec versions, error codes, error JSON and result shapes.
//!
//! The CNI wire protocol: spec versions, error codes and error JSON, and the IPAM result in the
//! shape each spec version expects (legacy `ip4`/`ip6` for 0.1.0/0.2.0, `ips` from 0.3.0 on).

use std::net::IpAddr;

use ipnet::IpNet;
use serde::Serialize;
use serde_json::Value;

/// Every CNI spec version this plugin speaks, oldest first.
pub const SUPPORTED_VERSIONS: [&str; 7] = [
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// The newest spec version supported (what VERSION reports as its own `cniVersion`).
pub const CURRENT_VERSION: &str = "1.1.0";

/// Spec error codes (1–99 are reserved by the spec) and blockipam's own (100 and up).
pub mod codes {
    /// Incompatible CNI version.
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    /// Unsupported field in network configuration (the message names key and value).
    pub const UNSUPPORTED_FIELD: u32 = 2;
    /// Invalid or missing environment variables (the message names them).
    pub const INVALID_ENVIRONMENT: u32 = 4;
    /// I/O failure.
    pub const IO_FAILURE: u32 = 5;
    /// Failed to decode content (stdin is not JSON, or a spec key has the wrong type).
    pub const DECODING_FAILURE: u32 = 6;
    /// Invalid network configuration.
    pub const INVALID_NETWORK_CONFIG: u32 = 7;
    /// Try again later (store unreachable, lock wait or retries exhausted, deadline passed).
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// STATUS: the plugin cannot serve ADD requests.
    pub const PLUGIN_NOT_AVAILABLE: u32 = 50;
    /// No free address in the candidate pools.
    pub const POOL_EXHAUSTED: u32 = 100;
    /// The node owns `max_blocks_per_host` blocks and they are full.
    pub const BLOCK_LIMIT_REACHED: u32 = 101;
    /// A requested address is held by someone else.
    pub const ADDRESS_IN_USE: u32 = 102;
    /// A requested address lies in no enabled pool.
    pub const ADDRESS_NOT_IN_POOL: u32 = 103;
    /// Strict affinity forbids using an address in another node's block.
    pub const AFFINITY_CONFLICT: u32 = 104;
    /// A pool named in `ipv4_pools` / `ipv6_pools` is missing, disabled or of the other family.
    pub const POOL_UNUSABLE: u32 = 105;
    /// A pool in the netconf's `pools` clashes with a different existing pool.
    pub const POOL_CONFLICT: u32 = 106;
    /// CHECK: an address of the attachment is not (or no longer) held by it.
    pub const CHECK_FAILED: u32 = 107;
    /// The store holds data this plugin cannot decode.
    pub const STORE_CORRUPT: u32 = 108;
    /// Enabled pools of the family exist, but none that auto-assign may use on this node (node
    /// selectors, manual pools, allowed uses).
    pub const NO_POOL_FOR_NODE: u32 = 109;
    /// A bug or an unexpected failure.
    pub const INTERNAL: u32 = 999;
}

/// A CNI error: printed as the spec's JSON on stdout, with a non-zero exit status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CNI error {code}: {msg}{}", if details.is_empty() { String::new() } else { format!(" ({details})") })]
pub struct CniError {
    /// The spec or plugin error code.
    pub code: u32,
    /// A short message.
    pub msg: String,
    /// More detail (may be empty).
    pub details: String,
}

impl CniError {
    /// An error with a message and no details.
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    /// An error with a message and details.
    pub fn with_details(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    /// Code 7 with a message.
    pub fn config(msg: impl Into<String>) -> Self {
        Self::new(codes::INVALID_NETWORK_CONFIG, msg)
    }

    /// The spec's error JSON: `{"cniVersion", "code", "msg", "details"}`.
    pub fn to_json(&self, cni_version: &str) -> Value {
        #[derive(Serialize)]
        struct Wire<'a> {
            #[serde(rename = "cniVersion")]
            cni_version: &'a str,
            code: u32,
            msg: &'a str,
            details: &'a str,
        }
        serde_json::to_value(Wire {
            cni_version,
            code: self.code,
            msg: &self.msg,
            details: &self.details,
        })
        .unwrap_or(Value::Null)
    }
}

/// A parsed `major.minor.patch` spec version, ordered numerically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SpecVersion(pub u32, pub u32, pub u32);

impl SpecVersion {
    /// Parses `X.Y.Z`.
    ///
    /// # Errors
    /// A message when the text is not three dot-separated numbers.
    pub fn parse(text: &str) -> Result<Self, String> {
        let parts: Vec<&str> = text.split('.').collect();
        if parts.len() != 3 {
            return Err(format!(
                "version {text:?} is not of the form major.minor.patch"
            ));
        }
        let mut numbers = [0u32; 3];
        for (slot, part) in numbers.iter_mut().zip(&parts) {
            *slot = part
                .parse()
                .map_err(|_| format!("version {text:?} is not of the form major.minor.patch"))?;
        }
        Ok(SpecVersion(numbers[0], numbers[1], numbers[2]))
    }

    /// True for the legacy result shape (`ip4` / `ip6`).
    pub fn is_legacy(self) -> bool {
        self < SpecVersion(0, 3, 0)
    }

    /// True when each IP carries a `"version"` field (0.3.x and 0.4.0).
    pub fn has_ip_version_field(self) -> bool {
        self >= SpecVersion(0, 3, 0) && self < SpecVersion(1, 0, 0)
    }
}

/// True when `version` is one of [`SUPPORTED_VERSIONS`] (exact match, as libcni compares).
pub fn is_supported(version: &str) -> bool {
    SUPPORTED_VERSIONS.contains(&version)
}

/// The VERSION answer.
pub fn version_info() -> Value {
    serde_json::json!({
        "cniVersion": CURRENT_VERSION,
        "supportedVersions": SUPPORTED_VERSIONS,
    })
}

/// One address of an IPAM result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultIp {
    /// The address with the prefix length the main plugin should configure.
    pub address: IpNet,
    /// The gateway for it, if one was configured inside its pool.
    pub gateway: Option<IpAddr>,
}

/// One route of an IPAM result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultRoute {
    /// Destination.
    pub dst: IpNet,
    /// Next hop; the main plugin uses the family's gateway when absent.
    pub gw: Option<IpAddr>,
}

/// What an IPAM ADD hands back, independent of spec version.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpamResult {
    /// Addresses, IPv4 first.
    pub ips: Vec<ResultIp>,
    /// Routes.
    pub routes: Vec<ResultRoute>,
}

#[derive(Serialize)]
struct WireRoute {
    dst: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    gw: Option<String>,
}

impl From<&ResultRoute> for WireRoute {
    fn from(route: &ResultRoute) -> Self {
        WireRoute {
            dst: route.dst.to_string(),
            gw: route.gw.map(|g| g.to_string()),
        }
    }
}

#[derive(Serialize)]
struct Dns {}

#[derive(Serialize)]
struct WireIp {
    #[serde(skip_serializing_if = "Option::is_none")]
    version: Option<&'static str>,
    address: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    gateway: Option<String>,
}

#[derive(Serialize)]
struct CurrentResult<'a> {
    #[serde(rename = "cniVersion")]
    cni_version: &'a str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    ips: Vec<WireIp>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    routes: Vec<WireRoute>,
    dns: Dns,
}

#[derive(Serialize)]
struct LegacyIpConfig {
    ip: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    gateway: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    routes: Vec<WireRoute>,
}

#[derive(Serialize)]
struct LegacyResult<'a> {
    #[serde(rename = "cniVersion")]
    cni_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    ip4: Option<LegacyIpConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ip6: Option<LegacyIpConfig>,
    dns: Dns,
}

impl IpamResult {
    /// The result in the shape of spec `version` (which must be supported), with
    /// `cniVersion` equal to it.
    pub fn render(&self, version: &str) -> Value {
        let spec = SpecVersion::parse(version).unwrap_or(SpecVersion(1, 1, 0));
        let value = if spec.is_legacy() {
            // 0.1.0 / 0.2.0 hold one address per family, routes inside it; as libcni converts,
            // the first address of each family wins.
            let legacy = |v4: bool| {
                let ip = self.ips.iter().find(|i| i.address.addr().is_ipv4() == v4)?;
                Some(LegacyIpConfig {
                    ip: ip.address.to_string(),
                    gateway: ip.gateway.map(|g| g.to_string()),
                    routes: self
                        .routes
                        .iter()
                        .filter(|r| r.dst.addr().is_ipv4() == v4)
                        .map(WireRoute::from)
                        .collect(),
                })
            };
            serde_json::to_value(LegacyResult {
                cni_version: version,
                ip4: legacy(true),
                ip6: legacy(false),
                dns: Dns {},
            })
        } else {
            let with_version = spec.has_ip_version_field();
            serde_json::to_value(CurrentResult {
                cni_version: version,
                ips: self
                    .ips
                    .iter()
                    .map(|ip| WireIp {
                        version: with_version.then_some(if ip.address.addr().is_ipv4() {
                            "4"
                        } else {
                            "6"
                        }),
                        address: ip.address.to_string(),
                        gateway: ip.gateway.map(|g| g.to_string()),
                    })
                    .collect(),
                routes: self.routes.iter().map(WireRoute::from).collect(),
                dns: Dns {},
            })
        };
        value.unwrap_or(Value::Null)
    }
}

/// The addresses listed in a `prevResult` of any spec version (`ips[].address`, or the legacy
/// `ip4.ip` / `ip6.ip`), without their prefix lengths.
///
/// # Errors
/// Code 6 when an address is not a string or does not parse.
pub fn prev_result_addresses(prev: &Value) -> Result<Vec<IpAddr>, CniError> {
    let mut found = Vec::new();
    let mut take = |where_: &str, value: &Value| -> Result<(), CniError> {
        let text = value.as_str().ok_or_else(|| {
            CniError::new(
                codes::DECODING_FAILURE,
                format!("prevResult {where_} must be a string, found {value}"),
            )
        })?;
        found.push(parse_ip_maybe_prefixed(text).map_err(|e| {
            CniError::new(
                codes::DECODING_FAILURE,
                format!("prevResult {where_} {text:?}: {e}"),
            )
        })?);
        Ok(())
    };
    if let Some(ips) = prev.get("ips") {
        let list = ips.as_array().ok_or_else(|| {
            CniError::new(codes::DECODING_FAILURE, "prevResult ips must be a list")
        })?;
        for (i, ip) in list.iter().enumerate() {
            let address = ip.get("address").unwrap_or(&Value::Null);
            take(&format!("ips[{i}].address"), address)?;
        }
    }
    for family in ["ip4", "ip6"] {
        if let Some(config) = prev.get(family).filter(|v| !v.is_null()) {
            take(
                &format!("{family}.ip"),
                config.get("ip").unwrap_or(&Value::Null),
            )?;
        }
    }
    Ok(found)
}

/// Parses `10.0.0.5` or `10.0.0.5/24` (the prefix length is dropped).
///
/// # Errors
/// A message when neither form parses.
pub fn parse_ip_maybe_prefixed(text: &str) -> Result<IpAddr, String> {
    let text = text.trim();
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(ip);
    }
    text.parse::<IpNet>()
        .map(|net| net.addr())
        .map_err(|_| format!("{text:?} is not an IP address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_order_numerically_and_reject_garbage() {
        assert!(SpecVersion::parse("0.10.0").expect("v") > SpecVersion::parse("0.4.0").expect("v"));
        assert!(SpecVersion::parse("1.0").is_err());
        assert!(SpecVersion::parse("a.b.c").is_err());
        assert!(SpecVersion(0, 2, 0).is_legacy());
        assert!(!SpecVersion(0, 3, 0).is_legacy());
        assert!(SpecVersion(0, 4, 0).has_ip_version_field());
        assert!(!SpecVersion(1, 0, 0).has_ip_version_field());
    }

    #[test]
    fn legacy_result_keeps_first_address_per_family_with_its_routes() {
        let result = IpamResult {
            ips: vec![
                ResultIp {
                    address: "10.0.0.5/26".parse().expect("net"),
                    gateway: None,
                },
                ResultIp {
                    address: "10.0.0.6/26".parse().expect("net"),
                    gateway: None,
                },
                ResultIp {
                    address: "fd00::5/122".parse().expect("net"),
                    gateway: None,
                },
            ],
            routes: vec![ResultRoute {
                dst: "10.0.0.0/26".parse().expect("net"),
                gw: None,
            }],
        };
        assert_eq!(
            result.render("0.2.0"),
            serde_json::json!({
                "cniVersion": "0.2.0",
                "ip4": {"ip": "10.0.0.5/26", "routes": [{"dst": "10.0.0.0/26"}]},
                "ip6": {"ip": "fd00::5/122"},
                "dns": {}
            })
        );
    }

    #[test]
    fn prev_result_addresses_come_from_ips_or_legacy_fields() {
        let prev =
            serde_json::json!({"ips": [{"address": "10.0.0.5/24"}], "ip6": {"ip": "fd00::1/64"}});
        assert_eq!(
            prev_result_addresses(&prev).expect("parse"),
            vec![
                "10.0.0.5".parse::<IpAddr>().expect("ip"),
                "fd00::1".parse::<IpAddr>().expect("ip")
            ]
        );
        let bad = serde_json::json!({"ips": [{"address": 5}]});
        assert_eq!(
            prev_result_addresses(&bad).expect_err("bad").code,
            codes::DECODING_FAILURE
        );
    }

    /// libcni compares versions as text: only the exact names are supported.
    #[test]
    fn supported_versions_are_exact_names_and_version_answers_with_them() {
        for version in SUPPORTED_VERSIONS {
            assert!(is_supported(version), "{version}");
        }
        for other in ["", "1.0", "1.2.0", " 1.0.0", "v1.0.0", "0.5.0"] {
            assert!(!is_supported(other), "{other:?}");
        }
        assert_eq!(
            version_info(),
            serde_json::json!({"cniVersion": "1.1.0", "supportedVersions": SUPPORTED_VERSIONS})
        );
    }

    #[test]
    fn an_error_is_the_specs_four_keys() {
        let error = CniError::with_details(codes::TRY_AGAIN_LATER, "etcd is down", "after 3 tries");
        assert_eq!(
            error.to_json("1.0.0"),
            serde_json::json!({
                "cniVersion": "1.0.0",
                "code": 11,
                "msg": "etcd is down",
                "details": "after 3 tries"
            })
        );
    }
}
