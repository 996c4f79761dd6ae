//! Api mode: a node's ADD and DEL as the allocator calls the plugin makes (`auto_assign` of one
//! IPv4 address with the plugin's attributes, `release_chosen` of the pod's interface's addresses),
//! over the node's own counted store client.

use std::net::IpAddr;
use std::sync::Arc;

use ipam_core::{AutoAssignRequest, CountingStore, Ipam, KvStore, RoundTrips};

use ipam_core::allocator::leaks::ATTR_INTERFACE;

use crate::error::LoadError;
use crate::observe::{CommitCounter, CommitWork};
use crate::pods;

/// One node's allocator and the counters around its store client.
#[derive(Debug, Clone)]
pub struct ApiNode {
    host: String,
    network: String,
    ipam: Ipam,
    counting: Arc<CountingStore>,
    commits: Arc<CommitCounter>,
}

/// What one call did to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreWork {
    /// Reads and transactions.
    pub round_trips: RoundTrips,
    /// Transactions refused by a failed condition (each retried by the allocator), and the keys
    /// the transactions wrote and tested.
    pub commits: CommitWork,
}

impl ApiNode {
    /// A node named `host` over `store` (its own client, or a handle it shares); with
    /// `agent_cache`, its allocator reads through a cache of its own, as its node agent serves
    /// the plugin (the counters then count what reaches the store). Its allocator records the
    /// node's activity as the plugin's does (`Ipam::recording_activity`).
    ///
    /// # Errors
    /// [`LoadError`] for a host name the store refuses.
    pub fn new(
        host: String,
        network: String,
        store: Arc<dyn KvStore>,
        agent_cache: bool,
    ) -> Result<Self, LoadError> {
        let commits = Arc::new(CommitCounter::new(store));
        let counting = Arc::new(CountingStore::new(commits.clone()));
        let allocator_store: Arc<dyn KvStore> = if agent_cache {
            Arc::new(ipam_core::node_cache(counting.clone()))
        } else {
            counting.clone()
        };
        let ipam = Ipam::new(allocator_store)
            .recording_activity(&host, env!("CARGO_PKG_VERSION"))
            .map_err(|e| LoadError::failed(format!("node {host}: {e}")))?;
        Ok(ApiNode {
            host,
            network,
            ipam,
            counting,
            commits,
        })
    }

    fn take_work(&self) -> StoreWork {
        StoreWork {
            round_trips: self.counting.take(),
            commits: self.commits.take(),
        }
    }

    /// ADD of `container`: one IPv4 address, never a block's first or last address (as the
    /// plugin asks when no gateway is configured).
    pub async fn add(
        &self,
        handle: &str,
        container: &str,
    ) -> (Result<Vec<IpAddr>, String>, StoreWork) {
        self.take_work();
        let request = AutoAssignRequest {
            handle: handle.to_owned(),
            host: self.host.clone(),
            num_v4: 1,
            attributes: pods::attributes(&self.network, container),
            reuse_existing: true,
            skip_block_edges: true,
            ..AutoAssignRequest::default()
        };
        let result = match self.ipam.auto_assign(&request).await {
            Ok(result) if result.reused => Err(format!(
                "ADD {handle}: the handle already held addresses before this run's ADD"
            )),
            Ok(result) if result.v4.is_empty() => Err(format!("ADD {handle}: no address returned")),
            Ok(result) => Ok(result.v4.into_iter().map(|a| a.ip).collect()),
            Err(e) => Err(format!("ADD {handle} on {}: {e}", self.host)),
        };
        (result, self.take_work())
    }

    /// DEL of the pod holding `held` under `handle`: releases its interface's addresses, as the
    /// plugin does, and fails unless exactly `held` was released.
    pub async fn del(
        &self,
        handle: &str,
        held: &[IpAddr],
    ) -> (Result<Vec<IpAddr>, String>, StoreWork) {
        self.take_work();
        // The plugin's DEL: the handle's addresses on the pod's interface, one read and one
        // transaction.
        let chosen = self
            .ipam
            .release_chosen(handle, &self.host, |held| {
                held.iter()
                    .filter(|info| {
                        info.attributes.get(ATTR_INTERFACE).map(String::as_str)
                            == Some(pods::INTERFACE)
                    })
                    .map(|info| info.ip)
                    .collect()
            })
            .await;
        let result = match chosen.map(|outcome| outcome.released) {
            Ok(mut released) => {
                let mut expected = held.to_vec();
                released.sort();
                expected.sort();
                if released == expected {
                    Ok(released)
                } else {
                    Err(format!(
                        "DEL {handle}: released {released:?}, but the pod held {expected:?}"
                    ))
                }
            }
            Err(e) => Err(format!("DEL {handle} on {}: {e}", self.host)),
        };
        (result, self.take_work())
    }
}
