//! The scale regression guard: the load generator at a small size on a real etcd and on sled
//! (api mode), and through the real plugin on etcd; each run must finish with no error, no
//! duplicate address, nothing missing or leaked, and a clean `check`. Never asserts on time.
//! Also proves the guard can fail: a store that forgets writes, and a pool too small for the
//! nodes, each fail the run, and the binary exits non-zero for it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use async_trait::async_trait;
use blockipam_load::{run, LoadConfig, Mode, OpKind, Report, StopRule, StoreTarget};
use blockipam_store::{Backend, DatastoreSettings, EtcdSettings};
use ipam_core::model::keys;
use ipam_core::{KeyValue, KvError, KvStore, MemoryStore, Op, Read, ReadResult, Revision, Txn};
use test_kit::etcd::EtcdServer;

const BIN: &str = env!("CARGO_BIN_EXE_blockipam-load");

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// 50 nodes x 4 pods, 300 operations: each node fills (its first ADD claims a block) then
/// replaces a pod.
fn fifty_nodes() -> LoadConfig {
    LoadConfig {
        mode: Mode::Api,
        nodes: 50,
        pods_per_node: 4,
        stop: StopRule::Operations(300),
        pool: "10.80.0.0/16".parse().expect("cidr"),
        block_size: Some(27),
        seed: 20261122,
        concurrency: 8,
        ..LoadConfig::default()
    }
}

fn run_load(config: &LoadConfig, target: StoreTarget) -> Report {
    runtime()
        .block_on(run(config, target, &mut |_| {}))
        .unwrap_or_else(|e| panic!("the load run could not be made: {e}"))
}

/// Everything the guard demands of a run, with the whole report in the message.
fn assert_clean(report: &Report, operations: u64) {
    let text = report.to_text();
    assert_eq!(report.errors, 0, "operations failed:\n{text}");
    assert_eq!(report.duplicates(), 0, "duplicate addresses:\n{text}");
    assert!(
        report.verification.is_clean(),
        "pods and store disagree:\n{text}"
    );
    assert!(report.check.clean, "the check found problems:\n{text}");
    assert!(report.passed, "{text}");
    assert_eq!(report.operations, operations, "{text}");
    let first = &report.kinds[&OpKind::FirstAdd];
    assert_eq!(
        first.count,
        u64::from(report.config.nodes),
        "one first ADD per node:\n{text}"
    );
    assert!(
        report.kinds[&OpKind::Del].count > 0,
        "no churn happened:\n{text}"
    );
    assert_eq!(
        report.verification.believed_addresses, report.verification.run_allocations,
        "{text}"
    );
}

#[test]
fn fifty_nodes_on_a_real_etcd_through_the_api_leave_no_duplicate_and_a_clean_check() {
    let etcd = EtcdServer::start().unwrap_or_else(|e| panic!("cannot start etcd: {e}"));
    let settings = DatastoreSettings {
        backend: Backend::Etcd(EtcdSettings {
            endpoints: vec![etcd.endpoint()],
            prefix: Some("/guard/api/".into()),
            ..EtcdSettings::default()
        }),
        ..DatastoreSettings::default()
    };
    let report = run_load(&fifty_nodes(), StoreTarget::from(settings));
    assert_clean(&report, 300);
    let text = report.to_text();
    // Round trips are observed in api mode; a steady ADD is one read and one transaction, and so
    // is every DEL (the plugin's).
    let steady = &report.kinds[&OpKind::Add];
    assert!(steady.round_trips_per_op.is_some(), "{text}");
    assert!(steady.conflicts.is_some(), "{text}");
    let del = &report.kinds[&OpKind::Del];
    let del_round_trips = del.round_trips_per_op.expect("DEL round trips");
    let retried = 2.0 * del.conflicts_per_op.expect("DEL conflicts");
    assert!(
        (2.0..=2.0 + retried + 1e-9).contains(&del_round_trips),
        "a DEL is one read and one transaction (and both again per conflict): {text}"
    );
    let etcd_sizes = report
        .etcd
        .as_ref()
        .expect("etcd sizes are reported on etcd");
    let size = |members: &[blockipam_load::etcd_status::MemberStatus]| {
        members.first().and_then(|m| m.db_size_bytes)
    };
    assert!(size(&etcd_sizes.before).is_some_and(|b| b > 0), "{text}");
    assert!(size(&etcd_sizes.after).is_some_and(|b| b > 0), "{text}");
}

/// The same run with each node reading through a cache of its own, as its agent serves the
/// plugin: no duplicate, a clean check, and a steady ADD or DEL reaches etcd once (a commit; a
/// read and a commit again per conflict).
#[test]
fn fifty_nodes_on_a_real_etcd_reading_through_agent_caches_leave_no_duplicate_and_a_clean_check() {
    let etcd = EtcdServer::start().unwrap_or_else(|e| panic!("cannot start etcd: {e}"));
    let settings = DatastoreSettings {
        backend: Backend::Etcd(EtcdSettings {
            endpoints: vec![etcd.endpoint()],
            prefix: Some("/guard/cached/".into()),
            ..EtcdSettings::default()
        }),
        ..DatastoreSettings::default()
    };
    let config = LoadConfig {
        agent_cache: true,
        ..fifty_nodes()
    };
    let report = run_load(&config, StoreTarget::from(settings));
    assert_clean(&report, 300);
    let text = report.to_text();
    for kind in [OpKind::Add, OpKind::Del] {
        let steady = &report.kinds[&kind];
        let round_trips = steady.round_trips_per_op.expect("round trips");
        let retried = 2.0 * steady.conflicts_per_op.expect("conflicts");
        assert!(
            (1.0..=1.0 + retried + 1e-9).contains(&round_trips),
            "{kind:?} through the cache is one transaction (and a read and a transaction again \
             per conflict): {text}"
        );
        // The report gives each transaction's shape: a steady ADD or DEL writes the block, its
        // claim entry, the handle and the owner key (and moves the block between open/ and
        // full/ now and then), and tests the block, the handle, the format record and what
        // else its decision read.
        let written = steady.keys_written_per_commit.expect("keys written");
        let tested = steady.conditions_per_commit.expect("conditions");
        eprintln!("{kind:?}: {written} keys written, {tested} conditions per commit");
        assert!((4.0..=5.0).contains(&written), "{kind:?}: {text}");
        assert!((3.0..=16.0).contains(&tested), "{kind:?}: {text}");
    }
}

#[test]
fn fifty_nodes_on_sled_through_the_api_leave_no_duplicate_and_a_clean_check() {
    let dir = tempfile::tempdir().expect("temp dir");
    let settings = DatastoreSettings {
        backend: Backend::Sled {
            path: Some(dir.path().join("store.sled")),
        },
        ..DatastoreSettings::default()
    };
    let report = run_load(&fifty_nodes(), StoreTarget::from(settings));
    assert_clean(&report, 300);
    assert!(report.etcd.is_none());
}

/// Builds the plugin beside this package's binary and returns its path.
fn build_plugin() -> PathBuf {
    test_kit::plugin::build_plugin_beside(Path::new(BIN))
}

#[test]
fn five_nodes_through_the_real_plugin_on_etcd_leave_no_duplicate_and_a_clean_check() {
    let plugin = build_plugin();
    let etcd = EtcdServer::start().unwrap_or_else(|e| panic!("cannot start etcd: {e}"));
    let settings = DatastoreSettings {
        backend: Backend::Etcd(EtcdSettings {
            endpoints: vec![etcd.endpoint()],
            prefix: Some("/guard/plugin/".into()),
            ..EtcdSettings::default()
        }),
        ..DatastoreSettings::default()
    };
    let config = LoadConfig {
        mode: Mode::Plugin,
        nodes: 5,
        pods_per_node: 4,
        stop: StopRule::Operations(40),
        concurrency: 4,
        plugin: Some(plugin),
        ..fifty_nodes()
    };
    let report = run_load(&config, StoreTarget::from(settings));
    assert_clean(&report, 40);
    // The plugin's work is not observable from here: no round-trip figures.
    assert_eq!(report.kinds[&OpKind::Add].round_trips_per_op, None);
}

/// Acknowledges every transaction that writes a handle (an address assignment or release) and
/// applies none of them, like a store that loses acknowledged writes.
#[derive(Debug)]
struct ForgetfulStore {
    inner: MemoryStore,
}

#[async_trait]
impl KvStore for ForgetfulStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.inner.list(prefix).await
    }

    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        let writes_a_handle = txn.ops.iter().any(|op| match op {
            Op::Put { key, .. } | Op::Delete { key } => key.starts_with(&keys::handles_dir()),
        });
        if writes_a_handle {
            return Ok(Revision(u64::MAX));
        }
        self.inner.commit(txn).await
    }

    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        self.inner.read_many(reads).await
    }
}

#[test]
fn a_store_that_forgets_acknowledged_writes_fails_the_run_with_duplicates() {
    let store = Arc::new(ForgetfulStore {
        inner: MemoryStore::new(),
    });
    let config = LoadConfig {
        nodes: 3,
        stop: StopRule::ChurnCycles(0),
        ..fifty_nodes()
    };
    let report = run_load(&config, StoreTarget::Shared(store));
    let text = report.to_text();
    assert!(
        !report.passed,
        "the run passed on a store that loses writes:\n{text}"
    );
    assert!(report.duplicates() > 0, "{text}");
    assert!(report.verification.missing > 0, "{text}");
}

#[test]
fn a_pool_too_small_for_the_nodes_fails_the_run_with_errors() {
    // One /28 block in the pool and strict affinity: the second node's first ADD finds no block.
    let config = LoadConfig {
        nodes: 2,
        pods_per_node: 2,
        stop: StopRule::ChurnCycles(0),
        pool: "10.81.0.0/28".parse().expect("cidr"),
        block_size: Some(28),
        strict_affinity: true,
        concurrency: 1,
        ..fifty_nodes()
    };
    let report = run_load(&config, StoreTarget::Shared(Arc::new(MemoryStore::new())));
    let text = report.to_text();
    assert!(!report.passed, "{text}");
    assert!(report.errors > 0, "{text}");
    assert!(!report.error_samples.is_empty(), "{text}");
}

#[test]
fn the_binary_exits_zero_with_json_for_a_clean_run_and_one_for_a_failed_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    let run_binary = |extra: &[&str]| {
        let output = Command::new(BIN)
            .args([
                "--datastore-type",
                "redb",
                "--nodes",
                "3",
                "--operations",
                "20",
                "--json",
            ])
            .arg("--datastore-path")
            .arg(dir.path().join(format!("store-{}.redb", extra.len())))
            .args(extra)
            .env_remove("DATASTORE_TYPE")
            .env_remove("DATASTORE_PATH")
            .output()
            .expect("run blockipam-load");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, stdout, stderr) = run_binary(&[]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    assert_eq!(report["passed"], true);
    assert_eq!(report["operations"], 20);
    assert!(
        report["kinds"]["first_add"]["p99_ms"].is_number(),
        "{stdout}"
    );
    assert!(
        stderr.is_empty(),
        "no progress line when stderr is not a terminal: {stderr}"
    );

    let (code, stdout, stderr) = run_binary(&[
        "--pool",
        "10.82.0.0/28",
        "--block-size",
        "28",
        "--strict-affinity",
    ]);
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    assert_eq!(report["passed"], false);
    assert!(stderr.contains("FAILED"), "{stderr}");
}
