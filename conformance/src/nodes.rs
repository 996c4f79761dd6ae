//! Node label cases (`Ipam::node_labels`, `set_node_labels`, `list_nodes_with_labels`,
//! `list_nodes_labels_each`, `remove_node_labels`): what pools' node selectors read, stored and
//! updated by compare-and-swap, on every backend.

use std::collections::BTreeMap;
use std::sync::Arc;

use ipam_core::kv::KvStore;
use ipam_core::nodes::{node_key, nodes_dir, NodeLabels, MAX_NODE_LABELS};
use ipam_core::selector::Selector;
use ipam_core::{Ipam, IpamError};

use crate::hooked::HookedStore;
use crate::ipam::{assert_clean, assign_one, ipam_with_pool};
use crate::StoreFactory;

/// Expands every node label case into one `#[tokio::test]` inside a module `node_labels`.
#[macro_export]
macro_rules! node_labels_conformance_tests {
    ($factory:expr) => {
        $crate::__expand_cases!(node_labels, $crate::nodes, $factory;
            unlabelled_node_has_no_labels_and_no_object,
            labels_are_set_replaced_and_removed_in_one_update,
            removing_the_last_label_deletes_the_node_object,
            invalid_hosts_keys_values_and_duplicates_are_refused_and_write_nothing,
            more_labels_than_the_limit_are_refused_and_write_nothing,
            concurrent_label_updates_of_one_node_lose_nothing,
            update_racing_another_writer_is_applied_on_top_of_it,
            listing_returns_only_labelled_nodes_sorted_by_host,
            corrupt_node_object_is_reported_naming_its_key,
            node_labels_leave_allocations_and_the_check_untouched,
        );
    };
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn map(items: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs(items).into_iter().collect()
}

fn keys(items: &[&str]) -> Vec<String> {
    items.iter().map(|k| (*k).to_owned()).collect()
}

async fn fresh_ipam<F: StoreFactory>(factory: &F) -> (crate::TestStore, Ipam) {
    let t = factory.fresh().await;
    let ipam = Ipam::new(Arc::clone(&t.store));
    (t, ipam)
}

/// A node never labelled reads as no labels, and nothing is stored for it.
pub async fn unlabelled_node_has_no_labels_and_no_object<F: StoreFactory>(factory: &F) {
    let (t, ipam) = fresh_ipam(factory).await;
    assert_eq!(ipam.node_labels("node-1").await.expect("read"), map(&[]));
    assert_eq!(ipam.list_nodes_with_labels().await.expect("list"), vec![]);
    // An update that changes nothing writes nothing.
    let labels = ipam
        .set_node_labels("node-1", &[], &keys(&["rack"]))
        .await
        .expect("remove a label the node lacks");
    assert_eq!(labels, map(&[]));
    assert_eq!(t.store.list("").await.expect("list store"), vec![]);
}

/// Setting adds or replaces, removing drops (a missing label is no error), all in one update;
/// the result is what a later read returns, and what a selector sees.
pub async fn labels_are_set_replaced_and_removed_in_one_update<F: StoreFactory>(factory: &F) {
    let (t, ipam) = fresh_ipam(factory).await;
    let first = ipam
        .set_node_labels(
            "node-1",
            &pairs(&[
                ("rack", "r1"),
                ("topology.kubernetes.io/zone", "z1"),
                ("gpu", ""),
            ]),
            &[],
        )
        .await
        .expect("set labels");
    assert_eq!(
        first,
        map(&[
            ("rack", "r1"),
            ("topology.kubernetes.io/zone", "z1"),
            ("gpu", "")
        ])
    );
    let revision_after_first = t
        .store
        .get(&node_key("node-1"))
        .await
        .expect("read node")
        .expect("node object written")
        .revision;

    let second = ipam
        .set_node_labels(
            "node-1",
            &pairs(&[("rack", "r2"), ("role", "edge")]),
            &keys(&["gpu", "never-set"]),
        )
        .await
        .expect("replace, add and remove");
    let expected = map(&[
        ("rack", "r2"),
        ("role", "edge"),
        ("topology.kubernetes.io/zone", "z1"),
    ]);
    assert_eq!(second, expected);
    assert_eq!(ipam.node_labels("node-1").await.expect("read"), expected);
    let after = t
        .store
        .get(&node_key("node-1"))
        .await
        .expect("read node")
        .expect("node object kept");
    assert!(after.revision > revision_after_first);

    // The same update again changes nothing and writes nothing.
    ipam.set_node_labels("node-1", &pairs(&[("rack", "r2")]), &keys(&["gpu"]))
        .await
        .expect("repeat");
    let again = t
        .store
        .get(&node_key("node-1"))
        .await
        .expect("read node")
        .expect("node object kept");
    assert_eq!(again.revision, after.revision, "a no-op update wrote");

    let selector = Selector::parse(r#"rack in {"r2", "r3"} && !has(gpu) && role == "edge""#)
        .expect("selector");
    assert!(selector.matches(&ipam.node_labels("node-1").await.expect("read")));
    assert!(!selector.matches(&ipam.node_labels("node-2").await.expect("read")));
}

/// A node left without labels has no object at all.
pub async fn removing_the_last_label_deletes_the_node_object<F: StoreFactory>(factory: &F) {
    let (t, ipam) = fresh_ipam(factory).await;
    ipam.set_node_labels("node-1", &pairs(&[("rack", "r1")]), &[])
        .await
        .expect("set");
    let labels = ipam
        .set_node_labels("node-1", &[], &keys(&["rack"]))
        .await
        .expect("remove");
    assert_eq!(labels, map(&[]));
    assert_eq!(t.store.get(&node_key("node-1")).await.expect("read"), None);
    assert_eq!(t.store.list(&nodes_dir()).await.expect("list"), vec![]);
}

fn assert_invalid(result: Result<BTreeMap<String, String>, IpamError>, says: &str) {
    match result {
        Err(IpamError::InvalidArgument(message)) => {
            assert!(message.contains(says), "{message:?} should say {says:?}")
        }
        other => panic!("expected an invalid-argument error saying {says:?}, got {other:?}"),
    }
}

/// Bad host names, keys, values and keys named twice are refused before anything is written.
pub async fn invalid_hosts_keys_values_and_duplicates_are_refused_and_write_nothing<
    F: StoreFactory,
>(
    factory: &F,
) {
    let (t, ipam) = fresh_ipam(factory).await;
    ipam.set_node_labels("node-1", &pairs(&[("rack", "r1")]), &[])
        .await
        .expect("set");
    let before = t.store.list("").await.expect("snapshot");

    assert_invalid(
        ipam.set_node_labels("a/b", &pairs(&[("rack", "r1")]), &[])
            .await,
        "host name",
    );
    assert_invalid(ipam.node_labels("").await, "host name");
    assert_invalid(
        ipam.set_node_labels("node-1", &pairs(&[("rack", "r2"), ("bad key", "x")]), &[])
            .await,
        "label key \"bad key\"",
    );
    assert_invalid(
        ipam.set_node_labels("node-1", &pairs(&[("Example.com/rack", "r2")]), &[])
            .await,
        "prefix",
    );
    assert_invalid(
        ipam.set_node_labels("node-1", &pairs(&[("rack", "-r2")]), &[])
            .await,
        "value \"-r2\"",
    );
    assert_invalid(
        ipam.set_node_labels("node-1", &pairs(&[("rack", &"v".repeat(64))]), &[])
            .await,
        "63",
    );
    assert_invalid(
        ipam.set_node_labels("node-1", &pairs(&[("rack", "r2"), ("rack", "r3")]), &[])
            .await,
        "set twice",
    );
    assert_invalid(
        ipam.set_node_labels("node-1", &pairs(&[("rack", "r2")]), &keys(&["rack"]))
            .await,
        "set and removed",
    );
    assert_invalid(
        ipam.set_node_labels("node-1", &[], &keys(&["bad/key/x"]))
            .await,
        "label key",
    );

    assert_eq!(
        t.store.list("").await.expect("snapshot"),
        before,
        "a refused update wrote"
    );
}

/// An update or a replacement that would leave more than [`MAX_NODE_LABELS`] labels is refused
/// whole.
pub async fn more_labels_than_the_limit_are_refused_and_write_nothing<F: StoreFactory>(
    factory: &F,
) {
    let (t, ipam) = fresh_ipam(factory).await;
    let full: Vec<(String, String)> = (0..MAX_NODE_LABELS)
        .map(|i| (format!("label-{i:03}"), format!("v{i}")))
        .collect();
    let labels = ipam
        .set_node_labels("node-1", &full, &[])
        .await
        .expect("the limit itself is allowed");
    assert_eq!(labels.len(), MAX_NODE_LABELS);
    let before = t.store.list("").await.expect("snapshot");
    assert_invalid(
        ipam.set_node_labels("node-1", &pairs(&[("one-more", "x")]), &[])
            .await,
        &format!("{} labels", MAX_NODE_LABELS + 1),
    );
    assert_eq!(t.store.list("").await.expect("snapshot"), before);
    // Replacing one within the limit still works.
    ipam.set_node_labels(
        "node-1",
        &pairs(&[("one-more", "x")]),
        &keys(&["label-000"]),
    )
    .await
    .expect("swap one label for another");
    // Replacing them whole: the limit itself is allowed, one more is refused.
    let mut over = full.clone();
    over.push(("one-more".to_owned(), "x".to_owned()));
    let before = t.store.list("").await.expect("snapshot");
    assert_invalid(
        ipam.replace_node_labels("node-1", &over).await,
        &format!("{} labels", MAX_NODE_LABELS + 1),
    );
    assert_eq!(t.store.list("").await.expect("snapshot"), before);
    assert_eq!(
        ipam.replace_node_labels("node-1", &full)
            .await
            .expect("the limit itself is allowed")
            .len(),
        MAX_NODE_LABELS
    );
}

/// Writers labelling one node at once each add their own label: the compare-and-swap retry
/// applies every update on top of the others, none is lost.
pub async fn concurrent_label_updates_of_one_node_lose_nothing<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = fresh_ipam(factory).await;
    const WRITERS: usize = 8;
    const UPDATES: usize = 3;
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let ipam = ipam.clone();
        tasks.push(tokio::spawn(async move {
            for update in 0..UPDATES {
                ipam.set_node_labels(
                    "node-1",
                    &[(format!("w{writer}-u{update}"), format!("v{update}"))],
                    &[],
                )
                .await
                .unwrap_or_else(|e| panic!("writer {writer} update {update}: {e}"));
            }
        }));
    }
    for task in tasks {
        task.await.expect("writer task");
    }
    let labels = ipam.node_labels("node-1").await.expect("read");
    assert_eq!(labels.len(), WRITERS * UPDATES, "{labels:?}");
    for writer in 0..WRITERS {
        for update in 0..UPDATES {
            assert_eq!(
                labels.get(&format!("w{writer}-u{update}")),
                Some(&format!("v{update}"))
            );
        }
    }
}

/// Another writer changing the node between an update's read and its commit makes the commit's
/// revision condition fail; the update is read again and applied on top, so both survive
/// (deterministic: the other write happens exactly in that window).
pub async fn update_racing_another_writer_is_applied_on_top_of_it<F: StoreFactory>(factory: &F) {
    let (t, _) = fresh_ipam(factory).await;
    ipam_with_existing_labels(&t.store).await;
    // Right after the first read of the node's labels is answered, another writer changes them.
    let interposing = HookedStore::new(Arc::clone(&t.store));
    let other = Ipam::new(Arc::clone(&t.store));
    let key = node_key("node-1");
    interposing.after_read(
        move |reads| {
            reads
                .iter()
                .any(|r| matches!(r, ipam_core::Read::Get(k) if *k == key))
        },
        move || async move {
            other
                .set_node_labels("node-1", &pairs(&[("written-between", "yes")]), &[])
                .await
                .expect("the interposed write");
        },
    );
    let ipam = Ipam::new(interposing.clone());
    let labels = ipam
        .set_node_labels("node-1", &pairs(&[("rack", "r2")]), &keys(&["gpu"]))
        .await
        .expect("update");
    assert!(interposing.read_hook_fired(), "the race was not staged");
    let expected = map(&[("rack", "r2"), ("written-between", "yes")]);
    assert_eq!(labels, expected);
    assert_eq!(
        Ipam::new(Arc::clone(&t.store))
            .node_labels("node-1")
            .await
            .expect("read"),
        expected
    );
}

async fn ipam_with_existing_labels(store: &Arc<dyn KvStore>) {
    Ipam::new(Arc::clone(store))
        .set_node_labels("node-1", &pairs(&[("rack", "r1"), ("gpu", "")]), &[])
        .await
        .expect("initial labels");
}

/// Listing returns every labelled node with its labels, sorted by host; unlabelled nodes (and
/// nodes whose labels were all removed) are not listed.
pub async fn listing_returns_only_labelled_nodes_sorted_by_host<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = fresh_ipam(factory).await;
    for (host, rack) in [("node-c", "r3"), ("node-a", "r1"), ("node-b", "r2")] {
        ipam.set_node_labels(host, &pairs(&[("rack", rack)]), &[])
            .await
            .expect("set");
    }
    ipam.set_node_labels("node-b", &[], &keys(&["rack"]))
        .await
        .expect("remove");
    // A host name that is a prefix of another is listed apart from it.
    ipam.set_node_labels("node-a1", &pairs(&[("rack", "r9")]), &[])
        .await
        .expect("set");
    assert_eq!(
        ipam.list_nodes_with_labels().await.expect("list"),
        vec![
            NodeLabels {
                host: "node-a".into(),
                labels: map(&[("rack", "r1")]),
            },
            NodeLabels {
                host: "node-a1".into(),
                labels: map(&[("rack", "r9")]),
            },
            NodeLabels {
                host: "node-c".into(),
                labels: map(&[("rack", "r3")]),
            },
        ]
    );
}

/// A damaged node object is an error naming its key, for reads and updates alike; an update
/// never writes over it.
pub async fn corrupt_node_object_is_reported_naming_its_key<F: StoreFactory>(factory: &F) {
    let (t, ipam) = fresh_ipam(factory).await;
    let key = node_key("node-1");
    t.store
        .put(
            &key,
            vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff, 0xff],
        )
        .await
        .expect("write damage");
    let corrupt = |result: Result<_, IpamError>| match result {
        Err(IpamError::Corrupt { key: named, .. }) => assert_eq!(named, key),
        other => panic!("expected a corrupt-object error naming {key}, got {other:?}"),
    };
    corrupt(ipam.node_labels("node-1").await);
    corrupt(
        ipam.set_node_labels("node-1", &pairs(&[("rack", "r1")]), &[])
            .await,
    );
    corrupt(ipam.list_nodes_with_labels().await.map(|_| BTreeMap::new()));
    let stored = t.store.get(&key).await.expect("read").expect("kept");
    assert_eq!(
        stored.value,
        vec![ipam_core::model::FORMAT_VERSION, 0xff, 0xff, 0xff]
    );

    // Listed one by one, the damaged object hides no other node; removed whole, it is gone.
    ipam.set_node_labels("node-2", &pairs(&[("rack", "r2")]), &[])
        .await
        .expect("label another node");
    let each = ipam.list_nodes_labels_each().await.expect("list each");
    assert_eq!(each.len(), 2, "{each:?}");
    assert_eq!(each[0].0, "node-1");
    corrupt(each[0].1.clone());
    assert_eq!(each[1], ("node-2".to_owned(), Ok(map(&[("rack", "r2")]))));
    assert!(ipam.remove_node_labels("node-1").await.expect("remove"));
    assert_eq!(t.store.get(&key).await.expect("read"), None);
    assert!(!ipam.remove_node_labels("node-1").await.expect("none left"));
    assert_eq!(
        ipam.list_nodes_with_labels().await.expect("list"),
        vec![NodeLabels {
            host: "node-2".into(),
            labels: map(&[("rack", "r2")])
        }]
    );
}

/// Labelling nodes changes no allocation, and the consistency check accepts node objects.
pub async fn node_labels_leave_allocations_and_the_check_untouched<F: StoreFactory>(factory: &F) {
    let (_t, ipam) = ipam_with_pool(factory, "10.60.0.0/24", 28).await;
    let first = assign_one(&ipam, "net.a", "node-1").await;
    let usage_before = ipam.utilization().await.expect("usage");
    ipam.set_node_labels("node-1", &pairs(&[("rack", "r1")]), &[])
        .await
        .expect("label an allocating node");
    ipam.set_node_labels("node-9", &pairs(&[("rack", "r9")]), &[])
        .await
        .expect("label a node with no blocks");
    assert_eq!(ipam.utilization().await.expect("usage"), usage_before);
    assert_clean(&ipam).await;
    let second = assign_one(&ipam, "net.b", "node-1").await;
    assert_ne!(first, second);
    assert_clean(&ipam).await;
}
