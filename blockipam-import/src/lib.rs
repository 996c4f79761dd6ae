//! Import of a Calico etcdv3 IPAM datastore into an empty blockipam store: read in one etcd
//! revision ([`source`]), map to blockipam's model ([`mapping`]), write and verify ([`writer`]).
//!
//! [`import_calico`] runs the three steps; `blockipamctl import calico` is a thin shell around it.

pub mod calico;
pub mod error;
pub mod mapping;
pub mod source;
pub mod writer;

use std::sync::Arc;

use ipam_core::{IpamConfig, KvStore};
use serde::Serialize;

pub use calico::{CalicoSnapshot, RawEntry};
pub use error::ImportError;
pub use mapping::{map, ImportPlan, Mapping, NotMapped};
pub use source::{CalicoEtcdSource, DEFAULT_CALICO_PREFIX};
pub use writer::{
    inspect_target, interrupted_import, marker_key, ImportMarker, TargetState, WriteOutcome,
};

/// What an import did (or, with `dry_run`, would do).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ImportReport {
    /// The Calico datastore read.
    pub source: String,
    /// The etcd revision every Calico object was read at.
    pub calico_revision: i64,
    /// Nothing was written.
    pub dry_run: bool,
    /// This run finished an interrupted import.
    pub resumed: bool,
    /// Pools imported.
    pub pools: usize,
    /// Blocks imported.
    pub blocks: usize,
    /// Of those, blocks affine to a host.
    pub affine_blocks: usize,
    /// Allocations imported.
    pub allocations: usize,
    /// Addresses Calico had released into IP cooldown, imported still cooling (with their
    /// release times; those whose cooldown is over are freed by the next write of their block).
    pub cooling_addresses: usize,
    /// Handles imported.
    pub handles: usize,
    /// IP reservations imported.
    pub reservations: usize,
    /// Nodes whose Calico labels were imported (what pools' node selectors read).
    pub labelled_nodes: usize,
    /// The IPAM configuration written.
    pub config: IpamConfig,
    /// Whether Calico stored a configuration (else its defaults were imported).
    pub config_from_calico: bool,
    /// The store's sequence floor, above every imported sequence number.
    pub sequence_floor: u64,
    /// Keys this run wrote.
    pub keys_written: usize,
    /// Keys an interrupted run had written already.
    pub keys_already_present: usize,
    /// Transactions this run committed.
    pub transactions: usize,
    /// Every allocation, handle, pool and the config were read back and `check` is clean.
    pub verified: bool,
    /// What was not mapped, and what was done about it.
    pub not_mapped: Vec<NotMapped>,
}

impl ImportReport {
    fn new(source: &str, plan: &ImportPlan, dry_run: bool) -> Self {
        ImportReport {
            source: source.to_owned(),
            calico_revision: plan.calico_revision,
            dry_run,
            resumed: false,
            pools: plan.pools.len(),
            blocks: plan.blocks.len(),
            affine_blocks: plan.blocks.iter().filter(|b| b.affinity.is_some()).count(),
            allocations: plan.expected.len(),
            cooling_addresses: plan.blocks.iter().map(|b| b.cooling.len()).sum(),
            handles: plan.handles.len(),
            reservations: plan.reservations.len(),
            labelled_nodes: plan.node_labels.len(),
            config: plan.config,
            config_from_calico: plan.config_stored,
            sequence_floor: plan.sequence_floor,
            keys_written: 0,
            keys_already_present: 0,
            transactions: 0,
            verified: false,
            not_mapped: plan.not_mapped.clone(),
        }
    }
}

/// Maps a snapshot, refusing (with every reason) when it cannot be imported.
///
/// # Errors
/// [`ImportError::Unmappable`] listing every refusal.
pub fn plan_import(snapshot: &CalicoSnapshot) -> Result<ImportPlan, ImportError> {
    let Mapping { plan, refusals } = map(snapshot);
    if refusals.is_empty() {
        Ok(plan)
    } else {
        Err(ImportError::Unmappable(refusals))
    }
}

/// Reads `source` (at `at_revision`, else its current revision) and maps it.
///
/// # Errors
/// [`ImportError::InvalidSource`], [`ImportError::Source`], [`ImportError::Compacted`] (with
/// what to do), [`ImportError::Unmappable`].
pub async fn read_plan(
    source: &CalicoEtcdSource,
    at_revision: Option<i64>,
) -> Result<ImportPlan, ImportError> {
    let snapshot = source.read(at_revision).await.map_err(|e| match e {
        ImportError::Compacted(message) => ImportError::Compacted(format!(
            "{message}: the interrupted import cannot be resumed from the same snapshot; empty the \
             target store and import again"
        )),
        other => other,
    })?;
    plan_import(&snapshot)
}

/// The revision an interrupted import in `state` read, when it is an import of `source`.
///
/// # Errors
/// [`ImportError::TargetNotEmpty`] when the interrupted import read another datastore.
pub fn resume_revision(
    source: &CalicoEtcdSource,
    state: &TargetState,
) -> Result<Option<i64>, ImportError> {
    match state {
        TargetState::Empty => Ok(None),
        TargetState::Interrupted(marker) if marker.source == source.describe() => {
            Ok(Some(marker.calico_revision))
        }
        TargetState::Interrupted(marker) => Err(ImportError::TargetNotEmpty(format!(
            "the target store holds an interrupted import of {}, not of {}; finish that import \
             (run it again) or empty the target store",
            marker.source,
            source.describe()
        ))),
    }
}

/// What importing `plan` would do, nothing written.
pub fn dry_run_report(source: &CalicoEtcdSource, plan: &ImportPlan) -> ImportReport {
    ImportReport::new(&source.describe(), plan, true)
}

/// Writes `plan` (read from `source`) into `target`, found in `state`, verifies it and removes
/// the import marker.
///
/// # Errors
/// [`ImportError::Target`], [`ImportError::Verify`].
pub async fn write_plan(
    source: &CalicoEtcdSource,
    plan: &ImportPlan,
    target: &Arc<dyn KvStore>,
    state: &TargetState,
) -> Result<ImportReport, ImportError> {
    let description = source.describe();
    let outcome = writer::write(target, plan, state, &description).await?;
    let mut report = ImportReport::new(&description, plan, false);
    report.resumed = matches!(state, TargetState::Interrupted(_));
    report.keys_written = outcome.keys_written;
    report.keys_already_present = outcome.keys_already_present;
    report.transactions = outcome.transactions;
    report.verified = true;
    Ok(report)
}

/// The whole import: read and map `source` first (a refusal opens no target), then the target
/// must be empty, or hold an interrupted import of the same source, which is resumed from the
/// revision it read.
///
/// # Errors
/// Every [`ImportError`]; nothing is written when the source cannot be read or mapped, or the
/// target is not empty.
pub async fn import_calico(
    source: &CalicoEtcdSource,
    target: &Arc<dyn KvStore>,
) -> Result<ImportReport, ImportError> {
    let plan = read_plan(source, None).await?;
    let state = inspect_target(target).await?;
    let plan = match resume_revision(source, &state)? {
        Some(revision) => read_plan(source, Some(revision)).await?,
        None => plan,
    };
    write_plan(source, &plan, target, &state).await
}
