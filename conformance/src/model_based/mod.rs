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

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipam_core::{Family, Ipam, Pool, PoolSpec};
use ipnet::IpNet;

mod concurrent;
mod machine;
mod regressions;
mod sequences;

pub use concurrent::{concurrent_tasks_hold_exactly_what_they_believe, TaskStep};
pub use machine::{AddressPick, AllocatorMachine, GenerationState, ModelConfig, ReleasePick, Step};
pub use regressions::{
    delete_pool_racing_a_recreation_under_the_same_name_leaves_no_block_outside_pools,
    delete_pool_racing_an_enable_and_an_add_leaves_no_block_outside_pools,
    pool_recarved_with_another_block_size_refuses_a_stale_guarded_release,
};
pub use sequences::operation_sequences_match_the_model;

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

/// Expands the model-based cases into one `#[test]` each inside a module `model_based`
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
