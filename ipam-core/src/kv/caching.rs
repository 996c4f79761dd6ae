//! A store that keeps what it last read and wrote, and answers a batched read from it with the
//! conditions under which the answer is still the store's: one round trip fewer per decision.
//!
//! [`CachingStore`] wraps another store. Every read through it and every write it commits teach
//! it keys' values and revisions and prefixes' listings. [`KvStore::read_many_cached`] answers a
//! batch whose every read it knows without asking the wrapped store, and returns, beside the
//! answers, *validators*: for each key answered, "absent" or "at this revision"; for each
//! listing, "no key put under the prefix after the listing's newest revision" and each listed key
//! at its revision. A transaction decided from the answers and carrying the validators applies
//! only if every answer is still exactly what the store holds, so correctness never depends on
//! what was kept: a stale answer costs a conflict and a fresh read, never a wrong write. A caller
//! that ends without committing (an answer that needed no write, an error) must read again
//! without the cache before it reports anything decided from a cached answer.
//!
//! Keys under a prefix configured with [`CachingStore::speculating_absent_under`] (the
//! allocator's handles: a new container's handle has never been written) are answered absent
//! when not known, validated by an "absent" condition.
//!
//! Each answer also says a revision at which it is known to have been exactly the store's
//! ([`CachedRead::current_as_of`]): a key read from the store, the revision of its last write; a
//! key or listing a committed transaction wrote, or tested and found unchanged (a listing: its
//! prefix and every listed key), that commit's revision; a listing read from the store, or a key
//! read absent, none (a deletion leaves no revision behind). Read again unchanged, an answer keeps
//! the later of the two.
//!
//! A prefix configured with [`CachingStore::covering`] names a *generation* key that every
//! transaction writing under the prefix also writes (the allocator's pools and their
//! generation counter). A batch that reads the generation (present) before the listing learns
//! the listing as known as of the generation's revision: no write under the prefix came between.
//! An answer whose listing is known as of the generation's revision or later is validated by
//! the generation's own validator alone, in place of the listing's prefix and listed keys: while
//! the generation stays at that revision, nothing under the prefix changed since the listing
//! was the store's. The promise is the configurer's: a writer that writes under the prefix
//! without raising the generation is not seen by an answer so validated.
//!
//! A [`Covering`] extends the same to single keys under a prefix (read after their generation,
//! they are known as of its revision), names a generation per key (`<dir><name>` for the key
//! `<prefix><name>`), may hold for answers of absence only (keys the store deletes on its own,
//! such as a lease's expiry, while every put writes the generation), and may be in force only
//! once a *gate* key holds a value the configurer names (the allocator's format record: every
//! writer keeps the promise only from a format on). A gated covering takes an answer as known as
//! of the later of the generation's and the gate's revisions, and learns it only from a batch
//! that read the gate (holding) before the generation before the answer: what an older writer
//! wrote before the gate held is never taken for covered.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::kv::{
    CachedRead, Condition, KeyValue, KvError, KvStore, Op, Read, ReadResult, Revision, Txn,
    MAX_TXN_CONDITIONS,
};

/// Most validators one cached answer carries: the rest of a transaction's conditions must fit
/// beside them ([`MAX_TXN_CONDITIONS`]). A batch needing more is read from the store.
pub const MAX_VALIDATORS: usize = MAX_TXN_CONDITIONS / 2;

// Room for a transaction's own conditions beside the validators, and for a node's listings.
const _: () = assert!(MAX_VALIDATORS * 2 <= MAX_TXN_CONDITIONS && MAX_VALIDATORS >= 32);

/// Most bytes of keys and values kept; past it, everything kept is forgotten.
pub const MAX_KEPT_BYTES: usize = 16 * 1024 * 1024;

/// A listing kept: its entries by key, and the newest revision among them when it was read or
/// last brought up to date (0 for none).
#[derive(Debug, Clone)]
struct KeptListing {
    entries: BTreeMap<String, (Vec<u8>, Revision)>,
    newest: Revision,
    /// A revision at which exactly these entries were under the prefix (NONE: not known).
    current_as_of: Revision,
}

impl KeptListing {
    fn from_listed(listed: &[KeyValue]) -> Self {
        KeptListing {
            entries: listed
                .iter()
                .map(|kv| (kv.key.clone(), (kv.value.clone(), kv.revision)))
                .collect(),
            newest: listed
                .iter()
                .map(|kv| kv.revision)
                .max()
                .unwrap_or(Revision::NONE),
            current_as_of: Revision::NONE,
        }
    }

    /// True when `listed` holds exactly these entries.
    fn holds_exactly(&self, listed: &[KeyValue]) -> bool {
        self.entries.len() == listed.len()
            && listed.iter().all(|kv| {
                self.entries
                    .get(&kv.key)
                    .is_some_and(|(value, revision)| *revision == kv.revision && *value == kv.value)
            })
    }

    fn bytes(&self) -> usize {
        self.entries
            .iter()
            .map(|(k, (v, _))| k.len() + v.len())
            .sum()
    }

    fn listed(&self) -> Vec<KeyValue> {
        self.entries
            .iter()
            .map(|(key, (value, revision))| KeyValue {
                key: key.clone(),
                value: value.clone(),
                revision: *revision,
            })
            .collect()
    }
}

/// The conditions that hold exactly when each of `results` is still what the store holds: for a
/// key, absent or at its revision; for a listing, nothing put under its prefix after its newest
/// revision and each listed key at its revision; none for the answers at the indexes in
/// `covered` (each validated instead by a generation read in the same batch: [`Covering`]).
/// None when two results disagree on a key (read at different times) or more than
/// [`MAX_VALIDATORS`] would be needed; ranges are not validated.
fn validators_except(
    reads: &[Read],
    results: &[ReadResult],
    covered: &[usize],
) -> Option<Vec<Condition>> {
    let mut validators: BTreeMap<(bool, String), Condition> = BTreeMap::new();
    let mut agreed = true;
    let mut validate = |condition: Condition| {
        let tested = (condition.tests_a_prefix(), condition.key().to_owned());
        if let Some(earlier) = validators.insert(tested, condition.clone()) {
            agreed &= earlier == condition;
        }
    };
    for (index, (read, result)) in reads.iter().zip(results).enumerate() {
        match (read, result) {
            _ if covered.contains(&index) => {}
            (Read::Get(key), ReadResult::Got(Some(kv))) => {
                validate(Condition::at_revision(key, kv.revision));
            }
            (Read::Get(key), ReadResult::Got(None)) => validate(Condition::absent(key)),
            (Read::List(prefix), ReadResult::Listed(listed)) => {
                let newest = listed.iter().map(|kv| kv.revision).max();
                validate(Condition::no_put_after(
                    prefix,
                    newest.unwrap_or(Revision::NONE),
                ));
                for kv in listed {
                    validate(Condition::at_revision(&kv.key, kv.revision));
                }
            }
            _ => {}
        }
    }
    (agreed && validators.len() <= MAX_VALIDATORS).then(|| validators.into_values().collect())
}

/// Keys or a listing a generation key validates in place of their own validators: every
/// transaction that writes them also writes the generation (see the module's documentation).
#[derive(Clone)]
pub struct Covering {
    /// Keys under it, and its own listing when the generation is one key.
    prefix: String,
    generation: GenerationOf,
    /// Only answers of absence are covered (the store deletes such keys on its own).
    absent_only: bool,
    /// In force only while this key holds a value the function accepts.
    gate: Option<(String, GateHolds)>,
}

/// Whether a gate key's value puts a [`Covering`] in force.
type GateHolds = fn(&[u8]) -> bool;

/// Where a covered key's generation is.
#[derive(Debug, Clone)]
enum GenerationOf {
    /// One key for every key under the prefix, and for its listing.
    Key(String),
    /// `<dir><name>` for the key `<prefix><name>` (a name without `/`); listings not covered.
    Named { dir: String },
}

impl std::fmt::Debug for Covering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Covering")
            .field("prefix", &self.prefix)
            .field("generation", &self.generation)
            .field("absent_only", &self.absent_only)
            .field("gate", &self.gate.as_ref().map(|(key, _)| key))
            .finish()
    }
}

impl Covering {
    /// The listing of `prefix` and every key under it, covered by the one key `generation`.
    pub fn listing(prefix: impl Into<String>, generation: impl Into<String>) -> Self {
        Covering {
            prefix: prefix.into(),
            generation: GenerationOf::Key(generation.into()),
            absent_only: false,
            gate: None,
        }
    }

    /// Each key `<prefix><name>` covered by its own generation `<generations_dir><name>`.
    pub fn each_by_name(prefix: impl Into<String>, generations_dir: impl Into<String>) -> Self {
        Covering {
            prefix: prefix.into(),
            generation: GenerationOf::Named {
                dir: generations_dir.into(),
            },
            absent_only: false,
            gate: None,
        }
    }

    /// Covers answers of absence only: for keys the store deletes on its own (a lease's expiry)
    /// while every put of one writes its generation.
    pub fn absent_only(mut self) -> Self {
        self.absent_only = true;
        self
    }

    /// In force only in a batch that read `key` holding a value `holds` accepts (before the
    /// generation, for what the batch teaches).
    pub fn when(mut self, key: impl Into<String>, holds: GateHolds) -> Self {
        self.gate = Some((key.into(), holds));
        self
    }

    /// The generation key of the answer to `read`, when this covering applies to it.
    fn generation_of(&self, read: &Read, result: &ReadResult) -> Option<String> {
        let generation = match (read, &self.generation) {
            (Read::Get(key), GenerationOf::Key(generation)) => {
                (key.starts_with(&self.prefix) && key != generation).then(|| generation.clone())
            }
            (Read::Get(key), GenerationOf::Named { dir }) => key
                .strip_prefix(&self.prefix)
                .filter(|name| !name.is_empty() && !name.contains('/'))
                .map(|name| format!("{dir}{name}"))
                .filter(|generation| generation != key),
            (Read::List(prefix), GenerationOf::Key(generation)) => {
                (*prefix == self.prefix).then(|| generation.clone())
            }
            _ => None,
        }?;
        let absent = matches!(result, ReadResult::Got(None));
        (!self.absent_only || absent).then_some(generation)
    }

    /// When this covering is in force for an answer whose generation is `generation`: the
    /// revision the answer must be known as of (the later of the generation's and the gate's).
    /// With `learning_at`, the index of an answer read from the store in this batch: only if the
    /// generation was read before it, and the gate before the generation.
    fn in_force(
        &self,
        reads: &[Read],
        results: &[ReadResult],
        generation: &str,
        learning_at: Option<usize>,
    ) -> Option<Revision> {
        let upto = learning_at.unwrap_or(reads.len());
        let (position, generation_revision) =
            present_read(&reads[..upto], &results[..upto], generation)?;
        let Some((gate, holds)) = &self.gate else {
            return Some(generation_revision);
        };
        let gate_upto = if learning_at.is_some() {
            position
        } else {
            reads.len()
        };
        reads[..gate_upto]
            .iter()
            .zip(&results[..gate_upto])
            .find_map(|(read, result)| match (read, result) {
                (Read::Get(key), ReadResult::Got(Some(kv))) if key == gate && holds(&kv.value) => {
                    Some(kv.revision.max(generation_revision))
                }
                _ => None,
            })
    }
}

/// Where the batch read `key` present, and its revision.
fn present_read(reads: &[Read], results: &[ReadResult], key: &str) -> Option<(usize, Revision)> {
    reads
        .iter()
        .zip(results)
        .enumerate()
        .find_map(|(index, (read, result))| match (read, result) {
            (Read::Get(k), ReadResult::Got(Some(kv))) if k == key => Some((index, kv.revision)),
            _ => None,
        })
}

/// What is kept.
#[derive(Debug, Default)]
struct Kept {
    /// Keys read or written, with their value and revision (None: absent when read).
    keys: HashMap<String, Option<(Vec<u8>, Revision)>>,
    /// For keys kept: a revision at which the kept value (or absence) was the store's; a key
    /// without one is not known to have been so at any revision.
    keys_current_as_of: HashMap<String, Revision>,
    /// Listings read, by prefix.
    listings: HashMap<String, KeptListing>,
    /// Bytes of the keys, prefixes and values kept.
    bytes: usize,
}

/// The bytes one kept key takes.
fn key_bytes(key: &str, entry: &Option<(Vec<u8>, Revision)>) -> usize {
    key.len() + entry.as_ref().map_or(0, |(v, _)| v.len())
}

impl Kept {
    /// Keeps `entry` for `key`, known to have been the store's at `current_as_of` (NONE: not
    /// known), or at the revision the kept entry was known at when `entry` is that same entry.
    fn keep_key(&mut self, key: &str, entry: Option<(Vec<u8>, Revision)>, current_as_of: Revision) {
        let unchanged = self.keys.get(key) == Some(&entry);
        self.bytes += key_bytes(key, &entry);
        if let Some(old) = self.keys.insert(key.to_owned(), entry) {
            self.bytes -= key_bytes(key, &old);
        }
        let known_before = self
            .keys_current_as_of
            .get(key)
            .copied()
            .filter(|_| unchanged)
            .unwrap_or(Revision::NONE);
        self.set_key_current_as_of(key, known_before.max(current_as_of));
    }

    fn set_key_current_as_of(&mut self, key: &str, current_as_of: Revision) {
        if current_as_of == Revision::NONE {
            self.keys_current_as_of.remove(key);
        } else {
            self.keys_current_as_of
                .insert(key.to_owned(), current_as_of);
        }
    }

    fn forget_key(&mut self, key: &str) {
        if let Some(old) = self.keys.remove(key) {
            self.bytes -= key_bytes(key, &old);
        }
        self.keys_current_as_of.remove(key);
    }

    /// For each of `results` (answers to `reads`), the revision at which it is known to have been
    /// the store's when it is exactly what is kept; NONE otherwise.
    fn current_as_of(&self, reads: &[Read], results: &[ReadResult]) -> Vec<Revision> {
        reads
            .iter()
            .zip(results)
            .map(|(read, result)| match (read, result) {
                (Read::Get(key), ReadResult::Got(got)) => {
                    let answered = got.as_ref().map(|kv| (kv.value.clone(), kv.revision));
                    if self.keys.get(key) == Some(&answered) {
                        self.keys_current_as_of
                            .get(key)
                            .copied()
                            .unwrap_or(Revision::NONE)
                    } else {
                        Revision::NONE
                    }
                }
                (Read::List(prefix), ReadResult::Listed(listed)) => self
                    .listings
                    .get(prefix)
                    .filter(|kept| kept.holds_exactly(listed))
                    .map_or(Revision::NONE, |kept| kept.current_as_of),
                _ => Revision::NONE,
            })
            .collect()
    }

    /// Keeps `listing` under `prefix`; read again unchanged, it keeps the revision the kept one
    /// was known at when that is later than its own.
    fn keep_listing(&mut self, prefix: &str, mut listing: KeptListing) {
        if let Some(kept) = self.listings.get(prefix) {
            if kept.entries == listing.entries {
                listing.current_as_of = listing.current_as_of.max(kept.current_as_of);
            }
        }
        self.bytes += prefix.len() + listing.bytes();
        if let Some(old) = self.listings.insert(prefix.to_owned(), listing) {
            self.bytes -= prefix.len() + old.bytes();
        }
    }

    fn forget_listing(&mut self, prefix: &str) {
        if let Some(old) = self.listings.remove(prefix) {
            self.bytes -= prefix.len() + old.bytes();
        }
    }

    /// The prefixes of the listings kept that `key` is under.
    fn listings_holding(&self, key: &str) -> Vec<String> {
        self.listings
            .keys()
            .filter(|prefix| key.starts_with(prefix.as_str()))
            .cloned()
            .collect()
    }

    fn forget_everything_past_the_limit(&mut self) {
        if self.bytes > MAX_KEPT_BYTES {
            *self = Kept::default();
        }
    }
}

/// Where a [`CachingStore`]'s cached reads were answered: shared (behind an `Arc`) with whoever
/// reports it, such as the agent's metrics.
#[derive(Debug, Default)]
pub struct CacheStats {
    answered_from_cache: AtomicU64,
    read_from_store: AtomicU64,
}

impl CacheStats {
    /// Batches [`KvStore::read_many_cached`] answered from what was kept.
    pub fn answered_from_cache(&self) -> u64 {
        self.answered_from_cache.load(Ordering::Relaxed)
    }

    /// Batches [`KvStore::read_many_cached`] read from the wrapped store: not all known, or
    /// asked of the store by the caller.
    pub fn read_from_store(&self) -> u64 {
        self.read_from_store.load(Ordering::Relaxed)
    }
}

/// A [`KvStore`] over another that keeps what it read and wrote: see the module's documentation.
#[derive(Debug)]
pub struct CachingStore {
    inner: Arc<dyn KvStore>,
    kept: Mutex<Kept>,
    speculating: Vec<String>,
    /// Keys and listings validated by a generation: see [`Covering`].
    covering: Vec<Covering>,
    stats: Arc<CacheStats>,
}

impl CachingStore {
    /// A store over `inner` that has kept nothing yet.
    pub fn new(inner: Arc<dyn KvStore>) -> Self {
        CachingStore {
            inner,
            kept: Mutex::new(Kept::default()),
            speculating: Vec::new(),
            covering: Vec::new(),
            stats: Arc::default(),
        }
    }

    /// Counts where its cached reads are answered into `stats` (see [`CacheStats`]).
    pub fn counting_into(mut self, stats: Arc<CacheStats>) -> Self {
        self.stats = stats;
        self
    }

    /// Answers a key under `prefix` that it does not know as absent (validated by an "absent"
    /// condition), instead of reading the batch from the store.
    pub fn speculating_absent_under(mut self, prefix: impl Into<String>) -> Self {
        self.speculating.push(prefix.into());
        self
    }

    /// Trusts every transaction that writes under `prefix` to write `generation` too, so that a
    /// listing of `prefix` known as of the generation's revision or later is validated by the
    /// generation alone (see the module's documentation). Only for a prefix whose every writer
    /// keeps that promise.
    pub fn covering(self, prefix: impl Into<String>, generation: impl Into<String>) -> Self {
        self.with_covering(Covering::listing(prefix, generation))
    }

    /// Adds `covering` (see [`Covering`]).
    pub fn with_covering(mut self, covering: Covering) -> Self {
        self.covering.push(covering);
        self
    }

    /// The indexes of the answers among `results` validated by their generation: each a key or
    /// listing a [`Covering`] applies to, in force in this batch (its gate read holding), whose
    /// generation the batch read present, known (`current_as_of`) as of the later of the
    /// generation's and the gate's revisions or later.
    fn covered(
        &self,
        reads: &[Read],
        results: &[ReadResult],
        current_as_of: &[Revision],
    ) -> Vec<usize> {
        let mut covered = Vec::new();
        for (index, (read, result)) in reads.iter().zip(results).enumerate() {
            let Some(known_as_of) = current_as_of
                .get(index)
                .copied()
                .filter(|r| *r != Revision::NONE)
            else {
                continue;
            };
            let is_covered = self.covering.iter().any(|covering| {
                covering
                    .generation_of(read, result)
                    .and_then(|generation| covering.in_force(reads, results, &generation, None))
                    .is_some_and(|needed| known_as_of >= needed)
            });
            if is_covered {
                covered.push(index);
            }
        }
        covered
    }

    /// The validators of `results`, those of listings their generation covers left out.
    fn validators(
        &self,
        reads: &[Read],
        results: &[ReadResult],
        current_as_of: &[Revision],
    ) -> Option<Vec<Condition>> {
        validators_except(reads, results, &self.covered(reads, results, current_as_of))
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn KvStore> {
        &self.inner
    }

    /// How many batches [`KvStore::read_many_cached`] answered from what was kept.
    pub fn answered_from_cache(&self) -> u64 {
        self.stats.answered_from_cache()
    }

    /// Forgets everything kept.
    pub fn forget(&self) {
        *self.lock() = Kept::default();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        // What is kept is only ever a guess the store checks: a panic while it was held leaves
        // nothing a later caller could trust less than any other guess.
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Learns the answers of a batch read from the store.
    fn learn(&self, reads: &[Read], results: &[ReadResult]) {
        let mut kept = self.lock();
        for (read, result) in reads.iter().zip(results) {
            match (read, result) {
                // A key read present was the store's from its last write on; one read absent,
                // from a time not known.
                (Read::Get(key), ReadResult::Got(got)) => kept.keep_key(
                    key,
                    got.as_ref().map(|kv| (kv.value.clone(), kv.revision)),
                    got.as_ref().map_or(Revision::NONE, |kv| kv.revision),
                ),
                (Read::List(prefix), ReadResult::Listed(listed)) => {
                    if listed.len() < MAX_VALIDATORS {
                        kept.keep_listing(prefix, KeptListing::from_listed(listed));
                    } else {
                        // Too many keys to validate: never answered from what is kept, and
                        // what was kept of it is stale.
                        kept.forget_listing(prefix);
                    }
                }
                _ => {}
            }
        }
        // A covered key or listing read after its generation (and a gated covering's generation
        // after its gate), in one batch: nothing was written there between the generation's
        // revision and the read, or the generation would be later (and the read found its
        // writes: its generation's validator then fails).
        for (index, (read, result)) in reads.iter().zip(results).enumerate() {
            let known_as_of = self
                .covering
                .iter()
                .filter_map(|covering| {
                    let generation = covering.generation_of(read, result)?;
                    covering.in_force(reads, results, &generation, Some(index))
                })
                .max();
            let Some(known_as_of) = known_as_of else {
                continue;
            };
            match read {
                Read::Get(key) if kept.keys.contains_key(key) => {
                    let kept_as_of = kept
                        .keys_current_as_of
                        .get(key)
                        .copied()
                        .unwrap_or(Revision::NONE);
                    kept.set_key_current_as_of(key, kept_as_of.max(known_as_of));
                }
                Read::List(prefix) => {
                    // The listing this batch read (one too long to keep was forgotten above).
                    if let Some(listing) = kept.listings.get_mut(prefix) {
                        listing.current_as_of = listing.current_as_of.max(known_as_of);
                    }
                }
                _ => {}
            }
        }
        kept.forget_everything_past_the_limit();
    }

    /// The answers of `reads` from what is kept; None when one of them is not known.
    fn answer_from_kept(&self, reads: &[Read]) -> Option<Vec<ReadResult>> {
        let kept = self.lock();
        let mut results = Vec::with_capacity(reads.len());
        for read in reads {
            match read {
                Read::Get(key) => {
                    let entry = match kept.keys.get(key) {
                        Some(entry) => entry.clone(),
                        None if self.speculating.iter().any(|p| key.starts_with(p.as_str())) => {
                            None
                        }
                        None => return None,
                    };
                    results.push(ReadResult::Got(entry.map(|(value, revision)| KeyValue {
                        key: key.clone(),
                        value,
                        revision,
                    })));
                }
                Read::List(prefix) => {
                    results.push(ReadResult::Listed(kept.listings.get(prefix)?.listed()));
                }
                Read::Range { .. } => return None,
            }
        }
        Some(results)
    }

    /// Brings what is kept up to date with `txn`, committed at `revision`.
    fn learn_commit(&self, txn: &Txn, revision: Revision) {
        let mut kept = self.lock();
        // What the transaction found as kept, by its conditions, was still the store's at its
        // revision: the keys it tested at their kept state, and the listings whose prefix it
        // tested at their newest revision with every listed key tested or written.
        let written: std::collections::HashSet<&str> = txn.ops.iter().map(|op| op.key()).collect();
        let tested_keys: Vec<String> = txn
            .conditions
            .iter()
            .filter(|c| match c {
                Condition::AtRevision { key, revision } => {
                    matches!(kept.keys.get(key), Some(Some((_, r))) if r == revision)
                }
                Condition::Absent { key } => matches!(kept.keys.get(key), Some(None)),
                Condition::NoPutAfter { .. } => false,
            })
            .map(|c| c.key().to_owned())
            .collect();
        let proven_listings: std::collections::HashSet<String> = kept
            .listings
            .iter()
            .filter(|(prefix, listing)| {
                txn.conditions.iter().any(|c| {
                    matches!(c, Condition::NoPutAfter { prefix: p, revision: r }
                        if p == *prefix && *r == listing.newest)
                }) && listing.entries.iter().all(|(key, (_, listed_at))| {
                    written.contains(key.as_str())
                        || txn
                            .conditions
                            .contains(&Condition::at_revision(key, *listed_at))
                })
            })
            .map(|(prefix, _)| prefix.clone())
            .collect();
        for key in &tested_keys {
            let entry = kept.keys.get(key).cloned().flatten();
            kept.keep_key(key, entry, revision);
        }
        // A key put or deleted is exactly what this transaction left, whatever was there.
        for op in &txn.ops {
            match op {
                Op::Put { key, value } => {
                    kept.keep_key(key, Some((value.clone(), revision)), revision);
                }
                Op::Delete { key } => kept.forget_key(key),
            }
        }
        for prefix in &proven_listings {
            if let Some(listing) = kept.listings.get_mut(prefix) {
                listing.current_as_of = listing.current_as_of.max(revision);
            }
        }
        // A listing the transaction writes under stays exact only if the transaction proved
        // that nothing was put there since it was read (its own validator held).
        let written: BTreeMap<String, Vec<&Op>> = kept
            .listings
            .keys()
            .map(|prefix| {
                let writes = txn
                    .ops
                    .iter()
                    .filter(|op| op.key().starts_with(prefix.as_str()))
                    .collect::<Vec<_>>();
                (prefix.clone(), writes)
            })
            .filter(|(_, writes)| !writes.is_empty())
            .collect();
        for (prefix, writes) in written {
            let Some(mut listing) = kept.listings.get(&prefix).cloned() else {
                continue;
            };
            let proven = txn.conditions.iter().any(|c| {
                matches!(c, Condition::NoPutAfter { prefix: p, revision: r }
                    if *p == prefix && *r == listing.newest)
            });
            if !proven {
                kept.forget_listing(&prefix);
                continue;
            }
            // Written under, it is known as of this revision only if proven above.
            listing.current_as_of = if proven_listings.contains(&prefix) {
                revision
            } else {
                Revision::NONE
            };
            for op in writes {
                match op {
                    Op::Put { key, value } => {
                        listing
                            .entries
                            .insert(key.clone(), (value.clone(), revision));
                        listing.newest = listing.newest.max(revision);
                    }
                    Op::Delete { key } => {
                        listing.entries.remove(key);
                    }
                }
            }
            if listing.entries.len() < MAX_VALIDATORS {
                kept.keep_listing(&prefix, listing);
            } else {
                kept.forget_listing(&prefix);
            }
        }
        kept.forget_everything_past_the_limit();
    }

    /// Forgets what a failed transaction's conditions tested: at least one of them is stale.
    fn unlearn_conditions(&self, txn: &Txn) {
        let mut kept = self.lock();
        for condition in &txn.conditions {
            if condition.tests_a_prefix() {
                kept.forget_listing(condition.key());
            } else {
                kept.forget_key(condition.key());
                for prefix in kept.listings_holding(condition.key()) {
                    kept.forget_listing(&prefix);
                }
            }
        }
    }
}

#[async_trait]
impl KvStore for CachingStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        let got = self.inner.get(key).await?;
        self.learn(
            &[Read::Get(key.to_owned())],
            &[ReadResult::Got(got.clone())],
        );
        Ok(got)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        let listed = self.inner.list(prefix).await?;
        self.learn(
            &[Read::List(prefix.to_owned())],
            &[ReadResult::Listed(listed.clone())],
        );
        Ok(listed)
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        match self.inner.commit(txn.clone()).await {
            Ok(revision) => {
                self.learn_commit(&txn, revision);
                Ok(revision)
            }
            Err(e @ KvError::Conflict { .. }) => {
                self.unlearn_conditions(&txn);
                Err(e)
            }
            Err(e) => {
                // The write may have landed, or the store may be another one now.
                self.forget();
                Err(e)
            }
        }
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        let results = self.inner.read_many(reads).await?;
        self.learn(reads, &results);
        Ok(results)
    }

    async fn read_many_cached(
        &self,
        reads: &[Read],
        may_use_cache: bool,
    ) -> Result<CachedRead, KvError> {
        for read in reads {
            read.validate()?;
        }
        if may_use_cache {
            if let Some(results) = self.answer_from_kept(reads) {
                let current_as_of = self.lock().current_as_of(reads, &results);
                if let Some(validators) = self.validators(reads, &results, &current_as_of) {
                    self.stats
                        .answered_from_cache
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(CachedRead {
                        results,
                        validators,
                        from_cache: true,
                        current_as_of,
                    });
                }
            }
        }
        let results = self.read_many(reads).await?;
        self.stats.read_from_store.fetch_add(1, Ordering::Relaxed);
        let current_as_of = self.lock().current_as_of(reads, &results);
        Ok(CachedRead {
            validators: self
                .validators(reads, &results, &current_as_of)
                .unwrap_or_default(),
            current_as_of,
            results,
            from_cache: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::counting::CountingStore;
    use crate::kv::memory::MemoryStore;

    /// A caching store over a counting one over `backing`, with handles under `h/` speculated.
    fn cached_over(backing: &Arc<MemoryStore>) -> (CachingStore, Arc<CountingStore>) {
        let counting = Arc::new(CountingStore::new(Arc::clone(backing) as Arc<dyn KvStore>));
        let cached = CachingStore::new(Arc::clone(&counting) as Arc<dyn KvStore>)
            .speculating_absent_under("h/");
        (cached, counting)
    }

    fn batch() -> Vec<Read> {
        vec![
            Read::List("blocks/".into()),
            Read::Get("config".into()),
            Read::Get("h/new-pod".into()),
        ]
    }

    async fn store_with_blocks() -> Arc<MemoryStore> {
        let backing = Arc::new(MemoryStore::new());
        backing.put("blocks/a", b"a0".to_vec()).await.expect("put");
        backing.put("blocks/b", b"b0".to_vec()).await.expect("put");
        backing.put("config", b"c0".to_vec()).await.expect("put");
        backing
    }

    /// A transaction decided from `answered`, carrying its validators.
    fn decided_from(answered: &CachedRead, writes: Txn) -> Txn {
        let mut txn = writes;
        for validator in answered.validators.clone() {
            if !txn.conditions.iter().any(|c| {
                c.key() == validator.key() && c.tests_a_prefix() == validator.tests_a_prefix()
            }) {
                txn.conditions.push(validator);
            }
        }
        txn
    }

    #[tokio::test]
    async fn shared_stats_count_where_each_cached_read_was_answered() {
        let backing = store_with_blocks().await;
        let stats = Arc::new(CacheStats::default());
        let cached = CachingStore::new(Arc::clone(&backing) as Arc<dyn KvStore>)
            .counting_into(Arc::clone(&stats));
        cached.read_many_cached(&batch(), true).await.expect("read");
        assert_eq!(
            (stats.answered_from_cache(), stats.read_from_store()),
            (0, 1)
        );
        cached.read_many_cached(&batch(), true).await.expect("read");
        cached.read_many_cached(&batch(), true).await.expect("read");
        assert_eq!(
            (stats.answered_from_cache(), stats.read_from_store()),
            (2, 1)
        );
        // A caller that asks the store is counted there, though the cache knows the batch.
        cached
            .read_many_cached(&batch(), false)
            .await
            .expect("read");
        assert_eq!(
            (stats.answered_from_cache(), stats.read_from_store()),
            (2, 2)
        );
        // A plain read is not a cached read.
        cached.read_many(&batch()).await.expect("read");
        assert_eq!(
            (stats.answered_from_cache(), stats.read_from_store()),
            (2, 2)
        );
        assert_eq!(cached.answered_from_cache(), 2);
    }

    #[tokio::test]
    async fn a_batch_read_once_is_answered_again_without_the_store_with_its_validators() {
        let backing = store_with_blocks().await;
        let (cached, counting) = cached_over(&backing);
        let first = cached
            .read_many_cached(&batch(), true)
            .await
            .expect("first read");
        assert!(!first.from_cache, "nothing kept yet: read from the store");
        assert_eq!(counting.take().reads, 1);
        let again = cached
            .read_many_cached(&batch(), true)
            .await
            .expect("again");
        assert!(again.from_cache);
        assert_eq!(again.results, first.results);
        assert_eq!(first.validators, again.validators, "the same conditions");
        assert_eq!(counting.take().reads, 0, "answered from what was kept");
        // A handle never read is taken for absent.
        let mut with_new_handle = batch();
        with_new_handle.push(Read::Get("h/another-pod".into()));
        let speculated = cached
            .read_many_cached(&with_new_handle, true)
            .await
            .expect("speculated");
        assert!(speculated.from_cache);
        assert_eq!(speculated.results[3], ReadResult::Got(None));
        assert!(speculated
            .validators
            .contains(&Condition::absent("h/another-pod")));
        assert_eq!(counting.take().reads, 0);
        // Not allowed to use the cache: read from the store.
        let fresh = cached
            .read_many_cached(&batch(), false)
            .await
            .expect("fresh");
        assert!(!fresh.from_cache);
        assert_eq!(counting.take().reads, 1);
        let a = backing
            .get("blocks/a")
            .await
            .expect("get")
            .expect("a")
            .revision;
        let b = backing
            .get("blocks/b")
            .await
            .expect("get")
            .expect("b")
            .revision;
        let config = backing
            .get("config")
            .await
            .expect("get")
            .expect("c")
            .revision;
        let mut validators = again.validators.clone();
        validators
            .sort_by(|x, y| (x.key(), x.tests_a_prefix()).cmp(&(y.key(), y.tests_a_prefix())));
        assert_eq!(
            validators,
            vec![
                Condition::no_put_after("blocks/", b),
                Condition::at_revision("blocks/a", a),
                Condition::at_revision("blocks/b", b),
                Condition::at_revision("config", config),
                Condition::absent("h/new-pod"),
            ]
        );
        // A commit decided from it applies while nothing changed.
        let txn = decided_from(
            &again,
            Txn::new()
                .when(Condition::at_revision("blocks/a", a))
                .then(Op::put("blocks/a", b"a1".to_vec()))
                .then(Op::put("h/new-pod", b"h".to_vec())),
        );
        cached.commit(txn).await.expect("commit");
        // What it wrote is kept: the next batch (the handle now present) needs no read either.
        let after = cached
            .read_many_cached(&batch(), true)
            .await
            .expect("after");
        assert!(after.from_cache);
        assert_eq!(
            counting.take(),
            crate::kv::counting::RoundTrips {
                reads: 0,
                commits: 1
            }
        );
        assert_eq!(
            after.results,
            backing.read_many(&batch()).await.expect("truth")
        );
    }

    #[tokio::test]
    async fn every_change_by_another_writer_fails_the_commit_and_the_next_read_goes_to_the_store() {
        let changes: Vec<(&str, Txn)> = vec![
            (
                "a listed key rewritten",
                Txn::new().then(Op::put("blocks/a", b"x".to_vec())),
            ),
            (
                "a key added under the prefix",
                Txn::new().then(Op::put("blocks/c", b"x".to_vec())),
            ),
            (
                "a listed key deleted",
                Txn::new().then(Op::delete("blocks/b")),
            ),
            (
                "a got key rewritten",
                Txn::new().then(Op::put("config", b"x".to_vec())),
            ),
            (
                "a speculated key written",
                Txn::new().then(Op::put("h/new-pod", b"x".to_vec())),
            ),
        ];
        for (what, change) in changes {
            let backing = store_with_blocks().await;
            let (cached, counting) = cached_over(&backing);
            cached.read_many(&batch()).await.expect("warm");
            let answered = cached
                .read_many_cached(&batch(), true)
                .await
                .expect("cached");
            assert!(answered.from_cache, "{what}: answered from the cache");
            backing.commit(change).await.expect("another writer");
            let before = backing.list("").await.expect("list");
            let txn = decided_from(&answered, Txn::new().then(Op::put("out", b"o".to_vec())));
            let refused = cached.commit(txn).await;
            assert!(
                matches!(refused, Err(KvError::Conflict { .. })),
                "{what}: {refused:?}"
            );
            assert_eq!(
                backing.list("").await.expect("list"),
                before,
                "{what}: nothing written"
            );
            counting.take();
            let fresh = cached
                .read_many_cached(&batch(), true)
                .await
                .expect("fresh");
            assert!(
                !fresh.from_cache,
                "{what}: the stale answer is not given again"
            );
            assert_eq!(counting.take().reads, 1, "{what}");
            assert_eq!(
                fresh.results,
                backing.read_many(&batch()).await.expect("truth"),
                "{what}"
            );
        }
    }

    #[tokio::test]
    async fn a_batch_with_an_unknown_key_or_a_range_is_read_from_the_store() {
        let backing = store_with_blocks().await;
        let (cached, counting) = cached_over(&backing);
        cached.read_many(&batch()).await.expect("warm");
        counting.take();
        for extra in [
            Read::Get("never-read".into()),
            Read::range("blocks/", "", 1),
        ] {
            let mut reads = batch();
            reads.push(extra.clone());
            let answered = cached.read_many_cached(&reads, true).await.expect("read");
            assert!(!answered.from_cache, "{extra:?}");
            assert_eq!(counting.take().reads, 1, "{extra:?}");
        }
    }

    #[tokio::test]
    async fn a_listing_written_under_without_its_validator_is_forgotten() {
        let backing = store_with_blocks().await;
        let (cached, counting) = cached_over(&backing);
        cached.read_many(&batch()).await.expect("warm");
        // Another writer adds a key; then this store writes under the prefix unconditioned: the
        // listing kept cannot be brought up to date, so it is not answered from again.
        backing
            .put("blocks/c", b"c".to_vec())
            .await
            .expect("another writer");
        cached
            .commit(Txn::new().then(Op::put("blocks/d", b"d".to_vec())))
            .await
            .expect("commit");
        counting.take();
        let answered = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(!answered.from_cache);
        assert_eq!(counting.take().reads, 1);
        assert_eq!(
            answered.results,
            backing.read_many(&batch()).await.expect("truth")
        );
    }

    #[tokio::test]
    async fn rewriting_one_key_many_times_keeps_what_else_was_kept() {
        let backing = store_with_blocks().await;
        let (cached, counting) = cached_over(&backing);
        cached.read_many(&batch()).await.expect("warm");
        // 5,000 rewrites of 4 KiB: 20 MiB written in all, one value kept at a time.
        for n in 0..5_000u32 {
            let mut value = vec![0u8; 4096];
            value[..4].copy_from_slice(&n.to_be_bytes());
            cached
                .commit(Txn::new().then(Op::put("elsewhere/counter", value)))
                .await
                .expect("commit");
        }
        counting.take();
        let answered = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(answered.from_cache, "what was kept was forgotten");
        assert_eq!(counting.take().reads, 0);
    }

    /// A store that applies each commit but answers it as of unknown outcome.
    #[derive(Debug, Default)]
    struct LandsButSaysUnknown {
        inner: MemoryStore,
    }

    #[async_trait]
    impl KvStore for LandsButSaysUnknown {
        async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
            self.inner.get(key).await
        }

        async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
            self.inner.list(prefix).await
        }

        async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
            self.inner.commit(txn).await?;
            Err(KvError::Indeterminate {
                message: "the answer was lost".into(),
            })
        }

        async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
            self.inner.read_many(reads).await
        }
    }

    #[tokio::test]
    async fn after_a_commit_of_unknown_outcome_nothing_kept_is_answered() {
        let backing = Arc::new(LandsButSaysUnknown::default());
        backing
            .inner
            .put("blocks/a", b"a0".to_vec())
            .await
            .expect("put");
        let cached = CachingStore::new(Arc::clone(&backing) as Arc<dyn KvStore>);
        let reads = [Read::List("blocks/".into()), Read::Get("blocks/a".into())];
        cached.read_many(&reads).await.expect("warm");
        let outcome = cached
            .commit(Txn::new().then(Op::put("blocks/a", b"a1".to_vec())))
            .await;
        assert!(
            matches!(outcome, Err(KvError::Indeterminate { .. })),
            "{outcome:?}"
        );
        let answered = cached.read_many_cached(&reads, true).await.expect("read");
        assert!(!answered.from_cache);
        assert_eq!(
            answered.results,
            backing.inner.read_many(&reads).await.expect("truth")
        );
    }

    #[tokio::test]
    async fn answers_from_the_cache_after_its_own_writes_are_the_stores() {
        let backing = store_with_blocks().await;
        let (cached, _counting) = cached_over(&backing);
        cached.read_many(&batch()).await.expect("warm");
        let answered = cached.read_many_cached(&batch(), true).await.expect("read");
        // Its own writes, carrying the validators: a put and a delete under the listing, the
        // configuration deleted.
        let txn = decided_from(
            &answered,
            Txn::new()
                .then(Op::put("blocks/c", b"c".to_vec()))
                .then(Op::delete("blocks/a"))
                .then(Op::delete("config")),
        );
        cached.commit(txn).await.expect("commit");
        let after = cached
            .read_many_cached(&batch(), true)
            .await
            .expect("after");
        assert_eq!(
            after.results,
            backing.read_many(&batch()).await.expect("truth")
        );
    }

    #[tokio::test]
    async fn a_batch_whose_kept_answers_disagree_on_a_key_is_read_from_the_store() {
        let backing = store_with_blocks().await;
        let (cached, counting) = cached_over(&backing);
        let reads = [Read::List("blocks/".into()), Read::Get("blocks/a".into())];
        cached.read_many(&reads).await.expect("warm");
        // Another writer rewrites a listed key; this store then reads that key alone: the
        // listing kept shows it at its old revision, the key at its new one.
        backing
            .put("blocks/a", b"a1".to_vec())
            .await
            .expect("another writer");
        cached.get("blocks/a").await.expect("get");
        counting.take();
        let answered = cached.read_many_cached(&reads, true).await.expect("read");
        assert!(!answered.from_cache, "answered from two different moments");
        assert_eq!(counting.take().reads, 1);
        assert_eq!(
            answered.results,
            backing.read_many(&reads).await.expect("truth")
        );
    }

    #[tokio::test]
    async fn a_failed_condition_on_a_listed_key_forgets_the_listing() {
        let backing = store_with_blocks().await;
        let (cached, _counting) = cached_over(&backing);
        let reads = [Read::List("blocks/".into())];
        cached.read_many(&reads).await.expect("warm");
        let stale = backing
            .get("blocks/a")
            .await
            .expect("get")
            .expect("a")
            .revision;
        backing
            .put("blocks/a", b"a1".to_vec())
            .await
            .expect("another writer");
        // A transaction conditioned on the listed key alone (no validator of the listing).
        let refused = cached
            .commit(
                Txn::new()
                    .when(Condition::at_revision("blocks/a", stale))
                    .then(Op::put("out", b"o".to_vec())),
            )
            .await;
        assert!(
            matches!(refused, Err(KvError::Conflict { .. })),
            "{refused:?}"
        );
        let answered = cached.read_many_cached(&reads, true).await.expect("read");
        assert!(!answered.from_cache, "the stale listing was answered");
        assert_eq!(
            answered.results,
            backing.read_many(&reads).await.expect("truth")
        );
    }

    #[tokio::test]
    async fn what_is_kept_counts_its_bytes_exactly_and_is_forgotten_past_its_bound() {
        let backing = store_with_blocks().await;
        let (cached, counting) = cached_over(&backing);
        cached.read_many(&batch()).await.expect("warm");
        let big = vec![7u8; 8 * 1024];
        // Churn that keeps little at a time: 24 MiB put and deleted, a listing of 8 KiB read
        // again 3,000 times.
        backing.put("wide/one", big.clone()).await.expect("put");
        for _ in 0..3_000 {
            cached
                .commit(Txn::new().then(Op::put("big/k", big.clone())))
                .await
                .expect("put");
            cached
                .commit(Txn::new().then(Op::delete("big/k")))
                .await
                .expect("delete");
            cached
                .read_many(&[Read::List("wide/".into())])
                .await
                .expect("list");
        }
        // 8 MiB kept at once, half the bound.
        let mebibyte = vec![1u8; 1024 * 1024];
        for n in 0..8 {
            cached
                .commit(Txn::new().then(Op::put(format!("large/{n}"), mebibyte.clone())))
                .await
                .expect("put");
        }
        counting.take();
        let answered = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(answered.from_cache, "forgotten below the bound");
        // 9 MiB more, kept at once: past the bound, everything is forgotten.
        for n in 8..17 {
            cached
                .commit(Txn::new().then(Op::put(format!("large/{n}"), mebibyte.clone())))
                .await
                .expect("put");
        }
        let answered = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(!answered.from_cache, "kept past the bound");
        // Keys written twice count once: 15 MiB written twice is 15 MiB kept, below the bound;
        // 2 MiB more is past it.
        cached.forget();
        cached.read_many(&batch()).await.expect("warm again");
        for _ in 0..2 {
            for n in 0..15 {
                cached
                    .commit(Txn::new().then(Op::put(format!("large/{n}"), mebibyte.clone())))
                    .await
                    .expect("put");
            }
        }
        let answered = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(answered.from_cache, "a rewritten key counted twice");
        for n in 15..17 {
            cached
                .commit(Txn::new().then(Op::put(format!("large/{n}"), mebibyte.clone())))
                .await
                .expect("put");
        }
        let answered = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(!answered.from_cache, "rewritten keys counted short");
        // Listings count their keys and values: 9 listings of one 1 MiB key each, read twice,
        // are below the bound; 17 MiB of listings are past it.
        cached.read_many(&batch()).await.expect("warm again");
        for _ in 0..2 {
            for n in [0, 2, 3, 4, 5, 6, 7, 8, 9] {
                cached
                    .read_many(&[Read::List(format!("large/{n}"))])
                    .await
                    .expect("list");
            }
        }
        let answered = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(answered.from_cache, "listings counted more than they hold");
        // Listings count too: 17 listings of 1 MiB and more, past the bound.
        cached.read_many(&batch()).await.expect("warm again");
        for n in 0..17 {
            cached
                .read_many(&[Read::List(format!("large/{n}"))])
                .await
                .expect("list");
        }
        let answered = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(!answered.from_cache, "listings kept past the bound");
        // Small listings do not fill it.
        cached.read_many(&batch()).await.expect("warm again");
        for n in 0..17 {
            cached
                .read_many(&[Read::List(format!("large/{n}/"))])
                .await
                .expect("list");
        }
        let answered = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(answered.from_cache, "empty listings are small");
    }

    #[tokio::test]
    async fn plain_reads_answer_from_the_store_and_teach_the_cache() {
        let backing = store_with_blocks().await;
        let (cached, counting) = cached_over(&backing);
        assert_eq!(
            cached.get("config").await.expect("get"),
            backing.get("config").await.expect("truth")
        );
        assert_eq!(
            cached.list("blocks/").await.expect("list"),
            backing.list("blocks/").await.expect("truth")
        );
        assert_eq!(counting.take().reads, 2);
        let reads = [Read::List("blocks/".into()), Read::Get("config".into())];
        let answered = cached.read_many_cached(&reads, true).await.expect("read");
        assert!(answered.from_cache, "learned from the plain reads");
        assert_eq!(counting.take().reads, 0);
        assert_eq!(
            answered.results,
            backing.read_many(&reads).await.expect("truth")
        );
    }

    #[tokio::test]
    async fn a_listing_too_long_to_validate_is_not_kept() {
        let backing = Arc::new(MemoryStore::new());
        for n in 0..MAX_VALIDATORS {
            backing
                .put(&format!("blocks/{n:03}"), Vec::new())
                .await
                .expect("put");
        }
        let (cached, counting) = cached_over(&backing);
        let reads = [Read::List("blocks/".into())];
        cached.read_many(&reads).await.expect("warm");
        counting.take();
        let answered = cached.read_many_cached(&reads, true).await.expect("read");
        assert!(!answered.from_cache);
        assert!(answered.validators.is_empty(), "too many to carry");
        assert_eq!(counting.take().reads, 1);
        assert!(
            !cached.lock().listings.contains_key("blocks/"),
            "a listing that can never be validated takes room"
        );
        // One key fewer: its validators fit, it is kept and answered.
        backing
            .delete(&format!("blocks/{:03}", MAX_VALIDATORS - 1))
            .await
            .expect("delete");
        cached.read_many(&reads).await.expect("warm");
        assert!(cached.lock().listings.contains_key("blocks/"));
        assert!(
            cached
                .read_many_cached(&reads, true)
                .await
                .expect("read")
                .from_cache
        );
    }

    /// The bytes `kept` holds, counted from what it holds.
    fn recounted(kept: &Kept) -> usize {
        kept.keys
            .iter()
            .map(|(key, entry)| key_bytes(key, entry))
            .chain(
                kept.listings
                    .iter()
                    .map(|(prefix, listing)| prefix.len() + listing.bytes()),
            )
            .sum()
    }

    #[tokio::test]
    async fn the_byte_count_follows_every_key_and_listing_kept_and_forgotten() {
        let backing = store_with_blocks().await;
        let (cached, _counting) = cached_over(&backing);
        let assert_counted = |step: &str| {
            let kept = cached.lock();
            assert_eq!(kept.bytes, recounted(&kept), "after {step}");
        };
        cached.read_many(&batch()).await.expect("warm");
        cached
            .read_many(&[Read::List("other/".into())])
            .await
            .expect("list");
        assert_counted("reading keys and listings");
        assert!(cached.lock().bytes > 0);
        // A listing written under without its validator is forgotten.
        cached
            .commit(Txn::new().then(Op::put("blocks/c", b"c0".to_vec())))
            .await
            .expect("put");
        assert!(!cached.lock().listings.contains_key("blocks/"));
        assert_counted("a listing forgotten by a commit");
        // A failed condition on a listing's prefix forgets it, and its key.
        cached.read_many(&batch()).await.expect("warm");
        backing
            .put("blocks/d", b"d0".to_vec())
            .await
            .expect("another writer");
        let refused = cached
            .commit(
                Txn::new()
                    .when(Condition::no_put_after("blocks/", Revision::NONE))
                    .when(Condition::at_revision("config", Revision(1)))
                    .then(Op::put("out", b"o".to_vec())),
            )
            .await;
        assert!(matches!(refused, Err(KvError::Conflict { .. })));
        assert!(!cached.lock().listings.contains_key("blocks/"));
        assert!(!cached.lock().keys.contains_key("config"));
        assert_counted("a listing and a key forgotten by a failed condition");
        // A key deleted by a commit.
        cached
            .commit(Txn::new().then(Op::delete("blocks/c")))
            .await
            .expect("delete");
        assert_counted("a key deleted");
        cached.forget();
        assert_eq!(cached.lock().bytes, 0);
    }

    #[test]
    fn exactly_the_bound_is_kept_and_one_byte_more_is_not() {
        let mut kept = Kept::default();
        let value = vec![0u8; MAX_KEPT_BYTES - "k".len() - 1];
        kept.keep_key("k", Some((value, Revision(1))), Revision(1));
        kept.keep_key("j", None, Revision::NONE);
        assert_eq!(kept.bytes, MAX_KEPT_BYTES);
        kept.forget_everything_past_the_limit();
        assert_eq!(kept.keys.len(), 2, "forgotten at the bound");
        kept.keep_key("i", None, Revision::NONE);
        kept.forget_everything_past_the_limit();
        assert!(kept.keys.is_empty(), "kept past the bound");
        assert_eq!(kept.bytes, 0);
    }

    #[tokio::test]
    async fn a_listing_its_own_commits_grow_past_what_can_be_validated_is_forgotten() {
        let backing = Arc::new(MemoryStore::new());
        for n in 0..MAX_VALIDATORS - 2 {
            backing
                .put(&format!("blocks/{n:03}"), Vec::new())
                .await
                .expect("put");
        }
        let (cached, _counting) = cached_over(&backing);
        let reads = [Read::List("blocks/".into())];
        cached.read_many(&reads).await.expect("warm");
        let put_under_the_listing = |key: &str| {
            let newest = cached.lock().listings["blocks/"].newest;
            Txn::new()
                .when(Condition::no_put_after("blocks/", newest))
                .then(Op::put(key, Vec::new()))
        };
        // Grown to one key fewer than the validators' room: still kept, and answered.
        let grown = put_under_the_listing("blocks/new-1");
        cached.commit(grown).await.expect("put");
        assert_eq!(
            cached.lock().listings["blocks/"].entries.len(),
            MAX_VALIDATORS - 1
        );
        let answered = cached.read_many_cached(&reads, true).await.expect("read");
        assert!(answered.from_cache);
        assert_eq!(
            answered.results,
            backing.read_many(&reads).await.expect("truth")
        );
        // One more: its validators would not fit, it is forgotten.
        let grown = put_under_the_listing("blocks/new-2");
        cached.commit(grown).await.expect("put");
        assert!(!cached.lock().listings.contains_key("blocks/"));
        let kept = cached.lock();
        assert_eq!(kept.bytes, recounted(&kept));
    }

    #[tokio::test]
    async fn each_answer_is_known_current_as_of_its_last_write_or_the_last_commit_that_tested_it() {
        let backing = store_with_blocks().await;
        let (cached, _) = cached_over(&backing);
        let config_at = backing
            .get("config")
            .await
            .expect("get")
            .expect("config")
            .revision;
        let read = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(!read.from_cache);
        // A listing read from the store and a key read absent: not known at any revision (a
        // deletion leaves none); a key read present: from its last write on.
        assert_eq!(
            read.current_as_of,
            vec![Revision::NONE, config_at, Revision::NONE]
        );
        let committed = cached
            .commit(decided_from(
                &read,
                Txn::new().then(Op::put("h/new-pod", b"h".to_vec())),
            ))
            .await
            .expect("commit");
        let again = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(again.from_cache);
        assert_eq!(again.current_as_of, vec![committed; 3]);
        // Another writer's unrelated write changes nothing of it.
        backing.put("other", b"o".to_vec()).await.expect("put");
        let again = cached.read_many_cached(&batch(), true).await.expect("read");
        assert_eq!(again.current_as_of, vec![committed; 3]);
        // Read again from the store unchanged, each answer keeps the later revision.
        let from_store = cached
            .read_many_cached(&batch(), false)
            .await
            .expect("read");
        assert!(!from_store.from_cache);
        assert_eq!(from_store.current_as_of, vec![committed; 3]);
        // Changed by another writer, a key is known from its new write on; a listing, at none.
        let config_now = backing.put("config", b"c1".to_vec()).await.expect("put");
        backing.delete("blocks/b").await.expect("delete");
        let changed = cached
            .read_many_cached(&batch(), false)
            .await
            .expect("read");
        assert_eq!(
            changed.current_as_of,
            vec![Revision::NONE, config_now, committed]
        );
    }

    #[tokio::test]
    async fn a_listing_is_known_current_only_when_a_commit_tested_its_prefix_and_every_listed_key()
    {
        let backing = store_with_blocks().await;
        let (cached, _) = cached_over(&backing);
        cached.read_many_cached(&batch(), true).await.expect("read");
        let a_at = backing
            .get("blocks/a")
            .await
            .expect("get")
            .expect("a")
            .revision;
        let newest = backing
            .get("blocks/b")
            .await
            .expect("get")
            .expect("b")
            .revision;
        // Written under with its prefix tested but not blocks/b: kept, known at no revision.
        cached
            .commit(
                Txn::new()
                    .when(Condition::no_put_after("blocks/", newest))
                    .when(Condition::at_revision("blocks/a", a_at))
                    .then(Op::put("blocks/a", b"a1".to_vec())),
            )
            .await
            .expect("commit");
        let partly = cached.read_many_cached(&batch(), true).await.expect("read");
        assert!(partly.from_cache, "the listing is kept");
        assert_eq!(partly.current_as_of[0], Revision::NONE);
        // Tested whole (its validators carried), it is known as of that commit.
        let whole = cached
            .commit(decided_from(
                &partly,
                Txn::new().then(Op::put("x", b"x".to_vec())),
            ))
            .await
            .expect("commit");
        let proven = cached.read_many_cached(&batch(), true).await.expect("read");
        assert_eq!(proven.current_as_of[0], whole);
    }

    #[tokio::test]
    async fn a_commit_testing_another_revision_than_the_kept_one_vouches_for_nothing_kept() {
        let backing = store_with_blocks().await;
        let (cached, _) = cached_over(&backing);
        let read = cached.read_many_cached(&batch(), true).await.expect("read");
        let kept_at = read.current_as_of[1];
        // Another writer changes the config; a transaction that tested the new revision (decided
        // from a read elsewhere) commits through this cache, which still holds the old value.
        let newer = backing.put("config", b"c1".to_vec()).await.expect("put");
        cached
            .commit(
                Txn::new()
                    .when(Condition::at_revision("config", newer))
                    .when(Condition::absent("h/unseen"))
                    .then(Op::put("x", b"x".to_vec())),
            )
            .await
            .expect("commit");
        let kept = cached.lock();
        assert_eq!(
            kept.keys.get("config"),
            Some(&Some((b"c0".to_vec(), kept_at)))
        );
        assert_eq!(
            kept.current_as_of(&batch()[1..2], &read.results[1..2]),
            vec![kept_at],
            "the stale value is not vouched for by a commit that tested another revision"
        );
        assert!(!kept.keys_current_as_of.contains_key("h/unseen"));
    }

    #[test]
    fn an_answer_that_is_not_exactly_what_is_kept_is_known_at_no_revision() {
        let kv = |key: &str, value: &[u8], revision: u64| KeyValue {
            key: key.to_owned(),
            value: value.to_vec(),
            revision: Revision(revision),
        };
        let mut kept = Kept::default();
        let mut listing = KeptListing::from_listed(&[kv("p/a", b"a", 1), kv("p/b", b"b", 2)]);
        listing.current_as_of = Revision(9);
        kept.keep_listing("p/", listing);
        kept.keep_key("k", Some((b"k".to_vec(), Revision(3))), Revision(9));
        let as_of = |kept: &Kept, listed: Vec<KeyValue>, got: Option<KeyValue>| {
            kept.current_as_of(
                &[Read::List("p/".into()), Read::Get("k".into())],
                &[ReadResult::Listed(listed), ReadResult::Got(got)],
            )
        };
        assert_eq!(
            as_of(
                &kept,
                vec![kv("p/a", b"a", 1), kv("p/b", b"b", 2)],
                Some(kv("k", b"k", 3))
            ),
            vec![Revision(9), Revision(9)]
        );
        // One listed key fewer, one at another revision, one with another value; the key at
        // another revision, then read absent.
        for listed in [
            vec![kv("p/a", b"a", 1)],
            vec![kv("p/a", b"a", 1), kv("p/b", b"b", 5)],
            vec![kv("p/a", b"a", 1), kv("p/b", b"B", 2)],
        ] {
            assert_eq!(as_of(&kept, listed, None)[0], Revision::NONE);
        }
        assert_eq!(
            as_of(&kept, Vec::new(), Some(kv("k", b"k", 4)))[1],
            Revision::NONE
        );
        assert_eq!(as_of(&kept, Vec::new(), None)[1], Revision::NONE);
    }

    /// A store with two pools, a configuration and the pools' generation, written after them;
    /// a cache over it that trusts the generation to cover the pools.
    async fn store_with_covered_pools() -> (Arc<MemoryStore>, CachingStore) {
        let backing = Arc::new(MemoryStore::new());
        backing.put("pools/a", b"a".to_vec()).await.expect("put");
        backing.put("pools/b", b"b".to_vec()).await.expect("put");
        backing.put("config", b"c".to_vec()).await.expect("put");
        backing.put("gen", b"1".to_vec()).await.expect("put");
        let cached =
            CachingStore::new(Arc::clone(&backing) as Arc<dyn KvStore>).covering("pools/", "gen");
        (backing, cached)
    }

    /// The pools written with their generation, as every pool writer writes them.
    fn pool_write(key: &str, generation: Revision) -> Txn {
        Txn::new()
            .when(Condition::at_revision("gen", generation))
            .then(Op::put(key, b"new".to_vec()))
            .then(Op::put("gen", b"2".to_vec()))
    }

    async fn revision_of(store: &MemoryStore, key: &str) -> Revision {
        store
            .get(key)
            .await
            .expect("get")
            .expect("present")
            .revision
    }

    #[tokio::test]
    async fn a_listing_read_after_its_generation_is_validated_by_the_generation_alone() {
        let (backing, cached) = store_with_covered_pools().await;
        let reads = vec![
            Read::Get("gen".into()),
            Read::List("pools/".into()),
            Read::Get("config".into()),
        ];
        let generation = revision_of(&backing, "gen").await;
        let expected = vec![
            Condition::at_revision("config", revision_of(&backing, "config").await),
            Condition::at_revision("gen", generation),
        ];
        let first = cached.read_many_cached(&reads, true).await.expect("read");
        assert!(!first.from_cache);
        assert_eq!(
            first.validators, expected,
            "no pool and no prefix tested: the generation read before them stands for them"
        );
        assert_eq!(first.current_as_of[1], generation, "the listing as of it");
        let again = cached.read_many_cached(&reads, true).await.expect("again");
        assert!(again.from_cache);
        assert_eq!(again.validators, expected);
        // A commit decided from it applies while the pools are unchanged.
        cached
            .commit(decided_from(
                &again,
                Txn::new().then(Op::put("config", b"c2".to_vec())),
            ))
            .await
            .expect("nothing changed: it applies");
        let steady = cached.read_many_cached(&reads, true).await.expect("steady");
        assert!(steady.from_cache);
        assert_eq!(steady.validators.len(), 2, "{:?}", steady.validators);

        // Another writer adds a pool, raising the generation: the answer still kept is stale,
        // and its generation's validator refuses the commit decided from it.
        backing
            .commit(pool_write("pools/c", generation))
            .await
            .expect("another writer's pool");
        let stale = cached.read_many_cached(&reads, true).await.expect("stale");
        assert!(stale.from_cache);
        assert_eq!(stale.results[1], again.results[1], "the kept listing");
        let refused = cached
            .commit(decided_from(
                &stale,
                Txn::new().then(Op::put("config", b"c3".to_vec())),
            ))
            .await;
        assert!(
            matches!(&refused, Err(KvError::Conflict { key }) if key == "gen"),
            "{refused:?}"
        );
        let fresh = cached.read_many_cached(&reads, true).await.expect("fresh");
        assert!(
            !fresh.from_cache,
            "what the refused commit tested is forgotten"
        );
        let ReadResult::Listed(listed) = &fresh.results[1] else {
            panic!("a listing")
        };
        assert_eq!(listed.len(), 3, "the new pool read");
        assert!(fresh
            .validators
            .iter()
            .all(|c| !c.tests_a_prefix() && !c.key().starts_with("pools/")));
    }

    #[tokio::test]
    async fn a_covered_listing_is_known_as_of_its_generation_not_of_another_key_read_before_it() {
        let (backing, cached) = store_with_covered_pools().await;
        // A key written after the generation and read before it in the batch: its later revision
        // says nothing about the pools.
        backing.put("later", b"l".to_vec()).await.expect("put");
        let generation = revision_of(&backing, "gen").await;
        let later = revision_of(&backing, "later").await;
        assert!(later > generation);
        let reads = vec![
            Read::Get("later".into()),
            Read::Get("gen".into()),
            Read::List("pools/".into()),
        ];
        let answered = cached.read_many_cached(&reads, false).await.expect("read");
        assert_eq!(
            answered.current_as_of[2], generation,
            "the listing as of its generation's revision"
        );
        assert_eq!(
            answered.validators,
            vec![
                Condition::at_revision("gen", generation),
                Condition::at_revision("later", later),
            ]
        );
        let again = cached.read_many_cached(&reads, true).await.expect("again");
        assert!(again.from_cache);
        assert_eq!(again.current_as_of[2], generation);
        assert_eq!(again.validators, answered.validators);
    }

    #[tokio::test]
    async fn a_covered_listing_keeps_its_own_validators_unless_known_as_of_its_generation() {
        let (backing, cached) = store_with_covered_pools().await;
        let tests_the_pools = |answered: &CachedRead| {
            answered
                .validators
                .iter()
                .any(|c| c.tests_a_prefix() && c.key() == "pools/")
                && answered
                    .validators
                    .iter()
                    .filter(|c| c.key().starts_with("pools/"))
                    .count()
                    == 3
        };
        // Listed before the generation: a pool written between the two reads would be missed.
        let listed_first = vec![Read::List("pools/".into()), Read::Get("gen".into())];
        let answered = cached
            .read_many_cached(&listed_first, false)
            .await
            .expect("read");
        assert!(tests_the_pools(&answered), "{:?}", answered.validators);
        // Without the generation in the batch.
        let alone = vec![Read::List("pools/".into())];
        let answered = cached.read_many_cached(&alone, false).await.expect("read");
        assert!(tests_the_pools(&answered), "{:?}", answered.validators);

        // Known as of the generation, then the generation learned at a later revision (a pool
        // written with it): the kept listing is older than the generation it would be covered by.
        let covered = vec![Read::Get("gen".into()), Read::List("pools/".into())];
        let answered = cached
            .read_many_cached(&covered, false)
            .await
            .expect("read");
        assert!(!tests_the_pools(&answered), "{:?}", answered.validators);
        let generation = revision_of(&backing, "gen").await;
        backing
            .commit(pool_write("pools/c", generation))
            .await
            .expect("another writer's pool");
        cached.get("gen").await.expect("the generation read again");
        let stale = cached
            .read_many_cached(&covered, true)
            .await
            .expect("stale");
        assert!(stale.from_cache);
        assert!(tests_the_pools(&stale), "{:?}", stale.validators);
        let refused = cached
            .commit(decided_from(
                &stale,
                Txn::new().then(Op::put("config", b"c2".to_vec())),
            ))
            .await;
        assert!(
            matches!(&refused, Err(KvError::Conflict { key }) if key == "pools/"),
            "the pool written after the kept listing is found: {refused:?}"
        );

        // A generation never written covers nothing.
        let backing = Arc::new(MemoryStore::new());
        backing.put("pools/a", b"a".to_vec()).await.expect("put");
        let cached =
            CachingStore::new(Arc::clone(&backing) as Arc<dyn KvStore>).covering("pools/", "gen");
        let answered = cached
            .read_many_cached(&covered, false)
            .await
            .expect("read");
        assert!(answered
            .validators
            .iter()
            .any(|c| c.tests_a_prefix() && c.key() == "pools/"));
        assert!(answered.validators.contains(&Condition::absent("gen")));
    }

    /// The format a gated covering waits for, as the gate's value.
    fn format_7_or_later(value: &[u8]) -> bool {
        value >= b"7".as_slice()
    }

    /// A store at format 6 with a configuration and its generation, and a node's record and its
    /// generation; a cache over it whose coverings are in force from format 7 on: the
    /// configuration by the generation, the node's record by its own, its countdown (a key the
    /// store deletes on its own) while absent.
    async fn store_with_gated_coverings() -> (Arc<MemoryStore>, CachingStore) {
        let backing = Arc::new(MemoryStore::new());
        backing.put("format", b"6".to_vec()).await.expect("put");
        backing.put("config", b"c".to_vec()).await.expect("put");
        backing.put("gen", b"1".to_vec()).await.expect("put");
        backing.put("act/n1", b"a".to_vec()).await.expect("put");
        backing.put("ngen/n1", b"x".to_vec()).await.expect("put");
        let cached = CachingStore::new(Arc::clone(&backing) as Arc<dyn KvStore>)
            .with_covering(Covering::listing("config", "gen").when("format", format_7_or_later))
            .with_covering(
                Covering::each_by_name("act/", "ngen/").when("format", format_7_or_later),
            )
            .with_covering(
                Covering::each_by_name("missing/", "ngen/")
                    .absent_only()
                    .when("format", format_7_or_later),
            );
        (backing, cached)
    }

    /// The gate, the two generations, then what they cover.
    fn gated_batch() -> Vec<Read> {
        vec![
            Read::Get("format".into()),
            Read::Get("gen".into()),
            Read::Get("ngen/n1".into()),
            Read::Get("config".into()),
            Read::Get("act/n1".into()),
            Read::Get("missing/n1".into()),
        ]
    }

    fn tested_keys(answered: &CachedRead) -> Vec<&str> {
        answered.validators.iter().map(Condition::key).collect()
    }

    #[tokio::test]
    async fn keys_are_validated_by_their_generations_only_once_the_gate_holds() {
        let (backing, cached) = store_with_gated_coverings().await;
        let before = cached
            .read_many_cached(&gated_batch(), false)
            .await
            .expect("read");
        assert_eq!(
            tested_keys(&before),
            ["act/n1", "config", "format", "gen", "missing/n1", "ngen/n1"],
            "at format 6 every key keeps its own validator"
        );
        // Finalized: the gate holds from its revision on (the node's generation is not raised).
        backing.put("format", b"7".to_vec()).await.expect("put");
        let after = cached
            .read_many_cached(&gated_batch(), false)
            .await
            .expect("read");
        assert_eq!(
            tested_keys(&after),
            ["format", "gen", "ngen/n1"],
            "read after the gate and their generations, each is known as of both"
        );
        let format = revision_of(&backing, "format").await;
        assert_eq!(after.current_as_of[4], format, "the record as of the gate");
        let again = cached
            .read_many_cached(&gated_batch(), true)
            .await
            .expect("again");
        assert!(again.from_cache);
        assert_eq!(again.validators, after.validators);

        // A countdown started (with the node's generation, as every writer from format 7 on):
        // the kept absence is stale, and the generation refuses a commit decided from it.
        backing
            .commit(
                Txn::new()
                    .then(Op::put("missing/n1", b"m".to_vec()))
                    .then(Op::put("ngen/n1", b"countdown".to_vec())),
            )
            .await
            .expect("countdown");
        let stale = cached
            .read_many_cached(&gated_batch(), true)
            .await
            .expect("stale");
        assert!(stale.from_cache);
        let refused = cached
            .commit(decided_from(
                &stale,
                Txn::new().then(Op::put("act/n1", b"b".to_vec())),
            ))
            .await;
        assert!(
            matches!(&refused, Err(KvError::Conflict { key }) if key == "ngen/n1"),
            "{refused:?}"
        );
        // Read again: a countdown present is not covered (the store deletes it on its own).
        let fresh = cached
            .read_many_cached(&gated_batch(), true)
            .await
            .expect("fresh");
        assert!(!fresh.from_cache);
        assert_eq!(
            tested_keys(&fresh),
            ["format", "gen", "missing/n1", "ngen/n1"]
        );
    }

    #[tokio::test]
    async fn a_key_kept_from_before_the_gate_held_keeps_its_own_validator() {
        let (backing, cached) = store_with_gated_coverings().await;
        cached
            .read_many_cached(&gated_batch(), false)
            .await
            .expect("every key read at format 6");
        // This cache's own write of the record, at format 6, with the node's generation.
        let generation = revision_of(&backing, "ngen/n1").await;
        let record = revision_of(&backing, "act/n1").await;
        cached
            .commit(
                Txn::new()
                    .when(Condition::at_revision("act/n1", record))
                    .when(Condition::at_revision("ngen/n1", generation))
                    .then(Op::put("act/n1", b"mine".to_vec()))
                    .then(Op::put("ngen/n1", b"activity".to_vec())),
            )
            .await
            .expect("own write");
        // An older writer rewrites the record without the generation, then the store is
        // finalized (which does not raise the node's generation); this cache learns the gate alone.
        backing.put("act/n1", b"older".to_vec()).await.expect("put");
        backing.put("format", b"7".to_vec()).await.expect("put");
        cached.get("format").await.expect("the gate read");
        let answered = cached
            .read_many_cached(&gated_batch(), true)
            .await
            .expect("read");
        assert!(answered.from_cache, "every key kept");
        assert!(
            tested_keys(&answered).contains(&"act/n1"),
            "known only from before the gate held: {:?}",
            answered.validators
        );
        let refused = cached
            .commit(decided_from(
                &answered,
                Txn::new().then(Op::put("config", b"c2".to_vec())),
            ))
            .await;
        assert!(
            matches!(&refused, Err(KvError::Conflict { key }) if key == "act/n1"),
            "the older writer's record is found: {refused:?}"
        );
    }

    #[tokio::test]
    async fn a_batch_teaches_a_gated_covering_only_in_the_gates_generations_keys_order() {
        let (backing, cached) = store_with_gated_coverings().await;
        backing.put("format", b"7".to_vec()).await.expect("put");
        for misordered in [
            // The gate read after the generations.
            vec![
                Read::Get("gen".into()),
                Read::Get("ngen/n1".into()),
                Read::Get("format".into()),
                Read::Get("config".into()),
                Read::Get("act/n1".into()),
            ],
            // The keys read before their generations.
            vec![
                Read::Get("format".into()),
                Read::Get("config".into()),
                Read::Get("act/n1".into()),
                Read::Get("gen".into()),
                Read::Get("ngen/n1".into()),
            ],
        ] {
            cached.forget();
            let answered = cached
                .read_many_cached(&misordered, false)
                .await
                .expect("read");
            assert_eq!(
                tested_keys(&answered),
                ["act/n1", "config", "format", "gen", "ngen/n1"],
                "{misordered:?}"
            );
        }
        // A generation never written covers nothing.
        cached.forget();
        backing.delete("ngen/n1").await.expect("delete");
        let answered = cached
            .read_many_cached(&gated_batch(), false)
            .await
            .expect("read");
        assert_eq!(
            tested_keys(&answered),
            ["act/n1", "format", "gen", "missing/n1", "ngen/n1"]
        );
    }

    #[tokio::test]
    async fn a_listing_read_too_long_to_keep_leaves_no_older_one_covered_by_a_later_generation() {
        let (backing, cached) = store_with_covered_pools().await;
        let covered = vec![Read::Get("gen".into()), Read::List("pools/".into())];
        cached
            .read_many_cached(&covered, false)
            .await
            .expect("two pools kept");
        // Another writer adds pools past what a listing may hold to be kept, with the generation.
        let mut txn = Txn::new().then(Op::put("gen", b"2".to_vec()));
        for n in 0..MAX_VALIDATORS {
            txn = txn.then(Op::put(format!("pools/more-{n:03}"), b"p".to_vec()));
        }
        backing.commit(txn).await.expect("many pools");
        let long = cached
            .read_many_cached(&covered, false)
            .await
            .expect("read");
        let ReadResult::Listed(listed) = &long.results[1] else {
            panic!("a listing")
        };
        assert_eq!(listed.len(), MAX_VALIDATORS + 2);
        // The generation is kept at its new revision: the two-pool listing kept before must not
        // be answered, let alone as covered by it.
        let again = cached
            .read_many_cached(&covered, true)
            .await
            .expect("again");
        assert!(!again.from_cache, "{:?}", again.results);
    }
}
