//! Defects the model-based tests found, kept as named cases that stage each race exactly.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use ipam_core::{
    AssignIpsRequest, AssignedAddress, AutoAssignRequest, Ipam, IpamError, KvStore, PoolSpec,
    ReleaseRequest,
};

use crate::hooked::{writes_key, HookedStore};
use crate::StoreFactory;

use super::{menu_spec, net};

// ---------------------------------------------------------------------------------------------
// Regression cases: defects the model-based tests found, kept as named cases
// ---------------------------------------------------------------------------------------------

/// Found by [`operation_sequences_match_the_model`] (minimal failing input, steps resolved: on
/// pools `a` 10.0.0.0/26 in /29 blocks and `c`: `AutoAssign h0 n0`, `AutoAssign h0 n1`,
/// `DeletePool a force`, `AddPool wide` (10.0.0.0/25 in /28 blocks), `AutoAssign h0 n1` — the last
/// hands out (10.0.0.0, sequence 0) a second time). A pool deleted with force and the same
/// addresses carved again with another block size start their blocks' sequence numbers afresh,
/// so an (address, sequence) pair repeats, and a late guarded release (GC, single-interface DEL)
/// of the first owner frees the second owner's address.
pub async fn pool_recarved_with_another_block_size_refuses_a_stale_guarded_release<
    F: StoreFactory,
>(
    factory: &F,
) {
    let test_store = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&test_store.store));
    ipam.create_pool(&menu_spec(0)).await.expect("pool a");
    let address: IpAddr = "10.0.0.1".parse().expect("address");
    let assign = |handle: &str, host: &str| AssignIpsRequest {
        ips: vec![address],
        handle: handle.to_owned(),
        host: host.to_owned(),
        ..Default::default()
    };
    ipam.assign_ips(&assign("old", "n0"))
        .await
        .expect("first owner");
    let old = ipam
        .get_assignment(address)
        .await
        .expect("read")
        .expect("allocated");
    ipam.delete_pool("a", true).await.expect("forced delete");
    ipam.create_pool(&PoolSpec {
        cidr: net("10.0.0.0/25"),
        name: Some("wide".into()),
        block_size: Some(28),
        disabled: false,
    })
    .await
    .expect("the same addresses in /28 blocks");
    ipam.assign_ips(&assign("new", "n1"))
        .await
        .expect("second owner");
    let new = ipam
        .get_assignment(address)
        .await
        .expect("read")
        .expect("allocated");
    let outcome = ipam
        .release_ips(&[ReleaseRequest {
            ip: address,
            sequence: Some(old.sequence),
        }])
        .await
        .expect("release");
    let still = ipam.get_assignment(address).await.expect("read");
    assert!(
        outcome.released.is_empty() && still.as_ref().map(|a| a.handle.as_str()) == Some("new"),
        "a stale guarded release of ({address}, sequence {}) from the first owner (block {}) freed \
         the second owner's allocation (block {}, sequence {}): outcome {outcome:?}, now {still:?}",
        old.sequence,
        old.block,
        new.block,
        new.sequence
    );
    let report = ipam.check(false).await.expect("check");
    assert!(report.problems.is_empty(), "check: {:#?}", report.problems);
}

/// What the racing ADD of the delete-pool regression case got.
type RacerOutcome = Result<Vec<AssignedAddress>, IpamError>;

/// The racing client's ADD: one address for handle `racer` on node `n9`.
async fn racer_add(other: &Ipam) -> RacerOutcome {
    other
        .auto_assign(&AutoAssignRequest {
            handle: "racer".into(),
            host: "n9".into(),
            num_v4: 1,
            ..Default::default()
        })
        .await
        .map(|r| r.v4)
}

/// Found by [`concurrent_tasks_hold_exactly_what_they_believe`] (the check reported "block
/// 10.0.0.8/29 lies in no pool" after a task's `DeletePool a` raced another's `SetPoolDisabled a
/// false` and `AutoAssign`). `delete_pool` disables the pool, lists its blocks, deletes those, then
/// deletes the pool; when another client enables the pool again and an ADD claims a new block in
/// it after the listing, the pool is deleted anyway: the new block (with a live address) is left
/// outside every pool. Here the other client's enable and ADD run just before the pool's deleting
/// transaction.
pub async fn delete_pool_racing_an_enable_and_an_add_leaves_no_block_outside_pools<
    F: StoreFactory,
>(
    factory: &F,
) {
    let test_store = factory.fresh().await;
    let assigned: Arc<Mutex<Option<RacerOutcome>>> = Arc::default();
    let seen = Arc::clone(&assigned);
    let inner = Arc::clone(&test_store.store);
    let hook = move || async move {
        let other = Ipam::new(inner);
        let enabled = other.set_pool_disabled("a", false).await;
        assert!(enabled.is_ok(), "re-enable: {enabled:?}");
        *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(racer_add(&other).await);
    };
    let store = HookedStore::new(Arc::clone(&test_store.store));
    store.before_commit(writes_key(ipam_core::model::keys::pool("a"), false), hook);
    let ipam = Ipam::new(store as Arc<dyn KvStore>);
    ipam.create_pool(&menu_spec(0)).await.expect("pool a");
    let deletion = ipam.delete_pool("a", false).await;
    let racer = assigned
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .expect("the hook ran before the pool's deleting transaction");
    let held = ipam.ips_by_handle("racer").await.expect("read");
    let pools = ipam.list_pools().await.expect("pools");
    let report = ipam.check(false).await.expect("check");
    assert!(
        report.problems.is_empty(),
        "delete_pool answered {deletion:?} while the racing ADD got {racer:?}; the racer now \
         holds {held:?}, pools left {pools:?}; check: {:#?}",
        report.problems
    );
}

/// Found by [`concurrent_tasks_hold_exactly_what_they_believe`] (the check reported "block
/// 10.0.2.0/30 lies in no pool": pool names are reused in the menu, `a` is 10.0.0.0/26 or later
/// 10.0.2.0/26). `delete_pool("a")` reads pool `a`, then works by name: when another client
/// deletes that pool and creates a new pool under the same name (and an ADD lands in it) before
/// the delete disables "a", the delete disables and deletes the new pool, checking for blocks only
/// in the old pool's CIDR: the new pool's block, with its live address, is left outside every pool.
/// Here the other client's delete, re-creation and ADD run just before the delete's first write.
pub async fn delete_pool_racing_a_recreation_under_the_same_name_leaves_no_block_outside_pools<
    F: StoreFactory,
>(
    factory: &F,
) {
    let test_store = factory.fresh().await;
    let assigned: Arc<Mutex<Option<RacerOutcome>>> = Arc::default();
    let seen = Arc::clone(&assigned);
    let inner = Arc::clone(&test_store.store);
    let hook = move || async move {
        let other = Ipam::new(inner);
        let deleted = other.delete_pool("a", false).await;
        assert!(deleted.is_ok(), "the other client's delete: {deleted:?}");
        let created = other.create_pool(&menu_spec(4)).await;
        assert!(created.is_ok(), "the new pool a: {created:?}");
        *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(racer_add(&other).await);
    };
    let store = HookedStore::new(Arc::clone(&test_store.store));
    store.before_commit(writes_key(ipam_core::model::keys::pool("a"), true), hook);
    let ipam = Ipam::new(Arc::clone(&test_store.store));
    ipam.create_pool(&menu_spec(0)).await.expect("pool a");
    let deleting = Ipam::new(store as Arc<dyn KvStore>);
    let deletion = deleting.delete_pool("a", false).await;
    let racer = assigned
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .expect("the hook ran before the delete's first write");
    let held = ipam.ips_by_handle("racer").await.expect("read");
    let pools = ipam.list_pools().await.expect("pools");
    let report = ipam.check(false).await.expect("check");
    let new_pool_intact = pools
        .iter()
        .any(|p| p.name == "a" && p.cidr == net("10.0.2.0/26") && !p.disabled);
    assert!(
        report.problems.is_empty() && new_pool_intact && !held.is_empty(),
        "delete_pool(a) of 10.0.0.0/26 answered {deletion:?}; meanwhile a was deleted, created \
         again as 10.0.2.0/26 and an ADD there got {racer:?}; the racer now holds {held:?}, pools \
         left {pools:?}; check: {:#?}",
        report.problems
    );
}
