//! Calico's IPAM gauges, computed from the store at scrape time and cached, and the dead-node
//! reclaim counters and node states.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ipam_core::caching::CacheStats;
use ipam_core::{Ipam, IpamError, KvStore};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabel, EncodeLabelSet, EncodeMetric, LabelSetEncoder,
};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use tokio::sync::Mutex;

use crate::counters::{LeakCounters, ReclaimCounters, NODE_STATES};

use super::{IPAM_COMPUTATION_TIMEOUT, NO_AFFINITY_LABEL, NO_POOL_LABEL, UNKNOWN_NODE_LABEL};

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
    /// Claim entries, blocks and owner keys that could not be decoded (key, what is wrong): a
    /// damaged block (or a damaged owner key's block) counts in `blocks` with none of its
    /// addresses, a damaged claim entry's block not at all.
    pub undecodable: Vec<(String, String)>,
}

impl IpamSnapshot {
    /// Counts as Calico's kube-controllers do: blocks by affine node (`no_affinity` for none),
    /// addresses by the node recorded with them (`unknown_node` for none), borrowed when that node
    /// is not the block's; things outside every pool under `no_ippool`. Every node seen anywhere
    /// gets an explicit zero in each pool's in-use and borrowed gauges.
    ///
    /// What it reads ([`Ipam::allocation_counts`]): the pools, the claim index and the
    /// borrowed-block indexes in one batch, then only the blocks a node borrowed from, blocks
    /// without an owner and blocks whose claim entry records no free count; every other block's
    /// addresses count for its owner. So a scrape reads small entries, not block values.
    ///
    /// A claim entry, block or owner key that cannot be decoded is listed in `undecodable` and the
    /// rest is counted: one damaged object does not take every gauge away.
    ///
    /// # Errors
    /// Store failures, and the corrupt objects the allocator cannot count past (a pool, a
    /// borrowed-block index key that names no block).
    pub async fn compute(store: Arc<dyn KvStore>) -> Result<Self, IpamError> {
        let counts = Ipam::new(store).allocation_counts().await?;
        let mut snapshot = IpamSnapshot {
            undecodable: counts
                .undecodable
                .iter()
                .map(|object| (object.key.clone(), object.message.clone()))
                .collect(),
            ..IpamSnapshot::default()
        };
        let mut nodes: BTreeSet<String> = BTreeSet::new();
        for pool in &counts.pools {
            // An IPv6 pool may span more than 2^64 addresses: a gauge is a float anyway.
            snapshot
                .pool_sizes
                .insert(pool.name.clone(), pool.capacity() as f64);
        }
        for block in &counts.blocks {
            let pool = counts
                .pools
                .iter()
                .find(|p| p.cidr.contains(&block.cidr.network()))
                .map_or_else(|| NO_POOL_LABEL.to_owned(), |p| p.name.clone());
            let owner = match &block.host {
                Some(host) => {
                    nodes.insert(host.clone());
                    host.clone()
                }
                None => NO_AFFINITY_LABEL.to_owned(),
            };
            *snapshot.blocks.entry((pool.clone(), owner)).or_default() += 1;
            for (node, count) in &block.by_node {
                if let Some(node) = node {
                    nodes.insert(node.clone());
                    if block.host.as_ref() != Some(node) {
                        *snapshot
                            .borrowed
                            .entry((pool.clone(), node.clone()))
                            .or_default() += count;
                    }
                }
                let node = node
                    .clone()
                    .unwrap_or_else(|| UNKNOWN_NODE_LABEL.to_owned());
                *snapshot.in_use.entry((pool.clone(), node)).or_default() += count;
            }
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
pub(super) struct Published {
    snapshot: Option<Arc<IpamSnapshot>>,
    store_up: bool,
    /// Unix time of the last successful computation.
    last_success_unix_seconds: Option<f64>,
}

#[derive(Debug, Default)]
pub(super) struct RefreshState {
    last_attempt: Option<Instant>,
    /// The keys of the undecodable objects last logged (each set is logged once).
    undecodable_logged: Vec<String>,
}

#[derive(Debug)]
pub(super) struct IpamState {
    pub(super) cache_for: Duration,
    pub(super) refresh: Mutex<RefreshState>,
    pub(super) published: RwLock<Published>,
}

impl IpamState {
    pub(super) async fn refresh(&self, store: &Weak<dyn KvStore>) {
        let mut refresh = self.refresh.lock().await;
        if refresh
            .last_attempt
            .is_some_and(|at| at.elapsed() < self.cache_for)
        {
            return;
        }
        refresh.last_attempt = Some(Instant::now());
        let outcome = match store.upgrade() {
            None => Err("the store is not open (the agent is starting or stopping)".to_owned()),
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
                warn_undecodable(&snapshot, &mut refresh.undecodable_logged);
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

/// Names the objects a computation could not decode, once for each set of them (every
/// computation reads them until they are repaired).
fn warn_undecodable(snapshot: &IpamSnapshot, logged: &mut Vec<String>) {
    let keys: Vec<String> = snapshot
        .undecodable
        .iter()
        .map(|(key, _)| key.clone())
        .collect();
    if keys != *logged {
        for (key, message) in &snapshot.undecodable {
            tracing::warn!(
                key = %key,
                "metrics: an object cannot be decoded ({message}); the ipam_* gauges leave out \
                 what it holds until it is repaired (blockipamctl check)"
            );
        }
        *logged = keys;
    }
}

/// Encodes the IPAM gauges from the last snapshot, and the store's health.
#[derive(Debug)]
pub(super) struct IpamCollector {
    pub(super) state: Arc<IpamState>,
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
        let undecodable = ConstGauge::new(saturating_i64(snapshot.undecodable.len() as u64));
        undecodable.encode(encoder.encode_descriptor(
            "blockipam_agent_ipam_undecodable_objects",
            "Claim entries, blocks and owner keys the last computation of the ipam_* gauges could \
             not decode: a damaged block (or a damaged owner key's block) counts in ipam_blocks \
             with none of its addresses, a damaged claim entry's block not at all (blockipamctl \
             check names them)",
            None,
            undecodable.metric_type(),
        )?)?;
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
pub(super) struct ReclaimCollector {
    pub(super) counters: Arc<ReclaimCounters>,
}

impl Collector for ReclaimCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (nodes, blocks) = self.counters.snapshot();
        for (name, help, value) in [
            (
                "blockipam_agent_dead_nodes_reclaimed",
                "Dead nodes whose blocks this agent released (their addresses are kept)",
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
        for (name, help, flag) in [
            (
                "blockipam_agent_node_registered",
                "1 while this agent's node is registered and its liveness key on a lease (etcd)",
                &self.counters.registered,
            ),
            (
                "blockipam_agent_reclaimer_leader",
                "1 while this agent holds the reclaimer leader key (etcd): its \
                 blockipam_agent_nodes are current",
                &self.counters.reclaimer_leader,
            ),
        ] {
            let gauge = ConstGauge::new(i64::from(flag.load(std::sync::atomic::Ordering::Relaxed)));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
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

/// Encodes the leak collection's counters and the gauges of its last look.
#[derive(Debug)]
pub(super) struct LeakCollector {
    pub(super) counters: Arc<LeakCounters>,
}

impl Collector for LeakCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.counters;
        let mut family = encoder.encode_descriptor(
            "ipam_allocations_gc_reclamations",
            "Addresses this agent released because their container was gone from the container \
             runtime at every look for the grace, by pool and node (Calico's garbage collector \
             reclamations)",
            None,
            MetricType::Counter,
        )?;
        for ((pool, node), count) in c.released_by_pool() {
            let labels = [("ippool", pool.as_str()), ("node", node.as_str())];
            ConstCounter::new(count).encode(family.encode_family(&labels)?)?;
        }
        for (name, help, value) in [
            (
                "blockipam_agent_leaks_released",
                "Addresses this agent released because their container was gone from the \
                 container runtime at every look for the grace",
                c.released.load(Relaxed),
            ),
            (
                "blockipam_agent_addresses_reasserted",
                "Live pods' addresses the store recorded as free, recorded for them again from \
                 libcni's cache",
                c.reasserted.load(Relaxed),
            ),
            (
                "blockipam_agent_runtime_looks",
                "Looks at which the container runtime answered",
                c.looks.load(Relaxed),
            ),
            (
                "blockipam_agent_runtime_looks_unanswered",
                "Looks at which the container runtime could not be asked (nothing is collected \
                 then)",
                c.unanswered_looks.load(Relaxed),
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
        for (name, help, value) in [
            (
                "blockipam_agent_runtime_answering",
                "1 when the container runtime answered the last look",
                u64::from(c.runtime_answering.load(Relaxed)),
            ),
            (
                "ipam_leaked_allocations",
                "This node's allocations whose container the runtime did not report at the last \
                 look (released once gone for the whole grace)",
                c.missing_allocations.load(Relaxed),
            ),
            (
                "ipam_duplicate_addresses",
                "Addresses live pods of this node use that the store records for another holder, \
                 at the last look",
                c.duplicate_addresses.load(Relaxed),
            ),
            (
                "ipam_unrecorded_live_addresses",
                "Addresses live pods of this node use that the store records as free, at the last \
                 look",
                c.unrecorded_addresses.load(Relaxed),
            ),
        ] {
            let gauge = ConstGauge::new(saturating_i64(value));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

/// Encodes where the plugin's batched reads were answered: the agent's read cache or the store.
#[derive(Debug)]
pub(super) struct CacheCollector {
    pub(super) stats: Arc<CacheStats>,
}

impl Collector for CacheCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "blockipam_agent_plugin_reads",
            "Batched reads deciding an allocation or a release (the plugin's ADD and DEL) by \
             where they were answered: from the agent's read cache (checked by the decision's \
             transaction) or from the store",
            None,
            MetricType::Counter,
        )?;
        for (answered, count) in [
            ("cache", self.stats.answered_from_cache()),
            ("store", self.stats.read_from_store()),
        ] {
            ConstCounter::new(count).encode(family.encode_family(&[("answered", answered)])?)?;
        }
        Ok(())
    }
}
