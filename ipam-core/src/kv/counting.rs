//! A store wrapper that counts round trips (calls that reach the store), for benchmarks and tests
//! that hold the allocator to its round-trip budget.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;

use crate::kv::{CachedRead, KeyValue, KvError, KvStore, Read, ReadResult, Revision, Txn};

/// Round trips counted by a [`CountingStore`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundTrips {
    /// Reads (`get`, `list`, or one `read_many` batch).
    pub reads: u64,
    /// Transactions.
    pub commits: u64,
}

impl RoundTrips {
    /// Reads plus commits.
    pub fn total(&self) -> u64 {
        self.reads + self.commits
    }
}

/// Wraps a store and counts each call that reaches it. A `read_many` batch counts as one read
/// (backends answer it with one request); provided helpers count as the calls they make.
#[derive(Debug)]
pub struct CountingStore {
    inner: Arc<dyn KvStore>,
    reads: AtomicU64,
    commits: AtomicU64,
}

impl CountingStore {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn KvStore>) -> Self {
        CountingStore {
            inner,
            reads: AtomicU64::new(0),
            commits: AtomicU64::new(0),
        }
    }

    /// Counts so far.
    pub fn round_trips(&self) -> RoundTrips {
        RoundTrips {
            reads: self.reads.load(Ordering::SeqCst),
            commits: self.commits.load(Ordering::SeqCst),
        }
    }

    /// Returns the counts so far and starts again from zero.
    pub fn take(&self) -> RoundTrips {
        RoundTrips {
            reads: self.reads.swap(0, Ordering::SeqCst),
            commits: self.commits.swap(0, Ordering::SeqCst),
        }
    }
}

#[async_trait]
impl KvStore for CountingStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.list(prefix).await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.commits.fetch_add(1, Ordering::SeqCst);
        self.inner.commit(txn).await
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.read_many(reads).await
    }

    async fn read_many_cached(
        &self,
        reads: &[Read],
        may_use_cache: bool,
    ) -> Result<CachedRead, KvError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.read_many_cached(reads, may_use_cache).await
    }
}
