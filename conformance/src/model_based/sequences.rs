//! The runtime model: who holds what after every step of a generated sequence, each answer
//! checked against it, and the sequential test that runs the sequences on a store.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ipam_core::{
    AssignIpsRequest, AssignedAddress, AutoAssignRequest, Family, HostRelease, Ipam, IpamError,
    Pool, ReleaseOutcome, ReleaseRequest,
};
use ipnet::IpNet;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use proptest_state_machine::ReferenceStateMachine;

use crate::StoreFactory;

use super::machine::{
    AddressPick, AllocatorMachine, GenerationState, ModelConfig, ReleasePick, Step,
};
use super::{
    address_at, capacity, family_of, handle_name, host_name, menu_pool, menu_spec, CASES_ENV,
    DEFAULT_CASES, DEFAULT_STEPS, HANDLES, INITIAL_POOLS, POOL_MENU, POOL_NAMES, SHRINK_TIME_MS,
    STEPS_ENV,
};

// ---------------------------------------------------------------------------------------------
// The runtime model
// ---------------------------------------------------------------------------------------------

/// One held address, as the model knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Holding {
    handle: String,
    /// The host the address was asked for (its `node` attribute).
    node: String,
    block: IpNet,
    /// The block sequence number it was allocated at: learned from the store right after the
    /// step that allocated it.
    sequence: Option<u64>,
}

/// One concrete operation, resolved from a [`Step`] against the model.
#[derive(Debug, Clone)]
enum Op {
    AutoAssign {
        handle: String,
        host: String,
        v4: u32,
        v6: u32,
    },
    AssignAddresses {
        handle: String,
        host: String,
        ips: Vec<IpAddr>,
    },
    Release(Vec<ReleaseRequest>),
    ReleaseHandle(String),
    ReleaseHost {
        host: String,
        addresses: bool,
    },
    AddPool(usize),
    SetPoolDisabled {
        name: String,
        disabled: bool,
    },
    DeletePool {
        name: String,
        force: bool,
    },
    ReleaseAffinity {
        host: String,
        block: IpNet,
    },
}

impl Op {
    /// The allocator call, for counting outcomes.
    fn kind(&self) -> &'static str {
        match self {
            Op::AutoAssign { v4, v6, .. } => match (*v4 > 0, *v6 > 0) {
                (true, true) => "auto_assign dual-stack",
                (true, false) => "auto_assign IPv4",
                _ => "auto_assign IPv6",
            },
            Op::AssignAddresses { .. } => "assign_ips",
            Op::Release(requests) if requests.iter().any(|r| r.sequence.is_some()) => {
                "release_ips (some guarded)"
            }
            Op::Release(_) => "release_ips (unguarded)",
            Op::ReleaseHandle(_) => "release_handle",
            Op::ReleaseHost {
                addresses: true, ..
            } => "release_host with addresses",
            Op::ReleaseHost { .. } => "release_host",
            Op::AddPool(_) => "create_pool",
            Op::SetPoolDisabled { .. } => "set_pool_disabled",
            Op::DeletePool { force: true, .. } => "delete_pool force",
            Op::DeletePool { .. } => "delete_pool",
            Op::ReleaseAffinity { .. } => "release_affinity",
        }
    }
}

/// How one family of an auto-assign must be served, in Calico's order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct FamilyPlan {
    /// From the host's existing affine blocks.
    from_affine: u32,
    /// New blocks claimed for the host.
    new_blocks: u32,
    /// Addresses from those new blocks.
    from_new: u32,
    /// Borrowed from blocks not affine to the host.
    borrowed: u32,
}

/// Who holds what, which blocks exist with which affinity, which pools exist; plus every
/// (address, sequence) pair ever handed out and the ones since released.
#[derive(Debug)]
struct Model {
    config: ModelConfig,
    pools: BTreeMap<String, Pool>,
    blocks: BTreeMap<IpNet, Option<String>>,
    holdings: BTreeMap<IpAddr, Holding>,
    issued: BTreeSet<(IpAddr, u64)>,
    retired: Vec<(IpAddr, u64)>,
    /// Every block CIDR that ever existed in this case (to count re-creations).
    ever_blocks: BTreeSet<IpNet>,
    /// What happened, counted (printed at the end of a test: shows what the runs exercised).
    tally: Tally,
}

/// Counts of what the runs exercised, by label.
#[derive(Debug, Default, Clone)]
pub(super) struct Tally(BTreeMap<String, u64>);

impl Tally {
    pub(super) fn add(&mut self, label: impl Into<String>, n: u64) {
        if n > 0 {
            *self.0.entry(label.into()).or_insert(0) += n;
        }
    }

    pub(super) fn merge(&mut self, other: &Tally) {
        for (label, n) in &other.0 {
            self.add(label.clone(), *n);
        }
    }

    pub(super) fn outcome<T>(&mut self, operation: &str, outcome: &Result<T, IpamError>) {
        match outcome {
            Ok(_) => self.add(format!("{operation}: ok"), 1),
            Err(e) => self.add(format!("{operation}: {}", error_kind(e)), 1),
        }
    }
}

impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (label, n) in &self.0 {
            writeln!(f, "  {n:>8}  {label}")?;
        }
        Ok(())
    }
}

/// The variant name of an error (`Exhausted`, `PoolInUse`, ...).
fn error_kind(e: &IpamError) -> String {
    let text = format!("{e:?}");
    text.split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or_default()
        .to_owned()
}

pub(super) fn fail(message: impl Into<String>) -> TestCaseError {
    TestCaseError::fail(message.into())
}

pub(super) fn store_error(what: &str) -> impl FnOnce(IpamError) -> TestCaseError + '_ {
    move |e| fail(format!("{what} failed: {e} ({e:?})"))
}

fn expect_outcome<T: fmt::Debug + PartialEq>(
    op: &Op,
    expected: &Result<T, IpamError>,
    actual: &Result<T, IpamError>,
) -> Result<(), TestCaseError> {
    if expected == actual {
        Ok(())
    } else {
        Err(fail(format!(
            "{op:?}: the model expected {expected:?}, the allocator answered {actual:?}"
        )))
    }
}

impl Model {
    fn new(config: ModelConfig) -> Self {
        Model {
            config,
            pools: BTreeMap::new(),
            blocks: BTreeMap::new(),
            holdings: BTreeMap::new(),
            issued: BTreeSet::new(),
            retired: Vec::new(),
            ever_blocks: BTreeSet::new(),
            tally: Tally::default(),
        }
    }

    /// Checks an answer against the prediction and counts it.
    fn expect<T: fmt::Debug + PartialEq>(
        &mut self,
        op: &Op,
        expected: &Result<T, IpamError>,
        actual: &Result<T, IpamError>,
    ) -> Result<(), TestCaseError> {
        self.tally.outcome(op.kind(), actual);
        expect_outcome(op, expected, actual)
    }

    /// Pools in the allocator's order (family, then address).
    fn sorted_pools(&self) -> Vec<&Pool> {
        let mut pools: Vec<&Pool> = self.pools.values().collect();
        pools.sort_by_key(|p| (p.cidr.network(), p.cidr.prefix_len()));
        pools
    }

    fn pool_containing(&self, ip: IpAddr) -> Option<&Pool> {
        self.sorted_pools()
            .into_iter()
            .find(|p| p.cidr.contains(&ip))
    }

    fn used(&self, block: &IpNet) -> u32 {
        self.holdings.values().filter(|h| h.block == *block).count() as u32
    }

    fn free(&self, block: &IpNet) -> u32 {
        capacity(block) - self.used(block)
    }

    fn held_addresses(&self) -> Vec<IpAddr> {
        self.holdings.keys().copied().collect()
    }

    fn holdings_of(&self, handle: &str) -> Vec<AssignedAddress> {
        self.holdings
            .iter()
            .filter(|(_, h)| h.handle == handle)
            .map(|(ip, h)| AssignedAddress {
                ip: *ip,
                block: h.block,
            })
            .collect()
    }

    /// Forgets a held address (its pair goes to the stale list) and deletes its block when that
    /// leaves it empty without affinity.
    fn release_address(&mut self, ip: IpAddr) {
        if let Some(holding) = self.holdings.remove(&ip) {
            if let Some(sequence) = holding.sequence {
                self.retired.push((ip, sequence));
            }
            self.settle(holding.block);
        }
    }

    fn settle(&mut self, block: IpNet) {
        if self.blocks.get(&block) == Some(&None) && self.used(&block) == 0 {
            self.blocks.remove(&block);
            self.tally.add("blocks deleted (empty, no affinity)", 1);
        }
    }

    fn hold(&mut self, ip: IpAddr, block: IpNet, handle: &str, host: &str) {
        if let std::collections::btree_map::Entry::Vacant(entry) = self.blocks.entry(block) {
            entry.insert(Some(host.to_owned()));
            if self.ever_blocks.insert(block) {
                self.tally.add("blocks created", 1);
            } else {
                self.tally.add("blocks re-created (same CIDR again)", 1);
            }
        }
        self.holdings.insert(
            ip,
            Holding {
                handle: handle.to_owned(),
                node: host.to_owned(),
                block,
                sequence: None,
            },
        );
    }

    // --- predictions ------------------------------------------------------------------------

    /// How an auto-assign of `wanted` addresses of `family` for `host` must be served, or the
    /// error it must fail with (mirrors Calico's order: affine blocks, new blocks, borrowing).
    fn plan_family(
        &self,
        host: &str,
        family: Family,
        wanted: u32,
    ) -> Result<FamilyPlan, IpamError> {
        let candidates: Vec<&Pool> = self
            .sorted_pools()
            .into_iter()
            .filter(|p| p.family() == family && !p.disabled)
            .collect();
        let in_candidates =
            |cidr: &IpNet| candidates.iter().any(|p| p.cidr.contains(&cidr.network()));
        let of_family = |cidr: &IpNet| family_of(cidr) == family;
        let mut plan = FamilyPlan::default();
        let affine_free: u32 = self
            .blocks
            .iter()
            .filter(|(c, a)| of_family(c) && a.as_deref() == Some(host) && in_candidates(c))
            .map(|(c, _)| self.free(c))
            .sum();
        plan.from_affine = affine_free.min(wanted);
        let mut got = plan.from_affine;
        if got < wanted && self.config.auto_allocate_blocks {
            let mut owned = self
                .blocks
                .iter()
                .filter(|(c, a)| of_family(c) && a.as_deref() == Some(host))
                .count() as u32;
            let mut unclaimed: Vec<(u32, u128)> = candidates
                .iter()
                .map(|p| {
                    let existing = self
                        .blocks
                        .keys()
                        .filter(|c| p.cidr.contains(&c.network()))
                        .count() as u128;
                    (
                        1u32 << (p.cidr.max_prefix_len() - p.block_size),
                        p.block_count() - existing,
                    )
                })
                .collect();
            let limit = self.config.max_blocks_per_host;
            while got < wanted {
                if limit != 0 && owned >= limit {
                    return Err(IpamError::BlockLimit {
                        host: host.to_owned(),
                        family,
                        owned,
                        limit,
                    });
                }
                let Some(slot) = unclaimed.iter_mut().find(|(_, left)| *left > 0) else {
                    break;
                };
                slot.1 -= 1;
                owned += 1;
                plan.new_blocks += 1;
                let take = slot.0.min(wanted - got);
                plan.from_new += take;
                got += take;
            }
        }
        if got < wanted && !self.config.strict_affinity {
            let lendable: u32 = self
                .blocks
                .iter()
                .filter(|(c, a)| of_family(c) && a.as_deref() != Some(host) && in_candidates(c))
                .map(|(c, _)| self.free(c))
                .sum();
            plan.borrowed = lendable.min(wanted - got);
            got += plan.borrowed;
        }
        if got < wanted {
            return Err(IpamError::Exhausted {
                family,
                requested: wanted,
                found: got,
                pools: candidates.iter().map(|p| p.name.clone()).collect(),
            });
        }
        Ok(plan)
    }

    /// The answer a specific assign must get (the allocator's checks, in its order).
    fn expected_assign(
        &self,
        handle: &str,
        host: &str,
        ips: &[IpAddr],
    ) -> Result<Vec<AssignedAddress>, IpamError> {
        let mut targets = Vec::new();
        for ip in ips {
            let pool = self
                .sorted_pools()
                .into_iter()
                .find(|p| !p.disabled && p.cidr.contains(ip))
                .ok_or(IpamError::NotInPool(*ip))?;
            let block = pool
                .block_containing(*ip)
                .ok_or(IpamError::NotInPool(*ip))?;
            targets.push((*ip, block));
        }
        let mut created: BTreeSet<IpNet> = BTreeSet::new();
        let mut assigned = Vec::new();
        for (ip, block) in targets {
            let owner = match self.blocks.get(&block) {
                Some(owner) => owner.clone(),
                None => {
                    created.insert(block);
                    Some(host.to_owned())
                }
            };
            if let Some(owner) = owner {
                if owner != host && self.config.strict_affinity {
                    return Err(IpamError::AffinityConflict { ip, block, owner });
                }
            }
            if let Some(holder) = self.holdings.get(&ip) {
                if holder.handle != handle {
                    return Err(IpamError::AlreadyAssigned {
                        ip,
                        handle: holder.handle.clone(),
                    });
                }
            }
            assigned.push(AssignedAddress { ip, block });
        }
        Ok(assigned)
    }

    /// The outcome a release by address must have, applied to the model as it goes.
    fn apply_release(&mut self, requests: &[ReleaseRequest]) -> ReleaseOutcome {
        let mut outcome = ReleaseOutcome::default();
        for request in requests {
            let block = self
                .pool_containing(request.ip)
                .and_then(|p| p.block_containing(request.ip));
            let Some(block) = block.filter(|b| self.blocks.contains_key(b)) else {
                outcome.not_allocated.push(request.ip);
                continue;
            };
            let Some(holding) = self.holdings.get(&request.ip).filter(|h| h.block == block) else {
                outcome.not_allocated.push(request.ip);
                continue;
            };
            if request.sequence.is_some() && request.sequence != holding.sequence {
                outcome.sequence_mismatch.push(request.ip);
                self.tally
                    .add("guarded releases refused (sequence mismatch)", 1);
                continue;
            }
            self.release_address(request.ip);
            outcome.released.push(request.ip);
        }
        outcome.released.sort();
        outcome.not_allocated.sort();
        outcome.sequence_mismatch.sort();
        outcome
    }

    fn apply_release_handle(&mut self, handle: &str) -> Vec<IpAddr> {
        let released: Vec<IpAddr> = self.holdings_of(handle).iter().map(|a| a.ip).collect();
        for ip in &released {
            self.release_address(*ip);
        }
        released
    }

    fn apply_release_host(&mut self, host: &str, addresses: bool) -> HostRelease {
        let mut report = HostRelease::default();
        if addresses {
            let handles: BTreeSet<String> = self
                .holdings
                .values()
                .filter(|h| h.node == host)
                .map(|h| h.handle.clone())
                .collect();
            for handle in handles {
                report
                    .released_addresses
                    .extend(self.apply_release_handle(&handle));
            }
            report.released_addresses.sort();
        }
        let owned: Vec<IpNet> = self
            .blocks
            .iter()
            .filter(|(_, a)| a.as_deref() == Some(host))
            .map(|(c, _)| *c)
            .collect();
        for block in owned {
            self.blocks.insert(block, None);
            if self.used(&block) == 0 {
                report.deleted_blocks.push(block);
            } else {
                report.unassigned_blocks.push(block);
            }
            self.settle(block);
        }
        report
    }

    fn expected_add_pool(&self, menu: usize) -> Result<Pool, IpamError> {
        let pool = menu_pool(menu);
        for existing in self.sorted_pools() {
            if existing.name == pool.name {
                return Err(IpamError::PoolExists(pool.name.clone()));
            }
            if existing.cidr.contains(&pool.cidr.network())
                || pool.cidr.contains(&existing.cidr.network())
            {
                return Err(IpamError::PoolOverlap {
                    cidr: pool.cidr,
                    existing: existing.name.clone(),
                    existing_cidr: existing.cidr,
                });
            }
        }
        Ok(pool)
    }

    /// Resolves the block a step names: the `pick`th existing block (none when there is none).
    fn pick_block(&self, pick: u16) -> Option<IpNet> {
        if self.blocks.is_empty() {
            return None;
        }
        self.blocks
            .keys()
            .nth(usize::from(pick) % self.blocks.len())
            .copied()
    }

    fn pick_held(&self, pick: u16) -> Option<IpAddr> {
        let held = self.held_addresses();
        if held.is_empty() {
            None
        } else {
            Some(held[usize::from(pick) % held.len()])
        }
    }

    fn resolve_release(&self, picks: &[ReleasePick]) -> Vec<ReleaseRequest> {
        picks
            .iter()
            .map(|pick| match pick {
                ReleasePick::Held { index, guarded } => match self.pick_held(*index) {
                    Some(ip) => ReleaseRequest {
                        ip,
                        sequence: if *guarded {
                            self.holdings.get(&ip).and_then(|h| h.sequence)
                        } else {
                            None
                        },
                    },
                    None => ReleaseRequest {
                        ip: address_at(*index),
                        sequence: None,
                    },
                },
                ReleasePick::Anywhere(pick) => ReleaseRequest {
                    ip: address_at(*pick),
                    sequence: None,
                },
                ReleasePick::Stale(index) => {
                    if self.retired.is_empty() {
                        ReleaseRequest {
                            ip: address_at(*index),
                            sequence: None,
                        }
                    } else {
                        let (ip, sequence) = self.retired[usize::from(*index) % self.retired.len()];
                        ReleaseRequest {
                            ip,
                            sequence: Some(sequence),
                        }
                    }
                }
            })
            .collect()
    }

    // --- running an operation ----------------------------------------------------------------

    /// Runs one operation on the allocator, checks its answer against the model's prediction,
    /// updates the model, then compares the whole store with the model.
    async fn run(&mut self, ipam: &Ipam, op: Op) -> Result<(), TestCaseError> {
        match &op {
            Op::AutoAssign {
                handle,
                host,
                v4,
                v6,
            } => {
                self.run_auto_assign(ipam, &op, handle, host, *v4, *v6)
                    .await?
            }
            Op::AssignAddresses { handle, host, ips } => {
                let expected = self.expected_assign(handle, host, ips);
                let actual = ipam
                    .assign_ips(&AssignIpsRequest {
                        ips: ips.clone(),
                        handle: handle.clone(),
                        host: host.clone(),
                        ..Default::default()
                    })
                    .await;
                self.expect(&op, &expected, &actual)?;
                if let Ok(assigned) = expected {
                    for address in assigned {
                        if !self.holdings.contains_key(&address.ip) {
                            self.hold(address.ip, address.block, handle, host);
                        }
                    }
                }
            }
            Op::Release(requests) => {
                let expected = Ok(self.apply_release(requests));
                let actual = ipam.release_ips(requests).await;
                self.expect(&op, &expected, &actual)?;
            }
            Op::ReleaseHandle(handle) => {
                let expected = Ok(self.apply_release_handle(handle));
                let actual = ipam.release_handle(handle).await;
                self.expect(&op, &expected, &actual)?;
            }
            Op::ReleaseHost { host, addresses } => {
                let mut expected = self.apply_release_host(host, *addresses);
                let mut actual = ipam
                    .release_host(host, *addresses)
                    .await
                    .map_err(store_error("release_host"))?;
                for report in [&mut expected, &mut actual] {
                    report.deleted_blocks.sort();
                    report.unassigned_blocks.sort();
                    report.released_addresses.sort();
                }
                self.expect(&op, &Ok(expected), &Ok(actual))?;
            }
            Op::AddPool(menu) => {
                let expected = self.expected_add_pool(*menu);
                let actual = ipam.create_pool(&menu_spec(*menu)).await;
                self.expect(&op, &expected, &actual)?;
                if let Ok(pool) = expected {
                    self.pools.insert(pool.name.clone(), pool);
                }
            }
            Op::SetPoolDisabled { name, disabled } => {
                let expected = match self.pools.get_mut(name) {
                    Some(pool) => {
                        pool.disabled = *disabled;
                        Ok(pool.clone())
                    }
                    None => Err(IpamError::PoolNotFound(name.clone())),
                };
                let actual = ipam.set_pool_disabled(name, *disabled).await;
                self.expect(&op, &expected, &actual)?;
            }
            Op::DeletePool { name, force } => {
                let expected = self.apply_delete_pool(name, *force);
                // Deleted-block counts depend on which blocks a forced release deleted on the
                // way; the model checks the blocks themselves after the step instead.
                let actual = ipam
                    .delete_pool(name, *force)
                    .await
                    .map(|d| (d.pool.name, d.pool.cidr, d.released_addresses));
                self.expect(&op, &expected, &actual)?;
            }
            Op::ReleaseAffinity { host, block } => {
                let expected = match self.blocks.get(block).cloned() {
                    Some(Some(owner)) if owner == *host => {
                        self.blocks.insert(*block, None);
                        self.settle(*block);
                        Ok(())
                    }
                    Some(Some(owner)) => Err(IpamError::BlockOwnedByOtherHost {
                        block: *block,
                        owner,
                    }),
                    _ => Ok(()),
                };
                let actual = ipam.release_affinity(host, *block).await;
                self.expect(&op, &expected, &actual)?;
            }
        }
        self.compare_with_store(ipam)
            .await
            .map_err(|e| fail(format!("after {op:?}: {e}")))
    }

    fn apply_delete_pool(
        &mut self,
        name: &str,
        force: bool,
    ) -> Result<(String, IpNet, u64), IpamError> {
        let Some(pool) = self.pools.get(name).cloned() else {
            return Err(IpamError::PoolNotFound(name.to_owned()));
        };
        let in_pool: Vec<IpAddr> = self
            .holdings
            .iter()
            .filter(|(_, h)| pool.cidr.contains(&h.block.network()))
            .map(|(ip, _)| *ip)
            .collect();
        if !in_pool.is_empty() && !force {
            return Err(IpamError::PoolInUse {
                pool: pool.name.clone(),
                in_use: in_pool.len() as u64,
            });
        }
        for ip in &in_pool {
            self.release_address(*ip);
        }
        let before = self.blocks.len();
        self.blocks.retain(|c, _| !pool.cidr.contains(&c.network()));
        self.tally.add(
            "blocks deleted with their pool",
            (before - self.blocks.len()) as u64,
        );
        self.pools.remove(name);
        Ok((pool.name, pool.cidr, in_pool.len() as u64))
    }

    async fn run_auto_assign(
        &mut self,
        ipam: &Ipam,
        op: &Op,
        handle: &str,
        host: &str,
        v4: u32,
        v6: u32,
    ) -> Result<(), TestCaseError> {
        let mut plans = Vec::new();
        let mut expected_error = None;
        for (family, wanted) in [(Family::V4, v4), (Family::V6, v6)] {
            if wanted == 0 {
                continue;
            }
            match self.plan_family(host, family, wanted) {
                Ok(plan) => plans.push((family, wanted, plan)),
                Err(e) => {
                    expected_error = Some(e);
                    break;
                }
            }
        }
        let actual = ipam
            .auto_assign(&AutoAssignRequest {
                handle: handle.to_owned(),
                host: host.to_owned(),
                num_v4: v4,
                num_v6: v6,
                ..Default::default()
            })
            .await;
        let result = match (expected_error, actual) {
            (Some(expected), actual) => {
                let actual = actual.map(|_| ());
                return self.expect(op, &Err(expected), &actual);
            }
            (None, Err(e)) => {
                return Err(fail(format!(
                    "{op:?}: the model expected success ({plans:?}), the allocator answered {e:?}"
                )))
            }
            (None, Ok(result)) => result,
        };
        if result.reused {
            return Err(fail(format!("{op:?}: a plain assign reported reuse")));
        }
        let mut granted: Vec<AssignedAddress> = Vec::new();
        for (family, wanted, plan) in plans {
            let got = match family {
                Family::V4 => &result.v4,
                Family::V6 => &result.v6,
            };
            if got.len() as u32 != wanted {
                return Err(fail(format!(
                    "{op:?}: asked for {wanted} {family} addresses, got {got:?}"
                )));
            }
            let mut seen = FamilyPlan::default();
            let mut new_blocks = BTreeSet::new();
            let mut distinct = BTreeSet::new();
            for address in got {
                if !distinct.insert(address.ip) {
                    return Err(fail(format!(
                        "{op:?}: {} handed out twice in one answer",
                        address.ip
                    )));
                }
                if let Some(holder) = self.holdings.get(&address.ip) {
                    return Err(fail(format!(
                        "{op:?}: handed out {}, which {} holds",
                        address.ip, holder.handle
                    )));
                }
                let pool = self
                    .sorted_pools()
                    .into_iter()
                    .find(|p| p.family() == family && !p.disabled && p.cidr.contains(&address.ip))
                    .cloned();
                let Some(pool) = pool else {
                    return Err(fail(format!(
                        "{op:?}: handed out {}, which is in no enabled {family} pool",
                        address.ip
                    )));
                };
                if pool.block_containing(address.ip) != Some(address.block) {
                    return Err(fail(format!(
                        "{op:?}: {} reported in block {}, pool {} says {:?}",
                        address.ip,
                        address.block,
                        pool.name,
                        pool.block_containing(address.ip)
                    )));
                }
                match self.blocks.get(&address.block) {
                    None => {
                        new_blocks.insert(address.block);
                        seen.from_new += 1;
                    }
                    Some(Some(owner)) if owner == host => seen.from_affine += 1,
                    Some(_) => seen.borrowed += 1,
                }
            }
            seen.new_blocks = new_blocks.len() as u32;
            if seen != plan {
                return Err(fail(format!(
                    "{op:?}: {family} addresses {got:?} were served as {seen:?}; Calico's order \
                     (affine blocks, then new blocks, then borrowing) gives {plan:?}"
                )));
            }
            self.tally
                .add("addresses from affine blocks", u64::from(plan.from_affine));
            self.tally.add(
                "addresses from newly claimed blocks",
                u64::from(plan.from_new),
            );
            self.tally
                .add("addresses borrowed", u64::from(plan.borrowed));
            granted.extend(got.iter().cloned());
        }
        self.tally.add(format!("{}: ok", op.kind()), 1);
        for address in granted {
            self.hold(address.ip, address.block, handle, host);
        }
        Ok(())
    }

    /// Compares the store with the model: allocations (no address twice, each with the model's
    /// handle, block, node and sequence number), blocks and their affinity, pools, every handle's
    /// addresses, and the consistency check. Learns the sequence numbers of new allocations and
    /// refuses an (address, sequence) pair handed out twice.
    async fn compare_with_store(&mut self, ipam: &Ipam) -> Result<(), String> {
        let allocations = ipam
            .list_allocations()
            .await
            .map_err(|e| format!("list_allocations: {e}"))?;
        let mut store: BTreeMap<IpAddr, String> = BTreeMap::new();
        for a in &allocations {
            if store.insert(a.ip, a.handle.clone()).is_some() {
                return Err(format!("{} is allocated twice in the store", a.ip));
            }
        }
        let model: BTreeMap<IpAddr, String> = self
            .holdings
            .iter()
            .map(|(ip, h)| (*ip, h.handle.clone()))
            .collect();
        if store != model {
            let missing: Vec<_> = model
                .iter()
                .filter(|(ip, h)| store.get(ip) != Some(h))
                .collect();
            let extra: Vec<_> = store
                .iter()
                .filter(|(ip, h)| model.get(ip) != Some(h))
                .collect();
            return Err(format!(
                "allocations differ: the model holds but the store does not {missing:?}; the \
                 store holds but the model does not {extra:?}"
            ));
        }
        for a in &allocations {
            let Some(holding) = self.holdings.get_mut(&a.ip) else {
                return Err(format!("{} vanished from the model", a.ip));
            };
            if a.block != holding.block
                || a.attributes.get(ipam_core::allocator::ATTR_NODE) != Some(&holding.node)
            {
                return Err(format!(
                    "{}: store says block {} node {:?}, the model block {} node {}",
                    a.ip,
                    a.block,
                    a.attributes.get(ipam_core::allocator::ATTR_NODE),
                    holding.block,
                    holding.node
                ));
            }
            match holding.sequence {
                Some(sequence) if sequence != a.sequence => {
                    return Err(format!(
                        "the sequence number of held {} changed from {sequence} to {}",
                        a.ip, a.sequence
                    ));
                }
                Some(_) => {}
                None => {
                    if !self.issued.insert((a.ip, a.sequence)) {
                        return Err(format!(
                            "({}, sequence {}) was handed out before: a stale guarded release of \
                             the earlier owner would free this one",
                            a.ip, a.sequence
                        ));
                    }
                    holding.sequence = Some(a.sequence);
                }
            }
        }
        let usage = ipam
            .utilization()
            .await
            .map_err(|e| format!("utilization: {e}"))?;
        if !usage.orphan_blocks.is_empty() {
            return Err(format!(
                "blocks outside every pool: {:?}",
                usage.orphan_blocks
            ));
        }
        let blocks: BTreeMap<IpNet, Option<String>> = usage
            .pools
            .iter()
            .flat_map(|p| p.blocks.iter())
            .map(|b| (b.cidr, b.host.clone()))
            .collect();
        if blocks != self.blocks {
            return Err(format!(
                "blocks (CIDR -> affinity) differ: store {blocks:?}, model {:?}",
                self.blocks
            ));
        }
        let pools = ipam
            .list_pools()
            .await
            .map_err(|e| format!("list_pools: {e}"))?;
        let expected_pools: Vec<Pool> = self.sorted_pools().into_iter().cloned().collect();
        if pools != expected_pools {
            return Err(format!(
                "pools differ: store {pools:?}, model {expected_pools:?}"
            ));
        }
        for handle in (0..HANDLES).map(handle_name) {
            let held = ipam
                .ips_by_handle(&handle)
                .await
                .map_err(|e| format!("ips_by_handle({handle}): {e}"))?;
            let expected = self.holdings_of(&handle);
            if held != expected {
                return Err(format!(
                    "handle {handle}: ips_by_handle says {held:?}, the model {expected:?}"
                ));
            }
        }
        let report = ipam.check(false).await.map_err(|e| format!("check: {e}"))?;
        if !report.problems.is_empty() {
            return Err(format!("check found problems: {:#?}", report.problems));
        }
        Ok(())
    }

    /// Runs one generated step (one or several operations).
    async fn run_step(&mut self, ipam: &Ipam, step: &Step) -> Result<(), TestCaseError> {
        match step {
            Step::AutoAssign {
                handle,
                host,
                v4,
                v6,
            } => {
                self.run(
                    ipam,
                    Op::AutoAssign {
                        handle: handle_name(*handle),
                        host: host_name(*host),
                        v4: u32::from(*v4),
                        v6: u32::from(*v6),
                    },
                )
                .await
            }
            Step::AssignAddresses {
                handle,
                host,
                addresses,
            } => {
                let mut ips: Vec<IpAddr> = Vec::new();
                for pick in addresses {
                    let ip = match pick {
                        AddressPick::Held(n) => {
                            self.pick_held(*n).unwrap_or_else(|| address_at(*n))
                        }
                        AddressPick::Anywhere(n) => address_at(*n),
                    };
                    if !ips.contains(&ip) {
                        ips.push(ip);
                    }
                }
                self.run(
                    ipam,
                    Op::AssignAddresses {
                        handle: handle_name(*handle),
                        host: host_name(*host),
                        ips,
                    },
                )
                .await
            }
            Step::Release(picks) => {
                let requests = self.resolve_release(picks);
                self.run(ipam, Op::Release(requests)).await
            }
            Step::ReleaseHandle(handle) => {
                self.run(ipam, Op::ReleaseHandle(handle_name(*handle)))
                    .await
            }
            Step::ReleaseHost { host, addresses } => {
                self.run(
                    ipam,
                    Op::ReleaseHost {
                        host: host_name(*host),
                        addresses: *addresses,
                    },
                )
                .await
            }
            Step::AddPool(menu) => {
                self.run(ipam, Op::AddPool(usize::from(*menu) % POOL_MENU.len()))
                    .await
            }
            Step::SetPoolDisabled { pool, disabled } => {
                self.run(
                    ipam,
                    Op::SetPoolDisabled {
                        name: POOL_NAMES[usize::from(*pool) % POOL_NAMES.len()].to_owned(),
                        disabled: *disabled,
                    },
                )
                .await
            }
            Step::DeletePool { pool, force } => {
                self.run(
                    ipam,
                    Op::DeletePool {
                        name: POOL_NAMES[usize::from(*pool) % POOL_NAMES.len()].to_owned(),
                        force: *force,
                    },
                )
                .await
            }
            Step::ReleaseAffinity {
                block,
                by_owner,
                host,
            } => {
                let Some(cidr) = self.pick_block(*block) else {
                    return Ok(());
                };
                let owner = self.blocks.get(&cidr).cloned().flatten();
                let host = match owner {
                    Some(owner) if *by_owner => owner,
                    _ => host_name(*host),
                };
                self.run(ipam, Op::ReleaseAffinity { host, block: cidr })
                    .await
            }
            Step::RecreateBlock {
                block,
                handle,
                host,
            } => self.recreate_block(ipam, *block, *handle, *host).await,
        }
    }

    async fn recreate_block(
        &mut self,
        ipam: &Ipam,
        pick: u16,
        handle: u8,
        host: u8,
    ) -> Result<(), TestCaseError> {
        let Some(cidr) = self.pick_block(pick) else {
            return Ok(());
        };
        if let Some(Some(owner)) = self.blocks.get(&cidr).cloned() {
            self.run(
                ipam,
                Op::ReleaseAffinity {
                    host: owner,
                    block: cidr,
                },
            )
            .await?;
        }
        let held: Vec<ReleaseRequest> = self
            .holdings
            .iter()
            .filter(|(_, h)| h.block == cidr)
            .map(|(ip, _)| ReleaseRequest {
                ip: *ip,
                sequence: None,
            })
            .collect();
        if !held.is_empty() {
            self.run(ipam, Op::Release(held)).await?;
        }
        let stale: Vec<ReleaseRequest> = self
            .retired
            .iter()
            .filter(|(ip, _)| cidr.contains(ip))
            .map(|(ip, sequence)| ReleaseRequest {
                ip: *ip,
                sequence: Some(*sequence),
            })
            .collect();
        // Claim the same CIDR again through an address of its earlier life.
        let target = stale.first().map_or(cidr.network(), |r| r.ip);
        self.run(
            ipam,
            Op::AssignAddresses {
                handle: handle_name(handle),
                host: host_name(host),
                ips: vec![target],
            },
        )
        .await?;
        if !stale.is_empty() {
            let stale: Vec<ReleaseRequest> = stale.into_iter().rev().take(8).collect();
            self.run(ipam, Op::Release(stale)).await?;
        }
        Ok(())
    }
}

/// Runs one sequence on a fresh store: the configuration, the initial pools, then every step,
/// comparing store and model after each operation.
async fn run_sequence<F: StoreFactory>(
    factory: &F,
    initial: &GenerationState,
    steps: &[Step],
    seen: Option<&AtomicUsize>,
    tally: &Mutex<Tally>,
) -> Result<(), TestCaseError> {
    let test_store = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&test_store.store));
    ipam.set_config(&initial.config.to_ipam())
        .await
        .map_err(store_error("set_config"))?;
    let mut model = Model::new(initial.config);
    let result = async {
        for menu in INITIAL_POOLS {
            model.run(&ipam, Op::AddPool(menu)).await?;
        }
        for (index, step) in steps.iter().enumerate() {
            // Tells the state-machine strategy how far the case got (its first shrinking move).
            if let Some(seen) = seen {
                seen.fetch_add(1, Ordering::SeqCst);
            }
            model
                .run_step(&ipam, step)
                .await
                .map_err(|e| fail(format!("step {index} {step:?}: {e}")))?;
            model.tally.add("steps", 1);
        }
        Ok(())
    }
    .await;
    model.tally.add("cases", 1);
    lock(tally).merge(&model.tally);
    result
}

pub(super) fn lock(tally: &Mutex<Tally>) -> std::sync::MutexGuard<'_, Tally> {
    tally
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(super) fn env_size(name: &str, default: u32) -> u32 {
    match std::env::var(name) {
        Ok(text) => text
            .parse()
            .unwrap_or_else(|_| panic!("{name}={text:?} is not a whole number")),
        Err(_) => default,
    }
}

/// Random operation sequences (auto-assign v4/v6/dual, specific addresses, release by address
/// guarded, unguarded and with stale guards, release by handle, host release with and without
/// addresses, pool add/disable/enable/delete with and without force, affinity release, block
/// re-creation) on small pools under a random configuration: after every operation the store
/// holds exactly what the model says, every answer and error is the one the model predicts, and
/// the consistency check is clean. Failures shrink to a minimal sequence.
pub async fn operation_sequences_match_the_model<F: StoreFactory>(factory: &F) {
    let cases = env_size(CASES_ENV, DEFAULT_CASES);
    let steps = env_size(STEPS_ENV, DEFAULT_STEPS).max(1) as usize;
    let defaults = Config::default();
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        // Each shrinking attempt runs a whole case on the store (a fraction of a second on
        // etcd): bounded unless PROPTEST_MAX_SHRINK_TIME says otherwise.
        max_shrink_time: if defaults.max_shrink_time == 0 {
            SHRINK_TIME_MS
        } else {
            defaults.max_shrink_time
        },
        ..defaults
    });
    let runtime = tokio::runtime::Handle::current();
    let tally = Mutex::new(Tally::default());
    let result = runner.run(
        &AllocatorMachine::sequential_strategy(1..=steps),
        |(initial, steps, seen)| {
            tokio::task::block_in_place(|| {
                runtime.block_on(run_sequence(
                    factory,
                    &initial,
                    &steps,
                    seen.as_deref(),
                    &tally,
                ))
            })
        },
    );
    if let Err(failure) = result {
        panic!(
            "{} store: the allocator disagrees with the model: {failure}",
            factory.backend_name()
        );
    }
    eprintln!(
        "{} store, model-based sequences ({CASES_ENV}={cases}, {STEPS_ENV}={steps}):\n{}",
        factory.backend_name(),
        lock(&tally)
    );
}
