//! `check` and `check --repair` on every backend, against stores broken on purpose through the
//! storage trait.

use std::collections::BTreeMap;

use ipam_core::check::kinds;
use ipam_core::model::{decode, encode, keys, Block, Handle};
use ipnet::IpNet;
use serde_json::Value;

use crate::common::{Backend, Lab};

crate::on_every_backend!(
    check_finds_a_broken_store_and_repair_fixes_it,
    check_exits_1_when_what_is_wrong_cannot_be_repaired,
    a_pods_handle_that_does_not_decode_is_rewritten_by_repair_and_its_del_then_frees_it,
);

/// What `check` advises when something it found is repairable.
const REPAIR_ADVICE: &str =
    "Run `blockipamctl check --repair` to fix the repairable ones; the others need a person.\n";

fn kinds_of(report: &Value) -> Vec<String> {
    report["problems"]
        .as_array()
        .expect("problems")
        .iter()
        .map(|p| p["kind"].as_str().expect("kind").to_owned())
        .collect()
}

fn check_finds_a_broken_store_and_repair_fixes_it(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.40.0.0/24", "--block-size", "28"])
        .ok();
    let ip = lab.assign("net.h1", "host-a");
    lab.assign("net.h1-other", "host-a");
    let block = IpNet::new(ip, 28).expect("net").trunc();

    let clean = lab.ctl(&["-o", "json", "check"]).ok().json();
    assert_eq!(clean["clean"], true);
    assert_eq!(clean["problems"], serde_json::json!([]));
    assert_eq!(clean["blocks_checked"], 1);
    assert_eq!(clean["handles_checked"], 2);
    assert_eq!(clean["allocations_checked"], 2);
    lab.ctl(&["check"]).ok().stdout_has("no problems");

    // Break it: a handle that over-counts, a handle no block knows, and a claim without a block.
    let orphan: IpNet = "10.40.0.192/28".parse().expect("cidr");
    lab.with_store(|store| async move {
        let wrong = Handle {
            blocks: BTreeMap::from([(block, 5)]),
            ..Handle::default()
        };
        store
            .put(&keys::handle("net.h1"), encode(&wrong).expect("encode"))
            .await
            .expect("put");
        store
            .put(&keys::handle("net.ghost"), encode(&wrong).expect("encode"))
            .await
            .expect("put");
        store
            .put(
                &keys::block_claim(&orphan),
                encode(&ipam_core::model::Claim {
                    affinity: Some("host-z".to_owned()),
                    free: 64,
                    emptied_at: None,
                    last_cooling_release: None,
                })
                .expect("encode"),
            )
            .await
            .expect("put");
    });
    let broken = lab.snapshot();

    let found = lab.ctl(&["-o", "json", "check"]);
    found.expect_code(1);
    let report = found.json();
    assert_eq!(report["clean"], false);
    let kinds = kinds_of(&report);
    assert_eq!(
        kinds.iter().filter(|k| *k == kinds::HANDLE_COUNT).count(),
        2,
        "{kinds:?}"
    );
    assert!(
        kinds.iter().any(|k| k == kinds::ORPHANED_CLAIM),
        "{kinds:?}"
    );
    for problem in report["problems"].as_array().expect("problems") {
        assert!(problem["detail"].as_str().is_some_and(|d| !d.is_empty()));
        assert_eq!(problem["repairable"], true);
        assert!(
            problem["remedy"]
                .as_str()
                .is_some_and(|r| r.contains("check --repair")),
            "every problem says what to do: {problem}"
        );
    }
    assert!(report.get("remaining").is_none());
    let table = lab.ctl(&["check"]);
    table
        .expect_code(1)
        .stdout_has("3 problems (3 repairable)")
        .stdout_has(kinds::HANDLE_COUNT)
        .stdout_has("What to do:")
        .stdout_has(
            "handle-count-mismatch: Run `blockipamctl check --repair`: it rewrites the handle",
        )
        .stdout_has(REPAIR_ADVICE);
    assert!(
        !table.stdout.contains("Nothing was repaired") && !table.stdout.contains("Repaired:"),
        "a check without --repair reports no repair:\n{}",
        table.stdout
    );
    // What to do is said once for each kind found, two problems of one kind or not.
    let what_to_do = table
        .stdout
        .split_once("What to do:\n")
        .map(|(_, after)| after)
        .expect("a What to do section");
    for kind in [kinds::HANDLE_COUNT, kinds::ORPHANED_CLAIM] {
        assert_eq!(
            what_to_do.matches(&format!("{kind}: ")).count(),
            1,
            "{kind}:\n{}",
            table.stdout
        );
    }
    assert_eq!(
        lab.snapshot(),
        broken,
        "check without --repair writes nothing"
    );

    let repaired = lab.ctl(&["-o", "json", "check", "--repair"]);
    let report = repaired.ok().json();
    assert_eq!(report["clean"], true);
    assert_eq!(
        kinds_of(&report).len(),
        3,
        "problems found before the repair"
    );
    assert_eq!(report["repaired"].as_array().map(Vec::len), Some(3));
    assert_eq!(report["remaining"], serde_json::json!([]));

    lab.ctl(&["-o", "json", "check"]).ok();
    let clean = lab.ctl(&["check", "--repair"]);
    clean.ok().stdout_has("no problems.\n");
    assert!(
        !clean.stdout.contains("Nothing was repaired"),
        "a clean store has nothing to repair:\n{}",
        clean.stdout
    );
    let handle = lab.with_store(|store| async move {
        let kv = store
            .get(&keys::handle("net.h1"))
            .await
            .expect("get")
            .expect("the handle exists");
        decode::<Handle>(&kv.key, &kv.value).expect("decode")
    });
    assert_eq!(
        handle.blocks,
        BTreeMap::from([(block, 1)]),
        "rewritten from the block"
    );
    let ghost =
        lab.with_store(
            |store| async move { store.get(&keys::handle("net.ghost")).await.expect("get") },
        );
    assert!(ghost.is_none(), "a handle holding nothing is deleted");
}

fn check_exits_1_when_what_is_wrong_cannot_be_repaired(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.41.0.0/24"]).ok();
    // A block with its claim, but in no pool: only a person can decide what it should be.
    let stray: IpNet = "10.99.0.0/26".parse().expect("cidr");
    lab.with_store(|store| async move {
        let block = Block::new(stray, Some("host-a".into()), 0);
        store
            .put(
                &keys::block(Some("host-a"), &stray),
                encode(&block).expect("encode"),
            )
            .await
            .expect("put");
        store
            .put(
                &keys::block_claim(&stray),
                ipam_core::model::encode_claim(&block).expect("encode"),
            )
            .await
            .expect("put");
    });
    let run = lab.ctl(&["-o", "json", "check", "--repair"]);
    let report = run.expect_code(1).json();
    assert_eq!(report["clean"], false);
    assert!(kinds_of(&report).contains(&kinds::BLOCK_OUTSIDE_POOLS.to_owned()));
    let remaining = report["remaining"].as_array().expect("remaining");
    assert_eq!(remaining.len(), 1);
    assert_eq!(remaining[0]["repairable"], false);
    let repair = lab.ctl(&["check", "--repair"]);
    repair.expect_code(1).stdout_has("1 problem remain");
    let found = lab.ctl(&["check"]);
    found
        .expect_code(1)
        .stdout_has("1 problem (0 repairable).\n");
    for run in [&repair, &found] {
        assert!(
            !run.stdout.contains(REPAIR_ADVICE),
            "nothing here is repairable:\n{}",
            run.stdout
        );
    }
}

/// A pod whose handle object is damaged cannot be deleted (its DEL fails with 108, and a runtime
/// retries it for ever). `check` names the key and the way out, `check --repair` rewrites the
/// handle from the blocks, and the pod's DEL then frees its address.
fn a_pods_handle_that_does_not_decode_is_rewritten_by_repair_and_its_del_then_frees_it(
    backend: Backend,
) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.40.0.0/24", "--block-size", "28"])
        .ok();
    let address = lab.added("n1", "c1").to_string();
    lab.with_store(|store| async move {
        store
            .put(&keys::handle("fixture.c1"), b"garbage{".to_vec())
            .await
            .expect("damage the handle")
    });
    let (status, failed) = lab.plugin("DEL", "n1", "c1", serde_json::json!({}));
    assert_eq!(
        (status, failed["code"].clone()),
        (1, serde_json::json!(108)),
        "{failed}"
    );

    let report = lab.ctl(&["-o", "json", "check"]);
    report.expect_code(1);
    let report = report.json();
    assert_eq!(kinds_of(&report), vec![kinds::CORRUPT_OBJECT], "{report}");
    let problem = &report["problems"][0];
    assert_eq!(problem["repairable"], true, "{report}");
    assert_eq!(problem["handle"], "fixture.c1", "{report}");
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains("ipam/v1/handles/fixture.c1")
                && d.contains("`blockipamctl check --repair` rewrites it from them")),
        "{report}"
    );
    let repaired = lab.ctl(&["check", "--repair"]);
    repaired
        .ok()
        .stdout_has("Repaired:\n")
        .stdout_has("Checked again after the repair: no problems.\n");
    assert!(
        !repaired.stdout.contains(REPAIR_ADVICE),
        "a repair is not told to repair:\n{}",
        repaired.stdout
    );
    lab.ctl(&["check"]).ok();
    let (status, freed) = lab.plugin("DEL", "n1", "c1", serde_json::json!({}));
    assert_eq!(status, 0, "{freed}");
    lab.ctl(&["show", "--ip", &address])
        .ok()
        .stdout_has("allocated  no");
}
