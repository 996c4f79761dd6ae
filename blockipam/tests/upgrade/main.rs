//! Mixed versions during a rolling upgrade: the previous release's plugin and CLI beside today's on one store, after every operator step.
//!
//! Each scenario starts from a store the previous release set up (node old-1's first ADD created
//! the network and the previous CLI wrote the configuration; the pool has two blocks, so once
//! each node has claimed one they borrow from each other's), then takes one step with today's binaries, then asks what an operator in the middle of
//! an upgrade needs: old-1's next ADD and DEL succeed, `check` is clean under the previous CLI and
//! today's, new-1's ADD and DEL succeed, and old-1's again. Every address is handed to one live
//! container at a time, and at the end the store holds exactly what the live containers were
//! given. `finalize` takes the last step, `upgrade finalize`, and what follows it; `full_pools`
//! has the previous release delete a block in a pool today's nodes marked full. Every scenario
//! runs on etcd (`etcd::`) and on sled served by today's agent (`agent_sled::`), but `reclaim`'s,
//! today's agent reclaiming a dead node of the previous release, which needs etcd's leases;
//! `agents` runs each release's plugin and CLI through the other release's agent.
//!
//! Needs the previous release's binaries: `scripts/build-previous` (run by `scripts/test`, which
//! passes their directory in `BLOCKIPAM_PREVIOUS_BIN`).

mod agents;
mod cluster;
mod finalize;
mod full_pools;
mod reclaim;

use cluster::{
    MixedCluster, Release, StoreKind, BLOCK_SIZE, NEW_1, OLD_1, OLD_2, OTHER, OTHER_POOL,
};
use finalize::{
    finalize_forced_over_a_node_that_reads_format_3, finalize_once_every_node_is_upgraded,
};
use full_pools::a_block_the_previous_release_deletes_in_a_pool_marked_full;
use reclaim::todays_agent_reclaims_a_dead_node_of_the_previous_release;
use serde_json::{json, Value};

/// Containers old-1 holds once the previous release has set the store up.
const OLD_1_CONTAINERS: [&str; 3] = ["old-1-a", "old-1-b", "old-1-c"];

/// The store as a cluster of the previous release leaves it: old-1 created the network with its
/// first ADD, the previous CLI wrote the configuration (a host may own both blocks of the pool;
/// borrowing comes from the pool having no block left to claim), old-1 holds three containers,
/// and both CLIs find it clean.
fn previous_release_sets_up(cluster: &MixedCluster) {
    let step = "set-up by the previous release";
    cluster.add(step, OLD_1, OLD_1_CONTAINERS[0]);
    cluster.ctl_ok(
        step,
        Release::Previous,
        &["config", "set", "--max-blocks-per-host", "2"],
    );
    for container in &OLD_1_CONTAINERS[1..] {
        cluster.add(step, OLD_1, container);
    }
    cluster.check_with_both(step);
    cluster.store_agrees_with_live_containers(step);
}

/// `node` ADDs `count` fresh containers one after another.
fn add_several(cluster: &MixedCluster, step: &str, node: cluster::Node, count: usize) {
    for _ in 0..count {
        let container = cluster.fresh_container(node);
        cluster.add(step, node, &container);
    }
}

/// The addresses `borrower` holds in blocks affine to `owner`, as today's `show --borrowed`
/// lists them.
fn borrowed(cluster: &MixedCluster, borrower: &str, owner: &str) -> Vec<String> {
    let shown = cluster.ctl_ok(
        &format!("listing what {borrower} borrowed"),
        Release::Today,
        &["show", "--borrowed"],
    );
    shown["borrowed"]
        .as_array()
        .map(|entries| {
            entries
                .iter()
                .filter(|e| e["node"] == json!(borrower) && e["block_host"] == json!(owner))
                .filter_map(|e| e["ip"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// A control: the previous release alone, with today's CLI only reading (`show`, `config show`,
/// `pool list`, `check`): nothing changes for the old node.
fn todays_read_only_commands_change_nothing_for_old_nodes(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    let step = "today's read-only commands";
    for args in [
        &["show", "--blocks", "--borrowed"][..],
        &["config", "show"],
        &["pool", "list"],
        &["check"],
    ] {
        cluster.ctl_ok(step, Release::Today, args);
    }
    cluster.add_and_del(&format!("after {step}, old-1's next call"), OLD_1);
    cluster.check_with_both(&format!("after {step}"));
    cluster.finish("today's read-only commands beside the previous release");
}

/// Today's agent on new-1 records a duplicate its leak collection found (one of old-1's
/// addresses used by a live pod on new-1): the previous release's nodes go on, its `check` does
/// not read the record and finds the store clean, today's `check` reports the duplicate; once the
/// agent clears the record both are clean.
fn a_live_duplicate_recorded_by_todays_agent(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    let step = "today's agent records a live duplicate";
    let taken = cluster.addresses_of(OLD_1_CONTAINERS[0]);
    cluster.record_live_duplicates(NEW_1.name, &taken);
    cluster.add_and_del(&format!("after {step}, old-1's next call"), OLD_1);
    cluster.check_with(step, &[Release::Previous]);
    let out = cluster.ctl(Release::Today, &["check"]);
    let kinds: Vec<Value> = out.json()["problems"]
        .as_array()
        .map(|p| p.iter().map(|p| p["kind"].clone()).collect())
        .unwrap_or_default();
    if out.status != 1 || kinds != [json!("duplicate-address")] {
        cluster.fail(format!(
            "{step}: today's check should report the duplicate alone: {}",
            out.summary()
        ));
    }
    cluster.record_live_duplicates(NEW_1.name, &[]);
    cluster.both_nodes_keep_working_after(step);
    cluster.finish("a live duplicate recorded by today's agent");
}

/// new-1 joins and allocates in a block of its own, beside old-1's.
fn a_new_node_allocating_in_its_own_block(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    add_several(&cluster, "new-1 joins", NEW_1, 2);
    if let Some(first) = cluster.live_of(NEW_1).first() {
        cluster.del("new-1 joins", NEW_1, first);
    }
    cluster.both_nodes_keep_working_after("new-1's ADDs in its own block");
    cluster.finish("a new node allocating in its own block");
}

/// new-1 fills its block and, with no block left to claim, borrows an address from old-1's.
fn a_new_node_borrowing_from_an_old_nodes_block(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    // Six fill new-1's own /29 block; the seventh can only come from old-1's.
    add_several(&cluster, "new-1 fills its block and borrows", NEW_1, 7);
    let lent = borrowed(&cluster, NEW_1.name, OLD_1.name);
    eprintln!("new-1 holds {lent:?} in old-1's block");
    if lent.is_empty() && cluster.failures().is_empty() {
        cluster.fail("new-1 never borrowed from old-1's block: the scenario tests nothing".into());
    }
    cluster.both_nodes_keep_working_after("new-1 borrowing from old-1's block");
    cluster.finish("a new node borrowing from an old node's block");
}

/// One node's script in the race: `true` ADDs a fresh container, `false` DELs its oldest.
fn run_script(cluster: &MixedCluster, step: &str, node: cluster::Node, script: &[bool]) {
    for &add in script {
        if add {
            let container = cluster.fresh_container(node);
            cluster.add(step, node, &container);
        } else if let Some(oldest) = cluster.live_of(node).first() {
            cluster.del(step, node, oldest);
        }
    }
}

/// Both nodes at once, each on its own host lock, ADD and DEL several containers; first old-1
/// fills its block and borrows from new-1's, then new-1 fills its and borrows from old-1's.
/// At most eleven are live at once, of the pool's twelve usable addresses: no call may fail.
fn nodes_of_both_releases_race_allocate_borrow_and_release(kind: StoreKind) {
    const A: bool = true;
    const D: bool = false;
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    // new-1 claims its block before the race, so that old-1's seventh address has a block to
    // be borrowed from.
    add_several(&cluster, "new-1 joins", NEW_1, 1);
    for (heavy, light) in [(OLD_1, NEW_1), (NEW_1, OLD_1)] {
        let step = format!("the race where {} borrows", heavy.name);
        // Down to two live on the light node and at most four on the heavy one, one by one.
        while cluster.live_of(light).len() > 2 {
            let oldest = cluster.live_of(light)[0].clone();
            cluster.del(&step, light, &oldest);
        }
        while cluster.live_of(heavy).len() > 4 {
            let oldest = cluster.live_of(heavy)[0].clone();
            cluster.del(&step, heavy, &oldest);
        }
        let heavy_live = cluster.live_of(heavy).len();
        // The heavy node ends with seven live (one more than its block holds), the light one
        // with at most four.
        let mut heavy_script = vec![A, A, D, A, A, D, A];
        heavy_script.extend(std::iter::repeat_n(A, 7 - heavy_live - 3));
        let light_script = [A, D, A, A, D, A, D];
        std::thread::scope(|scope| {
            scope.spawn(|| run_script(&cluster, &step, heavy, &heavy_script));
            scope.spawn(|| run_script(&cluster, &step, light, &light_script));
        });
        let lent = borrowed(&cluster, heavy.name, light.name);
        eprintln!(
            "{step}: {} holds {lent:?} in {}'s block",
            heavy.name, light.name
        );
        if lent.is_empty() && cluster.failures().is_empty() {
            cluster.fail(format!(
                "{step}: {} never borrowed from {}'s block: the race tests nothing",
                heavy.name, light.name
            ));
        }
        cluster.store_agrees_with_live_containers(&format!("after {step}"));
        cluster.check_with_both(&format!("after {step}"));
    }
    cluster.both_nodes_keep_working_after("the race");
    cluster.finish("nodes of both releases racing");
}

/// Today's `release --ip` of an address old-1's container holds.
fn release_ip_of_an_old_nodes_address(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    let step = "today's `release --ip` of an address of old-1";
    let address = cluster
        .addresses_of(OLD_1_CONTAINERS[1])
        .first()
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{OLD_1_CONTAINERS:?} hold nothing: {:#?}",
                cluster.failures()
            )
        });
    let released = cluster.ctl_ok(step, Release::Today, &["release", "--ip", &address]);
    if released["released"] != json!([address]) {
        cluster.fail(format!("{step}: released {released}, not {address}"));
    }
    cluster.address_released(&address);
    cluster.both_nodes_keep_working_after(step);
    cluster.finish("release --ip of an old node's address");
}

/// Today's `config set --max-blocks-per-host`.
fn config_set_max_blocks_per_host(kind: StoreKind) {
    operator_step(
        kind,
        "today's `config set --max-blocks-per-host 30`",
        &["config", "set", "--max-blocks-per-host", "30"],
        |_| {},
        |out| out["max_blocks_per_host"] == json!(30),
    );
}

/// Today's `pool add` of a pool no netconf uses.
fn pool_add_of_another_pool(kind: StoreKind) {
    operator_step(
        kind,
        "today's `pool add` of another pool",
        &[
            "pool",
            "add",
            OTHER_POOL,
            "--name",
            OTHER,
            "--block-size",
            BLOCK_SIZE,
        ],
        |_| {},
        |out| out["name"] == json!(OTHER),
    );
}

/// The previous CLI adds the other pool, as part of the set-up.
fn previous_cli_adds_the_other_pool(cluster: &MixedCluster) {
    cluster.ctl_ok(
        "the previous CLI adds another pool",
        Release::Previous,
        &[
            "pool",
            "add",
            OTHER_POOL,
            "--name",
            OTHER,
            "--block-size",
            BLOCK_SIZE,
        ],
    );
}

/// Today's `pool set` of the other pool (a node selector).
fn pool_set_of_another_pool(kind: StoreKind) {
    operator_step(
        kind,
        "today's `pool set --node-selector` of another pool",
        &["pool", "set", OTHER, "--node-selector", "has(rack)"],
        previous_cli_adds_the_other_pool,
        |out| out["node_selector"] == json!("has(rack)"),
    );
}

/// Today's `pool disable` of the other pool.
fn pool_disable_of_another_pool(kind: StoreKind) {
    operator_step(
        kind,
        "today's `pool disable` of another pool",
        &["pool", "disable", OTHER],
        previous_cli_adds_the_other_pool,
        |out| out["disabled"] == json!(true),
    );
}

/// Today's `node label` of old-1.
fn node_label_of_an_old_node(kind: StoreKind) {
    operator_step(
        kind,
        "today's `node label` of old-1",
        &["node", "label", OLD_1.name, "rack=r1"],
        |_| {},
        |out| out["labels"] == json!({"rack": "r1"}),
    );
}

/// Today's `reservation add` (of an address outside the nodes' pool).
fn reservation_add(kind: StoreKind) {
    operator_step(
        kind,
        "today's `reservation add`",
        &["reservation", "add", "vips", "10.80.0.5"],
        |_| {},
        |out| out["name"] == json!("vips"),
    );
}

/// CNI GC from new-1, collecting a container its runtime lost.
fn cni_gc_from_a_new_node(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    let step = "CNI GC from new-1";
    let lost = cluster.fresh_container(NEW_1);
    let kept = cluster.fresh_container(NEW_1);
    cluster.add("new-1 joins", NEW_1, &lost);
    cluster.add("new-1 joins", NEW_1, &kept);
    let lost_addresses = cluster.addresses_of(&lost);
    for address in &lost_addresses {
        cluster.address_released(address);
    }
    let mut netconf = cluster.netconf(NEW_1, json!({}));
    cluster::merge(
        &mut netconf,
        json!({"cni.dev/valid-attachments": [{"containerID": kept, "ifname": "eth0"}]}),
    );
    let done = cluster.plugin(NEW_1, "GC", "", &netconf);
    if done.status != 0 {
        cluster.fail(format!(
            "{step}: new-1 GC failed: {}",
            cluster::describe(&done)
        ));
    }
    cluster.store_agrees_with_live_containers(&format!("after {step}"));
    cluster.both_nodes_keep_working_after(step);
    cluster.finish("CNI GC from a new node");
}

/// Today's `blocks release-empty --apply`, releasing old-2's empty block in a disabled pool.
fn blocks_release_empty(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    let set_up = "old-2 leaves an empty block in a pool the previous CLI disables";
    previous_cli_adds_the_other_pool(&cluster);
    let netconf = cluster.netconf(OLD_2, json!({"ipv4_pools": [OTHER]}));
    for command in ["ADD", "DEL"] {
        let done = cluster.plugin(OLD_2, command, "old-2-a", &netconf);
        if done.status != 0 {
            cluster.fail(format!(
                "{set_up}: old-2 {command} failed: {}",
                cluster::describe(&done)
            ));
        }
    }
    cluster.ctl_ok(set_up, Release::Previous, &["pool", "disable", OTHER]);
    let step = "today's `blocks release-empty --older-than 0 --apply`";
    let out = cluster.ctl_ok(
        step,
        Release::Today,
        &["blocks", "release-empty", "--older-than", "0", "--apply"],
    );
    let released: Vec<&Value> = out["blocks"]
        .as_array()
        .map(|blocks| {
            blocks
                .iter()
                .filter(|b| b["released"] == json!(true))
                .collect()
        })
        .unwrap_or_default();
    if released.is_empty() {
        cluster.fail(format!(
            "{step}: released no block (old-2's empty block in {OTHER_POOL} should go): {out}"
        ));
    }
    cluster.both_nodes_keep_working_after(step);
    cluster.finish("blocks release-empty");
}

/// Today's `check --repair`, recreating the handle of an old-1 container that went missing.
fn check_repair(kind: StoreKind) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    let damaged = cluster::handle_of(OLD_1_CONTAINERS[1]);
    cluster.delete_key(&ipam_core::model::keys::handle(&damaged));
    let step = "today's `check --repair` (recreating a missing handle of old-1's)";
    let out = cluster.ctl(Release::Today, &["check", "--repair"]);
    if out.status != 0 || out.json()["repaired"].as_array().is_none_or(Vec::is_empty) {
        cluster.fail(format!(
            "{step}: repaired nothing or left problems: {}",
            out.stdout
        ));
    }
    cluster.both_nodes_keep_working_after(step);
    cluster.finish("check --repair");
}

/// The set-up, `before` (more set-up by the previous release), one command of today's CLI that
/// must exit 0 with output `took_effect` accepts, then what must hold after every step.
fn operator_step(
    kind: StoreKind,
    step: &str,
    args: &[&str],
    before: impl FnOnce(&MixedCluster),
    took_effect: impl FnOnce(&Value) -> bool,
) {
    let cluster = MixedCluster::start(kind);
    previous_release_sets_up(&cluster);
    before(&cluster);
    let out = cluster.ctl(Release::Today, args);
    if out.status != 0 || !took_effect(&out.json()) {
        cluster.fail(format!("{step}: {} printed {}", out.summary(), out.stdout));
    }
    cluster.both_nodes_keep_working_after(step);
    cluster.finish(step);
}

/// One `#[test]` per scenario and store: `etcd::<scenario>` and `agent_sled::<scenario>`, each
/// with the attributes (`#[ignore = ...]`) written before the scenario's name; the scenarios
/// after `; etcd only:` (dead-node reclaim needs etcd's leases) get `etcd::<scenario>` alone.
macro_rules! on_both_stores {
    (
        $($(#[$attribute:meta])* $scenario:ident),* $(,)?;
        etcd only: $($etcd_scenario:ident),* $(,)?
    ) => {
        mod etcd {
            $(
                #[test]
                $(#[$attribute])*
                fn $scenario() {
                    super::$scenario(super::StoreKind::Etcd);
                }
            )*
            $(
                #[test]
                fn $etcd_scenario() {
                    super::$etcd_scenario(super::StoreKind::Etcd);
                }
            )*
        }
        mod agent_sled {
            $(
                #[test]
                $(#[$attribute])*
                fn $scenario() {
                    super::$scenario(super::StoreKind::AgentSled);
                }
            )*
        }
    };
}

on_both_stores!(
    todays_read_only_commands_change_nothing_for_old_nodes,
    a_new_node_allocating_in_its_own_block,
    a_new_node_borrowing_from_an_old_nodes_block,
    nodes_of_both_releases_race_allocate_borrow_and_release,
    release_ip_of_an_old_nodes_address,
    config_set_max_blocks_per_host,
    pool_add_of_another_pool,
    pool_set_of_another_pool,
    pool_disable_of_another_pool,
    node_label_of_an_old_node,
    reservation_add,
    cni_gc_from_a_new_node,
    blocks_release_empty,
    check_repair,
    finalize_once_every_node_is_upgraded,
    finalize_forced_over_a_node_that_reads_format_3,
    a_live_duplicate_recorded_by_todays_agent,
    a_block_the_previous_release_deletes_in_a_pool_marked_full;
    etcd only: todays_agent_reclaims_a_dead_node_of_the_previous_release,
);
