//! etcd failures under the real plugin: members killed during a churn, quorum lost, lost replies.
//!
//! A 3-member loopback etcd cluster serves several simulated nodes (each its own `nodename` and
//! host lock, so their calls really race in the store) while a follower, then the leader, is
//! killed and restarted; then two members are killed at once. A write whose reply is lost (a TCP
//! proxy that forwards the transaction and drops the answer) and a store wrapper that reports
//! `KvError::Indeterminate` at every commit of an ADD/DEL sequence prove that a write whose
//! outcome is unknown ends with no duplicate and no leak once the runtime retries.

use crate::common;

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use backend_etcd::{EtcdConfig, EtcdStore};
use blockipam::args::CniArgs;
use blockipam::commands::{self, Attachment};
use blockipam::netconf::{parse_netconf, NetConf};
use common::*;
use ipam_core::{Ipam, KeyValue, KvError, KvStore, MemoryStore, Revision, Txn};
use serde_json::{json, Value};
use test_kit::etcd::{unique_prefix, EtcdCluster, EtcdServer};

/// A plugin process still running after this long is hung: it is killed and the test fails.
/// This is only the safety net; what the tests assert is each call's code and message.
const HANG_GUARD: Duration = Duration::from_secs(90);
/// The churn must make progress within this long, whatever is down (safety net, as above).
const STALL_GUARD: Duration = Duration::from_secs(120);
/// Simulated nodes in the churn.
const NODES: usize = 3;
/// Containers each node keeps alive; an older one is deleted for every new one beyond this.
const LIVE_PER_NODE: usize = 4;
/// Attempts of one call in the churn (the first plus retries after code 11).
const ATTEMPTS: usize = 30;
/// Pause before retrying a call that answered code 11.
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// `timeout_seconds` of the calls made while quorum is lost: the stated bound of their failure.
const NO_QUORUM_DEADLINE_SECONDS: u64 = 2;

fn cluster() -> EtcdCluster {
    EtcdCluster::start(3).unwrap_or_else(|e| {
        panic!(
            "these tests need etcd (Debian: apt-get install etcd-server, or run scripts/setup): {e}"
        )
    })
}

/// A netconf for `node` on the etcd `endpoints` under `prefix` (host lock in `sandbox`).
fn netconf_on(
    sandbox: &Sandbox,
    endpoints: &[String],
    prefix: &str,
    node: &str,
    extra: Value,
) -> Value {
    let mut ipam = json!({
        "datastore_type": "etcdv3",
        "datastore_path": null,
        "etcd_endpoints": endpoints.join(","),
        "etcd_prefix": prefix,
        "nodename": node,
    });
    merge(&mut ipam, extra);
    sandbox.netconf("1.0.0", ipam)
}

/// Runs the real plugin (see [`run_plugin_bounded`]) with this file's [`HANG_GUARD`].
fn run_plugin(command: &str, container: &str, netconf: &Value) -> Outcome {
    run_plugin_bounded(command, container, netconf, HANG_GUARD)
}

/// The CNI error code of a failed call, if its stdout is an error JSON.
fn error_code(outcome: &Outcome) -> Option<u64> {
    serde_json::from_str::<Value>(&outcome.stdout)
        .ok()
        .and_then(|v| v["code"].as_u64())
}

/// Runs `work` on an allocator over the etcd `endpoints` under `prefix` (a connection of its own).
fn with_ipam_on<T>(endpoints: &[String], prefix: &str, work: impl AsyncFnOnce(&Ipam) -> T) -> T {
    block_on(async {
        let config = EtcdConfig::new(endpoints.iter().cloned()).with_prefix(prefix);
        let store = EtcdStore::connect(config)
            .await
            .expect("connect to etcd for inspection");
        work(&Ipam::new(Arc::new(store))).await
    })
}

/// Every container's addresses by handle (the network's reservations left out).
async fn container_allocations(ipam: &Ipam) -> BTreeMap<String, Vec<IpAddr>> {
    let mut by_handle: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    for allocation in ipam.list_allocations().await.expect("list allocations") {
        if !allocation.handle.ends_with(":gateway") {
            by_handle
                .entry(allocation.handle)
                .or_default()
                .push(allocation.ip);
        }
    }
    by_handle
}

/// Asserts the consistency check finds nothing wrong.
async fn assert_check_clean(ipam: &Ipam, when: &str) {
    let report = ipam.check(false).await.expect("run the consistency check");
    assert!(
        report.problems.is_empty(),
        "check {when}: {:#?}",
        report.problems
    );
}

fn handle(container: &str) -> String {
    format!("{NETWORK}.{container}")
}

// ---------------------------------------------------------------------------------------------
// A member, then the leader, killed during a churn
// ---------------------------------------------------------------------------------------------

/// Shared state of the churn workers.
#[derive(Default)]
struct Churn {
    stop: AtomicBool,
    /// Completed steps (one ADD, plus one DEL once a node keeps [`LIVE_PER_NODE`]).
    steps: AtomicUsize,
    /// Calls made, and calls that answered code 11 and were retried.
    calls: AtomicUsize,
    retried: AtomicUsize,
    /// Calls in which the store moved to another endpoint after a failure (from the debug log).
    failed_over: AtomicUsize,
    /// Addresses of containers whose ADD succeeded and whose DEL has not started: each must
    /// belong to exactly one of them.
    live: Mutex<BTreeMap<IpAddr, String>>,
    failures: Mutex<Vec<String>>,
}

impl Churn {
    fn fail(&self, message: String) {
        self.failures.lock().expect("failures lock").push(message);
        self.stop.store(true, Ordering::SeqCst);
    }

    fn failed(&self) -> bool {
        !self.failures.lock().expect("failures lock").is_empty()
    }

    /// Runs a call until it succeeds; every failure on the way must be code 11.
    fn until_success(&self, command: &str, container: &str, netconf: &Value) -> Option<Outcome> {
        for _ in 0..ATTEMPTS {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let outcome = run_plugin(command, container, netconf);
            if outcome.stderr.contains("etcd request failed, retrying") {
                self.failed_over.fetch_add(1, Ordering::SeqCst);
            }
            if outcome.status == 0 {
                return Some(outcome);
            }
            if error_code(&outcome) != Some(11) {
                self.fail(format!(
                    "{command} {container} failed with another code than 11: {outcome:#?}"
                ));
                return None;
            }
            self.retried.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(RETRY_PAUSE);
        }
        self.fail(format!(
            "{command} {container} still answered code 11 after {ATTEMPTS} attempts"
        ));
        None
    }

    /// One node's churn; returns the containers it still holds, with their addresses.
    fn run_node(&self, node: usize, netconf: &Value) -> Vec<(String, IpAddr)> {
        let mut held: VecDeque<(String, IpAddr)> = VecDeque::new();
        let mut number = 0;
        while !self.stop.load(Ordering::SeqCst) {
            number += 1;
            let container = format!("n{node}-c{number}");
            let Some(outcome) = self.until_success("ADD", &container, netconf) else {
                break;
            };
            let address: IpAddr = match first_address(&outcome.json()).parse() {
                Ok(address) => address,
                Err(e) => {
                    self.fail(format!("ADD {container}: bad address ({e}): {outcome:#?}"));
                    break;
                }
            };
            let previous = self
                .live
                .lock()
                .expect("live lock")
                .insert(address, container.clone());
            if let Some(other) = previous {
                self.fail(format!(
                    "duplicate: {address} handed to {container} while {other} holds it"
                ));
                break;
            }
            held.push_back((container, address));
            if held.len() > LIVE_PER_NODE {
                let Some((old, address)) = held.pop_front() else {
                    break;
                };
                // From here on its address may be handed out again.
                self.live.lock().expect("live lock").remove(&address);
                if self.until_success("DEL", &old, netconf).is_none() {
                    held.push_front((old, address));
                    break;
                }
            }
            self.steps.fetch_add(1, Ordering::SeqCst);
        }
        held.into_iter().collect()
    }

    /// Waits until the churn has made `steps` more steps (or failed).
    fn wait_for_steps(&self, steps: usize, phase: &str) {
        let target = self.steps.load(Ordering::SeqCst) + steps;
        let guard = Instant::now() + STALL_GUARD;
        while self.steps.load(Ordering::SeqCst) < target && !self.failed() {
            assert!(
                Instant::now() < guard,
                "the churn stalled {phase}: {} of {target} steps",
                self.steps.load(Ordering::SeqCst)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Rounds of faults (a follower, then the leader, killed and restarted) in the churn test:
/// `BLOCKIPAM_ETCD_FAULT_ROUNDS`, 1 by default (CI).
fn fault_rounds() -> usize {
    std::env::var("BLOCKIPAM_ETCD_FAULT_ROUNDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .filter(|rounds| *rounds > 0)
        .unwrap_or(1)
}

/// Kills `member` (`SIGKILL`) while the churn runs, checks that some call noticed, restarts it.
fn kill_and_restart(cluster: &mut EtcdCluster, member: usize, churn: &Churn, which: &str) {
    let failed_over = churn.failed_over.load(Ordering::SeqCst);
    cluster.member_mut(member).stop();
    churn.wait_for_steps(15, &format!("with {which} down"));
    // The node that lists the member first notices it on its next call, but that call (a refused
    // connection, a pause, the next member) may still be running after the other nodes made
    // their steps: its log is read when it ends.
    let guard = Instant::now() + STALL_GUARD;
    let noticed = || churn.failed() || churn.failed_over.load(Ordering::SeqCst) > failed_over;
    while !noticed() && Instant::now() < guard {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        noticed(),
        "no call noticed within {STALL_GUARD:?} that {which} was down"
    );
    cluster
        .member_mut(member)
        .restart()
        .unwrap_or_else(|e| panic!("restart {which}: {e}"));
    churn.wait_for_steps(6, &format!("after {which} came back"));
}

#[test]
fn a_follower_or_the_leader_killed_during_churn_costs_only_code_11_retries() {
    let mut cluster = cluster();
    let endpoints = cluster.endpoints();
    let prefix = unique_prefix();
    let sandboxes: Vec<Sandbox> = (0..NODES).map(|_| Sandbox::new()).collect();
    let netconfs: Vec<Value> = sandboxes
        .iter()
        .enumerate()
        .map(|(node, sandbox)| {
            // Each node lists the members in another order, so every member is some node's
            // first choice and a killed member is always noticed by a client.
            let mut endpoints = endpoints.clone();
            let first = node % endpoints.len();
            endpoints.rotate_left(first);
            netconf_on(
                sandbox,
                &endpoints,
                &prefix,
                &format!("node-{node}"),
                json!({"timeout_seconds": 5, "log_level": "debug"}),
            )
        })
        .collect();
    let churn = Arc::new(Churn::default());
    let workers: Vec<_> = netconfs
        .iter()
        .enumerate()
        .map(|(node, netconf)| {
            let (churn, netconf) = (churn.clone(), netconf.clone());
            std::thread::spawn(move || (node, churn.run_node(node, &netconf)))
        })
        .collect();

    churn.wait_for_steps(6, "before any fault");
    let rounds = fault_rounds();
    for round in 1..=rounds {
        let leader = cluster
            .wait_for_leader(Duration::from_secs(20))
            .expect("a leader");
        let follower = (leader + 1) % 3;
        kill_and_restart(
            &mut cluster,
            follower,
            &churn,
            &format!("a follower, round {round}"),
        );
        let leader = cluster
            .wait_for_leader(Duration::from_secs(20))
            .expect("a leader");
        kill_and_restart(
            &mut cluster,
            leader,
            &churn,
            &format!("the leader, round {round}"),
        );
    }
    churn.stop.store(true, Ordering::SeqCst);

    let mut survivors: Vec<(usize, String, IpAddr)> = Vec::new();
    for worker in workers {
        let (node, held) = worker.join().expect("a churn worker panicked");
        survivors.extend(held.into_iter().map(|(c, ip)| (node, c, ip)));
    }
    let failures = churn.failures.lock().expect("failures lock").clone();
    assert!(failures.is_empty(), "{failures:#?}");

    // The store holds exactly what the surviving containers were given, and nothing is amiss.
    let expected: BTreeMap<String, Vec<IpAddr>> = survivors
        .iter()
        .map(|(_, container, ip)| (handle(container), vec![*ip]))
        .collect();
    with_ipam_on(&endpoints, &prefix, async |ipam| {
        assert_eq!(container_allocations(ipam).await, expected);
        assert_check_clean(ipam, "after the churn").await;
    });
    for (node, container, _) in &survivors {
        run_plugin("DEL", container, &netconfs[*node]).assert_silent_success("final DEL");
    }
    with_ipam_on(&endpoints, &prefix, async |ipam| {
        assert_eq!(container_allocations(ipam).await, BTreeMap::new());
        assert_check_clean(ipam, "after every DEL").await;
    });
    eprintln!(
        "churn figures: {} steps, {} plugin calls, {} of them moved to another endpoint, {} answered code 11 and were retried, 0 duplicates, 0 leaks",
        churn.steps.load(Ordering::SeqCst),
        churn.calls.load(Ordering::SeqCst),
        churn.failed_over.load(Ordering::SeqCst),
        churn.retried.load(Ordering::SeqCst)
    );
}

// ---------------------------------------------------------------------------------------------
// Quorum lost
// ---------------------------------------------------------------------------------------------

#[test]
fn without_quorum_calls_fail_with_code_11_by_their_deadline_and_service_resumes() {
    let mut cluster = cluster();
    let endpoints = cluster.endpoints();
    let prefix = unique_prefix();
    let sandbox = Sandbox::new();
    let netconf = netconf_on(
        &sandbox,
        &endpoints,
        &prefix,
        NODE,
        json!({"timeout_seconds": NO_QUORUM_DEADLINE_SECONDS}),
    );
    // The calls made with quorum use the same configuration with a deadline a loaded machine's
    // process start cannot eat (the short one bounds only the calls made without quorum).
    let mut steady = netconf.clone();
    steady["ipam"]["timeout_seconds"] = json!(30);
    let before = run_plugin("ADD", "before", &steady).success_json("ADD before the outage");
    let mut check_before = netconf.clone();
    merge(&mut check_before, json!({"prevResult": before}));
    let mut steady_check_before = steady.clone();
    merge(&mut steady_check_before, json!({"prevResult": before}));

    let leader = cluster
        .wait_for_leader(Duration::from_secs(20))
        .expect("a leader");
    let other = (leader + 1) % 3;
    cluster.member_mut(leader).stop();
    cluster.member_mut(other).stop();

    // Each call fails with code 11, saying the store is unavailable or the deadline passed, and
    // answers by its deadline: the slack covers starting the process, not waiting on etcd (the
    // hang guard is 90 s).
    let answered_by = Duration::from_secs(NO_QUORUM_DEADLINE_SECONDS + 10);
    for (command, container, conf) in [
        ("ADD", "during", &netconf),
        ("DEL", "before", &netconf),
        ("CHECK", "before", &check_before),
    ] {
        let started = Instant::now();
        let outcome = run_plugin(command, container, conf);
        let took = started.elapsed();
        let message = outcome.assert_error(11, &format!("{command} without quorum"));
        eprintln!("{command} without quorum: code 11 after {took:?}: {message}");
        assert!(
            took < answered_by,
            "{command} without quorum answered after {took:?}, past its deadline of \
             {NO_QUORUM_DEADLINE_SECONDS}s: {message}"
        );
        assert!(
            message.contains("store unavailable")
                || message.contains(&format!(
                    "did not finish within its deadline of {NO_QUORUM_DEADLINE_SECONDS}s"
                )),
            "{command}: {message}"
        );
    }

    cluster
        .member_mut(leader)
        .restart()
        .expect("restart the old leader");
    cluster
        .member_mut(other)
        .restart()
        .expect("restart the follower");
    let during = run_plugin("ADD", "during", &steady).success_json("ADD after the outage");
    assert_ne!(first_address(&during), first_address(&before));
    run_plugin("CHECK", "before", &steady_check_before)
        .assert_silent_success("CHECK after the outage");
    run_plugin("DEL", "before", &steady).assert_silent_success("DEL after the outage");
    with_ipam_on(&endpoints, &prefix, async |ipam| {
        let during_ip: IpAddr = first_address(&during).parse().expect("address");
        assert_eq!(
            container_allocations(ipam).await,
            BTreeMap::from([(handle("during"), vec![during_ip])])
        );
        assert_check_clean(ipam, "after the outage").await;
    });
}

// ---------------------------------------------------------------------------------------------
// A write whose reply is lost, on a real etcd through the real plugin
// ---------------------------------------------------------------------------------------------

/// A loopback TCP proxy in front of etcd that, when armed, forwards the next write transaction
/// (an etcd `Txn` with a put or delete) and drops every byte etcd sends back on that connection,
/// until [`sever`](Self::sever) closes it: the client sent a write that etcd applied and never
/// learns the outcome.
struct LossyProxy {
    address: SocketAddr,
    shared: Arc<ProxyShared>,
}

#[derive(Default)]
struct ProxyShared {
    armed: AtomicBool,
    lost_writes: AtomicUsize,
    /// Both sockets of each connection whose replies are being dropped.
    muted: Mutex<Vec<(TcpStream, TcpStream)>>,
}

impl LossyProxy {
    fn start(upstream: SocketAddr) -> LossyProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let address = listener.local_addr().expect("proxy address");
        let shared = Arc::new(ProxyShared::default());
        let accepting = shared.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let muted = Arc::new(AtomicBool::new(false));
                let (Ok(client_in), Ok(server_out)) = (client.try_clone(), server.try_clone())
                else {
                    continue;
                };
                let (shared, muted_up) = (accepting.clone(), muted.clone());
                std::thread::spawn(move || {
                    pump_requests(client_in, server_out, &muted_up, &shared);
                });
                std::thread::spawn(move || pump_replies(server, client, &muted));
            }
        });
        LossyProxy { address, shared }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The next write transaction through the proxy will lose its reply.
    fn lose_reply_of_next_write(&self) {
        self.shared.armed.store(true, Ordering::SeqCst);
    }

    /// Closes every connection whose replies are being dropped.
    fn sever(&self) {
        for (client, server) in self.shared.muted.lock().expect("muted lock").drain(..) {
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
        }
    }

    fn lost_writes(&self) -> usize {
        self.shared.lost_writes.load(Ordering::SeqCst)
    }
}

/// Client to etcd: forwards HTTP/2 frame by frame, and mutes the connection just before
/// forwarding the write transaction when the proxy is armed.
fn pump_requests(
    mut client: TcpStream,
    mut server: TcpStream,
    muted: &AtomicBool,
    shared: &ProxyShared,
) {
    const PREFACE_LEN: usize = 24;
    const FRAME_HEADER_LEN: usize = 9;
    let mut pending: Vec<u8> = Vec::new();
    let mut preface_sent = false;
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let read = match client.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        pending.extend_from_slice(&chunk[..read]);
        loop {
            let unit = if !preface_sent {
                if pending.len() < PREFACE_LEN {
                    break;
                }
                preface_sent = true;
                PREFACE_LEN
            } else {
                if pending.len() < FRAME_HEADER_LEN {
                    break;
                }
                let length = usize::from(pending[0]) << 16
                    | usize::from(pending[1]) << 8
                    | usize::from(pending[2]);
                if pending.len() < FRAME_HEADER_LEN + length {
                    break;
                }
                let (kind, flags) = (pending[3], pending[4]);
                let payload = &pending[FRAME_HEADER_LEN..FRAME_HEADER_LEN + length];
                if kind == 0
                    && is_write_txn(data_without_padding(payload, flags))
                    && shared.armed.swap(false, Ordering::SeqCst)
                {
                    muted.store(true, Ordering::SeqCst);
                    shared.lost_writes.fetch_add(1, Ordering::SeqCst);
                    if let (Ok(c), Ok(s)) = (client.try_clone(), server.try_clone()) {
                        shared.muted.lock().expect("muted lock").push((c, s));
                    }
                }
                FRAME_HEADER_LEN + length
            };
            let unit: Vec<u8> = pending.drain(..unit).collect();
            if server.write_all(&unit).is_err() {
                return;
            }
        }
    }
    let _ = server.shutdown(Shutdown::Write);
}

/// etcd to client: forwards everything unless the connection is muted.
fn pump_replies(mut server: TcpStream, mut client: TcpStream, muted: &AtomicBool) {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let read = match server.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if muted.load(Ordering::SeqCst) {
            continue;
        }
        if client.write_all(&chunk[..read]).is_err() {
            return;
        }
    }
    let _ = client.shutdown(Shutdown::Write);
}

/// A DATA frame's payload without its padding (flag 0x8).
fn data_without_padding(payload: &[u8], flags: u8) -> &[u8] {
    if flags & 0x8 == 0 {
        return payload;
    }
    match payload.split_first() {
        Some((&pad, rest)) if usize::from(pad) <= rest.len() => {
            &rest[..rest.len() - usize::from(pad)]
        }
        _ => &[],
    }
}

/// Whether a gRPC message (5-byte prefix, then protobuf) is an etcd `TxnRequest` that writes:
/// its `success` list (field 2) holds a put (`RequestOp` field 2) or a delete (field 3). The
/// adapter's reads are `RangeRequest`s (field 2 there is a key) or `Txn`s of ranges (field 1).
fn is_write_txn(message: &[u8]) -> bool {
    let Some(body) = message.get(5..) else {
        return false;
    };
    let mut at = 0;
    while at < body.len() {
        let Some((tag, used)) = varint(&body[at..]) else {
            return false;
        };
        at += used;
        match tag & 7 {
            0 => match varint(&body[at..]) {
                Some((_, used)) => at += used,
                None => return false,
            },
            1 => at += 8,
            5 => at += 4,
            2 => {
                let Some((length, used)) = varint(&body[at..]) else {
                    return false;
                };
                at += used;
                let Ok(length) = usize::try_from(length) else {
                    return false;
                };
                let Some(field) = body.get(at..at + length) else {
                    return false;
                };
                if tag >> 3 == 2 && matches!(field.first(), Some(0x12 | 0x1a)) {
                    return true;
                }
                at += length;
            }
            _ => return false,
        }
    }
    false
}

/// A protobuf varint and the bytes it used.
fn varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, byte) in bytes.iter().take(10).enumerate() {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

/// Waits until `condition` holds, failing if `plugin` finished first or the guard passed.
fn wait_until_landed(
    what: &str,
    plugin: &std::thread::JoinHandle<Outcome>,
    mut condition: impl FnMut() -> bool,
) {
    let guard = Instant::now() + HANG_GUARD;
    while !condition() {
        assert!(
            !plugin.is_finished(),
            "the plugin finished before {what} reached etcd"
        );
        assert!(Instant::now() < guard, "{what} never reached etcd");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_write_whose_reply_is_lost_is_code_11_and_the_retry_resolves_it() {
    let server = EtcdServer::start().unwrap_or_else(|e| {
        panic!("this test needs etcd (Debian: apt-get install etcd-server): {e}")
    });
    let upstream: SocketAddr = server
        .endpoint()
        .trim_start_matches("http://")
        .parse()
        .expect("etcd address");
    let proxy = LossyProxy::start(upstream);
    let prefix = unique_prefix();
    let direct = vec![server.endpoint()];
    let sandbox = Sandbox::new();
    // A deadline far beyond the time the lost write needs to land: the outcome is decided by
    // the severed connection, not by the deadline.
    let netconf = netconf_on(
        &sandbox,
        &[proxy.endpoint()],
        &prefix,
        NODE,
        json!({"timeout_seconds": 60}),
    );
    let holds = |container: &str| -> Vec<IpAddr> {
        with_ipam_on(&direct, &prefix, async |ipam| {
            container_allocations(ipam)
                .await
                .remove(&handle(container))
                .unwrap_or_default()
        })
    };

    // Pools, the gateway reservation and the node's block exist; c0 holds an address.
    let c0 = run_plugin("ADD", "c0", &netconf).success_json("ADD c0");
    assert_eq!(proxy.lost_writes(), 0);

    // ADD c1: etcd applies the allocation, the plugin never hears back.
    proxy.lose_reply_of_next_write();
    let add = {
        let netconf = netconf.clone();
        std::thread::spawn(move || run_plugin("ADD", "c1", &netconf))
    };
    wait_until_landed("the ADD's transaction", &add, || !holds("c1").is_empty());
    proxy.sever();
    let outcome = add.join().expect("ADD thread");
    let message = outcome.assert_error(11, "ADD whose reply was lost");
    assert!(message.contains("outcome unknown"), "{message}");
    assert_eq!(proxy.lost_writes(), 1);
    let landed = holds("c1");
    assert_eq!(landed.len(), 1, "{landed:?}");

    // The runtime retries: the same address comes back, nothing new is allocated.
    let retried = run_plugin("ADD", "c1", &netconf).success_json("ADD c1 again");
    assert_eq!(first_address(&retried), landed[0].to_string());
    let c0_ip: IpAddr = first_address(&c0).parse().expect("address");
    with_ipam_on(&direct, &prefix, async |ipam| {
        assert_eq!(
            container_allocations(ipam).await,
            BTreeMap::from([(handle("c0"), vec![c0_ip]), (handle("c1"), landed.clone())])
        );
        assert_check_clean(ipam, "after the retried ADD").await;
    });

    // DEL c1: etcd applies the release, the plugin never hears back; the retried DEL succeeds.
    proxy.lose_reply_of_next_write();
    let del = {
        let netconf = netconf.clone();
        std::thread::spawn(move || run_plugin("DEL", "c1", &netconf))
    };
    wait_until_landed("the DEL's transaction", &del, || holds("c1").is_empty());
    proxy.sever();
    let outcome = del.join().expect("DEL thread");
    let message = outcome.assert_error(11, "DEL whose reply was lost");
    assert!(message.contains("outcome unknown"), "{message}");
    assert_eq!(proxy.lost_writes(), 2);
    run_plugin("DEL", "c1", &netconf).assert_silent_success("DEL c1 again");
    with_ipam_on(&direct, &prefix, async |ipam| {
        assert_eq!(
            container_allocations(ipam).await,
            BTreeMap::from([(handle("c0"), vec![c0_ip])])
        );
        assert_check_clean(ipam, "after the retried DEL").await;
    });
}

// ---------------------------------------------------------------------------------------------
// An unknown outcome at every commit of an ADD/DEL sequence (in-process, memory store)
// ---------------------------------------------------------------------------------------------

/// What happens to the one commit chosen to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LostReply {
    /// The transaction is applied, then `Indeterminate` is returned.
    AfterApplying,
    /// Nothing is applied, and `Indeterminate` is returned.
    WithoutApplying,
}

/// A memory store whose commit number `fail_at` answers [`KvError::Indeterminate`].
#[derive(Debug)]
struct UnknownOutcomeStore {
    inner: MemoryStore,
    fail_at: Option<(usize, LostReply)>,
    commits: AtomicUsize,
    fired: AtomicUsize,
}

impl UnknownOutcomeStore {
    fn new(fail_at: Option<(usize, LostReply)>) -> Self {
        UnknownOutcomeStore {
            inner: MemoryStore::new(),
            fail_at,
            commits: AtomicUsize::new(0),
            fired: AtomicUsize::new(0),
        }
    }
}

#[async_trait]
impl KvStore for UnknownOutcomeStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }

    async fn read_many(
        &self,
        reads: &[ipam_core::Read],
    ) -> Result<Vec<ipam_core::ReadResult>, KvError> {
        self.inner.read_many(reads).await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        let number = self.commits.fetch_add(1, Ordering::SeqCst) + 1;
        match self.fail_at {
            Some((at, mode)) if at == number => {
                self.fired.fetch_add(1, Ordering::SeqCst);
                if mode == LostReply::AfterApplying {
                    self.inner.commit(txn).await?;
                }
                Err(KvError::Indeterminate {
                    message: format!("injected: the reply of commit #{number} was lost"),
                })
            }
            _ => self.inner.commit(txn).await,
        }
    }
}

/// One call of the sequence.
#[derive(Debug, Clone, Copy)]
enum Step {
    Add(&'static str, &'static str),
    Del(&'static str, &'static str),
}

/// ADDs that create the pools, reserve the gateway, claim blocks on two nodes and assign; DELs
/// that release; an ADD that reuses a released address.
const SEQUENCE: [Step; 7] = [
    Step::Add("a", "node-a"),
    Step::Add("b", "node-a"),
    Step::Add("c", "node-b"),
    Step::Del("a", "node-a"),
    Step::Del("c", "node-b"),
    Step::Add("d", "node-a"),
    Step::Add("e", "node-b"),
];

fn plugin_conf(node: &str) -> NetConf {
    let value = json!({
        "cniVersion": "1.0.0",
        "name": NETWORK,
        "ipam": {
            "type": "blockipam",
            "nodename": node,
            "pools": [{"cidr": "10.244.7.0/24", "block_size": 28, "name": "test-v4"}],
            "gateway": "10.244.7.1"
        }
    });
    parse_netconf(&value, NETWORK.to_owned(), "1.0.0".to_owned()).expect("a valid netconf")
}

/// Runs [`SEQUENCE`] as the plugin's commands would, retrying a call that answers code 11 as a
/// runtime does; returns the containers that hold an address, or what went wrong.
async fn run_sequence(ipam: &Ipam) -> Result<BTreeMap<String, Vec<IpAddr>>, String> {
    let args = CniArgs::default();
    let mut live: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    for step in SEQUENCE {
        let (container, node) = match step {
            Step::Add(c, n) | Step::Del(c, n) => (c, n),
        };
        let conf = plugin_conf(node);
        let call = Attachment {
            conf: &conf,
            container_id: container,
            ifname: "eth0",
            args: &args,
            node,
        };
        let mut attempts = 0;
        loop {
            attempts += 1;
            let outcome = match step {
                Step::Add(..) => commands::add(ipam, &call)
                    .await
                    .map(|result| Some(result.ips.iter().map(|ip| ip.address.addr()).collect())),
                Step::Del(..) => commands::del(ipam, &call).await.map(|_| None),
            };
            match outcome {
                Ok(Some(addresses)) => {
                    let addresses: Vec<IpAddr> = addresses;
                    for (other, held) in &live {
                        if other != container && held.iter().any(|ip| addresses.contains(ip)) {
                            return Err(format!(
                                "duplicate: {container} got {addresses:?}, {other} holds {held:?}"
                            ));
                        }
                    }
                    live.insert(container.to_owned(), addresses);
                    break;
                }
                Ok(None) => {
                    live.remove(container);
                    break;
                }
                Err(e) if e.code == 11 && attempts < 3 => continue,
                Err(e) => return Err(format!("{step:?} failed: code {} {}", e.code, e.msg)),
            }
        }
    }
    Ok(live
        .into_iter()
        .map(|(container, addresses)| (handle(&container), addresses))
        .collect())
}

#[test]
fn an_unknown_outcome_at_any_commit_of_add_and_del_leaves_no_duplicate_and_no_leak() {
    block_on(async {
        let baseline = Arc::new(UnknownOutcomeStore::new(None));
        let ipam = Ipam::new(baseline.clone());
        let expected = run_sequence(&ipam)
            .await
            .expect("the sequence without faults");
        assert_eq!(container_allocations(&ipam).await, expected);
        let commits = baseline.commits.load(Ordering::SeqCst);
        assert!(commits >= SEQUENCE.len(), "only {commits} commits");

        for at in 1..=commits {
            for mode in [LostReply::AfterApplying, LostReply::WithoutApplying] {
                let store = Arc::new(UnknownOutcomeStore::new(Some((at, mode))));
                let ipam = Ipam::new(store.clone());
                let what = format!("reply of commit #{at} of {commits} lost {mode:?}");
                let live = run_sequence(&ipam)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(
                    store.fired.load(Ordering::SeqCst),
                    1,
                    "{what}: not injected"
                );
                // Same holders as without the fault (addresses may differ), and exactly what
                // they were given is allocated: no duplicate, no leak.
                assert_eq!(
                    live.keys().collect::<Vec<_>>(),
                    expected.keys().collect::<Vec<_>>(),
                    "{what}"
                );
                assert_eq!(container_allocations(&ipam).await, live, "{what}");
                let report = ipam.check(false).await.expect("check");
                assert!(report.problems.is_empty(), "{what}: {:#?}", report.problems);
            }
        }
    });
}
