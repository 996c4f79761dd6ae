//! Counters and gauges the agent's background work keeps (liveness, dead-node reclaim) and its
//! metrics endpoint reads.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// What this agent's dead-node reclaimer has done since it started. Shared (behind an `Arc`)
/// between the reclaimer, which adds to it, and the metrics endpoint, which reads it.
#[derive(Debug, Default)]
pub struct ReclaimCounters {
    /// Dead nodes whose blocks this agent released (their addresses are kept).
    pub dead_nodes_reclaimed: AtomicU64,
    /// Blocks whose affinity was released (deleted when empty) on account of dead nodes.
    pub blocks_released: AtomicU64,
    /// Whether this agent's node is registered and its liveness key on a lease (false while
    /// etcd has not answered since the agent started).
    pub registered: AtomicBool,
    /// Whether this agent held the reclaimer leader key at its last attempt to take it (false
    /// before the first, with `--no-reclaim`, without a lease, and when the key could not be read).
    pub reclaimer_leader: AtomicBool,
    /// Registered nodes by state at this agent's last reclaim pass (as reclaimer leader):
    /// alive, active (agent down, plugin at work), missing (countdown running or not yet
    /// started), dead (its blocks released by that pass or about to be), reclaimed (blocks
    /// released earlier, addresses kept until released by the node or by hand), unreadable (a
    /// registration that does not decode: nothing done for it).
    pub nodes_by_state: [AtomicU64; 6],
}

/// The states [`ReclaimCounters::nodes_by_state`] counts, in its order.
pub const NODE_STATES: [&str; 6] = [
    "alive",
    "active",
    "missing",
    "dead",
    "reclaimed",
    "unreadable",
];

impl ReclaimCounters {
    /// Adds one reclaimed node with the blocks released for it (its addresses are kept).
    pub fn record_node(&self, blocks: u64) {
        self.dead_nodes_reclaimed.fetch_add(1, Ordering::Relaxed);
        self.blocks_released.fetch_add(blocks, Ordering::Relaxed);
    }

    /// Records the node states one reclaim pass found (indices as [`NODE_STATES`]).
    pub fn record_pass(&self, counts: [u64; 6]) {
        for (gauge, count) in self.nodes_by_state.iter().zip(counts) {
            gauge.store(count, Ordering::Relaxed);
        }
    }

    /// The node-state gauges, in [`NODE_STATES`] order.
    pub fn nodes_by_state(&self) -> [u64; 6] {
        [0, 1, 2, 3, 4, 5].map(|i| self.nodes_by_state[i].load(Ordering::Relaxed))
    }

    /// The reclaimed nodes and their released blocks.
    pub fn snapshot(&self) -> (u64, u64) {
        (
            self.dead_nodes_reclaimed.load(Ordering::Relaxed),
            self.blocks_released.load(Ordering::Relaxed),
        )
    }
}

/// What this agent's leak collection has seen and done since it started (shared, behind an `Arc`,
/// between the collection, which writes it, and the metrics endpoint, which reads it).
#[derive(Debug, Default)]
pub struct LeakCounters {
    /// Whether the container runtime answered the last look (1) or not (0).
    pub runtime_answering: AtomicBool,
    /// Looks at which the runtime answered.
    pub looks: AtomicU64,
    /// Looks at which the runtime could not be asked.
    pub unanswered_looks: AtomicU64,
    /// This node's allocations whose container the runtime did not report at the last look.
    pub missing_allocations: AtomicU64,
    /// Live sandboxes' addresses the store records for another holder, at the last look.
    pub duplicate_addresses: AtomicU64,
    /// Live sandboxes' addresses the store records as free, at the last look.
    pub unrecorded_addresses: AtomicU64,
    /// Addresses released as leaks.
    pub released: AtomicU64,
    /// The same addresses by (pool name, node), as Calico's garbage collector counts its
    /// reclamations.
    pub released_by_pool: Mutex<BTreeMap<(String, String), u64>>,
    /// Live pods' addresses the store recorded as free, recorded for them again.
    pub reasserted: AtomicU64,
}

impl LeakCounters {
    /// Counts one address released as a leak of `node` for each name in `pools`: the pool the
    /// address lay in.
    pub fn record_released<'a>(&self, node: &str, pools: impl IntoIterator<Item = &'a str>) {
        let mut by_pool = self
            .released_by_pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for pool in pools {
            self.released.fetch_add(1, Ordering::Relaxed);
            *by_pool
                .entry((pool.to_owned(), node.to_owned()))
                .or_default() += 1;
        }
    }

    /// The released leaks by (pool name, node).
    pub fn released_by_pool(&self) -> BTreeMap<(String, String), u64> {
        self.released_by_pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}
