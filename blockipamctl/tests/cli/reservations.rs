//! IP reservations through the real binaries on every backend: `reservation add|list|delete`
//! (table, JSON, errors), the plugin's ADD skipping reserved addresses and wholly reserved blocks,
//! an explicitly requested (`ipAddrs`) reserved address still assigned, and `show`'s RESERVED and
//! FREE figures; a reservation that does not decode, listed, reported and deleted.

use std::net::IpAddr;

use ipam_core::reservations::reservation_key;
use ipnet::IpNet;
use serde_json::{json, Value};

use crate::common::{assert_columns_line_up, Backend, Lab};
use crate::on_every_backend;

/// The IPv4 address of a successful ADD of `container` on `node` (`top` merged into the netconf).
fn added(lab: &Lab, node: &str, container: &str, top: Value) -> IpAddr {
    let (status, result) =
        lab.plugin_in("default", "1.0.0", "ADD", node, container, json!({}), top);
    assert_eq!(status, 0, "ADD {container} on {node}: {result}");
    let address: IpNet = result["ips"][0]["address"]
        .as_str()
        .expect("an address")
        .parse()
        .expect("a CIDR");
    address.addr()
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an address")
}

fn reservations_keep_addresses_from_the_plugin(backend: Backend) {
    let lab = Lab::new(backend);
    // 16 blocks of 16 addresses; every block but the last, 10.80.0.240/28, is reserved.
    lab.ctl(&[
        "pool",
        "add",
        "10.80.0.0/24",
        "--name",
        "p",
        "--block-size",
        "28",
    ])
    .ok();
    let created = lab
        .ctl(&[
            "-o",
            "json",
            "reservation",
            "add",
            "most",
            "10.80.0.0/25",
            "10.80.0.128/26",
            "10.80.0.192/27",
            "10.80.0.224/28",
        ])
        .ok()
        .json();
    assert_eq!(created["name"], "most");
    lab.ctl(&["reservation", "add", "one", "10.80.0.241"])
        .ok()
        .stdout_has("Created IP reservation one: 10.80.0.241/32.");

    // The plugin's ADD claims the one block with room and skips the reserved .241 (.240, the
    // block's network address, is never handed out when the block prefix is reported).
    assert_eq!(added(&lab, "n1", "c1", Value::Null), ip("10.80.0.242"));
    let shown = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    let blocks = shown["blocks"].as_array().expect("blocks");
    assert_eq!(
        blocks.len(),
        1,
        "only the unreserved block is claimed: {shown:#}"
    );
    assert_eq!(blocks[0]["cidr"], "10.80.0.240/28");
    assert_eq!(
        (
            &blocks[0]["reserved"],
            &blocks[0]["in_use"],
            &blocks[0]["free"]
        ),
        (&json!(1), &json!(1), &json!(14))
    );
    let pool = &shown["pools"][0];
    assert_eq!(pool["reserved"], 241);
    assert_eq!(pool["in_use"], 1);
    assert_eq!(pool["free"], 256 - 241 - 1);

    // A second node finds no unreserved block to claim and borrows from n1's block.
    let borrowed = added(&lab, "n2", "c2", Value::Null);
    assert!(
        "10.80.0.240/28"
            .parse::<IpNet>()
            .expect("cidr")
            .contains(&borrowed)
            && borrowed != ip("10.80.0.241"),
        "{borrowed}"
    );

    // An address asked for by name (Calico's ipAddrs annotation) is assigned even when reserved.
    let annotated = json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations":
        {"cni.projectcalico.org/ipAddrs": "[\"10.80.0.5\"]"}}});
    assert_eq!(added(&lab, "n1", "c3", annotated), ip("10.80.0.5"));
    // `show --ip` names the reservations covering an address, held or free.
    for (address, allocated, reserved_by) in [
        ("10.80.0.5", true, json!(["most"])),
        ("10.80.0.241", false, json!(["one"])),
        ("10.80.0.250", false, json!([])),
    ] {
        let shown = lab
            .ctl(&["-o", "json", "show", "--ip", address])
            .ok()
            .json();
        assert_eq!(
            (&shown["allocated"], &shown["reserved_by"]),
            (&json!(allocated), &reserved_by),
            "{address}: {shown}"
        );
    }
    lab.ctl(&["show", "--ip", "10.80.0.241"])
        .ok()
        .stdout_has("reserved by  one (auto-assign never hands it out");

    // The tables.
    let table = lab.ctl(&["show", "--blocks"]).ok().stdout.clone();
    assert!(table.contains("RESERVED"), "{table}");
    for part in table.split("\n\n") {
        assert_columns_line_up(part);
    }
    let listed = lab.ctl(&["reservation", "list"]).ok().stdout.clone();
    assert!(listed.starts_with("NAME"), "{listed}");
    assert!(
        listed.contains("10.80.0.0/25,10.80.0.128/26,10.80.0.192/27,10.80.0.224/28"),
        "{listed}"
    );
    assert_eq!(
        lab.ctl(&["-o", "json", "reservation", "list"]).ok().json(),
        json!([
            {"name": "most", "cidrs": ["10.80.0.0/25", "10.80.0.128/26", "10.80.0.192/27", "10.80.0.224/28"]},
            {"name": "one", "cidrs": ["10.80.0.241/32"]},
        ])
    );

    // Errors: clear, and nothing written.
    let before = lab.snapshot();
    for (args, code, what) in [
        (
            vec!["reservation", "add", "most", "10.80.0.9"],
            1,
            "already exists",
        ),
        (
            vec!["reservation", "add", "x", "10.80.0.5/24"],
            2,
            "host bits",
        ),
        (
            vec!["reservation", "add", "x", "ten"],
            2,
            "neither an IP address nor a CIDR",
        ),
        (
            vec!["reservation", "add", "x/y", "10.80.0.9"],
            2,
            "reservation name",
        ),
        (
            vec!["reservation", "delete", "nope"],
            1,
            "no IP reservation named \"nope\"",
        ),
    ] {
        let run = lab.ctl(&args);
        run.expect_code(code);
        assert!(
            run.error_line().contains(what),
            "{args:?}: {}",
            run.error_line()
        );
    }
    assert_eq!(lab.snapshot(), before, "a refused command wrote something");

    // Deleting frees the reserved space for auto-assign again; allocations stay where they are.
    let deleted = lab
        .ctl(&["-o", "json", "reservation", "delete", "most"])
        .ok()
        .json();
    assert_eq!(deleted["cidrs"][0], "10.80.0.0/25");
    let third = added(&lab, "n3", "c4", Value::Null);
    assert!(
        !"10.80.0.240/28"
            .parse::<IpNet>()
            .expect("cidr")
            .contains(&third),
        "n3 claims a block of its own now: {third}"
    );
    let held = lab
        .ctl(&["-o", "json", "show", "--ip", "10.80.0.5"])
        .ok()
        .json();
    assert_eq!(held["allocated"], true);
    assert_eq!(held["reserved_by"], json!([]), "{held}");
    lab.ctl(&["check"]).ok();
}

on_every_backend!(reservations_keep_addresses_from_the_plugin);

/// A reservation that cannot be decoded stops auto-assign everywhere: `reservation list` still
/// lists every reservation, naming the damaged one and what is wrong, `check` names the command
/// that removes it, and `reservation delete` does, after which the plugin's ADD works again.
fn a_reservation_that_does_not_decode_is_listed_named_and_deleted(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.81.0.0/24", "--block-size", "28"])
        .ok();
    lab.ctl(&["reservation", "add", "vips", "10.81.0.5"]).ok();
    lab.with_store(|store| async move {
        store
            .put(
                &reservation_key("broken"),
                vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff],
            )
            .await
            .expect("damage the reservation")
    });
    let (status, result) = lab.plugin("ADD", "n1", "c1", json!({}));
    assert_ne!(
        status, 0,
        "auto-assign past a damaged reservation: {result}"
    );
    assert!(
        result["msg"]
            .as_str()
            .is_some_and(|m| m.contains("ipam/v1/ipreservations/broken")),
        "{result}"
    );
    let before = lab.snapshot();

    let listed = lab.ctl(&["-o", "json", "reservation", "list"]).ok().json();
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");
    assert_eq!(listed[0]["name"], "broken");
    assert_eq!(listed[0]["cidrs"], json!([]));
    assert!(
        listed[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("ipam/v1/ipreservations/broken")),
        "{listed}"
    );
    assert_eq!(
        listed[1],
        json!({"name": "vips", "cidrs": ["10.81.0.5/32"]}),
        "a sound reservation has no error field"
    );
    lab.ctl(&["reservation", "list"])
        .ok()
        .stdout_has("broken  cannot be decoded: auto-assign fails")
        .stdout_has("vips    10.81.0.5/32");
    lab.ctl(&["check"])
        .expect_code(1)
        .stdout_has("`blockipamctl reservation delete broken`");
    assert_eq!(lab.snapshot(), before, "list and check write nothing");

    lab.ctl(&["reservation", "delete", "broken"]).ok();
    let listed = lab.ctl(&["-o", "json", "reservation", "list"]).ok().json();
    assert_eq!(listed, json!([{"name": "vips", "cidrs": ["10.81.0.5/32"]}]));
    let address = lab.added("n1", "c1");
    assert_ne!(address, ip("10.81.0.5"), "the kept reservation still holds");
    lab.ctl(&["check"]).ok();
}

on_every_backend!(a_reservation_that_does_not_decode_is_listed_named_and_deleted);
