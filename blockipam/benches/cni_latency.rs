//! Per-call CNI ADD/DEL latency and peak RSS of the `blockipam` binary beside Debian's `host-local`.
//!
//! Run: `cargo bench -p blockipam --bench cni_latency` (prints a markdown table).
//!
//! Every call is one process started with the CNI environment and the netconf on stdin, exactly as
//! a runtime starts it; the time is from spawn to exit. The plugin timed is the build that is
//! shipped: the static musl executable `scripts/build-plugin` makes (the benchmark runs it first;
//! `scripts/setup` installs the Rust target and musl-tools it needs). blockipam runs on sled, redb and etcd (a
//! throwaway `etcd` on loopback for each etcd row, stopped after it), each with the store opened by the plugin itself ("direct") and
//! through a `blockipam-agent` holding it open ("agent": the agent's own `run`, in this process,
//! on a socket in the run's temporary directory, named by the netconf's `agent_socket`);
//! host-local on its data directory; all in the same run, each with 0, 1,000 and 10,000 addresses
//! already allocated:
//! - blockipam is prefilled through the allocator API (through the agent in agent mode, after one
//!   plugin ADD/DEL has created the pool and reserved the gateway), each address as the plugin's
//!   ADD for a Kubernetes pod records it (one per container, the plugin's handle and attributes):
//!   "10k cluster" spreads them over 100 other nodes (100 each, what a node sees in a cluster),
//!   "10k this node" puts all of them on the benchmarked node (157 blocks of its own;
//!   `max_blocks_per_host` set to unlimited for that), "1k this node" 1,000 of them (16 blocks);
//!   "10k this node no gateway" as "10k this node" with no gateway in the netconf (the plugin's
//!   default: every block's network and last addresses stay free, 162 blocks);
//! - host-local is prefilled by writing its data-directory files (one per address, as it does).
//!
//! Peak RSS (of the plugin process) comes from a second pass of the same calls under
//! `/usr/bin/time -f %M`, so the timings carry no wrapper. Environment: `BLOCKIPAM_BENCH_CALLS`
//! sets the calls per mode (default 200); `BLOCKIPAM_BENCH_ONLY` (comma-separated words of the row
//! labels `<sled|redb|etcdv3> <agent|direct> <0|10k cluster|1k this node|10k this node|10k this node no gateway>`, such as
//! `sled,agent,0` or `redb`) runs only the blockipam rows whose label has every word (host-local
//! always runs: it is the baseline), and the breakdown only with the row `sled agent 0`. The load
//! average is printed with the table: figures from a busy machine are provisional.
//!
//! After the table, the target rows again as a side-by-side pair: through the agent, a store with
//! 10,000 addresses on this node (with and without a gateway) and an empty store, both set up
//! first and then called in turn, call by call, so that the machine's drift during the run falls
//! on both (selected as `<store> agent interleaved <10k this node|10k this node no gateway>`).
//!
//! After that, a breakdown of a call through the agent (sled): a bare process, the plugin's
//! own start and exit, connect + hello, read and commit round trips measured from this process,
//! sled's own durable commit, and a whole plugin call that writes nothing. With
//! `BLOCKIPAM_BENCH_COMPARE=<path of another blockipam binary>` (a copy kept from before a change)
//! the breakdown also times that binary's `VERSION`, ADD and DEL on the same agent, interleaved
//! call by call with the shipped build's: an A/B measured in one run. Without it, the binary
//! compared is the test build (`CARGO_BIN_EXE_blockipam`: glibc, dynamically linked).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::ffi::OsString;

use backend_agent::{AgentConfig, AgentStore};
use blockipam::args::CniArgs;
use blockipam::commands::{allocation_attributes, handle_id};
use blockipam_store::{Backend, DatastoreSettings, DatastoreType, EtcdSettings};
use ipam_core::{
    AllowedUse, AssignIpsRequest, AutoAssignRequest, Ipam, IpamConfig, KvStore, Op, PoolSpec, Txn,
};
use serde_json::{json, Value};
use test_kit::etcd::{unique_prefix, EtcdServer};

use test_kit::agent::InProcessAgent;

/// The test build of the plugin (glibc, dynamically linked): the breakdown's default comparison.
const TEST_BUILD: &str = env!("CARGO_BIN_EXE_blockipam");
/// Builds the shipped plugin and prints its path.
const BUILD_PLUGIN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/build-plugin");
const HOST_LOCAL: &str = "/usr/lib/cni/host-local";
const TIME: &str = "/usr/bin/time";
const POOL: &str = "10.128.0.0/16";
const GATEWAY: &str = "10.128.0.1";
const NODE: &str = "bench-node";
const PREFILL: usize = 10_000;
/// The stores blockipam is measured on, in the order of the table.
const STORES: [DatastoreType; 3] = [
    DatastoreType::Sled,
    DatastoreType::Redb,
    DatastoreType::Etcdv3,
];
/// Concurrent writers filling this node's blocks.
const PREFILL_WRITERS: usize = 16;
/// The netconf's network name (the plugin's handles and attributes carry it).
const NETWORK: &str = "bench";
/// Names another plugin binary that the breakdown times call by call beside this build's.
const COMPARE_ENV: &str = "BLOCKIPAM_BENCH_COMPARE";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Prefill {
    Empty,
    Cluster,
    /// 1,000 addresses on this node.
    ThisNodeThousand,
    ThisNode,
    /// 10,000 addresses on this node, whose netconf names no gateway: the plugin's default, where
    /// addresses are reported with their block's prefix and a block's network and last
    /// addresses are never handed out, so each of the node's blocks keeps those two free.
    ThisNodeNoGateway,
}

impl Prefill {
    fn label(self) -> &'static str {
        match self {
            Prefill::Empty => "0",
            Prefill::Cluster => "10k cluster",
            Prefill::ThisNodeThousand => "1k this node",
            Prefill::ThisNode => "10k this node",
            Prefill::ThisNodeNoGateway => "10k this node no gateway",
        }
    }

    /// How many addresses are allocated before the calls.
    fn count(self) -> usize {
        match self {
            Prefill::Empty => 0,
            Prefill::ThisNodeThousand => 1_000,
            Prefill::Cluster | Prefill::ThisNode | Prefill::ThisNodeNoGateway => PREFILL,
        }
    }

    /// Where the `n`th prefilled address lies from the first: consecutive, or without a gateway
    /// the 62 host addresses of each /26 block (what auto-assign then hands out).
    fn offset(self, n: usize) -> u32 {
        let n = n as u32;
        match self {
            Prefill::ThisNodeNoGateway => n / 62 * 64 + 1 + n % 62,
            _ => n,
        }
    }

    /// True when the prefilled addresses are all on this node (host-local is prefilled alike).
    fn on_this_node(self) -> bool {
        matches!(
            self,
            Prefill::ThisNodeThousand | Prefill::ThisNode | Prefill::ThisNodeNoGateway
        )
    }
}

struct Row {
    plugin: String,
    /// "direct" or "agent" for blockipam, "" for host-local.
    access: &'static str,
    prefill: &'static str,
    add: Vec<Duration>,
    del: Vec<Duration>,
    rss_kib: Option<u64>,
}

fn calls() -> usize {
    std::env::var("BLOCKIPAM_BENCH_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

fn env_for(command: &str, container: &str) -> Vec<(&'static str, String)> {
    vec![
        ("CNI_COMMAND", command.to_owned()),
        ("CNI_CONTAINERID", container.to_owned()),
        ("CNI_NETNS", format!("/var/run/netns/{container}")),
        ("CNI_IFNAME", "eth0".to_owned()),
        ("CNI_PATH", "/usr/lib/cni".to_owned()),
    ]
}

/// Runs one call; with `rss`, under `/usr/bin/time` and returns the peak RSS in KiB.
fn call(
    plugin: &Path,
    command: &str,
    container: &str,
    netconf: &[u8],
    rss: bool,
) -> (Duration, Option<u64>) {
    let mut cmd = if rss {
        let mut c = Command::new(TIME);
        c.args(["-f", "%M"]).arg(plugin);
        c
    } else {
        Command::new(plugin)
    };
    cmd.env_clear()
        .envs(env_for(command, container))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd.spawn().expect("start the plugin");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(netconf)
        .expect("write the netconf");
    let output = child.wait_with_output().expect("wait");
    let elapsed = started.elapsed();
    assert!(
        output.status.success(),
        "{} {command} {container} failed: {}\n{}",
        plugin.display(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let peak = rss.then(|| {
        String::from_utf8_lossy(&output.stderr)
            .lines()
            .last()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or(0)
    });
    (elapsed, peak)
}

fn measure(
    plugin_name: String,
    access: &'static str,
    prefill: &'static str,
    plugin: &Path,
    netconf: &Value,
) -> Row {
    let bytes = netconf.to_string().into_bytes();
    let n = calls();
    // Warm the page cache and the store once.
    call(plugin, "ADD", "warmup", &bytes, false);
    call(plugin, "DEL", "warmup", &bytes, false);
    let mut add = Vec::with_capacity(n);
    let mut del = Vec::with_capacity(n);
    for i in 0..n {
        add.push(call(plugin, "ADD", &format!("bench-{i}"), &bytes, false).0);
    }
    for i in 0..n {
        del.push(call(plugin, "DEL", &format!("bench-{i}"), &bytes, false).0);
    }
    let rss_kib = if Path::new(TIME).exists() {
        let mut peak = 0;
        for i in 0..20 {
            let container = format!("rss-{i}");
            peak = peak.max(call(plugin, "ADD", &container, &bytes, true).1.unwrap_or(0));
            peak = peak.max(call(plugin, "DEL", &container, &bytes, true).1.unwrap_or(0));
        }
        Some(peak)
    } else {
        None
    };
    Row {
        plugin: plugin_name,
        access,
        prefill,
        add,
        del,
        rss_kib,
    }
}

fn quantile(samples: &[Duration], q: f64) -> f64 {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(|a, b| a.total_cmp(b));
    if ms.is_empty() {
        return f64::NAN;
    }
    let index = ((ms.len() - 1) as f64 * q).round() as usize;
    ms[index]
}

/// Puts 10,000 addresses in the store through the allocator, each as the plugin's ADD records
/// it (one address per container, its handle `<network>.<container id>`, the attributes the plugin
/// records for a Kubernetes pod): on 100 other nodes, or all on [`NODE`]. Calls run concurrently,
/// each writer on blocks no other writer touches: one per node for the cluster, and on this node
/// [`PREFILL_WRITERS`] assigning specific addresses of their own blocks (what auto-assign would
/// have filled block by block).
async fn prefill_blockipam(store: Arc<dyn KvStore>, prefill: Prefill) {
    let ipam = Ipam::new(store);
    ipam.ensure_pool(&PoolSpec {
        cidr: POOL.parse().expect("cidr"),
        name: None,
        block_size: Some(26),
        disabled: false,
    })
    .await
    .expect("pool");
    if prefill == Prefill::Empty {
        return;
    }
    if prefill.on_this_node() {
        ipam.set_config(&IpamConfig {
            max_blocks_per_host: 0,
            ..IpamConfig::default()
        })
        .await
        .expect("config");
    }
    let mut writers = tokio::task::JoinSet::new();
    match prefill {
        Prefill::Cluster => {
            for node in 0..PREFILL / 100 {
                let ipam = ipam.clone();
                writers.spawn(async move {
                    let host = format!("node-{node:03}");
                    for n in node * 100..(node + 1) * 100 {
                        let (handle, attributes) = pod_allocation(n);
                        ipam.auto_assign(&AutoAssignRequest {
                            handle,
                            host: host.clone(),
                            num_v4: 1,
                            attributes,
                            ..AutoAssignRequest::default()
                        })
                        .await
                        .expect("prefill");
                    }
                });
            }
        }
        _ => {
            // From 10.128.64.0, clear of the gateway's block and the pool's last address.
            let first = u32::from(Ipv4Addr::new(10, 128, 64, 0));
            for writer in 0..PREFILL_WRITERS {
                let ipam = ipam.clone();
                writers.spawn(async move {
                    let mine = (0..prefill.count())
                        .filter(|n| (prefill.offset(*n) / 64) as usize % PREFILL_WRITERS == writer);
                    for n in mine {
                        let (handle, attributes) = pod_allocation(n);
                        let ip = Ipv4Addr::from(first + prefill.offset(n));
                        ipam.assign_ips(&AssignIpsRequest {
                            ips: vec![ip.into()],
                            handle,
                            host: NODE.to_owned(),
                            attributes,
                            purpose: Some(AllowedUse::Workload),
                            ..AssignIpsRequest::default()
                        })
                        .await
                        .expect("prefill");
                    }
                });
            }
        }
    }
    while let Some(done) = writers.join_next().await {
        done.expect("a prefill writer");
    }
}

/// The handle and attributes the plugin records for the `n`th prefilled pod's `eth0`: a 64-hex
/// container id, the pod's name and namespace (`CNI_ARGS`, as a CRI runtime sends them).
fn pod_allocation(n: usize) -> (String, BTreeMap<String, String>) {
    let container = format!("{:064x}", 0x00c0_ffee_u128 << 64 | n as u128);
    let args = CniArgs {
        ignore_unknown: true,
        pod_namespace: Some(format!("team-{:02}", n % 50)),
        pod_name: Some(format!("frontend-7d9f8b6c5-{n:05}")),
        infra_container_id: Some(container.clone()),
        pod_uid: Some(format!("{:08x}-0000-4000-8000-{n:012x}", n)),
        ..CniArgs::default()
    };
    (
        handle_id(NETWORK, &container),
        allocation_attributes(NETWORK, &container, "eth0", &args),
    )
}

fn blockipam_netconf(dir: &Path, settings: Value) -> Value {
    let mut ipam = json!({
        "type": "blockipam",
        "nodename": NODE,
        "ipam_lock_file": dir.join("ipam.lock"),
        "log_level": "warning",
        "pools": [{"cidr": POOL, "block_size": 26}],
        "gateway": GATEWAY
    });
    if let (Some(ipam), Value::Object(extra)) = (ipam.as_object_mut(), settings) {
        ipam.extend(extra);
    }
    json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "ptp", "ipam": ipam})
}

fn host_local_netconf(data_dir: &Path) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": "bench",
        "type": "ptp",
        "ipam": {
            "type": "host-local",
            "dataDir": data_dir,
            "ranges": [[{"subnet": POOL, "gateway": GATEWAY}]]
        }
    })
}

/// Writes host-local's files for 10,000 allocated addresses (`<dataDir>/<network>/<ip>`
/// holding `<container id>\r\n<ifname>`, and the last reserved address).
fn prefill_host_local(data_dir: &Path, count: usize) {
    let network = data_dir.join("bench");
    std::fs::create_dir_all(&network).expect("mkdir");
    let base = u32::from(Ipv4Addr::new(10, 128, 0, 2));
    let mut last = Ipv4Addr::new(10, 128, 0, 2);
    for i in 0..count as u32 {
        let ip = Ipv4Addr::from(base + i);
        std::fs::write(network.join(ip.to_string()), format!("prefill-{i}\r\neth0"))
            .expect("write");
        last = ip;
    }
    std::fs::write(network.join("last_reserved_ip.0"), last.to_string()).expect("write");
}

fn embedded(kind: DatastoreType, dir: &Path) -> (Value, DatastoreSettings) {
    let path = dir.join(format!("store.{}", kind.as_str()));
    let settings = DatastoreSettings {
        backend: Backend::embedded(kind, Some(path.clone())).expect("an embedded store type"),
        create_if_missing: true,
        ..DatastoreSettings::default()
    };
    (
        json!({"datastore_type": kind.as_str(), "datastore_path": path}),
        settings,
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// How the plugin reaches the store.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Direct,
    Agent,
}

impl Access {
    fn label(self) -> &'static str {
        match self {
            Access::Direct => "direct",
            Access::Agent => "agent",
        }
    }
}

/// Whether `BLOCKIPAM_BENCH_ONLY` selects the row labelled `label` (every word must be one of
/// the label's words: `sled,agent,0` is sled through the agent on the empty store only).
fn selected(label: &str) -> bool {
    match std::env::var("BLOCKIPAM_BENCH_ONLY") {
        Ok(words) => words
            .split(',')
            .map(str::trim)
            .filter(|w| !w.is_empty())
            .all(|w| label.split_whitespace().any(|token| token == w)),
        Err(_) => true,
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Measures blockipam on `kind` reached as `access`, after `prefill`.
fn measure_blockipam(kind: DatastoreType, access: Access, prefill: Prefill) -> Row {
    let prepared = prepare_blockipam(kind, access, prefill);
    measure(
        format!("blockipam ({})", kind.as_str()),
        access.label(),
        prefill.label(),
        shipped_plugin(),
        &prepared.netconf,
    )
}

/// A blockipam store ready for calls: its etcd (etcd rows), its directory, its agent (agent
/// rows) and the netconf that reaches it. Dropped in field order: the agent stops (and closes
/// the store) before the directory and the etcd go.
struct PreparedStore {
    _agent: Option<InProcessAgent>,
    _dir: tempfile::TempDir,
    _etcd: Option<EtcdServer>,
    netconf: Value,
}

/// Sets up blockipam on `kind` reached as `access` and allocates `prefill` in it.
fn prepare_blockipam(kind: DatastoreType, access: Access, prefill: Prefill) -> PreparedStore {
    // etcd rows get an etcd of their own, stopped after the row: a busy etcd (compacting,
    // collecting garbage after 10,000 allocations) must not slow the rows after it.
    let etcd = (kind == DatastoreType::Etcdv3)
        .then(|| EtcdServer::start().expect("start etcd (apt-get install etcd-server)"));
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let (mut netconf_settings, mut settings, agent_store_flags) = match &etcd {
        Some(etcd) => {
            let prefix = unique_prefix();
            (
                json!({"datastore_type": "etcdv3", "etcd_endpoints": etcd.endpoint(), "etcd_prefix": prefix}),
                DatastoreSettings {
                    backend: Backend::Etcd(EtcdSettings {
                        endpoints: vec![etcd.endpoint()],
                        prefix: Some(prefix.clone()),
                        ..EtcdSettings::default()
                    }),
                    ..DatastoreSettings::default()
                },
                ["--datastore-type", "etcdv3", "--etcd-endpoints"]
                    .map(OsString::from)
                    .into_iter()
                    .chain([
                        etcd.endpoint().into(),
                        "--etcd-prefix".into(),
                        prefix.into(),
                    ])
                    .collect::<Vec<OsString>>(),
            )
        }
        None => {
            let (netconf, settings) = embedded(kind, dir.path());
            let path = settings.resolved_path().expect("an embedded path");
            let flags = ["--datastore-type", kind.as_str(), "--datastore-path"]
                .map(OsString::from)
                .into_iter()
                .chain([path.into(), "--create-if-missing".into()])
                .collect();
            (netconf, settings, flags)
        }
    };
    let agent = match access {
        Access::Direct => {
            settings.agent_socket = None;
            if let Value::Object(extra) = &mut netconf_settings {
                extra.insert("agent_socket".into(), json!("none"));
            }
            None
        }
        Access::Agent => {
            settings.agent_socket = Some(socket.clone());
            if let Value::Object(extra) = &mut netconf_settings {
                extra.insert("agent_socket".into(), json!(socket));
            }
            Some(
                InProcessAgent::run_binary_with_flags(&socket, agent_store_flags)
                    .unwrap_or_else(|e| panic!("start the agent: {e}")),
            )
        }
    };
    let mut netconf = blockipam_netconf(dir.path(), netconf_settings);
    if prefill == Prefill::ThisNodeNoGateway {
        if let Some(ipam) = netconf["ipam"].as_object_mut() {
            ipam.remove("gateway");
        }
    }
    // The plugin creates the pool and reserves the gateway (as on a live node) before the
    // prefill takes its addresses.
    let setup = netconf.to_string().into_bytes();
    call(shipped_plugin(), "ADD", "setup", &setup, false);
    call(shipped_plugin(), "DEL", "setup", &setup, false);
    runtime().block_on(async {
        let store = settings.open().await.expect("open the store");
        prefill_blockipam(store, prefill).await;
    });
    PreparedStore {
        _agent: agent,
        _dir: dir,
        _etcd: etcd,
        netconf,
    }
}

/// ADD and DEL through the agent on an empty store and on one holding `prefill`, both set up
/// first and then called in turn, call by call (the store called first alternates each round), so
/// that the machine's drift over the minutes of a run falls on both alike.
struct Interleaved {
    store: &'static str,
    prefill: &'static str,
    empty: Row,
    filled: Row,
}

fn measure_interleaved(kind: DatastoreType, prefill: Prefill) -> Interleaved {
    let empty = prepare_blockipam(kind, Access::Agent, Prefill::Empty);
    let filled = prepare_blockipam(kind, Access::Agent, prefill);
    let plugin = shipped_plugin();
    let bytes = [&empty, &filled].map(|p| p.netconf.to_string().into_bytes());
    for netconf in &bytes {
        call(plugin, "ADD", "warmup", netconf, false);
        call(plugin, "DEL", "warmup", netconf, false);
    }
    let n = calls();
    let mut add = [Vec::with_capacity(n), Vec::with_capacity(n)];
    let mut del = [Vec::with_capacity(n), Vec::with_capacity(n)];
    for (command, samples) in [("ADD", &mut add), ("DEL", &mut del)] {
        for i in 0..n {
            let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
            for which in order {
                let container = format!("bench-{i}");
                samples[which].push(call(plugin, command, &container, &bytes[which], false).0);
            }
        }
    }
    let [empty_add, filled_add] = add;
    let [empty_del, filled_del] = del;
    let row = |prefill: Prefill, add, del| Row {
        plugin: format!("blockipam ({})", kind.as_str()),
        access: "agent, interleaved",
        prefill: prefill.label(),
        add,
        del,
        rss_kib: None,
    };
    Interleaved {
        store: kind.as_str(),
        prefill: prefill.label(),
        empty: row(Prefill::Empty, empty_add, empty_del),
        filled: row(prefill, filled_add, filled_del),
    }
}

/// The median over rounds of `ours[i] / theirs[i]`: each call against the baseline's call of the
/// same round (the upper median for an even count, as [`quantile`] takes it).
fn median_round_ratio(ours: &[Duration], theirs: &[Duration]) -> f64 {
    let mut ratios: Vec<f64> = ours
        .iter()
        .zip(theirs)
        .map(|(a, b)| a.as_secs_f64() / b.as_secs_f64())
        .collect();
    ratios.sort_by(|a, b| a.total_cmp(b));
    ratios.get(ratios.len() / 2).copied().unwrap_or(f64::NAN)
}

fn print_interleaved(runs: &[Interleaved]) {
    if runs.is_empty() {
        return;
    }
    println!(
        "\nThrough the agent, a store holding addresses against an empty one, called in turn call by call:\n"
    );
    println!(
        "| store | allocated before | ADD median ms (empty / filled) | ADD filled vs empty (medians) | ADD median of per-round ratios | DEL median ms (empty / filled) | DEL filled vs empty (medians) | DEL median of per-round ratios |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for run in runs {
        let (empty_add, filled_add) = (
            quantile(&run.empty.add, 0.5),
            quantile(&run.filled.add, 0.5),
        );
        let (empty_del, filled_del) = (
            quantile(&run.empty.del, 0.5),
            quantile(&run.filled.del, 0.5),
        );
        println!(
            "| {} | {} | {:.2} / {:.2} | {:.2}× | {:.2}× | {:.2} / {:.2} | {:.2}× | {:.2}× |",
            run.store,
            run.prefill,
            empty_add,
            filled_add,
            filled_add / empty_add,
            median_round_ratio(&run.filled.add, &run.empty.add),
            empty_del,
            filled_del,
            filled_del / empty_del,
            median_round_ratio(&run.filled.del, &run.empty.del),
        );
    }
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        // Built and started by `cargo test --all-targets`: measure only under `cargo bench`.
        println!("cni_latency: run with `cargo bench -p blockipam --bench cni_latency`");
        return;
    }
    assert!(
        Path::new(HOST_LOCAL).is_file(),
        "this benchmark runs Debian's host-local beside blockipam: apt-get install containernetworking-plugins"
    );
    eprintln!("building the shipped plugin (scripts/build-plugin) ...");
    eprintln!("timing {}", shipped_plugin().display());
    let load_before = load_average();
    let bare_at_start = bare_process_median();
    let mut rows = Vec::new();
    for prefill in [
        Prefill::Empty,
        Prefill::Cluster,
        Prefill::ThisNodeThousand,
        Prefill::ThisNode,
        Prefill::ThisNodeNoGateway,
    ] {
        if prefill != Prefill::Cluster {
            let dir = tempfile::tempdir().expect("temp dir");
            let data = dir.path().join("host-local");
            if prefill.on_this_node() {
                prefill_host_local(&data, prefill.count());
            }
            eprintln!("host-local, {} prefilled ...", prefill.label());
            rows.push(measure(
                "host-local".into(),
                "",
                prefill.label(),
                Path::new(HOST_LOCAL),
                &host_local_netconf(&data),
            ));
        }
        for kind in STORES {
            for access in [Access::Agent, Access::Direct] {
                let label = format!("{} {} {}", kind.as_str(), access.label(), prefill.label());
                if !selected(&label) {
                    continue;
                }
                eprintln!("blockipam {label} prefilled ...");
                rows.push(measure_blockipam(kind, access, prefill));
            }
        }
    }
    print_table(&rows);
    let mut interleaved = Vec::new();
    for prefill in [Prefill::ThisNode, Prefill::ThisNodeNoGateway] {
        for kind in STORES {
            let label = format!("{} agent interleaved {}", kind.as_str(), prefill.label());
            if !selected(&label) {
                continue;
            }
            eprintln!("blockipam {label} ...");
            interleaved.push(measure_interleaved(kind, prefill));
        }
    }
    print_interleaved(&interleaved);
    let bare_after = bare_process_median();
    if selected("sled agent 0") {
        print_breakdown();
    }
    println!(
        "\n{} calls per mode; host-local's row with as many addresses on its node is each row's baseline (`10k this node` for `10k cluster`). \
         Load average (1, 5, 15 min) before: {load_before}; after: {}. A bare process \
         (`/bin/true`, a busy machine shows here first): {bare_at_start:.2} ms before the table, \
         {bare_after:.2} ms after it.",
        calls(),
        load_average()
    );
}

/// The shipped build of the plugin (the static musl executable), built by `scripts/build-plugin`
/// on first use.
fn shipped_plugin() -> &'static Path {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let output = Command::new(BUILD_PLUGIN)
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {BUILD_PLUGIN}: {e}"));
        assert!(
            output.status.success(),
            "{BUILD_PLUGIN} failed (scripts/setup installs the musl target and musl-tools it needs)"
        );
        let path = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        assert!(
            Path::new(&path).is_file(),
            "{BUILD_PLUGIN} printed {path:?}, which is not a file"
        );
        path.into()
    })
}

/// Median time of starting `/bin/true` and waiting for it (ms): this machine's process floor.
fn bare_process_median() -> f64 {
    let times: Vec<Duration> = (0..200)
        .map(|_| {
            let started = Instant::now();
            let status = Command::new("/bin/true").status().expect("run /bin/true");
            assert!(status.success());
            started.elapsed()
        })
        .collect();
    quantile(&times, 0.5)
}

/// Where a call through the agent (sled, empty store) spends its time, measured piece by piece
/// in this run. The process pieces are interleaved call by call (a bare process, the plugin's own
/// start and exit with `VERSION`, an ADD, a DEL of a container that holds nothing, the ADD's DEL,
/// host-local's ADD and DEL on an empty data directory), so that a busy machine weighs on all of
/// them alike; then, from this process, the agent's
/// connect + hello, a read round trip (warm, and after the agent's threads parked) and a commit
/// round trip (the agent makes the commit durable before it answers), beside sled's own durable
/// commit in process.
fn print_breakdown() {
    const SAMPLES: usize = 200;
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let (mut netconf_settings, settings) = embedded(DatastoreType::Sled, dir.path());
    let path = settings.resolved_path().expect("an embedded path");
    let sled_commit = runtime().block_on(async {
        let own = DatastoreSettings {
            backend: Backend::Sled {
                path: Some(dir.path().join("in-process.sled")),
            },
            ..settings.clone()
        };
        let store = own.open_directly().await.expect("open sled");
        let mut times = Vec::with_capacity(SAMPLES);
        for i in 0..SAMPLES {
            let started = Instant::now();
            store
                .commit(Txn::new().then(Op::put(format!("bench/{i}"), vec![7u8; 300])))
                .await
                .expect("commit");
            times.push(started.elapsed());
        }
        quantile(&times, 0.5)
    });
    let store_flags = ["--datastore-type", "sled", "--datastore-path"]
        .map(OsString::from)
        .into_iter()
        .chain([path.into(), "--create-if-missing".into()])
        .collect();
    let _agent = InProcessAgent::run_binary_with_flags(&socket, store_flags)
        .unwrap_or_else(|e| panic!("start the agent: {e}"));
    if let Value::Object(extra) = &mut netconf_settings {
        extra.insert("agent_socket".into(), json!(socket));
    }
    let netconf = blockipam_netconf(dir.path(), netconf_settings)
        .to_string()
        .into_bytes();
    let plugin = shipped_plugin();
    call(plugin, "ADD", "setup", &netconf, false);
    call(plugin, "DEL", "setup", &netconf, false);
    // Another build of the plugin, timed call by call beside the shipped one on the same agent
    // (an A/B in one run): the test build, or the binary COMPARE_ENV names (a copy kept from
    // before a change).
    let (other, shown) = match std::env::var_os(COMPARE_ENV) {
        Some(path) => {
            let path = std::path::PathBuf::from(path);
            let shown = format!("{} ({COMPARE_ENV})", path.display());
            (path, shown)
        }
        None => (
            std::path::PathBuf::from(TEST_BUILD),
            "the test build (glibc, dynamically linked)".to_owned(),
        ),
    };
    let (mut bare, mut version, mut add, mut del_nothing, mut del) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut other_version, mut other_add, mut other_del) = (Vec::new(), Vec::new(), Vec::new());
    // host-local, empty, timed call by call beside the plugin: the ratio of the table's first
    // rows, with both sides under the same moment-to-moment load.
    let host_local_netconf = host_local_netconf(&dir.path().join("host-local"))
        .to_string()
        .into_bytes();
    let (mut host_local_add, mut host_local_del) = (Vec::new(), Vec::new());
    let version_call = |binary: &Path| {
        let started = Instant::now();
        let output = Command::new(binary)
            .env_clear()
            .env("CNI_COMMAND", "VERSION")
            .stdin(Stdio::null())
            .output()
            .expect("run the plugin");
        assert!(output.status.success());
        started.elapsed()
    };
    for i in 0..SAMPLES {
        let started = Instant::now();
        let status = Command::new("/bin/true").status().expect("run /bin/true");
        bare.push(started.elapsed());
        assert!(status.success());
        version.push(version_call(plugin));
        add.push(call(plugin, "ADD", &format!("c-{i}"), &netconf, false).0);
        del_nothing.push(call(plugin, "DEL", &format!("nothing-{i}"), &netconf, false).0);
        del.push(call(plugin, "DEL", &format!("c-{i}"), &netconf, false).0);
        let host_local = Path::new(HOST_LOCAL);
        let container = format!("h-{i}");
        host_local_add.push(call(host_local, "ADD", &container, &host_local_netconf, false).0);
        host_local_del.push(call(host_local, "DEL", &container, &host_local_netconf, false).0);
        other_version.push(version_call(&other));
        other_add.push(call(&other, "ADD", &format!("o-{i}"), &netconf, false).0);
        other_del.push(call(&other, "DEL", &format!("o-{i}"), &netconf, false).0);
    }
    // Each round's ratio, then their median: a drift of the machine between rounds cancels out.
    let add_round_ratio = median_round_ratio(&add, &host_local_add);
    let del_round_ratio = median_round_ratio(&del, &host_local_del);
    let [bare, version, add, del_nothing, del, host_local_add, host_local_del] = [
        bare,
        version,
        add,
        del_nothing,
        del,
        host_local_add,
        host_local_del,
    ]
    .map(|samples| quantile(&samples, 0.5));
    let (connect, read, idle_read, commit) = runtime()
        .block_on(async {
            let mut connect = Vec::with_capacity(SAMPLES);
            for _ in 0..SAMPLES {
                let started = Instant::now();
                let client = AgentStore::connect(AgentConfig::new(&socket))
                    .await
                    .expect("connect to the agent");
                connect.push(started.elapsed());
                drop(client);
            }
            let client = AgentStore::connect(AgentConfig::new(&socket))
                .await
                .expect("connect to the agent");
            let (mut read, mut idle_read, mut commit) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..SAMPLES {
                let started = Instant::now();
                client.get("bench/0").await.expect("get");
                read.push(started.elapsed());
                let started = Instant::now();
                client
                    .commit(Txn::new().then(Op::put(format!("bench/{i}"), vec![8u8; 300])))
                    .await
                    .expect("commit");
                commit.push(started.elapsed());
                // The agent's threads park when idle, as between two plugin calls.
                tokio::time::sleep(Duration::from_millis(5)).await;
                let started = Instant::now();
                client.get("bench/0").await.expect("get");
                idle_read.push(started.elapsed());
            }
            [connect, read, idle_read, commit].map(|samples| quantile(&samples, 0.5))
        })
        .into();
    println!(
        "\nWhere a call through the agent goes (sled, 0 allocated, the shipped static build, medians of {SAMPLES}, ms):\n"
    );
    println!("| piece | ms |\n|---|---|");
    println!("| a bare process (`/bin/true`), spawn to exit | {bare:.2} |");
    println!("| the plugin's start and exit (`VERSION`: no runtime, no store) | {version:.2} |");
    println!("| ADD through the agent: hello, one read, one commit | {add:.2} |");
    println!(
        "| DEL of a container that holds nothing: hello, one read, no commit | {del_nothing:.2} |"
    );
    println!("| DEL through the agent: hello, one read, one commit | {del:.2} |");
    println!("| host-local ADD, empty data directory, interleaved call by call with the above | {host_local_add:.2} |");
    println!("| host-local DEL, interleaved likewise | {host_local_del:.2} |");
    println!(
        "| ratio of those medians: ADD through the agent / host-local ADD; DEL / host-local DEL | {:.2}×; {:.2}× |",
        add / host_local_add,
        del / host_local_del
    );
    println!(
        "| median of the per-round ratios (each ADD over host-local's ADD of the same round); DEL likewise | {add_round_ratio:.2}×; {del_round_ratio:.2}× |"
    );
    println!("| connect + hello to the agent, from this process | {connect:.2} |");
    println!("| one read round trip, from this process | {read:.2} |");
    println!("| the same after 5 ms idle (the agent's threads parked) | {idle_read:.2} |");
    println!(
        "| one commit round trip (durable before the answer), from this process | {commit:.2} |"
    );
    println!("| sled's own durable commit, in process (no agent) | {sled_commit:.2} |");
    println!(
        "| ADD minus VERSION, connect + hello, idle read and commit: runtime, netconf, host lock, allocator, output, extra page faults | {:.2} |",
        add - version - connect - idle_read - commit
    );
    let [other_version, other_add, other_del] =
        [other_version, other_add, other_del].map(|samples| quantile(&samples, 0.5));
    println!("| `VERSION` of {shown}, interleaved with the above | {other_version:.2} |");
    println!("| ADD through the agent of {shown} | {other_add:.2} |");
    println!("| DEL through the agent of {shown} | {other_del:.2} |");
}

/// Prints the markdown table: medians, p90, peak RSS, the ratio to host-local's ADD median of the
/// same prefill, and the ratio of each mode's ADD median to its own empty-store one.
fn print_table(rows: &[Row]) {
    println!(
        "| plugin | store access | allocated before | ADD median ms | ADD p90 ms | DEL median ms | DEL p90 ms | peak RSS KiB | ADD median vs host-local | ADD median vs 0 allocated |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let add_median = |plugin: &str, access: &str, prefill: &str| {
        rows.iter()
            .find(|r| r.plugin == plugin && r.access == access && r.prefill == prefill)
            .map(|r| quantile(&r.add, 0.5))
    };
    for row in rows {
        let add = quantile(&row.add, 0.5);
        // host-local with as many addresses (all on its one node); for the cluster row, 10k.
        let baseline_prefill = if row.prefill == Prefill::Cluster.label() {
            Prefill::ThisNode.label()
        } else {
            row.prefill
        };
        let vs_host_local = add_median("host-local", "", baseline_prefill)
            .map(|b| format!("{:.2}×", add / b))
            .unwrap_or_default();
        let vs_empty = if row.prefill == Prefill::Empty.label() {
            String::new()
        } else {
            add_median(&row.plugin, row.access, Prefill::Empty.label())
                .map(|b| format!("{:.2}×", add / b))
                .unwrap_or_default()
        };
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {} |",
            row.plugin,
            row.access,
            row.prefill,
            add,
            quantile(&row.add, 0.9),
            quantile(&row.del, 0.5),
            quantile(&row.del, 0.9),
            row.rss_kib
                .map(|k| k.to_string())
                .unwrap_or_else(|| "n/a (no /usr/bin/time)".into()),
            vs_host_local,
            vs_empty
        );
    }
}
