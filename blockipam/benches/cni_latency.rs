//! Per-call CNI ADD/DEL latency and peak RSS of the `blockipam` binary beside Debian's `host-local`.
//!
//! Run: `cargo bench -p blockipam --bench cni_latency` (prints a markdown table).
//!
//! Every call is one process started with the CNI environment and the netconf on stdin, exactly as
//! a runtime starts it; the time is from spawn to exit. blockipam runs on sled, redb and etcd (a
//! throwaway `etcd` on loopback), host-local on its data directory, all in the same run, each
//! with 0 and with 10,000 addresses already allocated:
//! - blockipam is prefilled through the allocator API (after one plugin ADD/DEL has created the
//!   pool and reserved the gateway): "10k cluster" spreads them over 100 other nodes (100 each,
//!   what a node sees in a cluster), "10k this node" puts all of them on the benchmarked node
//!   (157 blocks of its own; `max_blocks_per_host` set to unlimited for that);
//! - host-local is prefilled by writing its data-directory files (one per address, as it does).
//!
//! Peak RSS comes from a second pass of the same calls under `/usr/bin/time -f %M`, so the
//! timings carry no wrapper. `BLOCKIPAM_BENCH_CALLS` sets the calls per mode (default 200).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_etcd::testing::{unique_prefix, EtcdServer};
use blockipam_store::{DatastoreSettings, DatastoreType};
use ipam_core::{AutoAssignRequest, Ipam, IpamConfig, KvStore, PoolSpec};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_blockipam");
const HOST_LOCAL: &str = "/usr/lib/cni/host-local";
const TIME: &str = "/usr/bin/time";
const POOL: &str = "10.128.0.0/16";
const GATEWAY: &str = "10.128.0.1";
const NODE: &str = "bench-node";
const PREFILL: usize = 10_000;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Prefill {
    Empty,
    Cluster,
    ThisNode,
}

impl Prefill {
    fn label(self) -> &'static str {
        match self {
            Prefill::Empty => "0",
            Prefill::Cluster => "10k cluster",
            Prefill::ThisNode => "10k this node",
        }
    }
}

struct Row {
    plugin: String,
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

fn measure(plugin_name: String, prefill: &'static str, plugin: &Path, netconf: &Value) -> Row {
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

/// Puts 10,000 addresses in the store through the allocator: on 100 other nodes, or all on
/// [`NODE`].
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
    if prefill == Prefill::ThisNode {
        ipam.set_config(&IpamConfig {
            max_blocks_per_host: 0,
            ..IpamConfig::default()
        })
        .await
        .expect("config");
    }
    let mut left = PREFILL;
    let mut batch = 0;
    while left > 0 {
        let node = match prefill {
            Prefill::Cluster => format!("node-{:03}", (PREFILL - left) / 100),
            _ => NODE.to_owned(),
        };
        // Up to 32 per request, never crossing a 100-address node boundary.
        let room = 100 - (PREFILL - left) % 100;
        let count = left.min(32).min(room);
        ipam.auto_assign(&AutoAssignRequest {
            handle: format!("prefill.{batch}"),
            host: node,
            num_v4: count as u32,
            attributes: BTreeMap::from([("interface".to_owned(), "eth0".to_owned())]),
            ..AutoAssignRequest::default()
        })
        .await
        .expect("prefill");
        left -= count;
        batch += 1;
    }
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
    json!({"cniVersion": "1.0.0", "name": "bench", "type": "ptp", "ipam": ipam})
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
fn prefill_host_local(data_dir: &Path) {
    let network = data_dir.join("bench");
    std::fs::create_dir_all(&network).expect("mkdir");
    let base = u32::from(Ipv4Addr::new(10, 128, 0, 2));
    let mut last = Ipv4Addr::new(10, 128, 0, 2);
    for i in 0..PREFILL as u32 {
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
        datastore_type: kind,
        path: Some(path.clone()),
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
    let etcd = EtcdServer::start().expect("start etcd (apt-get install etcd-server)");
    let mut rows = Vec::new();
    for prefill in [Prefill::Empty, Prefill::Cluster, Prefill::ThisNode] {
        if prefill != Prefill::ThisNode {
            let dir = tempfile::tempdir().expect("temp dir");
            let data = dir.path().join("host-local");
            if prefill == Prefill::Cluster {
                prefill_host_local(&data);
            }
            let label = if prefill == Prefill::Empty {
                "0"
            } else {
                "10k"
            };
            eprintln!("host-local, {label} prefilled ...");
            rows.push(measure(
                "host-local".into(),
                label,
                Path::new(HOST_LOCAL),
                &host_local_netconf(&data),
            ));
        }
        for kind in [
            DatastoreType::Sled,
            DatastoreType::Redb,
            DatastoreType::Etcdv3,
        ] {
            let dir = tempfile::tempdir().expect("temp dir");
            let (netconf_settings, settings) = match kind {
                DatastoreType::Etcdv3 => {
                    let prefix = unique_prefix();
                    (
                        json!({"datastore_type": "etcdv3", "etcd_endpoints": etcd.endpoint(), "etcd_prefix": prefix}),
                        DatastoreSettings {
                            datastore_type: kind,
                            etcd_endpoints: vec![etcd.endpoint()],
                            etcd_prefix: Some(prefix),
                            ..DatastoreSettings::default()
                        },
                    )
                }
                _ => embedded(kind, dir.path()),
            };
            eprintln!(
                "blockipam {}, {} prefilled ...",
                kind.as_str(),
                prefill.label()
            );
            let netconf = blockipam_netconf(dir.path(), netconf_settings);
            // The plugin creates the pool and reserves the gateway (as on a live node) before
            // the prefill takes 10,000 addresses.
            let setup = netconf.to_string().into_bytes();
            call(Path::new(BIN), "ADD", "setup", &setup, false);
            call(Path::new(BIN), "DEL", "setup", &setup, false);
            runtime().block_on(async {
                let store = settings.open().await.expect("open the store");
                prefill_blockipam(store, prefill).await;
            });
            rows.push(measure(
                format!("blockipam ({})", kind.as_str()),
                prefill.label(),
                Path::new(BIN),
                &netconf,
            ));
        }
    }
    println!(
        "| plugin | allocated before | ADD median ms | ADD p90 ms | DEL median ms | DEL p90 ms | peak RSS KiB | ADD median vs host-local |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let baseline = |prefill: &str| {
        let key = if prefill == "0" { "0" } else { "10k" };
        rows.iter()
            .find(|r| r.plugin == "host-local" && r.prefill == key)
            .map(|r| quantile(&r.add, 0.5))
    };
    for row in &rows {
        let add = quantile(&row.add, 0.5);
        let ratio = baseline(row.prefill)
            .map(|b| format!("{:.2}×", add / b))
            .unwrap_or_default();
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} |",
            row.plugin,
            row.prefill,
            add,
            quantile(&row.add, 0.9),
            quantile(&row.del, 0.5),
            quantile(&row.del, 0.9),
            row.rss_kib
                .map(|k| k.to_string())
                .unwrap_or_else(|| "n/a (no /usr/bin/time)".into()),
            ratio
        );
    }
    println!(
        "\n{} calls per mode; host-local `10k` rows are the baseline for both blockipam 10k rows.",
        calls()
    );
}
