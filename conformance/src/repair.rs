//! Repair and release cases: `check --repair` beside objects it cannot decode, owner keys left
//! over or missing, a host release that keeps conflicting, and a release by address racing a
//! pool split, on every backend.

use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use ipam_core::check::kinds;
use ipam_core::kv::{KvError, KvStore, Read};
use ipam_core::model::{decode, encode, keys, Attribute, Block, FORMAT_VERSION};
use ipam_core::{Ipam, IpamError, PoolChange, ReleaseRequest, RetryPolicy};

use crate::hooked::HookedStore;
use crate::ipam::{assert_clean, assign_one, assign_one_allocation, ipam_with_pool, spec, v4};
use crate::StoreFactory;

/// Expands every repair case into one `#[tokio::test]` inside a module `repair`.
#[macro_export]
macro_rules! repair_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(repair, $crate::repair, $factory;
            repair_leaves_handles_alone_while_a_block_cannot_be_decoded,
            a_handle_that_does_not_decode_is_rewritten_from_the_blocks_unless_one_is_unreadable,
            repair_is_held_back_by_a_damaged_entry_inside_a_handles_block,
            claim_entries_naming_another_host_or_free_count_are_reported_and_rewritten_from_the_blocks,
            repair_keeps_an_empty_block_its_host_still_holds,
            owner_keys_beside_a_damaged_object_of_another_size_are_held_back,
            a_block_stored_twice_is_reported_and_its_claim_entry_left_alone,
            a_release_acts_on_the_block_its_claim_names_not_on_a_copy_under_another_host,
            repair_deletes_orphaned_owner_keys_and_holds_back_a_block_whose_owner_key_is_missing,
            an_owner_key_that_cannot_be_decoded_is_reported_and_refused_and_the_pods_del_still_frees_it,
            a_missing_owner_keys_address_is_freed_by_its_handles_release,
            an_owner_key_deleted_by_a_del_between_a_lookups_two_reads_is_not_taken_for_missing,
            release_host_gives_up_on_blocks_that_keep_conflicting_and_names_them,
            release_host_splits_blocks_too_many_for_one_transaction,
            release_by_address_racing_a_pool_split_still_releases,
            check_counts_the_blocks_handles_and_addresses_it_examined,
        );
    };
}

/// How a block is made undecodable.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// Bytes no format reads.
    Garbage,
    /// A valid block stamped with a format version newer than this build reads.
    FutureFormat,
}

/// Every key and value under `prefix`, without revisions (a repair that rewrote a value with the
/// same bytes would still show; one that left it alone shows nothing).
async fn contents(store: &dyn KvStore, prefix: &str) -> Vec<(String, Vec<u8>)> {
    store
        .list(prefix)
        .await
        .expect("list")
        .into_iter()
        .map(|kv| (kv.key, kv.value))
        .collect()
}

/// Runs `check --repair` and asserts it changed nothing in the store; returns its report.
async fn repair_changing_nothing(ipam: &Ipam, store: &dyn KvStore) -> ipam_core::CheckReport {
    let before = contents(store, "").await;
    let report = ipam.check(true).await.expect("check --repair");
    assert_eq!(
        contents(store, "").await,
        before,
        "the repair changed the store: {report:#?}"
    );
    report
}

/// Plants an undecodable claim index entry for the second /28 inside `block` (16 addresses in:
/// blocks of mixed sizes after a resize) and returns its key.
async fn damage_the_claim_entry_of_its_second_28(store: &dyn KvStore, block: &IpNet) -> String {
    let inside = block
        .subnets(28)
        .expect("the block's /28s")
        .nth(1)
        .expect("its second /28");
    let damaged = keys::block_claim(&inside);
    store
        .put(&damaged, vec![0xff, 0x00, 0x13, 0x37])
        .await
        .expect("plant the damaged entry");
    damaged
}

/// A claim index entry naming another host than its block (its free count right), and one
/// counting another number of free addresses (its host right), are each reported, and the repair
/// rewrites them from their blocks.
pub async fn claim_entries_naming_another_host_or_free_count_are_reported_and_rewritten_from_the_blocks<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.22.0.0/24", 26).await;
    let held = assign_one_allocation(&ipam, "pod-1", "node-a").await;
    let key = keys::block_claim(&held.block);
    let stored = t
        .store
        .get(&key)
        .await
        .expect("get")
        .expect("the claim entry");
    let mut claim: ipam_core::model::Claim = decode(&key, &stored.value).expect("decode");
    assert_eq!(claim.affinity.as_deref(), Some("node-a"));
    claim.affinity = Some("node-b".to_owned());
    t.store
        .put(&key, encode(&claim).expect("encode"))
        .await
        .expect("write the entry naming node-b");
    let other = assign_one_allocation(&ipam, "pod-2", "node-c").await.block;
    let other_key = keys::block_claim(&other);
    let stored = t.store.get(&other_key).await.expect("get").expect("entry");
    let mut claim: ipam_core::model::Claim = decode(&other_key, &stored.value).expect("decode");
    assert_eq!(claim.free, 63);
    claim.free = 60;
    t.store
        .put(&other_key, encode(&claim).expect("encode"))
        .await
        .expect("write the entry counting 60 free");

    let report = ipam.check(false).await.expect("check");
    let mut mismatches: Vec<&str> = report
        .problems
        .iter()
        .filter(|p| p.kind == kinds::CLAIM_MISMATCH && p.repairable)
        .map(|p| p.detail.as_str())
        .collect();
    mismatches.sort();
    let mut expected = vec![
        format!(
            "claim index says block {} belongs to Some(\"node-b\"), the block says Some(\"node-a\")",
            held.block
        ),
        format!("claim index says block {other} has 60 free addresses, the block has 63"),
    ];
    expected.sort();
    assert_eq!(mismatches, expected, "{report:#?}");
    let repaired = ipam.check(true).await.expect("check --repair");
    assert!(!repaired.repaired.is_empty(), "{repaired:#?}");
    assert_clean(&ipam).await;
    for (key, affinity) in [(&key, "node-a"), (&other_key, "node-c")] {
        let stored = t
            .store
            .get(key)
            .await
            .expect("get")
            .expect("the claim entry");
        let claim: ipam_core::model::Claim = decode(key, &stored.value).expect("decode");
        assert_eq!(
            (claim.affinity.as_deref(), claim.free),
            (Some(affinity), 63)
        );
    }
}

/// A clean check says how much it examined: every block (an empty one kept by its host
/// included), every handle, and every address the blocks hold.
pub async fn check_counts_the_blocks_handles_and_addresses_it_examined<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.24.0.0/24", 26).await;
    ipam.auto_assign(&v4("two", "node-a", 2))
        .await
        .expect("two addresses on node-a");
    ipam.auto_assign(&v4("one", "node-b", 1))
        .await
        .expect("one address on node-b");
    ipam.auto_assign(&v4("gone", "node-c", 1))
        .await
        .expect("one address on node-c");
    ipam.release_handle("gone").await.expect("release gone");
    let report = ipam.check(false).await.expect("check");
    assert!(report.problems.is_empty(), "{report:#?}");
    assert_eq!(
        (
            report.blocks_checked,
            report.handles_checked,
            report.allocations_checked
        ),
        (3, 2, 3),
        "three blocks (node-c's empty one kept), two handles, three addresses: {report:#?}"
    );
}

/// The repair deletes empty blocks without affinity only: an empty block its host still holds
/// (every pod on it gone, the block kept for the next) stays, with its claim entry, while the
/// repair fixes something else.
pub async fn repair_keeps_an_empty_block_its_host_still_holds<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.23.0.0/24", 26).await;
    let block = assign_one_allocation(&ipam, "pod-1", "node-a").await.block;
    ipam.release_handle("pod-1").await.expect("release pod-1");
    let kept = contents(t.store.as_ref(), "ipam/v1/blocks/").await;
    assert_eq!(kept.len(), 1, "node-a keeps its empty block");
    let claim = keys::block_claim(&block);
    let claim_before = t
        .store
        .get(&claim)
        .await
        .expect("get")
        .expect("claim entry");
    // Something the repair fixes: a handle that holds nothing.
    let mut ghost = ipam_core::model::Handle::default();
    ghost.add(block, 1);
    t.store
        .put(&keys::handle("ghost"), encode(&ghost).expect("encode"))
        .await
        .expect("write the ghost handle");

    let repaired = ipam.check(true).await.expect("check --repair");
    assert!(!repaired.repaired.is_empty(), "{repaired:#?}");
    assert_clean(&ipam).await;
    assert_eq!(
        contents(t.store.as_ref(), "ipam/v1/blocks/").await,
        kept,
        "the repair changed node-a's empty block: {repaired:#?}"
    );
    assert_eq!(
        t.store.get(&claim).await.expect("get").map(|kv| kv.value),
        Some(claim_before.value)
    );
}

/// Owner keys beside an object that cannot be decoded, of another block size (blocks of mixed
/// sizes after a resize): an owner key whose block holds no such address is reported but held
/// back while a damaged claim entry lies inside its block, and an owner key of a /28 inside a
/// damaged /26 is not taken for orphaned at all (what the /26 holds is unknown). The repair
/// writes nothing in either store.
pub async fn owner_keys_beside_a_damaged_object_of_another_size_are_held_back<F: StoreFactory>(
    factory: &F,
) {
    let stray = Attribute {
        handle: "ghost".into(),
        metadata: Default::default(),
    };

    // An owner key naming a free address of pod-1's /26, and a damaged /28 entry inside it.
    let (t, ipam) = ipam_with_pool(factory, "10.24.0.0/24", 26).await;
    let block = assign_one_allocation(&ipam, "pod-1", "node-a").await.block;
    let orphan = keys::owner_key(&block, 40);
    t.store
        .put(&orphan, encode(&stray).expect("encode"))
        .await
        .expect("plant the orphaned owner key");
    let damaged = damage_the_claim_entry_of_its_second_28(t.store.as_ref(), &block).await;
    let report = repair_changing_nothing(&ipam, t.store.as_ref()).await;
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == kinds::ORPHANED_OWNER_KEY
                && !p.repairable
                && p.detail.contains(&orphan)
                && p.detail.contains(&damaged)),
        "{orphan} is not reported as held back by {damaged}: {report:#?}"
    );

    // pod-1's /26 cannot be decoded, and an owner key names an address of a /28 inside it.
    let (t, ipam) = ipam_with_pool(factory, "10.24.0.0/24", 26).await;
    let block = assign_one_allocation(&ipam, "pod-1", "node-a").await.block;
    let block_key = keys::block(Some("node-a"), &block);
    t.store
        .get(&block_key)
        .await
        .expect("get")
        .expect("pod-1's block is where its host keeps it");
    t.store
        .put(&block_key, vec![0xff, 0x00, 0x13, 0x37])
        .await
        .expect("damage the block");
    let inside = block.subnets(28).expect("/28s").nth(1).expect("second /28");
    let nested = keys::owner_key(&inside, 0);
    t.store
        .put(&nested, encode(&stray).expect("encode"))
        .await
        .expect("plant the owner key of the /28");
    let report = repair_changing_nothing(&ipam, t.store.as_ref()).await;
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == kinds::CORRUPT_OBJECT && p.detail.contains(&block_key)),
        "the damaged block is not reported: {report:#?}"
    );
    assert!(
        !report
            .problems
            .iter()
            .any(|p| p.kind == kinds::ORPHANED_OWNER_KEY),
        "an owner key inside a block that cannot be decoded is taken for orphaned: {report:#?}"
    );
}

/// One block stored at two keys (its host's and another's) needs a person: `check` reports it,
/// and the repair leaves the claim index entry as it is rather than rewriting it from either copy.
pub async fn a_block_stored_twice_is_reported_and_its_claim_entry_left_alone<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.25.0.0/24", 26).await;
    let block = assign_one_allocation(&ipam, "pod-1", "node-a").await.block;
    let first = keys::block(Some("node-a"), &block);
    let second = keys::block(Some("node-b"), &block);
    t.store
        .put(
            &second,
            encode(&Block::new(block, Some("node-b".into()), 0)).expect("encode"),
        )
        .await
        .expect("store the block again, empty, under node-b");
    // The claim entry (naming node-a) is left as it is, not rewritten from node-b's copy.
    let report = repair_changing_nothing(&ipam, t.store.as_ref()).await;
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == kinds::OVERLAPPING_BLOCKS
                && !p.repairable
                && p.detail.contains("stored twice")
                && p.detail.contains(&first)
                && p.detail.contains(&second)),
        "the block stored twice is not reported: {report:#?}"
    );
    // The copy's claim mismatch is reported as what it is: not repairable (the repair leaves it).
    let claim_mismatches: Vec<_> = report
        .problems
        .iter()
        .filter(|p| p.kind == kinds::CLAIM_MISMATCH)
        .collect();
    assert!(
        !claim_mismatches.is_empty()
            && claim_mismatches
                .iter()
                .all(|p| !p.repairable && p.detail.contains("stored twice")),
        "a claim mismatch of the block stored twice is offered as repairable: {report:#?}"
    );
}

/// One block stored twice, its copy (holding the same address) left under another host's full
/// blocks: a release of the pod's handle by that host acts on the block the claim index names,
/// never on the copy, so the address is freed where it is held and the claim still names its
/// host.
pub async fn a_release_acts_on_the_block_its_claim_names_not_on_a_copy_under_another_host<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.26.0.0/24", 26).await;
    let held = assign_one_allocation(&ipam, "pod-1", "node-a").await;
    let block_key = keys::block(Some("node-a"), &held.block);
    let stored_block = |store: Arc<dyn KvStore>, key: String| async move {
        let kv = store
            .get(&key)
            .await
            .expect("get")
            .unwrap_or_else(|| panic!("no block at {key}"));
        decode::<Block>(&kv.key, &kv.value).expect("decode the block")
    };
    let mut copy = stored_block(Arc::clone(&t.store), block_key.clone()).await;
    assert!(
        !copy.allocations.is_empty(),
        "pod-1's address is in its block"
    );
    copy.affinity = Some("node-b".into());
    t.store
        .put(
            &keys::full_block("node-b", &held.block),
            encode(&copy).expect("encode"),
        )
        .await
        .expect("store a copy under node-b's full blocks");

    let outcome = ipam
        .release_chosen("pod-1", "node-b", |all| all.iter().map(|a| a.ip).collect())
        .await
        .expect("release pod-1 from node-b");
    assert_eq!(outcome.released, vec![held.ip]);
    let block = stored_block(Arc::clone(&t.store), block_key.clone()).await;
    assert!(
        block.allocations.is_empty(),
        "pod-1's address is still held in {block_key}: {block:?}"
    );
    let claim_key = keys::block_claim(&held.block);
    let claim = t
        .store
        .get(&claim_key)
        .await
        .expect("get")
        .expect("the block's claim entry");
    assert_eq!(
        ipam_core::model::decode_claim(&claim.key, &claim.value)
            .expect("decode the claim entry")
            .affinity
            .as_deref(),
        Some("node-a"),
        "the claim entry moved to the copy's host"
    );
}

/// A claim index entry that cannot be decoded, for a CIDR inside a block a handle holds
/// addresses in but not at its start (blocks of mixed sizes after a resize): what it holds is
/// unknown, so the handle's repair is held back, and nothing is written.
pub async fn repair_is_held_back_by_a_damaged_entry_inside_a_handles_block<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.21.0.0/24", 26).await;
    let held = assign_one_allocation(&ipam, "pod-1", "node-a").await;
    // The handle is lost (a missing handle: the repair would recreate it), and a /28 entry
    // inside its /26, starting 16 addresses in, cannot be decoded.
    t.store
        .delete(&keys::handle("pod-1"))
        .await
        .expect("lose the handle");
    let damaged = damage_the_claim_entry_of_its_second_28(t.store.as_ref(), &held.block).await;
    let report = repair_changing_nothing(&ipam, t.store.as_ref()).await;
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == kinds::MISSING_HANDLE
                && !p.repairable
                && p.detail.contains("\"pod-1\"")
                && p.detail.contains(&damaged)),
        "pod-1's handle is not reported as held back by {damaged}: {report:#?}"
    );
}

/// A block that cannot be decoded (damaged, or written by a newer format) beside handles with
/// addresses in it: `check --repair` rewrites and deletes nothing (every handle, claim index
/// entry and block stays byte-identical), reports the key and what it held back; once the block
/// is restored, releasing a handle by its id frees its addresses.
pub async fn repair_leaves_handles_alone_while_a_block_cannot_be_decoded<F: StoreFactory>(
    factory: &F,
) {
    for damage in [Damage::Garbage, Damage::FutureFormat] {
        let (t, ipam) = ipam_with_pool(factory, "10.20.0.0/24", 28).await;
        let pod_one = ipam
            .auto_assign(&v4("pod-1", "node-a", 2))
            .await
            .expect("assign pod-1");
        let mut pod_one: Vec<_> = pod_one.v4.iter().map(|a| a.ip).collect();
        pod_one.sort();
        assign_one(&ipam, "pod-2", "node-a").await;
        let elsewhere = assign_one_allocation(&ipam, "pod-3", "node-b").await;
        let block = t
            .store
            .list(&keys::host_blocks_dir("node-a"))
            .await
            .expect("list node-a's blocks")
            .into_iter()
            .find(|kv| {
                decode::<Block>(&kv.key, &kv.value).is_ok_and(|b| b.cidr.contains(&pod_one[0]))
            })
            .expect("node-a's block");
        let damaged = match damage {
            Damage::Garbage => vec![0xff, 0x00, 0x13, 0x37],
            Damage::FutureFormat => {
                let mut bytes = block.value.clone();
                bytes[0] = FORMAT_VERSION + 1;
                bytes
            }
        };
        t.store
            .put(&block.key, damaged)
            .await
            .expect("plant the damaged block");
        let before = contents(t.store.as_ref(), "").await;
        // An unrelated, repairable problem, so that the repair runs: node-b's block loses its
        // claim index entry (the repair writes it back, byte for byte).
        let claim = keys::block_claim(&elsewhere.block);
        t.store.delete(&claim).await.expect("delete a claim entry");

        let report = ipam.check(true).await.expect("check --repair");
        assert_eq!(
            contents(t.store.as_ref(), "").await,
            before,
            "{damage:?}: the repair changed the store: {report:#?}"
        );
        assert!(
            report
                .problems
                .iter()
                .any(|p| p.kind == kinds::CORRUPT_OBJECT && p.detail.contains(&block.key)),
            "{damage:?}: the damaged block is not reported: {report:#?}"
        );
        // The owner keys of its addresses are not taken for orphaned: what it holds is unknown.
        assert!(
            !report
                .problems
                .iter()
                .any(|p| p.kind == kinds::ORPHANED_OWNER_KEY),
            "{damage:?}: an owner key of the damaged block is reported as orphaned: {report:#?}"
        );
        // Each handle with addresses in the block is reported, not repairable, naming the key.
        for pod in ["pod-1", "pod-2"] {
            assert!(
                report.problems.iter().any(|p| p.kind == kinds::HANDLE_COUNT
                    && !p.repairable
                    && p.detail.contains(&format!("{pod:?}"))
                    && p.detail.contains(&block.key)),
                "{damage:?}: {pod}'s handle is not reported as held back: {report:#?}"
            );
        }
        assert!(
            report
                .problems
                .iter()
                .all(|p| !p.repairable || p.detail.contains(&elsewhere.block.to_string())),
            "{damage:?}: only node-b's claim entry may be repairable: {report:#?}"
        );
        assert!(
            report.repaired.iter().any(|r| r.starts_with("held back")
                && r.contains("\"pod-1\"")
                && r.contains(&block.key)),
            "{damage:?}: the repair does not say it held pod-1 back: {report:#?}"
        );

        // The block comes back (restored from a backup, or read by a newer build): the pods' DELs
        // find their handles and free their addresses.
        t.store
            .put(&block.key, block.value.clone())
            .await
            .expect("restore the block");
        let released = ipam.release_handle("pod-1").await.expect("release pod-1");
        assert_eq!(released, pod_one, "{damage:?}: pod-1's addresses");
        assert_eq!(
            ipam.release_handle("pod-2")
                .await
                .expect("release pod-2")
                .len(),
            1,
            "{damage:?}: pod-2's address"
        );
        assert_eq!(
            ipam.release_handle("pod-3").await.expect("release pod-3"),
            vec![elsewhere.ip],
            "{damage:?}: pod-3's address"
        );
        assert_clean(&ipam).await;
    }
}

/// The owner key of `ip` (its block and ordinal, as the allocator stores it).
async fn owner_key_of(ipam: &Ipam, ip: std::net::IpAddr) -> String {
    let held = ipam
        .get_assignment(ip)
        .await
        .expect("show the address")
        .expect("the address is held");
    let ordinal = match (ip, held.block.network()) {
        (std::net::IpAddr::V4(a), std::net::IpAddr::V4(n)) => u32::from(a) - u32::from(n),
        _ => panic!("an IPv4 address in an IPv4 block"),
    };
    keys::owner_key(&held.block, ordinal)
}

/// Format 6 keeps each new allocation's attribute in an owner key. `check --repair` deletes owner
/// keys that name no address their block holds apart (one in a block with room, one of a CIDR
/// with no block); an address whose owner key is missing is reported, not repairable: the
/// address stays held (showing or releasing it is refused as corrupt, naming the key, and changes
/// nothing), and its holder's handle is held back from repair. Once the key is restored, check is
/// clean and the handle's release frees both its addresses.
pub async fn repair_deletes_orphaned_owner_keys_and_holds_back_a_block_whose_owner_key_is_missing<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.22.0.0/24", 28).await;
    let mut pod_one: Vec<_> = ipam
        .auto_assign(&v4("pod-1", "node-a", 2))
        .await
        .expect("assign pod-1")
        .v4
        .iter()
        .map(|a| a.ip)
        .collect();
    pod_one.sort();
    let pod_two = assign_one(&ipam, "pod-2", "node-a").await;
    let pod_three = assign_one(&ipam, "pod-3", "node-b").await;
    let owners = contents(t.store.as_ref(), &keys::owners_dir()).await;
    assert_eq!(owners.len(), 4, "one owner key per address: {owners:?}");
    assert_clean(&ipam).await;

    // Left over: an owner key naming a free address of node-b's block, and one of a CIDR no
    // block covers.
    let stray = Attribute {
        handle: "ghost".into(),
        metadata: Default::default(),
    };
    let node_b_key = owner_key_of(&ipam, pod_three).await;
    let free_in_node_b = format!(
        "{}9",
        node_b_key.trim_end_matches(|c: char| c.is_ascii_digit())
    );
    let no_block = keys::owner_key(&"10.22.0.240/28".parse().expect("cidr"), 1);
    for key in [&free_in_node_b, &no_block] {
        t.store
            .put(key, encode(&stray).expect("encode"))
            .await
            .expect("plant an orphaned owner key");
    }
    // Missing: the owner key of pod-1's first address.
    let missing = owner_key_of(&ipam, pod_one[0]).await;
    let missing_value = t
        .store
        .get(&missing)
        .await
        .expect("get")
        .expect("pod-1's owner key")
        .value;
    t.store
        .delete(&missing)
        .await
        .expect("delete the owner key");
    let before_release = contents(t.store.as_ref(), "").await;
    for outcome in [
        ipam.get_assignment(pod_one[0]).await.map(|_| ()),
        ipam.release_ips(&[ReleaseRequest {
            ip: pod_one[0],
            sequence: None,
        }])
        .await
        .map(|_| ()),
    ] {
        assert!(
            matches!(&outcome, Err(IpamError::Corrupt { key, .. }) if *key == missing),
            "{outcome:?}"
        );
    }
    assert_eq!(
        contents(t.store.as_ref(), "").await,
        before_release,
        "the refused release changed the store"
    );

    let report = ipam.check(true).await.expect("check --repair");
    for key in [&free_in_node_b, &no_block] {
        assert!(
            report
                .problems
                .iter()
                .any(|p| p.kind == kinds::ORPHANED_OWNER_KEY
                    && p.repairable
                    && p.detail.contains(key.as_str())),
            "{key} is not reported as repairable: {report:#?}"
        );
        assert!(
            report.repaired.iter().any(|r| r.contains(key.as_str())),
            "{key} was not repaired: {report:#?}"
        );
        assert!(
            t.store.get(key).await.expect("get").is_none(),
            "{key} is still there"
        );
    }
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == kinds::MISSING_OWNER_KEY
                && !p.repairable
                && p.detail.contains(&pod_one[0].to_string())),
        "the missing owner key is not reported: {report:#?}"
    );
    assert!(
        report.problems.iter().any(|p| p.kind == kinds::HANDLE_COUNT
            && !p.repairable
            && p.detail.contains("\"pod-1\"")),
        "pod-1's handle is not held back: {report:#?}"
    );
    assert!(
        report
            .repaired
            .iter()
            .any(|r| r.starts_with("held back") && r.contains("\"pod-1\"")),
        "the repair does not say it held pod-1 back: {report:#?}"
    );
    // The held-back handle and the block are as they were; the key is still missing.
    let mut expected = before_release.clone();
    expected.retain(|(key, _)| key != &free_in_node_b && key != &no_block);
    assert_eq!(contents(t.store.as_ref(), "").await, expected);

    // Restored from a backup: clean, and every pod's release frees its addresses.
    t.store
        .put(&missing, missing_value)
        .await
        .expect("restore the owner key");
    assert_clean(&ipam).await;
    assert_eq!(
        ipam.release_handle("pod-1").await.expect("release pod-1"),
        pod_one
    );
    assert_eq!(
        ipam.release_handle("pod-2").await.expect("release pod-2"),
        vec![pod_two]
    );
    assert_eq!(
        ipam.release_handle("pod-3").await.expect("release pod-3"),
        vec![pod_three]
    );
    assert!(
        contents(t.store.as_ref(), &keys::owners_dir())
            .await
            .is_empty(),
        "owner keys left after every release"
    );
    assert_clean(&ipam).await;
}

/// An owner key that cannot be decoded: `check` reports it as a corrupt object naming the key,
/// not repairable, and `--repair` changes nothing; the reads that need it (the address's
/// assignment, a release by address) fail with `Corrupt` naming the key and write nothing; the
/// pod's DEL (by its handle, which records the pod's metadata) still frees the address and
/// removes the key, and the store is clean after it.
pub async fn an_owner_key_that_cannot_be_decoded_is_reported_and_refused_and_the_pods_del_still_frees_it<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.23.0.0/24", 28).await;
    let damaged_ip = assign_one(&ipam, "pod-1", "node-a").await;
    let other_ip = assign_one(&ipam, "pod-2", "node-a").await;
    let key = owner_key_of(&ipam, damaged_ip).await;
    t.store
        .put(&key, b"\xff\x00 not an attribute".to_vec())
        .await
        .expect("damage the owner key");
    let before = contents(t.store.as_ref(), "").await;
    for outcome in [
        ipam.get_assignment(damaged_ip).await.map(|_| ()),
        ipam.release_ips(&[ReleaseRequest {
            ip: damaged_ip,
            sequence: None,
        }])
        .await
        .map(|_| ()),
    ] {
        assert!(
            matches!(&outcome, Err(IpamError::Corrupt { key: named, .. }) if *named == key),
            "{outcome:?}"
        );
    }
    assert_eq!(contents(t.store.as_ref(), "").await, before);

    let report = ipam.check(true).await.expect("check --repair");
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == kinds::CORRUPT_OBJECT
                && !p.repairable
                && p.detail.contains(key.as_str())),
        "the damaged owner key is not reported: {report:#?}"
    );
    assert!(
        !report
            .problems
            .iter()
            .any(|p| p.kind == kinds::ORPHANED_OWNER_KEY || p.kind == kinds::MISSING_OWNER_KEY),
        "a damaged owner key is neither orphaned nor missing: {report:#?}"
    );
    assert_eq!(
        contents(t.store.as_ref(), "").await,
        before,
        "--repair changed the store"
    );
    // The other pod's address reads as before.
    assert!(ipam
        .get_assignment(other_ip)
        .await
        .expect("the other address reads")
        .is_some());

    assert_eq!(
        ipam.release_handle("pod-1").await.expect("the pod's DEL"),
        vec![damaged_ip]
    );
    assert!(
        t.store.get(&key).await.expect("get").is_none(),
        "the damaged key outlived the DEL"
    );
    assert_clean(&ipam).await;
}

/// An owner key missing with no backup to restore it from: `check` names the handle held back
/// beside it, and a release by that handle (the pod's DEL, `release --handle`) frees the address,
/// the handle recording the pod's metadata, while a release by address stays refused; the store is
/// clean after it and the other pod's address untouched.
pub async fn a_missing_owner_keys_address_is_freed_by_its_handles_release<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.24.0.0/24", 28).await;
    let lost_ip = assign_one(&ipam, "pod-1", "node-a").await;
    let other_ip = assign_one(&ipam, "pod-2", "node-a").await;
    let key = owner_key_of(&ipam, lost_ip).await;
    t.store.delete(&key).await.expect("delete the owner key");
    let released = ipam
        .release_ips(&[ReleaseRequest {
            ip: lost_ip,
            sequence: None,
        }])
        .await;
    assert!(
        matches!(&released, Err(IpamError::Corrupt { key: named, .. }) if *named == key),
        "{released:?}"
    );
    let report = ipam.check(false).await.expect("check");
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == kinds::MISSING_OWNER_KEY && p.detail.contains(&lost_ip.to_string())),
        "the missing owner key is not reported: {report:#?}"
    );
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.kind == kinds::HANDLE_COUNT && p.detail.contains("\"pod-1\"")),
        "the handle holding the address is not named: {report:#?}"
    );
    assert_eq!(
        ipam.release_handle("pod-1").await.expect("release pod-1"),
        vec![lost_ip]
    );
    assert_clean(&ipam).await;
    assert!(
        ipam.get_assignment(other_ip)
            .await
            .expect("the other address reads")
            .is_some(),
        "the other pod's address was released"
    );
}

/// A pod's DEL lands between a lookup's read of the address's block and its read of the address's
/// owner key: the key is gone, but so is the block as read, so the lookup (and a release by
/// address) decides again instead of reporting the key missing: the address is free.
pub async fn an_owner_key_deleted_by_a_del_between_a_lookups_two_reads_is_not_taken_for_missing<
    F: StoreFactory,
>(
    factory: &F,
) {
    for release_by_address in [false, true] {
        let (t, ipam) = ipam_with_pool(factory, "10.24.0.0/24", 28).await;
        let ip = assign_one(&ipam, "pod-1", "node-a").await;
        let kept = assign_one(&ipam, "pod-2", "node-a").await;
        let hooked = HookedStore::new(Arc::clone(&t.store));
        let direct = Ipam::new(Arc::clone(&t.store));
        // The read that locates the address's block (block keys, no owner key): the pod's DEL
        // runs right after it is answered.
        hooked.after_read(
            |reads| {
                let key_of = |read: &Read| match read {
                    Read::Get(key) | Read::List(key) => key.clone(),
                    _ => String::new(),
                };
                reads
                    .iter()
                    .any(|r| key_of(r).starts_with(&keys::blocks_dir()))
                    && !reads
                        .iter()
                        .any(|r| key_of(r).starts_with(&keys::owners_dir()))
            },
            move || async move {
                assert_eq!(
                    direct.release_handle("pod-1").await.expect("the pod's DEL"),
                    vec![ip]
                );
            },
        );
        let racing = Ipam::new(hooked.clone());
        if release_by_address {
            let outcome = racing
                .release_ips(&[ReleaseRequest { ip, sequence: None }])
                .await
                .expect("the release by address decides again");
            assert!(outcome.released.is_empty(), "{outcome:?}");
            assert_eq!(outcome.not_allocated, vec![ip], "{outcome:?}");
        } else {
            assert_eq!(
                racing
                    .get_assignment(ip)
                    .await
                    .expect("the lookup decides again"),
                None
            );
        }
        assert!(
            hooked.read_hook_fired(),
            "the DEL never ran between the reads"
        );
        assert!(ipam
            .get_assignment(kept)
            .await
            .expect("pod-2 reads")
            .is_some());
        assert_clean(&ipam).await;
    }
}

/// Releasing a host whose blocks change under every attempt gives up after the retry policy's
/// attempts, with an error naming the blocks, instead of retrying forever; nothing is written.
pub async fn release_host_gives_up_on_blocks_that_keep_conflicting_and_names_them<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.21.0.0/24", 28).await;
    let block = assign_one_allocation(&ipam, "pod", "node-a").await.block;
    let before = contents(t.store.as_ref(), "").await;
    // Every commit that rewrites a block fails its condition, as if another writer changed the
    // block each time.
    let hooked = HookedStore::new(Arc::clone(&t.store));
    hooked.refuse_commits(|txn| {
        txn.conditions
            .iter()
            .map(|c| c.key())
            .find(|k| k.starts_with(&keys::blocks_dir()))
            .map(|key| KvError::Conflict {
                key: key.to_owned(),
            })
    });
    let conflicting = Ipam::new(hooked).with_retry_policy(RetryPolicy {
        max_attempts: 6,
        base_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(4),
    });
    // Bounded: without a bound on its retries the release never returns.
    let outcome = tokio::time::timeout(
        Duration::from_secs(60),
        conflicting.release_host("node-a", false),
    )
    .await
    .expect("release_host kept retrying a conflict that never clears");
    match &outcome {
        Err(e @ IpamError::KeptConflicting { attempts, .. }) => {
            assert_eq!(*attempts, 6, "{e}");
            assert!(e.is_retryable(), "{e}");
            let text = e.to_string();
            assert!(text.contains(&block.to_string()), "names the block: {text}");
        }
        other => panic!("expected KeptConflicting, got {other:?}"),
    }
    assert_eq!(
        contents(t.store.as_ref(), "").await,
        before,
        "a release that gave up wrote"
    );
    // Without the interference it goes through.
    let released = ipam.release_host("node-a", false).await.expect("release");
    assert_eq!(released.unassigned_blocks, vec![block]);
}

/// Releasing a host whose blocks do not fit one transaction (32 full blocks, each write guarded
/// by the block and by its addresses' owner keys) takes them in as few smaller transactions as fit:
/// every block is unassigned, every address stays with its handle.
pub async fn release_host_splits_blocks_too_many_for_one_transaction<F: StoreFactory>(factory: &F) {
    let (t, ipam) = ipam_with_pool(factory, "10.22.0.0/24", 30).await;
    ipam.set_config(&ipam_core::IpamConfig {
        max_blocks_per_host: 32,
        ..ipam_core::IpamConfig::default()
    })
    .await
    .expect("config");
    let mut held = Vec::new();
    for i in 0..32 {
        let handle = format!("pod-{i}");
        let got = ipam
            .auto_assign(&v4(&handle, "node-a", 4))
            .await
            .unwrap_or_else(|e| panic!("assign {handle}: {e}"));
        assert_eq!(got.v4.len(), 4, "four addresses for {handle}");
        held.extend(got.v4.into_iter().map(|a| (a.ip, handle.clone())));
    }
    // The node's 32 blocks, each full (wherever its search started).
    let blocks: Vec<IpNet> = held
        .iter()
        .map(|(ip, _)| IpNet::new(*ip, 30).expect("a /30").trunc())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(blocks.len(), 32);
    // Yielding before every call, so that the bound below is checked even on a store whose
    // calls never wait.
    let hooked = HookedStore::racing(Arc::clone(&t.store));
    // Bounded: a release that never gets smaller never ends.
    let report = tokio::time::timeout(
        Duration::from_secs(60),
        Ipam::new(hooked.clone()).release_host("node-a", false),
    )
    .await
    .expect("release_host never finished")
    .expect("release");
    let mut unassigned = report.unassigned_blocks.clone();
    unassigned.sort();
    assert_eq!(unassigned, blocks);
    assert!(report.deleted_blocks.is_empty(), "{report:?}");
    // More than one transaction (the 32 did not fit one), far fewer than one per block.
    let commits = hooked.commits();
    assert!((2..=4).contains(&commits), "{commits} transactions");
    let usage = ipam.utilization().await.expect("usage");
    assert!(
        usage.pools[0].blocks.iter().all(|b| b.host.is_none()),
        "{usage:?}"
    );
    for (ip, handle) in held {
        let info = ipam.get_assignment(ip).await.expect("read").expect("held");
        assert_eq!(info.handle, handle, "{ip}");
    }
    assert_clean(&ipam).await;
}

/// A release by address of an address in a block of a former size, racing a split of its pool
/// (the pool and its mixed-sizes record are replaced between the release's reads), still finds the
/// block and frees the address.
pub async fn release_by_address_racing_a_pool_split_still_releases<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let hooked = HookedStore::new(Arc::clone(&t.store));
    let store: Arc<dyn KvStore> = hooked.clone();
    let ipam = Ipam::new(store);
    let direct = Ipam::new(Arc::clone(&t.store));
    direct
        .create_pool(&spec("10.22.0.0/24", "pool", 28))
        .await
        .expect("create pool");
    let ip = assign_one(&direct, "pod", "node-a").await;
    // New blocks are /26 from now on: the pool records that it holds /28 blocks too.
    direct
        .set_pool(
            "pool",
            &PoolChange {
                block_size: Some(26),
                ..PoolChange::default()
            },
        )
        .await
        .expect("change the block size");
    // Right after the release reads the pools, the pool is split in two.
    let splitter = Ipam::new(Arc::clone(&t.store));
    hooked.after_read(
        |reads| {
            reads
                .iter()
                .any(|r| matches!(r, Read::List(p) if *p == keys::pools_dir()))
        },
        move || async move {
            splitter.split_pool("pool", 2).await.expect("split");
        },
    );
    let outcome = ipam
        .release_ips(&[ReleaseRequest { ip, sequence: None }])
        .await
        .expect("release");
    assert!(hooked.read_hook_fired(), "the split did not run");
    assert_eq!(outcome.released, vec![ip], "{outcome:?}");
    assert!(outcome.not_allocated.is_empty(), "{outcome:?}");
    assert_eq!(direct.get_assignment(ip).await.expect("who holds it"), None);
    assert_clean(&direct).await;
}

/// A handle object that cannot be decoded stops its pod's DEL. Its blocks hold every address it
/// records, so `check` reports it as a corrupt object the repair rewrites from them (never as a
/// missing handle, which a report would let an operator release), and once nothing else is
/// unreadable the repair writes over it at the revision read (one the blocks hold nothing for is
/// deleted) and the DEL frees its addresses. While any block cannot be decoded, the blocks the
/// handle names are unknown: every such repair is held back and nothing is written.
pub async fn a_handle_that_does_not_decode_is_rewritten_from_the_blocks_unless_one_is_unreadable<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let held = ipam
        .auto_assign(&v4("h", "node-a", 2))
        .await
        .expect("assign")
        .v4;
    let on_b = assign_one_allocation(&ipam, "hb", "node-b").await;
    let damaged = b"garbage{".to_vec();
    for id in ["h", "hb", "ghost"] {
        t.store
            .put(&keys::handle(id), damaged.clone())
            .await
            .expect("damage the handle");
    }
    let block_b = keys::block(Some("node-b"), &on_b.block);
    let block_b_bytes = t
        .store
        .get(&block_b)
        .await
        .expect("get")
        .expect("node-b's block")
        .value;
    t.store
        .put(&block_b, damaged.clone())
        .await
        .expect("damage node-b's block");
    match ipam.release_handle("h").await {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, keys::handle("h")),
        other => panic!("the DEL must stop at the damaged handle, got {other:?}"),
    }
    let problems_of = |report: &ipam_core::CheckReport, id: &str| {
        report
            .problems
            .iter()
            .filter(|p| {
                p.handle.as_deref() == Some(id)
                    || p.detail.starts_with(&format!("{}:", keys::handle(id)))
            })
            .cloned()
            .collect::<Vec<_>>()
    };

    // With node-b's block unreadable, "hb" looks empty from the blocks: deleting it would lose
    // the address that block holds for it. Every damaged handle waits.
    let before = contents(t.store.as_ref(), &keys::handles_dir()).await;
    let report = ipam.check(true).await.expect("check --repair");
    for id in ["h", "hb", "ghost"] {
        let found = problems_of(&report, id);
        assert_eq!(found.len(), 1, "{id}: {report:#?}");
        assert_eq!(found[0].kind, kinds::CORRUPT_OBJECT);
        assert!(
            !found[0].repairable && found[0].detail.contains(&block_b),
            "{id} is held back by the unreadable block: {report:#?}"
        );
    }
    assert!(
        report
            .problems
            .iter()
            .all(|p| p.kind != kinds::MISSING_HANDLE),
        "a damaged handle exists: {report:#?}"
    );
    assert!(report.repaired.is_empty(), "{report:#?}");
    assert_eq!(
        contents(t.store.as_ref(), &keys::handles_dir()).await,
        before
    );

    t.store
        .put(&block_b, block_b_bytes)
        .await
        .expect("restore node-b's block");
    let report = ipam.check(false).await.expect("check");
    assert_eq!(
        report.handles_checked, 3,
        "the damaged handles are checked too"
    );
    let h = problems_of(&report, "h");
    assert_eq!(h.len(), 1, "{report:#?}");
    assert!(
        h[0].repairable && h[0].detail.contains("rewrites it from them"),
        "{report:#?}"
    );
    assert_eq!(h[0].addresses.len(), 2, "{report:#?}");
    let ghost = problems_of(&report, "ghost");
    assert!(
        ghost.len() == 1 && ghost[0].repairable && ghost[0].detail.contains("deletes it"),
        "{report:#?}"
    );
    let repaired = ipam.check(true).await.expect("repair");
    assert_eq!(repaired.repaired.len(), 3, "{repaired:#?}");
    assert_clean(&ipam).await;
    assert!(t
        .store
        .get(&keys::handle("ghost"))
        .await
        .expect("get")
        .is_none());
    let mut freed = ipam.release_handle("h").await.expect("the DEL works again");
    freed.sort();
    let mut wanted: Vec<_> = held.iter().map(|a| a.ip).collect();
    wanted.sort();
    assert_eq!(freed, wanted);
    assert_eq!(
        ipam.release_handle("hb").await.expect("hb's DEL"),
        vec![on_b.ip]
    );
}
