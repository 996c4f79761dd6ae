//! Real `blockipam-agent` processes on etcd for the multi-node tests: start, signal and read the
//! log of an agent; the test's own view of the store; the plugin run as a node's runtime runs it.

use std::io::Read as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backend_etcd::{EtcdConfig, EtcdStore};
use ipam_core::dead_nodes::{agent_key, liveness_key, Registration};
use ipam_core::{Ipam, KvStore};
use serde_json::{json, Value};
use test_kit::etcd::EtcdCluster;

pub const AGENT: &str = env!("CARGO_BIN_EXE_blockipam-agent");
pub const TTL_SECONDS: &str = "2";
pub const GRACE_SECONDS: &str = "10";
/// Bound on every wait of this test (none is expected to come near it).
pub const WAIT_LIMIT: Duration = Duration::from_secs(45);

/// A `blockipam-agent` process on etcd; killed (SIGCONT first, in case it is paused) on drop.
pub struct Agent {
    pub node: &'static str,
    pub child: Child,
    log: Arc<Mutex<String>>,
}

impl Agent {
    pub fn start(node: &'static str, socket: &Path, endpoints: &str, prefix: &str) -> Agent {
        Agent::start_with(node, socket, endpoints, prefix, &[])
    }

    pub fn start_with(
        node: &'static str,
        socket: &Path,
        endpoints: &str,
        prefix: &str,
        extra: &[&str],
    ) -> Agent {
        Agent::start_with_grace(node, socket, endpoints, prefix, GRACE_SECONDS, extra)
    }

    pub fn start_with_grace(
        node: &'static str,
        socket: &Path,
        endpoints: &str,
        prefix: &str,
        grace_seconds: &str,
        extra: &[&str],
    ) -> Agent {
        let mut command = Command::new(AGENT);
        command
            .env_clear()
            .env("BLOCKIPAM_AGENT_LOG", "info")
            .arg("--socket")
            .arg(socket)
            // No --datastore-type: endpoints alone select etcd, as in a Calico deployment.
            .args(["--etcd-endpoints", endpoints])
            .args(["--etcd-prefix", prefix, "--node", node]);
        if !extra.contains(&"--liveness-ttl-seconds") {
            command.args(["--liveness-ttl-seconds", TTL_SECONDS]);
        }
        let mut child = command
            .args(["--dead-node-grace-seconds", grace_seconds])
            .args(["--reclaim-interval-seconds", "1"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start blockipam-agent");
        let log = Arc::new(Mutex::new(String::new()));
        if let Some(mut pipe) = child.stderr.take() {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                let mut buffer = [0u8; 8192];
                while let Ok(n) = pipe.read(&mut buffer) {
                    if n == 0 {
                        break;
                    }
                    log.lock()
                        .expect("log")
                        .push_str(&String::from_utf8_lossy(&buffer[..n]));
                }
            });
        }
        let deadline = Instant::now() + WAIT_LIMIT;
        while !socket.exists() {
            if let Some(status) = child.try_wait().expect("poll the agent") {
                panic!(
                    "agent {node} exited ({status}) before serving: {}",
                    log.lock().expect("log")
                );
            }
            assert!(
                Instant::now() < deadline,
                "agent {node} did not bind its socket"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Agent { node, child, log }
    }

    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} {} failed", self.node);
    }

    pub fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    /// The log as it keeps growing, still readable once this agent is dropped (its last lines
    /// arrive after the process is gone).
    pub fn log_source(&self) -> Arc<Mutex<String>> {
        Arc::clone(&self.log)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Quietly: the agent may have exited already.
        let _ = Command::new("kill")
            .arg("-CONT")
            .arg(self.child.id().to_string())
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the real plugin once (bounded) and returns its exit status and stdout.
/// A current-thread runtime, and a store on `cluster` under `prefix` (the test's own view of what
/// the agents write).
pub fn connect(cluster: &EtcdCluster, prefix: &str) -> (tokio::runtime::Runtime, Arc<dyn KvStore>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let store = runtime
        .block_on(EtcdStore::connect(
            EtcdConfig::new(cluster.endpoints()).with_prefix(prefix.to_owned()),
        ))
        .expect("connect to etcd");
    (runtime, Arc::new(store))
}

pub fn cni_add(container: &str, netconf: &Value) -> (i32, String) {
    let run = super::run_plugin("ADD", container, netconf, WAIT_LIMIT);
    (run.status, run.stdout)
}

pub fn netconf(node: &str, socket: &str, endpoints: &str, prefix: &str, lock: &Path) -> Value {
    netconf_with_pool(node, socket, endpoints, prefix, lock, "10.88.0.0/16")
}

pub fn netconf_with_pool(
    node: &str,
    socket: &str,
    endpoints: &str,
    prefix: &str,
    lock: &Path,
    pool: &str,
) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": "deadnet",
        "ipam": {
            "type": "blockipam",
            "nodename": node,
            "datastore_type": "etcdv3",
            "etcd_endpoints": endpoints,
            "etcd_prefix": prefix,
            "agent_socket": socket,
            "ipam_lock_file": lock,
            "timeout_seconds": 30,
            "pools": [{"cidr": pool, "block_size": 26, "name": "dead-pool"}]
        }
    })
}

/// Polls `condition` (an async check against the store) every 100 ms until it holds; fails the
/// test with `what` after [`WAIT_LIMIT`].
pub fn wait_until<F, Fut>(runtime: &tokio::runtime::Runtime, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WAIT_LIMIT;
    while !runtime.block_on(condition()) {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub async fn addresses_of(store: &Arc<dyn KvStore>, node: &str) -> usize {
    Ipam::new(Arc::clone(store))
        .list_allocations()
        .await
        .expect("list allocations")
        .iter()
        .filter(|a| a.attributes.get("node").map(String::as_str) == Some(node))
        .count()
}

pub async fn blocks_of(store: &Arc<dyn KvStore>, node: &str) -> usize {
    store
        .list(&ipam_core::model::keys::host_blocks_dir(node))
        .await
        .expect("list blocks")
        .len()
}

pub async fn registration(store: &Arc<dyn KvStore>, node: &str) -> Option<Registration> {
    store
        .get(&agent_key(node))
        .await
        .expect("read a registration")
        .map(|kv| serde_json::from_slice(&kv.value).expect("registration JSON"))
}

pub async fn is_live(store: &Arc<dyn KvStore>, node: &str) -> bool {
    store
        .get(&liveness_key(node))
        .await
        .expect("read a liveness key")
        .is_some()
}

/// The address an ADD returned.
pub fn added_address(container: &str, conf: &Value) -> String {
    let (status, stdout) = cni_add(container, conf);
    assert_eq!(status, 0, "ADD {container}: {stdout}");
    let result: Value = serde_json::from_str(&stdout).expect("ADD result JSON");
    result["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .expect("an address")
        .to_owned()
}

/// Every allocated address of `node`, by handle.
pub async fn held_by(
    store: &Arc<dyn KvStore>,
    node: &str,
) -> std::collections::BTreeMap<String, String> {
    Ipam::new(Arc::clone(store))
        .list_allocations()
        .await
        .expect("list allocations")
        .into_iter()
        .filter(|a| a.attributes.get("node").map(String::as_str) == Some(node))
        .map(|a| (a.handle, a.ip.to_string()))
        .collect()
}

/// Runs `blockipamctl` in this process against the cluster; returns its status and output.
pub fn ctl(endpoints: &str, prefix: &str, args: &[&str]) -> (i32, String) {
    let env = blockipamctl::Env::new([
        ("DATASTORE_TYPE", "etcdv3".to_owned()),
        ("ETCD_ENDPOINTS", endpoints.to_owned()),
        ("ETCD_PREFIX", prefix.to_owned()),
        ("BLOCKIPAM_AGENT_SOCKET", "none".to_owned()),
    ]);
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut argv = vec!["blockipamctl"];
    argv.extend_from_slice(args);
    let status = blockipamctl::run(argv, &env, &mut out, &mut err, false);
    (
        status,
        format!(
            "{}{}",
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&err)
        ),
    )
}
