//! The conformance-suite factory for etcd: each case gets its own key prefix on a shared server, deleted afterwards.

use std::sync::Arc;

use async_trait::async_trait;
use backend_etcd::{EtcdConfig, EtcdStore};
use conformance::{StoreFactory, TestStore};

use super::supervisor::EtcdServer;

/// A conformance-suite factory: each case gets a store on the shared server (or the given one)
/// under a fresh random prefix, deleted when the case's guard drops.
#[derive(Debug, Clone)]
pub struct EtcdFactory {
    endpoint: String,
}

impl EtcdFactory {
    /// A factory on [`EtcdServer::shared`].
    ///
    /// # Panics
    /// When the shared server cannot be started.
    pub fn new() -> Self {
        Self::on(EtcdServer::shared())
    }

    /// A factory on `server`.
    pub fn on(server: &EtcdServer) -> Self {
        EtcdFactory {
            endpoint: server.endpoint(),
        }
    }
}

impl Default for EtcdFactory {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl StoreFactory for EtcdFactory {
    fn backend_name(&self) -> &'static str {
        "etcd"
    }

    async fn fresh(&self) -> TestStore {
        let config = EtcdConfig::new([self.endpoint.clone()]).with_prefix(unique_prefix());
        let store = EtcdStore::connect(config.clone())
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the etcd test server: {e}"));
        TestStore {
            store: Arc::new(store),
            guard: Box::new(PrefixGuard::new(config)),
        }
    }
}

/// A key prefix no other test uses: `/blockipam-test/<random>/`.
pub fn unique_prefix() -> String {
    format!("/blockipam-test/{:016x}/", rand::random::<u64>())
}

/// Deletes every key under a configuration's prefix when dropped (from a thread of its own, so
/// it works inside or outside a Tokio runtime). Failures are printed, not raised.
#[derive(Debug)]
pub struct PrefixGuard {
    config: EtcdConfig,
}

impl PrefixGuard {
    /// Guards `config.prefix` on `config`'s etcd.
    pub fn new(config: EtcdConfig) -> Self {
        PrefixGuard { config }
    }
}

impl Drop for PrefixGuard {
    fn drop(&mut self) {
        let config = self.config.clone();
        let prefix = config.prefix.clone();
        let cleanup = std::thread::spawn(move || -> Result<u64, String> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let store = EtcdStore::connect_lazy(config).map_err(|e| e.to_string())?;
                store.delete_all().await.map_err(|e| e.to_string())
            })
        });
        match cleanup.join() {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => eprintln!("warning: could not delete test prefix {prefix:?}: {e}"),
            Err(_) => eprintln!("warning: deleting test prefix {prefix:?} panicked"),
        }
    }
}
