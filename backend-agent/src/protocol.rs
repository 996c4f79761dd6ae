//! The wire protocol between [`AgentStore`](crate::AgentStore) and the agent: frames, requests,
//! answers, and the conversions from and to `ipam_core`'s types.
//!
//! A frame is a 4-byte big-endian payload length, then the payload: one value encoded with
//! bincode 2 (standard configuration, through serde). The wire types mirror `ipam_core`'s on
//! purpose instead of deriving serde there: the protocol changes only when [`PROTOCOL_VERSION`]
//! does.
//!
//! Versions: the hello is always a [`RequestFrame`] carrying the client's newest version; the
//! agent answers with the version both speak (the lower of the two). After it, protocol 1 sends
//! [`RequestFrame`]s, protocols 2 and 3 [`BoundedRequestFrame`]s, which add the caller's deadline.
//! Protocol 3 differs from 2 only in what a request may hold: a [`WireRead::Range`] in a batched
//! read; protocol 4 from 3 in a transaction's [`WireCondition::NoPutAfter`] and in
//! [`Request::ReadManyCached`], answered by [`Response::ReadManyCached`]. Answers are
//! [`ResponseFrame`]s in all four. bincode is not self-describing: a variant or
//! field is never changed or reordered, only new variants added at the end of an enum, and a
//! variant added in version N is never sent on a connection that negotiated less (an agent of an
//! older build cannot decode it and closes the connection): [`Request::spoken_in`] rewrites a
//! request for such a connection.

use ipam_core::{Condition, KeyValue, KvError, Op, Read, ReadResult, Revision, Txn};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The first protocol version (requests without a deadline): the agent still serves clients
/// that speak only it, and the client falls back to it for an agent that knows no other.
pub const PROTOCOL_V1: u32 = 1;

/// The first protocol version whose requests carry the caller's deadline
/// ([`BoundedRequestFrame`]); it knows no [`WireRead::Range`].
pub const PROTOCOL_V2: u32 = 2;

/// The first protocol version in which a batched read may hold a [`WireRead::Range`] (framed as
/// [`PROTOCOL_V2`]).
pub const PROTOCOL_V3: u32 = 3;

/// The first protocol version in which a transaction may hold a [`WireCondition::NoPutAfter`]
/// and a client may send [`Request::ReadManyCached`] (framed as [`PROTOCOL_V2`]).
pub const PROTOCOL_V4: u32 = 4;

/// The newest protocol version this build speaks: [`PROTOCOL_V4`].
pub const PROTOCOL_VERSION: u32 = PROTOCOL_V4;

/// Largest request payload the agent reads (a transaction is at most about 1.4 MiB; a batched
/// read names keys only).
pub const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;

/// Largest answer payload a client reads (a listing of a large store).
pub const MAX_RESPONSE_BYTES: usize = 1024 * 1024 * 1024;

/// Which store an agent serves, in a form two settings can be compared by
/// ([`matches`](Self::matches)): the client uses the agent only for the store it was told to use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreIdentity {
    /// `sled`, `redb`, `etcdv3`, or another name for stores that are neither (tests).
    pub datastore_type: String,
    /// Embedded stores: the store's path, canonical when it exists.
    pub path: Option<String>,
    /// etcd: the endpoints, without scheme or trailing slash.
    pub etcd_endpoints: Vec<String>,
    /// etcd: the key prefix.
    pub etcd_prefix: Option<String>,
}

impl StoreIdentity {
    /// True when both name the same store: same type, and the same path (embedded stores) or the
    /// same prefix and at least one common endpoint (etcd).
    pub fn matches(&self, other: &StoreIdentity) -> bool {
        if self.datastore_type != other.datastore_type {
            return false;
        }
        if self.etcd_endpoints.is_empty() && other.etcd_endpoints.is_empty() {
            return self.path == other.path && self.etcd_prefix == other.etcd_prefix;
        }
        self.etcd_prefix == other.etcd_prefix
            && self
                .etcd_endpoints
                .iter()
                .any(|endpoint| other.etcd_endpoints.contains(endpoint))
    }
}

impl std::fmt::Display for StoreIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.datastore_type)?;
        if let Some(path) = &self.path {
            write!(f, " at {path}")?;
        }
        if !self.etcd_endpoints.is_empty() {
            write!(f, " at {}", self.etcd_endpoints.join(","))?;
        }
        if let Some(prefix) = &self.etcd_prefix {
            write!(f, " (prefix {prefix})")?;
        }
        Ok(())
    }
}

/// One request with its id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestFrame {
    /// Chosen by the client, unique among its calls in flight; repeated in the answer.
    pub id: u64,
    /// What is asked.
    pub request: Request,
}

/// One request with its id and the caller's deadline: every request after the hello in
/// protocols 2 and 3.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoundedRequestFrame {
    /// As [`RequestFrame::id`].
    pub id: u64,
    /// When the caller gives up on this request.
    pub deadline: WireDeadline,
    /// What is asked.
    pub request: Request,
}

/// When a caller gives up, in two forms: the agent runs on the same host and reads the same
/// monotonic clock, so the first is exact; the second serves when the clocks turn out to differ
/// (see `backend_agent::deadline`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireDeadline {
    /// The caller's `CLOCK_MONOTONIC` reading at which it gives up, in nanoseconds.
    pub monotonic_nanos: u64,
    /// The time the caller had left when it sent the request, in nanoseconds.
    pub remaining_nanos: u64,
}

/// A request as the agent read it, whichever protocol version framed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedRequest {
    /// The request's id.
    pub id: u64,
    /// The caller's deadline (protocol 2 on); `None` from a protocol 1 client.
    pub deadline: Option<WireDeadline>,
    /// What is asked.
    pub request: Request,
}

/// Decodes a request frame's payload as the negotiated `protocol` frames it (the hello, always
/// protocol 1's framing, is decoded with [`PROTOCOL_V1`]). Protocols 2 to 4 share a framing;
/// a [`WireRead::Range`] or [`WireCondition::NoPutAfter`] decodes in any of them (a client of
/// this build never sends one in a protocol before its own, and one that does is simply served).
///
/// # Errors
/// [`FrameError::Decode`] for a payload that is not one request of that framing, or an unknown
/// version.
pub fn decode_request(payload: &[u8], protocol: u32) -> Result<ReceivedRequest, FrameError> {
    match protocol {
        PROTOCOL_V1 => decode_payload::<RequestFrame>(payload).map(|frame| ReceivedRequest {
            id: frame.id,
            deadline: None,
            request: frame.request,
        }),
        PROTOCOL_V2..=PROTOCOL_VERSION => {
            decode_payload::<BoundedRequestFrame>(payload).map(|frame| ReceivedRequest {
                id: frame.id,
                deadline: Some(frame.deadline),
                request: frame.request,
            })
        }
        other => Err(FrameError::Decode(format!(
            "no framing for protocol version {other}"
        ))),
    }
}

/// What a client asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// The first request on a connection: the client's protocol version.
    Hello {
        /// [`PROTOCOL_VERSION`] of the client.
        protocol: u32,
    },
    /// `KvStore::get`.
    Get {
        /// The key.
        key: String,
    },
    /// `KvStore::list`.
    List {
        /// The string prefix.
        prefix: String,
    },
    /// `KvStore::read_many`.
    ReadMany {
        /// The reads, in order.
        reads: Vec<WireRead>,
    },
    /// `KvStore::commit`.
    Commit {
        /// The transaction.
        txn: WireTxn,
    },
    /// `KvStore::read_many_cached` (protocol 4 on; see [`Request::spoken_in`]): the reads,
    /// answered with the conditions under which the answer is still the store's, and, when
    /// allowed, from what the agent kept of earlier answers and writes.
    ReadManyCached {
        /// The reads, in order.
        reads: Vec<WireRead>,
        /// Whether the agent may answer from what it kept.
        may_use_cache: bool,
    },
}

impl Request {
    /// True for the one request that may write.
    pub fn is_write(&self) -> bool {
        matches!(self, Request::Commit { .. })
    }

    /// This request as a connection that negotiated `protocol` can carry it: before
    /// [`PROTOCOL_V3`], each [`WireRead::Range`] of a batched read becomes a
    /// [`WireRead::List`] of its prefix (the caller cuts the window from the listing, see
    /// `ipam_core::range_of_listing`); before [`PROTOCOL_V4`], a [`Request::ReadManyCached`]
    /// becomes the [`Request::ReadMany`] of its reads; anything else is unchanged.
    ///
    /// # Errors
    /// Why not, for a transaction holding a [`WireCondition::NoPutAfter`] before
    /// [`PROTOCOL_V4`]: no condition of older protocols tests what it tests.
    pub fn spoken_in(self, protocol: u32) -> Result<Request, String> {
        match self {
            // Before protocol 4, the reads themselves (answered from the store).
            Request::ReadManyCached { reads, .. } if protocol < PROTOCOL_V4 => {
                Request::ReadMany { reads }.spoken_in(protocol)
            }
            Request::ReadMany { reads } if protocol < PROTOCOL_V3 => Ok(Request::ReadMany {
                reads: reads.into_iter().map(WireRead::without_range).collect(),
            }),
            Request::Commit { txn }
                if protocol < PROTOCOL_V4
                    && txn
                        .conditions
                        .iter()
                        .any(|c| matches!(c, WireCondition::NoPutAfter(..))) =>
            {
                Err(format!(
                    "a transaction conditioned on a prefix takes protocol {PROTOCOL_V4}, and \
                     this agent speaks {protocol} (an older build: upgrade it)"
                ))
            }
            other => Ok(other),
        }
    }

    /// A short name for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::Get { .. } => "get",
            Request::List { .. } => "list",
            Request::ReadMany { .. } => "read_many",
            Request::Commit { .. } => "commit",
            Request::ReadManyCached { .. } => "read_many_cached",
        }
    }
}

/// One answer with the id of its request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseFrame {
    /// The request's id (0 for a refusal sent before any request was read).
    pub id: u64,
    /// The answer.
    pub response: Response,
}

/// What the agent answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// Answer to the hello.
    Hello {
        /// The version this connection speaks from now on: the newest both peers speak, the
        /// smaller of the client's offer and the agent's [`PROTOCOL_VERSION`]. (An agent of
        /// protocol 1 refuses any other offer; the client then connects again offering 1.)
        protocol: u32,
        /// The store the agent serves.
        served: StoreIdentity,
    },
    /// The agent does not serve this peer; it closes the connection after this frame.
    Refused {
        /// Why (the peer's uid is not allowed, a protocol mismatch, ...).
        reason: String,
    },
    /// Answer to `Get`.
    Got(Option<WireKeyValue>),
    /// Answer to `List`.
    Listed(Vec<WireKeyValue>),
    /// Answer to `ReadMany`.
    ReadMany(Vec<WireReadResult>),
    /// Answer to `Commit`: the revision of the write.
    Committed {
        /// The revision.
        revision: u64,
    },
    /// The store's error, kind and fields intact.
    Failed(WireError),
    /// Answer to `ReadManyCached` (protocol 4 on; `ipam_core::CachedRead`).
    ReadManyCached {
        /// One result per read, in order.
        results: Vec<WireReadResult>,
        /// The conditions under which the results are still the store's.
        validators: Vec<WireCondition>,
        /// True when answered from what the agent kept.
        from_cache: bool,
    },
}

/// [`KeyValue`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireKeyValue {
    /// The key.
    pub key: String,
    /// The value.
    #[serde(with = "raw_bytes")]
    pub value: Vec<u8>,
    /// The revision of its last write.
    pub revision: u64,
}

/// [`Read`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireRead {
    /// One key.
    Get(String),
    /// A string prefix.
    List(String),
    /// A window of a string prefix's listing (protocol 3 on; see [`Request::spoken_in`]).
    Range {
        /// The string prefix.
        prefix: String,
        /// The smallest key answered.
        from: String,
        /// How many keys at most.
        limit: u32,
    },
}

impl WireRead {
    /// This read as protocols 1 and 2 know it: a [`WireRead::Range`] becomes the
    /// [`WireRead::List`] of its prefix, whose answer holds the window.
    pub fn without_range(self) -> WireRead {
        match self {
            WireRead::Range { prefix, .. } => WireRead::List(prefix),
            other => other,
        }
    }
}

/// [`ReadResult`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireReadResult {
    /// Answer to a get.
    Got(Option<WireKeyValue>),
    /// Answer to a list.
    Listed(Vec<WireKeyValue>),
}

/// [`Condition`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireCondition {
    /// The key must be absent.
    Absent(String),
    /// The key must be at this revision.
    AtRevision(String, u64),
    /// No key under the prefix was put after the revision (protocol 4 on; see
    /// [`Request::spoken_in`]).
    NoPutAfter(String, u64),
}

/// [`Op`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireOp {
    /// Put a value.
    Put(String, #[serde(with = "raw_bytes")] Vec<u8>),
    /// Delete a key.
    Delete(String),
}

/// [`Txn`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireTxn {
    /// The conditions, in order.
    pub conditions: Vec<WireCondition>,
    /// The operations, in order.
    pub ops: Vec<WireOp>,
}

/// [`KvError`] on the wire: one variant per kind, with its fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireError {
    /// `KvError::Conflict`.
    Conflict {
        /// The first failed key.
        key: String,
    },
    /// `KvError::Unavailable`.
    Unavailable {
        /// What happened.
        message: String,
    },
    /// `KvError::Indeterminate`.
    Indeterminate {
        /// What happened.
        message: String,
    },
    /// `KvError::Corrupt`.
    Corrupt {
        /// The key, when known.
        key: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// `KvError::InvalidArgument`.
    InvalidArgument {
        /// What is wrong.
        message: String,
    },
    /// `KvError::Other` (and any kind this protocol version does not know).
    Other {
        /// What happened.
        message: String,
    },
}

impl From<KeyValue> for WireKeyValue {
    fn from(kv: KeyValue) -> Self {
        WireKeyValue {
            key: kv.key,
            value: kv.value,
            revision: kv.revision.get(),
        }
    }
}

impl From<WireKeyValue> for KeyValue {
    fn from(kv: WireKeyValue) -> Self {
        KeyValue {
            key: kv.key,
            value: kv.value,
            revision: Revision(kv.revision),
        }
    }
}

impl From<&Read> for WireRead {
    fn from(read: &Read) -> Self {
        match read {
            Read::Get(key) => WireRead::Get(key.clone()),
            Read::List(prefix) => WireRead::List(prefix.clone()),
            Read::Range {
                prefix,
                from,
                limit,
            } => WireRead::Range {
                prefix: prefix.clone(),
                from: from.clone(),
                limit: *limit,
            },
        }
    }
}

impl From<WireRead> for Read {
    fn from(read: WireRead) -> Self {
        match read {
            WireRead::Get(key) => Read::Get(key),
            WireRead::List(prefix) => Read::List(prefix),
            WireRead::Range {
                prefix,
                from,
                limit,
            } => Read::Range {
                prefix,
                from,
                limit,
            },
        }
    }
}

impl From<ReadResult> for WireReadResult {
    fn from(result: ReadResult) -> Self {
        match result {
            ReadResult::Got(kv) => WireReadResult::Got(kv.map(Into::into)),
            ReadResult::Listed(kvs) => {
                WireReadResult::Listed(kvs.into_iter().map(Into::into).collect())
            }
        }
    }
}

impl From<WireReadResult> for ReadResult {
    fn from(result: WireReadResult) -> Self {
        match result {
            WireReadResult::Got(kv) => ReadResult::Got(kv.map(Into::into)),
            WireReadResult::Listed(kvs) => {
                ReadResult::Listed(kvs.into_iter().map(Into::into).collect())
            }
        }
    }
}

impl From<Condition> for WireCondition {
    fn from(condition: Condition) -> Self {
        match condition {
            Condition::Absent { key } => WireCondition::Absent(key),
            Condition::AtRevision { key, revision } => {
                WireCondition::AtRevision(key, revision.get())
            }
            Condition::NoPutAfter { prefix, revision } => {
                WireCondition::NoPutAfter(prefix, revision.get())
            }
        }
    }
}

impl From<WireCondition> for Condition {
    fn from(condition: WireCondition) -> Self {
        match condition {
            WireCondition::Absent(key) => Condition::Absent { key },
            WireCondition::AtRevision(key, revision) => Condition::AtRevision {
                key,
                revision: Revision(revision),
            },
            WireCondition::NoPutAfter(prefix, revision) => Condition::NoPutAfter {
                prefix,
                revision: Revision(revision),
            },
        }
    }
}

impl From<Txn> for WireTxn {
    fn from(txn: Txn) -> Self {
        WireTxn {
            conditions: txn
                .conditions
                .into_iter()
                .map(WireCondition::from)
                .collect(),
            ops: txn
                .ops
                .into_iter()
                .map(|op| match op {
                    Op::Put { key, value } => WireOp::Put(key, value),
                    Op::Delete { key } => WireOp::Delete(key),
                })
                .collect(),
        }
    }
}

impl From<WireTxn> for Txn {
    fn from(txn: WireTxn) -> Self {
        Txn {
            conditions: txn.conditions.into_iter().map(Condition::from).collect(),
            ops: txn
                .ops
                .into_iter()
                .map(|op| match op {
                    WireOp::Put(key, value) => Op::Put { key, value },
                    WireOp::Delete(key) => Op::Delete { key },
                })
                .collect(),
        }
    }
}

impl From<&KvError> for WireError {
    fn from(error: &KvError) -> Self {
        match error {
            KvError::Conflict { key } => WireError::Conflict { key: key.clone() },
            KvError::Unavailable { message } => WireError::Unavailable {
                message: message.clone(),
            },
            KvError::Indeterminate { message } => WireError::Indeterminate {
                message: message.clone(),
            },
            KvError::Corrupt { key, message } => WireError::Corrupt {
                key: key.clone(),
                message: message.clone(),
            },
            KvError::InvalidArgument { message } => WireError::InvalidArgument {
                message: message.clone(),
            },
            KvError::Other { message } => WireError::Other {
                message: message.clone(),
            },
            other => WireError::Other {
                message: other.to_string(),
            },
        }
    }
}

impl From<WireError> for KvError {
    fn from(error: WireError) -> Self {
        match error {
            WireError::Conflict { key } => KvError::Conflict { key },
            WireError::Unavailable { message } => KvError::Unavailable { message },
            WireError::Indeterminate { message } => KvError::Indeterminate { message },
            WireError::Corrupt { key, message } => KvError::Corrupt { key, message },
            WireError::InvalidArgument { message } => KvError::InvalidArgument { message },
            WireError::Other { message } => KvError::Other { message },
        }
    }
}

/// Values as one byte string (bincode: a length and the bytes copied), not a sequence of
/// numbers encoded one by one: a 1 MiB value is one copy each way.
mod raw_bytes {
    use serde::de::{Error, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(value)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        deserializer.deserialize_byte_buf(BytesVisitor)
    }

    struct BytesVisitor;

    impl<'de> Visitor<'de> for BytesVisitor {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a byte string")
        }

        fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            let mut bytes = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
            while let Some(byte) = seq.next_element()? {
                bytes.push(byte);
            }
            Ok(bytes)
        }
    }
}

/// Why a frame could not be read or written.
#[derive(Debug)]
pub enum FrameError {
    /// The stream failed or ended in the middle of a frame.
    Io(std::io::Error),
    /// The announced length is over the limit.
    TooLarge {
        /// The announced length.
        length: usize,
        /// The limit.
        limit: usize,
    },
    /// The payload is not a value of the expected type.
    Decode(String),
    /// The value could not be encoded.
    Encode(String),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Io(e) => write!(f, "{e}"),
            FrameError::TooLarge { length, limit } => {
                write!(f, "a frame of {length} bytes is over the limit of {limit}")
            }
            FrameError::Decode(e) => write!(f, "undecodable frame: {e}"),
            FrameError::Encode(e) => write!(f, "cannot encode a frame: {e}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Encodes `value` as one whole frame (length prefix included), refusing payloads over `limit`.
///
/// # Errors
/// [`FrameError::Encode`] when serde fails, [`FrameError::TooLarge`] over the limit.
pub fn encode_frame<T: Serialize>(value: &T, limit: usize) -> Result<Vec<u8>, FrameError> {
    let payload = bincode::serde::encode_to_vec(value, bincode::config::standard())
        .map_err(|e| FrameError::Encode(e.to_string()))?;
    let length = u32::try_from(payload.len())
        .ok()
        .filter(|_| payload.len() <= limit)
        .ok_or(FrameError::TooLarge {
            length: payload.len(),
            limit,
        })?;
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&length.to_be_bytes());
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// Writes one frame made by [`encode_frame`], whole.
///
/// # Errors
/// [`FrameError::Io`] when the stream fails (part of the frame may have been written).
pub async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    frame: &[u8],
) -> Result<(), FrameError> {
    writer.write_all(frame).await.map_err(FrameError::Io)?;
    writer.flush().await.map_err(FrameError::Io)
}

/// Reads one frame and decodes it; `Ok(None)` when the stream ends cleanly before a frame.
///
/// # Errors
/// [`FrameError::Io`] when the stream fails or ends inside a frame, [`FrameError::TooLarge`]
/// over `limit`, [`FrameError::Decode`] for a payload that is not a `T`.
pub async fn read_frame<R: AsyncRead + Unpin, T: DeserializeOwned>(
    reader: &mut R,
    limit: usize,
) -> Result<Option<T>, FrameError> {
    match read_payload(reader, limit).await? {
        Some(payload) => decode_payload(&payload).map(Some),
        None => Ok(None),
    }
}

/// Reads one frame's payload, undecoded; `Ok(None)` when the stream ends cleanly before a frame.
///
/// # Errors
/// [`FrameError::Io`] when the stream fails or ends inside a frame, [`FrameError::TooLarge`]
/// over `limit`.
pub async fn read_payload<R: AsyncRead + Unpin>(
    reader: &mut R,
    limit: usize,
) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0u8; 4];
    let mut filled = 0;
    while filled < header.len() {
        let n = reader
            .read(&mut header[filled..])
            .await
            .map_err(FrameError::Io)?;
        if n == 0 {
            if filled == 0 {
                return Ok(None);
            }
            return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        filled += n;
    }
    let length = u32::from_be_bytes(header) as usize;
    if length > limit {
        return Err(FrameError::TooLarge { length, limit });
    }
    let mut payload = vec![0u8; length];
    reader
        .read_exact(&mut payload)
        .await
        .map_err(FrameError::Io)?;
    Ok(Some(payload))
}

/// How many bytes bincode's accounting may count per byte of payload: it counts every number at
/// its full width (a `u64` as 8 bytes however short its encoding) and every string or byte string
/// at its length, and the widest number in these types is 8 bytes.
const COUNTED_PER_PAYLOAD_BYTE: usize = 8;

/// Decodes one frame's payload (the bytes after the length prefix) as a `T`, whole.
///
/// bincode counts what a payload makes it allocate and read, and stops at a limit: the limit
/// used is the smallest of a few steps that a legitimate payload of this size stays under
/// ([`COUNTED_PER_PAYLOAD_BYTE`] times its size), so a length claiming more than the frame can
/// hold is a decode error before anything is allocated for it (a claim that passes is at most
/// 16 times that bound, and fails when the bytes run out).
///
/// # Errors
/// [`FrameError::Decode`] for a payload that is not exactly one `T`.
pub fn decode_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T, FrameError> {
    const KIB_512: usize = 512 * 1024;
    const MIB_8: usize = 8 * 1024 * 1024;
    const MIB_128: usize = 128 * 1024 * 1024;
    const MIB_512: usize = 512 * 1024 * 1024;
    const GIB_2: usize = 2 * 1024 * 1024 * 1024;
    const LARGEST: usize = MAX_RESPONSE_BYTES * COUNTED_PER_PAYLOAD_BYTE;
    match payload.len().saturating_mul(COUNTED_PER_PAYLOAD_BYTE) {
        n if n <= KIB_512 => decode_within::<T, KIB_512>(payload),
        n if n <= MIB_8 => decode_within::<T, MIB_8>(payload),
        n if n <= MIB_128 => decode_within::<T, MIB_128>(payload),
        n if n <= MIB_512 => decode_within::<T, MIB_512>(payload),
        n if n <= GIB_2 => decode_within::<T, GIB_2>(payload),
        _ => decode_within::<T, LARGEST>(payload),
    }
}

/// [`decode_payload`] with bincode's accounting of the payload held to `LIMIT` bytes.
fn decode_within<T: DeserializeOwned, const LIMIT: usize>(payload: &[u8]) -> Result<T, FrameError> {
    let config = bincode::config::standard().with_limit::<LIMIT>();
    let (value, used) =
        bincode::serde::decode_from_slice(payload, config).map_err(|e| match e {
            bincode::error::DecodeError::LimitExceeded => FrameError::Decode(format!(
            "a length inside this {}-byte frame claims more than such a frame can hold (bincode \
             limit {LIMIT} bytes)",
            payload.len()
        )),
            other => FrameError::Decode(other.to_string()),
        })?;
    if used != payload.len() {
        return Err(FrameError::Decode(format!(
            "{} bytes left over after the value",
            payload.len() - used
        )));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_kind_round_trips_with_its_fields() {
        let errors = [
            KvError::Conflict { key: "k".into() },
            KvError::unavailable("down"),
            KvError::Indeterminate {
                message: "maybe".into(),
            },
            KvError::corrupt(Some("bad"), "garbage"),
            KvError::corrupt(None, "whole store"),
            KvError::invalid("no"),
            KvError::other("disk"),
        ];
        for error in errors {
            let wire = WireError::from(&error);
            let frame = encode_frame(&wire, MAX_RESPONSE_BYTES).expect("encode");
            let decoded: WireError = tokio_test_read(&frame);
            assert_eq!(KvError::from(decoded), error);
        }
    }

    #[test]
    fn values_and_empty_values_round_trip_whole() {
        for value in [vec![], vec![0xFF; 1000], (0..=255u8).collect()] {
            let kv = WireKeyValue {
                key: "k".into(),
                value,
                revision: 1,
            };
            let frame = encode_frame(&kv, MAX_RESPONSE_BYTES).expect("encode");
            let decoded: WireKeyValue = tokio_test_read(&frame);
            assert_eq!(decoded, kv);
        }
    }

    #[test]
    fn transactions_round_trip() {
        let txn = Txn::new()
            .when(Condition::absent("a"))
            .when(Condition::at_revision("b", Revision(7)))
            .then(Op::put("a", b"1".to_vec()))
            .then(Op::delete("b"));
        let frame = encode_frame(&WireTxn::from(txn.clone()), MAX_REQUEST_BYTES).expect("encode");
        let decoded: WireTxn = tokio_test_read(&frame);
        assert_eq!(Txn::from(decoded), txn);
    }

    #[test]
    fn frame_over_the_limit_is_refused_on_both_sides() {
        let big = vec![0u8; 1000];
        assert!(matches!(
            encode_frame(&big, 100),
            Err(FrameError::TooLarge { .. })
        ));
        let frame = encode_frame(&big, 10_000).expect("encode");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let result = runtime.block_on(read_frame::<_, Vec<u8>>(&mut &frame[..], 100));
        assert!(matches!(result, Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn a_frame_of_exactly_the_limit_is_read_on_both_sides() {
        let value = vec![7u8; 1000];
        let frame = encode_frame(&value, 10_000).expect("encode");
        let limit = frame.len() - 4;
        assert_eq!(
            encode_frame(&value, limit).expect("encode at the limit"),
            frame
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let read = runtime.block_on(read_frame::<_, Vec<u8>>(&mut &frame[..], limit));
        assert_eq!(read.expect("read at the limit"), Some(value));
    }

    #[test]
    fn a_stream_ending_between_frames_is_a_clean_end_and_inside_a_length_an_error() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let ended = runtime.block_on(read_payload(&mut &[][..], 100));
        assert!(matches!(ended, Ok(None)), "{ended:?}");
        for cut in 1..4 {
            let header = [0u8, 0, 0, 5];
            let cut_short = runtime.block_on(read_payload(&mut &header[..cut], 100));
            assert!(
                matches!(&cut_short, Err(FrameError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof),
                "{cut} bytes of the length: {cut_short:?}"
            );
        }
        let cut_payload = runtime.block_on(read_payload(&mut &[0u8, 0, 0, 5, 1, 2][..], 100));
        assert!(
            matches!(&cut_payload, Err(FrameError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof),
            "{cut_payload:?}"
        );
    }

    #[test]
    fn a_claimed_length_beyond_the_frame_is_a_decode_error_not_an_allocation() {
        // A request frame whose key claims 2^62 bytes (a get, id 0), as sent to a live agent.
        let hostile = [
            0x00, 0x00, 0x00, 0x0b, 0x00, 0x01, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0x40,
        ];
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let request = runtime.block_on(read_frame::<_, RequestFrame>(
            &mut &hostile[..],
            MAX_REQUEST_BYTES,
        ));
        match request {
            Err(FrameError::Decode(message)) => {
                assert!(message.contains("claims more"), "{message}")
            }
            other => panic!("expected a decode error, got {other:?}"),
        }
        // The same claim inside an answer (a get's value), as a hostile agent could send it.
        let mut answer = vec![0x00, 0x02, 0x01, 0x01, b'k'];
        answer.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0x40]);
        assert!(matches!(
            decode_payload::<ResponseFrame>(&answer),
            Err(FrameError::Decode(_))
        ));
    }

    /// A get request (id 0) whose key claims `claimed` bytes, padded with `filler` bytes of the
    /// key: a payload of `11 + filler` bytes that can never hold the claim.
    fn get_claiming(claimed: u64, filler: usize) -> Vec<u8> {
        let mut payload = vec![0x00, 0x01, 0xfd];
        payload.extend_from_slice(&claimed.to_le_bytes());
        payload.resize(payload.len() + filler, b'k');
        payload
    }

    fn refused_as_claiming_more(payload: &[u8]) -> bool {
        match decode_payload::<RequestFrame>(payload) {
            Err(FrameError::Decode(message)) => message.contains("claims more"),
            other => panic!("a {}-byte payload decoded: {other:?}", payload.len()),
        }
    }

    #[test]
    fn a_claimed_length_is_refused_unread_above_the_bound_of_its_frames_size() {
        // Each payload size with the bound its claims are held to: the smallest of 512 KiB,
        // 8 MiB, 128 MiB, 512 MiB and 2 GiB that is at least 8 times the payload. Above the
        // bound, the claim is refused before anything is allocated for it; at or below it, the
        // decoder reads on and fails when the bytes run out.
        const KIB: u64 = 1024;
        const MIB: u64 = 1024 * KIB;
        for (filler, bound) in [
            (0, 512 * KIB),
            (64 * KIB as usize - 11, 512 * KIB),
            (64 * KIB as usize - 10, 8 * MIB),
            (MIB as usize - 11, 8 * MIB),
            (MIB as usize - 10, 128 * MIB),
            (16 * MIB as usize - 10, 512 * MIB),
            (64 * MIB as usize - 11, 512 * MIB),
            (64 * MIB as usize - 10, 2048 * MIB),
        ] {
            let size = 11 + filler;
            assert!(
                refused_as_claiming_more(&get_claiming(bound + 1, filler)),
                "{size}-byte payload claiming {} bytes",
                bound + 1
            );
            // Up to the bound less what the frame's other fields count.
            let within = bound - 64;
            assert!(
                !refused_as_claiming_more(&get_claiming(within, filler)),
                "{size}-byte payload claiming {within} bytes"
            );
        }
    }

    /// The wire samples committed as the protocol fuzzer's seeds (`fuzz/seeds/agent_frames`):
    /// each a byte naming the framing (0: protocol 1 request, 1: protocol 2 or 3 request, one
    /// framing, 2: answer), then one payload exactly as an earlier build and this one put it on
    /// the wire.
    #[test]
    fn the_committed_wire_samples_decode_and_encode_back_to_the_same_bytes() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/agent_frames");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("the seeds directory") {
            let path = entry.expect("a seed").path();
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            let name = name.unwrap_or_default();
            let sample = std::fs::read(&path).expect("read a seed");
            let (&kind, payload) = sample.split_first().expect("a non-empty seed");
            let encoded = match kind {
                0 | 1 => {
                    let protocol = if kind == 0 {
                        PROTOCOL_V1
                    } else {
                        PROTOCOL_VERSION
                    };
                    decode_request(payload, protocol).map(|request| match request.deadline {
                        Some(deadline) => encode_frame(
                            &BoundedRequestFrame {
                                id: request.id,
                                deadline,
                                request: request.request,
                            },
                            MAX_REQUEST_BYTES,
                        ),
                        None => encode_frame(
                            &RequestFrame {
                                id: request.id,
                                request: request.request,
                            },
                            MAX_REQUEST_BYTES,
                        ),
                    })
                }
                _ => decode_payload::<ResponseFrame>(payload)
                    .map(|response| encode_frame(&response, MAX_RESPONSE_BYTES)),
            };
            if name.starts_with("hostile-") {
                assert!(
                    matches!(encoded, Err(FrameError::Decode(_))),
                    "{name} decoded"
                );
            } else {
                let frame = encoded
                    .unwrap_or_else(|e| panic!("{name} no longer decodes: {e}"))
                    .expect("encode");
                assert_eq!(&frame[4..], payload, "{name} encodes to other bytes");
            }
            seen += 1;
        }
        assert!(seen >= 10, "only {seen} samples in {}", dir.display());
    }

    /// A batched read holding every kind of read, as protocol 3 sends it.
    fn bounded_batch_with_a_range() -> BoundedRequestFrame {
        BoundedRequestFrame {
            id: 7,
            deadline: WireDeadline {
                monotonic_nanos: 123_456_789_000,
                remaining_nanos: 5_000_000_000,
            },
            request: Request::ReadMany {
                reads: vec![
                    WireRead::Get("config".into()),
                    WireRead::List("blocks/".into()),
                    WireRead::Range {
                        prefix: "claims/".into(),
                        from: "claims/10.0.0.64".into(),
                        limit: 16,
                    },
                ],
            },
        }
    }

    #[test]
    fn protocols_2_and_3_decode_one_framing_and_no_other_version_has_one() {
        let frame = bounded_batch_with_a_range();
        let bytes = encode_frame(&frame, MAX_REQUEST_BYTES).expect("encode");
        let expected = ReceivedRequest {
            id: frame.id,
            deadline: Some(frame.deadline),
            request: frame.request,
        };
        for protocol in [PROTOCOL_V2, PROTOCOL_V3] {
            let received = decode_request(&bytes[4..], protocol)
                .unwrap_or_else(|e| panic!("protocol {protocol}: {e}"));
            assert_eq!(received, expected, "protocol {protocol}");
        }
        for unknown in [0, PROTOCOL_VERSION + 1] {
            assert!(
                matches!(
                    decode_request(&bytes[4..], unknown),
                    Err(FrameError::Decode(_))
                ),
                "protocol {unknown} decoded"
            );
        }
    }

    #[test]
    fn a_range_round_trips_and_the_reads_of_earlier_versions_keep_their_bytes() {
        let range = Read::range("claims/", "claims/10", 3);
        let wire = WireRead::from(&range);
        let frame = encode_frame(&wire, MAX_REQUEST_BYTES).expect("encode");
        assert_eq!(Read::from(tokio_test_read::<WireRead>(&frame)), range);
        // Variant indexes: a get 0 and a list 1 as in protocols 1 and 2, a range appended as 2.
        let payload =
            |read: &WireRead| encode_frame(read, MAX_REQUEST_BYTES).expect("encode")[4..].to_vec();
        assert_eq!(payload(&WireRead::Get("k".into())), [0, 1, b'k']);
        assert_eq!(payload(&WireRead::List("p".into())), [1, 1, b'p']);
        assert_eq!(
            payload(&WireRead::Range {
                prefix: "p".into(),
                from: "q".into(),
                limit: 5
            }),
            [2, 1, b'p', 1, b'q', 5]
        );
    }

    #[test]
    fn before_protocol_3_a_range_is_spoken_as_the_list_of_its_prefix() {
        let batch = bounded_batch_with_a_range().request;
        let without_ranges = Request::ReadMany {
            reads: vec![
                WireRead::Get("config".into()),
                WireRead::List("blocks/".into()),
                WireRead::List("claims/".into()),
            ],
        };
        for older in [PROTOCOL_V1, PROTOCOL_V2] {
            assert_eq!(
                batch.clone().spoken_in(older),
                Ok(without_ranges.clone()),
                "protocol {older}"
            );
        }
        for newer in [PROTOCOL_V3, PROTOCOL_V4] {
            assert_eq!(batch.clone().spoken_in(newer), Ok(batch.clone()));
        }
        let get = Request::Get { key: "k".into() };
        assert_eq!(get.clone().spoken_in(PROTOCOL_V1), Ok(get));
    }

    #[test]
    fn before_protocol_4_a_cached_read_is_spoken_as_its_reads() {
        let Request::ReadMany { reads } = bounded_batch_with_a_range().request else {
            panic!("the sample batch is a read_many");
        };
        let cached = Request::ReadManyCached {
            reads: reads.clone(),
            may_use_cache: true,
        };
        assert_eq!(cached.clone().spoken_in(PROTOCOL_V4), Ok(cached.clone()));
        assert_eq!(
            cached.clone().spoken_in(PROTOCOL_V3),
            Ok(Request::ReadMany {
                reads: reads.clone()
            })
        );
        // Below protocol 3, also each range as the list of its prefix.
        for older in [PROTOCOL_V1, PROTOCOL_V2] {
            assert_eq!(
                cached.clone().spoken_in(older),
                Request::ReadMany {
                    reads: reads.clone()
                }
                .spoken_in(older),
                "protocol {older}"
            );
            assert!(
                matches!(cached.clone().spoken_in(older), Ok(Request::ReadMany { reads }) if reads.iter().all(|r| !matches!(r, WireRead::Range { .. }))),
                "protocol {older}"
            );
        }
    }

    #[test]
    fn before_protocol_4_a_transaction_conditioned_on_a_prefix_is_not_sent() {
        let txn = WireTxn::from(
            Txn::new()
                .when(Condition::at_revision("a", Revision(3)))
                .when(Condition::no_put_after("p/", Revision(9)))
                .then(Op::put("a", b"v".to_vec())),
        );
        assert_eq!(txn.conditions[1], WireCondition::NoPutAfter("p/".into(), 9));
        assert_eq!(
            Txn::from(txn.clone()).conditions[1],
            Condition::no_put_after("p/", Revision(9))
        );
        let commit = Request::Commit { txn };
        for older in [PROTOCOL_V1, PROTOCOL_V2, PROTOCOL_V3] {
            let refused = commit.clone().spoken_in(older).expect_err("not sendable");
            assert!(refused.contains("protocol 4"), "{refused}");
        }
        assert_eq!(commit.clone().spoken_in(PROTOCOL_V4), Ok(commit.clone()));
        // Without such a condition, a transaction goes in every protocol unchanged.
        let plain = Request::Commit {
            txn: Txn::new().then(Op::delete("a")).into(),
        };
        assert_eq!(plain.clone().spoken_in(PROTOCOL_V1), Ok(plain));
    }

    /// The protocol 3 sample among the fuzzer's seeds is [`bounded_batch_with_a_range`] as this
    /// build sends it.
    #[test]
    fn the_committed_protocol_3_sample_is_a_batch_holding_a_range() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/seeds/agent_frames/request-v3-read-many-range");
        let sample = std::fs::read(&path).expect("read the protocol 3 sample");
        let frame = encode_frame(&bounded_batch_with_a_range(), MAX_REQUEST_BYTES).expect("encode");
        assert_eq!(sample.split_first(), Some((&1u8, &frame[4..])));
    }

    /// Protocol 4's additions, as this build sends them: a batched read the agent may answer from
    /// its cache, a commit conditioned on a prefix, and the cached answer.
    fn protocol_4_samples() -> [(&'static str, Vec<u8>); 3] {
        let deadline = WireDeadline {
            monotonic_nanos: 123_456_789_000,
            remaining_nanos: 5_000_000_000,
        };
        let request = |id, request| {
            let frame = BoundedRequestFrame {
                id,
                deadline,
                request,
            };
            let bytes = encode_frame(&frame, MAX_REQUEST_BYTES).expect("encode");
            [&[1u8][..], &bytes[4..]].concat()
        };
        let cached_read = request(
            8,
            Request::ReadManyCached {
                reads: vec![
                    WireRead::List("blocks/".into()),
                    WireRead::Get("handles/net.c1".into()),
                ],
                may_use_cache: true,
            },
        );
        let commit = request(
            9,
            Request::Commit {
                txn: WireTxn {
                    conditions: vec![
                        WireCondition::AtRevision("blocks/a".into(), 41),
                        WireCondition::NoPutAfter("blocks/".into(), 41),
                        WireCondition::Absent("handles/net.c1".into()),
                    ],
                    ops: vec![WireOp::Put("handles/net.c1".into(), b"{}".to_vec())],
                },
            },
        );
        let answer = ResponseFrame {
            id: 8,
            response: Response::ReadManyCached {
                results: vec![
                    WireReadResult::Listed(vec![WireKeyValue {
                        key: "blocks/a".into(),
                        value: b"a".to_vec(),
                        revision: 41,
                    }]),
                    WireReadResult::Got(None),
                ],
                validators: vec![
                    WireCondition::NoPutAfter("blocks/".into(), 41),
                    WireCondition::AtRevision("blocks/a".into(), 41),
                    WireCondition::Absent("handles/net.c1".into()),
                ],
                from_cache: true,
            },
        };
        let answer_bytes = encode_frame(&answer, MAX_RESPONSE_BYTES).expect("encode");
        [
            ("request-v4-read-many-cached", cached_read),
            ("request-v4-commit-no-put-after", commit),
            (
                "response-read-many-cached",
                [&[2u8][..], &answer_bytes[4..]].concat(),
            ),
        ]
    }

    #[test]
    fn the_committed_protocol_4_samples_are_a_cached_read_a_commit_on_a_prefix_and_its_answer() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/agent_frames");
        for (name, expected) in protocol_4_samples() {
            let sample = std::fs::read(dir.join(name)).expect("read a protocol 4 sample");
            assert_eq!(sample, expected, "{name}");
        }
    }

    #[test]
    fn frames_of_many_small_numbers_decode_at_every_size() {
        // Empty keys and values: 3 bytes each on the wire, and 24 bytes of the decoder's
        // accounting (a length or revision is counted at its full 8 bytes however short its
        // encoding): the densest a legitimate frame gets.
        for count in [1usize, 20_000, 400_000] {
            let listed = ResponseFrame {
                id: 1,
                response: Response::Listed(
                    (0..count)
                        .map(|_| WireKeyValue {
                            key: String::new(),
                            value: vec![],
                            revision: 1,
                        })
                        .collect(),
                ),
            };
            let frame = encode_frame(&listed, MAX_RESPONSE_BYTES).expect("encode");
            let decoded: ResponseFrame = decode_payload(&frame[4..])
                .unwrap_or_else(|e| panic!("{count} records in {} bytes: {e}", frame.len()));
            assert_eq!(decoded, listed);
        }
    }

    #[test]
    fn identities_match_on_path_or_on_a_common_endpoint_and_prefix() {
        let sled = |path: &str| StoreIdentity {
            datastore_type: "sled".into(),
            path: Some(path.into()),
            etcd_endpoints: vec![],
            etcd_prefix: None,
        };
        assert!(sled("/a").matches(&sled("/a")));
        assert!(!sled("/a").matches(&sled("/b")));
        let etcd = |endpoints: &[&str], prefix: &str| StoreIdentity {
            datastore_type: "etcdv3".into(),
            path: None,
            etcd_endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
            etcd_prefix: Some(prefix.into()),
        };
        assert!(etcd(&["h:1", "h:2"], "/p/").matches(&etcd(&["h:2"], "/p/")));
        assert!(!etcd(&["h:1"], "/p/").matches(&etcd(&["h:2"], "/p/")));
        assert!(!etcd(&["h:1"], "/p/").matches(&etcd(&["h:1"], "/q/")));
        assert!(!etcd(&["h:1"], "/p/").matches(&sled("/a")));
        // As operators read them (`blockipamctl`'s route, the agent's logs).
        assert_eq!(sled("/a").to_string(), "sled at /a");
        assert_eq!(
            etcd(&["h:1", "h:2"], "/p/").to_string(),
            "etcdv3 at h:1,h:2 (prefix /p/)"
        );
    }

    fn tokio_test_read<T: DeserializeOwned>(frame: &[u8]) -> T {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        runtime
            .block_on(read_frame::<_, T>(&mut &frame[..], usize::MAX))
            .expect("read")
            .expect("a frame")
    }
}
