//! The store checked against what a node's container runtime runs: allocations whose container is gone, released only after they were seen gone at every look for a grace period; live addresses the store disagrees with, reported.
//!
//! The caller (the node agent) asks the runtime which pod sandboxes exist and hands the answer
//! to [`LeakWatch::observe`] (the decision, pure), through [`Ipam::look_for_leaks`] (the decision on
//! the store's allocations), then [`Ipam::release_leaked`]. The watch is the only memory between
//! looks, and it forgets on purpose: a look the runtime did not answer, or two looks too far apart
//! to call the absence continuous, start every countdown again. What it never releases: an
//! allocation whose container the runtime reports in any state, one another node made, one that
//! names no container or no Kubernetes pod (the network's reservations, addresses assigned by hand,
//! a Podman container), one younger than the grace by its own timestamp, one whose address was
//! re-allocated since it was first seen missing (each release carries the sequence number it was
//! decided on), and nothing at all while the runtime reports none of the containers this node's
//! allocations name (it has not shown it is the runtime the plugin serves).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::{
    AllocationInfo, AssignIpsRequest, Attempt, Ipam, ReleaseRequest, UndecodableObject,
    ATTR_NETWORK, ATTR_NODE,
};
use crate::model::error::IpamError;
use crate::model::keys;
use crate::model::timestamp;
use crate::model::AllowedUse;

/// Attribute: the container (pod sandbox) an allocation was made for, as the runtime names it.
pub const ATTR_CONTAINER_ID: &str = "container_id";
/// Attribute: when the allocation was made (RFC 3339, UTC).
pub const ATTR_TIMESTAMP: &str = "timestamp";
/// Attribute: the Kubernetes pod an allocation was made for (`K8S_POD_NAME`): only such
/// allocations were made through a CRI runtime, and only they are judged against it.
pub const ATTR_POD: &str = "pod";
/// Attribute: the Kubernetes namespace of that pod (`K8S_POD_NAMESPACE`).
pub const ATTR_NAMESPACE: &str = "namespace";
/// Attribute: the interface inside the container (`CNI_IFNAME`).
pub const ATTR_INTERFACE: &str = "interface";
/// A leak look reads every block of the store once in this many looks (daily at the default
/// interval), at the first, and whenever a live address lies outside the blocks it read: the
/// others read the node's own blocks and its borrowed-block index.
pub const SURVEY_EVERY_LOOKS: u32 = 1_440;

/// The handle of a container's addresses on a network: `<network>.<container id>`, as Calico.
pub fn handle_id(network: &str, container_id: &str) -> String {
    format!("{network}.{container_id}")
}

/// One attachment of a container to a network, as the CNI plugin is told of it: what it records
/// with each address it hands out.
#[derive(Debug, Clone, Copy)]
pub struct Attachment<'a> {
    /// The network's name (the netconf's `name`).
    pub network: &'a str,
    /// The container, as the runtime names it (`CNI_CONTAINERID`).
    pub container_id: &'a str,
    /// The interface inside the container (`CNI_IFNAME`).
    pub interface: &'a str,
    /// The pod's namespace (`K8S_POD_NAMESPACE`), when the runtime names one.
    pub namespace: Option<&'a str>,
    /// The pod (`K8S_POD_NAME`), when the runtime names one.
    pub pod: Option<&'a str>,
}

impl Attachment<'_> {
    /// The attributes recorded with each of the attachment's addresses, made at `timestamp`
    /// (RFC 3339): the network, the container, the interface, the time, and the pod and its
    /// namespace when named and not empty (the allocator adds the node). The CNI plugin, the
    /// agent's re-recording and the load generator all record these.
    pub fn attributes(&self, timestamp: &str) -> BTreeMap<String, String> {
        let mut attributes = BTreeMap::from([
            (ATTR_NETWORK.to_owned(), self.network.to_owned()),
            (ATTR_CONTAINER_ID.to_owned(), self.container_id.to_owned()),
            (ATTR_INTERFACE.to_owned(), self.interface.to_owned()),
            (ATTR_TIMESTAMP.to_owned(), timestamp.to_owned()),
        ]);
        for (key, value) in [(ATTR_NAMESPACE, self.namespace), (ATTR_POD, self.pod)] {
            if let Some(value) = value.filter(|v| !v.is_empty()) {
                attributes.insert(key.to_owned(), value.to_owned());
            }
        }
        attributes
    }
}

/// How long an allocation's container must have been missing at every look before it is
/// released: Calico's `leakGracePeriod` default, 15 minutes.
pub const DEFAULT_LEAK_GRACE_SECONDS: u64 = 900;
/// Addresses released per transaction by a leak pass.
const LEAK_RELEASE_BATCH: usize = 32;

/// One pod sandbox the runtime reports, in any state (a stopped sandbox still names its pod).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveSandbox {
    /// The pod's name.
    pub pod: String,
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's uid.
    pub uid: String,
    /// The addresses the runtime reports for the sandbox's network (none for a host-network pod).
    pub addresses: Vec<IpAddr>,
}

/// What the runtime answered at one look.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuntimeView {
    /// When the runtime was asked (Unix seconds, this node's clock).
    pub observed_at: u64,
    /// Every sandbox it reported, by id (the container id the plugin was called with).
    pub sandboxes: BTreeMap<String, LiveSandbox>,
}

/// How a leak pass decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeakPolicy {
    /// Seconds an allocation's container must have been missing at every look (and, by its
    /// timestamp, the allocation's least age) before it is released. Looks and timestamps count
    /// whole seconds, so it is released at a look more than this many seconds after the first
    /// look that found it missing (and its stamp): never less than the grace of real time.
    pub grace_seconds: u64,
    /// Two looks further apart than this do not prove the absence in between: every countdown
    /// starts again (set it to a few scan intervals).
    pub max_gap_seconds: u64,
}

/// An allocation of this node whose container the runtime does not report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissingAllocation {
    /// The allocation, as read at this look.
    pub allocation: AllocationInfo,
    /// Since when it has been missing at every look (Unix seconds).
    pub missing_since: u64,
}

/// What the store holds for an address a live sandbox uses, when that is not the sandbox's own
/// allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AddressHolder {
    /// Nobody: the address is free in its pool.
    Free,
    /// Another allocation (another container's, or another node's).
    Other(AllocationInfo),
}

/// A live sandbox's address that the store does not record for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disagreement {
    /// The address.
    pub address: IpAddr,
    /// The sandbox using it.
    pub sandbox_id: String,
    /// Its pod's namespace and name.
    pub pod: String,
    /// What the store holds instead.
    pub holder: AddressHolder,
}

/// What one look decided.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeakDecisions {
    /// This node's allocations whose container the runtime reports.
    pub live: usize,
    /// This node's allocations whose container is missing, still within the grace.
    pub waiting: Vec<MissingAllocation>,
    /// Missing for the whole grace: to release, each guarded by its sequence number (empty while
    /// the runtime is unproven: those wait in `waiting`).
    pub leaked: Vec<MissingAllocation>,
    /// This node's allocations left alone because they name no container or no Kubernetes pod
    /// (the network's reservations, addresses assigned by hand, containers another runtime such
    /// as Podman started through the plugin).
    pub not_a_pod: usize,
    /// True when the runtime reports none of the containers this node's allocations name: it has
    /// not shown it is the runtime the plugin serves (a socket of another runtime, one that has
    /// just lost its state and runs nothing yet), so nothing is released; countdowns go on.
    pub runtime_unproven: bool,
    /// Live sandboxes' addresses the store does not record for them.
    pub disagreements: Vec<Disagreement>,
    /// Whether this look restarted every countdown (the previous one was too long ago).
    pub countdowns_restarted: bool,
    /// Block objects this look read that could not be decoded: nothing is decided about the
    /// addresses they cover (no allocation in them is judged, no live sandbox's address in them is
    /// reported as a disagreement); the rest of the look decides as usual.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub undecodable: Vec<UndecodableObject>,
    /// The name of the pool each address in `leaked` lies in, as this look read the pools (an
    /// address in no pool, its pool deleted, is not named).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub leaked_pools: BTreeMap<IpAddr, String>,
}

/// What releasing decided leaks did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeakRelease {
    /// Addresses released.
    pub released: Vec<IpAddr>,
    /// Decided leaks left alone: their address changed hands since it was decided on (sequence
    /// guard), or was free already.
    pub skipped: Vec<IpAddr>,
}

/// The name of the file an agent writes its last look's [`LeakReport`] to, in its socket's
/// directory.
pub const LEAK_REPORT_FILE: &str = "leaks.json";
/// The version of [`LeakReport`] this build writes and reads.
pub const LEAK_REPORT_VERSION: u32 = 1;

/// What an agent's last look found, as it writes it for `blockipamctl gc --leaks` (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeakReport {
    /// [`LEAK_REPORT_VERSION`].
    pub version: u32,
    /// The node the agent looks after.
    pub node: String,
    /// The runtime's CRI socket.
    pub runtime: String,
    /// When the look was made (Unix seconds, the node's clock).
    pub observed_at: u64,
    /// The agent's grace.
    pub grace_seconds: u64,
    /// The agent's interval between looks.
    pub scan_seconds: u64,
    /// Why the runtime could not be asked at this look (then there are no decisions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_error: Option<String>,
    /// What the look decided, when the runtime answered and the store was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decisions: Option<LeakDecisions>,
}

/// The version of [`LiveDisagreements`] this build writes and reads.
pub const LIVE_DISAGREEMENTS_VERSION: u32 = 1;

/// What a node's agent found at its looks: the live addresses the store disagrees with, stored
/// under [`keys::live_disagreements_key`] (JSON) for `check` to report cluster-wide.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveDisagreements {
    /// [`LIVE_DISAGREEMENTS_VERSION`].
    pub version: u32,
    /// The node whose agent looked.
    pub node: String,
    /// The look that first found exactly these (Unix seconds, the node's clock).
    pub since: u64,
    /// What it found, each still there at the agent's last look.
    pub disagreements: Vec<Disagreement>,
}

impl LiveDisagreements {
    /// Decodes a stored record; a record of another version is refused (a newer build wrote it).
    ///
    /// # Errors
    /// [`IpamError::Corrupt`] naming the key.
    pub fn decode(key: &str, bytes: &[u8]) -> Result<LiveDisagreements, IpamError> {
        let record: LiveDisagreements =
            serde_json::from_slice(bytes).map_err(|e| IpamError::Corrupt {
                key: key.to_owned(),
                message: format!("not a live-disagreements record: {e}"),
            })?;
        if record.version != LIVE_DISAGREEMENTS_VERSION {
            return Err(IpamError::Corrupt {
                key: key.to_owned(),
                message: format!(
                    "live-disagreements record version {} (this build reads {})",
                    record.version, LIVE_DISAGREEMENTS_VERSION
                ),
            });
        }
        Ok(record)
    }
}

/// The memory between looks: since when each of this node's allocations has been missing.
#[derive(Debug, Clone, Default)]
pub struct LeakWatch {
    /// (address, sequence) → first look at which its container was missing.
    missing_since: BTreeMap<(IpAddr, u64), u64>,
    /// The last look the runtime answered.
    last_look: Option<u64>,
    /// Looks since the last one that read every block of the store (`None`: none did yet).
    looks_since_survey: Option<u32>,
}

impl LeakWatch {
    /// A watch that has seen nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The runtime could not be asked: nothing is known about the time since the last look, so
    /// every countdown starts again at the next answered look.
    pub fn runtime_unanswered(&mut self) {
        self.missing_since.clear();
        self.last_look = None;
    }

    /// How many allocations are counting down.
    pub fn counting(&self) -> usize {
        self.missing_since.len()
    }

    /// Whether the next look reads every block of the store: the first look, and one look in
    /// [`SURVEY_EVERY_LOOKS`]; the others read the node's blocks and its borrowed-block index.
    pub fn survey_due(&self) -> bool {
        self.looks_since_survey
            .is_none_or(|looks| looks.saturating_add(1) >= SURVEY_EVERY_LOOKS)
    }

    /// Whether the last look read every block of the store.
    pub fn last_look_surveyed(&self) -> bool {
        self.looks_since_survey == Some(0)
    }

    fn looked(&mut self, surveyed: bool) {
        self.looks_since_survey = match (surveyed, self.looks_since_survey) {
            (true, _) => Some(0),
            (false, Some(looks)) => Some(looks.saturating_add(1)),
            (false, None) => None,
        };
    }

    /// Decides on one look. `allocations` is every allocation the store holds (this node's are
    /// those whose `node` attribute is `host`); `in_pools` says whether an address belongs to one
    /// of the store's pools (a live address outside them is another IPAM's business).
    pub fn observe(
        &mut self,
        host: &str,
        allocations: &[AllocationInfo],
        view: &RuntimeView,
        in_pools: &dyn Fn(IpAddr) -> bool,
        policy: LeakPolicy,
    ) -> LeakDecisions {
        let mut decisions = LeakDecisions::default();
        let now = view.observed_at;
        let continuous = self
            .last_look
            .is_some_and(|last| now >= last && now - last <= policy.max_gap_seconds);
        if !continuous {
            decisions.countdowns_restarted = self.last_look.is_some();
            self.missing_since.clear();
        }
        self.last_look = Some(now);

        let mut still_missing = BTreeSet::new();
        for allocation in allocations
            .iter()
            .filter(|a| a.attributes.get(ATTR_NODE).map(String::as_str) == Some(host))
        {
            let (Some(container), Some(_pod)) = (
                allocation.attributes.get(ATTR_CONTAINER_ID),
                allocation.attributes.get(ATTR_POD),
            ) else {
                decisions.not_a_pod += 1;
                continue;
            };
            if view.sandboxes.contains_key(container) {
                decisions.live += 1;
                continue;
            }
            let key = (allocation.ip, allocation.sequence);
            still_missing.insert(key);
            let since = *self.missing_since.entry(key).or_insert(now);
            let missing = MissingAllocation {
                allocation: allocation.clone(),
                missing_since: since,
            };
            let old_enough = allocation_age(allocation, now)
                .is_none_or(|age| lasted_the_grace(age, policy.grace_seconds));
            if lasted_the_grace(now.saturating_sub(since), policy.grace_seconds) && old_enough {
                decisions.leaked.push(missing);
            } else {
                decisions.waiting.push(missing);
            }
        }
        self.missing_since
            .retain(|key, _| still_missing.contains(key));
        decisions.runtime_unproven = decisions.live == 0;
        if decisions.runtime_unproven {
            let held = std::mem::take(&mut decisions.leaked);
            decisions.waiting.extend(held);
        }

        let by_address: BTreeMap<IpAddr, &AllocationInfo> =
            allocations.iter().map(|a| (a.ip, a)).collect();
        for (sandbox_id, sandbox) in &view.sandboxes {
            for address in &sandbox.addresses {
                let holder = match by_address.get(address) {
                    Some(held)
                        if held.attributes.get(ATTR_CONTAINER_ID).map(String::as_str)
                            == Some(sandbox_id.as_str()) =>
                    {
                        continue;
                    }
                    Some(held) => AddressHolder::Other((*held).clone()),
                    None if in_pools(*address) => AddressHolder::Free,
                    None => continue,
                };
                decisions.disagreements.push(Disagreement {
                    address: *address,
                    sandbox_id: sandbox_id.clone(),
                    pod: format!("{}/{}", sandbox.namespace, sandbox.pod),
                    holder,
                });
            }
        }
        decisions
    }
}

/// Whether two whole-second stamps `apart` seconds apart prove that at least `grace` seconds
/// passed: each stamp drops its fraction, so only more than `grace` does (exactly `grace` apart
/// can be as little as `grace - 1` seconds and a fraction).
fn lasted_the_grace(apart: u64, grace: u64) -> bool {
    apart > grace
}

/// The allocation's age by its own timestamp, when it records a readable one (a timestamp in the
/// future counts as age zero).
fn allocation_age(allocation: &AllocationInfo, now: u64) -> Option<u64> {
    let stamp = allocation.attributes.get(ATTR_TIMESTAMP)?;
    let made = timestamp::parse_rfc3339_utc(stamp)?;
    Some(now.saturating_sub(made))
}

/// A live sandbox's address the store records as free, to be recorded again for it (what the
/// plugin recorded at its ADD, as the runtime's own cache of that ADD tells).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reassertion {
    /// The address.
    pub address: IpAddr,
    /// Its owner: `<network>.<container id>`.
    pub handle: String,
    /// The node the sandbox runs on.
    pub host: String,
    /// The attributes the plugin records (the allocator adds `node`).
    pub attributes: BTreeMap<String, String>,
}

impl Ipam {
    /// Records `reassertion.address` for its live owner again, if it is still free: `Ok(true)`
    /// when recorded, `Ok(false)` when it is held by now (then nothing is written: it is a
    /// duplicate for the next look to report).
    ///
    /// # Errors
    /// Store failures; an address in no pool, or in a pool that does not allow workloads.
    pub async fn reassert(&self, reassertion: &Reassertion) -> Result<bool, IpamError> {
        let request = AssignIpsRequest {
            ips: vec![reassertion.address],
            handle: reassertion.handle.clone(),
            host: reassertion.host.clone(),
            attributes: reassertion.attributes.clone(),
            ignore_strict_affinity: false,
            purpose: Some(AllowedUse::Workload),
        };
        match self.assign_ips(&request).await {
            Ok(_) => Ok(true),
            Err(IpamError::AlreadyAssigned { .. }) => Ok(false),
            Err(other) => Err(other),
        }
    }

    /// Records what a look of `host`'s agent found at `observed_at` where `check` reads it:
    /// written only when it differs from the record (which keeps the look that first found it),
    /// deleted when the look found nothing. Whether it wrote.
    ///
    /// # Errors
    /// Store failures. A record that does not decode is replaced.
    pub async fn record_disagreements(
        &self,
        host: &str,
        observed_at: u64,
        disagreements: &[Disagreement],
    ) -> Result<bool, IpamError> {
        let key = keys::live_disagreements_key(host);
        let stored = self.store.get(&key).await?;
        let unchanged = stored.as_ref().is_some_and(|kv| {
            LiveDisagreements::decode(&kv.key, &kv.value)
                .is_ok_and(|r| r.node == host && r.disagreements == disagreements)
        });
        if disagreements.is_empty() {
            if stored.is_none() {
                return Ok(false);
            }
            self.store.delete(&key).await?;
            return Ok(true);
        }
        if unchanged {
            return Ok(false);
        }
        let record = LiveDisagreements {
            version: LIVE_DISAGREEMENTS_VERSION,
            node: host.to_owned(),
            since: observed_at,
            disagreements: disagreements.to_vec(),
        };
        let bytes = serde_json::to_vec(&record).map_err(|e| IpamError::Corrupt {
            key: key.clone(),
            message: format!("cannot encode: {e}"),
        })?;
        self.store.put(&key, bytes).await?;
        Ok(true)
    }

    /// One look for `host`: reads `host`'s allocations and the pools and decides with `watch`
    /// (see [`LeakWatch::observe`]).
    ///
    /// What it reads: the node's own blocks and the blocks its borrowed-block index names
    /// ([`keys::host_borrowed_dir`]), so that a look costs what the node holds, not what the
    /// store holds. Every block of the store instead at the first look, at one look in
    /// [`SURVEY_EVERY_LOOKS`], and at any look where a live sandbox's address lies outside the
    /// blocks read (it may be held by another node, free, or recorded by a writer that keeps no
    /// index): then the index is completed with every block outside the node's own that holds
    /// one of its addresses. The only writes: that index, completed after a survey and
    /// cleared of blocks that no longer hold anything of the node (each deletion conditioned on
    /// the block as it was read).
    ///
    /// A block object that cannot be decoded does not stop the look: it is named in
    /// [`LeakDecisions::undecodable`] and the addresses it covers are left out of every decision.
    ///
    /// # Errors
    /// Store failures, a pool that cannot be decoded, a block the node's borrowed-block index
    /// names that cannot be decoded (the watch is left as it was: no decision is made).
    pub async fn look_for_leaks(
        &self,
        host: &str,
        view: &RuntimeView,
        watch: &mut LeakWatch,
        policy: LeakPolicy,
    ) -> Result<LeakDecisions, IpamError> {
        let mut surveyed = watch.survey_due();
        let (pools, (allocations, undecodable)) = if surveyed {
            (
                self.list_pools().await?,
                self.list_allocations_each().await?,
            )
        } else {
            // A block rewritten between its read and its owner keys' is read again.
            let node = self
                .retrying(|| async { Ok(Attempt::Done(self.node_allocations(host).await?)) })
                .await?;
            let in_pools =
                |address: IpAddr| node.pools.iter().any(|pool| pool.cidr.contains(&address));
            if live_addresses_inside(&node.blocks, view, &in_pools) {
                self.forget_borrowed(host, &node.unneeded).await?;
                (node.pools, (node.allocations, node.undecodable))
            } else {
                surveyed = true;
                (node.pools, self.list_allocations_each().await?)
            }
        };
        // What a block that cannot be decoded holds (or whose owner key cannot be) is unknown:
        // its addresses are left out.
        let unreadable: Vec<IpNet> = undecodable
            .iter()
            .map(|object| object.covers().ok_or_else(|| object.clone().into_error()))
            .collect::<Result<_, _>>()?;
        let in_pools = |address: IpAddr| pools.iter().any(|pool| pool.cidr.contains(&address));
        if surveyed {
            self.complete_borrowed_index(host, &allocations).await?;
        }
        watch.looked(surveyed);
        let mut decisions = if unreadable.is_empty() {
            watch.observe(host, &allocations, view, &in_pools, policy)
        } else {
            let mut readable = view.clone();
            for sandbox in readable.sandboxes.values_mut() {
                sandbox
                    .addresses
                    .retain(|address| !unreadable.iter().any(|cidr| cidr.contains(address)));
            }
            watch.observe(host, &allocations, &readable, &in_pools, policy)
        };
        decisions.undecodable = undecodable;
        decisions.leaked_pools = decisions
            .leaked
            .iter()
            .filter_map(|missing| {
                let address = missing.allocation.ip;
                let pool = pools.iter().find(|pool| pool.cidr.contains(&address))?;
                Some((address, pool.name.clone()))
            })
            .collect();
        Ok(decisions)
    }

    /// Releases decided leaks, each address guarded by the sequence number it was decided on: an
    /// address re-allocated since (or already free) is left alone and reported as skipped.
    ///
    /// # Errors
    /// Store failures; [`IpamError::RetriesExhausted`]. Batches released before a failure stay
    /// released (each batch is one transaction).
    pub async fn release_leaked(
        &self,
        leaked: &[MissingAllocation],
    ) -> Result<LeakRelease, IpamError> {
        let requests: Vec<ReleaseRequest> = leaked
            .iter()
            .map(|m| ReleaseRequest {
                ip: m.allocation.ip,
                sequence: Some(m.allocation.sequence),
            })
            .collect();
        let mut outcome = LeakRelease::default();
        for batch in requests.chunks(LEAK_RELEASE_BATCH) {
            let done = self.release_ips(batch).await?;
            outcome.released.extend(done.released);
            outcome.skipped.extend(done.sequence_mismatch);
            outcome.skipped.extend(done.not_allocated);
        }
        Ok(outcome)
    }
}

/// Every live sandbox's address (in one of the pools) lies in one of `blocks`: a look that read
/// only those blocks knows whether each is held for its sandbox, for another holder, or free.
fn live_addresses_inside(
    blocks: &[IpNet],
    view: &RuntimeView,
    in_pools: &dyn Fn(IpAddr) -> bool,
) -> bool {
    view.sandboxes
        .values()
        .flat_map(|sandbox| sandbox.addresses.iter())
        .all(|address| !in_pools(*address) || blocks.iter().any(|b| b.contains(address)))
}

mod borrowed_index;

#[cfg(test)]
mod tests;
