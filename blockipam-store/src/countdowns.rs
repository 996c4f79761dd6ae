//! Grace countdowns for dead-node reclaim, timed by etcd: a key on a lease renewed once after its put.

use std::sync::Arc;
use std::time::Duration;

use backend_etcd::lease::LeaseSession;
use ipam_core::dead_nodes::{Countdowns, NoCountdowns};
use ipam_core::{IpamError, KvError, Revision};

use crate::DatastoreSettings;

/// Countdowns as keys on etcd leases of the countdown's duration, renewed once right after the
/// key is put and never again: etcd deletes the key once the lease's TTL has passed by its own
/// clock (a leader change restarts the TTL, which only lengthens a grace period). The renewal
/// times the countdown from after its put: a plugin commit that lands after the put moves the
/// node's activity record (it sees the countdown), one before it may not, so the grace must not
/// start at the grant, earlier than the put by however long this process took in between.
#[derive(Debug, Clone)]
pub struct LeaseCountdowns {
    session: Arc<LeaseSession>,
}

impl LeaseCountdowns {
    /// Countdowns granted through `session`.
    pub fn new(session: Arc<LeaseSession>) -> Self {
        LeaseCountdowns { session }
    }
}

#[async_trait::async_trait]
impl Countdowns for LeaseCountdowns {
    async fn start(
        &self,
        key: &str,
        value: Vec<u8>,
        duration: Duration,
    ) -> Result<Revision, IpamError> {
        let lease = self.session.grant_for(duration).await?;
        // A countdown started again replaces the one before on the same key: its lease, which
        // then holds nothing, is revoked rather than left running to its end.
        Ok(Revision(
            self.session
                .put_renewed_revoking_the_replaced_lease(lease, key, &value)
                .await?,
        ))
    }
}

/// The countdowns for the store `settings` name: etcd leases on etcd; on sled and redb none (dead-node
/// reclaim applies to etcd only: no node is ever marked there).
///
/// # Errors
/// [`KvError`] when the etcd settings are incomplete or etcd cannot be reached.
pub async fn countdowns_for(settings: &DatastoreSettings) -> Result<Box<dyn Countdowns>, KvError> {
    let Some(etcd) = settings.etcd() else {
        return Ok(Box::new(NoCountdowns));
    };
    // The session's own TTL is unused: every countdown grants its lease with its own duration.
    let session = LeaseSession::connect(&etcd.config()?, Duration::from_secs(60)).await?;
    Ok(Box::new(LeaseCountdowns::new(Arc::new(session))))
}
