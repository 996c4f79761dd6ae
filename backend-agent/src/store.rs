//! `AgentStore`: the `KvStore` trait over one connection to a blockipam agent, many calls in flight.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use ipam_core::{
    range_of_listing, CachedRead, KeyValue, KvError, KvStore, Read, ReadResult, Revision, Txn,
};
use tokio::io::BufReader;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use tokio::time::Instant;

use crate::config::AgentConfig;
use crate::deadline::caller_deadline;
use crate::error::{answer_missing, connect_failed, hello_timed_out};
use crate::protocol::{
    encode_frame, read_frame, write_frame, BoundedRequestFrame, Request, RequestFrame, Response,
    ResponseFrame, StoreIdentity, WireDeadline, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, PROTOCOL_V1,
    PROTOCOL_V2, PROTOCOL_V3, PROTOCOL_VERSION,
};

/// The read buffer of a connection: most answers fit whole (larger ones are read past it).
const READ_BUFFER_BYTES: usize = 16 * 1024;

/// A store served by a blockipam agent, reached over its unix socket.
///
/// One connection at a time, opened by [`connect`](Self::connect) and opened again by the next
/// call after it was lost; calls are multiplexed on it by request id, so concurrent calls do not
/// wait for each other. Every call is bounded by [`AgentConfig::request_timeout`], and by the
/// caller's deadline when it runs inside [`deadline::within`](crate::deadline::within); the
/// earlier of the two travels with the request, and the agent starts no commit after it.
pub struct AgentStore {
    config: AgentConfig,
    served: StoreIdentity,
    link: tokio::sync::Mutex<Option<Link>>,
}

impl fmt::Debug for AgentStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentStore")
            .field("socket", &self.config.socket)
            .field("served", &self.served)
            .finish_non_exhaustive()
    }
}

impl AgentStore {
    /// Connects to the agent at `config.socket` and exchanges the hello, within
    /// `config.connect_timeout` (and the caller's deadline, if earlier). An agent that speaks
    /// only protocol version 1 is spoken to in it (its requests carry no deadline; a warning is
    /// logged). Below protocol 3 a `Read::Range` is sent as the listing of its prefix and its
    /// window cut here, decided anew for each connection (one opened again after a loss may reach
    /// an agent of another version).
    ///
    /// # Errors
    /// [`KvError::Unavailable`] when there is no socket, nothing accepts on it, or the agent does
    /// not answer in time; [`KvError::Other`] when the agent refuses this peer, speaks no
    /// protocol version this client does, or connecting is not permitted.
    pub async fn connect(config: AgentConfig) -> Result<AgentStore, KvError> {
        let (link, served) = open_link(&config).await?;
        Ok(AgentStore {
            config,
            served,
            link: tokio::sync::Mutex::new(Some(link)),
        })
    }

    /// The protocol version spoken with the agent on the current connection.
    pub async fn protocol(&self) -> Option<u32> {
        self.link.lock().await.as_ref().map(|link| link.protocol)
    }

    /// The store the agent said it serves.
    pub fn served(&self) -> &StoreIdentity {
        &self.served
    }

    /// The agent's socket.
    pub fn socket(&self) -> &Path {
        &self.config.socket
    }

    /// The current connection, opened again if it was lost.
    async fn link(&self) -> Result<Link, KvError> {
        let mut current = self.link.lock().await;
        if let Some(link) = current.as_ref() {
            if !link.shared.is_closed() {
                return Ok(link.clone());
            }
        }
        *current = None;
        let (link, served) = open_link(&self.config).await?;
        if !served.matches(&self.served) {
            return Err(KvError::unavailable(format!(
                "the blockipam agent at {} now serves {served}, not {} that this client was using",
                self.config.socket.display(),
                self.served
            )));
        }
        *current = Some(link.clone());
        Ok(link)
    }

    async fn call(&self, request: Request) -> Result<Response, KvError> {
        self.call_spoken(request)
            .await
            .map(|(response, _protocol)| response)
    }

    /// Sends `request` over the current connection (opened again if it was lost, possibly to an
    /// agent of another version), as that connection's protocol can carry it
    /// ([`Request::spoken_in`]), and returns the answer with the protocol it went in.
    ///
    /// A request the agent never saw (its connection was found closed before it was written, or
    /// writing it failed: an agent restarted between two calls, before this client noticed its
    /// connection end), and a read whose connection ended before its answer came (an agent
    /// stopping reads no new request), is sent once more over a connection opened again, within
    /// the same deadline; a commit is never sent again once it may have reached the agent.
    async fn call_spoken(&self, request: Request) -> Result<(Response, u32), KvError> {
        let kind = request.kind();
        let timed_out = Instant::now() + self.config.request_timeout;
        let (deadline, gives_up) = match caller_deadline() {
            Some(caller) if caller < timed_out => {
                (caller, "no answer before the caller's deadline".to_owned())
            }
            _ => (
                timed_out,
                format!("no answer within {:?}", self.config.request_timeout),
            ),
        };
        let mut failed_before: Option<String> = None;
        loop {
            let link = match tokio::time::timeout_at(deadline, self.link()).await {
                Ok(Ok(link)) => link,
                Ok(Err(e)) => return Err(after_first_try(e, kind, failed_before.as_deref())),
                Err(_) => {
                    let e = KvError::unavailable(format!(
                        "{gives_up}: the {kind} was not sent, reconnecting to the blockipam \
                         agent at {} took too long",
                        self.config.socket.display()
                    ));
                    return Err(after_first_try(e, kind, failed_before.as_deref()));
                }
            };
            let protocol = link.protocol;
            let spoken = request.clone().spoken_in(protocol).map_err(|why| {
                KvError::invalid(format!(
                    "{why}; the {kind} was not sent to the blockipam agent at {}",
                    self.config.socket.display()
                ))
            })?;
            match self.send_over(&link, spoken, deadline, &gives_up).await {
                Sent::Answered(answer) => return answer.map(|response| (response, protocol)),
                Sent::Again(why) => match failed_before {
                    None => {
                        tracing::debug!(
                            socket = %self.config.socket.display(),
                            "{why}; sending the {kind} again over a new connection"
                        );
                        failed_before = Some(why);
                    }
                    Some(first) => {
                        return Err(KvError::unavailable(format!(
                            "{why}; tried over two connections to the blockipam agent at {} \
                             (over the first: {first})",
                            self.config.socket.display()
                        )))
                    }
                },
            }
        }
    }

    /// Sends `request`, already spoken in `link`'s protocol, over `link` and waits for its
    /// answer until `deadline`.
    async fn send_over(
        &self,
        link: &Link,
        request: Request,
        deadline: Instant,
        gives_up: &str,
    ) -> Sent {
        let kind = request.kind();
        let is_write = request.is_write();
        let id = link.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let encoded = if link.protocol >= PROTOCOL_V2 {
            let deadline = WireDeadline::at(deadline);
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
        };
        let frame = match encoded {
            Ok(frame) => frame,
            Err(e) => {
                return Sent::Answered(Err(KvError::invalid(format!(
                    "cannot send this {kind} to the agent: {e}"
                ))))
            }
        };
        let lost_before_sent = || format!("the connection was lost before the {kind} was sent");
        let Some(answer) = link.shared.register(id) else {
            return Sent::Again(lost_before_sent());
        };
        if link.outgoing.send((id, frame)).is_err() {
            link.shared.forget(id);
            return Sent::Again(lost_before_sent());
        }
        let socket = &self.config.socket;
        Sent::Answered(match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(Ok(Response::Failed(error)))) => Err(error.into()),
            Ok(Ok(Ok(response))) => Ok(response),
            Ok(Ok(Err(Failure::NotSent(why)))) => {
                return Sent::Again(format!("{why}; the {kind} was not sent"))
            }
            Ok(Ok(Err(Failure::Lost(why)))) if !is_write => {
                return Sent::Again(format!("{why} before the {kind} was answered"))
            }
            Ok(Ok(Err(Failure::Lost(why)))) => Err(answer_missing(socket, kind, is_write, &why)),
            Ok(Err(_)) => Err(answer_missing(
                socket,
                kind,
                is_write,
                "the connection was dropped",
            )),
            Err(_) => {
                link.shared.forget(id);
                Err(answer_missing(socket, kind, is_write, gives_up))
            }
        })
    }
}

/// `error`, met connecting again to send a `kind` once more, naming why the first try failed
/// (`first`) when there was one.
fn after_first_try(error: KvError, kind: &str, first: Option<&str>) -> KvError {
    match (error, first) {
        (KvError::Unavailable { message }, Some(first)) => KvError::unavailable(format!(
            "{message} (connecting again to send the {kind} once more, after: {first})"
        )),
        (error, _) => error,
    }
}

/// What became of a request sent over one connection.
enum Sent {
    /// The agent answered, or the request may have reached it: this is the call's result.
    Answered(Result<Response, KvError>),
    /// The agent never saw the request, or it is a read whose connection ended before its
    /// answer, for this reason: it may go over another connection.
    Again(String),
}

/// The answer to `read` from the `result` an agent spoken to in `protocol` gave: before
/// protocol 3 a range was sent as the listing of its prefix, and its window is cut from it here.
fn answer_in(read: &Read, result: ReadResult, protocol: u32) -> ReadResult {
    match (read, result) {
        (Read::Range { from, limit, .. }, ReadResult::Listed(listed)) if protocol < PROTOCOL_V3 => {
            ReadResult::Listed(range_of_listing(listed, from, *limit))
        }
        (_, result) => result,
    }
}

fn unexpected(kind: &str, response: &Response) -> KvError {
    KvError::other(format!(
        "the blockipam agent answered a {kind} with {}",
        match response {
            Response::Hello { .. } => "a hello",
            Response::Refused { .. } => "a refusal",
            Response::Got(_) => "a get result",
            Response::Listed(_) => "a list result",
            Response::ReadMany(_) => "a batched read result",
            Response::Committed { .. } => "a commit result",
            Response::Failed(_) => "an error",
            Response::ReadManyCached { .. } => "a batched read result from the agent's cache",
        }
    ))
}

#[async_trait]
impl KvStore for AgentStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        match self.call(Request::Get { key: key.into() }).await? {
            Response::Got(kv) => Ok(kv.map(Into::into)),
            other => Err(unexpected("get", &other)),
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        match self
            .call(Request::List {
                prefix: prefix.into(),
            })
            .await?
        {
            Response::Listed(kvs) => Ok(kvs.into_iter().map(Into::into).collect()),
            other => Err(unexpected("list", &other)),
        }
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        txn.validate()?;
        match self.call(Request::Commit { txn: txn.into() }).await? {
            Response::Committed { revision } => Ok(Revision(revision)),
            other => Err(unexpected("commit", &other)),
        }
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        let answered = self.batched_read(reads, None).await?;
        Ok(answered.results)
    }

    /// Asked of the agent (protocol 4 on), which may answer from what it kept; an agent of an
    /// older protocol reads the store and gives no conditions.
    async fn read_many_cached(
        &self,
        reads: &[Read],
        may_use_cache: bool,
    ) -> Result<CachedRead, KvError> {
        self.batched_read(reads, Some(may_use_cache)).await
    }
}

impl AgentStore {
    /// A batched read: `ReadManyCached` when `cached` says whether the agent may answer from
    /// what it kept, `ReadMany` when it is None.
    async fn batched_read(
        &self,
        reads: &[Read],
        cached: Option<bool>,
    ) -> Result<CachedRead, KvError> {
        // Refused before anything is sent, as every store refuses it: an agent spoken to in
        // protocol 1 or 2 is asked for the prefix's listing, which has no limit to refuse.
        for read in reads {
            if let Read::Range { .. } = read {
                read.validate()?;
            }
        }
        let count = reads.len();
        let wire_reads = reads.iter().map(Into::into).collect();
        let request = match cached {
            Some(may_use_cache) => Request::ReadManyCached {
                reads: wire_reads,
                may_use_cache,
            },
            None => Request::ReadMany { reads: wire_reads },
        };
        let (response, protocol) = self.call_spoken(request).await?;
        let (results, validators, from_cache) = match response {
            Response::ReadMany(results) => (results, Vec::new(), false),
            Response::ReadManyCached {
                results,
                validators,
                from_cache,
            } if cached.is_some() => (results, validators, from_cache),
            other => return Err(unexpected("read_many", &other)),
        };
        if results.len() != count {
            return Err(KvError::other(format!(
                "the blockipam agent answered {} reads with {} results",
                count,
                results.len()
            )));
        }
        Ok(CachedRead {
            results: reads
                .iter()
                .zip(results)
                .map(|(read, result)| answer_in(read, result.into(), protocol))
                .collect(),
            validators: validators.into_iter().map(Into::into).collect(),
            from_cache,
            current_as_of: Vec::new(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// One connection: a writer task sending whole frames, a reader task handing answers to callers.
// ---------------------------------------------------------------------------------------------

/// Why an answer will never come.
#[derive(Debug)]
enum Failure {
    /// The request's frame was not (entirely) written: the agent never saw it.
    NotSent(String),
    /// The connection ended after the request may have reached the agent.
    Lost(String),
}

type Answer = Result<Response, Failure>;

#[derive(Debug, Default)]
struct LinkState {
    closed: bool,
    pending: HashMap<u64, oneshot::Sender<Answer>>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<LinkState>,
    next_id: AtomicU64,
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, LinkState> {
        // A panic while holding this lock leaves plain data behind; keep using it.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn is_closed(&self) -> bool {
        self.state().closed
    }

    /// Registers a call; `None` when the connection is already closed.
    fn register(&self, id: u64) -> Option<oneshot::Receiver<Answer>> {
        let mut state = self.state();
        if state.closed {
            return None;
        }
        let (sender, receiver) = oneshot::channel();
        state.pending.insert(id, sender);
        Some(receiver)
    }

    fn forget(&self, id: u64) {
        self.state().pending.remove(&id);
    }

    fn deliver(&self, id: u64, answer: Answer) {
        if let Some(sender) = self.state().pending.remove(&id) {
            // The caller may have given up (timeout): nobody to tell.
            let _ = sender.send(answer);
        }
    }

    /// After writing request `failed` failed: marks the connection closed, then fails that
    /// request and every one still queued behind it as not sent (the agent saw none of them),
    /// and the calls already written as lost. Closed first, under the lock that registers calls:
    /// a caller told its request was not sent finds the connection closed and opens another,
    /// and a request registered after this is refused before it is queued.
    fn close_unwritten(
        &self,
        failed: u64,
        queue: &mut mpsc::UnboundedReceiver<(u64, Vec<u8>)>,
        why: &str,
    ) {
        let (pending, unwritten) = {
            let mut state = self.state();
            state.closed = true;
            queue.close();
            let mut unwritten = vec![failed];
            while let Ok((id, _)) = queue.try_recv() {
                unwritten.push(id);
            }
            (std::mem::take(&mut state.pending), unwritten)
        };
        for (id, sender) in pending {
            let failure = if unwritten.contains(&id) {
                Failure::NotSent(why.to_owned())
            } else {
                Failure::Lost(why.to_owned())
            };
            let _ = sender.send(Err(failure));
        }
    }

    /// Marks the connection closed and fails every call still waiting.
    fn close(&self, why: &str) {
        let pending = {
            let mut state = self.state();
            state.closed = true;
            std::mem::take(&mut state.pending)
        };
        for (_, sender) in pending {
            let _ = sender.send(Err(Failure::Lost(why.to_owned())));
        }
    }
}

/// Aborts the reader task when the last handle of a connection goes.
#[derive(Debug)]
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Debug, Clone)]
struct Link {
    /// The protocol version negotiated in the hello.
    protocol: u32,
    outgoing: mpsc::UnboundedSender<(u64, Vec<u8>)>,
    shared: Arc<Shared>,
    _reader: Arc<AbortOnDrop>,
}

async fn open_link(config: &AgentConfig) -> Result<(Link, StoreIdentity), KvError> {
    let socket = config.socket.as_path();
    let (stream, served, protocol) = tokio::time::timeout(config.connect_timeout, greet(socket))
        .await
        .map_err(|_| hello_timed_out(socket, config.connect_timeout))??;
    let (read_half, write_half) = stream.into_split();
    let shared = Arc::new(Shared {
        state: Mutex::default(),
        next_id: AtomicU64::new(1),
    });
    let (outgoing, queue) = mpsc::unbounded_channel();
    tokio::spawn(write_loop(write_half, queue, Arc::clone(&shared)));
    let reader = tokio::spawn(read_loop(read_half, Arc::clone(&shared)));
    Ok((
        Link {
            protocol,
            outgoing,
            shared,
            _reader: Arc::new(AbortOnDrop(reader)),
        },
        served,
    ))
}

/// Whether a client running as `own_uid` may talk to a server running as `server_uid`: root, or
/// the client's own user. Anyone else listening at the agent's socket could be an impostor that
/// hands out addresses or collects what the client sends.
fn server_is_trusted(server_uid: u32, own_uid: u32) -> bool {
    server_uid == 0 || server_uid == own_uid
}

/// The effective uid of this process, as `SO_PEERCRED` reports it for a socket pair's other end
/// (the same credentials the server's uid is read from); read once.
fn own_uid() -> std::io::Result<u32> {
    static OWN_UID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    if let Some(uid) = OWN_UID.get() {
        return Ok(*uid);
    }
    let (ours, _other) = UnixStream::pair()?;
    let uid = ours.peer_cred()?.uid();
    Ok(*OWN_UID.get_or_init(|| uid))
}

/// Refuses the server at the other end of `stream` unless [`server_is_trusted`]; nothing has been
/// sent on the stream yet.
fn check_server(stream: &UnixStream, socket: &Path) -> Result<(), KvError> {
    let shown = socket.display();
    let server = stream.peer_cred().map_err(|e| {
        KvError::other(format!(
            "cannot read who serves the blockipam agent socket {shown} (SO_PEERCRED): {e}; \
             nothing was sent"
        ))
    })?;
    let own = own_uid().map_err(|e| {
        KvError::other(format!(
            "cannot tell which user runs this client (a socket pair's credentials): {e}; nothing \
             was sent to {shown}"
        ))
    })?;
    if server_is_trusted(server.uid(), own) {
        return Ok(());
    }
    let pid = server
        .pid()
        .map(|pid| format!(", pid {pid}"))
        .unwrap_or_default();
    Err(KvError::other(format!(
        "refusing the blockipam agent socket {shown}: it is served by uid {}{pid}, neither root \
         nor uid {own} that runs this client, so it may be an impostor; nothing was sent. Run \
         blockipam-agent as root (or as this user), or remove what listens there",
        server.uid()
    )))
}

/// What an agent answered to a hello.
enum Greeting {
    /// It serves this client in `protocol`.
    Accepted {
        stream: UnixStream,
        served: StoreIdentity,
        protocol: u32,
    },
    /// It refused the version offered (an agent of an older release), saying `reason`.
    VersionRefused { reason: String },
}

/// Connects and exchanges the hello in the newest version, then, with an agent that refuses
/// it, in protocol 1 (unbounded: the caller bounds it). Returns the negotiated version.
async fn greet(socket: &Path) -> Result<(UnixStream, StoreIdentity, u32), KvError> {
    let refused = match hello(socket, PROTOCOL_VERSION).await? {
        Greeting::Accepted {
            stream,
            served,
            protocol,
        } => return Ok((stream, served, protocol)),
        Greeting::VersionRefused { reason } => reason,
    };
    match hello(socket, PROTOCOL_V1).await? {
        Greeting::Accepted {
            stream,
            served,
            protocol,
        } => {
            tracing::warn!(
                socket = %socket.display(),
                "the blockipam agent speaks protocol version {protocol} only, this client \
                 {PROTOCOL_VERSION} ({refused}): its requests carry no deadline, so a call that \
                 gives up may still be committed after it; upgrade the agent to this release"
            );
            Ok((stream, served, protocol))
        }
        Greeting::VersionRefused { reason } => Err(KvError::other(format!(
            "the blockipam agent at {} refused protocol versions {PROTOCOL_VERSION} ({refused}) \
             and {PROTOCOL_V1} ({reason}): run the same blockipam release on both sides",
            socket.display()
        ))),
    }
}

/// Connects, checks who serves the socket, and exchanges one hello offering protocol version
/// `offered` (unbounded).
async fn hello(socket: &Path, offered: u32) -> Result<Greeting, KvError> {
    let mut stream = UnixStream::connect(socket)
        .await
        .map_err(|e| connect_failed(socket, &e))?;
    check_server(&stream, socket)?;
    let frame = encode_frame(
        &RequestFrame {
            id: 0,
            request: Request::Hello { protocol: offered },
        },
        MAX_REQUEST_BYTES,
    )
    .map_err(|e| KvError::other(format!("cannot encode the hello: {e}")))?;
    // A refusing agent may close before reading the hello: read its reason even if writing failed.
    let written = write_frame(&mut stream, &frame).await;
    let answer = read_frame::<_, ResponseFrame>(&mut stream, MAX_RESPONSE_BYTES).await;
    let shown = socket.display();
    match answer {
        // An agent of an older release refuses any version but its own with these words.
        Ok(Some(ResponseFrame {
            response: Response::Refused { reason },
            ..
        })) if reason.starts_with("protocol version ") => Ok(Greeting::VersionRefused { reason }),
        Ok(Some(ResponseFrame {
            response: Response::Refused { reason },
            ..
        })) => Err(KvError::other(format!(
            "the blockipam agent at {shown} refused this connection: {reason}"
        ))),
        Ok(Some(ResponseFrame {
            response: Response::Hello { protocol, served },
            ..
        })) => {
            if (PROTOCOL_V1..=offered).contains(&protocol) {
                Ok(Greeting::Accepted {
                    stream,
                    served,
                    protocol,
                })
            } else {
                Err(KvError::other(format!(
                    "the blockipam agent at {shown} speaks protocol version {protocol}, this \
                     client {offered}: run the same blockipam release on both sides"
                )))
            }
        }
        Ok(Some(other)) => Err(KvError::other(format!(
            "the blockipam agent at {shown} answered the hello with {:?}",
            other.response
        ))),
        Ok(None) => Err(KvError::unavailable(format!(
            "the blockipam agent at {shown} closed the connection during the hello{}",
            written
                .err()
                .map(|e| format!(" (sending it failed: {e})"))
                .unwrap_or_default()
        ))),
        Err(e) => Err(KvError::unavailable(format!(
            "the blockipam agent at {shown} failed during the hello: {e}"
        ))),
    }
}

async fn write_loop(
    mut writer: OwnedWriteHalf,
    mut queue: mpsc::UnboundedReceiver<(u64, Vec<u8>)>,
    shared: Arc<Shared>,
) {
    while let Some((id, frame)) = queue.recv().await {
        if let Err(e) = write_frame(&mut writer, &frame).await {
            shared.close_unwritten(id, &mut queue, &format!("writing to the agent failed: {e}"));
            return;
        }
    }
    // Every handle of the store is gone: dropping `writer` ends the stream for the agent.
}

async fn read_loop(reader: OwnedReadHalf, shared: Arc<Shared>) {
    // Buffered: an answer's length and payload in one system call.
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, reader);
    loop {
        match read_frame::<_, ResponseFrame>(&mut reader, MAX_RESPONSE_BYTES).await {
            Ok(Some(frame)) => shared.deliver(frame.id, Ok(frame.response)),
            Ok(None) => {
                shared.close("the agent closed the connection");
                return;
            }
            Err(e) => {
                shared.close(&format!("the connection to the agent failed: {e}"));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode_request, read_payload, ReceivedRequest, WireRead};
    use ipam_core::MemoryStore;
    use std::path::PathBuf;
    use std::time::Duration;
    use tokio::net::UnixListener;

    /// How a fake agent serves one connection: the newest protocol it speaks on it, how many
    /// requests after the hello it answers (`None`: until the client goes), and how it then ends
    /// the connection.
    #[derive(Debug, Clone, Copy)]
    struct FakeConnection {
        newest_protocol: u32,
        answers: Option<usize>,
        ends: Ending,
    }

    /// How a fake agent ends a connection once it has answered what it answers.
    #[derive(Debug, Clone, Copy)]
    enum Ending {
        /// It closes it: the client reads its end.
        Closes,
        /// It stops reading and keeps its end open until the fake agent ends: the client reads
        /// nothing end, and its next write is refused (a broken pipe), the request unseen.
        StopsReading,
        /// It reads the next request (recorded), then closes without answering it.
        ReadsTheNextAndCloses,
    }

    /// A request as a fake agent received it, with the protocol of its connection.
    type Received = Arc<Mutex<Vec<(u32, Request)>>>;

    fn fake_identity() -> StoreIdentity {
        StoreIdentity {
            datastore_type: "fake".into(),
            path: None,
            etcd_endpoints: vec![],
            etcd_prefix: None,
        }
    }

    /// An agent of any build, as far as the protocol goes: serves `store`, one connection after
    /// the other as `connections` says, recording every request. A batched read holding a range
    /// on a connection below protocol 3 is recorded and the connection closed, as an agent of an
    /// older build that cannot decode it does.
    async fn fake_agent(
        listener: UnixListener,
        store: Arc<MemoryStore>,
        connections: Vec<FakeConnection>,
        received: Received,
    ) {
        let mut kept_open = Vec::new();
        for connection in connections {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let hello: RequestFrame = read_frame(&mut stream, MAX_REQUEST_BYTES)
                .await
                .expect("read the hello")
                .expect("a hello frame");
            let Request::Hello { protocol: offered } = hello.request else {
                panic!("the first request was not a hello: {hello:?}");
            };
            let protocol = offered.min(connection.newest_protocol);
            let served = fake_identity();
            answer(&mut stream, hello.id, Response::Hello { protocol, served }).await;
            let mut answered = 0;
            while connection.answers != Some(answered) {
                let Ok(Some(payload)) = read_payload(&mut stream, MAX_REQUEST_BYTES).await else {
                    break;
                };
                let frame = decode_request(&payload, protocol).expect("a request");
                received
                    .lock()
                    .expect("received")
                    .push((protocol, frame.request.clone()));
                let response = match frame.request {
                    Request::ReadMany { reads } => {
                        let holds_range = reads
                            .iter()
                            .any(|read| matches!(read, WireRead::Range { .. }));
                        if holds_range && protocol < PROTOCOL_V3 {
                            break;
                        }
                        let reads: Vec<Read> = reads.into_iter().map(Into::into).collect();
                        match store.read_many(&reads).await {
                            Ok(results) => {
                                Response::ReadMany(results.into_iter().map(Into::into).collect())
                            }
                            Err(e) => Response::Failed((&e).into()),
                        }
                    }
                    Request::Get { key } => {
                        Response::Got(store.get(&key).await.expect("get").map(Into::into))
                    }
                    Request::Commit { txn } => match store.commit(txn.into()).await {
                        Ok(revision) => Response::Committed {
                            revision: revision.get(),
                        },
                        Err(e) => Response::Failed((&e).into()),
                    },
                    other => panic!("the fake agent serves no {}", other.kind()),
                };
                answer(&mut stream, frame.id, response).await;
                answered += 1;
            }
            match connection.ends {
                Ending::Closes => {}
                Ending::StopsReading => {
                    let stream = stream.into_std().expect("the connection as a std stream");
                    stream
                        .shutdown(std::net::Shutdown::Read)
                        .expect("stop reading the connection");
                    kept_open.push(stream);
                }
                Ending::ReadsTheNextAndCloses => {
                    let payload = read_payload(&mut stream, MAX_REQUEST_BYTES)
                        .await
                        .expect("read the next request")
                        .expect("a next request");
                    let frame = decode_request(&payload, protocol).expect("a request");
                    received
                        .lock()
                        .expect("received")
                        .push((protocol, frame.request));
                }
            }
        }
    }

    async fn answer(stream: &mut UnixStream, id: u64, response: Response) {
        let frame =
            encode_frame(&ResponseFrame { id, response }, MAX_RESPONSE_BYTES).expect("encode");
        write_frame(stream, &frame).await.expect("write an answer");
    }

    /// A store with keys in and around the prefix `r/a/`, and a fake agent serving it.
    async fn serve_fake(
        connections: Vec<FakeConnection>,
    ) -> (tempfile::TempDir, AgentStore, Arc<MemoryStore>, Received) {
        let store = Arc::new(MemoryStore::new());
        for key in ["r/a", "r/a/1", "r/a/2", "r/a/3", "r/a/4", "r/ab", "r/b"] {
            store.put(key, key.as_bytes().to_vec()).await.expect("put");
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&socket).expect("bind");
        let received = Received::default();
        tokio::spawn(fake_agent(
            listener,
            Arc::clone(&store),
            connections,
            Arc::clone(&received),
        ));
        let config = AgentConfig::new(&socket)
            .with_timeouts(Duration::from_secs(5), Duration::from_secs(10));
        let client = AgentStore::connect(config).await.expect("connect");
        (dir, client, store, received)
    }

    /// Windows of every shape: from the middle, from below the prefix, past the end, larger than
    /// the rest; beside a get and a list.
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

    fn ranges_sent(received: &Received) -> usize {
        received
            .lock()
            .expect("received")
            .iter()
            .filter_map(|(_, request)| match request {
                Request::ReadMany { reads } => Some(reads),
                _ => None,
            })
            .flatten()
            .filter(|read| matches!(read, WireRead::Range { .. }))
            .count()
    }

    fn keys(result: &ReadResult) -> Vec<&str> {
        match result {
            ReadResult::Listed(kvs) => kvs.iter().map(|kv| kv.key.as_str()).collect(),
            ReadResult::Got(kv) => kv.iter().map(|kv| kv.key.as_str()).collect(),
        }
    }

    /// [`FakeConnection::answers`] of a connection served for as long as the client keeps it.
    const UNTIL_THE_CLIENT_GOES: Option<usize> = None;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_a_protocol_2_agent_a_range_goes_as_a_list_and_its_window_is_cut_here() {
        let (_dir, client, store, received) = serve_fake(vec![FakeConnection {
            newest_protocol: PROTOCOL_V2,
            answers: UNTIL_THE_CLIENT_GOES,
            ends: Ending::Closes,
        }])
        .await;
        assert_eq!(client.protocol().await, Some(PROTOCOL_V2));
        let reads = range_batch();
        let results = client.read_many(&reads).await.expect("read_many");
        assert_eq!(
            results,
            store.read_many(&reads).await.expect("the store's own")
        );
        assert_eq!(keys(&results[1]), ["r/a/2", "r/a/3"]);
        assert_eq!(keys(&results[3]), ["r/a/1", "r/a/2"]);
        assert!(keys(&results[4]).is_empty());
        assert_eq!(keys(&results[5]), ["r/a/3", "r/a/4"]);
        assert_eq!(ranges_sent(&received), 0, "a range was sent in protocol 2");
        let sent = received.lock().expect("received").clone();
        assert_eq!(
            sent,
            vec![(
                PROTOCOL_V2,
                Request::ReadMany {
                    reads: vec![
                        WireRead::Get("r/b".into()),
                        WireRead::List("r/a/".into()),
                        WireRead::List("r/a/".into()),
                        WireRead::List("r/a/".into()),
                        WireRead::List("r/a/".into()),
                        WireRead::List("r/a/".into()),
                    ]
                }
            )]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_a_protocol_3_agent_a_range_goes_as_a_range() {
        let (_dir, client, store, received) = serve_fake(vec![FakeConnection {
            newest_protocol: PROTOCOL_V3,
            answers: UNTIL_THE_CLIENT_GOES,
            ends: Ending::Closes,
        }])
        .await;
        assert_eq!(client.protocol().await, Some(PROTOCOL_V3));
        let reads = range_batch();
        let results = client.read_many(&reads).await.expect("read_many");
        assert_eq!(
            results,
            store.read_many(&reads).await.expect("the store's own")
        );
        assert_eq!(ranges_sent(&received), 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_range_of_limit_0_is_refused_before_anything_is_sent_in_every_protocol() {
        for newest_protocol in [PROTOCOL_V2, PROTOCOL_V3] {
            let (_dir, client, _store, received) = serve_fake(vec![FakeConnection {
                newest_protocol,
                answers: UNTIL_THE_CLIENT_GOES,
                ends: Ending::Closes,
            }])
            .await;
            let refused = client
                .read_many(&[Read::Get("r/b".into()), Read::range("r/a/", "", 0)])
                .await;
            assert!(
                matches!(refused, Err(KvError::InvalidArgument { .. })),
                "protocol {newest_protocol}: {refused:?}"
            );
            // The next call is the first the agent sees.
            client.get("r/b").await.expect("get");
            assert_eq!(
                received.lock().expect("received").clone(),
                vec![(newest_protocol, Request::Get { key: "r/b".into() })],
                "protocol {newest_protocol}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_opened_again_to_an_agent_of_protocol_2_is_sent_no_range() {
        // The first agent speaks 3 and goes after one answer; the one that takes its place
        // (a downgraded agent on the same socket) speaks 2.
        let (_dir, client, store, received) = serve_fake(vec![
            FakeConnection {
                newest_protocol: PROTOCOL_V3,
                answers: Some(1),
                ends: Ending::Closes,
            },
            FakeConnection {
                newest_protocol: PROTOCOL_V2,
                answers: UNTIL_THE_CLIENT_GOES,
                ends: Ending::Closes,
            },
        ])
        .await;
        let reads = range_batch();
        let expected = store.read_many(&reads).await.expect("the store's own");
        assert_eq!(client.read_many(&reads).await.expect("read_many"), expected);
        assert_eq!(ranges_sent(&received), 4);
        // Sent over the first connection before the client saw it end, or not: answered.
        let results = client.read_many(&reads).await.expect("read_many");
        assert_eq!(client.protocol().await, Some(PROTOCOL_V2));
        assert_eq!(results, expected);
        assert_eq!(ranges_sent(&received), 4, "a range was sent in protocol 2");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_the_agent_never_saw_is_sent_again_over_a_connection_opened_again() {
        // The first agent answers one request, then reads no more while its end stays open (so
        // the client's reader sees no end); the agent that takes its place serves on.
        let (_dir, client, store, received) = serve_fake(vec![
            FakeConnection {
                newest_protocol: PROTOCOL_VERSION,
                answers: Some(1),
                ends: Ending::StopsReading,
            },
            FakeConnection {
                newest_protocol: PROTOCOL_VERSION,
                answers: UNTIL_THE_CLIENT_GOES,
                ends: Ending::Closes,
            },
        ])
        .await;
        client.get("r/b").await.expect("the first agent's answer");
        // Writing it to the first connection is refused: a commit the agent never saw, sent
        // again over a new connection, and applied once.
        let before = store.get("r/b").await.expect("get").expect("r/b").revision;
        let txn = Txn::new().then(ipam_core::Op::put("r/new", b"new".to_vec()));
        let revision = client.commit(txn).await.expect("the commit, sent again");
        assert!(revision > before, "{revision:?} after {before:?}");
        let stored = store.get("r/new").await.expect("get").expect("r/new");
        assert_eq!(
            (stored.value.as_slice(), stored.revision),
            (&b"new"[..], revision)
        );
        let commits = received
            .lock()
            .expect("received")
            .iter()
            .filter(|(_, request)| matches!(request, Request::Commit { .. }))
            .count();
        assert_eq!(
            commits, 1,
            "the agents were sent the commit {commits} times"
        );
        // A read after it goes over the new connection too.
        assert_eq!(
            client.get("r/new").await.expect("get").map(|kv| kv.value),
            Some(b"new".to_vec())
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_whose_connection_ends_unanswered_is_sent_again_and_a_commit_is_not() {
        // Each of the first two agents answers one request, reads the next and closes without
        // answering it (an agent stopping); the next two answer none; the fifth serves on.
        let stopping = FakeConnection {
            newest_protocol: PROTOCOL_VERSION,
            answers: Some(1),
            ends: Ending::ReadsTheNextAndCloses,
        };
        let silent = FakeConnection {
            answers: Some(0),
            ..stopping
        };
        let (_dir, client, store, received) = serve_fake(vec![
            stopping,
            stopping,
            silent,
            silent,
            FakeConnection {
                newest_protocol: PROTOCOL_VERSION,
                answers: UNTIL_THE_CLIENT_GOES,
                ends: Ending::Closes,
            },
        ])
        .await;
        client.get("r/a").await.expect("the first agent's answer");
        // Read by the first agent, unanswered: asked again of the second, which answers.
        assert_eq!(
            client
                .get("r/b")
                .await
                .expect("the get, sent again")
                .map(|kv| kv.value),
            Some(b"r/b".to_vec())
        );
        // Read by the second agent, unanswered: it may have been applied, so not sent again.
        let txn = Txn::new().then(ipam_core::Op::put("r/new", b"new".to_vec()));
        let unanswered = client.commit(txn).await;
        assert!(
            matches!(unanswered, Err(KvError::Indeterminate { .. })),
            "{unanswered:?}"
        );
        assert_eq!(store.get("r/new").await.expect("get"), None);
        let sent: Vec<Request> = received
            .lock()
            .expect("received")
            .iter()
            .map(|(_, request)| request.clone())
            .collect();
        let get = |key: &str| Request::Get { key: key.into() };
        assert_eq!(sent[..3], [get("r/a"), get("r/b"), get("r/b")]);
        assert!(matches!(sent[3], Request::Commit { .. }), "{:?}", sent[3]);
        // Read and unanswered over two connections: not sent a third time.
        let unanswered = client.get("r/b").await;
        let Err(KvError::Unavailable { message }) = unanswered else {
            panic!("{unanswered:?}");
        };
        assert!(message.contains("tried over two connections"), "{message}");
        assert_eq!(sent.len() + 2, received.lock().expect("received").len());
        // The next call opens the fifth connection.
        client.get("r/b").await.expect("the fifth agent's answer");
    }

    #[test]
    fn a_failed_write_fails_its_request_and_those_queued_as_not_sent_and_the_rest_as_lost() {
        let shared = Shared::default();
        let (outgoing, mut queue) = mpsc::unbounded_channel();
        let written = shared.register(1).expect("registered");
        let failed = shared.register(2).expect("registered");
        let queued = shared.register(3).expect("registered");
        outgoing.send((3, Vec::new())).expect("queued");
        shared.close_unwritten(2, &mut queue, "writing failed");
        // Closed before anyone is told: a caller told "not sent" opens another connection.
        assert!(shared.is_closed());
        assert!(
            shared.register(4).is_none(),
            "registered on a closed connection"
        );
        assert!(
            outgoing.send((4, Vec::new())).is_err(),
            "queued on a closed connection"
        );
        let told = |mut answer: oneshot::Receiver<Answer>| match answer.try_recv() {
            Ok(Err(Failure::NotSent(why))) => format!("not sent: {why}"),
            Ok(Err(Failure::Lost(why))) => format!("lost: {why}"),
            other => format!("{other:?}"),
        };
        assert_eq!(
            [told(written), told(failed), told(queued)],
            [
                "lost: writing failed",
                "not sent: writing failed",
                "not sent: writing failed"
            ]
        );
    }

    /// A fake agent on a new socket: accepts connections one after the other, answers each
    /// hello with `on_hello` (given the version offered), then answers every request with
    /// `on_request` (given the request as received) until the client goes. Returns the versions
    /// offered, one per connection, once `connections` have ended.
    async fn scripted_agent(
        connections: usize,
        on_hello: fn(u32) -> Response,
        on_request: fn(&ReceivedRequest) -> Option<Response>,
    ) -> (
        tempfile::TempDir,
        PathBuf,
        tokio::task::JoinHandle<Vec<u32>>,
    ) {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&socket).expect("bind");
        let agent = tokio::spawn(async move {
            let mut offered = Vec::new();
            for _ in 0..connections {
                let (mut stream, _) = listener.accept().await.expect("accept");
                let hello: RequestFrame = read_frame(&mut stream, MAX_REQUEST_BYTES)
                    .await
                    .expect("read the hello")
                    .expect("a hello frame");
                let Request::Hello { protocol } = hello.request else {
                    panic!("the first request was not a hello: {hello:?}");
                };
                offered.push(protocol);
                let greeting = on_hello(protocol);
                let spoken = match greeting {
                    Response::Hello { protocol, .. } => Some(protocol),
                    _ => None,
                };
                answer(&mut stream, hello.id, greeting).await;
                let Some(spoken) = spoken else { continue };
                while let Ok(Some(payload)) = read_payload(&mut stream, MAX_REQUEST_BYTES).await {
                    let frame = decode_request(&payload, spoken).expect("a request");
                    if let Some(response) = on_request(&frame) {
                        answer(&mut stream, frame.id, response).await;
                    }
                }
            }
            offered
        });
        (dir, socket, agent)
    }

    fn accept_offered(protocol: u32) -> Response {
        Response::Hello {
            protocol,
            served: fake_identity(),
        }
    }

    /// A refusal that is not about the protocol version (here the agent's peer check) ends the
    /// connection attempt with the agent's reason: no second hello in an older version.
    #[tokio::test]
    async fn a_refusal_other_than_of_the_version_is_the_error_and_no_older_hello_follows() {
        fn refuse_the_user(_: u32) -> Response {
            Response::Refused {
                reason: "uid 4242 is not allowed (only root and the agent's --allowed-uid users)"
                    .into(),
            }
        }
        let (_dir, socket, agent) = scripted_agent(1, refuse_the_user, |_| None).await;
        let config =
            AgentConfig::new(&socket).with_timeouts(Duration::from_secs(5), Duration::from_secs(5));
        match AgentStore::connect(config).await {
            Err(KvError::Other { message }) => assert!(
                message.contains("refused this connection: uid 4242 is not allowed"),
                "{message}"
            ),
            other => panic!("expected the agent's refusal, got {other:?}"),
        }
        assert_eq!(agent.await.expect("the fake agent"), vec![PROTOCOL_VERSION]);
    }

    /// An answer of another kind than the request's (a batched read answered from a cache
    /// that was not asked for) is an error naming both, not a result.
    #[tokio::test]
    async fn a_batched_read_answered_as_a_cached_one_is_an_error() {
        fn answer_from_a_cache(_: &ReceivedRequest) -> Option<Response> {
            Some(Response::ReadManyCached {
                results: vec![crate::protocol::WireReadResult::Got(None)],
                validators: vec![],
                from_cache: true,
            })
        }
        let (_dir, socket, _agent) = scripted_agent(1, accept_offered, answer_from_a_cache).await;
        let config =
            AgentConfig::new(&socket).with_timeouts(Duration::from_secs(5), Duration::from_secs(5));
        let client = AgentStore::connect(config).await.expect("connect");
        match client.read_many(&[Read::Get("k".into())]).await {
            Err(KvError::Other { message }) => assert!(
                message.contains(
                    "answered a read_many with a batched read result from the agent's cache"
                ),
                "{message}"
            ),
            other => panic!("expected an error, got {other:?}"),
        }
    }

    /// A caller's deadline further away than the client's own request timeout is cut to it: the
    /// request carries the request timeout's instant, and the call gives up then, saying so.
    #[tokio::test]
    async fn a_callers_deadline_beyond_the_request_timeout_is_cut_to_it() {
        const REQUEST_TIMEOUT: Duration = Duration::from_millis(1500);
        static CARRIED: Mutex<Option<WireDeadline>> = Mutex::new(None);
        fn note_the_deadline_and_never_answer(frame: &ReceivedRequest) -> Option<Response> {
            *CARRIED.lock().expect("carried") = frame.deadline;
            None
        }
        let (_dir, socket, _agent) =
            scripted_agent(1, accept_offered, note_the_deadline_and_never_answer).await;
        let config =
            AgentConfig::new(&socket).with_timeouts(Duration::from_secs(5), REQUEST_TIMEOUT);
        let client = AgentStore::connect(config).await.expect("connect");
        let far = Instant::now() + Duration::from_secs(3600);
        let outcome = tokio::time::timeout(
            Duration::from_secs(60),
            crate::deadline::within(far, client.get("k")),
        )
        .await
        .expect("the call waited for its caller's deadline, beyond the request timeout");
        let carried = CARRIED
            .lock()
            .expect("carried")
            .expect("a deadline with the request");
        let remaining = Duration::from_nanos(carried.remaining_nanos);
        assert!(
            remaining > Duration::ZERO && remaining <= REQUEST_TIMEOUT,
            "the request carried {remaining:?} left, beyond the request timeout"
        );
        match outcome {
            Err(KvError::Unavailable { message }) => assert!(
                message.contains(&format!("no answer within {REQUEST_TIMEOUT:?}")),
                "{message}"
            ),
            other => panic!("expected the request timeout, got {other:?}"),
        }
    }

    #[test]
    fn only_root_or_the_clients_own_user_may_serve_it() {
        assert!(server_is_trusted(0, 0), "root serving root");
        assert!(server_is_trusted(0, 1000), "root serving a user");
        assert!(server_is_trusted(1000, 1000), "a user serving itself");
        assert!(!server_is_trusted(1000, 0), "a user serving root");
        assert!(!server_is_trusted(65534, 1000), "a user serving another");
    }

    #[tokio::test]
    async fn this_processs_own_uid_is_the_one_its_sockets_report() {
        let (listener_side, client_side) = UnixStream::pair().expect("a socket pair");
        let reported = client_side.peer_cred().expect("peer credentials").uid();
        drop(listener_side);
        assert_eq!(own_uid().expect("own uid"), reported);
        // Read once: the cached value is the same.
        assert_eq!(own_uid().expect("own uid"), reported);
    }
}
