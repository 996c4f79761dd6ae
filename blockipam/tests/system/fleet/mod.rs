//! Simulated nodes sharing one store, for the crash and multi-node tests.
//!
//! A [`Fleet`] is one store (sled, redb, or a fresh key prefix on the shared test etcd) and several
//! simulated nodes, each with its own node name and its own host lock file, as separate machines
//! have. Plugin calls run the real binary as a child process ([`call`]) with their start and end
//! recorded, optionally armed with a fault point (`BLOCKIPAM_FAULT`) or killed with `SIGKILL`.
//! [`Fleet::ctl`] runs `blockipamctl` (its library entry point, in-process) on the same store.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use blockipam_store::{Backend, DatastoreSettings, DatastoreType, EtcdSettings};
use ipam_core::{AllocationInfo, Ipam};
use serde_json::{json, Value};
use test_kit::cni::{start_cni, HANG_GUARD};
use test_kit::etcd::{unique_prefix, EtcdServer, PrefixGuard};
use test_kit::plugin::PinnedPlugin;

use crate::common::{block_on, cni_env, merge, Sandbox, BIN, NETWORK};

/// How long a plugin or blockipamctl waits for a host lock or an embedded store another process
/// holds: long, so that queueing is never mistaken for a failure.
pub const LOCK_WAIT_SECONDS: u64 = 300;

/// `SIGABRT`: what a fault point's `abort()` ends with.
pub const SIGABRT: i32 = 6;
/// `SIGKILL`: what `kill -9` ends with.
pub const SIGKILL: i32 = 9;

/// The shared test etcd, or a loud failure when it cannot run.
pub fn etcd_server() -> &'static EtcdServer {
    match EtcdServer::try_shared() {
        Ok(server) => server,
        Err(e) => panic!(
            "these tests need a local etcd (Debian: apt-get install etcd-server, or run scripts/setup): {e}"
        ),
    }
}

/// A seed from `variable` when set (to replay a run), else a fresh one; printed either way.
pub fn seed_from_env(variable: &str) -> u64 {
    let seed = match std::env::var(variable) {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{variable}={text:?} is not an unsigned integer")),
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            (nanos as u64) ^ u64::from(std::process::id()).rotate_left(32)
        }
    };
    eprintln!("seed: {seed} (replay the same choices with {variable}={seed})");
    seed
}

/// A size from `variable` when set, else `default`.
pub fn size_from_env(variable: &str, default: usize) -> usize {
    match std::env::var(variable) {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{variable}={text:?} is not an unsigned integer")),
        Err(_) => default,
    }
}

/// A small seeded pseudo-random generator (SplitMix64): the same seed, the same choices.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`, with `stream` telling apart generators of one run.
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut rng = Rng(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F));
        rng.next_u64();
        rng
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `percent`/100.
    pub fn percent(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Where the fleet's store lives.
#[derive(Debug)]
enum Target {
    Embedded,
    Etcd {
        endpoint: String,
        prefix: String,
        _guard: Box<PrefixGuard>,
    },
}

/// One store and several simulated nodes.
#[derive(Debug)]
pub struct Fleet {
    /// The backend.
    pub store_type: DatastoreType,
    /// Holds the embedded store and every node's lock file.
    pub sandbox: Sandbox,
    target: Target,
    /// Node names, `node-0`, `node-1`, ...
    pub nodes: Vec<String>,
    /// Settings merged into every node's `ipam` object.
    ipam_extra: Value,
    /// The plugin binary every call runs.
    pub plugin: PinnedPlugin,
}

impl Fleet {
    /// A fleet of `node_count` nodes on a fresh store of `store_type`; `ipam_extra` is merged
    /// into every node's `ipam` object (pools, gateway, ...).
    pub fn new(store_type: DatastoreType, node_count: usize, ipam_extra: Value) -> Fleet {
        let target = match store_type {
            DatastoreType::Etcdv3 => {
                let server = etcd_server();
                let prefix = unique_prefix();
                Target::Etcd {
                    endpoint: server.endpoint(),
                    _guard: Box::new(PrefixGuard::new(server.config(&prefix))),
                    prefix,
                }
            }
            _ => Target::Embedded,
        };
        Fleet {
            store_type,
            sandbox: Sandbox::with_store(store_type),
            target,
            nodes: (0..node_count).map(|i| format!("node-{i}")).collect(),
            ipam_extra,
            plugin: PinnedPlugin::pin(Path::new(BIN), Path::new(env!("CARGO_TARGET_TMPDIR"))),
        }
    }

    /// Runs the plugin (see [`call`]).
    pub fn call(
        &self,
        node: usize,
        netconf: &Value,
        command: &str,
        container: &str,
        sabotage: &Sabotage,
    ) -> Call {
        call(
            self.plugin.path(),
            node,
            netconf,
            command,
            container,
            sabotage,
        )
    }

    /// Node `node`'s own host lock file.
    pub fn lock_file(&self, node: usize) -> PathBuf {
        self.sandbox
            .dir
            .path()
            .join(format!("run/{}.lock", self.nodes[node]))
    }

    /// Node `node`'s netconf at spec `version`, with `extra` merged into its `ipam` object.
    pub fn netconf(&self, node: usize, version: &str, extra: Value) -> Value {
        let mut ipam = json!({
            "nodename": self.nodes[node],
            "ipam_lock_file": self.lock_file(node),
            "ipam_lock_timeout_seconds": LOCK_WAIT_SECONDS,
            "timeout_seconds": LOCK_WAIT_SECONDS,
            "log_level": "warning",
        });
        if let Target::Etcd {
            endpoint, prefix, ..
        } = &self.target
        {
            merge(
                &mut ipam,
                json!({
                    "datastore_type": "etcdv3",
                    "datastore_path": null,
                    "etcd_endpoints": endpoint,
                    "etcd_prefix": prefix,
                }),
            );
        }
        merge(&mut ipam, self.ipam_extra.clone());
        merge(&mut ipam, extra);
        self.sandbox.netconf(version, ipam)
    }

    /// The settings that open this fleet's store from the test process.
    pub fn settings(&self) -> DatastoreSettings {
        match &self.target {
            Target::Embedded => DatastoreSettings {
                backend: Backend::embedded(self.store_type, Some(self.sandbox.store_path()))
                    .expect("an embedded store type"),
                lock_wait: Duration::from_secs(LOCK_WAIT_SECONDS),
                ..DatastoreSettings::default()
            },
            Target::Etcd {
                endpoint, prefix, ..
            } => DatastoreSettings {
                backend: Backend::Etcd(EtcdSettings {
                    endpoints: vec![endpoint.clone()],
                    prefix: Some(prefix.clone()),
                    ..EtcdSettings::default()
                }),
                ..DatastoreSettings::default()
            },
        }
    }

    /// Runs `f` on an allocator over the store (opened, then closed again).
    pub fn with_ipam<T>(&self, f: impl AsyncFnOnce(&Ipam) -> T) -> T {
        let settings = self.settings();
        block_on(async move {
            let store = settings
                .open()
                .await
                .unwrap_or_else(|e| panic!("the store does not open: {e}"));
            let ipam = Ipam::new(store);
            f(&ipam).await
        })
    }

    /// Every allocation in the store.
    pub fn allocations(&self) -> Vec<AllocationInfo> {
        self.with_ipam(async |ipam| ipam.list_allocations().await)
            .unwrap_or_else(|e| panic!("cannot list the allocations: {e}"))
    }

    /// Every handle id in the store.
    pub fn handles(&self) -> BTreeSet<String> {
        let prefix = ipam_core::model::keys::handles_dir();
        self.with_ipam(async |ipam| ipam.store().list(&prefix).await)
            .unwrap_or_else(|e| panic!("cannot list the handles: {e}"))
            .into_iter()
            .map(|kv| kv.key[prefix.len()..].to_owned())
            .collect()
    }

    /// Runs `blockipamctl -o json <args>` on this store (in-process, through its library entry
    /// point, exactly as the binary does).
    pub fn ctl(&self, args: &[&str]) -> CtlOutcome {
        let settings = self.settings();
        let mut argv: Vec<String> = vec![
            "blockipamctl".into(),
            "-o".into(),
            "json".into(),
            "--datastore-type".into(),
            settings.datastore_type().as_str().into(),
            "--lock-wait-seconds".into(),
            LOCK_WAIT_SECONDS.to_string(),
        ];
        match &self.target {
            Target::Embedded => {
                argv.push("--datastore-path".into());
                argv.push(self.sandbox.store_path().display().to_string());
            }
            Target::Etcd {
                endpoint, prefix, ..
            } => {
                argv.extend([
                    "--etcd-endpoints".into(),
                    endpoint.clone(),
                    "--etcd-prefix".into(),
                    prefix.clone(),
                ]);
            }
        }
        argv.extend(args.iter().map(|a| (*a).to_owned()));
        let env = blockipamctl::Env::new(Vec::<(String, String)>::new());
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        let started = Instant::now();
        let status = blockipamctl::run(argv.clone(), &env, &mut stdout, &mut stderr, false);
        CtlOutcome {
            args: argv,
            status,
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            started,
            ended: Instant::now(),
        }
    }
}

/// What one `blockipamctl` run produced.
#[derive(Debug, Clone)]
pub struct CtlOutcome {
    /// The command line.
    pub args: Vec<String>,
    /// Exit status.
    pub status: i32,
    /// Standard output (JSON).
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
    /// When it started.
    pub started: Instant,
    /// When it ended.
    pub ended: Instant,
}

impl CtlOutcome {
    /// Stdout as JSON (panics with the whole outcome when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("blockipamctl printed no JSON ({e}): {self:#?}"))
    }

    /// Asserts status 0 and returns the JSON.
    pub fn success_json(&self) -> Value {
        assert_eq!(self.status, 0, "blockipamctl failed: {self:#?}");
        self.json()
    }
}

/// How a call is sabotaged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sabotage {
    /// Not at all.
    None,
    /// `BLOCKIPAM_FAULT=<spec>`: the plugin aborts at that point.
    Fault(String),
    /// The test sends `SIGKILL` this long after starting the process.
    KillAfter(Duration),
}

/// One plugin process, as it ended.
#[derive(Debug, Clone)]
pub struct Call {
    /// Which node ran it.
    pub node: usize,
    /// `ADD`, `DEL`, `GC`, ...
    pub command: String,
    /// The container (empty for GC).
    pub container: String,
    /// Started (just before the process was spawned).
    pub started: Instant,
    /// Ended (the process was reaped).
    pub ended: Instant,
    /// How it ended.
    pub status: ExitStatus,
    /// Standard output, verbatim.
    pub stdout: String,
    /// Standard error, verbatim.
    pub stderr: String,
}

impl Call {
    /// Exited 0.
    pub fn succeeded(&self) -> bool {
        self.status.success()
    }

    /// The signal that ended it, if one did.
    pub fn signal(&self) -> Option<i32> {
        self.status.signal()
    }

    /// The result or error JSON on stdout (panics when stdout is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:#?}"))
    }

    /// The CNI error code, for a call that exited 1 with an error JSON.
    pub fn error_code(&self) -> Option<u64> {
        if self.status.code() != Some(1) {
            return None;
        }
        serde_json::from_str::<Value>(&self.stdout)
            .ok()
            .and_then(|v| v["code"].as_u64())
    }

    /// Every address (without prefix) of a successful ADD's result.
    pub fn addresses(&self) -> Vec<String> {
        crate::common::addresses(&self.json())
    }

    /// Whether this call's lifetime overlaps `other`'s.
    pub fn overlaps(&self, other: &Call) -> bool {
        self.started < other.ended && other.started < self.ended
    }
}

/// Runs the plugin `bin` for `command` on (`container`, `eth0`) of `node` with `netconf` on
/// stdin, sabotaged as asked.
pub fn call(
    bin: &Path,
    node: usize,
    netconf: &Value,
    command: &str,
    container: &str,
    sabotage: &Sabotage,
) -> Call {
    let mut env = cni_env(command, container, "eth0");
    if let Sabotage::Fault(spec) = sabotage {
        env.push(("BLOCKIPAM_FAULT".to_owned(), spec.clone()));
    }
    let started = Instant::now();
    let mut process = start_cni(bin, &[], env, netconf.to_string().as_bytes());
    if let Sabotage::KillAfter(delay) = sabotage {
        std::thread::sleep(*delay);
        // Fails only when the process was already reaped, which it cannot be here.
        process.kill().expect("send SIGKILL to the plugin");
    }
    let ended = process.wait(HANG_GUARD);
    Call {
        node,
        command: command.to_owned(),
        container: container.to_owned(),
        started,
        ended: Instant::now(),
        status: ended.status,
        stdout: ended.stdout,
        stderr: ended.stderr,
    }
}

/// The plugin's handle id of `container` on the test network.
pub fn handle_of(container: &str) -> String {
    format!("{NETWORK}.{container}")
}

/// Whether `handle` is one of the network's reservations (gateway, network, broadcast).
pub fn is_reservation(handle: &str) -> bool {
    handle.ends_with(":gateway")
}
