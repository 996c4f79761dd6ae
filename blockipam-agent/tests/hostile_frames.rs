//! Hostile frames on both sides of the agent's socket: a claimed length no frame can hold is a
//! clean error on the connection that sent it, never an abort of the agent or of its client; a
//! connection that does not open with a hello the agent can answer is refused and closed.

mod common;

use std::sync::Arc;
use std::time::Duration;

use backend_agent::protocol::{
    encode_frame, read_frame, write_frame, RequestFrame, Response, ResponseFrame,
    MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, PROTOCOL_VERSION,
};
use backend_agent::{AgentConfig, AgentStore};
use blockipam_agent::ServerConfig;
use ipam_core::{KvError, KvStore};
use tokio::io::AsyncReadExt;
use tokio::net::{UnixListener, UnixStream};

/// A request frame (a get, id 0) whose key claims 2^62 bytes: 15 bytes in all.
const HOSTILE_REQUEST: [u8; 15] = [
    0x00, 0x00, 0x00, 0x0b, 0x00, 0x01, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0x40,
];

/// What reading to the end of a connection the agent closed gives: an end of stream, or a reset
/// when the agent closed its end with bytes still unread in its queue (Linux resets a Unix socket
/// closed so). Anything else (another error) fails.
fn assert_closed_by_the_agent(read: &std::io::Result<usize>) {
    assert!(
        read.is_ok()
            || read
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "{read:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_claiming_more_than_its_frame_closes_that_connection_and_the_agent_serves_on() {
    let agent = common::InProcessAgent::serve_on_current_runtime(
        Arc::new(ipam_core::MemoryStore::new()),
        ServerConfig::default(),
    );
    // Sent as the first frame, and again after a hello on a second connection.
    for greet_first in [false, true] {
        let mut hostile = UnixStream::connect(&agent.socket).await.expect("connect");
        if greet_first {
            let hello = encode_frame(
                &RequestFrame {
                    id: 0,
                    request: backend_agent::protocol::Request::Hello {
                        protocol: PROTOCOL_VERSION,
                    },
                },
                MAX_REQUEST_BYTES,
            )
            .expect("encode the hello");
            write_frame(&mut hostile, &hello).await.expect("hello");
            let answer: Option<ResponseFrame> = read_frame(&mut hostile, MAX_RESPONSE_BYTES)
                .await
                .expect("the hello's answer");
            assert!(
                matches!(
                    answer,
                    Some(ResponseFrame {
                        response: Response::Hello { .. },
                        ..
                    })
                ),
                "{answer:?}"
            );
        }
        write_frame(&mut hostile, &HOSTILE_REQUEST)
            .await
            .expect("send the hostile frame");
        // The agent closes this connection (bounded wait: a live agent does it at once).
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(10), hostile.read_to_end(&mut rest))
            .await
            .expect("the agent kept a connection open after an undecodable frame");
        assert_closed_by_the_agent(&closed);
        assert!(
            rest.is_empty(),
            "the agent answered an undecodable frame: {rest:?}"
        );
    }
    // And still serves everyone else.
    let client = agent.client().await;
    client.put("k", b"v".to_vec()).await.expect("put after");
    assert_eq!(
        client.get("k").await.expect("get after").map(|kv| kv.value),
        Some(b"v".to_vec())
    );
    agent.stop().await;
}

/// A first request that is no hello, or a hello offering a version below the first (0), is
/// answered with a refusal naming why, and the connection closed: nothing reaches the store, and
/// the agent serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_does_not_open_with_a_hello_it_can_answer_is_refused_and_closed() {
    use backend_agent::protocol::Request;
    let store = Arc::new(ipam_core::MemoryStore::new());
    let agent = common::InProcessAgent::serve_on_current_runtime(
        Arc::clone(&store) as Arc<dyn KvStore>,
        ServerConfig::default(),
    );
    let commit = || Request::Commit {
        txn: backend_agent::protocol::WireTxn {
            conditions: vec![],
            ops: vec![backend_agent::protocol::WireOp::Put(
                "k".into(),
                b"v".to_vec(),
            )],
        },
    };
    let openings = [
        (
            Request::Hello { protocol: 0 },
            "protocol version 0 is not spoken",
        ),
        (commit(), "the first request must be a hello, not a commit"),
    ];
    for (opening, reason) in openings {
        let mut stream = UnixStream::connect(&agent.socket).await.expect("connect");
        let frame = encode_frame(
            &RequestFrame {
                id: 7,
                request: opening,
            },
            MAX_REQUEST_BYTES,
        )
        .expect("encode");
        write_frame(&mut stream, &frame).await.expect("send");
        // Whatever follows is never read: the connection is closed after the refusal.
        let followed = encode_frame(
            &RequestFrame {
                id: 8,
                request: commit(),
            },
            MAX_REQUEST_BYTES,
        )
        .expect("encode");
        let _ = write_frame(&mut stream, &followed).await;
        let answer: Option<ResponseFrame> = read_frame(&mut stream, MAX_RESPONSE_BYTES)
            .await
            .expect("the refusal");
        match answer {
            Some(ResponseFrame {
                id: 7,
                response: Response::Refused { reason: said },
            }) => assert!(said.contains(reason), "{said}"),
            other => panic!("expected a refusal containing {reason:?}, got {other:?}"),
        }
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut rest))
            .await
            .expect("the agent kept a refused connection open");
        assert_closed_by_the_agent(&closed);
        assert!(rest.is_empty(), "answered after the refusal: {rest:?}");
    }
    assert_eq!(
        store.get("k").await.expect("get"),
        None,
        "a refused peer wrote"
    );
    let client = agent.client().await;
    client.put("k", b"v".to_vec()).await.expect("put after");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_claiming_more_than_its_frame_is_an_error_for_the_call_not_an_abort() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    let fake = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept");
        common::accept_hello(&mut stream).await;
        // Whatever the request: answer "got" with a value claiming 2^62 bytes, in a 14-byte frame.
        let mut length = [0u8; 4];
        stream.read_exact(&mut length).await.expect("a request");
        let mut request = vec![0u8; u32::from_be_bytes(length) as usize];
        stream.read_exact(&mut request).await.expect("its payload");
        let mut hostile = vec![0x00, 0x00, 0x00, 0x0e, 0x01, 0x02, 0x01, 0x01, b'k'];
        hostile.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0x40]);
        write_frame(&mut stream, &hostile)
            .await
            .expect("hostile answer");
        // Keep the connection open until the client lets go.
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
    });
    let client = AgentStore::connect(
        AgentConfig::new(&socket).with_timeouts(Duration::from_secs(5), Duration::from_secs(10)),
    )
    .await
    .expect("connect");
    match client.get("k").await {
        Err(KvError::Unavailable { message }) => {
            assert!(message.contains("claims more"), "{message}")
        }
        other => panic!("expected an unavailable error, got {other:?}"),
    }
    drop(client);
    fake.await.expect("fake agent");
}
