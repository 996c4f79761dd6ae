//! `AgentStore` against in-process agents and fake ones: store errors keep their kind across the
//! socket, a lost connection is indeterminate for a commit and unavailable for a read, a socket
//! that never answers is unavailable within the connect timeout, and calls run concurrently.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use backend_agent::protocol::{read_payload, MAX_REQUEST_BYTES};
use backend_agent::{AgentConfig, AgentStore};
use blockipam_agent::ServerConfig;
use ipam_core::{KeyValue, KvError, KvStore, Op, Revision, Txn};
use tokio::net::UnixListener;

/// A store whose every call fails with the error it was built with.
#[derive(Debug)]
struct FailingStore(KvError);

#[async_trait]
impl KvStore for FailingStore {
    async fn get(&self, _key: &str) -> Result<Option<KeyValue>, KvError> {
        Err(self.0.clone())
    }
    async fn list(&self, _prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        Err(self.0.clone())
    }
    async fn commit(&self, _txn: Txn) -> Result<Revision, KvError> {
        Err(self.0.clone())
    }
}

fn quick(socket: &std::path::Path) -> AgentConfig {
    AgentConfig::new(socket).with_timeouts(Duration::from_millis(500), Duration::from_secs(5))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_errors_cross_the_socket_with_their_kind_and_fields() {
    let errors = [
        KvError::Conflict {
            key: "blocks/10.0.0.0-26".into(),
        },
        KvError::unavailable("etcd down"),
        KvError::Indeterminate {
            message: "etcd timed out".into(),
        },
        KvError::corrupt(Some("blocks/x"), "not JSON"),
        KvError::corrupt(None, "wrong format marker"),
        KvError::invalid("empty key"),
        KvError::other("disk full"),
    ];
    for error in errors {
        let agent = common::InProcessAgent::serve_on_current_runtime(
            Arc::new(FailingStore(error.clone())),
            ServerConfig::default(),
        );
        let client = agent.client().await;
        assert_eq!(client.get("k").await, Err(error.clone()), "get");
        assert_eq!(client.list("k").await, Err(error.clone()), "list");
        assert_eq!(
            client
                .commit(Txn::new().then(Op::put("k", b"v".to_vec())))
                .await,
            Err(error.clone()),
            "commit"
        );
        agent.stop().await;
    }
}

/// A fake agent: answers the hello, then reads one request and closes without answering.
async fn agent_that_dies_after_reading_a_request(listener: UnixListener) {
    let (mut stream, _) = listener.accept().await.expect("accept");
    common::accept_hello(&mut stream).await;
    let request = read_payload(&mut stream, MAX_REQUEST_BYTES)
        .await
        .expect("read the request");
    assert!(request.is_some(), "no request arrived");
    drop(stream);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_lost_with_a_commit_in_flight_is_indeterminate_and_with_a_read_unavailable() {
    for commit in [true, false] {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&socket).expect("bind");
        let fake = tokio::spawn(agent_that_dies_after_reading_a_request(listener));
        let client = AgentStore::connect(quick(&socket)).await.expect("connect");
        let outcome = if commit {
            client
                .commit(Txn::new().then(Op::put("k", b"v".to_vec())))
                .await
                .map(|_| ())
        } else {
            client.get("k").await.map(|_| ())
        };
        fake.await.expect("fake agent");
        match (commit, outcome) {
            (true, Err(KvError::Indeterminate { message })) => {
                assert!(message.contains("may or may not"), "{message}")
            }
            (false, Err(KvError::Unavailable { .. })) => {}
            (commit, other) => panic!("commit={commit}: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_that_accepts_nothing_is_unavailable_within_the_connect_timeout() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    // Bound and listening (connections queue), never accepted or read.
    let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
    let outcome =
        tokio::time::timeout(Duration::from_secs(30), AgentStore::connect(quick(&socket)))
            .await
            .expect("connect hung beyond its own timeout");
    match outcome {
        Err(KvError::Unavailable { message }) => {
            assert!(message.contains("did not answer"), "{message}");
            assert!(message.contains(&socket.display().to_string()), "{message}");
        }
        other => panic!("expected unavailable, got {other:?}"),
    }
    // A socket file nobody listens on any more (a killed agent): unavailable at once.
    drop(_listener);
    match AgentStore::connect(quick(&socket)).await {
        Err(KvError::Unavailable { message }) => {
            assert!(message.contains("not running"), "{message}")
        }
        other => panic!("expected unavailable, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_share_one_connection_and_each_gets_its_own_answer() {
    let agent = common::InProcessAgent::serve_on_current_runtime(
        Arc::new(ipam_core::MemoryStore::new()),
        ServerConfig::default(),
    );
    let client = Arc::new(agent.client().await);
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let client = Arc::clone(&client);
            tokio::spawn(async move {
                let key = format!("key/{i:02}");
                client
                    .put(&key, format!("value {i}").into_bytes())
                    .await
                    .expect("put");
                let got = client.get(&key).await.expect("get").expect("present");
                assert_eq!(got.value, format!("value {i}").into_bytes());
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    assert_eq!(client.list("key/").await.expect("list").len(), 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_connects_again_after_the_agent_restarts_on_the_same_store() {
    let store: Arc<dyn KvStore> = Arc::new(ipam_core::MemoryStore::new());
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let serve_once = |store: Arc<dyn KvStore>| {
        let (listener, guard) = blockipam_agent::socket::bind(&socket, false).expect("bind");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            blockipam_agent::serve(listener, store, ServerConfig::default(), async {
                let _ = stopped.await;
            })
            .await;
            drop(guard);
        });
        (stop, task)
    };
    let (stop, task) = serve_once(Arc::clone(&store));
    // Generous connect timeout: the restarted server is a task that a loaded machine (test
    // binaries running side by side) may schedule late; the point here is the reconnection.
    let patient =
        AgentConfig::new(&socket).with_timeouts(Duration::from_secs(10), Duration::from_secs(10));
    let client = AgentStore::connect(patient).await.expect("connect");
    client.put("a", b"1".to_vec()).await.expect("put");
    let _ = stop.send(());
    task.await.expect("server");
    assert!(!socket.exists(), "the socket outlived its server");
    assert!(client.get("a").await.is_err(), "a stopped agent answered");
    let (stop, task) = serve_once(Arc::clone(&store));
    assert_eq!(
        client
            .get("a")
            .await
            .expect("get after restart")
            .map(|kv| kv.value),
        Some(b"1".to_vec())
    );
    let _ = stop.send(());
    task.await.expect("server");
}

/// A store whose commits wait until released (or forever), to hold requests in flight.
#[derive(Debug)]
struct SlowStore {
    inner: ipam_core::MemoryStore,
    started: tokio::sync::Notify,
    release: tokio::sync::Semaphore,
}

#[async_trait]
impl KvStore for SlowStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.started.notify_one();
        let _permit = self.release.acquire().await.expect("semaphore");
        self.inner.commit(txn).await
    }
}

/// At shutdown a commit in flight is answered when it ends within the grace (an hour here, so that
/// only a connection left open could hold the server) and abandoned, indeterminate, beyond it
/// (300 ms); the commit ends only once the server has stopped accepting. An idle client's
/// connection is closed at once: it reads no new request, and does not hold the server for the
/// grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_requests_in_flight_and_abandons_them_beyond_the_grace() {
    for finishes_in_time in [true, false] {
        let store = Arc::new(SlowStore {
            inner: ipam_core::MemoryStore::new(),
            started: tokio::sync::Notify::new(),
            release: tokio::sync::Semaphore::new(0),
        });
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("agent.sock");
        let (listener, guard) = blockipam_agent::socket::bind(&socket, false).expect("bind");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let config = ServerConfig {
            drain_timeout: if finishes_in_time {
                Duration::from_secs(3600)
            } else {
                Duration::from_millis(300)
            },
            ..ServerConfig::default()
        };
        let served: Arc<dyn KvStore> = Arc::clone(&store) as Arc<dyn KvStore>;
        let server = tokio::spawn(async move {
            blockipam_agent::serve(listener, served, config, async {
                let _ = stopped.await;
            })
            .await;
            drop(guard);
        });
        let idle = AgentStore::connect(quick(&socket)).await.expect("connect");
        assert_eq!(
            idle.get("k").await,
            Ok(None),
            "the idle client's first read"
        );
        let client = AgentStore::connect(quick(&socket)).await.expect("connect");
        let commit = tokio::spawn(async move {
            client
                .commit(Txn::new().then(Op::put("k", b"v".to_vec())))
                .await
        });
        store.started.notified().await;
        let _ = stop.send(());
        // The listener is dropped just before the connections are told to stop: once a new
        // connection is refused, give them a moment to see it, so that the commit ends during the
        // shutdown and not before it.
        let refused_by = std::time::Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&socket).is_ok() {
            assert!(
                std::time::Instant::now() < refused_by,
                "the server kept accepting"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        if finishes_in_time {
            store.release.add_permits(1);
        }
        tokio::time::timeout(Duration::from_secs(60), server)
            .await
            .expect("the server did not stop: a connection was left open into the grace")
            .expect("server stops");
        let outcome = commit.await.expect("commit task");
        assert!(
            idle.get("k").await.is_err(),
            "a stopped agent answered the idle client"
        );
        if finishes_in_time {
            assert!(
                outcome.is_ok(),
                "the commit in flight was not answered: {outcome:?}"
            );
            assert!(store.inner.get("k").await.expect("get").is_some());
        } else {
            assert!(
                matches!(outcome, Err(KvError::Indeterminate { .. })),
                "an abandoned commit must be indeterminate: {outcome:?}"
            );
        }
        assert!(!socket.exists(), "the socket outlived its server");
    }
}

/// A store whose reads wait until released, counting how many run at once.
#[derive(Debug)]
struct GatedReads {
    inner: ipam_core::MemoryStore,
    running: std::sync::atomic::AtomicUsize,
    most_at_once: std::sync::atomic::AtomicUsize,
    release: tokio::sync::Semaphore,
}

#[async_trait]
impl KvStore for GatedReads {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        use std::sync::atomic::Ordering;
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_at_once.fetch_max(now, Ordering::SeqCst);
        let permit = self.release.acquire().await.expect("semaphore");
        self.running.fetch_sub(1, Ordering::SeqCst);
        drop(permit);
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.inner.commit(txn).await
    }
}

/// One connection never has more requests running than the server's limit: the others wait
/// unread, and are answered once earlier ones end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_runs_at_most_its_limit_of_requests_at_once_and_the_rest_in_turn() {
    use std::sync::atomic::Ordering;
    const LIMIT: usize = 3;
    const CALLS: usize = 8;
    let store = Arc::new(GatedReads {
        inner: ipam_core::MemoryStore::new(),
        running: Default::default(),
        most_at_once: Default::default(),
        release: tokio::sync::Semaphore::new(0),
    });
    let agent = common::InProcessAgent::serve_on_current_runtime(
        Arc::clone(&store) as Arc<dyn KvStore>,
        ServerConfig {
            max_in_flight_per_connection: LIMIT,
            ..ServerConfig::default()
        },
    );
    let client = Arc::new(agent.client().await);
    let calls: Vec<_> = (0..CALLS)
        .map(|i| {
            let client = Arc::clone(&client);
            tokio::spawn(async move { client.get(&format!("key/{i}")).await })
        })
        .collect();
    let running_by = std::time::Instant::now() + Duration::from_secs(30);
    while store.running.load(Ordering::SeqCst) < LIMIT {
        assert!(
            std::time::Instant::now() < running_by,
            "only {} of the calls started",
            store.running.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Time for any request read beyond the limit to reach the store.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        store.most_at_once.load(Ordering::SeqCst),
        LIMIT,
        "requests of one connection running at once"
    );
    store.release.add_permits(CALLS);
    for call in calls {
        assert_eq!(call.await.expect("call task"), Ok(None));
    }
    assert_eq!(store.most_at_once.load(Ordering::SeqCst), LIMIT);
    agent.stop().await;
}

/// A listener run by another user (uid 65534) at a socket path: what a local user could put where
/// the plugin looks for its agent. The client refuses it by its peer credentials before sending
/// anything (the listener counts the bytes it received: none), and a real agent, run by root, is
/// still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_served_by_another_user_is_refused_before_anything_is_sent() {
    use std::io::BufRead;
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    const NOBODY: u32 = 65534;
    // Counts what it receives on one connection until the client closes it (or 10 s pass).
    const IMPOSTOR: &str = "
import socket, sys
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen(1)
print('ready', flush=True)
connection, _ = server.accept()
connection.settimeout(10)
received = 0
try:
    while True:
        chunk = connection.recv(65536)
        if not chunk:
            break
        received += len(chunk)
except socket.timeout:
    pass
print('received', received, flush=True)
";
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).expect("mkdir");
    std::os::unix::fs::chown(&theirs, Some(NOBODY), Some(NOBODY)).expect("chown (run as root)");
    let socket = theirs.join("agent.sock");
    let mut impostor = std::process::Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(IMPOSTOR)
        .arg(&socket)
        .env_clear()
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run python3 as uid 65534");
    let mut said = std::io::BufReader::new(impostor.stdout.take().expect("its stdout")).lines();
    let ready = said.next().and_then(Result::ok);
    assert_eq!(
        ready.as_deref(),
        Some("ready"),
        "the impostor did not start"
    );

    let refused = AgentStore::connect(quick(&socket))
        .await
        .map(drop)
        .expect_err("a socket served by uid 65534 was used");
    let KvError::Other { message } = &refused else {
        panic!("not a clear refusal: {refused:?}");
    };
    assert!(
        message.contains("served by uid 65534") && message.contains("nothing was sent"),
        "{message}"
    );
    let received = tokio::task::spawn_blocking(move || {
        let line = said.next().and_then(Result::ok);
        let _ = impostor.wait();
        line
    })
    .await
    .expect("the impostor's report");
    assert_eq!(
        received.as_deref(),
        Some("received 0"),
        "the client sent something to the impostor"
    );

    // A real agent, run by this process's user (root), is served.
    let agent = common::InProcessAgent::serve_on_current_runtime(
        Arc::new(ipam_core::MemoryStore::new()),
        ServerConfig::default(),
    );
    let client = AgentStore::connect(quick(&agent.socket))
        .await
        .expect("the real agent");
    client.put("k", b"v".to_vec()).await.expect("put");
    agent.stop().await;
}
