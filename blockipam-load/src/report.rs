//! A run's result: throughput, per-kind latency, round trips and conflicts, errors, the final
//! `check`, the duplicate comparison and etcd's database size; as JSON or as text.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use ipam_core::CheckReport;
use serde::Serialize;

use crate::config::LoadConfig;
use crate::etcd_status::MemberStatus;
use crate::prefill::PrefillSummary;
use crate::raw_ceiling::RawCeiling;
use crate::schedule::OpKind;
use crate::stats::KindSummary;
use crate::verify::Verification;

/// How many error messages a report keeps.
pub const ERROR_SAMPLES: usize = 10;

/// etcd's database before, during and after the run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EtcdSizes {
    /// Each member after setup, before the first operation.
    pub before: Vec<MemberStatus>,
    /// Samples taken during the run (`--etcd-status-interval-seconds`).
    pub during: Vec<EtcdSample>,
    /// Each member after the run and the verification.
    pub after: Vec<MemberStatus>,
    /// The revision compacted to (`--compact-at-end`).
    pub compacted_to_revision: Option<i64>,
    /// Why the compaction failed.
    pub compaction_error: Option<String>,
    /// Each member after the compaction.
    pub after_compaction: Vec<MemberStatus>,
}

/// One sample during the run.
#[derive(Debug, Clone, Serialize)]
pub struct EtcdSample {
    /// Seconds since the run started.
    pub elapsed_seconds: f64,
    /// Operations finished by then.
    pub operations: u64,
    /// The largest member database, in bytes.
    pub max_db_size_bytes: Option<i64>,
    /// The largest in-use size, in bytes.
    pub max_db_size_in_use_bytes: Option<i64>,
}

/// The pool after the run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PoolState {
    /// Blocks that exist.
    pub blocks: u64,
    /// Blocks affine to a host.
    pub affine_blocks: u64,
    /// Addresses in use in those blocks.
    pub in_use: u64,
    /// Addresses those blocks can hold.
    pub capacity: u64,
}

/// The final consistency check.
#[derive(Debug, Clone, Serialize)]
pub struct CheckSummary {
    /// No problem found.
    pub clean: bool,
    /// The check's report.
    pub report: CheckReport,
}

/// Everything a run measured and found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The parameters.
    pub config: LoadConfig,
    /// The store, described.
    pub store: String,
    /// How the simulated nodes reach the store.
    pub store_clients: String,
    /// Wall time from the first operation to the last one finishing.
    pub elapsed_seconds: f64,
    /// Operations finished.
    pub operations: u64,
    /// `operations / elapsed_seconds`.
    pub operations_per_second: f64,
    /// Per kind: `first_add` (a node's first ADD, which claims its block), `add`, `del`.
    pub kinds: BTreeMap<OpKind, KindSummary>,
    /// Operations that failed (any error other than a conflict the allocator retried).
    pub errors: u64,
    /// The first error messages.
    pub error_samples: Vec<String>,
    /// Addresses handed to a second pod while the first still held it, seen during the run.
    pub duplicates_during_run: u64,
    /// Their descriptions (the first ones).
    pub duplicate_samples: Vec<String>,
    /// The end-of-run comparison with `list_allocations`.
    pub verification: Verification,
    /// The final `check`.
    pub check: CheckSummary,
    /// The pool after the run.
    pub pool: PoolState,
    /// etcd's database size (etcd only).
    pub etcd: Option<EtcdSizes>,
    /// The prefilled allocations and whether they were all still there at the end (`--prefill`).
    pub prefill: Option<PrefillSummary>,
    /// The raw etcd-client loop of one-key conditional writes (`--raw-etcd-ceiling-seconds`).
    pub raw_ceiling: Option<RawCeiling>,
    /// `operations_per_second` (ADDs and DELs) / the raw loop's `writes_per_second`.
    pub allocation_to_raw_ratio: Option<f64>,
    /// What etcd's members themselves spent on the run's operations and on the raw loop's
    /// writes (with `--raw-etcd-ceiling-seconds`).
    pub etcd_cpu: Option<EtcdCpu>,
    /// No error, no duplicate, nothing missing or leaked, and a clean check.
    pub passed: bool,
}

/// The CPU etcd's members spent (summed over them, read from their `process_cpu_seconds_total`)
/// during the allocation run and during the raw loop: each operation's cost to etcd itself,
/// whatever else (the load generator standing in for every node's agent) shares the cores.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EtcdCpu {
    /// CPU seconds over the allocation run (from before its first operation to after its last).
    pub run_seconds: Option<f64>,
    /// `run_seconds` per operation, in milliseconds.
    pub per_operation_ms: Option<f64>,
    /// CPU seconds over the raw loop's measured span.
    pub raw_seconds: Option<f64>,
    /// `raw_seconds` per raw write, in milliseconds.
    pub per_raw_write_ms: Option<f64>,
    /// `per_raw_write_ms / per_operation_ms`: the operations etcd's CPU serves for the cost of
    /// one raw write (1 when an operation costs etcd what a raw write does).
    pub raw_write_to_operation: Option<f64>,
    /// Why a figure is missing (a member that could not be asked).
    pub error: Option<String>,
}

impl EtcdCpu {
    /// From the run's CPU seconds (or why they are unknown), its operations and the raw loop.
    pub fn new(run: Result<f64, String>, operations: u64, raw: &RawCeiling) -> Self {
        let per = |seconds: f64, count: u64| (count > 0).then(|| seconds * 1000.0 / count as f64);
        let (run_seconds, mut error) = match run {
            Ok(seconds) => (Some(seconds), None),
            Err(e) => (None, Some(e)),
        };
        if error.is_none() {
            error.clone_from(&raw.etcd_cpu_error);
        }
        let per_operation_ms = run_seconds.and_then(|s| per(s, operations));
        let per_raw_write_ms = raw.etcd_cpu_seconds.and_then(|s| per(s, raw.writes));
        EtcdCpu {
            run_seconds,
            per_operation_ms,
            raw_seconds: raw.etcd_cpu_seconds,
            per_raw_write_ms,
            raw_write_to_operation: per_raw_write_ms
                .zip(per_operation_ms)
                .filter(|(_, operation)| *operation > 0.0)
                .map(|(raw, operation)| raw / operation),
            error,
        }
    }
}

impl Report {
    /// Duplicates during the run plus duplicates at the end.
    pub fn duplicates(&self) -> u64 {
        self.duplicates_during_run + self.verification.duplicates
    }

    /// Whether the run passed (see [`Report::passed`]).
    pub fn compute_passed(&self) -> bool {
        self.errors == 0
            && self.duplicates() == 0
            && self.verification.is_clean()
            && self.check.clean
            && self.prefill.as_ref().is_none_or(PrefillSummary::is_clean)
            && self.raw_ceiling.as_ref().is_none_or(|raw| raw.errors == 0)
    }

    /// The report for people.
    pub fn to_text(&self) -> String {
        let c = &self.config;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "blockipam-load: {} mode, {} nodes x {} pods, pool {} (blocks {}), strict affinity {}, seed {}, concurrency {}",
            c.mode.as_str(),
            c.nodes,
            c.pods_per_node,
            c.pool,
            c.block_size
                .map(|b| format!("/{b}"))
                .unwrap_or_else(|| "of the default size".into()),
            c.strict_affinity,
            c.seed,
            c.concurrency
        );
        if u64::from(c.concurrency) > c.streams() {
            let _ = writeln!(
                out,
                "at most {} operations in flight: one per pod stream ({} nodes x {} lanes; --lanes-per-node N gives a node N streams)",
                c.streams(),
                c.nodes,
                c.lanes_per_node
            );
        }
        if c.lanes_per_node > 1 {
            let _ = writeln!(
                out,
                "{} lanes per node: {} pod streams, each with its own schedule and {} pods, sharing its node's identity",
                c.lanes_per_node,
                c.streams(),
                c.pods_per_node
            );
        }
        let _ = writeln!(out, "store: {} ({})", self.store, self.store_clients);
        let _ = writeln!(
            out,
            "{} operations in {:.2} s: {:.1} operations/s",
            self.operations, self.elapsed_seconds, self.operations_per_second
        );
        let _ = writeln!(
            out,
            "{:<10} {:>8} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9} {:>10} {:>10} {:>12}",
            "kind",
            "count",
            "errors",
            "p50 ms",
            "p95 ms",
            "p99 ms",
            "max ms",
            "trips/op",
            "commits/op",
            "conflicts",
            "keys/commit"
        );
        let ms = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into());
        for (kind, s) in &self.kinds {
            let _ = writeln!(
                out,
                "{:<10} {:>8} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9} {:>10} {:>10} {:>12}",
                kind.as_str(),
                s.count,
                s.errors,
                ms(s.p50_ms),
                ms(s.p95_ms),
                ms(s.p99_ms),
                ms(s.max_ms),
                ms(s.round_trips_per_op),
                ms(s.commits_per_op),
                s.conflicts
                    .map(|n| n.to_string())
                    .unwrap_or_else(|| "-".into()),
                match (s.keys_written_per_commit, s.conditions_per_commit) {
                    (Some(written), Some(tested)) => format!("{written:.1}w {tested:.1}c"),
                    _ => "-".into(),
                }
            );
        }
        let _ = writeln!(
            out,
            "pool: {} blocks ({} affine), {} of {} addresses in use",
            self.pool.blocks, self.pool.affine_blocks, self.pool.in_use, self.pool.capacity
        );
        let v = &self.verification;
        let _ = writeln!(
            out,
            "pods: {} live holding {} addresses; store: {} allocations ({} of this run)",
            v.live_pods, v.believed_addresses, v.store_allocations, v.run_allocations
        );
        let _ = writeln!(
            out,
            "duplicates: {} (during the run {}, at the end {}); missing: {}; leaked: {}",
            self.duplicates(),
            self.duplicates_during_run,
            v.duplicates,
            v.missing,
            v.leaked
        );
        for sample in self.duplicate_samples.iter().chain(&v.samples) {
            let _ = writeln!(out, "  {sample}");
        }
        let _ = writeln!(
            out,
            "check: {} ({} blocks, {} handles, {} allocations checked)",
            if self.check.clean {
                "clean"
            } else {
                "PROBLEMS"
            },
            self.check.report.blocks_checked,
            self.check.report.handles_checked,
            self.check.report.allocations_checked
        );
        for problem in self.check.report.problems.iter().take(ERROR_SAMPLES) {
            let _ = writeln!(out, "  {}: {}", problem.kind, problem.detail);
        }
        let _ = writeln!(out, "errors: {}", self.errors);
        for error in &self.error_samples {
            let _ = writeln!(out, "  {error}");
        }
        if let Some(etcd) = &self.etcd {
            let mib = |v: Option<i64>| {
                v.map(|b| format!("{:.2} MiB", b as f64 / 1_048_576.0))
                    .unwrap_or_else(|| "-".into())
            };
            let line = |members: &[MemberStatus]| {
                members
                    .iter()
                    .map(|m| match &m.error {
                        Some(e) => format!("{}: {e}", m.endpoint),
                        None => format!(
                            "{} {} (in use {}, revision {})",
                            m.endpoint,
                            mib(m.db_size_bytes),
                            mib(m.db_size_in_use_bytes),
                            m.revision.unwrap_or_default()
                        ),
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            };
            let _ = writeln!(out, "etcd db before: {}", line(&etcd.before));
            let _ = writeln!(out, "etcd db after:  {}", line(&etcd.after));
            if let Some(revision) = etcd.compacted_to_revision {
                let _ = writeln!(
                    out,
                    "etcd db after compacting to revision {revision}: {}",
                    line(&etcd.after_compaction)
                );
            }
            if let Some(error) = &etcd.compaction_error {
                let _ = writeln!(out, "etcd compaction failed: {error}");
            }
        }
        if let Some(prefill) = &self.prefill {
            let _ = writeln!(
                out,
                "prefill: {} addresses in {} handles held by {} (in {:.2} s, not measured); at the end {} present, {} missing, {} held by another handle",
                prefill.addresses,
                prefill.handles,
                prefill.node,
                prefill.seconds,
                prefill.present,
                prefill.missing,
                prefill.held_by_another
            );
            for sample in &prefill.samples {
                let _ = writeln!(out, "  {sample}");
            }
        }
        if let Some(raw) = &self.raw_ceiling {
            let _ = writeln!(
                out,
                "raw etcd ceiling ({}): {} workers, {} conditional one-key writes of {} bytes (each with {} more puts and {} more conditions) in {:.2} s: {:.1} writes/s; {} errors; {} keys deleted",
                raw.when,
                raw.workers,
                raw.writes,
                raw.value_bytes,
                raw.shape.extra_puts,
                raw.shape.extra_conditions,
                raw.seconds,
                raw.writes_per_second,
                raw.errors,
                raw.keys_deleted
            );
            for error in &raw.error_samples {
                let _ = writeln!(out, "  {error}");
            }
            if let Some(ratio) = self.allocation_to_raw_ratio {
                let _ = writeln!(
                    out,
                    "allocation to raw ratio: {:.3} ({:.1} operations/s / {:.1} writes/s)",
                    ratio, self.operations_per_second, raw.writes_per_second
                );
            }
            if let Some(cpu) = &self.etcd_cpu {
                let ms = |v: Option<f64>| v.map_or("unknown".to_owned(), |v| format!("{v:.3} ms"));
                let _ = writeln!(
                    out,
                    "etcd CPU (its members, summed): {} per operation, {} per raw write; raw write to operation: {}{}",
                    ms(cpu.per_operation_ms),
                    ms(cpu.per_raw_write_ms),
                    cpu.raw_write_to_operation
                        .map_or("unknown".to_owned(), |r| format!("{r:.3}")),
                    cpu.error
                        .as_ref()
                        .map_or(String::new(), |e| format!(" ({e})"))
                );
            }
        }
        let _ = writeln!(out, "result: {}", if self.passed { "PASS" } else { "FAIL" });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(writes: u64, cpu: Result<f64, &str>) -> RawCeiling {
        RawCeiling {
            writes,
            etcd_cpu_seconds: cpu.ok(),
            etcd_cpu_error: cpu.err().map(str::to_owned),
            ..RawCeiling::default()
        }
    }

    #[test]
    fn etcd_cpu_per_operation_and_per_raw_write_and_their_ratio() {
        let cpu = EtcdCpu::new(Ok(3.0), 1_000, &raw(4_000, Ok(6.0)));
        assert_eq!(cpu.per_operation_ms, Some(3.0));
        assert_eq!(cpu.per_raw_write_ms, Some(1.5));
        assert_eq!(cpu.raw_write_to_operation, Some(0.5));
        assert_eq!(cpu.error, None);
    }

    #[test]
    fn a_phase_etcd_could_not_be_asked_about_leaves_its_figures_and_the_ratio_unknown() {
        let cpu = EtcdCpu::new(Err("member down".into()), 1_000, &raw(4_000, Ok(6.0)));
        assert_eq!((cpu.run_seconds, cpu.per_operation_ms), (None, None));
        assert_eq!(cpu.per_raw_write_ms, Some(1.5));
        assert_eq!(cpu.raw_write_to_operation, None);
        assert_eq!(cpu.error.as_deref(), Some("member down"));
        let cpu = EtcdCpu::new(Ok(3.0), 1_000, &raw(4_000, Err("no metric")));
        assert_eq!(cpu.per_operation_ms, Some(3.0));
        assert_eq!((cpu.raw_seconds, cpu.per_raw_write_ms), (None, None));
        assert_eq!(cpu.raw_write_to_operation, None);
        assert_eq!(cpu.error.as_deref(), Some("no metric"));
    }

    #[test]
    fn no_operations_or_no_cpu_spent_gives_no_ratio() {
        let cpu = EtcdCpu::new(Ok(3.0), 0, &raw(0, Ok(6.0)));
        assert_eq!((cpu.per_operation_ms, cpu.per_raw_write_ms), (None, None));
        assert_eq!(cpu.raw_write_to_operation, None);
        let cpu = EtcdCpu::new(Ok(0.0), 10, &raw(10, Ok(1.0)));
        assert_eq!(cpu.per_operation_ms, Some(0.0));
        assert_eq!(cpu.raw_write_to_operation, None);
    }
}
