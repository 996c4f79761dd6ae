//! Queries: who holds what (by handle, by address, everything) and utilization.

use super::{
    allocation_info, allocations_of, allocations_of_handle, decode_stored, learn_apart_from_handle,
    load_all_owners_into, next_got, next_listed, AllocationInfo, AssignedAddress, Attempt,
    BlockUsage, Ipam, PoolUsage, Utilization,
};
use crate::kv::Read;
use crate::model::error::IpamError;
use crate::model::{keys, validate_handle, Block, Family};
use ipnet::IpNet;
use std::collections::BTreeSet;
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
        // The block holding it, whatever its size (a pool's blocks may have mixed sizes).
        self.retrying(|| async {
            let mut located = self.locate_blocks(&[(ip, pool)]).await?;
            let Some(stored) = located
                .block_of
                .get(&ip)
                .and_then(|cidr| located.loaded.found.get_mut(cidr))
            else {
                return Ok(Attempt::Done(None));
            };
            // The address's own owner key, not every key of its block.
            let ordinals = stored.value.ordinal_of(ip).into_iter().collect();
            self.load_owner_keys_of([(&mut *stored, ordinals)]).await?;
            Ok(Attempt::Done(allocation_info(&stored.value, ip)?))
        })
        .await
    }

    /// Every allocated address in the store.
    ///
    /// # Errors
    /// Store failures; corrupt objects.
    pub async fn list_allocations(&self) -> Result<Vec<AllocationInfo>, IpamError> {
        let mut all = Vec::new();
        for stored in self.all_blocks_with_attributes().await? {
            all.extend(allocations_of(&stored.value)?);
        }
        all.sort_by_key(|a| a.ip);
        Ok(all)
    }

    /// Per-pool and per-block capacity, use, reserved, cooling and free space (free: neither
    /// allocated, reserved nor cooling), reservations and config read in the same batch.
    ///
    /// # Errors
    /// Store failures; corrupt objects.
    pub async fn utilization(&self) -> Result<Utilization, IpamError> {
        Ok(self.read_utilization(false).await?.0)
    }

    /// [`utilization`](Self::utilization) and [`list_allocations`](Self::list_allocations) from
    /// one read of the blocks (callers that need both read every block once, not twice).
    ///
    /// # Errors
    /// Store failures; corrupt objects.
    pub async fn utilization_and_allocations(
        &self,
    ) -> Result<(Utilization, Vec<AllocationInfo>), IpamError> {
        self.read_utilization(true).await
    }

    async fn read_utilization(
        &self,
        with_allocations: bool,
    ) -> Result<(Utilization, Vec<AllocationInfo>), IpamError> {
        let mut reads = vec![
            Read::List(keys::pools_dir()),
            Read::List(keys::blocks_dir()),
            Read::List(keys::reservations_dir()),
            Read::Get(keys::config()),
        ];
        if with_allocations {
            // The attributes kept apart, in the blocks' snapshot.
            reads.push(Read::List(keys::owners_dir()));
        }
        let results = self.store.read_many(&reads).await?;
        let mut results = results.into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let mut blocks: Vec<Block> = next_listed(&mut results)?
            .into_iter()
            .map(|kv| decode_stored::<Block>(kv).map(|s| s.value))
            .collect::<Result<_, _>>()?;
        let reservations = next_listed(&mut results)?;
        let config = next_got(&mut results)?;
        let mut allocations = Vec::new();
        if with_allocations {
            load_all_owners_into(blocks.iter_mut(), next_listed(&mut results)?)?;
            for block in &blocks {
                allocations.extend(allocations_of(block)?);
            }
            allocations.sort_by_key(|a| a.ip);
        }
        let reserved = crate::model::reservations::ReservedRanges::from_listed(&reservations)?;
        let (config, _) = Self::decode_config(config)?;
        let lifetime = self.lifetime(&config);
        blocks.sort_by_key(|b| (Family::of_net(&b.cidr), b.cidr.network()));
        let mut usage = Utilization::default();
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
            let row = BlockUsage {
                cidr: block.cidr,
                pool: pool_index.map(|i| pools[i].value.name.clone()),
                host: block.affinity.clone(),
                capacity: u64::from(block.capacity()),
                in_use: u64::from(block.in_use()),
                // Reserved and allocated addresses count once, as allocated.
                free: u64::from(block.free())
                    .saturating_sub(block_reserved.saturating_sub(reserved_allocated))
                    .saturating_sub(cooling),
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
                        .saturating_sub(u128::from(cooling));
                    entry.cooling += cooling;
                    entry.blocks.push(row);
                }
                None => usage.orphan_blocks.push(row),
            }
        }
        Ok((usage, allocations))
    }
}
