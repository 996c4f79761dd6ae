//! Liveness and dead-node reclaim (etcd only): the agent registers its node, keeps the node's
//! lease-backed liveness key alive, and, while it holds the reclaimer leader key, releases the
//! blocks (never the addresses) of registered nodes that stayed without liveness key and without
//! plugin activity for a whole grace countdown timed by etcd (`ipam_core::dead_nodes`). See
//! docs/agent.md, "Liveness and dead-node reclaim".

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ipam_core::model::timestamp::unix_now;

use backend_etcd::lease::{Holder, LeaseSession, LeaseState, LeasedKey};
use backend_etcd::EtcdConfig;
use blockipam_store::countdowns::LeaseCountdowns;
use blockipam_store::DatastoreSettings;
use ipam_core::dead_nodes::{
    liveness_key, reclaim_pass, reclaimer_leader_key, register, validate_node, NodeAction,
    NodeOutcome, NodeState, ReclaimOptions,
};
use ipam_core::{Condition, EmptyBlockFilter, HostRelease, Ipam, KvStore, Revision};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::counters::ReclaimCounters;
use crate::{AgentArgs, AgentError};

/// The agent version written into its registration.
const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// What the liveness and reclaim tasks need to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LivenessSettings {
    /// This agent's node, as the plugin records it (`node` attribute).
    pub node: String,
    /// The lease TTL of the liveness key (whole seconds).
    pub ttl: Duration,
    /// How long a node's liveness must have been gone before it is dead.
    pub grace: Duration,
    /// How often the reclaimer looks (and tries to become leader).
    pub interval: Duration,
    /// False: keep this node's liveness, never reclaim others (`--no-reclaim`).
    pub reclaim: bool,
    /// As reclaimer leader, release the empty blocks hosts no longer need once they have been
    /// empty this long (`--empty-block-release-seconds`; `None`: never).
    pub empty_block_release: Option<Duration>,
}

/// Calico's node-name file, read when `--node` is not given (what the plugin reads too).
pub const NODENAME_FILE: &str = blockipam_store::node_name::DEFAULT_NODENAME_FILE;

impl LivenessSettings {
    /// The settings the flags give; the node is `--node` (`NODENAME`), else the contents of
    /// [`NODENAME_FILE`], else the host name lower-cased: the plugin's own order.
    ///
    /// # Errors
    /// [`AgentError`] when no node name can be found, or it is not a valid node name.
    pub fn from_args(args: &AgentArgs) -> Result<LivenessSettings, AgentError> {
        let node = node_name(args)?;
        Ok(LivenessSettings {
            node,
            ttl: Duration::from_secs(args.liveness_ttl_seconds),
            grace: Duration::from_secs(args.dead_node_grace_seconds),
            interval: Duration::from_secs(args.reclaim_interval_seconds),
            reclaim: !args.no_reclaim,
            empty_block_release: (args.empty_block_release_seconds > 0)
                .then(|| Duration::from_secs(args.empty_block_release_seconds)),
        })
    }
}

/// This node's name: `--node` (`NODENAME`), else the contents of [`NODENAME_FILE`], else the host
/// name lower-cased (the plugin's own order).
///
/// # Errors
/// [`AgentError`] when no node name can be found, or it is not a valid node name.
pub fn node_name(args: &AgentArgs) -> Result<String, AgentError> {
    let node = match &args.node {
        Some(node) => node.clone(),
        None => default_node_name()?,
    };
    validate_node(&node).map_err(|e| AgentError::new(format!("invalid --node: {e}")))?;
    Ok(node)
}

fn default_node_name() -> Result<String, AgentError> {
    blockipam_store::node_name::from_file_or_host(Path::new(NODENAME_FILE)).ok_or_else(|| {
        AgentError::new(format!(
            "cannot determine the node name: no --node (NODENAME), nothing in {NODENAME_FILE}, \
             and no host name"
        ))
    })
}

/// The running liveness key and reclaimer; [`stop`](Self::stop) it at shutdown.
#[derive(Debug)]
pub struct Liveness {
    liveness: LeasedKey,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Liveness {
    /// Connects a lease session, puts this node's liveness key on a lease (first, so that a
    /// reclaim of this node in progress stops at once), registers the node, and starts the task
    /// that keeps both current and runs the reclaimer.
    ///
    /// # Errors
    /// [`AgentError`] when etcd refuses or does not answer the first lease, put or registration.
    pub async fn start(
        settings: LivenessSettings,
        etcd: &EtcdConfig,
        store: Arc<dyn KvStore>,
        counters: Arc<ReclaimCounters>,
    ) -> Result<Liveness, AgentError> {
        let session = Arc::new(
            LeaseSession::connect(etcd, settings.ttl)
                .await
                .map_err(|e| AgentError::new(format!("liveness: cannot reach etcd: {e}")))?,
        );
        let liveness = LeasedKey::start(
            Arc::clone(&session),
            &liveness_key(&settings.node),
            settings.node.clone().into_bytes(),
        )
        .await
        .map_err(|e| AgentError::new(format!("liveness: cannot put the liveness key: {e}")))?;
        register(store.as_ref(), &settings.node, AGENT_VERSION, unix_now())
            .await
            .map_err(|e| AgentError::new(format!("liveness: cannot register the node: {e}")))?;
        tracing::info!(
            node = %settings.node,
            ttl_seconds = settings.ttl.as_secs(),
            grace_seconds = settings.grace.as_secs(),
            reclaim = settings.reclaim,
            "node registered; liveness key kept on an etcd lease"
        );
        counters
            .registered
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(run_loop(
            settings,
            session,
            liveness.watch(),
            store,
            counters,
            stopped,
        ));
        Ok(Liveness {
            liveness,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Stops the reclaimer and revokes the lease: the liveness key (and the leader key, when
    /// held) go at once; the registration stays, so the node is judged again by the others (a
    /// restart within the grace period is never reclaimed).
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        self.liveness.stop(true).await;
    }
}

async fn run_loop(
    settings: LivenessSettings,
    session: Arc<LeaseSession>,
    mut lease: watch::Receiver<LeaseState>,
    store: Arc<dyn KvStore>,
    counters: Arc<ReclaimCounters>,
    mut stopped: oneshot::Receiver<()>,
) {
    let mut registered_generation = lease.borrow().generation;
    let mut ticks = tokio::time::interval(settings.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            changed = lease.changed() => {
                if changed.is_err() {
                    // The keep-alive task ended (it never does before stop): nothing to follow.
                    return;
                }
            }
            _ = ticks.tick() => {}
        }
        let state = *lease.borrow_and_update();
        if state.lease.is_some() && state.generation != registered_generation {
            // A new lease after a lost one: register again, which clears a mark a reclaimer
            // may have set meanwhile and stops a reclaim of this node.
            match register(store.as_ref(), &settings.node, AGENT_VERSION, unix_now()).await {
                Ok(_) => {
                    registered_generation = state.generation;
                    tracing::info!(node = %settings.node, "node registered again on a new lease");
                }
                Err(e) => {
                    tracing::warn!(node = %settings.node, "registering again failed, retrying: {e}")
                }
            }
        }
        counters.registered.store(
            state.lease.is_some() && state.generation == registered_generation,
            std::sync::atomic::Ordering::Relaxed,
        );
        let leading = match state.lease {
            Some(id) => {
                keep_liveness_key(&settings.node, &session, id, store.as_ref()).await;
                settings.reclaim
                    && reclaim_if_leader(&settings, &session, id, &store, &counters).await
            }
            None => false,
        };
        counters
            .reclaimer_leader
            .store(leading, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Puts this node's liveness key again on this agent's lease when it is gone while the lease
/// lives: another agent of the same node name revoked its own lease (a clean stop), taking the
/// shared key with it.
async fn keep_liveness_key(node: &str, session: &LeaseSession, lease: i64, store: &dyn KvStore) {
    let key = liveness_key(node);
    match store.get(&key).await {
        Ok(Some(_)) => {}
        Ok(None) => {
            tracing::warn!(
                node,
                "the node's liveness key was gone while this agent's lease lives (another agent \
                 of the same node name stopped?): putting it again"
            );
            if let Err(e) = session.put(lease, &key, node.as_bytes()).await {
                tracing::warn!(node, "putting the liveness key again failed, retrying: {e}");
            }
        }
        Err(e) => tracing::debug!(node, "cannot read the liveness key: {e}"),
    }
}

/// Becomes (or stays) the reclaimer leader if nobody else is, and then runs one pass, every
/// write guarded by "the leader key is still at the revision this agent put it". True when this
/// agent holds the leader key at the end of the pass, false when another does, the key could not
/// be read, or the pass found the key changed (it then stops, and neither its partial count of
/// the nodes nor the empty-block release follows).
async fn reclaim_if_leader(
    settings: &LivenessSettings,
    session: &Arc<LeaseSession>,
    lease: i64,
    store: &Arc<dyn KvStore>,
    counters: &ReclaimCounters,
) -> bool {
    let leader_key = reclaimer_leader_key();
    let revision = match session
        .acquire(lease, &leader_key, settings.node.as_bytes())
        .await
    {
        Ok(Holder::Mine { revision }) => revision,
        Ok(Holder::Other { value }) => {
            tracing::debug!(leader = %String::from_utf8_lossy(&value), "another agent reclaims");
            return false;
        }
        Err(e) => {
            tracing::warn!("reclaimer: cannot read or take the leader key: {e}");
            return false;
        }
    };
    let leader_guard = Condition::at_revision(&leader_key, Revision(revision));
    let options = ReclaimOptions {
        grace: settings.grace,
        extra_guard: vec![leader_guard.clone()],
    };
    let session = Arc::clone(session);
    let countdowns = LeaseCountdowns::new(session);
    match reclaim_pass(Arc::clone(store), &countdowns, &options).await {
        Ok(outcomes) => {
            for outcome in &outcomes {
                report(outcome, counters);
            }
            match pass_summary(&outcomes, &leader_key) {
                Some(by_state) => counters.record_pass(by_state),
                None => {
                    tracing::info!(
                        "reclaimer: the leader key changed during the pass (another agent \
                         leads now): the pass stopped"
                    );
                    return false;
                }
            }
        }
        Err(e) => tracing::warn!("reclaimer: the pass failed: {e}"),
    }
    if let Some(age) = settings.empty_block_release {
        // The same pass as `blockipamctl blocks release-empty --apply`, guarded by the leadership.
        let ipam = Ipam::new(Arc::clone(store)).guarded_by(vec![leader_guard]);
        let filter = EmptyBlockFilter {
            older_than_seconds: age.as_secs(),
            only_unselected: false,
        };
        match ipam.release_empty_blocks_each(filter, true).await {
            Ok((blocks, undecodable)) => {
                let released = blocks.iter().filter(|b| b.released).count();
                if released > 0 {
                    tracing::info!(
                        released,
                        "reclaimer: released empty blocks hosts no longer need"
                    );
                }
                for object in &undecodable {
                    tracing::warn!(
                        key = %object.key,
                        "reclaimer: a block cannot be decoded ({}); it is not released, nor is \
                         any empty block of its host taken to be beyond the host's newest, until \
                         it is repaired (blockipamctl check)",
                        object.message
                    );
                }
            }
            Err(e) => tracing::warn!("reclaimer: releasing empty blocks failed: {e}"),
        }
    }
    true
}

/// The registered nodes by state (in [`crate::counters::NODE_STATES`] order) a whole pass judged;
/// `None` when the pass stopped because `leader_key` no longer held (it judged only some nodes,
/// and this agent no longer leads).
fn pass_summary(outcomes: &[NodeOutcome], leader_key: &str) -> Option<[u64; 6]> {
    let lost_leadership = outcomes.last().is_some_and(
        |outcome| matches!(&outcome.action, NodeAction::Stopped { key, .. } if key == leader_key),
    );
    if lost_leadership {
        return None;
    }
    let mut by_state = [0u64; 6];
    for outcome in outcomes {
        let index = match outcome.state {
            NodeState::Alive => 0,
            NodeState::Active => 1,
            NodeState::Missing { .. } => 2,
            NodeState::Dead { .. } => 3,
            NodeState::Reclaimed { .. } => 4,
            NodeState::Unreadable => 5,
        };
        by_state[index] += 1;
    }
    Some(by_state)
}

/// Logs one node's outcome and counts a release.
fn report(outcome: &NodeOutcome, counters: &ReclaimCounters) {
    let node = outcome.host.as_str();
    match &outcome.action {
        NodeAction::Alive => {}
        NodeAction::ClearedMark => {
            tracing::info!(node, "node is alive: its missing mark was cleared")
        }
        NodeAction::MarkedAgain => tracing::info!(
            node,
            "node's agent is still down but its plugin is at work: grace countdown started again \
             from the activity seen"
        ),
        NodeAction::MarkedMissing => tracing::warn!(
            node,
            "node's liveness key is gone: grace countdown started (reclaimed when it runs out \
             with no agent back and no plugin call on that node meanwhile)"
        ),
        NodeAction::StillMissing { grace_seconds } => {
            tracing::debug!(
                node,
                grace_seconds,
                "node still missing: its countdown runs"
            )
        }
        NodeAction::Reclaimed(release) => {
            tracing::warn!(
                node,
                blocks = blocks_released(release),
                deleted_blocks = ?release.deleted_blocks,
                unassigned_blocks = ?release.unassigned_blocks,
                "dead node reclaimed: its blocks were released; its addresses are kept (it may \
                 be cut off with its pods running): once you know its pods are gone, run \
                 `blockipamctl node release <node> --addresses`"
            );
            record_release(release, counters);
        }
        NodeAction::Stopped { key, released } => {
            tracing::warn!(
                node,
                guard = %key,
                "reclaim stopped: the node came back or this agent lost the leadership; nothing \
                 more written"
            );
            if let Some(release) = released {
                record_release(release, counters);
            }
        }
        NodeAction::AddressesKept => tracing::debug!(
            node,
            "node reclaimed earlier: its addresses are kept until it comes back or they are \
             released by hand"
        ),
        NodeAction::Changed => {
            tracing::debug!(
                node,
                "registration changed meanwhile: left for the next pass"
            )
        }
        NodeAction::Failed(message) => tracing::warn!(node, "reclaim failed: {message}"),
    }
}

/// The blocks a node's release let go of: the empty ones deleted and the others unassigned.
fn blocks_released(release: &HostRelease) -> usize {
    release.deleted_blocks.len() + release.unassigned_blocks.len()
}

/// Counts one reclaimed node with the blocks its release let go of.
fn record_release(release: &HostRelease, counters: &ReclaimCounters) {
    counters.record_node(blocks_released(release) as u64);
}

/// Liveness and the reclaimer, started in the background: the agent serves its socket at once,
/// even when etcd cannot be reached at boot, and the node registers as soon as etcd answers.
#[derive(Debug)]
pub struct LivenessTask {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl LivenessTask {
    /// Stops trying to start, or stops the running liveness (see [`Liveness::stop`]).
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// The longest wait between two attempts to reach etcd for liveness.
const MAX_START_BACKOFF: Duration = Duration::from_secs(30);
/// The wait before the second attempt to reach etcd for liveness.
const FIRST_START_BACKOFF: Duration = Duration::from_secs(1);

/// The wait after `backoff` before the next attempt: doubled, at most [`MAX_START_BACKOFF`].
fn next_start_backoff(backoff: Duration) -> Duration {
    (backoff * 2).min(MAX_START_BACKOFF)
}

/// Starts liveness and the reclaimer when the store is etcd, in the background, retrying (1 s,
/// doubling up to 30 s) until etcd answers; on sled and redb logs that they apply to etcd only
/// and returns `None`.
///
/// # Errors
/// As [`LivenessSettings::from_args`]; incomplete etcd settings.
pub async fn start_for(
    args: &AgentArgs,
    settings: &DatastoreSettings,
    store: &Arc<dyn KvStore>,
    counters: &Arc<ReclaimCounters>,
) -> Result<Option<LivenessTask>, AgentError> {
    let Some(etcd) = settings.etcd() else {
        tracing::info!(
            "liveness and dead-node reclaim apply to etcd only: off for this {} store",
            settings.datastore_type()
        );
        return Ok(None);
    };
    let liveness = LivenessSettings::from_args(args)?;
    let etcd = etcd
        .config()
        .map_err(|e| AgentError::new(format!("incomplete etcd settings: {e}")))?;
    let (stop, mut stopped) = oneshot::channel();
    let store = Arc::clone(store);
    let counters = Arc::clone(counters);
    let task = tokio::spawn(async move {
        let mut backoff = FIRST_START_BACKOFF;
        let running = loop {
            let attempt = Liveness::start(
                liveness.clone(),
                &etcd,
                Arc::clone(&store),
                Arc::clone(&counters),
            );
            tokio::select! {
                _ = &mut stopped => return,
                started = attempt => match started {
                    Ok(running) => break running,
                    Err(e) => tracing::warn!(
                        node = %liveness.node,
                        retry_in_seconds = backoff.as_secs(),
                        "the node is not registered yet (serving the socket meanwhile): {e}"
                    ),
                },
            }
            tokio::select! {
                _ = &mut stopped => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = next_start_backoff(backoff);
        };
        let _ = stopped.await;
        running.stop().await;
    });
    Ok(Some(LivenessTask { stop, task }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn settings(args: &[&str]) -> LivenessSettings {
        LivenessSettings::from_args(&AgentArgs::parsed_for_test(args)).expect("settings")
    }

    /// The defaults: reclaim on, empty blocks released after 900 s; `--no-reclaim` turns the
    /// reclaim off, and an empty-block age of 0 is never (not at once).
    #[test]
    fn the_flags_give_the_reclaim_and_the_empty_block_release() {
        let defaults = settings(&[]);
        assert_eq!(
            defaults,
            LivenessSettings {
                node: "node-a".into(),
                ttl: Duration::from_secs(30),
                grace: Duration::from_secs(900),
                interval: Duration::from_secs(60),
                reclaim: true,
                empty_block_release: Some(Duration::from_secs(900)),
            }
        );
        assert!(!settings(&["--no-reclaim"]).reclaim);
        assert_eq!(
            settings(&["--empty-block-release-seconds", "0"]).empty_block_release,
            None
        );
        assert_eq!(
            settings(&["--empty-block-release-seconds", "1"]).empty_block_release,
            Some(Duration::from_secs(1))
        );
    }

    /// While etcd cannot be reached at start, attempts are 1 s apart, then 2, 4, 8 and 16 s,
    /// then every 30 s (docs/agent.md).
    #[test]
    fn start_attempts_wait_one_second_doubling_to_thirty() {
        let waits: Vec<u64> = std::iter::successors(Some(FIRST_START_BACKOFF), |&backoff| {
            Some(next_start_backoff(backoff))
        })
        .take(8)
        .map(|wait| wait.as_secs())
        .collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
    }

    fn outcome(action: NodeAction) -> NodeOutcome {
        NodeOutcome {
            host: "node-b".into(),
            state: NodeState::Alive,
            action,
        }
    }

    /// A whole pass counts every node by state; one stopped by another guard (the node came
    /// back) still counts them all; one stopped because the leader key changed counts nothing
    /// (it judged only the nodes before) and tells that this agent no longer leads.
    #[test]
    fn a_pass_that_lost_the_leadership_counts_no_node_states() {
        let leader = reclaimer_leader_key();
        let mark = ipam_core::dead_nodes::MissingMark {
            countdown_revision: 7,
            activity_revision: 0,
            grace_seconds: 900,
        };
        let judged = |state: NodeState, action: NodeAction| NodeOutcome {
            host: "node-b".into(),
            state,
            action,
        };
        let stopped = |key: &str| NodeAction::Stopped {
            key: key.to_owned(),
            released: None,
        };
        let mut outcomes = vec![
            judged(NodeState::Alive, NodeAction::Alive),
            judged(NodeState::Alive, NodeAction::Alive),
            judged(NodeState::Active, NodeAction::MarkedAgain),
            judged(NodeState::Missing { mark: None }, NodeAction::MarkedMissing),
            judged(NodeState::Reclaimed { mark }, NodeAction::AddressesKept),
            judged(NodeState::Unreadable, NodeAction::Failed("no".into())),
            judged(NodeState::Dead { mark }, stopped("ipam/v1/liveness/node-b")),
        ];
        assert_eq!(pass_summary(&outcomes, &leader), Some([2, 1, 1, 1, 1, 1]));
        assert_eq!(pass_summary(&[], &leader), Some([0; 6]));
        outcomes.push(judged(NodeState::Dead { mark }, stopped(&leader)));
        assert_eq!(pass_summary(&outcomes, &leader), None);
    }

    fn release(deleted: usize, unassigned: usize, addresses: usize) -> HostRelease {
        let block = |i: usize| format!("10.9.{i}.0/26").parse().expect("a block");
        let address = |i: usize| format!("10.9.0.{i}").parse().expect("an address");
        HostRelease {
            deleted_blocks: (0..deleted).map(block).collect(),
            unassigned_blocks: (deleted..deleted + unassigned).map(block).collect(),
            released_addresses: (0..addresses).map(address).collect(),
        }
    }

    fn counted(counters: &ReclaimCounters) -> (u64, u64) {
        counters.snapshot()
    }

    /// A reclaimed node is counted with its deleted and unassigned blocks; so is one whose
    /// reclaim a guard stopped after its release had finished; one stopped before (nothing
    /// finished to count) and every other outcome count nothing.
    #[test]
    fn a_release_is_counted_whether_the_reclaim_finished_or_was_stopped_after_it() {
        let counters = ReclaimCounters::default();
        for quiet in [
            NodeAction::Alive,
            NodeAction::ClearedMark,
            NodeAction::MarkedMissing,
            NodeAction::MarkedAgain,
            NodeAction::StillMissing { grace_seconds: 900 },
            NodeAction::AddressesKept,
            NodeAction::Changed,
            NodeAction::Failed("the store failed".into()),
            NodeAction::Stopped {
                key: "guard".into(),
                released: None,
            },
        ] {
            report(&outcome(quiet), &counters);
        }
        assert_eq!(counted(&counters), (0, 0));

        report(&outcome(NodeAction::Reclaimed(release(2, 3, 0))), &counters);
        assert_eq!(counted(&counters), (1, 5));

        let stopped = NodeAction::Stopped {
            key: "guard".into(),
            released: Some(release(3, 4, 1)),
        };
        report(&outcome(stopped), &counters);
        assert_eq!(counted(&counters), (2, 12));
    }

    /// Without `--node` the agent takes the name a plugin whose netconf names no node takes:
    /// Calico's node-name file, else the host name.
    #[test]
    fn without_a_node_flag_the_node_is_the_one_the_plugin_finds() {
        let mut args = AgentArgs::try_parse_from(["blockipam-agent"]).expect("flags parse");
        // NODENAME in this process's environment fills the flag: the default is what is tested.
        args.node = None;
        let plugins = blockipam_store::node_name::from_file_or_host(Path::new(NODENAME_FILE))
            .expect("this machine has a host name");
        assert_eq!(node_name(&args).expect("a node name"), plugins);
    }
}
