//! blockipam's core, in three layers, each importing only from the ones below it: `kv` (the
//! storage trait, the in-memory reference store, counting, blocking and the host lock file),
//! `model` (keys, the versioned encoding and the stored objects) and `allocator` (the
//! block-affinity allocator: every operation on a store, network set-up, check and dead-node
//! reclaim). `docs/architecture.md` walks through them.

pub mod allocator;
pub mod fault;
pub mod kv;
pub mod model;

// The paths each part had before the layers, kept for the crates built on them.
pub use allocator::{check, dead_nodes, network_setup, upgrade};
pub use kv::{blocking, caching, counting, lockfile, memory};
pub use model::{error, formats, namespaces, nodes, reservations, selector, store_format};

pub use allocator::{
    node_cache, AddressStatus, AllocationInfo, AssignIpsRequest, AssignedAddress,
    AutoAssignRequest, AutoAssignResult, BlockUsage, ChosenRelease, ClaimIndexRoom, Clock,
    EmptyBlock, EmptyBlockFilter, EmptyBlockReason, HostRelease, HostUtilization, Ipam,
    NamespaceLookup, NewBlockProspect, PoolChange, PoolDeletion, PoolPolicy, PoolSpec, PoolUsage,
    ReleaseOutcome, ReleaseRequest, RetryPolicy, UndecodableObject, Utilization,
};
pub use check::{CheckReport, Problem};
pub use counting::{CountingStore, RoundTrips};
pub use error::IpamError;
pub use kv::{
    range_of_listing, CachedRead, Condition, KeyValue, KvError, KvStore, Op, Read, ReadResult,
    Revision, Txn,
};
pub use memory::MemoryStore;
pub use model::{AllowedUse, AllowedUses, AssignmentMode, Family, IpamConfig, Lifetime, Pool};
