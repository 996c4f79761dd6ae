//! Crash tests: the real plugin dies at named fault points and under `kill -9` during an ADD/DEL churn on several nodes, on sled, redb and etcd.
//!
//! The plugin binary under test is built with the `fault-injection` feature (blockipam's
//! dev-dependency on ipam-core turns it on for test builds only), so `BLOCKIPAM_FAULT=<point>[:<nth>]`
//! makes it abort at `holding-lock`, `before-commit`, `after-commit` or `before-reply`.
//!
//! The churn: several simulated nodes (own node name, own host lock file) run ADD/DEL calls for
//! their containers at the same time; a seeded random half of the calls is sabotaged, evenly
//! between the four fault points and a `SIGKILL` sent by the test at a random moment of the call.
//! Afterwards: no address was ever printed to two live containers, every acknowledged allocation
//! is still held, nothing is held by a container whose DEL succeeded, the store opens, `check`
//! finds only repairable problems and `check --repair` leaves none, a later ADD for every crashed
//! container succeeds, and DEL of every container leaves only the network's reservations.
//!
//! Size: `BLOCKIPAM_CRASH_CALLS` sabotaged calls per backend (default [`CI_SABOTAGED_CALLS`]); the
//! long run in `docs/reliability.md` uses 1000. `BLOCKIPAM_CRASH_SEED` replays a run's choices.

use crate::common;
use crate::fleet;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use blockipam_store::DatastoreType;
use fleet::{
    handle_of, is_reservation, seed_from_env, size_from_env, Call, Fleet, Rng, Sabotage, SIGABRT,
    SIGKILL,
};
use serde_json::{json, Value};

/// Sabotaged calls per backend.
const CALLS_VARIABLE: &str = "BLOCKIPAM_CRASH_CALLS";
/// Replays a run's choices.
const SEED_VARIABLE: &str = "BLOCKIPAM_CRASH_SEED";
/// Sabotaged calls per backend in CI.
const CI_SABOTAGED_CALLS: usize = 60;
/// Simulated nodes.
const NODES: usize = 3;
/// Containers per node.
const CONTAINERS_PER_NODE: usize = 8;
/// Share of the calls that is sabotaged, in percent.
const SABOTAGE_PERCENT: usize = 50;
/// The exit status of a plugin whose `BLOCKIPAM_FAULT` does not parse.
const INVALID_FAULT_SPEC_STATUS: i32 = 86;

/// How a call is sabotaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    HoldingLock,
    BeforeCommit,
    AfterCommit,
    BeforeReply,
    Kill,
}

impl Kind {
    const ALL: [Kind; 5] = [
        Kind::HoldingLock,
        Kind::BeforeCommit,
        Kind::AfterCommit,
        Kind::BeforeReply,
        Kind::Kill,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::HoldingLock => "holding-lock",
            Kind::BeforeCommit => "before-commit",
            Kind::AfterCommit => "after-commit",
            Kind::BeforeReply => "before-reply",
            Kind::Kill => "kill -9",
        }
    }
}

/// What the test knows a container holds.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Held {
    /// Never added, or its DEL succeeded.
    Nothing,
    /// Its ADD printed these addresses, and no DEL has started since.
    Live(Vec<String>),
    /// A call for it crashed (or a DEL is in flight): it may hold addresses or not.
    Unknown,
}

/// What the churn saw.
#[derive(Debug, Default)]
struct Tally {
    calls: usize,
    sabotaged: BTreeMap<Kind, usize>,
    /// Sabotage that really ended the process (abort at the point, or the kill landed first).
    fired: BTreeMap<Kind, usize>,
    /// Every container one of whose calls crashed.
    crashed: BTreeSet<String>,
    duplicates: Vec<String>,
    failures: Vec<String>,
}

/// The shared state of one churn.
struct Churn<'a> {
    fleet: &'a Fleet,
    seed: u64,
    budget: AtomicUsize,
    ledger: Mutex<BTreeMap<String, Held>>,
    tally: Mutex<Tally>,
}

fn containers_of(node: usize) -> Vec<String> {
    (0..CONTAINERS_PER_NODE)
        .map(|i| format!("n{node}-c{i}"))
        .collect()
}

impl Churn<'_> {
    fn held(&self, container: &str) -> Held {
        self.ledger
            .lock()
            .expect("ledger")
            .get(container)
            .cloned()
            .unwrap_or(Held::Nothing)
    }

    fn set(&self, container: &str, held: Held) {
        self.ledger
            .lock()
            .expect("ledger")
            .insert(container.to_owned(), held);
    }

    /// Records a successful ADD: its addresses must be held by no other live container, and a
    /// live container's repeated ADD must print what it already holds.
    fn added(&self, container: &str, before: &Held, addresses: Vec<String>) {
        let mut ledger = self.ledger.lock().expect("ledger");
        let mut tally = self.tally.lock().expect("tally");
        for (other, held) in ledger.iter() {
            if let Held::Live(theirs) = held {
                if other != container {
                    for address in addresses.iter().filter(|a| theirs.contains(a)) {
                        tally.duplicates.push(format!(
                            "{address} printed to {container} while {other} holds it"
                        ));
                    }
                }
            }
        }
        if let Held::Live(previous) = before {
            if *previous != addresses {
                tally.failures.push(format!(
                    "repeated ADD of {container} printed {addresses:?}, it held {previous:?}"
                ));
            }
        }
        ledger.insert(container.to_owned(), Held::Live(addresses));
    }

    /// Whether to sabotage the next call, and how: `None` once the budget is spent.
    fn sabotage_for(&self, rng: &mut Rng) -> Option<Kind> {
        if !rng.percent(SABOTAGE_PERCENT) {
            return None;
        }
        let kind = *rng.pick(&Kind::ALL);
        self.budget
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .ok()
            .map(|_| kind)
    }

    /// One node's churn: until the sabotage budget is spent.
    fn run_node(&self, node: usize) {
        let mut rng = Rng::new(self.seed, node as u64 + 1);
        let netconf = self.fleet.netconf(node, "1.0.0", json!({}));
        let containers = containers_of(node);
        // A running average of a plain call's duration, to spread kills over a call's life.
        let mut typical = Duration::from_millis(30);
        while self.budget.load(Ordering::SeqCst) > 0 {
            let container = rng.pick(&containers).clone();
            let before = self.held(&container);
            let command = match before {
                Held::Nothing => "ADD",
                Held::Live(_) if rng.percent(25) => "ADD",
                Held::Live(_) => "DEL",
                Held::Unknown if rng.percent(50) => "ADD",
                Held::Unknown => "DEL",
            };
            let kind = self.sabotage_for(&mut rng);
            let sabotage = match kind {
                None => Sabotage::None,
                Some(Kind::Kill) => {
                    let share = rng.below(121) as u32;
                    Sabotage::KillAfter(typical * share / 100)
                }
                Some(point @ (Kind::BeforeCommit | Kind::AfterCommit)) if command == "ADD" => {
                    // Mostly the first commit (the assignment, or the claim of a new block
                    // before it), sometimes the second (the assignment after a claim).
                    let nth = if rng.percent(20) { 2 } else { 1 };
                    Sabotage::Fault(format!("{}:{nth}", point.name()))
                }
                Some(point) => Sabotage::Fault(point.name().to_owned()),
            };
            if command == "DEL" {
                // From the moment the DEL starts, the addresses may be gone.
                self.set(&container, Held::Unknown);
            }
            let done = self
                .fleet
                .call(node, &netconf, command, &container, &sabotage);
            self.record(&container, &before, kind, &sabotage, &done);
            if kind.is_none() && done.succeeded() {
                let took = done.ended.duration_since(done.started);
                typical = (typical * 7 + took) / 8;
            }
        }
    }

    fn record(
        &self,
        container: &str,
        before: &Held,
        kind: Option<Kind>,
        sabotage: &Sabotage,
        done: &Call,
    ) {
        {
            let mut tally = self.tally.lock().expect("tally");
            tally.calls += 1;
            if let Some(kind) = kind {
                *tally.sabotaged.entry(kind).or_default() += 1;
            }
        }
        let crashed = match (kind, done.signal()) {
            (Some(Kind::Kill), Some(SIGKILL)) => true,
            (Some(point), Some(SIGABRT)) if point != Kind::Kill => {
                let marker = format!("fault injection: aborting at {}", point.name());
                if !done.stderr.contains(&marker) {
                    self.fail(format!(
                        "{container}: aborted without the {marker:?} line: {done:#?}"
                    ));
                }
                true
            }
            _ => false,
        };
        if crashed {
            let kind = kind.expect("only sabotaged calls crash");
            let mut tally = self.tally.lock().expect("tally");
            *tally.fired.entry(kind).or_default() += 1;
            tally.crashed.insert(container.to_owned());
            drop(tally);
            if done.command == "ADD" && !matches!(before, Held::Live(_)) {
                self.set(container, Held::Unknown);
            }
            return;
        }
        if !done.succeeded() {
            self.fail(format!(
                "node {} {} {container} ({sabotage:?}) failed: {done:#?}",
                done.node, done.command
            ));
            self.set(container, Held::Unknown);
            return;
        }
        if matches!(kind, Some(Kind::HoldingLock | Kind::BeforeReply)) {
            // Every call that succeeds passes both points: the binary is not armed.
            self.fail(format!(
                "{container}: {} never fired in a successful call: {} (a link to {}) was not \
                 built with the fault-injection feature (was it rebuilt by a `cargo build -p \
                 blockipam` before this test started?)",
                kind.map(Kind::name).unwrap_or_default(),
                self.fleet.plugin.path().display(),
                common::BIN
            ));
        }
        if done.command == "ADD" {
            self.added(container, before, done.addresses());
        } else {
            self.set(container, Held::Nothing);
        }
    }

    fn fail(&self, message: String) {
        self.tally.lock().expect("tally").failures.push(message);
    }
}

/// The netconf settings of the churn: one IPv4 pool in /28 blocks (so nodes claim and borrow
/// blocks), with a gateway (so the network's reservations exist too).
fn churn_ipam() -> Value {
    json!({
        "pools": [{"cidr": "10.244.7.0/24", "block_size": 28, "name": "crash-v4"}],
        "gateway": ["10.244.7.1"],
    })
}

fn crash_churn(store_type: DatastoreType) {
    let started = Instant::now();
    let seed = seed_from_env(SEED_VARIABLE);
    let sabotage_budget = size_from_env(CALLS_VARIABLE, CI_SABOTAGED_CALLS);
    let fleet = Fleet::new(store_type, NODES, churn_ipam());
    let what = format!("{} (seed {seed})", store_type.as_str());

    // The first call of a node creates the store and the pool: not part of the churn.
    let first = fleet.call(
        0,
        &fleet.netconf(0, "1.0.0", json!({})),
        "ADD",
        "warm-up",
        &Sabotage::None,
    );
    assert!(first.succeeded(), "{what}: warm-up ADD: {first:#?}");
    let del = fleet.call(
        0,
        &fleet.netconf(0, "1.0.0", json!({})),
        "DEL",
        "warm-up",
        &Sabotage::None,
    );
    assert!(del.succeeded(), "{what}: warm-up DEL: {del:#?}");

    let churn = Churn {
        fleet: &fleet,
        seed,
        budget: AtomicUsize::new(sabotage_budget),
        ledger: Mutex::new(BTreeMap::new()),
        tally: Mutex::new(Tally::default()),
    };
    std::thread::scope(|scope| {
        for node in 0..NODES {
            let churn = &churn;
            scope.spawn(move || churn.run_node(node));
        }
    });
    let tally = churn.tally.into_inner().expect("tally");
    let mut ledger = churn.ledger.into_inner().expect("ledger");
    assert!(
        tally.failures.is_empty(),
        "{what}: calls failed during the churn: {:#?}",
        tally.failures
    );
    assert!(
        tally.duplicates.is_empty(),
        "{what}: addresses printed to two live containers: {:#?}",
        tally.duplicates
    );

    // The store opens, and holds each address once.
    let allocations = fleet.allocations();
    let mut seen = BTreeSet::new();
    for allocation in &allocations {
        assert!(
            seen.insert(allocation.ip),
            "{what}: {} is allocated twice in the store: {allocations:#?}",
            allocation.ip
        );
    }
    // Every acknowledged allocation is still held by its container; nothing is held by a
    // container whose DEL succeeded.
    let holder: BTreeMap<String, String> = allocations
        .iter()
        .map(|a| (a.ip.to_string(), a.handle.clone()))
        .collect();
    for (container, held) in &ledger {
        if let Held::Live(addresses) = held {
            for address in addresses {
                assert_eq!(
                    holder.get(address),
                    Some(&handle_of(container)),
                    "{what}: {container}'s acknowledged address {address} is not held by it"
                );
            }
        }
    }
    for allocation in allocations.iter().filter(|a| !is_reservation(&a.handle)) {
        let container = allocation
            .handle
            .strip_prefix(&handle_of(""))
            .unwrap_or_else(|| panic!("{what}: unexpected handle {}", allocation.handle));
        let held = ledger.get(container).cloned().unwrap_or(Held::Nothing);
        assert_ne!(
            held,
            Held::Nothing,
            "{what}: {} is held by {container}, which holds nothing (leak)",
            allocation.ip
        );
    }

    // `check` finds only what `check --repair` clears, and the repair leaves nothing.
    let check = fleet.ctl(&["check"]).json();
    let problems = check["problems"].as_array().cloned().unwrap_or_default();
    let unrepairable: Vec<&Value> = problems
        .iter()
        .filter(|p| p["repairable"] != json!(true))
        .collect();
    assert!(
        unrepairable.is_empty(),
        "{what}: check found problems no repair clears: {check:#}"
    );
    let repair = fleet.ctl(&["check", "--repair"]);
    assert_eq!(
        repair.status, 0,
        "{what}: problems remain after check --repair: {repair:#?}"
    );

    // A later ADD for every container that crashed succeeds, with addresses no one else holds
    // (and, for a container that is live, exactly the addresses it holds).
    for container in &tally.crashed {
        let node: usize = container[1..container.find('-').expect("n<node>-c<i>")]
            .parse()
            .expect("node index");
        let again = fleet.call(
            node,
            &fleet.netconf(node, "1.0.0", json!({})),
            "ADD",
            container,
            &Sabotage::None,
        );
        assert!(
            again.succeeded(),
            "{what}: ADD after the crash of {container}: {again:#?}"
        );
        let addresses = again.addresses();
        for (other, held) in &ledger {
            if let Held::Live(theirs) = held {
                if other == container {
                    assert_eq!(
                        &addresses, theirs,
                        "{what}: ADD of live {container} after a crash printed other addresses"
                    );
                } else {
                    assert!(
                        addresses.iter().all(|a| !theirs.contains(a)),
                        "{what}: ADD of {container} after its crash printed {addresses:?}, and {other} holds {theirs:?}"
                    );
                }
            }
        }
        ledger.insert(container.clone(), Held::Live(addresses));
    }

    // DEL of every container leaves only the network's reservations.
    for node in 0..NODES {
        let netconf = fleet.netconf(node, "1.0.0", json!({}));
        for container in containers_of(node) {
            let gone = fleet.call(node, &netconf, "DEL", &container, &Sabotage::None);
            assert!(
                gone.succeeded(),
                "{what}: final DEL of {container}: {gone:#?}"
            );
        }
    }
    let leaked: Vec<String> = fleet
        .allocations()
        .into_iter()
        .filter(|a| !is_reservation(&a.handle))
        .map(|a| format!("{} held by {}", a.ip, a.handle))
        .collect();
    assert!(
        leaked.is_empty(),
        "{what}: leaked after DEL of everything: {leaked:#?}"
    );
    let handles: Vec<String> = fleet
        .handles()
        .into_iter()
        .filter(|h| !is_reservation(h))
        .collect();
    assert!(
        handles.is_empty(),
        "{what}: handles left behind: {handles:?}"
    );
    let last = fleet.ctl(&["check"]);
    assert_eq!(
        last.status, 0,
        "{what}: check after the clean-up: {last:#?}"
    );

    let by_kind = |counts: &BTreeMap<Kind, usize>| {
        Kind::ALL
            .iter()
            .map(|k| format!("{} {}", k.name(), counts.get(k).copied().unwrap_or(0)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    eprintln!(
        "crash churn on {what}: {} calls on {NODES} nodes, {} sabotaged ({}); crashed the process: {} ({}); \
         problems before repair: {} (all repairable); crashed containers added again: {}; \
         duplicates: 0; leaks after DEL of everything: 0; wall time {:.1?}",
        tally.calls,
        tally.sabotaged.values().sum::<usize>(),
        by_kind(&tally.sabotaged),
        tally.fired.values().sum::<usize>(),
        by_kind(&tally.fired),
        problems.len(),
        tally.crashed.len(),
        started.elapsed(),
    );
}

#[test]
fn crash_churn_on_sled_holds_nothing_twice_loses_nothing_and_leaks_nothing() {
    crash_churn(DatastoreType::Sled);
}

#[test]
fn crash_churn_on_redb_holds_nothing_twice_loses_nothing_and_leaks_nothing() {
    crash_churn(DatastoreType::Redb);
}

#[test]
fn crash_churn_on_etcd_holds_nothing_twice_loses_nothing_and_leaks_nothing() {
    crash_churn(DatastoreType::Etcdv3);
}

/// Proves the binary under test really is built with the crash points: each one aborts an ADD
/// on a fresh store, the store then opens, and a plain retry succeeds.
#[test]
fn every_fault_point_aborts_the_real_plugin_and_a_retry_succeeds() {
    let fleet = Fleet::new(DatastoreType::Sled, 1, churn_ipam());
    let netconf = fleet.netconf(0, "1.0.0", json!({}));
    for point in [
        Kind::HoldingLock,
        Kind::BeforeCommit,
        Kind::AfterCommit,
        Kind::BeforeReply,
    ] {
        let container = format!("c-{}", point.name());
        let crashed = fleet.call(
            0,
            &netconf,
            "ADD",
            &container,
            &Sabotage::Fault(point.name().to_owned()),
        );
        assert_eq!(
            crashed.signal(),
            Some(SIGABRT),
            "{} did not abort the plugin (is it built with the fault-injection feature?): {crashed:#?}",
            point.name()
        );
        assert!(
            crashed
                .stderr
                .contains(&format!("fault injection: aborting at {}", point.name())),
            "{crashed:#?}"
        );
        assert_eq!(crashed.stdout, "", "a crashed plugin printed a result");
        let retry = fleet.call(0, &netconf, "ADD", &container, &Sabotage::None);
        assert!(
            retry.succeeded(),
            "retry after {}: {retry:#?}",
            point.name()
        );
    }
    let held: BTreeSet<String> = fleet
        .allocations()
        .into_iter()
        .filter(|a| !is_reservation(&a.handle))
        .map(|a| a.handle)
        .collect();
    assert_eq!(held.len(), 4, "one allocation per container: {held:?}");
    // A misspelled point is a test bug: the plugin says so and fails, it does not crash.
    let misspelled = fleet.call(
        0,
        &netconf,
        "ADD",
        "c-typo",
        &Sabotage::Fault("before-comit".to_owned()),
    );
    assert_eq!(
        misspelled.status.code(),
        Some(INVALID_FAULT_SPEC_STATUS),
        "{misspelled:#?}"
    );
    assert!(
        misspelled.stderr.contains("unknown fault point"),
        "{misspelled:#?}"
    );
}
