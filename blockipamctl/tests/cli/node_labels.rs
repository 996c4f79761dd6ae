//! `node label HOST KEY=VALUE... [--remove KEY]... | --replace` and `node show HOST` on every
//! backend.

use ipam_core::nodes::node_key;
use serde_json::json;

use crate::common::{Backend, Lab};

crate::on_every_backend!(
    node_label_sets_replaces_and_removes_and_node_show_prints_them,
    malformed_label_commands_are_usage_errors_and_change_nothing,
    replace_writes_over_labels_that_do_not_decode_where_an_update_refuses,
);

fn node_label_sets_replaces_and_removes_and_node_show_prints_them(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.70.0.0/24"]).ok();

    lab.ctl(&["node", "show", "host-a"])
        .ok()
        .stdout_has("Node host-a has no labels.");
    lab.ctl(&[
        "node",
        "label",
        "host-a",
        "rack=r1",
        "topology.kubernetes.io/zone=z1",
        "gpu=",
    ])
    .ok()
    .stdout_has("Node host-a now has 3 labels:")
    .stdout_has("KEY                          VALUE")
    .stdout_has("rack                         r1")
    .stdout_has("topology.kubernetes.io/zone  z1");

    let shown = lab
        .ctl(&["-o", "json", "node", "show", "host-a"])
        .ok()
        .json();
    assert_eq!(
        shown,
        json!({
            "host": "host-a",
            "labels": {"gpu": "", "rack": "r1", "topology.kubernetes.io/zone": "z1"}
        })
    );

    // Replace one, add one, remove two (one the node lacks): one update.
    let changed = lab
        .ctl(&[
            "-o",
            "json",
            "node",
            "label",
            "host-a",
            "rack=r2",
            "role=edge",
            "--remove",
            "gpu",
            "--remove",
            "never-set",
        ])
        .ok()
        .json();
    let expected = json!({
        "host": "host-a",
        "labels": {"rack": "r2", "role": "edge", "topology.kubernetes.io/zone": "z1"}
    });
    assert_eq!(changed, expected);
    assert_eq!(
        lab.ctl(&["-o", "json", "node", "show", "host-a"])
            .ok()
            .json(),
        expected
    );
    lab.ctl(&["node", "show", "host-b"])
        .ok()
        .stdout_has("Node host-b has no labels.");
    assert_eq!(
        lab.ctl(&["-o", "json", "node", "show", "host-b"])
            .ok()
            .json(),
        json!({"host": "host-b", "labels": {}})
    );

    // The labels are what the library reads (and what pools' node selectors will match).
    let labels =
        lab.with_ipam(|ipam| async move { ipam.node_labels("host-a").await.expect("read labels") });
    let selector = ipam_core::selector::Selector::parse(r#"rack == "r2" && role in {"edge"}"#)
        .expect("selector");
    assert!(selector.matches(&labels), "{labels:?}");

    lab.ctl(&[
        "node",
        "label",
        "host-a",
        "--remove",
        "rack",
        "--remove",
        "role",
        "--remove",
        "topology.kubernetes.io/zone",
    ])
    .ok()
    .stdout_has("Node host-a now has no labels.");
    let leftover: Vec<String> = lab
        .snapshot()
        .into_iter()
        .map(|(key, _, _)| key)
        .filter(|key| key.contains("nodes/"))
        .collect();
    assert_eq!(
        leftover,
        Vec::<String>::new(),
        "an unlabelled node keeps no object"
    );
    lab.ctl(&["check"]).ok();
}

fn malformed_label_commands_are_usage_errors_and_change_nothing(backend: Backend) {
    let lab = Lab::new(backend);
    if backend != Backend::Etcd {
        // No store yet: labelling never creates one.
        let missing = lab.ctl(&["node", "label", "host-a", "rack=r1"]);
        missing.expect_code(1);
        assert!(missing.error_line().contains("no "), "{}", missing.stderr);
        assert!(!lab.path().exists(), "node label created a store");
    }
    lab.ctl(&["pool", "add", "10.71.0.0/24"]).ok();
    lab.ctl(&["node", "label", "host-a", "rack=r1"]).ok();
    let before = lab.snapshot();

    for (args, says) in [
        (vec!["node", "label", "host-a"], "required"),
        (vec!["node", "label", "host-a", "rack"], "must be KEY=VALUE"),
        (
            vec!["node", "label", "host-a", "bad key=x"],
            "label key \"bad key\"",
        ),
        (
            vec!["node", "label", "host-a", "Rack.Example.com/r=x"],
            "prefix",
        ),
        (vec!["node", "label", "host-a", "rack=-r2"], "value \"-r2\""),
        (
            vec!["node", "label", "host-a", "rack=r2", "rack=r3"],
            "set twice",
        ),
        (
            vec!["node", "label", "host-a", "rack=r2", "--remove", "rack"],
            "set and removed",
        ),
        (vec!["node", "label", "a/b", "rack=r2"], "host name"),
        (vec!["node", "show", "a/b"], "host name"),
    ] {
        let run = lab.ctl(&args);
        run.expect_code(2);
        let line = run.error_line();
        assert!(
            line.contains(says),
            "{args:?}: {line:?} should say {says:?}"
        );
    }
    assert_eq!(lab.snapshot(), before, "a refused command wrote");
    assert_eq!(
        lab.ctl(&["-o", "json", "node", "show", "host-a"])
            .ok()
            .json(),
        json!({"host": "host-a", "labels": {"rack": "r1"}})
    );
}

/// A node whose labels object cannot be decoded: an update (`KEY=VALUE`, `--remove`) refuses to
/// guess what to keep and writes nothing, `check` names `--replace` as the way out, and
/// `--replace` writes the labels given whole; with none given it removes the object.
fn replace_writes_over_labels_that_do_not_decode_where_an_update_refuses(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.70.0.0/24"]).ok();
    lab.with_store(|store| async move {
        store
            .put(
                &node_key("host-a"),
                vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff],
            )
            .await
            .expect("damage host-a's labels")
    });
    let before = lab.snapshot();
    let refused = lab.ctl(&["node", "label", "host-a", "rack=r1"]);
    refused.expect_code(1);
    assert!(
        refused.error_line().contains("ipam/v1/nodes/host-a"),
        "{}",
        refused.error_line()
    );
    lab.ctl(&["check"])
        .expect_code(1)
        .stdout_has("`blockipamctl node label host-a <KEY=VALUE>... --replace`");
    lab.ctl(&["node", "label", "host-a", "--replace", "--remove", "rack"])
        .expect_code(2);
    assert_eq!(lab.snapshot(), before, "refusals and check write nothing");

    let replaced = lab
        .ctl(&[
            "-o",
            "json",
            "node",
            "label",
            "host-a",
            "rack=r1",
            "zone=z1",
            "--replace",
        ])
        .ok()
        .json();
    assert_eq!(
        replaced,
        json!({"host": "host-a", "labels": {"rack": "r1", "zone": "z1"}})
    );
    lab.ctl(&["check"]).ok();
    lab.ctl(&["node", "label", "host-a", "zone=z2", "--replace"])
        .ok()
        .stdout_has("Node host-a now has 1 label:");
    let shown = lab
        .ctl(&["-o", "json", "node", "show", "host-a"])
        .ok()
        .json();
    assert_eq!(
        shown["labels"],
        json!({"zone": "z2"}),
        "the rest replaced too"
    );
    lab.ctl(&["node", "label", "host-a", "--replace"])
        .ok()
        .stdout_has("Node host-a now has no labels.");
    let removed =
        lab.with_store(|store| async move { store.get(&node_key("host-a")).await.expect("get") });
    assert_eq!(removed, None, "no labels, no object");
}
