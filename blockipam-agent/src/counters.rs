//! Counters the agent's background work keeps (dead-node reclaim) and its metrics endpoint reads.

use std::sync::atomic::{AtomicU64, Ordering};

/// What this agent's dead-node reclaimer has done since it started. Shared (behind an `Arc`)
/// between the reclaimer, which adds to it, and the metrics endpoint, which reads it.
#[derive(Debug, Default)]
pub struct ReclaimCounters {
    /// Dead nodes whose blocks and addresses this agent released.
    pub dead_nodes_reclaimed: AtomicU64,
    /// Addresses released on account of dead nodes.
    pub addresses_reclaimed: AtomicU64,
    /// Blocks whose affinity was released (deleted when empty) on account of dead nodes.
    pub blocks_released: AtomicU64,
}

impl ReclaimCounters {
    /// Adds one reclaimed node with the addresses and blocks released for it.
    pub fn record_node(&self, addresses: u64, blocks: u64) {
        self.dead_nodes_reclaimed.fetch_add(1, Ordering::Relaxed);
        self.addresses_reclaimed
            .fetch_add(addresses, Ordering::Relaxed);
        self.blocks_released.fetch_add(blocks, Ordering::Relaxed);
    }

    /// The three counts, in field order.
    pub fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.dead_nodes_reclaimed.load(Ordering::Relaxed),
            self.addresses_reclaimed.load(Ordering::Relaxed),
            self.blocks_released.load(Ordering::Relaxed),
        )
    }
}
