//! A store wrapper that counts commits refused by a failed condition: each is a conflict with
//! another writer that the allocator then retries. (Round trips are counted by
//! [`ipam_core::CountingStore`] underneath it.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use ipam_core::{KeyValue, KvError, KvStore, Read, ReadResult, Revision, Txn};

/// Forwards every call to the inner store and counts [`KvError::Conflict`] answers to commits.
#[derive(Debug)]
pub struct ConflictCounter {
    inner: Arc<dyn KvStore>,
    conflicts: AtomicU64,
}

impl ConflictCounter {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn KvStore>) -> Self {
        ConflictCounter {
            inner,
            conflicts: AtomicU64::new(0),
        }
    }

    /// Returns the conflicts counted so far and starts again from zero.
    pub fn take(&self) -> u64 {
        self.conflicts.swap(0, Ordering::SeqCst)
    }
}

#[async_trait]
impl KvStore for ConflictCounter {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        let result = self.inner.commit(txn).await;
        if matches!(result, Err(KvError::Conflict { .. })) {
            self.conflicts.fetch_add(1, Ordering::SeqCst);
        }
        result
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        self.inner.read_many(reads).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipam_core::{Condition, MemoryStore, Op};

    #[tokio::test]
    async fn refused_commits_are_counted_and_successful_ones_are_not() {
        let counter = ConflictCounter::new(Arc::new(MemoryStore::new()));
        let create = || Txn {
            conditions: vec![Condition::Absent {
                key: "k".to_owned(),
            }],
            ops: vec![Op::Put {
                key: "k".to_owned(),
                value: b"v".to_vec(),
            }],
        };
        counter.commit(create()).await.expect("first create");
        let refused = counter.commit(create()).await;
        assert!(
            matches!(refused, Err(KvError::Conflict { .. })),
            "{refused:?}"
        );
        assert_eq!(counter.take(), 1);
        assert_eq!(counter.take(), 0);
    }
}
