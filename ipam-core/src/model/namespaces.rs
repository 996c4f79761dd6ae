//! Per-namespace pools in the store (`ipam/v1/namespaces/<namespace>`): what Calico reads from a
//! namespace's `cni.projectcalico.org/ipv4pools` / `ipv6pools` annotations. A CNI plugin never
//! sees namespace annotations, so blockipam keeps the setting itself (`blockipamctl namespace
//! pools`), and auto-assign reads it inside its own batched read.

use crate::kv::KeyValue;
use crate::model::error::IpamError;
use crate::model::{decode, Family, Pool};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

pub use crate::model::keys::{namespace_key, namespaces_dir};

/// Longest namespace name (a Kubernetes DNS label).
pub const MAX_NAMESPACE: usize = 63;

/// A namespace's pools, by name or CIDR; an empty list leaves that family to the netconf.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespacePools {
    /// IPv4 pools.
    pub ipv4_pools: Vec<String>,
    /// IPv6 pools.
    pub ipv6_pools: Vec<String>,
}

impl NamespacePools {
    /// The pools for `family`.
    pub fn for_family(&self, family: Family) -> &[String] {
        match family {
            Family::V4 => &self.ipv4_pools,
            Family::V6 => &self.ipv6_pools,
        }
    }

    /// Whether either list names `pool`.
    pub fn names_pool(&self, pool: &Pool) -> bool {
        self.ipv4_pools
            .iter()
            .chain(&self.ipv6_pools)
            .any(|entry| entry_names_pool(entry, pool))
    }
}

/// Whether `entry` of a pools setting names `pool`: its name, or its CIDR.
pub fn entry_names_pool(entry: &str, pool: &Pool) -> bool {
    entry == pool.name || entry.parse::<IpNet>().is_ok_and(|cidr| cidr == pool.cidr)
}

/// Refuses what is not a Kubernetes namespace name (1 to 63 of `[a-z0-9-]`, starting and ending
/// with a letter or digit).
///
/// # Errors
/// [`IpamError::InvalidArgument`] naming the namespace.
pub fn validate_namespace(namespace: &str) -> Result<(), IpamError> {
    let bytes = namespace.as_bytes();
    let edges_ok = matches!(
        (bytes.first(), bytes.last()),
        (Some(first), Some(last)) if first.is_ascii_alphanumeric() && last.is_ascii_alphanumeric()
    );
    if !edges_ok
        || namespace.len() > MAX_NAMESPACE
        || !bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
    {
        return Err(IpamError::invalid(format!(
            "{namespace:?} is not a Kubernetes namespace name (1 to {MAX_NAMESPACE} of a-z, 0-9 \
             and '-', starting and ending with a letter or digit)"
        )));
    }
    Ok(())
}

/// The pools in a namespace object read from `key` (`None`: no object).
///
/// # Errors
/// [`IpamError::Corrupt`] naming the key.
pub fn decode_namespace_pools(
    key: &str,
    read: Option<&KeyValue>,
) -> Result<Option<NamespacePools>, IpamError> {
    read.map(|kv| decode::<NamespacePools>(key, &kv.value))
        .transpose()
}
