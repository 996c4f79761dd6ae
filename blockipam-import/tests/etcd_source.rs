//! The Calico etcd reader against a real etcd: every object under the prefix, however many pages
//! of 500 keys that takes (one request per page), all at one revision (the one it reports, or the
//! one asked for), nothing from a neighbouring prefix, and a revision compacted away refused as
//! such.

use std::collections::BTreeSet;

use blockipam_import::{CalicoEtcdSource, ImportError};
use test_kit::block_on;
use test_kit::calico::CalicoFixture;
use test_kit::etcd::{unique_prefix, EtcdServer, PrefixGuard};

/// A fixture of one pool, one node and `count` handles named `{stem}-NNNN`.
fn handles(stem: &str, count: usize) -> CalicoFixture {
    (0..count).fold(
        CalicoFixture::new()
            .pool("pods", "10.90.0.0/16", 26, serde_json::json!({}))
            .node("node-a", &[]),
        |fixture, n| fixture.handle(&format!("{stem}-{n:04}"), &[("10.90.0.0/26", 1)]),
    )
}

fn handle_ids(snapshot: &blockipam_import::CalicoSnapshot) -> BTreeSet<String> {
    snapshot.handles.iter().map(|(id, _)| id.clone()).collect()
}

#[test]
fn every_object_is_read_across_pages_at_one_revision() {
    let server = EtcdServer::shared();
    let root = unique_prefix();
    let _guard = PrefixGuard::new(server.config(&root));
    let endpoint = server.endpoint();
    let prefix = format!("{root}calico");
    // 1,201 handles: three pages of the IPAM directory.
    block_on(handles("first", 1_201).write_to_etcd(&endpoint, &prefix)).expect("write Calico");
    // A neighbouring Calico whose prefix starts with this one's.
    block_on(handles("neighbour", 3).write_to_etcd(&endpoint, &format!("{prefix}2")))
        .expect("write the neighbour");

    let mut source = CalicoEtcdSource::new([endpoint.clone()]);
    source.prefix = format!("{prefix}/");
    let ranges = || {
        server
            .grpc_requests_handled()
            .expect("etcd's request counters")
            .get("Range")
            .copied()
            .unwrap_or(0)
    };
    let ranges_before = ranges();
    let first = block_on(source.read(None)).expect("read Calico");
    // One request per page: the pools, three pages of IPAM objects, the (empty) reservations
    // and the nodes; no request after a last page.
    assert_eq!(ranges() - ranges_before, 6, "Range requests of one read");
    let expected: BTreeSet<String> = (0..1_201).map(|n| format!("first-{n:04}")).collect();
    assert_eq!(handle_ids(&first), expected);
    assert_eq!(first.handles.len(), 1_201, "no key read twice");
    assert_eq!(first.pools.len(), 1);
    assert!(
        first.revision > 0,
        "the revision read at: {}",
        first.revision
    );

    // Written later: not in a read at the first revision, in a read at the current one.
    block_on(handles("later", 10).write_to_etcd(&endpoint, &prefix)).expect("write more");
    let again = block_on(source.read(Some(first.revision))).expect("read at the first revision");
    assert_eq!(again.revision, first.revision);
    assert_eq!(handle_ids(&again), expected);
    let now = block_on(source.read(None)).expect("read now");
    assert!(now.revision > first.revision);
    assert_eq!(now.handles.len(), 1_211);

    // Once etcd has compacted the first revision away, reading at it is refused as such.
    block_on(async {
        let mut client = etcd_client::Client::connect([endpoint.as_str()], None)
            .await
            .expect("connect");
        client.compact(now.revision, None).await.expect("compact");
    });
    match block_on(source.read(Some(first.revision))) {
        Err(ImportError::Compacted(message)) => assert!(
            message.contains(&format!("revision {} was compacted", first.revision)),
            "{message}"
        ),
        other => panic!("expected a compacted revision, got {other:?}"),
    }
}
