//! `gc --leaks [--report PATH] [--apply]` through the real binary, on reports written as an agent writes them: the look (`Ipam::look_for_leaks`, the agent's own code) over a real store whose allocations the real plugin made.

use std::net::IpAddr;
use std::path::Path;
use test_kit::unix_now;

use ipam_core::allocator::leaks::{
    LeakPolicy, LeakReport, LeakWatch, LiveSandbox, RuntimeView, LEAK_REPORT_VERSION,
};
use ipam_core::AssignIpsRequest;
use serde_json::{json, Value};

use crate::common::{Backend, Lab};

crate::on_every_backend!(
    gc_leaks_shows_what_the_look_found_and_releases_only_what_is_due_with_apply,
    gc_leaks_refuses_to_apply_a_stale_an_unanswered_or_an_unproven_look,
    gc_leaks_names_the_blocks_the_look_could_not_decode_and_releases_what_is_due,
);

const GRACE: u64 = 900;
const SCAN: u64 = 60;

/// One look by the agent of node-a at `at`, the runtime running `live` (container ids with the
/// addresses it reports for them).
fn look(lab: &Lab, watch: &mut LeakWatch, at: u64, live: &[(&str, Vec<IpAddr>)]) -> LeakReport {
    let view = RuntimeView {
        observed_at: at,
        sandboxes: live
            .iter()
            .map(|(id, addresses)| {
                (
                    (*id).to_owned(),
                    LiveSandbox {
                        pod: (*id).to_owned(),
                        namespace: "default".into(),
                        uid: format!("uid-{id}"),
                        addresses: addresses.clone(),
                    },
                )
            })
            .collect(),
    };
    let policy = LeakPolicy {
        grace_seconds: GRACE,
        max_gap_seconds: 2 * GRACE,
    };
    let mut taken = std::mem::take(watch);
    let decisions = lab.with_ipam(|ipam| async move {
        let decisions = ipam
            .look_for_leaks("node-a", &view, &mut taken, policy)
            .await
            .expect("look");
        (decisions, taken)
    });
    *watch = decisions.1;
    LeakReport {
        version: LEAK_REPORT_VERSION,
        node: "node-a".into(),
        runtime: "/run/containerd/containerd.sock".into(),
        observed_at: at,
        grace_seconds: GRACE,
        scan_seconds: SCAN,
        runtime_error: None,
        decisions: Some(decisions.0),
    }
}

/// Two look times: 10 s from now (after the plugin's stamps) and a grace and 30 s after that.
fn looks_a_grace_apart() -> (u64, u64) {
    let first = unix_now() + 10;
    (first, first + GRACE + 30)
}

fn write(path: &Path, report: &LeakReport) {
    std::fs::write(path, serde_json::to_vec_pretty(report).expect("JSON")).expect("write");
}

fn holder(lab: &Lab, address: IpAddr) -> Value {
    lab.ctl(&["-o", "json", "show", "--ip", &address.to_string()])
        .ok()
        .json()["handle"]
        .clone()
}

fn gc_leaks_shows_what_the_look_found_and_releases_only_what_is_due_with_apply(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.66.0.0/24", "--block-size", "28"])
        .ok();
    let live = lab.added("node-a", "running");
    let gone = lab.added("node-a", "vanished");
    let elsewhere = lab.added("node-b", "vanished-elsewhere");
    let report_path = lab.dir.path().join("leaks.json");
    let report_arg = report_path.display().to_string();
    // The plugin stamped each allocation now: the looks are placed after it, the first that
    // found "vanished" missing 10 s from now, the last a grace and a bit later.
    let (first, last) = looks_a_grace_apart();
    let mut watch = LeakWatch::new();
    look(&lab, &mut watch, first, &[("running", vec![live])]);
    let report = look(&lab, &mut watch, last, &[("running", vec![live])]);
    write(&report_path, &report);

    let before = lab.snapshot();
    let shown = lab.ctl(&["gc", "--leaks", "--report", &report_arg]);
    shown
        .ok()
        .stdout_has(&gone.to_string())
        .stdout_has("default/vanished")
        .stdout_has("due: released at the next look, or by --apply")
        .stdout_has("Run again with --apply to release the ones past their grace.");
    assert!(
        !shown.stdout.contains("is it the runtime the kubelet uses"),
        "a runtime that runs one of the node's pods is not doubted:\n{}",
        shown.stdout
    );
    assert!(
        !shown.stdout.contains(&elsewhere.to_string()),
        "another node's allocation is not this node's leak:\n{}",
        shown.stdout
    );
    assert_eq!(lab.snapshot(), before, "without --apply nothing is written");
    let as_json = lab
        .ctl(&["-o", "json", "gc", "--leaks", "--report", &report_arg])
        .ok()
        .json();
    assert_eq!(as_json["applied"], false);
    assert_eq!(
        as_json["report"]["decisions"]["leaked"][0]["allocation"]["ip"],
        gone.to_string()
    );

    let applied = lab
        .ctl(&[
            "-o",
            "json",
            "gc",
            "--leaks",
            "--report",
            &report_arg,
            "--apply",
        ])
        .ok()
        .json();
    assert_eq!(applied["release"]["released"], json!([gone.to_string()]));
    assert_eq!(holder(&lab, gone), Value::Null);
    assert_ne!(holder(&lab, live), Value::Null, "a running pod's address");
    assert_ne!(
        holder(&lab, elsewhere),
        Value::Null,
        "another node's address"
    );

    // The same report again: the address is free now, left alone.
    let again = lab
        .ctl(&[
            "-o",
            "json",
            "gc",
            "--leaks",
            "--report",
            &report_arg,
            "--apply",
        ])
        .ok()
        .json();
    assert_eq!(again["release"]["released"], json!([]));
    assert_eq!(again["release"]["skipped"], json!([gone.to_string()]));

    // Taken again by a new pod since the look: the guard keeps it with its new owner.
    lab.with_ipam(|ipam| async move {
        ipam.assign_ips(&AssignIpsRequest {
            ips: vec![gone],
            handle: "net.newcomer".into(),
            host: "node-a".into(),
            ..Default::default()
        })
        .await
        .expect("the address taken again")
    });
    let guarded = lab
        .ctl(&[
            "-o",
            "json",
            "gc",
            "--leaks",
            "--report",
            &report_arg,
            "--apply",
        ])
        .ok()
        .json();
    assert_eq!(guarded["release"]["released"], json!([]));
    assert_ne!(holder(&lab, gone), Value::Null, "the new owner keeps it");
    lab.ctl(&["check"]).ok();
}

fn gc_leaks_refuses_to_apply_a_stale_an_unanswered_or_an_unproven_look(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.67.0.0/24", "--block-size", "28"])
        .ok();
    let live = lab.added("node-a", "running");
    let gone = lab.added("node-a", "vanished");
    let report_path = lab.dir.path().join("leaks.json");
    let report_arg = report_path.display().to_string();
    let before = lab.snapshot();

    // A look that found a leak due, made long ago: the agent is not looking any more.
    let (first, last) = looks_a_grace_apart();
    let mut watch = LeakWatch::new();
    look(&lab, &mut watch, first, &[("running", vec![live])]);
    let due = look(&lab, &mut watch, last, &[("running", vec![live])]);
    assert_eq!(due.decisions.as_ref().map(|d| d.leaked.len()), Some(1));
    let stale = LeakReport {
        observed_at: unix_now() - 10 * SCAN,
        ..due
    };
    write(&report_path, &stale);
    let refused = lab.ctl(&["gc", "--leaks", "--report", &report_arg, "--apply"]);
    refused.expect_code(1);
    assert!(
        refused.error_line().contains("is it running"),
        "{}",
        refused.error_line()
    );

    // A runtime that runs none of this node's pods: nothing is due, and --apply is refused. Its
    // first look finds both allocations missing, within their grace; the next, past it, holds them.
    let doubt = "is it the runtime the kubelet uses?";
    let held = "held: the runtime runs none of this node's pods";
    let mut watch = LeakWatch::new();
    let early = look(&lab, &mut watch, first, &[("not-ours", vec![])]);
    write(&report_path, &early);
    let waiting = lab.ctl(&["gc", "--leaks", "--report", &report_arg]);
    waiting
        .ok()
        .stdout_has("2 allocations whose container the runtime does not run")
        .stdout_has("waiting for its grace")
        .stdout_has(doubt);
    assert!(!waiting.stdout.contains(held), "{}", waiting.stdout);
    let unproven = look(&lab, &mut watch, last, &[("not-ours", vec![])]);
    write(&report_path, &unproven);
    let holding = lab.ctl(&["gc", "--leaks", "--report", &report_arg]);
    holding.ok().stdout_has(held).stdout_has(doubt);
    assert!(
        !holding.stdout.contains("waiting for its grace") && !holding.stdout.contains("Run again"),
        "nothing is due while the runtime is unproven:\n{}",
        holding.stdout
    );
    let refused = lab.ctl(&["gc", "--leaks", "--report", &report_arg, "--apply"]);
    refused.expect_code(1);
    assert!(
        refused.error_line().contains("none of this node's pods"),
        "{}",
        refused.error_line()
    );

    // A look the runtime did not answer.
    let unanswered = LeakReport {
        runtime_error: Some("cannot connect to the container runtime".into()),
        decisions: None,
        ..unproven
    };
    write(&report_path, &unanswered);
    lab.ctl(&["gc", "--leaks", "--report", &report_arg])
        .expect_code(1)
        .stdout_has("could not be asked");
    lab.ctl(&["gc", "--leaks", "--report", &report_arg, "--apply"])
        .expect_code(1);

    // Not a report, a report of another version, no report.
    std::fs::write(&report_path, b"{\"version\": 1, \"node\":").expect("write");
    let garbled = lab.ctl(&["gc", "--leaks", "--report", &report_arg]);
    garbled.expect_code(1);
    assert!(
        garbled.error_line().contains("not a leak report"),
        "{}",
        garbled.error_line()
    );
    let mut future = serde_json::to_value(&unanswered).expect("JSON");
    future["version"] = json!(LEAK_REPORT_VERSION + 1);
    std::fs::write(&report_path, future.to_string()).expect("write");
    let newer = lab.ctl(&["gc", "--leaks", "--report", &report_arg]);
    newer.expect_code(1);
    assert!(
        newer.error_line().contains("version"),
        "{}",
        newer.error_line()
    );
    std::fs::remove_file(&report_path).expect("remove");
    let missing = lab.ctl(&["gc", "--leaks", "--report", &report_arg]);
    missing.expect_code(1);
    assert!(
        missing.error_line().contains(&report_arg),
        "{}",
        missing.error_line()
    );
    lab.ctl(&["gc", "--leaks", "--dead-nodes"]).expect_code(2);

    assert_eq!(lab.snapshot(), before, "nothing refused wrote anything");
    assert_ne!(holder(&lab, gone), Value::Null);
}

/// A damaged block of another node does not stop the agent's look that reads it: the report names
/// it (exit 1, as for any problem found), and `--apply` still releases this node's leaks that are
/// due.
fn gc_leaks_names_the_blocks_the_look_could_not_decode_and_releases_what_is_due(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.68.0.0/24", "--block-size", "28"])
        .ok();
    let live = lab.added("node-a", "running");
    let gone = lab.added("node-a", "vanished");
    let elsewhere = lab.added("node-b", "vanished-elsewhere");
    let damaged_key = lab.damage_a_block_of("node-b", 1);
    let report_path = lab.dir.path().join("leaks.json");
    let report_arg = report_path.display().to_string();
    let (first, last) = looks_a_grace_apart();
    // A sandbox of node-a that reports node-b's address makes every look read the whole store
    // (the address lies outside node-a's blocks), the damaged block with it.
    let running = [("running", vec![live]), ("stray", vec![elsewhere])];
    let mut watch = LeakWatch::new();
    look(&lab, &mut watch, first, &running);
    let report = look(&lab, &mut watch, last, &running);
    write(&report_path, &report);

    let shown = lab.ctl(&["gc", "--leaks", "--report", &report_arg]);
    shown
        .expect_code(1)
        .stdout_has(&gone.to_string())
        .stdout_has(&damaged_key)
        .stdout_has("no address they cover is judged")
        .stdout_has("blockipamctl check");
    assert!(
        !shown.stdout.contains("DUPLICATE") && !shown.stdout.contains(&elsewhere.to_string()),
        "who holds an address in the damaged block is unknown:\n{}",
        shown.stdout
    );
    let applied = lab
        .ctl(&[
            "-o",
            "json",
            "gc",
            "--leaks",
            "--report",
            &report_arg,
            "--apply",
        ])
        .expect_code(1)
        .json();
    assert_eq!(
        applied["report"]["decisions"]["undecodable"][0]["key"],
        damaged_key
    );
    assert_eq!(applied["release"]["released"], json!([gone.to_string()]));
    assert_eq!(holder(&lab, gone), Value::Null);
    assert_ne!(holder(&lab, live), Value::Null, "a running pod's address");
}
