//! The last step of a rolling upgrade, `blockipamctl upgrade finalize`: refused while a node may read only format 3, done once every node is upgraded, then today's format's features work and the previous release is refused cleanly.

use serde_json::{json, Value};

use crate::cluster::{describe, MixedCluster, Release, StoreKind, NEW_1, OLD_1, OLD_2};
use crate::{add_several, borrowed, previous_release_sets_up, OLD_1_CONTAINERS};

/// The format today's writers write once finalized.
const TODAY: u64 = ipam_core::model::FORMAT_VERSION as u64;

/// The CNI error code of a plugin that finds a stored object it cannot decode (a format newer
/// than it reads): the previous release's `IpamError::Corrupt`.
const CNI_CORRUPT_STORE: u64 = 108;

/// old-1 (the previous plugin) and new-1 (today's) both allocate, and each borrows from the
/// other's block. The pool's two blocks end as: old-1's with four used and two free, new-1's
/// full (one of its addresses lent to old-1).
fn both_releases_allocate_and_borrow(cluster: &MixedCluster) {
    let step = "old-1 and new-1 allocate and borrow";
    // new-1 claims the second block; old-1 fills its own and borrows one from new-1's.
    add_several(cluster, step, NEW_1, 1);
    add_several(cluster, step, OLD_1, 4);
    // old-1 frees three of its own; new-1 fills its block and borrows one from old-1's.
    for container in OLD_1_CONTAINERS {
        cluster.del(step, OLD_1, container);
    }
    add_several(cluster, step, NEW_1, 5);
    for (borrower, owner) in [(OLD_1, NEW_1), (NEW_1, OLD_1)] {
        let lent = borrowed(cluster, borrower.name, owner.name);
        if lent.is_empty() {
            cluster.fail(format!(
                "{step}: {} never borrowed from {}'s block: the scenario tests nothing",
                borrower.name, owner.name
            ));
        }
    }
    cluster.store_agrees_with_live_containers(&format!("after {step}"));
    cluster.check_with_both(&format!("after {step}"));
}

/// Today's `upgrade status`: its exit status and its JSON.
fn upgrade_status(cluster: &MixedCluster) -> (i32, Value) {
    let out = cluster.ctl(Release::Today, &["upgrade", "status"]);
    (out.status, out.json())
}

/// The format `node` reads as `upgrade status` shows it.
fn reads_format(status: &Value, node: &str) -> Option<u64> {
    status["nodes"]
        .as_array()?
        .iter()
        .find(|n| n["node"] == json!(node))?["reads_format"]
        .as_u64()
}

/// Today's CLI with `args` must fail (exit 1) with an error naming every one of `named`, and
/// none of `not_named`.
fn refused(cluster: &MixedCluster, step: &str, args: &[&str], named: &[&str], not_named: &[&str]) {
    let out = cluster.ctl(Release::Today, args);
    let error = out.json()["error"].as_str().unwrap_or_default().to_owned();
    let missing: Vec<&&str> = named.iter().filter(|n| !error.contains(**n)).collect();
    let wrongly: Vec<&&str> = not_named.iter().filter(|n| error.contains(**n)).collect();
    if out.status != 1 || !missing.is_empty() || !wrongly.is_empty() {
        cluster.fail(format!(
            "{step}: expected a refusal (exit 1) naming {named:?} and not {not_named:?}; {}; stdout {}",
            out.summary(),
            out.stdout.trim()
        ));
    }
}

/// A finalize refused while old-1 runs the previous plugin, done once old-1 is upgraded; then a
/// cooldown works, and a previous plugin or CLI that still runs is refused cleanly.
pub fn finalize_once_every_node_is_upgraded(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    both_releases_allocate_and_borrow(&cluster);
    refused_while_old_1_reads_format_3(&cluster);
    finalized_once_old_1_is_upgraded(&cluster);
    a_cooldown_works_once_finalized(&cluster);
    previous_release_refused_cleanly(&cluster);
    cluster.finish("finalize once every node is upgraded");
}

/// old-1 runs the previous plugin: `upgrade status` exits 1 showing it reading format 3 at most,
/// and `upgrade finalize` (naming old-1, not new-1) and a cooldown (naming `upgrade finalize`)
/// are refused; none of them writes anything.
fn refused_while_old_1_reads_format_3(cluster: &MixedCluster) {
    let step = "before old-1 is upgraded";
    let before = cluster.dump();
    let (exit, status) = upgrade_status(cluster);
    if exit != 1
        || status["ready_to_finalize"] != json!(false)
        || reads_format(&status, OLD_1.name).is_none_or(|reads| reads > 3)
        || reads_format(&status, NEW_1.name) != Some(TODAY)
    {
        cluster.fail(format!(
            "{step}: `upgrade status` should exit 1 showing old-1 reading format 3 at most and new-1 format {TODAY}; exited {exit}: {status}"
        ));
    }
    refused(
        cluster,
        step,
        &["upgrade", "finalize"],
        &[OLD_1.name],
        &[NEW_1.name],
    );
    refused(
        cluster,
        step,
        &["config", "set", "--ip-cooldown-seconds", "30"],
        &["blockipamctl upgrade finalize"],
        &[],
    );
    cluster.store_unchanged(
        &format!("{step}: `upgrade status`, the refused finalize and cooldown"),
        &before,
    );
}

/// old-1 is upgraded (today's plugin: same node name, lock file and store) and makes one ADD,
/// which records what it reads: `upgrade status` exits 0, ready; `upgrade finalize` records
/// today's format.
fn finalized_once_old_1_is_upgraded(cluster: &MixedCluster) {
    let step = "old-1 upgraded";
    let old_1 = cluster.upgrade_node(OLD_1);
    add_several(cluster, step, old_1, 1);
    let (exit, status) = upgrade_status(cluster);
    if exit != 0 || status["ready_to_finalize"] != json!(true) {
        cluster.fail(format!(
            "{step}: `upgrade status` should exit 0, ready to finalize; exited {exit}: {status}"
        ));
    }
    let finalized = cluster.ctl_ok(step, Release::Today, &["upgrade", "finalize"]);
    if finalized["changed"] != json!(true) || finalized["writes"] != json!(TODAY) {
        cluster.fail(format!("{step}: `upgrade finalize` printed {finalized}"));
    }
    let (exit, status) = upgrade_status(cluster);
    if exit != 0
        || status["recorded_format"] != json!(TODAY)
        || status["writes_format"] != json!(TODAY)
    {
        cluster.fail(format!(
            "{step}: after finalize `upgrade status` should exit 0 with format {TODAY} recorded; exited {exit}: {status}"
        ));
    }
}

/// Format 4's feature: a 30 s cooldown is accepted, and an address new-1 releases cools.
fn a_cooldown_works_once_finalized(cluster: &MixedCluster) {
    let step = "after finalize, a 30 s IP cooldown";
    let config = cluster.ctl_ok(
        step,
        Release::Today,
        &["config", "set", "--ip-cooldown-seconds", "30"],
    );
    if config["ip_cooldown_seconds"] != json!(30) {
        cluster.fail(format!("{step}: `config set` printed {config}"));
    }
    released_address_cools(cluster, step);
}

/// new-1 DELs a container of its own (now full) block and ADDs another: without the cooldown
/// that address is the only free one in its block and would come straight back; cooling, it is
/// passed over for the free address of old-1's block.
fn released_address_cools(cluster: &MixedCluster, step: &str) {
    let lent = borrowed(cluster, NEW_1.name, OLD_1.name);
    let in_own_block = cluster.live_of(NEW_1).into_iter().find(|container| {
        cluster
            .addresses_of(container)
            .iter()
            .all(|address| !lent.contains(address))
    });
    let Some(container) = in_own_block else {
        cluster.fail(format!("{step}: new-1 holds nothing in its own block"));
        return;
    };
    let released = cluster.addresses_of(&container);
    cluster.del(step, NEW_1, &container);
    let next = cluster.fresh_container(NEW_1);
    if let Some(given) = cluster.add(step, NEW_1, &next) {
        if let Some(back) = given.iter().find(|address| released.contains(address)) {
            cluster.fail(format!(
                "{step}: new-1 released {back} and was given it straight back: it did not cool"
            ));
        }
    }
}

/// A previous-release plugin on a third node (old-2) and the previous CLI's `check`, after
/// finalize: the ADD fails with a CNI error naming the format, and neither writes anything.
fn previous_release_refused_cleanly(cluster: &MixedCluster) {
    let step = "after finalize, the previous plugin on old-2";
    let before = cluster.dump();
    let netconf = cluster.netconf(OLD_2, json!({}));
    let done = cluster.plugin(OLD_2, "ADD", "old-2-a", &netconf);
    let error: Value = serde_json::from_str(&done.stdout).unwrap_or(Value::Null);
    let message = format!(
        "{} {}",
        error["msg"].as_str().unwrap_or_default(),
        error["details"].as_str().unwrap_or_default()
    );
    eprintln!("{step}: ADD exited {}: {}", done.status, describe(&done));
    if done.status == 0
        || error["code"].as_u64() != Some(CNI_CORRUPT_STORE)
        || !message.contains(&format!("format version {TODAY}"))
        || done.stderr.contains("panicked")
    {
        cluster.fail(format!(
            "{step}: ADD should fail with CNI error {CNI_CORRUPT_STORE} naming format version {TODAY}; exited {}: {}",
            done.status,
            describe(&done)
        ));
    }
    cluster.store_unchanged(&format!("{step}: its refused ADD"), &before);

    let step = "after finalize, the previous CLI's `check`";
    let out = cluster.ctl(Release::Previous, &["check"]);
    let report = out.json();
    let corrupt: Vec<&str> = report["problems"]
        .as_array()
        .map(|problems| {
            problems
                .iter()
                .filter(|p| p["kind"] == json!("corrupt-object"))
                .filter_map(|p| p["detail"].as_str())
                .collect()
        })
        .unwrap_or_default();
    let others = report["problems"]
        .as_array()
        .map_or(0, |problems| problems.len() - corrupt.len());
    eprintln!(
        "{step}: exited {}, {} objects in format {TODAY} reported corrupt, and {others} other problems it \
         cannot judge without them (its `--repair` must never be run on a finalized store: it \
         deletes the handles whose blocks it cannot read; docs/upgrading.md)",
        out.status,
        corrupt.len()
    );
    if out.status == 0
        || report["clean"] != json!(false)
        || corrupt.is_empty()
        || !corrupt
            .iter()
            .all(|detail| detail.contains(&format!("format version {TODAY}")))
    {
        cluster.fail(format!(
            "{step}: should exit non-zero reporting the objects in format {TODAY} as corrupt; {}; stdout {}",
            out.summary(),
            out.stdout.trim()
        ));
    }
    cluster.store_unchanged(&format!("{step}: it"), &before);
}

/// `upgrade finalize --force` while old-1 still runs the previous plugin: it goes ahead, lists
/// old-1 as finalized over, and records today's format; `upgrade status` exits 1 while old-1 is
/// behind.
pub fn finalize_forced_over_a_node_that_reads_format_3(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    let step = "`upgrade finalize --force` with old-1 on the previous plugin";
    add_several(&cluster, "new-1 joins", NEW_1, 1);
    let forced = cluster.ctl_ok(step, Release::Today, &["upgrade", "finalize", "--force"]);
    let overridden: Vec<&str> = forced["overridden"]
        .as_array()
        .map(|nodes| nodes.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let lists_only_old_1 = overridden.len() == 1 && overridden[0].starts_with("old-1:");
    if forced["changed"] != json!(true) || !lists_only_old_1 {
        cluster.fail(format!(
            "{step}: should succeed listing old-1 (only) as finalized over; printed {forced}"
        ));
    }
    // old-1 now refuses the store: `upgrade status` says so with exit 1.
    let (exit, status) = upgrade_status(&cluster);
    if exit != 1
        || status["recorded_format"] != json!(TODAY)
        || reads_format(&status, OLD_1.name) != Some(3)
    {
        cluster.fail(format!(
            "{step}: `upgrade status` should exit 1 showing format {TODAY} recorded and old-1 reading format 3; exited {exit}: {status}"
        ));
    }
    // The finalize rewrote the configuration in today's format: the previous plugin's next ADD refuses
    // the store at once and writes nothing, while its DEL, which reads only the handle and its
    // blocks (still format 3), goes on releasing what the node holds.
    let step = "after a forced finalize, the previous plugin on old-1";
    let before = cluster.dump();
    let netconf = cluster.netconf(OLD_1, json!({}));
    let done = cluster.plugin(OLD_1, "ADD", "old-1-after-finalize", &netconf);
    let error: Value = serde_json::from_str(&done.stdout).unwrap_or(Value::Null);
    if done.status == 0
        || error["code"].as_u64() != Some(CNI_CORRUPT_STORE)
        || !done.stdout.contains("ipam/v1/config")
        || done.stderr.contains("panicked")
    {
        cluster.fail(format!(
            "{step}: ADD should fail with CNI error {CNI_CORRUPT_STORE} naming ipam/v1/config; exited {}: {}",
            done.status,
            describe(&done)
        ));
    }
    cluster.store_unchanged(&format!("{step}: its refused ADD"), &before);
    cluster.del(step, OLD_1, OLD_1_CONTAINERS[0]);
    // old-1's other containers are deleted at the end by today's plugin.
    cluster.upgrade_node(OLD_1);
    cluster.finish("finalize --force over a node that reads format 3");
}
