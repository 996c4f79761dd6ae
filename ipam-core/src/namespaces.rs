//! Per-namespace pools in the store (`ipam/v1/namespaces/<namespace>`): what Calico reads from a
//! namespace's `cni.projectcalico.org/ipv4pools` / `ipv6pools` annotations. A CNI plugin never
//! sees namespace annotations, so blockipam keeps the setting itself (`blockipamctl namespace
//! pools`), and auto-assign reads it inside its own batched read.

use serde::{Deserialize, Serialize};

use crate::allocator::{find_pool, next_got, next_listed, Attempt, Plan};
use crate::error::IpamError;
use crate::kv::{KeyValue, Read};
use crate::model::{decode, encode, keys, Family, ROOT};
use crate::Ipam;

/// Longest namespace name (a Kubernetes DNS label).
pub const MAX_NAMESPACE: usize = 63;

/// Prefix of every namespace's pools setting.
pub fn namespaces_dir() -> String {
    format!("{ROOT}namespaces/")
}

/// The key of `namespace`'s pools setting.
pub fn namespace_key(namespace: &str) -> String {
    format!("{ROOT}namespaces/{namespace}")
}

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

impl Ipam {
    /// A namespace's pools (`None` when none are set).
    ///
    /// # Errors
    /// Invalid namespace; store failures; a corrupt object.
    pub async fn namespace_pools(
        &self,
        namespace: &str,
    ) -> Result<Option<NamespacePools>, IpamError> {
        validate_namespace(namespace)?;
        let key = namespace_key(namespace);
        decode_namespace_pools(&key, self.store().get(&key).await?.as_ref())
    }

    /// Sets a namespace's pools (both lists empty: removes the setting). Every pool must exist and
    /// be of its list's family; one compare-and-swap.
    ///
    /// # Errors
    /// Invalid namespace; [`IpamError::PoolNotFound`]; [`IpamError::PoolWrongFamily`]; store
    /// failures.
    pub async fn set_namespace_pools(
        &self,
        namespace: &str,
        pools: &NamespacePools,
    ) -> Result<(), IpamError> {
        validate_namespace(namespace)?;
        let key = namespace_key(namespace);
        self.retrying(|| async {
            // One batch: the pools, their generation (which every pool add, delete and split
            // changes) and the setting. The write is conditioned on both revisions, so a setting
            // never lands naming a pool deleted or split after this read.
            let mut results = self
                .store()
                .read_many(&[
                    Read::List(keys::pools_dir()),
                    Read::Get(keys::pool_generation()),
                    Read::Get(key.clone()),
                ])
                .await?
                .into_iter();
            let listed = Self::decode_pools(next_listed(&mut results)?)?;
            let generation = next_got(&mut results)?;
            let read = next_got(&mut results)?;
            for family in [Family::V4, Family::V6] {
                for wanted in pools.for_family(family) {
                    let pool = find_pool(&listed, wanted)?;
                    if pool.value.family() != family {
                        return Err(IpamError::PoolWrongFamily {
                            pool: wanted.clone(),
                            family,
                        });
                    }
                }
            }
            let before = decode_namespace_pools(&key, read.as_ref())?.unwrap_or_default();
            if &before == pools {
                return Ok(Attempt::Done(()));
            }
            let mut plan = Plan::default();
            plan.expect(&key, read.as_ref().map(|kv| kv.revision));
            plan.expect(&keys::pool_generation(), generation.map(|kv| kv.revision));
            if pools.ipv4_pools.is_empty() && pools.ipv6_pools.is_empty() {
                plan.delete(&key);
            } else {
                plan.put(&key, encode(pools)?);
            }
            self.commit_plan(plan, ()).await
        })
        .await
    }
}
