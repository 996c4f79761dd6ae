//! Full-pool marks: hints that a pool has no unclaimed block, so a search there reads a window.
//!
//! With a believed mark, a new-block search in a full pool reads a window of claim entries by key
//! instead of the whole claim index.
//!
//! A new-block search that listed the whole claim index and found no unclaimed block in a pool
//! puts the pool's mark (`keys::full_pool_mark`) in its allocation's transaction, recording the
//! revision of the block-release counter (`keys::block_releases`) it read *before* that listing.
//! Every transaction that deletes a block puts the counter (`Plan::delete_block`), so a release
//! after the listing leaves the mark naming an older revision: no longer believed. A mark is
//! believed only while its pool keeps the CIDR and block size it names and the counter is at the
//! recorded revision. Writers that keep no marks (the previous release) may delete blocks without
//! touching the counter: the reclaimer's empty-block pass, which lists the claim index anyway,
//! puts the counter when a marked pool has an unclaimed block reservations leave room in.
//!
//! A mark only ever narrows where an allocation looks first: a search that believes it and finds
//! no room in the window of claim entries it read by key falls back to the whole index, so an address
//! is never refused because of a mark. A wrong mark costs placement (an address borrowed from a
//! neighbour while an unclaimed block exists), never an address.

use crate::kv::KeyValue;
use crate::model::reservations::ReservedRanges;
use crate::model::{keys, Pool};
use ipnet::IpNet;
use std::collections::BTreeSet;

/// How many claim entries a new-block search reads by key beyond its first probes, in its first
/// candidate pool, following the host's hashed start: the window a search that believes the
/// pools' full-pool marks borrows from (and where it may find an unclaimed block first).
pub(crate) const CLAIM_WINDOW: u32 = 32;

/// A full-pool mark as stored: `<pool CIDR> <block size> <block-release counter revision>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FullPoolMark {
    pub cidr: IpNet,
    pub block_size: u8,
    pub releases: u64,
}

impl FullPoolMark {
    /// The mark for `pool` as it is, with the counter at `releases`.
    pub(crate) fn of(pool: &Pool, releases: u64) -> Self {
        FullPoolMark {
            cidr: pool.cidr,
            block_size: pool.block_size,
            releases,
        }
    }

    /// The stored value.
    pub(crate) fn encode(&self) -> Vec<u8> {
        format!("{} {} {}", self.cidr, self.block_size, self.releases).into_bytes()
    }

    /// A stored mark, or `None` for a value this build cannot read (a hint, never an error: a
    /// mark that cannot be read is not believed).
    pub(crate) fn decode(value: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(value).ok()?;
        let mut parts = text.split(' ');
        let mark = FullPoolMark {
            cidr: parts.next()?.parse().ok()?,
            block_size: parts.next()?.parse().ok()?,
            releases: parts.next()?.parse().ok()?,
        };
        parts.next().is_none().then_some(mark)
    }

    /// True when `stored` is a mark of `pool` as it is now, made since the last block release
    /// the counter (at `releases`) records.
    pub(crate) fn believed(stored: Option<&KeyValue>, pool: &Pool, releases: u64) -> bool {
        stored
            .and_then(|kv| Self::decode(&kv.value))
            .is_some_and(|mark| mark == Self::of(pool, releases))
    }
}

/// The block-release counter's revision as read (0 while no block was ever deleted).
pub(crate) fn releases_revision(counter: Option<&KeyValue>) -> u64 {
    counter.map_or(0, |kv| kv.revision.get())
}

/// How many of a pool's blocks [`holds_an_unclaimed_usable_block`] looks at, as many as a
/// new-block search's full scan: a pool with more unclaimed blocks than that is taken to have a
/// usable one (a wrong answer costs one listing of the claim index, never an address).
const MOST_BLOCKS_LOOKED_AT: u128 = 1 << 20;

/// True when `pool` has a block that is not in `claimed` (claimed blocks of any pool) and that
/// `reserved` leaves an address in: a block a new-block search would claim. Blocks wholly reserved are skipped by searches,
/// so a pool whose only unclaimed blocks are reserved is rightly marked full.
pub(crate) fn holds_an_unclaimed_usable_block(
    pool: &Pool,
    claimed: &BTreeSet<IpNet>,
    reserved: &ReservedRanges,
) -> bool {
    let count = pool.block_count();
    let inside = claimed
        .iter()
        .filter(|cidr| pool.cidr.contains(&cidr.network()))
        .count() as u128;
    if inside >= count {
        return false;
    }
    if count > MOST_BLOCKS_LOOKED_AT {
        return true;
    }
    (0..count)
        .filter_map(|index| pool.block_at(index))
        .any(|block| !claimed.contains(&block) && !reserved.leaves_block_nothing(&block, false))
}

/// The key of `pool`'s full-pool mark.
pub(crate) fn mark_key(pool: &Pool) -> String {
    keys::full_pool_mark(&pool.name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::Revision;
    use crate::model::test_pool as pool;

    fn stored(value: &[u8]) -> KeyValue {
        KeyValue {
            key: keys::full_pool_mark("p"),
            value: value.to_vec(),
            revision: Revision(9),
        }
    }

    #[test]
    fn a_mark_reads_back_as_written() {
        let mark = FullPoolMark::of(&pool("10.64.0.0/13", 26), 41);
        assert_eq!(mark.encode(), b"10.64.0.0/13 26 41");
        assert_eq!(FullPoolMark::decode(&mark.encode()), Some(mark));
    }

    #[test]
    fn a_mark_is_believed_only_for_the_same_pool_shape_and_release_counter() {
        let p = pool("10.64.0.0/13", 26);
        let mark = stored(&FullPoolMark::of(&p, 41).encode());
        assert!(FullPoolMark::believed(Some(&mark), &p, 41));
        assert!(
            !FullPoolMark::believed(Some(&mark), &p, 42),
            "a block was released since"
        );
        assert!(!FullPoolMark::believed(
            Some(&mark),
            &pool("10.64.0.0/12", 26),
            41
        ));
        assert!(!FullPoolMark::believed(
            Some(&mark),
            &pool("10.64.0.0/13", 27),
            41
        ));
        assert!(!FullPoolMark::believed(None, &p, 41));
    }

    #[test]
    fn a_mark_this_build_cannot_read_is_not_believed() {
        let p = pool("10.64.0.0/13", 26);
        for value in [
            &b""[..],
            b"10.64.0.0/13 26",
            b"10.64.0.0/13 26 41 more",
            b"10.64.0.0/13 26 x",
            b"\xff\xfe",
            b"10.64.0.0/13  26 41",
        ] {
            assert_eq!(FullPoolMark::decode(value), None, "{value:?}");
            assert!(!FullPoolMark::believed(Some(&stored(value)), &p, 41));
        }
    }

    #[test]
    fn the_counter_revision_is_zero_until_a_block_is_released() {
        assert_eq!(releases_revision(None), 0);
        assert_eq!(releases_revision(Some(&stored(b"{}"))), 9);
    }

    #[test]
    fn only_an_unclaimed_block_reservations_leave_room_in_counts() {
        use crate::model::reservations::Reservation;
        let p = pool("10.64.0.0/28", 30);
        let cidrs = |list: &[&str]| -> BTreeSet<IpNet> {
            list.iter().map(|c| c.parse().expect("cidr")).collect()
        };
        let reserving = |list: &[&str]| {
            let reservation = Reservation {
                name: "r".into(),
                cidrs: list.iter().map(|c| c.parse().expect("cidr")).collect(),
            };
            ReservedRanges::new([&reservation])
        };
        let three = cidrs(&["10.64.0.0/30", "10.64.0.4/30", "10.64.0.12/30"]);
        let none = reserving(&[]);
        assert!(holds_an_unclaimed_usable_block(&p, &three, &none));
        let all = cidrs(&[
            "10.64.0.0/30",
            "10.64.0.4/30",
            "10.64.0.8/30",
            "10.64.0.12/30",
        ]);
        assert!(!holds_an_unclaimed_usable_block(&p, &all, &none));
        // The unclaimed block wholly reserved: nothing a search would claim.
        let whole = reserving(&["10.64.0.8/30"]);
        assert!(!holds_an_unclaimed_usable_block(&p, &three, &whole));
        // Reserved but for one address: claimable.
        let partly = reserving(&["10.64.0.8/32", "10.64.0.9/32", "10.64.0.10/32"]);
        assert!(holds_an_unclaimed_usable_block(&p, &three, &partly));
        // Claimed blocks of another pool do not fill this one.
        let elsewhere = cidrs(&[
            "10.65.0.0/30",
            "10.65.0.4/30",
            "10.65.0.8/30",
            "10.65.0.12/30",
        ]);
        assert!(holds_an_unclaimed_usable_block(&p, &elsewhere, &whole));
    }

    #[test]
    fn a_pool_too_large_to_look_through_is_taken_to_hold_a_usable_block() {
        use crate::model::reservations::Reservation;
        let everything = Reservation {
            name: "all".into(),
            cidrs: vec!["10.0.0.0/8".parse().expect("cidr")],
        };
        let reserved = ReservedRanges::new([&everything]);
        let nothing = BTreeSet::new();
        // 2^20 blocks: looked through, every one wholly reserved.
        assert!(!holds_an_unclaimed_usable_block(
            &pool("10.0.0.0/8", 28),
            &nothing,
            &reserved
        ));
        // 2^21 blocks: not looked through; a listing costs less than a scan that size.
        assert!(holds_an_unclaimed_usable_block(
            &pool("10.0.0.0/8", 29),
            &nothing,
            &reserved
        ));
    }
}
