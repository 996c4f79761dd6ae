//! Running a blocking storage-engine call off the async runtime, for the embedded adapters: a
//! panic inside the engine (damaged files) becomes a [`KvError`] instead of bringing the caller down.

use std::any::Any;
use std::path::Path;

use tokio::task::JoinError;

use crate::kv::KvError;

/// What a blocking task was doing, which decides what a panic inside it means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Opening (or creating) the store: nothing was acknowledged.
    Open,
    /// A read: nothing was written.
    Read,
    /// A transaction: it may or may not have landed.
    Write,
}

/// Runs `work` on tokio's blocking pool; a panic in it becomes the error [`task_failed`] describes.
///
/// # Errors
/// Whatever `work` returns, or the converted panic.
pub async fn run_blocking<T, F>(
    engine: &'static str,
    stage: Stage,
    path: &Path,
    work: F,
) -> Result<T, KvError>
where
    F: FnOnce() -> Result<T, KvError> + Send + 'static,
    T: Send + 'static,
{
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result,
        Err(err) => Err(task_failed(engine, err, stage, path)),
    }
}

/// Converts the failure of a blocking task (a panic inside the engine, or a runtime that shut down
/// before the task ran) into an error the caller can act on: corrupt for opens and reads (the files
/// are probably damaged), indeterminate for writes (the write may or may not have landed).
pub fn task_failed(engine: &str, err: JoinError, stage: Stage, path: &Path) -> KvError {
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
            format!("{engine} panicked while opening {shown} ({why}); its files are probably damaged"),
        ),
        Stage::Read => KvError::corrupt(
            None,
            format!("{engine} panicked while reading {shown} ({why}); its files are probably damaged"),
        ),
        Stage::Write => KvError::Indeterminate {
            message: format!("{engine} panicked during a write to {shown} ({why}); the write may or may not have landed"),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_while_reading_is_corrupt_and_while_writing_is_indeterminate() {
        let path = Path::new("/tmp/store");
        let read: Result<(), KvError> =
            run_blocking("engine", Stage::Read, path, || panic!("bad page")).await;
        match read {
            Err(KvError::Corrupt { message, .. }) => {
                assert!(message.contains("bad page") && message.contains("/tmp/store"))
            }
            other => panic!("expected corrupt, got {other:?}"),
        }
        let write: Result<(), KvError> =
            run_blocking("engine", Stage::Write, path, || panic!("oops")).await;
        assert!(matches!(write, Err(KvError::Indeterminate { .. })));
        let ok = run_blocking("engine", Stage::Open, path, || Ok(7)).await;
        assert_eq!(ok, Ok(7));
    }
}
