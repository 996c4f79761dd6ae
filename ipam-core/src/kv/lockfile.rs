//! An exclusive, inter-process file lock with a bounded wait, shared by the embedded stores and the
//! plugin's host lock.

use std::fs::{File, OpenOptions, TryLockError};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long an embedded store or the host lock waits for another process by default.
pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(10);

/// Why a lock could not be taken.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Another process held the lock for the whole wait.
    #[error("timed out after {waited:?} waiting for the lock on {path} (held by another process)")]
    TimedOut {
        /// The lock file.
        path: PathBuf,
        /// How long we waited.
        waited: Duration,
    },
    /// The lock file could not be created or locked.
    #[error("cannot use lock file {path}: {source}")]
    Io {
        /// The lock file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// `<path>.<suffix>`, beside a store kept at `path` (its lock file, its staging file).
///
/// # Errors
/// [`KvError::InvalidArgument`](super::KvError) when `path` does not end in a name.
pub fn sibling(path: &Path, suffix: &str) -> Result<PathBuf, super::KvError> {
    let Some(name) = path.file_name() else {
        return Err(super::KvError::invalid(format!(
            "the store path {} does not end in a name",
            path.display()
        )));
    };
    let mut name = name.to_owned();
    name.push(".");
    name.push(suffix);
    Ok(path.with_file_name(name))
}

/// The store error for a lock on the store at `path` that could not be taken: `Unavailable`
/// (held by another process or handle for the whole wait) or `Other`.
pub fn store_lock_error(err: LockError, path: &Path) -> super::KvError {
    match err {
        LockError::TimedOut { path: lock, waited } => super::KvError::unavailable(format!(
            "the store {} is held by another process or handle: no lock on {} after {waited:?}",
            path.display(),
            lock.display()
        )),
        other => {
            super::KvError::other(format!("cannot lock the store {}: {other}", path.display()))
        }
    }
}

/// A held exclusive lock; released when dropped (or when the process exits, however it exits).
#[derive(Debug)]
pub struct LockFile {
    file: File,
    path: PathBuf,
}

impl LockFile {
    /// Takes the exclusive lock on `path`, creating the file (mode 0600) and its parent directory
    /// (mode 0700) if missing, retrying until `wait` has passed.
    ///
    /// # Errors
    /// [`LockError::TimedOut`] when another process holds it for the whole wait; [`LockError::Io`]
    /// when the file cannot be created or locked.
    pub fn acquire(path: &Path, wait: Duration) -> Result<LockFile, LockError> {
        let io = |source| LockError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            if !parent.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(parent)
                    .map_err(io)?;
            }
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(io)?;
        let started = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            match file.try_lock() {
                Ok(()) => {
                    return Ok(LockFile {
                        file,
                        path: path.to_owned(),
                    })
                }
                Err(TryLockError::WouldBlock) => {}
                Err(TryLockError::Error(e)) => return Err(io(e)),
            }
            let waited = started.elapsed();
            if waited >= wait {
                return Err(LockError::TimedOut {
                    path: path.to_owned(),
                    waited,
                });
            }
            std::thread::sleep(pause.min(wait - waited));
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        // Closing the descriptor releases the lock too; unlocking first makes it immediate even if
        // a duplicate descriptor somehow survives.
        let _ = self.file.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_acquire_times_out_while_first_is_held_and_succeeds_after() {
        let dir = tempfile_dir();
        let path = dir.join("x.lock");
        let first = LockFile::acquire(&path, Duration::from_secs(1)).expect("first");
        match LockFile::acquire(&path, Duration::from_millis(50)) {
            Err(LockError::TimedOut { path: p, .. }) => assert_eq!(p, path),
            other => panic!("expected a timeout, got {other:?}"),
        }
        drop(first);
        LockFile::acquire(&path, Duration::from_millis(50)).expect("after release");
        std::fs::remove_dir_all(dir).expect("cleanup");
    }

    #[test]
    fn a_waiter_takes_the_lock_once_its_holder_lets_go_within_the_wait() {
        let dir = tempfile_dir();
        let path = dir.join("x.lock");
        let held = LockFile::acquire(&path, Duration::from_secs(1)).expect("first");
        let (taking, taken) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn({
            let path = path.clone();
            move || {
                taking.send(()).expect("say it is waiting");
                LockFile::acquire(&path, Duration::from_secs(30)).map(|lock| lock.path().to_owned())
            }
        });
        taken.recv().expect("the waiter started");
        std::thread::sleep(Duration::from_millis(100));
        drop(held);
        let got = waiter.join().expect("the waiter");
        assert_eq!(got.expect("the lock, once let go"), path);
        std::fs::remove_dir_all(dir).expect("cleanup");
    }

    #[test]
    fn a_sibling_is_named_after_the_store_in_its_directory() {
        assert_eq!(
            sibling(Path::new("/var/lib/blockipam/store.db"), "lock").expect("a sibling"),
            Path::new("/var/lib/blockipam/store.db.lock")
        );
        assert_eq!(
            sibling(Path::new("store"), "creating").expect("a sibling"),
            Path::new("store.creating")
        );
        match sibling(Path::new("/"), "lock") {
            Err(super::super::KvError::InvalidArgument { message }) => {
                assert!(message.contains("does not end in a name"), "{message}")
            }
            other => panic!("expected an invalid argument, got {other:?}"),
        }
    }

    #[test]
    fn lock_file_and_parent_are_created_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile_dir();
        let path = dir.join("sub/dir/x.lock");
        let _held = LockFile::acquire(&path, Duration::from_secs(1)).expect("acquire");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let parent_mode = std::fs::metadata(dir.join("sub/dir"))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(parent_mode & 0o777, 0o700);
        std::fs::remove_dir_all(dir).expect("cleanup");
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "blockipam-lock-test-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).expect("mkdir");
        dir
    }
}
