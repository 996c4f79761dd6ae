//! The server: an accept loop, one task per connection (peer credentials checked first), one task
//! per request, answers written back in whatever order they finish; bounded shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use backend_agent::protocol::{
    encode_frame, read_frame, write_frame, Request, RequestFrame, Response, ResponseFrame,
    StoreIdentity, WireError, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, PROTOCOL_VERSION,
};
use ipam_core::{KvError, KvStore, Read};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinSet;

use crate::metrics::{AgentMetrics, ConnectionOutcome};

/// How the server treats its peers and its shutdown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// The store served, announced in the hello.
    pub served: StoreIdentity,
    /// Users besides root allowed to connect (checked with the socket's peer credentials).
    pub allowed_uids: Vec<u32>,
    /// How long requests in flight at shutdown may take to finish before they are abandoned.
    pub drain_timeout: Duration,
    /// Requests one connection may have in flight; further ones wait to be read.
    pub max_in_flight_per_connection: usize,
    /// Where request latencies and connection outcomes are recorded (`--metrics-listen`).
    pub metrics: Option<Arc<AgentMetrics>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            served: StoreIdentity {
                datastore_type: "unnamed".into(),
                path: None,
                etcd_endpoints: Vec::new(),
                etcd_prefix: None,
            },
            allowed_uids: Vec::new(),
            drain_timeout: Duration::from_secs(10),
            max_in_flight_per_connection: 64,
            metrics: None,
        }
    }
}

impl ServerConfig {
    /// True when a peer running as `uid` may use the store: root, or a configured uid.
    pub fn allows(&self, uid: u32) -> bool {
        uid == 0 || self.allowed_uids.contains(&uid)
    }
}

/// Serves `store` on `listener` until `shutdown` completes, then stops accepting, stops reading
/// new requests, waits at most `config.drain_timeout` for the requests in flight (their answers
/// are still sent), abandons the rest and returns. Every clone of `store` it made is dropped by
/// then.
pub async fn serve(
    listener: UnixListener,
    store: Arc<dyn KvStore>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()>,
) {
    let config = Arc::new(config);
    let (stop, stopped) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(serve_connection(
                        stream,
                        Arc::clone(&store),
                        Arc::clone(&config),
                        stopped.clone(),
                    ));
                }
                Err(e) => {
                    // Out of file descriptors and the like: keep serving the connections we have.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = stop.send(true);
    let in_flight = connections.len();
    let drained = tokio::time::timeout(config.drain_timeout, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            connections = connections.len(),
            "requests still running after the shutdown grace of {:?}: abandoned",
            config.drain_timeout
        );
        connections.abort_all();
        while connections.join_next().await.is_some() {}
    } else if in_flight > 0 {
        tracing::info!(connections = in_flight, "connections closed for shutdown");
    }
}

async fn serve_connection(
    stream: UnixStream,
    store: Arc<dyn KvStore>,
    config: Arc<ServerConfig>,
    mut stopped: watch::Receiver<bool>,
) {
    let peer = match stream.peer_cred() {
        Ok(credentials) => credentials,
        Err(e) => {
            tracing::warn!("closing a connection whose peer credentials cannot be read: {e}");
            count_connection(&config, ConnectionOutcome::CredentialsUnreadable);
            return;
        }
    };
    let (uid, pid) = (peer.uid(), peer.pid());
    if !config.allows(uid) {
        count_connection(&config, ConnectionOutcome::Refused);
        tracing::warn!(
            uid,
            pid = ?pid,
            "refused a connection: uid {uid} is not root and not an --allowed-uid"
        );
        refuse(
            stream,
            format!("uid {uid} is not allowed (only root and the agent's --allowed-uid users)"),
        )
        .await;
        return;
    }
    tracing::debug!(uid, pid = ?pid, "connection accepted");
    count_connection(&config, ConnectionOutcome::Accepted);
    let (mut reader, mut writer) = stream.into_split();
    let limit = config.max_in_flight_per_connection.max(1);
    let (answers, mut outgoing) = mpsc::channel::<Vec<u8>>(limit);
    let write_task = tokio::spawn(async move {
        while let Some(frame) = outgoing.recv().await {
            if let Err(e) = write_frame(&mut writer, &frame).await {
                tracing::debug!("a client went away before its answer was written: {e}");
                return;
            }
        }
    });
    let permits = Arc::new(Semaphore::new(limit));
    let mut requests = JoinSet::new();
    let mut greeted = false;
    while !*stopped.borrow() {
        // Reading a frame is not cancelled by anything but shutdown, so no frame is half read.
        let frame = tokio::select! {
            _ = stopped.changed() => break,
            frame = read_frame::<_, RequestFrame>(&mut reader, MAX_REQUEST_BYTES) => frame,
        };
        let frame = match frame {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(uid, "closing a connection: {e}");
                break;
            }
        };
        if !greeted {
            let response = match frame.request {
                Request::Hello { protocol } if protocol == PROTOCOL_VERSION => {
                    greeted = true;
                    Response::Hello {
                        protocol: PROTOCOL_VERSION,
                        served: config.served.clone(),
                    }
                }
                Request::Hello { protocol } => Response::Refused {
                    reason: format!(
                        "protocol version {protocol} is not this agent's {PROTOCOL_VERSION}"
                    ),
                },
                other => Response::Refused {
                    reason: format!("the first request must be a hello, not a {}", other.kind()),
                },
            };
            let refused = !greeted;
            if let Some(bytes) = encode(frame.id, response) {
                let _ = answers.send(bytes).await;
            }
            if refused {
                break;
            }
            continue;
        }
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
            break;
        };
        let store = Arc::clone(&store);
        let answers = answers.clone();
        let served = config.served.clone();
        let metrics = config.metrics.clone();
        requests.spawn(async move {
            let kind = frame.request.kind();
            let started = std::time::Instant::now();
            let response = answer(&*store, frame.request, served).await;
            if let Some(metrics) = &metrics {
                metrics.observe_request(kind, started.elapsed());
            }
            if let Some(bytes) = encode(frame.id, response) {
                let _ = answers.send(bytes).await;
            }
            drop(permit);
        });
        while requests.try_join_next().is_some() {}
    }
    // Requests already read are answered (the server's drain timeout bounds this).
    while requests.join_next().await.is_some() {}
    drop(answers);
    let _ = write_task.await;
}

fn count_connection(config: &ServerConfig, outcome: ConnectionOutcome) {
    if let Some(metrics) = &config.metrics {
        metrics.count_connection(outcome);
    }
}

/// Tells a peer why it is refused, then closes (bounded: a peer that does not read is dropped).
async fn refuse(mut stream: UnixStream, reason: String) {
    if let Some(bytes) = encode(0, Response::Refused { reason }) {
        let _ =
            tokio::time::timeout(Duration::from_secs(1), write_frame(&mut stream, &bytes)).await;
    }
}

async fn answer(store: &dyn KvStore, request: Request, served: StoreIdentity) -> Response {
    let outcome = match request {
        Request::Hello { .. } => Ok(Response::Hello {
            protocol: PROTOCOL_VERSION,
            served,
        }),
        Request::Get { key } => store
            .get(&key)
            .await
            .map(|kv| Response::Got(kv.map(Into::into))),
        Request::List { prefix } => store
            .list(&prefix)
            .await
            .map(|kvs| Response::Listed(kvs.into_iter().map(Into::into).collect())),
        Request::ReadMany { reads } => {
            let reads: Vec<Read> = reads.into_iter().map(Into::into).collect();
            store
                .read_many(&reads)
                .await
                .map(|results| Response::ReadMany(results.into_iter().map(Into::into).collect()))
        }
        Request::Commit { txn } => {
            store
                .commit(txn.into())
                .await
                .map(|revision| Response::Committed {
                    revision: revision.get(),
                })
        }
    };
    outcome.unwrap_or_else(|e| Response::Failed(WireError::from(&e)))
}

/// The frame of an answer; an answer too large to send becomes an error naming its size.
fn encode(id: u64, response: Response) -> Option<Vec<u8>> {
    match encode_frame(&ResponseFrame { id, response }, MAX_RESPONSE_BYTES) {
        Ok(bytes) => Some(bytes),
        Err(e) => {
            tracing::warn!("cannot send an answer: {e}");
            let error = KvError::other(format!("the agent cannot send this answer: {e}"));
            encode_frame(
                &ResponseFrame {
                    id,
                    response: Response::Failed(WireError::from(&error)),
                },
                MAX_RESPONSE_BYTES,
            )
            .ok()
        }
    }
}
