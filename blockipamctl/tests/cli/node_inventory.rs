//! `node list` and `node retire HOST [--apply] [--force]` on every backend: agents' registrations
//! and liveness keys are written through the storage trait, as an agent writes them.

use ipam_core::dead_nodes::{activity_key, agent_key, liveness_key, register};
use ipam_core::nodes::node_key;
use serde_json::{json, Value};

use crate::common::{marked_registration, Backend, Lab};

crate::on_every_backend!(
    node_list_shows_every_node_the_store_knows,
    node_retire_previews_refuses_a_live_node_and_removes_everything,
    node_retire_refuses_an_active_node_and_retires_a_dead_one,
    node_list_and_retire_get_past_a_labels_object_that_does_not_decode,
    node_list_gc_and_a_retire_preview_get_past_a_block_that_does_not_decode,
    node_retire_leaves_a_block_of_cooling_addresses_to_blocks_release_empty,
);

/// host-a: registered with a liveness key (alive), labelled, one address; host-b: registered
/// without liveness key (missing), labelled, two addresses; host-c: labels only; host-d: an
/// address only (no agent). The store has a pool.
fn populate(lab: &Lab) -> (String, Vec<String>, String) {
    lab.with_store(|store| async move {
        for host in ["host-a", "host-b"] {
            register(store.as_ref(), host, "test", 1_700_000_000)
                .await
                .expect("register");
        }
        store
            .put(&liveness_key("host-a"), b"host-a".to_vec())
            .await
            .expect("put the liveness key");
    });
    let a = lab.assign("net.a", "host-a").to_string();
    let b = vec![
        lab.assign("net.b1", "host-b").to_string(),
        lab.assign("net.b2", "host-b").to_string(),
    ];
    let d = lab.assign("net.d", "host-d").to_string();
    lab.ctl(&["node", "label", "host-a", "rack=r1"]).ok();
    lab.ctl(&["node", "label", "host-b", "zone=z1"]).ok();
    lab.ctl(&["node", "label", "host-c", "rack=r2", "zone=z2"])
        .ok();
    (a, b, d)
}

fn node_of<'a>(list: &'a Value, host: &str) -> &'a Value {
    list["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["node"] == host)
        .unwrap_or_else(|| panic!("{host} is listed: {list}"))
}

/// Asserts that `node list`'s JSON `list` shows nothing of `host`.
fn assert_not_listed(list: &Value, host: &str) {
    assert!(
        list["nodes"]
            .as_array()
            .expect("nodes")
            .iter()
            .all(|n| n["node"] != host),
        "nothing of {host} is left: {list}"
    );
}

fn node_list_shows_every_node_the_store_knows(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.60.0.0/24", "--block-size", "28"])
        .ok();
    lab.ctl(&["node", "list"])
        .ok()
        .stdout_has("The store knows no node");
    populate(&lab);
    let before = lab.snapshot();
    let list = lab.ctl(&["-o", "json", "node", "list"]).ok().json();
    let hosts: Vec<&str> = list["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| n["node"].as_str().expect("node"))
        .collect();
    assert_eq!(hosts, ["host-a", "host-b", "host-c", "host-d"]);
    assert_eq!(
        node_of(&list, "host-a"),
        &json!({"node": "host-a", "state": "alive", "registered": true, "liveness_key": true,
                "labels": {"rack": "r1"}, "blocks": 1, "addresses": 1})
    );
    assert_eq!(
        node_of(&list, "host-b"),
        &json!({"node": "host-b", "state": "missing", "registered": true, "liveness_key": false,
                "labels": {"zone": "z1"}, "blocks": 1, "addresses": 2})
    );
    assert_eq!(
        node_of(&list, "host-c"),
        &json!({"node": "host-c", "state": "unregistered", "registered": false,
                "liveness_key": false, "labels": {"rack": "r2", "zone": "z2"}, "blocks": 0,
                "addresses": 0})
    );
    assert_eq!(node_of(&list, "host-d")["addresses"], 1);
    assert_eq!(node_of(&list, "host-d")["state"], "unregistered");

    let table = lab.ctl(&["node", "list"]);
    table
        .ok()
        .stdout_has("4 nodes:")
        .stdout_has("NODE")
        .stdout_has("missing (no countdown yet)")
        .stdout_has("rack=r2,zone=z2");
    let (_, rows) = table
        .stdout
        .split_once('\n')
        .expect("a table under the count");
    crate::common::assert_columns_line_up(rows);
    assert_eq!(lab.snapshot(), before, "node list writes nothing");
}

fn node_retire_previews_refuses_a_live_node_and_removes_everything(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.60.0.0/24", "--block-size", "28"])
        .ok();
    let (a, b, d) = populate(&lab);
    let before = lab.snapshot();

    let refused = lab.ctl(&["node", "retire", "host-a", "--apply"]);
    refused.expect_code(1);
    let line = refused.error_line();
    assert!(
        line.contains("node host-a is alive") && line.contains("--force"),
        "{line}"
    );
    let preview = lab
        .ctl(&["-o", "json", "node", "retire", "host-b"])
        .ok()
        .json();
    assert_eq!(
        preview,
        json!({"node": "host-b", "state": "missing", "applied": false,
               "labels": {"zone": "z1"}, "registered": true, "blocks": 1, "addresses": 2})
    );
    lab.ctl(&["node", "retire", "host-b"])
        .ok()
        .stdout_has("holds 2 addresses, 1 block, 1 label and an agent registration")
        .stdout_has("run again with --apply");
    assert_eq!(
        lab.snapshot(),
        before,
        "a refusal and a preview write nothing"
    );

    let retired = lab
        .ctl(&["-o", "json", "node", "retire", "host-b", "--apply"])
        .ok()
        .json();
    let done = &retired["retired"];
    let mut released: Vec<String> = done["released_addresses"]
        .as_array()
        .expect("released")
        .iter()
        .map(|v| v.as_str().expect("ip").to_owned())
        .collect();
    released.sort();
    let mut expected = b.clone();
    expected.sort();
    assert_eq!(released, expected);
    assert_eq!(done["deleted_blocks"].as_array().map(Vec::len), Some(1));
    assert_eq!(done["labels_removed"], true);
    assert_eq!(done["registration_deleted"], true);
    let registration =
        lab.with_store(|store| async move { store.get(&agent_key("host-b")).await.expect("get") });
    assert!(registration.is_none(), "the registration is deleted");
    let list = lab.ctl(&["-o", "json", "node", "list"]).ok().json();
    assert_not_listed(&list, "host-b");
    for ip in &b {
        assert_eq!(
            lab.ctl(&["-o", "json", "show", "--ip", ip]).ok().json()["allocated"],
            false
        );
    }
    assert_eq!(
        lab.ctl(&["-o", "json", "show", "--ip", &d]).ok().json()["allocated"],
        true,
        "another node's address stays"
    );

    // --force retires a live node; its agent's registration stays while it keeps its liveness key.
    lab.ctl(&["node", "retire", "host-a", "--apply", "--force"])
        .ok()
        .stdout_has("Node host-a retired:")
        .stdout_has("addresses released:          1")
        .stdout_has("agent registration deleted:  no");
    assert_eq!(
        lab.ctl(&["-o", "json", "show", "--ip", &a]).ok().json()["allocated"],
        false
    );
    let list = lab.ctl(&["-o", "json", "node", "list"]).ok().json();
    let host_a = node_of(&list, "host-a");
    assert_eq!(
        (&host_a["labels"], &host_a["blocks"], &host_a["addresses"]),
        (&json!({}), &json!(0), &json!(0))
    );

    lab.ctl(&["node", "retire", "-"]).expect_code(2);
    lab.ctl(&["node", "retire", "host-never-seen", "--apply"])
        .ok()
        .stdout_has("addresses released:          0");

    // A node no agent registered keeps no registration, but its plugin's activity record goes.
    lab.with_store(|store| async move {
        store
            .put(&activity_key("host-g"), b"{}".to_vec())
            .await
            .expect("an activity record only")
    });
    let retired = lab
        .ctl(&["-o", "json", "node", "retire", "host-g", "--apply"])
        .ok()
        .json();
    assert_eq!(retired["registered"], false);
    assert_eq!(retired["retired"]["activity_record_deleted"], true);
    let record = lab
        .with_store(|store| async move { store.get(&activity_key("host-g")).await.expect("get") });
    assert!(record.is_none(), "the activity record is deleted");
    lab.ctl(&["check"]).ok();
}

/// A registration marked missing by a reclaimer that saw no plugin activity (revision 0).
fn marked(host: &str) -> Vec<u8> {
    serde_json::to_vec(&marked_registration(host, 1_700_000_000)).expect("JSON")
}

fn node_retire_refuses_an_active_node_and_retires_a_dead_one(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.61.0.0/24", "--block-size", "28"])
        .ok();
    let e = lab.assign("net.e", "host-e").to_string();
    let f = lab.assign("net.f", "host-f").to_string();
    // host-e: marked, and its plugin committed since (its activity record moved): active.
    // host-f: marked, countdown gone, no activity since: dead.
    lab.with_store(|store| async move {
        store
            .put(&agent_key("host-e"), marked("host-e"))
            .await
            .expect("mark host-e");
        store
            .put(&activity_key("host-e"), b"{}".to_vec())
            .await
            .expect("host-e's plugin at work");
        store
            .put(&agent_key("host-f"), marked("host-f"))
            .await
            .expect("mark host-f");
    });
    let list = lab.ctl(&["-o", "json", "node", "list"]).ok().json();
    assert_eq!(node_of(&list, "host-e")["state"], "active");
    assert_eq!(node_of(&list, "host-f")["state"], "dead");

    let before = lab.snapshot();
    let refused = lab.ctl(&["node", "retire", "host-e", "--apply"]);
    refused.expect_code(1);
    assert!(
        refused.error_line().contains("node host-e is active"),
        "{}",
        refused.stderr
    );
    assert_eq!(lab.snapshot(), before, "a refused retire writes nothing");

    let retired = lab
        .ctl(&["-o", "json", "node", "retire", "host-f", "--apply"])
        .ok()
        .json();
    assert_eq!(retired["state"], "dead");
    assert_eq!(retired["retired"]["released_addresses"], json!([f]));
    assert_eq!(retired["retired"]["registration_deleted"], true);
    assert_eq!(
        lab.ctl(&["-o", "json", "show", "--ip", &e]).ok().json()["allocated"],
        true,
        "the active node keeps its address"
    );
    lab.ctl(&["check"]).ok();
}

/// host-b's labels object is damaged: `node list` shows every node, host-b's labels as not
/// decodable; `node retire host-b` previews it and with `--apply` deletes it with the rest.
fn node_list_and_retire_get_past_a_labels_object_that_does_not_decode(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.60.0.0/24", "--block-size", "28"])
        .ok();
    populate(&lab);
    lab.with_store(|store| async move {
        store
            .put(
                &node_key("host-b"),
                vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff],
            )
            .await
            .expect("damage host-b's labels")
    });
    let before = lab.snapshot();

    let list = lab.ctl(&["-o", "json", "node", "list"]).ok().json();
    assert_eq!(list["nodes"].as_array().map(Vec::len), Some(4), "{list}");
    let host_b = node_of(&list, "host-b");
    assert_eq!(host_b["labels"], json!({}));
    let error = host_b["labels_error"].as_str().expect("labels_error");
    assert!(error.contains("ipam/v1/nodes/host-b"), "{error}");
    assert_eq!(host_b["addresses"], 2);
    assert_eq!(node_of(&list, "host-a")["labels"], json!({"rack": "r1"}));
    assert!(node_of(&list, "host-a").get("labels_error").is_none());
    lab.ctl(&["node", "list"])
        .ok()
        .stdout_has("4 nodes:")
        .stdout_has("cannot be decoded (see `blockipamctl check`)")
        .stdout_has("rack=r2,zone=z2");

    let preview = lab
        .ctl(&["-o", "json", "node", "retire", "host-b"])
        .ok()
        .json();
    assert_eq!(preview["labels"], json!({}));
    assert!(
        preview["labels_error"]
            .as_str()
            .is_some_and(|e| e.contains("ipam/v1/nodes/host-b")),
        "{preview}"
    );
    lab.ctl(&["node", "retire", "host-b"])
        .ok()
        .stdout_has("a labels object that cannot be decoded");
    assert_eq!(lab.snapshot(), before, "list and preview write nothing");

    lab.ctl(&["node", "retire", "host-b", "--apply"])
        .ok()
        .stdout_has("addresses released:          2")
        .stdout_has("labels removed:              its labels object, which could not be decoded");
    let labels =
        lab.with_store(|store| async move { store.get(&node_key("host-b")).await.expect("get") });
    assert!(labels.is_none(), "the damaged object is deleted");
    let list = lab.ctl(&["-o", "json", "node", "list"]).ok().json();
    assert_not_listed(&list, "host-b");
    assert_eq!(
        node_of(&list, "host-c")["labels"],
        json!({"rack": "r2", "zone": "z2"})
    );
    lab.ctl(&["check"]).ok();
}

/// One damaged block hides no node: `node list`, `gc --dead-nodes` and a `node retire` preview
/// name it and count the rest; `node retire --apply` refuses (the block may hold the node's
/// addresses) and changes nothing until it is restored.
fn node_list_gc_and_a_retire_preview_get_past_a_block_that_does_not_decode(backend: Backend) {
    use ipam_core::model::keys;
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.60.0.0/24", "--block-size", "28"])
        .ok();
    let (_, _, d) = populate(&lab);
    let block_of_d = ipnet::IpNet::new(d.parse().expect("an address"), 28)
        .expect("a /28")
        .trunc();
    let damaged = keys::block(Some("host-d"), &block_of_d);
    let key = damaged.clone();
    let kept = lab.with_store(|store| async move {
        let kept = store.get(&key).await.expect("get").expect("host-d's block");
        store
            .put(&key, b"garbage{".to_vec())
            .await
            .expect("damage host-d's block");
        kept.value
    });
    let before = lab.snapshot();
    let named = |json: &Value| -> Vec<String> {
        json["undecodable"]
            .as_array()
            .unwrap_or_else(|| panic!("no undecodable list: {json}"))
            .iter()
            .filter_map(|o| o["key"].as_str().map(str::to_owned))
            .collect()
    };

    let list = lab.ctl(&["-o", "json", "node", "list"]).ok().json();
    assert_eq!(named(&list), vec![damaged.clone()]);
    assert_eq!(list["nodes"].as_array().map(Vec::len), Some(4), "{list}");
    assert_eq!(node_of(&list, "host-b")["addresses"], 2);
    assert_eq!(
        node_of(&list, "host-d")["blocks"],
        1,
        "its key still counts"
    );
    lab.ctl(&["node", "list"])
        .ok()
        .stdout_has("4 nodes:")
        .stdout_has("left out of the ADDRESSES counts")
        .stdout_has(&damaged);
    let gc = lab.ctl(&["-o", "json", "gc", "--dead-nodes"]).ok().json();
    assert_eq!(named(&gc), vec![damaged.clone()]);
    let preview = lab
        .ctl(&["-o", "json", "node", "retire", "host-b"])
        .ok()
        .json();
    assert_eq!(named(&preview), vec![damaged.clone()]);
    assert_eq!(preview["addresses"], 2);
    lab.ctl(&["node", "retire", "host-b"]).ok().stdout_has(
        "--apply is refused until every block can be decoded (and every owner key read)",
    );
    let refused = lab.ctl(&["node", "retire", "host-b", "--apply"]);
    refused.expect_code(1);
    assert!(
        refused.error_line().contains(&damaged)
            && refused
                .error_line()
                .contains("may hold addresses of its pods"),
        "{}",
        refused.error_line()
    );
    assert_eq!(lab.snapshot(), before, "nothing written");

    let key = damaged.clone();
    lab.with_store(|store| async move { store.put(&key, kept).await.expect("restore") });
    lab.ctl(&["node", "retire", "host-b", "--apply"])
        .ok()
        .stdout_has("addresses released:          2");
    let list = lab.ctl(&["-o", "json", "node", "list"]).ok().json();
    assert!(list.get("undecodable").is_none(), "{list}");
    assert_eq!(node_of(&list, "host-d")["addresses"], 1);
}

/// With an IP cooldown, the addresses a retire releases keep their block from being empty: the
/// block loses its host, the retire says why, `blocks release-empty` keeps it while they cool, and
/// deletes it once they have cooled (here by ending the cooldown, so no step races the clock).
fn node_retire_leaves_a_block_of_cooling_addresses_to_blocks_release_empty(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.53.0.0/24", "--block-size", "28"])
        .ok();
    lab.ctl(&["config", "set", "--ip-cooldown-seconds", "1200"])
        .ok();
    lab.assign("net.d", "host-d");
    lab.ctl(&["node", "retire", "host-d", "--apply"])
        .ok()
        .stdout_has("addresses released:          1\n")
        .stdout_has("empty blocks deleted:        0\n")
        .stdout_has(
            "blocks left without a host:  1 (they hold other nodes' addresses, or released \
             addresses still cooling down; each is deleted when its last address goes, or by \
             `blocks release-empty` once cooled)\n",
        );
    let blocks = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    assert_eq!(blocks["blocks"][0]["host"], Value::Null, "{blocks}");
    assert_eq!(blocks["blocks"][0]["cooling"], 1, "{blocks}");
    lab.ctl(&["blocks", "release-empty", "--older-than", "0", "--apply"])
        .ok();
    let still = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    assert_eq!(still, blocks, "a block with a cooling address is not empty");

    lab.ctl(&["config", "set", "--ip-cooldown-seconds", "0"])
        .ok();
    lab.ctl(&["blocks", "release-empty", "--older-than", "0", "--apply"])
        .ok();
    let blocks = lab.ctl(&["-o", "json", "show", "--blocks"]).ok().json();
    assert_eq!(blocks["blocks"], json!([]), "the cooled block is released");
}
