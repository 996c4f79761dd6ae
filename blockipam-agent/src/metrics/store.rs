//! The store wrapper that counts the agent's store round trips and their latency, by kind.

use std::sync::Arc;

use async_trait::async_trait;
use ipam_core::{KeyValue, KvError, KvStore, Read, ReadResult, Revision, Txn};

use super::AgentMetrics;

// ---------------------------------------------------------------------------------------------
// The store wrapper
// ---------------------------------------------------------------------------------------------

/// A store that counts each round trip, by kind and outcome, into [`AgentMetrics`].
#[derive(Debug)]
pub(super) struct InstrumentedStore {
    pub(super) inner: Arc<dyn KvStore>,
    pub(super) metrics: Arc<AgentMetrics>,
}

#[async_trait]
impl KvStore for InstrumentedStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        let result = self.inner.get(key).await;
        self.metrics.count_store_request("get", &result);
        result
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        let result = self.inner.list(prefix).await;
        self.metrics.count_store_request("list", &result);
        result
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        let result = self.inner.commit(txn).await;
        self.metrics.count_store_request("commit", &result);
        result
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        let result = self.inner.read_many(reads).await;
        self.metrics.count_store_request("read_many", &result);
        result
    }
}
