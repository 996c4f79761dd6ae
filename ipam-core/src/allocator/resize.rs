//! Resizing pools: splitting a pool into sub-pools, changing a pool's block size (new claims use
//! the new size, old blocks drain), and finding the block that holds an address when a pool's
//! blocks have mixed sizes.
//!
//! A pool whose block size was ever changed has a *mixed-sizes record*
//! (`ipam/v1/mixed-block-sizes/<pool name>`, its CIDR and the sizes it had before). While it
//! exists, finding "the block holding address x" in that pool reads the claim index (the CIDRs of
//! every block, whatever their size) instead of computing the CIDR from the block size, the
//! new-block search skips its 16-block probe and searches the claim index with an overlap test, and
//! every block created in the pool rewrites the record in its transaction, so two block claims in
//! one mixed pool never commit from the same snapshot (two overlapping CIDRs of different sizes
//! have different claim keys, which alone would not stop them). Pools that never changed size keep
//! the exact-CIDR path and its round trips.

use super::{
    find_pool, next_got, next_listed, Attempt, Ipam, LoadedBlocks, Plan, PoolChange,
    ReleaseRequest, Stored, WorkingBlock,
};
use crate::kv::{KeyValue, Read};
use crate::model::error::IpamError;
use crate::model::namespaces::{entry_names_pool, namespace_key, NamespacePools};
use crate::model::{
    decode, encode, ip_to_u128, keys, validate_pool_name, Block, Family, Pool, V4_BLOCK_SIZES,
    V6_BLOCK_SIZES,
};
use crate::model::{host_bits, u128_to_ip};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

pub use crate::model::keys::{mixed_sizes_dir, mixed_sizes_key};

/// Most sub-pools one split makes (one transaction writes each, and its mixed-sizes record).
pub const MAX_SPLIT_PARTS: u32 = 32;

/// Says that the pool with this CIDR may hold blocks of other sizes than its block size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MixedBlockSizes {
    /// The pool's CIDR when the record was written (a record for another CIDR, left by a pool
    /// deleted and re-created under the same name, is ignored).
    pub cidr: IpNet,
    /// The block sizes the pool had before its current one.
    pub former_sizes: BTreeSet<u8>,
}

/// The mixed-sizes record read from `kv`, when it applies to `pool`.
pub(crate) fn mixed_record_for(
    pool: &Pool,
    kv: Option<&KeyValue>,
) -> Result<Option<MixedBlockSizes>, IpamError> {
    let Some(kv) = kv else {
        return Ok(None);
    };
    let record: MixedBlockSizes = decode(&kv.key, &kv.value)?;
    Ok((record.cidr == pool.cidr).then_some(record))
}

/// What splitting a pool did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSplit {
    /// The pool that was replaced.
    pub pool: Pool,
    /// The sub-pools that replaced it, in address order.
    pub pools: Vec<Pool>,
    /// Blocks that now lie in the sub-pools (they did not move: blocks belong to the pool whose
    /// CIDR contains them).
    pub blocks: u64,
    /// Namespaces whose pools setting named the old pool, rewritten to name the sub-pools.
    pub namespaces: Vec<String>,
}

/// The blocks found for a set of addresses, and the block each address lies in.
#[derive(Debug, Default)]
pub(crate) struct LocatedBlocks {
    /// Per address: the existing block holding it, else the CIDR a block claimed for it would
    /// take (the pool's block size, or in a mixed pool the largest block of at least that size
    /// that overlaps no existing block).
    pub block_of: BTreeMap<IpAddr, IpNet>,
    /// The existing blocks among those, and the sequence floor.
    pub loaded: LoadedBlocks,
    /// Mixed-sizes records read, by pool name, for [`LocatedBlocks::guard_creations`].
    mixed: BTreeMap<String, (IpNet, KeyValue)>,
}

impl LocatedBlocks {
    /// Adds to `plan`, for every block `working` creates inside a mixed pool, a rewrite of that
    /// pool's mixed-sizes record conditioned on the revision read: concurrent claims in one mixed
    /// pool then conflict instead of committing overlapping CIDRs.
    pub(crate) fn guard_creations<'a>(
        &self,
        plan: &mut Plan,
        working: impl Iterator<Item = &'a WorkingBlock>,
    ) {
        for created in working.filter(|w| w.read.is_none() && w.dirty) {
            for (pool_cidr, kv) in self.mixed.values() {
                if pool_cidr.contains(&created.block.cidr.network()) {
                    guard_mixed_record(plan, kv);
                }
            }
        }
    }
}

/// Conditions `plan` on the mixed-sizes record `kv` and rewrites it (a new revision).
pub(crate) fn guard_mixed_record(plan: &mut Plan, kv: &KeyValue) {
    plan.expect(&kv.key, Some(kv.revision));
    plan.put(&kv.key, kv.value.clone());
}

/// True when two CIDRs share an address (aligned CIDRs either nest or are disjoint).
fn cidrs_overlap(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// The CIDR a new block for `ip` takes in a mixed pool: the largest block of at least the pool's
/// block size that holds `ip` and overlaps none of `claimed`.
fn free_block_for(pool: &Pool, ip: IpAddr, claimed: &[IpNet]) -> Option<IpNet> {
    (pool.block_size..=host_bits(pool.family()))
        .filter_map(|prefix| IpNet::new(ip, prefix).ok().map(|n| n.trunc()))
        .find(|candidate| !claimed.iter().any(|c| cidrs_overlap(c, candidate)))
}

impl Ipam {
    /// Finds the block each address lies in (`targets` pairs an address with the pool containing
    /// it) and reads the existing ones. For pools of one block size, the same two round trips as
    /// [`load_blocks_for_write`](Ipam::load_blocks_for_write) (the first also reads the pools'
    /// mixed-sizes records); a mixed pool adds one listing of the claim index.
    ///
    /// # Errors
    /// As [`load_blocks_for_write`](Ipam::load_blocks_for_write).
    pub(crate) async fn locate_blocks(
        &self,
        targets: &[(IpAddr, &Pool)],
    ) -> Result<LocatedBlocks, IpamError> {
        if targets.is_empty() {
            return Ok(LocatedBlocks::default());
        }
        let pools: BTreeMap<&str, &Pool> = targets
            .iter()
            .map(|(_, pool)| (pool.name.as_str(), *pool))
            .collect();
        let mut current: BTreeMap<IpAddr, IpNet> = BTreeMap::new();
        for (ip, pool) in targets {
            if let Some(cidr) = pool.block_containing(*ip) {
                current.insert(*ip, cidr);
            }
        }
        let current_cidrs: BTreeSet<IpNet> = current.values().copied().collect();
        let mut reads: Vec<Read> = pools
            .keys()
            .map(|name| Read::Get(mixed_sizes_key(name)))
            .collect();
        reads.extend(
            current_cidrs
                .iter()
                .map(|c| Read::Get(keys::block_claim(c))),
        );
        let mut results = self.store.read_many(&reads).await?.into_iter();
        let mut mixed: BTreeMap<String, (IpNet, KeyValue)> = BTreeMap::new();
        for (name, pool) in &pools {
            let kv = next_got(&mut results)?;
            if mixed_record_for(pool, kv.as_ref())?.is_some() {
                if let Some(kv) = kv {
                    mixed.insert((*name).to_owned(), (pool.cidr, kv));
                }
            }
        }
        let mut claims: BTreeMap<IpNet, Option<KeyValue>> = BTreeMap::new();
        for cidr in &current_cidrs {
            claims.insert(*cidr, next_got(&mut results)?);
        }
        let mut block_of: BTreeMap<IpAddr, IpNet> = BTreeMap::new();
        let mut chosen: BTreeMap<IpNet, Option<KeyValue>> = BTreeMap::new();
        let index = if mixed.is_empty() {
            None
        } else {
            Some(self.claim_index().await?)
        };
        for (ip, pool) in targets {
            match (&index, mixed.contains_key(&pool.name)) {
                (Some(index), true) => {
                    if let Some(entry) = index.entries.iter().find(|e| e.cidr.contains(ip)) {
                        block_of.insert(*ip, entry.cidr);
                        chosen.insert(entry.cidr, Some(entry.stored.clone()));
                        continue;
                    }
                    let claimed: Vec<IpNet> = index.entries.iter().map(|e| e.cidr).collect();
                    if let Some(cidr) = free_block_for(pool, *ip, &claimed) {
                        block_of.insert(*ip, cidr);
                        chosen.insert(cidr, None);
                    }
                }
                _ => {
                    if let Some(cidr) = current.get(ip) {
                        block_of.insert(*ip, *cidr);
                        let claim = claims.get(cidr).cloned().flatten();
                        chosen.insert(*cidr, claim);
                    }
                }
            }
        }
        let cidrs: BTreeSet<IpNet> = chosen.keys().copied().collect();
        let loaded = self
            .load_blocks_given_claims(&cidrs, chosen.into_values().collect())
            .await?;
        Ok(LocatedBlocks {
            block_of,
            loaded,
            mixed,
        })
    }

    /// The CIDR of the block each address lies in (or would get: see [`LocatedBlocks`]), for
    /// addresses inside the given enabled `pools`; others are left out. Whatever the block sizes:
    /// one batched read of the pools' mixed-sizes records, and one listing of the claim index only
    /// when a pool records a size change. What the CNI plugin checks a requested address against
    /// (the prefix its result reports) before it assigns it.
    ///
    /// # Errors
    /// Store failures; a corrupt record or claim index entry.
    pub async fn block_cidrs_holding(
        &self,
        pools: &[Pool],
        ips: &[IpAddr],
    ) -> Result<BTreeMap<IpAddr, IpNet>, IpamError> {
        let targets: Vec<(IpAddr, &Pool)> = ips
            .iter()
            .filter_map(|ip| {
                pools
                    .iter()
                    .find(|p| !p.disabled && p.cidr.contains(ip))
                    .map(|p| (*ip, p))
            })
            .collect();
        let involved: BTreeMap<&str, &Pool> =
            targets.iter().map(|(_, p)| (p.name.as_str(), *p)).collect();
        if involved.is_empty() {
            return Ok(BTreeMap::new());
        }
        let reads: Vec<Read> = involved
            .keys()
            .map(|name| Read::Get(mixed_sizes_key(name)))
            .collect();
        let mut results = self.store.read_many(&reads).await?.into_iter();
        let mut mixed = BTreeSet::new();
        for (name, pool) in &involved {
            let kv = next_got(&mut results)?;
            if mixed_record_for(pool, kv.as_ref())?.is_some() {
                mixed.insert(*name);
            }
        }
        let claimed: Vec<IpNet> = if mixed.is_empty() {
            Vec::new()
        } else {
            self.claim_index()
                .await?
                .entries
                .into_iter()
                .map(|e| e.cidr)
                .collect()
        };
        let mut found = BTreeMap::new();
        for (ip, pool) in targets {
            let cidr = if mixed.contains(pool.name.as_str()) {
                claimed
                    .iter()
                    .find(|c| c.contains(&ip))
                    .copied()
                    .or_else(|| free_block_for(pool, ip, &claimed))
            } else {
                pool.block_containing(ip)
            };
            if let Some(cidr) = cidr {
                found.insert(ip, cidr);
            }
        }
        Ok(found)
    }

    /// For a release by address: each request paired with the block its address lies in
    /// (whatever the block's size), the addresses in no pool, and the blocks found — in the same
    /// round trips as reading exact CIDRs when no pool involved has mixed sizes.
    ///
    /// # Errors
    /// As [`locate_blocks`](Ipam::locate_blocks).
    #[allow(clippy::type_complexity)]
    pub(crate) async fn locate_release_targets(
        &self,
        pools: &[Stored<Pool>],
        requests: &[ReleaseRequest],
    ) -> Result<
        (
            Vec<(ReleaseRequest, IpNet)>,
            Vec<IpAddr>,
            BTreeMap<IpNet, Stored<Block>>,
        ),
        IpamError,
    > {
        let mut in_pools: Vec<(IpAddr, &Pool)> = Vec::new();
        let mut outside = Vec::new();
        for request in requests {
            match pools.iter().find(|p| p.value.cidr.contains(&request.ip)) {
                Some(pool) => in_pools.push((request.ip, &pool.value)),
                None => outside.push(request.ip),
            }
        }
        let located = self.locate_blocks(&in_pools).await?;
        let targets = requests
            .iter()
            .filter_map(|r| located.block_of.get(&r.ip).map(|cidr| (*r, *cidr)))
            .collect();
        Ok((targets, outside, located.loaded.found))
    }

    /// The mixed-sizes records of `pools` that apply, by pool name, in one batched read.
    pub(crate) async fn mixed_records(
        &self,
        pools: &[&Stored<Pool>],
    ) -> Result<BTreeMap<String, KeyValue>, IpamError> {
        if pools.is_empty() {
            return Ok(BTreeMap::new());
        }
        let reads: Vec<Read> = pools
            .iter()
            .map(|p| Read::Get(mixed_sizes_key(&p.value.name)))
            .collect();
        let mut found = BTreeMap::new();
        let mut results = self.store.read_many(&reads).await?.into_iter();
        for pool in pools {
            let kv = next_got(&mut results)?;
            if mixed_record_for(&pool.value, kv.as_ref())?.is_some() {
                if let Some(kv) = kv {
                    found.insert(pool.value.name.clone(), kv);
                }
            }
        }
        Ok(found)
    }

    /// The names of `pools` that record a block size change (their blocks may have mixed sizes).
    pub(crate) async fn pools_with_mixed_sizes(
        &self,
        pools: &[Stored<Pool>],
    ) -> Result<BTreeSet<String>, IpamError> {
        let records = self.store.list(&mixed_sizes_dir()).await?;
        let mut mixed = BTreeSet::new();
        for pool in pools {
            let key = mixed_sizes_key(&pool.value.name);
            let kv = records.iter().find(|kv| kv.key == key);
            if mixed_record_for(&pool.value, kv)?.is_some() {
                mixed.insert(pool.value.name.clone());
            }
        }
        Ok(mixed)
    }

    // -----------------------------------------------------------------------------------------
    // Block-size change
    // -----------------------------------------------------------------------------------------

    /// [`set_pool`](Ipam::set_pool) with a new block size: the pool and its mixed-sizes record
    /// (the old size added) change in one compare-and-swap serialised with every other pool
    /// write. Every assignment commits on the pool generation this raises (or, a store without
    /// one, the revision of the pool it used), so no block of the old size is claimed once this
    /// commits; existing blocks keep their size and drain.
    pub(crate) async fn change_pool_with_block_size(
        &self,
        name_or_cidr: &str,
        change: &PoolChange,
        block_size: u8,
    ) -> Result<Pool, IpamError> {
        self.retrying(|| async {
            let (pools, generation) = self.read_pools_and_generation().await?;
            let found = find_pool(&pools, name_or_cidr)?;
            validate_block_size(&found.value, block_size)?;
            let mut pool = found.value.clone();
            change.apply_to(&mut pool);
            pool.block_size = block_size;
            if pool == found.value {
                return Ok(Attempt::Done(pool));
            }
            let mut plan = self.plan();
            self.bump_pool_generation(&mut plan, generation)?;
            plan.expect(&found.key, Some(found.revision));
            plan.put(&found.key, encode(&pool)?);
            if pool.block_size != found.value.block_size {
                let key = mixed_sizes_key(&pool.name);
                let read = self.store.get(&key).await?;
                let mut record =
                    mixed_record_for(&found.value, read.as_ref())?.unwrap_or(MixedBlockSizes {
                        cidr: pool.cidr,
                        former_sizes: BTreeSet::new(),
                    });
                record.former_sizes.insert(found.value.block_size);
                plan.expect(&key, read.as_ref().map(|kv| kv.revision));
                plan.put(&key, encode(&record)?);
            }
            self.commit_plan(plan, pool).await
        })
        .await
    }

    // -----------------------------------------------------------------------------------------
    // Split
    // -----------------------------------------------------------------------------------------

    /// Replaces a pool by `parts` sub-pools of equal size (`parts` a power of two, 2 to
    /// [`MAX_SPLIT_PARTS`]; each part at least one block large), named as Calico's
    /// `calicoctl ipam split` names them: `split-<name>-<i>`. Each keeps the pool's block size,
    /// node selector, assignment mode, allowed uses and disabled flag (and its mixed-sizes
    /// record). Blocks stay where they are: a block belongs to the pool whose CIDR contains it.
    /// Namespace pools settings naming the pool (by name or CIDR) are rewritten to name every
    /// sub-pool. All in one transaction conditioned on the pool generation, the pool, each
    /// namespace setting and the claim index entries that were checked: an assignment racing it
    /// either committed on the old pool before, or retries and finds the sub-pools.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for a bad `parts`, parts smaller than a block, or a block of
    /// a former size larger than a part; [`IpamError::PoolExists`] when a sub-pool name is taken;
    /// [`IpamError::PoolNotFound`]; [`IpamError::TooLarge`]; store failures.
    pub async fn split_pool(&self, name_or_cidr: &str, parts: u32) -> Result<PoolSplit, IpamError> {
        if parts < 2 || !parts.is_power_of_two() || parts > MAX_SPLIT_PARTS {
            return Err(IpamError::invalid(format!(
                "a pool is split into a power of two parts, 2 to {MAX_SPLIT_PARTS} (got {parts})"
            )));
        }
        self.retrying(|| self.try_split_pool(name_or_cidr, parts))
            .await
    }

    async fn try_split_pool(
        &self,
        name_or_cidr: &str,
        parts: u32,
    ) -> Result<Attempt<PoolSplit>, IpamError> {
        let results = self
            .store
            .read_many(&[
                // The generation before the pools, as every pool write reads them.
                Read::Get(keys::pool_generation()),
                Read::List(keys::pools_dir()),
                Read::List(keys::claims_dir()),
                Read::List(crate::model::namespaces::namespaces_dir()),
            ])
            .await?;
        let mut results = results.into_iter();
        let generation = next_got(&mut results)?;
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let claims = next_listed(&mut results)?;
        let namespaces = next_listed(&mut results)?;
        let found = find_pool(&pools, name_or_cidr)?;
        let old = found.value.clone();
        let sub_cidrs = split_cidr(&old, parts)?;
        let mixed_key = mixed_sizes_key(&old.name);
        let mixed_read = self.store.get(&mixed_key).await?;
        let mixed = mixed_record_for(&old, mixed_read.as_ref())?;

        let sub_prefix = sub_cidrs[0].prefix_len();
        let mut blocks = 0u64;
        let claims_prefix = keys::claims_dir();
        for kv in &claims {
            let Some(cidr) = kv
                .key
                .strip_prefix(&claims_prefix)
                .and_then(keys::parse_cidr_segment)
            else {
                continue;
            };
            if !old.cidr.contains(&cidr.network()) {
                continue;
            }
            blocks += 1;
            if cidr.prefix_len() < sub_prefix {
                return Err(IpamError::invalid(format!(
                    "block {cidr} (a former block size of pool {}) is larger than a /{sub_prefix} \
                     part: split the pool once that block is released, or into fewer parts",
                    old.name
                )));
            }
        }

        let mut plan = self.plan();
        self.bump_pool_generation(&mut plan, generation)?;
        plan.expect(&found.key, Some(found.revision));
        plan.delete(&found.key);
        let mut created = Vec::with_capacity(sub_cidrs.len());
        for (index, cidr) in sub_cidrs.iter().enumerate() {
            let name = format!("split-{}-{index}", old.name);
            validate_pool_name(&name)?;
            if pools.iter().any(|p| p.value.name == name) {
                return Err(IpamError::PoolExists(name));
            }
            let sub = Pool {
                name,
                cidr: *cidr,
                ..old.clone()
            };
            let key = keys::pool(&sub.name);
            plan.expect(&key, None);
            plan.put(&key, encode(&sub)?);
            if let Some(record) = &mixed {
                let sub_record = MixedBlockSizes {
                    cidr: *cidr,
                    former_sizes: record.former_sizes.clone(),
                };
                plan.put(&mixed_sizes_key(&sub.name), encode(&sub_record)?);
            }
            created.push(sub);
        }
        if let Some(kv) = &mixed_read {
            plan.expect(&kv.key, Some(kv.revision));
            plan.delete(&kv.key);
        }

        let names: Vec<String> = created.iter().map(|p| p.name.clone()).collect();
        let mut rewritten = Vec::new();
        let namespaces_prefix = namespace_key("");
        for kv in namespaces {
            let Some(namespace) = kv.key.strip_prefix(&namespaces_prefix) else {
                continue;
            };
            let setting: NamespacePools = decode(&kv.key, &kv.value)?;
            let replace = |list: &[String]| -> Vec<String> {
                let mut out: Vec<String> = Vec::new();
                for entry in list {
                    let with: Vec<String> = if entry_names_pool(entry, &old) {
                        names.clone()
                    } else {
                        vec![entry.clone()]
                    };
                    for name in with {
                        if !out.contains(&name) {
                            out.push(name);
                        }
                    }
                }
                out
            };
            let updated = NamespacePools {
                ipv4_pools: replace(&setting.ipv4_pools),
                ipv6_pools: replace(&setting.ipv6_pools),
            };
            if updated != setting {
                plan.expect(&kv.key, Some(kv.revision));
                plan.put(&kv.key, encode(&updated)?);
                rewritten.push(namespace.to_owned());
            }
        }
        self.commit_plan(
            plan,
            PoolSplit {
                pool: old,
                pools: created,
                blocks,
                namespaces: rewritten,
            },
        )
        .await
    }
}

/// Refuses a block size out of the family's range or larger than the pool.
fn validate_block_size(pool: &Pool, block_size: u8) -> Result<(), IpamError> {
    let range = match pool.family() {
        Family::V4 => V4_BLOCK_SIZES,
        Family::V6 => V6_BLOCK_SIZES,
    };
    if !range.contains(&block_size) {
        return Err(IpamError::invalid(format!(
            "block size /{block_size} is out of range for {} (allowed /{} to /{})",
            pool.family(),
            range.start(),
            range.end()
        )));
    }
    if block_size < pool.cidr.prefix_len() {
        return Err(IpamError::invalid(format!(
            "pool {} is smaller than one /{block_size} block",
            pool.cidr
        )));
    }
    Ok(())
}

/// The `parts` equal sub-networks of `pool`, each at least one block large.
fn split_cidr(pool: &Pool, parts: u32) -> Result<Vec<IpNet>, IpamError> {
    let sub_prefix = pool.cidr.prefix_len() + parts.trailing_zeros() as u8;
    if sub_prefix > pool.block_size {
        return Err(IpamError::invalid(format!(
            "pool {} ({}) cannot be split into {parts}: each part (/{sub_prefix}) would be smaller \
             than one /{} block",
            pool.name, pool.cidr, pool.block_size
        )));
    }
    let step = 1u128 << (host_bits(pool.family()) - sub_prefix);
    let start = ip_to_u128(pool.cidr.network());
    (0..u128::from(parts))
        .map(|i| {
            IpNet::new(u128_to_ip(pool.family(), start + i * step), sub_prefix)
                .map_err(|e| IpamError::Internal(format!("sub-pool {i} of {}: {e}", pool.cidr)))
        })
        .collect()
}
