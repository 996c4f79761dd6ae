//! Format upgrade: stores written by format 1 (`fixtures/format-v1`, made by that release's own
//! binaries) open, check clean and keep working through the real binaries on sled, redb and etcd
//! (etcd receives the redb fixture through `migrate`, a raw copy); the claim entries of the blocks
//! that later calls write are rewritten in format 2, the others stay as they were.

use std::path::{Path, PathBuf};
use std::process::Command;

use ipam_core::model::{decode_claim, keys};
use ipnet::IpNet;
use serde_json::Value;

use crate::common::{Backend, Lab};
use crate::on_every_backend;

const BIN: &str = env!("CARGO_BIN_EXE_blockipamctl");

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/format-v1")
        .join(name)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the copy's directory");
    for entry in std::fs::read_dir(from).expect("read the fixture directory") {
        let entry = entry.expect("a fixture entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy a fixture file");
        }
    }
}

/// Puts a copy of the format-1 store into `lab` (never opening the committed fixture itself).
fn load_fixture(lab: &Lab) {
    match lab.backend {
        Backend::Sled => copy_dir(&fixture("store.sled"), &lab.path()),
        Backend::Redb => {
            std::fs::copy(fixture("store.redb"), lab.path()).expect("copy the redb fixture");
        }
        Backend::Etcd => {
            let source = Lab::new(Backend::Redb);
            std::fs::copy(fixture("store.redb"), source.path()).expect("copy the redb fixture");
            let mut args = source.store_args();
            args.push("migrate".to_owned());
            args.extend(lab.target_args());
            crate::common::ctl(&args, &[]).ok();
        }
    }
}

/// The netconf the fixture's pods were added with, pointed at this lab's store.
fn netconf(lab: &Lab, node: &str) -> String {
    let mut ipam = serde_json::json!({
        "type": "blockipam",
        "datastore_type": lab.type_name(),
        "nodename": node,
        "ipam_lock_file": lab.dir.path().join(format!("{node}.lock")),
        "assign_ipv4": "true",
        "assign_ipv6": "true",
        "ipv4_pools": ["v4"],
        "ipv6_pools": ["v6"],
    });
    match lab.etcd() {
        Some((endpoint, prefix)) => {
            ipam["etcd_endpoints"] = Value::from(endpoint);
            ipam["etcd_prefix"] = Value::from(prefix);
        }
        None => ipam["datastore_path"] = Value::from(lab.path().display().to_string()),
    }
    serde_json::json!({"cniVersion": "1.0.0", "name": "fixture", "ipam": ipam}).to_string()
}

/// Runs the real plugin once; returns its stdout, failing the test on any error.
fn plugin(lab: &Lab, command: &str, node: &str, container: &str) -> Value {
    use std::io::Write;
    let plugin = blockipam_store::testing::build_plugin_beside(Path::new(BIN));
    let mut child = Command::new(plugin)
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container)
        .env("CNI_NETNS", "/var/run/netns/format-upgrade")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/nonexistent")
        .env(
            "CNI_ARGS",
            format!("K8S_POD_NAMESPACE=default;K8S_POD_NAME={container}"),
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the plugin");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(netconf(lab, node).as_bytes())
        .expect("write the netconf");
    let output = child.wait_with_output().expect("the plugin ends");
    assert!(
        output.status.success(),
        "{command} {container} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if output.stdout.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&output.stdout).expect("the plugin's result is JSON")
    }
}

fn addresses(result: &Value) -> Vec<IpNet> {
    result["ips"]
        .as_array()
        .expect("an ips list")
        .iter()
        .map(|ip| {
            ip["address"]
                .as_str()
                .expect("an address")
                .parse()
                .expect("a CIDR")
        })
        .collect()
}

/// The format byte and free count of a block's claim entry, read raw.
fn claim_of(lab: &Lab, cidr: &str) -> (u8, Option<u32>) {
    let cidr: IpNet = cidr.parse().expect("cidr");
    lab.with_store(|store| async move {
        let kv = store
            .get(&keys::block_claim(&cidr))
            .await
            .expect("get")
            .expect("a claim entry");
        let entry = decode_claim(&kv.key, &kv.value).expect("the claim entry decodes");
        (kv.value[0], entry.free)
    })
}

fn a_format_1_store_opens_checks_clean_and_keeps_working(backend: Backend) {
    let lab = Lab::new(backend);
    load_fixture(&lab);
    // Every claim entry of the fixture is format 1, and the store reads as it did then.
    assert_eq!(claim_of(&lab, "10.80.0.96/28"), (1, None));
    lab.ctl(&["check"]).ok();
    let shown = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    let then: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("show-blocks.redb.json")).expect("read the fixture"),
    )
    .expect("fixture JSON");
    assert_eq!(shown, then, "format-1 store shown differently");

    // A new pod on node-a lands in node-a's block with room, duplicating nothing.
    let added = addresses(&plugin(&lab, "ADD", "node-a", "ctr-new"));
    let v4 = added
        .iter()
        .find(|a| a.addr().is_ipv4())
        .expect("an IPv4 address");
    let node_a_open: IpNet = "10.80.0.64/28".parse().expect("cidr");
    let node_a_first: IpNet = "10.80.0.48/28".parse().expect("cidr");
    assert!(
        node_a_open.contains(&v4.addr()) || node_a_first.contains(&v4.addr()),
        "{v4} is not in node-a's blocks"
    );
    let holder = lab
        .ctl(&["-o", "json", "show", "--ip", &v4.addr().to_string()])
        .ok()
        .json();
    assert_eq!(
        holder["handle"].as_str(),
        Some("fixture.ctr-new"),
        "{holder}"
    );
    // A pod the format-1 release added is deleted through the plugin: its addresses come free.
    plugin(&lab, "DEL", "node-a", "ctr-a1");
    let gone = lab
        .ctl(&["-o", "json", "show", "--ip", "10.80.0.49"])
        .ok()
        .json();
    assert!(
        gone["handle"].is_null(),
        "ctr-a1's address is still held: {gone}"
    );
    lab.ctl(&["check"]).ok();

    // Written blocks carry format-2 claim entries with their free count; node-b's, untouched,
    // is still format 1 and still accepted.
    let block_of_new = if node_a_open.contains(&v4.addr()) {
        "10.80.0.64/28"
    } else {
        "10.80.0.48/28"
    };
    let (version, free) = claim_of(&lab, block_of_new);
    assert_eq!(version, ipam_core::model::FORMAT_VERSION);
    assert!(free.is_some(), "a rewritten entry records the free count");
    assert_eq!(claim_of(&lab, "10.80.0.96/28"), (1, None));
}

on_every_backend!(a_format_1_store_opens_checks_clean_and_keeps_working);
