//! The borrow scenario: a pool whose blocks are all claimed but a few (`--claimed-percent`), each
//! by a filler node holding one address, strict affinity off; then `--nodes` new nodes each ADD
//! one address. Each ADD is measured over its own counted store client: latency, round trips, and
//! block values read against claim-index listings; it either claimed one of the few free blocks
//! or borrowed from a filler's block (reported apart).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use ipam_core::model::{ip_to_u128, u128_to_ip};
use ipam_core::{AssignIpsRequest, AutoAssignRequest, CountingStore, Ipam, KvStore};
use serde::Serialize;
use tokio::task::JoinSet;

use super::reads::ReadClassifier;
use super::ScenarioConfig;
use super::{check, prepare_pool, CallSample, CallSummary, CheckOutcome};
use crate::config::LoadConfig;
use crate::error::LoadError;
use crate::pods::{self, container_id, PodKind};
use crate::run::{open_target, StoreTarget};

/// Largest pool (in blocks) the scenario fills.
const MAX_BLOCKS: u128 = 1 << 20;
/// How many error messages are kept.
const SAMPLES: usize = 10;

/// What the borrow scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct BorrowReport {
    /// `borrow`.
    pub scenario: &'static str,
    /// The store, described.
    pub store: String,
    /// The pool.
    pub pool: String,
    /// Its block prefix length.
    pub block_size: u8,
    /// Blocks in the pool.
    pub blocks: u64,
    /// Blocks claimed by filler nodes (one address each).
    pub claimed_blocks: u64,
    /// The share asked for, in percent.
    pub claimed_percent: u32,
    /// Seconds the filling took (not measured).
    pub fill_seconds: f64,
    /// New nodes, one ADD each.
    pub nodes: u32,
    /// ADDs in flight at once.
    pub concurrency: u32,
    /// Every ADD.
    pub adds: CallSummary,
    /// ADDs that claimed a free block for their node.
    pub claimed: CallSummary,
    /// ADDs that borrowed an address from another node's block.
    pub borrowed: CallSummary,
    /// ADDs that failed.
    pub errors: u64,
    /// The first error messages.
    pub error_samples: Vec<String>,
    /// Allocations in the store at the end (fillers + new nodes).
    pub allocations: u64,
    /// The final check.
    pub check: CheckOutcome,
    /// No error, every address in the store, a clean check.
    pub passed: bool,
}

impl BorrowReport {
    /// The report for people.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "blockipam-load borrow: pool {} (/{} blocks: {}), {} claimed by filler nodes ({}% asked) in {:.2} s; {} new nodes, one ADD each, {} at once",
            self.pool,
            self.block_size,
            self.blocks,
            self.claimed_blocks,
            self.claimed_percent,
            self.fill_seconds,
            self.nodes,
            self.concurrency
        );
        let _ = writeln!(out, "store: {}", self.store);
        let _ = writeln!(out, "all ADDs:      {}", self.adds.line());
        let _ = writeln!(out, "claimed block: {}", self.claimed.line());
        let _ = writeln!(out, "borrowed:      {}", self.borrowed.line());
        let _ = writeln!(out, "allocations at the end: {}", self.allocations);
        let _ = writeln!(
            out,
            "check: {}",
            if self.check.clean {
                "clean"
            } else {
                "PROBLEMS"
            }
        );
        for problem in &self.check.problems {
            let _ = writeln!(out, "  {problem}");
        }
        let _ = writeln!(out, "errors: {}", self.errors);
        for error in &self.error_samples {
            let _ = writeln!(out, "  {error}");
        }
        let _ = writeln!(out, "result: {}", if self.passed { "PASS" } else { "FAIL" });
        out
    }
}

/// The block indices left unclaimed: `free` of `blocks`, spread evenly.
fn free_blocks(blocks: u64, free: u64) -> BTreeSet<u64> {
    (0..free).map(|k| k * blocks / free.max(1)).collect()
}

/// Runs the scenario.
///
/// # Errors
/// [`LoadError::Usage`] for a bad percentage or a pool too large; [`LoadError::Failed`] when the
/// store cannot be set up or read back.
pub async fn run(
    config: &LoadConfig,
    scenario: &ScenarioConfig,
    target: StoreTarget,
) -> Result<BorrowReport, LoadError> {
    if scenario.claimed_percent > 100 {
        return Err(LoadError::usage("--claimed-percent must be 0 to 100"));
    }
    if config.strict_affinity {
        return Err(LoadError::usage(
            "the borrow scenario needs strict affinity off (borrowing is what it measures)",
        ));
    }
    let (settings, store, _temporary) = open_target(config, target).await?;
    let description = settings
        .as_ref()
        .map(blockipam_store::DatastoreSettings::describe)
        .unwrap_or_else(|| "a store handed in by the caller".into());
    let ipam = Ipam::new(store.clone());
    let pool = prepare_pool(&ipam, config).await?;
    let block_count = pool.block_count();
    if block_count > MAX_BLOCKS {
        return Err(LoadError::usage(format!(
            "the pool {} holds {block_count} blocks of /{}; the borrow scenario fills at most {MAX_BLOCKS}: give a smaller --pool or a larger --block-size",
            pool.cidr, pool.block_size
        )));
    }
    let blocks = block_count as u64;
    let claimed = blocks * u64::from(scenario.claimed_percent) / 100;
    let free = free_blocks(blocks, blocks - claimed);

    // Fill: one address in each claimed block, each block its own filler node.
    let started = Instant::now();
    let fillers: Vec<u64> = (0..blocks).filter(|i| !free.contains(i)).collect();
    let mut filling = JoinSet::new();
    let mut next = fillers.into_iter();
    let concurrency = config.concurrency.max(1) as usize;
    loop {
        while filling.len() < concurrency {
            let Some(index) = next.next() else { break };
            let Some(block) = pool.block_at(u128::from(index)) else {
                continue;
            };
            let edge = u128::from(block.max_prefix_len() - block.prefix_len() >= 2);
            let ip: IpAddr = u128_to_ip(pool.family(), ip_to_u128(block.network()) + edge);
            let ipam = ipam.clone();
            let network = config.network.clone();
            filling.spawn(async move {
                ipam.assign_ips(&AssignIpsRequest {
                    ips: vec![ip],
                    handle: format!("{network}-filler.{index:07}"),
                    host: format!("filler-{index:07}"),
                    ..AssignIpsRequest::default()
                })
                .await
                .map_err(|e| format!("filling block {block} with {ip}: {e}"))
            });
        }
        let Some(joined) = filling.join_next().await else {
            break;
        };
        joined
            .map_err(|e| LoadError::failed(format!("a filling task failed: {e}")))?
            .map_err(LoadError::failed)?;
    }
    let fill_seconds = started.elapsed().as_secs_f64();

    // Measure: each new node's one ADD over its own counted client.
    let mut adding = JoinSet::new();
    let mut nodes = 0..config.nodes;
    let mut claimed_samples = Vec::new();
    let mut borrowed_samples = Vec::new();
    let mut error_samples = Vec::new();
    let mut errors = 0;
    loop {
        while adding.len() < concurrency {
            let Some(node) = nodes.next() else { break };
            adding.spawn(add_one(config.clone(), store.clone(), node));
        }
        let Some(joined) = adding.join_next().await else {
            break;
        };
        let (host, result) =
            joined.map_err(|e| LoadError::failed(format!("an ADD task failed: {e}")))?;
        match result {
            Ok((ip, sample)) => {
                let owner = ipam
                    .get_assignment(ip)
                    .await
                    .map_err(|e| LoadError::failed(format!("cannot read {ip} back: {e}")))?;
                match owner.and_then(|a| a.block_host) {
                    Some(block_host) if block_host == host => claimed_samples.push(sample),
                    _ => borrowed_samples.push(sample),
                }
            }
            Err(e) => {
                errors += 1;
                if error_samples.len() < SAMPLES {
                    error_samples.push(e);
                }
            }
        }
    }
    let allocations = ipam
        .list_allocations()
        .await
        .map_err(|e| LoadError::failed(format!("cannot list the allocations: {e}")))?
        .len() as u64;
    let check = check(&ipam).await?;
    let all: Vec<CallSample> = claimed_samples
        .iter()
        .chain(&borrowed_samples)
        .copied()
        .collect();
    let successes = all.len() as u64;
    let passed = errors == 0 && check.clean && allocations == claimed + successes;
    Ok(BorrowReport {
        scenario: "borrow",
        store: description,
        pool: pool.cidr.to_string(),
        block_size: pool.block_size,
        blocks,
        claimed_blocks: claimed,
        claimed_percent: scenario.claimed_percent,
        fill_seconds,
        nodes: config.nodes,
        concurrency: config.concurrency,
        adds: CallSummary::of(&all),
        claimed: CallSummary::of(&claimed_samples),
        borrowed: CallSummary::of(&borrowed_samples),
        errors,
        error_samples,
        allocations,
        check,
        passed,
    })
}

/// One new node's ADD of one address, measured.
async fn add_one(
    config: LoadConfig,
    store: Arc<dyn KvStore>,
    node: u32,
) -> (String, Result<(IpAddr, CallSample), String>) {
    let host = format!("borrow-node-{node:05}");
    let classifier = Arc::new(ReadClassifier::new(store));
    let counting = Arc::new(CountingStore::new(classifier.clone()));
    let ipam = Ipam::new(counting.clone());
    let container = container_id(PodKind::Borrow, u64::from(node), 0);
    let request = AutoAssignRequest {
        handle: config.handle(&container),
        host: host.clone(),
        num_v4: 1,
        attributes: pods::attributes(&config.network, &container),
        skip_block_edges: true,
        ..AutoAssignRequest::default()
    };
    let started = Instant::now();
    let result = ipam.auto_assign(&request).await;
    let latency = started.elapsed();
    let outcome = match result {
        Ok(result) => match result.v4.first() {
            Some(address) => Ok((
                address.ip,
                CallSample {
                    latency,
                    round_trips: counting.round_trips(),
                    reads: classifier.kinds(),
                },
            )),
            None => Err(format!("ADD on {host}: no address returned")),
        },
        Err(e) => Err(format!("ADD on {host}: {e}")),
    };
    (host, outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_blocks_are_spread_and_counted_exactly() {
        assert_eq!(free_blocks(100, 5), BTreeSet::from([0, 20, 40, 60, 80]));
        assert_eq!(free_blocks(64, 0), BTreeSet::new());
        assert_eq!(free_blocks(3, 3), BTreeSet::from([0, 1, 2]));
    }
}
