//! Each release's plugin and CLI through the other release's agent (a sled store): every call is answered within its bound, by a success or an error naming both versions; today's client reads ranges through the previous agent (protocol 1) as listings cut to their windows.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use backend_agent::protocol::{PROTOCOL_V1, PROTOCOL_VERSION};
use backend_agent::{AgentConfig, AgentStore};
use blockipam_store::DatastoreType;
use serde_json::{json, Value};
use test_kit::agent::InProcessAgent;
use test_kit::cni::{cni_env, start_cni, Outcome};
use test_kit::previous::PreviousRelease;

use crate::cluster::{describe, merge, CALL_BOUND, MAIN, MAIN_POOL, NETWORK};

/// Longest the previous agent may take to bind its socket.
const AGENT_START_BOUND: Duration = Duration::from_secs(30);

/// The previous release's agent, a process of its own; killed on drop.
pub(crate) struct PreviousAgent {
    child: Child,
    log: PathBuf,
}

impl PreviousAgent {
    /// Starts it on `socket` serving (and creating) the sled store at `store`, and waits until
    /// the socket is there.
    ///
    /// # Panics
    /// As [`PreviousAgent::start_with_flags`].
    fn start(previous: &PreviousRelease, socket: &Path, store: &Path, log: PathBuf) -> Self {
        let mut flags: Vec<OsString> = ["--datastore-type", "sled", "--datastore-path"]
            .map(OsString::from)
            .into();
        flags.push(store.into());
        flags.push("--create-if-missing".into());
        Self::start_with_flags(previous, socket, &flags, log)
    }

    /// Starts it on `socket` with `flags` (the store it serves, and any other), its log (stderr,
    /// at its default level) written to `log`, and waits until the socket is there.
    ///
    /// # Panics
    /// When it cannot start, exits, or does not bind within [`AGENT_START_BOUND`].
    pub(crate) fn start_with_flags(
        previous: &PreviousRelease,
        socket: &Path,
        flags: &[OsString],
        log: PathBuf,
    ) -> Self {
        let log_file = std::fs::File::create(&log).expect("the agent's log file");
        let child = Command::new(previous.agent())
            .arg("--socket")
            .arg(socket)
            .args(flags)
            .args(["--lock-wait-seconds", "0", "--shutdown-grace-seconds", "5"])
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", previous.agent().display()));
        let mut agent = PreviousAgent { child, log };
        let deadline = Instant::now() + AGENT_START_BOUND;
        while !socket.exists() {
            if let Ok(Some(status)) = agent.child.try_wait() {
                panic!(
                    "the previous agent exited ({status}) before serving: {}",
                    agent.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the previous agent did not bind {} within {AGENT_START_BOUND:?}: {}",
                socket.display(),
                agent.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        agent
    }

    /// Kills it with SIGKILL (nothing of it runs on: no lease revoked, its socket left behind)
    /// and waits for it.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether it is still running.
    pub(crate) fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// What it logged so far.
    pub(crate) fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PreviousAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `text` names both sides' versions of a mismatch: the stored formats (today's, the
/// previous release reading 1 to 3), or the agent protocols (today's and the previous one).
fn names_both_versions(text: &str) -> bool {
    let formats = text.contains(&format!(
        "format version {}",
        ipam_core::model::FORMAT_VERSION
    )) && text.contains("versions 1 to 3");
    let protocols = text.contains("protocol version")
        && text.contains(&PROTOCOL_VERSION.to_string())
        && text.contains(&PROTOCOL_V1.to_string());
    formats || protocols
}

/// What one run through the other release's agent found.
#[derive(Debug, Default)]
struct Calls {
    failures: Vec<String>,
    answered: usize,
    /// The first warning a call logged on stderr, shown in the summary.
    first_warning: Option<String>,
}

impl Calls {
    /// A call must end within its bound, and succeed or fail naming both versions.
    fn judge(&mut self, what: &str, done: &Outcome, hung: bool) {
        if hung {
            self.failures
                .push(format!("{what} hung: killed after {CALL_BOUND:?}"));
            return;
        }
        self.answered += 1;
        if self.first_warning.is_none() {
            self.first_warning = done
                .stderr
                .lines()
                .find(|line| line.contains("WARN"))
                .map(str::to_owned);
        }
        if done.status != 0 {
            let message = format!("{} {}", describe(done), done.stderr);
            if !names_both_versions(&message) {
                self.failures.push(format!(
                    "{what} failed without naming both versions: {}",
                    describe(done)
                ));
            }
        }
    }

    fn assert_clean(&self, what: &str) {
        eprintln!(
            "{what}: {} calls answered; first warning: {}",
            self.answered,
            self.first_warning.as_deref().unwrap_or("none")
        );
        assert!(
            self.failures.is_empty(),
            "{what}: {} failures:\n{}",
            self.failures.len(),
            self.failures.join("\n")
        );
    }
}

/// A netconf of node `node` on the sled store at `store` behind `socket`.
fn netconf(node: &str, dir: &Path, socket: &Path, store: &Path) -> Value {
    json!({
        "cniVersion": "1.1.0",
        "name": NETWORK,
        "ipam": {
            "type": "blockipam",
            "nodename": node,
            "datastore_type": "sled",
            "datastore_path": store,
            "agent_socket": socket,
            "ipam_lock_file": dir.join(format!("{node}.lock")),
            "ipam_lock_timeout_seconds": 30,
            "timeout_seconds": 30,
            "log_level": "warning",
            "pools": [{"cidr": MAIN_POOL, "block_size": 29, "name": MAIN}],
        }
    })
}

/// ADD of two containers, CHECK of one, DEL of it, GC keeping the other, STATUS, DEL of the
/// other: each through `plugin`, judged by [`Calls::judge`].
fn plugin_calls(calls: &mut Calls, plugin: &Path, netconf: &Value, who: &str) {
    let mut run = |command: &str, container: &str, netconf: &Value| {
        let ended = start_cni(
            plugin,
            &[],
            cni_env(command, container, "eth0"),
            netconf.to_string().as_bytes(),
        )
        .wait_or_kill(CALL_BOUND);
        let hung = ended.hung;
        let done: Outcome = ended.into();
        calls.judge(&format!("{who} {command} {container}"), &done, hung);
        done
    };
    let first = run("ADD", "c1", netconf);
    run("ADD", "c2", netconf);
    let mut check = netconf.clone();
    let previous_result: Value = serde_json::from_str(&first.stdout).unwrap_or(Value::Null);
    merge(&mut check, json!({"prevResult": previous_result}));
    run("CHECK", "c1", &check);
    run("DEL", "c1", netconf);
    let mut gc = netconf.clone();
    merge(
        &mut gc,
        json!({"cni.dev/valid-attachments": [{"containerID": "c2", "ifname": "eth0"}]}),
    );
    run("GC", "", &gc);
    run("STATUS", "", netconf);
    run("DEL", "c2", netconf);
}

/// The arguments of a CLI `command` (JSON output) on the sled `store` through the agent at
/// `socket`, for either release's CLI.
fn cli_args(socket: &Path, store: &Path, command: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "-o".into(),
        "json".into(),
        "--datastore-type".into(),
        "sled".into(),
        "--datastore-path".into(),
        store.display().to_string(),
        "--agent-socket".into(),
        socket.display().to_string(),
    ];
    args.extend(command.iter().map(|a| (*a).to_owned()));
    args
}

/// The previous release's CLI: `show`, `pool list`, `check`, bounded.
fn previous_cli_calls(calls: &mut Calls, previous: &PreviousRelease, socket: &Path, store: &Path) {
    for command in [&["show"][..], &["pool", "list"], &["check"]] {
        let args = cli_args(socket, store, command);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let ended = start_cni(&previous.cli(), &args, Vec::<(String, String)>::new(), b"")
            .wait_or_kill(CALL_BOUND);
        let hung = ended.hung;
        let done: Outcome = ended.into();
        calls.judge(
            &format!("previous blockipamctl {}", command.join(" ")),
            &done,
            hung,
        );
    }
}

/// Today's CLI (in-process): `show`, `pool list`, `check`.
fn todays_cli_calls(calls: &mut Calls, socket: &Path, store: &Path) {
    for command in [&["show"][..], &["pool", "list"], &["check"]] {
        let mut argv: Vec<String> = vec!["blockipamctl".into()];
        argv.extend(cli_args(socket, store, command));
        let env = blockipamctl::Env::new(Vec::<(String, String)>::new());
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        let status = blockipamctl::run(argv, &env, &mut stdout, &mut stderr, false);
        let done = Outcome {
            status,
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        };
        calls.judge(
            &format!("today's blockipamctl {}", command.join(" ")),
            &done,
            false,
        );
    }
}

#[test]
fn the_previous_plugin_and_cli_through_todays_agent_are_answered() {
    let previous = PreviousRelease::locate();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("agent.sock");
    let store = dir.path().join("store.sled");
    let agent = InProcessAgent::run_binary(&socket, DatastoreType::Sled, &store)
        .unwrap_or_else(|e| panic!("today's agent did not start: {e}"));
    let mut calls = Calls::default();
    let netconf = netconf("old-1", dir.path(), &socket, &store);
    plugin_calls(&mut calls, &previous.plugin(), &netconf, "previous plugin");
    previous_cli_calls(&mut calls, &previous, &socket, &store);
    drop(agent);
    calls.assert_clean(&format!(
        "the previous release ({}) through today's agent",
        previous.commit()
    ));
}

#[test]
fn todays_plugin_and_cli_through_the_previous_agent_are_answered() {
    let previous = PreviousRelease::locate();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("agent.sock");
    let store = dir.path().join("store.sled");
    let agent = PreviousAgent::start(&previous, &socket, &store, dir.path().join("agent.log"));
    let mut calls = Calls::default();
    let netconf = netconf("new-1", dir.path(), &socket, &store);
    let plugin = PathBuf::from(env!("CARGO_BIN_EXE_blockipam"));
    plugin_calls(&mut calls, &plugin, &netconf, "today's plugin");
    todays_cli_calls(&mut calls, &socket, &store);
    let log = agent.log_text();
    drop(agent);
    if !log.trim().is_empty() {
        eprintln!("the previous agent's log:\n{log}");
    }
    calls.assert_clean(&format!(
        "today's release through the previous agent ({})",
        previous.commit()
    ));
}

#[test]
fn todays_client_reads_ranges_through_the_previous_agent() {
    use ipam_core::{KvStore, Read, ReadResult};
    let previous = PreviousRelease::locate();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("agent.sock");
    let store = dir.path().join("store.sled");
    let agent = PreviousAgent::start(&previous, &socket, &store, dir.path().join("agent.log"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let windows = runtime.block_on(async {
        let client =
            AgentStore::connect(AgentConfig::new(&socket).with_timeouts(CALL_BOUND, CALL_BOUND))
                .await
                .expect("connect to the previous agent");
        assert_eq!(client.protocol().await, Some(PROTOCOL_V1));
        for key in ["r/a", "r/a/1", "r/a/2", "r/a/3", "r/a/4", "r/ab", "r/b"] {
            client.put(key, b"v".to_vec()).await.expect("put");
        }
        let results = client
            .read_many(&[
                Read::range("r/a/", "r/a/2", 2),
                Read::Get("r/b".into()),
                Read::range("r/a/", "", 2),
                Read::range("r/a/", "r/a/9", 5),
                Read::range("r/a/", "r/a/3", 10),
            ])
            .await
            .expect("ranges through the previous agent");
        let zero = client.read_many(&[Read::range("r/a/", "", 0)]).await;
        assert!(
            matches!(zero, Err(ipam_core::KvError::InvalidArgument { .. })),
            "{zero:?}"
        );
        results
    });
    let keys = |result: &ReadResult| match result {
        ReadResult::Listed(kvs) => kvs.iter().map(|kv| kv.key.clone()).collect::<Vec<_>>(),
        other => panic!("expected a list result, got {other:?}"),
    };
    assert_eq!(keys(&windows[0]), ["r/a/2", "r/a/3"]);
    assert!(matches!(&windows[1], ReadResult::Got(Some(kv)) if kv.key == "r/b"));
    assert_eq!(keys(&windows[2]), ["r/a/1", "r/a/2"]);
    assert!(keys(&windows[3]).is_empty());
    assert_eq!(keys(&windows[4]), ["r/a/3", "r/a/4"]);
    let log = agent.log_text();
    drop(agent);
    assert!(
        !log.contains("ERROR"),
        "the previous agent logged an error: {log}"
    );
}
