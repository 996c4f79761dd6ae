//! `SledConfig`: where the sled store lives and how long `open` waits for another process.

use std::path::PathBuf;
use std::time::Duration;

use ipam_core::lockfile::DEFAULT_LOCK_WAIT;

/// How to open a [`SledStore`](crate::SledStore).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SledConfig {
    /// The store's directory. It is created (mode 0700) when missing; the lock file
    /// `<path>.lock` and, while a store is being created, `<path>.creating` sit beside it.
    pub path: PathBuf,
    /// How long [`SledStore::open`](crate::SledStore::open) waits for another process (or handle)
    /// that holds the store before failing with `KvError::Unavailable`.
    pub lock_wait: Duration,
}

impl SledConfig {
    /// A configuration for the store at `path`, waiting [`DEFAULT_LOCK_WAIT`] for other processes.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            lock_wait: DEFAULT_LOCK_WAIT,
        }
    }

    /// The same configuration with another lock wait.
    pub fn with_lock_wait(mut self, lock_wait: Duration) -> Self {
        self.lock_wait = lock_wait;
        self
    }
}
