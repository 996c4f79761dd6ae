//! The stored IPAM objects (pools, blocks, handles, config), their key layout and their versioned
//! binary encoding. `docs/data-model.md` describes the same layout for operators.
//!
//! Layered above `kv` and below `allocator`: nothing here reads or writes a store.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

pub mod codec;
pub mod error;
pub mod formats;
pub mod keys;
pub mod namespaces;
pub mod nodes;
pub mod reservations;
pub mod selector;
pub mod store_format;
pub mod timestamp;

mod block;
mod handle;
mod pool;
mod validate;

pub use block::*;
pub use codec::*;
pub use handle::*;
pub use pool::*;
pub use validate::*;

/// Every key blockipam writes starts with this.
pub const ROOT: &str = "ipam/v1/";
/// Format version written as the first byte of every stored value. Version 2 added the block's
/// free-address count to its claim index entry ([`Claim`]); version 3 added a pool's node
/// selector, assignment mode and allowed uses ([`Pool`]); version 4 added a block's claim and
/// empty timestamps and cooling addresses ([`Block`], [`Claim`]) and the IP cooldown and
/// empty-block reclaim settings ([`IpamConfig`]); every other object is laid out as in version 1.
/// Version 5 changed no object's layout, only where blocks live: an affine block whose only free
/// addresses are its edges is kept under its host's `full/` ([`keys::block_key_in`]).
/// Version 6 keeps the attributes of allocations made from then on apart from their blocks, in
/// owner keys ([`keys::owner_key`], [`APART`]), and each handle the metadata of its addresses so
/// kept ([`Handle::apart`]).
/// Version 7 changed no object's layout: from it on, every writer of what an assignment decides
/// from raises a generation in the same transaction ([`GENERATIONS_COVER_FORMAT`]), so that an
/// assignment tests the generations instead of each key.
/// Older layouts are read by [`crate::model::formats`].
pub const FORMAT_VERSION: u8 = 7;
/// The first stored format whose every writer of what an assignment decides from raises, in the
/// same transaction, the pool generation ([`keys::pool_generation`]: pools, the configuration,
/// reservations, node labels, namespace settings, confirmed reservations, the import marker) or
/// the node's generation ([`keys::node_generation`]: its registration, grace countdown and
/// activity record): a transaction that tests the two generations at the revisions its
/// decision read them tests all of those. Writers of older formats do not all keep that promise,
/// so an assignment relies on it only in a store finalized at this format or later.
pub const GENERATIONS_COVER_FORMAT: u8 = 7;
/// The newest format that changed how an object is laid out: a value of this format or a later
/// one decodes as today's objects.
pub const NEWEST_OBJECT_LAYOUT: u8 = 6;
/// Oldest format version this build reads. Objects of an older version are rewritten in the
/// format the store's writers use ([`store_format`]) the next time they are written
/// (`docs/data-model.md`, "Format versions").
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

#[cfg(test)]
mod tests;
