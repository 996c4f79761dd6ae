//! The allocator reading through a cache of what it read and wrote (the node agent's
//! `ipam_core::caching::CachingStore`), with other writers changing the store under it: what was
//! kept may be stale, no answer may be wrong.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use ipam_core::caching::CachingStore;
use ipam_core::model::keys;
use ipam_core::reservations::Reservation;
use ipam_core::{
    AssignIpsRequest, Condition, CountingStore, Ipam, KeyValue, KvError, KvStore, Read, ReadResult,
    Revision, RoundTrips, Txn,
};

use ipnet::IpNet;

use crate::ipam::{
    assert_allocations_are, assert_clean, assign_concurrently, assign_one, ipam_with_pool, net,
    spec, v4,
};
use crate::StoreFactory;

/// Expands every case into one `#[tokio::test]` inside a module `cached_reads`.
#[macro_export]
macro_rules! cached_reads_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(cached_reads, $crate::cached_reads, $factory;
            a_node_reading_through_its_cache_never_decides_from_what_another_writer_changed,
            hosts_assigning_concurrently_through_caches_of_their_own_get_distinct_addresses,
            a_steady_assign_through_the_cache_tests_the_pool_generation_for_every_pool,
            every_write_an_assignment_decides_from_raises_the_pool_generation_with_it,
            a_confirmation_is_dropped_only_while_its_handle_is_still_gone,
            a_steady_assign_through_the_cache_tests_the_two_generations_once_finalized,
        );
    };
}

/// A node's allocator as its agent serves it: over a cache (handles speculated absent) over a
/// counter of the round trips that reach the store.
fn cached_node(store: &Arc<dyn KvStore>) -> (Ipam, Arc<CachingStore>, Arc<CountingStore>) {
    let counting = Arc::new(CountingStore::new(Arc::clone(store)));
    let cache = Arc::new(ipam_core::node_cache(
        Arc::clone(&counting) as Arc<dyn KvStore>
    ));
    let ipam = Ipam::new(Arc::clone(&cache) as Arc<dyn KvStore>);
    (ipam, cache, counting)
}

async fn assign(ipam: &Ipam, handle: &str) -> IpAddr {
    let got = ipam
        .auto_assign(&v4(handle, "node-a", 1))
        .await
        .unwrap_or_else(|e| panic!("assign {handle}: {e}"));
    assert_eq!(got.v4.len(), 1, "{handle}");
    got.v4[0].ip
}

/// Node A assigns through its cache, so that a steady assign reaches the store with one commit
/// and no read; then another writer (a CLI, another node) changes each thing A's next decision
/// depends on: an address of A's block taken, an address reserved, A's own handle released, the
/// pool disabled, a handle released. Each time A's answer from its cache is stale, its commit is
/// refused or its outcome needed no write, and A decides again from the store: it never hands
/// out the taken or reserved address, never reports a released address as still held, never
/// allocates from the disabled pool. A steady release through the cache is one commit too.
pub async fn a_node_reading_through_its_cache_never_decides_from_what_another_writer_changed<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, other) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let (node_a, cache, counting) = cached_node(&t.store);
    // A's block is where its name hashes to: addresses are counted from its first.
    let first = assign(&node_a, "h0").await;
    let nth = |n: u32| {
        IpAddr::V4(std::net::Ipv4Addr::from(
            u32::from(match first {
                IpAddr::V4(v4) => v4,
                IpAddr::V6(_) => panic!("an IPv4 pool"),
            }) + n,
        ))
    };
    assert_eq!(assign(&node_a, "h1").await, nth(1));
    counting.take();
    let hits = cache.answered_from_cache();
    assert_eq!(assign(&node_a, "h2").await, nth(2));
    assert_eq!(
        counting.take(),
        RoundTrips {
            reads: 0,
            commits: 1
        },
        "a steady assign through the cache reaches the store once"
    );
    assert_eq!(cache.answered_from_cache(), hits + 1);

    // The next address of A's block taken by another writer.
    other
        .assign_ips(&AssignIpsRequest {
            ips: vec![nth(3)],
            handle: "other".into(),
            host: "node-a".into(),
            attributes: BTreeMap::new(),
            ..Default::default()
        })
        .await
        .expect("another writer takes the next address");
    assert_eq!(assign(&node_a, "h3").await, nth(4));
    assert_eq!(
        counting.take(),
        RoundTrips {
            reads: 1,
            commits: 2
        },
        "the commit decided from the cache is refused, then one read and one commit"
    );

    // The next address reserved.
    other
        .add_reservation(&Reservation {
            name: "r".into(),
            cidrs: vec![IpNet::from(nth(5))],
        })
        .await
        .expect("reserve the next address");
    assert_eq!(assign(&node_a, "h4").await, nth(6));
    assert_eq!(counting.take().commits, 2, "a refused commit, then one");

    // A's own handle released by another writer: A's repeated request for it gets an address
    // of its own, not the one its cache still shows the handle holding.
    assert_eq!(
        other.release_handle("h0").await.expect("release h0"),
        vec![first]
    );
    let mut again = v4("h0", "node-a", 1);
    again.reuse_existing = true;
    let got = node_a.auto_assign(&again).await.expect("h0 again");
    assert!(!got.reused, "reported the released address as still held");
    let held = other
        .get_assignment(got.v4[0].ip)
        .await
        .expect("who")
        .expect("held");
    assert_eq!(held.handle, "h0");

    // The pool disabled, another created.
    other
        .create_pool(&spec("10.1.0.0/24", "second", 26))
        .await
        .expect("second pool");
    other
        .set_pool_disabled("pool", true)
        .await
        .expect("disable");
    let from_second = assign(&node_a, "h5").await;
    assert!(
        net("10.1.0.0/24").contains(&from_second),
        "allocated {from_second} from a disabled pool"
    );

    // A steady release through the cache reaches the store once; a release of a handle another
    // writer already released finds nothing once decided again from the store.
    counting.take();
    let released = node_a
        .release_chosen("h2", "node-a", |held| held.iter().map(|a| a.ip).collect())
        .await
        .expect("release h2");
    assert_eq!(released.released, vec![nth(2)]);
    assert_eq!(
        counting.take(),
        RoundTrips {
            reads: 0,
            commits: 1
        },
        "a steady release through the cache reaches the store once"
    );
    other.release_handle("h1").await.expect("release h1");
    let released = node_a
        .release_chosen("h1", "node-a", |held| held.iter().map(|a| a.ip).collect())
        .await
        .expect("release h1 again");
    assert!(
        released.held.is_empty() && released.released.is_empty(),
        "{released:?}"
    );

    // A handle another writer gave an address: not in A's cache, so taken for absent there;
    // releasing it finds it once decided again from the store.
    let by_other = assign_one(&other, "hx", "node-a").await;
    let released = node_a
        .release_chosen("hx", "node-a", |held| held.iter().map(|a| a.ip).collect())
        .await
        .expect("release hx");
    assert_eq!(released.released, vec![by_other]);

    let mut seen = BTreeMap::new();
    for info in other.list_allocations().await.expect("list") {
        assert!(
            seen.insert(info.ip, info.handle.clone()).is_none(),
            "{} twice",
            info.ip
        );
    }
    assert_eq!(seen.len(), 5, "{seen:?}");
    assert_clean(&other).await;
}

/// Eight hosts, each with four lanes sharing its own cache (as one agent serves a node's
/// concurrent plugin calls), fill a pool too small for each to stay in its own blocks: they
/// borrow from each other, so each one's cache goes stale under the others' writes. Every address
/// is handed out once, and some answers did come from the caches.
pub async fn hosts_assigning_concurrently_through_caches_of_their_own_get_distinct_addresses<
    F: StoreFactory,
>(
    factory: &F,
) {
    const HOSTS: usize = 8;
    const PER_HOST: usize = 60;
    const LANES: usize = 4;
    // 8 blocks of 64: 480 of 512 addresses.
    let (t, other) = ipam_with_pool(factory, "10.0.0.0/23", 26).await;
    let caches: Vec<Arc<CachingStore>> = Vec::new();
    let caches = std::sync::Mutex::new(caches);
    let by_address = assign_concurrently(
        |_| {
            let (ipam, cache, _counting) = cached_node(&t.store);
            caches.lock().expect("caches").push(cache);
            ipam
        },
        HOSTS,
        PER_HOST,
        LANES,
    )
    .await;
    assert_allocations_are(&other, &by_address).await;
    let caches = caches.into_inner().expect("caches");
    let hits: u64 = caches.iter().map(|c| c.answered_from_cache()).sum();
    assert!(
        hits > 0,
        "no answer came from a cache: the cases proved nothing of it"
    );
    assert_clean(&other).await;
}

/// A store that keeps the conditions of every transaction committed through it.
#[derive(Debug)]
struct ConditionsSeen {
    inner: Arc<dyn KvStore>,
    committed: std::sync::Mutex<Vec<Vec<Condition>>>,
}

#[async_trait::async_trait]
impl KvStore for ConditionsSeen {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        let conditions = txn.conditions.clone();
        let revision = self.inner.commit(txn).await?;
        self.committed.lock().expect("seen").push(conditions);
        Ok(revision)
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        self.inner.read_many(reads).await
    }
}

/// With two pools, a steady assign through the node's cache tests the pool generation (which
/// every pool write raises) and neither pool nor the pools' prefix; a pool written since
/// (another writer's) refuses it all the same, and the assign decided again uses the new pool.
pub async fn a_steady_assign_through_the_cache_tests_the_pool_generation_for_every_pool<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, other) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    other
        .create_pool(&spec("10.1.0.0/24", "second", 26))
        .await
        .expect("second pool");
    let seen = Arc::new(ConditionsSeen {
        inner: Arc::clone(&t.store),
        committed: std::sync::Mutex::new(Vec::new()),
    });
    let (node_a, cache, _counting) = cached_node(&(seen.clone() as Arc<dyn KvStore>));
    for handle in ["h0", "h1", "h2"] {
        assign(&node_a, handle).await;
    }
    let hits = cache.answered_from_cache();
    let steady = assign(&node_a, "h3").await;
    assert_eq!(
        cache.answered_from_cache(),
        hits + 1,
        "answered from the cache"
    );
    let last = seen.committed.lock().expect("seen").last().cloned();
    let last = last.expect("a commit");
    let pools = keys::pools_dir();
    assert!(
        last.iter()
            .any(|c| !c.tests_a_prefix() && c.key() == keys::pool_generation()),
        "{last:?}"
    );
    assert!(
        !last.iter().any(|c| c.key().starts_with(&pools)),
        "a pool or their prefix tested: {last:?}"
    );

    // The pool A allocates from disabled by another writer: A's kept pools are stale, its
    // commit is refused by the generation, and it allocates from the other pool.
    let disabled = if net("10.0.0.0/24").contains(&steady) {
        "pool"
    } else {
        "second"
    };
    other
        .set_pool_disabled(disabled, true)
        .await
        .expect("disable");
    let after = assign(&node_a, "h4").await;
    let still_enabled = if disabled == "pool" {
        "10.1.0.0/24"
    } else {
        "10.0.0.0/24"
    };
    assert!(
        net(still_enabled).contains(&after),
        "allocated {after} from the disabled pool {disabled}"
    );
    assert_clean(&other).await;
}

/// Reserves 10.0.0.1 for the network `net` (its reservation handle `net:gateway`).
async fn reserve_gateway(ipam: Ipam) {
    ipam.assign_ips(&AssignIpsRequest {
        ips: vec!["10.0.0.1".parse().expect("ip")],
        handle: "net:gateway".into(),
        host: "node-a".into(),
        ..Default::default()
    })
    .await
    .expect("the gateway reserved");
}

/// The pool generation's count and revision (the test's store holds one).
async fn pool_generation(store: &Arc<dyn KvStore>) -> (u64, Revision) {
    let kv = store
        .get(&keys::pool_generation())
        .await
        .expect("read the generation")
        .expect("a pool generation");
    let count = ipam_core::model::decode(&kv.key, &kv.value).expect("a count");
    (count, kv.revision)
}

/// Every write of something an assignment decides from raises the pool generation, in the
/// write's own transaction: the configuration, an IP reservation added and deleted, a node's
/// labels set, replaced and removed, a namespace's pools set and removed, a network's
/// reservations confirmed and their record dropped. A write that changes nothing raises nothing.
/// (What lets a node's cache take the generation for all of them.)
pub async fn every_write_an_assignment_decides_from_raises_the_pool_generation_with_it<
    F: StoreFactory,
>(
    factory: &F,
) {
    use ipam_core::namespaces::{namespace_key, NamespacePools};
    use ipam_core::nodes::node_key;
    use ipam_core::reservations::reservation_key;

    let (t, ipam) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    // Raised by one, and, for a key the write puts, at that key's revision: the same transaction.
    let raised = |what: &'static str, before: (u64, Revision), put: Option<String>| {
        let store = Arc::clone(&t.store);
        async move {
            let after = pool_generation(&store).await;
            assert_eq!(after.0, before.0 + 1, "{what}: not raised by one");
            assert!(after.1 > before.1, "{what}: {before:?} then {after:?}");
            if let Some(key) = put {
                let written = store
                    .get(&key)
                    .await
                    .expect("read")
                    .unwrap_or_else(|| panic!("{what}: {key} not written"));
                assert_eq!(
                    written.revision, after.1,
                    "{what}: raised in another transaction than the one writing {key}"
                );
            }
            after
        }
    };

    let before = pool_generation(&t.store).await;
    ipam.update_config(|config| config.ip_cooldown_seconds += 1)
        .await
        .expect("config");
    let before = raised("a configuration change", before, Some(keys::config())).await;

    let reservation = Reservation {
        name: "gateways".into(),
        cidrs: vec![net("10.0.0.250/31")],
    };
    ipam.add_reservation(&reservation).await.expect("reserve");
    let before = raised(
        "a reservation added",
        before,
        Some(reservation_key("gateways")),
    )
    .await;
    ipam.delete_reservation("gateways")
        .await
        .expect("unreserve");
    let before = raised("a reservation deleted", before, None).await;

    ipam.set_node_labels("node-a", &[("rack".into(), "r1".into())], &[])
        .await
        .expect("label");
    let before = raised("labels set", before, Some(node_key("node-a"))).await;
    ipam.set_node_labels("node-a", &[("rack".into(), "r1".into())], &[])
        .await
        .expect("label again");
    assert_eq!(
        pool_generation(&t.store).await,
        before,
        "labels set as they were"
    );
    ipam.replace_node_labels("node-a", &[("rack".into(), "r2".into())])
        .await
        .expect("relabel");
    let before = raised("labels replaced", before, Some(node_key("node-a"))).await;
    assert!(ipam.remove_node_labels("node-a").await.expect("unlabel"));
    let before = raised("labels removed", before, None).await;

    let pools = NamespacePools {
        ipv4_pools: vec!["pool".into()],
        ipv6_pools: Vec::new(),
    };
    ipam.set_namespace_pools("team", &pools)
        .await
        .expect("namespace pools");
    let before = raised(
        "a namespace's pools set",
        before,
        Some(namespace_key("team")),
    )
    .await;
    ipam.set_namespace_pools("team", &pools)
        .await
        .expect("the same pools");
    assert_eq!(
        pool_generation(&t.store).await,
        before,
        "a namespace's pools set as they were"
    );
    ipam.set_namespace_pools("team", &NamespacePools::default())
        .await
        .expect("namespace pools removed");
    raised("a namespace's pools removed", before, None).await;

    reserve_gateway(ipam.clone()).await;
    let before = pool_generation(&t.store).await;
    ipam.confirm_reservations("net:gateway")
        .await
        .expect("confirm");
    let before = raised(
        "a network's reservations confirmed",
        before,
        Some(keys::reservations_held("net:gateway")),
    )
    .await;
    ipam.confirm_reservations("net:gateway")
        .await
        .expect("confirm again");
    assert_eq!(
        pool_generation(&t.store).await,
        before,
        "reservations confirmed as they were"
    );
    ipam.release_handle("net:gateway").await.expect("release");
    let before = pool_generation(&t.store).await;
    ipam.confirm_reservations("net:gateway")
        .await
        .expect("the record dropped");
    assert!(t
        .store
        .get(&keys::reservations_held("net:gateway"))
        .await
        .expect("read")
        .is_none());
    raised("a network's confirmation dropped", before, None).await;
}

/// A network's confirmation record is dropped when its reservation handle is gone, but not when
/// the handle is written again between the read that found it gone and the drop (the network set
/// up again meanwhile): the drop is refused, the record stays, and the call is no error.
pub async fn a_confirmation_is_dropped_only_while_its_handle_is_still_gone<F: StoreFactory>(
    factory: &F,
) {
    let (t, _) = ipam_with_pool(factory, "10.0.0.0/24", 26).await;
    let hooked = crate::hooked::HookedStore::new(Arc::clone(&t.store));
    let ipam = Ipam::new(hooked.clone() as Arc<dyn KvStore>);
    reserve_gateway(ipam.clone()).await;
    ipam.confirm_reservations("net:gateway")
        .await
        .expect("confirm");
    ipam.release_handle("net:gateway").await.expect("release");
    let record_key = keys::reservations_held("net:gateway");
    let record = t.store.get(&record_key).await.expect("read");
    assert!(record.is_some(), "a confirmation to drop");

    let again = Ipam::new(Arc::clone(&t.store));
    hooked.before_commit(
        crate::hooked::writes_key(record_key.clone(), false),
        move || reserve_gateway(again),
    );
    ipam.confirm_reservations("net:gateway")
        .await
        .expect("a refused drop is no error");
    assert!(hooked.commit_hook_fired(), "the race was not staged");
    assert_eq!(
        t.store.get(&record_key).await.expect("read"),
        record,
        "dropped although the handle was written again"
    );

    // Gone again, and nothing in between: dropped.
    ipam.release_handle("net:gateway").await.expect("release");
    ipam.confirm_reservations("net:gateway")
        .await
        .expect("drop");
    assert_eq!(t.store.get(&record_key).await.expect("read"), None);
}

/// A store in use: a pool, the configuration, a reservation and node-a's labels written,
/// node-a's agent registered; recorded at format 6 (its upgrade not finalized) when `format_6`.
async fn store_in_use<F: StoreFactory>(factory: &F, format_6: bool) -> (crate::TestStore, Ipam) {
    let t = factory.fresh().await;
    if format_6 {
        t.store
            .put(&keys::store_format(), br#"{"writes":6}"#.to_vec())
            .await
            .expect("record format 6");
    }
    let other = Ipam::new(Arc::clone(&t.store));
    other
        .create_pool(&spec("10.0.0.0/24", "pool", 26))
        .await
        .expect("pool");
    other
        .update_config(|config| config.max_blocks_per_host = 4)
        .await
        .expect("config");
    other
        .add_reservation(&Reservation {
            name: "gateways".into(),
            cidrs: vec![net("10.0.0.250/31")],
        })
        .await
        .expect("reservation");
    other
        .set_node_labels("node-a", &[("zone".into(), "a".into())], &[])
        .await
        .expect("labels");
    ipam_core::dead_nodes::register(t.store.as_ref(), "node-a", "test", 1)
        .await
        .expect("register");
    (t, other)
}

/// Through node-a's cache, node-a's plugin (recording its activity) assigns until an assign is
/// answered from the cache; the conditions of that steady assign's commit.
async fn steady_assign_conditions(store: &Arc<dyn KvStore>) -> Vec<Condition> {
    let seen = Arc::new(ConditionsSeen {
        inner: Arc::clone(store),
        committed: std::sync::Mutex::new(Vec::new()),
    });
    let (node_a, cache, _counting) = cached_node(&(seen.clone() as Arc<dyn KvStore>));
    let node_a = node_a
        .recording_activity("node-a", "test")
        .expect("record activity");
    // As the plugin asks: the pod's namespace may name its pools.
    let assign_in_namespace = |handle: &'static str| {
        let node_a = node_a.clone();
        async move {
            let request = ipam_core::AutoAssignRequest {
                namespace: Some(ipam_core::NamespaceLookup {
                    namespace: "default".into(),
                    v4: true,
                    v6: false,
                }),
                ..v4(handle, "node-a", 1)
            };
            let got = node_a.auto_assign(&request).await.expect("assign");
            assert_eq!(got.v4.len(), 1, "{handle}");
        }
    };
    for handle in ["h0", "h1", "h2"] {
        assign_in_namespace(handle).await;
    }
    let hits = cache.answered_from_cache();
    assign_in_namespace("h3").await;
    assert_eq!(
        cache.answered_from_cache(),
        hits + 1,
        "answered from the cache"
    );
    let last = seen.committed.lock().expect("seen").last().cloned();
    last.expect("a commit")
}

/// Once the store is finalized at the format whose every writer of what an assignment decides
/// from raises the pool generation or the node's generation, a steady assign through the node's
/// cache tests those two generations instead of the configuration, the reservations, the node's
/// labels, the pod's namespace setting, the import marker, and the node's registration, activity
/// record and countdown: its
/// commit tests the format record, the two generations, the node's open blocks (their prefix
/// and the block it writes), the handle and nothing else. In a store still at format 6 the
/// cache keeps testing each of them (an older release's writers do not raise the generations).
/// Another writer's change to any of them moves a generation: the steady assign is refused and
/// decided again (`every_write_an_assignment_decides_from_raises_the_pool_generation_with_it`).
pub async fn a_steady_assign_through_the_cache_tests_the_two_generations_once_finalized<
    F: StoreFactory,
>(
    factory: &F,
) {
    let covered = [
        keys::config(),
        keys::import_in_progress(),
        keys::reservations_dir(),
        keys::nodes_dir(),
        keys::namespaces_dir(),
        keys::agents_dir(),
        keys::activity_dir(),
        keys::countdown_dir(),
    ];
    let tests_a_covered_key = |conditions: &[Condition], prefix: &str| {
        conditions.iter().any(|c| c.key().starts_with(prefix))
    };

    let (t, other) = store_in_use(factory, false).await;
    let conditions = steady_assign_conditions(&t.store).await;
    for prefix in &covered {
        assert!(
            !tests_a_covered_key(&conditions, prefix),
            "finalized: {prefix} tested: {conditions:?}"
        );
    }
    let block = other
        .store()
        .list(&keys::host_open_blocks_dir("node-a"))
        .await
        .expect("list");
    assert_eq!(block.len(), 1, "one block of node-a");
    let mut tested: Vec<(bool, String)> = conditions
        .iter()
        .map(|c| (c.tests_a_prefix(), c.key().to_owned()))
        .collect();
    tested.sort();
    let mut expected = vec![
        (false, keys::store_format()),
        (false, keys::pool_generation()),
        (false, keys::node_generation("node-a")),
        (true, keys::host_open_blocks_dir("node-a")),
        (false, block[0].key.clone()),
        (false, keys::handle("h3")),
    ];
    expected.sort();
    assert_eq!(tested, expected, "{conditions:?}");
    assert_clean(&other).await;

    let (t, other) = store_in_use(factory, true).await;
    let conditions = steady_assign_conditions(&t.store).await;
    for prefix in &covered {
        assert!(
            tests_a_covered_key(&conditions, prefix),
            "format 6: {prefix} not tested: {conditions:?}"
        );
    }
    assert_clean(&other).await;
}
