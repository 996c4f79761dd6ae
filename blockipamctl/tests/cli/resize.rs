//! `pool split` and `pool set --block-size` through the real `blockipamctl` and `blockipam`
//! binaries on every backend: plugin ADD and DEL before and after, JSON output, `check` clean,
//! and refusals that change nothing.

use ipnet::IpNet;
use serde_json::{json, Value};

use crate::common::{Backend, Lab};
use crate::on_every_backend;

on_every_backend!(
    pool_split_keeps_allocations_and_plugin_calls_work_after_it,
    pool_block_size_change_serves_new_claims_at_the_new_size,
);

/// A successful plugin ADD's first address, with the prefix the result reports.
fn add_in(lab: &Lab, namespace: &str, node: &str, container: &str) -> IpNet {
    let (status, result) = lab.plugin_in(
        namespace,
        "1.0.0",
        "ADD",
        node,
        container,
        Value::Null,
        Value::Null,
    );
    assert_eq!(status, 0, "ADD {container} on {node}: {result}");
    result["ips"][0]["address"]
        .as_str()
        .expect("an address")
        .parse()
        .expect("a CIDR")
}

fn del(lab: &Lab, node: &str, container: &str) {
    let (status, result) = lab.plugin("DEL", node, container, Value::Null);
    assert_eq!(status, 0, "DEL {container} on {node}: {result}");
}

fn assert_check_clean(lab: &Lab) {
    let report = lab.ctl(&["-o", "json", "check"]).ok().json();
    assert_eq!(report["problems"], json!([]), "{report}");
}

/// Block CIDRs from `show --blocks`, each with its pool.
fn blocks(lab: &Lab) -> Vec<(IpNet, String)> {
    let shown = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    shown["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .map(|b| {
            (
                b["cidr"].as_str().expect("cidr").parse().expect("a CIDR"),
                b["pool"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

fn pool_split_keeps_allocations_and_plugin_calls_work_after_it(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&[
        "pool",
        "add",
        "10.60.0.0/24",
        "--name",
        "big",
        "--block-size",
        "28",
        "--allowed-uses",
        "workload",
    ])
    .ok();
    lab.ctl(&["namespace", "pools", "team", "--ipv4", "big"])
        .ok();
    let a = add_in(&lab, "default", "node-a", "c1");
    let b = add_in(&lab, "default", "node-b", "c2");
    let t = add_in(&lab, "team", "node-a", "c3");
    let before = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();

    // Refusals first: nothing changes.
    lab.ctl(&["pool", "split", "big", "3"]).expect_code(2);
    lab.ctl(&["pool", "split", "big", "32"]).expect_code(2);
    assert_eq!(
        lab.ctl(&["-o", "json", "pool", "list"]).ok().json()[0]["name"],
        "big"
    );

    let split = lab
        .ctl(&["-o", "json", "pool", "split", "big", "4"])
        .ok()
        .json();
    assert_eq!(split["pool"]["name"], "big");
    let names: Vec<&str> = split["pools"]
        .as_array()
        .expect("pools")
        .iter()
        .map(|p| p["name"].as_str().expect("name"))
        .collect();
    assert_eq!(
        names,
        ["split-big-0", "split-big-1", "split-big-2", "split-big-3"]
    );
    assert_eq!(split["namespaces"], json!(["team"]));
    let listed = lab.ctl(&["-o", "json", "pool", "list"]).ok().json();
    let listed = listed.as_array().expect("pools");
    assert_eq!(listed.len(), 4);
    for (i, pool) in listed.iter().enumerate() {
        assert_eq!(pool["cidr"], format!("10.60.0.{}/26", i * 64));
        assert_eq!(pool["block_size"], 28);
    }
    // Every block in the sub-pool containing it, allocations unchanged.
    let after = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    assert_eq!(
        before["blocks"].as_array().map(Vec::len),
        after["blocks"].as_array().map(Vec::len)
    );
    for (cidr, pool) in blocks(&lab) {
        let index = usize::from(
            cidr.network()
                .to_string()
                .rsplit('.')
                .next()
                .map_or(0, |o| o.parse::<u8>().expect("octet"))
                / 64,
        );
        assert_eq!(pool, format!("split-big-{index}"), "block {cidr}");
    }
    let shown = lab
        .ctl(&["-o", "json", "namespace", "pools", "team"])
        .ok()
        .json();
    assert_eq!(shown["ipv4_pools"], json!(names));
    let table = lab.ctl(&["pool", "split", "split-big-0", "2"]);
    table
        .ok()
        .stdout_has("Split IP pool split-big-0")
        .stdout_has("Namespace pools settings now naming the sub-pools: team.");
    assert_check_clean(&lab);

    let held = lab
        .ctl(&["-o", "json", "show", "--ip", &a.addr().to_string()])
        .ok()
        .json();
    assert_eq!(held["allocated"], true, "{held}");
    assert_eq!(held["block"], a.trunc().to_string());
    assert!(
        held["pool"]
            .as_str()
            .is_some_and(|p| p.starts_with("split-split-big-0-")),
        "{held}"
    );

    // The plugin after the split: DEL frees, ADD allocates, a repeated ADD returns the same.
    del(&lab, "node-a", "c1");
    assert_eq!(add_in(&lab, "default", "node-b", "c2"), b, "a retried ADD");
    let again = add_in(&lab, "default", "node-a", "c4");
    assert!(again.addr() != b.addr() && again.addr() != t.addr());
    assert!("10.60.0.0/24"
        .parse::<IpNet>()
        .expect("net")
        .contains(&again.addr()));
    // The namespace's rewritten setting is used: its pods get addresses from the sub-pools.
    let in_team = add_in(&lab, "team", "node-c", "c5");
    assert!(
        ![again.addr(), b.addr(), t.addr()].contains(&in_team.addr()),
        "{in_team} handed out twice"
    );
    assert!("10.60.0.0/24"
        .parse::<IpNet>()
        .expect("net")
        .contains(&in_team.addr()));
    del(&lab, "node-b", "c2");
    del(&lab, "node-a", "c3");
    assert_check_clean(&lab);
}

fn pool_block_size_change_serves_new_claims_at_the_new_size(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&[
        "pool",
        "add",
        "10.61.0.0/24",
        "--name",
        "p",
        "--block-size",
        "26",
    ])
    .ok();
    let old = add_in(&lab, "default", "node-a", "c1");
    assert_eq!(old.prefix_len(), 26, "reported with its block's prefix");

    // Refused: out of range, larger than the pool; nothing changes.
    lab.ctl(&["pool", "set", "p", "--block-size", "20"])
        .expect_code(2);
    lab.ctl(&["pool", "set", "p", "--block-size", "33"])
        .expect_code(2);
    let changed = lab
        .ctl(&["-o", "json", "pool", "set", "p", "--block-size", "28"])
        .ok()
        .json();
    assert_eq!(changed["block_size"], 28);
    lab.ctl(&["pool", "list"]).ok().stdout_has("/28");

    // New claims are /28 and never overlap the old /26; node-a keeps using its /26.
    let fresh = add_in(&lab, "default", "node-b", "c2");
    assert_eq!(fresh.prefix_len(), 28, "{fresh}");
    assert!(!old.trunc().contains(&fresh.addr()), "{fresh} inside {old}");
    let same_host = add_in(&lab, "default", "node-a", "c3");
    assert_eq!(same_host.trunc(), old.trunc());
    let cidrs: Vec<IpNet> = blocks(&lab).into_iter().map(|(c, _)| c).collect();
    assert!(cidrs.contains(&old.trunc()) && cidrs.contains(&fresh.trunc()));

    // A specific address is checked against the block that holds it, not the new size: the old
    // /26's 17th address is a /28's network address but a host address of the /26 it lies in.
    let base = match old.trunc().network() {
        std::net::IpAddr::V4(v4) => u32::from(v4),
        other => panic!("an IPv4 block, got {other}"),
    };
    let inside = std::net::Ipv4Addr::from(base + 16).to_string();
    let (status, result) = lab.plugin_in(
        "default",
        "1.0.0",
        "ADD",
        "node-d",
        "c-static",
        Value::Null,
        json!({"runtimeConfig": {"ips": [inside]}}),
    );
    assert_eq!(status, 0, "{result}");
    assert_eq!(result["ips"][0]["address"], format!("{inside}/26"));
    let network = std::net::Ipv4Addr::from(base).to_string();
    let (status, result) = lab.plugin_in(
        "default",
        "1.0.0",
        "ADD",
        "node-d",
        "c-network",
        Value::Null,
        json!({"runtimeConfig": {"ips": [network]}}),
    );
    assert_eq!(status, 1, "the /26's network address is refused: {result}");
    assert_eq!(result["code"], 7, "{result}");
    del(&lab, "node-d", "c-static");
    assert_check_clean(&lab);

    // DEL of an address of the old-size block, then of the new.
    del(&lab, "node-a", "c1");
    del(&lab, "node-b", "c2");
    let shown = lab
        .ctl(&["-o", "json", "show", "--ip", &old.addr().to_string()])
        .ok()
        .json();
    assert_eq!(shown["allocated"], false, "{shown}");
    assert_eq!(
        shown["block"],
        old.trunc().to_string(),
        "found in its /26 block"
    );
    // Back to /26: the /28 block is now the former size, still found.
    lab.ctl(&["pool", "set", "p", "--block-size", "26"]).ok();
    let third = add_in(&lab, "default", "node-c", "c4");
    assert_eq!(third.prefix_len(), 26);
    for cidr in blocks(&lab).into_iter().map(|(c, _)| c) {
        assert!(
            cidr == third.trunc() || !cidr.contains(&third.addr()),
            "{cidr} overlaps {third}"
        );
    }
    del(&lab, "node-a", "c3");
    del(&lab, "node-c", "c4");
    assert_check_clean(&lab);
}
