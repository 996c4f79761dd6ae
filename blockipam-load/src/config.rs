//! What one load run does: the simulated cluster, its pod churn, when it stops, and how each
//! operation reaches the store.

use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;
use serde::Serialize;

use crate::error::LoadError;

/// How an operation reaches the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The allocator API in this process: each node has its own `Ipam` over its own store client
    /// (its own etcd connection; one shared handle for an embedded store, which admits one
    /// process).
    Api,
    /// The real `blockipam` binary, one process per operation with the CNI environment and the
    /// netconf on stdin, each node with its own `nodename` and `ipam_lock_file`.
    Plugin,
}

impl Mode {
    /// `api` or `plugin`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Api => "api",
            Mode::Plugin => "plugin",
        }
    }
}

/// When a node stops starting new operations.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopRule {
    /// After this many operations in total, split evenly over the nodes (the fill counts).
    Operations(u64),
    /// When this much time has passed since the run started (the fill counts).
    Duration(#[serde(serialize_with = "seconds")] Duration),
    /// After filling, each node replaces this many pods (one DEL and one ADD each).
    ChurnCycles(u64),
}

fn seconds<S: serde::Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(duration.as_secs_f64())
}

/// One run's parameters (everything but the store, see [`crate::StoreTarget`]).
/// Most keys a raw `Txn` may put or test beyond its own (etcd's default `--max-txn-ops` is 128).
pub const RAW_EXTRA_LIMIT: u32 = 100;

/// Bytes of each value the raw loop writes unless told otherwise (about a small stored object).
pub const RAW_VALUE_BYTES: usize = 200;
/// Most bytes one raw `Txn` may put in all (etcd refuses requests above 1.5 MiB by default).
pub const RAW_TXN_BYTES_LIMIT: usize = 1_000_000;

/// What each raw `Txn` holds beyond its one conditional put of a new key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RawShape {
    /// More new keys put, each of the same size.
    pub extra_puts: u32,
    /// More keys tested (each worker's own, present).
    pub extra_conditions: u32,
    /// Bytes of each value put (the loop's own key and each extra one).
    pub value_bytes: usize,
}

impl Default for RawShape {
    /// The plain loop: one conditional put of [`RAW_VALUE_BYTES`].
    fn default() -> Self {
        RawShape {
            extra_puts: 0,
            extra_conditions: 0,
            value_bytes: RAW_VALUE_BYTES,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct LoadConfig {
    /// How operations reach the store.
    pub mode: Mode,
    /// Simulated nodes.
    pub nodes: u32,
    /// Pods each node holds once filled.
    pub pods_per_node: u32,
    /// When nodes stop.
    pub stop: StopRule,
    /// Churn cycles (DEL of a random held pod, then ADD of a new one) per node per second, as a
    /// Poisson process from the seeded schedule; `None` runs them back to back.
    pub churn_rate: Option<f64>,
    /// At the end, each node deletes every pod it holds.
    pub drain: bool,
    /// The pool's CIDR.
    pub pool: IpNet,
    /// The pool's block prefix length (the allocator's default when `None`).
    pub block_size: Option<u8>,
    /// The IPAM configuration's `strict_affinity`.
    pub strict_affinity: bool,
    /// The IPAM configuration's `max_blocks_per_host` (left as it is when `None`; 0 = unlimited).
    pub max_blocks_per_host: Option<u32>,
    /// The schedule's seed: the same seed gives each node the same operations.
    pub seed: u64,
    /// Operations in flight at once, each from a different node.
    pub concurrency: u32,
    /// The CNI network name; every handle is `<network>.<container id>`.
    pub network: String,
    /// The `blockipam` binary (plugin mode).
    pub plugin: Option<PathBuf>,
    /// etcd: how often to sample the database size during the run (only before and after when
    /// `None`).
    #[serde(serialize_with = "optional_seconds")]
    pub etcd_status_interval: Option<Duration>,
    /// etcd: after the run, compact the history up to the current revision and report the
    /// database size again (destroys history: for a benchmark etcd only).
    pub compact_at_end: bool,
    /// Independent pod streams per node, each with its own schedule, sharing the node's host
    /// identity (its `nodename` and lock file): several operations of one node in flight at once,
    /// as a kubelet starting several pods (`--lanes-per-node`, default 1).
    pub lanes_per_node: u32,
    /// Allocations put in the store through the allocator API before the measured run, held by
    /// [`LoadConfig::prefill_node`] (`--prefill`).
    pub prefill: u64,
    /// The node holding the prefilled allocations (the first node when `None`).
    pub prefill_node: Option<String>,
    /// etcd: after the allocation run, this long a raw etcd-client loop of one-key conditional
    /// `Txn` writes, `concurrency` workers each with its own connection (`--raw-etcd-ceiling-seconds`).
    #[serde(serialize_with = "optional_seconds")]
    pub raw_etcd_ceiling: Option<Duration>,
    /// What each raw `Txn` holds beyond its one conditional put (`--raw-etcd-extra-puts`,
    /// `--raw-etcd-extra-conditions`).
    pub raw_etcd_shape: RawShape,
    /// Api mode: each node's allocator reads through a cache of its own, as its node agent
    /// serves the plugin (`ipam_core::caching::CachingStore`; `--agent-cache`).
    pub agent_cache: bool,
}

fn optional_seconds<S: serde::Serializer>(
    duration: &Option<Duration>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match duration {
        Some(d) => serializer.serialize_some(&d.as_secs_f64()),
        None => serializer.serialize_none(),
    }
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            mode: Mode::Api,
            nodes: 10,
            pods_per_node: 5,
            stop: StopRule::ChurnCycles(5),
            churn_rate: None,
            drain: false,
            pool: IpNet::V4(
                ipnet::Ipv4Net::new(std::net::Ipv4Addr::new(10, 64, 0, 0), 10).unwrap_or_default(),
            ),
            block_size: None,
            strict_affinity: false,
            max_blocks_per_host: None,
            seed: 1,
            concurrency: 8,
            network: "load".to_owned(),
            plugin: None,
            etcd_status_interval: None,
            compact_at_end: false,
            lanes_per_node: 1,
            prefill: 0,
            prefill_node: None,
            raw_etcd_ceiling: None,
            raw_etcd_shape: RawShape::default(),
            agent_cache: false,
        }
    }
}

impl LoadConfig {
    /// Checks the parameters against each other.
    ///
    /// # Errors
    /// [`LoadError::Usage`] naming the parameter.
    pub fn validate(&self) -> Result<(), LoadError> {
        if self.nodes == 0 {
            return Err(LoadError::usage("--nodes must be at least 1"));
        }
        if self.pods_per_node == 0 {
            return Err(LoadError::usage("--pods-per-node must be at least 1"));
        }
        if self.concurrency == 0 {
            return Err(LoadError::usage("--concurrency must be at least 1"));
        }
        if self.lanes_per_node == 0 {
            return Err(LoadError::usage("--lanes-per-node must be at least 1"));
        }
        if let Some(node) = &self.prefill_node {
            ipam_core::model::validate_host(node)
                .map_err(|e| LoadError::usage(format!("--prefill-node: {e}")))?;
        }
        if let Some(d) = self.raw_etcd_ceiling {
            if d.is_zero() {
                return Err(LoadError::usage(
                    "--raw-etcd-ceiling-seconds must be above 0",
                ));
            }
        }
        if self.raw_etcd_shape != RawShape::default() && self.raw_etcd_ceiling.is_none() {
            return Err(LoadError::usage(
                "--raw-etcd-extra-puts, --raw-etcd-extra-conditions and --raw-etcd-value-bytes shape the raw loop: they need --raw-etcd-ceiling-seconds",
            ));
        }
        for (flag, value) in [
            ("--raw-etcd-extra-puts", self.raw_etcd_shape.extra_puts),
            (
                "--raw-etcd-extra-conditions",
                self.raw_etcd_shape.extra_conditions,
            ),
        ] {
            if value > RAW_EXTRA_LIMIT {
                return Err(LoadError::usage(format!(
                    "{flag} must be at most {RAW_EXTRA_LIMIT} (etcd refuses larger transactions by default), not {value}"
                )));
            }
        }
        let shape = self.raw_etcd_shape;
        let txn_bytes = (shape.extra_puts as usize + 1).saturating_mul(shape.value_bytes);
        if shape.value_bytes == 0 || txn_bytes > RAW_TXN_BYTES_LIMIT {
            return Err(LoadError::usage(format!(
                "--raw-etcd-value-bytes must be at least 1, and all the values of one raw Txn (1 + --raw-etcd-extra-puts of them) at most {RAW_TXN_BYTES_LIMIT} bytes (etcd refuses larger requests by default), not {} × {}",
                shape.extra_puts as usize + 1,
                shape.value_bytes
            )));
        }
        if let Some(rate) = self.churn_rate {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(LoadError::usage(format!(
                    "--churn-rate must be a number of cycles per node per second above 0, not {rate}"
                )));
            }
        }
        if let StopRule::Duration(d) = self.stop {
            if d.is_zero() {
                return Err(LoadError::usage("--duration-seconds must be above 0"));
            }
        }
        if self.pool.network() != self.pool.addr() {
            return Err(LoadError::usage(format!(
                "--pool {} has host bits set; give the network address ({})",
                self.pool,
                self.pool.trunc()
            )));
        }
        let network_ok = self
            .network
            .chars()
            .enumerate()
            .all(|(i, c)| c.is_ascii_alphanumeric() || (i > 0 && matches!(c, '_' | '.' | '-')));
        if self.network.is_empty() || !network_ok {
            return Err(LoadError::usage(format!(
                "--network {:?} must match [a-zA-Z0-9][a-zA-Z0-9_.-]* (a CNI network name)",
                self.network
            )));
        }
        if self.agent_cache && self.mode != Mode::Api {
            return Err(LoadError::usage(
                "--agent-cache is for api mode (in plugin mode, run an agent and name its socket)",
            ));
        }
        if self.mode == Mode::Plugin && self.plugin.is_none() {
            return Err(LoadError::usage(
                "plugin mode needs the blockipam binary (--plugin or BLOCKIPAM_PLUGIN)",
            ));
        }
        Ok(())
    }

    /// The simulated node names: `load-node-00000`, `load-node-00001`, ...
    pub fn node_name(index: u32) -> String {
        format!("load-node-{index:05}")
    }

    /// Simulated pod streams: `nodes × lanes_per_node`.
    pub fn streams(&self) -> u64 {
        u64::from(self.nodes) * u64::from(self.lanes_per_node.max(1))
    }

    /// The node holding the prefilled allocations.
    pub fn prefill_host(&self) -> String {
        self.prefill_node
            .clone()
            .unwrap_or_else(|| LoadConfig::node_name(0))
    }

    /// The handle of a pod attachment, as the plugin forms it: `<network>.<container id>`.
    pub fn handle(&self, container: &str) -> String {
        format!("{}.{container}", self.network)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_parameters_are_usage_errors() {
        LoadConfig::default()
            .validate()
            .expect("defaults are valid");
        let cases = [
            LoadConfig {
                nodes: 0,
                ..LoadConfig::default()
            },
            LoadConfig {
                pods_per_node: 0,
                ..LoadConfig::default()
            },
            LoadConfig {
                concurrency: 0,
                ..LoadConfig::default()
            },
            LoadConfig {
                churn_rate: Some(f64::NAN),
                ..LoadConfig::default()
            },
            LoadConfig {
                pool: "10.0.0.1/16".parse().expect("cidr"),
                ..LoadConfig::default()
            },
            LoadConfig {
                network: "-bad".into(),
                ..LoadConfig::default()
            },
            LoadConfig {
                mode: Mode::Plugin,
                ..LoadConfig::default()
            },
            LoadConfig {
                lanes_per_node: 0,
                ..LoadConfig::default()
            },
            LoadConfig {
                prefill_node: Some(String::new()),
                ..LoadConfig::default()
            },
            LoadConfig {
                raw_etcd_ceiling: Some(Duration::ZERO),
                ..LoadConfig::default()
            },
            // The agent cache is api mode's: in plugin mode a real agent serves the plugin.
            LoadConfig {
                mode: Mode::Plugin,
                plugin: Some(PathBuf::from("/usr/bin/blockipam")),
                agent_cache: true,
                ..LoadConfig::default()
            },
        ];
        LoadConfig {
            agent_cache: true,
            ..LoadConfig::default()
        }
        .validate()
        .expect("api mode through agent caches is valid");
        for case in cases {
            assert!(
                matches!(case.validate(), Err(LoadError::Usage(_))),
                "{case:?} was accepted"
            );
        }
    }
}
