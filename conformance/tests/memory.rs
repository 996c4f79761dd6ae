//! Runs the whole conformance suite (storage and allocator cases) against the in-memory reference store.

conformance::kv_conformance_tests!(conformance::MemoryFactory);
conformance::ipam_conformance_tests!(conformance::MemoryFactory);
