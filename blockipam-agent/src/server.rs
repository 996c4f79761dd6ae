//! The server: an accept loop, one task per connection (peer credentials checked first) that reads
//! requests, answers the first one in flight itself and runs any others beside it as tasks of
//! their own, and writes answers back in whatever order they finish; bounded shutdown.
//!
//! Every request has a deadline (the caller's, protocols 2 and 3; [`V1_CLIENT_TIMEOUT`] after it
//! was read, protocol 1), and every request of every connection passes one [`CommitOrder`]: no
//! commit starts after its deadline, and a request read after a commit started waits for that
//! commit to end, so that a caller that gave up leaves a settled outcome to the next one.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use backend_agent::protocol::{
    decode_request, encode_frame, read_payload, write_frame, FrameError, ReceivedRequest, Request,
    Response, ResponseFrame, StoreIdentity, WireError, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES,
    PROTOCOL_V1, PROTOCOL_VERSION,
};
use backend_agent::AgentConfig;
use ipam_core::{KvError, KvStore, Read};
use tokio::io::BufReader;
use tokio::net::unix::OwnedReadHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, RwLock};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::metrics::{AgentMetrics, ConnectionOutcome};

/// The read buffer of a connection: most request frames fit whole (larger ones are read past it).
const READ_BUFFER_BYTES: usize = 16 * 1024;

/// The deadline of a request from a protocol 1 client, which sends none, counted from when it
/// was read: such a client gives up after its fixed request timeout.
pub const V1_CLIENT_TIMEOUT: Duration = AgentConfig::DEFAULT_REQUEST_TIMEOUT;

/// The order between commits and the requests read after them, shared by every connection of a
/// server: a commit runs alone, once every request admitted before it has ended; a read runs
/// beside other reads, once every commit admitted before it has ended. Admission is in arrival
/// order (the lock is fair), and a commit not admitted by its deadline is never started.
///
/// So when a caller gives up on a commit, either the commit was admitted before the caller's
/// deadline, and every later request (the runtime's next call on the node, made after the
/// caller gave up) waits for its outcome, or it was not, and it never runs.
#[derive(Debug, Default)]
pub struct CommitOrder {
    lock: RwLock<()>,
}

impl CommitOrder {
    /// Runs `commit` once admitted, unless `deadline` passes first.
    async fn commit<T>(
        &self,
        deadline: Instant,
        commit: impl Future<Output = Result<T, KvError>>,
    ) -> Result<T, KvError> {
        let admitted = tokio::time::timeout_at(deadline, self.lock.write()).await;
        match admitted {
            // Checked again once admitted: a free lock is taken even past the deadline.
            Ok(_alone) if Instant::now() < deadline => commit.await,
            _ => Err(KvError::unavailable(
                "the caller's deadline passed before the agent could start this commit (an \
                 earlier commit was still running): nothing was written",
            )),
        }
    }

    /// Runs `read` once every commit admitted before it has ended, unless `deadline` passes
    /// first.
    async fn read<T>(
        &self,
        deadline: Instant,
        read: impl Future<Output = Result<T, KvError>>,
    ) -> Result<T, KvError> {
        match tokio::time::timeout_at(deadline, self.lock.read()).await {
            Ok(_beside_reads) => read.await,
            Err(_) => Err(KvError::unavailable(
                "an earlier commit was still running on the agent when the caller's deadline \
                 passed: nothing was read",
            )),
        }
    }
}

/// How the server treats its peers and its shutdown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// The store served, announced in the hello.
    pub served: StoreIdentity,
    /// Users besides root allowed to connect (checked with the socket's peer credentials).
    pub allowed_uids: Vec<u32>,
    /// The user this agent runs as, allowed to connect too (it can open the store's files itself);
    /// `None` when it cannot be told.
    pub own_uid: Option<u32>,
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
            own_uid: blockipam_store::effective_uid(),
            drain_timeout: Duration::from_secs(10),
            max_in_flight_per_connection: 64,
            metrics: None,
        }
    }
}

impl ServerConfig {
    /// True when a peer running as `uid` may use the store: root, the agent's own user, or a
    /// configured uid.
    pub fn allows(&self, uid: u32) -> bool {
        uid == 0 || self.own_uid == Some(uid) || self.allowed_uids.contains(&uid)
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
    let order = Arc::new(CommitOrder::default());
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
                        Arc::clone(&order),
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
    order: Arc<CommitOrder>,
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
            "refused a connection: uid {uid} is not root, the agent's own user nor an --allowed-uid"
        );
        refuse(
            stream,
            format!(
                "uid {uid} is not allowed (only root, the agent's own user and its --allowed-uid \
                 users)"
            ),
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
    // The hello is framed as in protocol 1 whatever the client speaks; the version it settles
    // frames every later request. A range read arriving on a protocol 2 connection (a client of
    // this build never sends one there) decodes all the same and is served like any other.
    let mut protocol = PROTOCOL_V1;
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
                Ok(Some(payload)) => match decode_request(&payload, protocol) {
                    Ok(frame) => {
                        reading = Some(read_next(reader));
                        frame
                    }
                    Err(e) => {
                        tracing::debug!(uid, "closing a connection: {e}");
                        reading = None;
                        continue;
                    }
                },
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
        let received = Instant::now();
        if !greeted {
            let response = match frame.request {
                Request::Hello { protocol: offered } if offered >= PROTOCOL_V1 => {
                    greeted = true;
                    // The newest version both speak: a client of an older build keeps its own
                    // (1: no deadlines, 2: no range reads).
                    protocol = offered.min(PROTOCOL_VERSION);
                    Response::Hello {
                        protocol,
                        served: config.served.clone(),
                    }
                }
                Request::Hello { protocol: offered } => Response::Refused {
                    reason: format!(
                        "protocol version {offered} is not spoken by this agent (it speaks \
                         {PROTOCOL_V1} to {PROTOCOL_VERSION})"
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
        let deadline = frame
            .deadline
            .map_or(received + V1_CLIENT_TIMEOUT, |deadline| {
                deadline.instant(received)
            });
        let answering = respond(
            Arc::clone(&store),
            Arc::clone(&order),
            frame,
            Received {
                at: received,
                deadline,
            },
            protocol,
            &config,
        );
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

/// A read of the next request frame's payload; it hands the read half back with it.
type Reading =
    Pin<Box<dyn Future<Output = (ConnectionReader, Result<Option<Vec<u8>>, FrameError>)> + Send>>;

/// The read half of a connection, buffered: a frame's length and payload in one system call.
type ConnectionReader = BufReader<OwnedReadHalf>;

/// What happened on a connection.
enum Event {
    /// A request's answer is ready (`None`: it could not be encoded).
    Answer(Option<Vec<u8>>),
    /// The next frame's payload (or the end of the stream, or a failure), with the read half.
    Frame(ConnectionReader, Result<Option<Vec<u8>>, FrameError>),
}

fn read_next(mut reader: ConnectionReader) -> Reading {
    Box::pin(async move {
        // Kept until it completes: only a connection that stops reading (shutdown, a client
        // gone) drops it half way.
        let frame = read_payload(&mut reader, MAX_REQUEST_BYTES).await;
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
) -> (ConnectionReader, Result<Option<Vec<u8>>, FrameError>) {
    match reading {
        Some(read) => read.await,
        None => std::future::pending().await,
    }
}

/// When a request was read from its connection, and the deadline it is answered by.
#[derive(Debug, Clone, Copy)]
struct Received {
    at: Instant,
    deadline: Instant,
}

/// Answers one request: runs it on the store in its place in `order` and by its deadline,
/// records its latency (from when it was read, so that the time it waits for its task to run
/// counts), encodes the answer.
fn respond(
    store: Arc<dyn KvStore>,
    order: Arc<CommitOrder>,
    frame: ReceivedRequest,
    received: Received,
    protocol: u32,
    config: &ServerConfig,
) -> Answering {
    let served = config.served.clone();
    let metrics = config.metrics.clone();
    // Counted from the moment the request was read, not from when its task is first polled.
    let in_flight = metrics.as_ref().map(|metrics| metrics.request_in_flight());
    Box::pin(async move {
        let _in_flight = in_flight;
        let kind = frame.request.kind();
        let asked = Asked {
            store: &*store,
            order: &order,
            deadline: received.deadline,
            protocol,
            served,
        };
        let response = asked.answer(frame.request).await;
        if let Some(metrics) = &metrics {
            metrics.observe_request(kind, received.at.elapsed());
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

/// One request's context: the store, the order it runs in, its deadline, the connection's
/// protocol version and the store's identity (for a repeated hello).
struct Asked<'a> {
    store: &'a dyn KvStore,
    order: &'a CommitOrder,
    deadline: Instant,
    protocol: u32,
    served: StoreIdentity,
}

impl Asked<'_> {
    async fn answer(self, request: Request) -> Response {
        let Asked {
            store,
            order,
            deadline,
            protocol,
            served,
        } = self;
        let outcome =
            match request {
                Request::Hello { .. } => Ok(Response::Hello { protocol, served }),
                Request::Get { key } => order
                    .read(deadline, store.get(&key))
                    .await
                    .map(|kv| Response::Got(kv.map(Into::into))),
                Request::List { prefix } => order
                    .read(deadline, store.list(&prefix))
                    .await
                    .map(|kvs| Response::Listed(kvs.into_iter().map(Into::into).collect())),
                Request::ReadMany { reads } => {
                    let reads: Vec<Read> = reads.into_iter().map(Into::into).collect();
                    order
                        .read(deadline, store.read_many(&reads))
                        .await
                        .map(|results| {
                            Response::ReadMany(results.into_iter().map(Into::into).collect())
                        })
                }
                Request::ReadManyCached {
                    reads,
                    may_use_cache,
                } => {
                    let reads: Vec<Read> = reads.into_iter().map(Into::into).collect();
                    order
                        .read(deadline, store.read_many_cached(&reads, may_use_cache))
                        .await
                        .map(|answered| Response::ReadManyCached {
                            results: answered.results.into_iter().map(Into::into).collect(),
                            validators: answered.validators.into_iter().map(Into::into).collect(),
                            from_cache: answered.from_cache,
                        })
                }
                Request::Commit { txn } => order
                    .commit(deadline, store.commit(txn.into()))
                    .await
                    .map(|revision| Response::Committed {
                        revision: revision.get(),
                    }),
            };
        outcome.unwrap_or_else(|e| Response::Failed(WireError::from(&e)))
    }
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

#[cfg(test)]
mod tests {
    use super::{respond, CommitOrder, Received, ServerConfig};
    use crate::counters::ReclaimCounters;
    use crate::metrics::AgentMetrics;
    use backend_agent::protocol::{ReceivedRequest, Request};
    use ipam_core::{KvStore, MemoryStore};
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::time::Instant;

    /// A request's recorded latency runs from when it was read, not from when its task was first
    /// polled: the time it waited for the runtime (behind other requests) counts.
    #[tokio::test]
    async fn a_requests_latency_counts_the_time_it_waited_to_be_polled() {
        let metrics = Arc::new(AgentMetrics::new(
            Arc::new(ReclaimCounters::default()),
            Duration::ZERO,
        ));
        let config = ServerConfig {
            metrics: Some(Arc::clone(&metrics)),
            ..ServerConfig::default()
        };
        let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
        let read_at = Instant::now();
        let answering = respond(
            Arc::clone(&store),
            Arc::new(CommitOrder::default()),
            ReceivedRequest {
                id: 1,
                deadline: None,
                request: Request::Get { key: "k".into() },
            },
            Received {
                at: read_at,
                deadline: read_at + Duration::from_secs(60),
            },
            3,
            &config,
        );
        let waited = Duration::from_millis(300);
        tokio::time::sleep(waited).await;
        assert!(answering.await.is_some(), "an answer");
        let text = metrics.scrape(&Arc::downgrade(&store), false).await;
        let sum: f64 = text
            .lines()
            .find_map(|line| {
                line.strip_prefix("blockipam_agent_request_duration_seconds_sum{kind=\"get\"} ")
            })
            .unwrap_or_else(|| panic!("no latency of the get in:\n{text}"))
            .parse()
            .expect("a number");
        assert!(
            sum >= waited.as_secs_f64(),
            "recorded {sum} s for a request read {waited:?} before it was polled"
        );
    }

    #[test]
    fn root_the_agents_own_user_and_the_allowed_users_may_connect() {
        let config = ServerConfig {
            allowed_uids: vec![1001],
            own_uid: Some(1000),
            ..ServerConfig::default()
        };
        for (uid, allowed) in [(0, true), (1000, true), (1001, true), (1002, false)] {
            assert_eq!(config.allows(uid), allowed, "uid {uid}");
        }
        let unknown_self = ServerConfig {
            own_uid: None,
            ..ServerConfig::default()
        };
        assert!(unknown_self.allows(0) && !unknown_self.allows(1000));
        // By default the agent's own user is the one this process runs as.
        let default = ServerConfig::default().own_uid;
        assert!(default.is_some());
        assert_eq!(default, blockipam_store::effective_uid());
    }
}
