//! The storage cases: every statement under `# Behavior` and `# Errors` of the `KvStore` trait,
//! each as one function named after what it proves.

use std::sync::Arc;

use ipam_core::kv::{
    Condition, KvError, KvStore, Op, Revision, Txn, MAX_TXN_BYTES, MAX_TXN_CONDITIONS, MAX_TXN_OPS,
    MAX_VALUE_BYTES,
};

use crate::StoreFactory;

async fn value_of(store: &dyn KvStore, key: &str) -> Option<Vec<u8>> {
    store
        .get(key)
        .await
        .unwrap_or_else(|e| panic!("get {key:?} failed: {e}"))
        .map(|kv| kv.value)
}

async fn revision_of(store: &dyn KvStore, key: &str) -> Revision {
    store
        .get(key)
        .await
        .unwrap_or_else(|e| panic!("get {key:?} failed: {e}"))
        .unwrap_or_else(|| panic!("{key:?} should exist"))
        .revision
}

fn assert_conflict_on<T: std::fmt::Debug>(result: Result<T, KvError>, key: &str) {
    match result {
        Err(KvError::Conflict { key: failed }) => {
            assert_eq!(failed, key, "conflict names the wrong key")
        }
        other => panic!("expected a conflict on {key:?}, got {other:?}"),
    }
}

fn assert_invalid<T: std::fmt::Debug>(result: Result<T, KvError>) {
    match result {
        Err(KvError::InvalidArgument { .. }) => {}
        other => panic!("expected an invalid-argument error, got {other:?}"),
    }
}

/// `get` of a key never written returns `None`.
pub async fn get_missing_key_is_none<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    assert_eq!(t.store.get("never/written").await.expect("get"), None);
}

/// `create` stores the value, and `get` returns it with the revision `create` returned.
pub async fn create_then_get_returns_value_and_revision<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let rev = t.store.create("k", b"v1".to_vec()).await.expect("create");
    assert!(rev > Revision::NONE);
    let kv = t.store.get("k").await.expect("get").expect("present");
    assert_eq!(kv.key, "k");
    assert_eq!(kv.value, b"v1");
    assert_eq!(kv.revision, rev);
}

/// `create` on an existing key is a conflict and leaves the old value.
pub async fn create_on_existing_key_is_conflict<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let rev = t
        .store
        .create("k", b"first".to_vec())
        .await
        .expect("create");
    assert_conflict_on(t.store.create("k", b"second".to_vec()).await, "k");
    let kv = t.store.get("k").await.expect("get").expect("present");
    assert_eq!(kv.value, b"first");
    assert_eq!(kv.revision, rev);
}

/// `update` at the current revision replaces the value and returns a greater revision.
pub async fn update_with_current_revision_replaces_value<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let r1 = t.store.create("k", b"a".to_vec()).await.expect("create");
    let r2 = t
        .store
        .update("k", r1, b"b".to_vec())
        .await
        .expect("update");
    assert!(r2 > r1);
    assert_eq!(value_of(&*t.store, "k").await, Some(b"b".to_vec()));
    assert_eq!(revision_of(&*t.store, "k").await, r2);
}

/// `update` with a stale revision is a conflict and writes nothing.
pub async fn update_with_stale_revision_is_conflict_and_writes_nothing<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let r1 = t.store.create("k", b"a".to_vec()).await.expect("create");
    let r2 = t
        .store
        .update("k", r1, b"b".to_vec())
        .await
        .expect("update");
    assert_conflict_on(t.store.update("k", r1, b"stale".to_vec()).await, "k");
    assert_eq!(value_of(&*t.store, "k").await, Some(b"b".to_vec()));
    assert_eq!(revision_of(&*t.store, "k").await, r2);
}

/// `update` of a missing key is a conflict and does not create it.
pub async fn update_on_missing_key_is_conflict<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let other = t.store.put("other", b"x".to_vec()).await.expect("put");
    assert_conflict_on(
        t.store.update("missing", other, b"v".to_vec()).await,
        "missing",
    );
    assert_eq!(value_of(&*t.store, "missing").await, None);
}

/// Deleting a key that does not exist succeeds and changes nothing else.
pub async fn delete_missing_key_succeeds<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    t.store.put("keep", b"x".to_vec()).await.expect("put");
    t.store
        .delete("missing")
        .await
        .expect("delete of a missing key succeeds");
    assert_eq!(value_of(&*t.store, "keep").await, Some(b"x".to_vec()));
    assert_eq!(value_of(&*t.store, "missing").await, None);
}

/// `delete_at` with the current revision removes the key.
pub async fn delete_at_current_revision_removes_key<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let r = t.store.create("k", b"v".to_vec()).await.expect("create");
    t.store.delete_at("k", r).await.expect("delete_at");
    assert_eq!(t.store.get("k").await.expect("get"), None);
    assert!(t.store.list("").await.expect("list").is_empty());
}

/// `delete_at` with a stale revision, or on a missing key, is a conflict and keeps the key.
pub async fn delete_at_stale_revision_is_conflict_and_keeps_key<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let r1 = t.store.create("k", b"a".to_vec()).await.expect("create");
    let r2 = t
        .store
        .update("k", r1, b"b".to_vec())
        .await
        .expect("update");
    assert_conflict_on(t.store.delete_at("k", r1).await, "k");
    assert_eq!(revision_of(&*t.store, "k").await, r2);
    assert_conflict_on(t.store.delete_at("missing", r2).await, "missing");
}

/// A deleted key reads as absent, so `create` works on it again with a newer revision.
pub async fn deleted_key_can_be_created_again<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let r1 = t.store.create("k", b"a".to_vec()).await.expect("create");
    t.store.delete("k").await.expect("delete");
    let r2 = t
        .store
        .create("k", b"b".to_vec())
        .await
        .expect("create again");
    assert!(r2 > r1);
    assert_eq!(value_of(&*t.store, "k").await, Some(b"b".to_vec()));
}

/// When every condition holds, every put and delete applies.
pub async fn transaction_applies_every_op_when_conditions_hold<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let ra = t.store.create("a", b"a0".to_vec()).await.expect("create a");
    t.store
        .create("gone", b"g".to_vec())
        .await
        .expect("create gone");
    let rev = t
        .store
        .commit(
            Txn::new()
                .when(Condition::at_revision("a", ra))
                .when(Condition::absent("b"))
                .then(Op::put("a", b"a1".to_vec()))
                .then(Op::put("b", b"b1".to_vec()))
                .then(Op::delete("gone")),
        )
        .await
        .expect("commit");
    assert_eq!(value_of(&*t.store, "a").await, Some(b"a1".to_vec()));
    assert_eq!(value_of(&*t.store, "b").await, Some(b"b1".to_vec()));
    assert_eq!(value_of(&*t.store, "gone").await, None);
    assert_eq!(revision_of(&*t.store, "a").await, rev);
}

/// One failed condition among many leaves every key untouched.
pub async fn transaction_with_one_failed_condition_writes_nothing<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let mut revisions = Vec::new();
    for i in 0..5 {
        revisions.push(
            t.store
                .create(&format!("k{i}"), vec![i])
                .await
                .expect("create"),
        );
    }
    let mut txn = Txn::new();
    for (i, rev) in revisions.iter().enumerate() {
        // k3's condition names a stale revision; all others hold.
        let expected = if i == 3 {
            Revision(rev.0.saturating_sub(1))
        } else {
            *rev
        };
        txn = txn.when(Condition::at_revision(format!("k{i}"), expected));
        txn = txn.then(Op::put(format!("k{i}"), b"changed".to_vec()));
    }
    txn = txn
        .then(Op::put("new", b"n".to_vec()))
        .then(Op::delete("also-new"));
    t.store.put("also-new", b"a".to_vec()).await.expect("put");
    let before = t.store.list("").await.expect("list");
    assert_conflict_on(t.store.commit(txn).await, "k3");
    assert_eq!(
        t.store.list("").await.expect("list"),
        before,
        "store changed after a failed transaction"
    );
}

/// No stored key is at revision 0 or at the largest revision, so a condition naming either never
/// holds, whether the key exists or not, and its transaction writes nothing.
pub async fn a_condition_at_revision_zero_or_the_largest_never_holds<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    t.store
        .create("present", b"p".to_vec())
        .await
        .expect("create");
    for key in ["missing", "present"] {
        for revision in [Revision(0), Revision(u64::MAX)] {
            let before = t.store.list("").await.expect("list");
            assert_conflict_on(
                t.store
                    .commit(
                        Txn::new()
                            .when(Condition::at_revision(key, revision))
                            .then(Op::put("written", b"w".to_vec())),
                    )
                    .await,
                key,
            );
            assert_eq!(
                t.store.list("").await.expect("list"),
                before,
                "a condition on {key} at {revision:?} held"
            );
        }
    }
}

/// The conflict error names the first condition, in order, that failed.
pub async fn conflict_names_first_failed_key<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    t.store
        .create("exists1", b"1".to_vec())
        .await
        .expect("create");
    t.store
        .create("exists2", b"2".to_vec())
        .await
        .expect("create");
    let txn = Txn::new()
        .when(Condition::absent("free"))
        .when(Condition::absent("exists2"))
        .when(Condition::absent("exists1"))
        .then(Op::put("free", b"x".to_vec()));
    assert_conflict_on(t.store.commit(txn).await, "exists2");
    assert_eq!(value_of(&*t.store, "free").await, None);
}

/// A transaction's deletes and puts land together or not at all, as seen by a later list.
pub async fn transaction_mixing_puts_and_deletes_is_atomic<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    for i in 0..10 {
        t.store
            .put(&format!("old/{i}"), vec![i])
            .await
            .expect("put");
    }
    let mut txn = Txn::new();
    for i in 0..10 {
        txn = txn.then(Op::delete(format!("old/{i}")));
        txn = txn.then(Op::put(format!("new/{i}"), vec![i]));
    }
    t.store.commit(txn).await.expect("commit");
    assert!(t.store.list_dir("old").await.expect("list").is_empty());
    let new: Vec<_> = t
        .store
        .list_dir("new")
        .await
        .expect("list")
        .into_iter()
        .map(|kv| kv.value)
        .collect();
    assert_eq!(new, (0..10).map(|i| vec![i]).collect::<Vec<_>>());
}

/// A listing answers the store at one moment: while transactions keep rewriting every key of a
/// directory at once, no listing (alone, or as a read of a batch) shows some keys as one of them
/// left them and others as another did.
pub async fn a_list_never_sees_half_a_transaction<F: StoreFactory>(factory: &F) {
    // Enough keys and bytes to span many of an embedded engine's pages or tree nodes.
    const KEYS: usize = 64;
    const VALUE_BYTES: usize = 1024;
    const COMMITS: u64 = 100;
    const READERS: usize = 2;
    let t = factory.fresh().await;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("whole/{i:02}")).collect();
    let value_of_round = |round: u64| {
        let mut value = round.to_be_bytes().to_vec();
        value.resize(VALUE_BYTES, b'.');
        value
    };
    let rewrite_all = |round: u64| {
        keys.iter().fold(Txn::new(), |txn, key| {
            txn.then(Op::put(key.clone(), value_of_round(round)))
        })
    };
    t.store.commit(rewrite_all(0)).await.expect("first commit");
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let barrier = Arc::new(tokio::sync::Barrier::new(READERS + 1));
    let mut readers = Vec::new();
    for reader in 0..READERS {
        let store = Arc::clone(&t.store);
        let done = Arc::clone(&done);
        let barrier = Arc::clone(&barrier);
        readers.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut listings = 0u64;
            loop {
                let finished = done.load(std::sync::atomic::Ordering::SeqCst);
                let listed = if (listings + reader as u64).is_multiple_of(2) {
                    store.list("whole/").await.expect("list")
                } else {
                    match store
                        .read_many(&[ipam_core::kv::Read::List("whole/".to_owned())])
                        .await
                        .expect("read_many")
                        .pop()
                    {
                        Some(ipam_core::kv::ReadResult::Listed(listed)) => listed,
                        other => panic!("a list read answered {other:?}"),
                    }
                };
                listings += 1;
                assert_eq!(listed.len(), KEYS, "listing {listings}");
                let mut keys_by_write = std::collections::BTreeMap::<_, usize>::new();
                for kv in &listed {
                    *keys_by_write
                        .entry((kv.revision, kv.value.get(..8).map(<[u8]>::to_vec)))
                        .or_default() += 1;
                }
                assert_eq!(
                    keys_by_write.len(),
                    1,
                    "listing {listings} shows the keys of more than one transaction (keys per \
                     revision and round written): {keys_by_write:?}"
                );
                if finished {
                    return listings;
                }
            }
        }));
    }
    barrier.wait().await;
    for round in 1..=COMMITS {
        t.store.commit(rewrite_all(round)).await.expect("commit");
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    for reader in readers {
        let listings = reader.await.expect("reader panicked");
        assert!(listings >= 1, "a reader listed nothing");
    }
    let last = t.store.list("whole/").await.expect("list");
    assert!(
        last.len() == KEYS && last.iter().all(|kv| kv.value == value_of_round(COMMITS)),
        "the last listing is not the last commit's"
    );
}

/// A listing longer than a backend's page (etcd's: 512 keys) and a batch of more reads than one
/// transaction holds each answer the store at one moment: while transactions keep rewriting the
/// first and the last key together, no listing or batch shows them as two different
/// transactions left them.
pub async fn a_long_list_or_batch_never_sees_half_a_transaction<F: StoreFactory>(factory: &F) {
    use ipam_core::kv::{Read, ReadResult};
    const KEYS: usize = 1_200;
    const READS_EACH: usize = 20;
    const READERS: usize = 2;
    let t = factory.fresh().await;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("long/{i:04}")).collect();
    let round_value = |round: u64| round.to_be_bytes().to_vec();
    for chunk in keys.chunks(MAX_TXN_OPS) {
        let fill = chunk.iter().fold(Txn::new(), |txn, key| {
            txn.then(Op::put(key.clone(), round_value(0)))
        });
        t.store.commit(fill).await.expect("fill");
    }
    let (first, last) = (keys[0].clone(), keys[KEYS - 1].clone());
    // The first key, one transaction's worth of others, then the last key: a second batch.
    let batch: Vec<Read> = keys[..=MAX_TXN_OPS]
        .iter()
        .chain(std::iter::once(&last))
        .map(|key| Read::Get(key.clone()))
        .collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let committed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writer = {
        let (store, stop) = (Arc::clone(&t.store), Arc::clone(&stop));
        let committed = Arc::clone(&committed);
        let (first, last) = (first.clone(), last.clone());
        tokio::spawn(async move {
            let mut round = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                round += 1;
                let txn = Txn::new()
                    .then(Op::put(first.clone(), round_value(round)))
                    .then(Op::put(last.clone(), round_value(round)));
                store.commit(txn).await.expect("commit");
                committed.store(round, std::sync::atomic::Ordering::SeqCst);
                tokio::task::yield_now().await;
            }
            round
        })
    };
    let mut readers = Vec::new();
    for reader in 0..READERS {
        let store = Arc::clone(&t.store);
        let batch = batch.clone();
        let committed = Arc::clone(&committed);
        readers.push(tokio::spawn(async move {
            let mut rounds_seen = std::collections::BTreeSet::new();
            let mut after = 0;
            for read in 0..READS_EACH {
                // Each read starts after a commit later than what the reader's last read saw.
                let guard = std::time::Instant::now() + std::time::Duration::from_secs(60);
                while committed.load(std::sync::atomic::Ordering::SeqCst) <= after {
                    assert!(
                        std::time::Instant::now() < guard,
                        "the writer stopped committing"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
                let (how, ends) = if (read + reader).is_multiple_of(2) {
                    let listed = store.list("long/").await.expect("list");
                    assert_eq!(listed.len(), KEYS, "listing {read}");
                    let ends = (listed[0].value.clone(), listed[KEYS - 1].value.clone());
                    ("listing", ends)
                } else {
                    let mut got = store.read_many(&batch).await.expect("read_many");
                    assert_eq!(got.len(), batch.len(), "batch {read}");
                    let mut value = |index: usize| match std::mem::replace(
                        &mut got[index],
                        ReadResult::Listed(Vec::new()),
                    ) {
                        ReadResult::Got(Some(kv)) => kv.value,
                        other => panic!("batch {read}, read {index} answered {other:?}"),
                    };
                    let ends = (value(0), value(MAX_TXN_OPS + 1));
                    ("batch", ends)
                };
                assert_eq!(
                    ends.0, ends.1,
                    "{how} {read} shows the first and the last key as two transactions left them"
                );
                after = ends
                    .0
                    .as_slice()
                    .try_into()
                    .map(u64::from_be_bytes)
                    .expect("a round's value");
                rounds_seen.insert(after);
            }
            rounds_seen.len()
        }));
    }
    let mut rounds_seen = 0;
    for reader in readers {
        rounds_seen += reader.await.expect("reader panicked");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let rounds = writer.await.expect("writer panicked");
    assert!(
        rounds_seen == READERS * READS_EACH,
        "each read of a reader must see a later commit than its last ({rounds} commits; rounds \
         seen {rounds_seen})"
    );
}

/// Each write returns a revision greater than every one before it, whichever key it touches.
pub async fn revisions_only_grow_across_keys<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let mut last = Revision::NONE;
    for i in 0..20u8 {
        let key = format!("key{}", i % 3);
        let rev = if i % 5 == 4 {
            t.store.delete(&key).await.expect("delete")
        } else {
            t.store.put(&key, vec![i]).await.expect("put")
        };
        assert!(rev > last, "revision {rev} after {last} did not grow");
        last = rev;
        for kv in t.store.list("").await.expect("list") {
            assert!(
                kv.revision <= last,
                "a stored revision is ahead of the last write"
            );
        }
    }
}

/// Every key a transaction puts carries the revision the commit returned.
pub async fn every_key_put_carries_the_commit_revision<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    t.store.put("untouched", b"u".to_vec()).await.expect("put");
    let rev = t
        .store
        .commit(
            Txn::new()
                .then(Op::put("x", b"1".to_vec()))
                .then(Op::put("y", b"2".to_vec())),
        )
        .await
        .expect("commit");
    assert_eq!(revision_of(&*t.store, "x").await, rev);
    assert_eq!(revision_of(&*t.store, "y").await, rev);
    assert!(revision_of(&*t.store, "untouched").await < rev);
}

/// A failed transaction neither changes keys nor makes the next write's revision go backwards.
pub async fn failed_transaction_does_not_advance_visible_revisions<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let r1 = t.store.create("k", b"v".to_vec()).await.expect("create");
    assert!(t.store.create("k", b"w".to_vec()).await.is_err());
    assert_eq!(revision_of(&*t.store, "k").await, r1);
    let r2 = t.store.put("other", b"o".to_vec()).await.expect("put");
    assert!(r2 > r1);
}

async fn keys_of(store: &dyn KvStore, prefix: &str) -> Vec<String> {
    store
        .list(prefix)
        .await
        .expect("list")
        .into_iter()
        .map(|kv| kv.key)
        .collect()
}

/// `list("a/b")` is a plain string prefix: it returns `a/b`, `a/b/...` and `a/bc...`.
pub async fn list_prefix_is_a_string_prefix<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    for key in ["a/a", "a/b", "a/b/c", "a/bc/d", "a/c", "b"] {
        t.store
            .put(key, key.as_bytes().to_vec())
            .await
            .expect("put");
    }
    assert_eq!(keys_of(&*t.store, "a/b").await, ["a/b", "a/b/c", "a/bc/d"]);
    assert_eq!(keys_of(&*t.store, "a/b/").await, ["a/b/c"]);
    assert_eq!(keys_of(&*t.store, "zz").await, Vec::<String>::new());
}

/// `list_dir("a/b")` returns only keys under `a/b/`, at any depth, never `a/bc`.
pub async fn list_dir_returns_only_children<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    for key in ["a/b", "a/b/c", "a/b/c/d", "a/bc/d", "a/b0"] {
        t.store.put(key, Vec::new()).await.expect("put");
    }
    let children: Vec<String> = t
        .store
        .list_dir("a/b")
        .await
        .expect("list")
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(children, ["a/b/c", "a/b/c/d"]);
    let same: Vec<String> = t
        .store
        .list_dir("a/b/")
        .await
        .expect("list")
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(same, children);
}

/// Listing is sorted by key bytes, whatever the order of writing.
pub async fn list_is_sorted_by_key<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let keys = ["p/9", "p/10", "p/1", "p/Z", "p/a", "p/ä", "p/-", "p/~"];
    for key in keys {
        t.store.put(key, Vec::new()).await.expect("put");
    }
    let mut expected: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    expected.sort(); // String's Ord is byte-wise on UTF-8
    assert_eq!(keys_of(&*t.store, "p/").await, expected);
}

/// An empty prefix lists every key in the store.
pub async fn empty_prefix_lists_everything<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    for key in ["x", "y/z", "\u{263a}"] {
        t.store.put(key, Vec::new()).await.expect("put");
    }
    assert_eq!(keys_of(&*t.store, "").await, ["x", "y/z", "\u{263a}"]);
}

/// Each listed entry carries the revision of its own last write.
pub async fn list_reports_each_key_revision<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let r1 = t.store.put("d/1", b"1".to_vec()).await.expect("put");
    let r2 = t.store.put("d/2", b"2".to_vec()).await.expect("put");
    let r3 = t.store.put("d/1", b"1b".to_vec()).await.expect("put");
    let listed: Vec<(String, Vec<u8>, Revision)> = t
        .store
        .list_dir("d")
        .await
        .expect("list")
        .into_iter()
        .map(|kv| (kv.key, kv.value, kv.revision))
        .collect();
    assert!(r3 > r1);
    assert_eq!(
        listed,
        vec![
            ("d/1".into(), b"1b".to_vec(), r3),
            ("d/2".into(), b"2".to_vec(), r2)
        ]
    );
}

/// An empty value is stored and read back as empty, distinct from absent.
pub async fn empty_value_round_trips<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    t.store.create("empty", Vec::new()).await.expect("create");
    assert_eq!(value_of(&*t.store, "empty").await, Some(Vec::new()));
    assert_conflict_on(t.store.create("empty", b"x".to_vec()).await, "empty");
}

/// A 1 MiB value round-trips byte for byte.
pub async fn one_mebibyte_value_round_trips<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let value: Vec<u8> = (0..1024 * 1024)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    t.store.put("big", value.clone()).await.expect("put 1 MiB");
    let back = value_of(&*t.store, "big").await.expect("present");
    assert_eq!(back.len(), value.len());
    assert!(
        back == value,
        "1 MiB value changed on the way through the store"
    );
}

/// Keys with `/`, `:`, spaces and non-ASCII characters round-trip unchanged.
pub async fn keys_with_slash_colon_and_unicode_round_trip<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let keys = [
        "/calico/ipam/v2/assignment/ipv4/block/10.0.0.0-26",
        "handle/k8s-pod-network.abc:def",
        "fd00::/122",
        "nœud/東京/🚀",
        "with space",
    ];
    for (i, key) in keys.iter().enumerate() {
        t.store.create(key, vec![i as u8]).await.expect("create");
    }
    for (i, key) in keys.iter().enumerate() {
        let kv = t.store.get(key).await.expect("get").expect("present");
        assert_eq!(kv.key, *key);
        assert_eq!(kv.value, vec![i as u8]);
    }
    let mut listed = keys_of(&*t.store, "").await;
    let mut expected: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    expected.sort();
    listed.sort();
    assert_eq!(listed, expected);
}

/// An empty key is refused as an invalid argument, in reads and writes.
pub async fn empty_key_is_invalid_argument<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    assert_invalid(t.store.get("").await);
    assert_invalid(t.store.put("", b"v".to_vec()).await);
    assert!(t.store.list("").await.expect("list").is_empty());
}

/// Writing one key twice in a transaction is invalid, and nothing of it is written.
pub async fn key_written_twice_in_one_transaction_is_invalid_and_writes_nothing<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let txn = Txn::new()
        .then(Op::put("other", b"o".to_vec()))
        .then(Op::put("k", b"1".to_vec()))
        .then(Op::delete("k"));
    assert_invalid(t.store.commit(txn).await);
    assert!(t.store.list("").await.expect("list").is_empty());
}

/// A transaction with conditions but no operation is invalid.
pub async fn transaction_without_ops_is_invalid<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    assert_invalid(
        t.store
            .commit(Txn::new().when(Condition::absent("k")))
            .await,
    );
}

/// More than `MAX_TXN_OPS` operations is invalid, and nothing is written.
pub async fn too_many_ops_is_invalid_argument<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let mut txn = Txn::new();
    for i in 0..=MAX_TXN_OPS {
        txn = txn.then(Op::put(format!("k{i}"), Vec::new()));
    }
    assert_invalid(t.store.commit(txn).await);
    assert!(t.store.list("").await.expect("list").is_empty());
    let mut at_limit = Txn::new();
    for i in 0..MAX_TXN_OPS {
        at_limit = at_limit.then(Op::put(format!("k{i:03}"), Vec::new()));
    }
    t.store
        .commit(at_limit)
        .await
        .expect("exactly MAX_TXN_OPS operations are accepted");
    assert_eq!(t.store.list("").await.expect("list").len(), MAX_TXN_OPS);
}

/// A value over `MAX_VALUE_BYTES` is invalid and not written.
pub async fn oversized_value_is_invalid_argument<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    assert_invalid(t.store.put("huge", vec![0u8; MAX_VALUE_BYTES + 1]).await);
    assert_eq!(value_of(&*t.store, "huge").await, None);
}

/// Reads a little-endian counter, treating a missing key as zero.
pub async fn read_counter(
    store: &dyn KvStore,
    key: &str,
) -> Result<(u64, Option<Revision>), KvError> {
    Ok(match store.get(key).await? {
        None => (0, None),
        Some(kv) => {
            let bytes: [u8; 8] = kv
                .value
                .as_slice()
                .try_into()
                .map_err(|_| KvError::corrupt(Some(key), "counter is not 8 bytes"))?;
            (u64::from_le_bytes(bytes), Some(kv.revision))
        }
    })
}

/// Adds one to a counter with compare-and-swap, retrying on conflict; returns the attempts used.
pub async fn cas_increment(store: &dyn KvStore, key: &str) -> Result<u32, KvError> {
    cas_increment_observed(store, key)
        .await
        .map(|increment| increment.attempts)
}

/// One successful compare-and-swap increment, and what it took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Increment {
    /// The counter value this increment's successful commit wrote.
    pub written: u64,
    /// Reads and writes tried, the successful one included.
    pub attempts: u32,
    /// Writes refused because another writer changed the counter after this one read it.
    pub conflicts: u32,
}

/// Adds one to a counter with compare-and-swap, retrying on conflict (and, after a pause, when
/// the store is unavailable); reports the value written and the conflicts met.
pub async fn cas_increment_observed(store: &dyn KvStore, key: &str) -> Result<Increment, KvError> {
    let mut increment = Increment::default();
    loop {
        increment.attempts += 1;
        let (count, revision) = read_counter(store, key).await?;
        match write_counter(store, key, count, revision).await {
            Ok(written) => {
                increment.written = written;
                return Ok(increment);
            }
            Err(KvError::Conflict { .. }) => increment.conflicts += 1,
            Err(e) if e.is_retryable() => {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Writes `count + 1` if the counter is still at `revision` (absent for `None`); returns it.
async fn write_counter(
    store: &dyn KvStore,
    key: &str,
    count: u64,
    revision: Option<Revision>,
) -> Result<u64, KvError> {
    let next = count + 1;
    let bytes = next.to_le_bytes().to_vec();
    match revision {
        None => store.create(key, bytes).await?,
        Some(rev) => store.update(key, rev, bytes).await?,
    };
    Ok(next)
}

/// 16 workers × 100 compare-and-swap increments on one key end at exactly 1600, every value from
/// 1 to 1600 written by exactly one successful commit, and the store refuses the stale writes.
///
/// Each worker's first increment is forced to race: every worker reads the counter before any of
/// them writes (a barrier between read and write), so exactly one write succeeds and the other 15
/// must be conflicts. Without that, a store could pass with no conflict at all, legitimately:
/// a scheduler may run the free-running workers one after another (the in-memory store never
/// yields between a worker's read and its write), so "some conflict happened" is asserted only
/// where it is certain. A store that accepted a stale compare-and-swap fails twice over: two
/// commits write the same value (and some value is never written), and the sum comes out short.
pub async fn concurrent_cas_increments_sum_exactly<F: StoreFactory>(factory: &F) {
    const WORKERS: usize = 16;
    const INCREMENTS: usize = 100;
    let t = factory.fresh().await;
    let barrier = Arc::new(tokio::sync::Barrier::new(WORKERS));
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let store = Arc::clone(&t.store);
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            let mut written = Vec::with_capacity(INCREMENTS);
            let (count, revision) = read_counter(&*store, "counter").await.expect("read");
            barrier.wait().await;
            let forced = match write_counter(&*store, "counter", count, revision).await {
                Ok(value) => {
                    written.push(value);
                    ForcedRace::Won
                }
                Err(KvError::Conflict { .. }) => ForcedRace::Conflict,
                Err(e) if e.is_retryable() => ForcedRace::Unavailable,
                Err(e) => panic!("forced racing write failed: {e}"),
            };
            while written.len() < INCREMENTS {
                let increment = cas_increment_observed(&*store, "counter")
                    .await
                    .expect("increment");
                written.push(increment.written);
            }
            (forced, written)
        }));
    }
    let mut forced = Vec::new();
    let mut written = Vec::new();
    for task in tasks {
        let (race, values) = task.await.expect("worker panicked");
        forced.push(race);
        written.extend(values);
    }
    let (count, _) = read_counter(&*t.store, "counter").await.expect("read");
    assert_eq!(
        count,
        (WORKERS * INCREMENTS) as u64,
        "lost or duplicated increments"
    );
    assert_eq!(
        written.len(),
        WORKERS * INCREMENTS,
        "successful increment commits"
    );
    written.sort_unstable();
    let duplicated: Vec<u64> = written
        .windows(2)
        .filter(|pair| pair[0] == pair[1])
        .map(|pair| pair[0])
        .collect();
    assert!(
        duplicated.is_empty(),
        "two successful compare-and-swaps wrote the same value (a stale write was accepted): \
         {duplicated:?}"
    );
    assert_eq!(
        written,
        (1..=(WORKERS * INCREMENTS) as u64).collect::<Vec<_>>(),
        "each value from 1 to {} is written by exactly one commit",
        WORKERS * INCREMENTS
    );
    let won = forced.iter().filter(|r| **r == ForcedRace::Won).count();
    let conflicts = forced
        .iter()
        .filter(|r| **r == ForcedRace::Conflict)
        .count();
    let unavailable = WORKERS - won - conflicts;
    assert!(
        won <= 1,
        "{won} writes from the same read succeeded in the forced race: {forced:?}"
    );
    assert!(
        conflicts + unavailable >= WORKERS - 1,
        "the forced race of {WORKERS} writes from one read saw only {conflicts} conflicts: \
         {forced:?}"
    );
    if unavailable == 0 {
        assert_eq!(
            (won, conflicts),
            (1, WORKERS - 1),
            "the forced race of {WORKERS} writes from one read: one must win, the rest conflict"
        );
    }
}

/// How a worker's forced racing write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ForcedRace {
    Won,
    Conflict,
    Unavailable,
}

/// Of 16 concurrent `create`s of one key exactly one succeeds; the rest are conflicts.
pub async fn concurrent_creates_of_one_key_have_one_winner<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let mut tasks = Vec::new();
    for i in 0..16u8 {
        let store = Arc::clone(&t.store);
        tasks.push(tokio::spawn(async move {
            (i, store.create("lock", vec![i]).await)
        }));
    }
    let mut winners = Vec::new();
    for task in tasks {
        let (i, result) = task.await.expect("task panicked");
        match result {
            Ok(_) => winners.push(i),
            Err(KvError::Conflict { key }) => assert_eq!(key, "lock"),
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    assert_eq!(value_of(&*t.store, "lock").await, Some(vec![winners[0]]));
}

/// `read_many` answers every get and list in request order, as the single calls would.
pub async fn read_many_answers_each_read_in_order<F: StoreFactory>(factory: &F) {
    use ipam_core::kv::{Read, ReadResult};
    let t = factory.fresh().await;
    let ra = t.store.put("d/a", b"a".to_vec()).await.expect("put");
    let rb = t.store.put("d/b", b"b".to_vec()).await.expect("put");
    t.store.put("e", b"e".to_vec()).await.expect("put");
    let results = t
        .store
        .read_many(&[
            Read::List("d/".into()),
            Read::Get("missing".into()),
            Read::Get("e".into()),
            Read::List("zz".into()),
        ])
        .await
        .expect("read_many");
    assert_eq!(results.len(), 4);
    let listed: Vec<(String, Revision)> = match &results[0] {
        ReadResult::Listed(kvs) => kvs.iter().map(|kv| (kv.key.clone(), kv.revision)).collect(),
        other => panic!("expected a list result, got {other:?}"),
    };
    assert_eq!(
        listed,
        vec![("d/a".to_string(), ra), ("d/b".to_string(), rb)]
    );
    assert_eq!(results[1], ReadResult::Got(None));
    assert!(matches!(&results[2], ReadResult::Got(Some(kv)) if kv.value == b"e"));
    assert_eq!(results[3], ReadResult::Listed(Vec::new()));
    assert_invalid(t.store.read_many(&[Read::Get(String::new())]).await);
}

/// The keys a range case reads: five under `r/a/` written one at a time (each with a revision of
/// its own), and three around it that share a string prefix with it or sort next to it.
async fn put_keys_in_and_around_r_a(store: &dyn KvStore) {
    for key in [
        "r/a/3", "r/a/1", "r/a/5", "r/a/2", "r/a/4", "r/a", "r/ab", "r/b",
    ] {
        store
            .put(key, format!("value of {key}").into_bytes())
            .await
            .unwrap_or_else(|e| panic!("put {key:?} failed: {e}"));
    }
}

/// The answer to one `Read::Range` of `prefix` from `from`, at most `limit` keys.
async fn range_of(
    store: &dyn KvStore,
    prefix: &str,
    from: &str,
    limit: u32,
) -> Result<Vec<ipam_core::kv::KeyValue>, KvError> {
    use ipam_core::kv::Read;
    let mut results = store.read_many(&[Read::range(prefix, from, limit)]).await?;
    assert_eq!(results.len(), 1, "one read, {} results", results.len());
    results.remove(0).into_listed()
}

/// The keys of a range's answer, or a panic naming the range.
async fn range_keys(store: &dyn KvStore, prefix: &str, from: &str, limit: u32) -> Vec<String> {
    range_of(store, prefix, from, limit)
        .await
        .unwrap_or_else(|e| panic!("range of {prefix:?} from {from:?}, {limit}: {e}"))
        .into_iter()
        .map(|kv| kv.key)
        .collect()
}

/// A range from a key in the middle of a prefix answers exactly `limit` keys from it (the key
/// itself included) in ascending order, each with the value and revision `get` returns; from a
/// key that does not exist it starts at the next one.
pub async fn range_from_the_middle_answers_limit_keys_as_get_does<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    put_keys_in_and_around_r_a(&*t.store).await;
    let window = range_of(&*t.store, "r/a/", "r/a/2", 3)
        .await
        .expect("a range");
    let mut expected = Vec::new();
    for key in ["r/a/2", "r/a/3", "r/a/4"] {
        expected.push(t.store.get(key).await.expect("get").expect("present"));
    }
    assert_eq!(window, expected);
    assert_eq!(
        range_keys(&*t.store, "r/a/", "r/a/25", 2).await,
        ["r/a/3", "r/a/4"]
    );
}

/// A range from a key below its prefix (the empty key, a shorter key the prefix starts with, a
/// key sorting before it) starts at the prefix's first key.
pub async fn range_from_below_the_prefix_starts_at_its_first_key<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    put_keys_in_and_around_r_a(&*t.store).await;
    for from in ["", "r/", "r/a", "a"] {
        assert_eq!(
            range_keys(&*t.store, "r/a/", from, 2).await,
            ["r/a/1", "r/a/2"],
            "from {from:?}"
        );
    }
}

/// A range from past the prefix's last key, or of a prefix without keys, is empty.
pub async fn range_from_past_the_last_key_is_empty<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    put_keys_in_and_around_r_a(&*t.store).await;
    assert!(range_keys(&*t.store, "r/a/", "r/a/6", 3).await.is_empty());
    assert!(range_keys(&*t.store, "r/a/", "r/b", 3).await.is_empty());
    assert!(range_keys(&*t.store, "zz/", "", 3).await.is_empty());
}

/// A range never answers a key outside its prefix, however near it sorts: `r/ab` and `r/b` are not
/// in `r/a/` (as with `list`, the prefix is a string prefix: `r/ab` is in `r/a`).
pub async fn range_never_answers_a_key_outside_its_prefix<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    for key in ["r/a/1", "r/a/2", "r/ab", "r/b"] {
        t.store.put(key, b"v".to_vec()).await.expect("put");
    }
    assert_eq!(
        range_keys(&*t.store, "r/a/", "r/a/", 10).await,
        ["r/a/1", "r/a/2"]
    );
    assert_eq!(range_keys(&*t.store, "r/a/", "r/a/2", 10).await, ["r/a/2"]);
    assert!(range_keys(&*t.store, "r/a/", "r/a/3", 10).await.is_empty());
    assert_eq!(range_keys(&*t.store, "r/a", "r/a/3", 10).await, ["r/ab"]);
}

/// A range whose limit is larger than what is left of its prefix answers the rest: the whole
/// listing from its first key on.
pub async fn range_with_a_limit_beyond_the_rest_answers_the_rest<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    put_keys_in_and_around_r_a(&*t.store).await;
    assert_eq!(
        range_keys(&*t.store, "r/a/", "r/a/4", 100).await,
        ["r/a/4", "r/a/5"]
    );
    let listed = t.store.list("r/a/").await.expect("list");
    assert_eq!(listed.len(), 5);
    assert_eq!(
        range_of(&*t.store, "r/a/", "", u32::MAX)
            .await
            .expect("a range"),
        listed
    );
}

/// A range of limit 0 is an invalid argument, alone or in a batch with other reads: the batch
/// answers nothing.
pub async fn range_of_limit_0_is_invalid_argument<F: StoreFactory>(factory: &F) {
    use ipam_core::kv::Read;
    let t = factory.fresh().await;
    put_keys_in_and_around_r_a(&*t.store).await;
    assert_invalid(range_of(&*t.store, "r/a/", "", 0).await);
    assert_invalid(
        t.store
            .read_many(&[
                Read::Get("r/a/1".into()),
                Read::range("r/a/", "r/a/2", 0),
                Read::List("r/a/".into()),
            ])
            .await,
    );
}

/// Ranges in a batch with gets and lists are answered in request order, each as its single call
/// would: a range as the window of its prefix's listing.
pub async fn read_many_answers_ranges_beside_gets_and_lists_in_order<F: StoreFactory>(factory: &F) {
    use ipam_core::kv::{Read, ReadResult};
    let t = factory.fresh().await;
    put_keys_in_and_around_r_a(&*t.store).await;
    let results = t
        .store
        .read_many(&[
            Read::range("r/a/", "r/a/2", 2),
            Read::Get("r/b".into()),
            Read::List("r/a/".into()),
            Read::range("r/", "r/a/5", 2),
            Read::Get("missing".into()),
        ])
        .await
        .expect("read_many");
    assert_eq!(results.len(), 5);
    let listed = t.store.list("r/a/").await.expect("list");
    assert_eq!(results[0], ReadResult::Listed(listed[1..3].to_vec()));
    assert_eq!(
        results[1],
        ReadResult::Got(t.store.get("r/b").await.expect("get"))
    );
    assert_eq!(results[2], ReadResult::Listed(listed));
    let from_r_a_5: Vec<_> = t
        .store
        .list("r/")
        .await
        .expect("list")
        .into_iter()
        .filter(|kv| kv.key.as_str() >= "r/a/5")
        .take(2)
        .collect();
    assert_eq!(
        from_r_a_5
            .iter()
            .map(|kv| kv.key.as_str())
            .collect::<Vec<_>>(),
        ["r/a/5", "r/ab"]
    );
    assert_eq!(results[3], ReadResult::Listed(from_r_a_5));
    assert_eq!(results[4], ReadResult::Got(None));
}

/// What the limits allow, a store accepts: a value of exactly `MAX_VALUE_BYTES`, and one
/// transaction of `MAX_TXN_CONDITIONS` conditions and `MAX_TXN_OPS` puts whose keys and values
/// come to exactly `MAX_TXN_BYTES`, each read back whole.
pub async fn the_largest_value_and_the_largest_transaction_are_written_whole<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let largest: Vec<u8> = (0..MAX_VALUE_BYTES).map(|i| (i % 251) as u8).collect();
    t.store
        .put("largest", largest.clone())
        .await
        .expect("a value of MAX_VALUE_BYTES");
    assert!(
        value_of(&*t.store, "largest").await == Some(largest),
        "the largest value read back differs"
    );
    let keys: Vec<String> = (0..MAX_TXN_OPS).map(|i| format!("t/{i:03}")).collect();
    // Each key tested (absent) and written: counted twice.
    let key_bytes: usize = 2 * keys.iter().map(String::len).sum::<usize>();
    let value_bytes = MAX_TXN_BYTES - key_bytes;
    let each = value_bytes / MAX_TXN_OPS;
    let values: Vec<Vec<u8>> = (0..MAX_TXN_OPS)
        .map(|i| {
            let len = if i == MAX_TXN_OPS - 1 {
                value_bytes - each * (MAX_TXN_OPS - 1)
            } else {
                each
            };
            vec![i as u8; len]
        })
        .collect();
    assert_eq!(MAX_TXN_CONDITIONS, MAX_TXN_OPS, "one condition per put");
    let txn = keys
        .iter()
        .zip(&values)
        .fold(Txn::new(), |txn, (key, value)| {
            txn.when(Condition::absent(key.clone()))
                .then(Op::put(key.clone(), value.clone()))
        });
    t.store.commit(txn).await.expect(
        "a transaction of MAX_TXN_CONDITIONS conditions, MAX_TXN_OPS puts and MAX_TXN_BYTES",
    );
    let listed = t.store.list("t/").await.expect("list");
    assert_eq!(listed.len(), MAX_TXN_OPS);
    for ((kv, key), value) in listed.iter().zip(&keys).zip(&values) {
        assert!(
            &kv.key == key && &kv.value == value,
            "{key} read back as {} ({} bytes)",
            kv.key,
            kv.value.len()
        );
    }
}

/// A transaction whose keys and values exceed `MAX_TXN_BYTES` in all is invalid and writes nothing,
/// even when each value alone is allowed.
pub async fn transaction_over_the_total_size_limit_is_invalid_and_writes_nothing<
    F: StoreFactory,
>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let value = vec![7u8; MAX_TXN_BYTES / 2 + 1];
    let txn = Txn::new()
        .then(Op::put("a", value.clone()))
        .then(Op::put("b", value));
    assert_invalid(t.store.commit(txn).await);
    assert!(t.store.list("").await.expect("list").is_empty());
}

/// A transaction that changes nothing (deleting a missing key) never returns a revision older than
/// one already seen, and the next real write is newer than both.
pub async fn commit_that_changes_nothing_never_goes_backwards<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let before = t.store.put("k", b"v".to_vec()).await.expect("put");
    let noop = t
        .store
        .delete("never-existed")
        .await
        .expect("delete of a missing key");
    assert!(
        noop >= before,
        "no-op commit returned {noop}, before {before}"
    );
    let after = t.store.put("k2", b"v".to_vec()).await.expect("put");
    assert!(after > before && after >= noop);
}

/// Puts `p/a`, `p/b` and, outside the string prefix `p/`, `p`, `pa` and `q/x`; returns the
/// newest revision under `p/` (that of `p/b`).
async fn put_keys_in_and_around_p(store: &dyn KvStore) -> Revision {
    store.put("p/a", b"a".to_vec()).await.expect("put p/a");
    let newest = store.put("p/b", b"b".to_vec()).await.expect("put p/b");
    for key in ["p", "pa", "q/x"] {
        store.put(key, b"o".to_vec()).await.expect("put outside");
    }
    newest
}

/// A transaction conditioned on "no key under the prefix put after R" applies while every key
/// there carries R or less, and conflicts, naming the prefix and writing nothing, once a key
/// there is put again or a new one is put: by another transaction or by one of this store's
/// convenience writes.
pub async fn no_put_after_holds_until_a_key_under_the_prefix_is_put<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let newest = put_keys_in_and_around_p(&*t.store).await;
    let guarded = |revision: Revision, value: &[u8]| {
        Txn::new()
            .when(Condition::no_put_after("p/", revision))
            .then(Op::put("out/result", value.to_vec()))
    };
    t.store
        .commit(guarded(newest, b"1"))
        .await
        .expect("nothing under p/ was put after its newest revision");
    // A revision beyond the newest holds too: the condition bounds revisions from above.
    t.store
        .commit(guarded(Revision(newest.get() + 1_000), b"2"))
        .await
        .expect("a bound above the newest revision holds");
    // One revision short of the newest key's: p/b was put after it.
    assert_conflict_on(
        t.store
            .commit(guarded(Revision(newest.get() - 1), b"3"))
            .await,
        "p/",
    );
    assert_eq!(value_of(&*t.store, "out/result").await, Some(b"2".to_vec()));
    // An existing key put again.
    let rewritten = revision_of(&*t.store, "p/a").await;
    t.store
        .update("p/a", rewritten, b"a2".to_vec())
        .await
        .expect("update p/a");
    assert_conflict_on(t.store.commit(guarded(newest, b"4")).await, "p/");
    // A new key below the prefix, at any depth.
    let again = revision_of(&*t.store, "p/a").await;
    t.store
        .commit(guarded(again, b"5"))
        .await
        .expect("holds at the rewrite's revision");
    t.store
        .create("p/deeper/c", b"c".to_vec())
        .await
        .expect("create p/deeper/c");
    assert_conflict_on(t.store.commit(guarded(again, b"6")).await, "p/");
    assert_eq!(value_of(&*t.store, "out/result").await, Some(b"5".to_vec()));
}

/// Keys outside the string prefix never fail the condition, whatever their revision, and a
/// delete under the prefix is not a put: the condition still holds after one.
pub async fn no_put_after_ignores_keys_outside_the_prefix_and_deletes<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let newest = put_keys_in_and_around_p(&*t.store).await;
    for key in ["p", "pa", "p0", "o/p/x", "q/x"] {
        t.store.put(key, b"later".to_vec()).await.expect("put");
    }
    t.store.delete("p/a").await.expect("delete p/a");
    t.store
        .commit(
            Txn::new()
                .when(Condition::no_put_after("p/", newest))
                .then(Op::put("out/result", b"1".to_vec())),
        )
        .await
        .expect("only puts under p/ fail the condition");
    assert_eq!(value_of(&*t.store, "out/result").await, Some(b"1".to_vec()));
}

/// A prefix with no key holds at revision 0 (a listing that answered nothing), until a key is
/// put there; the empty prefix tests every key of the store.
pub async fn no_put_after_on_a_prefix_without_keys_holds_until_one_is_put<F: StoreFactory>(
    factory: &F,
) {
    let t = factory.fresh().await;
    let guarded = |prefix: &str, value: &[u8]| {
        Txn::new()
            .when(Condition::no_put_after(prefix, Revision::NONE))
            .then(Op::put("first", value.to_vec()))
    };
    t.store
        .commit(guarded("", b"1"))
        .await
        .expect("an empty store holds for the empty prefix at revision 0");
    assert_conflict_on(t.store.commit(guarded("", b"2")).await, "");
    t.store
        .commit(guarded("x/", b"3"))
        .await
        .expect("nothing under x/ yet");
    t.store.put("x/1", b"1".to_vec()).await.expect("put x/1");
    assert_conflict_on(t.store.commit(guarded("x/", b"4")).await, "x/");
    assert_eq!(value_of(&*t.store, "first").await, Some(b"3".to_vec()));
}

/// A conflict names the first failed condition in order, prefix conditions among key
/// conditions; a prefix and a key of the same text are two conditions, a prefix tested twice
/// or one holding NUL is an invalid argument.
pub async fn no_put_after_takes_its_place_among_the_conditions<F: StoreFactory>(factory: &F) {
    let t = factory.fresh().await;
    let newest = put_keys_in_and_around_p(&*t.store).await;
    let stale = Condition::no_put_after("p/", Revision(newest.get() - 1));
    let first_prefix = Txn::new()
        .when(Condition::absent("free"))
        .when(stale.clone())
        .when(Condition::absent("q/x"))
        .then(Op::put("free", b"x".to_vec()));
    assert_conflict_on(t.store.commit(first_prefix).await, "p/");
    let first_key = Txn::new()
        .when(Condition::absent("q/x"))
        .when(stale.clone())
        .then(Op::put("free", b"x".to_vec()));
    assert_conflict_on(t.store.commit(first_key).await, "q/x");
    assert_eq!(value_of(&*t.store, "free").await, None);
    // "p" as a key (it exists) and "p" as a prefix (p, p/a, p/b, pa): two conditions.
    let p_revision = revision_of(&*t.store, "p").await;
    let newest_under_p = revision_of(&*t.store, "pa").await.max(p_revision);
    t.store
        .commit(
            Txn::new()
                .when(Condition::at_revision("p", p_revision))
                .when(Condition::no_put_after("p", newest_under_p))
                .then(Op::put("free", b"y".to_vec())),
        )
        .await
        .expect("a key and a prefix of the same text");
    assert_invalid(
        t.store
            .commit(
                Txn::new()
                    .when(Condition::no_put_after("p/", newest))
                    .when(Condition::no_put_after("p/", newest))
                    .then(Op::put("free", b"z".to_vec())),
            )
            .await,
    );
    assert_invalid(
        t.store
            .commit(
                Txn::new()
                    .when(Condition::no_put_after("p/\0", newest))
                    .then(Op::put("free", b"z".to_vec())),
            )
            .await,
    );
    assert_eq!(value_of(&*t.store, "free").await, Some(b"y".to_vec()));
}
