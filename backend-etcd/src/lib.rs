//! blockipam's etcd v3 store: the `KvStore` trait on etcd.
//!
//! [`EtcdStore`] maps reads to etcd Range requests and every commit to exactly one etcd
//! transaction; [`EtcdConfig`] says where etcd is and which key prefix the store owns.
//! [`lease`] holds what the trait has no room for: keys kept alive on etcd leases (the node
//! agent's liveness key and reclaimer leader key).

mod config;
mod error;
pub mod lease;
mod store;

pub use config::{EtcdConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PREFIX, DEFAULT_REQUEST_TIMEOUT};
pub use store::EtcdStore;
