//! Conversion of sled's errors, and of a blocking task that panicked, into [`KvError`].

use std::any::Any;
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

/// Converts the failure of a blocking task (a panic inside sled, or a runtime that shut down
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
            format!("sled panicked while opening {shown} ({why}); its files are probably damaged"),
        ),
        Stage::Read => KvError::corrupt(
            None,
            format!("sled panicked while reading {shown} ({why}); its files are probably damaged"),
        ),
        Stage::Write => KvError::Indeterminate {
            message: format!(
                "sled panicked during a write to {shown} ({why}); the write may or may not have landed"
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
