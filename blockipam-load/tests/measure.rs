//! The scale-measurement options of the load generator at small sizes: the raw etcd ceiling
//! (measured, reported beside the allocation rate, its keys deleted), the prefill (made the
//! plugin's way, excluded from the measured operations and from the leak count, checked present
//! at the end), and several
//! plugin processes of one node at once on an embedded store (lanes). Never asserts on time.

use std::path::Path;

use blockipam_load::{
    run, LoadConfig, LoadError, Mode, OpKind, RawShape, Report, StopRule, StoreTarget,
};
use blockipam_store::{Backend, DatastoreSettings, EtcdSettings};
use ipam_core::allocator::leaks::{
    ATTR_CONTAINER_ID, ATTR_INTERFACE, ATTR_NAMESPACE, ATTR_POD, ATTR_TIMESTAMP,
};
use ipam_core::allocator::ATTR_NODE;
use ipam_core::model::timestamp::parse_rfc3339_utc;
use ipam_core::{AllocationInfo, Ipam};
use std::time::Duration;
use test_kit::etcd::EtcdServer;

const BIN: &str = env!("CARGO_BIN_EXE_blockipam-load");

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn small() -> LoadConfig {
    LoadConfig {
        nodes: 4,
        pods_per_node: 3,
        stop: StopRule::Operations(24),
        pool: "10.90.0.0/16".parse().expect("cidr"),
        block_size: Some(26),
        seed: 9,
        concurrency: 4,
        ..LoadConfig::default()
    }
}

fn run_load(config: &LoadConfig, target: StoreTarget) -> Result<Report, LoadError> {
    runtime().block_on(run(config, target, &mut |_| {}))
}

/// The settings of a run on `etcd` under `prefix`.
fn etcd_settings(etcd: &EtcdServer, prefix: &str) -> DatastoreSettings {
    DatastoreSettings {
        backend: Backend::Etcd(EtcdSettings {
            endpoints: vec![etcd.endpoint()],
            prefix: Some(prefix.into()),
            ..EtcdSettings::default()
        }),
        ..DatastoreSettings::default()
    }
}

#[test]
fn the_raw_etcd_ceiling_is_measured_beside_the_run_and_its_keys_are_deleted() {
    let etcd = EtcdServer::start().unwrap_or_else(|e| panic!("cannot start etcd: {e}"));
    let prefix = "/measure/raw/";
    let settings = etcd_settings(&etcd, prefix);
    let config = LoadConfig {
        raw_etcd_ceiling: Some(Duration::from_millis(500)),
        ..small()
    };
    let cpu_at = || {
        runtime()
            .block_on(blockipam_load::etcd_status::cpu_seconds(&[etcd.endpoint()]))
            .expect("etcd's CPU seconds")
    };
    let cpu_before = cpu_at();
    let report = run_load(&config, StoreTarget::from(settings)).expect("the run was made");
    let cpu_after = cpu_at();
    let text = report.to_text();
    assert!(report.passed, "{text}");
    let raw = report
        .raw_ceiling
        .as_ref()
        .expect("raw_ceiling is reported");
    assert_eq!(raw.workers, 4, "{text}");
    assert!(raw.writes > 0, "no raw write committed:\n{text}");
    assert_eq!(raw.errors, 0, "{text}");
    assert_eq!(raw.keys_deleted, raw.writes as i64, "{text}");
    let ratio = report
        .allocation_to_raw_ratio
        .expect("allocation_to_raw_ratio is reported");
    let expected = report.operations_per_second / raw.writes_per_second;
    assert!(
        (ratio - expected).abs() <= expected * 1e-9,
        "{ratio} != {expected}"
    );
    assert!(text.contains("raw etcd ceiling"), "{text}");
    // What etcd itself spent on each phase, read from its metrics before and after each.
    let cpu = report.etcd_cpu.as_ref().expect("etcd_cpu is reported");
    assert_eq!(cpu.error, None, "{text}");
    let run_seconds = cpu.run_seconds.expect("the run's etcd CPU");
    assert!(run_seconds >= 0.0, "{text}");
    let per_operation = cpu.per_operation_ms.expect("per operation");
    let expected = run_seconds * 1000.0 / report.operations as f64;
    assert!((per_operation - expected).abs() <= 1e-9, "{text}");
    // Half a second of raw writes costs etcd more than its metric's resolution (10 ms).
    let raw_seconds = cpu.raw_seconds.expect("the raw loop's etcd CPU");
    assert!(raw_seconds > 0.0, "{text}");
    // Each phase's figure is what etcd spent within it: the two spans lie inside the whole run.
    assert!(
        run_seconds + raw_seconds <= cpu_after - cpu_before + 1e-9,
        "{run_seconds} + {raw_seconds} > {cpu_after} - {cpu_before}: {text}"
    );
    let per_raw = cpu.per_raw_write_ms.expect("per raw write");
    assert!(
        (per_raw - raw_seconds * 1000.0 / raw.writes as f64).abs() <= 1e-9,
        "{text}"
    );
    if per_operation > 0.0 {
        let ratio = cpu.raw_write_to_operation.expect("the CPU ratio");
        assert!((ratio - per_raw / per_operation).abs() <= 1e-9, "{text}");
    }
    assert!(text.contains("etcd CPU (its members, summed)"), "{text}");
    let json = serde_json::to_value(&report).expect("JSON");
    assert!(json["raw_ceiling"]["writes_per_second"].is_number());
    assert!(json["etcd_cpu"]["per_raw_write_ms"].is_number());
    // Nothing of the raw loop is left under the run's prefix.
    let left = etcd
        .etcdctl(
            None,
            &[
                "get",
                "--prefix",
                "--keys-only",
                &format!("{prefix}raw-ceiling/"),
            ],
        )
        .expect("etcdctl get");
    assert!(left.trim().is_empty(), "raw keys left behind: {left}");
    // The allocation run's keys are still there.
    let kept = etcd
        .etcdctl(None, &["get", "--prefix", "--keys-only", prefix])
        .expect("etcdctl get");
    assert!(!kept.trim().is_empty(), "the run's own keys are gone");
}

#[test]
fn a_shaped_raw_loop_puts_and_tests_the_keys_it_is_told_and_deletes_them_all() {
    let etcd = EtcdServer::start().unwrap_or_else(|e| panic!("cannot start etcd: {e}"));
    let prefix = "/measure/shaped/";
    let settings = etcd_settings(&etcd, prefix);
    let shape = RawShape {
        extra_puts: 2,
        extra_conditions: 3,
        value_bytes: 64,
    };
    let config = LoadConfig {
        raw_etcd_ceiling: Some(Duration::from_millis(500)),
        raw_etcd_shape: shape,
        ..small()
    };
    let report = run_load(&config, StoreTarget::from(settings)).expect("the run was made");
    let text = report.to_text();
    assert!(report.passed, "{text}");
    let raw = report
        .raw_ceiling
        .as_ref()
        .expect("raw_ceiling is reported");
    assert_eq!(raw.shape, shape, "{text}");
    assert!(
        raw.writes > 0,
        "no raw write committed:
{text}"
    );
    assert_eq!(raw.errors, 0, "{text}");
    // Each write put three keys; each of the 4 workers put 3 keys to test first.
    assert_eq!(raw.keys_deleted, raw.writes as i64 * 3 + 4 * 3, "{text}");
    assert!(
        text.contains("writes of 64 bytes (each with 2 more puts and 3 more conditions)"),
        "{text}"
    );
    // The keys as they stood right before the loop's one deletion (the last write): each value
    // has the size asked for.
    let status = etcd
        .etcdctl(None, &["get", "any-key", "-w", "json"])
        .expect("etcdctl get");
    let status: serde_json::Value = serde_json::from_str(&status).expect("etcdctl's JSON");
    let revision = status["header"]["revision"].as_i64().expect("a revision");
    let before_deletion = format!("--rev={}", revision - 1);
    let raw_prefix = format!("{prefix}raw-ceiling/");
    let values = etcd
        .etcdctl(
            None,
            &[
                "get",
                "--prefix",
                &raw_prefix,
                &before_deletion,
                "--print-value-only",
            ],
        )
        .expect("etcdctl get at the revision before the deletion");
    let values: Vec<&str> = values.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(values.len() as i64, raw.keys_deleted, "{text}");
    assert!(
        values.iter().all(|v| *v == "x".repeat(64)),
        "values of other sizes: {:?}",
        values
            .iter()
            .map(|v| v.len())
            .collect::<std::collections::BTreeSet<_>>()
    );
}

#[test]
fn the_raw_etcd_ceiling_on_an_embedded_store_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let settings = DatastoreSettings {
        backend: Backend::Sled {
            path: Some(dir.path().join("store.sled")),
        },
        ..DatastoreSettings::default()
    };
    let config = LoadConfig {
        raw_etcd_ceiling: Some(Duration::from_secs(1)),
        ..small()
    };
    let result = run_load(&config, StoreTarget::from(settings));
    assert!(matches!(result, Err(LoadError::Usage(_))), "{result:?}");
}

#[test]
fn prefilled_allocations_are_not_measured_nor_leaked_and_are_all_present_at_the_end() {
    let dir = tempfile::tempdir().expect("temp dir");
    let settings = settings_for(dir.path());
    let config = LoadConfig {
        prefill: 70,
        ..small()
    };
    let report = run_load(&config, StoreTarget::from(settings)).expect("the run was made");
    let text = report.to_text();
    assert!(report.passed, "{text}");
    assert_eq!(report.operations, 24, "the prefill was counted:\n{text}");
    let prefill = report.prefill.as_ref().expect("prefill is reported");
    assert_eq!(prefill.node, "load-node-00000", "{text}");
    assert_eq!((prefill.addresses, prefill.handles), (70, 70), "{text}");
    assert_eq!(prefill.present, 70, "{text}");
    let v = &report.verification;
    assert_eq!(v.leaked, 0, "{text}");
    assert_eq!(v.run_allocations, v.believed_addresses, "{text}");
    assert_eq!(v.store_allocations, 70 + v.run_allocations, "{text}");
    assert_eq!(report.pool.in_use, 70 + v.run_allocations, "{text}");

    // Every allocation, prefilled or made by the run, is recorded as the plugin records a pod's.
    let allocations = allocations_in(&settings_for(dir.path()));
    assert_eq!(allocations.len() as u64, v.store_allocations, "{text}");
    let prefix = format!("{}-prefill.", config.network);
    let prefilled = allocations
        .iter()
        .filter(|a| a.handle.starts_with(&prefix))
        .count();
    assert_eq!(prefilled, 70, "one prefilled address per handle");
    assert_recorded_as_the_plugin_records(&allocations);
}

/// Every allocation the store at `settings` holds.
fn allocations_in(settings: &DatastoreSettings) -> Vec<AllocationInfo> {
    runtime().block_on(async {
        let store = settings.open().await.expect("open the store");
        Ipam::new(store).list_allocations().await.expect("list")
    })
}

/// Asserts that each allocation carries what the plugin records for a Kubernetes pod: a 64-hex
/// container id its handle ends with, the interface, the pod, its namespace, the time, the node.
fn assert_recorded_as_the_plugin_records(allocations: &[AllocationInfo]) {
    assert!(!allocations.is_empty());
    for allocation in allocations {
        let attribute = |key: &str| {
            allocation
                .attributes
                .get(key)
                .unwrap_or_else(|| panic!("{allocation:?} lacks {key}"))
                .as_str()
        };
        let container = attribute(ATTR_CONTAINER_ID);
        assert_eq!(container.len(), 64, "{allocation:?}");
        assert!(
            container.bytes().all(|b| b.is_ascii_hexdigit()),
            "{allocation:?}"
        );
        assert!(allocation.handle.ends_with(&format!(".{container}")));
        assert_eq!(attribute(ATTR_INTERFACE), "eth0");
        assert!(
            attribute(ATTR_POD).starts_with("frontend-"),
            "{allocation:?}"
        );
        assert!(
            attribute(ATTR_NAMESPACE).starts_with("team-"),
            "{allocation:?}"
        );
        assert!(
            parse_rfc3339_utc(attribute(ATTR_TIMESTAMP)).is_some(),
            "{allocation:?}"
        );
        assert!(
            attribute(ATTR_NODE).starts_with("load-node-"),
            "{allocation:?}"
        );
    }
}

/// The settings of a sled store in `dir`, as the prefill test opens it.
fn settings_for(dir: &Path) -> DatastoreSettings {
    DatastoreSettings {
        backend: Backend::Sled {
            path: Some(dir.join("store.sled")),
        },
        ..DatastoreSettings::default()
    }
}

#[test]
fn many_plugin_processes_of_one_node_share_its_lock_on_redb_with_a_prefill() {
    let plugin = test_kit::plugin::build_plugin_beside(Path::new(BIN));
    let dir = tempfile::tempdir().expect("temp dir");
    let settings = DatastoreSettings {
        backend: Backend::Redb {
            path: Some(dir.path().join("store.redb")),
        },
        ..DatastoreSettings::default()
    };
    let config = LoadConfig {
        mode: Mode::Plugin,
        plugin: Some(plugin),
        nodes: 1,
        lanes_per_node: 4,
        concurrency: 4,
        prefill: 40,
        ..small()
    };
    let report = run_load(&config, StoreTarget::from(settings)).expect("the run was made");
    let text = report.to_text();
    assert!(report.passed, "{text}");
    assert_eq!(report.operations, 24, "{text}");
    // One first ADD per lane, all for the one node.
    assert_eq!(report.kinds[&OpKind::FirstAdd].count, 4, "{text}");
    assert!(report.kinds[&OpKind::Del].count > 0, "no churn:\n{text}");
    let prefill = report.prefill.as_ref().expect("prefill is reported");
    assert_eq!(prefill.present, 40, "{text}");
    assert!(text.contains("4 lanes per node"), "{text}");
    // The plugin was called as a kubelet's runtime calls it: it recorded the pods.
    let allocations = allocations_in(&DatastoreSettings {
        backend: Backend::Redb {
            path: Some(dir.path().join("store.redb")),
        },
        ..DatastoreSettings::default()
    });
    assert_eq!(
        allocations.len() as u64,
        report.verification.store_allocations
    );
    assert_recorded_as_the_plugin_records(&allocations);
}
