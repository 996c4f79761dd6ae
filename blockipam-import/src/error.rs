//! Why an import did not happen or did not finish, one variant per kind of cause.

use ipam_core::{IpamError, KvError};

/// Why an import failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The Calico source settings are wrong whatever etcd holds (bad endpoint, unreadable TLS file).
    #[error("{0}")]
    InvalidSource(String),
    /// The Calico etcd could not be reached or refused a read.
    #[error("{0}")]
    Source(String),
    /// The revision an interrupted import was reading has been compacted away.
    #[error("{0}")]
    Compacted(String),
    /// The Calico data holds something blockipam cannot represent; nothing was written.
    #[error("the Calico datastore cannot be imported, nothing was written: {}", .0.join("; "))]
    Unmappable(Vec<String>),
    /// The target store already holds blockipam data (and no interrupted import of this source).
    #[error("{0}")]
    TargetNotEmpty(String),
    /// Reading or writing the target store failed.
    #[error("{0}")]
    Target(String),
    /// The written store does not hold what the Calico datastore held.
    #[error("verification failed: {0}")]
    Verify(String),
}

impl From<KvError> for ImportError {
    fn from(error: KvError) -> Self {
        ImportError::Target(format!("target store: {error}"))
    }
}

impl From<IpamError> for ImportError {
    fn from(error: IpamError) -> Self {
        ImportError::Target(format!("target store: {error}"))
    }
}
