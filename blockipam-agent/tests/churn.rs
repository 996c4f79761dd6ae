//! The churn test: simulated nodes (own node names, lock files and agents) on a 3-member etcd,
//! pods that come and go and pods that stay, while agents are stopped, killed, restarted and left
//! down, etcd members are killed and restarted, the agents' reclaimer runs with short settings,
//! and `check --repair`, `gc --dead-nodes --apply` and the runtime's CNI GC run meanwhile.
//!
//! The test keeps its own ground truth: which containers run on which node and the address each
//! ADD answered. At the end no address of a running container was released or handed to another
//! container, nothing is left allocated that no container holds, and `check` is clean.
//! `BLOCKIPAM_CHURN_SECONDS` sets how long the chaos lasts (default 40; the long run in
//! docs/reliability.md uses more).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::etcd_agents::{connect, ctl, netconf_with_pool, wait_until, Agent};
use common::run_plugin;
use ipam_core::{Ipam, KvStore};
use serde_json::{json, Value};
use test_kit::etcd::{unique_prefix, EtcdCluster};

const NODES: [&str; 3] = ["churn-0", "churn-1", "churn-2"];
/// Agent settings: a 2 s liveness TTL (`Agent`), a short grace, the reclaimer every second.
const GRACE_SECONDS: &str = "4";
/// Pods each node keeps for the whole test (never deleted).
const STAYERS: usize = 2;
/// Most pods a node runs at once.
const MAX_PODS: usize = 7;
/// How long one runtime call may be retried (code 11) before the test fails.
const CALL_PATIENCE: Duration = Duration::from_secs(90);
/// A plugin process is killed (and the test fails) past this.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn churn_seconds() -> u64 {
    std::env::var("BLOCKIPAM_CHURN_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40)
}

/// A small deterministic generator (the test needs variety, not cryptographic randomness).
struct Dice(u64);

impl Dice {
    fn roll(&mut self, sides: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % sides.max(1)
    }
}

/// What the runtimes believe: (node, container) → the address its ADD answered.
type Truth = Arc<Mutex<BTreeMap<(String, String), String>>>;

/// Calls the plugin as a runtime does: retried while it answers "try again later" (11), any
/// other failure fails the test. Returns the ADD's address (`None` for other commands).
fn runtime_call(command: &str, container: &str, conf: &Value) -> Option<String> {
    let deadline = Instant::now() + CALL_PATIENCE;
    loop {
        let run = run_plugin(command, container, conf, HANG_GUARD);
        if run.status == 0 {
            if command != "ADD" {
                return None;
            }
            let result: Value = serde_json::from_str(&run.stdout).expect("ADD result JSON");
            let address = result["ips"][0]["address"]
                .as_str()
                .and_then(|a| a.split('/').next())
                .expect("an address")
                .to_owned();
            return Some(address);
        }
        let answer: Value = serde_json::from_str(&run.stdout).unwrap_or(Value::Null);
        assert_eq!(
            answer["code"], 11,
            "{command} {container} failed with something else than 11: {}\n{}",
            run.stdout, run.stderr
        );
        assert!(
            Instant::now() < deadline,
            "{command} {container} still answered 11 after {CALL_PATIENCE:?}: {}",
            run.stdout
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// One node's runtime: ADDs, DELs of pods that are not stayers, and now and then a CNI GC with
/// exactly the pods it runs, until `stop`.
fn node_runtime(node: &'static str, conf: Value, truth: Truth, stop: Arc<AtomicBool>, seed: u64) {
    let mut dice = Dice(seed);
    let mut running: Vec<String> = Vec::new();
    let mut next = 0usize;
    let mut round = 0u64;
    while !stop.load(Ordering::SeqCst) {
        round += 1;
        let add = running.len() < STAYERS || (running.len() < MAX_PODS && dice.roll(2) == 0);
        if add {
            let container = format!("{node}-pod{next}");
            next += 1;
            let address =
                runtime_call("ADD", &container, &conf).expect("an ADD answers an address");
            truth
                .lock()
                .expect("truth")
                .insert((node.to_owned(), container.clone()), address);
            running.push(container);
        } else if running.len() > STAYERS {
            let index = STAYERS + dice.roll((running.len() - STAYERS) as u64) as usize;
            let container = running.remove(index);
            runtime_call("DEL", &container, &conf);
            truth
                .lock()
                .expect("truth")
                .remove(&(node.to_owned(), container));
        }
        if round.is_multiple_of(8) {
            let mut gc = conf.clone();
            gc["cniVersion"] = json!("1.1.0");
            gc["cni.dev/valid-attachments"] = running
                .iter()
                .map(|c| json!({"containerID": c, "ifname": "eth0"}))
                .collect();
            runtime_call("GC", "", &gc);
        }
        std::thread::sleep(Duration::from_millis(100 + dice.roll(200)));
    }
}

#[test]
fn churn_with_agents_and_etcd_members_failing_never_releases_or_duplicates_a_running_pods_address()
{
    let mut cluster = EtcdCluster::start(3).expect("a 3-member etcd cluster (package etcd-server)");
    let endpoints = cluster.endpoints().join(",");
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    let (runtime, store) = connect(&cluster, &prefix);
    let socket = |node: &str| dir.path().join(format!("{node}.sock"));
    // A pool of four /28 blocks for three nodes of up to seven pods: nodes borrow.
    let conf = |node: &str| {
        netconf_with_pool(
            node,
            &socket(node).display().to_string(),
            &endpoints,
            &prefix,
            &dir.path().join(format!("{node}.lock")),
            "10.91.0.0/26",
        )
    };
    let start_agent = |node: &'static str| {
        Agent::start_with_grace(node, &socket(node), &endpoints, &prefix, GRACE_SECONDS, &[])
    };
    let mut agents: Vec<Option<Agent>> = NODES.iter().map(|n| Some(start_agent(n))).collect();
    let confs: Vec<Value> = NODES
        .iter()
        .map(|n| {
            let mut c = conf(n);
            c["ipam"]["pools"][0]["block_size"] = json!(28);
            c
        })
        .collect();
    // The pool, with its small blocks, exists before any runtime starts.
    runtime_call("ADD", "setup-probe", &confs[0]);
    runtime_call("DEL", "setup-probe", &confs[0]);

    let truth: Truth = Arc::new(Mutex::new(BTreeMap::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = NODES
        .iter()
        .zip(confs.iter().cloned())
        .enumerate()
        .map(|(i, (node, conf))| {
            let (truth, stop) = (Arc::clone(&truth), Arc::clone(&stop));
            std::thread::spawn(move || {
                node_runtime(node, conf, truth, stop, 0x9e37_79b9 + i as u64)
            })
        })
        .collect();

    // The chaos, from this thread.
    let mut dice = Dice(0x2545_f491_4f6c_dd1d);
    let mut down_until: Vec<Option<Instant>> = vec![None; NODES.len()];
    let mut member_down: Option<(usize, Instant)> = None;
    let mut events: BTreeMap<&'static str, usize> = BTreeMap::new();
    let chaos_end = Instant::now() + Duration::from_secs(churn_seconds());
    while Instant::now() < chaos_end {
        // Agents whose time down is over come back.
        for (i, until) in down_until.iter_mut().enumerate() {
            if until.is_some_and(|t| Instant::now() >= t) {
                agents[i] = Some(start_agent(NODES[i]));
                *until = None;
                *events.entry("agent restarted").or_default() += 1;
            }
        }
        if let Some((member, at)) = member_down {
            if Instant::now() >= at {
                cluster
                    .member_mut(member)
                    .restart()
                    .expect("restart an etcd member");
                member_down = None;
                *events.entry("etcd member restarted").or_default() += 1;
            }
        }
        match dice.roll(5) {
            0 | 1 => {
                // Stop or kill an agent, and leave it down for 0 to 9 s (at most two down).
                let up: Vec<usize> = (0..NODES.len()).filter(|&i| agents[i].is_some()).collect();
                if up.len() > 1 {
                    let i = up[dice.roll(up.len() as u64) as usize];
                    let agent = agents[i].take().expect("an agent that is up");
                    let signal = if dice.roll(2) == 0 { "TERM" } else { "KILL" };
                    agent.signal(signal);
                    drop(agent);
                    down_until[i] = Some(Instant::now() + Duration::from_secs(dice.roll(10)));
                    *events
                        .entry(if signal == "TERM" {
                            "agent stopped"
                        } else {
                            "agent killed"
                        })
                        .or_default() += 1;
                }
            }
            2 => {
                if member_down.is_none() {
                    let member = dice.roll(3) as usize;
                    cluster.member_mut(member).stop();
                    member_down = Some((member, Instant::now() + Duration::from_secs(3)));
                    *events.entry("etcd member killed").or_default() += 1;
                }
            }
            3 => {
                let (status, output) = ctl(&endpoints, &prefix, &["check", "--repair"]);
                assert_eq!(status, 0, "check --repair during the churn:\n{output}");
                *events.entry("check --repair").or_default() += 1;
            }
            _ => {
                let (status, output) = ctl(
                    &endpoints,
                    &prefix,
                    &[
                        "gc",
                        "--dead-nodes",
                        "--apply",
                        "--grace-seconds",
                        GRACE_SECONDS,
                    ],
                );
                // An etcd member down may fail one node's write: status 1 names it; never more.
                assert!(
                    status == 0 || status == 1,
                    "gc --dead-nodes --apply during the churn:\n{output}"
                );
                assert!(
                    !output.contains("reclaimed"),
                    "a reclaim by hand released a node whose runtime is at work:\n{output}"
                );
                *events.entry("gc --dead-nodes --apply").or_default() += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(1500 + dice.roll(1500)));
    }
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.join().expect("a node's runtime");
    }
    if let Some((member, _)) = member_down {
        cluster
            .member_mut(member)
            .restart()
            .expect("restart an etcd member");
    }
    for (i, agent) in agents.iter_mut().enumerate() {
        if agent.is_none() {
            *agent = Some(start_agent(NODES[i]));
        }
    }

    // The runtimes' truth against the store.
    let truth = truth.lock().expect("truth").clone();
    let mut addresses = BTreeSet::new();
    for ((node, container), address) in &truth {
        assert!(
            addresses.insert(address.clone()),
            "{address} was answered to two running containers (one is {node}/{container})"
        );
    }
    let allocations = runtime.block_on(async {
        Ipam::new(Arc::clone(&store) as Arc<dyn KvStore>)
            .list_allocations()
            .await
            .expect("list allocations")
    });
    let by_address: BTreeMap<String, (String, String)> = allocations
        .iter()
        .map(|a| {
            (
                a.ip.to_string(),
                (
                    a.handle.clone(),
                    a.attributes.get("node").cloned().unwrap_or_default(),
                ),
            )
        })
        .collect();
    let reclaims: Vec<String> = agents
        .iter()
        .flatten()
        .flat_map(|a| {
            a.log()
                .lines()
                .filter(|l| l.contains("dead node reclaimed"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    for ((node, container), address) in &truth {
        let expected = (format!("deadnet.{container}"), node.clone());
        assert_eq!(
            by_address.get(address),
            Some(&expected),
            "running container {node}/{container} lost {address} (reclaims: {reclaims:?})"
        );
    }
    let held: BTreeSet<&String> = truth.values().collect();
    let leaked: Vec<&String> = by_address.keys().filter(|a| !held.contains(a)).collect();
    assert!(leaked.is_empty(), "allocated with no container: {leaked:?}");
    assert!(reclaims.is_empty(), "a node was reclaimed: {reclaims:?}");
    let (status, output) = ctl(&endpoints, &prefix, &["check"]);
    assert_eq!(status, 0, "check after the churn:\n{output}");
    for (what, minimum) in [
        ("agent stopped", 1),
        ("agent killed", 1),
        ("etcd member killed", 1),
        ("check --repair", 1),
    ] {
        assert!(
            events.get(what).copied().unwrap_or(0) >= minimum,
            "the chaos never did {what:?}: {events:?} (run longer: BLOCKIPAM_CHURN_SECONDS)"
        );
    }
    wait_until(&runtime, "every agent is live again", || async {
        let mut live = 0;
        for node in NODES {
            if common::etcd_agents::is_live(&store, node).await {
                live += 1;
            }
        }
        live == NODES.len()
    });
    eprintln!(
        "churn figures: {} s of chaos, {events:?}, {} containers running at the end, 0 addresses \
         of running containers released, 0 held twice, 0 leaked, check clean",
        churn_seconds(),
        truth.len()
    );
    drop(agents);
    drop(cluster);
}
