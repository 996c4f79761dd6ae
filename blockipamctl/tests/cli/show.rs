//! `show`, `show --blocks`, `show --borrowed` and `show --ip` on every backend.

use std::net::IpAddr;

use ipam_core::AssignIpsRequest;
use ipnet::IpNet;
use serde_json::Value;

use crate::common::{assert_columns_line_up, Backend, Lab};

crate::on_every_backend!(
    show_reports_pools_blocks_borrowed_addresses_and_single_ips,
    show_names_each_object_it_cannot_decode_and_shows_the_rest,
    show_names_an_owner_key_it_cannot_decode_and_shows_the_rest,
);

/// The address `offset` places after the start of `ip`'s /28 block.
fn in_same_block(ip: IpAddr, offset: u8) -> IpAddr {
    let block = IpNet::new(ip, 28).expect("a /28").trunc();
    match block.network() {
        IpAddr::V4(v4) => {
            let mut octets = v4.octets();
            octets[3] += offset;
            IpAddr::from(octets)
        }
        IpAddr::V6(_) => panic!("IPv4 expected"),
    }
}

fn block_of<'a>(blocks: &'a [Value], host: &str) -> &'a Value {
    blocks
        .iter()
        .find(|b| b["host"] == host)
        .unwrap_or_else(|| panic!("no block of {host} in {blocks:?}"))
}

fn show_reports_pools_blocks_borrowed_addresses_and_single_ips(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&[
        "pool",
        "add",
        "10.20.0.0/24",
        "--name",
        "p",
        "--block-size",
        "28",
    ])
    .ok();
    let a1 = lab.assign("net.c1", "host-a");
    lab.assign("net.c2", "host-a");
    lab.assign("net.c3", "host-b");
    let borrowed_ip = in_same_block(a1, 9);
    lab.with_ipam(|ipam| async move {
        ipam.assign_ips(&AssignIpsRequest {
            ips: vec![borrowed_ip],
            handle: "net.c4".into(),
            host: "host-b".into(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("host-b takes an address from host-a's block");
    });

    // show
    let shown = lab.ctl(&["-o", "json", "show"]).ok().json();
    assert!(shown.get("blocks").is_none() && shown.get("borrowed").is_none());
    let pool = &shown["pools"][0];
    assert_eq!(pool["name"], "p");
    assert_eq!(pool["cidr"], "10.20.0.0/24");
    assert_eq!(pool["capacity"], 256);
    assert_eq!(pool["in_use"], 4);
    assert_eq!(pool["free"], 252);
    assert_eq!(pool["block_count"], 2);
    let table = lab.ctl(&["show"]);
    table.ok();
    for column in ["POOL", "CIDR", "ADDRESSES", "IN USE", "FREE", "USED"] {
        table.stdout_has(column);
    }
    table.stdout_has("1.6%");
    assert_columns_line_up(&table.stdout);

    // show --blocks
    let shown = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    let blocks = shown["blocks"].as_array().expect("blocks");
    assert_eq!(blocks.len(), 2);
    let a = block_of(blocks, "host-a");
    assert_eq!(
        a["cidr"],
        IpNet::new(a1, 28).expect("net").trunc().to_string()
    );
    assert_eq!(a["pool"], "p");
    assert_eq!(a["capacity"], 16);
    assert_eq!(a["in_use"], 3);
    assert_eq!(a["free"], 13);
    assert_eq!(block_of(blocks, "host-b")["in_use"], 1);
    let table = lab.ctl(&["show", "--blocks"]);
    table
        .ok()
        .stdout_has("BLOCK")
        .stdout_has("host-a")
        .stdout_has("host-b");
    let block_table = table.stdout.split("\n\n").nth(1).expect("a block table");
    assert_columns_line_up(block_table);

    // show --borrowed
    let shown = lab.ctl(&["-o", "json", "show", "--borrowed"]).ok().json();
    let borrowed = shown["borrowed"].as_array().expect("borrowed");
    assert_eq!(borrowed.len(), 1, "{borrowed:?}");
    assert_eq!(borrowed[0]["ip"], borrowed_ip.to_string());
    assert_eq!(borrowed[0]["node"], "host-b");
    assert_eq!(borrowed[0]["block_host"], "host-a");
    assert_eq!(borrowed[0]["handle"], "net.c4");
    lab.ctl(&["show", "--borrowed"])
        .ok()
        .stdout_has("BLOCK HOST")
        .stdout_has(&borrowed_ip.to_string());

    // show --ip, allocated
    let a1_text = a1.to_string();
    let one = lab
        .ctl(&["-o", "json", "show", "--ip", &a1_text])
        .ok()
        .json();
    assert_eq!(one["ip"], a1_text);
    assert_eq!(one["allocated"], true);
    assert_eq!(one["handle"], "net.c1");
    assert_eq!(one["block"], a["cidr"]);
    assert_eq!(one["block_host"], "host-a");
    assert_eq!(one["pool"], "p");
    assert_eq!(one["attributes"]["node"], "host-a");
    assert_eq!(one["attributes"]["pod"], "net.c1");
    lab.ctl(&["show", "--ip", &a1_text])
        .ok()
        .stdout_has("net.c1")
        .stdout_has("attribute node");

    // show --ip, free inside a block, and outside every pool
    let free = in_same_block(a1, 15).to_string();
    let one = lab.ctl(&["-o", "json", "show", "--ip", &free]).ok().json();
    assert_eq!(one["allocated"], false);
    assert_eq!(one["handle"], Value::Null);
    assert_eq!(one["attributes"], Value::Null);
    assert_eq!(one["block"], a["cidr"]);
    let outside = lab
        .ctl(&["-o", "json", "show", "--ip", "192.168.1.1"])
        .ok()
        .json();
    assert_eq!(outside["allocated"], false);
    assert_eq!(outside["block"], Value::Null);
    assert_eq!(outside["pool"], Value::Null);
    lab.ctl(&["show", "--ip", "192.168.1.1"])
        .ok()
        .stdout_has("in no pool");

    // An address in no pool inside a block that outlived its pool (the pool object removed under
    // it): the block is still found, and named.
    lab.with_store(|store| async move {
        store
            .delete(&ipam_core::model::keys::pool("p"))
            .await
            .expect("delete the pool object");
    });
    let orphaned = lab.ctl(&["-o", "json", "show", "--ip", &free]).ok().json();
    assert_eq!(
        (
            &orphaned["pool"],
            &orphaned["block"],
            &orphaned["allocated"]
        ),
        (&Value::Null, &a["cidr"], &Value::Bool(false)),
        "{orphaned}"
    );
}

/// A block, a pool and a reservation that cannot be decoded: `show` and `show --ip` name each
/// (table and JSON), show everything else, and write nothing; an address of the damaged block is
/// refused naming its key.
fn show_names_each_object_it_cannot_decode_and_shows_the_rest(backend: Backend) {
    use ipam_core::model::keys;
    let lab = Lab::new(backend);
    for (cidr, name) in [("10.20.0.0/24", "p"), ("10.21.0.0/24", "q")] {
        lab.ctl(&["pool", "add", cidr, "--name", name, "--block-size", "28"])
            .ok();
    }
    lab.ctl(&["reservation", "add", "kept", "10.20.0.200/30"])
        .ok();
    lab.ctl(&["reservation", "add", "lost", "10.20.0.240/30"])
        .ok();
    let on_a = lab.added("host-a", "c1");
    let on_b = lab.added("host-b", "c2");
    let block_of_a = IpNet::new(on_a, 28).expect("a /28").trunc();
    let damaged = [
        keys::block(Some("host-a"), &block_of_a),
        keys::pool("q"),
        keys::reservation_key("lost"),
    ];
    let to_damage = damaged.to_vec();
    lab.with_store(|store| async move {
        for key in to_damage {
            store
                .put(&key, b"garbage{".to_vec())
                .await
                .expect("damage it");
        }
    });
    let before = lab.snapshot();
    let mut named = damaged.to_vec();
    named.sort();

    let shown = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    let keys_named: Vec<&str> = shown["undecodable"]
        .as_array()
        .unwrap_or_else(|| panic!("no undecodable list: {shown}"))
        .iter()
        .filter_map(|o| o["key"].as_str())
        .collect();
    assert_eq!(keys_named, named, "{shown}");
    assert_eq!(shown["pools"].as_array().map(Vec::len), Some(1), "{shown}");
    assert_eq!(shown["pools"][0]["name"], "p");
    assert_eq!(shown["pools"][0]["in_use"], 1, "host-b's address: {shown}");
    assert_eq!(
        shown["pools"][0]["reserved"], 4,
        "the sound reservation: {shown}"
    );
    assert_eq!(
        shown["blocks"].as_array().map(Vec::len),
        Some(1),
        "host-b's block: {shown}"
    );
    let table = lab.ctl(&["show"]).ok().stdout.clone();
    assert!(
        table.contains("3 object(s) cannot be decoded and are left out of the figures above")
            && damaged.iter().all(|key| table.contains(key.as_str()))
            && table.contains("format version"),
        "{table}"
    );
    assert_columns_line_up(&table);

    let status = lab
        .ctl(&["-o", "json", "show", "--ip", &on_b.to_string()])
        .ok()
        .json();
    assert_eq!(status["allocated"], true, "{status}");
    assert_eq!(status["handle"], "fixture.c2", "{status}");
    let status_named: Vec<&str> = status["undecodable"]
        .as_array()
        .unwrap_or_else(|| panic!("no undecodable list: {status}"))
        .iter()
        .filter_map(|o| o["key"].as_str())
        .collect();
    assert_eq!(
        status_named,
        vec![keys::reservation_key("lost"), keys::pool("q")],
        "{status}"
    );
    lab.ctl(&["show", "--ip", "10.21.0.5"])
        .ok()
        .stdout_has("- (in no pool that can be decoded)")
        .stdout_has(&keys::pool("q"));
    let refused = lab.ctl(&["show", "--ip", &on_a.to_string()]);
    refused.expect_code(1);
    assert!(
        refused.error_line().contains(&damaged[0]),
        "{}",
        refused.error_line()
    );
    assert_eq!(lab.snapshot(), before, "show writes nothing");
}

/// An owner key (the attributes of an address, kept apart from its block's value) that cannot be
/// decoded: `show --borrowed` names it and shows the rest (its block still counted in the
/// figures); `show --ip` of an address of its block, once no pool holds the block, is refused
/// naming it (who holds the address is unknown), while another block's address is shown; nothing
/// is written.
fn show_names_an_owner_key_it_cannot_decode_and_shows_the_rest(backend: Backend) {
    use ipam_core::model::keys;
    let lab = Lab::new(backend);
    lab.ctl(&[
        "pool",
        "add",
        "10.20.0.0/24",
        "--name",
        "p",
        "--block-size",
        "28",
    ])
    .ok();
    let on_a = lab.added("host-a", "c1");
    let on_b = lab.added("host-b", "c2");
    let block_of_a = IpNet::new(on_a, 28).expect("a /28").trunc();
    let owner_key = lab.with_store(|store| async move {
        let key = store
            .list(&keys::block_owners_dir(&block_of_a))
            .await
            .expect("list the owner keys")
            .into_iter()
            .next()
            .expect("c1's owner key")
            .key;
        store
            .put(&key, b"garbage{".to_vec())
            .await
            .expect("damage it");
        key
    });
    let before = lab.snapshot();

    let shown = lab.ctl(&["-o", "json", "show", "--borrowed"]).ok().json();
    let keys_named: Vec<&str> = shown["undecodable"]
        .as_array()
        .unwrap_or_else(|| panic!("no undecodable list: {shown}"))
        .iter()
        .filter_map(|o| o["key"].as_str())
        .collect();
    assert_eq!(keys_named, [owner_key.as_str()], "{shown}");
    assert_eq!(
        shown["pools"][0]["in_use"], 2,
        "both addresses counted: {shown}"
    );
    assert!(shown["borrowed"].is_array(), "{shown}");
    lab.ctl(&["show", "--borrowed"])
        .ok()
        .stdout_has(&owner_key)
        .stdout_has("for an owner key: its block's addresses, from the borrowed list only");
    assert_eq!(lab.snapshot(), before, "show writes nothing");

    // No pool holds the blocks any more (the pool object alone deleted, as `pool delete --force`
    // does for a pool object that cannot be decoded): `show --ip` reads every block to find the
    // address.
    lab.with_store(|store| async move {
        store
            .delete(&keys::pool("p"))
            .await
            .expect("delete the pool object")
    });
    let before = lab.snapshot();
    let refused = lab.ctl(&["show", "--ip", &on_a.to_string()]);
    refused.expect_code(1);
    assert!(
        refused.error_line().contains(&owner_key),
        "{}",
        refused.error_line()
    );
    let status = lab
        .ctl(&["-o", "json", "show", "--ip", &on_b.to_string()])
        .ok()
        .json();
    assert_eq!(status["allocated"], true, "{status}");
    assert_eq!(status["handle"], "fixture.c2", "{status}");
    assert_eq!(lab.snapshot(), before, "show writes nothing");
}
