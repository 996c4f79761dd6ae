//! blockipam's etcd v3 store: the `KvStore` trait on etcd, plus test support for real etcd processes.
//!
//! [`EtcdStore`] maps reads to etcd Range requests and every commit to exactly one etcd
//! transaction; [`EtcdConfig`] says where etcd is and which key prefix the store owns.
//! [`lease`] holds what the trait has no room for: keys kept alive on etcd leases (the node
//! agent's liveness key and reclaimer leader key).
//! `testing` (feature `testing`) starts throwaway `etcd` processes for tests and benchmarks.

mod config;
mod error;
pub mod lease;
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use config::{EtcdConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PREFIX, DEFAULT_REQUEST_TIMEOUT};
pub use store::EtcdStore;
