//! Test support: a fresh store of each kind (sled, redb, a real etcd under its own prefix), running
//! the real `blockipamctl` binary against it, and reading or damaging the store directly.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Read;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockipam_store::{Backend as StoreBackend, DatastoreSettings, EtcdSettings};
use ipam_core::dead_nodes::{MissingMark, Registration};
use ipam_core::{AutoAssignRequest, Ipam, KvStore};
use serde_json::Value;
use test_kit::cni::{full_cni_env, run_cni};
use test_kit::etcd::{unique_prefix, EtcdServer, PrefixGuard};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_blockipamctl");

/// A run that takes longer than this is hung: it is killed and the test fails saying so.
const HANG_GUARD: Duration = Duration::from_secs(240);

/// Environment variables blockipamctl reads; removed from every child so that the developer's own
/// settings never leak into a test.
pub const CTL_ENV: &[&str] = &[
    "DATASTORE_TYPE",
    "DATASTORE_PATH",
    "ETCD_ENDPOINTS",
    "ETCD_CA_CERT_FILE",
    "ETCD_CERT_FILE",
    "ETCD_KEY_FILE",
    "ETCD_PREFIX",
    "ETCD_USERNAME",
    "ETCD_PASSWORD",
    "BLOCKIPAM_LOCK_WAIT_SECONDS",
    "BLOCKIPAM_ETCD_TIMEOUT_SECONDS",
    "BLOCKIPAMCTL_OUTPUT",
    "BLOCKIPAM_PLUGIN",
];

/// Which store a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Embedded sled in a temporary directory.
    Sled,
    /// Embedded redb in a temporary directory.
    Redb,
    /// The test binary's shared etcd, under a fresh key prefix.
    Etcd,
}

/// Expands to one test per backend for each named function `fn name(backend: Backend)`:
/// `name::sled`, `name::redb`, `name::etcd`.
#[macro_export]
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn sled() {
                    super::$name($crate::common::Backend::Sled)
                }
                #[test]
                fn redb() {
                    super::$name($crate::common::Backend::Redb)
                }
                #[test]
                fn etcd() {
                    super::$name($crate::common::Backend::Etcd)
                }
            }
        )*
    };
}

pub use test_kit::block_on;

/// One fresh store and the flags that select it.
pub struct Lab {
    /// The store kind.
    pub backend: Backend,
    /// Holds embedded stores (and anything else a test wants to put beside them).
    pub dir: tempfile::TempDir,
    endpoint: Option<String>,
    prefix: Option<String>,
    _guard: Option<PrefixGuard>,
}

impl Lab {
    /// A fresh, empty store of this kind (an embedded store is created on first write).
    pub fn new(backend: Backend) -> Lab {
        let dir = tempfile::Builder::new()
            .prefix("blockipamctl-test-")
            .tempdir()
            .expect("a temporary directory");
        let (endpoint, prefix, guard) = match backend {
            Backend::Etcd => {
                let server = EtcdServer::shared();
                let prefix = unique_prefix();
                let guard = PrefixGuard::new(server.config(&prefix));
                (Some(server.endpoint()), Some(prefix), Some(guard))
            }
            _ => (None, None, None),
        };
        Lab {
            backend,
            dir,
            endpoint,
            prefix,
            _guard: guard,
        }
    }

    /// The embedded store's path (inside the lab directory).
    pub fn path(&self) -> PathBuf {
        match self.backend {
            Backend::Redb => self.dir.path().join("store.redb"),
            _ => self.dir.path().join("store.sled"),
        }
    }

    /// The etcd endpoint and prefix, for etcd labs.
    pub fn etcd(&self) -> Option<(String, String)> {
        Some((self.endpoint.clone()?, self.prefix.clone()?))
    }

    /// The datastore type's name.
    pub fn type_name(&self) -> &'static str {
        match self.backend {
            Backend::Sled => "sled",
            Backend::Redb => "redb",
            Backend::Etcd => "etcdv3",
        }
    }

    /// The global flags selecting this store.
    pub fn store_args(&self) -> Vec<String> {
        let mut args = vec!["--datastore-type".to_owned(), self.type_name().to_owned()];
        match self.etcd() {
            Some((endpoint, prefix)) => {
                args.extend(["--etcd-endpoints".to_owned(), endpoint]);
                args.extend(["--etcd-prefix".to_owned(), prefix]);
            }
            None => args.extend([
                "--datastore-path".to_owned(),
                self.path().display().to_string(),
            ]),
        }
        args
    }

    /// The flags that make this store a `migrate` target.
    pub fn target_args(&self) -> Vec<String> {
        let mut args = vec![
            "--to-datastore-type".to_owned(),
            self.type_name().to_owned(),
        ];
        match self.etcd() {
            Some((endpoint, prefix)) => {
                args.extend(["--to-etcd-endpoints".to_owned(), endpoint]);
                args.extend(["--to-etcd-prefix".to_owned(), prefix]);
            }
            None => args.extend([
                "--to-datastore-path".to_owned(),
                self.path().display().to_string(),
            ]),
        }
        args
    }

    /// The same store as the library opens it (creating an embedded store when missing).
    pub fn settings(&self) -> DatastoreSettings {
        let path = Some(self.path());
        let backend = match self.backend {
            Backend::Sled => StoreBackend::Sled { path },
            Backend::Redb => StoreBackend::Redb { path },
            Backend::Etcd => StoreBackend::Etcd(EtcdSettings {
                endpoints: self.endpoint.iter().cloned().collect(),
                prefix: self.prefix.clone(),
                ..EtcdSettings::default()
            }),
        };
        DatastoreSettings {
            backend,
            create_if_missing: true,
            ..DatastoreSettings::default()
        }
    }

    /// Runs blockipamctl with this store's flags followed by `args`.
    pub fn ctl(&self, args: &[&str]) -> Run {
        self.ctl_env(args, &[])
    }

    /// Runs another release's blockipamctl, `binary`, with this store's flags followed by `args`.
    pub fn ctl_of(&self, binary: &std::path::Path, args: &[&str]) -> Run {
        let full = self.with_store_args(args);
        run_guarded(ctl_command(binary, &full), &full)
    }

    /// As [`ctl`](Self::ctl), with stdout going to `stdout` instead of a pipe the test reads.
    pub fn ctl_into(&self, args: &[&str], stdout: Stdio) -> Run {
        let full = self.with_store_args(args);
        run_guarded_into(ctl_command(BIN.as_ref(), &full), &full, stdout)
    }

    /// Runs blockipamctl in the lab's directory, naming the embedded store there by its file name
    /// alone (a path with no directory part), followed by `args`.
    pub fn ctl_by_bare_file_name(&self, args: &[&str]) -> Run {
        let path = self.path();
        let name = path.file_name().expect("the store's file name");
        let mut full = vec![
            "--datastore-type".to_owned(),
            self.type_name().to_owned(),
            "--datastore-path".to_owned(),
            name.to_string_lossy().into_owned(),
        ];
        full.extend(args.iter().map(|a| (*a).to_owned()));
        let mut command = ctl_command(BIN.as_ref(), &full);
        command.current_dir(self.dir.path());
        run_guarded(command, &full)
    }

    /// As [`ctl`](Self::ctl), run under `strace -f` recording the system calls
    /// [`test_kit::strace`] reads, of every thread, into the file `trace`. Fails the test when
    /// strace is missing (`scripts/setup` installs it).
    pub fn ctl_traced(&self, trace: &Path, args: &[&str]) -> Run {
        let strace = test_kit::strace::strace_path();
        let mut full = test_kit::strace::traced_args(trace, Path::new(BIN));
        full.extend(self.with_store_args(args));
        run_guarded(ctl_command(&strace, &full), &full)
    }

    /// As [`ctl`](Self::ctl), with extra environment variables.
    pub fn ctl_env(&self, args: &[&str], env: &[(&str, &str)]) -> Run {
        ctl(&self.with_store_args(args), env)
    }

    /// This store's flags followed by `args`.
    fn with_store_args(&self, args: &[&str]) -> Vec<String> {
        let mut full = self.store_args();
        full.extend(args.iter().map(|a| (*a).to_owned()));
        full
    }

    /// Opens the store, runs `work` on an allocator over it, and closes the store again.
    pub fn with_ipam<T, F, Fut>(&self, work: F) -> T
    where
        F: FnOnce(Ipam) -> Fut,
        Fut: Future<Output = T>,
    {
        let settings = self.settings();
        block_on(async move {
            let store = settings.open().await.expect("open the test store");
            work(Ipam::new(store)).await
        })
    }

    /// Opens the store, runs `work` on the raw KV store, and closes the store again.
    pub fn with_store<T, F, Fut>(&self, work: F) -> T
    where
        F: FnOnce(Arc<dyn KvStore>) -> Fut,
        Fut: Future<Output = T>,
    {
        let settings = self.settings();
        block_on(async move {
            let store = settings.open().await.expect("open the test store");
            work(store).await
        })
    }

    /// Overwrites the first of `host`'s blocks with bytes that do not decode, asserting the host
    /// has `blocks` blocks; the damaged block's key.
    pub fn damage_a_block_of(&self, host: &str, blocks: usize) -> String {
        let dir = ipam_core::model::keys::host_blocks_dir(host);
        self.with_store(|store| async move {
            let listed = store.list(&dir).await.expect("list the host's blocks");
            assert_eq!(listed.len(), blocks, "{listed:?}");
            let key = listed[0].key.clone();
            store
                .put(&key, b"garbage{".to_vec())
                .await
                .expect("damage the block");
            key
        })
    }

    /// `blocks release-empty --older-than 0` in JSON (a preview: it writes nothing), and the CIDRs
    /// of the blocks of `host` it lists.
    pub fn release_empty_preview(&self, host: &str) -> (Value, Vec<String>) {
        let preview = self
            .ctl(&["-o", "json", "blocks", "release-empty", "--older-than", "0"])
            .ok()
            .json();
        let listed = preview["blocks"]
            .as_array()
            .expect("blocks")
            .iter()
            .filter(|b| b["host"] == host)
            .map(|b| b["cidr"].as_str().expect("cidr").to_owned())
            .collect();
        (preview, listed)
    }

    /// Every key with its value and revision (`list("")`), read with the store closed afterwards.
    pub fn snapshot(&self) -> Vec<(String, Vec<u8>, u64)> {
        self.with_store(|store| async move {
            store
                .list("")
                .await
                .expect("list the whole store")
                .into_iter()
                .map(|kv| (kv.key, kv.value, kv.revision.get()))
                .collect()
        })
    }

    /// Runs the real `blockipam` plugin once for `command` on `container` (interface eth0) of
    /// node `node`, against this lab's store, with `ipam` fields merged over the store's own
    /// (network `fixture`, no agent): the exit status, and stdout as JSON (`Null` when empty).
    pub fn plugin(&self, command: &str, node: &str, container: &str, ipam: Value) -> (i32, Value) {
        self.plugin_at("1.0.0", command, node, container, ipam)
    }

    /// The IPv4 address of a successful ADD by the real plugin for `container` (a pod of the
    /// same name) on `node`, with the default netconf.
    pub fn added(&self, node: &str, container: &str) -> IpAddr {
        let (status, result) = self.plugin("ADD", node, container, serde_json::json!({}));
        assert_eq!(status, 0, "ADD {container} on {node}: {result}");
        result["ips"][0]["address"]
            .as_str()
            .and_then(|address| address.split('/').next())
            .and_then(|address| address.parse().ok())
            .unwrap_or_else(|| panic!("ADD {container} on {node} gave no IP address: {result}"))
    }

    /// [`Lab::plugin`] with the netconf's `cniVersion` (STATUS and GC need 1.1.0).
    pub fn plugin_at(
        &self,
        version: &str,
        command: &str,
        node: &str,
        container: &str,
        ipam: Value,
    ) -> (i32, Value) {
        self.plugin_in(
            "default",
            version,
            command,
            node,
            container,
            ipam,
            Value::Null,
        )
    }

    /// [`Lab::plugin_at`] for a pod in `namespace` (`K8S_POD_NAMESPACE`), with `top` fields (such
    /// as `runtimeConfig`) merged into the netconf's top level.
    #[allow(clippy::too_many_arguments)]
    pub fn plugin_in(
        &self,
        namespace: &str,
        version: &str,
        command: &str,
        node: &str,
        container: &str,
        ipam: Value,
        top: Value,
    ) -> (i32, Value) {
        let plugin = test_kit::plugin::build_plugin_beside(std::path::Path::new(BIN));
        self.plugin_binary_in(
            &plugin, namespace, version, command, node, container, ipam, top,
        )
    }

    /// [`Lab::plugin`] with another release's plugin, `plugin`.
    pub fn plugin_of(
        &self,
        plugin: &std::path::Path,
        command: &str,
        node: &str,
        container: &str,
        ipam: Value,
    ) -> (i32, Value) {
        self.plugin_binary_in(
            plugin,
            "default",
            "1.0.0",
            command,
            node,
            container,
            ipam,
            Value::Null,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn plugin_binary_in(
        &self,
        plugin: &std::path::Path,
        namespace: &str,
        version: &str,
        command: &str,
        node: &str,
        container: &str,
        ipam: Value,
        top: Value,
    ) -> (i32, Value) {
        let mut conf = serde_json::json!({
            "type": "blockipam",
            "datastore_type": self.type_name(),
            "nodename": node,
            "ipam_lock_file": self.dir.path().join(format!("{node}.lock")),
            "agent_socket": "",
        });
        match self.etcd() {
            Some((endpoint, prefix)) => {
                conf["etcd_endpoints"] = Value::from(endpoint);
                conf["etcd_prefix"] = Value::from(prefix);
            }
            None => conf["datastore_path"] = Value::from(self.path().display().to_string()),
        }
        if let (Some(conf), Value::Object(extra)) = (conf.as_object_mut(), ipam) {
            conf.extend(extra);
        }
        let mut netconf =
            serde_json::json!({"cniVersion": version, "name": "fixture", "ipam": conf});
        if let (Some(netconf), Value::Object(extra)) = (netconf.as_object_mut(), top) {
            netconf.extend(extra);
        }
        let pod_args = format!("K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={container}");
        call_plugin_binary(plugin, command, container, Some(&pod_args), &netconf)
    }

    /// Allocates one IPv4 address for `handle` on `host` and returns it.
    pub fn assign(&self, handle: &str, host: &str) -> IpAddr {
        let (handle, host) = (handle.to_owned(), host.to_owned());
        self.with_ipam(|ipam| async move {
            let result = ipam
                .auto_assign(&AutoAssignRequest {
                    handle: handle.clone(),
                    host,
                    num_v4: 1,
                    attributes: BTreeMap::from([("pod".to_owned(), handle)]),
                    ..AutoAssignRequest::default()
                })
                .await
                .expect("auto-assign");
            result.v4.first().expect("one address").ip
        })
    }
}

/// The outcome of one blockipamctl run.
#[derive(Debug)]
pub struct Run {
    /// The arguments (for messages).
    pub args: Vec<String>,
    /// The exit status.
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Run {
    fn describe(&self) -> String {
        format!(
            "blockipamctl {}\n--- exit status {}\n--- stdout:\n{}\n--- stderr:\n{}",
            self.args.join(" "),
            self.code,
            self.stdout,
            self.stderr
        )
    }

    /// Asserts exit status 0.
    pub fn ok(&self) -> &Self {
        self.expect_code(0)
    }

    /// Asserts this exit status, and that nothing panicked.
    pub fn expect_code(&self, code: i32) -> &Self {
        assert_eq!(
            self.code,
            code,
            "unexpected exit status\n{}",
            self.describe()
        );
        assert!(
            !self.stderr.contains("panicked") && !self.stderr.contains("RUST_BACKTRACE"),
            "a panic\n{}",
            self.describe()
        );
        self
    }

    /// Parses stdout as one JSON document.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e})\n{}", self.describe()))
    }

    /// The one `error: ` line on stderr (asserting there is exactly one and no panic).
    pub fn error_line(&self) -> String {
        let lines: Vec<&str> = self
            .stderr
            .lines()
            .filter(|l| l.starts_with("error: "))
            .collect();
        assert_eq!(
            lines.len(),
            1,
            "expected one error line\n{}",
            self.describe()
        );
        assert!(
            !self.stderr.contains("panicked"),
            "a panic\n{}",
            self.describe()
        );
        lines[0].to_owned()
    }

    /// Asserts stdout contains `text`.
    pub fn stdout_has(&self, text: &str) -> &Self {
        assert!(
            self.stdout.contains(text),
            "stdout lacks {text:?}\n{}",
            self.describe()
        );
        self
    }
}

/// Runs blockipamctl with exactly these arguments and extra environment variables (its own
/// variables are removed from the inherited environment first).
pub fn ctl(args: &[String], env: &[(&str, &str)]) -> Run {
    let mut command = ctl_command(BIN.as_ref(), args);
    for (name, value) in env {
        command.env(name, value);
    }
    run_guarded(command, args)
}

/// `binary` with `args`, and none of blockipamctl's environment variables from this process.
fn ctl_command(binary: &std::path::Path, args: &[String]) -> Command {
    let mut command = Command::new(binary);
    command.args(args);
    for name in CTL_ENV {
        command.env_remove(name);
    }
    command
}

/// Runs a command with piped output, killing it if it outlives [`HANG_GUARD`].
pub fn run_guarded(command: Command, args: &[String]) -> Run {
    run_guarded_into(command, args, Stdio::piped())
}

/// As [`run_guarded`], with stdout going to `stdout` (read into the [`Run`] only when piped).
pub fn run_guarded_into(mut command: Command, args: &[String], stdout: Stdio) -> Run {
    command
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("start blockipamctl");
    let stdout = child.stdout.take();
    let mut stderr = child.stderr.take().expect("stderr pipe");
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut stdout) = stdout {
            let _ = stdout.read_to_string(&mut text);
        }
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for blockipamctl") {
            break status;
        }
        if started.elapsed() > HANG_GUARD {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "blockipamctl {} hung: killed after {} s",
                args.join(" "),
                HANG_GUARD.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Run {
        args: args.to_vec(),
        code: status.code().unwrap_or(-1),
        stdout: out.join().expect("stdout reader"),
        stderr: err.join().expect("stderr reader"),
    }
}

/// Asserts that every column boundary of a table's header line is a boundary in every row: the
/// character just before each header column is a space on every line.
pub fn assert_columns_line_up(table: &str) {
    let lines: Vec<&str> = table.lines().take_while(|l| !l.is_empty()).collect();
    let header = lines.first().expect("a header line");
    let bytes = header.as_bytes();
    let starts: Vec<usize> = (2..bytes.len())
        .filter(|&i| bytes[i] != b' ' && bytes[i - 1] == b' ' && bytes[i - 2] == b' ')
        .collect();
    assert!(!starts.is_empty(), "not a table: {table}");
    for line in &lines[1..] {
        for &start in &starts {
            assert!(
                line.len() >= start && line.as_bytes()[start - 1] == b' ',
                "column at {start} does not line up in {line:?}\n{table}"
            );
        }
    }
}

/// The cells of the row of a table whose first cell is `first`: columns are separated by two
/// spaces or more, and no cell holds two spaces in a row.
pub fn table_row(table: &str, first: &str) -> Vec<String> {
    let line = table
        .lines()
        .find(|line| line.split_whitespace().next() == Some(first))
        .unwrap_or_else(|| panic!("no row for {first} in\n{table}"));
    line.split("  ")
        .map(str::trim)
        .filter(|cell| !cell.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A loopback port nothing listens on.
pub fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    listener.local_addr().expect("local address").port()
}

/// Runs `plugin` once for `command` on `container` (interface eth0, a netns path nobody opens) with
/// `netconf` on stdin and `cni_args` as `CNI_ARGS`; returns its exit status and its stdout as JSON
/// (null when empty).
pub fn call_plugin_binary(
    plugin: &Path,
    command: &str,
    container: &str,
    cni_args: Option<&str>,
    netconf: &Value,
) -> (i32, Value) {
    let mut env = full_cni_env(
        command,
        container,
        "eth0",
        "/var/run/netns/blockipamctl-test",
        "/nonexistent",
    );
    if let Some(cni_args) = cni_args {
        env.push(("CNI_ARGS".to_owned(), cni_args.to_owned()));
    }
    let output = run_cni(
        plugin,
        &[],
        &env,
        netconf.to_string().as_bytes(),
        HANG_GUARD,
    );
    let stdout = if output.stdout.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&output.stdout).unwrap_or_else(|e| {
            panic!(
                "the plugin's stdout is not JSON ({e}): {}\n{}",
                output.stdout, output.stderr
            )
        })
    };
    (output.status, stdout)
}

/// A registration of `host` (agent version "test", reading today's format) marked missing by a reclaimer
/// that saw no plugin activity (countdown revision 1, activity revision 0, grace 900 s).
pub fn marked_registration(host: &str, registered_at: u64) -> Registration {
    Registration {
        node: host.to_owned(),
        registered_at,
        agent_version: "test".into(),
        reads_format: Some(ipam_core::model::FORMAT_VERSION),
        missing_since: None,
        missing_mark: Some(MissingMark {
            countdown_revision: 1,
            activity_revision: 0,
            grace_seconds: 900,
        }),
        blocks_released: false,
    }
}
