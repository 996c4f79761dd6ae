//! The agent's Prometheus metrics (`--metrics-listen`): Calico's IPAM gauges computed from the
//! store at scrape time (cached), the dead-node reclaim counters, and the agent's own request,
//! store round-trip and connection counters, served over HTTP at `GET /metrics`.

use std::collections::BTreeSet;
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use ipam_core::caching::CacheStats;
use ipam_core::{KvError, KvStore};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::Mutex;

use crate::counters::{LeakCounters, ReclaimCounters};

mod gauges;
mod health;
mod http;
mod store;
#[cfg(test)]
mod tests;

use gauges::{
    CacheCollector, IpamCollector, IpamState, LeakCollector, Published, ReclaimCollector,
    RefreshState,
};
use store::InstrumentedStore;

pub use gauges::IpamSnapshot;
pub use health::{Health, READINESS_CACHE, READINESS_READ_TIMEOUT};
pub use http::{MetricsEndpoint, MetricsServer};

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
    requests_in_flight: Gauge,
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
        let requests_in_flight = Gauge::default();
        registry.register(
            "blockipam_agent_requests_in_flight",
            "Client requests read from the agent's socket and not yet answered (nor abandoned at \
             shutdown)",
            requests_in_flight.clone(),
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
            requests_in_flight,
            ipam,
        }
    }

    /// These metrics with the leak collection's counters and gauges, read from `leaks`.
    pub fn with_leak_counters(mut self, leaks: Arc<LeakCounters>) -> Self {
        self.registry
            .register_collector(Box::new(LeakCollector { counters: leaks }));
        self
    }

    /// These metrics with where the plugin's reads were answered (the agent's read cache or the
    /// store), read from `cache`.
    pub fn with_cache_stats(mut self, cache: Arc<CacheStats>) -> Self {
        self.registry
            .register_collector(Box::new(CacheCollector { stats: cache }));
        self
    }

    /// Records how long a client request of `kind` took to answer.
    pub fn observe_request(&self, kind: &'static str, took: Duration) {
        self.request_duration
            .get_or_create(&KindLabels { kind })
            .observe(took.as_secs_f64());
    }

    /// Counts one client request in `blockipam_agent_requests_in_flight` from now until the
    /// returned guard is dropped: when its answer is ready, or when it is abandoned (its task
    /// aborted at shutdown, its connection gone).
    pub fn request_in_flight(&self) -> InFlightRequest {
        self.requests_in_flight.inc();
        InFlightRequest {
            gauge: self.requests_in_flight.clone(),
        }
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

/// One client request counted in flight; dropping it takes it off the count.
#[derive(Debug)]
pub struct InFlightRequest {
    gauge: Gauge,
}

impl Drop for InFlightRequest {
    fn drop(&mut self) {
        self.gauge.dec();
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
