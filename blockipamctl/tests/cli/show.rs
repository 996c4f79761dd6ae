//! `show`, `show --blocks`, `show --borrowed` and `show --ip` on every backend.

use std::net::IpAddr;

use ipam_core::AssignIpsRequest;
use ipnet::IpNet;
use serde_json::Value;

use crate::common::{assert_columns_line_up, Backend, Lab};

crate::on_every_backend!(show_reports_pools_blocks_borrowed_addresses_and_single_ips);

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
