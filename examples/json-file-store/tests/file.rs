//! The file itself: every byte value survives a reopen, a file whose values are not hex is refused
//! as corrupt, and a commit that cannot be saved leaves the store as it was.

use ipam_core::kv::{KvError, KvStore, Op, Revision, Txn};
use json_file_store::JsonFileStore;

fn puts(pairs: &[(&str, &[u8])]) -> Txn {
    let mut txn = Txn::new();
    for (key, value) in pairs {
        txn.ops.push(Op::put(*key, value.to_vec()));
    }
    txn
}

#[tokio::test]
async fn every_byte_value_survives_a_reopen() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("store.json");
    let every_byte: Vec<u8> = (0..=255u8).collect();
    let store = JsonFileStore::open(&path).expect("an empty store");
    store
        .commit(puts(&[("bytes", &every_byte), ("empty", b"")]))
        .await
        .expect("committed");
    drop(store);
    let reopened = JsonFileStore::open(&path).expect("the store");
    let bytes = reopened
        .get("bytes")
        .await
        .expect("a read")
        .expect("the key");
    assert_eq!(bytes.value, every_byte);
    assert_eq!(bytes.revision, Revision(1));
    let empty = reopened
        .get("empty")
        .await
        .expect("a read")
        .expect("the key");
    assert_eq!(empty.value, b"");
}

#[tokio::test]
async fn a_value_that_is_not_hex_is_refused_as_corrupt() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("store.json");
    for (value, reason) in [
        ("\"6\"", "odd number of hex digits"),
        ("\"6g\"", "'g' is not a hex digit"),
        ("\"6G\"", "'G' is not a hex digit"),
        ("[118]", "expected a string"),
    ] {
        let text =
            format!(r#"{{"revision":1,"entries":{{"k":{{"value":{value},"revision":1}}}}}}"#);
        std::fs::write(&path, text).expect("written");
        match JsonFileStore::open(&path) {
            Err(KvError::Corrupt { message, .. }) => {
                assert!(message.contains(reason), "{value}: {message}");
            }
            other => panic!("{value}: not refused as corrupt: {other:?}"),
        }
    }
    std::fs::write(
        &path,
        r#"{"revision":1,"entries":{"k":{"value":"76Af","revision":1}}}"#,
    )
    .expect("written");
    let store = JsonFileStore::open(&path).expect("hex digits of either case");
    let found = store.get("k").await.expect("a read").expect("the key");
    assert_eq!(found.value, [0x76, 0xaf]);
}

#[tokio::test]
async fn a_commit_that_cannot_be_saved_leaves_the_store_as_it_was() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("store.json");
    let store = JsonFileStore::open(&path).expect("an empty store");
    store
        .commit(puts(&[("kept", b"1"), ("removed", b"2")]))
        .await
        .expect("committed");
    let before = store.list("").await.expect("a listing");

    // The file is written beside the store first: a directory in that place makes the save fail.
    let staged = dir.path().join("store.json.new");
    std::fs::create_dir(&staged).expect("a directory where the file is staged");
    let mut txn = puts(&[("kept", b"changed"), ("added", b"3")]);
    txn.ops.push(Op::delete("removed"));
    let failed = store.commit(txn).await;
    assert!(
        matches!(&failed, Err(KvError::Other { message }) if message.contains("cannot create beside")),
        "a commit that was not saved answered {failed:?}"
    );
    assert_eq!(store.list("").await.expect("a listing"), before);
    assert_eq!(
        JsonFileStore::open(&path)
            .expect("the file")
            .list("")
            .await
            .expect("a listing"),
        before
    );

    std::fs::remove_dir(&staged).expect("removed");
    let revision = store
        .commit(puts(&[("added", b"3")]))
        .await
        .expect("committed");
    assert_eq!(revision, Revision(2), "the failed commit took no revision");
}
