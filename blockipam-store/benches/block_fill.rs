//! Block-fill benchmark: an ADD (and its release) in a block near full against one near empty, interleaved, on every backend.
//!
//! Each row is one backend and block size. Two hosts each own one block of a pool of two blocks:
//! one host's block holds every address but a few (each with the attributes the plugin records:
//! network, 64-hex container id, interface, timestamp, pod, namespace), the other's holds
//! nothing. Round by round, each host assigns one address and releases it, the order of the two
//! hosts alternating; the row reports each host's median assign and release and their ratio
//! (near full / near empty), and the stored size of each block.
//!
//! Run: `cargo bench -p blockipam-store --bench block_fill` (prints a markdown table).
//! `BLOCKIPAM_BENCH_ROUNDS` sets the rounds per row (default 100).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipam_core::allocator::leaks::Attachment;
use ipam_core::model::keys;
use ipam_core::{AutoAssignRequest, Ipam, KvStore, PoolSpec};

mod common;
use common::{BenchStores, KINDS};

/// The host whose block is kept near full.
const FULL_HOST: &str = "near-full";
/// The host whose block is kept near empty.
const EMPTY_HOST: &str = "near-empty";
/// Addresses left free in the near-full block.
const LEFT_FREE: u32 = 4;

/// What the plugin records with an address, for container number `n`.
fn plugin_attributes(n: usize) -> BTreeMap<String, String> {
    Attachment {
        network: "k8s-pod-network",
        container_id: &format!("{n:064x}"),
        interface: "eth0",
        namespace: Some("production-services"),
        pod: Some(&format!("workload-7d4b9c8f6-{n:05}")),
    }
    .attributes("2026-11-24T23:50:00Z")
}

/// An assign of one IPv4 address for container `n` on `host`.
fn request(host: &str, n: usize) -> AutoAssignRequest {
    AutoAssignRequest {
        handle: format!("k8s-pod-network.{n:064x}"),
        host: host.to_owned(),
        num_v4: 1,
        attributes: plugin_attributes(n),
        ..AutoAssignRequest::default()
    }
}

/// The stored bytes of `host`'s blocks (key and value), open or full.
async fn block_bytes(store: &Arc<dyn KvStore>, host: &str) -> usize {
    let mut bytes = 0;
    for dir in [
        keys::host_open_blocks_dir(host),
        keys::host_full_blocks_dir(host),
    ] {
        for kv in store.list(&dir).await.expect("list the host's blocks") {
            bytes += kv.key.len() + kv.value.len();
        }
    }
    bytes
}

/// The median of `samples`.
fn median(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// One row's medians: assign and release near empty, then near full.
struct Row {
    assign: [Duration; 2],
    release: [Duration; 2],
    bytes: [usize; 2],
}

/// Sets up the two blocks of `block_size` on `store` and runs `rounds` interleaved rounds.
async fn measure(store: Arc<dyn KvStore>, block_size: u8, rounds: usize) -> Row {
    let ipam = Ipam::new(Arc::clone(&store));
    // A pool of exactly two blocks.
    let pool = format!("10.0.0.0/{}", block_size - 1);
    ipam.create_pool(&PoolSpec {
        cidr: pool.parse().expect("pool CIDR"),
        name: Some("bench".into()),
        block_size: Some(block_size),
        disabled: false,
    })
    .await
    .expect("create pool");
    let capacity = 1u32 << (32 - u32::from(block_size));
    let mut n = 0;
    for host in [EMPTY_HOST, FULL_HOST] {
        // The first assign claims the host's block; the near-empty host gives it back.
        let filled = if host == FULL_HOST {
            capacity - LEFT_FREE
        } else {
            1
        };
        for _ in 0..filled {
            n += 1;
            ipam.auto_assign(&request(host, n))
                .await
                .unwrap_or_else(|e| panic!("filling {host}'s block: {e}"));
        }
        if host == EMPTY_HOST {
            ipam.release_handle(&request(host, n).handle)
                .await
                .expect("release");
        }
    }
    let mut assign: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    let mut release: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for which in order {
            let host = [EMPTY_HOST, FULL_HOST][which];
            n += 1;
            let wanted = request(host, n);
            let started = Instant::now();
            let got = ipam.auto_assign(&wanted).await.expect("assign");
            assign[which].push(started.elapsed());
            assert_eq!(got.v4.len(), 1, "one address assigned on {host}");
            let started = Instant::now();
            ipam.release_handle(&wanted.handle).await.expect("release");
            release[which].push(started.elapsed());
        }
    }
    Row {
        assign: [median(&mut assign[0]), median(&mut assign[1])],
        release: [median(&mut release[0]), median(&mut release[1])],
        bytes: [
            block_bytes(&store, EMPTY_HOST).await,
            block_bytes(&store, FULL_HOST).await,
        ],
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; accept and ignore harness arguments.
    let rounds: usize = std::env::var("BLOCKIPAM_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let mut stores = BenchStores::start();
    println!(
        "| backend | block | assign near empty / near full, ms | ratio | release near empty / near full, ms | ratio | block bytes near empty / near full |"
    );
    println!("|---|---|---|---|---|---|---|");
    for block_size in [26u8, 23] {
        for kind in KINDS {
            let store = stores.open(kind).await;
            let row = measure(store, block_size, rounds).await;
            let ratio = |pair: [Duration; 2]| pair[1].as_secs_f64() / pair[0].as_secs_f64();
            println!(
                "| {kind} | /{block_size} | {} / {} | {:.2} | {} / {} | {:.2} | {} / {} |",
                ms(row.assign[0]),
                ms(row.assign[1]),
                ratio(row.assign),
                ms(row.release[0]),
                ms(row.release[1]),
                ratio(row.release),
                row.bytes[0],
                row.bytes[1],
            );
        }
    }
}
