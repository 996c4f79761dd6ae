//! An example store adapter written outside blockipam's own backends: the whole store in one JSON
//! file, rewritten by every commit (written beside, synced, renamed over, directory synced), so a
//! commit is durable before it is answered and a crash leaves the old file or the new one, never
//! half of either. Reads are answered from a copy kept in memory. Values are stored as hex strings
//! (a JSON array of numbers, serde's default for bytes, is about twice as long and slower to
//! write). `tests/conformance.rs` runs the whole conformance suite on it: that suite is the
//! contract a store adapter must meet.
//!
//! It is an example, not a store to deploy: every commit rewrites the whole file, and one process
//! at a time may open it (nothing here locks the file against another process).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use ipam_core::blocking::{run_blocking, Stage};
use ipam_core::kv::durable;
use ipam_core::kv::{
    range_of_listing, validate_key, KeyValue, KvError, KvStore, Op, Read, ReadResult, Revision, Txn,
};
use serde::{Deserialize, Serialize};

/// What the file holds: the store's revision and every key with its value and revision.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Contents {
    revision: u64,
    entries: BTreeMap<String, Entry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    #[serde(with = "hex_bytes")]
    value: Vec<u8>,
    revision: u64,
}

/// A value as a string of lowercase hex digits, two per byte.
mod hex_bytes {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    const DIGITS: &[u8; 16] = b"0123456789abcdef";

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        let text: String = bytes
            .iter()
            .flat_map(|b| [DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 0xf)]])
            .map(char::from)
            .collect();
        serializer.serialize_str(&text)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(deserializer)?;
        let digit = |c: u8| {
            char::from(c)
                .to_digit(16)
                .map(|d| d as u8)
                .ok_or_else(|| D::Error::custom(format!("{:?} is not a hex digit", char::from(c))))
        };
        if text.len() % 2 != 0 {
            return Err(D::Error::custom("a value has an odd number of hex digits"));
        }
        text.as_bytes()
            .chunks(2)
            .map(|pair| Ok(digit(pair[0])? << 4 | digit(pair[1])?))
            .collect()
    }
}

impl Contents {
    fn key_value(key: &str, entry: &Entry) -> KeyValue {
        KeyValue {
            key: key.to_owned(),
            value: entry.value.clone(),
            revision: Revision(entry.revision),
        }
    }

    fn get(&self, key: &str) -> Option<KeyValue> {
        self.entries.get(key).map(|e| Self::key_value(key, e))
    }

    fn list(&self, prefix: &str) -> Vec<KeyValue> {
        self.entries
            .range(prefix.to_owned()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .map(|(key, entry)| Self::key_value(key, entry))
            .collect()
    }
}

struct Inner {
    path: PathBuf,
    contents: Mutex<Contents>,
}

impl Inner {
    fn contents(&self) -> Result<MutexGuard<'_, Contents>, KvError> {
        self.contents
            .lock()
            .map_err(|_| KvError::other("the store's lock was poisoned by a panicking writer"))
    }

    /// Writes `contents` beside the file, syncs it, renames it over the file, syncs the directory.
    fn save(&self, contents: &Contents) -> Result<(), KvError> {
        let io = |what: &str, e: std::io::Error| {
            KvError::other(format!("{what} {}: {e}", self.path.display()))
        };
        let bytes = serde_json::to_vec(contents)
            .map_err(|e| KvError::other(format!("cannot encode the store: {e}")))?;
        let staged = self.path.with_extension("json.new");
        let mut file = File::create(&staged).map_err(|e| io("cannot create beside", e))?;
        file.write_all(&bytes)
            .and_then(|()| file.sync_all())
            .map_err(|e| io("cannot write beside", e))?;
        fs::rename(&staged, &self.path).map_err(|e| io("cannot replace", e))?;
        durable::sync_directory_of(&self.path).map_err(|e| io("cannot sync the directory of", e))
    }

    fn commit(&self, txn: &Txn) -> Result<Revision, KvError> {
        let mut contents = self.contents()?;
        if let Some(failed) = txn.first_failed_condition(
            |key| Ok(contents.entries.get(key).map(|e| Revision(e.revision))),
            |prefix| {
                Ok(contents
                    .entries
                    .range(prefix.to_owned()..)
                    .take_while(|(key, _)| key.starts_with(prefix))
                    .map(|(_, e)| Revision(e.revision))
                    .max())
            },
        )? {
            return Err(KvError::Conflict {
                key: failed.key().to_owned(),
            });
        }
        // Applied in place, each replaced entry kept, so a failed save puts them back: readers
        // wait on the same lock, so they see the old contents or the saved new ones.
        let previous_revision = contents.revision;
        contents.revision += 1;
        let revision = contents.revision;
        let mut replaced = Vec::with_capacity(txn.ops.len());
        for op in &txn.ops {
            match op {
                Op::Put { key, value } => {
                    let entry = Entry {
                        value: value.clone(),
                        revision,
                    };
                    replaced.push((key.clone(), contents.entries.insert(key.clone(), entry)));
                }
                Op::Delete { key } => {
                    replaced.push((key.clone(), contents.entries.remove(key)));
                }
            }
        }
        // Durable first; only then answered.
        if let Err(e) = self.save(&contents) {
            for (key, entry) in replaced.into_iter().rev() {
                match entry {
                    Some(entry) => contents.entries.insert(key, entry),
                    None => contents.entries.remove(&key),
                };
            }
            contents.revision = previous_revision;
            return Err(e);
        }
        Ok(Revision(contents.revision))
    }
}

/// The store; cloning shares it.
#[derive(Clone)]
pub struct JsonFileStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for JsonFileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonFileStore")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl JsonFileStore {
    /// Opens the store kept in `path`, an empty one when the file does not exist yet (it is
    /// written by the first commit).
    ///
    /// # Errors
    /// [`KvError::Corrupt`] when the file is not a store this adapter wrote; [`KvError::Other`]
    /// when it cannot be read.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, KvError> {
        let path = path.into();
        let contents = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                KvError::corrupt(None, format!("{} is not a store: {e}", path.display()))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Contents::default(),
            Err(e) => {
                return Err(KvError::other(format!(
                    "cannot read {}: {e}",
                    path.display()
                )))
            }
        };
        Ok(JsonFileStore {
            inner: Arc::new(Inner {
                path,
                contents: Mutex::new(contents),
            }),
        })
    }
}

#[async_trait]
impl KvStore for JsonFileStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        validate_key(key)?;
        Ok(self.inner.contents()?.get(key))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        Ok(self.inner.contents()?.list(prefix))
    }

    /// Every read from one snapshot: the contents, under one lock.
    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        let contents = self.inner.contents()?;
        reads
            .iter()
            .map(|read| match read {
                Read::Get(key) => validate_key(key).map(|()| ReadResult::Got(contents.get(key))),
                Read::List(prefix) => Ok(ReadResult::Listed(contents.list(prefix))),
                Read::Range {
                    prefix,
                    from,
                    limit,
                } => read.validate().map(|()| {
                    ReadResult::Listed(range_of_listing(contents.list(prefix), from, *limit))
                }),
            })
            .collect()
    }

    /// Checks the conditions and writes the file on tokio's blocking pool, not on the caller's
    /// thread.
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        txn.validate()?;
        let inner = Arc::clone(&self.inner);
        let path = self.inner.path.clone();
        run_blocking("json-file", Stage::Write, &path, move || inner.commit(&txn)).await
    }
}
