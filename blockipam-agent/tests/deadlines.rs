//! The caller's deadline through the agent: a commit not started by it never lands (also for the
//! real plugin under `timeout_seconds`), a request read after a commit the caller gave up on waits
//! for its outcome, and protocol 1 peers on either side keep working (an old client with a new
//! agent, a new client with an old agent).

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use backend_agent::deadline::within;
use backend_agent::protocol::{
    encode_frame, read_frame, write_frame, BoundedRequestFrame, Request, RequestFrame, Response,
    ResponseFrame, StoreIdentity, WireDeadline, WireError, WireOp, WireTxn, MAX_REQUEST_BYTES,
    MAX_RESPONSE_BYTES, PROTOCOL_V1, PROTOCOL_VERSION,
};
use backend_agent::{AgentConfig, AgentStore};
use blockipam_agent::ServerConfig;
use ipam_core::{KeyValue, KvError, KvStore, Op, Revision, Txn};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Mutex, Notify, Semaphore};
use tokio::time::Instant;

/// An engine with one writer at a time (as redb's `begin_write` and sled's flush are), whose
/// commit of [`HELD`] waits, holding the writer, until the test releases it.
#[derive(Debug)]
struct OneWriterEngine {
    inner: ipam_core::MemoryStore,
    writer: Mutex<()>,
    held_started: Notify,
    release_held: Semaphore,
}

impl OneWriterEngine {
    fn new() -> Self {
        OneWriterEngine {
            inner: ipam_core::MemoryStore::new(),
            writer: Mutex::new(()),
            held_started: Notify::new(),
            release_held: Semaphore::new(0),
        }
    }
}

/// The key whose commit the engine holds.
const HELD: &str = "held";

#[async_trait]
impl KvStore for OneWriterEngine {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        let _writer = self.writer.lock().await;
        let held = txn
            .ops
            .iter()
            .any(|op| matches!(op, Op::Put { key, .. } if key == HELD));
        if held {
            self.held_started.notify_one();
            self.release_held
                .acquire()
                .await
                .map_err(|e| KvError::other(e.to_string()))?
                .forget();
        }
        self.inner.commit(txn).await
    }
}

fn put(key: &str, value: &str) -> Txn {
    Txn::new().then(Op::put(key, value.as_bytes().to_vec()))
}

/// The deadline of a call the test makes give up: long enough to be sent and read, far shorter
/// than how long the engine holds the writer.
const SHORT: Duration = Duration::from_millis(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_not_started_by_the_callers_deadline_never_lands() {
    let engine = Arc::new(OneWriterEngine::new());
    let agent =
        common::InProcessAgent::serve_on_current_runtime(engine.clone(), ServerConfig::default());
    let first = Arc::new(agent.client().await);
    let second = agent.client().await;
    // Another call's commit holds the engine's writer.
    let holding = tokio::spawn({
        let first = Arc::clone(&first);
        async move { first.commit(put(HELD, "1")).await }
    });
    engine.held_started.notified().await;
    // A call with a short deadline commits behind it and gives up.
    let late = within(Instant::now() + SHORT, second.commit(put("late", "1"))).await;
    assert!(late.is_err(), "the late commit was answered: {late:?}");
    // The engine lets go; a commit queued after the late one's place completes, so the late one,
    // had the agent started it, has landed by then.
    engine.release_held.add_permits(1);
    holding.await.expect("task").expect("the holding commit");
    first
        .commit(put("after", "1"))
        .await
        .expect("a later commit");
    assert_eq!(
        first.get("late").await.expect("get"),
        None,
        "a commit the agent started after its caller's deadline landed"
    );
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_after_a_commit_its_caller_gave_up_on_waits_for_the_outcome() {
    let engine = Arc::new(OneWriterEngine::new());
    let agent =
        common::InProcessAgent::serve_on_current_runtime(engine.clone(), ServerConfig::default());
    let giving_up = agent.client().await;
    let next = Arc::new(agent.client().await);
    // A call's commit starts in time and then outlives its caller's deadline (long enough for
    // the request to reach the agent on a loaded machine; were it late, the agent would refuse it
    // unstarted and the wait below would fail, not hang).
    let commit = tokio::spawn(async move {
        within(
            Instant::now() + Duration::from_secs(3),
            giving_up.commit(put(HELD, "1")),
        )
        .await
    });
    tokio::time::timeout(Duration::from_secs(30), engine.held_started.notified())
        .await
        .expect("the commit started within its deadline");
    let gave_up = commit.await.expect("task");
    assert!(
        matches!(gave_up, Err(KvError::Indeterminate { .. })),
        "{gave_up:?}"
    );
    // The node's next call reads what the first one wrote.
    let mut read = tokio::spawn({
        let next = Arc::clone(&next);
        async move { next.get(HELD).await }
    });
    // Let the read reach the agent and, if nothing holds it, be answered (a bounded wait).
    let early = tokio::time::timeout(Duration::from_millis(500), &mut read).await;
    engine.release_held.add_permits(1);
    let seen = match early {
        Ok(joined) => joined,
        Err(_) => read.await,
    }
    .expect("task")
    .expect("the read");
    assert_eq!(
        seen.map(|kv| kv.value),
        Some(b"1".to_vec()),
        "the read did not wait for the commit in flight"
    );
    agent.stop().await;
}

/// Writes `request` with `deadline` as a protocol 2 frame, or without one as a protocol 1
/// frame, and reads the answer.
async fn exchange(
    stream: &mut UnixStream,
    id: u64,
    deadline: Option<WireDeadline>,
    request: Request,
) -> Response {
    let frame = match deadline {
        Some(deadline) => encode_frame(
            &BoundedRequestFrame {
                id,
                deadline,
                request,
            },
            MAX_REQUEST_BYTES,
        ),
        None => encode_frame(&RequestFrame { id, request }, MAX_REQUEST_BYTES),
    }
    .expect("encode");
    write_frame(stream, &frame).await.expect("send");
    let answer: Option<ResponseFrame> = read_frame(stream, MAX_RESPONSE_BYTES)
        .await
        .expect("an answer");
    let answer = answer.expect("an answer frame");
    assert_eq!(answer.id, id);
    answer.response
}

/// A raw connection to `agent` after a hello offering `offered`, with the agent's answer.
async fn greeted(agent: &common::InProcessAgent, offered: u32) -> (UnixStream, Response) {
    let mut stream = UnixStream::connect(&agent.socket).await.expect("connect");
    let hello = Request::Hello { protocol: offered };
    let answer = exchange(&mut stream, 0, None, hello).await;
    (stream, answer)
}

fn wire_put(key: &str) -> Request {
    Request::Commit {
        txn: WireTxn {
            conditions: vec![],
            ops: vec![WireOp::Put(key.into(), b"v".to_vec())],
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_read_after_its_deadline_is_refused_as_unavailable_and_writes_nothing() {
    let store = Arc::new(ipam_core::MemoryStore::new());
    let agent =
        common::InProcessAgent::serve_on_current_runtime(store.clone(), ServerConfig::default());
    let (mut stream, hello) = greeted(&agent, PROTOCOL_VERSION).await;
    assert!(
        matches!(hello, Response::Hello { protocol, .. } if protocol == PROTOCOL_VERSION),
        "{hello:?}"
    );
    // Gone a second before the agent reads it.
    let past = WireDeadline::at(Instant::now());
    let past = WireDeadline {
        monotonic_nanos: past.monotonic_nanos.saturating_sub(1_000_000_000),
        remaining_nanos: 0,
    };
    match exchange(&mut stream, 1, Some(past), wire_put("k")).await {
        Response::Failed(WireError::Unavailable { message }) => {
            assert!(message.contains("nothing was written"), "{message}")
        }
        other => panic!("expected an unavailable refusal, got {other:?}"),
    }
    assert_eq!(store.get("k").await.expect("get"), None);
    // The same connection goes on with a deadline in the future.
    let future = WireDeadline::at(Instant::now() + Duration::from_secs(10));
    assert!(matches!(
        exchange(&mut stream, 2, Some(future), wire_put("k")).await,
        Response::Committed { .. }
    ));
    assert!(store.get("k").await.expect("get").is_some());
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_1_client_keeps_working_with_this_agent() {
    let store = Arc::new(ipam_core::MemoryStore::new());
    let agent =
        common::InProcessAgent::serve_on_current_runtime(store.clone(), ServerConfig::default());
    // Exactly what the previous release's client sends.
    let (mut stream, hello) = greeted(&agent, PROTOCOL_V1).await;
    assert!(
        matches!(hello, Response::Hello { protocol: 1, .. }),
        "an old client must be answered in its own version: {hello:?}"
    );
    assert!(matches!(
        exchange(&mut stream, 1, None, wire_put("k")).await,
        Response::Committed { .. }
    ));
    match exchange(&mut stream, 2, None, Request::Get { key: "k".into() }).await {
        Response::Got(Some(kv)) => assert_eq!(kv.value, b"v".to_vec()),
        other => panic!("expected the value, got {other:?}"),
    }
    agent.stop().await;
}

/// An agent of the previous release, as far as the protocol goes: it refuses any hello but
/// version 1 with that release's words, and answers protocol 1 frames (a get finds "k" = "v").
/// Returns the versions offered to it, one per connection.
async fn previous_release_agent(listener: UnixListener, connections: usize) -> Vec<u32> {
    let mut offered = Vec::new();
    for _ in 0..connections {
        let (mut stream, _) = listener.accept().await.expect("accept");
        let (id, protocol) = common::read_hello(&mut stream).await;
        offered.push(protocol);
        let response = if protocol == 1 {
            Response::Hello {
                protocol: 1,
                served: common::fake_identity(),
            }
        } else {
            Response::Refused {
                reason: format!("protocol version {protocol} is not this agent's 1"),
            }
        };
        common::answer(&mut stream, id, response).await;
        if protocol != 1 {
            continue;
        }
        while let Ok(Some(frame)) =
            read_frame::<_, RequestFrame>(&mut stream, MAX_REQUEST_BYTES).await
        {
            let response = match frame.request {
                Request::Get { key } if key == "k" => {
                    Response::Got(Some(backend_agent::protocol::WireKeyValue {
                        key,
                        value: b"v".to_vec(),
                        revision: 1,
                    }))
                }
                Request::Get { .. } => Response::Got(None),
                _ => Response::Committed { revision: 2 },
            };
            common::answer(&mut stream, frame.id, response).await;
        }
    }
    offered
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn this_client_falls_back_to_protocol_1_with_an_agent_of_the_previous_release() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    let old_agent = tokio::spawn(previous_release_agent(listener, 2));
    let client = AgentStore::connect(
        AgentConfig::new(&socket).with_timeouts(Duration::from_secs(5), Duration::from_secs(10)),
    )
    .await
    .expect("connect to an agent of the previous release");
    assert_eq!(client.protocol().await, Some(PROTOCOL_V1));
    let got = within(Instant::now() + Duration::from_secs(10), client.get("k"))
        .await
        .expect("a get in protocol 1");
    assert_eq!(got.map(|kv| kv.value), Some(b"v".to_vec()));
    client
        .commit(put("x", "1"))
        .await
        .expect("a commit in protocol 1");
    drop(client);
    assert_eq!(
        old_agent.await.expect("old agent"),
        vec![PROTOCOL_VERSION, PROTOCOL_V1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_refusing_every_version_is_a_clear_error_naming_both() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    // Speaks only a version of its own: refuses this client's newest, then 1.
    let picky = tokio::spawn(async move {
        for _ in 0..2 {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let (id, protocol) = common::read_hello(&mut stream).await;
            let reason = format!("protocol version {protocol} is not this agent's 7");
            common::answer(&mut stream, id, Response::Refused { reason }).await;
        }
    });
    match AgentStore::connect(
        AgentConfig::new(&socket).with_timeouts(Duration::from_secs(5), Duration::from_secs(10)),
    )
    .await
    {
        Err(KvError::Other { message }) => {
            assert!(
                message.contains(&format!("versions {PROTOCOL_VERSION}"))
                    && message.contains("and 1"),
                "{message}"
            );
            assert!(message.contains("this agent's 7"), "{message}");
        }
        other => panic!("expected a clear error, got {other:?}"),
    }
    picky.await.expect("fake agent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_call_that_gives_up_behind_a_commit_in_flight_writes_nothing_after_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store_path = dir.path().join("store.sled");
    // The agent announces the sled store the netconf names, so the plugin goes through it.
    let served = StoreIdentity {
        datastore_type: "sled".into(),
        path: Some(store_path.display().to_string()),
        etcd_endpoints: vec![],
        etcd_prefix: None,
    };
    let engine = Arc::new(OneWriterEngine::new());
    let config = ServerConfig {
        served,
        ..ServerConfig::default()
    };
    let agent = common::InProcessAgent::serve_on_current_runtime(engine.clone(), config);
    // Built (once per test binary) before anything is held.
    tokio::task::spawn_blocking(common::plugin)
        .await
        .expect("build the plugin");
    // Another client's commit holds the engine's writer.
    let holder = AgentStore::connect(
        AgentConfig::new(&agent.socket)
            .with_timeouts(Duration::from_secs(5), Duration::from_secs(120)),
    )
    .await
    .expect("connect");
    let holder = Arc::new(holder);
    let holding = tokio::spawn({
        let holder = Arc::clone(&holder);
        async move { holder.commit(put(HELD, "1")).await }
    });
    engine.held_started.notified().await;
    let netconf = serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "deadlinenet",
        "ipam": {
            "type": "blockipam",
            "nodename": "node-a",
            "datastore_type": "sled",
            "datastore_path": store_path,
            "agent_socket": agent.socket,
            "ipam_lock_file": dir.path().join("lock"),
            "timeout_seconds": 1,
            "pools": [{"cidr": "10.78.0.0/16", "block_size": 26, "name": "deadline-pool"}]
        }
    });
    let run = tokio::task::spawn_blocking(move || {
        common::run_plugin("ADD", "late-1", &netconf, Duration::from_secs(60))
    })
    .await
    .expect("plugin thread");
    let answer: serde_json::Value = serde_json::from_str(&run.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {run:#?}"));
    assert_eq!(answer["code"].as_u64(), Some(11), "{run:#?}");
    // The engine lets go; a commit queued behind whatever the plugin left in the agent completes.
    engine.release_held.add_permits(1);
    holding.await.expect("task").expect("the holding commit");
    holder
        .commit(put("after", "1"))
        .await
        .expect("a later commit");
    let keys: Vec<String> = engine
        .inner
        .list("")
        .await
        .expect("list")
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(
        keys,
        vec!["after".to_owned(), HELD.to_owned()],
        "the plugin's call wrote after it had given up"
    );
    agent.stop().await;
}
