//! Damaged, foreign and unmarked redb files give clear errors (never a panic) and are not rewritten.

use std::path::{Path, PathBuf};
use std::time::Duration;

use backend_redb::{RedbConfig, RedbStore, DATA_TABLE, FORMAT_KEY, META_TABLE};
use ipam_core::{KvError, KvStore};
use redb::{ReadableDatabase, TableDefinition};

struct Location {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn new_location() -> Location {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store");
    Location { _dir: dir, path }
}

async fn open(path: &Path) -> Result<RedbStore, KvError> {
    RedbStore::open(
        RedbConfig::new(path)
            .with_lock_wait(Duration::from_secs(5))
            .creating(),
    )
    .await
}

/// A store at `path` holding a few keys, closed again.
async fn store_with_keys(path: &Path) {
    let store = open(path).await.expect("create store");
    for i in 0..200u32 {
        store
            .put(&format!("key/{i:03}"), vec![7u8; 100])
            .await
            .expect("put");
    }
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
    store_with_keys(&loc.path).await;
    {
        let db = redb::Database::create(&loc.path).expect("open with redb");
        let write = db.begin_write().expect("write");
        write
            .open_table(DATA_TABLE)
            .expect("data table")
            .insert("short", &[1u8, 2, 3][..])
            .expect("insert");
        write.commit().expect("commit");
    }
    let store = open(&loc.path).await.expect("reopen");
    let message = expect_corrupt(store.get("short").await, Some("short"));
    assert!(message.contains("3 bytes"), "message: {message}");
    expect_corrupt(store.list("").await, Some("short"));
    expect_corrupt(store.list("sh").await, Some("short"));
    // Other keys stay readable, and listing a prefix that avoids the bad record works.
    assert!(store.get("key/000").await.expect("get").is_some());
    assert_eq!(store.list("key/").await.expect("list").len(), 200);
}

#[tokio::test]
async fn garbage_filled_database_file_is_an_error_on_open_and_left_as_it_was() {
    let loc = new_location();
    store_with_keys(&loc.path).await;
    let len = std::fs::metadata(&loc.path).expect("stat").len();
    let garbage = vec![0xA5u8; len as usize];
    std::fs::write(&loc.path, &garbage).expect("overwrite");
    let message = expect_corrupt(open(&loc.path).await, None);
    assert!(
        message.contains(&loc.path.display().to_string()),
        "message: {message}"
    );
    assert!(std::fs::read(&loc.path).expect("read back") == garbage);
}

#[tokio::test]
async fn database_file_truncated_to_half_is_an_error_on_open() {
    let loc = new_location();
    store_with_keys(&loc.path).await;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&loc.path)
        .expect("open");
    let len = file.metadata().expect("stat").len();
    file.set_len(len / 2).expect("truncate");
    drop(file);
    expect_corrupt(open(&loc.path).await, None);
}

/// A store truncated to nothing (or an empty placeholder) is damage, not a missing store: even a
/// caller allowed to create a store (the plugin with netconf pools, `pool add`) is refused, and the
/// file is left empty, so no new, empty store hands out addresses the lost one still holds.
#[tokio::test]
async fn database_file_truncated_to_nothing_is_refused_even_when_creating_and_left_empty() {
    let loc = new_location();
    store_with_keys(&loc.path).await;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&loc.path)
        .and_then(|file| file.set_len(0))
        .expect("truncate to nothing");
    let message = expect_corrupt(open(&loc.path).await, None);
    assert!(
        message.contains("is an empty file") && message.contains(&loc.path.display().to_string()),
        "message: {message}"
    );
    assert_eq!(
        std::fs::metadata(&loc.path).expect("stat").len(),
        0,
        "the empty file was replaced by a new store"
    );
}

#[tokio::test]
async fn database_file_truncated_inside_its_header_is_an_error_on_open() {
    let loc = new_location();
    store_with_keys(&loc.path).await;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&loc.path)
        .expect("open");
    file.set_len(100).expect("truncate");
    drop(file);
    expect_corrupt(open(&loc.path).await, None);
}

/// redb trusts a valid header and may panic on the damaged pages behind it (debug builds assert);
/// the panic stays inside the blocking task and comes back as an error.
#[tokio::test]
async fn damaged_pages_behind_a_valid_header_are_an_error_not_a_panic() {
    let loc = new_location();
    store_with_keys(&loc.path).await;
    let mut bytes = std::fs::read(&loc.path).expect("read");
    for byte in bytes.iter_mut().skip(4096) {
        *byte = 0xA5;
    }
    std::fs::write(&loc.path, &bytes).expect("damage");
    let result = open(&loc.path).await;
    expect_corrupt(result, None);
}

/// Where `needle` first occurs in the file at `path`.
fn offset_of(path: &Path, needle: &[u8]) -> usize {
    let bytes = std::fs::read(path).expect("read");
    bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| {
            panic!(
                "{:?} not found in the file",
                String::from_utf8_lossy(needle)
            )
        })
}

/// Flips `mask` in the byte at `offset` of the file at `path`; returns the damaged bytes.
fn flip(path: &Path, offset: usize, mask: u8) -> Vec<u8> {
    let mut bytes = std::fs::read(path).expect("read");
    bytes[offset] ^= mask;
    std::fs::write(path, &bytes).expect("damage");
    bytes
}

/// A flipped bit in a stored key leaves every page readable, but the key out of the tree's order:
/// lookups that trust the order then miss a range of keys (a store that lists no blocks hands
/// out addresses again). The open verifies every page's checksum and refuses the file, as it is.
#[tokio::test]
async fn a_flipped_bit_in_a_stored_key_is_corrupt_on_open_and_the_file_is_left_as_it_was() {
    let loc = new_location();
    store_with_keys(&loc.path).await;
    // "key/100" becomes "key'100", which sorts before every "key/" key.
    let at = offset_of(&loc.path, b"key/100") + 3;
    let damaged = flip(&loc.path, at, 0x08);
    let message = expect_corrupt(open(&loc.path).await, None);
    assert!(
        message.contains(&loc.path.display().to_string()),
        "message: {message}"
    );
    assert!(std::fs::read(&loc.path).expect("read back") == damaged);
}

/// A flipped bit in the newest commit's value is refused, not rolled back to the commit before:
/// that would drop a write the store reported as done.
#[tokio::test]
async fn a_flipped_bit_in_the_newest_write_is_corrupt_on_open_never_rolled_back() {
    let loc = new_location();
    store_with_keys(&loc.path).await;
    {
        let store = open(&loc.path).await.expect("reopen");
        store
            .put("key/newest", b"the newest value, written last".to_vec())
            .await
            .expect("put");
    }
    let at = offset_of(&loc.path, b"the newest value") + 4;
    let damaged = flip(&loc.path, at, 0x01);
    expect_corrupt(open(&loc.path).await, None);
    assert!(std::fs::read(&loc.path).expect("read back") == damaged);
}

/// An intact store opens with every key it was given, again and again (the check on open changes
/// nothing it holds).
#[tokio::test]
async fn an_intact_store_opens_with_every_key_after_the_check() {
    let loc = new_location();
    store_with_keys(&loc.path).await;
    for _ in 0..3 {
        let store = open(&loc.path).await.expect("reopen");
        let listed = store.list("key/").await.expect("list");
        assert_eq!(listed.len(), 200);
        assert_eq!(listed[100].key, "key/100");
    }
}

#[tokio::test]
async fn redb_database_without_the_format_marker_is_refused_and_keeps_its_tables() {
    let loc = new_location();
    let theirs: TableDefinition<&str, &str> = TableDefinition::new("their-table");
    {
        let db = redb::Database::create(&loc.path).expect("create");
        let write = db.begin_write().expect("write");
        write
            .open_table(theirs)
            .expect("table")
            .insert("k", "their value")
            .expect("insert");
        write.commit().expect("commit");
    }
    let message = expect_corrupt(open(&loc.path).await, None);
    assert!(
        message.contains("not a blockipam store"),
        "message: {message}"
    );
    let db = redb::Database::create(&loc.path).expect("reopen with redb");
    let read = db.begin_read().expect("read");
    let names: Vec<String> = read
        .list_tables()
        .expect("tables")
        .map(|t| redb::TableHandle::name(&t).to_owned())
        .collect();
    assert_eq!(names, ["their-table"]);
    let value = read
        .open_table(theirs)
        .expect("table")
        .get("k")
        .expect("get")
        .map(|v| v.value().to_owned());
    assert_eq!(value.as_deref(), Some("their value"));
}

#[tokio::test]
async fn store_whose_data_table_was_deleted_is_refused_as_damaged_not_recreated() {
    let loc = new_location();
    store_with_keys(&loc.path).await;
    {
        let db = redb::Database::create(&loc.path).expect("open with redb");
        let write = db.begin_write().expect("write");
        assert!(
            write.delete_table(DATA_TABLE).expect("delete"),
            "a data table"
        );
        write.commit().expect("commit");
    }
    let message = expect_corrupt(open(&loc.path).await, None);
    assert!(
        message.contains("without its data table") && message.contains("restore it"),
        "message: {message}"
    );
    // Refused again: the open wrote no new, empty data table.
    expect_corrupt(open(&loc.path).await, None);
}

#[tokio::test]
async fn store_with_another_format_marker_is_refused_naming_it() {
    let loc = new_location();
    store_with_keys(&loc.path).await;
    {
        let db = redb::Database::create(&loc.path).expect("open with redb");
        let write = db.begin_write().expect("write");
        write
            .open_table(META_TABLE)
            .expect("meta table")
            .insert(FORMAT_KEY, &b"blockipam-kv-v999"[..])
            .expect("insert");
        write.commit().expect("commit");
    }
    let message = expect_corrupt(open(&loc.path).await, Some(FORMAT_KEY));
    assert!(message.contains("blockipam-kv-v999"), "message: {message}");
}

#[tokio::test]
async fn directory_at_store_path_is_refused() {
    let loc = new_location();
    std::fs::create_dir(&loc.path).expect("mkdir");
    expect_corrupt(open(&loc.path).await, None);
}

#[tokio::test]
async fn store_path_under_a_regular_file_is_an_error_saying_so_not_a_missing_store() {
    let loc = new_location();
    std::fs::write(&loc.path, b"a file where a directory should be").expect("write");
    let beneath = loc.path.join("store.redb");
    let refused = RedbStore::open(RedbConfig::new(&beneath).with_lock_wait(Duration::from_secs(5)))
        .await
        .expect_err("no store can be beneath a file");
    let message = refused.to_string();
    assert!(
        message.contains("cannot inspect the store path") && message.contains("Not a directory"),
        "{message}"
    );
    assert!(!message.contains("no redb store at"), "{message}");
    assert_eq!(
        std::fs::read(&loc.path).expect("the file"),
        b"a file where a directory should be"
    );
}

#[tokio::test]
async fn existing_store_file_readable_by_others_is_made_private_on_open() {
    use std::os::unix::fs::PermissionsExt;
    let loc = new_location();
    store_with_keys(&loc.path).await;
    std::fs::set_permissions(&loc.path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let _store = open(&loc.path).await.expect("open");
    let mode = std::fs::metadata(&loc.path)
        .expect("stat")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}
