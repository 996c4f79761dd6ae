//! What the plugin does with addresses, beyond the protocol.
//!
//! What the plugin does with addresses: idempotent ADD per attachment, several interfaces per
//! container, specific addresses, recorded attributes, reservations, result shaping, DEL of
//! Calico's legacy handle, GC and the in-process entry point.

use crate::common;

use std::collections::BTreeMap;

use blockipam_store::DatastoreType;
use common::*;
use ipam_core::AssignIpsRequest;
use serde_json::json;

#[test]
fn in_process_run_gives_the_same_result_as_the_binary() {
    let binary = Sandbox::new();
    let in_process = Sandbox::new();
    let a = cni(
        "ADD",
        "c1",
        "eth0",
        &binary.netconf("1.0.0", json!({})),
        &[],
    );
    let b = cni_in_process(
        "ADD",
        "c1",
        "eth0",
        &in_process.netconf("1.0.0", json!({})),
        &[],
    );
    assert_eq!(a.success_json("binary"), b.success_json("in process"));
    let bad = cni_in_process("ADD", "c1", "eth0", &json!({"cniVersion": "1.0.0"}), &[]);
    assert_eq!(bad.assert_error(7, "in process"), "missing network name");
}

#[test]
fn repeated_add_for_one_attachment_returns_its_addresses_without_allocating_more() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({"assign_ipv6": "true"}));
    let first = cni_in_process("ADD", "c1", "eth0", &netconf, &[]).success_json("first");
    for _ in 0..3 {
        let again = cni_in_process("ADD", "c1", "eth0", &netconf, &[]).success_json("again");
        assert_eq!(again, first);
    }
    assert_eq!(sandbox.container_allocations().len(), 2);
}

#[test]
fn second_interface_gets_its_own_addresses_and_del_releases_only_that_interface() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let eth0 =
        first_address(&cni_in_process("ADD", "c1", "eth0", &netconf, &[]).success_json("eth0"));
    let eth1 =
        first_address(&cni_in_process("ADD", "c1", "eth1", &netconf, &[]).success_json("eth1"));
    assert_ne!(eth0, eth1);
    // Retrying either returns its own address.
    let again = cni_in_process("ADD", "c1", "eth1", &netconf, &[]).success_json("eth1 again");
    assert_eq!(first_address(&again), eth1);
    let held: BTreeMap<String, String> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(ip, handle, attrs)| {
            assert_eq!(handle, "testnet.c1");
            (attrs["interface"].clone(), ip)
        })
        .collect();
    assert_eq!(
        held,
        BTreeMap::from([("eth0".into(), eth0.clone()), ("eth1".into(), eth1)])
    );
    cni_in_process("DEL", "c1", "eth1", &netconf, &[]).assert_silent_success("DEL eth1");
    let left: Vec<String> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(ip, _, _)| ip)
        .collect();
    assert_eq!(left, vec![eth0]);
    cni_in_process("DEL", "c1", "eth1", &netconf, &[]).assert_silent_success("DEL eth1 again");
    cni_in_process("DEL", "c1", "eth0", &netconf, &[]).assert_silent_success("DEL eth0");
    assert!(sandbox.container_allocations().is_empty());
}

#[test]
fn attributes_record_network_node_namespace_pod_container_interface_and_timestamp() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({}));
    cni(
        "ADD",
        "c1",
        "net1",
        &netconf,
        &[("CNI_ARGS", "K8S_POD_NAMESPACE=web;K8S_POD_NAME=frontend-0;K8S_POD_INFRA_CONTAINER_ID=c1;K8S_POD_UID=u-1")],
    )
    .success_json("ADD");
    let allocations = sandbox.container_allocations();
    assert_eq!(allocations.len(), 1);
    let (_, handle, attrs) = &allocations[0];
    assert_eq!(handle, "testnet.c1");
    assert_eq!(attrs["node"], NODE);
    assert_eq!(attrs["namespace"], "web");
    assert_eq!(attrs["pod"], "frontend-0");
    assert_eq!(attrs["container_id"], "c1");
    assert_eq!(attrs["interface"], "net1");
    assert_eq!(attrs["network"], NETWORK);
    let stamp = &attrs["timestamp"];
    assert_eq!(stamp.len(), 20, "{stamp}");
    assert!(
        stamp.ends_with('Z') && stamp.as_bytes()[10] == b'T',
        "{stamp}"
    );
}

#[test]
fn specific_addresses_come_from_cni_args_args_and_runtime_config() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let result = cni(
        "ADD",
        "c1",
        "eth0",
        &netconf,
        &[("CNI_ARGS", "IgnoreUnknown=1;IP=10.244.7.20,fd00:10:244::20")],
    )
    .success_json("IP=");
    assert_eq!(
        addresses(&result),
        vec!["10.244.7.20".to_owned(), "fd00:10:244::20".to_owned()]
    );
    let mut with_args = netconf.clone();
    merge(
        &mut with_args,
        json!({"args": {"cni": {"ips": ["10.244.7.21/24"]}}}),
    );
    let result = cni("ADD", "c2", "eth0", &with_args, &[]).success_json("args.cni.ips");
    assert_eq!(addresses(&result), vec!["10.244.7.21".to_owned()]);
    let mut with_runtime = netconf.clone();
    merge(
        &mut with_runtime,
        json!({"runtimeConfig": {"ips": ["10.244.7.22/24"]}}),
    );
    let result = cni("ADD", "c3", "eth0", &with_runtime, &[]).success_json("runtimeConfig.ips");
    assert_eq!(addresses(&result), vec!["10.244.7.22".to_owned()]);
    // Retrying a specific-address ADD is idempotent too.
    let again = cni("ADD", "c3", "eth0", &with_runtime, &[]).success_json("again");
    assert_eq!(addresses(&again), vec!["10.244.7.22".to_owned()]);
    assert_eq!(sandbox.container_allocations().len(), 4);
    // A specific address records its attachment as an auto-assigned one does: the per-interface
    // DEL, GC and the leak collection tell attachments apart by it.
    for (ip, handle, attrs) in sandbox.container_allocations() {
        let container = handle
            .strip_prefix("testnet.")
            .expect("the network's handle");
        for (key, value) in [
            ("container_id", container),
            ("interface", "eth0"),
            ("network", NETWORK),
            ("node", NODE),
        ] {
            assert_eq!(
                attrs.get(key).map(String::as_str),
                Some(value),
                "{ip}: {key} not recorded: {attrs:?}"
            );
        }
    }
}

/// A specific address in a pool that allows tunnel addresses only is refused (code 105, naming
/// the pool), as an auto-assigned one would be, and nothing is allocated.
#[test]
fn a_specific_address_in_a_pool_for_tunnels_only_is_refused() {
    use ipam_core::{AllowedUse, AllowedUses, PoolPolicy, PoolSpec};
    let sandbox = Sandbox::new();
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        let tunnels = PoolSpec {
            cidr: "10.244.11.0/28".parse().expect("a CIDR"),
            name: Some("tunnels".into()),
            block_size: Some(30),
            disabled: false,
        };
        let policy = PoolPolicy {
            allowed_uses: AllowedUses::new([AllowedUse::Tunnel]).expect("uses"),
            ..PoolPolicy::default()
        };
        ipam.create_pool_with_policy(&tunnels, &policy)
            .await
            .expect("a pool");
    });
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let message = cni(
        "ADD",
        "c1",
        "eth0",
        &netconf,
        &[("CNI_ARGS", "IP=10.244.11.5")],
    )
    .assert_error(105, "a tunnel pool's address");
    assert!(
        message.contains("\"tunnels\" does not allow workload addresses"),
        "{message}"
    );
    assert!(sandbox.container_allocations().is_empty());
}

#[test]
fn gateway_network_and_broadcast_addresses_are_reserved_once_and_never_handed_out() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf(
        "1.0.0",
        json!({"pools": [{"cidr": "10.244.9.0/28", "block_size": 28}], "gateway": "10.244.9.1"}),
    );
    let mut given = Vec::new();
    for i in 0..13 {
        let result =
            cni_in_process("ADD", &format!("c{i}"), "eth0", &netconf, &[]).success_json("ADD");
        assert_eq!(result["ips"][0]["gateway"], json!("10.244.9.1"));
        assert!(result["ips"][0]["address"]
            .as_str()
            .expect("address")
            .ends_with("/28"));
        given.push(first_address(&result));
    }
    for reserved in ["10.244.9.0", "10.244.9.1", "10.244.9.15"] {
        assert!(
            !given.contains(&reserved.to_owned()),
            "{reserved} was handed out"
        );
    }
    let distinct: std::collections::BTreeSet<&String> = given.iter().collect();
    assert_eq!(distinct.len(), 13);
    cni_in_process("ADD", "c13", "eth0", &netconf, &[]).assert_error(100, "pool full");
    let reservations: Vec<String> = sandbox
        .allocations()
        .into_iter()
        .filter(|(_, handle, _)| handle == "testnet:gateway")
        .map(|(ip, _, attrs)| {
            assert_eq!(attrs["node"], "-");
            ip
        })
        .collect();
    assert_eq!(
        reservations,
        vec!["10.244.9.0", "10.244.9.1", "10.244.9.15"]
    );
}

#[test]
fn without_a_gateway_addresses_carry_their_block_prefix_are_host_addresses_of_it_and_get_no_route()
{
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({"gateway": null}));
    let result = cni("ADD", "c1", "eth0", &netconf, &[]).success_json("ADD");
    // The node's block is 10.244.7.192/26: its network address .192 is never handed out.
    assert_eq!(
        result,
        json!({"cniVersion": "1.0.0", "ips": [{"address": "10.244.7.193/26"}], "dns": {}})
    );
    assert!(sandbox
        .allocations()
        .iter()
        .all(|(_, h, _)| h != "testnet:gateway"));
}

#[test]
fn configured_routes_replace_the_block_routes() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf(
        "0.3.1",
        json!({"routes": [{"dst": "0.0.0.0/0"}, {"dst": "192.168.0.0/16", "gw": "10.244.7.254"}]}),
    );
    let result = cni("ADD", "c1", "eth0", &netconf, &[]).success_json("ADD");
    assert_eq!(
        result["routes"],
        json!([{"dst": "0.0.0.0/0"}, {"dst": "192.168.0.0/16", "gw": "10.244.7.254"}])
    );
}

#[test]
fn ipv6_only_and_pool_selection_follow_calicos_flags() {
    let sandbox = Sandbox::new();
    let v6_only = sandbox.netconf(
        "1.0.0",
        json!({"assign_ipv4": "false", "assign_ipv6": "true"}),
    );
    let result = cni("ADD", "c1", "eth0", &v6_only, &[]).success_json("v6 only");
    assert_eq!(addresses(&result), vec!["fd00:10:244::c0".to_owned()]);
    let chosen = sandbox.netconf(
        "1.0.0",
        json!({
            "pools": [
                {"cidr": "10.244.7.0/24", "block_size": 26, "name": "test-v4"},
                {"cidr": "10.244.8.0/24", "block_size": 26, "name": "second"}
            ],
            "gateway": null,
            "ipv4_pools": ["second"]
        }),
    );
    let result = cni("ADD", "c2", "eth0", &chosen, &[]).success_json("named pool");
    assert!(first_address(&result).starts_with("10.244.8."), "{result}");
    let by_cidr = sandbox.netconf(
        "1.0.0",
        json!({"gateway": null, "ipv4_pools": ["10.244.7.0/24"]}),
    );
    let result = cni("ADD", "c3", "eth0", &by_cidr, &[]).success_json("pool by CIDR");
    assert!(first_address(&result).starts_with("10.244.7."), "{result}");
}

#[test]
fn nodename_comes_from_netconf_then_node_name_file_then_host_name() {
    let sandbox = Sandbox::new();
    let file = sandbox.dir.path().join("nodename");
    std::fs::write(&file, "node-from-file\n").expect("write");
    let top_level = {
        let mut netconf = sandbox.netconf("1.0.0", json!({"nodename": null}));
        merge(&mut netconf, json!({"nodename": "node-top"}));
        netconf
    };
    let ipam_wins = {
        let mut netconf = sandbox.netconf("1.0.0", json!({"nodename": "node-inner"}));
        merge(&mut netconf, json!({"nodename": "node-top"}));
        netconf
    };
    let from_file = sandbox.netconf("1.0.0", json!({"nodename": null, "nodename_file": file}));
    let from_host = sandbox.netconf(
        "1.0.0",
        json!({"nodename": null, "nodename_file": sandbox.dir.path().join("missing")}),
    );
    for (container, netconf) in [
        ("a", &top_level),
        ("b", &ipam_wins),
        ("c", &from_file),
        ("d", &from_host),
    ] {
        cni("ADD", container, "eth0", netconf, &[]).success_json(container);
    }
    let nodes: BTreeMap<String, String> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(_, _, attrs)| (attrs["container_id"].clone(), attrs["node"].clone()))
        .collect();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .expect("host name")
        .trim()
        .to_ascii_lowercase();
    assert_eq!(nodes["a"], "node-top");
    assert_eq!(nodes["b"], "node-inner");
    assert_eq!(nodes["c"], "node-from-file");
    assert_eq!(nodes["d"], host);
}

#[test]
fn add_for_the_reservations_pseudo_node_is_refused_and_del_still_releases_what_was_allocated_there()
{
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({}));
    cni("ADD", "prime", "eth0", &netconf, &[]).success_json("prime");
    // What an earlier release, which took "-" for a node, allocated under it.
    seed(
        &sandbox,
        "10.244.7.100",
        &format!("{NETWORK}.old"),
        "-",
        &[
            ("network", NETWORK),
            ("container_id", "old"),
            ("interface", "eth0"),
            ("node", "-"),
        ],
    );
    let file = sandbox.dir.path().join("nodename");
    std::fs::write(&file, "-\n").expect("write the node-name file");
    let named = sandbox.netconf("1.0.0", json!({"nodename": "-"}));
    let from_file = sandbox.netconf("1.0.0", json!({"nodename": null, "nodename_file": file}));
    let before = sandbox.snapshot();
    for (what, conf) in [("nodename", &named), ("nodename_file", &from_file)] {
        let msg = cni("ADD", "c1", "eth0", conf, &[]).assert_error(7, what);
        assert!(msg.contains("pseudo-node"), "{what}: {msg}");
        assert_eq!(
            sandbox.snapshot(),
            before,
            "a refused ADD ({what}) changed the store"
        );
    }
    assert_eq!(held_by(&sandbox, "testnet.old"), vec!["10.244.7.100"]);
    cni("DEL", "old", "eth0", &named, &[]).assert_silent_success("DEL under \"-\"");
    assert!(
        held_by(&sandbox, "testnet.old").is_empty(),
        "DEL under \"-\" must release what was allocated there"
    );
}

#[test]
fn del_releases_calicos_legacy_namespace_pod_handle_when_the_main_one_is_unknown() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({}));
    cni("ADD", "prime", "eth0", &netconf, &[]).success_json("prime");
    seed(&sandbox, "10.244.7.100", "web.frontend-0", NODE, &[]);
    let args = [("CNI_ARGS", "K8S_POD_NAMESPACE=web;K8S_POD_NAME=frontend-0")];
    let del = cni("DEL", "old", "eth0", &netconf, &args);
    del.assert_silent_success("DEL legacy");
    assert!(
        del.stderr
            .lines()
            .any(|line| line.contains("released the legacy handle")
                && line.contains("handle=web.frontend-0")
                && line.contains("10.244.7.100")),
        "{del:#?}"
    );
    let left: Vec<String> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(_, handle, _)| handle)
        .collect();
    assert_eq!(left, vec!["testnet.prime"]);
}

#[test]
fn gc_releases_only_stale_attachments_of_this_network_made_on_this_node() {
    let sandbox = Sandbox::new();
    let here = sandbox.netconf("1.1.0", json!({}));
    let elsewhere = sandbox.netconf("1.1.0", json!({"nodename": "node-b"}));
    let mut other_network = here.clone();
    merge(&mut other_network, json!({"name": "othernet"}));
    cni_in_process("ADD", "keep", "eth0", &here, &[]).success_json("keep");
    cni_in_process("ADD", "keep", "eth1", &here, &[]).success_json("keep eth1");
    cni_in_process("ADD", "stale", "eth0", &here, &[]).success_json("stale");
    cni_in_process("ADD", "remote", "eth0", &elsewhere, &[]).success_json("remote");
    cni_in_process("ADD", "stale", "eth0", &other_network, &[]).success_json("other network");
    let mut gc = here.clone();
    merge(
        &mut gc,
        json!({"cni.dev/valid-attachments": [{"containerID": "keep", "ifname": "eth0"}]}),
    );
    cni("GC", "", "", &gc, &[]).assert_silent_success("GC");
    let mut left: Vec<(String, String)> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(_, handle, attrs)| (handle, attrs["interface"].clone()))
        .collect();
    left.sort();
    assert_eq!(
        left,
        vec![
            ("othernet.stale".to_owned(), "eth0".to_owned()),
            ("testnet.keep".to_owned(), "eth0".to_owned()),
            ("testnet.remote".to_owned(), "eth0".to_owned()),
        ]
    );
    // The reservations survive any GC.
    assert_eq!(
        sandbox
            .allocations()
            .iter()
            .filter(|(_, h, _)| h == "testnet:gateway")
            .count(),
        5
    );
}

#[test]
fn gc_accepts_the_older_attachments_key_and_an_empty_list_clears_this_node() {
    let sandbox = Sandbox::new();
    let here = sandbox.netconf("1.1.0", json!({}));
    let elsewhere = sandbox.netconf("1.1.0", json!({"nodename": "node-b"}));
    cni_in_process("ADD", "a", "eth0", &here, &[]).success_json("a");
    cni_in_process("ADD", "b", "eth0", &here, &[]).success_json("b");
    cni_in_process("ADD", "r", "eth0", &elsewhere, &[]).success_json("r");
    let mut gc = here.clone();
    merge(
        &mut gc,
        json!({"cni.dev/attachments": [{"containerID": "b", "ifname": "eth0"}]}),
    );
    cni("GC", "", "", &gc, &[]).assert_silent_success("GC, older key");
    let handles = |s: &Sandbox| -> Vec<String> {
        let mut h: Vec<String> = s
            .container_allocations()
            .into_iter()
            .map(|(_, h, _)| h)
            .collect();
        h.sort();
        h
    };
    assert_eq!(handles(&sandbox), vec!["testnet.b", "testnet.r"]);
    let mut gc = here.clone();
    merge(&mut gc, json!({"cni.dev/valid-attachments": []}));
    cni("GC", "", "", &gc, &[]).assert_silent_success("GC, empty list");
    assert_eq!(handles(&sandbox), vec!["testnet.r"]);
}

/// Allocations that record no network (made by an older release, or imported from Calico) are
/// told apart by their handle: GC collects the one on this network's handle and leaves another
/// network's, whose attachments this GC knows nothing of.
#[test]
fn gc_tells_allocations_recording_no_network_apart_by_their_handle() {
    let sandbox = Sandbox::new();
    let here = sandbox.netconf("1.1.0", json!({}));
    cni("ADD", "prime", "eth0", &here, &[]).success_json("prime");
    let no_network = [("node", NODE), ("container_id", "old")];
    let this_network = format!("{NETWORK}.old");
    seed(&sandbox, "10.244.7.100", &this_network, NODE, &no_network);
    seed(&sandbox, "10.244.7.101", "othernet.old", NODE, &no_network);
    let mut gc = here.clone();
    merge(
        &mut gc,
        json!({"cni.dev/valid-attachments": [{"containerID": "prime", "ifname": "eth0"}]}),
    );
    cni("GC", "", "", &gc, &[]).assert_silent_success("GC");
    assert!(
        held_by(&sandbox, &this_network).is_empty(),
        "this network's stale allocation was left"
    );
    assert_eq!(
        held_by(&sandbox, "othernet.old"),
        vec!["10.244.7.101"],
        "another network's allocation was collected"
    );
    assert_eq!(held_by(&sandbox, &format!("{NETWORK}.prime")).len(), 1);
}

#[test]
fn redb_store_serves_add_check_del_like_sled() {
    let sandbox = Sandbox::with_store(DatastoreType::Redb);
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let result = cni("ADD", "c1", "eth0", &netconf, &[]).success_json("ADD");
    assert_eq!(first_address(&result), "10.244.7.64");
    assert!(sandbox.store_path().is_file());
    let mut check = netconf.clone();
    merge(&mut check, json!({"prevResult": result}));
    cni("CHECK", "c1", "eth0", &check, &[]).assert_silent_success("CHECK");
    cni("DEL", "c1", "eth0", &netconf, &[]).assert_silent_success("DEL");
    assert!(sandbox.container_allocations().is_empty());
}

/// Records `ip` for `handle` on `host` with `attributes` through the allocator's API, as other
/// tools and earlier releases made allocations.
fn seed(sandbox: &Sandbox, ip: &str, handle: &str, host: &str, attributes: &[(&str, &str)]) {
    sandbox.with_ipam(async |ipam| {
        ipam.assign_ips(&AssignIpsRequest {
            ips: vec![ip.parse().expect("ip")],
            handle: handle.to_owned(),
            host: host.to_owned(),
            attributes: attributes
                .iter()
                .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
                .collect(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("seeding {ip} for {handle} on {host}: {e}"));
    });
}

/// Records `ip` for `container` on [`NETWORK`] without an `interface` attribute, as allocations
/// made through the allocator's API or by other tools are.
fn seed_unlabelled(sandbox: &Sandbox, container: &str, ip: &str) {
    let handle = format!("{NETWORK}.{container}");
    seed(
        sandbox,
        ip,
        &handle,
        NODE,
        &[("network", NETWORK), ("container_id", container)],
    );
}

/// The addresses `handle` holds, sorted.
fn held_by(sandbox: &Sandbox, handle: &str) -> Vec<String> {
    let mut held: Vec<String> = sandbox
        .allocations()
        .into_iter()
        .filter(|(_, h, _)| h == handle)
        .map(|(ip, _, _)| ip)
        .collect();
    held.sort();
    held
}

#[test]
fn del_of_one_interface_never_releases_an_unlabelled_allocation_it_cannot_prove_is_its_own() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({}));
    cni("ADD", "prime", "eth0", &netconf, &[]).success_json("prime");
    // eth0's live address, recorded without an interface.
    seed_unlabelled(&sandbox, "c1", "10.244.7.100");
    let net1 = first_address(&cni("ADD", "c1", "net1", &netconf, &[]).success_json("ADD net1"));
    assert_ne!(net1, "10.244.7.100");
    // A Multus hot-unplug of net1.
    cni("DEL", "c1", "net1", &netconf, &[]).assert_silent_success("DEL net1");
    assert_eq!(
        held_by(&sandbox, "testnet.c1"),
        vec!["10.244.7.100"],
        "DEL net1 must release net1's address and only it"
    );
    // Nothing labelled left on the handle: still not net2's to release.
    cni("DEL", "c1", "net2", &netconf, &[]).assert_silent_success("DEL net2");
    assert_eq!(held_by(&sandbox, "testnet.c1"), vec!["10.244.7.100"]);
    // It is the conventional first interface's: a retried ADD for eth0 returns it, DEL eth0
    // releases it.
    let again = cni("ADD", "c1", "eth0", &netconf, &[]).success_json("ADD eth0");
    assert_eq!(addresses(&again), vec!["10.244.7.100".to_owned()]);
    assert_eq!(held_by(&sandbox, "testnet.c1"), vec!["10.244.7.100"]);
    cni("DEL", "c1", "eth0", &netconf, &[]).assert_silent_success("DEL eth0");
    assert!(held_by(&sandbox, "testnet.c1").is_empty());
}

#[test]
fn unlabelled_allocation_beside_labelled_ones_is_no_single_interfaces_to_release() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let eth0 = first_address(&cni("ADD", "c1", "eth0", &netconf, &[]).success_json("eth0"));
    seed_unlabelled(&sandbox, "c1", "10.244.7.100");
    let del = cni("DEL", "c1", "eth0", &netconf, &[]);
    del.assert_silent_success("DEL eth0");
    // The operator is told what was left, and why.
    assert!(
        del.stderr.lines().any(
            |line| line.contains("left allocations that record no interface")
                && line.contains("unproven=[10.244.7.100]")
        ),
        "{del:#?}"
    );
    assert_eq!(
        held_by(&sandbox, "testnet.c1"),
        vec!["10.244.7.100"],
        "DEL eth0 released {eth0} and must leave the address it cannot prove is its own"
    );
}

#[test]
fn second_interface_asking_for_the_first_interfaces_address_is_code_102() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let eth0 = first_address(&cni("ADD", "c1", "eth0", &netconf, &[]).success_json("eth0"));
    let mut asking = netconf.clone();
    merge(
        &mut asking,
        json!({"runtimeConfig": {"ips": [format!("{eth0}/24")]}}),
    );
    let before = sandbox.snapshot();
    let msg = cni("ADD", "c1", "net1", &asking, &[]).assert_error(102, "net1 asks for eth0's");
    assert!(msg.contains(&eth0) && msg.contains("eth0"), "{msg}");
    let args = format!("IP={eth0}");
    let msg = cni("ADD", "c1", "net1", &netconf, &[("CNI_ARGS", &args)])
        .assert_error(102, "net1 asks for eth0's through CNI_ARGS");
    assert!(msg.contains(&eth0), "{msg}");
    assert_eq!(
        sandbox.snapshot(),
        before,
        "a refused ADD changed the store"
    );
    // The attachment that holds it may ask again: idempotent.
    let again = cni("ADD", "c1", "eth0", &asking, &[]).success_json("eth0 asks for its own");
    assert_eq!(addresses(&again), vec![eth0]);
    assert_eq!(sandbox.container_allocations().len(), 1);
}

#[test]
fn cni_args_ip_is_ignored_when_args_cni_ips_is_present() {
    let sandbox = Sandbox::new();
    let mut netconf = sandbox.netconf("1.0.0", json!({"log_level": "debug"}));
    merge(
        &mut netconf,
        json!({"args": {"cni": {"ips": ["10.244.7.21/24"]}}}),
    );
    let outcome = cni(
        "ADD",
        "c1",
        "eth0",
        &netconf,
        &[("CNI_ARGS", "IgnoreUnknown=1;IP=10.244.7.20")],
    );
    let result = outcome.success_json("ADD with both");
    assert_eq!(addresses(&result), vec!["10.244.7.21".to_owned()]);
    assert!(
        outcome.stderr.contains("CNI_ARGS IP is ignored"),
        "no debug line says why IP= was ignored: {outcome:#?}"
    );
    // An empty args.cni.ips is present too: nothing specific asked for, one address assigned.
    let mut empty = sandbox.netconf("1.0.0", json!({}));
    merge(&mut empty, json!({"args": {"cni": {"ips": []}}}));
    let result = cni(
        "ADD",
        "c2",
        "eth0",
        &empty,
        &[("CNI_ARGS", "IP=10.244.7.22")],
    )
    .success_json("ADD, empty args.cni.ips");
    assert_ne!(addresses(&result), vec!["10.244.7.22".to_owned()]);
    let held: Vec<String> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(ip, _, _)| ip)
        .collect();
    assert!(
        !held.contains(&"10.244.7.20".to_owned()) && !held.contains(&"10.244.7.22".to_owned()),
        "{held:?}"
    );
}

#[test]
fn with_the_gateway_in_the_pool_no_route_covers_part_of_the_on_link_subnet() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf("1.0.0", json!({"assign_ipv6": "true"}));
    let result = cni("ADD", "c1", "eth0", &netconf, &[]).success_json("ADD");
    assert_eq!(
        result,
        json!({
            "cniVersion": "1.0.0",
            "ips": [
                {"address": "10.244.7.64/24", "gateway": "10.244.7.1"},
                {"address": "fd00:10:244::c0/120", "gateway": "fd00:10:244::1"}
            ],
            "dns": {}
        }),
        "a route for the address's block via the gateway sends same-subnet traffic through the host"
    );
}

#[test]
fn reservations_in_a_nodes_block_under_strict_affinity_never_make_add_fail() {
    let sandbox = Sandbox::new();
    // The pools exist, without reservations yet; node-a owns the blocks holding the pool's
    // network address and gateway (10.244.7.0/26) and its broadcast address (10.244.7.192/26).
    let no_gateway = sandbox.netconf("1.0.0", json!({"gateway": null}));
    cni("ADD", "first", "eth0", &no_gateway, &[]).success_json("ADD without gateway");
    sandbox.with_ipam(async |ipam| {
        for block in ["10.244.7.0/26", "10.244.7.192/26"] {
            ipam.claim_affinity(NODE, block.parse().expect("block"))
                .await
                .expect("claim");
        }
        ipam.set_config(&ipam_core::IpamConfig {
            strict_affinity: true,
            ..ipam_core::IpamConfig::default()
        })
        .await
        .expect("strict affinity");
    });
    // Now the gateway is configured: every ADD, from any node, reserves and succeeds.
    for (node, container) in [
        (NODE, "a1"),
        ("node-b", "b1"),
        (NODE, "a2"),
        ("node-b", "b2"),
    ] {
        let netconf = sandbox.netconf("1.0.0", json!({"nodename": node}));
        let result = cni("ADD", container, "eth0", &netconf, &[]).success_json(container);
        let address = first_address(&result);
        assert!(
            !["10.244.7.0", "10.244.7.1", "10.244.7.255"].contains(&address.as_str()),
            "{container} got the reserved {address}"
        );
    }
    let mut reserved = held_by(&sandbox, "testnet:gateway");
    reserved.retain(|ip| ip.starts_with("10."));
    assert_eq!(reserved, vec!["10.244.7.0", "10.244.7.1", "10.244.7.255"]);
}

#[test]
fn without_a_gateway_every_address_is_a_host_address_of_its_prefix_until_the_pool_is_exhausted() {
    let sandbox = Sandbox::new();
    // Two /29 blocks, each reported as its own /29: six host addresses each.
    let netconf = sandbox.netconf(
        "1.0.0",
        json!({"pools": [{"cidr": "10.47.0.0/28", "block_size": 29}], "gateway": null}),
    );
    let mut given = std::collections::BTreeSet::new();
    for i in 0..=16 {
        let outcome = cni("ADD", &format!("c{i}"), "eth0", &netconf, &[]);
        if outcome.status != 0 {
            let msg = outcome.assert_error(100, "the pool is exhausted");
            assert!(msg.contains("no free IPv4 address"), "{msg}");
            break;
        }
        let result = outcome.json();
        let text = result["ips"][0]["address"].as_str().expect("address");
        let reported: ipnet::Ipv4Net = text.parse().expect("prefix");
        assert_eq!(reported.prefix_len(), 29, "{text}");
        assert!(
            reported.addr() != reported.network() && reported.addr() != reported.broadcast(),
            "{text} is the network or broadcast address of the prefix it is reported with"
        );
        assert!(given.insert(reported.addr()), "{text} handed out twice");
        assert!(i < 16, "more ADDs succeeded than the pool has addresses");
    }
    assert_eq!(given.len(), 12, "{given:?}");
}

/// `netconf` asking for exactly `ips` (`runtimeConfig.ips`).
fn asking_for_ips(netconf: &serde_json::Value, ips: &[&str]) -> serde_json::Value {
    let mut asking = netconf.clone();
    merge(&mut asking, json!({"runtimeConfig": {"ips": ips}}));
    asking
}

#[test]
fn a_requested_address_that_is_no_host_address_of_its_prefix_is_refused() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf(
        "1.0.0",
        json!({"pools": [{"cidr": "10.47.0.0/28", "block_size": 29}], "gateway": null}),
    );
    let prime = asking_for_ips(&netconf, &["10.47.0.2"]);
    cni("ADD", "prime", "eth0", &prime, &[]).success_json("prime");
    let before = sandbox.snapshot();
    for (address, what) in [("10.47.0.8", "network"), ("10.47.0.15", "broadcast")] {
        let asking = asking_for_ips(&netconf, &[address]);
        let msg = cni("ADD", "c1", "eth0", &asking, &[]).assert_error(7, address);
        assert!(
            msg.contains(address) && msg.contains(what) && msg.contains("10.47.0.8/29"),
            "{msg}"
        );
    }
    assert_eq!(
        sandbox.snapshot(),
        before,
        "a refused ADD changed the store"
    );
    let asking = asking_for_ips(&netconf, &["10.47.0.9"]);
    let result = cni("ADD", "c1", "eth0", &asking, &[]).success_json("a host address");
    assert_eq!(result["ips"][0]["address"], json!("10.47.0.9/29"));
}

#[test]
fn a_requested_address_is_checked_against_the_block_of_its_own_pool_in_a_dual_stack_network() {
    let sandbox = Sandbox::new();
    let netconf = sandbox.netconf(
        "1.0.0",
        json!({"pools": [
            {"cidr": "10.47.0.0/28", "block_size": 29},
            {"cidr": "fd00:47::/120", "block_size": 122}
        ], "gateway": null}),
    );
    let prime = asking_for_ips(&netconf, &["10.47.0.2", "fd00:47::2"]);
    cni("ADD", "prime", "eth0", &prime, &[]).success_json("prime");
    let before = sandbox.snapshot();
    // The IPv6 address is the network address of its /122 block (the IPv4 pool, listed first,
    // does not hold it); the IPv4 one is a host address.
    let asking = asking_for_ips(&netconf, &["10.47.0.9", "fd00:47::40"]);
    let msg = cni("ADD", "c1", "eth0", &asking, &[]).assert_error(7, "fd00:47::40");
    assert!(
        msg.contains("subnet-router anycast") && msg.contains("fd00:47::40/122"),
        "{msg}"
    );
    assert_eq!(
        sandbox.snapshot(),
        before,
        "a refused ADD changed the store"
    );
    let asking = asking_for_ips(&netconf, &["10.47.0.9", "fd00:47::41"]);
    let result = cni("ADD", "c1", "eth0", &asking, &[]).success_json("host addresses");
    assert_eq!(result["ips"][0]["address"], json!("10.47.0.9/29"));
    assert_eq!(result["ips"][1]["address"], json!("fd00:47::41/122"));
}
