//! The raw etcd ceiling: workers, each on its own etcd-client connection, each a loop of one-key
//! conditional `Txn` writes (create-if-absent, as the allocator claims a block), run on the same
//! cluster after the allocation run; every allocation is at least one such write, so its rate is
//! the physical limit the allocation rate is compared with. Its keys are deleted afterwards. A
//! shape with more puts or conditions per `Txn` ([`RawShape`]) measures what each costs etcd.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, DeleteOptions, Txn, TxnOp};
use serde::Serialize;
use tokio::sync::Barrier;
use tokio::task::JoinSet;

use crate::config::RawShape;
use crate::error::LoadError;
use crate::etcd_status::StatusClient;

/// Connections opened at once.
const CONNECTS_AT_ONCE: usize = 32;
/// How many error messages are kept.
const SAMPLES: usize = 10;

/// What the raw loop measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RawCeiling {
    /// When it ran, relative to the allocation run.
    pub when: &'static str,
    /// Workers, each with its own connection (`--concurrency`).
    pub workers: u32,
    /// Bytes of each value.
    pub value_bytes: usize,
    /// What each `Txn` holds beyond its one conditional put.
    pub shape: RawShape,
    /// Conditional writes committed.
    pub writes: u64,
    /// From the moment every worker was connected to the last one finishing.
    pub seconds: f64,
    /// `writes / seconds`.
    pub writes_per_second: f64,
    /// Writes that failed (transport errors, or a condition that did not hold).
    pub errors: u64,
    /// The first error messages.
    pub error_samples: Vec<String>,
    /// Keys deleted afterwards (should equal `writes` × (1 + extra puts), plus each worker's
    /// extra-condition keys).
    pub keys_deleted: i64,
    /// The CPU seconds etcd's members spent over the same span as `seconds`
    /// ([`crate::etcd_status::cpu_seconds`]); `None` when they could not be asked.
    pub etcd_cpu_seconds: Option<f64>,
    /// Why they could not.
    pub etcd_cpu_error: Option<String>,
}

/// One worker's loop: `raw-ceiling/<worker>/<n>` under `prefix`, each created only if absent,
/// with `shape`'s extra puts (`raw-ceiling/<worker>/<n>/<i>`) and conditions (its keys
/// `raw-ceiling/<worker>/tested/<i>`, put before the start, each tested present).
async fn worker(
    mut client: etcd_client::Client,
    prefix: String,
    worker: u32,
    shape: RawShape,
    start: Arc<Barrier>,
    duration: Duration,
) -> (u64, Vec<String>, u64) {
    let value = vec![b'x'; shape.value_bytes];
    let (mut writes, mut errors, mut samples) = (0_u64, 0_u64, Vec::new());
    let tested: Vec<String> = (0..shape.extra_conditions)
        .map(|i| format!("{prefix}raw-ceiling/{worker}/tested/{i}"))
        .collect();
    for key in &tested {
        if let Err(e) = client.put(key.clone(), value.clone(), None).await {
            errors += 1;
            samples.push(format!("{key}: {e}"));
        }
    }
    start.wait().await;
    let deadline = Instant::now() + duration;
    let mut n = 0_u64;
    while Instant::now() < deadline {
        let key = format!("{prefix}raw-ceiling/{worker}/{n}");
        n += 1;
        let conditions = std::iter::once(Compare::version(key.clone(), CompareOp::Equal, 0))
            .chain(
                tested
                    .iter()
                    .map(|tested| Compare::version(tested.clone(), CompareOp::Greater, 0)),
            )
            .collect::<Vec<_>>();
        let puts = std::iter::once(TxnOp::put(key.clone(), value.clone(), None))
            .chain(
                (0..shape.extra_puts)
                    .map(|i| TxnOp::put(format!("{key}/{i}"), value.clone(), None)),
            )
            .collect::<Vec<_>>();
        let txn = Txn::new().when(conditions).and_then(puts);
        let problem = match client.txn(txn).await {
            Ok(response) if response.succeeded() => {
                writes += 1;
                None
            }
            Ok(_) => Some(format!("{key}: the condition (absent) did not hold")),
            Err(e) => Some(format!("{key}: {e}")),
        };
        if let Some(problem) = problem {
            errors += 1;
            if samples.len() < SAMPLES {
                samples.push(problem);
            }
        }
    }
    (writes, samples, errors)
}

/// Runs `workers` loops of `shape` for `duration` against the cluster `client` names, under
/// `prefix` (the run's etcd prefix), then deletes every key written.
///
/// # Errors
/// [`LoadError::Failed`] when a connection cannot be made or the keys cannot be deleted.
pub async fn measure(
    client: &Arc<StatusClient>,
    prefix: &str,
    workers: u32,
    shape: RawShape,
    duration: Duration,
) -> Result<RawCeiling, LoadError> {
    let mut clients = Vec::with_capacity(workers as usize);
    let indices: Vec<u32> = (0..workers).collect();
    for chunk in indices.chunks(CONNECTS_AT_ONCE) {
        let mut connecting = JoinSet::new();
        for _ in chunk {
            let client = client.clone();
            connecting.spawn(async move { client.connect_cluster().await });
        }
        while let Some(joined) = connecting.join_next().await {
            let connected =
                joined.map_err(|e| LoadError::failed(format!("a connecting task failed: {e}")))?;
            clients
                .push(connected.map_err(|e| LoadError::failed(format!("raw etcd ceiling: {e}")))?);
        }
    }
    let start = Arc::new(Barrier::new(clients.len() + 1));
    let mut running = JoinSet::new();
    for (index, connection) in (0..).zip(clients) {
        running.spawn(worker(
            connection,
            prefix.to_owned(),
            index,
            shape,
            start.clone(),
            duration,
        ));
    }
    let cpu_before = client.cpu_seconds().await;
    start.wait().await;
    let began = Instant::now();
    let mut result = RawCeiling {
        when: "after the allocation run and its verification, on the same cluster",
        workers,
        value_bytes: shape.value_bytes,
        shape,
        ..RawCeiling::default()
    };
    while let Some(joined) = running.join_next().await {
        let (writes, samples, errors) = joined
            .map_err(|e| LoadError::failed(format!("a raw etcd ceiling worker failed: {e}")))?;
        result.writes += writes;
        result.errors += errors;
        for sample in samples {
            if result.error_samples.len() < SAMPLES {
                result.error_samples.push(sample);
            }
        }
    }
    result.seconds = began.elapsed().as_secs_f64();
    match (cpu_before, client.cpu_seconds().await) {
        (Ok(before), Ok(after)) => result.etcd_cpu_seconds = Some(after - before),
        (Err(e), _) | (_, Err(e)) => result.etcd_cpu_error = Some(e),
    }
    result.writes_per_second = if result.seconds > 0.0 {
        result.writes as f64 / result.seconds
    } else {
        0.0
    };
    let mut cleaner = client
        .connect_cluster()
        .await
        .map_err(|e| LoadError::failed(format!("raw etcd ceiling cleanup: {e}")))?;
    let deleted = cleaner
        .delete(
            format!("{prefix}raw-ceiling/"),
            Some(DeleteOptions::new().with_prefix()),
        )
        .await
        .map_err(|e| {
            LoadError::failed(format!(
                "raw etcd ceiling: cannot delete {prefix}raw-ceiling/: {e}"
            ))
        })?;
    result.keys_deleted = deleted.deleted();
    Ok(result)
}
