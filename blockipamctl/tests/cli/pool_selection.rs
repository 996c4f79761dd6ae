//! Pools chosen the way Calico chooses them, through the real binaries on every backend: node
//! selectors against node labels, manual pools used only when named, allowed uses checked, and
//! `pool set` (a selector that does not parse is refused naming the position, changing nothing).

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{json, Value};

use crate::common::{Backend, Lab};
use crate::on_every_backend;

/// The IPv4 address of a successful ADD.
fn added(lab: &Lab, node: &str, container: &str, ipam: Value) -> IpAddr {
    let (status, result) = lab.plugin("ADD", node, container, ipam);
    assert_eq!(status, 0, "ADD {container} on {node}: {result}");
    let address: IpNet = result["ips"][0]["address"]
        .as_str()
        .expect("an address")
        .parse()
        .expect("a CIDR");
    address.addr()
}

fn within(cidr: &str, ip: IpAddr) -> bool {
    cidr.parse::<IpNet>().expect("cidr").contains(&ip)
}

fn pools_follow_selectors_modes_and_uses(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&[
        "pool",
        "add",
        "10.90.0.0/24",
        "--name",
        "rack1",
        "--block-size",
        "28",
        "--node-selector",
        "rack == \"r1\"",
    ])
    .ok();
    lab.ctl(&[
        "pool",
        "add",
        "10.91.0.0/24",
        "--name",
        "rack2",
        "--block-size",
        "28",
        "--node-selector",
        "rack in {\"r2\", \"r3\"} && !has(drain)",
    ])
    .ok();
    lab.ctl(&[
        "pool",
        "add",
        "10.92.0.0/24",
        "--name",
        "special",
        "--block-size",
        "28",
        "--assignment-mode",
        "manual",
    ])
    .ok();
    lab.ctl(&[
        "pool",
        "add",
        "10.93.0.0/24",
        "--name",
        "lb",
        "--block-size",
        "28",
        "--allowed-uses",
        "loadbalancer",
    ])
    .ok();
    lab.ctl(&["node", "label", "n1", "rack=r1"]).ok();
    lab.ctl(&["node", "label", "n2", "rack=r3"]).ok();

    // Each node gets an address from the pool that selects it, never from the manual or the
    // load-balancer pool.
    assert!(within("10.90.0.0/24", added(&lab, "n1", "a1", json!({}))));
    assert!(within("10.91.0.0/24", added(&lab, "n2", "b1", json!({}))));

    // A node no automatic pool selects: code 109 naming the node, and nothing written.
    let before = lab.snapshot();
    let (status, error) = lab.plugin("ADD", "n3", "c1", json!({}));
    assert_ne!(status, 0);
    assert_eq!(error["code"], 109, "{error}");
    let message = error["msg"].as_str().unwrap_or_default().to_owned()
        + error["details"].as_str().unwrap_or_default();
    assert!(message.contains("\"n3\""), "{error}");
    assert_eq!(lab.snapshot(), before, "a refused ADD wrote something");
    // STATUS says so too (code 50), and is fine on a node a pool selects.
    let (_, status) = lab.plugin_at("1.1.0", "STATUS", "n3", "", json!({}));
    assert_eq!(status["code"], 50, "{status}");
    assert!(
        status["msg"]
            .as_str()
            .unwrap_or_default()
            .contains("no IP pool selects node \"n3\""),
        "{status}"
    );
    let (code, _) = lab.plugin_at("1.1.0", "STATUS", "n1", "", json!({}));
    assert_eq!(code, 0, "STATUS on a selected node");

    // Named pools are used whatever they select: the manual pool on n3, rack1 on n2.
    let named = added(&lab, "n3", "c2", json!({"ipv4_pools": ["special"]}));
    assert!(within("10.92.0.0/24", named), "{named}");
    let named = added(&lab, "n2", "b2", json!({"ipv4_pools": ["rack1"]}));
    assert!(within("10.90.0.0/24", named), "{named}");
    // A pool that does not allow workload addresses is unusable even when named: code 105.
    let (_, error) = lab.plugin("ADD", "n1", "a2", json!({"ipv4_pools": ["lb"]}));
    assert_eq!(error["code"], 105, "{error}");
    // So is one of its addresses asked for by name (the ipAddrs annotation): code 105, nothing
    // written; an address of a workload pool asked for the same way is handed out.
    let before = lab.snapshot();
    let explicit = |container: &str, address: &str| {
        lab.plugin_in(
            "default",
            "1.0.0",
            "ADD",
            "n1",
            container,
            json!({}),
            json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {
                "cni.projectcalico.org/ipAddrs": format!("[\"{address}\"]")
            }}}),
        )
    };
    let (_, error) = explicit("a3", "10.93.0.5");
    assert_eq!(error["code"], 105, "{error}");
    assert_eq!(
        lab.snapshot(),
        before,
        "a refused explicit ADD wrote something"
    );
    let (status, result) = explicit("a4", "10.90.0.77");
    assert_eq!(status, 0, "{result}");
    assert!(
        result["ips"][0]["address"]
            .as_str()
            .is_some_and(|a| a.starts_with("10.90.0.77/")),
        "{result}"
    );

    // Labels change: n2 is drained, so rack2 no longer selects it.
    lab.ctl(&["node", "label", "n2", "drain=soon"]).ok();
    let (_, error) = lab.plugin("ADD", "n2", "b3", json!({}));
    assert_eq!(error["code"], 109, "{error}");
    // The pool's selector changes instead: rack1 now takes r3 nodes too.
    lab.ctl(&[
        "pool",
        "set",
        "rack1",
        "--node-selector",
        "rack in {\"r1\", \"r3\"}",
    ])
    .ok();
    assert!(within("10.90.0.0/24", added(&lab, "n2", "b4", json!({}))));

    // A selector that does not parse: a usage error naming the position; the pool is unchanged.
    let pools_before = lab.ctl(&["-o", "json", "pool", "list"]).ok().json();
    let refused = lab.ctl(&["pool", "set", "rack1", "--node-selector", "rack == "]);
    refused.expect_code(2);
    let line = refused.error_line();
    assert!(
        line.contains("--node-selector") && line.contains("at character 8"),
        "{line}"
    );
    for (args, what) in [
        (
            vec!["pool", "set", "rack1", "--assignment-mode", "sometimes"],
            "assignment-mode",
        ),
        (
            vec![
                "pool",
                "set",
                "rack1",
                "--allowed-uses",
                "workload,loadbalancer",
            ],
            "allowed-uses",
        ),
        (
            vec!["pool", "set", "rack1", "--allowed-uses", "wormhole"],
            "allowed-uses",
        ),
    ] {
        let run = lab.ctl(&args);
        run.expect_code(2);
        assert!(run.error_line().contains(what), "{}", run.error_line());
    }
    assert_eq!(
        lab.ctl(&["-o", "json", "pool", "list"]).ok().json(),
        pools_before
    );

    // The pool list shows every setting, as JSON and as a table.
    let special = pools_before
        .as_array()
        .expect("pools")
        .iter()
        .find(|p| p["name"] == "special")
        .cloned()
        .expect("the special pool");
    assert_eq!(special["assignment_mode"], "manual");
    assert_eq!(special["node_selector"], "all()");
    assert_eq!(special["allowed_uses"], json!(["workload", "tunnel"]));
    let table = lab.ctl(&["pool", "list"]).ok().stdout.clone();
    assert!(table.contains("rack in {\"r1\", \"r3\"}"), "{table}");
    assert!(
        table.contains("loadbalancer") && table.contains("manual"),
        "{table}"
    );
    lab.ctl(&["check"]).ok();
}

on_every_backend!(pools_follow_selectors_modes_and_uses);
