//! Conversion of redb's errors, and of a blocking task that panicked, into [`KvError`].

use std::any::Any;
use std::io;
use std::path::Path;

use ipam_core::KvError;
use tokio::task::JoinError;

/// What a blocking task was doing, which decides what a panic inside it means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// Opening (or creating) the store: nothing was acknowledged.
    Open,
    /// A read: nothing was written.
    Read,
    /// A transaction: it may or may not have landed.
    Write,
}

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

/// Converts the failure of a blocking task (a panic inside redb, or a runtime that shut down
/// before the task ran) into an error the caller can act on.
pub(crate) fn task_failed(err: JoinError, stage: Stage, path: &Path) -> KvError {
    let shown = path.display();
    if !err.is_panic() {
        // spawn_blocking tasks are only cancelled before they start: nothing was done.
        return KvError::unavailable(format!(
            "the runtime shut down before the operation on {shown} ran"
        ));
    }
    let why = panic_message(err.into_panic());
    match stage {
        Stage::Open => KvError::corrupt(
            None,
            format!("redb panicked while opening {shown} ({why}); the file is probably damaged"),
        ),
        Stage::Read => KvError::corrupt(
            None,
            format!("redb panicked while reading {shown} ({why}); the file is probably damaged"),
        ),
        Stage::Write => KvError::Indeterminate {
            message: format!(
                "redb panicked during a write to {shown} ({why}); the write may or may not have landed"
            ),
        },
    }
}

fn panic_message(payload: Box<dyn Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic without a message".to_owned()
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
