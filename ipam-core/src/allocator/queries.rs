//! Queries: who holds what (by handle, by address, everything) and utilization.

use super::{
    allocation_info, allocations_of, allocations_of_handle, decode_each, learn_apart_from_handle,
    load_all_owners_each, next_got, next_listed, sort_pools, AddressStatus, AllocationInfo,
    AssignedAddress, Attempt, BlockUsage, HostUtilization, Ipam, PoolUsage, UndecodableObject,
    Utilization,
};
use crate::kv::Read;
use crate::model::error::IpamError;
use crate::model::nodes::decode_node_labels;
use crate::model::reservations::Reservation;
use crate::model::{
    decode, decode_pool, keys, validate_handle, validate_host, Block, Family, IpamConfig, Pool,
};
use ipnet::IpNet;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

impl Ipam {
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
        for stored in self.load_blocks(&cidrs).await?.values_mut() {
            learn_apart_from_handle(&mut stored.value, handle_id, &handle);
            found.extend(allocations_of_handle(&stored.value, handle_id)?);
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
        let Some(pool) = pools.iter().find(|p| p.cidr.contains(&ip)) else {
            return Ok(None);
        };
        Ok(self
            .block_holding(ip, pool)
            .await?
            .and_then(|(_, allocation)| allocation))
    }

    /// Everything the allocator knows of one address: who holds it; when nobody does, the existing
    /// block of its pool that contains it and, while it is in IP cooldown, when that ends (the
    /// reason an `IP=` request for it is refused); and the reservations that cover it. Reads the
    /// pools, the reservations, the config and that one block, whatever the store holds. A pool
    /// or reservation object that cannot be decoded is named in
    /// [`AddressStatus::undecodable`], and left out.
    ///
    /// # Errors
    /// Store failures; a config object, or the block that contains the address, that cannot be
    /// decoded.
    pub async fn address_status(&self, ip: IpAddr) -> Result<AddressStatus, IpamError> {
        let (pools, damaged_pools) = self.list_pools_each().await?;
        let mut undecodable: Vec<UndecodableObject> = damaged_pools
            .into_iter()
            .map(|(name, e)| UndecodableObject::new(keys::pool(&name), e))
            .collect();
        let mut reserved_by = Vec::new();
        for (name, reservation) in self.list_reservations_each().await? {
            match reservation {
                Ok(r) if r.cidrs.iter().any(|cidr| cidr.contains(&ip)) => reserved_by.push(name),
                Ok(_) => {}
                Err(e) => undecodable.push(UndecodableObject::new(keys::reservation_key(&name), e)),
            }
        }
        undecodable.sort_by(|a, b| a.key.cmp(&b.key));
        let lifetime = self.lifetime(&self.get_config().await?);
        let mut status = AddressStatus {
            pool: pools.iter().find(|p| p.cidr.contains(&ip)).cloned(),
            allocation: None,
            block: None,
            cooling_until: None,
            reserved_by,
            undecodable,
        };
        let Some(pool) = &status.pool else {
            return Ok(status);
        };
        if let Some((block, allocation)) = self.block_holding(ip, pool).await? {
            if allocation.is_none() {
                let ordinal = block.ordinal_of(ip);
                status.cooling_until = block
                    .cooling
                    .iter()
                    .find(|c| Some(c.ordinal) == ordinal && !lifetime.cooled(c.released_at))
                    .map(|c| lifetime.cooldown_end(c.released_at));
            }
            status.block = Some((block.cidr, block.affinity));
            status.allocation = allocation;
        }
        Ok(status)
    }

    /// The existing block of `pool` that contains `ip` (whatever its size: a pool's blocks may
    /// have mixed sizes), with the address's owner key loaded, and who holds the address.
    async fn block_holding(
        &self,
        ip: IpAddr,
        pool: &Pool,
    ) -> Result<Option<(Block, Option<AllocationInfo>)>, IpamError> {
        self.retrying(|| async {
            let mut located = self.locate_blocks(&[(ip, pool)]).await?;
            let Some(mut stored) = located
                .block_of
                .get(&ip)
                .and_then(|cidr| located.loaded.found.remove(cidr))
            else {
                return Ok(Attempt::Done(None));
            };
            // The address's own owner key, not every key of its block.
            let ordinals = stored.value.ordinal_of(ip).into_iter().collect();
            self.load_owner_keys_of([(&mut stored, ordinals)]).await?;
            let allocation = allocation_info(&stored.value, ip)?;
            Ok(Attempt::Done(Some((stored.value, allocation))))
        })
        .await
    }

    /// Every allocated address in the store.
    ///
    /// # Errors
    /// Store failures; corrupt objects.
    pub async fn list_allocations(&self) -> Result<Vec<AllocationInfo>, IpamError> {
        let (all, undecodable) = self.list_allocations_each().await?;
        match undecodable.into_iter().next() {
            Some(first) => Err(first.into_error()),
            None => Ok(all),
        }
    }

    /// Every allocated address of the blocks that can be decoded, and each block object that
    /// cannot, or owner key that is missing or cannot be (whose block's allocations are then left
    /// out), sorted by key: one damaged object hides no other block's allocations.
    ///
    /// # Errors
    /// Store failures.
    pub async fn list_allocations_each(
        &self,
    ) -> Result<(Vec<AllocationInfo>, Vec<UndecodableObject>), IpamError> {
        let (blocks, undecodable) = self.all_blocks_with_attributes_each().await?;
        let mut all = Vec::new();
        for stored in blocks {
            all.extend(allocations_of(&stored.value)?);
        }
        all.sort_by_key(|a| a.ip);
        Ok((all, undecodable))
    }

    /// Per-pool and per-block capacity, use, reserved, cooling and free space (free: neither
    /// allocated, reserved nor cooling), reservations and config read in the same batch. A pool,
    /// block or reservation object that cannot be decoded is left out of the figures and named in
    /// [`Utilization::undecodable`]: one damaged object hides no other.
    ///
    /// # Errors
    /// Store failures; a config object that cannot be decoded.
    pub async fn utilization(&self) -> Result<Utilization, IpamError> {
        Ok(self
            .read_utilization(keys::blocks_dir(), false, None)
            .await?
            .usage)
    }

    /// [`utilization`](Self::utilization) of `host`'s blocks with a free address (those kept
    /// under `open/`) only: what an ADD of the host reads first, whatever else the store holds.
    /// Each such block's row is the one `utilization` gives; the pools' figures count only these
    /// blocks. Pools, reservations and config are read whole, as there, and the host's labels
    /// with them: one round trip (what CNI STATUS reads every few seconds on every node).
    ///
    /// # Errors
    /// As [`utilization`](Self::utilization); an invalid host name; a node object that cannot be
    /// decoded.
    pub async fn host_utilization(&self, host: &str) -> Result<HostUtilization, IpamError> {
        validate_host(host)?;
        let read = self
            .read_utilization(keys::host_open_blocks_dir(host), false, Some(host))
            .await?;
        Ok(HostUtilization {
            usage: read.usage,
            config: read.config,
            labels: read.labels,
        })
    }

    /// [`utilization`](Self::utilization) and [`list_allocations`](Self::list_allocations) from
    /// one read of the blocks (callers that need both read every block once, not twice).
    ///
    /// An owner key that is missing or cannot be decoded is named in [`Utilization::undecodable`]
    /// and its block's allocations left out (the block still counts in the figures).
    ///
    /// # Errors
    /// Store failures; a config object that cannot be decoded.
    pub async fn utilization_and_allocations(
        &self,
    ) -> Result<(Utilization, Vec<AllocationInfo>), IpamError> {
        let read = self
            .read_utilization(keys::blocks_dir(), true, None)
            .await?;
        Ok((read.usage, read.allocations))
    }

    /// Every address of the blocks that can be decoded that no request can be given now: the
    /// allocated ones and those still in IP cooldown. From the blocks' values and the config in
    /// one read: owner keys are not read, so a block whose owner key cannot be decoded counts
    /// whole. The operator's reservations are not among them (see
    /// [`list_reservations`](Self::list_reservations)).
    ///
    /// # Errors
    /// Store failures; a config object that cannot be decoded.
    pub async fn addresses_not_free(&self) -> Result<BTreeSet<IpAddr>, IpamError> {
        let results = self
            .store
            .read_many(&[Read::List(keys::blocks_dir()), Read::Get(keys::config())])
            .await?;
        let mut results = results.into_iter();
        let blocks = decode_each(next_listed(&mut results)?, decode::<Block>, &mut Vec::new());
        let (config, _) = Self::decode_config(next_got(&mut results)?)?;
        let lifetime = self.lifetime(&config);
        let mut not_free = BTreeSet::new();
        for block in blocks.iter().map(|stored| &stored.value) {
            let ordinals = block
                .allocations
                .keys()
                .copied()
                .chain(block.cooling_ordinals_at(lifetime));
            not_free.extend(ordinals.map(|ordinal| block.ip_of(ordinal)));
        }
        Ok(not_free)
    }

    /// Usage of the blocks listed under `blocks` (every block, or a host's), with their
    /// allocations when asked, and the labels of `labels_of` when given, from one batch.
    async fn read_utilization(
        &self,
        blocks: String,
        with_allocations: bool,
        labels_of: Option<&str>,
    ) -> Result<UtilizationRead, IpamError> {
        let mut reads = vec![
            Read::List(keys::pools_dir()),
            Read::List(blocks),
            Read::List(keys::reservations_dir()),
            Read::Get(keys::config()),
        ];
        if with_allocations {
            // The attributes kept apart, in the blocks' snapshot.
            reads.push(Read::List(keys::owners_dir()));
        }
        let node_key = labels_of.map(keys::node_key);
        if let Some(key) = &node_key {
            reads.push(Read::Get(key.clone()));
        }
        let results = self.store.read_many(&reads).await?;
        let mut results = results.into_iter();
        // One object that does not decode hides no other: it is named, and left out.
        let mut undecodable = Vec::new();
        let mut pools = decode_each(next_listed(&mut results)?, decode_pool, &mut undecodable);
        sort_pools(&mut pools);
        let mut blocks: Vec<Block> = decode_each(
            next_listed(&mut results)?,
            decode::<Block>,
            &mut undecodable,
        )
        .into_iter()
        .map(|stored| stored.value)
        .collect();
        let reservations: Vec<Reservation> = decode_each(
            next_listed(&mut results)?,
            decode::<Reservation>,
            &mut undecodable,
        )
        .into_iter()
        .map(|stored| stored.value)
        .collect();
        let config = next_got(&mut results)?;
        let mut allocations = Vec::new();
        if with_allocations {
            // A block whose owner key is damaged still counts in the figures (they come from its
            // value); its allocations are left out, the key named.
            let unknown = load_all_owners_each(
                blocks.iter_mut(),
                next_listed(&mut results)?,
                &mut undecodable,
            )?;
            for block in blocks.iter().filter(|b| !unknown.contains(&b.cidr)) {
                allocations.extend(allocations_of(block)?);
            }
            allocations.sort_by_key(|a| a.ip);
        }
        let labels = match &node_key {
            Some(key) => decode_node_labels(key, next_got(&mut results)?.as_ref())?,
            None => BTreeMap::new(),
        };
        undecodable.sort_by(|a, b| a.key.cmp(&b.key));
        let reserved = crate::model::reservations::ReservedRanges::new(&reservations);
        let (config, _) = Self::decode_config(config)?;
        let lifetime = self.lifetime(&config);
        blocks.sort_by_key(|b| (Family::of_net(&b.cidr), b.cidr.network()));
        let mut usage = Utilization {
            undecodable,
            ..Utilization::default()
        };
        for pool in &pools {
            let pool_reserved = reserved.count_in(&pool.value.cidr);
            usage.pools.push(PoolUsage {
                pool: pool.value.clone(),
                capacity: pool.value.capacity(),
                in_use: 0,
                free: pool.value.capacity().saturating_sub(pool_reserved),
                reserved: pool_reserved,
                cooling: 0,
                blocks: Vec::new(),
            });
        }
        for block in blocks {
            let pool_index = pools
                .iter()
                .position(|p| p.value.cidr.contains(&block.cidr.network()));
            let block_reserved = u64::try_from(reserved.count_in(&block.cidr)).unwrap_or(u64::MAX);
            let reserved_allocated = reserved.allocated_in(&block);
            let cooling = u64::from(block.cooling_at(lifetime));
            // A reserved address that is cooling is left out of free once, as reserved.
            let cooling_unreserved = cooling - reserved.cooling_in(&block, lifetime);
            let row = BlockUsage {
                cidr: block.cidr,
                pool: pool_index.map(|i| pools[i].value.name.clone()),
                host: block.affinity.clone(),
                capacity: u64::from(block.capacity()),
                in_use: u64::from(block.in_use()),
                // Reserved and allocated addresses count once, as allocated; reserved and
                // cooling ones once, as reserved.
                free: u64::from(block.free())
                    .saturating_sub(block_reserved.saturating_sub(reserved_allocated))
                    .saturating_sub(cooling_unreserved),
                reserved: block_reserved,
                cooling,
            };
            match pool_index {
                Some(i) => {
                    let entry = &mut usage.pools[i];
                    entry.in_use += row.in_use;
                    // The pool's free count already left out every reserved address.
                    entry.free = entry
                        .free
                        .saturating_sub(u128::from(row.in_use - reserved_allocated))
                        .saturating_sub(u128::from(cooling_unreserved));
                    entry.cooling += cooling;
                    entry.blocks.push(row);
                }
                None => usage.orphan_blocks.push(row),
            }
        }
        Ok(UtilizationRead {
            usage,
            allocations,
            config,
            labels,
        })
    }
}

/// What [`Ipam::read_utilization`] read.
struct UtilizationRead {
    usage: Utilization,
    allocations: Vec<AllocationInfo>,
    config: IpamConfig,
    labels: BTreeMap<String, String>,
}
