//! A pool today's nodes marked full, where the previous release (which keeps no marks) deletes a block.
//!
//! Today's new-block search, once it has listed the whole claim index of a pool and found no
//! unclaimed block, marks the pool full and from then on reads only a window of claim entries
//! there; every block deletion by today's writers retires the mark. The previous release deletes
//! blocks without retiring it, so until today's empty-block pass notices the missing claim, a
//! node may borrow from a neighbour while an unclaimed block exists (placement, never a refused
//! address). This scenario has the previous release's real CLI delete the block and checks each
//! step of that story, with both releases' `check` clean throughout.

use crate::cluster::{MixedCluster, Release, StoreKind, NEW_1, OLD_1, OLD_3};
use serde_json::{json, Value};

/// A pool of 64 two-address blocks (/31): more blocks than the 48 claim entries today's search
/// reads first, and a block can have room without being empty (an empty block may be taken over
/// or released, which would hide what this scenario looks at).
const FULL_POOL: &str = "10.90.0.0/25";
/// Its name.
const FULL: &str = "full";
/// Addresses inside new-1's window of 48 claim entries in [`FULL_POOL`] (blocks 31 to 63 and 0
/// to 14, from ipam-core's `host_hash("new-1") % 64` = 31): both of its first probe's block and
/// the second of its second probe's.
const IN_NEW_1S_WINDOW: [&str; 3] = ["10.90.0.62", "10.90.0.63", "10.90.0.65"];
/// The addresses of old-3's first probe there, block 22 (`host_hash("old-3") % 64`): outside
/// new-1's window.
const OUTSIDE_NEW_1S_WINDOW: [&str; 2] = ["10.90.0.44", "10.90.0.45"];

/// The netconf addition that declares [`FULL_POOL`] beside the main pool and allocates from it.
fn in_full_pool() -> Value {
    json!({
        "pools": [
            {"cidr": crate::cluster::MAIN_POOL, "block_size": 29, "name": crate::cluster::MAIN},
            {"cidr": FULL_POOL, "block_size": 31, "name": FULL},
        ],
        "ipv4_pools": [FULL],
    })
}

/// True when the store holds a key named `key` (a relative key such as `ipam/v1/...`).
fn store_holds(cluster: &MixedCluster, key: &str) -> bool {
    cluster.dump().iter().any(|kv| kv.key.ends_with(key))
}

/// ADD of a fresh container on `node` in [`FULL_POOL`]; its name and addresses.
fn add_in_full_pool(
    cluster: &MixedCluster,
    step: &str,
    node: crate::cluster::Node,
) -> (String, Vec<String>) {
    let container = cluster.fresh_container(node);
    let addresses = cluster
        .add_with(step, node, &container, in_full_pool())
        .unwrap_or_default();
    (container, addresses)
}

/// Records a failure under `step` unless `got` is exactly `[expected]`.
fn expect_address(cluster: &MixedCluster, step: &str, got: &[String], expected: &str, why: &str) {
    if got != [expected.to_owned()] {
        cluster.fail(format!("{step}: got {got:?}, expected {expected} ({why})"));
    }
}

/// The scenario, on `kind`.
pub fn a_block_the_previous_release_deletes_in_a_pool_marked_full(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    crate::previous_release_sets_up(&cluster);
    cluster.ctl_ok(
        "set-up",
        Release::Previous,
        &["config", "set", "--max-blocks-per-host", "0"],
    );
    let mark = ipam_core::model::keys::full_pool_mark(FULL);
    let counter = ipam_core::model::keys::block_releases();
    let [x_first, x_second, next_second] = IN_NEW_1S_WINDOW;

    // The previous release fills the pool: old-3 its first probe, old-1 every other block.
    let step = "the previous release fills the pool";
    let old_3s: Vec<(String, Vec<String>)> = (0..2)
        .map(|_| add_in_full_pool(&cluster, step, OLD_3))
        .collect();
    let old_3_got: Vec<String> = old_3s.iter().flat_map(|(_, got)| got.clone()).collect();
    if old_3_got != OUTSIDE_NEW_1S_WINDOW {
        cluster.fail(format!(
            "{step}: old-3 got {old_3_got:?}, expected its first probe {OUTSIDE_NEW_1S_WINDOW:?}"
        ));
    }
    let old_1s: Vec<(String, Vec<String>)> = (0..126)
        .map(|_| add_in_full_pool(&cluster, step, OLD_1))
        .collect();
    let old_1_frees = |step: &str, address: &str| match old_1s
        .iter()
        .find(|(_, got)| got == &[address.to_owned()])
    {
        Some((container, _)) => cluster.del_with(step, OLD_1, container, in_full_pool()),
        None => cluster.fail(format!("{step}: no old-1 container got {address}")),
    };
    // Room in new-1's first probe: a lender, the only room in the pool.
    old_1_frees(step, x_second);

    // new-1's first ADD lists the whole claim index, finds no unclaimed block, borrows and marks.
    let step = "new-1's first ADD in the full pool";
    let (_, got) = add_in_full_pool(&cluster, step, NEW_1);
    expect_address(&cluster, step, &got, x_second, "the only free address");
    if !store_holds(&cluster, &mark) {
        cluster.fail(format!(
            "{step}: no full-pool mark at {mark}: the scenario tests nothing"
        ));
    }
    cluster.check_with_both(step);

    // old-3 is drained and removed; the previous CLI releases its affinity, deleting its block
    // without retiring the mark.
    let step = "the previous CLI's `node release old-3`";
    for (container, _) in &old_3s {
        cluster.del_with(step, OLD_3, container, in_full_pool());
    }
    cluster.ctl_ok(step, Release::Previous, &["node", "release", OLD_3.name]);
    if store_holds(&cluster, &counter) {
        cluster.fail(format!(
            "{step}: {counter} exists before any of today's writers deleted a block"
        ));
    }
    cluster.check_with_both(step);

    // The mark is still believed: new-1 borrows within its window although old-3's block is
    // unclaimed now (a placement cost; no address is refused).
    let step = "new-1's ADD while the mark is wrong";
    old_1_frees(step, x_first);
    let (_, got) = add_in_full_pool(&cluster, step, NEW_1);
    expect_address(
        &cluster,
        step,
        &got,
        x_first,
        "borrowed in the window: the previous release's deletion left the mark believed",
    );

    // More room in new-1's window, which it would borrow next while the mark is believed.
    let step = "old-1 frees an address of new-1's second probe";
    old_1_frees(step, next_second);

    // Today's empty-block pass sees fewer claims than blocks in a marked pool and retires the
    // mark (`--older-than 3600`: it is not about releasing blocks, and none is empty).
    let step = "today's `blocks release-empty --older-than 3600 --apply`";
    let out = cluster.ctl_ok(
        step,
        Release::Today,
        &["blocks", "release-empty", "--older-than", "3600", "--apply"],
    );
    if out["blocks"]
        .as_array()
        .is_some_and(|b| b.iter().any(|b| b["released"] == json!(true)))
    {
        cluster.fail(format!("{step}: released a block: {out}"));
    }
    if !store_holds(&cluster, &counter) {
        cluster.fail(format!(
            "{step}: {counter} was not written: the mark stays believed"
        ));
    }

    // new-1's next search lists the index again and claims the block old-3 left, rather than
    // borrowing in its window.
    let step = "new-1's ADD after the empty-block pass";
    let (_, got) = add_in_full_pool(&cluster, step, NEW_1);
    expect_address(
        &cluster,
        step,
        &got,
        OUTSIDE_NEW_1S_WINDOW[0],
        &format!("the unclaimed block, not {next_second} borrowed: the mark is retired"),
    );
    cluster.store_agrees_with_live_containers(step);
    cluster.both_nodes_keep_working_after(step);
    cluster.finish("a block the previous release deletes in a pool marked full");
}
