//! Dead-node reclaim over the in-memory reference store: the decision table (alive, active,
//! missing and marked, dead and its blocks released, reclaimed with its addresses kept, never
//! registered, the reservation pseudo-node), a node whose agent is down while its plugin keeps
//! working (never reclaimed), a node cut off for longer than the grace (its pods' addresses never
//! handed to another node; back to normal when it returns), marks left by earlier versions' wall
//! clocks (never trusted), and a node that comes back or whose plugin writes in the middle of its
//! reclaim, which stops the reclaim at its next write.
//!
//! The in-memory store cannot time keys, so [`TestCountdowns`] puts plain countdown keys and a
//! test "lets the grace pass" by deleting one ([`grace_passes`]), as etcd does when the
//! countdown's lease expires.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ipam_core::dead_nodes::{
    activity_key, agent_key, countdown_key, forget_node, liveness_key, preview_release,
    reclaim_pass, register, survey, CountdownRecord, Countdowns, NodeAction, NodeOutcome,
    NodeState, ReclaimOptions, Registration, RESERVATION_NODE,
};
use ipam_core::{
    AssignIpsRequest, AutoAssignRequest, Condition, Ipam, IpamError, KeyValue, KvError, KvStore,
    MemoryStore, Op, PoolSpec, Read, ReadResult, Revision, Txn,
};

const GRACE: Duration = Duration::from_secs(900);
const T0: u64 = 1_800_000_000;

/// Countdowns as plain keys: they run until [`grace_passes`] deletes them.
struct TestCountdowns(Arc<dyn KvStore>);

#[async_trait]
impl Countdowns for TestCountdowns {
    async fn start(
        &self,
        key: &str,
        value: Vec<u8>,
        _duration: Duration,
        guard: &[Condition],
        also: &[Op],
    ) -> Result<Revision, IpamError> {
        let mut txn = Txn::new().then(Op::put(key, value));
        for op in also {
            txn = txn.then(op.clone());
        }
        for condition in guard {
            txn = txn.when(condition.clone());
        }
        Ok(self.0.commit(txn).await?)
    }
}

/// One reclaim pass with plain-key countdowns.
async fn pass_with(store: &Arc<dyn KvStore>, options: &ReclaimOptions) -> Vec<NodeOutcome> {
    reclaim_pass(
        Arc::clone(store),
        &TestCountdowns(Arc::clone(store)),
        options,
    )
    .await
    .expect("reclaim pass")
}

async fn pass(store: &Arc<dyn KvStore>) -> Vec<NodeOutcome> {
    pass_with(store, &options()).await
}

/// What etcd does when a countdown's lease runs out: the key goes.
async fn grace_passes(store: &dyn KvStore, host: &str) {
    store
        .delete(&countdown_key(host))
        .await
        .expect("delete the countdown");
}

/// One commit of `host`'s plugin: an allocation through an allocator recording its activity.
async fn plugin_commit(store: &Arc<dyn KvStore>, host: &str, handle: &str) {
    Ipam::new(Arc::clone(store))
        .recording_activity(host, "test")
        .expect("a valid host")
        .auto_assign(&AutoAssignRequest {
            handle: handle.to_owned(),
            host: host.to_owned(),
            num_v4: 1,
            ..AutoAssignRequest::default()
        })
        .await
        .expect("the plugin's ADD");
}

fn options() -> ReclaimOptions {
    ReclaimOptions {
        grace: GRACE,
        extra_guard: Vec::new(),
    }
}

async fn ipam_with_pool(store: Arc<dyn KvStore>) -> Ipam {
    let ipam = Ipam::new(store);
    ipam.create_pool(&PoolSpec {
        cidr: "10.0.0.0/16".parse().expect("cidr"),
        name: Some("pool".into()),
        block_size: Some(26),
        disabled: false,
    })
    .await
    .expect("create the pool");
    ipam
}

/// Allocates `count` addresses for `host`, one handle each.
async fn allocate(ipam: &Ipam, host: &str, count: usize) -> Vec<IpAddr> {
    let mut ips = Vec::new();
    for i in 0..count {
        let result = ipam
            .auto_assign(&AutoAssignRequest {
                handle: format!("net.{host}-c{i}"),
                host: host.to_owned(),
                num_v4: 1,
                ..AutoAssignRequest::default()
            })
            .await
            .expect("auto-assign");
        ips.extend(result.v4.iter().map(|a| a.ip));
    }
    ips
}

async fn addresses_of(ipam: &Ipam, host: &str) -> usize {
    ipam.list_allocations()
        .await
        .expect("list allocations")
        .iter()
        .filter(|a| a.attributes.get("node").map(String::as_str) == Some(host))
        .count()
}

async fn blocks_of(store: &dyn KvStore, host: &str) -> usize {
    store
        .list(&ipam_core::model::keys::host_blocks_dir(host))
        .await
        .expect("list the host's blocks")
        .len()
}

async fn registration(store: &dyn KvStore, host: &str) -> Option<Registration> {
    store
        .get(&agent_key(host))
        .await
        .expect("read the registration")
        .map(|kv| serde_json::from_slice(&kv.value).expect("a registration is JSON"))
}

async fn set_live(store: &dyn KvStore, host: &str) {
    store
        .put(&liveness_key(host), b"alive".to_vec())
        .await
        .expect("put the liveness key");
}

fn action_of<'a>(outcomes: &'a [ipam_core::dead_nodes::NodeOutcome], host: &str) -> &'a NodeAction {
    &outcomes
        .iter()
        .find(|o| o.host == host)
        .unwrap_or_else(|| panic!("no outcome for {host}: {outcomes:?}"))
        .action
}

async fn assert_check_clean(ipam: &Ipam) {
    let report = ipam.check(false).await.expect("check");
    assert!(
        report.problems.is_empty(),
        "check found problems: {report:?}"
    );
}

#[tokio::test]
async fn alive_node_is_never_touched() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    allocate(&ipam, "node-a", 3).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    set_live(store.as_ref(), "node-a").await;
    let before = store.get(&agent_key("node-a")).await.expect("get");

    let outcomes = pass(&store).await;
    assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::Alive);
    assert_eq!(
        store.get(&countdown_key("node-a")).await.expect("get"),
        None
    );
    assert_eq!(addresses_of(&ipam, "node-a").await, 3);
    assert_eq!(blocks_of(store.as_ref(), "node-a").await, 1);
    assert_eq!(store.get(&agent_key("node-a")).await.expect("get"), before);
}

#[tokio::test]
async fn missing_node_is_marked_then_its_blocks_released_once_the_grace_has_passed() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    allocate(&ipam, "node-a", 3).await;
    allocate(&ipam, "node-b", 2).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register a");
    register(store.as_ref(), "node-b", "test", T0)
        .await
        .expect("register b");
    set_live(store.as_ref(), "node-b").await;

    // First sight of the missing liveness key: a countdown started, the registration marked with
    // its revision; nothing freed.
    let outcomes = pass(&store).await;
    assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::MarkedMissing);
    let countdown = store
        .get(&countdown_key("node-a"))
        .await
        .expect("get")
        .expect("a countdown runs for node-a");
    let mark = registration(store.as_ref(), "node-a")
        .await
        .expect("registered")
        .missing_mark
        .expect("marked");
    assert_eq!(mark.countdown_revision, countdown.revision.0);
    assert_eq!(mark.grace_seconds, GRACE.as_secs());
    assert_eq!(addresses_of(&ipam, "node-a").await, 3);

    // While the countdown runs, however many passes: still only missing.
    for _ in 0..3 {
        let outcomes = pass(&store).await;
        assert_eq!(
            action_of(&outcomes, "node-a"),
            &NodeAction::StillMissing {
                grace_seconds: GRACE.as_secs()
            }
        );
    }
    assert_eq!(addresses_of(&ipam, "node-a").await, 3);
    assert_eq!(blocks_of(store.as_ref(), "node-a").await, 1);

    // The grace has passed: its block loses its affinity (like `node release` without
    // `--addresses`); its addresses are kept, the registration marked.
    grace_passes(store.as_ref(), "node-a").await;
    let outcomes = pass(&store).await;
    match action_of(&outcomes, "node-a") {
        NodeAction::Reclaimed(release) => {
            assert!(release.released_addresses.is_empty(), "{release:?}");
            assert_eq!(release.unassigned_blocks.len(), 1, "{release:?}");
            assert!(release.deleted_blocks.is_empty(), "{release:?}");
        }
        other => panic!("node-a was not reclaimed: {other:?}"),
    }
    assert_eq!(action_of(&outcomes, "node-b"), &NodeAction::Alive);
    assert_eq!(addresses_of(&ipam, "node-a").await, 3);
    assert_eq!(blocks_of(store.as_ref(), "node-a").await, 0);
    let reclaimed = registration(store.as_ref(), "node-a")
        .await
        .expect("still registered");
    assert!(reclaimed.blocks_released);
    assert_eq!(reclaimed.missing_mark, Some(mark));
    assert_eq!(addresses_of(&ipam, "node-b").await, 2);
    assert_check_clean(&ipam).await;

    // The record that says the addresses are kept sits under the countdown's key, without lease.
    let hold = store
        .get(&countdown_key("node-a"))
        .await
        .expect("get")
        .expect("the record that keeps the addresses");
    let hold: CountdownRecord = serde_json::from_slice(&hold.value).expect("JSON");
    assert!(hold.addresses_kept, "{hold:?}");

    // Later passes: reclaimed, nothing more done, however often.
    for _ in 0..2 {
        let outcomes = pass(&store).await;
        assert_eq!(
            outcomes
                .iter()
                .find(|o| o.host == "node-a")
                .map(|o| o.state),
            Some(NodeState::Reclaimed { mark })
        );
        assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::AddressesKept);
    }
    assert_eq!(addresses_of(&ipam, "node-a").await, 3);

    // The operator knows its pods are gone: `node release node-a --addresses` releases them and
    // forgets the node.
    let released = ipam.release_host("node-a", true).await.expect("release");
    assert_eq!(released.released_addresses.len(), 3);
    assert!(forget_node(store.as_ref(), "node-a").await.expect("forget"));
    assert_eq!(registration(store.as_ref(), "node-a").await, None);
    assert_eq!(
        store.get(&countdown_key("node-a")).await.expect("get"),
        None
    );
    let outcomes = pass(&store).await;
    assert!(outcomes.iter().all(|o| o.host != "node-a"), "{outcomes:?}");
    assert_check_clean(&ipam).await;
    // A node whose agent is live is never forgotten.
    assert!(!forget_node(store.as_ref(), "node-b").await.expect("forget"));
    assert!(registration(store.as_ref(), "node-b").await.is_some());
    assert!(!forget_node(store.as_ref(), "never-registered")
        .await
        .expect("forget"));
}

/// A node cut off from the store for longer than the grace looks exactly like one that
/// vanished; its pods still run. The reclaim must hand none of their addresses to another node,
/// and the node must carry on when it comes back.
#[tokio::test]
async fn node_cut_off_past_the_grace_keeps_its_pods_addresses_and_carries_on_when_back() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = Ipam::new(Arc::clone(&store));
    // One pool of one block: whatever node-b gets comes from node-a's block.
    ipam.create_pool(&PoolSpec {
        cidr: "10.9.0.0/28".parse().expect("cidr"),
        name: Some("one-block".into()),
        block_size: Some(28),
        disabled: false,
    })
    .await
    .expect("create the pool");
    let held = allocate(&ipam, "node-a", 3).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    // The partition: no liveness key, no plugin commit, for a whole grace.
    pass(&store).await;
    grace_passes(store.as_ref(), "node-a").await;
    assert!(matches!(
        action_of(&pass(&store).await, "node-a"),
        NodeAction::Reclaimed(_)
    ));

    // node-b takes everything the pool has left: never one of node-a's pods' addresses.
    let mut taken = Vec::new();
    for i in 0.. {
        match ipam
            .auto_assign(&AutoAssignRequest {
                handle: format!("net.node-b-c{i}"),
                host: "node-b".into(),
                num_v4: 1,
                ..AutoAssignRequest::default()
            })
            .await
        {
            Ok(result) if !result.v4.is_empty() => taken.extend(result.v4.iter().map(|a| a.ip)),
            _ => break,
        }
        assert!(
            i < 64,
            "node-b kept getting addresses from a 16-address pool"
        );
    }
    assert_eq!(taken.len(), 16 - 3, "node-b got {taken:?}");
    for ip in &held {
        assert!(
            !taken.contains(ip),
            "{ip} of node-a's running pod went to node-b"
        );
        let owner = ipam
            .get_assignment(*ip)
            .await
            .expect("read")
            .expect("still allocated");
        assert_eq!(
            owner.attributes.get("node").map(String::as_str),
            Some("node-a")
        );
    }
    assert_check_clean(&ipam).await;

    // The partition heals: node-a's agent is back; the next pass clears the mark and the record
    // that kept the addresses; its runtime's DELs release them.
    set_live(store.as_ref(), "node-a").await;
    assert_eq!(
        action_of(&pass(&store).await, "node-a"),
        &NodeAction::ClearedMark
    );
    let back = registration(store.as_ref(), "node-a")
        .await
        .expect("registered");
    assert!(
        !back.blocks_released && back.missing_mark.is_none(),
        "{back:?}"
    );
    assert_eq!(
        store.get(&countdown_key("node-a")).await.expect("get"),
        None
    );
    for i in 0..3 {
        let released = ipam
            .release_handle(&format!("net.node-a-c{i}"))
            .await
            .expect("DEL");
        assert_eq!(released.len(), 1);
    }
    assert_eq!(addresses_of(&ipam, "node-a").await, 0);
    assert_check_clean(&ipam).await;
}

#[tokio::test]
async fn agent_down_while_the_plugin_keeps_working_is_never_reclaimed_until_all_goes_quiet() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    allocate(&ipam, "node-a", 3).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    // The agent is down (no liveness key) but the runtime keeps calling the plugin, which goes
    // to the store directly: every countdown that runs out finds the activity record moved.
    assert_eq!(
        action_of(&pass(&store).await, "node-a"),
        &NodeAction::MarkedMissing
    );
    for round in 0..3 {
        plugin_commit(&store, "node-a", &format!("net.pod-{round}")).await;
        grace_passes(store.as_ref(), "node-a").await;
        let nodes = survey(store.as_ref()).await.expect("survey");
        assert_eq!(nodes[0].state, NodeState::Active, "round {round}");
        let outcomes = pass(&store).await;
        assert_eq!(
            action_of(&outcomes, "node-a"),
            &NodeAction::MarkedAgain,
            "round {round}"
        );
        // Marked again from the activity seen, with a new countdown: the node stays marked, so
        // the next pass (no commit meanwhile) finds it missing with its countdown running, not
        // unmarked and to be marked once more.
        let mark = registration(store.as_ref(), "node-a")
            .await
            .expect("still registered")
            .missing_mark
            .expect("marked again");
        assert_eq!(
            mark.activity_revision,
            activity_revision(store.as_ref(), "node-a").await.0,
            "round {round}"
        );
        let countdown = store
            .get(&countdown_key("node-a"))
            .await
            .expect("get")
            .expect("a new countdown");
        assert_eq!(
            mark.countdown_revision, countdown.revision.0,
            "round {round}"
        );
        assert_eq!(
            action_of(&pass(&store).await, "node-a"),
            &NodeAction::StillMissing {
                grace_seconds: mark.grace_seconds
            },
            "round {round}"
        );
        assert_eq!(addresses_of(&ipam, "node-a").await, 3 + round + 1);
    }
    // Then the node really goes: no agent, no calls. Once the countdown started from its last
    // activity runs out, it is released.
    grace_passes(store.as_ref(), "node-a").await;
    match action_of(&pass(&store).await, "node-a") {
        NodeAction::Reclaimed(release) => {
            assert!(release.released_addresses.is_empty(), "{release:?}");
            assert!(!release.unassigned_blocks.is_empty(), "{release:?}");
        }
        other => panic!("node-a was not reclaimed: {other:?}"),
    }
    assert_eq!(addresses_of(&ipam, "node-a").await, 6);
    assert_eq!(blocks_of(store.as_ref(), "node-a").await, 0);
    assert_check_clean(&ipam).await;
}

#[tokio::test]
async fn wall_clock_mark_of_an_earlier_version_is_never_trusted() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    allocate(&ipam, "node-a", 2).await;
    // An earlier agent, its clock far ahead or far behind, marked the node long ago.
    for missing_since in [1, u64::MAX / 2] {
        store
            .put(
                &agent_key("node-a"),
                format!(
                    r#"{{"node":"node-a","registered_at":1,"agent_version":"0.0.9","missing_since":{missing_since}}}"#
                )
                .into_bytes(),
            )
            .await
            .expect("an earlier version's registration");
        let outcomes = pass(&store).await;
        assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::MarkedMissing);
        let registration = registration(store.as_ref(), "node-a")
            .await
            .expect("registered");
        assert_eq!(registration.missing_since, None);
        assert!(registration.missing_mark.is_some());
        assert_eq!(addresses_of(&ipam, "node-a").await, 2);
        grace_passes(store.as_ref(), "node-a").await;
    }
}

#[tokio::test]
async fn plugin_activity_before_the_mark_does_not_keep_a_node_forever() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    Ipam::new(Arc::clone(&store))
        .create_pool(&PoolSpec {
            cidr: "10.0.0.0/16".parse().expect("cidr"),
            name: Some("pool".into()),
            block_size: Some(26),
            disabled: false,
        })
        .await
        .expect("create the pool");
    plugin_commit(&store, "node-a", "net.pod").await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    assert_eq!(
        action_of(&pass(&store).await, "node-a"),
        &NodeAction::MarkedMissing
    );
    grace_passes(store.as_ref(), "node-a").await;
    assert!(matches!(
        action_of(&pass(&store).await, "node-a"),
        NodeAction::Reclaimed(_)
    ));
}

#[tokio::test]
async fn never_registered_node_and_reservations_are_never_touched() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    // A node whose plugin runs without an agent: allocations, no registration, no liveness.
    allocate(&ipam, "plugin-only", 2).await;
    // A gateway reservation, made for the pseudo-node "-", and a registration record under its
    // name (which no agent can write through `register`).
    ipam.assign_ips(&AssignIpsRequest {
        ips: vec!["10.0.200.1".parse().expect("ip")],
        handle: "reservation.gw".into(),
        host: RESERVATION_NODE.into(),
        attributes: BTreeMap::new(),
        ignore_strict_affinity: true,
        purpose: None,
    })
    .await
    .expect("reserve the gateway");
    assert!(matches!(
        register(store.as_ref(), RESERVATION_NODE, "test", T0).await,
        Err(IpamError::InvalidArgument(_))
    ));
    store
        .put(
            &agent_key(RESERVATION_NODE),
            br#"{"node":"-","registered_at":1,"agent_version":"x","missing_since":1}"#.to_vec(),
        )
        .await
        .expect("write a registration under the pseudo-node's name");

    for _ in 0..3 {
        let outcomes = pass(&store).await;
        assert!(outcomes.is_empty(), "{outcomes:?}");
        grace_passes(store.as_ref(), RESERVATION_NODE).await;
    }
    assert_eq!(addresses_of(&ipam, "plugin-only").await, 2);
    assert_eq!(blocks_of(store.as_ref(), "plugin-only").await, 1);
    assert_eq!(addresses_of(&ipam, RESERVATION_NODE).await, 1);
}

#[tokio::test]
async fn live_node_with_a_stale_mark_is_cleared_not_released() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    allocate(&ipam, "node-a", 1).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    pass(&store).await;
    set_live(store.as_ref(), "node-a").await;
    grace_passes(store.as_ref(), "node-a").await;

    let nodes = survey(store.as_ref()).await.expect("survey");
    assert_eq!(nodes[0].state, NodeState::Alive);
    let outcomes = pass(&store).await;
    assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::ClearedMark);
    assert_eq!(
        registration(store.as_ref(), "node-a")
            .await
            .expect("registered")
            .missing_mark,
        None
    );
    assert_eq!(addresses_of(&ipam, "node-a").await, 1);
}

#[tokio::test]
async fn survey_and_preview_write_nothing_and_count_what_a_reclaim_would_release() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    allocate(&ipam, "node-a", 70).await; // two blocks of 64
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    let before = store.list("").await.expect("list");

    let nodes = survey(store.as_ref()).await.expect("survey");
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].state, NodeState::Missing { mark: None });
    let (previews, undecodable) = preview_release(Arc::clone(&store), &["node-a"])
        .await
        .expect("preview");
    assert!(undecodable.is_empty(), "{undecodable:?}");
    assert_eq!(previews["node-a"].blocks, 2);
    assert_eq!(previews["node-a"].addresses, 70);
    assert_eq!(store.list("").await.expect("list"), before);
}

/// A store that makes a node come back right after the `trigger_after`-th successful commit:
/// its liveness key reappears, or its agent registers again.
#[derive(Debug)]
struct ComesBackStore {
    inner: Arc<dyn KvStore>,
    commits: AtomicUsize,
    trigger_after: usize,
    host: String,
    how: ComeBack,
}

#[derive(Debug, Clone, Copy)]
enum ComeBack {
    LivenessKey,
    Registers,
    PluginCommits,
}

#[async_trait]
impl KvStore for ComesBackStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }
    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        self.inner.read_many(reads).await
    }
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        let revision = self.inner.commit(txn).await?;
        if self.commits.fetch_add(1, Ordering::SeqCst) + 1 == self.trigger_after {
            match self.how {
                ComeBack::LivenessKey => set_live(self.inner.as_ref(), &self.host).await,
                ComeBack::Registers => {
                    register(self.inner.as_ref(), &self.host, "test", T0)
                        .await
                        .expect("register again");
                }
                ComeBack::PluginCommits => {
                    plugin_commit(&self.inner, &self.host, "net.late-pod").await;
                }
            }
        }
        Ok(revision)
    }
}

async fn node_coming_back_mid_reclaim_stops_the_reclaim(how: ComeBack) {
    let memory: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&memory)).await;
    // The reclaim takes two transactions: the blocks' affinity, then the registration's mark.
    allocate(&ipam, "node-a", 40).await;
    register(memory.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    pass(&memory).await;
    grace_passes(memory.as_ref(), "node-a").await;

    let store: Arc<dyn KvStore> = Arc::new(ComesBackStore {
        inner: Arc::clone(&memory),
        commits: AtomicUsize::new(0),
        trigger_after: 1,
        host: "node-a".into(),
        how,
    });
    let outcomes = reclaim_pass(store, &TestCountdowns(Arc::clone(&memory)), &options())
        .await
        .expect("pass");
    let expected_key = match how {
        ComeBack::LivenessKey => liveness_key("node-a"),
        ComeBack::Registers => agent_key("node-a"),
        ComeBack::PluginCommits => activity_key("node-a"),
    };
    match action_of(&outcomes, "node-a") {
        // Stopped at the registration's mark; or, when the late commit claimed a new block for
        // the node, already at that block's release.
        NodeAction::Stopped { key, released } => {
            assert_eq!(key, &expected_key);
            if let Some(release) = released {
                assert_eq!(release.unassigned_blocks.len(), 1, "{release:?}");
                assert!(release.released_addresses.is_empty(), "{release:?}");
            } else {
                assert!(matches!(how, ComeBack::PluginCommits), "{how:?}");
            }
        }
        other => panic!("the reclaim was not stopped by {expected_key}: {other:?}"),
    }
    // The block lost its affinity before the node came back; nothing after it: the registration
    // is not marked reclaimed, and every address is kept (the plugin's late commit added one of
    // its own).
    let late = usize::from(matches!(how, ComeBack::PluginCommits));
    assert_eq!(addresses_of(&ipam, "node-a").await, 40 + late);
    assert_eq!(blocks_of(memory.as_ref(), "node-a").await, late);
    let registration = registration(memory.as_ref(), "node-a")
        .await
        .expect("still registered");
    assert!(!registration.blocks_released, "{registration:?}");
    assert_check_clean(&ipam).await;
}

#[tokio::test]
async fn liveness_key_reappearing_mid_release_stops_the_release() {
    node_coming_back_mid_reclaim_stops_the_reclaim(ComeBack::LivenessKey).await;
}

#[tokio::test]
async fn agent_registering_again_mid_release_stops_the_release() {
    node_coming_back_mid_reclaim_stops_the_reclaim(ComeBack::Registers).await;
}

#[tokio::test]
async fn plugin_committing_mid_release_stops_the_release() {
    node_coming_back_mid_reclaim_stops_the_reclaim(ComeBack::PluginCommits).await;
}

#[tokio::test]
async fn lost_extra_guard_stops_every_write_of_the_pass() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    allocate(&ipam, "node-a", 2).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register a");
    pass(&store).await;
    grace_passes(store.as_ref(), "node-a").await;
    register(store.as_ref(), "node-b", "test", T0)
        .await
        .expect("register b");
    // The leader key this reclaimer held is gone (its lease expired): neither the mark of a
    // newly missing node nor the release of a dead one is written.
    let leader = ipam_core::dead_nodes::reclaimer_leader_key();
    let lost = ReclaimOptions {
        grace: GRACE,
        extra_guard: vec![Condition::at_revision(&leader, Revision(1))],
    };
    let outcomes = pass_with(&store, &lost).await;
    assert_eq!(
        action_of(&outcomes, "node-a"),
        &NodeAction::Stopped {
            key: leader,
            released: None
        }
    );
    // The pass ended there: node-b (after node-a) was not even tried.
    assert!(outcomes.iter().all(|o| o.host != "node-b"), "{outcomes:?}");
    assert_eq!(addresses_of(&ipam, "node-a").await, 2);
    assert_eq!(
        registration(store.as_ref(), "node-b")
            .await
            .expect("registered")
            .missing_mark,
        None
    );
}

#[tokio::test]
async fn lost_extra_guard_stops_the_marking_of_a_missing_node() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    register(store.as_ref(), "node-b", "test", T0)
        .await
        .expect("register b");
    let leader = ipam_core::dead_nodes::reclaimer_leader_key();
    let lost = ReclaimOptions {
        grace: GRACE,
        extra_guard: vec![Condition::at_revision(&leader, Revision(1))],
    };
    let outcomes = pass_with(&store, &lost).await;
    assert_eq!(
        action_of(&outcomes, "node-b"),
        &NodeAction::Stopped {
            key: leader,
            released: None
        }
    );
    assert_eq!(
        registration(store.as_ref(), "node-b")
            .await
            .expect("registered")
            .missing_mark,
        None
    );
    // Nor was its countdown started: a former leader cannot start one either.
    assert!(store
        .get(&countdown_key("node-b"))
        .await
        .expect("read the countdown")
        .is_none());
}

/// Countdowns as plain keys that let another reclaimer (grace [`GRACE`]) mark `node-a` once,
/// between this reclaimer's survey and its countdown's start: what a concurrent `gc --dead-nodes
/// --apply --grace-seconds N`, or a former leader paused past its lease with another grace, does
/// to the reclaimer that leads.
struct AnotherReclaimerMarksFirst {
    store: Arc<dyn KvStore>,
    interjected: AtomicUsize,
}

#[async_trait]
impl Countdowns for AnotherReclaimerMarksFirst {
    async fn start(
        &self,
        key: &str,
        value: Vec<u8>,
        duration: Duration,
        guard: &[Condition],
        also: &[Op],
    ) -> Result<Revision, IpamError> {
        if self.interjected.fetch_add(1, Ordering::SeqCst) == 0 {
            let outcomes = pass(&self.store).await;
            assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::MarkedMissing);
        }
        TestCountdowns(Arc::clone(&self.store))
            .start(key, value, duration, guard, also)
            .await
    }
}

#[tokio::test]
async fn a_reclaimer_that_looked_before_another_marked_the_node_leaves_the_marked_countdown_alone()
{
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    allocate(&ipam, "node-a", 2).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    let shorter = ReclaimOptions {
        grace: Duration::from_secs(10),
        extra_guard: Vec::new(),
    };
    let late = AnotherReclaimerMarksFirst {
        store: Arc::clone(&store),
        interjected: AtomicUsize::new(0),
    };
    let outcomes = reclaim_pass(Arc::clone(&store), &late, &shorter)
        .await
        .expect("reclaim pass");
    assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::Changed);
    // The countdown is the one the mark names, with the mark's grace: not replaced by a shorter
    // one, which would have ended the grace 890 s before the mark says.
    let mark = registration(store.as_ref(), "node-a")
        .await
        .expect("registered")
        .missing_mark
        .expect("marked by the other reclaimer");
    assert_eq!(mark.grace_seconds, GRACE.as_secs());
    let countdown = store
        .get(&countdown_key("node-a"))
        .await
        .expect("read the countdown")
        .expect("the countdown runs");
    assert_eq!(countdown.revision.get(), mark.countdown_revision);
    let record: CountdownRecord =
        serde_json::from_slice(&countdown.value).expect("a countdown is JSON");
    assert_eq!(record.grace_seconds, GRACE.as_secs());
    // Still missing at the next pass, whatever its grace: nothing released.
    assert_eq!(
        action_of(&pass_with(&store, &shorter).await, "node-a"),
        &NodeAction::StillMissing {
            grace_seconds: GRACE.as_secs()
        }
    );
    assert_eq!(addresses_of(&ipam, "node-a").await, 2);
}

#[tokio::test]
async fn live_node_with_an_earlier_versions_wall_clock_mark_or_a_stray_countdown_is_cleared() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    store
        .put(
            &agent_key("node-a"),
            br#"{"node":"node-a","registered_at":1,"agent_version":"0.0.9","missing_since":7}"#
                .to_vec(),
        )
        .await
        .expect("an earlier version's marked registration");
    set_live(store.as_ref(), "node-a").await;
    assert_eq!(
        action_of(&pass(&store).await, "node-a"),
        &NodeAction::ClearedMark
    );
    let cleared = registration(store.as_ref(), "node-a")
        .await
        .expect("registered");
    assert_eq!((cleared.missing_since, cleared.missing_mark), (None, None));

    // A countdown left behind with no mark (its marking write was refused): cleared too.
    store
        .put(&countdown_key("node-a"), b"{}".to_vec())
        .await
        .expect("a stray countdown");
    assert_eq!(
        action_of(&pass(&store).await, "node-a"),
        &NodeAction::ClearedMark
    );
    assert_eq!(
        store.get(&countdown_key("node-a")).await.expect("get"),
        None
    );
    assert_eq!(action_of(&pass(&store).await, "node-a"), &NodeAction::Alive);
}

/// A store whose first batched read is followed, before anything else, by the node's agent
/// registering again: the pass's write for that node finds the registration changed.
#[derive(Debug)]
struct RegistersAfterSurvey {
    inner: Arc<dyn KvStore>,
    armed: AtomicUsize,
}

#[async_trait]
impl KvStore for RegistersAfterSurvey {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }
    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        let results = self.inner.read_many(reads).await?;
        if self.armed.swap(0, Ordering::SeqCst) == 1 {
            register(self.inner.as_ref(), "node-a", "test", T0 + 1)
                .await
                .expect("register again");
        }
        Ok(results)
    }
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.inner.commit(txn).await
    }
}

#[tokio::test]
async fn a_registration_changed_under_the_pass_is_left_for_the_next_pass() {
    let memory: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    register(memory.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    let store: Arc<dyn KvStore> = Arc::new(RegistersAfterSurvey {
        inner: Arc::clone(&memory),
        armed: AtomicUsize::new(1),
    });
    // The leader guard holds throughout: the refusal is the registration's, not the guard's.
    let leader = ipam_core::dead_nodes::reclaimer_leader_key();
    let leader_revision = memory
        .put(&leader, b"me".to_vec())
        .await
        .expect("the leader key");
    let options = ReclaimOptions {
        grace: GRACE,
        extra_guard: vec![Condition::at_revision(&leader, leader_revision)],
    };
    let outcomes = reclaim_pass(store, &TestCountdowns(Arc::clone(&memory)), &options)
        .await
        .expect("pass");
    assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::Changed);
    assert_eq!(
        registration(memory.as_ref(), "node-a")
            .await
            .expect("registered")
            .missing_mark,
        None
    );
}

/// A registration that does not decode (damaged, or written by a version this one cannot read)
/// is reported and left alone; it no longer stops the pass for every other node.
#[tokio::test]
async fn an_unreadable_registration_is_reported_and_the_other_nodes_are_still_judged() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    allocate(&ipam, "node-a", 2).await;
    allocate(&ipam, "node-x", 2).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register a");
    store
        .put(&agent_key("node-x"), b"\x00not json".to_vec())
        .await
        .expect("a damaged registration");
    let damaged = store.get(&agent_key("node-x")).await.expect("get");

    let nodes = survey(store.as_ref()).await.expect("survey");
    let x = nodes
        .iter()
        .find(|n| n.host == "node-x")
        .expect("node-x listed");
    assert_eq!(x.state, NodeState::Unreadable);
    assert!(
        x.problem.as_deref().is_some_and(|p| p.contains("node-x")),
        "{:?}",
        x.problem
    );

    // node-a goes through its whole reclaim; node-x is reported failed every time.
    assert_eq!(
        action_of(&pass(&store).await, "node-a"),
        &NodeAction::MarkedMissing
    );
    grace_passes(store.as_ref(), "node-a").await;
    let outcomes = pass(&store).await;
    assert!(
        matches!(action_of(&outcomes, "node-a"), NodeAction::Reclaimed(_)),
        "{outcomes:?}"
    );
    match action_of(&outcomes, "node-x") {
        NodeAction::Failed(message) => assert!(message.contains("nothing is done"), "{message}"),
        other => panic!("node-x: {other:?}"),
    }
    assert_eq!(store.get(&agent_key("node-x")).await.expect("get"), damaged);
    assert_eq!(addresses_of(&ipam, "node-x").await, 2);
    assert_eq!(blocks_of(store.as_ref(), "node-x").await, 1);
}

/// A registration that says its blocks were released but carries no mark (written by hand, or
/// left by an interrupted tool) is marked missing from scratch: its countdown runs in full before
/// anything is decided, and its blocks are then released as for any dead node.
#[tokio::test]
async fn a_released_flag_without_a_mark_starts_a_fresh_countdown() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = ipam_with_pool(Arc::clone(&store)).await;
    allocate(&ipam, "node-a", 1).await;
    store
        .put(
            &agent_key("node-a"),
            br#"{"node":"node-a","registered_at":1,"agent_version":"x","blocks_released":true}"#
                .to_vec(),
        )
        .await
        .expect("a registration flagged without a mark");
    assert_eq!(
        action_of(&pass(&store).await, "node-a"),
        &NodeAction::MarkedMissing
    );
    let marked = registration(store.as_ref(), "node-a")
        .await
        .expect("registered");
    assert!(!marked.blocks_released, "{marked:?}");
    assert!(matches!(
        action_of(&pass(&store).await, "node-a"),
        NodeAction::StillMissing { .. }
    ));
    assert_eq!(blocks_of(store.as_ref(), "node-a").await, 1);
    grace_passes(store.as_ref(), "node-a").await;
    assert!(matches!(
        action_of(&pass(&store).await, "node-a"),
        NodeAction::Reclaimed(_)
    ));
    assert_eq!(blocks_of(store.as_ref(), "node-a").await, 0);
    assert_eq!(addresses_of(&ipam, "node-a").await, 1);
}

/// `host`'s plugin of `version`: an allocator recording its activity over `store`.
fn plugin_of(store: Arc<dyn KvStore>, host: &str, version: &str) -> Ipam {
    Ipam::new(store)
        .recording_activity(host, version)
        .expect("a valid host")
}

/// One ADD of `handle` on `host` by `plugin`.
async fn plugin_add(plugin: &Ipam, host: &str, handle: &str) {
    plugin
        .auto_assign(&AutoAssignRequest {
            handle: handle.to_owned(),
            host: host.to_owned(),
            num_v4: 1,
            ..AutoAssignRequest::default()
        })
        .await
        .expect("the plugin's ADD");
}

/// One DEL of `handle` on `host` by `plugin` (every address of the handle).
async fn plugin_del(plugin: &Ipam, host: &str, handle: &str) {
    let outcome = plugin
        .release_chosen(handle, host, |held| held.iter().map(|a| a.ip).collect())
        .await
        .expect("the plugin's DEL");
    assert_eq!(outcome.released.len(), 1, "{outcome:?}");
}

/// The revision of `host`'s activity record (it must exist).
async fn activity_revision(store: &dyn KvStore, host: &str) -> Revision {
    store
        .get(&activity_key(host))
        .await
        .expect("read the activity record")
        .expect("an activity record")
        .revision
}

#[tokio::test]
async fn a_steady_plugin_commit_leaves_the_activity_record_as_it_is_until_a_reclaimer_marks_the_node(
) {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    ipam_with_pool(Arc::clone(&store)).await;
    // Through a cache, as the plugin's calls through its agent are answered, and directly.
    let through_cache: Arc<dyn KvStore> =
        Arc::new(ipam_core::caching::CachingStore::new(Arc::clone(&store)));
    for (round, plugin_store) in [Arc::clone(&store), through_cache].into_iter().enumerate() {
        let host = format!("node-{round}");
        let plugin = plugin_of(plugin_store, &host, "test");
        // Never registered: the first commit writes the record, the next ones leave it.
        plugin_add(&plugin, &host, &format!("net.{host}-a")).await;
        let first = activity_revision(store.as_ref(), &host).await;
        plugin_add(&plugin, &host, &format!("net.{host}-b")).await;
        plugin_del(&plugin, &host, &format!("net.{host}-a")).await;
        assert_eq!(activity_revision(store.as_ref(), &host).await, first);
        // Registered without a mark: the first commit after it fails its "no registration"
        // condition and is decided again; the record stays as it is.
        register(store.as_ref(), &host, "test", T0)
            .await
            .expect("register");
        plugin_add(&plugin, &host, &format!("net.{host}-c")).await;
        assert_eq!(activity_revision(store.as_ref(), &host).await, first);
        // Its agent is down: a reclaimer marks it. The plugin's next commit moves the record,
        // through the cache too (its first answer, from before the mark, fails to commit).
        assert_eq!(
            action_of(&pass(&store).await, &host),
            &NodeAction::MarkedMissing
        );
        plugin_del(&plugin, &host, &format!("net.{host}-b")).await;
        let moved = activity_revision(store.as_ref(), &host).await;
        assert!(moved > first, "round {round}: {moved:?} after {first:?}");
        let nodes = survey(store.as_ref()).await.expect("survey");
        let node = nodes.iter().find(|n| n.host == host).expect("surveyed");
        assert_eq!(node.state, NodeState::Active, "round {round}");
        // Its agent still down, the node is marked again from that activity: the mark stays, so
        // the next commit moves the record as well.
        assert_eq!(
            action_of(&pass(&store).await, &host),
            &NodeAction::MarkedAgain
        );
        plugin_add(&plugin, &host, &format!("net.{host}-g")).await;
        let moved_again = activity_revision(store.as_ref(), &host).await;
        assert!(moved_again > moved, "round {round}");
        let moved = moved_again;
        // Its agent is back: the mark is cleared, and commits leave the record as it is again.
        set_live(store.as_ref(), &host).await;
        assert_eq!(
            action_of(&pass(&store).await, &host),
            &NodeAction::ClearedMark
        );
        plugin_add(&plugin, &host, &format!("net.{host}-d")).await;
        assert_eq!(activity_revision(store.as_ref(), &host).await, moved);
        // A plugin of another version rewrites it once.
        let upgraded = plugin_of(Arc::clone(&store), &host, "test-2");
        plugin_add(&upgraded, &host, &format!("net.{host}-e")).await;
        let rewritten = activity_revision(store.as_ref(), &host).await;
        assert!(rewritten > moved, "round {round}");
        let record: serde_json::Value = serde_json::from_slice(
            &store
                .get(&activity_key(&host))
                .await
                .expect("get")
                .expect("record")
                .value,
        )
        .expect("JSON");
        assert_eq!(record["plugin_version"], "test-2");
        plugin_add(&upgraded, &host, &format!("net.{host}-f")).await;
        assert_eq!(activity_revision(store.as_ref(), &host).await, rewritten);
    }
    assert_check_clean(&Ipam::new(store)).await;
}

#[tokio::test]
async fn a_registration_this_build_cannot_read_whole_makes_every_commit_rewrite_the_activity_record(
) {
    let unreadable: [(&str, &[u8]); 2] = [
        // A later release's registration, with a field this build does not know (it may be a mark).
        (
            "a field this build does not know",
            br#"{"node":"node-a","registered_at":1,"agent_version":"9.0.0","held_for":"reclaim"}"#,
        ),
        // Bytes that are not a registration at all (damaged, or another writer's).
        ("bytes that are not JSON", b"\x00\xffnot a registration"),
    ];
    for (what, bytes) in unreadable {
        let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
        ipam_with_pool(Arc::clone(&store)).await;
        let plugin = plugin_of(Arc::clone(&store), "node-a", "test");
        plugin_add(&plugin, "node-a", "net.a").await;
        store
            .put(&agent_key("node-a"), bytes.to_vec())
            .await
            .expect("the registration");
        let before = activity_revision(store.as_ref(), "node-a").await;
        plugin_add(&plugin, "node-a", "net.b").await;
        let after = activity_revision(store.as_ref(), "node-a").await;
        assert!(after > before, "{what}: the ADD left the record as it was");
        plugin_del(&plugin, "node-a", "net.b").await;
        let after_del = activity_revision(store.as_ref(), "node-a").await;
        assert!(
            after_del > after,
            "{what}: the DEL left the record as it was"
        );
        // The registration itself is left as it was: the plugin never rewrites it.
        let kept = store
            .get(&agent_key("node-a"))
            .await
            .expect("read the registration")
            .expect("the registration is still there");
        assert_eq!(kept.value, bytes, "{what}");
    }
}

/// What a reclaimer does to `node-a` between the plugin's read and its commit.
#[derive(Debug, Clone, Copy)]
enum Interjection {
    /// A whole reclaim pass, which marks the node.
    Mark,
    /// Only the countdown's start (a plain key, as [`TestCountdowns`] puts), before any mark,
    /// with the node's generation, as every reclaimer of a store finalized at format 7 does.
    Countdown,
    /// The same start without the node's generation, as a reclaimer of a format-6 release does.
    CountdownOfAnOlderRelease,
}

/// A store whose first commit is preceded by `interjection`: a reclaimer acts between the
/// plugin's read and its commit.
#[derive(Debug)]
struct InterjectsBeforeFirstCommit {
    inner: Arc<dyn KvStore>,
    interjection: Interjection,
    done: std::sync::atomic::AtomicBool,
}

impl InterjectsBeforeFirstCommit {
    fn over(inner: &Arc<dyn KvStore>, interjection: Interjection) -> Arc<dyn KvStore> {
        Arc::new(InterjectsBeforeFirstCommit {
            inner: Arc::clone(inner),
            interjection,
            done: false.into(),
        })
    }
}

#[async_trait]
impl KvStore for InterjectsBeforeFirstCommit {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }
    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        self.inner.read_many(reads).await
    }
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        if !self.done.swap(true, Ordering::SeqCst) {
            match self.interjection {
                Interjection::Mark => {
                    let outcomes = pass(&self.inner).await;
                    assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::MarkedMissing);
                }
                Interjection::Countdown | Interjection::CountdownOfAnOlderRelease => {
                    let generation = [Op::put(
                        ipam_core::model::keys::node_generation("node-a"),
                        b"countdown".to_vec(),
                    )];
                    let also: &[Op] = match self.interjection {
                        Interjection::Countdown => &generation,
                        _ => &[],
                    };
                    let record = CountdownRecord {
                        node: "node-a".into(),
                        grace_seconds: GRACE.as_secs(),
                        addresses_kept: false,
                    };
                    TestCountdowns(Arc::clone(&self.inner))
                        .start(
                            &countdown_key("node-a"),
                            serde_json::to_vec(&record).expect("encode the countdown"),
                            GRACE,
                            &[],
                            also,
                        )
                        .await
                        .expect("start the countdown");
                }
            }
        }
        self.inner.commit(txn).await
    }
}

/// A registered `node-a` with one allocation, then an ADD by its plugin with `interjection`
/// between the ADD's read and its commit; asserts the ADD moved the activity record. The store
/// is at this build's format, or at format 6 (not finalized) with `format_6`.
async fn add_with_a_reclaimer_interjecting(interjection: Interjection) -> Arc<dyn KvStore> {
    add_with_a_reclaimer_interjecting_at(interjection, false).await
}

async fn add_with_a_reclaimer_interjecting_at(
    interjection: Interjection,
    format_6: bool,
) -> Arc<dyn KvStore> {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    if format_6 {
        store
            .put(
                &ipam_core::model::keys::store_format(),
                br#"{"writes":6}"#.to_vec(),
            )
            .await
            .expect("record format 6");
    }
    ipam_with_pool(Arc::clone(&store)).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    plugin_add(
        &plugin_of(Arc::clone(&store), "node-a", "test"),
        "node-a",
        "net.a",
    )
    .await;
    let before = activity_revision(store.as_ref(), "node-a").await;
    let racing = InterjectsBeforeFirstCommit::over(&store, interjection);
    plugin_add(&plugin_of(racing, "node-a", "test"), "node-a", "net.b").await;
    assert!(activity_revision(store.as_ref(), "node-a").await > before);
    store
}

#[tokio::test]
async fn a_mark_made_between_the_plugins_read_and_its_commit_makes_the_commit_move_the_record() {
    let store = add_with_a_reclaimer_interjecting(Interjection::Mark).await;
    let nodes = survey(store.as_ref()).await.expect("survey");
    assert_eq!(nodes[0].state, NodeState::Active);
    // The grace passing changes nothing: the node is not dead, it is marked again.
    grace_passes(store.as_ref(), "node-a").await;
    assert_eq!(
        action_of(&pass(&store).await, "node-a"),
        &NodeAction::MarkedAgain
    );
    assert_eq!(addresses_of(&Ipam::new(store), "node-a").await, 2);
}

/// Countdowns as plain keys that, once the countdown is put and before the reclaimer marks the
/// registration, let the node's plugin (`plugin`) commit one ADD: the commit that lands between
/// the countdown's start and the mark.
struct PluginCommitsAfterTheCountdown {
    store: Arc<dyn KvStore>,
    plugin: Ipam,
    handle: String,
}

#[async_trait]
impl Countdowns for PluginCommitsAfterTheCountdown {
    async fn start(
        &self,
        key: &str,
        value: Vec<u8>,
        duration: Duration,
        guard: &[Condition],
        also: &[Op],
    ) -> Result<Revision, IpamError> {
        let revision = TestCountdowns(Arc::clone(&self.store))
            .start(key, value, duration, guard, also)
            .await?;
        plugin_add(&self.plugin, "node-a", &self.handle).await;
        Ok(revision)
    }
}

#[tokio::test]
async fn a_plugin_commit_after_the_countdown_started_and_before_the_mark_keeps_the_node_from_being_reclaimed(
) {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    ipam_with_pool(Arc::clone(&store)).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    // Through a cache (the agent answers the plugin's reads from one: it kept "no countdown"
    // from an earlier call) and directly.
    let through_cache: Arc<dyn KvStore> =
        Arc::new(ipam_core::caching::CachingStore::new(Arc::clone(&store)));
    for (round, plugin_store) in [Arc::clone(&store), through_cache].into_iter().enumerate() {
        let plugin = plugin_of(plugin_store, "node-a", "test");
        plugin_add(&plugin, "node-a", &format!("net.steady-{round}")).await;
        let before = activity_revision(store.as_ref(), "node-a").await;
        let racing = PluginCommitsAfterTheCountdown {
            store: Arc::clone(&store),
            plugin,
            handle: format!("net.racing-{round}"),
        };
        let outcomes = reclaim_pass(Arc::clone(&store), &racing, &options())
            .await
            .expect("reclaim pass");
        // The commit moved the record, so the mark (guarded by "record unmoved") was refused:
        // the grace is timed again from a countdown started after that commit.
        assert_eq!(
            action_of(&outcomes, "node-a"),
            &NodeAction::Changed,
            "round {round}"
        );
        assert!(
            activity_revision(store.as_ref(), "node-a").await > before,
            "round {round}"
        );
        let registration = registration(store.as_ref(), "node-a")
            .await
            .expect("registered");
        assert_eq!(registration.missing_mark, None, "round {round}");
        // The countdown started before the commit runs out: the node is not dead.
        grace_passes(store.as_ref(), "node-a").await;
        assert_eq!(
            action_of(&pass(&store).await, "node-a"),
            &NodeAction::MarkedMissing,
            "round {round}"
        );
        assert_eq!(
            blocks_of(store.as_ref(), "node-a").await,
            1,
            "round {round}"
        );
        // The next round starts unmarked, as after the node's agent registered again.
        grace_passes(store.as_ref(), "node-a").await;
        register(store.as_ref(), "node-a", "test", T0)
            .await
            .expect("register again");
    }
    assert_eq!(
        addresses_of(&Ipam::new(Arc::clone(&store)), "node-a").await,
        4
    );
    assert_check_clean(&Ipam::new(store)).await;
}

/// The countdown a pass starts again for an active node (agent down, plugin at work) is guarded
/// like the first: a plugin commit between its start and the new mark refuses the mark, so the
/// old mark stays, the node is found active again once that countdown ran out, and it is marked
/// again rather than reclaimed.
#[tokio::test]
async fn a_plugin_commit_while_an_active_node_is_marked_again_keeps_it_from_being_reclaimed() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    ipam_with_pool(Arc::clone(&store)).await;
    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    assert_eq!(
        action_of(&pass(&store).await, "node-a"),
        &NodeAction::MarkedMissing
    );
    let plugin = plugin_of(Arc::clone(&store), "node-a", "test");
    plugin_add(&plugin, "node-a", "net.steady").await;
    let first_mark = registration(store.as_ref(), "node-a")
        .await
        .expect("registered")
        .missing_mark
        .expect("marked");
    let before = activity_revision(store.as_ref(), "node-a").await;
    let racing = PluginCommitsAfterTheCountdown {
        store: Arc::clone(&store),
        plugin,
        handle: "net.racing".into(),
    };
    let outcomes = reclaim_pass(Arc::clone(&store), &racing, &options())
        .await
        .expect("reclaim pass");
    assert_eq!(outcomes[0].state, NodeState::Active);
    assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::Changed);
    assert!(activity_revision(store.as_ref(), "node-a").await > before);
    assert_eq!(
        registration(store.as_ref(), "node-a")
            .await
            .expect("registered")
            .missing_mark,
        Some(first_mark),
        "the refused mark left the earlier one"
    );
    grace_passes(store.as_ref(), "node-a").await;
    assert_eq!(
        action_of(&pass(&store).await, "node-a"),
        &NodeAction::MarkedAgain
    );
    assert_eq!(blocks_of(store.as_ref(), "node-a").await, 1);
    assert_eq!(
        addresses_of(&Ipam::new(Arc::clone(&store)), "node-a").await,
        2
    );
}

/// In a store not finalized at format 7, a reclaimer of the previous release starts countdowns
/// without the node's generation: the plugin's commit still tests the countdown itself.
#[tokio::test]
async fn before_finalize_an_older_reclaimers_countdown_between_the_read_and_the_commit_moves_the_record(
) {
    let store =
        add_with_a_reclaimer_interjecting_at(Interjection::CountdownOfAnOlderRelease, true).await;
    let format = store
        .get(&ipam_core::model::keys::store_format())
        .await
        .expect("read")
        .expect("recorded");
    assert_eq!(format.value, br#"{"writes":6}"#.to_vec(), "still format 6");
}

#[tokio::test]
async fn a_countdown_started_between_the_plugins_read_and_its_commit_makes_the_commit_move_the_record(
) {
    let store = add_with_a_reclaimer_interjecting(Interjection::Countdown).await;
    // While a countdown runs, every commit moves the record, marked or not.
    let moved = activity_revision(store.as_ref(), "node-a").await;
    plugin_del(
        &plugin_of(Arc::clone(&store), "node-a", "test"),
        "node-a",
        "net.b",
    )
    .await;
    assert!(activity_revision(store.as_ref(), "node-a").await > moved);
}

/// `host`'s node generation as stored.
async fn node_generation(store: &dyn KvStore, host: &str) -> Option<KeyValue> {
    store
        .get(&ipam_core::model::keys::node_generation(host))
        .await
        .expect("read the node generation")
}

/// Asserts that `host`'s node generation names `writer` and was put in the transaction that last
/// wrote `key`.
async fn assert_generation_put_with(store: &dyn KvStore, host: &str, writer: &str, key: &str) {
    let generation = node_generation(store, host)
        .await
        .unwrap_or_else(|| panic!("{writer}: no node generation"));
    let written = store
        .get(key)
        .await
        .expect("read")
        .unwrap_or_else(|| panic!("{writer}: {key} absent"));
    assert_eq!(
        (generation.value.as_slice(), generation.revision),
        (writer.as_bytes(), written.revision),
        "{writer}: the generation was not put with {key}"
    );
}

/// Countdowns as [`TestCountdowns`] starts them, recording the node generation right after each
/// start beside the start's revision.
struct GenerationAfterEachCountdown {
    store: Arc<dyn KvStore>,
    seen: std::sync::Mutex<Vec<(Revision, Option<KeyValue>)>>,
}

#[async_trait]
impl Countdowns for GenerationAfterEachCountdown {
    async fn start(
        &self,
        key: &str,
        value: Vec<u8>,
        duration: Duration,
        guard: &[Condition],
        also: &[Op],
    ) -> Result<Revision, IpamError> {
        let revision = TestCountdowns(Arc::clone(&self.store))
            .start(key, value, duration, guard, also)
            .await?;
        let generation = node_generation(self.store.as_ref(), "node-a").await;
        self.seen
            .lock()
            .expect("not poisoned")
            .push((revision, generation));
        Ok(revision)
    }
}

/// Every write of what decides whether a node's plugin rewrites its activity record puts the
/// node's generation in its own transaction, naming the writer: the agent registering, the
/// plugin's record (not a call that leaves it as it is), the grace countdown's start, the mark,
/// its clearing, the reclaim; forgetting the node deletes it.
#[tokio::test]
async fn every_write_of_a_nodes_activity_evidence_changes_its_generation() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    ipam_with_pool(Arc::clone(&store)).await;
    let countdowns = GenerationAfterEachCountdown {
        store: Arc::clone(&store),
        seen: std::sync::Mutex::new(Vec::new()),
    };
    let pass = || async {
        reclaim_pass(Arc::clone(&store), &countdowns, &options())
            .await
            .expect("reclaim pass")
    };
    let agent = agent_key("node-a");
    let activity = activity_key("node-a");

    register(store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    assert_generation_put_with(store.as_ref(), "node-a", "registration", &agent).await;
    plugin_commit(&store, "node-a", "net.a").await;
    assert_generation_put_with(store.as_ref(), "node-a", "activity", &activity).await;
    let before = node_generation(store.as_ref(), "node-a").await;
    plugin_commit(&store, "node-a", "net.b").await;
    assert_eq!(
        node_generation(store.as_ref(), "node-a").await,
        before,
        "a call that leaves the record as it is"
    );

    // No liveness key: the countdown starts, then the mark.
    let outcomes = pass().await;
    assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::MarkedMissing);
    assert_generation_put_with(store.as_ref(), "node-a", "mark", &agent).await;
    {
        let seen = countdowns.seen.lock().expect("not poisoned");
        let (revision, generation) = seen.last().expect("a countdown started");
        let generation = generation.as_ref().expect("a generation");
        assert_eq!(
            (generation.value.as_slice(), generation.revision),
            (b"countdown".as_slice(), *revision),
            "the generation was not put with the countdown"
        );
    }

    // The agent is back: the mark is cleared.
    set_live(store.as_ref(), "node-a").await;
    let outcomes = pass().await;
    assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::ClearedMark);
    assert_generation_put_with(store.as_ref(), "node-a", "mark-cleared", &agent).await;

    // Gone again for longer than the grace: reclaimed.
    store
        .delete(&liveness_key("node-a"))
        .await
        .expect("the agent stops");
    let outcomes = pass().await;
    assert_eq!(action_of(&outcomes, "node-a"), &NodeAction::MarkedMissing);
    grace_passes(store.as_ref(), "node-a").await;
    let outcomes = pass().await;
    assert!(
        matches!(action_of(&outcomes, "node-a"), NodeAction::Reclaimed(_)),
        "{outcomes:?}"
    );
    assert_generation_put_with(store.as_ref(), "node-a", "reclaim", &agent).await;

    assert!(forget_node(store.as_ref(), "node-a").await.expect("forget"));
    assert_eq!(node_generation(store.as_ref(), "node-a").await, None);
}
