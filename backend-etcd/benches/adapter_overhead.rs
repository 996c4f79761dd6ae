//! Adapter overhead: `EtcdStore` get, compare-and-swap update and 2-key commit, each beside raw
//! etcd-client doing the same work in the same run, against one bench-started etcd on loopback.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use backend_etcd::EtcdStore;
use criterion::{criterion_group, criterion_main, Criterion};
use etcd_client::{Client, Compare, CompareOp, TxnOp};
use ipam_core::{KvStore, Op, Revision, Txn};
use test_kit::etcd::EtcdServer;

const PREFIX: &str = "/bench/";
const VALUE: [u8; 64] = [7; 64];

fn adapter_overhead(c: &mut Criterion) {
    let server = EtcdServer::start().unwrap_or_else(|e| panic!("cannot start etcd: {e}"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (store, raw, adapter_rev, raw_rev) = runtime.block_on(async {
        let store = EtcdStore::connect(server.config(PREFIX))
            .await
            .expect("connect the adapter");
        let raw = Client::connect([server.endpoint()], None)
            .await
            .expect("connect raw etcd-client");
        store.put("get", VALUE.to_vec()).await.expect("seed get");
        let adapter_rev = store
            .put("cas-adapter", VALUE.to_vec())
            .await
            .expect("seed");
        let raw_rev = store.put("cas-raw", VALUE.to_vec()).await.expect("seed");
        (store, raw, adapter_rev, raw_rev)
    });
    let adapter_rev = AtomicI64::new(adapter_rev.get() as i64);
    let raw_rev = AtomicI64::new(raw_rev.get() as i64);

    let mut group = c.benchmark_group("etcd_get");
    group.bench_function("adapter", |b| {
        b.to_async(&runtime)
            .iter(|| async { store.get("get").await.expect("get") })
    });
    group.bench_function("raw", |b| {
        b.to_async(&runtime).iter(|| {
            let mut kv = raw.kv_client();
            async move { kv.get("/bench/get", None).await.expect("get") }
        })
    });
    group.finish();

    let mut group = c.benchmark_group("etcd_cas_update");
    group.bench_function("adapter", |b| {
        b.to_async(&runtime).iter(|| async {
            let current = Revision(adapter_rev.load(Ordering::Relaxed) as u64);
            let next = store
                .update("cas-adapter", current, VALUE.to_vec())
                .await
                .expect("update");
            adapter_rev.store(next.get() as i64, Ordering::Relaxed);
        })
    });
    group.bench_function("raw", |b| {
        b.to_async(&runtime).iter(|| {
            let mut kv = raw.kv_client();
            let raw_rev = &raw_rev;
            async move {
                let key = "/bench/cas-raw";
                let txn = etcd_client::Txn::new()
                    .when([Compare::mod_revision(
                        key,
                        CompareOp::Equal,
                        raw_rev.load(Ordering::Relaxed),
                    )])
                    .and_then([TxnOp::put(key, VALUE.to_vec(), None)]);
                let response = kv.txn(txn).await.expect("txn");
                assert!(response.succeeded(), "raw CAS lost its revision");
                let revision = response.header().map(|h| h.revision()).unwrap_or(0);
                raw_rev.store(revision, Ordering::Relaxed);
            }
        })
    });
    group.finish();

    let mut group = c.benchmark_group("etcd_commit_2_keys");
    group.bench_function("adapter", |b| {
        b.to_async(&runtime).iter(|| async {
            store
                .commit(
                    Txn::new()
                        .then(Op::put("pair/a", VALUE.to_vec()))
                        .then(Op::put("pair/b", VALUE.to_vec())),
                )
                .await
                .expect("commit")
        })
    });
    group.bench_function("raw", |b| {
        b.to_async(&runtime).iter(|| {
            let mut kv = raw.kv_client();
            async move {
                let txn = etcd_client::Txn::new().and_then([
                    TxnOp::put("/bench/raw-pair/a", VALUE.to_vec(), None),
                    TxnOp::put("/bench/raw-pair/b", VALUE.to_vec(), None),
                ]);
                kv.txn(txn).await.expect("txn")
            }
        })
    });
    group.finish();

    drop(store);
    drop(raw);
    drop(runtime);
    drop(server);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = adapter_overhead
}
criterion_main!(benches);
