//! Cases only embedded (file-backed) stores can be held to: durability across reopen and across a
//! `kill -9` of the writing process, no silent re-creation of a missing store, the inter-process
//! lock, private files, foreign files, and two OS processes sharing one store.

use std::collections::BTreeSet;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ipam_core::kv::{KvError, KvStore, Op, Txn};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

use crate::kv::{cas_increment, read_counter};
use crate::StoreFactory;

/// Environment variable naming the store a child worker process increments.
pub const WORKER_STORE_ENV: &str = "BLOCKIPAM_CONFORMANCE_WORKER_STORE";
/// Environment variable giving the number of increments a child worker does.
pub const WORKER_COUNT_ENV: &str = "BLOCKIPAM_CONFORMANCE_WORKER_COUNT";
/// Environment variable naming the store the child writer of the kill case writes to.
pub const KILL_WRITER_STORE_ENV: &str = "BLOCKIPAM_CONFORMANCE_KILL_WRITER_STORE";
/// Environment variable giving the round of the kill case the child writer runs.
pub const KILL_WRITER_ROUND_ENV: &str = "BLOCKIPAM_CONFORMANCE_KILL_WRITER_ROUND";

/// A factory for stores that live at a path and can be closed and opened again.
#[async_trait]
pub trait EmbeddedFactory: StoreFactory {
    /// Opens the store at `path`, waiting at most `lock_wait` for another process that holds it.
    /// A missing store is created when `create_if_missing` is true, and is an error otherwise.
    async fn open_at(
        &self,
        path: &Path,
        lock_wait: Duration,
        create_if_missing: bool,
    ) -> Result<Arc<dyn KvStore>, KvError>;
}

/// Expands every embedded-store case into one `#[tokio::test]` inside a module `embedded`, plus the
/// ignored child-process entry points used by the two-process and the kill cases.
#[macro_export]
macro_rules! embedded_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(embedded, $crate::embedded, $factory;
            writes_survive_a_clean_close_and_reopen,
            acknowledged_writes_survive_kill_9_of_the_writing_process,
            missing_store_is_an_error_naming_the_path_and_nothing_is_created,
            empty_placeholder_at_store_path_is_an_error_without_create_if_missing,
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

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = "child process of embedded::acknowledged_writes_survive_kill_9_of_the_writing_process, which starts it"]
            async fn kill_writer() {
                $crate::embedded::run_kill_writer(&$factory).await;
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

/// Writes made before a clean close are all there after reopening. (A clean close flushes
/// everything, so this proves nothing about acknowledged writes: see
/// [`acknowledged_writes_survive_kill_9_of_the_writing_process`].)
pub async fn writes_survive_a_clean_close_and_reopen<F: EmbeddedFactory>(factory: &F) {
    let loc = new_location();
    let written = {
        let store = factory.open_at(&loc.path, WAIT, true).await.expect("open");
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
    let store = factory
        .open_at(&loc.path, WAIT, false)
        .await
        .expect("reopen");
    let after = store.list("").await.expect("list");
    assert_eq!(after.len(), 50);
    assert_eq!(after, written, "store differs after reopen");
}

/// Rounds of the kill case; each starts a writer process and kills it.
const KILL_ROUNDS: u64 = 3;
/// Most commits one writer makes; it is killed long before (after at most
/// `KILL_MIN_ACKS + KILL_ACK_SPREAD` acknowledgements).
const KILL_WRITER_MAX_COMMITS: u64 = 400;
/// Fewest acknowledgements the parent reads before it kills the writer.
const KILL_MIN_ACKS: u64 = 4;
/// The parent kills after `KILL_MIN_ACKS + random(0..KILL_ACK_SPREAD)` acknowledgements.
const KILL_ACK_SPREAD: u64 = 28;
/// What the writer prints, followed by the commit's index, once a commit returned `Ok`.
const ACKNOWLEDGED: &str = "kill-writer acknowledged commit ";

fn kill_key(round: u64, index: u64) -> String {
    format!("kill/r{round}/{index:05}")
}

fn kill_twin_key(round: u64, index: u64) -> String {
    format!("kill/r{round}/{index:05}/twin")
}

/// The value of commit `index` of `round`: every third one is 200 KiB and more (sled writes such
/// a value to a blob file of its own), the others small; the bytes depend on round and index.
fn kill_value(round: u64, index: u64) -> Vec<u8> {
    let len = if index % 3 == 1 {
        200 * 1024 + index as usize
    } else {
        64 + index as usize
    };
    (0..len)
        .map(|j| (j as u64).wrapping_mul(31).wrapping_add(round * 7 + index) as u8)
        .collect()
}

/// A random number below `bound` (the standard library's per-process random hash keys).
fn random_below(bound: u64) -> u64 {
    std::collections::hash_map::RandomState::new().hash_one(bound) % bound
}

/// Every write a process saw acknowledged is there, whole, after that process is killed with
/// SIGKILL at a random point, and no commit is half applied.
///
/// Each round starts a child process (this test binary, entry point `embedded_child::kill_writer`)
/// that commits writes one after another, each a transaction of a value (every third one 200 KiB
/// and more: a sled blob) and a small twin key, and prints every acknowledged index on stdout.
/// After a random number of acknowledgements the parent sends SIGKILL while the child is in the
/// middle of its next writes, reopens the store and checks every acknowledged write and its twin,
/// and that at most the one commit in flight landed beyond them, whole or not at all. Three rounds
/// write into the same store, so recovery after a kill is followed by more writes and more kills.
///
/// A kill loses what the process had not yet handed to the kernel: this proves that a store
/// acknowledges a write only after it left the process. Power loss, which also loses what the
/// kernel had not written to the disk, cannot be simulated here; the evidence for it is that the
/// syncs are observed (backend-sled's
/// `every_blob_file_and_the_blobs_directory_are_synced_before_a_commit_returns`; redb commits with
/// `Durability::Immediate`).
pub async fn acknowledged_writes_survive_kill_9_of_the_writing_process<F: EmbeddedFactory>(
    factory: &F,
) {
    use std::os::unix::process::ExitStatusExt;
    let loc = new_location();
    drop(
        factory
            .open_at(&loc.path, WAIT, true)
            .await
            .expect("create store"),
    );
    let exe = std::env::current_exe().expect("current test binary");
    for round in 0..KILL_ROUNDS {
        let kill_after = KILL_MIN_ACKS + random_below(KILL_ACK_SPREAD);
        let mut child = tokio::process::Command::new(&exe)
            .args([
                "--exact",
                "embedded_child::kill_writer",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(KILL_WRITER_STORE_ENV, &loc.path)
            .env(KILL_WRITER_ROUND_ENV, round.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the writer process");
        let stdout = child.stdout.take().expect("the writer's stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut acknowledged = Vec::new();
        while let Some(line) = lines.next_line().await.expect("read the writer's stdout") {
            // The test harness may print "test ... " in front of the first line.
            let Some((_, index)) = line.split_once(ACKNOWLEDGED) else {
                continue;
            };
            acknowledged.push(index.trim().parse::<u64>().expect("an acknowledged index"));
            if acknowledged.len() as u64 == kill_after {
                child.start_kill().expect("send SIGKILL to the writer");
            }
        }
        let status = child.wait().await.expect("wait for the writer");
        let mut stderr = String::new();
        if let Some(mut pipe) = child.stderr.take() {
            let _ = pipe.read_to_string(&mut stderr).await;
        }
        assert_eq!(
            status.signal(),
            Some(9),
            "round {round}: the writer was to be killed after {kill_after} acknowledged commits; \
             it saw {} and ended with {status}\nstderr:\n{stderr}",
            acknowledged.len()
        );
        assert!(
            acknowledged.len() as u64 >= kill_after,
            "round {round}: only {} acknowledged commits before the writer ended",
            acknowledged.len()
        );
        assert_eq!(
            acknowledged,
            (0..acknowledged.len() as u64).collect::<Vec<_>>(),
            "round {round}: the writer acknowledges its commits in order"
        );

        let store = factory
            .open_at(&loc.path, WAIT, false)
            .await
            .expect("reopen the store after kill -9");
        let listed = store
            .list(&format!("kill/r{round}/"))
            .await
            .expect("list the round's keys");
        let present: BTreeSet<String> = listed.iter().map(|kv| kv.key.clone()).collect();
        for kv in &listed {
            let index: u64 = kv.key[format!("kill/r{round}/").len()..][..5]
                .parse()
                .expect("an index in the key");
            let expected = if kv.key.ends_with("/twin") {
                index.to_le_bytes().to_vec()
            } else {
                kill_value(round, index)
            };
            assert!(
                kv.value == expected,
                "round {round}: {} holds {} bytes that are not the {} bytes written",
                kv.key,
                kv.value.len(),
                expected.len()
            );
        }
        for &index in &acknowledged {
            for key in [kill_key(round, index), kill_twin_key(round, index)] {
                assert!(
                    present.contains(&key),
                    "round {round}: {key} was acknowledged before the kill (after {kill_after} \
                     acknowledgements) and is missing after reopening"
                );
            }
        }
        let in_flight = acknowledged.len() as u64;
        for index in 0..=in_flight {
            assert_eq!(
                present.contains(&kill_key(round, index)),
                present.contains(&kill_twin_key(round, index)),
                "round {round}: commit {index} is half applied"
            );
        }
        let beyond: Vec<&String> = present
            .iter()
            .filter(|key| {
                key[format!("kill/r{round}/").len()..][..5]
                    .parse::<u64>()
                    .is_ok_and(|index| index > in_flight)
            })
            .collect();
        assert!(
            beyond.is_empty(),
            "round {round}: writes beyond the one in flight at the kill: {beyond:?}"
        );
        for earlier in 0..round {
            let count = store
                .list(&format!("kill/r{earlier}/"))
                .await
                .expect("list an earlier round");
            assert!(
                !count.is_empty(),
                "round {round}: the writes of round {earlier} are gone"
            );
        }
    }
}

/// Body of the kill case's child process: commits one write after another into the store named
/// by the environment, printing each acknowledged index, until it is killed.
pub async fn run_kill_writer<F: EmbeddedFactory>(factory: &F) {
    use std::io::Write;
    let path = std::env::var_os(KILL_WRITER_STORE_ENV).unwrap_or_else(|| {
        panic!("{KILL_WRITER_STORE_ENV} is not set: this entry point is started by the kill case")
    });
    let round: u64 = std::env::var(KILL_WRITER_ROUND_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{KILL_WRITER_ROUND_ENV} must be a number"));
    let store = factory
        .open_at(Path::new(&path), Duration::from_secs(60), false)
        .await
        .expect("open in the writer");
    let mut stdout = std::io::stdout();
    for index in 0..KILL_WRITER_MAX_COMMITS {
        store
            .commit(
                Txn::new()
                    .then(Op::put(kill_key(round, index), kill_value(round, index)))
                    .then(Op::put(
                        kill_twin_key(round, index),
                        index.to_le_bytes().to_vec(),
                    )),
            )
            .await
            .expect("commit in the writer");
        writeln!(stdout, "{ACKNOWLEDGED}{index}").expect("print an acknowledgement");
        stdout.flush().expect("flush stdout");
    }
}

/// Opening a missing store without `create_if_missing` fails, naming the path and how a store
/// is created, and creates nothing: not the store, not its lock file, not a missing parent.
pub async fn missing_store_is_an_error_naming_the_path_and_nothing_is_created<
    F: EmbeddedFactory,
>(
    factory: &F,
) {
    let dir = tempfile::tempdir().expect("temp dir");
    for path in [
        dir.path().join("store"),
        dir.path().join("absent-parent").join("store"),
    ] {
        match factory.open_at(&path, WAIT, false).await {
            Ok(store) => panic!("opened a missing store at {}: {store:?}", path.display()),
            Err(err) => {
                let message = err.to_string();
                assert!(
                    matches!(err, KvError::Other { .. }),
                    "a missing store is a permanent error, got {err:?}"
                );
                for needle in [
                    path.display().to_string(),
                    "blockipamctl pool add".to_owned(),
                    "ipam.pools".to_owned(),
                ] {
                    assert!(
                        message.contains(&needle),
                        "{message:?} does not say {needle:?}"
                    );
                }
            }
        }
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .expect("read dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert!(left.is_empty(), "opening a missing store created {left:?}");
    }
    // With create_if_missing the same path becomes a store.
    let path = dir.path().join("store");
    let store = factory.open_at(&path, WAIT, true).await.expect("create");
    store.put("k", b"v".to_vec()).await.expect("put");
    drop(store);
    let store = factory.open_at(&path, WAIT, false).await.expect("reopen");
    assert_eq!(
        store.get("k").await.expect("get").map(|kv| kv.value),
        Some(b"v".to_vec())
    );
}

/// What an unmounted volume or a truncated creation leaves at the store path (an empty
/// directory for a directory store, an empty file for a file store) is not a store: opening it
/// without `create_if_missing` fails and leaves it as it was.
pub async fn empty_placeholder_at_store_path_is_an_error_without_create_if_missing<
    F: EmbeddedFactory,
>(
    factory: &F,
) {
    let loc = new_location();
    let created = factory
        .open_at(&loc.path, WAIT, true)
        .await
        .expect("create");
    drop(created);
    let is_directory = loc.path.is_dir();
    if is_directory {
        std::fs::remove_dir_all(&loc.path).expect("remove the store");
        std::fs::create_dir(&loc.path).expect("leave an empty directory");
    } else {
        std::fs::remove_file(&loc.path).expect("remove the store");
        std::fs::write(&loc.path, b"").expect("leave an empty file");
    }
    match factory.open_at(&loc.path, WAIT, false).await {
        Ok(store) => panic!("opened an empty placeholder as a store: {store:?}"),
        Err(err) => {
            let message = err.to_string();
            assert!(
                message.contains(&loc.path.display().to_string()),
                "{err} does not name the path"
            );
            // A message wrapped in the source keeps no run of its indentation.
            assert!(!message.contains("  "), "{message:?} has a run of spaces");
        }
    }
    if is_directory {
        assert_eq!(
            std::fs::read_dir(&loc.path).expect("read dir").count(),
            0,
            "the empty directory was filled"
        );
    } else {
        assert_eq!(
            std::fs::metadata(&loc.path).expect("stat").len(),
            0,
            "the empty file was written"
        );
    }
}

/// The revision counter is stored: the first write after reopen is newer than any before it.
pub async fn revisions_keep_growing_after_reopen<F: EmbeddedFactory>(factory: &F) {
    let loc = new_location();
    let last = {
        let store = factory.open_at(&loc.path, WAIT, true).await.expect("open");
        store.put("a", b"1".to_vec()).await.expect("put");
        let last = store.put("b", b"2".to_vec()).await.expect("put");
        store.delete("b").await.expect("delete").max(last)
    };
    let store = factory
        .open_at(&loc.path, WAIT, false)
        .await
        .expect("reopen");
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
    let holder = factory.open_at(&loc.path, WAIT, true).await.expect("open");
    holder.put("k", b"v".to_vec()).await.expect("put");
    match factory
        .open_at(&loc.path, Duration::from_millis(300), false)
        .await
    {
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

/// A second open that starts while the store is held completes only after the holder closed
/// it, and then succeeds and sees the holder's last write.
///
/// The order is checked, not the time: the holder sets a flag just before it closes, and the
/// waiting open must find the flag set when it completes. The pause before closing only gives
/// the waiting open the chance to complete too early if the lock did not hold it back.
pub async fn waiting_open_proceeds_once_the_holder_closes<F: EmbeddedFactory>(factory: &F) {
    let loc = new_location();
    let holder = factory.open_at(&loc.path, WAIT, true).await.expect("open");
    holder.put("k", b"from-holder".to_vec()).await.expect("put");
    let released = Arc::new(AtomicBool::new(false));
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let waiter = {
        let path = loc.path.clone();
        let released = Arc::clone(&released);
        async move {
            let _ = started_tx.send(());
            let opened = factory.open_at(&path, Duration::from_secs(20), false).await;
            (opened, released.load(Ordering::SeqCst))
        }
    };
    let release = {
        let released = Arc::clone(&released);
        async move {
            started_rx.await.expect("waiter started");
            tokio::time::sleep(Duration::from_millis(200)).await;
            // The holder still works while the other open waits.
            holder
                .put("k", b"last-write-before-release".to_vec())
                .await
                .expect("put while another open waits");
            released.store(true, Ordering::SeqCst);
            drop(holder);
        }
    };
    let ((opened, released_before_open_completed), ()) = tokio::join!(waiter, release);
    let store = opened.expect("open after the holder closed");
    assert!(
        released_before_open_completed,
        "the second open completed while the first handle still held the store"
    );
    assert_eq!(
        store.get("k").await.expect("get").map(|kv| kv.value),
        Some(b"last-write-before-release".to_vec())
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
    let store = factory.open_at(&loc.path, WAIT, true).await.expect("open");
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
    match factory.open_at(&loc.path, WAIT, true).await {
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
    let result = factory.open_at(&loc.path, WAIT, true).await;
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
            .open_at(&loc.path, WAIT, true)
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
    let store = factory
        .open_at(&loc.path, WAIT, false)
        .await
        .expect("reopen");
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
            .open_at(Path::new(&path), Duration::from_secs(60), false)
            .await
            .expect("open in worker");
        cas_increment(&*store, "counter")
            .await
            .expect("increment in worker");
        drop(store);
    }
}
