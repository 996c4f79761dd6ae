//! Cases only embedded (file-backed) stores can be held to: durability across reopen, the
//! inter-process lock, private files, foreign files, and two OS processes sharing one store.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ipam_core::kv::{KvError, KvStore, Op, Txn};

use crate::kv::{cas_increment, read_counter};
use crate::StoreFactory;

/// Environment variable naming the store a child worker process increments.
pub const WORKER_STORE_ENV: &str = "BLOCKIPAM_CONFORMANCE_WORKER_STORE";
/// Environment variable giving the number of increments a child worker does.
pub const WORKER_COUNT_ENV: &str = "BLOCKIPAM_CONFORMANCE_WORKER_COUNT";

/// A factory for stores that live at a path and can be closed and opened again.
#[async_trait]
pub trait EmbeddedFactory: StoreFactory {
    /// Opens the store at `path`, creating it if missing, waiting at most `lock_wait` for another
    /// process that holds it.
    async fn open_at(&self, path: &Path, lock_wait: Duration) -> Result<Arc<dyn KvStore>, KvError>;
}

/// Expands every embedded-store case into one `#[tokio::test]` inside a module `embedded`, plus the
/// ignored child-process entry point used by the two-process case.
#[macro_export]
macro_rules! embedded_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(embedded, $crate::embedded, $factory;
            acknowledged_writes_survive_close_and_reopen,
            revisions_keep_growing_after_reopen,
            second_open_waits_for_the_lock_then_reports_unavailable,
            waiting_open_proceeds_once_the_holder_closes,
            store_files_are_private_to_the_owner,
            foreign_file_at_store_path_is_a_clear_error,
            foreign_directory_at_store_path_is_a_clear_error,
            two_processes_cas_increments_sum_exactly,
        );

        mod embedded_child {
            #[allow(unused_imports)]
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = "child process of embedded::two_processes_cas_increments_sum_exactly, which starts it"]
            async fn multi_process_cas_worker() {
                $crate::embedded::run_cas_worker(&$factory).await;
            }
        }
    };
}

struct Location {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn new_location() -> Location {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store");
    Location { _dir: dir, path }
}

const WAIT: Duration = Duration::from_secs(10);

/// Writes acknowledged before close are all there after reopening.
pub async fn acknowledged_writes_survive_close_and_reopen<F: EmbeddedFactory>(factory: &F) {
    let loc = new_location();
    let written = {
        let store = factory.open_at(&loc.path, WAIT).await.expect("open");
        for i in 0..50u32 {
            store
                .put(&format!("k/{i:02}"), i.to_le_bytes().to_vec())
                .await
                .expect("put");
        }
        store
            .commit(
                Txn::new()
                    .then(Op::delete("k/00"))
                    .then(Op::put("k/txn", b"t".to_vec())),
            )
            .await
            .expect("commit");
        store.list("").await.expect("list")
    };
    let store = factory.open_at(&loc.path, WAIT).await.expect("reopen");
    let after = store.list("").await.expect("list");
    assert_eq!(after.len(), 50);
    assert_eq!(after, written, "store differs after reopen");
}

/// The revision counter is stored: the first write after reopen is newer than any before it.
pub async fn revisions_keep_growing_after_reopen<F: EmbeddedFactory>(factory: &F) {
    let loc = new_location();
    let last = {
        let store = factory.open_at(&loc.path, WAIT).await.expect("open");
        store.put("a", b"1".to_vec()).await.expect("put");
        let last = store.put("b", b"2".to_vec()).await.expect("put");
        store.delete("b").await.expect("delete").max(last)
    };
    let store = factory.open_at(&loc.path, WAIT).await.expect("reopen");
    let next = store.put("c", b"3".to_vec()).await.expect("put");
    assert!(
        next > last,
        "revision {next} after reopen is not greater than {last}"
    );
}

/// While one handle holds the store, a second open waits, then fails as unavailable naming the path.
pub async fn second_open_waits_for_the_lock_then_reports_unavailable<F: EmbeddedFactory>(
    factory: &F,
) {
    let loc = new_location();
    let holder = factory.open_at(&loc.path, WAIT).await.expect("open");
    holder.put("k", b"v".to_vec()).await.expect("put");
    match factory.open_at(&loc.path, Duration::from_millis(300)).await {
        Err(KvError::Unavailable { message }) => {
            let shown = loc.path.display().to_string();
            assert!(
                message.contains(&shown),
                "message {message:?} does not name {shown}"
            );
        }
        other => panic!("expected unavailable while locked, got {other:?}"),
    }
    // The holder is unaffected by the failed attempt.
    assert_eq!(
        holder.get("k").await.expect("get").map(|kv| kv.value),
        Some(b"v".to_vec())
    );
}

/// A second open that starts while the store is held succeeds once the holder closes it.
pub async fn waiting_open_proceeds_once_the_holder_closes<F: EmbeddedFactory>(factory: &F) {
    let loc = new_location();
    let holder = factory.open_at(&loc.path, WAIT).await.expect("open");
    holder.put("k", b"from-holder".to_vec()).await.expect("put");
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let waiter = {
        let path = loc.path.clone();
        async move {
            let _ = started_tx.send(());
            factory.open_at(&path, Duration::from_secs(20)).await
        }
    };
    let release = async move {
        started_rx.await.expect("waiter started");
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(holder);
    };
    let (opened, ()) = tokio::join!(waiter, release);
    let store = opened.expect("open after the holder closed");
    assert_eq!(
        store.get("k").await.expect("get").map(|kv| kv.value),
        Some(b"from-holder".to_vec())
    );
}

fn collect_files(path: &Path, out: &mut Vec<PathBuf>) {
    let meta = std::fs::symlink_metadata(path).expect("stat");
    out.push(path.to_owned());
    if meta.is_dir() {
        for entry in std::fs::read_dir(path).expect("read dir") {
            collect_files(&entry.expect("dir entry").path(), out);
        }
    }
}

/// Every file and directory the store creates (database and lock) is accessible to its owner only.
pub async fn store_files_are_private_to_the_owner<F: EmbeddedFactory>(factory: &F) {
    use std::os::unix::fs::PermissionsExt;
    let loc = new_location();
    let store = factory.open_at(&loc.path, WAIT).await.expect("open");
    store.put("k", b"v".to_vec()).await.expect("put");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(loc.path.parent().expect("parent")).expect("read dir") {
        collect_files(&entry.expect("entry").path(), &mut files);
    }
    assert!(!files.is_empty(), "the store created no file");
    for file in files {
        let mode = std::fs::metadata(&file).expect("stat").permissions().mode();
        assert_eq!(
            mode & 0o077,
            0,
            "{} has mode {:o}",
            file.display(),
            mode & 0o777
        );
    }
}

/// A file that is not a store of this kind at the store path gives an error, not a panic, and is left as it was.
pub async fn foreign_file_at_store_path_is_a_clear_error<F: EmbeddedFactory>(factory: &F) {
    let loc = new_location();
    let foreign = b"# not a database\nthis file belongs to someone else\n".repeat(200);
    std::fs::write(&loc.path, &foreign).expect("write foreign file");
    match factory.open_at(&loc.path, WAIT).await {
        Ok(store) => panic!("opened a foreign file as a store: {store:?}"),
        Err(e) => {
            let message = e.to_string();
            assert!(!message.is_empty());
            assert!(
                matches!(
                    e,
                    KvError::Corrupt { .. }
                        | KvError::Other { .. }
                        | KvError::InvalidArgument { .. }
                ),
                "unexpected error kind: {e:?}"
            );
        }
    }
    assert_eq!(
        std::fs::read(&loc.path).expect("read back"),
        foreign,
        "the foreign file was modified"
    );
}

/// A foreign, non-empty directory at the store path gives an error, not a panic, and is left as it was.
pub async fn foreign_directory_at_store_path_is_a_clear_error<F: EmbeddedFactory>(factory: &F) {
    let loc = new_location();
    std::fs::create_dir(&loc.path).expect("mkdir");
    let inside = loc.path.join("notes.txt");
    std::fs::write(&inside, b"someone else's directory\n").expect("write");
    let result = factory.open_at(&loc.path, WAIT).await;
    assert!(result.is_err(), "opened a foreign directory as a store");
    let entries: Vec<_> = std::fs::read_dir(&loc.path)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(
        entries,
        vec![std::ffi::OsString::from("notes.txt")],
        "the foreign directory was modified"
    );
    assert_eq!(
        std::fs::read(&inside).expect("read"),
        b"someone else's directory\n"
    );
}

/// Two OS processes, each doing 200 compare-and-swap increments (open, increment, close) on the
/// same store, end at exactly 400.
pub async fn two_processes_cas_increments_sum_exactly<F: EmbeddedFactory>(factory: &F) {
    const PER_PROCESS: u64 = 200;
    let loc = new_location();
    // Create the store first so both children race on an existing file.
    drop(
        factory
            .open_at(&loc.path, WAIT)
            .await
            .expect("create store"),
    );
    let exe = std::env::current_exe().expect("current test binary");
    let mut children = Vec::new();
    for _ in 0..2 {
        let child = tokio::process::Command::new(&exe)
            .args([
                "--exact",
                "embedded_child::multi_process_cas_worker",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(WORKER_STORE_ENV, &loc.path)
            .env(WORKER_COUNT_ENV, PER_PROCESS.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn worker process");
        children.push(child);
    }
    for child in children {
        let output = child.wait_with_output().await.expect("wait for worker");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains("1 passed"),
            "worker failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let store = factory.open_at(&loc.path, WAIT).await.expect("reopen");
    let (count, _) = read_counter(&*store, "counter")
        .await
        .expect("read counter");
    assert_eq!(
        count,
        2 * PER_PROCESS,
        "lost or duplicated increments between processes"
    );
}

/// Body of the child process: opens the store named by the environment, increments, closes, repeats.
pub async fn run_cas_worker<F: EmbeddedFactory>(factory: &F) {
    let path = std::env::var_os(WORKER_STORE_ENV).unwrap_or_else(|| {
        panic!("{WORKER_STORE_ENV} is not set: this entry point is started by the two-process case")
    });
    let count: u64 = std::env::var(WORKER_COUNT_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{WORKER_COUNT_ENV} must be a number"));
    for _ in 0..count {
        let store = factory
            .open_at(Path::new(&path), Duration::from_secs(60))
            .await
            .expect("open in worker");
        cas_increment(&*store, "counter")
            .await
            .expect("increment in worker");
        drop(store);
    }
}
