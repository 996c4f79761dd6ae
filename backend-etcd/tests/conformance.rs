//! Runs the whole conformance suite (storage and allocator cases) against etcd: one shared `etcd`
//! per test binary, one random key prefix per case.

conformance::kv_conformance_tests!(backend_etcd::testing::EtcdFactory::new());
conformance::ipam_conformance_tests!(backend_etcd::testing::EtcdFactory::new());
