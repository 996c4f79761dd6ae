//! Runs the whole conformance suite (storage, embedded-store and allocator cases) against the sled adapter.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use backend_sled::{SledConfig, SledStore};
use conformance::embedded::EmbeddedFactory;
use conformance::{StoreFactory, TestStore};
use ipam_core::{KvError, KvStore};

/// Hands out sled stores in fresh temporary directories.
struct SledFactory;

#[async_trait]
impl StoreFactory for SledFactory {
    fn backend_name(&self) -> &'static str {
        "sled"
    }

    async fn fresh(&self) -> TestStore {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SledStore::open(SledConfig::new(dir.path().join("store")).creating())
            .await
            .expect("open a fresh sled store");
        TestStore {
            store: Arc::new(store),
            guard: Box::new(dir),
        }
    }
}

#[async_trait]
impl EmbeddedFactory for SledFactory {
    async fn open_at(
        &self,
        path: &Path,
        lock_wait: Duration,
        create_if_missing: bool,
    ) -> Result<Arc<dyn KvStore>, KvError> {
        let config = SledConfig {
            create_if_missing,
            ..SledConfig::new(path).with_lock_wait(lock_wait)
        };
        Ok(Arc::new(SledStore::open(config).await?))
    }
}

conformance::kv_conformance_tests!(SledFactory);
conformance::embedded_conformance_tests!(SledFactory);
conformance::ipam_conformance_tests!(SledFactory);
