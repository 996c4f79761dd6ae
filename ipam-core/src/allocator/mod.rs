//! The block-affinity allocator: Calico's IPAM behaviour over the storage trait, with every block
//! change and its handle change committed in one transaction.
//!
//! This file holds the request and result types, the transaction plan, the retry loop and the
//! batched block reads every operation shares. The operations live beside it, one concern per
//! file: `pools.rs` (pools and the IPAM config), `assign.rs` (auto-assign: affine blocks, new blocks,
//! borrowing; specific addresses), `release.rs` (addresses, handles, chosen addresses, hosts),
//! `queries.rs` (who holds what, utilization) and `affinity.rs` (claiming and releasing blocks).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::kv::{
    Condition, KeyValue, KvError, KvStore, Op, Read, Revision, Txn, MAX_TXN_BYTES,
    MAX_TXN_CONDITIONS, MAX_TXN_OPS, MAX_VALUE_BYTES,
};
use crate::model::error::IpamError;
use crate::model::{
    decode, decode_claim, decode_pool, encode, encode_claim, keys, AllowedUse, AllowedUses,
    AssignmentMode, Attribute, Block, ClaimEntry, Family, Handle, IpamConfig, Lifetime, Pool,
    MAX_ATTRIBUTE_BYTES, MAX_BLOCK_ADDRESSES, OWNERS_APART_FORMAT,
};
mod affinity;
mod assign;
pub mod check;
mod counts;
pub mod dead_nodes;
mod full_pools;
pub mod leaks;
mod lifecycle;
mod namespaces;
pub mod network_setup;
mod nodes;
mod pools;
mod queries;
mod release;
mod reservations;
mod resize;
pub mod upgrade;

pub use resize::{MixedBlockSizes, PoolSplit, MAX_SPLIT_PARTS};

pub use counts::{AllocationCounts, BlockCount};
pub use lifecycle::{EmptyBlock, EmptyBlockFilter, EmptyBlockReason};
pub use namespaces::UnusableNamespacePool;
pub(crate) use pools::find_pool;
pub use pools::raising_pool_generation;

use self::network_setup::NetworkSetup;
use crate::model::selector::Selector;
use crate::model::store_format::FormatRecord;

/// Metadata key recording the host an allocation was made for.
pub const ATTR_NODE: &str = "node";
/// Attribute naming the network an allocation belongs to.
pub const ATTR_NETWORK: &str = "network";
/// Attribute saying what a non-workload allocation is for (`gateway` for a network's
/// reservations).
pub const ATTR_PURPOSE: &str = "purpose";
/// Most addresses one request may ask for, per family.
pub const MAX_ADDRESSES_PER_REQUEST: u32 = 32;

/// The value of a borrowed-block index entry: the key says everything (node and block).
pub const BORROWED_INDEX_VALUE: &[u8] = b"{}";
/// Addresses released per transaction by [`Ipam::release_ips`] (each may touch a block and a
/// handle, so this keeps a transaction well under `MAX_TXN_OPS`).
const RELEASES_PER_TXN: usize = 32;
/// Blocks moved or deleted per transaction when releasing a host's affinities.
const BLOCKS_PER_TXN: usize = 32;

/// How conflicts between concurrent writers are retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts before giving up with [`IpamError::RetriesExhausted`].
    pub max_attempts: u32,
    /// Backoff before the second attempt; doubled after each conflict up to `max_backoff`, jittered.
    pub base_backoff: Duration,
    /// Largest backoff between attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 100,
            base_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(40),
        }
    }
}

/// What an auto-assign asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AutoAssignRequest {
    /// The owner of the addresses (`<network>.<container id>` for the CNI plugin).
    pub handle: String,
    /// The host the addresses are for; its affine blocks are used first.
    pub host: String,
    /// IPv4 addresses wanted.
    pub num_v4: u32,
    /// IPv6 addresses wanted.
    pub num_v6: u32,
    /// IPv4 pools to use, by name or CIDR; empty means every enabled IPv4 pool.
    pub v4_pools: Vec<String>,
    /// IPv6 pools to use, by name or CIDR; empty means every enabled IPv6 pool.
    pub v6_pools: Vec<String>,
    /// Metadata recorded with each address (the allocator adds `node`).
    pub attributes: BTreeMap<String, String>,
    /// When the handle already holds addresses, return them instead of allocating more.
    pub reuse_existing: bool,
    /// When true, a block's network address and its last address (IPv4 blocks larger than /31,
    /// IPv6 blocks larger than /127) are never handed out, so every address is a usable host
    /// address of its block's prefix (what a caller that reports the block prefix needs).
    /// Ignored with `setup`, which decides it from the pools read.
    pub skip_block_edges: bool,
    /// What the addresses are for: only pools allowing this use are candidates (CNI requests
    /// are workload requests; a node's tunnel address is a tunnel request).
    pub purpose: AllowedUse,
    /// The pod's namespace, when its pools setting (`blockipamctl namespace pools`) may replace
    /// `v4_pools`/`v6_pools`, family by family (read in the same batch).
    pub namespace: Option<NamespaceLookup>,
    /// What the caller's network needs in place, checked in the same batched read
    /// ([`crate::allocator::network_setup`]): when something is missing, auto-assign sets it up
    /// ([`Ipam::prepare_network`]) and tries again, deciding `skip_block_edges` from the pools.
    pub setup: Option<NetworkSetup>,
    /// Addresses this call never hands out, as if reserved (nothing is stored): what the call
    /// passes over when its network's reservations could not be made, so that the network's
    /// gateway, network and broadcast addresses go to no pod meanwhile.
    pub pass_over: Vec<IpAddr>,
}

/// Which families a namespace's pools setting may decide (those a pod annotation did not).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NamespaceLookup {
    /// The namespace.
    pub namespace: String,
    /// Its IPv4 pools replace `v4_pools` when set.
    pub v4: bool,
    /// Its IPv6 pools replace `v6_pools` when set.
    pub v6: bool,
}

/// One address handed out.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AssignedAddress {
    /// The address.
    pub ip: IpAddr,
    /// The block it came from (its prefix length is what the CNI result reports).
    pub block: IpNet,
}

/// What an auto-assign handed out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AutoAssignResult {
    /// IPv4 addresses.
    pub v4: Vec<AssignedAddress>,
    /// IPv6 addresses.
    pub v6: Vec<AssignedAddress>,
    /// True when the handle already held these and nothing new was allocated.
    pub reused: bool,
    /// The store's pools, as the assignment's read saw them.
    pub pools: Vec<Pool>,
}

/// Assign given addresses to one handle.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AssignIpsRequest {
    /// The addresses.
    pub ips: Vec<IpAddr>,
    /// Their owner.
    pub handle: String,
    /// The host they are for.
    pub host: String,
    /// Metadata recorded with each (the allocator adds `node`).
    pub attributes: BTreeMap<String, String>,
    /// When true, strict affinity does not refuse an address in a block affine to another host
    /// (network reservations, which belong to no host).
    pub ignore_strict_affinity: bool,
    /// What the addresses are for: each must lie in a pool that allows it (Calico's intended
    /// use). `None` for addresses held rather than used (network reservations).
    pub purpose: Option<AllowedUse>,
}

/// Release one address, optionally only if it was allocated at a given block sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReleaseRequest {
    /// The address.
    pub ip: IpAddr,
    /// When set, the release is refused if the address was re-allocated since this sequence number.
    pub sequence: Option<u64>,
}

/// What a release by address did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseOutcome {
    /// Addresses freed.
    pub released: Vec<IpAddr>,
    /// Addresses that were not allocated (not an error).
    pub not_allocated: Vec<IpAddr>,
    /// Addresses left alone because they were re-allocated since the given sequence number.
    pub sequence_mismatch: Vec<IpAddr>,
}

/// What one address is to the allocator ([`Ipam::address_status`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressStatus {
    /// The pool that contains it, if any.
    pub pool: Option<Pool>,
    /// Who holds it, if anyone.
    pub allocation: Option<AllocationInfo>,
    /// The existing block of its pool that contains it, with that block's host.
    pub block: Option<(IpNet, Option<String>)>,
    /// While nobody holds it and it is in IP cooldown: when the cooldown ends, in seconds since
    /// the Unix epoch.
    pub cooling_until: Option<u64>,
    /// The names of the reservations whose CIDRs contain it.
    pub reserved_by: Vec<String>,
    /// Pool and reservation objects that could not be decoded, sorted by key: `pool` and
    /// `reserved_by` leave them out.
    pub undecodable: Vec<UndecodableObject>,
}

/// Everything known about one allocated address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationInfo {
    /// The address.
    pub ip: IpAddr,
    /// Its block.
    pub block: IpNet,
    /// The block's affine host, if any.
    pub block_host: Option<String>,
    /// The owner.
    pub handle: String,
    /// Recorded metadata.
    pub attributes: BTreeMap<String, String>,
    /// Block sequence number at allocation (pass it to a guarded release).
    pub sequence: u64,
}

/// What [`Ipam::release_chosen`] found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChosenRelease {
    /// Everything the handle held, in address order.
    pub held: Vec<AllocationInfo>,
    /// The addresses released, in address order.
    pub released: Vec<IpAddr>,
}

/// How to create a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// The pool's network.
    pub cidr: IpNet,
    /// Name; derived from the CIDR when absent.
    pub name: Option<String>,
    /// Block prefix length; the family default when absent.
    pub block_size: Option<u8>,
    /// Create it disabled.
    pub disabled: bool,
}

/// A pool's node selector, assignment mode and allowed uses, for
/// [`Ipam::create_pool_with_policy`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolPolicy {
    /// The nodes that auto-assign from the pool.
    pub node_selector: Selector,
    /// Automatic or manual.
    pub assignment_mode: AssignmentMode,
    /// What its addresses may be used for.
    pub allowed_uses: AllowedUses,
}

impl PoolPolicy {
    fn apply_to(&self, pool: &mut Pool) {
        pool.node_selector = self.node_selector.clone();
        pool.assignment_mode = self.assignment_mode;
        pool.allowed_uses = self.allowed_uses.clone();
    }
}

/// What [`Ipam::set_pool`] changes; `None` leaves a field as it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolChange {
    /// A new node selector.
    pub node_selector: Option<Selector>,
    /// A new assignment mode.
    pub assignment_mode: Option<AssignmentMode>,
    /// New allowed uses.
    pub allowed_uses: Option<AllowedUses>,
    /// Disable (true) or enable (false).
    pub disabled: Option<bool>,
    /// A new block size for new claims (existing blocks keep theirs and drain; see
    /// [`Ipam::set_pool`]).
    pub block_size: Option<u8>,
}

impl PoolChange {
    fn apply_to(&self, pool: &mut Pool) {
        if let Some(selector) = &self.node_selector {
            pool.node_selector = selector.clone();
        }
        if let Some(mode) = self.assignment_mode {
            pool.assignment_mode = mode;
        }
        if let Some(uses) = &self.allowed_uses {
            pool.allowed_uses = uses.clone();
        }
        if let Some(disabled) = self.disabled {
            pool.disabled = disabled;
        }
    }
}

/// What deleting a pool did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolDeletion {
    /// The deleted pool.
    pub pool: Pool,
    /// Addresses released because of `force`.
    pub released_addresses: u64,
    /// Blocks deleted.
    pub deleted_blocks: u64,
}

/// What releasing a host's affinities did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRelease {
    /// Empty blocks deleted.
    pub deleted_blocks: Vec<IpNet>,
    /// Non-empty blocks that lost their affinity (deleted when their last address goes).
    pub unassigned_blocks: Vec<IpNet>,
    /// Addresses released (when addresses were asked for too).
    pub released_addresses: Vec<IpAddr>,
}

/// Usage of one block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockUsage {
    /// The block.
    pub cidr: IpNet,
    /// Its pool's name, if it lies in one.
    pub pool: Option<String>,
    /// Its affine host.
    pub host: Option<String>,
    /// Addresses in it.
    pub capacity: u64,
    /// Allocated.
    pub in_use: u64,
    /// Free: neither allocated nor reserved.
    pub free: u64,
    /// Covered by an IP reservation, allocated or not (Calico's `Reserved`).
    #[serde(default)]
    pub reserved: u64,
    /// Released but still in IP cooldown: neither free nor in use.
    #[serde(default)]
    pub cooling: u64,
}

/// Usage of one pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolUsage {
    /// The pool.
    pub pool: Pool,
    /// Addresses the pool spans (saturating at `u128::MAX`).
    pub capacity: u128,
    /// Allocated.
    pub in_use: u64,
    /// Free: neither allocated nor reserved, blocks not yet claimed included.
    pub free: u128,
    /// Covered by an IP reservation, allocated or not, over the whole pool CIDR (Calico's
    /// `Reserved`).
    #[serde(default)]
    pub reserved: u128,
    /// Released but still in IP cooldown: neither free nor in use.
    #[serde(default)]
    pub cooling: u64,
    /// Blocks that exist in the pool.
    pub blocks: Vec<BlockUsage>,
}

/// Usage of the whole store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Utilization {
    /// Per pool, sorted by CIDR.
    pub pools: Vec<PoolUsage>,
    /// Blocks that lie in no pool.
    pub orphan_blocks: Vec<BlockUsage>,
    /// Pool, block and reservation objects that could not be decoded, sorted by key: the figures
    /// above leave them out (`check` reports each with its way out). With allocations read, also
    /// the owner keys missing or undecodable, whose block's allocations are left out (the block
    /// itself still counts in the figures).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub undecodable: Vec<UndecodableObject>,
}

/// What an ADD of a host reads first, with what CNI STATUS needs beside it, from one read:
/// [`Ipam::host_utilization`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostUtilization {
    /// The usage of the host's blocks with a free address; every pool, whatever it holds.
    pub usage: Utilization,
    /// The IPAM configuration (defaults when never set).
    pub config: IpamConfig,
    /// The host's labels (empty for a node never labelled).
    pub labels: BTreeMap<String, String>,
}

/// A stored object a listing could not decode, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UndecodableObject {
    /// Its key.
    pub key: String,
    /// What is wrong with it.
    pub message: String,
}

impl UndecodableObject {
    /// The object at `key` that failed to decode with `error`.
    pub fn new(key: String, error: IpamError) -> Self {
        let message = match error {
            IpamError::Corrupt { message, .. } => message,
            other => other.to_string(),
        };
        UndecodableObject { key, message }
    }

    /// The corrupt-object error it stands for.
    pub fn into_error(self) -> IpamError {
        IpamError::Corrupt {
            key: self.key,
            message: self.message,
        }
    }

    /// When it is a block: the host its key says it is affine to (`None`: none) and its CIDR.
    pub fn block(&self) -> Option<(Option<&str>, IpNet)> {
        let affinity = keys::affinity_of_block_key(&self.key)?;
        let (_, segment) = self.key.rsplit_once('/')?;
        Some((affinity, keys::parse_cidr_segment(segment)?))
    }

    /// The CIDR whose addresses it leaves unknown (who holds each, if anyone): a block's, or the
    /// block's of an owner key (an address's attributes kept apart from its block).
    pub fn covers(&self) -> Option<IpNet> {
        match self.block() {
            Some((_, cidr)) => Some(cidr),
            None => keys::parse_owner_key(&self.key).map(|(cidr, _)| cidr),
        }
    }
}

/// A decoded object with where and when it was read.
#[derive(Debug, Clone)]
pub(crate) struct Stored<T> {
    pub key: String,
    pub revision: Revision,
    pub value: T,
}

pub(crate) fn decode_stored<T: serde::de::DeserializeOwned + 'static>(
    kv: KeyValue,
) -> Result<Stored<T>, IpamError> {
    Ok(Stored {
        value: decode(&kv.key, &kv.value)?,
        key: kv.key,
        revision: kv.revision,
    })
}

/// Decodes each listed object with `decode_value`: the ones that decode, with where and when
/// they were read, and beside them each one that does not, named by its key; one damaged object
/// hides no other.
pub(crate) fn decode_each<T>(
    listed: Vec<KeyValue>,
    decode_value: impl Fn(&str, &[u8]) -> Result<T, IpamError>,
    undecodable: &mut Vec<UndecodableObject>,
) -> Vec<Stored<T>> {
    let mut sound = Vec::with_capacity(listed.len());
    for kv in listed {
        match decode_value(&kv.key, &kv.value) {
            Ok(value) => sound.push(Stored {
                value,
                key: kv.key,
                revision: kv.revision,
            }),
            Err(e) => undecodable.push(UndecodableObject::new(kv.key, e)),
        }
    }
    sound
}

/// A block being changed by one attempt.
#[derive(Debug, Clone)]
pub(crate) struct WorkingBlock {
    /// Key and revision it was read at; `None` for a block this attempt creates.
    pub read: Option<(String, Revision)>,
    pub block: Block,
    pub dirty: bool,
    /// For a block this attempt creates: the revision of the sequence floor its numbering starts
    /// at (`None`: the floor was never written). Its creation is conditioned on it (see
    /// [`Plan::write_block`]).
    pub numbered_from: Option<Revision>,
}

impl WorkingBlock {
    pub(crate) fn from_stored(stored: Stored<Block>) -> Self {
        WorkingBlock {
            read: Some((stored.key, stored.revision)),
            block: stored.value,
            dirty: false,
            numbered_from: None,
        }
    }

    /// A block this attempt creates for `affinity`, its sequence numbers starting at the store's
    /// sequence floor (read in the same snapshot that showed the CIDR unclaimed).
    pub(crate) fn created(
        cidr: IpNet,
        affinity: Option<String>,
        sequence_floor: SequenceFloor,
        now: u64,
    ) -> Self {
        WorkingBlock {
            read: None,
            block: Block::claimed(cidr, affinity, sequence_floor.value, now),
            dirty: true,
            numbered_from: sequence_floor.revision,
        }
    }
}

/// The blocks found for a set of CIDRs, and the sequence floor read in the same snapshot.
#[derive(Debug, Default)]
pub(crate) struct LoadedBlocks {
    pub found: BTreeMap<IpNet, Stored<Block>>,
    pub sequence_floor: SequenceFloor,
    /// Blocks that could not be decoded, when the read was asked to get past them (see
    /// [`Ipam::load_blocks_given_claims_each`]); always empty otherwise (such a block fails the read).
    pub undecodable: Vec<UndecodableObject>,
}

/// The sequence floor as one read found it ([`keys::sequence_floor`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SequenceFloor {
    /// The first sequence number a new block may start at (0 when never written).
    pub value: u64,
    /// The revision it was read at (`None` when never written). A block numbered from this floor
    /// is created only while the floor is still at it: a deletion of the same block by another
    /// client since (which raised the floor past the numbers the deleted block gave) makes the
    /// creation conflict and be decided again, instead of repeating those numbers.
    pub revision: Option<Revision>,
}

/// Decodes the sequence floor (0 when never written), with the revision it was read at.
fn decode_sequence_floor(kv: Option<KeyValue>) -> Result<SequenceFloor, IpamError> {
    match kv {
        None => Ok(SequenceFloor::default()),
        Some(kv) => Ok(SequenceFloor {
            value: decode(&kv.key, &kv.value)?,
            revision: Some(kv.revision),
        }),
    }
}

/// The whole claim index (one small entry per block: CIDR, owner, free count) and the sequence
/// floor, read in one snapshot: what the full new-block search and borrowing read instead of every
/// block's value.
#[derive(Debug)]
pub(crate) struct ClaimIndex {
    pub entries: Vec<IndexedClaim>,
    pub sequence_floor: SequenceFloor,
}

/// One claim index entry, decoded, with the stored entry it came from.
#[derive(Debug)]
pub(crate) struct IndexedClaim {
    pub cidr: IpNet,
    pub claim: ClaimEntry,
    pub stored: KeyValue,
}

impl IndexedClaim {
    /// A listed claim index entry, decoded, with the CIDR its key names.
    pub(crate) fn decode(kv: KeyValue) -> Result<IndexedClaim, IpamError> {
        let cidr = kv
            .key
            .strip_prefix(&keys::claims_dir())
            .and_then(keys::parse_cidr_segment)
            .ok_or_else(|| IpamError::Corrupt {
                key: kv.key.clone(),
                message: "a claim index key that names no CIDR".into(),
            })?;
        Ok(IndexedClaim {
            cidr,
            claim: decode_claim(&kv.key, &kv.value)?,
            stored: kv,
        })
    }
}

/// Blocks a new-block search reads ahead, per candidate pool, from the host's hashed start.
const NEW_BLOCK_PROBES: u128 = 16;

/// The first `probes` blocks of `pool` a new-block search of `host` looks at, from the host's
/// hashed start, wrapping at the end of the pool (no block twice).
fn probed_blocks<'a>(pool: &'a Pool, host: &str, probes: u128) -> impl Iterator<Item = IpNet> + 'a {
    let count = pool.block_count();
    let start = if count == 0 {
        0
    } else {
        u128::from(host_hash(host)) % count
    };
    (0..count.min(probes)).filter_map(move |step| pool.block_at((start + step) % count))
}

/// What the next ADD of a host that must claim a new block finds in the first read of its
/// search ([`Ipam::new_block_prospect`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewBlockProspect {
    /// The host's blocks kept under `full/` (no free address for an ADD), by the CIDR their keys
    /// name (one that cannot be decoded counts too), when asked for: the per-host block limit
    /// counts them.
    pub full_blocks: Vec<IpNet>,
    /// For each pool asked about, in the order given: the first of its probed blocks that no
    /// node has claimed and that reservations leave an address in, which that ADD would claim;
    /// `None` when the probe found none (the pool may still have one, which only the claim
    /// index tells), and for a pool of mixed block sizes and every pool after it (there the
    /// search goes to the claim index).
    pub unclaimed: Vec<Option<IpNet>>,
    /// The probed blocks another node or none holds whose claim entries record a free address
    /// that reservations leave, in the order an ADD that must borrow tries them (blocks nobody
    /// holds first, then by address): the lenders [`Ipam::first_lender_with_room`] reads.
    pub lenders: Vec<IpNet>,
    /// The lenders' claim entries as read, the reservations and the host: what reading the
    /// lenders, and the claim index after them, needs.
    lender_claims: Vec<KeyValue>,
    reserved: crate::model::reservations::ReservedRanges,
    host: String,
}

/// What [`Ipam::room_in_claim_index`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimIndexRoom {
    /// The block the ADD would claim, or borrow an address from; `None` when there is none.
    pub block: Option<IpNet>,
    /// When there is none: the lenders passed over because their blocks cannot be decoded
    /// (they may have had room).
    pub undecodable: Vec<UndecodableObject>,
}

/// What the first read of a new-block search found.
#[derive(Debug)]
struct NewBlockProbe {
    /// The mixed-sizes records of candidate pools (pool CIDR, record as read; see `resize.rs`).
    mixed: Vec<(IpNet, KeyValue)>,
    /// The host's full blocks (all families), when the per-host limit needs them.
    host_full: Vec<IpNet>,
    /// Of those, the ones with a free address (only their edges free), when asked for.
    edge_blocks: Vec<Stored<Block>>,
    /// Of those, when asked for, the ones that cannot be decoded (passed over, never written).
    damaged_full: Vec<UndecodableObject>,
    /// Unclaimed blocks among the probed ones, in search order.
    unclaimed: Vec<IpNet>,
    /// The sequence floor, read in the same snapshot.
    sequence_floor: SequenceFloor,
    /// The block-release counter's revision (full_pools.rs).
    releases: u64,
    /// Every candidate pool has a believed full-pool mark (and none has mixed block sizes).
    marked_full: bool,
    /// The claim entries the probes found: the window (full_pools.rs).
    window: Vec<IndexedClaim>,
}

/// Bytes a transaction keeps free for the format record's key and value (see `Ipam::seal`).
const FORMAT_RECORD_ROOM: usize = 64;

/// Accumulates the conditions and writes of one transaction, one entry per key.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    conditions: BTreeMap<String, Condition>,
    writes: BTreeMap<String, Option<Vec<u8>>>,
    /// Past the last sequence number of every block this plan deletes: the sequence floor must
    /// reach it in the same transaction (see [`Ipam::commit_plan`]).
    retired_sequence: u64,
    /// The stored format whose layout decides where blocks are written ([`keys::block_key_in`]):
    /// the store's write format as the allocator last learned it (0, the oldest layout, when it
    /// has not). [`Ipam::commit_plan`] refuses a plan laid out for a newer format than the store's.
    layout_format: u8,
    /// Set by an attempt that proved its commit may leave the plugin's activity record as it is:
    /// the conditions that keep that proof true ([`Ipam::activity_unchanged`]).
    pub activity_unchanged: Option<Vec<Condition>>,
}

/// The plugin's node activity record and where its node's registration is kept.
#[derive(Debug)]
struct ActivityRecording {
    /// `ipam/v1/activity/<host>`.
    key: String,
    /// The record this plugin writes.
    value: Vec<u8>,
    /// `ipam/v1/agents/<host>`: the registration a reclaimer marks.
    registration_key: String,
    /// `ipam/v1/missing/<host>`: the grace countdown a reclaimer starts before it marks.
    countdown_key: String,
    /// `ipam/v1/node-generation/<host>`: put with every write of the record.
    generation_key: String,
}

impl Plan {
    /// True when this plan puts blocks whose only free addresses are their edges under `full/`.
    pub fn keeps_edge_blocks_full(&self) -> bool {
        self.layout_format >= keys::EDGE_BLOCKS_FULL_FORMAT
    }

    /// True when this plan keeps the attributes of the addresses it takes apart from their
    /// blocks, in owner keys, and in their handles the metadata of each ([`Handle::hold`]).
    pub fn keeps_attributes_apart(&self) -> bool {
        self.layout_format >= OWNERS_APART_FORMAT
    }

    /// `metadata` when this plan keeps attributes apart: what a handle records beside its count
    /// for an address this plan takes ([`Handle::hold`]).
    pub fn apart_metadata<'a>(
        &self,
        metadata: &'a BTreeMap<String, String>,
    ) -> Option<&'a BTreeMap<String, String>> {
        self.keeps_attributes_apart().then_some(metadata)
    }

    pub fn expect(&mut self, key: &str, revision: Option<Revision>) {
        self.conditions
            .entry(key.to_owned())
            .or_insert_with(|| match revision {
                Some(r) => Condition::at_revision(key, r),
                None => Condition::absent(key),
            });
    }

    /// Adds the validators of the read a plan was decided from (`KvStore::read_many_cached`):
    /// the commit then applies only if every answer is still the store's. Always for an answer
    /// from the cache; for one from the store, when they fit beside the plan's own conditions
    /// (carried, they keep a cache in front of the store exact past the commit).
    pub fn carry_validators(&mut self, validators: Vec<Condition>, from_cache: bool) {
        if from_cache || self.conditions.len() + validators.len() < MAX_TXN_CONDITIONS {
            for validator in validators {
                self.carry(validator);
            }
        }
    }

    /// Adds `condition` unless the plan already tests its key (the plan's own expectation,
    /// from a later read, stands); a prefix condition is kept apart from a key of the same text.
    fn carry(&mut self, condition: Condition) {
        let tested = if condition.tests_a_prefix() {
            // No key holds NUL: this never meets a key's entry.
            format!("\0{}", condition.key())
        } else {
            condition.key().to_owned()
        };
        self.conditions.entry(tested).or_insert(condition);
    }

    pub fn put(&mut self, key: &str, value: Vec<u8>) {
        self.writes.insert(key.to_owned(), Some(value));
    }

    pub fn delete(&mut self, key: &str) {
        self.writes.insert(key.to_owned(), None);
    }

    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Records `block` in `host`'s borrowed-block index when it is not affine to `host`: the
    /// transaction is putting an address for `host` there.
    pub fn index_borrowed(&mut self, host: &str, block: &Block) {
        if block.affinity.as_deref() != Some(host) {
            self.put(
                &keys::borrowed_key(host, &block.cidr),
                BORROWED_INDEX_VALUE.to_vec(),
            );
        }
    }

    fn bytes(&self) -> usize {
        self.writes
            .iter()
            .map(|(key, value)| key.len() + value.as_ref().map_or(0, Vec::len))
            .chain(self.conditions.keys().map(String::len))
            .sum()
    }

    /// True when the transaction fits every store's limits (operations, conditions, bytes).
    pub fn fits_one_transaction(&self) -> bool {
        // One more write and condition for the store's format record (see `Ipam::seal`).
        self.writes.len() < MAX_TXN_OPS
            && self.conditions.len() < MAX_TXN_CONDITIONS
            && self.bytes() + FORMAT_RECORD_ROOM <= MAX_TXN_BYTES
    }

    /// The plan's size against the limits, for an error message.
    pub fn describe_size(&self) -> String {
        format!(
            "{} writes (limit {MAX_TXN_OPS}), {} conditions (limit {MAX_TXN_CONDITIONS}), {} bytes (limit {MAX_TXN_BYTES})",
            self.writes.len(),
            self.conditions.len(),
            self.bytes()
        )
    }

    pub fn into_txn(self) -> Txn {
        Txn {
            conditions: self.conditions.into_values().collect(),
            ops: self
                .writes
                .into_iter()
                .map(|(key, value)| match value {
                    Some(value) => Op::Put { key, value },
                    None => Op::Delete { key },
                })
                .collect(),
        }
    }

    /// Deletes a block stored at `key` (its claim too); the commit raises the sequence floor past
    /// the block's last sequence number.
    pub fn delete_block(&mut self, key: &str, block: &Block) {
        self.delete(key);
        self.delete(&keys::block_claim(&block.cidr));
        // Full-pool marks made before this release are no longer believed (full_pools.rs).
        self.put(&keys::block_releases(), b"{}".to_vec());
        self.retired_sequence = self.retired_sequence.max(block.sequence.saturating_add(1));
    }

    /// True when this plan deletes a block (its commit must raise the sequence floor).
    pub fn deletes_blocks(&self) -> bool {
        self.retired_sequence > 0
    }

    /// Adds, when this plan deletes blocks, the write that raises the sequence floor (currently
    /// `floor`, read at its revision) past them, conditioned on that revision so that concurrent
    /// raises never lower it. A condition the plan already has on the floor stands (a block it
    /// creates is numbered from the floor as read then): if the floor moved since, the commit
    /// conflicts.
    pub fn raise_sequence_floor(&mut self, floor: Option<KeyValue>) -> Result<(), IpamError> {
        let current = decode_sequence_floor(floor)?;
        if self.retired_sequence > current.value {
            let key = keys::sequence_floor();
            self.expect(&key, current.revision);
            self.put(&key, encode(&self.retired_sequence)?);
        }
        self.retired_sequence = 0;
        Ok(())
    }

    /// Adds the writes of a block changed by this attempt.
    pub fn write_block(&mut self, working: &WorkingBlock) -> Result<(), IpamError> {
        if !working.dirty {
            return Ok(());
        }
        let block = &working.block;
        let key = keys::block_key_in(block, self.layout_format);
        match &working.read {
            None => {
                self.expect(&key, None);
                self.expect(&keys::block_claim(&block.cidr), None);
                // Absence alone is not enough: another client may have created, used and deleted
                // this block since the read (both keys absent again), raising the floor past the
                // numbers it gave; numbered from the floor as read, this block would repeat them.
                self.expect(&keys::sequence_floor(), working.numbered_from);
            }
            Some((read_key, revision)) => {
                self.expect(read_key, Some(*revision));
                if *read_key != key {
                    // The block moved (affinity changed, or it filled up or got room again).
                    self.expect(&key, None);
                    self.delete(read_key);
                    if keys::affinity_of_block_key(read_key) != Some(block.affinity.as_deref()) {
                        // A new owner (or none): the addresses it holds for other nodes are
                        // borrowed from now on.
                        let mut nodes = BTreeSet::new();
                        for ordinal in block.allocations.keys() {
                            if let Some(attribute) = block.attribute_of(*ordinal)? {
                                nodes.extend(attribute.metadata.get(ATTR_NODE));
                            }
                        }
                        for node in nodes {
                            self.index_borrowed(node, block);
                        }
                    }
                }
            }
        }
        // The owner keys of the apart addresses this attempt freed go with the block (whatever
        // this plan's layout: only a store that keeps attributes apart holds them).
        for ordinal in block.freed_apart() {
            self.delete(&keys::owner_key(&block.cidr, ordinal));
        }
        if block.is_empty() && block.affinity.is_none() {
            // Calico's rule: an empty block with no affinity is deleted.
            self.delete_block(&key, block);
        } else {
            let mut block = block.clone();
            block.sequence += 1;
            if self.keeps_attributes_apart() {
                for (ordinal, attribute) in block.move_taken_apart() {
                    // After the deletes above: an ordinal freed and taken again keeps its key.
                    self.put(&keys::owner_key(&block.cidr, ordinal), encode(&attribute)?);
                }
            }
            let value = encode(&block)?;
            if value.len() > MAX_VALUE_BYTES {
                return Err(IpamError::Internal(format!(
                    "block {} would take {} bytes, more than one stored value may ({MAX_VALUE_BYTES})",
                    block.cidr,
                    value.len()
                )));
            }
            self.put(&key, value);
            // The claim entry follows the block's owner and free count on every write.
            self.put(&keys::block_claim(&block.cidr), encode_claim(&block)?);
        }
        Ok(())
    }
}

/// Outcome of one optimistic attempt.
pub(crate) enum Attempt<T> {
    Done(T),
    Conflict,
}

/// FNV-1a of the host name: the start index of the host's new-block search, stable across builds.
pub(crate) fn host_hash(host: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in host.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// Where the allocator reads the time (seconds since the Unix epoch): the system clock, or one a
/// test sets.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> u64 + Send + Sync>);

impl Clock {
    /// The system's wall clock.
    pub fn system() -> Self {
        Clock(Arc::new(crate::model::timestamp::unix_now))
    }

    /// A clock that reads `now` (for tests that move time by hand).
    pub fn from_fn(now: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        Clock(Arc::new(now))
    }

    /// Seconds since the Unix epoch.
    pub fn now(&self) -> u64 {
        (self.0)()
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Clock({})", self.now())
    }
}

/// The cache a node's agent keeps in front of `inner` for the allocators it serves: a handle it
/// does not know is taken for absent (a new container's handle was never written), and the
/// pools are validated by the pool generation alone, which every pool write raises in the same
/// transaction (so a steady ADD tests one key for every pool instead of each pool and their
/// prefix). In a store finalized at [`crate::model::GENERATIONS_COVER_FORMAT`] or later, the
/// pool generation also validates the configuration, the import marker, reservations, node
/// labels, namespace settings and confirmed reservations, and each node's generation its
/// registration, its activity record and the absence of its grace countdown (which the store
/// deletes on its own when the grace ends, so only its absence is covered).
pub fn node_cache(inner: Arc<dyn KvStore>) -> crate::kv::caching::CachingStore {
    use crate::kv::caching::Covering;
    let finalized =
        |covering: Covering| covering.when(keys::store_format(), FormatRecord::generations_cover);
    let mut cache = crate::kv::caching::CachingStore::new(inner)
        .speculating_absent_under(keys::handles_dir())
        .covering(keys::pools_dir(), keys::pool_generation());
    for prefix in [
        keys::config(),
        keys::import_in_progress(),
        keys::reservations_dir(),
        keys::nodes_dir(),
        keys::namespaces_dir(),
        keys::reservations_held_dir(),
    ] {
        cache = cache.with_covering(finalized(Covering::listing(
            prefix,
            keys::pool_generation(),
        )));
    }
    for prefix in [keys::agents_dir(), keys::activity_dir()] {
        cache = cache.with_covering(finalized(Covering::each_by_name(
            prefix,
            keys::node_generations_dir(),
        )));
    }
    cache.with_covering(finalized(
        Covering::each_by_name(keys::countdown_dir(), keys::node_generations_dir()).absent_only(),
    ))
}

/// The allocator: every IPAM operation, over any [`KvStore`].
#[derive(Debug, Clone)]
pub struct Ipam {
    store: Arc<dyn KvStore>,
    retry: RetryPolicy,
    /// Conditions added to every transaction this allocator commits (see [`Ipam::guarded_by`]).
    guard: Arc<[Condition]>,
    /// The plugin's node activity record, which every commit of this allocator writes unless it
    /// proves the record needs no rewrite (see [`Ipam::recording_activity`]).
    activity: Option<Arc<ActivityRecording>>,
    /// The caller's clock: stamps releases (IP cooldown) and block claims and emptying.
    clock: Clock,
    /// The store's write format as last learned ([`upgrade`]).
    format: self::upgrade::FormatCell,
}

impl Ipam {
    /// An allocator over `store` with the default retry policy and the system clock.
    pub fn new(store: Arc<dyn KvStore>) -> Self {
        Ipam {
            store,
            retry: RetryPolicy::default(),
            guard: Arc::from(Vec::new()),
            activity: None,
            clock: Clock::system(),
            format: Default::default(),
        }
    }

    /// The same allocator, reading the time from `clock`.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Now, by this allocator's clock.
    pub fn now(&self) -> u64 {
        self.clock.now()
    }

    /// The time and cooldown a change made now under `config` uses.
    pub(crate) fn lifetime(&self, config: &IpamConfig) -> Lifetime {
        Lifetime {
            now: self.now(),
            cooldown_seconds: config.ip_cooldown_seconds,
        }
    }

    /// The same allocator, with `guard` added to every transaction it commits: once any of these
    /// conditions stops holding, each write fails with [`IpamError::GuardLost`] and nothing more
    /// is written. What a reclaimer uses to stop the moment a node it thought dead comes back.
    pub fn guarded_by(mut self, guard: Vec<Condition>) -> Self {
        self.guard = Arc::from(guard);
        self
    }

    /// The same allocator, rewriting `host`'s activity record in every transaction it commits
    /// (one more small put in a transaction it sends anyway, never a round trip of its own): the
    /// evidence that the node's runtime gets work done, which keeps a node whose agent is down
    /// from being reclaimed (`dead_nodes`). What the plugin uses for its node.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an invalid host name.
    pub fn recording_activity(
        mut self,
        host: &str,
        plugin_version: &str,
    ) -> Result<Self, IpamError> {
        crate::model::validate_host(host)?;
        let record = crate::allocator::dead_nodes::Activity {
            node: host.to_owned(),
            plugin_version: plugin_version.to_owned(),
            reads_format: Some(crate::model::FORMAT_VERSION),
        };
        self.activity = Some(Arc::new(ActivityRecording {
            key: crate::allocator::dead_nodes::activity_key(host),
            value: record.encode()?,
            registration_key: crate::allocator::dead_nodes::agent_key(host),
            countdown_key: crate::allocator::dead_nodes::countdown_key(host),
            generation_key: crate::model::keys::node_generation(host),
        }));
        Ok(self)
    }

    /// The reads a call's attempt adds to its batch so that its commit may leave the activity
    /// record as it is (none when this allocator records no activity): the store's format
    /// record, the node's generation, its registration, its activity record, then its grace
    /// countdown, in that order (see [`Ipam::activity_unchanged`]). Their answers go to
    /// [`Ipam::activity_unchanged`].
    pub(crate) fn activity_reads(&self) -> Vec<Read> {
        self.activity
            .iter()
            .flat_map(|activity| {
                [
                    crate::allocator::upgrade::format_read(),
                    Read::Get(activity.generation_key.clone()),
                    Read::Get(activity.registration_key.clone()),
                    Read::Get(activity.key.clone()),
                    Read::Get(activity.countdown_key.clone()),
                ]
            })
            .collect()
    }

    /// From the answers to [`Ipam::activity_reads`] (taken from `results`): the conditions under
    /// which a commit may leave the activity record as it is, or `None` when it must rewrite it.
    ///
    /// The record is evidence only against a reclaimer's mark: a node is dead only when its
    /// record has not moved since a reclaimer marked its registration (`dead_nodes`). So a
    /// commit may skip the rewrite while the registration is absent or carries no mark (exactly
    /// as this build writes an unmarked one), no grace countdown runs for the node, and the
    /// record already holds this plugin's value, provided all three are still so when it
    /// commits: it carries "registration unchanged", "no countdown" and "record unchanged"
    /// instead. A mark, a new registration or a countdown made before it commits fails it, and
    /// its retry rewrites the record, as every commit did before. The countdown matters because
    /// a reclaimer starts it before it marks: the grace is timed from the countdown, so a commit
    /// after the countdown started that left the record as it was would let the node be
    /// reclaimed less than the grace after that commit.
    ///
    /// In a store finalized at [`crate::model::GENERATIONS_COVER_FORMAT`] or later (as the
    /// format record read first says), every write of those three puts the node's generation
    /// too, so the commit carries the generation as read (present at its revision, or absent)
    /// instead of the three: the format record was read before the generation, and the
    /// generation before the three, so a write of any of them after they were read moved the
    /// generation.
    pub(crate) fn activity_unchanged(
        &self,
        results: &mut impl Iterator<Item = crate::kv::ReadResult>,
    ) -> Result<Option<Vec<Condition>>, IpamError> {
        let Some(activity) = &self.activity else {
            return Ok(None);
        };
        let format = next_got(results)?;
        let generation = next_got(results)?;
        let registration = next_got(results)?;
        let record = next_got(results)?;
        let countdown = next_got(results)?;
        if countdown.is_some() {
            return Ok(None);
        }
        let Some(record) = record.filter(|kv| kv.value == activity.value) else {
            return Ok(None);
        };
        let registration_condition = match &registration {
            None => Condition::absent(&activity.registration_key),
            Some(kv) if crate::allocator::dead_nodes::is_unmarked_registration(&kv.value) => {
                Condition::at_revision(&activity.registration_key, kv.revision)
            }
            Some(_) => return Ok(None),
        };
        if format.is_some_and(|kv| FormatRecord::generations_cover(&kv.value)) {
            return Ok(Some(vec![match generation {
                Some(kv) => Condition::at_revision(&activity.generation_key, kv.revision),
                None => Condition::absent(&activity.generation_key),
            }]));
        }
        Ok(Some(vec![
            registration_condition,
            Condition::absent(&activity.countdown_key),
            Condition::at_revision(&activity.key, record.revision),
        ]))
    }

    /// Replaces the retry policy.
    pub fn with_retry_policy(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// The store underneath.
    pub fn store(&self) -> &Arc<dyn KvStore> {
        &self.store
    }

    /// Runs `attempt` until it is done, retrying conflicts with jittered exponential backoff.
    pub(crate) async fn retrying<T, F, Fut>(&self, mut attempt: F) -> Result<T, IpamError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Attempt<T>, IpamError>>,
    {
        let mut backoff = self.retry.base_backoff;
        for number in 1..=self.retry.max_attempts {
            match attempt().await {
                Ok(Attempt::Done(value)) => return Ok(value),
                Ok(Attempt::Conflict) | Err(IpamError::Store(KvError::Conflict { .. })) => {
                    if number == self.retry.max_attempts {
                        break;
                    }
                    let jitter = rand::random::<f64>() + 0.5;
                    tokio::time::sleep(backoff.mul_f64(jitter)).await;
                    backoff = (backoff * 2).min(self.retry.max_backoff);
                }
                Err(e) => return Err(e),
            }
        }
        Err(IpamError::RetriesExhausted {
            attempts: self.retry.max_attempts,
        })
    }

    /// Runs `attempt` for one attempt of a call: the first (`may_use_cache` set) may be answered
    /// from the store's cache ([`KvStore::read_many_cached`]), and its outcome stands only if it
    /// committed (`committed` tells it from the value) or the store failed; anything else decided
    /// from a cached answer (a value that needed no write, an error, a conflict) is decided again
    /// at once from the store. `attempt` gets whether it may use the cache and sets the flag it
    /// is handed when its answer came from there.
    pub(crate) async fn attempt_through_cache<T, F, Fut>(
        &self,
        may_use_cache: &AtomicBool,
        committed: impl Fn(&T) -> bool,
        attempt: F,
    ) -> Result<Attempt<T>, IpamError>
    where
        F: Fn(bool, Arc<AtomicBool>) -> Fut,
        Fut: Future<Output = Result<Attempt<T>, IpamError>>,
    {
        if may_use_cache.swap(false, Ordering::Relaxed) {
            let from_cache = Arc::new(AtomicBool::new(false));
            let outcome = attempt(true, Arc::clone(&from_cache)).await;
            if !from_cache.load(Ordering::Relaxed) {
                return outcome;
            }
            let stands = match &outcome {
                Ok(Attempt::Done(value)) => committed(value),
                Ok(Attempt::Conflict) | Err(IpamError::Store(KvError::Conflict { .. })) => false,
                // The store's trouble, not the cache's: as from any attempt.
                Err(IpamError::Store(_) | IpamError::GuardLost { .. }) => true,
                Err(_) => false,
            };
            if stands {
                return outcome;
            }
        }
        attempt(false, Arc::new(AtomicBool::new(false))).await
    }

    /// An empty plan, laid out for the store's write format as this allocator last learned it.
    pub(crate) fn plan(&self) -> Plan {
        Plan {
            layout_format: self.learned_format().unwrap_or(0),
            ..Plan::default()
        }
    }

    /// Commits a plan; a failed condition becomes [`Attempt::Conflict`].
    pub(crate) async fn commit_plan<T>(
        &self,
        mut plan: Plan,
        value: T,
    ) -> Result<Attempt<T>, IpamError> {
        if plan.is_empty() {
            return Ok(Attempt::Done(value));
        }
        if plan.layout_format > self.known_format().await?.writes {
            // Laid out for a format the store no longer records as written (it was replaced under
            // this allocator): decided again on the record as it is.
            self.forget_format();
            return Ok(Attempt::Conflict);
        }
        if plan.deletes_blocks() {
            // Deleting a block: one more read (rare: a block is deleted when it is empty and has
            // no affinity), so that the floor only ever grows.
            let floor = self.store.get(&keys::sequence_floor()).await?;
            plan.raise_sequence_floor(floor)?;
        }
        for condition in self.guard.iter() {
            plan.conditions
                .insert(condition.key().to_owned(), condition.clone());
        }
        if let Some(activity) = &self.activity {
            match plan.activity_unchanged.take() {
                Some(conditions) => {
                    for condition in conditions {
                        plan.carry(condition);
                    }
                }
                None => {
                    plan.put(&activity.key, activity.value.clone());
                    plan.put(&activity.generation_key, b"activity".to_vec());
                }
            }
        }
        if !plan.fits_one_transaction() {
            return Err(IpamError::TooLarge(plan.describe_size()));
        }
        let txn = self.seal(plan.into_txn()).await?;
        crate::fault::point(crate::fault::FaultPoint::BeforeCommit);
        match self.store.commit(txn).await {
            Ok(revision) => {
                self.committed(revision);
                crate::fault::point(crate::fault::FaultPoint::AfterCommit);
                Ok(Attempt::Done(value))
            }
            Err(KvError::Conflict { key }) if self.guard.iter().any(|c| c.key() == key) => {
                Err(IpamError::GuardLost { key })
            }
            Err(KvError::Conflict { key }) => {
                if key == keys::store_format() {
                    self.forget_format();
                }
                Ok(Attempt::Conflict)
            }
            Err(e) => Err(e.into()),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Reading
    // -----------------------------------------------------------------------------------------

    pub(crate) fn decode_pools(kvs: Vec<KeyValue>) -> Result<Vec<Stored<Pool>>, IpamError> {
        let mut pools: Vec<Stored<Pool>> = kvs
            .into_iter()
            .map(|kv| {
                Ok(Stored {
                    value: decode_pool(&kv.key, &kv.value)?,
                    key: kv.key,
                    revision: kv.revision,
                })
            })
            .collect::<Result<_, IpamError>>()?;
        sort_pools(&mut pools);
        Ok(pools)
    }

    pub(crate) fn decode_config(
        kv: Option<KeyValue>,
    ) -> Result<(IpamConfig, Option<Revision>), IpamError> {
        match kv {
            None => Ok((IpamConfig::default(), None)),
            Some(kv) => {
                let stored: Stored<IpamConfig> = decode_stored(kv)?;
                Ok((stored.value, Some(stored.revision)))
            }
        }
    }

    pub(crate) fn decode_handle(
        kv: Option<KeyValue>,
    ) -> Result<(Handle, Option<Revision>), IpamError> {
        match kv {
            None => Ok((Handle::default(), None)),
            Some(kv) => {
                let stored: Stored<Handle> = decode_stored(kv)?;
                Ok((stored.value, Some(stored.revision)))
            }
        }
    }

    /// Reads the owner keys of the apart addresses of `blocks` whose attributes are not known yet
    /// (format 6), in one round trip that reads each such block again: a block that changed
    /// since the caller read it fails the call with a conflict (an attempt retries), so what is
    /// loaded is always what the caller's block holds. Blocks with nothing to load cost nothing.
    ///
    /// # Errors
    /// [`KvError::Conflict`] naming a block that changed; [`IpamError::Corrupt`] naming the owner
    /// key of an address the block holds apart when that key is missing or cannot be decoded;
    /// store failures.
    pub(crate) async fn load_owner_keys<'a>(
        &self,
        blocks: impl IntoIterator<Item = &'a mut Stored<Block>>,
    ) -> Result<(), IpamError> {
        let mut pending: Vec<&mut Stored<Block>> = blocks
            .into_iter()
            .filter(|stored| !stored.value.unloaded_apart().is_empty())
            .collect();
        if pending.is_empty() {
            return Ok(());
        }
        let mut reads = Vec::with_capacity(pending.len() * 2);
        for stored in &pending {
            reads.push(Read::Get(stored.key.clone()));
            reads.push(Read::List(keys::block_owners_dir(&stored.value.cidr)));
        }
        let mut results = self.store.read_many(&reads).await?.into_iter();
        for stored in &mut pending {
            let current = next_got(&mut results)?;
            let owners = next_listed(&mut results)?;
            if current.map(|kv| kv.revision) != Some(stored.revision) {
                return Err(IpamError::Store(KvError::Conflict {
                    key: stored.key.clone(),
                }));
            }
            load_owners_into(&mut stored.value, owners)?;
        }
        Ok(())
    }

    /// Loads, for each block, the owner keys of the ordinals given beside it that it holds apart
    /// and has not loaded: one round trip reading those keys alone (a call about a few addresses
    /// reads their keys, not every key of their blocks), each block read again in the same batch.
    ///
    /// # Errors
    /// [`KvError::Conflict`] (as [`IpamError::Store`]) when a block changed since it was read;
    /// [`IpamError::Corrupt`] naming an owner key that cannot be decoded, or one that is missing
    /// while its block is unchanged.
    pub(crate) async fn load_owner_keys_of<'a>(
        &self,
        wanted: impl IntoIterator<Item = (&'a mut Stored<Block>, BTreeSet<u32>)>,
    ) -> Result<(), IpamError> {
        let mut pending: Vec<(&mut Stored<Block>, Vec<u32>)> = wanted
            .into_iter()
            .filter_map(|(stored, ordinals)| {
                let unloaded: Vec<u32> = stored
                    .value
                    .unloaded_apart()
                    .into_iter()
                    .filter(|ordinal| ordinals.contains(ordinal))
                    .collect();
                (!unloaded.is_empty()).then_some((stored, unloaded))
            })
            .collect();
        if pending.is_empty() {
            return Ok(());
        }
        let mut reads = Vec::new();
        for (stored, ordinals) in &pending {
            reads.push(Read::Get(stored.key.clone()));
            for ordinal in ordinals {
                reads.push(Read::Get(keys::owner_key(&stored.value.cidr, *ordinal)));
            }
        }
        let mut results = self.store.read_many(&reads).await?.into_iter();
        for (stored, ordinals) in &mut pending {
            let current = next_got(&mut results)?;
            let mut owners = Vec::with_capacity(ordinals.len());
            for _ in ordinals.iter() {
                owners.extend(next_got(&mut results)?);
            }
            if current.map(|kv| kv.revision) != Some(stored.revision) {
                return Err(IpamError::Store(KvError::Conflict {
                    key: stored.key.clone(),
                }));
            }
            load_owner_values(&mut stored.value, owners)?;
            let unloaded = stored.value.unloaded_apart();
            if let Some(ordinal) = ordinals.iter().find(|o| unloaded.contains(o)) {
                return Err(missing_owner_key(&stored.value, *ordinal));
            }
        }
        Ok(())
    }

    /// Reads the blocks with these CIDRs (wherever their affinity puts them): two round trips.
    ///
    /// # Errors
    /// As [`load_blocks_for_write`](Ipam::load_blocks_for_write).
    pub(crate) async fn load_blocks(
        &self,
        cidrs: &BTreeSet<IpNet>,
    ) -> Result<BTreeMap<IpNet, Stored<Block>>, IpamError> {
        Ok(self.load_blocks_for_write(cidrs).await?.found)
    }

    /// Reads the blocks with these CIDRs, expecting them affine to `host`: one round trip reading,
    /// per CIDR, its claim entry and the two keys the block may live at under `host` (open and
    /// full). A CIDR whose claim names another owner (or a block that is not where its claim
    /// says) is read again the general way, one more round trip. A block whose claim is absent
    /// in the same snapshot does not exist and is not returned.
    ///
    /// # Errors
    /// As [`load_blocks_for_write`](Ipam::load_blocks_for_write).
    pub(crate) async fn load_host_blocks(
        &self,
        host: &str,
        cidrs: &BTreeSet<IpNet>,
    ) -> Result<BTreeMap<IpNet, Stored<Block>>, IpamError> {
        let mut found = BTreeMap::new();
        if cidrs.is_empty() {
            return Ok(found);
        }
        let mut reads = Vec::with_capacity(cidrs.len() * 3);
        let mut spans = Vec::with_capacity(cidrs.len());
        for cidr in cidrs {
            let first = reads.len();
            reads.push(Read::Get(keys::block_claim(cidr)));
            for key in keys::block_candidates(Some(host), cidr) {
                reads.push(Read::Get(key));
            }
            spans.push(first..reads.len());
        }
        let mut results: Vec<Option<KeyValue>> = Vec::with_capacity(reads.len());
        for result in self.store.read_many(&reads).await? {
            results.push(result.into_got()?);
        }
        let mut elsewhere = BTreeSet::new();
        let mut their_claims = Vec::new();
        for (cidr, span) in cidrs.iter().zip(spans) {
            let Some(claim) = results[span.start].take() else {
                continue;
            };
            let owner = decode_claim(&claim.key, &claim.value)?.affinity;
            let at_host = results[span.start + 1..span.end]
                .iter_mut()
                .filter_map(Option::take)
                .last();
            match at_host {
                Some(kv) if owner.as_deref() == Some(host) => {
                    found.insert(*cidr, decode_stored(kv)?);
                }
                _ => {
                    elsewhere.insert(*cidr);
                    their_claims.push(Some(claim));
                }
            }
        }
        if !elsewhere.is_empty() {
            found.extend(
                self.load_blocks_given_claims(&elsewhere, their_claims)
                    .await?
                    .found,
            );
        }
        Ok(found)
    }

    /// Reads the blocks with these CIDRs, and the sequence floor. Two round trips: the claim index entries, then the blocks they point at read
    /// together with the claims again. A block is reported absent only when its claim entry is
    /// absent in the same snapshot; when a claim moved between the two reads (a block changing
    /// hosts), the second read is redone, so a block that exists is never taken for absent.
    ///
    /// # Errors
    /// Store failures; [`IpamError::Corrupt`] when a claim entry keeps naming a block that does
    /// not exist (`check --repair` clears it).
    pub(crate) async fn load_blocks_for_write(
        &self,
        cidrs: &BTreeSet<IpNet>,
    ) -> Result<LoadedBlocks, IpamError> {
        if cidrs.is_empty() {
            return Ok(LoadedBlocks::default());
        }
        let claim_reads: Vec<Read> = cidrs
            .iter()
            .map(|c| Read::Get(keys::block_claim(c)))
            .collect();
        let mut claims: Vec<Option<KeyValue>> = Vec::with_capacity(cidrs.len());
        for result in self.store.read_many(&claim_reads).await? {
            claims.push(result.into_got()?);
        }
        self.load_blocks_given_claims(cidrs, claims).await
    }

    /// [`load_blocks_for_write`](Self::load_blocks_for_write) after its first read: `claims` are
    /// the claim entries of `cidrs` (in order) as a recent read saw them. One round trip when they
    /// have not moved since.
    pub(crate) async fn load_blocks_given_claims(
        &self,
        cidrs: &BTreeSet<IpNet>,
        claims: Vec<Option<KeyValue>>,
    ) -> Result<LoadedBlocks, IpamError> {
        self.read_blocks_given_claims(cidrs, claims, false).await
    }

    /// [`load_blocks_given_claims`](Self::load_blocks_given_claims) for a reader that writes
    /// nothing on what it cannot read: a block that does not decode is named in
    /// [`LoadedBlocks::undecodable`] and left out of `found` instead of failing the read. Never for
    /// a writer: a block missing from `found` would look absent, free to create again.
    pub(crate) async fn load_blocks_given_claims_each(
        &self,
        cidrs: &BTreeSet<IpNet>,
        claims: Vec<Option<KeyValue>>,
    ) -> Result<LoadedBlocks, IpamError> {
        self.read_blocks_given_claims(cidrs, claims, true).await
    }

    async fn read_blocks_given_claims(
        &self,
        cidrs: &BTreeSet<IpNet>,
        mut claims: Vec<Option<KeyValue>>,
        past_undecodable: bool,
    ) -> Result<LoadedBlocks, IpamError> {
        /// Re-reads allowed when claims move under the read.
        const CONSISTENT_READ_ATTEMPTS: u32 = 10;
        let mut dangling = None;
        for attempt in 0..CONSISTENT_READ_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(self.retry.base_backoff * attempt).await;
            }
            // The floor, then per CIDR: its claim again and the keys its block may live at.
            let mut reads = vec![Read::Get(keys::sequence_floor())];
            let mut spans = Vec::with_capacity(cidrs.len());
            for (cidr, claim) in cidrs.iter().zip(&claims) {
                let first = reads.len();
                reads.push(Read::Get(keys::block_claim(cidr)));
                if let Some(kv) = claim {
                    let owner = decode_claim(&kv.key, &kv.value)?.affinity;
                    for key in keys::block_candidates(owner.as_deref(), cidr) {
                        reads.push(Read::Get(key));
                    }
                }
                spans.push(first..reads.len());
            }
            let mut results: Vec<Option<KeyValue>> = Vec::with_capacity(reads.len());
            for result in self.store.read_many(&reads).await? {
                results.push(result.into_got()?);
            }
            let mut loaded = LoadedBlocks {
                found: BTreeMap::new(),
                sequence_floor: decode_sequence_floor(results[0].take())?,
                undecodable: Vec::new(),
            };
            dangling = None;
            let mut consistent = true;
            for ((cidr, claim), span) in cidrs.iter().zip(claims.iter_mut()).zip(spans) {
                // Claim entries change on every write of their block (its free count); what
                // must not have changed is the owner, which decided the keys read.
                let again = results[span.start].take();
                let same = match (&*claim, &again) {
                    (None, None) => true,
                    (Some(a), Some(b)) => {
                        decode_claim(&a.key, &a.value)?.affinity
                            == decode_claim(&b.key, &b.value)?.affinity
                    }
                    _ => false,
                };
                *claim = again;
                if !same {
                    consistent = false;
                    continue;
                }
                let rest = results[span.start + 1..span.end]
                    .iter_mut()
                    .filter_map(Option::take);
                if claim.is_some() {
                    let mut found = None;
                    for kv in rest {
                        if past_undecodable {
                            let mut decoded =
                                decode_each(vec![kv], decode::<Block>, &mut loaded.undecodable);
                            found = Some(decoded.pop());
                        } else {
                            let stored: Stored<Block> = decode_stored(kv)?;
                            found = Some(Some(stored));
                        }
                    }
                    match found {
                        Some(Some(stored)) => {
                            loaded.found.insert(*cidr, stored);
                        }
                        Some(None) => {}
                        None => {
                            dangling = Some(keys::block_claim(cidr));
                            consistent = false;
                        }
                    }
                }
            }
            if consistent {
                return Ok(loaded);
            }
        }
        Err(match dangling {
            Some(key) => IpamError::Corrupt {
                key,
                message: "the claim index entry names a block that does not exist; run `blockipamctl check --repair`".into(),
            },
            None => IpamError::RetriesExhausted {
                attempts: CONSISTENT_READ_ATTEMPTS,
            },
        })
    }

    /// The whole claim index and the sequence floor, in one read.
    pub(crate) async fn claim_index(&self) -> Result<ClaimIndex, IpamError> {
        let results = self
            .store
            .read_many(&[
                Read::List(keys::claims_dir()),
                Read::Get(keys::sequence_floor()),
            ])
            .await?;
        let mut results = results.into_iter();
        let entries = next_listed(&mut results)?
            .into_iter()
            .map(IndexedClaim::decode)
            .collect::<Result<Vec<_>, _>>()?;
        let sequence_floor = decode_sequence_floor(next_got(&mut results)?)?;
        Ok(ClaimIndex {
            entries,
            sequence_floor,
        })
    }

    /// Every block in the store that can be decoded, the attributes it keeps apart loaded from
    /// the owner keys read in the same snapshot, and each block object that cannot be decoded or
    /// owner key that is missing or cannot be (its block then left out), sorted by key: one
    /// damaged object hides no other block.
    ///
    /// # Errors
    /// Store failures.
    pub(crate) async fn all_blocks_with_attributes_each(
        &self,
    ) -> Result<(Vec<Stored<Block>>, Vec<UndecodableObject>), IpamError> {
        let mut results = self
            .store
            .read_many(&[
                Read::List(keys::blocks_dir()),
                Read::List(keys::owners_dir()),
            ])
            .await?
            .into_iter();
        let listed = next_listed(&mut results)?;
        let owners = next_listed(&mut results)?;
        let mut undecodable = Vec::new();
        let mut blocks = decode_each(listed, decode::<Block>, &mut undecodable);
        let unknown = load_all_owners_each(
            blocks.iter_mut().map(|stored| &mut stored.value),
            owners,
            &mut undecodable,
        )?;
        blocks.retain(|stored| !unknown.contains(&stored.value.cidr));
        undecodable.sort_by(|a, b| a.key.cmp(&b.key));
        Ok((blocks, undecodable))
    }
}

/// Assignments are refused while an import into the store is unfinished (its marker, read in the
/// assignment's first batch, is present): the store may still lack blocks, handles or pools, and an
/// address handed out now could be one the import is about to write.
fn refuse_during_import(marker: Option<KeyValue>) -> Result<(), IpamError> {
    match marker {
        None => Ok(()),
        Some(kv) => Err(IpamError::Corrupt {
            key: kv.key,
            message: "an import into this store did not finish; no address is assigned until it \
                      does: run the same `blockipamctl import` again to resume it"
                .into(),
        }),
    }
}

/// The CIDR a key ends with (a block's, a claim's or an index entry's last segment).
///
/// # Errors
/// [`IpamError::Corrupt`] naming the key when its last segment is not a CIDR; `what` says what
/// kind of key it is.
pub(crate) fn cidr_of_key(key: &str, what: &str) -> Result<IpNet, IpamError> {
    key.rsplit('/')
        .next()
        .and_then(keys::parse_cidr_segment)
        .ok_or_else(|| IpamError::Corrupt {
            key: key.to_owned(),
            message: format!("{what} that names no CIDR"),
        })
}

pub(crate) fn next_listed(
    results: &mut impl Iterator<Item = crate::kv::ReadResult>,
) -> Result<Vec<KeyValue>, IpamError> {
    results
        .next()
        .ok_or_else(|| IpamError::Internal("read_many returned too few results".into()))?
        .into_listed()
        .map_err(IpamError::from)
}

pub(crate) fn next_got(
    results: &mut impl Iterator<Item = crate::kv::ReadResult>,
) -> Result<Option<KeyValue>, IpamError> {
    results
        .next()
        .ok_or_else(|| IpamError::Internal("read_many returned too few results".into()))?
        .into_got()
        .map_err(IpamError::from)
}

/// Refuses an allocation attribute (handle and metadata, with the node added) larger than
/// [`MAX_ATTRIBUTE_BYTES`] encoded: what keeps a full block inside one stored value.
fn validate_attribute_size(
    handle: &str,
    attributes: &BTreeMap<String, String>,
    host: &str,
) -> Result<(), IpamError> {
    let attribute = Attribute {
        handle: handle.to_owned(),
        metadata: with_node(attributes, host),
    };
    let size = encode(&attribute)?.len();
    if size > MAX_ATTRIBUTE_BYTES {
        return Err(IpamError::invalid(format!(
            "the allocation's handle and attributes take {size} bytes; at most {MAX_ATTRIBUTE_BYTES} are allowed"
        )));
    }
    Ok(())
}

/// Largest encoded block a block larger than the allowed sizes (made by an older build) may
/// grow to: two such blocks (a dual-stack request) still fit one transaction.
const LEGACY_BLOCK_BUDGET: usize = (MAX_TXN_BYTES - 64 * 1024) / 2;

/// False when one more allocation could push a block made with a block size this build no longer
/// allows past [`LEGACY_BLOCK_BUDGET`]; blocks of allowed sizes always have room by construction.
fn block_value_has_room(block: &Block) -> bool {
    if block.capacity() <= MAX_BLOCK_ADDRESSES {
        return true;
    }
    encode(block).is_ok_and(|bytes| bytes.len() + MAX_ATTRIBUTE_BYTES + 64 <= LEGACY_BLOCK_BUDGET)
}

fn with_node(attributes: &BTreeMap<String, String>, host: &str) -> BTreeMap<String, String> {
    let mut metadata = attributes.clone();
    metadata
        .entry(ATTR_NODE.to_owned())
        .or_insert_with(|| host.to_owned());
    metadata
}

/// Records in `block` the attributes of its listed owner keys (its `keys::block_owners_dir`,
/// read in the block's snapshot); keys of other blocks and keys naming no apart address are left
/// to `check`.
///
/// # Errors
/// [`IpamError::Corrupt`] naming an owner key that cannot be decoded, or the key of an address
/// the block holds apart that is not among them.
pub(crate) fn load_owners_into(block: &mut Block, owners: Vec<KeyValue>) -> Result<(), IpamError> {
    load_owner_values(block, owners)?;
    match block.unloaded_apart().first() {
        None => Ok(()),
        Some(ordinal) => Err(missing_owner_key(block, *ordinal)),
    }
}

/// Loads into `block` the attributes of the owner keys among `owners` that are its own.
///
/// # Errors
/// [`IpamError::Corrupt`] naming an owner key that cannot be decoded.
fn load_owner_values(block: &mut Block, owners: Vec<KeyValue>) -> Result<(), IpamError> {
    for kv in owners {
        if let Some((cidr, ordinal)) = keys::parse_owner_key(&kv.key) {
            if cidr == block.cidr {
                let attribute: Attribute = decode(&kv.key, &kv.value)?;
                block.load_apart(ordinal, attribute);
            }
        }
    }
    Ok(())
}

/// The error for the owner key of `ordinal`, which `block` holds apart, gone from the store.
fn missing_owner_key(block: &Block, ordinal: u32) -> IpamError {
    IpamError::Corrupt {
        key: keys::owner_key(&block.cidr, ordinal),
        message: format!(
            "missing: block {} holds {} apart from its value and this key, which names its \
             holder, is gone (`blockipamctl check` reports it)",
            block.cidr,
            block.ip_of(ordinal)
        ),
    }
}

/// [`load_owners_into`] for each of `blocks`, from a listing of owner keys of any blocks (read in
/// the blocks' snapshot), past an owner key that is missing or cannot be decoded: whose that
/// block's addresses are is then unknown, so its CIDR is returned and the key named in
/// `undecodable` (one damaged key hides no other block's allocations).
///
/// # Errors
/// Errors other than a corrupt owner key (none today; kept so that a new one is not taken for
/// damage).
pub(crate) fn load_all_owners_each<'a>(
    blocks: impl IntoIterator<Item = &'a mut Block>,
    owners: Vec<KeyValue>,
    undecodable: &mut Vec<UndecodableObject>,
) -> Result<BTreeSet<IpNet>, IpamError> {
    let mut by_block: BTreeMap<IpNet, Vec<KeyValue>> = BTreeMap::new();
    for kv in owners {
        if let Some((cidr, _)) = keys::parse_owner_key(&kv.key) {
            by_block.entry(cidr).or_default().push(kv);
        }
    }
    let mut unknown = BTreeSet::new();
    for block in blocks {
        let owners = by_block.remove(&block.cidr).unwrap_or_default();
        match load_owners_into(block, owners) {
            Ok(()) => {}
            Err(IpamError::Corrupt { key, message }) => {
                undecodable.push(UndecodableObject { key, message });
                unknown.insert(block.cidr);
            }
            Err(other) => return Err(other),
        }
    }
    Ok(unknown)
}

/// Records in `block` what `handle`'s record says `handle_id` holds apart in it, so that
/// [`Block::ordinals_of_handle`] answers for the handle without its owner keys.
pub(crate) fn learn_apart_from_handle(block: &mut Block, handle_id: &str, handle: &Handle) {
    let none = BTreeMap::new();
    block.learn_apart_of_handle(handle_id, handle.apart.get(&block.cidr).unwrap_or(&none));
}

/// Who holds `ip` in `block`: `None` when it is not allocated (or its attribute entry is missing).
///
/// # Errors
/// [`IpamError::AttributeNotLoaded`] for an attribute kept apart and not loaded.
fn allocation_info(block: &Block, ip: IpAddr) -> Result<Option<AllocationInfo>, IpamError> {
    let Some(ordinal) = block.ordinal_of(ip) else {
        return Ok(None);
    };
    let Some(allocation) = block.allocations.get(&ordinal) else {
        return Ok(None);
    };
    let Some(attribute) = block.attribute_of(ordinal)? else {
        return Ok(None);
    };
    Ok(Some(AllocationInfo {
        ip,
        block: block.cidr,
        block_host: block.affinity.clone(),
        handle: attribute.handle.clone(),
        attributes: attribute.metadata.clone(),
        sequence: allocation.sequence,
    }))
}

/// Every allocation of `block` whose attribute it records, in ordinal order.
///
/// # Errors
/// [`IpamError::AttributeNotLoaded`] for an attribute kept apart and not loaded.
fn allocations_of(block: &Block) -> Result<Vec<AllocationInfo>, IpamError> {
    let mut found = Vec::with_capacity(block.allocations.len());
    for ordinal in block.allocations.keys() {
        found.extend(allocation_info(block, block.ip_of(*ordinal))?);
    }
    Ok(found)
}

/// The allocations of `block` that `handle_id` holds, in ordinal order.
///
/// # Errors
/// [`IpamError::AttributeNotLoaded`] when an attribute kept apart that could be the handle's was
/// not loaded.
fn allocations_of_handle(block: &Block, handle_id: &str) -> Result<Vec<AllocationInfo>, IpamError> {
    let mut found = Vec::new();
    for ordinal in block.ordinals_of_handle(handle_id)? {
        found.extend(allocation_info(block, block.ip_of(ordinal))?);
    }
    Ok(found)
}

/// Sorts pools by family, then address, then prefix length: the order every listing gives.
pub(crate) fn sort_pools(pools: &mut [Stored<Pool>]) {
    pools.sort_by_key(|p| {
        (
            Family::of_net(&p.value.cidr),
            p.value.cidr.network(),
            p.value.cidr.prefix_len(),
        )
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_hash_is_stable_fnv1a() {
        assert_eq!(host_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(host_hash("a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(host_hash("node-1"), host_hash("node-2"));
    }

    /// A plan of `writes` puts and `conditions` conditions, on keys of their own.
    fn plan_of(writes: usize, conditions: usize) -> Plan {
        let mut plan = Plan::default();
        for n in 0..writes {
            plan.put(&format!("w/{n:04}"), Vec::new());
        }
        for n in 0..conditions {
            plan.expect(&format!("c/{n:04}"), None);
        }
        plan
    }

    /// The seal adds a condition on the store's format record, and on a store without one the
    /// record's write: a plan fits only with one write, one condition and the record's bytes
    /// left under each limit.
    #[test]
    fn a_plan_fits_one_transaction_with_room_left_for_the_format_record() {
        assert!(plan_of(MAX_TXN_OPS - 1, MAX_TXN_CONDITIONS - 1).fits_one_transaction());
        assert!(!plan_of(MAX_TXN_OPS, 0).fits_one_transaction());
        assert!(!plan_of(0, MAX_TXN_CONDITIONS).fits_one_transaction());
        let mut plan = Plan::default();
        plan.put("k", vec![0; MAX_TXN_BYTES - FORMAT_RECORD_ROOM - 1]);
        assert!(plan.fits_one_transaction(), "{}", plan.describe_size());
        plan.put("k", vec![0; MAX_TXN_BYTES - FORMAT_RECORD_ROOM]);
        assert!(!plan.fits_one_transaction(), "{}", plan.describe_size());
        // What the refusal (`IpamError::TooLarge`) says: each size beside its limit.
        let mut plan = plan_of(MAX_TXN_OPS, 3);
        plan.put("k", vec![0; 10]);
        assert_eq!(
            plan.describe_size(),
            format!(
                "{} writes (limit {MAX_TXN_OPS}), 3 conditions (limit {MAX_TXN_CONDITIONS}), {} bytes (limit {MAX_TXN_BYTES})",
                MAX_TXN_OPS + 1,
                MAX_TXN_OPS * 6 + 1 + 10 + 3 * 6
            )
        );
    }

    /// A plan deleting blocks raises the sequence floor past them, conditioned on the floor it
    /// read (its revision, or its absence); a floor already there is neither written nor tested,
    /// so the deletion cannot conflict with another writer's raise of it.
    #[test]
    fn the_sequence_floor_is_raised_only_when_deleted_blocks_pass_it() {
        let key = keys::sequence_floor();
        let floor_at = |floor: u64| KeyValue {
            key: key.clone(),
            value: encode(&floor).expect("encode"),
            revision: Revision(7),
        };
        let mut plan = Plan {
            retired_sequence: 9,
            ..Plan::default()
        };
        assert!(plan.deletes_blocks());
        plan.raise_sequence_floor(Some(floor_at(9))).expect("raise");
        assert!(plan.writes.is_empty(), "written: {:?}", plan.writes);
        assert!(plan.conditions.is_empty(), "tested: {:?}", plan.conditions);
        assert!(!plan.deletes_blocks());

        let mut plan = Plan {
            retired_sequence: 10,
            ..Plan::default()
        };
        plan.raise_sequence_floor(Some(floor_at(9))).expect("raise");
        assert_eq!(
            plan.writes.get(&key),
            Some(&Some(encode(&10u64).expect("encode")))
        );
        assert_eq!(
            plan.conditions.get(&key),
            Some(&Condition::at_revision(&key, Revision(7)))
        );

        let mut plan = Plan {
            retired_sequence: 1,
            ..Plan::default()
        };
        plan.raise_sequence_floor(None).expect("raise");
        assert_eq!(
            plan.writes.get(&key),
            Some(&Some(encode(&1u64).expect("encode")))
        );
        assert_eq!(plan.conditions.get(&key), Some(&Condition::absent(&key)));
    }

    /// A block a plan creates is conditioned on the sequence floor it is numbered from (its
    /// revision, or its absence), beside the absence of its keys; a raise of the floor in the same
    /// plan, from a later read, keeps that condition, so that a floor moved since the block was
    /// numbered makes the commit conflict.
    #[test]
    fn a_created_block_is_conditioned_on_the_floor_it_is_numbered_from() {
        let key = keys::sequence_floor();
        let cidr: IpNet = "10.0.0.0/26".parse().expect("cidr");
        for (revision, expected) in [
            (None, Condition::absent(&key)),
            (Some(Revision(7)), Condition::at_revision(&key, Revision(7))),
        ] {
            let floor = SequenceFloor { value: 5, revision };
            let working = WorkingBlock::created(cidr, Some("n".into()), floor, 0);
            assert_eq!(working.block.sequence, 5, "numbered from the floor");
            let mut plan = Plan::default();
            plan.write_block(&working).expect("write");
            assert_eq!(plan.conditions.get(&key), Some(&expected));
            assert_eq!(
                plan.conditions.get(&keys::block_claim(&cidr)),
                Some(&Condition::absent(keys::block_claim(&cidr)))
            );

            plan.retired_sequence = 20;
            plan.raise_sequence_floor(Some(KeyValue {
                key: key.clone(),
                value: encode(&10u64).expect("encode"),
                revision: Revision(9),
            }))
            .expect("raise");
            assert_eq!(
                plan.conditions.get(&key),
                Some(&expected),
                "the raise replaced the condition the created block is numbered under"
            );
            assert_eq!(
                plan.writes.get(&key),
                Some(&Some(encode(&20u64).expect("encode")))
            );
        }
    }

    /// The validators of a read from the store are carried only where they leave room for the
    /// format record's condition; those of a read from the cache always are (the commit must
    /// check them).
    #[test]
    fn validators_of_a_store_read_are_carried_only_with_room_for_the_format_record() {
        let validators = |n: usize| -> Vec<Condition> {
            (0..n)
                .map(|i| Condition::absent(format!("v/{i:04}")))
                .collect()
        };
        let own = MAX_TXN_CONDITIONS - 28;
        let mut plan = plan_of(1, own);
        plan.carry_validators(validators(27), false);
        assert_eq!(plan.conditions.len(), MAX_TXN_CONDITIONS - 1, "carried");
        let mut plan = plan_of(1, own);
        plan.carry_validators(validators(28), false);
        assert_eq!(plan.conditions.len(), own, "not carried: no room left");
        let mut plan = plan_of(1, own);
        plan.carry_validators(validators(28), true);
        assert_eq!(
            plan.conditions.len(),
            MAX_TXN_CONDITIONS,
            "from the cache: carried"
        );
    }

    /// Conflicts are retried after a backoff that starts at the base and doubles after each
    /// conflict up to the largest, each jittered to between half and one and a half of it; a
    /// conflict on the last attempt gives up. Timed on tokio's paused clock (virtual time).
    #[tokio::test(start_paused = true)]
    async fn conflicts_are_retried_after_a_doubling_jittered_backoff() {
        let ms = Duration::from_millis;
        let ipam = Ipam::new(Arc::new(crate::kv::memory::MemoryStore::new())).with_retry_policy(
            RetryPolicy {
                max_attempts: 7,
                base_backoff: ms(8),
                max_backoff: ms(40),
            },
        );
        let starts = std::sync::Mutex::new(Vec::new());
        let outcome: Result<(), IpamError> = ipam
            .retrying(|| {
                starts
                    .lock()
                    .expect("starts")
                    .push(tokio::time::Instant::now());
                async { Ok(Attempt::Conflict) }
            })
            .await;
        assert!(
            matches!(outcome, Err(IpamError::RetriesExhausted { attempts: 7 })),
            "{outcome:?}"
        );
        let starts = starts.into_inner().expect("starts");
        assert_eq!(starts.len(), 7, "one start per attempt");
        let gaps: Vec<Duration> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        // The timer rounds a sleep up to the next millisecond.
        for (gap, backoff) in gaps.iter().zip([8, 16, 32, 40, 40, 40].map(ms)) {
            assert!(
                *gap >= backoff / 2 && *gap <= backoff * 3 / 2 + ms(1),
                "{gap:?} after a backoff of {backoff:?}: {gaps:?}"
            );
        }
        // Done after a conflict: the value, at once.
        let attempts = std::sync::atomic::AtomicU32::new(0);
        let value = ipam
            .retrying(|| {
                let number = attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async move {
                    Ok(if number == 0 {
                        Attempt::Conflict
                    } else {
                        Attempt::Done(number)
                    })
                }
            })
            .await
            .expect("done on the second attempt");
        assert_eq!(value, 1);
    }

    /// An allocation whose attribute (handle, metadata and node) encodes to exactly the largest
    /// size allowed is taken; one byte more is refused, the error naming both sizes.
    #[test]
    fn an_attribute_of_the_largest_size_is_taken_and_one_byte_more_refused() {
        let padded = |padding: usize| {
            let metadata = BTreeMap::from([("pad".to_owned(), "a".repeat(padding))]);
            let attribute = Attribute {
                handle: "h".into(),
                metadata: with_node(&metadata, "n"),
            };
            (metadata, encode(&attribute).expect("encode").len())
        };
        let at_limit = (0..MAX_ATTRIBUTE_BYTES)
            .find(|padding| padded(*padding).1 == MAX_ATTRIBUTE_BYTES)
            .expect("a padding giving an attribute of exactly the limit");
        let (metadata, _) = padded(at_limit);
        validate_attribute_size("h", &metadata, "n").expect("an attribute at the limit");
        let (metadata, size) = padded(at_limit + 1);
        assert_eq!(size, MAX_ATTRIBUTE_BYTES + 1);
        let refused = validate_attribute_size("h", &metadata, "n")
            .expect_err("an attribute one byte over the limit");
        let message = refused.to_string();
        assert!(
            message.contains(&format!("take {size} bytes"))
                && message.contains(&format!("at most {MAX_ATTRIBUTE_BYTES}")),
            "{message}"
        );
    }

    /// What another writer does to the pools in [`PoolWrittenAfterTheListing`].
    enum AnotherPoolWrite {
        Create(PoolSpec),
        Delete(&'static str),
    }

    /// A store whose batched reads are the trait's default (one read after another, not one
    /// snapshot) and where another writer creates or deletes a pool right after the first
    /// listing of the pools has been answered.
    struct PoolWrittenAfterTheListing {
        inner: Arc<crate::kv::memory::MemoryStore>,
        writer: std::sync::Mutex<Option<(Ipam, AnotherPoolWrite)>>,
    }

    impl std::fmt::Debug for PoolWrittenAfterTheListing {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("PoolWrittenAfterTheListing")
                .finish_non_exhaustive()
        }
    }

    #[async_trait::async_trait]
    impl KvStore for PoolWrittenAfterTheListing {
        async fn get(&self, key: &str) -> Result<Option<KeyValue>, crate::kv::KvError> {
            self.inner.get(key).await
        }

        async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, crate::kv::KvError> {
            let listed = self.inner.list(prefix).await;
            if prefix == keys::pools_dir() {
                let writer = self.writer.lock().expect("writer lock").take();
                match writer {
                    Some((ipam, AnotherPoolWrite::Create(spec))) => {
                        ipam.create_pool(&spec)
                            .await
                            .expect("the other writer's pool");
                    }
                    Some((ipam, AnotherPoolWrite::Delete(name))) => {
                        ipam.delete_pool(name, false)
                            .await
                            .expect("the other writer's delete");
                    }
                    None => {}
                }
            }
            listed
        }

        async fn commit(&self, txn: Txn) -> Result<Revision, crate::kv::KvError> {
            self.inner.commit(txn).await
        }
    }

    /// On a store whose batch is not one snapshot, a pool created between the pool write's reads
    /// is still seen: the write is refused on the generation, read again, and the overlap found.
    #[tokio::test]
    async fn a_pool_created_between_a_pool_writes_reads_is_never_overlapped() {
        let inner = Arc::new(crate::kv::memory::MemoryStore::new());
        let other = Ipam::new(Arc::clone(&inner) as Arc<dyn KvStore>);
        other
            .create_pool(&PoolSpec {
                cidr: "10.1.0.0/16".parse().expect("cidr"),
                name: Some("first".into()),
                block_size: None,
                disabled: false,
            })
            .await
            .expect("a pool, so that the generation exists");
        let store = Arc::new(PoolWrittenAfterTheListing {
            inner: Arc::clone(&inner),
            writer: std::sync::Mutex::new(Some((
                other,
                AnotherPoolWrite::Create(PoolSpec {
                    cidr: "10.0.0.0/16".parse().expect("cidr"),
                    name: Some("theirs".into()),
                    block_size: None,
                    disabled: false,
                }),
            ))),
        });
        let ipam = Ipam::new(store as Arc<dyn KvStore>);
        let created = ipam
            .create_pool(&PoolSpec {
                cidr: "10.0.0.0/24".parse().expect("cidr"),
                name: Some("ours".into()),
                block_size: None,
                disabled: false,
            })
            .await;
        assert!(
            matches!(&created, Err(IpamError::PoolOverlap { .. })),
            "{created:?}"
        );
        let mut names: Vec<String> = Ipam::new(Arc::clone(&inner) as Arc<dyn KvStore>)
            .list_pools()
            .await
            .expect("list")
            .into_iter()
            .map(|pool| pool.name)
            .collect();
        names.sort();
        assert_eq!(names, vec!["first".to_owned(), "theirs".to_owned()]);
    }

    /// On a store whose batch is not one snapshot, a namespace's setting never lands naming a
    /// pool deleted between its reads: it is refused on the generation, read again, and the
    /// pool found missing.
    #[tokio::test]
    async fn a_namespace_setting_never_names_a_pool_deleted_between_its_reads() {
        let inner = Arc::new(crate::kv::memory::MemoryStore::new());
        let other = Ipam::new(Arc::clone(&inner) as Arc<dyn KvStore>);
        for (cidr, name) in [("10.1.0.0/16", "kept"), ("10.0.0.0/16", "gone")] {
            other
                .create_pool(&PoolSpec {
                    cidr: cidr.parse().expect("cidr"),
                    name: Some(name.into()),
                    block_size: None,
                    disabled: false,
                })
                .await
                .expect("pool");
        }
        let store = Arc::new(PoolWrittenAfterTheListing {
            inner: Arc::clone(&inner),
            writer: std::sync::Mutex::new(Some((other, AnotherPoolWrite::Delete("gone")))),
        });
        let ipam = Ipam::new(store as Arc<dyn KvStore>);
        let set = ipam
            .set_namespace_pools(
                "tenant",
                &crate::model::namespaces::NamespacePools {
                    ipv4_pools: vec!["gone".into()],
                    ipv6_pools: Vec::new(),
                },
            )
            .await;
        assert!(
            matches!(&set, Err(IpamError::PoolNotFound { .. })),
            "{set:?}"
        );
        let stored = Ipam::new(Arc::clone(&inner) as Arc<dyn KvStore>)
            .namespace_pools("tenant")
            .await
            .expect("read");
        assert_eq!(stored, None, "no setting naming the deleted pool");
    }

    /// A store whose claim index entry of one block names another host before every batched
    /// read: the block moving between hosts under each read.
    #[derive(Debug)]
    struct ClaimMovesOnEveryRead {
        inner: crate::kv::memory::MemoryStore,
        cidr: IpNet,
        reads: std::sync::atomic::AtomicU32,
    }

    #[async_trait::async_trait]
    impl KvStore for ClaimMovesOnEveryRead {
        async fn get(&self, key: &str) -> Result<Option<KeyValue>, crate::kv::KvError> {
            self.inner.get(key).await
        }

        async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, crate::kv::KvError> {
            self.inner.list(prefix).await
        }

        async fn commit(&self, txn: Txn) -> Result<Revision, crate::kv::KvError> {
            self.inner.commit(txn).await
        }

        async fn read_many(
            &self,
            reads: &[Read],
        ) -> Result<Vec<crate::kv::ReadResult>, crate::kv::KvError> {
            let number = self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let host = if number.is_multiple_of(2) {
                "node-a"
            } else {
                "node-b"
            };
            let block =
                WorkingBlock::created(self.cidr, Some(host.into()), SequenceFloor::default(), 0)
                    .block;
            self.inner
                .put(
                    &keys::block_claim(&self.cidr),
                    encode_claim(&block).expect("encode the claim"),
                )
                .await?;
            self.inner.read_many(reads).await
        }
    }

    /// A read of blocks whose claims keep moving is redone after pauses growing by the base
    /// backoff each time (1, 2, ... 9 times it between its ten reads), then given up. Timed on
    /// tokio's paused clock (virtual time).
    #[tokio::test(start_paused = true)]
    async fn a_block_read_whose_claims_keep_moving_is_redone_after_growing_pauses_then_given_up() {
        let base = Duration::from_millis(8);
        let cidr: IpNet = "10.0.0.0/26".parse().expect("cidr");
        let store = Arc::new(ClaimMovesOnEveryRead {
            inner: crate::kv::memory::MemoryStore::new(),
            cidr,
            reads: std::sync::atomic::AtomicU32::new(0),
        });
        let ipam =
            Ipam::new(Arc::clone(&store) as Arc<dyn KvStore>).with_retry_policy(RetryPolicy {
                max_attempts: 3,
                base_backoff: base,
                max_backoff: Duration::from_millis(40),
            });
        let started = tokio::time::Instant::now();
        let outcome = ipam.load_blocks_for_write(&BTreeSet::from([cidr])).await;
        let waited = started.elapsed();
        assert!(
            matches!(outcome, Err(IpamError::RetriesExhausted { attempts: 10 })),
            "{outcome:?}"
        );
        assert_eq!(
            store.reads.load(std::sync::atomic::Ordering::SeqCst),
            11,
            "the claims, then ten reads of claims and blocks"
        );
        // The timer rounds each sleep up to the next millisecond.
        assert!(
            waited >= base * 45 && waited <= base * 45 + Duration::from_millis(9),
            "waited {waited:?}"
        );
    }

    /// A block kept with its allocations' attributes (the oldest layout) whose value would pass
    /// the largest value a store takes is refused with a clear error and nothing planned; one of
    /// exactly that size is written.
    #[test]
    fn a_block_value_over_the_stores_limit_is_refused_and_one_at_it_written() {
        let sized = |padding: usize| {
            let mut working = WorkingBlock::created(
                "10.0.0.0/26".parse().expect("cidr"),
                Some("n".into()),
                SequenceFloor::default(),
                0,
            );
            let attribute = Attribute {
                handle: "h".into(),
                metadata: BTreeMap::from([("pad".to_owned(), "a".repeat(padding))]),
            };
            working.block.allocate_next(&attribute).expect("an address");
            let mut written = working.block.clone();
            written.sequence += 1;
            (working, encode(&written).expect("encode").len())
        };
        // The encoding's size grows with the padding, not always one byte for one: search.
        let (_, small) = sized(1000);
        let near = 1000 + MAX_VALUE_BYTES - small;
        let at_limit = (near - 64..near + 64)
            .find(|padding| sized(*padding).1 == MAX_VALUE_BYTES)
            .expect("a padding giving a value of exactly the limit");
        let (working, bytes) = sized(at_limit);
        assert_eq!(bytes, MAX_VALUE_BYTES);
        let mut plan = Plan::default();
        assert!(!plan.keeps_attributes_apart(), "the oldest layout");
        plan.write_block(&working)
            .expect("a block value at the limit");
        assert!(!plan.is_empty());
        let (working, bytes) = sized(at_limit + 1);
        assert_eq!(bytes, MAX_VALUE_BYTES + 1);
        let mut plan = Plan::default();
        let refused = plan
            .write_block(&working)
            .expect_err("a block value past the limit");
        assert!(
            matches!(&refused, IpamError::Internal(message) if message.contains("more than one stored value may")),
            "{refused}"
        );
        assert!(plan.is_empty(), "nothing planned");
    }

    /// A block of a size this build no longer allows (more than 512 addresses) has room for one
    /// more allocation only while its value leaves a largest attribute and some slack under the
    /// legacy budget; a block of an allowed size always has room.
    #[test]
    fn a_legacy_sized_block_has_room_only_under_its_budget() {
        let block_with = |cidr: &str, padding: usize| {
            let mut block = Block::claimed(cidr.parse().expect("cidr"), Some("n".into()), 0, 0);
            let attribute = Attribute {
                handle: "h".into(),
                metadata: BTreeMap::from([("pad".to_owned(), "a".repeat(padding))]),
            };
            block.allocate_next(&attribute).expect("an address");
            let bytes = encode(&block).expect("encode").len();
            (block, bytes)
        };
        let room = LEGACY_BLOCK_BUDGET - MAX_ATTRIBUTE_BYTES - 64;
        let (_, small) = block_with("10.0.0.0/22", 1000);
        let near = 1000 + room - small;
        let at_room = (near - 64..near + 64)
            .find(|padding| block_with("10.0.0.0/22", *padding).1 == room)
            .expect("a padding giving a value of exactly the room");
        let (block, bytes) = block_with("10.0.0.0/22", at_room);
        assert!(block.capacity() > MAX_BLOCK_ADDRESSES);
        assert_eq!(bytes, room);
        assert!(block_value_has_room(&block), "{bytes} bytes: room left");
        let (block, bytes) = block_with("10.0.0.0/22", at_room + 1);
        assert_eq!(bytes, room + 1);
        assert!(!block_value_has_room(&block), "{bytes} bytes: no room left");
        // Allowed sizes are bounded by construction: not measured.
        let (block, _) = block_with("10.0.0.0/23", at_room + 1);
        assert!(block_value_has_room(&block), "a /23 always has room");
    }
}
