//! The mapper and the writer without etcd: Calico objects built from Calico's JSON shapes are
//! parsed, mapped, written into an in-memory store and verified; then the allocator works on them
//! as Calico would have (free-list order, release by handle across two blocks); refusals write
//! nothing; an interrupted import is detected and resumed.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use blockipam_import::writer::{self, planned_units};
use blockipam_import::{
    inspect_target, map, marker_key, plan_import, CalicoSnapshot, ImportError, ImportPlan,
    TargetState,
};
use ipam_core::model::CoolingAddress;
use ipam_core::model::{decode, keys, Block, ROOT};
use ipam_core::{
    AutoAssignRequest, Clock, Ipam, KeyValue, KvError, KvStore, MemoryStore, Op, Revision, Txn,
};
use serde_json::{json, Value};
use test_kit::block_on;
use test_kit::calico::{sample_cluster, CalicoBlockBuilder, CalicoFixture, SAMPLE_NETWORK};

fn snapshot(fixture: &CalicoFixture) -> CalicoSnapshot {
    CalicoSnapshot::parse(42, fixture.entries())
}

/// 2025-01-01T00:00:00Z, 2026-01-01T00:00:00Z, 2126-01-01T00:00:00Z and 2026-06-01T00:00:00Z in
/// seconds since the Unix epoch.
const JAN_2025: u64 = 1_735_689_600;
const JAN_2026: u64 = 1_767_225_600;
const JAN_2126: u64 = 4_922_899_200;
const JUNE_2026: u64 = 1_780_272_000;

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an address")
}

fn block_of(plan: &ImportPlan, cidr: &str) -> Block {
    let cidr: ipnet::IpNet = cidr.parse().expect("cidr");
    plan.blocks
        .iter()
        .find(|b| b.cidr == cidr)
        .cloned()
        .unwrap_or_else(|| panic!("block {cidr} in the plan"))
}

/// A fresh in-memory store holding `plan`, written and verified.
async fn written_to_memory(plan: &ImportPlan) -> Arc<dyn KvStore> {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let state = inspect_target(&store).await.expect("inspect");
    writer::write(&store, plan, &state, "test source")
        .await
        .expect("write and verify");
    store
}

#[test]
fn calico_blocks_keep_free_list_order_sequences_affinity_and_attributes() {
    let plan = plan_import(&snapshot(&sample_cluster())).expect("the sample maps");
    assert_eq!(plan.calico_revision, 42);
    assert_eq!(plan.pools.len(), 2);
    assert_eq!(plan.blocks.len(), 3);
    let a = block_of(&plan, "10.244.0.0/26");
    assert!(a.self_check().is_empty(), "{:?}", a.self_check());
    assert_eq!(a.affinity.as_deref(), Some("node-a"));
    assert_eq!(
        a.next_fresh, 64,
        "every free ordinal is in the released queue"
    );
    let mut order: Vec<u32> = (7..64).collect();
    order.push(3);
    assert_eq!(a.released.iter().copied().collect::<Vec<_>>(), order);
    // Calico's cooling addresses (allocated to an attribute with only `releasedAt`, off the free
    // list) stay cooling with their release time, oldest release first.
    assert_eq!(
        a.cooling.iter().copied().collect::<Vec<_>>(),
        [
            CoolingAddress {
                ordinal: 6,
                released_at: JAN_2025
            },
            CoolingAddress {
                ordinal: 5,
                released_at: JAN_2126
            },
        ]
    );
    assert!(
        a.attributes
            .iter()
            .all(|attr| !attr.handle.ends_with(".c5")),
        "a cooling address keeps no owner"
    );
    assert_eq!(plan.config.ip_cooldown_seconds, 30);
    let b = block_of(&plan, "10.244.0.64/26");
    assert_eq!(b.claimed_at, Some(JAN_2026), "from affinity_claim_time");
    assert_eq!(b.emptied_at, None, "it holds an allocation");
    assert_eq!(a.claimed_at, None, "Calico stored no claim time");
    assert_eq!(a.sequence, 1004);
    let sequences: BTreeMap<u32, u64> = a
        .allocations
        .iter()
        .map(|(o, al)| (*o, al.sequence))
        .collect();
    assert_eq!(
        sequences,
        BTreeMap::from([(0, 1000), (1, 1001), (2, 1002), (4, 1003)])
    );
    let borrowed = a
        .attribute_of(4)
        .expect("inline")
        .expect("ordinal 4 allocated");
    assert_eq!(borrowed.handle, format!("{SAMPLE_NETWORK}.b9"));
    assert_eq!(
        borrowed.metadata.get("node").map(String::as_str),
        Some("node-b")
    );
    assert_eq!(
        plan.sequence_floor, 2001,
        "above the largest imported sequence (block B's 2000)"
    );

    let c1 = plan
        .handles
        .get(&format!("{SAMPLE_NETWORK}.c1"))
        .expect("c1's handle");
    assert_eq!(c1.blocks.len(), 2, "the handle spans two blocks");
    assert!(!plan.handles.contains_key(&format!("{SAMPLE_NETWORK}.gone")));
    assert_eq!(
        plan.config.max_blocks_per_host, 20,
        "Calico's unset maxBlocksPerHost is 20"
    );
    assert!(plan.config.auto_allocate_blocks);
}

#[test]
fn what_blockipam_lacks_is_reported_with_its_value_never_guessed() {
    let plan = plan_import(&snapshot(&sample_cluster())).expect("the sample maps");
    let find = |object: &str, field: &str| {
        plan.not_mapped
            .iter()
            .find(|n| n.object.contains(object) && n.field == field)
            .unwrap_or_else(|| panic!("{object} {field} reported in {:#?}", plan.not_mapped))
            .clone()
    };
    assert_eq!(
        find("ippool default-ipv4-ippool", "spec.ipipMode").value,
        "\"Always\""
    );
    assert_eq!(
        find("ippool default-ipv4-ippool", "spec.natOutgoing").value,
        "true"
    );
    assert!(
        !plan
            .not_mapped
            .iter()
            .any(|n| n.field == "spec.nodeSelector" || n.field == "spec.vxlanMode"),
        "Calico defaults lose nothing and are not reported: {:#?}",
        plan.not_mapped
    );
    assert_eq!(
        find("affinity node-c 10.244.0.128/26", "state").value,
        "\"pending\""
    );
    assert!(
        !plan
            .not_mapped
            .iter()
            .any(|n| n.object.contains("ipreservation")),
        "IP reservations are mapped now: {:#?}",
        plan.not_mapped
    );
    for mapped in ["ipCooldownSeconds", "affinity_claim_time", "releasedAt"] {
        assert!(
            !plan.not_mapped.iter().any(|n| n.field == mapped),
            "{mapped} is mapped now: {:#?}",
            plan.not_mapped
        );
    }
    assert!(find("allocations", "secondary.owner.example.com/team")
        .note
        .contains("kept"));
    assert!(find("handle k8s-pod-network.gone", "block")
        .note
        .contains("leak"));
    // The unknown key is carried as metadata, not dropped.
    let b = block_of(&plan, "10.244.0.64/26");
    assert_eq!(
        b.attribute_of(0)
            .expect("inline")
            .and_then(|a| a.metadata.get("owner.example.com/team"))
            .map(String::as_str),
        Some("blue")
    );
}

#[test]
fn unconfirmed_affinity_imports_the_block_without_a_host() {
    let block = CalicoBlockBuilder::new("10.9.0.0/26", Some("node-p"), 1).allocate(
        7,
        "net.x",
        &[("node", "node-p")],
        1,
    );
    let fixture = CalicoFixture::new()
        .pool("p", "10.9.0.0/24", 26, json!({}))
        .block(&block)
        .affinity("node-p", "10.9.0.0/26", "pendingDeletion");
    let plan = plan_import(&snapshot(&fixture)).expect("maps");
    let mapped = block_of(&plan, "10.9.0.0/26");
    assert_eq!(mapped.affinity, None);
    assert!(
        mapped.attribute_of(7).expect("inline").is_some(),
        "its allocation is kept"
    );
}

#[test]
fn cooldown_settings_and_cooling_only_blocks_map_as_calico_reads_them() {
    // A block of node-q whose only addresses are cooling (one released with its owner still on
    // the attribute), claimed at 2026-01-01; an unaffine block whose only address is cooling.
    let owned = CalicoBlockBuilder::new("10.4.0.0/26", Some("node-q"), 7)
        .allocate(2, "net.q2", &[("node", "node-q")], 3)
        .allocate(1, "net.q1", &[("node", "node-q")], 4)
        .release_into_cooldown(2, "2026-01-01T00:01:40Z")
        .release_into_cooldown(1, "2026-01-01T00:00:50.5+00:00")
        .field("affinity_claim_time", json!("2026-01-01T00:00:00Z"));
    let mut owned_json = owned.to_json();
    owned_json["attributes"][1]["handle_id"] = json!("net.q1");
    let unaffine = CalicoBlockBuilder::new("10.4.0.64/26", None, 9)
        .allocate(0, "net.u", &[], 9)
        .release_into_cooldown(0, "2026-01-01T00:00:00Z");
    let cooling_fixture = |cooldown: Value| {
        CalicoFixture::new()
            .pool("p", "10.4.0.0/24", 26, json!({}))
            .config(json!({"ipCooldownSeconds": cooldown}))
            .raw(
                "/ipam/v2/assignment/ipv4/block/10.4.0.0-26",
                &owned_json.to_string(),
            )
            .affinity("node-q", "10.4.0.0/26", "confirmed")
            .block(&unaffine)
    };
    let plan = plan_import(&snapshot(&cooling_fixture(json!(1200)))).expect("maps");
    assert_eq!(plan.config.ip_cooldown_seconds, 1200);
    let q = block_of(&plan, "10.4.0.0/26");
    assert_eq!(
        q.cooling.iter().copied().collect::<Vec<_>>(),
        [
            CoolingAddress {
                ordinal: 1,
                released_at: JAN_2026 + 51
            },
            CoolingAddress {
                ordinal: 2,
                released_at: JAN_2026 + 100
            },
        ],
        "oldest release first; a fraction of a second rounds up"
    );
    assert!(q.allocations.is_empty() && q.attributes.is_empty());
    assert_eq!(q.claimed_at, Some(JAN_2026));
    assert_eq!(
        q.emptied_at,
        Some(JAN_2026 + 100),
        "not before its newest cooling release"
    );
    assert_eq!(
        q.empty_from(1200),
        Some(JAN_2026 + 100 + 1200 + 1),
        "empty once its newest cooling address has cooled: a whole second after the cooldown"
    );
    let u = block_of(&plan, "10.4.0.64/26");
    assert_eq!(
        (u.affinity.as_deref(), u.cooling.len()),
        (None, 1),
        "kept: not empty"
    );
    let owner = plan
        .not_mapped
        .iter()
        .find(|n| n.object == "cooling addresses (1)" && n.field == "handle_id")
        .unwrap_or_else(|| panic!("the released owner reported in {:#?}", plan.not_mapped));
    assert_eq!(owner.value, "\"net.q1\"");
    assert!(
        !plan.handles.contains_key("net.q1") && plan.expected.is_empty(),
        "a cooling address is held by nobody"
    );

    // Over Calico's API limit: clamped and reported; negative: no cooldown, reported.
    for (stored, imported) in [(json!(5000), 1200), (json!(-5), 0)] {
        let plan = plan_import(&snapshot(&cooling_fixture(stored.clone()))).expect("maps");
        assert_eq!(plan.config.ip_cooldown_seconds, imported, "{stored}");
        let note = plan
            .not_mapped
            .iter()
            .find(|n| n.field == "ipCooldownSeconds")
            .unwrap_or_else(|| panic!("{stored} reported in {:#?}", plan.not_mapped));
        assert_eq!(note.value, stored.to_string());
    }
    // A value Go cannot read into an int makes the config unreadable, as for Calico.
    let mapping = map(&snapshot(&cooling_fixture(json!("30"))));
    assert!(
        mapping
            .refusals
            .iter()
            .any(|r| r.contains("/ipam/v2/config")),
        "{:?}",
        mapping.refusals
    );

    // A release time Calico could not parse refuses, naming the address.
    let broken = CalicoBlockBuilder::new("10.4.0.128/26", Some("node-q"), 1)
        .allocate(3, "net.b", &[], 1)
        .release_into_cooldown(3, "yesterday");
    let fixture =
        cooling_fixture(json!(30))
            .block(&broken)
            .affinity("node-q", "10.4.0.128/26", "confirmed");
    let mapping = map(&snapshot(&fixture));
    assert!(
        mapping
            .refusals
            .iter()
            .any(|r| r.contains("10.4.0.131") && r.contains("releasedAt")),
        "{:?}",
        mapping.refusals
    );

    // Written and verified: the cooling addresses and the times survive the store.
    block_on(async {
        let store = written_to_memory(&plan).await;
        let stored: Vec<Block> = store
            .list(&keys::blocks_dir())
            .await
            .expect("list")
            .iter()
            .map(|kv| decode(&kv.key, &kv.value).expect("decode"))
            .collect();
        assert_eq!(stored.len(), 2);
        assert!(stored.contains(&q) && stored.contains(&u), "{stored:#?}");
    });
}

#[test]
fn unsupported_block_size_refuses_the_whole_import() {
    let fixture = CalicoFixture::new()
        .pool("big-blocks", "10.8.0.0/16", 20, json!({}))
        .pool("fine", "10.7.0.0/24", 26, json!({}));
    let mapping = map(&snapshot(&fixture));
    assert_eq!(mapping.refusals.len(), 1, "{:?}", mapping.refusals);
    assert!(mapping.refusals[0].contains("big-blocks") && mapping.refusals[0].contains("/20"));
    match plan_import(&snapshot(&fixture)) {
        Err(ImportError::Unmappable(reasons)) => assert_eq!(reasons, mapping.refusals),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn allocation_without_a_handle_refuses() {
    let fixture = CalicoFixture::new()
        .pool("p", "10.6.0.0/24", 26, json!({}))
        .raw(
            "/ipam/v2/assignment/ipv4/block/10.6.0.0-26",
            &json!({"cidr": "10.6.0.0/26", "affinity": "host:n",
                "allocations": std::iter::once(Some(0))
                    .chain(std::iter::repeat_n(None, 63))
                    .collect::<Vec<Option<u32>>>(),
                "unallocated": (1..64).collect::<Vec<_>>(),
                "attributes": [{"handle_id": null, "secondary": null}],
                "sequenceNumber": 1, "deleted": false})
            .to_string(),
        )
        .affinity("n", "10.6.0.0/26", "confirmed");
    let mapping = map(&snapshot(&fixture));
    assert!(
        mapping
            .refusals
            .iter()
            .any(|r| r.contains("10.6.0.0") && r.contains("handle_id")),
        "{:?}",
        mapping.refusals
    );
}

#[test]
fn calico_ip_reservations_become_stored_reservations_counted_as_reserved() {
    let fixture = sample_cluster().reservation(
        "odd",
        &[
            "10.244.0.129/30",
            "not-an-address",
            "10.244.0.64",
            "10.244.0.64/32",
        ],
    );
    let plan = plan_import(&snapshot(&fixture)).expect("maps");
    let cidrs = |name: &str| -> Vec<String> {
        plan.reservations
            .iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("reservation {name} in {:#?}", plan.reservations))
            .cidrs
            .iter()
            .map(|c| c.to_string())
            .collect()
    };
    assert_eq!(
        cidrs("reserved-edge"),
        vec!["10.244.0.200/30", "fd00:10:244::ff/128"]
    );
    // Host bits cleared (as Calico's filter does), the repeat dropped, the junk left out.
    assert_eq!(cidrs("odd"), vec!["10.244.0.128/30", "10.244.0.64/32"]);
    let notes: Vec<&str> = plan
        .not_mapped
        .iter()
        .filter(|n| n.object == "ipreservation odd")
        .map(|n| n.note.as_str())
        .collect();
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(
        notes.iter().any(|n| n.contains("10.244.0.128/30")),
        "{notes:?}"
    );
    assert!(notes.iter().any(|n| n.contains("neither")), "{notes:?}");

    block_on(async {
        let store = written_to_memory(&plan).await;
        let ipam = Ipam::new(store.clone());
        let stored = ipam.list_reservations().await.expect("list");
        assert_eq!(stored, plan.reservations);
        let usage = ipam.utilization().await.expect("usage");
        let v4 = usage
            .pools
            .iter()
            .find(|p| p.pool.cidr.contains(&ip("10.244.0.200")))
            .expect("the IPv4 pool");
        assert_eq!(v4.reserved, 4 + 4 + 1);
    });
}

#[test]
fn imported_store_verifies_and_the_allocator_continues_as_calico_would() {
    block_on(async {
        let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
        let plan = plan_import(&snapshot(&sample_cluster())).expect("maps");
        let state = inspect_target(&store).await.expect("inspect");
        assert_eq!(state, TargetState::Empty);
        let outcome = writer::write(&store, &plan, &state, "test source")
            .await
            .expect("write and verify");
        assert!(outcome.transactions >= 3);
        assert!(
            store.get(&marker_key()).await.expect("get").is_none(),
            "marker removed"
        );
        // The marker's removal raised the pool generation (written as the count of pools), in
        // the import's last transaction: an ADD that read the store before it tests it.
        let generation = store
            .get(&keys::pool_generation())
            .await
            .expect("get")
            .expect("a pool generation");
        let count: u64 = decode(&generation.key, &generation.value).expect("a count");
        assert_eq!(count, plan.pools.len() as u64 + 1);
        let newest = store
            .list(ROOT)
            .await
            .expect("list")
            .iter()
            .map(|kv| kv.revision)
            .max();
        assert_eq!(Some(generation.revision), newest, "raised last");

        // Time stands still at 2026-06-01: .6's cooldown (released 2025) is over, .5's (released
        // 2126) is not, and c1's release below starts a cooldown that never ends.
        let ipam = Ipam::new(store.clone()).with_clock(Clock::from_fn(|| JUNE_2026));
        let usage = ipam.utilization().await.expect("usage");
        let a = usage
            .pools
            .iter()
            .flat_map(|p| p.blocks.iter())
            .find(|b| b.cidr.to_string() == "10.244.0.0/26")
            .expect("block A");
        assert_eq!((a.in_use, a.cooling), (4, 1), "{a:?}");
        // A DEL of c1 releases both of its addresses, in two blocks.
        let mut released = ipam
            .release_handle(&format!("{SAMPLE_NETWORK}.c1"))
            .await
            .expect("release");
        released.sort();
        assert_eq!(released, vec![ip("10.244.0.1"), ip("fd00:10:244::")]);
        // node-a's next addresses come from its own block in Calico's free-list order: .7 to
        // .63, then the released .3, then .6 (cooled, queued behind it); never the cooling .5 or
        // the just-released .1 (cooling under the imported 30 s cooldown), never an imported one.
        let block_a: ipnet::IpNet = "10.244.0.0/26".parse().expect("cidr");
        let mut handed_out = Vec::new();
        for n in 0.. {
            let result = ipam
                .auto_assign(&AutoAssignRequest {
                    handle: format!("net.new-{n}"),
                    host: "node-a".into(),
                    num_v4: 1,
                    ..AutoAssignRequest::default()
                })
                .await
                .expect("assign");
            if result.v4[0].block != block_a {
                break;
            }
            handed_out.push(result.v4[0].ip);
            assert!(n < 64, "more addresses than the block holds");
        }
        let mut expected: Vec<IpAddr> = (7..64).map(|o| ip(&format!("10.244.0.{o}"))).collect();
        expected.extend([ip("10.244.0.3"), ip("10.244.0.6")]);
        assert_eq!(handed_out, expected);
        // A block claimed after the import starts above every imported sequence number.
        let result = ipam
            .auto_assign(&AutoAssignRequest {
                handle: "net.other".into(),
                host: "node-z".into(),
                num_v4: 1,
                ..AutoAssignRequest::default()
            })
            .await
            .expect("assign on a new node");
        let fresh = result.v4[0].block;
        let blocks = store.list(&keys::blocks_dir()).await.expect("list");
        let new_block: Block = blocks
            .iter()
            .map(|kv| decode::<Block>(&kv.key, &kv.value).expect("decode"))
            .find(|b| b.cidr == fresh)
            .expect("the new block");
        assert!(new_block.sequence >= plan.sequence_floor, "{new_block:?}");
        assert!(ipam.check(false).await.expect("check").problems.is_empty());
    });
}

#[test]
fn non_empty_target_is_refused_and_left_alone() {
    block_on(async {
        let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
        store
            .put(&keys::config(), vec![1, 2, 3])
            .await
            .expect("seed");
        match inspect_target(&store).await {
            Err(ImportError::TargetNotEmpty(message)) => assert!(message.contains("not empty")),
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert_eq!(store.list(ROOT).await.expect("list").len(), 1);
    });
}

/// A store whose commits fail once `budget` of them succeeded (a crash half-way).
#[derive(Debug)]
struct FailingAfter {
    inner: MemoryStore,
    budget: AtomicUsize,
}

#[async_trait]
impl KvStore for FailingAfter {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        if self
            .budget
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_err()
        {
            return Err(KvError::unavailable("injected: the store went away"));
        }
        self.inner.commit(txn).await
    }
}

#[test]
fn interrupted_import_is_detected_and_resumed_from_the_same_plan() {
    block_on(async {
        let failing = Arc::new(FailingAfter {
            inner: MemoryStore::new(),
            budget: AtomicUsize::new(2),
        });
        let store: Arc<dyn KvStore> = failing.clone();
        // Many small blocks so the plan needs several transactions.
        let mut fixture = CalicoFixture::new().pool("p", "10.5.0.0/16", 32, json!({}));
        for i in 0..300u32 {
            let cidr = format!("10.5.{}.{}/32", i / 256, i % 256);
            let host = format!("node-{}", i % 7);
            let block = CalicoBlockBuilder::new(&cidr, Some(&host), u64::from(i)).allocate(
                0,
                &format!("net.c{i}"),
                &[("node", host.as_str())],
                u64::from(i) + 1,
            );
            fixture = fixture.block(&block).affinity(&host, &cidr, "confirmed");
        }
        let plan = plan_import(&snapshot(&fixture)).expect("maps");
        let units = planned_units(&plan).expect("units");
        assert!(writer::transactions(&units).expect("fits").len() > 2);

        let state = inspect_target(&store).await.expect("inspect");
        let first = writer::write(&store, &plan, &state, "src").await;
        assert!(matches!(first, Err(ImportError::Target(_))), "{first:?}");
        assert!(
            store.get(&marker_key()).await.expect("get").is_some(),
            "marker left behind"
        );
        // check-like readers see a non-empty store; the next run sees the interrupted import.
        let state = inspect_target(&store).await.expect("inspect again");
        let TargetState::Interrupted(marker) = &state else {
            panic!("expected an interrupted import, got {state:?}");
        };
        assert_eq!(marker.calico_revision, 42);
        assert_eq!(marker.source, "src");

        failing.budget.store(usize::MAX, Ordering::SeqCst);
        let outcome = writer::write(&store, &plan, &state, "src")
            .await
            .expect("resume");
        assert!(
            outcome.keys_already_present > 0 && outcome.keys_written > 0,
            "{outcome:?}"
        );
        assert!(store.get(&marker_key()).await.expect("get").is_none());
        assert_eq!(
            inspect_target(&store).await.ok(),
            None,
            "a finished import is not empty"
        );
    });
}

/// A Calico block of a Windows node as Calico's `newBlock` makes it: the first three and the last
/// ordinal allocated to `windows-reserved-ipam-handle` with only a `note`, plus `pods` pods.
fn windows_block(cidr: &str, host: Option<&str>, pods: &[(usize, &str)]) -> CalicoBlockBuilder {
    let mut block = CalicoBlockBuilder::new(cidr, host, 1);
    for ordinal in [0, 1, 2, 63] {
        block = block.allocate(
            ordinal,
            "windows-reserved-ipam-handle",
            &[("note", "windows host rsvd")],
            1,
        );
    }
    for (ordinal, pod) in pods {
        let node = host.unwrap_or("gone");
        block = block.allocate(*ordinal, pod, &[("node", node), ("pod", pod)], 2);
    }
    block
}

/// Calico's Windows-reserved addresses (no `node` attribute; Calico counts a block holding only
/// them as empty) are imported under one handle per host with that host as their node: releasing
/// a Windows node's addresses releases them with its pods, so its blocks are freed, and another
/// Windows node's reservations stay. Those of a block affine to nobody keep Calico's handle.
#[test]
fn windows_reserved_addresses_are_released_with_their_blocks_host() {
    block_on(async {
        let fixture = CalicoFixture::new()
            .pool("p", "10.9.0.0/16", 26, json!({}))
            .block(&windows_block(
                "10.9.0.0/26",
                Some("win-1"),
                &[(3, "net.pod-1")],
            ))
            .affinity("win-1", "10.9.0.0/26", "confirmed")
            .block(&windows_block("10.9.0.64/26", Some("win-2"), &[]))
            .affinity("win-2", "10.9.0.64/26", "confirmed")
            .block(&windows_block("10.9.0.128/26", None, &[(5, "net.pod-2")]))
            .handle(
                "windows-reserved-ipam-handle",
                &[
                    ("10.9.0.0/26", 4),
                    ("10.9.0.64/26", 4),
                    ("10.9.0.128/26", 4),
                ],
            )
            .handle("net.pod-1", &[("10.9.0.0/26", 1)])
            .handle("net.pod-2", &[("10.9.0.128/26", 1)]);
        let plan = plan_import(&snapshot(&fixture)).expect("maps");
        let win_1 = block_of(&plan, "10.9.0.0/26");
        let reserved = win_1
            .attribute_of(0)
            .expect("inline")
            .expect("ordinal 0 is held");
        assert_eq!(reserved.handle, "windows-reserved-ipam-handle.win-1");
        assert_eq!(
            reserved.metadata.get("node").map(String::as_str),
            Some("win-1")
        );
        assert_eq!(
            reserved.metadata.get("note").map(String::as_str),
            Some("windows host rsvd")
        );
        let unaffine = block_of(&plan, "10.9.0.128/26");
        assert_eq!(
            unaffine
                .attribute_of(63)
                .expect("inline")
                .map(|a| a.handle.as_str()),
            Some("windows-reserved-ipam-handle")
        );

        let store = written_to_memory(&plan).await;
        let ipam = Ipam::new(store.clone());
        assert!(ipam.check(false).await.expect("check").problems.is_empty());

        // The Windows node is gone: releasing its addresses frees its block.
        let released = ipam
            .release_host("win-1", true)
            .await
            .expect("release win-1");
        let mut addresses = released.released_addresses.clone();
        addresses.sort();
        assert_eq!(
            addresses,
            ["10.9.0.0", "10.9.0.1", "10.9.0.2", "10.9.0.3", "10.9.0.63"]
                .map(ip)
                .to_vec()
        );
        assert_eq!(
            released.deleted_blocks,
            vec!["10.9.0.0/26".parse::<ipnet::IpNet>().expect("cidr")],
            "{released:?}"
        );
        // win-2's reservations are its own.
        for ordinal in ["10.9.0.64", "10.9.0.65", "10.9.0.66", "10.9.0.127"] {
            let holder = ipam
                .get_assignment(ip(ordinal))
                .await
                .expect("who holds it");
            assert_eq!(
                holder.map(|h| h.handle),
                Some("windows-reserved-ipam-handle.win-2".to_owned()),
                "{ordinal}"
            );
        }
        assert!(ipam.check(false).await.expect("check").problems.is_empty());
    });
}

/// The verification the import runs before removing its marker names each way the written store
/// can differ from Calico's data: an allocation missing, held by another handle, or one too many;
/// a block missing, with other cooling addresses or claim times; a handle missing or counting
/// wrong; the pools, reservations, node labels or config; a sequence floor not above every
/// imported sequence; and what `check` finds.
#[test]
fn verification_names_each_difference_between_the_written_store_and_calicos_data() {
    block_on(async {
        let plan = plan_import(&snapshot(&sample_cluster())).expect("maps");
        assert!(!plan.reservations.is_empty() && !plan.expected.is_empty());
        let written = written_to_memory(&plan).await;
        writer::verify(&written, &plan)
            .await
            .expect("the written store verifies");
        let refused = |error: Result<(), ImportError>, wanted: &str| match error {
            Err(ImportError::Verify(message)) => {
                assert!(message.contains(wanted), "{wanted:?} not in {message:?}")
            }
            other => panic!("{wanted:?}: {other:?}"),
        };

        // The plan says otherwise.
        let first = plan.expected[0].clone();
        let mut changed: Vec<(ImportPlan, String)> = Vec::new();
        let mut other = plan.clone();
        other.expected[0].handle = "net.someone-else".into();
        changed.push((other, format!("{} is held by {}", first.ip, first.handle)));
        let mut other = plan.clone();
        other.expected[0]
            .metadata
            .insert("pod".into(), "another".into());
        changed.push((other, format!("{} is held by", first.ip)));
        let mut other = plan.clone();
        other.expected[0].sequence += 1;
        changed.push((
            other,
            format!(
                "Calico had {} (sequence {})",
                first.handle,
                first.sequence + 1
            ),
        ));
        let mut other = plan.clone();
        let mut absent = first.clone();
        absent.ip = "10.255.255.1".parse().expect("an address");
        other.expected.push(absent);
        changed.push((other, "Calico's allocation 10.255.255.1 is missing".into()));
        let mut other = plan.clone();
        other.expected.pop();
        changed.push((
            other,
            format!(
                "holds {} allocations, Calico held {}",
                plan.expected.len(),
                plan.expected.len() - 1
            ),
        ));
        let mut other = plan.clone();
        let mut absent = other.blocks[0].clone();
        absent.cidr = "10.255.0.0/26".parse().expect("a block");
        other.blocks.push(absent);
        changed.push((other, "block 10.255.0.0/26 is missing".into()));
        let mut other = plan.clone();
        other.blocks[0].cooling.push_back(CoolingAddress {
            ordinal: 60,
            released_at: JAN_2025,
        });
        changed.push((
            other,
            format!("block {} has cooling addresses", plan.blocks[0].cidr),
        ));
        let mut other = plan.clone();
        other.blocks[0].claimed_at = Some(JAN_2025 + 1);
        changed.push((
            other,
            format!("block {} was claimed at", plan.blocks[0].cidr),
        ));
        let mut other = plan.clone();
        other.blocks[0].emptied_at = Some(JAN_2025 + 2);
        changed.push((
            other,
            format!("block {} was claimed at", plan.blocks[0].cidr),
        ));
        let mut other = plan.clone();
        other.pools[0].disabled = !other.pools[0].disabled;
        changed.push((other, "the stored pools differ".into()));
        let mut other = plan.clone();
        other.reservations.pop();
        changed.push((other, "the stored IP reservations differ".into()));
        let mut other = plan.clone();
        other.node_labels.insert("node-zz".into(), BTreeMap::new());
        changed.push((other, "the stored node labels differ".into()));
        let mut other = plan.clone();
        other.config.ip_cooldown_seconds += 1;
        changed.push((other, "the stored config".into()));
        for (other, wanted) in changed {
            refused(writer::verify(&written, &other).await, &wanted);
        }

        // The store says otherwise.
        let handle = &first.handle;
        let handle_key = keys::handle(handle);
        let stored_handle = written
            .get(&handle_key)
            .await
            .expect("get")
            .expect("the handle");
        let tampered: Vec<(Op, String)> = vec![
            (
                Op::delete(&handle_key),
                format!("handles, Calico's allocations have {}", plan.handles.len()),
            ),
            (
                Op::put(&handle_key, {
                    let mut wrong: ipam_core::model::Handle =
                        decode(&handle_key, &stored_handle.value).expect("a handle");
                    for count in wrong.blocks.values_mut() {
                        *count += 3;
                    }
                    ipam_core::model::encode(&wrong).expect("encode")
                }),
                format!("handle {handle} counts"),
            ),
            (
                Op::delete(keys::sequence_floor()),
                "the sequence floor 0 is not above the largest imported sequence".into(),
            ),
            (
                Op::put(
                    keys::block_claim(&"10.255.0.0/26".parse().expect("a block")),
                    ipam_core::model::encode(&ipam_core::model::Claim {
                        affinity: Some("node-zz".into()),
                        free: 64,
                        emptied_at: None,
                        last_cooling_release: None,
                    })
                    .expect("encode"),
                ),
                "check found 1 problem (first: orphaned-claim".into(),
            ),
        ];
        for (op, wanted) in tampered {
            let store = written_to_memory(&plan).await;
            store.commit(Txn::new().then(op)).await.expect("tamper");
            refused(writer::verify(&store, &plan).await, &wanted);
        }
    });
}

/// Units are grouped into transactions up to the store's limits, counted as `Txn::validate`
/// counts them (each key twice, under its "absent" condition, plus its value): an exact fit is
/// one transaction, one operation or one byte more is two; a unit too large alone is refused,
/// named.
#[test]
fn units_are_grouped_into_transactions_the_store_accepts() {
    use ipam_core::kv::{MAX_TXN_BYTES, MAX_TXN_OPS};
    let key = |n: usize| format!("ipam/v1/handles/{n:084}");
    assert_eq!(key(0).len(), 100);
    let unit = |first: usize, keys: usize, value: usize| -> writer::Unit {
        (first..first + keys)
            .map(|n| (key(n), vec![0; value]))
            .collect()
    };
    let sizes = |units: &[writer::Unit]| -> Vec<usize> {
        let batches = writer::transactions(units).expect("groups");
        for batch in &batches {
            writer::batch_txn(batch)
                .validate()
                .expect("a transaction the store accepts");
        }
        batches.iter().map(Vec::len).collect()
    };
    // By operations: 100 + 28 keys fit, 100 + 29 do not.
    assert_eq!(sizes(&[unit(0, 100, 1), unit(100, 28, 1)]), vec![2]);
    assert_eq!(sizes(&[unit(0, 100, 1), unit(100, 29, 1)]), vec![1, 1]);
    // By bytes: two keys filling the budget exactly fit, one byte more does not.
    let half = MAX_TXN_BYTES / 2 - 200;
    assert_eq!(sizes(&[unit(0, 1, half), unit(1, 1, half)]), vec![2]);
    assert_eq!(sizes(&[unit(0, 1, half), unit(1, 1, half + 1)]), vec![1, 1]);
    // One unit at the limits is one transaction; one over them is refused.
    assert_eq!(sizes(&[unit(0, MAX_TXN_OPS, 1)]), vec![1]);
    assert_eq!(sizes(&[unit(0, 2, half)]), vec![1]);
    for (too_large, what) in [
        (unit(0, MAX_TXN_OPS + 1, 1), "operations"),
        (unit(0, 2, half + 1), "bytes"),
    ] {
        match writer::transactions(&[unit(500, 1, 1), too_large]) {
            Err(ImportError::Target(message)) => assert!(
                message.starts_with(&key(0)) && message.contains("too large for one transaction"),
                "{what}: {message}"
            ),
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// The sequence floor is written only when Calico's blocks carried sequence numbers, and the
/// pool generation counter only when there are pools (then it counts them).
#[test]
fn the_floor_and_the_pool_generation_are_written_only_when_there_is_something_to_record() {
    let keys_of = |plan: &ImportPlan| -> BTreeMap<String, Vec<u8>> {
        planned_units(plan)
            .expect("units")
            .into_iter()
            .flatten()
            .collect()
    };
    let empty = plan_import(&snapshot(&CalicoFixture::new())).expect("maps");
    assert_eq!((empty.sequence_floor, empty.pools.len()), (0, 0));
    let written = keys_of(&empty);
    assert!(
        !written.contains_key(&keys::sequence_floor()),
        "{written:?}"
    );
    assert!(
        !written.contains_key(&keys::pool_generation()),
        "{written:?}"
    );
    let plan = plan_import(&snapshot(&sample_cluster())).expect("maps");
    assert!(plan.sequence_floor > 0 && !plan.pools.is_empty());
    let written = keys_of(&plan);
    let generation: u64 = decode(
        &keys::pool_generation(),
        written
            .get(&keys::pool_generation())
            .expect("the pool generation"),
    )
    .expect("a count");
    assert_eq!(generation, plan.pools.len() as u64);
    let floor: u64 = decode(
        &keys::sequence_floor(),
        written.get(&keys::sequence_floor()).expect("the floor"),
    )
    .expect("a number");
    assert_eq!(floor, plan.sequence_floor);
}
