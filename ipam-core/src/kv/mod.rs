//! The KV-with-revisions storage trait that every blockipam store adapter implements.
//!
//! The model follows etcd v3: string keys, byte values, a store-wide revision that only grows, and
//! one atomic conditional transaction from which every other write is derived.

use std::fmt;

use async_trait::async_trait;

pub mod blocking;
pub mod caching;
pub mod counting;
pub mod durable;
pub mod lockfile;
pub mod memory;
pub mod records;

/// Largest number of operations (puts plus deletes) one transaction may carry.
///
/// etcd's default `--max-txn-ops` is 128; every backend enforces the same limit so that code
/// written against one store behaves the same on all of them.
pub const MAX_TXN_OPS: usize = 128;

/// Largest number of conditions one transaction may carry (same reason as [`MAX_TXN_OPS`]).
pub const MAX_TXN_CONDITIONS: usize = 128;

/// Largest value a store must accept, in bytes (etcd's default request limit is 1.5 MiB).
pub const MAX_VALUE_BYTES: usize = 1024 * 1024 + 4096;

/// Largest total size of one transaction's keys and values, in bytes: below etcd's default
/// 1.5 MiB request limit with room for framing, so every backend refuses the same transactions.
pub const MAX_TXN_BYTES: usize = 1024 * 1024 + 400 * 1024;

/// A point in a store's history.
///
/// Every successful write produces a revision greater than every revision read or written before
/// it on the same store. Revisions are not promised to be contiguous. `Revision::NONE` (zero) is
/// never the revision of a stored key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Revision(pub u64);

impl Revision {
    /// The revision before any write.
    pub const NONE: Revision = Revision(0);

    /// The raw number.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One stored key with its value and the revision of the write that last changed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key, as the caller wrote it (adapters strip any prefix of their own).
    pub key: String,
    /// The stored bytes.
    pub value: Vec<u8>,
    /// Revision of the transaction that last put this key.
    pub revision: Revision,
}

/// What a transaction requires of one key before it applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    /// The key must not exist.
    Absent {
        /// The key tested.
        key: String,
    },
    /// The key must exist and have been last written at exactly this revision.
    AtRevision {
        /// The key tested.
        key: String,
        /// The revision it must carry.
        revision: Revision,
    },
    /// No key starting with `prefix` may have been put after `revision`: every such key was last
    /// written at or before it (a prefix without keys holds). A delete is not a put: a key deleted
    /// since is not seen. What a write decided from an earlier listing of `prefix` is conditioned
    /// on, the listing's newest revision (the greatest revision among the keys it answered, 0
    /// for none) standing for the moment it was read: any put since carries a greater one.
    NoPutAfter {
        /// The string prefix tested, compared as [`KvStore::list`] compares it (`""`: every key).
        prefix: String,
        /// The newest revision a key under `prefix` may carry.
        revision: Revision,
    },
}

impl Condition {
    /// The key this condition tests; for [`Condition::NoPutAfter`], its prefix. A conflict
    /// names the first failed condition by it.
    pub fn key(&self) -> &str {
        match self {
            Condition::Absent { key } | Condition::AtRevision { key, .. } => key,
            Condition::NoPutAfter { prefix, .. } => prefix,
        }
    }

    /// True for [`Condition::NoPutAfter`], which tests every key under a prefix rather than one key.
    pub fn tests_a_prefix(&self) -> bool {
        matches!(self, Condition::NoPutAfter { .. })
    }

    /// Builds the condition "key is absent".
    pub fn absent(key: impl Into<String>) -> Self {
        Condition::Absent { key: key.into() }
    }

    /// Builds the condition "key exists at exactly `revision`".
    pub fn at_revision(key: impl Into<String>, revision: Revision) -> Self {
        Condition::AtRevision {
            key: key.into(),
            revision,
        }
    }

    /// Builds the condition "no key under `prefix` was put after `revision`".
    pub fn no_put_after(prefix: impl Into<String>, revision: Revision) -> Self {
        Condition::NoPutAfter {
            prefix: prefix.into(),
            revision,
        }
    }

    /// True when the store as it is satisfies this condition, given `current`: for a key
    /// condition, the revision the key is stored at (None: absent); for
    /// [`Condition::NoPutAfter`], the greatest revision among the keys under its prefix (None:
    /// no key there).
    pub fn holds_for(&self, current: Option<Revision>) -> bool {
        match (self, current) {
            (Condition::Absent { .. }, None) => true,
            (Condition::AtRevision { revision, .. }, Some(found)) => *revision == found,
            (Condition::NoPutAfter { revision, .. }, newest) => {
                newest.is_none_or(|found| found <= *revision)
            }
            _ => false,
        }
    }
}

/// One write inside a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Store `value` under `key`, creating or replacing it.
    Put {
        /// The key written.
        key: String,
        /// The bytes stored.
        value: Vec<u8>,
    },
    /// Remove `key`; removing a key that does not exist is not an error.
    Delete {
        /// The key removed.
        key: String,
    },
}

impl Op {
    /// The key this operation writes.
    pub fn key(&self) -> &str {
        match self {
            Op::Put { key, .. } | Op::Delete { key } => key,
        }
    }

    /// Builds a put.
    pub fn put(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Op::Put {
            key: key.into(),
            value: value.into(),
        }
    }

    /// Builds a delete.
    pub fn delete(key: impl Into<String>) -> Self {
        Op::Delete { key: key.into() }
    }
}

/// An atomic conditional transaction: if every condition holds, every operation applies;
/// otherwise nothing is written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    /// What must hold before anything is written.
    pub conditions: Vec<Condition>,
    /// What is written when the conditions hold, in order.
    pub ops: Vec<Op>,
}

impl Txn {
    /// An empty transaction.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a condition.
    pub fn when(mut self, condition: Condition) -> Self {
        self.conditions.push(condition);
        self
    }

    /// Adds an operation.
    pub fn then(mut self, op: Op) -> Self {
        self.ops.push(op);
        self
    }

    /// Checks the shape rules every backend enforces before touching the store.
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] when the transaction has no operation, too many conditions or
    /// operations, an empty key, a key written twice, a key tested twice, a value that is too large,
    /// or more than [`MAX_TXN_BYTES`] of keys and values in all.
    pub fn validate(&self) -> Result<(), KvError> {
        if self.ops.is_empty() {
            return Err(KvError::invalid(
                "a transaction needs at least one operation",
            ));
        }
        if self.ops.len() > MAX_TXN_OPS {
            return Err(KvError::invalid(format!(
                "a transaction may carry at most {MAX_TXN_OPS} operations, this one has {}",
                self.ops.len()
            )));
        }
        if self.conditions.len() > MAX_TXN_CONDITIONS {
            return Err(KvError::invalid(format!(
                "a transaction may carry at most {MAX_TXN_CONDITIONS} conditions, this one has {}",
                self.conditions.len()
            )));
        }
        let total: usize = self
            .ops
            .iter()
            .map(|op| match op {
                Op::Put { key, value } => key.len() + value.len(),
                Op::Delete { key } => key.len(),
            })
            .chain(self.conditions.iter().map(|c| c.key().len()))
            .sum();
        if total > MAX_TXN_BYTES {
            return Err(KvError::invalid(format!(
                "a transaction may carry at most {MAX_TXN_BYTES} bytes of keys and values, this one has {total}"
            )));
        }
        let mut written = std::collections::HashSet::new();
        for op in &self.ops {
            validate_key(op.key())?;
            if !written.insert(op.key()) {
                return Err(KvError::invalid(format!(
                    "key {:?} is written twice in one transaction",
                    op.key()
                )));
            }
            if let Op::Put { value, .. } = op {
                if value.len() > MAX_VALUE_BYTES {
                    return Err(KvError::invalid(format!(
                        "value for key {:?} is {} bytes, the limit is {MAX_VALUE_BYTES}",
                        op.key(),
                        value.len()
                    )));
                }
            }
        }
        let mut tested = std::collections::HashSet::new();
        for condition in &self.conditions {
            if condition.tests_a_prefix() {
                validate_prefix(condition.key())?;
            } else {
                validate_key(condition.key())?;
            }
            if !tested.insert((condition.tests_a_prefix(), condition.key())) {
                return Err(KvError::invalid(format!(
                    "{} {:?} is tested twice in one transaction",
                    if condition.tests_a_prefix() {
                        "prefix"
                    } else {
                        "key"
                    },
                    condition.key()
                )));
            }
        }
        Ok(())
    }

    /// The first condition (in order) that does not hold, given lookups of the store as it is:
    /// `current_revision` of a key (None: absent), `newest_under` a prefix (the greatest revision
    /// among its keys, None: no key), asked only for [`Condition::NoPutAfter`].
    ///
    /// Backends that evaluate conditions themselves use this so that all of them name the same key.
    pub fn first_failed_condition<F, G>(
        &self,
        mut current_revision: F,
        mut newest_under: G,
    ) -> Result<Option<&Condition>, KvError>
    where
        F: FnMut(&str) -> Result<Option<Revision>, KvError>,
        G: FnMut(&str) -> Result<Option<Revision>, KvError>,
    {
        for condition in &self.conditions {
            let current = if condition.tests_a_prefix() {
                newest_under(condition.key())?
            } else {
                current_revision(condition.key())?
            };
            if !condition.holds_for(current) {
                return Ok(Some(condition));
            }
        }
        Ok(None)
    }

    /// The prefixes this transaction's [`Condition::NoPutAfter`] conditions test, in order.
    pub fn tested_prefixes(&self) -> impl Iterator<Item = &str> {
        self.conditions
            .iter()
            .filter(|c| c.tests_a_prefix())
            .map(Condition::key)
    }
}

/// Rejects keys no backend can store faithfully.
///
/// # Errors
/// [`KvError::InvalidArgument`] for an empty key or one containing a NUL character.
pub fn validate_key(key: &str) -> Result<(), KvError> {
    if key.is_empty() {
        return Err(KvError::invalid("keys may not be empty"));
    }
    if key.contains('\0') {
        return Err(KvError::invalid(format!(
            "key {key:?} contains a NUL character"
        )));
    }
    Ok(())
}

/// Rejects prefixes no backend can compare faithfully (the empty prefix, every key, is allowed).
///
/// # Errors
/// [`KvError::InvalidArgument`] for a prefix containing a NUL character.
pub fn validate_prefix(prefix: &str) -> Result<(), KvError> {
    if prefix.contains('\0') {
        return Err(KvError::invalid(format!(
            "prefix {prefix:?} contains a NUL character"
        )));
    }
    Ok(())
}

/// Everything that can go wrong talking to a store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// A transaction condition did not hold; nothing was written.
    #[error("condition failed on key {key:?}: nothing was written")]
    Conflict {
        /// The first key (in condition order) whose condition did not hold.
        key: String,
    },
    /// The store could not be reached or is busy; nothing was written. Retrying may succeed.
    #[error("store unavailable: {message}")]
    Unavailable {
        /// What happened, naming the endpoint or path.
        message: String,
    },
    /// The write may or may not have been applied; re-read before deciding anything.
    #[error("outcome unknown, re-read the store: {message}")]
    Indeterminate {
        /// What happened.
        message: String,
    },
    /// Stored bytes are not what this software writes.
    #[error("corrupt data{}: {message}", key.as_ref().map(|k| format!(" at key {k:?}")).unwrap_or_default())]
    Corrupt {
        /// The key whose bytes are bad, when known.
        key: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// The request itself is malformed; retrying will not help.
    #[error("invalid argument: {message}")]
    InvalidArgument {
        /// What is wrong with it.
        message: String,
    },
    /// A permanent failure not covered above (permissions, configuration, engine errors).
    #[error("store error: {message}")]
    Other {
        /// What happened.
        message: String,
    },
}

impl KvError {
    /// True when the same request may succeed if simply tried again later
    /// (the store was unavailable). A conflict is not retryable as-is: re-read first.
    pub fn is_retryable(&self) -> bool {
        matches!(self, KvError::Unavailable { .. })
    }

    /// True when a condition failed.
    pub fn is_conflict(&self) -> bool {
        matches!(self, KvError::Conflict { .. })
    }

    /// Shorthand for [`KvError::InvalidArgument`].
    pub fn invalid(message: impl Into<String>) -> Self {
        KvError::InvalidArgument {
            message: message.into(),
        }
    }

    /// Shorthand for [`KvError::Unavailable`].
    pub fn unavailable(message: impl Into<String>) -> Self {
        KvError::Unavailable {
            message: message.into(),
        }
    }

    /// Shorthand for [`KvError::Other`].
    pub fn other(message: impl Into<String>) -> Self {
        KvError::Other {
            message: message.into(),
        }
    }

    /// Shorthand for [`KvError::Corrupt`].
    pub fn corrupt(key: Option<&str>, message: impl Into<String>) -> Self {
        KvError::Corrupt {
            key: key.map(str::to_owned),
            message: message.into(),
        }
    }
}

/// Returns `prefix` with a trailing `/` added when it lacks one: the prefix that lists exactly the
/// children of a directory-like key.
pub fn dir_prefix(dir: &str) -> String {
    if dir.ends_with('/') {
        dir.to_owned()
    } else {
        format!("{dir}/")
    }
}

/// One read inside a [`KvStore::read_many`] batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    /// Read one key, as [`KvStore::get`].
    Get(String),
    /// List a string prefix, as [`KvStore::list`].
    List(String),
    /// The first `limit` keys that start with `prefix` and are not below `from`, ascending:
    /// a window of a listing, sized by the caller rather than by the store. Answered by
    /// [`ReadResult::Listed`]; `from` below `prefix` starts at the prefix's first key, and a
    /// `limit` of 0 is [`KvError::InvalidArgument`]. What comes back is bounded by `limit`; what
    /// the store does to find it need not be: etcd walks its in-memory index over every key from
    /// `from` to the prefix's end to answer a limited range (3.4 collects them all, later
    /// releases still count them), so on a large prefix a few reads by [`Read::Get`] cost it less.
    Range {
        /// The string prefix every answered key starts with.
        prefix: String,
        /// The smallest key answered.
        from: String,
        /// How many keys at most.
        limit: u32,
    },
}

impl Read {
    /// A window of `prefix`'s listing: at most `limit` keys from `from` on.
    pub fn range(prefix: impl Into<String>, from: impl Into<String>, limit: u32) -> Self {
        Read::Range {
            prefix: prefix.into(),
            from: from.into(),
            limit,
        }
    }

    /// Checks what can be checked before asking the store: a `Get`'s key, a `Range`'s limit.
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] for an empty key or a limit of 0.
    pub fn validate(&self) -> Result<(), KvError> {
        match self {
            Read::Get(key) => validate_key(key),
            Read::List(_) => Ok(()),
            Read::Range { limit: 0, .. } => Err(KvError::invalid(
                "a range read must ask for at least one key",
            )),
            Read::Range { .. } => Ok(()),
        }
    }

    /// Where a window of `prefix` from `from` starts: `from`, or the prefix when `from` is below it.
    pub fn range_start<'a>(prefix: &'a str, from: &'a str) -> &'a str {
        if from < prefix {
            prefix
        } else {
            from
        }
    }
}

/// The window a [`Read::Range`] answers, cut from the whole listing of its prefix (sorted by
/// key): for stores and protocols without a ranged read of their own.
pub fn range_of_listing(listed: Vec<KeyValue>, from: &str, limit: u32) -> Vec<KeyValue> {
    listed
        .into_iter()
        .filter(|kv| kv.key.as_str() >= from)
        .take(limit as usize)
        .collect()
}

/// The answer to one [`Read`], in the same position as the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadResult {
    /// Answer to [`Read::Get`].
    Got(Option<KeyValue>),
    /// Answer to [`Read::List`] and [`Read::Range`].
    Listed(Vec<KeyValue>),
}

impl ReadResult {
    /// The value of a `Get`, or an invalid-argument error if this answered a `List`.
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] when the result is of the other kind.
    pub fn into_got(self) -> Result<Option<KeyValue>, KvError> {
        match self {
            ReadResult::Got(kv) => Ok(kv),
            ReadResult::Listed(_) => Err(KvError::invalid(
                "expected a get result, found a list result",
            )),
        }
    }

    /// The entries of a `List`, or an invalid-argument error if this answered a `Get`.
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] when the result is of the other kind.
    pub fn into_listed(self) -> Result<Vec<KeyValue>, KvError> {
        match self {
            ReadResult::Listed(kvs) => Ok(kvs),
            ReadResult::Got(_) => Err(KvError::invalid(
                "expected a list result, found a get result",
            )),
        }
    }
}

/// The answer to [`KvStore::read_many_cached`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedRead {
    /// One result per read, in request order, as [`KvStore::read_many`] answers.
    pub results: Vec<ReadResult>,
    /// The conditions that hold exactly when every result is still what the store holds (empty
    /// from a store that keeps nothing). A transaction decided from these results carries them:
    /// it must when `from_cache`; otherwise it may, and a store that keeps what it reads then
    /// keeps it exact past the transaction.
    pub validators: Vec<Condition>,
    /// True when answered from what the store kept of earlier answers and writes, which may be
    /// stale: a caller that ends without a transaction carrying `validators` must read again,
    /// without the cache, before it reports anything decided from these results.
    pub from_cache: bool,
    /// For each result, in request order, a revision at which it is known to have been exactly
    /// the store's ([`Revision::NONE`]: not known); empty from a store that does not say. A
    /// result known as of revision `a` is still the store's at a later commit when no write that
    /// could change it came after `a`: what lets a caller test one key that every such write
    /// raises instead of each result ([`crate::kv::caching`] says how it is known).
    pub current_as_of: Vec<Revision>,
}

/// A key-value store with revisions and atomic conditional transactions.
///
/// Adapters implement [`get`](KvStore::get), [`list`](KvStore::list) and
/// [`commit`](KvStore::commit); the convenience writes are provided on top of `commit`.
/// The trait is object safe: binaries hold an `Arc<dyn KvStore>` chosen at run time.
#[async_trait]
pub trait KvStore: Send + Sync + fmt::Debug {
    /// Reads one key.
    ///
    /// # Behavior
    /// - returns the value with the revision of the write that last changed it;
    /// - returns `None` for a key that was never written or was deleted.
    ///
    /// # Errors
    /// - [`KvError::InvalidArgument`] for an empty key;
    /// - [`KvError::Unavailable`] when the store cannot be reached;
    /// - [`KvError::Corrupt`] when the stored record cannot be decoded.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError>;

    /// Lists every key that starts with `prefix`, compared as a plain string.
    ///
    /// # Behavior
    /// - the prefix is a string prefix: `list("a/b")` returns `a/b`, `a/b/c` **and** `a/bc`;
    ///   use [`list_dir`](KvStore::list_dir) (or a prefix ending in `/`) for a directory's children;
    /// - results are sorted by key, byte-wise ascending, each with its revision;
    /// - an empty prefix lists the whole store;
    /// - the answer is the store at one moment: never some keys as one transaction left them and
    ///   others as a later one did.
    ///
    /// # Errors
    /// - [`KvError::Unavailable`] when the store cannot be reached;
    /// - [`KvError::Corrupt`] when a stored record cannot be decoded.
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError>;

    /// Applies a transaction atomically.
    ///
    /// # Behavior
    /// - when every condition holds, every operation applies, in order, and the call returns the
    ///   revision of the write, greater than any revision read or written before on this store;
    ///   every key put carries that revision;
    /// - a transaction that changes nothing (only deletes of keys that do not exist) may return the
    ///   current revision instead of a new one (etcd does), but never a smaller one;
    /// - when any condition fails, nothing is written;
    /// - deleting a key that does not exist is not an error;
    /// - the write is durable when the call returns `Ok`.
    ///
    /// # Errors
    /// - [`KvError::Conflict`] naming the first failed condition's key, with nothing written;
    /// - [`KvError::InvalidArgument`] when [`Txn::validate`] rejects the transaction (nothing written);
    /// - [`KvError::Unavailable`] when the store could not be reached (nothing written);
    /// - [`KvError::Indeterminate`] when the write may or may not have landed.
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError>;

    /// Performs several reads as one request where the backend can (etcd: one `Txn` of ranges,
    /// one round trip, one snapshot).
    ///
    /// # Behavior
    /// - returns one [`ReadResult`] per [`Read`], in request order, each as `get` / `list` would;
    /// - backends that override it answer every read from one snapshot; the default performs the
    ///   reads one after another, so callers that need consistency must still guard their writes
    ///   with transaction conditions.
    ///
    /// # Errors
    /// As [`get`](KvStore::get) and [`list`](KvStore::list).
    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        // A read the store would refuse refuses the batch before anything is read.
        for read in reads {
            read.validate()?;
        }
        let mut results = Vec::with_capacity(reads.len());
        for read in reads {
            results.push(match read {
                Read::Get(key) => ReadResult::Got(self.get(key).await?),
                Read::List(prefix) => ReadResult::Listed(self.list(prefix).await?),
                Read::Range {
                    prefix,
                    from,
                    limit,
                } => {
                    read.validate()?;
                    ReadResult::Listed(range_of_listing(self.list(prefix).await?, from, *limit))
                }
            });
        }
        Ok(results)
    }

    /// Performs several reads as [`read_many`](KvStore::read_many) does, with the conditions
    /// under which the answer is still the store's ([`CachedRead`]); when `may_use_cache`, a
    /// store that keeps what it read and wrote may answer from that. Stores that keep nothing
    /// read, with no conditions (the default).
    ///
    /// # Errors
    /// As [`read_many`](KvStore::read_many).
    async fn read_many_cached(
        &self,
        reads: &[Read],
        may_use_cache: bool,
    ) -> Result<CachedRead, KvError> {
        let _ = may_use_cache;
        Ok(CachedRead {
            results: self.read_many(reads).await?,
            validators: Vec::new(),
            from_cache: false,
            current_as_of: Vec::new(),
        })
    }

    /// Lists the children of a directory-like key: `list_dir("a/b")` is `list("a/b/")`.
    ///
    /// # Behavior
    /// - never returns `a/bc` for `a/b`; returns every key below `a/b/`, at any depth.
    ///
    /// # Errors
    /// As [`list`](KvStore::list).
    async fn list_dir(&self, dir: &str) -> Result<Vec<KeyValue>, KvError> {
        self.list(&dir_prefix(dir)).await
    }

    /// Creates `key` only if it does not exist.
    ///
    /// # Behavior
    /// - returns the revision of the new key.
    ///
    /// # Errors
    /// - [`KvError::Conflict`] when the key exists (nothing written); otherwise as [`commit`](KvStore::commit).
    async fn create(&self, key: &str, value: Vec<u8>) -> Result<Revision, KvError> {
        self.commit(
            Txn::new()
                .when(Condition::absent(key))
                .then(Op::put(key, value)),
        )
        .await
    }

    /// Replaces `key` only if it is stored at exactly `revision`.
    ///
    /// # Behavior
    /// - returns the key's new revision.
    ///
    /// # Errors
    /// - [`KvError::Conflict`] when the key is missing or at another revision (nothing written);
    ///   otherwise as [`commit`](KvStore::commit).
    async fn update(
        &self,
        key: &str,
        revision: Revision,
        value: Vec<u8>,
    ) -> Result<Revision, KvError> {
        self.commit(
            Txn::new()
                .when(Condition::at_revision(key, revision))
                .then(Op::put(key, value)),
        )
        .await
    }

    /// Deletes `key` only if it is stored at exactly `revision`.
    ///
    /// # Errors
    /// - [`KvError::Conflict`] when the key is missing or at another revision (nothing deleted);
    ///   otherwise as [`commit`](KvStore::commit).
    async fn delete_at(&self, key: &str, revision: Revision) -> Result<Revision, KvError> {
        self.commit(
            Txn::new()
                .when(Condition::at_revision(key, revision))
                .then(Op::delete(key)),
        )
        .await
    }

    /// Stores `value` under `key` whatever was there.
    ///
    /// # Errors
    /// As [`commit`](KvStore::commit), never a conflict.
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<Revision, KvError> {
        self.commit(Txn::new().then(Op::put(key, value))).await
    }

    /// Deletes `key` whatever its revision; deleting a missing key succeeds.
    ///
    /// # Errors
    /// As [`commit`](KvStore::commit), never a conflict.
    async fn delete(&self, key: &str) -> Result<Revision, KvError> {
        self.commit(Txn::new().then(Op::delete(key))).await
    }
}

#[cfg(test)]
mod tests {
    use super::memory::MemoryStore;
    use super::*;

    /// A store with only the methods an adapter must write: every other call takes the trait's
    /// default, as it would in an adapter that overrides nothing.
    #[derive(Debug)]
    struct RequiredOnly(MemoryStore);

    #[async_trait]
    impl KvStore for RequiredOnly {
        async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
            self.0.get(key).await
        }

        async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
            self.0.list(prefix).await
        }

        async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
            self.0.commit(txn).await
        }
    }

    fn keys_of(result: &ReadResult) -> Vec<&str> {
        match result {
            ReadResult::Got(got) => got.iter().map(|kv| kv.key.as_str()).collect(),
            ReadResult::Listed(listed) => listed.iter().map(|kv| kv.key.as_str()).collect(),
        }
    }

    #[tokio::test]
    async fn the_default_read_many_answers_each_read_in_order() {
        let store = RequiredOnly(MemoryStore::new());
        for key in ["d/a", "d/b", "d/c", "d/d", "e/a"] {
            store.put(key, b"v".to_vec()).await.expect("put");
        }
        let results = store
            .read_many(&[
                Read::range("d/", "d/b", 2),
                Read::Get("e/a".into()),
                Read::List("d/".into()),
                Read::Get("d/missing".into()),
                Read::range("d/", "", 10),
            ])
            .await
            .expect("read_many");
        let keys: Vec<Vec<&str>> = results.iter().map(keys_of).collect();
        assert_eq!(
            keys,
            vec![
                vec!["d/b", "d/c"],
                vec!["e/a"],
                vec!["d/a", "d/b", "d/c", "d/d"],
                vec![],
                vec!["d/a", "d/b", "d/c", "d/d"],
            ]
        );
        assert!(matches!(results[3], ReadResult::Got(None)));
    }

    #[tokio::test]
    async fn the_default_read_many_refuses_a_range_of_no_keys_in_a_batch() {
        let store = RequiredOnly(MemoryStore::new());
        let refused = store
            .read_many(&[Read::List("d/".into()), Read::range("d/", "d/a", 0)])
            .await;
        assert!(
            matches!(refused, Err(KvError::InvalidArgument { .. })),
            "{refused:?}"
        );
    }

    #[test]
    fn a_window_of_a_listing_starts_at_its_key_and_stops_at_its_limit() {
        let listing: Vec<KeyValue> = ["p/a", "p/b", "p/c"]
            .iter()
            .map(|key| KeyValue {
                key: (*key).to_owned(),
                value: Vec::new(),
                revision: Revision(1),
            })
            .collect();
        let window = |from: &str, limit: u32| -> Vec<String> {
            range_of_listing(listing.clone(), from, limit)
                .into_iter()
                .map(|kv| kv.key)
                .collect()
        };
        assert_eq!(window("p/b", 5), ["p/b", "p/c"]);
        assert_eq!(window("p/a", 2), ["p/a", "p/b"]);
        assert_eq!(window("p/bb", 5), ["p/c"]);
        assert!(window("p/d", 5).is_empty());
    }

    #[test]
    fn only_an_unavailable_store_is_retryable_and_only_a_failed_condition_a_conflict() {
        let message = || "m".to_owned();
        let errors = [
            KvError::Conflict { key: "k".into() },
            KvError::Unavailable { message: message() },
            KvError::Indeterminate { message: message() },
            KvError::Corrupt {
                key: None,
                message: message(),
            },
            KvError::InvalidArgument { message: message() },
            KvError::Other { message: message() },
        ];
        let retryable: Vec<bool> = errors.iter().map(KvError::is_retryable).collect();
        let conflict: Vec<bool> = errors.iter().map(KvError::is_conflict).collect();
        assert_eq!(retryable, [false, true, false, false, false, false]);
        assert_eq!(conflict, [true, false, false, false, false, false]);
    }

    #[test]
    fn a_revision_reads_as_its_number() {
        assert_eq!(Revision(42).to_string(), "42");
        assert_eq!(Revision::NONE.to_string(), "0");
    }
}
