//! Queries: who holds what (by handle, by address, everything) and utilization.

use super::*;

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
}
