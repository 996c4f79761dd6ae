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
    /// Fields this import does not know (e.g. `affinity_claim_time`), kept to be reported.
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
    /// Fields this import does not know (`alternateOwnerAttrs`, `releasedAt`, ...).
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
    /// Fields blockipam has no equivalent for (`ipCooldownSeconds`, `kubeVirtVMAddressPersistence`).
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
            ],
        );
        assert_eq!(snapshot.revision, 7);
        assert!(snapshot.config.as_ref().is_some_and(|c| c.strict_affinity));
        assert_eq!(snapshot.blocks.len(), 1);
        assert_eq!(snapshot.blocks[0].1.sequence_number, 3);
        assert_eq!(snapshot.affinities.len(), 2);
        assert!(snapshot.affinities[0].2.is_confirmed());
        assert!(!snapshot.affinities[1].2.is_confirmed());
        assert_eq!(snapshot.handles.len(), 1);
        assert_eq!(
            snapshot.unrecognised,
            ["/ipam/v2/assignment/ipv4/block/fd00::-122"]
        );
        assert_eq!(snapshot.unreadable.len(), 1);
        assert!(snapshot.unreadable[0].starts_with("/ipam/v2/handle/broken"));
    }
}
