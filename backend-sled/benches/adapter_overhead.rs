//! What `SledStore` costs over raw sled: get, CAS update and a 2-key commit, each beside sled doing the same work.
//!
//! Run: `cargo bench -p backend-sled --bench adapter_overhead`. Each group has an `adapter` and a
//! `raw` entry measured in the same run, with throughput in operations per second. `raw` is sled's
//! own call plus `flush`; `raw_with_revision_counter` is the adapter's whole write done by hand
//! (revision counter, record header, `flush`, then `fdatasync` of the log as the adapter does).

use std::hint::black_box;
use std::time::{Duration, Instant};

use backend_sled::{SledConfig, SledStore};
use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use ipam_core::{KvStore, Op, Txn};
use sled::transaction::ConflictableTransactionError;
use sled::Transactional;
use tokio::runtime::Runtime;

const VALUE: [u8; 256] = [0x5A; 256];
const KEYS: usize = 1000;

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(1));
    group
}

fn key(i: usize) -> String {
    format!(
        "/calico/ipam/v2/assignment/ipv4/block/10.{}.{}.0-26",
        i / 256,
        i % 256
    )
}

fn bench(c: &mut Criterion) {
    let runtime = Runtime::new().expect("tokio runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let store = runtime
        .block_on(SledStore::open(
            SledConfig::new(dir.path().join("adapter")).creating(),
        ))
        .expect("open adapter store");
    let raw = sled::Config::new()
        .path(dir.path().join("raw"))
        .flush_every_ms(None)
        .open()
        .expect("open raw sled");
    let raw_tree = raw.open_tree("kv").expect("raw tree");
    let raw_meta = raw.open_tree("meta").expect("raw meta tree");
    let raw_log = std::fs::File::open(dir.path().join("raw").join("db")).expect("raw log file");
    for i in 0..KEYS {
        runtime
            .block_on(store.put(&key(i), VALUE.to_vec()))
            .expect("fill adapter");
        raw_tree.insert(key(i), &VALUE[..]).expect("fill raw");
        raw.flush().expect("flush raw");
    }

    let mut get = group(c, "sled/get");
    get.bench_function("adapter", |b| {
        let mut i = 0;
        b.to_async(&runtime).iter(|| {
            i = (i + 7) % KEYS;
            let store = &store;
            let k = key(i);
            async move { black_box(store.get(&k).await.expect("get")) }
        })
    });
    get.bench_function("raw", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 7) % KEYS;
            black_box(raw_tree.get(key(i)).expect("get"))
        })
    });
    get.finish();

    let mut update = group(c, "sled/cas_update");
    update.bench_function("adapter", |b| {
        b.to_async(&runtime).iter_custom(|iters| {
            let store = &store;
            async move {
                let mut revision = store.get("cas").await.expect("get").map(|kv| kv.revision);
                let started = Instant::now();
                for n in 0..iters {
                    let value = n.to_le_bytes().to_vec();
                    revision = Some(match revision {
                        None => store.create("cas", value).await.expect("create"),
                        Some(rev) => store.update("cas", rev, value).await.expect("update"),
                    });
                }
                started.elapsed()
            }
        })
    });
    update.bench_function("raw", |b| {
        b.iter_custom(|iters| {
            let mut current = raw_tree.get("cas").expect("get");
            let started = Instant::now();
            for n in 0..iters {
                let value = n.to_le_bytes();
                raw_tree
                    .compare_and_swap("cas", current.as_deref(), Some(&value[..]))
                    .expect("cas")
                    .expect("no concurrent writer");
                raw.flush().expect("flush");
                current = Some(value[..].into());
            }
            started.elapsed()
        })
    });
    update.finish();

    let mut commit = group(c, "sled/commit_2_keys");
    commit.bench_function("adapter", |b| {
        let mut i = 0;
        b.to_async(&runtime).iter(|| {
            i = (i + 2) % KEYS;
            let store = &store;
            let txn = Txn::new()
                .then(Op::put(key(i), VALUE.to_vec()))
                .then(Op::put(key(i + 1), VALUE.to_vec()));
            async move { black_box(store.commit(txn).await.expect("commit")) }
        })
    });
    commit.bench_function("raw", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 2) % KEYS;
            let (a, b) = (key(i), key(i + 1));
            raw_tree
                .transaction(|tree| {
                    tree.insert(a.as_bytes(), &VALUE[..])?;
                    tree.insert(b.as_bytes(), &VALUE[..])?;
                    Ok::<_, ConflictableTransactionError<()>>(())
                })
                .expect("transaction");
            raw.flush().expect("flush");
        })
    });
    // The adapter's work done by hand: read and bump a counter in a second tree within the same
    // transaction, prefix each value with the new revision, flush, then fdatasync the log (sled's
    // flush alone ends in sync_file_range).
    commit.bench_function("raw_with_revision_counter", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 2) % KEYS;
            let (a, b) = (key(i), key(i + 1));
            (&raw_tree, &raw_meta)
                .transaction(|(tree, meta)| {
                    let current = meta
                        .get("revision")?
                        .and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok())
                        .map_or(0, u64::from_be_bytes);
                    let next = (current + 1).to_be_bytes();
                    meta.insert("revision", &next)?;
                    let mut record = next.to_vec();
                    record.extend_from_slice(&VALUE);
                    tree.insert(a.as_bytes(), record.as_slice())?;
                    tree.insert(b.as_bytes(), record)?;
                    Ok::<_, ConflictableTransactionError<()>>(())
                })
                .expect("transaction");
            raw.flush().expect("flush");
            raw_log.sync_data().expect("fdatasync");
        })
    });
    commit.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
