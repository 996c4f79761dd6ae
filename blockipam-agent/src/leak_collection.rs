//! Leak collection on a live node: the agent asks the container runtime (CRI) which pod sandboxes exist, compares them with this node's allocations, releases those whose container has been gone at every look for the grace, and reports live addresses the store disagrees with.
//!
//! The decision is `ipam_core::allocator::leaks` (what is never touched, why a look restarts the
//! countdowns, why nothing is released until the runtime reports a container the store records);
//! this module asks the runtime, keeps the watch between looks, logs and counts. See docs/agent.md,
//! "Leak collection".

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ipam_core::model::timestamp::unix_now;

use cri_client::{CriClient, CriError};
use ipam_core::allocator::leaks::{
    AddressHolder, Disagreement, LeakDecisions, LeakPolicy, LeakReport, LeakWatch, LiveSandbox,
    RuntimeView, LEAK_REPORT_FILE, LEAK_REPORT_VERSION,
};
use ipam_core::{Ipam, KvStore};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::counters::LeakCounters;
use crate::metrics::NO_POOL_LABEL;
use crate::{AgentArgs, AgentError};

/// What `--leak-collection` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LeakAction {
    /// Release allocations missing for the whole grace (and report disagreements).
    Release,
    /// Only report (log and metrics): nothing is written.
    Report,
    /// Do not ask the runtime at all.
    Off,
}

/// The leak collection's settings, from the agent's flags.
#[derive(Debug, Clone)]
pub struct LeakSettings {
    /// This node's name, as the plugin records it.
    pub node: String,
    /// The runtime's CRI socket.
    pub socket: PathBuf,
    /// The grace and the longest gap between looks that still counts as continuous.
    pub policy: LeakPolicy,
    /// Seconds between looks.
    pub interval: Duration,
    /// Release, or only report.
    pub release: bool,
    /// Deadline of each CRI call.
    pub call_deadline: Duration,
    /// Where each look's report is written for `blockipamctl gc --leaks` (beside the socket).
    pub report_path: PathBuf,
    /// libcni's cache directory, the witness for re-asserting a live pod's lost address.
    pub cni_cache_dir: PathBuf,
}

/// Looks further apart than this many intervals do not prove an absence in between.
const GAP_INTERVALS: u64 = 3;
/// The longest a CRI call may take (and at most half the interval between looks).
const CRI_CALL_DEADLINE: Duration = Duration::from_secs(10);

impl LeakSettings {
    /// The settings the flags give, or `None` when `--leak-collection off`.
    ///
    /// # Errors
    /// [`AgentError`] when no valid node name can be found.
    pub fn from_args(args: &AgentArgs) -> Result<Option<LeakSettings>, AgentError> {
        if args.leak_collection == LeakAction::Off {
            return Ok(None);
        }
        let node = crate::liveness::node_name(args)?;
        let interval = args.leak_scan_seconds;
        Ok(Some(LeakSettings {
            node,
            socket: args.cri_socket.clone(),
            policy: LeakPolicy {
                grace_seconds: args.leak_grace_seconds,
                max_gap_seconds: interval.saturating_mul(GAP_INTERVALS),
            },
            interval: Duration::from_secs(interval),
            release: args.leak_collection == LeakAction::Release,
            call_deadline: CRI_CALL_DEADLINE.min(Duration::from_secs(interval) / 2),
            report_path: args.socket.with_file_name(LEAK_REPORT_FILE),
            cni_cache_dir: args.cni_cache_dir.clone(),
        }))
    }
}

/// The running leak collection; [`stop`](Self::stop) it at shutdown.
#[derive(Debug)]
pub struct LeakCollection {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl LeakCollection {
    /// Starts looking at once (an agent starting after a reclaim or a restore compares first),
    /// then every interval.
    pub fn start(
        settings: LeakSettings,
        store: Arc<dyn KvStore>,
        counters: Arc<LeakCounters>,
    ) -> LeakCollection {
        tracing::info!(
            node = %settings.node,
            runtime = %settings.socket.display(),
            interval_seconds = settings.interval.as_secs(),
            grace_seconds = settings.policy.grace_seconds,
            "leak collection: comparing this node's allocations with the container runtime; {}",
            if settings.release {
                "releasing those whose container is gone at every look for the grace"
            } else {
                "reporting only (--leak-collection report)"
            }
        );
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(run_loop(settings, store, counters, stopped));
        LeakCollection {
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Stops looking; a release in progress finishes first.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

/// The runtime's state as last logged, so that each change is logged once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RuntimeState {
    Unknown,
    Answering,
    Unanswered,
}

async fn run_loop(
    settings: LeakSettings,
    store: Arc<dyn KvStore>,
    counters: Arc<LeakCounters>,
    mut stopped: oneshot::Receiver<()>,
) {
    let ipam = Ipam::new(store);
    let mut watch = LeakWatch::new();
    let mut client: Option<CriClient> = None;
    let mut state = RuntimeState::Unknown;
    let mut reported = BTreeSet::new();
    let mut unproven_logged = false;
    let mut undecodable_logged = Vec::new();
    loop {
        match ask_runtime(&settings, &mut client).await {
            Err(e) => {
                write_report(&settings, unix_now(), Some(e.to_string()), None);
                watch.runtime_unanswered();
                client = None;
                counters.runtime_answering.store(false, Ordering::Relaxed);
                counters.unanswered_looks.fetch_add(1, Ordering::Relaxed);
                if state != RuntimeState::Unanswered {
                    tracing::warn!(
                        "leak collection: the container runtime cannot be asked ({e}); nothing is \
                         collected until it answers, and every countdown starts again then \
                         (a node whose runtime has no CRI, such as Podman, never collects: \
                         --leak-collection off says so)"
                    );
                    state = RuntimeState::Unanswered;
                }
            }
            Ok(view) => {
                counters.runtime_answering.store(true, Ordering::Relaxed);
                counters.looks.fetch_add(1, Ordering::Relaxed);
                if state != RuntimeState::Answering {
                    tracing::info!(
                        runtime = %settings.socket.display(),
                        sandboxes = view.sandboxes.len(),
                        "leak collection: the container runtime answers"
                    );
                    state = RuntimeState::Answering;
                }
                match ipam
                    .look_for_leaks(&settings.node, &view, &mut watch, settings.policy)
                    .await
                {
                    Ok(decisions) => {
                        report(&decisions, &counters, &mut reported, &mut unproven_logged);
                        warn_undecodable(&decisions, &mut undecodable_logged);
                        write_report(&settings, view.observed_at, None, Some(&decisions));
                        if settings.release && !decisions.leaked.is_empty() {
                            release(&ipam, &settings.node, &decisions, &counters).await;
                        }
                        let recorded_again = match client.clone() {
                            Some(runtime) if settings.release => {
                                let still_ready = |id: String| {
                                    let runtime = runtime.clone();
                                    async move { runtime.sandbox_is_ready(&id).await }
                                };
                                reassert(&ipam, &settings, &decisions, &counters, still_ready).await
                            }
                            _ => BTreeSet::new(),
                        };
                        // What `blockipamctl check` reports: what this look found and did not
                        // settle itself.
                        let unsettled: Vec<Disagreement> = decisions
                            .disagreements
                            .iter()
                            .filter(|d| !recorded_again.contains(&d.address))
                            .cloned()
                            .collect();
                        if let Err(e) = ipam
                            .record_disagreements(&settings.node, view.observed_at, &unsettled)
                            .await
                        {
                            tracing::warn!(
                                "leak collection: cannot record this look's disagreements for \
                                 `blockipamctl check` ({e})"
                            );
                        }
                    }
                    Err(e) => tracing::warn!(
                        "leak collection: cannot read this node's allocations ({e}); nothing \
                         released at this look"
                    ),
                }
            }
        }
        tokio::select! {
            _ = &mut stopped => return,
            () = tokio::time::sleep(settings.interval) => {}
        }
    }
}

/// One look at the runtime: every sandbox, with the moment it was asked.
async fn ask_runtime(
    settings: &LeakSettings,
    client: &mut Option<CriClient>,
) -> Result<RuntimeView, CriError> {
    if client.is_none() {
        *client = Some(CriClient::connect(&settings.socket, settings.call_deadline).await?);
    }
    let Some(connected) = client.as_ref() else {
        unreachable!("connected just above");
    };
    let sandboxes = connected.sandboxes().await?;
    Ok(RuntimeView {
        observed_at: unix_now(),
        sandboxes: sandboxes
            .into_iter()
            .map(|sandbox| {
                (
                    sandbox.id,
                    LiveSandbox {
                        pod: sandbox.pod,
                        namespace: sandbox.namespace,
                        uid: sandbox.uid,
                        addresses: sandbox.addresses,
                    },
                )
            })
            .collect(),
    })
}

/// Logs what one look found (each disagreement once while it lasts) and sets the gauges.
/// Names the blocks a look could not decode, once for each set of them (every look reads them
/// until they are repaired).
fn warn_undecodable(decisions: &LeakDecisions, logged: &mut Vec<String>) {
    let keys: Vec<String> = decisions
        .undecodable
        .iter()
        .map(|object| object.key.clone())
        .collect();
    if keys != *logged {
        for object in &decisions.undecodable {
            tracing::warn!(
                key = %object.key,
                "leak collection: a block cannot be decoded ({}); nothing it covers is judged \
                 until it is repaired (blockipamctl check)",
                object.message
            );
        }
        *logged = keys;
    }
}

fn report(
    decisions: &LeakDecisions,
    counters: &LeakCounters,
    reported: &mut BTreeSet<(IpAddr, String)>,
    unproven_logged: &mut bool,
) {
    let missing = decisions.waiting.len() + decisions.leaked.len();
    counters
        .missing_allocations
        .store(missing as u64, Ordering::Relaxed);
    let duplicates = decisions
        .disagreements
        .iter()
        .filter(|d| matches!(d.holder, AddressHolder::Other(_)))
        .count();
    counters
        .duplicate_addresses
        .store(duplicates as u64, Ordering::Relaxed);
    counters.unrecorded_addresses.store(
        (decisions.disagreements.len() - duplicates) as u64,
        Ordering::Relaxed,
    );
    if decisions.runtime_unproven && missing > 0 {
        if !*unproven_logged {
            tracing::warn!(
                missing,
                "leak collection: the container runtime runs none of the containers this node's \
                 allocations name; nothing is released until it does (is --cri-socket the runtime \
                 the kubelet uses?)"
            );
            *unproven_logged = true;
        }
    } else {
        *unproven_logged = false;
    }
    let mut now_seen = BTreeSet::new();
    for disagreement in &decisions.disagreements {
        let key = (disagreement.address, disagreement.sandbox_id.clone());
        if !reported.contains(&key) {
            match &disagreement.holder {
                AddressHolder::Free => tracing::warn!(
                    address = %disagreement.address,
                    pod = %disagreement.pod,
                    sandbox = %disagreement.sandbox_id,
                    "leak collection: a live pod uses an address the store records as free \
                     (blockipamctl check; a restored backup?)"
                ),
                AddressHolder::Other(holder) => tracing::warn!(
                    address = %disagreement.address,
                    pod = %disagreement.pod,
                    sandbox = %disagreement.sandbox_id,
                    holder = %holder.handle,
                    holder_node = holder.attributes.get(ipam_core::allocator::ATTR_NODE).map_or("", String::as_str),
                    "leak collection: DUPLICATE: a live pod uses an address the store records \
                     for another holder"
                ),
            }
        }
        now_seen.insert(key);
    }
    *reported = now_seen;
}

/// Releases what the look decided, logging each address and counting it by its pool.
async fn release(ipam: &Ipam, node: &str, decisions: &LeakDecisions, counters: &LeakCounters) {
    match ipam.release_leaked(&decisions.leaked).await {
        Ok(outcome) => {
            counters.record_released(
                node,
                outcome.released.iter().map(|address| {
                    decisions
                        .leaked_pools
                        .get(address)
                        .map_or(NO_POOL_LABEL, String::as_str)
                }),
            );
            for missing in &decisions.leaked {
                let attributes = &missing.allocation.attributes;
                let field = |key: &str| attributes.get(key).map_or("", String::as_str);
                let released = outcome.released.contains(&missing.allocation.ip);
                tracing::info!(
                    address = %missing.allocation.ip,
                    handle = %missing.allocation.handle,
                    container = field(ipam_core::allocator::leaks::ATTR_CONTAINER_ID),
                    pod = format!(
                        "{}/{}",
                        field(ipam_core::allocator::leaks::ATTR_NAMESPACE),
                        field(ipam_core::allocator::leaks::ATTR_POD)
                    ),
                    missing_since = missing.missing_since,
                    "leak collection: {}",
                    if released {
                        "released an address whose container the runtime no longer runs"
                    } else {
                        "left an address alone: it changed hands since the decision"
                    }
                );
            }
        }
        Err(e) => tracing::warn!(
            leaked = decisions.leaked.len(),
            "leak collection: releasing failed ({e}); the next look decides again"
        ),
    }
}

/// Records each live pod's address the store holds as free for it again, from libcni's cache of
/// its ADD (the runtime's own record); an address without such a record is only reported. The
/// addresses recorded again.
///
/// The look saw the sandbox ready before it read the store: a pod deleted since (the runtime
/// stops its sandbox, then its CNI DEL frees the address, then libcni drops the cache entry)
/// would have its freed address recorded again for a sandbox that is gone, held until a later
/// look finds it gone and its grace has passed. So each sandbox is asked again (`still_ready`,
/// the runtime's `PodSandboxStatus`) after its cache entry is read and just before its address is
/// recorded: one no longer ready, or one the runtime cannot answer for, is left alone.
async fn reassert<F, Fut>(
    ipam: &Ipam,
    settings: &LeakSettings,
    decisions: &LeakDecisions,
    counters: &LeakCounters,
    still_ready: F,
) -> BTreeSet<IpAddr>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<bool, CriError>>,
{
    let now = ipam_core::model::timestamp::now_rfc3339();
    let mut recorded_again = BTreeSet::new();
    for disagreement in &decisions.disagreements {
        if !matches!(disagreement.holder, AddressHolder::Free) {
            continue;
        }
        let Some(reassertion) = crate::cni_cache::reassertion_for(
            &settings.cni_cache_dir,
            &disagreement.sandbox_id,
            disagreement.address,
            &settings.node,
            &now,
        ) else {
            tracing::warn!(
                address = %disagreement.address,
                pod = %disagreement.pod,
                cache = %settings.cni_cache_dir.display(),
                "leak collection: no libcni cache entry records this live pod's address: it is \
                 only reported (blockipamctl check)"
            );
            continue;
        };
        match still_ready(disagreement.sandbox_id.clone()).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(
                    address = %disagreement.address,
                    pod = %disagreement.pod,
                    "leak collection: the pod's sandbox stopped since the look: its address is \
                     not recorded again"
                );
                continue;
            }
            Err(e) => {
                tracing::warn!(
                    address = %disagreement.address,
                    pod = %disagreement.pod,
                    "leak collection: the runtime cannot say whether the pod's sandbox still \
                     runs ({e}): its address is not recorded again at this look"
                );
                continue;
            }
        }
        match ipam.reassert(&reassertion).await {
            Ok(true) => {
                recorded_again.insert(disagreement.address);
                counters.reasserted.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    address = %disagreement.address,
                    pod = %disagreement.pod,
                    handle = %reassertion.handle,
                    "leak collection: recorded a live pod's address again (the store held it free)"
                );
            }
            Ok(false) => tracing::warn!(
                address = %disagreement.address,
                pod = %disagreement.pod,
                "leak collection: a live pod's address was taken before it could be recorded \
                 again: a duplicate"
            ),
            Err(e) => tracing::warn!(
                address = %disagreement.address,
                pod = %disagreement.pod,
                "leak collection: cannot record a live pod's address again: {e}"
            ),
        }
    }
    recorded_again
}

/// Writes one look's report beside the socket (written beside, then renamed: a reader never sees
/// half of one; mode 0600: it names pods and addresses). A failure is logged, never fatal.
fn write_report(
    settings: &LeakSettings,
    observed_at: u64,
    runtime_error: Option<String>,
    decisions: Option<&LeakDecisions>,
) {
    let report = LeakReport {
        version: LEAK_REPORT_VERSION,
        node: settings.node.clone(),
        runtime: settings.socket.display().to_string(),
        observed_at,
        grace_seconds: settings.policy.grace_seconds,
        scan_seconds: settings.interval.as_secs(),
        runtime_error,
        decisions: decisions.cloned(),
    };
    let written = serde_json::to_vec_pretty(&report)
        .map_err(std::io::Error::other)
        .and_then(|bytes| {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let partial = settings.report_path.with_extension("json.partial");
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&partial)?;
            file.write_all(&bytes)?;
            file.write_all(b"\n")?;
            std::fs::rename(&partial, &settings.report_path)
        });
    if let Err(e) = written {
        tracing::warn!(
            path = %settings.report_path.display(),
            "leak collection: cannot write the report for blockipamctl gc --leaks: {e}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipam_core::allocator::leaks::MissingAllocation;
    use ipam_core::AllocationInfo;

    fn allocation(last_octet: u8) -> AllocationInfo {
        AllocationInfo {
            ip: IpAddr::from([10, 9, 0, last_octet]),
            block: "10.9.0.0/26".parse().expect("a block"),
            block_host: Some("node-a".into()),
            handle: format!("net.container-{last_octet}"),
            attributes: Default::default(),
            sequence: 1,
        }
    }

    fn missing(last_octets: std::ops::Range<u8>) -> Vec<MissingAllocation> {
        last_octets
            .map(|octet| MissingAllocation {
                allocation: allocation(octet),
                missing_since: 100,
            })
            .collect()
    }

    fn disagreement(last_octet: u8, holder: AddressHolder) -> Disagreement {
        Disagreement {
            address: IpAddr::from([10, 9, 0, last_octet]),
            sandbox_id: format!("sandbox-{last_octet}"),
            pod: "default/web".into(),
            holder,
        }
    }

    fn gauges(counters: &LeakCounters) -> (u64, u64, u64) {
        (
            counters.missing_allocations.load(Ordering::Relaxed),
            counters.duplicate_addresses.load(Ordering::Relaxed),
            counters.unrecorded_addresses.load(Ordering::Relaxed),
        )
    }

    fn settings(args: &[&str]) -> Option<LeakSettings> {
        LeakSettings::from_args(&AgentArgs::parsed_for_test(args)).expect("settings")
    }

    /// The defaults release after 900 s, look every 60 s (looks 180 s apart restart the
    /// countdowns) and give a CRI call 10 s; `report` only reports; a short interval gives its
    /// calls half of it; `off` asks nothing; the report lies beside the socket.
    #[test]
    fn the_flags_give_the_leak_collection() {
        let defaults = settings(&[]).expect("on by default");
        assert_eq!(defaults.node, "node-a");
        assert!(defaults.release);
        assert_eq!(defaults.policy.grace_seconds, 900);
        assert_eq!(defaults.policy.max_gap_seconds, 180);
        assert_eq!(defaults.interval, Duration::from_secs(60));
        assert_eq!(defaults.call_deadline, Duration::from_secs(10));
        assert_eq!(
            defaults.report_path,
            PathBuf::from("/run/x").join(LEAK_REPORT_FILE)
        );
        assert_eq!(
            defaults.socket,
            PathBuf::from(cri_client::CONTAINERD_SOCKET)
        );

        let quick = settings(&["--leak-collection", "report", "--leak-scan-seconds", "4"])
            .expect("reporting is on");
        assert!(!quick.release, "report only reports");
        assert_eq!(quick.interval, Duration::from_secs(4));
        assert_eq!(quick.policy.max_gap_seconds, 12);
        assert_eq!(quick.call_deadline, Duration::from_secs(2));

        assert!(settings(&["--leak-collection", "off"]).is_none());
    }

    /// The gauges are what the last look found: missing allocations (waiting and leaked), live
    /// addresses held by another holder (duplicates) and live addresses held free (unrecorded);
    /// the disagreements remembered are the last look's; the warning that the runtime is
    /// unproven is given once while it lasts, and again after a look that clears it.
    #[test]
    fn each_look_sets_the_gauges_and_remembers_only_what_it_found() {
        let counters = LeakCounters::default();
        let mut reported = BTreeSet::new();
        let mut unproven_logged = false;
        let look = LeakDecisions {
            waiting: missing(1..3),
            leaked: missing(3..6),
            disagreements: vec![
                disagreement(10, AddressHolder::Free),
                disagreement(11, AddressHolder::Other(allocation(11))),
                disagreement(12, AddressHolder::Free),
                disagreement(13, AddressHolder::Free),
            ],
            ..LeakDecisions::default()
        };
        report(&look, &counters, &mut reported, &mut unproven_logged);
        assert_eq!(gauges(&counters), (5, 1, 3));
        assert_eq!(reported.len(), 4);
        assert!(reported.contains(&(IpAddr::from([10, 9, 0, 11]), "sandbox-11".to_owned())));
        assert!(!unproven_logged, "the runtime proved itself at this look");

        let unproven = LeakDecisions {
            waiting: missing(1..3),
            runtime_unproven: true,
            ..LeakDecisions::default()
        };
        report(&unproven, &counters, &mut reported, &mut unproven_logged);
        assert_eq!(gauges(&counters), (2, 0, 0));
        assert!(reported.is_empty(), "no disagreement at the last look");
        assert!(
            unproven_logged,
            "an unproven runtime with allocations missing is warned of"
        );
        report(&unproven, &counters, &mut reported, &mut unproven_logged);
        assert!(
            unproven_logged,
            "still unproven: the warning is not given again"
        );

        let nothing_missing = LeakDecisions {
            runtime_unproven: true,
            ..LeakDecisions::default()
        };
        report(
            &nothing_missing,
            &counters,
            &mut reported,
            &mut unproven_logged,
        );
        assert_eq!(gauges(&counters), (0, 0, 0));
        assert!(
            !unproven_logged,
            "nothing missing: nothing to warn of, and the next unproven look warns again"
        );
    }

    /// A live pod's address the store holds free is recorded again only when its sandbox is
    /// still ready when asked just before: one stopped since the look (its DEL freed the address
    /// and libcni's cache entry is not yet gone) is left alone, as is one the runtime cannot
    /// answer for.
    #[tokio::test]
    async fn an_address_is_recorded_again_only_for_a_sandbox_still_ready_when_asked_again() {
        let dir = tempfile::tempdir().expect("a directory");
        let cache = dir.path().join("cni-cache");
        std::fs::create_dir_all(cache.join("results")).expect("mkdir");
        for octet in [10, 11, 12] {
            let entry = serde_json::json!({
                "kind": "cniCacheV1",
                "containerId": format!("sandbox-{octet}"),
                "config": "e30=",
                "ifName": "eth0",
                "networkName": "pods",
                "cniArgs": [["K8S_POD_NAMESPACE", "default"], ["K8S_POD_NAME", "web"]],
                "result": {"cniVersion": "1.0.0", "ips": [{"address": format!("10.9.0.{octet}/26")}]}
            });
            std::fs::write(
                cache
                    .join("results")
                    .join(format!("pods-sandbox-{octet}-eth0")),
                entry.to_string(),
            )
            .expect("a cache entry");
        }
        let store: Arc<dyn KvStore> = Arc::new(ipam_core::kv::memory::MemoryStore::new());
        let ipam = Ipam::new(store);
        ipam.create_pool(&ipam_core::PoolSpec {
            cidr: "10.9.0.0/24".parse().expect("a cidr"),
            name: Some("pool".into()),
            block_size: Some(26),
            disabled: false,
        })
        .await
        .expect("a pool");
        let settings = LeakSettings {
            cni_cache_dir: cache,
            ..settings(&[]).expect("on by default")
        };
        let decisions = LeakDecisions {
            disagreements: vec![
                disagreement(10, AddressHolder::Free),
                disagreement(11, AddressHolder::Free),
                disagreement(12, AddressHolder::Free),
            ],
            ..LeakDecisions::default()
        };
        let counters = LeakCounters::default();
        let asked = std::sync::Mutex::new(Vec::new());
        let still_ready = |id: String| {
            asked
                .lock()
                .expect("the list of asked sandboxes")
                .push(id.clone());
            async move {
                match id.as_str() {
                    "sandbox-10" => Ok(true),
                    "sandbox-11" => Ok(false),
                    _ => Err(CriError::Answer {
                        socket: PathBuf::from("/run/cri.sock"),
                        method: "PodSandboxStatus",
                        what: "no answer".into(),
                    }),
                }
            }
        };
        let recorded = reassert(&ipam, &settings, &decisions, &counters, still_ready).await;
        assert_eq!(recorded, BTreeSet::from([IpAddr::from([10, 9, 0, 10])]));
        assert_eq!(counters.reasserted.load(Ordering::Relaxed), 1);
        assert_eq!(
            asked.into_inner().expect("the list of asked sandboxes"),
            ["sandbox-10", "sandbox-11", "sandbox-12"]
        );
        let holder = |octet: u8| {
            let ipam = &ipam;
            async move {
                ipam.get_assignment(IpAddr::from([10, 9, 0, octet]))
                    .await
                    .expect("a lookup")
                    .map(|allocation| allocation.handle)
            }
        };
        assert_eq!(holder(10).await.as_deref(), Some("pods.sandbox-10"));
        assert_eq!(holder(11).await, None, "recorded for a stopped sandbox");
        assert_eq!(
            holder(12).await,
            None,
            "recorded without the runtime's word"
        );
    }

    /// `stop` returns only once the loop has ended: nothing it started is still running (a
    /// release would be finished), and it no longer holds the store the agent is about to close.
    #[tokio::test]
    async fn stop_returns_once_the_loop_has_ended_and_let_go_of_the_store() {
        let dir = tempfile::tempdir().expect("a directory");
        let store: Arc<dyn KvStore> = Arc::new(ipam_core::kv::memory::MemoryStore::new());
        let counters = Arc::new(LeakCounters::default());
        let settings = LeakSettings {
            node: "node-a".into(),
            // Nothing listens here: every look finds the runtime unanswered at once.
            socket: dir.path().join("no-runtime.sock"),
            policy: LeakPolicy {
                grace_seconds: 60,
                max_gap_seconds: 180,
            },
            interval: Duration::from_secs(3600),
            release: true,
            call_deadline: Duration::from_secs(1),
            report_path: dir.path().join(LEAK_REPORT_FILE),
            cni_cache_dir: dir.path().join("cni-cache"),
        };
        let collection = LeakCollection::start(settings, store.clone(), counters.clone());
        let looked = tokio::time::timeout(Duration::from_secs(30), async {
            while counters.unanswered_looks.load(Ordering::Relaxed) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(looked.is_ok(), "the first look never happened");
        assert_eq!(Arc::strong_count(&store), 2, "the loop holds the store");
        collection.stop().await;
        assert_eq!(
            Arc::strong_count(&store),
            1,
            "stop returned while the loop still ran, holding the store"
        );
    }
}
