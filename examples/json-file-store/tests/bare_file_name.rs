//! A store named by its file name alone (a path with no directory part) commits and reopens: the
//! only test in this binary, as it changes the process's working directory.

use ipam_core::kv::{KvStore, Op, Txn};
use json_file_store::JsonFileStore;

#[tokio::test]
async fn a_store_named_by_its_file_name_alone_commits_and_reopens() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::env::set_current_dir(dir.path()).expect("work in the temporary directory");
    let store = JsonFileStore::open("store.json").expect("an empty store");
    let mut txn = Txn::new();
    txn.ops.push(Op::Put {
        key: "k".into(),
        value: b"v".to_vec(),
    });
    store
        .commit(txn)
        .await
        .expect("the commit is answered as done");
    drop(store);
    let reopened = JsonFileStore::open(dir.path().join("store.json")).expect("the store");
    let found = reopened.get("k").await.expect("a read").expect("the key");
    assert_eq!(found.value, b"v");
}
