//! The agent as systemd runs it, through the real binaries: the shipped units verified, socket
//! activation with the real plugin, every setting from the environment, a fresh node's store and
//! the refusal once it is gone, the runtime directory's mode with --allowed-uid, a log free of
//! colour escapes.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const AGENT: &str = env!("CARGO_BIN_EXE_blockipam-agent");
const SOCKET_ACTIVATE: &str = "/usr/bin/systemd-socket-activate";
/// Longest a plugin call or an agent's start or stop may take before the test calls it a hang.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn unit_text(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The value of the first `key=` line of a unit.
fn unit_setting(text: &str, key: &str) -> String {
    text.lines()
        .find_map(|line| line.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in the unit:\n{text}"))
        .trim()
        .to_owned()
}

fn octal_mode(text: &str, key: &str) -> u32 {
    let value = unit_setting(text, key);
    u32::from_str_radix(&value, 8).unwrap_or_else(|e| panic!("{key}={value}: {e}"))
}

/// A process whose standard error goes to a file, as under journald (not a terminal).
struct Logged {
    child: Child,
    log: PathBuf,
}

impl Logged {
    fn spawn(mut command: Command, log: &Path) -> Logged {
        let file = std::fs::File::create(log).expect("create the log file");
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("start {command:?}: {e}"));
        Logged {
            child,
            log: log.to_owned(),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log holds `needle`, failing if the process exits first or after the hang
    /// guard.
    fn wait_for_log(&mut self, needle: &str) {
        let deadline = Instant::now() + HANG_GUARD;
        while !self.log().contains(needle) {
            if let Some(status) = self.child.try_wait().expect("poll") {
                panic!(
                    "exited ({status}) before logging {needle:?}:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in the log within {HANG_GUARD:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn terminate(&self) {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Waits for the exit; a process still running after the hang guard (an agent serving where
    /// it should have refused) fails the test, and is killed when dropped.
    fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + HANG_GUARD;
        loop {
            if let Some(status) = self.child.try_wait().expect("poll") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "did not exit within {HANG_GUARD:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The agent binary with an empty environment but `variables`, and no flag unless given.
fn agent_command(variables: &[(&str, String)], flags: &[&str]) -> Command {
    let mut command = Command::new(AGENT);
    command.env_clear().args(flags);
    for (name, value) in variables {
        command.env(name, value);
    }
    command
}

/// A netconf for the sled store at `store`, reaching the agent at `socket`.
fn netconf(store: &Path, socket: &Path, lock: &Path) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": "systemdnet",
        "ipam": {
            "type": "blockipam",
            "nodename": "node-a",
            "datastore_type": "sled",
            "datastore_path": store,
            "agent_socket": socket,
            "ipam_lock_file": lock,
            "timeout_seconds": 30,
            "pools": [{"cidr": "10.78.0.0/16", "block_size": 26, "name": "systemd-pool"}]
        }
    })
}

#[test]
fn shipped_units_pass_systemd_analyze_verify() {
    let service = unit_text("blockipam-agent.service");
    let socket = unit_text("blockipam-agent.socket");
    assert!(
        service.contains("ExecStart=/usr/local/bin/blockipam-agent"),
        "{service}"
    );
    // verify insists that ExecStart's binary exists: point it at the one cargo built.
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("blockipam-agent.service"),
        service.replace("/usr/local/bin/blockipam-agent", AGENT),
    )
    .expect("write the service copy");
    std::fs::write(dir.path().join("blockipam-agent.socket"), &socket)
        .expect("write the socket copy");
    let output = Command::new("systemd-analyze")
        .args(["verify", "blockipam-agent.socket", "blockipam-agent.service"])
        .current_dir(dir.path())
        .output()
        .unwrap_or_else(|e| {
            panic!("systemd-analyze is needed (Debian package systemd; scripts/setup installs it): {e}")
        });
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stderr.trim().is_empty(),
        "systemd-analyze verify: {}\n{stderr}",
        output.status
    );
    // The wiring between the two, and the socket where the plugin looks by default.
    assert_eq!(
        unit_setting(&socket, "ListenStream"),
        "/run/blockipam/agent.sock"
    );
    assert_eq!(unit_setting(&service, "Requires"), "blockipam-agent.socket");
    assert_eq!(unit_setting(&service, "Also"), "blockipam-agent.socket");
    assert!(
        unit_setting(&service, "After").contains("blockipam-agent.socket"),
        "{service}"
    );
    assert_eq!(
        unit_setting(&service, "Environment"),
        "BLOCKIPAM_AGENT_CREATE_ON_FIRST_START=true"
    );
}

/// As systemd does it: the socket is bound before the agent runs, the first connection (a real
/// plugin ADD) starts the agent on the inherited socket, the ADD and DEL go through it, and at
/// SIGTERM the agent leaves the socket, which is systemd's.
#[test]
fn a_socket_activated_agent_serves_the_plugin_and_leaves_the_socket_at_stop() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let store = dir.path().join("store.sled");
    let lock = dir.path().join("ipam.lock");
    let mut command = Command::new(SOCKET_ACTIVATE);
    command
        .env_clear()
        .arg("-l")
        .arg(&socket)
        .args(["-E", "BLOCKIPAM_AGENT_LOG=debug", AGENT, "--socket"])
        .arg(&socket)
        .args(["--datastore-type", "sled", "--datastore-path"])
        .arg(&store)
        .args(["--create-on-first-start", "--metrics-listen", "127.0.0.1:0"]);
    let mut activator = Logged::spawn(command, &dir.path().join("agent.log"));
    common::wait_for_path(&socket, HANG_GUARD);
    assert!(
        !activator.log().contains("blockipam-agent starting"),
        "the agent started before any connection:\n{}",
        activator.log()
    );

    let conf = netconf(&store, &socket, &lock);
    let add = common::run_plugin("ADD", "ctr-activated", &conf, HANG_GUARD);
    let result = add.success_json("ADD through the socket-activated agent");
    let addresses = test_kit::cni::result_addresses(&result);
    assert_eq!(addresses.len(), 1, "{add:#?}");
    let through = format!("store reached through the agent at {}", socket.display());
    assert!(add.stderr.contains(&through), "ADD: {add:#?}");
    assert!(
        !add.stderr.contains("etcd credentials"),
        "an agent serving sled has no etcd credentials to speak of: {add:#?}"
    );
    activator.wait_for_log("connection accepted");
    let log = activator.log();
    assert!(
        log.contains(&format!("socket={} (socket activation)", socket.display())),
        "{log}"
    );
    assert!(
        !log.contains("not at --socket"),
        "the inherited socket's path was not recognised:\n{log}"
    );
    // systemd passes the socket without close-on-exec; the agent sets it (as sd_listen_fds does), so
    // no program it may start inherits the listening socket. systemd-socket-activate, without
    // --accept, runs the agent in its own process: the child's descriptor 3 is the agent's.
    let fdinfo_path = format!("/proc/{}/fdinfo/3", activator.child.id());
    let fdinfo = std::fs::read_to_string(&fdinfo_path)
        .unwrap_or_else(|e| panic!("cannot read {fdinfo_path}: {e}"));
    let flags = fdinfo
        .lines()
        .find_map(|line| line.strip_prefix("flags:"))
        .map(|octal| u32::from_str_radix(octal.trim(), 8).expect("octal flags"))
        .unwrap_or_else(|| panic!("no flags in {fdinfo_path}:\n{fdinfo}"));
    assert_ne!(
        flags & libc::O_CLOEXEC as u32,
        0,
        "the inherited socket is not close-on-exec: {fdinfo}"
    );

    let del = common::run_plugin("DEL", "ctr-activated", &conf, HANG_GUARD);
    del.assert_silent_success("DEL through the socket-activated agent");
    assert!(del.stderr.contains(&through), "DEL: {del:#?}");
    // The agent's counters: two clients served (ADD, DEL), each of which committed.
    let metrics = common::scrape(&activator.log());
    assert_eq!(
        common::sample(
            &metrics,
            "blockipam_agent_connections_total{outcome=\"accepted\"}"
        ),
        2.0,
        "{metrics}"
    );
    assert!(
        common::sample(
            &metrics,
            "blockipam_agent_request_duration_seconds_count{kind=\"commit\"}"
        ) >= 2.0,
        "{metrics}"
    );

    activator.terminate();
    let status = activator.wait();
    assert!(status.success(), "{status}:\n{}", activator.log());
    assert!(
        activator.log().contains("blockipam-agent stopped"),
        "{}",
        activator.log()
    );
    let metadata = std::fs::symlink_metadata(&socket)
        .unwrap_or_else(|e| panic!("the agent removed systemd's socket ({e})"));
    assert!(
        std::os::unix::fs::FileTypeExt::is_socket(&metadata.file_type()),
        "{metadata:?}"
    );
}

/// What an agent started by hand with systemd's variables but a descriptor 3 that is not a
/// listening unix stream socket says (and that it does not serve).
fn start_with_bad_descriptor(python_setup: &str, listen_fds: &str) -> (ExitStatus, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let program = format!(
        "import os, socket, sys\n{python_setup}\nos.dup2(fd, 3)\nos.set_inheritable(3, True)\n\
         os.environ['LISTEN_PID'] = str(os.getpid())\n\
         os.environ['LISTEN_FDS'] = '{listen_fds}'\n\
         os.execv(sys.argv[1], sys.argv[1:])\n"
    );
    let output = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(&program)
        .arg(AGENT)
        .arg("--datastore-path")
        .arg(dir.path().join("store.sled"))
        .arg("--create-if-missing")
        .env_clear()
        .env("TMPDIR", dir.path())
        .output()
        .expect("run /usr/bin/python3");
    assert!(
        !dir.path().join("store.sled").exists(),
        "the store was opened before the descriptor was checked"
    );
    (
        output.status,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn an_inherited_descriptor_that_is_not_a_listening_unix_stream_socket_is_refused() {
    for (setup, listen_fds, expected) in [
        (
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); fd = s.fileno()",
            "1",
            "not a listening unix stream socket",
        ),
        (
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); fd = s.fileno()",
            "1",
            "not a listening unix stream socket",
        ),
        (
            "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM); s.bind(('127.0.0.1', 0)); \
             s.listen(); fd = s.fileno()",
            "1",
            "not a listening unix stream socket",
        ),
        (
            "fd = os.open('/etc/hostname', os.O_RDONLY)",
            "1",
            "not a socket",
        ),
        (
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); fd = s.fileno()",
            "2",
            "LISTEN_FDS=2",
        ),
    ] {
        let (status, stderr) = start_with_bad_descriptor(setup, listen_fds);
        assert_eq!(status.code(), Some(1), "{setup}: {stderr}");
        assert!(
            stderr.contains("socket activation") && stderr.contains(expected),
            "{setup}: expected {expected:?} in:\n{stderr}"
        );
    }
}

/// No flag at all: every setting from its environment variable, each other than its default,
/// shows in the configuration the agent logs and, where it can be seen from outside, in what it
/// does.
#[test]
fn every_flag_is_taken_from_the_environment_alone() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("run/agent.sock");
    let store = dir.path().join("store.redb");
    let variables: Vec<(&str, String)> = vec![
        ("BLOCKIPAM_AGENT_SOCKET", socket.display().to_string()),
        ("BLOCKIPAM_AGENT_ALLOWED_UIDS", "4242,4343".into()),
        ("BLOCKIPAM_AGENT_SHUTDOWN_GRACE_SECONDS", "3.5".into()),
        ("BLOCKIPAM_AGENT_METRICS_LISTEN", "127.0.0.1:0".into()),
        ("BLOCKIPAM_AGENT_METRICS_CACHE_SECONDS", "7".into()),
        ("BLOCKIPAM_AGENT_CREATE_IF_MISSING", "true".into()),
        // As an environment file overrides the unit's `true`: off, and no conflict with the above.
        ("BLOCKIPAM_AGENT_CREATE_ON_FIRST_START", "false".into()),
        ("DATASTORE_TYPE", "redb".into()),
        ("DATASTORE_PATH", store.display().to_string()),
        // ETCD_ENDPOINTS beside an embedded type is refused (which store is meant?): it is
        // taken from the environment in a second run below, alone.
        ("ETCD_CA_CERT_FILE", "/nonexistent/ca.pem".into()),
        ("ETCD_CERT_FILE", "/nonexistent/cert.pem".into()),
        ("ETCD_KEY_FILE", "/nonexistent/key.pem".into()),
        ("ETCD_PREFIX", "/from-env/".into()),
        ("ETCD_USERNAME", "env-user".into()),
        ("ETCD_PASSWORD", "env-secret".into()),
        ("BLOCKIPAM_LOCK_WAIT_SECONDS", "4".into()),
        ("BLOCKIPAM_ETCD_TIMEOUT_SECONDS", "6".into()),
        ("NODENAME", "env-node".into()),
        ("BLOCKIPAM_AGENT_LIVENESS_TTL_SECONDS", "31".into()),
        ("BLOCKIPAM_AGENT_DEAD_NODE_GRACE_SECONDS", "901".into()),
        ("BLOCKIPAM_AGENT_RECLAIM_INTERVAL_SECONDS", "61".into()),
        ("BLOCKIPAM_AGENT_NO_RECLAIM", "true".into()),
        ("BLOCKIPAM_AGENT_EMPTY_BLOCK_RELEASE_SECONDS", "902".into()),
    ];
    let mut agent = Logged::spawn(agent_command(&variables, &[]), &dir.path().join("log"));
    agent.wait_for_log("blockipam-agent serving");
    let log = agent.log();
    for expected in [
        format!("socket: {:?}", socket.display().to_string()),
        "allowed_uid: [4242, 4343]".into(),
        "shutdown_grace_seconds: 3.5".into(),
        "metrics_listen: Some(127.0.0.1:0)".into(),
        "metrics_cache_seconds: 7.0".into(),
        "create_if_missing: true, create_on_first_start: false".into(),
        "datastore_type: Some(\"redb\")".into(),
        format!("datastore_path: Some({:?})", store.display().to_string()),
        "etcd_ca_cert_file: Some(\"/nonexistent/ca.pem\")".into(),
        "etcd_cert_file: Some(\"/nonexistent/cert.pem\")".into(),
        "etcd_key_file: Some(\"/nonexistent/key.pem\")".into(),
        "etcd_prefix: Some(\"/from-env/\")".into(),
        "etcd_username: Some(\"env-user\")".into(),
        "etcd_password: Some(<redacted>)".into(),
        "lock_wait_seconds: 4.0".into(),
        "etcd_timeout_seconds: Some(6.0)".into(),
        "node: Some(\"env-node\")".into(),
        "liveness_ttl_seconds: 31".into(),
        "dead_node_grace_seconds: 901".into(),
        "reclaim_interval_seconds: 61".into(),
        "no_reclaim: true".into(),
        "empty_block_release_seconds: 902".into(),
    ] {
        assert!(log.contains(&expected), "no {expected:?} in:\n{log}");
    }
    assert!(
        !log.contains("env-secret"),
        "the password was logged:\n{log}"
    );
    // Seen from outside: the socket where the variable says, open to the allowed uids (0666),
    // the redb store created there, the metrics endpoint listening.
    let mode = std::fs::metadata(&socket)
        .expect("the socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o666, "the allowed uids did not open the socket");
    assert!(store.is_file(), "no redb store at {}", store.display());
    assert!(log.contains("metrics endpoint listening"), "{log}");
    agent.terminate();
    assert!(agent.wait().success(), "{}", agent.log());

    // ETCD_ENDPOINTS alone: the agent serves that etcd (endpoints without a type mean etcd), even
    // while nothing answers there.
    let endpoint = "http://127.0.0.1:1";
    let etcd_socket = dir.path().join("etcd/agent.sock");
    let etcd_variables: Vec<(&str, String)> = vec![
        ("BLOCKIPAM_AGENT_SOCKET", etcd_socket.display().to_string()),
        ("ETCD_ENDPOINTS", endpoint.into()),
        ("NODENAME", "env-node".into()),
        ("BLOCKIPAM_AGENT_NO_RECLAIM", "true".into()),
    ];
    let mut etcd_agent = Logged::spawn(
        agent_command(&etcd_variables, &[]),
        &dir.path().join("etcd-log"),
    );
    etcd_agent.wait_for_log("blockipam-agent serving");
    let log = etcd_agent.log();
    for expected in [
        format!("etcd_endpoints: Some({endpoint:?})"),
        format!("etcdv3 at {endpoint}"),
    ] {
        assert!(log.contains(&expected), "no {expected:?} in:\n{log}");
    }
    etcd_agent.terminate();
    assert!(etcd_agent.wait().success(), "{}", etcd_agent.log());
}

/// The unit's setting, from the environment as the unit gives it: a fresh node's store is
/// created (and its marker written); once the store is deleted, the agent refuses to start,
/// naming the marker, and creates nothing; with the marker removed, it creates a new store.
#[test]
fn a_fresh_node_gets_its_store_and_a_deleted_store_is_refused_by_its_marker() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let store = dir.path().join("store.sled");
    let marker = dir.path().join("store.sled.created");
    let variables: Vec<(&str, String)> = vec![
        ("BLOCKIPAM_AGENT_SOCKET", socket.display().to_string()),
        ("DATASTORE_PATH", store.display().to_string()),
        ("BLOCKIPAM_AGENT_CREATE_ON_FIRST_START", "true".into()),
    ];
    let start = |name: &str| {
        let mut agent = Logged::spawn(agent_command(&variables, &[]), &dir.path().join(name));
        agent.wait_for_log("blockipam-agent serving");
        agent.terminate();
        assert!(agent.wait().success(), "{}", agent.log());
        agent.log()
    };

    // A fresh node: no store, no marker.
    let log = start("first.log");
    assert!(store.is_dir(), "the store was not created:\n{log}");
    let said = std::fs::read_to_string(&marker).expect("the marker was written");
    assert!(said.contains("created the store"), "{said}");
    // A restart with the store there opens it.
    start("second.log");

    // The store is deleted: the agent refuses and creates nothing.
    std::fs::remove_dir_all(&store).expect("delete the store");
    let mut refused = Logged::spawn(agent_command(&variables, &[]), &dir.path().join("gone.log"));
    let status = refused.wait();
    let stderr = refused.log();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("the store {} does not exist", store.display()))
            && stderr.contains(&format!("its marker {}", marker.display()))
            && stderr.contains("remove the marker"),
        "{stderr}"
    );
    assert!(
        !store.exists(),
        "a new store was created over the deleted one"
    );
    assert!(!socket.exists(), "the refusing agent left a socket");

    // The operator decides there is nothing to lose: without the marker, a new store.
    std::fs::remove_file(&marker).expect("remove the marker");
    start("third.log");
    assert!(store.is_dir() && marker.is_file());

    // A store that existed before the option (created by the plugin) gets its marker too.
    std::fs::remove_file(&marker).expect("remove the marker");
    let log = start("fourth.log");
    let said = std::fs::read_to_string(&marker).expect("the marker was written");
    assert!(said.contains("found the store"), "{said}\n{log}");
}

/// The runtime directory and socket with the shipped units' modes (the socket unit's
/// `DirectoryMode=` and `SocketMode=`, the service's `RuntimeDirectoryMode=`): a user named in
/// BLOCKIPAM_AGENT_ALLOWED_UIDS is served through the socket-activated agent, another is refused by
/// the peer-credential check; with no allowed uid, that user is refused too.
#[test]
fn the_units_runtime_directory_lets_an_allowed_uid_in_and_the_peer_check_keeps_others_out() {
    const NOBODY: u32 = 65534;
    let socket_unit = unit_text("blockipam-agent.socket");
    let service_unit = unit_text("blockipam-agent.service");
    let directory_mode = octal_mode(&socket_unit, "DirectoryMode");
    let runtime_mode = octal_mode(&service_unit, "RuntimeDirectoryMode");
    assert_eq!(
        directory_mode, runtime_mode,
        "the socket unit and the service would reset /run/blockipam to different modes"
    );
    let socket_mode = octal_mode(&socket_unit, "SocketMode");
    for (allowed, expect_served) in [(Some(NOBODY), true), (None, false)] {
        let top = tempfile::tempdir().expect("temp dir");
        std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755))
            .expect("open the temporary directory's parent");
        let run = top.path().join("blockipam");
        std::fs::create_dir(&run).expect("mkdir");
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(runtime_mode))
            .expect("chmod the runtime directory");
        let socket = run.join("agent.sock");
        let store = top.path().join("store.sled");
        let mut command = Command::new(SOCKET_ACTIVATE);
        command.env_clear().arg("-l").arg(&socket);
        if let Some(uid) = allowed {
            command.args(["-E", &format!("BLOCKIPAM_AGENT_ALLOWED_UIDS={uid}")]);
        }
        command
            .args([AGENT, "--socket"])
            .arg(&socket)
            .arg("--datastore-path")
            .arg(&store)
            .arg("--create-if-missing");
        let mut activator = Logged::spawn(command, &top.path().join("agent.log"));
        common::wait_for_path(&socket, HANG_GUARD);
        // What systemd does with SocketMode= once it has bound the socket.
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(socket_mode))
            .expect("chmod the socket");
        let outcome = common::run_child_as(NOBODY, &socket);
        if expect_served {
            assert_eq!(outcome, "ok", "allowed uid {NOBODY}:\n{}", activator.log());
        } else {
            assert!(
                outcome.contains(&format!("uid {NOBODY} is not allowed")),
                "uid {NOBODY} with no allowed uid: {outcome}\n{}",
                activator.log()
            );
            activator.wait_for_log("refused a connection");
        }
        activator.terminate();
        assert!(activator.wait().success(), "{}", activator.log());
    }
}

/// Under systemd, stderr is the journal, not a terminal: no colour escapes in the log.
#[test]
fn the_log_has_no_colour_escapes_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let variables: Vec<(&str, String)> = vec![
        ("BLOCKIPAM_AGENT_SOCKET", socket.display().to_string()),
        (
            "DATASTORE_PATH",
            dir.path().join("store.sled").display().to_string(),
        ),
        ("BLOCKIPAM_AGENT_CREATE_IF_MISSING", "true".into()),
        ("BLOCKIPAM_AGENT_LOG", "debug".into()),
    ];
    let mut agent = Logged::spawn(agent_command(&variables, &[]), &dir.path().join("log"));
    agent.wait_for_log("blockipam-agent serving");
    agent.terminate();
    assert!(agent.wait().success(), "{}", agent.log());
    let log = agent.log();
    assert!(
        log.contains("INFO") && log.contains("blockipam-agent stopped"),
        "{log}"
    );
    assert!(!log.contains("\x1b["), "colour escapes in the log:\n{log}");
}
