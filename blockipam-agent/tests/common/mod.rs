//! Test helpers: the store factories that put an in-process agent between the conformance suite
//! and sled or redb, the plugin runner, and a fake agent's side of the protocol.

#![allow(dead_code)]

pub mod etcd_agents;
pub mod partition;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use backend_agent::protocol::{
    encode_frame, read_frame, write_frame, Request, RequestFrame, Response, ResponseFrame,
    StoreIdentity, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES,
};
use backend_agent::{AgentConfig, AgentStore};
use backend_redb::{RedbConfig, RedbStore};
use backend_sled::{SledConfig, SledStore};
use blockipam_agent::ServerConfig;
use conformance::embedded::EmbeddedFactory;
use conformance::{StoreFactory, TestStore};
use ipam_core::{KeyValue, KvError, KvStore, Read, ReadResult, Revision, Txn};
use tokio::net::UnixStream;

pub use test_kit::agent::InProcessAgent;
use test_kit::cni::{full_cni_env, run_cni, Outcome};

/// The embedded engine behind the agent.
#[derive(Debug, Clone, Copy)]
pub enum Backend {
    Sled,
    Redb,
}

impl Backend {
    pub async fn open(
        self,
        path: &Path,
        lock_wait: Duration,
        create_if_missing: bool,
    ) -> Result<Arc<dyn KvStore>, KvError> {
        Ok(match self {
            Backend::Sled => Arc::new(
                SledStore::open(SledConfig {
                    create_if_missing,
                    ..SledConfig::new(path).with_lock_wait(lock_wait)
                })
                .await?,
            ),
            Backend::Redb => Arc::new(
                RedbStore::open(RedbConfig {
                    create_if_missing,
                    ..RedbConfig::new(path).with_lock_wait(lock_wait)
                })
                .await?,
            ),
        })
    }
}

/// A client of an agent that serves the store only for as long as the client lives: "open" is
/// starting the agent on the store, "close" is stopping it.
#[derive(Debug)]
pub struct ServedStore {
    client: AgentStore,
    agent: InProcessAgent,
}

#[async_trait]
impl KvStore for ServedStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, KvError> {
        self.client.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<KeyValue>, KvError> {
        self.client.list(prefix).await
    }
    async fn commit(&self, txn: Txn) -> Result<Revision, KvError> {
        self.client.commit(txn).await
    }
    async fn read_many(&self, reads: &[Read]) -> Result<Vec<ReadResult>, KvError> {
        self.client.read_many(reads).await
    }
}

/// Conformance factory: sled or redb in a temporary directory, served by an in-process agent,
/// reached through `AgentStore`.
pub struct AgentFactory {
    pub backend: Backend,
}

#[async_trait]
impl StoreFactory for AgentFactory {
    fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Sled => "agent over sled",
            Backend::Redb => "agent over redb",
        }
    }

    async fn fresh(&self) -> TestStore {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = self
            .backend
            .open(&dir.path().join("store"), Duration::from_secs(10), true)
            .await
            .expect("open a fresh store");
        let agent = InProcessAgent::serve_on_current_runtime(store, ServerConfig::default());
        let client = agent.client().await;
        TestStore {
            store: Arc::new(client),
            guard: Box::new((agent, dir)),
        }
    }
}

#[async_trait]
impl EmbeddedFactory for AgentFactory {
    async fn open_at(
        &self,
        path: &Path,
        lock_wait: Duration,
        create_if_missing: bool,
    ) -> Result<Arc<dyn KvStore>, KvError> {
        let store = self
            .backend
            .open(path, lock_wait, create_if_missing)
            .await?;
        let agent = InProcessAgent::serve_at_on_current_runtime(
            &socket_beside(path),
            store,
            ServerConfig::default(),
        );
        let client = agent.client().await;
        Ok(Arc::new(ServedStore { client, agent }))
    }
}

/// A socket path of its own beside the store at `path`, in the directory the suite made for the
/// store (and removes): a child process the suite kills leaves its socket there, not in a
/// directory nobody removes.
fn socket_beside(path: &Path) -> PathBuf {
    static SERVED: AtomicUsize = AtomicUsize::new(0);
    let name = path.file_name().map_or_else(
        || "store".to_owned(),
        |name| name.to_string_lossy().into_owned(),
    );
    path.with_file_name(format!(
        "{name}.agent-{}-{}.sock",
        std::process::id(),
        SERVED.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Waits until `path` exists (a socket being bound), failing the test after `limit`.
pub fn wait_for_path(path: &Path, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} did not appear within {limit:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The real `blockipam` plugin, built once beside this test's `blockipam-agent` binary.
pub fn plugin() -> PathBuf {
    static PLUGIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PLUGIN
        .get_or_init(|| {
            test_kit::plugin::build_plugin_beside(Path::new(env!("CARGO_BIN_EXE_blockipam-agent")))
        })
        .clone()
}

/// Runs the real plugin once for `command` on `container` (interface eth0) with `netconf` on
/// stdin, killing it and failing the test if it outlives `hang_guard` (a safety net, not a timing
/// assertion).
pub fn run_plugin(
    command: &str,
    container: &str,
    netconf: &serde_json::Value,
    hang_guard: Duration,
) -> Outcome {
    let plugin = plugin();
    let plugin_dir = plugin.parent().expect("plugin dir").display().to_string();
    let env = full_cni_env(
        command,
        container,
        "eth0",
        "/var/run/netns/blockipam-agent-test",
        &plugin_dir,
    );
    run_cni(
        &plugin,
        &[],
        &env,
        netconf.to_string().as_bytes(),
        hang_guard,
    )
}

/// The store a fake agent says it serves.
pub fn fake_identity() -> StoreIdentity {
    StoreIdentity {
        datastore_type: "fake".into(),
        path: None,
        etcd_endpoints: vec![],
        etcd_prefix: None,
    }
}

/// A fake agent's side of the hello: reads the client's; returns its id and the version offered.
pub async fn read_hello(stream: &mut UnixStream) -> (u64, u32) {
    let hello: Option<RequestFrame> = read_frame(stream, MAX_REQUEST_BYTES)
        .await
        .expect("read the hello");
    match hello {
        Some(RequestFrame {
            id,
            request: Request::Hello { protocol },
        }) => (id, protocol),
        other => panic!("the first request was not a hello: {other:?}"),
    }
}

/// A fake agent's answer `response` to request `id`.
pub async fn answer(stream: &mut UnixStream, id: u64, response: Response) {
    let frame = encode_frame(&ResponseFrame { id, response }, MAX_RESPONSE_BYTES).expect("encode");
    write_frame(stream, &frame).await.expect("write an answer");
}

/// A fake agent's hello that accepts the version the client offers; returns that version.
pub async fn accept_hello(stream: &mut UnixStream) -> u32 {
    let (id, protocol) = read_hello(stream).await;
    let served = fake_identity();
    answer(stream, id, Response::Hello { protocol, served }).await;
    protocol
}

/// Child entry point of [`run_child_as`]: connects as whatever user it runs as and writes one key.
#[tokio::test]
#[ignore = "child process of run_child_as"]
async fn peer_credential_child() {
    let socket = std::env::var("BLOCKIPAM_TEST_AGENT_SOCKET").expect("socket variable");
    let outcome = match AgentStore::connect(AgentConfig::new(socket)).await {
        Ok(store) => store.put("from-child", b"x".to_vec()).await.map(|_| ()),
        Err(e) => Err(e),
    };
    match outcome {
        Ok(()) => println!("PEER-OUTCOME ok"),
        Err(KvError::Other { message }) => println!("PEER-OUTCOME other {message}"),
        Err(e) => println!("PEER-OUTCOME unexpected {e:?}"),
    }
}

/// Runs [`peer_credential_child`] as `uid` against the agent at `socket`; returns its outcome:
/// `ok`, `other <message>` (a refusal), or `unexpected <error>`.
pub fn run_child_as(uid: u32, socket: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    // The checkout may sit in a directory only root can enter (a CI clone under a 0700 temporary
    // directory): run a world-readable copy of this test binary instead.
    let exe = std::env::current_exe().expect("this test binary");
    let copy_dir = tempfile::tempdir().expect("a directory for the child's binary");
    std::fs::set_permissions(copy_dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("open the directory to the child's user");
    let copy = copy_dir.path().join("peer-credential-child");
    std::fs::copy(&exe, &copy).expect("copy this test binary");
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755))
        .expect("make the copy executable by the child's user");
    let output = std::process::Command::new(&copy)
        .args([
            "--exact",
            "common::peer_credential_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("BLOCKIPAM_TEST_AGENT_SOCKET", socket)
        .uid(uid)
        .gid(uid)
        .output()
        .expect("run the child as another user");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    stdout
        .lines()
        .find_map(|line| {
            line.split_once("PEER-OUTCOME ")
                .map(|(_, rest)| rest.to_owned())
        })
        .unwrap_or_else(|| {
            panic!(
                "the child (uid {uid}) printed no outcome: {}\nstdout:\n{stdout}\nstderr:\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            )
        })
}

/// Longest a scrape of an agent's metrics may take.
const METRICS_WAIT: Duration = Duration::from_secs(30);

/// The agent's metrics, from the endpoint its log names (`metrics endpoint listening on ...`).
pub fn scrape(log: &str) -> String {
    use std::io::{Read as _, Write as _};
    let (_, rest) = log
        .split_once("metrics endpoint listening on http://")
        .unwrap_or_else(|| panic!("the agent did not log its metrics address:\n{log}"));
    let (address, _) = rest
        .split_once("/metrics")
        .expect("a URL ending in /metrics");
    let address: std::net::SocketAddr = address.parse().expect("a socket address");
    let mut stream =
        std::net::TcpStream::connect_timeout(&address, METRICS_WAIT).expect("connect to metrics");
    stream
        .set_read_timeout(Some(METRICS_WAIT))
        .expect("read timeout");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("read the answer");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    answer
}

/// The value of the sample `name{labels}` in a scrape (0 when absent).
pub fn sample(metrics: &str, name_and_labels: &str) -> f64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0.0)
}
