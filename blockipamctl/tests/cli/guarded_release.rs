//! Releases guarded by sequence numbers: `release --ip A --sequence N`, and `check -o json` as a
//! report that `release --from-report` acts on, on every backend.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use ipam_core::check::kinds;
use ipam_core::model::{encode, keys, Handle};
use ipam_core::AssignIpsRequest;
use serde_json::Value;

use crate::common::{Backend, Lab};

crate::on_every_backend!(
    release_with_a_sequence_frees_only_the_allocation_that_carries_it,
    a_leak_reported_by_check_is_released_from_the_report,
    an_address_allocated_again_after_the_report_is_not_released,
    a_leak_whose_handle_exists_again_is_left_to_its_del,
    a_malformed_or_foreign_report_is_refused_and_changes_nothing,
);

/// The sequence number `show --ip` prints for `ip`.
fn sequence_of(lab: &Lab, ip: &str) -> u64 {
    let shown = lab.ctl(&["-o", "json", "show", "--ip", ip]).ok().json();
    shown["sequence"]
        .as_u64()
        .expect("an allocated address has a sequence")
}

/// Gives `ip` to `handle` on `host` (the address must be free).
fn assign_exactly(lab: &Lab, ip: IpAddr, handle: &str, host: &str) {
    let (handle, host) = (handle.to_owned(), host.to_owned());
    lab.with_ipam(|ipam| async move {
        ipam.assign_ips(&AssignIpsRequest {
            ips: vec![ip],
            handle,
            host,
            attributes: BTreeMap::new(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("assign the address again");
    });
}

/// Deletes `handle`'s object, leaving its addresses in their blocks: what `check` reports as
/// missing-handle (no DEL can free them any more).
fn lose_handle(lab: &Lab, handle: &str) {
    let key = keys::handle(handle);
    lab.with_store(|store| async move { store.delete(&key).await.expect("delete the handle") });
}

/// `check -o json` (exit status 1: it finds the leak) saved to a file in the lab directory.
fn write_report(lab: &Lab, name: &str) -> (PathBuf, Value) {
    let run = lab.ctl(&["-o", "json", "check"]);
    run.expect_code(1);
    let path = lab.dir.path().join(name);
    std::fs::write(&path, &run.stdout).expect("write the report");
    (path, run.json())
}

fn release_with_a_sequence_frees_only_the_allocation_that_carries_it(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.50.0.0/24"]).ok();
    let ip = lab.assign("net.a", "host-a");
    let a = ip.to_string();
    let first = sequence_of(&lab, &a);

    // Released and given to another owner: the old sequence no longer names the allocation.
    lab.ctl(&["release", "--ip", &a]).ok();
    assign_exactly(&lab, ip, "net.b", "host-a");
    let second = sequence_of(&lab, &a);
    assert_ne!(
        first, second,
        "a new allocation carries a new sequence number"
    );

    let before = lab.snapshot();
    let refused = lab.ctl(&["release", "--ip", &a, "--sequence", &first.to_string()]);
    refused.expect_code(1);
    let line = refused.error_line();
    assert!(
        line.contains(&format!("carries sequence {second} now"))
            && line.contains("\"net.b\"")
            && line.contains("nothing changed"),
        "{line}"
    );
    assert_eq!(lab.snapshot(), before, "a refused release writes nothing");
    let shown = lab.ctl(&["-o", "json", "show", "--ip", &a]).ok().json();
    assert_eq!(shown["handle"], "net.b", "the new owner keeps the address");

    // A repeated address counts once, guarded or not.
    let released = lab.ctl(&[
        "-o",
        "json",
        "release",
        "--ip",
        &a,
        &a,
        "--sequence",
        &second.to_string(),
    ]);
    assert_eq!(
        released.ok().json(),
        serde_json::json!({"ip": a, "sequence": second, "released": true})
    );
    assert_eq!(
        lab.ctl(&["-o", "json", "show", "--ip", &a]).ok().json()["allocated"],
        false
    );

    let free = lab.ctl(&["release", "--ip", &a, "--sequence", &second.to_string()]);
    free.expect_code(1);
    assert!(
        free.error_line().contains("not allocated"),
        "{}",
        free.stderr
    );
    let two = lab.ctl(&["release", "--ip", &a, "10.50.0.9", "--sequence", "1"]);
    two.expect_code(2);
    assert!(
        two.error_line().contains("exactly one --ip"),
        "{}",
        two.stderr
    );
    lab.ctl(&["release", "--handle", "net.b", "--sequence", "1"])
        .expect_code(2);
    lab.ctl(&["check"]).ok();
}

fn a_leak_reported_by_check_is_released_from_the_report(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.51.0.0/24"]).ok();
    let kept = lab.assign("net.kept", "host-a").to_string();
    let leaked_ip = lab.assign("net.leaked", "host-a");
    let leaked = leaked_ip.to_string();
    let block = ipnet::IpNet::new(leaked_ip, 26)
        .expect("net")
        .trunc()
        .to_string();
    let sequence = sequence_of(&lab, &leaked);
    lose_handle(&lab, "net.leaked");

    let (path, report) = write_report(&lab, "report.json");
    assert_eq!(report["report"], "blockipam-check-report");
    assert_eq!(report["version"], 1);
    assert_eq!(report["store"]["datastore_type"], lab.type_name());
    let problem = report["problems"]
        .as_array()
        .expect("problems")
        .iter()
        .find(|p| p["kind"] == kinds::MISSING_HANDLE)
        .expect("the leak is reported")
        .clone();
    assert_eq!(problem["handle"], "net.leaked");
    assert_eq!(
        problem["addresses"],
        serde_json::json!([{
            "ip": leaked,
            "block": block,
            "handle": "net.leaked",
            "node": "host-a",
            "sequence": sequence,
        }])
    );

    let before = lab.snapshot();
    let path = path.display().to_string();
    let preview = lab
        .ctl(&["-o", "json", "release", "--from-report", &path])
        .ok()
        .json();
    assert_eq!(preview["applied"], false);
    assert_eq!(preview["released"][0]["ip"], leaked.as_str());
    assert_eq!(lab.snapshot(), before, "a preview writes nothing");
    lab.ctl(&["release", "--from-report", &path])
        .ok()
        .stdout_has("Would release 1 leaked address")
        .stdout_has("--apply");

    // A --sequence beside the report is a usage error, not a guard dropped in silence; --apply
    // without a report is one too. Neither writes anything.
    for (args, says) in [
        (
            vec![
                "release",
                "--from-report",
                &path,
                "--apply",
                "--sequence",
                "999",
            ],
            "--sequence guards one --ip",
        ),
        (
            vec!["release", "--handle", "net.kept", "--apply"],
            "--apply goes with --from-report only",
        ),
        (
            vec!["release", "--ip", &kept, "--apply"],
            "--apply goes with --from-report only",
        ),
    ] {
        let run = lab.ctl(&args);
        run.expect_code(2);
        assert!(run.error_line().contains(says), "{args:?}: {}", run.stderr);
        assert_eq!(lab.snapshot(), before, "{args:?} wrote something");
    }

    let applied = lab.ctl(&["release", "--from-report", &path, "--apply"]);
    applied
        .ok()
        .stdout_has("Released 1 leaked address")
        .stdout_has(&leaked);
    assert!(
        !applied.stdout.contains("Nothing was changed"),
        "an applied release changed something: {}",
        applied.stdout
    );
    assert_eq!(
        lab.ctl(&["-o", "json", "show", "--ip", &leaked])
            .ok()
            .json()["allocated"],
        false
    );
    assert_eq!(
        lab.ctl(&["-o", "json", "show", "--ip", &kept]).ok().json()["handle"],
        "net.kept",
        "an address the report does not list stays"
    );
    lab.ctl(&["check"]).ok().stdout_has("no problems");

    // The same report again: the address is no longer allocated, nothing is done.
    let again = lab
        .ctl(&["-o", "json", "release", "--from-report", &path, "--apply"])
        .ok()
        .json();
    assert_eq!(again["released"], serde_json::json!([]));
    assert_eq!(again["skipped"][0]["reason"], "no longer allocated");
}

fn an_address_allocated_again_after_the_report_is_not_released(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.52.0.0/24"]).ok();
    let ip = lab.assign("net.old", "host-a");
    let a = ip.to_string();
    let reported = sequence_of(&lab, &a);
    lose_handle(&lab, "net.old");
    let (path, _) = write_report(&lab, "report.json");

    // After the report: the address is freed, handed to a new pod, and that pod's handle is lost
    // too. It looks leaked again, but it is another allocation.
    lab.ctl(&["release", "--ip", &a]).ok();
    assign_exactly(&lab, ip, "net.new", "host-b");
    let now = sequence_of(&lab, &a);
    assert_ne!(now, reported);
    lose_handle(&lab, "net.new");

    let before = lab.snapshot();
    let path = path.display().to_string();
    let run = lab.ctl(&["-o", "json", "release", "--from-report", &path, "--apply"]);
    let outcome = run.ok().json();
    assert_eq!(outcome["released"], serde_json::json!([]), "{outcome}");
    let skipped = &outcome["skipped"][0];
    assert_eq!(skipped["ip"], a.as_str());
    assert_eq!(skipped["sequence"], reported);
    assert!(
        skipped["reason"]
            .as_str()
            .is_some_and(|r| r.contains("allocated again since the report")),
        "{skipped}"
    );
    assert_eq!(lab.snapshot(), before, "nothing was released");
    let shown = lab.ctl(&["-o", "json", "show", "--ip", &a]).ok().json();
    assert_eq!(shown["allocated"], true);
    assert_eq!(shown["sequence"], now);
    lab.ctl(&["release", "--from-report", &path, "--apply"])
        .ok()
        .stdout_has("Released nothing")
        .stdout_has("allocated again since the report");
}

fn a_malformed_or_foreign_report_is_refused_and_changes_nothing(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.53.0.0/24"]).ok();
    lab.assign("net.leaked", "host-a");
    lose_handle(&lab, "net.leaked");
    let (path, report) = write_report(&lab, "report.json");
    let before = lab.snapshot();
    let write = |name: &str, text: &str| {
        let path = lab.dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path.display().to_string()
    };

    let garbage = write(
        "garbage.json",
        "{\"report\": \"blockipam-check-report\", \"vers",
    );
    let run = lab.ctl(&["release", "--from-report", &garbage, "--apply"]);
    run.expect_code(2);
    assert!(
        run.error_line().contains("not a check report"),
        "{}",
        run.stderr
    );

    let mut other_version = report.clone();
    other_version["version"] = Value::from(2);
    let other_version = write("v2.json", &other_version.to_string());
    let run = lab.ctl(&["release", "--from-report", &other_version, "--apply"]);
    run.expect_code(2);
    assert!(run.error_line().contains("version 2"), "{}", run.stderr);

    let mut no_problems = report.clone();
    no_problems["problems"] = Value::from("many");
    let no_problems = write("damaged.json", &no_problems.to_string());
    let run = lab.ctl(&["release", "--from-report", &no_problems, "--apply"]);
    run.expect_code(2);
    assert!(
        run.error_line().contains("damaged check report"),
        "{}",
        run.stderr
    );

    let missing = lab.dir.path().join("absent.json").display().to_string();
    lab.ctl(&["release", "--from-report", &missing, "--apply"])
        .expect_code(2);

    // A report of another store, whose addresses and sequence numbers are the same as here.
    let other = Lab::new(backend);
    other.ctl(&["pool", "add", "10.53.0.0/24"]).ok();
    other.assign("net.leaked", "host-a");
    lose_handle(&other, "net.leaked");
    let (foreign, foreign_report) = write_report(&other, "foreign.json");
    let foreign = foreign.display().to_string();
    let run = lab.ctl(&["release", "--from-report", &foreign, "--apply"]);
    run.expect_code(1);
    // The refusal names the report's store: its type, and its path or key prefix.
    let store = &foreign_report["store"];
    let kind = store["datastore_type"].as_str().expect("a store type");
    let place = store["path"]
        .as_str()
        .or(store["etcd_prefix"].as_str())
        .expect("a path or a key prefix");
    let line = run.error_line();
    assert!(
        line.contains(&format!("made from another store ({kind} at ")) && line.contains(place),
        "{}",
        run.stderr
    );

    assert_eq!(
        lab.snapshot(),
        before,
        "no refused report changed the store"
    );
    // The report of this store still works.
    let path = path.display().to_string();
    lab.ctl(&["release", "--from-report", &path, "--apply"])
        .ok()
        .stdout_has("Released 1 leaked address");
}

/// A leak whose handle exists again after the report (`check --repair` recreated it, or its pod
/// wrote it) is skipped: its DEL frees it. The report's problems of other kinds are counted, by
/// kind, as not released.
fn a_leak_whose_handle_exists_again_is_left_to_its_del(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.54.0.0/24"]).ok();
    let leaked_ip = lab.assign("net.leaked", "host-a");
    let leaked = leaked_ip.to_string();
    let block = ipnet::IpNet::new(leaked_ip, 26).expect("net").trunc();
    lab.assign("net.c1", "host-a");
    lab.assign("net.c2", "host-a");
    // Two handles that over-count their addresses: handle-count-mismatch, not a leak.
    lab.with_store(|store| async move {
        let wrong = Handle {
            blocks: BTreeMap::from([(block, 5)]),
            ..Handle::default()
        };
        for handle in ["net.c1", "net.c2"] {
            store
                .put(&keys::handle(handle), encode(&wrong).expect("encode"))
                .await
                .expect("put");
        }
    });
    lose_handle(&lab, "net.leaked");
    let (path, _) = write_report(&lab, "report.json");
    let path = path.display().to_string();

    let not_released = serde_json::json!([{
        "kind": kinds::HANDLE_COUNT,
        "problems": 2,
        "reason": "its handle exists, so the pod's DEL releases its addresses; `check --repair` \
                   fixes the counts",
    }]);
    let preview = lab
        .ctl(&["-o", "json", "release", "--from-report", &path])
        .ok()
        .json();
    assert_eq!(preview["released"][0]["ip"], leaked.as_str(), "{preview}");
    assert_eq!(preview["kinds_not_released"], not_released, "{preview}");
    lab.ctl(&["release", "--from-report", &path])
        .ok()
        .stdout_has("Would release 1 leaked address")
        .stdout_has("Not released: 2 problems of kind handle-count-mismatch");

    // The repair recreates the lost handle: the address is no longer leaked.
    lab.ctl(&["check", "--repair"]).ok();
    let before = lab.snapshot();
    let preview = lab.ctl(&["release", "--from-report", &path]);
    preview
        .ok()
        .stdout_has("Would release nothing")
        .stdout_has("exists again");
    assert!(
        !preview.stdout.contains("Nothing was changed"),
        "a preview that would release nothing offers nothing to apply: {}",
        preview.stdout
    );
    let applied = lab
        .ctl(&["-o", "json", "release", "--from-report", &path, "--apply"])
        .ok()
        .json();
    assert_eq!(applied["released"], serde_json::json!([]), "{applied}");
    assert_eq!(applied["skipped"][0]["ip"], leaked.as_str(), "{applied}");
    assert!(
        applied["skipped"][0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("\"net.leaked\" exists again")),
        "{applied}"
    );
    assert_eq!(applied["kinds_not_released"], not_released, "{applied}");
    assert_eq!(lab.snapshot(), before, "nothing was released");
    let shown = lab
        .ctl(&["-o", "json", "show", "--ip", &leaked])
        .ok()
        .json();
    assert_eq!(shown["handle"], "net.leaked", "its DEL will free it");
    lab.ctl(&["check"]).ok().stdout_has("no problems");
}
