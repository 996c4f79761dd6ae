//! The agent as a real process, with the real plugin: SIGTERM (and its grace for a request in
//! flight, on an etcd the test stops), a live socket refused, peer credentials, a socket that
//! never answers (code 11), no socket (direct), SIGKILL in the middle of a churn of plugin calls
//! (the systemd units: tests/systemd.rs).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backend_agent::{AgentConfig, AgentStore};
use blockipam_agent::ServerConfig;
use ipam_core::KvStore;
use serde_json::{json, Value};

const AGENT: &str = env!("CARGO_BIN_EXE_blockipam-agent");
/// Longest a plugin call may take before the test calls it a hang.
const HANG_GUARD: Duration = Duration::from_secs(60);

/// A running `blockipam-agent` process; killed (SIGKILL) if still running when dropped.
struct AgentProcess {
    child: Child,
    socket: PathBuf,
    /// Everything the agent logged, read as it comes (a full pipe would stall the agent).
    log: Arc<Mutex<String>>,
}

impl AgentProcess {
    fn start(socket: &Path, store: &Path, extra: &[&str]) -> AgentProcess {
        let child = Command::new(AGENT)
            .env_clear()
            .env("BLOCKIPAM_AGENT_LOG", "debug")
            .arg("--socket")
            .arg(socket)
            .args(["--datastore-type", "sled", "--datastore-path"])
            .arg(store)
            .args(["--create-if-missing", "--lock-wait-seconds", "10"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start blockipam-agent");
        let mut child = child;
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
        let mut agent = AgentProcess {
            child,
            socket: socket.to_owned(),
            log,
        };
        agent.wait_until_serving();
        agent
    }

    /// Waits until the agent answers a hello on its socket.
    fn wait_until_serving(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let runtime = runtime();
        loop {
            if let Some(status) = self.child.try_wait().expect("poll the agent") {
                panic!(
                    "the agent exited ({status}) before serving: {}",
                    self.stderr()
                );
            }
            let connected = runtime.block_on(AgentStore::connect(
                AgentConfig::new(&self.socket)
                    .with_timeouts(Duration::from_secs(2), Duration::from_secs(10)),
            ));
            if connected.is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not serve within 30 s: {connected:?}"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} failed");
    }

    /// Waits for the exit (bounded) and returns its status and stderr.
    fn wait(mut self) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("poll the agent") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not exit within 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let stderr = self.stderr();
        (status, stderr)
    }

    fn stderr(&mut self) -> String {
        // Give the reader thread a moment to take the last lines of an exited agent.
        std::thread::sleep(Duration::from_millis(50));
        self.log.lock().expect("log").clone()
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// What one plugin call produced.
#[derive(Debug)]
struct Outcome {
    status: i32,
    stdout: String,
    /// Shown in failure messages (through `Debug`).
    #[allow(dead_code)]
    stderr: String,
}

impl Outcome {
    /// The CNI error code, when the call failed with an error JSON.
    fn error_code(&self) -> Option<u64> {
        if self.status == 0 {
            return None;
        }
        let value: Value = serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:#?}"));
        value["code"].as_u64()
    }

    /// The first address of a successful ADD.
    fn address(&self) -> String {
        let value: Value = serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:#?}"));
        value["ips"][0]["address"]
            .as_str()
            .unwrap_or_else(|| panic!("no address in {self:#?}"))
            .to_owned()
    }
}

/// Runs the real plugin once, failing the test if it runs longer than [`HANG_GUARD`].
fn cni(command: &str, container: &str, netconf: &Value) -> Outcome {
    let run = common::run_plugin(command, container, netconf, HANG_GUARD);
    Outcome {
        status: run.status,
        stdout: run.stdout,
        stderr: run.stderr,
    }
}

/// A netconf for node `node` on the sled store at `store`, reaching the agent at `socket`.
fn netconf(store: &Path, socket: &Path, lock: &Path, node: &str) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": "agentnet",
        "ipam": {
            "type": "blockipam",
            "nodename": node,
            "datastore_type": "sled",
            "datastore_path": store,
            "agent_socket": socket,
            "ipam_lock_file": lock,
            "ipam_lock_timeout_seconds": 2,
            "timeout_seconds": 30,
            "pools": [{"cidr": "10.77.0.0/16", "block_size": 26, "name": "agent-pool"}]
        }
    })
}

#[test]
fn sigterm_exits_cleanly_removes_the_socket_and_releases_the_store() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("run/agent.sock");
    let store = dir.path().join("store.sled");
    let agent = AgentProcess::start(&socket, &store, &[]);
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode(&socket), 0o600, "socket mode");
    assert_eq!(
        mode(socket.parent().expect("dir")),
        0o700,
        "socket directory mode"
    );

    let runtime = runtime();
    runtime.block_on(async {
        let client = AgentStore::connect(AgentConfig::new(&socket))
            .await
            .expect("connect");
        client.put("kept", b"yes".to_vec()).await.expect("put");
    });
    // blockipamctl reaches the store through the agent (BLOCKIPAM_AGENT_SOCKET); opening it
    // directly fails at once, the agent holding its lock.
    let ctl = |agent_socket: &str| {
        let env = blockipamctl::Env::new([
            ("DATASTORE_PATH", store.display().to_string()),
            ("BLOCKIPAM_AGENT_SOCKET", agent_socket.to_owned()),
            ("BLOCKIPAM_LOCK_WAIT_SECONDS", "0".to_owned()),
        ]);
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let status = blockipamctl::run(
            ["blockipamctl", "pool", "list"],
            &env,
            &mut out,
            &mut err,
            false,
        );
        (status, String::from_utf8_lossy(&err).into_owned())
    };
    let (status, err) = ctl(&socket.display().to_string());
    assert_eq!(status, 0, "blockipamctl through the agent: {err}");
    let (status, err) = ctl("none");
    assert_ne!(
        status, 0,
        "blockipamctl opened a store the agent holds: {err}"
    );

    // A second agent on a live socket is refused, and the first keeps serving.
    let second = Command::new(AGENT)
        .env_clear()
        .arg("--socket")
        .arg(&socket)
        .arg("--datastore-path")
        .arg(dir.path().join("other.sled"))
        .arg("--create-if-missing")
        .output()
        .expect("run a second agent");
    assert!(
        !second.status.success(),
        "a second agent started on a live socket"
    );
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(said.contains("another blockipam agent"), "{said}");

    agent.signal("TERM");
    let (status, stderr) = agent.wait();
    assert!(status.success(), "exit after SIGTERM: {status}\n{stderr}");
    assert!(!socket.exists(), "the socket is still there after SIGTERM");
    // The store was closed: it opens directly at once, with the write made through the agent.
    runtime.block_on(async {
        let direct = backend_sled::SledStore::open(
            backend_sled::SledConfig::new(&store).with_lock_wait(Duration::from_millis(100)),
        )
        .await
        .expect("the agent let go of the store");
        let kept = direct.get("kept").await.expect("get");
        assert_eq!(kept.map(|kv| kv.value), Some(b"yes".to_vec()));
    });
}

/// `--shutdown-grace-seconds` bounds how long SIGTERM waits for a request in flight: with etcd
/// stopped (SIGSTOP) under a commit the agent is serving, the agent abandons it after the grace it
/// was given (0.3 s here, against a default of 10 s) and says so.
#[test]
fn sigterm_abandons_a_request_in_flight_after_the_configured_shutdown_grace() {
    let etcd = test_kit::etcd::EtcdServer::start().expect("start etcd");
    let etcd_pid = etcd.pid().expect("etcd runs").to_string();
    let signal_etcd = |name: &str| {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(&etcd_pid)
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} etcd");
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let agent = common::etcd_agents::Agent::start_with(
        "node-grace",
        &socket,
        &etcd.endpoint(),
        "/grace/",
        &[
            "--shutdown-grace-seconds",
            "0.3",
            "--metrics-listen",
            "127.0.0.1:0",
            // One computation of the store's gauges, before etcd stops: later scrapes reuse it.
            "--metrics-cache-seconds",
            "3600",
        ],
    );
    // The client on a thread of its own: a put while etcd answers, then (once etcd is stopped)
    // the put left in flight.
    let (ready_tx, ready) = std::sync::mpsc::channel::<()>();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    let client_socket = socket.clone();
    let in_flight = std::thread::spawn(move || {
        runtime().block_on(async {
            let client = AgentStore::connect(
                AgentConfig::new(&client_socket)
                    .with_timeouts(Duration::from_secs(2), Duration::from_secs(60)),
            )
            .await
            .expect("connect");
            client
                .put("before", b"1".to_vec())
                .await
                .expect("a put while etcd answers");
            ready_tx.send(()).expect("ready");
            go_rx.recv().expect("go");
            client.put("during", b"2".to_vec()).await
        })
    });
    ready.recv().expect("the client's first put");
    let in_flight_now = |agent: &common::etcd_agents::Agent| {
        common::sample(
            &common::scrape(&agent.log()),
            "blockipam_agent_requests_in_flight",
        )
    };
    // The first put was answered: nothing is in flight.
    assert_eq!(in_flight_now(&agent), 0.0);
    signal_etcd("STOP");
    go.send(()).expect("go");
    let deadline = Instant::now() + Duration::from_secs(60);
    // The agent has read the second put and sent it on to the stopped etcd.
    while in_flight_now(&agent) < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the agent never read the second put"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    agent.signal("TERM");
    let mut agent = agent;
    let exited =
        |agent: &mut common::etcd_agents::Agent| agent.child.try_wait().expect("poll the agent");
    // etcd stays stopped until the agent has given up on the request (or has stopped).
    while !agent.log().contains("abandoned") && exited(&mut agent).is_none() {
        assert!(
            Instant::now() < deadline,
            "the agent neither gave up nor stopped"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_etcd("CONT");
    let status = loop {
        if let Some(status) = exited(&mut agent) {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not stop after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = agent.log();
    assert!(status.success(), "exit after SIGTERM: {status}\n{log}");
    assert!(
        log.contains("requests still running after the shutdown grace of 300ms: abandoned"),
        "{log}"
    );
    let answered = in_flight.join().expect("the client thread");
    assert!(
        answered.is_err(),
        "an abandoned request was answered: {answered:?}"
    );
}

/// Starts the agent for node `node` on a sled store to be created in a fresh directory, with
/// `flags` and `env` added, and gives it 30 s to refuse (an agent that accepted its settings
/// serves: it is killed then, and the exit code is `None`). Its exit code, its stderr, and what it
/// left in the directory.
fn start_to_be_refused(
    node: &str,
    flags: &[&str],
    env: &[(&str, &str)],
) -> (Option<i32>, String, Vec<std::ffi::OsString>) {
    let mut all = vec!["--create-if-missing", "--node", node];
    all.extend_from_slice(flags);
    start_until_served_or_exited(&all, env)
}

/// Starts the agent on the sled store `store.sled` of a fresh directory, socket `agent.sock`
/// beside it, with only `flags` and `env`; waits (30 s at most) until it serves its socket or
/// exits, and kills it if it serves. Its exit code (`None` when it served), its stderr, and what
/// it left in the directory.
fn start_until_served_or_exited(
    flags: &[&str],
    env: &[(&str, &str)],
) -> (Option<i32>, String, Vec<std::ffi::OsString>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let mut agent = Command::new(AGENT)
        .env_clear()
        .envs(env.iter().copied())
        .arg("--socket")
        .arg(&socket)
        .arg("--datastore-path")
        .arg(dir.path().join("store.sled"))
        .args(flags)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the agent");
    let deadline = Instant::now() + Duration::from_secs(30);
    while agent.try_wait().expect("poll the agent").is_none()
        && !socket.exists()
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = agent.kill();
    let ended = agent.wait_with_output().expect("the agent's exit");
    let made = std::fs::read_dir(dir.path())
        .expect("list the directory")
        .map(|entry| entry.expect("entry").file_name())
        .collect();
    (
        ended.status.code(),
        String::from_utf8_lossy(&ended.stderr).into_owned(),
        made,
    )
}

/// A dead-node grace etcd cannot time (its longest lease is 9,000,000,000 s) or a zero one is
/// refused as the flags are read, from the flag or its environment variable: status 2, nothing
/// made.
#[test]
fn a_dead_node_grace_etcd_cannot_time_is_refused_before_anything_is_made() {
    for (grace, from_env) in [("0", false), ("9000000001", false), ("9000000001", true)] {
        let (flags, env) = if from_env {
            (
                vec![],
                vec![("BLOCKIPAM_AGENT_DEAD_NODE_GRACE_SECONDS", grace)],
            )
        } else {
            (vec!["--dead-node-grace-seconds", grace], vec![])
        };
        let (code, stderr, made) = start_to_be_refused("node-1", &flags, &env);
        assert_eq!(code, Some(2), "{grace} {from_env}: {stderr}");
        assert!(
            stderr.contains("--dead-node-grace-seconds") && stderr.contains("1..=9000000000"),
            "{grace} {from_env}: {stderr}"
        );
        assert!(made.is_empty(), "{grace} {from_env} made {made:?}");
    }
}

#[test]
fn bad_settings_are_refused_before_anything_is_made() {
    let node_refused = "invalid --node";
    // A bad node name is refused as the agent starts (status 1); a bad number of seconds by the
    // flags' parsing (status 2, a usage error, as in blockipamctl).
    for (node, flags, code, flag, said) in [
        (
            "-",
            vec![],
            1,
            node_refused,
            "\"-\" is the network reservations' pseudo-node",
        ),
        (
            "a/b",
            vec![],
            1,
            node_refused,
            "host name \"a/b\" may not contain '/'",
        ),
        // A sled store with no leak collection uses no node name; a bad one given is refused all
        // the same.
        (
            "a/b",
            vec!["--leak-collection", "off"],
            1,
            node_refused,
            "host name \"a/b\" may not contain '/'",
        ),
        (
            "node-1",
            vec!["--shutdown-grace-seconds", "nan"],
            2,
            "--shutdown-grace-seconds",
            "expected 0 or more seconds, up to one day",
        ),
        (
            "node-1",
            vec!["--shutdown-grace-seconds", "86401"],
            2,
            "--shutdown-grace-seconds",
            "expected 0 or more seconds, up to one day",
        ),
        (
            "node-1",
            vec!["--metrics-cache-seconds", "99999999999"],
            2,
            "--metrics-cache-seconds",
            "expected 0 or more seconds, up to one day",
        ),
        (
            "node-1",
            vec!["--lock-wait-seconds=-1"],
            2,
            "--lock-wait-seconds",
            "expected 0 or more seconds, up to one day",
        ),
        (
            "node-1",
            vec!["--etcd-timeout-seconds", "0"],
            2,
            "--etcd-timeout-seconds",
            "expected more than 0 seconds, up to one day",
        ),
    ] {
        let (exit_code, stderr, made) = start_to_be_refused(node, &flags, &[]);
        assert_eq!(exit_code, Some(code), "--node {node} {flags:?}: {stderr}");
        assert!(
            stderr.contains(flag) && stderr.contains(said),
            "--node {node} {flags:?}: {stderr}"
        );
        assert!(made.is_empty(), "--node {node} {flags:?} made {made:?}");
    }
    // The same rule for a value from the environment, as a unit's Environment= gives it.
    let (exit_code, stderr, made) =
        start_to_be_refused("node-1", &[], &[("BLOCKIPAM_LOCK_WAIT_SECONDS", "ten")]);
    assert_eq!(exit_code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--lock-wait-seconds") && stderr.contains("expected 0 or more seconds"),
        "{stderr}"
    );
    assert!(made.is_empty(), "made {made:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_credentials_refuse_unallowed_uids_and_accept_allowed_ones() {
    use std::os::unix::fs::PermissionsExt;
    const NOBODY: u32 = 65534;
    assert_eq!(
        std::process::Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .expect("id -u"),
        "0",
        "this test switches users: run it as root (CI does)"
    );
    // (allowed uids, the agent's own uid, whether nobody is served): an agent running as nobody
    // serves nobody without naming it.
    for (allowed, own_uid, expect_ok) in [
        (vec![4242], Some(0), false),
        (vec![NOBODY], Some(0), true),
        (vec![], Some(NOBODY), true),
        (vec![], None, false),
    ] {
        let store: Arc<dyn KvStore> = Arc::new(ipam_core::MemoryStore::new());
        let agent = common::InProcessAgent::serve_on_current_runtime(
            Arc::clone(&store),
            ServerConfig {
                allowed_uids: allowed.clone(),
                own_uid,
                ..ServerConfig::default()
            },
        );
        // The temporary directory is the agent's to protect; open it so `nobody` reaches the socket.
        let dir = agent.socket.parent().expect("socket dir");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        // And the socket, which an agent running as nobody would own: what is left to keep a
        // peer out is its credentials.
        std::fs::set_permissions(&agent.socket, std::fs::Permissions::from_mode(0o666))
            .expect("chmod the socket");
        // Root is always allowed.
        agent
            .client()
            .await
            .put("from-root", b"r".to_vec())
            .await
            .expect("root is served");
        let socket = agent.socket.clone();
        let outcome = tokio::task::spawn_blocking(move || common::run_child_as(NOBODY, &socket))
            .await
            .expect("child");
        let child_wrote = store.get("from-child").await.expect("get").is_some();
        if expect_ok {
            assert_eq!(outcome, "ok", "allowed uid {NOBODY} was not served");
            assert!(child_wrote, "the allowed child's write is missing");
        } else {
            assert!(
                outcome.starts_with("other ") && outcome.contains("uid 65534 is not allowed"),
                "unallowed uid: {outcome}"
            );
            assert!(!child_wrote, "an unallowed peer wrote to the store");
        }
        agent.stop().await;
    }
}

#[test]
fn plugin_answers_code_11_in_bounded_time_when_the_socket_never_answers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    // Listens (connections queue in the backlog) but never accepts nor reads.
    let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
    let store = dir.path().join("store.sled");
    let conf = netconf(&store, &socket, &dir.path().join("lock"), "node-a");
    let outcome = cni("ADD", "silent-1", &conf);
    assert_eq!(outcome.error_code(), Some(11), "{outcome:#?}");
    assert!(
        outcome.stdout.contains(&socket.display().to_string())
            && outcome.stdout.contains("did not answer"),
        "{outcome:#?}"
    );
    assert!(
        !store.exists(),
        "the plugin opened the store directly although an agent socket is there"
    );
}

#[test]
fn plugin_opens_the_store_directly_when_there_is_no_socket_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = dir.path().join("store.sled");
    let conf = netconf(
        &store,
        &dir.path().join("absent.sock"),
        &dir.path().join("lock"),
        "node-a",
    );
    let outcome = cni("ADD", "direct-1", &conf);
    assert_eq!(outcome.status, 0, "{outcome:#?}");
    assert!(outcome.address().starts_with("10.77."), "{outcome:#?}");
    assert!(store.exists(), "no store created directly");
}

/// Whether a process other than this one has `path` open: a plugin waiting for the store's lock
/// holds the lock file open while it retries.
fn opened_by_another_process(path: &Path) -> bool {
    let own = std::process::id();
    let Ok(processes) = std::fs::read_dir("/proc") else {
        return false;
    };
    processes
        .flatten()
        .filter(|process| {
            // Processes only (not `self` or `thread-self`), and not this one.
            let pid = process
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok());
            pid.is_some_and(|pid| pid != own)
        })
        .filter_map(|process| std::fs::read_dir(process.path().join("fd")).ok())
        .flat_map(|fds| fds.flatten())
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target == path))
}

/// The sled store at `store` opened in this process, holding its lock, as a starting agent holds
/// it before it binds its socket; and the identity a plugin wants an agent of that store to serve.
async fn hold_the_store(store: &Path) -> (Arc<dyn KvStore>, backend_agent::StoreIdentity) {
    let opened = backend_sled::SledStore::open(backend_sled::SledConfig {
        create_if_missing: true,
        ..backend_sled::SledConfig::new(store)
    })
    .await
    .expect("open the store");
    let settings = blockipam_store::DatastoreSettings {
        backend: blockipam_store::Backend::Sled {
            path: Some(store.to_owned()),
        },
        ..blockipam_store::DatastoreSettings::default()
    };
    (Arc::new(opened), settings.identity())
}

/// A plugin call that found no socket and waits for the store's lock goes through the agent once
/// the agent holding the lock binds its socket: the window of an agent's start (store opened,
/// socket not bound yet), in which a call used to wait out the whole lock wait and fail. The
/// lock wait here is longer than the call's deadline: only a call that stops waiting for the lock
/// when the agent appears can succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waiting_for_the_lock_goes_through_the_agent_that_starts_meanwhile() {
    // Built before the wait below starts (a cold build takes minutes).
    common::plugin();
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("run/agent.sock");
    let store = dir.path().join("store.sled");
    let (held, served) = hold_the_store(&store).await;
    let mut conf = netconf(&store, &socket, &dir.path().join("lock"), "node-a");
    conf["ipam"]["ipam_lock_timeout_seconds"] = json!(600);
    conf["ipam"]["timeout_seconds"] = json!(30);
    let call = tokio::task::spawn_blocking(move || cni("ADD", "late-agent-1", &conf));
    let lock_file = std::fs::canonicalize(dir.path().join("store.sled.lock")).expect("lock file");
    let deadline = Instant::now() + HANG_GUARD;
    while !opened_by_another_process(&lock_file) {
        assert!(
            !call.is_finished(),
            "the call ended before it waited for the lock: {:#?}",
            call.await
        );
        assert!(
            Instant::now() < deadline,
            "the plugin never waited for the store's lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Several rounds of the wait pass with no agent before one appears.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let agent = common::InProcessAgent::serve_at_on_current_runtime(
        &socket,
        Arc::clone(&held),
        ServerConfig {
            served,
            ..ServerConfig::default()
        },
    );
    let outcome = call.await.expect("the plugin call");
    assert_eq!(outcome.status, 0, "{outcome:#?}");
    assert!(
        outcome
            .stderr
            .contains("an agent began serving the store while this call waited for its lock"),
        "{outcome:#?}"
    );
    let address = outcome.address();
    let allocations = ipam_core::Ipam::new(Arc::clone(&held))
        .list_allocations()
        .await
        .expect("list the allocations");
    assert!(
        allocations
            .iter()
            .any(|a| a.handle == "agentnet.late-agent-1"
                && address.starts_with(&format!("{}/", a.ip))),
        "{address} is not in the store: {allocations:#?}"
    );
    agent.stop().await;
}

/// The same wait with no agent ever appearing ends after the lock wait with "try again later"
/// (code 11), naming the socket it watched, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waiting_for_the_lock_fails_after_the_wait_when_no_agent_appears() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("run/agent.sock");
    let store = dir.path().join("store.sled");
    let (held, _) = hold_the_store(&store).await;
    let before = held.list("").await.expect("list");
    let mut conf = netconf(&store, &socket, &dir.path().join("lock"), "node-a");
    conf["ipam"]["ipam_lock_timeout_seconds"] = json!(1);
    let outcome = tokio::task::spawn_blocking(move || cni("ADD", "no-agent-1", &conf))
        .await
        .expect("the plugin call");
    assert_eq!(outcome.error_code(), Some(11), "{outcome:#?}");
    assert!(
        outcome.stdout.contains(&format!(
            "no agent began serving it at {}",
            socket.display()
        )),
        "{outcome:#?}"
    );
    assert_eq!(
        held.list("").await.expect("list"),
        before,
        "the store changed"
    );
}

/// One operation a simulated node asked for, and how it ended.
#[derive(Debug, Clone)]
enum Op {
    Add(String),
    Del(String),
}

/// SIGKILL of the agent while plugin processes of three nodes churn against it: every ADD
/// acknowledged is there afterwards with its address, no address is held twice, calls in
/// flight fail with code 11 only, calls after the kill open the store themselves (the dead
/// agent's socket is bypassed) and succeed, failed calls succeed when retried after a restart;
/// the store checks clean.
#[test]
fn sigkill_during_a_plugin_churn_loses_nothing_and_retries_succeed_after_restart() {
    const NODES: usize = 3;
    const OPS_PER_NODE: usize = 24;
    const KILL_AFTER_ACKS: usize = 15;
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let store = dir.path().join("store.sled");
    let agent = Arc::new(Mutex::new(Some(AgentProcess::start(&socket, &store, &[]))));
    let acks = Arc::new(Mutex::new(0usize));
    let killed = Arc::new(std::sync::atomic::AtomicBool::new(false));

    // Each node: ADD containers one after another, DEL every third one; record what happened.
    let workers: Vec<_> = (0..NODES)
        .map(|node| {
            let conf = netconf(
                &store,
                &socket,
                &dir.path().join(format!("lock-{node}")),
                &format!("node-{node}"),
            );
            let acks = Arc::clone(&acks);
            let agent = Arc::clone(&agent);
            let killed = Arc::clone(&killed);
            std::thread::spawn(move || {
                let mut live: BTreeMap<String, String> = BTreeMap::new();
                let mut failed: Vec<(Op, Outcome)> = Vec::new();
                let mut succeeded_after_kill = 0usize;
                for i in 0..OPS_PER_NODE {
                    let op = if i % 3 == 2 {
                        Op::Del(format!("n{node}-c{}", i - 1))
                    } else {
                        Op::Add(format!("n{node}-c{i}"))
                    };
                    let outcome = match &op {
                        Op::Add(c) => cni("ADD", c, &conf),
                        Op::Del(c) => cni("DEL", c, &conf),
                    };
                    if outcome.status == 0 {
                        if killed.load(std::sync::atomic::Ordering::SeqCst) {
                            succeeded_after_kill += 1;
                        }
                        match &op {
                            Op::Add(c) => {
                                live.insert(c.clone(), outcome.address());
                            }
                            Op::Del(c) => {
                                live.remove(c);
                            }
                        }
                        let mut count = acks.lock().expect("acks");
                        *count += 1;
                        if *count == KILL_AFTER_ACKS {
                            // SIGKILL while the other nodes are in the middle of their calls.
                            if let Some(mut process) = agent.lock().expect("agent").take() {
                                process.child.kill().expect("SIGKILL the agent");
                                let _ = process.child.wait();
                                killed.store(true, std::sync::atomic::Ordering::SeqCst);
                            }
                        }
                    } else {
                        // A DEL that failed leaves the container's state unknown until retried.
                        failed.push((op, outcome));
                    }
                }
                (conf, live, failed, succeeded_after_kill)
            })
        })
        .collect();
    let mut results = Vec::new();
    for worker in workers {
        results.push(worker.join().expect("node thread"));
    }
    assert!(
        killed.load(std::sync::atomic::Ordering::SeqCst),
        "the churn ended before the agent was killed"
    );
    for (_, _, failed, _) in &results {
        for (op, outcome) in failed {
            assert_eq!(
                outcome.error_code(),
                Some(11),
                "{op:?} failed with another code than 11: {outcome:#?}"
            );
        }
    }
    let after_kill: usize = results.iter().map(|r| r.3).sum();
    assert!(
        after_kill > 0,
        "no call succeeded after the kill: the dead agent's socket was not bypassed"
    );
    assert!(
        socket.exists(),
        "the killed agent's socket should be left behind"
    );

    // Restart (the stale socket is replaced) and retry every failed call until it succeeds.
    let restarted = AgentProcess::start(&socket, &store, &[]);
    let mut everything: BTreeMap<String, String> = BTreeMap::new();
    for (conf, mut live, failed, _) in results {
        for (op, _) in failed {
            let outcome = match &op {
                Op::Add(c) => cni("ADD", c, &conf),
                Op::Del(c) => cni("DEL", c, &conf),
            };
            assert_eq!(
                outcome.status, 0,
                "retry of {op:?} after restart: {outcome:#?}"
            );
            match op {
                Op::Add(c) => {
                    live.insert(c, outcome.address());
                }
                Op::Del(c) => {
                    live.remove(&c);
                }
            }
        }
        // Every acknowledged ADD is still there: a repeated ADD returns the same address.
        for (container, address) in &live {
            let again = cni("ADD", container, &conf);
            assert_eq!(again.status, 0, "{again:#?}");
            assert_eq!(
                &again.address(),
                address,
                "{container} lost its acknowledged address"
            );
        }
        everything.extend(live);
    }
    let distinct: BTreeSet<&String> = everything.values().collect();
    assert_eq!(
        distinct.len(),
        everything.len(),
        "an address is held twice: {everything:#?}"
    );

    // `blockipamctl check` through the restarted agent is clean.
    let mut out = Vec::new();
    let mut err = Vec::new();
    let status = blockipamctl::run(
        [
            "blockipamctl".into(),
            "--datastore-path".into(),
            store.clone().into_os_string(),
            "--agent-socket".into(),
            socket.clone().into_os_string(),
            "check".into(),
        ] as [std::ffi::OsString; 6],
        &blockipamctl::Env::default(),
        &mut out,
        &mut err,
        false,
    );
    assert_eq!(
        status,
        0,
        "blockipamctl check: {}\n{}",
        String::from_utf8_lossy(&out),
        String::from_utf8_lossy(&err)
    );
    restarted.signal("TERM");
    let (status, stderr) = restarted.wait();
    assert!(status.success(), "{stderr}");
}

/// A switch's environment variable is off for `false`, `no`, `off`, `0`, `n`, `f` (any case) and
/// the empty value, and on for anything else: an empty `BLOCKIPAM_AGENT_...=` line in
/// `/etc/default/blockipam-agent` does not stop the agent.
#[test]
fn switch_variables_are_off_for_falsey_and_empty_values_and_on_otherwise() {
    // Whether the agent served (it made the store) or refused at once (status 1, nothing made).
    let serves = |env: &[(&str, &str)], flags: &[&str]| -> bool {
        let mut all = vec!["--node", "node-1"];
        all.extend_from_slice(flags);
        let (code, stderr, made) = start_until_served_or_exited(&all, env);
        let store_made = made.iter().any(|name| name == "store.sled");
        match code {
            None => {
                assert!(store_made, "serving without a store: {stderr}");
                true
            }
            Some(code) => {
                assert_eq!(code, 1, "{env:?} {flags:?}: {stderr}");
                assert!(stderr.contains("no sled store at"), "{env:?}: {stderr}");
                assert!(made.is_empty(), "a refused start made {made:?}");
                false
            }
        }
    };
    let variable = "BLOCKIPAM_AGENT_CREATE_IF_MISSING";
    for value in ["", "false", "no", "off", "0", "n", "f", "FALSE", "Off"] {
        assert!(
            !serves(&[(variable, value)], &[]),
            "{variable}={value:?} created the store"
        );
    }
    for value in ["true", "yes", "on", "1", "y"] {
        assert!(
            serves(&[(variable, value)], &[]),
            "{variable}={value:?} did not create the store"
        );
    }
    // The other two switches accept an empty variable too (it used to stop the agent).
    for variable in [
        "BLOCKIPAM_AGENT_CREATE_ON_FIRST_START",
        "BLOCKIPAM_AGENT_NO_RECLAIM",
    ] {
        assert!(
            serves(&[(variable, "")], &["--create-if-missing"]),
            "{variable}= stopped the agent"
        );
    }
}

/// The socket directory the agent makes has the mode it means whatever the umask: 0711 with
/// `--allowed-uid` (so that the allowed users reach the socket), 0700 without.
#[test]
fn the_socket_directory_gets_its_mode_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    for (flags, wanted) in [(&["--allowed-uid", "4242"][..], 0o711), (&[][..], 0o700)] {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("run/agent.sock");
        // Started by a shell that sets the umask first.
        let mut command = Command::new("sh");
        command
            .env_clear()
            .args(["-c", "umask 077 && exec \"$0\" \"$@\"", AGENT])
            .arg("--socket")
            .arg(&socket)
            .arg("--datastore-path")
            .arg(dir.path().join("store.sled"))
            .args(["--create-if-missing", "--node", "node-1"])
            .args(flags)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut agent = command.spawn().expect("start the agent");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            assert!(
                agent.try_wait().expect("poll the agent").is_none(),
                "the agent exited before serving"
            );
            assert!(Instant::now() < deadline, "the agent did not serve");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mode = std::fs::metadata(socket.parent().expect("socket directory"))
            .expect("the socket directory")
            .permissions()
            .mode()
            & 0o7777;
        let _ = agent.kill();
        let _ = agent.wait();
        assert_eq!(mode, wanted, "{flags:?}: mode {mode:o}");
    }
}
