//! Today's agents reclaiming (etcd): a node of the previous release dies, today's agent on another node releases its blocks in format 3 and keeps its addresses, both releases' nodes keep working, and the node comes back with the previous agent.
//!
//! old-2 runs the previous release's agent (registered, its liveness key on a lease of 3 s) and
//! plugin, fills its block of the main pool with six containers and leaves an empty block in the
//! other pool. Today's agent on new-1 reclaims, with a liveness TTL and grace of 3 s (short, with
//! room for a keep-alive delayed a second or two on a loaded machine), a pass every second and the
//! empty-block release off, so that what it does is the dead-node reclaim alone. old-2's agent is
//! SIGKILLed and its plugin makes no call: old-1 (the previous plugin) and new-1 (today's) ADD and
//! DEL throughout, until the reclaim is seen. Then old-2 owns no block (the empty one deleted, the
//! full one without a host, rewritten with its claim in format 3), its six addresses are kept, and
//! `check` of both releases is clean. The previous agent restarted on old-2 registers again
//! (today's reclaimer then deletes the record that kept the addresses), old-2's previous plugin
//! DELs its containers, and new-1 and old-1 borrow the addresses freed in the block old-2 lost.
//!
//! old-2's block is full when old-2 dies: nothing but the reclaim writes it until old-2 is back,
//! so the block and claim the reclaim wrote are still in the store, exactly as it wrote them,
//! when the test reads them.
//!
//! Today's agent starts first and keeps the reclaimer leader key throughout (checked). The
//! previous release's agent must not lead while a node today's agent reclaimed is still down:
//! its rule (ff39a16) never reads `ipam/v1/missing/<node>` (it predates the countdowns) and
//! judges by its own wall-clock `missing_since`; tried by hand as leader with a 1 s grace after
//! this reclaim, it rewrote old-2's registration without today's `missing_mark` and
//! `blocks_released`, released all six of old-2's addresses a second later, deleted the
//! registration and left the hold record behind. docs/agent.md ("One reclaimer at a time") and
//! docs/upgrading.md say so, and upgrade the agents first.

use std::ffi::OsString;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ipam_core::dead_nodes::{
    agent_key, countdown_key, liveness_key, reclaimer_leader_key, CountdownRecord, Registration,
};
use ipam_core::model::keys;
use ipam_core::KeyValue;
use ipnet::IpNet;
use serde_json::{json, Value};
use test_kit::agent::InProcessAgent;

use crate::agents::PreviousAgent;
use crate::cluster::{
    describe, MixedCluster, Node, Release, StoreKind, MAIN_POOL, NEW_1, OLD_1, OLD_2, OTHER,
    OTHER_POOL,
};
use crate::{previous_cli_adds_the_other_pool, previous_release_sets_up};

/// The stored format every writer writes until the upgrade is finalized, and the only one the
/// previous release reads.
const PREVIOUS_FORMAT: u8 = 3;
/// The agents' liveness TTL and today's dead-node grace (seconds): short, with room for a
/// keep-alive or a pass delayed a second or two on a loaded machine.
const TTL_AND_GRACE_SECONDS: &str = "3";
/// Today's reclaim interval: the shortest its flags allow (seconds).
const RECLAIM_INTERVAL_SECONDS: &str = "1";
/// Longest the test waits for a node to be registered and live, or back.
const REGISTRATION_BOUND: Duration = Duration::from_secs(30);
/// Longest the test waits, from old-2's death, for its reclaim: about TTL + grace + two
/// intervals (8 s) is expected; the rest is room for a loaded machine.
const RECLAIM_BOUND: Duration = Duration::from_secs(40);
/// How often the test reads the store while it waits.
const POLL: Duration = Duration::from_millis(100);
/// The most ADD-and-DEL rounds each of old-1 and new-1 makes while old-2 is being reclaimed.
const MOST_ROUNDS_MEANWHILE: usize = 200;
/// The pause between two of those rounds, to keep the machine's load (and CI's) down.
const PAUSE_BETWEEN_ROUNDS: Duration = Duration::from_millis(50);
/// old-2's containers: as many as its /29 block of the main pool has usable addresses.
const OLD_2_CONTAINERS: [&str; 6] = [
    "old-2-a", "old-2-b", "old-2-c", "old-2-d", "old-2-e", "old-2-f",
];

/// The value stored at `key` in `dump`.
fn stored<'a>(dump: &'a [KeyValue], key: &str) -> Option<&'a KeyValue> {
    dump.iter().find(|kv| kv.key == key)
}

/// `node`'s registration in `dump`, when there is one that decodes.
fn registration(dump: &[KeyValue], node: &str) -> Option<(Registration, u64)> {
    let kv = stored(dump, &agent_key(node))?;
    let registration = serde_json::from_slice(&kv.value).ok()?;
    Some((registration, kv.revision.0))
}

/// The record under `node`'s countdown key in `dump`, when there is one that decodes.
fn countdown(dump: &[KeyValue], node: &str) -> Option<CountdownRecord> {
    serde_json::from_slice(&stored(dump, &countdown_key(node))?.value).ok()
}

/// Whether `dump` holds `node`'s liveness key.
fn is_live(dump: &[KeyValue], node: &str) -> bool {
    stored(dump, &liveness_key(node)).is_some()
}

/// The node named by the reclaimer leader key in `dump`.
fn leader(dump: &[KeyValue]) -> Option<String> {
    stored(dump, &reclaimer_leader_key()).map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
}

/// The blocks affine to `node` in `dump`, with their keys.
fn blocks_of(dump: &[KeyValue], node: &str) -> Vec<(IpNet, String)> {
    let dir = keys::host_blocks_dir(node);
    dump.iter()
        .filter(|kv| kv.key.starts_with(&dir))
        .filter_map(|kv| {
            let cidr = keys::parse_cidr_segment(kv.key.rsplit('/').next()?)?;
            Some((cidr, kv.key.clone()))
        })
        .collect()
}

/// `pool` (one of the constants) as a network.
fn network(pool: &str) -> IpNet {
    pool.parse().expect("a pool's CIDR")
}

/// Whether `address` (as an ADD result shows it) lies in `block`.
fn holds(block: &IpNet, address: &str) -> bool {
    address
        .parse::<std::net::IpAddr>()
        .is_ok_and(|address| block.contains(&address))
}

/// Reads the store every [`POLL`] until `condition` holds of it, for at most `bound`: the store
/// it held, or `None` (with a failure recorded under `what`) when the bound ran out.
fn wait_for(
    cluster: &MixedCluster,
    what: &str,
    bound: Duration,
    mut condition: impl FnMut(&[KeyValue]) -> bool,
) -> Option<Vec<KeyValue>> {
    let deadline = Instant::now() + bound;
    loop {
        let dump = cluster.dump();
        if condition(&dump) {
            return Some(dump);
        }
        if Instant::now() >= deadline {
            cluster.fail(format!("{what}: not within {bound:?}"));
            return None;
        }
        std::thread::sleep(POLL);
    }
}

/// Today's `gc --dead-nodes` (it only reads): the state it shows for `node`.
fn dead_nodes_state(cluster: &MixedCluster, step: &str, node: &str) -> Value {
    let out = cluster.ctl_ok(step, Release::Today, &["gc", "--dead-nodes"]);
    out["nodes"]
        .as_array()
        .and_then(|nodes| nodes.iter().find(|n| n["node"] == json!(node)))
        .map_or(Value::Null, |n| n["state"].clone())
}

/// The previous agent of `node` on the cluster's etcd, its liveness TTL the shortest there is
/// (its grace and interval left at their defaults, as an operator runs it).
fn start_previous_agent(
    cluster: &MixedCluster,
    dir: &Path,
    node: Node,
    log_name: &str,
) -> PreviousAgent {
    let (endpoint, prefix) = cluster.etcd_location().expect("an etcd store");
    let socket = dir.join(format!("{}.sock", node.name));
    // A killed agent leaves its socket behind; the agent replaces such a socket by itself, but
    // the start waits for the socket to appear.
    let _ = std::fs::remove_file(&socket);
    let flags: Vec<OsString> = [
        "--datastore-type",
        "etcdv3",
        "--etcd-endpoints",
        &endpoint,
        "--etcd-prefix",
        &prefix,
        "--node",
        node.name,
        "--liveness-ttl-seconds",
        TTL_AND_GRACE_SECONDS,
    ]
    .map(OsString::from)
    .into();
    PreviousAgent::start_with_flags(cluster.previous(), &socket, &flags, dir.join(log_name))
}

/// Today's agent of new-1 on the cluster's etcd, as the reclaimer: short TTL, grace and interval,
/// and no empty-block release.
fn start_todays_reclaimer(cluster: &MixedCluster, dir: &Path) -> InProcessAgent {
    let (endpoint, prefix) = cluster.etcd_location().expect("an etcd store");
    let flags: Vec<OsString> = [
        "--datastore-type",
        "etcdv3",
        "--etcd-endpoints",
        &endpoint,
        "--etcd-prefix",
        &prefix,
        "--node",
        NEW_1.name,
        "--liveness-ttl-seconds",
        TTL_AND_GRACE_SECONDS,
        "--dead-node-grace-seconds",
        TTL_AND_GRACE_SECONDS,
        "--reclaim-interval-seconds",
        RECLAIM_INTERVAL_SECONDS,
        "--empty-block-release-seconds",
        "0",
    ]
    .map(OsString::from)
    .into();
    InProcessAgent::run_binary_with_flags(&dir.join("new-1.sock"), flags)
        .unwrap_or_else(|e| panic!("today's agent did not start: {e}"))
}

/// What old-2 holds before it dies.
struct Old2Blocks {
    /// Its block of the main pool, full.
    full: IpNet,
    /// Its empty block of the other pool.
    empty: IpNet,
}

/// old-2's previous plugin fills a block of the main pool and leaves an empty block in the
/// other pool (the previous CLI adds that pool).
fn old_2_runs_containers(cluster: &MixedCluster) -> Option<Old2Blocks> {
    let step = "old-2 (the previous plugin) runs containers";
    for container in OLD_2_CONTAINERS {
        cluster.add(step, OLD_2, container);
    }
    previous_cli_adds_the_other_pool(cluster);
    let netconf = cluster.netconf(OLD_2, json!({"ipv4_pools": [OTHER]}));
    for command in ["ADD", "DEL"] {
        let done = cluster.plugin(OLD_2, command, "old-2-other", &netconf);
        if done.status != 0 {
            cluster.fail(format!(
                "{step}: old-2 {command} in the other pool failed: {}",
                describe(&done)
            ));
        }
    }
    let blocks = blocks_of(&cluster.dump(), OLD_2.name);
    let given: Vec<String> = OLD_2_CONTAINERS
        .iter()
        .flat_map(|container| cluster.addresses_of(container))
        .collect();
    // Full: its six containers hold the block's six usable addresses.
    let full = blocks.iter().find(|(cidr, _)| {
        network(MAIN_POOL).contains(cidr)
            && given.len() == OLD_2_CONTAINERS.len()
            && given.iter().all(|address| holds(cidr, address))
    });
    let empty = blocks
        .iter()
        .find(|(cidr, _)| network(OTHER_POOL).contains(cidr));
    match (full, empty) {
        (Some((full, _)), Some((empty, _))) => Some(Old2Blocks {
            full: *full,
            empty: *empty,
        }),
        _ => {
            cluster.fail(format!(
                "{step}: old-2 should own a block of {MAIN_POOL} its containers fill and an empty \
                 one of {OTHER_POOL}; it owns {blocks:?}, its containers hold {given:?}: the \
                 scenario tests nothing"
            ));
            None
        }
    }
}

/// ADD then DEL of fresh containers on `node`, round after round, until `done` is set (at most
/// [`MOST_ROUNDS_MEANWHILE`] rounds, [`PAUSE_BETWEEN_ROUNDS`] apart); counts the rounds in
/// `rounds`.
fn keep_calling(
    cluster: &MixedCluster,
    step: &str,
    node: Node,
    done: &AtomicBool,
    rounds: &AtomicUsize,
) {
    while !done.load(Ordering::Relaxed) && rounds.load(Ordering::Relaxed) < MOST_ROUNDS_MEANWHILE {
        cluster.add_and_del(step, node);
        rounds.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(PAUSE_BETWEEN_ROUNDS);
    }
}

/// What the reclaim must have left in `dump`: old-2 owns no block; its empty block and that
/// block's claim are deleted; its full block is without a host, and that block and its claim
/// are rewritten (since `before_death`) in format 3 by the reclaim (at or before the
/// registration's mark, nothing wrote them since); every block and claim in the store is in
/// format 3.
fn reclaim_left_format_3(
    cluster: &MixedCluster,
    step: &str,
    blocks: &Old2Blocks,
    before_death: &[KeyValue],
    dump: &[KeyValue],
) {
    let still_owned = blocks_of(dump, OLD_2.name);
    if !still_owned.is_empty() {
        cluster.fail(format!("{step}: old-2 still owns {still_owned:?}"));
    }
    let mut empty_block_keys = keys::block_candidates(Some(OLD_2.name), &blocks.empty);
    empty_block_keys.push(keys::block(None, &blocks.empty));
    empty_block_keys.push(keys::block_claim(&blocks.empty));
    for key in empty_block_keys {
        if stored(dump, &key).is_some() {
            cluster.fail(format!(
                "{step}: {key} is still stored: old-2's empty block should be deleted"
            ));
        }
    }
    let mark_revision = registration(dump, OLD_2.name).map_or(0, |(_, revision)| revision);
    for key in [
        keys::block(None, &blocks.full),
        keys::block_claim(&blocks.full),
    ] {
        let Some(kv) = stored(dump, &key) else {
            cluster.fail(format!(
                "{step}: {key} is missing: old-2's full block should be kept, without a host"
            ));
            continue;
        };
        let rewritten = stored(before_death, &key).is_none_or(|was| was.revision < kv.revision);
        if !rewritten || kv.revision.0 > mark_revision {
            cluster.fail(format!(
                "{step}: {key} (revision {}) should be the reclaim's write, between old-2's death \
                 and its registration's mark (revision {mark_revision})",
                kv.revision.0
            ));
        }
        eprintln!(
            "{step}: the reclaim wrote {key} at revision {} in format {:?}",
            kv.revision.0,
            kv.value.first()
        );
        if kv.value.first() != Some(&PREVIOUS_FORMAT) {
            cluster.fail(format!(
                "{step}: the reclaim wrote {key} in format {:?}, not {PREVIOUS_FORMAT}: the \
                 previous release cannot read it",
                kv.value.first()
            ));
        }
    }
    let newer: Vec<String> = dump
        .iter()
        .filter(|kv| {
            kv.key.starts_with(&keys::blocks_dir()) || kv.key.starts_with(&keys::claims_dir())
        })
        .filter(|kv| kv.value.first() != Some(&PREVIOUS_FORMAT))
        .map(|kv| format!("{} (format {:?})", kv.key, kv.value.first()))
        .collect();
    if !newer.is_empty() {
        cluster.fail(format!(
            "{step}: blocks and claims not in format {PREVIOUS_FORMAT}: {}",
            newer.join(", ")
        ));
    }
}

/// Today's agent on new-1 reclaims old-2 (previous agent and plugin) once it is dead; see the
/// module's documentation.
pub fn todays_agent_reclaims_a_dead_node_of_the_previous_release(kind: StoreKind) {
    assert_eq!(kind, StoreKind::Etcd, "dead-node reclaim needs etcd leases");
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    let dir = tempfile::Builder::new()
        .prefix("blockipam-upgrade-agents-")
        .tempdir()
        .expect("a temporary directory");

    // Today's agent first, so that it is the reclaimer: the previous agent, started next, finds
    // the leader key taken.
    let step = "today's agent on new-1 starts";
    let todays_agent = start_todays_reclaimer(&cluster, dir.path());
    wait_for(
        &cluster,
        &format!("{step}: new-1 registered, live and the reclaimer"),
        REGISTRATION_BOUND,
        |dump| {
            registration(dump, NEW_1.name).is_some()
                && is_live(dump, NEW_1.name)
                && leader(dump).as_deref() == Some(NEW_1.name)
        },
    );
    let step = "the previous agent on old-2 starts";
    let mut old_2_agent = start_previous_agent(&cluster, dir.path(), OLD_2, "old-2-agent.log");
    wait_for(
        &cluster,
        &format!("{step}: old-2 registered and live"),
        REGISTRATION_BOUND,
        |dump| registration(dump, OLD_2.name).is_some() && is_live(dump, OLD_2.name),
    );
    let Some(blocks) = old_2_runs_containers(&cluster) else {
        drop(old_2_agent);
        drop(todays_agent);
        cluster.finish("today's agent reclaiming a dead node of the previous release");
        return;
    };
    cluster.check_with_both("before old-2 dies");

    // old-2 dies: its agent is SIGKILLed (its lease runs out by itself), its plugin is silent.
    // old-1 and new-1 keep calling meanwhile, each on its own thread.
    let step = "while old-2 is dead and reclaimed";
    let before_death = cluster.dump();
    old_2_agent.kill();
    let died = Instant::now();
    let reclaimed_seen = AtomicBool::new(false);
    let (old_1_rounds, new_1_rounds) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let reclaimed = std::thread::scope(|scope| {
        scope.spawn(|| keep_calling(&cluster, step, OLD_1, &reclaimed_seen, &old_1_rounds));
        scope.spawn(|| keep_calling(&cluster, step, NEW_1, &reclaimed_seen, &new_1_rounds));
        let reclaimed = wait_for(
            &cluster,
            &format!("{step}: old-2's reclaim"),
            RECLAIM_BOUND,
            |dump| {
                registration(dump, OLD_2.name).is_some_and(|(r, _)| r.blocks_released)
                    && countdown(dump, OLD_2.name).is_some_and(|c| c.addresses_kept)
            },
        );
        reclaimed_seen.store(true, Ordering::Relaxed);
        reclaimed
    });
    let rounds = (
        old_1_rounds.load(Ordering::Relaxed),
        new_1_rounds.load(Ordering::Relaxed),
    );
    eprintln!(
        "{step}: reclaim seen {:.1?} after old-2's agent was killed; meanwhile old-1 made {} and \
         new-1 {} ADD-and-DEL rounds",
        died.elapsed(),
        rounds.0,
        rounds.1
    );
    if rounds.0 == 0 || rounds.1 == 0 {
        cluster.fail(format!(
            "{step}: old-1 and new-1 should both call meanwhile; rounds {rounds:?}"
        ));
    }
    let Some(reclaimed) = reclaimed else {
        eprintln!("old-2's previous agent logged:\n{}", old_2_agent.log_text());
        drop(todays_agent);
        cluster.finish("today's agent reclaiming a dead node of the previous release");
        return;
    };

    let step = "after old-2's reclaim";
    if leader(&reclaimed).as_deref() != Some(NEW_1.name) {
        cluster.fail(format!(
            "{step}: the reclaimer leader is {:?}, not today's agent on new-1",
            leader(&reclaimed)
        ));
    }
    let dump = cluster.dump();
    reclaim_left_format_3(&cluster, step, &blocks, &before_death, &dump);
    // The ledger still holds old-2's six containers: the store must hold their addresses.
    cluster.store_agrees_with_live_containers(step);
    cluster.check_with_both(step);
    let state = dead_nodes_state(&cluster, step, OLD_2.name);
    if state != json!("reclaimed") {
        cluster.fail(format!(
            "{step}: today's `gc --dead-nodes` shows old-2 {state}, not reclaimed"
        ));
    }
    cluster.add_and_del(&format!("{step}, old-1's next call"), OLD_1);
    cluster.add_and_del(&format!("{step}, new-1's next call"), NEW_1);

    // old-2 comes back: the previous agent restarted there registers again; today's reclaimer
    // sees it alive and deletes the record that kept its addresses.
    let step = "the previous agent restarted on old-2";
    let mut old_2_agent =
        start_previous_agent(&cluster, dir.path(), OLD_2, "old-2-agent-restarted.log");
    wait_for(
        &cluster,
        &format!("{step}: old-2 live, registered without marks, its addresses' record deleted"),
        REGISTRATION_BOUND,
        |dump| {
            is_live(dump, OLD_2.name)
                && registration(dump, OLD_2.name)
                    .is_some_and(|(r, _)| !r.blocks_released && r.missing_mark.is_none())
                && stored(dump, &countdown_key(OLD_2.name)).is_none()
        },
    );
    let state = dead_nodes_state(&cluster, step, OLD_2.name);
    if state != json!("alive") {
        cluster.fail(format!(
            "{step}: today's `gc --dead-nodes` shows old-2 {state}, not alive"
        ));
    }
    if !old_2_agent.is_running() {
        cluster.fail(format!("{step}: it exited: {}", old_2_agent.log_text()));
    }
    let dump = cluster.dump();
    if leader(&dump).as_deref() != Some(NEW_1.name) {
        cluster.fail(format!(
            "{step}: the reclaimer leader is {:?}, not today's agent on new-1",
            leader(&dump)
        ));
    }

    // old-2's previous plugin DELs half of its containers (their addresses were kept); the
    // block it lost then lends them: to new-1 first (today's plugin borrows from blocks without
    // a host first), then to old-1 once its own block is full.
    let step = "old-2 back, its previous plugin DELs its containers";
    for container in &OLD_2_CONTAINERS[..3] {
        cluster.del(step, OLD_2, container);
    }
    let step = "new-1 and old-1 borrow from the block old-2 lost";
    let lent_to_new_1 = cluster
        .add(step, NEW_1, &cluster.fresh_container(NEW_1))
        .unwrap_or_default();
    if !lent_to_new_1.iter().any(|a| holds(&blocks.full, a)) {
        cluster.fail(format!(
            "{step}: new-1 was given {lent_to_new_1:?}, not an address of {}",
            blocks.full
        ));
    }
    let mut lent_to_old_1 = Vec::new();
    // old-1 holds three of its block's six: the fourth ADD has to borrow.
    for _ in 0..4 {
        let given = cluster
            .add(step, OLD_1, &cluster.fresh_container(OLD_1))
            .unwrap_or_default();
        lent_to_old_1.extend(given.into_iter().filter(|a| holds(&blocks.full, a)));
    }
    if lent_to_old_1.is_empty() {
        cluster.fail(format!(
            "{step}: old-1 filled its block and borrowed nothing from {}",
            blocks.full
        ));
    }
    eprintln!(
        "{step}: new-1 holds {lent_to_new_1:?} and old-1 {lent_to_old_1:?} of {}",
        blocks.full
    );
    cluster.store_agrees_with_live_containers(step);
    cluster.check_with_both(step);
    let step = "old-2 back, its previous plugin DELs the rest and calls again";
    for container in &OLD_2_CONTAINERS[3..] {
        cluster.del(step, OLD_2, container);
    }
    cluster.add_and_del(step, OLD_2);
    cluster.both_nodes_keep_working_after("old-2's return");

    let log = old_2_agent.log_text();
    let noteworthy: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("WARN") || line.contains("ERROR"))
        .collect();
    eprintln!(
        "the previous agent restarted on old-2 logged {} lines, {} at warn or error{}",
        log.lines().count(),
        noteworthy.len(),
        if noteworthy.is_empty() {
            String::new()
        } else {
            format!(":\n{}", noteworthy.join("\n"))
        }
    );
    drop(old_2_agent);
    drop(todays_agent);
    cluster.finish("today's agent reclaiming a dead node of the previous release");
}
