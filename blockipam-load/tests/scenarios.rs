//! The scenarios at small sizes: borrowing in a fully claimed pool reads a bounded number of block
//! values per ADD (never one per block), new nodes claim the few free blocks first, and the real
//! `blockipamctl node release --addresses` leaves the node holding nothing with a clean check.
//! Never asserts on time.

use std::path::{Path, PathBuf};

use blockipam_load::scenario::{run_scenario, Scenario, ScenarioConfig, ScenarioReport};
use blockipam_load::{LoadConfig, StoreTarget};
use blockipam_store::{Backend, DatastoreSettings};

const BIN: &str = env!("CARGO_BIN_EXE_blockipam-load");

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn sled(dir: &Path) -> StoreTarget {
    StoreTarget::from(DatastoreSettings {
        backend: Backend::Sled {
            path: Some(dir.join("store.sled")),
        },
        ..DatastoreSettings::default()
    })
}

/// A /22 of /28 blocks: 64 blocks.
fn small_pool(nodes: u32) -> LoadConfig {
    LoadConfig {
        nodes,
        pool: "10.93.0.0/22".parse().expect("cidr"),
        block_size: Some(28),
        concurrency: 2,
        ..LoadConfig::default()
    }
}

fn borrow(
    config: &LoadConfig,
    claimed_percent: u32,
    dir: &Path,
) -> blockipam_load::scenario::borrow::BorrowReport {
    let scenario = ScenarioConfig {
        scenario: Scenario::Borrow,
        claimed_percent,
        ..ScenarioConfig::default()
    };
    match runtime().block_on(run_scenario(config, &scenario, sled(dir))) {
        Ok(ScenarioReport::Borrow(report)) => *report,
        other => panic!("the borrow scenario did not run: {other:?}"),
    }
}

#[test]
fn in_a_fully_claimed_pool_every_new_node_borrows_reading_a_bounded_number_of_blocks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let report = borrow(&small_pool(3), 100, dir.path());
    let text = report.to_text();
    assert!(report.passed, "{text}");
    assert_eq!((report.blocks, report.claimed_blocks), (64, 64), "{text}");
    assert_eq!(report.borrowed.count, 3, "every ADD borrows:\n{text}");
    assert_eq!(report.claimed.count, 0, "{text}");
    assert_eq!(report.allocations, 64 + 3, "{text}");
    // The search reads the claim index, then only the blocks it uses: far fewer than 64.
    assert!(
        report.borrowed.block_values_max <= 4,
        "a borrowing ADD read {} block values of 64:\n{text}",
        report.borrowed.block_values_max
    );
    assert!(
        report.borrowed.reads_total.claim_entries > 0,
        "borrowing never read the claim index:\n{text}"
    );
    assert!(report.borrowed.round_trips_max > 0, "{text}");
}

#[test]
fn in_a_nearly_full_pool_new_nodes_claim_the_free_blocks_first() {
    let dir = tempfile::tempdir().expect("temp dir");
    // 90% of 64 blocks: 57 claimed, 7 free; 3 new nodes each claim one.
    let report = borrow(&small_pool(3), 90, dir.path());
    let text = report.to_text();
    assert!(report.passed, "{text}");
    assert_eq!(report.claimed_blocks, 57, "{text}");
    assert_eq!(report.claimed.count, 3, "{text}");
    assert_eq!(report.borrowed.count, 0, "{text}");
}

/// Builds blockipamctl beside this package's binary (same target directory and profile).
fn build_blockipamctl() -> PathBuf {
    let exe_dir = Path::new(BIN).parent().expect("a directory");
    let target_dir = exe_dir.parent().expect("a target directory");
    assert_eq!(
        exe_dir.file_name().and_then(|n| n.to_str()),
        Some("debug"),
        "this test builds blockipamctl with the debug profile into {}",
        exe_dir.display()
    );
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let output = test_kit::plugin::cargo_command()
        .args([
            "build",
            "-p",
            "blockipamctl",
            "--bin",
            "blockipamctl",
            "--manifest-path",
        ])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir)
        .output()
        .expect("run cargo");
    assert!(
        output.status.success(),
        "this test needs blockipamctl, and `cargo build -p blockipamctl` failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let ctl = exe_dir.join("blockipamctl");
    assert!(ctl.is_file(), "{} was not built", ctl.display());
    ctl
}

#[test]
fn blockipamctl_node_release_leaves_the_node_holding_nothing_and_a_clean_check() {
    let ctl = build_blockipamctl();
    let dir = tempfile::tempdir().expect("temp dir");
    let config = LoadConfig {
        pool: "10.94.0.0/24".parse().expect("cidr"),
        block_size: Some(28),
        max_blocks_per_host: Some(0),
        ..LoadConfig::default()
    };
    let scenario = ScenarioConfig {
        scenario: Scenario::NodeRelease,
        addresses: 40,
        blockipamctl: Some(ctl),
        ..ScenarioConfig::default()
    };
    let report = match runtime().block_on(run_scenario(&config, &scenario, sled(dir.path()))) {
        Ok(ScenarioReport::NodeRelease(report)) => *report,
        other => panic!("the node-release scenario did not run: {other:?}"),
    };
    let text = report.to_text();
    assert!(report.passed, "{text}");
    assert_eq!(report.blockipamctl.exit_code, Some(0), "{text}");
    assert_eq!(report.node, "load-node-00000", "{text}");
    assert_eq!(report.node_allocations_after, 0, "{text}");
    assert_eq!(report.node_blocks_after, 0, "{text}");
    assert_eq!(report.allocations_after, 0, "{text}");
    assert!(report.check.clean, "{text}");
    assert_eq!(report.api_release.released_addresses, 40, "{text}");
    // Batched: 40 addresses are two release transactions (32 each at most) and one that moves
    // the node's blocks, not one transaction per pod.
    assert!(report.api_release.commits <= 4, "{text}");
}
