//! `SledStore`: conditions, the revision counter and the records of a commit in one sled transaction.

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ipam_core::kv::durable;
use ipam_core::kv::records::{decode_counter, decode_record, encode_record};
use ipam_core::kv::{
    validate_key, KeyValue, KvError, KvStore, Op, Read, ReadResult, Revision, Txn,
};
use ipam_core::lockfile::{sibling, store_lock_error, LockFile};
use sled::transaction::{
    ConflictableTransactionError, TransactionError, UnabortableTransactionError,
};
use sled::Transactional;

use crate::config::SledConfig;
use crate::error::{engine_error, is_engine_lock_busy};
use ipam_core::blocking::Stage;

/// The value of [`FORMAT_KEY`] in every store this crate writes.
pub const FORMAT: &str = "blockipam-kv-v1";
/// The sled tree holding the records, one per key.
pub const DATA_TREE: &str = "blockipam/kv";
/// The sled tree holding the revision counter and the format marker.
pub const META_TREE: &str = "blockipam/meta";
/// The key of the format marker in [`META_TREE`].
pub const FORMAT_KEY: &str = "format";
/// The key of the store-wide revision counter (8 bytes, big-endian) in [`META_TREE`].
pub const REVISION_KEY: &str = "revision";

/// sled's log file inside the store directory.
const LOG_FILE: &str = "db";
/// The directory in which sled writes large items as files of their own, while it runs.
const BLOBS: &str = "blobs";
/// Longest pause between two attempts to take sled's own lock.
const MAX_PAUSE: Duration = Duration::from_millis(20);
/// Least time given to sled's own lock, whatever the configured lock wait: by then our
/// inter-process lock is held, so a taken engine lock is a handle that is still closing (the one
/// that just created the store, whose I/O threads let go a moment later, most often), not another
/// user of the store.
const ENGINE_CLOSE_GRACE: Duration = Duration::from_secs(2);

/// A [`KvStore`] kept in a sled database directory; see the [crate documentation](crate).
///
/// Cloning is cheap and shares the open database; the lock on the store is released when the last
/// clone (and the last operation still running on it) is gone.
#[derive(Clone)]
pub struct SledStore {
    inner: Arc<Inner>,
}

// Fields drop in declaration order: the sled handles first, the inter-process lock last.
struct Inner {
    data: sled::Tree,
    meta: sled::Tree,
    db: sled::Db,
    /// sled's log file, for the `fdatasync` that makes a flushed write durable (see `commit`).
    log_file: fs::File,
    /// Held exclusively by a commit from before its transaction until its write is durable, and
    /// shared by reads: sled shows a transaction's writes to readers as soon as it applies them,
    /// before the flush and the sync, and a read must not act on a write a crash can still undo.
    durable_writes: RwLock<()>,
    /// Test builds: called by a commit between applying its transaction and flushing it.
    #[cfg(test)]
    after_apply: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
    /// What was done to each file and directory under `blobs/` (made private, synced at which
    /// length), so that a commit only fixes and syncs what sled made or changed since (while
    /// open, sled creates files nowhere else). The lock is held for a whole walk, so a commit
    /// never returns while another one is still syncing a file it counts as done.
    blob_files: Mutex<Secured>,
    /// Test builds: every path a walk synced, with the length it had (directories: 0), in order.
    #[cfg(test)]
    synced_log: Mutex<Vec<(PathBuf, u64)>>,
    path: PathBuf,
    _lock: LockFile,
}

impl fmt::Debug for SledStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SledStore")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl SledStore {
    /// Opens the store at `config.path`. When the path is missing or an empty directory, the
    /// store is created if `config.create_if_missing` is set, and otherwise nothing is created.
    ///
    /// Waits up to `config.lock_wait` for another process or handle that holds the store.
    ///
    /// # Errors
    /// - [`KvError::Other`] naming the path and saying how a store is created, when there is no
    ///   store and `config.create_if_missing` is not set (nothing is created, not even the lock
    ///   file);
    /// - [`KvError::Unavailable`] naming the path when the store stayed held for the whole wait;
    /// - [`KvError::Corrupt`] when the path holds something other than a blockipam sled store
    ///   (a file, a foreign directory, a sled database without the format marker, damaged files);
    ///   a file or foreign directory is left untouched;
    /// - [`KvError::Other`] for I/O and permission errors.
    pub async fn open(config: SledConfig) -> Result<Self, KvError> {
        let path = config.path.clone();
        let inner = run_blocking(Stage::Open, &path, move || Inner::open(&config)).await?;
        Ok(SledStore {
            inner: Arc::new(inner),
        })
    }

    /// The store's directory.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }
}

#[async_trait]
impl KvStore for SledStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        validate_key(key)?;
        let inner = Arc::clone(&self.inner);
        let key = key.to_owned();
        run_blocking(Stage::Read, &self.inner.path, move || {
            inner.once_durable(|| inner.get(key))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        let inner = Arc::clone(&self.inner);
        let prefix = prefix.to_owned();
        run_blocking(Stage::Read, &self.inner.path, move || {
            inner.once_durable(|| inner.list(&prefix))
        })
        .await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        txn.validate()?;
        let inner = Arc::clone(&self.inner);
        run_blocking(Stage::Write, &self.inner.path, move || inner.commit(&txn)).await
    }

    /// Answers every read at one revision (no commit runs meanwhile).
    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        for read in reads {
            if let Read::Get(key) = read {
                validate_key(key)?;
            }
        }
        let inner = Arc::clone(&self.inner);
        let reads = reads.to_vec();
        run_blocking(Stage::Read, &self.inner.path, move || {
            inner.once_durable(|| inner.read_many(&reads))
        })
        .await
    }
}

/// Runs `work` on tokio's blocking pool, turning a panic inside sled into a [`KvError`].
async fn run_blocking<T, F>(stage: Stage, path: &Path, work: F) -> Result<T, KvError>
where
    F: FnOnce() -> Result<T, KvError> + Send + 'static,
    T: Send + 'static,
{
    ipam_core::blocking::run_blocking("sled", stage, path, work).await
}

/// What is at the store path before sled is asked to open it.
enum Found {
    /// Nothing (or an empty directory, described by the text): a new store may be created.
    Nothing(&'static str),
    /// A directory holding sled's `db` and `conf` files.
    SledDirectory,
}

impl Inner {
    fn open(config: &SledConfig) -> Result<Inner, KvError> {
        let path = &config.path;
        let started = Instant::now();
        // Checked before the lock is taken, so that refusing a missing store creates nothing
        // (not even the lock file or its directory).
        if !config.create_if_missing {
            if let Found::Nothing(what) = inspect(path)? {
                return Err(missing_store(path, what));
            }
        }
        let lock_path = sibling(path, "lock")?;
        let lock = LockFile::acquire(&lock_path, config.lock_wait)
            .map_err(|err| store_lock_error(err, path))?;
        if let Found::Nothing(what) = inspect(path)? {
            if !config.create_if_missing {
                return Err(missing_store(path, what));
            }
            create(path, started, config.lock_wait)?;
        }
        remove_unfinished_snapshots(path)?;
        let db = open_engine(path, started, config.lock_wait)?;
        let (data, meta) = check_format(&db, path)?;
        let log_file = fs::File::open(path.join(LOG_FILE))
            .map_err(|e| io_error("cannot open sled's log file in", path, &e))?;
        // Everything already in the store is made private and durable once per open: a process
        // that died before syncing may have left a blob that the log (synced by the next
        // commit) points at.
        let mut synced = Vec::new();
        let mut blob_files = Secured::default();
        let sync_failed = |err: io::Error| io_error("cannot sync the files in", path, &err);
        let in_blobs =
            secure(&path.join(BLOBS), &mut blob_files, &mut synced).map_err(sync_failed)?;
        // The walk of the whole store skips what the walk of blobs/ just did.
        let mut store_files = blob_files.clone();
        let in_store = secure(path, &mut store_files, &mut synced).map_err(sync_failed)?;
        if let Some(err) = in_blobs.or(in_store) {
            return Err(io_error("cannot make the files private in", path, &err));
        }
        Ok(Inner {
            data,
            meta,
            db,
            log_file,
            durable_writes: RwLock::new(()),
            #[cfg(test)]
            after_apply: Mutex::new(None),
            blob_files: Mutex::new(blob_files),
            #[cfg(test)]
            synced_log: Mutex::new(synced),
            path: path.clone(),
            _lock: lock,
        })
    }

    /// Runs `read` once no commit is between applying its writes and making them durable, and
    /// with none starting until it ends: sled's iterators are not snapshots, so this is also what
    /// makes a listing, or a batch of reads, answer the store at one revision (the store's lock
    /// file keeps every other process out).
    fn once_durable<T>(&self, read: impl FnOnce() -> T) -> T {
        let _no_commit_in_flight = self
            .durable_writes
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        read()
    }

    fn get(&self, key: String) -> Result<Option<KeyValue>, KvError> {
        let Some(record) = self
            .data
            .get(key.as_bytes())
            .map_err(|e| engine_error(e, &self.path))?
        else {
            return Ok(None);
        };
        let (revision, value) = decode_record(&key, &record)?;
        let value = value.to_vec();
        Ok(Some(KeyValue {
            key,
            value,
            revision,
        }))
    }

    fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.scan(prefix)
    }

    fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        for read in reads {
            read.validate()?;
        }
        reads
            .iter()
            .map(|read| match read {
                Read::Get(key) => self.get(key.clone()).map(ReadResult::Got),
                Read::List(prefix) => self.scan(prefix).map(ReadResult::Listed),
                Read::Range {
                    prefix,
                    from,
                    limit,
                } => self
                    .scan_window(prefix, from, *limit)
                    .map(ReadResult::Listed),
            })
            .collect()
    }

    fn scan(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.scan_window(prefix, prefix, u32::MAX)
    }

    /// At most `limit` keys starting with `prefix`, from `from` on (a [`Read::Range`]).
    fn scan_window(&self, prefix: &str, from: &str, limit: u32) -> Result<Vec<KeyValue>, KvError> {
        let mut listed = Vec::new();
        let start = Read::range_start(prefix, from).as_bytes().to_vec();
        for item in self.data.range(start..) {
            if listed.len() >= limit as usize {
                break;
            }
            let (raw_key, record) = item.map_err(|e| engine_error(e, &self.path))?;
            let key = String::from_utf8(raw_key.to_vec()).map_err(|_| {
                KvError::corrupt(
                    Some(&String::from_utf8_lossy(&raw_key)),
                    "stored key is not UTF-8",
                )
            })?;
            if !key.starts_with(prefix) {
                break;
            }
            let (revision, value) = decode_record(&key, &record)?;
            let value = value.to_vec();
            listed.push(KeyValue {
                key,
                value,
                revision,
            });
        }
        Ok(listed)
    }

    fn commit(&self, txn: &Txn) -> Result<Revision, KvError> {
        let path = &self.path;
        // Until this commit's write is durable (or has failed), no read runs.
        let _writing = self
            .durable_writes
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // sled's transactions cannot scan: each tested prefix's newest revision is read here,
        // where no other write of this process can run (the lock above; the store's lock file
        // keeps other processes out).
        let mut newest_under: HashMap<&str, Option<Revision>> = HashMap::new();
        for prefix in txn.tested_prefixes() {
            let newest = self.scan(prefix)?.iter().map(|kv| kv.revision).max();
            newest_under.insert(prefix, newest);
        }
        let outcome = (&self.data, &self.meta).transaction(|(data, meta)| {
            let mut engine_failure = None;
            let failed = txn.first_failed_condition(
                |key| match data.get(key.as_bytes()) {
                    Ok(None) => Ok(None),
                    Ok(Some(record)) => decode_record(key, &record).map(|(rev, _)| Some(rev)),
                    Err(err) => {
                        engine_failure = Some(err);
                        Err(KvError::other("sled read failed"))
                    }
                },
                |prefix| Ok(newest_under.get(prefix).copied().flatten()),
            );
            if let Some(err) = engine_failure {
                return Err(staged(err, path));
            }
            if let Some(condition) = failed.map_err(ConflictableTransactionError::Abort)? {
                return Err(ConflictableTransactionError::Abort(KvError::Conflict {
                    key: condition.key().to_owned(),
                }));
            }
            let stored = meta.get(REVISION_KEY).map_err(|e| staged(e, path))?;
            let current = decode_counter(REVISION_KEY, stored.as_deref())
                .map_err(ConflictableTransactionError::Abort)?;
            let next = current.checked_add(1).ok_or_else(|| {
                ConflictableTransactionError::Abort(KvError::other(
                    "the revision counter is exhausted",
                ))
            })?;
            meta.insert(REVISION_KEY, &next.to_be_bytes())
                .map_err(|e| staged(e, path))?;
            for op in &txn.ops {
                match op {
                    Op::Put { key, value } => {
                        data.insert(key.as_bytes(), encode_record(next, value))
                            .map_err(|e| staged(e, path))?;
                    }
                    Op::Delete { key } => {
                        data.remove(key.as_bytes()).map_err(|e| staged(e, path))?;
                    }
                }
            }
            Ok(Revision(next))
        });
        let revision = match outcome {
            Ok(revision) => revision,
            Err(TransactionError::Abort(err)) => return Err(err),
            // Only sled's own commit step gets here: it may have applied part of the writes.
            Err(TransactionError::Storage(err)) => {
                return Err(KvError::Indeterminate {
                    message: format!(
                        "sled failed while committing to {}: {}",
                        path.display(),
                        engine_error(err, path)
                    ),
                })
            }
        };
        #[cfg(test)]
        if let Some(hook) = self
            .after_apply
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
        {
            hook();
        }
        self.db.flush().map_err(|err| KvError::Indeterminate {
            message: format!(
                "the write to {} was applied but flushing it to disk failed: {}",
                path.display(),
                engine_error(err, path)
            ),
        })?;
        // sled's flush ends in sync_file_range on Linux, which neither commits the file's
        // metadata (the log grows into new blocks) nor flushes the drive's cache: only a process
        // crash is covered. fdatasync covers a power loss too.
        self.log_file
            .sync_data()
            .map_err(|err| KvError::Indeterminate {
                message: format!(
                    "the write to {} was applied but syncing it to disk failed: {err}",
                    path.display()
                ),
            })?;
        // sled writes a page over about a quarter of a segment to a file of its own under
        // `blobs/` (the log only points at it) and never syncs it nor the directory: sync every
        // blob file made or grown since the last walk, and each directory that gained an entry.
        let mut blob_files = self
            .blob_files
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut synced = Vec::new();
        let walked = secure(&path.join(BLOBS), &mut blob_files, &mut synced);
        #[cfg(test)]
        self.synced_log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(synced);
        // A file that cannot be made private now is tried again by the next walk (and open).
        walked.map_err(|err| KvError::Indeterminate {
            message: format!(
                "the write to {} was applied but syncing sled's blob files failed: {err}",
                path.display()
            ),
        })?;
        Ok(revision)
    }
}

/// Inside the transaction closure: keeps sled's conflict (which makes it retry the closure) and
/// turns a storage error, met before anything was applied, into an abort with nothing written.
fn staged(err: UnabortableTransactionError, path: &Path) -> ConflictableTransactionError<KvError> {
    match err {
        UnabortableTransactionError::Conflict => ConflictableTransactionError::Conflict,
        UnabortableTransactionError::Storage(err) => {
            ConflictableTransactionError::Abort(engine_error(err, path))
        }
    }
}

/// The error for a store that is not there, when `open` may not create it: the path, how a store
/// comes into being, and why it is not simply re-created.
fn missing_store(path: &Path, what: &str) -> KvError {
    KvError::other(format!(
        "no sled store at {}{what}: a store is created only by `blockipamctl pool add` (or \
         `blockipamctl migrate` into it, or `blockipamctl demo`) or by a plugin call whose netconf \
         lists `ipam.pools`; if this node had a store there, it was deleted or its volume is not \
         mounted, and an empty new one would hand out addresses that are still in use",
        path.display()
    ))
}

fn io_error(what: &str, path: &Path, err: &io::Error) -> KvError {
    KvError::other(format!("{what} {}: {err}", path.display()))
}

fn inspect(path: &Path) -> Result<Found, KvError> {
    let metadata = match fs::metadata(path) {
        Ok(metadata) => metadata,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Found::Nothing("")),
        Err(err) => return Err(io_error("cannot inspect the store path", path, &err)),
    };
    if !metadata.is_dir() {
        return Err(KvError::corrupt(
            None,
            format!(
                "{} is not a directory, so not a blockipam sled store; it was left untouched",
                path.display()
            ),
        ));
    }
    let mut entries =
        fs::read_dir(path).map_err(|e| io_error("cannot read the store directory", path, &e))?;
    if entries.next().is_none() {
        return Ok(Found::Nothing(
            " (an empty directory: perhaps the mount point of a volume that is not mounted)",
        ));
    }
    if path.join(LOG_FILE).is_file() && path.join("conf").is_file() {
        Ok(Found::SledDirectory)
    } else {
        Err(KvError::corrupt(
            None,
            format!(
                "{} is a directory that holds no sled database; it was left untouched",
                path.display()
            ),
        ))
    }
}

/// Builds a new store in `<path>.creating` and renames it into place, so that a crash can leave
/// a stray staging directory (removed by the next creation) but never a half-made store.
fn create(path: &Path, started: Instant, wait: Duration) -> Result<(), KvError> {
    let staging = sibling(path, "creating")?;
    match fs::remove_dir_all(&staging) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => {
            return Err(io_error(
                "cannot remove a stale staging directory",
                &staging,
                &err,
            ))
        }
    }
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&staging)
        .map_err(|e| io_error("cannot create", &staging, &e))?;
    {
        let db = open_engine(&staging, started, wait)?;
        let fail = |err| engine_error(err, &staging);
        let meta = db.open_tree(META_TREE).map_err(fail)?;
        db.open_tree(DATA_TREE).map_err(fail)?;
        meta.insert(REVISION_KEY, &0u64.to_be_bytes())
            .map_err(fail)?;
        meta.insert(FORMAT_KEY, FORMAT).map_err(fail)?;
        db.flush().map_err(fail)?;
    }
    // sled syncs neither its configuration file nor (fully) its log: sync every file, and the
    // directories holding them, before the store becomes visible under its name.
    match secure(&staging, &mut Secured::default(), &mut Vec::new()) {
        Ok(None) => {}
        Ok(Some(err)) => return Err(io_error("cannot make the files private in", &staging, &err)),
        Err(err) => return Err(io_error("cannot sync the files in", &staging, &err)),
    }
    fs::rename(&staging, path).map_err(|e| io_error("cannot move the new store to", path, &e))?;
    durable::sync_directory_of(path)
        .map_err(|e| io_error("cannot sync the directory", durable::directory_of(path), &e))
}

/// Removes the snapshot files sled was still writing when its process died (`snap.*.generating`).
///
/// sled writes a snapshot as it opens, under that name, then renames it; but it also reads such a
/// file as a snapshot when its name sorts last, and refuses the whole store when it is cut short
/// (`Corruption { at: None }`): one process killed while opening would make the store unusable.
/// Only called with the store's lock file held, so no live process of ours is writing one: each is
/// left by a process that died before its rename, so before it wrote anything else, and sled
/// rebuilds the same state from the previous snapshot and the log.
fn remove_unfinished_snapshots(path: &Path) -> Result<(), KvError> {
    let entries = match fs::read_dir(path) {
        Ok(entries) => entries,
        Err(err) => return Err(io_error("cannot list", path, &err)),
    };
    let mut removed = false;
    for entry in entries {
        let entry = entry.map_err(|e| io_error("cannot list", path, &e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("snap.") && name.ends_with(".generating") {
            let file = entry.path();
            fs::remove_file(&file)
                .map_err(|e| io_error("cannot remove an unfinished snapshot", &file, &e))?;
            removed = true;
        }
    }
    if removed {
        fs::File::open(path)
            .and_then(|dir| dir.sync_all())
            .map_err(|e| io_error("cannot sync the directory", path, &e))?;
    }
    Ok(())
}

/// Opens sled at `path`, retrying while sled's own lock is still held (a previous handle, in this
/// or another process, may still be closing) until `wait` has passed since `started`.
fn open_engine(path: &Path, started: Instant, wait: Duration) -> Result<sled::Db, KvError> {
    let wait = wait.max(ENGINE_CLOSE_GRACE);
    let mut pause = Duration::from_millis(1);
    loop {
        // No periodic flusher thread: every commit flushes before it is acknowledged.
        match sled::Config::new().path(path).flush_every_ms(None).open() {
            Ok(db) => return Ok(db),
            Err(err) if is_engine_lock_busy(&err) => {
                let waited = started.elapsed();
                if waited >= wait {
                    return Err(KvError::unavailable(format!(
                        "the store {} is held by another process or handle: sled's lock still \
                         taken after {waited:?}",
                        path.display()
                    )));
                }
                std::thread::sleep(pause.min(wait - waited));
                pause = (pause * 2).min(MAX_PAUSE);
            }
            Err(err) => return Err(engine_error(err, path)),
        }
    }
}

/// Checks the format marker without creating anything, and returns the data and meta trees.
fn check_format(db: &sled::Db, path: &Path) -> Result<(sled::Tree, sled::Tree), KvError> {
    let names = db.tree_names();
    let has = |name: &str| names.iter().any(|n| n.as_ref() == name.as_bytes());
    let not_ours = || {
        KvError::corrupt(
            None,
            format!(
                "{} is a sled database but not a blockipam store (no format marker)",
                path.display()
            ),
        )
    };
    if !has(META_TREE) {
        return Err(not_ours());
    }
    let fail = |err| engine_error(err, path);
    let meta = db.open_tree(META_TREE).map_err(fail)?;
    match meta.get(FORMAT_KEY).map_err(fail)? {
        Some(found) if found.as_ref() == FORMAT.as_bytes() => {}
        Some(found) => {
            return Err(KvError::corrupt(
                Some(FORMAT_KEY),
                format!(
                    "{} has format {:?}; this build reads {FORMAT:?}",
                    path.display(),
                    String::from_utf8_lossy(&found)
                ),
            ))
        }
        None => return Err(not_ours()),
    }
    if !has(DATA_TREE) {
        return Err(KvError::corrupt(
            None,
            format!(
                "{} is a blockipam store without its data tree: it is damaged (restore it from a \
                 backup)",
                path.display()
            ),
        ));
    }
    decode_counter(
        REVISION_KEY,
        meta.get(REVISION_KEY).map_err(fail)?.as_deref(),
    )?;
    let data = db.open_tree(DATA_TREE).map_err(fail)?;
    Ok((data, meta))
}

/// What [`secure`] knows of each file and directory it saw under the tree it walked.
#[derive(Debug, Clone, Default)]
struct Secured {
    entries: HashMap<PathBuf, EntryState>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct EntryState {
    /// Group and other permissions are removed.
    private: bool,
    /// Synced, at this length (directories: 0); `None` when not synced yet.
    synced_len: Option<u64>,
}

/// Makes `dir` (0700) and everything below it private (files 0600, directories 0700) and
/// durable: a file is synced (`fsync`) when it is new or its length changed since it was
/// last synced, a directory when it is new or gained an entry. Work recorded in `secured` is not
/// repeated; `secured` is left describing exactly what was seen, and every path synced is pushed
/// onto `synced`. A missing `dir` is fine, and so is an entry sled deletes meanwhile.
///
/// A failure to sync is returned at once as `Err` (`secured` is then unchanged, so the next walk
/// does the work again); the first failure to change permissions is returned as `Ok(Some(_))`
/// after the walk, which still syncs everything, and is retried by the next walk.
fn secure(
    dir: &Path,
    secured: &mut Secured,
    synced: &mut Vec<(PathBuf, u64)>,
) -> io::Result<Option<io::Error>> {
    let mut walk = Walk {
        before: &secured.entries,
        seen: HashMap::with_capacity(secured.entries.len()),
        synced,
        permission_error: None,
    };
    walk.directory(dir)?;
    let Walk {
        seen,
        permission_error,
        ..
    } = walk;
    secured.entries = seen;
    Ok(permission_error)
}

struct Walk<'a> {
    before: &'a HashMap<PathBuf, EntryState>,
    seen: HashMap<PathBuf, EntryState>,
    synced: &'a mut Vec<(PathBuf, u64)>,
    permission_error: Option<io::Error>,
}

impl Walk<'_> {
    fn directory(&mut self, dir: &Path) -> io::Result<()> {
        let before = self.before.get(dir).copied().unwrap_or_default();
        let private = before.private || self.restrict(dir, 0o700);
        let entries = match fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(err) => return Err(err),
        };
        let mut gained_entry = false;
        for entry in entries {
            let entry = entry?;
            let path = entry.path();
            gained_entry |= !self.before.contains_key(&path);
            match entry.file_type() {
                Ok(kind) if kind.is_dir() => self.directory(&path)?,
                Ok(kind) if kind.is_file() => self.file(path)?,
                Ok(_) => {}
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => return Err(err),
            }
        }
        let mut synced_len = before.synced_len;
        if synced_len.is_none() || gained_entry {
            match fs::File::open(dir).and_then(|handle| handle.sync_all()) {
                Ok(()) => {
                    self.synced.push((dir.to_owned(), 0));
                    synced_len = Some(0);
                }
                Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(err) => return Err(err),
            }
        }
        self.seen.insert(
            dir.to_owned(),
            EntryState {
                private,
                synced_len,
            },
        );
        Ok(())
    }

    fn file(&mut self, path: PathBuf) -> io::Result<()> {
        let before = self.before.get(&path).copied().unwrap_or_default();
        let private = before.private || self.restrict(&path, 0o600);
        let mut synced_len = before.synced_len;
        // The length is read before the sync, so the sync covers at least that much: a file
        // still being written is synced again once a later walk finds it longer.
        let len = match fs::metadata(&path) {
            Ok(metadata) => metadata.len(),
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(err) => return Err(err),
        };
        if synced_len != Some(len) {
            match fs::File::open(&path).and_then(|handle| handle.sync_all()) {
                Ok(()) => {}
                Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(err) => return Err(err),
            }
            self.synced.push((path.clone(), len));
            synced_len = Some(len);
        }
        self.seen.insert(
            path,
            EntryState {
                private,
                synced_len,
            },
        );
        Ok(())
    }

    /// Restricts `path`; a failure is kept for the end of the walk and reported as `false`.
    fn restrict(&mut self, path: &Path, mode: u32) -> bool {
        match restrict(path, mode) {
            Ok(()) => true,
            Err(err) => {
                self.permission_error.get_or_insert(err);
                false
            }
        }
    }
}

/// Removes group and other permissions from `path` (sled may delete a file meanwhile: fine).
fn restrict(path: &Path, mode: u32) -> io::Result<()> {
    let current = match fs::metadata(path) {
        Ok(metadata) => metadata.permissions().mode(),
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(err),
    };
    if current & 0o077 == 0 {
        return Ok(());
    }
    match fs::set_permissions(path, fs::Permissions::from_mode(mode)) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value large enough that sled writes it to a file of its own under `blobs/` (more than a
    /// quarter of its 512 KiB segment), like a well-used block of a big pool.
    const BLOB_SIZED: usize = 200 * 1024;

    /// The paths synced since the last call, with the length each had when synced.
    fn take_synced(store: &SledStore) -> Vec<(PathBuf, u64)> {
        std::mem::take(
            &mut *store
                .inner
                .synced_log
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Every regular file under `dir`, with its length.
    fn files_with_lengths(dir: &Path) -> Vec<(PathBuf, u64)> {
        let mut found = Vec::new();
        for entry in fs::read_dir(dir).expect("read the blobs directory") {
            let entry = entry.expect("directory entry");
            let metadata = entry.metadata().expect("stat a blob file");
            if metadata.is_file() {
                found.push((entry.path(), metadata.len()));
            }
        }
        found.sort();
        found
    }

    /// Everything observed to be synced so far: each path with the length of its last sync.
    #[derive(Default)]
    struct Durable(HashMap<PathBuf, u64>);

    impl Durable {
        /// Records the syncs `store` made since the last call; returns them.
        fn record(&mut self, store: &SledStore) -> Vec<(PathBuf, u64)> {
            let synced = take_synced(store);
            self.0.extend(synced.iter().cloned());
            synced
        }

        /// Asserts that every file now under `blobs` was synced at its present length.
        fn assert_covers(&self, blobs: &Path, after: &str) {
            for (file, len) in files_with_lengths(blobs) {
                assert_eq!(
                    self.0.get(&file),
                    Some(&len),
                    "after {after}, the blob file {} ({len} bytes) was not synced at that length",
                    file.display()
                );
            }
        }
    }

    /// Commits a blob-sized `value` under `key` and checks that the commit made a blob file, and
    /// synced it and the `blobs/` directory before returning.
    async fn commit_blob(store: &SledStore, durable: &mut Durable, key: &str, value: Vec<u8>) {
        let blobs = store.path().join(BLOBS);
        let before = files_with_lengths(&blobs);
        durable.record(store);
        store
            .commit(Txn::new().then(Op::put(key, value)))
            .await
            .expect("commit a blob-sized value");
        let synced = durable.record(store);
        let after = files_with_lengths(&blobs);
        assert!(
            after.iter().any(|file| !before.contains(file)),
            "writing {key} created no file under {}: the test no longer makes sled write a blob",
            blobs.display()
        );
        durable.assert_covers(&blobs, &format!("the commit of {key}"));
        assert!(
            synced.contains(&(blobs.clone(), 0)),
            "the commit of {key} returned without syncing {}, which gained a file; synced: \
             {synced:?}",
            blobs.display()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_does_not_see_a_commit_before_it_is_durable() {
        use std::sync::mpsc;
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SledStore::open(SledConfig::new(dir.path().join("store")).creating())
            .await
            .expect("create a sled store");
        // The commit stops between applying its transaction and flushing it, until told to go.
        let (reached, reached_here) = mpsc::channel::<()>();
        let (go, wait_for_go) = mpsc::channel::<()>();
        let wait_for_go = Mutex::new(wait_for_go);
        *store
            .inner
            .after_apply
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Box::new(move || {
            let _ = reached.send(());
            let _ = wait_for_go
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .recv_timeout(Duration::from_secs(30));
        }));
        let committing = tokio::spawn({
            let store = store.clone();
            async move { store.put("k", b"v".to_vec()).await }
        });
        reached_here
            .recv_timeout(Duration::from_secs(30))
            .expect("the commit applied its transaction");
        // Reads while the write is applied but not durable.
        let mut reading = tokio::spawn({
            let store = store.clone();
            async move {
                let got = store.get("k").await;
                let listed = store.list("").await;
                let batch = store.read_many(&[Read::Get("k".into())]).await;
                (got, listed, batch)
            }
        });
        // Long enough for unblocked reads to be answered (a bounded wait, nothing asserted on it).
        if let Ok(answered) = tokio::time::timeout(Duration::from_millis(300), &mut reading).await {
            let (got, listed, batch) = answered.expect("reading task");
            assert_eq!(got, Ok(None), "a get saw a write that was not durable yet");
            assert_eq!(
                listed,
                Ok(vec![]),
                "a list saw a write that was not durable yet"
            );
            assert_eq!(
                batch,
                Ok(vec![ReadResult::Got(None)]),
                "a batch saw a write that was not durable yet"
            );
        }
        go.send(()).expect("release the commit");
        committing
            .await
            .expect("commit task")
            .expect("the commit succeeds");
        // Once durable, the write is seen.
        let (got, _, _) = reading.await.expect("reading task");
        let seen = store.get("k").await.expect("get after");
        assert_eq!(seen.map(|kv| kv.value), Some(b"v".to_vec()));
        assert!(got.is_ok(), "{got:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_blob_file_and_the_blobs_directory_are_synced_before_a_commit_returns() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("store");
        let blobs = path.join(BLOBS);
        let store = SledStore::open(SledConfig::new(&path).creating())
            .await
            .expect("create a sled store");
        let mut durable = Durable::default();
        commit_blob(&store, &mut durable, "blocks/a", vec![0xa5; BLOB_SIZED]).await;
        commit_blob(&store, &mut durable, "blocks/b", vec![0x5a; BLOB_SIZED]).await;
        // A new value for a key goes to a new blob file.
        commit_blob(&store, &mut durable, "blocks/a", vec![0x3c; BLOB_SIZED + 1]).await;
        // Small writes beside the large ones (sled may rewrite a whole leaf into a new blob).
        for i in 0..20 {
            store
                .put(&format!("blocks/c{i:02}"), vec![7; 100])
                .await
                .expect("put a small value");
            durable.record(&store);
            durable.assert_covers(&blobs, &format!("small write {i}"));
        }
        drop(store);

        // A reopened store syncs what it finds: a process that died before its sync may have left
        // blob files that the log, synced by the next commit, points at.
        let store = SledStore::open(SledConfig::new(&path))
            .await
            .expect("reopen");
        let synced = take_synced(&store);
        for file in files_with_lengths(&blobs) {
            assert!(
                synced.contains(&file),
                "open did not sync the blob file {:?}; synced: {synced:?}",
                file
            );
        }
        assert!(synced.contains(&(blobs, 0)), "open did not sync blobs/");
        assert!(
            synced.contains(&(path, 0)),
            "open did not sync the store directory"
        );
    }
}
