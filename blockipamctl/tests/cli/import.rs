//! `import calico`: a real etcd holds Calico-format objects (built from Calico's JSON shapes by
//! `test_kit::calico`); the real `blockipamctl` imports them into sled, redb and etcd,
//! then the real `blockipam` plugin releases an imported pod (same network name and container id)
//! and allocates on an imported node without duplicating or handing out an address Calico left in
//! IP cooldown. Refusals (unsupported block size, non-empty target) write nothing; a dry run
//! writes nothing.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use test_kit::calico::{sample_cluster, CalicoFixture, SAMPLE_NETWORK};
use test_kit::cni::{full_cni_env, run_cni, HANG_GUARD};
use test_kit::etcd::{unique_prefix, EtcdServer, PrefixGuard};

use crate::common::{assert_columns_line_up, block_on, Backend, Lab, BIN};

/// Calico objects in the shared etcd, under a prefix of their own (removed on drop).
struct CalicoEtcd {
    endpoint: String,
    prefix: String,
    _guard: PrefixGuard,
}

impl CalicoEtcd {
    fn holding(fixture: &CalicoFixture) -> CalicoEtcd {
        let server = EtcdServer::shared();
        let root = unique_prefix();
        let guard = PrefixGuard::new(server.config(&root));
        let prefix = format!("{root}calico");
        let endpoint = server.endpoint();
        block_on(fixture.write_to_etcd(&endpoint, &prefix)).expect("write the Calico objects");
        CalicoEtcd {
            endpoint,
            prefix,
            _guard: guard,
        }
    }

    fn args(&self) -> Vec<String> {
        vec![
            "import".into(),
            "calico".into(),
            "--from-etcd-endpoints".into(),
            self.endpoint.clone(),
            "--from-etcd-prefix".into(),
            self.prefix.clone(),
        ]
    }
}

fn import(lab: &Lab, calico: &CalicoEtcd, extra: &[&str]) -> crate::common::Run {
    let mut args = calico.args();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    lab.ctl(&refs)
}

/// The plugin, built once per test binary.
fn plugin() -> PathBuf {
    static PLUGIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PLUGIN
        .get_or_init(|| test_kit::plugin::build_plugin_beside(Path::new(BIN)))
        .clone()
}

/// Runs the real plugin for `command` on container `container` (eth0) of network
/// `k8s-pod-network` on `node`, against the lab's store.
fn cni(lab: &Lab, command: &str, container: &str, node: &str) -> (i32, Value, String) {
    let mut ipam = json!({
        "type": "blockipam",
        "nodename": node,
        "datastore_type": lab.type_name(),
        "ipam_lock_file": lab.dir.path().join("run/ipam.lock"),
        "timeout_seconds": 60,
    });
    match lab.etcd() {
        Some((endpoint, prefix)) => {
            ipam["etcd_endpoints"] = json!(endpoint);
            ipam["etcd_prefix"] = json!(prefix);
        }
        None => ipam["datastore_path"] = json!(lab.path()),
    }
    let netconf = json!({"cniVersion": "1.0.0", "name": SAMPLE_NETWORK, "ipam": ipam});
    let env = full_cni_env(
        command,
        container,
        "eth0",
        &format!("/var/run/netns/{container}"),
        "/usr/lib/cni",
    );
    let output = run_cni(
        &plugin(),
        &[],
        &env,
        netconf.to_string().as_bytes(),
        HANG_GUARD,
    );
    let value = serde_json::from_str(&output.stdout).unwrap_or(Value::Null);
    (output.status, value, output.stderr)
}

/// The marker an import from `calico` at `revision` leaves while it has not finished.
fn import_marker(calico: &CalicoEtcd, revision: i64) -> blockipam_import::ImportMarker {
    let source = blockipam_import::CalicoEtcdSource {
        prefix: calico.prefix.clone(),
        ..blockipam_import::CalicoEtcdSource::new([calico.endpoint.clone()])
    };
    blockipam_import::ImportMarker {
        source: source.describe(),
        calico_revision: revision,
    }
}

fn holder(lab: &Lab, ip: &str) -> Option<String> {
    let doc = lab.ctl(&["-o", "json", "show", "--ip", ip]).ok().json();
    doc["handle"].as_str().map(str::to_owned)
}

fn import_from_calico_etcd_then_the_plugin_takes_over(backend: Backend) {
    let calico = CalicoEtcd::holding(&sample_cluster());
    let lab = Lab::new(backend);
    let run = import(&lab, &calico, &["-o", "json"]);
    let doc = run.ok().json();
    assert_eq!(doc["pools"], 2, "{doc:#}");
    assert_eq!(doc["blocks"], 3);
    assert_eq!(doc["affine_blocks"], 3);
    assert_eq!(doc["allocations"], 6);
    assert_eq!(
        doc["handles"], 5,
        "the leaked Calico handle is not imported"
    );
    assert_eq!(doc["verified"], true);
    assert_eq!(doc["resumed"], false);
    assert_eq!(doc["sequence_floor"], 2001);
    assert_eq!(doc["config"]["max_blocks_per_host"], 20);
    let not_mapped = doc["not_mapped"].as_array().expect("not_mapped");
    let reported = |object: &str, field: &str| {
        not_mapped.iter().any(|n| {
            n["object"].as_str().is_some_and(|o| o.contains(object)) && n["field"] == field
        })
    };
    assert!(
        reported("affinity node-c 10.244.0.128/26", "state"),
        "{not_mapped:#?}"
    );
    assert!(
        !reported("ipreservation reserved-edge", "spec.reservedCIDRs"),
        "IP reservations are mapped: {not_mapped:#?}"
    );
    assert_eq!(doc["reservations"], 1);
    assert_eq!(
        lab.ctl(&["reservation", "list", "-o", "json"]).ok().json(),
        serde_json::json!([{
            "name": "reserved-edge",
            "cidrs": ["10.244.0.200/30", "fd00:10:244::ff/128"],
        }])
    );
    assert!(reported("ippool default-ipv4-ippool", "spec.ipipMode"));
    // Calico's IP cooldown arrives: the setting, and the two addresses it released into cooldown
    // (.5 still cooling, .6 cooled but not yet freed by a write), with the claim time of B.
    assert!(
        !reported("ipam config", "ipCooldownSeconds"),
        "{not_mapped:#?}"
    );
    assert!(
        !reported("blocks", "affinity_claim_time"),
        "{not_mapped:#?}"
    );
    assert!(!reported("allocations", "releasedAt"), "{not_mapped:#?}");
    assert_eq!(doc["config"]["ip_cooldown_seconds"], 30);
    assert_eq!(doc["cooling_addresses"], 2);
    let config = lab.ctl(&["-o", "json", "config", "show"]).ok().json();
    assert_eq!(config["ip_cooldown_seconds"], 30, "{config}");
    let block_row = |cidr: &str| -> Value {
        let usage = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
        usage["blocks"]
            .as_array()
            .and_then(|blocks| blocks.iter().find(|b| b["cidr"] == cidr))
            .cloned()
            .unwrap_or_else(|| panic!("block {cidr} in {usage:#}"))
    };
    let a = block_row("10.244.0.0/26");
    assert_eq!(
        (a["in_use"].clone(), a["cooling"].clone(), a["free"].clone()),
        (json!(4), json!(1), json!(59)),
        "{a:#}"
    );
    assert_eq!(holder(&lab, "10.244.0.5"), None, "cooling: nobody holds it");

    lab.ctl(&["check"]).ok();
    let handle = |container: &str| format!("{SAMPLE_NETWORK}.{container}");
    assert_eq!(holder(&lab, "10.244.0.1"), Some(handle("c1")));
    assert_eq!(holder(&lab, "fd00:10:244::"), Some(handle("c1")));
    assert_eq!(
        holder(&lab, "10.244.0.4"),
        Some(handle("b9")),
        "the borrowed address"
    );
    assert_eq!(
        holder(&lab, "10.244.0.0"),
        Some("ipip-tunnel-addr-node-a".to_owned())
    );
    assert_eq!(holder(&lab, "10.244.0.3"), None, "released in Calico");

    // The real plugin's DEL, same network name and container id, releases what Calico allocated:
    // both of c1's addresses, in two blocks.
    let (code, _, stderr) = cni(&lab, "DEL", "c1", "node-a");
    assert_eq!(code, 0, "DEL failed: {stderr}");
    assert_eq!(holder(&lab, "10.244.0.1"), None);
    assert_eq!(holder(&lab, "fd00:10:244::"), None);
    assert_eq!(
        holder(&lab, "10.244.0.2"),
        Some(handle("c2")),
        "others untouched"
    );

    // ADD on an imported node continues in its block, in Calico's free-list order (.7: the
    // released .3, the cooled .6 and the now cooling .1 wait at the tail, .5 still cools),
    // duplicating nothing.
    let (code, result, stderr) = cni(&lab, "ADD", "c9", "node-a");
    assert_eq!(code, 0, "ADD failed: {stderr}");
    assert_eq!(result["ips"][0]["address"], "10.244.0.7/26", "{result:#}");
    assert_eq!(holder(&lab, "10.244.0.7"), Some(handle("c9")));
    assert_eq!(holder(&lab, "10.244.0.5"), None);
    let a = block_row("10.244.0.0/26");
    assert_eq!(
        (a["in_use"].clone(), a["cooling"].clone()),
        (json!(4), json!(2)),
        "c1's .1 went into the imported 30 s cooldown beside .5: {a:#}"
    );
    lab.ctl(&["check"]).ok();
}

crate::on_every_backend!(import_from_calico_etcd_then_the_plugin_takes_over);

#[test]
fn unsupported_block_size_is_refused_and_nothing_is_written() {
    let fixture = CalicoFixture::new()
        .pool("big-blocks", "10.32.0.0/16", 20, json!({}))
        .pool("fine", "10.33.0.0/24", 26, json!({}));
    let calico = CalicoEtcd::holding(&fixture);
    for backend in [Backend::Sled, Backend::Etcd] {
        let lab = Lab::new(backend);
        let run = import(&lab, &calico, &[]);
        run.expect_code(1);
        let line = run.error_line();
        assert!(
            line.contains("big-blocks")
                && line.contains("/20")
                && line.contains("nothing was written"),
            "{line}"
        );
        match backend {
            Backend::Etcd => assert!(lab.snapshot().is_empty(), "nothing written to etcd"),
            _ => assert!(!lab.path().exists(), "no embedded store was even created"),
        }
    }
}

#[test]
fn non_empty_target_is_refused_and_left_unchanged() {
    let calico = CalicoEtcd::holding(&sample_cluster());
    let lab = Lab::new(Backend::Redb);
    lab.ctl(&["pool", "add", "10.40.0.0/24"]).ok();
    let before = lab.snapshot();
    let run = import(&lab, &calico, &[]);
    run.expect_code(1);
    assert!(run.error_line().contains("not empty"), "{}", run.stderr);
    assert_eq!(lab.snapshot(), before);
}

#[test]
fn dry_run_reports_in_a_table_and_writes_nothing() {
    let calico = CalicoEtcd::holding(&sample_cluster());
    let lab = Lab::new(Backend::Sled);
    let run = import(&lab, &calico, &["--dry-run"]);
    run.ok()
        .stdout_has("Dry run")
        .stdout_has("2 pools, 3 blocks (3 affine to a host), 6 allocations, 5 handles")
        .stdout_has("2 addresses in IP cooldown")
        .stdout_has("ip_cooldown_seconds 30")
        .stdout_has("Nothing was written.")
        .stdout_has("spec.ipipMode");
    let table = run
        .stdout
        .split_once("Not mapped")
        .and_then(|(_, rest)| rest.split_once('\n'))
        .map(|(_, table)| table.to_owned())
        .expect("a not-mapped table");
    assert_columns_line_up(&table);
    assert!(!lab.path().exists(), "a dry run creates no store");
}

#[test]
fn source_flag_mistakes_are_usage_errors() {
    let lab = Lab::new(Backend::Sled);
    let run = lab.ctl(&[
        "import",
        "calico",
        "--from-etcd-endpoints",
        "127.0.0.1:1",
        "--from-etcd-username",
        "root",
    ]);
    run.expect_code(2);
    assert!(run.error_line().contains("--from-etcd-password-env"));
    let run = lab.ctl(&[
        "import",
        "calico",
        "--from-etcd-endpoints",
        "127.0.0.1:1",
        "--from-etcd-username",
        "root",
        "--from-etcd-password-env",
        "BLOCKIPAM_TEST_UNSET_PASSWORD",
    ]);
    run.expect_code(2);
    assert!(run.error_line().contains("BLOCKIPAM_TEST_UNSET_PASSWORD"));
    let run = lab.ctl(&[
        "import",
        "calico",
        "--from-etcd-endpoints",
        "127.0.0.1:1",
        "--from-etcd-ca-cert-file",
        "/nonexistent/ca.pem",
    ]);
    run.expect_code(2);
    assert!(run.error_line().contains("/nonexistent/ca.pem"));
}

/// Calico's etcd over TLS with client certificates and authentication on: the import logs in with
/// the certificate, the CA and a user whose role reads only Calico's prefix.
#[test]
fn import_reads_a_tls_etcd_with_client_certificates_and_a_user() {
    use backend_etcd::{EtcdConfig, EtcdStore};
    use ipam_core::KvStore;
    use test_kit::etcd::{EtcdServerOptions, TestPki};

    let pki = TestPki::generate().expect("this test needs openssl");
    let server = EtcdServer::start_with(EtcdServerOptions {
        tls: Some(pki.server_tls(true)),
        ..EtcdServerOptions::default()
    })
    .expect("this test needs etcd");
    let config = EtcdConfig::new([server.endpoint()])
        .with_prefix("")
        .with_ca_cert(pki.ca_cert())
        .with_client_cert(pki.client_cert(), pki.client_key());
    block_on(async {
        let store = EtcdStore::connect(config).await.expect("connect over TLS");
        for entry in sample_cluster().entries() {
            store
                .put(&format!("/calico{}", entry.key), entry.value.clone())
                .await
                .expect("write a Calico object");
        }
    });
    server
        .enable_auth(
            Some(&pki),
            "root-pw",
            "calico-reader",
            "Reader-pw-7d1e",
            "/calico/",
        )
        .expect("enable etcd authentication");

    let lab = Lab::new(Backend::Sled);
    let (ca, cert, key) = (pki.ca_cert(), pki.client_cert(), pki.client_key());
    let args = [
        "-o",
        "json",
        "import",
        "calico",
        "--from-etcd-endpoints",
        &server.endpoint(),
        "--from-etcd-ca-cert-file",
        ca.to_str().expect("path"),
        "--from-etcd-cert-file",
        cert.to_str().expect("path"),
        "--from-etcd-key-file",
        key.to_str().expect("path"),
        "--from-etcd-username",
        "calico-reader",
        "--from-etcd-password-env",
        "CALICO_ETCD_PASSWORD",
    ];
    let wrong = lab.ctl_env(&args, &[("CALICO_ETCD_PASSWORD", "wrong")]);
    wrong.expect_code(1);
    assert!(!wrong.stderr.contains("Reader-pw-7d1e"));
    assert!(!lab.path().exists(), "a failed read opens no target");
    let doc = lab
        .ctl_env(&args, &[("CALICO_ETCD_PASSWORD", "Reader-pw-7d1e")])
        .ok()
        .json();
    assert_eq!(doc["allocations"], 6, "{doc:#}");
    assert_eq!(doc["verified"], true);
    lab.ctl(&["check"]).ok();
}

/// An import that stopped right after writing its marker: `check` reports it, and the same
/// command run again resumes it (from the revision the marker names) and finishes.
#[test]
fn interrupted_import_is_reported_by_check_and_resumed_by_the_next_run() {
    use blockipam_import::marker_key;
    use ipam_core::model::encode;

    let calico = CalicoEtcd::holding(&sample_cluster());
    let lab = Lab::new(Backend::Sled);
    let planned = import(&lab, &calico, &["-o", "json", "--dry-run"])
        .ok()
        .json();
    let revision = planned["calico_revision"].as_i64().expect("a revision");
    let marker = import_marker(&calico, revision);
    lab.with_store(|store| async move {
        store
            .put(&marker_key(), encode(&marker).expect("encode the marker"))
            .await
            .expect("write the marker");
    });

    let run = lab.ctl(&["-o", "json", "check"]);
    run.expect_code(1);
    let problems = run.json()["problems"].clone();
    assert!(
        problems
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["kind"] == "import-in-progress")),
        "{problems:#}"
    );

    let doc = import(&lab, &calico, &["-o", "json"]).ok().json();
    assert_eq!(doc["resumed"], true, "{doc:#}");
    assert_eq!(doc["calico_revision"], revision);
    assert_eq!(doc["allocations"], 6);
    assert_eq!(doc["verified"], true);
    lab.ctl(&["check"]).ok();
}

/// An import that stopped after writing its blocks and before their handles: `check` reports the
/// missing handles as repairable, but `check --repair` repairs nothing while the import is
/// unfinished (handles rebuilt from the blocks written so far could differ from what the import
/// writes, and it would refuse to resume) and says to run the import again; the import then
/// resumes and finishes, and the store is clean.
#[test]
fn check_repair_leaves_an_unfinished_import_to_the_import() {
    use blockipam_import::marker_key;
    use ipam_core::model::{encode, keys};

    let calico = CalicoEtcd::holding(&sample_cluster());
    // What the import writes before its handles, taken from a finished import into another
    // store (without the pool generation: written last, and raised when the marker went).
    let finished = Lab::new(Backend::Sled);
    let done = import(&finished, &calico, &["-o", "json"]).ok().json();
    let revision = done["calico_revision"].as_i64().expect("a revision");
    let written: Vec<(String, Vec<u8>)> = finished
        .snapshot()
        .into_iter()
        .map(|(key, value, _)| (key, value))
        .filter(|(key, _)| {
            !key.starts_with(&keys::handles_dir()) && *key != keys::pool_generation()
        })
        .collect();
    assert!(
        written
            .iter()
            .any(|(key, _)| key.starts_with(&keys::blocks_dir())),
        "the import wrote no block"
    );
    let marker = import_marker(&calico, revision);
    let lab = Lab::new(Backend::Sled);
    lab.with_store(|store| async move {
        store
            .put(&marker_key(), encode(&marker).expect("encode the marker"))
            .await
            .expect("write the marker");
        for (key, value) in written {
            store.put(&key, value).await.expect("write a key");
        }
    });

    let checked = lab.ctl(&["-o", "json", "check"]);
    checked.expect_code(1);
    let problems = checked.json()["problems"].clone();
    assert!(
        problems
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["repairable"] == true)
                && p.iter().any(|p| p["kind"] == "import-in-progress")),
        "{problems:#}"
    );
    let before = lab.snapshot();
    let held_back = lab.ctl(&["check", "--repair"]);
    held_back
        .expect_code(1)
        .stdout_has("Nothing was repaired: an `import calico` did not finish.");
    assert_eq!(
        lab.snapshot(),
        before,
        "check --repair wrote during an import"
    );
    let json = lab.ctl(&["-o", "json", "check", "--repair"]);
    json.expect_code(1);
    let json = json.json();
    assert_eq!(json["repaired"], serde_json::json!([]), "{json:#}");
    assert_eq!(json["clean"], false, "{json:#}");

    let doc = import(&lab, &calico, &["-o", "json"]).ok().json();
    assert_eq!(doc["resumed"], true, "{doc:#}");
    assert_eq!(doc["verified"], true, "{doc:#}");
    lab.ctl(&["check"]).ok();
}

/// Calico's pools select nodes by the labels of Calico's Node resources: the import carries the
/// labels, so after it each node's pods come from the pool that selected it under Calico, and a
/// node no pool selects still gets none (code 109).
#[test]
fn calico_node_labels_are_imported_and_pools_select_on_them() {
    let fixture = CalicoFixture::new()
        .pool(
            "rack-a",
            "10.50.0.0/24",
            26,
            json!({"nodeSelector": "rack == \"a\""}),
        )
        .pool(
            "rack-b",
            "10.51.0.0/24",
            26,
            json!({"nodeSelector": "rack == \"b\" && has(kubernetes.io/hostname)"}),
        )
        .node(
            "node-a",
            &[("rack", "a"), ("kubernetes.io/hostname", "node-a")],
        )
        .node(
            "node-b",
            &[("rack", "b"), ("kubernetes.io/hostname", "node-b")],
        )
        .node("node-c", &[]);
    let calico = CalicoEtcd::holding(&fixture);
    for backend in [Backend::Sled, Backend::Etcd] {
        let lab = Lab::new(backend);
        let doc = import(&lab, &calico, &["-o", "json"]).ok().json();
        assert_eq!(doc["labelled_nodes"], 2, "{doc:#}");
        assert_eq!(doc["verified"], true, "{doc:#}");
        lab.ctl(&["node", "show", "node-b"])
            .ok()
            .stdout_has("rack")
            .stdout_has("kubernetes.io/hostname");
        for (node, pool) in [("node-a", "10.50.0."), ("node-b", "10.51.0.")] {
            let (status, result, stderr) = cni(&lab, "ADD", &format!("pod-on-{node}"), node);
            assert_eq!(status, 0, "{node}: {stderr} {result}");
            let ip = result["ips"][0]["address"].as_str().unwrap_or_default();
            assert!(ip.starts_with(pool), "{node} got {ip}, not from {pool}0/24");
        }
        let (status, error, _) = cni(&lab, "ADD", "pod-on-node-c", "node-c");
        assert_ne!(status, 0);
        assert_eq!(error["code"], 109, "{error}");
    }
}

/// A Calico Node label blockipam cannot hold refuses the import before anything is written: a
/// node without one of its labels could draw addresses from another pool.
#[test]
fn a_node_label_blockipam_cannot_hold_refuses_the_import_and_writes_nothing() {
    let fixture = CalicoFixture::new()
        .pool("all", "10.52.0.0/24", 26, json!({"nodeSelector": "all()"}))
        .node("node-a", &[("rack", "a")])
        .node("node-z", &[("zone", "not a label value!")]);
    let calico = CalicoEtcd::holding(&fixture);
    let lab = Lab::new(Backend::Sled);
    let run = import(&lab, &calico, &[]);
    run.expect_code(1);
    let message = run.stderr.clone();
    assert!(
        message.contains("node-z")
            && message.contains("zone")
            && message.contains("nothing was written"),
        "{message}"
    );
    assert!(!lab.path().exists(), "no embedded store was even created");
}
