//! The key layout, in one place: every key blockipam writes, and the directories it lists.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::model::{Block, ROOT};

/// The store's format record: which stored-format version every writer writes
/// ([`crate::model::store_format`]).
pub fn store_format() -> String {
    format!("{ROOT}format")
}

/// The IPAM configuration object.
pub fn config() -> String {
    format!("{ROOT}config")
}

/// Raised by every pool write, so that pool writes (and their overlap checks) serialise, and by
/// every write of what else an assignment decides from (see
/// [`crate::model::GENERATIONS_COVER_FORMAT`]).
pub fn pool_generation() -> String {
    format!("{ROOT}pool-generation")
}

/// The record confirming which addresses a reservation handle holds (see
/// `network_setup`).
pub fn reservations_held(handle: &str) -> String {
    format!("{ROOT}reservations-held/{handle}")
}

/// Prefix of every record of confirmed reservations.
pub fn reservations_held_dir() -> String {
    format!("{ROOT}reservations-held/")
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

/// Prefix of every block affine to a host (the host's name is the next key segment).
pub fn affine_blocks_dir() -> String {
    format!("{ROOT}blocks/host/")
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

/// The first stored format that keeps an affine block whose only free addresses are both its edges
/// (network and last address, which a request that skips them never takes) under `full/`, so that
/// a node's steady-state read, which lists `open/`, does not grow with the blocks such requests
/// filled. Earlier formats keep such a block under `open/`.
pub const EDGE_BLOCKS_FULL_FORMAT: u8 = 5;

/// Where a writer of stored format `format` puts this block, given its affinity and whether it
/// has room: under its host's `full/` when it has no free address (or, from
/// [`EDGE_BLOCKS_FULL_FORMAT`] on, none but both its edges), else under `open/`.
pub fn block_key_in(block: &Block, format: u8) -> String {
    match block.affinity.as_deref() {
        Some(host)
            if block.free() == 0
                || (format >= EDGE_BLOCKS_FULL_FORMAT && block.only_its_edges_free()) =>
        {
            full_block(host, &block.cidr)
        }
        affinity => self::block(affinity, &block.cidr),
    }
}

/// True when `key` is a place a block may be stored at in a store of any format this build
/// writes: its key in format 4, or its key from [`EDGE_BLOCKS_FULL_FORMAT`] on (they differ only
/// for a block whose only free addresses are its edges, which a writer of format 4 last wrote
/// before the store was finalized).
pub fn is_block_key_of(key: &str, block: &Block) -> bool {
    key == block_key_in(block, EDGE_BLOCKS_FULL_FORMAT - 1)
        || key == block_key_in(block, EDGE_BLOCKS_FULL_FORMAT)
}

/// The affinity a block key records: `Some(Some(host))` under a host's directory, `Some(None)`
/// under `unaffine/`, `None` for a key that is not a block's.
pub fn affinity_of_block_key(key: &str) -> Option<Option<&str>> {
    if let Some(rest) = key.strip_prefix(&format!("{ROOT}blocks/unaffine/")) {
        return (!rest.is_empty()).then_some(None);
    }
    let rest = key.strip_prefix(&format!("{ROOT}blocks/host/"))?;
    let (host, _) = rest.split_once('/')?;
    Some(Some(host))
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

/// The block-release counter: put (value `{}`) by every transaction that deletes a block, so that
/// its revision changes with every release; full-pool marks record the revision they were made at.
pub fn block_releases() -> String {
    format!("{ROOT}block-releases")
}

/// Prefix of every full-pool mark.
pub fn full_pool_marks_dir() -> String {
    format!("{ROOT}full-pools/")
}

/// `pool`'s full-pool mark: a hint that the pool had no unclaimed block when the block-release
/// counter was at the revision it records (value `<pool CIDR> <block size> <revision>`).
pub fn full_pool_mark(pool: &str) -> String {
    format!("{ROOT}full-pools/{pool}")
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

/// Prefix of every owner key (format 6).
pub fn owners_dir() -> String {
    format!("{ROOT}owners/")
}

/// Prefix of the owner keys of the block `cidr`.
pub fn block_owners_dir(cidr: &IpNet) -> String {
    format!("{ROOT}owners/{}/", cidr_segment(cidr))
}

/// The owner key of ordinal `ordinal` of block `cidr`: its allocation's attribute (handle and
/// metadata), when the block keeps it apart ([`crate::model::APART`], format 6). Written and
/// deleted by the transactions that take and free the ordinal, so a block's own value does not
/// grow with its allocations' attributes.
pub fn owner_key(cidr: &IpNet, ordinal: u32) -> String {
    format!("{ROOT}owners/{}/{ordinal}", cidr_segment(cidr))
}

/// The block and ordinal of a key written by [`owner_key`]; `None` for any other key, including
/// an ordinal written with a sign, leading zeros or outside `u32`.
pub fn parse_owner_key(key: &str) -> Option<(IpNet, u32)> {
    let rest = key.strip_prefix(ROOT)?.strip_prefix("owners/")?;
    let (segment, ordinal) = rest.split_once('/')?;
    let cidr = parse_cidr_segment(segment)?;
    let parsed: u32 = ordinal.parse().ok()?;
    // One spelling per key: the one `owner_key` writes.
    (owner_key(&cidr, parsed) == key).then_some((cidr, parsed))
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

/// Prefix of every node object.
pub fn nodes_dir() -> String {
    format!("{ROOT}nodes/")
}

/// The key of `host`'s node object.
pub fn node_key(host: &str) -> String {
    format!("{ROOT}nodes/{host}")
}

/// Prefix of every namespace's pools setting.
pub fn namespaces_dir() -> String {
    format!("{ROOT}namespaces/")
}

/// The key of `namespace`'s pools setting.
pub fn namespace_key(namespace: &str) -> String {
    format!("{ROOT}namespaces/{namespace}")
}

/// Prefix of every reservation.
pub fn reservations_dir() -> String {
    format!("{ROOT}ipreservations/")
}

/// The key of the reservation `name`.
pub fn reservation_key(name: &str) -> String {
    format!("{ROOT}ipreservations/{name}")
}

/// Prefix of every mixed-sizes record.
pub fn mixed_sizes_dir() -> String {
    format!("{ROOT}mixed-block-sizes/")
}

/// The mixed-sizes record of the pool named `pool`.
pub fn mixed_sizes_key(pool: &str) -> String {
    format!("{ROOT}mixed-block-sizes/{pool}")
}

/// Prefix of every agent registration.
pub fn agents_dir() -> String {
    format!("{ROOT}agents/")
}

/// The registration record of `host`'s agent (persistent; deleted once the node is reclaimed).
pub fn agent_key(host: &str) -> String {
    format!("{ROOT}agents/{host}")
}

/// Prefix of every liveness key.
pub fn liveness_dir() -> String {
    format!("{ROOT}liveness/")
}

/// `host`'s liveness key: attached to its agent's etcd lease, gone when the lease expires.
pub fn liveness_key(host: &str) -> String {
    format!("{ROOT}liveness/{host}")
}

/// Prefix of every activity record.
pub fn activity_dir() -> String {
    format!("{ROOT}activity/")
}

/// `host`'s activity record: rewritten by every commit of the plugin on that node, so its
/// revision moves whenever the node's runtime gets work done, whatever the node's agent does.
pub fn activity_key(host: &str) -> String {
    format!("{ROOT}activity/{host}")
}

/// Prefix of every node generation.
pub fn node_generations_dir() -> String {
    format!("{ROOT}node-generation/")
}

/// `host`'s node generation: put (its value names the writer) in the same transaction as every
/// write of what decides whether that node's plugin rewrites its activity record: the node's
/// registration (an agent registering, a reclaimer's mark, its clearing, a reclaim), its grace
/// countdown's start and its activity record; deleted when the node is forgotten or retired. A
/// transaction that tests it at the revision read tests all of them.
pub fn node_generation(host: &str) -> String {
    format!("{ROOT}node-generation/{host}")
}

/// Prefix of every node's record of live addresses the store disagrees with.
pub fn live_disagreements_dir() -> String {
    format!("{ROOT}live-disagreements/")
}

/// `host`'s record of the live addresses the store disagrees with: written by that node's agent
/// when what its looks find changes, deleted when they find nothing and when the node is
/// forgotten; read by `check`.
pub fn live_disagreements_key(host: &str) -> String {
    format!("{ROOT}live-disagreements/{host}")
}

/// Prefix of every node's index of the blocks it borrowed addresses from.
pub fn borrowed_dir() -> String {
    format!("{ROOT}borrowed/")
}

/// Prefix of `host`'s borrowed-block index: one key per block not affine to `host` that may hold
/// an address recorded for `host`, so that the node's agent reads its allocations without
/// reading every block of the store.
pub fn host_borrowed_dir(host: &str) -> String {
    format!("{ROOT}borrowed/{host}/")
}

/// `host`'s borrowed-block index entry for `cidr`: put by every transaction that records an
/// address for `host` in a block not affine to it; deleted by the node's agent once the block
/// holds nothing of `host`, and when the node is forgotten.
pub fn borrowed_key(host: &str, cidr: &IpNet) -> String {
    format!("{ROOT}borrowed/{host}/{}", cidr_segment(cidr))
}

/// Prefix of every grace countdown.
pub fn countdown_dir() -> String {
    format!("{ROOT}missing/")
}

/// `host`'s grace countdown: put by a reclaimer when it finds the node's liveness key gone, on a
/// lease of the grace period renewed once right after the put and never again; the store deletes
/// it once the grace has passed. While it exists, every plugin commit rewrites the node's activity
/// record.
pub fn countdown_key(host: &str) -> String {
    format!("{ROOT}missing/{host}")
}

/// The reclaimer leader key: attached to the lease of the agent that reclaims; the others wait.
pub fn reclaimer_leader_key() -> String {
    format!("{ROOT}reclaimer-leader")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The operators' table of keys (`docs/data-model.md`, "Keys"): the layout every release
    /// reads, so a key this build writes elsewhere is one an older node never finds.
    const DATA_MODEL: &str = include_str!("../../../docs/data-model.md");

    /// The keys named in the first column of the data model's key table.
    fn documented_keys() -> Vec<&'static str> {
        DATA_MODEL
            .lines()
            .filter_map(|line| line.strip_prefix("| `"))
            .filter_map(|rest| rest.split_once("` |").map(|(key, _)| key))
            .filter(|key| key.starts_with(ROOT))
            .collect()
    }

    /// Every key this build writes, spelled with the table's placeholders (`<node>`, `<cidr>`,
    /// ...), is a row of the operators' table, and every row is one of them.
    #[test]
    fn every_key_is_where_the_operators_table_says() {
        let cidr: IpNet = "10.0.0.0/26".parse().expect("cidr");
        let placeholders = |key: String| key.replace(&cidr_segment(&cidr), "<cidr>");
        let written = [
            store_format(),
            config(),
            pool_generation(),
            pool("<name>"),
            block(Some("<host>"), &cidr),
            full_block("<host>", &cidr),
            block(None, &cidr),
            block_claim(&cidr),
            sequence_floor(),
            block_releases(),
            full_pool_mark("<pool>"),
            handle("<handle id>"),
            owner_key(&cidr, 0).replace("/0", "/<ordinal>"),
            reservation_key("<name>"),
            namespace_key("<namespace>"),
            reservations_held("<handle id>"),
            mixed_sizes_key("<pool name>"),
            node_key("<node>"),
            agent_key("<node>"),
            liveness_key("<node>"),
            activity_key("<node>"),
            node_generation("<node>"),
            countdown_key("<node>"),
            live_disagreements_key("<node>"),
            borrowed_key("<node>", &cidr),
            reclaimer_leader_key(),
            import_in_progress(),
        ]
        .map(placeholders);
        let mut documented = documented_keys();
        documented.sort_unstable();
        let mut expected: Vec<&str> = written.iter().map(String::as_str).collect();
        expected.sort_unstable();
        assert_eq!(expected, documented);
    }

    /// Each directory listed is the prefix of exactly the keys it stands for, ends with `/`, and
    /// holds none of another directory's keys.
    #[test]
    fn each_directory_is_the_prefix_of_its_keys() {
        let cidr: IpNet = "10.0.0.0/26".parse().expect("cidr");
        let within = [
            (pools_dir(), pool("p")),
            (blocks_dir(), block(None, &cidr)),
            (blocks_dir(), affine_blocks_dir()),
            (affine_blocks_dir(), host_blocks_dir("n")),
            (host_blocks_dir("n"), host_open_blocks_dir("n")),
            (host_blocks_dir("n"), host_full_blocks_dir("n")),
            (host_open_blocks_dir("n"), block(Some("n"), &cidr)),
            (host_full_blocks_dir("n"), full_block("n", &cidr)),
            (claims_dir(), block_claim(&cidr)),
            (full_pool_marks_dir(), full_pool_mark("p")),
            (handles_dir(), handle("h")),
            (owners_dir(), block_owners_dir(&cidr)),
            (block_owners_dir(&cidr), owner_key(&cidr, 3)),
            (nodes_dir(), node_key("n")),
            (namespaces_dir(), namespace_key("ns")),
            (reservations_dir(), reservation_key("r")),
            (mixed_sizes_dir(), mixed_sizes_key("p")),
            (agents_dir(), agent_key("n")),
            (liveness_dir(), liveness_key("n")),
            (activity_dir(), activity_key("n")),
            (live_disagreements_dir(), live_disagreements_key("n")),
            (borrowed_dir(), host_borrowed_dir("n")),
            (host_borrowed_dir("n"), borrowed_key("n", &cidr)),
            (countdown_dir(), countdown_key("n")),
        ];
        for (dir, key) in &within {
            assert!(dir.ends_with('/') && dir.len() > ROOT.len(), "{dir}");
            assert!(key.starts_with(dir.as_str()), "{key} is not under {dir}");
            assert_ne!(key, dir);
        }
        // Another host's blocks, and the unaffine ones, are not under this host's directories.
        assert!(!block(Some("n2"), &cidr).starts_with(&host_blocks_dir("n")));
        assert!(!block(None, &cidr).starts_with(&affine_blocks_dir()));
        assert!(!block(Some("n"), &cidr).starts_with(&host_full_blocks_dir("n")));
        assert!(!full_block("n", &cidr).starts_with(&host_open_blocks_dir("n")));
        assert!(!owner_key(&"10.0.0.64/26".parse().expect("cidr"), 3)
            .starts_with(&block_owners_dir(&cidr)));
        assert!(!borrowed_key("n2", &cidr).starts_with(&host_borrowed_dir("n")));
    }
}
