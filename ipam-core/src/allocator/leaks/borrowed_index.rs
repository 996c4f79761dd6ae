//! A node's allocations read by what the node holds: its own blocks and the blocks its borrowed-block index names, and the upkeep of that index.
//!
//! Every transaction that records an address for a node in a block not affine to it puts the
//! index entry `ipam/v1/borrowed/<node>/<cidr>` (see `Plan::index_borrowed`). Writers that keep
//! no index (an older release's plugin, an import, a block whose affinity was released while it
//! held the node's addresses) are caught by the look's survey of the whole store, which completes
//! the index; entries whose block holds nothing of the node any more are deleted, each on the
//! condition that the block is still as it was read.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;

use super::super::{
    allocations_of, cidr_of_key, decode_each, next_listed, AllocationInfo, Ipam, Stored,
    UndecodableObject, BORROWED_INDEX_VALUE,
};
use crate::kv::{Condition, KvError, Op, Read, Txn, MAX_TXN_OPS};
use crate::model::error::IpamError;
use crate::model::{decode, keys, Block};

use super::ATTR_NODE;

/// What [`Ipam::node_allocations`] read.
#[derive(Debug, Default)]
pub(crate) struct NodeAllocations {
    /// The pools, read with the node's blocks.
    pub pools: Vec<crate::model::Pool>,
    /// Every allocation of the blocks read (the node's and, in its own blocks, other nodes').
    pub allocations: Vec<AllocationInfo>,
    /// The blocks read: the node's own and those its index names that still exist.
    pub blocks: Vec<IpNet>,
    /// Index entries whose block holds nothing of the node, each with the condition under
    /// which deleting it is right (the block unchanged, or still absent).
    pub unneeded: Vec<(String, Condition)>,
    /// The node's own block objects that could not be decoded, and the owner keys of its own
    /// blocks that could not (each such block left out of the rest), sorted by key.
    pub undecodable: Vec<UndecodableObject>,
}

impl Ipam {
    /// Reads the pools, `host`'s own blocks and its borrowed-block index in one batch, then the
    /// blocks the index names (by key), then the owner keys of the attributes they keep apart, if
    /// any. Writes nothing.
    ///
    /// # Errors
    /// Store failures; a pool, or a block the index names, that cannot be decoded; an index key
    /// that names no block; an owner key of a block the index names that is missing or cannot be
    /// decoded. The node's own blocks that cannot be decoded, or whose owner key cannot be, are
    /// named in [`NodeAllocations::undecodable`] instead.
    pub(crate) async fn node_allocations(&self, host: &str) -> Result<NodeAllocations, IpamError> {
        let borrowed_dir = keys::host_borrowed_dir(host);
        let mut results = self
            .store
            .read_many(&[
                Read::List(keys::pools_dir()),
                Read::List(keys::host_blocks_dir(host)),
                Read::List(borrowed_dir.clone()),
            ])
            .await?
            .into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?
            .into_iter()
            .map(|p| p.value)
            .collect();
        let mut undecodable = Vec::new();
        let mut own: Vec<Stored<Block>> = decode_each(
            next_listed(&mut results)?,
            decode::<Block>,
            &mut undecodable,
        );
        let mut indexed: BTreeMap<IpNet, String> = BTreeMap::new();
        for kv in next_listed(&mut results)? {
            indexed.insert(cidr_of_key(&kv.key, "a borrowed-block index key")?, kv.key);
        }
        let own_cidrs: BTreeSet<IpNet> = own.iter().map(|s| s.value.cidr).collect();
        let elsewhere: BTreeSet<IpNet> = indexed
            .keys()
            .filter(|c| !own_cidrs.contains(c))
            .copied()
            .collect();
        let mut borrowed = self.load_blocks_for_write(&elsewhere).await?.found;
        // Whose each address is, for the blocks that keep attributes apart. An own block whose
        // owner key is missing or cannot be decoded is left out and the key named, as an own
        // block that cannot be decoded is: whose its addresses are is unknown.
        loop {
            match self
                .load_owner_keys(own.iter_mut().chain(borrowed.values_mut()))
                .await
            {
                Ok(()) => break,
                Err(IpamError::Corrupt { key, message }) => {
                    let Some(at) = keys::parse_owner_key(&key)
                        .and_then(|(cidr, _)| own.iter().position(|s| s.value.cidr == cidr))
                    else {
                        return Err(IpamError::Corrupt { key, message });
                    };
                    own.remove(at);
                    undecodable.push(UndecodableObject { key, message });
                }
                Err(other) => return Err(other),
            }
        }
        undecodable.sort_by(|a, b| a.key.cmp(&b.key));

        let mut read = NodeAllocations {
            pools,
            undecodable,
            ..NodeAllocations::default()
        };
        for (cidr, key) in &indexed {
            let stored = own
                .iter()
                .find(|s| s.value.cidr == *cidr)
                .or_else(|| borrowed.get(cidr));
            let condition = match stored {
                None => Condition::absent(keys::block_claim(cidr)),
                Some(stored) => {
                    if stored.value.affinity.as_deref() != Some(host)
                        && holds_for(&stored.value, host)?
                    {
                        continue;
                    }
                    Condition::at_revision(&stored.key, stored.revision)
                }
            };
            read.unneeded.push((key.clone(), condition));
        }
        for stored in own.iter().chain(borrowed.values()) {
            read.blocks.push(stored.value.cidr);
            read.allocations.extend(allocations_of(&stored.value)?);
        }
        Ok(read)
    }

    /// Deletes index entries [`node_allocations`](Self::node_allocations) found unneeded, each in
    /// its own transaction on its condition; an entry whose block changed since is kept (the
    /// next look decides again).
    ///
    /// # Errors
    /// Store failures other than a failed condition.
    pub(crate) async fn forget_borrowed(
        &self,
        host: &str,
        unneeded: &[(String, Condition)],
    ) -> Result<(), IpamError> {
        for (key, condition) in unneeded {
            let txn = Txn::new().when(condition.clone()).then(Op::delete(key));
            match self.store.commit(txn).await {
                Ok(_) => {
                    tracing::debug!(%host, %key, "borrowed-block index entry no longer needed")
                }
                Err(KvError::Conflict { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Puts the index entries `host` lacks for the blocks not affine to it that hold one of its
    /// addresses among `allocations` (a survey of the whole store).
    ///
    /// # Errors
    /// Store failures.
    pub(crate) async fn complete_borrowed_index(
        &self,
        host: &str,
        allocations: &[AllocationInfo],
    ) -> Result<(), IpamError> {
        let needed: BTreeSet<String> = allocations
            .iter()
            .filter(|a| a.attributes.get(ATTR_NODE).map(String::as_str) == Some(host))
            .filter(|a| a.block_host.as_deref() != Some(host))
            .map(|a| keys::borrowed_key(host, &a.block))
            .collect();
        if needed.is_empty() {
            return Ok(());
        }
        let present: BTreeSet<String> = self
            .store
            .list(&keys::host_borrowed_dir(host))
            .await?
            .into_iter()
            .map(|kv| kv.key)
            .collect();
        let missing: Vec<&String> = needed.difference(&present).collect();
        for chunk in missing.chunks(MAX_TXN_OPS) {
            let mut txn = Txn::new();
            for key in chunk {
                txn = txn.then(Op::put(key.as_str(), BORROWED_INDEX_VALUE.to_vec()));
            }
            self.store.commit(txn).await?;
            tracing::info!(%host, entries = chunk.len(), "borrowed-block index completed from a survey of the store");
        }
        Ok(())
    }
}

/// Whether `block` holds an address recorded for `host`.
fn holds_for(block: &Block, host: &str) -> Result<bool, IpamError> {
    Ok(allocations_of(block)?
        .iter()
        .any(|a| a.attributes.get(ATTR_NODE).map(String::as_str) == Some(host)))
}
