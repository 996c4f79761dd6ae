//! Affinity: claiming and releasing blocks for a host.

use super::{
    decode_stored, Attempt, HostRelease, Ipam, ReleaseRequest, Stored, WorkingBlock, ATTR_NODE,
    BLOCKS_PER_TXN,
};
use crate::kv::KvError;
use crate::model::error::IpamError;
use crate::model::{keys, validate_host, Block, Pool};
use ipnet::IpNet;
use std::collections::BTreeSet;

impl Ipam {
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
        let mut plan = self.plan();
        // In a pool of mixed block sizes (resize.rs), a block of a former size may overlap the
        // wanted ones: refused, and the claim rewrites the pool's record so that no other claim
        // in the pool commits from the same snapshot.
        if let Some(record) = self.mixed_records(&[pool]).await?.remove(&pool.value.name) {
            let index = self.claim_index().await?;
            for wanted_cidr in &wanted {
                if let Some(other) = index.entries.iter().find(|e| {
                    e.cidr != *wanted_cidr
                        && (e.cidr.contains(&wanted_cidr.network())
                            || wanted_cidr.contains(&e.cidr.network()))
                }) {
                    return Err(IpamError::invalid(format!(
                        "block {wanted_cidr} overlaps block {}, of another block size of pool {}; \
                         claim blocks that do not overlap it",
                        other.cidr, pool.value.name
                    )));
                }
            }
            super::resize::guard_mixed_record(&mut plan, &record);
        }
        let mut existing = self.load_blocks_for_write(&wanted).await?;
        // A block without affinity that this host claims: the addresses it holds for other
        // nodes become borrowed, which their attributes tell.
        self.load_owner_keys(
            existing
                .found
                .values_mut()
                .filter(|stored| stored.value.affinity.is_none()),
        )
        .await?;
        plan.expect(&pool.key, Some(pool.revision));
        for block_cidr in &wanted {
            let working = match existing.found.get(block_cidr) {
                None => WorkingBlock::created(
                    *block_cidr,
                    Some(host.to_owned()),
                    existing.sequence_floor,
                    self.now(),
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
                        w.block.claimed_at = Some(self.now());
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
            let mut found = self.load_blocks(&BTreeSet::from([block])).await?;
            // The addresses it holds for other nodes become borrowed: their attributes tell.
            self.load_owner_keys(found.values_mut()).await?;
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
            let mut plan = self.plan();
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
    /// Store failures; [`IpamError::RetriesExhausted`]; [`IpamError::KeptConflicting`] when the
    /// host's blocks changed under every one of the retry policy's attempts (nothing more is
    /// written; blocks released before stay released).
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
        // Consecutive conflicts: each is a block another writer changed meanwhile. Retried with
        // the retry policy's backoff, up to its attempts, then reported naming the blocks.
        let mut conflicts = 0u32;
        let mut backoff = self.retry.base_backoff;
        loop {
            let mut host_blocks: Vec<Stored<Block>> = self
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
            // The addresses they hold for other nodes become borrowed: their attributes tell.
            let loaded = match self
                .load_owner_keys(host_blocks.iter_mut().take(take))
                .await
            {
                Err(IpamError::Store(KvError::Conflict { .. })) => false,
                other => {
                    other?;
                    true
                }
            };
            let (plan, deleted, unassigned) = loop {
                if !loaded {
                    // Named as the blocks this round would have released.
                    let named = host_blocks.iter().take(take).map(|b| b.value.cidr);
                    break (self.plan(), named.collect(), Vec::new());
                }
                let mut plan = self.plan();
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
            // A conflict here means a block changed: list again and carry on, within bounds.
            let outcome = if loaded {
                self.commit_plan(plan, ()).await?
            } else {
                Attempt::Conflict
            };
            if let Attempt::Done(()) = outcome {
                report.deleted_blocks.extend(deleted);
                report.unassigned_blocks.extend(unassigned);
                conflicts = 0;
                backoff = self.retry.base_backoff;
            } else {
                conflicts += 1;
                if conflicts >= self.retry.max_attempts {
                    let blocks: Vec<String> = deleted
                        .iter()
                        .chain(unassigned.iter())
                        .map(ToString::to_string)
                        .collect();
                    return Err(IpamError::KeptConflicting {
                        attempts: conflicts,
                        what: format!(
                            "the blocks of host {host:?} being released ({})",
                            blocks.join(", ")
                        ),
                    });
                }
                let jitter = rand::random::<f64>() + 0.5;
                tokio::time::sleep(backoff.mul_f64(jitter)).await;
                backoff = (backoff * 2).min(self.retry.max_backoff);
            }
        }
        Ok(report)
    }
}
