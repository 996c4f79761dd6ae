//! Dead-node reclaim through the storage trait alone: agents' registrations, the liveness keys
//! their leases keep, the per-node decision (alive / missing / dead) and the guarded release of
//! a dead node's blocks and addresses. Leases themselves are etcd's (`backend_etcd::lease`).
//!
//! A node is judged only when its agent registered it (`ipam/v1/agents/<host>`). Its liveness key
//! (`ipam/v1/liveness/<host>`) lives as long as the agent's lease. A reclaimer that finds the
//! liveness key gone marks the registration with `missing_since` (its own clock, by
//! compare-and-swap); once the mark is older than the grace period the node is dead and is
//! released like `blockipamctl node release <host> --addresses`, every write guarded by "the
//! liveness key is still absent and the registration is unchanged", then the registration is
//! deleted. A node that comes back (its liveness key reappears or its agent registers again)
//! stops the release at its next write.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::allocator::{HostRelease, Ipam, ATTR_NODE};
use crate::error::IpamError;
use crate::kv::{Condition, KvError, KvStore, Op, Read, Revision, Txn};
use crate::model::{keys, validate_host, ROOT};

/// Calico's default: a node whose liveness has been gone this long is dead.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(15 * 60);

/// The pseudo-node the plugin makes network (gateway) reservations for: never a real node,
/// never reclaimed, whatever is stored under its name.
pub const RESERVATION_NODE: &str = "-";

/// Prefix of every agent registration.
pub fn agents_dir() -> String {
    format!("{ROOT}agents/")
}

/// The registration record of `host`'s agent (persistent; deleted once the node is reclaimed).
pub fn agent_key(host: &str) -> String {
    format!("{ROOT}agents/{host}")
}

/// Prefix of every liveness key.
pub fn liveness_dir() -> String {
    format!("{ROOT}liveness/")
}

/// `host`'s liveness key: attached to its agent's etcd lease, gone when the lease expires.
pub fn liveness_key(host: &str) -> String {
    format!("{ROOT}liveness/{host}")
}

/// The reclaimer leader key: attached to the lease of the agent that reclaims; the others wait.
pub fn reclaimer_leader_key() -> String {
    format!("{ROOT}reclaimer-leader")
}

/// What an agent stores when it registers its node (JSON, readable with `etcdctl`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// The node (host) name, as the plugin records it in the `node` attribute.
    pub node: String,
    /// When the agent last registered (unix seconds, the agent's clock).
    pub registered_at: u64,
    /// The version of the agent that registered.
    pub agent_version: String,
    /// Set by a reclaimer when it first found the liveness key absent (unix seconds, the
    /// reclaimer's clock); cleared when the agent registers again or the key is back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing_since: Option<u64>,
}

impl Registration {
    fn encode(&self) -> Result<Vec<u8>, IpamError> {
        serde_json::to_vec(self)
            .map_err(|e| IpamError::Internal(format!("cannot encode a registration: {e}")))
    }

    fn decode(key: &str, bytes: &[u8]) -> Result<Registration, IpamError> {
        serde_json::from_slice(bytes).map_err(|e| IpamError::Corrupt {
            key: key.to_owned(),
            message: format!("not an agent registration: {e}"),
        })
    }
}

/// Writes (or rewrites) `host`'s registration with no `missing_since` mark. An agent calls it at
/// start and whenever it had to grant itself a new lease; put the liveness key first, so that a
/// reclaim in progress stops on the liveness guard at once.
///
/// # Errors
/// [`IpamError::InvalidArgument`] for an invalid host name or the reservation pseudo-node; store
/// failures.
pub async fn register(
    store: &dyn KvStore,
    host: &str,
    agent_version: &str,
    now: u64,
) -> Result<Revision, IpamError> {
    validate_node(host)?;
    let registration = Registration {
        node: host.to_owned(),
        registered_at: now,
        agent_version: agent_version.to_owned(),
        missing_since: None,
    };
    Ok(store.put(&agent_key(host), registration.encode()?).await?)
}

/// Refuses names no registered node may have: invalid host names and the reservation pseudo-node.
fn validate_node(host: &str) -> Result<(), IpamError> {
    validate_host(host)?;
    if host == RESERVATION_NODE {
        return Err(IpamError::InvalidArgument(format!(
            "{RESERVATION_NODE:?} is the network reservations' pseudo-node, not a node"
        )));
    }
    Ok(())
}

/// Where a registered node stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum NodeState {
    /// Its liveness key exists.
    Alive,
    /// Its liveness key is gone; `since` is the reclaimer's mark (`None`: not marked yet).
    Missing {
        /// When a reclaimer first found the key gone (unix seconds).
        since: Option<u64>,
    },
    /// Its liveness key has been gone for at least the grace period.
    Dead {
        /// When a reclaimer first found the key gone (unix seconds).
        since: u64,
    },
}

/// One registered node, as [`survey`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatus {
    /// The node.
    pub host: String,
    /// Its registration record.
    pub registration: Registration,
    /// The registration's revision (what a reclaim is guarded with).
    pub revision: Revision,
    /// Whether its liveness key exists.
    pub live: bool,
    /// The decision at `now`.
    pub state: NodeState,
}

/// The decision for one node at `now` (unix seconds): alive while the liveness key exists, dead
/// once the `missing_since` mark is at least `grace` old, missing in between. A mark in the future
/// (the reclaimer's clock went back) counts as made now.
pub fn decide(live: bool, missing_since: Option<u64>, now: u64, grace: Duration) -> NodeState {
    match (live, missing_since) {
        (true, _) => NodeState::Alive,
        (false, None) => NodeState::Missing { since: None },
        (false, Some(since)) if now.saturating_sub(since) >= grace.as_secs() => {
            NodeState::Dead { since }
        }
        (false, Some(since)) => NodeState::Missing { since: Some(since) },
    }
}

/// Every registered node and its state at `now`, from one batched read of the registrations and
/// the liveness keys. Writes nothing. Records under the reservation pseudo-node's name or an
/// invalid host name are left out (never judged).
///
/// # Errors
/// Store failures; [`IpamError::Corrupt`] for a registration that does not decode.
pub async fn survey(
    store: &dyn KvStore,
    now: u64,
    grace: Duration,
) -> Result<Vec<NodeStatus>, IpamError> {
    let mut answers = store
        .read_many(&[Read::List(agents_dir()), Read::List(liveness_dir())])
        .await?
        .into_iter();
    let (Some(registrations), Some(liveness)) = (answers.next(), answers.next()) else {
        return Err(IpamError::Store(KvError::other(
            "the store answered a batch of two reads with fewer results",
        )));
    };
    let live: BTreeSet<String> = liveness
        .into_listed()?
        .into_iter()
        .filter_map(|kv| kv.key.strip_prefix(&liveness_dir()).map(str::to_owned))
        .collect();
    let mut nodes = Vec::new();
    for kv in registrations.into_listed()? {
        let Some(host) = kv.key.strip_prefix(&agents_dir()).map(str::to_owned) else {
            continue;
        };
        if validate_node(&host).is_err() {
            continue;
        }
        let registration = Registration::decode(&kv.key, &kv.value)?;
        let is_live = live.contains(&host);
        nodes.push(NodeStatus {
            state: decide(is_live, registration.missing_since, now, grace),
            host,
            registration,
            revision: kv.revision,
            live: is_live,
        });
    }
    Ok(nodes)
}

/// What a reclaim of a node would release: its blocks and the addresses `release_host` frees.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReleasePreview {
    /// Blocks affine to the node (empty ones are deleted, the others lose their affinity).
    pub blocks: u64,
    /// Addresses that would be released: every address of every handle holding an address
    /// recorded for the node.
    pub addresses: u64,
}

/// What releasing each of `hosts` would release now (one listing of every allocation, one
/// listing of each host's blocks). Writes nothing.
///
/// # Errors
/// Store failures; corrupt objects.
pub async fn preview_release(
    store: Arc<dyn KvStore>,
    hosts: &[&str],
) -> Result<BTreeMap<String, ReleasePreview>, IpamError> {
    let mut previews = BTreeMap::new();
    if hosts.is_empty() {
        return Ok(previews);
    }
    let allocations = Ipam::new(Arc::clone(&store)).list_allocations().await?;
    for host in hosts {
        let handles: BTreeSet<&str> = allocations
            .iter()
            .filter(|a| a.attributes.get(ATTR_NODE).map(String::as_str) == Some(*host))
            .map(|a| a.handle.as_str())
            .collect();
        let addresses = allocations
            .iter()
            .filter(|a| handles.contains(a.handle.as_str()))
            .count() as u64;
        let blocks = store.list(&keys::host_blocks_dir(host)).await?.len() as u64;
        previews.insert((*host).to_owned(), ReleasePreview { blocks, addresses });
    }
    Ok(previews)
}

/// How a reclaim pass runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReclaimOptions {
    /// How long a node's liveness must have been missing before it is dead.
    pub grace: Duration,
    /// Conditions added to every write of the pass, besides each node's own guard: an agent
    /// passes "the leader key is still mine", so that a reclaimer that lost its leadership (it
    /// was paused past its lease) stops writing.
    pub extra_guard: Vec<Condition>,
}

impl Default for ReclaimOptions {
    fn default() -> Self {
        ReclaimOptions {
            grace: DEFAULT_GRACE,
            extra_guard: Vec::new(),
        }
    }
}

/// What a reclaim pass did for one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeAction {
    /// Its liveness key exists: nothing to do.
    Alive,
    /// Its liveness key exists and a stale `missing_since` mark was cleared.
    ClearedMark,
    /// Its liveness key was found gone for the first time: marked `missing_since = now`.
    MarkedMissing,
    /// Still missing, not yet for the whole grace period.
    StillMissing {
        /// When it was marked.
        since: u64,
        /// Seconds left until it is dead.
        remaining_seconds: u64,
    },
    /// Dead, released, registration deleted.
    Reclaimed(HostRelease),
    /// A guard stopped the release (the node came back, or the extra guard stopped holding):
    /// whatever was released before that stays released; nothing more was written.
    Stopped {
        /// The guard key that no longer held.
        key: String,
        /// What the release did when it had finished before the guard stopped the deletion of
        /// the registration; `None` when the guard stopped the release itself (batches it had
        /// committed before stay released, uncounted).
        released: Option<HostRelease>,
    },
    /// Someone else changed the registration between the read and the write (another
    /// reclaimer, or the agent registering again): left for the next pass.
    Changed,
    /// The store failed for this node; the pass went on with the others.
    Failed(String),
}

/// One node's line in a pass's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeOutcome {
    /// The node.
    pub host: String,
    /// What was decided and done.
    pub action: NodeAction,
}

/// One reclaim pass at `now` (unix seconds): [`survey`], then for every registered node: clear a
/// stale mark of a live node; mark a node whose liveness key is gone for the first time; release
/// a dead one with every write guarded by "its liveness key is still absent, its registration is
/// unchanged" (plus `options.extra_guard`), then delete its registration. A write refused by the
/// extra guard ends the pass (its node is reported `Stopped`, later nodes are not reported).
/// Never touches a node whose liveness key exists, a node that never registered, or the
/// reservation pseudo-node.
///
/// # Errors
/// Failure of the first batched read; a failure for one node is reported in its outcome and the
/// pass goes on.
pub async fn reclaim_pass(
    store: Arc<dyn KvStore>,
    now: u64,
    options: &ReclaimOptions,
) -> Result<Vec<NodeOutcome>, IpamError> {
    let nodes = survey(store.as_ref(), now, options.grace).await?;
    let mut outcomes = Vec::with_capacity(nodes.len());
    for node in nodes {
        let action = match act_on(&store, &node, now, options).await {
            Ok(action) => action,
            Err(e) => NodeAction::Failed(e.to_string()),
        };
        // The extra guard stopped holding (the reclaimer lost its leadership): every further
        // write would fail the same way, so the pass ends here.
        let lost_extra_guard = matches!(
            &action,
            NodeAction::Stopped { key, .. } if options.extra_guard.iter().any(|c| c.key() == key)
        );
        outcomes.push(NodeOutcome {
            host: node.host,
            action,
        });
        if lost_extra_guard {
            break;
        }
    }
    Ok(outcomes)
}

/// Rewrites `node`'s registration with `missing_since` only while it is unchanged, its liveness
/// key is still absent (for a node found missing), and the extra guard holds: `None` when
/// written, else the key of the condition that failed.
async fn rewrite_registration(
    store: &dyn KvStore,
    node: &NodeStatus,
    missing_since: Option<u64>,
    extra_guard: &[Condition],
) -> Result<Option<String>, IpamError> {
    let registration = Registration {
        missing_since,
        ..node.registration.clone()
    };
    let key = agent_key(&node.host);
    let mut txn = Txn::new()
        .when(Condition::at_revision(&key, node.revision))
        .then(Op::put(&key, registration.encode()?));
    if !node.live {
        txn = txn.when(Condition::absent(liveness_key(&node.host)));
    }
    for condition in extra_guard {
        txn = txn.when(condition.clone());
    }
    match store.commit(txn).await {
        Ok(_) => Ok(None),
        Err(KvError::Conflict { key }) => Ok(Some(key)),
        Err(e) => Err(e.into()),
    }
}

async fn act_on(
    store: &Arc<dyn KvStore>,
    node: &NodeStatus,
    now: u64,
    options: &ReclaimOptions,
) -> Result<NodeAction, IpamError> {
    // A refused rewrite: stopped by the extra guard, or someone else changed the registration.
    let changed = |conflict: Option<String>, action: NodeAction| match conflict {
        None => action,
        Some(key) if options.extra_guard.iter().any(|c| c.key() == key) => NodeAction::Stopped {
            key,
            released: None,
        },
        Some(_) => NodeAction::Changed,
    };
    match node.state {
        NodeState::Alive if node.registration.missing_since.is_some() => {
            let conflict =
                rewrite_registration(store.as_ref(), node, None, &options.extra_guard).await?;
            Ok(changed(conflict, NodeAction::ClearedMark))
        }
        NodeState::Alive => Ok(NodeAction::Alive),
        NodeState::Missing { since: None } => {
            let conflict =
                rewrite_registration(store.as_ref(), node, Some(now), &options.extra_guard).await?;
            Ok(changed(conflict, NodeAction::MarkedMissing))
        }
        NodeState::Missing { since: Some(since) } => Ok(NodeAction::StillMissing {
            since,
            remaining_seconds: options
                .grace
                .as_secs()
                .saturating_sub(now.saturating_sub(since)),
        }),
        NodeState::Dead { .. } => reclaim_dead(store, node, &options.extra_guard).await,
    }
}

/// Releases a dead node under its guard, then deletes its registration under the same guard.
async fn reclaim_dead(
    store: &Arc<dyn KvStore>,
    node: &NodeStatus,
    extra_guard: &[Condition],
) -> Result<NodeAction, IpamError> {
    let registration_key = agent_key(&node.host);
    let mut guard = vec![
        Condition::absent(liveness_key(&node.host)),
        Condition::at_revision(&registration_key, node.revision),
    ];
    guard.extend(extra_guard.iter().cloned());
    let ipam = Ipam::new(Arc::clone(store)).guarded_by(guard.clone());
    let released = match ipam.release_host(&node.host, true).await {
        Ok(released) => released,
        Err(IpamError::GuardLost { key }) => {
            return Ok(NodeAction::Stopped {
                key,
                released: None,
            })
        }
        Err(e) => return Err(e),
    };
    let mut txn = Txn::new().then(Op::delete(&registration_key));
    for condition in guard {
        txn = txn.when(condition);
    }
    match store.commit(txn).await {
        Ok(_) => Ok(NodeAction::Reclaimed(released)),
        Err(KvError::Conflict { key }) => Ok(NodeAction::Stopped {
            key,
            released: Some(released),
        }),
        Err(e) => Err(e.into()),
    }
}
