//! Allocated addresses counted by block and by node from the claim index and the borrowed-block indexes, reading block values only where an address may be recorded for another node than the block's.
//!
//! A claim entry records its block's owner and free count, so a block's allocated count is its
//! capacity minus that. Addresses a node holds in a block not affine to it are in that node's
//! borrowed-block index (`ipam/v1/borrowed/<node>/`), put by every transaction that records one;
//! those blocks, blocks without an owner and blocks whose claim entry records no free count
//! (format 1) are read and counted address by address. Every other block's addresses count for
//! its owner.
//!
//! A claim entry, a block value or an owner key that cannot be decoded does not stop the count: it
//! is named in [`AllocationCounts::undecodable`]; such a block is counted as a block of the owner
//! its claim entry records, with none of its addresses (who holds them is unknown until it is
//! repaired).

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;

use super::{cidr_of_key, next_listed, Attempt, IndexedClaim, Ipam, UndecodableObject, ATTR_NODE};
use crate::kv::{KeyValue, Read};
use crate::model::error::IpamError;
use crate::model::{keys, Pool};

/// What [`Ipam::allocation_counts`] counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllocationCounts {
    /// Every pool.
    pub pools: Vec<Pool>,
    /// Every block, in key order of its claim entry.
    pub blocks: Vec<BlockCount>,
    /// Claim entries, block values and owner keys that could not be decoded (an owner key also
    /// when missing), by key: a claim entry's block is left out of `blocks`; a block (or the block
    /// of an owner key) is in `blocks` with no address counted.
    pub undecodable: Vec<UndecodableObject>,
}

/// One block's allocated addresses, by the node recorded with them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockCount {
    /// The block.
    pub cidr: IpNet,
    /// Its owner, if any.
    pub host: Option<String>,
    /// Allocated addresses by the node recorded with them (`None`: none recorded).
    pub by_node: BTreeMap<Option<String>, u64>,
    /// Whether the block's value was read and counted (else its count is its owner's, from its
    /// claim entry; none when the value is named in [`AllocationCounts::undecodable`]).
    pub read: bool,
}

impl Ipam {
    /// Allocated addresses of every block, by node: one batched read of the pools, the claim
    /// index and every borrowed-block index, then the blocks that need reading (see the module
    /// documentation), by key.
    ///
    /// # Errors
    /// Store failures; a pool that cannot be decoded; a borrowed-block index key that names no
    /// block (which blocks to read is not known then).
    pub async fn allocation_counts(&self) -> Result<AllocationCounts, IpamError> {
        // A block rewritten between its read and its owner keys' is read again.
        self.retrying(|| async { Ok(Attempt::Done(self.try_allocation_counts().await?)) })
            .await
    }

    async fn try_allocation_counts(&self) -> Result<AllocationCounts, IpamError> {
        let mut results = self
            .store
            .read_many(&[
                Read::List(keys::pools_dir()),
                Read::List(keys::claims_dir()),
                Read::List(keys::borrowed_dir()),
            ])
            .await?
            .into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?
            .into_iter()
            .map(|p| p.value)
            .collect();
        let mut undecodable = Vec::new();
        let mut claims = Vec::new();
        for kv in next_listed(&mut results)? {
            let key = kv.key.clone();
            match IndexedClaim::decode(kv) {
                Ok(entry) => claims.push(entry),
                Err(e) => undecodable.push(UndecodableObject::new(key, e)),
            }
        }
        let mut borrowed: BTreeSet<IpNet> = BTreeSet::new();
        for kv in next_listed(&mut results)? {
            borrowed.insert(cidr_of_key(&kv.key, "a borrowed-block index key")?);
        }
        let to_read: BTreeMap<IpNet, KeyValue> = claims
            .iter()
            .filter(|e| {
                e.claim.affinity.is_none() || e.claim.free.is_none() || borrowed.contains(&e.cidr)
            })
            .map(|e| (e.cidr, e.stored.clone()))
            .collect();
        let cidrs: BTreeSet<IpNet> = to_read.keys().copied().collect();
        let mut read = BTreeMap::new();
        let mut damaged: BTreeSet<IpNet> = BTreeSet::new();
        if !cidrs.is_empty() {
            let loaded = self
                .load_blocks_given_claims_each(&cidrs, to_read.into_values().map(Some).collect())
                .await?;
            read = loaded.found;
            for object in loaded.undecodable {
                if let Some((_, cidr)) = object.block() {
                    damaged.insert(cidr);
                }
                undecodable.push(object);
            }
        }
        // Whose each address is (its node), for the blocks kept apart. A block with an owner key
        // that cannot be decoded (or is missing) is counted as a damaged block: whose its
        // addresses are is unknown.
        loop {
            match self.load_owner_keys(read.values_mut()).await {
                Ok(()) => break,
                Err(IpamError::Corrupt { key, message }) => {
                    let error = IpamError::Corrupt {
                        key: key.clone(),
                        message,
                    };
                    let Some((cidr, _)) = keys::parse_owner_key(&key) else {
                        return Err(error);
                    };
                    if read.remove(&cidr).is_none() {
                        return Err(error);
                    }
                    damaged.insert(cidr);
                    undecodable.push(UndecodableObject::new(key, error));
                }
                Err(e) => return Err(e),
            }
        }
        let mut blocks = Vec::with_capacity(claims.len());
        for entry in claims {
            let count = match read.remove(&entry.cidr) {
                Some(stored) => {
                    let block = stored.value;
                    let mut by_node: BTreeMap<Option<String>, u64> = BTreeMap::new();
                    for ordinal in block.allocations.keys() {
                        let node = block
                            .attribute_of(*ordinal)?
                            .and_then(|a| a.metadata.get(ATTR_NODE))
                            .cloned();
                        *by_node.entry(node).or_default() += 1;
                    }
                    BlockCount {
                        cidr: block.cidr,
                        host: block.affinity,
                        by_node,
                        read: true,
                    }
                }
                None if damaged.contains(&entry.cidr) => BlockCount {
                    cidr: entry.cidr,
                    host: entry.claim.affinity,
                    by_node: BTreeMap::new(),
                    read: false,
                },
                None if cidrs.contains(&entry.cidr) => continue,
                None => {
                    let capacity = crate::model::block_capacity(&entry.cidr);
                    let in_use = u64::from(capacity.saturating_sub(entry.claim.free.unwrap_or(0)));
                    let mut by_node = BTreeMap::new();
                    if in_use > 0 {
                        by_node.insert(entry.claim.affinity.clone(), in_use);
                    }
                    BlockCount {
                        cidr: entry.cidr,
                        host: entry.claim.affinity,
                        by_node,
                        read: false,
                    }
                }
            };
            blocks.push(count);
        }
        undecodable.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(AllocationCounts {
            pools,
            blocks,
            undecodable,
        })
    }
}
