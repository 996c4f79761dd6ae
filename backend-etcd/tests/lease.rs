//! `backend_etcd::lease` against a real etcd: a lease key is what the store reads under the same
//! prefix, a create-if-absent key has one holder at a time, revocation deletes the lease's keys,
//! and a lost lease is granted again with the key put back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_etcd::lease::{Holder, LeaseSession, LeasedKey};
use backend_etcd::EtcdStore;
use ipam_core::kv::{Condition, KvError, Op};
use ipam_core::{KvStore, Revision};
use test_kit::etcd::{unique_prefix, EtcdServer, PrefixGuard};

/// Polls `condition` every 50 ms for at most 30 s.
async fn wait_until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The shared etcd, a fresh prefix (deleted when the guard drops), a store over it and a lease
/// session of `ttl` under the same prefix.
async fn under_fresh_prefix(ttl: Duration) -> (PrefixGuard, EtcdStore, LeaseSession) {
    let server = EtcdServer::shared();
    let prefix = unique_prefix();
    let guard = PrefixGuard::new(server.config(&prefix));
    let store = EtcdStore::connect(server.config(&prefix))
        .await
        .expect("connect the store");
    let session = LeaseSession::connect(&server.config(&prefix), ttl)
        .await
        .expect("a lease session");
    (guard, store, session)
}

#[tokio::test]
async fn leader_key_has_one_holder_and_revoking_deletes_it() {
    let (_guard, store, session) = under_fresh_prefix(Duration::from_secs(60)).await;
    let (first, second) = (
        session.grant().await.expect("grant"),
        session.grant().await.expect("grant"),
    );

    let Holder::Mine { revision } = session
        .acquire(first, "leader", b"first")
        .await
        .expect("acquire")
    else {
        panic!("the first acquire of a free key did not get it");
    };
    let stored = store.get("leader").await.expect("get").expect("the key");
    assert_eq!(stored.value, b"first");
    assert_eq!(
        stored.revision.get(),
        revision,
        "the store's revision of the key"
    );
    assert_eq!(
        session
            .acquire(second, "leader", b"second")
            .await
            .expect("acquire"),
        Holder::Other {
            value: b"first".to_vec()
        }
    );
    assert_eq!(
        session
            .acquire(first, "leader", b"first")
            .await
            .expect("acquire"),
        Holder::Mine { revision },
        "the holder acquiring again keeps it, at the same revision"
    );

    session.revoke(first).await.expect("revoke");
    assert!(store.get("leader").await.expect("get").is_none());
    assert!(matches!(
        session
            .acquire(second, "leader", b"second")
            .await
            .expect("acquire"),
        Holder::Mine { .. }
    ));
}

#[tokio::test]
async fn a_lost_lease_is_granted_again_and_the_key_put_back() {
    let (_guard, store, session) = under_fresh_prefix(Duration::from_secs(2)).await;
    let session = Arc::new(session);
    let kept = LeasedKey::start(Arc::clone(&session), "liveness/n1", b"n1".to_vec())
        .await
        .expect("start the leased key");
    let first = kept.lease().expect("a lease");
    let mut state = kept.watch();
    assert_eq!(state.borrow().generation, 1);
    assert_eq!(
        store
            .get("liveness/n1")
            .await
            .expect("get")
            .map(|kv| kv.value),
        Some(b"n1".to_vec())
    );

    // Someone revokes the lease (as its expiry would): the key goes, then comes back on a new
    // lease, and the state says so.
    session.revoke(first).await.expect("revoke");
    assert!(store.get("liveness/n1").await.expect("get").is_none());
    wait_until("the key is put again on a new lease", || {
        let generation = state.borrow_and_update().generation;
        let store = &store;
        async move { generation >= 2 && store.get("liveness/n1").await.ok().flatten().is_some() }
    })
    .await;
    let second = kept.lease().expect("a new lease");
    assert_ne!(second, first);

    // Revoked once the key has been kept alive on its new lease for a while (its keep-alive stream
    // open): the stream's answer says the lease is gone, and the key comes back on a third lease.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(kept.lease(), Some(second), "kept alive on its second lease");
    session.revoke(second).await.expect("revoke");
    wait_until("the key is put again on a third lease", || {
        let generation = state.borrow_and_update().generation;
        let store = &store;
        async move { generation >= 3 && store.get("liveness/n1").await.ok().flatten().is_some() }
    })
    .await;
    assert_ne!(kept.lease(), Some(second));

    // A clean stop with revocation deletes it at once.
    kept.stop(true).await;
    assert!(store.get("liveness/n1").await.expect("get").is_none());
}

/// The TTL etcd says `lease` has left, in whole seconds (-1 once it is gone).
async fn seconds_left(endpoints: &[String], lease: i64) -> i64 {
    let mut client = etcd_client::Client::connect(endpoints, None)
        .await
        .expect("connect a client");
    client
        .lease_time_to_live(lease, None)
        .await
        .expect("the lease's time to live")
        .ttl()
}

#[tokio::test]
async fn a_key_put_renewed_lives_the_whole_ttl_from_its_put_not_from_the_grant() {
    let (_guard, store, session) = under_fresh_prefix(Duration::from_secs(60)).await;
    let endpoints = [EtcdServer::shared().endpoint()];

    // Granted, then put 3 s later (a caller paused between the two): the plain put leaves the
    // lease counting from the grant, the renewed put restarts it at the full TTL.
    let plain = session
        .grant_for(Duration::from_secs(60))
        .await
        .expect("grant");
    let renewed = session
        .grant_for(Duration::from_secs(60))
        .await
        .expect("grant");
    tokio::time::sleep(Duration::from_secs(3)).await;
    session
        .put(plain, "countdown/plain", b"plain")
        .await
        .expect("put");
    let revision = session
        .put_renewed(renewed, "countdown/renewed", b"renewed")
        .await
        .expect("put renewed");
    // The renewed lease is read first: a stall between the two reads only widens the gap, and
    // the renewed one restarted some 3 s after the plain one's grant.
    let renewed_left = seconds_left(&endpoints, renewed).await;
    let plain_left = seconds_left(&endpoints, plain).await;
    assert!(plain_left <= 57, "plain put: {plain_left} s left");
    assert!(
        renewed_left >= plain_left + 2,
        "renewed put: {renewed_left} s left, plain put: {plain_left} s left"
    );
    let stored = store
        .get("countdown/renewed")
        .await
        .expect("get")
        .expect("the key");
    assert_eq!(stored.value, b"renewed");
    assert_eq!(stored.revision.get(), revision, "the put's revision");

    // A lease gone before the put: refused, nothing stored.
    session.revoke(plain).await.expect("revoke");
    assert!(session
        .put_renewed(plain, "countdown/late", b"late")
        .await
        .is_err());
    assert!(store.get("countdown/late").await.expect("get").is_none());
    session.revoke(renewed).await.expect("revoke");
}

/// A countdown started again on its key revokes the lease of the one it replaced (which then
/// holds nothing) instead of leaving it to run out; a replaced lease that still holds another key
/// is left alone, and so is a previous value put without a lease. The plain `put_renewed` revokes
/// nothing.
#[tokio::test]
async fn a_countdown_put_again_revokes_the_lease_it_replaced_when_that_holds_nothing() {
    let (_guard, store, session) = under_fresh_prefix(Duration::from_secs(60)).await;
    let endpoints = [EtcdServer::shared().endpoint()];
    let grant = || session.grant_for(Duration::from_secs(60));

    let first = grant().await.expect("grant");
    session
        .put_renewed_revoking_the_replaced_lease(first, "countdown/n1", b"first")
        .await
        .expect("the first countdown");
    let second = grant().await.expect("grant");
    let revision = session
        .put_renewed_revoking_the_replaced_lease(second, "countdown/n1", b"second")
        .await
        .expect("the countdown started again");
    assert_eq!(
        seconds_left(&endpoints, first).await,
        -1,
        "the replaced lease runs on"
    );
    assert!(seconds_left(&endpoints, second).await > 0);
    let stored = store
        .get("countdown/n1")
        .await
        .expect("get")
        .expect("the key");
    assert_eq!(
        (stored.value.as_slice(), stored.revision.get()),
        (b"second".as_slice(), revision)
    );

    // The replaced lease still holds another key: someone's, left alone.
    let shared = grant().await.expect("grant");
    session
        .put(shared, "other/kept", b"kept")
        .await
        .expect("another key on the lease");
    session
        .put_renewed_revoking_the_replaced_lease(shared, "countdown/n2", b"first")
        .await
        .expect("a countdown on the shared lease");
    let third = grant().await.expect("grant");
    session
        .put_renewed_revoking_the_replaced_lease(third, "countdown/n2", b"second")
        .await
        .expect("the countdown started again");
    assert!(
        seconds_left(&endpoints, shared).await > 0,
        "a lease holding a key was revoked"
    );
    assert!(store.get("other/kept").await.expect("get").is_some());

    // A value without a lease (a reclaim's kept record) is replaced, nothing revoked; the plain
    // put_renewed leaves the lease it replaced running.
    store
        .put("countdown/n3", b"kept".to_vec())
        .await
        .expect("a value without a lease");
    let fourth = grant().await.expect("grant");
    session
        .put_renewed_revoking_the_replaced_lease(fourth, "countdown/n3", b"countdown")
        .await
        .expect("a countdown over a value without a lease");
    let fifth = grant().await.expect("grant");
    session
        .put_renewed(fifth, "countdown/n3", b"plain")
        .await
        .expect("a plain renewed put");
    assert!(
        seconds_left(&endpoints, fourth).await > 0,
        "put_renewed revoked a lease"
    );
    for lease in [second, shared, third, fourth, fifth] {
        session.revoke(lease).await.expect("revoke");
    }
}

/// A guarded countdown is put, renewed and replaces the one before only while its guard holds
/// in the put's own transaction: a guard that does not hold names its first failed condition and
/// writes nothing (the countdown there keeps its value, revision and lease). The keys written
/// with it are written in the same transaction, without its lease, or not at all.
#[tokio::test]
async fn a_guarded_countdown_is_put_only_while_its_guard_holds() {
    let (_guard, store, session) = under_fresh_prefix(Duration::from_secs(60)).await;
    let endpoints = [EtcdServer::shared().endpoint()];
    let grant = || session.grant_for(Duration::from_secs(60));
    let registration = store
        .put("agents/n1", b"registered".to_vec())
        .await
        .expect("a registration");

    // Holding: the key absent, the registration at its revision, nothing under "live/".
    let first = grant().await.expect("grant");
    let revision = session
        .put_renewed_if(
            first,
            "countdown/n1",
            b"first",
            &[
                Condition::absent("countdown/n1"),
                Condition::at_revision("agents/n1", registration),
                Condition::no_put_after("live/", registration),
            ],
            &[Op::put("generation/n1", b"countdown".to_vec())],
        )
        .await
        .expect("a countdown whose guard holds");
    assert!(seconds_left(&endpoints, first).await > 0);
    let generation = store
        .get("generation/n1")
        .await
        .expect("get")
        .expect("written with the countdown");
    assert_eq!(
        (generation.value.as_slice(), generation.revision.get()),
        (b"countdown".as_slice(), revision)
    );

    // Not holding: the first condition that fails is named, in the guard's order.
    let registered_again = store
        .put("agents/n1", b"registered again".to_vec())
        .await
        .expect("the registration rewritten");
    for (guard, failed) in [
        (
            vec![
                Condition::at_revision("countdown/n1", Revision(revision)),
                Condition::at_revision("agents/n1", registration),
            ],
            "agents/n1",
        ),
        (
            vec![
                Condition::at_revision("agents/n1", registered_again),
                Condition::absent("countdown/n1"),
            ],
            "countdown/n1",
        ),
    ] {
        let second = grant().await.expect("grant");
        match session
            .put_renewed_if(
                second,
                "countdown/n1",
                b"second",
                &guard,
                &[Op::put("generation/n1", b"refused".to_vec())],
            )
            .await
        {
            Err(KvError::Conflict { key }) => assert_eq!(key, failed),
            other => panic!("a guard that does not hold answered {other:?}"),
        }
        session.revoke(second).await.expect("revoke");
    }
    let stored = store
        .get("countdown/n1")
        .await
        .expect("get")
        .expect("the countdown");
    assert_eq!(
        (stored.value.as_slice(), stored.revision.get()),
        (b"first".as_slice(), revision),
        "a refused countdown wrote"
    );
    assert!(
        seconds_left(&endpoints, first).await > 0,
        "a refused countdown revoked the one it did not replace"
    );
    assert_eq!(
        store.get("generation/n1").await.expect("get"),
        Some(generation.clone()),
        "a refused countdown wrote beside it"
    );

    // Holding again, against the countdown seen: replaced, the replaced lease revoked.
    let third = grant().await.expect("grant");
    session
        .put_renewed_if(
            third,
            "countdown/n1",
            b"third",
            &[Condition::at_revision("countdown/n1", Revision(revision))],
            &[
                Op::put("generation/n1", b"replaced".to_vec()),
                Op::delete("other/n1"),
            ],
        )
        .await
        .expect("a countdown replacing the one it saw");
    assert_eq!(seconds_left(&endpoints, first).await, -1);
    assert_eq!(
        store
            .get("countdown/n1")
            .await
            .expect("get")
            .expect("the countdown")
            .value,
        b"third"
    );
    session.revoke(third).await.expect("revoke");
    // Not on the lease: its end takes the countdown only.
    assert_eq!(store.get("countdown/n1").await.expect("get"), None);
    assert_eq!(
        store
            .get("generation/n1")
            .await
            .expect("get")
            .expect("the generation outlives the lease")
            .value,
        b"replaced"
    );
}

#[tokio::test]
async fn a_lease_ttl_is_a_whole_number_of_seconds_at_least_one() {
    let server = EtcdServer::shared();
    let config = server.config(&unique_prefix());
    for refused in [
        Duration::ZERO,
        Duration::from_millis(500),
        Duration::from_millis(1_500),
        Duration::from_nanos(60_000_000_001),
    ] {
        match LeaseSession::connect(&config, refused).await {
            Err(KvError::InvalidArgument { message }) => assert!(
                message.contains("a lease TTL is a whole number of seconds, at least 1"),
                "{refused:?}: {message}"
            ),
            other => panic!("a TTL of {refused:?} was not refused: {other:?}"),
        }
    }
    let session = LeaseSession::connect(&config, Duration::from_secs(1))
        .await
        .expect("one second is a TTL");
    assert_eq!(session.ttl(), Duration::from_secs(1));
    // What a log line shows of a session: where it connects and under which prefix, with its TTL.
    let shown = format!("{session:?}");
    for part in ["LeaseSession", &server.endpoint(), &config.prefix, "1s"] {
        assert!(shown.contains(part), "{part:?} missing from {shown}");
    }
}

#[tokio::test]
async fn a_leased_key_dropped_without_a_stop_is_no_longer_kept_alive_and_expires() {
    let (_guard, store, session) = under_fresh_prefix(Duration::from_secs(2)).await;
    let kept = LeasedKey::start(Arc::new(session), "liveness/dropped", b"n2".to_vec())
        .await
        .expect("start the leased key");
    assert!(store.get("liveness/dropped").await.expect("get").is_some());
    // Dropped (a process's state torn down without a clean stop): nothing revokes the lease, and
    // nothing renews it either, so etcd deletes the key once the TTL has run out.
    drop(kept);
    wait_until("the dropped key expires", || {
        let store = &store;
        async move { store.get("liveness/dropped").await.ok().flatten().is_none() }
    })
    .await;
}

/// Sends `signal` (`STOP`, `CONT`) to the private etcd `server`.
fn signal(server: &EtcdServer, signal: &str) {
    let pid = server.pid().expect("etcd runs");
    let status = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// A private etcd (to pause), its configuration with `request_timeout`, and `key` kept alive there
/// on leases of `ttl`.
async fn kept_on_a_private_etcd(
    ttl: Duration,
    request_timeout: Duration,
    key: &str,
) -> (EtcdServer, backend_etcd::EtcdConfig, LeasedKey) {
    let server = EtcdServer::start().expect("a private etcd");
    let config = backend_etcd::EtcdConfig {
        request_timeout,
        connect_timeout: Duration::from_millis(500),
        ..server.config(&unique_prefix())
    };
    let session = LeaseSession::connect(&config, ttl)
        .await
        .expect("a session");
    let kept = LeasedKey::start(Arc::new(session), key, key.as_bytes().to_vec())
        .await
        .expect("start the leased key");
    (server, config, kept)
}

/// The value stored at `key`, through a new store on `config`.
async fn stored(config: backend_etcd::EtcdConfig, key: &str) -> Option<Vec<u8>> {
    let store = EtcdStore::connect(config).await.expect("connect the store");
    store.get(key).await.expect("get").map(|kv| kv.value)
}

#[tokio::test]
async fn keep_alives_failing_for_less_than_the_ttl_keep_the_lease_and_its_key() {
    // A private etcd, paused (SIGSTOP: its connections accept, nothing answers) for longer than a
    // keep-alive period (5 s) and shorter than the TTL (15 s).
    let (server, config, kept) = kept_on_a_private_etcd(
        Duration::from_secs(15),
        Duration::from_secs(1),
        "liveness/n3",
    )
    .await;
    let first = kept.lease().expect("a lease");
    let state = kept.watch();

    signal(&server, "STOP");
    tokio::time::sleep(Duration::from_secs(7)).await;
    signal(&server, "CONT");
    // The keep-alive at 5 s failed; the lease is not given up for that (not a whole TTL without
    // renewal), nor at the next keep-alive, after the pause.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !state.has_changed().expect("the keep-alive task runs"),
        "the lease state changed: {:?}",
        *state.borrow()
    );
    assert_eq!(kept.lease(), Some(first), "the same lease kept");
    assert_eq!(
        stored(config, "liveness/n3").await,
        Some(b"liveness/n3".to_vec())
    );
    kept.stop(true).await;
}

#[tokio::test]
async fn a_leased_key_outlives_its_ttl_many_times_while_kept_alive() {
    let (_guard, store, session) = under_fresh_prefix(Duration::from_secs(3)).await;
    let kept = LeasedKey::start(Arc::new(session), "liveness/kept", b"n4".to_vec())
        .await
        .expect("start the leased key");
    let first = kept.lease().expect("a lease");
    let state = kept.watch();
    // Two and a half TTLs: the key is there at every look, on its first lease.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(
            store.get("liveness/kept").await.expect("get").is_some(),
            "the key expired while kept alive"
        );
    }
    assert!(!state.has_changed().expect("the keep-alive task runs"));
    assert_eq!(kept.lease(), Some(first));
    kept.stop(true).await;
}

#[tokio::test]
async fn keep_alives_failing_for_longer_than_the_ttl_give_the_lease_up_then_a_new_one_is_granted() {
    // A private etcd, paused (SIGSTOP) until the key's holder has given its lease up: no
    // keep-alive answered for a whole TTL (3 s) means etcd has let the lease expire by now.
    let (server, config, kept) = kept_on_a_private_etcd(
        Duration::from_secs(3),
        Duration::from_millis(500),
        "liveness/n5",
    )
    .await;
    let mut state = kept.watch();

    signal(&server, "STOP");
    wait_until("the lease is given up while etcd does not answer", || {
        let lease = state.borrow_and_update().lease;
        async move { lease.is_none() }
    })
    .await;
    signal(&server, "CONT");
    wait_until("the key is put again on a new lease", || {
        let now = *state.borrow_and_update();
        async move { now.lease.is_some() && now.generation == 2 }
    })
    .await;
    assert_eq!(
        stored(config.clone(), "liveness/n5").await,
        Some(b"liveness/n5".to_vec())
    );
    kept.stop(true).await;
    assert_eq!(stored(config, "liveness/n5").await, None, "revoked at stop");
}
