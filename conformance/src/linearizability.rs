//! Linearizability of the storage trait: random concurrent histories checked against a sequential model.
//!
//! Several workers (Tokio tasks; with a [`MultiClientFactory`](crate::MultiClientFactory), each
//! on its own client, for etcd each connected to a different cluster member) run random `get`,
//! `list`, `create`, compare-and-swap `update`, `delete_at`, blind `put` / `delete` and multi-key
//! conditional transactions on a few keys. Each call is stamped on one logical clock (an atomic
//! counter read just before the call and just after it returns), with what it answered.
//!
//! [`check`] then searches (Wing & Gong's algorithm with Lowe's memoisation of visited
//! (linearized set, model state) pairs) for one sequential order that respects real time (an
//! operation that returned before another was invoked comes first) and in which a sequential
//! KV-with-revisions model gives every recorded answer:
//! - a read returns exactly the value and revision of the last write of the key (or nothing);
//! - a list returns every key of the directory with its value and revision, from one state;
//! - a commit applies when every condition holds, else it is a conflict naming the first failed
//!   condition's key and writes nothing;
//! - a commit that changes something returns a revision greater than every revision returned
//!   before it in the order (revisions need not be contiguous); one that changes nothing (only
//!   deletes of missing keys) may return the current revision but never a smaller one.
//!
//! A write answered `Unavailable` or `Indeterminate` "may have applied": the search may place it
//! anywhere after its invocation (even after it returned) or leave it out, and the revision it
//! gave its keys is unknown until a read reveals it.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ipam_core::kv::{Condition, KvError, KvStore, Op, Txn};

use crate::{MultiClientFactory, StoreFactory};

/// The directory every key of a history lives in.
pub const DIR: &str = "linearizability/";

/// The keys the workers race on (few, so that operations collide often).
pub const KEYS: [&str; 3] = ["a", "b", "c"];

/// Workers per history.
pub const WORKERS: usize = 4;

/// Operations per worker.
pub const OPS_PER_WORKER: usize = 40;

/// The seeds every CI run checks (one history each).
pub const CI_SEEDS: [u64; 3] = [1, 2, 3];

/// Set to a number N to check N more histories with random seeds (printed).
pub const RUNS_ENV: &str = "BLOCKIPAM_LINEARIZABILITY_RUNS";

/// Set to one seed to check only that history (to reproduce a failure).
pub const SEED_ENV: &str = "BLOCKIPAM_LINEARIZABILITY_SEED";

/// How many (linearized set, state) pairs the search may visit before it gives up (an error).
const SEARCH_BUDGET: usize = 2_000_000;

/// An index into [`KEYS`]; [`UNKNOWN_KEY`] for a key the test never wrote.
pub type KeyIndex = usize;

/// Stands for a key outside [`KEYS`] in an answer (always a violation).
pub const UNKNOWN_KEY: KeyIndex = usize::MAX;

/// A value written by the test: each write stores a number no other write uses.
pub type ValueId = u64;

/// Stands for stored bytes that are not a number this test wrote (always a violation).
pub const UNKNOWN_VALUE: ValueId = u64::MAX;

/// A condition of a recorded commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cond {
    /// The key must not exist.
    Absent(KeyIndex),
    /// The key must exist at exactly this revision.
    At(KeyIndex, u64),
}

impl Cond {
    fn key(self) -> KeyIndex {
        match self {
            Cond::Absent(key) | Cond::At(key, _) => key,
        }
    }
}

/// A write of a recorded commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    /// Store this value.
    Put(KeyIndex, ValueId),
    /// Remove the key.
    Delete(KeyIndex),
}

/// What a worker asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `get` of one key.
    Get(KeyIndex),
    /// `list` of [`DIR`].
    List,
    /// `commit` (or a helper built on it: `create`, `update`, `delete_at`, `put`, `delete`).
    Commit {
        /// Its conditions, in order.
        conditions: Vec<Cond>,
        /// Its writes, in order.
        writes: Vec<Write>,
    },
}

/// What the store answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// A `get`: the value and revision, or nothing.
    Got(Option<(ValueId, u64)>),
    /// A `list`: (key, value, revision) in the order returned.
    Listed(Vec<(KeyIndex, ValueId, u64)>),
    /// A commit that applied, with its revision.
    Committed(u64),
    /// A commit refused by the condition on this key.
    Conflict(KeyIndex),
    /// A commit answered `Unavailable` or `Indeterminate`: it may or may not have applied.
    Maybe,
}

/// One operation of a history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The worker that ran it.
    pub worker: usize,
    /// What was asked.
    pub call: Call,
    /// What came back.
    pub answer: Answer,
    /// The logical time just before the call.
    pub invoked: u64,
    /// The logical time just after it returned (ignored for [`Answer::Maybe`]: its effect, if
    /// any, may land later).
    pub returned: u64,
}

impl Event {
    /// True when the search must place it (everything but a "maybe applied" write).
    fn required(&self) -> bool {
        self.answer != Answer::Maybe
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = |k: KeyIndex| KEYS.get(k).copied().unwrap_or("?");
        write!(
            f,
            "[{:>4} .. {:>4}] worker {}: ",
            self.invoked, self.returned, self.worker
        )?;
        match &self.call {
            Call::Get(k) => write!(f, "get {}", key(*k))?,
            Call::List => write!(f, "list")?,
            Call::Commit { conditions, writes } => {
                let conditions: Vec<String> = conditions
                    .iter()
                    .map(|c| match c {
                        Cond::Absent(k) => format!("{} absent", key(*k)),
                        Cond::At(k, r) => format!("{}@{r}", key(*k)),
                    })
                    .collect();
                let writes: Vec<String> = writes
                    .iter()
                    .map(|w| match w {
                        Write::Put(k, v) => format!("put {}={v}", key(*k)),
                        Write::Delete(k) => format!("delete {}", key(*k)),
                    })
                    .collect();
                write!(
                    f,
                    "commit if [{}] then [{}]",
                    conditions.join(", "),
                    writes.join(", ")
                )?;
            }
        }
        match &self.answer {
            Answer::Got(None) => write!(f, " -> none"),
            Answer::Got(Some((v, r))) => write!(f, " -> {v}@{r}"),
            Answer::Listed(entries) => {
                let entries: Vec<String> = entries
                    .iter()
                    .map(|(k, v, r)| format!("{}={v}@{r}", key(*k)))
                    .collect();
                write!(f, " -> [{}]", entries.join(", "))
            }
            Answer::Committed(r) => write!(f, " -> ok@{r}"),
            Answer::Conflict(k) => write!(f, " -> conflict on {}", key(*k)),
            Answer::Maybe => write!(f, " -> maybe applied"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The sequential model and the checker
// ---------------------------------------------------------------------------------------------

/// A key's revision in the model: known, or set by a "maybe applied" write and not seen since.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Rev {
    Known(u64),
    Unknown,
}

/// The model: each key's value and revision, and the greatest revision returned so far.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct State {
    keys: Vec<Option<(ValueId, Rev)>>,
    last: u64,
}

impl State {
    fn empty() -> Self {
        State {
            keys: vec![None; KEYS.len()],
            last: 0,
        }
    }

    /// The state after a read saw `seen` for `key`, or `None` when the model disagrees.
    fn observe(mut self, key: KeyIndex, seen: Option<(ValueId, u64)>) -> Option<Self> {
        let slot = self.keys.get_mut(key)?;
        match (*slot, seen) {
            (None, None) => {}
            (Some((value, Rev::Known(rev))), Some((seen_value, seen_rev)))
                if value == seen_value && rev == seen_rev => {}
            (Some((value, Rev::Unknown)), Some((seen_value, seen_rev))) if value == seen_value => {
                *slot = Some((value, Rev::Known(seen_rev)));
                self.last = self.last.max(seen_rev);
            }
            _ => return None,
        }
        Some(self)
    }

    /// Whether a condition holds: `Some(true)`, `Some(false)`, or `None` when the key's revision
    /// is unknown.
    fn holds(&self, condition: Cond) -> Option<bool> {
        match (condition, self.keys.get(condition.key()).copied().flatten()) {
            (Cond::Absent(_), current) => Some(current.is_none()),
            (Cond::At(..), None) => Some(false),
            (Cond::At(_, wanted), Some((_, Rev::Known(rev)))) => Some(rev == wanted),
            (Cond::At(..), Some((_, Rev::Unknown))) => None,
        }
    }

    fn apply(&mut self, writes: &[Write], rev: Rev) {
        for write in writes {
            match *write {
                Write::Put(key, value) => {
                    if let Some(slot) = self.keys.get_mut(key) {
                        *slot = Some((value, rev));
                    }
                }
                Write::Delete(key) => {
                    if let Some(slot) = self.keys.get_mut(key) {
                        *slot = None;
                    }
                }
            }
        }
    }

    /// The state after `event` took effect here, or `None` when its answer is impossible.
    fn step(&self, event: &Event) -> Option<State> {
        match (&event.call, &event.answer) {
            (Call::Get(key), Answer::Got(seen)) => self.clone().observe(*key, *seen),
            (Call::List, Answer::Listed(entries)) => {
                let mut next = self.clone();
                let mut listed = vec![None; KEYS.len()];
                for (key, value, rev) in entries {
                    let slot = listed.get_mut(*key)?;
                    if slot.is_some() {
                        return None;
                    }
                    *slot = Some((*value, *rev));
                }
                for (key, seen) in listed.into_iter().enumerate() {
                    next = next.observe(key, seen)?;
                }
                Some(next)
            }
            (Call::Commit { conditions, writes }, answer) => {
                let verdicts: Vec<Option<bool>> =
                    conditions.iter().map(|c| self.holds(*c)).collect();
                let may_all_hold = verdicts.iter().all(|v| *v != Some(false));
                match answer {
                    Answer::Committed(rev) => {
                        if !may_all_hold {
                            return None;
                        }
                        let changes = writes.iter().any(|w| match w {
                            Write::Put(..) => true,
                            Write::Delete(key) => self.keys.get(*key).copied().flatten().is_some(),
                        });
                        let in_order = if changes {
                            *rev > self.last
                        } else {
                            *rev >= self.last
                        };
                        if !in_order {
                            return None;
                        }
                        let mut next = self.clone();
                        next.apply(writes, Rev::Known(*rev));
                        next.last = *rev;
                        Some(next)
                    }
                    Answer::Conflict(key) => {
                        let failed = conditions.iter().position(|c| c.key() == *key)?;
                        let earlier_may_hold = verdicts[..failed].iter().all(|v| *v != Some(false));
                        (earlier_may_hold && verdicts[failed] != Some(true)).then(|| self.clone())
                    }
                    Answer::Maybe => {
                        let mut next = self.clone();
                        if may_all_hold {
                            next.apply(writes, Rev::Unknown);
                        }
                        Some(next)
                    }
                    Answer::Got(_) | Answer::Listed(_) => None,
                }
            }
            _ => None,
        }
    }
}

/// Why a history is not linearizable (or could not be decided), with the history itself.
#[derive(Debug, Clone)]
pub struct Violation {
    /// What went wrong.
    pub reason: String,
    /// The history, sorted by invocation.
    pub history: Vec<Event>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.reason)?;
        writeln!(f, "history ({} operations):", self.history.len())?;
        for event in &self.history {
            writeln!(f, "  {event}")?;
        }
        Ok(())
    }
}

struct Search<'a> {
    history: &'a [Event],
    visited: HashSet<(Vec<u64>, State)>,
    done: Vec<u64>,
    required_left: usize,
    deepest: usize,
    deepest_missing: Vec<usize>,
}

impl Search<'_> {
    fn is_done(&self, index: usize) -> bool {
        self.done[index / 64] & (1 << (index % 64)) != 0
    }

    fn flip(&mut self, index: usize) {
        self.done[index / 64] ^= 1 << (index % 64);
    }

    /// Depth-first search for an order of the remaining operations from `state`.
    fn extend(&mut self, state: &State, depth: usize) -> Result<bool, String> {
        if self.required_left == 0 {
            return Ok(true);
        }
        if !self.visited.insert((self.done.clone(), state.clone())) {
            return Ok(false);
        }
        if self.visited.len() > SEARCH_BUDGET {
            return Err(format!(
                "the checker gave up after visiting {SEARCH_BUDGET} states; use a smaller history"
            ));
        }
        if depth > self.deepest {
            self.deepest = depth;
            self.deepest_missing = (0..self.history.len())
                .filter(|i| !self.is_done(*i) && self.history[*i].required())
                .collect();
        }
        // Only an operation invoked before every pending operation's return may come next.
        let horizon = (0..self.history.len())
            .filter(|i| !self.is_done(*i) && self.history[*i].required())
            .map(|i| self.history[i].returned)
            .min()
            .unwrap_or(u64::MAX);
        for index in 0..self.history.len() {
            let event = &self.history[index];
            if self.is_done(index) || event.invoked >= horizon {
                continue;
            }
            let Some(next) = state.step(event) else {
                continue;
            };
            self.flip(index);
            let required = usize::from(event.required());
            self.required_left -= required;
            let found = self.extend(&next, depth + 1)?;
            self.required_left += required;
            self.flip(index);
            if found {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// Checks that `history` (operations on [`KEYS`] of a store that was empty at the start) is
/// linearizable with respect to the KV-with-revisions model.
///
/// # Errors
/// A [`Violation`] naming the operations no order could place, or saying that the search budget
/// ran out.
pub fn check(history: &[Event]) -> Result<(), Violation> {
    let mut history = history.to_vec();
    history.sort_by_key(|e| e.invoked);
    for event in &mut history {
        if !event.required() {
            event.returned = u64::MAX;
        }
    }
    let mut search = Search {
        history: &history,
        visited: HashSet::new(),
        done: vec![0; history.len().div_ceil(64)],
        required_left: history.iter().filter(|e| e.required()).count(),
        deepest: 0,
        deepest_missing: Vec::new(),
    };
    let outcome = search.extend(&State::empty(), 0);
    let reason = match outcome {
        Ok(true) => return Ok(()),
        Ok(false) => {
            let stuck: Vec<String> = search
                .deepest_missing
                .iter()
                .take(5)
                .map(|i| format!("  {}", history[*i]))
                .collect();
            format!(
                "not linearizable: no sequential order explains every answer; the longest \
                 explainable prefix holds {} of {} operations, and none of these could come next \
                 (first 5 shown):\n{}",
                search.deepest,
                history.len(),
                stuck.join("\n")
            )
        }
        Err(budget) => budget,
    };
    Err(Violation { reason, history })
}

// ---------------------------------------------------------------------------------------------
// Recording histories
// ---------------------------------------------------------------------------------------------

/// A small deterministic generator (SplitMix64), so that a seed reproduces a worker's choices.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: usize) -> usize {
        (self.next() % bound as u64) as usize
    }
}

fn key_name(key: KeyIndex) -> String {
    format!("{DIR}{}", KEYS[key])
}

fn key_index(name: &str) -> KeyIndex {
    name.strip_prefix(DIR)
        .and_then(|short| KEYS.iter().position(|k| *k == short))
        .unwrap_or(UNKNOWN_KEY)
}

fn value_id(bytes: &[u8]) -> ValueId {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(UNKNOWN_VALUE)
}

/// One worker: `ops` random operations on `store`, stamped on `clock`.
async fn run_worker(
    store: Arc<dyn KvStore>,
    worker: usize,
    seed: u64,
    ops: usize,
    clock: Arc<AtomicU64>,
) -> Result<Vec<Event>, String> {
    let mut rng = Rng(seed ^ (worker as u64).wrapping_mul(0xA076_1D64_78BD_642F));
    // The revision this worker last saw for each key, to aim its compare-and-swaps.
    let mut seen: Vec<Option<u64>> = vec![None; KEYS.len()];
    let mut events = Vec::with_capacity(ops);
    for op in 0..ops {
        let fresh_value = (worker as u64 + 1) * 1_000_000 + op as u64;
        let key = rng.below(KEYS.len());
        let aimed_revision = |rng: &mut Rng, seen: &[Option<u64>], key: KeyIndex| {
            // Mostly the last revision seen, sometimes a guess that is likely stale.
            match seen[key] {
                Some(rev) if rng.below(5) != 0 => rev,
                _ => 1 + rng.below(4) as u64,
            }
        };
        let roll = rng.below(100);
        let (call, txn) = if roll < 20 {
            (Call::Get(key), None)
        } else if roll < 30 {
            (Call::List, None)
        } else {
            let (conditions, writes) = if roll < 42 {
                (vec![Cond::Absent(key)], vec![Write::Put(key, fresh_value)])
            } else if roll < 62 {
                let rev = aimed_revision(&mut rng, &seen, key);
                (vec![Cond::At(key, rev)], vec![Write::Put(key, fresh_value)])
            } else if roll < 70 {
                let rev = aimed_revision(&mut rng, &seen, key);
                (vec![Cond::At(key, rev)], vec![Write::Delete(key)])
            } else if roll < 76 {
                (Vec::new(), vec![Write::Put(key, fresh_value)])
            } else if roll < 80 {
                (Vec::new(), vec![Write::Delete(key)])
            } else {
                // A multi-key transaction: conditions on two keys, writes on one to three.
                let other = (key + 1 + rng.below(KEYS.len() - 1)) % KEYS.len();
                let mut conditions = Vec::new();
                for k in [key, other] {
                    conditions.push(if rng.below(3) == 0 {
                        Cond::Absent(k)
                    } else {
                        Cond::At(k, aimed_revision(&mut rng, &seen, k))
                    });
                }
                let first = rng.below(KEYS.len());
                let count = 1 + rng.below(KEYS.len());
                let writes = (0..count)
                    .map(|i| {
                        let k = (first + i) % KEYS.len();
                        if rng.below(4) == 0 {
                            Write::Delete(k)
                        } else {
                            Write::Put(k, fresh_value)
                        }
                    })
                    .collect();
                (conditions, writes)
            };
            let txn = Txn {
                conditions: conditions
                    .iter()
                    .map(|c| match *c {
                        Cond::Absent(k) => Condition::absent(key_name(k)),
                        Cond::At(k, rev) => {
                            Condition::at_revision(key_name(k), ipam_core::Revision(rev))
                        }
                    })
                    .collect(),
                ops: writes
                    .iter()
                    .map(|w| match *w {
                        Write::Put(k, value) => Op::put(key_name(k), value.to_string()),
                        Write::Delete(k) => Op::delete(key_name(k)),
                    })
                    .collect(),
            };
            (Call::Commit { conditions, writes }, Some(txn))
        };
        let invoked = clock.fetch_add(1, Ordering::SeqCst);
        let answer = match (&call, txn) {
            (Call::Get(key), _) => match store.get(&key_name(*key)).await {
                Ok(kv) => Some(Answer::Got(
                    kv.map(|kv| (value_id(&kv.value), kv.revision.get())),
                )),
                Err(e) if e.is_retryable() => None,
                Err(e) => return Err(format!("worker {worker}: get failed: {e}")),
            },
            (Call::List, _) => match store.list(DIR).await {
                Ok(kvs) => Some(Answer::Listed(
                    kvs.iter()
                        .map(|kv| (key_index(&kv.key), value_id(&kv.value), kv.revision.get()))
                        .collect(),
                )),
                Err(e) if e.is_retryable() => None,
                Err(e) => return Err(format!("worker {worker}: list failed: {e}")),
            },
            (Call::Commit { .. }, Some(txn)) => {
                // Through the provided helpers where the transaction has their shape, so that
                // they are exercised too; they are thin wrappers over `commit`.
                let outcome = commit_through_helper(&*store, txn).await;
                Some(match outcome {
                    Ok(rev) => Answer::Committed(rev.get()),
                    Err(KvError::Conflict { key }) => Answer::Conflict(key_index(&key)),
                    Err(KvError::Unavailable { .. } | KvError::Indeterminate { .. }) => {
                        Answer::Maybe
                    }
                    Err(e) => return Err(format!("worker {worker}: commit failed: {e}")),
                })
            }
            (Call::Commit { .. }, None) => None,
        };
        let returned = clock.fetch_add(1, Ordering::SeqCst);
        let Some(answer) = answer else {
            // A read that failed observed nothing: it is left out of the history.
            continue;
        };
        match (&call, &answer) {
            (Call::Get(key), Answer::Got(got)) => seen[*key] = got.map(|(_, rev)| rev),
            (Call::List, Answer::Listed(entries)) => {
                seen = vec![None; KEYS.len()];
                for (key, _, rev) in entries {
                    if let Some(slot) = seen.get_mut(*key) {
                        *slot = Some(*rev);
                    }
                }
            }
            (Call::Commit { writes, .. }, Answer::Committed(rev)) => {
                for write in writes {
                    match *write {
                        Write::Put(k, _) => seen[k] = Some(*rev),
                        Write::Delete(k) => seen[k] = None,
                    }
                }
            }
            _ => {}
        }
        events.push(Event {
            worker,
            call,
            answer,
            invoked,
            returned,
        });
    }
    Ok(events)
}

/// Commits `txn` through the `KvStore` helper of the same shape, or `commit` itself.
async fn commit_through_helper(
    store: &dyn KvStore,
    txn: Txn,
) -> Result<ipam_core::Revision, KvError> {
    match (txn.conditions.as_slice(), txn.ops.as_slice()) {
        ([Condition::Absent { key: tested }], [Op::Put { key, value }]) if tested == key => {
            store.create(key, value.clone()).await
        }
        (
            [Condition::AtRevision {
                key: tested,
                revision,
            }],
            [Op::Put { key, value }],
        ) if tested == key => store.update(key, *revision, value.clone()).await,
        (
            [Condition::AtRevision {
                key: tested,
                revision,
            }],
            [Op::Delete { key }],
        ) if tested == key => store.delete_at(key, *revision).await,
        ([], [Op::Put { key, value }]) => store.put(key, value.clone()).await,
        ([], [Op::Delete { key }]) => store.delete(key).await,
        _ => store.commit(txn).await,
    }
}

/// Runs one random history on `clients` (worker `i` uses client `i % clients.len()`; the store
/// behind them must be empty) and returns it.
///
/// # Errors
/// A message when a call failed in a way no history can explain (invalid argument, corrupt
/// data, a permanent error), or a worker panicked.
pub async fn record_history(
    clients: &[Arc<dyn KvStore>],
    seed: u64,
    workers: usize,
    ops_per_worker: usize,
) -> Result<Vec<Event>, String> {
    if clients.is_empty() {
        return Err("no client to run the history on".into());
    }
    let clock = Arc::new(AtomicU64::new(0));
    let start = Arc::new(tokio::sync::Barrier::new(workers));
    let mut tasks = Vec::with_capacity(workers);
    for worker in 0..workers {
        let store = Arc::clone(&clients[worker % clients.len()]);
        let clock = Arc::clone(&clock);
        let start = Arc::clone(&start);
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            run_worker(store, worker, seed, ops_per_worker, clock).await
        }));
    }
    let mut history = Vec::new();
    for task in tasks {
        let events = task
            .await
            .map_err(|e| format!("a worker panicked: {e}"))??;
        history.extend(events);
    }
    Ok(history)
}

/// The seeds to check: [`CI_SEEDS`], or only `$BLOCKIPAM_LINEARIZABILITY_SEED`, plus
/// `$BLOCKIPAM_LINEARIZABILITY_RUNS` random ones.
pub fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var(SEED_ENV)
        .ok()
        .and_then(|s| s.trim().parse().ok())
    {
        return vec![seed];
    }
    let extra: u64 = std::env::var(RUNS_ENV)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut random = Rng(base);
    CI_SEEDS
        .iter()
        .copied()
        .chain((0..extra).map(|_| random.next()))
        .collect()
}

/// Records and checks one history per seed of [`seeds`], each on a fresh store from `fresh`.
async fn check_seeds<Fut>(backend: &str, mut fresh: impl FnMut() -> Fut)
where
    Fut:
        std::future::Future<Output = (Vec<Arc<dyn KvStore>>, Box<dyn std::any::Any + Send + Sync>)>,
{
    for seed in seeds() {
        let (clients, guard) = fresh().await;
        let history = record_history(&clients, seed, WORKERS, OPS_PER_WORKER)
            .await
            .unwrap_or_else(|e| panic!("{backend}, seed {seed}: {e}"));
        drop(guard);
        if let Err(violation) = check(&history) {
            panic!("{backend}, seed {seed} (rerun with {SEED_ENV}={seed}): {violation}");
        }
        let committed = history
            .iter()
            .filter(|e| matches!(e.answer, Answer::Committed(_)))
            .count();
        let conflicts = history
            .iter()
            .filter(|e| matches!(e.answer, Answer::Conflict(_)))
            .count();
        println!(
            "{backend}, seed {seed}: {} operations linearizable ({committed} committed, \
             {conflicts} conflicts, {} maybe applied; {} pairs overlapped in time)",
            history.len(),
            history.iter().filter(|e| !e.required()).count(),
            overlapping_pairs(&history)
        );
    }
}

/// How many pairs of operations of different workers were in flight at the same time.
pub fn overlapping_pairs(history: &[Event]) -> usize {
    let mut pairs = 0;
    for (i, a) in history.iter().enumerate() {
        for b in &history[i + 1..] {
            if a.worker != b.worker && a.invoked < b.returned && b.invoked < a.returned {
                pairs += 1;
            }
        }
    }
    pairs
}

/// Random concurrent histories of gets, lists, compare-and-swaps, creates, deletes and multi-key
/// transactions, all workers on one store handle, are linearizable.
pub async fn concurrent_histories_are_linearizable<F: StoreFactory>(factory: &F) {
    check_seeds(factory.backend_name(), || async {
        let t = factory.fresh().await;
        let clients = vec![Arc::clone(&t.store); WORKERS];
        (clients, t.guard)
    })
    .await;
}

/// The same histories, each worker on a client of its own (for a cluster: connected to a
/// different member), are linearizable.
pub async fn concurrent_histories_across_clients_are_linearizable<F: MultiClientFactory>(
    factory: &F,
) {
    check_seeds(factory.backend_name(), || async {
        let t = factory.fresh_clients(WORKERS).await;
        (t.clients, t.guard)
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(worker: usize, invoked: u64, returned: u64, call: Call, answer: Answer) -> Event {
        Event {
            worker,
            call,
            answer,
            invoked,
            returned,
        }
    }

    fn put(key: KeyIndex, value: ValueId) -> Call {
        Call::Commit {
            conditions: Vec::new(),
            writes: vec![Write::Put(key, value)],
        }
    }

    fn create(key: KeyIndex, value: ValueId) -> Call {
        Call::Commit {
            conditions: vec![Cond::Absent(key)],
            writes: vec![Write::Put(key, value)],
        }
    }

    #[test]
    fn sequential_write_then_read_is_accepted() {
        let history = [
            event(0, 0, 1, put(0, 7), Answer::Committed(5)),
            event(1, 2, 3, Call::Get(0), Answer::Got(Some((7, 5)))),
        ];
        check(&history).expect("linearizable");
    }

    #[test]
    fn read_overlapping_a_write_may_see_old_or_new_value() {
        for seen in [None, Some((7, 5))] {
            let history = [
                event(0, 0, 3, put(0, 7), Answer::Committed(5)),
                event(1, 1, 2, Call::Get(0), Answer::Got(seen)),
            ];
            check(&history).unwrap_or_else(|v| panic!("{seen:?} should be accepted: {v}"));
        }
    }

    #[test]
    fn stale_read_after_a_completed_write_is_rejected() {
        let history = [
            event(0, 0, 1, put(0, 7), Answer::Committed(5)),
            event(1, 2, 3, Call::Get(0), Answer::Got(None)),
        ];
        let violation = check(&history).expect_err("stale read must be rejected");
        assert!(violation.reason.contains("not linearizable"), "{violation}");
    }

    #[test]
    fn read_of_a_value_never_written_is_rejected() {
        let history = [event(1, 0, 1, Call::Get(0), Answer::Got(Some((7, 5))))];
        check(&history).expect_err("value from nowhere");
    }

    #[test]
    fn two_successful_creates_of_one_key_are_rejected_even_when_concurrent() {
        let history = [
            event(0, 0, 3, create(0, 1), Answer::Committed(5)),
            event(1, 1, 2, create(0, 2), Answer::Committed(6)),
        ];
        check(&history).expect_err("double create");
    }

    #[test]
    fn revisions_going_backwards_are_rejected_and_gaps_accepted() {
        let backwards = [
            event(0, 0, 1, put(0, 1), Answer::Committed(7)),
            event(1, 2, 3, put(1, 2), Answer::Committed(6)),
        ];
        check(&backwards).expect_err("a later write got a smaller revision");
        let gaps = [
            event(0, 0, 1, put(0, 1), Answer::Committed(7)),
            event(1, 2, 3, put(1, 2), Answer::Committed(700)),
        ];
        check(&gaps).expect("non-contiguous revisions are allowed");
    }

    #[test]
    fn concurrent_writes_are_ordered_by_their_revisions() {
        // Both overlap; the read after both sees the one with the greater revision.
        let right = [
            event(0, 0, 3, put(0, 1), Answer::Committed(8)),
            event(1, 1, 2, put(0, 2), Answer::Committed(9)),
            event(2, 4, 5, Call::Get(0), Answer::Got(Some((2, 9)))),
        ];
        check(&right).expect("linearizable");
        let wrong = [
            event(0, 0, 3, put(0, 1), Answer::Committed(8)),
            event(1, 1, 2, put(0, 2), Answer::Committed(9)),
            event(2, 4, 5, Call::Get(0), Answer::Got(Some((1, 8)))),
        ];
        check(&wrong).expect_err("the write at 8 cannot come after the one at 9");
    }

    #[test]
    fn torn_multi_key_transaction_seen_by_a_list_is_rejected() {
        let both = Call::Commit {
            conditions: vec![Cond::Absent(0), Cond::Absent(1)],
            writes: vec![Write::Put(0, 1), Write::Put(1, 1)],
        };
        let torn = [
            event(0, 0, 3, both.clone(), Answer::Committed(9)),
            event(1, 1, 2, Call::List, Answer::Listed(vec![(0, 1, 9)])),
        ];
        check(&torn).expect_err("half a transaction is visible");
        let whole = [
            event(0, 0, 3, both, Answer::Committed(9)),
            event(
                1,
                1,
                2,
                Call::List,
                Answer::Listed(vec![(0, 1, 9), (1, 1, 9)]),
            ),
        ];
        check(&whole).expect("linearizable");
    }

    #[test]
    fn conflict_must_name_the_first_failed_condition() {
        let call = Call::Commit {
            conditions: vec![Cond::At(0, 3), Cond::Absent(1)],
            writes: vec![Write::Put(2, 1)],
        };
        // Key a is absent, so its condition fails first.
        check(&[event(0, 0, 1, call.clone(), Answer::Conflict(0))]).expect("names a");
        check(&[event(0, 0, 1, call, Answer::Conflict(1))]).expect_err("b's condition held");
    }

    #[test]
    fn compare_and_swap_on_a_stale_revision_must_conflict() {
        let cas = |rev| Call::Commit {
            conditions: vec![Cond::At(0, rev)],
            writes: vec![Write::Put(0, 3)],
        };
        let history = [
            event(0, 0, 1, put(0, 1), Answer::Committed(5)),
            event(0, 2, 3, put(0, 2), Answer::Committed(6)),
            event(1, 4, 5, cas(5), Answer::Committed(7)),
        ];
        check(&history).expect_err("a stale compare-and-swap applied");
        let history = [
            event(0, 0, 1, put(0, 1), Answer::Committed(5)),
            event(0, 2, 3, put(0, 2), Answer::Committed(6)),
            event(1, 4, 5, cas(5), Answer::Conflict(0)),
            event(1, 6, 7, cas(6), Answer::Committed(7)),
        ];
        check(&history).expect("linearizable");
    }

    #[test]
    fn delete_of_a_missing_key_may_return_the_current_revision() {
        let delete = Call::Commit {
            conditions: Vec::new(),
            writes: vec![Write::Delete(1)],
        };
        let history = [
            event(0, 0, 1, put(0, 1), Answer::Committed(5)),
            event(0, 2, 3, delete.clone(), Answer::Committed(5)),
        ];
        check(&history).expect("a no-op may return the current revision");
        let history = [
            event(0, 0, 1, put(0, 1), Answer::Committed(5)),
            event(0, 2, 3, delete, Answer::Committed(4)),
        ];
        check(&history).expect_err("a no-op may not go backwards");
    }

    #[test]
    fn maybe_applied_write_may_be_seen_later_or_never() {
        for seen in [None, Some((7, 12))] {
            let history = [
                event(0, 0, 1, put(0, 7), Answer::Maybe),
                event(1, 2, 3, Call::Get(0), Answer::Got(seen)),
                event(1, 4, 5, Call::Get(0), Answer::Got(seen)),
            ];
            check(&history).unwrap_or_else(|v| panic!("{seen:?} should be accepted: {v}"));
        }
        // But once seen, it cannot disappear again.
        let history = [
            event(0, 0, 1, put(0, 7), Answer::Maybe),
            event(1, 2, 3, Call::Get(0), Answer::Got(Some((7, 12)))),
            event(1, 4, 5, Call::Get(0), Answer::Got(None)),
        ];
        check(&history).expect_err("a write that was seen cannot be undone");
    }

    /// A store that answers `get` from a cache filled on first read: stale reads, as a replica
    /// that serves reads without asking the leader would give.
    #[derive(Debug, Default)]
    struct CachingStore {
        inner: ipam_core::MemoryStore,
        cache: std::sync::Mutex<std::collections::HashMap<String, Option<ipam_core::KeyValue>>>,
    }

    #[async_trait::async_trait]
    impl KvStore for CachingStore {
        async fn get(&self, key: &str) -> Result<Option<ipam_core::KeyValue>, KvError> {
            let cached = self.cache.lock().expect("cache lock").get(key).cloned();
            match cached {
                Some(kv) => Ok(kv),
                None => {
                    let kv = self.inner.get(key).await?;
                    self.cache
                        .lock()
                        .expect("cache lock")
                        .insert(key.to_owned(), kv.clone());
                    Ok(kv)
                }
            }
        }

        async fn list(&self, prefix: &str) -> Result<Vec<ipam_core::KeyValue>, KvError> {
            self.inner.list(prefix).await
        }

        async fn commit(&self, txn: Txn) -> Result<ipam_core::Revision, KvError> {
            self.inner.commit(txn).await
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn recorded_history_of_a_store_with_stale_reads_is_rejected() {
        let store: Arc<dyn KvStore> = Arc::new(CachingStore::default());
        let clients = vec![store; WORKERS];
        let history = record_history(&clients, 7, WORKERS, OPS_PER_WORKER)
            .await
            .expect("record");
        check(&history).expect_err("cached reads go stale once another worker writes");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn recorded_history_on_the_memory_store_passes_and_a_doctored_copy_fails() {
        let store: Arc<dyn KvStore> = Arc::new(ipam_core::MemoryStore::new());
        let clients = vec![store; WORKERS];
        let history = record_history(&clients, 42, WORKERS, OPS_PER_WORKER)
            .await
            .expect("record");
        assert_eq!(history.len(), WORKERS * OPS_PER_WORKER);
        check(&history).unwrap_or_else(|v| panic!("{v}"));
        // Make the last successful read return a revision no write produced.
        let mut doctored = history.clone();
        let last_read = doctored
            .iter_mut()
            .filter(|e| matches!(e.answer, Answer::Got(Some(_))))
            .max_by_key(|e| e.invoked)
            .expect("the history has a successful read");
        if let Answer::Got(Some((_, rev))) = &mut last_read.answer {
            *rev += 1_000_000;
        }
        check(&doctored).expect_err("a read of a revision nobody wrote");
    }
}
