//! A store wrapper that sorts what the allocator reads: block keys (and how many block values came
//! back) against claim-index keys (and how many claim entries came back), so a scenario can show
//! that a search reads the compact claim index, never one block value per block.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use ipam_core::model::keys;
use ipam_core::{KeyValue, KvError, KvStore, Read, ReadResult, Revision, Txn};
use serde::Serialize;

/// What was read, by kind of key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReadKinds {
    /// Single-key reads of block keys.
    pub block_gets: u64,
    /// Prefix listings under the blocks directory.
    pub block_listings: u64,
    /// Block values returned (by gets and listings).
    pub block_values: u64,
    /// Single-key reads of claim-index keys.
    pub claim_gets: u64,
    /// Prefix listings of the claim index.
    pub claim_listings: u64,
    /// Windowed reads of the claim index (at most a given number of entries each).
    pub claim_windows: u64,
    /// Claim-index entries returned.
    pub claim_entries: u64,
    /// Reads of any other key or prefix.
    pub other_reads: u64,
}

#[derive(Debug, Default)]
struct Counters {
    block_gets: AtomicU64,
    block_listings: AtomicU64,
    block_values: AtomicU64,
    claim_gets: AtomicU64,
    claim_listings: AtomicU64,
    claim_windows: AtomicU64,
    claim_entries: AtomicU64,
    other_reads: AtomicU64,
}

/// Forwards every call to the inner store and sorts its reads into [`ReadKinds`].
#[derive(Debug)]
pub struct ReadClassifier {
    inner: Arc<dyn KvStore>,
    counters: Counters,
    blocks: String,
    claims: String,
}

impl ReadClassifier {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn KvStore>) -> Self {
        ReadClassifier {
            inner,
            counters: Counters::default(),
            blocks: keys::blocks_dir(),
            claims: keys::claims_dir(),
        }
    }

    /// The counts so far.
    pub fn kinds(&self) -> ReadKinds {
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::SeqCst);
        ReadKinds {
            block_gets: load(&c.block_gets),
            block_listings: load(&c.block_listings),
            block_values: load(&c.block_values),
            claim_gets: load(&c.claim_gets),
            claim_listings: load(&c.claim_listings),
            claim_windows: load(&c.claim_windows),
            claim_entries: load(&c.claim_entries),
            other_reads: load(&c.other_reads),
        }
    }

    fn count_returned(&self, values: &[KeyValue]) {
        for kv in values {
            if kv.key.starts_with(&self.blocks) {
                self.counters.block_values.fetch_add(1, Ordering::SeqCst);
            } else if kv.key.starts_with(&self.claims) {
                self.counters.claim_entries.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    fn count_get(&self, key: &str) {
        let counter = if key.starts_with(&self.blocks) {
            &self.counters.block_gets
        } else if key.starts_with(&self.claims) {
            &self.counters.claim_gets
        } else {
            &self.counters.other_reads
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }

    fn count_list(&self, prefix: &str) {
        let counter = if prefix.starts_with(&self.blocks) {
            &self.counters.block_listings
        } else if prefix.starts_with(&self.claims) {
            &self.counters.claim_listings
        } else {
            &self.counters.other_reads
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl KvStore for ReadClassifier {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.count_get(key);
        let found = self.inner.get(key).await?;
        self.count_returned(found.as_slice());
        Ok(found)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.count_list(prefix);
        let listed = self.inner.list(prefix).await?;
        self.count_returned(&listed);
        Ok(listed)
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.inner.commit(txn).await
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        for read in reads {
            match read {
                Read::Get(key) => self.count_get(key),
                Read::List(prefix) => self.count_list(prefix),
                Read::Range { prefix, .. } => {
                    let counter = if prefix.starts_with(&self.claims) {
                        &self.counters.claim_windows
                    } else {
                        &self.counters.other_reads
                    };
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        let results = self.inner.read_many(reads).await?;
        for result in &results {
            match result {
                ReadResult::Got(found) => self.count_returned(found.as_slice()),
                ReadResult::Listed(listed) => self.count_returned(listed),
            }
        }
        Ok(results)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipam_core::{MemoryStore, Op};

    #[tokio::test]
    async fn block_and_claim_reads_are_told_apart() {
        let store = Arc::new(MemoryStore::new());
        let put = |key: String| Op::Put {
            key,
            value: b"v".to_vec(),
        };
        store
            .commit(Txn {
                conditions: vec![],
                ops: vec![
                    put(format!("{}a", keys::claims_dir())),
                    put(format!("{}b", keys::claims_dir())),
                    put(format!("{}x", keys::blocks_dir())),
                ],
            })
            .await
            .expect("commit");
        let classifier = ReadClassifier::new(store);
        classifier.list(&keys::claims_dir()).await.expect("list");
        classifier
            .read_many(&[
                Read::Get(format!("{}x", keys::blocks_dir())),
                Read::Get(keys::config()),
            ])
            .await
            .expect("read_many");
        assert_eq!(
            classifier.kinds(),
            ReadKinds {
                block_gets: 1,
                block_values: 1,
                claim_listings: 1,
                claim_entries: 2,
                other_reads: 1,
                ..ReadKinds::default()
            }
        );
    }
}
