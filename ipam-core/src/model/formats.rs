//! The stored layouts older formats wrote: readers that bring each old object into today's shape
//! (with the defaults its missing fields had), and the writers of formats 3 to 5 that a store
//! whose upgrade is not finalized still gets ([`downgrade`]).

use std::any::Any;
use std::collections::{BTreeMap, VecDeque};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::model::error::IpamError;
use crate::model::keys;
use crate::model::selector::Selector;
use crate::model::store_format::OLDEST_WRITABLE_FORMAT;
use crate::model::{
    decode_body, encode, Allocation, AllowedUses, AssignmentMode, Attribute, Block, ClaimEntry,
    Handle, IpamConfig, Pool, DEFAULT_EMPTY_BLOCK_RECLAIM_SECONDS, FORMAT_VERSION,
    OWNERS_APART_FORMAT,
};

/// The format that added node selectors, assignment modes and allowed uses to pools.
const FORMAT_OF_POOL_SELECTORS: u8 = 3;

/// The format that added the IP cooldown and the empty-block reclaim age to the IPAM config, and
/// claim and empty timestamps and cooling addresses to blocks and their claim entries.
pub(crate) const FORMAT_OF_COOLDOWN: u8 = 4;

/// A handle as formats 1 to 5 stored it (before the metadata of addresses kept apart).
#[derive(Serialize, Deserialize)]
struct HandleFormat5 {
    blocks: BTreeMap<IpNet, u32>,
}

/// A pool as formats 1 and 2 stored it (before node selectors, assignment modes and allowed uses).
#[derive(Deserialize)]
struct PoolFormat2 {
    name: String,
    cidr: IpNet,
    block_size: u8,
    disabled: bool,
}

/// A block as formats 1 to 3 stored it (before claim and empty timestamps and cooling addresses).
#[derive(Serialize, Deserialize)]
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
#[derive(Serialize, Deserialize)]
struct IpamConfigFormat3 {
    strict_affinity: bool,
    auto_allocate_blocks: bool,
    max_blocks_per_host: u32,
}

/// A claim index entry as formats 2 and 3 stored it (host and free count).
#[derive(Serialize, Deserialize)]
struct ClaimFormat3 {
    affinity: Option<String>,
    free: u32,
}

/// Reads `body`, written by format `version` (older than [`crate::model::NEWEST_OBJECT_LAYOUT`]), when `T`'s layout changed since:
/// `Some` with the object in today's shape, `None` when `T` is laid out as it was then.
pub(crate) fn decode_older<T: 'static>(
    key: &str,
    version: u8,
    body: &[u8],
) -> Result<Option<T>, IpamError> {
    let wanted = std::any::TypeId::of::<T>();
    let upgraded: Box<dyn Any> =
        if wanted == std::any::TypeId::of::<Pool>() && version < FORMAT_OF_POOL_SELECTORS {
            Box::new(pool(key, body)?)
        } else if wanted == std::any::TypeId::of::<Block>() && version < FORMAT_OF_COOLDOWN {
            Box::new(block(key, body)?)
        } else if wanted == std::any::TypeId::of::<IpamConfig>() && version < FORMAT_OF_COOLDOWN {
            Box::new(config(key, body)?)
        } else if wanted == std::any::TypeId::of::<Handle>() && version < OWNERS_APART_FORMAT {
            let old: HandleFormat5 = decode_body(key, body)?;
            Box::new(Handle {
                blocks: old.blocks,
                apart: BTreeMap::new(),
            })
        } else {
            return Ok(None);
        };
    Ok(upgraded.downcast::<T>().ok().map(|boxed| *boxed))
}

fn pool(key: &str, body: &[u8]) -> Result<Pool, IpamError> {
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
    let mut block = Block::new(old.cidr, old.affinity, old.sequence);
    // As stored, host bits and all (`Block::self_check` reports them).
    block.cidr = old.cidr;
    block.next_fresh = old.next_fresh;
    block.released = old.released;
    block.allocations = old.allocations;
    block.attributes = old.attributes;
    // Unknown: an old empty block counts as empty for as long as reclaim needs (see
    // docs/data-model.md, "Format versions"); `Block::new` leaves the claim and empty timestamps
    // unset and no address cooling.
    Ok(block)
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

/// Rewrites `value`, an object this build encoded for `key` (in [`FORMAT_VERSION`]), in format
/// `to`, the one the store's writers use. Values that are not versioned objects (the JSON records
/// of agents, plugins and the format record) are returned as they are.
///
/// Formats before 6 have no place for what format 6 added: a handle is written with its counts
/// alone, and an owner key or a handle holding the metadata of an address kept apart cannot be
/// written at all ([`IpamError::FormatNotFinalized`]; writers keep attributes in their blocks until
/// then). Formats 4 and 5 lay every other object out as today: only the version byte is
/// rewritten. Format 3 has no place for what format 4 added: a block's claim and empty timestamps are left
/// out (a reader then counts them as unknown, as for any block format 3 wrote); its cooling
/// addresses become free ones, so none is lost; the IP cooldown and a changed empty-block reclaim
/// age cannot be written at all ([`IpamError::FormatNotFinalized`]).
///
/// # Errors
/// [`IpamError::FormatNotFinalized`] for a setting or an object format `to` cannot hold;
/// [`IpamError::Internal`] for a format this build cannot write.
pub fn downgrade(key: &str, value: Vec<u8>, to: u8) -> Result<Vec<u8>, IpamError> {
    if to >= FORMAT_VERSION || value.first() != Some(&FORMAT_VERSION) {
        return Ok(value);
    }
    if to < OLDEST_WRITABLE_FORMAT {
        return Err(IpamError::Internal(format!(
            "cannot write format {to}: the oldest this build writes is {OLDEST_WRITABLE_FORMAT}"
        )));
    }
    let body = &value[1..];
    let mut out = vec![to];
    let kept_apart = || IpamError::FormatNotFinalized {
        what: "an allocation's attribute kept apart from its block".into(),
        needs: OWNERS_APART_FORMAT,
        writes: to,
    };
    // Owner keys and handles' kept-apart metadata exist from format 6 on: only formats before it
    // cannot hold them (a later format's own additions are gated by their own format).
    if to < OWNERS_APART_FORMAT && key.starts_with(&keys::owners_dir()) {
        return Err(kept_apart());
    }
    if to < OWNERS_APART_FORMAT && key.starts_with(&keys::handles_dir()) {
        let handle: Handle = decode_body(key, body)?;
        if !handle.apart.is_empty() {
            return Err(kept_apart());
        }
        let encoded = encode(&HandleFormat5 {
            blocks: handle.blocks,
        })?;
        out.extend_from_slice(&encoded[1..]);
        return Ok(out);
    }
    if to >= FORMAT_OF_COOLDOWN {
        // Laid out as today: only the version byte differs.
        out.extend_from_slice(body);
        return Ok(out);
    }
    let blocks = keys::blocks_dir();
    let claims = keys::claims_dir();
    let rewritten = if key == keys::config() {
        let config: IpamConfig = decode_body(key, body)?;
        if config.ip_cooldown_seconds != 0 {
            return Err(IpamError::FormatNotFinalized {
                what: format!("an IP cooldown ({} s)", config.ip_cooldown_seconds),
                needs: FORMAT_OF_COOLDOWN,
                writes: to,
            });
        }
        if config.empty_block_reclaim_seconds != DEFAULT_EMPTY_BLOCK_RECLAIM_SECONDS {
            return Err(IpamError::FormatNotFinalized {
                what: format!(
                    "an empty-block reclaim age other than the default {DEFAULT_EMPTY_BLOCK_RECLAIM_SECONDS} s ({} s)",
                    config.empty_block_reclaim_seconds
                ),
                needs: FORMAT_OF_COOLDOWN,
                writes: to,
            });
        }
        Some(encode(&IpamConfigFormat3 {
            strict_affinity: config.strict_affinity,
            auto_allocate_blocks: config.auto_allocate_blocks,
            max_blocks_per_host: config.max_blocks_per_host,
        })?)
    } else if key.starts_with(&claims) {
        let claim: crate::model::Claim = decode_body(key, body)?;
        Some(encode(&ClaimFormat3 {
            affinity: claim.affinity,
            free: claim.free,
        })?)
    } else if key.starts_with(&blocks) {
        let block: Block = decode_body(key, body)?;
        let mut released = block.released;
        released.extend(block.cooling.iter().map(|cooling| cooling.ordinal));
        Some(encode(&BlockFormat3 {
            cidr: block.cidr,
            affinity: block.affinity,
            sequence: block.sequence,
            next_fresh: block.next_fresh,
            released,
            allocations: block.allocations,
            attributes: block.attributes,
        })?)
    } else {
        None
    };
    match rewritten {
        Some(encoded) => out.extend_from_slice(&encoded[1..]),
        None => out.extend_from_slice(body),
    }
    Ok(out)
}
