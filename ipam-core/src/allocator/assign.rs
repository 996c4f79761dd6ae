//! Assignment: auto-assign (affine blocks, new blocks, borrowing) and specific addresses.

use super::{
    block_value_has_room, decode_each, decode_sequence_floor, find_pool, host_hash,
    learn_apart_from_handle, next_got, next_listed, probed_blocks, refuse_during_import,
    validate_attribute_size, with_node, AssignIpsRequest, AssignedAddress, Attempt,
    AutoAssignRequest, AutoAssignResult, ClaimIndex, ClaimIndexRoom, IndexedClaim, Ipam,
    NewBlockProbe, NewBlockProspect, SequenceFloor, Stored, UndecodableObject, WorkingBlock,
    MAX_ADDRESSES_PER_REQUEST, NEW_BLOCK_PROBES,
};
use crate::allocator::full_pools::{self, FullPoolMark};
use crate::allocator::network_setup;
use crate::allocator::upgrade::format_read;
use crate::kv::{KeyValue, Read};
use crate::model::error::IpamError;
use crate::model::reservations::ReservedRanges;
use crate::model::{
    decode, encode, ip_to_u128, keys, validate_handle, validate_host, AllowedUse, AssignmentMode,
    Attribute, Block, Family, Handle, IpamConfig, Lifetime, Pool,
};
use ipnet::IpNet;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What one try of auto-assign came to (besides a conflict, which is tried again).
enum Assignment {
    /// Addresses assigned (or found held by the handle).
    Assigned(AutoAssignResult),
    /// The request's network is not set up (a pool or a reservation is missing): nothing was
    /// written; [`Ipam::auto_assign`] sets it up and tries again.
    SetupMissing,
}

impl Ipam {
    // -----------------------------------------------------------------------------------------
    // Auto-assign
    // -----------------------------------------------------------------------------------------

    /// Hands out `num_v4` IPv4 and `num_v6` IPv6 addresses to a handle on a host, Calico's way:
    /// the host's affine blocks first, then a newly claimed block (search starting at a hash of
    /// the host name), then — unless strict affinity is on — a free address borrowed from any
    /// block. Both families commit in one transaction together with the handle: either every
    /// address is handed out or none is.
    ///
    /// Steady state (an affine block has room): one batched read and one transaction.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`]; pool errors for requested pools; [`IpamError::BlockLimit`];
    /// [`IpamError::Exhausted`]; [`IpamError::RetriesExhausted`]; store failures;
    /// [`IpamError::Corrupt`] naming a block that cannot be decoded, of the host or a lender, when
    /// the request falls short (such a block is passed over, never written: the host's other
    /// blocks, a new block or another lender serve the request when they can).
    pub async fn auto_assign(
        &self,
        request: &AutoAssignRequest,
    ) -> Result<AutoAssignResult, IpamError> {
        validate_handle(&request.handle)?;
        validate_host(&request.host)?;
        validate_attribute_size(&request.handle, &request.attributes, &request.host)?;
        for (family, n) in [(Family::V4, request.num_v4), (Family::V6, request.num_v6)] {
            if n > MAX_ADDRESSES_PER_REQUEST {
                return Err(IpamError::invalid(format!(
                    "{n} {family} addresses asked for; at most {MAX_ADDRESSES_PER_REQUEST} per request"
                )));
            }
        }
        let may_use_cache = AtomicBool::new(true);
        match self
            .retrying(|| self.try_auto_assign(request, &may_use_cache))
            .await?
        {
            Assignment::Assigned(result) => Ok(result),
            Assignment::SetupMissing => {
                let Some(setup) = &request.setup else {
                    return Err(IpamError::Internal(
                        "auto-assign found a network set-up missing that nobody asked for".into(),
                    ));
                };
                tracing::info!(network = %setup.network, "setting the network up");
                let (pools, reserved) = self.prepare_network_reporting(setup).await?;
                // Set up now (or as far as it could be: a reservation that failed is tried again
                // at the next call); the block edges are decided from the pools just prepared.
                let mut again = request.clone();
                again.setup = None;
                if !reserved {
                    // Not reserved yet: this call hands none of them out all the same.
                    again
                        .pass_over
                        .extend(network_setup::reserved_addresses(&pools, &setup.gateways));
                }
                again.skip_block_edges = network_setup::block_prefix_reportable(
                    &pools,
                    &[
                        (Family::V4, request.num_v4 > 0, request.v4_pools.as_slice()),
                        (Family::V6, request.num_v6 > 0, request.v6_pools.as_slice()),
                    ],
                    &setup.gateways,
                );
                let may_use_cache = AtomicBool::new(true);
                match self
                    .retrying(|| self.try_auto_assign(&again, &may_use_cache))
                    .await?
                {
                    Assignment::Assigned(result) => Ok(result),
                    Assignment::SetupMissing => Err(IpamError::Internal(
                        "auto-assign without a set-up to check found one missing".into(),
                    )),
                }
            }
        }
    }

    /// One attempt: the first of a call (`may_use_cache` set) may be answered from the store's
    /// cache, and keeps its outcome only if it committed (`Ipam::attempt_through_cache`).
    async fn try_auto_assign(
        &self,
        request: &AutoAssignRequest,
        may_use_cache: &AtomicBool,
    ) -> Result<Attempt<Assignment>, IpamError> {
        self.attempt_through_cache(
            may_use_cache,
            |assignment| {
                matches!(assignment, Assignment::Assigned(result)
                    if !result.reused && (!result.v4.is_empty() || !result.v6.is_empty()))
            },
            |use_cache, from_cache| self.try_auto_assign_reading(request, use_cache, from_cache),
        )
        .await
    }

    /// One attempt, answered from the store's cache when `use_cache` and it can (`from_cache`
    /// tells whether it was).
    async fn try_auto_assign_reading(
        &self,
        request: &AutoAssignRequest,
        use_cache: bool,
        from_cache: Arc<AtomicBool>,
    ) -> Result<Attempt<Assignment>, IpamError> {
        let handle_key = keys::handle(&request.handle);
        // The format record, then the pool generation, then what it covers: every pool write
        // raises it, so the decision tests it instead of each pool it used (and a cache
        // validates the pools by it); from the format whose every writer of the configuration,
        // reservations, labels, namespace settings, confirmations and import marker raises it
        // too, those as well (a cache learns that only in this order: `node_cache`).
        let mut reads = vec![
            format_read(),
            Read::Get(keys::pool_generation()),
            Read::List(keys::pools_dir()),
            Read::Get(keys::config()),
            Read::List(keys::host_open_blocks_dir(&request.host)),
            Read::Get(handle_key.clone()),
            Read::Get(keys::import_in_progress()),
            Read::Get(keys::node_key(&request.host)),
            Read::List(keys::reservations_dir()),
        ];
        if let Some(lookup) = &request.namespace {
            reads.push(Read::Get(keys::namespace_key(&lookup.namespace)));
        }
        if let Some(setup) = &request.setup {
            reads.push(Read::Get(keys::handle(&setup.reservation_handle)));
            reads.push(Read::Get(keys::reservations_held(
                &setup.reservation_handle,
            )));
        }
        reads.extend(self.activity_reads());
        // With the conditions under which the answer is still the store's (none from a store
        // that keeps nothing): carried by the commit, they keep a cache in front of the store
        // exact past it, and make an answer from the cache safe to decide from.
        let answered = self.store.read_many_cached(&reads, use_cache).await?;
        from_cache.store(answered.from_cache, Ordering::Relaxed);
        let validators = answered.validators;
        let answered_from_cache = answered.from_cache;
        let mut results = answered.results.into_iter();
        self.learn_format(next_got(&mut results)?).await?;
        // Only its revision counts: its value is the pool writers'.
        let pool_generation = next_got(&mut results)?.map(|kv| kv.revision);
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let (config, config_revision) = Self::decode_config(next_got(&mut results)?)?;
        let lifetime = self.lifetime(&config);
        // A block of the host that cannot be decoded is passed over (never written; its claim
        // entry keeps its CIDR from being claimed again) and named if the request falls short.
        let mut damaged_own: Vec<UndecodableObject> = Vec::new();
        let host_blocks: Vec<Stored<Block>> = decode_each(
            next_listed(&mut results)?,
            decode::<Block>,
            &mut damaged_own,
        );
        let damaged_own: Vec<(IpNet, UndecodableObject)> = damaged_own
            .into_iter()
            .map(|object| match object.block() {
                Some((_, cidr)) => Ok((cidr, object)),
                None => Err(object.into_error()),
            })
            .collect::<Result<_, _>>()?;
        for (_, object) in &damaged_own {
            tracing::warn!(
                key = %object.key,
                "passing over a block of this node that cannot be decoded ({}): nothing it holds \
                 is handed out until it is repaired (blockipamctl check)",
                object.message
            );
        }
        let (mut handle, handle_revision) = Self::decode_handle(next_got(&mut results)?)?;
        refuse_during_import(next_got(&mut results)?)?;
        let node_key = keys::node_key(&request.host);
        let node_labels =
            crate::model::nodes::decode_node_labels(&node_key, next_got(&mut results)?.as_ref())?;
        let reserved = ReservedRanges::from_listed(&next_listed(&mut results)?)?
            .with_addresses(&request.pass_over);
        // The pools each family draws from: the request's, unless the namespace's setting
        // replaces them.
        let mut v4_pools = request.v4_pools.clone();
        let mut v6_pools = request.v6_pools.clone();
        // The namespace whose setting named a family's pools, for the error if one is unusable.
        let mut v4_from_namespace = None;
        let mut v6_from_namespace = None;
        if let Some(lookup) = &request.namespace {
            let key = keys::namespace_key(&lookup.namespace);
            if let Some(set) = crate::model::namespaces::decode_namespace_pools(
                &key,
                next_got(&mut results)?.as_ref(),
            )? {
                if lookup.v4 && !set.ipv4_pools.is_empty() {
                    v4_pools = set.ipv4_pools;
                    v4_from_namespace = Some(lookup.namespace.as_str());
                }
                if lookup.v6 && !set.ipv6_pools.is_empty() {
                    v6_pools = set.ipv6_pools;
                    v6_from_namespace = Some(lookup.namespace.as_str());
                }
            }
        }
        let listed_pools: Vec<Pool> = pools.iter().map(|p| p.value.clone()).collect();
        let mut skip_block_edges = request.skip_block_edges;
        if let Some(setup) = &request.setup {
            let (_, reservation_revision) = Self::decode_handle(next_got(&mut results)?)?;
            let confirmation = next_got(&mut results)?;
            if !network_setup::setup_in_place(
                setup,
                &pools,
                reservation_revision,
                confirmation.as_ref(),
            )? {
                return Ok(Attempt::Done(Assignment::SetupMissing));
            }
            skip_block_edges = network_setup::block_prefix_reportable(
                &listed_pools,
                &[
                    (Family::V4, request.num_v4 > 0, v4_pools.as_slice()),
                    (Family::V6, request.num_v6 > 0, v6_pools.as_slice()),
                ],
                &setup.gateways,
            );
        }
        let activity_unchanged = self.activity_unchanged(&mut results)?;

        if request.reuse_existing && handle.total() > 0 {
            let held = self
                .addresses_in_blocks(&request.handle, &handle, &request.host, &host_blocks)
                .await?;
            return Ok(Attempt::Done(Assignment::Assigned(AutoAssignResult {
                v4: held.iter().filter(|a| a.ip.is_ipv4()).cloned().collect(),
                v6: held.iter().filter(|a| a.ip.is_ipv6()).cloned().collect(),
                reused: true,
                pools: listed_pools,
            })));
        }

        let attribute = Attribute {
            handle: request.handle.clone(),
            metadata: with_node(&request.attributes, &request.host),
        };
        let mut working: BTreeMap<IpNet, WorkingBlock> = BTreeMap::new();
        for stored in host_blocks {
            working.insert(stored.value.cidr, WorkingBlock::from_stored(stored));
        }
        let mut claim_index: Option<ClaimIndex> = None;
        // Mixed-sizes records of candidate pools a new block may be claimed in (resize.rs).
        let mut mixed_seen: Vec<(IpNet, KeyValue)> = Vec::new();
        let mut plan = self.plan();
        plan.activity_unchanged = activity_unchanged;
        if plan.keeps_edge_blocks_full() {
            // Blocks a writer of an older format left under `open/` with only their edges free
            // move to `full/` with this write, a few per call, so that the node's steady-state
            // read shrinks back once the store is finalized.
            for entry in working
                .values_mut()
                .filter(|w| w.block.only_its_edges_free())
                .take(EDGE_BLOCKS_MOVED_PER_CALL)
            {
                entry.dirty = true;
            }
        }
        // Whether a request may find room in the edges of the host's blocks kept under `full/`:
        // only a request that may take edges, in a store whose writers keep such blocks there.
        let edges_may_help = !skip_block_edges && plan.keeps_edge_blocks_full();
        // Full-pool marks this allocation's search proved (full_pools.rs), by key.
        let mut proven_full: BTreeMap<String, FullPoolMark> = BTreeMap::new();
        let mut result = AutoAssignResult {
            pools: listed_pools,
            ..AutoAssignResult::default()
        };
        let mut used_pools: BTreeSet<String> = BTreeSet::new();
        let mut config_used = false;

        for (family, wanted, requested_pools, from_namespace) in [
            (Family::V4, request.num_v4, &v4_pools, v4_from_namespace),
            (Family::V6, request.num_v6, &v6_pools, v6_from_namespace),
        ] {
            if wanted == 0 {
                continue;
            }
            let candidates = candidate_pools(
                &pools,
                family,
                requested_pools,
                &request.host,
                &node_labels,
                request.purpose,
            )
            .map_err(|reason| match from_namespace {
                Some(namespace) => IpamError::NamespacePoolUnusable {
                    namespace: namespace.to_owned(),
                    family,
                    reason: Box::new(reason),
                },
                None => reason,
            })?;
            let in_candidates = |cidr: &IpNet| {
                candidates
                    .iter()
                    .any(|p| p.value.cidr.contains(&cidr.network()))
            };
            let mut got: Vec<AssignedAddress> = Vec::new();
            // The host's blocks kept under `full/` that cannot be decoded, read only by a request
            // that may take edges: passed over, and named if the request falls short.
            let mut damaged_full: Vec<UndecodableObject> = Vec::new();
            // The host's blocks of this request that cannot be decoded.
            let damaged_here: Vec<&(IpNet, UndecodableObject)> = damaged_own
                .iter()
                .filter(|(cidr, _)| Family::of_net(cidr) == family && in_candidates(cidr))
                .collect();

            // 1. The host's affine blocks, in address order.
            let affine: Vec<IpNet> = working
                .values()
                .filter(|w| w.block.affinity.as_deref() == Some(request.host.as_str()))
                .map(|w| w.block.cidr)
                .filter(|c| Family::of_net(c) == family && in_candidates(c))
                .collect();
            take_from_blocks(
                &mut working,
                &affine,
                &attribute,
                wanted,
                skip_block_edges,
                lifetime,
                &reserved,
                &mut got,
            );
            if (got.len() as u32) < wanted && edges_may_help && !config.auto_allocate_blocks {
                // Still the host's own blocks, as Calico takes them before any other: a request
                // that may take edges also takes them from the host's blocks kept under `full/`
                // for having only them free (one listing of those, only when its blocks with
                // room ran out; with new blocks allowed, the new-block probe reads them).
                let with_edges = self
                    .blocks_kept_full_for_their_edges(
                        &request.host,
                        &candidates,
                        family,
                        &mut working,
                        &mut damaged_full,
                    )
                    .await?;
                take_from_blocks(
                    &mut working,
                    &with_edges,
                    &attribute,
                    wanted,
                    skip_block_edges,
                    lifetime,
                    &reserved,
                    &mut got,
                );
            }

            // Steps 2 and 3, at most twice: a first pass may believe the candidate pools'
            // full-pool marks and look only at a window of the claim index (full_pools.rs); when
            // that window does not hold enough, a second pass reads the whole index.
            let mut believe_marks = true;
            // Set when the per-host block limit stopped the search short.
            let mut block_limit: Option<u32> = None;
            // Lenders whose block could not be decoded: passed over (nothing is written to them),
            // and named if the request then falls short.
            let mut undecodable_lenders: Vec<UndecodableObject> = Vec::new();
            loop {
                // Set when this pass looked only at a window of the claim index.
                let mut window: Option<ClaimIndex> = None;

                // 2. New blocks for this host.
                let mut limit_hit: Option<u32> = None;
                if (got.len() as u32) < wanted && config.auto_allocate_blocks {
                    config_used = true;
                    // The steady-state read holds only the host's blocks with room; the per-host
                    // limit counts its full ones too, read in the same batch as the probe.
                    let limited = config.max_blocks_per_host != 0;
                    let probe = self
                        .probe_new_blocks(&candidates, &request.host, limited, edges_may_help)
                        .await?;
                    mixed_seen.extend(probe.mixed.iter().cloned());
                    // Still the host's own blocks, as Calico takes them before a new one: a
                    // request that may take edges takes them from the host's blocks kept under
                    // `full/` for having only them free, read in the probe's batch.
                    pass_over_damaged_full_blocks(&mut damaged_full, probe.damaged_full);
                    let with_edges =
                        adopt_edge_blocks(probe.edge_blocks, &candidates, family, &mut working);
                    take_from_blocks(
                        &mut working,
                        &with_edges,
                        &attribute,
                        wanted,
                        skip_block_edges,
                        lifetime,
                        &reserved,
                        &mut got,
                    );
                    let host_owns = |block: &Block| {
                        block.affinity.as_deref() == Some(request.host.as_str())
                            && Family::of_net(&block.cidr) == family
                    };
                    let owned_blocks: BTreeSet<IpNet> = probe
                        .host_full
                        .iter()
                        .copied()
                        .filter(|c| Family::of_net(c) == family)
                        .chain(
                            working
                                .values()
                                .map(|w| &w.block)
                                .filter(|b| host_owns(b))
                                .map(|b| b.cidr),
                        )
                        .chain(damaged_here.iter().map(|(cidr, _)| *cidr))
                        .collect();
                    let mut owned = owned_blocks.len() as u32;
                    let mut unclaimed = probe.unclaimed.into_iter();
                    if believe_marks && probe.marked_full {
                        window = Some(ClaimIndex {
                            entries: probe.window,
                            sequence_floor: probe.sequence_floor,
                        });
                    }
                    'new_blocks: while (got.len() as u32) < wanted {
                        if limited && owned >= config.max_blocks_per_host {
                            limit_hit = Some(owned);
                            break;
                        }
                        let create = |cidr: IpNet, sequence_floor: SequenceFloor| {
                            WorkingBlock::created(
                                cidr,
                                Some(request.host.clone()),
                                sequence_floor,
                                lifetime.now,
                            )
                        };
                        let usable =
                            |c: &IpNet| !reserved.leaves_block_nothing(c, skip_block_edges);
                        let claimed = 'claimed: {
                            if let Some(found) = unclaimed
                                .by_ref()
                                .find(|c| !working.contains_key(c) && usable(c))
                            {
                                break 'claimed create(found, probe.sequence_floor);
                            }
                            let index = match &window {
                                // Every candidate pool is marked full: no unclaimed block to
                                // look for, another host's long-empty block perhaps.
                                Some(window) => window,
                                None => {
                                    // Every probed block is taken: one listing of the claim
                                    // index (small entries, not blocks) settles it.
                                    let index = self.ensure_claim_index(&mut claim_index).await?;
                                    if let Some(cidr) = find_unclaimed_block(
                                        candidates.iter().map(|p| &p.value),
                                        &request.host,
                                        index.entries.iter().map(|e| e.cidr),
                                        &working,
                                        usable,
                                    ) {
                                        break 'claimed create(cidr, index.sequence_floor);
                                    }
                                    // The whole index shows none: the pools are full, marked
                                    // so by this transaction.
                                    for pool in &candidates {
                                        if !probe.mixed.iter().any(|(c, _)| *c == pool.value.cidr) {
                                            proven_full.insert(
                                                full_pools::mark_key(&pool.value),
                                                FullPoolMark::of(&pool.value, probe.releases),
                                            );
                                        }
                                    }
                                    index
                                }
                            };
                            // No unclaimed block left: another host's long-empty block.
                            match self
                                .take_over_empty_block(
                                    index,
                                    &candidates,
                                    &request.host,
                                    family,
                                    &config,
                                    lifetime,
                                    &working,
                                    usable,
                                )
                                .await?
                            {
                                Some(taken) => taken,
                                None => break 'new_blocks,
                            }
                        };
                        let cidr = claimed.block.cidr;
                        working.insert(cidr, claimed);
                        owned += 1;
                        take_from_blocks(
                            &mut working,
                            &[cidr],
                            &attribute,
                            wanted,
                            skip_block_edges,
                            lifetime,
                            &reserved,
                            &mut got,
                        );
                    }
                }
                if let Some(owned) = limit_hit {
                    if (got.len() as u32) < wanted {
                        // No borrowing past the per-host block limit.
                        block_limit = Some(owned);
                        break;
                    }
                }

                // 3. Borrow from any other block, unless strict affinity forbids it.
                if (got.len() as u32) < wanted && !config.strict_affinity {
                    config_used = true;
                    let index = match &window {
                        Some(window) => window,
                        None => self.ensure_claim_index(&mut claim_index).await?,
                    };
                    // Lenders come from the claim index: blocks nobody owns first, then other
                    // hosts' blocks, each in address order; entries that record no free address
                    // are skipped (format-1 entries, which record no count, are tried).
                    let mut lenders: Vec<&IndexedClaim> = index
                        .entries
                        .iter()
                        .filter(|e| Family::of_net(&e.cidr) == family)
                        .filter(|e| e.claim.affinity.as_deref() != Some(request.host.as_str()))
                        .filter(|e| in_candidates(&e.cidr) && e.claim.free != Some(0))
                        .filter(|e| !reserved.leaves_block_nothing(&e.cidr, skip_block_edges))
                        .filter(|e| !working.contains_key(&e.cidr))
                        .collect();
                    lenders.sort_by_key(|e| (e.claim.affinity.is_some(), e.cidr.network()));
                    let mut lenders = lenders.into_iter();
                    // Read only as many lenders as the missing addresses need, one batch at a
                    // time; a lender that filled up since the listing sends the loop to the
                    // next ones. Lenders whose entries promise nothing this ADD can have (their
                    // free addresses may all be edges it skips) go in batches that double, so
                    // that blocks full but for their edges cost a few reads, not one each.
                    let mut doubtful_allowance = 1usize;
                    while (got.len() as u32) < wanted {
                        let missing = wanted - got.len() as u32;
                        let mut batch: BTreeMap<IpNet, KeyValue> = BTreeMap::new();
                        let mut covered = 0u32;
                        let mut doubtful = 0usize;
                        while covered < missing && doubtful < doubtful_allowance {
                            let Some(lender) = lenders.next() else {
                                break;
                            };
                            let sure = sure_free(lender, skip_block_edges);
                            if sure == 0 {
                                doubtful += 1;
                            }
                            covered = covered.saturating_add(sure);
                            batch.insert(lender.cidr, lender.stored.clone());
                        }
                        doubtful_allowance = doubtful_allowance.saturating_mul(2);
                        if batch.is_empty() {
                            break;
                        }
                        let cidrs: BTreeSet<IpNet> = batch.keys().copied().collect();
                        let claims = batch.into_values().map(Some).collect();
                        // A lender that does not decode is passed over: another lender's
                        // address serves as well, and the damaged block is never written.
                        let loaded = self.load_blocks_given_claims_each(&cidrs, claims).await?;
                        undecodable_lenders.extend(loaded.undecodable);
                        let mut order = Vec::with_capacity(loaded.found.len());
                        for (cidr, stored) in loaded.found {
                            working
                                .entry(cidr)
                                .or_insert_with(|| WorkingBlock::from_stored(stored));
                            order.push(cidr);
                        }
                        order.sort_by_key(|c| {
                            (
                                working.get(c).is_some_and(|w| w.block.affinity.is_some()),
                                c.network(),
                            )
                        });
                        take_from_blocks(
                            &mut working,
                            &order,
                            &attribute,
                            wanted,
                            skip_block_edges,
                            lifetime,
                            &reserved,
                            &mut got,
                        );
                    }
                }
                if (got.len() as u32) < wanted && window.is_some() {
                    // The window held too little: the whole index decides.
                    believe_marks = false;
                    continue;
                }
                break;
            }

            if (got.len() as u32) < wanted {
                // The pools may have room, or the limit not be reached: in a damaged block of the
                // host, or a damaged lender.
                let damaged_full_here = damaged_full.iter().filter(|object| {
                    object.block().is_some_and(|(_, cidr)| {
                        Family::of_net(&cidr) == family && in_candidates(&cidr)
                    })
                });
                if let Some(object) = damaged_here
                    .iter()
                    .map(|(_, object)| object)
                    .chain(damaged_full_here)
                    .chain(&undecodable_lenders)
                    .next()
                {
                    return Err(object.clone().into_error());
                }
                if let Some(owned) = block_limit {
                    return Err(IpamError::BlockLimit {
                        host: request.host.clone(),
                        family,
                        owned,
                        limit: config.max_blocks_per_host,
                    });
                }
                return Err(IpamError::Exhausted {
                    family,
                    requested: wanted,
                    found: got.len() as u32,
                    pools: candidates.iter().map(|p| p.value.name.clone()).collect(),
                });
            }
            for address in &got {
                let Some(entry) = working.get(&address.block) else {
                    return Err(IpamError::Internal(format!(
                        "{} was assigned from block {}, which this attempt did not read",
                        address.ip, address.block
                    )));
                };
                plan.index_borrowed(&request.host, &entry.block);
                let ordinal = entry.block.ordinal_of(address.ip).ok_or_else(|| {
                    IpamError::Internal(format!("{} is not inside {}", address.ip, address.block))
                })?;
                if let Some(pool) = candidates
                    .iter()
                    .find(|p| p.value.cidr.contains(&address.ip))
                {
                    used_pools.insert(pool.value.name.clone());
                }
                handle.hold(
                    address.block,
                    ordinal,
                    plan.apart_metadata(&attribute.metadata),
                );
            }
            match family {
                Family::V4 => result.v4 = got,
                Family::V6 => result.v6 = got,
            }
        }

        if result.v4.is_empty() && result.v6.is_empty() {
            return Ok(Attempt::Done(Assignment::Assigned(result)));
        }
        for working in working.values() {
            plan.write_block(working)?;
            // A block claimed in a pool of mixed block sizes rewrites the pool's record, so that
            // two claims there never commit from one snapshot (resize.rs).
            if working.read.is_none() {
                for (pool_cidr, record) in &mixed_seen {
                    if pool_cidr.contains(&working.block.cidr.network()) {
                        super::resize::guard_mixed_record(&mut plan, record);
                    }
                }
            }
        }
        // Pools and config that decided this allocation must not have changed under it: the pools
        // by their generation, read before them (a store whose pools were written without one,
        // by each pool used).
        match pool_generation {
            Some(revision) if !used_pools.is_empty() => {
                plan.expect(&keys::pool_generation(), Some(revision));
            }
            _ => {
                for pool in pools.iter().filter(|p| used_pools.contains(&p.value.name)) {
                    plan.expect(&pool.key, Some(pool.revision));
                }
            }
        }
        if config_used {
            plan.expect(&keys::config(), config_revision);
        }
        plan.expect(&handle_key, handle_revision);
        plan.put(&handle_key, encode(&handle)?);
        for (key, mark) in &proven_full {
            plan.put(key, mark.encode());
        }
        plan.carry_validators(validators, answered_from_cache);
        self.commit_plan(plan, Assignment::Assigned(result)).await
    }

    /// The host's blocks under `full/` of `family` in one of `candidates` that have a free address
    /// (blocks whose only free addresses are their edges), added to `working`: their CIDRs, for a
    /// request that may take edges and found no room in the host's other blocks. One listing of
    /// the host's full blocks. One that cannot be decoded is passed over and added to `damaged`.
    async fn blocks_kept_full_for_their_edges(
        &self,
        host: &str,
        candidates: &[&Stored<Pool>],
        family: Family,
        working: &mut BTreeMap<IpNet, WorkingBlock>,
        damaged: &mut Vec<UndecodableObject>,
    ) -> Result<Vec<IpNet>, IpamError> {
        let listed = self.store.list(&keys::host_full_blocks_dir(host)).await?;
        let mut undecodable = Vec::new();
        let listed = decode_each(listed, decode::<Block>, &mut undecodable);
        pass_over_damaged_full_blocks(damaged, undecodable);
        let listed = listed
            .into_iter()
            .filter(|stored| stored.value.free() > 0)
            .collect();
        let with_edges = adopt_edge_blocks(listed, candidates, family, working);
        Ok(with_edges)
    }

    /// The first read of a new-block search, one batch: the host's full blocks (when the per-host
    /// limit needs counting them, or `edge_blocks` asks for those with only their edges free), the sequence floor, the block-release counter, for each candidate
    /// pool its full-pool mark and the claim entries of the [`NEW_BLOCK_PROBES`] blocks that follow
    /// the host's hashed start, and in the first candidate pool [`full_pools::CLAIM_WINDOW`] more:
    /// the entries found are the *window* a search that believes the marks borrows from. Every
    /// read is a key, so its cost does not grow with the number of blocks or hosts in the store,
    /// on any backend.
    async fn probe_new_blocks(
        &self,
        candidates: &[&Stored<Pool>],
        host: &str,
        count_full: bool,
        edge_blocks: bool,
    ) -> Result<NewBlockProbe, IpamError> {
        let read_full = count_full || edge_blocks;
        let mut reads = vec![
            Read::Get(keys::sequence_floor()),
            Read::Get(keys::block_releases()),
        ];
        if read_full {
            reads.push(Read::List(keys::host_full_blocks_dir(host)));
        }
        let mut probed = Vec::new();
        for (pool_index, pool) in candidates.iter().enumerate() {
            let probes = if pool_index == 0 {
                NEW_BLOCK_PROBES + u128::from(full_pools::CLAIM_WINDOW)
            } else {
                NEW_BLOCK_PROBES
            };
            for cidr in probed_blocks(&pool.value, host, probes) {
                probed.push((pool_index, cidr));
                reads.push(Read::Get(keys::block_claim(&cidr)));
            }
        }
        // Each candidate's mixed-sizes record (resize.rs) and full-pool mark, in the same batch.
        for pool in candidates {
            reads.push(Read::Get(super::resize::mixed_sizes_key(&pool.value.name)));
            reads.push(Read::Get(full_pools::mark_key(&pool.value)));
        }
        let mut results = self.store.read_many(&reads).await?.into_iter();
        let sequence_floor = decode_sequence_floor(next_got(&mut results)?)?;
        let releases = full_pools::releases_revision(next_got(&mut results)?.as_ref());
        let mut host_full = Vec::new();
        let mut with_edges = Vec::new();
        let mut damaged_full = Vec::new();
        if read_full {
            let listed = next_listed(&mut results)?;
            for kv in &listed {
                host_full.push(super::cidr_of_key(&kv.key, "a block key")?);
            }
            if edge_blocks {
                with_edges = decode_each(listed, decode::<Block>, &mut damaged_full)
                    .into_iter()
                    .filter(|stored| stored.value.free() > 0)
                    .collect();
            }
        }
        let mut unclaimed = Vec::new();
        let mut window = Vec::new();
        for (pool_index, cidr) in probed {
            match next_got(&mut results)? {
                None => unclaimed.push((pool_index, cidr)),
                Some(kv) => window.push(IndexedClaim::decode(kv)?),
            }
        }
        // A block of a pool with mixed sizes may overlap an unclaimed CIDR of the current size:
        // from the first such pool on, the search goes to the claim index and its overlap test.
        let mut mixed = Vec::new();
        let mut first_mixed = candidates.len();
        let mut marked_full = !candidates.is_empty();
        for (pool_index, pool) in candidates.iter().enumerate() {
            let kv = next_got(&mut results)?;
            if super::resize::mixed_record_for(&pool.value, kv.as_ref())?.is_some() {
                if let Some(kv) = kv {
                    first_mixed = first_mixed.min(pool_index);
                    mixed.push((pool.value.cidr, kv));
                    marked_full = false;
                }
            }
            let mark = next_got(&mut results)?;
            marked_full &= FullPoolMark::believed(mark.as_ref(), &pool.value, releases);
        }
        let unclaimed = unclaimed
            .into_iter()
            .filter(|(pool_index, _)| *pool_index < first_mixed)
            .map(|(_, cidr)| cidr)
            .collect();
        Ok(NewBlockProbe {
            mixed,
            host_full,
            edge_blocks: with_edges,
            damaged_full,
            unclaimed,
            sequence_floor,
            releases,
            marked_full,
            window,
        })
    }

    /// What the next ADD of `host` that must claim a new block in one of `pools` (its candidate
    /// pools, in its order) finds in the first read of that search: for each pool, a block its
    /// probe finds unclaimed and not wholly reserved (skipping block edges as `skip_block_edges`
    /// says), which that ADD would claim; with `count_full`, the host's blocks kept under
    /// `full/`. One batch of reads by key (the [`NEW_BLOCK_PROBES`] claim entries from the
    /// host's hashed start in each pool, each pool's mixed-sizes record), the reservations and
    /// the host's full blocks: its cost does not grow with the blocks of other hosts.
    ///
    /// # Errors
    /// Store failures; an invalid host name; a claim entry, mixed-sizes record or reservation
    /// that cannot be decoded, or a full block's key that names no block (the ADD fails on
    /// them too).
    pub async fn new_block_prospect(
        &self,
        host: &str,
        pools: &[Pool],
        skip_block_edges: bool,
        count_full: bool,
    ) -> Result<NewBlockProspect, IpamError> {
        validate_host(host)?;
        let mut reads = vec![Read::List(keys::reservations_dir())];
        if count_full {
            reads.push(Read::List(keys::host_full_blocks_dir(host)));
        }
        let mut probed = Vec::new();
        for (pool_index, pool) in pools.iter().enumerate() {
            for cidr in probed_blocks(pool, host, NEW_BLOCK_PROBES) {
                probed.push((pool_index, cidr));
                reads.push(Read::Get(keys::block_claim(&cidr)));
            }
        }
        for pool in pools {
            reads.push(Read::Get(super::resize::mixed_sizes_key(&pool.name)));
        }
        let mut results = self.store.read_many(&reads).await?.into_iter();
        let reserved = ReservedRanges::from_listed(&next_listed(&mut results)?)?;
        let mut full_blocks = Vec::new();
        if count_full {
            for kv in next_listed(&mut results)? {
                full_blocks.push(super::cidr_of_key(&kv.key, "a block key")?);
            }
        }
        let mut unclaimed: Vec<Option<IpNet>> = vec![None; pools.len()];
        let mut lenders = Vec::new();
        for (pool_index, cidr) in probed {
            match next_got(&mut results)? {
                Some(kv) => {
                    // As the borrowing ADD picks its lenders from the claim index.
                    let entry = IndexedClaim::decode(kv)?;
                    if entry.claim.affinity.as_deref() != Some(host)
                        && entry.claim.free.is_some_and(|free| free > 0)
                        && !reserved.leaves_block_nothing(&cidr, skip_block_edges)
                    {
                        lenders.push(entry);
                    }
                }
                None => {
                    let first = &mut unclaimed[pool_index];
                    if first.is_none() && !reserved.leaves_block_nothing(&cidr, skip_block_edges) {
                        *first = Some(cidr);
                    }
                }
            }
        }
        // As the search: from the first pool of mixed block sizes on, the claim index decides.
        for (pool_index, pool) in pools.iter().enumerate() {
            let kv = next_got(&mut results)?;
            if kv.is_some() && super::resize::mixed_record_for(pool, kv.as_ref())?.is_some() {
                for later in &mut unclaimed[pool_index..] {
                    *later = None;
                }
                break;
            }
        }
        lenders.sort_by_key(|e| (e.claim.affinity.is_some(), e.cidr.network()));
        Ok(NewBlockProspect {
            full_blocks,
            unclaimed,
            lenders: lenders.iter().map(|e| e.cidr).collect(),
            lender_claims: lenders.into_iter().map(|e| e.stored).collect(),
            reserved,
            host: host.to_owned(),
        })
    }

    /// The first of `prospect`'s lenders in one of the pools `within` (their CIDRs) that an ADD
    /// that must borrow could take an address from now (skipping block edges as
    /// `skip_block_edges` says, past reservations and, under `config`'s cooldown, cooling
    /// addresses, as that ADD takes them); `None` when none can, or none was probed. Reads the
    /// first such lender's block, then the next two, four, ... in one read each while none has
    /// room (at most the 16 probed per pool): its cost does not grow with the blocks of other
    /// hosts. A lender whose block cannot be decoded
    /// is passed over, as the ADD passes over it.
    ///
    /// # Errors
    /// Store failures; a claim entry that changed under the read and cannot be decoded.
    pub async fn first_lender_with_room(
        &self,
        prospect: &NewBlockProspect,
        within: &[IpNet],
        config: &IpamConfig,
        skip_block_edges: bool,
    ) -> Result<Option<IpNet>, IpamError> {
        let lenders: Vec<(IpNet, KeyValue)> = prospect
            .lenders
            .iter()
            .copied()
            .zip(prospect.lender_claims.iter().cloned())
            .filter(|(cidr, _)| within.iter().any(|pool| pool.contains(&cidr.network())))
            .collect();
        Ok(self
            .first_with_room(&lenders, &prospect.reserved, config, skip_block_edges)
            .await?
            .block)
    }

    /// Where the ADD of the prospect's host looks when the blocks its search probed give it
    /// nothing: the whole claim index (one listing of small entries, not blocks), as that ADD
    /// reads it. With `claim`, the first block of `pools` (the ADD's candidate pools of one
    /// family, in its order) that no node has claimed and reservations leave an address in,
    /// which the ADD would claim; failing that, with `borrow`, the first lender in `pools` an ADD
    /// that must borrow could take an address from now, read as
    /// [`Self::first_lender_with_room`] reads its lenders; `None` when neither, with the lenders
    /// passed over for blocks that cannot be decoded. Reads no block when a block is unclaimed or
    /// no entry records a free address, and nothing when neither is allowed.
    ///
    /// # Errors
    /// Store failures; a claim entry that cannot be decoded (the ADD fails on it too).
    pub async fn room_in_claim_index(
        &self,
        prospect: &NewBlockProspect,
        pools: &[Pool],
        config: &IpamConfig,
        skip_block_edges: bool,
        claim: bool,
        borrow: bool,
    ) -> Result<ClaimIndexRoom, IpamError> {
        if !claim && !borrow {
            return Ok(ClaimIndexRoom::default());
        }
        let index = self.claim_index().await?;
        let reserved = &prospect.reserved;
        let usable = |cidr: &IpNet| !reserved.leaves_block_nothing(cidr, skip_block_edges);
        if claim {
            let claimed = index.entries.iter().map(|e| e.cidr);
            let none = BTreeMap::new();
            if let Some(cidr) = find_unclaimed_block(pools, &prospect.host, claimed, &none, usable)
            {
                return Ok(ClaimIndexRoom {
                    block: Some(cidr),
                    undecodable: Vec::new(),
                });
            }
        }
        if !borrow {
            return Ok(ClaimIndexRoom::default());
        }
        // As the borrowing ADD orders them: blocks nobody holds first, then by address.
        let mut lenders: Vec<&IndexedClaim> = index
            .entries
            .iter()
            .filter(|e| pools.iter().any(|p| p.cidr.contains(&e.cidr.network())))
            .filter(|e| e.claim.affinity.as_deref() != Some(prospect.host.as_str()))
            .filter(|e| e.claim.free != Some(0) && usable(&e.cidr))
            .collect();
        lenders.sort_by_key(|e| (e.claim.affinity.is_some(), e.cidr.network()));
        let lenders: Vec<(IpNet, KeyValue)> = lenders
            .into_iter()
            .map(|e| (e.cidr, e.stored.clone()))
            .collect();
        self.first_with_room(&lenders, reserved, config, skip_block_edges)
            .await
    }

    /// The first of `lenders` (CIDR and claim entry as read, in the order an ADD tries them)
    /// whose block an ADD could take an address from now, on copies never written: the first
    /// lender's block in one read, then the next two, four, ... in one read each while none has
    /// room; one that cannot be decoded is passed over, and named when none has room.
    async fn first_with_room(
        &self,
        lenders: &[(IpNet, KeyValue)],
        reserved: &crate::model::reservations::ReservedRanges,
        config: &IpamConfig,
        skip_block_edges: bool,
    ) -> Result<ClaimIndexRoom, IpamError> {
        let mut undecodable = Vec::new();
        let lifetime = self.lifetime(config);
        let attribute = Attribute {
            handle: String::new(),
            metadata: BTreeMap::new(),
        };
        // Batches of 1, 2, 4, ... lenders: few reads, and few blocks read when one has room.
        let mut start = 0;
        while start < lenders.len() {
            let end = lenders.len().min(2 * start + 1);
            let batch = &lenders[start..end];
            start = end;
            // The read pairs each CIDR with its claim entry in address order.
            let by_cidr: BTreeMap<IpNet, KeyValue> = batch.iter().cloned().collect();
            let cidrs: BTreeSet<IpNet> = by_cidr.keys().copied().collect();
            let claims = by_cidr.into_values().map(Some).collect();
            let loaded = self.load_blocks_given_claims_each(&cidrs, claims).await?;
            undecodable.extend(loaded.undecodable);
            let mut found: BTreeMap<IpNet, Block> = loaded
                .found
                .into_iter()
                .map(|(cidr, stored)| (cidr, stored.value))
                .collect();
            for (cidr, _) in batch {
                let Some(block) = found.get_mut(cidr) else {
                    continue;
                };
                // What the ADD does with the block, on a copy that is never written.
                block.finish_cooling(lifetime);
                let room = block_value_has_room(block)
                    && reserved
                        .allocate_next(block, &attribute, |block| {
                            if skip_block_edges {
                                block.allocate_next_host_address(&attribute)
                            } else {
                                block.allocate_next(&attribute)
                            }
                        })
                        .is_some();
                if room {
                    return Ok(ClaimIndexRoom {
                        block: Some(*cidr),
                        undecodable: Vec::new(),
                    });
                }
            }
        }
        Ok(ClaimIndexRoom {
            block: None,
            undecodable,
        })
    }

    async fn ensure_claim_index<'a>(
        &self,
        cache: &'a mut Option<ClaimIndex>,
    ) -> Result<&'a ClaimIndex, IpamError> {
        if cache.is_none() {
            *cache = Some(self.claim_index().await?);
        }
        cache
            .as_ref()
            .ok_or_else(|| IpamError::Internal("claim index cache vanished".into()))
    }

    /// The addresses a handle holds, reading only the blocks not already in hand (by key, as
    /// `host`'s blocks first: one read when they are).
    async fn addresses_in_blocks(
        &self,
        handle_id: &str,
        handle: &Handle,
        host: &str,
        in_hand: &[Stored<Block>],
    ) -> Result<Vec<AssignedAddress>, IpamError> {
        let mut blocks: BTreeMap<IpNet, Block> = in_hand
            .iter()
            .filter(|b| handle.blocks.contains_key(&b.value.cidr))
            .map(|b| (b.value.cidr, b.value.clone()))
            .collect();
        let missing: BTreeSet<IpNet> = handle
            .blocks
            .keys()
            .filter(|c| !blocks.contains_key(c))
            .copied()
            .collect();
        for (cidr, stored) in self.load_host_blocks(host, &missing).await? {
            blocks.insert(cidr, stored.value);
        }
        let mut addresses = Vec::new();
        for block in blocks.values_mut() {
            learn_apart_from_handle(block, handle_id, handle);
            for ordinal in block.ordinals_of_handle(handle_id)? {
                addresses.push(AssignedAddress {
                    ip: block.ip_of(ordinal),
                    block: block.cidr,
                });
            }
        }
        addresses.sort();
        Ok(addresses)
    }

    // -----------------------------------------------------------------------------------------
    // Specific addresses
    // -----------------------------------------------------------------------------------------

    /// Assigns the given addresses to a handle, all or none. Each must lie in an enabled pool; its
    /// block is claimed for `host` when it does not exist. An address the same handle already holds
    /// is accepted as is.
    ///
    /// # Errors
    /// [`IpamError::NotInPool`]; [`IpamError::AlreadyAssigned`]; [`IpamError::AddressCooling`]
    /// for an address released recently and still in IP cooldown;
    /// [`IpamError::AffinityConflict`] under strict affinity; store failures.
    pub async fn assign_ips(
        &self,
        request: &AssignIpsRequest,
    ) -> Result<Vec<AssignedAddress>, IpamError> {
        validate_handle(&request.handle)?;
        validate_host(&request.host)?;
        validate_attribute_size(&request.handle, &request.attributes, &request.host)?;
        if request.ips.is_empty() || request.ips.len() > MAX_ADDRESSES_PER_REQUEST as usize {
            return Err(IpamError::invalid(format!(
                "between 1 and {MAX_ADDRESSES_PER_REQUEST} addresses may be assigned at once"
            )));
        }
        let unique: BTreeSet<IpAddr> = request.ips.iter().copied().collect();
        if unique.len() != request.ips.len() {
            return Err(IpamError::invalid("an address is listed twice"));
        }
        self.retrying(|| self.try_assign_ips(request)).await
    }

    async fn try_assign_ips(
        &self,
        request: &AssignIpsRequest,
    ) -> Result<Attempt<Vec<AssignedAddress>>, IpamError> {
        let handle_key = keys::handle(&request.handle);
        let results = self
            .store
            .read_many(&[
                Read::List(keys::pools_dir()),
                Read::Get(keys::config()),
                format_read(),
                Read::Get(handle_key.clone()),
                Read::Get(keys::import_in_progress()),
                Read::List(keys::reservations_dir()),
            ])
            .await?;
        let mut results = results.into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let (config, config_revision) = Self::decode_config(next_got(&mut results)?)?;
        self.learn_format(next_got(&mut results)?).await?;
        let (mut handle, handle_revision) = Self::decode_handle(next_got(&mut results)?)?;
        refuse_during_import(next_got(&mut results)?)?;
        // Only for the warning below: a damaged reservation must not stop an explicit assignment.
        let reserved = ReservedRanges::from_listed(&next_listed(&mut results)?).unwrap_or_default();
        let lifetime = self.lifetime(&config);
        let now = lifetime.now;

        let mut targets: Vec<(IpAddr, IpNet, &Stored<Pool>)> = Vec::new();
        for ip in &request.ips {
            let pool = pools
                .iter()
                .find(|p| !p.value.disabled && p.value.cidr.contains(ip))
                .ok_or(IpamError::NotInPool(*ip))?;
            if let Some(purpose) = request.purpose {
                if !pool.value.allowed_uses.allows(purpose) {
                    return Err(IpamError::PoolUseNotAllowed {
                        pool: pool.value.name.clone(),
                        use_: purpose,
                        allowed: pool.value.allowed_uses.clone(),
                    });
                }
            }
            targets.push((*ip, IpNet::from(*ip), pool));
        }
        // The block each address lies in, whatever its size (resize.rs: a pool's blocks may have
        // mixed sizes), read in the same round trips as an exact-CIDR read.
        let wanted: Vec<(IpAddr, &Pool)> = targets.iter().map(|t| (t.0, &t.2.value)).collect();
        let mut located = self.locate_blocks(&wanted).await?;
        for target in &mut targets {
            target.1 = *located
                .block_of
                .get(&target.0)
                .ok_or(IpamError::NotInPool(target.0))?;
        }
        let mut loaded = std::mem::take(&mut located.loaded);
        let sequence_floor = loaded.sequence_floor;
        // Who holds each target: this handle's own record names what it holds apart; an address
        // held apart by another handle is named by its owner key.
        for stored in loaded.found.values_mut() {
            learn_apart_from_handle(&mut stored.value, &request.handle, &handle);
        }
        let held_by_others = loaded.found.values_mut().filter(|stored| {
            targets.iter().any(|(ip, cidr, _)| {
                *cidr == stored.value.cidr
                    && stored
                        .value
                        .ordinal_of(*ip)
                        .is_some_and(|o| stored.value.attribute_of(o).is_err())
            })
        });
        self.load_owner_keys(held_by_others).await?;
        let mut working: BTreeMap<IpNet, WorkingBlock> = loaded
            .found
            .into_iter()
            .map(|(cidr, stored)| (cidr, WorkingBlock::from_stored(stored)))
            .collect();
        let attribute = Attribute {
            handle: request.handle.clone(),
            metadata: with_node(&request.attributes, &request.host),
        };
        let mut plan = self.plan();
        let mut assigned = Vec::new();
        for (ip, cidr, pool) in &targets {
            let entry = working.entry(*cidr).or_insert_with(|| {
                WorkingBlock::created(*cidr, Some(request.host.clone()), sequence_floor, now)
            });
            if let Some(owner) = entry.block.affinity.as_deref() {
                if owner != request.host
                    && config.strict_affinity
                    && !request.ignore_strict_affinity
                {
                    return Err(IpamError::AffinityConflict {
                        ip: *ip,
                        block: *cidr,
                        owner: owner.to_owned(),
                    });
                }
            }
            let ordinal = entry
                .block
                .ordinal_of(*ip)
                .ok_or_else(|| IpamError::Internal(format!("{ip} is not inside {cidr}")))?;
            if let Some(holder) = entry.block.attribute_of(ordinal)? {
                if holder.handle == request.handle {
                    assigned.push(AssignedAddress {
                        ip: *ip,
                        block: *cidr,
                    });
                    continue;
                }
                return Err(IpamError::AlreadyAssigned {
                    ip: *ip,
                    handle: holder.handle.clone(),
                });
            }
            // As Calico (the address keeps its allocation entry while it cools): not handed out,
            // even named explicitly, until its cooldown has passed.
            if let Some(cooling) = entry
                .block
                .cooling
                .iter()
                .find(|c| c.ordinal == ordinal && !lifetime.cooled(c.released_at))
            {
                return Err(IpamError::AddressCooling {
                    ip: *ip,
                    released_at: cooling.released_at,
                    cools_at: lifetime.cooldown_end(cooling.released_at),
                });
            }
            if reserved.contains(*ip) {
                // As Calico: reservations keep addresses from auto-assign only.
                tracing::warn!(%ip, handle = %request.handle, "assigning a reserved address, as explicitly requested");
            }
            entry.block.allocate_ordinal(ordinal, &attribute);
            entry.dirty = true;
            plan.index_borrowed(&request.host, &entry.block);
            handle.hold(*cidr, ordinal, plan.apart_metadata(&attribute.metadata));
            plan.expect(&pool.key, Some(pool.revision));
            assigned.push(AssignedAddress {
                ip: *ip,
                block: *cidr,
            });
        }
        for working in working.values() {
            plan.write_block(working)?;
        }
        located.guard_creations(&mut plan, working.values());
        if !plan.is_empty() {
            plan.expect(&keys::config(), config_revision);
            plan.expect(&handle_key, handle_revision);
            plan.put(&handle_key, encode(&handle)?);
        }
        self.commit_plan(plan, assigned).await
    }
}

/// The blocks of `family` in one of `candidates` among `blocks` (the host's blocks kept under
/// `full/` with only their edges free) that `working` does not hold yet, added to it: their CIDRs.
fn adopt_edge_blocks(
    blocks: Vec<Stored<Block>>,
    candidates: &[&Stored<Pool>],
    family: Family,
    working: &mut BTreeMap<IpNet, WorkingBlock>,
) -> Vec<IpNet> {
    let mut adopted = Vec::new();
    for stored in blocks {
        let cidr = stored.value.cidr;
        let in_candidates = candidates
            .iter()
            .any(|p| p.value.cidr.contains(&cidr.network()));
        if Family::of_net(&cidr) == family && in_candidates && !working.contains_key(&cidr) {
            working.insert(cidr, WorkingBlock::from_stored(stored));
            adopted.push(cidr);
        }
    }
    adopted
}

/// How many blocks that a writer of an older format left under `open/` with only their edges free
/// one allocation moves to `full/` (each move is two writes and a condition more).
const EDGE_BLOCKS_MOVED_PER_CALL: usize = 4;

/// The pools an auto-assign may use for one family.
fn candidate_pools<'a>(
    pools: &'a [Stored<Pool>],
    family: Family,
    requested: &[String],
    host: &str,
    node_labels: &BTreeMap<String, String>,
    purpose: AllowedUse,
) -> Result<Vec<&'a Stored<Pool>>, IpamError> {
    if requested.is_empty() {
        // As Calico: enabled, automatic, allowing the use, and selecting the node.
        let enabled: Vec<&Stored<Pool>> = pools
            .iter()
            .filter(|p| p.value.family() == family && !p.value.disabled)
            .collect();
        let chosen: Vec<&Stored<Pool>> = enabled
            .iter()
            .copied()
            .filter(|p| {
                p.value.assignment_mode == AssignmentMode::Automatic
                    && p.value.allowed_uses.allows(purpose)
                    && p.value.node_selector.matches(node_labels)
            })
            .collect();
        if chosen.is_empty() && !enabled.is_empty() {
            return Err(IpamError::NoPoolSelectsNode {
                host: host.to_owned(),
                family,
                pools: enabled.iter().map(|p| p.value.name.clone()).collect(),
            });
        }
        return Ok(chosen);
    }
    // Pools named explicitly are used whatever they select, manual ones included (as Calico);
    // they must still allow the use.
    let mut chosen = Vec::new();
    for wanted in requested {
        let pool = named_pool(pools, wanted, family, purpose)?;
        if !chosen
            .iter()
            .any(|c: &&Stored<Pool>| c.value.name == pool.value.name)
        {
            chosen.push(pool);
        }
    }
    Ok(chosen)
}

/// The pool `wanted` (a name or CIDR) names, when a request of `family` for `purpose` may use it:
/// it exists, is of the family, is enabled and allows the use.
///
/// # Errors
/// [`IpamError::PoolNotFound`], [`IpamError::PoolWrongFamily`], [`IpamError::PoolDisabled`],
/// [`IpamError::PoolUseNotAllowed`].
pub(crate) fn named_pool<'a>(
    pools: &'a [Stored<Pool>],
    wanted: &str,
    family: Family,
    purpose: AllowedUse,
) -> Result<&'a Stored<Pool>, IpamError> {
    let pool = find_pool(pools, wanted)?;
    if pool.value.family() != family {
        return Err(IpamError::PoolWrongFamily {
            pool: wanted.to_owned(),
            family,
        });
    }
    if pool.value.disabled {
        return Err(IpamError::PoolDisabled(pool.value.name.clone()));
    }
    if !pool.value.allowed_uses.allows(purpose) {
        return Err(IpamError::PoolUseNotAllowed {
            pool: pool.value.name.clone(),
            use_: purpose,
            allowed: pool.value.allowed_uses.clone(),
        });
    }
    Ok(pool)
}

/// Allocates from `order` until `got` holds `wanted` addresses (host addresses of each block's
/// prefix only, with `skip_block_edges`), passing over reserved and cooling addresses.
#[allow(clippy::too_many_arguments)]
fn take_from_blocks(
    working: &mut BTreeMap<IpNet, WorkingBlock>,
    order: &[IpNet],
    attribute: &Attribute,
    wanted: u32,
    skip_block_edges: bool,
    lifetime: Lifetime,
    reserved: &ReservedRanges,
    got: &mut Vec<AssignedAddress>,
) {
    for cidr in order {
        let Some(entry) = working.get_mut(cidr) else {
            continue;
        };
        // A block reservations cover entirely is skipped as a whole (as Calico does).
        if reserved.leaves_block_nothing(cidr, skip_block_edges) {
            continue;
        }
        // Addresses whose cooldown has passed join the free list; it is stored only if the block
        // is written anyway.
        entry.block.finish_cooling(lifetime);
        while (got.len() as u32) < wanted && block_value_has_room(&entry.block) {
            let next = reserved.allocate_next(&mut entry.block, attribute, |block| {
                if skip_block_edges {
                    block.allocate_next_host_address(attribute)
                } else {
                    block.allocate_next(attribute)
                }
            });
            match next {
                Some(ordinal) => {
                    entry.dirty = true;
                    got.push(AssignedAddress {
                        ip: entry.block.ip_of(ordinal),
                        block: entry.block.cidr,
                    });
                }
                None => break,
            }
        }
        if (got.len() as u32) >= wanted {
            return;
        }
    }
}

/// The free addresses of a lender's block an ADD can surely have, by its claim entry: its free
/// count, less the block's two edges when the ADD skips them (they may be among the free ones);
/// one for an entry that records no count (format 1).
fn sure_free(lender: &IndexedClaim, skip_block_edges: bool) -> u32 {
    let Some(free) = lender.claim.free else {
        return 1;
    };
    let has_edges = lender.cidr.max_prefix_len() - lender.cidr.prefix_len() >= 2;
    if skip_block_edges && has_edges {
        free.saturating_sub(2)
    } else {
        free
    }
}

/// The first block of the candidate pools that does not exist yet, searching each pool from an
/// index seeded by the host name and wrapping around.
fn find_unclaimed_block<'p>(
    candidates: impl IntoIterator<Item = &'p Pool>,
    host: &str,
    claimed: impl Iterator<Item = IpNet>,
    working: &BTreeMap<IpNet, WorkingBlock>,
    assignable: impl Fn(&IpNet) -> bool,
) -> Option<IpNet> {
    let taken = TakenCidrs::new(claimed.chain(working.keys().copied()));
    for pool in candidates {
        let count = pool.block_count();
        let in_pool = taken.count_inside(&pool.cidr) as u128;
        // A free block is found within (blocks already taken in this pool + 1) steps.
        let steps = count.min(in_pool + 1);
        let start = u128::from(host_hash(host)) % count;
        for step in 0..steps.max(1) {
            let index = (start + step) % count;
            let Some(candidate) = pool.block_at(index) else {
                continue;
            };
            if !taken.overlaps(&candidate) && assignable(&candidate) {
                return Some(candidate);
            }
        }
        // Taken blocks may be spread out: a full scan settles it.
        if steps < count {
            let mut index = (start + steps) % count;
            for _ in steps..count.min(1 << 20) {
                if let Some(candidate) = pool.block_at(index) {
                    if !taken.overlaps(&candidate) && assignable(&candidate) {
                        return Some(candidate);
                    }
                }
                index = (index + 1) % count;
            }
        }
    }
    None
}

/// Claimed CIDRs ordered by family and first address, for overlap questions in O(log n).
struct TakenCidrs {
    by_start: BTreeMap<(Family, u128), IpNet>,
}

impl TakenCidrs {
    fn new(cidrs: impl Iterator<Item = IpNet>) -> Self {
        let mut by_start: BTreeMap<(Family, u128), IpNet> = BTreeMap::new();
        for cidr in cidrs {
            let key = (Family::of_net(&cidr), ip_to_u128(cidr.network()));
            // Of two CIDRs starting at one address, keep the wider: it covers the other.
            match by_start.get(&key) {
                Some(kept) if kept.prefix_len() <= cidr.prefix_len() => {}
                _ => {
                    by_start.insert(key, cidr);
                }
            }
        }
        TakenCidrs { by_start }
    }

    fn bounds(cidr: &IpNet) -> ((Family, u128), (Family, u128)) {
        let family = Family::of_net(cidr);
        (
            (family, ip_to_u128(cidr.network())),
            (family, ip_to_u128(cidr.broadcast())),
        )
    }

    /// True when a taken CIDR starts inside `cidr`, or the nearest one starting before it covers it.
    fn overlaps(&self, cidr: &IpNet) -> bool {
        let (first, last) = Self::bounds(cidr);
        if self.by_start.range(first..=last).next().is_some() {
            return true;
        }
        self.by_start
            .range(..first)
            .next_back()
            .is_some_and(|(key, taken)| key.0 == first.0 && taken.contains(&cidr.network()))
    }

    /// How many taken CIDRs start inside `cidr`.
    fn count_inside(&self, cidr: &IpNet) -> usize {
        let (first, last) = Self::bounds(cidr);
        self.by_start.range(first..=last).count()
    }
}

/// Adds `found`, blocks of the host kept under `full/` that cannot be decoded, to `damaged`
/// (named if the request then falls short), warning once for each not already there: the
/// request passes over it, and the addresses at its edges are not handed out until it is
/// repaired.
fn pass_over_damaged_full_blocks(
    damaged: &mut Vec<UndecodableObject>,
    found: Vec<UndecodableObject>,
) {
    for object in found {
        if damaged.iter().any(|known| known.key == object.key) {
            continue;
        }
        tracing::warn!(
            key = %object.key,
            "passing over a full block of this node that cannot be decoded ({}): the addresses \
             at its edges are not handed out until it is repaired (blockipamctl check)",
            object.message
        );
        damaged.push(object);
    }
}
