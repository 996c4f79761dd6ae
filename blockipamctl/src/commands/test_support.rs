//! What the commands' unit tests start from: an in-memory store with a pool and pods on a node.

use std::sync::Arc;

use ipam_core::{AutoAssignRequest, Ipam, KvStore, MemoryStore, PoolSpec};

/// An in-memory store with the pool 10.0.0.0/16 (blocks of /26) and one address for each of
/// `net.a` and `net.b` on `node-a`.
pub(crate) async fn two_pods_on_node_a() -> (Arc<dyn KvStore>, Ipam) {
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let ipam = Ipam::new(Arc::clone(&store));
    ipam.create_pool(&PoolSpec {
        cidr: "10.0.0.0/16".parse().expect("a cidr"),
        name: Some("pool".into()),
        block_size: Some(26),
        disabled: false,
    })
    .await
    .expect("a pool");
    for pod in ["net.a", "net.b"] {
        ipam.auto_assign(&AutoAssignRequest {
            handle: pod.into(),
            host: "node-a".into(),
            num_v4: 1,
            ..AutoAssignRequest::default()
        })
        .await
        .expect("an address");
    }
    (store, ipam)
}
