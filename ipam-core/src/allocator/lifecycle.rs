//! Block lifecycle: taking over other hosts' long-empty blocks when a pool has no unclaimed block
//! left, and releasing empty blocks a host no longer needs.

use super::full_pools::{self, FullPoolMark};
use super::{
    decode_each, decode_stored, next_got, next_listed, Attempt, ClaimIndex, IndexedClaim, Ipam,
    Stored, UndecodableObject, WorkingBlock,
};
use crate::kv::{Condition, KeyValue, Op, Read, Txn};
use crate::model::error::IpamError;
use crate::model::reservations::ReservedRanges;
use crate::model::{decode, keys, Block, Family, IpamConfig, Lifetime, Pool};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Why [`Ipam::release_empty_blocks`] releases (or would release) an empty block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EmptyBlockReason {
    /// The host has a newer block of the same family.
    BeyondNewest,
    /// No enabled pool that contains the block selects its host any more.
    PoolNoLongerSelects,
    /// Nobody owns it (it stayed only while addresses in it were cooling).
    Unowned,
}

impl std::fmt::Display for EmptyBlockReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EmptyBlockReason::BeyondNewest => "beyond-newest",
            EmptyBlockReason::PoolNoLongerSelects => "pool-no-longer-selects",
            EmptyBlockReason::Unowned => "unowned",
        })
    }
}

/// One empty block [`Ipam::release_empty_blocks`] found releasable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmptyBlock {
    /// The block.
    pub cidr: IpNet,
    /// Its owner, if any.
    pub host: Option<String>,
    /// The pool containing it, if any.
    pub pool: Option<String>,
    /// When it became empty (seconds since the Unix epoch); 0 when a format 3 store never said.
    pub empty_since: u64,
    /// Why it is releasable.
    pub reason: EmptyBlockReason,
    /// Whether it was released (only with `apply`; false when it changed meanwhile).
    pub released: bool,
}

/// Which empty blocks [`Ipam::release_empty_blocks`] considers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmptyBlockFilter {
    /// Only blocks empty for at least this many seconds.
    pub older_than_seconds: u64,
    /// Only blocks whose pools no longer select their host (what a selector or label change
    /// releases).
    pub only_unselected: bool,
}

impl Ipam {
    /// The oldest empty block of another host among `candidates` that has been empty for at least
    /// the configured reclaim age, taken over for `host`: what auto-assign does when its pools have
    /// no unclaimed block left (Calico's empty-block reclaim). The returned block is to be written
    /// in the caller's transaction, guarded by the revision it was read at. Blocks `usable` rejects
    /// (entirely reserved ones) are passed over. One read.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn take_over_empty_block(
        &self,
        index: &ClaimIndex,
        candidates: &[&Stored<Pool>],
        host: &str,
        family: Family,
        config: &IpamConfig,
        lifetime: Lifetime,
        working: &BTreeMap<IpNet, WorkingBlock>,
        usable: impl Fn(&IpNet) -> bool,
    ) -> Result<Option<WorkingBlock>, IpamError> {
        /// Blocks read at once: a few, in case some changed since the index was listed.
        const TAKEOVER_READ: usize = 4;
        let cutoff = lifetime
            .now
            .saturating_sub(u64::from(config.empty_block_reclaim_seconds));
        let mut eligible: Vec<(u64, &IndexedClaim)> = index
            .entries
            .iter()
            .filter(|e| Family::of_net(&e.cidr) == family)
            .filter(|e| e.claim.affinity.as_deref() != Some(host))
            .filter(|e| !working.contains_key(&e.cidr) && usable(&e.cidr))
            .filter(|e| {
                candidates
                    .iter()
                    .any(|p| p.value.cidr.contains(&e.cidr.network()))
            })
            .filter_map(|e| {
                e.claim
                    .empty_from(&e.cidr, lifetime.cooldown_seconds)
                    .filter(|from| *from <= cutoff)
                    .map(|from| (from, e))
            })
            .collect();
        eligible.sort_by_key(|(from, e)| (*from, e.cidr.network()));
        for chunk in eligible.chunks(TAKEOVER_READ) {
            let cidrs: BTreeSet<IpNet> = chunk.iter().map(|(_, e)| e.cidr).collect();
            let claims = chunk
                .iter()
                .map(|(_, e)| (e.cidr, e.stored.clone()))
                .collect::<BTreeMap<_, _>>()
                .into_values()
                .map(Some)
                .collect();
            let loaded = self.load_blocks_given_claims(&cidrs, claims).await?;
            for (_, entry) in chunk {
                let Some(stored) = loaded.found.get(&entry.cidr) else {
                    continue;
                };
                let block = &stored.value;
                let old_enough = block
                    .empty_from(lifetime.cooldown_seconds)
                    .is_some_and(|from| from <= cutoff);
                if block.affinity.as_deref() == Some(host) || !old_enough {
                    continue;
                }
                let mut taken = WorkingBlock::from_stored(stored.clone());
                taken.block.finish_cooling(lifetime);
                tracing::info!(
                    block = %block.cidr,
                    from = block.affinity.as_deref().unwrap_or("-"),
                    to = host,
                    "taking over an empty block: its pools have no unclaimed block left"
                );
                taken.block.affinity = Some(host.to_owned());
                taken.block.claimed_at = Some(lifetime.now);
                taken.block.emptied_at = Some(lifetime.now);
                taken.dirty = true;
                return Ok(Some(taken));
            }
        }
        Ok(None)
    }

    /// The empty blocks hosts no longer need, released when `apply` is set: per host and family,
    /// every empty block except the host's newest block; empty blocks in pools that no longer
    /// select their host (or in no enabled pool); and unowned blocks whose cooling addresses have
    /// cooled. A block counts only when it has been empty for `filter.older_than_seconds` and none
    /// of its addresses is cooling. A host whose labels object cannot be decoded is taken as still
    /// selected by its pools' selectors (its newest block stays); the other hosts are unaffected. Each release is its own transaction, guarded by the block's
    /// revision: a block that changed since it was read is left alone (reported unreleased).
    ///
    /// # Errors
    /// Store failures; corrupt objects (before anything is released).
    pub async fn release_empty_blocks(
        &self,
        filter: EmptyBlockFilter,
        apply: bool,
    ) -> Result<Vec<EmptyBlock>, IpamError> {
        Ok(self.find_empty_blocks(filter, apply, false).await?.0)
    }

    /// [`release_empty_blocks`](Self::release_empty_blocks) past the block objects it cannot
    /// decode, named beside what it found (sorted by key): what such a block holds is unknown, so
    /// it is never released, and while a host has one, none of that host's empty blocks of the
    /// same family is taken to be beyond its newest (the damaged one may be its newest). Every
    /// other block is judged as usual.
    ///
    /// # Errors
    /// Store failures; a pool, the config, a reservation or a claim index entry that cannot be
    /// decoded; a block key that names no block.
    pub async fn release_empty_blocks_each(
        &self,
        filter: EmptyBlockFilter,
        apply: bool,
    ) -> Result<(Vec<EmptyBlock>, Vec<UndecodableObject>), IpamError> {
        self.find_empty_blocks(filter, apply, true).await
    }

    async fn find_empty_blocks(
        &self,
        filter: EmptyBlockFilter,
        apply: bool,
        past_undecodable: bool,
    ) -> Result<(Vec<EmptyBlock>, Vec<UndecodableObject>), IpamError> {
        // The claim index (one small entry per block: owner, free count, when it became empty)
        // says which blocks may be empty; only those, and the blocks of their hosts (to know
        // each host's newest), are read with their values. A store with no empty block costs
        // one batched read of small entries, however many blocks it holds.
        let mut results = self
            .store
            .read_many(&[
                Read::List(keys::pools_dir()),
                Read::Get(keys::config()),
                Read::List(keys::claims_dir()),
                Read::List(crate::model::nodes::nodes_dir()),
                Read::List(keys::full_pool_marks_dir()),
                Read::Get(keys::block_releases()),
                Read::List(keys::reservations_dir()),
            ])
            .await?
            .into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let (config, _) = Self::decode_config(next_got(&mut results)?)?;
        let lifetime = self.lifetime(&config);
        let claims = next_listed(&mut results)?;
        let nodes = next_listed(&mut results)?;
        let marks = next_listed(&mut results)?;
        let counter = next_got(&mut results)?;
        let reserved = ReservedRanges::from_listed(&next_listed(&mut results)?)?;
        if apply {
            self.forget_wrong_full_pool_marks(&pools, &claims, &marks, counter.as_ref(), &reserved)
                .await?;
        }
        // A node whose labels object does not decode (`check` reports it) stops nobody else's
        // release: its labels are unknown, so no pool is taken to have stopped selecting it.
        let mut labels: BTreeMap<String, Option<BTreeMap<String, String>>> = BTreeMap::new();
        for kv in nodes {
            if let Some(host) = kv.key.strip_prefix(&crate::model::nodes::nodes_dir()) {
                labels.insert(
                    host.to_owned(),
                    crate::model::nodes::decode_node_labels(&kv.key, Some(&kv)).ok(),
                );
            }
        }
        let cutoff = lifetime.now.saturating_sub(filter.older_than_seconds);
        let (blocks, undecodable) = self
            .blocks_that_may_be_empty(claims, lifetime, cutoff, past_undecodable)
            .await?;
        // The hosts and families of blocks that cannot be decoded: one of them may be the
        // host's newest.
        let mut unknown_newest: BTreeSet<(&str, Family)> = BTreeSet::new();
        for object in &undecodable {
            match object.block() {
                Some((Some(host), cidr)) => {
                    unknown_newest.insert((host, Family::of_net(&cidr)));
                }
                Some((None, _)) => {}
                None => return Err(object.clone().into_error()),
            }
        }
        let no_labels = BTreeMap::new();
        // Each host's newest block per family (latest claim, then highest address).
        let mut newest: BTreeMap<(&str, Family), (u64, IpNet)> = BTreeMap::new();
        for stored in &blocks {
            let block = &stored.value;
            if let Some(host) = block.affinity.as_deref() {
                let key = (host, Family::of_net(&block.cidr));
                let rank = (block.claimed_at.unwrap_or(0), block.cidr);
                if newest.get(&key).is_none_or(|kept| rank > *kept) {
                    newest.insert(key, rank);
                }
            }
        }
        let mut found = Vec::new();
        for stored in &blocks {
            let block = &stored.value;
            let Some(empty_since) = block
                .empty_from(lifetime.cooldown_seconds)
                .filter(|from| *from <= cutoff)
            else {
                continue;
            };
            let pool = pools
                .iter()
                .find(|p| p.value.cidr.contains(&block.cidr.network()));
            let reason = match block.affinity.as_deref() {
                None => EmptyBlockReason::Unowned,
                Some(host) => {
                    let selected = pool.is_some_and(|p| {
                        !p.value.disabled
                            && match labels.get(host) {
                                None => p.value.node_selector.matches(&no_labels),
                                Some(Some(host_labels)) => {
                                    p.value.node_selector.matches(host_labels)
                                }
                                Some(None) => true,
                            }
                    });
                    let family = Family::of_net(&block.cidr);
                    if !selected {
                        EmptyBlockReason::PoolNoLongerSelects
                    } else if !unknown_newest.contains(&(host, family))
                        && newest
                            .get(&(host, family))
                            .is_some_and(|(_, cidr)| *cidr != block.cidr)
                    {
                        EmptyBlockReason::BeyondNewest
                    } else {
                        continue;
                    }
                }
            };
            if filter.only_unselected && reason != EmptyBlockReason::PoolNoLongerSelects {
                continue;
            }
            let released = apply && self.release_empty_block(stored, lifetime).await?;
            if released {
                tracing::info!(block = %block.cidr, host = block.affinity.as_deref().unwrap_or("-"), %reason, "released an empty block");
            }
            found.push(EmptyBlock {
                cidr: block.cidr,
                host: block.affinity.clone(),
                pool: pool.map(|p| p.value.name.clone()),
                empty_since,
                reason,
                released,
            });
        }
        Ok((found, undecodable))
    }

    /// Puts the block-release counter, so that no full-pool mark is believed any more, when a
    /// believed mark's pool has a block with no entry in `claims` (the whole claim index, read
    /// in one snapshot with `marks`, `counter` and `reserved`) that reservations leave room in:
    /// a writer that keeps no marks released it. Unclaimed blocks wholly reserved do not count
    /// (a search skips them too, and marks the pool full again). Conditioned on the counter as
    /// read; a counter that moved meanwhile already did the same.
    async fn forget_wrong_full_pool_marks(
        &self,
        pools: &[Stored<Pool>],
        claims: &[KeyValue],
        marks: &[KeyValue],
        counter: Option<&KeyValue>,
        reserved: &ReservedRanges,
    ) -> Result<(), IpamError> {
        let releases = full_pools::releases_revision(counter);
        let claimed: BTreeSet<IpNet> = claims
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(&keys::claims_dir()))
            .filter_map(keys::parse_cidr_segment)
            .collect();
        let wrong = pools.iter().find(|pool| {
            let mark = marks
                .iter()
                .find(|kv| kv.key == full_pools::mark_key(&pool.value));
            if !FullPoolMark::believed(mark, &pool.value, releases) {
                return false;
            }
            full_pools::holds_an_unclaimed_usable_block(&pool.value, &claimed, reserved)
        });
        let Some(pool) = wrong else {
            return Ok(());
        };
        let key = keys::block_releases();
        let txn = Txn::new()
            .when(match counter {
                Some(kv) => Condition::at_revision(&key, kv.revision),
                None => Condition::absent(&key),
            })
            .then(Op::put(&key, b"{}".to_vec()));
        match self.store.commit(txn).await {
            Ok(_) => {
                tracing::info!(
                    pool = %pool.value.name,
                    "a pool marked full has an unclaimed block with room (a writer that keeps no \
                     marks released it, or a reservation on it went): no full-pool mark is \
                     believed until a search proves one again"
                );
                Ok(())
            }
            Err(e) if e.is_conflict() => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The blocks [`release_empty_blocks`](Self::release_empty_blocks) must look at, with their
    /// values: every block whose claim entry says it is empty since `cutoff` (never later than
    /// now) or earlier (or does not say: entries of format 1), and every block of the hosts those
    /// belong to (a host's newest block decides which of its empty blocks it no longer needs).
    async fn blocks_that_may_be_empty(
        &self,
        claims: Vec<KeyValue>,
        lifetime: Lifetime,
        cutoff: u64,
        past_undecodable: bool,
    ) -> Result<(Vec<Stored<Block>>, Vec<UndecodableObject>), IpamError> {
        let mut unowned: BTreeMap<IpNet, KeyValue> = BTreeMap::new();
        let mut hosts: BTreeSet<String> = BTreeSet::new();
        for kv in claims {
            let IndexedClaim {
                cidr,
                claim,
                stored,
            } = IndexedClaim::decode(kv)?;
            let may_be_empty = claim.free.is_none()
                || claim
                    .empty_from(&cidr, lifetime.cooldown_seconds)
                    .is_some_and(|from| from <= cutoff);
            if !may_be_empty {
                continue;
            }
            match claim.affinity {
                Some(host) => {
                    hosts.insert(host);
                }
                None => {
                    unowned.insert(cidr, stored);
                }
            }
        }
        let mut blocks = Vec::new();
        let mut undecodable = Vec::new();
        if !hosts.is_empty() {
            let reads: Vec<Read> = hosts
                .iter()
                .map(|host| Read::List(keys::host_blocks_dir(host)))
                .collect();
            for result in self.store.read_many(&reads).await? {
                let listed = result.into_listed()?;
                if past_undecodable {
                    blocks.extend(decode_each(listed, decode::<Block>, &mut undecodable));
                } else {
                    for kv in listed {
                        blocks.push(decode_stored(kv)?);
                    }
                }
            }
        }
        if !unowned.is_empty() {
            let cidrs: BTreeSet<IpNet> = unowned.keys().copied().collect();
            let claims = unowned.into_values().map(Some).collect();
            let loaded = if past_undecodable {
                self.load_blocks_given_claims_each(&cidrs, claims).await?
            } else {
                self.load_blocks_given_claims(&cidrs, claims).await?
            };
            blocks.extend(loaded.found.into_values());
            undecodable.extend(loaded.undecodable);
        }
        undecodable.sort_by(|a, b| a.key.cmp(&b.key));
        Ok((blocks, undecodable))
    }

    /// Deletes one empty block if it is still as read; false when it changed meanwhile.
    async fn release_empty_block(
        &self,
        stored: &Stored<Block>,
        lifetime: Lifetime,
    ) -> Result<bool, IpamError> {
        let mut working = WorkingBlock::from_stored(stored.clone());
        working.block.finish_cooling(lifetime);
        if !working.block.is_empty() {
            return Ok(false);
        }
        working.block.affinity = None;
        working.dirty = true;
        let mut plan = self.plan();
        plan.write_block(&working)?;
        Ok(matches!(
            self.commit_plan(plan, ()).await?,
            Attempt::Done(())
        ))
    }
}
