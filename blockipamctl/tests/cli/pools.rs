//! `pool add|list|enable|disable|delete` on every backend: JSON keys and values, tables, statuses;
//! a pool object that does not decode, listed and deleted alone.

use ipam_core::model::keys;
use serde_json::json;

use crate::common::{assert_columns_line_up, Backend, Lab};

crate::on_every_backend!(
    pool_add_list_enable_disable_delete_round_trip,
    pool_delete_refuses_while_addresses_are_allocated_unless_forced,
    a_pool_object_that_does_not_decode_is_listed_and_deleted_alone_when_forced,
);

fn pool_add_list_enable_disable_delete_round_trip(backend: Backend) {
    let lab = Lab::new(backend);

    let added = lab.ctl(&["-o", "json", "pool", "add", "10.10.0.0/16"]);
    let pool = added.ok().json();
    assert_eq!(
        pool["name"], "10.10.0.0-16",
        "the default name comes from the CIDR"
    );
    assert_eq!(pool["cidr"], "10.10.0.0/16");
    assert_eq!(pool["block_size"], 26);
    assert_eq!(pool["disabled"], false);
    assert_eq!(pool["family"], "ipv4");
    assert_eq!(pool["capacity"], 65536);

    lab.ctl(&[
        "pool",
        "add",
        "fd00:10::/64",
        "--name",
        "v6",
        "--block-size",
        "120",
        "--disabled",
    ])
    .ok()
    .stdout_has("Created IP pool v6: fd00:10::/64, /120 blocks of 256 addresses");

    let list = lab.ctl(&["pool", "list", "-o", "json"]);
    let pools = list.ok().json();
    let pools = pools.as_array().expect("an array");
    assert_eq!(pools.len(), 2);
    assert_eq!(pools[0]["name"], "10.10.0.0-16");
    assert_eq!(pools[1]["name"], "v6");
    assert_eq!(pools[1]["cidr"], "fd00:10::/64");
    assert_eq!(pools[1]["block_size"], 120);
    assert_eq!(pools[1]["disabled"], true);
    assert_eq!(pools[1]["family"], "ipv6");
    assert_eq!(
        pools[1]["capacity"].as_f64(),
        Some(2f64.powi(64)),
        "a /64 spans 2^64 addresses, more than a u64 holds"
    );

    let table = lab.ctl(&["pool", "list"]);
    table.ok();
    let lines: Vec<&str> = table.stdout.lines().collect();
    assert!(lines[0].starts_with("NAME"), "{}", table.stdout);
    for column in ["CIDR", "BLOCK SIZE", "STATE", "ADDRESSES"] {
        assert!(lines[0].contains(column), "{}", table.stdout);
    }
    assert!(lines[1].contains("10.10.0.0/16") && lines[1].contains("enabled"));
    assert!(
        lines[1].contains("65,536"),
        "readable sizes: {}",
        table.stdout
    );
    assert!(lines[2].contains("disabled") && lines[2].contains("18.4E"));
    assert_columns_line_up(&table.stdout);

    let disabled = lab.ctl(&["-o", "json", "pool", "disable", "10.10.0.0-16"]);
    assert_eq!(disabled.ok().json()["disabled"], true);
    lab.ctl(&["pool", "enable", "fd00:10::/64"])
        .ok()
        .stdout_has("IP pool v6 (fd00:10::/64) is enabled.");
    let pools = lab.ctl(&["-o", "json", "pool", "list"]).ok().json();
    assert_eq!(pools[0]["disabled"], true);
    assert_eq!(pools[1]["disabled"], false);

    let deleted = lab.ctl(&["-o", "json", "pool", "delete", "v6"]);
    let deleted = deleted.ok().json();
    assert_eq!(deleted["pool"]["name"], "v6");
    assert_eq!(deleted["released_addresses"], 0);
    assert_eq!(deleted["deleted_blocks"], 0);
    let pools = lab.ctl(&["-o", "json", "pool", "list"]).ok().json();
    assert_eq!(pools.as_array().map(Vec::len), Some(1));

    lab.ctl(&["pool", "delete", "10.10.0.0/16"])
        .ok()
        .stdout_has("Deleted IP pool 10.10.0.0-16 (10.10.0.0/16)");
    lab.ctl(&["pool", "list"]).ok().stdout_has("No IP pools.");
    assert_eq!(
        lab.ctl(&["-o", "json", "pool", "list"]).ok().json(),
        serde_json::json!([])
    );
}

fn pool_delete_refuses_while_addresses_are_allocated_unless_forced(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.11.0.0/24", "--name", "busy"])
        .ok();
    lab.assign("net.c1", "host-a");
    // A sound pool one of whose blocks cannot be decoded: even --force refuses (the block's
    // addresses cannot be counted or released), naming the block, and changes nothing; it is
    // not taken for a pool object that cannot be decoded, deleted alone.
    lab.ctl(&["pool", "add", "10.12.0.0/24", "--name", "damaged"])
        .ok();
    lab.ctl(&["pool", "disable", "busy"]).ok();
    lab.assign("net.d1", "host-d");
    lab.ctl(&["pool", "enable", "busy"]).ok();
    let sound = lab.with_store(|store| async move {
        let dir = keys::host_blocks_dir("host-d");
        store.list(&dir).await.expect("list").remove(0)
    });
    let damaged_block = lab.damage_a_block_of("host-d", 1);
    assert_eq!(damaged_block, sound.key);
    let before = lab.snapshot();
    let refused = lab.ctl(&["pool", "delete", "damaged", "--force"]);
    refused.expect_code(1);
    assert!(
        refused.error_line().contains(&damaged_block)
            && !refused
                .error_line()
                .contains("delete the pool object alone"),
        "{}",
        refused.error_line()
    );
    assert_eq!(
        lab.snapshot(),
        before,
        "a refused forced delete changes nothing"
    );
    lab.with_store(|store| async move {
        store
            .put(&sound.key, sound.value)
            .await
            .expect("the block as it was")
    });
    lab.ctl(&["pool", "delete", "damaged", "--force"]).ok();
    let before = lab.snapshot();

    let refused = lab.ctl(&["-o", "json", "pool", "delete", "busy"]);
    refused.expect_code(1);
    let message = refused.json()["error"].as_str().map(str::to_owned);
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("1 allocated") && m.contains("--force")),
        "{message:?}"
    );
    assert!(refused.error_line().contains("--force"));
    assert_eq!(lab.snapshot(), before, "a refused delete changes nothing");

    let forced = lab.ctl(&["-o", "json", "pool", "delete", "busy", "--force"]);
    let forced = forced.ok().json();
    assert_eq!(forced["released_addresses"], 1);
    assert_eq!(forced["deleted_blocks"], 1);
    assert_eq!(
        lab.ctl(&["-o", "json", "pool", "list"]).ok().json(),
        serde_json::json!([])
    );
    lab.ctl(&["check"]).ok();
}

/// A pool object that cannot be decoded: `pool list` lists it beside the others, `pool delete`
/// refuses without `--force` (its addresses cannot be counted) and with it deletes the object
/// alone; the pool added again with its CIDR owns its block and address once more.
fn a_pool_object_that_does_not_decode_is_listed_and_deleted_alone_when_forced(backend: Backend) {
    let lab = Lab::new(backend);
    let add_pool_a = || {
        lab.ctl(&[
            "pool",
            "add",
            "10.82.0.0/24",
            "--name",
            "a",
            "--block-size",
            "28",
        ])
        .ok();
    };
    add_pool_a();
    lab.ctl(&[
        "pool",
        "add",
        "10.83.0.0/24",
        "--name",
        "b",
        "--block-size",
        "28",
    ])
    .ok();
    let address = lab.added("n1", "c1");
    assert!(address.to_string().starts_with("10.82.0."), "{address}");
    lab.with_store(|store| async move {
        store
            .put(
                &keys::pool("a"),
                vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff],
            )
            .await
            .expect("damage pool a")
    });
    let before = lab.snapshot();

    let listed = lab.ctl(&["-o", "json", "pool", "list"]).ok().json();
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");
    assert_eq!(listed[0]["name"], "b");
    assert_eq!(listed[0]["cidr"], "10.83.0.0/24");
    assert_eq!(listed[1]["name"], "a");
    assert!(
        listed[1]["error"]
            .as_str()
            .is_some_and(|e| e.contains("ipam/v1/pools/a")),
        "{listed}"
    );
    lab.ctl(&["pool", "list"])
        .ok()
        .stdout_has("cannot be decoded")
        .stdout_has("Pool a cannot be decoded");
    let refused = lab.ctl(&["pool", "delete", "a"]);
    refused.expect_code(1);
    assert!(
        refused
            .error_line()
            .contains("pass --force to delete the pool object alone"),
        "{}",
        refused.error_line()
    );
    lab.ctl(&["check"])
        .expect_code(1)
        .stdout_has("`blockipamctl pool delete a --force`");
    assert_eq!(
        lab.snapshot(),
        before,
        "list, the refused delete and check write nothing"
    );

    let deleted = lab
        .ctl(&["-o", "json", "pool", "delete", "a", "--force"])
        .ok()
        .json();
    assert_eq!(deleted["pool"]["name"], "a");
    assert_eq!(
        (
            deleted["released_addresses"].clone(),
            deleted["deleted_blocks"].clone()
        ),
        (json!(0), json!(0)),
        "{deleted}"
    );
    let listed = lab.ctl(&["-o", "json", "pool", "list"]).ok().json();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    lab.ctl(&["check"])
        .expect_code(1)
        .stdout_has("block-outside-pools");
    // Its address is still held, in a block that lies in no pool now.
    let shown = lab
        .ctl(&["-o", "json", "show", "--ip", &address.to_string()])
        .ok()
        .json();
    assert_eq!(
        (
            shown["allocated"].clone(),
            shown["handle"].clone(),
            shown["pool"].clone()
        ),
        (json!(true), json!("fixture.c1"), json!(null)),
        "{shown}"
    );
    add_pool_a();
    let shown = lab
        .ctl(&["-o", "json", "show", "--ip", &address.to_string()])
        .ok()
        .json();
    assert_eq!(shown["allocated"], true, "{shown}");
    lab.ctl(&["check"]).ok();
}
