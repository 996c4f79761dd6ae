//! An in-memory reference implementation of the storage trait, for unit tests above the trait.

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;

use crate::kv::{validate_key, KeyValue, KvError, KvStore, Op, Read, ReadResult, Revision, Txn};

#[derive(Debug, Default)]
struct MemoryState {
    revision: u64,
    entries: BTreeMap<String, (Vec<u8>, Revision)>,
}

/// A [`KvStore`] kept in process memory. Nothing survives the process; everything else follows
/// the trait's contract exactly, so it is the reference the conformance suite checks first.
#[derive(Debug, Default)]
pub struct MemoryStore {
    state: Mutex<MemoryState>,
}

impl MemoryStore {
    /// An empty store at revision zero.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, MemoryState>, KvError> {
        self.state
            .lock()
            .map_err(|_| KvError::other("memory store lock poisoned by a panicking writer"))
    }
}

#[async_trait]
impl KvStore for MemoryStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        validate_key(key)?;
        let state = self.lock()?;
        Ok(state.entries.get(key).map(|(value, revision)| KeyValue {
            key: key.to_owned(),
            value: value.clone(),
            revision: *revision,
        }))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        let state = self.lock()?;
        Ok(state
            .entries
            .range(prefix.to_owned()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .map(|(key, (value, revision))| KeyValue {
                key: key.clone(),
                value: value.clone(),
                revision: *revision,
            })
            .collect())
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        for read in reads {
            read.validate()?;
        }
        let state = self.lock()?;
        let snapshot = |kv: (&String, &(Vec<u8>, Revision))| KeyValue {
            key: kv.0.clone(),
            value: kv.1 .0.clone(),
            revision: kv.1 .1,
        };
        reads
            .iter()
            .map(|read| match read {
                Read::Get(key) => {
                    validate_key(key)?;
                    Ok(ReadResult::Got(
                        state.entries.get_key_value(key).map(snapshot),
                    ))
                }
                Read::List(prefix) => Ok(ReadResult::Listed(
                    state
                        .entries
                        .range(prefix.clone()..)
                        .take_while(|(key, _)| key.starts_with(prefix.as_str()))
                        .map(snapshot)
                        .collect(),
                )),
                Read::Range {
                    prefix,
                    from,
                    limit,
                } => {
                    read.validate()?;
                    Ok(ReadResult::Listed(
                        state
                            .entries
                            .range(Read::range_start(prefix, from).to_owned()..)
                            .take_while(|(key, _)| key.starts_with(prefix.as_str()))
                            .take(*limit as usize)
                            .map(snapshot)
                            .collect(),
                    ))
                }
            })
            .collect()
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        txn.validate()?;
        let mut state = self.lock()?;
        if let Some(failed) = txn.first_failed_condition(
            |key| Ok(state.entries.get(key).map(|(_, revision)| *revision)),
            |prefix| {
                Ok(state
                    .entries
                    .range(prefix.to_owned()..)
                    .take_while(|(key, _)| key.starts_with(prefix))
                    .map(|(_, (_, revision))| *revision)
                    .max())
            },
        )? {
            return Err(KvError::Conflict {
                key: failed.key().to_owned(),
            });
        }
        state.revision += 1;
        let revision = Revision(state.revision);
        for op in txn.ops {
            match op {
                Op::Put { key, value } => {
                    state.entries.insert(key, (value, revision));
                }
                Op::Delete { key } => {
                    state.entries.remove(&key);
                }
            }
        }
        Ok(revision)
    }
}
