//! etcd leases, which the `KvStore` trait does not have: a key kept alive on a lease (granted
//! again and put again whenever the lease is lost), create-if-absent keys on that lease (a leader
//! key), and revocation at a clean stop.
//!
//! Keys are given in the store's terms and written under the configured prefix, so that a lease
//! key `ipam/v1/liveness/node-a` is the key an [`EtcdStore`](crate::EtcdStore) with the same
//! configuration reads, lists and puts conditions on.

use std::fmt;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, LeaseKeepAliveStream, LeaseKeeper,
    LeaseTimeToLiveOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use ipam_core::kv::{validate_key, Condition, KvError, Op};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::config::EtcdConfig;
use crate::error::{map_error, Kind};
use crate::store::{comparisons, connect_options, failed_condition, reads_of_the_tested_keys};

/// A lease's id as etcd numbers it.
pub type LeaseId = i64;

/// A connection to etcd for lease work, with the store's prefix, the lease TTL and the request
/// bound of its configuration.
pub struct LeaseSession {
    client: Client,
    prefix: String,
    endpoints: String,
    ttl: Duration,
    request_timeout: Duration,
}

impl fmt::Debug for LeaseSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseSession")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// Who holds a create-if-absent lease key (see [`LeaseSession::acquire`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// The key is attached to the lease given: held, at this modification revision (the revision
    /// an `EtcdStore` reports for the key).
    Mine {
        /// The key's revision.
        revision: u64,
    },
    /// Another lease holds it; its value.
    Other {
        /// The value the holder stored.
        value: Vec<u8>,
    },
}

impl LeaseSession {
    /// Validates `config` and connects (all endpoints, balanced); leases granted by this session
    /// live `ttl` (whole seconds, at least 1; etcd may raise a very short TTL to its minimum,
    /// about 2 s).
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] for an invalid configuration or TTL; a mapped etcd error when
    /// the client cannot be built.
    pub async fn connect(config: &EtcdConfig, ttl: Duration) -> Result<LeaseSession, KvError> {
        if ttl.as_secs() == 0 || ttl.subsec_nanos() != 0 {
            return Err(KvError::invalid(format!(
                "a lease TTL is a whole number of seconds, at least 1 (got {ttl:?})"
            )));
        }
        let resolved = config.resolve()?;
        let options = connect_options(&resolved)?;
        let endpoints = resolved.endpoints.join(",");
        let client = tokio::time::timeout(
            resolved.request_timeout,
            Client::connect(&resolved.endpoints, Some(options)),
        )
        .await
        .map_err(|_| {
            KvError::unavailable(format!(
                "etcd at {endpoints}: no connection within {:?}",
                resolved.request_timeout
            ))
        })?
        .map_err(|e| map_error(e, Kind::Read, &endpoints))?;
        Ok(LeaseSession {
            client,
            prefix: resolved.prefix,
            endpoints,
            ttl,
            request_timeout: resolved.request_timeout,
        })
    }

    /// The TTL of the leases this session grants.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    fn full_key(&self, key: &str) -> Result<Vec<u8>, KvError> {
        validate_key(key)?;
        Ok(format!("{}{key}", self.prefix).into_bytes())
    }

    /// Runs one request within the request timeout, mapping its error.
    async fn bounded<T>(
        &self,
        kind: Kind,
        request: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, KvError> {
        match tokio::time::timeout(self.request_timeout, request).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(map_error(e, kind, &self.endpoints)),
            Err(_) => Err(KvError::unavailable(format!(
                "etcd at {}: no answer within {:?}",
                self.endpoints, self.request_timeout
            ))),
        }
    }

    /// Grants a new lease of the session's TTL.
    ///
    /// # Errors
    /// etcd errors, mapped; [`KvError::Unavailable`] after the request timeout.
    pub async fn grant(&self) -> Result<LeaseId, KvError> {
        self.grant_for(self.ttl).await
    }

    /// Grants a new lease of `ttl` (whole seconds; etcd may raise a very short one to its
    /// minimum): a lease nobody renews deletes its keys once `ttl` has passed by etcd's clock.
    ///
    /// # Errors
    /// As [`grant`](Self::grant).
    pub async fn grant_for(&self, ttl: Duration) -> Result<LeaseId, KvError> {
        let ttl = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let mut client = self.client.clone();
        let response = self
            .bounded(Kind::Write, client.lease_grant(ttl, None))
            .await?;
        if !response.error().is_empty() {
            return Err(KvError::other(format!(
                "etcd refused a lease: {}",
                response.error()
            )));
        }
        Ok(response.id())
    }

    /// Stores `key` = `value` attached to `lease` (unconditionally); returns the revision of the
    /// put (the key's revision as an `EtcdStore` reports it).
    ///
    /// # Errors
    /// As [`grant`](Self::grant); an expired lease is an error from etcd.
    pub async fn put(&self, lease: LeaseId, key: &str, value: &[u8]) -> Result<u64, KvError> {
        self.put_returning_previous_lease(lease, key, value, &[], &[])
            .await
            .map(|(revision, _)| revision)
    }

    /// As [`put`](Self::put), also returning the lease the key was attached to before this put
    /// (`None` when it did not exist or had no lease), and only while every condition of `guard`
    /// holds (one etcd transaction).
    async fn put_returning_previous_lease(
        &self,
        lease: LeaseId,
        key: &str,
        value: &[u8],
        guard: &[Condition],
        also: &[Op],
    ) -> Result<(u64, Option<LeaseId>), KvError> {
        let full = self.full_key(key)?;
        // The same write as a store transaction: validated as every transaction is (its keys,
        // its size), and what names the failed condition.
        let as_committed = ipam_core::kv::Txn {
            conditions: guard.to_vec(),
            ops: std::iter::once(Op::put(key, value.to_vec()))
                .chain(also.iter().cloned())
                .collect(),
        };
        as_committed.validate()?;
        let mut ops = vec![TxnOp::put(
            full,
            value,
            Some(PutOptions::new().with_lease(lease).with_prev_key()),
        )];
        for op in also {
            ops.push(match op {
                Op::Put { key, value } => TxnOp::put(self.full_key(key)?, value.clone(), None),
                Op::Delete { key } => TxnOp::delete(self.full_key(key)?, None),
            });
        }
        let txn = Txn::new()
            .when(comparisons(&self.prefix, guard))
            .and_then(ops)
            .or_else(reads_of_the_tested_keys(&self.prefix, guard));
        let mut client = self.client.clone();
        let response = self.bounded(Kind::Write, client.txn(txn)).await?;
        if !response.succeeded() {
            return Err(failed_condition(&self.prefix, &as_committed, response)?);
        }
        let revision = response
            .header()
            .and_then(|h| u64::try_from(h.revision()).ok())
            .unwrap_or(0);
        // The leased put's answer comes first.
        let previous = response
            .op_responses()
            .into_iter()
            .next()
            .and_then(|answer| match answer {
                TxnOpResponse::Put(put) => put.prev_key().map(|kv| kv.lease()),
                _ => None,
            })
            .filter(|&previous| previous != 0);
        Ok((revision, previous))
    }

    /// Stores `key` = `value` attached to `lease`, then renews the lease once, so that the key
    /// lives the lease's whole TTL counted from after the put, however long the caller took
    /// between the grant and the put (a process paused there, a slow answer): a countdown that
    /// must run no shorter than its TTL after every event its put made visible. Returns the
    /// put's revision, as [`put`](Self::put) does.
    ///
    /// # Errors
    /// As [`put`](Self::put); [`KvError::Other`] when the lease ran out before it was renewed
    /// (its key is gone with it).
    pub async fn put_renewed(
        &self,
        lease: LeaseId,
        key: &str,
        value: &[u8],
    ) -> Result<u64, KvError> {
        self.put_renewed_replacing(lease, key, value, &[], &[], false)
            .await
    }

    /// As [`put_renewed`](Self::put_renewed), for a key whose every value lives on a lease of
    /// its own (a countdown started again replaces the one before): once the key is on `lease`,
    /// the lease it was on before is revoked if no key is attached to it any more, so a replaced
    /// countdown's lease does not run on, holding nothing, until its TTL. Revoking is best
    /// effort: a lease that cannot be revoked (already gone, etcd busy) expires by its TTL.
    ///
    /// # Errors
    /// As [`put_renewed`](Self::put_renewed); never for the revocation.
    pub async fn put_renewed_revoking_the_replaced_lease(
        &self,
        lease: LeaseId,
        key: &str,
        value: &[u8],
    ) -> Result<u64, KvError> {
        self.put_renewed_replacing(lease, key, value, &[], &[], true)
            .await
    }

    /// As [`put_renewed_revoking_the_replaced_lease`](Self::put_renewed_revoking_the_replaced_lease),
    /// only while every condition of `guard` holds, tested in the put's own transaction: a
    /// countdown that must not replace one started after its caller looked.
    ///
    /// # Errors
    /// As [`put_renewed`](Self::put_renewed); [`KvError::Conflict`] naming the first condition of
    /// `guard` that does not hold (nothing is written, `lease` is left as it is).
    ///
    /// `also` are written in the same transaction, without the lease.
    pub async fn put_renewed_if(
        &self,
        lease: LeaseId,
        key: &str,
        value: &[u8],
        guard: &[Condition],
        also: &[Op],
    ) -> Result<u64, KvError> {
        self.put_renewed_replacing(lease, key, value, guard, also, true)
            .await
    }

    async fn put_renewed_replacing(
        &self,
        lease: LeaseId,
        key: &str,
        value: &[u8],
        guard: &[Condition],
        also: &[Op],
        revoke_replaced: bool,
    ) -> Result<u64, KvError> {
        let (revision, previous) = self
            .put_returning_previous_lease(lease, key, value, guard, also)
            .await?;
        if self.open_keep_alive(lease).await?.is_none() {
            return Err(KvError::other(format!(
                "the lease of {key} ran out before it could be renewed"
            )));
        }
        if let Some(replaced) = previous.filter(|&previous| revoke_replaced && previous != lease) {
            self.revoke_if_it_holds_no_key(replaced, key).await;
        }
        Ok(revision)
    }

    /// Revokes `lease` when etcd says no key is attached to it (a lease still holding a key is
    /// someone's: it is left alone). Failures are logged, not returned.
    async fn revoke_if_it_holds_no_key(&self, lease: LeaseId, key: &str) {
        let mut client = self.client.clone();
        let holds_nothing = match self
            .bounded(
                Kind::Read,
                client.lease_time_to_live(lease, Some(LeaseTimeToLiveOptions::new().with_keys())),
            )
            .await
        {
            // A TTL of -1: the lease is gone already.
            Ok(answer) => answer.ttl() >= 0 && answer.keys().is_empty(),
            Err(e) => {
                tracing::debug!(key, lease, "could not look at a replaced lease: {e}");
                false
            }
        };
        if holds_nothing {
            if let Err(e) = self.revoke(lease).await {
                tracing::debug!(
                    key,
                    lease,
                    "could not revoke a replaced lease (it expires after its TTL): {e}"
                );
            }
        }
    }

    /// Creates `key` = `value` on `lease` if no key is there (one etcd transaction), and says who
    /// holds it afterwards: the lease key of a leader election.
    ///
    /// # Errors
    /// As [`grant`](Self::grant).
    pub async fn acquire(
        &self,
        lease: LeaseId,
        key: &str,
        value: &[u8],
    ) -> Result<Holder, KvError> {
        let full = self.full_key(key)?;
        let txn = Txn::new()
            .when([Compare::create_revision(full.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                full.clone(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(full, Some(GetOptions::new()))]);
        let mut client = self.client.clone();
        let response = self.bounded(Kind::Write, client.txn(txn)).await?;
        if response.succeeded() {
            let revision = response.header().map(|h| h.revision()).unwrap_or(0);
            return Ok(Holder::Mine {
                revision: u64::try_from(revision).unwrap_or(0),
            });
        }
        for answer in response.op_responses() {
            if let TxnOpResponse::Get(got) = answer {
                if let Some(kv) = got.kvs().first() {
                    return Ok(if kv.lease() == lease {
                        Holder::Mine {
                            revision: u64::try_from(kv.mod_revision()).unwrap_or(0),
                        }
                    } else {
                        Holder::Other {
                            value: kv.value().to_vec(),
                        }
                    });
                }
            }
        }
        // Deleted between the comparison and the read: nobody holds it; the next call takes it.
        Ok(Holder::Other { value: Vec::new() })
    }

    /// Revokes `lease`: every key attached to it is deleted at once.
    ///
    /// # Errors
    /// As [`grant`](Self::grant).
    pub async fn revoke(&self, lease: LeaseId) -> Result<(), KvError> {
        let mut client = self.client.clone();
        self.bounded(Kind::Write, client.lease_revoke(lease))
            .await
            .map(|_| ())
    }

    /// Opens a keep-alive stream for `lease`; `None` when etcd says the lease is gone (the client
    /// library checks the first renewal's TTL itself and reports a gone lease as an error).
    async fn open_keep_alive(
        &self,
        lease: LeaseId,
    ) -> Result<Option<(LeaseKeeper, LeaseKeepAliveStream)>, KvError> {
        let mut client = self.client.clone();
        match tokio::time::timeout(self.request_timeout, client.lease_keep_alive(lease)).await {
            Ok(Ok(stream)) => Ok(Some(stream)),
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(message)))
                if message.contains("lease not found") =>
            {
                Ok(None)
            }
            Ok(Err(e)) => Err(map_error(e, Kind::Read, &self.endpoints)),
            Err(_) => Err(KvError::unavailable(format!(
                "etcd at {}: no answer within {:?}",
                self.endpoints, self.request_timeout
            ))),
        }
    }
}

/// Where a [`LeasedKey`] stands, published on a watch channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseState {
    /// The lease the key is attached to; `None` while the lease is lost and not yet granted again.
    pub lease: Option<LeaseId>,
    /// Incremented each time a new lease was granted and the key put on it (1 after the start):
    /// a holder of the key's meaning (a registration) writes it again when this changes.
    pub generation: u64,
}

/// A key kept alive on a lease by a background task: keep-alive every TTL/4 to TTL/3 (see
/// [`renewal_period`]); when etcd says the lease is gone (the process was paused, or etcd
/// unreachable, for longer than the TTL), a new lease is granted and the key put on it again,
/// retried at the same period until it succeeds.
#[derive(Debug)]
pub struct LeasedKey {
    state: watch::Receiver<LeaseState>,
    stop: Option<oneshot::Sender<bool>>,
    task: Option<JoinHandle<()>>,
}

impl LeasedKey {
    /// Grants a lease, puts `key` = `value` on it, and keeps it alive in a background task.
    ///
    /// # Errors
    /// When the first grant or put fails (nothing is left behind but a lease that expires).
    pub async fn start(
        session: std::sync::Arc<LeaseSession>,
        key: &str,
        value: Vec<u8>,
    ) -> Result<LeasedKey, KvError> {
        let lease = session.grant().await?;
        session.put(lease, key, &value).await?;
        let (publish, state) = watch::channel(LeaseState {
            lease: Some(lease),
            generation: 1,
        });
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(keep_alive_loop(
            session,
            key.to_owned(),
            value,
            lease,
            publish,
            stopped,
        ));
        Ok(LeasedKey {
            state,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// The lease state, to watch for new leases.
    pub fn watch(&self) -> watch::Receiver<LeaseState> {
        self.state.clone()
    }

    /// The lease the key is attached to now, if any.
    pub fn lease(&self) -> Option<LeaseId> {
        self.state.borrow().lease
    }

    /// Stops keeping the key alive; with `revoke`, revokes the lease so that the key (and every
    /// other key on the lease) is deleted at once, otherwise it expires after the TTL.
    pub async fn stop(mut self, revoke: bool) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(revoke);
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for LeasedKey {
    fn drop(&mut self) {
        // Dropped without `stop`: stop keeping it alive, let it expire.
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn keep_alive_loop(
    session: std::sync::Arc<LeaseSession>,
    key: String,
    value: Vec<u8>,
    first_lease: LeaseId,
    publish: watch::Sender<LeaseState>,
    mut stopped: oneshot::Receiver<bool>,
) {
    let mut lease = Some(first_lease);
    let mut generation = 1;
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    let mut renewed_at = tokio::time::Instant::now();
    loop {
        tokio::select! {
            revoke = &mut stopped => {
                if let (Ok(true), Some(id)) = (revoke, lease) {
                    match session.revoke(id).await {
                        Ok(()) => tracing::info!(key, lease = id, "lease revoked"),
                        Err(e) => tracing::warn!(key, lease = id, "revoking the lease failed (it expires after its TTL): {e}"),
                    }
                }
                return;
            }
            () = tokio::time::sleep(renewal_period(session.ttl(), rand::random::<f64>())) => {}
        }
        match lease {
            Some(id) => match keep_alive_once(&session, id, &mut stream).await {
                Ok(true) => renewed_at = tokio::time::Instant::now(),
                Err(e) if renewed_at.elapsed() > session.ttl() => {
                    // Not renewed for a whole TTL: etcd has let the lease expire by now.
                    tracing::warn!(
                        key,
                        lease = id,
                        "lease not renewed for longer than its TTL ({e}): granting a new one"
                    );
                    lease = None;
                    stream = None;
                    publish.send_replace(LeaseState { lease, generation });
                }
                Ok(false) => {
                    tracing::warn!(
                        key,
                        lease = id,
                        "the lease expired (this process was paused, or etcd out of reach, for \
                         longer than the TTL): granting a new one"
                    );
                    lease = None;
                    stream = None;
                    publish.send_replace(LeaseState { lease, generation });
                }
                Err(e) => {
                    tracing::warn!(key, lease = id, "lease keep-alive failed, retrying: {e}");
                    stream = None;
                }
            },
            None => {
                let renewed = async {
                    let id = session.grant().await?;
                    session.put(id, &key, &value).await?;
                    Ok::<_, KvError>(id)
                };
                match renewed.await {
                    Ok(id) => {
                        renewed_at = tokio::time::Instant::now();
                        generation += 1;
                        lease = Some(id);
                        tracing::info!(key, lease = id, "key put again on a new lease");
                        publish.send_replace(LeaseState { lease, generation });
                    }
                    Err(e) => tracing::warn!(key, "granting a new lease failed, retrying: {e}"),
                }
            }
        }
    }
}

/// How long to wait before the next renewal of a lease of `ttl`: from a third of the TTL down to
/// a quarter, `fraction` (0 to 1, drawn at random for each wait) of the way, and at least 100 ms.
/// Three or more renewals fit in every TTL, and agents started together (a fleet rolled out at
/// once) drift apart instead of renewing together every period.
fn renewal_period(ttl: Duration, fraction: f64) -> Duration {
    let third = ttl / 3;
    let spread = third.saturating_sub(ttl / 4);
    third
        .saturating_sub(spread.mul_f64(fraction.clamp(0.0, 1.0)))
        .max(Duration::from_millis(100))
}

/// One keep-alive round trip on the (re)opened stream: true while the lease lives, false when
/// etcd reports it gone (TTL 0).
async fn keep_alive_once(
    session: &LeaseSession,
    lease: LeaseId,
    stream: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
) -> Result<bool, KvError> {
    if stream.is_none() {
        match session.open_keep_alive(lease).await? {
            Some(opened) => *stream = Some(opened),
            None => return Ok(false),
        }
    }
    let Some((keeper, responses)) = stream.as_mut() else {
        return Err(KvError::other("keep-alive stream missing"));
    };
    session.bounded(Kind::Read, keeper.keep_alive()).await?;
    match session.bounded(Kind::Read, responses.message()).await? {
        Some(response) => Ok(response.ttl() > 0),
        None => Err(KvError::unavailable("etcd closed the keep-alive stream")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewals_come_between_a_quarter_and_a_third_of_the_ttl_spread_by_the_draw() {
        let ttl = Duration::from_secs(30);
        assert_eq!(renewal_period(ttl, 0.0), Duration::from_secs(10));
        assert_eq!(renewal_period(ttl, 1.0), Duration::from_millis(7_500));
        assert_eq!(renewal_period(ttl, 0.5), Duration::from_millis(8_750));
        // A draw outside 0 to 1 cannot leave the range.
        assert_eq!(renewal_period(ttl, -3.0), Duration::from_secs(10));
        assert_eq!(renewal_period(ttl, 7.0), Duration::from_millis(7_500));
        // The shortest TTL: still three renewals or more in it.
        let one = Duration::from_secs(1);
        for fraction in [0.0, 0.3, 0.99, 1.0] {
            let period = renewal_period(one, fraction);
            assert!(
                (Duration::from_millis(250)..=Duration::from_millis(334)).contains(&period),
                "{fraction}: {period:?}"
            );
        }
        // Agents drawing differently wait differently: periods do not line up.
        let periods: std::collections::BTreeSet<Duration> = (0..=10)
            .map(|i| renewal_period(ttl, f64::from(i) / 10.0))
            .collect();
        assert_eq!(periods.len(), 11, "{periods:?}");
    }
}
