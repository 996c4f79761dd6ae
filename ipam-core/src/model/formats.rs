//! Readers of the stored layouts older formats wrote: each old object is read into today's shape,
//! with the defaults its missing fields had, and rewritten in the current format on its next write.

use std::any::Any;
use std::collections::{BTreeMap, VecDeque};

use ipnet::IpNet;
use serde::Deserialize;

use crate::model::error::IpamError;
use crate::model::selector::Selector;
use crate::model::{
    decode_body, Allocation, AllowedUses, AssignmentMode, Attribute, Block, ClaimEntry, IpamConfig,
    Pool, DEFAULT_EMPTY_BLOCK_RECLAIM_SECONDS,
};

/// A pool as formats 1 and 2 stored it (before node selectors, assignment modes and allowed uses).
#[derive(Deserialize)]
struct PoolFormat2 {
    name: String,
    cidr: IpNet,
    block_size: u8,
    disabled: bool,
}

/// A block as formats 1 to 3 stored it (before claim and empty timestamps and cooling addresses).
#[derive(Deserialize)]
struct BlockFormat3 {
    cidr: IpNet,
    affinity: Option<String>,
    sequence: u64,
    next_fresh: u32,
    released: VecDeque<u32>,
    allocations: BTreeMap<u32, Allocation>,
    attributes: Vec<Attribute>,
}

/// The IPAM config as formats 1 to 3 stored it (before IP cooldown and the reclaim age).
#[derive(Deserialize)]
struct IpamConfigFormat3 {
    strict_affinity: bool,
    auto_allocate_blocks: bool,
    max_blocks_per_host: u32,
}

/// A claim index entry as formats 2 and 3 stored it (host and free count).
#[derive(Deserialize)]
struct ClaimFormat3 {
    affinity: Option<String>,
    free: u32,
}

/// Reads `body`, written by format `version` (older than today's), when `T`'s layout changed since:
/// `Some` with the object in today's shape, `None` when `T` is laid out as it was then.
pub(crate) fn decode_older<T: 'static>(
    key: &str,
    version: u8,
    body: &[u8],
) -> Result<Option<T>, IpamError> {
    let wanted = std::any::TypeId::of::<T>();
    let upgraded: Box<dyn Any> = if wanted == std::any::TypeId::of::<Pool>() {
        Box::new(pool(key, version, body)?)
    } else if wanted == std::any::TypeId::of::<Block>() {
        Box::new(block(key, body)?)
    } else if wanted == std::any::TypeId::of::<IpamConfig>() {
        Box::new(config(key, body)?)
    } else {
        return Ok(None);
    };
    Ok(upgraded.downcast::<T>().ok().map(|boxed| *boxed))
}

fn pool(key: &str, version: u8, body: &[u8]) -> Result<Pool, IpamError> {
    if version >= 3 {
        return decode_body(key, body);
    }
    let old: PoolFormat2 = decode_body(key, body)?;
    Ok(Pool {
        name: old.name,
        cidr: old.cidr,
        block_size: old.block_size,
        disabled: old.disabled,
        // Calico's defaults for pools that predate these fields.
        node_selector: Selector::all(),
        assignment_mode: AssignmentMode::Automatic,
        allowed_uses: AllowedUses::default(),
    })
}

fn block(key: &str, body: &[u8]) -> Result<Block, IpamError> {
    let old: BlockFormat3 = decode_body(key, body)?;
    Ok(Block {
        cidr: old.cidr,
        affinity: old.affinity,
        sequence: old.sequence,
        next_fresh: old.next_fresh,
        released: old.released,
        allocations: old.allocations,
        attributes: old.attributes,
        // Unknown: an old empty block counts as empty for as long as reclaim needs (see
        // docs/data-model.md, "Format versions").
        claimed_at: None,
        emptied_at: None,
        cooling: VecDeque::new(),
    })
}

fn config(key: &str, body: &[u8]) -> Result<IpamConfig, IpamError> {
    let old: IpamConfigFormat3 = decode_body(key, body)?;
    Ok(IpamConfig {
        strict_affinity: old.strict_affinity,
        auto_allocate_blocks: old.auto_allocate_blocks,
        max_blocks_per_host: old.max_blocks_per_host,
        ip_cooldown_seconds: 0,
        empty_block_reclaim_seconds: DEFAULT_EMPTY_BLOCK_RECLAIM_SECONDS,
    })
}

/// Reads a claim index entry written by format 1 (the host alone) or 2 and 3 (host and free count).
pub(crate) fn decode_older_claim(
    key: &str,
    version: u8,
    body: &[u8],
) -> Result<ClaimEntry, IpamError> {
    if version == 1 {
        let affinity: Option<String> = decode_body(key, body)?;
        return Ok(ClaimEntry {
            affinity,
            free: None,
            emptied_at: None,
            last_cooling_release: None,
        });
    }
    let claim: ClaimFormat3 = decode_body(key, body)?;
    Ok(ClaimEntry {
        affinity: claim.affinity,
        free: Some(claim.free),
        emptied_at: None,
        last_cooling_release: None,
    })
}
