//! The reference state machine: the operations a model-based case is made of, and how proptest
//! generates and shrinks their sequences from what is decided before each step runs.

use std::collections::BTreeMap;

use ipam_core::IpamConfig;
use proptest::prelude::*;
use proptest_state_machine::ReferenceStateMachine;

use super::{net, HANDLES, HOSTS, INITIAL_POOLS, POOL_MENU, POOL_NAMES};

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
    pub(super) fn to_ipam(self) -> IpamConfig {
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
