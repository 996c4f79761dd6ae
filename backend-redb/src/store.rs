//! `RedbStore`: conditions, the revision counter and the records of a commit in one redb write transaction.

use std::fmt;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ipam_core::kv::durable;
use ipam_core::kv::records::{decode_counter, decode_record};
use ipam_core::kv::{
    validate_key, KeyValue, KvError, KvStore, Op, Read, ReadResult, Revision, Txn,
};
use ipam_core::lockfile::{sibling, store_lock_error, LockFile};
use redb::backends::FileBackend;
use redb::{
    Database, DatabaseError, Durability, ReadTransaction, ReadableDatabase, ReadableTable,
    TableDefinition, TableHandle, WriteTransaction,
};

use crate::config::RedbConfig;
use crate::error::EngineResult;
use ipam_core::blocking::Stage;

/// The value of [`FORMAT_KEY`] in every store this crate writes.
pub const FORMAT: &str = "blockipam-kv-v1";
/// The redb table holding the records, one per key.
pub const DATA_TABLE: TableDefinition<'static, &str, &[u8]> = TableDefinition::new("blockipam/kv");
/// The redb table holding the revision counter and the format marker.
pub const META_TABLE: TableDefinition<'static, &str, &[u8]> =
    TableDefinition::new("blockipam/meta");
/// The key of the format marker in [`META_TABLE`].
pub const FORMAT_KEY: &str = "format";
/// The key of the store-wide revision counter (8 bytes, big-endian) in [`META_TABLE`].
pub const REVISION_KEY: &str = "revision";

/// Longest pause between two attempts to take redb's own lock.
const MAX_PAUSE: Duration = Duration::from_millis(20);
/// Least time given to redb's own lock, whatever the configured lock wait: by then our
/// inter-process lock is held, so a taken engine lock is a handle that is still closing, not
/// another user of the store.
const ENGINE_CLOSE_GRACE: Duration = Duration::from_secs(2);

/// A [`KvStore`] kept in one redb file; see the [crate documentation](crate).
///
/// Cloning is cheap and shares the open database; the lock on the store is released when the last
/// clone (and the last operation still running on it) is gone.
#[derive(Clone)]
pub struct RedbStore {
    inner: Arc<Inner>,
}

// Fields drop in declaration order: the database first, the inter-process lock last.
struct Inner {
    db: Database,
    path: PathBuf,
    _lock: LockFile,
}

impl fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedbStore")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl RedbStore {
    /// Opens the store at `config.path`. When the file is missing or empty, the store is created
    /// (mode 0600) if `config.create_if_missing` is set, and otherwise nothing is created.
    ///
    /// Waits up to `config.lock_wait` for another process or handle that holds the store.
    ///
    /// # Errors
    /// - [`KvError::Other`] naming the path and saying how a store is created, when there is no
    ///   store and `config.create_if_missing` is not set (nothing is created, not even the lock
    ///   file);
    /// - [`KvError::Unavailable`] naming the path when the store stayed held for the whole wait;
    /// - [`KvError::Corrupt`] when the file is not a redb database (it is left untouched), is
    ///   damaged, or is a redb database without the blockipam format marker;
    /// - [`KvError::Other`] for I/O and permission errors.
    pub async fn open(config: RedbConfig) -> Result<Self, KvError> {
        let path = config.path.clone();
        let inner = run_blocking(Stage::Open, &path, move || Inner::open(&config)).await?;
        Ok(RedbStore {
            inner: Arc::new(inner),
        })
    }

    /// The store's file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }
}

#[async_trait]
impl KvStore for RedbStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        validate_key(key)?;
        let inner = Arc::clone(&self.inner);
        let key = key.to_owned();
        run_blocking(Stage::Read, &self.inner.path, move || {
            let snapshot = inner.begin_read()?;
            inner.get(&snapshot, key)
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        let inner = Arc::clone(&self.inner);
        let prefix = prefix.to_owned();
        run_blocking(Stage::Read, &self.inner.path, move || {
            let snapshot = inner.begin_read()?;
            inner.list(&snapshot, &prefix)
        })
        .await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        txn.validate()?;
        let inner = Arc::clone(&self.inner);
        run_blocking(Stage::Write, &self.inner.path, move || inner.commit(&txn)).await
    }

    /// Answers every read from one redb read transaction, so from one snapshot.
    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        for read in reads {
            read.validate()?;
        }
        let inner = Arc::clone(&self.inner);
        let reads = reads.to_vec();
        run_blocking(Stage::Read, &self.inner.path, move || {
            let snapshot = inner.begin_read()?;
            reads
                .into_iter()
                .map(|read| match read {
                    Read::Get(key) => inner.get(&snapshot, key).map(ReadResult::Got),
                    Read::List(prefix) => inner.list(&snapshot, &prefix).map(ReadResult::Listed),
                    Read::Range {
                        prefix,
                        from,
                        limit,
                    } => inner
                        .window(&snapshot, &prefix, &from, limit)
                        .map(ReadResult::Listed),
                })
                .collect()
        })
        .await
    }
}

/// Runs `work` on tokio's blocking pool, turning a panic inside redb into a [`KvError`].
async fn run_blocking<T, F>(stage: Stage, path: &Path, work: F) -> Result<T, KvError>
where
    F: FnOnce() -> Result<T, KvError> + Send + 'static,
    T: Send + 'static,
{
    ipam_core::blocking::run_blocking("redb", stage, path, work).await
}

impl Inner {
    fn open(config: &RedbConfig) -> Result<Inner, KvError> {
        let path = &config.path;
        let started = Instant::now();
        // Checked before the lock is taken, so that refusing a missing store creates nothing
        // (not even the lock file or its directory); checked again under the lock.
        if !config.create_if_missing {
            refuse_if_missing(path)?;
        }
        let lock_path = sibling(path, "lock")?;
        let lock = LockFile::acquire(&lock_path, config.lock_wait)
            .map_err(|err| store_lock_error(err, path))?;
        match refuse_if_missing(path) {
            Ok(()) => {}
            Err(missing) if !config.create_if_missing || missing_is_damage(&missing) => {
                return Err(missing)
            }
            Err(_) => create_staged(path, started, config.lock_wait)?,
        }
        let db = open_engine(path, false, started, config.lock_wait)?;
        check_format(&db, path)?;
        restrict(path)?;
        Ok(Inner {
            db,
            path: path.clone(),
            _lock: lock,
        })
    }

    fn begin_read(&self) -> Result<ReadTransaction, KvError> {
        self.db.begin_read().engine(&self.path)
    }

    fn get(&self, snapshot: &ReadTransaction, key: String) -> Result<Option<KeyValue>, KvError> {
        let path = &self.path;
        let table = snapshot.open_table(DATA_TABLE).engine(path)?;
        let Some(record) = table.get(key.as_str()).engine(path)? else {
            return Ok(None);
        };
        let (revision, value) = decode_record(&key, record.value())?;
        let value = value.to_vec();
        Ok(Some(KeyValue {
            key,
            value,
            revision,
        }))
    }

    fn list(&self, snapshot: &ReadTransaction, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.window(snapshot, prefix, prefix, u32::MAX)
    }

    /// At most `limit` keys starting with `prefix`, from `from` on (a [`Read::Range`]).
    fn window(
        &self,
        snapshot: &ReadTransaction,
        prefix: &str,
        from: &str,
        limit: u32,
    ) -> Result<Vec<KeyValue>, KvError> {
        let path = &self.path;
        let table = snapshot.open_table(DATA_TABLE).engine(path)?;
        let mut listed = Vec::new();
        let start = Read::range_start(prefix, from);
        for item in table.range::<&str>(start..).engine(path)? {
            if listed.len() >= limit as usize {
                break;
            }
            let (key, record) = item.engine(path)?;
            let key = key.value();
            if !key.starts_with(prefix) {
                break;
            }
            let (revision, value) = decode_record(key, record.value())?;
            listed.push(KeyValue {
                key: key.to_owned(),
                value: value.to_vec(),
                revision,
            });
        }
        Ok(listed)
    }

    fn commit(&self, txn: &Txn) -> Result<Revision, KvError> {
        let path = &self.path;
        let write = begin_durable_write(&self.db, path)?;
        match self.apply(&write, txn) {
            Ok(revision) => {
                write.commit().map_err(|e| KvError::Indeterminate {
                    message: format!(
                        "committing to {} failed, the write may or may not have landed: {e}",
                        path.display()
                    ),
                })?;
                Ok(revision)
            }
            Err(err) => {
                // Nothing of the transaction is kept; an abort that fails changes nothing either.
                let _ = write.abort();
                Err(err)
            }
        }
    }

    /// Checks the conditions and stages the writes of `txn` in `write`, returning its revision.
    fn apply(&self, write: &WriteTransaction, txn: &Txn) -> Result<Revision, KvError> {
        let path = &self.path;
        let mut data = write.open_table(DATA_TABLE).engine(path)?;
        let mut meta = write.open_table(META_TABLE).engine(path)?;
        if let Some(condition) = txn.first_failed_condition(
            |key| match data.get(key).engine(path)? {
                None => Ok(None),
                Some(record) => decode_record(key, record.value()).map(|(rev, _)| Some(rev)),
            },
            |prefix| {
                let mut newest = None;
                for item in data.range::<&str>(prefix..).engine(path)? {
                    let (key, record) = item.engine(path)?;
                    if !key.value().starts_with(prefix) {
                        break;
                    }
                    let (revision, _) = decode_record(key.value(), record.value())?;
                    newest = newest.max(Some(revision));
                }
                Ok(newest)
            },
        )? {
            return Err(KvError::Conflict {
                key: condition.key().to_owned(),
            });
        }
        let stored = meta
            .get(REVISION_KEY)
            .engine(path)?
            .map(|g| g.value().to_vec());
        let current = decode_counter(REVISION_KEY, stored.as_deref())?;
        let next = current
            .checked_add(1)
            .ok_or_else(|| KvError::other("the revision counter is exhausted"))?;
        meta.insert(REVISION_KEY, next.to_be_bytes().as_slice())
            .engine(path)?;
        let mut record = Vec::new();
        for op in &txn.ops {
            match op {
                Op::Put { key, value } => {
                    record.clear();
                    record.extend_from_slice(&next.to_be_bytes());
                    record.extend_from_slice(value);
                    data.insert(key.as_str(), record.as_slice()).engine(path)?;
                }
                Op::Delete { key } => {
                    data.remove(key.as_str()).engine(path)?;
                }
            }
        }
        Ok(Revision(next))
    }
}

/// Syncs the directory holding `path`, so that a file just created there keeps its name.
fn sync_parent(path: &Path) -> Result<(), KvError> {
    durable::sync_directory_of(path).map_err(|err| {
        KvError::other(format!(
            "cannot sync the directory {} of the new store: {err}",
            durable::directory_of(path).display()
        ))
    })
}

/// Creates a new store: a database with the format marker built in `<path>.creating`, synced,
/// then renamed to `path` (and the directory synced), so that a file at `path` is always a whole
/// store and an empty or unmarked one there is damage, never a creation cut short.
fn create_staged(path: &Path, started: Instant, wait: Duration) -> Result<(), KvError> {
    let staging = sibling(path, "creating")?;
    match fs::remove_file(&staging) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => {
            return Err(KvError::other(format!(
                "cannot remove the unfinished store {}: {err}",
                staging.display()
            )))
        }
    }
    let db = open_engine(&staging, true, started, wait)?;
    write_format(&db, &staging)?;
    drop(db);
    fs::File::open(&staging)
        .and_then(|file| file.sync_all())
        .and_then(|()| fs::rename(&staging, path))
        .map_err(|err| {
            KvError::other(format!(
                "cannot put the new store {} in place: {err}",
                path.display()
            ))
        })?;
    // The new name must survive a power loss too: its absence would be a vanished store, which
    // no call without netconf pools may re-create.
    sync_parent(path)
}

/// True for [`refuse_if_missing`]'s answer to a damaged store (never to be created over).
fn missing_is_damage(error: &KvError) -> bool {
    matches!(error, KvError::Corrupt { .. })
}

/// Fails, naming the path and saying how a store is created, when there is no store file at
/// `path`; an empty file there is damage (stores are created whole, see [`create_staged`]) and
/// is reported as corrupt, left untouched, whatever the caller may create.
fn refuse_if_missing(path: &Path) -> Result<(), KvError> {
    let what = match fs::metadata(path) {
        Ok(metadata) if metadata.is_file() && metadata.len() == 0 => {
            return Err(KvError::corrupt(
                None,
                format!(
                    "the redb store {} is an empty file: it was truncated or is not a blockipam \
                     store; it was left untouched (restore it, or remove it and create the store \
                     again with `blockipamctl pool add`)",
                    path.display()
                ),
            ))
        }
        Ok(_) => return Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => "",
        Err(err) => {
            return Err(KvError::other(format!(
                "cannot inspect the store path {}: {err}",
                path.display()
            )))
        }
    };
    Err(KvError::other(format!(
        "no redb store at {}{what}: a store is created only by `blockipamctl pool add` (or \
         `blockipamctl migrate` into it, or `blockipamctl demo`) or by a plugin call whose netconf \
         lists `ipam.pools`; if this node had a store there, it was deleted or its volume is not \
         mounted, and an empty new one would hand out addresses that are still in use",
        path.display()
    )))
}

/// Opens (with `create`, creating with mode 0600 when missing) the redb file at `path`, retrying
/// while redb's own lock is still held (a previous handle may still be closing) until `wait` has
/// passed since `started`. A file that is not a redb database, or whose committed pages do not
/// match their checksums, is refused by redb before anything is written.
fn open_engine(
    path: &Path,
    create: bool,
    started: Instant,
    wait: Duration,
) -> Result<Database, KvError> {
    let wait = wait.max(ENGINE_CLOSE_GRACE);
    let mut pause = Duration::from_millis(1);
    loop {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(|err| match err.kind() {
                io::ErrorKind::NotFound if !create => {
                    refuse_if_missing(path).err().unwrap_or_else(|| {
                        KvError::other(format!("cannot open {}: {err}", path.display()))
                    })
                }
                io::ErrorKind::IsADirectory => KvError::corrupt(
                    None,
                    format!(
                        "{} is a directory, not a blockipam redb store; it was left untouched",
                        path.display()
                    ),
                ),
                _ => KvError::other(format!("cannot open {}: {err}", path.display())),
            })?;
        let backend = FileBackend::new(file).engine(path)?;
        // Every page of the committed trees verified against its checksum before anything is
        // read: a file damaged since it was written (a flipped bit in a key can hide a range of
        // keys from lookups that trust the tree's order) is refused as corrupt, not trusted.
        match Database::builder()
            .set_check_integrity_on_open(true)
            .create_with_backend(backend)
        {
            Ok(db) => return Ok(db),
            Err(DatabaseError::DatabaseAlreadyOpen) => {
                let waited = started.elapsed();
                if waited >= wait {
                    return Err(KvError::unavailable(format!(
                        "the store {} is held by another process or handle: redb's lock still \
                         taken after {waited:?}",
                        path.display()
                    )));
                }
                std::thread::sleep(pause.min(wait - waited));
                pause = (pause * 2).min(MAX_PAUSE);
            }
            Err(err) => return Err(err).engine(path),
        }
    }
}

/// Accepts a database carrying this software's format marker and refuses any other (one with no
/// table at all included: stores are created with their marker, see [`create_staged`]).
fn check_format(db: &Database, path: &Path) -> Result<(), KvError> {
    let snapshot = db.begin_read().engine(path)?;
    let tables: Vec<String> = snapshot
        .list_tables()
        .engine(path)?
        .map(|table| table.name().to_owned())
        .collect();
    let not_ours = || {
        KvError::corrupt(
            None,
            format!(
                "{} is a redb database but not a blockipam store (no format marker)",
                path.display()
            ),
        )
    };
    let has = |name: &str| tables.iter().any(|t| t == name);
    if !has(META_TABLE.name()) {
        return Err(not_ours());
    }
    let meta = snapshot.open_table(META_TABLE).engine(path)?;
    match meta.get(FORMAT_KEY).engine(path)? {
        Some(found) if found.value() == FORMAT.as_bytes() => {}
        Some(found) => {
            return Err(KvError::corrupt(
                Some(FORMAT_KEY),
                format!(
                    "{} has format {:?}; this build reads {FORMAT:?}",
                    path.display(),
                    String::from_utf8_lossy(found.value())
                ),
            ))
        }
        None => return Err(not_ours()),
    }
    if !has(DATA_TABLE.name()) {
        return Err(KvError::corrupt(
            None,
            format!(
                "{} is a blockipam store without its data table: it is damaged (restore it \
                 from a backup)",
                path.display()
            ),
        ));
    }
    let stored = meta
        .get(REVISION_KEY)
        .engine(path)?
        .map(|g| g.value().to_vec());
    decode_counter(REVISION_KEY, stored.as_deref())?;
    Ok(())
}

/// A write transaction whose commit is durable when it returns, and committed in two phases: the
/// pages first, then the header naming them. So a newest commit that does not verify on open can
/// only be damage, which is refused, never a torn commit that redb would roll back (dropping a
/// write this store reported as done).
fn begin_durable_write(db: &Database, path: &Path) -> Result<WriteTransaction, KvError> {
    let mut write = db.begin_write().engine(path)?;
    write.set_durability(Durability::Immediate).map_err(|e| {
        KvError::other(format!(
            "redb refused immediate durability on {}: {e}",
            path.display()
        ))
    })?;
    write.set_two_phase_commit(true);
    Ok(write)
}

fn write_format(db: &Database, path: &Path) -> Result<(), KvError> {
    let write = begin_durable_write(db, path)?;
    {
        let mut meta = write.open_table(META_TABLE).engine(path)?;
        meta.insert(FORMAT_KEY, FORMAT.as_bytes()).engine(path)?;
        meta.insert(REVISION_KEY, 0u64.to_be_bytes().as_slice())
            .engine(path)?;
        write.open_table(DATA_TABLE).engine(path)?;
    }
    write.commit().engine(path)
}

/// Removes group and other permissions from the store file (one created before this software
/// made it 0600, or copied in).
fn restrict(path: &Path) -> Result<(), KvError> {
    let io_fail =
        |err: io::Error| KvError::other(format!("cannot make {} private: {err}", path.display()));
    let mode = fs::metadata(path).map_err(io_fail)?.permissions().mode();
    if mode & 0o077 != 0 {
        fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(io_fail)?;
    }
    Ok(())
}
