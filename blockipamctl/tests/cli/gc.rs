//! `gc --dead-nodes [--grace-seconds N] [--apply]` on etcd (where agents register their nodes and
//! keep liveness keys on leases), and what it says on an embedded store.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use backend_etcd::lease::LeaseSession;
use backend_etcd::EtcdConfig;
use ipam_core::dead_nodes::{agent_key, liveness_key, register, Registration};
use serde_json::Value;

use crate::common::{assert_columns_line_up, Backend, Lab};

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .expect("a clock after 1970")
}

fn node<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["node"] == name)
        .unwrap_or_else(|| panic!("no {name} in {report:#}"))
}

fn addresses_of(lab: &Lab, host: &str) -> usize {
    let host = host.to_owned();
    lab.with_ipam(|ipam| async move {
        ipam.list_allocations()
            .await
            .expect("list allocations")
            .iter()
            .filter(|a| a.attributes.get("node") == Some(&host))
            .count()
    })
}

#[test]
fn gc_dead_nodes_shows_then_releases_only_dead_registered_nodes() {
    let lab = Lab::new(Backend::Etcd);
    let (endpoint, prefix) = lab.etcd().expect("an etcd lab");
    lab.ctl(&["pool", "add", "10.60.0.0/16"]).ok();
    for i in 0..3 {
        lab.assign(&format!("net.dead{i}"), "dead-node");
    }
    for i in 0..2 {
        lab.assign(&format!("net.alive{i}"), "alive-node");
        lab.assign(&format!("net.plain{i}"), "plugin-only");
    }
    // alive-node: registered, liveness key on a real lease (60 s, longer than the test);
    // dead-node: registered, marked missing long ago; new-node: registered, its key just gone.
    let now = unix_now();
    lab.with_store(|store| async move {
        for host in ["alive-node", "dead-node", "new-node"] {
            register(store.as_ref(), host, "test", now)
                .await
                .expect("register");
        }
        let dead = Registration {
            node: "dead-node".into(),
            registered_at: now - 5000,
            agent_version: "test".into(),
            missing_since: Some(now - 2000),
        };
        store
            .put(
                &agent_key("dead-node"),
                serde_json::to_vec(&dead).expect("JSON"),
            )
            .await
            .expect("mark dead-node missing long ago");
        let session = LeaseSession::connect(
            &EtcdConfig::new([endpoint]).with_prefix(prefix),
            Duration::from_secs(60),
        )
        .await
        .expect("a lease session");
        let lease = session.grant().await.expect("grant a lease");
        session
            .put(lease, &liveness_key("alive-node"), b"alive-node")
            .await
            .expect("put the liveness key");
    });
    let before = lab.snapshot();

    // Dry run: states and what would be released; nothing written.
    let report = lab.ctl(&["-o", "json", "gc", "--dead-nodes"]).ok().json();
    assert_eq!(report["applied"], false);
    assert_eq!(report["grace_seconds"], 900);
    assert_eq!(node(&report, "alive-node")["state"], "alive");
    assert_eq!(node(&report, "new-node")["state"], "missing");
    assert_eq!(node(&report, "new-node")["missing_since"], Value::Null);
    let dead = node(&report, "dead-node");
    assert_eq!(dead["state"], "dead");
    assert_eq!(dead["missing_since"], now - 2000);
    assert_eq!(dead["would_release"]["blocks"], 1);
    assert_eq!(dead["would_release"]["addresses"], 3);
    assert_eq!(report["nodes"].as_array().map(Vec::len), Some(3));
    let table = lab.ctl(&["gc", "--dead-nodes"]);
    table
        .ok()
        .stdout_has("3 nodes registered (grace period 900s), nothing changed")
        .stdout_has("would release (--apply)")
        .stdout_has("missing (not marked yet)")
        .stdout_has("--apply");
    let rows = table
        .stdout
        .split_once('\n')
        .map(|(_, rows)| rows)
        .expect("a heading line, then the table");
    assert_columns_line_up(rows);
    assert_eq!(lab.snapshot(), before, "a dry run wrote to the store");

    // --apply: dead-node released, new-node marked, the others untouched.
    let report = lab
        .ctl(&["-o", "json", "gc", "--dead-nodes", "--apply"])
        .ok()
        .json();
    assert_eq!(report["applied"], true);
    let dead = node(&report, "dead-node");
    assert_eq!(dead["action"], "reclaimed");
    assert_eq!(
        dead["released"]["released_addresses"]
            .as_array()
            .map(Vec::len),
        Some(3)
    );
    assert_eq!(node(&report, "new-node")["action"], "marked-missing");
    assert_eq!(node(&report, "alive-node")["action"], "none");
    assert_eq!(addresses_of(&lab, "dead-node"), 0);
    assert_eq!(addresses_of(&lab, "alive-node"), 2);
    assert_eq!(addresses_of(&lab, "plugin-only"), 2);
    lab.ctl(&["check"]).ok();

    // Marked now, so dead only after its own grace: with a grace of one day it waits.
    let report = lab
        .ctl(&[
            "-o",
            "json",
            "gc",
            "--dead-nodes",
            "--grace-seconds",
            "86400",
        ])
        .ok()
        .json();
    assert_eq!(node(&report, "new-node")["state"], "missing");
    assert!(node(&report, "new-node")["missing_since"].as_u64() >= Some(now));
    assert_eq!(report["nodes"].as_array().map(Vec::len), Some(2));
}

#[test]
fn gc_dead_nodes_on_an_embedded_store_says_registrations_are_etcd_only() {
    let lab = Lab::new(Backend::Sled);
    lab.ctl(&["pool", "add", "10.61.0.0/16"]).ok();
    lab.assign("net.a", "host-a");
    lab.ctl(&["gc", "--dead-nodes", "--apply"])
        .ok()
        .stdout_has("No node is registered")
        .stdout_has("etcd only");
    assert_eq!(addresses_of(&lab, "host-a"), 1);
    lab.ctl(&["gc"]).expect_code(2);
}
