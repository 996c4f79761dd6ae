//! Scenarios that are not churn (`--scenario`): borrowing in a nearly full pool ([`borrow`]) and
//! reclaiming a dead node's addresses with the real `blockipamctl node release --addresses`
//! ([`node_release`]); each sets its store up through the allocator API, measures one thing, then
//! checks the store.

pub mod borrow;
pub mod node_release;
pub mod reads;

use std::path::PathBuf;
use std::time::Duration;

use ipam_core::{Ipam, PoolSpec, RoundTrips};
use serde::Serialize;

use crate::config::LoadConfig;
use crate::error::LoadError;
use crate::run::StoreTarget;
use crate::stats::percentile;
use reads::ReadKinds;

/// Which scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// The default: nodes churning pods ([`crate::run`]).
    Churn,
    /// A pool whose blocks are nearly all claimed; new nodes ADD one address each.
    Borrow,
    /// One node holding many addresses, released by `blockipamctl node release --addresses`.
    NodeRelease,
}

/// The scenarios' own parameters (the pool, block size, nodes and concurrency come from
/// [`LoadConfig`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScenarioConfig {
    /// Which scenario.
    pub scenario: Scenario,
    /// borrow: the share of the pool's blocks claimed by filler nodes, in percent.
    pub claimed_percent: u32,
    /// node-release: the addresses the node holds.
    pub addresses: u64,
    /// node-release: the `blockipamctl` binary.
    pub blockipamctl: Option<PathBuf>,
}

impl Default for ScenarioConfig {
    fn default() -> Self {
        ScenarioConfig {
            scenario: Scenario::Churn,
            claimed_percent: 95,
            addresses: 1000,
            blockipamctl: None,
        }
    }
}

/// A scenario's report.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum ScenarioReport {
    /// `--scenario borrow`.
    Borrow(Box<borrow::BorrowReport>),
    /// `--scenario node-release`.
    NodeRelease(Box<node_release::NodeReleaseReport>),
}

impl ScenarioReport {
    /// Whether the scenario found its store as it must be at the end.
    pub fn passed(&self) -> bool {
        match self {
            ScenarioReport::Borrow(r) => r.passed,
            ScenarioReport::NodeRelease(r) => r.passed,
        }
    }

    /// The report for people.
    pub fn to_text(&self) -> String {
        match self {
            ScenarioReport::Borrow(r) => r.to_text(),
            ScenarioReport::NodeRelease(r) => r.to_text(),
        }
    }
}

/// Runs the scenario `scenario` names.
///
/// # Errors
/// [`LoadError::Usage`] for bad parameters or `Scenario::Churn` (run that with [`crate::run`]);
/// [`LoadError::Failed`] when the store cannot be set up or read back.
pub async fn run_scenario(
    config: &LoadConfig,
    scenario: &ScenarioConfig,
    target: StoreTarget,
) -> Result<ScenarioReport, LoadError> {
    config.validate()?;
    match scenario.scenario {
        Scenario::Churn => Err(LoadError::usage(
            "the churn scenario is the load run itself (blockipam_load::run)",
        )),
        Scenario::Borrow => Ok(ScenarioReport::Borrow(Box::new(
            borrow::run(config, scenario, target).await?,
        ))),
        Scenario::NodeRelease => Ok(ScenarioReport::NodeRelease(Box::new(
            node_release::run(config, scenario, target).await?,
        ))),
    }
}

/// Creates the run's pool and sets strict affinity and the block limit as `config` says.
async fn prepare_pool(ipam: &Ipam, config: &LoadConfig) -> Result<ipam_core::Pool, LoadError> {
    let failed = |what: &str, e: ipam_core::IpamError| LoadError::failed(format!("{what}: {e}"));
    let pool = ipam
        .ensure_pool(&PoolSpec {
            cidr: config.pool,
            name: None,
            block_size: config.block_size,
            disabled: false,
        })
        .await
        .map_err(|e| failed(&format!("cannot create the pool {}", config.pool), e))?;
    let strict_affinity = config.strict_affinity;
    let max_blocks = config.max_blocks_per_host;
    ipam.update_config(|c| {
        c.strict_affinity = strict_affinity;
        if let Some(max) = max_blocks {
            c.max_blocks_per_host = max;
        }
    })
    .await
    .map_err(|e| failed("cannot set the IPAM configuration", e))?;
    Ok(pool)
}

/// One measured call: wall time, round trips and what it read.
#[derive(Debug, Clone, Copy)]
pub struct CallSample {
    /// Wall time.
    pub latency: Duration,
    /// Reads and commits.
    pub round_trips: RoundTrips,
    /// What the reads were of.
    pub reads: ReadKinds,
}

/// Summary of several measured calls.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CallSummary {
    /// Calls.
    pub count: u64,
    /// Latency percentiles and maximum, ms.
    pub p50_ms: Option<f64>,
    /// 99th percentile, ms.
    pub p99_ms: Option<f64>,
    /// Maximum, ms.
    pub max_ms: Option<f64>,
    /// Mean round trips (reads + commits) per call.
    pub round_trips_mean: Option<f64>,
    /// Most round trips of one call.
    pub round_trips_max: u64,
    /// Mean reads per call.
    pub reads_mean: Option<f64>,
    /// Mean commits per call.
    pub commits_mean: Option<f64>,
    /// Most block values one call read.
    pub block_values_max: u64,
    /// Mean block values read per call.
    pub block_values_mean: Option<f64>,
    /// Most claim-index listings of one call.
    pub claim_listings_max: u64,
    /// Most claim-index entries one call read.
    pub claim_entries_max: u64,
    /// Total of each kind of read over all calls.
    pub reads_total: ReadKinds,
}

impl CallSummary {
    /// Summarizes `samples`.
    pub fn of(samples: &[CallSample]) -> CallSummary {
        let mut latencies: Vec<f64> = samples
            .iter()
            .map(|s| s.latency.as_secs_f64() * 1000.0)
            .collect();
        latencies.sort_by(f64::total_cmp);
        let n = samples.len() as f64;
        let mean = |f: &dyn Fn(&CallSample) -> u64| {
            (!samples.is_empty()).then(|| samples.iter().map(|s| f(s) as f64).sum::<f64>() / n)
        };
        let max = |f: &dyn Fn(&CallSample) -> u64| samples.iter().map(f).max().unwrap_or(0);
        let mut total = ReadKinds::default();
        for s in samples {
            let r = &s.reads;
            total.block_gets += r.block_gets;
            total.block_listings += r.block_listings;
            total.block_values += r.block_values;
            total.claim_gets += r.claim_gets;
            total.claim_listings += r.claim_listings;
            total.claim_windows += r.claim_windows;
            total.claim_entries += r.claim_entries;
            total.other_reads += r.other_reads;
        }
        CallSummary {
            count: samples.len() as u64,
            p50_ms: percentile(&latencies, 0.50),
            p99_ms: percentile(&latencies, 0.99),
            max_ms: latencies.last().copied(),
            round_trips_mean: mean(&|s| s.round_trips.total()),
            round_trips_max: max(&|s| s.round_trips.total()),
            reads_mean: mean(&|s| s.round_trips.reads),
            commits_mean: mean(&|s| s.round_trips.commits),
            block_values_max: max(&|s| s.reads.block_values),
            block_values_mean: mean(&|s| s.reads.block_values),
            claim_listings_max: max(&|s| s.reads.claim_listings),
            claim_entries_max: max(&|s| s.reads.claim_entries),
            reads_total: total,
        }
    }

    /// One line for people.
    pub fn line(&self) -> String {
        let f = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into());
        format!(
            "{} calls: p50 {} ms, p99 {} ms, max {} ms; round trips mean {} (max {}), reads {}, commits {}; block values read mean {} (max {}); claim listings max {}, claim entries max {}",
            self.count,
            f(self.p50_ms),
            f(self.p99_ms),
            f(self.max_ms),
            f(self.round_trips_mean),
            self.round_trips_max,
            f(self.reads_mean),
            f(self.commits_mean),
            f(self.block_values_mean),
            self.block_values_max,
            self.claim_listings_max,
            self.claim_entries_max
        )
    }
}

/// The final check, summarized.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CheckOutcome {
    /// No problem.
    pub clean: bool,
    /// The first problems, described.
    pub problems: Vec<String>,
}

async fn check(ipam: &Ipam) -> Result<CheckOutcome, LoadError> {
    let report = ipam
        .check(false)
        .await
        .map_err(|e| LoadError::failed(format!("the final check could not run: {e}")))?;
    Ok(CheckOutcome {
        clean: report.problems.is_empty(),
        problems: report
            .problems
            .iter()
            .take(10)
            .map(|p| format!("{}: {}", p.kind, p.detail))
            .collect(),
    })
}
