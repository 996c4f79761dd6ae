//! What the allocator benchmarks share: a fresh store of each kind, on one throwaway etcd and one temporary directory.

use std::sync::Arc;
use std::time::Duration;

use blockipam_store::{DatastoreSettings, DatastoreType, RawDatastoreSettings};
use ipam_core::{KvStore, MemoryStore};
use test_kit::etcd::EtcdServer;

/// The kinds every benchmark row runs on, the in-memory reference store first.
pub const KINDS: [&str; 4] = ["memory", "sled", "redb", "etcdv3"];

/// Opens fresh stores: each embedded one in its own file, each etcd one under its own prefix.
pub struct BenchStores {
    etcd: EtcdServer,
    dir: tempfile::TempDir,
    opened: usize,
}

impl BenchStores {
    /// Starts the etcd the `etcdv3` stores use.
    ///
    /// # Panics
    /// When etcd cannot start.
    pub fn start() -> Self {
        BenchStores {
            etcd: EtcdServer::start()
                .unwrap_or_else(|e| panic!("cannot start etcd for the benchmark: {e}")),
            dir: tempfile::tempdir().expect("temp dir"),
            opened: 0,
        }
    }

    /// A fresh, empty store of `kind` (one of [`KINDS`]).
    ///
    /// # Panics
    /// When the store cannot be opened.
    pub async fn open(&mut self, kind: &str) -> Arc<dyn KvStore> {
        self.opened += 1;
        if kind == "memory" {
            return Arc::new(MemoryStore::new());
        }
        let datastore_type: DatastoreType = kind.parse().expect("a datastore type");
        let etcd = datastore_type == DatastoreType::Etcdv3;
        // Endpoints for etcd only, a path for the embedded stores: the settings refuse both.
        let raw = RawDatastoreSettings {
            datastore_type: Some(datastore_type),
            path: (!etcd).then(|| self.dir.path().join(format!("store-{}", self.opened))),
            etcd_endpoints: if etcd {
                vec![self.etcd.endpoint()]
            } else {
                Vec::new()
            },
            etcd_prefix: etcd.then(|| format!("/bench-{}/", self.opened)),
            ..RawDatastoreSettings::default()
        };
        DatastoreSettings {
            lock_wait: Duration::from_secs(10),
            create_if_missing: true,
            ..DatastoreSettings::from_raw(raw).expect("bench settings")
        }
        .open()
        .await
        .expect("open store")
    }
}
