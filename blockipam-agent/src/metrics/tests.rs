//! Tests of the metrics: the registry's output, the gauges from a store, the endpoint's limits.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ipam_core::{Ipam, KeyValue, KvError, KvStore, Revision, Txn};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

use crate::counters::ReclaimCounters;

use super::gauges::IpamSnapshot;
use super::http::MetricsEndpoint;
use super::{openmetrics_to_prometheus_text, AgentMetrics, ConnectionLimits, NO_AFFINITY_LABEL};
use ipam_core::allocator::{AssignIpsRequest, PoolSpec};
use ipam_core::MemoryStore;

/// Reads what `stream` sends until it closes; `None` when it is still open after `within`.
async fn read_until_closed(stream: &mut tokio::net::TcpStream, within: Duration) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut received = Vec::new();
    let read = tokio::time::timeout(within, stream.read_to_end(&mut received)).await;
    match read {
        Ok(_) => Some(String::from_utf8_lossy(&received).into_owned()),
        Err(_) => None,
    }
}

/// One request (`GET /metrics`: a method and a path) on a new connection: the whole answer.
async fn exchange(address: SocketAddr, request: &str) -> String {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    stream
        .write_all(
            format!("{request} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .expect("send the request");
    read_until_closed(&mut stream, Duration::from_secs(20))
        .await
        .unwrap_or_else(|| panic!("{request} was not answered and closed"))
}

/// One `GET /metrics` on a new connection: the status line and the body.
async fn scrape_once(address: SocketAddr) -> String {
    exchange(address, "GET /metrics").await
}

/// The liveness gauges: this node registered or not, and the node states of the last
/// reclaim pass, each state a labelled sample.
#[tokio::test]
async fn registration_and_node_states_are_exported_as_gauges() {
    let counters = Arc::new(ReclaimCounters::default());
    let metrics = AgentMetrics::new(Arc::clone(&counters), Duration::ZERO);
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let before = metrics.scrape(&Arc::downgrade(&store), false).await;
    for line in [
        "blockipam_agent_node_registered 0\n",
        "# TYPE blockipam_agent_reclaimer_leader gauge\n",
        "blockipam_agent_reclaimer_leader 0\n",
    ] {
        assert!(before.contains(line), "no {line:?} in:\n{before}");
    }
    counters
        .registered
        .store(true, std::sync::atomic::Ordering::Relaxed);
    counters
        .reclaimer_leader
        .store(true, std::sync::atomic::Ordering::Relaxed);
    counters.record_pass([3, 1, 2, 0, 4, 1]);
    let after = metrics.scrape(&Arc::downgrade(&store), false).await;
    for line in [
        "# TYPE blockipam_agent_node_registered gauge\n",
        "blockipam_agent_node_registered 1\n",
        "blockipam_agent_reclaimer_leader 1\n",
        "# TYPE blockipam_agent_nodes gauge\n",
        "blockipam_agent_nodes{state=\"alive\"} 3\n",
        "blockipam_agent_nodes{state=\"active\"} 1\n",
        "blockipam_agent_nodes{state=\"missing\"} 2\n",
        "blockipam_agent_nodes{state=\"dead\"} 0\n",
        "blockipam_agent_nodes{state=\"reclaimed\"} 4\n",
        "blockipam_agent_nodes{state=\"unreadable\"} 1\n",
    ] {
        assert!(after.contains(line), "no {line:?} in:\n{after}");
    }
}

/// A request counts in flight from its guard's creation until the guard is dropped, however many
/// overlap; the gauge is a gauge in both text formats.
#[tokio::test]
async fn requests_count_in_flight_until_their_guard_is_dropped() {
    let metrics = AgentMetrics::new(Arc::new(ReclaimCounters::default()), Duration::ZERO);
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let in_flight = |text: &str| -> String {
        text.lines()
            .find(|line| line.starts_with("blockipam_agent_requests_in_flight "))
            .unwrap_or_else(|| panic!("no in-flight sample in:\n{text}"))
            .to_owned()
    };
    let idle = metrics.scrape(&Arc::downgrade(&store), false).await;
    assert!(
        idle.contains("# TYPE blockipam_agent_requests_in_flight gauge\n"),
        "{idle}"
    );
    assert_eq!(in_flight(&idle), "blockipam_agent_requests_in_flight 0");
    let first = metrics.request_in_flight();
    let second = metrics.request_in_flight();
    let busy = metrics.scrape(&Arc::downgrade(&store), true).await;
    assert!(
        busy.contains("# TYPE blockipam_agent_requests_in_flight gauge\n"),
        "{busy}"
    );
    assert_eq!(in_flight(&busy), "blockipam_agent_requests_in_flight 2");
    drop(first);
    let one = metrics.scrape(&Arc::downgrade(&store), false).await;
    assert_eq!(in_flight(&one), "blockipam_agent_requests_in_flight 1");
    drop(second);
    let none = metrics.scrape(&Arc::downgrade(&store), false).await;
    assert_eq!(in_flight(&none), "blockipam_agent_requests_in_flight 0");
}

fn endpoint_with(limits: ConnectionLimits) -> MetricsEndpoint {
    let metrics = Arc::new(AgentMetrics::new(
        Arc::new(ReclaimCounters::default()),
        Duration::ZERO,
    ));
    MetricsEndpoint::bind("127.0.0.1:0".parse().expect("address"), metrics)
        .expect("bind")
        .with_limits(limits)
}

/// Clients that connect and send nothing are closed once the header bound has passed (here
/// shortened to 2 s; waited for up to 5 s), while another scrape is answered beside them; beyond
/// the cap a connection is closed at once, before any bound could have closed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_send_nothing_are_closed_within_the_header_bound_while_scrapes_go_on() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let endpoint = endpoint_with(ConnectionLimits {
        header_read: Duration::from_secs(2),
        lifetime: Duration::from_secs(30),
        max_connections: 2,
    });
    let address = endpoint.local_addr().expect("address");
    let server = endpoint.spawn(Arc::new(super::Health::serving(Arc::downgrade(&store))));

    let mut first = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    let scraped = scrape_once(address).await;
    assert!(
        scraped.starts_with("HTTP/1.1 200") && scraped.contains("blockipam_agent"),
        "a scrape beside a silent client: {scraped}"
    );
    let mut second = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut over = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    assert_eq!(
        read_until_closed(&mut over, Duration::from_secs(1))
            .await
            .as_deref(),
        Some(""),
        "a connection beyond the cap was not closed at once"
    );
    for (name, silent) in [("first", &mut first), ("second", &mut second)] {
        assert_eq!(
            read_until_closed(silent, Duration::from_secs(5))
                .await
                .as_deref(),
            Some(""),
            "the {name} client that sent nothing kept its connection"
        );
    }
    let scraped = scrape_once(address).await;
    assert!(scraped.starts_with("HTTP/1.1 200"), "{scraped}");
    server.stop().await;
}

/// A store whose reads never answer.
#[derive(Debug)]
struct HangingStore;

#[async_trait]
impl KvStore for HangingStore {
    async fn get(&self, _key: &str) -> Result<Option<KeyValue>, KvError> {
        std::future::pending().await
    }
    async fn list(&self, _prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        std::future::pending().await
    }
    async fn commit(&self, _txn: Txn) -> Result<Revision, KvError> {
        std::future::pending().await
    }
}

/// A connection is closed at the end of its lifetime whatever it is waiting for (here the
/// gauges' computation, which a hanging store stretches to its own 8 s bound; a client that
/// never reads its answer is cut the same way): the lifetime shortened to 1 s, the connection
/// is closed, unanswered, within 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_is_closed_at_its_lifetime_whatever_it_waits_for() {
    use tokio::io::AsyncWriteExt;
    let store: Arc<dyn KvStore> = Arc::new(HangingStore);
    let endpoint = endpoint_with(ConnectionLimits {
        header_read: Duration::from_secs(10),
        lifetime: Duration::from_secs(1),
        max_connections: 2,
    });
    let address = endpoint.local_addr().expect("address");
    let server = endpoint.spawn(Arc::new(super::Health::serving(Arc::downgrade(&store))));
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\n\r\n")
        .await
        .expect("send the request");
    assert_eq!(
        read_until_closed(&mut stream, Duration::from_secs(5))
            .await
            .as_deref(),
        Some(""),
        "the connection outlived its lifetime"
    );
    server.stop().await;
}

#[test]
fn counters_get_their_total_suffix_in_the_classic_text_format_and_eof_goes() {
    let mut registry = Registry::default();
    let counter = Counter::<u64>::default();
    counter.inc_by(3);
    registry.register("things_done", "Things done", counter);
    let gauge = prometheus_client::metrics::gauge::Gauge::<i64>::default();
    gauge.set(7);
    registry.register("things_open", "Things open", gauge);
    let mut openmetrics = String::new();
    prometheus_client::encoding::text::encode(&mut openmetrics, &registry).expect("encode");
    assert!(
        openmetrics.contains("# TYPE things_done counter\n"),
        "{openmetrics}"
    );
    assert_eq!(
        openmetrics_to_prometheus_text(&openmetrics),
        "# HELP things_done_total Things done.\n\
         # TYPE things_done_total counter\n\
         things_done_total 3\n\
         # HELP things_open Things open.\n\
         # TYPE things_open gauge\n\
         things_open 7\n"
    );
}

#[tokio::test]
async fn snapshot_counts_like_calico_by_pool_and_node_with_borrowed_and_unaffine_blocks() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = Ipam::new(Arc::clone(&store));
    let pool = |cidr: &str, name: &str, block_size: u8| PoolSpec {
        cidr: cidr.parse().expect("cidr"),
        name: Some(name.to_owned()),
        block_size: Some(block_size),
        disabled: false,
    };
    ipam.create_pool(&pool("10.1.0.0/24", "blue", 26))
        .await
        .expect("pool blue");
    ipam.create_pool(&pool("fd00::/64", "six", 122))
        .await
        .expect("pool six");
    let assign = |ip: &str, handle: &str, host: &str| AssignIpsRequest {
        ips: vec![ip.parse().expect("ip")],
        handle: handle.to_owned(),
        host: host.to_owned(),
        ..AssignIpsRequest::default()
    };
    // node-a gets 10.1.0.0/26 by its first address; node-b borrows from it.
    for request in [
        assign("10.1.0.1", "h1", "node-a"),
        assign("10.1.0.2", "h2", "node-a"),
        assign("10.1.0.3", "h3", "node-b"),
        assign("10.1.0.65", "h4", "node-c"),
    ] {
        ipam.assign_ips(&request).await.expect("assign");
    }
    // node-c lets go of its block while it still holds an address there.
    ipam.release_affinity("node-c", "10.1.0.64/26".parse().expect("block"))
        .await
        .expect("release node-c's affinity");
    let snapshot = IpamSnapshot::compute(Arc::clone(&store))
        .await
        .expect("compute");
    let key = |pool: &str, node: &str| (pool.to_owned(), node.to_owned());
    assert_eq!(snapshot.pool_sizes.get("blue"), Some(&256.0));
    assert_eq!(
        snapshot.pool_sizes.get("six"),
        Some(&18_446_744_073_709_551_616.0)
    );
    assert_eq!(
        snapshot.blocks,
        BTreeMap::from([
            (key("blue", "node-a"), 1),
            (key("blue", NO_AFFINITY_LABEL), 1)
        ]),
        "a block belongs to the node that first took an address in it"
    );
    assert_eq!(snapshot.in_use.get(&key("blue", "node-a")), Some(&2));
    assert_eq!(snapshot.in_use.get(&key("blue", "node-b")), Some(&1));
    assert_eq!(snapshot.borrowed.get(&key("blue", "node-a")), Some(&0));
    assert_eq!(
        snapshot.borrowed.get(&key("blue", "node-b")),
        Some(&1),
        "{snapshot:#?}"
    );
    // An address in a block with no affinity is borrowed too (Calico's rule).
    assert_eq!(snapshot.in_use.get(&key("blue", "node-c")), Some(&1));
    assert_eq!(snapshot.borrowed.get(&key("blue", "node-c")), Some(&1));
    // Every node seen gets an explicit zero in the other pool.
    assert_eq!(snapshot.in_use.get(&key("six", "node-a")), Some(&0));
    assert_eq!(snapshot.borrowed.get(&key("six", "node-b")), Some(&0));
}

/// Equality of the metrics is identity (what a configuration holding them compares): the same
/// metrics are equal, two made alike are not.
#[test]
fn metrics_are_equal_only_to_themselves() {
    let counters = Arc::new(ReclaimCounters::default());
    let one = Arc::new(AgentMetrics::new(Arc::clone(&counters), Duration::ZERO));
    let same = Arc::clone(&one);
    let alike = AgentMetrics::new(counters, Duration::ZERO);
    assert!(*one == *same);
    assert!(*one != alike);
}

/// The leak collection's counters and last-look gauges are each a sample of a scrape, with the
/// values the collection recorded; its releases also by pool and node, as Calico's garbage
/// collector counts its reclamations.
#[tokio::test]
async fn the_leak_collections_counters_and_gauges_are_scraped() {
    use std::sync::atomic::Ordering::Relaxed;
    let leaks = Arc::new(crate::counters::LeakCounters::default());
    leaks.runtime_answering.store(true, Relaxed);
    leaks.record_released("node-a", ["pool-one", "no_ippool"]);
    leaks.record_released("node-a", ["pool-one"]);
    for (counter, value) in [
        (&leaks.reasserted, 3),
        (&leaks.looks, 5),
        (&leaks.unanswered_looks, 7),
        (&leaks.missing_allocations, 11),
        (&leaks.duplicate_addresses, 13),
        (&leaks.unrecorded_addresses, 17),
    ] {
        counter.store(value, Relaxed);
    }
    let metrics = AgentMetrics::new(Arc::new(ReclaimCounters::default()), Duration::ZERO)
        .with_leak_counters(leaks);
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let text = metrics.scrape(&Arc::downgrade(&store), false).await;
    for sample in [
        "blockipam_agent_leaks_released_total 3\n",
        "# TYPE ipam_allocations_gc_reclamations_total counter\n",
        "ipam_allocations_gc_reclamations_total{ippool=\"no_ippool\",node=\"node-a\"} 1\n",
        "ipam_allocations_gc_reclamations_total{ippool=\"pool-one\",node=\"node-a\"} 2\n",
        "blockipam_agent_addresses_reasserted_total 3\n",
        "blockipam_agent_runtime_looks_total 5\n",
        "blockipam_agent_runtime_looks_unanswered_total 7\n",
        "blockipam_agent_runtime_answering 1\n",
        "ipam_leaked_allocations 11\n",
        "ipam_duplicate_addresses 13\n",
        "ipam_unrecorded_live_addresses 17\n",
    ] {
        assert!(text.contains(sample), "{sample:?} in\n{text}");
    }
}

/// Readiness follows the agent's phase: what it is doing while it starts, the store's answer
/// while it serves, "shutting down" once it stops (and the metrics' store is then gone).
#[tokio::test]
async fn readiness_follows_the_agents_phase() {
    use super::health::Health;
    let health = Health::starting("opening the store");
    assert_eq!(
        health.readiness().await,
        Err("not ready: opening the store".to_owned())
    );
    health.set_starting("binding the socket");
    assert_eq!(
        health.readiness().await,
        Err("not ready: binding the socket".to_owned())
    );
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    health.set_serving(Arc::downgrade(&store), Arc::downgrade(&store));
    assert_eq!(health.readiness().await, Ok(()));
    assert!(health.metrics_store().upgrade().is_some());
    health.set_stopping();
    assert_eq!(
        health.readiness().await,
        Err("not ready: shutting down".to_owned())
    );
    assert!(health.metrics_store().upgrade().is_none());
}

/// Once `stop` returns, the endpoint's port accepts no connection; a server dropped without
/// `stop` (an error path of the agent) closes its port too.
#[tokio::test]
async fn a_stopped_or_dropped_endpoint_accepts_no_connection() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let health = || Arc::new(super::Health::serving(Arc::downgrade(&store)));
    let endpoint = endpoint_with(ConnectionLimits::default());
    let address = endpoint.local_addr().expect("address");
    let server = endpoint.spawn(health());
    let scraped = scrape_once(address).await;
    assert!(scraped.starts_with("HTTP/1.1 200"), "{scraped}");
    server.stop().await;
    // No await between the stop and the connection: what `stop` left open would still be open.
    assert!(
        std::net::TcpStream::connect(address).is_err(),
        "the stopped endpoint accepted a connection"
    );

    let endpoint = endpoint_with(ConnectionLimits::default());
    let address = endpoint.local_addr().expect("address");
    drop(endpoint.spawn(health()));
    let closed = async {
        while std::net::TcpStream::connect(address).is_ok() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    assert!(
        tokio::time::timeout(Duration::from_secs(5), closed)
            .await
            .is_ok(),
        "the dropped endpoint kept its port open for 5 s"
    );
}

/// A store that counts the reads it answers.
#[derive(Debug, Default)]
struct CountingStore {
    inner: MemoryStore,
    gets: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl KvStore for CountingStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.inner.commit(txn).await
    }
}

/// Probes in quick succession share one store read (its outcome answers for a second): ten
/// back-to-back probes cost fewer than ten reads however slowly the machine runs them, unless
/// each took a second.
#[tokio::test]
async fn readiness_probes_in_quick_succession_share_a_store_read() {
    let counting = Arc::new(CountingStore::default());
    let store: Arc<dyn KvStore> = counting.clone();
    let health = super::Health::serving(Arc::downgrade(&store));
    for _ in 0..10 {
        assert_eq!(health.readiness().await, Ok(()));
    }
    let reads = counting.gets.load(std::sync::atomic::Ordering::SeqCst);
    assert!((1..10).contains(&reads), "{reads} reads for 10 probes");
}

/// GET and HEAD are served; any other method is answered 405, an unknown path 404.
#[tokio::test]
async fn only_get_and_head_are_served_at_the_known_paths() {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let endpoint = endpoint_with(ConnectionLimits::default());
    let address = endpoint.local_addr().expect("address");
    let server = endpoint.spawn(Arc::new(super::Health::serving(Arc::downgrade(&store))));
    for (request, status) in [
        ("GET /healthz", "200"),
        ("HEAD /healthz", "200"),
        ("HEAD /metrics", "200"),
        ("POST /healthz", "405"),
        ("DELETE /metrics", "405"),
        ("GET /nowhere", "404"),
    ] {
        let answer = exchange(address, request).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status} ")),
            "{request}: {answer}"
        );
    }
    server.stop().await;
}
