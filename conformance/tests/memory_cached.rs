//! Runs the whole conformance suite against the in-memory reference store behind the node agent's
//! read cache (`ipam_core::caching::CachingStore`, handles taken for absent when unknown), as the
//! agent serves the plugin: every storage case and every allocator behaviour hold through it.

use std::sync::Arc;

use conformance::{StoreFactory, TestStore};
use ipam_core::memory::MemoryStore;

/// A fresh memory store behind a fresh cache.
#[derive(Debug, Default, Clone, Copy)]
struct CachedMemoryFactory;

#[conformance::async_trait]
impl StoreFactory for CachedMemoryFactory {
    fn backend_name(&self) -> &'static str {
        "memory behind the agent's cache"
    }

    async fn fresh(&self) -> TestStore {
        TestStore {
            store: Arc::new(ipam_core::node_cache(Arc::new(MemoryStore::new()))),
            guard: Box::new(()),
        }
    }
}

conformance::kv_conformance_tests!(CachedMemoryFactory);
conformance::ipam_conformance_tests!(CachedMemoryFactory);
