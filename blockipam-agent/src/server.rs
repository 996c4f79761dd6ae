//! The server: an accept loop, one task per connection (peer credentials checked first) that reads
//! requests, answers the first one in flight itself and runs any others beside it as tasks of
//! their own, and writes answers back in whatever order they finish; bounded shutdown.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use backend_agent::protocol::{
    encode_frame, read_frame, write_frame, FrameError, Request, RequestFrame, Response,
    ResponseFrame, StoreIdentity, WireError, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES,
    PROTOCOL_VERSION,
};
use ipam_core::{KvError, KvStore, Read};
use tokio::io::BufReader;
use tokio::net::unix::OwnedReadHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::metrics::{AgentMetrics, ConnectionOutcome};

/// The read buffer of a connection: most request frames fit whole (larger ones are read past it).
const READ_BUFFER_BYTES: usize = 16 * 1024;

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
    let (reader, mut writer) = stream.into_split();
    let limit = config.max_in_flight_per_connection.max(1);
    // The request a client waits on (a plugin call has one at a time) runs on this task and its
    // answer is written from here: no task spawned, no channel, no other thread woken between
    // the store's answer and the socket. Requests read while it is in flight run as tasks of
    // their own; their answers come back here to be written.
    let mut inline: Option<Answering> = None;
    let mut requests: JoinSet<Option<Vec<u8>>> = JoinSet::new();
    // One read in progress at a time, kept across iterations so that no frame is half read.
    let mut reading = Some(read_next(BufReader::with_capacity(
        READ_BUFFER_BYTES,
        reader,
    )));
    let mut greeted = false;
    let mut writable = true;
    let mut server_gone = false;
    loop {
        let in_flight = usize::from(inline.is_some()) + requests.len();
        if reading.is_none() && in_flight == 0 {
            break;
        }
        let stopping = server_gone || *stopped.borrow();
        if stopping {
            // Shutdown: no new request is read; those already read are answered (the
            // server's drain timeout bounds this).
            reading = None;
            if in_flight == 0 {
                break;
            }
        }
        let can_read = reading.is_some() && in_flight < limit;
        let event = tokio::select! {
            answer = poll_answering(&mut inline) => {
                inline = None;
                Event::Answer(answer)
            }
            Some(joined) = requests.join_next(), if !requests.is_empty() => match joined {
                Ok(answer) => Event::Answer(answer),
                Err(e) => {
                    tracing::warn!("a request of uid {uid} failed without an answer: {e}");
                    continue;
                }
            },
            (reader, frame) = poll_reading(&mut reading), if can_read => Event::Frame(reader, frame),
            changed = stopped.changed(), if !stopping => {
                // A server gone without a word stops this connection as a shutdown does.
                server_gone = changed.is_err();
                continue;
            }
        };
        let frame = match event {
            Event::Answer(answer) => {
                if let (Some(bytes), true) = (answer, writable) {
                    if let Err(e) = write_frame(&mut writer, &bytes).await {
                        tracing::debug!("a client went away before its answer was written: {e}");
                        // Requests already read still run to the end; nothing more is read.
                        writable = false;
                        reading = None;
                    }
                }
                continue;
            }
            Event::Frame(reader, frame) => match frame {
                Ok(Some(frame)) => {
                    reading = Some(read_next(reader));
                    frame
                }
                Ok(None) => {
                    reading = None;
                    continue;
                }
                Err(e) => {
                    tracing::debug!(uid, "closing a connection: {e}");
                    reading = None;
                    continue;
                }
            },
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
            if let Some(bytes) = encode(frame.id, response) {
                if let Err(e) = write_frame(&mut writer, &bytes).await {
                    tracing::debug!("a client went away before its hello was answered: {e}");
                    break;
                }
            }
            if !greeted {
                break;
            }
            continue;
        }
        let answering = respond(Arc::clone(&store), frame, &config);
        if inline.is_none() {
            inline = Some(answering);
        } else {
            requests.spawn(answering);
        }
    }
    // Dropping the write half ends the stream for the client.
    drop(writer);
}

/// The encoded answer to one request, `None` when it cannot be encoded at all.
type Answering = Pin<Box<dyn Future<Output = Option<Vec<u8>>> + Send>>;

/// A read of the next request frame; it hands the read half back with the frame.
type Reading = Pin<
    Box<dyn Future<Output = (ConnectionReader, Result<Option<RequestFrame>, FrameError>)> + Send>,
>;

/// The read half of a connection, buffered: a frame's length and payload in one system call.
type ConnectionReader = BufReader<OwnedReadHalf>;

/// What happened on a connection.
enum Event {
    /// A request's answer is ready (`None`: it could not be encoded).
    Answer(Option<Vec<u8>>),
    /// The next frame (or the end of the stream, or a failure), with the read half.
    Frame(ConnectionReader, Result<Option<RequestFrame>, FrameError>),
}

fn read_next(mut reader: ConnectionReader) -> Reading {
    Box::pin(async move {
        // Kept until it completes: only a connection that stops reading (shutdown, a client
        // gone) drops it half way.
        let frame = read_frame::<_, RequestFrame>(&mut reader, MAX_REQUEST_BYTES).await;
        (reader, frame)
    })
}

/// Waits for the request answered on the connection's task; never completes when there is none.
async fn poll_answering(inline: &mut Option<Answering>) -> Option<Vec<u8>> {
    match inline {
        Some(answering) => answering.await,
        None => std::future::pending().await,
    }
}

/// Waits for the read in progress; never completes when there is none.
async fn poll_reading(
    reading: &mut Option<Reading>,
) -> (ConnectionReader, Result<Option<RequestFrame>, FrameError>) {
    match reading {
        Some(read) => read.await,
        None => std::future::pending().await,
    }
}

/// Answers one request: runs it on the store, records its latency, encodes the answer.
fn respond(store: Arc<dyn KvStore>, frame: RequestFrame, config: &ServerConfig) -> Answering {
    let served = config.served.clone();
    let metrics = config.metrics.clone();
    Box::pin(async move {
        let kind = frame.request.kind();
        let started = std::time::Instant::now();
        let response = answer(&*store, frame.request, served).await;
        if let Some(metrics) = &metrics {
            metrics.observe_request(kind, started.elapsed());
        }
        encode(frame.id, response)
    })
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
