//! Handles: one allocation owner and the addresses it holds in each block.

use std::collections::BTreeMap;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// One allocation owner: how many addresses it holds in each block and, for the addresses whose
/// blocks keep their attributes apart (format 6), each one's metadata.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Handle {
    /// Addresses held, per block CIDR.
    pub blocks: BTreeMap<IpNet, u32>,
    /// The metadata of the addresses held whose blocks keep their attributes apart
    /// ([`crate::model::APART`]), per block CIDR and ordinal: what a release by handle reads
    /// instead of their owner keys (format 6; empty before).
    pub apart: BTreeMap<IpNet, BTreeMap<u32, BTreeMap<String, String>>>,
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

    /// Adds the address of `ordinal` in `block`; with `apart`, its metadata too (a block that
    /// keeps the address's attribute apart).
    pub fn hold(&mut self, block: IpNet, ordinal: u32, apart: Option<&BTreeMap<String, String>>) {
        self.add(block, 1);
        if let Some(metadata) = apart {
            self.apart
                .entry(block)
                .or_default()
                .insert(ordinal, metadata.clone());
        }
    }

    /// Removes the address of `ordinal` in `block` (and its metadata, when kept).
    pub fn let_go(&mut self, block: IpNet, ordinal: u32) {
        self.remove(block, 1);
        if let Some(held) = self.apart.get_mut(&block) {
            held.remove(&ordinal);
            if held.is_empty() {
                self.apart.remove(&block);
            }
        }
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
