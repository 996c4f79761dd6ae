//! sled-specific cases: damaged, foreign and unmarked stores give clear errors (never a panic), files stay private.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use backend_sled::{SledConfig, SledStore, DATA_TREE, FORMAT_KEY, META_TREE};
use ipam_core::{KvError, KvStore};

struct Location {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn new_location() -> Location {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store");
    Location { _dir: dir, path }
}

async fn open(path: &Path) -> Result<SledStore, KvError> {
    SledStore::open(
        SledConfig::new(path)
            .with_lock_wait(Duration::from_secs(5))
            .creating(),
    )
    .await
}

/// Opens sled directly, waiting for a just-dropped store to let go of sled's own lock.
fn open_raw(path: &Path) -> sled::Db {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match sled::Config::new().path(path).open() {
            Ok(db) => return db,
            Err(err) if Instant::now() < deadline => {
                let _ = err;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(err) => panic!("cannot open {} with sled: {err}", path.display()),
        }
    }
}

/// A store at `path` holding one good key, closed again.
async fn store_with_one_key(path: &Path) {
    let store = open(path).await.expect("create store");
    store.put("good", b"value".to_vec()).await.expect("put");
}

fn expect_corrupt<T: std::fmt::Debug>(result: Result<T, KvError>, key: Option<&str>) -> String {
    match result {
        Err(KvError::Corrupt {
            key: found,
            message,
        }) => {
            assert_eq!(found.as_deref(), key, "corrupt error names the wrong key");
            message
        }
        other => panic!("expected a corrupt error, got {other:?}"),
    }
}

#[tokio::test]
async fn record_shorter_than_its_revision_header_is_corrupt_on_get_and_list() {
    let loc = new_location();
    store_with_one_key(&loc.path).await;
    {
        let db = open_raw(&loc.path);
        let data = db.open_tree(DATA_TREE).expect("data tree");
        data.insert("short", &[1u8, 2, 3][..]).expect("insert");
        db.flush().expect("flush");
    }
    let store = open(&loc.path).await.expect("reopen");
    let message = expect_corrupt(store.get("short").await, Some("short"));
    assert!(message.contains("3 bytes"), "message: {message}");
    expect_corrupt(store.list("").await, Some("short"));
    expect_corrupt(store.list("sh").await, Some("short"));
    // Other keys stay readable, and listing a prefix that avoids the bad record works.
    assert_eq!(
        store.get("good").await.expect("get").map(|kv| kv.value),
        Some(b"value".to_vec())
    );
    assert_eq!(store.list("g").await.expect("list").len(), 1);
}

#[tokio::test]
async fn garbage_filled_database_file_is_an_error_on_open() {
    let loc = new_location();
    store_with_one_key(&loc.path).await;
    let db_file = loc.path.join("db");
    let len = std::fs::metadata(&db_file).expect("stat db").len();
    std::fs::write(&db_file, vec![0xA5u8; len as usize]).expect("overwrite db");
    // sled itself reads such a log as an empty database; the missing format marker gives it away.
    let message = expect_corrupt(open(&loc.path).await, None);
    assert!(
        message.contains(&loc.path.display().to_string()),
        "message: {message}"
    );
}

#[tokio::test]
async fn database_file_truncated_to_a_few_bytes_is_an_error_on_open() {
    let loc = new_location();
    store_with_one_key(&loc.path).await;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(loc.path.join("db"))
        .expect("open db");
    file.set_len(100).expect("truncate");
    drop(file);
    expect_corrupt(open(&loc.path).await, None);
}

/// sled writes a snapshot as it opens (`snap.<lsn>.generating`, then renamed); a process killed
/// before the rename leaves the file cut short, and sled then refused the whole store
/// (`Corruption { at: None }`) at every later open: one kill at the wrong moment made the node's
/// store unusable. The file is removed under the store's lock; nothing stored is lost.
#[tokio::test]
async fn a_snapshot_left_unfinished_by_a_killed_process_does_not_stop_the_store() {
    let loc = new_location();
    store_with_one_key(&loc.path).await;
    {
        let store = open(&loc.path).await.expect("reopen");
        store.put("second", b"value".to_vec()).await.expect("put");
    }
    let newest = std::fs::read_dir(&loc.path)
        .expect("list the store")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("snap.") && !name.ends_with(".generating"))
        .max()
        .expect("sled wrote a snapshot");
    // What a kill between sled's first write of the file and its rename leaves: a few bytes.
    let unfinished = loc.path.join(format!("{newest}.generating"));
    std::fs::write(&unfinished, [0x5Au8; 40]).expect("write the unfinished snapshot");

    let store = open(&loc.path).await.expect("the store opens");
    assert_eq!(
        store.get("good").await.expect("get").map(|kv| kv.value),
        Some(b"value".to_vec())
    );
    assert_eq!(
        store.get("second").await.expect("get").map(|kv| kv.value),
        Some(b"value".to_vec())
    );
    assert!(!unfinished.exists(), "the unfinished snapshot is removed");
    store
        .put("third", b"value".to_vec())
        .await
        .expect("writes go on");
}

#[tokio::test]
async fn damaged_config_file_is_an_error_on_open() {
    let loc = new_location();
    store_with_one_key(&loc.path).await;
    std::fs::write(loc.path.join("conf"), b"not sled's configuration").expect("overwrite conf");
    assert!(open(&loc.path).await.is_err());
}

#[tokio::test]
async fn sled_database_without_the_format_marker_is_refused() {
    let loc = new_location();
    {
        let db = open_raw(&loc.path);
        db.insert("someone", "else's data").expect("insert");
        db.open_tree("their-tree")
            .expect("tree")
            .insert("k", "v")
            .expect("insert");
        db.flush().expect("flush");
    }
    let message = expect_corrupt(open(&loc.path).await, None);
    assert!(
        message.contains("not a blockipam store"),
        "message: {message}"
    );
    // Nothing of ours was added to their database.
    let db = open_raw(&loc.path);
    let names: Vec<String> = db
        .tree_names()
        .iter()
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n == META_TREE || n == DATA_TREE),
        "trees: {names:?}"
    );
    assert_eq!(
        db.get("someone").expect("get").as_deref(),
        Some(&b"else's data"[..])
    );
}

#[tokio::test]
async fn store_whose_data_tree_was_dropped_is_refused_as_damaged_not_recreated() {
    let loc = new_location();
    store_with_one_key(&loc.path).await;
    {
        let db = open_raw(&loc.path);
        assert!(db.drop_tree(DATA_TREE).expect("drop"), "a data tree");
        db.flush().expect("flush");
    }
    let message = expect_corrupt(open(&loc.path).await, None);
    assert!(
        message.contains("without its data tree") && message.contains("restore it"),
        "message: {message}"
    );
    // Refused again: the open made no new, empty data tree.
    expect_corrupt(open(&loc.path).await, None);
    let db = open_raw(&loc.path);
    assert!(
        !db.tree_names()
            .iter()
            .any(|n| n.as_ref() == DATA_TREE.as_bytes()),
        "a data tree was made"
    );
}

#[tokio::test]
async fn store_with_another_format_marker_is_refused_naming_it() {
    let loc = new_location();
    store_with_one_key(&loc.path).await;
    {
        let db = open_raw(&loc.path);
        let meta = db.open_tree(META_TREE).expect("meta tree");
        meta.insert(FORMAT_KEY, "blockipam-kv-v999")
            .expect("insert");
        db.flush().expect("flush");
    }
    let message = expect_corrupt(open(&loc.path).await, Some(FORMAT_KEY));
    assert!(message.contains("blockipam-kv-v999"), "message: {message}");
}

#[tokio::test]
async fn foreign_directory_at_store_path_is_refused_and_left_untouched() {
    let loc = new_location();
    std::fs::create_dir(&loc.path).expect("mkdir");
    std::fs::write(loc.path.join("notes.txt"), b"mine").expect("write");
    expect_corrupt(open(&loc.path).await, None);
    let entries: Vec<_> = std::fs::read_dir(&loc.path)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(entries, ["notes.txt"]);
    assert_eq!(
        std::fs::read(loc.path.join("notes.txt")).expect("read"),
        b"mine"
    );
}

/// A directory holding only one of the two files every sled database has (its log `db` and its
/// `conf`): not opened as a store (sled would add the other), refused and left as it was.
#[tokio::test]
async fn directory_with_only_one_of_sleds_files_is_refused_and_left_untouched() {
    for (present, contents) in [
        ("conf", &b"segment_size: 524288"[..]),
        ("db", &[0u8; 64][..]),
    ] {
        let loc = new_location();
        std::fs::create_dir(&loc.path).expect("mkdir");
        std::fs::write(loc.path.join(present), contents).expect("write");
        let message = expect_corrupt(open(&loc.path).await, None);
        assert!(
            message.contains("holds no sled database"),
            "{present} alone: {message}"
        );
        let entries: Vec<_> = std::fs::read_dir(&loc.path)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(entries, [present], "{present} alone");
        assert_eq!(
            std::fs::read(loc.path.join(present)).expect("read"),
            contents,
            "{present} alone"
        );
    }
}

#[tokio::test]
async fn store_path_under_a_regular_file_is_an_error_saying_so_not_a_missing_store() {
    let loc = new_location();
    std::fs::write(&loc.path, b"a file where a directory should be").expect("write");
    let beneath = loc.path.join("store.sled");
    let refused = SledStore::open(SledConfig::new(&beneath).with_lock_wait(Duration::from_secs(5)))
        .await
        .expect_err("no store can be beneath a file");
    let message = refused.to_string();
    assert!(
        message.contains("cannot inspect the store path") && message.contains("Not a directory"),
        "{message}"
    );
    assert!(!message.contains("no sled store at"), "{message}");
    assert_eq!(
        std::fs::read(&loc.path).expect("the file"),
        b"a file where a directory should be"
    );
}

#[tokio::test]
async fn empty_directory_at_store_path_becomes_a_private_store() {
    use std::os::unix::fs::PermissionsExt;
    let loc = new_location();
    std::fs::create_dir(&loc.path).expect("mkdir");
    std::fs::set_permissions(&loc.path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let store = open(&loc.path).await.expect("open");
    store.put("k", b"v".to_vec()).await.expect("put");
    let mode = std::fs::metadata(&loc.path)
        .expect("stat")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
}

#[tokio::test]
async fn staging_directory_left_by_an_interrupted_creation_is_replaced() {
    let loc = new_location();
    let staging = loc.path.with_file_name("store.creating");
    std::fs::create_dir(&staging).expect("mkdir");
    std::fs::write(staging.join("db"), b"half-made").expect("write");
    let store = open(&loc.path).await.expect("open");
    store.put("k", b"v".to_vec()).await.expect("put");
    assert!(!staging.exists(), "the staging directory is still there");
}

#[tokio::test]
async fn blob_files_sled_writes_for_large_values_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let loc = new_location();
    let store = open(&loc.path).await.expect("open");
    store
        .put("big", vec![0x42u8; 1024 * 1024])
        .await
        .expect("put 1 MiB");
    let blobs: Vec<PathBuf> = std::fs::read_dir(loc.path.join("blobs"))
        .expect("read blobs dir")
        .map(|e| e.expect("entry").path())
        .collect();
    assert!(
        !blobs.is_empty(),
        "sled wrote no blob file for a 1 MiB value"
    );
    for blob in blobs {
        let mode = std::fs::metadata(&blob).expect("stat").permissions().mode();
        assert_eq!(
            mode & 0o077,
            0,
            "{} has mode {:o}",
            blob.display(),
            mode & 0o777
        );
    }
}
