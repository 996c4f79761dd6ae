//! The allocator's operations on per-namespace pools: reading and setting a namespace's pools
//! (the objects and their validation: `model::namespaces`).

use crate::allocator::assign::named_pool;
use crate::allocator::Ipam;
use crate::allocator::{find_pool, next_got, next_listed, Attempt};
use crate::kv::Read;
use crate::model::error::IpamError;
use crate::model::namespaces::{
    decode_namespace_pools, namespace_key, namespaces_dir, validate_namespace, NamespacePools,
};
use crate::model::{decode, encode, keys, AllowedUse, Family, Pool};

/// A pool a namespace's setting names that its pods' ADDs cannot use.
#[derive(Debug, Clone, PartialEq)]
pub struct UnusableNamespacePool {
    /// The family of the list that names it.
    pub family: Family,
    /// The entry, as the setting has it (a pool's name or CIDR).
    pub pool: String,
    /// What an ADD in the namespace fails with: the pool is gone, of the other family, disabled,
    /// or does not allow workload use.
    pub reason: IpamError,
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
    /// be of its list's family; one compare-and-swap. A stored setting that does not decode is
    /// replaced (or removed): the caller gives the whole setting, so nothing readable is lost.
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
            // never lands naming a pool deleted or split after this read, and raises the
            // generation, as every write of what an ADD decides from does.
            let mut results = self
                .store()
                .read_many(&[
                    // The generation before the pools, as every pool write reads them.
                    Read::Get(keys::pool_generation()),
                    Read::List(keys::pools_dir()),
                    Read::Get(key.clone()),
                ])
                .await?
                .into_iter();
            let generation = next_got(&mut results)?;
            let listed = Self::decode_pools(next_listed(&mut results)?)?;
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
            let unchanged = match decode_namespace_pools(&key, read.as_ref()) {
                Ok(before) => before.unwrap_or_default() == *pools,
                // A setting that does not decode is replaced (or removed) all the same: the
                // caller says what it is to be, and `check` reported it.
                Err(_) => false,
            };
            if unchanged {
                return Ok(Attempt::Done(()));
            }
            let mut plan = self.plan();
            plan.expect(&key, read.as_ref().map(|kv| kv.revision));
            self.bump_pool_generation(&mut plan, generation)?;
            if pools.ipv4_pools.is_empty() && pools.ipv6_pools.is_empty() {
                plan.delete(&key);
            } else {
                plan.put(&key, encode(pools)?);
            }
            self.commit_plan(plan, ()).await
        })
        .await
    }

    /// A namespace's pools (`None` when none are set), with each named pool an ADD in the
    /// namespace could not use and why: the checks auto-assign makes, on one snapshot.
    ///
    /// # Errors
    /// Invalid namespace; store failures; a corrupt object.
    pub async fn namespace_pools_status(
        &self,
        namespace: &str,
    ) -> Result<Option<(NamespacePools, Vec<UnusableNamespacePool>)>, IpamError> {
        validate_namespace(namespace)?;
        let key = namespace_key(namespace);
        let mut results = self
            .store()
            .read_many(&[Read::List(keys::pools_dir()), Read::Get(key.clone())])
            .await?
            .into_iter();
        let pools = Self::decode_pools(next_listed(&mut results)?)?;
        let Some(setting) = decode_namespace_pools(&key, next_got(&mut results)?.as_ref())? else {
            return Ok(None);
        };
        let mut unusable = Vec::new();
        for family in [Family::V4, Family::V6] {
            for entry in setting.for_family(family) {
                if let Err(reason) = named_pool(&pools, entry, family, AllowedUse::Workload) {
                    unusable.push(UnusableNamespacePool {
                        family,
                        pool: entry.clone(),
                        reason,
                    });
                }
            }
        }
        Ok(Some((setting, unusable)))
    }

    /// The namespaces whose pools setting names `pool` (by name or CIDR), in name order. A
    /// setting that does not decode names nothing here (`check` reports it): this answers after a
    /// pool was deleted or disabled, which must not be reported as failed because of it.
    ///
    /// # Errors
    /// Store failures.
    pub async fn namespaces_naming_pool(&self, pool: &Pool) -> Result<Vec<String>, IpamError> {
        let prefix = namespace_key("");
        let mut naming = Vec::new();
        for kv in self.store().list(&namespaces_dir()).await? {
            let Some(namespace) = kv.key.strip_prefix(&prefix) else {
                continue;
            };
            let Ok(setting) = decode::<NamespacePools>(&kv.key, &kv.value) else {
                continue;
            };
            if setting.names_pool(pool) {
                naming.push(namespace.to_owned());
            }
        }
        Ok(naming)
    }
}
