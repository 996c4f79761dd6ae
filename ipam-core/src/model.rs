//! The stored IPAM objects (pools, blocks, handles, config), their key layout and their versioned
//! binary encoding. `docs/data-model.md` describes the same layout for operators.

use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::error::IpamError;
use crate::selector::Selector;

/// Every key blockipam writes starts with this.
pub const ROOT: &str = "ipam/v1/";
/// Format version written as the first byte of every stored value. Version 2 added the block's
/// free-address count to its claim index entry ([`Claim`]); version 3 added a pool's node
/// selector, assignment mode and allowed uses ([`Pool`]); version 4 added a block's claim and
/// empty timestamps and cooling addresses ([`Block`], [`Claim`]) and the IP cooldown and
/// empty-block reclaim settings ([`IpamConfig`]); every other object is laid out as in version 1.
/// Older layouts are read by [`crate::formats`].
pub const FORMAT_VERSION: u8 = 4;
/// Oldest format version this build reads. Objects of an older version are rewritten in the
/// current version the next time they are written (`docs/data-model.md`, "Format versions").
pub const OLDEST_READABLE_FORMAT_VERSION: u8 = 1;

/// Default IPv4 block prefix length (64 addresses), as Calico.
pub const DEFAULT_V4_BLOCK_SIZE: u8 = 26;
/// Default IPv6 block prefix length (64 addresses), as Calico.
pub const DEFAULT_V6_BLOCK_SIZE: u8 = 122;
/// Allowed IPv4 block prefix lengths. Calico allows /20 to /32; blockipam stops at /23 (512
/// addresses) so that a full block, each address with an attribute of [`MAX_ATTRIBUTE_BYTES`],
/// stays well inside one stored value, and two full blocks (a dual-stack ADD) inside one
/// transaction (`docs/data-model.md`, "Size limits").
pub const V4_BLOCK_SIZES: std::ops::RangeInclusive<u8> = 23..=32;
/// Allowed IPv6 block prefix lengths (/119 to /128, 512 addresses at most, as for IPv4).
pub const V6_BLOCK_SIZES: std::ops::RangeInclusive<u8> = 119..=128;
/// Largest encoded size of one allocation's attribute (handle and metadata), in bytes: Kubernetes'
/// longest names (253-character pod and node names, a 64-character container id) fit.
pub const MAX_ATTRIBUTE_BYTES: usize = 1024;
/// Largest number of addresses a block of an allowed size holds.
pub const MAX_BLOCK_ADDRESSES: u32 = 512;

/// IP family of a pool, block or address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// The family of an address.
    pub fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// The family of a network.
    pub fn of_net(net: &IpNet) -> Family {
        Family::of(net.addr())
    }

    /// The path segment used in keys: `v4` or `v6`.
    pub fn segment(self) -> &'static str {
        match self {
            Family::V4 => "v4",
            Family::V6 => "v6",
        }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------------------------

/// The key layout, in one place.
pub mod keys {
    use super::*;

    /// The IPAM configuration object.
    pub fn config() -> String {
        format!("{ROOT}config")
    }

    /// Bumped on every pool write, so that pool writes (and their overlap checks) serialise.
    pub fn pool_generation() -> String {
        format!("{ROOT}pool-generation")
    }

    /// The record confirming which addresses a reservation handle holds (see
    /// `network_setup`).
    pub fn reservations_held(handle: &str) -> String {
        format!("{ROOT}reservations-held/{handle}")
    }

    /// Prefix of every pool.
    pub fn pools_dir() -> String {
        format!("{ROOT}pools/")
    }

    /// One pool, by name.
    pub fn pool(name: &str) -> String {
        format!("{ROOT}pools/{name}")
    }

    /// Prefix of every block, affine or not.
    pub fn blocks_dir() -> String {
        format!("{ROOT}blocks/")
    }

    /// Prefix of every block affine to `host` (all families, with room or full).
    pub fn host_blocks_dir(host: &str) -> String {
        format!("{ROOT}blocks/host/{host}/")
    }

    /// Prefix of the blocks affine to `host` that have a free address: the steady-state read, whose
    /// size does not grow with the number of full blocks the host owns.
    pub fn host_open_blocks_dir(host: &str) -> String {
        format!("{ROOT}blocks/host/{host}/open/")
    }

    /// Prefix of the blocks affine to `host` that are full.
    pub fn host_full_blocks_dir(host: &str) -> String {
        format!("{ROOT}blocks/host/{host}/full/")
    }

    /// Where a block with room lives: under its host's `open/` when it has an affinity, else under
    /// `unaffine/`.
    pub fn block(affinity: Option<&str>, cidr: &IpNet) -> String {
        match affinity {
            Some(host) => format!("{ROOT}blocks/host/{host}/open/{}", cidr_segment(cidr)),
            None => format!("{ROOT}blocks/unaffine/{}", cidr_segment(cidr)),
        }
    }

    /// Where a full block affine to `host` lives.
    pub fn full_block(host: &str, cidr: &IpNet) -> String {
        format!("{ROOT}blocks/host/{host}/full/{}", cidr_segment(cidr))
    }

    /// Where this block belongs, given its affinity and whether it has room.
    pub fn block_key_of(block: &Block) -> String {
        match block.affinity.as_deref() {
            Some(host) if block.free() == 0 => full_block(host, &block.cidr),
            affinity => self::block(affinity, &block.cidr),
        }
    }

    /// Every key a block with this claim entry may live at (open and full for an affine block).
    pub fn block_candidates(affinity: Option<&str>, cidr: &IpNet) -> Vec<String> {
        match affinity {
            Some(host) => vec![self::block(Some(host), cidr), full_block(host, cidr)],
            None => vec![self::block(None, cidr)],
        }
    }

    /// The claim index entry of a block CIDR: exists exactly while the block exists, value = the
    /// block's affine host (empty for none). Creating it with an "absent" condition is what makes
    /// two hosts unable to claim the same CIDR.
    pub fn block_claim(cidr: &IpNet) -> String {
        format!("{ROOT}claims/{}", cidr_segment(cidr))
    }

    /// Prefix of every claim index entry.
    pub fn claims_dir() -> String {
        format!("{ROOT}claims/")
    }

    /// The sequence floor: every block is created with a sequence number at or above it, and
    /// every block deletion raises it past the deleted block's last sequence number, so an
    /// (address, sequence) pair never repeats, whatever CIDR or block size later covers the address.
    pub fn sequence_floor() -> String {
        format!("{ROOT}sequence-floor")
    }

    /// Present exactly while a `blockipamctl import` into this store is unfinished: the allocator
    /// refuses to assign until it is gone (the store may still lack blocks, handles or pools).
    pub fn import_in_progress() -> String {
        format!("{ROOT}import-in-progress")
    }

    /// One handle.
    pub fn handle(id: &str) -> String {
        format!("{ROOT}handles/{id}")
    }

    /// Prefix of every handle.
    pub fn handles_dir() -> String {
        format!("{ROOT}handles/")
    }

    /// A CIDR as one key segment: `10.0.0.0/26` → `10.0.0.0-26`.
    pub fn cidr_segment(cidr: &IpNet) -> String {
        format!("{}-{}", cidr.network(), cidr.prefix_len())
    }

    /// Parses a key segment written by [`cidr_segment`].
    pub fn parse_cidr_segment(segment: &str) -> Option<IpNet> {
        let (addr, len) = segment.rsplit_once('-')?;
        let addr: IpAddr = addr.parse().ok()?;
        let len: u8 = len.parse().ok()?;
        IpNet::new(addr, len).ok()
    }
}

// ---------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<{ 16 * 1024 * 1024 }>()
}

/// Encodes a stored object: one format-version byte, then bincode.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, IpamError> {
    let mut out = vec![FORMAT_VERSION];
    let body = bincode::serde::encode_to_vec(value, bincode_config())
        .map_err(|e| IpamError::Internal(format!("cannot encode: {e}")))?;
    out.extend_from_slice(&body);
    Ok(out)
}

/// Splits a stored value into its format version and body; a version this build cannot read is
/// [`IpamError::Corrupt`] naming the key.
pub(crate) fn versioned<'a>(key: &str, bytes: &'a [u8]) -> Result<(u8, &'a [u8]), IpamError> {
    let (&version, body) = bytes.split_first().ok_or_else(|| IpamError::Corrupt {
        key: key.to_owned(),
        message: "empty value".into(),
    })?;
    if !(OLDEST_READABLE_FORMAT_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(IpamError::Corrupt {
            key: key.to_owned(),
            message: format!(
                "format version {version}, this build reads versions {OLDEST_READABLE_FORMAT_VERSION} to {FORMAT_VERSION}"
            ),
        });
    }
    Ok((version, body))
}

/// Decodes one bincode body that must fill `body` exactly.
pub(crate) fn decode_body<T: DeserializeOwned>(key: &str, body: &[u8]) -> Result<T, IpamError> {
    let corrupt = |message: String| IpamError::Corrupt {
        key: key.to_owned(),
        message,
    };
    let (value, used) = bincode::serde::decode_from_slice(body, bincode_config())
        .map_err(|e| corrupt(format!("cannot decode: {e}")))?;
    if used != body.len() {
        return Err(corrupt(format!("{} trailing bytes", body.len() - used)));
    }
    Ok(value)
}

/// Decodes a stored object written by [`encode`]; any damage is a [`IpamError::Corrupt`] naming the key.
/// Claim index entries have their own reader, [`decode_claim`].
///
/// Objects whose layout changed since format 1 (pools, blocks, the IPAM config) are read from
/// whichever readable version they were written in ([`crate::formats`]).
pub fn decode<T: DeserializeOwned + 'static>(key: &str, bytes: &[u8]) -> Result<T, IpamError> {
    let (version, body) = versioned(key, bytes)?;
    if version < FORMAT_VERSION {
        if let Some(upgraded) = crate::formats::decode_older::<T>(key, version, body)? {
            return Ok(upgraded);
        }
    }
    decode_body(key, body)
}

/// What a block's claim index entry holds (format 2): the block's affine host and how many of its
/// addresses are free, so that new-block searches and borrowing read these small entries instead of
/// whole blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// The block's affine host; `None` for a block nobody owns.
    pub affinity: Option<String>,
    /// Free addresses in the block when it was last written (cooling addresses included).
    pub free: u32,
    /// The block's [`Block::emptied_at`] (format 4).
    pub emptied_at: Option<u64>,
    /// When the newest of the block's cooling addresses was released (format 4).
    pub last_cooling_release: Option<u64>,
}

/// A decoded claim index entry, of any format version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimEntry {
    /// The block's affine host; `None` for a block nobody owns.
    pub affinity: Option<String>,
    /// Free addresses; `None` in an entry written by format 1, which recorded only the host (the
    /// block's next write records it).
    pub free: Option<u32>,
    /// When the block last became empty; `None` while it holds allocations, or when the entry
    /// was written by format 3 or earlier.
    pub emptied_at: Option<u64>,
    /// When the newest of its cooling addresses was released; `None` when it has none.
    pub last_cooling_release: Option<u64>,
}

impl ClaimEntry {
    /// From when the block of `cidr` counts as empty given the cooldown (see
    /// [`Block::empty_from`]): `None` while it holds allocations, or when the entry does not say
    /// (format 1).
    pub fn empty_from(&self, cidr: &IpNet, cooldown_seconds: u32) -> Option<u64> {
        let probe = Block::new(*cidr, None, 0);
        if self.free? != probe.capacity() {
            return None;
        }
        let emptied = self.emptied_at.unwrap_or(0);
        Some(match self.last_cooling_release {
            Some(released) => emptied.max(released.saturating_add(u64::from(cooldown_seconds))),
            None => emptied,
        })
    }
}

/// The claim index entry of `block`, encoded.
pub fn encode_claim(block: &Block) -> Result<Vec<u8>, IpamError> {
    encode(&Claim {
        affinity: block.affinity.clone(),
        free: block.free(),
        emptied_at: block.emptied_at,
        last_cooling_release: block.cooling.iter().map(|c| c.released_at).max(),
    })
}

/// Decodes a claim index entry of format 1 (the host alone), 2 or 3 (host and free count) or 4
/// ([`Claim`]).
pub fn decode_claim(key: &str, bytes: &[u8]) -> Result<ClaimEntry, IpamError> {
    let (version, body) = versioned(key, bytes)?;
    if version < FORMAT_VERSION {
        return crate::formats::decode_older_claim(key, version, body);
    }
    let claim: Claim = decode_body(key, body)?;
    Ok(ClaimEntry {
        affinity: claim.affinity,
        free: Some(claim.free),
        emptied_at: claim.emptied_at,
        last_cooling_release: claim.last_cooling_release,
    })
}

/// The two entries that store `block` as it is: the block at its key, and its claim index entry.
/// For writers that create whole stores (import, migration tools); the allocator writes blocks
/// through its own conditional transactions.
pub fn block_entries(block: &Block) -> Result<Vec<(String, Vec<u8>)>, IpamError> {
    Ok(vec![
        (keys::block_key_of(block), encode(block)?),
        (keys::block_claim(&block.cidr), encode_claim(block)?),
    ])
}

// ---------------------------------------------------------------------------------------------
// Objects
// ---------------------------------------------------------------------------------------------

/// IPAM-wide settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpamConfig {
    /// When true, a host never borrows addresses from blocks affine to other hosts (or to none).
    pub strict_affinity: bool,
    /// When true, a host claims new blocks as it needs them.
    pub auto_allocate_blocks: bool,
    /// Most blocks of one family a host may own; 0 means unlimited.
    pub max_blocks_per_host: u32,
    /// Seconds a released address waits before it is handed out again (Calico's
    /// `ipCooldownSeconds`); 0 (the default) reuses at once; at most [`MAX_IP_COOLDOWN_SECONDS`].
    pub ip_cooldown_seconds: u32,
    /// Seconds a block must have been empty before another host may take it over when its pools
    /// have no unclaimed block left (Calico's `EmptyBlockMinReclaimAge`, default 60).
    pub empty_block_reclaim_seconds: u32,
}

impl IpamConfig {
    /// Rejects settings out of range.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an IP cooldown over [`MAX_IP_COOLDOWN_SECONDS`].
    pub fn validate(&self) -> Result<(), IpamError> {
        if self.ip_cooldown_seconds > MAX_IP_COOLDOWN_SECONDS {
            return Err(IpamError::InvalidArgument(format!(
                "IP cooldown {} s is over the {MAX_IP_COOLDOWN_SECONDS} s limit (as Calico's ipCooldownSeconds)",
                self.ip_cooldown_seconds
            )));
        }
        Ok(())
    }
}

/// Longest IP cooldown, as Calico (20 minutes).
pub const MAX_IP_COOLDOWN_SECONDS: u32 = 1200;
/// Default [`IpamConfig::empty_block_reclaim_seconds`], Calico's `EmptyBlockMinReclaimAge`.
pub const DEFAULT_EMPTY_BLOCK_RECLAIM_SECONDS: u32 = 60;

impl Default for IpamConfig {
    fn default() -> Self {
        IpamConfig {
            strict_affinity: false,
            auto_allocate_blocks: true,
            max_blocks_per_host: 20,
            ip_cooldown_seconds: 0,
            empty_block_reclaim_seconds: DEFAULT_EMPTY_BLOCK_RECLAIM_SECONDS,
        }
    }
}

/// A range of addresses that blocks are carved from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    /// Unique name (letters, digits, `.`, `_`, `-`, `:`).
    pub name: String,
    /// The pool's network (a network address, no host bits).
    pub cidr: IpNet,
    /// Prefix length of the pool's blocks.
    pub block_size: u8,
    /// A disabled pool is never allocated from.
    pub disabled: bool,
    /// The nodes that auto-assign from this pool (Calico's `nodeSelector`); `all()` by default.
    /// A pool named explicitly is used whatever it selects.
    pub node_selector: Selector,
    /// Whether auto-assign may pick this pool by itself (Calico's `assignmentMode`).
    pub assignment_mode: AssignmentMode,
    /// What its addresses may be used for (Calico's `allowedUses`).
    pub allowed_uses: AllowedUses,
}

/// How a pool's addresses are handed out (Calico's `assignmentMode`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum AssignmentMode {
    /// Auto-assign picks the pool by itself (when it selects the node).
    #[default]
    Automatic,
    /// Only when named (netconf `ipv4_pools`/`ipv6_pools`), or for an explicitly requested
    /// address.
    Manual,
}

impl std::str::FromStr for AssignmentMode {
    type Err = IpamError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "automatic" => Ok(AssignmentMode::Automatic),
            "manual" => Ok(AssignmentMode::Manual),
            other => Err(IpamError::invalid(format!(
                "assignment mode {other:?}: expected automatic or manual"
            ))),
        }
    }
}

impl std::fmt::Display for AssignmentMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AssignmentMode::Automatic => "automatic",
            AssignmentMode::Manual => "manual",
        })
    }
}

/// One use a pool's addresses may be put to (Calico's `allowedUses`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum AllowedUse {
    /// Pod (workload) addresses: every CNI request.
    #[default]
    Workload,
    /// A node's tunnel addresses (IPIP, VXLAN, WireGuard).
    Tunnel,
    /// Load-balancer service addresses.
    Loadbalancer,
}

impl std::fmt::Display for AllowedUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AllowedUse::Workload => "workload",
            AllowedUse::Tunnel => "tunnel",
            AllowedUse::Loadbalancer => "loadbalancer",
        })
    }
}

/// A pool's allowed uses: a non-empty set; `loadbalancer` only alone (as Calico). Default:
/// workload and tunnel.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "Vec<AllowedUse>", into = "Vec<AllowedUse>")]
pub struct AllowedUses(std::collections::BTreeSet<AllowedUse>);

impl AllowedUses {
    /// Validates a set of uses.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an empty set, or `loadbalancer` with another use.
    pub fn new(uses: impl IntoIterator<Item = AllowedUse>) -> Result<Self, IpamError> {
        let set: std::collections::BTreeSet<AllowedUse> = uses.into_iter().collect();
        if set.is_empty() {
            return Err(IpamError::invalid(
                "allowed uses may not be empty (workload, tunnel, loadbalancer)",
            ));
        }
        if set.contains(&AllowedUse::Loadbalancer) && set.len() > 1 {
            return Err(IpamError::invalid(
                "allowed use loadbalancer may not be combined with another use (as in Calico)",
            ));
        }
        Ok(AllowedUses(set))
    }

    /// Parses a comma-separated list (`workload,tunnel`).
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an unknown use or an invalid set.
    pub fn parse(text: &str) -> Result<Self, IpamError> {
        let mut uses = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            uses.push(match part.to_ascii_lowercase().as_str() {
                "workload" => AllowedUse::Workload,
                "tunnel" => AllowedUse::Tunnel,
                "loadbalancer" => AllowedUse::Loadbalancer,
                other => {
                    return Err(IpamError::invalid(format!(
                        "allowed use {other:?}: expected workload, tunnel or loadbalancer"
                    )))
                }
            });
        }
        AllowedUses::new(uses)
    }

    /// Whether `use_` is allowed.
    pub fn allows(&self, use_: AllowedUse) -> bool {
        self.0.contains(&use_)
    }

    /// The uses, in order.
    pub fn iter(&self) -> impl Iterator<Item = AllowedUse> + '_ {
        self.0.iter().copied()
    }
}

impl Default for AllowedUses {
    fn default() -> Self {
        AllowedUses(
            [AllowedUse::Workload, AllowedUse::Tunnel]
                .into_iter()
                .collect(),
        )
    }
}

impl TryFrom<Vec<AllowedUse>> for AllowedUses {
    type Error = IpamError;

    fn try_from(uses: Vec<AllowedUse>) -> Result<Self, Self::Error> {
        AllowedUses::new(uses)
    }
}

impl From<AllowedUses> for Vec<AllowedUse> {
    fn from(uses: AllowedUses) -> Self {
        uses.0.into_iter().collect()
    }
}

impl std::fmt::Display for AllowedUses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.iter().map(|u| u.to_string()).collect();
        f.write_str(&names.join(","))
    }
}

/// Decodes a stored pool of any readable format (formats 1 and 2 get `all()`, automatic, and
/// workload and tunnel).
///
/// # Errors
/// [`IpamError::Corrupt`] naming the key.
pub fn decode_pool(key: &str, bytes: &[u8]) -> Result<Pool, IpamError> {
    decode(key, bytes)
}

impl Pool {
    /// The pool's family.
    pub fn family(&self) -> Family {
        Family::of_net(&self.cidr)
    }

    /// Number of blocks the pool holds (saturating at `u128::MAX`).
    pub fn block_count(&self) -> u128 {
        1u128
            .checked_shl(u32::from(self.block_size - self.cidr.prefix_len()))
            .unwrap_or(u128::MAX)
    }

    /// The `index`th block of the pool, counting from its first address.
    pub fn block_at(&self, index: u128) -> Option<IpNet> {
        let step = 1u128.checked_shl(u32::from(host_bits(self.family()) - self.block_size))?;
        let start = ip_to_u128(self.cidr.network()).checked_add(index.checked_mul(step)?)?;
        IpNet::new(u128_to_ip(self.family(), start), self.block_size).ok()
    }

    /// The block of this pool that contains `ip`.
    pub fn block_containing(&self, ip: IpAddr) -> Option<IpNet> {
        if !self.cidr.contains(&ip) {
            return None;
        }
        IpNet::new(ip, self.block_size).ok().map(|n| n.trunc())
    }

    /// Number of addresses the pool spans (saturating).
    pub fn capacity(&self) -> u128 {
        1u128
            .checked_shl(u32::from(host_bits(self.family()) - self.cidr.prefix_len()))
            .unwrap_or(u128::MAX)
    }
}

/// Total address bits of a family.
pub fn host_bits(family: Family) -> u8 {
    match family {
        Family::V4 => 32,
        Family::V6 => 128,
    }
}

/// An address as an integer.
pub fn ip_to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// An integer as an address of `family` (IPv4 keeps the low 32 bits).
pub fn u128_to_ip(family: Family, value: u128) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(std::net::Ipv4Addr::from(value as u32)),
        Family::V6 => IpAddr::V6(std::net::Ipv6Addr::from(value)),
    }
}

/// Who an allocation belongs to and what it is for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attribute {
    /// The allocation's owner (normally `<network>.<container id>`).
    pub handle: String,
    /// Free-form metadata: `node`, `namespace`, `pod`, `container_id`, `interface`, `timestamp`.
    pub metadata: BTreeMap<String, String>,
}

/// One allocated ordinal of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// Index into the block's attribute table.
    pub attribute: u32,
    /// The block's sequence number when this allocation was made.
    pub sequence: u64,
}

/// A power-of-two slice of a pool, and the authority on which of its addresses are in use.
///
/// The free list is kept compact: ordinals from `next_fresh` up that are neither allocated nor
/// queued in `released` were never handed out and come first, in ascending order; after them come
/// the `released` ordinals in release order. So a /20 block costs nothing per free address, and a
/// released address is the last to be reused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    /// The block's network.
    pub cidr: IpNet,
    /// The host this block is affine to, if any.
    pub affinity: Option<String>,
    /// Bumped on every write of the block.
    pub sequence: u64,
    /// Ordinals at or above this that are not allocated and not in `released` were never used.
    pub next_fresh: u32,
    /// Freed ordinals, oldest first: reused in this order once fresh ordinals run out.
    pub released: VecDeque<u32>,
    /// Allocated ordinals.
    pub allocations: BTreeMap<u32, Allocation>,
    /// Attributes referenced by allocations.
    pub attributes: Vec<Attribute>,
    /// When the block was claimed, in seconds since the Unix epoch by the claimer's clock; `None`
    /// for a block written by format 3 or earlier (format 4).
    pub claimed_at: Option<u64>,
    /// When its last allocation was released (or, for a block that never held one, when it was
    /// claimed), while it holds none; `None` while it holds allocations, or when a format 3 or
    /// earlier block never said (format 4).
    pub emptied_at: Option<u64>,
    /// Addresses released while an IP cooldown was set, oldest release first: neither free nor
    /// in use until their cooldown has passed, when the next write of the block queues them on
    /// `released` (format 4).
    pub cooling: VecDeque<CoolingAddress>,
}

/// An address of a block in IP cooldown (see [`IpamConfig::ip_cooldown_seconds`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoolingAddress {
    /// The address's ordinal in its block.
    pub ordinal: u32,
    /// When it was released, in seconds since the Unix epoch by the releaser's clock.
    pub released_at: u64,
}

/// The time and cooldown a block change is made under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Lifetime {
    /// Now, in seconds since the Unix epoch.
    pub now: u64,
    /// The IP cooldown in force ([`IpamConfig::ip_cooldown_seconds`]).
    pub cooldown_seconds: u32,
}

impl Lifetime {
    /// Whether an address released at `released_at` has finished cooling. A release stamped in the
    /// future (a releaser whose clock runs ahead) cools for that much longer.
    pub fn cooled(&self, released_at: u64) -> bool {
        released_at.saturating_add(u64::from(self.cooldown_seconds)) <= self.now
    }
}

impl Block {
    /// A new, empty block whose sequence numbers start at `first_sequence` (the store's sequence
    /// floor, see [`keys::sequence_floor`]).
    pub fn new(cidr: IpNet, affinity: Option<String>, first_sequence: u64) -> Block {
        Block {
            cidr: cidr.trunc(),
            affinity,
            sequence: first_sequence,
            next_fresh: 0,
            released: VecDeque::new(),
            allocations: BTreeMap::new(),
            attributes: Vec::new(),
            claimed_at: None,
            emptied_at: None,
            cooling: VecDeque::new(),
        }
    }

    /// A new, empty block claimed at `now` (seconds since the Unix epoch).
    pub fn claimed(cidr: IpNet, affinity: Option<String>, first_sequence: u64, now: u64) -> Block {
        Block {
            claimed_at: Some(now),
            emptied_at: Some(now),
            ..Block::new(cidr, affinity, first_sequence)
        }
    }

    /// Number of addresses in the block.
    pub fn capacity(&self) -> u32 {
        let bits = u32::from(host_bits(Family::of_net(&self.cidr)) - self.cidr.prefix_len());
        1u32.checked_shl(bits).unwrap_or(u32::MAX)
    }

    /// Number of allocated addresses.
    pub fn in_use(&self) -> u32 {
        self.allocations.len() as u32
    }

    /// Number of addresses not allocated: the free ones and the cooling ones (which a later
    /// write frees). What decides whether a block has room and what its claim entry records.
    pub fn free(&self) -> u32 {
        self.capacity() - self.in_use()
    }

    /// Addresses still cooling under `lifetime`.
    pub fn cooling_at(&self, lifetime: Lifetime) -> u32 {
        self.cooling
            .iter()
            .filter(|c| !lifetime.cooled(c.released_at))
            .count() as u32
    }

    /// True when nothing is allocated and no address is in cooldown.
    pub fn is_empty(&self) -> bool {
        self.allocations.is_empty() && self.cooling.is_empty()
    }

    /// From when the block counts as empty under a cooldown of `cooldown_seconds`: when its last
    /// allocation was released or its last cooling address cools, whichever is later. `None` while
    /// it holds allocations. A block written by format 3 or earlier, which never recorded when it
    /// became empty, counts as empty since the epoch.
    pub fn empty_from(&self, cooldown_seconds: u32) -> Option<u64> {
        if !self.allocations.is_empty() {
            return None;
        }
        let emptied = self.emptied_at.unwrap_or(0);
        Some(
            self.cooling
                .iter()
                .map(|c| c.released_at.saturating_add(u64::from(cooldown_seconds)))
                .fold(emptied, u64::max),
        )
    }

    /// Queues the cooling addresses whose cooldown has passed on the free list (in release order),
    /// so the next allocation may take them. True when any moved.
    pub fn finish_cooling(&mut self, lifetime: Lifetime) -> bool {
        let mut moved = false;
        // Oldest first; one still cooling keeps the ones behind it (released later) in place.
        while let Some(first) = self.cooling.front().copied() {
            if !lifetime.cooled(first.released_at) {
                break;
            }
            self.cooling.pop_front();
            self.released.push_back(first.ordinal);
            moved = true;
        }
        moved
    }

    /// The address of an ordinal.
    pub fn ip_of(&self, ordinal: u32) -> IpAddr {
        u128_to_ip(
            Family::of_net(&self.cidr),
            ip_to_u128(self.cidr.network()) + u128::from(ordinal),
        )
    }

    /// The ordinal of an address inside the block.
    pub fn ordinal_of(&self, ip: IpAddr) -> Option<u32> {
        if !self.cidr.contains(&ip) {
            return None;
        }
        u32::try_from(ip_to_u128(ip) - ip_to_u128(self.cidr.network())).ok()
    }

    /// Hands out the next free ordinal in free-list order, recording `attribute` for it.
    pub fn allocate_next(&mut self, attribute: &Attribute) -> Option<u32> {
        let ordinal = self.next_free_ordinal(|_| true)?;
        self.take(ordinal, attribute);
        Some(ordinal)
    }

    /// As [`allocate_next`](Block::allocate_next), but never the block's network address or last
    /// address (see [`is_edge`](Block::is_edge)): the next free host address of the block's prefix.
    pub fn allocate_next_host_address(&mut self, attribute: &Attribute) -> Option<u32> {
        let edges = self.edges();
        let ordinal = self.next_free_ordinal(|o| !edges.contains(&o))?;
        self.take(ordinal, attribute);
        Some(ordinal)
    }

    /// True for the block's network address and its last (IPv4 broadcast) address when the block
    /// is large enough to have them: larger than /31 (IPv4) or /127 (IPv6).
    pub fn is_edge(&self, ordinal: u32) -> bool {
        self.edges().contains(&ordinal)
    }

    fn edges(&self) -> Vec<u32> {
        let bits = host_bits(Family::of_net(&self.cidr)) - self.cidr.prefix_len();
        if bits >= 2 {
            vec![0, self.capacity() - 1]
        } else {
            Vec::new()
        }
    }

    /// The first free ordinal in free-list order that `allowed` accepts. Ordinals it rejects keep
    /// their place in the free list.
    fn next_free_ordinal(&mut self, allowed: impl Fn(u32) -> bool) -> Option<u32> {
        let capacity = self.capacity();
        // Move the fresh cursor past ordinals that are no longer fresh.
        while self.next_fresh < capacity
            && (self.allocations.contains_key(&self.next_fresh)
                || self.released.contains(&self.next_fresh)
                || self.is_cooling(self.next_fresh))
        {
            self.next_fresh += 1;
        }
        let fresh = (self.next_fresh..capacity).find(|candidate| {
            !self.allocations.contains_key(candidate)
                && !self.released.contains(candidate)
                && !self.is_cooling(*candidate)
                && allowed(*candidate)
        });
        fresh.or_else(|| self.released.iter().copied().find(|o| allowed(*o)))
    }

    /// Allocates a given ordinal; false when it is already allocated or outside the block.
    pub fn allocate_ordinal(&mut self, ordinal: u32, attribute: &Attribute) -> bool {
        if ordinal >= self.capacity() || self.allocations.contains_key(&ordinal) {
            return false;
        }
        self.take(ordinal, attribute);
        true
    }

    /// Whether an ordinal is in cooldown.
    pub fn is_cooling(&self, ordinal: u32) -> bool {
        self.cooling.iter().any(|c| c.ordinal == ordinal)
    }

    fn take(&mut self, ordinal: u32, attribute: &Attribute) {
        if let Some(position) = self.released.iter().position(|o| *o == ordinal) {
            self.released.remove(position);
        }
        // Only an explicit request takes a cooling address.
        if let Some(position) = self.cooling.iter().position(|c| c.ordinal == ordinal) {
            self.cooling.remove(position);
        }
        self.emptied_at = None;
        if ordinal == self.next_fresh {
            self.next_fresh += 1;
        }
        let index = match self.attributes.iter().position(|a| a == attribute) {
            Some(index) => index,
            None => {
                self.attributes.push(attribute.clone());
                self.attributes.len() - 1
            }
        };
        self.allocations.insert(
            ordinal,
            Allocation {
                attribute: index as u32,
                sequence: self.sequence,
            },
        );
    }

    /// Frees an ordinal at `lifetime.now`: to the tail of the free list, or, with a cooldown set,
    /// into cooling. Returns the freed allocation's attribute, or `None` when it was not allocated.
    pub fn release_ordinal(&mut self, ordinal: u32, lifetime: Lifetime) -> Option<Attribute> {
        let allocation = self.allocations.remove(&ordinal)?;
        let attribute = self.attributes.get(allocation.attribute as usize).cloned();
        if lifetime.cooldown_seconds == 0 {
            // To the tail, whether or not the fresh cursor has passed it: the cursor skips queued ordinals.
            self.released.push_back(ordinal);
        } else {
            self.cooling.push_back(CoolingAddress {
                ordinal,
                released_at: lifetime.now,
            });
        }
        if self.allocations.is_empty() {
            self.emptied_at = Some(lifetime.now);
        }
        self.compact_attributes();
        attribute
    }

    /// The attribute of an allocated ordinal.
    pub fn attribute_of(&self, ordinal: u32) -> Option<&Attribute> {
        let allocation = self.allocations.get(&ordinal)?;
        self.attributes.get(allocation.attribute as usize)
    }

    /// Ordinals held by `handle`.
    pub fn ordinals_of_handle(&self, handle: &str) -> Vec<u32> {
        self.allocations
            .iter()
            .filter(|(_, a)| {
                self.attributes
                    .get(a.attribute as usize)
                    .is_some_and(|attr| attr.handle == handle)
            })
            .map(|(o, _)| *o)
            .collect()
    }

    /// Drops attributes no allocation refers to, renumbering the rest.
    fn compact_attributes(&mut self) {
        let mut used = vec![false; self.attributes.len()];
        for allocation in self.allocations.values() {
            if let Some(flag) = used.get_mut(allocation.attribute as usize) {
                *flag = true;
            }
        }
        if used.iter().all(|u| *u) {
            return;
        }
        let mut remap = vec![u32::MAX; self.attributes.len()];
        let mut kept = Vec::new();
        for (index, attribute) in std::mem::take(&mut self.attributes).into_iter().enumerate() {
            if used[index] {
                remap[index] = kept.len() as u32;
                kept.push(attribute);
            }
        }
        self.attributes = kept;
        for allocation in self.allocations.values_mut() {
            if let Some(new) = remap.get(allocation.attribute as usize) {
                allocation.attribute = *new;
            }
        }
    }

    /// Describes every way this block's own bookkeeping is inconsistent (empty when sound).
    pub fn self_check(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let capacity = self.capacity();
        if self.cidr.trunc() != self.cidr {
            problems.push(format!("block CIDR {} has host bits set", self.cidr));
        }
        let mut seen = std::collections::HashSet::new();
        for ordinal in &self.released {
            if *ordinal >= capacity {
                problems.push(format!("free-list ordinal {ordinal} is outside the block"));
            }
            if !seen.insert(*ordinal) {
                problems.push(format!("ordinal {ordinal} appears twice in the free list"));
            }
            if self.allocations.contains_key(ordinal) {
                problems.push(format!(
                    "ordinal {ordinal} ({}) is both allocated and free",
                    self.ip_of(*ordinal)
                ));
            }
        }
        for (ordinal, allocation) in &self.allocations {
            if *ordinal >= capacity {
                problems.push(format!("allocated ordinal {ordinal} is outside the block"));
            }
            if allocation.attribute as usize >= self.attributes.len() {
                problems.push(format!(
                    "ordinal {ordinal} refers to missing attribute {}",
                    allocation.attribute
                ));
            }
            if allocation.sequence > self.sequence {
                problems.push(format!(
                    "ordinal {ordinal} was allocated at sequence {} after the block's {}",
                    allocation.sequence, self.sequence
                ));
            }
        }
        for cooling in &self.cooling {
            let ordinal = cooling.ordinal;
            if ordinal >= capacity {
                problems.push(format!("cooling ordinal {ordinal} is outside the block"));
            }
            if !seen.insert(ordinal) {
                problems.push(format!(
                    "ordinal {ordinal} is cooling twice, or both cooling and free"
                ));
            }
            if self.allocations.contains_key(&ordinal) {
                problems.push(format!(
                    "ordinal {ordinal} ({}) is both allocated and cooling",
                    self.ip_of(ordinal)
                ));
            }
        }
        if self.next_fresh > capacity {
            problems.push(format!(
                "next fresh ordinal {} is past the block's {capacity} addresses",
                self.next_fresh
            ));
        }
        problems
    }
}

/// One allocation owner: how many addresses it holds in each block.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Handle {
    /// Addresses held, per block CIDR.
    pub blocks: BTreeMap<IpNet, u32>,
}

impl Handle {
    /// Total addresses held.
    pub fn total(&self) -> u64 {
        self.blocks.values().map(|c| u64::from(*c)).sum()
    }

    /// Adds `count` addresses in `block`.
    pub fn add(&mut self, block: IpNet, count: u32) {
        *self.blocks.entry(block).or_insert(0) += count;
    }

    /// Removes `count` addresses in `block`, dropping the entry at zero.
    pub fn remove(&mut self, block: IpNet, count: u32) {
        if let Some(held) = self.blocks.get_mut(&block) {
            *held = held.saturating_sub(count);
            if *held == 0 {
                self.blocks.remove(&block);
            }
        }
    }
}

/// Rejects host names that cannot be a key segment.
pub fn validate_host(host: &str) -> Result<(), IpamError> {
    if host.is_empty() || host.len() > 253 {
        return Err(IpamError::InvalidArgument(format!(
            "host name {host:?} must be 1 to 253 characters"
        )));
    }
    if host.contains('/') || host.chars().any(|c| c.is_control()) {
        return Err(IpamError::InvalidArgument(format!(
            "host name {host:?} may not contain '/' or control characters"
        )));
    }
    Ok(())
}

/// Rejects handle ids that cannot be stored faithfully.
pub fn validate_handle(handle: &str) -> Result<(), IpamError> {
    if handle.is_empty() || handle.len() > 512 || handle.chars().any(|c| c.is_control()) {
        return Err(IpamError::InvalidArgument(format!(
            "handle id {handle:?} must be 1 to 512 printable characters"
        )));
    }
    Ok(())
}

/// Longest name of a pool or a reservation (a Kubernetes object name).
pub const MAX_OBJECT_NAME: usize = 253;

/// Rejects pool names outside `[A-Za-z0-9._:-]{1,253}`.
pub fn validate_pool_name(name: &str) -> Result<(), IpamError> {
    validate_object_name("pool", name)
}

/// Rejects a name of a stored object (`what`: "pool", "reservation") outside
/// `[A-Za-z0-9._:-]{1,253}`: the names key paths may carry.
pub(crate) fn validate_object_name(what: &str, name: &str) -> Result<(), IpamError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_OBJECT_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'));
    if ok {
        Ok(())
    } else {
        Err(IpamError::InvalidArgument(format!(
            "{what} name {name:?} must be 1 to {MAX_OBJECT_NAME} of letters, digits, '.', '_', '-', ':'"
        )))
    }
}

/// The name a pool gets when none is given: its CIDR with `/` replaced by `-` (`10.0.0.0-16`).
pub fn default_pool_name(cidr: &IpNet) -> String {
    keys::cidr_segment(cidr)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(handle: &str) -> Attribute {
        Attribute {
            handle: handle.into(),
            metadata: BTreeMap::new(),
        }
    }

    fn net(s: &str) -> IpNet {
        s.parse().expect("cidr")
    }

    #[test]
    fn fresh_ordinals_come_first_and_released_ones_are_reused_last() {
        let mut block = Block::new(net("10.0.0.0/30"), None, 0);
        let a = attr("a");
        assert_eq!(block.allocate_next(&a), Some(0));
        assert_eq!(block.allocate_next(&a), Some(1));
        block.release_ordinal(0, Lifetime::default());
        assert_eq!(block.allocate_next(&a), Some(2));
        assert_eq!(block.allocate_next(&a), Some(3));
        assert_eq!(block.allocate_next(&a), Some(0));
        assert_eq!(block.allocate_next(&a), None);
        assert!(block.self_check().is_empty());
    }

    #[test]
    fn specific_ordinal_is_skipped_by_the_fresh_cursor_and_queued_when_released() {
        let mut block = Block::new(net("10.0.0.0/29"), None, 0);
        let a = attr("a");
        assert!(block.allocate_ordinal(3, &a));
        assert!(!block.allocate_ordinal(3, &a));
        block.release_ordinal(3, Lifetime::default());
        let order: Vec<u32> = std::iter::from_fn(|| block.allocate_next(&a)).collect();
        assert_eq!(order, vec![0, 1, 2, 4, 5, 6, 7, 3]);
        assert!(block.self_check().is_empty());
    }

    #[test]
    fn host_address_allocation_skips_block_edges_and_keeps_them_free() {
        let mut block = Block::new(net("10.0.0.8/29"), None, 0);
        let a = attr("a");
        let order: Vec<u32> = std::iter::from_fn(|| block.allocate_next_host_address(&a)).collect();
        assert_eq!(order, vec![1, 2, 3, 4, 5, 6]);
        assert_eq!(block.free(), 2);
        // The edges are still free for callers that may use them, in free-list order.
        assert_eq!(block.allocate_next(&a), Some(0));
        assert_eq!(block.allocate_next(&a), Some(7));
        assert!(block.self_check().is_empty());
        // /31 and /32 blocks (and /127, /128) have no edges.
        let mut small = Block::new(net("10.0.0.0/31"), None, 0);
        assert_eq!(small.allocate_next_host_address(&a), Some(0));
        assert_eq!(small.allocate_next_host_address(&a), Some(1));
        let v6 = Block::new(net("fd00::/126"), None, 0);
        assert!(v6.is_edge(0) && v6.is_edge(3) && !v6.is_edge(1));
    }

    #[test]
    fn unused_attributes_are_dropped_and_indices_stay_valid() {
        let mut block = Block::new(net("10.0.0.0/29"), None, 0);
        block.allocate_next(&attr("a"));
        block.allocate_next(&attr("b"));
        block.allocate_next(&attr("a"));
        assert_eq!(block.attributes.len(), 2);
        block.release_ordinal(0, Lifetime::default());
        block.release_ordinal(2, Lifetime::default());
        assert_eq!(block.attributes.len(), 1);
        assert_eq!(block.attribute_of(1).map(|a| a.handle.as_str()), Some("b"));
        assert!(block.self_check().is_empty());
    }

    #[test]
    fn large_block_encoding_is_small_when_mostly_free() {
        let mut block = Block::new(net("10.0.0.0/23"), Some("host-a".into()), 0);
        for i in 0..10 {
            block.allocate_next(&attr(&format!("h{i}")));
        }
        let bytes = encode(&block).expect("encode");
        assert!(
            bytes.len() < 1024,
            "a /23 block with 10 allocations took {} bytes",
            bytes.len()
        );
        let back: Block = decode("k", &bytes).expect("decode");
        assert_eq!(back, block);
    }

    #[test]
    fn decoding_damaged_bytes_is_an_error_not_a_panic() {
        let block = Block::new(net("fd00::/122"), Some("h".into()), 0);
        let bytes = encode(&block).expect("encode");
        for cut in 0..bytes.len() {
            assert!(
                decode::<Block>("k", &bytes[..cut]).is_err(),
                "truncated at {cut} decoded"
            );
        }
        let mut wrong_version = bytes.clone();
        wrong_version[0] = 99;
        assert!(matches!(
            decode::<Block>("k", &wrong_version),
            Err(IpamError::Corrupt { .. })
        ));
        let mut trailing = bytes;
        trailing.push(0);
        assert!(decode::<Block>("k", &trailing).is_err());
    }

    #[test]
    fn cidr_segments_round_trip_for_both_families() {
        for s in ["10.0.0.0/26", "fd00::/122", "0.0.0.0/0", "2001:db8::40/122"] {
            let n = net(s);
            assert_eq!(keys::parse_cidr_segment(&keys::cidr_segment(&n)), Some(n));
        }
    }

    #[test]
    fn pool_block_arithmetic() {
        let pool = Pool {
            name: "p".into(),
            cidr: net("10.1.0.0/24"),
            block_size: 26,
            disabled: false,
            ..Pool::default()
        };
        assert_eq!(pool.block_count(), 4);
        assert_eq!(pool.block_at(3), Some(net("10.1.0.192/26")));
        assert_eq!(
            pool.block_containing("10.1.0.77".parse().expect("ip")),
            Some(net("10.1.0.64/26"))
        );
        assert_eq!(pool.block_containing("10.2.0.1".parse().expect("ip")), None);
        let v6 = Pool {
            name: "p6".into(),
            cidr: net("fd00::/64"),
            block_size: 122,
            disabled: false,
            ..Pool::default()
        };
        assert_eq!(v6.block_count(), 1u128 << 58);
        assert_eq!(v6.block_at(1), Some(net("fd00::40/122")));
    }
}
