//! `gc --dead-nodes [--grace-seconds N] [--apply]` on etcd (where agents register their nodes and
//! keep liveness keys on leases), and what it says on an embedded store.

use std::time::Duration;

use test_kit::unix_now;

use backend_etcd::lease::LeaseSession;
use backend_etcd::EtcdConfig;
use ipam_core::dead_nodes::{
    activity_key, agent_key, countdown_key, liveness_key, register, Registration,
};
use ipam_core::KvStore;
use serde_json::Value;

use crate::common::{assert_columns_line_up, marked_registration, table_row, Backend, Lab};

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

/// Marks `host`'s registration missing long ago (by `now`), its countdown gone: dead.
async fn mark_dead(store: &dyn KvStore, host: &str, now: u64) {
    let dead = marked_registration(host, now - 5000);
    store
        .put(&agent_key(host), serde_json::to_vec(&dead).expect("JSON"))
        .await
        .expect("mark the node, its countdown gone");
}

/// A node whose agent is down while its plugin commits (marked, its activity record moved since)
/// is active: the dry run says it would be marked again and writes nothing; `--apply` marks it
/// again, with a new countdown and the activity record's current revision, and releases nothing.
/// The next look finds it missing with its countdown running, not unmarked.
#[test]
fn gc_dead_nodes_marks_an_active_node_again_from_its_plugins_activity() {
    let lab = Lab::new(Backend::Etcd);
    lab.ctl(&["pool", "add", "10.62.0.0/24"]).ok();
    lab.assign("net.busy0", "busy-node");
    let now = unix_now();
    let activity = lab.with_store(|store| async move {
        store
            .put(
                &agent_key("busy-node"),
                serde_json::to_vec(&marked_registration("busy-node", now - 5000)).expect("JSON"),
            )
            .await
            .expect("mark the node");
        store
            .put(&activity_key("busy-node"), b"{}".to_vec())
            .await
            .expect("its plugin at work since the mark")
    });
    let before = lab.snapshot();
    let report = lab.ctl(&["-o", "json", "gc", "--dead-nodes"]).ok().json();
    assert_eq!(node(&report, "busy-node")["state"], "active");
    lab.ctl(&["gc", "--dead-nodes"])
        .ok()
        .stdout_has("would mark again from its plugin's activity (--apply)");
    assert_eq!(lab.snapshot(), before, "a dry run wrote to the store");

    let report = lab
        .ctl(&["-o", "json", "gc", "--dead-nodes", "--apply"])
        .ok()
        .json();
    assert_eq!(node(&report, "busy-node")["state"], "active");
    assert_eq!(node(&report, "busy-node")["action"], "marked-again");
    let (mark, countdown) = lab.with_store(|store| async move {
        let registration: Registration = serde_json::from_slice(
            &store
                .get(&agent_key("busy-node"))
                .await
                .expect("read")
                .expect("registered")
                .value,
        )
        .expect("a registration");
        let countdown = store
            .get(&countdown_key("busy-node"))
            .await
            .expect("read the countdown");
        (registration.missing_mark, countdown)
    });
    let mark = mark.expect("marked again");
    assert_eq!(mark.activity_revision, activity.0);
    assert_eq!(
        Some(mark.countdown_revision),
        countdown.map(|c| c.revision.0),
        "the mark names the new countdown"
    );
    assert_eq!(addresses_of(&lab, "busy-node"), 1);
    let report = lab.ctl(&["-o", "json", "gc", "--dead-nodes"]).ok().json();
    assert_eq!(node(&report, "busy-node")["state"], "missing");
    assert_eq!(node(&report, "busy-node")["countdown_running"], true);
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
    // dead-node: registered, marked, its countdown run out (the key is gone) and no plugin
    // activity since; new-node: registered, its key just gone; old-mark: marked by an earlier
    // agent version's wall clock long ago, which is never acted on.
    let now = unix_now();
    lab.with_store(|store| async move {
        for host in ["alive-node", "dead-node", "new-node", "old-mark"] {
            register(store.as_ref(), host, "test", now)
                .await
                .expect("register");
        }
        mark_dead(store.as_ref(), "dead-node", now).await;
        let old = Registration {
            node: "old-mark".into(),
            registered_at: now - 5000,
            agent_version: "0.0.9".into(),
            reads_format: None,
            missing_since: Some(now - 2000),
            missing_mark: None,
            blocks_released: false,
        };
        store
            .put(
                &agent_key("old-mark"),
                serde_json::to_vec(&old).expect("JSON"),
            )
            .await
            .expect("an earlier version's wall-clock mark");
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
    assert_eq!(node(&report, "new-node")["missing_mark"], Value::Null);
    assert_eq!(node(&report, "new-node")["countdown_running"], false);
    assert_eq!(node(&report, "old-mark")["state"], "missing");
    let dead = node(&report, "dead-node");
    assert_eq!(dead["state"], "dead");
    assert_eq!(dead["missing_mark"]["grace_seconds"], 900);
    assert_eq!(dead["would_release"]["blocks"], 1);
    assert_eq!(dead["would_release"]["addresses"], 3);
    assert_eq!(report["nodes"].as_array().map(Vec::len), Some(4));
    let table = lab.ctl(&["gc", "--dead-nodes"]);
    table
        .ok()
        .stdout_has("4 nodes registered (grace period 900s), nothing changed")
        .stdout_has("would release its blocks (--apply); addresses kept")
        .stdout_has("missing (no countdown yet)")
        .stdout_has("dead (countdown of 900s ran out)")
        .stdout_has("--apply");
    let rows = table
        .stdout
        .split_once('\n')
        .map(|(_, rows)| rows)
        .expect("a heading line, then the table");
    assert_columns_line_up(rows);
    assert_eq!(lab.snapshot(), before, "a dry run wrote to the store");

    // --apply: dead-node's block released (it keeps its addresses: silence is no evidence its
    // pods are gone), new-node marked, the others untouched.
    let report = lab
        .ctl(&["-o", "json", "gc", "--dead-nodes", "--apply"])
        .ok()
        .json();
    assert_eq!(report["applied"], true);
    let dead = node(&report, "dead-node");
    assert_eq!(dead["action"], "reclaimed");
    assert_eq!(
        dead["released"]["released_addresses"],
        serde_json::json!([])
    );
    assert_eq!(
        dead["released"]["unassigned_blocks"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    assert_eq!(node(&report, "new-node")["action"], "marked-missing");
    assert_eq!(node(&report, "old-mark")["action"], "marked-missing");
    assert_eq!(node(&report, "alive-node")["action"], "none");
    // The countdown is an etcd key on a lease: it exists now, and etcd alone will delete it.
    let countdown = lab.with_store(|store| async move {
        store
            .get(&countdown_key("new-node"))
            .await
            .expect("read the countdown")
    });
    assert!(countdown.is_some(), "no countdown was started for new-node");
    assert_eq!(addresses_of(&lab, "dead-node"), 3);
    assert_eq!(addresses_of(&lab, "alive-node"), 2);
    assert_eq!(addresses_of(&lab, "plugin-only"), 2);
    lab.ctl(&["check"]).ok();

    // Marked now, so dead only once its countdown has run out, whatever the clock says.
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
    assert_eq!(node(&report, "new-node")["countdown_running"], true);
    assert_eq!(
        node(&report, "new-node")["missing_mark"]["grace_seconds"],
        900
    );
    assert_eq!(node(&report, "old-mark")["state"], "missing");
    let reclaimed = node(&report, "dead-node");
    assert_eq!(reclaimed["state"], "reclaimed");
    assert_eq!(reclaimed["blocks_released"], true);
    assert_eq!(reclaimed["countdown_running"], false);
    assert_eq!(reclaimed["would_release"]["blocks"], 0);
    assert_eq!(reclaimed["would_release"]["addresses"], 3);
    assert_eq!(report["nodes"].as_array().map(Vec::len), Some(4));
    lab.ctl(&["gc", "--dead-nodes"])
        .ok()
        .stdout_has("reclaimed (blocks released, addresses kept)")
        .stdout_has("node release <node> --addresses");

    // The operator knows its pods are gone: the addresses go, and so does the registration.
    let released = lab
        .ctl(&["-o", "json", "node", "release", "dead-node", "--addresses"])
        .ok()
        .json();
    assert_eq!(
        released["released_addresses"].as_array().map(Vec::len),
        Some(3)
    );
    assert_eq!(released["registration_deleted"], true);
    assert_eq!(addresses_of(&lab, "dead-node"), 0);
    let report = lab.ctl(&["-o", "json", "gc", "--dead-nodes"]).ok().json();
    assert_eq!(report["nodes"].as_array().map(Vec::len), Some(3));
    // A live node's registration stays, whatever is released by hand.
    let released = lab
        .ctl(&["-o", "json", "node", "release", "alive-node", "--addresses"])
        .ok()
        .json();
    assert_eq!(released["registration_deleted"], false);
    let report = lab.ctl(&["-o", "json", "gc", "--dead-nodes"]).ok().json();
    assert_eq!(node(&report, "alive-node")["state"], "alive");
    lab.ctl(&["check"]).ok();
}

/// The table an operator reads: with `--apply`, what each node got (a reclaimed node's released
/// block count and the command that releases its addresses later) and no advice to run with
/// `--apply`; without it, which node would be marked, which waits for its countdown, and the advice.
#[test]
fn gc_dead_nodes_table_says_what_each_node_got_and_what_comes_next() {
    let lab = Lab::new(Backend::Etcd);
    lab.ctl(&["pool", "add", "10.64.0.0/16"]).ok();
    for i in 0..2 {
        lab.assign(&format!("net.dead{i}"), "dead-node");
    }
    let now = unix_now();
    lab.with_store(|store| async move {
        for host in ["dead-node", "new-node"] {
            register(store.as_ref(), host, "test", now)
                .await
                .expect("register");
        }
        mark_dead(store.as_ref(), "dead-node", now).await;
    });

    let applied = lab.ctl(&["gc", "--dead-nodes", "--apply"]);
    applied
        .ok()
        .stdout_has("2 nodes registered (grace period 900s):\n");
    assert_eq!(
        table_row(&applied.stdout, "dead-node"),
        [
            "dead-node",
            "dead (countdown of 900s ran out)",
            "1",
            "0",
            "reclaimed: addresses kept: once its pods are gone, `node release dead-node --addresses`",
        ],
        "{}",
        applied.stdout
    );
    assert_eq!(
        table_row(&applied.stdout, "new-node"),
        [
            "new-node",
            "missing (no countdown yet)",
            "-",
            "-",
            "marked-missing"
        ]
    );
    assert!(
        !applied.stdout.contains("Run again"),
        "an applied run advises running with --apply:\n{}",
        applied.stdout
    );
    assert_eq!(addresses_of(&lab, "dead-node"), 2);

    // A node registered since: it would be marked; new-node's countdown runs; dead-node keeps
    // its addresses until the operator releases them.
    lab.with_store(|store| async move {
        register(store.as_ref(), "late-node", "test", now)
            .await
            .expect("register");
    });
    let dry = lab.ctl(&["gc", "--dead-nodes"]);
    dry.ok()
        .stdout_has("3 nodes registered (grace period 900s), nothing changed:\n")
        .stdout_has(
            "\nRun again with --apply to mark missing nodes and release dead ones' blocks.\n",
        );
    assert_eq!(
        table_row(&dry.stdout, "late-node"),
        [
            "late-node",
            "missing (no countdown yet)",
            "0",
            "0",
            "would mark missing (--apply)"
        ]
    );
    assert_eq!(
        table_row(&dry.stdout, "new-node"),
        [
            "new-node",
            "missing (countdown of 900s runs)",
            "0",
            "0",
            "wait"
        ]
    );
    assert_eq!(
        table_row(&dry.stdout, "dead-node"),
        [
            "dead-node",
            "reclaimed (blocks released, addresses kept)",
            "0",
            "2",
            "addresses kept: once its pods are gone, `node release <node> --addresses`"
        ]
    );
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

/// A grace etcd cannot time (a countdown is an etcd lease, at most 9,000,000,000 s) or a zero one
/// is refused as the command line is read: status 2, nothing read or written.
#[test]
fn gc_dead_nodes_refuses_a_grace_etcd_cannot_time() {
    let lab = Lab::new(Backend::Sled);
    lab.ctl(&["pool", "add", "10.63.0.0/16"]).ok();
    let before = lab.snapshot();
    for grace in ["0", "9000000001"] {
        let refused = lab.ctl(&["gc", "--dead-nodes", "--apply", "--grace-seconds", grace]);
        refused.expect_code(2);
        let line = refused.error_line();
        assert!(
            line.contains("--grace-seconds") && line.contains("1..=9000000000"),
            "{grace}: {line}"
        );
    }
    assert_eq!(lab.snapshot(), before, "a refused gc changed the store");
    lab.ctl(&["gc", "--dead-nodes", "--grace-seconds", "9000000000"])
        .ok()
        .stdout_has("No node is registered");
}

#[test]
fn gc_dead_nodes_reports_an_unreadable_registration_and_still_judges_the_others() {
    let lab = Lab::new(Backend::Etcd);
    lab.ctl(&["pool", "add", "10.62.0.0/16"]).ok();
    lab.assign("net.bad0", "bad-node");
    let now = unix_now();
    lab.with_store(|store| async move {
        register(store.as_ref(), "new-node", "test", now)
            .await
            .expect("register");
        store
            .put(&agent_key("bad-node"), b"\x00damaged".to_vec())
            .await
            .expect("a damaged registration");
    });
    let before = lab.snapshot();

    // Dry run: listed as unreadable with the reason, exit status 1, nothing written.
    let dry = lab.ctl(&["-o", "json", "gc", "--dead-nodes"]);
    dry.expect_code(1);
    let report = dry.json();
    let bad = node(&report, "bad-node");
    assert_eq!(bad["state"], "unreadable");
    assert!(
        bad["detail"]
            .as_str()
            .is_some_and(|d| d.contains("ipam/v1/agents/bad-node")),
        "{bad:#}"
    );
    assert_eq!(node(&report, "new-node")["state"], "missing");
    lab.ctl(&["gc", "--dead-nodes"])
        .expect_code(1)
        .stdout_has("unreadable registration");
    assert_eq!(lab.snapshot(), before, "a dry run wrote to the store");

    // --apply: the other node is still marked; the unreadable one is reported, left alone.
    let applied = lab.ctl(&["-o", "json", "gc", "--dead-nodes", "--apply"]);
    applied.expect_code(1);
    let report = applied.json();
    assert_eq!(node(&report, "new-node")["action"], "marked-missing");
    assert_eq!(node(&report, "bad-node")["action"], "failed");
    assert_eq!(addresses_of(&lab, "bad-node"), 1);
}
