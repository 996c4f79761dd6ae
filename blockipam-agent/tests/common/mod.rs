//! Test helpers: the store factories that put an in-process agent between the conformance suite
//! and sled or redb, the plugin runner, and a fake agent's side of the protocol.

#![allow(dead_code)]

pub mod etcd_agents;
pub mod partition;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use backend_agent::protocol::{
    encode_frame, read_frame, write_frame, Request, RequestFrame, Response, ResponseFrame,
    StoreIdentity, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES,
};
use backend_agent::AgentStore;
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
        let agent = InProcessAgent::serve_on_current_runtime(store, ServerConfig::default());
        let client = agent.client().await;
        Ok(Arc::new(ServedStore { client, agent }))
    }
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
