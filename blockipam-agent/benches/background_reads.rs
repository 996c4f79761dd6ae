//! What the agent's background work reads from the store as the store grows: one reclaimer pass, one metrics scrape, and one leak look (an agent's first, which surveys the store, and a steady one), beside the bytes of every block value the store holds.
//!
//! The store is made the plugin's way on the in-memory store (one address per pod, with the
//! attributes the plugin records: 64-hex container id, pod, namespace, interface, timestamp),
//! 110 pods per node, each node registered as a live agent. Keys and bytes read do not depend on
//! the machine or the backend (each backend returns the same keys and values), so the figures
//! are exact; the time column is only a hint.
//!
//! Run: `cargo bench -p blockipam-agent --bench background_reads` (10,000 blocks; about 5,000
//! nodes). `BLOCKIPAM_BENCH_BLOCKS` sets the number of blocks (two per node).

use std::sync::Arc;
use std::time::{Duration, Instant};

use blockipam_agent::metrics::IpamSnapshot;
use conformance::read_cost::{container_id, pod_add, ReadCost, ReadMeter};
use ipam_core::allocator::leaks::{LeakPolicy, LeakWatch, LiveSandbox, RuntimeView};
use ipam_core::allocator::{EmptyBlockFilter, ATTR_NODE};
use ipam_core::dead_nodes::{liveness_key, reclaim_pass, register, NoCountdowns, ReclaimOptions};
use ipam_core::model::keys;
use ipam_core::{Ipam, KvStore, MemoryStore, PoolSpec};

/// Pods per node: Kubernetes' default limit, two /26 blocks.
const PODS_PER_NODE: u32 = 110;
const BLOCKS_PER_NODE: u32 = 2;

fn blocks_wanted() -> u32 {
    std::env::var("BLOCKIPAM_BENCH_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

fn node(n: u32) -> String {
    format!("node-{n:05}")
}

/// One measured call: what it read and how long it took.
struct Row {
    what: &'static str,
    cost: ReadCost,
    took: Duration,
}

async fn measure<F, T>(meter: &ReadMeter, what: &'static str, call: F) -> (Row, T)
where
    F: std::future::Future<Output = T>,
{
    meter.take();
    let started = Instant::now();
    let out = call.await;
    let took = started.elapsed();
    (
        Row {
            what,
            cost: meter.take(),
            took,
        },
        out,
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let blocks = blocks_wanted();
    let nodes = (blocks / BLOCKS_PER_NODE).max(1);
    let store: Arc<dyn KvStore> = Arc::new(MemoryStore::new());
    let maker = Ipam::new(Arc::clone(&store));
    maker
        .create_pool(&PoolSpec {
            cidr: "10.0.0.0/8".parse().expect("cidr"),
            name: Some("pods".into()),
            block_size: Some(26),
            disabled: false,
        })
        .await
        .expect("create pool");
    let made = Instant::now();
    for n in 0..nodes {
        let host = node(n);
        for pod in 0..PODS_PER_NODE {
            maker
                .auto_assign(&pod_add(&host, pod))
                .await
                .unwrap_or_else(|e| panic!("ADD of pod {pod} on {host}: {e}"));
        }
        register(store.as_ref(), &host, "bench", 1_800_000_000)
            .await
            .expect("register");
        store
            .put(&liveness_key(&host), host.clone().into_bytes())
            .await
            .expect("liveness");
    }
    let stored = store.list(&keys::blocks_dir()).await.expect("list blocks");
    let block_bytes: u64 = stored
        .iter()
        .map(|kv| (kv.key.len() + kv.value.len()) as u64)
        .sum();
    println!(
        "store: {nodes} nodes x {PODS_PER_NODE} pods, {} blocks, {} bytes of block keys and \
         values (made in {:.1} s)\n",
        stored.len(),
        block_bytes,
        made.elapsed().as_secs_f64()
    );

    let meter = ReadMeter::new(Arc::clone(&store));
    let metered: Arc<dyn KvStore> = meter.clone();
    let ipam = Ipam::new(Arc::clone(&metered));
    let mut rows = Vec::new();

    let (row, outcomes) = measure(&meter, "reclaimer pass: dead-node survey", async {
        reclaim_pass(
            Arc::clone(&metered),
            &NoCountdowns,
            &ReclaimOptions::default(),
        )
        .await
        .expect("reclaim pass")
    })
    .await;
    assert_eq!(outcomes.len() as u32, nodes, "every node surveyed");
    rows.push(row);
    let (row, _) = measure(&meter, "reclaimer pass: empty-block release", async {
        ipam.release_empty_blocks(
            EmptyBlockFilter {
                older_than_seconds: 60,
                only_unselected: false,
            },
            true,
        )
        .await
        .expect("empty-block release")
    })
    .await;
    rows.push(row);
    let (row, snapshot) = measure(&meter, "metrics scrape (ipam_* gauges)", async {
        IpamSnapshot::compute(Arc::clone(&metered))
            .await
            .expect("gauges")
    })
    .await;
    assert!(!snapshot.in_use.is_empty());
    rows.push(row);

    // The leak look of node 0: every pod runs but the last.
    let host = node(0);
    let allocations = maker.list_allocations().await.expect("list");
    let view = |at| RuntimeView {
        observed_at: at,
        sandboxes: allocations
            .iter()
            .filter(|a| a.attributes.get(ATTR_NODE) == Some(&host))
            .filter(|a| {
                a.attributes.get("container_id") != Some(&container_id(&host, PODS_PER_NODE - 1))
            })
            .map(|a| {
                (
                    a.attributes["container_id"].clone(),
                    LiveSandbox {
                        pod: "pod".into(),
                        namespace: "ns".into(),
                        uid: "uid".into(),
                        addresses: vec![a.ip],
                    },
                )
            })
            .collect(),
    };
    let policy = LeakPolicy {
        grace_seconds: 900,
        max_gap_seconds: 180,
    };
    let (first_view, steady_view) = (view(1_800_000_000), view(1_800_000_060));
    let mut watch = LeakWatch::new();
    let (row, first) = measure(&meter, "leak look: an agent's first (survey)", async {
        ipam.look_for_leaks(&host, &first_view, &mut watch, policy)
            .await
            .expect("look")
    })
    .await;
    assert_eq!(first.waiting.len(), 1);
    rows.push(row);
    let (row, steady) = measure(&meter, "leak look: steady", async {
        ipam.look_for_leaks(&host, &steady_view, &mut watch, policy)
            .await
            .expect("look")
    })
    .await;
    assert_eq!(steady.waiting.len(), 1);
    assert!(!watch.last_look_surveyed());
    rows.push(row);

    println!("| what | reads | keys read | bytes read | of the block bytes | time |");
    println!("|---|---|---|---|---|---|");
    for row in rows {
        println!(
            "| {} | {} | {} | {} | {:.4} | {:.1} ms |",
            row.what,
            row.cost.round_trips,
            row.cost.keys,
            row.cost.bytes,
            row.cost.bytes as f64 / block_bytes.max(1) as f64,
            row.took.as_secs_f64() * 1e3
        );
    }
}
