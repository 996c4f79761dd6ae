//! Runs the whole conformance suite against the in-memory reference store.

conformance::kv_conformance_tests!(conformance::MemoryFactory);
