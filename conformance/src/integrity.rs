//! Allocator integrity cases: regressions for the duplicate, leak and size defects of issue 8
//! (sequence numbers across block incarnations, pool deletion racing an ADD, a block moving between
//! the two reads that find it, blocks and batches outgrowing the store's limits), on every backend.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use ipam_core::kv::{KeyValue, KvError, KvStore, Read, ReadResult, Revision, Txn};
use ipam_core::model::{encode, keys, Attribute, Block, Handle, MAX_ATTRIBUTE_BYTES};
use ipam_core::{
    AssignIpsRequest, AutoAssignRequest, Condition, Ipam, IpamError, Op, PoolSpec, ReleaseRequest,
};

use crate::hooked::HookedStore;
use crate::ipam::{
    assert_clean, assign_one, block_of, damage, first_owner_key, holder, ip, ipam_with_pool, net,
    spec, v4, GARBAGE,
};
use crate::StoreFactory;

/// Expands every integrity case into one `#[tokio::test]` inside a module `ipam_integrity`.
#[macro_export]
macro_rules! ipam_integrity_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(ipam_integrity, $crate::integrity, $factory;
            recreated_block_never_repeats_an_address_sequence_pair,
            block_recreated_while_its_creator_waits_never_repeats_an_address_sequence_pair,
            pool_delete_racing_an_add_never_releases_a_live_address,
            pool_delete_refuses_damage_in_its_pool_and_passes_over_damage_elsewhere,
            block_moving_between_reads_is_never_taken_for_absent,
            largest_blocks_fill_to_their_last_address_then_report_exhausted,
            oversized_attributes_and_unfillable_block_sizes_are_refused,
            releasing_several_full_blocks_splits_into_transactions_that_fit,
            new_block_search_reads_a_fixed_number_of_keys_whatever_the_store_holds,
            reservations_ignore_strict_affinity_only_when_asked,
            skipping_block_edges_hands_out_only_host_addresses_until_exhausted,
            borrowing_reads_the_claim_index_and_only_the_lenders_it_needs,
            borrowing_passes_over_a_lender_it_cannot_decode,
            a_hosts_block_that_cannot_be_decoded_is_passed_over_and_still_counts_for_its_limit,
            claim_entries_follow_each_blocks_free_count,
            format_1_claim_entries_are_read_tried_and_upgraded_on_write,
            assignments_are_refused_while_an_import_is_unfinished,
            node_release_frees_many_pods_in_batches_not_one_transaction_each,
            claim_entries_of_an_unknown_format_are_reported_never_misread,
            release_chosen_frees_what_the_caller_picks_in_one_transaction,
            guarded_writes_stop_once_the_guard_no_longer_holds,
            empty_block_release_reads_the_claim_index_and_only_the_blocks_it_may_release,
            allocation_counts_read_the_claim_index_and_only_blocks_holding_other_nodes_addresses,
            allocation_counts_name_what_they_cannot_decode_and_count_the_rest,
            usage_and_allocations_read_together_are_what_each_query_answers,
        );
    };
}

/// Which read a hook follows.
type ReadTrigger = Box<dyn Fn(&[Read]) -> bool + Send + Sync>;

fn lists(prefix: String) -> impl Fn(&[Read]) -> bool + Send + Sync {
    move |reads| {
        reads
            .iter()
            .any(|r| matches!(r, Read::List(p) if *p == prefix))
    }
}

/// The first read of a block's claim entry `key`: point reads only, `key` among them, and not the
/// second read (which starts with the sequence floor). A release by address reads the pool's
/// mixed-sizes record in the same batch (resize.rs), a release by handle the entry alone.
fn is_exactly(key: String) -> impl Fn(&[Read]) -> bool + Send + Sync {
    move |reads| {
        reads.iter().all(|r| matches!(r, Read::Get(_)))
            && reads.iter().any(|r| matches!(r, Read::Get(k) if *k == key))
            && !reads
                .iter()
                .any(|r| matches!(r, Read::Get(k) if *k == keys::sequence_floor()))
    }
}

// ---------------------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------------------

/// Defect 1: a block deleted (empty, no affinity) and claimed again continues its sequence
/// numbers, so a late release guarded with an old (address, sequence) is refused instead of
/// freeing the new owner's address; by auto-assign and by a specific-address request.
pub async fn recreated_block_never_repeats_an_address_sequence_pair<F: StoreFactory>(factory: &F) {
    // One block in the pool: every incarnation has the same CIDR.
    let (_t, ipam) = ipam_with_pool(factory, "10.9.0.0/30", 30).await;
    let first = assign_one(&ipam, "old-owner", "node-a").await;
    let old = ipam
        .get_assignment(first)
        .await
        .expect("read")
        .expect("allocated");
    // Retire the host, then release the address: the block is empty and unaffine, so deleted.
    ipam.release_host("node-a", false)
        .await
        .expect("release host");
    ipam.release_handle("old-owner").await.expect("release");
    assert!(
        ipam.utilization().await.expect("usage").pools[0]
            .blocks
            .is_empty(),
        "the empty unaffine block is deleted"
    );

    // Re-created by auto-assign: the first address is handed out again.
    let again = assign_one(&ipam, "new-owner", "node-b").await;
    assert_eq!(
        again, first,
        "the re-created block starts at ordinal 0 again"
    );
    let stale = ipam
        .release_ips(&[ReleaseRequest {
            ip: first,
            sequence: Some(old.sequence),
        }])
        .await
        .expect("guarded release");
    assert!(
        stale.released.is_empty(),
        "a release guarded with the old incarnation's sequence {} freed the new owner's address: {stale:?}",
        old.sequence
    );
    assert_eq!(stale.sequence_mismatch, vec![first]);
    assert_eq!(
        holder(&ipam, first).await.as_deref(),
        Some("new-owner"),
        "the new owner keeps its address"
    );

    // Once more, re-created by a specific-address request.
    let second = ipam
        .get_assignment(first)
        .await
        .expect("read")
        .expect("allocated");
    ipam.release_host("node-b", false)
        .await
        .expect("release host");
    ipam.release_handle("new-owner").await.expect("release");
    ipam.assign_ips(&AssignIpsRequest {
        ips: vec![first],
        handle: "third-owner".into(),
        host: "node-c".into(),
        ..Default::default()
    })
    .await
    .expect("specific address");
    for earlier in [old.sequence, second.sequence] {
        let stale = ipam
            .release_ips(&[ReleaseRequest {
                ip: first,
                sequence: Some(earlier),
            }])
            .await
            .expect("guarded release");
        assert!(
            stale.released.is_empty(),
            "stale sequence {earlier} released the third owner's address"
        );
    }
    assert_eq!(holder(&ipam, first).await.as_deref(), Some("third-owner"));
    assert_clean(&ipam).await;
}

/// How a racing creator makes its block (see the next case).
#[derive(Debug, Clone, Copy)]
enum Creation {
    AutoAssign,
    SpecificAddress,
    AffinityClaim,
}

impl Creation {
    /// Creates the block `cidr` this way and takes its first address, `first`, for `handle` on
    /// `host`.
    async fn take_first(
        self,
        ipam: &Ipam,
        cidr: ipnet::IpNet,
        first: IpAddr,
        handle: &str,
        host: &str,
    ) {
        match self {
            Creation::AutoAssign => {
                assert_eq!(assign_one(ipam, handle, host).await, first);
            }
            Creation::SpecificAddress => {
                ipam.assign_ips(&AssignIpsRequest {
                    ips: vec![first],
                    handle: handle.into(),
                    host: host.into(),
                    ..Default::default()
                })
                .await
                .expect("specific address");
            }
            Creation::AffinityClaim => {
                ipam.claim_affinity(host, cidr)
                    .await
                    .expect("claim the block");
                assert_eq!(assign_one(ipam, handle, host).await, first);
            }
        }
    }
}

/// A block created while, between the creator's read and its commit, another client creates the
/// same block the same way, allocates in it, releases it and deletes it: the store then holds
/// neither the block nor its claim again (what the creator's commit tests), but the deletion
/// raised the sequence floor. The creator must not number its block from the floor it read
/// before: the other client's (address, sequence) pair, released, must never free the creator's
/// live address. By auto-assign, by a specific-address request and by an affinity claim.
pub async fn block_recreated_while_its_creator_waits_never_repeats_an_address_sequence_pair<
    F: StoreFactory,
>(
    factory: &F,
) {
    for creation in [
        Creation::AutoAssign,
        Creation::SpecificAddress,
        Creation::AffinityClaim,
    ] {
        // One block in the pool: every incarnation has the same CIDR.
        let (t, _) = ipam_with_pool(factory, "10.9.0.0/30", 30).await;
        let cidr = net("10.9.0.0/30");
        let first = ip("10.9.0.0");
        let hooked = HookedStore::new(Arc::clone(&t.store));
        let creator = Ipam::new(hooked.clone() as Arc<dyn KvStore>);
        let other = Ipam::new(Arc::clone(&t.store));
        let stale = Arc::new(Mutex::new(None));
        let seen = Arc::clone(&stale);
        hooked.before_commit(crate::hooked::writes_key(keys::block_claim(&cidr), true), {
            move || async move {
                creation
                    .take_first(&other, cidr, first, "other", "node-a")
                    .await;
                let info = other
                    .get_assignment(first)
                    .await
                    .expect("read")
                    .expect("allocated");
                other
                    .release_host("node-a", false)
                    .await
                    .expect("release host");
                other.release_handle("other").await.expect("release");
                assert!(
                    other.utilization().await.expect("usage").pools[0]
                        .blocks
                        .is_empty(),
                    "the other client's empty unaffine block is deleted"
                );
                *seen.lock().expect("stale sequence") = Some(info.sequence);
            }
        });
        creation
            .take_first(&creator, cidr, first, "creator", "node-b")
            .await;
        assert!(
            hooked.commit_hook_fired(),
            "{creation:?}: the other client never ran"
        );
        let sequence = stale
            .lock()
            .expect("stale sequence")
            .take()
            .expect("the other client's sequence");
        let late = creator
            .release_ips(&[ReleaseRequest {
                ip: first,
                sequence: Some(sequence),
            }])
            .await
            .expect("guarded release");
        assert!(
            late.released.is_empty(),
            "{creation:?}: a release guarded with the deleted block's (address, sequence) pair \
             ({first}, {sequence}) freed the creator's live address: {late:?}"
        );
        assert_eq!(late.sequence_mismatch, vec![first], "{creation:?}");
        assert_eq!(
            holder(&creator, first).await.as_deref(),
            Some("creator"),
            "{creation:?}: the creator keeps its address"
        );
        assert_clean(&creator).await;
    }
}

/// Defect 2: `delete_pool` without force never releases an address an ADD was given, whether
/// the ADD lands before the delete reads anything or between its reads.
pub async fn pool_delete_racing_an_add_never_releases_a_live_address<F: StoreFactory>(factory: &F) {
    for (moment, trigger) in [
        (
            "after the delete's first read",
            Box::new(|_: &[Read]| true) as ReadTrigger,
        ),
        (
            "after the delete lists the blocks",
            Box::new(lists(keys::blocks_dir())) as ReadTrigger,
        ),
    ] {
        let t = factory.fresh().await;
        let node = Ipam::new(Arc::clone(&t.store));
        node.create_pool(&spec("10.8.0.0/28", "pool", 30))
            .await
            .expect("pool");
        let hooked = HookedStore::new(Arc::clone(&t.store));
        let admin = Ipam::new(hooked.clone() as Arc<dyn KvStore>);
        let add_result = Arc::new(Mutex::new(None));
        let slot = Arc::clone(&add_result);
        let racer = node.clone();
        hooked.after_read(trigger, move || async move {
            let got = racer.auto_assign(&v4("racer", "node-a", 1)).await;
            *slot.lock().expect("slot") = Some(got);
        });
        let deleted = admin.delete_pool("pool", false).await;
        assert!(
            hooked.read_hook_fired(),
            "{moment}: the racing ADD never ran"
        );
        let added = add_result
            .lock()
            .expect("slot")
            .take()
            .expect("the ADD finished");
        match added {
            Ok(got) => {
                let address = got.v4[0].ip;
                assert!(
                    matches!(deleted, Err(IpamError::PoolInUse { .. })),
                    "{moment}: the ADD got {address} but the delete returned {deleted:?}"
                );
                assert_eq!(
                    holder(&node, address).await.as_deref(),
                    Some("racer"),
                    "{moment}: the delete released a live address"
                );
                let pool = node.get_pool("pool").await.expect("pool kept");
                assert!(
                    !pool.disabled,
                    "{moment}: a refused delete re-enables the pool"
                );
            }
            Err(e) => {
                let outcome = deleted.expect("nothing in use: the delete succeeds");
                assert_eq!(outcome.released_addresses, 0, "{moment}: {e}");
            }
        }
        assert_clean(&node).await;
    }
}

/// `delete_pool` never starts on a pool it cannot finish: a block of the pool, or an owner key of
/// one, that cannot be decoded is named, forced or not, before anything is written (the pool is
/// left enabled, no address released). Damage in another pool is passed over.
pub async fn pool_delete_refuses_damage_in_its_pool_and_passes_over_damage_elsewhere<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.7.0.0/24", 30).await;
    ipam.create_pool(&spec("10.8.0.0/24", "other", 30))
        .await
        .expect("pool");
    let mut request = v4("kept", "node-a", 1);
    request.v4_pools = vec!["pool".into()];
    let in_pool = ipam.auto_assign(&request).await.expect("assign").v4[0].ip;
    let mut request = v4("elsewhere", "node-a", 1);
    request.v4_pools = vec!["other".into()];
    let elsewhere = ipam.auto_assign(&request).await.expect("assign").v4[0].ip;
    let pool_block = block_of(&ipam, in_pool).await;
    let owner_key = first_owner_key(t.store.as_ref(), &pool_block).await;
    let block_key = keys::block(Some("node-a"), &pool_block);

    for (what, damaged_key) in [
        ("an owner key", owner_key),
        ("its block", block_key.clone()),
    ] {
        let intact = damage(t.store.as_ref(), &damaged_key).await;
        for force in [false, true] {
            let before = t.store.list("").await.expect("list");
            match ipam.delete_pool("pool", force).await {
                Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, damaged_key, "{what}"),
                // Unforced, a block whose value decodes is refused for the address it holds.
                Err(IpamError::PoolInUse { in_use: 1, .. }) if !force && what != "its block" => {}
                other => panic!("{what}, force {force}: expected a refusal, got {other:?}"),
            }
            assert_eq!(
                t.store.list("").await.expect("list"),
                before,
                "{what}, force {force}: nothing written (the pool left enabled)"
            );
        }
        t.store.put(&damaged_key, intact).await.expect("restore it");
    }

    // Damage that appears after the forced delete's first read: the delete fails on it, having
    // released nothing, and re-enables the pool it disabled.
    let intact = t
        .store
        .get(&block_key)
        .await
        .expect("get")
        .expect("the pool's block")
        .value;
    let hooked = HookedStore::new(Arc::clone(&t.store));
    let admin = Ipam::new(hooked.clone() as Arc<dyn KvStore>);
    let store = Arc::clone(&t.store);
    let late = block_key.clone();
    hooked.after_read(lists(keys::owners_dir()), move || async move {
        store.put(&late, GARBAGE.to_vec()).await.expect("damage it");
    });
    match admin.delete_pool("pool", true).await {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, block_key),
        other => panic!("expected the block damaged late named, got {other:?}"),
    }
    assert!(hooked.read_hook_fired(), "the damage never came");
    assert!(
        !ipam.get_pool("pool").await.expect("kept").disabled,
        "a delete that failed before releasing anything re-enables the pool"
    );
    t.store.put(&block_key, intact).await.expect("restore it");
    assert_eq!(holder(&ipam, in_pool).await.as_deref(), Some("kept"));

    // A block of the other pool that cannot be decoded: this pool's delete goes on without it.
    let other_key = keys::block(Some("node-a"), &block_of(&ipam, elsewhere).await);
    let intact = damage(t.store.as_ref(), &other_key).await;
    match ipam.delete_pool("pool", false).await {
        Err(IpamError::PoolInUse { in_use: 1, .. }) => {}
        other => panic!("expected pool-in-use past the other pool's damage, got {other:?}"),
    }
    assert!(!ipam.get_pool("pool").await.expect("kept").disabled);
    let deleted = ipam.delete_pool("pool", true).await.expect("forced delete");
    assert_eq!((deleted.released_addresses, deleted.deleted_blocks), (1, 1));
    assert!(matches!(
        ipam.get_pool("pool").await,
        Err(IpamError::PoolNotFound(_))
    ));
    assert!(ipam.ips_by_handle("kept").await.expect("kept").is_empty());
    assert_eq!(
        t.store
            .get(&other_key)
            .await
            .expect("get")
            .expect("kept")
            .value,
        GARBAGE,
        "the damaged block of the other pool is left as it was"
    );
    t.store.put(&other_key, intact).await.expect("restore it");
    let kept: Vec<IpAddr> = ipam
        .ips_by_handle("elsewhere")
        .await
        .expect("elsewhere")
        .iter()
        .map(|a| a.ip)
        .collect();
    assert_eq!(kept, [elsewhere]);

    // A block of the pool that cannot be decoded, appearing after a forced delete emptied the
    // pool's blocks: the pool is not deleted over it (that block would lie in no pool). The
    // address released stays released; the pool stays disabled until the delete runs again.
    ipam.create_pool(&spec("10.7.0.0/24", "pool", 30))
        .await
        .expect("pool again");
    let mut request = v4("again", "node-a", 1);
    request.v4_pools = vec!["pool".into()];
    let again = ipam.auto_assign(&request).await.expect("assign").v4[0].ip;
    let emptied = keys::block(Some("node-a"), &block_of(&ipam, again).await);
    let stray_key = keys::block(Some("node-b"), &net("10.7.0.200/30"));
    let hooked = HookedStore::new(Arc::clone(&t.store));
    let admin = Ipam::new(hooked.clone() as Arc<dyn KvStore>);
    let store = Arc::clone(&t.store);
    let stray = stray_key.clone();
    hooked.before_commit(
        move |txn: &Txn| {
            txn.ops
                .iter()
                .any(|op| matches!(op, Op::Delete { key } if *key == emptied))
        },
        move || async move {
            store
                .put(&stray, GARBAGE.to_vec())
                .await
                .expect("damage it");
        },
    );
    match admin.delete_pool("pool", true).await {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, stray_key),
        other => panic!("expected the block that appeared named, got {other:?}"),
    }
    assert!(hooked.commit_hook_fired(), "the block never appeared");
    assert!(ipam.get_pool("pool").await.expect("kept").disabled);
    assert!(ipam.ips_by_handle("again").await.expect("again").is_empty());
    t.store.delete(&stray_key).await.expect("remove it");
    let deleted = ipam.delete_pool("pool", true).await.expect("run again");
    assert_eq!((deleted.released_addresses, deleted.deleted_blocks), (0, 0));
    assert_clean(&ipam).await;
}

/// Defect 3: a block that changes hosts between the read of its claim entry and the read of the
/// block is found, not taken for absent: releasing by handle and by address frees the address
/// instead of dropping the handle and leaking it.
pub async fn block_moving_between_reads_is_never_taken_for_absent<F: StoreFactory>(factory: &F) {
    let (t, node) = ipam_with_pool(factory, "10.7.0.0/28", 30).await;
    for release_by_handle in [true, false] {
        let handle = if release_by_handle {
            "by-handle"
        } else {
            "by-ip"
        };
        let host = format!("node-{handle}");
        let got = node
            .auto_assign(&v4(handle, &host, 1))
            .await
            .expect("assign");
        let (address, block) = (got.v4[0].ip, got.v4[0].block);
        let hooked = HookedStore::new(Arc::clone(&t.store));
        let admin = Ipam::new(hooked.clone() as Arc<dyn KvStore>);
        let mover = node.clone();
        let moving_host = host.clone();
        // Right after the claim entry is read, the block loses its affinity (moves key).
        hooked.after_read(is_exactly(keys::block_claim(&block)), move || async move {
            mover
                .release_affinity(&moving_host, block)
                .await
                .expect("move the block");
        });
        let released = if release_by_handle {
            admin.release_handle(handle).await.expect("release handle")
        } else {
            admin
                .release_ips(&[ReleaseRequest {
                    ip: address,
                    sequence: None,
                }])
                .await
                .expect("release address")
                .released
        };
        assert!(
            hooked.read_hook_fired(),
            "the block never moved under the read"
        );
        assert_eq!(
            released,
            vec![address],
            "{handle}: the address was released"
        );
        assert_eq!(holder(&node, address).await, None, "{handle}: leaked");
        assert!(node.ips_by_handle(handle).await.expect("read").is_empty());
    }
    assert_clean(&node).await;
}

/// A store that records every read it answers.
#[derive(Debug)]
struct RecordingStore {
    inner: Arc<dyn KvStore>,
    reads: Mutex<Vec<Vec<Read>>>,
}

#[async_trait]
impl KvStore for RecordingStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.reads
            .lock()
            .expect("reads")
            .push(vec![Read::Get(key.to_owned())]);
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.reads
            .lock()
            .expect("reads")
            .push(vec![Read::List(prefix.to_owned())]);
        self.inner.list(prefix).await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.inner.commit(txn).await
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        self.reads.lock().expect("reads").push(reads.to_vec());
        self.inner.read_many(reads).await
    }
}

/// A new host's first ADD (a block claim) reads the same keys whether the pool holds 1 block or
/// 60: one batched read of a fixed set of claim entries, never a listing of every block
/// (issue 9: the claim must not read the whole pool).
pub async fn new_block_search_reads_a_fixed_number_of_keys_whatever_the_store_holds<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.2.0.0/22", 30).await;
    let mut shapes = Vec::new();
    for hosts_before in [0usize, 60] {
        for h in shapes.len() * 1000..shapes.len() * 1000 + hosts_before {
            assign_one(&ipam, &format!("filler-{h}"), &format!("filler-host-{h}")).await;
        }
        let recording = Arc::new(RecordingStore {
            inner: Arc::clone(&t.store),
            reads: Mutex::new(Vec::new()),
        });
        let observed = Ipam::new(recording.clone() as Arc<dyn KvStore>);
        let host = format!("new-host-{hosts_before}");
        observed
            .auto_assign(&v4("first-add", &host, 1))
            .await
            .expect("first ADD claims a block");
        let reads = recording.reads.lock().expect("reads").clone();
        assert!(
            !reads
                .iter()
                .flatten()
                .any(|r| matches!(r, Read::List(p) if *p == keys::blocks_dir())),
            "with {hosts_before} other hosts the claim listed every block: {reads:?}"
        );
        // Round trips and the number of keys asked for, not counting the host's own directory.
        shapes.push((reads.len(), reads.iter().map(Vec::len).sum::<usize>()));
        ipam.release_handle("first-add").await.expect("release");
    }
    assert_eq!(
        shapes[0], shapes[1],
        "the claim's reads (round trips, keys) grew with the store"
    );
    assert_clean(&ipam).await;
}

/// Defect 6, allocator side: under strict affinity an address in another host's block is refused,
/// unless the request says strict affinity does not apply (network reservations, which belong to
/// no host).
pub async fn reservations_ignore_strict_affinity_only_when_asked<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.1.0.0/24", 26).await;
    ipam.update_config(|c| c.strict_affinity = true)
        .await
        .expect("strict affinity");
    let first = assign_one(&ipam, "pod", "node-a").await;
    // The next address of node-a's block.
    let IpAddr::V4(first_v4) = first else {
        panic!("an IPv4 pool gave {first}")
    };
    let gateway = IpAddr::V4((u32::from(first_v4) + 1).into());
    let request = |ignore_strict_affinity| AssignIpsRequest {
        ips: vec![gateway],
        handle: "net:gateway".into(),
        host: "-".into(),
        ignore_strict_affinity,
        ..Default::default()
    };
    let refused = ipam.assign_ips(&request(false)).await;
    assert!(
        matches!(refused, Err(IpamError::AffinityConflict { .. })),
        "{refused:?}"
    );
    ipam.assign_ips(&request(true))
        .await
        .expect("a reservation in node-a's block");
    assert_eq!(holder(&ipam, gateway).await.as_deref(), Some("net:gateway"));
    assert_clean(&ipam).await;
}

/// Defect 11, allocator side: with `skip_block_edges`, no block's network or last address is ever
/// handed out, auto-assign answers "exhausted" once only edges are left, and the edges stay free.
pub async fn skipping_block_edges_hands_out_only_host_addresses_until_exhausted<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.1.1.0/28", 29).await;
    let mut given = Vec::new();
    loop {
        let got = ipam
            .auto_assign(&AutoAssignRequest {
                skip_block_edges: true,
                ..v4(&format!("pod-{}", given.len()), "node-a", 1)
            })
            .await;
        match got {
            Ok(got) => given.push(got.v4[0].clone()),
            Err(IpamError::Exhausted { .. }) => break,
            Err(e) => panic!("assign {}: {e}", given.len()),
        }
        assert!(
            given.len() <= 12,
            "more than the 12 host addresses of two /29 blocks"
        );
    }
    assert_eq!(
        given.len(),
        12,
        "every host address of both blocks: {given:?}"
    );
    for address in &given {
        let block = address.block;
        assert!(
            address.ip != block.network() && address.ip != ip_last(block),
            "{} is an edge of {block}",
            address.ip
        );
    }
    let usage = ipam.utilization().await.expect("usage");
    assert_eq!(usage.pools[0].in_use, 12, "the four edges stay free");
    assert_clean(&ipam).await;
}

fn ip_last(block: ipnet::IpNet) -> IpAddr {
    match block {
        ipnet::IpNet::V4(v4) => IpAddr::V4(v4.broadcast()),
        ipnet::IpNet::V6(v6) => IpAddr::V6(v6.broadcast()),
    }
}

/// A metadata map that makes the allocation's attribute `target` bytes when encoded.
fn attributes_of_size(handle: &str, host: &str, target: usize) -> BTreeMap<String, String> {
    let mut metadata = BTreeMap::from([("pod".to_owned(), String::new())]);
    let size = |metadata: &BTreeMap<String, String>| {
        let mut with_node = metadata.clone();
        with_node.insert("node".into(), host.into());
        encode(&Attribute {
            handle: handle.into(),
            metadata: with_node,
        })
        .expect("encode")
        .len()
            - 1 // the format byte is not part of the attribute inside a block
    };
    while size(&metadata) < target {
        metadata.entry("pod".into()).or_default().push('p');
    }
    metadata
}

/// Defect 5: a block of the largest allowed size, every address with an attribute of the largest
/// allowed size, fills to its last address and then answers "exhausted" (IPv4 /23 and IPv6 /119).
pub async fn largest_blocks_fill_to_their_last_address_then_report_exhausted<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    ipam.create_pool(&spec("10.6.0.0/23", "big-v4", 23))
        .await
        .expect("v4 pool");
    ipam.create_pool(&spec("fd00:6::/119", "big-v6", 119))
        .await
        .expect("v6 pool");
    for (family_v6, count) in [(false, 512u32), (true, 512u32)] {
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..count {
            let handle = format!("k8s-pod-network.{i:064x}");
            let attributes = attributes_of_size(&handle, "node-a", MAX_ATTRIBUTE_BYTES - 8);
            let got = ipam
                .auto_assign(&AutoAssignRequest {
                    handle: handle.clone(),
                    host: "node-a".into(),
                    num_v4: u32::from(!family_v6),
                    num_v6: u32::from(family_v6),
                    attributes,
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("address {i} of {count} (v6: {family_v6}): {e}"));
            let address = got.v4.iter().chain(&got.v6).next().expect("one").ip;
            assert!(seen.insert(address), "{address} handed out twice");
        }
        let over = ipam
            .auto_assign(&AutoAssignRequest {
                handle: "one-too-many".into(),
                host: "node-a".into(),
                num_v4: u32::from(!family_v6),
                num_v6: u32::from(family_v6),
                ..Default::default()
            })
            .await;
        assert!(
            matches!(over, Err(IpamError::Exhausted { .. })),
            "a full pool answers exhausted, got {over:?}"
        );
    }
    assert_clean(&ipam).await;
}

/// Defect 5: an attribute over the limit is refused before anything is written; a block size
/// whose full block could not be stored is refused when the pool is created.
pub async fn oversized_attributes_and_unfillable_block_sizes_are_refused<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.5.0.0/24", 26).await;
    let before = t.store.list("").await.expect("dump");
    let handle = "too-big";
    let attributes = attributes_of_size(handle, "node-a", MAX_ATTRIBUTE_BYTES + 1);
    let refused = ipam
        .auto_assign(&AutoAssignRequest {
            handle: handle.into(),
            host: "node-a".into(),
            num_v4: 1,
            attributes: attributes.clone(),
            ..Default::default()
        })
        .await;
    assert!(
        matches!(refused, Err(IpamError::InvalidArgument(ref m)) if m.contains("bytes")),
        "{refused:?}"
    );
    let refused = ipam
        .assign_ips(&AssignIpsRequest {
            ips: vec![ip("10.5.0.9")],
            handle: handle.into(),
            host: "node-a".into(),
            attributes,
            ..Default::default()
        })
        .await;
    assert!(
        matches!(refused, Err(IpamError::InvalidArgument(_))),
        "{refused:?}"
    );
    assert_eq!(
        t.store.list("").await.expect("dump"),
        before,
        "nothing written"
    );
    for (cidr, size) in [("10.4.0.0/16", 22u8), ("fd00:4::/112", 118u8)] {
        let refused = ipam
            .create_pool(&PoolSpec {
                cidr: net(cidr),
                name: None,
                block_size: Some(size),
                disabled: false,
            })
            .await;
        assert!(
            matches!(refused, Err(IpamError::InvalidArgument(_))),
            "block size /{size} accepted: {refused:?}"
        );
    }
}

/// Defect 5: a node holding several full blocks of the largest size (more bytes than one
/// transaction may carry) is released, by address and by host, in transactions that fit.
pub async fn releasing_several_full_blocks_splits_into_transactions_that_fit<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.3.0.0/21", 23).await;
    let host = "node-full";
    let mut all = Vec::new();
    // Written directly: three full /23 blocks with large attributes (what 1,536 ADDs leave),
    // their claim entries and their handles.
    for cidr in ["10.3.0.0/23", "10.3.2.0/23", "10.3.4.0/23"] {
        let mut block = Block::new(net(cidr), Some(host.into()), 1);
        let mut handles = Vec::new();
        for i in 0..512u32 {
            let handle = format!("k8s-pod-network.{cidr}-{i:058x}");
            let attribute = Attribute {
                metadata: attributes_of_size(&handle, host, MAX_ATTRIBUTE_BYTES - 8),
                handle: handle.clone(),
            };
            let ordinal = block.allocate_next(&attribute).expect("room");
            all.push(block.ip_of(ordinal));
            handles.push(handle);
        }
        let claim = keys::block_claim(&block.cidr);
        let key = keys::block_key_in(&block, ipam_core::model::FORMAT_VERSION);
        t.store
            .commit(
                Txn::new()
                    .when(Condition::absent(&key))
                    .when(Condition::absent(&claim))
                    .then(Op::put(&key, encode(&block).expect("encode")))
                    .then(Op::put(
                        &claim,
                        ipam_core::model::encode_claim(&block).expect("encode"),
                    )),
            )
            .await
            .expect("write a full block");
        for chunk in handles.chunks(100) {
            let mut txn = Txn::new();
            for handle in chunk {
                let mut value = Handle::default();
                value.add(block.cidr, 1);
                txn = txn.then(Op::put(
                    keys::handle(handle),
                    encode(&value).expect("encode"),
                ));
            }
            t.store.commit(txn).await.expect("write handles");
        }
    }
    assert_clean(&ipam).await;

    // By host first: the three blocks lose their affinity, more bytes than one transaction.
    let report = ipam.release_host(host, false).await.expect("release host");
    assert_eq!(report.unassigned_blocks.len(), 3, "{report:?}");
    // Then every address at once (GC and `release` do this), interleaved across the blocks so
    // that every chunk of the request touches all three.
    let mut interleaved: Vec<&IpAddr> = Vec::new();
    for i in 0..512 {
        interleaved.extend([&all[i], &all[512 + i], &all[1024 + i]]);
    }
    let requests: Vec<ReleaseRequest> = interleaved
        .into_iter()
        .map(|ip| ReleaseRequest {
            ip: *ip,
            sequence: None,
        })
        .collect();
    let outcome = ipam.release_ips(&requests).await.expect("release all");
    assert_eq!(outcome.released.len(), all.len());
    assert!(ipam.list_allocations().await.expect("list").is_empty());
    assert!(
        ipam.utilization().await.expect("usage").pools[0]
            .blocks
            .is_empty(),
        "empty unaffine blocks are deleted"
    );
    assert_clean(&ipam).await;
}

/// The read shape of one observed call by `host`: round trips, listings of blocks other than the
/// host's own directories, and block keys fetched one by one.
#[derive(Debug, PartialEq, Eq)]
struct ReadShape {
    round_trips: usize,
    block_listings: usize,
    block_gets: usize,
}

fn read_shape(reads: &[Vec<Read>], host: &str) -> ReadShape {
    let blocks = keys::blocks_dir();
    let own = keys::host_blocks_dir(host);
    let all = || reads.iter().flatten();
    ReadShape {
        round_trips: reads.len(),
        block_listings: all()
            .filter(
                |r| matches!(r, Read::List(p) if p.starts_with(&blocks) && !p.starts_with(&own)),
            )
            .count(),
        block_gets: all()
            .filter(|r| matches!(r, Read::Get(k) if k.starts_with(&blocks)))
            .count(),
    }
}

/// Issue 9: a host with no room of its own, in a pool whose every block another host has claimed,
/// borrows by listing the claim index (small entries carrying each block's free count) and reading
/// only the one lender it needs: the same round trips and block reads whether the pool has 16 blocks
/// or 64, and never a listing of the blocks.
pub async fn borrowing_reads_the_claim_index_and_only_the_lenders_it_needs<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    let mut shapes = Vec::new();
    for (pool, cidr, blocks) in [("small", "10.4.0.0/26", 16), ("large", "10.5.0.0/24", 64)] {
        ipam.create_pool(&spec(cidr, pool, 30))
            .await
            .expect("create pool");
        let in_pool = |handle: &str, host: &str| AutoAssignRequest {
            v4_pools: vec![pool.to_owned()],
            ..v4(handle, host, 1)
        };
        // Every block claimed by its own host, one address used: 95%+ of the pool claimed.
        for h in 0..blocks {
            ipam.auto_assign(&in_pool(
                &format!("{pool}-filler-{h}"),
                &format!("{pool}-host-{h}"),
            ))
            .await
            .expect("a filler host claims a block");
        }
        let recording = Arc::new(RecordingStore {
            inner: Arc::clone(&t.store),
            reads: Mutex::new(Vec::new()),
        });
        let observed = Ipam::new(recording.clone() as Arc<dyn KvStore>);
        let borrowed = observed
            .auto_assign(&in_pool(&format!("{pool}-borrower"), "borrower"))
            .await
            .expect("a host with no block of its own borrows");
        let lender = ipam
            .get_assignment(borrowed.v4[0].ip)
            .await
            .expect("read")
            .expect("the borrowed address is assigned");
        assert_eq!(lender.handle, format!("{pool}-borrower"));
        assert_ne!(
            lender.block_host.as_deref(),
            Some("borrower"),
            "the address came from another host's block"
        );
        let reads = recording.reads.lock().expect("reads").clone();
        let shape = read_shape(&reads, "borrower");
        assert_eq!(
            shape.block_listings, 0,
            "borrowing listed blocks: {reads:?}"
        );
        assert!(
            shape.block_gets <= 2,
            "borrowing one address read {} block keys (one lender is two candidate keys): {reads:?}",
            shape.block_gets
        );
        shapes.push(shape);
    }
    assert_eq!(
        shapes[0], shapes[1],
        "borrowing's reads grew with the number of blocks in the pool"
    );
    assert_clean(&ipam).await;
}

/// A host that must borrow passes over a lender whose block cannot be decoded (one damaged block
/// would otherwise fail every borrowing ADD of the cluster) and takes another lender's address,
/// never writing the damaged block; when only the damaged block could have had room, the request
/// fails naming it, not as exhausted pools; once restored, its addresses are lent again.
pub async fn borrowing_passes_over_a_lender_it_cannot_decode<F: StoreFactory>(factory: &F) {
    // Four /30 blocks, one per host: the pool has no block left to claim.
    let (t, ipam) = ipam_with_pool(factory, "10.7.0.0/28", 30).await;
    let mut firsts = Vec::new();
    for h in 0..4 {
        firsts.push(assign_one(&ipam, &format!("h{h}-pod"), &format!("h{h}")).await);
    }
    let mut blocks = Vec::new();
    for address in &firsts {
        blocks.push(block_of(&ipam, *address).await);
    }
    // h0's block, among the lenders (tried in address order), cannot be decoded.
    let damaged_key = t
        .store
        .list(&keys::host_blocks_dir("h0"))
        .await
        .expect("list h0's blocks")
        .into_iter()
        .map(|kv| kv.key)
        .next()
        .expect("h0's block");
    let intact = damage(t.store.as_ref(), &damaged_key).await;

    for n in 0..9 {
        let got = assign_one(&ipam, &format!("borrower-pod-{n}"), "borrower").await;
        assert!(
            blocks[1..].iter().any(|b| b.contains(&got)),
            "{got} comes from an intact lender, not {}",
            blocks[0]
        );
    }
    let before = t.store.list("").await.expect("list");
    match ipam
        .auto_assign(&v4("borrower-pod-last", "borrower", 1))
        .await
    {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, damaged_key),
        other => panic!("expected the damaged lender named, got {other:?}"),
    }
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "nothing written by the request that fell short"
    );
    assert_eq!(
        t.store
            .get(&damaged_key)
            .await
            .expect("get")
            .expect("still there")
            .value,
        GARBAGE.to_vec(),
        "the damaged block is never written"
    );

    t.store.put(&damaged_key, intact).await.expect("restore it");
    let got = assign_one(&ipam, "borrower-pod-last", "borrower").await;
    assert!(blocks[0].contains(&got), "{got} from the restored block");
    assert_clean(&ipam).await;
}

/// A block of the host that cannot be decoded (which would otherwise fail every ADD of the node)
/// is passed over: the host's next address comes from a new block, the damaged one is never
/// written nor claimed again (and the ADD of a pod whose address lies in it is refused naming it,
/// never given a second address); it still counts for the per-host block limit, and when the request
/// falls short the error names it (the host may have had room there), writing nothing; once
/// restored, its addresses are taken again.
pub async fn a_hosts_block_that_cannot_be_decoded_is_passed_over_and_still_counts_for_its_limit<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.7.0.0/24", 30).await;
    ipam.set_config(&ipam_core::IpamConfig {
        max_blocks_per_host: 2,
        ..ipam_core::IpamConfig::default()
    })
    .await
    .expect("config");
    let first = assign_one(&ipam, "h0-pod-0", "h0").await;
    let damaged_block = ipam
        .get_assignment(first)
        .await
        .expect("read")
        .expect("assigned")
        .block;
    let damaged_key = keys::block(Some("h0"), &damaged_block);
    let intact = damage(t.store.as_ref(), &damaged_key).await;
    let claim_before = t
        .store
        .get(&keys::block_claim(&damaged_block))
        .await
        .expect("get")
        .expect("its claim entry");

    // The plugin's ADD again for the pod whose address lies in it: named, never a second address.
    let before = t.store.list("").await.expect("list");
    match ipam
        .auto_assign(&AutoAssignRequest {
            reuse_existing: true,
            ..v4("h0-pod-0", "h0", 1)
        })
        .await
    {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, damaged_key),
        other => panic!("expected the damaged block named, got {other:?}"),
    }
    assert_eq!(t.store.list("").await.expect("list"), before);

    // Four addresses: the whole of a second /30 block, claimed for h0.
    let mut second = Vec::new();
    for n in 1..5 {
        let got = assign_one(&ipam, &format!("h0-pod-{n}"), "h0").await;
        assert!(
            !damaged_block.contains(&got),
            "{got} from the damaged block"
        );
        second.push(got);
    }
    let info = ipam
        .get_assignment(second[0])
        .await
        .expect("read")
        .expect("assigned");
    assert_eq!(info.block_host.as_deref(), Some("h0"));
    assert!(second.iter().all(|a| info.block.contains(a)), "{second:?}");
    assert_eq!(
        t.store
            .get(&keys::block_claim(&damaged_block))
            .await
            .expect("get")
            .expect("its claim entry")
            .value,
        claim_before.value,
        "the damaged block's claim is left as it was"
    );

    // Two blocks owned, the damaged one among them: no third block, and the damaged one named.
    let before = t.store.list("").await.expect("list");
    match ipam.auto_assign(&v4("h0-pod-5", "h0", 1)).await {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, damaged_key),
        other => panic!("expected the damaged block named, got {other:?}"),
    }
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "nothing written by the request that fell short"
    );

    t.store.put(&damaged_key, intact).await.expect("restore it");
    let got = assign_one(&ipam, "h0-pod-5", "h0").await;
    assert!(
        damaged_block.contains(&got),
        "{got} from the restored block"
    );
    assert_clean(&ipam).await;
}

/// Issue 9: every write of a block rewrites its claim index entry with the block's owner and free
/// count, in the same transaction, so that searches read the index instead of the blocks.
pub async fn claim_entries_follow_each_blocks_free_count<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.6.0.0/24", 28).await;
    let claim_of = |cidr| {
        let store = Arc::clone(&t.store);
        async move {
            let kv = store
                .get(&keys::block_claim(&cidr))
                .await
                .expect("get")
                .expect("a claim entry");
            ipam_core::model::decode_claim(&kv.key, &kv.value).expect("decode claim")
        }
    };
    let mut taken = Vec::new();
    for i in 0..5 {
        let got = ipam
            .auto_assign(&v4(&format!("pod-{i}"), "node-a", 1))
            .await
            .expect("assign");
        taken.push(got.v4[0].clone());
    }
    let block = taken[0].block;
    let claim = claim_of(block).await;
    assert_eq!(claim.affinity.as_deref(), Some("node-a"));
    assert_eq!(claim.free, Some(16 - 5));
    ipam.release_ips(&[ReleaseRequest {
        ip: taken[2].ip,
        sequence: None,
    }])
    .await
    .expect("release");
    assert_eq!(claim_of(block).await.free, Some(16 - 4));
    // Filled to the last address: the entry says 0, and a later search skips it without a read.
    ipam.auto_assign(&v4("rest", "node-a", 12))
        .await
        .expect("fill");
    assert_eq!(claim_of(block).await.free, Some(0));
    assert_clean(&ipam).await;
}

/// Issue 9 and the format upgrade: a claim entry written by format 1 (the owner alone) is read,
/// counted as consistent by `check`, tried by borrowing (its free count unknown), and rewritten in
/// format 2 with the free count by the next write of its block.
pub async fn format_1_claim_entries_are_read_tried_and_upgraded_on_write<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.7.0.0/28", 29).await;
    let owned = assign_one(&ipam, "owner-pod", "owner").await;
    let second = assign_one(&ipam, "owner-pod-2", "other-owner").await;
    let (cidr_a, cidr_b) = (net("10.7.0.0/29"), net("10.7.0.8/29"));
    assert!(cidr_a.contains(&owned) || cidr_b.contains(&owned));
    assert!(cidr_a.contains(&second) || cidr_b.contains(&second));
    // Rewrite both entries as format 1 wrote them: version byte 1, then the owner.
    for cidr in [cidr_a, cidr_b] {
        let key = keys::block_claim(&cidr);
        let kv = t.store.get(&key).await.expect("get").expect("claim");
        let owner = ipam_core::model::decode_claim(&key, &kv.value)
            .expect("decode")
            .affinity;
        let mut old = encode(&owner).expect("encode");
        old[0] = 1;
        t.store.put(&key, old).await.expect("put a format-1 entry");
        let entry = ipam_core::model::decode_claim(
            &key,
            &t.store.get(&key).await.expect("get").expect("claim").value,
        )
        .expect("a format-1 entry decodes");
        assert_eq!(entry.free, None, "format 1 records no free count");
    }
    assert_clean(&ipam).await;
    // Both blocks are claimed: a third host borrows, trying entries whose count is unknown.
    let borrowed = assign_one(&ipam, "borrower-pod", "borrower").await;
    assert!(cidr_a.contains(&borrowed) || cidr_b.contains(&borrowed));
    let lender = if cidr_a.contains(&borrowed) {
        cidr_a
    } else {
        cidr_b
    };
    let kv = t
        .store
        .get(&keys::block_claim(&lender))
        .await
        .expect("get")
        .expect("claim");
    assert_eq!(
        kv.value[0],
        ipam_core::model::FORMAT_VERSION,
        "rewritten in the current format"
    );
    assert_eq!(
        ipam_core::model::decode_claim(&kv.key, &kv.value)
            .expect("decode")
            .free,
        Some(8 - 2)
    );
    assert_clean(&ipam).await;
}

/// An unfinished import (its marker present) refuses every assignment, automatic or explicit, and
/// writes nothing; once the marker is gone, assignments work again.
pub async fn assignments_are_refused_while_an_import_is_unfinished<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.8.0.0/24", 26).await;
    t.store
        .put(&keys::import_in_progress(), b"marker".to_vec())
        .await
        .expect("put the marker");
    let before = t.store.list("").await.expect("list");
    let auto = ipam.auto_assign(&v4("pod", "node-a", 1)).await;
    assert!(
        matches!(&auto, Err(IpamError::Corrupt { key, .. }) if *key == keys::import_in_progress()),
        "{auto:?}"
    );
    let explicit = ipam
        .assign_ips(&AssignIpsRequest {
            ips: vec![ip("10.8.0.9")],
            handle: "explicit".into(),
            host: "node-a".into(),
            ..Default::default()
        })
        .await;
    assert!(
        matches!(&explicit, Err(IpamError::Corrupt { key, .. }) if *key == keys::import_in_progress()),
        "{explicit:?}"
    );
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "a refused assignment wrote something"
    );
    t.store
        .delete(&keys::import_in_progress())
        .await
        .expect("delete the marker");
    assign_one(&ipam, "pod", "node-a").await;
    assert_clean(&ipam).await;
}

/// Issue 9, node removal: releasing a node's addresses commits in batches of addresses, not one
/// transaction (and three reads) per pod: 60 pods cost a handful of commits.
pub async fn node_release_frees_many_pods_in_batches_not_one_transaction_each<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.9.0.0/24", 26).await;
    let mut held = Vec::new();
    for pod in 0..60 {
        let request = AutoAssignRequest {
            attributes: [("node".to_owned(), "dead-node".to_owned())].into(),
            ..v4(&format!("pod-{pod}"), "dead-node", 1)
        };
        held.push(ipam.auto_assign(&request).await.expect("assign").v4[0].ip);
    }
    let survivor = assign_one(&ipam, "survivor", "live-node").await;
    let counting = Arc::new(ipam_core::CountingStore::new(Arc::clone(&t.store)));
    let observed = Ipam::new(counting.clone() as Arc<dyn KvStore>);
    let report = observed
        .release_host("dead-node", true)
        .await
        .expect("release the node");
    held.sort();
    assert_eq!(report.released_addresses, held);
    let trips = counting.round_trips();
    assert!(
        trips.commits <= 4,
        "releasing 60 pods took {} commits ({trips:?}): one per pod or worse",
        trips.commits
    );
    assert_eq!(holder(&ipam, survivor).await.as_deref(), Some("survivor"));
    for ip in held {
        assert_eq!(holder(&ipam, ip).await, None, "{ip} still held");
    }
    assert_clean(&ipam).await;
}

/// A claim index entry written by a newer format (or damaged) is reported as corrupt, naming its
/// key, by every reader: the allocator's searches refuse to act on it and `check` lists it, and
/// nothing is written on its account.
pub async fn claim_entries_of_an_unknown_format_are_reported_never_misread<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.10.0.0/28", 29).await;
    assign_one(&ipam, "first", "node-a").await;
    assign_one(&ipam, "second", "node-b").await;
    // Every block is claimed; rewrite one claim entry with a format byte from the future.
    let claimed = net("10.10.0.0/29");
    let key = keys::block_claim(&claimed);
    let mut future = t.store.get(&key).await.expect("get").expect("claim").value;
    future[0] = ipam_core::model::FORMAT_VERSION + 1;
    t.store.put(&key, future).await.expect("put");
    let before = t.store.list("").await.expect("list");
    // A third host must read the claim index to borrow: refused, naming the key.
    let borrowed = ipam.auto_assign(&v4("third", "node-c", 1)).await;
    assert!(
        matches!(&borrowed, Err(IpamError::Corrupt { key: k, .. }) if *k == key),
        "{borrowed:?}"
    );
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "a refused assignment wrote"
    );
    let report = ipam.check(false).await.expect("check");
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == "corrupt-object" && p.detail.contains(&key)),
        "{report:#?}"
    );
}

/// Issue 10, DEL in two round trips: `release_chosen` reads the handle and the host's blocks with
/// room in one batch and commits once; it releases exactly what the caller picks, keeps the
/// handle for what is left and deletes it with the last address; addresses in the host's full
/// blocks (issue 25: read by key, not listed) and borrowed from another host's block are found
/// too, with one more read.
pub async fn release_chosen_frees_what_the_caller_picks_in_one_transaction<F: StoreFactory>(
    factory: &F,
) {
    // Two blocks of four: host-a fills one, host-b claims the other, host-a then borrows.
    let (t, ipam) = ipam_with_pool(factory, "10.12.0.0/29", 30).await;
    let own = ipam
        .auto_assign(&v4("own", "host-a", 4))
        .await
        .expect("fill host-a's block");
    let own: Vec<IpAddr> = own.v4.iter().map(|a| a.ip).collect();
    let other = assign_one(&ipam, "other", "host-b").await;
    let borrowed = ipam
        .auto_assign(&v4("borrower", "host-a", 2))
        .await
        .expect("borrow from host-b's block");
    let borrowed: Vec<IpAddr> = borrowed.v4.iter().map(|a| a.ip).collect();

    let counting = Arc::new(ipam_core::CountingStore::new(Arc::clone(&t.store)));
    let observed = Ipam::new(counting.clone() as Arc<dyn KvStore>);
    // Pick two of four in host-a's full block: the block read by key after the batch, one
    // transaction; the handle keeps the other two.
    let first = observed
        .release_chosen("own", "host-a", |held| {
            held.iter().take(2).map(|info| info.ip).collect()
        })
        .await
        .expect("release two");
    let trips = counting.take();
    assert_eq!((trips.reads, trips.commits), (2, 1), "{trips:?}");
    let held: Vec<IpAddr> = first.held.iter().map(|info| info.ip).collect();
    assert_eq!(
        held, own,
        "every allocation of the handle, in address order"
    );
    assert_eq!(first.released, own[..2].to_vec());
    for ip in &own[..2] {
        assert_eq!(holder(&ipam, *ip).await, None, "{ip} released");
    }
    let kept: Vec<IpAddr> = ipam
        .ips_by_handle("own")
        .await
        .expect("handle")
        .iter()
        .map(|a| a.ip)
        .collect();
    assert_eq!(
        kept,
        own[2..].to_vec(),
        "the handle keeps what was not picked"
    );
    assert_clean(&ipam).await;

    // Everything left, from a block with room now: one read, one transaction; the handle goes
    // too.
    counting.take();
    let rest = observed
        .release_chosen("own", "host-a", |held| held.iter().map(|i| i.ip).collect())
        .await
        .expect("release the rest");
    assert_eq!(rest.released, own[2..].to_vec());
    let trips = counting.take();
    assert_eq!((trips.reads, trips.commits), (1, 1), "{trips:?}");
    assert!(t
        .store
        .get(&keys::handle("own"))
        .await
        .expect("read")
        .is_none());

    // Borrowed addresses live in host-b's block: found with one more read, released all the same.
    let lent = observed
        .release_chosen("borrower", "host-a", |held| {
            held.iter().map(|i| i.ip).collect()
        })
        .await
        .expect("release borrowed");
    assert_eq!(lent.released, borrowed);
    assert_eq!(holder(&ipam, other).await.as_deref(), Some("other"));

    // Nothing to release: a read and no transaction; picking nothing writes nothing either.
    counting.take();
    let none = observed
        .release_chosen("never-assigned", "host-a", |held| {
            held.iter().map(|i| i.ip).collect()
        })
        .await
        .expect("unknown handle");
    assert!(none.held.is_empty() && none.released.is_empty());
    let picked_nothing = observed
        .release_chosen("other", "host-b", |_| Vec::new())
        .await
        .expect("pick nothing");
    assert_eq!(picked_nothing.held.len(), 1);
    assert!(picked_nothing.released.is_empty());
    assert_eq!(counting.take().commits, 0);
    assert_eq!(holder(&ipam, other).await.as_deref(), Some("other"));
    assert_clean(&ipam).await;
}

/// Issue 10, dead-node reclaim: an allocator guarded by a condition adds it to every
/// transaction; once the guard key changes, writes fail with `GuardLost` and change nothing.
pub async fn guarded_writes_stop_once_the_guard_no_longer_holds<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.13.0.0/24", 28).await;
    let guard_key = "ipam/v1/test-guard";
    let guarded = ipam.clone().guarded_by(vec![Condition::absent(guard_key)]);
    let first = assign_one(&guarded, "while-guard-holds", "host-a").await;
    t.store
        .put(guard_key, b"node came back".to_vec())
        .await
        .expect("break the guard");
    let before = t.store.list("").await.expect("snapshot");
    match guarded.auto_assign(&v4("after-guard", "host-a", 1)).await {
        Err(IpamError::GuardLost { key }) => assert_eq!(key, guard_key),
        other => panic!("expected GuardLost, got {other:?}"),
    }
    match guarded.release_host("host-a", true).await {
        Err(IpamError::GuardLost { key }) => assert_eq!(key, guard_key),
        other => panic!("expected GuardLost from the host release, got {other:?}"),
    }
    assert_eq!(
        t.store.list("").await.expect("snapshot"),
        before,
        "a lost guard writes nothing"
    );
    assert_eq!(
        holder(&ipam, first).await.as_deref(),
        Some("while-guard-holds")
    );
}

/// The reclaimer's empty-block pass (`release_empty_blocks`) starts from the claim index: with no
/// empty block it reads no block at all, whatever the store holds; with one host holding empty
/// blocks it reads that host's blocks only, and releases all but its newest.
pub async fn empty_block_release_reads_the_claim_index_and_only_the_blocks_it_may_release<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    ipam.create_pool(&spec("10.6.0.0/24", "release-pass", 30))
        .await
        .expect("create pool");
    for h in 0..24 {
        ipam.auto_assign(&v4(&format!("busy-{h}"), &format!("busy-host-{h}"), 1))
            .await
            .expect("a busy host claims a block");
    }
    let filter = ipam_core::EmptyBlockFilter {
        older_than_seconds: 0,
        only_unselected: false,
    };
    let recording = Arc::new(RecordingStore {
        inner: Arc::clone(&t.store),
        reads: Mutex::new(Vec::new()),
    });
    let observed = Ipam::new(recording.clone() as Arc<dyn KvStore>);
    let found = observed
        .release_empty_blocks(filter, true)
        .await
        .expect("a pass with nothing to release");
    assert!(found.is_empty(), "{found:?}");
    let reads = recording.reads.lock().expect("reads").clone();
    let shape = read_shape(&reads, "nobody");
    assert_eq!(
        (shape.round_trips, shape.block_listings, shape.block_gets),
        (1, 0, 0),
        "a pass over a store with no empty block read blocks: {reads:?}"
    );

    // One host with three blocks, all emptied: the two older ones go, its newest stays.
    ipam.auto_assign(&v4("emptied", "quiet-host", 9))
        .await
        .expect("three blocks of four addresses");
    ipam.release_handle("emptied").await.expect("release them");
    recording.reads.lock().expect("reads").clear();
    let found = observed
        .release_empty_blocks(filter, true)
        .await
        .expect("a pass with blocks to release");
    let released: Vec<_> = found.iter().filter(|b| b.released).collect();
    assert_eq!(released.len(), 2, "{found:?}");
    assert!(released
        .iter()
        .all(|b| b.host.as_deref() == Some("quiet-host")));
    let reads = recording.reads.lock().expect("reads").clone();
    let shape = read_shape(&reads, "quiet-host");
    assert_eq!(
        shape.block_listings, 0,
        "the pass listed blocks other than the emptied host's: {reads:?}"
    );
    assert_clean(&ipam).await;
}

/// Allocated addresses by block and node (the agent's `ipam_*` gauges) come from the claim index
/// and the borrowed-block indexes: the same counts as every allocation's own record, reading the
/// values of only the blocks that hold another node's addresses (a borrowed address, a block whose
/// affinity was released). An address recorded without its index entry (by a writer that keeps
/// none) counts for the block's owner until the borrower's agent's next survey puts the entry back.
pub async fn allocation_counts_read_the_claim_index_and_only_blocks_holding_other_nodes_addresses<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.7.0.0/24", 28).await;
    let mut first = Vec::new();
    for h in 0..6 {
        for n in 0..3 {
            let got = assign_one(&ipam, &format!("h{h}-pod-{n}"), &format!("h{h}")).await;
            if n == 0 {
                first.push(got);
            }
        }
    }
    let lender = block_of(&ipam, first[0]).await;
    let mut borrowed = None;
    for candidate in lender.hosts() {
        if ipam
            .get_assignment(candidate)
            .await
            .expect("read")
            .is_none()
        {
            borrowed = Some(candidate);
            break;
        }
    }
    ipam.assign_ips(&ipam_core::AssignIpsRequest {
        ips: vec![borrowed.expect("a free address in h0's block")],
        handle: "borrower-pod".into(),
        host: "borrower".into(),
        ..Default::default()
    })
    .await
    .expect("an address of h0's block for another node");
    let orphaned = block_of(&ipam, first[1]).await;
    ipam.release_affinity("h1", orphaned)
        .await
        .expect("h1's block loses its owner");
    // h5's pods gone: its block, kept for it, holds nothing.
    for n in 0..3 {
        ipam.release_handle(&format!("h5-pod-{n}"))
            .await
            .expect("release h5's pods");
    }
    // An ownerless block is read whether or not an index names it.
    t.store
        .delete(&keys::borrowed_key("h1", &orphaned))
        .await
        .expect("forget h1's entry");

    let exact = || async {
        let mut by_block: BTreeMap<ipnet::IpNet, BTreeMap<Option<String>, u64>> = BTreeMap::new();
        for a in ipam.list_allocations().await.expect("list") {
            *by_block
                .entry(a.block)
                .or_default()
                .entry(a.attributes.get("node").cloned())
                .or_default() += 1;
        }
        by_block
    };
    let recording = Arc::new(RecordingStore {
        inner: Arc::clone(&t.store),
        reads: Mutex::new(Vec::new()),
    });
    let observed = Ipam::new(recording.clone() as Arc<dyn KvStore>);
    let counts = observed.allocation_counts().await.expect("counts");
    let counted: BTreeMap<ipnet::IpNet, BTreeMap<Option<String>, u64>> = counts
        .blocks
        .iter()
        .filter(|b| !b.by_node.is_empty())
        .map(|b| (b.cidr, b.by_node.clone()))
        .collect();
    assert_eq!(
        counted,
        exact().await,
        "counts from the indexes and the blocks' own records"
    );
    let read: std::collections::BTreeSet<ipnet::IpNet> = counts
        .blocks
        .iter()
        .filter(|b| b.read)
        .map(|b| b.cidr)
        .collect();
    assert_eq!(
        read,
        [lender, orphaned].into(),
        "only the blocks holding other nodes' addresses are read"
    );
    let reads = recording.reads.lock().expect("reads").clone();
    assert!(
        reads
            .iter()
            .flatten()
            .all(|r| !matches!(r, Read::List(p) if p.starts_with(&keys::blocks_dir()))),
        "a listing of block values: {reads:?}"
    );
    assert_eq!(counts.blocks.len(), 6);

    // A claim entry of format 1 records no free count: its block is read and counted exactly.
    let plain = block_of(&ipam, first[2]).await;
    let claim_key = keys::block_claim(&plain);
    let owner = ipam_core::model::decode_claim(
        &claim_key,
        &t.store
            .get(&claim_key)
            .await
            .expect("get")
            .expect("claim")
            .value,
    )
    .expect("decode")
    .affinity;
    let mut format_1 = encode(&owner).expect("encode");
    format_1[0] = 1;
    t.store
        .put(&claim_key, format_1)
        .await
        .expect("a format-1 entry");
    let counts = observed.allocation_counts().await.expect("counts");
    let h2 = counts
        .blocks
        .iter()
        .find(|b| b.cidr == plain)
        .expect("h2's block");
    assert!(h2.read, "a block whose free count is unknown is read");
    assert_eq!(h2.by_node, BTreeMap::from([(Some("h2".to_owned()), 3)]));

    // The ownerless block emptied (and so deleted) between the index read and its own read: it
    // counts nothing, not what its claim entry said.
    let hooked = HookedStore::new(Arc::clone(&t.store));
    let releaser = Ipam::new(Arc::clone(&t.store));
    hooked.after_read(lists(keys::claims_dir()), move || async move {
        for n in 0..3 {
            releaser
                .release_handle(&format!("h1-pod-{n}"))
                .await
                .expect("release h1's pods");
        }
    });
    let counts = Ipam::new(hooked.clone() as Arc<dyn KvStore>)
        .allocation_counts()
        .await
        .expect("counts");
    assert!(hooked.read_hook_fired());
    assert!(
        counts.blocks.iter().all(|b| b.cidr != orphaned),
        "the deleted block is not counted: {counts:#?}"
    );

    // The borrower's entry gone (as a writer that keeps none leaves it): its address counts for
    // h0, the block's owner.
    t.store
        .delete(&keys::borrowed_key("borrower", &lender))
        .await
        .expect("delete the entry");
    let counts = observed.allocation_counts().await.expect("counts");
    let h0 = counts
        .blocks
        .iter()
        .find(|b| b.cidr == lender)
        .expect("h0's block");
    assert!(!h0.read);
    assert_eq!(
        h0.by_node,
        BTreeMap::from([(Some("h0".to_owned()), 4)]),
        "three of h0's addresses and the borrower's"
    );
}

/// One claim entry, block value or owner key that cannot be decoded does not stop the counts (the
/// agent's `ipam_*` gauges would vanish cluster-wide until it is repaired): it is named; a damaged
/// block (or the block of a damaged owner key) counts as a block of the owner its claim entry
/// records, with none of its addresses; a damaged claim entry's block is left out; every other
/// block is counted exactly. Nothing is written.
pub async fn allocation_counts_name_what_they_cannot_decode_and_count_the_rest<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.7.0.0/24", 28).await;
    let mut first = BTreeMap::new();
    for h in 0..4 {
        for n in 0..3 {
            let got = assign_one(&ipam, &format!("h{h}-pod-{n}"), &format!("h{h}")).await;
            first.entry(h).or_insert(got);
        }
    }
    // h0's block lends an address (so it is read), h1's loses its owner (so it is read too).
    let lender = block_of(&ipam, first[&0]).await;
    let borrowed = lender.hosts().nth(5).expect("a sixth address");
    ipam.assign_ips(&AssignIpsRequest {
        ips: vec![borrowed],
        handle: "borrower-pod".into(),
        host: "borrower".into(),
        ..Default::default()
    })
    .await
    .expect("an address of h0's block for another node");
    let orphaned = block_of(&ipam, first[&1]).await;
    ipam.release_affinity("h1", orphaned)
        .await
        .expect("h1's block loses its owner");
    let plain = block_of(&ipam, first[&2]).await;
    let untouched = block_of(&ipam, first[&3]).await;

    let lender_key = t
        .store
        .list(&keys::host_blocks_dir("h0"))
        .await
        .expect("list h0's blocks")
        .into_iter()
        .map(|kv| kv.key)
        .next()
        .expect("h0's block");
    let claim_key = keys::block_claim(&plain);
    let mut saved = Vec::new();
    for key in [&lender_key, &claim_key] {
        saved.push((key.clone(), damage(t.store.as_ref(), key).await));
    }
    let before = t.store.list("").await.expect("list");

    let counts = ipam
        .allocation_counts()
        .await
        .expect("counts past the damage");
    let mut named: Vec<String> = counts.undecodable.iter().map(|o| o.key.clone()).collect();
    named.sort();
    let mut expected = vec![lender_key.clone(), claim_key.clone()];
    expected.sort();
    assert_eq!(named, expected, "{counts:#?}");
    assert!(
        counts.undecodable.iter().all(|o| !o.message.is_empty()),
        "{counts:#?}"
    );
    let of = |cidr: ipnet::IpNet| counts.blocks.iter().find(|b| b.cidr == cidr);
    let damaged = of(lender).expect("the damaged block is still a block of h0");
    assert_eq!(damaged.host.as_deref(), Some("h0"));
    assert!(damaged.by_node.is_empty(), "{damaged:#?}");
    assert!(
        of(plain).is_none(),
        "a damaged claim entry's block: {counts:#?}"
    );
    assert_eq!(
        of(orphaned).expect("the ownerless block").by_node,
        BTreeMap::from([(Some("h1".to_owned()), 3)])
    );
    let h3 = of(untouched).expect("h3's block");
    assert_eq!(h3.host.as_deref(), Some("h3"));
    assert_eq!(h3.by_node, BTreeMap::from([(Some("h3".to_owned()), 3)]));
    assert_eq!(counts.blocks.len(), 3, "{counts:#?}");
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "nothing written"
    );

    // Repaired: every block counted again, nothing named.
    for (key, intact) in saved {
        t.store.put(&key, intact).await.expect("restore");
    }
    let counts = ipam.allocation_counts().await.expect("counts");
    assert!(counts.undecodable.is_empty(), "{counts:#?}");
    let lender_count = counts
        .blocks
        .iter()
        .find(|b| b.cidr == lender)
        .expect("h0's block");
    assert_eq!(
        lender_count.by_node,
        BTreeMap::from([(Some("borrower".to_owned()), 1), (Some("h0".to_owned()), 3)])
    );
    assert_eq!(counts.blocks.len(), 4);

    // An owner key of a block that is read (the ownerless one): whose its addresses are is
    // unknown, so it counts as a damaged block, named by that key.
    let owner = t
        .store
        .list(&keys::block_owners_dir(&orphaned))
        .await
        .expect("list the owner keys")
        .into_iter()
        .next()
        .expect("an owner key (a store of today's format keeps them apart)");
    damage(t.store.as_ref(), &owner.key).await;
    let counts = ipam.allocation_counts().await.expect("counts past it");
    let named: Vec<&str> = counts.undecodable.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(named, [owner.key.as_str()]);
    let ownerless = counts
        .blocks
        .iter()
        .find(|b| b.cidr == orphaned)
        .expect("the ownerless block is still a block");
    assert!(ownerless.by_node.is_empty(), "{ownerless:#?}");
    assert_eq!(
        counts
            .blocks
            .iter()
            .find(|b| b.cidr == lender)
            .expect("h0's block")
            .by_node
            .len(),
        2,
        "the lender is counted: {counts:#?}"
    );
    assert_eq!(counts.blocks.len(), 4);
}

/// `Ipam::utilization_and_allocations` (one read of the blocks, for `blockipamctl show`) answers
/// exactly what `Ipam::utilization` and `Ipam::list_allocations` answer apart: addresses in two
/// nodes' blocks, with their attributes.
pub async fn usage_and_allocations_read_together_are_what_each_query_answers<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.70.0.0/24", 30).await;
    let mut assigned = Vec::new();
    for n in 0..3 {
        assigned.push(assign_one(&ipam, &format!("a-{n}"), "node-a").await);
    }
    for n in 0..2 {
        let mut request = v4(&format!("b-{n}"), "node-b", 1);
        request.attributes = BTreeMap::from([("pod".to_owned(), format!("pod-b-{n}"))]);
        let got = ipam.auto_assign(&request).await.expect("assign on node-b");
        assigned.extend(got.v4.iter().map(|a| a.ip));
    }
    let (usage, mut allocations) = ipam
        .utilization_and_allocations()
        .await
        .expect("usage and allocations");
    let mut listed = ipam.list_allocations().await.expect("list");
    allocations.sort_by_key(|a| a.ip);
    listed.sort_by_key(|a| a.ip);
    assert_eq!(allocations, listed);
    assert_eq!(usage, ipam.utilization().await.expect("usage"));
    assigned.sort();
    assert_eq!(
        allocations.iter().map(|a| a.ip).collect::<Vec<_>>(),
        assigned
    );
    assert_eq!(usage.pools[0].in_use, 5);
    assert!(
        allocations
            .iter()
            .any(|a| a.attributes.get("pod").map(String::as_str) == Some("pod-b-1")),
        "{allocations:?}"
    );
}
