//! blockipam's core: the storage trait, the in-memory reference store, and the block-affinity allocator.

pub mod allocator;
pub mod blocking;
pub mod check;
pub mod counting;
pub mod dead_nodes;
pub mod error;
pub mod fault;
pub mod formats;
pub mod kv;
pub mod lockfile;
pub mod memory;
pub mod model;
pub mod namespaces;
pub mod network_setup;
pub mod nodes;
pub mod reservations;
pub mod selector;

pub use allocator::{
    AllocationInfo, AssignIpsRequest, AssignedAddress, AutoAssignRequest, AutoAssignResult,
    BlockUsage, ChosenRelease, Clock, EmptyBlock, EmptyBlockFilter, EmptyBlockReason, HostRelease,
    Ipam, NamespaceLookup, PoolChange, PoolDeletion, PoolPolicy, PoolSpec, PoolUsage,
    ReleaseOutcome, ReleaseRequest, RetryPolicy, Utilization,
};
pub use check::{CheckReport, Problem};
pub use counting::{CountingStore, RoundTrips};
pub use error::IpamError;
pub use kv::{Condition, KeyValue, KvError, KvStore, Op, Read, ReadResult, Revision, Txn};
pub use memory::MemoryStore;
pub use model::{AllowedUse, AllowedUses, AssignmentMode, Family, IpamConfig, Lifetime, Pool};
