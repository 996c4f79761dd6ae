//! One run from start to report: open and prepare the store, give every simulated node its way to
//! it, dispatch the nodes' operations (at most `concurrency` in flight, each from another node,
//! the next node drawn from the seeded stream), then check the store and compare it with what the
//! pods believe.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blockipam_store::{Backend, DatastoreSettings};
use ipam_core::{Ipam, KvStore, PoolSpec};
use tokio::task::JoinSet;

use crate::config::{LoadConfig, Mode, StopRule};
use crate::driver::api::ApiNode;
use crate::driver::plugin::{PluginNode, PluginRunner};
use crate::driver::NodeDriver;
use crate::error::LoadError;
use crate::etcd_status::{MemberStatus, StatusClient};
use crate::ledger::Ledger;
use crate::report::{
    CheckSummary, EtcdCpu, EtcdSample, EtcdSizes, PoolState, Report, ERROR_SAMPLES,
};
use crate::rng::SplitMix64;
use crate::schedule::{NodeSchedule, OpKind, PlannedOp, Step};
use crate::stats::{OpSample, Stats};
use crate::verify;
use crate::{prefill, raw_ceiling};

/// How often the progress callback is called.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);
/// etcd connections opened at once when every node gets its own.
const CONNECTS_AT_ONCE: usize = 32;

/// Which store the run uses.
#[derive(Debug, Clone)]
pub enum StoreTarget {
    /// The store these settings select. An embedded store without a path is a new temporary one
    /// (removed after the run); a missing embedded store is created; etcd without a prefix gets
    /// a new prefix of its own (`/blockipam-load/<network>-<seed>-<time>-<pid>/`, kept after the
    /// run so that it can be inspected).
    Settings(Box<DatastoreSettings>),
    /// An open store that every node shares (api mode only; for tests).
    Shared(Arc<dyn KvStore>),
}

impl From<DatastoreSettings> for StoreTarget {
    fn from(settings: DatastoreSettings) -> Self {
        StoreTarget::Settings(Box::new(settings))
    }
}

/// Every node's way to the store.
struct Drivers {
    /// One per node, in node order.
    nodes: Vec<NodeDriver>,
    /// How the nodes reach the store, for the report.
    description: String,
    /// The store to verify with afterwards; `None`: reopen it (the plugin needed it closed).
    keep_store: Option<Arc<dyn KvStore>>,
}

/// Where a run is, for a progress display.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Operations finished.
    pub finished: u64,
    /// Operations failed.
    pub errors: u64,
    /// Operations the run will make, when known in advance.
    pub planned: Option<u64>,
    /// Time since the first operation.
    pub elapsed: Duration,
    /// The run's length, for a duration-bound run.
    pub duration: Option<Duration>,
    /// True for the last call.
    pub done: bool,
}

/// What dispatching measured.
struct Dispatched {
    stats: Stats,
    elapsed: Duration,
    error_samples: Vec<String>,
    ledger: Ledger,
    schedules: Vec<NodeSchedule>,
    samples: Vec<EtcdSample>,
}

/// A node between operations.
struct SimNode {
    schedule: NodeSchedule,
    driver: NodeDriver,
}

/// A node back from an operation: the operation, what it returned, what it measured.
struct Finished {
    node: SimNode,
    op: PlannedOp,
    result: Result<Vec<IpAddr>, String>,
    sample: OpSample,
}

/// Runs the load `config` describes against `target`, calling `progress` about four times a
/// second and once at the end.
///
/// # Errors
/// [`LoadError::Usage`] for bad parameters; [`LoadError::Failed`] when the store, the plugin or
/// etcd cannot be set up or read back. Problems the run finds (errors of operations, duplicates,
/// a failed check) are in the [`Report`], which then has `passed == false`.
pub async fn run(
    config: &LoadConfig,
    target: StoreTarget,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Report, LoadError> {
    config.validate()?;
    let on_etcd = matches!(&target, StoreTarget::Settings(s) if s.etcd().is_some());
    if config.raw_etcd_ceiling.is_some() && !on_etcd {
        return Err(LoadError::usage(
            "--raw-etcd-ceiling-seconds needs an etcd store (--datastore-type etcdv3)",
        ));
    }
    let (settings, store, temporary_store_dir) = open_target(config, target).await?;
    let store_description = settings
        .as_ref()
        .map(DatastoreSettings::describe)
        .unwrap_or_else(|| "a store handed in by the caller".to_owned());
    prepare_store(&Ipam::new(store.clone()), config).await?;
    let prefilled = if config.prefill > 0 {
        Some(prefill::prefill(&Ipam::new(store.clone()), config).await?)
    } else {
        None
    };

    let status_client = match settings.as_ref().and_then(DatastoreSettings::etcd) {
        Some(etcd) => Some(Arc::new(
            StatusClient::new(&etcd.config().map_err(|e| LoadError::usage(e.to_string()))?)
                .map_err(LoadError::failed)?,
        )),
        _ => None,
    };
    let mut etcd = EtcdSizes::default();
    if let Some(client) = &status_client {
        etcd.before = client.members().await;
    }

    let lock_dir = tempfile::Builder::new()
        .prefix("blockipam-load-locks-")
        .tempdir()
        .map_err(|e| LoadError::failed(format!("cannot create a temporary directory: {e}")))?;
    let drivers = build_drivers(config, settings.as_ref(), store, lock_dir.path()).await?;
    let store_clients = drivers.description;

    let cpu_before = match &status_client {
        Some(client) if config.raw_etcd_ceiling.is_some() => Some(client.cpu_seconds().await),
        _ => None,
    };
    let dispatched = dispatch(config, drivers.nodes, status_client.clone(), progress).await?;
    let run_cpu = match (cpu_before, &status_client) {
        (Some(before), Some(client)) => Some(match (before, client.cpu_seconds().await) {
            (Ok(before), Ok(after)) => Ok(after - before),
            (Err(e), _) | (_, Err(e)) => Err(e),
        }),
        _ => None,
    };

    let verify_store = match drivers.keep_store {
        Some(store) => store,
        None => {
            let settings = settings
                .as_ref()
                .ok_or_else(|| LoadError::failed("no store settings to reopen the store with"))?;
            open(settings).await?
        }
    };
    let ipam = Ipam::new(verify_store);
    let check = ipam
        .check(false)
        .await
        .map_err(|e| LoadError::failed(format!("the final check could not run: {e}")))?;
    let allocations = ipam
        .list_allocations()
        .await
        .map_err(|e| LoadError::failed(format!("cannot list the allocations: {e}")))?;
    let mut believed: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    let mut uncertain = BTreeSet::new();
    for schedule in &dispatched.schedules {
        for pod in schedule.held() {
            believed.insert(config.handle(&pod.container), pod.ips.clone());
        }
        for container in schedule.uncertain() {
            uncertain.insert(config.handle(container));
        }
    }
    let verification = verify::compare(
        &believed,
        &uncertain,
        &allocations,
        &format!("{}.", config.network),
    );
    let prefill = prefilled.as_ref().map(|p| prefill::verify(p, &allocations));
    let pool = pool_state(&ipam, config).await?;
    drop(ipam);

    let mut raw_ceiling = None;
    let etcd = match &status_client {
        Some(client) => {
            etcd.during = dispatched.samples;
            etcd.after = client.members().await;
            if let Some(duration) = config.raw_etcd_ceiling {
                let prefix = settings
                    .as_ref()
                    .and_then(|s| s.etcd().and_then(|etcd| etcd.prefix.clone()))
                    .unwrap_or_default();
                raw_ceiling = Some(
                    raw_ceiling::measure(
                        client,
                        &prefix,
                        config.concurrency,
                        config.raw_etcd_shape,
                        duration,
                    )
                    .await?,
                );
            }
            if config.compact_at_end {
                match client.compact(&etcd.after).await {
                    Ok(revision) => {
                        etcd.compacted_to_revision = Some(revision);
                        etcd.after_compaction = client.members().await;
                    }
                    Err(e) => etcd.compaction_error = Some(e),
                }
            }
            Some(etcd)
        }
        None => None,
    };
    drop(temporary_store_dir);

    let operations = dispatched.stats.finished();
    let elapsed = dispatched.elapsed.as_secs_f64();
    let mut report = Report {
        config: config.clone(),
        store: store_description,
        store_clients,
        elapsed_seconds: elapsed,
        operations,
        operations_per_second: if elapsed > 0.0 {
            operations as f64 / elapsed
        } else {
            0.0
        },
        kinds: dispatched.stats.summarize(),
        errors: dispatched.stats.errors(),
        error_samples: dispatched.error_samples,
        duplicates_during_run: dispatched.ledger.duplicates().len() as u64,
        duplicate_samples: dispatched
            .ledger
            .duplicates()
            .iter()
            .take(ERROR_SAMPLES)
            .cloned()
            .collect(),
        verification,
        check: CheckSummary {
            clean: check.problems.is_empty(),
            report: check,
        },
        pool,
        etcd,
        prefill,
        allocation_to_raw_ratio: raw_ceiling
            .as_ref()
            .filter(|raw: &&raw_ceiling::RawCeiling| raw.writes_per_second > 0.0)
            .map(|raw| {
                if elapsed > 0.0 {
                    operations as f64 / elapsed / raw.writes_per_second
                } else {
                    0.0
                }
            }),
        etcd_cpu: raw_ceiling
            .as_ref()
            .zip(run_cpu)
            .map(|(raw, run_cpu)| EtcdCpu::new(run_cpu, operations, raw)),
        raw_ceiling,
        passed: false,
    };
    report.passed = report.compute_passed();
    Ok(report)
}

/// The store `target` names, opened: an embedded store without a path becomes a new temporary
/// one (the returned directory, removed when dropped), etcd without a prefix gets a prefix of its
/// own, a missing store is created.
///
/// # Errors
/// [`LoadError::Usage`] for plugin mode over a shared store; [`LoadError::Failed`] when the store
/// cannot be opened.
pub(crate) async fn open_target(
    config: &LoadConfig,
    target: StoreTarget,
) -> Result<
    (
        Option<DatastoreSettings>,
        Arc<dyn KvStore>,
        Option<tempfile::TempDir>,
    ),
    LoadError,
> {
    let mut temporary_store_dir = None;
    let (settings, store) = match target {
        StoreTarget::Shared(store) => {
            if config.mode == Mode::Plugin {
                return Err(LoadError::usage(
                    "plugin mode needs store settings (the plugin opens the store itself)",
                ));
            }
            (None, store)
        }
        StoreTarget::Settings(settings) => {
            let mut settings = *settings;
            let kind = settings.datastore_type();
            match &mut settings.backend {
                Backend::Sled { path } | Backend::Redb { path } if path.is_none() => {
                    let dir = tempfile::Builder::new()
                        .prefix("blockipam-load-")
                        .tempdir()
                        .map_err(|e| {
                            LoadError::failed(format!("cannot create a temporary directory: {e}"))
                        })?;
                    *path = Some(dir.path().join(format!("store.{kind}")));
                    temporary_store_dir = Some(dir);
                }
                Backend::Etcd(etcd) if etcd.prefix.is_none() => {
                    etcd.prefix = Some(unique_etcd_prefix(config));
                }
                _ => {}
            }
            settings.create_if_missing = true;
            let store = open(&settings).await?;
            (Some(settings), store)
        }
    };
    Ok((settings, store, temporary_store_dir))
}

fn unique_etcd_prefix(config: &LoadConfig) -> String {
    let seconds = ipam_core::model::timestamp::unix_now();
    format!(
        "/blockipam-load/{}-{}-{seconds}-{}/",
        config.network,
        config.seed,
        std::process::id()
    )
}

pub(crate) async fn open(settings: &DatastoreSettings) -> Result<Arc<dyn KvStore>, LoadError> {
    settings.open().await.map_err(|e| {
        LoadError::failed(format!(
            "cannot open the store ({}): {e}",
            settings.describe()
        ))
    })
}

/// Creates the pool (or finds the identical one), sets the configuration, and refuses a store
/// that already holds allocations of this run's network (an earlier run's pods would count as
/// leaks or duplicates).
async fn prepare_store(ipam: &Ipam, config: &LoadConfig) -> Result<(), LoadError> {
    let failed = |what: &str, e: ipam_core::IpamError| LoadError::failed(format!("{what}: {e}"));
    ipam.ensure_pool(&PoolSpec {
        cidr: config.pool,
        name: None,
        block_size: config.block_size,
        disabled: false,
    })
    .await
    .map_err(|e| failed(&format!("cannot create the pool {}", config.pool), e))?;
    let strict_affinity = config.strict_affinity;
    let max_blocks = config.max_blocks_per_host;
    ipam.update_config(|c| {
        c.strict_affinity = strict_affinity;
        if let Some(max) = max_blocks {
            c.max_blocks_per_host = max;
        }
    })
    .await
    .map_err(|e| failed("cannot set the IPAM configuration", e))?;
    let prefix = format!("{}.", config.network);
    let leftovers = ipam
        .list_allocations()
        .await
        .map_err(|e| failed("cannot list the allocations", e))?
        .iter()
        .filter(|a| a.handle.starts_with(&prefix))
        .count();
    if leftovers > 0 {
        return Err(LoadError::failed(format!(
            "the store already holds {leftovers} allocations of network {:?} (an earlier run?): \
             use a fresh store, another --etcd-prefix or another --network",
            config.network
        )));
    }
    Ok(())
}

/// Gives every node its way to the store.
async fn build_drivers(
    config: &LoadConfig,
    settings: Option<&DatastoreSettings>,
    store: Arc<dyn KvStore>,
    lock_dir: &std::path::Path,
) -> Result<Drivers, LoadError> {
    let names: Vec<String> = (0..config.nodes).map(LoadConfig::node_name).collect();
    match config.mode {
        Mode::Api => {
            let etcd = settings.filter(|s| s.etcd().is_some());
            let drivers = match etcd {
                Some(settings) => {
                    let mut drivers = Vec::with_capacity(names.len());
                    for chunk in names.chunks(CONNECTS_AT_ONCE) {
                        let mut connecting = JoinSet::new();
                        for (offset, name) in chunk.iter().enumerate() {
                            let settings = settings.clone();
                            let name = name.clone();
                            connecting.spawn(async move { (offset, name, open(&settings).await) });
                        }
                        let mut opened: Vec<(usize, NodeDriver)> = Vec::new();
                        while let Some(joined) = connecting.join_next().await {
                            let (offset, name, store) = joined.map_err(|e| {
                                LoadError::failed(format!("a connecting task failed: {e}"))
                            })?;
                            let driver = ApiNode::new(
                                name,
                                config.network.clone(),
                                store?,
                                config.agent_cache,
                            )?;
                            opened.push((offset, NodeDriver::Api(driver)));
                        }
                        opened.sort_by_key(|(offset, _)| *offset);
                        drivers.extend(opened.into_iter().map(|(_, d)| d));
                    }
                    drivers
                }
                None => names
                    .into_iter()
                    .map(|name| {
                        ApiNode::new(
                            name,
                            config.network.clone(),
                            store.clone(),
                            config.agent_cache,
                        )
                        .map(NodeDriver::Api)
                    })
                    .collect::<Result<_, _>>()?,
            };
            let mut clients = match etcd {
                Some(_) => "api mode: each node has its own Ipam and its own etcd client (own connections)".to_owned(),
                None => "api mode: each node has its own Ipam, all over one shared store handle (an embedded store admits one process)".to_owned(),
            };
            if config.agent_cache {
                clients.push_str(
                    "; each node reads through a cache of its own, as its agent serves the plugin",
                );
            }
            Ok(Drivers {
                nodes: drivers,
                description: clients,
                keep_store: Some(store),
            })
        }
        Mode::Plugin => {
            let settings = settings.ok_or_else(|| {
                LoadError::usage(
                    "plugin mode needs store settings (the plugin opens the store itself)",
                )
            })?;
            let binary = config
                .plugin
                .clone()
                .ok_or_else(|| LoadError::usage("plugin mode needs the blockipam binary"))?;
            if !binary.is_file() {
                return Err(LoadError::failed(format!(
                    "the blockipam plugin binary was not found at {}: build it with `cargo build \
                     -p blockipam` or pass --plugin PATH",
                    binary.display()
                )));
            }
            let runner = Arc::new(PluginRunner::new(binary, lock_dir.to_path_buf()));
            let drivers = names
                .iter()
                .map(|name| {
                    let netconf = runner.netconf(config, settings, name);
                    NodeDriver::Plugin(PluginNode::new(runner.clone(), &netconf))
                })
                .collect();
            let embedded = settings.etcd().is_none();
            let clients = if embedded {
                "plugin mode: one blockipam process per operation, each node with its own nodename and ipam_lock_file; the processes take turns on the embedded store's own lock"
            } else {
                "plugin mode: one blockipam process per operation (its own etcd connection), each node with its own nodename and ipam_lock_file"
            };
            // The plugin opens an embedded store itself: this process must let go of it.
            let keep = if embedded {
                drop(store);
                None
            } else {
                Some(store)
            };
            Ok(Drivers {
                nodes: drivers,
                description: clients.to_owned(),
                keep_store: keep,
            })
        }
    }
}

fn planned_operations(config: &LoadConfig) -> Option<u64> {
    match (config.stop, config.drain) {
        (StopRule::Operations(n), false) => Some(n),
        (StopRule::ChurnCycles(c), false) => {
            Some(config.streams() * (u64::from(config.pods_per_node) + 2 * c))
        }
        (StopRule::ChurnCycles(c), true) => {
            Some(config.streams() * (2 * u64::from(config.pods_per_node) + 2 * c))
        }
        _ => None,
    }
}

/// Runs every node's schedule to its end.
async fn dispatch(
    config: &LoadConfig,
    drivers: Vec<NodeDriver>,
    status_client: Option<Arc<StatusClient>>,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Dispatched, LoadError> {
    let start = Instant::now();
    // Each node runs `lanes_per_node` pod streams over the same driver (its host identity).
    let lanes = config.lanes_per_node.max(1);
    let mut ready: Vec<SimNode> = drivers
        .into_iter()
        .zip(0_u32..)
        .flat_map(|(driver, node)| {
            (0..lanes).map(move |lane| SimNode {
                schedule: NodeSchedule::new(config, node * lanes + lane, start),
                driver: driver.clone(),
            })
        })
        .collect();
    let mut parked: Vec<(Instant, SimNode)> = Vec::new();
    let mut schedules = Vec::with_capacity(ready.len());
    let mut in_flight: JoinSet<Finished> = JoinSet::new();
    let mut picker = SplitMix64::derived(config.seed, u64::MAX);
    let mut stats = Stats::default();
    let mut ledger = Ledger::default();
    let mut error_samples = Vec::new();
    let concurrency = config.concurrency as usize;
    let planned = planned_operations(config);
    let duration = match config.stop {
        StopRule::Duration(d) => Some(d),
        _ => None,
    };
    let finished_count = Arc::new(AtomicU64::new(0));
    let samples = Arc::new(Mutex::new(Vec::new()));
    let sampler = match (&status_client, config.etcd_status_interval) {
        (Some(client), Some(every)) => Some(tokio::spawn(sample_etcd(
            client.clone(),
            every,
            start,
            finished_count.clone(),
            samples.clone(),
        ))),
        _ => None,
    };
    let mut next_progress = start + PROGRESS_EVERY;
    let mut last_finish = start;

    loop {
        let now = Instant::now();
        let mut index = 0;
        while index < parked.len() {
            if parked[index].0 <= now {
                ready.push(parked.swap_remove(index).1);
            } else {
                index += 1;
            }
        }
        while in_flight.len() < concurrency && !ready.is_empty() {
            let pick = picker.below(ready.len());
            match ready[pick].schedule.next(now) {
                Step::Run(op) => {
                    let node = ready.swap_remove(pick);
                    if op.kind == OpKind::Del {
                        ledger.releasing(&op.pod.container, &op.pod.ips);
                    }
                    let handle = config.handle(&op.pod.container);
                    in_flight.spawn(async move {
                        let (result, sample) = node.driver.perform(&op, &handle).await;
                        Finished {
                            node,
                            op,
                            result,
                            sample,
                        }
                    });
                }
                Step::WaitUntil(when) => parked.push((when, ready.swap_remove(pick))),
                Step::Done => schedules.push(ready.swap_remove(pick).schedule),
            }
        }
        if in_flight.is_empty() && ready.is_empty() && parked.is_empty() {
            break;
        }
        let wake = parked.iter().map(|(when, _)| *when).min();
        tokio::select! {
            joined = in_flight.join_next(), if !in_flight.is_empty() => {
                let Some(joined) = joined else { continue };
                let Finished { mut node, op, result, sample } = joined
                    .map_err(|e| LoadError::failed(format!("a node's task failed: {e}")))?;
                stats.add(&sample);
                finished_count.fetch_add(1, Ordering::Relaxed);
                last_finish = Instant::now();
                match (&result, op.kind) {
                    (Ok(ips), OpKind::FirstAdd | OpKind::Add) => ledger.added(&op.pod.container, ips),
                    (Ok(_), OpKind::Del) => ledger.released(&op.pod.container, &op.pod.ips),
                    (Err(e), _) => {
                        if error_samples.len() < ERROR_SAMPLES {
                            error_samples.push(e.clone());
                        }
                    }
                }
                node.schedule.record(op, &result);
                ready.push(node);
            }
            () = sleep_until_option(wake), if wake.is_some() && in_flight.len() < concurrency => {}
            () = tokio::time::sleep_until(next_progress.into()) => {
                next_progress = Instant::now() + PROGRESS_EVERY;
                progress(&Progress {
                    finished: stats.finished(),
                    errors: stats.errors(),
                    planned,
                    elapsed: start.elapsed(),
                    duration,
                    done: false,
                });
            }
        }
    }
    if let Some(sampler) = sampler {
        sampler.abort();
        let _ = sampler.await;
    }
    progress(&Progress {
        finished: stats.finished(),
        errors: stats.errors(),
        planned,
        elapsed: start.elapsed(),
        duration,
        done: true,
    });
    let samples = samples
        .lock()
        .map(|mut samples| std::mem::take(&mut *samples))
        .unwrap_or_default();
    schedules.sort_by_key(NodeSchedule::node);
    Ok(Dispatched {
        stats,
        elapsed: last_finish - start,
        error_samples,
        ledger,
        schedules,
        samples,
    })
}

async fn sleep_until_option(when: Option<Instant>) {
    if let Some(when) = when {
        tokio::time::sleep_until(when.into()).await;
    }
}

/// Samples etcd's database size every `every` until aborted.
async fn sample_etcd(
    client: Arc<StatusClient>,
    every: Duration,
    start: Instant,
    finished: Arc<AtomicU64>,
    samples: Arc<Mutex<Vec<EtcdSample>>>,
) {
    loop {
        tokio::time::sleep(every).await;
        let members = client.members().await;
        let sample = EtcdSample {
            elapsed_seconds: start.elapsed().as_secs_f64(),
            operations: finished.load(Ordering::Relaxed),
            max_db_size_bytes: MemberStatus::max_db_size(&members),
            max_db_size_in_use_bytes: members.iter().filter_map(|m| m.db_size_in_use_bytes).max(),
        };
        if let Ok(mut samples) = samples.lock() {
            samples.push(sample);
        }
    }
}

async fn pool_state(ipam: &Ipam, config: &LoadConfig) -> Result<PoolState, LoadError> {
    let usage = ipam
        .utilization()
        .await
        .map_err(|e| LoadError::failed(format!("cannot read the pool's utilization: {e}")))?;
    let mut state = PoolState::default();
    for pool in usage.pools.iter().filter(|p| p.pool.cidr == config.pool) {
        for block in &pool.blocks {
            state.blocks += 1;
            state.affine_blocks += u64::from(block.host.is_some());
            state.in_use += block.in_use;
            state.capacity += block.capacity;
        }
    }
    Ok(state)
}
