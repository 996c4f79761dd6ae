//! The etcd store against real etcd processes, one server (or cluster) per test: outages and
//! restarts, prefixes, unreachable and silent endpoints, leader loss, compaction under a long read,
//! TLS, authentication, and the test helpers' own clean-up.

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use backend_etcd::{EtcdConfig, EtcdStore};
use conformance::StoreFactory;
use ipam_core::kv::{Read, ReadResult};
use ipam_core::{KvError, KvStore, Revision};
use test_kit::etcd::{
    unique_prefix, EtcdCluster, EtcdFactory, EtcdServer, EtcdServerOptions, TestPki,
};

/// Short timeouts so that outages are reported quickly.
fn quick(config: EtcdConfig) -> EtcdConfig {
    config.with_timeouts(Duration::from_secs(1), Duration::from_secs(3))
}

fn start_server() -> EtcdServer {
    EtcdServer::start().unwrap_or_else(|e| panic!("cannot start etcd: {e}"))
}

async fn connect(config: EtcdConfig) -> EtcdStore {
    EtcdStore::connect(config)
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"))
}

fn assert_unavailable<T: std::fmt::Debug>(what: &str, result: Result<T, KvError>) {
    match result {
        Err(KvError::Unavailable { .. }) => {}
        other => panic!("{what}: expected Unavailable, got {other:?}"),
    }
}

/// A loopback port nobody listens on.
fn unused_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

async fn keys(store: &EtcdStore, prefix: &str) -> Vec<String> {
    store
        .list(prefix)
        .await
        .expect("list")
        .into_iter()
        .map(|kv| kv.key)
        .collect()
}

/// Puts `key`, retrying while the store is unavailable (an election, a dead endpoint).
async fn put_through_outage(
    store: &EtcdStore,
    key: &str,
    value: &[u8],
) -> Result<Revision, KvError> {
    let mut tries = 0;
    loop {
        tries += 1;
        match store.put(key, value.to_vec()).await {
            Err(e) if e.is_retryable() && tries < 100 => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => return other,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_is_unavailable_while_etcd_is_stopped_and_works_after_restart() {
    let mut server = start_server();
    let store = connect(quick(server.config("/outage/"))).await;
    let kept = store.put("kept", b"before".to_vec()).await.expect("put");

    server.stop();
    assert!(!server.is_running());
    assert_unavailable("get while stopped", store.get("kept").await);
    assert_unavailable("list while stopped", store.list("").await);
    assert_unavailable(
        "read_many while stopped",
        store.read_many(&[Read::Get("kept".into())]).await,
    );
    // Nothing can have been sent: the write is reported as not done, not as indeterminate.
    assert_unavailable("put while stopped", store.put("lost", b"x".to_vec()).await);

    server.restart().expect("restart etcd");
    let kv = store
        .get("kept")
        .await
        .expect("get after restart")
        .expect("the key written before the outage survived");
    assert_eq!(kv.value, b"before");
    assert_eq!(kv.revision, kept);
    assert_eq!(store.get("lost").await.expect("get"), None);
    let after = store
        .put("after", b"x".to_vec())
        .await
        .expect("put after restart");
    assert!(after > kept);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_with_different_prefixes_do_not_see_each_other() {
    let server = start_server();
    let a = connect(server.config("/tenant-a/")).await;
    let b = connect(server.config("/tenant-b/")).await;
    a.put("shared/key", b"a".to_vec()).await.expect("put a");
    b.put("shared/key", b"b".to_vec()).await.expect("put b");
    a.put("only-a", b"a".to_vec()).await.expect("put a");

    assert_eq!(
        a.get("shared/key").await.expect("get").expect("a").value,
        b"a"
    );
    assert_eq!(
        b.get("shared/key").await.expect("get").expect("b").value,
        b"b"
    );
    assert_eq!(b.get("only-a").await.expect("get"), None);
    assert_eq!(keys(&a, "").await, ["only-a", "shared/key"]);
    assert_eq!(keys(&b, "").await, ["shared/key"]);
    // A condition on one store's key says nothing about the other's.
    b.create("only-a", b"b".to_vec())
        .await
        .expect("b can create a key that only exists under a's prefix");

    // The raw key space holds both, each under its own prefix.
    let raw = connect(server.config("")).await;
    assert_eq!(
        keys(&raw, "/tenant-").await,
        [
            "/tenant-a/only-a",
            "/tenant-a/shared/key",
            "/tenant-b/only-a",
            "/tenant-b/shared/key"
        ]
    );

    assert_eq!(b.delete_all().await.expect("delete_all"), 2);
    assert!(keys(&b, "").await.is_empty());
    assert_eq!(keys(&a, "").await, ["only-a", "shared/key"]);
    assert!(matches!(
        raw.delete_all().await,
        Err(KvError::InvalidArgument { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_endpoint_is_unavailable_not_a_hang() {
    let port = unused_port();
    let config = EtcdConfig::new([format!("127.0.0.1:{port}")])
        .with_prefix("/x/")
        .with_timeouts(Duration::from_millis(500), Duration::from_secs(2));
    match EtcdStore::connect(config.clone()).await {
        Err(KvError::Unavailable { message }) => {
            assert!(message.contains(&port.to_string()), "{message}")
        }
        other => panic!("expected Unavailable from connect, got {other:?}"),
    }
    let lazy = EtcdStore::connect_lazy(config).expect("valid configuration");
    assert_unavailable("get", lazy.get("k").await);
    assert_unavailable("list", lazy.list("").await);
    assert_unavailable("put", lazy.put("k", b"v".to_vec()).await);
}

/// A store on `endpoints` under a fresh prefix, connecting on first use, with short timeouts.
fn lazy_store<const N: usize>(endpoints: [String; N]) -> EtcdStore {
    EtcdStore::connect_lazy(quick(
        EtcdConfig::new(endpoints).with_prefix(unique_prefix()),
    ))
    .expect("valid configuration")
}

/// An endpoint that closes every connection, listed before a live one, costs the first read one
/// attempt: the read moves on and succeeds, and every later call, read or write, starts at the
/// live endpoint (the closing one is never connected to again). An endpoint nobody listens on,
/// listed first, costs even a first write only the attempt: nothing was sent there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_endpoint_costs_one_attempt_and_later_calls_start_at_the_next() {
    let server = start_server();
    // Accepts each connection and closes it at once, counting them.
    let closing = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let closing_port = closing.local_addr().expect("address").port();
    let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = Arc::clone(&connections);
    let closer = tokio::spawn(async move {
        while let Ok((stream, _)) = closing.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(stream);
        }
    });
    let store = lazy_store([format!("127.0.0.1:{closing_port}"), server.endpoint()]);
    assert_eq!(
        store
            .get("first")
            .await
            .expect("the first read moves on to the live endpoint"),
        None
    );
    let tried = connections.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        tried >= 1,
        "the first read never tried the closing endpoint"
    );
    for i in 0..10u8 {
        store.put("later", vec![i]).await.expect("a later write");
        assert_eq!(
            store
                .get("later")
                .await
                .expect("a later read")
                .map(|kv| kv.value),
            Some(vec![i])
        );
    }
    assert_eq!(
        connections.load(std::sync::atomic::Ordering::SeqCst),
        tried,
        "later calls went back to the closing endpoint"
    );
    // Alone, the closing endpoint fails a listing and a batch with its own error, named.
    let alone = lazy_store([format!("127.0.0.1:{closing_port}")]);
    for (what, outcome) in [
        ("list", alone.list("").await.map(|_| ())),
        (
            "read_many",
            alone
                .read_many(&[Read::List(String::new())])
                .await
                .map(|_| ()),
        ),
    ] {
        match outcome {
            Err(KvError::Unavailable { message })
                if message.contains(&closing_port.to_string()) => {}
            other => panic!("{what}: expected the endpoint's own error, got {other:?}"),
        }
    }
    // A listing of a prefix no key can start with (NUL) answers empty without asking etcd.
    assert_eq!(
        alone.list("k/\0").await.expect("list, not asked"),
        Vec::new()
    );
    assert_eq!(
        alone
            .read_many(&[Read::List("k/\0".into()), Read::range("k/\0", "", 5)])
            .await
            .expect("read_many, not asked"),
        vec![
            ReadResult::Listed(Vec::new()),
            ReadResult::Listed(Vec::new())
        ]
    );
    closer.abort();

    let refused = lazy_store([format!("127.0.0.1:{}", unused_port()), server.endpoint()]);
    refused
        .put("first", b"1".to_vec())
        .await
        .expect("a first write moves on past an endpoint that refuses connections");
    assert_eq!(
        refused.get("first").await.expect("read").map(|kv| kv.value),
        Some(b"1".to_vec())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_endpoint_times_out_reads_unavailable_and_writes_indeterminate() {
    // Accepts TCP connections (the kernel does, from the backlog) but never speaks.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("address").port();
    let store = EtcdStore::connect_lazy(
        EtcdConfig::new([format!("127.0.0.1:{port}")])
            .with_prefix("/x/")
            .with_timeouts(Duration::from_millis(500), Duration::from_secs(1)),
    )
    .expect("valid configuration");
    assert_unavailable("get", store.get("k").await);
    match store.put("k", b"v".to_vec()).await {
        Err(KvError::Indeterminate { .. }) => {}
        other => panic!("a write with no answer must be Indeterminate, got {other:?}"),
    }
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_continue_after_the_leader_is_killed_and_no_acknowledged_write_is_lost() {
    let mut cluster = EtcdCluster::start(3).unwrap_or_else(|e| panic!("cannot start cluster: {e}"));
    let prefix = unique_prefix();
    let store = Arc::new(
        connect(quick(
            EtcdConfig::new(cluster.endpoints()).with_prefix(prefix.clone()),
        ))
        .await,
    );

    let mut acknowledged: Vec<(String, Revision)> = Vec::new();
    let mut uncertain: Vec<String> = Vec::new();
    let mut last = Revision::NONE;
    let mut write = |key: String, result: Result<Revision, KvError>| match result {
        Ok(revision) => {
            assert!(revision > last, "revision {revision} after {last}");
            last = revision;
            acknowledged.push((key, revision));
        }
        Err(KvError::Indeterminate { .. }) => uncertain.push(key),
        Err(e) => panic!("write of {key} failed: {e}"),
    };

    for i in 0..20 {
        let key = format!("before/{i:03}");
        let result = put_through_outage(&store, &key, key.as_bytes()).await;
        write(key, result);
    }
    let leader = cluster
        .wait_for_leader(Duration::from_secs(10))
        .expect("a leader");
    cluster.member_mut(leader).stop();
    for i in 0..40 {
        let key = format!("after/{i:03}");
        let result = put_through_outage(&store, &key, key.as_bytes()).await;
        write(key, result);
    }
    assert!(
        acknowledged
            .iter()
            .filter(|(k, _)| k.starts_with("after/"))
            .count()
            >= 35,
        "too few writes acknowledged after the election: {uncertain:?} uncertain"
    );

    // Every acknowledged write is there with its revision; uncertain ones may or may not be.
    let stored: std::collections::HashMap<String, (Vec<u8>, Revision)> = store
        .list("")
        .await
        .expect("list")
        .into_iter()
        .map(|kv| (kv.key, (kv.value, kv.revision)))
        .collect();
    for (key, revision) in &acknowledged {
        let (value, stored_revision) = stored
            .get(key)
            .unwrap_or_else(|| panic!("acknowledged write {key} was lost"));
        assert_eq!(value, key.as_bytes());
        assert_eq!(stored_revision, revision);
    }
    assert_eq!(
        stored.len(),
        acknowledged.len() + uncertain.iter().filter(|k| stored.contains_key(*k)).count()
    );

    // The killed member comes back, catches up, and serves the same data.
    cluster
        .member_mut(leader)
        .restart()
        .expect("restart the old leader");
    let rejoined = connect(quick(
        EtcdConfig::new([cluster.members()[leader].endpoint()]).with_prefix(prefix),
    ))
    .await;
    for (key, revision) in &acknowledged {
        let kv = rejoined
            .get(key)
            .await
            .expect("get through the rejoined member")
            .unwrap_or_else(|| panic!("{key} missing on the rejoined member"));
        assert_eq!(kv.revision, *revision);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_client_certificates_works_and_is_required() {
    let pki = TestPki::generate().unwrap_or_else(|e| panic!("cannot make certificates: {e}"));
    let server = EtcdServer::start_with(EtcdServerOptions {
        tls: Some(pki.server_tls(true)),
        ..EtcdServerOptions::default()
    })
    .unwrap_or_else(|e| panic!("cannot start etcd with TLS: {e}"));
    assert!(server.endpoint().starts_with("https://"));

    let config = server
        .config(&unique_prefix())
        .with_ca_cert(pki.ca_cert())
        .with_client_cert(pki.client_cert(), pki.client_key());
    let store = connect(config.clone()).await;
    let rev = store
        .create("k", b"v".to_vec())
        .await
        .expect("create over TLS");
    let kv = store
        .get("k")
        .await
        .expect("get over TLS")
        .expect("present");
    assert_eq!((kv.value.as_slice(), kv.revision), (&b"v"[..], rev));

    // A bare host:port with TLS files means https.
    let port = server
        .endpoint()
        .rsplit(':')
        .next()
        .map(str::to_owned)
        .expect("port");
    let mut bare = config.clone();
    bare.endpoints = vec![format!("127.0.0.1:{port}")];
    assert!(connect(bare).await.get("k").await.expect("get").is_some());

    // Without a client certificate, or trusting another CA, nothing works.
    let no_client_cert = quick(server.config(&unique_prefix()).with_ca_cert(pki.ca_cert()));
    assert!(
        EtcdStore::connect(no_client_cert).await.is_err(),
        "connected without a client certificate"
    );
    let other = TestPki::generate().expect("second PKI");
    let mut wrong_ca = quick(config);
    wrong_ca.ca_cert_file = Some(other.ca_cert());
    assert!(
        EtcdStore::connect(wrong_ca).await.is_err(),
        "connected trusting the wrong CA"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_a_clear_permanent_error() {
    let server = start_server();
    let mut admin = etcd_client::Client::connect([server.endpoint()], None)
        .await
        .expect("raw client");
    admin.role_add("root").await.expect("add root role");
    admin
        .user_add("root", "s3cret", None)
        .await
        .expect("add root user");
    admin
        .user_grant_role("root", "root")
        .await
        .expect("grant root role");
    admin.auth_enable().await.expect("enable auth");

    let prefix = unique_prefix();
    let store = connect(server.config(&prefix).with_credentials("root", "s3cret")).await;
    store
        .put("k", b"v".to_vec())
        .await
        .expect("put with credentials");

    match EtcdStore::connect(server.config(&prefix).with_credentials("root", "wrong")).await {
        Err(KvError::Other { message }) => {
            assert!(message.contains("user name or password"), "{message}")
        }
        other => panic!("expected Other for a wrong password, got {other:?}"),
    }
    match EtcdStore::connect(server.config(&prefix)).await {
        Err(KvError::Other { .. }) => {}
        other => panic!("expected Other without credentials, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_many_reads_every_key_and_prefix_from_one_snapshot() {
    let server = start_server();
    let store = connect(server.config(&unique_prefix())).await;
    let mut reads = Vec::new();
    for i in 0..150 {
        let key = format!("k/{i:03}");
        store.put(&key, vec![1]).await.expect("put");
        reads.push(Read::Get(key));
    }
    reads.push(Read::List("k/".into()));
    // More reads than one etcd transaction may carry: answered in batches at one revision.
    let results = store.read_many(&reads).await.expect("read_many");
    assert_eq!(results.len(), 151);
    for (i, result) in results[..150].iter().enumerate() {
        match result {
            ReadResult::Got(Some(kv)) => assert_eq!(kv.key, format!("k/{i:03}")),
            other => panic!("read {i}: {other:?}"),
        }
    }
    match &results[150] {
        ReadResult::Listed(kvs) => assert_eq!(kvs.len(), 150),
        other => panic!("list: {other:?}"),
    }
    // No key contains NUL, so a prefix with one lists nothing, in place.
    let results = store
        .read_many(&[Read::List("k/\0".into()), Read::Get("k/000".into())])
        .await
        .expect("read_many");
    assert_eq!(results[0], ReadResult::Listed(Vec::new()));
    assert!(matches!(&results[1], ReadResult::Got(Some(kv)) if kv.key == "k/000"));
    assert!(store.list("k/\0").await.expect("list").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_over_etcds_request_limit_is_invalid_argument_and_writes_nothing() {
    // Each value is within MAX_VALUE_BYTES, but etcd's default --max-request-bytes (1.5 MiB)
    // would refuse the request as a whole; `Txn::validate` refuses it first (MAX_TXN_BYTES),
    // so every backend answers the same.
    let server = start_server();
    let store = connect(server.config(&unique_prefix())).await;
    for count in [2, 3] {
        let mut txn = ipam_core::Txn::new();
        for i in 0..count {
            txn = txn.then(ipam_core::Op::put(
                format!("big/{i}"),
                vec![0u8; 1024 * 1024],
            ));
        }
        match store.commit(txn).await {
            Err(KvError::InvalidArgument { message }) => {
                assert!(message.contains("bytes"), "{message}")
            }
            other => panic!("{count} MiB: expected InvalidArgument, got {other:?}"),
        }
    }
    assert!(store.list("").await.expect("list").is_empty());
}

/// etcd creates no revision for a transaction that changes nothing (only deletes of missing keys),
/// so `commit` returns the current revision, as the trait allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_that_changes_nothing_returns_the_current_revision() {
    let server = start_server();
    let store = connect(server.config(&unique_prefix())).await;
    let written = store.put("k", b"v".to_vec()).await.expect("put");
    let nothing = store
        .delete("missing")
        .await
        .expect("delete of a missing key");
    assert_eq!(nothing, written);
    let next = store.put("k", b"w".to_vec()).await.expect("put");
    assert!(next > written);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn factory_guard_deletes_its_prefix_when_dropped() {
    let server = start_server();
    let factory = EtcdFactory::on(&server);
    let case = factory.fresh().await;
    case.store.put("a", b"1".to_vec()).await.expect("put");
    case.store.put("b/c", b"2".to_vec()).await.expect("put");
    let raw = connect(server.config("")).await;
    assert_eq!(keys(&raw, "/blockipam-test/").await.len(), 2);
    drop(case);
    assert!(keys(&raw, "/blockipam-test/").await.is_empty());
}

#[test]
fn dropping_a_server_kills_etcd_and_removes_its_data() {
    let server = start_server();
    let data = server.data_dir();
    let port = client_port(&server);
    assert!(server.is_running());
    assert!(data.exists());
    drop(server);
    assert!(!data.exists(), "{} still exists", data.display());
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "etcd still listens"
    );
}

#[test]
fn dropping_a_test_pki_removes_its_files() {
    let pki = TestPki::generate().expect("openssl");
    let dir = pki.ca_cert().parent().expect("a directory").to_owned();
    assert!(pki.client_key().exists());
    drop(pki);
    assert!(!dir.exists(), "{} still exists", dir.display());
}

fn client_port(server: &EtcdServer) -> u16 {
    server
        .endpoint()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("endpoint has a port")
}

const CHILD_ENV: &str = "BLOCKIPAM_ETCD_TEST_CHILD";

/// Child process of `etcd_and_its_test_files_do_not_outlive_a_killed_test_process`: holds a server and a test
/// PKI, reports them, and waits to be killed.
#[test]
#[ignore = "child process of etcd_and_its_test_files_do_not_outlive_a_killed_test_process, which starts it"]
fn child_holds_a_server_until_killed() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let server = start_server();
    let pki = TestPki::generate().expect("openssl");
    let pki_dir = pki.ca_cert().parent().expect("a directory").to_owned();
    println!(
        "SERVER port={} dir={} pki={}",
        client_port(&server),
        server.data_dir().display(),
        pki_dir.display()
    );
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn etcd_and_its_test_files_do_not_outlive_a_killed_test_process() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    /// Kills the child even when an assertion below fails.
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--ignored",
            "--exact",
            "child_holds_a_server_until_killed",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start child test process");
    let stdout = child.stdout.take().expect("child stdout");
    let mut child = KillOnDrop(child);
    // libtest prints "test <name> ... " first, on the same line.
    let line = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|line| line.split_once("SERVER ").map(|(_, rest)| rest.to_owned()))
        .expect("the child reports its server");
    let mut port = 0u16;
    let mut dir = String::new();
    let mut pki_dir = String::new();
    for field in line.split_whitespace() {
        if let Some(p) = field.strip_prefix("port=") {
            port = p.parse().expect("port");
        } else if let Some(d) = field.strip_prefix("dir=") {
            dir = d.to_owned();
        } else if let Some(d) = field.strip_prefix("pki=") {
            pki_dir = d.to_owned();
        }
    }
    assert!(
        std::path::Path::new(&pki_dir).join("ca.pem").exists(),
        "the child's PKI is at {pki_dir:?}"
    );
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_ok(),
        "child's etcd is up"
    );

    child.0.kill().expect("SIGKILL the child"); // no destructor runs in the child
    child.0.wait().expect("reap the child");

    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let listening = TcpStream::connect(("127.0.0.1", port)).is_ok();
        let data_left = std::path::Path::new(&dir).exists();
        let pki_left = std::path::Path::new(&pki_dir).exists();
        if !listening && !data_left && !pki_left {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "etcd or its files outlived the test process (listening: {listening}, data left: \
             {data_left}, PKI left: {pki_left})"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A loopback TCP proxy in front of an etcd member that can hold back what etcd answers: while
/// held, etcd's bytes are kept (and counted) and sent on, in order, at release.
struct HoldingProxy {
    address: std::net::SocketAddr,
    shared: Arc<HoldShared>,
}

#[derive(Default)]
struct HoldShared {
    held: std::sync::atomic::AtomicBool,
    held_bytes: std::sync::atomic::AtomicUsize,
    stopped: std::sync::atomic::AtomicBool,
    /// Each forwarded connection's client side and what was held back for it.
    downstreams: std::sync::Mutex<Vec<Arc<std::sync::Mutex<Downstream>>>>,
    /// Every socket of every forwarded connection, to close them when the proxy is dropped.
    sockets: std::sync::Mutex<Vec<TcpStream>>,
}

struct Downstream {
    client: TcpStream,
    pending: Vec<u8>,
}

impl Downstream {
    fn flush_pending(&mut self) -> std::io::Result<()> {
        use std::io::Write;
        let pending = std::mem::take(&mut self.pending);
        self.client.write_all(&pending)
    }
}

impl HoldingProxy {
    fn start(endpoint: &str) -> HoldingProxy {
        let upstream: std::net::SocketAddr = endpoint
            .trim_start_matches("http://")
            .parse()
            .expect("an http://IP:PORT etcd endpoint");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let address = listener.local_addr().expect("the proxy's address");
        let shared = Arc::new(HoldShared::default());
        let accepting = Arc::clone(&shared);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if accepting.stopped.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                let _ = Self::forward(client, upstream, &accepting);
            }
        });
        HoldingProxy { address, shared }
    }

    fn forward(
        client: TcpStream,
        upstream: std::net::SocketAddr,
        shared: &Arc<HoldShared>,
    ) -> std::io::Result<()> {
        use std::io::Read as _;
        use std::sync::atomic::Ordering;
        let server = TcpStream::connect(upstream)?;
        shared
            .sockets
            .lock()
            .expect("proxy lock")
            .extend([client.try_clone()?, server.try_clone()?]);
        let (mut from_client, mut to_server) = (client.try_clone()?, server.try_clone()?);
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut from_client, &mut to_server);
            let _ = to_server.shutdown(std::net::Shutdown::Both);
        });
        let downstream = Arc::new(std::sync::Mutex::new(Downstream {
            client,
            pending: Vec::new(),
        }));
        shared
            .downstreams
            .lock()
            .expect("proxy lock")
            .push(Arc::clone(&downstream));
        let (shared, mut from_server) = (Arc::clone(shared), server);
        std::thread::spawn(move || {
            let mut buffer = vec![0u8; 64 * 1024];
            loop {
                let read = match from_server.read(&mut buffer) {
                    Ok(0) | Err(_) => break,
                    Ok(read) => read,
                };
                let mut downstream = downstream.lock().expect("proxy lock");
                if shared.held.load(Ordering::SeqCst) {
                    downstream.pending.extend_from_slice(&buffer[..read]);
                    shared.held_bytes.fetch_add(read, Ordering::SeqCst);
                    continue;
                }
                let sent = downstream.flush_pending().and_then(|()| {
                    use std::io::Write;
                    downstream.client.write_all(&buffer[..read])
                });
                if sent.is_err() {
                    break;
                }
            }
            let _ = downstream
                .lock()
                .expect("proxy lock")
                .client
                .shutdown(std::net::Shutdown::Both);
        });
        Ok(())
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// From now on, etcd's answers are held back.
    fn hold(&self) {
        self.shared
            .held_bytes
            .store(0, std::sync::atomic::Ordering::SeqCst);
        self.shared
            .held
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Waits until at least `bytes` of etcd's answers are held back (within 20 seconds).
    async fn wait_until_holding(&self, bytes: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while self
            .shared
            .held_bytes
            .load(std::sync::atomic::Ordering::SeqCst)
            < bytes
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "etcd's answer never reached the proxy"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Sends on what was held back and stops holding.
    fn release(&self) {
        self.shared
            .held
            .store(false, std::sync::atomic::Ordering::SeqCst);
        for downstream in self.shared.downstreams.lock().expect("proxy lock").iter() {
            let _ = downstream.lock().expect("proxy lock").flush_pending();
        }
    }
}

impl Drop for HoldingProxy {
    fn drop(&mut self) {
        self.shared
            .stopped
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Wake the accepting thread so that it sees the stop.
        let _ = TcpStream::connect(self.address);
        for socket in self.shared.sockets.lock().expect("proxy lock").drain(..) {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Writes `value` at `key` (under the store's `prefix`) straight to etcd and compacts its history
/// up to that write, so that every earlier revision can no longer be read.
async fn write_and_compact(
    client: &mut etcd_client::Client,
    prefix: &str,
    key: &str,
    value: &[u8],
) {
    let written = client
        .put(format!("{prefix}{key}"), value, None)
        .await
        .expect("put straight to etcd");
    let revision = written.header().expect("a header").revision();
    client
        .compact(revision, None)
        .await
        .expect("compact etcd's history");
}

/// A listing longer than one page, and a batch of more reads than one transaction, pin their
/// first answer's revision for the rest; when compaction discards that revision between two
/// requests, each starts again at the newest revision and answers in full, from that moment. The
/// proxy holds etcd's first answer back until the test has written and compacted past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_or_batch_whose_revision_is_compacted_between_its_requests_starts_again() {
    let server = start_server();
    let prefix = unique_prefix();
    let proxy = HoldingProxy::start(&server.endpoint());
    let store = Arc::new(connect(EtcdConfig::new([proxy.endpoint()]).with_prefix(&prefix)).await);
    let mut direct = etcd_client::Client::connect([server.endpoint()], None)
        .await
        .expect("connect straight to etcd");
    // 1,200 keys of 400 bytes: three listing pages; 130 reads: two transactions.
    let key = |i: usize| format!("k/{i:04}");
    for chunk in (0..1_200).collect::<Vec<_>>().chunks(100) {
        let mut txn = ipam_core::Txn::new();
        for &i in chunk {
            txn = txn.then(ipam_core::Op::put(key(i), vec![b'0'; 400]));
        }
        store.commit(txn).await.expect("write the keys");
    }
    // More than any control frame: etcd has answered the first request.
    let answered = 16 * 1024;

    proxy.hold();
    let listing = tokio::spawn({
        let store = Arc::clone(&store);
        async move { store.list("k/").await }
    });
    proxy.wait_until_holding(answered).await;
    write_and_compact(&mut direct, &prefix, &key(0), b"after the first page").await;
    proxy.release();
    let listed = listing
        .await
        .expect("the listing task")
        .expect("a listing whose revision was compacted between pages starts again");
    assert_eq!(listed.len(), 1_200);
    assert!(listed.iter().enumerate().all(|(i, kv)| kv.key == key(i)));
    assert_eq!(
        listed[0].value,
        b"after the first page".to_vec(),
        "not the newest revision"
    );

    let reads: Vec<Read> = (0..130).map(|i| Read::Get(key(i))).collect();
    proxy.hold();
    let batch = tokio::spawn({
        let store = Arc::clone(&store);
        async move { store.read_many(&reads).await }
    });
    proxy.wait_until_holding(answered).await;
    write_and_compact(&mut direct, &prefix, &key(129), b"after the first batch").await;
    proxy.release();
    let results = batch
        .await
        .expect("the batch task")
        .expect("a batch whose revision was compacted between transactions starts again");
    assert_eq!(results.len(), 130);
    let value = |result: &ReadResult| match result {
        ReadResult::Got(Some(kv)) => kv.value.clone(),
        other => panic!("expected a key, got {other:?}"),
    };
    assert_eq!(value(&results[0]), b"after the first page".to_vec());
    assert_eq!(
        value(&results[129]),
        b"after the first batch".to_vec(),
        "not the newest revision"
    );
    assert!(results[1..129].iter().all(|r| value(r) == vec![b'0'; 400]));
}
