//! Builders of Calico-format objects, as Calico's etcdv3 backend
//! stores them (JSON shapes of libcalico-go `model.AllocationBlock`, `BlockAffinity`, `IPAMHandle`,
//! `IPAMConfig` and the v3 `IPPool` / `IPReservation` resources), and a writer putting them into a
//! real etcd under a test's own prefix.

use std::collections::BTreeMap;

use ipnet::IpNet;
use serde_json::{json, Value};

use blockipam_import::calico::{
    cidr_segment, family_segment, RawEntry, CONFIG_KEY, NODES_DIR, POOLS_DIR, RESERVATIONS_DIR,
};

/// A Calico allocation block under construction.
#[derive(Debug, Clone)]
pub struct CalicoBlockBuilder {
    cidr: IpNet,
    affinity: Option<String>,
    allocations: Vec<Option<usize>>,
    attributes: Vec<Value>,
    unallocated: Vec<usize>,
    sequence: u64,
    sequence_for: BTreeMap<usize, u64>,
    extra: BTreeMap<String, Value>,
}

impl CalicoBlockBuilder {
    /// An empty block (every ordinal free, in ascending order) at sequence number `sequence`,
    /// affine to `host` (`"host:<host>"`) or to nobody.
    ///
    /// # Panics
    /// When `cidr` is not a CIDR (a test bug).
    pub fn new(cidr: &str, host: Option<&str>, sequence: u64) -> Self {
        let cidr: IpNet = cidr.parse().expect("a block CIDR");
        let bits = match cidr {
            IpNet::V4(_) => 32,
            IpNet::V6(_) => 128,
        } - u32::from(cidr.prefix_len());
        let size = 1usize << bits;
        CalicoBlockBuilder {
            cidr,
            affinity: host.map(|h| format!("host:{h}")),
            allocations: vec![None; size],
            attributes: Vec::new(),
            unallocated: (0..size).collect(),
            sequence,
            sequence_for: BTreeMap::new(),
            extra: BTreeMap::new(),
        }
    }

    /// Sets the raw affinity string (`virtual:<name>`, ...).
    pub fn raw_affinity(mut self, affinity: Option<&str>) -> Self {
        self.affinity = affinity.map(str::to_owned);
        self
    }

    /// Allocates `ordinal` to `handle` with these secondary attributes at block sequence `at`
    /// (the block's sequence number is raised to at least `at`), as Calico's `autoAssign` records
    /// it: the ordinal leaves the free list, identical attributes share one entry.
    ///
    /// # Panics
    /// When the ordinal is outside the block or already allocated (a test bug).
    pub fn allocate(
        mut self,
        ordinal: usize,
        handle: &str,
        secondary: &[(&str, &str)],
        at: u64,
    ) -> Self {
        assert!(
            self.allocations[ordinal].is_none(),
            "ordinal {ordinal} is taken"
        );
        let secondary: BTreeMap<&str, &str> = secondary.iter().copied().collect();
        let attribute = json!({"handle_id": handle, "secondary": secondary});
        let index = match self.attributes.iter().position(|a| *a == attribute) {
            Some(index) => index,
            None => {
                self.attributes.push(attribute);
                self.attributes.len() - 1
            }
        };
        self.allocations[ordinal] = Some(index);
        self.unallocated.retain(|o| *o != ordinal);
        self.sequence_for.insert(ordinal, at);
        self.sequence = self.sequence.max(at);
        self
    }

    /// Releases an allocated `ordinal` as Calico does: it goes to the tail of the free list, its
    /// sequence entry goes, and an attribute nothing refers to any more is dropped (the others
    /// renumbered).
    pub fn release(mut self, ordinal: usize) -> Self {
        let Some(index) = self.allocations[ordinal].take() else {
            return self;
        };
        self.sequence_for.remove(&ordinal);
        self.unallocated.retain(|o| *o != ordinal);
        self.unallocated.push(ordinal);
        if !self.allocations.contains(&Some(index)) {
            self.attributes.remove(index);
            for slot in self.allocations.iter_mut().flatten() {
                if *slot > index {
                    *slot -= 1;
                }
            }
        }
        self
    }

    /// Releases an allocated `ordinal` into IP cooldown as Calico's `releaseByHandle` does with
    /// `ipCooldownSeconds` set: the ordinal stays off the free list and points at a new attribute
    /// holding only `releasedAt` (RFC 3339, as Go's `metav1.Time`); its sequence entry stays; an
    /// attribute nothing refers to any more is dropped (the others renumbered).
    ///
    /// # Panics
    /// When the ordinal is not allocated (a test bug).
    pub fn release_into_cooldown(mut self, ordinal: usize, released_at: &str) -> Self {
        let index = self.allocations[ordinal]
            .take()
            .unwrap_or_else(|| panic!("ordinal {ordinal} is not allocated"));
        if !self.allocations.contains(&Some(index)) {
            self.attributes.remove(index);
            for slot in self.allocations.iter_mut().flatten() {
                if *slot > index {
                    *slot -= 1;
                }
            }
        }
        self.attributes.push(json!({"releasedAt": released_at}));
        self.allocations[ordinal] = Some(self.attributes.len() - 1);
        self
    }

    /// Raises the block's sequence number to `sequence` (a later write of the block).
    pub fn written_at(mut self, sequence: u64) -> Self {
        self.sequence = self.sequence.max(sequence);
        self
    }

    /// Adds a top-level field (`affinity_claim_time`, ...).
    pub fn field(mut self, name: &str, value: Value) -> Self {
        self.extra.insert(name.to_owned(), value);
        self
    }

    /// The block's CIDR.
    pub fn cidr(&self) -> IpNet {
        self.cidr
    }

    /// The free list in Calico's order.
    pub fn unallocated(&self) -> &[usize] {
        &self.unallocated
    }

    /// The stored JSON.
    pub fn to_json(&self) -> Value {
        let sequence_for: BTreeMap<String, u64> = self
            .sequence_for
            .iter()
            .map(|(o, s)| (o.to_string(), *s))
            .collect();
        let mut value = json!({
            "cidr": self.cidr.to_string(),
            "affinity": self.affinity,
            "allocations": self.allocations,
            "unallocated": self.unallocated,
            "attributes": self.attributes,
            "sequenceNumber": self.sequence,
            "sequenceNumberForAllocation": sequence_for,
            "deleted": false,
        });
        if let Some(object) = value.as_object_mut() {
            for (k, v) in &self.extra {
                object.insert(k.clone(), v.clone());
            }
        }
        value
    }
}

/// A set of Calico objects, each as its etcd key (relative to the Calico prefix) and JSON value.
#[derive(Debug, Clone, Default)]
pub struct CalicoFixture {
    entries: Vec<RawEntry>,
}

impl CalicoFixture {
    /// No objects.
    pub fn new() -> Self {
        CalicoFixture::default()
    }

    /// Adds any key and value.
    pub fn raw(mut self, key: &str, value: &str) -> Self {
        self.entries.push(RawEntry {
            key: key.to_owned(),
            value: value.as_bytes().to_vec(),
        });
        self
    }

    fn json(self, key: &str, value: &Value) -> Self {
        let text = value.to_string();
        self.raw(key, &text)
    }

    /// An IP pool resource; `spec_extra` fields (`ipipMode`, `nodeSelector`, ...) join its spec.
    pub fn pool(self, name: &str, cidr: &str, block_size: u8, spec_extra: Value) -> Self {
        let mut spec = json!({"cidr": cidr, "blockSize": block_size});
        if let (Some(spec), Some(extra)) = (spec.as_object_mut(), spec_extra.as_object()) {
            for (k, v) in extra {
                spec.insert(k.clone(), v.clone());
            }
        }
        let value = json!({
            "kind": "IPPool",
            "apiVersion": "projectcalico.org/v3",
            "metadata": {"name": name, "uid": "3f8a0e4c-0000-4000-8000-000000000001",
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": spec,
        });
        self.json(&format!("{POOLS_DIR}{name}"), &value)
    }

    /// The IPAM configuration object.
    pub fn config(self, value: Value) -> Self {
        self.json(CONFIG_KEY, &value)
    }

    /// A block.
    pub fn block(self, block: &CalicoBlockBuilder) -> Self {
        let key = format!(
            "/ipam/v2/assignment/{}/block/{}",
            family_segment(&block.cidr),
            cidr_segment(&block.cidr)
        );
        self.json(&key, &block.to_json())
    }

    /// A block affinity in `state` (`confirmed`, `pending`, `pendingDeletion`).
    ///
    /// # Panics
    /// When `cidr` is not a CIDR (a test bug).
    pub fn affinity(self, host: &str, cidr: &str, state: &str) -> Self {
        let cidr: IpNet = cidr.parse().expect("an affinity CIDR");
        let key = format!(
            "/ipam/v2/host/{host}/{}/block/{}",
            family_segment(&cidr),
            cidr_segment(&cidr)
        );
        self.json(&key, &json!({"state": state, "deleted": false}))
    }

    /// A handle holding `counts` addresses per block CIDR.
    pub fn handle(self, id: &str, counts: &[(&str, u32)]) -> Self {
        let block: BTreeMap<&str, u32> = counts.iter().copied().collect();
        self.json(
            &format!("/ipam/v2/handle/{id}"),
            &json!({"block": block, "deleted": false}),
        )
    }

    /// An IP reservation resource.
    pub fn reservation(self, name: &str, cidrs: &[&str]) -> Self {
        let value = json!({
            "kind": "IPReservation",
            "apiVersion": "projectcalico.org/v3",
            "metadata": {"name": name},
            "spec": {"reservedCIDRs": cidrs},
        });
        self.json(&format!("{RESERVATIONS_DIR}{name}"), &value)
    }

    /// A Calico Node resource with `labels` (as calico-node writes it from the Kubernetes node).
    pub fn node(self, name: &str, labels: &[(&str, &str)]) -> Self {
        let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
        let value = json!({
            "kind": "Node",
            "apiVersion": "projectcalico.org/v3",
            "metadata": {"name": name, "uid": "5d1c2b3a-0000-4000-8000-000000000002",
                         "creationTimestamp": "2026-01-01T00:00:00Z", "labels": labels},
            "spec": {"bgp": {"ipv4Address": "192.0.2.10/24"},
                     "orchRefs": [{"nodeName": name, "orchestrator": "k8s"}]},
        });
        self.json(&format!("{NODES_DIR}{name}"), &value)
    }

    /// The objects, keys relative to the Calico prefix.
    pub fn entries(&self) -> &[RawEntry] {
        &self.entries
    }

    /// Puts every object into the etcd at `endpoint`, each key under `prefix` (`/calico`, or a
    /// test's own such as `/calico-test-17`), in one transaction per 100 keys.
    ///
    /// # Errors
    /// The etcd client's error, as text.
    pub async fn write_to_etcd(&self, endpoint: &str, prefix: &str) -> Result<(), String> {
        let mut client = etcd_client::Client::connect([endpoint], None)
            .await
            .map_err(|e| format!("connect to {endpoint}: {e}"))?;
        let prefix = prefix.trim_end_matches('/');
        for chunk in self.entries.chunks(100) {
            let ops: Vec<etcd_client::TxnOp> = chunk
                .iter()
                .map(|e| {
                    etcd_client::TxnOp::put(format!("{prefix}{}", e.key), e.value.clone(), None)
                })
                .collect();
            client
                .txn(etcd_client::Txn::new().and_then(ops))
                .await
                .map_err(|e| format!("write Calico objects: {e}"))?;
        }
        Ok(())
    }

    /// Deletes every key under `prefix` from the etcd at `endpoint`.
    ///
    /// # Errors
    /// The etcd client's error, as text.
    pub async fn delete_prefix(endpoint: &str, prefix: &str) -> Result<(), String> {
        let mut client = etcd_client::Client::connect([endpoint], None)
            .await
            .map_err(|e| format!("connect to {endpoint}: {e}"))?;
        let prefix = format!("{}/", prefix.trim_end_matches('/'));
        client
            .delete(
                prefix,
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            )
            .await
            .map_err(|e| format!("delete Calico objects: {e}"))?;
        Ok(())
    }
}

/// The network name of the sample cluster's pods (Calico's default).
pub const SAMPLE_NETWORK: &str = "k8s-pod-network";

/// When the sample's still-cooling address was released: a century ahead (as a releaser whose
/// clock ran ahead would stamp it), so it is still in its cooldown whenever a test runs, however
/// slowly, and no test depends on the wall clock.
pub const SAMPLE_STILL_COOLING_RELEASED_AT: &str = "2126-01-01T00:00:00Z";

/// When the sample's cooled address was released: long before any test runs, so its 30 s
/// cooldown is over (Calico frees it at its next read of the block, blockipam at its next write).
pub const SAMPLE_COOLED_RELEASED_AT: &str = "2025-01-01T00:00:00Z";

/// A small Calico cluster holding every case the import must carry:
///
/// - pools `default-ipv4-ippool` 10.244.0.0/24 (/26 blocks; `ipipMode: Always`, `natOutgoing`,
///   `nodeSelector: all()`) and `default-ipv6-ippool` fd00:10:244::/120 (/122 blocks);
/// - IPAM config with `strict_affinity: false`, `auto_allocate_blocks: true`, `maxBlocksPerHost`
///   unset (20) and `ipCooldownSeconds: 30`;
/// - block 10.244.0.0/26 on node-a (sequence 1004): .0 the IPIP tunnel address
///   (`ipip-tunnel-addr-node-a`, sequence 1000), .1 pod `c1` (1001), .2 pod `c2` (1002), .4 pod
///   `b9` of node-b (a borrowed address, 1003); .3 was released before the cooldown was set, so
///   it is last in the free list; .5 (pod `c5`) and .6 (pod `c6`) were released into cooldown
///   (off the free list, attribute with only `releasedAt`): .5 at
///   [`SAMPLE_STILL_COOLING_RELEASED_AT`] (still cooling), .6 at [`SAMPLE_COOLED_RELEASED_AT`]
///   (its cooldown over, not yet freed by a write);
/// - block 10.244.0.64/26 on node-b (sequence 2000, with `affinity_claim_time`): .64 pod `b1`
///   whose attributes carry the unknown key `owner.example.com/team`;
/// - block fd00:10:244::/122 on node-a (sequence 500): fd00:10:244:: for pod `c1`, whose handle
///   therefore spans two blocks;
/// - confirmed affinities for those three blocks, and a pending one of node-c for 10.244.0.128/26
///   (no block);
/// - handles for every holder, plus `k8s-pod-network.gone`, a handle Calico leaked (no address);
/// - an IP reservation `reserved-edge` of 10.244.0.200/30 and fd00:10:244::ff.
pub fn sample_cluster() -> CalicoFixture {
    let pod = |namespace: &str, name: &str, node: &str| -> Vec<(String, String)> {
        vec![
            ("namespace".into(), namespace.into()),
            ("node".into(), node.into()),
            ("pod".into(), name.into()),
            (
                "timestamp".into(),
                "2026-01-01 00:00:00.000000001 +0000 UTC".into(),
            ),
        ]
    };
    let handle = |container: &str| format!("{SAMPLE_NETWORK}.{container}");
    let tunnel: Vec<(String, String)> = vec![
        ("node".into(), "node-a".into()),
        ("type".into(), "ipipTunnelAddress".into()),
    ];
    let block_a = CalicoBlockBuilder::new("10.244.0.0/26", Some("node-a"), 999)
        .allocate(0, "ipip-tunnel-addr-node-a", &pairs(&tunnel), 1000)
        .allocate(
            1,
            &handle("c1"),
            &pairs(&pod("default", "web-1", "node-a")),
            1001,
        )
        .allocate(
            2,
            &handle("c2"),
            &pairs(&pod("default", "web-2", "node-a")),
            1002,
        )
        .allocate(
            3,
            &handle("c3"),
            &pairs(&pod("default", "web-3", "node-a")),
            1002,
        )
        .release(3)
        .allocate(
            4,
            &handle("b9"),
            &pairs(&pod("shop", "cart-9", "node-b")),
            1003,
        )
        .allocate(
            5,
            &handle("c5"),
            &pairs(&pod("default", "web-5", "node-a")),
            1003,
        )
        .allocate(
            6,
            &handle("c6"),
            &pairs(&pod("default", "web-6", "node-a")),
            1003,
        )
        .release_into_cooldown(5, SAMPLE_STILL_COOLING_RELEASED_AT)
        .release_into_cooldown(6, SAMPLE_COOLED_RELEASED_AT)
        .written_at(1004);
    let mut b1 = pod("shop", "cart-1", "node-b");
    b1.push(("owner.example.com/team".into(), "blue".into()));
    let block_b = CalicoBlockBuilder::new("10.244.0.64/26", Some("node-b"), 2000)
        .allocate(0, &handle("b1"), &pairs(&b1), 2000)
        .field("affinity_claim_time", json!("2026-01-01T00:00:00Z"));
    let block_c = CalicoBlockBuilder::new("fd00:10:244::/122", Some("node-a"), 500).allocate(
        0,
        &handle("c1"),
        &pairs(&pod("default", "web-1", "node-a")),
        500,
    );

    CalicoFixture::new()
        .pool(
            "default-ipv4-ippool",
            "10.244.0.0/24",
            26,
            json!({"ipipMode": "Always", "natOutgoing": true, "nodeSelector": "all()",
                   "vxlanMode": "Never"}),
        )
        .pool(
            "default-ipv6-ippool",
            "fd00:10:244::/120",
            122,
            json!({"vxlanMode": "Never", "nodeSelector": "all()"}),
        )
        .config(
            json!({"strict_affinity": false, "auto_allocate_blocks": true,
                       "ipCooldownSeconds": 30}),
        )
        .block(&block_a)
        .block(&block_b)
        .block(&block_c)
        .affinity("node-a", "10.244.0.0/26", "confirmed")
        .affinity("node-b", "10.244.0.64/26", "confirmed")
        .affinity("node-a", "fd00:10:244::/122", "confirmed")
        .affinity("node-c", "10.244.0.128/26", "pending")
        .handle("ipip-tunnel-addr-node-a", &[("10.244.0.0/26", 1)])
        .handle(
            &handle("c1"),
            &[("10.244.0.0/26", 1), ("fd00:10:244::/122", 1)],
        )
        .handle(&handle("c2"), &[("10.244.0.0/26", 1)])
        .handle(&handle("b9"), &[("10.244.0.0/26", 1)])
        .handle(&handle("b1"), &[("10.244.0.64/26", 1)])
        .handle(&handle("gone"), &[("10.244.0.0/26", 1)])
        .reservation("reserved-edge", &["10.244.0.200/30", "fd00:10:244::ff"])
}

/// Borrowed `(&str, &str)` view of owned attribute pairs.
pub fn pairs(owned: &[(String, String)]) -> Vec<(&str, &str)> {
    owned
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}
