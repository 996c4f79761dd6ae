//! Release: addresses, handles, an attachment's chosen addresses, and a removed host.

use super::{
    allocations_of_handle, decode_stored, learn_apart_from_handle, next_got, next_listed,
    AllocationInfo, Attempt, ChosenRelease, Ipam, Plan, ReleaseOutcome, ReleaseRequest, Stored,
    WorkingBlock, RELEASES_PER_TXN,
};
use crate::allocator::upgrade::format_read;
use crate::kv::{Read, Revision};
use crate::model::error::IpamError;
use crate::model::{encode, keys, validate_handle, validate_host, Block, Handle};
use ipnet::IpNet;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

impl Ipam {
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
        let mut results = self
            .store
            .read_many(&[
                Read::List(keys::pools_dir()),
                Read::Get(keys::config()),
                format_read(),
            ])
            .await?
            .into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let (config, _) = Self::decode_config(next_got(&mut results)?)?;
        self.learn_format(next_got(&mut results)?).await?;
        let lifetime = self.lifetime(&config);
        let mut outcome = ReleaseOutcome::default();
        // The block each address lies in, whatever its size (resize.rs).
        let (targets, outside_pools, mut found) =
            self.locate_release_targets(&pools, requests).await?;
        outcome.not_allocated.extend(outside_pools);
        // Who holds each address, for its handle: the owner keys of the addresses released that
        // the blocks keep apart (those keys only).
        let mut wanted: BTreeMap<IpNet, BTreeSet<u32>> = BTreeMap::new();
        for (request, cidr) in &targets {
            if let Some(ordinal) = found.get(cidr).and_then(|s| s.value.ordinal_of(request.ip)) {
                wanted.entry(*cidr).or_default().insert(ordinal);
            }
        }
        self.load_owner_keys_of(
            found.iter_mut().filter_map(|(cidr, stored)| {
                wanted.remove(cidr).map(|ordinals| (stored, ordinals))
            }),
        )
        .await?;
        let mut working: BTreeMap<IpNet, WorkingBlock> = found
            .into_iter()
            .map(|(cidr, stored)| (cidr, WorkingBlock::from_stored(stored)))
            .collect();
        // Per handle, the addresses (block and ordinal) released from it.
        let mut per_handle: BTreeMap<String, Vec<(IpNet, u32)>> = BTreeMap::new();
        // Pools in which an address's block was not found: if one changed since it was read (a
        // split, a block size change), the block was looked for in the wrong place.
        let mut pools_of_absent_blocks: BTreeMap<&str, Revision> = BTreeMap::new();
        for (request, cidr) in targets {
            let Some(entry) = working.get_mut(&cidr) else {
                if let Some(pool) = pools.iter().find(|p| p.value.cidr.contains(&request.ip)) {
                    pools_of_absent_blocks.insert(&pool.key, pool.revision);
                }
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
            if let Some(attribute) = entry.block.release_ordinal(ordinal, lifetime)? {
                per_handle
                    .entry(attribute.handle)
                    .or_default()
                    .push((cidr, ordinal));
            }
            entry.dirty = true;
            outcome.released.push(request.ip);
        }
        if self.any_pool_changed(&pools_of_absent_blocks).await? {
            return Ok(Attempt::Conflict);
        }
        let mut plan = self.plan();
        self.release_from_handles(&mut plan, &per_handle).await?;
        for working in working.values() {
            plan.write_block(working)?;
        }
        outcome.released.sort();
        outcome.not_allocated.sort();
        outcome.sequence_mismatch.sort();
        self.commit_plan(plan, outcome).await
    }

    /// Whether any of these pools (key and the revision read) is gone or was rewritten since: one
    /// batched read, none when `pools` is empty.
    async fn any_pool_changed(&self, pools: &BTreeMap<&str, Revision>) -> Result<bool, IpamError> {
        if pools.is_empty() {
            return Ok(false);
        }
        let reads: Vec<Read> = pools.keys().map(|k| Read::Get((*k).to_owned())).collect();
        for ((_, revision), result) in pools.iter().zip(self.store.read_many(&reads).await?) {
            if result.into_got()?.map(|kv| kv.revision) != Some(*revision) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Adds to `plan` the handle updates for releasing, per handle, the listed addresses (block
    /// and ordinal).
    async fn release_from_handles(
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
            for (cidr, ordinal) in releases {
                handle.let_go(*cidr, *ordinal);
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
        let mut results = self
            .store
            .read_many(&[
                Read::Get(key.clone()),
                Read::Get(keys::config()),
                format_read(),
            ])
            .await?
            .into_iter();
        let handle_kv = next_got(&mut results)?;
        let (config, _) = Self::decode_config(next_got(&mut results)?)?;
        self.learn_format(next_got(&mut results)?).await?;
        let lifetime = self.lifetime(&config);
        let Some(kv) = handle_kv else {
            return Ok(Attempt::Done(Vec::new()));
        };
        let stored: Stored<Handle> = decode_stored(kv)?;
        let cidrs: BTreeSet<IpNet> = stored.value.blocks.keys().copied().collect();
        let mut released = Vec::new();
        let mut plan = self.plan();
        for (_, block) in self.load_blocks(&cidrs).await? {
            let mut working = WorkingBlock::from_stored(block);
            learn_apart_from_handle(&mut working.block, handle_id, &stored.value);
            for ordinal in working.block.ordinals_of_handle(handle_id)? {
                released.push(working.block.ip_of(ordinal));
                working.block.release_ordinal(ordinal, lifetime)?;
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
    /// handle's blocks are the host's blocks with room (the common case): one batched read of the
    /// handle and of the host's open blocks, then the transaction. Its reads grow with the host's
    /// blocks that have room, never with its full ones: a handle's block that is full is read by
    /// key, one more read; a block affine elsewhere costs two more.
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
        // The first attempt may be answered from the store's cache; it stands only if it
        // released something (Ipam::attempt_through_cache).
        let may_use_cache = AtomicBool::new(true);
        self.retrying(|| {
            self.attempt_through_cache(
                &may_use_cache,
                |outcome: &ChosenRelease| !outcome.released.is_empty(),
                |use_cache, from_cache| {
                    self.try_release_chosen(handle_id, host, &choose, use_cache, from_cache)
                },
            )
        })
        .await
    }

    async fn try_release_chosen<F>(
        &self,
        handle_id: &str,
        host: &str,
        choose: &F,
        use_cache: bool,
        from_cache: Arc<AtomicBool>,
    ) -> Result<Attempt<ChosenRelease>, IpamError>
    where
        F: Fn(&[AllocationInfo]) -> Vec<IpAddr>,
    {
        let key = keys::handle(handle_id);
        let mut reads = vec![
            Read::Get(key.clone()),
            Read::List(keys::host_open_blocks_dir(host)),
            Read::Get(keys::config()),
            format_read(),
        ];
        reads.extend(self.activity_reads());
        let answered = self.store.read_many_cached(&reads, use_cache).await?;
        from_cache.store(answered.from_cache, Ordering::Relaxed);
        let validators = answered.validators;
        let mut results = answered.results.into_iter();
        let handle_kv = next_got(&mut results)?;
        let open_blocks = next_listed(&mut results)?;
        let (config, _) = Self::decode_config(next_got(&mut results)?)?;
        self.learn_format(next_got(&mut results)?).await?;
        let activity_unchanged = self.activity_unchanged(&mut results)?;
        let lifetime = self.lifetime(&config);
        let Some(handle_kv) = handle_kv else {
            return Ok(Attempt::Done(ChosenRelease::default()));
        };
        let stored: Stored<Handle> = decode_stored(handle_kv)?;
        let wanted: BTreeSet<IpNet> = stored.value.blocks.keys().copied().collect();
        let mut working: BTreeMap<IpNet, WorkingBlock> = BTreeMap::new();
        for kv in open_blocks {
            let block: Stored<Block> = decode_stored(kv)?;
            if wanted.contains(&block.value.cidr) {
                working.insert(block.value.cidr, WorkingBlock::from_stored(block));
            }
        }
        let not_open: BTreeSet<IpNet> = wanted
            .iter()
            .filter(|c| !working.contains_key(c))
            .copied()
            .collect();
        for (cidr, block) in self.load_host_blocks(host, &not_open).await? {
            working.insert(cidr, WorkingBlock::from_stored(block));
        }
        let mut held = Vec::new();
        for entry in working.values_mut() {
            learn_apart_from_handle(&mut entry.block, handle_id, &stored.value);
            held.extend(allocations_of_handle(&entry.block, handle_id)?);
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
            entry.block.release_ordinal(ordinal, lifetime)?;
            entry.dirty = true;
            handle.let_go(info.block, ordinal);
            released.push(info.ip);
        }
        if released.is_empty() {
            return Ok(Attempt::Done(ChosenRelease { held, released }));
        }
        let mut plan = self.plan();
        plan.activity_unchanged = activity_unchanged;
        for entry in working.values().filter(|w| w.dirty) {
            plan.write_block(entry)?;
        }
        plan.expect(&key, Some(stored.revision));
        if released.len() == held.len() {
            plan.delete(&key);
        } else {
            plan.put(&key, encode(&handle)?);
        }
        plan.carry_validators(validators, from_cache.load(Ordering::Relaxed));
        self.commit_plan(plan, ChosenRelease { held, released })
            .await
    }
}
