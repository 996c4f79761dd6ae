//! `RedbConfig`: where the redb store file lives, whether `open` may create it, and how long `open` waits for another process.

use std::path::PathBuf;
use std::time::Duration;

use ipam_core::lockfile::DEFAULT_LOCK_WAIT;

/// How to open a [`RedbStore`](crate::RedbStore).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedbConfig {
    /// The store's file. The lock file `<path>.lock` sits beside it.
    pub path: PathBuf,
    /// How long [`RedbStore::open`](crate::RedbStore::open) waits for another process (or handle)
    /// that holds the store before failing with `KvError::Unavailable`.
    pub lock_wait: Duration,
    /// Whether `open` creates the store file (mode 0600) when it is missing (an empty file is
    /// damage, reported as corrupt and never created over). Off by
    /// default: a store that vanished (a deleted file, an unmounted volume) is then an error, not
    /// a silently re-created empty store that would hand out addresses still in use.
    pub create_if_missing: bool,
}

impl RedbConfig {
    /// A configuration for the existing store at `path`, waiting [`DEFAULT_LOCK_WAIT`] for other
    /// processes. Use [`creating`](Self::creating) to allow creating it.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            lock_wait: DEFAULT_LOCK_WAIT,
            create_if_missing: false,
        }
    }

    /// The same configuration with another lock wait.
    pub fn with_lock_wait(mut self, lock_wait: Duration) -> Self {
        self.lock_wait = lock_wait;
        self
    }

    /// The same configuration, allowed to create the store when it is missing.
    pub fn creating(mut self) -> Self {
        self.create_if_missing = true;
        self
    }
}
