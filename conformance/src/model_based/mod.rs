//! Model-based tests of the allocator: random operation sequences (proptest state-machine
//! generation and shrinking) checked after every step against an in-memory model of who holds
//! what, and concurrent tasks whose beliefs must add up to exactly what the store holds.
//!
//! Sizes: `BLOCKIPAM_MODEL_CASES` cases per test (default [`DEFAULT_CASES`]) of at most
//! `BLOCKIPAM_MODEL_STEPS` steps each (default [`DEFAULT_STEPS`]; per task in the concurrent test).
//!
//! The generation-time reference state ([`GenerationState`]) knows only what is decided before a
//! step runs (the configuration and, roughly, which pools exist); which addresses and sequence
//! numbers the allocator hands out are its own choice, so the runtime `Model` learns them from
//! each answer, after checking that the answer was allowed, and predicts everything else exactly:
//! every error, every release outcome, every block's affinity and existence.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use ipam_core::{
    AssignIpsRequest, AssignedAddress, AutoAssignRequest, Family, HostRelease, Ipam, IpamConfig,
    IpamError, KeyValue, KvError, KvStore, Pool, PoolSpec, Read, ReadResult, ReleaseOutcome,
    ReleaseRequest, Revision, Txn,
};
use ipnet::IpNet;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use proptest_state_machine::ReferenceStateMachine;

use crate::StoreFactory;

/// Environment variable: cases per model-based test.
pub const CASES_ENV: &str = "BLOCKIPAM_MODEL_CASES";
/// Environment variable: most steps per case (per task in the concurrent test).
pub const STEPS_ENV: &str = "BLOCKIPAM_MODEL_STEPS";
/// Cases per test when [`CASES_ENV`] is not set: sized for CI.
pub const DEFAULT_CASES: u32 = 32;
/// Most steps per case when [`STEPS_ENV`] is not set.
pub const DEFAULT_STEPS: u32 = 40;
/// Longest time spent shrinking a failing sequence, in milliseconds.
const SHRINK_TIME_MS: u32 = 120_000;
/// Tasks racing in the concurrent test.
const TASKS: usize = 4;
/// Hosts the sequential test spreads its requests over.
const HOSTS: u8 = 3;
/// Handles the sequential test spreads its requests over.
const HANDLES: u8 = 6;
/// Handles each concurrent task uses.
const TASK_HANDLES: u8 = 3;

/// Expands the model-based cases into one `#[tokio::test]` each inside a module `model_based`
/// (called from `ipam_conformance_tests!`, so every backend that runs the allocator cases runs
/// these too).
#[macro_export]
macro_rules! model_based_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(model_based, $crate::model_based, $factory;
            operation_sequences_match_the_model,
            concurrent_tasks_hold_exactly_what_they_believe,
            pool_recarved_with_another_block_size_refuses_a_stale_guarded_release,
            delete_pool_racing_an_enable_and_an_add_leaves_no_block_outside_pools,
            delete_pool_racing_a_recreation_under_the_same_name_leaves_no_block_outside_pools,
        );
    };
}

// ---------------------------------------------------------------------------------------------
// The pools, hosts, handles and addresses the operations draw from
// ---------------------------------------------------------------------------------------------

/// A pool the tests may create. Small on purpose: exhaustion, borrowing and block deletion
/// happen within a few steps.
#[derive(Debug, Clone, Copy)]
struct MenuPool {
    /// Index into [`POOL_NAMES`].
    name: usize,
    cidr: &'static str,
    block_size: u8,
}

/// Pool names; a name may stand for different CIDRs over a case's life.
const POOL_NAMES: [&str; 4] = ["a", "b", "c", "wide"];

/// Every pool a case may create. `wide` overlaps `a` with another block size, and the second `a`
/// reuses a name for another CIDR: overlap and name errors, and blocks of one address range
/// carved two ways over a store's life.
const POOL_MENU: [MenuPool; 5] = [
    MenuPool {
        name: 0,
        cidr: "10.0.0.0/26",
        block_size: 29,
    },
    MenuPool {
        name: 1,
        cidr: "10.0.1.0/26",
        block_size: 30,
    },
    MenuPool {
        name: 2,
        cidr: "fd00::/124",
        block_size: 126,
    },
    MenuPool {
        name: 3,
        cidr: "10.0.0.0/25",
        block_size: 28,
    },
    MenuPool {
        name: 0,
        cidr: "10.0.2.0/26",
        block_size: 30,
    },
];

/// The pools every case starts with (indices into [`POOL_MENU`]): one small IPv4 pool, so that
/// exhaustion and borrowing come soon, and the tiny IPv6 pool.
const INITIAL_POOLS: [usize; 2] = [0, 2];

/// Address ranges specific-address picks land in: every menu pool, and addresses outside all.
const ADDRESS_RANGES: [(&str, u32); 5] = [
    ("10.0.0.0", 128),
    ("10.0.1.0", 64),
    ("10.0.2.0", 64),
    ("fd00::", 16),
    ("10.0.3.0", 4),
];

fn net(text: &str) -> IpNet {
    text.parse()
        .unwrap_or_else(|e| panic!("bad test CIDR {text}: {e}"))
}

fn menu_spec(menu: usize) -> PoolSpec {
    let entry = POOL_MENU[menu % POOL_MENU.len()];
    PoolSpec {
        cidr: net(entry.cidr),
        name: Some(POOL_NAMES[entry.name].to_owned()),
        block_size: Some(entry.block_size),
        disabled: false,
    }
}

fn menu_pool(menu: usize) -> Pool {
    Ipam::pool_from_spec(&menu_spec(menu)).expect("every menu pool is valid")
}

/// The `pick`th address of [`ADDRESS_RANGES`] (wrapping).
fn address_at(pick: u16) -> IpAddr {
    let total: u32 = ADDRESS_RANGES.iter().map(|r| r.1).sum();
    let mut index = u32::from(pick) % total;
    for (base, len) in ADDRESS_RANGES {
        if index < len {
            let base: IpAddr = base.parse().expect("valid base address");
            return match base {
                IpAddr::V4(a) => IpAddr::V4(Ipv4Addr::from(u32::from(a) + index)),
                IpAddr::V6(a) => IpAddr::V6(Ipv6Addr::from(u128::from(a) + u128::from(index))),
            };
        }
        index -= len;
    }
    unreachable!("index is below the total")
}

fn host_name(host: u8) -> String {
    format!("n{}", host % HOSTS)
}

fn handle_name(handle: u8) -> String {
    format!("h{}", handle % HANDLES)
}

fn capacity(cidr: &IpNet) -> u32 {
    1u32 << (cidr.max_prefix_len() - cidr.prefix_len())
}

fn family_of(cidr: &IpNet) -> Family {
    Family::of_net(cidr)
}

// ---------------------------------------------------------------------------------------------
// Generation: the reference state machine
// ---------------------------------------------------------------------------------------------

/// The allocator configuration a case runs under (chosen by the initial state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelConfig {
    /// [`IpamConfig::strict_affinity`].
    pub strict_affinity: bool,
    /// [`IpamConfig::auto_allocate_blocks`].
    pub auto_allocate_blocks: bool,
    /// [`IpamConfig::max_blocks_per_host`].
    pub max_blocks_per_host: u32,
}

impl ModelConfig {
    fn to_ipam(self) -> IpamConfig {
        IpamConfig {
            strict_affinity: self.strict_affinity,
            auto_allocate_blocks: self.auto_allocate_blocks,
            max_blocks_per_host: self.max_blocks_per_host,
            ..IpamConfig::default()
        }
    }
}

/// What generation knows before a step runs: the configuration, and which pools exist as far
/// as it can tell (a delete without force may or may not be refused; it is assumed refused).
/// It only steers generation toward pool operations that change something.
#[derive(Debug, Clone)]
pub struct GenerationState {
    /// The configuration of the case.
    pub config: ModelConfig,
    /// Pools believed to exist: name index -> (menu index, disabled).
    pools: BTreeMap<usize, (usize, bool)>,
}

impl GenerationState {
    fn new(config: ModelConfig) -> Self {
        let mut pools = BTreeMap::new();
        for menu in INITIAL_POOLS {
            pools.insert(POOL_MENU[menu].name, (menu, false));
        }
        GenerationState { config, pools }
    }
}

/// Picks an address for a specific assign.
#[derive(Debug, Clone)]
pub enum AddressPick {
    /// The `n`th address the model says is held (any address when none is).
    Held(u16),
    /// The `n`th address of the pools' ranges (or outside them).
    Anywhere(u16),
}

/// Picks one release request.
#[derive(Debug, Clone)]
pub enum ReleasePick {
    /// The `index`th held address; guarded with the sequence number the model recorded for it.
    Held {
        /// Which held address.
        index: u16,
        /// Whether to pass the recorded sequence number.
        guarded: bool,
    },
    /// Any address, unguarded (often free or outside every pool).
    Anywhere(u16),
    /// An (address, sequence) pair the model saw released earlier: a stale guard, to be refused.
    Stale(u16),
}

/// One generated step. Indices are resolved against the model when the step runs, so a step
/// stays meaningful when shrinking removes the steps before it.
#[derive(Debug, Clone)]
pub enum Step {
    /// Auto-assign `v4` IPv4 and `v6` IPv6 addresses.
    AutoAssign {
        /// Handle index.
        handle: u8,
        /// Host index.
        host: u8,
        /// IPv4 addresses wanted.
        v4: u8,
        /// IPv6 addresses wanted.
        v6: u8,
    },
    /// Assign specific addresses.
    AssignAddresses {
        /// Handle index.
        handle: u8,
        /// Host index.
        host: u8,
        /// The addresses (duplicates dropped).
        addresses: Vec<AddressPick>,
    },
    /// Release by address, in one request.
    Release(Vec<ReleasePick>),
    /// Release everything a handle holds.
    ReleaseHandle(u8),
    /// Retire a host, with or without its addresses.
    ReleaseHost {
        /// Host index.
        host: u8,
        /// Release the host's addresses too.
        addresses: bool,
    },
    /// Create a pool of the menu.
    AddPool(u8),
    /// Disable or enable a pool by name.
    SetPoolDisabled {
        /// Name index.
        pool: u8,
        /// The new state.
        disabled: bool,
    },
    /// Delete a pool by name.
    DeletePool {
        /// Name index.
        pool: u8,
        /// Release its addresses first.
        force: bool,
    },
    /// Release a host's affinity to a block.
    ReleaseAffinity {
        /// Which existing block.
        block: u16,
        /// Ask as the block's own host (else as `host`).
        by_owner: bool,
        /// Host index used when not asking as the owner.
        host: u8,
    },
    /// Block re-creation: take the block's affinity away, release its addresses (so it is
    /// deleted), assign one of its old addresses again (so the same CIDR is claimed again), then
    /// release every (address, sequence) pair of its earlier life, guarded: all must be refused.
    RecreateBlock {
        /// Which existing block.
        block: u16,
        /// Handle index of the new owner.
        handle: u8,
        /// Host index of the new owner.
        host: u8,
    },
}

/// The reference state machine: generation (and shrinking) of [`Step`] sequences.
#[derive(Debug)]
pub struct AllocatorMachine;

fn config_strategy() -> impl Strategy<Value = ModelConfig> {
    (
        prop_oneof![3 => Just(false), 1 => Just(true)],
        prop_oneof![6 => Just(true), 1 => Just(false)],
        prop_oneof![Just(0u32), Just(20), Just(1)],
    )
        .prop_map(
            |(strict_affinity, auto_allocate_blocks, max_blocks_per_host)| ModelConfig {
                strict_affinity,
                auto_allocate_blocks,
                max_blocks_per_host,
            },
        )
}

fn auto_assign_strategy() -> impl Strategy<Value = Step> {
    let counts = prop_oneof![
        5 => (1u8..=4).prop_map(|n| (n, 0u8)),
        2 => (1u8..=2).prop_map(|n| (0u8, n)),
        2 => (1u8..=2).prop_map(|n| (n, 1u8)),
    ];
    (0..HANDLES, 0..HOSTS, counts).prop_map(|(handle, host, (v4, v6))| Step::AutoAssign {
        handle,
        host,
        v4,
        v6,
    })
}

fn address_pick_strategy() -> impl Strategy<Value = AddressPick> {
    prop_oneof![
        1 => any::<u16>().prop_map(AddressPick::Held),
        2 => any::<u16>().prop_map(AddressPick::Anywhere),
    ]
}

fn release_pick_strategy() -> impl Strategy<Value = ReleasePick> {
    prop_oneof![
        4 => (any::<u16>(), any::<bool>())
            .prop_map(|(index, guarded)| ReleasePick::Held { index, guarded }),
        1 => any::<u16>().prop_map(ReleasePick::Anywhere),
        2 => any::<u16>().prop_map(ReleasePick::Stale),
    ]
}

impl ReferenceStateMachine for AllocatorMachine {
    type State = GenerationState;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<GenerationState> {
        config_strategy().prop_map(GenerationState::new).boxed()
    }

    fn transitions(state: &GenerationState) -> BoxedStrategy<Step> {
        let names = POOL_NAMES.len() as u8;
        // Pool operations lean toward ones that change something: toggling a pool that exists,
        // adding a name that does not.
        let toggles: Vec<(u8, bool)> = state
            .pools
            .iter()
            .map(|(name, (_, disabled))| (*name as u8, !*disabled))
            .collect();
        let set_disabled = if toggles.is_empty() {
            (0..names, any::<bool>()).boxed()
        } else {
            prop_oneof![3 => proptest::sample::select(toggles), 1 => (0..names, any::<bool>())]
                .boxed()
        }
        .prop_map(|(pool, disabled)| Step::SetPoolDisabled { pool, disabled });
        let absent: Vec<u8> = (0..POOL_MENU.len())
            .filter(|m| !state.pools.contains_key(&POOL_MENU[*m].name))
            .map(|m| m as u8)
            .collect();
        let add = if absent.is_empty() {
            (0..POOL_MENU.len() as u8).boxed()
        } else {
            prop_oneof![3 => proptest::sample::select(absent), 1 => 0..POOL_MENU.len() as u8]
                .boxed()
        }
        .prop_map(Step::AddPool);
        prop_oneof![
            10 => auto_assign_strategy(),
            3 => (0..HANDLES, 0..HOSTS, proptest::collection::vec(address_pick_strategy(), 1..=2))
                .prop_map(|(handle, host, addresses)| Step::AssignAddresses { handle, host, addresses }),
            5 => proptest::collection::vec(release_pick_strategy(), 1..=3).prop_map(Step::Release),
            2 => (0..HANDLES).prop_map(Step::ReleaseHandle),
            2 => (0..HOSTS, any::<bool>())
                .prop_map(|(host, addresses)| Step::ReleaseHost { host, addresses }),
            1 => add,
            1 => set_disabled,
            1 => (0..names, any::<bool>()).prop_map(|(pool, force)| Step::DeletePool { pool, force }),
            2 => (any::<u16>(), prop_oneof![3 => Just(true), 1 => Just(false)], 0..HOSTS)
                .prop_map(|(block, by_owner, host)| Step::ReleaseAffinity { block, by_owner, host }),
            2 => (any::<u16>(), 0..HANDLES, 0..HOSTS)
                .prop_map(|(block, handle, host)| Step::RecreateBlock { block, handle, host }),
        ]
        .boxed()
    }

    fn apply(mut state: GenerationState, step: &Step) -> GenerationState {
        match step {
            Step::AddPool(menu) => {
                let menu = usize::from(*menu) % POOL_MENU.len();
                let entry = POOL_MENU[menu];
                let cidr = net(entry.cidr);
                let overlaps = state.pools.values().any(|(m, _)| {
                    let other = net(POOL_MENU[*m].cidr);
                    other.contains(&cidr.network()) || cidr.contains(&other.network())
                });
                if !state.pools.contains_key(&entry.name) && !overlaps {
                    state.pools.insert(entry.name, (menu, false));
                }
            }
            Step::SetPoolDisabled { pool, disabled } => {
                if let Some(entry) = state
                    .pools
                    .get_mut(&(usize::from(*pool) % POOL_NAMES.len()))
                {
                    entry.1 = *disabled;
                }
            }
            Step::DeletePool { pool, force: true } => {
                state.pools.remove(&(usize::from(*pool) % POOL_NAMES.len()));
            }
            _ => {}
        }
        state
    }
}

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
struct Tally(BTreeMap<String, u64>);

impl Tally {
    fn add(&mut self, label: impl Into<String>, n: u64) {
        if n > 0 {
            *self.0.entry(label.into()).or_insert(0) += n;
        }
    }

    fn merge(&mut self, other: &Tally) {
        for (label, n) in &other.0 {
            self.add(label.clone(), *n);
        }
    }

    fn outcome<T>(&mut self, operation: &str, outcome: &Result<T, IpamError>) {
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

fn fail(message: impl Into<String>) -> TestCaseError {
    TestCaseError::fail(message.into())
}

fn store_error(what: &str) -> impl FnOnce(IpamError) -> TestCaseError + '_ {
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

fn lock(tally: &Mutex<Tally>) -> std::sync::MutexGuard<'_, Tally> {
    tally
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn env_size(name: &str, default: u32) -> u32 {
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

// ---------------------------------------------------------------------------------------------
// Concurrent tasks
// ---------------------------------------------------------------------------------------------

/// One step of a concurrent task. Each task has its own host and handles; it only releases what
/// it holds, so what it holds at the end is exactly what it believes it holds.
#[derive(Debug, Clone)]
pub enum TaskStep {
    /// Auto-assign for one of the task's handles.
    AutoAssign {
        /// Handle index (within the task).
        handle: u8,
        /// IPv4 addresses wanted.
        v4: u8,
        /// IPv6 addresses wanted.
        v6: u8,
    },
    /// Assign one specific address (often held by another task: refused).
    AssignAddress {
        /// Handle index (within the task).
        handle: u8,
        /// Which address.
        address: u16,
    },
    /// Release one of the task's addresses, guarded with its sequence number or not.
    ReleaseHeld {
        /// Which held address.
        index: u16,
        /// Pass the recorded sequence number.
        guarded: bool,
    },
    /// Release an (address, sequence) pair the task released before: must be refused.
    ReleaseStale(u16),
    /// Release one of the task's handles.
    ReleaseHandle(u8),
    /// Retire the task's host, with or without its addresses.
    ReleaseHost(bool),
    /// Release the task's affinity to the block of one of its addresses.
    ReleaseAffinity(u16),
    /// Disable or enable a pool.
    SetPoolDisabled {
        /// Name index.
        pool: u8,
        /// The new state.
        disabled: bool,
    },
    /// Delete a pool without force (must be refused while anyone holds an address in it).
    DeletePool(u8),
    /// Create a pool of the menu.
    AddPool(u8),
}

fn task_step_strategy() -> impl Strategy<Value = TaskStep> {
    let names = POOL_NAMES.len() as u8;
    prop_oneof![
        8 => (0..TASK_HANDLES, prop_oneof![4 => Just((1u8, 0u8)), 2 => Just((2, 0)), 1 => Just((0, 1)), 2 => Just((1, 1))])
            .prop_map(|(handle, (v4, v6))| TaskStep::AutoAssign { handle, v4, v6 }),
        2 => (0..TASK_HANDLES, any::<u16>())
            .prop_map(|(handle, address)| TaskStep::AssignAddress { handle, address }),
        5 => (any::<u16>(), any::<bool>())
            .prop_map(|(index, guarded)| TaskStep::ReleaseHeld { index, guarded }),
        2 => any::<u16>().prop_map(TaskStep::ReleaseStale),
        1 => (0..TASK_HANDLES).prop_map(TaskStep::ReleaseHandle),
        1 => any::<bool>().prop_map(TaskStep::ReleaseHost),
        1 => any::<u16>().prop_map(TaskStep::ReleaseAffinity),
        1 => (0..names, any::<bool>())
            .prop_map(|(pool, disabled)| TaskStep::SetPoolDisabled { pool, disabled }),
        1 => (0..names).prop_map(TaskStep::DeletePool),
        1 => (0..POOL_MENU.len() as u8).prop_map(TaskStep::AddPool),
    ]
}

/// What one task believes it holds, and the pairs it released.
#[derive(Debug, Default)]
struct Belief {
    held: BTreeMap<IpAddr, (String, Option<u64>)>,
    retired: Vec<(IpAddr, u64)>,
    tally: Tally,
}

impl Belief {
    fn forget(&mut self, ip: IpAddr) {
        if let Some((_, Some(sequence))) = self.held.remove(&ip) {
            self.retired.push((ip, sequence));
        }
    }

    fn handle_addresses(&self, handle: &str) -> Vec<IpAddr> {
        self.held
            .iter()
            .filter(|(_, (h, _))| h == handle)
            .map(|(ip, _)| *ip)
            .collect()
    }
}

/// Records newly held addresses and learns their sequence numbers from the store.
async fn learn(
    ipam: &Ipam,
    belief: &mut Belief,
    handle: &str,
    ips: &[IpAddr],
) -> Result<(), String> {
    let allocations = ipam
        .allocations_by_handle(handle)
        .await
        .map_err(|e| format!("allocations_by_handle({handle}): {e}"))?;
    for ip in ips {
        let sequence = allocations.iter().find(|a| a.ip == *ip).map(|a| a.sequence);
        belief.held.insert(*ip, (handle.to_owned(), sequence));
    }
    Ok(())
}

/// One task's run. An error names the step and what went wrong.
async fn run_task(ipam: Ipam, task: usize, steps: Vec<TaskStep>) -> Result<Belief, String> {
    let host = format!("t{task}");
    let handle_of = |h: u8| format!("t{task}-h{}", h % TASK_HANDLES);
    let mut belief = Belief::default();
    for (index, step) in steps.iter().enumerate() {
        let context = |message: String| format!("task {task} step {index} {step:?}: {message}");
        match step {
            TaskStep::AutoAssign { handle, v4, v6 } => {
                let handle = handle_of(*handle);
                let result = ipam
                    .auto_assign(&AutoAssignRequest {
                        handle: handle.clone(),
                        host: host.clone(),
                        num_v4: u32::from(*v4),
                        num_v6: u32::from(*v6),
                        ..Default::default()
                    })
                    .await;
                belief.tally.outcome("auto_assign", &result);
                match result {
                    Ok(got) => {
                        let ips: Vec<IpAddr> = got.v4.iter().chain(&got.v6).map(|a| a.ip).collect();
                        if let Some(ip) = ips.iter().find(|ip| belief.held.contains_key(ip)) {
                            return Err(context(format!("handed out {ip}, which this task holds")));
                        }
                        learn(&ipam, &mut belief, &handle, &ips)
                            .await
                            .map_err(context)?;
                    }
                    Err(IpamError::Exhausted { .. }) | Err(IpamError::BlockLimit { .. }) => {}
                    Err(e) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
            TaskStep::AssignAddress { handle, address } => {
                let handle = handle_of(*handle);
                let ip = address_at(*address);
                let result = ipam
                    .assign_ips(&AssignIpsRequest {
                        ips: vec![ip],
                        handle: handle.clone(),
                        host: host.clone(),
                        ..Default::default()
                    })
                    .await;
                belief.tally.outcome("assign_ips", &result);
                match (result, belief.held.get(&ip).cloned()) {
                    (Ok(_), Some((holder, _))) if holder == handle => {}
                    (Ok(_), Some((holder, _))) => {
                        return Err(context(format!("assigned {ip}, which {holder} holds")))
                    }
                    (Ok(_), None) => learn(&ipam, &mut belief, &handle, &[ip])
                        .await
                        .map_err(context)?,
                    (Err(IpamError::AlreadyAssigned { handle: holder, .. }), mine) => {
                        let believed = mine.map(|(h, _)| h);
                        let is_mine = holder.starts_with(&format!("t{task}-"));
                        if is_mine != believed.is_some()
                            || (is_mine && believed != Some(holder.clone()))
                        {
                            return Err(context(format!(
                                "refused as held by {holder}; this task believes {believed:?}"
                            )));
                        }
                    }
                    (Err(IpamError::NotInPool(_)), _) => {}
                    (Err(e), _) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
            TaskStep::ReleaseHeld { index, guarded } => {
                let held: Vec<(IpAddr, Option<u64>)> =
                    belief.held.iter().map(|(ip, (_, s))| (*ip, *s)).collect();
                if held.is_empty() {
                    continue;
                }
                let (ip, sequence) = held[usize::from(*index) % held.len()];
                let sequence = if *guarded { sequence } else { None };
                let outcome = ipam
                    .release_ips(&[ReleaseRequest { ip, sequence }])
                    .await
                    .map_err(|e| context(format!("release failed: {e:?}")))?;
                if outcome.released != vec![ip] {
                    return Err(context(format!(
                        "releasing held {ip} (sequence {sequence:?}) gave {outcome:?}"
                    )));
                }
                belief.forget(ip);
                belief.tally.add(
                    if sequence.is_some() {
                        "release of a held address, guarded: released"
                    } else {
                        "release of a held address, unguarded: released"
                    },
                    1,
                );
            }
            TaskStep::ReleaseStale(index) => {
                if belief.retired.is_empty() {
                    continue;
                }
                let (ip, sequence) = belief.retired[usize::from(*index) % belief.retired.len()];
                let outcome = ipam
                    .release_ips(&[ReleaseRequest {
                        ip,
                        sequence: Some(sequence),
                    }])
                    .await
                    .map_err(|e| context(format!("release failed: {e:?}")))?;
                belief.tally.add(
                    if outcome.sequence_mismatch.is_empty() {
                        "stale guarded release: not allocated"
                    } else {
                        "stale guarded release: refused (sequence mismatch)"
                    },
                    1,
                );
                if !outcome.released.is_empty() {
                    return Err(context(format!(
                        "a stale guarded release of ({ip}, sequence {sequence}) freed a live \
                         address: {outcome:?}"
                    )));
                }
            }
            TaskStep::ReleaseHandle(handle) => {
                let handle = handle_of(*handle);
                let mut released = ipam
                    .release_handle(&handle)
                    .await
                    .map_err(|e| context(format!("release_handle failed: {e:?}")))?;
                belief.tally.add("release_handle: ok", 1);
                released.sort();
                let expected = belief.handle_addresses(&handle);
                if released != expected {
                    return Err(context(format!(
                        "released {released:?}, the handle was believed to hold {expected:?}"
                    )));
                }
                for ip in expected {
                    belief.forget(ip);
                }
            }
            TaskStep::ReleaseHost(addresses) => {
                let report = ipam
                    .release_host(&host, *addresses)
                    .await
                    .map_err(|e| context(format!("release_host failed: {e:?}")))?;
                belief.tally.add(
                    if *addresses {
                        "release_host with addresses: ok"
                    } else {
                        "release_host: ok"
                    },
                    1,
                );
                if *addresses {
                    let expected: Vec<IpAddr> = belief.held.keys().copied().collect();
                    if report.released_addresses != expected {
                        return Err(context(format!(
                            "released {:?}, the host was believed to hold {expected:?}",
                            report.released_addresses
                        )));
                    }
                    for ip in expected {
                        belief.forget(ip);
                    }
                }
            }
            TaskStep::ReleaseAffinity(index) => {
                // The block of an address depends on its pool; ask the store.
                let Some(ip) = belief
                    .held
                    .keys()
                    .nth(usize::from(*index) % belief.held.len().max(1))
                else {
                    continue;
                };
                let Some(info) = ipam
                    .get_assignment(*ip)
                    .await
                    .map_err(|e| context(format!("get_assignment failed: {e:?}")))?
                else {
                    let pools = ipam.list_pools().await;
                    return Err(context(format!(
                        "held {ip} is not allocated in the store (pools now: {pools:?})"
                    )));
                };
                let result = ipam.release_affinity(&host, info.block).await;
                belief.tally.outcome("release_affinity", &result);
                match result {
                    Ok(()) | Err(IpamError::BlockOwnedByOtherHost { .. }) => {}
                    Err(e) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
            TaskStep::SetPoolDisabled { pool, disabled } => {
                let name = POOL_NAMES[usize::from(*pool) % POOL_NAMES.len()];
                let result = ipam.set_pool_disabled(name, *disabled).await;
                belief.tally.outcome("set_pool_disabled", &result);
                match result {
                    Ok(_) | Err(IpamError::PoolNotFound(_)) => {}
                    Err(e) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
            TaskStep::DeletePool(pool) => {
                let name = POOL_NAMES[usize::from(*pool) % POOL_NAMES.len()];
                let result = ipam.delete_pool(name, false).await;
                belief.tally.outcome("delete_pool", &result);
                match result {
                    Ok(deletion) => {
                        let mine: Vec<IpAddr> = belief
                            .held
                            .keys()
                            .filter(|ip| deletion.pool.cidr.contains(*ip))
                            .copied()
                            .collect();
                        if !mine.is_empty() {
                            return Err(context(format!(
                                "deleted pool {} without force while this task held {mine:?}",
                                deletion.pool.cidr
                            )));
                        }
                    }
                    Err(IpamError::PoolInUse { .. }) | Err(IpamError::PoolNotFound(_)) => {}
                    Err(e) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
            TaskStep::AddPool(menu) => {
                let result = ipam.create_pool(&menu_spec(usize::from(*menu))).await;
                belief.tally.outcome("create_pool", &result);
                match result {
                    Ok(_) | Err(IpamError::PoolExists(_)) | Err(IpamError::PoolOverlap { .. }) => {}
                    Err(e) => return Err(context(format!("unexpected error {e:?}"))),
                }
            }
        }
    }
    Ok(belief)
}

/// Runs the tasks at once on one store, then compares what they believe with what it holds.
async fn run_concurrently<F: StoreFactory>(
    factory: &F,
    plans: Vec<Vec<TaskStep>>,
    tally: &Mutex<Tally>,
) -> Result<(), TestCaseError> {
    let test_store = factory.fresh().await;
    let racing = Arc::new(RacingStore::new(Arc::clone(&test_store.store)));
    let ipam = Ipam::new(Arc::clone(&racing) as Arc<dyn KvStore>);
    let result = check_concurrently(&ipam, plans, tally).await;
    let mut counts = lock(tally);
    counts.add("cases", 1);
    counts.add("commits", racing.commits.load(Ordering::SeqCst));
    counts.add(
        "commits refused by a concurrent change (conflicts: the tasks really raced)",
        racing.conflicts.load(Ordering::SeqCst),
    );
    result
}

/// Creates the pools, runs the tasks, compares beliefs with the store.
async fn check_concurrently(
    ipam: &Ipam,
    plans: Vec<Vec<TaskStep>>,
    tally: &Mutex<Tally>,
) -> Result<(), TestCaseError> {
    for menu in INITIAL_POOLS {
        ipam.create_pool(&menu_spec(menu))
            .await
            .map_err(store_error("create_pool"))?;
    }
    // Every task starts at the same moment; they share one allocator over one store handle.
    let start = Arc::new(tokio::sync::Barrier::new(plans.len()));
    let mut tasks = Vec::new();
    for (task, steps) in plans.into_iter().enumerate() {
        let ipam = ipam.clone();
        let start = Arc::clone(&start);
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            run_task(ipam, task, steps).await
        }));
    }
    let mut beliefs = Vec::new();
    let mut errors = Vec::new();
    for task in tasks {
        match task.await {
            Ok(Ok(belief)) => {
                lock(tally).merge(&belief.tally);
                beliefs.push(belief)
            }
            Ok(Err(e)) => errors.push(e),
            Err(e) => errors.push(format!("a task panicked: {e}")),
        }
    }
    if !errors.is_empty() {
        return Err(fail(errors.join("\n")));
    }
    let mut believed: BTreeMap<IpAddr, (String, Option<u64>)> = BTreeMap::new();
    for belief in &beliefs {
        for (ip, held) in &belief.held {
            if let Some(other) = believed.insert(*ip, held.clone()) {
                return Err(fail(format!(
                    "{ip} is believed held by both {} and {}",
                    other.0, held.0
                )));
            }
        }
    }
    let allocations = ipam
        .list_allocations()
        .await
        .map_err(store_error("list_allocations"))?;
    let mut store: BTreeMap<IpAddr, (String, Option<u64>)> = BTreeMap::new();
    for a in allocations {
        if store
            .insert(a.ip, (a.handle.clone(), Some(a.sequence)))
            .is_some()
        {
            return Err(fail(format!("{} is allocated twice in the store", a.ip)));
        }
    }
    let store_holders: BTreeMap<&IpAddr, &String> =
        store.iter().map(|(ip, h)| (ip, &h.0)).collect();
    let believed_holders: BTreeMap<&IpAddr, &String> =
        believed.iter().map(|(ip, h)| (ip, &h.0)).collect();
    if store_holders != believed_holders {
        let lost: Vec<_> = believed_holders
            .iter()
            .filter(|(ip, h)| store_holders.get(*ip) != Some(*h))
            .collect();
        let leaked: Vec<_> = store_holders
            .iter()
            .filter(|(ip, h)| believed_holders.get(*ip) != Some(*h))
            .collect();
        return Err(fail(format!(
            "the tasks' beliefs and the store differ: believed but not in the store {lost:?}; \
             in the store but believed by no task {leaked:?}"
        )));
    }
    for (ip, (handle, sequence)) in &believed {
        if sequence.is_some() && store.get(ip).map(|s| s.1) != Some(*sequence) {
            return Err(fail(format!(
                "{ip} ({handle}): believed sequence {sequence:?}, store {:?}",
                store.get(ip)
            )));
        }
    }
    for (task, belief) in beliefs.iter().enumerate() {
        for h in 0..TASK_HANDLES {
            let handle = format!("t{task}-h{h}");
            let held: Vec<IpAddr> = ipam
                .ips_by_handle(&handle)
                .await
                .map_err(store_error("ips_by_handle"))?
                .into_iter()
                .map(|a| a.ip)
                .collect();
            let expected = belief.handle_addresses(&handle);
            if held != expected {
                return Err(fail(format!(
                    "handle {handle}: ips_by_handle says {held:?}, the task believes {expected:?}"
                )));
            }
        }
    }
    let report = ipam.check(false).await.map_err(store_error("check"))?;
    if !report.problems.is_empty() {
        return Err(fail(format!(
            "check found problems: {:#?}",
            report.problems
        )));
    }
    Ok(())
}

/// Several tasks (each its own host and handles) run random sequences at the same time on one
/// store through one shared allocator, interleaving at every await: afterwards the union of what
/// each believes it holds (successful assigns minus successful releases) is exactly what the
/// store holds, no address is held twice, every handle reads back right, and the check is clean.
/// Each task also checks its own answers as it goes (a stale guarded release must free nothing;
/// a pool it holds addresses in must not be deleted without force).
pub async fn concurrent_tasks_hold_exactly_what_they_believe<F: StoreFactory>(factory: &F) {
    let cases = env_size(CASES_ENV, DEFAULT_CASES);
    let steps = env_size(STEPS_ENV, DEFAULT_STEPS).max(1) as usize;
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        // Interleavings do not repeat, so shrinking would chase a moving target.
        max_shrink_iters: 0,
        ..Config::default()
    });
    let runtime = tokio::runtime::Handle::current();
    let strategy = proptest::collection::vec(
        proptest::collection::vec(task_step_strategy(), 1..=steps),
        TASKS,
    );
    let tally = Mutex::new(Tally::default());
    let result = runner.run(&strategy, |plans| {
        tokio::task::block_in_place(|| runtime.block_on(run_concurrently(factory, plans, &tally)))
    });
    if let Err(failure) = result {
        panic!(
            "{} store: concurrent tasks and the store disagree: {failure}",
            factory.backend_name()
        );
    }
    eprintln!(
        "{} store, concurrent tasks ({TASKS} tasks, {CASES_ENV}={cases}, {STEPS_ENV}={steps}):\n{}",
        factory.backend_name(),
        lock(&tally)
    );
}

/// The store the concurrent tasks share: passes every call through to the store under test,
/// first yielding to the scheduler so that tasks interleave at every store call even on a
/// store whose calls never wait (the memory store), and counts commits and conflicts. It
/// serialises nothing.
#[derive(Debug)]
struct RacingStore {
    inner: Arc<dyn KvStore>,
    commits: AtomicU64,
    conflicts: AtomicU64,
}

impl RacingStore {
    fn new(inner: Arc<dyn KvStore>) -> Self {
        RacingStore {
            inner,
            commits: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
        }
    }
}

#[async_trait]
impl KvStore for RacingStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        tokio::task::yield_now().await;
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        tokio::task::yield_now().await;
        self.inner.list(prefix).await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        tokio::task::yield_now().await;
        self.commits.fetch_add(1, Ordering::SeqCst);
        let result = self.inner.commit(txn).await;
        if matches!(result, Err(KvError::Conflict { .. })) {
            self.conflicts.fetch_add(1, Ordering::SeqCst);
        }
        result
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        tokio::task::yield_now().await;
        self.inner.read_many(reads).await
    }
}

// ---------------------------------------------------------------------------------------------
// Regression cases: defects the model-based tests found, kept as named cases
// ---------------------------------------------------------------------------------------------

/// Found by [`operation_sequences_match_the_model`] (minimal failing input, steps resolved: on
/// pools `a` 10.0.0.0/26 in /29 blocks and `c`: `AutoAssign h0 n0`, `AutoAssign h0 n1`,
/// `DeletePool a force`, `AddPool wide` (10.0.0.0/25 in /28 blocks), `AutoAssign h0 n1` — the last
/// hands out (10.0.0.0, sequence 0) a second time). A pool deleted with force and the same
/// addresses carved again with another block size start their blocks' sequence numbers afresh,
/// so an (address, sequence) pair repeats, and a late guarded release (GC, single-interface DEL)
/// of the first owner frees the second owner's address.
pub async fn pool_recarved_with_another_block_size_refuses_a_stale_guarded_release<
    F: StoreFactory,
>(
    factory: &F,
) {
    let test_store = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&test_store.store));
    ipam.create_pool(&menu_spec(0)).await.expect("pool a");
    let address: IpAddr = "10.0.0.1".parse().expect("address");
    let assign = |handle: &str, host: &str| AssignIpsRequest {
        ips: vec![address],
        handle: handle.to_owned(),
        host: host.to_owned(),
        ..Default::default()
    };
    ipam.assign_ips(&assign("old", "n0"))
        .await
        .expect("first owner");
    let old = ipam
        .get_assignment(address)
        .await
        .expect("read")
        .expect("allocated");
    ipam.delete_pool("a", true).await.expect("forced delete");
    ipam.create_pool(&PoolSpec {
        cidr: net("10.0.0.0/25"),
        name: Some("wide".into()),
        block_size: Some(28),
        disabled: false,
    })
    .await
    .expect("the same addresses in /28 blocks");
    ipam.assign_ips(&assign("new", "n1"))
        .await
        .expect("second owner");
    let new = ipam
        .get_assignment(address)
        .await
        .expect("read")
        .expect("allocated");
    let outcome = ipam
        .release_ips(&[ReleaseRequest {
            ip: address,
            sequence: Some(old.sequence),
        }])
        .await
        .expect("release");
    let still = ipam.get_assignment(address).await.expect("read");
    assert!(
        outcome.released.is_empty() && still.as_ref().map(|a| a.handle.as_str()) == Some("new"),
        "a stale guarded release of ({address}, sequence {}) from the first owner (block {}) freed \
         the second owner's allocation (block {}, sequence {}): outcome {outcome:?}, now {still:?}",
        old.sequence,
        old.block,
        new.block,
        new.sequence
    );
    let report = ipam.check(false).await.expect("check");
    assert!(report.problems.is_empty(), "check: {:#?}", report.problems);
}

/// What the racing ADD of the delete-pool regression case got.
type RacerOutcome = Result<Vec<AssignedAddress>, IpamError>;

/// A store that runs a hook (once) just before the first transaction that deletes (or, with
/// `on_any_write`, writes) a given key: another client's changes at an exact point of an operation.
struct HookBeforeWrite {
    inner: Arc<dyn KvStore>,
    key: String,
    on_any_write: bool,
    hook: tokio::sync::Mutex<Option<Hook>>,
}

type Hook = Box<
    dyn FnOnce(Arc<dyn KvStore>) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send,
>;

impl fmt::Debug for HookBeforeWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookBeforeWrite")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl KvStore for HookBeforeWrite {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        let triggers = txn.ops.iter().any(|op| match op {
            ipam_core::Op::Delete { key } => *key == self.key,
            ipam_core::Op::Put { key, .. } => self.on_any_write && *key == self.key,
        });
        if triggers {
            let hook = self.hook.lock().await.take();
            if let Some(hook) = hook {
                hook(Arc::clone(&self.inner)).await;
            }
        }
        self.inner.commit(txn).await
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        self.inner.read_many(reads).await
    }
}

/// Found by [`concurrent_tasks_hold_exactly_what_they_believe`] (the check reported "block
/// 10.0.0.8/29 lies in no pool" after a task's `DeletePool a` raced another's `SetPoolDisabled a
/// false` and `AutoAssign`). `delete_pool` disables the pool, lists its blocks, deletes those, then
/// deletes the pool; when another client enables the pool again and an ADD claims a new block in
/// it after the listing, the pool is deleted anyway: the new block (with a live address) is left
/// outside every pool. Here the other client's enable and ADD run just before the pool's deleting
/// transaction.
pub async fn delete_pool_racing_an_enable_and_an_add_leaves_no_block_outside_pools<
    F: StoreFactory,
>(
    factory: &F,
) {
    let test_store = factory.fresh().await;
    let assigned: Arc<Mutex<Option<RacerOutcome>>> = Arc::default();
    let seen = Arc::clone(&assigned);
    let hook: Hook = Box::new(move |inner: Arc<dyn KvStore>| {
        Box::pin(async move {
            let other = Ipam::new(inner);
            let enabled = other.set_pool_disabled("a", false).await;
            assert!(enabled.is_ok(), "re-enable: {enabled:?}");
            let got = other
                .auto_assign(&AutoAssignRequest {
                    handle: "racer".into(),
                    host: "n9".into(),
                    num_v4: 1,
                    ..Default::default()
                })
                .await
                .map(|r| r.v4);
            *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(got);
        })
    });
    let store = Arc::new(HookBeforeWrite {
        inner: Arc::clone(&test_store.store),
        key: ipam_core::model::keys::pool("a"),
        on_any_write: false,
        hook: tokio::sync::Mutex::new(Some(hook)),
    });
    let ipam = Ipam::new(store as Arc<dyn KvStore>);
    ipam.create_pool(&menu_spec(0)).await.expect("pool a");
    let deletion = ipam.delete_pool("a", false).await;
    let racer = assigned
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .expect("the hook ran before the pool's deleting transaction");
    let held = ipam.ips_by_handle("racer").await.expect("read");
    let pools = ipam.list_pools().await.expect("pools");
    let report = ipam.check(false).await.expect("check");
    assert!(
        report.problems.is_empty(),
        "delete_pool answered {deletion:?} while the racing ADD got {racer:?}; the racer now \
         holds {held:?}, pools left {pools:?}; check: {:#?}",
        report.problems
    );
}

/// Found by [`concurrent_tasks_hold_exactly_what_they_believe`] (the check reported "block
/// 10.0.2.0/30 lies in no pool": pool names are reused in the menu, `a` is 10.0.0.0/26 or later
/// 10.0.2.0/26). `delete_pool("a")` reads pool `a`, then works by name: when another client
/// deletes that pool and creates a new pool under the same name (and an ADD lands in it) before
/// the delete disables "a", the delete disables and deletes the new pool, checking for blocks only
/// in the old pool's CIDR: the new pool's block, with its live address, is left outside every pool.
/// Here the other client's delete, re-creation and ADD run just before the delete's first write.
pub async fn delete_pool_racing_a_recreation_under_the_same_name_leaves_no_block_outside_pools<
    F: StoreFactory,
>(
    factory: &F,
) {
    let test_store = factory.fresh().await;
    let assigned: Arc<Mutex<Option<RacerOutcome>>> = Arc::default();
    let seen = Arc::clone(&assigned);
    let hook: Hook = Box::new(move |inner: Arc<dyn KvStore>| {
        Box::pin(async move {
            let other = Ipam::new(inner);
            let deleted = other.delete_pool("a", false).await;
            assert!(deleted.is_ok(), "the other client's delete: {deleted:?}");
            let created = other.create_pool(&menu_spec(4)).await;
            assert!(created.is_ok(), "the new pool a: {created:?}");
            let got = other
                .auto_assign(&AutoAssignRequest {
                    handle: "racer".into(),
                    host: "n9".into(),
                    num_v4: 1,
                    ..Default::default()
                })
                .await
                .map(|r| r.v4);
            *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(got);
        })
    });
    let store = Arc::new(HookBeforeWrite {
        inner: Arc::clone(&test_store.store),
        key: ipam_core::model::keys::pool("a"),
        on_any_write: true,
        hook: tokio::sync::Mutex::new(Some(hook)),
    });
    let ipam = Ipam::new(Arc::clone(&test_store.store));
    ipam.create_pool(&menu_spec(0)).await.expect("pool a");
    let deleting = Ipam::new(store as Arc<dyn KvStore>);
    let deletion = deleting.delete_pool("a", false).await;
    let racer = assigned
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .expect("the hook ran before the delete's first write");
    let held = ipam.ips_by_handle("racer").await.expect("read");
    let pools = ipam.list_pools().await.expect("pools");
    let report = ipam.check(false).await.expect("check");
    let new_pool_intact = pools
        .iter()
        .any(|p| p.name == "a" && p.cidr == net("10.0.2.0/26") && !p.disabled);
    assert!(
        report.problems.is_empty() && new_pool_intact && !held.is_empty(),
        "delete_pool(a) of 10.0.0.0/26 answered {deletion:?}; meanwhile a was deleted, created \
         again as 10.0.2.0/26 and an ADD there got {racer:?}; the racer now holds {held:?}, pools \
         left {pools:?}; check: {:#?}",
        report.problems
    );
}
