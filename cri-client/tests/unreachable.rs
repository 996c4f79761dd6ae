//! A runtime that cannot be asked is an error within the deadline, never a hang or an empty answer: no socket, a socket nobody serves, a peer that accepts and never answers, a peer that is not gRPC.

use std::time::{Duration, Instant};

use cri_client::{CriClient, CriError};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;

const DEADLINE: Duration = Duration::from_secs(2);
/// Far above the deadline: only turns a hang into a failure.
const HANG_GUARD: Duration = Duration::from_secs(60);

async fn sandboxes_at(socket: &std::path::Path) -> Result<Vec<cri_client::Sandbox>, CriError> {
    let started = Instant::now();
    let outcome = tokio::time::timeout(HANG_GUARD, async {
        let client = CriClient::connect(socket, DEADLINE).await?;
        client.sandboxes().await
    })
    .await
    .expect("the client gave up by itself");
    assert!(started.elapsed() < HANG_GUARD);
    outcome
}

#[tokio::test]
async fn no_socket_is_a_connect_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("containerd.sock");
    match sandboxes_at(&socket).await {
        Err(CriError::Connect { socket: named, .. }) => assert_eq!(named, socket),
        other => panic!("expected a connect error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_socket_nobody_serves_is_a_connect_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
    let error = sandboxes_at(&socket).await.expect_err("nobody serves it");
    assert!(matches!(error, CriError::Connect { .. }), "{error:?}");
    assert!(error.to_string().contains("stale.sock"), "{error}");
}

#[tokio::test]
async fn a_peer_that_never_answers_fails_within_the_deadline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("silent.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    let _silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let error = sandboxes_at(&socket).await.expect_err("no answer");
    assert!(
        matches!(
            error,
            CriError::Call {
                method: "ListPodSandbox",
                ..
            } | CriError::Connect { .. }
        ),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_peer_that_is_not_grpc_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("http1.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    let _talker = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let _ = stream
                .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                .await;
        }
    });
    let error = sandboxes_at(&socket).await.expect_err("not a CRI");
    assert!(
        matches!(error, CriError::Call { .. } | CriError::Connect { .. }),
        "{error:?}"
    );
}
