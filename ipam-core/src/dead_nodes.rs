//! Dead-node reclaim through the storage trait alone: agents' registrations, the evidence that a
//! node is alive (its agents' liveness keys, its plugin's activity record), the per-node decision
//! (alive / active / missing / dead) and the guarded release of a dead node's blocks and
//! addresses. The grace period is timed by the store itself (a countdown key on an etcd lease that
//! is never renewed), never by a machine's clock.
//!
//! A node is judged only when its agent registered it (`ipam/v1/agents/<host>`). It is alive while
//! any agent of it keeps its liveness key (`ipam/v1/liveness/<host>`, on the agent's lease), and
//! active while its plugin writes: every plugin commit also rewrites the node's activity record
//! (`ipam/v1/activity/<host>`), so a node whose runtime keeps calling the plugin (directly, with
//! its agent down) moves that record's revision. A reclaimer that finds no liveness key starts a
//! countdown (`ipam/v1/missing/<host>`, deleted by the store once the grace has passed) and marks
//! the registration with the countdown's revision and the activity record's revision. The node is
//! dead only when the countdown is gone, no liveness key exists, and the activity record has not
//! moved since the mark; its release is guarded by exactly that (plus the registration's
//! revision), so a node that comes back, registers again or makes one plugin call stops the
//! release at its next write.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::allocator::{HostRelease, Ipam, ATTR_NODE};
use crate::error::IpamError;
use crate::kv::{Condition, KeyValue, KvError, KvStore, Op, Read, Revision, Txn};
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

/// Prefix of every activity record.
pub fn activity_dir() -> String {
    format!("{ROOT}activity/")
}

/// `host`'s activity record: rewritten by every commit of the plugin on that node, so its
/// revision moves whenever the node's runtime gets work done, whatever the node's agent does.
pub fn activity_key(host: &str) -> String {
    format!("{ROOT}activity/{host}")
}

/// Prefix of every grace countdown.
pub fn countdown_dir() -> String {
    format!("{ROOT}missing/")
}

/// `host`'s grace countdown: put by a reclaimer when it finds the node's liveness key gone, on a
/// lease of the grace period that nobody renews; the store deletes it once the grace has passed.
pub fn countdown_key(host: &str) -> String {
    format!("{ROOT}missing/{host}")
}

/// The reclaimer leader key: attached to the lease of the agent that reclaims; the others wait.
pub fn reclaimer_leader_key() -> String {
    format!("{ROOT}reclaimer-leader")
}

/// What the plugin writes into its node's activity record (JSON, readable with `etcdctl`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activity {
    /// The node (host) name.
    pub node: String,
    /// The version of the plugin that wrote it.
    pub plugin_version: String,
}

impl Activity {
    /// The record's bytes.
    ///
    /// # Errors
    /// [`IpamError::Internal`] if it cannot be encoded (it always can).
    pub fn encode(&self) -> Result<Vec<u8>, IpamError> {
        serde_json::to_vec(self)
            .map_err(|e| IpamError::Internal(format!("cannot encode an activity record: {e}")))
    }
}

/// Starts grace countdowns that the store times itself: a key the store deletes on its own once
/// the duration has passed (on etcd, a key on a lease of that TTL that is never renewed). The
/// machines' clocks play no part, so a skewed or stepped clock can neither shorten nor stretch a
/// grace period.
#[async_trait]
pub trait Countdowns: Send + Sync {
    /// Puts `key` = `value` (replacing any earlier countdown there), to be deleted by the store
    /// once `duration` has passed; returns the revision of the put.
    ///
    /// # Errors
    /// Store failures; [`IpamError::InvalidArgument`] when the store cannot time keys.
    async fn start(
        &self,
        key: &str,
        value: Vec<u8>,
        duration: Duration,
    ) -> Result<Revision, IpamError>;
}

/// For stores that cannot time keys (sled, redb, the in-memory store): every countdown is
/// refused, so no node is ever marked missing there (and so never reclaimed).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoCountdowns;

#[async_trait]
impl Countdowns for NoCountdowns {
    async fn start(&self, _: &str, _: Vec<u8>, _: Duration) -> Result<Revision, IpamError> {
        Err(IpamError::InvalidArgument(
            "dead-node reclaim needs a store that times keys itself (etcd leases)".into(),
        ))
    }
}

/// What a grace countdown holds (JSON): for whom, and how long it was started for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountdownRecord {
    /// The node.
    pub node: String,
    /// The grace period the countdown was started with (seconds).
    pub grace_seconds: u64,
}

/// A reclaimer's mark on a registration: which countdown runs for it and what the node's activity
/// record was when it was started. Revisions are the store's, never a clock's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissingMark {
    /// Revision of the countdown key put for this mark.
    pub countdown_revision: u64,
    /// Revision of the node's activity record when marked (0: it had none).
    pub activity_revision: u64,
    /// The grace period the countdown was started with (seconds).
    pub grace_seconds: u64,
}

/// What an agent stores when it registers its node (JSON, readable with `etcdctl`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// The node (host) name, as the plugin records it in the `node` attribute.
    pub node: String,
    /// When the agent last registered (unix seconds, the agent's clock; informative only).
    pub registered_at: u64,
    /// The version of the agent that registered.
    pub agent_version: String,
    /// A wall-clock mark that agents of earlier versions set (unix seconds). Read for display
    /// only; this version never decides on it, and clears it when it rewrites the registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing_since: Option<u64>,
    /// Set by a reclaimer when it found the node's liveness key gone and started its countdown;
    /// cleared when the node is seen alive or active, and whenever its agent registers again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing_mark: Option<MissingMark>,
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

/// Writes (or rewrites) `host`'s registration with no mark. An agent calls it at start and
/// whenever it had to grant itself a new lease; put the liveness key first, so that a reclaim in
/// progress stops on the liveness guard at once.
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
        missing_mark: None,
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
    /// An agent of it keeps its liveness key.
    Alive,
    /// No liveness key, but its plugin has committed since the node was marked: the node is up
    /// (its runtime gets work done) while its agent is not; never reclaimed, the mark is cleared.
    Active,
    /// No liveness key and no plugin activity since the mark; `mark` is `None` until a reclaimer
    /// starts the countdown.
    Missing {
        /// The reclaimer's mark, once made.
        mark: Option<MissingMark>,
    },
    /// The countdown has run out with no liveness key and no plugin activity since the mark.
    Dead {
        /// The mark whose countdown ran out.
        mark: MissingMark,
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
    /// Revision of its activity record (`None`: it has none).
    pub activity: Option<Revision>,
    /// Revision of its grace countdown (`None`: none runs).
    pub countdown: Option<Revision>,
    /// The decision.
    pub state: NodeState,
}

/// The decision for one node from what the store holds: alive while a liveness key exists;
/// active when its activity record moved since the mark; missing while its countdown runs (or
/// before a mark); dead once the countdown is gone with the activity record unmoved.
pub fn decide(
    live: bool,
    mark: Option<MissingMark>,
    activity: Option<Revision>,
    countdown: Option<Revision>,
) -> NodeState {
    let Some(mark) = mark.filter(|_| !live) else {
        return if live {
            NodeState::Alive
        } else {
            NodeState::Missing { mark: None }
        };
    };
    if activity.map_or(0, |r| r.0) != mark.activity_revision {
        NodeState::Active
    } else if countdown.is_some() {
        NodeState::Missing { mark: Some(mark) }
    } else {
        NodeState::Dead { mark }
    }
}

/// The host each key under `dir` names, with the key's revision.
fn by_host(dir: &str, kvs: Vec<KeyValue>) -> BTreeMap<String, Revision> {
    kvs.into_iter()
        .filter_map(|kv| {
            kv.key
                .strip_prefix(dir)
                .map(|host| (host.to_owned(), kv.revision))
        })
        .collect()
}

/// Every registered node and its state, from one batched read of the registrations, liveness
/// keys, activity records and countdowns. Writes nothing. Records under the reservation
/// pseudo-node's name or an invalid host name are left out (never judged).
///
/// # Errors
/// Store failures; [`IpamError::Corrupt`] for a registration that does not decode.
pub async fn survey(store: &dyn KvStore) -> Result<Vec<NodeStatus>, IpamError> {
    let reads = [
        Read::List(agents_dir()),
        Read::List(liveness_dir()),
        Read::List(activity_dir()),
        Read::List(countdown_dir()),
    ];
    let answers = store.read_many(&reads).await?;
    if answers.len() != reads.len() {
        return Err(IpamError::Store(KvError::other(format!(
            "the store answered a batch of {} reads with {} results",
            reads.len(),
            answers.len()
        ))));
    }
    let mut answers = answers.into_iter();
    let mut next = || answers.next().map(|a| a.into_listed()).transpose();
    let registrations = next()?.unwrap_or_default();
    let live = by_host(&liveness_dir(), next()?.unwrap_or_default());
    let activity = by_host(&activity_dir(), next()?.unwrap_or_default());
    let countdowns = by_host(&countdown_dir(), next()?.unwrap_or_default());
    let mut nodes = Vec::new();
    for kv in registrations {
        let Some(host) = kv.key.strip_prefix(&agents_dir()).map(str::to_owned) else {
            continue;
        };
        if validate_node(&host).is_err() {
            continue;
        }
        let registration = Registration::decode(&kv.key, &kv.value)?;
        let is_live = live.contains_key(&host);
        let activity = activity.get(&host).copied();
        let countdown = countdowns.get(&host).copied();
        nodes.push(NodeStatus {
            state: decide(is_live, registration.missing_mark, activity, countdown),
            host,
            registration,
            revision: kv.revision,
            live: is_live,
            activity,
            countdown,
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
    /// How long a node must stay without liveness key and without plugin activity, after it was
    /// first found so, before it is dead (the countdowns this pass starts run that long).
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
    /// Its liveness key exists, or its plugin committed since the mark: the mark (and any
    /// countdown, and an earlier version's wall-clock mark) was cleared.
    ClearedMark,
    /// Its liveness key was found gone (and no mark made yet): its countdown was started and the
    /// registration marked.
    MarkedMissing,
    /// Still missing: its countdown runs.
    StillMissing {
        /// The grace period the countdown was started with (seconds).
        grace_seconds: u64,
    },
    /// Dead, released, registration deleted.
    Reclaimed(HostRelease),
    /// A guard stopped the release (the node came back, its plugin wrote, or the extra guard
    /// stopped holding): whatever was released before that stays released; nothing more was
    /// written.
    Stopped {
        /// The guard key that no longer held.
        key: String,
        /// What the release did when it had finished before the guard stopped the deletion of
        /// the registration; `None` when the guard stopped the release itself (batches it had
        /// committed before stay released, uncounted).
        released: Option<HostRelease>,
    },
    /// Someone else changed the registration, the liveness key, the activity record or the
    /// countdown between the read and the write: left for the next pass.
    Changed,
    /// The store failed for this node; the pass went on with the others.
    Failed(String),
}

/// One node's line in a pass's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeOutcome {
    /// The node.
    pub host: String,
    /// Its state as the pass found it, before acting.
    pub state: NodeState,
    /// What was decided and done.
    pub action: NodeAction,
}

/// One reclaim pass: [`survey`], then for every registered node: clear the mark of a node seen
/// alive or active; start the countdown of a node whose liveness key is gone and mark it; release
/// a dead one with every write guarded by "no liveness key, registration unchanged, activity
/// record unmoved, countdown gone" (plus `options.extra_guard`), then delete its registration. A
/// write refused by the extra guard ends the pass (its node is reported `Stopped`, later nodes are
/// not reported). Never touches a node whose liveness key exists or whose plugin committed since
/// it was marked, a node that never registered, or the reservation pseudo-node.
///
/// # Errors
/// Failure of the first batched read; a failure for one node is reported in its outcome and the
/// pass goes on.
pub async fn reclaim_pass(
    store: Arc<dyn KvStore>,
    countdowns: &dyn Countdowns,
    options: &ReclaimOptions,
) -> Result<Vec<NodeOutcome>, IpamError> {
    let nodes = survey(store.as_ref()).await?;
    let mut outcomes = Vec::with_capacity(nodes.len());
    for node in nodes {
        let action = match act_on(&store, countdowns, &node, options).await {
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
            state: node.state,
            action,
        });
        if lost_extra_guard {
            break;
        }
    }
    Ok(outcomes)
}

/// "The store still holds what the survey saw of this node's evidence": its registration at the
/// same revision, no liveness key, the activity record unmoved.
fn evidence_guard(node: &NodeStatus) -> Vec<Condition> {
    vec![
        Condition::at_revision(agent_key(&node.host), node.revision),
        Condition::absent(liveness_key(&node.host)),
        match node.activity {
            Some(revision) => Condition::at_revision(activity_key(&node.host), revision),
            None => Condition::absent(activity_key(&node.host)),
        },
    ]
}

/// Commits `txn` with `guard` and the extra guard: `None` when written, else the key of the
/// condition that failed.
async fn commit_guarded(
    store: &dyn KvStore,
    mut txn: Txn,
    guard: &[Condition],
    extra_guard: &[Condition],
) -> Result<Option<String>, IpamError> {
    for condition in guard.iter().chain(extra_guard) {
        txn = txn.when(condition.clone());
    }
    match store.commit(txn).await {
        Ok(_) => Ok(None),
        Err(KvError::Conflict { key }) => Ok(Some(key)),
        Err(e) => Err(e.into()),
    }
}

/// Rewrites the registration of a node seen alive or active without any mark, and deletes its
/// countdown, while the registration is unchanged (and the extra guard holds).
async fn clear_mark(
    store: &dyn KvStore,
    node: &NodeStatus,
    extra_guard: &[Condition],
) -> Result<Option<String>, IpamError> {
    let registration = Registration {
        missing_since: None,
        missing_mark: None,
        ..node.registration.clone()
    };
    let key = agent_key(&node.host);
    let mut txn = Txn::new().then(Op::put(&key, registration.encode()?));
    if node.countdown.is_some() {
        txn = txn.then(Op::delete(countdown_key(&node.host)));
    }
    let guard = [Condition::at_revision(&key, node.revision)];
    commit_guarded(store, txn, &guard, extra_guard).await
}

/// Starts the countdown of a node found without liveness key, then marks its registration with
/// the countdown's revision and the activity record's, guarded by the evidence it saw and by the
/// countdown being the one just put.
async fn mark_missing(
    store: &dyn KvStore,
    countdowns: &dyn Countdowns,
    node: &NodeStatus,
    options: &ReclaimOptions,
) -> Result<Option<String>, IpamError> {
    let record = CountdownRecord {
        node: node.host.clone(),
        grace_seconds: options.grace.as_secs(),
    };
    let value = serde_json::to_vec(&record)
        .map_err(|e| IpamError::Internal(format!("cannot encode a countdown: {e}")))?;
    let countdown_revision = countdowns
        .start(&countdown_key(&node.host), value, options.grace)
        .await?;
    let registration = Registration {
        missing_since: None,
        missing_mark: Some(MissingMark {
            countdown_revision: countdown_revision.0,
            activity_revision: node.activity.map_or(0, |r| r.0),
            grace_seconds: options.grace.as_secs(),
        }),
        ..node.registration.clone()
    };
    let txn = Txn::new().then(Op::put(agent_key(&node.host), registration.encode()?));
    let mut guard = evidence_guard(node);
    guard.push(Condition::at_revision(
        countdown_key(&node.host),
        countdown_revision,
    ));
    commit_guarded(store, txn, &guard, &options.extra_guard).await
}

async fn act_on(
    store: &Arc<dyn KvStore>,
    countdowns: &dyn Countdowns,
    node: &NodeStatus,
    options: &ReclaimOptions,
) -> Result<NodeAction, IpamError> {
    // A refused write: stopped by the extra guard, or someone else changed the evidence.
    let changed = |conflict: Option<String>, action: NodeAction| match conflict {
        None => action,
        Some(key) if options.extra_guard.iter().any(|c| c.key() == key) => NodeAction::Stopped {
            key,
            released: None,
        },
        Some(_) => NodeAction::Changed,
    };
    let marked = node.registration.missing_mark.is_some()
        || node.registration.missing_since.is_some()
        || node.countdown.is_some();
    match node.state {
        NodeState::Alive | NodeState::Active if marked => {
            let conflict = clear_mark(store.as_ref(), node, &options.extra_guard).await?;
            Ok(changed(conflict, NodeAction::ClearedMark))
        }
        NodeState::Alive | NodeState::Active => Ok(NodeAction::Alive),
        NodeState::Missing { mark: None } => {
            let conflict = mark_missing(store.as_ref(), countdowns, node, options).await?;
            Ok(changed(conflict, NodeAction::MarkedMissing))
        }
        NodeState::Missing { mark: Some(mark) } => Ok(NodeAction::StillMissing {
            grace_seconds: mark.grace_seconds,
        }),
        NodeState::Dead { .. } => reclaim_dead(store, node, &options.extra_guard).await,
    }
}

/// Releases a dead node under its guard (its evidence unchanged and its countdown still gone),
/// then deletes its registration under the same guard.
async fn reclaim_dead(
    store: &Arc<dyn KvStore>,
    node: &NodeStatus,
    extra_guard: &[Condition],
) -> Result<NodeAction, IpamError> {
    let mut guard = evidence_guard(node);
    guard.push(Condition::absent(countdown_key(&node.host)));
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
    let txn = Txn::new().then(Op::delete(agent_key(&node.host)));
    match commit_guarded(store.as_ref(), txn, &guard, &[]).await? {
        None => Ok(NodeAction::Reclaimed(released)),
        Some(key) => Ok(NodeAction::Stopped {
            key,
            released: Some(released),
        }),
    }
}
