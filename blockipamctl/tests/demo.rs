//! The README quickstart's main job end to end: `blockipamctl demo` runs the real `blockipam` plugin
//! through the CNI protocol. The test builds the plugin first (`cargo build -p blockipam`, same
//! profile and target directory as this test), so `cargo test -p blockipamctl` alone is enough; it
//! fails, never skips, when the plugin cannot be built or found.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_blockipamctl");

/// Builds the plugin beside this package's binary and returns its path.
fn build_plugin() -> PathBuf {
    test_kit::plugin::build_plugin_beside(Path::new(BIN))
}

fn run_demo(dir: &Path, json: bool) -> (i32, String, String) {
    let mut command = Command::new(BIN);
    if json {
        command.args(["-o", "json"]);
    }
    command.arg("demo").arg("--dir").arg(dir);
    for name in [
        "DATASTORE_TYPE",
        "DATASTORE_PATH",
        "BLOCKIPAM_PLUGIN",
        "BLOCKIPAMCTL_OUTPUT",
    ] {
        command.env_remove(name);
    }
    let output = command.output().expect("run blockipamctl demo");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn demo_runs_the_real_plugin_through_cni_and_leaves_the_pool_empty() {
    build_plugin();
    let scratch = tempfile::tempdir().expect("tempdir");
    let dir = scratch.path().join("blockipam-demo");

    let (code, out, err) = run_demo(&dir, true);
    assert_eq!(code, 0, "demo failed\nstdout:\n{out}\nstderr:\n{err}");
    let doc: Value = serde_json::from_str(&out).expect("demo JSON");
    assert_eq!(doc["ok"], true);
    assert_eq!(doc["created_pool"], true);
    let containers = doc["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 6, "two containers on each of three nodes");
    let mut addresses: Vec<&str> = containers
        .iter()
        .map(|c| c["address"].as_str().expect("an address"))
        .collect();
    for c in containers {
        assert_eq!(c["deleted"], true);
        assert_eq!(c["result"]["cniVersion"], "1.0.0");
        let address = c["address"].as_str().expect("address");
        assert!(
            address.starts_with("10.77.") && address.ends_with("/26"),
            "{address}"
        );
    }
    addresses.sort_unstable();
    addresses.dedup();
    assert_eq!(addresses.len(), 6, "addresses are distinct");
    let blocks = doc["blocks_after_add"].as_array().expect("blocks");
    let hosts: std::collections::BTreeSet<&str> =
        blocks.iter().filter_map(|b| b["host"].as_str()).collect();
    assert_eq!(
        hosts.len(),
        3,
        "each node got a block of its own: {blocks:?}"
    );
    let in_use: u64 = blocks.iter().filter_map(|b| b["in_use"].as_u64()).sum();
    assert_eq!(in_use, 6);
    assert_eq!(doc["pools_after_del"][0]["in_use"], 0);

    // Again, for people, on the same directory: it finds the pool and runs clean.
    let (code, out, err) = run_demo(&dir, false);
    assert_eq!(
        code, 0,
        "second demo failed\nstdout:\n{out}\nstderr:\n{err}"
    );
    for text in [
        "Using the store's pools: demo",
        "ADD demo-node-3-2 on node-3 -> 10.77.",
        "blockipamctl show --blocks",
        "DEL demo-node-1-1 on node-1 -> released",
        "Demo OK",
        // The tables, indented under their step.
        "\n   POOL ",
        "\n   BLOCK ",
        "(Empty blocks stay affine to their node",
    ] {
        assert!(out.contains(text), "stdout lacks {text:?}:\n{out}");
    }
    assert!(
        !out.contains("Released"),
        "the first run left nothing to release:\n{out}"
    );

    let store = dir.join("store.sled");
    let output = Command::new(BIN)
        .args(["-o", "json", "--datastore-path"])
        .arg(&store)
        .arg("show")
        .output()
        .expect("show");
    let shown: Value = serde_json::from_slice(&output.stdout).expect("show JSON");
    assert_eq!(
        shown["pools"][0]["in_use"], 0,
        "the pool is empty after the demo"
    );
}
