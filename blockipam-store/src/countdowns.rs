//! Grace countdowns for dead-node reclaim, timed by etcd: a key on a lease renewed once after its put.

use std::sync::Arc;
use std::time::Duration;

use backend_etcd::lease::LeaseSession;
use ipam_core::dead_nodes::{Countdowns, NoCountdowns};
use ipam_core::{Condition, IpamError, KvError, Op, Revision};

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
        guard: &[Condition],
        also: &[Op],
    ) -> Result<Revision, IpamError> {
        let lease = self.session.grant_for(duration).await?;
        // A countdown started again replaces the one before on the same key: its lease, which
        // then holds nothing, is revoked rather than left running to its end.
        match self
            .session
            .put_renewed_if(lease, key, &value, guard, also)
            .await
        {
            Ok(revision) => Ok(Revision(revision)),
            Err(e) => {
                // Refused by its guard, nothing was written: the lease just granted holds
                // nothing. After any other failure the put may have landed; its lease is left
                // to run (revoking it would end that countdown at once).
                if matches!(e, KvError::Conflict { .. }) {
                    if let Err(revoke) = self.session.revoke(lease).await {
                        tracing::debug!(
                            key,
                            lease,
                            "could not revoke the lease of a refused countdown (it expires \
                             after its TTL): {revoke}"
                        );
                    }
                }
                Err(e.into())
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use backend_etcd::EtcdStore;
    use ipam_core::dead_nodes::{
        countdown_key, reclaim_pass, register, survey, CountdownRecord, NodeAction, NodeState,
        ReclaimOptions, DEFAULT_GRACE,
    };
    use ipam_core::KvStore;
    use std::sync::atomic::{AtomicBool, Ordering};
    use test_kit::etcd::{unique_prefix, EtcdServer, PrefixGuard};

    /// Lease countdowns that let another reclaimer, with the default grace, mark every missing
    /// node once before the first countdown this one starts: the leader's pass between a
    /// concurrent `gc --dead-nodes` run's survey and its countdown.
    struct AnotherReclaimerMarksFirst {
        store: Arc<dyn KvStore>,
        countdowns: LeaseCountdowns,
        interjected: AtomicBool,
    }

    #[async_trait::async_trait]
    impl Countdowns for AnotherReclaimerMarksFirst {
        async fn start(
            &self,
            key: &str,
            value: Vec<u8>,
            duration: Duration,
            guard: &[Condition],
            also: &[Op],
        ) -> Result<Revision, IpamError> {
            if !self.interjected.swap(true, Ordering::SeqCst) {
                reclaim_pass(
                    Arc::clone(&self.store),
                    &self.countdowns,
                    &ReclaimOptions::default(),
                )
                .await?;
            }
            self.countdowns
                .start(key, value, duration, guard, also)
                .await
        }
    }

    #[tokio::test]
    async fn etcd_refuses_a_countdown_started_from_a_survey_older_than_the_mark() {
        let server = EtcdServer::shared();
        let prefix = unique_prefix();
        let _cleanup = PrefixGuard::new(server.config(&prefix));
        let store: Arc<dyn KvStore> = Arc::new(
            EtcdStore::connect(server.config(&prefix))
                .await
                .expect("connect the store"),
        );
        let session = LeaseSession::connect(&server.config(&prefix), Duration::from_secs(60))
            .await
            .expect("a lease session");
        register(store.as_ref(), "node-a", "test", 1)
            .await
            .expect("register");
        let late = AnotherReclaimerMarksFirst {
            store: Arc::clone(&store),
            countdowns: LeaseCountdowns::new(Arc::new(session)),
            interjected: AtomicBool::new(false),
        };
        let shorter = ReclaimOptions {
            grace: Duration::from_secs(10),
            extra_guard: Vec::new(),
        };
        let outcomes = reclaim_pass(Arc::clone(&store), &late, &shorter)
            .await
            .expect("reclaim pass");
        assert_eq!(outcomes.len(), 1, "{outcomes:?}");
        assert_eq!(outcomes[0].action, NodeAction::Changed);
        // The countdown that runs is the one the mark names, with the mark's grace.
        let node = survey(store.as_ref()).await.expect("survey").remove(0);
        let NodeState::Missing { mark: Some(mark) } = node.state else {
            panic!("node-a is {:?}", node.state);
        };
        assert_eq!(mark.grace_seconds, DEFAULT_GRACE.as_secs());
        let countdown = store
            .get(&countdown_key("node-a"))
            .await
            .expect("read the countdown")
            .expect("the countdown runs");
        assert_eq!(countdown.revision.get(), mark.countdown_revision);
        let record: CountdownRecord =
            serde_json::from_slice(&countdown.value).expect("a countdown is JSON");
        assert_eq!(record.grace_seconds, DEFAULT_GRACE.as_secs());
    }
}
