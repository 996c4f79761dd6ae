//! Allocator benchmark: auto-assign + release pairs per second and store round trips per assign, on
//! every backend, beside the in-memory reference store measured in the same run.
//!
//! Run: `cargo bench -p blockipam-store --bench allocator` (prints a markdown table).
//! `BLOCKIPAM_BENCH_PAIRS` sets the pairs per backend and mode (default 400).

use std::sync::Arc;
use std::time::Instant;

use ipam_core::{
    AutoAssignRequest, CountingStore, Ipam, IpamConfig, KvStore, PoolSpec, RoundTrips,
};

mod common;
use common::{BenchStores, KINDS};

const HOSTS: usize = 8;

fn request(handle: String, host: String) -> AutoAssignRequest {
    AutoAssignRequest {
        handle,
        host,
        num_v4: 1,
        ..AutoAssignRequest::default()
    }
}

async fn pool(ipam: &Ipam, cidr: &str, block_size: u8) {
    ipam.create_pool(&PoolSpec {
        cidr: cidr.parse().expect("cidr"),
        name: Some("bench".into()),
        block_size: Some(block_size),
        disabled: false,
    })
    .await
    .expect("create pool");
}

/// Pairs per second for `hosts` concurrent hosts doing `pairs` assign+release pairs in total.
async fn throughput(store: Arc<dyn KvStore>, hosts: usize, pairs: usize) -> f64 {
    let ipam = Ipam::new(store);
    pool(&ipam, "10.0.0.0/16", 26).await;
    // Warm up: every host claims its block first.
    for h in 0..hosts {
        let handle = format!("warm-{h}");
        ipam.auto_assign(&request(handle.clone(), format!("node-{h}")))
            .await
            .expect("warm");
        ipam.release_handle(&handle).await.expect("release");
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for h in 0..hosts {
        let ipam = ipam.clone();
        let per_host = pairs / hosts;
        tasks.push(tokio::spawn(async move {
            for i in 0..per_host {
                let handle = format!("c-{h}-{i}");
                ipam.auto_assign(&request(handle.clone(), format!("node-{h}")))
                    .await
                    .expect("assign");
                ipam.release_handle(&handle).await.expect("release");
            }
        }));
    }
    for task in tasks {
        task.await.expect("bench task");
    }
    let elapsed = started.elapsed().as_secs_f64();
    ((pairs / hosts) * hosts) as f64 / elapsed
}

/// Round trips of one auto-assign in the steady state, when a new block must be claimed, and when
/// it must borrow.
async fn round_trips(store: Arc<dyn KvStore>) -> (RoundTrips, RoundTrips, RoundTrips) {
    let counting = Arc::new(CountingStore::new(store));
    let ipam = Ipam::new(counting.clone());
    pool(&ipam, "10.1.0.0/28", 30).await; // 4 blocks of 4 addresses
    ipam.auto_assign(&request("first".into(), "node-a".into()))
        .await
        .expect("claim");
    counting.take();
    ipam.auto_assign(&request("steady".into(), "node-a".into()))
        .await
        .expect("steady");
    let steady = counting.take();
    for i in 0..2 {
        ipam.auto_assign(&request(format!("fill{i}"), "node-a".into()))
            .await
            .expect("fill");
    }
    counting.take();
    ipam.auto_assign(&request("new-block".into(), "node-a".into()))
        .await
        .expect("new block");
    let new_block = counting.take();
    ipam.set_config(&IpamConfig {
        max_blocks_per_host: 0,
        ..IpamConfig::default()
    })
    .await
    .expect("config");
    // Claim the remaining blocks for node-b, then node-c must borrow.
    ipam.claim_affinity("node-b", "10.1.0.0/28".parse().expect("cidr"))
        .await
        .ok();
    for cidr in ["10.1.0.0/30", "10.1.0.4/30", "10.1.0.8/30", "10.1.0.12/30"] {
        ipam.claim_affinity("node-b", cidr.parse().expect("cidr"))
            .await
            .ok();
    }
    counting.take();
    ipam.auto_assign(&request("borrow".into(), "node-c".into()))
        .await
        .expect("borrow");
    let borrow = counting.take();
    (steady, new_block, borrow)
}

fn trips(t: RoundTrips) -> String {
    format!("{} ({}r+{}w)", t.total(), t.reads, t.commits)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; accept and ignore harness arguments.
    let pairs: usize = std::env::var("BLOCKIPAM_BENCH_PAIRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let mut stores = BenchStores::start();
    println!("| backend | 1 host pairs/s | vs memory | {HOSTS} hosts pairs/s | vs memory | round trips: steady | new block | borrow |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut baseline = (0.0, 0.0);
    for kind in KINDS {
        let single = throughput(stores.open(kind).await, 1, pairs).await;
        let parallel = throughput(stores.open(kind).await, HOSTS, pairs).await;
        let (steady, new_block, borrow) = round_trips(stores.open(kind).await).await;
        if kind == "memory" {
            baseline = (single, parallel);
        }
        println!(
            "| {kind} | {single:.0} | {:.4} | {parallel:.0} | {:.4} | {} | {} | {} |",
            single / baseline.0,
            parallel / baseline.1,
            trips(steady),
            trips(new_block),
            trips(borrow)
        );
    }
}
