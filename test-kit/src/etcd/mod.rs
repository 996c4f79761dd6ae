//! etcd for tests and benchmarks: throwaway servers and clusters, a test PKI, and the
//! conformance factory that gives each case its own key prefix.

mod factory;
mod pki;
mod supervisor;

pub use factory::{unique_prefix, EtcdFactory, PrefixGuard};
pub use pki::TestPki;
pub use supervisor::{
    EtcdCluster, EtcdServer, EtcdServerOptions, ServerTls, CLUSTER_READY_TIMEOUT, ETCD_BIN_ENV,
    READY_TIMEOUT,
};
