//! The IPAM configuration and pools: what blocks are carved from and how addresses are assigned.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::model::error::IpamError;
use crate::model::selector::Selector;

use crate::model::{decode, host_bits, ip_to_u128, u128_to_ip, Family};

/// IPAM-wide settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpamConfig {
    /// When true, a host never borrows addresses from blocks affine to other hosts (or to none).
    pub strict_affinity: bool,
    /// When true, a host claims new blocks as it needs them.
    pub auto_allocate_blocks: bool,
    /// Most blocks of one family a host may own; 0 means unlimited.
    pub max_blocks_per_host: u32,
    /// Seconds a released address waits before it is handed out again (Calico's
    /// `ipCooldownSeconds`); 0 (the default) reuses at once; at most [`MAX_IP_COOLDOWN_SECONDS`].
    pub ip_cooldown_seconds: u32,
    /// Seconds a block must have been empty before another host may take it over when its pools
    /// have no unclaimed block left (Calico's `EmptyBlockMinReclaimAge`, default 60).
    pub empty_block_reclaim_seconds: u32,
}

impl IpamConfig {
    /// Rejects settings out of range.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an IP cooldown over [`MAX_IP_COOLDOWN_SECONDS`].
    pub fn validate(&self) -> Result<(), IpamError> {
        if self.ip_cooldown_seconds > MAX_IP_COOLDOWN_SECONDS {
            return Err(IpamError::InvalidArgument(format!(
                "IP cooldown {} s is over the {MAX_IP_COOLDOWN_SECONDS} s limit (as Calico's ipCooldownSeconds)",
                self.ip_cooldown_seconds
            )));
        }
        Ok(())
    }
}

/// Longest IP cooldown, as Calico (20 minutes).
pub const MAX_IP_COOLDOWN_SECONDS: u32 = 1200;
/// Default [`IpamConfig::empty_block_reclaim_seconds`], Calico's `EmptyBlockMinReclaimAge`.
pub const DEFAULT_EMPTY_BLOCK_RECLAIM_SECONDS: u32 = 60;

impl Default for IpamConfig {
    fn default() -> Self {
        IpamConfig {
            strict_affinity: false,
            auto_allocate_blocks: true,
            max_blocks_per_host: 20,
            ip_cooldown_seconds: 0,
            empty_block_reclaim_seconds: DEFAULT_EMPTY_BLOCK_RECLAIM_SECONDS,
        }
    }
}

/// A range of addresses that blocks are carved from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    /// Unique name (letters, digits, `.`, `_`, `-`, `:`).
    pub name: String,
    /// The pool's network (a network address, no host bits).
    pub cidr: IpNet,
    /// Prefix length of the pool's blocks.
    pub block_size: u8,
    /// A disabled pool is never allocated from.
    pub disabled: bool,
    /// The nodes that auto-assign from this pool (Calico's `nodeSelector`); `all()` by default.
    /// A pool named explicitly is used whatever it selects.
    pub node_selector: Selector,
    /// Whether auto-assign may pick this pool by itself (Calico's `assignmentMode`).
    pub assignment_mode: AssignmentMode,
    /// What its addresses may be used for (Calico's `allowedUses`).
    pub allowed_uses: AllowedUses,
}

/// How a pool's addresses are handed out (Calico's `assignmentMode`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum AssignmentMode {
    /// Auto-assign picks the pool by itself (when it selects the node).
    #[default]
    Automatic,
    /// Only when named (netconf `ipv4_pools`/`ipv6_pools`), or for an explicitly requested
    /// address.
    Manual,
}

impl std::str::FromStr for AssignmentMode {
    type Err = IpamError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "automatic" => Ok(AssignmentMode::Automatic),
            "manual" => Ok(AssignmentMode::Manual),
            other => Err(IpamError::invalid(format!(
                "assignment mode {other:?}: expected automatic or manual"
            ))),
        }
    }
}

impl std::fmt::Display for AssignmentMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AssignmentMode::Automatic => "automatic",
            AssignmentMode::Manual => "manual",
        })
    }
}

/// One use a pool's addresses may be put to (Calico's `allowedUses`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum AllowedUse {
    /// Pod (workload) addresses: every CNI request.
    #[default]
    Workload,
    /// A node's tunnel addresses (IPIP, VXLAN, WireGuard).
    Tunnel,
    /// Load-balancer service addresses.
    Loadbalancer,
}

impl std::fmt::Display for AllowedUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AllowedUse::Workload => "workload",
            AllowedUse::Tunnel => "tunnel",
            AllowedUse::Loadbalancer => "loadbalancer",
        })
    }
}

/// A pool's allowed uses: a non-empty set; `loadbalancer` only alone (as Calico). Default:
/// workload and tunnel.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "Vec<AllowedUse>", into = "Vec<AllowedUse>")]
pub struct AllowedUses(std::collections::BTreeSet<AllowedUse>);

impl AllowedUses {
    /// Validates a set of uses.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an empty set, or `loadbalancer` with another use.
    pub fn new(uses: impl IntoIterator<Item = AllowedUse>) -> Result<Self, IpamError> {
        let set: std::collections::BTreeSet<AllowedUse> = uses.into_iter().collect();
        if set.is_empty() {
            return Err(IpamError::invalid(
                "allowed uses may not be empty (workload, tunnel, loadbalancer)",
            ));
        }
        if set.contains(&AllowedUse::Loadbalancer) && set.len() > 1 {
            return Err(IpamError::invalid(
                "allowed use loadbalancer may not be combined with another use (as in Calico)",
            ));
        }
        Ok(AllowedUses(set))
    }

    /// Parses a comma-separated list (`workload,tunnel`).
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an unknown use or an invalid set.
    pub fn parse(text: &str) -> Result<Self, IpamError> {
        let mut uses = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            uses.push(match part.to_ascii_lowercase().as_str() {
                "workload" => AllowedUse::Workload,
                "tunnel" => AllowedUse::Tunnel,
                "loadbalancer" => AllowedUse::Loadbalancer,
                other => {
                    return Err(IpamError::invalid(format!(
                        "allowed use {other:?}: expected workload, tunnel or loadbalancer"
                    )))
                }
            });
        }
        AllowedUses::new(uses)
    }

    /// Whether `use_` is allowed.
    pub fn allows(&self, use_: AllowedUse) -> bool {
        self.0.contains(&use_)
    }

    /// The uses, in order.
    pub fn iter(&self) -> impl Iterator<Item = AllowedUse> + '_ {
        self.0.iter().copied()
    }
}

impl Default for AllowedUses {
    fn default() -> Self {
        AllowedUses(
            [AllowedUse::Workload, AllowedUse::Tunnel]
                .into_iter()
                .collect(),
        )
    }
}

impl TryFrom<Vec<AllowedUse>> for AllowedUses {
    type Error = IpamError;

    fn try_from(uses: Vec<AllowedUse>) -> Result<Self, Self::Error> {
        AllowedUses::new(uses)
    }
}

impl From<AllowedUses> for Vec<AllowedUse> {
    fn from(uses: AllowedUses) -> Self {
        uses.0.into_iter().collect()
    }
}

impl std::fmt::Display for AllowedUses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.iter().map(|u| u.to_string()).collect();
        f.write_str(&names.join(","))
    }
}

/// Decodes a stored pool of any readable format (formats 1 and 2 get `all()`, automatic, and
/// workload and tunnel).
///
/// # Errors
/// [`IpamError::Corrupt`] naming the key.
pub fn decode_pool(key: &str, bytes: &[u8]) -> Result<Pool, IpamError> {
    decode(key, bytes)
}

impl Pool {
    /// The pool's family.
    pub fn family(&self) -> Family {
        Family::of_net(&self.cidr)
    }

    /// Number of blocks the pool holds (saturating at `u128::MAX`).
    pub fn block_count(&self) -> u128 {
        1u128
            .checked_shl(u32::from(self.block_size - self.cidr.prefix_len()))
            .unwrap_or(u128::MAX)
    }

    /// The `index`th block of the pool, counting from its first address.
    pub fn block_at(&self, index: u128) -> Option<IpNet> {
        let step = 1u128.checked_shl(u32::from(host_bits(self.family()) - self.block_size))?;
        let start = ip_to_u128(self.cidr.network()).checked_add(index.checked_mul(step)?)?;
        IpNet::new(u128_to_ip(self.family(), start), self.block_size).ok()
    }

    /// Where `block` is among the pool's blocks (the inverse of [`block_at`](Self::block_at));
    /// `None` for a CIDR that is not one of them.
    pub fn block_index_of(&self, block: &IpNet) -> Option<u128> {
        if block.prefix_len() != self.block_size
            || Family::of_net(block) != self.family()
            || !self.cidr.contains(&block.network())
        {
            return None;
        }
        let shift = u32::from(host_bits(self.family()) - self.block_size);
        let offset = ip_to_u128(block.network()) - ip_to_u128(self.cidr.network());
        let index = offset.checked_shr(shift)?;
        (self.block_at(index) == Some(*block)).then_some(index)
    }

    /// The block of this pool that contains `ip`.
    pub fn block_containing(&self, ip: IpAddr) -> Option<IpNet> {
        if !self.cidr.contains(&ip) {
            return None;
        }
        IpNet::new(ip, self.block_size).ok().map(|n| n.trunc())
    }

    /// Number of addresses the pool spans (saturating).
    pub fn capacity(&self) -> u128 {
        1u128
            .checked_shl(u32::from(host_bits(self.family()) - self.cidr.prefix_len()))
            .unwrap_or(u128::MAX)
    }
}

/// A pool named `p` of `cidr` with blocks of `block_size`, the defaults otherwise (for tests).
#[cfg(test)]
pub(crate) fn test_pool(cidr: &str, block_size: u8) -> Pool {
    Pool {
        name: "p".into(),
        cidr: cidr.parse().expect("cidr"),
        block_size,
        ..Pool::default()
    }
}

#[cfg(test)]
mod tests {
    use super::test_pool as pool;
    use super::*;

    #[test]
    fn the_ip_cooldown_is_at_most_calicos_limit() {
        let mut config = IpamConfig {
            ip_cooldown_seconds: MAX_IP_COOLDOWN_SECONDS,
            ..IpamConfig::default()
        };
        assert!(config.validate().is_ok());
        config.ip_cooldown_seconds = 0;
        assert!(config.validate().is_ok());
        config.ip_cooldown_seconds = MAX_IP_COOLDOWN_SECONDS + 1;
        let refused = config.validate();
        assert!(
            matches!(&refused, Err(IpamError::InvalidArgument(m)) if m.contains("1201 s")),
            "{refused:?}"
        );
    }

    #[test]
    fn assignment_modes_parse_in_any_case_and_print_as_calico_names_them() {
        for (text, mode) in [
            ("automatic", AssignmentMode::Automatic),
            (" Manual ", AssignmentMode::Manual),
            ("MANUAL", AssignmentMode::Manual),
        ] {
            assert_eq!(text.parse::<AssignmentMode>().ok(), Some(mode), "{text:?}");
        }
        assert_eq!(AssignmentMode::Automatic.to_string(), "automatic");
        assert_eq!(AssignmentMode::Manual.to_string(), "manual");
        let refused = "auto".parse::<AssignmentMode>();
        assert!(
            matches!(&refused, Err(IpamError::InvalidArgument(m)) if m.contains("\"auto\"")),
            "{refused:?}"
        );
    }

    #[test]
    fn allowed_uses_parse_check_print_and_store_as_a_list() {
        let both = AllowedUses::parse(" Tunnel, workload,,").expect("parse");
        assert_eq!(both, AllowedUses::default());
        assert_eq!(both.to_string(), "workload,tunnel");
        assert!(both.allows(AllowedUse::Workload) && both.allows(AllowedUse::Tunnel));
        assert!(!both.allows(AllowedUse::Loadbalancer));
        assert_eq!(
            both.iter().collect::<Vec<_>>(),
            [AllowedUse::Workload, AllowedUse::Tunnel]
        );
        let balancer = AllowedUses::parse("loadbalancer").expect("parse");
        assert_eq!(balancer.to_string(), "loadbalancer");
        assert!(!balancer.allows(AllowedUse::Workload));

        for (text, says) in [
            ("", "may not be empty"),
            (" , ", "may not be empty"),
            ("workload,loadbalancer", "may not be combined"),
            ("workloads", "\"workloads\""),
        ] {
            let refused = AllowedUses::parse(text);
            assert!(
                matches!(&refused, Err(IpamError::InvalidArgument(m)) if m.contains(says)),
                "{text:?}: {refused:?}"
            );
        }

        let stored = serde_json::to_string(&both).expect("encode");
        assert_eq!(stored, r#"["workload","tunnel"]"#);
        let back: AllowedUses = serde_json::from_str(&stored).expect("decode");
        assert_eq!(back, both);
        assert!(serde_json::from_str::<AllowedUses>("[]").is_err());
        assert!(serde_json::from_str::<AllowedUses>(r#"["tunnel","loadbalancer"]"#).is_err());
    }

    #[test]
    fn a_pools_capacity_and_blocks_follow_its_prefix() {
        let v4 = pool("10.0.0.0/16", 26);
        assert_eq!(v4.capacity(), 65_536);
        assert_eq!(v4.block_count(), 1_024);
        let last: IpNet = "10.0.255.192/26".parse().expect("cidr");
        assert_eq!(v4.block_at(1_023), Some(last));
        assert_eq!(v4.block_index_of(&last), Some(1_023));
        for outside in ["10.1.0.0/26", "10.0.0.0/24", "10.0.0.32/26", "fd00::/122"] {
            let block: IpNet = outside.parse().expect("cidr");
            assert_eq!(v4.block_index_of(&block), None, "{outside}");
        }
        assert_eq!(pool("fd00::/48", 122).capacity(), 1 << 80);
        assert_eq!(pool("::/0", 122).capacity(), u128::MAX);
    }
}
