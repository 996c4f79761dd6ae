//! `SledConfig`: where the sled store lives, whether `open` may create it, and how long `open` waits for another process.

use std::path::PathBuf;
use std::time::Duration;

use ipam_core::lockfile::DEFAULT_LOCK_WAIT;

/// How to open a [`SledStore`](crate::SledStore).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SledConfig {
    /// The store's directory. The lock file `<path>.lock` and, while a store is being created,
    /// `<path>.creating` sit beside it.
    pub path: PathBuf,
    /// How long [`SledStore::open`](crate::SledStore::open) waits for another process (or handle)
    /// that holds the store before failing with `KvError::Unavailable`.
    pub lock_wait: Duration,
    /// Whether `open` creates the store (mode 0700) when the path is missing or an empty
    /// directory. Off by default: a store that vanished (a deleted directory, an unmounted volume
    /// leaving an empty mount point) is then an error, not a silently re-created empty store that
    /// would hand out addresses still in use.
    pub create_if_missing: bool,
}

impl SledConfig {
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
