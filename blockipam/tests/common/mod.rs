//! Test support shared by the integration tests.
//!
//! Test support shared by the integration tests: a sandbox (temporary store, lock file and
//! node-name file, and in [`Mode::Agent`] an agent serving the store), netconf builders, and
//! runners for the real `blockipam` binary and the in-process library entry point.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use std::sync::Mutex;

use blockipam_store::{Backend, DatastoreSettings, DatastoreType};
use ipam_core::{Ipam, KvStore};
use serde_json::{json, Value};

pub use test_kit::agent::InProcessAgent;
pub use test_kit::block_on;
pub use test_kit::cni::{cni_env, Outcome};
use test_kit::cni::{run_cni, HANG_GUARD};

/// How the plugin under test reaches a sandbox's store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The plugin opens the store itself (no agent).
    Direct,
    /// An agent holds the store open and the netconf's `agent_socket` names its socket: the
    /// plugin can only reach the store through it (the agent holds the store's lock).
    Agent,
}

/// The test build of the plugin: the one with crash points (`BLOCKIPAM_FAULT`), which the crash
/// tests need. Every other test runs [`plugin_binary`].
pub const BIN: &str = env!("CARGO_BIN_EXE_blockipam");

/// Names another build of the plugin for the tests that run the binary (not the crash tests):
/// `scripts/test` runs them a second time on the static build that is shipped.
pub const PLUGIN_ENV: &str = "BLOCKIPAM_TEST_PLUGIN";

/// The binary under test: the build [`PLUGIN_ENV`] names, else the test build ([`BIN`]).
pub fn plugin_binary() -> &'static Path {
    static CHOSEN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    CHOSEN.get_or_init(|| match std::env::var_os(PLUGIN_ENV) {
        Some(path) => {
            let path = PathBuf::from(path);
            assert!(
                path.is_file(),
                "{PLUGIN_ENV} names {}, which is not a file",
                path.display()
            );
            path
        }
        None => PathBuf::from(BIN),
    })
}

/// Every spec version the plugin supports.
pub const VERSIONS: [&str; 7] = [
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// The network name every netconf here uses.
pub const NETWORK: &str = "testnet";

/// The node name every netconf here uses.
pub const NODE: &str = "node-a";

/// A temporary directory holding one test's store, lock file and node-name file; in
/// [`Mode::Agent`] also the agent serving that store (started by the first netconf or store
/// access, stopped before the directory is removed).
#[derive(Debug)]
pub struct Sandbox {
    /// The agent (agent mode). Declared first so that it stops before `dir` is removed.
    agent: Mutex<AgentState>,
    /// The directory (removed on drop).
    pub dir: tempfile::TempDir,
    /// Which embedded store.
    pub store_type: DatastoreType,
    /// How the plugin reaches the store.
    pub mode: Mode,
}

/// Where a sandbox's agent is.
#[derive(Debug)]
enum AgentState {
    /// Not started yet (or direct mode).
    NotStarted,
    /// Serving the sandbox's store.
    Serving(InProcessAgent),
    /// It refused to start and [`Sandbox::start_agent`] handed that to the test: the plugin
    /// finds no socket and opens the store directly.
    Refused,
}

impl Sandbox {
    /// A sandbox with a sled store.
    pub fn new() -> Self {
        Self::with_store(DatastoreType::Sled)
    }

    /// A sandbox with the given embedded store.
    pub fn with_store(store_type: DatastoreType) -> Self {
        Self::with_store_in_mode(store_type, Mode::Direct)
    }

    /// A sandbox with a sled store, reached as `mode` says.
    pub fn in_mode(mode: Mode) -> Self {
        Self::with_store_in_mode(DatastoreType::Sled, mode)
    }

    /// A sandbox with the given embedded store, reached as `mode` says.
    pub fn with_store_in_mode(store_type: DatastoreType, mode: Mode) -> Self {
        Sandbox {
            agent: Mutex::new(AgentState::NotStarted),
            dir: tempfile::Builder::new()
                .prefix("blockipam-test-")
                .tempdir()
                .expect("temp dir"),
            store_type,
            mode,
        }
    }

    /// The agent's socket (agent mode).
    pub fn agent_socket(&self) -> PathBuf {
        self.dir.path().join("run/agent.sock")
    }

    /// Starts the agent on this sandbox's store (agent mode; once). Only tests that expect the
    /// agent to refuse the store call it: a refusal returned here is the test's to check, and
    /// later netconfs name the socket where no agent listens (the plugin then opens the store
    /// directly, as on a node whose agent cannot start). Any other start failure panics.
    ///
    /// # Errors
    /// The agent's message when it refuses to start.
    pub fn start_agent(&self) -> Result<(), String> {
        assert_eq!(self.mode, Mode::Agent, "start_agent in direct mode");
        let mut state = self.agent.lock().expect("agent state");
        if let AgentState::NotStarted = *state {
            match InProcessAgent::run_binary(
                &self.agent_socket(),
                self.store_type,
                &self.store_path(),
            ) {
                Ok(agent) => *state = AgentState::Serving(agent),
                Err(refusal) => {
                    *state = AgentState::Refused;
                    return Err(refusal);
                }
            }
        }
        Ok(())
    }

    /// In agent mode, makes sure the agent serves (starting it on first use).
    fn ensure_agent(&self) {
        if self.mode != Mode::Agent {
            return;
        }
        let mut state = self.agent.lock().expect("agent state");
        if let AgentState::NotStarted = *state {
            let agent = InProcessAgent::run_binary(
                &self.agent_socket(),
                self.store_type,
                &self.store_path(),
            )
            .unwrap_or_else(|e| panic!("the sandbox's agent did not start: {e}"));
            *state = AgentState::Serving(agent);
        }
    }

    /// Whether an agent serves this sandbox's store right now.
    pub fn agent_serving(&self) -> bool {
        matches!(
            *self.agent.lock().expect("agent state"),
            AgentState::Serving(_)
        )
    }

    /// The store's path.
    pub fn store_path(&self) -> PathBuf {
        let name = match self.store_type {
            DatastoreType::Redb => "store.redb",
            _ => "store.sled",
        };
        self.dir.path().join(name)
    }

    /// The host lock's path.
    pub fn lock_path(&self) -> PathBuf {
        self.dir.path().join("run/ipam.lock")
    }

    /// The `ipam` object: this sandbox's store and lock, node [`NODE`], the test pools (IPv4
    /// 10.244.7.0/24 in /26 blocks, IPv6 fd00:10:244::/120 in /122 blocks) and their gateways,
    /// in agent mode the agent's socket (the agent is started here on first use), with `extra`
    /// merged over it (a `null` value removes a key).
    pub fn ipam(&self, extra: Value) -> Value {
        let mut ipam = json!({
            "type": "blockipam",
            "nodename": NODE,
            "datastore_type": self.store_type.as_str(),
            "datastore_path": self.store_path(),
            "ipam_lock_file": self.lock_path(),
            "pools": [
                {"cidr": "10.244.7.0/24", "block_size": 26, "name": "test-v4"},
                {"cidr": "fd00:10:244::/120", "block_size": 122, "name": "test-v6"}
            ],
            "gateway": ["10.244.7.1", "fd00:10:244::1"]
        });
        if self.mode == Mode::Agent {
            self.ensure_agent();
            merge(&mut ipam, json!({"agent_socket": self.agent_socket()}));
        }
        merge(&mut ipam, extra);
        ipam
    }

    /// A whole netconf at `version` with [`Sandbox::ipam`]`(extra)`.
    pub fn netconf(&self, version: &str, extra: Value) -> Value {
        json!({"cniVersion": version, "name": NETWORK, "ipam": self.ipam(extra)})
    }

    /// Opens this sandbox's store, creating it when missing (no plugin may be running on it);
    /// in agent mode through the agent (which holds it), and only through it.
    pub async fn open_store(&self) -> std::sync::Arc<dyn KvStore> {
        self.ensure_agent();
        DatastoreSettings {
            backend: Backend::embedded(self.store_type, Some(self.store_path()))
                .expect("an embedded store type"),
            create_if_missing: true,
            agent_socket: (self.mode == Mode::Agent).then(|| self.agent_socket()),
            ..DatastoreSettings::default()
        }
        .open()
        .await
        .expect("open the sandbox store")
    }

    /// Every key and value in the store, or an empty list when it was never created.
    pub fn snapshot(&self) -> Vec<(String, Vec<u8>)> {
        if !self.store_path().exists() {
            return Vec::new();
        }
        block_on(async {
            let store = self.open_store().await;
            store
                .list("")
                .await
                .expect("list the store")
                .into_iter()
                .map(|kv| (kv.key, kv.value))
                .collect()
        })
    }

    /// Runs `f` on an allocator over this sandbox's store, then closes it.
    pub fn with_ipam<T>(&self, f: impl AsyncFnOnce(&Ipam) -> T) -> T {
        block_on(async {
            let ipam = Ipam::new(self.open_store().await);
            f(&ipam).await
        })
    }

    /// Overwrites every object stored under `prefix` with bytes that do not decode; returns them as
    /// they were, for [`Sandbox::restore`].
    pub fn damage_under(&self, prefix: &str) -> Vec<(String, Vec<u8>)> {
        let prefix = prefix.to_owned();
        self.with_ipam(async move |ipam: &Ipam| {
            let intact = ipam.store().list(&prefix).await.expect("list");
            for kv in &intact {
                ipam.store()
                    .put(&kv.key, b"garbage{".to_vec())
                    .await
                    .expect("damage it");
            }
            intact.into_iter().map(|kv| (kv.key, kv.value)).collect()
        })
    }

    /// Writes back objects as [`Sandbox::damage_under`] returned them.
    pub fn restore(&self, objects: Vec<(String, Vec<u8>)>) {
        self.with_ipam(async move |ipam: &Ipam| {
            for (key, value) in objects {
                ipam.store().put(&key, value).await.expect("restore");
            }
        });
    }

    /// Every allocation in the store as (address, handle, attributes).
    pub fn allocations(&self) -> Vec<(String, String, BTreeMap<String, String>)> {
        if !self.store_path().exists() {
            return Vec::new();
        }
        self.with_ipam(async |ipam| {
            ipam.list_allocations()
                .await
                .expect("list allocations")
                .into_iter()
                .map(|a| (a.ip.to_string(), a.handle, a.attributes))
                .collect()
        })
    }

    /// The allocations of containers (everything but the network's reservations).
    pub fn container_allocations(&self) -> Vec<(String, String, BTreeMap<String, String>)> {
        self.allocations()
            .into_iter()
            .filter(|(_, handle, _)| !handle.ends_with(":gateway"))
            .collect()
    }
}

impl Default for Sandbox {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether this test process runs as root (its real uid in `/proc/self/status`), as the tests that
/// create network namespaces and run containerd need.
pub fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
        })
        .is_some_and(|uid| uid == "0")
}

/// Merges `extra` into `base` (objects only; `null` removes the key).
pub fn merge(base: &mut Value, extra: Value) {
    if let (Some(base), Value::Object(extra)) = (base.as_object_mut(), extra) {
        for (key, value) in extra {
            if value.is_null() {
                base.remove(&key);
            } else {
                base.insert(key, value);
            }
        }
    }
}

/// Runs the real binary with exactly `env` and `stdin`.
pub fn exec(env: &[(String, String)], stdin: &[u8]) -> Outcome {
    exec_bin(plugin_binary(), env, stdin)
}

/// Runs `bin` with exactly `env` and `stdin`.
pub fn exec_bin(bin: &Path, env: &[(String, String)], stdin: &[u8]) -> Outcome {
    run_cni(bin, &[], env, stdin, HANG_GUARD)
}

/// The CNI environment for `command` on (`container`, `ifname`), plus `extra_env`.
fn call_env(
    command: &str,
    container: &str,
    ifname: &str,
    extra_env: &[(&str, &str)],
) -> Vec<(String, String)> {
    let mut env = cni_env(command, container, ifname);
    env.extend(
        extra_env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    env
}

/// Runs the binary for `command` on (`container`, `ifname`) with `netconf` on stdin and
/// `extra_env` added (e.g. `CNI_ARGS`).
pub fn cni(
    command: &str,
    container: &str,
    ifname: &str,
    netconf: &Value,
    extra_env: &[(&str, &str)],
) -> Outcome {
    let env = call_env(command, container, ifname, extra_env);
    exec(&env, netconf.to_string().as_bytes())
}

/// Runs the library in-process, as the binary would.
pub fn run_in_process(env: &[(String, String)], stdin: &[u8]) -> Outcome {
    let env: BTreeMap<String, String> = env.iter().cloned().collect();
    let mut input = stdin;
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    let status = blockipam::run(&env, &mut input, &mut stdout, &mut stderr);
    Outcome {
        status,
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    }
}

/// In-process counterpart of [`cni`].
pub fn cni_in_process(
    command: &str,
    container: &str,
    ifname: &str,
    netconf: &Value,
    extra_env: &[(&str, &str)],
) -> Outcome {
    let env = call_env(command, container, ifname, extra_env);
    run_in_process(&env, netconf.to_string().as_bytes())
}

/// The first address (without prefix) of an ADD result of spec 0.3.0 or later.
pub fn first_address(result: &Value) -> String {
    let address = result["ips"][0]["address"]
        .as_str()
        .unwrap_or_else(|| panic!("no ips[0].address in {result}"));
    address.split('/').next().expect("address").to_owned()
}

/// Every address (without prefix) of an ADD result of spec 0.3.0 or later.
pub use test_kit::cni::result_addresses as addresses;

/// Runs the real plugin for `command` on (`container`, eth0) with `netconf` on stdin, killing it
/// (and failing the test) if it outlives `hang_guard`: a safety net, not a timing assertion.
pub fn run_plugin_bounded(
    command: &str,
    container: &str,
    netconf: &Value,
    hang_guard: std::time::Duration,
) -> Outcome {
    run_cni(
        plugin_binary(),
        &[],
        &cni_env(command, container, "eth0"),
        netconf.to_string().as_bytes(),
        hang_guard,
    )
}
