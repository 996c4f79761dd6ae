//! Pools: creating, changing, deleting and reading IP pools, and the IPAM config.

use super::{
    decode_each, decode_stored, next_got, next_listed, sort_pools, Attempt, Ipam, Plan, PoolChange,
    PoolDeletion, PoolPolicy, PoolSpec, ReleaseRequest, Stored, UndecodableObject,
};
use crate::kv::{Condition, KeyValue, Op, Read, Revision, Txn};
use crate::model::error::IpamError;
use crate::model::selector::Selector;
use crate::model::{
    decode, decode_pool, default_pool_name, encode, keys, validate_new_pool_range,
    validate_pool_name, AllowedUses, AssignmentMode, Block, Family, IpamConfig, Pool,
    DEFAULT_V4_BLOCK_SIZE, DEFAULT_V6_BLOCK_SIZE, V4_BLOCK_SIZES, V6_BLOCK_SIZES,
};
use ipnet::IpNet;
use std::collections::BTreeSet;

impl Ipam {
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

    /// Deletes the object of pool `name` when it cannot be decoded (damaged bytes, or written by
    /// a newer release), guarded by the revision read: nothing else is touched, so its blocks and
    /// their allocations stay, outside every pool until a pool holding them is added again.
    /// Returns the error the object gave.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an invalid name or a pool object that decodes (delete
    /// it with [`delete_pool`](Self::delete_pool)); [`IpamError::PoolNotFound`];
    /// [`IpamError::RetriesExhausted`]; store failures.
    pub async fn delete_undecodable_pool(&self, name: &str) -> Result<IpamError, IpamError> {
        validate_pool_name(name)?;
        let key = keys::pool(name);
        self.retrying(|| async {
            let mut results = self
                .store
                .read_many(&[Read::Get(key.clone()), Read::Get(keys::pool_generation())])
                .await?
                .into_iter();
            let Some(read) = next_got(&mut results)? else {
                return Err(IpamError::PoolNotFound(name.to_owned()));
            };
            let generation = next_got(&mut results)?;
            let Err(damage) = crate::model::decode_pool(&key, &read.value) else {
                return Err(IpamError::invalid(format!(
                    "IP pool {name:?} can be decoded: delete it as any pool"
                )));
            };
            // A pool write like any other: the pool generation moves.
            let mut plan = self.plan();
            self.bump_pool_generation(&mut plan, generation)?;
            plan.expect(&key, Some(read.revision));
            plan.delete(&key);
            self.commit_plan(plan, damage).await
        })
        .await
    }

    /// Every pool that decodes, sorted as [`list_pools`](Self::list_pools) sorts them, and, by
    /// name, the corrupt-object error of each pool object that does not: one damaged pool hides
    /// no other.
    ///
    /// # Errors
    /// Store failures.
    pub async fn list_pools_each(
        &self,
    ) -> Result<(Vec<Pool>, Vec<(String, IpamError)>), IpamError> {
        let dir = keys::pools_dir();
        let mut undecodable = Vec::new();
        let mut sound = decode_each(self.store.list(&dir).await?, decode_pool, &mut undecodable);
        let damaged = undecodable
            .into_iter()
            .map(|object| {
                let name = object
                    .key
                    .strip_prefix(&dir)
                    .unwrap_or(&object.key)
                    .to_owned();
                (name, object.into_error())
            })
            .collect();
        sort_pools(&mut sound);
        Ok((sound.into_iter().map(|p| p.value).collect(), damaged))
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

    /// Validates a spec into the pool it would create when no such pool is stored yet: as
    /// [`pool_from_spec`](Ipam::pool_from_spec), and the range may not overlap its family's
    /// link-local range ([`validate_new_pool_range`]). What `pool add` and the import check
    /// before writing.
    ///
    /// # Errors
    /// As [`pool_from_spec`](Ipam::pool_from_spec); [`IpamError::InvalidArgument`] for a range
    /// overlapping link-local addresses.
    pub fn new_pool_from_spec(spec: &PoolSpec) -> Result<Pool, IpamError> {
        let pool = Self::pool_from_spec(spec)?;
        validate_new_pool_range(&pool.cidr)?;
        Ok(pool)
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

    /// Changes a pool's node selector, assignment mode, allowed uses, disabled flag and block size
    /// (each only when given): one compare-and-swap on the pool, serialised with every other pool
    /// write. Its CIDR never changes here. A new block size applies to blocks claimed from then on;
    /// existing blocks keep their size until they are released, and the pool is recorded as
    /// holding mixed sizes (see the `resize` module) in the same transaction.
    ///
    /// # Errors
    /// [`IpamError::PoolNotFound`]; [`IpamError::InvalidArgument`] for a block size out of the
    /// family's range or larger than the pool; store failures.
    pub async fn set_pool(
        &self,
        name_or_cidr: &str,
        change: &PoolChange,
    ) -> Result<Pool, IpamError> {
        if let Some(block_size) = change.block_size {
            return self
                .change_pool_with_block_size(name_or_cidr, change, block_size)
                .await;
        }
        self.change_pool_where(change, false, |pools| find_pool(pools, name_or_cidr))
            .await
    }

    /// Applies `change` to the pool `find` picks, in one compare-and-swap serialised with every
    /// other pool write (the pool generation is bumped). An unchanged pool is written anyway only
    /// with `write_unchanged` (disabling writes always: see [`Ipam::delete_pool`]).
    async fn change_pool_where<F>(
        &self,
        change: &PoolChange,
        write_unchanged: bool,
        find: F,
    ) -> Result<Pool, IpamError>
    where
        F: Fn(&[Stored<Pool>]) -> Result<&Stored<Pool>, IpamError>,
    {
        self.retrying(|| async {
            let (pools, generation) = self.read_pools_and_generation().await?;
            let found = find(&pools)?;
            let mut pool = found.value.clone();
            change.apply_to(&mut pool);
            if pool == found.value && !write_unchanged {
                return Ok(Attempt::Done(pool));
            }
            let mut plan = self.plan();
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
    /// Validation errors as [`new_pool_from_spec`](Ipam::new_pool_from_spec);
    /// [`IpamError::PoolExists`]; [`IpamError::PoolOverlap`]; store failures.
    pub async fn create_pool(&self, spec: &PoolSpec) -> Result<Pool, IpamError> {
        let pool = Self::pool_from_spec(spec)?;
        self.retrying(|| self.try_create_pool(&pool, false)).await
    }

    /// Creates a pool unless an identical one (same CIDR and block size) exists under any name;
    /// safe when many processes race to do it. An identical pool is accepted whatever its range
    /// (one overlapping link-local addresses, stored by an earlier release, keeps working).
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
        // A pool that is not stored yet: one an earlier release created is found above.
        validate_new_pool_range(&pool.cidr)?;
        let mut plan = self.plan();
        self.bump_pool_generation(&mut plan, generation)?;
        let key = keys::pool(&pool.name);
        plan.expect(&key, None);
        plan.put(&key, encode(pool)?);
        self.commit_plan(plan, pool.clone()).await
    }

    /// Every pool and the pool-generation counter, in one batched read: what a pool write checks
    /// and conditions on. The generation is read first: on a store whose batch is not one
    /// snapshot, a pool written between the two reads then leaves the generation read older than
    /// the store's, and the write conditioned on it is refused (read the other way round, the
    /// pool would be missed and the generation current).
    pub(crate) async fn read_pools_and_generation(
        &self,
    ) -> Result<(Vec<Stored<Pool>>, Option<KeyValue>), IpamError> {
        let results = self
            .store
            .read_many(&[
                Read::Get(keys::pool_generation()),
                Read::List(keys::pools_dir()),
            ])
            .await?;
        let mut results = results.into_iter();
        let generation = next_got(&mut results)?;
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        Ok((pools, generation))
    }

    /// `key` and the pool generation, in one batch (the generation first, as
    /// [`read_pools_and_generation`](Self::read_pools_and_generation) reads it): what a write of
    /// something an ADD decides from reads, to raise the generation in the same transaction.
    pub(crate) async fn read_with_generation(
        &self,
        key: &str,
    ) -> Result<(Option<KeyValue>, Option<KeyValue>), IpamError> {
        let mut results = self
            .store
            .read_many(&[
                Read::Get(keys::pool_generation()),
                Read::Get(key.to_owned()),
            ])
            .await?
            .into_iter();
        let generation = next_got(&mut results)?;
        let read = next_got(&mut results)?;
        Ok((read, generation))
    }

    /// Adds to `plan` the raise of the pool generation read as `generation` (conditioned on that
    /// read). Every write of something an allocation decides from raises it in the same
    /// transaction: pools, the configuration, IP reservations, node labels and namespace
    /// settings (and, outside the allocator, the end of an import and a format finalize), so an
    /// allocation that tests the generation tests all of them.
    pub(crate) fn bump_pool_generation(
        &self,
        plan: &mut Plan,
        generation: Option<KeyValue>,
    ) -> Result<(), IpamError> {
        let (read_at, raised) = next_pool_generation(generation)?;
        plan.expect(&keys::pool_generation(), read_at);
        plan.put(&keys::pool_generation(), raised);
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
        let change = PoolChange {
            disabled: Some(disabled),
            ..PoolChange::default()
        };
        self.change_pool_where(&change, true, find).await
    }

    /// Deletes a pool and its blocks. Refuses while any address in it is allocated, unless
    /// `force`, which releases those addresses first (updating their handles).
    ///
    /// Nothing is written when a block of the pool cannot be decoded, nor (with `force`) an owner
    /// key of one: the error names it. Damage outside the pool is passed over.
    ///
    /// The pool is disabled first: every assignment commits on the pool generation the disabling
    /// raises (or, a store without one, the revision of the pool it uses), so from then on
    /// nothing new lands in it, and the count of addresses in use that decides
    /// a refusal cannot miss an ADD racing the delete. A delete that fails before releasing any
    /// address re-enables a pool it disabled. Each block is deleted by a transaction that checks,
    /// on the block's revision, that it is empty.
    ///
    /// # Errors
    /// [`IpamError::PoolNotFound`]; [`IpamError::PoolInUse`]; [`IpamError::Corrupt`] for an
    /// object of the pool that cannot be decoded; store failures.
    pub async fn delete_pool(
        &self,
        name_or_cidr: &str,
        force: bool,
    ) -> Result<PoolDeletion, IpamError> {
        let pool = self.get_pool(name_or_cidr).await?;
        // The common refusals write nothing.
        if force {
            // Releasing by address reads each block's owner keys: every one must decode.
            let (_, undecodable) = self.all_blocks_with_attributes_each().await?;
            refuse_damage_in_pool(&pool, undecodable)?;
        } else {
            let in_use = self.pool_blocks(&pool).await?.1;
            if in_use > 0 {
                return Err(IpamError::PoolInUse {
                    pool: pool.name.clone(),
                    in_use,
                });
            }
        }
        let mut progress = PoolDeletionProgress::default();
        match self
            .empty_and_delete_pool(&pool, force, &mut progress)
            .await
        {
            Ok(()) => Ok(PoolDeletion {
                pool,
                released_addresses: progress.released_addresses,
                deleted_blocks: progress.deleted_blocks,
            }),
            Err(e) => {
                if progress.disabled_here && progress.released_addresses == 0 {
                    if let Err(enabling) = self.set_exact_pool_disabled(&pool, false).await {
                        tracing::warn!(pool = %pool.name, error = %enabling, "could not re-enable the pool after a failed delete");
                    }
                }
                Err(e)
            }
        }
    }

    /// The rounds of [`delete_pool`](Ipam::delete_pool) after its first checks: disable, release
    /// (with `force`), delete the blocks, then the pool. `progress` says what was done, also when
    /// it fails.
    async fn empty_and_delete_pool(
        &self,
        pool: &Pool,
        force: bool,
        progress: &mut PoolDeletionProgress,
    ) -> Result<(), IpamError> {
        // Rounds repeat only when another client re-enabled the pool (and maybe allocated in it)
        // while it was being emptied.
        for _ in 0..self.retry.max_attempts {
            // This very pool: another client may have deleted it and created another under its
            // name, which this delete must not touch.
            let pools = Self::decode_pools(self.store.list(&keys::pools_dir()).await?)?;
            match find_exact_pool(&pools, pool) {
                Err(_) => return Ok(()),
                Ok(current) if !current.value.disabled => {
                    match self.set_exact_pool_disabled(pool, true).await {
                        Err(IpamError::PoolNotFound(_)) => continue,
                        other => other?,
                    };
                    progress.disabled_here = !pool.disabled;
                }
                Ok(_) => {}
            }
            // Counted after the disable: an ADD that raced the first count is seen here.
            let (blocks, in_use) = self.pool_blocks(pool).await?;
            if in_use > 0 && !force {
                return Err(IpamError::PoolInUse {
                    pool: pool.name.clone(),
                    in_use,
                });
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
                    progress.released_addresses +=
                        self.release_ips(&held).await?.released.len() as u64;
                }
                let cidr = block.cidr;
                match self.retrying(|| self.try_delete_empty_block(cidr)).await {
                    Ok(deleted) => progress.deleted_blocks += u64::from(deleted),
                    Err(IpamError::PoolInUse { in_use, .. }) if !force => {
                        return Err(IpamError::PoolInUse {
                            pool: pool.name.clone(),
                            in_use,
                        })
                    }
                    Err(IpamError::PoolInUse { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            if self.retrying(|| self.try_delete_emptied_pool(pool)).await? {
                return Ok(());
            }
        }
        Err(IpamError::RetriesExhausted {
            attempts: self.retry.max_attempts,
        })
    }

    /// The blocks that lie in `pool`, and how many addresses they hold.
    ///
    /// # Errors
    /// [`IpamError::Corrupt`] naming a block of the pool that cannot be decoded; store failures.
    async fn pool_blocks(&self, pool: &Pool) -> Result<(Vec<Block>, u64), IpamError> {
        let mut undecodable = Vec::new();
        let listed = self.store.list(&keys::blocks_dir()).await?;
        let blocks: Vec<Block> = decode_each(listed, decode::<Block>, &mut undecodable)
            .into_iter()
            .map(|b| b.value)
            .filter(|b| pool.cidr.contains(&b.cidr.network()))
            .collect();
        refuse_damage_in_pool(pool, undecodable)?;
        let in_use = blocks.iter().map(|b| u64::from(b.in_use())).sum();
        Ok((blocks, in_use))
    }

    /// Deletes the pool if, in one snapshot, it is still disabled and no block lies in it; the
    /// delete is conditioned on the pool's revision and raises the pool generation, on which
    /// every assignment is conditioned. False when it was enabled again or holds a block again (go round once more).
    async fn try_delete_emptied_pool(&self, pool: &Pool) -> Result<Attempt<bool>, IpamError> {
        let results = self
            .store
            .read_many(&[
                // The generation before the pools, as every pool write reads them.
                Read::Get(keys::pool_generation()),
                Read::List(keys::pools_dir()),
                Read::List(keys::blocks_dir()),
            ])
            .await?;
        let mut results = results.into_iter();
        let generation = next_got(&mut results)?;
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let Ok(found) = find_exact_pool(&pools, pool) else {
            return Ok(Attempt::Done(true));
        };
        let mut undecodable = Vec::new();
        let blocks = decode_each(
            next_listed(&mut results)?,
            decode::<Block>,
            &mut undecodable,
        );
        refuse_damage_in_pool(pool, undecodable)?;
        let occupied = blocks
            .iter()
            .any(|block| pool.cidr.contains(&block.value.cidr.network()));
        if occupied || !found.value.disabled {
            return Ok(Attempt::Done(false));
        }
        let mut plan = self.plan();
        self.bump_pool_generation(&mut plan, generation)?;
        plan.expect(&found.key, Some(found.revision));
        plan.delete(&found.key);
        // Its mixed-sizes record goes with it (absent or not: a delete of nothing is harmless).
        plan.delete(&super::resize::mixed_sizes_key(&pool.name));
        self.commit_plan(plan, true).await
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
        let mut plan = self.plan();
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
    /// Store failures; [`IpamError::FormatNotFinalized`] for a setting the store's write format
    /// cannot hold.
    pub async fn set_config(&self, config: &IpamConfig) -> Result<(), IpamError> {
        config.validate()?;
        self.update_config(|current| *current = *config)
            .await
            .map(|_| ())
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
            let (read, generation) = self.read_with_generation(&keys::config()).await?;
            let (mut config, revision) = Self::decode_config(read)?;
            change(&mut config);
            config.validate()?;
            let mut plan = self.plan();
            plan.expect(&keys::config(), revision);
            plan.put(&keys::config(), encode(&config)?);
            self.bump_pool_generation(&mut plan, generation)?;
            self.commit_plan(plan, config).await
        })
        .await
    }
}

/// `txn` with the raise of the pool generation read as `generation` (`None`: absent) added,
/// for a transaction built by hand: the condition that the generation is still as read, and
/// the put of its next value. Every write of something an allocation decides from raises it in
/// the same transaction (see `Ipam::bump_pool_generation`).
///
/// # Errors
/// [`IpamError::Corrupt`] when the stored generation does not decode; encoding failures.
pub fn raising_pool_generation(txn: Txn, generation: Option<KeyValue>) -> Result<Txn, IpamError> {
    let key = keys::pool_generation();
    let (read_at, raised) = next_pool_generation(generation)?;
    let condition = match read_at {
        Some(revision) => Condition::at_revision(&key, revision),
        None => Condition::absent(&key),
    };
    Ok(txn.when(condition).then(Op::put(&key, raised)))
}

/// The revision the pool generation was read at (`None`: absent) and its next value.
fn next_pool_generation(
    generation: Option<KeyValue>,
) -> Result<(Option<Revision>, Vec<u8>), IpamError> {
    let (count, read_at) = match generation {
        None => (0u64, None),
        Some(kv) => {
            let stored: Stored<u64> = decode_stored(kv)?;
            (stored.value, Some(stored.revision))
        }
    };
    Ok((read_at, encode(&(count + 1))?))
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

/// What a pool delete has done so far.
#[derive(Debug, Default)]
struct PoolDeletionProgress {
    /// This delete disabled the pool (it was enabled when the delete began).
    disabled_here: bool,
    released_addresses: u64,
    deleted_blocks: u64,
}

/// The first object in `undecodable` that may hold addresses of `pool` (a block, or an owner key
/// of a block, lying in it; one whose key names no CIDR counts), as its corrupt-object error.
fn refuse_damage_in_pool(
    pool: &Pool,
    undecodable: Vec<UndecodableObject>,
) -> Result<(), IpamError> {
    match undecodable.into_iter().find(|object| {
        object.covers().is_none_or(|cidr| {
            pool.cidr.contains(&cidr.network()) || cidr.contains(&pool.cidr.network())
        })
    }) {
        Some(object) => Err(object.into_error()),
        None => Ok(()),
    }
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
