//! The allocator's error type: what went wrong, in terms an operator or a CNI runtime can act on.

use std::net::IpAddr;

use crate::kv::KvError;
use crate::model::Family;

/// Everything an IPAM operation can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IpamError {
    /// The store failed (unreachable, indeterminate write, ...); see [`KvError`].
    #[error(transparent)]
    Store(#[from] KvError),
    /// A stored object could not be decoded.
    #[error("corrupt IPAM object at {key:?}: {message}")]
    Corrupt {
        /// The key whose bytes are bad.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A condition the caller guarded every write with (see `Ipam::guarded_by`) stopped holding:
    /// nothing more was written.
    #[error("guard condition on key {key:?} no longer holds: stopped, nothing more written")]
    GuardLost {
        /// The guarded key.
        key: String,
    },
    /// A request argument is malformed (bad CIDR, bad name, block size out of range, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No pool has this name or CIDR.
    #[error("no IP pool named or with CIDR {0:?}")]
    PoolNotFound(String),
    /// A requested pool is disabled.
    #[error("IP pool {0:?} is disabled")]
    PoolDisabled(String),
    /// A requested pool is of the other family.
    #[error("IP pool {pool:?} is not an {family} pool")]
    PoolWrongFamily {
        /// The pool.
        pool: String,
        /// The family asked for.
        family: Family,
    },
    /// A pool with this name exists already.
    #[error("an IP pool named {0:?} already exists")]
    PoolExists(String),
    /// No IP reservation has this name.
    #[error("no IP reservation named {0:?}")]
    ReservationNotFound(String),
    /// An IP reservation with this name exists already.
    #[error("an IP reservation named {0:?} already exists")]
    ReservationExists(String),
    /// The new pool overlaps an existing one.
    #[error("IP pool {cidr} overlaps existing pool {existing:?} ({existing_cidr})")]
    PoolOverlap {
        /// The requested CIDR.
        cidr: ipnet::IpNet,
        /// The pool it overlaps.
        existing: String,
        /// That pool's CIDR.
        existing_cidr: ipnet::IpNet,
    },
    /// The pool still has allocated addresses.
    #[error("IP pool {pool:?} still has {in_use} allocated addresses (release them or force)")]
    PoolInUse {
        /// The pool.
        pool: String,
        /// Addresses allocated in it.
        in_use: u64,
    },
    /// The address is in no enabled pool.
    #[error("address {0} is not in any enabled IP pool")]
    NotInPool(IpAddr),
    /// The address is allocated already.
    #[error("address {ip} is already assigned (handle {handle:?})")]
    AlreadyAssigned {
        /// The address.
        ip: IpAddr,
        /// Who holds it.
        handle: String,
    },
    /// Strict affinity forbids using this address from another host's block.
    #[error(
        "address {ip} is in block {block} affine to host {owner:?}, and strict affinity is on"
    )]
    AffinityConflict {
        /// The address.
        ip: IpAddr,
        /// Its block.
        block: ipnet::IpNet,
        /// The block's host.
        owner: String,
    },
    /// Not enough free addresses in the candidate pools.
    #[error("no free {family} address: {}", exhausted_detail(*.family, *.requested, *.found, .pools))]
    Exhausted {
        /// The family asked for.
        family: Family,
        /// How many were asked for.
        requested: u32,
        /// How many could be had.
        found: u32,
        /// The candidate pools searched.
        pools: Vec<String>,
    },
    /// A pool named for an assignment does not allow that use (its `allowed_uses`).
    #[error("IP pool {pool:?} does not allow {use_} addresses (allowed uses: {allowed})")]
    PoolUseNotAllowed {
        /// The pool.
        pool: String,
        /// The use asked for.
        use_: crate::model::AllowedUse,
        /// What the pool allows.
        allowed: crate::model::AllowedUses,
    },
    /// A pool the pod's namespace names for its pods (`blockipamctl namespace pools`) cannot be
    /// used: `reason` says why (no such pool, disabled, of the other family, use not allowed).
    #[error("namespace {namespace:?} names {family} pools for its pods that cannot be used (see `blockipamctl namespace pools {namespace}`): {reason}")]
    NamespacePoolUnusable {
        /// The pod's namespace.
        namespace: String,
        /// The family whose pools it names.
        family: Family,
        /// Why the pool cannot be used.
        reason: Box<IpamError>,
    },
    /// Enabled pools of the family exist, but none that auto-assign may use on this node: none
    /// selects it (`node_selector`), or they are manual, or they do not allow the use asked for.
    #[error("no IP pool selects node {host:?} for automatic {family} assignment (enabled pools: {pools:?}; check their node selectors, assignment modes and allowed uses, or the node's labels)")]
    NoPoolSelectsNode {
        /// The node.
        host: String,
        /// The family asked for.
        family: Family,
        /// The enabled pools of the family, none of which qualified.
        pools: Vec<String>,
    },
    /// The host owns `max_blocks_per_host` blocks and none has room.
    #[error("host {host:?} owns {owned} {family} blocks, the per-host block limit is {limit}, and they are full")]
    BlockLimit {
        /// The host.
        host: String,
        /// The family.
        family: Family,
        /// Blocks it owns.
        owned: u32,
        /// The configured limit.
        limit: u32,
    },
    /// The block is affine to another host.
    #[error("block {block} is affine to host {owner:?}")]
    BlockOwnedByOtherHost {
        /// The block.
        block: ipnet::IpNet,
        /// Its host.
        owner: String,
    },
    /// Every attempt lost a race with another writer; try again later.
    #[error("gave up after {attempts} attempts: the store kept changing under concurrent writers, try again later")]
    RetriesExhausted {
        /// Attempts made.
        attempts: u32,
    },
    /// Every attempt found the same objects changed by another writer (a host release whose
    /// blocks keep changing); try again later.
    #[error("gave up after {attempts} attempts: {what} kept changing under concurrent writers, try again later")]
    KeptConflicting {
        /// Attempts made.
        attempts: u32,
        /// What kept changing, naming the objects.
        what: String,
    },
    /// An address named explicitly was released recently and is still in IP cooldown: like
    /// Calico, it is not handed out again until the cooldown has passed.
    #[error("address {ip} was released at {released_at} (seconds since the epoch) and is in IP cooldown until {cools_at}: ask for it again then, or for another address")]
    AddressCooling {
        /// The address.
        ip: IpAddr,
        /// When it was released.
        released_at: u64,
        /// When its cooldown ends (release time plus the configured `ip_cooldown_seconds`).
        cools_at: u64,
    },
    /// One change would not fit a single store transaction (operations or bytes); the callers
    /// that can split their work do so on this error.
    #[error("the change does not fit one store transaction: {0}")]
    TooLarge(String),
    /// A change needs a newer stored format than the store's writers use: the cluster's upgrade
    /// to it is not finalized, so nodes of the previous release may still read the store.
    #[error("{what} needs stored format {needs}, and this store's writers use format {writes} until the upgrade is finalized: once every node runs this release, run `blockipamctl upgrade finalize` (docs/upgrading.md)")]
    FormatNotFinalized {
        /// The change refused.
        what: String,
        /// The format the change needs.
        needs: u8,
        /// The format the store's writers use.
        writes: u8,
    },
    /// An allocation's attribute is kept apart from its block (in its owner key) and the
    /// operation did not read it: a bug in the operation, never a property of the store.
    #[error("internal error: the attribute of ordinal {ordinal} of block {block} is kept apart and was not read")]
    AttributeNotLoaded {
        /// The block.
        block: ipnet::IpNet,
        /// The allocation's ordinal in it.
        ordinal: u32,
    },
    /// The store's writers use a newer format than this build can write: a newer release
    /// finalized its upgrade.
    #[error("this store's writers use stored format {writes}, and this build writes formats up to {newest}: install the release that finalized the store's upgrade (docs/upgrading.md)")]
    FormatTooNew {
        /// The format the store records.
        writes: u8,
        /// The newest this build writes.
        newest: u8,
    },
    /// A bug: an invariant the code relies on did not hold.
    #[error("internal error: {0}")]
    Internal(String),
}

/// What [`IpamError::Exhausted`] found: the pools searched, or that there was none to search.
fn exhausted_detail(family: Family, requested: u32, found: u32, pools: &[String]) -> String {
    if pools.is_empty() {
        format!(
            "wanted {requested}, but no enabled {family} pool exists (create one with \
             `blockipamctl pool add` or a netconf's `ipam.pools`, or `blockipamctl pool enable` one)"
        )
    } else {
        format!("wanted {requested}, found {found} in pools {pools:?}")
    }
}

impl IpamError {
    /// True when retrying later may succeed (store unavailable, retries exhausted).
    pub fn is_retryable(&self) -> bool {
        match self {
            IpamError::Store(e) => e.is_retryable() || matches!(e, KvError::Indeterminate { .. }),
            IpamError::RetriesExhausted { .. } | IpamError::KeptConflicting { .. } => true,
            _ => false,
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        IpamError::InvalidArgument(message.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhaustion_names_the_pools_searched_or_says_there_was_none() {
        let searched = IpamError::Exhausted {
            family: Family::V4,
            requested: 2,
            found: 1,
            pools: vec!["default".into()],
        };
        assert_eq!(
            searched.to_string(),
            "no free IPv4 address: wanted 2, found 1 in pools [\"default\"]"
        );
        let none = IpamError::Exhausted {
            family: Family::V6,
            requested: 1,
            found: 0,
            pools: Vec::new(),
        };
        assert_eq!(
            none.to_string(),
            "no free IPv6 address: wanted 1, but no enabled IPv6 pool exists (create one with \
             `blockipamctl pool add` or a netconf's `ipam.pools`, or `blockipamctl pool enable` one)"
        );
    }
}
