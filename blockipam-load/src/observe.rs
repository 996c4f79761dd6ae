//! A store wrapper that counts commits refused by a failed condition (each is a conflict with
//! another writer that the allocator then retries) and the keys each commit writes and tests.
//! (Round trips are counted by [`ipam_core::CountingStore`] underneath it.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use ipam_core::{KeyValue, KvError, KvStore, Read, ReadResult, Revision, Txn};

/// What the commits counted by a [`CommitCounter`] sent to the store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitWork {
    /// Commits refused by a failed condition.
    pub conflicts: u64,
    /// Keys put or deleted, summed over every commit sent (refused ones included).
    pub keys_written: u64,
    /// Conditions tested, summed over every commit sent (refused ones included).
    pub conditions: u64,
}

/// Forwards every call to the inner store, counts [`KvError::Conflict`] answers to commits, and
/// sums the keys each commit writes and the conditions it tests (the transaction's shape, which
/// sets what a store such as etcd can commit per second).
#[derive(Debug)]
pub struct CommitCounter {
    inner: Arc<dyn KvStore>,
    conflicts: AtomicU64,
    keys_written: AtomicU64,
    conditions: AtomicU64,
}

impl CommitCounter {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn KvStore>) -> Self {
        CommitCounter {
            inner,
            conflicts: AtomicU64::new(0),
            keys_written: AtomicU64::new(0),
            conditions: AtomicU64::new(0),
        }
    }

    /// Returns what was counted so far and starts again from zero.
    pub fn take(&self) -> CommitWork {
        CommitWork {
            conflicts: self.conflicts.swap(0, Ordering::SeqCst),
            keys_written: self.keys_written.swap(0, Ordering::SeqCst),
            conditions: self.conditions.swap(0, Ordering::SeqCst),
        }
    }
}

#[async_trait]
impl KvStore for CommitCounter {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.keys_written
            .fetch_add(txn.ops.len() as u64, Ordering::SeqCst);
        self.conditions
            .fetch_add(txn.conditions.len() as u64, Ordering::SeqCst);
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
    async fn refused_commits_are_counted_and_every_commits_keys_and_conditions_summed() {
        let counter = CommitCounter::new(Arc::new(MemoryStore::new()));
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
        let two_puts = Txn {
            conditions: vec![],
            ops: vec![
                Op::Put {
                    key: "a".to_owned(),
                    value: b"v".to_vec(),
                },
                Op::Delete {
                    key: "k".to_owned(),
                },
            ],
        };
        counter.commit(two_puts).await.expect("unconditional");
        assert_eq!(
            counter.take(),
            CommitWork {
                conflicts: 1,
                keys_written: 4,
                conditions: 2,
            }
        );
        assert_eq!(counter.take(), CommitWork::default());
    }
}
