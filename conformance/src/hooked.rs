//! One store wrapper for the cases that stage a race deterministically: it passes every call
//! through to the store under test, and can run a hook once right after a chosen read has been
//! answered or right before a chosen commit reaches the store (another client's writes land
//! exactly there), refuse chosen commits (as if another writer always got there first), yield to
//! the scheduler before every call (so that concurrent tasks interleave at every store call even
//! on a store whose calls never wait), and count commits and conflicts.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use ipam_core::{KeyValue, KvError, KvStore, Op, Read, ReadResult, Revision, Txn};

type Hook = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;
type ReadTrigger = Box<dyn Fn(&[Read]) -> bool + Send + Sync>;
type CommitTrigger = Box<dyn Fn(&Txn) -> bool + Send + Sync>;
type Refusal = Box<dyn Fn(&Txn) -> Option<KvError> + Send + Sync>;

/// The wrapper; see the module documentation.
pub struct HookedStore {
    inner: Arc<dyn KvStore>,
    yield_first: bool,
    after_read: Mutex<Option<(ReadTrigger, Hook)>>,
    before_commit: Mutex<Option<(CommitTrigger, Hook)>>,
    refuse: Mutex<Option<Refusal>>,
    commits: AtomicU64,
    conflicts: AtomicU64,
}

impl fmt::Debug for HookedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookedStore")
            .field("inner", &self.inner)
            .field("yield_first", &self.yield_first)
            .finish_non_exhaustive()
    }
}

fn boxed<H, Fut>(hook: H) -> Hook
where
    H: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    Box::new(move || Box::pin(hook()))
}

impl HookedStore {
    /// Wraps `inner`, passing everything through until something is armed.
    pub fn new(inner: Arc<dyn KvStore>) -> Arc<Self> {
        Arc::new(Self::with(inner, false))
    }

    /// Wraps `inner`, yielding to the scheduler before every call: tasks sharing it interleave
    /// at every store call. It serialises nothing.
    pub fn racing(inner: Arc<dyn KvStore>) -> Arc<Self> {
        Arc::new(Self::with(inner, true))
    }

    fn with(inner: Arc<dyn KvStore>, yield_first: bool) -> Self {
        HookedStore {
            inner,
            yield_first,
            after_read: Mutex::new(None),
            before_commit: Mutex::new(None),
            refuse: Mutex::new(None),
            commits: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
        }
    }

    /// The store under test, to write through without triggering anything.
    pub fn inner(&self) -> &Arc<dyn KvStore> {
        &self.inner
    }

    /// Runs `hook` once, after the first read (a `get`, a `list` or a batch) for which `trigger`
    /// holds has been answered, before the answer reaches the caller.
    pub fn after_read<T, H, Fut>(&self, trigger: T, hook: H)
    where
        T: Fn(&[Read]) -> bool + Send + Sync + 'static,
        H: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        *self.after_read.lock().expect("hook lock") = Some((Box::new(trigger), boxed(hook)));
    }

    /// Runs `hook` once, right before the first commit for which `trigger` holds reaches the
    /// store.
    pub fn before_commit<T, H, Fut>(&self, trigger: T, hook: H)
    where
        T: Fn(&Txn) -> bool + Send + Sync + 'static,
        H: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        *self.before_commit.lock().expect("hook lock") = Some((Box::new(trigger), boxed(hook)));
    }

    /// From now on, a commit for which `refuse` returns an error fails with it, writing nothing.
    pub fn refuse_commits<R>(&self, refuse: R)
    where
        R: Fn(&Txn) -> Option<KvError> + Send + Sync + 'static,
    {
        *self.refuse.lock().expect("refusal lock") = Some(Box::new(refuse));
    }

    /// Whether the hook armed with [`after_read`](Self::after_read) has run.
    pub fn read_hook_fired(&self) -> bool {
        self.after_read.lock().expect("hook lock").is_none()
    }

    /// Whether the hook armed with [`before_commit`](Self::before_commit) has run.
    pub fn commit_hook_fired(&self) -> bool {
        self.before_commit.lock().expect("hook lock").is_none()
    }

    /// Commits that reached the store under test.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::SeqCst)
    }

    /// Commits the store under test refused with a conflict.
    pub fn conflicts(&self) -> u64 {
        self.conflicts.load(Ordering::SeqCst)
    }

    async fn before_call(&self) {
        if self.yield_first {
            tokio::task::yield_now().await;
        }
    }

    async fn after(&self, reads: &[Read]) {
        let hook = {
            let mut armed = self.after_read.lock().expect("hook lock");
            match &*armed {
                Some((trigger, _)) if trigger(reads) => armed.take().map(|(_, hook)| hook),
                _ => None,
            }
        };
        if let Some(hook) = hook {
            hook().await;
        }
    }
}

/// A commit trigger: the transaction deletes `key` (or, with `on_any_write`, writes it at all).
pub fn writes_key(key: String, on_any_write: bool) -> impl Fn(&Txn) -> bool + Send + Sync {
    move |txn| {
        txn.ops.iter().any(|op| match op {
            Op::Delete { key: k } => *k == key,
            Op::Put { key: k, .. } => on_any_write && *k == key,
        })
    }
}

#[async_trait]
impl KvStore for HookedStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.before_call().await;
        let found = self.inner.get(key).await;
        self.after(&[Read::Get(key.to_owned())]).await;
        found
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.before_call().await;
        let found = self.inner.list(prefix).await;
        self.after(&[Read::List(prefix.to_owned())]).await;
        found
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.before_call().await;
        let hook = {
            let mut armed = self.before_commit.lock().expect("hook lock");
            match &*armed {
                Some((trigger, _)) if trigger(&txn) => armed.take().map(|(_, hook)| hook),
                _ => None,
            }
        };
        if let Some(hook) = hook {
            hook().await;
        }
        let refused = self
            .refuse
            .lock()
            .expect("refusal lock")
            .as_ref()
            .and_then(|refuse| refuse(&txn));
        if let Some(e) = refused {
            return Err(e);
        }
        self.commits.fetch_add(1, Ordering::SeqCst);
        let result = self.inner.commit(txn).await;
        if matches!(result, Err(KvError::Conflict { .. })) {
            self.conflicts.fetch_add(1, Ordering::SeqCst);
        }
        result
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        self.before_call().await;
        let found = self.inner.read_many(reads).await;
        self.after(reads).await;
        found
    }
}
