//! Store round trips per plugin call, counted through the real `blockipam` binary: by the plugin's
//! own count (its debug log line "store round trips") on sled and redb, and by etcd's own gRPC
//! counters (`grpc_server_handled_total`) around each call on a real etcd. Steady-state ADD and
//! DEL make two each: one batched read and one transaction. Also: the checks folded into that read
//! still notice a missing reservation or a changed gateway; STATUS reads which addresses are taken
//! only when its answer depends on them.

use crate::common;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use backend_etcd::{EtcdConfig, EtcdStore};
use blockipam_store::DatastoreType;
use common::*;
use ipam_core::{Ipam, ReleaseRequest};
use serde_json::{json, Value};
use test_kit::etcd::{unique_prefix, EtcdServer};

/// One call's counts from the plugin's log.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Counted {
    command: String,
    reads: u64,
    commits: u64,
}

/// Every "store round trips" line of the plugin's log at `log`, in order.
fn counted_calls(log: &Path) -> Vec<Counted> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let field = |line: &str, name: &str| -> Option<String> {
        let start = line.find(&format!("{name}="))? + name.len() + 1;
        let rest = &line[start..];
        let end = rest.find(' ').unwrap_or(rest.len());
        Some(rest[..end].trim_matches('"').to_owned())
    };
    text.lines()
        .filter(|line| line.contains("store round trips"))
        .map(|line| Counted {
            command: field(line, "command").expect("command field"),
            reads: field(line, "reads")
                .and_then(|v| v.parse().ok())
                .expect("reads field"),
            commits: field(line, "commits")
                .and_then(|v| v.parse().ok())
                .expect("commits field"),
        })
        .collect()
}

/// Runs `command` for `container` and returns its counts (the newest log line).
fn call_counted(command: &str, container: &str, netconf: &Value, log: &Path) -> (Outcome, Counted) {
    let before = counted_calls(log).len();
    let outcome = cni(command, container, "eth0", netconf, &[]);
    let calls = counted_calls(log);
    assert_eq!(
        calls.len(),
        before + 1,
        "{command} {container} logged no round-trip line: {}",
        outcome.stderr
    );
    (outcome, calls[before].clone())
}

fn one_and_one(command: &str) -> Counted {
    Counted {
        command: command.to_owned(),
        reads: 1,
        commits: 1,
    }
}

fn steady_state_is_two_round_trips(store_type: DatastoreType) {
    let sandbox = Sandbox::with_store(store_type);
    let log = sandbox.store_path().with_extension("log");
    let netconf = sandbox.netconf(
        "1.0.0",
        json!({"log_level": "debug", "log_file_path": log, "agent_socket": ""}),
    );
    // The first ADD sets the network up (pools, reservations): more round trips, once.
    let (first, setup) = call_counted("ADD", "c0", &netconf, &log);
    first.success_json("first ADD");
    assert!(
        setup.reads + setup.commits > 2,
        "the first ADD must set the network up: {setup:?}"
    );
    for container in ["c1", "c2", "c3"] {
        let (outcome, counted) = call_counted("ADD", container, &netconf, &log);
        outcome.success_json("steady-state ADD");
        assert_eq!(counted, one_and_one("ADD"), "ADD {container}");
    }
    for container in ["c1", "c2"] {
        let (outcome, counted) = call_counted("DEL", container, &netconf, &log);
        outcome.assert_silent_success("DEL");
        assert_eq!(counted, one_and_one("DEL"), "DEL {container}");
    }
    // A DEL with nothing to release: one read, no transaction.
    let (outcome, counted) = call_counted("DEL", "never-added", &netconf, &log);
    outcome.assert_silent_success("DEL of nothing");
    assert_eq!((counted.reads, counted.commits), (1, 0), "DEL of nothing");
    let left: Vec<String> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(_, handle, _)| handle)
        .collect();
    assert_eq!(
        left,
        vec!["testnet.c0".to_owned(), "testnet.c3".to_owned()],
        "c0 and c3 hold their address, c1 and c2 released theirs"
    );
}

#[test]
fn steady_state_add_and_del_make_two_round_trips_on_sled() {
    steady_state_is_two_round_trips(DatastoreType::Sled);
}

#[test]
fn steady_state_add_and_del_make_two_round_trips_on_redb() {
    steady_state_is_two_round_trips(DatastoreType::Redb);
}

/// The gateway reservation handle's addresses, as the store holds them.
fn reserved(sandbox: &Sandbox) -> Vec<String> {
    let mut held: Vec<String> = sandbox
        .allocations()
        .into_iter()
        .filter(|(_, handle, _)| handle.ends_with(":gateway"))
        .map(|(ip, _, _)| ip)
        .collect();
    held.sort();
    held
}

#[test]
fn a_released_reservation_or_a_changed_gateway_is_noticed_inside_the_one_read() {
    let sandbox = Sandbox::new();
    let log = sandbox.store_path().with_extension("log");
    let netconf = sandbox.netconf(
        "1.0.0",
        json!({"log_level": "debug", "log_file_path": log, "agent_socket": ""}),
    );
    cni("ADD", "c0", "eth0", &netconf, &[]).success_json("first ADD");
    let before = reserved(&sandbox);
    assert!(
        before.contains(&"10.244.7.1".to_owned()),
        "the gateway is reserved: {before:?}"
    );
    // An operator releases the gateway's reservation: the next ADD must put it back (and so take
    // the set-up path), not trust a stale confirmation.
    sandbox.with_ipam(async |ipam: &Ipam| {
        let ip: IpAddr = "10.244.7.1".parse().expect("ip");
        let outcome = ipam
            .release_ips(&[ReleaseRequest { ip, sequence: None }])
            .await
            .expect("release the gateway reservation");
        assert_eq!(outcome.released, vec![ip]);
    });
    assert!(!reserved(&sandbox).contains(&"10.244.7.1".to_owned()));
    let (outcome, counted) = call_counted("ADD", "c1", &netconf, &log);
    outcome.success_json("ADD after the release");
    assert_ne!(
        counted,
        one_and_one("ADD"),
        "a released reservation must send ADD down the set-up path"
    );
    assert_eq!(reserved(&sandbox), before, "the reservation is back");
    let (_, counted) = call_counted("ADD", "c2", &netconf, &log);
    assert_eq!(counted, one_and_one("ADD"), "steady again");

    // The netconf's gateway changes to an address no container holds yet: it is reserved at the
    // next ADD, and no container is ever given it.
    let mut moved = netconf.clone();
    moved["ipam"]["gateway"] = json!(["10.244.7.200", "fd00:10:244::1"]);
    let (outcome, counted) = call_counted("ADD", "c3", &moved, &log);
    outcome.success_json("ADD with a new gateway");
    assert_ne!(counted, one_and_one("ADD"), "a new gateway needs set-up");
    assert!(
        reserved(&sandbox).contains(&"10.244.7.200".to_owned()),
        "the new gateway is reserved: {:?}",
        reserved(&sandbox)
    );
    let handed_out: BTreeMap<String, String> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(ip, handle, _)| (ip, handle))
        .collect();
    for ip in ["10.244.7.1", "10.244.7.200", "10.244.7.0", "10.244.7.255"] {
        assert!(
            !handed_out.contains_key(ip),
            "{ip} went to a container: {handed_out:?}"
        );
    }
}

#[test]
fn a_damaged_confirmation_record_costs_one_set_up_path_never_an_error() {
    let sandbox = Sandbox::new();
    let log = sandbox.store_path().with_extension("log");
    let netconf = sandbox.netconf(
        "1.0.0",
        json!({"log_level": "debug", "log_file_path": log, "agent_socket": ""}),
    );
    cni("ADD", "c0", "eth0", &netconf, &[]).success_json("first ADD");
    let record = ipam_core::model::keys::reservations_held("testnet:gateway");
    let damaged = record.clone();
    sandbox.with_ipam(async move |ipam: &Ipam| {
        ipam.store()
            .put(&damaged, b"\x00not json".to_vec())
            .await
            .expect("damage the record");
    });
    let (outcome, counted) = call_counted("ADD", "c1", &netconf, &log);
    outcome.success_json("ADD over a damaged record");
    assert_ne!(counted, one_and_one("ADD"), "the damaged record is stale");
    let rewritten = sandbox
        .snapshot()
        .into_iter()
        .find(|(key, _)| *key == record)
        .map(|(_, value)| value)
        .expect("the record is written again");
    assert!(
        serde_json::from_slice::<Value>(&rewritten).is_ok(),
        "the record is JSON again"
    );
    let (_, counted) = call_counted("ADD", "c2", &netconf, &log);
    assert_eq!(counted, one_and_one("ADD"), "steady again");
}

/// The reads of one STATUS of the netconf's node, which must fail with `refusal` in its message.
fn refused_status_reads(netconf: &Value, log: &Path, refusal: &str) -> u64 {
    let before = counted_calls(log).len();
    let msg = cni("STATUS", "", "", netconf, &[]).assert_error(50, refusal);
    assert!(msg.contains(refusal), "expected {refusal:?} in {msg}");
    let calls = counted_calls(log);
    assert_eq!(calls.len(), before + 1, "STATUS logged no round-trip line");
    assert_eq!(
        (calls[before].command.as_str(), calls[before].commits),
        ("STATUS", 0),
        "STATUS never writes: {:?}",
        calls[before]
    );
    calls[before].reads
}

/// When STATUS must count every block (here: a node at its block limit whose own block it cannot
/// decode, or a node whose pool's one block, holding the network's gateway, is full, where an
/// ADD may take block edges), it reads which addresses are taken
/// (every allocation, and the reservations: two more reads) only when the answer depends on it:
/// a block of one or two free addresses that may be its edges, or a free gateway address of the
/// network's set-up in a block with room. Neither a block with many free addresses nor a full
/// block holding the gateway is such a block.
#[test]
fn status_reads_which_addresses_are_taken_only_when_its_answer_depends_on_them() {
    let sandbox = Sandbox::new();
    let log = sandbox.store_path().with_extension("log");
    let on = |node: &str, gateway: Value, pool: &str| {
        sandbox.netconf(
            "1.1.0",
            json!({"nodename": node, "gateway": gateway, "log_level": "debug",
                   "log_file_path": log, "agent_socket": "", "ipv4_pools": [pool],
                   "pools": [{"cidr": pool, "block_size": 29}]}),
        )
    };
    // Two /29 blocks, no gateway: limit-a's block, and limit-b's with seven free addresses.
    let limit_a = on("limit-a", Value::Null, "10.244.20.0/28");
    let limit_b = on("limit-b", Value::Null, "10.244.20.0/28");
    cni("ADD", "a1", "eth0", &limit_a, &[]).success_json("a1");
    let b1 = cni("ADD", "b1", "eth0", &limit_b, &[]).success_json("b1");
    let b1: ipnet::IpNet = b1["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .expect("b1's address");
    // A pool whose one /29 block holds the network's gateway, filled up: with a gateway in the
    // pool, an ADD may take the block's edges.
    let gw_a = on("gw-a", json!("10.244.21.1"), "10.244.21.0/29");
    cni("ADD", "g1", "eth0", &gw_a, &[]).success_json("g1");
    let gateway_block: ipnet::IpNet = "10.244.21.0/29".parse().expect("the block");
    sandbox.with_ipam(async |ipam: &Ipam| {
        for ip in gateway_block.hosts().chain([gateway_block.broadcast()]) {
            // The gateway and g1's address are held already.
            let _ = ipam
                .assign_ips(&ipam_core::AssignIpsRequest {
                    ips: vec![ip],
                    handle: "gw-filler".into(),
                    host: "gw-a".into(),
                    ..ipam_core::AssignIpsRequest::default()
                })
                .await;
        }
        let usage = ipam.utilization().await.expect("usage");
        let block = usage
            .pools
            .iter()
            .flat_map(|p| p.blocks.iter())
            .find(|b| b.cidr == gateway_block)
            .expect("the gateway's block");
        assert_eq!(block.free, 0, "the gateway's block is full: {block:?}");
    });
    sandbox.with_ipam(async |ipam: &Ipam| {
        ipam.update_config(|config| config.max_blocks_per_host = 1)
            .await
            .expect("a limit of one block");
    });
    let damaged = sandbox.damage_under(&ipam_core::model::keys::host_open_blocks_dir("limit-a"));
    assert_eq!(damaged.len(), 1, "limit-a's block has room");
    let at_limit_damaged = refused_status_reads(&limit_a, &log, "per-node block limit is 1");
    // Refused for want of room, not at the block limit: limit-a's block, which cannot be decoded,
    // counts toward limit-a's limit, not gw-a's.
    let gateway_block_full = refused_status_reads(&gw_a, &log, "no free address");
    // limit-b's block with its every host address taken: two free addresses, which may be its
    // edges; which addresses are taken now decides, and STATUS reads it.
    let block = ipnet::IpNet::new(b1.addr(), 29).expect("a /29").trunc();
    let others: Vec<IpAddr> = block.hosts().filter(|ip| *ip != b1.addr()).collect();
    assert_eq!(others.len(), 5, "{block}");
    sandbox.with_ipam(async |ipam: &Ipam| {
        ipam.assign_ips(&ipam_core::AssignIpsRequest {
            ips: others.clone(),
            handle: "filler".into(),
            host: "limit-b".into(),
            ..ipam_core::AssignIpsRequest::default()
        })
        .await
        .expect("take limit-b's block's other host addresses");
    });
    let edges_decide = refused_status_reads(&limit_a, &log, "per-node block limit is 1");
    eprintln!(
        "STATUS reads: limit-a at its limit, its block damaged, {at_limit_damaged}; gw-a, the \
         gateway's block full, {gateway_block_full}; limit-a beside a block whose edges decide, \
         {edges_decide}"
    );
    assert_eq!(
        at_limit_damaged, 3,
        "limit-a: its blocks, the new-block probe, then every block; nothing read of which \
         addresses are taken"
    );
    assert_eq!(
        gateway_block_full, 4,
        "gw-a: its blocks, the new-block probe, the claim index (no lender there), then every \
         block; nothing read of which addresses are taken"
    );
    assert_eq!(
        edges_decide,
        at_limit_damaged + 2,
        "which addresses are taken (the allocations and the reservations), read when a block's \
         room depends on its edges"
    );
}

/// etcd's own count of gRPC requests, by method, before and after `call`.
fn grpc_requests_during(server: &EtcdServer, call: impl FnOnce()) -> BTreeMap<String, u64> {
    let before = server.grpc_requests_handled().expect("etcd metrics");
    call();
    let after = server.grpc_requests_handled().expect("etcd metrics");
    after
        .into_iter()
        .filter_map(|(method, count)| {
            let grew = count - before.get(&method).copied().unwrap_or(0);
            (grew > 0).then_some((method, grew))
        })
        .collect()
}

/// An etcd server of the test's own: nothing else sends it requests while it counts.
fn own_etcd() -> EtcdServer {
    EtcdServer::start().unwrap_or_else(|e| {
        panic!(
            "this test needs etcd (Debian: apt-get install etcd-server, or run scripts/setup): {e}"
        )
    })
}

/// The sandbox's netconf on `server` under `prefix`, reaching it through the agent at
/// `agent_socket` (`""`: the plugin opens the store itself).
fn etcd_netconf(
    sandbox: &Sandbox,
    server: &EtcdServer,
    prefix: &str,
    agent_socket: Value,
) -> Value {
    let mut netconf = sandbox.netconf("1.0.0", json!({ "agent_socket": agent_socket }));
    netconf["ipam"]["datastore_type"] = json!("etcdv3");
    netconf["ipam"]["datastore_path"] = Value::Null;
    netconf["ipam"]["etcd_endpoints"] = json!(server.endpoint());
    netconf["ipam"]["etcd_prefix"] = json!(prefix);
    netconf
}

/// An ADD and a DEL of a container with `netconf`, each asserted to succeed.
fn add_and_del(netconf: &Value) -> (impl Fn(&str) + '_, impl Fn(&str) + '_) {
    let add = move |container: &str| {
        cni("ADD", container, "eth0", netconf, &[]).success_json("ADD");
    };
    let del = move |container: &str| {
        cni("DEL", container, "eth0", netconf, &[]).assert_silent_success("DEL");
    };
    (add, del)
}

#[test]
fn etcd_counts_two_requests_per_steady_state_add_and_del() {
    let server = own_etcd();
    let prefix = unique_prefix();
    let sandbox = Sandbox::new();
    let netconf = etcd_netconf(&sandbox, &server, &prefix, json!(""));
    let (add, del) = add_and_del(&netconf);
    let first = grpc_requests_during(&server, || add("c0"));
    println!("first ADD: {first:?}");
    for container in ["c1", "c2"] {
        let steady = grpc_requests_during(&server, || add(container));
        println!("ADD {container}: {steady:?}");
        assert_eq!(
            steady.values().sum::<u64>(),
            2,
            "a steady-state ADD is one read and one transaction: {steady:?}"
        );
    }
    for container in ["c1", "c2"] {
        let released = grpc_requests_during(&server, || del(container));
        println!("DEL {container}: {released:?}");
        assert_eq!(
            released.values().sum::<u64>(),
            2,
            "a DEL is one read and one transaction: {released:?}"
        );
    }
    // The counts are real: c0 is still allocated, c1 and c2 are not.
    let left = common::block_on(async {
        let store = EtcdStore::connect(EtcdConfig::new([server.endpoint()]).with_prefix(&prefix))
            .await
            .expect("connect");
        Ipam::new(Arc::new(store))
            .list_allocations()
            .await
            .expect("list")
            .into_iter()
            .filter(|a| !a.handle.ends_with(":gateway"))
            .map(|a| a.handle)
            .collect::<Vec<_>>()
    });
    assert_eq!(left, vec!["testnet.c0".to_owned()]);
}

/// Through the node agent (its cache of what it read and wrote), a steady-state ADD and DEL on a
/// real etcd are one request each: the transaction, carrying the conditions under which the
/// agent's answers were still the store's. The agent's own work is made quiet for the count
/// (a long liveness lease and reclaim interval).
#[test]
fn etcd_counts_one_request_per_steady_state_add_and_del_through_the_agent() {
    let server = own_etcd();
    let prefix = unique_prefix();
    let sandbox = Sandbox::new();
    let socket = sandbox.agent_socket();
    std::fs::create_dir_all(socket.parent().expect("socket dir")).expect("socket dir");
    let flags: Vec<std::ffi::OsString> = [
        "--datastore-type",
        "etcdv3",
        "--etcd-endpoints",
        &server.endpoint(),
        "--etcd-prefix",
        &prefix,
        "--node",
        NODE,
        "--liveness-ttl-seconds",
        "3600",
        "--reclaim-interval-seconds",
        "86400",
    ]
    .map(Into::into)
    .into();
    let _agent = InProcessAgent::run_binary_with_flags(&socket, flags)
        .unwrap_or_else(|e| panic!("the agent did not start: {e}"));
    let netconf = etcd_netconf(&sandbox, &server, &prefix, json!(socket));
    let (add, del) = add_and_del(&netconf);
    // The network's set-up, then an ADD whose read fills the agent's cache.
    add("c0");
    add("c1");
    let quiet = grpc_requests_during(&server, || {
        std::thread::sleep(std::time::Duration::from_millis(300));
    });
    assert!(quiet.is_empty(), "the agent is not quiet: {quiet:?}");
    for container in ["c2", "c3"] {
        let steady = grpc_requests_during(&server, || add(container));
        println!("ADD {container}: {steady:?}");
        assert_eq!(
            steady,
            BTreeMap::from([("Txn".to_owned(), 1)]),
            "a steady-state ADD through the agent is one transaction"
        );
    }
    for container in ["c2", "c3"] {
        let released = grpc_requests_during(&server, || del(container));
        println!("DEL {container}: {released:?}");
        assert_eq!(
            released,
            BTreeMap::from([("Txn".to_owned(), 1)]),
            "a steady-state DEL through the agent is one transaction"
        );
    }
    // The counts are real: c0 and c1 are still allocated, c2 and c3 are not.
    let left = common::block_on(async {
        let store = EtcdStore::connect(EtcdConfig::new([server.endpoint()]).with_prefix(&prefix))
            .await
            .expect("connect");
        let mut left = Ipam::new(Arc::new(store))
            .list_allocations()
            .await
            .expect("list")
            .into_iter()
            .filter(|a| !a.handle.ends_with(":gateway"))
            .map(|a| a.handle)
            .collect::<Vec<_>>();
        left.sort();
        left
    });
    assert_eq!(left, vec!["testnet.c0".to_owned(), "testnet.c1".to_owned()]);
}
