//! `tunnel-address assign|release` through the real binary on every backend: Calico's handle and
//! type, only from pools allowing tunnel use, the same address on a second `assign`, and released
//! by `release` and by `node release --addresses`.

use serde_json::{json, Value};

use crate::common::{Backend, Lab};
use crate::on_every_backend;

fn first_address(doc: &Value) -> String {
    doc["addresses"][0]
        .as_str()
        .unwrap_or_else(|| panic!("no address in {doc}"))
        .to_owned()
}

/// `tunnel-address assign NODE --type KIND`, its JSON answer.
fn assign(lab: &Lab, node: &str, kind: &str) -> Value {
    lab.ctl(&[
        "-o",
        "json",
        "tunnel-address",
        "assign",
        node,
        "--type",
        kind,
    ])
    .ok()
    .json()
}

fn tunnel_addresses_come_from_tunnel_pools_and_stay_put(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&[
        "pool",
        "add",
        "10.60.0.0/24",
        "--name",
        "pods",
        "--block-size",
        "28",
        "--allowed-uses",
        "workload",
    ])
    .ok();
    lab.ctl(&[
        "pool",
        "add",
        "10.61.0.0/24",
        "--name",
        "tunnels",
        "--block-size",
        "28",
        "--allowed-uses",
        "tunnel",
    ])
    .ok();

    let first = assign(&lab, "n1", "vxlan");
    assert_eq!(first["handle"], "vxlan-tunnel-addr-n1", "{first}");
    let address = first_address(&first);
    assert!(
        address.starts_with("10.61.0."),
        "not from the tunnel pool: {address}"
    );
    // A second assign returns the same address, unchanged.
    let again = assign(&lab, "n1", "vxlan");
    assert_eq!(first_address(&again), address);
    let held = lab
        .ctl(&["-o", "json", "show", "--ip", &address])
        .ok()
        .json();
    assert_eq!(held["handle"], "vxlan-tunnel-addr-n1", "{held}");
    assert_eq!(held["attributes"]["type"], "vxlanTunnelAddress", "{held}");
    assert_eq!(held["attributes"]["node"], "n1", "{held}");

    // An IPv6 type takes one IPv6 address (and no IPv4 one) from an IPv6 pool allowing tunnels.
    lab.ctl(&[
        "pool",
        "add",
        "fd61::/120",
        "--name",
        "tunnels-v6",
        "--allowed-uses",
        "tunnel",
    ])
    .ok();
    let v6 = assign(&lab, "n1", "vxlan-v6");
    assert_eq!(v6["handle"], "vxlan-v6-tunnel-addr-n1", "{v6}");
    assert_eq!(v6["addresses"].as_array().map(Vec::len), Some(1), "{v6}");
    let v6_address = first_address(&v6);
    assert!(v6_address.starts_with("fd61::"), "{v6}");
    let held = lab
        .ctl(&["-o", "json", "show", "--ip", &v6_address])
        .ok()
        .json();
    assert_eq!(held["attributes"]["type"], "vxlanV6TunnelAddress", "{held}");

    // Pods never get tunnel-pool addresses, and tunnels never get pod-pool ones.
    let (status, pod) = lab.plugin("ADD", "n1", "pod-1", json!({}));
    assert_eq!(status, 0, "{pod}");
    assert!(
        pod["ips"][0]["address"]
            .as_str()
            .is_some_and(|a| a.starts_with("10.60.0.")),
        "{pod}"
    );
    lab.ctl(&["pool", "set", "tunnels", "--disabled", "true"])
        .ok();
    let refused = lab.ctl(&["tunnel-address", "assign", "n2", "--type", "ipip"]);
    refused.expect_code(1);
    assert!(refused
        .error_line()
        .contains("no IP pool selects node \"n2\""));
    lab.ctl(&["pool", "set", "tunnels", "--disabled", "false"])
        .ok();

    // Bad input changes nothing.
    let before = lab.snapshot();
    for args in [
        vec!["tunnel-address", "assign", "n1", "--type", "gre"],
        vec!["tunnel-address", "assign", "bad/node", "--type", "ipip"],
    ] {
        lab.ctl(&args).expect_code(2);
    }
    assert_eq!(lab.snapshot(), before);

    // release frees it; node release --addresses frees a new one too.
    let released = lab
        .ctl(&[
            "-o",
            "json",
            "tunnel-address",
            "release",
            "n1",
            "--type",
            "vxlan",
        ])
        .ok()
        .json();
    assert_eq!(first_address(&released), address);
    let gone = lab
        .ctl(&["-o", "json", "show", "--ip", &address])
        .ok()
        .json();
    assert!(gone["handle"].is_null(), "{gone}");
    let wireguard = assign(&lab, "n1", "wireguard");
    lab.ctl(&["node", "release", "n1", "--addresses"]).ok();
    let gone = lab
        .ctl(&["-o", "json", "show", "--ip", &first_address(&wireguard)])
        .ok()
        .json();
    assert!(gone["handle"].is_null(), "{gone}");
    lab.ctl(&["check"]).ok();
}

on_every_backend!(tunnel_addresses_come_from_tunnel_pools_and_stay_put);
