//! `EtcdStore`: the `KvStore` trait on etcd v3 (Range for reads, one etcd `Txn` per commit).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, Identity,
    KvClient, SortOrder, SortTarget, TlsOptions, TxnOp, TxnOpResponse,
};
use ipam_core::kv::{
    validate_key, Condition, KeyValue, KvError, KvStore, Op, Read, ReadResult, Revision, Txn,
    MAX_TXN_OPS,
};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::config::{EtcdConfig, Resolved};
use crate::error::{is_compacted, map_error, timeout_error, Kind};

/// Keys fetched per Range request when listing; pages are read at one pinned revision.
const LIST_PAGE: i64 = 512;
/// Largest gRPC response accepted (etcd may answer a page of large values).
const MAX_RESPONSE_BYTES: usize = i32::MAX as usize;
/// How often a multi-request read restarts when compaction overtakes its pinned revision.
const READ_RESTARTS: usize = 3;
/// First pause between retries; grows linearly.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// HTTP/2 keep-alive ping interval, to notice dead connections.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// A [`KvStore`] on etcd v3.
///
/// Every key is stored as `prefix + key`; reads are linearizable Range requests and each
/// [`commit`](KvStore::commit) is exactly one etcd transaction. The store keeps one connection
/// per endpoint, uses one of them at a time and moves to the next when an endpoint fails; reads
/// are retried across endpoints, a transaction only when the error proves it was never sent.
/// Every call is bounded by the configured request timeout, and a store whose etcd went away
/// works again once etcd is back.
///
/// Connections are set up on first use and belong to the Tokio runtime that first used them:
/// use a store from one runtime.
pub struct EtcdStore {
    members: Vec<Member>,
    preferred: AtomicUsize,
    prefix: String,
    request_timeout: Duration,
    /// Set once any request got an answer: until then, an unreachable etcd's error says what to
    /// check (quorum, TLS), since that is most likely a configuration mistake.
    answered: AtomicBool,
}

/// One endpoint and its lazily created client.
struct Member {
    endpoint: String,
    options: ConnectOptions,
    client: OnceCell<KvClient>,
}

impl Member {
    async fn kv(&self) -> Result<KvClient, etcd_client::Error> {
        self.client
            .get_or_try_init(|| async {
                let client =
                    Client::connect([self.endpoint.as_str()], Some(self.options.clone())).await?;
                Ok(client
                    .kv_client()
                    .max_decoding_message_size(MAX_RESPONSE_BYTES))
            })
            .await
            .cloned()
    }
}

/// Why one attempt failed: setting the client up (nothing of the request was sent) or the
/// request itself.
enum Failure {
    Setup(etcd_client::Error),
    Request(etcd_client::Error),
}

impl fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints())
            .field("prefix", &self.prefix)
            .field("request_timeout", &self.request_timeout)
            .finish_non_exhaustive()
    }
}

impl EtcdStore {
    /// Validates `config`, then checks that at least one endpoint answers a read under the
    /// prefix (which also proves the credentials and TLS files work).
    ///
    /// # Errors
    /// - [`KvError::InvalidArgument`] for an invalid configuration;
    /// - [`KvError::Unavailable`] when no endpoint answered within the request timeout;
    /// - [`KvError::Other`] when etcd refused the credentials or the permission to read.
    pub async fn connect(config: EtcdConfig) -> Result<Self, KvError> {
        let store = Self::connect_lazy(config)?;
        store.probe().await?;
        Ok(store)
    }

    /// Validates `config` and builds the store without contacting etcd; the first call connects.
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] for an invalid configuration (including TLS files that do
    /// not parse).
    pub fn connect_lazy(config: EtcdConfig) -> Result<Self, KvError> {
        let resolved = config.resolve()?;
        let options = connect_options(&resolved)?;
        let members = resolved
            .endpoints
            .iter()
            .map(|endpoint| Member {
                endpoint: endpoint.clone(),
                options: options.clone(),
                client: OnceCell::new(),
            })
            .collect();
        Ok(EtcdStore {
            members,
            preferred: AtomicUsize::new(0),
            prefix: resolved.prefix,
            request_timeout: resolved.request_timeout,
            answered: AtomicBool::new(false),
        })
    }

    /// The key prefix this store lives under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The endpoints, as URLs.
    pub fn endpoints(&self) -> Vec<&str> {
        self.members.iter().map(|m| m.endpoint.as_str()).collect()
    }

    /// Deletes every key under this store's prefix and returns how many there were.
    ///
    /// # Errors
    /// - [`KvError::InvalidArgument`] when the prefix is empty (this would empty the whole etcd);
    /// - as [`commit`](KvStore::commit) otherwise (deleting again after `Indeterminate` is safe).
    pub async fn delete_all(&self) -> Result<u64, KvError> {
        if self.prefix.is_empty() {
            return Err(KvError::invalid(
                "delete_all refuses to run with an empty prefix: it would empty the whole etcd",
            ));
        }
        let prefix = self.prefix.clone().into_bytes();
        let response = self
            .run(Kind::Write, |mut kv| {
                let prefix = prefix.clone();
                async move {
                    kv.delete(prefix, Some(DeleteOptions::new().with_prefix()))
                        .await
                }
            })
            .await?;
        Ok(u64::try_from(response.deleted()).unwrap_or(0))
    }

    /// One cheap read under the prefix.
    async fn probe(&self) -> Result<(), KvError> {
        let (start, end) = self.range_for("");
        self.run(Kind::Read, |mut kv| {
            let (start, end) = (start.clone(), end.clone());
            async move {
                let options = GetOptions::new()
                    .with_range(end)
                    .with_keys_only()
                    .with_limit(1);
                kv.get(start, Some(options)).await
            }
        })
        .await
        .map(|_| ())
    }

    fn full_key(&self, key: &str) -> Vec<u8> {
        full_key(&self.prefix, key)
    }

    /// The etcd range `[start, end)` holding every key that starts with `prefix` (after the
    /// store prefix). An `end` of `[0]` means "to the end of the key space".
    fn range_for(&self, prefix: &str) -> (Vec<u8>, Vec<u8>) {
        range_for(&self.prefix, prefix)
    }

    /// One read of a [`read_many`](KvStore::read_many) batch as a transaction operation, at
    /// `revision` (0: the newest); `None` for a listing that matches nothing without asking.
    fn read_op(&self, read: &Read, revision: i64) -> Result<Option<TxnOp>, KvError> {
        Ok(match read {
            Read::Get(key) => {
                validate_key(key)?;
                Some(TxnOp::get(
                    self.full_key(key),
                    Some(GetOptions::new().with_revision(revision)),
                ))
            }
            Read::List(prefix) if matches_nothing(prefix) => None,
            Read::List(prefix) => {
                let (start, end) = self.range_for(prefix);
                Some(TxnOp::get(
                    start,
                    Some(
                        GetOptions::new()
                            .with_range(end)
                            .with_sort(SortTarget::Key, SortOrder::Ascend)
                            .with_revision(revision),
                    ),
                ))
            }
            Read::Range { prefix, .. } if matches_nothing(prefix) => {
                read.validate()?;
                None
            }
            Read::Range {
                prefix,
                from,
                limit,
            } => {
                read.validate()?;
                let (_, end) = self.range_for(prefix);
                let start = self.full_key(Read::range_start(prefix, from));
                Some(TxnOp::get(
                    if start.is_empty() { vec![0] } else { start },
                    Some(
                        GetOptions::new()
                            .with_range(end)
                            .with_limit(i64::from(*limit))
                            .with_sort(SortTarget::Key, SortOrder::Ascend)
                            .with_revision(revision),
                    ),
                ))
            }
        })
    }

    /// Converts an etcd key-value under the prefix back into the caller's terms.
    fn decode(&self, kv: etcd_client::KeyValue) -> Result<KeyValue, KvError> {
        let revision = kv.mod_revision();
        let (key, value) = kv.into_key_value();
        self.decode_parts(key, value, revision)
    }

    fn decode_parts(
        &self,
        key: Vec<u8>,
        value: Vec<u8>,
        revision: i64,
    ) -> Result<KeyValue, KvError> {
        decode_parts(&self.prefix, key, value, revision)
    }

    /// Runs `request` against the preferred endpoint, moving on to the next endpoint and retrying
    /// (with a short pause) as long as the mapped error is `Unavailable`, within one request
    /// timeout overall.
    async fn run<T, F, Fut>(&self, kind: Kind, request: F) -> Result<T, KvError>
    where
        F: FnMut(KvClient) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        match self.run_on_members(kind, request).await {
            Ok(value) => {
                self.answered.store(true, Ordering::Relaxed);
                Ok(value)
            }
            // A TLS mismatch (plain text against TLS, a missing client certificate) shows up
            // only as a connection the server closed: before etcd ever answered, say what to
            // check.
            Err(KvError::Unavailable { message }) if !self.answered.load(Ordering::Relaxed) => {
                Err(KvError::Unavailable {
                    message: format!(
                        "{message} (check that etcd runs there with a quorum, and that the \
                         endpoint matches its TLS: https:// and a CA file for a TLS etcd, plus \
                         a client certificate and key when it requires them)"
                    ),
                })
            }
            Err(other) => Err(other),
        }
    }

    async fn run_on_members<T, F, Fut>(&self, kind: Kind, mut request: F) -> Result<T, KvError>
    where
        F: FnMut(KvClient) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let count = self.members.len().max(1);
        let attempts = count + 2;
        let deadline = Instant::now() + self.request_timeout;
        let mut last: Option<KvError> = None;
        for attempt in 0..attempts {
            let index = self.preferred.load(Ordering::Relaxed) % count;
            let Some(member) = self.members.get(index) else {
                break;
            };
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            let sent = AtomicBool::new(false);
            let outcome = tokio::time::timeout(remaining, async {
                let kv = member.kv().await.map_err(Failure::Setup)?;
                sent.store(true, Ordering::Relaxed);
                request(kv).await.map_err(Failure::Request)
            })
            .await;
            let error = match outcome {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(Failure::Setup(e))) => map_error(e, Kind::Read, &member.endpoint),
                Ok(Err(Failure::Request(e))) => map_error(e, kind, &member.endpoint),
                Err(_elapsed) => {
                    return Err(timeout_error(
                        kind,
                        &member.endpoint,
                        self.request_timeout,
                        sent.load(Ordering::Relaxed),
                    ))
                }
            };
            if !error.is_retryable() {
                return Err(error);
            }
            tracing::debug!(endpoint = %member.endpoint, attempt, %error, "etcd request failed, retrying");
            // Later calls start at the next endpoint too.
            let _ = self.preferred.compare_exchange(
                index,
                (index + 1) % count,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            last = Some(error);
            if attempt + 1 < attempts {
                let pause = RETRY_PAUSE * (attempt as u32 + 1);
                let remaining = deadline.saturating_duration_since(Instant::now());
                tokio::time::sleep(pause.min(remaining)).await;
            }
        }
        Err(last.unwrap_or_else(|| {
            KvError::unavailable(format!(
                "no etcd endpoint of {:?} answered within {:?}",
                self.endpoints(),
                self.request_timeout
            ))
        }))
    }
}

/// etcd client options from a validated configuration.
pub(crate) fn connect_options(resolved: &Resolved) -> Result<ConnectOptions, KvError> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(resolved.connect_timeout)
        .with_keep_alive(KEEP_ALIVE_INTERVAL, resolved.connect_timeout)
        // A member without a leader refuses at once instead of queueing the request.
        .with_require_leader(true);
    if let Some((user, password)) = &resolved.credentials {
        options = options
            .with_user(user.clone(), password.clone())
            .with_auto_token_refresh(true);
    }
    if let Some(tls) = &resolved.tls {
        let mut tls_options = TlsOptions::new().ca_certificate(Certificate::from_pem(&tls.ca));
        if let Some((cert, key)) = &tls.identity {
            tls_options = tls_options.identity(Identity::from_pem(cert, key));
        }
        // Parse the certificates now so that bad files are a configuration error, not an
        // endpoint that never answers.
        for endpoint in &resolved.endpoints {
            tonic::transport::Endpoint::from_shared(endpoint.clone())
                .and_then(|e| e.tls_config(tls_options.clone()))
                .map_err(|e| {
                    KvError::invalid(format!(
                        "etcd TLS files rejected for {endpoint}: {e}{}",
                        std::error::Error::source(&e)
                            .map(|s| format!(": {s}"))
                            .unwrap_or_default()
                    ))
                })?;
        }
        options = options.with_tls(tls_options);
    }
    Ok(options)
}

/// No stored key contains NUL ([`validate_key`] refuses it), so no key starts with a prefix
/// that does: such a listing is empty without asking etcd.
fn matches_nothing(prefix: &str) -> bool {
    prefix.contains('\0')
}

/// The smallest key greater than every key starting with `prefix` (`[0]`: no such key).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The revision etcd's answer to a successful transaction gives (the header's; 0 when missing):
/// every transaction leaves the store at a revision of at least 1, so anything else is an error.
fn acknowledged_revision(revision: i64) -> Result<Revision, KvError> {
    match u64::try_from(revision) {
        Ok(r) if r > 0 => Ok(Revision(r)),
        _ => Err(KvError::other(format!(
            "etcd acknowledged the transaction with revision {revision}"
        ))),
    }
}

/// The etcd comparison for one condition: `key` is the tested key with the store's prefix, or
/// for [`Condition::NoPutAfter`] the start of its range, and `range_end` the end of that range.
fn compare_for(condition: &Condition, key: Vec<u8>, range_end: Vec<u8>) -> Compare {
    match condition {
        // Every key of the range must compare true (a range without keys holds): etcd 3.3 on.
        Condition::NoPutAfter { revision, .. } => Compare::mod_revision(
            key,
            CompareOp::Less,
            i64::try_from(revision.get())
                .unwrap_or(i64::MAX)
                .saturating_add(1),
        )
        .with_range(range_end),
        // A key that does not exist has create_revision 0.
        Condition::Absent { .. } => Compare::create_revision(key, CompareOp::Equal, 0),
        Condition::AtRevision { revision, .. } => match i64::try_from(revision.get()) {
            Ok(r) if r > 0 => Compare::mod_revision(key, CompareOp::Equal, r),
            // No stored key has revision 0 (etcd would match a missing key with mod_revision
            // 0) or one beyond i64: a comparison that never holds.
            _ => Compare::create_revision(key, CompareOp::Less, 0),
        },
    }
}

#[async_trait]
impl KvStore for EtcdStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        validate_key(key)?;
        let full = self.full_key(key);
        let mut response = self
            .run(Kind::Read, |mut kv| {
                let full = full.clone();
                async move { kv.get(full, None).await }
            })
            .await?;
        match response.take_kvs().into_iter().next() {
            None => Ok(None),
            Some(kv) => self.decode(kv).map(Some),
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        if matches_nothing(prefix) {
            return Ok(Vec::new());
        }
        let (start, end) = self.range_for(prefix);
        'listing: for _ in 0..READ_RESTARTS {
            let mut listed = Vec::new();
            let mut from = start.clone();
            // 0 until the first page: then every page is read at that page's revision.
            let mut at_revision = 0;
            loop {
                let options = GetOptions::new()
                    .with_range(end.clone())
                    .with_sort(SortTarget::Key, SortOrder::Ascend)
                    .with_limit(LIST_PAGE)
                    .with_revision(at_revision);
                let page = self
                    .run(Kind::Read, |mut kv| {
                        let (from, options) = (from.clone(), options.clone());
                        async move {
                            match kv.get(from, Some(options)).await {
                                Ok(page) => Ok(Some(page)),
                                Err(e) if is_compacted(&e) => Ok(None),
                                Err(e) => Err(e),
                            }
                        }
                    })
                    .await?;
                let Some(mut page) = page else {
                    continue 'listing;
                };
                if at_revision == 0 {
                    at_revision = page.header().map(|h| h.revision()).unwrap_or(0);
                }
                let more = page.more();
                let kvs = page.take_kvs();
                let next_from = kvs.last().map(|kv| {
                    let mut next = kv.key().to_vec();
                    next.push(0);
                    next
                });
                for kv in kvs {
                    listed.push(self.decode(kv)?);
                }
                match next_from {
                    Some(next) if more => from = next,
                    _ => return Ok(listed),
                }
            }
        }
        Err(KvError::unavailable(format!(
            "listing {prefix:?} kept losing its revision to compaction ({READ_RESTARTS} tries)"
        )))
    }

    /// One read-only etcd transaction per [`MAX_TXN_OPS`] reads (usually just one): one round
    /// trip, one snapshot. Later batches read at the first batch's revision.
    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        for read in reads {
            self.read_op(read, 0)?;
        }
        'reading: for _ in 0..READ_RESTARTS {
            let mut results = Vec::with_capacity(reads.len());
            let mut at_revision = 0;
            for batch in reads.chunks(MAX_TXN_OPS) {
                let planned = batch
                    .iter()
                    .map(|read| self.read_op(read, at_revision))
                    .collect::<Result<Vec<_>, _>>()?;
                let ops: Vec<TxnOp> = planned.iter().flatten().cloned().collect();
                let mut answers = Vec::new().into_iter();
                if !ops.is_empty() {
                    let sent = ops.len();
                    let request = etcd_client::Txn::new().and_then(ops);
                    let response = self
                        .run(Kind::Read, |mut kv| {
                            let request = request.clone();
                            async move {
                                match kv.txn(request).await {
                                    Ok(response) => Ok(Some(response)),
                                    Err(e) if is_compacted(&e) => Ok(None),
                                    Err(e) => Err(e),
                                }
                            }
                        })
                        .await?;
                    let Some(response) = response else {
                        continue 'reading;
                    };
                    if at_revision == 0 {
                        at_revision = response.header().map(|h| h.revision()).unwrap_or(0);
                    }
                    let got = response.op_responses();
                    if got.len() != sent {
                        return Err(KvError::other(format!(
                            "etcd answered {} of {sent} reads in a transaction",
                            got.len()
                        )));
                    }
                    answers = got.into_iter();
                }
                for (read, op) in batch.iter().zip(&planned) {
                    // Only reads that were sent consume an answer, in order.
                    let answer = if op.is_some() { answers.next() } else { None };
                    let kvs = match (op, answer) {
                        (None, _) => Vec::new(),
                        (Some(_), Some(TxnOpResponse::Get(mut got))) => got
                            .take_kvs()
                            .into_iter()
                            .map(|kv| self.decode(kv))
                            .collect::<Result<Vec<_>, _>>()?,
                        (Some(_), _) => {
                            return Err(KvError::other(
                                "etcd answered a read in a transaction with something else",
                            ))
                        }
                    };
                    results.push(match read {
                        Read::Get(_) => ReadResult::Got(kvs.into_iter().next()),
                        Read::List(_) | Read::Range { .. } => ReadResult::Listed(kvs),
                    });
                }
            }
            return Ok(results);
        }
        Err(KvError::unavailable(format!(
            "a batch of {} reads kept losing its revision to compaction ({READ_RESTARTS} tries)",
            reads.len()
        )))
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        txn.validate()?;
        let ops: Vec<TxnOp> = txn
            .ops
            .iter()
            .map(|op| match op {
                Op::Put { key, value } => TxnOp::put(self.full_key(key), value.clone(), None),
                Op::Delete { key } => TxnOp::delete(self.full_key(key), None),
            })
            .collect();
        let request = etcd_client::Txn::new()
            .when(comparisons(&self.prefix, &txn.conditions))
            .and_then(ops)
            .or_else(reads_of_the_tested_keys(&self.prefix, &txn.conditions));

        let response = self
            .run(Kind::Write, |mut kv| {
                let request = request.clone();
                async move { kv.txn(request).await }
            })
            .await?;

        if response.succeeded() {
            return acknowledged_revision(response.header().map(|h| h.revision()).unwrap_or(0));
        }
        Err(failed_condition(&self.prefix, &txn, response)?)
    }
}

/// `key` under the store prefix `prefix`.
pub(crate) fn full_key(prefix: &str, key: &str) -> Vec<u8> {
    let mut full = Vec::with_capacity(prefix.len() + key.len());
    full.extend_from_slice(prefix.as_bytes());
    full.extend_from_slice(key.as_bytes());
    full
}

/// The etcd range `[start, end)` holding every key that starts with `key_prefix` under the store
/// prefix `prefix`. An `end` of `[0]` means "to the end of the key space".
fn range_for(prefix: &str, key_prefix: &str) -> (Vec<u8>, Vec<u8>) {
    let start = full_key(prefix, key_prefix);
    if start.is_empty() {
        return (vec![0], vec![0]);
    }
    let end = prefix_end(&start);
    (start, end)
}

/// The etcd key a condition tests (under the store prefix `prefix`), or the range of its prefix;
/// an empty end: one key.
fn tested(prefix: &str, condition: &Condition) -> (Vec<u8>, Vec<u8>) {
    if condition.tests_a_prefix() {
        range_for(prefix, condition.key())
    } else {
        (full_key(prefix, condition.key()), Vec::new())
    }
}

/// The etcd comparisons of a transaction's `conditions`, with keys under the store prefix `prefix`.
pub(crate) fn comparisons(prefix: &str, conditions: &[Condition]) -> Vec<Compare> {
    conditions
        .iter()
        .map(|c| {
            let (key, end) = tested(prefix, c);
            compare_for(c, key, end)
        })
        .collect()
}

/// The reads a transaction makes when a comparison fails: every tested key (revisions only), in
/// the same transaction, so that [`failed_condition`] can name the first failed condition exactly.
pub(crate) fn reads_of_the_tested_keys(prefix: &str, conditions: &[Condition]) -> Vec<TxnOp> {
    conditions
        .iter()
        .map(|c| {
            let (key, end) = tested(prefix, c);
            let mut options = GetOptions::new().with_keys_only();
            if !end.is_empty() {
                options = options.with_range(end);
            }
            TxnOp::get(key, Some(options))
        })
        .collect()
}

/// The conflict naming the first condition of `txn` that did not hold, from the answer to a
/// transaction that failed its comparisons and made [`reads_of_the_tested_keys`].
///
/// # Errors
/// [`KvError::Corrupt`] for a key etcd returned that the store cannot hold.
pub(crate) fn failed_condition(
    prefix: &str,
    txn: &Txn,
    response: etcd_client::TxnResponse,
) -> Result<KvError, KvError> {
    let mut current: HashMap<String, Revision> = HashMap::new();
    for op in response.op_responses() {
        if let TxnOpResponse::Get(mut got) = op {
            for kv in got.take_kvs() {
                let revision = kv.mod_revision();
                let (key, value) = kv.into_key_value();
                let kv = decode_parts(prefix, key, value, revision)?;
                current.insert(kv.key, kv.revision);
            }
        }
    }
    let newest_under = |key_prefix: &str| {
        Ok(current
            .iter()
            .filter(|(key, _)| key.starts_with(key_prefix))
            .map(|(_, revision)| *revision)
            .max())
    };
    Ok(
        match txn.first_failed_condition(|key| Ok(current.get(key).copied()), newest_under)? {
            Some(failed) => KvError::Conflict {
                key: failed.key().to_owned(),
            },
            None => KvError::other(
                "etcd reported a failed comparison, but every condition holds in its answer",
            ),
        },
    )
}

/// An etcd key-value pair in the store's terms: its key without the store prefix `prefix`.
fn decode_parts(
    prefix: &str,
    key: Vec<u8>,
    value: Vec<u8>,
    revision: i64,
) -> Result<KeyValue, KvError> {
    let shown = || String::from_utf8_lossy(&key).into_owned();
    let Some(stripped) = key.strip_prefix(prefix.as_bytes()) else {
        return Err(KvError::corrupt(
            Some(&shown()),
            format!("etcd returned a key outside the prefix {:?}", prefix),
        ));
    };
    let key = match std::str::from_utf8(stripped) {
        Ok(key) => key.to_owned(),
        Err(_) => {
            return Err(KvError::corrupt(
                Some(&shown()),
                "the key stored in etcd is not UTF-8",
            ))
        }
    };
    let revision = match u64::try_from(revision) {
        Ok(r) if r > 0 => Revision(r),
        _ => {
            return Err(KvError::corrupt(
                Some(&key),
                format!("etcd reported mod_revision {revision}"),
            ))
        }
    };
    Ok(KeyValue {
        key,
        value,
        revision,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte_below_ff() {
        assert_eq!(prefix_end(b"a/b"), b"a/c");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), [0]);
    }

    #[test]
    fn ranges_cover_exactly_the_prefix() {
        let store = EtcdStore::connect_lazy(EtcdConfig::new(["127.0.0.1:1"]).with_prefix("/p/"))
            .expect("valid");
        assert_eq!(store.range_for(""), (b"/p/".to_vec(), b"/p0".to_vec()));
        assert_eq!(
            store.range_for("a/b"),
            (b"/p/a/b".to_vec(), b"/p/a/c".to_vec())
        );
        let bare = EtcdStore::connect_lazy(EtcdConfig::new(["127.0.0.1:1"]).with_prefix(""))
            .expect("valid");
        assert_eq!(bare.range_for(""), (vec![0], vec![0]));
    }

    #[test]
    fn a_transaction_acknowledged_at_revision_0_or_below_is_an_error() {
        assert_eq!(acknowledged_revision(1).expect("revision 1"), Revision(1));
        assert_eq!(
            acknowledged_revision(i64::MAX).expect("the largest").0,
            i64::MAX as u64
        );
        for revision in [0, -1, i64::MIN] {
            match acknowledged_revision(revision) {
                Err(KvError::Other { message }) => {
                    assert!(message.contains(&revision.to_string()), "{message}")
                }
                other => panic!("revision {revision}: expected an error, got {other:?}"),
            }
        }
    }

    #[test]
    fn keys_outside_the_prefix_or_not_utf8_are_corrupt() {
        let store = EtcdStore::connect_lazy(EtcdConfig::new(["127.0.0.1:1"]).with_prefix("/p/"))
            .expect("valid");
        assert!(matches!(
            store.decode_parts(b"/q/x".to_vec(), Vec::new(), 3),
            Err(KvError::Corrupt { .. })
        ));
        assert!(matches!(
            store.decode_parts(b"/p/\xff".to_vec(), Vec::new(), 3),
            Err(KvError::Corrupt { .. })
        ));
        let kv = store
            .decode_parts(b"/p/a/b".to_vec(), b"v".to_vec(), 7)
            .expect("valid");
        assert_eq!(kv.key, "a/b");
        assert_eq!(kv.revision, Revision(7));
        // etcd never reports a stored key at revision 0 or below: such an answer is corrupt.
        for revision in [0, -1] {
            assert!(matches!(
                store.decode_parts(b"/p/a".to_vec(), Vec::new(), revision),
                Err(KvError::Corrupt { .. })
            ));
        }
        assert_eq!(
            store
                .decode_parts(b"/p/a".to_vec(), Vec::new(), 1)
                .expect("revision 1")
                .revision,
            Revision(1)
        );
    }
}
