//! The check report (`check -o json`): its versioned header, the store it names, and reading one
//! back for `release --from-report`.

use std::path::Path;

use blockipam_store::{DatastoreSettings, StoreIdentity};
use ipam_core::check::kinds;
use ipam_core::Problem;
use serde::{Deserialize, Serialize};

use crate::error::CtlError;

/// What the `report` field of every check report says.
pub const REPORT_NAME: &str = "blockipam-check-report";

/// The version of the report document this build writes and reads.
pub const REPORT_VERSION: u32 = 1;

/// The problem kinds whose addresses `release --from-report` releases: addresses the blocks hold
/// for a handle that does not exist. A CNI DEL finds a container's addresses through its handle,
/// so no DEL will ever free these.
pub const RELEASABLE_KINDS: &[&str] = &[kinds::MISSING_HANDLE];

/// Why a problem of `kind` is not released from a report.
pub fn not_releasable_reason(kind: &str) -> &'static str {
    match kind {
        kinds::HANDLE_COUNT => {
            "its handle exists, so the pod's DEL releases its addresses; `check --repair` fixes the counts"
        }
        _ => "it names no leaked address; see the problem's remedy",
    }
}

/// The store a report was made from, as the agent socket compares stores: embedded stores by
/// their canonical path, etcd by its endpoints and key prefix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportStore {
    /// `sled`, `redb` or `etcdv3`.
    pub datastore_type: String,
    /// Embedded stores: the canonical path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// etcd: the endpoints, without scheme.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub etcd_endpoints: Vec<String>,
    /// etcd: the key prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_prefix: Option<String>,
}

impl ReportStore {
    /// The store these settings select.
    pub fn of(settings: &DatastoreSettings) -> ReportStore {
        let identity = settings.identity();
        ReportStore {
            datastore_type: identity.datastore_type,
            path: identity.path,
            etcd_endpoints: identity.etcd_endpoints,
            etcd_prefix: identity.etcd_prefix,
        }
    }

    /// The same store as the agent socket's identity, which compares and prints stores.
    fn identity(&self) -> StoreIdentity {
        StoreIdentity {
            datastore_type: self.datastore_type.clone(),
            path: self.path.clone(),
            etcd_endpoints: self.etcd_endpoints.clone(),
            etcd_prefix: self.etcd_prefix.clone(),
        }
    }

    /// Whether both name the same store, as [`StoreIdentity::matches`] decides: same type, and
    /// the same path (embedded stores) or the same prefix and at least one common endpoint (etcd).
    pub fn matches(&self, other: &ReportStore) -> bool {
        self.identity().matches(&other.identity())
    }
}

impl std::fmt::Display for ReportStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.identity().fmt(f)
    }
}

/// The parts of a check report `release --from-report` reads.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReportHeader {
    report: String,
    version: u32,
}

/// A report as `release --from-report` reads it (fields it does not need are ignored).
#[derive(Debug, Deserialize)]
pub struct Report {
    /// The store it was made from.
    pub store: ReportStore,
    /// The problems found (before any repair).
    pub problems: Vec<Problem>,
    /// With `check --repair`: what was left after the repair.
    #[serde(default)]
    pub remaining: Option<Vec<Problem>>,
}

impl Report {
    /// The problems still standing when the report was written: what was left after a repair,
    /// else everything found.
    pub fn standing(&self) -> &[Problem] {
        self.remaining.as_deref().unwrap_or(&self.problems)
    }
}

/// Reads and validates the report at `path`: a check report of [`REPORT_VERSION`], made from the
/// store `settings` select.
///
/// # Errors
/// [`CtlError::Usage`] for an unreadable file, a document that is not a check report, or a report
/// of another version; [`CtlError::Failed`] for a report made from another store.
pub fn read(path: &Path, settings: &DatastoreSettings) -> Result<Report, CtlError> {
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| CtlError::usage(format!("cannot read the report {shown}: {e}")))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        CtlError::usage(format!(
            "{shown} is not a check report (not JSON: {e}); write one with `blockipamctl check -o json > FILE`"
        ))
    })?;
    let header = value
        .as_object()
        .map(|object| {
            let mut header = serde_json::Map::new();
            for field in ["report", "version"] {
                if let Some(v) = object.get(field) {
                    header.insert(field.to_owned(), v.clone());
                }
            }
            serde_json::Value::Object(header)
        })
        .ok_or_else(|| {
            CtlError::usage(format!("{shown} is not a check report (not a JSON object)"))
        })?;
    let header: ReportHeader = serde_json::from_value(header).map_err(|e| {
        CtlError::usage(format!(
            "{shown} is not a check report ({e}); write one with `blockipamctl check -o json > FILE`"
        ))
    })?;
    if header.report != REPORT_NAME {
        return Err(CtlError::usage(format!(
            "{shown} is not a check report: its \"report\" field is {:?}, not {REPORT_NAME:?}",
            header.report
        )));
    }
    if header.version != REPORT_VERSION {
        return Err(CtlError::usage(format!(
            "{shown} is a check report of version {}; this blockipamctl reads version \
             {REPORT_VERSION}: make the report again with this blockipamctl",
            header.version
        )));
    }
    let report: Report = serde_json::from_value(value)
        .map_err(|e| CtlError::usage(format!("{shown} is a damaged check report: {e}")))?;
    let here = ReportStore::of(settings);
    if !report.store.matches(&here) {
        return Err(CtlError::failed(format!(
            "{shown} was made from another store ({}), not the selected one ({here}): nothing was \
             released; run `blockipamctl check -o json` against this store for its own report",
            report.store
        )));
    }
    Ok(report)
}
