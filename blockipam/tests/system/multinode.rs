//! Real concurrency between nodes: plugin processes of several simulated nodes race ADD, DEL and GC on one store while an operator races pool changes, node release and `check --repair`.
//!
//! Each simulated node has its own node name and its own host lock file, as separate machines
//! do, so nothing serialises the plugin processes of different nodes: on **etcd** they race in
//! the store itself (compare-and-swap conflicts and retries). On **sled and redb** the store's own
//! open lock lets one process in at a time: processes of different nodes still overlap in time
//! (queued on that lock), but their store work is serialised, so there the test proves that
//! interleaving, not parallel transactions.
//!
//! Each node runs its calls one after another (as a runtime does behind the host lock): ADD of new
//! containers (some only from the operator's `spare` pool), CHECK of live ones, DEL, "forgetting" a
//! container (its DEL is lost) and CNI GC with the node's real list of live attachments. One node stops half-way
//! and the operator retires it with `blockipamctl node release --addresses`; meanwhile the
//! operator adds, disables, enables and deletes the `spare` pool (`pool delete` without
//! `--force` must refuse while addresses are in use) and runs `check --repair`.
//!
//! Asserted: every ADD result's address is unique among live containers; each live container
//! still holds what it was given (nothing released under it by GC, node release, pool delete or
//! repair); a deleted pool leaves no block; `check` finds nothing, during the race and at the
//! end; after GC, DEL of everything and the node release the store holds only the network's
//! reservations; and calls of different nodes really overlapped in time.
//!
//! Size: `BLOCKIPAM_MULTINODE_ROUNDS` calls per node (default [`CI_ROUNDS`]);
//! `BLOCKIPAM_MULTINODE_SEED` replays a run's choices.

use crate::common;
use crate::fleet;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use blockipam_store::DatastoreType;
use fleet::{
    handle_of, is_reservation, seed_from_env, size_from_env, Call, CtlOutcome, Fleet, Rng, Sabotage,
};
use serde_json::{json, Value};

/// Calls per node.
const ROUNDS_VARIABLE: &str = "BLOCKIPAM_MULTINODE_ROUNDS";
/// Replays a run's choices.
const SEED_VARIABLE: &str = "BLOCKIPAM_MULTINODE_SEED";
/// Calls per node in CI.
const CI_ROUNDS: usize = 60;
/// Simulated nodes.
const NODES: usize = 4;
/// How far past its rounds a node of the pool-delete race goes on while no delete has succeeded.
const EXTRA_ROUNDS_FACTOR: usize = 5;
/// The node that stops half-way and is retired by the operator.
const STOPPING_NODE: usize = 3;
/// The netconf's pool: small (29 usable addresses in /30 blocks), so nodes claim, borrow and
/// fill it.
const MAIN_POOL: &str = "10.50.0.0/27";
/// The operator's pool, added, disabled, enabled and deleted during the race.
const SPARE_POOL: &str = "10.60.0.0/27";
/// Its name.
const SPARE: &str = "spare";

/// What the test knows a container holds.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Its ADD printed these addresses, and nothing has released them since.
    Live(Vec<String>),
    /// Its release (DEL, GC, node release) is in flight.
    Releasing,
    /// The runtime lost it without a DEL: GC or node release must collect these addresses.
    Forgotten(Vec<String>),
    /// Released, or its ADD failed: it must hold nothing.
    Gone,
}

/// Everything the racing actors share.
struct Race<'a> {
    fleet: &'a Fleet,
    seed: u64,
    rounds: usize,
    /// Container -> (node, state).
    ledger: Mutex<BTreeMap<String, (usize, State)>>,
    calls: Mutex<Vec<Call>>,
    admin: Mutex<Vec<CtlOutcome>>,
    failures: Mutex<Vec<String>>,
    nodes_running: AtomicUsize,
    stopped: AtomicBool,
    figures: Mutex<Figures>,
}

/// What happened, for the summary line.
#[derive(Debug, Default)]
struct Figures {
    adds: usize,
    adds_refused: usize,
    dels: usize,
    checks: usize,
    gcs: usize,
    gc_released: usize,
    forgotten: usize,
    node_released: usize,
    pool_adds: usize,
    pool_disables: usize,
    pool_enables: usize,
    pool_deletes: usize,
    pool_deletes_refused: usize,
    repairs: usize,
}

impl Race<'_> {
    fn fail(&self, message: String) {
        self.failures.lock().expect("failures").push(message);
    }

    fn set(&self, container: &str, node: usize, state: State) {
        self.ledger
            .lock()
            .expect("ledger")
            .insert(container.to_owned(), (node, state));
    }

    fn live_of(&self, node: usize) -> Vec<String> {
        self.ledger
            .lock()
            .expect("ledger")
            .iter()
            .filter(|(_, (n, state))| *n == node && matches!(state, State::Live(_)))
            .map(|(container, _)| container.clone())
            .collect()
    }

    /// Records a successful ADD; its addresses must be held by no other live (or forgotten, not
    /// yet collected) container.
    fn added(&self, container: &str, node: usize, addresses: Vec<String>) {
        let mut ledger = self.ledger.lock().expect("ledger");
        for (other, (_, state)) in ledger.iter() {
            if let State::Live(theirs) | State::Forgotten(theirs) = state {
                for address in addresses.iter().filter(|a| theirs.contains(a)) {
                    self.fail(format!(
                        "duplicate: {address} printed to {container} while {other} holds it"
                    ));
                }
            }
        }
        ledger.insert(container.to_owned(), (node, State::Live(addresses)));
    }

    fn figures(&self) -> std::sync::MutexGuard<'_, Figures> {
        self.figures.lock().expect("figures")
    }

    fn run(&self, node: usize, netconf: &Value, command: &str, container: &str) -> Call {
        let done = self
            .fleet
            .call(node, netconf, command, container, &Sabotage::None);
        self.calls.lock().expect("calls").push(done.clone());
        done
    }

    /// One node: `rounds` calls one after another (the stopping node stops half-way).
    fn run_node(&self, node: usize) {
        let mut rng = Rng::new(self.seed, node as u64 + 1);
        let any_pool = self.fleet.netconf(node, "1.1.0", json!({}));
        let main_only = self
            .fleet
            .netconf(node, "1.1.0", json!({"ipv4_pools": ["main"]}));
        let spare_only = self
            .fleet
            .netconf(node, "1.1.0", json!({"ipv4_pools": [SPARE]}));
        let rounds = if node == STOPPING_NODE {
            self.rounds / 2
        } else {
            self.rounds
        };
        // This node's containers that hold an address of the operator's pool.
        let mut spare_users = BTreeSet::new();
        // The ADD result of each container, for CHECK's `prevResult`.
        let mut results: BTreeMap<String, Value> = BTreeMap::new();
        for round in 0..rounds {
            let live = self.live_of(node);
            let live_spare_users: Vec<String> = live
                .iter()
                .filter(|c| spare_users.contains(*c))
                .cloned()
                .collect();
            let choice = rng.below(100);
            if choice < 45 || live.is_empty() {
                let container = format!("n{node}-{round}");
                // Half from the netconf's pool only, a third from the operator's pool only,
                // the rest from whichever pool has room.
                let pick = rng.below(100);
                let from_spare = (50..85).contains(&pick);
                let netconf = match pick {
                    0..50 => &main_only,
                    50..85 => &spare_only,
                    _ => &any_pool,
                };
                let done = self.run(node, netconf, "ADD", &container);
                self.figures().adds += 1;
                if done.succeeded() {
                    let addresses = done.addresses();
                    let spare: ipnet::IpNet = SPARE_POOL.parse().expect("spare CIDR");
                    let in_spare = addresses.iter().any(|a| {
                        a.parse::<std::net::IpAddr>()
                            .is_ok_and(|ip| spare.contains(&ip))
                    });
                    self.added(&container, node, addresses);
                    results.insert(container.clone(), done.json());
                    if in_spare {
                        spare_users.insert(container);
                    }
                    continue;
                }
                // Refusals the race makes legitimate: the pool is full, or (spare only) the
                // operator's pool is disabled or deleted. Nothing may be held afterwards.
                let allowed: &[u64] = if from_spare { &[100, 105] } else { &[100] };
                match done.error_code() {
                    Some(code) if allowed.contains(&code) => self.figures().adds_refused += 1,
                    _ => self.fail(format!("node {node}: ADD {container} failed: {done:#?}")),
                }
                self.set(&container, node, State::Gone);
            } else if choice < 70 {
                // Users of the operator's pool come and go quickly, so that the pool is often
                // empty and `pool delete` races ADDs into it.
                let container = if !live_spare_users.is_empty() && rng.percent(90) {
                    rng.pick(&live_spare_users).clone()
                } else {
                    rng.pick(&live).clone()
                };
                self.set(&container, node, State::Releasing);
                let done = self.run(node, &any_pool, "DEL", &container);
                self.figures().dels += 1;
                if !done.succeeded() {
                    self.fail(format!("node {node}: DEL {container} failed: {done:#?}"));
                }
                self.set(&container, node, State::Gone);
            } else if choice < 80 {
                // CNI CHECK: the container still holds exactly what it was given.
                let container = rng.pick(&live).clone();
                let mut netconf = any_pool.clone();
                let result = results.get(&container).cloned().unwrap_or_default();
                common::merge(&mut netconf, json!({"prevResult": result}));
                let done = self.run(node, &netconf, "CHECK", &container);
                self.figures().checks += 1;
                if !done.succeeded() {
                    self.fail(format!(
                        "node {node}: CHECK of live {container} failed: {done:#?}"
                    ));
                }
            } else if choice < 90 {
                // The runtime loses a container of the netconf's pool (collected by GC).
                let forgettable: Vec<String> = live
                    .iter()
                    .filter(|c| !spare_users.contains(*c))
                    .cloned()
                    .collect();
                if forgettable.is_empty() {
                    continue;
                }
                let container = rng.pick(&forgettable).clone();
                let mut ledger = self.ledger.lock().expect("ledger");
                if let Some((_, state @ State::Live(_))) = ledger.get_mut(&container) {
                    let State::Live(addresses) = state.clone() else {
                        unreachable!("matched Live")
                    };
                    *state = State::Forgotten(addresses);
                }
                self.figures().forgotten += 1;
            } else {
                self.gc(node, &live);
            }
        }
        if node == STOPPING_NODE {
            self.stopped.store(true, Ordering::SeqCst);
        }
    }

    /// CNI GC on `node` with `live` as the valid attachments: collects the forgotten ones.
    fn gc(&self, node: usize, live: &[String]) {
        let forgotten: Vec<String> = {
            let mut ledger = self.ledger.lock().expect("ledger");
            ledger
                .iter_mut()
                .filter(|(_, (n, state))| *n == node && matches!(state, State::Forgotten(_)))
                .map(|(container, (_, state))| {
                    *state = State::Releasing;
                    container.clone()
                })
                .collect()
        };
        let valid: Vec<Value> = live
            .iter()
            .map(|c| json!({"containerID": c, "ifname": "eth0"}))
            .collect();
        let mut netconf = self.fleet.netconf(node, "1.1.0", json!({}));
        common::merge(&mut netconf, json!({"cni.dev/valid-attachments": valid}));
        let done = self.run(node, &netconf, "GC", "");
        if !done.succeeded() {
            self.fail(format!("node {node}: GC failed: {done:#?}"));
        }
        let mut figures = self.figures();
        figures.gcs += 1;
        figures.gc_released += forgotten.len();
        drop(figures);
        for container in forgotten {
            self.set(&container, node, State::Gone);
        }
    }

    fn ctl(&self, args: &[&str]) -> CtlOutcome {
        let outcome = self.fleet.ctl(args);
        self.admin.lock().expect("admin").push(outcome.clone());
        outcome
    }

    /// The operator: until every node is done, random pool changes and `check --repair`; once
    /// the stopping node has stopped, `node release --addresses` of it.
    fn run_operator(&self) {
        let mut rng = Rng::new(self.seed, 0);
        let mut spare_exists = false;
        let mut released = false;
        while self.nodes_running.load(Ordering::SeqCst) > 0 {
            if !released && self.stopped.load(Ordering::SeqCst) {
                self.release_stopped_node();
                released = true;
            }
            let choice = rng.below(100);
            if !spare_exists {
                let out = self.ctl(&[
                    "pool",
                    "add",
                    SPARE_POOL,
                    "--name",
                    SPARE,
                    "--block-size",
                    "29",
                ]);
                if out.status == 0 {
                    spare_exists = true;
                    self.figures().pool_adds += 1;
                } else {
                    self.fail(format!("pool add: {out:#?}"));
                }
            } else if choice < 15 {
                let out = self.ctl(&["pool", "disable", SPARE]);
                self.expect_ok("pool disable", &out);
                self.figures().pool_disables += 1;
            } else if choice < 40 {
                let out = self.ctl(&["pool", "enable", SPARE]);
                self.expect_ok("pool enable", &out);
                self.figures().pool_enables += 1;
            } else if choice < 80 {
                spare_exists = !self.delete_spare();
            } else {
                self.repair();
            }
            std::thread::sleep(Duration::from_millis(rng.below(30) as u64));
        }
        if !released {
            self.release_stopped_node();
        }
    }

    fn expect_ok(&self, what: &str, out: &CtlOutcome) {
        if out.status != 0 {
            self.fail(format!("{what}: {out:#?}"));
        }
    }

    /// `pool delete spare` without `--force`: refused while addresses are in use; when it
    /// succeeds no block of the pool is left. Returns whether it deleted the pool.
    fn delete_spare(&self) -> bool {
        let out = self.ctl(&["pool", "delete", SPARE]);
        if out.status != 0 {
            let refused = out.stderr.contains("still has") && out.stderr.contains("allocated");
            if refused {
                self.figures().pool_deletes_refused += 1;
            } else {
                self.fail(format!("pool delete failed for another reason: {out:#?}"));
            }
            return false;
        }
        self.figures().pool_deletes += 1;
        // Only the operator re-adds the pool, so until then nothing may lie in it.
        let spare: ipnet::IpNet = SPARE_POOL.parse().expect("spare CIDR");
        let show = self.ctl(&["show", "--blocks"]).success_json();
        let left: Vec<&Value> = show["blocks"]
            .as_array()
            .map(|blocks| {
                blocks
                    .iter()
                    .filter(|b| {
                        b["cidr"]
                            .as_str()
                            .and_then(|c| c.parse::<ipnet::IpNet>().ok())
                            .is_some_and(|c| spare.contains(&c))
                    })
                    .collect()
            })
            .unwrap_or_default();
        if !left.is_empty() {
            self.fail(format!(
                "pool delete succeeded and left blocks of the pool: {left:#?} ({out:#?})"
            ));
        }
        true
    }

    /// `check --repair` during the race: every snapshot of the store is consistent, so it
    /// finds nothing and repairs nothing.
    fn repair(&self) {
        let out = self.ctl(&["check", "--repair"]);
        self.figures().repairs += 1;
        let report = out.json();
        let problems = report["problems"].as_array().map_or(0, Vec::len);
        let repaired = report["repaired"].as_array().map_or(0, Vec::len);
        if out.status != 0 || problems != 0 || repaired != 0 {
            self.fail(format!("check --repair during the race: {out:#?}"));
        }
    }

    /// `node release <stopped node> --addresses`: releases exactly that node's addresses.
    fn release_stopped_node(&self) {
        let node = STOPPING_NODE;
        let (live, known): (BTreeSet<String>, BTreeSet<String>) = {
            let mut ledger = self.ledger.lock().expect("ledger");
            let mut live = BTreeSet::new();
            let mut known = BTreeSet::new();
            for (_, state) in ledger.values_mut().filter(|(n, _)| *n == node) {
                match state {
                    State::Live(addresses) => {
                        live.extend(addresses.iter().cloned());
                        known.extend(addresses.iter().cloned());
                    }
                    State::Forgotten(addresses) => known.extend(addresses.iter().cloned()),
                    _ => {}
                }
                if matches!(state, State::Live(_) | State::Forgotten(_)) {
                    *state = State::Releasing;
                }
            }
            (live, known)
        };
        let host = format!("node-{node}");
        let out = self.ctl(&["node", "release", &host, "--addresses"]);
        if out.status != 0 {
            self.fail(format!("node release: {out:#?}"));
            return;
        }
        let released: BTreeSet<String> = out.json()["released_addresses"]
            .as_array()
            .map(|list| {
                list.iter()
                    .filter_map(|a| a.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        if !live.is_subset(&released) || !released.is_subset(&known) {
            self.fail(format!(
                "node release of {host} released {released:?}; its live addresses were {live:?}, all it held {known:?}"
            ));
        }
        self.figures().node_released += released.len();
        let mut ledger = self.ledger.lock().expect("ledger");
        for (_, state) in ledger.values_mut().filter(|(n, _)| *n == node) {
            if *state == State::Releasing {
                *state = State::Gone;
            }
        }
    }
}

fn race_ipam() -> Value {
    json!({
        "pools": [{"cidr": MAIN_POOL, "block_size": 30, "name": "main"}],
        "gateway": ["10.50.0.1"],
    })
}

fn nodes_race(store_type: DatastoreType) {
    let started = Instant::now();
    let seed = seed_from_env(SEED_VARIABLE);
    let rounds = size_from_env(ROUNDS_VARIABLE, CI_ROUNDS);
    let fleet = Fleet::new(store_type, NODES, race_ipam());
    let what = format!("{} (seed {seed})", store_type.as_str());
    // Create the store and the netconf's pool before the race (as a first pod would).
    let warm_up = fleet.netconf(0, "1.1.0", json!({}));
    for command in ["ADD", "DEL"] {
        let done = fleet.call(0, &warm_up, command, "warm-up", &Sabotage::None);
        assert!(done.succeeded(), "{what}: warm-up {command}: {done:#?}");
    }

    let race = Race {
        fleet: &fleet,
        seed,
        rounds,
        ledger: Mutex::new(BTreeMap::new()),
        calls: Mutex::new(Vec::new()),
        admin: Mutex::new(Vec::new()),
        failures: Mutex::new(Vec::new()),
        nodes_running: AtomicUsize::new(NODES),
        stopped: AtomicBool::new(false),
        figures: Mutex::new(Figures::default()),
    };
    std::thread::scope(|scope| {
        for node in 0..NODES {
            let race = &race;
            scope.spawn(move || {
                race.run_node(node);
                race.nodes_running.fetch_sub(1, Ordering::SeqCst);
            });
        }
        let race = &race;
        scope.spawn(move || race.run_operator());
    });
    let failures = race.failures.lock().expect("failures").clone();
    assert!(
        failures.is_empty(),
        "{what}: {} failures during the race: {failures:#?}",
        failures.len()
    );

    // Every live container still holds what it was given; nothing released holds anything.
    let mut ledger = race.ledger.lock().expect("ledger").clone();
    let allocations = fleet.allocations();
    let holder: BTreeMap<String, String> = allocations
        .iter()
        .map(|a| (a.ip.to_string(), a.handle.clone()))
        .collect();
    assert_eq!(
        holder.len(),
        allocations.len(),
        "{what}: an address is stored twice"
    );
    for (container, (_, state)) in &ledger {
        if let State::Live(addresses) | State::Forgotten(addresses) = state {
            for address in addresses {
                assert_eq!(
                    holder.get(address),
                    Some(&handle_of(container)),
                    "{what}: {container} was given {address}, and the store says {:?} holds it",
                    holder.get(address)
                );
            }
        }
    }
    for allocation in allocations.iter().filter(|a| !is_reservation(&a.handle)) {
        let container = allocation.handle.strip_prefix(&handle_of("")).unwrap_or("");
        let state = ledger.get(container).map(|(_, s)| s.clone());
        assert!(
            matches!(state, Some(State::Live(_) | State::Forgotten(_))),
            "{what}: {} is held by {}, which was released or never added (leak): {state:?}",
            allocation.ip,
            allocation.handle
        );
    }

    // Clean up as a cluster would: each remaining node's GC, then DEL of every live container.
    for node in (0..NODES).filter(|n| *n != STOPPING_NODE) {
        let live = race.live_of(node);
        race.gc(node, &live);
        let netconf = fleet.netconf(node, "1.1.0", json!({}));
        for container in live {
            let done = fleet.call(node, &netconf, "DEL", &container, &Sabotage::None);
            assert!(done.succeeded(), "{what}: final DEL {container}: {done:#?}");
            ledger.insert(container, (node, State::Gone));
        }
    }
    let failures = race.failures.lock().expect("failures").clone();
    assert!(failures.is_empty(), "{what}: final GC: {failures:#?}");
    let leaked: Vec<String> = fleet
        .allocations()
        .into_iter()
        .filter(|a| !is_reservation(&a.handle))
        .map(|a| format!("{} held by {}", a.ip, a.handle))
        .collect();
    assert!(leaked.is_empty(), "{what}: leaked: {leaked:#?}");
    let handles: Vec<String> = fleet
        .handles()
        .into_iter()
        .filter(|h| !is_reservation(h))
        .collect();
    assert!(handles.is_empty(), "{what}: handles left: {handles:?}");
    let check = fleet.ctl(&["check"]);
    assert_eq!(check.status, 0, "{what}: check at the end: {check:#?}");

    // The actors really raced: calls of different nodes overlapped in time, and the operator's
    // commands overlapped plugin calls.
    let calls = race.calls.lock().expect("calls").clone();
    let admin = race.admin.lock().expect("admin").clone();
    let mut node_overlaps = 0usize;
    for (i, a) in calls.iter().enumerate() {
        for b in &calls[i + 1..] {
            if a.node != b.node && a.overlaps(b) {
                node_overlaps += 1;
            }
        }
    }
    let admin_overlaps = admin
        .iter()
        .filter(|o| {
            calls
                .iter()
                .any(|c| o.started < c.ended && c.started < o.ended)
        })
        .count();
    assert!(
        node_overlaps > 0,
        "{what}: no two calls of different nodes overlapped: nothing raced"
    );
    assert!(
        admin_overlaps > 0,
        "{what}: no operator command overlapped a plugin call"
    );
    let figures = race.figures.lock().expect("figures");
    eprintln!(
        "node race on {what}: {} plugin calls on {NODES} nodes ({} ADD, {} refused as pool \
         full/unusable; {} DEL; {} CHECK; {} GC collecting {} forgotten of {}), {} operator commands (pool \
         add {}, disable {}, enable {}, delete {} + {} refused in use; node release freeing {}; \
         check --repair {}); overlapping call pairs of different nodes: {node_overlaps}; operator \
         commands overlapping a call: {admin_overlaps}; duplicates 0, leaks 0; wall time {:.1?}",
        calls.len(),
        figures.adds,
        figures.adds_refused,
        figures.dels,
        figures.checks,
        figures.gcs,
        figures.gc_released,
        figures.forgotten,
        admin.len(),
        figures.pool_adds,
        figures.pool_disables,
        figures.pool_enables,
        figures.pool_deletes,
        figures.pool_deletes_refused,
        figures.node_released,
        figures.repairs,
        started.elapsed(),
    );
}

/// ADDs into the operator's pool racing `pool delete` without `--force`, on etcd (on an embedded
/// store one blockipamctl command holds the store from start to end, so nothing can land
/// between its steps there): every node loops ADD (from that pool only), CHECK, DEL, so the pool
/// is often empty while ADDs are in flight; the operator loops `pool delete` and, after each
/// success, checks that no block of the pool is left and adds the pool again. A delete that
/// released a live address shows as a failed CHECK (code 107); one that left a block shows in
/// `show --blocks`.
#[test]
fn pool_delete_racing_adds_on_etcd_never_releases_a_live_address() {
    let started = Instant::now();
    let seed = seed_from_env(SEED_VARIABLE);
    let rounds = size_from_env(ROUNDS_VARIABLE, CI_ROUNDS);
    let fleet = Fleet::new(DatastoreType::Etcdv3, NODES, race_ipam());
    let warm_up = fleet.netconf(0, "1.1.0", json!({}));
    for command in ["ADD", "DEL"] {
        let done = fleet.call(0, &warm_up, command, "warm-up", &Sabotage::None);
        assert!(done.succeeded(), "warm-up {command}: {done:#?}");
    }
    let race = Race {
        fleet: &fleet,
        seed,
        rounds,
        ledger: Mutex::new(BTreeMap::new()),
        calls: Mutex::new(Vec::new()),
        admin: Mutex::new(Vec::new()),
        failures: Mutex::new(Vec::new()),
        nodes_running: AtomicUsize::new(NODES),
        stopped: AtomicBool::new(false),
        figures: Mutex::new(Figures::default()),
    };
    race.ctl(&[
        "pool",
        "add",
        SPARE_POOL,
        "--name",
        SPARE,
        "--block-size",
        "29",
    ])
    .success_json();
    std::thread::scope(|scope| {
        for node in 0..NODES {
            let race = &race;
            scope.spawn(move || {
                let netconf = race
                    .fleet
                    .netconf(node, "1.1.0", json!({"ipv4_pools": [SPARE]}));
                let mut rng = Rng::new(race.seed, node as u64 + 1);
                // Past `rounds`, nodes go on (up to EXTRA_ROUNDS_FACTOR times as many) until
                // the operator has deleted the pool at least once: on a loaded machine the four
                // nodes may keep it busy through every attempt of a short run.
                let mut round = 0;
                while round < race.rounds
                    || (race.figures().pool_deletes == 0
                        && round < race.rounds * EXTRA_ROUNDS_FACTOR)
                {
                    let container = format!("n{node}-{round}");
                    round += 1;
                    let added = race.run(node, &netconf, "ADD", &container);
                    race.figures().adds += 1;
                    if !added.succeeded() {
                        // The pool is being deleted, or is gone: nothing may be held.
                        if added.error_code() != Some(105) {
                            race.fail(format!("ADD {container}: {added:#?}"));
                        }
                        race.figures().adds_refused += 1;
                        race.set(&container, node, State::Gone);
                        continue;
                    }
                    race.added(&container, node, added.addresses());
                    let mut check = netconf.clone();
                    common::merge(&mut check, json!({"prevResult": added.json()}));
                    let checked = race.run(node, &check, "CHECK", &container);
                    race.figures().checks += 1;
                    if !checked.succeeded() {
                        race.fail(format!(
                            "CHECK of live {container} failed (its address was released under it): {checked:#?}"
                        ));
                    }
                    race.set(&container, node, State::Releasing);
                    let gone = race.run(node, &netconf, "DEL", &container);
                    race.figures().dels += 1;
                    if !gone.succeeded() {
                        race.fail(format!("DEL {container}: {gone:#?}"));
                    }
                    race.set(&container, node, State::Gone);
                    // A seeded idle gap, so that windows with no address held in the pool
                    // (all nodes between DEL and ADD) come up while ADDs still race.
                    std::thread::sleep(Duration::from_millis(rng.below(25) as u64));
                }
                race.nodes_running.fetch_sub(1, Ordering::SeqCst);
            });
        }
        let race = &race;
        scope.spawn(move || {
            let mut rng = Rng::new(race.seed, 0);
            while race.nodes_running.load(Ordering::SeqCst) > 0 {
                if race.delete_spare() {
                    let out = race.ctl(&[
                        "pool",
                        "add",
                        SPARE_POOL,
                        "--name",
                        SPARE,
                        "--block-size",
                        "29",
                    ]);
                    race.expect_ok("pool add", &out);
                }
                std::thread::sleep(Duration::from_millis(rng.below(10) as u64));
            }
        });
    });
    let failures = race.failures.lock().expect("failures").clone();
    assert!(
        failures.is_empty(),
        "seed {seed}: {} failures: {failures:#?}",
        failures.len()
    );
    let leaked: Vec<String> = fleet
        .allocations()
        .into_iter()
        .filter(|a| !is_reservation(&a.handle))
        .map(|a| format!("{} held by {}", a.ip, a.handle))
        .collect();
    assert!(leaked.is_empty(), "seed {seed}: leaked: {leaked:#?}");
    let check = fleet.ctl(&["check"]);
    assert_eq!(check.status, 0, "seed {seed}: check at the end: {check:#?}");
    let figures = race.figures.lock().expect("figures");
    // The race happened: the pool was deleted while ADDs kept coming, and some got in.
    assert!(
        figures.pool_deletes > 0 && figures.adds > figures.adds_refused,
        "seed {seed}: no delete or no ADD succeeded: {figures:?}"
    );
    eprintln!(
        "pool delete race on etcd (seed {seed}): {} ADD ({} refused: pool disabled or gone), {} CHECK, \
         {} DEL; pool delete {} + {} refused in use; duplicates 0, live addresses released 0, leaks 0; \
         wall time {:.1?}",
        figures.adds,
        figures.adds_refused,
        figures.checks,
        figures.dels,
        figures.pool_deletes,
        figures.pool_deletes_refused,
        started.elapsed(),
    );
}

#[test]
fn nodes_racing_on_etcd_never_share_or_leak_an_address() {
    nodes_race(DatastoreType::Etcdv3);
}

#[test]
fn nodes_racing_on_sled_never_share_or_leak_an_address() {
    nodes_race(DatastoreType::Sled);
}

#[test]
fn nodes_racing_on_redb_never_share_or_leak_an_address() {
    nodes_race(DatastoreType::Redb);
}
