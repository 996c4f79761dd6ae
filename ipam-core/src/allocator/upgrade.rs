//! Which stored format writers write: learning the store's format record, sealing every commit
//! with it (writes rewritten in that format, conditioned on the record), and the operator's
//! upgrade status and finalize.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use crate::allocator::dead_nodes::{Activity, Registration};
use crate::allocator::{next_got, next_listed, raising_pool_generation, Attempt, Ipam};
use crate::kv::{Condition, KeyValue, KvError, Op, Read, Revision, Txn};
use crate::model::error::IpamError;
use crate::model::formats::downgrade;
use crate::model::keys;
use crate::model::store_format::{FormatRecord, FORMAT_OF_UNRECORDED_STORES};
use crate::model::{decode_claim, encode, FORMAT_VERSION, OLDEST_READABLE_FORMAT_VERSION};

/// What an allocator learned of the store's format record, shared by its clones.
#[derive(Debug, Clone, Default)]
pub(crate) struct FormatCell(Arc<Mutex<Option<KnownFormat>>>);

/// The store's write format as last read, and what a commit must check and write for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KnownFormat {
    /// The format every write is rewritten in.
    pub writes: u8,
    /// The record's revision; `None` when the store had no record.
    pub revision: Option<Revision>,
    /// For a store without a record: the record the next commit writes (the format it was found
    /// to count as).
    pub record: Option<u8>,
}

impl FormatCell {
    fn get(&self) -> Option<KnownFormat> {
        *self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn set(&self, known: Option<KnownFormat>) {
        *self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = known;
    }
}

/// The read that a call's batch adds to learn the store's format (see [`Ipam::learn_format`]).
pub(crate) fn format_read() -> Read {
    Read::Get(keys::store_format())
}

impl Ipam {
    /// Learns the store's write format from the record as a batched read returned it
    /// ([`format_read`]). A store without a record is looked at once more (its configuration,
    /// pools, node labels and namespace settings): one in use predates the record and counts as
    /// [`FORMAT_OF_UNRECORDED_STORES`]; an empty one is new and gets this build's format. The
    /// next commit records what was found.
    ///
    /// # Errors
    /// Store failures; a damaged record; [`IpamError::FormatTooNew`].
    pub(crate) async fn learn_format(
        &self,
        record: Option<KeyValue>,
    ) -> Result<KnownFormat, IpamError> {
        let known = match record {
            Some(kv) => KnownFormat {
                writes: FormatRecord::decode(&kv.key, &kv.value)?.writable()?,
                revision: Some(kv.revision),
                record: None,
            },
            None => {
                let writes = if self.store_in_use().await? {
                    FORMAT_OF_UNRECORDED_STORES
                } else {
                    FORMAT_VERSION
                };
                KnownFormat {
                    writes,
                    revision: None,
                    record: Some(writes),
                }
            }
        };
        self.format.set(Some(known));
        Ok(known)
    }

    /// True when anything of an IPAM store is there: its configuration, a pool, a node's labels
    /// or a namespace's pools (every other object needs a pool or came with one).
    async fn store_in_use(&self) -> Result<bool, IpamError> {
        let answers = self
            .store()
            .read_many(&[
                Read::Get(keys::config()),
                Read::List(keys::pools_dir()),
                Read::List(keys::nodes_dir()),
                Read::List(keys::namespaces_dir()),
            ])
            .await?;
        let mut answers = answers.into_iter();
        let config = next_got(&mut answers)?;
        let mut in_use = config.is_some();
        for _ in 0..3 {
            in_use |= !next_listed(&mut answers)?.is_empty();
        }
        Ok(in_use)
    }

    /// The store's write format as last learned, without reading it.
    pub(crate) fn learned_format(&self) -> Option<u8> {
        self.format.get().map(|known| known.writes)
    }

    /// The store's write format: as last learned, else read now.
    pub(crate) async fn known_format(&self) -> Result<KnownFormat, IpamError> {
        match self.format.get() {
            Some(known) => Ok(known),
            None => {
                let record = self.store().get(&keys::store_format()).await?;
                self.learn_format(record).await
            }
        }
    }

    /// After a commit at `revision` of a transaction [`Ipam::seal`]ed: when it wrote the record
    /// of a store that had none, the record is now at that revision.
    pub(crate) fn committed(&self, revision: Revision) {
        if let Some(known) = self.format.get() {
            if let Some(writes) = known.record {
                self.format.set(Some(KnownFormat {
                    writes,
                    revision: Some(revision),
                    record: None,
                }));
            }
        }
    }

    /// Forgets the learned format: the next commit reads it again. Called when a commit found
    /// the record changed.
    pub(crate) fn forget_format(&self) {
        self.format.set(None);
    }

    /// `txn` as it must be committed: every value rewritten in the store's write format, the
    /// record written when the store had none, and a condition that the record is still what was
    /// learned (so that no write uses a format the record no longer names).
    ///
    /// # Errors
    /// As [`Ipam::known_format`]; [`IpamError::FormatNotFinalized`] for a change the store's
    /// write format cannot hold.
    pub(crate) async fn seal(&self, txn: Txn) -> Result<Txn, IpamError> {
        let cached = self.format.get().is_some();
        let known = self.known_format().await?;
        if known.writes >= FORMAT_VERSION {
            // Finalized (or new): every value is written as encoded, without a copy.
            return Self::sealed(txn.conditions, txn.ops, known);
        }
        match Self::rewrite_ops(&txn.ops, known.writes) {
            Err(IpamError::FormatNotFinalized { .. }) if cached => {
                // What was learned may predate a finalize: refuse only on the record as it is.
                self.forget_format();
                let known = self.known_format().await?;
                let ops = Self::rewrite_ops(&txn.ops, known.writes)?;
                Self::sealed(txn.conditions, ops, known)
            }
            ops => Self::sealed(txn.conditions, ops?, known),
        }
    }

    /// `ops` with every value rewritten in format `writes`.
    fn rewrite_ops(ops: &[Op], writes: u8) -> Result<Vec<Op>, IpamError> {
        ops.iter()
            .map(|op| match op {
                Op::Put { key, value } => Ok(Op::Put {
                    key: key.clone(),
                    value: downgrade(key, value.clone(), writes)?,
                }),
                delete => Ok(delete.clone()),
            })
            .collect()
    }

    /// The transaction of `conditions` and `ops` (already rewritten for `known`), with the
    /// record's condition and, for a store without one, the record.
    fn sealed(
        conditions: Vec<Condition>,
        ops: Vec<Op>,
        known: KnownFormat,
    ) -> Result<Txn, IpamError> {
        let key = keys::store_format();
        let mut sealed = Txn { conditions, ops };
        sealed.conditions.retain(|c| c.key() != key);
        sealed.conditions.push(match known.revision {
            Some(revision) => Condition::at_revision(&key, revision),
            None => Condition::absent(&key),
        });
        if let Some(writes) = known.record {
            sealed
                .ops
                .push(Op::put(&key, FormatRecord { writes }.encode()?));
        }
        Ok(sealed)
    }

    /// What an operator needs to decide on finalizing: the recorded format, what writers use,
    /// what this build reads and writes, and what format each node that can be seen reads.
    ///
    /// # Errors
    /// Store failures; damaged records.
    pub async fn upgrade_status(&self) -> Result<UpgradeStatus, IpamError> {
        Ok(self.upgrade_status_at().await?.0)
    }

    /// [`Ipam::upgrade_status`], with the revision of the record it read and the conditions "no
    /// agent registration and no plugin activity record was put since this read" (what a node
    /// says about the formats it reads).
    async fn upgrade_status_at(
        &self,
    ) -> Result<(UpgradeStatus, Option<Revision>, Vec<Condition>), IpamError> {
        let answers = self
            .store()
            .read_many(&[
                format_read(),
                Read::List(keys::agents_dir()),
                Read::List(keys::activity_dir()),
                Read::List(keys::claims_dir()),
            ])
            .await?;
        let mut answers = answers.into_iter();
        let record = next_got(&mut answers)?;
        let recorded = match &record {
            Some(kv) => Some(FormatRecord::decode(&kv.key, &kv.value)?.writes),
            None => None,
        };
        let writes = match recorded {
            Some(writes) => writes,
            None if self.store_in_use().await? => FORMAT_OF_UNRECORDED_STORES,
            None => FORMAT_VERSION,
        };
        let mut nodes: BTreeMap<String, NodeFormats> = BTreeMap::new();
        let newest = |kvs: &[KeyValue]| {
            kvs.iter()
                .map(|kv| kv.revision)
                .max()
                .unwrap_or(Revision(0))
        };
        let registrations = next_listed(&mut answers)?;
        let activities = next_listed(&mut answers)?;
        let unchanged_since_read = vec![
            Condition::no_put_after(keys::agents_dir(), newest(&registrations)),
            Condition::no_put_after(keys::activity_dir(), newest(&activities)),
        ];
        for kv in registrations {
            let registration: Registration =
                serde_json::from_slice(&kv.value).map_err(|e| IpamError::Corrupt {
                    key: kv.key.clone(),
                    message: format!("not an agent registration: {e}"),
                })?;
            let node = nodes.entry(registration.node.clone()).or_default();
            node.agent = Some(SeenBinary {
                version: registration.agent_version,
                reads_format: registration.reads_format,
            });
        }
        for kv in activities {
            let activity: Activity =
                serde_json::from_slice(&kv.value).map_err(|e| IpamError::Corrupt {
                    key: kv.key.clone(),
                    message: format!("not an activity record: {e}"),
                })?;
            let node = nodes.entry(activity.node.clone()).or_default();
            node.plugin = Some(SeenBinary {
                version: activity.plugin_version,
                reads_format: activity.reads_format,
            });
        }
        for kv in next_listed(&mut answers)? {
            if let Some(host) = decode_claim(&kv.key, &kv.value)?.affinity {
                nodes.entry(host).or_default().holds_blocks = true;
            }
        }
        let revision = record.map(|kv| kv.revision);
        let status = UpgradeStatus {
            recorded,
            writes,
            reads_from: OLDEST_READABLE_FORMAT_VERSION,
            reads_up_to: FORMAT_VERSION,
            nodes: nodes
                .into_iter()
                .map(|(node, mut formats)| {
                    formats.node = node;
                    formats
                })
                .collect(),
        };
        Ok((status, revision, unchanged_since_read))
    }

    /// Records [`FORMAT_VERSION`] as the format every writer writes, and rewrites the IPAM
    /// configuration in it, in one compare-and-swap on both as read; from then on every ADD of a
    /// binary of the previous release refuses the store (it reads the configuration). Refused
    /// while a node that can be seen may read less (an agent or plugin that says so, or does not
    /// say, or a node that holds blocks and was never seen with this release), unless `force`.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] naming the nodes that hold it back;
    /// [`IpamError::FormatTooNew`] when a newer release finalized the store (even with `force`);
    /// store failures; [`IpamError::RetriesExhausted`] when the record kept changing.
    pub async fn finalize_upgrade(&self, force: bool) -> Result<FinalizeOutcome, IpamError> {
        self.retrying(|| self.try_finalize_upgrade(force)).await
    }

    async fn try_finalize_upgrade(
        &self,
        force: bool,
    ) -> Result<Attempt<FinalizeOutcome>, IpamError> {
        let (status, revision, unchanged_since_read) = self.upgrade_status_at().await?;
        // A newer release finalized the store: writing this build's format into the record
        // would take it back, and this build's writers would rewrite what they cannot read.
        if let Some(writes) = status.recorded {
            FormatRecord { writes }.writable()?;
        }
        if status.recorded == Some(FORMAT_VERSION) {
            return Ok(Attempt::Done(FinalizeOutcome {
                previous: status.recorded,
                writes: FORMAT_VERSION,
                changed: false,
                overridden: Vec::new(),
            }));
        }
        let behind: Vec<String> = status
            .nodes
            .iter()
            .filter(|node| node.reads_format() < FORMAT_VERSION)
            .map(|node| node.describe())
            .collect();
        if !behind.is_empty() && !force {
            return Err(IpamError::invalid(format!(
                "not finalized: {} node(s) may read only older formats and would refuse the store: {}. Upgrade them (their agent registers, their plugin's next call records its version) or retire them (`blockipamctl node retire <node> --apply`), then run this again; --force finalizes anyway",
                behind.len(),
                behind.join("; ")
            )));
        }
        let key = keys::store_format();
        let condition = match revision {
            Some(revision) => Condition::at_revision(&key, revision),
            None => Condition::absent(&key),
        };
        // The configuration is rewritten in the new format in the same write: every call of a
        // binary that reads only older formats and reads it (ADDs; the format-4 and format-5
        // releases' DELs, for the cooldown) refuses the store at once, writing nothing, rather
        // than failing later, object by object. The format-3 release's DELs do not read it.
        let (config_kv, generation) = self.read_with_generation(&keys::config()).await?;
        let config_condition = match &config_kv {
            Some(kv) => Condition::at_revision(&kv.key, kv.revision),
            None => Condition::absent(keys::config()),
        };
        let (config, _) = Self::decode_config(config_kv)?;
        // What the decision rests on: a node whose agent registers (an agent rolled back) or
        // whose plugin records a call (a plugin of an older release, called for the first time)
        // after the read fails the write, and it is decided again with that node.
        let mut txn = Txn::new().when(condition).when(config_condition);
        for seen in unchanged_since_read {
            txn = txn.when(seen);
        }
        let txn = txn
            .then(Op::put(
                &key,
                FormatRecord {
                    writes: FORMAT_VERSION,
                }
                .encode()?,
            ))
            .then(Op::put(keys::config(), encode(&config)?));
        // A configuration rewritten raises the pool generation, as every write of what an ADD
        // decides from does.
        let txn = raising_pool_generation(txn, generation)?;
        // One compare-and-swap: a record or configuration changed since it was read (another
        // finalize, the first write recording an unrecorded store, a `config set`), or a node's
        // word on its formats, fails it, and it is decided again on what is there now.
        match self.store().commit(txn).await {
            Ok(_) => {}
            Err(KvError::Conflict { .. }) => return Ok(Attempt::Conflict),
            Err(e) => return Err(e.into()),
        }
        self.forget_format();
        Ok(Attempt::Done(FinalizeOutcome {
            previous: status.recorded,
            writes: FORMAT_VERSION,
            changed: true,
            overridden: if force { behind } else { Vec::new() },
        }))
    }
}

/// The store's format and what its nodes read ([`Ipam::upgrade_status`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UpgradeStatus {
    /// The format the record names; `None` when the store has no record yet.
    pub recorded: Option<u8>,
    /// The format writers write now.
    pub writes: u8,
    /// The oldest format this build reads.
    pub reads_from: u8,
    /// The newest format this build reads and writes.
    pub reads_up_to: u8,
    /// Every node seen through its agent's registration, its plugin's activity record or its
    /// blocks.
    pub nodes: Vec<NodeFormats>,
}

/// What one node's binaries read, as far as they can be seen.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NodeFormats {
    /// The node's name.
    pub node: String,
    /// Its agent, from its registration.
    pub agent: Option<SeenBinary>,
    /// Its plugin, from the activity record its last call wrote.
    pub plugin: Option<SeenBinary>,
    /// True when a block is affine to it.
    pub holds_blocks: bool,
}

/// A binary seen in the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SeenBinary {
    /// Its release.
    pub version: String,
    /// The newest format it reads; `None` for releases that do not say (format 3 at most).
    pub reads_format: Option<u8>,
}

impl NodeFormats {
    /// The newest format every binary of the node that can be seen reads: a binary that does not
    /// say reads [`FORMAT_OF_UNRECORDED_STORES`] at most, and a node that holds blocks but whose
    /// plugin was never seen may run a plugin that does not say.
    pub fn reads_format(&self) -> u8 {
        let said = |seen: &Option<SeenBinary>| {
            seen.as_ref()
                .map(|b| b.reads_format.unwrap_or(FORMAT_OF_UNRECORDED_STORES))
        };
        let plugin = match said(&self.plugin) {
            Some(reads) => reads,
            None if self.holds_blocks => FORMAT_OF_UNRECORDED_STORES,
            None => FORMAT_VERSION,
        };
        said(&self.agent).map_or(plugin, |agent| agent.min(plugin))
    }

    fn describe(&self) -> String {
        let show = |what: &str, seen: &Option<SeenBinary>| match seen {
            Some(b) => match b.reads_format {
                Some(reads) => format!("{what} {} reads format {reads}", b.version),
                None => format!("{what} {} (format 3 at most)", b.version),
            },
            None => format!("no {what} seen"),
        };
        format!(
            "{}: {}, {}{}",
            self.node,
            show("agent", &self.agent),
            show("plugin", &self.plugin),
            if self.holds_blocks && self.plugin.is_none() {
                " (it holds blocks)"
            } else {
                ""
            }
        )
    }
}

/// What [`Ipam::finalize_upgrade`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FinalizeOutcome {
    /// The format recorded before; `None` when the store had no record.
    pub previous: Option<u8>,
    /// The format recorded now.
    pub writes: u8,
    /// False when the store was finalized already.
    pub changed: bool,
    /// The nodes that held it back, finalized over with `force`.
    pub overridden: Vec<String>,
}
