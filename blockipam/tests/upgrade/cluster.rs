//! A cluster half-way through a rolling upgrade: node old-1 runs the previous release's plugin, node new-1 today's, on one store, with both releases' CLIs.
//!
//! The store is a key prefix on a real etcd (one member), or a sled store served by today's
//! `blockipam-agent` (in this process), which every plugin and CLI reaches through its socket.
//! Each node has its own node name and host lock file, so their calls really race. Every call is
//! a process bounded by [`CALL_BOUND`] (today's CLI runs in-process through its library entry
//! point). A failed call or check does not stop the scenario: it is recorded, and
//! [`MixedCluster::finish`] fails the test listing every one, so one run shows each step that
//! broke a node.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use blockipam_store::{Backend, DatastoreSettings, DatastoreType, EtcdSettings};
use ipam_core::allocator::leaks::{AddressHolder, Disagreement};
use ipam_core::model::keys;
use ipam_core::store_format::FormatRecord;
use ipam_core::{Ipam, KeyValue};
use serde_json::{json, Value};
use test_kit::agent::InProcessAgent;
use test_kit::cni::{cni_env, start_cni, Outcome};
use test_kit::etcd::{unique_prefix, EtcdServer, PrefixGuard};
use test_kit::plugin::PinnedPlugin;
use test_kit::previous::PreviousRelease;

/// The network name of every netconf here (handles are `upgrade.<container>`).
pub const NETWORK: &str = "upgrade";
/// The nodes' pool: two /29 blocks of six usable addresses each (no gateway: block edges are
/// never handed out). Once old-1 and new-1 have claimed one each, no block is left to claim: a
/// node whose block is full borrows from the other's.
pub const MAIN_POOL: &str = "10.70.0.0/28";
/// The name of [`MAIN_POOL`].
pub const MAIN: &str = "main";
/// The operator's other pool, which no netconf uses.
pub const OTHER_POOL: &str = "10.80.0.0/28";
/// The name of [`OTHER_POOL`].
pub const OTHER: &str = "other";
/// The block size of both pools.
pub const BLOCK_SIZE: &str = "29";
/// Longest one plugin or CLI process may run before the test calls it a hang.
pub const CALL_BOUND: Duration = Duration::from_secs(60);
/// The netconf's `timeout_seconds` and `ipam_lock_timeout_seconds`, and the CLIs' lock wait:
/// below [`CALL_BOUND`], so a slow call ends as an error of its own before it is killed.
const STORE_WAIT_SECONDS: u64 = 30;

/// Which build a node or CLI runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The previous release (`scripts/build-previous`).
    Previous,
    /// Today's build of this workspace.
    Today,
}

impl Release {
    /// How messages name it.
    pub fn label(self) -> &'static str {
        match self {
            Release::Previous => "previous",
            Release::Today => "today's",
        }
    }
}

/// One simulated node: its name and the plugin it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    /// The node name (`nodename`).
    pub name: &'static str,
    /// The plugin it runs.
    pub release: Release,
}

/// A node not upgraded yet.
pub const OLD_1: Node = Node {
    name: "old-1",
    release: Release::Previous,
};
/// A second node not upgraded yet (allocating from the operator's other pool).
pub const OLD_2: Node = Node {
    name: "old-2",
    release: Release::Previous,
};
/// A node of the previous release that is drained and removed (its affinities released by the
/// previous CLI's `node release`).
pub const OLD_3: Node = Node {
    name: "old-3",
    release: Release::Previous,
};
/// An upgraded node.
pub const NEW_1: Node = Node {
    name: "new-1",
    release: Release::Today,
};

/// Which store the cluster shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// A fresh key prefix on the shared test etcd (one member).
    Etcd,
    /// A sled store served by today's agent, reached only through its socket.
    AgentSled,
}

impl StoreKind {
    /// How messages name it.
    pub fn label(self) -> &'static str {
        match self {
            StoreKind::Etcd => "etcd",
            StoreKind::AgentSled => "sled through today's agent",
        }
    }
}

/// Where the store is.
enum Store {
    Etcd {
        endpoint: String,
        prefix: String,
        _guard: Box<PrefixGuard>,
    },
    AgentSled {
        socket: PathBuf,
        path: PathBuf,
        _agent: InProcessAgent,
    },
}

/// What a live container holds, as its ADD printed it.
#[derive(Debug, Clone)]
struct Holding {
    node: &'static str,
    addresses: Vec<String>,
}

/// What one CLI run produced.
#[derive(Debug, Clone)]
pub struct CtlOutcome {
    /// Which CLI ran.
    pub release: Release,
    /// Its arguments after the store flags.
    pub args: Vec<String>,
    /// Exit status.
    pub status: i32,
    /// Standard output (JSON).
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl CtlOutcome {
    /// Stdout as JSON (`null` when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or(Value::Null)
    }

    /// One line for failure messages.
    pub fn summary(&self) -> String {
        let error = self.json()["error"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| self.stderr.trim().to_owned());
        format!(
            "{} blockipamctl {} exited {}: {error}",
            self.release.label(),
            self.args.join(" "),
            self.status
        )
    }
}

/// A store, its nodes, both releases' CLIs, and what the test knows every container holds.
pub struct MixedCluster {
    /// Which store.
    pub kind: StoreKind,
    /// Declared before `dir`: the agent stops before its directory is removed.
    store: Store,
    dir: tempfile::TempDir,
    previous: PreviousRelease,
    today_plugin: PinnedPlugin,
    ledger: Mutex<BTreeMap<String, Holding>>,
    /// The nodes of the previous release whose plugin was replaced by today's.
    upgraded: Mutex<BTreeSet<&'static str>>,
    failures: Mutex<Vec<String>>,
    calls: AtomicUsize,
    probes: AtomicUsize,
    started: Instant,
}

impl std::fmt::Debug for MixedCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MixedCluster")
            .field("kind", &self.kind)
            .field("dir", &self.dir.path())
            .field("previous", &self.previous)
            .finish_non_exhaustive()
    }
}

impl MixedCluster {
    /// A cluster on a fresh store of `kind`.
    ///
    /// # Panics
    /// When the previous release's binaries are missing (naming `scripts/build-previous`), etcd
    /// cannot run, or today's agent does not start.
    pub fn start(kind: StoreKind) -> MixedCluster {
        let previous = PreviousRelease::locate();
        let dir = tempfile::Builder::new()
            .prefix("blockipam-upgrade-")
            .tempdir()
            .expect("a temporary directory");
        std::fs::create_dir(dir.path().join("run")).expect("the lock directory");
        let store = match kind {
            StoreKind::Etcd => {
                let server = EtcdServer::try_shared().unwrap_or_else(|e| {
                    panic!("these tests need a local etcd (Debian: run scripts/setup): {e}")
                });
                let prefix = unique_prefix();
                Store::Etcd {
                    endpoint: server.endpoint(),
                    _guard: Box::new(PrefixGuard::new(server.config(&prefix))),
                    prefix,
                }
            }
            StoreKind::AgentSled => {
                let socket = dir.path().join("run/agent.sock");
                let path = dir.path().join("store.sled");
                let agent = InProcessAgent::run_binary(&socket, DatastoreType::Sled, &path)
                    .unwrap_or_else(|e| panic!("today's agent did not start: {e}"));
                Store::AgentSled {
                    socket,
                    path,
                    _agent: agent,
                }
            }
        };
        MixedCluster {
            kind,
            store,
            dir,
            previous,
            today_plugin: PinnedPlugin::pin(
                Path::new(env!("CARGO_BIN_EXE_blockipam")),
                Path::new(env!("CARGO_TARGET_TMPDIR")),
            ),
            ledger: Mutex::new(BTreeMap::new()),
            upgraded: Mutex::new(BTreeSet::new()),
            failures: Mutex::new(Vec::new()),
            calls: AtomicUsize::new(0),
            probes: AtomicUsize::new(0),
            started: Instant::now(),
        }
    }

    /// The previous release's binaries this cluster runs.
    pub fn previous(&self) -> &PreviousRelease {
        &self.previous
    }

    /// The etcd endpoint and key prefix of the store; `None` for a sled store.
    pub fn etcd_location(&self) -> Option<(String, String)> {
        match &self.store {
            Store::Etcd {
                endpoint, prefix, ..
            } => Some((endpoint.clone(), prefix.clone())),
            Store::AgentSled { .. } => None,
        }
    }

    /// Records a failure; the scenario goes on.
    pub fn fail(&self, message: String) {
        self.failures.lock().expect("failures").push(message);
    }

    /// The failures recorded so far.
    pub fn failures(&self) -> Vec<String> {
        self.failures.lock().expect("failures").clone()
    }

    /// Node `node`'s netconf, with `extra` merged into its `ipam` object.
    pub fn netconf(&self, node: Node, extra: Value) -> Value {
        let mut ipam = json!({
            "type": "blockipam",
            "nodename": node.name,
            "ipam_lock_file": self.dir.path().join(format!("run/{}.lock", node.name)),
            "ipam_lock_timeout_seconds": STORE_WAIT_SECONDS,
            "timeout_seconds": STORE_WAIT_SECONDS,
            "log_level": "warning",
            "pools": [{"cidr": MAIN_POOL, "block_size": 29, "name": MAIN}],
            "ipv4_pools": [MAIN],
        });
        let store = match &self.store {
            Store::Etcd {
                endpoint, prefix, ..
            } => json!({
                "datastore_type": "etcdv3",
                "etcd_endpoints": endpoint,
                "etcd_prefix": prefix,
                "agent_socket": "",
            }),
            Store::AgentSled { socket, path, .. } => json!({
                "datastore_type": "sled",
                "datastore_path": path,
                "agent_socket": socket,
            }),
        };
        merge(&mut ipam, store);
        merge(&mut ipam, extra);
        json!({"cniVersion": "1.1.0", "name": NETWORK, "ipam": ipam})
    }

    /// The plugin binary `release` runs.
    fn plugin_binary(&self, release: Release) -> PathBuf {
        match release {
            Release::Previous => self.previous.plugin(),
            Release::Today => self.today_plugin.path().to_owned(),
        }
    }

    /// Runs `node`'s plugin: `command` on (`container`, eth0) with `netconf`. A call that
    /// outlives [`CALL_BOUND`] is killed and recorded as a failure (status -1).
    pub fn plugin(&self, node: Node, command: &str, container: &str, netconf: &Value) -> Outcome {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let program = self.plugin_binary(node.release);
        let ended = start_cni(
            &program,
            &[],
            cni_env(command, container, "eth0"),
            netconf.to_string().as_bytes(),
        )
        .wait_or_kill(CALL_BOUND);
        if ended.hung {
            self.fail(format!(
                "{} ({} plugin) {command} {container} hung: killed after {CALL_BOUND:?}; stderr: {}",
                node.name,
                node.release.label(),
                ended.stderr.trim()
            ));
        }
        ended.into()
    }

    /// ADD of `container` on `node`: its addresses when it succeeded (recorded as live, and
    /// checked against every other live container), else the failure is recorded under `step`.
    pub fn add(&self, step: &str, node: Node, container: &str) -> Option<Vec<String>> {
        self.add_with(step, node, container, json!({}))
    }

    /// [`MixedCluster::add`] with `extra` merged into the netconf's `ipam` object.
    pub fn add_with(
        &self,
        step: &str,
        node: Node,
        container: &str,
        extra: Value,
    ) -> Option<Vec<String>> {
        let netconf = self.netconf(node, extra);
        let done = self.plugin(node, "ADD", container, &netconf);
        if done.status != 0 {
            self.fail(format!(
                "{step}: {} ({} plugin) ADD {container} failed: {}",
                node.name,
                node.release.label(),
                describe(&done)
            ));
            return None;
        }
        let addresses = result_addresses(&done);
        if addresses.is_empty() {
            self.fail(format!(
                "{step}: {} ADD {container} printed no address: {}",
                node.name, done.stdout
            ));
        }
        let mut ledger = self.ledger.lock().expect("ledger");
        for (other, holding) in ledger.iter() {
            for address in addresses.iter().filter(|a| holding.addresses.contains(a)) {
                self.fail(format!(
                    "{step}: duplicate: {} gave {address} to {container} while {other} (on {}) holds it",
                    node.name, holding.node
                ));
            }
        }
        ledger.insert(
            container.to_owned(),
            Holding {
                node: node.name,
                addresses: addresses.clone(),
            },
        );
        Some(addresses)
    }

    /// DEL of `container` on `node`; it is no longer live either way (a failure is recorded).
    pub fn del(&self, step: &str, node: Node, container: &str) {
        self.del_with(step, node, container, json!({}));
    }

    /// [`MixedCluster::del`] with `extra` merged into the netconf's `ipam` object.
    pub fn del_with(&self, step: &str, node: Node, container: &str, extra: Value) {
        let netconf = self.netconf(node, extra);
        let done = self.plugin(node, "DEL", container, &netconf);
        if done.status != 0 {
            self.fail(format!(
                "{step}: {} ({} plugin) DEL {container} failed: {}",
                node.name,
                node.release.label(),
                describe(&done)
            ));
        }
        self.ledger.lock().expect("ledger").remove(container);
    }

    /// The live containers of `node`, oldest name first.
    pub fn live_of(&self, node: Node) -> Vec<String> {
        self.ledger
            .lock()
            .expect("ledger")
            .iter()
            .filter(|(_, holding)| holding.node == node.name)
            .map(|(container, _)| container.clone())
            .collect()
    }

    /// The addresses live container `container` holds.
    pub fn addresses_of(&self, container: &str) -> Vec<String> {
        self.ledger
            .lock()
            .expect("ledger")
            .get(container)
            .map(|holding| holding.addresses.clone())
            .unwrap_or_default()
    }

    /// Records that `address` was released by hand: its container no longer holds it.
    pub fn address_released(&self, address: &str) {
        for holding in self.ledger.lock().expect("ledger").values_mut() {
            holding.addresses.retain(|a| a != address);
        }
    }

    /// The store flags of both CLIs.
    fn store_flags(&self) -> Vec<String> {
        let mut flags: Vec<String> = vec!["-o".into(), "json".into()];
        match &self.store {
            Store::Etcd {
                endpoint, prefix, ..
            } => flags.extend([
                "--datastore-type".into(),
                "etcdv3".into(),
                "--etcd-endpoints".into(),
                endpoint.clone(),
                "--etcd-prefix".into(),
                prefix.clone(),
                "--agent-socket".into(),
                "none".into(),
            ]),
            Store::AgentSled { socket, path, .. } => flags.extend([
                "--datastore-type".into(),
                "sled".into(),
                "--datastore-path".into(),
                path.display().to_string(),
                "--agent-socket".into(),
                socket.display().to_string(),
            ]),
        }
        flags.extend(["--lock-wait-seconds".into(), STORE_WAIT_SECONDS.to_string()]);
        flags
    }

    /// Runs `release`'s `blockipamctl -o json <store flags> <args>`: today's in-process through
    /// its library entry point, the previous release's binary as a process bounded by
    /// [`CALL_BOUND`].
    pub fn ctl(&self, release: Release, args: &[&str]) -> CtlOutcome {
        let mut argv = self.store_flags();
        argv.extend(args.iter().map(|a| (*a).to_owned()));
        let (status, stdout, stderr) = match release {
            Release::Today => {
                let env = blockipamctl::Env::new(Vec::<(String, String)>::new());
                let mut stdout = Vec::new();
                let mut stderr = Vec::new();
                let mut full = vec!["blockipamctl".to_owned()];
                full.extend(argv);
                let status = blockipamctl::run(full, &env, &mut stdout, &mut stderr, false);
                (
                    status,
                    String::from_utf8_lossy(&stdout).into_owned(),
                    String::from_utf8_lossy(&stderr).into_owned(),
                )
            }
            Release::Previous => {
                let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
                let ended = start_cni(
                    &self.previous.cli(),
                    &argv,
                    Vec::<(String, String)>::new(),
                    b"",
                )
                .wait_or_kill(CALL_BOUND);
                let status = if ended.hung {
                    -1
                } else {
                    ended.status.code().unwrap_or(-1)
                };
                (status, ended.stdout, ended.stderr)
            }
        };
        CtlOutcome {
            release,
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            status,
            stdout,
            stderr,
        }
    }

    /// Runs `release`'s CLI with `args`, recording a failure under `step` unless it exits 0.
    pub fn ctl_ok(&self, step: &str, release: Release, args: &[&str]) -> Value {
        let out = self.ctl(release, args);
        if out.status != 0 {
            self.fail(format!("{step}: {}", out.summary()));
        }
        out.json()
    }

    /// `check` under both releases' CLIs: each must find the store clean.
    pub fn check_with_both(&self, step: &str) {
        self.check_with(step, &[Release::Previous, Release::Today]);
    }

    /// `check` under each of `releases`' CLIs: each must find the store clean.
    pub fn check_with(&self, step: &str, releases: &[Release]) {
        for &release in releases {
            let out = self.ctl(release, &["check"]);
            let report = out.json();
            if out.status == 0 && report["clean"] == json!(true) {
                continue;
            }
            let problems: Vec<String> = report["problems"]
                .as_array()
                .map(|problems| {
                    problems
                        .iter()
                        .map(|p| {
                            format!(
                                "{}: {}",
                                p["kind"].as_str().unwrap_or("?"),
                                p["detail"].as_str().unwrap_or("?")
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            if problems.is_empty() {
                self.fail(format!("{step}: {}", out.summary()));
            } else {
                self.fail(format!(
                    "{step}: {} blockipamctl check is not clean: {}",
                    release.label(),
                    problems.join("; ")
                ));
            }
        }
    }

    /// A fresh container name.
    pub fn fresh_container(&self, node: Node) -> String {
        let n = self.probes.fetch_add(1, Ordering::Relaxed);
        format!("{}-probe-{n}", node.name)
    }

    /// `node`'s next ADD and DEL (of a fresh container) must both succeed.
    pub fn add_and_del(&self, step: &str, node: Node) {
        let container = self.fresh_container(node);
        if self.add(step, node, &container).is_some() {
            self.del(step, node, &container);
        }
    }

    /// What must hold after every operator step: old-1's next ADD and DEL, then `check` under
    /// both CLIs (before today's plugin writes anything more), then new-1's ADD and DEL, old-1's
    /// again, and `check` again.
    pub fn both_nodes_keep_working_after(&self, step: &str) {
        self.add_and_del(&format!("after {step}, old-1's next call"), OLD_1);
        self.check_with_both(&format!("after {step}"));
        self.add_and_del(&format!("after {step}, new-1's next call"), NEW_1);
        self.add_and_del(
            &format!("after {step} and new-1's ADD and DEL, old-1's next call"),
            OLD_1,
        );
        self.check_with_both(&format!("after {step} and both nodes' calls"));
    }

    /// The settings that open this store from the test process (through the agent for sled).
    fn settings(&self) -> DatastoreSettings {
        match &self.store {
            Store::Etcd {
                endpoint, prefix, ..
            } => DatastoreSettings {
                backend: Backend::Etcd(EtcdSettings {
                    endpoints: vec![endpoint.clone()],
                    prefix: Some(prefix.clone()),
                    ..EtcdSettings::default()
                }),
                agent_socket: None,
                ..DatastoreSettings::default()
            },
            Store::AgentSled { socket, path, .. } => DatastoreSettings {
                backend: Backend::embedded(DatastoreType::Sled, Some(path.clone()))
                    .expect("sled is embedded"),
                agent_socket: Some(socket.clone()),
                ..DatastoreSettings::default()
            },
        }
    }

    /// Records, as today's agent on `node` does after a look, that a live pod there uses each of
    /// `addresses` while the store holds it for its current holder (a duplicate); an empty list
    /// clears the record.
    pub fn record_live_duplicates(&self, node: &str, addresses: &[String]) {
        let settings = self.settings();
        test_kit::block_on(async move {
            let store = settings.open().await.expect("open the store");
            let ipam = Ipam::new(store);
            let mut disagreements = Vec::new();
            for address in addresses {
                let ip: std::net::IpAddr = address
                    .split('/')
                    .next()
                    .and_then(|a| a.parse().ok())
                    .unwrap_or_else(|| panic!("not an address: {address}"));
                let held = ipam
                    .get_assignment(ip)
                    .await
                    .expect("read the address")
                    .unwrap_or_else(|| panic!("{ip} is not allocated"));
                disagreements.push(Disagreement {
                    address: ip,
                    sandbox_id: "f".repeat(64),
                    pod: "default/intruder".into(),
                    holder: AddressHolder::Other(held),
                });
            }
            ipam.record_disagreements(node, 1_800_000_000, &disagreements)
                .await
                .expect("record the look's findings");
        });
    }

    /// Deletes `key` from the store as damage would (no format involved).
    pub fn delete_key(&self, key: &str) {
        let settings = self.settings();
        test_kit::block_on(async move {
            let store = settings.open().await.expect("open the store");
            store.delete(key).await.expect("delete the key");
        });
    }

    /// Upgrades `node` in place: from now on it runs today's plugin, with the same node name, host
    /// lock file and store (its live containers stay its own, and are deleted by today's plugin at
    /// the end). Returns the node as it now runs.
    pub fn upgrade_node(&self, node: Node) -> Node {
        self.upgraded.lock().expect("upgraded").insert(node.name);
        Node {
            name: node.name,
            release: Release::Today,
        }
    }

    /// `name` as it runs now: upgraded, or as it started.
    fn node_named(&self, name: &str) -> Node {
        let node = [OLD_1, OLD_2, OLD_3, NEW_1]
            .into_iter()
            .find(|n| n.name == name)
            .expect("a known node");
        if self.upgraded.lock().expect("upgraded").contains(name) {
            Node {
                name: node.name,
                release: Release::Today,
            }
        } else {
            node
        }
    }

    /// Every key of the store with its value and revision, read through the store adapter (the
    /// cluster's etcd prefix, or the whole sled store through the agent).
    ///
    /// # Panics
    /// When the store cannot be read.
    pub fn dump(&self) -> Vec<KeyValue> {
        let settings = self.settings();
        test_kit::block_on(async move {
            let store = settings.open().await.expect("open the store");
            store.list("").await.expect("list the whole store")
        })
    }

    /// Records a failure under `step` unless the store holds exactly `before` (the same keys, with
    /// the same values, last written at the same revisions), naming every key that differs.
    pub fn store_unchanged(&self, step: &str, before: &[KeyValue]) {
        let after = self.dump();
        if after == before {
            return;
        }
        let index = |kvs: &[KeyValue]| -> BTreeMap<String, (Vec<u8>, String)> {
            kvs.iter()
                .map(|kv| (kv.key.clone(), (kv.value.clone(), kv.revision.to_string())))
                .collect()
        };
        let (was, is) = (index(before), index(&after));
        let shown = |entry: Option<&(Vec<u8>, String)>| match entry {
            None => "absent".to_owned(),
            Some((value, revision)) => {
                let mut shown = value.escape_ascii().to_string();
                if shown.len() > 80 {
                    shown.truncate(80);
                    shown.push_str("...");
                }
                format!("\"{shown}\" at revision {revision}")
            }
        };
        let changed: Vec<String> = was
            .keys()
            .chain(is.keys())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .filter(|key| was.get(*key) != is.get(*key))
            .map(|key| format!("{key}: {} -> {}", shown(was.get(key)), shown(is.get(key))))
            .collect();
        self.fail(format!(
            "{step}: the store changed ({} keys): {}",
            changed.len(),
            changed.join("; ")
        ));
    }

    /// The format the store's record says writers write; `None` without a record.
    ///
    /// # Panics
    /// When the store cannot be read or the record is damaged.
    pub fn recorded_format(&self) -> Option<u8> {
        let settings = self.settings();
        test_kit::block_on(async move {
            let store = settings.open().await.expect("open the store");
            let key = keys::store_format();
            let record = store.get(&key).await.expect("read the format record")?;
            Some(
                FormatRecord::decode(&key, &record.value)
                    .expect("a format record")
                    .writes,
            )
        })
    }

    /// The store, read with today's allocator (which reads every format), must hold exactly
    /// what the live containers were given, each address once.
    pub fn store_agrees_with_live_containers(&self, step: &str) {
        let settings = self.settings();
        let allocations = test_kit::block_on(async move {
            let store = settings.open().await.map_err(|e| e.to_string())?;
            Ipam::new(store)
                .list_allocations()
                .await
                .map_err(|e| e.to_string())
        });
        let allocations = match allocations {
            Ok(allocations) => allocations,
            Err(e) => {
                self.fail(format!(
                    "{step}: today's allocator cannot list the store: {e}"
                ));
                return;
            }
        };
        let mut holder: BTreeMap<String, String> = BTreeMap::new();
        for allocation in &allocations {
            let ip = allocation.ip.to_string();
            if let Some(first) = holder.insert(ip.clone(), allocation.handle.clone()) {
                self.fail(format!(
                    "{step}: {ip} is stored twice, for {first} and {}",
                    allocation.handle
                ));
            }
        }
        let ledger = self.ledger.lock().expect("ledger").clone();
        let mut expected: BTreeMap<String, String> = BTreeMap::new();
        for (container, holding) in &ledger {
            for address in &holding.addresses {
                expected.insert(address.clone(), handle_of(container));
            }
        }
        if holder != expected {
            self.fail(format!(
                "{step}: the store holds {holder:?}, the live containers were given {expected:?}"
            ));
        }
    }

    /// Every live container's DEL on its own node (by today's plugin on a node upgraded since),
    /// then the store must hold no allocation, `check` must be clean under both CLIs (today's
    /// alone once the store is finalized), and no failure may have been recorded; prints a
    /// summary line.
    ///
    /// # Panics
    /// Listing every failure recorded in the whole scenario.
    pub fn finish(self, scenario: &str) {
        let live: Vec<(String, &'static str)> = self
            .ledger
            .lock()
            .expect("ledger")
            .iter()
            .map(|(container, holding)| (container.clone(), holding.node))
            .collect();
        for (container, node) in live {
            self.del("at the end", self.node_named(node), &container);
        }
        self.store_agrees_with_live_containers("at the end");
        // Once finalized, the previous release's CLI refuses what today's writes in its format
        // (the finalize scenarios assert how); today's must still find the store clean.
        if self.recorded_format() == Some(ipam_core::model::FORMAT_VERSION) {
            self.check_with("at the end", &[Release::Today]);
        } else {
            self.check_with_both("at the end");
        }
        let failures = self.failures();
        let what = format!(
            "{scenario} on {} (previous release {})",
            self.kind.label(),
            self.previous.commit()
        );
        eprintln!(
            "{what}: {} plugin calls, {} failures, {:.1?}",
            self.calls.load(Ordering::Relaxed),
            failures.len(),
            self.started.elapsed()
        );
        if !failures.is_empty() {
            let listed: Vec<String> = failures
                .iter()
                .enumerate()
                .map(|(i, f)| format!("{:>3}. {f}", i + 1))
                .collect();
            panic!(
                "{what}: {} failures:\n{}",
                failures.len(),
                listed.join("\n")
            );
        }
    }
}

/// The handle of `container` on [`NETWORK`].
pub fn handle_of(container: &str) -> String {
    format!("{NETWORK}.{container}")
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

/// Every address (without prefix) of an ADD result.
pub fn result_addresses(done: &Outcome) -> Vec<String> {
    test_kit::cni::result_addresses(&serde_json::from_str(&done.stdout).unwrap_or(Value::Null))
}

/// A failed call in one line: its CNI error code and message, else its status and stderr.
pub fn describe(done: &Outcome) -> String {
    let error: Value = serde_json::from_str(&done.stdout).unwrap_or(Value::Null);
    match (error["code"].as_u64(), error["msg"].as_str()) {
        (Some(code), Some(msg)) => {
            let details = error["details"].as_str().unwrap_or("");
            if details.is_empty() || details == msg {
                format!("code {code}: {msg}")
            } else {
                format!("code {code}: {msg} ({details})")
            }
        }
        _ => format!(
            "exit status {}, stdout {:?}, stderr {:?}",
            done.status,
            done.stdout.trim(),
            done.stderr.trim()
        ),
    }
}
