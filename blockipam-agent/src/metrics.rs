//! The agent's Prometheus metrics (`--metrics-listen`): Calico's IPAM gauges computed from the
//! store at scrape time (cached), the dead-node reclaim counters, and the agent's own request,
//! store round-trip and connection counters, served over HTTP at `GET /metrics`.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ACCEPT, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use ipam_core::allocator::ATTR_NODE;
use ipam_core::{Ipam, IpamError, KeyValue, KvError, KvStore, Read, ReadResult, Revision, Txn};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabel, EncodeLabelSet, EncodeMetric, LabelSetEncoder,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::{watch, Mutex};
use tokio::task::JoinSet;

use crate::counters::{ReclaimCounters, NODE_STATES};
use crate::AgentError;

/// `Content-Type` of the classic Prometheus text format, served by default.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// `Content-Type` of OpenMetrics text, served to clients that ask for it (Prometheus does).
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Pool label of blocks and addresses that lie in no pool (Calico's label).
pub const NO_POOL_LABEL: &str = "no_ippool";
/// Node label of blocks with no affinity (Calico's label).
pub const NO_AFFINITY_LABEL: &str = "no_affinity";
/// Node label of addresses recorded without a node (Calico's label).
pub const UNKNOWN_NODE_LABEL: &str = "unknown_node";
/// Longest one computation of the IPAM gauges may take before the scrape reports the store down.
const IPAM_COMPUTATION_TIMEOUT: Duration = Duration::from_secs(8);
/// Bounds on the metrics endpoint's connections, so that clients that stall (connect and send
/// nothing, never finish a request, never read the answer) cannot hold the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Longest wait for a request's headers, from the moment the connection is accepted.
    pub header_read: Duration,
    /// Longest life of a connection: its one request read, answered and the answer written (the
    /// gauges' computation is bounded by 8 s within it). Beyond it the connection is closed.
    pub lifetime: Duration,
    /// Connections served at once; further ones are closed at once.
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read: Duration::from_secs(10),
            lifetime: Duration::from_secs(30),
            max_connections: 32,
        }
    }
}
/// Bucket upper bounds of the request latency histogram, in seconds (50 µs to 10 s).
const LATENCY_BUCKETS: [f64; 17] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];

/// Labels of a request latency sample.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// Labels of a store round trip.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StoreRequestLabels {
    kind: &'static str,
    outcome: &'static str,
}

/// Labels of an accepted or refused connection.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// What happened to a connection on the agent's socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionOutcome {
    /// The peer is root or an allowed uid.
    Accepted,
    /// The peer's uid is not allowed.
    Refused,
    /// The peer's credentials could not be read; the connection was closed.
    CredentialsUnreadable,
}

impl ConnectionOutcome {
    fn label(self) -> &'static str {
        match self {
            ConnectionOutcome::Accepted => "accepted",
            ConnectionOutcome::Refused => "refused",
            ConnectionOutcome::CredentialsUnreadable => "credentials_unreadable",
        }
    }
}

/// The agent's metrics: what the server and the store wrapper record as they go, and what a scrape
/// computes from the store. Shared behind an `Arc`; equality is identity.
#[derive(Debug)]
pub struct AgentMetrics {
    registry: Registry,
    request_duration: Family<KindLabels, Histogram, fn() -> Histogram>,
    store_requests: Family<StoreRequestLabels, Counter>,
    connections: Family<OutcomeLabels, Counter>,
    ipam: Arc<IpamState>,
}

impl PartialEq for AgentMetrics {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for AgentMetrics {}

impl AgentMetrics {
    /// Metrics whose dead-node reclaim counters are read from `reclaim`, and whose IPAM gauges are
    /// computed at most once per `cache_for`.
    pub fn new(reclaim: Arc<ReclaimCounters>, cache_for: Duration) -> Self {
        let mut registry = Registry::default();
        let request_duration: Family<KindLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "blockipam_agent_request_duration_seconds",
            "Time the agent took to answer one request of a client (plugin, blockipamctl) on its \
             socket, by request kind, store round trip included",
            request_duration.clone(),
        );
        let store_requests = Family::<StoreRequestLabels, Counter>::default();
        registry.register(
            "blockipam_agent_store_requests",
            "Round trips from the agent to its store, by kind (get, list, read_many, commit) and \
             outcome (ok, conflict, unavailable, indeterminate, corrupt, invalid_argument, error)",
            store_requests.clone(),
        );
        let connections = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "blockipam_agent_connections",
            "Connections to the agent's socket, by outcome of the peer credential check \
             (accepted, refused, credentials_unreadable)",
            connections.clone(),
        );
        let ipam = Arc::new(IpamState {
            cache_for,
            refresh: Mutex::new(RefreshState::default()),
            published: RwLock::new(Published::default()),
        });
        registry.register_collector(Box::new(IpamCollector {
            state: Arc::clone(&ipam),
        }));
        registry.register_collector(Box::new(ReclaimCollector { counters: reclaim }));
        AgentMetrics {
            registry,
            request_duration,
            store_requests,
            connections,
            ipam,
        }
    }

    /// Records how long a client request of `kind` took to answer.
    pub fn observe_request(&self, kind: &'static str, took: Duration) {
        self.request_duration
            .get_or_create(&KindLabels { kind })
            .observe(took.as_secs_f64());
    }

    /// Counts one connection and how its peer credential check ended.
    pub fn count_connection(&self, outcome: ConnectionOutcome) {
        self.connections
            .get_or_create(&OutcomeLabels {
                outcome: outcome.label(),
            })
            .inc();
    }

    fn count_store_request<T>(&self, kind: &'static str, result: &Result<T, KvError>) {
        let outcome = match result {
            Ok(_) => "ok",
            Err(KvError::Conflict { .. }) => "conflict",
            Err(KvError::Unavailable { .. }) => "unavailable",
            Err(KvError::Indeterminate { .. }) => "indeterminate",
            Err(KvError::Corrupt { .. }) => "corrupt",
            Err(KvError::InvalidArgument { .. }) => "invalid_argument",
            Err(_) => "error",
        };
        self.store_requests
            .get_or_create(&StoreRequestLabels { kind, outcome })
            .inc();
    }

    /// Wraps `store` so that every round trip to it (for clients, scrapes and the agent's own
    /// work) is counted in `blockipam_agent_store_requests_total`.
    pub fn instrument(self: &Arc<Self>, store: Arc<dyn KvStore>) -> Arc<dyn KvStore> {
        Arc::new(InstrumentedStore {
            inner: store,
            metrics: Arc::clone(self),
        })
    }

    /// Brings the IPAM gauges up to date (at most once per cache period; concurrent scrapes share
    /// one computation), then encodes every metric. `openmetrics` selects OpenMetrics text; the
    /// classic Prometheus text format (0.0.4) otherwise.
    pub async fn scrape(&self, store: &Weak<dyn KvStore>, openmetrics: bool) -> String {
        self.ipam.refresh(store).await;
        let mut text = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            // Only a failing `fmt::Write` into a String could do this: answer what was written.
            tracing::warn!("encoding the metrics failed: {e}");
        }
        if openmetrics {
            text
        } else {
            openmetrics_to_prometheus_text(&text)
        }
    }
}

/// Rewrites OpenMetrics text into the classic Prometheus text format (0.0.4): a counter family
/// `x` becomes `x_total` in its `# HELP` and `# TYPE` lines (its samples already are `x_total`),
/// and the `# UNIT` and `# EOF` lines, which that format does not have, are dropped.
pub fn openmetrics_to_prometheus_text(openmetrics: &str) -> String {
    let counters: BTreeSet<&str> = openmetrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut text = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let rewritten = ["# HELP ", "# TYPE "].iter().find_map(|marker| {
            let rest = line.strip_prefix(marker)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters
                .contains(name)
                .then(|| format!("{marker}{name}_total {tail}"))
        });
        match rewritten {
            Some(line) => text.push_str(line.trim_end()),
            None => text.push_str(line),
        }
        text.push('\n');
    }
    text
}

// ---------------------------------------------------------------------------------------------
// The store wrapper
// ---------------------------------------------------------------------------------------------

/// A store that counts each round trip, by kind and outcome, into [`AgentMetrics`].
#[derive(Debug)]
struct InstrumentedStore {
    inner: Arc<dyn KvStore>,
    metrics: Arc<AgentMetrics>,
}

#[async_trait]
impl KvStore for InstrumentedStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        let result = self.inner.get(key).await;
        self.metrics.count_store_request("get", &result);
        result
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        let result = self.inner.list(prefix).await;
        self.metrics.count_store_request("list", &result);
        result
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        let result = self.inner.commit(txn).await;
        self.metrics.count_store_request("commit", &result);
        result
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        let result = self.inner.read_many(reads).await;
        self.metrics.count_store_request("read_many", &result);
        result
    }
}

// ---------------------------------------------------------------------------------------------
// The IPAM gauges
// ---------------------------------------------------------------------------------------------

/// The IPAM gauges at one moment, computed from the store.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IpamSnapshot {
    /// Addresses each pool spans, by pool name.
    pub pool_sizes: BTreeMap<String, f64>,
    /// Allocated addresses, by (pool, node recorded with the address).
    pub in_use: BTreeMap<(String, String), u64>,
    /// Allocated addresses of a block affine to another node (or to none), by (pool, node).
    pub borrowed: BTreeMap<(String, String), u64>,
    /// Blocks, by (pool, affine node).
    pub blocks: BTreeMap<(String, String), u64>,
}

impl IpamSnapshot {
    /// Reads the store (one batched read of pools and blocks, one listing of blocks) and counts
    /// as Calico's kube-controllers do: blocks by affine node (`no_affinity` for none), addresses
    /// by the node recorded with them (`unknown_node` for none), borrowed when that node is not
    /// the block's; things outside every pool under `no_ippool`. Every node seen anywhere gets
    /// an explicit zero in each pool's in-use and borrowed gauges.
    ///
    /// # Errors
    /// Store failures and corrupt objects, as the allocator reports them.
    pub async fn compute(store: Arc<dyn KvStore>) -> Result<Self, IpamError> {
        let ipam = Ipam::new(store);
        let usage = ipam.utilization().await?;
        let allocations = ipam.list_allocations().await?;
        let mut snapshot = IpamSnapshot::default();
        let mut pool_of_block: BTreeMap<String, String> = BTreeMap::new();
        let mut nodes: BTreeSet<String> = BTreeSet::new();
        for pool in &usage.pools {
            // An IPv6 pool may span more than 2^64 addresses: a gauge is a float anyway.
            let size = pool.capacity as f64;
            snapshot.pool_sizes.insert(pool.pool.name.clone(), size);
            for block in &pool.blocks {
                pool_of_block.insert(block.cidr.to_string(), pool.pool.name.clone());
            }
        }
        let all_blocks = usage
            .pools
            .iter()
            .flat_map(|p| p.blocks.iter())
            .chain(usage.orphan_blocks.iter());
        for block in all_blocks {
            let pool = pool_of_block
                .get(&block.cidr.to_string())
                .cloned()
                .unwrap_or_else(|| NO_POOL_LABEL.to_owned());
            let node = match &block.host {
                Some(host) => {
                    nodes.insert(host.clone());
                    host.clone()
                }
                None => NO_AFFINITY_LABEL.to_owned(),
            };
            *snapshot.blocks.entry((pool, node)).or_default() += 1;
        }
        for allocation in &allocations {
            let pool = pool_of_block
                .get(&allocation.block.to_string())
                .cloned()
                .unwrap_or_else(|| NO_POOL_LABEL.to_owned());
            let node = allocation.attributes.get(ATTR_NODE).cloned();
            if let Some(node) = &node {
                nodes.insert(node.clone());
                if allocation.block_host.as_ref() != Some(node) {
                    *snapshot
                        .borrowed
                        .entry((pool.clone(), node.clone()))
                        .or_default() += 1;
                }
            }
            let node = node.unwrap_or_else(|| UNKNOWN_NODE_LABEL.to_owned());
            *snapshot.in_use.entry((pool, node)).or_default() += 1;
        }
        for pool in snapshot.pool_sizes.keys() {
            for node in &nodes {
                let key = (pool.clone(), node.clone());
                snapshot.in_use.entry(key.clone()).or_default();
                snapshot.borrowed.entry(key).or_default();
            }
        }
        Ok(snapshot)
    }
}

/// What the collector encodes: the last snapshot computed and whether the last attempt worked.
#[derive(Debug, Default)]
struct Published {
    snapshot: Option<Arc<IpamSnapshot>>,
    store_up: bool,
    /// Unix time of the last successful computation.
    last_success_unix_seconds: Option<f64>,
}

#[derive(Debug, Default)]
struct RefreshState {
    last_attempt: Option<Instant>,
}

#[derive(Debug)]
struct IpamState {
    cache_for: Duration,
    refresh: Mutex<RefreshState>,
    published: RwLock<Published>,
}

impl IpamState {
    async fn refresh(&self, store: &Weak<dyn KvStore>) {
        let mut refresh = self.refresh.lock().await;
        if refresh
            .last_attempt
            .is_some_and(|at| at.elapsed() < self.cache_for)
        {
            return;
        }
        refresh.last_attempt = Some(Instant::now());
        let outcome = match store.upgrade() {
            None => Err("the store is closed (the agent is stopping)".to_owned()),
            Some(store) => {
                match tokio::time::timeout(IPAM_COMPUTATION_TIMEOUT, IpamSnapshot::compute(store))
                    .await
                {
                    Ok(Ok(snapshot)) => Ok(snapshot),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!(
                        "reading the pools and blocks took longer than {IPAM_COMPUTATION_TIMEOUT:?}"
                    )),
                }
            }
        };
        let mut published = self
            .published
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        match outcome {
            Ok(snapshot) => {
                published.snapshot = Some(Arc::new(snapshot));
                published.store_up = true;
                published.last_success_unix_seconds = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .ok()
                    .map(|d| d.as_secs_f64());
            }
            Err(message) => {
                if published.store_up || published.snapshot.is_none() {
                    tracing::warn!(
                        "metrics: cannot compute the IPAM gauges, keeping the last values: {message}"
                    );
                }
                published.store_up = false;
            }
        }
    }
}

/// Encodes the IPAM gauges from the last snapshot, and the store's health.
#[derive(Debug)]
struct IpamCollector {
    state: Arc<IpamState>,
}

/// A pool label alone, or a pool and a node.
#[derive(Debug)]
struct PoolNode<'a> {
    pool: &'a str,
    node: Option<&'a str>,
}

impl EncodeLabelSet for PoolNode<'_> {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabel::encode(&("ippool", self.pool), encoder.encode_label())?;
        if let Some(node) = self.node {
            EncodeLabel::encode(&("node", node), encoder.encode_label())?;
        }
        Ok(())
    }
}

fn encode_gauge_family<'a, N>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: impl IntoIterator<Item = (PoolNode<'a>, N)>,
) -> Result<(), std::fmt::Error>
where
    ConstGauge<N>: EncodeMetric,
{
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in values {
        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for IpamCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let published = self
            .state
            .published
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        let up = ConstGauge::new(i64::from(published.store_up));
        up.encode(encoder.encode_descriptor(
            "blockipam_agent_store_up",
            "1 when the last computation of the ipam_* gauges read the store, 0 when it failed \
             (the ipam_* gauges then keep their last values)",
            None,
            up.metric_type(),
        )?)?;
        if let Some(seconds) = published.last_success_unix_seconds {
            let gauge = ConstGauge::new(seconds);
            gauge.encode(encoder.encode_descriptor(
                "blockipam_agent_ipam_last_success_timestamp_seconds",
                "Unix time of the last successful computation of the ipam_* gauges",
                None,
                gauge.metric_type(),
            )?)?;
        }
        let Some(snapshot) = &published.snapshot else {
            return Ok(());
        };
        encode_gauge_family(
            &mut encoder,
            "ipam_ippool_size",
            "Total number of addresses in the IP pool",
            snapshot.pool_sizes.iter().map(|(pool, size)| {
                (
                    PoolNode {
                        pool: pool.as_str(),
                        node: None,
                    },
                    *size,
                )
            }),
        )?;
        encode_gauge_family(
            &mut encoder,
            "ipam_allocations_in_use",
            "Addresses currently allocated, by pool and by the node recorded with the address",
            snapshot
                .in_use
                .iter()
                .map(|(key, count)| (pool_node(key), saturating_i64(*count))),
        )?;
        encode_gauge_family(
            &mut encoder,
            "ipam_allocations_borrowed",
            "Addresses currently allocated to a node from a block affine to another node (or to \
             none), by pool and node",
            snapshot
                .borrowed
                .iter()
                .map(|(key, count)| (pool_node(key), saturating_i64(*count))),
        )?;
        encode_gauge_family(
            &mut encoder,
            "ipam_blocks",
            "Blocks currently allocated for the IP pool, by affine node",
            snapshot
                .blocks
                .iter()
                .map(|(key, count)| (pool_node(key), saturating_i64(*count))),
        )?;
        Ok(())
    }
}

fn pool_node((pool, node): &(String, String)) -> PoolNode<'_> {
    PoolNode {
        pool: pool.as_str(),
        node: Some(node.as_str()),
    }
}

fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Encodes the dead-node reclaim counters kept by the reclaimer.
#[derive(Debug)]
struct ReclaimCollector {
    counters: Arc<ReclaimCounters>,
}

impl Collector for ReclaimCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (nodes, addresses, blocks) = self.counters.snapshot();
        for (name, help, value) in [
            (
                "ipam_allocations_gc_reclamations",
                "Addresses released by this agent's dead-node reclaim",
                addresses,
            ),
            (
                "blockipam_agent_dead_nodes_reclaimed",
                "Dead nodes whose blocks and addresses this agent released",
                nodes,
            ),
            (
                "blockipam_agent_dead_node_blocks_released",
                "Blocks whose affinity this agent released (deleted when empty) for dead nodes",
                blocks,
            ),
        ] {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(
                name,
                help,
                None,
                counter.metric_type(),
            )?)?;
        }
        let registered = ConstGauge::new(i64::from(
            self.counters
                .registered
                .load(std::sync::atomic::Ordering::Relaxed),
        ));
        registered.encode(encoder.encode_descriptor(
            "blockipam_agent_node_registered",
            "1 while this agent's node is registered and its liveness key on a lease (etcd)",
            None,
            registered.metric_type(),
        )?)?;
        let mut family = encoder.encode_descriptor(
            "blockipam_agent_nodes",
            "Registered nodes by state at this agent's last reclaim pass (reclaimer leader only)",
            None,
            MetricType::Gauge,
        )?;
        for (state, count) in NODE_STATES.iter().zip(self.counters.nodes_by_state()) {
            let labels = [("state", *state)];
            ConstGauge::new(saturating_i64(count)).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The HTTP endpoint
// ---------------------------------------------------------------------------------------------

/// The metrics listener, bound at start-up so that a bad address stops the agent before it opens
/// its store.
#[derive(Debug)]
pub struct MetricsEndpoint {
    listener: TcpListener,
    metrics: Arc<AgentMetrics>,
    limits: ConnectionLimits,
}

impl MetricsEndpoint {
    /// The endpoint `--metrics-listen` asks for, bound, or `None` when the flag is absent.
    ///
    /// # Errors
    /// [`AgentError`] for a bad `--metrics-cache-seconds` or an address that cannot be bound.
    pub fn from_args(
        args: &crate::AgentArgs,
        reclaim: Arc<ReclaimCounters>,
    ) -> Result<Option<Self>, AgentError> {
        let cache_for = args.metrics_cache()?;
        let Some(address) = args.metrics_listen else {
            tracing::info!("metrics endpoint off (no --metrics-listen)");
            return Ok(None);
        };
        let endpoint = Self::bind(address, Arc::new(AgentMetrics::new(reclaim, cache_for)))?;
        tracing::info!(
            "metrics endpoint listening on http://{}/metrics",
            endpoint.local_addr()?
        );
        Ok(Some(endpoint))
    }

    /// Binds `address` for `metrics`.
    ///
    /// # Errors
    /// [`AgentError`] naming the address when it cannot be bound (in use, not local, no right).
    pub fn bind(address: SocketAddr, metrics: Arc<AgentMetrics>) -> Result<Self, AgentError> {
        let bound = std::net::TcpListener::bind(address)
            .and_then(|listener| {
                listener.set_nonblocking(true)?;
                TcpListener::from_std(listener)
            })
            .map_err(|e| {
                AgentError::new(format!(
                    "cannot listen for metrics on {address} (--metrics-listen): {e}"
                ))
            })?;
        Ok(MetricsEndpoint {
            listener: bound,
            metrics,
            limits: ConnectionLimits::default(),
        })
    }

    /// The same endpoint with other connection bounds (the defaults suit Prometheus).
    pub fn with_limits(mut self, limits: ConnectionLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The address actually bound (the port chosen when `:0` was asked for).
    ///
    /// # Errors
    /// [`AgentError`] when the socket cannot say.
    pub fn local_addr(&self) -> Result<SocketAddr, AgentError> {
        self.listener
            .local_addr()
            .map_err(|e| AgentError::new(format!("cannot read the metrics address: {e}")))
    }

    /// The metrics this endpoint serves.
    pub fn metrics(&self) -> &Arc<AgentMetrics> {
        &self.metrics
    }

    /// Starts serving; `store` is what the IPAM gauges are computed from (held weakly, so that
    /// the store closes when the agent lets go of it).
    pub fn spawn(self, store: Weak<dyn KvStore>) -> MetricsServer {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(accept_loop(
            self.listener,
            self.metrics,
            store,
            self.limits,
            stopped,
        ));
        MetricsServer {
            stop,
            task: Some(task),
        }
    }
}

/// The running metrics endpoint.
#[derive(Debug)]
pub struct MetricsServer {
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl MetricsServer {
    /// Stops accepting, drops the scrapes in progress and waits until they are gone.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            if let Err(e) = task.await {
                tracing::warn!("the metrics endpoint ended abnormally: {e}");
            }
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    metrics: Arc<AgentMetrics>,
    store: Weak<dyn KvStore>,
    limits: ConnectionLimits,
    mut stopped: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    let served = Arc::new(AtomicU64::new(0));
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if connections.len() >= limits.max_connections {
                        tracing::debug!(%peer, "metrics: too many scrapes at once, closing one");
                        continue;
                    }
                    let metrics = Arc::clone(&metrics);
                    let store = store.clone();
                    let served = Arc::clone(&served);
                    connections.spawn(async move {
                        let service = hyper::service::service_fn(move |request| {
                            let metrics = Arc::clone(&metrics);
                            let store = store.clone();
                            served.fetch_add(1, Ordering::Relaxed);
                            async move { Ok::<_, Infallible>(respond(&metrics, &store, request).await) }
                        });
                        // One request per connection (Prometheus connects anew for each scrape),
                        // so that the lifetime bound never cuts a kept-alive connection between
                        // two scrapes, and no unread request body is waited for.
                        let connection = hyper::server::conn::http1::Builder::new()
                            .timer(TokioTimer::new())
                            .header_read_timeout(limits.header_read)
                            .keep_alive(false)
                            .serve_connection(TokioIo::new(stream), service);
                        // The lifetime bounds what hyper does not: a request body that never
                        // comes, an answer the client never reads.
                        match tokio::time::timeout(limits.lifetime, connection).await {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, "metrics: a scrape connection ended: {e}");
                            }
                            Err(_) => tracing::debug!(
                                %peer,
                                "metrics: a scrape connection outlived {:?}, closed",
                                limits.lifetime
                            ),
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!("metrics: accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    tracing::debug!(
        scrapes = served.load(Ordering::Relaxed),
        "metrics endpoint stopped"
    );
}

async fn respond(
    metrics: &AgentMetrics,
    store: &Weak<dyn KvStore>,
    request: Request<Incoming>,
) -> Response<Full<Bytes>> {
    if request.uri().path() != "/metrics" {
        return plain(
            StatusCode::NOT_FOUND,
            "not found: the metrics are at /metrics\n",
        );
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return plain(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and HEAD are served at /metrics\n",
        );
    }
    let openmetrics = request
        .headers()
        .get_all(ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .any(|value| value.contains("application/openmetrics-text"));
    let body = metrics.scrape(store, openmetrics).await;
    let content_type = if openmetrics {
        OPENMETRICS_CONTENT_TYPE
    } else {
        TEXT_CONTENT_TYPE
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

fn plain(status: StatusCode, message: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(message.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipam_core::allocator::{AssignIpsRequest, PoolSpec};
    use ipam_core::MemoryStore;

    /// Reads what `stream` sends until it closes; `None` when it is still open after `within`.
    async fn read_until_closed(
        stream: &mut tokio::net::TcpStream,
        within: Duration,
    ) -> Option<String> {
        use tokio::io::AsyncReadExt;
        let mut received = Vec::new();
        let read = tokio::time::timeout(within, stream.read_to_end(&mut received)).await;
        match read {
            Ok(_) => Some(String::from_utf8_lossy(&received).into_owned()),
            Err(_) => None,
        }
    }

    /// One `GET /metrics` on a new connection: the status line and the body.
    async fn scrape_once(address: SocketAddr) -> String {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(address)
            .await
            .expect("connect");
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
            .await
            .expect("send the request");
        read_until_closed(&mut stream, Duration::from_secs(20))
            .await
            .expect("the scrape was answered and closed")
    }

    /// The liveness gauges: this node registered or not, and the node states of the last
    /// reclaim pass, each state a labelled sample.
    #[tokio::test]
    async fn registration_and_node_states_are_exported_as_gauges() {
        let counters = Arc::new(ReclaimCounters::default());
        let metrics = AgentMetrics::new(Arc::clone(&counters), Duration::ZERO);
        let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
        let before = metrics.scrape(&Arc::downgrade(&store), false).await;
        assert!(
            before.contains("blockipam_agent_node_registered 0\n"),
            "{before}"
        );
        counters
            .registered
            .store(true, std::sync::atomic::Ordering::Relaxed);
        counters.record_pass([3, 1, 2, 0, 4]);
        let after = metrics.scrape(&Arc::downgrade(&store), false).await;
        for line in [
            "# TYPE blockipam_agent_node_registered gauge\n",
            "blockipam_agent_node_registered 1\n",
            "# TYPE blockipam_agent_nodes gauge\n",
            "blockipam_agent_nodes{state=\"alive\"} 3\n",
            "blockipam_agent_nodes{state=\"active\"} 1\n",
            "blockipam_agent_nodes{state=\"missing\"} 2\n",
            "blockipam_agent_nodes{state=\"dead\"} 0\n",
            "blockipam_agent_nodes{state=\"reclaimed\"} 4\n",
        ] {
            assert!(after.contains(line), "no {line:?} in:\n{after}");
        }
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
        let server = endpoint.spawn(Arc::downgrade(&store));

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
        let server = endpoint.spawn(Arc::downgrade(&store));
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
}
