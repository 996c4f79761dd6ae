//! Handles: one allocation owner and the addresses it holds in each block.

use std::collections::BTreeMap;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// One allocation owner: how many addresses it holds in each block.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Handle {
    /// Addresses held, per block CIDR.
    pub blocks: BTreeMap<IpNet, u32>,
}

impl Handle {
    /// Total addresses held.
    pub fn total(&self) -> u64 {
        self.blocks.values().map(|c| u64::from(*c)).sum()
    }

    /// Adds `count` addresses in `block`.
    pub fn add(&mut self, block: IpNet, count: u32) {
        *self.blocks.entry(block).or_insert(0) += count;
    }

    /// Removes `count` addresses in `block`, dropping the entry at zero.
    pub fn remove(&mut self, block: IpNet, count: u32) {
        if let Some(held) = self.blocks.get_mut(&block) {
            *held = held.saturating_sub(count);
            if *held == 0 {
                self.blocks.remove(&block);
            }
        }
    }
}
