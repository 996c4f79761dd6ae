//! IP reservations (`ipam/v1/ipreservations/<name>`), Calico's `IPReservation`: CIDRs that
//! auto-assign never hands out, read inside auto-assign's own batched read.
//!
//! As in Calico, a reservation only keeps addresses out of *automatic* assignment: an address
//! already allocated stays where it is, and an explicitly requested address is assigned even when
//! reserved (with a warning). A block every assignable address of which is reserved is skipped as
//! a whole, by comparing its CIDR with the merged reserved ranges, never address by address.

use crate::kv::KeyValue;
use crate::model::error::IpamError;
use crate::model::{decode, host_bits, ip_to_u128, Attribute, Block, Family};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

pub use crate::model::keys::{reservation_key, reservations_dir};

/// Most CIDRs one reservation may list (keeps the object, read by every auto-assign, small).
pub const MAX_RESERVED_CIDRS: usize = 1024;
/// Longest reservation name.
pub const MAX_RESERVATION_NAME: usize = crate::model::MAX_OBJECT_NAME;

/// One stored reservation (format as every object: a version byte, then bincode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// Its name (Calico: `metadata.name`).
    pub name: String,
    /// The reserved networks, single addresses as /32 or /128 (Calico: `spec.reservedCIDRs`).
    pub cidrs: Vec<IpNet>,
}

/// Refuses names outside `[A-Za-z0-9._:-]{1,253}` (the characters a pool name may use).
///
/// # Errors
/// [`IpamError::InvalidArgument`] naming the name.
pub fn validate_reservation_name(name: &str) -> Result<(), IpamError> {
    crate::model::validate_object_name("reservation", name)
}

/// Parses a reserved range: a CIDR without host bits (`10.0.0.0/28`) or one address (`10.0.0.5`,
/// stored as `10.0.0.5/32`).
///
/// # Errors
/// [`IpamError::InvalidArgument`] for text that is neither, or a CIDR with host bits set (naming
/// the network it would mean).
pub fn parse_reserved_cidr(text: &str) -> Result<IpNet, IpamError> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(IpNet::from(ip));
    }
    let cidr: IpNet = text.parse().map_err(|_| {
        IpamError::invalid(format!(
            "{text:?} is neither an IP address nor a CIDR (e.g. 10.0.0.5 or 10.0.0.0/28)"
        ))
    })?;
    check_no_host_bits(&cidr)?;
    Ok(cidr)
}

fn check_no_host_bits(cidr: &IpNet) -> Result<(), IpamError> {
    if cidr.trunc() != *cidr {
        return Err(IpamError::invalid(format!(
            "reserved CIDR {cidr} has host bits set (did you mean {}?)",
            cidr.trunc()
        )));
    }
    Ok(())
}

/// Checks what [`Ipam::add_reservation`] stores: a valid name, 1 to [`MAX_RESERVED_CIDRS`] CIDRs
/// without host bits, none listed twice.
///
/// # Errors
/// [`IpamError::InvalidArgument`] saying what is wrong.
pub fn validate_reservation(reservation: &Reservation) -> Result<(), IpamError> {
    validate_reservation_name(&reservation.name)?;
    if reservation.cidrs.is_empty() || reservation.cidrs.len() > MAX_RESERVED_CIDRS {
        return Err(IpamError::invalid(format!(
            "a reservation lists 1 to {MAX_RESERVED_CIDRS} CIDRs or addresses, {} given",
            reservation.cidrs.len()
        )));
    }
    let mut seen = std::collections::BTreeSet::new();
    for cidr in &reservation.cidrs {
        check_no_host_bits(cidr)?;
        if !seen.insert(*cidr) {
            return Err(IpamError::invalid(format!("{cidr} is listed twice")));
        }
    }
    Ok(())
}

/// Decodes listed reservation objects.
///
/// # Errors
/// [`IpamError::Corrupt`] naming the first key that does not decode.
pub fn decode_reservations(listed: &[KeyValue]) -> Result<Vec<Reservation>, IpamError> {
    listed
        .iter()
        .map(|kv| decode::<Reservation>(&kv.key, &kv.value))
        .collect()
}

/// Every reserved address, as merged ranges per family: what auto-assign and utilization compare
/// blocks and addresses against, each question costing a binary search, not a scan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReservedRanges {
    /// Sorted, disjoint, non-adjacent inclusive ranges of IPv4 addresses (as integers).
    v4: Vec<(u128, u128)>,
    /// The same for IPv6.
    v6: Vec<(u128, u128)>,
}

/// First and last address of `cidr`, as integers.
fn bounds(cidr: &IpNet) -> (u128, u128) {
    (ip_to_u128(cidr.network()), ip_to_u128(cidr.broadcast()))
}

impl ReservedRanges {
    /// The ranges of `reservations`, merged.
    pub fn new<'a>(reservations: impl IntoIterator<Item = &'a Reservation>) -> Self {
        let mut v4 = Vec::new();
        let mut v6 = Vec::new();
        for cidr in reservations.into_iter().flat_map(|r| r.cidrs.iter()) {
            match Family::of_net(cidr) {
                Family::V4 => v4.push(bounds(cidr)),
                Family::V6 => v6.push(bounds(cidr)),
            }
        }
        ReservedRanges {
            v4: merge(v4),
            v6: merge(v6),
        }
    }

    /// The ranges of the reservation objects listed at [`reservations_dir`].
    ///
    /// # Errors
    /// [`IpamError::Corrupt`] naming a reservation that does not decode.
    pub fn from_listed(listed: &[KeyValue]) -> Result<Self, IpamError> {
        Ok(Self::new(&decode_reservations(listed)?))
    }

    /// These ranges and `addresses`, merged: what a call passes over besides the stored
    /// reservations.
    pub fn with_addresses(mut self, addresses: &[IpAddr]) -> Self {
        if addresses.is_empty() {
            return self;
        }
        for ip in addresses {
            let value = ip_to_u128(*ip);
            match Family::of(*ip) {
                Family::V4 => self.v4.push((value, value)),
                Family::V6 => self.v6.push((value, value)),
            }
        }
        ReservedRanges {
            v4: merge(self.v4),
            v6: merge(self.v6),
        }
    }

    /// True when nothing is reserved.
    pub fn is_empty(&self) -> bool {
        self.v4.is_empty() && self.v6.is_empty()
    }

    fn of(&self, family: Family) -> &[(u128, u128)] {
        match family {
            Family::V4 => &self.v4,
            Family::V6 => &self.v6,
        }
    }

    /// The ranges that meet `first..=last`, in order.
    fn meeting(&self, family: Family, first: u128, last: u128) -> &[(u128, u128)] {
        let ranges = self.of(family);
        let start = ranges.partition_point(|(_, end)| *end < first);
        let stop = start + ranges[start..].partition_point(|(begin, _)| *begin <= last);
        &ranges[start..stop]
    }

    /// True when one reservation range holds every address of `first..=last`.
    fn covers(&self, family: Family, first: u128, last: u128) -> bool {
        self.meeting(family, first, first)
            .first()
            .is_some_and(|(begin, end)| *begin <= first && *end >= last)
    }

    /// True when `ip` is reserved.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let value = ip_to_u128(ip);
        self.covers(Family::of(ip), value, value)
    }

    /// True when some address of `cidr` is reserved.
    pub fn overlaps(&self, cidr: &IpNet) -> bool {
        let (first, last) = bounds(cidr);
        !self.meeting(Family::of_net(cidr), first, last).is_empty()
    }

    /// How many addresses of `cidr` are reserved (saturating).
    pub fn count_in(&self, cidr: &IpNet) -> u128 {
        let (first, last) = bounds(cidr);
        self.meeting(Family::of_net(cidr), first, last)
            .iter()
            .map(|(begin, end)| ((*end).min(last) - (*begin).max(first)).saturating_add(1))
            .fold(0u128, u128::saturating_add)
    }

    /// True when auto-assign can hand out no address of the block `cidr` because reservations
    /// cover all of it, or (with `skip_block_edges`, for blocks that have edges) all of it but its
    /// network and last address, which such an assignment never hands out anyway.
    pub fn leaves_block_nothing(&self, cidr: &IpNet, skip_block_edges: bool) -> bool {
        if self.is_empty() {
            return false;
        }
        let family = Family::of_net(cidr);
        let (first, last) = bounds(cidr);
        let has_edges = host_bits(family) - cidr.prefix_len() >= 2;
        if skip_block_edges && has_edges {
            self.covers(family, first + 1, last - 1)
        } else {
            self.covers(family, first, last)
        }
    }

    /// Allocates the next address of `block` that no reservation covers, in the order `pick`
    /// hands addresses out (the block's own free-list order): `pick` is the allocation call the
    /// caller would make without reservations (`Block::allocate_next`,
    /// `Block::allocate_next_host_address`). A block no reservation touches is served by `pick`
    /// directly; otherwise `pick` runs on a copy until it yields an unreserved address, which is
    /// then allocated in `block` with `attribute`. `None` when no unreserved address is free.
    pub fn allocate_next(
        &self,
        block: &mut Block,
        attribute: &Attribute,
        pick: impl Fn(&mut Block) -> Option<u32>,
    ) -> Option<u32> {
        if !self.overlaps(&block.cidr) {
            return pick(block);
        }
        let mut trial = block.clone();
        while let Some(ordinal) = pick(&mut trial) {
            if !self.contains(block.ip_of(ordinal)) {
                return block
                    .allocate_ordinal(ordinal, attribute)
                    .then_some(ordinal);
            }
        }
        None
    }

    /// How many of `block`'s addresses in IP cooldown under `lifetime` these ranges reserve: each
    /// is both reserved and cooling, and counts once in what is not free.
    pub fn cooling_in(&self, block: &Block, lifetime: super::Lifetime) -> u64 {
        if !self.overlaps(&block.cidr) {
            return 0;
        }
        block
            .cooling_ordinals_at(lifetime)
            .filter(|ordinal| self.contains(block.ip_of(*ordinal)))
            .count() as u64
    }

    /// How many of `block`'s allocated addresses are reserved (allocated before the reservation,
    /// or assigned explicitly).
    pub fn allocated_in(&self, block: &Block) -> u64 {
        if !self.overlaps(&block.cidr) {
            return 0;
        }
        block
            .allocations
            .keys()
            .filter(|ordinal| self.contains(block.ip_of(**ordinal)))
            .count() as u64
    }
}

/// Sorts inclusive ranges and merges those that overlap or touch.
fn merge(mut ranges: Vec<(u128, u128)>) -> Vec<(u128, u128)> {
    ranges.sort_unstable();
    let mut merged: Vec<(u128, u128)> = Vec::with_capacity(ranges.len());
    for (begin, end) in ranges {
        match merged.last_mut() {
            Some(last) if begin <= last.1.saturating_add(1) => last.1 = last.1.max(end),
            _ => merged.push((begin, end)),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("test cidr")
    }

    fn ranges(cidrs: &[&str]) -> ReservedRanges {
        ReservedRanges::new(&[Reservation {
            name: "r".into(),
            cidrs: cidrs.iter().map(|c| net(c)).collect(),
        }])
    }

    #[test]
    fn addresses_and_cidrs_parse_and_host_bits_are_refused() {
        assert_eq!(
            parse_reserved_cidr("10.0.0.5").ok(),
            Some(net("10.0.0.5/32"))
        );
        assert_eq!(
            parse_reserved_cidr("fd00::1").ok(),
            Some(net("fd00::1/128"))
        );
        assert_eq!(
            parse_reserved_cidr("10.0.0.0/28").ok(),
            Some(net("10.0.0.0/28"))
        );
        match parse_reserved_cidr("10.0.0.5/24") {
            Err(IpamError::InvalidArgument(m)) => assert!(m.contains("10.0.0.0/24"), "{m}"),
            other => panic!("host bits must be refused, got {other:?}"),
        }
        assert!(parse_reserved_cidr("ten").is_err());
    }

    #[test]
    fn a_reservation_lists_1_to_the_limit_of_distinct_networks_without_host_bits() {
        let of = |cidrs: Vec<IpNet>| Reservation {
            name: "r".into(),
            cidrs,
        };
        let at_limit: Vec<IpNet> = (0..MAX_RESERVED_CIDRS)
            .map(|i| {
                IpNet::from(IpAddr::from(std::net::Ipv4Addr::from(
                    0x0a00_0000 + i as u32,
                )))
            })
            .collect();
        assert!(validate_reservation(&of(at_limit.clone())).is_ok());
        let mut over = at_limit;
        over.push(net("10.1.0.0/32"));
        for (reservation, says) in [
            (of(over), "1 to 1024 CIDRs or addresses, 1025 given"),
            (of(vec![]), "0 given"),
            (
                of(vec![net("10.0.0.0/28"), net("10.0.0.0/28")]),
                "listed twice",
            ),
            (of(vec![net("10.0.0.1/28")]), "host bits"),
            (
                Reservation {
                    name: "a b".into(),
                    cidrs: vec![net("10.0.0.0/28")],
                },
                "reservation",
            ),
        ] {
            let refused = validate_reservation(&reservation);
            assert!(
                matches!(&refused, Err(IpamError::InvalidArgument(m)) if m.contains(says)),
                "{says}: {refused:?}"
            );
        }
    }

    #[test]
    fn touching_and_nested_ranges_merge_into_one() {
        let r = ranges(&["10.0.0.0/26", "10.0.0.64/26", "10.0.0.5/32", "fd00::/127"]);
        assert_eq!(r.v4.len(), 1);
        assert!(r.leaves_block_nothing(&net("10.0.0.0/25"), false));
        assert!(!r.leaves_block_nothing(&net("10.0.0.0/24"), false));
        assert_eq!(r.count_in(&net("10.0.0.0/24")), 128);
        assert_eq!(r.count_in(&net("fd00::/120")), 2);
        assert!(r.contains("fd00::1".parse().expect("ip")));
        assert!(!r.contains("fd00::2".parse().expect("ip")));
    }

    #[test]
    fn a_block_reserved_but_for_its_edges_has_nothing_for_edge_skipping_assignment() {
        let r = ranges(&["10.0.0.1/32", "10.0.0.2/31", "10.0.0.4/31"]);
        let block = net("10.0.0.0/29");
        assert!(!r.leaves_block_nothing(&block, false));
        assert!(!r.leaves_block_nothing(&block, true), ".6 is still free");
        let r = ranges(&["10.0.0.1/32", "10.0.0.2/31", "10.0.0.4/31", "10.0.0.6/32"]);
        assert!(r.leaves_block_nothing(&block, true));
        assert!(!r.leaves_block_nothing(&block, false));
        // Blocks of one or two addresses have no edges to skip.
        let r = ranges(&["10.0.0.8/32", "10.0.0.11/32"]);
        assert!(r.leaves_block_nothing(&net("10.0.0.8/32"), true));
        assert!(
            !r.leaves_block_nothing(&net("10.0.0.8/31"), true),
            ".9 is free"
        );
        assert!(
            !r.leaves_block_nothing(&net("10.0.0.10/31"), true),
            ".10 is free"
        );
    }

    #[test]
    fn allocation_skips_reserved_addresses_in_free_list_order() {
        let r = ranges(&["10.0.0.0/31", "10.0.0.3/32"]);
        let mut block = Block::new(net("10.0.0.0/29"), None, 0);
        let a = Attribute {
            handle: "h".into(),
            metadata: Default::default(),
        };
        let got: Vec<u32> =
            std::iter::from_fn(|| r.allocate_next(&mut block, &a, |b| b.allocate_next(&a)))
                .collect();
        assert_eq!(got, vec![2, 4, 5, 6, 7]);
        assert_eq!(block.in_use(), 5);
        assert!(block.self_check().is_empty());
        assert_eq!(r.allocated_in(&block), 0);
    }
}
