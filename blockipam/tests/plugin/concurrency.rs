//! Many plugin processes of one node at once on one embedded store: they queue on the node's host
//! lock and the store's open lock, and 32 ADDs still give distinct addresses, 32 DELs empty the pool.
//!
//! What this proves is the locking and queueing of one node's plugin processes (no call fails for
//! lack of the lock, none corrupts the store); they never race inside the store. Real races between
//! nodes (different node names and lock files, one store) are in `multinode.rs`.

use crate::common;

use std::collections::BTreeSet;

use blockipam_store::DatastoreType;
use common::*;
use serde_json::{json, Value};
use test_kit::cni::{start_cni, CniProcess, HANG_GUARD};

const PROCESSES: usize = 32;

fn spawn(command: &str, container: &str, netconf: &Value) -> CniProcess {
    start_cni(
        plugin_binary(),
        &[],
        cni_env(command, container, "eth0"),
        netconf.to_string().as_bytes(),
    )
}

fn finish(process: CniProcess) -> Outcome {
    process.finish(HANG_GUARD)
}

fn concurrent_adds_are_distinct_and_concurrent_dels_empty_the_pool(store: DatastoreType) {
    let sandbox = Sandbox::with_store(store);
    // No gateway, so no reservation: an empty pool really is empty. A long lock wait, because
    // 32 processes queue for the host lock.
    let netconf = sandbox.netconf(
        "1.0.0",
        json!({"gateway": null, "ipam_lock_timeout_seconds": 120, "log_level": "warning"}),
    );
    let containers: Vec<String> = (0..PROCESSES).map(|i| format!("ctr{i:02}")).collect();
    let children: Vec<CniProcess> = containers
        .iter()
        .map(|c| spawn("ADD", c, &netconf))
        .collect();
    let mut seen = BTreeSet::new();
    for (container, child) in containers.iter().zip(children) {
        let outcome = finish(child);
        let address = first_address(&outcome.success_json(container));
        assert!(address.starts_with("10.244.7."), "{address}");
        assert!(
            seen.insert(address.clone()),
            "{address} was handed out twice"
        );
    }
    assert_eq!(seen.len(), PROCESSES);
    let recorded: BTreeSet<String> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(ip, _, _)| ip)
        .collect();
    assert_eq!(recorded, seen, "the store disagrees with what was printed");

    let children: Vec<CniProcess> = containers
        .iter()
        .map(|c| spawn("DEL", c, &netconf))
        .collect();
    for (container, child) in containers.iter().zip(children) {
        finish(child).assert_silent_success(container);
    }
    assert!(sandbox.allocations().is_empty());
    let in_use = sandbox.with_ipam(async |ipam| {
        ipam.utilization()
            .await
            .expect("utilization")
            .pools
            .iter()
            .map(|p| p.in_use)
            .sum::<u64>()
    });
    assert_eq!(in_use, 0, "the pools are not empty after every DEL");
    let handles = sandbox.with_ipam(async |ipam| {
        ipam.store()
            .list(&ipam_core::model::keys::handles_dir())
            .await
            .expect("list")
            .len()
    });
    assert_eq!(handles, 0, "handles left behind");
}

#[test]
fn thirty_two_concurrent_adds_on_sled_are_distinct_and_dels_empty_the_pool() {
    concurrent_adds_are_distinct_and_concurrent_dels_empty_the_pool(DatastoreType::Sled);
}

#[test]
fn thirty_two_concurrent_adds_on_redb_are_distinct_and_dels_empty_the_pool() {
    concurrent_adds_are_distinct_and_concurrent_dels_empty_the_pool(DatastoreType::Redb);
}
