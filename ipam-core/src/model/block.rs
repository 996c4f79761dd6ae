//! Blocks and their allocations: address arithmetic, the allocations' attributes, cooling
//! addresses and the block's own bookkeeping.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::model::error::IpamError;
use crate::model::Family;

/// The attribute index of an allocation whose attribute is kept apart from the block value (in
/// its owner key, [`crate::model::keys::owner_key`]), so that a block's stored size does not grow
/// with its allocations' attributes. Only a store whose writers use [`OWNERS_APART_FORMAT`] or
/// later holds such allocations.
pub const APART: u32 = u32::MAX;

/// The first stored format that keeps allocations' attributes apart from block values ([`APART`]).
pub const OWNERS_APART_FORMAT: u8 = 6;

/// Total address bits of a family.
pub fn host_bits(family: Family) -> u8 {
    match family {
        Family::V4 => 32,
        Family::V6 => 128,
    }
}

/// Addresses in a block of this CIDR.
pub fn block_capacity(cidr: &IpNet) -> u32 {
    let bits = u32::from(host_bits(Family::of_net(cidr)) - cidr.prefix_len());
    1u32.checked_shl(bits).unwrap_or(u32::MAX)
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
    /// Free-form metadata: `node`, `namespace`, `pod`, `container_id`, `interface`, `network`,
    /// `timestamp`; a tunnel address's `type`; a network gateway's `purpose`.
    pub metadata: BTreeMap<String, String>,
}

/// One allocated ordinal of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// Index into the block's attribute table, or [`APART`] for an attribute kept in the
    /// allocation's owner key.
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
///
/// Equality compares what the block records (its stored fields), not what was learned about its
/// apart attributes since it was read.
#[derive(Debug, Clone, Eq, Serialize, Deserialize)]
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
    /// What was learned, since the block was read, about the attributes it keeps apart; never
    /// stored in the block value.
    #[serde(skip)]
    apart: ApartAttributes,
}

/// The attributes of a block's [`APART`] allocations known in memory, and the changes to them a
/// write of the block must carry to their owner keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ApartAttributes {
    /// Attributes of apart allocations, from their owner keys or their handles.
    loaded: BTreeMap<u32, Attribute>,
    /// Handles whose every apart allocation in this block is in `loaded` (learned from the
    /// handle, which names them all).
    complete_for: BTreeSet<String>,
    /// Ordinals allocated since the block was read: their attributes are in the attribute table
    /// until [`Block::move_taken_apart`].
    taken: BTreeSet<u32>,
    /// Apart ordinals released since the block was read: their owner keys go with the write.
    freed: BTreeSet<u32>,
}

impl PartialEq for Block {
    fn eq(&self, other: &Self) -> bool {
        self.cidr == other.cidr
            && self.affinity == other.affinity
            && self.sequence == other.sequence
            && self.next_fresh == other.next_fresh
            && self.released == other.released
            && self.allocations == other.allocations
            && self.attributes == other.attributes
            && self.claimed_at == other.claimed_at
            && self.emptied_at == other.emptied_at
            && self.cooling == other.cooling
    }
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
    /// Whether an address released at `released_at` has finished cooling (see [`cooldown_end`]).
    /// A release stamped in the future (a releaser whose clock runs ahead) cools for that much
    /// longer.
    pub fn cooled(&self, released_at: u64) -> bool {
        cooldown_end(released_at, self.cooldown_seconds) <= self.now
    }

    /// The first whole second at which an address released at `released_at` has cooled.
    pub fn cooldown_end(&self, released_at: u64) -> u64 {
        cooldown_end(released_at, self.cooldown_seconds)
    }
}

/// The first whole second at which an address released at `released_at` has cooled under a
/// cooldown of `cooldown_seconds`. Times are whole seconds: an address released at 100.9 s is
/// stamped 100, so with a 30 s cooldown it cools at 131, never before 30 s of real time have
/// passed (at most 32). With no cooldown, an address still cooling from an earlier, longer one is
/// cooled from its release.
pub fn cooldown_end(released_at: u64, cooldown_seconds: u32) -> u64 {
    if cooldown_seconds == 0 {
        return released_at;
    }
    released_at
        .saturating_add(u64::from(cooldown_seconds))
        .saturating_add(1)
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
            apart: ApartAttributes::default(),
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
        block_capacity(&self.cidr)
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
        self.cooling_ordinals_at(lifetime).count() as u32
    }

    /// The ordinals of the addresses still cooling under `lifetime`, oldest release first.
    pub fn cooling_ordinals_at(&self, lifetime: Lifetime) -> impl Iterator<Item = u32> + '_ {
        self.cooling
            .iter()
            .filter(move |c| !lifetime.cooled(c.released_at))
            .map(|c| c.ordinal)
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
                .map(|c| cooldown_end(c.released_at, cooldown_seconds))
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

    /// True when the block's only free addresses (cooling ones included) are both its edges
    /// ([`is_edge`](Block::is_edge)): how requests that skip edges leave a block they filled, and
    /// why they find no room in it. A block with one edge free is not such a block: requests that
    /// take edges fill a block from its network address on, and its last address is still theirs.
    pub fn only_its_edges_free(&self) -> bool {
        let edges = self.edges();
        !edges.is_empty()
            && self.free() == edges.len() as u32
            && edges
                .iter()
                .all(|ordinal| !self.allocations.contains_key(ordinal))
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
        self.apart.taken.insert(ordinal);
    }

    /// Frees an ordinal at `lifetime.now`: to the tail of the free list, or, with a cooldown set,
    /// into cooling. Returns the freed allocation's attribute, or `None` when it was not allocated
    /// (or its attribute entry is missing, which [`Block::self_check`] reports).
    ///
    /// # Errors
    /// [`IpamError::AttributeNotLoaded`] for an allocation whose attribute is kept apart and was
    /// not loaded (nothing is changed).
    pub fn release_ordinal(
        &mut self,
        ordinal: u32,
        lifetime: Lifetime,
    ) -> Result<Option<Attribute>, IpamError> {
        if !self.allocations.contains_key(&ordinal) {
            return Ok(None);
        }
        // Read before anything changes: an apart attribute not loaded refuses the release.
        let attribute = self.attribute_of(ordinal)?.cloned();
        if self
            .allocations
            .remove(&ordinal)
            .is_some_and(|a| a.attribute == APART)
        {
            self.apart.loaded.remove(&ordinal);
            self.apart.freed.insert(ordinal);
        }
        self.apart.taken.remove(&ordinal);
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
        Ok(attribute)
    }

    /// The attribute of an allocated ordinal; `None` when it is not allocated.
    ///
    /// # Errors
    /// [`IpamError::AttributeNotLoaded`] when its attribute is kept apart and was not loaded.
    pub fn attribute_of(&self, ordinal: u32) -> Result<Option<&Attribute>, IpamError> {
        let Some(allocation) = self.allocations.get(&ordinal) else {
            return Ok(None);
        };
        if allocation.attribute == APART {
            return self
                .apart
                .loaded
                .get(&ordinal)
                .map(Some)
                .ok_or_else(|| self.not_loaded(ordinal));
        }
        Ok(self.attributes.get(allocation.attribute as usize))
    }

    fn not_loaded(&self, ordinal: u32) -> IpamError {
        IpamError::AttributeNotLoaded {
            block: self.cidr,
            ordinal,
        }
    }

    /// Ordinals held by `handle`.
    ///
    /// # Errors
    /// [`IpamError::AttributeNotLoaded`] when an allocation kept apart was not loaded and the
    /// handle's own record was not learned ([`Block::learn_apart_of_handle`]): it could be the
    /// handle's.
    pub fn ordinals_of_handle(&self, handle: &str) -> Result<Vec<u32>, IpamError> {
        let complete = self.apart.complete_for.contains(handle);
        let mut ordinals = Vec::new();
        for (ordinal, allocation) in &self.allocations {
            let attribute = if allocation.attribute == APART {
                match self.apart.loaded.get(ordinal) {
                    Some(attribute) => Some(attribute),
                    None if complete => None,
                    None => return Err(self.not_loaded(*ordinal)),
                }
            } else {
                self.attributes.get(allocation.attribute as usize)
            };
            if attribute.is_some_and(|attr| attr.handle == handle) {
                ordinals.push(*ordinal);
            }
        }
        Ok(ordinals)
    }

    /// The allocated ordinals whose attributes are kept apart and not loaded.
    pub fn unloaded_apart(&self) -> Vec<u32> {
        self.allocations
            .iter()
            .filter(|(ordinal, a)| a.attribute == APART && !self.apart.loaded.contains_key(ordinal))
            .map(|(ordinal, _)| *ordinal)
            .collect()
    }

    /// Records the attribute of an apart allocation, read from its owner key. False (nothing
    /// recorded) when the ordinal holds no apart allocation: the key is left over.
    pub fn load_apart(&mut self, ordinal: u32, attribute: Attribute) -> bool {
        if self
            .allocations
            .get(&ordinal)
            .is_some_and(|a| a.attribute == APART)
        {
            self.apart.loaded.insert(ordinal, attribute);
            true
        } else {
            false
        }
    }

    /// Records what `handle`'s own record says it holds apart in this block (the metadata of
    /// each of its ordinals), so that [`Block::ordinals_of_handle`] answers for it. Ordinals that
    /// hold no apart allocation are skipped: the record and the block disagree, and the block is
    /// the authority on what is allocated. Returns the ordinals skipped.
    pub fn learn_apart_of_handle(
        &mut self,
        handle: &str,
        held: &BTreeMap<u32, BTreeMap<String, String>>,
    ) -> Vec<u32> {
        let mut skipped = Vec::new();
        for (ordinal, metadata) in held {
            let attribute = Attribute {
                handle: handle.to_owned(),
                metadata: metadata.clone(),
            };
            if !self.load_apart(*ordinal, attribute) {
                skipped.push(*ordinal);
            }
        }
        self.apart.complete_for.insert(handle.to_owned());
        skipped
    }

    /// Moves the attributes of the ordinals allocated since the block was read out of its
    /// attribute table, marking their allocations [`APART`]; returns them, for their owner keys.
    /// What a write in [`OWNERS_APART_FORMAT`] or later does before the block is encoded.
    pub fn move_taken_apart(&mut self) -> Vec<(u32, Attribute)> {
        let mut moved = Vec::new();
        for ordinal in std::mem::take(&mut self.apart.taken) {
            let Some(allocation) = self.allocations.get_mut(&ordinal) else {
                continue;
            };
            if allocation.attribute == APART {
                continue;
            }
            let Some(attribute) = self.attributes.get(allocation.attribute as usize).cloned()
            else {
                continue;
            };
            allocation.attribute = APART;
            self.apart.loaded.insert(ordinal, attribute.clone());
            moved.push((ordinal, attribute));
        }
        self.compact_attributes();
        moved
    }

    /// The apart ordinals released since the block was read, whose owner keys the write deletes.
    pub fn freed_apart(&self) -> impl Iterator<Item = u32> + '_ {
        self.apart.freed.iter().copied()
    }

    /// Drops attributes no allocation refers to, renumbering the rest.
    fn compact_attributes(&mut self) {
        let mut used = vec![false; self.attributes.len()];
        for allocation in self.allocations.values() {
            // An apart allocation (index APART) is past every table entry: no flag.
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
            if allocation.attribute != APART
                && allocation.attribute as usize >= self.attributes.len()
            {
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
