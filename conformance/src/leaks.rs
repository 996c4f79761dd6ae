//! Leak collection cases: the decision on a real store's allocations, and the release of what it decided, on every backend.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipam_core::allocator::leaks::{
    handle_id, AddressHolder, Disagreement, LeakDecisions, LeakPolicy, LeakWatch, LiveSandbox,
    Reassertion, RuntimeView, ATTR_CONTAINER_ID, ATTR_NAMESPACE, ATTR_POD, SURVEY_EVERY_LOOKS,
};
use ipam_core::allocator::{AssignIpsRequest, AutoAssignRequest};
use ipam_core::check::kinds;
use ipam_core::dead_nodes::{forget_node, register};
use ipam_core::model::keys;
use ipam_core::{Ipam, IpamError, ReleaseRequest};

use crate::ipam::{assert_clean, block_of, damage, first_owner_key, ipam_with_pool};
use crate::StoreFactory;

/// Expands every leak-collection case into one `#[test]` inside a module `leaks`.
#[macro_export]
macro_rules! leaks_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(leaks, $crate::leaks, $factory;
            a_look_releases_only_this_nodes_missing_containers_and_only_after_the_grace,
            a_decided_leak_whose_address_changed_hands_is_left_alone,
            live_addresses_recorded_for_another_node_or_free_are_reported,
            a_live_pods_free_address_is_recorded_again_and_a_held_one_is_left_alone,
            a_nodes_live_disagreements_are_problems_for_check_until_its_agent_finds_none,
            a_live_disagreements_record_that_does_not_decode_is_reported_replaced_and_forgotten,
            a_block_that_does_not_decode_is_named_and_nothing_it_covers_is_judged,
            an_owner_key_that_cannot_be_read_is_named_and_nothing_its_block_covers_is_judged,
            a_borrowed_address_is_indexed_and_collected_by_the_nodes_own_looks,
            a_borrowed_address_without_an_index_entry_is_indexed_by_the_next_survey,
            a_live_address_outside_the_nodes_blocks_makes_the_look_a_survey,
            a_forgotten_nodes_borrowed_index_goes_but_a_live_nodes_stays,
            a_block_that_loses_its_affinity_is_indexed_for_the_nodes_it_holds_addresses_of,
            an_index_key_that_names_no_block_stops_the_look_and_the_counts_naming_it,
        );
    };
}

const GRACE: u64 = 900;
/// Looks a grace and a second apart (the first that may release) still count as continuous.
const POLICY: LeakPolicy = LeakPolicy {
    grace_seconds: GRACE,
    max_gap_seconds: 2 * GRACE,
};
const T0: u64 = 1_800_000_000;

/// The attributes the plugin records for a Kubernetes pod's container (the allocator adds `node`).
fn pod_attributes(container: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (ATTR_CONTAINER_ID.to_owned(), container.to_owned()),
        (ATTR_POD.to_owned(), format!("pod-{container}")),
        (ATTR_NAMESPACE.to_owned(), "default".to_owned()),
    ])
}

/// One address for `container` on `host`, as the plugin asks for it (the allocator records `node`).
async fn assign_for(ipam: &Ipam, container: &str, host: &str) -> (IpAddr, u64) {
    let got = ipam
        .auto_assign(&AutoAssignRequest {
            handle: format!("net.{container}"),
            host: host.into(),
            num_v4: 1,
            attributes: pod_attributes(container),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("assign {container} on {host}: {e}"));
    let address = got.v4[0].ip;
    let info = ipam
        .get_assignment(address)
        .await
        .expect("read back")
        .expect("assigned");
    (address, info.sequence)
}

/// node-a's pods in a pool of /30 blocks: "live", "gone", "held" and "old" fill its first block,
/// "second-live" and "second-gone" are in its second, then node-b's "theirs" in a block of node-b.
async fn node_a_in_two_blocks(ipam: &Ipam) -> ([IpAddr; 4], IpAddr, IpAddr, IpAddr) {
    let mut first_block = [IpAddr::from([0, 0, 0, 0]); 4];
    for (slot, container) in first_block.iter_mut().zip(["live", "gone", "held", "old"]) {
        *slot = assign_for(ipam, container, "node-a").await.0;
    }
    let (second_live, _) = assign_for(ipam, "second-live", "node-a").await;
    let (second_gone, _) = assign_for(ipam, "second-gone", "node-a").await;
    let (theirs, _) = assign_for(ipam, "theirs", "node-b").await;
    (first_block, second_live, second_gone, theirs)
}

/// The addresses a look left waiting for their grace, sorted.
fn waiting_addresses(decisions: &LeakDecisions) -> Vec<IpAddr> {
    let mut waiting: Vec<IpAddr> = decisions.waiting.iter().map(|m| m.allocation.ip).collect();
    waiting.sort();
    waiting
}

/// The addresses a look decided leaked, sorted.
fn leaked_addresses(decisions: &LeakDecisions) -> Vec<IpAddr> {
    let mut leaked: Vec<IpAddr> = decisions.leaked.iter().map(|m| m.allocation.ip).collect();
    leaked.sort();
    leaked
}

fn view(at: u64, live: &[(&str, Vec<IpAddr>)]) -> RuntimeView {
    RuntimeView {
        observed_at: at,
        sandboxes: live
            .iter()
            .map(|(id, addresses)| {
                (
                    (*id).to_owned(),
                    LiveSandbox {
                        pod: format!("pod-{id}"),
                        namespace: "default".into(),
                        uid: format!("uid-{id}"),
                        addresses: addresses.clone(),
                    },
                )
            })
            .collect(),
    }
}

/// node-a: a live container, a gone one and a reservation (no container); node-b: a gone
/// container. Only node-a's gone container is released, and only at a look more than a grace after
/// the first that found it missing.
pub async fn a_look_releases_only_this_nodes_missing_containers_and_only_after_the_grace<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let (live, _) = assign_for(&ipam, "live", "node-a").await;
    let (gone, _) = assign_for(&ipam, "gone", "node-a").await;
    let (elsewhere, _) = assign_for(&ipam, "gone-b", "node-b").await;
    let reserved: IpAddr = "10.0.0.200".parse().expect("address");
    ipam.assign_ips(&AssignIpsRequest {
        ips: vec![reserved],
        handle: "reservation".into(),
        host: "node-a".into(),
        ..Default::default()
    })
    .await
    .expect("reserve");

    let mut watch = LeakWatch::new();
    let runtime = |at| view(at, &[("live", vec![live])]);
    // Looks stamp whole seconds: exactly GRACE apart may be less than GRACE of real time.
    for at in [T0, T0 + GRACE / 2, T0 + GRACE] {
        let decisions = ipam
            .look_for_leaks("node-a", &runtime(at), &mut watch, POLICY)
            .await
            .expect("look");
        assert!(decisions.leaked.is_empty(), "at {at}: {decisions:#?}");
        assert_eq!(decisions.waiting.len(), 1);
        assert_eq!(decisions.waiting[0].allocation.ip, gone);
        assert_eq!(decisions.live, 1);
        assert_eq!(decisions.not_a_pod, 1);
        assert!(decisions.disagreements.is_empty(), "{decisions:#?}");
        assert!(decisions.leaked_pools.is_empty(), "{decisions:#?}");
    }
    let decisions = ipam
        .look_for_leaks("node-a", &runtime(T0 + GRACE + 1), &mut watch, POLICY)
        .await
        .expect("look");
    assert_eq!(decisions.leaked.len(), 1, "{decisions:#?}");
    assert_eq!(decisions.leaked[0].allocation.ip, gone);
    assert_eq!(decisions.leaked[0].missing_since, T0);
    // Each decided leak's pool is named, for the agent's count of reclamations by pool.
    assert_eq!(
        decisions.leaked_pools,
        std::collections::BTreeMap::from([(gone, "pool".to_owned())])
    );
    let outcome = ipam
        .release_leaked(&decisions.leaked)
        .await
        .expect("release");
    assert_eq!(outcome.released, [gone]);
    assert!(outcome.skipped.is_empty());

    assert_eq!(ipam.get_assignment(gone).await.expect("read"), None);
    for kept in [live, elsewhere, reserved] {
        assert!(
            ipam.get_assignment(kept).await.expect("read").is_some(),
            "{kept} must be kept"
        );
    }
    assert_clean(&ipam).await;
}

/// A leak decided on, then its address released and taken by another pod before the release
/// runs: the release is refused by the sequence guard and the new owner keeps it.
pub async fn a_decided_leak_whose_address_changed_hands_is_left_alone<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let (gone, sequence) = assign_for(&ipam, "gone", "node-a").await;
    let (live, _) = assign_for(&ipam, "live", "node-a").await;
    let runtime = |at| view(at, &[("live", vec![live])]);
    let mut watch = LeakWatch::new();
    ipam.look_for_leaks("node-a", &runtime(T0), &mut watch, POLICY)
        .await
        .expect("look");
    let decisions = ipam
        .look_for_leaks("node-a", &runtime(T0 + GRACE + 1), &mut watch, POLICY)
        .await
        .expect("look");
    assert_eq!(decisions.leaked.len(), 1);
    assert_eq!(decisions.leaked[0].allocation.sequence, sequence);

    // Between the decision and its release: the pod's own DEL, and a new pod given the address.
    ipam.release_ips(&[ReleaseRequest {
        ip: gone,
        sequence: None,
    }])
    .await
    .expect("DEL");
    ipam.assign_ips(&AssignIpsRequest {
        ips: vec![gone],
        handle: "net.newcomer".into(),
        host: "node-a".into(),
        attributes: pod_attributes("newcomer"),
        ..Default::default()
    })
    .await
    .expect("the address taken again");

    let outcome = ipam
        .release_leaked(&decisions.leaked)
        .await
        .expect("release");
    assert!(outcome.released.is_empty(), "{outcome:?}");
    assert_eq!(outcome.skipped, [gone]);
    let holder = ipam
        .get_assignment(gone)
        .await
        .expect("read")
        .expect("still assigned");
    assert_eq!(holder.handle, "net.newcomer");
    assert_clean(&ipam).await;
}

/// A live pod using an address the store records for another node's container (a duplicate), and
/// one using a free address of a pool: both reported at the first look; an address outside every
/// pool is not ours and is not reported. Nothing is written.
pub async fn live_addresses_recorded_for_another_node_or_free_are_reported<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let (own, _) = assign_for(&ipam, "own", "node-a").await;
    let (theirs, _) = assign_for(&ipam, "theirs", "node-b").await;
    let free: IpAddr = "10.0.0.150".parse().expect("address");
    let outside: IpAddr = "192.168.7.7".parse().expect("address");
    let before = t.store.list("").await.expect("list");
    let mut watch = LeakWatch::new();
    let decisions = ipam
        .look_for_leaks(
            "node-a",
            &view(
                T0,
                &[("own", vec![own, theirs]), ("stray", vec![free, outside])],
            ),
            &mut watch,
            POLICY,
        )
        .await
        .expect("look");
    let reported: Vec<(IpAddr, &str, bool)> = decisions
        .disagreements
        .iter()
        .map(|d| {
            (
                d.address,
                d.sandbox_id.as_str(),
                matches!(&d.holder, AddressHolder::Other(info) if info.handle == "net.theirs"),
            )
        })
        .collect();
    assert_eq!(
        reported,
        [(theirs, "own", true), (free, "stray", false)],
        "{decisions:#?}"
    );
    assert!(matches!(
        decisions.disagreements[1].holder,
        AddressHolder::Free
    ));
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "a look writes nothing"
    );
}

/// A live pod's address the store holds as free is recorded for it again, as the plugin recorded
/// it (handle, attributes, node); once held, a re-assertion writes nothing (and succeeds only for
/// the handle that holds it).
pub async fn a_live_pods_free_address_is_recorded_again_and_a_held_one_is_left_alone<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let (address, _) = assign_for(&ipam, "restored", "node-a").await;
    ipam.release_ips(&[ReleaseRequest {
        ip: address,
        sequence: None,
    }])
    .await
    .expect("the store loses it (an older backup)");
    let reassertion = Reassertion {
        address,
        handle: handle_id("net", "restored"),
        host: "node-a".into(),
        attributes: pod_attributes("restored"),
    };
    assert!(ipam.reassert(&reassertion).await.expect("re-assert"));
    let held = ipam
        .get_assignment(address)
        .await
        .expect("read")
        .expect("recorded again");
    assert_eq!(held.handle, "net.restored");
    assert_eq!(
        held.attributes.get("pod").map(String::as_str),
        Some("pod-restored")
    );
    assert_eq!(
        held.attributes.get("node").map(String::as_str),
        Some("node-a")
    );

    let before = t.store.list("").await.expect("list");
    assert!(
        ipam.reassert(&reassertion).await.expect("re-assert again"),
        "held by its own handle already: done"
    );
    let other = Reassertion {
        handle: handle_id("net", "someone-else"),
        ..reassertion
    };
    assert!(!ipam.reassert(&other).await.expect("re-assert for another"));
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "a held address is left alone"
    );
    assert_clean(&ipam).await;
}

/// The disagreements node-a's look found (a duplicate of node-b's address, a free address).
async fn node_a_disagreements(ipam: &Ipam) -> (Vec<Disagreement>, IpAddr, IpAddr) {
    let (own, _) = assign_for(ipam, "own", "node-a").await;
    let (theirs, _) = assign_for(ipam, "theirs", "node-b").await;
    let free: IpAddr = "10.0.0.150".parse().expect("address");
    let decisions = ipam
        .look_for_leaks(
            "node-a",
            &view(T0, &[("own", vec![own, theirs]), ("stray", vec![free])]),
            &mut LeakWatch::new(),
            POLICY,
        )
        .await
        .expect("look");
    assert_eq!(decisions.disagreements.len(), 2, "{decisions:#?}");
    (decisions.disagreements, theirs, free)
}

/// What a node's agent records of its look is what `check` reports, one problem per address
/// (`duplicate-address` naming the holder's handle and node, `unrecorded-live-address`), each
/// naming the node that found it; the same findings are not written again; a look that finds
/// nothing deletes the record and `check` is clean again.
pub async fn a_nodes_live_disagreements_are_problems_for_check_until_its_agent_finds_none<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let (disagreements, theirs, free) = node_a_disagreements(&ipam).await;
    assert_clean(&ipam).await;
    assert!(ipam
        .record_disagreements("node-a", T0, &disagreements)
        .await
        .expect("record"));
    let key = keys::live_disagreements_key("node-a");
    let written = t.store.get(&key).await.expect("read").expect("recorded");

    let report = ipam.check(false).await.expect("check");
    let found: Vec<(&str, Option<&str>, Option<&str>)> = report
        .problems
        .iter()
        .map(|p| (p.kind.as_str(), p.node.as_deref(), p.handle.as_deref()))
        .collect();
    assert_eq!(
        found,
        [
            (kinds::DUPLICATE_ADDRESS, Some("node-a"), Some("net.theirs")),
            (kinds::UNRECORDED_LIVE_ADDRESS, Some("node-a"), None),
        ],
        "{report:#?}"
    );
    let duplicate = &report.problems[0].detail;
    assert!(
        duplicate.contains(&theirs.to_string())
            && duplicate.contains("pod-own")
            && duplicate.contains("node node-b"),
        "{duplicate}"
    );
    assert!(report.problems[1].detail.contains(&free.to_string()));
    assert!(report
        .problems
        .iter()
        .all(|p| !p.repairable && !p.remedy.is_empty()));

    // The next look finds the same: nothing written (the record keeps when it was first found).
    assert!(!ipam
        .record_disagreements("node-a", T0 + 60, &disagreements)
        .await
        .expect("record again"));
    let kept = t.store.get(&key).await.expect("read").expect("recorded");
    assert_eq!(
        kept.revision, written.revision,
        "the same findings rewritten"
    );
    // One of them resolved: rewritten with what is left.
    assert!(ipam
        .record_disagreements("node-a", T0 + 120, &disagreements[..1])
        .await
        .expect("record fewer"));
    let report = ipam.check(false).await.expect("check");
    assert_eq!(report.problems.len(), 1, "{report:#?}");
    assert_eq!(report.problems[0].kind, kinds::DUPLICATE_ADDRESS);
    // A look that finds nothing: the record goes, and check is clean.
    assert!(ipam
        .record_disagreements("node-a", T0 + 180, &[])
        .await
        .expect("record none"));
    assert_eq!(t.store.get(&key).await.expect("read"), None);
    assert!(!ipam
        .record_disagreements("node-a", T0 + 240, &[])
        .await
        .expect("record none again"));
    assert_clean(&ipam).await;
}

/// Bytes at a node's record that do not decode are a `corrupt-object` for `check`, never a
/// panic; the agent's next record replaces them; forgetting the node (`node release`) deletes
/// its record with its registration.
pub async fn a_live_disagreements_record_that_does_not_decode_is_reported_replaced_and_forgotten<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let key = keys::live_disagreements_key("node-a");
    t.store
        .put(&key, b"{not json".to_vec())
        .await
        .expect("garbage");
    let report = ipam.check(false).await.expect("check");
    assert_eq!(report.problems.len(), 1, "{report:#?}");
    assert_eq!(report.problems[0].kind, kinds::CORRUPT_OBJECT);
    assert!(report.problems[0].detail.contains(&key), "{report:#?}");

    let (disagreements, _, _) = node_a_disagreements(&ipam).await;
    assert!(ipam
        .record_disagreements("node-a", T0, &disagreements)
        .await
        .expect("replace"));
    let report = ipam.check(false).await.expect("check");
    assert_eq!(report.problems.len(), 2, "{report:#?}");
    assert!(report
        .problems
        .iter()
        .all(|p| p.kind != kinds::CORRUPT_OBJECT));

    register(t.store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    assert!(forget_node(t.store.as_ref(), "node-a")
        .await
        .expect("forget"));
    assert_eq!(t.store.get(&key).await.expect("read"), None);
}

/// A block the look reads that does not decode, the node's own or another's, is named and the
/// addresses it covers are left out of every decision, while the rest of the look decides as
/// usual: no allocation in it is judged (a countdown does not run across a look that could not see
/// it), no live sandbox's address in it is reported as free or held by another, and nothing is
/// written; whether the look reads the whole store or only the node's blocks.
pub async fn a_block_that_does_not_decode_is_named_and_nothing_it_covers_is_judged<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 30).await;
    let ([live, gone, held, old], second_live, second_gone, theirs) =
        node_a_in_two_blocks(&ipam).await;
    let own_block = block_of(&ipam, live).await;
    for address in [gone, held, old] {
        assert_eq!(block_of(&ipam, address).await, own_block);
    }
    assert_ne!(block_of(&ipam, second_live).await, own_block);
    assert_eq!(
        block_of(&ipam, second_gone).await,
        block_of(&ipam, second_live).await
    );
    // A sandbox of node-a that reports node-b's address: a disagreement while it can be read.
    let runtime = |at| {
        view(
            at,
            &[
                ("live", vec![live]),
                ("held", vec![held]),
                ("second-live", vec![second_live]),
                ("stray", vec![theirs]),
            ],
        )
    };
    let sorted = |mut addresses: Vec<IpAddr>| {
        addresses.sort();
        addresses
    };

    let mut watch = LeakWatch::new();
    let intact = ipam
        .look_for_leaks("node-a", &runtime(T0), &mut watch, POLICY)
        .await
        .expect("look");
    assert!(intact.undecodable.is_empty(), "{intact:#?}");
    assert_eq!(
        waiting_addresses(&intact),
        sorted(vec![gone, old, second_gone])
    );
    assert_eq!(intact.disagreements.len(), 1, "{intact:#?}");
    assert_eq!(intact.disagreements[0].address, theirs);

    let damage = |block: ipnet::IpNet, node: &'static str| {
        let store = std::sync::Arc::clone(&t.store);
        async move {
            // A full block lives under its host's `full/`.
            let mut key = keys::block(Some(node), &block);
            if store.get(&key).await.expect("get").is_none() {
                key = keys::full_block(node, &block);
            }
            let intact = store.get(&key).await.expect("get").expect("block").value;
            let mut damaged = intact.clone();
            damaged.truncate(damaged.len() / 2);
            store.put(&key, damaged).await.expect("damage it");
            (key, intact)
        }
    };

    // Another node's block.
    let (their_key, their_intact) = damage(block_of(&ipam, theirs).await, "node-b").await;
    let before = t.store.list("").await.expect("list");
    let past_theirs = ipam
        .look_for_leaks("node-a", &runtime(T0 + 1), &mut watch, POLICY)
        .await
        .expect("a look gets past another node's damaged block");
    assert!(
        watch.last_look_surveyed(),
        "the stray sandbox's address lies outside node-a's blocks"
    );
    let named: Vec<&str> = past_theirs
        .undecodable
        .iter()
        .map(|o| o.key.as_str())
        .collect();
    assert_eq!(named, [their_key.as_str()]);
    assert!(
        past_theirs.disagreements.is_empty(),
        "who holds an address in a block that cannot be read is unknown: {past_theirs:#?}"
    );
    assert_eq!(
        waiting_addresses(&past_theirs),
        sorted(vec![gone, old, second_gone])
    );

    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "the look wrote nothing"
    );

    // The node's own block too.
    let (own_key, own_intact) = damage(own_block, "node-a").await;
    let before = t.store.list("").await.expect("list");
    let past_both = ipam
        .look_for_leaks("node-a", &runtime(T0 + GRACE + 1), &mut watch, POLICY)
        .await
        .expect("a look gets past the node's own damaged block");
    let mut expected = vec![own_key.clone(), their_key.clone()];
    expected.sort();
    let named: Vec<String> = past_both
        .undecodable
        .iter()
        .map(|o| o.key.clone())
        .collect();
    assert_eq!(named, expected);
    assert_eq!(
        leaked_addresses(&past_both),
        [second_gone],
        "decided past both damaged blocks: {past_both:#?}"
    );
    assert!(
        past_both.waiting.is_empty(),
        "nothing in the damaged block is judged: {past_both:#?}"
    );
    assert_eq!(past_both.live, 1, "{past_both:#?}");
    assert!(
        past_both.disagreements.is_empty(),
        "live addresses in the node's damaged block are not reported free: {past_both:#?}"
    );
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "the look wrote nothing"
    );

    t.store
        .put(&their_key, their_intact)
        .await
        .expect("restore it");
    t.store.put(&own_key, own_intact).await.expect("restore it");
    let restored = ipam
        .look_for_leaks("node-a", &runtime(T0 + GRACE + 2), &mut watch, POLICY)
        .await
        .expect("look after the restore");
    assert!(restored.undecodable.is_empty(), "{restored:#?}");
    assert_eq!(
        waiting_addresses(&restored),
        sorted(vec![gone, old]),
        "their countdown starts again from the look that saw them: {restored:#?}"
    );
    assert_eq!(leaked_addresses(&restored), [second_gone]);
    assert_eq!(restored.disagreements.len(), 1, "{restored:#?}");
    for address in [gone, old, second_gone] {
        assert!(ipam.get_assignment(address).await.expect("read").is_some());
    }

    // The node's own block damaged again, at a look that reads only the node's blocks (every live
    // address lies in an intact block of its own): named all the same, nothing it covers judged.
    let (own_key, _) = damage(own_block, "node-a").await;
    let quiet = |at| view(at, &[("second-live", vec![second_live])]);
    let before = t.store.list("").await.expect("list");
    let own_only = ipam
        .look_for_leaks("node-a", &quiet(T0 + GRACE + 3), &mut watch, POLICY)
        .await
        .expect("a look of the node's blocks gets past its damaged one");
    assert!(
        !watch.last_look_surveyed(),
        "every live address lies in node-a's intact block"
    );
    let named: Vec<&str> = own_only
        .undecodable
        .iter()
        .map(|o| o.key.as_str())
        .collect();
    assert_eq!(named, [own_key.as_str()]);
    assert!(own_only.waiting.is_empty(), "{own_only:#?}");
    assert_eq!(leaked_addresses(&own_only), [second_gone]);
    assert!(own_only.disagreements.is_empty(), "{own_only:#?}");
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "the look wrote nothing"
    );
}

/// An owner key (an address's attributes, kept apart from its block's value) that cannot be
/// decoded, or is gone, stops neither the look (a survey or a look at the node's blocks) nor the
/// listing of every allocation: the key is named and nothing its block covers is judged or listed
/// (whose its addresses are is unknown), while every other block is; the usage figures still
/// count that block (they come from its value); nothing is written.
pub async fn an_owner_key_that_cannot_be_read_is_named_and_nothing_its_block_covers_is_judged<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 30).await;
    let ([live, gone, held, old], second_live, second_gone, theirs) =
        node_a_in_two_blocks(&ipam).await;
    let own_block = block_of(&ipam, live).await;
    let second_block = block_of(&ipam, second_live).await;
    assert_ne!(second_block, own_block);
    // A sandbox of node-a that reports node-b's address: a disagreement, wherever the damage is.
    let runtime = |at| {
        view(
            at,
            &[
                ("live", vec![live]),
                ("second-live", vec![second_live]),
                ("stray", vec![theirs]),
            ],
        )
    };
    let owner_key = first_owner_key(t.store.as_ref(), &own_block).await;
    let intact = damage(t.store.as_ref(), &owner_key).await;

    // The first look, a survey.
    let mut watch = LeakWatch::new();
    let before = t.store.list("").await.expect("list");
    let surveyed = ipam
        .look_for_leaks("node-a", &runtime(T0), &mut watch, POLICY)
        .await
        .expect("a survey gets past the damaged owner key");
    assert!(watch.last_look_surveyed());
    let named: Vec<&str> = surveyed
        .undecodable
        .iter()
        .map(|o| o.key.as_str())
        .collect();
    assert_eq!(named, [owner_key.as_str()]);
    assert_eq!(
        waiting_addresses(&surveyed),
        [second_gone],
        "nothing in the block whose owner key is damaged is judged: {surveyed:#?}"
    );
    assert_eq!(
        surveyed
            .disagreements
            .iter()
            .map(|d| d.address)
            .collect::<Vec<_>>(),
        [theirs],
        "a live address in that block is not reported free, another node's is: {surveyed:#?}"
    );

    // A look at the node's blocks only (every live address lies in its intact block).
    let quiet = |at| view(at, &[("second-live", vec![second_live])]);
    let own_only = ipam
        .look_for_leaks("node-a", &quiet(T0 + GRACE + 1), &mut watch, POLICY)
        .await
        .expect("a look of the node's blocks gets past the damaged owner key");
    assert!(!watch.last_look_surveyed());
    let named: Vec<&str> = own_only
        .undecodable
        .iter()
        .map(|o| o.key.as_str())
        .collect();
    assert_eq!(named, [owner_key.as_str()]);
    assert_eq!(leaked_addresses(&own_only), [second_gone]);
    assert!(own_only.waiting.is_empty(), "{own_only:#?}");
    assert!(own_only.disagreements.is_empty(), "{own_only:#?}");

    // Every allocation, and usage with allocations (what `show --borrowed`, GC and the node
    // inventory read).
    let (listed, undecodable) = ipam
        .list_allocations_each()
        .await
        .expect("every allocation past the damaged owner key");
    let named: Vec<&str> = undecodable.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(named, [owner_key.as_str()]);
    assert_eq!(
        listed.iter().map(|a| a.ip).collect::<Vec<_>>(),
        {
            let mut rest = vec![second_live, second_gone, theirs];
            rest.sort();
            rest
        },
        "the damaged owner key's block left out, the other listed"
    );
    let (usage, allocations) = ipam
        .utilization_and_allocations()
        .await
        .expect("usage and allocations past the damaged owner key");
    let named: Vec<&str> = usage.undecodable.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(named, [owner_key.as_str()]);
    assert_eq!(allocations, listed);
    let counted = usage
        .pools
        .iter()
        .flat_map(|p| p.blocks.iter())
        .find(|b| b.cidr == own_block)
        .expect("the block still counts in the figures");
    assert_eq!(counted.in_use, 4, "{counted:#?}");
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "nothing written"
    );

    // Gone altogether: named as missing.
    t.store.delete(&owner_key).await.expect("delete it");
    let (_, undecodable) = ipam
        .list_allocations_each()
        .await
        .expect("every allocation past a missing owner key");
    assert_eq!(undecodable.len(), 1, "{undecodable:#?}");
    assert_eq!(undecodable[0].key, owner_key);
    assert!(
        undecodable[0].message.contains("missing"),
        "{undecodable:#?}"
    );

    // Restored: the block's allocations are judged again, their countdown from this look.
    t.store.put(&owner_key, intact).await.expect("restore it");
    let restored = ipam
        .look_for_leaks("node-a", &runtime(T0 + GRACE + 2), &mut watch, POLICY)
        .await
        .expect("look after the restore");
    assert!(restored.undecodable.is_empty(), "{restored:#?}");
    let mut waiting = vec![gone, held, old];
    waiting.sort();
    assert_eq!(waiting_addresses(&restored), waiting, "{restored:#?}");
    assert_eq!(leaked_addresses(&restored), [second_gone]);
}

/// A pool of one /30 block that node-b claims first: node-a's address comes from node-b's block.
async fn borrowed_for_node_a<F: StoreFactory>(
    factory: &F,
) -> (crate::TestStore, Ipam, IpAddr, IpAddr) {
    let (t, ipam) = ipam_with_pool(factory, "10.9.0.0/30", 30).await;
    let (theirs, _) = assign_for(&ipam, "theirs", "node-b").await;
    let (borrowed, _) = assign_for(&ipam, "gone", "node-a").await;
    let info = ipam
        .get_assignment(borrowed)
        .await
        .expect("read")
        .expect("assigned");
    assert_eq!(
        info.block_host.as_deref(),
        Some("node-b"),
        "node-a borrowed"
    );
    (t, ipam, borrowed, theirs)
}

/// A live pod "live" on node-a (its runtime's view at any moment), and a watch that has made the
/// agent's first look (a survey) at `T0`.
async fn live_pod_on_node_a(ipam: &Ipam) -> (impl Fn(u64) -> RuntimeView, LeakWatch) {
    let (live, _) = assign_for(ipam, "live", "node-a").await;
    let runtime = move |at| view(at, &[("live", vec![live])]);
    let mut watch = LeakWatch::new();
    ipam.look_for_leaks("node-a", &runtime(T0), &mut watch, POLICY)
        .await
        .expect("the first look");
    (runtime, watch)
}

/// The looks in a row after the first (a survey) that read only the node's blocks.
async fn bounded_looks(
    ipam: &Ipam,
    watch: &mut LeakWatch,
    runtime: &dyn Fn(u64) -> RuntimeView,
    at: &[u64],
) -> Vec<LeakDecisions> {
    let mut all = Vec::new();
    for at in at {
        let decisions = ipam
            .look_for_leaks("node-a", &runtime(*at), watch, POLICY)
            .await
            .expect("look");
        assert!(
            !watch.last_look_surveyed(),
            "the look at {at} read the whole store"
        );
        all.push(decisions);
    }
    all
}

/// An address node-a borrowed from node-b's block is put in node-a's borrowed-block index by the
/// assigning transaction; looks that read only node-a's blocks and that index find it missing and
/// release it after the grace; the next look deletes the entry that names nothing of node-a's.
pub async fn a_borrowed_address_is_indexed_and_collected_by_the_nodes_own_looks<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam, borrowed, theirs) = borrowed_for_node_a(factory).await;
    let block = block_of(&ipam, borrowed).await;
    let entry = keys::borrowed_key("node-a", &block);
    assert!(
        t.store.get(&entry).await.expect("get").is_some(),
        "the borrowing transaction indexed the block"
    );
    // A live pod in node-a's own block proves the runtime.
    ipam.create_pool(&crate::ipam::spec("10.9.1.0/26", "own", 26))
        .await
        .expect("a second pool");
    let (runtime, mut watch) = live_pod_on_node_a(&ipam).await;
    let looks = bounded_looks(&ipam, &mut watch, &runtime, &[T0 + 60, T0 + GRACE + 1]).await;
    assert_eq!(looks[0].waiting.len(), 1, "{:#?}", looks[0]);
    assert_eq!(looks[0].waiting[0].allocation.ip, borrowed);
    assert_eq!(looks[1].leaked.len(), 1, "{:#?}", looks[1]);
    let outcome = ipam
        .release_leaked(&looks[1].leaked)
        .await
        .expect("release");
    assert_eq!(outcome.released, [borrowed]);
    assert!(ipam.get_assignment(theirs).await.expect("read").is_some());
    bounded_looks(&ipam, &mut watch, &runtime, &[T0 + GRACE + 60]).await;
    assert!(
        t.store.get(&entry).await.expect("get").is_none(),
        "the entry of a block that holds nothing of node-a is deleted"
    );
    assert_clean(&ipam).await;
}

/// A borrowed address written without its index entry (by a writer that keeps none, such as the
/// previous release's plugin) is not judged by looks that read only the node's blocks; the next
/// survey of the store puts the entry, and from then on every look judges it.
pub async fn a_borrowed_address_without_an_index_entry_is_indexed_by_the_next_survey<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam, borrowed, _) = borrowed_for_node_a(factory).await;
    ipam.create_pool(&crate::ipam::spec("10.9.1.0/26", "own", 26))
        .await
        .expect("a second pool");
    let (runtime, mut watch) = live_pod_on_node_a(&ipam).await;
    let block = block_of(&ipam, borrowed).await;
    let entry = keys::borrowed_key("node-a", &block);
    t.store
        .delete(&entry)
        .await
        .expect("as an older writer left it");
    let unseen = bounded_looks(&ipam, &mut watch, &runtime, &[T0 + 60]).await;
    assert!(unseen[0].waiting.is_empty(), "{:#?}", unseen[0]);

    let mut at = T0 + 120;
    let mut looks = 0;
    while !watch.survey_due() {
        assert!(
            looks < SURVEY_EVERY_LOOKS,
            "no survey came due in {looks} looks after the last one"
        );
        bounded_looks(&ipam, &mut watch, &runtime, &[at]).await;
        at += 60;
        looks += 1;
    }
    let survey = ipam
        .look_for_leaks("node-a", &runtime(at), &mut watch, POLICY)
        .await
        .expect("the survey");
    assert!(watch.last_look_surveyed());
    assert_eq!(survey.waiting.len(), 1, "{survey:#?}");
    assert!(
        t.store.get(&entry).await.expect("get").is_some(),
        "the survey put the missing entry"
    );
    let after = bounded_looks(&ipam, &mut watch, &runtime, &[at + 60]).await;
    assert_eq!(after[0].waiting.len(), 1, "{:#?}", after[0]);
    assert_eq!(after[0].waiting[0].allocation.ip, borrowed);
    assert_eq!(
        after[0].waiting[0].missing_since, at,
        "its countdown went on"
    );
}

/// A live pod of node-a using an address of node-b's block (a duplicate): a look that would read
/// only node-a's blocks cannot tell who holds it, so it reads the whole store and reports it.
pub async fn a_live_address_outside_the_nodes_blocks_makes_the_look_a_survey<F: StoreFactory>(
    factory: &F,
) {
    let (_t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let (live, _) = assign_for(&ipam, "live", "node-a").await;
    let (theirs, _) = assign_for(&ipam, "theirs", "node-b").await;
    let mut watch = LeakWatch::new();
    let only_live = |at| view(at, &[("live", vec![live])]);
    ipam.look_for_leaks("node-a", &only_live(T0), &mut watch, POLICY)
        .await
        .expect("the first look");
    bounded_looks(&ipam, &mut watch, &only_live, &[T0 + 60]).await;
    let with_duplicate = view(T0 + 120, &[("live", vec![live]), ("copy", vec![theirs])]);
    let decisions = ipam
        .look_for_leaks("node-a", &with_duplicate, &mut watch, POLICY)
        .await
        .expect("look");
    assert!(watch.last_look_surveyed());
    assert_eq!(decisions.disagreements.len(), 1, "{decisions:#?}");
    assert_eq!(decisions.disagreements[0].address, theirs);
    assert!(matches!(
        decisions.disagreements[0].holder,
        AddressHolder::Other(ref held) if held.handle == "net.theirs"
    ));
}

/// `node release --addresses` and `node retire --apply` forget a node: its borrowed-block index
/// goes too (with or without a registration), but not while its agent keeps it live.
pub async fn a_forgotten_nodes_borrowed_index_goes_but_a_live_nodes_stays<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam, borrowed, _) = borrowed_for_node_a(factory).await;
    let block = block_of(&ipam, borrowed).await;
    let entry = keys::borrowed_key("node-a", &block);
    register(t.store.as_ref(), "node-a", "test", T0)
        .await
        .expect("register");
    let liveness = ipam_core::dead_nodes::liveness_key("node-a");
    t.store
        .put(&liveness, b"node-a".to_vec())
        .await
        .expect("the agent is live");
    assert!(!forget_node(t.store.as_ref(), "node-a")
        .await
        .expect("forget a live node"));
    assert!(
        t.store.get(&entry).await.expect("get").is_some(),
        "a live node keeps its index"
    );
    t.store.delete(&liveness).await.expect("the agent stops");
    assert!(forget_node(t.store.as_ref(), "node-a")
        .await
        .expect("forget"));
    assert_eq!(t.store.get(&entry).await.expect("get"), None);

    // A node that never had an agent: its index goes all the same.
    let (other, _) = assign_for(&ipam, "more", "node-c").await;
    let other_block = block_of(&ipam, other).await;
    let other_entry = keys::borrowed_key("node-c", &other_block);
    assert!(t.store.get(&other_entry).await.expect("get").is_some());
    assert!(!forget_node(t.store.as_ref(), "node-c")
        .await
        .expect("forget a node without registration"));
    assert_eq!(t.store.get(&other_entry).await.expect("get"), None);
}

/// A block whose affinity is released while it holds addresses (an operator's `blocks
/// release-affinity`, a node retired without releasing its addresses) is put in the index of every
/// node it holds addresses of, in the same transaction: the node's steady looks keep judging them.
pub async fn a_block_that_loses_its_affinity_is_indexed_for_the_nodes_it_holds_addresses_of<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let (runtime, mut watch) = live_pod_on_node_a(&ipam).await;
    let (gone, _) = assign_for(&ipam, "gone", "node-a").await;
    let block = block_of(&ipam, gone).await;
    let entry = keys::borrowed_key("node-a", &block);
    assert_eq!(t.store.get(&entry).await.expect("get"), None);
    ipam.release_affinity("node-a", block)
        .await
        .expect("release the affinity");
    let info = ipam
        .get_assignment(gone)
        .await
        .expect("read")
        .expect("still assigned");
    assert_eq!(info.block_host, None, "the block has no owner now");
    assert!(
        t.store.get(&entry).await.expect("get").is_some(),
        "the transaction that released the affinity indexed the block for node-a"
    );
    let looks = bounded_looks(&ipam, &mut watch, &runtime, &[T0 + 60, T0 + 61 + GRACE]).await;
    assert_eq!(looks[0].live, 1, "{:#?}", looks[0]);
    assert_eq!(looks[0].waiting.len(), 1, "{:#?}", looks[0]);
    assert_eq!(looks[1].leaked.len(), 1, "{:#?}", looks[1]);
    assert_eq!(looks[1].leaked[0].allocation.ip, gone);
}

/// A key under a node's borrowed-block index that names no block (written by hand, or damaged):
/// the node's look and the allocation counts fail naming it, and nothing is written.
pub async fn an_index_key_that_names_no_block_stops_the_look_and_the_counts_naming_it<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let (runtime, mut watch) = live_pod_on_node_a(&ipam).await;
    let bad = format!("{}not-a-block", keys::host_borrowed_dir("node-a"));
    t.store
        .put(&bad, b"{}".to_vec())
        .await
        .expect("a damaged entry");
    let before = t.store.list("").await.expect("list");
    match ipam
        .look_for_leaks("node-a", &runtime(T0 + 60), &mut watch, POLICY)
        .await
    {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, bad),
        other => panic!("expected a corruption error naming {bad}, got {other:?}"),
    }
    match ipam.allocation_counts().await {
        Err(IpamError::Corrupt { key, .. }) => assert_eq!(key, bad),
        other => panic!("expected a corruption error naming {bad}, got {other:?}"),
    }
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "nothing written"
    );
}
