//! Conversion of redb's errors into [`KvError`] (panics inside redb are handled by `ipam_core::blocking`).

use std::io;
use std::path::Path;

use ipam_core::KvError;

/// Converts a redb error met while working on the store at `path`.
///
/// Commit failures are not passed here: the caller reports them as indeterminate.
pub(crate) fn engine_error(err: impl Into<redb::Error>, path: &Path) -> KvError {
    let shown = path.display();
    match err.into() {
        redb::Error::DatabaseAlreadyOpen | redb::Error::LockProtocolMismatch => {
            KvError::unavailable(format!(
                "the redb database {shown} is held by another handle or process"
            ))
        }
        redb::Error::Corrupted(message) => KvError::corrupt(
            None,
            format!("redb found damaged data in {shown}: {message}"),
        ),
        redb::Error::Io(err)
            if matches!(
                err.kind(),
                io::ErrorKind::InvalidData | io::ErrorKind::UnexpectedEof
            ) =>
        {
            KvError::corrupt(
                None,
                format!("{shown} is not a readable redb database: {err}"),
            )
        }
        redb::Error::Io(err) => {
            KvError::other(format!("I/O error on the redb store {shown}: {err}"))
        }
        redb::Error::TableDoesNotExist(table) => KvError::corrupt(
            None,
            format!("the redb store {shown} has no table {table:?}"),
        ),
        redb::Error::TableTypeMismatch { table, .. }
        | redb::Error::TableIsMultimap(table)
        | redb::Error::TableIsNotMultimap(table) => KvError::corrupt(
            None,
            format!("the table {table:?} in {shown} is not one this software writes"),
        ),
        redb::Error::UpgradeRequired(version) => KvError::other(format!(
            "{shown} is in redb file format {version}, which this build cannot read"
        )),
        other => KvError::other(format!("redb failed on {shown}: {other}")),
    }
}

/// `result.engine(path)`: [`engine_error`] on the error of any redb call.
pub(crate) trait EngineResult<T> {
    /// Converts the error, naming the store at `path`.
    fn engine(self, path: &Path) -> Result<T, KvError>;
}

impl<T, E: Into<redb::Error>> EngineResult<T> for Result<T, E> {
    fn engine(self, path: &Path) -> Result<T, KvError> {
        self.map_err(|err| engine_error(err, path))
    }
}
