//! Store format cases: writers write the format the store records (the previous release's until
//! the upgrade is finalized), the record, the upgrade status and finalize, on every backend.

use std::sync::Arc;

use ipam_core::allocator::AutoAssignRequest;
use ipam_core::model::{decode, keys, FORMAT_VERSION};
use ipam_core::store_format::FormatRecord;
use ipam_core::{Ipam, IpamConfig, IpamError, KeyValue, KvStore};
use ipnet::IpNet;

use crate::hooked::HookedStore;
use crate::ipam::{assert_clean, block_of, damage, ipam_with_pool, spec, v4, GARBAGE};
use crate::StoreFactory;

/// Expands every store-format case into one `#[test]` inside a module `upgrade`.
#[macro_export]
macro_rules! upgrade_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(upgrade, $crate::upgrade, $factory;
            a_new_store_records_the_current_format_with_its_first_write,
            the_writer_that_recorded_the_format_writes_on_without_a_conflict,
            a_store_in_use_without_a_record_is_written_in_format_3_and_recorded_so,
            settings_the_recorded_format_cannot_hold_are_refused_and_change_nothing,
            finalize_refuses_while_a_node_may_read_an_older_format_unless_forced,
            finalize_decides_again_when_a_node_speaks_up_between_its_read_and_its_write,
            after_finalize_every_write_is_in_the_current_format,
            a_writer_that_learned_the_older_format_before_finalize_retries_in_the_new_one,
            a_record_newer_than_this_build_is_refused_clearly_and_nothing_is_written,
            a_damaged_record_fails_every_write_naming_it_and_nothing_is_written,
            a_block_filled_to_its_edges_moves_to_full_only_once_finalized,
            a_request_taking_edges_gets_the_edges_of_blocks_kept_full,
            a_request_taking_edges_passes_over_a_block_kept_full_it_cannot_decode,
            a_dual_stack_request_at_the_block_limit_gets_the_edges_of_both_families,
        );
    };
}

const RECORD: &str = "ipam/v1/format";

async fn recorded(store: &Arc<dyn KvStore>) -> Option<u8> {
    let kv = store.get(RECORD).await.expect("get record")?;
    Some(
        FormatRecord::decode(&kv.key, &kv.value)
            .expect("a format record")
            .writes,
    )
}

/// The format byte of every versioned object (blocks, claims, handles, pools, config).
async fn object_formats(store: &Arc<dyn KvStore>) -> Vec<(String, u8)> {
    let mut formats = Vec::new();
    for kv in store.list("ipam/v1/").await.expect("list") {
        let versioned = ["blocks/", "claims/", "handles/", "pools/", "config"]
            .iter()
            .any(|kind| kv.key.starts_with(&format!("ipam/v1/{kind}")));
        if versioned {
            formats.push((kv.key.clone(), kv.value[0]));
        }
    }
    formats
}

/// A store as the previous release leaves it: in use (a pool, an allocation) and no record.
async fn store_of_the_previous_release(factory: &impl StoreFactory) -> (crate::TestStore, Ipam) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    ipam.auto_assign(&v4("before", "old-1", 1))
        .await
        .expect("assign");
    t.store.delete(RECORD).await.expect("delete the record");
    let fresh = Ipam::new(Arc::clone(&t.store));
    (t, fresh)
}

/// An empty store is new: its first write records this build's format, and writes it.
pub async fn a_new_store_records_the_current_format_with_its_first_write<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    assert_eq!(recorded(&t.store).await, None);
    ipam.create_pool(&spec("10.0.0.0/24", "pool", 26))
        .await
        .expect("create pool");
    assert_eq!(
        recorded(&t.store).await,
        Some(ipam_core::model::FORMAT_VERSION)
    );
    ipam.auto_assign(&v4("h", "node-a", 1))
        .await
        .expect("assign");
    for (key, format) in object_formats(&t.store).await {
        assert_eq!(format, ipam_core::model::FORMAT_VERSION, "{key}");
    }
}

/// On an empty store, the upgrade status says no record yet and writers on this build's format;
/// the writer whose first write recorded it knows the record's revision: its next writes (pool,
/// configuration, node labels, none of which reads the record again) commit at once, without
/// a conflict on the record.
pub async fn the_writer_that_recorded_the_format_writes_on_without_a_conflict<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let hooked = HookedStore::new(Arc::clone(&t.store));
    let ipam = Ipam::new(hooked.clone());
    let status = ipam
        .upgrade_status()
        .await
        .expect("status of an empty store");
    assert_eq!(status.recorded, None);
    assert_eq!(
        status.writes, FORMAT_VERSION,
        "an empty store is new: {status:?}"
    );
    assert!(status.nodes.is_empty(), "{status:?}");

    ipam.create_pool(&spec("10.0.0.0/24", "pool", 26))
        .await
        .expect("create pool");
    assert_eq!(recorded(&t.store).await, Some(FORMAT_VERSION));
    ipam.update_config(|c| c.max_blocks_per_host = 30)
        .await
        .expect("config");
    ipam.create_pool(&spec("10.9.0.0/24", "other", 26))
        .await
        .expect("second pool");
    ipam.set_node_labels("node-a", &[("zone".to_owned(), "a".to_owned())], &[])
        .await
        .expect("label");
    assert_eq!(
        (hooked.commits(), hooked.conflicts()),
        (4, 0),
        "four writes, each committed once"
    );
    let status = ipam.upgrade_status().await.expect("status");
    assert_eq!(
        (status.recorded, status.writes),
        (Some(FORMAT_VERSION), FORMAT_VERSION)
    );
    assert_clean(&ipam).await;
}

/// A store in use without a record predates it: every write is in format 3, which the previous
/// release reads, and the first write records format 3. This build still reads it all.
pub async fn a_store_in_use_without_a_record_is_written_in_format_3_and_recorded_so<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = store_of_the_previous_release(factory).await;
    ipam.auto_assign(&v4("after", "new-1", 1))
        .await
        .expect("assign on new-1");
    ipam.auto_assign(&v4("borrow", "old-1", 1))
        .await
        .expect("assign on old-1");
    ipam.update_config(|c| c.max_blocks_per_host = 30)
        .await
        .expect("config");
    ipam.create_pool(&spec("10.9.0.0/24", "other", 26))
        .await
        .expect("create pool");
    assert_eq!(recorded(&t.store).await, Some(3));
    let written: Vec<(String, u8)> = object_formats(&t.store)
        .await
        .into_iter()
        .filter(|(key, _)| !key.ends_with("handles/before") && !key.ends_with("pools/pool"))
        .collect();
    assert!(written.len() >= 5, "{written:?}");
    for (key, format) in &written {
        assert_eq!(*format, 3, "{key} was written in format {format}");
    }
    // Format 3's readers (this build's, for the claim index and blocks) read it all back.
    assert_eq!(
        ipam.get_config().await.expect("config").max_blocks_per_host,
        30
    );
    assert_clean(&ipam).await;
}

/// Until finalize, a cooldown (which format 3 cannot hold) is refused with a clear error, and the
/// store is unchanged.
pub async fn settings_the_recorded_format_cannot_hold_are_refused_and_change_nothing<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = store_of_the_previous_release(factory).await;
    let before = t.store.list("ipam/v1/").await.expect("list");
    let refused = ipam
        .set_config(&IpamConfig {
            ip_cooldown_seconds: 30,
            ..IpamConfig::default()
        })
        .await
        .expect_err("a cooldown needs format 4");
    assert!(
        matches!(
            refused,
            IpamError::FormatNotFinalized {
                needs: 4,
                writes: 3,
                ..
            }
        ),
        "{refused:?}"
    );
    assert!(refused
        .to_string()
        .contains("blockipamctl upgrade finalize"));
    let after = t.store.list("ipam/v1/").await.expect("list");
    assert_eq!(before, after, "a refused change writes nothing");
}

/// Finalize refuses while a node may read an older format: an agent registration of a release
/// that does not say what it reads, or a node holding blocks whose plugin was never seen; with
/// `force` it records today's format in one write.
pub async fn finalize_refuses_while_a_node_may_read_an_older_format_unless_forced<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = store_of_the_previous_release(factory).await;
    t.store
        .put(
            "ipam/v1/agents/old-2",
            br#"{"node":"old-2","registered_at":1,"agent_version":"0.1.0"}"#.to_vec(),
        )
        .await
        .expect("an older agent's registration");
    let status = ipam.upgrade_status().await.expect("status");
    assert_eq!(status.recorded, None);
    assert_eq!(status.writes, 3);
    let behind: Vec<&str> = status
        .nodes
        .iter()
        .filter(|n| n.reads_format() < FORMAT_VERSION)
        .map(|n| n.node.as_str())
        .collect();
    assert_eq!(behind, ["old-1", "old-2"]);
    let refused = ipam.finalize_upgrade(false).await.expect_err("refused");
    let message = refused.to_string();
    assert!(
        message.contains("old-1") && message.contains("old-2"),
        "{message}"
    );
    assert_eq!(recorded(&t.store).await, None, "a refusal writes nothing");

    // The nodes are upgraded: old-1's plugin records what it reads with its next call, old-2's
    // agent registers again.
    let upgraded = Ipam::new(Arc::clone(&t.store))
        .recording_activity("old-1", "0.2.0")
        .expect("activity");
    upgraded
        .auto_assign(&v4("upgraded", "old-1", 1))
        .await
        .expect("assign");
    ipam_core::dead_nodes::register(t.store.as_ref(), "old-2", "0.2.0", 2)
        .await
        .expect("register");
    let outcome = ipam.finalize_upgrade(false).await.expect("finalize");
    assert!(outcome.changed);
    assert_eq!(outcome.previous, Some(3));
    assert_eq!(recorded(&t.store).await, Some(FORMAT_VERSION));
    let again = ipam.finalize_upgrade(false).await.expect("finalize again");
    assert!(!again.changed, "finalizing twice changes nothing");

    // Forced over a node that still reads format 3.
    let (t, ipam) = store_of_the_previous_release(factory).await;
    let outcome = ipam.finalize_upgrade(true).await.expect("forced");
    assert_eq!(outcome.overridden.len(), 1, "{outcome:?}");
    assert_eq!(recorded(&t.store).await, Some(FORMAT_VERSION));
}

/// Between finalize's read of what every node reads and its write, an agent registers saying it
/// reads only format 3 (an agent rolled back), or a plugin of an older release records its first
/// call: the write is refused, and finalize, deciding again, refuses for that node; nothing is
/// recorded.
pub async fn finalize_decides_again_when_a_node_speaks_up_between_its_read_and_its_write<
    F: StoreFactory,
>(
    factory: &F,
) {
    for (what, key, value) in [
        (
            "an agent rolled back registers",
            "ipam/v1/agents/late",
            br#"{"node":"late","registered_at":1,"agent_version":"0.1.0"}"#.to_vec(),
        ),
        (
            "an older plugin records its first call",
            "ipam/v1/activity/late",
            br#"{"node":"late","plugin_version":"0.4.0","reads_format":5}"#.to_vec(),
        ),
    ] {
        let (t, _) = store_of_the_previous_release(factory).await;
        // old-1 is upgraded: nothing else holds finalize back.
        Ipam::new(Arc::clone(&t.store))
            .recording_activity("old-1", "0.2.0")
            .expect("activity")
            .auto_assign(&v4("upgraded", "old-1", 1))
            .await
            .expect("assign");
        let before = recorded(&t.store).await;
        assert_ne!(before, Some(FORMAT_VERSION));
        let hooked = HookedStore::new(Arc::clone(&t.store));
        let store = Arc::clone(&t.store);
        hooked.before_commit(
            |txn| txn.ops.iter().any(|op| op.key() == RECORD),
            move || async move {
                store.put(key, value).await.expect("the node's word");
            },
        );
        let ipam = Ipam::new(hooked.clone());
        let refused = ipam
            .finalize_upgrade(false)
            .await
            .expect_err("finalized over a node that reads an older format");
        assert!(
            hooked.commit_hook_fired(),
            "{what}: the race was not staged"
        );
        assert!(refused.to_string().contains("late"), "{what}: {refused}");
        assert_eq!(recorded(&t.store).await, before, "{what}: recorded anyway");
    }
}

/// After finalize every object written is in today's format, and settings that need it are accepted.
pub async fn after_finalize_every_write_is_in_the_current_format<F: StoreFactory>(factory: &F) {
    let (t, ipam) = store_of_the_previous_release(factory).await;
    ipam.auto_assign(&v4("in-3", "new-1", 1))
        .await
        .expect("assign");
    let generation = |store: Arc<dyn KvStore>| async move {
        store
            .get(&keys::pool_generation())
            .await
            .expect("read")
            .expect("a pool generation")
    };
    let before = generation(Arc::clone(&t.store)).await;
    ipam.finalize_upgrade(true).await.expect("finalize");
    // The configuration rewritten raises the pool generation, in the same transaction.
    let after = generation(Arc::clone(&t.store)).await;
    let record = t
        .store
        .get(&keys::store_format())
        .await
        .expect("read")
        .expect("a format record");
    assert_eq!(after.revision, record.revision, "raised with the record");
    let count = |kv: &KeyValue| -> u64 { decode(&kv.key, &kv.value).expect("a count") };
    assert_eq!(count(&after), count(&before) + 1);
    let ipam = Ipam::new(Arc::clone(&t.store));
    ipam.auto_assign(&v4("in-4", "new-1", 1))
        .await
        .expect("assign");
    ipam.set_config(&IpamConfig {
        ip_cooldown_seconds: 30,
        ..IpamConfig::default()
    })
    .await
    .expect("a cooldown once finalized");
    let formats = object_formats(&t.store).await;
    let format_of = |part: &str| {
        formats
            .iter()
            .find(|(key, _)| key.contains(part))
            .unwrap_or_else(|| panic!("no key with {part} in {formats:?}"))
            .1
    };
    assert_eq!(format_of("ipam/v1/config"), FORMAT_VERSION);
    assert_eq!(format_of("handles/in-4"), FORMAT_VERSION);
    assert_eq!(
        format_of("handles/in-3"),
        3,
        "untouched objects keep their format"
    );
    assert_clean(&ipam).await;
}

/// An allocator that learned format 3 (an agent's, long-lived) and then writes after another
/// finalized: its commit is conditioned on the record it learned, so it fails, re-reads the
/// record and writes today's format; never format 3 over a finalized store.
pub async fn a_writer_that_learned_the_older_format_before_finalize_retries_in_the_new_one<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, learner) = store_of_the_previous_release(factory).await;
    learner
        .create_pool(&spec("10.8.0.0/24", "learned-in-3", 26))
        .await
        .expect("pool");
    assert_eq!(recorded(&t.store).await, Some(3));
    let other_learner = Ipam::new(Arc::clone(&t.store));
    other_learner
        .auto_assign(&v4("learned", "new-1", 1))
        .await
        .expect("assign");
    Ipam::new(Arc::clone(&t.store))
        .finalize_upgrade(true)
        .await
        .expect("finalize");
    // A write it still thinks goes in format 3: the commit fails on the record and is redone.
    learner
        .create_pool(&spec("10.7.0.0/24", "after-finalize", 26))
        .await
        .expect("pool after finalize");
    let formats = object_formats(&t.store).await;
    let pool = formats
        .iter()
        .find(|(key, _)| key.ends_with("pools/after-finalize"))
        .expect("the pool");
    assert_eq!(pool.1, FORMAT_VERSION, "{formats:?}");
    // A setting it thinks format 3 cannot hold: refused only after reading the record again.
    other_learner
        .set_config(&IpamConfig {
            ip_cooldown_seconds: 30,
            ..IpamConfig::default()
        })
        .await
        .expect("a cooldown once finalized, by an allocator that learned format 3");
    assert_eq!(recorded(&t.store).await, Some(FORMAT_VERSION));
}

/// A record naming a format newer than this build writes (a newer release finalized the store):
/// every write, `finalize_upgrade` included (forced too), is refused with an error that says so,
/// and nothing is written.
pub async fn a_record_newer_than_this_build_is_refused_clearly_and_nothing_is_written<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    t.store
        .put(RECORD, br#"{"writes":9}"#.to_vec())
        .await
        .expect("a newer record");
    let before = t.store.list("ipam/v1/").await.expect("list");
    let fresh = Ipam::new(Arc::clone(&t.store));
    let refused = fresh
        .auto_assign(&v4("h", "node-a", 1))
        .await
        .expect_err("refused");
    assert!(
        matches!(
            refused,
            IpamError::FormatTooNew {
                writes: 9,
                newest: FORMAT_VERSION
            }
        ),
        "{refused:?}"
    );
    let refused = ipam
        .create_pool(&spec("10.9.0.0/24", "other", 26))
        .await
        .expect_err("refused");
    assert!(
        matches!(refused, IpamError::FormatTooNew { .. }),
        "{refused:?}"
    );
    // Finalize, forced or not, never takes the record back to this build's format: the newer
    // release's objects would then be rewritten by writers that cannot read them.
    for force in [false, true] {
        let refused = ipam.finalize_upgrade(force).await.expect_err("refused");
        assert!(
            matches!(refused, IpamError::FormatTooNew { writes: 9, .. }),
            "force {force}: {refused:?}"
        );
    }
    // Status only reads: it reports the record as it is.
    assert_eq!(
        ipam.upgrade_status().await.expect("status").recorded,
        Some(9)
    );
    assert_eq!(before, t.store.list("ipam/v1/").await.expect("list"));
}

/// A damaged record: every write fails as corrupt, naming the record, and nothing is written;
/// `upgrade_status` names it too. Put back, everything works again.
pub async fn a_damaged_record_fails_every_write_naming_it_and_nothing_is_written<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, _) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    t.store
        .put(RECORD, b"\x04garbage".to_vec())
        .await
        .expect("a damaged record");
    let before = t.store.list("ipam/v1/").await.expect("list");
    let ipam = Ipam::new(Arc::clone(&t.store));
    let named = |e: &IpamError| matches!(e, IpamError::Corrupt { key, .. } if key == RECORD);
    let refused = ipam
        .auto_assign(&v4("h", "node-a", 1))
        .await
        .expect_err("refused");
    assert!(named(&refused), "{refused:?}");
    let refused = ipam
        .create_pool(&spec("10.9.0.0/24", "other", 26))
        .await
        .expect_err("refused");
    assert!(named(&refused), "{refused:?}");
    let refused = ipam.upgrade_status().await.expect_err("refused");
    assert!(named(&refused), "{refused:?}");
    assert_eq!(before, t.store.list("ipam/v1/").await.expect("list"));
    t.store
        .put(RECORD, br#"{"writes":4}"#.to_vec())
        .await
        .expect("the record put back");
    Ipam::new(Arc::clone(&t.store))
        .auto_assign(&v4("h", "node-a", 1))
        .await
        .expect("assign once the record is back");
}

/// `v4(handle, host, 1)` as the plugin sends it without a gateway: block edges never handed out.
fn skipping_edges(handle: &str, host: &str) -> AutoAssignRequest {
    AutoAssignRequest {
        skip_block_edges: true,
        ..v4(handle, host, 1)
    }
}

/// Which of `host`'s block keys for `block` hold it: `open`, `full`, both or neither.
async fn placement(store: &Arc<dyn KvStore>, host: &str, block: &IpNet) -> Vec<&'static str> {
    let mut found = Vec::new();
    for (place, key) in [
        ("open", keys::block(Some(host), block)),
        ("full", keys::full_block(host, block)),
    ] {
        if store.get(&key).await.expect("get").is_some() {
            found.push(place);
        }
    }
    found
}

/// A block filled up to its edges (by requests that skip them) stays under `open/`, where the
/// previous release (format 4) keeps it and its `check` expects it, while the store's writers
/// write format 4; once the upgrade is finalized, the next allocation on its node moves it under
/// `full/`, out of the node's steady-state read. `check` finds nothing wrong either way.
pub async fn a_block_filled_to_its_edges_moves_to_full_only_once_finalized<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    t.store
        .put(RECORD, br#"{"writes":4}"#.to_vec())
        .await
        .expect("record format 4");
    let ipam = Ipam::new(Arc::clone(&t.store));
    ipam.create_pool(&spec("10.0.0.0/28", "pool", 30))
        .await
        .expect("create pool");
    let first = ipam
        .auto_assign(&skipping_edges("a", "node-a"))
        .await
        .expect("assign a");
    let block = first.v4[0].block;
    let second = ipam
        .auto_assign(&skipping_edges("b", "node-a"))
        .await
        .expect("assign b");
    assert_eq!(second.v4[0].block, block, "both host addresses of one /30");
    assert_eq!(placement(&t.store, "node-a", &block).await, ["open"]);
    assert_clean(&ipam).await;
    // The next ADD, still at format 4, claims a new block and leaves that one as it is.
    let open_key = keys::block(Some("node-a"), &block);
    let revision = |store: Arc<dyn KvStore>, key: String| async move {
        store.get(&key).await.expect("get").map(|kv| kv.revision)
    };
    let before = revision(Arc::clone(&t.store), open_key.clone()).await;
    let next = ipam
        .auto_assign(&skipping_edges("b2", "node-a"))
        .await
        .expect("assign b2");
    let next_block = next.v4[0].block;
    assert_ne!(next_block, block, "a new block for b2");
    assert_eq!(
        revision(Arc::clone(&t.store), open_key).await,
        before,
        "a format-4 writer rewrote a block it did not change"
    );

    ipam.finalize_upgrade(true).await.expect("finalize");
    // Finalized, before the node writes again: the block is where format 4 left it, a place
    // `check` accepts in a finalized store.
    assert_eq!(placement(&t.store, "node-a", &block).await, ["open"]);
    assert_clean(&ipam).await;
    let third = ipam
        .auto_assign(&skipping_edges("c", "node-a"))
        .await
        .expect("assign c");
    assert_eq!(third.v4[0].block, next_block, "c fills b2's block");
    // The block format 4 left under open/ moved with c's write, and c's filled block is stored
    // as full at once.
    assert_eq!(placement(&t.store, "node-a", &block).await, ["full"]);
    assert_eq!(placement(&t.store, "node-a", &next_block).await, ["full"]);
    assert_clean(&ipam).await;
    // Its addresses stay where they were, and release from where it is now.
    ipam.release_handle("a").await.expect("release a");
    assert_eq!(placement(&t.store, "node-a", &block).await, ["open"]);
    assert_clean(&ipam).await;
}

/// A request that may take block edges (a netconf with a gateway) on a node whose only block in
/// its pool is full but for its edges, in a pool with no block left, gets those edges: a block kept
/// under `full/` for having only its edges free never makes an allocation fail that had room. It
/// takes them only from its own pool and family, although the node keeps such blocks of another
/// pool and of IPv6 there too.
pub async fn a_request_taking_edges_gets_the_edges_of_blocks_kept_full<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/30", 30).await;
    for (cidr, name, size) in [("10.0.1.0/30", "other", 30), ("fd00::/126", "v6", 126)] {
        ipam.create_pool(&spec(cidr, name, size))
            .await
            .expect("create pool");
    }
    let in_pool = |handle: &str, pool: &str, v6: bool, skip_block_edges: bool| {
        let request = v4(handle, "node-a", u32::from(!v6));
        AutoAssignRequest {
            num_v6: u32::from(v6),
            v4_pools: if v6 { vec![] } else { vec![pool.to_owned()] },
            v6_pools: if v6 { vec![pool.to_owned()] } else { vec![] },
            skip_block_edges,
            ..request
        }
    };
    for (pool, v6) in [("pool", false), ("other", false), ("v6", true)] {
        for n in 0..2 {
            ipam.auto_assign(&in_pool(&format!("{pool}-{n}"), pool, v6, true))
                .await
                .expect("assign a host address");
        }
    }
    for block in ["10.0.0.0/30", "10.0.1.0/30", "fd00::/126"] {
        let block: IpNet = block.parse().expect("cidr");
        assert_eq!(
            placement(&t.store, "node-a", &block).await,
            ["full"],
            "{block}"
        );
    }
    let mut edges = Vec::new();
    for handle in ["c", "d"] {
        let got = ipam
            .auto_assign(&in_pool(handle, "pool", false, false))
            .await
            .unwrap_or_else(|e| panic!("assign {handle}, which may take an edge: {e}"));
        assert!(got.v6.is_empty(), "{got:?}");
        edges.extend(got.v4.iter().map(|a| a.ip.to_string()));
    }
    edges.sort();
    assert_eq!(edges, ["10.0.0.0", "10.0.0.3"]);
    let refused = ipam
        .auto_assign(&in_pool("e", "pool", false, false))
        .await
        .expect_err("the pool is full");
    assert!(
        matches!(refused, IpamError::Exhausted { .. }),
        "{refused:?}"
    );
    assert_clean(&ipam).await;
}

/// A block of the node kept under `full/` (only its edges free) that cannot be decoded is passed
/// over by a request that may take edges, and never written: the request borrows (new blocks off)
/// or gets a new block instead of failing; when nothing else has room, the error names the block.
pub async fn a_request_taking_edges_passes_over_a_block_kept_full_it_cannot_decode<
    F: StoreFactory,
>(
    factory: &F,
) {
    // Four /30 blocks.
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/28", 30).await;
    let request = |handle: &str, host: &str, skip_block_edges: bool| AutoAssignRequest {
        skip_block_edges,
        ..v4(handle, host, 1)
    };
    let theirs = ipam
        .auto_assign(&request("b-0", "node-b", true))
        .await
        .expect("node-b's block")
        .v4[0]
        .ip;
    let lender = block_of(&ipam, theirs).await;
    let mut kept_full = None;
    for n in 0..2 {
        let got = ipam
            .auto_assign(&request(&format!("a-{n}"), "node-a", true))
            .await
            .expect("a host address");
        kept_full = Some(got.v4[0].block);
    }
    let kept_full = kept_full.expect("node-a's block");
    assert_eq!(placement(&t.store, "node-a", &kept_full).await, ["full"]);
    let key = keys::full_block("node-a", &kept_full);
    let intact = damage(t.store.as_ref(), &key).await;
    let set_config = |config: IpamConfig| {
        let ipam = &ipam;
        async move { ipam.set_config(&config).await.expect("config") }
    };

    // New blocks off, borrowing on: the node's blocks kept full are listed, then it borrows.
    set_config(IpamConfig {
        auto_allocate_blocks: false,
        ..IpamConfig::default()
    })
    .await;
    let borrowed = ipam
        .auto_assign(&request("c", "node-a", false))
        .await
        .expect("an address past the damaged block, borrowed");
    assert!(lender.contains(&borrowed.v4[0].ip), "{borrowed:?}");

    // Nothing else has room (no new block, no borrowing): the damaged block is named.
    set_config(IpamConfig {
        auto_allocate_blocks: false,
        strict_affinity: true,
        ..IpamConfig::default()
    })
    .await;
    let before = t.store.list("").await.expect("list");
    match ipam.auto_assign(&request("d", "node-a", false)).await {
        Err(IpamError::Corrupt { key: named, .. }) => assert_eq!(named, key),
        other => panic!("expected the damaged block named, got {other:?}"),
    }
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "nothing written"
    );

    // New blocks on: the probe reads the blocks kept full, and the node gets a new block.
    set_config(IpamConfig::default()).await;
    let fresh = ipam
        .auto_assign(&request("e", "node-a", false))
        .await
        .expect("an address past the damaged block, from a new block");
    let fresh_block = fresh.v4[0].block;
    assert!(
        fresh_block != kept_full && fresh_block != lender,
        "{fresh:?}"
    );
    assert_eq!(
        t.store
            .get(&key)
            .await
            .expect("get")
            .expect("still there")
            .value,
        GARBAGE.to_vec(),
        "the damaged block is never written"
    );

    // Restored: its edges are taken again.
    t.store.put(&key, intact).await.expect("restore it");
    set_config(IpamConfig {
        auto_allocate_blocks: false,
        strict_affinity: true,
        ..IpamConfig::default()
    })
    .await;
    let mut taken = Vec::new();
    for handle in ["f", "g", "h", "i"] {
        let got = ipam
            .auto_assign(&request(handle, "node-a", false))
            .await
            .unwrap_or_else(|e| panic!("assign {handle}: {e}"));
        taken.push(got.v4[0].ip);
    }
    assert!(
        taken.iter().any(|ip| kept_full.contains(ip)),
        "an edge of the restored block: {taken:?}"
    );
    assert_clean(&ipam).await;
}

/// At the per-host block limit, a dual-stack request that may take edges gets an edge of each
/// family from the node's blocks kept under `full/`, rather than a block-limit error.
pub async fn a_dual_stack_request_at_the_block_limit_gets_the_edges_of_both_families<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/29", 30).await;
    ipam.create_pool(&spec("fd00::/125", "v6", 126))
        .await
        .expect("create pool");
    ipam.update_config(|c| c.max_blocks_per_host = 1)
        .await
        .expect("one block per family");
    let dual = |handle: &str, skip_block_edges: bool| AutoAssignRequest {
        num_v6: 1,
        skip_block_edges,
        ..v4(handle, "node-a", 1)
    };
    let mut blocks = Vec::new();
    for handle in ["a", "b"] {
        let got = ipam
            .auto_assign(&dual(handle, true))
            .await
            .expect("assign host addresses");
        blocks.extend(got.v4.iter().chain(&got.v6).map(|a| a.block));
    }
    blocks.sort();
    blocks.dedup();
    assert_eq!(blocks.len(), 2, "one block of each family: {blocks:?}");
    for block in &blocks {
        assert_eq!(
            placement(&t.store, "node-a", block).await,
            ["full"],
            "{block}"
        );
    }
    let got = ipam
        .auto_assign(&dual("gateway", false))
        .await
        .expect("a request that may take edges, at the block limit");
    for address in got.v4.iter().chain(&got.v6) {
        assert!(blocks.contains(&address.block), "{address:?}");
        assert!(
            address.ip == address.block.network() || address.ip == address.block.broadcast(),
            "{address:?} is not an edge of its block"
        );
    }
    assert_eq!((got.v4.len(), got.v6.len()), (1, 1), "{got:?}");
    assert_clean(&ipam).await;
}
