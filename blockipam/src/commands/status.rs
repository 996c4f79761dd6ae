//! STATUS: whether the network can hand out an address on this node now.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipam_core::model::keys;
use ipam_core::{BlockUsage, Family, Ipam, IpamError, Pool, PoolUsage, Utilization};
use ipnet::IpNet;

use super::{may_report_block_prefix, GATEWAY_NODE};
use crate::netconf::NetConf;
use crate::protocol::{codes, CniError};

/// STATUS: the store answers and this node can still get an address of every family the
/// netconf asks for.
///
/// # Errors
/// Code 50 saying which of the two fails.
pub async fn status(ipam: &Ipam, conf: &NetConf, node: &str) -> Result<(), CniError> {
    let unreachable = |e: IpamError| {
        CniError::new(
            codes::PLUGIN_NOT_AVAILABLE,
            format!("the IPAM store is not usable: {e}"),
        )
    };
    // The common answer first, from what an ADD of the node reads first (its blocks with a free
    // address), whatever else the store holds, with the config and the node's labels in the same
    // read: STATUS runs every few seconds on every node.
    let ipam_core::HostUtilization {
        usage: own,
        config,
        labels,
    } = ipam.host_utilization(node).await.map_err(unreachable)?;
    let scope = NodeScope {
        node,
        labels: &labels,
    };
    let pending = usable_pools(conf, node, &own)?;
    let stored_and_pending: Vec<&PoolUsage> = own.pools.iter().chain(&pending).collect();
    // The addresses the network's set-up reserves, in blocks already claimed, counted as taken
    // where they lie in the node's blocks (whether it holds them already is not read here). A
    // netconf without a gateway reserves none (and its pools are not copied to find out).
    let reserved = if conf.gateways.is_empty() {
        Vec::new()
    } else {
        let every: Vec<Pool> = stored_and_pending.iter().map(|p| p.pool.clone()).collect();
        ipam_core::network_setup::reserved_addresses(&every, &conf.gateways)
    };
    let after_set_up = with_set_up_reservations_taken(&stored_and_pending, &reserved, None);
    let all_pools: Vec<&PoolUsage> = after_set_up.iter().map(AsRef::as_ref).collect();
    if own_blocks_serve(conf, &all_pools, &scope) {
        return Ok(());
    }
    // A node without room claims a new block or borrows: what the first reads of the ADD's
    // searches find, then the claim index it reads after them.
    let own_pools = OwnPools {
        usage: &own,
        after_set_up: &all_pools,
        reserved: &reserved,
    };
    match new_or_borrowed_blocks_serve(ipam, conf, &config, &own_pools, &scope).await {
        Bounded::Serves => return Ok(()),
        Bounded::Refuses { family, why } => {
            return Err(CniError::new(
                codes::PLUGIN_NOT_AVAILABLE,
                format!("node {node:?} cannot get an {family} address: {why}"),
            ))
        }
        Bounded::Unsettled => {}
    }
    // Otherwise every block counts: borrowing, the whole claim index, what cannot be decoded.
    let usage = ipam.utilization().await.map_err(unreachable)?;
    let pending = usable_pools(conf, node, &usage)?;
    let stored_and_pending: Vec<&PoolUsage> = usage.pools.iter().chain(&pending).collect();
    let pools: Vec<Pool> = stored_and_pending.iter().map(|p| p.pool.clone()).collect();
    let skip_edges = may_report_block_prefix(conf, &pools);
    // As the ADD finds them once its network set-up has reserved the gateway addresses: in a
    // stored block, those still free are taken by the set-up first (which of them are free is
    // read only then).
    let reserved = ipam_core::network_setup::reserved_addresses(&pools, &conf.gateways);
    let set_up_in_stored_blocks = stored_and_pending
        .iter()
        .flat_map(|p| p.blocks.iter())
        .any(|b| b.free > 0 && reserved.iter().any(|ip| b.cidr.contains(ip)));
    let mut taken: Option<Taken> = None;
    if set_up_in_stored_blocks {
        taken = Some(Taken::read(ipam).await.map_err(unreachable)?);
    }
    let set_up_taken =
        with_set_up_reservations_taken(&stored_and_pending, &reserved, taken.as_ref());
    let stored_after_set_up: Vec<&PoolUsage> = set_up_taken.iter().map(AsRef::as_ref).collect();
    let after_set_up = with_reservation_blocks(&stored_after_set_up, &usage, &reserved);
    let all_pools: Vec<&PoolUsage> = after_set_up.iter().map(AsRef::as_ref).collect();
    // Which block edges are taken matters only for a block with one or two free addresses.
    let ambiguous = all_pools
        .iter()
        .flat_map(|p| p.blocks.iter())
        .any(|b| (1..=2).contains(&b.free) && !block_edges(b.cidr).is_empty());
    if skip_edges && ambiguous && taken.is_none() {
        taken = Some(Taken::read(ipam).await.map_err(unreachable)?);
    }
    // What the blocks that can be decoded hold (as the usage above), with the reservations the
    // set-up makes.
    let taken = taken.map(|mut taken| {
        taken.not_free.extend(reserved.iter().copied());
        taken
    });
    let usable = Usable {
        skip_edges,
        taken: taken.as_ref(),
    };
    for (family, wanted, requested) in [
        (Family::V4, conf.assign_ipv4, &conf.ipv4_pools),
        (Family::V6, conf.assign_ipv6, &conf.ipv6_pools),
    ] {
        if !wanted {
            continue;
        }
        if let Err(why) = family_available(
            &all_pools, &usage, &config, &scope, family, requested, &usable,
        ) {
            // The ADD names such a block then: it may have had room. The node's own first, which
            // its ADD reads first.
            let damaged = usage
                .undecodable
                .iter()
                .filter_map(|o| o.block().map(|(host, cidr)| (o, host, cidr)))
                .filter(|(_, _, cidr)| Family::of_net(cidr) == family)
                .min_by_key(|(_, host, _)| *host != Some(node))
                .map(|(o, _, _)| damaged_block_note(&o.key, &o.message))
                .unwrap_or_default();
            return Err(CniError::new(
                codes::PLUGIN_NOT_AVAILABLE,
                format!("node {node:?} cannot get an {family} address: {why}{damaged}"),
            ));
        }
    }
    Ok(())
}

/// The netconf's pools not stored yet (see [`pending_netconf_pools`]), after checking that no
/// object every ADD reads is undecodable in `usage`.
///
/// # Errors
/// Code 50 naming such an object, or the netconf pool the ADD cannot create.
fn usable_pools(
    conf: &NetConf,
    node: &str,
    usage: &Utilization,
) -> Result<Vec<PoolUsage>, CniError> {
    // An object every ADD of this node reads stops them all; a block (another node's, or one of
    // this node's, which its ADDs pass over) only leaves its addresses out of the room counted.
    if let Some(object) = usage.undecodable.iter().find(|o| read_by_every_add(&o.key)) {
        return Err(CniError::new(
            codes::PLUGIN_NOT_AVAILABLE,
            format!(
                "node {node:?} cannot get an address while the IPAM object at {:?} cannot be \
                 decoded ({}); `blockipamctl check` names the way out",
                object.key, object.message
            ),
        ));
    }
    // The netconf's pools that are not stored yet: the next ADD creates them, empty, unless one
    // is in the way of another pool.
    pending_netconf_pools(conf, usage).map_err(|why| {
        CniError::new(
            codes::PLUGIN_NOT_AVAILABLE,
            format!("node {node:?} cannot get an address: {why}"),
        )
    })
}

/// True when, for every family the netconf asks for, a block of the node in one of the pools an
/// ADD would choose has an address that ADD can have, counting every edge of the block as free
/// (which edges are taken is not read here): then the ADD is served by its first read. `pools`
/// hold only the node's blocks with room.
fn own_blocks_serve(conf: &NetConf, pools: &[&PoolUsage], scope: &NodeScope<'_>) -> bool {
    let all: Vec<Pool> = pools.iter().map(|p| p.pool.clone()).collect();
    let usable = Usable {
        skip_edges: may_report_block_prefix(conf, &all),
        taken: None,
    };
    [
        (Family::V4, conf.assign_ipv4, &conf.ipv4_pools),
        (Family::V6, conf.assign_ipv6, &conf.ipv6_pools),
    ]
    .into_iter()
    .filter(|(_, wanted, _)| *wanted)
    .all(|(family, _, requested)| {
        candidate_pools(pools, scope, family, requested).is_ok_and(|candidates| {
            candidates
                .iter()
                .flat_map(|p| p.blocks.iter())
                .any(|b| b.host.as_deref() == Some(scope.node) && usable.has_room(b))
        })
    })
}

/// What STATUS read of the node's own blocks first, for [`new_or_borrowed_blocks_serve`].
#[derive(Clone, Copy)]
struct OwnPools<'a> {
    /// The usage of the node's blocks with room (and of every pool).
    usage: &'a Utilization,
    /// Every pool, stored and not created yet, with the node's blocks with room, the addresses
    /// the network's set-up reserves in them counted as taken.
    after_set_up: &'a [&'a PoolUsage],
    /// The addresses the network's set-up reserves.
    reserved: &'a [IpAddr],
}

/// What STATUS settles without reading every block.
enum Bounded {
    /// Every family the netconf asks for can get an address.
    Serves,
    /// The ADD of `family` fails, for the reason given.
    Refuses { family: Family, why: String },
    /// Only the whole usage tells (or phrases why not).
    Unsettled,
}

/// Serves when, for every family the netconf asks for, the node's own blocks have room (as
/// [`own_blocks_serve`]), or the ADD would claim a new block (`auto_allocate_blocks` on, under the
/// per-node block limit, and a block of a pool it would choose is unclaimed and not wholly
/// reserved), or borrow (no strict affinity, and another node's or nobody's block has an address
/// the ADD could take): first among the blocks the ADD's new-block search probes, then in the
/// claim index the ADD reads after them. Refuses a family whose node is at its block limit with
/// no room in its blocks (the ADD refuses it before it would borrow). Reads claim entries and
/// the blocks of lenders, never every block; unsettled when anything it reads cannot be decoded,
/// or a block's room depends on which of its edges are taken, or the block it finds holds an
/// address the ADD's network set-up reserves (which claims it first, or may take its free
/// address), or nothing serves (the whole usage then tells, and phrases why not).
async fn new_or_borrowed_blocks_serve(
    ipam: &Ipam,
    conf: &NetConf,
    config: &ipam_core::IpamConfig,
    own_pools: &OwnPools<'_>,
    scope: &NodeScope<'_>,
) -> Bounded {
    let OwnPools {
        usage: own,
        after_set_up: all_pools,
        reserved,
    } = *own_pools;
    // The ADD's network set-up claims a block not claimed yet that holds an address it reserves
    // before the ADD looks for one: only the whole usage tells whether another is left; in a
    // lender, it may take the lender's free address.
    let set_up_claims = |block: &IpNet| reserved.iter().any(|ip| block.contains(ip));
    let families: Vec<(Family, Vec<&PoolUsage>)> = [
        (Family::V4, conf.assign_ipv4, &conf.ipv4_pools),
        (Family::V6, conf.assign_ipv6, &conf.ipv6_pools),
    ]
    .into_iter()
    .filter(|(_, wanted, _)| *wanted)
    .map(|(family, _, requested)| {
        candidate_pools(all_pools, scope, family, requested).map(|pools| (family, pools))
    })
    .collect::<Result<_, _>>()
    .unwrap_or_default();
    if families.is_empty() {
        return Bounded::Unsettled;
    }
    let mut probed: Vec<Pool> = Vec::new();
    for (_, candidates) in &families {
        for pool in candidates {
            if !probed.iter().any(|p| p.name == pool.pool.name) {
                probed.push(pool.pool.clone());
            }
        }
    }
    let every: Vec<Pool> = all_pools.iter().map(|p| p.pool.clone()).collect();
    let skip_edges = may_report_block_prefix(conf, &every);
    let limited = config.auto_allocate_blocks && config.max_blocks_per_host != 0;
    let Ok(prospect) = ipam
        .new_block_prospect(scope.node, &probed, skip_edges, limited)
        .await
    else {
        return Bounded::Unsettled;
    };
    let usable = Usable {
        skip_edges,
        taken: None,
    };
    for (family, candidates) in &families {
        let own_room = candidates
            .iter()
            .flat_map(|p| p.blocks.iter())
            .any(|b| b.host.as_deref() == Some(scope.node) && usable.has_room(b));
        if own_room {
            continue;
        }
        // New blocks: none without automatic block allocation (the ADD then borrows at once).
        if config.auto_allocate_blocks {
            // As the ADD counts them: the node's blocks of the family with room, kept full, and
            // those that cannot be decoded.
            let node = Some(scope.node);
            let owned: BTreeSet<IpNet> = own
                .pools
                .iter()
                .flat_map(|p| p.blocks.iter())
                .chain(&own.orphan_blocks)
                .filter(|b| b.host.as_deref() == node)
                .map(|b| b.cidr)
                .chain(prospect.full_blocks.iter().copied())
                .chain(
                    own.undecodable
                        .iter()
                        .filter_map(|o| o.block())
                        .filter(|(host, _)| *host == node)
                        .map(|(_, cidr)| cidr),
                )
                .filter(|cidr| Family::of_net(cidr) == *family)
                .collect();
            if limited && owned.len() >= config.max_blocks_per_host as usize {
                // The ADD refuses at the limit before it would borrow, unless the node's own
                // blocks may have room after all.
                if own_room_unread(own, *family, skip_edges) {
                    return Bounded::Unsettled;
                }
                return Bounded::Refuses {
                    family: *family,
                    why: format!(
                        "its {} blocks are full and the per-node block limit is {}",
                        owned.len(),
                        config.max_blocks_per_host
                    ),
                };
            }
            let found: Vec<IpNet> = candidates
                .iter()
                .flat_map(|candidate| {
                    probed
                        .iter()
                        .zip(&prospect.unclaimed)
                        .filter(|(pool, _)| pool.name == candidate.pool.name)
                        .filter_map(|(_, found)| *found)
                })
                .collect();
            if found.iter().any(set_up_claims) {
                return Bounded::Unsettled;
            }
            if !found.is_empty() {
                continue;
            }
        }
        // No new block among the probed ones: the ADD borrows, unless strict affinity forbids
        // it.
        let borrow = !config.strict_affinity;
        if borrow {
            let within: Vec<IpNet> = candidates.iter().map(|p| p.pool.cidr).collect();
            match ipam
                .first_lender_with_room(&prospect, &within, config, skip_edges)
                .await
            {
                // A lender whose free address the set-up may reserve: the whole usage tells.
                Ok(Some(lender)) if set_up_claims(&lender) => return Bounded::Unsettled,
                Ok(Some(_)) => continue,
                Ok(None) => {}
                Err(_) => return Bounded::Unsettled,
            }
        }
        // Then the ADD reads the claim index: an unclaimed block the probe missed, or a lender.
        let pools: Vec<Pool> = candidates.iter().map(|p| p.pool.clone()).collect();
        let Ok(room) = ipam
            .room_in_claim_index(
                &prospect,
                &pools,
                config,
                skip_edges,
                config.auto_allocate_blocks,
                borrow,
            )
            .await
        else {
            return Bounded::Unsettled;
        };
        match room.block {
            // Claimed by the set-up first, or a lender whose free address it may reserve.
            Some(block) if set_up_claims(&block) => return Bounded::Unsettled,
            Some(_) => continue,
            None => {}
        }
        // None: the ADD fails, unless the node's own blocks may have room after all (as at the
        // block limit above).
        if own_room_unread(own, *family, skip_edges) {
            return Bounded::Unsettled;
        }
        let names: Vec<&str> = candidates.iter().map(|p| p.pool.name.as_str()).collect();
        // The ADD passed over a lender that cannot be decoded: it may have had room.
        let damaged = room
            .undecodable
            .first()
            .map(|o| damaged_block_note(&o.key, &o.message))
            .unwrap_or_default();
        return Bounded::Refuses {
            family: *family,
            why: format!("no free address in pools {names:?}{damaged}"),
        };
    }
    Bounded::Serves
}

/// True when the node's own blocks of `family` may have an address its ADD can have that the
/// usage of its blocks with room (`own`, which holds only the node's blocks kept under `open/`,
/// each with a free address) does not show: one that cannot be decoded (the ADD names it), one
/// whose free addresses may be host addresses (which edges are taken is not read), or, where the
/// ADD may take block edges (`skip_edges` false), a full block whose edges are free. (So a block
/// of the node holding an address the network's set-up reserves, counted as taken though it may
/// be held already, always leaves the answer to the whole usage.)
fn own_room_unread(own: &Utilization, family: Family, skip_edges: bool) -> bool {
    let damaged = own.undecodable.iter().any(|o| {
        o.block()
            .is_some_and(|(_, cidr)| Family::of_net(&cidr) == family)
    });
    let edges_decide = skip_edges
        && own
            .pools
            .iter()
            .flat_map(|p| p.blocks.iter())
            .any(|b| Family::of_net(&b.cidr) == family);
    damaged || edges_decide || !skip_edges
}

/// What a refusal adds about a block that cannot be decoded, whose free addresses it did not
/// count.
fn damaged_block_note(key: &str, message: &str) -> String {
    format!(
        "; the block at {key:?} cannot be decoded ({message}) and its free addresses are not \
         counted: `blockipamctl check` names the way out"
    )
}

/// True when every auto-assign ADD reads the object at `key` and cannot go on without it: the
/// pools and the reservations (the node's blocks with room are read too, but one that cannot be
/// decoded is passed over).
fn read_by_every_add(key: &str) -> bool {
    [keys::pools_dir(), keys::reservations_dir()]
        .iter()
        .any(|dir| key.starts_with(dir.as_str()))
}

/// The node STATUS answers for, and its labels (what pools' node selectors match).
struct NodeScope<'a> {
    node: &'a str,
    labels: &'a BTreeMap<String, String>,
}

/// Which free addresses of a block an ADD can be given.
struct Usable<'a> {
    /// ADD skips block edges ([`may_report_block_prefix`]).
    skip_edges: bool,
    /// Which addresses are taken (read only when it matters): unknown, every edge counts as
    /// free.
    taken: Option<&'a Taken>,
}

impl Usable<'_> {
    /// True when an ADD can be given one of the block's free addresses.
    fn has_room(&self, block: &BlockUsage) -> bool {
        if !self.skip_edges {
            return block.free > 0;
        }
        let free_edges = block_edges(block.cidr)
            .into_iter()
            .filter(|ip| self.taken.is_none_or(|taken| taken.is_free(*ip)))
            .count() as u64;
        block.free > free_edges
    }
}

/// The addresses of the stored blocks that are not free, and the operator's reservations: read
/// only when the answer depends on which addresses are free.
struct Taken {
    /// Allocated or in IP cooldown, in the blocks that can be decoded
    /// ([`Ipam::addresses_not_free`]); with the set-up's reservations once they count.
    not_free: BTreeSet<IpAddr>,
    /// The operator's reservations (no request is given an address in one).
    reservation_ranges: ipam_core::reservations::ReservedRanges,
}

impl Taken {
    /// Reads both.
    async fn read(ipam: &Ipam) -> Result<Taken, IpamError> {
        Ok(Taken {
            not_free: ipam.addresses_not_free().await?,
            reservation_ranges: ipam_core::reservations::ReservedRanges::new(
                &ipam.list_reservations().await?,
            ),
        })
    }

    /// True when `ip`, an address of a block that can be decoded, is free there: neither
    /// allocated, cooling nor reserved.
    fn is_free(&self, ip: IpAddr) -> bool {
        !self.not_free.contains(&ip) && !self.reservation_ranges.contains(ip)
    }
}

/// A block's network and last address when it has them as edges (IPv4 blocks larger than /31,
/// IPv6 blocks larger than /127): what `skip_block_edges` never hands out.
fn block_edges(block: IpNet) -> Vec<IpAddr> {
    if block.max_prefix_len() - block.prefix_len() >= 2 {
        vec![block.network(), block.broadcast()]
    } else {
        Vec::new()
    }
}

/// The netconf's pools not stored yet, as the empty pools the next ADD creates (enabled, every
/// node, automatic, workload and tunnel use).
///
/// # Errors
/// Why the ADD cannot create one (as the allocator refuses it): a different pool under its name,
/// a pool its range overlaps, or a range overlapping its family's link-local addresses.
fn pending_netconf_pools(conf: &NetConf, usage: &Utilization) -> Result<Vec<PoolUsage>, String> {
    let mut pending = Vec::new();
    for spec in &conf.pools {
        let pool = Ipam::pool_from_spec(spec).map_err(|e| e.to_string())?;
        let mut stored = false;
        for existing in usage.pools.iter().map(|p| &p.pool) {
            if existing.cidr == pool.cidr && existing.block_size == pool.block_size {
                stored = true;
            } else if existing.name == pool.name {
                return Err(IpamError::PoolExists(pool.name.clone()).to_string());
            } else if existing.cidr.contains(&pool.cidr.network())
                || pool.cidr.contains(&existing.cidr.network())
            {
                return Err(IpamError::PoolOverlap {
                    cidr: pool.cidr,
                    existing: existing.name.clone(),
                    existing_cidr: existing.cidr,
                }
                .to_string());
            }
        }
        if !stored {
            // The ADD refuses to create a pool on link-local addresses (an earlier release's
            // such pool is found stored above and used as it is).
            ipam_core::model::validate_new_pool_range(&pool.cidr).map_err(|e| e.to_string())?;
            pending.push(PoolUsage {
                capacity: pool.capacity(),
                in_use: 0,
                free: pool.capacity(),
                reserved: 0,
                cooling: 0,
                blocks: Vec::new(),
                pool,
            });
        }
    }
    Ok(pending)
}

/// The stored blocks of `pools` as an ADD's network set-up leaves them: each address it reserves
/// (`reserved`) that lies in one and is free there (see [`Taken::is_free`]) is taken, one free
/// address fewer. With nothing read of which addresses are taken (`taken` none), every reserved
/// address in a block counts as taken. Pools with no such address are returned as they are, not
/// copied.
fn with_set_up_reservations_taken<'a>(
    pools: &[&'a PoolUsage],
    reserved: &[IpAddr],
    taken: Option<&Taken>,
) -> Vec<Cow<'a, PoolUsage>> {
    let taken_in = |block: &BlockUsage| -> u64 {
        reserved
            .iter()
            .filter(|ip| block.cidr.contains(*ip))
            .filter(|ip| taken.is_none_or(|taken| taken.is_free(**ip)))
            .count() as u64
    };
    pools
        .iter()
        .map(|pool_usage| {
            if !pool_usage.blocks.iter().any(|b| taken_in(b) > 0) {
                return Cow::Borrowed(*pool_usage);
            }
            let mut after = (*pool_usage).clone();
            for block in &mut after.blocks {
                let taken = taken_in(block).min(block.free);
                block.free -= taken;
            }
            Cow::Owned(after)
        })
        .collect()
}

/// `pools` as an ADD's network set-up leaves them: each address it reserves (`reserved`) whose
/// block is not stored yet (not in `pools`, and not among the blocks of `usage` that cannot be
/// decoded) has that block claimed for the reservations' pseudo-node, which no node can claim then
/// (a pool not created yet has every such block added). Pools with no such block are returned as
/// they are, not copied.
fn with_reservation_blocks<'a>(
    pools: &[&'a PoolUsage],
    usage: &Utilization,
    reserved: &[IpAddr],
) -> Vec<Cow<'a, PoolUsage>> {
    let undecodable: BTreeSet<IpNet> = usage
        .undecodable
        .iter()
        .filter_map(|o| o.block().map(|(_, cidr)| cidr))
        .collect();
    pools
        .iter()
        .map(|pool_usage| {
            let mut claimed: BTreeMap<IpNet, u64> = BTreeMap::new();
            for ip in reserved {
                let Some(block) = pool_usage.pool.block_containing(*ip) else {
                    continue;
                };
                let stored = undecodable.contains(&block)
                    || pool_usage.blocks.iter().any(|b| b.cidr == block);
                if !stored {
                    *claimed.entry(block).or_default() += 1;
                }
            }
            if claimed.is_empty() {
                return Cow::Borrowed(*pool_usage);
            }
            let mut after = (*pool_usage).clone();
            for (cidr, held) in claimed {
                let capacity = u64::from(ipam_core::model::block_capacity(&cidr));
                after.blocks.push(BlockUsage {
                    cidr,
                    pool: Some(pool_usage.pool.name.clone()),
                    host: Some(GATEWAY_NODE.to_owned()),
                    capacity,
                    in_use: held,
                    free: capacity - held,
                    reserved: 0,
                    cooling: 0,
                });
            }
            Cow::Owned(after)
        })
        .collect()
}

/// The pools an ADD of `family` would choose among `pools`: the requested ones (each must exist,
/// be enabled, be of the family and allow workload addresses), else those auto-assign uses on
/// the node; else why there are none.
fn candidate_pools<'a>(
    pools: &[&'a PoolUsage],
    scope: &NodeScope<'_>,
    family: Family,
    requested: &[String],
) -> Result<Vec<&'a PoolUsage>, String> {
    let node = scope.node;
    let candidates: Vec<&PoolUsage> = if requested.is_empty() {
        let enabled: Vec<&PoolUsage> = pools
            .iter()
            .copied()
            .filter(|p| p.pool.family() == family && !p.pool.disabled)
            .collect();
        // As auto-assign: automatic pools allowing workload addresses that select the node.
        let selecting: Vec<&PoolUsage> = enabled
            .iter()
            .copied()
            .filter(|p| {
                p.pool.assignment_mode == ipam_core::AssignmentMode::Automatic
                    && p.pool.allowed_uses.allows(ipam_core::AllowedUse::Workload)
                    && p.pool.node_selector.matches(scope.labels)
            })
            .collect();
        if selecting.is_empty() && !enabled.is_empty() {
            return Err(format!(
                "no IP pool selects node {node:?} for automatic assignment (enabled pools: {}; \
                 check their node selectors, assignment modes and allowed uses, or the node's \
                 labels)",
                enabled
                    .iter()
                    .map(|p| p.pool.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        selecting
    } else {
        let mut chosen = Vec::new();
        for wanted in requested {
            let found = pools.iter().copied().find(|p| {
                p.pool.name == *wanted || wanted.parse::<IpNet>().ok() == Some(p.pool.cidr)
            });
            match found {
                None => return Err(format!("pool {wanted:?} does not exist")),
                Some(p) if p.pool.disabled => return Err(format!("pool {wanted:?} is disabled")),
                Some(p) if p.pool.family() != family => {
                    return Err(format!("pool {wanted:?} is not an {family} pool"))
                }
                Some(p) if !p.pool.allowed_uses.allows(ipam_core::AllowedUse::Workload) => {
                    return Err(format!(
                        "pool {wanted:?} does not allow workload addresses (allowed uses: {})",
                        p.pool.allowed_uses
                    ))
                }
                Some(p) => chosen.push(p),
            }
        }
        chosen
    };
    if candidates.is_empty() {
        return Err("there is no enabled pool".into());
    }
    Ok(candidates)
}

/// Whether an ADD of `family` can get an address on the node, choosing among `pools` (the stored
/// ones and those the ADD creates) as auto-assign does; else why not.
fn family_available(
    pools: &[&PoolUsage],
    usage: &Utilization,
    config: &ipam_core::IpamConfig,
    scope: &NodeScope<'_>,
    family: Family,
    requested: &[String],
    usable: &Usable<'_>,
) -> Result<(), String> {
    let node = scope.node;
    let candidates = candidate_pools(pools, scope, family, requested)?;
    let blocks = || candidates.iter().flat_map(|p| p.blocks.iter());
    if blocks().any(|b| b.host.as_deref() == Some(node) && usable.has_room(b)) {
        return Ok(());
    }
    if config.auto_allocate_blocks {
        // A block that cannot be decoded still takes its place in the pool and in the node's
        // block count.
        let undecodable: Vec<(Option<&str>, IpNet)> =
            usage.undecodable.iter().filter_map(|o| o.block()).collect();
        let owned = usage
            .pools
            .iter()
            .filter(|p| p.pool.family() == family)
            .flat_map(|p| p.blocks.iter())
            .filter(|b| b.host.as_deref() == Some(node))
            .count()
            + undecodable
                .iter()
                .filter(|(host, cidr)| *host == Some(node) && Family::of_net(cidr) == family)
                .count();
        let under_limit =
            config.max_blocks_per_host == 0 || owned < config.max_blocks_per_host as usize;
        let room = candidates.iter().any(|p| {
            let undecodable_here = undecodable
                .iter()
                .filter(|(_, cidr)| p.pool.cidr.contains(&cidr.network()))
                .count();
            ((p.blocks.len() + undecodable_here) as u128) < p.pool.block_count()
        });
        if !under_limit {
            // The allocator refuses with a block-limit error before it would borrow.
            return Err(format!(
                "its {owned} blocks are full and the per-node block limit is {}",
                config.max_blocks_per_host
            ));
        }
        if room {
            return Ok(());
        }
    }
    if !config.strict_affinity && blocks().any(|b| usable.has_room(b)) {
        return Ok(());
    }
    let names: Vec<&str> = candidates.iter().map(|p| p.pool.name.as_str()).collect();
    Err(format!("no free address in pools {names:?}"))
}
