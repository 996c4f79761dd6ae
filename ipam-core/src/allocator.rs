//! The block-affinity allocator: Calico's IPAM behaviour over the storage trait, with every block
//! change and its handle change committed in one transaction.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::error::IpamError;
use crate::kv::{
    Condition, KeyValue, KvError, KvStore, Op, Read, Revision, Txn, MAX_TXN_BYTES,
    MAX_TXN_CONDITIONS, MAX_TXN_OPS, MAX_VALUE_BYTES,
};
use crate::model::{
    decode, decode_claim, decode_pool, default_pool_name, encode, encode_claim, ip_to_u128, keys,
    validate_handle, validate_host, validate_pool_name, AllowedUse, AllowedUses, AssignmentMode,
    Attribute, Block, ClaimEntry, Family, Handle, IpamConfig, Pool, DEFAULT_V4_BLOCK_SIZE,
    DEFAULT_V6_BLOCK_SIZE, MAX_ATTRIBUTE_BYTES, MAX_BLOCK_ADDRESSES, V4_BLOCK_SIZES,
    V6_BLOCK_SIZES,
};
use crate::network_setup::{self, NetworkSetup};
use crate::selector::Selector;

/// Metadata key recording the host an allocation was made for.
pub const ATTR_NODE: &str = "node";
/// Most addresses one request may ask for, per family.
pub const MAX_ADDRESSES_PER_REQUEST: u32 = 32;
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
    /// ([`crate::network_setup`]): when something is missing, [`IpamError::SetupNeeded`] and
    /// nothing is written.
    pub setup: Option<NetworkSetup>,
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

impl AssignedAddress {
    /// The address with its block's prefix length (`10.0.0.5/26`).
    pub fn with_block_prefix(&self) -> IpNet {
        IpNet::new(self.ip, self.block.prefix_len()).unwrap_or_else(|_| IpNet::from(self.ip))
    }
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
    /// Free.
    pub free: u64,
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
    /// Free.
    pub free: u128,
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
}

/// A decoded object with where and when it was read.
#[derive(Debug, Clone)]
pub(crate) struct Stored<T> {
    pub key: String,
    pub revision: Revision,
    pub value: T,
}

pub(crate) fn decode_stored<T: serde::de::DeserializeOwned>(
    kv: KeyValue,
) -> Result<Stored<T>, IpamError> {
    Ok(Stored {
        value: decode(&kv.key, &kv.value)?,
        key: kv.key,
        revision: kv.revision,
    })
}

/// A block being changed by one attempt.
#[derive(Debug, Clone)]
pub(crate) struct WorkingBlock {
    /// Key and revision it was read at; `None` for a block this attempt creates.
    pub read: Option<(String, Revision)>,
    pub block: Block,
    pub dirty: bool,
}

impl WorkingBlock {
    pub(crate) fn from_stored(stored: Stored<Block>) -> Self {
        WorkingBlock {
            read: Some((stored.key, stored.revision)),
            block: stored.value,
            dirty: false,
        }
    }

    /// A block this attempt creates for `affinity`, its sequence numbers starting at the store's
    /// sequence floor (read in the same snapshot that showed the CIDR unclaimed).
    pub(crate) fn created(cidr: IpNet, affinity: Option<String>, sequence_floor: u64) -> Self {
        WorkingBlock {
            read: None,
            block: Block::new(cidr, affinity, sequence_floor),
            dirty: true,
        }
    }
}

/// The blocks found for a set of CIDRs, and the sequence floor read in the same snapshot.
#[derive(Debug, Default)]
pub(crate) struct LoadedBlocks {
    pub found: BTreeMap<IpNet, Stored<Block>>,
    pub sequence_floor: u64,
}

/// Decodes the sequence floor (0 when never written).
fn decode_sequence_floor(kv: Option<KeyValue>) -> Result<u64, IpamError> {
    kv.map_or(Ok(0), |kv| decode(&kv.key, &kv.value))
}

/// The whole claim index (one small entry per block: CIDR, owner, free count) and the sequence
/// floor, read in one snapshot: what the full new-block search and borrowing read instead of every
/// block's value.
#[derive(Debug)]
pub(crate) struct ClaimIndex {
    pub entries: Vec<IndexedClaim>,
    pub sequence_floor: u64,
}

/// One claim index entry, decoded, with the stored entry it came from.
#[derive(Debug)]
pub(crate) struct IndexedClaim {
    pub cidr: IpNet,
    pub claim: ClaimEntry,
    pub stored: KeyValue,
}

/// Blocks a new-block search reads ahead, per candidate pool, from the host's hashed start.
const NEW_BLOCK_PROBES: u128 = 16;

/// What the first read of a new-block search found.
#[derive(Debug)]
struct NewBlockProbe {
    /// The host's full blocks (all families), when the per-host limit needs them.
    host_full: Vec<IpNet>,
    /// Unclaimed blocks among the probed ones, in search order.
    unclaimed: Vec<IpNet>,
    /// The sequence floor, read in the same snapshot.
    sequence_floor: u64,
}

/// Accumulates the conditions and writes of one transaction, one entry per key.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    conditions: BTreeMap<String, Condition>,
    writes: BTreeMap<String, Option<Vec<u8>>>,
    /// Past the last sequence number of every block this plan deletes: the sequence floor must
    /// reach it in the same transaction (see [`Ipam::commit_plan`]).
    retired_sequence: u64,
}

impl Plan {
    pub fn expect(&mut self, key: &str, revision: Option<Revision>) {
        self.conditions
            .entry(key.to_owned())
            .or_insert_with(|| match revision {
                Some(r) => Condition::at_revision(key, r),
                None => Condition::absent(key),
            });
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

    fn bytes(&self) -> usize {
        self.writes
            .iter()
            .map(|(key, value)| key.len() + value.as_ref().map_or(0, Vec::len))
            .chain(self.conditions.keys().map(String::len))
            .sum()
    }

    /// True when the transaction fits every store's limits (operations, conditions, bytes).
    pub fn fits_one_transaction(&self) -> bool {
        self.writes.len() <= MAX_TXN_OPS
            && self.conditions.len() <= MAX_TXN_CONDITIONS
            && self.bytes() <= MAX_TXN_BYTES
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
        self.retired_sequence = self.retired_sequence.max(block.sequence.saturating_add(1));
    }

    /// True when this plan deletes a block (its commit must raise the sequence floor).
    pub fn deletes_blocks(&self) -> bool {
        self.retired_sequence > 0
    }

    /// Adds, when this plan deletes blocks, the write that raises the sequence floor (currently
    /// `floor`, read at `revision`) past them, conditioned on that revision so that concurrent
    /// raises never lower it.
    pub fn raise_sequence_floor(&mut self, floor: Option<KeyValue>) -> Result<(), IpamError> {
        let revision = floor.as_ref().map(|kv| kv.revision);
        let current = decode_sequence_floor(floor)?;
        if self.retired_sequence > current {
            let key = keys::sequence_floor();
            self.conditions.insert(
                key.clone(),
                match revision {
                    Some(r) => Condition::at_revision(&key, r),
                    None => Condition::absent(&key),
                },
            );
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
        let key = keys::block_key_of(block);
        match &working.read {
            None => {
                self.expect(&key, None);
                self.expect(&keys::block_claim(&block.cidr), None);
            }
            Some((read_key, revision)) => {
                self.expect(read_key, Some(*revision));
                if *read_key != key {
                    // The block moved (affinity changed, or it filled up or got room again).
                    self.expect(&key, None);
                    self.delete(read_key);
                }
            }
        }
        if block.is_empty() && block.affinity.is_none() {
            // Calico's rule: an empty block with no affinity is deleted.
            self.delete_block(&key, block);
        } else {
            let mut block = block.clone();
            block.sequence += 1;
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

/// The allocator: every IPAM operation, over any [`KvStore`].
#[derive(Debug, Clone)]
pub struct Ipam {
    store: Arc<dyn KvStore>,
    retry: RetryPolicy,
    /// Conditions added to every transaction this allocator commits (see [`Ipam::guarded_by`]).
    guard: Arc<[Condition]>,
}

impl Ipam {
    /// An allocator over `store` with the default retry policy.
    pub fn new(store: Arc<dyn KvStore>) -> Self {
        Ipam {
            store,
            retry: RetryPolicy::default(),
            guard: Arc::from(Vec::new()),
        }
    }

    /// The same allocator, with `guard` added to every transaction it commits: once any of these
    /// conditions stops holding, each write fails with [`IpamError::GuardLost`] and nothing more
    /// is written. What a reclaimer uses to stop the moment a node it thought dead comes back.
    pub fn guarded_by(mut self, guard: Vec<Condition>) -> Self {
        self.guard = Arc::from(guard);
        self
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

    /// Commits a plan; a failed condition becomes [`Attempt::Conflict`].
    pub(crate) async fn commit_plan<T>(
        &self,
        mut plan: Plan,
        value: T,
    ) -> Result<Attempt<T>, IpamError> {
        if plan.is_empty() {
            return Ok(Attempt::Done(value));
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
        if !plan.fits_one_transaction() {
            return Err(IpamError::TooLarge(plan.describe_size()));
        }
        crate::fault::point(crate::fault::FaultPoint::BeforeCommit);
        match self.store.commit(plan.into_txn()).await {
            Ok(_) => {
                crate::fault::point(crate::fault::FaultPoint::AfterCommit);
                Ok(Attempt::Done(value))
            }
            Err(KvError::Conflict { key }) if self.guard.iter().any(|c| c.key() == key) => {
                Err(IpamError::GuardLost { key })
            }
            Err(KvError::Conflict { .. }) => Ok(Attempt::Conflict),
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
        pools.sort_by_key(|p| {
            (
                Family::of_net(&p.value.cidr),
                p.value.cidr.network(),
                p.value.cidr.prefix_len(),
            )
        });
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
        mut claims: Vec<Option<KeyValue>>,
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
                        let stored: Stored<Block> = decode_stored(kv)?;
                        found = Some(stored);
                    }
                    match found {
                        Some(stored) => {
                            loaded.found.insert(*cidr, stored);
                        }
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
        let prefix = keys::claims_dir();
        let mut entries = Vec::new();
        for kv in next_listed(&mut results)? {
            let cidr = kv
                .key
                .strip_prefix(&prefix)
                .and_then(keys::parse_cidr_segment)
                .ok_or_else(|| IpamError::Corrupt {
                    key: kv.key.clone(),
                    message: "a claim index key that names no CIDR".into(),
                })?;
            entries.push(IndexedClaim {
                cidr,
                claim: decode_claim(&kv.key, &kv.value)?,
                stored: kv,
            });
        }
        let sequence_floor = decode_sequence_floor(next_got(&mut results)?)?;
        Ok(ClaimIndex {
            entries,
            sequence_floor,
        })
    }

    /// Every block in the store.
    pub(crate) async fn all_blocks(&self) -> Result<Vec<Stored<Block>>, IpamError> {
        self.store
            .list(&keys::blocks_dir())
            .await?
            .into_iter()
            .map(decode_stored)
            .collect()
    }

    // -----------------------------------------------------------------------------------------
    // Pools
    // -----------------------------------------------------------------------------------------

    /// Every pool, sorted by family then address.
    ///
    /// # Errors
    /// Store failures; corrupt pool objects.
    pub async fn list_pools(&self) -> Result<Vec<Pool>, IpamError> {
        let kvs = self.store.list(&keys::pools_dir()).await?;
        Ok(Self::decode_pools(kvs)?
            .into_iter()
            .map(|p| p.value)
            .collect())
    }

    /// Finds a pool by name, or by CIDR.
    ///
    /// # Errors
    /// [`IpamError::PoolNotFound`] when none matches.
    pub async fn get_pool(&self, name_or_cidr: &str) -> Result<Pool, IpamError> {
        let pools = Self::decode_pools(self.store.list(&keys::pools_dir()).await?)?;
        find_pool(&pools, name_or_cidr).map(|p| p.value.clone())
    }

    /// Validates a spec into the pool it would create.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for host bits in the CIDR, a block size out of range or
    /// larger than the pool, or a bad name.
    pub fn pool_from_spec(spec: &PoolSpec) -> Result<Pool, IpamError> {
        let cidr = spec.cidr;
        if cidr.trunc() != cidr {
            return Err(IpamError::invalid(format!(
                "{cidr} is not a network address (did you mean {}?)",
                cidr.trunc()
            )));
        }
        let family = Family::of_net(&cidr);
        let (default, range) = match family {
            Family::V4 => (DEFAULT_V4_BLOCK_SIZE, V4_BLOCK_SIZES),
            Family::V6 => (DEFAULT_V6_BLOCK_SIZE, V6_BLOCK_SIZES),
        };
        let block_size = spec.block_size.unwrap_or(default);
        if !range.contains(&block_size) {
            return Err(IpamError::invalid(format!(
                "block size /{block_size} is out of range for {family} (allowed /{} to /{})",
                range.start(),
                range.end()
            )));
        }
        if block_size < cidr.prefix_len() {
            return Err(IpamError::invalid(format!(
                "pool {cidr} is smaller than one /{block_size} block"
            )));
        }
        let name = spec
            .name
            .clone()
            .unwrap_or_else(|| default_pool_name(&cidr));
        validate_pool_name(&name)?;
        Ok(Pool {
            name,
            cidr,
            block_size,
            disabled: spec.disabled,
            node_selector: Selector::all(),
            assignment_mode: AssignmentMode::Automatic,
            allowed_uses: AllowedUses::default(),
        })
    }

    /// Creates a pool with a node selector, assignment mode and allowed uses (what `spec` alone
    /// leaves at Calico's defaults: `all()`, automatic, workload and tunnel).
    ///
    /// # Errors
    /// As [`create_pool`](Ipam::create_pool).
    pub async fn create_pool_with_policy(
        &self,
        spec: &PoolSpec,
        policy: &PoolPolicy,
    ) -> Result<Pool, IpamError> {
        let mut pool = Self::pool_from_spec(spec)?;
        policy.apply_to(&mut pool);
        self.retrying(|| self.try_create_pool(&pool, false)).await
    }

    /// Changes a pool's node selector, assignment mode, allowed uses and disabled flag (each only
    /// when given): one compare-and-swap on the pool, serialised with every other pool write. Its
    /// CIDR and block size never change here.
    ///
    /// # Errors
    /// [`IpamError::PoolNotFound`]; store failures.
    pub async fn set_pool(
        &self,
        name_or_cidr: &str,
        change: &PoolChange,
    ) -> Result<Pool, IpamError> {
        self.retrying(|| async {
            let (pools, generation) = self.read_pools_and_generation().await?;
            let found = find_pool(&pools, name_or_cidr)?;
            let mut pool = found.value.clone();
            change.apply_to(&mut pool);
            if pool == found.value {
                return Ok(Attempt::Done(pool));
            }
            let mut plan = Plan::default();
            self.bump_pool_generation(&mut plan, generation)?;
            plan.expect(&found.key, Some(found.revision));
            plan.put(&found.key, encode(&pool)?);
            self.commit_plan(plan, pool).await
        })
        .await
    }

    /// Creates a pool.
    ///
    /// # Errors
    /// Validation errors as [`pool_from_spec`](Ipam::pool_from_spec); [`IpamError::PoolExists`];
    /// [`IpamError::PoolOverlap`]; store failures.
    pub async fn create_pool(&self, spec: &PoolSpec) -> Result<Pool, IpamError> {
        let pool = Self::pool_from_spec(spec)?;
        self.retrying(|| self.try_create_pool(&pool, false)).await
    }

    /// Creates a pool unless an identical one (same CIDR and block size) exists under any name;
    /// safe when many processes race to do it.
    ///
    /// # Errors
    /// As [`create_pool`](Ipam::create_pool) when a different pool is in the way.
    pub async fn ensure_pool(&self, spec: &PoolSpec) -> Result<Pool, IpamError> {
        let pool = Self::pool_from_spec(spec)?;
        self.retrying(|| self.try_create_pool(&pool, true)).await
    }

    async fn try_create_pool(
        &self,
        pool: &Pool,
        accept_identical: bool,
    ) -> Result<Attempt<Pool>, IpamError> {
        let (pools, generation) = self.read_pools_and_generation().await?;
        for existing in &pools {
            let same =
                existing.value.cidr == pool.cidr && existing.value.block_size == pool.block_size;
            if accept_identical && same {
                return Ok(Attempt::Done(existing.value.clone()));
            }
            if existing.value.name == pool.name {
                return Err(IpamError::PoolExists(pool.name.clone()));
            }
            if existing.value.cidr.contains(&pool.cidr.network())
                || pool.cidr.contains(&existing.value.cidr.network())
            {
                return Err(IpamError::PoolOverlap {
                    cidr: pool.cidr,
                    existing: existing.value.name.clone(),
                    existing_cidr: existing.value.cidr,
                });
            }
        }
        let mut plan = Plan::default();
        self.bump_pool_generation(&mut plan, generation)?;
        let key = keys::pool(&pool.name);
        plan.expect(&key, None);
        plan.put(&key, encode(pool)?);
        self.commit_plan(plan, pool.clone()).await
    }

    /// Every pool and the pool-generation counter, in one batched read: what a pool write checks
    /// and conditions on.
    async fn read_pools_and_generation(
        &self,
    ) -> Result<(Vec<Stored<Pool>>, Option<KeyValue>), IpamError> {
        let results = self
            .store
            .read_many(&[
                Read::List(keys::pools_dir()),
                Read::Get(keys::pool_generation()),
            ])
            .await?;
        let mut results = results.into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let generation = next_got(&mut results)?;
        Ok((pools, generation))
    }

    fn bump_pool_generation(
        &self,
        plan: &mut Plan,
        generation: Option<KeyValue>,
    ) -> Result<(), IpamError> {
        let key = keys::pool_generation();
        let (count, revision) = match generation {
            None => (0u64, None),
            Some(kv) => {
                let stored: Stored<u64> = decode_stored(kv)?;
                (stored.value, Some(stored.revision))
            }
        };
        plan.expect(&key, revision);
        plan.put(&key, encode(&(count + 1))?);
        Ok(())
    }

    /// Enables or disables a pool. A disabled pool is never allocated from; its addresses stay.
    ///
    /// # Errors
    /// [`IpamError::PoolNotFound`]; store failures.
    pub async fn set_pool_disabled(
        &self,
        name_or_cidr: &str,
        disabled: bool,
    ) -> Result<Pool, IpamError> {
        self.set_pool_disabled_where(disabled, |pools| find_pool(pools, name_or_cidr))
            .await
    }

    /// Enables or disables this very pool (same name, CIDR and block size), not one created
    /// since under its name.
    async fn set_exact_pool_disabled(
        &self,
        pool: &Pool,
        disabled: bool,
    ) -> Result<Pool, IpamError> {
        self.set_pool_disabled_where(disabled, |pools| find_exact_pool(pools, pool))
            .await
    }

    async fn set_pool_disabled_where<F>(&self, disabled: bool, find: F) -> Result<Pool, IpamError>
    where
        F: Fn(&[Stored<Pool>]) -> Result<&Stored<Pool>, IpamError>,
    {
        self.retrying(|| async {
            let (pools, generation) = self.read_pools_and_generation().await?;
            let found = find(&pools)?;
            let mut pool = found.value.clone();
            pool.disabled = disabled;
            let mut plan = Plan::default();
            self.bump_pool_generation(&mut plan, generation)?;
            plan.expect(&found.key, Some(found.revision));
            plan.put(&found.key, encode(&pool)?);
            self.commit_plan(plan, pool).await
        })
        .await
    }

    /// Deletes a pool and its blocks. Refuses while any address in it is allocated, unless
    /// `force`, which releases those addresses first (updating their handles).
    ///
    /// The pool is disabled first: every assignment commits on the revision of the pool it uses,
    /// so from then on nothing new lands in it, and the count of addresses in use that decides
    /// a refusal cannot miss an ADD racing the delete. A refused delete re-enables a pool it
    /// disabled. Each block is deleted by a transaction that checks, on the block's revision, that
    /// it is empty.
    ///
    /// # Errors
    /// [`IpamError::PoolNotFound`]; [`IpamError::PoolInUse`]; store failures.
    pub async fn delete_pool(
        &self,
        name_or_cidr: &str,
        force: bool,
    ) -> Result<PoolDeletion, IpamError> {
        let pool = self.get_pool(name_or_cidr).await?;
        if !force {
            // The common refusal writes nothing.
            let in_use = self.pool_blocks(&pool).await?.1;
            if in_use > 0 {
                return Err(IpamError::PoolInUse {
                    pool: pool.name.clone(),
                    in_use,
                });
            }
        }
        let mut released_addresses = 0u64;
        let mut deleted_blocks = 0u64;
        // Rounds repeat only when another client re-enabled the pool (and maybe allocated in it)
        // while it was being emptied.
        for _ in 0..self.retry.max_attempts {
            // This very pool: another client may have deleted it and created another under its
            // name, which this delete must not touch.
            let pools = Self::decode_pools(self.store.list(&keys::pools_dir()).await?)?;
            match find_exact_pool(&pools, &pool) {
                Err(_) => {
                    return Ok(PoolDeletion {
                        pool,
                        released_addresses,
                        deleted_blocks,
                    })
                }
                Ok(current) if !current.value.disabled => {
                    match self.set_exact_pool_disabled(&pool, true).await {
                        Err(IpamError::PoolNotFound(_)) => continue,
                        other => other?,
                    };
                }
                Ok(_) => {}
            }
            // Counted after the disable: an ADD that raced the first count is seen here.
            let (blocks, in_use) = self.pool_blocks(&pool).await?;
            if in_use > 0 && !force {
                return Err(self.refuse_pool_delete(&pool, in_use).await);
            }
            for block in blocks {
                let held: Vec<ReleaseRequest> = block
                    .allocations
                    .keys()
                    .map(|o| ReleaseRequest {
                        ip: block.ip_of(*o),
                        sequence: None,
                    })
                    .collect();
                if !held.is_empty() {
                    released_addresses += self.release_ips(&held).await?.released.len() as u64;
                }
                let cidr = block.cidr;
                match self.retrying(|| self.try_delete_empty_block(cidr)).await {
                    Ok(deleted) => deleted_blocks += u64::from(deleted),
                    Err(IpamError::PoolInUse { in_use, .. }) if !force => {
                        return Err(self.refuse_pool_delete(&pool, in_use).await)
                    }
                    Err(IpamError::PoolInUse { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            if self
                .retrying(|| self.try_delete_emptied_pool(&pool))
                .await?
            {
                return Ok(PoolDeletion {
                    pool,
                    released_addresses,
                    deleted_blocks,
                });
            }
        }
        Err(IpamError::RetriesExhausted {
            attempts: self.retry.max_attempts,
        })
    }

    /// The blocks that lie in `pool`, and how many addresses they hold.
    async fn pool_blocks(&self, pool: &Pool) -> Result<(Vec<Block>, u64), IpamError> {
        let blocks: Vec<Block> = self
            .all_blocks()
            .await?
            .into_iter()
            .map(|b| b.value)
            .filter(|b| pool.cidr.contains(&b.cidr.network()))
            .collect();
        let in_use = blocks.iter().map(|b| u64::from(b.in_use())).sum();
        Ok((blocks, in_use))
    }

    /// Deletes the pool if, in one snapshot, it is still disabled and no block lies in it; the
    /// delete is conditioned on the pool's revision, which every assignment in it is conditioned
    /// on too. False when it was enabled again or holds a block again (go round once more).
    async fn try_delete_emptied_pool(&self, pool: &Pool) -> Result<Attempt<bool>, IpamError> {
        let results = self
            .store
            .read_many(&[
                Read::List(keys::pools_dir()),
                Read::Get(keys::pool_generation()),
                Read::List(keys::blocks_dir()),
            ])
            .await?;
        let mut results = results.into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let generation = next_got(&mut results)?;
        let Ok(found) = find_exact_pool(&pools, pool) else {
            return Ok(Attempt::Done(true));
        };
        let mut occupied = false;
        for kv in next_listed(&mut results)? {
            let block: Stored<Block> = decode_stored(kv)?;
            occupied |= pool.cidr.contains(&block.value.cidr.network());
        }
        if occupied || !found.value.disabled {
            return Ok(Attempt::Done(false));
        }
        let mut plan = Plan::default();
        self.bump_pool_generation(&mut plan, generation)?;
        plan.expect(&found.key, Some(found.revision));
        plan.delete(&found.key);
        self.commit_plan(plan, true).await
    }

    /// The error of a refused pool delete, after re-enabling the pool when the delete disabled it.
    async fn refuse_pool_delete(&self, pool: &Pool, in_use: u64) -> IpamError {
        if !pool.disabled {
            if let Err(e) = self.set_exact_pool_disabled(pool, false).await {
                tracing::warn!(pool = %pool.name, error = %e, "could not re-enable the pool after a refused delete");
            }
        }
        IpamError::PoolInUse {
            pool: pool.name.clone(),
            in_use,
        }
    }

    /// Deletes one block if it exists and is empty, checked in the deleting transaction.
    async fn try_delete_empty_block(&self, cidr: IpNet) -> Result<Attempt<bool>, IpamError> {
        let blocks = self.load_blocks(&BTreeSet::from([cidr])).await?;
        let Some(stored) = blocks.into_values().next() else {
            return Ok(Attempt::Done(false));
        };
        if !stored.value.is_empty() {
            return Err(IpamError::PoolInUse {
                pool: cidr.to_string(),
                in_use: u64::from(stored.value.in_use()),
            });
        }
        let mut plan = Plan::default();
        plan.expect(&stored.key, Some(stored.revision));
        plan.delete_block(&stored.key, &stored.value);
        self.commit_plan(plan, true).await
    }

    // -----------------------------------------------------------------------------------------
    // Config
    // -----------------------------------------------------------------------------------------

    /// The IPAM configuration (defaults when never set).
    ///
    /// # Errors
    /// Store failures; a corrupt config object.
    pub async fn get_config(&self) -> Result<IpamConfig, IpamError> {
        Ok(Self::decode_config(self.store.get(&keys::config()).await?)?.0)
    }

    /// Replaces the IPAM configuration.
    ///
    /// # Errors
    /// Store failures.
    pub async fn set_config(&self, config: &IpamConfig) -> Result<(), IpamError> {
        self.store.put(&keys::config(), encode(config)?).await?;
        Ok(())
    }

    /// Changes the configuration with `change` applied to the current one, compare-and-swap: a
    /// concurrent change is re-read and `change` applied again, so no update is lost. Returns the
    /// configuration written.
    ///
    /// # Errors
    /// Store failures; [`IpamError::RetriesExhausted`].
    pub async fn update_config<F>(&self, change: F) -> Result<IpamConfig, IpamError>
    where
        F: Fn(&mut IpamConfig),
    {
        self.retrying(|| async {
            let (mut config, revision) =
                Self::decode_config(self.store.get(&keys::config()).await?)?;
            change(&mut config);
            let mut plan = Plan::default();
            plan.expect(&keys::config(), revision);
            plan.put(&keys::config(), encode(&config)?);
            self.commit_plan(plan, config).await
        })
        .await
    }

    // -----------------------------------------------------------------------------------------
    // Auto-assign
    // -----------------------------------------------------------------------------------------

    /// Hands out `num_v4` IPv4 and `num_v6` IPv6 addresses to a handle on a host, Calico's way:
    /// the host's affine blocks first, then a newly claimed block (search starting at a hash of
    /// the host name), then — unless strict affinity is on — a free address borrowed from any
    /// block. Both families commit in one transaction together with the handle: either every
    /// address is handed out or none is.
    ///
    /// Steady state (an affine block has room): one batched read and one transaction.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`]; pool errors for requested pools; [`IpamError::BlockLimit`];
    /// [`IpamError::Exhausted`]; [`IpamError::RetriesExhausted`]; store failures.
    pub async fn auto_assign(
        &self,
        request: &AutoAssignRequest,
    ) -> Result<AutoAssignResult, IpamError> {
        validate_handle(&request.handle)?;
        validate_host(&request.host)?;
        validate_attribute_size(&request.handle, &request.attributes, &request.host)?;
        for (family, n) in [(Family::V4, request.num_v4), (Family::V6, request.num_v6)] {
            if n > MAX_ADDRESSES_PER_REQUEST {
                return Err(IpamError::invalid(format!(
                    "{n} {family} addresses asked for; at most {MAX_ADDRESSES_PER_REQUEST} per request"
                )));
            }
        }
        self.retrying(|| self.try_auto_assign(request)).await
    }

    async fn try_auto_assign(
        &self,
        request: &AutoAssignRequest,
    ) -> Result<Attempt<AutoAssignResult>, IpamError> {
        let handle_key = keys::handle(&request.handle);
        let mut reads = vec![
            Read::List(keys::pools_dir()),
            Read::Get(keys::config()),
            Read::List(keys::host_open_blocks_dir(&request.host)),
            Read::Get(handle_key.clone()),
            Read::Get(keys::import_in_progress()),
            Read::Get(crate::nodes::node_key(&request.host)),
        ];
        if let Some(lookup) = &request.namespace {
            reads.push(Read::Get(crate::namespaces::namespace_key(
                &lookup.namespace,
            )));
        }
        if let Some(setup) = &request.setup {
            reads.push(Read::Get(keys::handle(&setup.reservation_handle)));
            reads.push(Read::Get(keys::reservations_held(
                &setup.reservation_handle,
            )));
        }
        let results = self.store.read_many(&reads).await?;
        let mut results = results.into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let (config, config_revision) = Self::decode_config(next_got(&mut results)?)?;
        let host_blocks: Vec<Stored<Block>> = next_listed(&mut results)?
            .into_iter()
            .map(decode_stored)
            .collect::<Result<_, _>>()?;
        let (mut handle, handle_revision) = Self::decode_handle(next_got(&mut results)?)?;
        refuse_during_import(next_got(&mut results)?)?;
        let node_key = crate::nodes::node_key(&request.host);
        let node_labels =
            crate::nodes::decode_node_labels(&node_key, next_got(&mut results)?.as_ref())?;
        // The pools each family draws from: the request's, unless the namespace's setting
        // replaces them.
        let mut v4_pools = request.v4_pools.clone();
        let mut v6_pools = request.v6_pools.clone();
        if let Some(lookup) = &request.namespace {
            let key = crate::namespaces::namespace_key(&lookup.namespace);
            if let Some(set) =
                crate::namespaces::decode_namespace_pools(&key, next_got(&mut results)?.as_ref())?
            {
                if lookup.v4 && !set.ipv4_pools.is_empty() {
                    v4_pools = set.ipv4_pools;
                }
                if lookup.v6 && !set.ipv6_pools.is_empty() {
                    v6_pools = set.ipv6_pools;
                }
            }
        }
        let listed_pools: Vec<Pool> = pools.iter().map(|p| p.value.clone()).collect();
        let mut skip_block_edges = request.skip_block_edges;
        if let Some(setup) = &request.setup {
            let (_, reservation_revision) = Self::decode_handle(next_got(&mut results)?)?;
            let confirmation = next_got(&mut results)?;
            if !network_setup::setup_in_place(
                setup,
                &pools,
                reservation_revision,
                confirmation.as_ref(),
            )? {
                return Err(IpamError::SetupNeeded(
                    "a pool or a reservation of the network is missing".into(),
                ));
            }
            skip_block_edges = network_setup::block_prefix_reportable(
                &listed_pools,
                &[
                    (Family::V4, request.num_v4 > 0, v4_pools.as_slice()),
                    (Family::V6, request.num_v6 > 0, v6_pools.as_slice()),
                ],
                &setup.gateways,
            );
        }

        if request.reuse_existing && handle.total() > 0 {
            let held = self
                .addresses_in_blocks(&request.handle, &handle, &host_blocks)
                .await?;
            return Ok(Attempt::Done(AutoAssignResult {
                v4: held.iter().filter(|a| a.ip.is_ipv4()).cloned().collect(),
                v6: held.iter().filter(|a| a.ip.is_ipv6()).cloned().collect(),
                reused: true,
                pools: listed_pools,
            }));
        }

        let attribute = Attribute {
            handle: request.handle.clone(),
            metadata: with_node(&request.attributes, &request.host),
        };
        let mut working: BTreeMap<IpNet, WorkingBlock> = BTreeMap::new();
        for stored in host_blocks {
            working.insert(stored.value.cidr, WorkingBlock::from_stored(stored));
        }
        let mut claim_index: Option<ClaimIndex> = None;
        let mut plan = Plan::default();
        let mut result = AutoAssignResult {
            pools: listed_pools,
            ..AutoAssignResult::default()
        };
        let mut used_pools: BTreeSet<String> = BTreeSet::new();
        let mut config_used = false;

        for (family, wanted, requested_pools) in [
            (Family::V4, request.num_v4, &v4_pools),
            (Family::V6, request.num_v6, &v6_pools),
        ] {
            if wanted == 0 {
                continue;
            }
            let candidates = candidate_pools(
                &pools,
                family,
                requested_pools,
                &request.host,
                &node_labels,
                request.purpose,
            )?;
            let in_candidates = |cidr: &IpNet| {
                candidates
                    .iter()
                    .any(|p| p.value.cidr.contains(&cidr.network()))
            };
            let mut got: Vec<AssignedAddress> = Vec::new();

            // 1. The host's affine blocks, in address order.
            let affine: Vec<IpNet> = working
                .values()
                .filter(|w| w.block.affinity.as_deref() == Some(request.host.as_str()))
                .map(|w| w.block.cidr)
                .filter(|c| Family::of_net(c) == family && in_candidates(c))
                .collect();
            take_from_blocks(
                &mut working,
                &affine,
                &attribute,
                wanted,
                skip_block_edges,
                &mut got,
            );

            // 2. New blocks for this host.
            let mut limit_hit: Option<u32> = None;
            if (got.len() as u32) < wanted && config.auto_allocate_blocks {
                config_used = true;
                // The steady-state read holds only the host's blocks with room; the per-host
                // limit counts its full ones too, read in the same batch as the probe.
                let limited = config.max_blocks_per_host != 0;
                let probe = self
                    .probe_new_blocks(&candidates, &request.host, limited)
                    .await?;
                let host_owns = |block: &Block| {
                    block.affinity.as_deref() == Some(request.host.as_str())
                        && Family::of_net(&block.cidr) == family
                };
                let owned_blocks: BTreeSet<IpNet> = probe
                    .host_full
                    .iter()
                    .copied()
                    .filter(|c| Family::of_net(c) == family)
                    .chain(
                        working
                            .values()
                            .map(|w| &w.block)
                            .filter(|b| host_owns(b))
                            .map(|b| b.cidr),
                    )
                    .collect();
                let mut owned = owned_blocks.len() as u32;
                let mut unclaimed = probe.unclaimed.into_iter();
                while (got.len() as u32) < wanted {
                    if limited && owned >= config.max_blocks_per_host {
                        limit_hit = Some(owned);
                        break;
                    }
                    let (cidr, sequence_floor) =
                        match unclaimed.by_ref().find(|c| !working.contains_key(c)) {
                            Some(found) => (found, probe.sequence_floor),
                            None => {
                                // Every probed block is taken: one listing of the claim index
                                // (small entries, not blocks) settles it.
                                let index = self.ensure_claim_index(&mut claim_index).await?;
                                let Some(cidr) = find_unclaimed_block(
                                    &candidates,
                                    &request.host,
                                    index.entries.iter().map(|e| e.cidr),
                                    &working,
                                ) else {
                                    break;
                                };
                                (cidr, index.sequence_floor)
                            }
                        };
                    working.insert(
                        cidr,
                        WorkingBlock::created(cidr, Some(request.host.clone()), sequence_floor),
                    );
                    owned += 1;
                    take_from_blocks(
                        &mut working,
                        &[cidr],
                        &attribute,
                        wanted,
                        skip_block_edges,
                        &mut got,
                    );
                }
            }
            if let Some(owned) = limit_hit {
                if (got.len() as u32) < wanted {
                    return Err(IpamError::BlockLimit {
                        host: request.host.clone(),
                        family,
                        owned,
                        limit: config.max_blocks_per_host,
                    });
                }
            }

            // 3. Borrow from any other block, unless strict affinity forbids it.
            if (got.len() as u32) < wanted && !config.strict_affinity {
                config_used = true;
                let index = self.ensure_claim_index(&mut claim_index).await?;
                // Lenders come from the claim index: blocks nobody owns first, then other hosts'
                // blocks, each in address order; entries that record no free address are skipped
                // (format-1 entries, which record no count, are tried).
                let mut lenders: Vec<&IndexedClaim> = index
                    .entries
                    .iter()
                    .filter(|e| Family::of_net(&e.cidr) == family)
                    .filter(|e| e.claim.affinity.as_deref() != Some(request.host.as_str()))
                    .filter(|e| in_candidates(&e.cidr) && e.claim.free != Some(0))
                    .filter(|e| !working.contains_key(&e.cidr))
                    .collect();
                lenders.sort_by_key(|e| (e.claim.affinity.is_some(), e.cidr.network()));
                let mut lenders = lenders.into_iter();
                // Read only as many lenders as the missing addresses need, one batch at a time;
                // a lender that filled up since the listing sends the loop to the next ones.
                while (got.len() as u32) < wanted {
                    let missing = wanted - got.len() as u32;
                    let mut batch: BTreeMap<IpNet, KeyValue> = BTreeMap::new();
                    let mut covered = 0u32;
                    while covered < missing {
                        let Some(lender) = lenders.next() else {
                            break;
                        };
                        covered = covered.saturating_add(lender.claim.free.unwrap_or(1));
                        batch.insert(lender.cidr, lender.stored.clone());
                    }
                    if batch.is_empty() {
                        break;
                    }
                    let cidrs: BTreeSet<IpNet> = batch.keys().copied().collect();
                    let claims = batch.into_values().map(Some).collect();
                    let loaded = self.load_blocks_given_claims(&cidrs, claims).await?;
                    let mut order = Vec::with_capacity(loaded.found.len());
                    for (cidr, stored) in loaded.found {
                        working
                            .entry(cidr)
                            .or_insert_with(|| WorkingBlock::from_stored(stored));
                        order.push(cidr);
                    }
                    order.sort_by_key(|c| {
                        (
                            working.get(c).is_some_and(|w| w.block.affinity.is_some()),
                            c.network(),
                        )
                    });
                    take_from_blocks(
                        &mut working,
                        &order,
                        &attribute,
                        wanted,
                        skip_block_edges,
                        &mut got,
                    );
                }
            }

            if (got.len() as u32) < wanted {
                return Err(IpamError::Exhausted {
                    family,
                    requested: wanted,
                    found: got.len() as u32,
                    pools: candidates.iter().map(|p| p.value.name.clone()).collect(),
                });
            }
            for address in &got {
                if let Some(pool) = candidates
                    .iter()
                    .find(|p| p.value.cidr.contains(&address.ip))
                {
                    used_pools.insert(pool.value.name.clone());
                }
                handle.add(address.block, 1);
            }
            match family {
                Family::V4 => result.v4 = got,
                Family::V6 => result.v6 = got,
            }
        }

        if result.v4.is_empty() && result.v6.is_empty() {
            return Ok(Attempt::Done(result));
        }
        for working in working.values() {
            plan.write_block(working)?;
        }
        // Pools and config that decided this allocation must not have changed under it.
        for pool in pools.iter().filter(|p| used_pools.contains(&p.value.name)) {
            plan.expect(&pool.key, Some(pool.revision));
        }
        if config_used {
            plan.expect(&keys::config(), config_revision);
        }
        plan.expect(&handle_key, handle_revision);
        plan.put(&handle_key, encode(&handle)?);
        self.commit_plan(plan, result).await
    }

    /// The first read of a new-block search, one batch: the host's full blocks (when the per-host
    /// limit needs counting), the sequence floor and, for each candidate pool, the claim entries of the
    /// [`NEW_BLOCK_PROBES`] blocks that follow the host's hashed start. Its size does not grow
    /// with the number of blocks or hosts in the store.
    async fn probe_new_blocks(
        &self,
        candidates: &[&Stored<Pool>],
        host: &str,
        read_full: bool,
    ) -> Result<NewBlockProbe, IpamError> {
        let mut reads = vec![Read::Get(keys::sequence_floor())];
        if read_full {
            reads.push(Read::List(keys::host_full_blocks_dir(host)));
        }
        let mut probed = Vec::new();
        for pool in candidates {
            let count = pool.value.block_count();
            let start = u128::from(host_hash(host)) % count;
            for step in 0..count.min(NEW_BLOCK_PROBES) {
                if let Some(cidr) = pool.value.block_at((start + step) % count) {
                    probed.push(cidr);
                    reads.push(Read::Get(keys::block_claim(&cidr)));
                }
            }
        }
        let mut results = self.store.read_many(&reads).await?.into_iter();
        let sequence_floor = decode_sequence_floor(next_got(&mut results)?)?;
        let mut host_full = Vec::new();
        if read_full {
            for kv in next_listed(&mut results)? {
                let cidr = kv
                    .key
                    .rsplit('/')
                    .next()
                    .and_then(keys::parse_cidr_segment)
                    .ok_or_else(|| IpamError::Corrupt {
                        key: kv.key.clone(),
                        message: "a block key that names no CIDR".into(),
                    })?;
                host_full.push(cidr);
            }
        }
        let mut unclaimed = Vec::new();
        for cidr in probed {
            if next_got(&mut results)?.is_none() {
                unclaimed.push(cidr);
            }
        }
        Ok(NewBlockProbe {
            host_full,
            unclaimed,
            sequence_floor,
        })
    }

    async fn ensure_claim_index<'a>(
        &self,
        cache: &'a mut Option<ClaimIndex>,
    ) -> Result<&'a ClaimIndex, IpamError> {
        if cache.is_none() {
            *cache = Some(self.claim_index().await?);
        }
        cache
            .as_ref()
            .ok_or_else(|| IpamError::Internal("claim index cache vanished".into()))
    }

    /// The addresses a handle holds, reading only the blocks not already in hand.
    async fn addresses_in_blocks(
        &self,
        handle_id: &str,
        handle: &Handle,
        in_hand: &[Stored<Block>],
    ) -> Result<Vec<AssignedAddress>, IpamError> {
        let mut blocks: BTreeMap<IpNet, Block> = in_hand
            .iter()
            .filter(|b| handle.blocks.contains_key(&b.value.cidr))
            .map(|b| (b.value.cidr, b.value.clone()))
            .collect();
        let missing: BTreeSet<IpNet> = handle
            .blocks
            .keys()
            .filter(|c| !blocks.contains_key(c))
            .copied()
            .collect();
        for (cidr, stored) in self.load_blocks(&missing).await? {
            blocks.insert(cidr, stored.value);
        }
        let mut addresses = Vec::new();
        for block in blocks.values() {
            for ordinal in block.ordinals_of_handle(handle_id) {
                addresses.push(AssignedAddress {
                    ip: block.ip_of(ordinal),
                    block: block.cidr,
                });
            }
        }
        addresses.sort();
        Ok(addresses)
    }

    // -----------------------------------------------------------------------------------------
    // Specific addresses
    // -----------------------------------------------------------------------------------------

    /// Assigns the given addresses to a handle, all or none. Each must lie in an enabled pool; its
    /// block is claimed for `host` when it does not exist. An address the same handle already holds
    /// is accepted as is.
    ///
    /// # Errors
    /// [`IpamError::NotInPool`]; [`IpamError::AlreadyAssigned`]; [`IpamError::AffinityConflict`]
    /// under strict affinity; store failures.
    pub async fn assign_ips(
        &self,
        request: &AssignIpsRequest,
    ) -> Result<Vec<AssignedAddress>, IpamError> {
        validate_handle(&request.handle)?;
        validate_host(&request.host)?;
        validate_attribute_size(&request.handle, &request.attributes, &request.host)?;
        if request.ips.is_empty() || request.ips.len() > MAX_ADDRESSES_PER_REQUEST as usize {
            return Err(IpamError::invalid(format!(
                "between 1 and {MAX_ADDRESSES_PER_REQUEST} addresses may be assigned at once"
            )));
        }
        let unique: BTreeSet<IpAddr> = request.ips.iter().copied().collect();
        if unique.len() != request.ips.len() {
            return Err(IpamError::invalid("an address is listed twice"));
        }
        self.retrying(|| self.try_assign_ips(request)).await
    }

    async fn try_assign_ips(
        &self,
        request: &AssignIpsRequest,
    ) -> Result<Attempt<Vec<AssignedAddress>>, IpamError> {
        let handle_key = keys::handle(&request.handle);
        let results = self
            .store
            .read_many(&[
                Read::List(keys::pools_dir()),
                Read::Get(keys::config()),
                Read::Get(handle_key.clone()),
                Read::Get(keys::import_in_progress()),
            ])
            .await?;
        let mut results = results.into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let (config, config_revision) = Self::decode_config(next_got(&mut results)?)?;
        let (mut handle, handle_revision) = Self::decode_handle(next_got(&mut results)?)?;
        refuse_during_import(next_got(&mut results)?)?;

        let mut targets: Vec<(IpAddr, IpNet, &Stored<Pool>)> = Vec::new();
        for ip in &request.ips {
            let pool = pools
                .iter()
                .find(|p| !p.value.disabled && p.value.cidr.contains(ip))
                .ok_or(IpamError::NotInPool(*ip))?;
            let block = pool
                .value
                .block_containing(*ip)
                .ok_or(IpamError::NotInPool(*ip))?;
            targets.push((*ip, block, pool));
        }
        let cidrs: BTreeSet<IpNet> = targets.iter().map(|t| t.1).collect();
        let loaded = self.load_blocks_for_write(&cidrs).await?;
        let sequence_floor = loaded.sequence_floor;
        let mut working: BTreeMap<IpNet, WorkingBlock> = loaded
            .found
            .into_iter()
            .map(|(cidr, stored)| (cidr, WorkingBlock::from_stored(stored)))
            .collect();
        let attribute = Attribute {
            handle: request.handle.clone(),
            metadata: with_node(&request.attributes, &request.host),
        };
        let mut plan = Plan::default();
        let mut assigned = Vec::new();
        for (ip, cidr, pool) in &targets {
            let entry = working.entry(*cidr).or_insert_with(|| {
                WorkingBlock::created(*cidr, Some(request.host.clone()), sequence_floor)
            });
            if let Some(owner) = entry.block.affinity.as_deref() {
                if owner != request.host
                    && config.strict_affinity
                    && !request.ignore_strict_affinity
                {
                    return Err(IpamError::AffinityConflict {
                        ip: *ip,
                        block: *cidr,
                        owner: owner.to_owned(),
                    });
                }
            }
            let ordinal = entry
                .block
                .ordinal_of(*ip)
                .ok_or_else(|| IpamError::Internal(format!("{ip} is not inside {cidr}")))?;
            if let Some(holder) = entry.block.attribute_of(ordinal) {
                if holder.handle == request.handle {
                    assigned.push(AssignedAddress {
                        ip: *ip,
                        block: *cidr,
                    });
                    continue;
                }
                return Err(IpamError::AlreadyAssigned {
                    ip: *ip,
                    handle: holder.handle.clone(),
                });
            }
            entry.block.allocate_ordinal(ordinal, &attribute);
            entry.dirty = true;
            handle.add(*cidr, 1);
            plan.expect(&pool.key, Some(pool.revision));
            assigned.push(AssignedAddress {
                ip: *ip,
                block: *cidr,
            });
        }
        for working in working.values() {
            plan.write_block(working)?;
        }
        if !plan.is_empty() {
            plan.expect(&keys::config(), config_revision);
            plan.expect(&handle_key, handle_revision);
            plan.put(&handle_key, encode(&handle)?);
        }
        self.commit_plan(plan, assigned).await
    }

    // -----------------------------------------------------------------------------------------
    // Release
    // -----------------------------------------------------------------------------------------

    /// Releases addresses. Addresses not allocated are reported, not errors; with a sequence
    /// number, an address re-allocated since then is left alone and reported. Up to 32 addresses
    /// commit together; a longer list is released in several transactions.
    ///
    /// # Errors
    /// Store failures; [`IpamError::RetriesExhausted`].
    pub async fn release_ips(
        &self,
        requests: &[ReleaseRequest],
    ) -> Result<ReleaseOutcome, IpamError> {
        // Each chunk is one transaction. A chunk whose blocks and handles do not fit one
        // transaction (large, well-used blocks) is split in halves until it does.
        let mut outcome = ReleaseOutcome::default();
        let mut queue: std::collections::VecDeque<&[ReleaseRequest]> =
            requests.chunks(RELEASES_PER_TXN).collect();
        while let Some(chunk) = queue.pop_front() {
            let part = match self.retrying(|| self.try_release_ips(chunk)).await {
                Err(IpamError::TooLarge(_)) if chunk.len() > 1 => {
                    let (first, second) = chunk.split_at(chunk.len() / 2);
                    queue.push_front(second);
                    queue.push_front(first);
                    continue;
                }
                other => other?,
            };
            outcome.released.extend(part.released);
            outcome.not_allocated.extend(part.not_allocated);
            outcome.sequence_mismatch.extend(part.sequence_mismatch);
        }
        outcome.released.sort();
        outcome.not_allocated.sort();
        outcome.sequence_mismatch.sort();
        Ok(outcome)
    }

    async fn try_release_ips(
        &self,
        requests: &[ReleaseRequest],
    ) -> Result<Attempt<ReleaseOutcome>, IpamError> {
        let pools = Self::decode_pools(self.store.list(&keys::pools_dir()).await?)?;
        let mut outcome = ReleaseOutcome::default();
        let mut targets: Vec<(ReleaseRequest, IpNet)> = Vec::new();
        for request in requests {
            match pools
                .iter()
                .find_map(|p| p.value.block_containing(request.ip))
            {
                Some(block) => targets.push((*request, block)),
                None => outcome.not_allocated.push(request.ip),
            }
        }
        let cidrs: BTreeSet<IpNet> = targets.iter().map(|t| t.1).collect();
        let mut working: BTreeMap<IpNet, WorkingBlock> = self
            .load_blocks(&cidrs)
            .await?
            .into_iter()
            .map(|(cidr, stored)| (cidr, WorkingBlock::from_stored(stored)))
            .collect();
        let mut handle_counts: BTreeMap<IpNet, BTreeMap<String, u32>> = BTreeMap::new();
        for (request, cidr) in targets {
            let Some(entry) = working.get_mut(&cidr) else {
                outcome.not_allocated.push(request.ip);
                continue;
            };
            let Some(ordinal) = entry.block.ordinal_of(request.ip) else {
                outcome.not_allocated.push(request.ip);
                continue;
            };
            let Some(allocation) = entry.block.allocations.get(&ordinal).copied() else {
                outcome.not_allocated.push(request.ip);
                continue;
            };
            if request.sequence.is_some_and(|s| s != allocation.sequence) {
                outcome.sequence_mismatch.push(request.ip);
                continue;
            }
            if let Some(attribute) = entry.block.release_ordinal(ordinal) {
                *handle_counts
                    .entry(cidr)
                    .or_default()
                    .entry(attribute.handle)
                    .or_insert(0) += 1;
            }
            entry.dirty = true;
            outcome.released.push(request.ip);
        }
        let mut plan = Plan::default();
        let mut per_handle: BTreeMap<String, Vec<(IpNet, u32)>> = BTreeMap::new();
        for (cidr, counts) in handle_counts {
            for (handle, count) in counts {
                per_handle.entry(handle).or_default().push((cidr, count));
            }
        }
        self.release_counts_from_handles(&mut plan, &per_handle)
            .await?;
        for working in working.values() {
            plan.write_block(working)?;
        }
        outcome.released.sort();
        outcome.not_allocated.sort();
        outcome.sequence_mismatch.sort();
        self.commit_plan(plan, outcome).await
    }

    /// Adds to `plan` the handle updates for releasing, per handle, `count` addresses of each
    /// listed block.
    async fn release_counts_from_handles(
        &self,
        plan: &mut Plan,
        per_handle: &BTreeMap<String, Vec<(IpNet, u32)>>,
    ) -> Result<(), IpamError> {
        if per_handle.is_empty() {
            return Ok(());
        }
        let reads: Vec<Read> = per_handle
            .keys()
            .map(|h| Read::Get(keys::handle(h)))
            .collect();
        for ((handle_id, releases), result) in
            per_handle.iter().zip(self.store.read_many(&reads).await?)
        {
            let (mut handle, revision) = Self::decode_handle(result.into_got()?)?;
            let key = keys::handle(handle_id);
            plan.expect(&key, revision);
            for (cidr, count) in releases {
                handle.remove(*cidr, *count);
            }
            if handle.blocks.is_empty() {
                if revision.is_some() {
                    plan.delete(&key);
                }
            } else {
                plan.put(&key, encode(&handle)?);
            }
        }
        Ok(())
    }

    /// Releases every address a handle holds and deletes the handle. An unknown handle is success.
    ///
    /// # Errors
    /// Store failures; [`IpamError::RetriesExhausted`].
    pub async fn release_handle(&self, handle_id: &str) -> Result<Vec<IpAddr>, IpamError> {
        validate_handle(handle_id)?;
        self.retrying(|| self.try_release_handle(handle_id)).await
    }

    async fn try_release_handle(&self, handle_id: &str) -> Result<Attempt<Vec<IpAddr>>, IpamError> {
        let key = keys::handle(handle_id);
        let Some(kv) = self.store.get(&key).await? else {
            return Ok(Attempt::Done(Vec::new()));
        };
        let stored: Stored<Handle> = decode_stored(kv)?;
        let cidrs: BTreeSet<IpNet> = stored.value.blocks.keys().copied().collect();
        let mut released = Vec::new();
        let mut plan = Plan::default();
        for (_, block) in self.load_blocks(&cidrs).await? {
            let mut working = WorkingBlock::from_stored(block);
            for ordinal in working.block.ordinals_of_handle(handle_id) {
                released.push(working.block.ip_of(ordinal));
                working.block.release_ordinal(ordinal);
                working.dirty = true;
            }
            plan.write_block(&working)?;
        }
        plan.expect(&key, Some(stored.revision));
        plan.delete(&key);
        released.sort();
        self.commit_plan(plan, released).await
    }

    /// Releases, in one transaction, the addresses `choose` picks among everything `handle_id`
    /// holds (it is given the handle's allocations in address order): the handle is updated, or
    /// deleted when it is left with nothing. What a CNI DEL needs, in two round trips when the
    /// handle's blocks are affine to `host` (the common case): one batched read of the handle and
    /// of the host's blocks, then the transaction. Blocks elsewhere cost one more read.
    ///
    /// # Errors
    /// Store failures; corrupt objects; [`IpamError::RetriesExhausted`].
    pub async fn release_chosen<F>(
        &self,
        handle_id: &str,
        host: &str,
        choose: F,
    ) -> Result<ChosenRelease, IpamError>
    where
        F: Fn(&[AllocationInfo]) -> Vec<IpAddr>,
    {
        validate_handle(handle_id)?;
        validate_host(host)?;
        self.retrying(|| self.try_release_chosen(handle_id, host, &choose))
            .await
    }

    async fn try_release_chosen<F>(
        &self,
        handle_id: &str,
        host: &str,
        choose: &F,
    ) -> Result<Attempt<ChosenRelease>, IpamError>
    where
        F: Fn(&[AllocationInfo]) -> Vec<IpAddr>,
    {
        let key = keys::handle(handle_id);
        let mut results = self
            .store
            .read_many(&[
                Read::Get(key.clone()),
                Read::List(keys::host_blocks_dir(host)),
            ])
            .await?
            .into_iter();
        let handle_kv = next_got(&mut results)?;
        let host_blocks = next_listed(&mut results)?;
        let Some(handle_kv) = handle_kv else {
            return Ok(Attempt::Done(ChosenRelease::default()));
        };
        let stored: Stored<Handle> = decode_stored(handle_kv)?;
        let wanted: BTreeSet<IpNet> = stored.value.blocks.keys().copied().collect();
        let mut working: BTreeMap<IpNet, WorkingBlock> = BTreeMap::new();
        for kv in host_blocks {
            let block: Stored<Block> = decode_stored(kv)?;
            if wanted.contains(&block.value.cidr) {
                working.insert(block.value.cidr, WorkingBlock::from_stored(block));
            }
        }
        let elsewhere: BTreeSet<IpNet> = wanted
            .iter()
            .filter(|c| !working.contains_key(c))
            .copied()
            .collect();
        for (cidr, block) in self.load_blocks(&elsewhere).await? {
            working.insert(cidr, WorkingBlock::from_stored(block));
        }
        let mut held = Vec::new();
        for entry in working.values() {
            for ordinal in entry.block.ordinals_of_handle(handle_id) {
                if let Some(info) = allocation_info(&entry.block, entry.block.ip_of(ordinal)) {
                    held.push(info);
                }
            }
        }
        held.sort_by_key(|a| a.ip);
        let chosen: BTreeSet<IpAddr> = choose(&held).into_iter().collect();
        let mut handle = stored.value.clone();
        let mut released = Vec::new();
        for info in held.iter().filter(|info| chosen.contains(&info.ip)) {
            let Some(entry) = working.get_mut(&info.block) else {
                continue;
            };
            let Some(ordinal) = entry.block.ordinal_of(info.ip) else {
                continue;
            };
            entry.block.release_ordinal(ordinal);
            entry.dirty = true;
            handle.remove(info.block, 1);
            released.push(info.ip);
        }
        if released.is_empty() {
            return Ok(Attempt::Done(ChosenRelease { held, released }));
        }
        let mut plan = Plan::default();
        for entry in working.values().filter(|w| w.dirty) {
            plan.write_block(entry)?;
        }
        plan.expect(&key, Some(stored.revision));
        if released.len() == held.len() {
            plan.delete(&key);
        } else {
            plan.put(&key, encode(&handle)?);
        }
        self.commit_plan(plan, ChosenRelease { held, released })
            .await
    }

    // -----------------------------------------------------------------------------------------
    // Queries
    // -----------------------------------------------------------------------------------------

    /// The addresses a handle holds (empty for an unknown handle).
    ///
    /// # Errors
    /// Store failures; corrupt objects.
    pub async fn ips_by_handle(&self, handle_id: &str) -> Result<Vec<AssignedAddress>, IpamError> {
        Ok(self
            .allocations_by_handle(handle_id)
            .await?
            .into_iter()
            .map(|info| AssignedAddress {
                ip: info.ip,
                block: info.block,
            })
            .collect())
    }

    /// Every allocation a handle holds, with its attributes and sequence number (empty for an
    /// unknown handle): one handle read and one batch of block reads, whatever the count.
    ///
    /// # Errors
    /// Store failures; corrupt objects.
    pub async fn allocations_by_handle(
        &self,
        handle_id: &str,
    ) -> Result<Vec<AllocationInfo>, IpamError> {
        validate_handle(handle_id)?;
        let (handle, _) = Self::decode_handle(self.store.get(&keys::handle(handle_id)).await?)?;
        let cidrs: BTreeSet<IpNet> = handle.blocks.keys().copied().collect();
        let mut found = Vec::new();
        for stored in self.load_blocks(&cidrs).await?.values() {
            for ordinal in stored.value.ordinals_of_handle(handle_id) {
                if let Some(info) = allocation_info(&stored.value, stored.value.ip_of(ordinal)) {
                    found.push(info);
                }
            }
        }
        found.sort_by_key(|a| a.ip);
        Ok(found)
    }

    /// Who holds an address, if anyone.
    ///
    /// # Errors
    /// Store failures; corrupt objects.
    pub async fn get_assignment(&self, ip: IpAddr) -> Result<Option<AllocationInfo>, IpamError> {
        let pools = self.list_pools().await?;
        let Some(cidr) = pools.iter().find_map(|p| p.block_containing(ip)) else {
            return Ok(None);
        };
        let blocks = self.load_blocks(&BTreeSet::from([cidr])).await?;
        let Some(stored) = blocks.get(&cidr) else {
            return Ok(None);
        };
        Ok(allocation_info(&stored.value, ip))
    }

    /// Every allocated address in the store.
    ///
    /// # Errors
    /// Store failures; corrupt objects.
    pub async fn list_allocations(&self) -> Result<Vec<AllocationInfo>, IpamError> {
        let mut all = Vec::new();
        for stored in self.all_blocks().await? {
            for ordinal in stored.value.allocations.keys() {
                if let Some(info) = allocation_info(&stored.value, stored.value.ip_of(*ordinal)) {
                    all.push(info);
                }
            }
        }
        all.sort_by_key(|a| a.ip);
        Ok(all)
    }

    /// Per-pool and per-block capacity, use and free space.
    ///
    /// # Errors
    /// Store failures; corrupt objects.
    pub async fn utilization(&self) -> Result<Utilization, IpamError> {
        let results = self
            .store
            .read_many(&[
                Read::List(keys::pools_dir()),
                Read::List(keys::blocks_dir()),
            ])
            .await?;
        let mut results = results.into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let mut blocks: Vec<Block> = next_listed(&mut results)?
            .into_iter()
            .map(|kv| decode_stored::<Block>(kv).map(|s| s.value))
            .collect::<Result<_, _>>()?;
        blocks.sort_by_key(|b| (Family::of_net(&b.cidr), b.cidr.network()));
        let mut usage = Utilization::default();
        for pool in &pools {
            usage.pools.push(PoolUsage {
                pool: pool.value.clone(),
                capacity: pool.value.capacity(),
                in_use: 0,
                free: pool.value.capacity(),
                blocks: Vec::new(),
            });
        }
        for block in blocks {
            let pool_index = pools
                .iter()
                .position(|p| p.value.cidr.contains(&block.cidr.network()));
            let row = BlockUsage {
                cidr: block.cidr,
                pool: pool_index.map(|i| pools[i].value.name.clone()),
                host: block.affinity.clone(),
                capacity: u64::from(block.capacity()),
                in_use: u64::from(block.in_use()),
                free: u64::from(block.free()),
            };
            match pool_index {
                Some(i) => {
                    let entry = &mut usage.pools[i];
                    entry.in_use += row.in_use;
                    entry.free = entry.free.saturating_sub(u128::from(row.in_use));
                    entry.blocks.push(row);
                }
                None => usage.orphan_blocks.push(row),
            }
        }
        Ok(usage)
    }

    // -----------------------------------------------------------------------------------------
    // Affinity
    // -----------------------------------------------------------------------------------------

    /// Claims for `host` every block inside `cidr` (which must lie in one enabled pool and be at
    /// least one block large): missing blocks are created, blocks with no affinity are taken.
    /// Returns the blocks claimed (already-owned blocks included).
    ///
    /// # Errors
    /// [`IpamError::NotInPool`]; [`IpamError::BlockOwnedByOtherHost`]; [`IpamError::InvalidArgument`].
    pub async fn claim_affinity(&self, host: &str, cidr: IpNet) -> Result<Vec<IpNet>, IpamError> {
        validate_host(host)?;
        if cidr.trunc() != cidr {
            return Err(IpamError::invalid(format!(
                "{cidr} is not a network address"
            )));
        }
        self.retrying(|| self.try_claim_affinity(host, cidr)).await
    }

    async fn try_claim_affinity(
        &self,
        host: &str,
        cidr: IpNet,
    ) -> Result<Attempt<Vec<IpNet>>, IpamError> {
        let pools = Self::decode_pools(self.store.list(&keys::pools_dir()).await?)?;
        let pool = pools
            .iter()
            .find(|p| !p.value.disabled && p.value.cidr.contains(&cidr))
            .ok_or(IpamError::NotInPool(cidr.network()))?;
        if cidr.prefix_len() > pool.value.block_size {
            return Err(IpamError::invalid(format!(
                "{cidr} is smaller than one /{} block of pool {}",
                pool.value.block_size, pool.value.name
            )));
        }
        let count = 1u128 << (pool.value.block_size - cidr.prefix_len());
        if count > BLOCKS_PER_TXN as u128 {
            return Err(IpamError::invalid(format!(
                "{cidr} spans {count} blocks; claim at most {BLOCKS_PER_TXN} at a time"
            )));
        }
        let sub = Pool {
            cidr,
            ..pool.value.clone()
        };
        let wanted: BTreeSet<IpNet> = (0..count).filter_map(|i| sub.block_at(i)).collect();
        let existing = self.load_blocks_for_write(&wanted).await?;
        let mut plan = Plan::default();
        plan.expect(&pool.key, Some(pool.revision));
        for block_cidr in &wanted {
            let working = match existing.found.get(block_cidr) {
                None => WorkingBlock::created(
                    *block_cidr,
                    Some(host.to_owned()),
                    existing.sequence_floor,
                ),
                Some(stored) => match stored.value.affinity.as_deref() {
                    Some(owner) if owner == host => continue,
                    Some(owner) => {
                        return Err(IpamError::BlockOwnedByOtherHost {
                            block: *block_cidr,
                            owner: owner.to_owned(),
                        })
                    }
                    None => {
                        let mut w = WorkingBlock::from_stored(stored.clone());
                        w.block.affinity = Some(host.to_owned());
                        w.dirty = true;
                        w
                    }
                },
            };
            plan.write_block(&working)?;
        }
        self.commit_plan(plan, wanted.into_iter().collect()).await
    }

    /// Releases `host`'s affinity to one block: deleted if empty, else left without affinity.
    ///
    /// # Errors
    /// [`IpamError::BlockOwnedByOtherHost`] when the block is not the host's; store failures.
    pub async fn release_affinity(&self, host: &str, block: IpNet) -> Result<(), IpamError> {
        validate_host(host)?;
        self.retrying(|| async {
            let found = self.load_blocks(&BTreeSet::from([block])).await?;
            let Some(stored) = found.into_values().next() else {
                return Ok(Attempt::Done(()));
            };
            match stored.value.affinity.as_deref() {
                Some(owner) if owner == host => {}
                Some(owner) => {
                    return Err(IpamError::BlockOwnedByOtherHost {
                        block,
                        owner: owner.to_owned(),
                    })
                }
                None => return Ok(Attempt::Done(())),
            }
            let mut working = WorkingBlock::from_stored(stored);
            working.block.affinity = None;
            working.dirty = true;
            let mut plan = Plan::default();
            plan.write_block(&working)?;
            self.commit_plan(plan, ()).await
        })
        .await
    }

    /// Retires a host: its empty blocks are deleted and its other blocks lose their affinity.
    /// With `release_addresses`, every address whose `node` attribute is this host is released
    /// first (by handle, so handles stay exact).
    ///
    /// # Errors
    /// Store failures; [`IpamError::RetriesExhausted`].
    pub async fn release_host(
        &self,
        host: &str,
        release_addresses: bool,
    ) -> Result<HostRelease, IpamError> {
        validate_host(host)?;
        let mut report = HostRelease::default();
        if release_addresses {
            // Every address of every handle recorded for the node, released in batches (one
            // transaction per batch, not per pod), each guarded by the sequence number it was
            // listed with: an address re-allocated since belongs to its new owner and stays.
            let allocations = self.list_allocations().await?;
            let handles: BTreeSet<&str> = allocations
                .iter()
                .filter(|a| a.attributes.get(ATTR_NODE).map(String::as_str) == Some(host))
                .map(|a| a.handle.as_str())
                .collect();
            let requests: Vec<ReleaseRequest> = allocations
                .iter()
                .filter(|a| handles.contains(a.handle.as_str()))
                .map(|a| ReleaseRequest {
                    ip: a.ip,
                    sequence: Some(a.sequence),
                })
                .collect();
            report.released_addresses = self.release_ips(&requests).await?.released;
        }
        loop {
            let host_blocks: Vec<Stored<Block>> = self
                .store
                .list(&keys::host_blocks_dir(host))
                .await?
                .into_iter()
                .map(decode_stored)
                .collect::<Result<_, _>>()?;
            if host_blocks.is_empty() {
                break;
            }
            // As many blocks as fit one transaction (by count and by bytes), at least one.
            let mut take = host_blocks.len().min(BLOCKS_PER_TXN);
            let (plan, deleted, unassigned) = loop {
                let mut plan = Plan::default();
                let mut deleted = Vec::new();
                let mut unassigned = Vec::new();
                for stored in host_blocks.iter().take(take) {
                    let mut working = WorkingBlock::from_stored(stored.clone());
                    working.block.affinity = None;
                    working.dirty = true;
                    if working.block.is_empty() {
                        deleted.push(working.block.cidr);
                    } else {
                        unassigned.push(working.block.cidr);
                    }
                    plan.write_block(&working)?;
                }
                if take == 1 || plan.fits_one_transaction() {
                    break (plan, deleted, unassigned);
                }
                take /= 2;
            };
            // A conflict here just means a block changed: list again and carry on.
            if let Attempt::Done(()) = self.commit_plan(plan, ()).await? {
                report.deleted_blocks.extend(deleted);
                report.unassigned_blocks.extend(unassigned);
            } else {
                tokio::time::sleep(self.retry.base_backoff).await;
            }
        }
        Ok(report)
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

fn next_listed(
    results: &mut impl Iterator<Item = crate::kv::ReadResult>,
) -> Result<Vec<KeyValue>, IpamError> {
    results
        .next()
        .ok_or_else(|| IpamError::Internal("read_many returned too few results".into()))?
        .into_listed()
        .map_err(IpamError::from)
}

fn next_got(
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

fn allocation_info(block: &Block, ip: IpAddr) -> Option<AllocationInfo> {
    let ordinal = block.ordinal_of(ip)?;
    let allocation = block.allocations.get(&ordinal)?;
    let attribute = block.attribute_of(ordinal)?;
    Some(AllocationInfo {
        ip,
        block: block.cidr,
        block_host: block.affinity.clone(),
        handle: attribute.handle.clone(),
        attributes: attribute.metadata.clone(),
        sequence: allocation.sequence,
    })
}

/// Finds a pool by name or by CIDR text.
pub(crate) fn find_pool<'a>(
    pools: &'a [Stored<Pool>],
    name_or_cidr: &str,
) -> Result<&'a Stored<Pool>, IpamError> {
    if let Some(found) = pools.iter().find(|p| p.value.name == name_or_cidr) {
        return Ok(found);
    }
    if let Ok(cidr) = name_or_cidr.parse::<IpNet>() {
        if let Some(found) = pools.iter().find(|p| p.value.cidr == cidr) {
            return Ok(found);
        }
    }
    Err(IpamError::PoolNotFound(name_or_cidr.to_owned()))
}

/// The stored pool that is `pool` itself: same name, CIDR and block size.
fn find_exact_pool<'a>(
    pools: &'a [Stored<Pool>],
    pool: &Pool,
) -> Result<&'a Stored<Pool>, IpamError> {
    pools
        .iter()
        .find(|p| {
            p.value.name == pool.name
                && p.value.cidr == pool.cidr
                && p.value.block_size == pool.block_size
        })
        .ok_or_else(|| IpamError::PoolNotFound(pool.name.clone()))
}

/// The pools an auto-assign may use for one family.
fn candidate_pools<'a>(
    pools: &'a [Stored<Pool>],
    family: Family,
    requested: &[String],
    host: &str,
    node_labels: &BTreeMap<String, String>,
    purpose: AllowedUse,
) -> Result<Vec<&'a Stored<Pool>>, IpamError> {
    if requested.is_empty() {
        // As Calico: enabled, automatic, allowing the use, and selecting the node.
        let enabled: Vec<&Stored<Pool>> = pools
            .iter()
            .filter(|p| p.value.family() == family && !p.value.disabled)
            .collect();
        let chosen: Vec<&Stored<Pool>> = enabled
            .iter()
            .copied()
            .filter(|p| {
                p.value.assignment_mode == AssignmentMode::Automatic
                    && p.value.allowed_uses.allows(purpose)
                    && p.value.node_selector.matches(node_labels)
            })
            .collect();
        if chosen.is_empty() && !enabled.is_empty() {
            return Err(IpamError::NoPoolSelectsNode {
                host: host.to_owned(),
                family,
                pools: enabled.iter().map(|p| p.value.name.clone()).collect(),
            });
        }
        return Ok(chosen);
    }
    // Pools named explicitly are used whatever they select, manual ones included (as Calico);
    // they must still allow the use.
    let mut chosen = Vec::new();
    for wanted in requested {
        let pool = find_pool(pools, wanted)?;
        if pool.value.family() != family {
            return Err(IpamError::PoolWrongFamily {
                pool: wanted.clone(),
                family,
            });
        }
        if pool.value.disabled {
            return Err(IpamError::PoolDisabled(pool.value.name.clone()));
        }
        if !pool.value.allowed_uses.allows(purpose) {
            return Err(IpamError::PoolUseNotAllowed {
                pool: pool.value.name.clone(),
                use_: purpose,
                allowed: pool.value.allowed_uses.clone(),
            });
        }
        if !chosen
            .iter()
            .any(|c: &&Stored<Pool>| c.value.name == pool.value.name)
        {
            chosen.push(pool);
        }
    }
    Ok(chosen)
}

/// Allocates from `order` until `got` holds `wanted` addresses (host addresses of each block's
/// prefix only, with `skip_block_edges`).
fn take_from_blocks(
    working: &mut BTreeMap<IpNet, WorkingBlock>,
    order: &[IpNet],
    attribute: &Attribute,
    wanted: u32,
    skip_block_edges: bool,
    got: &mut Vec<AssignedAddress>,
) {
    for cidr in order {
        let Some(entry) = working.get_mut(cidr) else {
            continue;
        };
        while (got.len() as u32) < wanted && block_value_has_room(&entry.block) {
            let next = if skip_block_edges {
                entry.block.allocate_next_host_address(attribute)
            } else {
                entry.block.allocate_next(attribute)
            };
            match next {
                Some(ordinal) => {
                    entry.dirty = true;
                    got.push(AssignedAddress {
                        ip: entry.block.ip_of(ordinal),
                        block: entry.block.cidr,
                    });
                }
                None => break,
            }
        }
        if (got.len() as u32) >= wanted {
            return;
        }
    }
}

/// The first block of the candidate pools that does not exist yet, searching each pool from an
/// index seeded by the host name and wrapping around.
fn find_unclaimed_block(
    candidates: &[&Stored<Pool>],
    host: &str,
    claimed: impl Iterator<Item = IpNet>,
    working: &BTreeMap<IpNet, WorkingBlock>,
) -> Option<IpNet> {
    let taken = TakenCidrs::new(claimed.chain(working.keys().copied()));
    for pool in candidates {
        let count = pool.value.block_count();
        let in_pool = taken.count_inside(&pool.value.cidr) as u128;
        // A free block is found within (blocks already taken in this pool + 1) steps.
        let steps = count.min(in_pool + 1);
        let start = u128::from(host_hash(host)) % count;
        for step in 0..steps.max(1) {
            let index = (start + step) % count;
            let Some(candidate) = pool.value.block_at(index) else {
                continue;
            };
            if !taken.overlaps(&candidate) {
                return Some(candidate);
            }
        }
        // Taken blocks may be spread out: a full scan settles it.
        if steps < count {
            let mut index = (start + steps) % count;
            for _ in steps..count.min(1 << 20) {
                if let Some(candidate) = pool.value.block_at(index) {
                    if !taken.overlaps(&candidate) {
                        return Some(candidate);
                    }
                }
                index = (index + 1) % count;
            }
        }
    }
    None
}

/// Claimed CIDRs ordered by family and first address, for overlap questions in O(log n).
struct TakenCidrs {
    by_start: BTreeMap<(Family, u128), IpNet>,
}

impl TakenCidrs {
    fn new(cidrs: impl Iterator<Item = IpNet>) -> Self {
        let mut by_start: BTreeMap<(Family, u128), IpNet> = BTreeMap::new();
        for cidr in cidrs {
            let key = (Family::of_net(&cidr), ip_to_u128(cidr.network()));
            // Of two CIDRs starting at one address, keep the wider: it covers the other.
            match by_start.get(&key) {
                Some(kept) if kept.prefix_len() <= cidr.prefix_len() => {}
                _ => {
                    by_start.insert(key, cidr);
                }
            }
        }
        TakenCidrs { by_start }
    }

    fn bounds(cidr: &IpNet) -> ((Family, u128), (Family, u128)) {
        let family = Family::of_net(cidr);
        (
            (family, ip_to_u128(cidr.network())),
            (family, ip_to_u128(cidr.broadcast())),
        )
    }

    /// True when a taken CIDR starts inside `cidr`, or the nearest one starting before it covers it.
    fn overlaps(&self, cidr: &IpNet) -> bool {
        let (first, last) = Self::bounds(cidr);
        if self.by_start.range(first..=last).next().is_some() {
            return true;
        }
        self.by_start
            .range(..first)
            .next_back()
            .is_some_and(|(key, taken)| key.0 == first.0 && taken.contains(&cidr.network()))
    }

    /// How many taken CIDRs start inside `cidr`.
    fn count_inside(&self, cidr: &IpNet) -> usize {
        let (first, last) = Self::bounds(cidr);
        self.by_start.range(first..=last).count()
    }
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
}
