//! The plugin on a real etcd, and on an unreachable or silent one.
//!
//! The plugin on a real etcd (a throwaway `etcd` process on loopback): ADD/CHECK/DEL rounds and
//! concurrent ADDs, and an unreachable or silent etcd giving code 11 (50 for STATUS) without
//! hanging.

use crate::common;

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::sync::mpsc;
use std::time::Duration;

use backend_etcd::{EtcdConfig, EtcdStore};
use common::*;
use ipam_core::Ipam;
use serde_json::{json, Value};
use test_kit::etcd::{unique_prefix, EtcdServer, PrefixGuard};

fn server() -> &'static EtcdServer {
    match EtcdServer::try_shared() {
        Ok(server) => server,
        Err(e) => panic!(
            "these tests need a local etcd (Debian: apt-get install etcd-server, or run scripts/setup): {e}"
        ),
    }
}

/// A netconf on etcd `endpoint` under `prefix` (the lock file lives in `sandbox`).
fn etcd_netconf(
    sandbox: &Sandbox,
    version: &str,
    endpoint: &str,
    prefix: &str,
    extra: Value,
) -> Value {
    let mut ipam = json!({
        "datastore_type": "etcdv3",
        "datastore_path": null,
        "etcd_endpoints": endpoint,
        "etcd_prefix": prefix,
    });
    merge(&mut ipam, extra);
    sandbox.netconf(version, ipam)
}

/// An allocator on the etcd `config` names (inside the caller's runtime).
async fn ipam_on(config: EtcdConfig) -> Ipam {
    Ipam::new(std::sync::Arc::new(
        EtcdStore::connect(config).await.expect("connect"),
    ))
}

fn container_allocations_on(endpoint: &str, prefix: &str) -> Vec<(String, String)> {
    block_on(async {
        ipam_on(EtcdConfig::new([endpoint.to_owned()]).with_prefix(prefix))
            .await
            .list_allocations()
            .await
            .expect("list allocations")
            .into_iter()
            .filter(|a| !a.handle.ends_with(":gateway"))
            .map(|a| (a.ip.to_string(), a.handle))
            .collect()
    })
}

/// Runs `f` on a thread and fails the test if it has not returned after a generous bound
/// (which only turns a hang into a failure; no duration is asserted).
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(f());
    });
    receiver
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("{what} did not return"))
}

#[test]
fn add_check_del_round_trip_on_etcd() {
    let server = server();
    let prefix = unique_prefix();
    let _guard = PrefixGuard::new(server.config(&prefix));
    let sandbox = Sandbox::new();
    let netconf = etcd_netconf(
        &sandbox,
        "1.0.0",
        &server.endpoint(),
        &prefix,
        json!({"assign_ipv6": "true"}),
    );
    let result = cni("ADD", "c1", "eth0", &netconf, &[]).success_json("ADD");
    assert_eq!(
        addresses(&result),
        vec!["10.244.7.64".to_owned(), "fd00:10:244::c0".to_owned()]
    );
    let again = cni("ADD", "c1", "eth0", &netconf, &[]).success_json("ADD again");
    assert_eq!(again, result);
    assert_eq!(
        container_allocations_on(&server.endpoint(), &prefix).len(),
        2
    );
    let mut check = netconf.clone();
    merge(&mut check, json!({"prevResult": result}));
    cni("CHECK", "c1", "eth0", &check, &[]).assert_silent_success("CHECK");
    cni("DEL", "c1", "eth0", &netconf, &[]).assert_silent_success("DEL");
    cni("DEL", "c1", "eth0", &netconf, &[]).assert_silent_success("DEL again");
    assert!(container_allocations_on(&server.endpoint(), &prefix).is_empty());
    // Nothing went outside the prefix: the default prefix is untouched.
    let default_prefix = container_allocations_on(&server.endpoint(), "/blockipam/");
    assert!(default_prefix.is_empty(), "{default_prefix:?}");
}

/// A Calico netconf names its etcd and no `datastore_type`: the plugin allocates on that etcd (as
/// calico-ipam does), not on a store of each node's own; and a netconf whose type says sled while
/// it names an etcd is refused, with nothing written anywhere.
#[test]
fn etcd_endpoints_without_a_datastore_type_allocate_on_etcd() {
    let server = server();
    let prefix = unique_prefix();
    let _guard = PrefixGuard::new(server.config(&prefix));
    let sandbox = Sandbox::new();
    let mut calico_like = etcd_netconf(&sandbox, "1.0.0", &server.endpoint(), &prefix, json!({}));
    let ipam = calico_like["ipam"].as_object_mut().expect("ipam");
    ipam.remove("datastore_type");
    ipam.remove("datastore_path");
    let result = cni("ADD", "c1", "eth0", &calico_like, &[]).success_json("ADD");
    assert_eq!(addresses(&result), vec!["10.244.7.64".to_owned()]);
    assert_eq!(
        container_allocations_on(&server.endpoint(), &prefix),
        vec![("10.244.7.64".to_owned(), format!("{NETWORK}.c1"))]
    );

    let contradicting = etcd_netconf(
        &sandbox,
        "1.0.0",
        &server.endpoint(),
        &prefix,
        json!({"datastore_type": "sled", "datastore_path": sandbox.store_path()}),
    );
    let message = cni("ADD", "c2", "eth0", &contradicting, &[])
        .assert_error(7, "ADD with sled and etcd_endpoints");
    assert!(message.contains("etcd endpoints"), "{message}");
    assert!(!sandbox.store_path().exists(), "a sled store was created");
    assert_eq!(
        container_allocations_on(&server.endpoint(), &prefix).len(),
        1,
        "the refused ADD wrote to etcd"
    );
    cni("DEL", "c1", "eth0", &calico_like, &[]).assert_silent_success("DEL");
    assert!(container_allocations_on(&server.endpoint(), &prefix).is_empty());
}

#[test]
fn concurrent_adds_on_etcd_from_two_hosts_are_distinct() {
    let server = server();
    let prefix = unique_prefix();
    let _guard = PrefixGuard::new(server.config(&prefix));
    // Two "hosts": separate lock files and node names, one etcd.
    let host_a = Sandbox::new();
    let host_b = Sandbox::new();
    let endpoint = server.endpoint();
    let netconf_a = etcd_netconf(
        &host_a,
        "1.0.0",
        &endpoint,
        &prefix,
        json!({"ipam_lock_timeout_seconds": 120}),
    );
    let netconf_b = etcd_netconf(
        &host_b,
        "1.0.0",
        &endpoint,
        &prefix,
        json!({"ipam_lock_timeout_seconds": 120, "nodename": "node-b"}),
    );
    let handles: Vec<std::thread::JoinHandle<Outcome>> = (0..16)
        .map(|i| {
            let netconf = if i % 2 == 0 {
                netconf_a.clone()
            } else {
                netconf_b.clone()
            };
            std::thread::spawn(move || cni("ADD", &format!("c{i}"), "eth0", &netconf, &[]))
        })
        .collect();
    let mut seen = BTreeSet::new();
    for handle in handles {
        let outcome = handle.join().expect("thread");
        assert!(seen.insert(first_address(&outcome.success_json("ADD"))));
    }
    assert_eq!(container_allocations_on(&endpoint, &prefix).len(), 16);
}

#[test]
fn unreachable_etcd_is_code_11_and_status_is_code_50() {
    // A port nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let sandbox = Sandbox::new();
    let endpoint = format!("http://127.0.0.1:{port}");
    let netconf = etcd_netconf(
        &sandbox,
        "1.1.0",
        &endpoint,
        "/blockipam-test/none/",
        json!({"timeout_seconds": 5}),
    );
    let add = netconf.clone();
    let outcome = bounded("ADD on an unreachable etcd", move || {
        cni("ADD", "c1", "eth0", &add, &[])
    });
    let msg = outcome.assert_error(11, "unreachable etcd");
    assert!(msg.contains("store"), "{msg}");
    let del = netconf.clone();
    let outcome = bounded("DEL on an unreachable etcd", move || {
        cni("DEL", "c1", "eth0", &del, &[])
    });
    outcome.assert_error(11, "DEL, unreachable etcd");
    let status = netconf.clone();
    let outcome = bounded("STATUS on an unreachable etcd", move || {
        cni("STATUS", "", "", &status, &[])
    });
    outcome.assert_error(50, "STATUS, unreachable etcd");
}

#[test]
fn etcd_that_accepts_but_never_answers_hits_the_deadline_with_code_11() {
    // A listener that accepts connections and never says anything, counting them.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (accepted, connections) = mpsc::channel();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            let _ = accepted.send(());
            held.push(stream);
        }
    });
    let sandbox = Sandbox::new();
    let endpoint = format!("http://127.0.0.1:{port}");
    let netconf = etcd_netconf(
        &sandbox,
        "1.0.0",
        &endpoint,
        "/blockipam-test/none/",
        json!({"timeout_seconds": 2}),
    );
    let outcome = bounded("ADD on a silent etcd", move || {
        cni("ADD", "c1", "eth0", &netconf, &[])
    });
    let msg = outcome.assert_error(11, "silent etcd");
    assert!(
        connections.try_recv().is_ok(),
        "the plugin never connected to the silent etcd: {outcome:#?}"
    );
    assert_eq!(
        msg, "ADD did not finish within its deadline of 2s (timeout_seconds)",
        "the call must end at its deadline, not on another failure"
    );
}

/// Bytes a private etcd has sent its clients so far (its `etcd_network_client_grpc_sent_bytes_total`).
fn bytes_sent_by(endpoint: &str) -> u64 {
    etcd_metrics(endpoint)
        .lines()
        .find_map(|line| line.strip_prefix("etcd_network_client_grpc_sent_bytes_total "))
        .and_then(|value| value.trim().parse::<f64>().ok())
        .map(|value| value as u64)
        .unwrap_or_else(|| panic!("no sent-bytes figure in etcd's metrics"))
}

/// The KV requests (reads, transactions) etcd at `endpoint` has answered so far: one per round
/// trip of the store's reads and commits.
fn kv_requests_answered_by(endpoint: &str) -> u64 {
    let text = etcd_metrics(endpoint);
    let counts: Vec<u64> = text
        .lines()
        .filter(|line| {
            line.starts_with("grpc_server_handled_total{")
                && line.contains("grpc_service=\"etcdserverpb.KV\"")
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|value| value as u64)
        .collect();
    assert!(!counts.is_empty(), "no KV request counts in etcd's metrics");
    counts.iter().sum()
}

/// The text of etcd's metrics page.
fn etcd_metrics(endpoint: &str) -> String {
    use std::io::{Read as _, Write as _};
    let address = endpoint.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address).expect("connect to etcd");
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())
        .expect("ask for the metrics");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("read the metrics");
    text
}

/// CNI STATUS runs every few seconds on every node (containerd asks on each runtime status check):
/// on a node whose blocks have room it reads what the node's ADD reads first, and on a node with
/// no block what the ADD's new-block search reads first, as many bytes with 400 blocks of other
/// nodes in the store as without, and so does a node that must borrow (it asks for a small pool
/// whose every block another node holds), with automatic block allocation on or off: the probed
/// claim entries and the first lender's block. A node whose probe finds no lender with room reads
/// the claim index (small entries, which the measure sees) and one lender's block, not every
/// block, and so does a node refused for want of room anywhere; a node at its block limit is
/// refused from its own blocks and its probe; a dual-stack node with room in its IPv4 block only
/// probes for IPv6 alone.
#[test]
fn status_reads_the_claim_index_at_most_not_other_nodes_blocks_whether_it_serves_or_refuses() {
    let server = EtcdServer::start().expect("a private etcd, whose traffic is this test's alone");
    let endpoint = server.endpoint();
    let prefix = unique_prefix();
    let sandbox = Sandbox::new();
    let small_pool = "10.97.0.0/28";
    // A node's netconf, with the pools it asks for (`choice`) merged in.
    let netconf_of = |node: &str, choice: Value| {
        let mut keys = json!({
            "nodename": node,
            "pools": [{"cidr": "10.96.0.0/16", "block_size": 26}],
        });
        merge(&mut keys, choice);
        etcd_netconf(&sandbox, "1.1.0", &endpoint, &prefix, keys)
    };
    let on = |node: &str, requested: &[&str]| netconf_of(node, json!({ "ipv4_pools": requested }));
    cni("ADD", "c1", "eth0", &on("node-a", &[]), &[]).success_json("ADD");
    // The bytes etcd sends for one STATUS of `node`, the mean of four.
    let cost_of = |node: &str, netconf: &Value| {
        let before = bytes_sent_by(&endpoint);
        for _ in 0..4 {
            cni("STATUS", "", "", netconf, &[]).assert_silent_success(node);
        }
        (bytes_sent_by(&endpoint) - before) / 4
    };
    let status_cost = |node: &str, requested: &[&str]| cost_of(node, &on(node, requested));
    let refusal_cost = |node: &str, requested: &[&str], why: &str| {
        let netconf = on(node, requested);
        let before = bytes_sent_by(&endpoint);
        let msg = cni("STATUS", "", "", &netconf, &[]).assert_error(50, node);
        assert!(msg.contains(why), "{msg}");
        bytes_sent_by(&endpoint) - before
    };
    let requests_before = kv_requests_answered_by(&endpoint);
    cni("STATUS", "", "", &on("node-a", &[]), &[]).assert_silent_success("node-a");
    let status_requests = kv_requests_answered_by(&endpoint) - requests_before;
    eprintln!("KV requests etcd answered for one STATUS of a node with room: {status_requests}");
    assert_eq!(status_requests, 1, "one read: the node's blocks with room, the pools, the reservations, the config and the node's labels");
    let with_room_alone = status_cost("node-a", &[]);
    let without_block_alone = status_cost("node-b", &[]);
    // Every other block of the pool (a new node's search probes 16 blocks in a row, so it finds
    // unclaimed ones among them), and every block of a small pool.
    let other_blocks = 400u32;
    block_on(async {
        let ipam = ipam_on(server.config(&prefix)).await;
        let mut claimed = 0;
        for index in (1..1024u32).step_by(2) {
            if claimed == other_blocks {
                break;
            }
            let block: ipnet::IpNet = format!("10.96.{}.{}/26", index / 4, (index % 4) * 64)
                .parse()
                .expect("a block");
            // node-a's own block is passed over.
            if ipam
                .claim_affinity(&format!("node-{index:04}"), block)
                .await
                .is_ok()
            {
                claimed += 1;
            }
        }
        assert_eq!(claimed, other_blocks, "blocks of other nodes");
        ipam.create_pool(&ipam_core::PoolSpec {
            cidr: small_pool.parse().expect("a pool"),
            name: Some("small".into()),
            block_size: Some(30),
            disabled: false,
        })
        .await
        .expect("the small pool");
        for index in 0..4u32 {
            let block: ipnet::IpNet = format!("10.97.0.{}/30", index * 4)
                .parse()
                .expect("a block");
            ipam.claim_affinity(&format!("small-{index}"), block)
                .await
                .expect("a block of the small pool");
        }
    });
    let with_room = status_cost("node-a", &[]);
    let without_block = status_cost("node-b", &[]);
    let borrowing = status_cost("node-c", &[small_pool]);
    // A pool of 32 blocks, every one held by other nodes and full but one, which the probe of
    // the node asking (16 blocks from its hashed start) does not reach: STATUS looks further, in
    // the claim index, as the ADD does.
    let tight_pool = "10.98.0.0/25";
    let looking_node = block_on(async {
        let ipam = ipam_on(server.config(&prefix)).await;
        ipam.create_pool(&ipam_core::PoolSpec {
            cidr: tight_pool.parse().expect("a pool"),
            name: Some("tight".into()),
            block_size: Some(30),
            disabled: false,
        })
        .await
        .expect("the tight pool");
        for index in 0..32u32 {
            let block: ipnet::IpNet = format!("10.98.0.{}/30", index * 4)
                .parse()
                .expect("a block");
            let holder = format!("tight-{index}");
            ipam.claim_affinity(&holder, block)
                .await
                .expect("a block of the tight pool");
            // The last block keeps a host address free (its second).
            let taken = if index == 31 { 3 } else { 4 };
            ipam.assign_ips(&ipam_core::AssignIpsRequest {
                ips: [block.network(), block.broadcast()]
                    .into_iter()
                    .chain(block.hosts())
                    .take(taken)
                    .collect(),
                handle: holder.clone(),
                host: holder,
                ..ipam_core::AssignIpsRequest::default()
            })
            .await
            .expect("fill the block");
        }
        let tight = vec![ipam.get_pool("tight").await.expect("the tight pool")];
        for n in 0.. {
            let node = format!("node-d{n}");
            let prospect = ipam
                .new_block_prospect(&node, &tight, true, false)
                .await
                .expect("a prospect");
            if prospect.lenders.is_empty() {
                return node;
            }
        }
        unreachable!("no node name whose probe misses the one block with room")
    });
    let looking_further = status_cost(&looking_node, &[tight_pool]);
    // What one listing of the claim index costs on the wire: the measure of what that STATUS may
    // read beyond its probe and one lender's block.
    let claim_index_listing = block_on(async {
        use ipam_core::kv::KvStore;
        let store = EtcdStore::connect(server.config(&prefix))
            .await
            .expect("connect");
        let before = bytes_sent_by(&endpoint);
        let entries = store
            .list(&ipam_core::model::keys::claims_dir())
            .await
            .expect("the claim index");
        assert!(entries.len() > other_blocks as usize, "{}", entries.len());
        bytes_sent_by(&endpoint) - before
    });
    // A node at its block limit whose blocks are full: refused (its ADD fails before it would
    // borrow) from its own blocks and its probe.
    let limit = block_on(async {
        let ipam = ipam_on(server.config(&prefix)).await;
        let before = ipam
            .get_config()
            .await
            .expect("the config")
            .max_blocks_per_host;
        ipam.update_config(|config| config.max_blocks_per_host = 1)
            .await
            .expect("a block limit of one");
        before
    });
    let at_its_limit = refusal_cost("tight-0", &[tight_pool], "per-node block limit is 1");
    block_on(async {
        let ipam = ipam_on(server.config(&prefix)).await;
        ipam.update_config(|config| config.max_blocks_per_host = limit)
            .await
            .expect("the block limit as it was");
    });
    // A dual-stack node whose own IPv4 block has room and which has no IPv6 block yet, its IPv4
    // pool otherwise full: STATUS answers IPv4 from that block and probes only for IPv6, never
    // the IPv4 pool's lenders, the claim index or every block.
    block_on(async {
        let ipam = ipam_on(server.config(&prefix)).await;
        for (cidr, name, block_size) in [
            ("10.99.0.0/29", "snug", 30),
            ("fd00:99::/116", "snug-v6", 122),
        ] {
            ipam.create_pool(&ipam_core::PoolSpec {
                cidr: cidr.parse().expect("a pool"),
                name: Some(name.into()),
                block_size: Some(block_size),
                disabled: false,
            })
            .await
            .expect("a pool of the dual-stack node");
        }
        let [own, other]: [ipnet::IpNet; 2] =
            ["10.99.0.0/30", "10.99.0.4/30"].map(|b| b.parse().expect("a block"));
        ipam.claim_affinity("snug-a", own).await.expect("its block");
        ipam.claim_affinity("snug-b", other)
            .await
            .expect("the other block");
        ipam.assign_ips(&ipam_core::AssignIpsRequest {
            ips: [other.network(), other.broadcast()]
                .into_iter()
                .chain(other.hosts())
                .collect(),
            handle: "snug-b".into(),
            host: "snug-b".into(),
            ..ipam_core::AssignIpsRequest::default()
        })
        .await
        .expect("fill the other block");
    });
    let dual_stack = netconf_of(
        "snug-a",
        json!({"ipv4_pools": ["snug"], "assign_ipv6": true, "ipv6_pools": ["snug-v6"]}),
    );
    let dual_stack_cost = cost_of("snug-a", &dual_stack);
    let added = cni("ADD", "snug-1", "eth0", &dual_stack, &[]).success_json("snug-1");
    let addresses: Vec<&str> = added["ips"]
        .as_array()
        .expect("ips")
        .iter()
        .filter_map(|ip| ip["address"].as_str())
        .collect();
    assert!(
        addresses.len() == 2
            && addresses[0].starts_with("10.99.0.")
            && addresses[1].starts_with("fd00:99::"),
        "as STATUS said, the ADD gets an address of each pool: {added}"
    );
    // With automatic block allocation off, the ADD borrows at once: STATUS reads what its probe
    // would, and the first lender's block.
    block_on(async {
        let ipam = ipam_on(server.config(&prefix)).await;
        ipam.update_config(|config| config.auto_allocate_blocks = false)
            .await
            .expect("automatic block allocation off");
    });
    let borrowing_at_once = status_cost("node-c", &[small_pool]);
    // As that STATUS said, the node's ADD borrows the tight pool's last free address, found past
    // its probe; then there is no room anywhere, STATUS says so from the claim index, and the
    // next ADD fails.
    let looking = on(&looking_node, &[tight_pool]);
    let added = cni("ADD", "looking-1", "eth0", &looking, &[]).success_json("looking-1");
    assert_eq!(added["ips"][0]["address"], "10.98.0.126/30", "{added}");
    let no_room_anywhere = refusal_cost(&looking_node, &[tight_pool], "no free address");
    let refused = cni("ADD", "looking-2", "eth0", &looking, &[]);
    assert_ne!(
        refused.status, 0,
        "STATUS refused, the ADD succeeded: {}",
        refused.stdout
    );
    eprintln!(
        "bytes etcd sent per STATUS alone, then beside {other_blocks} blocks of other nodes: \
         node-a (room) {with_room_alone}, {with_room}; node-b (no block) \
         {without_block_alone}, {without_block}; node-c (must borrow) {borrowing}, with \
         automatic block allocation off {borrowing_at_once}; {looking_node} (no probed lender \
         with room) {looking_further} (the claim index listed alone {claim_index_listing}); \
         tight-0 at its block limit {at_its_limit}; {looking_node} refused, no room anywhere \
         {no_room_anywhere}; snug-a (dual-stack, room in its IPv4 block only) \
         {dual_stack_cost}"
    );
    assert!(
        with_room <= with_room_alone + 512,
        "a STATUS of node-a read {with_room_alone} bytes alone, {with_room} beside \
         {other_blocks} blocks of other nodes"
    );
    // The search reads the claim entries of the blocks it probes: some of them are now taken.
    assert!(
        without_block <= without_block_alone + 2048,
        "a STATUS of node-b read {without_block_alone} bytes alone, {without_block} beside \
         {other_blocks} blocks of other nodes"
    );
    // The probed claim entries of the small pool, all taken, and the first lender's block.
    for (what, borrowed) in [
        ("", borrowing),
        (" with automatic block allocation off", borrowing_at_once),
    ] {
        assert!(
            borrowed <= without_block_alone + 2048,
            "a STATUS of node-c, which must borrow{what}, read {borrowed} bytes, node-b's alone \
             {without_block_alone}, beside {other_blocks} blocks of other nodes"
        );
    }
    assert!(
        dual_stack_cost <= without_block_alone + 2048,
        "a STATUS of snug-a, dual-stack with room in its IPv4 block only, read \
         {dual_stack_cost} bytes, node-b's alone {without_block_alone}, beside {other_blocks} \
         blocks of other nodes"
    );
    assert!(
        at_its_limit <= without_block_alone + 2048,
        "a refused STATUS of tight-0, at its block limit, read {at_its_limit} bytes, node-b's \
         alone {without_block_alone}, beside {other_blocks} blocks of other nodes"
    );
    // The claim index (an entry for every block, which the measure sees) beside what a node
    // without a block reads, and one block: no other block.
    assert!(
        claim_index_listing >= u64::from(other_blocks) * 40,
        "the claim index listed alone: {claim_index_listing} bytes"
    );
    assert!(
        looking_further <= without_block + claim_index_listing + 2048,
        "a STATUS of {looking_node}, whose probe finds no lender with room, read \
         {looking_further} bytes; the claim index listed alone {claim_index_listing}"
    );
    assert!(
        no_room_anywhere <= without_block + claim_index_listing + 2048,
        "a STATUS of {looking_node} refused for want of room anywhere read {no_room_anywhere} \
         bytes; the claim index listed alone {claim_index_listing}"
    );
}
