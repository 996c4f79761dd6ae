//! Range reads across agent protocol versions: this agent answers each hello with the newest version both speak and serves a range in protocol 3 and on a protocol 2 connection; this client, reconnected to an agent of protocol 2, sends it no range and still gets each window. Also: malformed protocol 4 requests from a raw peer.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use backend_agent::protocol::{
    decode_request, encode_frame, read_frame, read_payload, write_frame, BoundedRequestFrame,
    Request, RequestFrame, Response, ResponseFrame, WireDeadline, WireRead, MAX_REQUEST_BYTES,
    MAX_RESPONSE_BYTES, PROTOCOL_V1, PROTOCOL_V2, PROTOCOL_V3, PROTOCOL_V4, PROTOCOL_VERSION,
};
use backend_agent::{AgentConfig, AgentStore};
use blockipam_agent::ServerConfig;
use ipam_core::{KvError, KvStore, MemoryStore, Read, ReadResult};
use tokio::net::{UnixListener, UnixStream};
use tokio::time::Instant;

/// A store with keys in and around the prefix `r/a/`.
async fn store_around_r_a() -> Arc<MemoryStore> {
    let store = Arc::new(MemoryStore::new());
    for key in ["r/a", "r/a/1", "r/a/2", "r/a/3", "r/a/4", "r/ab", "r/b"] {
        store.put(key, key.as_bytes().to_vec()).await.expect("put");
    }
    store
}

/// Windows from the middle, from below the prefix, past the end and larger than the rest, beside
/// a get and a list.
fn range_batch() -> Vec<Read> {
    vec![
        Read::Get("r/b".into()),
        Read::range("r/a/", "r/a/2", 2),
        Read::List("r/a/".into()),
        Read::range("r/a/", "", 2),
        Read::range("r/a/", "r/a/9", 5),
        Read::range("r/a/", "r/a/3", 10),
    ]
}

fn listed_keys(result: &ReadResult) -> Vec<&str> {
    match result {
        ReadResult::Listed(kvs) => kvs.iter().map(|kv| kv.key.as_str()).collect(),
        other => panic!("expected a list result, got {other:?}"),
    }
}

/// The windows [`range_batch`] must get from [`store_around_r_a`].
fn assert_windows(results: &[ReadResult]) {
    assert_eq!(results.len(), 6);
    assert_eq!(listed_keys(&results[1]), ["r/a/2", "r/a/3"]);
    assert_eq!(
        listed_keys(&results[2]),
        ["r/a/1", "r/a/2", "r/a/3", "r/a/4"]
    );
    assert_eq!(listed_keys(&results[3]), ["r/a/1", "r/a/2"]);
    assert!(listed_keys(&results[4]).is_empty());
    assert_eq!(listed_keys(&results[5]), ["r/a/3", "r/a/4"]);
}

/// Sends `request` on a raw connection, framed for `protocol` (the hello always as protocol 1),
/// and reads the answer.
async fn exchange(stream: &mut UnixStream, id: u64, protocol: u32, request: Request) -> Response {
    let frame = if protocol >= PROTOCOL_V2 {
        let deadline = WireDeadline::at(Instant::now() + Duration::from_secs(10));
        encode_frame(
            &BoundedRequestFrame {
                id,
                deadline,
                request,
            },
            MAX_REQUEST_BYTES,
        )
    } else {
        encode_frame(&RequestFrame { id, request }, MAX_REQUEST_BYTES)
    }
    .expect("encode");
    write_frame(stream, &frame).await.expect("send");
    let answer: ResponseFrame = read_frame(stream, MAX_RESPONSE_BYTES)
        .await
        .expect("an answer")
        .expect("an answer frame");
    assert_eq!(answer.id, id);
    answer.response
}

/// A raw connection to `agent` after a hello offering `offered`; returns the version answered.
async fn greeted(agent: &common::InProcessAgent, offered: u32) -> (UnixStream, u32) {
    let mut stream = UnixStream::connect(&agent.socket).await.expect("connect");
    let hello = Request::Hello { protocol: offered };
    match exchange(&mut stream, 0, PROTOCOL_V1, hello).await {
        Response::Hello { protocol, .. } => (stream, protocol),
        other => panic!("offering {offered}: expected a hello, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_hello_is_answered_with_the_newest_version_both_speak() {
    let agent = common::InProcessAgent::serve_on_current_runtime(
        Arc::new(MemoryStore::new()),
        ServerConfig::default(),
    );
    assert_eq!(PROTOCOL_VERSION, PROTOCOL_V4);
    for (offered, answered) in [(1, 1), (2, 2), (3, 3), (4, 4), (5, 4), (u32::MAX, 4)] {
        let (_stream, protocol) = greeted(&agent, offered).await;
        assert_eq!(protocol, answered, "offering {offered}");
    }
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_is_served_in_protocol_3_and_on_a_protocol_2_connection() {
    let agent = common::InProcessAgent::serve_on_current_runtime(
        store_around_r_a().await,
        ServerConfig::default(),
    );
    let reads: Vec<WireRead> = range_batch().iter().map(Into::into).collect();
    for offered in [PROTOCOL_V2, PROTOCOL_V3] {
        let (mut stream, protocol) = greeted(&agent, offered).await;
        let request = Request::ReadMany {
            reads: reads.clone(),
        };
        let results = match exchange(&mut stream, 1, protocol, request).await {
            Response::ReadMany(results) => results,
            other => panic!("protocol {protocol}: expected a batched read, got {other:?}"),
        };
        let results: Vec<ReadResult> = results.into_iter().map(Into::into).collect();
        assert_windows(&results);
        // A limit of 0 is the store's invalid argument, the connection goes on.
        let zero = Request::ReadMany {
            reads: vec![WireRead::Range {
                prefix: "r/a/".into(),
                from: String::new(),
                limit: 0,
            }],
        };
        let refused = exchange(&mut stream, 2, protocol, zero).await;
        assert!(
            matches!(
                refused,
                Response::Failed(backend_agent::protocol::WireError::InvalidArgument { .. })
            ),
            "protocol {protocol}: {refused:?}"
        );
        let get = Request::Get { key: "r/b".into() };
        assert!(matches!(
            exchange(&mut stream, 3, protocol, get).await,
            Response::Got(Some(_))
        ));
    }
    agent.stop().await;
}

/// What a fake agent of protocol 2 received: the reads of each batched read.
type ReceivedReads = Arc<Mutex<Vec<Vec<WireRead>>>>;

/// An agent of the build before protocol 3, as far as the protocol goes: answers one connection's
/// hello with the newest version both speak (at most 2) and serves batched reads from `store`;
/// a range, which that build cannot decode, closes the connection.
async fn protocol_2_agent(
    listener: UnixListener,
    store: Arc<MemoryStore>,
    received: ReceivedReads,
) {
    let (mut stream, _) = listener.accept().await.expect("accept");
    let (id, offered) = common::read_hello(&mut stream).await;
    let protocol = offered.min(PROTOCOL_V2);
    let served = ServerConfig::default().served;
    common::answer(&mut stream, id, Response::Hello { protocol, served }).await;
    while let Ok(Some(payload)) = read_payload(&mut stream, MAX_REQUEST_BYTES).await {
        let frame = decode_request(&payload, protocol).expect("a request");
        let Request::ReadMany { reads } = frame.request else {
            panic!("this fake serves batched reads only: {:?}", frame.request);
        };
        received.lock().expect("received").push(reads.clone());
        if reads
            .iter()
            .any(|read| matches!(read, WireRead::Range { .. }))
        {
            return;
        }
        let reads: Vec<Read> = reads.into_iter().map(Into::into).collect();
        let results = store.read_many(&reads).await.expect("read_many");
        let response = Response::ReadMany(results.into_iter().map(Into::into).collect());
        common::answer(&mut stream, frame.id, response).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn this_client_reads_each_window_through_an_agent_replaced_by_one_of_protocol_2() {
    let store = store_around_r_a().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    // Today's agent first.
    let (listener, guard) = blockipam_agent::socket::bind(&socket, false).expect("bind");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let todays_agent = tokio::spawn({
        let store: Arc<dyn KvStore> = store.clone();
        async move {
            blockipam_agent::serve(listener, store, ServerConfig::default(), async {
                let _ = stopped.await;
            })
            .await;
            drop(guard);
        }
    });
    let client = AgentStore::connect(
        AgentConfig::new(&socket).with_timeouts(Duration::from_secs(10), Duration::from_secs(10)),
    )
    .await
    .expect("connect");
    assert_eq!(client.protocol().await, Some(PROTOCOL_V4));
    assert_windows(&client.read_many(&range_batch()).await.expect("read_many"));
    // It is replaced by an agent of the build before protocol 3 (a rollback) on the same socket.
    let _ = stop.send(());
    todays_agent.await.expect("today's agent");
    let received = ReceivedReads::default();
    let older_agent = tokio::spawn(protocol_2_agent(
        UnixListener::bind(&socket).expect("bind again"),
        Arc::clone(&store),
        Arc::clone(&received),
    ));
    // Until the client has seen its connection end, a call may go over it and be lost.
    let mut attempts = 0;
    let results = loop {
        attempts += 1;
        match client.read_many(&range_batch()).await {
            Ok(results) => break results,
            Err(KvError::Unavailable { .. }) if attempts < 100 => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("after {attempts} attempts: {e}"),
        }
    };
    assert_eq!(client.protocol().await, Some(PROTOCOL_V2));
    assert_windows(&results);
    assert_eq!(
        received.lock().expect("received").clone(),
        vec![vec![
            WireRead::Get("r/b".into()),
            WireRead::List("r/a/".into()),
            WireRead::List("r/a/".into()),
            WireRead::List("r/a/".into()),
            WireRead::List("r/a/".into()),
            WireRead::List("r/a/".into()),
        ]],
        "the protocol 2 agent was sent a range"
    );
    drop(client);
    older_agent.await.expect("the protocol 2 agent");
}

/// Protocol 4 from a raw peer, served through the agent's read cache: malformed cached reads and
/// prefix conditions get the store's invalid-argument answer and write nothing, a stale prefix
/// condition is a conflict naming its prefix, and the connection goes on: the next cached read is
/// answered, from the cache the second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_protocol_4_requests_are_refused_and_the_connection_goes_on() {
    use backend_agent::protocol::{WireCondition, WireError, WireOp, WireTxn};
    use ipam_core::caching::CachingStore;
    let backing = store_around_r_a().await;
    let cached = CachingStore::new(Arc::clone(&backing) as Arc<dyn KvStore>);
    let agent =
        common::InProcessAgent::serve_on_current_runtime(Arc::new(cached), ServerConfig::default());
    let (mut stream, protocol) = greeted(&agent, PROTOCOL_V4).await;
    assert_eq!(protocol, PROTOCOL_V4);
    let before = backing.list("").await.expect("list");
    let invalid = |response: &Response| {
        matches!(
            response,
            Response::Failed(WireError::InvalidArgument { .. })
        )
    };
    let cached_read = |reads: Vec<WireRead>| Request::ReadManyCached {
        reads,
        may_use_cache: true,
    };
    let refused = exchange(
        &mut stream,
        1,
        protocol,
        cached_read(vec![WireRead::Get(String::new())]),
    )
    .await;
    assert!(invalid(&refused), "an empty key: {refused:?}");
    let zero = WireRead::Range {
        prefix: "r/a/".into(),
        from: String::new(),
        limit: 0,
    };
    let refused = exchange(&mut stream, 2, protocol, cached_read(vec![zero])).await;
    assert!(invalid(&refused), "a range of 0 keys: {refused:?}");
    let commit_on = |prefix: &str, revision: u64| Request::Commit {
        txn: WireTxn {
            conditions: vec![WireCondition::NoPutAfter(prefix.into(), revision)],
            ops: vec![WireOp::Put("x".into(), b"x".to_vec())],
        },
    };
    let refused = exchange(&mut stream, 3, protocol, commit_on("r/\0", u64::MAX)).await;
    assert!(invalid(&refused), "a prefix holding NUL: {refused:?}");
    let stale = exchange(&mut stream, 4, protocol, commit_on("r/a/", 1)).await;
    assert_eq!(
        stale,
        Response::Failed(WireError::Conflict { key: "r/a/".into() }),
        "a put under the prefix after revision 1"
    );
    assert_eq!(
        backing.list("").await.expect("list"),
        before,
        "something was written"
    );
    let reads = vec![WireRead::List("r/a/".into()), WireRead::Get("r/b".into())];
    for (id, from_cache) in [(5, false), (6, true)] {
        match exchange(&mut stream, id, protocol, cached_read(reads.clone())).await {
            Response::ReadManyCached {
                results,
                validators,
                from_cache: answered_from_cache,
            } => {
                assert_eq!(answered_from_cache, from_cache, "request {id}");
                assert_eq!(results.len(), 2);
                assert_eq!(
                    validators.len(),
                    6,
                    "the listing's prefix and 4 keys, the key"
                );
            }
            other => panic!("request {id}: expected a cached read's answer, got {other:?}"),
        }
    }
    agent.stop().await;
}
