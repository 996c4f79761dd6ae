//! The writer: puts an [`ImportPlan`] into an empty blockipam store in bounded transactions,
//! behind an "import in progress" marker written first and removed last, so that an interrupted
//! import is detected and resumed (or refused) by the next run; and the verification that runs
//! before the marker is removed.

use ipam_core::store_format::FormatRecord;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipam_core::allocator::raising_pool_generation;
use ipam_core::kv::{MAX_TXN_BYTES, MAX_TXN_CONDITIONS, MAX_TXN_OPS};
use ipam_core::model::nodes::{decode_node_labels, node_key, nodes_dir, StoredNode};
use ipam_core::model::{block_entries, decode, decode_pool, encode, keys, Block, Handle, ROOT};
use ipam_core::reservations::{decode_reservations, reservation_key, reservations_dir};
use ipam_core::{Condition, Ipam, IpamConfig, KeyValue, KvStore, Op, Pool, Txn};
use serde::{Deserialize, Serialize};

use crate::error::ImportError;
use crate::mapping::ImportPlan;

/// The key of the import marker: present exactly while an import is unfinished.
pub fn marker_key() -> String {
    keys::import_in_progress()
}

/// What the marker records: which Calico datastore, read at which revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportMarker {
    /// The source's description (endpoints and prefix).
    pub source: String,
    /// The etcd revision the import read; a resumed import reads the same one.
    pub calico_revision: i64,
}

/// What the target held before writing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetState {
    /// No blockipam key at all.
    Empty,
    /// An interrupted import's marker (and whatever it wrote).
    Interrupted(ImportMarker),
}

/// Reads the target: empty, or holding an interrupted import.
///
/// # Errors
/// [`ImportError::TargetNotEmpty`] when it holds blockipam data and no marker;
/// [`ImportError::Target`] when it cannot be read or the marker does not decode.
pub async fn inspect_target(target: &Arc<dyn KvStore>) -> Result<TargetState, ImportError> {
    let present = target.list(ROOT).await?;
    let marker_key = marker_key();
    match present.iter().find(|kv| kv.key == marker_key) {
        Some(kv) => {
            let marker: ImportMarker = decode(&kv.key, &kv.value)?;
            Ok(TargetState::Interrupted(marker))
        }
        None if present.is_empty() => Ok(TargetState::Empty),
        None => Err(ImportError::TargetNotEmpty(format!(
            "the target store is not empty: it holds {} keys under {ROOT}; import writes only \
             into an empty store. Nothing was written",
            present.len()
        ))),
    }
}

/// One group of keys written in the same transaction (a block with its claim index entry).
pub type Unit = Vec<(String, Vec<u8>)>;

/// Every key and value the plan stores, in write order: the sequence floor, the config, each
/// block with its claim entry, the handles, the pools, the IP reservations, the node labels,
/// then the pool generation counter.
///
/// # Errors
/// [`ImportError::Target`] when an object cannot be encoded.
pub fn planned_units(plan: &ImportPlan) -> Result<Vec<Unit>, ImportError> {
    let mut units = Vec::new();
    if plan.sequence_floor > 0 {
        units.push(vec![(
            keys::sequence_floor(),
            encode(&plan.sequence_floor)?,
        )]);
    }
    units.push(vec![(keys::config(), encode(&plan.config)?)]);
    for block in &plan.blocks {
        units.push(block_entries(block)?);
    }
    for (id, handle) in &plan.handles {
        units.push(vec![(keys::handle(id), encode(handle)?)]);
    }
    for pool in &plan.pools {
        units.push(vec![(keys::pool(&pool.name), encode(pool)?)]);
    }
    for reservation in &plan.reservations {
        units.push(vec![(
            reservation_key(&reservation.name),
            encode(reservation)?,
        )]);
    }
    for (host, labels) in &plan.node_labels {
        let node = StoredNode {
            labels: labels.clone(),
        };
        units.push(vec![(node_key(host), encode(&node)?)]);
    }
    if !plan.pools.is_empty() {
        units.push(vec![(
            keys::pool_generation(),
            encode(&(plan.pools.len() as u64))?,
        )]);
    }
    Ok(units)
}

/// What writing did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriteOutcome {
    /// Keys written by this run.
    pub keys_written: usize,
    /// Keys an interrupted run had written already.
    pub keys_already_present: usize,
    /// Transactions committed (marker and its removal included).
    pub transactions: usize,
}

/// Bytes a transaction spends on one key written under an "absent" condition, as
/// [`Txn::validate`] counts them.
fn entry_bytes(key: &str, value: &[u8]) -> usize {
    2 * key.len() + value.len()
}

/// Groups units into transactions within the store limits, never splitting a unit.
///
/// # Errors
/// [`ImportError::Target`] when one unit alone is too large for a transaction.
pub fn transactions(units: &[Unit]) -> Result<Vec<Vec<&Unit>>, ImportError> {
    let mut out: Vec<Vec<&Unit>> = Vec::new();
    let mut current: Vec<&Unit> = Vec::new();
    let (mut ops, mut bytes) = (0usize, 0usize);
    for unit in units {
        let unit_ops = unit.len();
        let unit_bytes: usize = unit.iter().map(|(k, v)| entry_bytes(k, v)).sum();
        if unit_ops > MAX_TXN_OPS.min(MAX_TXN_CONDITIONS) || unit_bytes > MAX_TXN_BYTES {
            return Err(ImportError::Target(format!(
                "{} ({unit_bytes} bytes) is too large for one transaction",
                unit.first().map(|(k, _)| k.as_str()).unwrap_or("a unit")
            )));
        }
        if !current.is_empty()
            && (ops + unit_ops > MAX_TXN_OPS.min(MAX_TXN_CONDITIONS)
                || bytes + unit_bytes > MAX_TXN_BYTES)
        {
            out.push(std::mem::take(&mut current));
            ops = 0;
            bytes = 0;
        }
        current.push(unit);
        ops += unit_ops;
        bytes += unit_bytes;
    }
    if !current.is_empty() {
        out.push(current);
    }
    Ok(out)
}

/// The transaction that writes one batch of [`transactions`]: each key put only where it is
/// absent.
pub fn batch_txn(batch: &[&Unit]) -> Txn {
    let entries = || batch.iter().flat_map(|unit| unit.iter());
    Txn {
        conditions: entries().map(|(k, _)| Condition::absent(k)).collect(),
        ops: entries().map(|(k, v)| Op::put(k, v.clone())).collect(),
    }
}

/// Writes the plan into the target, which [`inspect_target`] found in `state`; verifies the
/// result, then removes the marker. Every key is written under an "absent" condition, so nothing
/// in the target is ever overwritten.
///
/// # Errors
/// [`ImportError::Target`] on store failures or when an interrupted import's keys differ from
/// this plan; [`ImportError::Verify`] when the written store does not verify (the marker stays).
pub async fn write(
    target: &Arc<dyn KvStore>,
    plan: &ImportPlan,
    state: &TargetState,
    source: &str,
) -> Result<WriteOutcome, ImportError> {
    let units = planned_units(plan)?;
    let marker_key = marker_key();
    let mut outcome = WriteOutcome::default();
    let mut pending: Vec<Unit> = units.clone();
    match state {
        TargetState::Empty => {
            let marker = ImportMarker {
                source: source.to_owned(),
                calico_revision: plan.calico_revision,
            };
            target
                .commit(
                    Txn::new()
                        .when(Condition::absent(&marker_key))
                        .when(Condition::absent(keys::config()))
                        .when(Condition::absent(keys::store_format()))
                        .then(Op::put(&marker_key, encode(&marker)?))
                        // A new store: every writer writes this build's format (the import
                        // carries settings, such as Calico's IP cooldown, that only it holds).
                        .then(Op::put(
                            keys::store_format(),
                            FormatRecord {
                                writes: ipam_core::model::FORMAT_VERSION,
                            }
                            .encode()
                            .map_err(|e| ImportError::Target(e.to_string()))?,
                        )),
                )
                .await
                .map_err(|e| {
                    if e.is_conflict() {
                        ImportError::TargetNotEmpty(
                            "another writer started using the target store; nothing was written"
                                .into(),
                        )
                    } else {
                        ImportError::from(e)
                    }
                })?;
            outcome.transactions += 1;
        }
        TargetState::Interrupted(_) => {
            let planned: BTreeMap<&str, &[u8]> = units
                .iter()
                .flatten()
                .map(|(k, v)| (k.as_str(), v.as_slice()))
                .collect();
            let present = target.list(ROOT).await?;
            let mut done = BTreeSet::new();
            // The marker and the format record were written together, first.
            let written_first = [marker_key.clone(), keys::store_format()];
            for kv in present.iter().filter(|kv| !written_first.contains(&kv.key)) {
                if planned.get(kv.key.as_str()) != Some(&kv.value.as_slice()) {
                    return Err(ImportError::Target(format!(
                        "the interrupted import's key {} differs from what this import would write \
                         (did something else write to the target?); empty the target store and \
                         import again",
                        kv.key
                    )));
                }
                done.insert(kv.key.clone());
            }
            outcome.keys_already_present = done.len();
            pending = units
                .iter()
                .map(|unit| {
                    unit.iter()
                        .filter(|(k, _)| !done.contains(k))
                        .cloned()
                        .collect::<Unit>()
                })
                .filter(|unit| !unit.is_empty())
                .collect();
        }
    }

    for batch in transactions(&pending)? {
        let txn = batch_txn(&batch);
        let written = txn.ops.len();
        target.commit(txn).await.map_err(|e| {
            if e.is_conflict() {
                ImportError::Target(format!(
                    "another writer created a key in the target during the import ({e})"
                ))
            } else {
                ImportError::Target(format!(
                    "writing the target failed after {} keys: {e}; run the same import again to \
                     resume it",
                    outcome.keys_written
                ))
            }
        })?;
        outcome.keys_written += written;
        outcome.transactions += 1;
    }

    verify(target, plan).await?;

    // The marker's removal opens the store to ADDs: it raises the pool generation, as every
    // write of what an ADD decides from does.
    let generation = target.get(&keys::pool_generation()).await?;
    let marker = target.get(&marker_key).await?.ok_or_else(|| {
        ImportError::Target("the import marker vanished during the import".into())
    })?;
    let removal = Txn::new()
        .when(Condition::at_revision(&marker_key, marker.revision))
        .then(Op::delete(&marker_key));
    target
        .commit(raising_pool_generation(removal, generation)?)
        .await?;
    outcome.transactions += 1;
    Ok(outcome)
}

fn decoded<T: serde::de::DeserializeOwned + 'static>(
    kvs: &[KeyValue],
) -> Result<Vec<T>, ImportError> {
    kvs.iter()
        .map(|kv| decode(&kv.key, &kv.value).map_err(ImportError::from))
        .collect()
}

/// Checks the written store against the plan's Calico allocations: every allocation at its
/// address with its handle and attributes (and nothing else allocated), every cooling address
/// with its release time and every block's claim and empty times, every handle's count,
/// the pools, the config and the sequence floor; then `Ipam::check` must be clean.
///
/// # Errors
/// [`ImportError::Verify`] naming the first difference.
pub async fn verify(target: &Arc<dyn KvStore>, plan: &ImportPlan) -> Result<(), ImportError> {
    let fail = |message: String| Err(ImportError::Verify(message));
    let blocks: Vec<Block> = decoded(&target.list(&keys::blocks_dir()).await?)?;
    let mut stored: BTreeMap<IpAddr, (String, BTreeMap<String, String>, u64)> = BTreeMap::new();
    let mut max_sequence = 0;
    for block in &blocks {
        max_sequence = max_sequence.max(block.sequence);
        for (ordinal, allocation) in &block.allocations {
            let attribute = match block.attribute_of(*ordinal) {
                Ok(Some(attribute)) => attribute,
                Ok(None) => return fail(format!("{} has no attribute", block.ip_of(*ordinal))),
                Err(e) => return fail(format!("{}: {e}", block.ip_of(*ordinal))),
            };
            stored.insert(
                block.ip_of(*ordinal),
                (
                    attribute.handle.clone(),
                    attribute.metadata.clone(),
                    allocation.sequence,
                ),
            );
        }
    }
    for expected in &plan.expected {
        match stored.get(&expected.ip) {
            None => return fail(format!("Calico's allocation {} is missing", expected.ip)),
            Some((handle, metadata, sequence)) => {
                if *handle != expected.handle
                    || *metadata != expected.metadata
                    || *sequence != expected.sequence
                {
                    return fail(format!(
                        "{} is held by {handle} (sequence {sequence}), Calico had {} (sequence {})",
                        expected.ip, expected.handle, expected.sequence
                    ));
                }
            }
        }
    }
    if stored.len() != plan.expected.len() {
        return fail(format!(
            "the store holds {} allocations, Calico held {}",
            stored.len(),
            plan.expected.len()
        ));
    }
    for planned in &plan.blocks {
        let Some(block) = blocks.iter().find(|b| b.cidr == planned.cidr) else {
            return fail(format!("block {} is missing", planned.cidr));
        };
        if block.cooling != planned.cooling {
            return fail(format!(
                "block {} has cooling addresses {:?}, Calico had {:?}",
                planned.cidr, block.cooling, planned.cooling
            ));
        }
        if (block.claimed_at, block.emptied_at) != (planned.claimed_at, planned.emptied_at) {
            return fail(format!(
                "block {} was claimed at {:?} and emptied at {:?}, the plan says {:?} and {:?}",
                planned.cidr,
                block.claimed_at,
                block.emptied_at,
                planned.claimed_at,
                planned.emptied_at
            ));
        }
    }

    let mut expected_counts: BTreeMap<&str, u64> = BTreeMap::new();
    for expected in &plan.expected {
        *expected_counts.entry(expected.handle.as_str()).or_default() += 1;
    }
    let handle_kvs = target.list(&keys::handles_dir()).await?;
    if handle_kvs.len() != expected_counts.len() {
        return fail(format!(
            "the store holds {} handles, Calico's allocations have {}",
            handle_kvs.len(),
            expected_counts.len()
        ));
    }
    for kv in &handle_kvs {
        let id = kv.key.strip_prefix(&keys::handles_dir()).unwrap_or(&kv.key);
        let handle: Handle = decode(&kv.key, &kv.value)?;
        if expected_counts.get(id).copied() != Some(handle.total()) {
            return fail(format!(
                "handle {id} counts {} addresses, Calico's blocks hold {:?}",
                handle.total(),
                expected_counts.get(id)
            ));
        }
    }

    let mut pools: Vec<Pool> = target
        .list(&keys::pools_dir())
        .await?
        .iter()
        .map(|kv| decode_pool(&kv.key, &kv.value).map_err(ImportError::from))
        .collect::<Result<_, _>>()?;
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    if pools != plan.pools {
        return fail("the stored pools differ from the plan".into());
    }
    let mut reservations = decode_reservations(&target.list(&reservations_dir()).await?)?;
    reservations.sort_by(|a, b| a.name.cmp(&b.name));
    if reservations != plan.reservations {
        return fail("the stored IP reservations differ from the plan".into());
    }
    let mut node_labels = BTreeMap::new();
    for kv in target.list(&nodes_dir()).await? {
        let host = kv
            .key
            .strip_prefix(&nodes_dir())
            .unwrap_or(&kv.key)
            .to_owned();
        node_labels.insert(host, decode_node_labels(&kv.key, Some(&kv))?);
    }
    if node_labels != plan.node_labels {
        return fail("the stored node labels differ from the Calico Nodes' labels".into());
    }
    let config: Option<IpamConfig> = match target.get(&keys::config()).await? {
        Some(kv) => Some(decode(&kv.key, &kv.value)?),
        None => None,
    };
    if config != Some(plan.config) {
        return fail(format!(
            "the stored config {config:?} differs from {:?}",
            plan.config
        ));
    }
    let floor: u64 = match target.get(&keys::sequence_floor()).await? {
        Some(kv) => decode(&kv.key, &kv.value)?,
        None => 0,
    };
    if !blocks.is_empty() && floor <= max_sequence {
        return fail(format!(
            "the sequence floor {floor} is not above the largest imported sequence {max_sequence}"
        ));
    }

    let report = Ipam::new(target.clone()).check(false).await?;
    if let Some(first) = report.problems.first() {
        return fail(format!(
            "check found {} {} (first: {}: {})",
            report.problems.len(),
            if report.problems.len() == 1 {
                "problem"
            } else {
                "problems"
            },
            first.kind,
            first.detail
        ));
    }
    Ok(())
}

/// The marker of an unfinished import in `store`, if there is one (what `check` reports).
///
/// # Errors
/// [`ImportError::Target`] when the store cannot be read or the marker does not decode.
pub async fn interrupted_import(
    store: &Arc<dyn KvStore>,
) -> Result<Option<ImportMarker>, ImportError> {
    match store.get(&marker_key()).await? {
        Some(kv) => Ok(Some(decode(&kv.key, &kv.value)?)),
        None => Ok(None),
    }
}
