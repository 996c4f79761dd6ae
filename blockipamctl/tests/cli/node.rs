//! `node release HOST [--addresses]` on every backend.

use serde_json::{json, Value};

use crate::common::{Backend, Lab};

crate::on_every_backend!(node_release_retires_a_host_and_optionally_its_addresses);

fn node_release_retires_a_host_and_optionally_its_addresses(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.50.0.0/24", "--block-size", "28"])
        .ok();
    // host-a owns two blocks: one will hold an address, the other stays empty.
    lab.with_ipam(|ipam| async move {
        let claimed = ipam
            .claim_affinity("host-a", "10.50.0.0/27".parse().expect("cidr"))
            .await
            .expect("claim two blocks");
        assert_eq!(claimed.len(), 2);
    });
    let a = lab.assign("net.a", "host-a").to_string();
    let b = lab.assign("net.b", "host-b").to_string();

    let released = lab
        .ctl(&["-o", "json", "node", "release", "host-a"])
        .ok()
        .json();
    assert_eq!(released["host"], "host-a");
    assert_eq!(released["deleted_blocks"].as_array().map(Vec::len), Some(1));
    assert_eq!(
        released["unassigned_blocks"].as_array().map(Vec::len),
        Some(1)
    );
    assert_eq!(released["released_addresses"], json!([]));
    let kept = released["unassigned_blocks"][0].clone();

    let blocks = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    let blocks = blocks["blocks"].as_array().expect("blocks").clone();
    let unassigned: Vec<&Value> = blocks.iter().filter(|b| b["host"].is_null()).collect();
    assert_eq!(unassigned.len(), 1, "{blocks:?}");
    assert_eq!(unassigned[0]["cidr"], kept);
    assert_eq!(unassigned[0]["in_use"], 1);
    let one = lab.ctl(&["-o", "json", "show", "--ip", &a]).ok().json();
    assert_eq!(
        one["allocated"], true,
        "without --addresses the addresses stay"
    );
    assert_eq!(one["block_host"], Value::Null);

    let table = lab.ctl(&["node", "release", "host-b", "--addresses"]);
    table
        .ok()
        .stdout_has("Node host-b released:")
        .stdout_has("addresses released:           1")
        .stdout_has(&b);
    let one = lab.ctl(&["-o", "json", "show", "--ip", &b]).ok().json();
    assert_eq!(one["allocated"], false);

    let released = lab
        .ctl(&["-o", "json", "node", "release", "host-a", "--addresses"])
        .ok()
        .json();
    assert_eq!(released["released_addresses"], json!([a]));
    let shown = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    assert_eq!(shown["pools"][0]["in_use"], 0);
    assert_eq!(
        shown["blocks"],
        json!([]),
        "emptied blocks without a host are deleted"
    );

    // A host whose only block is empty: the block is deleted, and the table says so.
    let empty_block = lab.with_ipam(|ipam| async move {
        ipam.claim_affinity("host-c", "10.50.0.128/28".parse().expect("cidr"))
            .await
            .expect("claim an empty block")
    });
    assert_eq!(empty_block.len(), 1);
    let table = lab.ctl(&["node", "release", "host-c"]);
    table
        .ok()
        .stdout_has("Node host-c released:")
        .stdout_has("empty blocks deleted:         1 (10.50.0.128/28)")
        .stdout_has("blocks left without a host:   0\n");
    assert!(
        !table.stdout.contains("nothing changed"),
        "{}",
        table.stdout
    );

    lab.ctl(&["node", "release", "host-never-seen"])
        .ok()
        .stdout_has("held no blocks");
    lab.ctl(&["check"]).ok();
}
