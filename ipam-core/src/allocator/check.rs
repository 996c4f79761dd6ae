//! The consistency check: every way the stored IPAM objects can disagree with each other, and the
//! repairs that are safe to make automatically.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::allocator::leaks::{AddressHolder, LiveDisagreements};
use crate::allocator::{decode_stored, Ipam, Plan, Stored, ATTR_NODE};
use crate::kv::{KvError, Read};
use crate::model::error::IpamError;
use crate::model::reservations::Reservation;
use crate::model::{
    decode, decode_claim, encode, encode_claim, keys, Block, ClaimEntry, Family, Handle,
    IpamConfig, Pool,
};

/// Kinds of inconsistency, as stable strings (they appear in JSON output).
pub mod kinds {
    /// A stored object cannot be decoded.
    pub const CORRUPT_OBJECT: &str = "corrupt-object";
    /// A block's key and content disagree (location, CIDR or affinity).
    pub const BLOCK_MISPLACED: &str = "block-misplaced";
    /// A block lies outside every pool.
    pub const BLOCK_OUTSIDE_POOLS: &str = "block-outside-pools";
    /// A block's size differs from its pool's block size.
    pub const BLOCK_SIZE_MISMATCH: &str = "block-size-mismatch";
    /// Two blocks overlap, or one CIDR is stored twice.
    pub const OVERLAPPING_BLOCKS: &str = "overlapping-blocks";
    /// A block's free list and allocations disagree (an address both free and used, duplicates, ...).
    pub const FREE_LIST: &str = "free-list";
    /// A claim index entry has no block.
    pub const ORPHANED_CLAIM: &str = "orphaned-claim";
    /// A block has no claim index entry, or the entry names another host.
    pub const CLAIM_MISMATCH: &str = "claim-mismatch";
    /// A handle's per-block counts differ from what the blocks hold.
    pub const HANDLE_COUNT: &str = "handle-count-mismatch";
    /// Blocks hold addresses for a handle that has no handle object.
    pub const MISSING_HANDLE: &str = "missing-handle";
    /// An empty block without affinity (should have been deleted).
    pub const EMPTY_UNAFFINE_BLOCK: &str = "empty-unaffine-block";
    /// Two pools overlap.
    pub const OVERLAPPING_POOLS: &str = "overlapping-pools";
    /// A `blockipamctl import calico` did not finish (reported by `blockipamctl check`).
    pub const IMPORT_IN_PROGRESS: &str = "import-in-progress";
    /// A node's agent found a live pod using an address the store records for another
    /// allocation (another container's, or another node's): two pods may answer on it.
    pub const DUPLICATE_ADDRESS: &str = "duplicate-address";
    /// A node's agent found a live pod using an address the store holds as free.
    pub const UNRECORDED_LIVE_ADDRESS: &str = "unrecorded-live-address";
    /// An owner key names an address its block does not hold apart (format 6).
    pub const ORPHANED_OWNER_KEY: &str = "orphaned-owner-key";
    /// A block holds an address whose attribute it keeps apart, and its owner key is missing
    /// (format 6): who holds the address is unknown.
    pub const MISSING_OWNER_KEY: &str = "missing-owner-key";
    /// A namespace's pools setting names a pool its pods' ADDs cannot use (gone, disabled, of
    /// the other family, or not allowing workload addresses).
    pub const NAMESPACE_POOL_UNUSABLE: &str = "namespace-pool-unusable";

    /// Every kind, for tables and tests.
    pub const ALL: &[&str] = &[
        CORRUPT_OBJECT,
        BLOCK_MISPLACED,
        BLOCK_OUTSIDE_POOLS,
        BLOCK_SIZE_MISMATCH,
        OVERLAPPING_BLOCKS,
        FREE_LIST,
        ORPHANED_CLAIM,
        CLAIM_MISMATCH,
        HANDLE_COUNT,
        MISSING_HANDLE,
        EMPTY_UNAFFINE_BLOCK,
        OVERLAPPING_POOLS,
        IMPORT_IN_PROGRESS,
        DUPLICATE_ADDRESS,
        UNRECORDED_LIVE_ADDRESS,
        ORPHANED_OWNER_KEY,
        MISSING_OWNER_KEY,
        NAMESPACE_POOL_UNUSABLE,
    ];

    /// What a person should do about a problem of `kind` (empty for a kind this build does not know).
    pub fn remedy(kind: &str) -> &'static str {
        match kind {
            CORRUPT_OBJECT => {
                "Find out what wrote the key: a value written by a newer blockipam (its format \
                 version is above this build's) is read by upgrading this tool; damaged bytes are \
                 restored from a backup or store snapshot. Until then, repairs that depend on the \
                 object (the handles, claim index entries and empty blocks of its CIDR) are held \
                 back; deleting the key instead loses the allocations it holds."
            }
            BLOCK_MISPLACED => {
                "Stop the writers of this store and compare the block with its claim index entry; \
                 move the value to the key the detail names (same bytes), then run check again."
            }
            BLOCK_OUTSIDE_POOLS => {
                "Recreate the pool that held the block (same CIDR and block size), or release the \
                 block's addresses and its affinity so it is deleted."
            }
            BLOCK_SIZE_MISMATCH => {
                "Recreate the pool with the block size its blocks have, or record the change \
                 with `blockipamctl pool set --block-size` (existing blocks keep their size and drain)."
            }
            OVERLAPPING_BLOCKS => {
                "Addresses may be handed out twice: stop the writers, release the addresses of one \
                 of the blocks (`blockipamctl release`), delete it, then run check again."
            }
            FREE_LIST => {
                "Stop the writers and restore the block from a backup; releasing and reassigning \
                 the listed addresses rebuilds the free list when no backup exists."
            }
            ORPHANED_CLAIM => "Run `blockipamctl check --repair`: it deletes the entry.",
            CLAIM_MISMATCH => {
                "Run `blockipamctl check --repair`: it rewrites the entry from the block. A repair \
                 held back by an unreadable object waits until that object is fixed."
            }
            HANDLE_COUNT => {
                "Run `blockipamctl check --repair`: it rewrites the handle from the blocks. A \
                 repair held back by an unreadable block or claim entry waits until that object is \
                 fixed (a rewrite then would lose the addresses it holds)."
            }
            NAMESPACE_POOL_UNUSABLE => {
                "Name pools its pods can use: `blockipamctl namespace pools <namespace>` with \
                 --ipv4/--ipv6, or --clear for the netconf's; or add (or enable) the pool it names."
            }
            MISSING_HANDLE => {
                "Run `blockipamctl check --repair`: it recreates the handle, so the pod's DEL \
                 releases its addresses. When the pod is gone, release them instead: \
                 `blockipamctl check -o json > report.json`, then `blockipamctl release \
                 --from-report report.json --apply`."
            }
            EMPTY_UNAFFINE_BLOCK => "Run `blockipamctl check --repair`: it deletes the block.",
            OVERLAPPING_POOLS => {
                "Delete or shrink one of the pools (`blockipamctl pool delete`) once it holds no \
                 addresses; new pools that overlap are refused."
            }
            IMPORT_IN_PROGRESS => {
                "Run the same `blockipamctl import calico` again: it resumes the import."
            }
            DUPLICATE_ADDRESS => {
                "Two pods may answer on the address: the live pod the detail names and the holder \
                 the store records. The store keeps it for the holder, so it is not handed out \
                 again. Find out which pod really owns it (`blockipamctl show --ip`); delete the \
                 live pod the store does not record (its controller recreates it with an address \
                 of its own), or, when the holder is gone, release the holder's address \
                 (`blockipamctl release --ip`) and delete the live pod. The node's agent clears \
                 the record at its next look once they agree."
            }
            ORPHANED_OWNER_KEY => "Run `blockipamctl check --repair`: it deletes the key.",
            MISSING_OWNER_KEY => {
                "The address stays held, so it is never handed out twice, but its owner key is \
                 lost: restore the key from a backup or store snapshot. When the address's pod is \
                 gone, release it by its handle, which the `handle-count-mismatch` line beside \
                 this one names (the pod's DEL, or `blockipamctl release --handle`); a release by \
                 address is refused. Until then, repairs of the block's handles, claim index \
                 entry and emptiness are held back."
            }
            UNRECORDED_LIVE_ADDRESS => {
                "A live pod uses an address the store holds as free, so it may be handed to \
                 another pod. The node's agent records it for the pod again at its next look \
                 (`--leak-collection release`, with the runtime's libcni cache readable); when it \
                 cannot, delete the pod so that it is recreated with an address of its own."
            }
            _ => "",
        }
    }
}

/// One inconsistency.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// One of [`kinds`].
    pub kind: String,
    /// What exactly is wrong, naming the objects.
    pub detail: String,
    /// Whether `check --repair` fixes this kind.
    pub repairable: bool,
    /// What a person should do about it ([`kinds::remedy`]); empty in reports written before
    /// remedies were reported.
    #[serde(default)]
    pub remedy: String,
    /// The block it concerns, when it concerns one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<IpNet>,
    /// The handle it concerns, when it concerns one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<String>,
    /// The node it concerns, when it concerns one (a block's affine host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Every allocated address it involves, each with the sequence number a guarded release
    /// needs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<ProblemAddress>,
}

/// One allocated address a [`Problem`] involves, as the check found it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProblemAddress {
    /// The address.
    pub ip: IpAddr,
    /// The block holding it.
    pub block: IpNet,
    /// Its owner.
    pub handle: String,
    /// The node it was allocated for (its `node` attribute), if recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The block's sequence number when it was allocated: a release guarded by it frees the
    /// address only while this allocation still holds it.
    pub sequence: u64,
}

impl Problem {
    /// A problem of `kind`, with that kind's remedy.
    pub fn new(kind: &str, repairable: bool, detail: String) -> Problem {
        Problem {
            kind: kind.to_owned(),
            detail,
            repairable,
            remedy: kinds::remedy(kind).to_owned(),
            block: None,
            handle: None,
            node: None,
            addresses: Vec::new(),
        }
    }

    /// The same problem, naming the block (and its affine host as the node) it concerns.
    pub fn with_block(mut self, block: &Block) -> Problem {
        self.block = Some(block.cidr);
        self.node = block.affinity.clone();
        self
    }

    /// The same problem, naming the handle it concerns.
    pub fn with_handle(mut self, handle: &str) -> Problem {
        self.handle = Some(handle.to_owned());
        self
    }

    /// The same problem, listing the addresses it involves.
    pub fn with_addresses(mut self, addresses: Vec<ProblemAddress>) -> Problem {
        self.addresses = addresses;
        self
    }
}

/// The problems a node's record of live disagreements stands for: one per address.
fn live_disagreement_problems(record: &LiveDisagreements) -> Vec<Problem> {
    let since = crate::model::timestamp::format_unix(record.since);
    record
        .disagreements
        .iter()
        .map(|d| {
            let sandbox: String = d.sandbox_id.chars().take(12).collect();
            let user = format!(
                "{} is used by live pod {} (sandbox {sandbox}) on node {}",
                d.address, d.pod, record.node
            );
            let found = format!("found by the node's agent since {since}");
            let mut problem = match &d.holder {
                AddressHolder::Free => Problem::new(
                    kinds::UNRECORDED_LIVE_ADDRESS,
                    false,
                    format!("{user} and free in the store ({found})"),
                ),
                AddressHolder::Other(holder) => {
                    let node = holder
                        .attributes
                        .get(ATTR_NODE)
                        .or(holder.block_host.as_ref())
                        .map_or_else(|| "no node".to_owned(), |n| format!("node {n}"));
                    Problem::new(
                        kinds::DUPLICATE_ADDRESS,
                        false,
                        format!(
                            "{user} and recorded for handle {} on {node} ({found})",
                            holder.handle
                        ),
                    )
                    .with_handle(&holder.handle)
                }
            };
            problem.node = Some(record.node.clone());
            problem
        })
        .collect()
}

/// The result of a check (and of a repair, when asked).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckReport {
    /// What is wrong (before any repair).
    pub problems: Vec<Problem>,
    /// What the repair changed.
    pub repaired: Vec<String>,
    /// Objects examined.
    pub blocks_checked: u64,
    /// Handles examined.
    pub handles_checked: u64,
    /// Allocated addresses seen.
    pub allocations_checked: u64,
}

impl CheckReport {
    fn problem(&mut self, kind: &str, repairable: bool, detail: String) {
        self.problems.push(Problem::new(kind, repairable, detail));
    }
}

impl Snapshot {
    /// Every address the blocks hold for each of `handles`, in one pass over the blocks: per
    /// handle, in block then address order.
    fn addresses_of_handles(
        &self,
        handles: &BTreeSet<&str>,
    ) -> BTreeMap<String, Vec<ProblemAddress>> {
        let mut found: BTreeMap<String, Vec<ProblemAddress>> = BTreeMap::new();
        if handles.is_empty() {
            return found;
        }
        let mut blocks: Vec<&Block> = self.blocks.iter().map(|b| &b.value).collect();
        blocks.sort_by_key(|b| {
            (
                Family::of_net(&b.cidr),
                b.cidr.network(),
                b.cidr.prefix_len(),
            )
        });
        for block in blocks {
            for (ordinal, allocation) in &block.allocations {
                // An address whose owner key is missing has no known holder.
                let Ok(Some(attribute)) = block.attribute_of(*ordinal) else {
                    continue;
                };
                if !handles.contains(attribute.handle.as_str()) {
                    continue;
                }
                found
                    .entry(attribute.handle.clone())
                    .or_default()
                    .push(ProblemAddress {
                        ip: block.ip_of(*ordinal),
                        block: block.cidr,
                        handle: attribute.handle.clone(),
                        node: attribute.metadata.get(ATTR_NODE).cloned(),
                        sequence: allocation.sequence,
                    });
            }
        }
        found
    }
}

/// Reports blocks of different CIDRs that share addresses (possible only when a pool's blocks
/// have mixed sizes; the same CIDR stored twice is reported where it is seen).
fn overlapping_blocks(blocks: &[Stored<Block>], report: &mut CheckReport) {
    let mut cidrs: Vec<IpNet> = blocks.iter().map(|b| b.value.cidr).collect();
    cidrs.sort_by_key(|c| (Family::of_net(c), c.network(), c.prefix_len()));
    cidrs.dedup();
    // Aligned CIDRs nest or are disjoint: in address order, an overlap is a CIDR inside the
    // widest one that started before it and still covers it.
    let mut cover: Option<IpNet> = None;
    for cidr in cidrs {
        match cover {
            Some(outer) if outer.contains(&cidr.network()) => report.problem(
                kinds::OVERLAPPING_BLOCKS,
                false,
                format!("blocks {outer} and {cidr} overlap"),
            ),
            _ => cover = Some(cidr),
        }
    }
}

/// A block or claim index entry that cannot be decoded (damaged, or written by a newer format).
#[derive(Debug)]
struct Unreadable {
    key: String,
    /// The CIDR its key names; `None` when the key names none (it could be any block).
    cidr: Option<IpNet>,
}

/// Everything the check reads, from one batched read.
struct Snapshot {
    pools: Vec<Stored<Pool>>,
    blocks: Vec<Stored<Block>>,
    claims: BTreeMap<IpNet, Stored<ClaimEntry>>,
    handles: BTreeMap<String, Stored<Handle>>,
    /// Handles that failed to decode, by id: their key, the revision read and why. A handle is
    /// rebuilt from the blocks, which hold every address it records.
    undecodable_handles: BTreeMap<String, (String, crate::kv::Revision, String)>,
    /// Blocks and claim index entries that failed to decode, and blocks whose apart attributes
    /// could not all be read: what they hold is unknown.
    unreadable: Vec<Unreadable>,
    /// Owner keys that name no address their block holds apart.
    orphaned_owner_keys: Vec<OrphanedOwnerKey>,
}

/// An owner key naming an address its block does not hold apart: the key, and the block as read
/// (its key and revision), or `None` when no block of that CIDR exists.
struct OrphanedOwnerKey {
    key: String,
    revision: crate::kv::Revision,
    cidr: IpNet,
    block: Option<(String, crate::kv::Revision)>,
}

impl Snapshot {
    /// The key of an undecodable block or claim index entry that may hold addresses of any of
    /// `cidrs` (its CIDR overlaps one of them, or its key names no CIDR): a repair touching those
    /// CIDRs is held back while it exists, since what it holds is unknown. `None` when no such key.
    fn holding_back<'a>(&self, cidrs: impl IntoIterator<Item = &'a IpNet>) -> Option<&str> {
        let cidrs: Vec<&IpNet> = cidrs.into_iter().collect();
        self.unreadable
            .iter()
            .find(|u| match u.cidr {
                None => true,
                Some(bad) => cidrs
                    .iter()
                    .any(|c| c.contains(&bad.network()) || bad.contains(&c.network())),
            })
            .map(|u| u.key.as_str())
    }

    /// The key of the first undecodable block, claim index entry or owner key (or missing owner
    /// key), if any: what holds back the repair of a handle whose own record cannot be decoded
    /// (the blocks it names are unknown).
    fn any_unreadable(&self) -> Option<&str> {
        self.unreadable.first().map(|u| u.key.as_str())
    }

    /// The CIDRs a repair of handle `id` touches: those it records and those the blocks hold for it.
    fn handle_cidrs<'a>(&'a self, id: &str, expected: Option<&'a Handle>) -> BTreeSet<&'a IpNet> {
        self.handles
            .get(id)
            .into_iter()
            .flat_map(|h| h.value.blocks.keys())
            .chain(expected.into_iter().flat_map(|e| e.blocks.keys()))
            .collect()
    }
}

/// Why a repair is held back, appended to the problem's detail.
fn held_back_note(key: &str) -> String {
    format!(
        "; not repaired while {key} cannot be decoded (it may hold addresses this repair would \
         lose track of)"
    )
}

impl Ipam {
    /// Checks every stored object against the others; with `repair`, fixes what is safe to fix:
    /// handle counts (rewritten from the blocks, which are the authority), claim index entries,
    /// and empty blocks without affinity. Each repair is its own guarded transaction, so a repair
    /// racing a live allocator changes nothing it should not. A repair whose CIDRs overlap a block
    /// or claim index entry that cannot be decoded (or any, when its key names no CIDR) is held
    /// back, reported as not repairable: what that object holds is unknown, and rewriting a handle
    /// without it would lose track of addresses (a leak once the pod's DEL finds no handle).
    ///
    /// # Errors
    /// Store failures.
    pub async fn check(&self, repair: bool) -> Result<CheckReport, IpamError> {
        let mut report = CheckReport::default();
        let snapshot = self.read_snapshot(&mut report).await?;
        // What each handle should record: its count in each block and the metadata of its
        // addresses kept apart (the blocks and owner keys are the authority).
        let mut expected_handles: BTreeMap<String, Handle> = BTreeMap::new();
        let mut seen_cidrs: BTreeMap<IpNet, String> = BTreeMap::new();
        // A CIDR stored at two keys needs a person: its claim entry is not rewritten from either.
        let stored_twice: BTreeSet<IpNet> = {
            let mut once = BTreeSet::new();
            snapshot
                .blocks
                .iter()
                .filter(|stored| !once.insert(stored.value.cidr))
                .map(|stored| stored.value.cidr)
                .collect()
        };
        let mixed_pools = self.pools_with_mixed_sizes(&snapshot.pools).await?;
        overlapping_blocks(&snapshot.blocks, &mut report);

        for (i, a) in snapshot.pools.iter().enumerate() {
            for b in &snapshot.pools[i + 1..] {
                if a.value.cidr.contains(&b.value.cidr.network())
                    || b.value.cidr.contains(&a.value.cidr.network())
                {
                    report.problem(
                        kinds::OVERLAPPING_POOLS,
                        false,
                        format!(
                            "pools {} ({}) and {} ({}) overlap",
                            a.value.name, a.value.cidr, b.value.name, b.value.cidr
                        ),
                    );
                }
            }
        }

        // Where writers put blocks: a store finalized at a format that keeps blocks with only their
        // edges free under `full/` may still hold such blocks where format 4 put them.
        let writes = self.known_format().await?.writes;
        for stored in &snapshot.blocks {
            report.blocks_checked += 1;
            let block = &stored.value;
            report.allocations_checked += u64::from(block.in_use());
            let expected_key = keys::block_key_in(block, writes);
            let placed = if writes >= keys::EDGE_BLOCKS_FULL_FORMAT {
                keys::is_block_key_of(&stored.key, block)
            } else {
                stored.key == expected_key
            };
            if !placed {
                report.problem(
                    kinds::BLOCK_MISPLACED,
                    false,
                    format!(
                        "block {} (affinity {:?}) is stored at {} instead of {}",
                        block.cidr, block.affinity, stored.key, expected_key
                    ),
                );
            }
            if let Some(previous) = seen_cidrs.insert(block.cidr, stored.key.clone()) {
                report.problem(
                    kinds::OVERLAPPING_BLOCKS,
                    false,
                    format!(
                        "block {} is stored twice: {} and {}",
                        block.cidr, previous, stored.key
                    ),
                );
            }
            match snapshot
                .pools
                .iter()
                .find(|p| p.value.cidr.contains(&block.cidr.network()))
            {
                None => report.problems.push(
                    Problem::new(
                        kinds::BLOCK_OUTSIDE_POOLS,
                        false,
                        format!("block {} lies in no pool", block.cidr),
                    )
                    .with_block(block),
                ),
                Some(pool) if block.cidr.prefix_len() < pool.value.cidr.prefix_len() => report
                    .problem(
                        kinds::BLOCK_SIZE_MISMATCH,
                        false,
                        format!(
                            "block {} is larger than its pool {} ({})",
                            block.cidr, pool.value.name, pool.value.cidr
                        ),
                    ),
                // A block of a former size is fine once the pool records its size change (the
                // record is what sends lookups in the pool to the claim index).
                Some(pool)
                    if pool.value.block_size != block.cidr.prefix_len()
                        && !mixed_pools.contains(&pool.value.name) =>
                {
                    report.problem(
                        kinds::BLOCK_SIZE_MISMATCH,
                        false,
                        format!(
                            "block {} is /{} but pool {} uses /{} blocks and records no block \
                             size change",
                            block.cidr,
                            block.cidr.prefix_len(),
                            pool.value.name,
                            pool.value.block_size
                        ),
                    )
                }
                Some(_) => {}
            }
            for detail in block.self_check() {
                report.problems.push(
                    Problem::new(
                        kinds::FREE_LIST,
                        false,
                        format!("block {}: {detail}", block.cidr),
                    )
                    .with_block(block),
                );
            }
            let held_back = snapshot.holding_back([&block.cidr]);
            let repairable = held_back.is_none();
            let note = held_back.map(held_back_note).unwrap_or_default();
            if block.is_empty() && block.affinity.is_none() {
                report.problems.push(
                    Problem::new(
                        kinds::EMPTY_UNAFFINE_BLOCK,
                        repairable,
                        format!("block {} is empty and has no affinity{note}", block.cidr),
                    )
                    .with_block(block),
                );
            }
            let claim_problem = match snapshot.claims.get(&block.cidr) {
                None => Some(format!("block {} has no claim index entry", block.cidr)),
                Some(claim) if claim.value.affinity != block.affinity => Some(format!(
                    "claim index says block {} belongs to {:?}, the block says {:?}",
                    block.cidr, claim.value.affinity, block.affinity
                )),
                Some(claim) if claim.value.free.is_some_and(|free| free != block.free()) => {
                    Some(format!(
                        "claim index says block {} has {} free addresses, the block has {}",
                        block.cidr,
                        claim.value.free.unwrap_or_default(),
                        block.free()
                    ))
                }
                Some(_) => None,
            };
            if let Some(detail) = claim_problem {
                let (repairable, note) = if stored_twice.contains(&block.cidr) {
                    (
                        false,
                        "; not repaired while the block is stored twice".to_owned(),
                    )
                } else {
                    (repairable, note)
                };
                report.problems.push(
                    Problem::new(kinds::CLAIM_MISMATCH, repairable, format!("{detail}{note}"))
                        .with_block(block),
                );
            }
            for (ordinal, allocation) in &block.allocations {
                // An attribute whose owner key is missing counts for nobody: its block is held
                // back from every repair (missing-owner-key).
                let Ok(Some(attribute)) = block.attribute_of(*ordinal) else {
                    continue;
                };
                let apart =
                    (allocation.attribute == crate::model::APART).then_some(&attribute.metadata);
                expected_handles
                    .entry(attribute.handle.clone())
                    .or_default()
                    .hold(block.cidr, *ordinal, apart);
            }
        }
        for cidr in snapshot.claims.keys() {
            if !seen_cidrs.contains_key(cidr) {
                let held_back = snapshot.holding_back([cidr]);
                report.problem(
                    kinds::ORPHANED_CLAIM,
                    held_back.is_none(),
                    format!(
                        "claim index entry for {cidr} has no block{}",
                        held_back.map(held_back_note).unwrap_or_default()
                    ),
                );
            }
        }
        // The handles with a problem, and every address the blocks hold for them.
        let handles_with_problems: BTreeSet<&str> = snapshot
            .handles
            .iter()
            .filter(|(id, stored)| {
                expected_handles
                    .get(*id)
                    .map_or(!stored.value.blocks.is_empty(), |e| *e != stored.value)
            })
            .map(|(id, _)| id.as_str())
            .chain(
                expected_handles
                    .keys()
                    .filter(|id| !snapshot.handles.contains_key(*id))
                    .map(String::as_str),
            )
            .chain(snapshot.undecodable_handles.keys().map(String::as_str))
            .collect();
        let mut addresses = snapshot.addresses_of_handles(&handles_with_problems);
        for (id, stored) in &snapshot.handles {
            report.handles_checked += 1;
            let expected = expected_handles.get(id).cloned().unwrap_or_default();
            if stored.value != expected {
                let held_back =
                    snapshot.holding_back(snapshot.handle_cidrs(id, expected_handles.get(id)));
                report.problems.push(
                    Problem::new(
                        kinds::HANDLE_COUNT,
                        held_back.is_none(),
                        format!(
                            "handle {id:?} records {} but the blocks hold {}{}",
                            handle_text(&stored.value),
                            handle_text(&expected),
                            held_back.map(held_back_note).unwrap_or_default()
                        ),
                    )
                    .with_handle(id)
                    .with_addresses(addresses.remove(id).unwrap_or_default()),
                );
            }
        }
        for (id, (key, _, error)) in &snapshot.undecodable_handles {
            report.handles_checked += 1;
            let expected = expected_handles.get(id).cloned().unwrap_or_default();
            // Which blocks it records is unknown: any block that cannot be decoded may hold its
            // addresses.
            let held_back = snapshot.any_unreadable();
            let way_out = if expected.blocks.is_empty() {
                "the blocks hold no address for it: `blockipamctl check --repair` deletes it"
                    .to_owned()
            } else {
                format!(
                    "the blocks hold {}: `blockipamctl check --repair` rewrites it from them, so \
                     the pod's DEL releases its addresses",
                    handle_text(&expected)
                )
            };
            report.problems.push(
                Problem::new(
                    kinds::CORRUPT_OBJECT,
                    held_back.is_none(),
                    format!(
                        "{key}: {error}; {way_out}{}",
                        held_back.map(held_back_note).unwrap_or_default()
                    ),
                )
                .with_handle(id)
                .with_addresses(addresses.remove(id).unwrap_or_default()),
            );
        }
        for (id, expected) in &expected_handles {
            if !snapshot.handles.contains_key(id) && !snapshot.undecodable_handles.contains_key(id)
            {
                let held_back = snapshot.holding_back(expected.blocks.keys());
                report.problems.push(
                    Problem::new(
                        kinds::MISSING_HANDLE,
                        held_back.is_none(),
                        format!(
                            "blocks hold {:?} for handle {id:?}, which does not exist{}",
                            counts_text(&expected.blocks),
                            held_back.map(held_back_note).unwrap_or_default()
                        ),
                    )
                    .with_handle(id)
                    .with_addresses(addresses.remove(id).unwrap_or_default()),
                );
            }
        }
        if repair && report.problems.iter().any(|p| p.repairable) {
            self.repair(&snapshot, &expected_handles, &mut report)
                .await?;
        }
        Ok(report)
    }

    async fn read_snapshot(&self, report: &mut CheckReport) -> Result<Snapshot, IpamError> {
        let results = self
            .store()
            .read_many(&[
                Read::List(keys::pools_dir()),
                Read::List(keys::blocks_dir()),
                Read::List(keys::claims_dir()),
                Read::List(keys::handles_dir()),
                Read::Get(keys::config()),
                Read::List(keys::reservations_dir()),
                Read::List(keys::live_disagreements_dir()),
                Read::List(keys::owners_dir()),
                Read::List(keys::namespaces_dir()),
                Read::List(keys::nodes_dir()),
            ])
            .await?;
        let mut lists = Vec::new();
        let mut config = None;
        for result in results {
            match result {
                crate::kv::ReadResult::Listed(kvs) => lists.push(kvs),
                crate::kv::ReadResult::Got(kv) => config = kv,
            }
        }
        let [pools, blocks, claims, handles, reservations, live_disagreements, owners, namespaces, nodes]: [Vec<
            crate::kv::KeyValue,
        >;
            9] = lists.try_into().map_err(|_| {
            IpamError::Store(KvError::other(
                "read_many returned the wrong number of results",
            ))
        })?;
        let mut snapshot = Snapshot {
            pools: Vec::new(),
            blocks: Vec::new(),
            claims: BTreeMap::new(),
            handles: BTreeMap::new(),
            undecodable_handles: BTreeMap::new(),
            unreadable: Vec::new(),
            orphaned_owner_keys: Vec::new(),
        };
        let corrupt = |report: &mut CheckReport, key: &str, e: IpamError| {
            report.problem(kinds::CORRUPT_OBJECT, false, format!("{key}: {e}"));
        };
        let unreadable_entry = |report: &mut CheckReport,
                                unreadable: &mut Vec<Unreadable>,
                                key: &str,
                                cidr: Option<IpNet>,
                                e: IpamError| {
            let scope = cidr.map_or_else(|| "every CIDR".to_owned(), |c| c.to_string());
            report.problem(
                kinds::CORRUPT_OBJECT,
                false,
                format!(
                    "{key}: {e}; repairs of the handles, claim index entries and empty blocks of \
                     {scope} are held back until it can be decoded"
                ),
            );
            unreadable.push(Unreadable {
                key: key.to_owned(),
                cidr,
            });
        };
        if let Some(kv) = config {
            if let Err(e) = decode::<IpamConfig>(&kv.key, &kv.value) {
                corrupt(report, &kv.key, e);
            }
        }
        for kv in &live_disagreements {
            match LiveDisagreements::decode(&kv.key, &kv.value) {
                Ok(record) => report.problems.extend(live_disagreement_problems(&record)),
                Err(e) => corrupt(report, &kv.key, e),
            }
        }
        // Read by every auto-assign (what it must pass over): one that does not decode stops
        // every ADD that does not name its address, everywhere.
        let reservations_prefix = keys::reservations_dir();
        for kv in &reservations {
            if let Err(e) = decode::<Reservation>(&kv.key, &kv.value) {
                let name = kv.key.strip_prefix(&reservations_prefix).unwrap_or(&kv.key);
                let way_out = format!(
                    "every ADD that does not name its address (`IP=`, `ipAddrs`) fails until \
                     it is restored from a backup, or deleted with \
                     `blockipamctl reservation delete {name}` and made again with \
                     `blockipamctl reservation add {name} <CIDR|IP>...`"
                );
                report.problem(
                    kinds::CORRUPT_OBJECT,
                    false,
                    format!("{}: {e}; {way_out}", kv.key),
                );
            }
        }
        // Read by every ADD in the namespace, and by every ADD on the node (its pools' node
        // selectors): one that does not decode stops those ADDs.
        let namespaces_prefix = keys::namespaces_dir();
        for kv in &namespaces {
            if let Err(e) = crate::model::namespaces::decode_namespace_pools(&kv.key, Some(kv)) {
                let namespace = kv.key.strip_prefix(&namespaces_prefix).unwrap_or(&kv.key);
                let way_out = format!(
                    "the ADDs in namespace {namespace} fail until `blockipamctl namespace pools \
                     {namespace}` with --ipv4/--ipv6 or --clear replaces it"
                );
                report.problem(
                    kinds::CORRUPT_OBJECT,
                    false,
                    format!("{}: {e}; {way_out}", kv.key),
                );
            }
        }
        let nodes_prefix = keys::nodes_dir();
        for kv in &nodes {
            if let Err(e) = crate::model::nodes::decode_node_labels(&kv.key, Some(kv)) {
                let host = kv.key.strip_prefix(&nodes_prefix).unwrap_or(&kv.key);
                let way_out = format!(
                    "the ADDs on node {host} fail until it is restored from a backup, or \
                     replaced whole: `blockipamctl node label {host} <KEY=VALUE>... --replace` \
                     (no labels given: none); a node gone from the cluster: `blockipamctl node \
                     retire {host}` removes it with the rest"
                );
                report.problem(
                    kinds::CORRUPT_OBJECT,
                    false,
                    format!("{}: {e}; {way_out}", kv.key),
                );
            }
        }
        // Read by every ADD and most commands: one that does not decode stops them all. Its
        // blocks live on without it, so it can be made again.
        let pools_prefix = keys::pools_dir();
        let pools_listed = pools.len();
        for kv in pools {
            let key = kv.key.clone();
            match crate::model::decode_pool(&kv.key, &kv.value) {
                Ok(value) => snapshot.pools.push(Stored {
                    value,
                    key: kv.key,
                    revision: kv.revision,
                }),
                Err(e) => {
                    let name = key.strip_prefix(&pools_prefix).unwrap_or(&key);
                    report.problem(
                        kinds::CORRUPT_OBJECT,
                        false,
                        format!(
                            "{key}: {e}; every ADD fails until it is restored from a backup; \
                             without one, `blockipamctl pool delete {name} --force` deletes the \
                             object alone, and the pool is added again with its CIDR and block \
                             size (`blockipamctl pool add <CIDR> --name {name} --block-size <N>`, \
                             then its other settings): its blocks, which `check` lists as outside \
                             every pool meanwhile, and their allocations are its own again"
                        ),
                    );
                }
            }
        }
        // A namespace's setting that names a pool its pods cannot use (gone, disabled, of the
        // other family, not for workloads) fails their ADDs: the checks auto-assign makes. Not
        // judged while a pool cannot be decoded: it may be the one named.
        if snapshot.pools.len() == pools_listed {
            for kv in &namespaces {
                let Ok(Some(setting)) =
                    crate::model::namespaces::decode_namespace_pools(&kv.key, Some(kv))
                else {
                    continue;
                };
                let namespace = kv.key.strip_prefix(&namespaces_prefix).unwrap_or(&kv.key);
                for family in [Family::V4, Family::V6] {
                    for entry in setting.for_family(family) {
                        if let Err(reason) = crate::allocator::assign::named_pool(
                            &snapshot.pools,
                            entry,
                            family,
                            crate::model::AllowedUse::Workload,
                        ) {
                            report.problem(
                                kinds::NAMESPACE_POOL_UNUSABLE,
                                false,
                                format!(
                                    "namespace {namespace} names {family} pool {entry:?} for its \
                                     pods, which they cannot use ({reason}): their ADDs fail \
                                     with error 105"
                                ),
                            );
                        }
                    }
                }
            }
        }
        let mut unreadable = Vec::new();
        for kv in blocks {
            let key = kv.key.clone();
            match decode_stored::<Block>(kv) {
                Ok(b) => snapshot.blocks.push(b),
                Err(e) => {
                    let cidr = key.rsplit('/').next().and_then(keys::parse_cidr_segment);
                    unreadable_entry(report, &mut unreadable, &key, cidr, e);
                }
            }
        }
        for kv in claims {
            let key = kv.key.clone();
            let Some(cidr) = key
                .strip_prefix(&keys::claims_dir())
                .and_then(keys::parse_cidr_segment)
            else {
                unreadable_entry(
                    report,
                    &mut unreadable,
                    &key,
                    None,
                    IpamError::invalid("key does not name a CIDR"),
                );
                continue;
            };
            match decode_claim(&kv.key, &kv.value) {
                Ok(value) => {
                    snapshot.claims.insert(
                        cidr,
                        Stored {
                            key: kv.key,
                            revision: kv.revision,
                            value,
                        },
                    );
                }
                Err(e) => unreadable_entry(report, &mut unreadable, &key, Some(cidr), e),
            }
        }
        self.read_owner_keys(owners, &mut snapshot, &mut unreadable, report);
        snapshot.unreadable = unreadable;
        for kv in handles {
            let key = kv.key.clone();
            let id = key
                .strip_prefix(&keys::handles_dir())
                .unwrap_or(&key)
                .to_owned();
            let revision = kv.revision;
            match decode_stored::<Handle>(kv) {
                Ok(h) => {
                    snapshot.handles.insert(id, h);
                }
                // Reported with the blocks' view of it, in `check`.
                Err(e) => {
                    snapshot
                        .undecodable_handles
                        .insert(id, (key, revision, e.to_string()));
                }
            }
        }
        Ok(snapshot)
    }

    /// Loads the attributes of the blocks' apart addresses from their owner keys (read in the
    /// snapshot's batch); records the keys that name no such address, and, as unreadable, the
    /// owner keys that cannot be decoded and the blocks whose apart attributes are not all there.
    /// An owner key of a CIDR whose block (or another object of that CIDR) cannot be decoded is
    /// neither: what its block holds is unknown, and that object's problem already holds back
    /// every repair of the CIDR.
    fn read_owner_keys(
        &self,
        owners: Vec<crate::kv::KeyValue>,
        snapshot: &mut Snapshot,
        unreadable: &mut Vec<Unreadable>,
        report: &mut CheckReport,
    ) {
        let undecodable: Vec<IpNet> = unreadable.iter().filter_map(|u| u.cidr).collect();
        // Owner keys that cannot be decoded: their addresses are not missing an owner key.
        let mut damaged: BTreeSet<(IpNet, u32)> = BTreeSet::new();
        for kv in owners {
            let Some((cidr, ordinal)) = keys::parse_owner_key(&kv.key) else {
                report.problem(
                    kinds::CORRUPT_OBJECT,
                    false,
                    format!(
                        "{}: the key names no block and ordinal; repairs of the handles, claim \
                         index entries and empty blocks of every CIDR are held back until it is \
                         removed",
                        kv.key
                    ),
                );
                unreadable.push(Unreadable {
                    key: kv.key,
                    cidr: None,
                });
                continue;
            };
            let attribute = match decode::<crate::model::Attribute>(&kv.key, &kv.value) {
                Ok(attribute) => attribute,
                Err(e) => {
                    report.problem(
                        kinds::CORRUPT_OBJECT,
                        false,
                        format!(
                            "{}: {e}; repairs of the handles, claim index entries and empty \
                             blocks of {cidr} are held back until it can be decoded",
                            kv.key
                        ),
                    );
                    unreadable.push(Unreadable {
                        key: kv.key,
                        cidr: Some(cidr),
                    });
                    damaged.insert((cidr, ordinal));
                    continue;
                }
            };
            let block = snapshot.blocks.iter_mut().find(|b| b.value.cidr == cidr);
            let loaded = match block {
                Some(stored) => {
                    if stored.value.load_apart(ordinal, attribute) {
                        None
                    } else {
                        Some(Some((stored.key.clone(), stored.revision)))
                    }
                }
                None if undecodable
                    .iter()
                    .any(|bad| bad.contains(&cidr.network()) || cidr.contains(&bad.network())) =>
                {
                    None
                }
                None => Some(None),
            };
            if let Some(block) = loaded {
                snapshot.orphaned_owner_keys.push(OrphanedOwnerKey {
                    key: kv.key,
                    revision: kv.revision,
                    cidr,
                    block,
                });
            }
        }
        for stored in &snapshot.blocks {
            let missing: Vec<u32> = stored
                .value
                .unloaded_apart()
                .into_iter()
                .filter(|ordinal| !damaged.contains(&(stored.value.cidr, *ordinal)))
                .collect();
            let Some(first) = missing.first() else {
                continue;
            };
            let addresses: Vec<String> = missing
                .iter()
                .map(|o| stored.value.ip_of(*o).to_string())
                .collect();
            report.problems.push(
                Problem::new(
                    kinds::MISSING_OWNER_KEY,
                    false,
                    format!(
                        "block {} holds {} apart whose owner keys are missing: their holders are \
                         unknown; repairs of the block's handles, claim index entry and emptiness \
                         are held back",
                        stored.value.cidr,
                        addresses.join(", ")
                    ),
                )
                .with_block(&stored.value),
            );
            unreadable.push(Unreadable {
                key: keys::owner_key(&stored.value.cidr, *first),
                cidr: Some(stored.value.cidr),
            });
        }
        for orphan in &snapshot.orphaned_owner_keys {
            let held_back = unreadable.iter().find(|u| {
                u.cidr.is_none_or(|bad| {
                    bad.contains(&orphan.cidr.network()) || orphan.cidr.contains(&bad.network())
                })
            });
            report.problem(
                kinds::ORPHANED_OWNER_KEY,
                held_back.is_none(),
                format!(
                    "owner key {} names an address its block does not hold apart{}",
                    orphan.key,
                    held_back
                        .map(|u| held_back_note(&u.key))
                        .unwrap_or_default()
                ),
            );
        }
    }

    async fn repair(
        &self,
        snapshot: &Snapshot,
        expected_handles: &BTreeMap<String, Handle>,
        report: &mut CheckReport,
    ) -> Result<(), IpamError> {
        let mut outcomes: Vec<(String, Result<(), IpamError>)> = Vec::new();
        // Repairs that depend on an undecodable block or claim entry: reported, never made.
        let mut held_back: Vec<String> = Vec::new();
        // Handle counts: the blocks are the authority.
        let ids: BTreeSet<&String> = snapshot
            .handles
            .keys()
            .chain(expected_handles.keys())
            .chain(snapshot.undecodable_handles.keys())
            .collect();
        for id in ids {
            let expected = expected_handles.get(id).cloned().unwrap_or_default();
            let stored = snapshot.handles.get(id);
            if stored.map(|s| &s.value) == Some(&expected) {
                continue;
            }
            // A handle that does not decode is written over at the revision it was read at.
            let read_at = stored.map(|s| s.revision).or_else(|| {
                snapshot
                    .undecodable_handles
                    .get(id)
                    .map(|(_, revision, _)| *revision)
            });
            let held_back_by = if snapshot.undecodable_handles.contains_key(id) {
                snapshot.any_unreadable()
            } else {
                snapshot.holding_back(snapshot.handle_cidrs(id, expected_handles.get(id)))
            };
            if let Some(bad) = held_back_by {
                held_back.push(format!("handle {id:?} (while {bad} cannot be decoded)"));
                continue;
            }
            let key = keys::handle(id);
            let mut plan = self.plan();
            plan.expect(&key, read_at);
            // The blocks this handle is counted in must not change under the repair either.
            for block in snapshot
                .blocks
                .iter()
                .filter(|b| expected.blocks.contains_key(&b.value.cidr))
            {
                plan.expect(&block.key, Some(block.revision));
            }
            let action = if expected.blocks.is_empty() {
                plan.delete(&key);
                format!("deleted handle {id:?}, which holds no address")
            } else {
                plan.put(&key, encode(&expected)?);
                format!("rewrote handle {id:?} as {}", handle_text(&expected))
            };
            outcomes.push((action, self.commit_repair(plan).await));
        }
        // Claim index entries.
        for stored in &snapshot.blocks {
            let block = &stored.value;
            let claim_key = keys::block_claim(&block.cidr);
            let claim = snapshot.claims.get(&block.cidr);
            if claim.is_some_and(|c| {
                c.value.affinity == block.affinity
                    && c.value.free.is_none_or(|free| free == block.free())
            }) {
                continue;
            }
            if snapshot
                .blocks
                .iter()
                .filter(|b| b.value.cidr == block.cidr)
                .count()
                > 1
            {
                continue; // stored twice: needs a person
            }
            if let Some(bad) = snapshot.holding_back([&block.cidr]) {
                held_back.push(format!(
                    "claim index entry of {} (while {bad} cannot be decoded)",
                    block.cidr
                ));
                continue;
            }
            let mut plan = self.plan();
            plan.expect(&stored.key, Some(stored.revision));
            plan.expect(&claim_key, claim.map(|c| c.revision));
            plan.put(&claim_key, encode_claim(block)?);
            outcomes.push((
                format!(
                    "set claim index entry of {} to {:?}",
                    block.cidr, block.affinity
                ),
                self.commit_repair(plan).await,
            ));
        }
        for (cidr, claim) in &snapshot.claims {
            if snapshot.blocks.iter().any(|b| b.value.cidr == *cidr) {
                continue;
            }
            if let Some(bad) = snapshot.holding_back([cidr]) {
                held_back.push(format!(
                    "claim index entry {cidr} (while {bad} cannot be decoded)"
                ));
                continue;
            }
            let mut plan = self.plan();
            plan.expect(&claim.key, Some(claim.revision));
            plan.delete(&claim.key);
            // The block must still be absent wherever it could live.
            for key in keys::block_candidates(claim.value.affinity.as_deref(), cidr) {
                plan.expect(&key, None);
            }
            outcomes.push((
                format!("deleted orphaned claim index entry {cidr}"),
                self.commit_repair(plan).await,
            ));
        }
        // Owner keys naming no address their block holds apart, while the block is as read.
        for orphan in &snapshot.orphaned_owner_keys {
            if let Some(bad) = snapshot.holding_back([&orphan.cidr]) {
                held_back.push(format!(
                    "owner key {} (while {bad} cannot be decoded)",
                    orphan.key
                ));
                continue;
            }
            let mut plan = self.plan();
            plan.expect(&orphan.key, Some(orphan.revision));
            match &orphan.block {
                Some((key, revision)) => plan.expect(key, Some(*revision)),
                None => plan.expect(&keys::block_claim(&orphan.cidr), None),
            }
            plan.delete(&orphan.key);
            outcomes.push((
                format!("deleted orphaned owner key {}", orphan.key),
                self.commit_repair(plan).await,
            ));
        }
        // Empty blocks without affinity.
        for stored in snapshot
            .blocks
            .iter()
            .filter(|b| b.value.is_empty() && b.value.affinity.is_none())
        {
            if let Some(bad) = snapshot.holding_back([&stored.value.cidr]) {
                held_back.push(format!(
                    "empty block {} (while {bad} cannot be decoded)",
                    stored.value.cidr
                ));
                continue;
            }
            let mut plan = self.plan();
            plan.expect(&stored.key, Some(stored.revision));
            plan.delete_block(&stored.key, &stored.value);
            outcomes.push((
                format!("deleted empty block {} with no affinity", stored.value.cidr),
                self.commit_repair(plan).await,
            ));
        }
        report.repaired.extend(
            held_back
                .into_iter()
                .map(|what| format!("held back, not repaired: {what}")),
        );
        for (action, outcome) in outcomes {
            match outcome {
                Ok(()) => report.repaired.push(action),
                Err(IpamError::Store(KvError::Conflict { .. })) => report.repaired.push(format!(
                    "skipped (changed while repairing; run check again): {action}"
                )),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn commit_repair(&self, mut plan: Plan) -> Result<(), IpamError> {
        if plan.deletes_blocks() {
            let floor = self.store().get(&keys::sequence_floor()).await?;
            plan.raise_sequence_floor(floor)?;
        }
        let txn = self.seal(plan.into_txn()).await?;
        match self.store().commit(txn).await {
            Ok(revision) => {
                self.committed(revision);
                Ok(())
            }
            Err(e) => {
                self.forget_format();
                Err(e.into())
            }
        }
    }
}

fn counts_text(counts: &BTreeMap<IpNet, u32>) -> BTreeMap<String, u32> {
    counts.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// A handle's counts and, when it has any, its addresses kept apart.
fn handle_text(handle: &Handle) -> String {
    let counts = format!("{:?}", counts_text(&handle.blocks));
    if handle.apart.is_empty() {
        return counts;
    }
    let apart: Vec<String> = handle
        .apart
        .iter()
        .flat_map(|(cidr, held)| held.keys().map(move |ordinal| format!("{cidr}#{ordinal}")))
        .collect();
    format!("{counts} (kept apart: {})", apart.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kinds declared in this file's `kinds` module, read from the source itself, so a kind
    /// added there without a remedy (or left out of `kinds::ALL`) fails the test below.
    fn declared_kinds() -> Vec<String> {
        let source = include_str!("check.rs");
        let module = source
            .split("pub mod kinds {")
            .nth(1)
            .and_then(|rest| rest.split("pub const ALL").next())
            .unwrap_or_default();
        module
            .lines()
            .filter_map(|line| line.trim().strip_prefix("pub const "))
            .filter_map(|rest| rest.split('"').nth(1))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn every_problem_kind_says_what_to_do() {
        let declared = declared_kinds();
        assert!(declared.len() >= 12, "too few kinds read: {declared:?}");
        let listed: Vec<String> = kinds::ALL.iter().map(|k| (*k).to_owned()).collect();
        assert_eq!(declared, listed, "kinds::ALL must list every declared kind");
        for kind in kinds::ALL {
            let remedy = kinds::remedy(kind);
            assert!(!remedy.trim().is_empty(), "kind {kind} has no remedy");
            let problem = Problem::new(kind, false, "x".into());
            assert_eq!(problem.remedy, remedy);
        }
    }

    #[test]
    fn reports_written_without_remedies_still_parse() {
        let older = r#"{"kind":"orphaned-claim","detail":"d","repairable":true}"#;
        let problem: Problem = serde_json::from_str(older).expect("older problem parses");
        assert_eq!(problem.kind, kinds::ORPHANED_CLAIM);
        assert!(problem.remedy.is_empty());
    }
}
