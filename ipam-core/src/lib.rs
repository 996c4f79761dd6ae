//! blockipam's core: the storage trait, the in-memory reference store, and the block-affinity allocator.

pub mod kv;
pub mod lockfile;
pub mod memory;

pub use kv::{Condition, KeyValue, KvError, KvStore, Op, Revision, Txn};
pub use memory::MemoryStore;
