//! Address and block lifecycle through the real binaries on every backend: IP cooldown (`config
//! set --ip-cooldown-seconds`, cooling in `show`, never handed out by the plugin while cooling),
//! another node's empty block taken over when a pool has no unclaimed block left, a selector
//! change releasing the empty blocks of nodes the pool no longer selects, and `blocks
//! release-empty` (preview, apply, a bad `--older-than` refused with nothing written).

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{json, Value};
use test_kit::unix_now;

use crate::common::{Backend, Lab};
use crate::on_every_backend;

/// The plugin's ADD on `node`: the IPv4 address, or the failed run's status and output.
fn add(lab: &Lab, node: &str, container: &str) -> Result<IpAddr, (i32, Value)> {
    let (status, result) = lab.plugin("ADD", node, container, json!({}));
    if status != 0 {
        return Err((status, result));
    }
    let address: IpNet = result["ips"][0]["address"]
        .as_str()
        .expect("an address")
        .parse()
        .expect("a CIDR");
    Ok(address.addr())
}

fn del(lab: &Lab, node: &str, container: &str) {
    let (status, result) = lab.plugin("DEL", node, container, json!({}));
    assert_eq!(status, 0, "DEL {container}: {result}");
}

/// The `show --blocks` row of `cidr`, if the block exists.
fn block_row(lab: &Lab, cidr: &str) -> Option<Value> {
    let shown = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    shown["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .find(|b| b["cidr"] == cidr)
        .cloned()
}

/// `pool add <cidr> --name <name> --block-size 30`: tiny blocks, so that a few addresses fill one.
fn add_pool_of_30s(lab: &Lab, cidr: &str, name: &str) {
    lab.ctl(&["pool", "add", cidr, "--name", name, "--block-size", "30"])
        .ok();
}

fn block_of(ip: IpAddr) -> String {
    IpNet::new(ip, 30).expect("a /30").trunc().to_string()
}

fn released_addresses_cool_before_the_plugin_hands_them_out_again(backend: Backend) {
    let lab = Lab::new(backend);
    add_pool_of_30s(&lab, "10.95.0.0/30", "one-block");
    // Over Calico's 1200 s limit: refused, nothing changed.
    let refused = lab.ctl(&["config", "set", "--ip-cooldown-seconds", "1201"]);
    assert_ne!(refused.code, 0, "{refused:?}");
    assert!(refused.error_line().contains("1200"), "{refused:?}");
    let config = lab.ctl(&["-o", "json", "config", "show"]).ok().json();
    assert_eq!(config["ip_cooldown_seconds"], 0, "{config}");
    lab.ctl(&["config", "set", "--ip-cooldown-seconds", "1200"])
        .ok();

    let first = add(&lab, "node-a", "ctr-0").expect("first ADD");
    let before_release = unix_now();
    del(&lab, "node-a", "ctr-0");
    let after_release = unix_now();
    // `show --ip` says until when it cools (the release time, by the releaser's clock, in whole
    // seconds, plus the cooldown and the second the stamp may hide).
    let shown = lab
        .ctl(&["-o", "json", "show", "--ip", &first.to_string()])
        .ok()
        .json();
    assert_eq!(shown["allocated"], false, "{shown}");
    let until = shown["cooling_until"].as_u64().expect("cooling_until");
    assert!(
        (before_release + 1201..=after_release + 1201).contains(&until),
        "{shown}: released between {before_release} and {after_release}"
    );
    lab.ctl(&["show", "--ip", &first.to_string()])
        .ok()
        .stdout_has("cooling until  ");
    let row = block_row(&lab, &block_of(first)).expect("the block stays");
    assert_eq!(
        (
            row["in_use"].clone(),
            row["cooling"].clone(),
            row["free"].clone()
        ),
        (json!(0), json!(1), json!(3)),
        "{row}"
    );
    let table = lab.ctl(&["show", "--blocks"]).ok().stdout.clone();
    assert!(table.contains("COOLING"), "{table}");
    // The other addresses the plugin hands out go (it skips the block's network and broadcast
    // addresses); the cooling one never does, to this node or another.
    let mut handed_out = 0;
    let mut fresh = Vec::new();
    let refusal = loop {
        match add(&lab, "node-a", &format!("ctr-{}", handed_out + 1)) {
            Ok(ip) => {
                assert_ne!(ip, first, "a cooling address was handed out");
                fresh.push(ip);
                handed_out += 1;
                assert!(handed_out < 4, "more addresses than the block holds");
            }
            Err(refused) => break refused,
        }
    };
    assert!(handed_out >= 1, "no fresh address was handed out");
    // An address handed out does not cool; neither does one never released.
    let never_released = IpNet::new(first, 30).expect("a /30").network();
    for address in [fresh[0], never_released] {
        let shown = lab
            .ctl(&["-o", "json", "show", "--ip", &address.to_string()])
            .ok()
            .json();
        assert_eq!(shown["cooling_until"], Value::Null, "{address}: {shown}");
    }
    assert!(refusal.1.to_string().contains("no free"), "{refusal:?}");
    let (status, output) = add(&lab, "node-b", "ctr-b").expect_err("only a cooling address left");
    assert_ne!(status, 0);
    assert!(output.to_string().contains("no free"), "{output}");
    lab.ctl(&["check"]).ok();
}

fn a_long_empty_block_of_another_node_is_taken_over(backend: Backend) {
    let lab = Lab::new(backend);
    add_pool_of_30s(&lab, "10.96.0.0/29", "two-blocks");
    lab.ctl(&[
        "config",
        "set",
        "--strict-affinity",
        "true",
        "--empty-block-reclaim-seconds",
        "0",
    ])
    .ok();
    let a = add(&lab, "node-a", "ctr-a").expect("node-a");
    let b = add(&lab, "node-b", "ctr-b").expect("node-b");
    assert_ne!(block_of(a), block_of(b));
    // No unclaimed block and no borrowing: node-c waits for an empty one.
    assert!(add(&lab, "node-c", "ctr-c0").is_err());
    del(&lab, "node-a", "ctr-a");
    let c = add(&lab, "node-c", "ctr-c1").expect("node-c takes over node-a's empty block");
    assert_eq!(block_of(c), block_of(a));
    let row = block_row(&lab, &block_of(a)).expect("the block");
    assert_eq!(row["host"], "node-c", "{row}");
    assert_eq!(
        block_row(&lab, &block_of(b)).expect("node-b's block")["host"],
        "node-b"
    );
    lab.ctl(&["check"]).ok();
}

fn a_selector_change_releases_the_empty_blocks_of_nodes_no_longer_selected(backend: Backend) {
    let lab = Lab::new(backend);
    add_pool_of_30s(&lab, "10.97.0.0/28", "racked");
    lab.ctl(&["node", "label", "node-b", "rack=r1"]).ok();
    let a = add(&lab, "node-a", "ctr-a").expect("node-a");
    let b = add(&lab, "node-b", "ctr-b").expect("node-b");
    del(&lab, "node-a", "ctr-a");
    del(&lab, "node-b", "ctr-b");
    let set = lab
        .ctl(&["pool", "set", "racked", "--node-selector", "rack == \"r1\""])
        .ok()
        .stdout
        .clone();
    assert!(
        set.contains("Released 1 empty block") && set.contains(&block_of(a)),
        "{set}"
    );
    assert_eq!(block_row(&lab, &block_of(a)), None, "node-a's block stayed");
    assert_eq!(
        block_row(&lab, &block_of(b)).expect("node-b's block")["host"],
        "node-b",
        "a selected node's empty block stays"
    );
    // Unlabelling node-b takes its block too, and the JSON output says so.
    let unlabelled = lab
        .ctl(&["-o", "json", "node", "label", "node-b", "--remove", "rack"])
        .ok()
        .json();
    assert_eq!(
        unlabelled["released_empty_blocks"],
        serde_json::json!([{"cidr": block_of(b), "host": "node-b"}]),
        "{unlabelled}"
    );
    assert_eq!(block_row(&lab, &block_of(b)), None);
    // A change that releases nothing leaves the field out.
    let relabelled = lab
        .ctl(&[
            "-o",
            "json",
            "pool",
            "set",
            "racked",
            "--node-selector",
            "all()",
        ])
        .ok()
        .json();
    assert_eq!(relabelled["name"], "racked", "{relabelled}");
    assert!(
        relabelled.get("released_empty_blocks").is_none(),
        "{relabelled}"
    );
    lab.ctl(&["check"]).ok();
}

fn release_empty_previews_then_releases_blocks_beyond_the_newest_and_refuses_bad_ages(
    backend: Backend,
) {
    let lab = Lab::new(backend);
    add_pool_of_30s(&lab, "10.97.0.0/28", "small-blocks");
    // Five addresses on node-a take two /30 blocks of four; all released, both blocks are empty.
    let held: Vec<IpAddr> = (0..5)
        .map(|n| add(&lab, "node-a", &format!("ctr-{n}")).expect("ADD"))
        .collect();
    let blocks: std::collections::BTreeSet<String> = held.iter().map(|ip| block_of(*ip)).collect();
    assert!(blocks.len() >= 2, "{held:?}");
    for n in 0..5 {
        del(&lab, "node-a", &format!("ctr-{n}"));
    }
    let before = lab.snapshot();
    for bad in ["garbage", "10x", "-5", "", "99999999999999999999d"] {
        let flag = format!("--older-than={bad}");
        let refused = lab.ctl(&["blocks", "release-empty", &flag, "--apply"]);
        refused.expect_code(2);
        assert!(
            refused.error_line().contains("duration"),
            "--older-than {bad:?}: {}",
            refused.error_line()
        );
    }
    assert_eq!(lab.snapshot(), before, "a refused release-empty wrote");
    let (preview, listed) = lab.release_empty_preview("node-a");
    assert_eq!(preview["applied"], false, "{preview}");
    // Every empty block but the newest one goes.
    assert_eq!(listed.len(), blocks.len() - 1, "{preview}");
    for block in preview["blocks"].as_array().expect("blocks") {
        assert_eq!(block["reason"], "beyond-newest", "{preview}");
    }
    // The table names the reason as the JSON does.
    lab.ctl(&["blocks", "release-empty", "--older-than", "0"])
        .ok()
        .stdout_has("beyond-newest")
        .stdout_has("would release")
        .stdout_has("Nothing was written; run again with --apply to release them.\n");
    assert_eq!(lab.snapshot(), before, "the preview wrote");
    let none = lab.ctl(&["blocks", "release-empty", "--older-than", "1d"]);
    none.ok()
        .stdout_has("No empty block to release (empty for at least 86400 s).\n");
    assert!(
        !none.stdout.contains("run again with --apply"),
        "nothing to apply:\n{}",
        none.stdout
    );
    // Not old enough yet: nothing to release.
    let young = lab
        .ctl(&[
            "-o",
            "json",
            "blocks",
            "release-empty",
            "--older-than",
            "1d",
        ])
        .ok()
        .json();
    assert_eq!(young["blocks"].as_array().map(Vec::len), Some(0), "{young}");
    lab.ctl(&["blocks", "release-empty", "--older-than", "0", "--apply"])
        .ok()
        .stdout_has("Released");
    let left: Vec<Value> = blocks.iter().filter_map(|b| block_row(&lab, b)).collect();
    assert_eq!(left.len(), 1, "only the newest empty block stays: {left:?}");
    assert_eq!(left[0]["host"], "node-a");
    lab.ctl(&["check"]).ok();
    // The released blocks are free again: another node claims one.
    add(&lab, "node-b", "ctr-b").expect("node-b gets a block");
}

on_every_backend!(
    released_addresses_cool_before_the_plugin_hands_them_out_again,
    a_long_empty_block_of_another_node_is_taken_over,
    a_selector_change_releases_the_empty_blocks_of_nodes_no_longer_selected,
    release_empty_previews_then_releases_blocks_beyond_the_newest_and_refuses_bad_ages,
    release_empty_names_a_block_it_cannot_decode_and_releases_the_other_nodes_blocks,
);

/// A damaged block of node-b does not stop `blocks release-empty`: node-a's empty block beyond
/// its newest is released, node-b's are named and left (status 0; `check` is the command that
/// fails on them).
fn release_empty_names_a_block_it_cannot_decode_and_releases_the_other_nodes_blocks(
    backend: Backend,
) {
    let lab = Lab::new(backend);
    add_pool_of_30s(&lab, "10.98.0.0/27", "small-blocks");
    let mut blocks: Vec<String> = Vec::new();
    for node in ["node-a", "node-b"] {
        for n in 0..4 {
            let ip = add(&lab, node, &format!("{node}-{n}")).expect("ADD");
            if !blocks.contains(&block_of(ip)) {
                blocks.push(block_of(ip));
            }
        }
        for n in 0..4 {
            del(&lab, node, &format!("{node}-{n}"));
        }
    }
    // The plugin skips each /30's network and broadcast addresses: two usable per block.
    assert_eq!(blocks.len(), 4, "two /30 blocks per node: {blocks:?}");
    let damaged = lab.damage_a_block_of("node-b", 2);
    let applied = lab
        .ctl(&[
            "-o",
            "json",
            "blocks",
            "release-empty",
            "--older-than",
            "0",
            "--apply",
        ])
        .ok()
        .json();
    let released: Vec<&Value> = applied["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .collect();
    assert_eq!(released.len(), 1, "{applied}");
    assert_eq!(released[0]["host"], "node-a", "{applied}");
    assert_eq!(released[0]["released"], true, "{applied}");
    assert_eq!(
        applied["undecodable"][0]["key"],
        damaged.as_str(),
        "{applied}"
    );
    let intact: Vec<&String> = blocks[2..]
        .iter()
        .filter(|block| !damaged.ends_with(&block.replace('/', "-")))
        .collect();
    assert_eq!(intact.len(), 1, "{blocks:?} {damaged}");
    assert_eq!(
        block_row(&lab, intact[0]).map(|row| row["host"].clone()),
        Some(Value::from("node-b")),
        "node-b's other empty block stays while its newest cannot be told"
    );
    lab.ctl(&["blocks", "release-empty", "--older-than", "0"])
        .ok()
        .stdout_has(&damaged)
        .stdout_has("none is released");
    lab.ctl(&["check"]).expect_code(1).stdout_has(&damaged);
}
