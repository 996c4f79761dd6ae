//! Dead-node reclaim end to end on a 3-member etcd cluster: three `blockipam-agent` processes
//! (nodes a, b, c) with a 2 s liveness TTL, a 10 s grace and a 1 s reclaim interval; addresses
//! allocated through the real plugin. Agent a is killed (SIGKILL): once the grace has passed its
//! blocks and addresses are gone and `blockipamctl check` is clean. Agent b is paused (SIGSTOP)
//! until its liveness key has expired and a reclaimer has marked it missing, then resumed: it is
//! never reclaimed and its liveness key comes back. Node c, and a node whose plugin runs without
//! an agent (never registered), are untouched. A second test has the reclaimer leader release
//! the empty blocks hosts no longer need (`--empty-block-release-seconds`).

mod common;

use std::io::Read as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backend_etcd::testing::{unique_prefix, EtcdCluster};
use backend_etcd::{EtcdConfig, EtcdStore};
use ipam_core::dead_nodes::{agent_key, liveness_key, Registration};
use ipam_core::{Ipam, KvStore};
use serde_json::{json, Value};

const AGENT: &str = env!("CARGO_BIN_EXE_blockipam-agent");
const TTL_SECONDS: &str = "2";
const GRACE_SECONDS: &str = "10";
/// Bound on every wait of this test (none is expected to come near it).
const WAIT_LIMIT: Duration = Duration::from_secs(45);

/// A `blockipam-agent` process on etcd; killed (SIGCONT first, in case it is paused) on drop.
struct Agent {
    node: &'static str,
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Agent {
    fn start(node: &'static str, socket: &Path, endpoints: &str, prefix: &str) -> Agent {
        Agent::start_with(node, socket, endpoints, prefix, &[])
    }

    fn start_with(
        node: &'static str,
        socket: &Path,
        endpoints: &str,
        prefix: &str,
        extra: &[&str],
    ) -> Agent {
        let mut child = Command::new(AGENT)
            .env_clear()
            .env("BLOCKIPAM_AGENT_LOG", "info")
            .arg("--socket")
            .arg(socket)
            .args(["--datastore-type", "etcdv3", "--etcd-endpoints", endpoints])
            .args(["--etcd-prefix", prefix, "--node", node])
            .args(["--liveness-ttl-seconds", TTL_SECONDS])
            .args(["--dead-node-grace-seconds", GRACE_SECONDS])
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

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} {} failed", self.node);
    }

    fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-CONT")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the real plugin once (bounded) and returns its exit status and stdout.
/// A current-thread runtime, and a store on `cluster` under `prefix` (the test's own view of what
/// the agents write).
fn connect(cluster: &EtcdCluster, prefix: &str) -> (tokio::runtime::Runtime, Arc<dyn KvStore>) {
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

fn cni_add(container: &str, netconf: &Value) -> (i32, String) {
    let run = common::run_plugin("ADD", container, netconf, WAIT_LIMIT);
    (run.status, run.stdout)
}

fn netconf(node: &str, socket: &str, endpoints: &str, prefix: &str, lock: &Path) -> Value {
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
            "pools": [{"cidr": "10.88.0.0/16", "block_size": 26, "name": "dead-pool"}]
        }
    })
}

/// Polls `condition` (an async check against the store) every 100 ms until it holds; fails the
/// test with `what` after [`WAIT_LIMIT`].
fn wait_until<F, Fut>(runtime: &tokio::runtime::Runtime, what: &str, mut condition: F)
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

async fn addresses_of(store: &Arc<dyn KvStore>, node: &str) -> usize {
    Ipam::new(Arc::clone(store))
        .list_allocations()
        .await
        .expect("list allocations")
        .iter()
        .filter(|a| a.attributes.get("node").map(String::as_str) == Some(node))
        .count()
}

async fn blocks_of(store: &Arc<dyn KvStore>, node: &str) -> usize {
    store
        .list(&ipam_core::model::keys::host_blocks_dir(node))
        .await
        .expect("list blocks")
        .len()
}

async fn registration(store: &Arc<dyn KvStore>, node: &str) -> Option<Registration> {
    store
        .get(&agent_key(node))
        .await
        .expect("read a registration")
        .map(|kv| serde_json::from_slice(&kv.value).expect("registration JSON"))
}

async fn is_live(store: &Arc<dyn KvStore>, node: &str) -> bool {
    store
        .get(&liveness_key(node))
        .await
        .expect("read a liveness key")
        .is_some()
}

#[test]
fn killed_agents_node_is_reclaimed_after_the_grace_and_a_paused_one_that_returns_is_not() {
    let cluster = EtcdCluster::start(3).expect("a 3-member etcd cluster (package etcd-server)");
    let endpoints = cluster.endpoints().join(",");
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = dir.path().join("ipam.lock");
    let (runtime, store) = connect(&cluster, &prefix);

    let socket = |node: &str| dir.path().join(format!("{node}.sock"));
    let agents: Vec<Agent> = ["node-a", "node-b", "node-c"]
        .into_iter()
        .map(|node| Agent::start(node, &socket(node), &endpoints, &prefix))
        .collect();
    for node in ["node-a", "node-b", "node-c"] {
        wait_until(
            &runtime,
            &format!("{node} is registered and live"),
            || async { registration(&store, node).await.is_some() && is_live(&store, node).await },
        );
    }

    // Two pods per node through the real plugin and that node's agent; two on a node whose
    // plugin runs without an agent (never registered).
    for (node, agent_socket) in [
        ("node-a", socket("node-a").display().to_string()),
        ("node-b", socket("node-b").display().to_string()),
        ("node-c", socket("node-c").display().to_string()),
        ("node-x", "none".to_owned()),
    ] {
        let conf = netconf(node, &agent_socket, &endpoints, &prefix, &lock);
        for pod in 0..2 {
            let (status, stdout) = cni_add(&format!("{node}-pod{pod}"), &conf);
            assert_eq!(status, 0, "ADD on {node}: {stdout}");
        }
    }
    for node in ["node-a", "node-b", "node-c", "node-x"] {
        assert_eq!(runtime.block_on(addresses_of(&store, node)), 2, "{node}");
    }

    let (agent_a, agent_b, agent_c) = (&agents[0], &agents[1], &agents[2]);
    agent_a.signal("KILL");
    agent_b.signal("STOP");
    // b's lease expires and a reclaimer marks b missing; then b resumes, well within the grace.
    wait_until(&runtime, "node-b is marked missing", || async {
        !is_live(&store, "node-b").await
            && registration(&store, "node-b")
                .await
                .is_some_and(|r| r.missing_since.is_some())
    });
    // Stay paused a while longer (still well within the grace): a reclaimer that ignored the
    // grace would release node-b now.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        runtime.block_on(registration(&store, "node-b")).is_some(),
        "node-b was reclaimed before its grace period had passed"
    );
    agent_b.signal("CONT");
    wait_until(
        &runtime,
        "node-b is live again, its mark cleared",
        || async {
            is_live(&store, "node-b").await
                && registration(&store, "node-b")
                    .await
                    .is_some_and(|r| r.missing_since.is_none())
        },
    );

    let log_b = agent_b.log();
    assert!(
        log_b.contains("the lease expired") && log_b.contains("registered again"),
        "node-b did not take a new lease and register again after its pause:\n{log_b}"
    );

    // a: reclaimed once the grace has passed.
    wait_until(&runtime, "node-a is reclaimed", || async {
        registration(&store, "node-a").await.is_none()
            && addresses_of(&store, "node-a").await == 0
            && blocks_of(&store, "node-a").await == 0
    });
    let logs = format!("{}\n{}", agent_b.log(), agent_c.log());
    assert!(
        logs.lines()
            .any(|l| l.contains("dead node reclaimed") && l.contains("node-a")),
        "no reclaimer logged the release of node-a:\n{logs}"
    );

    // b, c and the agent-less node x keep everything; b and c are registered and live.
    for node in ["node-b", "node-c", "node-x"] {
        assert_eq!(runtime.block_on(addresses_of(&store, node)), 2, "{node}");
        assert_eq!(runtime.block_on(blocks_of(&store, node)), 1, "{node}");
    }
    for node in ["node-b", "node-c"] {
        assert!(runtime.block_on(is_live(&store, node)), "{node} not live");
        assert!(
            runtime.block_on(registration(&store, node)).is_some(),
            "{node} lost its registration"
        );
    }
    assert!(runtime.block_on(registration(&store, "node-x")).is_none());
    assert!(
        !logs
            .lines()
            .any(|l| l.contains("dead node reclaimed") && !l.contains("node-a")),
        "another node was reclaimed:\n{logs}"
    );

    // The store is consistent.
    let env = blockipamctl::Env::new([
        ("DATASTORE_TYPE", "etcdv3".to_owned()),
        ("ETCD_ENDPOINTS", endpoints.clone()),
        ("ETCD_PREFIX", prefix.clone()),
        ("BLOCKIPAM_AGENT_SOCKET", "none".to_owned()),
    ]);
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let status = blockipamctl::run(["blockipamctl", "check"], &env, &mut out, &mut err, false);
    assert_eq!(
        status,
        0,
        "check: {}{}",
        String::from_utf8_lossy(&out),
        String::from_utf8_lossy(&err)
    );
    drop(agents);
    drop(cluster);
}

/// The reclaimer leader releases, by itself, the empty blocks hosts no longer need: a node's
/// empty blocks beyond its newest one go once empty for `--empty-block-release-seconds`; the
/// newest stays, and so does a block in use.
#[test]
fn the_reclaimer_leader_releases_empty_blocks_beyond_each_hosts_newest() {
    let cluster = EtcdCluster::start(1).expect("an etcd (package etcd-server)");
    let endpoints = cluster.endpoints().join(",");
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    let (runtime, store) = connect(&cluster, &prefix);
    // node-q (no agent) gets three /30 blocks and empties them; node-r keeps one in use.
    let ipam = Ipam::new(Arc::clone(&store));
    runtime.block_on(async {
        ipam.create_pool(&ipam_core::PoolSpec {
            cidr: "10.77.0.0/27".parse().expect("cidr"),
            name: Some("small".into()),
            block_size: Some(30),
            disabled: false,
        })
        .await
        .expect("pool");
        ipam.update_config(|c| c.max_blocks_per_host = 0)
            .await
            .expect("config");
        let many = ipam_core::AutoAssignRequest {
            handle: "q-pods".into(),
            host: "node-q".into(),
            num_v4: 9,
            ..Default::default()
        };
        ipam.auto_assign(&many).await.expect("node-q's addresses");
        ipam.release_handle("q-pods")
            .await
            .expect("release node-q's");
        let one = ipam_core::AutoAssignRequest {
            handle: "r-pod".into(),
            host: "node-r".into(),
            num_v4: 1,
            ..Default::default()
        };
        ipam.auto_assign(&one).await.expect("node-r's address");
    });
    assert_eq!(runtime.block_on(blocks_of(&store, "node-q")), 3);

    let agent = Agent::start_with(
        "node-a",
        &dir.path().join("a.sock"),
        &endpoints,
        &prefix,
        &["--empty-block-release-seconds", "1"],
    );
    wait_until(&runtime, "node-q is down to its newest block", || async {
        blocks_of(&store, "node-q").await == 1
    });
    assert!(
        agent.log().contains("released empty blocks"),
        "the agent did not log the release:\n{}",
        agent.log()
    );
    // A few more passes change nothing: the newest block and node-r's block in use stay.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(runtime.block_on(blocks_of(&store, "node-q")), 1);
    assert_eq!(runtime.block_on(blocks_of(&store, "node-r")), 1);
    assert_eq!(runtime.block_on(addresses_of(&store, "node-r")), 1);
    let report = runtime.block_on(ipam.check(false)).expect("check");
    assert!(report.problems.is_empty(), "{:#?}", report.problems);
}
