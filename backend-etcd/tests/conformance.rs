//! Runs the whole conformance suite (storage and allocator cases) against etcd: one shared `etcd`
//! per test binary, one random key prefix per case; and the multi-client cases against a shared
//! 3-member cluster, each client connected to a different member.

use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use backend_etcd::{EtcdConfig, EtcdStore};
use conformance::{MultiClientFactory, TestClients};
use ipam_core::KvStore;
use test_kit::etcd::{unique_prefix, EtcdCluster, PrefixGuard};

conformance::kv_conformance_tests!(test_kit::etcd::EtcdFactory::new());
conformance::ipam_conformance_tests!(test_kit::etcd::EtcdFactory::new());
conformance::multi_client_conformance_tests!(ClusterClients);

/// Clients of a 3-member loopback cluster shared by this test binary (its watchdogs stop it when
/// the binary exits), client `i` connected only to member `i % 3`, under a fresh key prefix.
struct ClusterClients;

fn cluster() -> &'static EtcdCluster {
    static CLUSTER: OnceLock<Result<EtcdCluster, String>> = OnceLock::new();
    match CLUSTER.get_or_init(|| EtcdCluster::start(3)) {
        Ok(cluster) => cluster,
        Err(e) => panic!("cannot start a 3-member etcd cluster: {e}"),
    }
}

#[async_trait]
impl MultiClientFactory for ClusterClients {
    fn backend_name(&self) -> &'static str {
        "etcd cluster"
    }

    async fn fresh_clients(&self, count: usize) -> TestClients {
        let endpoints = cluster().endpoints();
        let prefix = unique_prefix();
        let mut clients: Vec<Arc<dyn KvStore>> = Vec::with_capacity(count);
        for i in 0..count {
            let endpoint = endpoints[i % endpoints.len()].clone();
            let config = EtcdConfig::new([endpoint]).with_prefix(prefix.clone());
            let store = EtcdStore::connect(config)
                .await
                .unwrap_or_else(|e| panic!("cannot connect to cluster member {i}: {e}"));
            clients.push(Arc::new(store));
        }
        TestClients {
            clients,
            guard: Box::new(PrefixGuard::new(
                EtcdConfig::new(endpoints).with_prefix(prefix),
            )),
        }
    }
}
