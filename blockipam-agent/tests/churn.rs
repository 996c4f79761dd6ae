//! The churn test: simulated nodes (own node names, lock files and agents) on a 3-member etcd,
//! pods that come and go and pods that stay, while agents are stopped, killed, restarted and left
//! down, etcd members are killed and restarted, the agents' reclaimer runs with short settings,
//! and `check --repair`, `gc --dead-nodes --apply` and the runtime's CNI GC run meanwhile.
//!
//! The test keeps its own ground truth: which containers run on which node and the address each
//! ADD answered. At the end no address of a running container was released or handed to another
//! container, nothing is left allocated that no container holds, and `check` is clean.
//!
//! A node whose agent is down and whose runtime stalls (a plugin call retried while an etcd member
//! is down, a busy machine) may rightly be reclaimed: its blocks lose their host, its addresses are
//! kept. What must never happen is a reclaim against evidence: the test records when each of its
//! runtimes' committing calls was tried and answered, and fails on any reclaim (by an agent's
//! reclaimer or by `gc --dead-nodes --apply`) whose node committed after the reclaim's mark and
//! before its last write.
//! `BLOCKIPAM_CHURN_SECONDS` sets how long the chaos lasts (default 40; the long run in
//! docs/reliability.md uses more).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::etcd_agents::{connect, ctl, netconf_with_pool, wait_until, Agent, WAIT_LIMIT};
use common::run_plugin;
use ipam_core::{Ipam, KvStore};
use serde_json::{json, Value};
use test_kit::etcd::{unique_prefix, EtcdCluster};

const NODES: [&str; 3] = ["churn-0", "churn-1", "churn-2"];
/// Agent settings: a 2 s liveness TTL (`Agent`), a short grace, the reclaimer every second.
const GRACE: Duration = Duration::from_secs(4);
/// An agent logs a reclaim right after its last write: within this, the test assumes.
const LOG_DELAY: Duration = Duration::from_secs(1);
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

/// A node's plugin call that committed (an ADD, or the DEL of an address the node held): its
/// commit lies between when the runtime first tried it and when the successful answer came.
#[derive(Clone, Debug)]
struct Commit {
    node: &'static str,
    call: String,
    tried: SystemTime,
    answered: SystemTime,
}

type Commits = Arc<Mutex<Vec<Commit>>>;

/// A completed reclaim of a node's blocks: its last write came no earlier than
/// `last_write_after`, and every write no later than `written_by`.
#[derive(Debug)]
struct Reclaim {
    node: String,
    by: String,
    last_write_after: SystemTime,
    written_by: SystemTime,
}

/// The commit of the reclaimed node's runtime that proves `reclaim` wrong, if any.
///
/// A reclaimer reads the node's activity record, puts the countdown (on a lease of the grace,
/// renewed right after the put) and marks the registration with that read; it reclaims once the
/// countdown is gone, and each write of the reclaim is guarded by "activity record unmoved since
/// the mark". A plugin commit after the countdown's put moves the record (before the mark, it
/// fails the mark). So the countdown was put no later than `written_by - GRACE`, and a commit
/// tried after that and answered before the last write moved the record in between: the reclaim
/// had to stop.
fn contradicting_commit<'a>(reclaim: &Reclaim, commits: &'a [Commit]) -> Option<&'a Commit> {
    let after_countdown = reclaim.written_by - GRACE;
    commits.iter().find(|commit| {
        commit.node == reclaim.node
            && commit.tried >= after_countdown
            && commit.answered <= reclaim.last_write_after
    })
}

/// How long before `later` `earlier` came (zero if it did not).
fn before(later: SystemTime, earlier: SystemTime) -> Duration {
    later.duration_since(earlier).unwrap_or_default()
}

/// The time of a log line's RFC 3339 UTC timestamp (`2026-11-26T14:31:47.123456Z`, as the agent's
/// log writes it): the whole seconds as the store's timestamps are read, and the fraction.
fn parse_utc(text: &str) -> Option<SystemTime> {
    let seconds = ipam_core::model::timestamp::parse_rfc3339_utc(text)?;
    let fraction = text
        .strip_suffix('Z')?
        .split_once('.')
        .map_or("0", |(_, f)| f);
    let nanos: u32 = format!("{fraction:0<9}").get(..9)?.parse().ok()?;
    Some(UNIX_EPOCH + Duration::new(seconds, nanos))
}

/// The reclaims an agent's log reports (`dead node reclaimed`, logged after the last write).
fn logged_reclaims(agent: &str, log: &str) -> Vec<Reclaim> {
    log.lines()
        .filter(|line| line.contains("dead node reclaimed"))
        .map(|line| {
            let logged = line
                .split_whitespace()
                .next()
                .and_then(parse_utc)
                .unwrap_or_else(|| panic!("no UTC timestamp opens agent {agent}'s line: {line}"));
            let node = line
                .split("node=\"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap_or_else(|| panic!("no node in agent {agent}'s line: {line}"));
            Reclaim {
                node: node.to_owned(),
                by: format!("agent {agent}: {line}"),
                last_write_after: logged - LOG_DELAY,
                written_by: logged,
            }
        })
        .collect()
}

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
fn node_runtime(
    node: &'static str,
    conf: Value,
    truth: Truth,
    commits: Commits,
    stop: Arc<AtomicBool>,
    seed: u64,
) {
    let mut dice = Dice(seed);
    let mut running: Vec<String> = Vec::new();
    let mut next = 0usize;
    let mut round = 0u64;
    while !stop.load(Ordering::SeqCst) {
        round += 1;
        let add = running.len() < STAYERS || (running.len() < MAX_PODS && dice.roll(2) == 0);
        let committed = |call: String, tried: SystemTime| {
            commits.lock().expect("commits").push(Commit {
                node,
                call,
                tried,
                answered: SystemTime::now(),
            });
        };
        if add {
            let container = format!("{node}-pod{next}");
            next += 1;
            let tried = SystemTime::now();
            let address =
                runtime_call("ADD", &container, &conf).expect("an ADD answers an address");
            committed(format!("ADD {container}"), tried);
            truth
                .lock()
                .expect("truth")
                .insert((node.to_owned(), container.clone()), address);
            running.push(container);
        } else if running.len() > STAYERS {
            let index = STAYERS + dice.roll((running.len() - STAYERS) as u64) as usize;
            let container = running.remove(index);
            let tried = SystemTime::now();
            runtime_call("DEL", &container, &conf);
            committed(format!("DEL {container}"), tried);
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
    let grace_seconds = GRACE.as_secs().to_string();
    let start_agent = |node: &'static str| {
        Agent::start_with_grace(
            node,
            &socket(node),
            &endpoints,
            &prefix,
            &grace_seconds,
            &[],
        )
    };
    // The logs of agents stopped during the chaos: one of them may have led the reclaimer.
    let mut stopped_logs: Vec<(&'static str, Arc<Mutex<String>>)> = Vec::new();
    let mut reclaims: Vec<Reclaim> = Vec::new();
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
    let commits: Commits = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = NODES
        .iter()
        .zip(confs.iter().cloned())
        .enumerate()
        .map(|(i, (node, conf))| {
            let (truth, commits, stop) =
                (Arc::clone(&truth), Arc::clone(&commits), Arc::clone(&stop));
            std::thread::spawn(move || {
                node_runtime(node, conf, truth, commits, stop, 0x9e37_79b9 + i as u64)
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
                    let mut agent = agents[i].take().expect("an agent that is up");
                    let signal = if dice.roll(2) == 0 { "TERM" } else { "KILL" };
                    agent.signal(signal);
                    if signal == "TERM" {
                        // A stop: the agent answers what it read, revokes its lease, removes its
                        // socket and exits 0 (bounded by its shutdown grace).
                        let deadline = Instant::now() + WAIT_LIMIT;
                        let status = loop {
                            if let Some(status) = agent.child.try_wait().expect("poll the agent") {
                                break status;
                            }
                            assert!(
                                Instant::now() < deadline,
                                "{} did not stop after SIGTERM:\n{}",
                                agent.node,
                                agent.log()
                            );
                            std::thread::sleep(Duration::from_millis(20));
                        };
                        assert!(
                            status.success(),
                            "{} exited {status} after SIGTERM:\n{}",
                            agent.node,
                            agent.log()
                        );
                    }
                    stopped_logs.push((agent.node, agent.log_source()));
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
                // Every snapshot of the store is consistent: it finds and repairs nothing.
                let (status, output) =
                    ctl(&endpoints, &prefix, &["-o", "json", "check", "--repair"]);
                let report: Value = serde_json::from_str(&output)
                    .unwrap_or_else(|e| panic!("check --repair during the churn: {e}:\n{output}"));
                let found = |field: &str| report[field].as_array().map_or(0, Vec::len);
                assert!(
                    status == 0 && found("problems") == 0 && found("repaired") == 0,
                    "check --repair during the churn found or repaired something:\n{output}"
                );
                *events.entry("check --repair").or_default() += 1;
            }
            _ => {
                let started = SystemTime::now();
                let (status, output) = ctl(
                    &endpoints,
                    &prefix,
                    &[
                        "gc",
                        "--dead-nodes",
                        "--apply",
                        "--grace-seconds",
                        &grace_seconds,
                        "-o",
                        "json",
                    ],
                );
                let finished = SystemTime::now();
                // An etcd member down may fail one node's write: status 1 names it; never more.
                assert!(
                    status == 0 || status == 1,
                    "gc --dead-nodes --apply during the churn:\n{output}"
                );
                let report = serde_json::Deserializer::from_str(&output)
                    .into_iter::<Value>()
                    .next()
                    .and_then(Result::ok);
                match report {
                    Some(report) => {
                        let nodes = report["nodes"].as_array().cloned().unwrap_or_default();
                        for node in nodes.iter().filter(|n| n["action"] == "reclaimed") {
                            reclaims.push(Reclaim {
                                node: node["node"].as_str().unwrap_or_default().to_owned(),
                                by: format!("gc --dead-nodes --apply: {node}"),
                                last_write_after: started,
                                written_by: finished,
                            });
                        }
                        *events.entry("gc --dead-nodes --apply").or_default() += 1;
                    }
                    // Failed before its report (the store unreachable): it wrote nothing.
                    None => {
                        assert_eq!(status, 1, "gc -o json printed no report:\n{output}");
                        *events.entry("gc --dead-nodes --apply failed").or_default() += 1;
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1500 + dice.roll(1500)));
    }
    // Everything comes back while the runtimes still work, so that no node falls idle with its
    // agent down; then the runtimes stop.
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
    wait_until(&runtime, "every agent is live again", || async {
        let mut live = 0;
        for node in NODES {
            if common::etcd_agents::is_live(&store, node).await {
                live += 1;
            }
        }
        live == NODES.len()
    });
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.join().expect("a node's runtime");
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
    for (node, log) in &stopped_logs {
        reclaims.extend(logged_reclaims(node, &log.lock().expect("log")));
    }
    for agent in agents.iter().flatten() {
        reclaims.extend(logged_reclaims(agent.node, &agent.log()));
    }
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
    let commits = commits.lock().expect("commits").clone();
    for reclaim in &reclaims {
        if let Some(commit) = contradicting_commit(reclaim, &commits) {
            panic!(
                "{} was reclaimed although its runtime committed after the countdown started and \
                 before the last write: {} was tried {:?} and answered {:?} before the reclaim's writes \
                 were over (grace {GRACE:?}), by {}",
                reclaim.node,
                commit.call,
                before(reclaim.written_by, commit.tried),
                before(reclaim.written_by, commit.answered),
                reclaim.by
            );
        }
        eprintln!(
            "churn: {} reclaimed while idle (no commit of its runtime between the countdown and the \
             reclaim), by {}",
            reclaim.node, reclaim.by
        );
    }
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
    eprintln!(
        "churn figures: {} s of chaos, {events:?}, {} containers running at the end, {} \
         committing calls, {} reclaims of an idle node (none against a commit), 0 addresses of \
         running containers released, 0 held twice, 0 leaked, check clean",
        churn_seconds(),
        truth.len(),
        commits.len(),
        reclaims.len()
    );
    drop(agents);
    drop(cluster);
}

#[test]
fn log_timestamps_are_read_as_utc() {
    assert_eq!(parse_utc("1970-01-01T00:00:00Z"), Some(UNIX_EPOCH));
    assert_eq!(
        parse_utc("1970-01-02T00:00:01.5Z"),
        Some(UNIX_EPOCH + Duration::from_millis(86_401_500))
    );
    // A leap day, and the day after a leap century's February.
    assert_eq!(
        parse_utc("2024-02-29T12:00:00.000001Z"),
        Some(UNIX_EPOCH + Duration::new(1_709_208_000, 1_000))
    );
    assert_eq!(
        parse_utc("2000-03-01T00:00:00Z"),
        Some(UNIX_EPOCH + Duration::from_secs(951_868_800))
    );
    assert_eq!(parse_utc("2026-11-26 14:31:47Z"), None);
    assert_eq!(parse_utc("2026-11-26T14:31:47"), None);
}

#[test]
fn a_reclaim_is_contradicted_only_by_a_commit_between_its_countdown_and_last_write() {
    let at =
        |seconds: u64| UNIX_EPOCH + Duration::from_secs(1_000) + Duration::from_millis(seconds);
    let reclaim = Reclaim {
        node: "churn-1".into(),
        by: "test".into(),
        last_write_after: at(10_000),
        written_by: at(10_500),
    };
    let commit = |node: &'static str, tried: u64, answered: u64| Commit {
        node,
        call: "ADD".into(),
        tried: at(tried),
        answered: at(answered),
    };
    // Countdown put no later than 10.5 - 4 = 6.5 s.
    let inside = [commit("churn-1", 6_500, 9_000)];
    assert!(contradicting_commit(&reclaim, &inside).is_some());
    for alibi in [
        commit("churn-0", 8_000, 8_100),
        commit("churn-1", 6_499, 8_000),
        commit("churn-1", 8_000, 10_001),
    ] {
        assert!(
            contradicting_commit(&reclaim, std::slice::from_ref(&alibi)).is_none(),
            "{alibi:?}"
        );
    }
}
