//! Per-kind latency samples and counters, and their summary (percentiles, round trips and
//! conflicts per operation).

use std::collections::BTreeMap;
use std::time::Duration;

use ipam_core::RoundTrips;
use serde::Serialize;

use crate::observe::CommitWork;
use crate::schedule::OpKind;

/// What one finished operation measured.
#[derive(Debug, Clone)]
pub struct OpSample {
    /// Its kind.
    pub kind: OpKind,
    /// Wall time of the call (allocator call, or plugin process from spawn to exit).
    pub latency: Duration,
    /// Whether it succeeded.
    pub ok: bool,
    /// Store round trips (api mode only).
    pub round_trips: Option<RoundTrips>,
    /// Commits refused by a failed condition (each retried), and the keys the commits wrote and
    /// tested (api mode only).
    pub commits: Option<CommitWork>,
}

#[derive(Debug, Default)]
struct KindSamples {
    latencies_ms: Vec<f64>,
    errors: u64,
    observed: u64,
    reads: u64,
    commits: u64,
    conflicts: u64,
    keys_written: u64,
    conditions: u64,
}

/// Everything measured so far, by kind.
#[derive(Debug, Default)]
pub struct Stats {
    kinds: BTreeMap<OpKind, KindSamples>,
}

/// The summary of one kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindSummary {
    /// Operations finished (successes and errors).
    pub count: u64,
    /// Operations that failed.
    pub errors: u64,
    /// Latency percentiles over every finished operation, in milliseconds (nearest rank).
    pub p50_ms: Option<f64>,
    /// 95th percentile.
    pub p95_ms: Option<f64>,
    /// 99th percentile.
    pub p99_ms: Option<f64>,
    /// Slowest.
    pub max_ms: Option<f64>,
    /// Mean.
    pub mean_ms: Option<f64>,
    /// Mean store reads per operation (api mode; `None` when not observable).
    pub reads_per_op: Option<f64>,
    /// Mean store transactions per operation, retried ones included.
    pub commits_per_op: Option<f64>,
    /// Mean round trips (reads + transactions) per operation.
    pub round_trips_per_op: Option<f64>,
    /// Commits refused by a failed condition (a concurrent writer won), each retried.
    pub conflicts: Option<u64>,
    /// `conflicts / count`.
    pub conflicts_per_op: Option<f64>,
    /// Mean keys put or deleted per transaction sent (retried ones included): with
    /// `conditions_per_commit`, the transaction's shape, which bounds what etcd commits per second.
    pub keys_written_per_commit: Option<f64>,
    /// Mean conditions tested per transaction sent (retried ones included).
    pub conditions_per_commit: Option<f64>,
}

impl Stats {
    /// Adds one operation.
    pub fn add(&mut self, sample: &OpSample) {
        let kind = self.kinds.entry(sample.kind).or_default();
        kind.latencies_ms
            .push(sample.latency.as_secs_f64() * 1000.0);
        if !sample.ok {
            kind.errors += 1;
        }
        if let (Some(trips), Some(commits)) = (sample.round_trips, sample.commits) {
            kind.observed += 1;
            kind.reads += trips.reads;
            kind.commits += trips.commits;
            kind.conflicts += commits.conflicts;
            kind.keys_written += commits.keys_written;
            kind.conditions += commits.conditions;
        }
    }

    /// Operations finished so far.
    pub fn finished(&self) -> u64 {
        self.kinds
            .values()
            .map(|k| k.latencies_ms.len() as u64)
            .sum()
    }

    /// Operations failed so far.
    pub fn errors(&self) -> u64 {
        self.kinds.values().map(|k| k.errors).sum()
    }

    /// The summary of every kind (kinds with no operation included, with count 0).
    pub fn summarize(&self) -> BTreeMap<OpKind, KindSummary> {
        let empty = KindSamples::default();
        OpKind::ALL
            .iter()
            .map(|kind| (*kind, summarize(self.kinds.get(kind).unwrap_or(&empty))))
            .collect()
    }
}

fn summarize(samples: &KindSamples) -> KindSummary {
    let mut sorted = samples.latencies_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let count = sorted.len() as u64;
    // Per-operation figures only when every operation of the kind was observed.
    let observed = samples.observed > 0 && samples.observed == count;
    let per_op = |total: u64| observed.then(|| total as f64 / samples.observed as f64);
    let per_commit = |total: u64| {
        (observed && samples.commits > 0).then(|| total as f64 / samples.commits as f64)
    };
    KindSummary {
        count,
        errors: samples.errors,
        p50_ms: percentile(&sorted, 0.50),
        p95_ms: percentile(&sorted, 0.95),
        p99_ms: percentile(&sorted, 0.99),
        max_ms: sorted.last().copied(),
        mean_ms: (!sorted.is_empty()).then(|| sorted.iter().sum::<f64>() / sorted.len() as f64),
        reads_per_op: per_op(samples.reads),
        commits_per_op: per_op(samples.commits),
        round_trips_per_op: per_op(samples.reads + samples.commits),
        conflicts: observed.then_some(samples.conflicts),
        conflicts_per_op: per_op(samples.conflicts),
        keys_written_per_commit: per_commit(samples.keys_written),
        conditions_per_commit: per_commit(samples.conditions),
    }
}

/// The nearest-rank percentile `q` (0 < q ≤ 1) of sorted samples: the smallest sample with at
/// least `q` of all samples at or below it.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted.get(rank.min(sorted.len()) - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&samples, 0.50), Some(50.0));
        assert_eq!(percentile(&samples, 0.95), Some(95.0));
        assert_eq!(percentile(&samples, 0.99), Some(99.0));
        assert_eq!(percentile(&[7.0], 0.99), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn summaries_count_errors_round_trips_and_conflicts_per_kind() {
        let mut stats = Stats::default();
        for (ms, ok, conflicts) in [(2, true, 0), (4, true, 2), (6, false, 0)] {
            stats.add(&OpSample {
                kind: OpKind::Add,
                latency: Duration::from_millis(ms),
                ok,
                round_trips: Some(RoundTrips {
                    reads: 1,
                    commits: 1 + conflicts,
                }),
                commits: Some(CommitWork {
                    conflicts,
                    keys_written: 4 * (1 + conflicts),
                    conditions: 12 * (1 + conflicts) + 1,
                }),
            });
        }
        stats.add(&OpSample {
            kind: OpKind::Del,
            latency: Duration::from_millis(1),
            ok: true,
            round_trips: None,
            commits: None,
        });
        assert_eq!(stats.finished(), 4);
        assert_eq!(stats.errors(), 1);
        let summary = stats.summarize();
        let add = &summary[&OpKind::Add];
        assert_eq!((add.count, add.errors), (3, 1));
        assert_eq!(add.p50_ms, Some(4.0));
        assert_eq!(add.max_ms, Some(6.0));
        assert_eq!(add.conflicts, Some(2));
        assert_eq!(add.round_trips_per_op, Some((3.0 + 5.0) / 3.0));
        // 5 commits (1 + 3 + 1), each writing 4 keys; 60 conditions and one more per sample.
        assert_eq!(add.keys_written_per_commit, Some(4.0));
        assert_eq!(add.conditions_per_commit, Some(63.0 / 5.0));
        let del = &summary[&OpKind::Del];
        assert_eq!(
            (
                del.count,
                del.round_trips_per_op,
                del.conflicts,
                del.keys_written_per_commit,
                del.conditions_per_commit
            ),
            (1, None, None, None, None)
        );
        assert_eq!(add.mean_ms, Some(4.0));
        let none = &summary[&OpKind::FirstAdd];
        assert_eq!(
            (
                none.count,
                none.mean_ms,
                none.reads_per_op,
                none.conflicts,
                none.conditions_per_commit
            ),
            (0, None, None, None, None)
        );
    }

    /// A kind some of whose operations went unobserved gives no per-operation figure (a mean over
    /// part of them would pass for the whole); one that sent no commit gives no per-commit shape.
    #[test]
    fn summaries_give_no_figure_that_not_every_operation_observed() {
        let mut stats = Stats::default();
        let observed = |kind, commits: u64| OpSample {
            kind,
            latency: Duration::from_millis(1),
            ok: false,
            round_trips: Some(RoundTrips { reads: 1, commits }),
            commits: Some(CommitWork {
                conflicts: 0,
                keys_written: 2 * commits,
                conditions: 3 * commits,
            }),
        };
        stats.add(&observed(OpKind::Add, 1));
        stats.add(&OpSample {
            round_trips: None,
            commits: None,
            ..observed(OpKind::Add, 1)
        });
        stats.add(&observed(OpKind::Del, 0));
        assert_eq!(stats.errors(), 3);
        let summary = stats.summarize();
        let add = &summary[&OpKind::Add];
        assert_eq!(
            (
                add.count,
                add.reads_per_op,
                add.commits_per_op,
                add.round_trips_per_op,
                add.conflicts,
                add.keys_written_per_commit,
                add.conditions_per_commit
            ),
            (2, None, None, None, None, None, None)
        );
        let del = &summary[&OpKind::Del];
        assert_eq!(
            (del.reads_per_op, del.conflicts, del.keys_written_per_commit),
            (Some(1.0), Some(0), None)
        );
    }
}
