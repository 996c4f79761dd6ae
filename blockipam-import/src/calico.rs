//! Calico's stored IPAM objects as an etcdv3 datastore holds them (JSON values under `/calico/`),
//! and the parse of one revision's raw key listing into them.
//!
//! Shapes follow projectcalico/calico `libcalico-go/lib/backend/model/` (`block.go`,
//! `block_affinity.go`, `ipam_handle.go`, `ipam_config.go`) and `api/pkg/apis/projectcalico/v3/`
//! (`ippool.go`, `ipreservation.go`). Go marshals a nil slice or map as `null`, so every list and
//! map here accepts `null` as empty.

use std::collections::BTreeMap;

use ipam_core::model::keys::parse_cidr_segment;
use ipnet::IpNet;
use serde::Deserialize;
use serde_json::Value;

/// Path of the IP pools below the Calico prefix.
pub const POOLS_DIR: &str = "/resources/v3/projectcalico.org/ippools/";
/// Path of the IP reservations below the Calico prefix.
pub const RESERVATIONS_DIR: &str = "/resources/v3/projectcalico.org/ipreservations/";
/// Path of the Calico Node resources below the Calico prefix (their labels select pools).
pub const NODES_DIR: &str = "/resources/v3/projectcalico.org/nodes/";
/// Path of every IPAM object (config, blocks, affinities, handles) below the Calico prefix.
pub const IPAM_DIR: &str = "/ipam/v2/";
/// Path of the IPAM configuration below the Calico prefix.
pub const CONFIG_KEY: &str = "/ipam/v2/config";

/// An allocation block (`/calico/ipam/v2/assignment/ipv4|ipv6/block/<cidr>`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CalicoBlock {
    /// The block's CIDR.
    pub cidr: String,
    /// `host:<node>`, `virtual:<name>`, or none.
    #[serde(default)]
    pub affinity: Option<String>,
    /// Deprecated form of the affinity: the bare host name.
    #[serde(default, rename = "hostAffinity")]
    pub host_affinity: Option<String>,
    /// One entry per ordinal: `null` when free, else an index into `attributes`.
    #[serde(default)]
    pub allocations: Option<Vec<Option<i64>>>,
    /// The free ordinals, in reuse order.
    #[serde(default)]
    pub unallocated: Option<Vec<i64>>,
    /// Who holds the allocated ordinals.
    #[serde(default)]
    pub attributes: Option<Vec<CalicoAttribute>>,
    /// Bumped on every write of the block.
    #[serde(default, rename = "sequenceNumber")]
    pub sequence_number: u64,
    /// The block's sequence number when each ordinal (a decimal string) was allocated.
    #[serde(default, rename = "sequenceNumberForAllocation")]
    pub sequence_number_for_allocation: Option<BTreeMap<String, u64>>,
    /// Set by the Kubernetes datastore just before a deletion; such a block is gone.
    #[serde(default)]
    pub deleted: bool,
    /// When the host claimed the block (Go's `metav1.Time`, RFC 3339; Calico v3.32+, absent on
    /// older blocks).
    #[serde(default)]
    pub affinity_claim_time: Option<String>,
    /// Fields this import does not know, kept to be reported.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// One entry of a block's attribute table.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CalicoAttribute {
    /// The handle (`<network>.<container id>` for pods).
    #[serde(default)]
    pub handle_id: Option<String>,
    /// Metadata: `node`, `pod`, `namespace`, `timestamp`, `type`, `service`.
    #[serde(default)]
    pub secondary: Option<BTreeMap<String, String>>,
    /// Set when the ordinals pointing here were released into IP cooldown (Go's `metav1.Time`,
    /// RFC 3339): they are neither free nor in use until `ipCooldownSeconds` have passed.
    #[serde(default, rename = "releasedAt")]
    pub released_at: Option<String>,
    /// Fields this import does not know (`alternateOwnerAttrs`, ...).
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// A block affinity (`/calico/ipam/v2/host/<node>/ipv4|ipv6/block/<cidr>`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
pub struct CalicoAffinity {
    /// `confirmed`, `pending` or `pendingDeletion`; empty counts as confirmed.
    #[serde(default)]
    pub state: Option<String>,
    /// Set by the Kubernetes datastore just before a deletion.
    #[serde(default)]
    pub deleted: bool,
}

impl CalicoAffinity {
    /// True when the affinity is real ownership (state `confirmed`, empty or missing).
    pub fn is_confirmed(&self) -> bool {
        matches!(self.state.as_deref(), None | Some("") | Some("confirmed")) && !self.deleted
    }

    /// The state as Calico names it (`confirmed` when empty).
    pub fn state_name(&self) -> &str {
        match self.state.as_deref() {
            None | Some("") => "confirmed",
            Some(state) => state,
        }
    }
}

/// A handle (`/calico/ipam/v2/handle/<id>`): addresses held per block CIDR.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
pub struct CalicoHandle {
    /// Addresses held per block CIDR (`10.0.0.0/26`).
    #[serde(default)]
    pub block: Option<BTreeMap<String, i64>>,
    /// Set by the Kubernetes datastore just before a deletion.
    #[serde(default)]
    pub deleted: bool,
}

/// The IPAM configuration (`/calico/ipam/v2/config`); Go omits fields that are false or zero.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
pub struct CalicoIpamConfig {
    /// Never borrow from other hosts' blocks.
    #[serde(default)]
    pub strict_affinity: bool,
    /// Claim new blocks when needed (omitted, so false, when false).
    #[serde(default)]
    pub auto_allocate_blocks: bool,
    /// Most blocks per host; 0 means 20 in Calico.
    #[serde(default, rename = "maxBlocksPerHost")]
    pub max_blocks_per_host: i64,
    /// Seconds a released address stays in cooldown; 0 or negative means none.
    #[serde(default, rename = "ipCooldownSeconds")]
    pub ip_cooldown_seconds: i64,
    /// Fields blockipam has no equivalent for (`kubeVirtVMAddressPersistence`, ...).
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// Object metadata of a v3 resource (only the name is used).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
pub struct CalicoMetadata {
    /// The resource's name.
    #[serde(default)]
    pub name: String,
}

/// An IP pool resource (`/calico/resources/v3/projectcalico.org/ippools/<name>`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CalicoPool {
    /// Name and identity.
    #[serde(default)]
    pub metadata: CalicoMetadata,
    /// The pool itself.
    pub spec: CalicoPoolSpec,
}

/// The spec of an IP pool.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CalicoPoolSpec {
    /// The pool's network.
    pub cidr: String,
    /// Block prefix length; 0 or missing means 26 (IPv4) or 122 (IPv6).
    #[serde(default, rename = "blockSize")]
    pub block_size: i64,
    /// No assignment from a disabled pool.
    #[serde(default)]
    pub disabled: bool,
    /// Everything else (`nodeSelector`, `ipipMode`, `vxlanMode`, `natOutgoing`, ...).
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// A Calico Node resource (`/calico/resources/v3/projectcalico.org/nodes/<name>`): only its labels
/// are read, since pools' node selectors are evaluated against them.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
pub struct CalicoNode {
    /// Name and labels.
    #[serde(default)]
    pub metadata: CalicoNodeMetadata,
}

/// The metadata of a Calico Node.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
pub struct CalicoNodeMetadata {
    /// The node's labels (Kubernetes labels, copied by Calico from the Kubernetes node).
    #[serde(default)]
    pub labels: Option<BTreeMap<String, String>>,
}

/// An IP reservation resource (`/calico/resources/v3/projectcalico.org/ipreservations/<name>`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CalicoReservation {
    /// Name and identity.
    #[serde(default)]
    pub metadata: CalicoMetadata,
    /// The reserved ranges.
    #[serde(default)]
    pub spec: CalicoReservationSpec,
}

/// The spec of an IP reservation.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
pub struct CalicoReservationSpec {
    /// CIDRs or single addresses excluded from automatic assignment.
    #[serde(default, rename = "reservedCIDRs")]
    pub reserved_cidrs: Option<Vec<String>>,
}

/// One key and value as read from etcd, the key relative to the Calico prefix (`/ipam/v2/config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawEntry {
    /// The key below the prefix, starting with `/`.
    pub key: String,
    /// The stored JSON.
    pub value: Vec<u8>,
}

/// Everything read from one Calico datastore at one etcd revision, parsed.
#[derive(Debug, Clone, Default)]
pub struct CalicoSnapshot {
    /// The etcd revision every object was read at.
    pub revision: i64,
    /// IP pools, by key name.
    pub pools: Vec<(String, CalicoPool)>,
    /// The IPAM configuration, when stored.
    pub config: Option<CalicoIpamConfig>,
    /// Blocks, with the CIDR their key names.
    pub blocks: Vec<(IpNet, CalicoBlock)>,
    /// Affinities: host, block CIDR, state.
    pub affinities: Vec<(String, IpNet, CalicoAffinity)>,
    /// Handles, by id.
    pub handles: Vec<(String, CalicoHandle)>,
    /// IP reservations, by key name.
    pub reservations: Vec<(String, CalicoReservation)>,
    /// Calico Nodes, by key name.
    pub nodes: Vec<(String, CalicoNode)>,
    /// Keys read that are none of the above (reported, never imported).
    pub unrecognised: Vec<String>,
    /// Values that could not be parsed: `key: why`. Any makes the import refuse.
    pub unreadable: Vec<String>,
}

impl CalicoSnapshot {
    /// Sorts raw entries into objects. A value that does not parse lands in `unreadable`.
    pub fn parse(revision: i64, entries: &[RawEntry]) -> CalicoSnapshot {
        let mut snapshot = CalicoSnapshot {
            revision,
            ..CalicoSnapshot::default()
        };
        for entry in entries {
            snapshot.add(entry);
        }
        snapshot
    }

    fn add(&mut self, entry: &RawEntry) {
        let key = entry.key.as_str();
        let value = entry.value.as_slice();
        if let Some(name) = key.strip_prefix(POOLS_DIR) {
            if let Some(pool) = self.json(key, value) {
                self.pools.push((name.to_owned(), pool));
            }
        } else if let Some(name) = key.strip_prefix(NODES_DIR) {
            if let Some(node) = self.json(key, value) {
                self.nodes.push((name.to_owned(), node));
            }
        } else if let Some(name) = key.strip_prefix(RESERVATIONS_DIR) {
            if let Some(reservation) = self.json(key, value) {
                self.reservations.push((name.to_owned(), reservation));
            }
        } else if key == CONFIG_KEY {
            self.config = self.json(key, value);
        } else if let Some(rest) = key.strip_prefix("/ipam/v2/assignment/") {
            match block_cidr(rest) {
                Some(cidr) => {
                    if let Some(block) = self.json(key, value) {
                        self.blocks.push((cidr, block));
                    }
                }
                None => self.unrecognised.push(key.to_owned()),
            }
        } else if let Some(rest) = key.strip_prefix("/ipam/v2/host/") {
            match affinity_key(rest) {
                Some((host, cidr)) => {
                    // An empty value counts as a confirmed affinity (Calico's own parser).
                    let affinity = if value.iter().all(u8::is_ascii_whitespace) {
                        Some(CalicoAffinity::default())
                    } else {
                        self.json(key, value)
                    };
                    if let Some(affinity) = affinity {
                        self.affinities.push((host.to_owned(), cidr, affinity));
                    }
                }
                None => self.unrecognised.push(key.to_owned()),
            }
        } else if let Some(id) = key.strip_prefix("/ipam/v2/handle/") {
            if id.is_empty() || id.contains('/') {
                self.unrecognised.push(key.to_owned());
            } else if let Some(handle) = self.json(key, value) {
                self.handles.push((id.to_owned(), handle));
            }
        } else {
            self.unrecognised.push(key.to_owned());
        }
    }

    fn json<T: serde::de::DeserializeOwned>(&mut self, key: &str, value: &[u8]) -> Option<T> {
        match serde_json::from_slice(value) {
            Ok(parsed) => Some(parsed),
            Err(e) => {
                self.unreadable
                    .push(format!("{key}: not a Calico object of this kind: {e}"));
                None
            }
        }
    }
}

/// A Calico time (Go's `metav1.Time`: RFC 3339, `2026-01-01T00:00:00Z`, fractional seconds and
/// a `+hh:mm` offset accepted as Go's `time.Parse(time.RFC3339, ...)` does) in whole seconds since
/// the Unix epoch: a fraction rounds up (a cooldown never ends earlier than Calico's would), a
/// time before the epoch counts as the epoch.
///
/// # Errors
/// Why the text is not such a time.
pub fn parse_calico_time(text: &str) -> Result<u64, String> {
    let bad = |why: &str| format!("{text:?} is not an RFC 3339 time ({why})");
    let bytes = text.as_bytes();
    let digits = |range: std::ops::Range<usize>| -> Result<i64, String> {
        let part = bytes.get(range).ok_or_else(|| bad("too short"))?;
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return Err(bad("a digit was expected"));
        }
        Ok(part.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0')))
    };
    let separator = |at: usize, expected: u8| -> Result<(), String> {
        match bytes.get(at) {
            Some(found) if *found == expected => Ok(()),
            _ => Err(bad(&format!("{:?} expected at {at}", expected as char))),
        }
    };
    let (year, month, day) = (digits(0..4)?, digits(5..7)?, digits(8..10)?);
    separator(4, b'-')?;
    separator(7, b'-')?;
    separator(10, b'T')?;
    let (hour, minute, second) = (digits(11..13)?, digits(14..16)?, digits(17..19)?);
    separator(13, b':')?;
    separator(16, b':')?;
    let mut rest = &bytes[19..];
    let mut fraction = false;
    if let Some(after_dot) = rest.strip_prefix(b".") {
        let count = after_dot.iter().take_while(|b| b.is_ascii_digit()).count();
        if count == 0 {
            return Err(bad("digits expected after the decimal point"));
        }
        fraction = after_dot[..count].iter().any(|d| *d != b'0');
        rest = &after_dot[count..];
    }
    let offset_seconds = match rest {
        b"Z" => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let two = |a: u8, b: u8| -> Result<i64, String> {
                if a.is_ascii_digit() && b.is_ascii_digit() {
                    Ok(i64::from(a - b'0') * 10 + i64::from(b - b'0'))
                } else {
                    Err(bad("a digit was expected in the offset"))
                }
            };
            let (hours, minutes) = (two(*h1, *h2)?, two(*m1, *m2)?);
            // Go's range test: "some people do write offsets of 24 hours or 60 minutes".
            if hours > 24 || minutes > 60 {
                return Err(bad("offset out of range"));
            }
            let magnitude = hours * 3600 + minutes * 60;
            if *sign == b'+' {
                magnitude
            } else {
                -magnitude
            }
        }
        _ => return Err(bad("`Z` or a `+hh:mm` offset expected at the end")),
    };
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let days_in_month = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return Err(bad("month out of range")),
    };
    if day < 1 || day > days_in_month || hour > 23 || minute > 59 || second > 59 {
        return Err(bad("day or time of day out of range"));
    }
    // Days from 1970-01-01 to the date (proleptic Gregorian calendar).
    let shifted_year = if month <= 2 { year - 1 } else { year };
    let era = shifted_year.div_euclid(400);
    let year_of_era = shifted_year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    let seconds =
        days * 86_400 + hour * 3600 + minute * 60 + second - offset_seconds + i64::from(fraction);
    Ok(u64::try_from(seconds).unwrap_or(0))
}

/// `ipv4/block/10.0.0.0-26` → the CIDR (the family segment must match it).
fn block_cidr(rest: &str) -> Option<IpNet> {
    let (family, segment) = rest.split_once("/block/")?;
    let cidr = parse_cidr_segment(segment)?;
    family_matches(family, &cidr).then_some(cidr)
}

/// `<host>/ipv4/block/10.0.0.0-26` → host and CIDR.
fn affinity_key(rest: &str) -> Option<(&str, IpNet)> {
    let (host, tail) = rest.split_once('/')?;
    let cidr = block_cidr(tail)?;
    (!host.is_empty()).then_some((host, cidr))
}

fn family_matches(segment: &str, cidr: &IpNet) -> bool {
    matches!(
        (segment, cidr),
        ("ipv4", IpNet::V4(_)) | ("ipv6", IpNet::V6(_))
    )
}

/// Calico's key segment for a CIDR: `10.0.0.0/26` → `10.0.0.0-26`.
pub fn cidr_segment(cidr: &IpNet) -> String {
    format!("{}-{}", cidr.network(), cidr.prefix_len())
}

/// `ipv4` or `ipv6`, as in Calico's keys.
pub fn family_segment(cidr: &IpNet) -> &'static str {
    match cidr {
        IpNet::V4(_) => "ipv4",
        IpNet::V6(_) => "ipv6",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, value: &str) -> RawEntry {
        RawEntry {
            key: key.to_owned(),
            value: value.as_bytes().to_vec(),
        }
    }

    #[test]
    fn calico_times_read_as_go_writes_and_parses_them() {
        assert_eq!(parse_calico_time("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(parse_calico_time("2026-01-01T00:00:00Z"), Ok(1_767_225_600));
        assert_eq!(parse_calico_time("2024-02-29T12:30:15Z"), Ok(1_709_209_815));
        assert_eq!(
            parse_calico_time("2026-01-01T02:00:00+02:00"),
            Ok(1_767_225_600)
        );
        assert_eq!(
            parse_calico_time("2025-12-31T23:30:00-00:30"),
            Ok(1_767_225_600)
        );
        assert_eq!(
            parse_calico_time("2026-01-01T00:00:00.000Z"),
            Ok(1_767_225_600)
        );
        assert_eq!(
            parse_calico_time("2026-01-01T00:00:00.25Z"),
            Ok(1_767_225_601),
            "a fraction rounds up"
        );
        assert_eq!(parse_calico_time("1969-12-31T23:59:59Z"), Ok(0));
        // Leap years as the Gregorian calendar counts them; months of 30 days and February.
        assert_eq!(parse_calico_time("2000-02-29T00:00:00Z"), Ok(951_782_400));
        assert_eq!(parse_calico_time("2026-02-28T00:00:00Z"), Ok(1_772_236_800));
        assert_eq!(parse_calico_time("2026-04-30T00:00:00Z"), Ok(1_777_507_200));
        // Go takes offsets of up to 24 hours and 60 minutes.
        assert_eq!(
            parse_calico_time("2026-01-02T00:00:00+24:00"),
            Ok(1_767_225_600)
        );
        assert_eq!(
            parse_calico_time("2026-01-01T01:00:00+00:60"),
            Ok(1_767_225_600)
        );
        for bad in [
            "",
            "2026-01-01",
            "2026-01-01 00:00:00Z",
            "2026-01-01T00:00:00",
            "2026-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-01-01T24:00:00Z",
            "2026-01-01T00:00:00.Z",
            "2026-01-01T00:00:00+0200",
            "2026-01-01T00:00:00z",
            "202X-01-01T00:00:00Z",
            "1900-02-29T00:00:00Z",
            "2100-02-29T00:00:00Z",
            "2026-04-31T00:00:00Z",
            "2026-01-00T00:00:00Z",
            "2026-01-32T00:00:00Z",
            "2026-01-01T00:60:00Z",
            "2026-01-01T00:00:60Z",
            "2026-01-01T00:00:00+25:00",
            "2026-01-01T00:00:00+00:61",
            "2026-01-01T00:00:00+0a:00",
            "2026-01-01T00:00:00+0::00",
        ] {
            assert!(parse_calico_time(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn key_segments_are_calicos() {
        let v4: IpNet = "10.0.0.64/26".parse().expect("cidr");
        let v6: IpNet = "fd00::40/122".parse().expect("cidr");
        assert_eq!(
            (family_segment(&v4), cidr_segment(&v4)),
            ("ipv4", "10.0.0.64-26".to_owned())
        );
        assert_eq!(
            (family_segment(&v6), cidr_segment(&v6)),
            ("ipv6", "fd00::40-122".to_owned())
        );
        assert_eq!(block_cidr("ipv6/block/fd00::40-122"), Some(v6));
    }

    #[test]
    fn keys_sort_into_objects_and_strangers_are_kept_for_the_report() {
        let snapshot = CalicoSnapshot::parse(
            7,
            &[
                entry("/ipam/v2/config", r#"{"strict_affinity":true}"#),
                entry(
                    "/ipam/v2/assignment/ipv6/block/fd00::-122",
                    r#"{"cidr":"fd00::/122","affinity":null,"allocations":null,"unallocated":null,"attributes":null,"sequenceNumber":3,"sequenceNumberForAllocation":null,"deleted":false}"#,
                ),
                entry("/ipam/v2/host/node-1/ipv6/block/fd00::-122", ""),
                entry(
                    "/ipam/v2/host/node-2/ipv4/block/10.0.0.0-26",
                    r#"{"state":"pending","deleted":false}"#,
                ),
                entry(
                    "/ipam/v2/handle/k8s-pod-network.abc",
                    r#"{"block":{"fd00::/122":1},"deleted":false}"#,
                ),
                entry("/ipam/v2/assignment/ipv4/block/fd00::-122", "{}"),
                entry("/ipam/v2/handle/broken", "{not json"),
                entry("/ipam/v2/handle/", r#"{"block":{},"deleted":false}"#),
                entry("/ipam/v2/host//ipv4/block/10.0.0.0-26", ""),
                entry("/ipam/v2/handle/a/b", r#"{"block":{},"deleted":false}"#),
            ],
        );
        assert_eq!(snapshot.revision, 7);
        assert!(snapshot.config.as_ref().is_some_and(|c| c.strict_affinity));
        assert_eq!(snapshot.blocks.len(), 1);
        assert_eq!(snapshot.blocks[0].1.sequence_number, 3);
        assert_eq!(snapshot.affinities.len(), 2);
        assert_eq!(
            snapshot
                .affinities
                .iter()
                .map(|(host, cidr, affinity)| (
                    host.as_str(),
                    cidr.to_string(),
                    affinity.state_name()
                ))
                .collect::<Vec<_>>(),
            [
                ("node-1", "fd00::/122".to_owned(), "confirmed"),
                ("node-2", "10.0.0.0/26".to_owned(), "pending")
            ]
        );
        assert!(snapshot.affinities[0].2.is_confirmed());
        assert!(!snapshot.affinities[1].2.is_confirmed());
        assert_eq!(snapshot.handles.len(), 1);
        assert_eq!(
            snapshot.unrecognised,
            [
                "/ipam/v2/assignment/ipv4/block/fd00::-122",
                "/ipam/v2/handle/",
                "/ipam/v2/host//ipv4/block/10.0.0.0-26",
                "/ipam/v2/handle/a/b"
            ]
        );
        assert_eq!(snapshot.unreadable.len(), 1);
        assert!(snapshot.unreadable[0].starts_with("/ipam/v2/handle/broken"));
    }
}
