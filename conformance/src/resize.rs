//! Pool split and block-size change: allocations survive a split in the sub-pool containing them,
//! new claims after a block-size change use the new size and never overlap an old block, and
//! everything that finds "the block holding an address" finds it whatever its size.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use ipam_core::check::kinds;
use ipam_core::model::{block_entries, Block};
use ipam_core::namespaces::NamespacePools;
use ipam_core::selector::Selector;
use ipam_core::{
    AllowedUses, AssignIpsRequest, AssignmentMode, CountingStore, Ipam, IpamConfig, IpamError,
    KvStore, Op, PoolChange, PoolPolicy, ReleaseRequest, Txn,
};
use ipnet::IpNet;

use crate::hooked::HookedStore;
use crate::ipam::{assert_clean, ip, ipam_with_pool, net, spec, v4};
use crate::StoreFactory;

/// Expands every resize case into one `#[tokio::test]` inside a module `resize`.
#[macro_export]
macro_rules! resize_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(resize, $crate::resize, $factory;
            split_keeps_allocations_in_the_sub_pool_containing_them_and_rewrites_namespaces,
            split_refuses_bad_part_counts_and_parts_smaller_than_a_block_and_writes_nothing,
            split_into_parts_of_one_block_and_a_former_block_larger_than_a_part,
            smaller_block_size_claims_new_blocks_beside_old_ones_that_drain,
            larger_block_size_never_overlaps_old_smaller_blocks,
            claim_affinity_refuses_a_block_overlapping_a_former_size,
            check_accepts_recorded_mixed_sizes_and_reports_overlaps_and_unrecorded_sizes,
            check_reports_a_pool_inside_another_and_a_block_larger_than_its_pool,
            address_lookups_keep_their_round_trips_until_a_size_change,
            a_claim_racing_another_in_a_mixed_pool_retries_instead_of_overlapping,
            explicit_assignments_in_existing_blocks_of_a_mixed_pool_do_not_conflict,
            a_namespace_setting_racing_a_split_never_names_the_split_pool,
        );
    };
}

async fn set_block_size(ipam: &Ipam, pool: &str, size: u8) {
    let change = PoolChange {
        block_size: Some(size),
        ..PoolChange::default()
    };
    let changed = ipam
        .set_pool(pool, &change)
        .await
        .unwrap_or_else(|e| panic!("set block size /{size} on {pool}: {e}"));
    assert_eq!(changed.block_size, size);
}

async fn assign_on(ipam: &Ipam, handle: &str, host: &str, n: u32) -> Vec<(IpAddr, IpNet)> {
    ipam.auto_assign(&v4(handle, host, n))
        .await
        .unwrap_or_else(|e| panic!("assign {n} to {handle} on {host}: {e}"))
        .v4
        .into_iter()
        .map(|a| (a.ip, a.block))
        .collect()
}

async fn block_cidrs(ipam: &Ipam) -> Vec<IpNet> {
    let usage = ipam.utilization().await.expect("utilization");
    assert!(
        usage.orphan_blocks.is_empty(),
        "blocks outside every pool: {:?}",
        usage.orphan_blocks
    );
    usage
        .pools
        .iter()
        .flat_map(|p| p.blocks.iter().map(|b| b.cidr))
        .collect()
}

fn assert_disjoint(cidrs: &[IpNet]) {
    for (i, a) in cidrs.iter().enumerate() {
        for b in &cidrs[i + 1..] {
            assert!(
                !(a.contains(&b.network()) || b.contains(&a.network())),
                "blocks {a} and {b} overlap (all: {cidrs:?})"
            );
        }
    }
}

/// A split replaces the pool by N sub-pools with its settings, every block and allocation stays
/// and lies in exactly one sub-pool, a namespace naming the pool now names the sub-pools, and
/// release and assign work afterwards.
pub async fn split_keeps_allocations_in_the_sub_pool_containing_them_and_rewrites_namespaces<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    let policy = PoolPolicy {
        node_selector: Selector::parse("all()").expect("selector"),
        assignment_mode: AssignmentMode::Automatic,
        allowed_uses: AllowedUses::parse("workload").expect("uses"),
    };
    ipam.create_pool_with_policy(&spec("10.0.0.0/24", "big", 28), &policy)
        .await
        .expect("create pool");
    ipam.set_namespace_pools(
        "team-a",
        &NamespacePools {
            ipv4_pools: vec!["big".into()],
            ipv6_pools: vec![],
        },
    )
    .await
    .expect("namespace pools by name");
    ipam.set_namespace_pools(
        "team-b",
        &NamespacePools {
            ipv4_pools: vec!["10.0.0.0/24".into()],
            ipv6_pools: vec![],
        },
    )
    .await
    .expect("namespace pools by CIDR");
    let mut held = Vec::new();
    for host in ["node-a", "node-b", "node-c", "node-d", "node-e"] {
        held.extend(assign_on(&ipam, &format!("h-{host}"), host, 3).await);
    }
    let before = ipam.list_allocations().await.expect("allocations");
    let blocks_before = block_cidrs(&ipam).await;

    let split = ipam.split_pool("big", 4).await.expect("split");
    assert_eq!(split.pool.name, "big");
    assert_eq!(split.blocks, blocks_before.len() as u64);
    let names: Vec<&str> = split.pools.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        ["split-big-0", "split-big-1", "split-big-2", "split-big-3"]
    );
    let pools = ipam.list_pools().await.expect("pools");
    assert_eq!(
        pools, split.pools,
        "the old pool is gone, the sub-pools are there"
    );
    for (i, pool) in pools.iter().enumerate() {
        assert_eq!(pool.cidr, net(&format!("10.0.0.{}/26", i * 64)));
        assert_eq!(pool.block_size, 28);
        assert_eq!(pool.allowed_uses, policy.allowed_uses);
        assert_eq!(pool.node_selector, policy.node_selector);
        assert!(!pool.disabled);
    }
    // Every block in exactly one sub-pool, every allocation unchanged.
    let usage = ipam.utilization().await.expect("utilization");
    assert!(usage.orphan_blocks.is_empty());
    let mut after_blocks: Vec<IpNet> = usage
        .pools
        .iter()
        .flat_map(|p| {
            p.blocks.iter().map(|b| {
                assert!(
                    p.pool.cidr.contains(&b.cidr),
                    "{} outside {}",
                    b.cidr,
                    p.pool.cidr
                );
                b.cidr
            })
        })
        .collect();
    after_blocks.sort();
    let mut sorted_before = blocks_before.clone();
    sorted_before.sort();
    assert_eq!(after_blocks, sorted_before);
    assert_eq!(ipam.list_allocations().await.expect("allocations"), before);
    for name in ["team-a", "team-b"] {
        let setting = ipam
            .namespace_pools(name)
            .await
            .expect("read namespace")
            .expect("namespace setting kept");
        assert_eq!(setting.ipv4_pools, names, "namespace {name}");
    }
    let mut rewritten = split.namespaces.clone();
    rewritten.sort();
    assert_eq!(rewritten, ["team-a", "team-b"]);

    // Release and assign after the split.
    let (first, _) = held[0];
    let released = ipam
        .release_ips(&[ReleaseRequest {
            ip: first,
            sequence: None,
        }])
        .await
        .expect("release");
    assert_eq!(released.released, vec![first]);
    let fresh = assign_on(&ipam, "h-new", "node-f", 2).await;
    assert_eq!(fresh.len(), 2);
    assert_clean(&ipam).await;
}

/// N must be a power of two from 2 to 32, and each part at least one block; a refused split
/// writes nothing, and a taken sub-pool name is refused too.
pub async fn split_refuses_bad_part_counts_and_parts_smaller_than_a_block_and_writes_nothing<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    for parts in [0, 1, 3, 6, 64] {
        match ipam.split_pool("pool", parts).await {
            Err(IpamError::InvalidArgument(_)) => {}
            other => panic!("split into {parts}: expected an invalid argument, got {other:?}"),
        }
    }
    // /24 with /26 blocks: 8 parts would be /27, smaller than a block.
    match ipam.split_pool("pool", 8).await {
        Err(IpamError::InvalidArgument(message)) => {
            assert!(message.contains("smaller than one /26 block"), "{message}")
        }
        other => panic!("split into 8: expected an invalid argument, got {other:?}"),
    }
    ipam.create_pool(&spec("10.1.0.0/24", "split-pool-1", 26))
        .await
        .expect("pool in the way");
    match ipam.split_pool("pool", 2).await {
        Err(IpamError::PoolExists(name)) => assert_eq!(name, "split-pool-1"),
        other => panic!("expected the taken name to be refused, got {other:?}"),
    }
    let names: Vec<String> = ipam
        .list_pools()
        .await
        .expect("pools")
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert_eq!(names, ["pool", "split-pool-1"]);
    match ipam.split_pool("missing", 2).await {
        Err(IpamError::PoolNotFound(_)) => {}
        other => panic!("expected pool not found, got {other:?}"),
    }
    // A pool with room for more: 32 parts is the most, 64 is refused for its count alone.
    ipam.create_pool(&spec("10.64.0.0/16", "wide", 26))
        .await
        .expect("wide pool");
    match ipam.split_pool("wide", 64).await {
        Err(IpamError::InvalidArgument(message)) => {
            assert!(message.contains("2 to 32 (got 64)"), "{message}")
        }
        other => panic!("split into 64: expected an invalid argument, got {other:?}"),
    }
    let split = ipam.split_pool("wide", 32).await.expect("split into 32");
    assert_eq!(split.pools.len(), 32);
    assert!(
        split.pools.iter().all(|p| p.cidr.prefix_len() == 21),
        "{split:?}"
    );
}

/// A split into parts of exactly one block keeps each block in the part that is that block; a
/// block of a former, larger size than a part is refused (it would straddle two sub-pools),
/// naming it, and nothing is written. A block size may grow to the pool's own size, not beyond.
pub async fn split_into_parts_of_one_block_and_a_former_block_larger_than_a_part<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let held = assign_on(&ipam, "h-a", "node-a", 1).await[0];
    let split = ipam
        .split_pool("pool", 4)
        .await
        .expect("split into /26 parts");
    assert_eq!(split.blocks, 1);
    let part = split
        .pools
        .iter()
        .find(|p| p.cidr == held.1)
        .expect("a part that is the block");
    assert_eq!(part.cidr.prefix_len(), 26);
    assert_eq!(ipam.ips_by_handle("h-a").await.expect("held")[0].ip, held.0);

    ipam.create_pool(&spec("10.1.0.0/24", "whole", 24))
        .await
        .expect("pool of one /24 block");
    let whole_block = ipam
        .assign_ips(&AssignIpsRequest {
            ips: vec![ip("10.1.0.5")],
            handle: "h-b".into(),
            host: "node-b".into(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("an address of the /24 block")[0]
        .block;
    assert_eq!(whole_block, net("10.1.0.0/24"));
    set_block_size(&ipam, "whole", 26).await;
    let pools_before = ipam.list_pools().await.expect("pools");
    match ipam.split_pool("whole", 2).await {
        Err(IpamError::InvalidArgument(message)) => assert!(
            message.contains("block 10.1.0.0/24") && message.contains("larger than a /25 part"),
            "{message}"
        ),
        other => panic!("split around a /24 block: expected a refusal, got {other:?}"),
    }
    assert_eq!(ipam.list_pools().await.expect("pools"), pools_before);

    // A block size may be the pool's own size, never larger.
    let larger = PoolChange {
        block_size: Some(23),
        ..PoolChange::default()
    };
    match ipam.set_pool("whole", &larger).await {
        Err(IpamError::InvalidArgument(message)) => assert!(
            message.contains("pool 10.1.0.0/24 is smaller than one /23 block"),
            "{message}"
        ),
        other => panic!("a /23 block size for a /24 pool: expected a refusal, got {other:?}"),
    }
    assert_eq!(ipam.list_pools().await.expect("pools"), pools_before);
    ipam.create_pool(&spec("10.2.0.0/26", "single", 28))
        .await
        .expect("a /26 pool");
    set_block_size(&ipam, "single", 26).await;
    assert_clean(&ipam).await;
}

/// /26 → /28 (smaller blocks): the host keeps filling its old /26 block, new claims are /28
/// blocks that never overlap it, an address of the old block is found and released by address,
/// and filling the pool to its last address leaves no overlap.
pub async fn smaller_block_size_claims_new_blocks_beside_old_ones_that_drain<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/25", 26).await;
    let old = assign_on(&ipam, "h-old", "node-a", 2).await;
    let old_block = old[0].1;
    assert_eq!(old_block.prefix_len(), 26);
    set_block_size(&ipam, "pool", 28).await;

    // The affine old block still serves its host first.
    let more = assign_on(&ipam, "h-more", "node-a", 1).await;
    assert_eq!(more[0].1, old_block);
    // Another host claims a /28, outside the old /26.
    let other = assign_on(&ipam, "h-b", "node-b", 1).await;
    assert_eq!(other[0].1.prefix_len(), 28);
    assert!(
        !old_block.contains(&other[0].0),
        "{other:?} inside {old_block}"
    );

    // The old block's address is found and released by address.
    let info = ipam
        .get_assignment(old[0].0)
        .await
        .expect("lookup")
        .expect("the old block's address is found");
    assert_eq!(info.block, old_block);
    let released = ipam
        .release_ips(&[ReleaseRequest {
            ip: old[0].0,
            sequence: Some(info.sequence),
        }])
        .await
        .expect("release");
    assert_eq!(released.released, vec![old[0].0]);
    // An explicit address in the old block lands in the old block.
    let explicit = ipam
        .assign_ips(&AssignIpsRequest {
            ips: vec![old[0].0],
            handle: "h-explicit".into(),
            host: "node-c".into(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("explicit assign");
    assert_eq!(explicit[0].block, old_block);
    assert_clean(&ipam).await;

    // Fill every address of the pool from many hosts: no overlap, no duplicate.
    ipam.set_config(&IpamConfig {
        max_blocks_per_host: 0,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    let mut seen = BTreeSet::new();
    for allocation in ipam.list_allocations().await.expect("allocations") {
        seen.insert(allocation.ip);
    }
    let mut round = 0;
    while seen.len() < 128 {
        let host = format!("node-{}", round % 5);
        let want = (128 - seen.len() as u32).min(8);
        let got = assign_on(&ipam, &format!("fill-{round}"), &host, want).await;
        for (address, _) in got {
            assert!(seen.insert(address), "{address} handed out twice");
        }
        round += 1;
        assert!(round < 64, "the pool never filled");
    }
    assert!(matches!(
        ipam.auto_assign(&v4("one-too-many", "node-z", 1)).await,
        Err(IpamError::Exhausted { .. })
    ));
    let cidrs = block_cidrs(&ipam).await;
    assert!(cidrs.contains(&old_block));
    assert!(cidrs.iter().any(|c| c.prefix_len() == 28));
    assert_disjoint(&cidrs);
    assert_clean(&ipam).await;
}

/// /28 → /26 (larger blocks): new /26 claims skip every /26 holding an old /28 block, an explicit
/// address next to an old block gets the largest block that overlaps nothing, old addresses are
/// found and released, and the pool fills with no overlap.
pub async fn larger_block_size_never_overlaps_old_smaller_blocks<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 28).await;
    // Old /28 blocks in the first and third /26, wherever the hosts' hashes put them otherwise.
    for (host, cidr) in [("node-a", "10.0.0.16/28"), ("node-b", "10.0.0.128/28")] {
        ipam.claim_affinity(host, net(cidr))
            .await
            .unwrap_or_else(|e| panic!("claim {cidr}: {e}"));
    }
    let old = assign_on(&ipam, "h-old", "node-a", 1).await;
    assert_eq!(old[0].1, net("10.0.0.16/28"));
    set_block_size(&ipam, "pool", 26).await;

    // node-a's old block still serves it; new hosts get /26 blocks free of old ones.
    let mut fresh = Vec::new();
    for host in ["node-c", "node-d"] {
        let got = assign_on(&ipam, &format!("h-{host}"), host, 1).await;
        fresh.push(got[0].1);
    }
    let mut fresh_sorted = fresh.clone();
    fresh_sorted.sort();
    assert_eq!(
        fresh_sorted,
        [net("10.0.0.64/26"), net("10.0.0.192/26")],
        "only the /26 blocks holding no old /28 are claimed"
    );
    // No /26 is left: the next host borrows (or, failing that, is exhausted) instead of overlapping.
    ipam.set_config(&IpamConfig {
        strict_affinity: true,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    assert!(matches!(
        ipam.auto_assign(&v4("h-e", "node-e", 1)).await,
        Err(IpamError::Exhausted { .. })
    ));
    ipam.set_config(&IpamConfig::default())
        .await
        .expect("config");

    // An explicit address beside the old /28 at .16 gets .0/28 (the largest free block holding it).
    let explicit = ipam
        .assign_ips(&AssignIpsRequest {
            ips: vec![ip("10.0.0.5")],
            handle: "h-explicit".into(),
            host: "node-e".into(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("explicit assign next to an old block");
    assert_eq!(explicit[0].block, net("10.0.0.0/28"));
    // And one in the empty half of the third /26 gets .160/27.
    let explicit = ipam
        .assign_ips(&AssignIpsRequest {
            ips: vec![ip("10.0.0.170")],
            handle: "h-explicit-2".into(),
            host: "node-e".into(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("explicit assign in a larger gap");
    assert_eq!(explicit[0].block, net("10.0.0.160/27"));

    // Old addresses are found and released by address.
    let info = ipam
        .get_assignment(old[0].0)
        .await
        .expect("lookup")
        .expect("old address found");
    assert_eq!(info.block, net("10.0.0.16/28"));
    let released = ipam
        .release_ips(&[ReleaseRequest {
            ip: old[0].0,
            sequence: None,
        }])
        .await
        .expect("release");
    assert_eq!(released.released, vec![old[0].0]);
    assert_disjoint(&block_cidrs(&ipam).await);
    assert_clean(&ipam).await;
}

/// After /28 → /26, claiming a /26 that holds an old /28 block is refused and writes nothing.
pub async fn claim_affinity_refuses_a_block_overlapping_a_former_size<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 28).await;
    ipam.claim_affinity("node-a", net("10.0.0.16/28"))
        .await
        .expect("claim old-size block");
    set_block_size(&ipam, "pool", 26).await;
    match ipam.claim_affinity("node-b", net("10.0.0.0/26")).await {
        Err(IpamError::InvalidArgument(message)) => {
            assert!(message.contains("10.0.0.16/28"), "{message}")
        }
        other => panic!("expected the overlapping claim refused, got {other:?}"),
    }
    let claimed = ipam
        .claim_affinity("node-b", net("10.0.0.64/26"))
        .await
        .expect("claim a free /26");
    assert_eq!(claimed, vec![net("10.0.0.64/26")]);
    assert_eq!(
        block_cidrs(&ipam).await,
        [net("10.0.0.16/28"), net("10.0.0.64/26")]
    );
    assert_clean(&ipam).await;
}

/// Writes `block` as it is (block and claim index entry), bypassing the allocator.
/// `check` reports what the allocator never writes but another writer might: a pool stored inside
/// another (not at its start), and a block larger than the pool it lies in.
pub async fn check_reports_a_pool_inside_another_and_a_block_larger_than_its_pool<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&spec("10.2.0.0/27", "small", 28))
        .await
        .expect("a /27 pool of /28 blocks");
    assign_on(&ipam, "h-a", "node-a", 1).await;
    assert_clean(&ipam).await;
    let inner = ipam_core::model::Pool {
        name: "inner".to_owned(),
        cidr: net("10.0.0.128/25"),
        block_size: 26,
        disabled: false,
        node_selector: Selector::all(),
        assignment_mode: AssignmentMode::default(),
        allowed_uses: AllowedUses::default(),
    };
    t.store
        .put(
            &ipam_core::model::keys::pool("inner"),
            ipam_core::model::encode(&inner).expect("encode the pool"),
        )
        .await
        .expect("write a pool inside the first");
    let large = net("10.2.0.0/26");
    write_raw_block(&t.store, &Block::new(large, Some("node-x".into()), 0)).await;

    let report = Ipam::new(Arc::clone(&t.store))
        .check(false)
        .await
        .expect("check");
    let details = |kind: &str| -> Vec<&str> {
        report
            .problems
            .iter()
            .filter(|p| p.kind == kind)
            .map(|p| p.detail.as_str())
            .collect()
    };
    assert_eq!(
        details(kinds::OVERLAPPING_POOLS),
        ["pools inner (10.0.0.128/25) and pool (10.0.0.0/24) overlap"],
        "{:#?}",
        report.problems
    );
    assert!(
        details(kinds::BLOCK_SIZE_MISMATCH)
            .contains(&"block 10.2.0.0/26 is larger than its pool small (10.2.0.0/27)"),
        "{:#?}",
        report.problems
    );
}

async fn write_raw_block(store: &Arc<dyn KvStore>, block: &Block) {
    let ops = block_entries(block)
        .expect("encode block")
        .into_iter()
        .map(|(key, value)| Op::Put { key, value })
        .collect();
    store
        .commit(Txn {
            conditions: vec![],
            ops,
        })
        .await
        .expect("write raw block");
}

/// `check` accepts blocks of a size the pool recorded changing from, but reports a block of
/// another size in a pool that records no change, and blocks that overlap.
pub async fn check_accepts_recorded_mixed_sizes_and_reports_overlaps_and_unrecorded_sizes<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.create_pool(&spec("10.1.0.0/24", "other", 26))
        .await
        .expect("second pool");
    assign_on(&ipam, "h-a", "node-a", 1).await;
    set_block_size(&ipam, "pool", 28).await;
    assign_on(&ipam, "h-b", "node-b", 1).await;
    assert_clean(&ipam).await;

    // A /28 in the pool that never changed size: reported.
    let stray = Block::new(net("10.1.0.16/28"), Some("node-x".into()), 0);
    write_raw_block(&t.store, &stray).await;
    // A /28 inside an existing /26 of the changed pool: an overlap.
    let cidrs = block_cidrs(&ipam).await;
    let old = cidrs
        .iter()
        .find(|c| c.prefix_len() == 26)
        .copied()
        .expect("the old /26 block");
    let inside = IpNet::new(old.network(), 28).expect("cidr");
    write_raw_block(&t.store, &Block::new(inside, Some("node-y".into()), 0)).await;
    // And a second one further in, not next to the /26 in address order.
    let further_in = old
        .subnets(28)
        .expect("the /26's /28s")
        .nth(2)
        .expect("its third /28");
    assert!(old.contains(&further_in.network()) && !inside.contains(&further_in.network()));
    write_raw_block(&t.store, &Block::new(further_in, Some("node-z".into()), 0)).await;

    let report = ipam.check(false).await.expect("check");
    let kinds_found: BTreeSet<&str> = report.problems.iter().map(|p| p.kind.as_str()).collect();
    assert!(
        kinds_found.contains(kinds::BLOCK_SIZE_MISMATCH),
        "{:#?}",
        report.problems
    );
    // Each overlap once: the /26 with each /28 inside it.
    let overlaps: Vec<&str> = report
        .problems
        .iter()
        .filter(|p| p.kind == kinds::OVERLAPPING_BLOCKS)
        .map(|p| p.detail.as_str())
        .collect();
    assert_eq!(
        overlaps,
        [
            format!("blocks {old} and {inside} overlap"),
            format!("blocks {old} and {further_in} overlap"),
        ],
        "{:#?}",
        report.problems
    );
    assert!(
        !report
            .problems
            .iter()
            .any(|p| p.kind == kinds::BLOCK_SIZE_MISMATCH && p.detail.contains("10.0.0.")),
        "a recorded former size is not a problem: {:#?}",
        report.problems
    );
}

/// Explicit assignment (three reads: request batch, claim entries, blocks) and release by address
/// (five: pools, claim entries, blocks, the owner keys of the block, handles) and one commit each,
/// in a pool whose block size
/// never changed, as before mixed sizes existed (the pool's record is read in the batch that reads
/// the claim entry); one read more (the claim index) once it changed.
pub async fn address_lookups_keep_their_round_trips_until_a_size_change<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let counting = Arc::new(CountingStore::new(Arc::clone(&t.store)));
    let ipam = Ipam::new(counting.clone());
    ipam.create_pool(&spec("10.0.0.0/24", "pool", 26))
        .await
        .expect("pool");
    let mut measured = Vec::new();
    for (round, address) in [(0, "10.0.0.5"), (1, "10.0.0.70")] {
        if round == 1 {
            set_block_size(&ipam, "pool", 28).await;
        }
        counting.take();
        ipam.assign_ips(&AssignIpsRequest {
            ips: vec![ip(address)],
            handle: format!("h-{round}"),
            host: "node-a".into(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("explicit assign");
        let assign = counting.take();
        ipam.release_ips(&[ReleaseRequest {
            ip: ip(address),
            sequence: None,
        }])
        .await
        .expect("release");
        let release = counting.take();
        measured.push((
            (assign.reads, assign.commits),
            (release.reads, release.commits),
        ));
    }
    assert_eq!(
        measured,
        [((3, 1), (5, 1)), ((4, 1), (6, 1))],
        "(reads, commits) of an explicit assign and a release by address, before and after a \
         block size change"
    );
}

/// In a pool of mixed sizes, an explicit assignment that chose a /28 from a snapshot where an old
/// /28 still blocked the /26 around it, and a new host that claimed that /26 once the old block was
/// gone, have different claim keys: without the pool's record rewritten by each claim, both would
/// commit and overlap. The explicit assignment must conflict, retry, and land in the /26.
pub async fn a_claim_racing_another_in_a_mixed_pool_retries_instead_of_overlapping<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    ipam.create_pool(&spec("10.0.0.0/24", "pool", 28))
        .await
        .expect("pool");
    // Old /28 blocks hold three of the four /26s; an unaffine old /28 (.80/28, one address)
    // holds the fourth.
    for cidr in ["10.0.0.0/28", "10.0.0.128/28", "10.0.0.192/28"] {
        ipam.claim_affinity("node-a", net(cidr))
            .await
            .unwrap_or_else(|e| panic!("claim {cidr}: {e}"));
    }
    ipam.claim_affinity("node-x", net("10.0.0.80/28"))
        .await
        .expect("claim the blocking block");
    ipam.assign_ips(&AssignIpsRequest {
        ips: vec![ip("10.0.0.81")],
        handle: "h-x".into(),
        host: "node-x".into(),
        ..AssignIpsRequest::default()
    })
    .await
    .expect("hold an address in it");
    ipam.release_affinity("node-x", net("10.0.0.80/28"))
        .await
        .expect("unaffine it");
    set_block_size(&ipam, "pool", 26).await;

    // B reads (the /26 around .66 is blocked by .80/28: B picks .64/28), then, before B commits,
    // the blocking block goes and a new host claims .64/26.
    let racer = ipam.clone();
    let paused = HookedStore::new(Arc::clone(&t.store));
    paused.before_commit(
        |_| true,
        move || async move {
            racer
                .release_ips(&[ReleaseRequest {
                    ip: ip("10.0.0.81"),
                    sequence: None,
                }])
                .await
                .expect("release the blocking address");
            let got = racer
                .auto_assign(&v4("h-c", "node-c", 1))
                .await
                .expect("the new host claims a block");
            assert_eq!(got.v4[0].block, net("10.0.0.64/26"));
        },
    );
    let explicit = Ipam::new(paused.clone() as Arc<dyn KvStore>)
        .assign_ips(&AssignIpsRequest {
            ips: vec![ip("10.0.0.66")],
            handle: "h-b".into(),
            host: "node-b".into(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("explicit assign");
    assert!(paused.commit_hook_fired(), "the race never ran");
    assert_eq!(
        explicit[0].block,
        net("10.0.0.64/26"),
        "the explicit address lands in the block claimed meanwhile"
    );
    assert_disjoint(&block_cidrs(&ipam).await);
    assert_clean(&ipam).await;
}

/// Only a block created in a mixed pool rewrites the pool's mixed-sizes record: two explicit
/// assignments into blocks that exist already (each node's own) commit side by side, neither
/// conflicting with the other, as in a pool whose size never changed.
pub async fn explicit_assignments_in_existing_blocks_of_a_mixed_pool_do_not_conflict<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let a_block = assign_on(&ipam, "h-a", "node-a", 1).await[0].1;
    let b_block = assign_on(&ipam, "h-b", "node-b", 1).await[0].1;
    assert_ne!(a_block, b_block);
    set_block_size(&ipam, "pool", 28).await;
    let blocks_before = block_cidrs(&ipam).await;
    let nth = |block: IpNet, n: u32| -> IpAddr {
        match block.network() {
            IpAddr::V4(v4) => IpAddr::V4((u32::from(v4) + n).into()),
            other => panic!("an IPv4 block, got {other}"),
        }
    };
    let (a_ip, b_ip) = (nth(a_block, 20), nth(b_block, 20));

    // B's explicit assignment commits right before A's reaches the store.
    let racer = ipam.clone();
    let paused = HookedStore::new(Arc::clone(&t.store));
    paused.before_commit(
        |_| true,
        move || async move {
            let got = racer
                .assign_ips(&AssignIpsRequest {
                    ips: vec![b_ip],
                    handle: "h-b2".into(),
                    host: "node-b".into(),
                    ..AssignIpsRequest::default()
                })
                .await
                .expect("B's explicit assign");
            assert_eq!(got[0].block, b_block);
        },
    );
    let got = Ipam::new(paused.clone() as Arc<dyn KvStore>)
        .assign_ips(&AssignIpsRequest {
            ips: vec![a_ip],
            handle: "h-a2".into(),
            host: "node-a".into(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("A's explicit assign");
    assert!(paused.commit_hook_fired(), "the race never ran");
    assert_eq!(got[0].block, a_block);
    assert_eq!(
        (paused.commits(), paused.conflicts()),
        (1, 0),
        "A's assignment committed at once beside B's"
    );
    assert_eq!(
        block_cidrs(&ipam).await,
        blocks_before,
        "no block was created"
    );
    for (handle, ip) in [("h-a2", a_ip), ("h-b2", b_ip)] {
        let held: Vec<IpAddr> = ipam
            .ips_by_handle(handle)
            .await
            .expect("by handle")
            .into_iter()
            .map(|a| a.ip)
            .collect();
        assert_eq!(held, [ip], "{handle}");
    }
    assert_clean(&ipam).await;
}

/// A namespace setting that read its pools before a split of one of them, and commits after the
/// split rewrote the namespaces it knew about, must not land naming the pool the split deleted
/// (every ADD in the namespace would then fail on an unknown pool): it conflicts on the pools'
/// generation, retries, and reports the pool as gone, writing nothing.
pub async fn a_namespace_setting_racing_a_split_never_names_the_split_pool<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    ipam.create_pool(&spec("10.0.0.0/24", "big", 28))
        .await
        .expect("create pool");
    let racer = ipam.clone();
    let paused = HookedStore::new(Arc::clone(&t.store));
    paused.before_commit(
        |_| true,
        move || async move {
            racer.split_pool("big", 2).await.expect("split");
        },
    );
    let set = Ipam::new(paused.clone() as Arc<dyn KvStore>)
        .set_namespace_pools(
            "team",
            &NamespacePools {
                ipv4_pools: vec!["big".into()],
                ipv6_pools: vec![],
            },
        )
        .await;
    assert!(paused.commit_hook_fired(), "the race never ran");
    assert!(
        matches!(&set, Err(IpamError::PoolNotFound(_))),
        "a namespace setting naming a pool split meanwhile: {set:?}"
    );
    assert_eq!(
        ipam.namespace_pools("team")
            .await
            .expect("read the setting"),
        None,
        "nothing written"
    );
    assert_clean(&ipam).await;
}
