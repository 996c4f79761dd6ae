//! Conversion of sled's errors into [`KvError`] (panics inside sled are handled by `ipam_core::blocking`).

use std::path::Path;

use ipam_core::KvError;

/// True when sled refused to open because another handle still holds its own lock on `db`.
pub(crate) fn is_engine_lock_busy(err: &sled::Error) -> bool {
    matches!(err, sled::Error::Io(io) if io.to_string().contains("could not acquire lock"))
}

/// Converts a sled error met while working on the store at `path`.
pub(crate) fn engine_error(err: sled::Error, path: &Path) -> KvError {
    let shown = path.display();
    if is_engine_lock_busy(&err) {
        return KvError::unavailable(format!(
            "the sled database {shown} is held by another handle: {err}"
        ));
    }
    match err {
        sled::Error::Io(io) => KvError::other(format!("I/O error on the sled store {shown}: {io}")),
        sled::Error::Corruption { at, .. } => KvError::corrupt(
            None,
            format!(
                "sled found damaged data in {shown}{}",
                at.map(|ptr| format!(" at {ptr:?}")).unwrap_or_default()
            ),
        ),
        sled::Error::CollectionNotFound(name) => KvError::corrupt(
            None,
            format!(
                "the sled store {shown} has no tree {:?}",
                String::from_utf8_lossy(&name)
            ),
        ),
        sled::Error::Unsupported(message) => {
            KvError::other(format!("sled cannot use {shown}: {message}"))
        }
        sled::Error::ReportableBug(message) => {
            KvError::other(format!("sled failed on {shown} (a sled bug): {message}"))
        }
    }
}
