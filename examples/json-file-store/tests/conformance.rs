//! The whole conformance suite on the example adapter, as a third-party adapter runs it: a factory
//! that gives each case a fresh store in a temporary directory, then one macro per part of the suite.

use std::sync::Arc;

use conformance::{StoreFactory, TestStore};
use json_file_store::JsonFileStore;

/// A fresh, empty store per case; the directory goes when the case ends.
struct JsonFileFactory;

#[conformance::async_trait]
impl StoreFactory for JsonFileFactory {
    fn backend_name(&self) -> &'static str {
        "json-file"
    }

    async fn fresh(&self) -> TestStore {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store = JsonFileStore::open(dir.path().join("store.json")).expect("an empty store");
        TestStore {
            store: Arc::new(store),
            guard: Box::new(dir),
        }
    }
}

conformance::kv_conformance_tests!(JsonFileFactory);
conformance::ipam_conformance_tests!(JsonFileFactory);
