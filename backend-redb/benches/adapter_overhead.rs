//! What `RedbStore` costs over raw redb: get, CAS update and a 2-key commit, each beside redb doing the same work.
//!
//! Run: `cargo bench -p backend-redb --bench adapter_overhead`. Each group has an `adapter` and a
//! `raw` entry measured in the same run, with throughput in operations per second. Writes on both
//! sides commit with `Durability::Immediate` before they count.

use std::hint::black_box;
use std::time::{Duration, Instant};

use backend_redb::{RedbConfig, RedbStore};
use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use ipam_core::{KvStore, Op, Txn};
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::runtime::Runtime;

const VALUE: [u8; 256] = [0x5A; 256];
const KEYS: usize = 1000;
const RAW: TableDefinition<&str, &[u8]> = TableDefinition::new("kv");
const RAW_META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

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

/// One durable raw write transaction putting `puts`; with `counter`, it also does the adapter's
/// whole write by hand: read and bump a revision counter, prefix each value with it, and commit in
/// two phases (the pages synced before the header naming them), as the adapter commits.
fn raw_write(db: &Database, puts: &[(&str, &[u8])], counter: bool) {
    let mut write = db.begin_write().expect("begin write");
    write
        .set_durability(Durability::Immediate)
        .expect("durability");
    write.set_two_phase_commit(counter);
    {
        let mut table = write.open_table(RAW).expect("table");
        if counter {
            let mut meta = write.open_table(RAW_META).expect("meta");
            let current = meta
                .get("revision")
                .expect("get")
                .and_then(|v| <[u8; 8]>::try_from(v.value()).ok())
                .map_or(0, u64::from_be_bytes);
            let next = (current + 1).to_be_bytes();
            meta.insert("revision", &next[..]).expect("insert");
            for (k, v) in puts {
                let mut record = next.to_vec();
                record.extend_from_slice(v);
                table.insert(*k, record.as_slice()).expect("insert");
            }
        } else {
            for (k, v) in puts {
                table.insert(*k, *v).expect("insert");
            }
        }
    }
    write.commit().expect("commit");
}

fn bench(c: &mut Criterion) {
    let runtime = Runtime::new().expect("tokio runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let store = runtime
        .block_on(RedbStore::open(
            RedbConfig::new(dir.path().join("adapter")).creating(),
        ))
        .expect("open adapter store");
    let raw = Database::create(dir.path().join("raw")).expect("open raw redb");
    for i in 0..KEYS {
        runtime
            .block_on(store.put(&key(i), VALUE.to_vec()))
            .expect("fill adapter");
        raw_write(&raw, &[(&key(i), &VALUE[..])], false);
    }

    let mut get = group(c, "redb/get");
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
            let read = raw.begin_read().expect("begin read");
            let table = read.open_table(RAW).expect("table");
            let value = table
                .get(key(i).as_str())
                .expect("get")
                .map(|v| v.value().to_vec());
            black_box(value)
        })
    });
    get.finish();

    let mut update = group(c, "redb/cas_update");
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
            let started = Instant::now();
            for n in 0..iters {
                // Compare and swap by hand: read the current value in the write transaction,
                // then replace it.
                let mut write = raw.begin_write().expect("begin write");
                write
                    .set_durability(Durability::Immediate)
                    .expect("durability");
                {
                    let mut table = write.open_table(RAW).expect("table");
                    let current = table.get("cas").expect("get").map(|v| v.value().to_vec());
                    black_box(current);
                    table.insert("cas", &n.to_le_bytes()[..]).expect("insert");
                }
                write.commit().expect("commit");
            }
            started.elapsed()
        })
    });
    update.finish();

    let mut commit = group(c, "redb/commit_2_keys");
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
            raw_write(&raw, &[(&a, &VALUE[..]), (&b, &VALUE[..])], false);
        })
    });
    commit.bench_function("raw_with_revision_counter", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 2) % KEYS;
            let (a, b) = (key(i), key(i + 1));
            raw_write(&raw, &[(&a, &VALUE[..]), (&b, &VALUE[..])], true);
        })
    });
    commit.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
