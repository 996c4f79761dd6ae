//! The allocator's cases: Calico's IPAM behaviour (and blockipam's improvements on it), run over
//! every backend through the storage trait.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipam_core::check::{kinds, CheckReport};
use ipam_core::model::keys;
use ipam_core::Family;
use ipam_core::{
    AssignIpsRequest, AssignedAddress, AutoAssignRequest, CountingStore, Ipam, IpamConfig,
    IpamError, KvStore, Op, PoolChange, PoolSpec, ReleaseRequest, Txn,
};
use ipnet::IpNet;

use crate::StoreFactory;

pub(crate) fn net(s: &str) -> IpNet {
    s.parse()
        .unwrap_or_else(|e| panic!("bad test CIDR {s}: {e}"))
}

pub(crate) fn ip(s: &str) -> IpAddr {
    s.parse()
        .unwrap_or_else(|e| panic!("bad test address {s}: {e}"))
}

pub(crate) fn spec(cidr: &str, name: &str, block_size: u8) -> PoolSpec {
    PoolSpec {
        cidr: net(cidr),
        name: Some(name.to_owned()),
        block_size: Some(block_size),
        disabled: false,
    }
}

pub(crate) fn v4(handle: &str, host: &str, n: u32) -> AutoAssignRequest {
    AutoAssignRequest {
        handle: handle.into(),
        host: host.into(),
        num_v4: n,
        ..Default::default()
    }
}

/// The handle holding `address`, if any.
pub(crate) async fn holder(ipam: &Ipam, address: IpAddr) -> Option<String> {
    ipam.get_assignment(address)
        .await
        .expect("who holds the address")
        .map(|info| info.handle)
}

/// Asserts `check` reported `key` as a corrupt object, not repairable, naming `way_out`.
pub(crate) fn assert_reported_corrupt(report: &CheckReport, key: &str, way_out: &str) {
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == kinds::CORRUPT_OBJECT
                && !p.repairable
                && p.detail.contains(key)
                && p.detail.contains(way_out)),
        "check must report {key} and the way out {way_out:?}: {report:#?}"
    );
}

/// The block holding `address`, which must be assigned.
pub(crate) async fn block_of(ipam: &Ipam, address: IpAddr) -> IpNet {
    ipam.get_assignment(address)
        .await
        .expect("read")
        .unwrap_or_else(|| panic!("{address} is assigned"))
        .block
}

/// Bytes no stored object decodes from.
pub(crate) const GARBAGE: &[u8] = b"garbage{";

/// Overwrites the object at `key` (which must exist) with [`GARBAGE`] and returns its intact
/// bytes, to put back when the case repairs it.
pub(crate) async fn damage(store: &dyn KvStore, key: &str) -> Vec<u8> {
    let intact = store
        .get(key)
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("{key} exists"))
        .value;
    store.put(key, GARBAGE.to_vec()).await.expect("damage it");
    intact
}

/// The key of the first owner key of `block` (a store of today's format keeps the attributes of
/// its allocations apart, one key per address).
pub(crate) async fn first_owner_key(store: &dyn KvStore, block: &IpNet) -> String {
    store
        .list(&keys::block_owners_dir(block))
        .await
        .expect("list the owner keys")
        .into_iter()
        .next()
        .expect("an owner key (a store of today's format keeps them apart)")
        .key
}

pub(crate) async fn assign_one(ipam: &Ipam, handle: &str, host: &str) -> IpAddr {
    assign_one_allocation(ipam, handle, host).await.ip
}

/// Auto-assigns one IPv4 address to `handle` on `host` and returns the allocation: the address and
/// the block it came from.
pub(crate) async fn assign_one_allocation(
    ipam: &Ipam,
    handle: &str,
    host: &str,
) -> AssignedAddress {
    let got = ipam
        .auto_assign(&v4(handle, host, 1))
        .await
        .unwrap_or_else(|e| panic!("assign {handle} on {host}: {e}"));
    assert_eq!(got.v4.len(), 1, "one address for {handle} on {host}");
    got.v4.into_iter().next().expect("one address")
}

pub(crate) async fn assert_clean(ipam: &Ipam) {
    let report = ipam.check(false).await.expect("check");
    assert!(
        report.problems.is_empty(),
        "consistency check found problems: {:#?}",
        report.problems
    );
}

pub(crate) async fn ipam_with_pool(
    factory: &impl StoreFactory,
    cidr: &str,
    block_size: u8,
) -> (crate::TestStore, Ipam) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    ipam.create_pool(&spec(cidr, "pool", block_size))
        .await
        .expect("create pool");
    (t, ipam)
}

/// Expands every allocator case into one `#[tokio::test]` inside a module `ipam`.
#[macro_export]
macro_rules! ipam_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(ipam, $crate::ipam, $factory;
            first_assign_claims_a_block_for_the_host,
            a_network_setup_skips_block_edges_exactly_when_a_wanted_pool_has_no_gateway,
            a_call_whose_network_reservations_cannot_be_made_hands_none_of_them_out,
            a_namespaces_pools_replace_the_requests_family_by_family,
            a_namespaces_pools_status_names_the_pools_its_pods_cannot_use,
            specific_ips_are_assigned_one_to_32_at_a_time,
            auto_assign_chooses_automatic_pools_allowing_the_use_and_selecting_the_node,
            filling_a_block_spills_into_a_second_block,
            two_hosts_get_different_blocks,
            host_uses_its_affine_blocks_before_claiming_new_ones,
            borrowing_takes_a_free_address_from_another_hosts_block,
            strict_affinity_denies_borrowing,
            block_limit_gives_a_block_limit_error,
            zero_max_blocks_per_host_means_unlimited,
            no_auto_allocate_blocks_means_no_new_blocks,
            released_address_is_reused_last,
            specific_ip_is_assigned_and_its_block_claimed,
            specific_ip_in_use_is_refused,
            specific_ip_outside_enabled_pools_is_refused,
            strict_affinity_refuses_specific_ip_in_another_hosts_block,
            dual_stack_assign_is_all_or_nothing,
            dual_stack_assign_gives_both_families,
            release_by_handle_frees_everything_and_is_idempotent,
            release_by_address_reports_unallocated_addresses,
            sequence_numbered_release_refuses_a_reallocated_address,
            empty_block_without_affinity_is_deleted,
            releasing_host_affinities_deletes_empty_blocks_and_unassigns_others,
            release_host_with_addresses_frees_that_hosts_allocations,
            claim_and_release_affinity,
            claim_affinity_takes_at_most_one_transaction_of_blocks,
            requested_pools_must_exist_and_be_enabled,
            requested_pool_restricts_allocation,
            disabled_pool_is_never_allocated_from,
            pool_validation_rejects_bad_specs,
            new_pools_overlapping_link_local_ranges_are_refused_and_a_stored_one_keeps_working,
            overlapping_pool_is_refused,
            pool_delete_is_refused_while_in_use_unless_forced,
            pool_changes_write_only_what_changes_and_a_disable_always_writes,
            pool_delete_meeting_an_address_that_landed_meanwhile_releases_it_or_refuses,
            concurrent_ensure_pool_creates_one_pool,
            reuse_existing_returns_the_addresses_already_held,
            failed_assign_changes_nothing,
            exhausted_pool_gives_exhausted_error,
            who_holds_an_address,
            utilization_counts_per_pool_and_block,
            config_round_trips_with_calico_defaults,
            steady_state_assign_is_one_read_and_one_transaction,
            corrupt_block_is_an_error_not_a_panic,
            usage_and_address_status_name_the_objects_they_cannot_decode_and_count_the_rest,
            a_pool_object_that_does_not_decode_is_listed_reported_and_deleted_alone,
            corrupt_namespace_and_node_objects_are_reported_and_stop_only_their_adds,
            check_detects_broken_state_and_repair_fixes_it,
            check_reports_blocks_outside_pools_free_list_damage_and_misplaced_blocks,
            conflicts_on_every_attempt_end_in_retries_exhausted,
            releasing_hundreds_of_addresses_at_once_works,
            full_blocks_leave_the_steady_state_read_and_return_when_freed,
            concurrent_config_updates_lose_nothing,
            eight_hosts_assigning_concurrently_get_distinct_addresses,
            random_operation_sequences_keep_every_invariant,
        );
        $crate::ipam_integrity_tests!($factory);
        $crate::model_based_conformance_tests!($factory);
        $crate::node_labels_conformance_tests!($factory);
        $crate::lifecycle_conformance_tests!($factory);
        $crate::reservations_conformance_tests!($factory);
        $crate::resize_conformance_tests!($factory);
        $crate::repair_conformance_tests!($factory);
        $crate::upgrade_conformance_tests!($factory);
        $crate::leaks_conformance_tests!($factory);
        $crate::read_cost_conformance_tests!($factory);
        $crate::full_pools_conformance_tests!($factory);
        $crate::cached_reads_conformance_tests!($factory);
    };
}

/// The first auto-assign on a host claims a block affine to it and hands out its first address.
pub async fn first_assign_claims_a_block_for_the_host<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let got = ipam
        .auto_assign(&v4("h1", "node-a", 1))
        .await
        .expect("assign");
    let block = got.v4[0].block;
    assert_eq!(block.prefix_len(), 26);
    assert_eq!(
        got.v4[0].ip,
        block.network(),
        "ordinal 0 is handed out first"
    );
    let usage = ipam.utilization().await.expect("usage");
    assert_eq!(usage.pools[0].blocks.len(), 1);
    assert_eq!(usage.pools[0].blocks[0].host.as_deref(), Some("node-a"));
    assert_clean(&ipam).await;
}

/// 64 addresses fill one /26; the 65th comes from a second block of the same host.
pub async fn filling_a_block_spills_into_a_second_block<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let mut blocks = BTreeSet::new();
    let mut addresses = BTreeSet::new();
    for i in 0..64 {
        let got = ipam
            .auto_assign(&v4(&format!("h{i}"), "node-a", 1))
            .await
            .expect("assign");
        blocks.insert(got.v4[0].block);
        assert!(addresses.insert(got.v4[0].ip));
    }
    assert_eq!(blocks.len(), 1, "64 addresses should fit one /26");
    let got = ipam
        .auto_assign(&v4("h64", "node-a", 1))
        .await
        .expect("assign 65th");
    assert!(
        !blocks.contains(&got.v4[0].block),
        "the 65th address must come from a new block"
    );
    let usage = ipam.utilization().await.expect("usage");
    assert!(usage.pools[0]
        .blocks
        .iter()
        .all(|b| b.host.as_deref() == Some("node-a")));
    assert_eq!(usage.pools[0].in_use, 65);
    assert_clean(&ipam).await;
}

/// Two hosts get addresses from two different blocks, each affine to its host.
pub async fn two_hosts_get_different_blocks<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/16", 26).await;
    let a = ipam.auto_assign(&v4("ha", "node-a", 1)).await.expect("a");
    let b = ipam.auto_assign(&v4("hb", "node-b", 1)).await.expect("b");
    assert_ne!(a.v4[0].block, b.v4[0].block);
    let usage = ipam.utilization().await.expect("usage");
    let owners: BTreeMap<IpNet, Option<String>> = usage.pools[0]
        .blocks
        .iter()
        .map(|b| (b.cidr, b.host.clone()))
        .collect();
    assert_eq!(
        owners.get(&a.v4[0].block),
        Some(&Some("node-a".to_string()))
    );
    assert_eq!(
        owners.get(&b.v4[0].block),
        Some(&Some("node-b".to_string()))
    );
    assert_clean(&ipam).await;
}

/// A host with room in its affine block never claims another one.
pub async fn host_uses_its_affine_blocks_before_claiming_new_ones<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/16", 26).await;
    let first = ipam
        .auto_assign(&v4("h0", "node-a", 1))
        .await
        .expect("assign");
    for i in 1..10 {
        let got = ipam
            .auto_assign(&v4(&format!("h{i}"), "node-a", 1))
            .await
            .expect("assign");
        assert_eq!(got.v4[0].block, first.v4[0].block);
    }
    assert_eq!(
        ipam.utilization().await.expect("usage").pools[0]
            .blocks
            .len(),
        1
    );
}

/// With no unclaimed block left, a host borrows from another host's block (strict affinity off).
pub async fn borrowing_takes_a_free_address_from_another_hosts_block<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/26", 26).await;
    let a = ipam.auto_assign(&v4("ha", "node-a", 1)).await.expect("a");
    let b = ipam
        .auto_assign(&v4("hb", "node-b", 1))
        .await
        .expect("b borrows");
    assert_eq!(b.v4[0].block, a.v4[0].block);
    let info = ipam
        .get_assignment(b.v4[0].ip)
        .await
        .expect("who")
        .expect("allocated");
    assert_eq!(info.block_host.as_deref(), Some("node-a"));
    assert_eq!(
        info.attributes.get("node").map(String::as_str),
        Some("node-b")
    );
    assert_clean(&ipam).await;
}

/// With strict affinity on, a host never borrows: the request fails instead.
pub async fn strict_affinity_denies_borrowing<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/26", 26).await;
    ipam.set_config(&IpamConfig {
        strict_affinity: true,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    ipam.auto_assign(&v4("ha", "node-a", 1)).await.expect("a");
    match ipam.auto_assign(&v4("hb", "node-b", 1)).await {
        Err(IpamError::Exhausted {
            requested: 1,
            found: 0,
            ..
        }) => {}
        other => panic!("expected exhaustion under strict affinity, got {other:?}"),
    }
    assert!(ipam.ips_by_handle("hb").await.expect("query").is_empty());
    assert_clean(&ipam).await;
}

/// A host that owns `max_blocks_per_host` full blocks gets a block-limit error (no borrowing).
pub async fn block_limit_gives_a_block_limit_error<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 30).await;
    ipam.set_config(&IpamConfig {
        max_blocks_per_host: 2,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    // Another host's block with room, to show the limit does not fall back to borrowing.
    ipam.auto_assign(&v4("other", "node-b", 1))
        .await
        .expect("b");
    for i in 0..8 {
        ipam.auto_assign(&v4(&format!("h{i}"), "node-a", 1))
            .await
            .expect("within two /30 blocks");
    }
    match ipam.auto_assign(&v4("h8", "node-a", 1)).await {
        Err(IpamError::BlockLimit {
            owned: 2, limit: 2, ..
        }) => {}
        other => panic!("expected the block limit, got {other:?}"),
    }
    // One request needing three new blocks on a host that holds none is refused whole: the
    // blocks it claims on the way count too.
    match ipam.auto_assign(&v4("many", "node-c", 9)).await {
        Err(IpamError::BlockLimit {
            owned: 2, limit: 2, ..
        }) => {}
        other => panic!("expected the block limit for nine addresses, got {other:?}"),
    }
    assert!(
        ipam.ips_by_handle("many").await.expect("many").is_empty(),
        "a refused request holds nothing"
    );
    ipam.auto_assign(&v4("eight", "node-c", 8))
        .await
        .expect("eight addresses fit in two new /30 blocks");
    assert_clean(&ipam).await;
}

/// `max_blocks_per_host = 0` means no limit (not Calico's surprising "0 means 20").
pub async fn zero_max_blocks_per_host_means_unlimited<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 30).await;
    ipam.set_config(&IpamConfig {
        max_blocks_per_host: 0,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    let got = ipam
        .auto_assign(&v4("many", "node-a", 32))
        .await
        .expect("32 addresses over 8 blocks");
    let blocks: BTreeSet<IpNet> = got.v4.iter().map(|a| a.block).collect();
    assert_eq!(blocks.len(), 8);
    assert_clean(&ipam).await;
}

/// With `auto_allocate_blocks` off, hosts only borrow from existing blocks.
pub async fn no_auto_allocate_blocks_means_no_new_blocks<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.claim_affinity("node-a", net("10.0.0.0/26"))
        .await
        .expect("claim");
    ipam.set_config(&IpamConfig {
        auto_allocate_blocks: false,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    let b = ipam
        .auto_assign(&v4("hb", "node-b", 1))
        .await
        .expect("borrow");
    assert_eq!(b.v4[0].block, net("10.0.0.0/26"));
    assert_eq!(
        ipam.utilization().await.expect("usage").pools[0]
            .blocks
            .len(),
        1
    );
}

/// A released address goes to the tail of the free list: every other free address is used first.
pub async fn released_address_is_reused_last<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/28", 28).await;
    let first = assign_one(&ipam, "h0", "node-a").await;
    for i in 1..4 {
        assign_one(&ipam, &format!("h{i}"), "node-a").await;
    }
    ipam.release_handle("h0").await.expect("release");
    // 12 never-used addresses remain; all of them come before the released one.
    let mut later = Vec::new();
    for i in 4..17 {
        later.push(assign_one(&ipam, &format!("h{i}"), "node-a").await);
    }
    assert!(
        !later[..12].contains(&first),
        "the released address came back before fresh ones: {later:?}"
    );
    assert_eq!(
        later[12], first,
        "the released address is the last one handed out"
    );
}

/// Assigning specific addresses takes 1 to 32 at once: none, or 33, is refused and writes
/// nothing; 32 are assigned.
pub async fn specific_ips_are_assigned_one_to_32_at_a_time<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let request = |count: u32| AssignIpsRequest {
        ips: (0..count)
            .map(|n| ip(&format!("10.0.0.{}", n + 1)))
            .collect(),
        handle: "h".into(),
        host: "node-a".into(),
        ..Default::default()
    };
    let before = t.store.list("").await.expect("list");
    for refused in [0, 33] {
        assert!(
            matches!(
                ipam.assign_ips(&request(refused)).await,
                Err(IpamError::InvalidArgument(_))
            ),
            "{refused} addresses at once"
        );
        assert_eq!(t.store.list("").await.expect("list"), before);
    }
    let got = ipam.assign_ips(&request(32)).await.expect("32 at once");
    assert_eq!(got.len(), 32);
    assert_clean(&ipam).await;
}

/// A specific address is assigned, and its missing block is claimed for the host.
pub async fn specific_ip_is_assigned_and_its_block_claimed<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let got = ipam
        .assign_ips(&AssignIpsRequest {
            ips: vec![ip("10.0.0.77")],
            handle: "h".into(),
            host: "node-a".into(),
            attributes: BTreeMap::new(),
            ..Default::default()
        })
        .await
        .expect("assign");
    assert_eq!(got[0].block, net("10.0.0.64/26"));
    let info = ipam
        .get_assignment(ip("10.0.0.77"))
        .await
        .expect("who")
        .expect("held");
    assert_eq!(info.handle, "h");
    assert_eq!(info.block_host.as_deref(), Some("node-a"));
    // The auto-assign cursor skips it.
    let next = ipam
        .auto_assign(&v4("h2", "node-a", 1))
        .await
        .expect("auto");
    assert_ne!(next.v4[0].ip, ip("10.0.0.77"));
    assert_clean(&ipam).await;
}

/// Assigning an address someone else holds is refused, naming the holder, and changes nothing.
pub async fn specific_ip_in_use_is_refused<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let held = assign_one(&ipam, "owner", "node-a").await;
    let before = t.store.list("").await.expect("list");
    let request = AssignIpsRequest {
        ips: vec![held],
        handle: "intruder".into(),
        host: "node-a".into(),
        attributes: BTreeMap::new(),
        ..Default::default()
    };
    match ipam.assign_ips(&request).await {
        Err(IpamError::AlreadyAssigned {
            ip: refused,
            handle,
        }) => {
            assert_eq!(refused, held);
            assert_eq!(handle, "owner");
        }
        other => panic!("expected already-assigned, got {other:?}"),
    }
    assert_eq!(t.store.list("").await.expect("list"), before);
    // The owner asking again for its own address is fine.
    let again = AssignIpsRequest {
        handle: "owner".into(),
        ..request
    };
    assert_eq!(
        ipam.assign_ips(&again).await.expect("idempotent")[0].ip,
        held
    );
}

/// An address outside every enabled pool is refused (including one in a disabled pool).
pub async fn specific_ip_outside_enabled_pools_is_refused<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&PoolSpec {
        disabled: true,
        ..spec("10.9.0.0/24", "off", 26)
    })
    .await
    .expect("disabled pool");
    let before = t.store.list("").await.expect("list");
    for outside in ["192.168.7.1", "10.9.0.5", "fd00::1"] {
        let request = AssignIpsRequest {
            ips: vec![ip(outside)],
            handle: "h".into(),
            host: "node-a".into(),
            attributes: BTreeMap::new(),
            ..Default::default()
        };
        match ipam.assign_ips(&request).await {
            Err(IpamError::NotInPool(refused)) => assert_eq!(refused, ip(outside)),
            other => panic!("expected not-in-pool for {outside}, got {other:?}"),
        }
    }
    assert_eq!(t.store.list("").await.expect("list"), before);
}

/// Under strict affinity an address in another host's block is refused.
pub async fn strict_affinity_refuses_specific_ip_in_another_hosts_block<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.set_config(&IpamConfig {
        strict_affinity: true,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    ipam.claim_affinity("node-a", net("10.0.0.0/26"))
        .await
        .expect("claim");
    let request = AssignIpsRequest {
        ips: vec![ip("10.0.0.9")],
        handle: "h".into(),
        host: "node-b".into(),
        attributes: BTreeMap::new(),
        ..Default::default()
    };
    match ipam.assign_ips(&request).await {
        Err(IpamError::AffinityConflict { owner, .. }) => assert_eq!(owner, "node-a"),
        other => panic!("expected an affinity conflict, got {other:?}"),
    }
}

/// When IPv6 cannot be had, no IPv4 address is kept either, and the store is unchanged.
pub async fn dual_stack_assign_is_all_or_nothing<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&spec("fd00::/126", "v6", 126))
        .await
        .expect("v6 pool");
    let mut request = v4("h", "node-a", 1);
    request.num_v6 = 8; // a /126 has only 4
    let before = t.store.list("").await.expect("list");
    match ipam.auto_assign(&request).await {
        Err(IpamError::Exhausted {
            family: ipam_core::Family::V6,
            ..
        }) => {}
        other => panic!("expected IPv6 exhaustion, got {other:?}"),
    }
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "IPv4 address leaked by a failed dual-stack assign"
    );
}

/// A dual-stack request gets one address of each family, both on the handle.
pub async fn dual_stack_assign_gives_both_families<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&spec("fd00::/120", "v6", 122))
        .await
        .expect("v6 pool");
    let mut request = v4("h", "node-a", 1);
    request.num_v6 = 1;
    let got = ipam.auto_assign(&request).await.expect("dual stack");
    assert_eq!((got.v4.len(), got.v6.len()), (1, 1));
    assert!(got.v6[0].ip.is_ipv6());
    assert_eq!(got.v6[0].block.prefix_len(), 122);
    assert_eq!(ipam.ips_by_handle("h").await.expect("held").len(), 2);
    assert_clean(&ipam).await;
}

/// Release by handle frees every address of the handle; doing it again, or for an unknown handle, succeeds.
pub async fn release_by_handle_frees_everything_and_is_idempotent<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 30).await;
    let got = ipam
        .auto_assign(&v4("h", "node-a", 6))
        .await
        .expect("assign over two blocks");
    let mut released = ipam.release_handle("h").await.expect("release");
    let mut expected: Vec<IpAddr> = got.v4.iter().map(|a| a.ip).collect();
    released.sort();
    expected.sort();
    assert_eq!(released, expected);
    assert!(ipam.release_handle("h").await.expect("again").is_empty());
    assert!(ipam
        .release_handle("never-existed")
        .await
        .expect("unknown")
        .is_empty());
    assert_eq!(ipam.utilization().await.expect("usage").pools[0].in_use, 0);
    assert_clean(&ipam).await;
}

/// Release by address frees allocated addresses and reports the others without failing.
pub async fn release_by_address_reports_unallocated_addresses<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let held = assign_one(&ipam, "h", "node-a").await;
    let requests: Vec<ReleaseRequest> = [held, ip("10.0.0.200"), ip("172.31.0.1")]
        .into_iter()
        .map(|ip| ReleaseRequest { ip, sequence: None })
        .collect();
    let outcome = ipam.release_ips(&requests).await.expect("release");
    assert_eq!(outcome.released, vec![held]);
    assert_eq!(
        outcome.not_allocated,
        vec![ip("10.0.0.200"), ip("172.31.0.1")]
    );
    assert!(ipam.ips_by_handle("h").await.expect("held").is_empty());
    assert_clean(&ipam).await;
}

/// A release that carries the sequence number of an earlier allocation does not free a re-allocated address.
pub async fn sequence_numbered_release_refuses_a_reallocated_address<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/30", 30).await;
    let address = ip("10.0.0.1");
    let assign = |handle: &str| AssignIpsRequest {
        ips: vec![address],
        handle: handle.into(),
        host: "node-a".into(),
        attributes: BTreeMap::new(),
        ..Default::default()
    };
    ipam.assign_ips(&assign("old")).await.expect("first owner");
    let old_sequence = ipam
        .get_assignment(address)
        .await
        .expect("who")
        .expect("held")
        .sequence;
    ipam.release_handle("old").await.expect("release");
    ipam.assign_ips(&assign("new")).await.expect("second owner");
    let late = ipam
        .release_ips(&[ReleaseRequest {
            ip: address,
            sequence: Some(old_sequence),
        }])
        .await
        .expect("late release");
    assert_eq!(late.sequence_mismatch, vec![address]);
    assert_eq!(
        ipam.get_assignment(address)
            .await
            .expect("who")
            .expect("still held")
            .handle,
        "new"
    );
    let current = ipam
        .get_assignment(address)
        .await
        .expect("who")
        .expect("held")
        .sequence;
    let ok = ipam
        .release_ips(&[ReleaseRequest {
            ip: address,
            sequence: Some(current),
        }])
        .await
        .expect("release");
    assert_eq!(ok.released, vec![address]);
}

/// When the last address of a block without affinity is released, the block is deleted.
pub async fn empty_block_without_affinity_is_deleted<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    assign_one(&ipam, "h", "node-a").await;
    let report = ipam
        .release_host("node-a", false)
        .await
        .expect("release host");
    assert_eq!(report.unassigned_blocks.len(), 1);
    assert_eq!(
        ipam.utilization().await.expect("usage").pools[0].blocks[0].host,
        None
    );
    ipam.release_handle("h").await.expect("release");
    assert!(ipam.utilization().await.expect("usage").pools[0]
        .blocks
        .is_empty());
    assert_clean(&ipam).await;
}

/// Releasing a host's affinities deletes its empty blocks and un-assigns the non-empty ones.
pub async fn releasing_host_affinities_deletes_empty_blocks_and_unassigns_others<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let used = assign_one_allocation(&ipam, "h", "node-a").await.block;
    // Claim the half of the pool the used block is not in (where it lands depends on the host hash).
    let other_half = if net("10.0.0.0/25").contains(&used.network()) {
        "10.0.0.128/25"
    } else {
        "10.0.0.0/25"
    };
    let claimed = ipam
        .claim_affinity("node-a", net(other_half))
        .await
        .expect("claim two more");
    assert_eq!(claimed.len(), 2);
    let other = assign_one_allocation(&ipam, "hb", "node-b").await.block;
    let report = ipam
        .release_host("node-a", false)
        .await
        .expect("release host");
    assert_eq!(report.unassigned_blocks, vec![used]);
    let deleted: BTreeSet<IpNet> = report.deleted_blocks.into_iter().collect();
    assert_eq!(deleted, claimed.into_iter().collect());
    let blocks = ipam.utilization().await.expect("usage").pools[0]
        .blocks
        .clone();
    let hosts: BTreeMap<IpNet, Option<String>> =
        blocks.into_iter().map(|b| (b.cidr, b.host)).collect();
    assert_eq!(hosts.get(&used), Some(&None));
    assert_eq!(hosts.get(&other), Some(&Some("node-b".into())));
    assert_eq!(hosts.len(), 2);
    // The address stays allocated until released.
    assert_eq!(ipam.ips_by_handle("h").await.expect("held").len(), 1);
    assert_clean(&ipam).await;
}

/// `release_host` with addresses frees every allocation whose node is that host, and only those.
pub async fn release_host_with_addresses_frees_that_hosts_allocations<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let a: Vec<IpAddr> = ipam
        .auto_assign(&v4("ha", "node-a", 3))
        .await
        .expect("a")
        .v4
        .into_iter()
        .map(|x| x.ip)
        .collect();
    let b = assign_one(&ipam, "hb", "node-b").await;
    let report = ipam.release_host("node-a", true).await.expect("release");
    assert_eq!(report.released_addresses, a);
    assert_eq!(report.deleted_blocks.len(), 1);
    assert!(ipam.get_assignment(b).await.expect("who").is_some());
    assert_eq!(ipam.utilization().await.expect("usage").pools[0].in_use, 1);
    assert_clean(&ipam).await;
}

/// Claiming creates blocks for a host; a block of another host cannot be claimed; releasing an
/// empty affine block deletes it.
pub async fn claim_and_release_affinity<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    assert_eq!(
        ipam.claim_affinity("node-a", net("10.0.0.0/26"))
            .await
            .expect("claim"),
        vec![net("10.0.0.0/26")]
    );
    assert_eq!(
        ipam.claim_affinity("node-a", net("10.0.0.0/26"))
            .await
            .expect("again"),
        vec![net("10.0.0.0/26")]
    );
    match ipam.claim_affinity("node-b", net("10.0.0.0/26")).await {
        Err(IpamError::BlockOwnedByOtherHost { owner, .. }) => assert_eq!(owner, "node-a"),
        other => panic!("expected owned-by-other-host, got {other:?}"),
    }
    assert!(matches!(
        ipam.claim_affinity("node-a", net("10.1.0.0/26")).await,
        Err(IpamError::NotInPool(_))
    ));
    assert!(matches!(
        ipam.release_affinity("node-b", net("10.0.0.0/26")).await,
        Err(IpamError::BlockOwnedByOtherHost { .. })
    ));
    ipam.release_affinity("node-a", net("10.0.0.0/26"))
        .await
        .expect("release");
    assert!(ipam.utilization().await.expect("usage").pools[0]
        .blocks
        .is_empty());
    assert_clean(&ipam).await;
}

/// One claim takes at most 32 blocks, all in one transaction: a CIDR of exactly 32 blocks is
/// claimed whole (every backend commits that many in one transaction); one of 64 is refused with
/// the limit named, and nothing is written.
pub async fn claim_affinity_takes_at_most_one_transaction_of_blocks<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/22", 30).await;
    let claimed = ipam
        .claim_affinity("node-a", net("10.0.0.0/25"))
        .await
        .expect("a claim of 32 blocks");
    let wanted: Vec<IpNet> = (0..32u32)
        .map(|i| net(&format!("10.0.0.{}/30", i * 4)))
        .collect();
    assert_eq!(claimed, wanted);
    let owned: BTreeSet<IpNet> = ipam.utilization().await.expect("usage").pools[0]
        .blocks
        .iter()
        .filter(|b| b.host.as_deref() == Some("node-a"))
        .map(|b| b.cidr)
        .collect();
    assert_eq!(owned, wanted.iter().copied().collect());
    let before = t.store.list("").await.expect("list");
    match ipam.claim_affinity("node-a", net("10.0.1.0/24")).await {
        Err(IpamError::InvalidArgument(message)) => assert!(
            message.contains("spans 64 blocks; claim at most 32"),
            "{message}"
        ),
        other => panic!("expected a refusal of 64 blocks, got {other:?}"),
    }
    assert_eq!(t.store.list("").await.expect("list"), before);
    assert_clean(&ipam).await;
}

/// Requested pools must exist, match the family and be enabled.
pub async fn requested_pools_must_exist_and_be_enabled<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&PoolSpec {
        disabled: true,
        ..spec("10.1.0.0/24", "off", 26)
    })
    .await
    .expect("pool");
    ipam.create_pool(&spec("fd00::/120", "six", 122))
        .await
        .expect("pool");
    let before = t.store.list("").await.expect("list");
    let with_pools = |pools: &[&str]| AutoAssignRequest {
        v4_pools: pools.iter().map(|s| s.to_string()).collect(),
        ..v4("h", "node-a", 1)
    };
    assert!(matches!(
        ipam.auto_assign(&with_pools(&["nope"])).await,
        Err(IpamError::PoolNotFound(_))
    ));
    assert!(matches!(
        ipam.auto_assign(&with_pools(&["off"])).await,
        Err(IpamError::PoolDisabled(_))
    ));
    assert!(matches!(
        ipam.auto_assign(&with_pools(&["six"])).await,
        Err(IpamError::PoolWrongFamily { .. })
    ));
    assert_eq!(t.store.list("").await.expect("list"), before);
}

/// Naming a pool (by name or CIDR) keeps the allocation inside it.
pub async fn requested_pool_restricts_allocation<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&spec("10.1.0.0/24", "second", 26))
        .await
        .expect("pool");
    for pool in ["second", "10.1.0.0/24"] {
        let request = AutoAssignRequest {
            v4_pools: vec![pool.into()],
            ..v4(&format!("h-{pool}"), "node-a", 1)
        };
        let got = ipam.auto_assign(&request).await.expect("assign");
        assert!(
            net("10.1.0.0/24").contains(&got.v4[0].ip),
            "{pool}: got {}",
            got.v4[0].ip
        );
    }
}

/// A disabled pool is never allocated from, even through blocks a host already owns there.
pub async fn disabled_pool_is_never_allocated_from<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&spec("10.1.0.0/24", "second", 26))
        .await
        .expect("pool");
    let first = assign_one(&ipam, "h0", "node-a").await;
    assert!(net("10.0.0.0/24").contains(&first));
    ipam.set_pool_disabled("pool", true).await.expect("disable");
    for i in 1..5 {
        let got = assign_one(&ipam, &format!("h{i}"), "node-a").await;
        assert!(
            net("10.1.0.0/24").contains(&got),
            "allocated {got} from a disabled pool"
        );
    }
    ipam.set_pool_disabled("second", true)
        .await
        .expect("disable");
    assert!(matches!(
        ipam.auto_assign(&v4("hx", "node-a", 1)).await,
        Err(IpamError::Exhausted { .. })
    ));
    ipam.set_pool_disabled("10.0.0.0/24", false)
        .await
        .expect("enable by CIDR");
    assert!(net("10.0.0.0/24").contains(&assign_one(&ipam, "hy", "node-a").await));
}

/// Pool creation rejects host bits, out-of-range block sizes, blocks larger than the pool and bad names.
pub async fn pool_validation_rejects_bad_specs<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    let bad = [
        spec("10.0.0.1/24", "hostbits", 26),
        spec("10.0.0.0/24", "toosmall", 19),
        spec("10.0.0.0/24", "toobig", 33),
        spec("fd00::/64", "v6small", 115),
        spec("10.0.0.0/28", "blockbigger", 26),
        spec("10.0.0.0/24", "bad/name", 26),
        spec("10.0.0.0/24", "", 26),
    ];
    for s in bad {
        match ipam.create_pool(&s).await {
            Err(IpamError::InvalidArgument(message)) => assert!(!message.is_empty()),
            other => panic!("{s:?} should be invalid, got {other:?}"),
        }
    }
    assert!(
        t.store.list("").await.expect("list").is_empty(),
        "an invalid pool wrote something"
    );
    let defaulted = ipam
        .create_pool(&PoolSpec {
            cidr: net("fd00::/64"),
            name: None,
            block_size: None,
            disabled: false,
        })
        .await
        .expect("defaults");
    assert_eq!(defaulted.block_size, 122);
    assert_eq!(defaulted.name, "fd00::-64");
}

/// A new pool overlapping its family's link-local range (169.254.0.0/16, fe80::/10) is refused,
/// by `create_pool` and `ensure_pool` alike, writing nothing; ranges next to them are not. A
/// link-local pool an earlier release stored keeps working: `ensure_pool` accepts it, and
/// addresses are handed out from it.
pub async fn new_pools_overlapping_link_local_ranges_are_refused_and_a_stored_one_keeps_working<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    for s in [
        spec("169.254.0.0/16", "all-of-it", 26),
        spec("169.254.255.0/24", "last-part", 26),
        spec("169.0.0.0/8", "around-it", 26),
        spec("0.0.0.0/0", "everything-v4", 26),
        spec("fe80::/64", "v6-part", 122),
        spec("febf:ffff::/32", "v6-last-part", 122),
        spec("fe00::/7", "v6-around-it", 122),
        spec("::/0", "everything-v6", 122),
    ] {
        for ensure in [false, true] {
            let outcome = if ensure {
                ipam.ensure_pool(&s).await
            } else {
                ipam.create_pool(&s).await
            };
            match outcome {
                Err(IpamError::InvalidArgument(message)) => assert!(
                    message.contains("link-local range") && message.contains(&s.cidr.to_string()),
                    "{s:?}: {message}"
                ),
                other => panic!("{s:?} (ensure: {ensure}) must be refused, got {other:?}"),
            }
        }
    }
    assert!(
        t.store.list("").await.expect("list").is_empty(),
        "a refused pool wrote something"
    );
    for s in [
        spec("169.253.255.0/24", "just-below", 26),
        spec("169.255.0.0/24", "just-above", 26),
        spec("fe7f:ffff::/32", "v6-just-below", 122),
        spec("fec0::/10", "v6-just-above", 122),
    ] {
        ipam.create_pool(&s)
            .await
            .unwrap_or_else(|e| panic!("{s:?} is outside link-local: {e}"));
    }
    // As an earlier release stored it, before new pools were checked.
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    let stored = Ipam::pool_from_spec(&spec("169.254.64.0/24", "stored-earlier", 26))
        .expect("a valid spec apart from its range");
    t.store
        .commit(Txn::new().then(Op::put(
            keys::pool(&stored.name),
            ipam_core::model::encode(&stored).expect("encode"),
        )))
        .await
        .expect("store the pool");
    let ensured = ipam
        .ensure_pool(&spec("169.254.64.0/24", "other-name", 26))
        .await
        .expect("the stored pool is accepted as identical");
    assert_eq!(ensured, stored);
    assert!(stored
        .cidr
        .contains(&assign_one(&ipam, "c1", "node-a").await));
}

/// A pool overlapping an existing one, or reusing its name, is refused.
pub async fn overlapping_pool_is_refused<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/16", 26).await;
    for cidr in ["10.0.5.0/24", "10.0.0.0/8", "10.0.0.0/16"] {
        assert!(
            matches!(
                ipam.create_pool(&spec(cidr, &format!("p{}", cidr.len()), 26))
                    .await,
                Err(IpamError::PoolOverlap { .. })
            ),
            "{cidr} should overlap"
        );
    }
    assert!(matches!(
        ipam.create_pool(&spec("10.1.0.0/16", "pool", 26)).await,
        Err(IpamError::PoolExists(_))
    ));
    assert_eq!(ipam.list_pools().await.expect("pools").len(), 1);
}

/// Deleting a pool with allocations is refused; with force its addresses are released and handles fixed.
pub async fn pool_delete_is_refused_while_in_use_unless_forced<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&spec("10.1.0.0/24", "other", 26))
        .await
        .expect("pool");
    let mut request = v4("h", "node-a", 1);
    request.v4_pools = vec!["pool".into()];
    ipam.auto_assign(&request).await.expect("assign");
    let mut request2 = v4("h2", "node-a", 1);
    request2.v4_pools = vec!["other".into()];
    ipam.auto_assign(&request2).await.expect("assign");
    match ipam.delete_pool("pool", false).await {
        Err(IpamError::PoolInUse { in_use: 1, .. }) => {}
        other => panic!("expected pool-in-use, got {other:?}"),
    }
    assert!(!ipam.get_pool("pool").await.expect("still there").disabled);
    let deleted = ipam.delete_pool("pool", true).await.expect("force");
    assert_eq!((deleted.released_addresses, deleted.deleted_blocks), (1, 1));
    assert!(matches!(
        ipam.get_pool("pool").await,
        Err(IpamError::PoolNotFound(_))
    ));
    assert!(
        t.store
            .get(&keys::handle("h"))
            .await
            .expect("get")
            .is_none(),
        "handle of a released address left behind"
    );
    assert_eq!(ipam.ips_by_handle("h2").await.expect("h2").len(), 1);
    assert_clean(&ipam).await;
    ipam.delete_pool("10.1.0.0/24", true)
        .await
        .expect("delete by CIDR");
    assert!(t
        .store
        .list("ipam/v1/blocks/")
        .await
        .expect("list")
        .is_empty());
}

/// A pool change that changes nothing writes nothing (the pool and the pool generation keep their
/// revisions, so no allocator re-reads the pools for it); a disable writes even a pool disabled
/// already (what a delete relies on to stop assignments racing it); a delete of a disabled, empty
/// pool writes once, to delete it.
pub async fn pool_changes_write_only_what_changes_and_a_disable_always_writes<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let hooked = crate::hooked::HookedStore::new(Arc::clone(&t.store));
    let ipam = Ipam::new(hooked.clone() as Arc<dyn KvStore>);
    ipam.create_pool(&spec("10.0.0.0/24", "pool", 26))
        .await
        .expect("pool");
    let revisions = || async {
        let pool = t.store.get(&keys::pool("pool")).await.expect("get pool");
        let generation = t
            .store
            .get(&keys::pool_generation())
            .await
            .expect("get generation");
        (pool.map(|kv| kv.revision), generation.map(|kv| kv.revision))
    };
    let before = revisions().await;
    let commits = hooked.commits();
    let unchanged = PoolChange {
        disabled: Some(false),
        ..PoolChange::default()
    };
    let pool = ipam.set_pool("pool", &unchanged).await.expect("no change");
    assert!(!pool.disabled);
    assert_eq!(hooked.commits(), commits, "a change to nothing wrote");
    assert_eq!(revisions().await, before);

    ipam.set_pool_disabled("pool", true).await.expect("disable");
    assert_eq!(hooked.commits(), commits + 1);
    let disabled = revisions().await;
    assert!(
        disabled.0 > before.0 && disabled.1 > before.1,
        "{disabled:?}"
    );
    ipam.set_pool_disabled("pool", true)
        .await
        .expect("disable again");
    assert_eq!(hooked.commits(), commits + 2, "a disable always writes");
    assert!(revisions().await.0 > disabled.0);
    assert!(ipam.get_pool("pool").await.expect("pool").disabled);

    let deleted = ipam.delete_pool("pool", false).await.expect("delete");
    assert_eq!((deleted.released_addresses, deleted.deleted_blocks), (0, 0));
    assert_eq!(
        hooked.commits(),
        commits + 3,
        "deleting a disabled, empty pool writes once"
    );
    assert_eq!(revisions().await.0, None);
}

/// A pool delete that meets a block holding an address that landed after it counted (another
/// client enabled the pool, an ADD took an address in the node's empty block, and the pool was
/// disabled again, all right before the delete's commit of that block): with force it goes round
/// again, releases the address and deletes the block and the pool (never the pool alone, leaving
/// the block outside every pool); without force it is refused naming the pool, and the address,
/// block and pool stay.
pub async fn pool_delete_meeting_an_address_that_landed_meanwhile_releases_it_or_refuses<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&spec("10.1.0.0/24", "other", 26))
        .await
        .expect("second pool");
    for pool in ["pool", "other"] {
        // An empty block affine to node-a: what a delete counts as holding nothing.
        let mut request = v4(&format!("h-{pool}"), "node-a", 1);
        request.v4_pools = vec![pool.into()];
        let held = ipam.auto_assign(&request).await.expect("assign").v4[0].ip;
        ipam.release_ips(&[ReleaseRequest {
            ip: held,
            sequence: None,
        }])
        .await
        .expect("release");
    }
    let deletes_a_block = |txn: &Txn| {
        txn.ops
            .iter()
            .any(|op| matches!(op, Op::Delete { key } if key.starts_with("ipam/v1/blocks/")))
    };
    let arm = |pool: &'static str| {
        let hooked = crate::hooked::HookedStore::new(Arc::clone(&t.store));
        let racer = ipam.clone();
        hooked.before_commit(deletes_a_block, move || async move {
            racer
                .set_pool_disabled(pool, false)
                .await
                .expect("enable again");
            let mut request = v4(&format!("late-{pool}"), "node-a", 1);
            request.v4_pools = vec![pool.into()];
            racer.auto_assign(&request).await.expect("a late ADD");
            racer
                .set_pool_disabled(pool, true)
                .await
                .expect("disable again");
        });
        hooked
    };

    let hooked = arm("pool");
    let deleted = Ipam::new(hooked.clone() as Arc<dyn KvStore>)
        .delete_pool("pool", true)
        .await
        .expect("forced delete");
    assert!(hooked.commit_hook_fired(), "the race never ran");
    assert_eq!(
        (deleted.released_addresses, deleted.deleted_blocks),
        (1, 1),
        "the late address released, its block deleted"
    );
    assert!(ipam
        .ips_by_handle("late-pool")
        .await
        .expect("late")
        .is_empty());
    assert!(matches!(
        ipam.get_pool("pool").await,
        Err(IpamError::PoolNotFound(_))
    ));

    let hooked = arm("other");
    match Ipam::new(hooked.clone() as Arc<dyn KvStore>)
        .delete_pool("other", false)
        .await
    {
        Err(IpamError::PoolInUse { pool, in_use: 1 }) => assert_eq!(pool, "other"),
        other => panic!("expected the pool in use, got {other:?}"),
    }
    assert!(hooked.commit_hook_fired(), "the race never ran");
    assert_eq!(
        ipam.ips_by_handle("late-other").await.expect("late").len(),
        1
    );
    ipam.get_pool("other").await.expect("the pool stays");
    let blocks = t.store.list("ipam/v1/blocks/").await.expect("list");
    assert_eq!(
        blocks.len(),
        1,
        "only the block of the pool kept: {blocks:?}"
    );
    assert_clean(&ipam).await;
}

/// Many concurrent `ensure_pool` calls with the same spec create exactly one pool and all succeed.
pub async fn concurrent_ensure_pool_creates_one_pool<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let ipam = ipam.clone();
        tasks.push(tokio::spawn(async move {
            ipam.ensure_pool(&spec("10.0.0.0/16", "shared", 26)).await
        }));
    }
    for task in tasks {
        let pool = task.await.expect("join").expect("ensure");
        assert_eq!(pool.cidr, net("10.0.0.0/16"));
    }
    assert_eq!(ipam.list_pools().await.expect("pools").len(), 1);
    // A different pool under the same name is an error, not silently accepted.
    assert!(ipam
        .ensure_pool(&spec("10.5.0.0/16", "shared", 26))
        .await
        .is_err());
}

/// With `reuse_existing`, a repeated request for a handle returns what it holds and allocates nothing.
pub async fn reuse_existing_returns_the_addresses_already_held<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let mut request = v4("net.container", "node-a", 1);
    request.reuse_existing = true;
    let first = ipam.auto_assign(&request).await.expect("first");
    assert!(!first.reused);
    let before = t.store.list("").await.expect("list");
    let second = ipam.auto_assign(&request).await.expect("second");
    assert!(second.reused);
    assert_eq!(second.v4, first.v4);
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "a repeated request wrote something"
    );

    // Addresses in a block the host keeps as full (outside its steady-state read) are returned too.
    let (t, ipam) = ipam_with_pool(factory, "10.1.0.0/24", 30).await;
    let mut request = v4("net.six", "node-a", 6);
    request.reuse_existing = true;
    let first = ipam.auto_assign(&request).await.expect("first");
    let blocks: BTreeSet<IpNet> = first.v4.iter().map(|a| a.block).collect();
    assert_eq!(blocks.len(), 2, "one /30 full, one half full: {first:?}");
    let before = t.store.list("").await.expect("list");
    let second = ipam.auto_assign(&request).await.expect("second");
    assert!(second.reused);
    assert_eq!(second.v4, first.v4);
    assert_eq!(t.store.list("").await.expect("list"), before);
}

/// A failing auto-assign (exhausted) leaves the store exactly as it was.
pub async fn failed_assign_changes_nothing<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/30", 30).await;
    ipam.auto_assign(&v4("a", "node-a", 3))
        .await
        .expect("three of four");
    let before = t.store.list("").await.expect("list");
    assert!(ipam.auto_assign(&v4("b", "node-a", 2)).await.is_err());
    assert_eq!(t.store.list("").await.expect("list"), before);
    assert!(matches!(
        ipam.auto_assign(&v4("bad/handle\n", "node-a", 1)).await,
        Err(IpamError::InvalidArgument(_))
    ));
    assert!(matches!(
        ipam.auto_assign(&v4("h", "bad/host", 1)).await,
        Err(IpamError::InvalidArgument(_))
    ));
    assert!(matches!(
        ipam.auto_assign(&v4("h", "node-a", 1000)).await,
        Err(IpamError::InvalidArgument(_))
    ));
    assert_eq!(t.store.list("").await.expect("list"), before);
}

/// When every address is taken the error says how many were wanted and found.
pub async fn exhausted_pool_gives_exhausted_error<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/29", 30).await;
    for i in 0..8 {
        assign_one(
            &ipam,
            &format!("h{i}"),
            if i % 2 == 0 { "node-a" } else { "node-b" },
        )
        .await;
    }
    match ipam.auto_assign(&v4("last", "node-c", 1)).await {
        Err(IpamError::Exhausted {
            requested: 1,
            found: 0,
            pools,
            ..
        }) => assert_eq!(pools, vec!["pool".to_string()]),
        other => panic!("expected exhaustion, got {other:?}"),
    }
    let empty = factory.fresh().await;
    let no_pools = Ipam::new(Arc::clone(&empty.store));
    assert!(matches!(
        no_pools.auto_assign(&v4("h", "node-a", 1)).await,
        Err(IpamError::Exhausted { .. })
    ));
}

/// `get_assignment` reports the holder, attributes and block; a free address reports nothing.
pub async fn who_holds_an_address<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let mut request = v4("net.abc", "node-a", 1);
    request.attributes.insert("pod".into(), "web-0".into());
    request.attributes.insert("namespace".into(), "prod".into());
    let got = ipam.auto_assign(&request).await.expect("assign");
    let info = ipam
        .get_assignment(got.v4[0].ip)
        .await
        .expect("who")
        .expect("held");
    assert_eq!(info.handle, "net.abc");
    assert_eq!(info.block, got.v4[0].block);
    assert_eq!(
        info.attributes.get("pod").map(String::as_str),
        Some("web-0")
    );
    assert_eq!(
        info.attributes.get("node").map(String::as_str),
        Some("node-a")
    );
    assert_eq!(
        ipam.get_assignment(ip("10.0.0.250")).await.expect("who"),
        None
    );
    assert_eq!(ipam.get_assignment(ip("8.8.8.8")).await.expect("who"), None);
    assert_eq!(ipam.list_allocations().await.expect("all").len(), 1);
    let by_handle = ipam
        .allocations_by_handle("net.abc")
        .await
        .expect("by handle");
    assert_eq!(by_handle, vec![info]);
    assert!(ipam
        .allocations_by_handle("unknown")
        .await
        .expect("unknown handle")
        .is_empty());
}

/// Utilisation adds up per block and per pool.
pub async fn utilization_counts_per_pool_and_block<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.auto_assign(&v4("a", "node-a", 3)).await.expect("a");
    ipam.auto_assign(&v4("b", "node-b", 2)).await.expect("b");
    let usage = ipam.utilization().await.expect("usage");
    let pool = &usage.pools[0];
    assert_eq!((pool.capacity, pool.in_use, pool.free), (256, 5, 251));
    assert_eq!(pool.blocks.len(), 2);
    for block in &pool.blocks {
        assert_eq!(block.capacity, 64);
        assert_eq!(block.in_use + block.free, 64);
        assert_eq!(block.pool.as_deref(), Some("pool"));
    }
    assert!(usage.orphan_blocks.is_empty());
}

/// The config defaults are Calico's, except that 0 blocks per host means unlimited; set then get round-trips.
pub async fn config_round_trips_with_calico_defaults<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    let defaults = ipam.get_config().await.expect("get");
    assert_eq!(
        defaults,
        IpamConfig {
            strict_affinity: false,
            auto_allocate_blocks: true,
            max_blocks_per_host: 20,
            ip_cooldown_seconds: 0,
            empty_block_reclaim_seconds: 60,
        }
    );
    let changed = IpamConfig {
        strict_affinity: true,
        auto_allocate_blocks: false,
        max_blocks_per_host: 0,
        ip_cooldown_seconds: 1200,
        empty_block_reclaim_seconds: 5,
    };
    ipam.set_config(&changed).await.expect("set");
    assert_eq!(ipam.get_config().await.expect("get"), changed);
}

/// Once a host has an affine block with room, an auto-assign costs one read and one transaction.
pub async fn steady_state_assign_is_one_read_and_one_transaction<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let counting = Arc::new(CountingStore::new(Arc::clone(&t.store)));
    let ipam = Ipam::new(counting.clone());
    ipam.create_pool(&spec("10.0.0.0/24", "pool", 26))
        .await
        .expect("pool");
    ipam.auto_assign(&v4("warm", "node-a", 1))
        .await
        .expect("first assign claims the block");
    counting.take();
    ipam.auto_assign(&v4("steady", "node-a", 1))
        .await
        .expect("steady assign");
    let trips = counting.take();
    assert_eq!(
        (trips.reads, trips.commits),
        (1, 1),
        "steady-state assign made {trips:?}"
    );
}

/// A block whose stored bytes are damaged makes the operations that need it fail with a corruption
/// error (a new pod of its node is served from another block), and the check reports it; nothing
/// panics.
pub async fn corrupt_block_is_an_error_not_a_panic<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let got = ipam
        .auto_assign(&v4("h", "node-a", 1))
        .await
        .expect("assign");
    let key = keys::block(Some("node-a"), &got.v4[0].block);
    let stored = t.store.get(&key).await.expect("get").expect("block exists");
    let mut damaged = stored.value.clone();
    damaged.truncate(damaged.len() / 2);
    t.store.put(&key, damaged).await.expect("damage it");
    // The pod whose address lies in it: a corruption error, never a second address.
    match ipam
        .auto_assign(&AutoAssignRequest {
            reuse_existing: true,
            ..v4("h", "node-a", 1)
        })
        .await
    {
        Err(IpamError::Corrupt { key: bad, .. }) => assert_eq!(bad, key),
        other => panic!("expected a corruption error, got {other:?}"),
    }
    // Another pod of the node: passed over, its address comes from another block.
    let other = ipam
        .auto_assign(&v4("h2", "node-a", 1))
        .await
        .expect("an address past the damaged block");
    assert_ne!(other.v4[0].block, got.v4[0].block);
    let report = ipam.check(false).await.expect("check runs");
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == kinds::CORRUPT_OBJECT && p.detail.contains(&key)),
        "{report:#?}"
    );
    t.store.put(&key, vec![]).await.expect("empty it");
    assert!(matches!(
        ipam.release_handle("h").await,
        Err(IpamError::Corrupt { .. })
    ));
}

/// One damaged object hides no other from the usage figures or from what is known of an address:
/// a block, a pool and a reservation that cannot be decoded are each named, with what is wrong,
/// and left out; everything else is counted as before, and once they are restored nothing is
/// named.
pub async fn usage_and_address_status_name_the_objects_they_cannot_decode_and_count_the_rest<
    F: StoreFactory,
>(
    factory: &F,
) {
    use ipam_core::reservations::Reservation;
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&spec("10.1.0.0/24", "other", 26))
        .await
        .expect("second pool");
    let on_a = assign_one_allocation(&ipam, "a", "node-a").await;
    let on_b = assign_one_allocation(&ipam, "b", "node-b").await;
    for (name, cidr) in [
        ("kept", on_b.block.to_string()),
        ("lost", "10.0.0.250/32".into()),
        ("apart", "10.0.0.249/32".into()),
    ] {
        ipam.add_reservation(&Reservation {
            name: name.into(),
            cidrs: vec![net(&cidr)],
        })
        .await
        .expect("reserve");
    }
    let clean = ipam.utilization().await.expect("usage");
    assert!(clean.undecodable.is_empty(), "{clean:#?}");
    let block_key = keys::block(Some("node-a"), &on_a.block);
    let damaged = [
        block_key.clone(),
        keys::pool("other"),
        keys::reservation_key("lost"),
    ];
    let mut kept = Vec::new();
    for key in &damaged {
        kept.push(damage(t.store.as_ref(), key).await);
    }
    let mut named = damaged.to_vec();
    named.sort();
    for usage in [
        ipam.utilization()
            .await
            .expect("usage past damaged objects"),
        ipam.utilization_and_allocations()
            .await
            .expect("usage and allocations past damaged objects")
            .0,
    ] {
        let keys_named: Vec<&str> = usage.undecodable.iter().map(|o| o.key.as_str()).collect();
        assert_eq!(keys_named, named, "{usage:#?}");
        assert!(
            usage
                .undecodable
                .iter()
                .all(|o| o.message.contains("format version")),
            "each says what is wrong: {usage:#?}"
        );
        assert_eq!(
            usage
                .undecodable
                .iter()
                .filter_map(|o| o.block())
                .collect::<Vec<_>>(),
            vec![(Some("node-a"), on_a.block)],
            "a damaged block's key still names its host and CIDR"
        );
        // The damaged pool is left out; the sound one counts its sound block and reservation.
        assert_eq!(usage.pools.len(), 1, "{usage:#?}");
        let pool = &usage.pools[0];
        assert_eq!(pool.pool.name, "pool");
        let blocks: Vec<IpNet> = pool.blocks.iter().map(|b| b.cidr).collect();
        assert_eq!(blocks, vec![on_b.block]);
        assert_eq!(pool.in_use, 1);
        assert_eq!(pool.reserved, 65, "the sound reservations still count");
        assert_eq!(pool.free, 256 - 65);
    }
    let (allocations, blocks_named) = ipam.list_allocations_each().await.expect("allocations");
    assert_eq!(
        allocations.iter().map(|a| a.ip).collect::<Vec<_>>(),
        vec![on_b.ip],
        "the allocations of the blocks that decode"
    );
    assert_eq!(
        blocks_named
            .iter()
            .map(|o| o.key.as_str())
            .collect::<Vec<_>>(),
        vec![block_key.as_str()]
    );
    match ipam.list_allocations().await {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, block_key),
        other => panic!("the whole listing names the damaged block, got {other:?}"),
    }
    let status = ipam.address_status(on_b.ip).await.expect("status");
    assert_eq!(
        status.allocation.as_ref().map(|a| a.handle.as_str()),
        Some("b")
    );
    assert_eq!(status.reserved_by, vec!["kept".to_owned()]);
    let status_named: Vec<&str> = status.undecodable.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(
        status_named,
        vec![keys::reservation_key("lost"), keys::pool("other")],
        "an address's status names the pool and reservation objects it could not read"
    );
    // Who holds an address of the damaged block cannot be told past it.
    match ipam.address_status(on_a.ip).await {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, block_key),
        other => panic!("expected the block's corruption error, got {other:?}"),
    }
    for (key, value) in damaged.iter().zip(kept) {
        t.store.put(key, value).await.expect("restore");
    }
    let restored = ipam.utilization().await.expect("usage");
    assert!(restored.undecodable.is_empty(), "{restored:#?}");
    assert_eq!(restored.pools.len(), 2);
    assert_eq!(restored.pools[0].in_use, 2);
    assert!(ipam
        .address_status(on_b.ip)
        .await
        .expect("status")
        .undecodable
        .is_empty());
}

/// A pool object whose stored bytes are damaged stops every ADD; the listing of each pool shows
/// it beside the others, `check` reports it with the way out, and deleting the object alone (its
/// CIDR is unknown) keeps its blocks and their allocations, which a pool added again with its
/// CIDR owns once more. A pool that decodes is not deleted that way.
pub async fn a_pool_object_that_does_not_decode_is_listed_reported_and_deleted_alone<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&spec("10.1.0.0/24", "other", 26))
        .await
        .expect("second pool");
    let held = ipam
        .auto_assign(&v4("h", "node-a", 1))
        .await
        .expect("assign")
        .v4[0]
        .ip;
    assert!(
        net("10.0.0.0/24").contains(&held),
        "{held} is in the pool damaged below"
    );
    let key = keys::pool("pool");
    let stored = t.store.get(&key).await.expect("get").expect("the pool");
    t.store
        .put(&key, vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff])
        .await
        .expect("damage it");

    match ipam.auto_assign(&v4("h2", "node-b", 1)).await {
        Err(IpamError::Corrupt { key: bad, .. }) => assert_eq!(bad, key),
        other => panic!("an ADD must stop at the damaged pool, got {other:?}"),
    }
    let (sound, damaged) = ipam.list_pools_each().await.expect("list each");
    assert_eq!(
        sound.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
        vec!["other"]
    );
    assert_eq!(damaged.len(), 1, "{damaged:?}");
    assert_eq!(damaged[0].0, "pool");
    assert!(
        matches!(&damaged[0].1, IpamError::Corrupt { key: bad, .. } if *bad == key),
        "{damaged:?}"
    );
    assert_reported_corrupt(
        &ipam.check(false).await.expect("check"),
        &key,
        "`blockipamctl pool delete pool --force`",
    );
    assert!(
        matches!(
            ipam.delete_undecodable_pool("other").await,
            Err(IpamError::InvalidArgument(_))
        ),
        "a sound pool is not deleted alone"
    );
    assert!(matches!(
        ipam.delete_undecodable_pool("nope").await,
        Err(IpamError::PoolNotFound(_))
    ));

    let generation = || async {
        t.store
            .get(&keys::pool_generation())
            .await
            .expect("get")
            .map(|kv| kv.revision)
    };
    let generation_before = generation().await;
    let damage = ipam
        .delete_undecodable_pool("pool")
        .await
        .expect("delete the damaged object");
    assert_ne!(
        generation().await,
        generation_before,
        "a pool write moves the pool generation"
    );
    assert!(
        matches!(&damage, IpamError::Corrupt { key: bad, .. } if *bad == key),
        "{damage:?}"
    );
    assert_eq!(t.store.get(&key).await.expect("get"), None);
    assert_eq!(
        holder(&ipam, held).await,
        None,
        "outside every pool for now"
    );
    ipam.auto_assign(&v4("h2", "node-b", 1))
        .await
        .expect("ADDs work again, from the other pool");
    // The pool added again as it was owns its block and allocation once more.
    t.store
        .put(&key, stored.value)
        .await
        .expect("the pool again");
    assert_eq!(holder(&ipam, held).await, Some("h".to_owned()));
    assert_clean(&ipam).await;
}

/// A namespace's pools setting or a node's labels whose stored bytes are damaged: `check` reports
/// each (naming its key and the way out, not repairable), only the ADDs that read it fail (in that
/// namespace, on that node), and a new setting given for the namespace replaces the damaged one.
pub async fn corrupt_namespace_and_node_objects_are_reported_and_stop_only_their_adds<
    F: StoreFactory,
>(
    factory: &F,
) {
    use ipam_core::allocator::NamespaceLookup;
    use ipam_core::namespaces::{namespace_key, NamespacePools};
    use ipam_core::nodes::node_key;

    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let damaged = vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff];
    let namespace = namespace_key("web");
    let node = node_key("node-b");
    for key in [&namespace, &node] {
        t.store.put(key, damaged.clone()).await.expect("damage it");
    }
    let report = ipam.check(false).await.expect("check runs");
    for (key, way_out) in [
        (
            &namespace,
            "`blockipamctl namespace pools web` with --ipv4/--ipv6 or --clear",
        ),
        (
            &node,
            "`blockipamctl node label node-b <KEY=VALUE>... --replace`",
        ),
    ] {
        assert_reported_corrupt(&report, key, way_out);
    }
    let in_namespace = |handle: &str, host: &str, namespace: &str| AutoAssignRequest {
        namespace: Some(NamespaceLookup {
            namespace: namespace.into(),
            v4: true,
            v6: true,
        }),
        ..v4(handle, host, 1)
    };
    ipam.auto_assign(&in_namespace("h1", "node-a", "api"))
        .await
        .expect("another namespace on another node is not affected");
    match ipam.auto_assign(&in_namespace("h2", "node-a", "web")).await {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, namespace),
        other => panic!("expected the namespace setting's corruption, got {other:?}"),
    }
    match ipam.auto_assign(&v4("h3", "node-b", 1)).await {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, node),
        other => panic!("expected the node object's corruption, got {other:?}"),
    }
    // The operator's way out for the namespace: say what its setting is to be.
    ipam.set_namespace_pools("web", &NamespacePools::default())
        .await
        .expect("clear the damaged setting");
    assert_eq!(ipam.namespace_pools("web").await.expect("read"), None);
    ipam.auto_assign(&in_namespace("h2", "node-a", "web"))
        .await
        .expect("the namespace's ADDs work again");
    // A label update never writes over the node's labels (the conformance case of node
    // labels); replacing them whole does.
    let rack = [("rack".to_owned(), "r1".to_owned())];
    assert_eq!(
        ipam.replace_node_labels("node-b", &rack)
            .await
            .expect("replace the damaged labels"),
        BTreeMap::from(rack.clone())
    );
    assert_eq!(
        ipam.node_labels("node-b").await.expect("read"),
        BTreeMap::from(rack)
    );
    ipam.auto_assign(&v4("h3", "node-b", 1))
        .await
        .expect("the node's ADDs work again");
    ipam.replace_node_labels("node-b", &[])
        .await
        .expect("replace them with none");
    assert_eq!(
        t.store.get(&node).await.expect("get"),
        None,
        "no labels, no object"
    );
    assert_clean(&ipam).await;
}

/// The check finds deliberately broken objects, and repair fixes what it safely can.
pub async fn check_detects_broken_state_and_repair_fixes_it<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let got = ipam
        .auto_assign(&v4("h", "node-a", 2))
        .await
        .expect("assign");
    assert_clean(&ipam).await;
    // Break it: handle over-counts, a handle that owns nothing, an orphaned claim, a missing handle.
    let mut wrong = ipam_core::model::Handle::default();
    wrong.add(got.v4[0].block, 5);
    t.store
        .put(
            &keys::handle("h"),
            ipam_core::model::encode(&wrong).expect("encode"),
        )
        .await
        .expect("put");
    let mut ghost = ipam_core::model::Handle::default();
    ghost.add(net("10.0.0.64/26"), 1);
    t.store
        .put(
            &keys::handle("ghost"),
            ipam_core::model::encode(&ghost).expect("encode"),
        )
        .await
        .expect("put");
    let existing: BTreeSet<IpNet> = ipam.utilization().await.expect("usage").pools[0]
        .blocks
        .iter()
        .map(|b| b.cidr)
        .collect();
    let orphan = [
        "10.0.0.0/26",
        "10.0.0.64/26",
        "10.0.0.128/26",
        "10.0.0.192/26",
    ]
    .into_iter()
    .map(net)
    .find(|c| !existing.contains(c))
    .expect("a block that does not exist");
    t.store
        .put(
            &keys::block_claim(&orphan),
            ipam_core::model::encode(&ipam_core::model::Claim {
                affinity: Some("node-z".to_string()),
                free: 64,
                emptied_at: None,
                last_cooling_release: None,
            })
            .expect("encode"),
        )
        .await
        .expect("put");
    let lost = ipam
        .auto_assign(&v4("lost", "node-a", 1))
        .await
        .expect("assign");
    t.store.delete(&keys::handle("lost")).await.expect("delete");

    let report = ipam.check(false).await.expect("check");
    let found: BTreeSet<&str> = report.problems.iter().map(|p| p.kind.as_str()).collect();
    for kind in [
        kinds::HANDLE_COUNT,
        kinds::ORPHANED_CLAIM,
        kinds::MISSING_HANDLE,
    ] {
        assert!(found.contains(kind), "check missed {kind}: {report:#?}");
    }
    // Each handle problem lists the addresses the blocks hold for the handle.
    let listed = |kind: &str, handle: &str| -> Vec<IpAddr> {
        report
            .problems
            .iter()
            .find(|p| p.kind == kind && p.handle.as_deref() == Some(handle))
            .unwrap_or_else(|| panic!("no {kind} problem for {handle}: {report:#?}"))
            .addresses
            .iter()
            .map(|a| a.ip)
            .collect()
    };
    let mut held: Vec<IpAddr> = got.v4.iter().map(|a| a.ip).collect();
    held.sort();
    assert_eq!(listed(kinds::HANDLE_COUNT, "h"), held);
    assert_eq!(listed(kinds::HANDLE_COUNT, "ghost"), Vec::<IpAddr>::new());
    assert_eq!(listed(kinds::MISSING_HANDLE, "lost"), [lost.v4[0].ip]);
    assert!(report.repaired.is_empty(), "a plain check must not repair");
    // Each handle problem says what the handle records and what the blocks hold: per block, and
    // which addresses are kept apart.
    let detail = |kind: &str, handle: &str| -> &str {
        &report
            .problems
            .iter()
            .find(|p| p.kind == kind && p.handle.as_deref() == Some(handle))
            .unwrap_or_else(|| panic!("no {kind} problem for {handle}: {report:#?}"))
            .detail
    };
    let apart = |block: IpNet, addresses: &[IpAddr]| -> String {
        addresses
            .iter()
            .map(|a| match (a, block.network()) {
                (IpAddr::V4(a), IpAddr::V4(n)) => {
                    format!("{block}#{}", u32::from(*a) - u32::from(n))
                }
                _ => panic!("an IPv4 address in an IPv4 block"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (block, lost_block) = (got.v4[0].block, lost.v4[0].block);
    let h_now = format!("{{\"{block}\": 2}} (kept apart: {})", apart(block, &held));
    let lost_now = format!(
        "{{\"{lost_block}\": 1}} (kept apart: {})",
        apart(lost_block, &[lost.v4[0].ip])
    );
    assert_eq!(
        detail(kinds::HANDLE_COUNT, "h"),
        format!("handle \"h\" records {{\"{block}\": 5}} but the blocks hold {h_now}")
    );
    assert_eq!(
        detail(kinds::HANDLE_COUNT, "ghost"),
        "handle \"ghost\" records {\"10.0.0.64/26\": 1} but the blocks hold {}"
    );
    assert_eq!(
        detail(kinds::MISSING_HANDLE, "lost"),
        format!("blocks hold {{\"{lost_block}\": 1}} for handle \"lost\", which does not exist")
    );
    let repaired = ipam.check(true).await.expect("repair");
    for done in [
        format!("rewrote handle \"h\" as {h_now}"),
        format!("rewrote handle \"lost\" as {lost_now}"),
        "deleted handle \"ghost\", which holds no address".to_owned(),
    ] {
        assert!(
            repaired.repaired.contains(&done),
            "not repaired: {done}: {:#?}",
            repaired.repaired
        );
    }
    assert!(!repaired.repaired.is_empty());
    assert_clean(&ipam).await;
    assert_eq!(ipam.ips_by_handle("h").await.expect("h").len(), 2);
    assert_eq!(ipam.ips_by_handle("lost").await.expect("lost").len(), 1);
    assert!(ipam.release_handle("lost").await.expect("release").len() == 1);
    assert_clean(&ipam).await;
}

/// 8 simulated hosts × 100 auto-assigns (4 at a time per host) against one store: every address
/// is distinct, every handle holds exactly one, and the consistency check is clean.
pub async fn eight_hosts_assigning_concurrently_get_distinct_addresses<F: StoreFactory>(
    factory: &F,
) {
    const HOSTS: usize = 8;
    const PER_HOST: usize = 100;
    const PER_HOST_CONCURRENCY: usize = 4;
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/20", 26).await;
    let by_address =
        assign_concurrently(|_| ipam.clone(), HOSTS, PER_HOST, PER_HOST_CONCURRENCY).await;
    assert_allocations_are(&ipam, &by_address).await;
    assert_clean(&ipam).await;
}

/// `per_host` assigns of one IPv4 address on each of `hosts` hosts (`node-<n>`), `lanes` at once
/// per host, host `n` through `ipam_of(n)`: panics on a failed assign or an address handed out
/// twice, and returns each address with the handle it went to.
pub(crate) async fn assign_concurrently(
    ipam_of: impl Fn(usize) -> Ipam,
    hosts: usize,
    per_host: usize,
    lanes: usize,
) -> BTreeMap<IpAddr, String> {
    let mut tasks = Vec::new();
    for host in 0..hosts {
        let ipam = ipam_of(host);
        for lane in 0..lanes {
            let ipam = ipam.clone();
            tasks.push(tokio::spawn(async move {
                let mut got = Vec::new();
                for i in (lane..per_host).step_by(lanes) {
                    let handle = format!("net.h{host}-c{i}");
                    let result = ipam
                        .auto_assign(&v4(&handle, &format!("node-{host}"), 1))
                        .await;
                    let address = result.unwrap_or_else(|e| panic!("{handle}: {e}"));
                    got.push((handle, address.v4[0].ip));
                }
                got
            }));
        }
    }
    let mut by_address: BTreeMap<IpAddr, String> = BTreeMap::new();
    for task in tasks {
        for (handle, address) in task.await.expect("worker panicked") {
            if let Some(previous) = by_address.insert(address, handle.clone()) {
                panic!("{address} handed to both {previous} and {handle}");
            }
        }
    }
    assert_eq!(by_address.len(), hosts * per_host);
    by_address
}

/// The store holds exactly the allocations of `by_address`, and checks clean.
pub(crate) async fn assert_allocations_are(ipam: &Ipam, by_address: &BTreeMap<IpAddr, String>) {
    let allocations = ipam.list_allocations().await.expect("list");
    assert_eq!(allocations.len(), by_address.len());
    for info in &allocations {
        assert_eq!(by_address.get(&info.ip), Some(&info.handle));
    }
    assert_clean(ipam).await;
}

/// Random sequences of assigns and releases, checked after every step against a model (the set of
/// addresses each handle holds) and the consistency check.
pub async fn random_operation_sequences_keep_every_invariant<F: StoreFactory>(factory: &F) {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestCaseError, TestRunner};

    #[derive(Debug, Clone)]
    enum Step {
        Assign { handle: u8, host: u8, count: u8 },
        AssignSpecific { handle: u8, host: u8, offset: u8 },
        ReleaseHandle { handle: u8 },
        ReleaseAddress { offset: u8 },
        ReleaseHost { host: u8 },
    }
    let step = prop_oneof![
        4 => (0u8..6, 0u8..3, 1u8..4).prop_map(|(handle, host, count)| Step::Assign { handle, host, count }),
        1 => (0u8..6, 0u8..3, any::<u8>()).prop_map(|(handle, host, offset)| Step::AssignSpecific { handle, host, offset }),
        2 => (0u8..6).prop_map(|handle| Step::ReleaseHandle { handle }),
        1 => any::<u8>().prop_map(|offset| Step::ReleaseAddress { offset }),
        1 => (0u8..3).prop_map(|host| Step::ReleaseHost { host }),
    ];
    let cases = std::env::var("BLOCKIPAM_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let runtime = tokio::runtime::Handle::current();
    let result = runner.run(&proptest::collection::vec(step, 1..30), |steps| {
        tokio::task::block_in_place(|| {
            runtime.block_on(async {
                let t = factory.fresh().await;
                let ipam = Ipam::new(Arc::clone(&t.store));
                ipam.create_pool(&spec("10.0.0.0/26", "pool", 29))
                    .await
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let mut model: BTreeMap<String, BTreeSet<IpAddr>> = BTreeMap::new();
                for step in steps {
                    match step {
                        Step::Assign {
                            handle,
                            host,
                            count,
                        } => {
                            let handle = format!("h{handle}");
                            let result = ipam
                                .auto_assign(&v4(
                                    &handle,
                                    &format!("node-{host}"),
                                    u32::from(count),
                                ))
                                .await;
                            match result {
                                Ok(got) => {
                                    prop_assert_eq!(got.v4.len(), usize::from(count));
                                    for a in got.v4 {
                                        let fresh =
                                            model.values().all(|held| !held.contains(&a.ip));
                                        prop_assert!(fresh, "{} handed out twice", a.ip);
                                        model.entry(handle.clone()).or_default().insert(a.ip);
                                    }
                                }
                                Err(IpamError::Exhausted { .. })
                                | Err(IpamError::BlockLimit { .. }) => {
                                    let used: usize = model.values().map(BTreeSet::len).sum();
                                    prop_assert!(
                                        used + usize::from(count) > 64,
                                        "refused {} with only {} of 64 in use",
                                        count,
                                        used
                                    );
                                }
                                Err(e) => return Err(TestCaseError::fail(e.to_string())),
                            }
                        }
                        Step::AssignSpecific {
                            handle,
                            host,
                            offset,
                        } => {
                            let handle = format!("h{handle}");
                            let address = ip(&format!("10.0.0.{}", offset % 64));
                            let holder = model
                                .iter()
                                .find(|(_, held)| held.contains(&address))
                                .map(|(h, _)| h.clone());
                            let request = AssignIpsRequest {
                                ips: vec![address],
                                handle: handle.clone(),
                                host: format!("node-{host}"),
                                attributes: BTreeMap::new(),
                                ..Default::default()
                            };
                            match (ipam.assign_ips(&request).await, holder) {
                                (Ok(_), None) => {
                                    model.entry(handle).or_default().insert(address);
                                }
                                (Ok(_), Some(h)) => prop_assert_eq!(h, handle),
                                (
                                    Err(IpamError::AlreadyAssigned { handle: h, .. }),
                                    Some(holder),
                                ) => prop_assert_eq!(h, holder),
                                (other, holder) => {
                                    return Err(TestCaseError::fail(format!(
                                        "{address}: {other:?} (model holder {holder:?})"
                                    )))
                                }
                            }
                        }
                        Step::ReleaseHandle { handle } => {
                            let handle = format!("h{handle}");
                            let released: BTreeSet<IpAddr> = ipam
                                .release_handle(&handle)
                                .await
                                .map_err(|e| TestCaseError::fail(e.to_string()))?
                                .into_iter()
                                .collect();
                            prop_assert_eq!(released, model.remove(&handle).unwrap_or_default());
                        }
                        Step::ReleaseAddress { offset } => {
                            let address = ip(&format!("10.0.0.{}", offset % 64));
                            let outcome = ipam
                                .release_ips(&[ReleaseRequest {
                                    ip: address,
                                    sequence: None,
                                }])
                                .await
                                .map_err(|e| TestCaseError::fail(e.to_string()))?;
                            let held = model.values_mut().find(|held| held.contains(&address));
                            match held {
                                Some(held) => {
                                    held.remove(&address);
                                    prop_assert_eq!(outcome.released, vec![address]);
                                }
                                None => prop_assert_eq!(outcome.not_allocated, vec![address]),
                            }
                            model.retain(|_, held| !held.is_empty());
                        }
                        Step::ReleaseHost { host } => {
                            ipam.release_host(&format!("node-{host}"), false)
                                .await
                                .map_err(|e| TestCaseError::fail(e.to_string()))?;
                        }
                    }
                    // Invariants after every step.
                    for (handle, held) in &model {
                        let actual: BTreeSet<IpAddr> = ipam
                            .ips_by_handle(handle)
                            .await
                            .map_err(|e| TestCaseError::fail(e.to_string()))?
                            .into_iter()
                            .map(|a| a.ip)
                            .collect();
                        prop_assert_eq!(
                            &actual,
                            held,
                            "handle {} holds the wrong addresses",
                            handle
                        );
                    }
                    let report = ipam
                        .check(false)
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert!(report.problems.is_empty(), "check: {:?}", report.problems);
                    let allocated = ipam
                        .list_allocations()
                        .await
                        .map_err(|e| TestCaseError::fail(e.to_string()))?
                        .len();
                    prop_assert_eq!(allocated, model.values().map(BTreeSet::len).sum::<usize>());
                }
                Ok(())
            })
        })
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

/// The check reports blocks outside every pool, free-list damage (an ordinal both free and
/// allocated, a duplicate free ordinal) and a block stored under the wrong host; repair leaves them
/// for a person and says so by still reporting them.
pub async fn check_reports_blocks_outside_pools_free_list_damage_and_misplaced_blocks<
    F: StoreFactory,
>(
    factory: &F,
) {
    use ipam_core::model::{encode, Attribute, Block};
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let attribute = Attribute {
        handle: "h".into(),
        metadata: BTreeMap::new(),
    };
    // A block in no pool, with a consistent claim entry and handle so only the pool problem shows.
    let stray_cidr = net("192.168.50.0/26");
    let mut stray = Block::new(stray_cidr, Some("node-a".into()), 0);
    stray.allocate_next(&attribute);
    // A damaged block: ordinal 1 both allocated and free, ordinal 2 free twice.
    let damaged_cidr = net("10.0.0.0/26");
    let mut damaged = Block::new(damaged_cidr, Some("node-a".into()), 0);
    damaged.allocate_next(&attribute);
    damaged.allocate_next(&attribute);
    damaged.released.push_back(1);
    damaged.released.push_back(2);
    damaged.released.push_back(2);
    // A block whose content says node-b but which is stored under node-a.
    let misplaced_cidr = net("10.0.0.64/26");
    let misplaced = Block::new(misplaced_cidr, Some("node-b".into()), 0);
    let mut handle = ipam_core::model::Handle::default();
    handle.add(stray_cidr, 1);
    handle.add(damaged_cidr, 2);
    let writes = [
        (
            keys::block(Some("node-a"), &stray_cidr),
            encode(&stray).expect("encode"),
        ),
        (
            keys::block_claim(&stray_cidr),
            ipam_core::model::encode_claim(&stray).expect("encode"),
        ),
        (
            keys::block(Some("node-a"), &damaged_cidr),
            encode(&damaged).expect("encode"),
        ),
        (
            keys::block_claim(&damaged_cidr),
            ipam_core::model::encode_claim(&damaged).expect("encode"),
        ),
        (
            keys::block(Some("node-a"), &misplaced_cidr),
            encode(&misplaced).expect("encode"),
        ),
        (
            keys::block_claim(&misplaced_cidr),
            ipam_core::model::encode_claim(&misplaced).expect("encode"),
        ),
        (keys::handle("h"), encode(&handle).expect("encode")),
    ];
    for (key, value) in writes {
        t.store.put(&key, value).await.expect("write broken object");
    }
    let report = ipam.check(false).await.expect("check");
    let details = |kind: &str| -> Vec<String> {
        report
            .problems
            .iter()
            .filter(|p| p.kind == kind)
            .map(|p| p.detail.clone())
            .collect()
    };
    assert!(
        details(kinds::BLOCK_OUTSIDE_POOLS)
            .iter()
            .any(|d| d.contains("192.168.50.0/26")),
        "{report:#?}"
    );
    let free_list = details(kinds::FREE_LIST);
    assert!(
        free_list
            .iter()
            .any(|d| d.contains("both allocated and free")),
        "{report:#?}"
    );
    assert!(free_list.iter().any(|d| d.contains("twice")), "{report:#?}");
    assert!(
        details(kinds::BLOCK_MISPLACED)
            .iter()
            .any(|d| d.contains("10.0.0.64/26")),
        "{report:#?}"
    );
    let after_repair = ipam.check(true).await.expect("repair");
    assert!(after_repair
        .problems
        .iter()
        .any(|p| p.kind == kinds::FREE_LIST && !p.repairable));
    let again = ipam.check(false).await.expect("check");
    assert!(
        again
            .problems
            .iter()
            .any(|p| p.kind == kinds::BLOCK_OUTSIDE_POOLS),
        "repair must not hide what it cannot fix"
    );
}

/// When every attempt loses its race, the allocator gives up after the configured number of
/// attempts with an error that says to try again, and writes nothing.
pub async fn conflicts_on_every_attempt_end_in_retries_exhausted<F: StoreFactory>(factory: &F) {
    use ipam_core::{KeyValue, KvError, KvStore, Read, ReadResult, RetryPolicy, Revision, Txn};

    /// Passes reads through and makes every commit lose a race.
    #[derive(Debug)]
    struct AlwaysConflicting(Arc<dyn KvStore>);

    #[async_trait::async_trait]
    impl KvStore for AlwaysConflicting {
        async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
            self.0.get(key).await
        }
        async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
            self.0.list(prefix).await
        }
        async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
            self.0.read_many(reads).await
        }
        async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
            Err(KvError::Conflict {
                key: txn
                    .conditions
                    .first()
                    .map(|c| c.key().to_owned())
                    .unwrap_or_default(),
            })
        }
    }

    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let before = t.store.list("").await.expect("list");
    let losing = Ipam::new(Arc::new(AlwaysConflicting(Arc::clone(&t.store)))).with_retry_policy(
        RetryPolicy {
            max_attempts: 4,
            ..RetryPolicy::default()
        },
    );
    match losing.auto_assign(&v4("h", "node-a", 1)).await {
        Err(e @ IpamError::RetriesExhausted { attempts: 4 }) => {
            assert!(e.is_retryable());
            assert!(e.to_string().contains("try again later"), "{e}");
        }
        other => panic!("expected retries exhausted, got {other:?}"),
    }
    assert_eq!(t.store.list("").await.expect("list"), before);
    drop(ipam);
}

/// Releasing more addresses than one transaction can carry (over many blocks and handles) works,
/// in several transactions.
pub async fn releasing_hundreds_of_addresses_at_once_works<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/22", 30).await;
    ipam.set_config(&IpamConfig {
        max_blocks_per_host: 0,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    let mut all = Vec::new();
    for i in 0..100 {
        let got = ipam
            .auto_assign(&v4(&format!("h{i}"), &format!("node-{}", i % 7), 2))
            .await
            .expect("assign");
        all.extend(got.v4.into_iter().map(|a| ReleaseRequest {
            ip: a.ip,
            sequence: None,
        }));
    }
    let outcome = ipam
        .release_ips(&all)
        .await
        .expect("release 200 addresses over ~60 blocks");
    assert_eq!(outcome.released.len(), 200);
    assert_eq!(ipam.utilization().await.expect("usage").pools[0].in_use, 0);
    assert_clean(&ipam).await;
}

/// A host's full blocks are kept out of the steady-state read (so its size does not grow with the
/// node's allocations), still count toward the block limit, and come back once an address in them
/// is released.
pub async fn full_blocks_leave_the_steady_state_read_and_return_when_freed<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 30).await;
    let mut first_block = None;
    for i in 0..10 {
        let got = ipam
            .auto_assign(&v4(&format!("h{i}"), "node-a", 1))
            .await
            .expect("assign");
        first_block.get_or_insert(got.v4[0].block);
    }
    let open = t
        .store
        .list(&keys::host_open_blocks_dir("node-a"))
        .await
        .expect("list open");
    let all = t
        .store
        .list(&keys::host_blocks_dir("node-a"))
        .await
        .expect("list all");
    assert_eq!(
        (open.len(), all.len()),
        (1, 3),
        "10 addresses in /30 blocks: two full blocks, one with room"
    );
    ipam.release_handle("h0")
        .await
        .expect("release from a full block");
    let open = t
        .store
        .list(&keys::host_open_blocks_dir("node-a"))
        .await
        .expect("list open");
    assert_eq!(
        open.len(),
        2,
        "the block with a freed address is back in the steady-state read"
    );
    assert_clean(&ipam).await;
    // Three more fill the open blocks (no new block is claimed); then every block is full and out of
    // the steady-state read, and the limit still counts them all.
    ipam.auto_assign(&v4("h10", "node-a", 3))
        .await
        .expect("fill");
    assert_eq!(
        t.store
            .list(&keys::host_blocks_dir("node-a"))
            .await
            .expect("list")
            .len(),
        3
    );
    assert!(t
        .store
        .list(&keys::host_open_blocks_dir("node-a"))
        .await
        .expect("list")
        .is_empty());
    ipam.set_config(&IpamConfig {
        max_blocks_per_host: 3,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    assert!(matches!(
        ipam.auto_assign(&v4("h12", "node-a", 1)).await,
        Err(IpamError::BlockLimit { owned: 3, .. })
    ));
    assert!(first_block.is_some());
    assert_clean(&ipam).await;
}

/// Concurrent `update_config` calls changing different fields all land: none overwrites another.
pub async fn concurrent_config_updates_lose_nothing<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    let strict = {
        let ipam = ipam.clone();
        tokio::spawn(async move { ipam.update_config(|c| c.strict_affinity = true).await })
    };
    let limit = {
        let ipam = ipam.clone();
        tokio::spawn(async move { ipam.update_config(|c| c.max_blocks_per_host = 7).await })
    };
    let no_auto = {
        let ipam = ipam.clone();
        tokio::spawn(async move { ipam.update_config(|c| c.auto_allocate_blocks = false).await })
    };
    for task in [strict, limit, no_auto] {
        task.await.expect("join").expect("update");
    }
    assert_eq!(
        ipam.get_config().await.expect("get"),
        IpamConfig {
            strict_affinity: true,
            auto_allocate_blocks: false,
            max_blocks_per_host: 7,
            ..IpamConfig::default()
        }
    );
}

/// A network whose reservations cannot be made (the store refuses their writes) at its first
/// calls: each call goes on, and hands out none of the addresses the network reserves (its
/// gateway, its pool's network and broadcast addresses) all the same; once the store takes them,
/// the next call reserves them.
pub async fn a_call_whose_network_reservations_cannot_be_made_hands_none_of_them_out<
    F: StoreFactory,
>(
    factory: &F,
) {
    use ipam_core::network_setup::NetworkSetup;

    let t = factory.fresh().await;
    let hooked = crate::hooked::HookedStore::new(Arc::clone(&t.store));
    let reservation = keys::handle("net:gateway");
    let refused = reservation.clone();
    hooked.refuse_commits(move |txn| {
        txn.ops
            .iter()
            .any(|op| op.key() == refused)
            .then(|| ipam_core::KvError::unavailable("the test refuses the reservation"))
    });
    let ipam = Ipam::new(hooked.clone());
    let request = |handle: &str, n: u32| AutoAssignRequest {
        handle: handle.into(),
        host: "node-a".into(),
        num_v4: n,
        setup: Some(NetworkSetup {
            network: "net".into(),
            pools: vec![spec("10.31.0.0/29", "v4", 29)],
            gateways: vec![ip("10.31.0.1")],
            reservation_handle: "net:gateway".into(),
        }),
        ..Default::default()
    };
    // 10.31.0.0/29 holds 8 addresses; the network reserves .0, .1 (the gateway) and .7.
    let got = ipam
        .auto_assign(&request("pod-a", 5))
        .await
        .expect("the call goes on without its reservations");
    let handed_out: BTreeSet<IpAddr> = got.v4.iter().map(|a| a.ip).collect();
    let hosts: BTreeSet<IpAddr> = [
        "10.31.0.2",
        "10.31.0.3",
        "10.31.0.4",
        "10.31.0.5",
        "10.31.0.6",
    ]
    .into_iter()
    .map(ip)
    .collect();
    assert_eq!(handed_out, hosts, "a reserved address was handed out");
    let more = ipam.auto_assign(&request("pod-b", 1)).await;
    assert!(
        matches!(more, Err(IpamError::Exhausted { .. })),
        "only reserved addresses are left: {more:?}"
    );
    assert!(
        t.store.get(&reservation).await.expect("read").is_none(),
        "the reservation was refused"
    );

    // The store takes the reservation's writes again: the next call makes it.
    hooked.refuse_commits(|_| None);
    ipam.release_handle("pod-a").await.expect("release");
    let got = ipam
        .auto_assign(&request("pod-c", 1))
        .await
        .expect("the network set up");
    assert!(hosts.contains(&got.v4[0].ip), "{got:?}");
    let reserved: BTreeSet<IpAddr> = ipam
        .list_allocations()
        .await
        .expect("list")
        .into_iter()
        .filter(|a| a.handle == "net:gateway")
        .map(|a| a.ip)
        .collect();
    assert_eq!(
        reserved,
        ["10.31.0.0", "10.31.0.1", "10.31.0.7"]
            .into_iter()
            .map(ip)
            .collect(),
    );
    assert_clean(&ipam).await;
}

/// Auto-assign with a network set-up (as the CNI plugin asks): the set-up's pools are created,
/// its gateways reserved with their pool's network (and IPv4 broadcast) address, and a block's
/// network and last addresses are skipped exactly when a pool of a family the call asks for holds
/// no gateway (the caller then reports the block's prefix). Each call's family alone decides:
/// a gateway-less pool of the other family changes nothing. Every address the pool can give is
/// handed out, by the call that sets the network up (all at once), and one per call (the later
/// calls finding the network in place).
pub async fn a_network_setup_skips_block_edges_exactly_when_a_wanted_pool_has_no_gateway<
    F: StoreFactory,
>(
    factory: &F,
) {
    use ipam_core::network_setup::NetworkSetup;

    let v4_pool = "10.30.0.0/28";
    let v6_pool = "fd00:30::/124";
    // (family asked for, gateways, what the pool hands out): /30 and /126 blocks of 4 addresses.
    let cases: [(Family, &[&str], Vec<&str>); 4] = [
        // No IPv4 gateway: no block's first or last address. The IPv6 pool's gateway does not
        // make the IPv4 blocks' edges usable.
        (
            Family::V4,
            &["fd00:30::1"],
            vec![
                "10.30.0.1",
                "10.30.0.2",
                "10.30.0.5",
                "10.30.0.6",
                "10.30.0.9",
                "10.30.0.10",
                "10.30.0.13",
                "10.30.0.14",
            ],
        ),
        // An IPv4 gateway: every address but it and the pool's network and broadcast addresses,
        // block edges included, though the IPv6 pool has no gateway.
        (
            Family::V4,
            &["10.30.0.1"],
            vec![
                "10.30.0.2",
                "10.30.0.3",
                "10.30.0.4",
                "10.30.0.5",
                "10.30.0.6",
                "10.30.0.7",
                "10.30.0.8",
                "10.30.0.9",
                "10.30.0.10",
                "10.30.0.11",
                "10.30.0.12",
                "10.30.0.13",
                "10.30.0.14",
            ],
        ),
        (
            Family::V6,
            &["10.30.0.1"],
            vec![
                "fd00:30::1",
                "fd00:30::2",
                "fd00:30::5",
                "fd00:30::6",
                "fd00:30::9",
                "fd00:30::a",
                "fd00:30::d",
                "fd00:30::e",
            ],
        ),
        // An IPv6 gateway: every address but it and the pool's network address.
        (
            Family::V6,
            &["fd00:30::1"],
            vec![
                "fd00:30::2",
                "fd00:30::3",
                "fd00:30::4",
                "fd00:30::5",
                "fd00:30::6",
                "fd00:30::7",
                "fd00:30::8",
                "fd00:30::9",
                "fd00:30::a",
                "fd00:30::b",
                "fd00:30::c",
                "fd00:30::d",
                "fd00:30::e",
                "fd00:30::f",
            ],
        ),
    ];
    for (family, gateways, expected) in cases {
        let expected: BTreeSet<IpAddr> = expected.into_iter().map(ip).collect();
        let setup = NetworkSetup {
            network: "net".into(),
            pools: vec![spec(v4_pool, "v4", 30), spec(v6_pool, "v6", 126)],
            gateways: gateways.iter().map(|g| ip(g)).collect(),
            reservation_handle: "net:gateway".into(),
        };
        let request = |handle: String, n: u32| AutoAssignRequest {
            handle,
            host: "node-a".into(),
            num_v4: if family == Family::V4 { n } else { 0 },
            num_v6: if family == Family::V6 { n } else { 0 },
            setup: Some(setup.clone()),
            ..Default::default()
        };
        let exhausted = |outcome: Result<ipam_core::AutoAssignResult, IpamError>| {
            assert!(
                matches!(outcome, Err(IpamError::Exhausted { .. })),
                "{family:?} {gateways:?}: not exhausted: {outcome:?}"
            );
        };
        // The call that sets the network up takes every address at once; then none is left.
        let t = factory.fresh().await;
        let ipam = Ipam::new(Arc::clone(&t.store));
        let all = u32::try_from(expected.len()).expect("a few addresses");
        let got = ipam
            .auto_assign(&request("pod-all".into(), all))
            .await
            .unwrap_or_else(|e| panic!("{family:?} {gateways:?}: {all} at once: {e}"));
        let handed_out: BTreeSet<IpAddr> = got.v4.iter().chain(&got.v6).map(|a| a.ip).collect();
        assert_eq!(handed_out, expected, "{family:?} {gateways:?}: at once");
        let seen: BTreeSet<String> = got.pools.iter().map(|p| p.cidr.to_string()).collect();
        assert_eq!(
            seen,
            BTreeSet::from([v4_pool.to_owned(), v6_pool.to_owned()]),
            "the pools the call saw, with the ones it created"
        );
        exhausted(ipam.auto_assign(&request("pod-more".into(), 1)).await);
        assert_clean(&ipam).await;

        // One address per call: the first sets the network up, the later ones find it in place.
        let t = factory.fresh().await;
        let ipam = Ipam::new(Arc::clone(&t.store));
        let mut handed_out = BTreeSet::new();
        for call in 0..expected.len() {
            let got = ipam
                .auto_assign(&request(format!("pod-{call}"), 1))
                .await
                .unwrap_or_else(|e| panic!("{family:?} {gateways:?}: call {call}: {e}"));
            for a in got.v4.iter().chain(&got.v6) {
                assert!(handed_out.insert(a.ip), "{} handed out twice", a.ip);
            }
        }
        assert_eq!(
            handed_out, expected,
            "{family:?} {gateways:?}: one per call"
        );
        exhausted(ipam.auto_assign(&request("pod-more".into(), 1)).await);
        let pools: BTreeSet<String> = ipam
            .list_pools()
            .await
            .expect("pools")
            .iter()
            .map(|p| p.cidr.to_string())
            .collect();
        assert_eq!(
            pools,
            BTreeSet::from([v4_pool.to_owned(), v6_pool.to_owned()])
        );
        assert_clean(&ipam).await;
    }
}

/// A namespace's pools setting replaces the pools a request names, family by family: only for a
/// family the caller lets it decide (no pod annotation chose that family's pools), and only when
/// the setting lists pools of that family. A namespace without a setting changes nothing.
pub async fn a_namespaces_pools_replace_the_requests_family_by_family<F: StoreFactory>(
    factory: &F,
) {
    use ipam_core::allocator::NamespaceLookup;
    use ipam_core::namespaces::NamespacePools;

    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    for (cidr, name, size) in [
        ("10.40.0.0/26", "a", 28),
        ("10.40.1.0/26", "b", 28),
        ("fd00:40::/120", "c", 124),
        ("fd00:40:1::/120", "d", 124),
    ] {
        ipam.create_pool(&spec(cidr, name, size))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
    }
    for (namespace, v4, v6) in [("web", vec!["b"], vec!["d"]), ("api", vec![], vec!["d"])] {
        ipam.set_namespace_pools(
            namespace,
            &NamespacePools {
                ipv4_pools: v4.into_iter().map(String::from).collect(),
                ipv6_pools: v6.into_iter().map(String::from).collect(),
            },
        )
        .await
        .unwrap_or_else(|e| panic!("set {namespace}'s pools: {e}"));
    }
    // One address of each family for `handle`, from pools a and c unless the namespace's setting
    // decides (for IPv4 when `v4`, IPv6 when `v6`).
    let request = |handle: &str, namespace: &str, v4: bool, v6: bool| AutoAssignRequest {
        handle: handle.into(),
        host: "node-a".into(),
        num_v4: 1,
        num_v6: 1,
        v4_pools: vec!["a".into()],
        v6_pools: vec!["c".into()],
        namespace: Some(NamespaceLookup {
            namespace: namespace.into(),
            v4,
            v6,
        }),
        ..Default::default()
    };
    // (namespace, its setting may decide IPv4, IPv6, the pools the addresses come from)
    for (n, (namespace, v4, v6, expected)) in [
        ("web", true, true, ["10.40.1.0/26", "fd00:40:1::/120"]),
        ("web", false, false, ["10.40.0.0/26", "fd00:40::/120"]),
        ("web", true, false, ["10.40.1.0/26", "fd00:40::/120"]),
        ("web", false, true, ["10.40.0.0/26", "fd00:40:1::/120"]),
        ("api", true, true, ["10.40.0.0/26", "fd00:40:1::/120"]),
        ("unset", true, true, ["10.40.0.0/26", "fd00:40::/120"]),
    ]
    .into_iter()
    .enumerate()
    {
        let got = ipam
            .auto_assign(&request(&format!("pod-{n}"), namespace, v4, v6))
            .await
            .unwrap_or_else(|e| panic!("{namespace} v4 {v4} v6 {v6}: {e}"));
        let pools: Vec<String> = got
            .v4
            .iter()
            .chain(&got.v6)
            .map(|a| {
                expected
                    .iter()
                    .find(|p| net(p).contains(&a.ip))
                    .map_or_else(|| format!("{} in another pool", a.ip), |p| (*p).to_owned())
            })
            .collect();
        assert_eq!(
            pools, expected,
            "{namespace}, setting decides v4 {v4}, v6 {v6}"
        );
    }
    // A pool the setting names that cannot be used: the error names the namespace, the family
    // and why, and nothing is allocated; where the setting does not decide, the request's own
    // pool's error is its own.
    ipam.set_pool_disabled("d", true).await.expect("disable d");
    ipam.set_pool_disabled("c", true).await.expect("disable c");
    let before = ipam.list_allocations().await.expect("allocations");
    let assign = |handle: &str, namespace: &str, v6: bool| {
        let request = request(handle, namespace, true, v6);
        let ipam = &ipam;
        async move { ipam.auto_assign(&request).await }
    };
    let refused = assign("pod-refused-1", "web", true).await;
    assert_eq!(
        refused,
        Err(IpamError::NamespacePoolUnusable {
            namespace: "web".into(),
            family: Family::V6,
            reason: Box::new(IpamError::PoolDisabled("d".into())),
        })
    );
    let message = refused.expect_err("refused").to_string();
    assert!(
        message.contains("namespace \"web\"") && message.contains("\"d\" is disabled"),
        "{message}"
    );
    assert_eq!(
        assign("pod-refused-2", "web", false).await,
        Err(IpamError::PoolDisabled("c".into()))
    );
    assert_eq!(
        ipam.list_allocations().await.expect("allocations"),
        before,
        "a refused assignment allocated something"
    );
    // `check` names the settings whose pods' ADDs now fail, and nothing else.
    let report = ipam.check(false).await.expect("check");
    let reported: Vec<(&str, bool)> = report
        .problems
        .iter()
        .map(|p| {
            (
                p.kind.as_str(),
                p.detail.contains("IPv6 pool \"d\"") && p.detail.contains("disabled"),
            )
        })
        .collect();
    assert_eq!(
        reported,
        vec![(kinds::NAMESPACE_POOL_UNUSABLE, true); 2],
        "api and web: {report:#?}"
    );
}

/// A namespace's pools setting read back with each named pool its pods' ADDs could not use and
/// the error they would get (gone, disabled, of the other family), and the namespaces whose setting
/// names a pool, by name or CIDR, even once it is deleted.
pub async fn a_namespaces_pools_status_names_the_pools_its_pods_cannot_use<F: StoreFactory>(
    factory: &F,
) {
    use ipam_core::allocator::UnusableNamespacePool;
    use ipam_core::namespaces::NamespacePools;

    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    for (cidr, name, size) in [
        ("10.41.0.0/26", "a", 28),
        ("10.41.1.0/26", "b", 28),
        ("fd00:41::/120", "c", 124),
    ] {
        ipam.create_pool(&spec(cidr, name, size))
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
    }
    let strings = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let web = NamespacePools {
        ipv4_pools: strings(&["a", "10.41.1.0/26"]),
        ipv6_pools: strings(&["c"]),
    };
    for (namespace, setting) in [
        ("web", web.clone()),
        (
            "api",
            NamespacePools {
                ipv4_pools: strings(&["a"]),
                ipv6_pools: Vec::new(),
            },
        ),
        (
            "other",
            NamespacePools {
                ipv4_pools: Vec::new(),
                ipv6_pools: strings(&["fd00:41::/120"]),
            },
        ),
    ] {
        ipam.set_namespace_pools(namespace, &setting)
            .await
            .unwrap_or_else(|e| panic!("set {namespace}'s pools: {e}"));
    }
    let status = |namespace: &'static str| {
        let ipam = &ipam;
        async move {
            ipam.namespace_pools_status(namespace)
                .await
                .unwrap_or_else(|e| panic!("{namespace}'s status: {e}"))
        }
    };
    let naming = |name: &'static str| {
        let ipam = &ipam;
        async move {
            let pool = ipam.get_pool(name).await.expect("pool");
            ipam.namespaces_naming_pool(&pool)
                .await
                .expect("namespaces naming the pool")
        }
    };
    // A setting that does not decode names no pool here (`check` reports it).
    t.store
        .put(
            &ipam_core::namespaces::namespace_key("broken"),
            vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff],
        )
        .await
        .expect("damage a setting");
    assert_eq!(status("web").await, Some((web.clone(), Vec::new())));
    assert_eq!(status("unset").await, None);
    assert_eq!(naming("a").await, strings(&["api", "web"]));
    assert_eq!(naming("b").await, strings(&["web"]), "named by its CIDR");
    assert_eq!(naming("c").await, strings(&["other", "web"]));

    let unusable = |family, pool: &str, reason| UnusableNamespacePool {
        family,
        pool: pool.to_owned(),
        reason,
    };
    ipam.set_pool_disabled("b", true).await.expect("disable b");
    assert_eq!(
        status("web").await,
        Some((
            web.clone(),
            vec![unusable(
                Family::V4,
                "10.41.1.0/26",
                IpamError::PoolDisabled("b".into())
            )]
        ))
    );
    let a = ipam.get_pool("a").await.expect("pool a");
    ipam.delete_pool("a", false).await.expect("delete a");
    assert_eq!(
        ipam.namespaces_naming_pool(&a).await.expect("naming a"),
        strings(&["api", "web"]),
        "a deleted pool is still named"
    );
    // Another pool under the deleted one's name, of the other family.
    ipam.create_pool(&spec("fd00:42::/120", "a", 124))
        .await
        .expect("create the new a");
    let expected_web = vec![
        unusable(
            Family::V4,
            "a",
            IpamError::PoolWrongFamily {
                pool: "a".into(),
                family: Family::V4,
            },
        ),
        unusable(
            Family::V4,
            "10.41.1.0/26",
            IpamError::PoolDisabled("b".into()),
        ),
    ];
    assert_eq!(status("web").await, Some((web.clone(), expected_web)));
    ipam.delete_pool("a", false)
        .await
        .expect("delete the new a");
    let (_, api) = status("api").await.expect("api's setting");
    assert_eq!(
        api,
        vec![unusable(
            Family::V4,
            "a",
            IpamError::PoolNotFound("a".into())
        )]
    );
    ipam.set_namespace_pools("broken", &NamespacePools::default())
        .await
        .expect("clear the damaged setting");
    // `check` reports each entry its pods cannot use, as their ADDs would fail.
    let report = ipam.check(false).await.expect("check");
    let mut reported: Vec<&str> = report
        .problems
        .iter()
        .map(|p| {
            assert!(
                p.kind == kinds::NAMESPACE_POOL_UNUSABLE && !p.repairable,
                "{report:#?}"
            );
            p.detail.as_str()
        })
        .collect();
    reported.sort();
    assert_eq!(reported.len(), 3, "{report:#?}");
    for (found, (namespace, entry, why)) in reported.iter().zip([
        ("api", "\"a\"", "no IP pool named or with CIDR \"a\""),
        ("web", "\"10.41.1.0/26\"", "IP pool \"b\" is disabled"),
        ("web", "\"a\"", "no IP pool named or with CIDR \"a\""),
    ]) {
        assert!(
            found.starts_with(&format!("namespace {namespace} names IPv4 pool {entry}"))
                && found.contains(why)
                && found.contains("error 105"),
            "{found}"
        );
    }
    for namespace in ["api", "web"] {
        ipam.set_namespace_pools(namespace, &NamespacePools::default())
            .await
            .expect("clear the setting");
    }
    assert_clean(&ipam).await;
    // While a pool cannot be decoded it may be the one a setting names: no setting is judged.
    let c = t
        .store
        .get(&keys::pool("c"))
        .await
        .expect("get")
        .expect("pool c");
    t.store
        .put(&c.key, vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff])
        .await
        .expect("damage pool c");
    let report = ipam.check(false).await.expect("check");
    let found: Vec<&str> = report.problems.iter().map(|p| p.kind.as_str()).collect();
    assert_eq!(found, vec![kinds::CORRUPT_OBJECT], "{report:#?}");
    t.store.put(&c.key, c.value).await.expect("restore pool c");
    assert_clean(&ipam).await;
}

/// Without named pools, auto-assign uses only the pools that are automatic, allow the use asked
/// for and select the node (Calico's rule); named pools are used whatever their mode and
/// selector, each of them, in order.
pub async fn auto_assign_chooses_automatic_pools_allowing_the_use_and_selecting_the_node<
    F: StoreFactory,
>(
    factory: &F,
) {
    use ipam_core::selector::Selector;
    use ipam_core::{AllowedUses, AssignmentMode, PoolPolicy};

    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    for (cidr, name, mode, uses, selector) in [
        (
            "10.80.0.0/30",
            "manual",
            AssignmentMode::Manual,
            "workload",
            "all()",
        ),
        (
            "10.80.0.4/30",
            "tunnel",
            AssignmentMode::Automatic,
            "tunnel",
            "all()",
        ),
        (
            "10.80.0.8/30",
            "east",
            AssignmentMode::Automatic,
            "workload",
            "zone == 'east'",
        ),
        (
            "10.80.0.12/30",
            "auto",
            AssignmentMode::Automatic,
            "workload",
            "all()",
        ),
    ] {
        let policy = PoolPolicy {
            node_selector: Selector::parse(selector).expect("selector"),
            assignment_mode: mode,
            allowed_uses: AllowedUses::parse(uses).expect("uses"),
        };
        ipam.create_pool_with_policy(&spec(cidr, name, 30), &policy)
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
    }
    // Only "auto" is a candidate: its four addresses, and not one more.
    let before = t.store.list("").await.expect("list");
    assert!(
        matches!(
            ipam.auto_assign(&v4("five", "node-a", 5)).await,
            Err(IpamError::Exhausted { .. })
        ),
        "five addresses from a pool of four"
    );
    assert_eq!(t.store.list("").await.expect("list"), before);
    let got = ipam
        .auto_assign(&v4("four", "node-a", 4))
        .await
        .expect("four addresses of auto");
    assert!(
        got.v4.iter().all(|a| net("10.80.0.12/30").contains(&a.ip)),
        "{got:?}"
    );
    // Named pools, a manual one and one selecting other nodes: both used, the first first.
    let mut named = v4("named", "node-a", 8);
    named.v4_pools = vec!["manual".into(), "east".into()];
    let got = ipam
        .auto_assign(&named)
        .await
        .expect("eight from two named pools");
    let in_pool = |cidr: &str| got.v4.iter().filter(|a| net(cidr).contains(&a.ip)).count();
    assert_eq!(
        (in_pool("10.80.0.0/30"), in_pool("10.80.0.8/30")),
        (4, 4),
        "{got:?}"
    );
    assert_clean(&ipam).await;
}
