//! Runs the whole conformance suite (storage, embedded-store and allocator cases) against the redb adapter.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use backend_redb::{RedbConfig, RedbStore};
use conformance::embedded::EmbeddedFactory;
use conformance::{StoreFactory, TestStore};
use ipam_core::{KvError, KvStore};

/// Hands out redb stores (one file each) in fresh temporary directories.
struct RedbFactory;

#[async_trait]
impl StoreFactory for RedbFactory {
    fn backend_name(&self) -> &'static str {
        "redb"
    }

    async fn fresh(&self) -> TestStore {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = RedbStore::open(RedbConfig::new(dir.path().join("store")).creating())
            .await
            .expect("open a fresh redb store");
        TestStore {
            store: Arc::new(store),
            guard: Box::new(dir),
        }
    }
}

#[async_trait]
impl EmbeddedFactory for RedbFactory {
    async fn open_at(
        &self,
        path: &Path,
        lock_wait: Duration,
        create_if_missing: bool,
    ) -> Result<Arc<dyn KvStore>, KvError> {
        let config = RedbConfig {
            create_if_missing,
            ..RedbConfig::new(path).with_lock_wait(lock_wait)
        };
        Ok(Arc::new(RedbStore::open(config).await?))
    }
}

conformance::kv_conformance_tests!(RedbFactory);
conformance::embedded_conformance_tests!(RedbFactory);
conformance::ipam_conformance_tests!(RedbFactory);
