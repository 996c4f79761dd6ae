//! Dead-node reclaim through the storage trait alone: agents' registrations, the evidence that a
//! node is alive (its agents' liveness keys, its plugin's activity record), the per-node decision
//! (alive / active / missing / dead / reclaimed) and the guarded release of a dead node's blocks.
//! The grace period is timed by the store itself (a countdown key on an etcd lease that is never
//! renewed), never by a machine's clock.
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
//!
//! Silence is not evidence that a node's pods are gone: a node cut off from the store (a network
//! partition) is as silent as one that vanished, and its pods keep running with their addresses.
//! So a reclaim releases only what no running pod uses: the node's empty blocks are deleted and
//! its other blocks lose their affinity (their free addresses serve every node again). The node's
//! addresses are kept, marked on its registration (`blocks_released`) and held by a record without
//! lease under the countdown's key, until positive evidence comes: the node's own calls (its
//! runtime's DELs once it is back), or an operator's `node release <node> --addresses`
//! ([`forget_node`] then deletes the registration). Agents of release 0.1.0 read neither the record
//! nor the marks: one of them that leads the reclaim applies its own rule (it releases a dead
//! node's addresses too), which is why `docs/upgrading.md` upgrades the agents first.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::allocator::{HostRelease, Ipam, UndecodableObject, ATTR_NODE};
use crate::kv::{Condition, KeyValue, KvError, KvStore, Op, Read, Revision, Txn};
use crate::model::error::IpamError;
use crate::model::{keys, validate_host};

pub use crate::model::keys::{
    activity_dir, activity_key, agent_key, agents_dir, countdown_dir, countdown_key, liveness_dir,
    liveness_key, reclaimer_leader_key,
};

/// Calico's default: a node whose liveness has been gone this long is dead.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(15 * 60);

/// The longest grace a countdown can be timed for: etcd's longest lease (its `MaxLeaseTTL`, some
/// 285 years); etcd refuses a longer one ("too large lease TTL").
pub const MAX_GRACE_SECONDS: u64 = 9_000_000_000;

/// The pseudo-node the plugin makes network (gateway) reservations for: never a real node,
/// never reclaimed, whatever is stored under its name.
pub const RESERVATION_NODE: &str = "-";

/// What the plugin writes into its node's activity record (JSON, readable with `etcdctl`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activity {
    /// The node (host) name.
    pub node: String,
    /// The version of the plugin that wrote it.
    pub plugin_version: String,
    /// The newest stored format that plugin reads; absent in records of releases that predate
    /// the format record (they read format 3 at most). Read by `blockipamctl upgrade`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reads_format: Option<u8>,
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
/// the duration has passed (on etcd, a key on a lease of that TTL, renewed once right after the
/// put and never again). The machines' clocks play no part, so a skewed or stepped clock can
/// neither shorten nor stretch a grace period.
#[async_trait]
pub trait Countdowns: Send + Sync {
    /// Puts `key` = `value` (replacing any earlier countdown there) while every condition of
    /// `guard` holds, tested in the put's own transaction, to be deleted by the store once
    /// `duration` has passed counted from the put (not from any earlier step: a plugin commit
    /// after the put rewrites the node's activity record, one before it may not); returns the
    /// revision of the put.
    ///
    /// # Errors
    /// [`IpamError::Store`] with [`KvError::Conflict`] naming the first condition of `guard` that
    /// does not hold (nothing written); store failures; [`IpamError::InvalidArgument`] when the
    /// store cannot time keys.
    ///
    /// `also` are written in the same transaction, untimed (the node's generation).
    async fn start(
        &self,
        key: &str,
        value: Vec<u8>,
        duration: Duration,
        guard: &[Condition],
        also: &[Op],
    ) -> Result<Revision, IpamError>;
}

/// For stores that cannot time keys (sled, redb, the in-memory store): every countdown is
/// refused, so no node is ever marked missing there (and so never reclaimed).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoCountdowns;

#[async_trait]
impl Countdowns for NoCountdowns {
    async fn start(
        &self,
        _: &str,
        _: Vec<u8>,
        _: Duration,
        _: &[Condition],
        _: &[Op],
    ) -> Result<Revision, IpamError> {
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
    /// Set on the record a reclaim leaves, without lease, once the node's blocks were released:
    /// its addresses are kept until released by hand or by the node itself.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub addresses_kept: bool,
}

impl CountdownRecord {
    fn encode(&self) -> Result<Vec<u8>, IpamError> {
        serde_json::to_vec(self)
            .map_err(|e| IpamError::Internal(format!("cannot encode a countdown: {e}")))
    }
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
    /// The newest stored format that agent reads; absent in registrations of releases that
    /// predate the format record (they read format 3 at most). Read by `blockipamctl upgrade`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reads_format: Option<u8>,
    /// A wall-clock mark that agents of earlier versions set (unix seconds). Read for display
    /// only; this version never decides on it, and clears it when it rewrites the registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing_since: Option<u64>,
    /// Set by a reclaimer when it found the node's liveness key gone and started its countdown;
    /// cleared when the node is seen alive or active, and whenever its agent registers again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing_mark: Option<MissingMark>,
    /// Set by the reclaim of a dead node, beside its mark: its blocks were released, its
    /// addresses are kept (a silent node may be cut off, its pods still running). Cleared with
    /// the mark when the node is seen alive or active.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub blocks_released: bool,
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
        reads_format: Some(crate::model::FORMAT_VERSION),
        missing_since: None,
        missing_mark: None,
        blocks_released: false,
    };
    let txn = Txn::new()
        .then(Op::put(agent_key(host), registration.encode()?))
        .then(node_generation_change(host, "registration"));
    Ok(store.commit(txn).await?)
}

/// The put of `host`'s node generation ([`crate::model::keys::node_generation`]) that goes in
/// the transaction of every write of its registration, grace countdown or activity record,
/// naming the writer.
pub(crate) fn node_generation_change(host: &str, writer: &str) -> Op {
    Op::put(crate::model::keys::node_generation(host), writer.as_bytes())
}

/// True when `bytes` is a registration with no reclaimer's mark, stored exactly as this build
/// writes one (a registration with fields this build does not know counts as marked: a later
/// release may mark it in a way this build cannot see).
pub(crate) fn is_unmarked_registration(bytes: &[u8]) -> bool {
    serde_json::from_slice::<Registration>(bytes).is_ok_and(|registration| {
        registration.missing_since.is_none()
            && registration.missing_mark.is_none()
            && !registration.blocks_released
            && registration.encode().is_ok_and(|again| again == bytes)
    })
}

/// Index entries deleted per transaction when a node is forgotten.
const FORGET_INDEX_BATCH: usize = 100;

/// Forgets `host` once an operator released its addresses (`node release <node> --addresses`):
/// deletes its borrowed-block index (also when it has no registration), then its registration,
/// its agent's record of live disagreements, whatever is under its countdown's key and its node
/// generation, in one transaction guarded by "no liveness key, registration unchanged". A node an
/// agent keeps live stays registered and keeps its index.
/// Returns whether a registration was deleted (`false` also when there was none).
///
/// # Errors
/// [`IpamError::InvalidArgument`] for an invalid host name or the reservation pseudo-node; store
/// failures.
pub async fn forget_node(store: &dyn KvStore, host: &str) -> Result<bool, IpamError> {
    validate_node(host)?;
    let registration = store.get(&agent_key(host)).await?;
    let guard = [
        match &registration {
            Some(registration) => Condition::at_revision(agent_key(host), registration.revision),
            None => Condition::absent(agent_key(host)),
        },
        Condition::absent(liveness_key(host)),
    ];
    // Its borrowed-block index, under the same guard, before the registration goes (a node an
    // agent keeps live keeps its index; so does one whose agent registers meanwhile).
    let borrowed = store
        .list(&crate::model::keys::host_borrowed_dir(host))
        .await?;
    for chunk in borrowed.chunks(FORGET_INDEX_BATCH) {
        let mut txn = Txn::new();
        for kv in chunk {
            txn = txn.then(Op::delete(&kv.key));
        }
        if commit_guarded(store, txn, &guard, &[]).await?.is_some() {
            return Ok(false);
        }
    }
    if registration.is_none() {
        return Ok(false);
    }
    let txn = Txn::new()
        .then(Op::delete(agent_key(host)))
        .then(Op::delete(countdown_key(host)))
        .then(Op::delete(crate::model::keys::live_disagreements_key(host)))
        .then(Op::delete(crate::model::keys::node_generation(host)));
    Ok(commit_guarded(store, txn, &guard, &[]).await?.is_none())
}

/// Refuses names no node may have: invalid host names and the reservation pseudo-node. What the
/// agent, `blockipamctl` and `install-cni` check a node name given to them with.
///
/// # Errors
/// [`IpamError::InvalidArgument`] naming what is wrong.
pub fn validate_node(host: &str) -> Result<(), IpamError> {
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
    /// (its runtime gets work done) while its agent is not; not reclaimed: it is marked again,
    /// with a new countdown, from the activity seen.
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
    /// Dead, and its blocks were released; its addresses are kept until the node comes back
    /// and releases them, or an operator runs `node release <node> --addresses`.
    Reclaimed {
        /// The mark whose countdown ran out.
        mark: MissingMark,
    },
    /// Its registration does not decode (damaged, or written by a version this one cannot
    /// read): nothing is done for it, and it is reported; the other nodes are judged as usual.
    Unreadable,
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
    /// Why the registration could not be read ([`NodeState::Unreadable`] only).
    pub problem: Option<String>,
}

/// The decision for one node from what the store holds: alive while a liveness key exists;
/// active when its activity record moved since the mark; reclaimed once a reclaim released its
/// blocks (`blocks_released`, whatever the record under the countdown's key); missing while its
/// countdown runs (or before a mark); dead once the countdown is gone with the activity record
/// unmoved.
pub fn decide(
    live: bool,
    mark: Option<MissingMark>,
    blocks_released: bool,
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
    } else if blocks_released {
        NodeState::Reclaimed { mark }
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
/// pseudo-node's name or an invalid host name are left out (never judged); a registration that
/// does not decode is listed as [`NodeState::Unreadable`], with the reason.
///
/// # Errors
/// Store failures.
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
        let is_live = live.contains_key(&host);
        let activity = activity.get(&host).copied();
        let countdown = countdowns.get(&host).copied();
        let registration = match Registration::decode(&kv.key, &kv.value) {
            Ok(registration) => registration,
            Err(e) => {
                nodes.push(NodeStatus {
                    registration: Registration {
                        node: host.clone(),
                        registered_at: 0,
                        agent_version: String::new(),
                        reads_format: None,
                        missing_since: None,
                        missing_mark: None,
                        blocks_released: false,
                    },
                    host,
                    revision: kv.revision,
                    live: is_live,
                    activity,
                    countdown,
                    state: NodeState::Unreadable,
                    problem: Some(e.to_string()),
                });
                continue;
            }
        };
        nodes.push(NodeStatus {
            state: decide(
                is_live,
                registration.missing_mark,
                registration.blocks_released,
                activity,
                countdown,
            ),
            problem: None,
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

/// What a node holds: the blocks a reclaim releases, and the addresses it keeps (released only
/// by the node itself or by `node release <node> --addresses`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReleasePreview {
    /// Blocks affine to the node (a reclaim deletes the empty ones, the others lose their
    /// affinity).
    pub blocks: u64,
    /// Addresses `node release <node> --addresses` would release: every address of every handle
    /// holding an address recorded for the node.
    pub addresses: u64,
}

/// What each of `hosts` holds now (one listing of every allocation, one listing of each host's
/// blocks), and each block object (or owner key) that cannot be decoded, whose block's addresses
/// the counts leave out (its key still counts it among its host's blocks). Writes nothing.
///
/// # Errors
/// Store failures.
pub async fn preview_release(
    store: Arc<dyn KvStore>,
    hosts: &[&str],
) -> Result<(BTreeMap<String, ReleasePreview>, Vec<UndecodableObject>), IpamError> {
    let mut previews = BTreeMap::new();
    if hosts.is_empty() {
        return Ok((previews, Vec::new()));
    }
    let (allocations, undecodable) = Ipam::new(Arc::clone(&store))
        .list_allocations_each()
        .await?;
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
    Ok((previews, undecodable))
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
    /// Its liveness key exists: the mark (and any countdown, and an earlier version's wall-clock
    /// mark) was cleared.
    ClearedMark,
    /// No liveness key, but its plugin committed since the mark (its agent is down, the node is
    /// at work): a new countdown was started and the registration marked again with the activity
    /// record's current revision, so the grace runs from the activity seen, and the node stays
    /// marked (it is not cleared to be found missing again at the next pass).
    MarkedAgain,
    /// Its liveness key was found gone (and no mark made yet): its countdown was started and the
    /// registration marked.
    MarkedMissing,
    /// Still missing: its countdown runs.
    StillMissing {
        /// The grace period the countdown was started with (seconds).
        grace_seconds: u64,
    },
    /// Dead: its blocks were released (empty ones deleted, the others without affinity) and its
    /// registration marked `blocks_released`; its addresses are kept (`released_addresses` is
    /// empty).
    Reclaimed(HostRelease),
    /// Reclaimed earlier: its addresses are still kept, nothing to do.
    AddressesKept,
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
/// alive; start the countdown of a node whose liveness key is gone and mark it, and start it again
/// and mark it anew for a node whose plugin committed since its mark (active); release
/// the blocks of a dead one with every write guarded by "no liveness key, registration unchanged,
/// activity record unmoved, countdown gone" (plus `options.extra_guard`), then mark its
/// registration `blocks_released` and leave the record that holds its addresses. A write refused
/// by the extra guard ends the pass (its node is reported `Stopped`, later nodes are not
/// reported). Never releases an address; never touches a node whose liveness key exists or whose
/// plugin committed since it was marked, a node that never registered, or the reservation
/// pseudo-node.
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

/// Rewrites the registration of a node seen alive without any mark, and deletes its countdown,
/// while the registration is unchanged (and the extra guard holds).
async fn clear_mark(
    store: &dyn KvStore,
    node: &NodeStatus,
    extra_guard: &[Condition],
) -> Result<Option<String>, IpamError> {
    let registration = Registration {
        missing_since: None,
        missing_mark: None,
        blocks_released: false,
        ..node.registration.clone()
    };
    let key = agent_key(&node.host);
    let mut txn = Txn::new()
        .then(Op::put(&key, registration.encode()?))
        .then(node_generation_change(&node.host, "mark-cleared"));
    if node.countdown.is_some() {
        txn = txn.then(Op::delete(countdown_key(&node.host)));
    }
    let guard = [Condition::at_revision(&key, node.revision)];
    commit_guarded(store, txn, &guard, extra_guard).await
}

/// Starts the countdown of a node found without liveness key (replacing one that runs or ran for
/// an earlier mark), then marks its registration with the countdown's revision and the activity
/// record's, guarded by the evidence it saw and by the countdown being the one just put. The
/// countdown itself is started only while the evidence and the countdown the survey saw are
/// unchanged (and the extra guard holds): a reclaimer that looked before another one marked the
/// node (a concurrent `gc --dead-nodes`, a former leader paused past its lease) cannot replace
/// the marked countdown with one of its own, which, shorter, would end the grace before the mark
/// says.
async fn mark_missing(
    store: &dyn KvStore,
    countdowns: &dyn Countdowns,
    node: &NodeStatus,
    options: &ReclaimOptions,
) -> Result<Option<String>, IpamError> {
    let value = CountdownRecord {
        node: node.host.clone(),
        grace_seconds: options.grace.as_secs(),
        addresses_kept: false,
    }
    .encode()?;
    let mut start_guard = evidence_guard(node);
    start_guard.push(match node.countdown {
        Some(revision) => Condition::at_revision(countdown_key(&node.host), revision),
        None => Condition::absent(countdown_key(&node.host)),
    });
    start_guard.extend(options.extra_guard.iter().cloned());
    let countdown_revision = match countdowns
        .start(
            &countdown_key(&node.host),
            value,
            options.grace,
            &start_guard,
            &[node_generation_change(&node.host, "countdown")],
        )
        .await
    {
        Ok(revision) => revision,
        Err(IpamError::Store(KvError::Conflict { key })) => return Ok(Some(key)),
        Err(e) => return Err(e),
    };
    let registration = Registration {
        missing_since: None,
        missing_mark: Some(MissingMark {
            countdown_revision: countdown_revision.0,
            activity_revision: node.activity.map_or(0, |r| r.0),
            grace_seconds: options.grace.as_secs(),
        }),
        blocks_released: false,
        ..node.registration.clone()
    };
    let txn = Txn::new()
        .then(Op::put(agent_key(&node.host), registration.encode()?))
        .then(node_generation_change(&node.host, "mark"));
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
        NodeState::Alive if marked => {
            let conflict = clear_mark(store.as_ref(), node, &options.extra_guard).await?;
            Ok(changed(conflict, NodeAction::ClearedMark))
        }
        NodeState::Alive => Ok(NodeAction::Alive),
        NodeState::Active => {
            let conflict = mark_missing(store.as_ref(), countdowns, node, options).await?;
            Ok(changed(conflict, NodeAction::MarkedAgain))
        }
        NodeState::Missing { mark: None } => {
            let conflict = mark_missing(store.as_ref(), countdowns, node, options).await?;
            Ok(changed(conflict, NodeAction::MarkedMissing))
        }
        NodeState::Missing { mark: Some(mark) } => Ok(NodeAction::StillMissing {
            grace_seconds: mark.grace_seconds,
        }),
        NodeState::Dead { mark } => reclaim_dead(store, node, mark, &options.extra_guard).await,
        NodeState::Reclaimed { .. } => Ok(NodeAction::AddressesKept),
        NodeState::Unreadable => {
            Ok(NodeAction::Failed(format!(
            "{}; nothing is done for this node until its agent registers again (or the record is \
             deleted)",
            node.problem.as_deref().unwrap_or("its registration does not decode")
        )))
        }
    }
}

/// Releases a dead node's blocks under its guard (its evidence unchanged and its countdown still
/// gone), then, under the same guard, marks its registration `blocks_released` and puts the
/// record (without lease) that says its addresses are kept. Its addresses are not released: a
/// silent node may be cut off with its pods running.
async fn reclaim_dead(
    store: &Arc<dyn KvStore>,
    node: &NodeStatus,
    mark: MissingMark,
    extra_guard: &[Condition],
) -> Result<NodeAction, IpamError> {
    let mut guard = evidence_guard(node);
    guard.push(Condition::absent(countdown_key(&node.host)));
    guard.extend(extra_guard.iter().cloned());
    let ipam = Ipam::new(Arc::clone(store)).guarded_by(guard.clone());
    let released = match ipam.release_host(&node.host, false).await {
        Ok(released) => released,
        Err(IpamError::GuardLost { key }) => {
            return Ok(NodeAction::Stopped {
                key,
                released: None,
            })
        }
        Err(e) => return Err(e),
    };
    // The registration still carries the mark the decision read (its revision is guarded).
    let registration = Registration {
        blocks_released: true,
        ..node.registration.clone()
    };
    let hold = CountdownRecord {
        node: node.host.clone(),
        grace_seconds: mark.grace_seconds,
        addresses_kept: true,
    };
    let txn = Txn::new()
        .then(Op::put(agent_key(&node.host), registration.encode()?))
        .then(Op::put(countdown_key(&node.host), hold.encode()?))
        .then(node_generation_change(&node.host, "reclaim"));
    match commit_guarded(store.as_ref(), txn, &guard, &[]).await? {
        None => Ok(NodeAction::Reclaimed(released)),
        Some(key) => Ok(NodeAction::Stopped {
            key,
            released: Some(released),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ROOT;

    #[test]
    fn the_default_grace_is_calicos_fifteen_minutes() {
        assert_eq!(DEFAULT_GRACE, Duration::from_secs(900));
        assert_eq!(ReclaimOptions::default().grace, DEFAULT_GRACE);
    }

    #[test]
    fn every_key_lives_under_its_own_directory_of_the_ipam_root() {
        for (key, dir) in [
            (agent_key("node-a"), agents_dir()),
            (liveness_key("node-a"), liveness_dir()),
            (activity_key("node-a"), activity_dir()),
            (countdown_key("node-a"), countdown_dir()),
        ] {
            assert_eq!(key, format!("{dir}node-a"));
            assert!(dir.starts_with(ROOT) && dir.ends_with('/'), "{dir}");
        }
        assert_eq!(reclaimer_leader_key(), format!("{ROOT}reclaimer-leader"));
    }

    #[test]
    fn the_activity_record_names_the_node_and_the_plugin_version() {
        let record = Activity {
            node: "node-a".into(),
            plugin_version: "1.2.3".into(),
            reads_format: Some(4),
        };
        let bytes = record.encode().expect("encode");
        let back: Activity = serde_json::from_slice(&bytes).expect("JSON");
        assert_eq!(back, record);
    }

    #[tokio::test]
    async fn stores_that_cannot_time_keys_start_no_countdown() {
        let refused = NoCountdowns
            .start(
                &countdown_key("node-a"),
                Vec::new(),
                DEFAULT_GRACE,
                &[],
                &[],
            )
            .await;
        assert!(
            matches!(refused, Err(IpamError::InvalidArgument(_))),
            "{refused:?}"
        );
    }

    #[test]
    fn the_decision_needs_no_clock() {
        let mark = MissingMark {
            countdown_revision: 7,
            activity_revision: 5,
            grace_seconds: 900,
        };
        let at = |r| Some(Revision(r));
        assert_eq!(
            decide(true, Some(mark), false, at(9), None),
            NodeState::Alive
        );
        assert_eq!(
            decide(false, None, false, at(5), None),
            NodeState::Missing { mark: None }
        );
        assert_eq!(
            decide(false, Some(mark), false, at(6), None),
            NodeState::Active
        );
        assert_eq!(
            decide(false, Some(mark), false, at(5), at(7)),
            NodeState::Missing { mark: Some(mark) }
        );
        assert_eq!(
            decide(false, Some(mark), false, at(5), None),
            NodeState::Dead { mark }
        );
        let unmarked_activity = MissingMark {
            activity_revision: 0,
            ..mark
        };
        assert_eq!(
            decide(false, Some(unmarked_activity), false, None, None),
            NodeState::Dead {
                mark: unmarked_activity
            }
        );
        assert_eq!(
            decide(false, Some(unmarked_activity), false, at(3), None),
            NodeState::Active
        );
        // Reclaimed: whatever lies under the countdown's key (the record that keeps the
        // addresses); back to alive or active as soon as the node shows itself.
        for countdown in [None, at(8)] {
            assert_eq!(
                decide(false, Some(mark), true, at(5), countdown),
                NodeState::Reclaimed { mark }
            );
        }
        assert_eq!(
            decide(true, Some(mark), true, at(5), at(8)),
            NodeState::Alive
        );
        assert_eq!(
            decide(false, Some(mark), true, at(6), at(8)),
            NodeState::Active
        );
        assert_eq!(
            decide(false, None, true, at(5), None),
            NodeState::Missing { mark: None }
        );
    }
}
