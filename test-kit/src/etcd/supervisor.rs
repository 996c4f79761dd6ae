//! Throwaway `etcd` processes on loopback: one member ([`EtcdServer`]) or a cluster ([`EtcdCluster`]).
//!
//! Every `etcd` runs under a small `sh` watchdog whose standard input is a pipe from the test
//! process: when the test process ends for any reason (even `SIGKILL`, even with statics never
//! dropped) the pipe closes, and the watchdog kills `etcd` and removes its data directory.
//! All calls here block (they start processes and poll them); they are meant for tests and
//! benchmarks, and are fine inside a multi-threaded Tokio runtime.

use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use backend_etcd::EtcdConfig;

use super::pki::TestPki;

/// Environment variable naming the `etcd` binary to run instead of the one on `PATH`.
pub const ETCD_BIN_ENV: &str = "BLOCKIPAM_ETCD_BIN";

/// How long a single member may take to become healthy.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a cluster may take until every member is healthy.
pub const CLUSTER_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How many times a start is retried with new ports when a port was taken meanwhile.
const START_TRIES: usize = 3;

/// The watchdog: starts etcd in the background, prints its pid, then waits on stdin.
/// A `stop` line kills etcd and keeps the data; end-of-file (the owner is gone) kills etcd and
/// removes the whole directory. It ignores INT/TERM/HUP, so that a signal sent to the whole
/// process group (Ctrl-C, `timeout`) kills the test process but not the clean-up.
const WATCHDOG: &str = r#"root=$1; shift
"$@" </dev/null >>"$root/etcd.log" 2>&1 &
etcd=$!
trap '' INT TERM HUP
echo "$etcd"
IFS= read -r command || command=
kill -9 "$etcd" 2>/dev/null
wait "$etcd" 2>/dev/null
if [ "$command" != stop ]; then rm -rf "$root"; fi
"#;

/// TLS settings for a test server's client port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    /// PEM certificate the server presents (must name `127.0.0.1`).
    pub cert_file: PathBuf,
    /// PEM private key of `cert_file`.
    pub key_file: PathBuf,
    /// When set, clients must present a certificate signed by this CA (`--client-cert-auth`).
    pub client_ca_file: Option<PathBuf>,
}

/// Options for [`EtcdServer::start_with`].
#[derive(Debug, Clone, Default)]
pub struct EtcdServerOptions {
    /// Serve clients over TLS.
    pub tls: Option<ServerTls>,
    /// How long to wait for the member to become healthy; [`READY_TIMEOUT`] when `None`.
    pub ready_timeout: Option<Duration>,
}

/// One `etcd` member on loopback ports with its own temporary data directory.
///
/// Dropping it kills the process and removes the directory.
pub struct EtcdServer {
    spec: MemberSpec,
    bin: PathBuf,
    dir: tempfile::TempDir,
    process: Option<Watchdog>,
    ready_timeout: Duration,
}

/// Everything needed to (re)start one member the same way.
#[derive(Debug, Clone)]
struct MemberSpec {
    name: String,
    client_port: u16,
    peer_port: u16,
    metrics_port: u16,
    initial_cluster: String,
    cluster_token: String,
    tls: Option<ServerTls>,
}

struct Watchdog {
    shell: Child,
    stdin: Option<ChildStdin>,
    etcd_pid: u32,
}

/// Why a start failed; a port conflict is worth retrying with other ports.
struct StartError {
    message: String,
    port_conflict: bool,
}

impl From<String> for StartError {
    fn from(message: String) -> Self {
        StartError {
            message,
            port_conflict: false,
        }
    }
}

impl fmt::Debug for EtcdServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdServer")
            .field("name", &self.spec.name)
            .field("endpoint", &self.endpoint())
            .field("dir", &self.dir.path())
            .field("etcd_pid", &self.process.as_ref().map(|p| p.etcd_pid))
            .finish()
    }
}

impl EtcdServer {
    /// Starts a single-member etcd on free loopback ports and waits until it is healthy.
    ///
    /// # Errors
    /// A message when the `etcd` binary is missing (saying how to install it), when it does not
    /// become healthy within [`READY_TIMEOUT`] (with the end of its log), or on I/O errors.
    pub fn start() -> Result<EtcdServer, String> {
        Self::start_with(EtcdServerOptions::default())
    }

    /// As [`start`](Self::start), with TLS or another ready timeout.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_with(options: EtcdServerOptions) -> Result<EtcdServer, String> {
        let bin = find_etcd()?;
        let ready_timeout = options.ready_timeout.unwrap_or(READY_TIMEOUT);
        let mut last = String::new();
        for _ in 0..START_TRIES {
            let [client_port, peer_port, metrics_port] = free_ports::<3>()?;
            let name = "blockipam-test".to_owned();
            let spec = MemberSpec {
                initial_cluster: format!("{name}=http://127.0.0.1:{peer_port}"),
                name,
                client_port,
                peer_port,
                metrics_port,
                cluster_token: random_token(),
                tls: options.tls.clone(),
            };
            let mut server = EtcdServer::create(spec, bin.clone(), ready_timeout)?;
            let started = server
                .spawn()
                .and_then(|()| server.wait_ready(Instant::now() + ready_timeout));
            match started {
                Ok(()) => return Ok(server),
                Err(e) if e.port_conflict => last = e.message,
                Err(e) => return Err(e.message),
            }
        }
        Err(last)
    }

    /// A server shared by every test of this test binary: started on first use, never stopped
    /// explicitly (its watchdog kills it and removes its data when the process exits).
    ///
    /// Give each user its own key prefix (see [`EtcdFactory`] and [`unique_prefix`]); do not
    /// stop or restart it.
    ///
    /// # Panics
    /// When the server cannot be started; the message says why (for example that `etcd` is not
    /// installed). Every later call panics with the same message.
    pub fn shared() -> &'static EtcdServer {
        match Self::try_shared() {
            Ok(server) => server,
            Err(message) => panic!("cannot start the shared etcd test server: {message}"),
        }
    }

    /// As [`shared`](Self::shared), returning the start error instead of panicking.
    ///
    /// # Errors
    /// The message of the (single) failed start attempt.
    pub fn try_shared() -> Result<&'static EtcdServer, String> {
        static SHARED: OnceLock<Result<EtcdServer, String>> = OnceLock::new();
        SHARED
            .get_or_init(EtcdServer::start)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn create(spec: MemberSpec, bin: PathBuf, ready_timeout: Duration) -> Result<Self, String> {
        let dir = tempfile::Builder::new()
            .prefix("blockipam-etcd-")
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory for etcd: {e}"))?;
        Ok(EtcdServer {
            spec,
            bin,
            dir,
            process: None,
            ready_timeout,
        })
    }

    /// The client URL, for example `http://127.0.0.1:40123` (`https://` with TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.spec.tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://127.0.0.1:{}", self.spec.client_port)
    }

    /// A store configuration for this server (endpoint only) with the given key prefix.
    pub fn config(&self, prefix: &str) -> EtcdConfig {
        EtcdConfig::new([self.endpoint()]).with_prefix(prefix)
    }

    /// The member name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The data directory (kept across [`stop`](Self::stop) and [`restart`](Self::restart)).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The file etcd logs to.
    pub fn log_file(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// True while the etcd process is alive.
    pub fn is_running(&self) -> bool {
        self.process
            .as_ref()
            .is_some_and(|p| process_alive(p.etcd_pid))
    }

    /// Whether this member is currently the raft leader (from its metrics).
    ///
    /// # Errors
    /// A message when the metrics cannot be read (for example, the member is stopped).
    pub fn is_leader(&self) -> Result<bool, String> {
        let (_, body) = http_get(self.spec.metrics_port, "/metrics")?;
        Ok(body
            .lines()
            .any(|line| line.trim() == "etcd_server_is_leader 1"))
    }

    /// The sum of etcd's own `grpc_server_handled_total` counter over every gRPC method
    /// (Range, Txn, Put, ...): how many requests clients have made to this member so far.
    ///
    /// # Errors
    /// A message when the metrics cannot be read or hold no such counter.
    pub fn grpc_requests_handled(&self) -> Result<std::collections::BTreeMap<String, u64>, String> {
        let (_, body) = http_get(self.spec.metrics_port, "/metrics")?;
        let mut by_method: std::collections::BTreeMap<String, u64> =
            std::collections::BTreeMap::new();
        for line in body.lines() {
            let Some(rest) = line.strip_prefix("grpc_server_handled_total{") else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            let method = labels
                .split(',')
                .find_map(|l| l.strip_prefix("grpc_method=\""))
                .map(|m| m.trim_end_matches('"').to_owned())
                .unwrap_or_default();
            let count = value
                .trim()
                .parse::<f64>()
                .map_err(|e| format!("bad counter line {line:?}: {e}"))?;
            *by_method.entry(method).or_insert(0) += count as u64;
        }
        if by_method.is_empty() {
            return Err("etcd's metrics hold no grpc_server_handled_total".into());
        }
        Ok(by_method)
    }

    /// The process id of the running etcd, if any (to send it signals such as `SIGSTOP`).
    pub fn pid(&self) -> Option<u32> {
        self.process
            .as_ref()
            .map(|p| p.etcd_pid)
            .filter(|pid| process_alive(*pid))
    }

    /// Runs `etcdctl` (API v3) against this member with `args` and returns its standard output.
    /// `pki` supplies `--cacert` for a TLS member, and the client certificate, which a member
    /// started with `--client-cert-auth` requires.
    ///
    /// # Errors
    /// A message when `etcdctl` is missing (saying how to install it) or fails (with its output).
    pub fn etcdctl(&self, pki: Option<&TestPki>, args: &[&str]) -> Result<String, String> {
        let mut command = Command::new(find_etcdctl()?);
        command
            .env("ETCDCTL_API", "3")
            .arg("--endpoints")
            .arg(self.endpoint())
            .arg("--dial-timeout")
            .arg("5s")
            .arg("--command-timeout")
            .arg("10s");
        if let Some(pki) = pki {
            command.arg("--cacert").arg(pki.ca_cert());
            if self
                .spec
                .tls
                .as_ref()
                .is_some_and(|t| t.client_ca_file.is_some())
            {
                command
                    .arg("--cert")
                    .arg(pki.client_cert())
                    .arg("--key")
                    .arg(pki.client_key());
            }
        }
        let output = command
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run etcdctl: {e}"))?;
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(format!(
                "etcdctl {} failed: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ))
        }
    }

    /// Turns authentication on: creates `root` (with `root_password`) and `user` (with
    /// `password`), whose role may read and write every key under `prefix`, then enables auth.
    /// From then on every client must log in. `pki` as for [`etcdctl`](Self::etcdctl).
    ///
    /// # Errors
    /// As [`etcdctl`](Self::etcdctl).
    pub fn enable_auth(
        &self,
        pki: Option<&TestPki>,
        root_password: &str,
        user: &str,
        password: &str,
        prefix: &str,
    ) -> Result<(), String> {
        let role = format!("{user}-role");
        let root_password = format!("--new-user-password={root_password}");
        let password = format!("--new-user-password={password}");
        self.etcdctl(pki, &["user", "add", "root", &root_password])?;
        self.etcdctl(pki, &["user", "add", user, &password])?;
        self.etcdctl(pki, &["role", "add", &role])?;
        self.etcdctl(
            pki,
            &[
                "role",
                "grant-permission",
                &role,
                "--prefix=true",
                "readwrite",
                prefix,
            ],
        )?;
        self.etcdctl(pki, &["user", "grant-role", user, &role])?;
        self.etcdctl(pki, &["auth", "enable"])?;
        Ok(())
    }

    /// Kills etcd (`SIGKILL`, like a crash) and waits until it is gone; the data directory stays.
    /// Does nothing when it is not running.
    pub fn stop(&mut self) {
        self.kill(true);
    }

    /// Starts etcd again on the same ports with the same data directory and waits until it is
    /// healthy (in a cluster: until it has a leader again). Stops it first when running.
    ///
    /// # Errors
    /// A message when it does not become healthy in time (with the end of its log).
    pub fn restart(&mut self) -> Result<(), String> {
        self.kill(true);
        self.spawn()
            .and_then(|()| self.wait_ready(Instant::now() + self.ready_timeout))
            .map_err(|e| e.message)
    }

    fn args(&self) -> Vec<String> {
        let spec = &self.spec;
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", spec.peer_port);
        let mut args = vec![
            "--name".to_owned(),
            spec.name.clone(),
            "--data-dir".to_owned(),
            self.data_dir().display().to_string(),
            "--listen-client-urls".to_owned(),
            client_url.clone(),
            "--advertise-client-urls".to_owned(),
            client_url,
            "--listen-peer-urls".to_owned(),
            peer_url.clone(),
            "--initial-advertise-peer-urls".to_owned(),
            peer_url,
            "--listen-metrics-urls".to_owned(),
            format!("http://127.0.0.1:{}", spec.metrics_port),
            "--initial-cluster".to_owned(),
            spec.initial_cluster.clone(),
            "--initial-cluster-token".to_owned(),
            spec.cluster_token.clone(),
            "--initial-cluster-state".to_owned(),
            "new".to_owned(),
            "--logger".to_owned(),
            "zap".to_owned(),
            "--log-outputs".to_owned(),
            "stderr".to_owned(),
        ];
        if let Some(tls) = &spec.tls {
            args.push("--cert-file".to_owned());
            args.push(tls.cert_file.display().to_string());
            args.push("--key-file".to_owned());
            args.push(tls.key_file.display().to_string());
            if let Some(ca) = &tls.client_ca_file {
                args.push("--client-cert-auth".to_owned());
                args.push("--trusted-ca-file".to_owned());
                args.push(ca.display().to_string());
            }
        }
        args
    }

    /// Starts the watchdog (which starts etcd) and records etcd's pid.
    fn spawn(&mut self) -> Result<(), StartError> {
        let log_path = self.log_file();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
        let mut shell = Command::new("sh")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("blockipam-etcd-watchdog")
            .arg(self.dir.path())
            .arg(&self.bin)
            .args(self.args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| format!("cannot run sh to start etcd: {e}"))?;
        let stdin = shell.stdin.take();
        let mut line = String::new();
        let read = match shell.stdout.take() {
            Some(stdout) => BufReader::new(stdout).read_line(&mut line),
            None => Ok(0),
        };
        let pid = match (read, line.trim().parse::<u32>()) {
            (Ok(_), Ok(pid)) => pid,
            _ => {
                drop(stdin);
                let _ = shell.kill();
                let _ = shell.wait();
                return Err(
                    format!("the etcd watchdog did not report a pid (got {line:?})").into(),
                );
            }
        };
        self.process = Some(Watchdog {
            shell,
            stdin,
            etcd_pid: pid,
        });
        Ok(())
    }

    /// Polls `/health` until it says true, etcd exits, or `deadline` passes.
    fn wait_ready(&self, deadline: Instant) -> Result<(), StartError> {
        let pid = self.process.as_ref().map(|p| p.etcd_pid).unwrap_or(0);
        loop {
            if !process_alive(pid) {
                let log = log_tail(&self.log_file());
                return Err(StartError {
                    port_conflict: log.contains("address already in use"),
                    message: format!(
                        "etcd member {} exited during start-up; end of {}:\n{log}",
                        self.spec.name,
                        self.log_file().display()
                    ),
                });
            }
            if let Ok((200, body)) = http_get(self.spec.metrics_port, "/health") {
                if body.contains("\"health\":\"true\"") {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "etcd member {} was not healthy in time; end of {}:\n{}",
                    self.spec.name,
                    self.log_file().display(),
                    log_tail(&self.log_file())
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills etcd through its watchdog; `keep_data` says whether the watchdog keeps the data
    /// directory.
    fn kill(&mut self, keep_data: bool) {
        let Some(mut watchdog) = self.process.take() else {
            return;
        };
        if let Some(mut stdin) = watchdog.stdin.take() {
            if keep_data {
                let _ = stdin.write_all(b"stop\n");
            }
            // Dropping the pipe also tells the watchdog to act.
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match watchdog.shell.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(None) => {
                    // The watchdog is stuck: kill etcd directly, then the watchdog.
                    let _ = Command::new("kill")
                        .args(["-9", &watchdog.etcd_pid.to_string()])
                        .status();
                    let _ = watchdog.shell.kill();
                    let _ = watchdog.shell.wait();
                    break;
                }
            }
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill(false);
    }
}

/// A loopback etcd cluster of several members.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<EtcdServer>,
}

impl EtcdCluster {
    /// Starts `size` members that form one new cluster, and waits until every one is healthy
    /// (within [`CLUSTER_READY_TIMEOUT`]).
    ///
    /// # Errors
    /// As [`EtcdServer::start`].
    pub fn start(size: usize) -> Result<EtcdCluster, String> {
        if size == 0 {
            return Err("a cluster needs at least one member".to_owned());
        }
        let bin = find_etcd()?;
        let mut last = String::new();
        for _ in 0..START_TRIES {
            // Every member's ports from one search: found member by member, two members could
            // be given the same port (etcd refuses a cluster with a duplicate URL).
            let ports = member_ports(size)?;
            let token = random_token();
            let initial_cluster = ports
                .iter()
                .enumerate()
                .map(|(i, [_, peer, _])| format!("member{i}=http://127.0.0.1:{peer}"))
                .collect::<Vec<_>>()
                .join(",");
            let mut members = Vec::with_capacity(size);
            for (i, [client_port, peer_port, metrics_port]) in ports.into_iter().enumerate() {
                let spec = MemberSpec {
                    name: format!("member{i}"),
                    client_port,
                    peer_port,
                    metrics_port,
                    initial_cluster: initial_cluster.clone(),
                    cluster_token: token.clone(),
                    tls: None,
                };
                members.push(EtcdServer::create(spec, bin.clone(), READY_TIMEOUT)?);
            }
            let deadline = Instant::now() + CLUSTER_READY_TIMEOUT;
            let started = members
                .iter_mut()
                .try_for_each(EtcdServer::spawn)
                .and_then(|()| members.iter().try_for_each(|m| m.wait_ready(deadline)));
            match started {
                Ok(()) => return Ok(EtcdCluster { members }),
                Err(e) if e.port_conflict => last = e.message,
                Err(e) => return Err(e.message),
            }
        }
        Err(last)
    }

    /// Every member's client URL, in member order.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(EtcdServer::endpoint).collect()
    }

    /// The members.
    pub fn members(&self) -> &[EtcdServer] {
        &self.members
    }

    /// One member, to stop or restart it.
    ///
    /// # Panics
    /// When `index` is out of range.
    pub fn member_mut(&mut self, index: usize) -> &mut EtcdServer {
        &mut self.members[index]
    }

    /// The index of the running member that currently reports itself leader, if any.
    pub fn leader(&self) -> Option<usize> {
        self.members
            .iter()
            .position(|m| m.is_running() && m.is_leader().unwrap_or(false))
    }

    /// Waits until some running member is leader.
    ///
    /// # Errors
    /// A message when no leader appeared within `timeout`.
    pub fn wait_for_leader(&self, timeout: Duration) -> Result<usize, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(leader) = self.leader() {
                return Ok(leader);
            }
            if Instant::now() >= deadline {
                return Err(format!("no etcd member became leader within {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The `etcd` binary: `$BLOCKIPAM_ETCD_BIN`, else the first `etcd` on `PATH`.
fn find_etcd() -> Result<PathBuf, String> {
    if let Some(bin) = std::env::var_os(ETCD_BIN_ENV) {
        let bin = PathBuf::from(bin);
        return if bin.is_file() {
            Ok(bin)
        } else {
            Err(format!(
                "{ETCD_BIN_ENV} names {}, which is not a file",
                bin.display()
            ))
        };
    }
    crate::find_on_path("etcd").ok_or_else(|| {
        format!(
            "the `etcd` binary was not found on PATH: install it with \
                 `apt-get install etcd-server` (Debian/Ubuntu), or set {ETCD_BIN_ENV} to its path"
        )
    })
}

/// The `etcdctl` binary: the one beside the `etcd` binary in use, else the first on `PATH`.
fn find_etcdctl() -> Result<PathBuf, String> {
    let beside = find_etcd()
        .ok()
        .and_then(|etcd| etcd.parent().map(|dir| dir.join("etcdctl")))
        .filter(|candidate| candidate.is_file());
    beside
        .or_else(|| {
            std::env::var_os("PATH")
                .iter()
                .flat_map(std::env::split_paths)
                .map(|dir| dir.join("etcdctl"))
                .find(|candidate| candidate.is_file())
        })
        .ok_or_else(|| {
            "the `etcdctl` binary was not found on PATH: install it with \
             `apt-get install etcd-client` (Debian/Ubuntu)"
                .to_owned()
        })
}

/// `N` distinct free loopback ports (never etcd's defaults 2379/2380), found by binding port 0.
fn free_ports<const N: usize>() -> Result<[u16; N], String> {
    let found = free_port_list(N)?;
    let mut ports = [0u16; N];
    ports.copy_from_slice(&found);
    Ok(ports)
}

/// The client, peer and metrics ports of `size` members, all distinct.
fn member_ports(size: usize) -> Result<Vec<[u16; 3]>, String> {
    Ok(free_port_list(3 * size)?
        .chunks_exact(3)
        .map(|member| [member[0], member[1], member[2]])
        .collect())
}

/// `count` distinct free loopback ports (never etcd's defaults 2379/2380), found by binding port
/// 0 with every listener held until all are found: a port is free again once its listener is
/// dropped, so ports found by separate calls may repeat.
fn free_port_list(count: usize) -> Result<Vec<u16>, String> {
    let mut held = Vec::with_capacity(count + 2);
    let mut ports = Vec::with_capacity(count);
    while ports.len() < count {
        let listener = TcpListener::bind("127.0.0.1:0")
            .map_err(|e| format!("cannot bind a loopback port: {e}"))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("cannot read a bound port: {e}"))?
            .port();
        if port != 2379 && port != 2380 {
            ports.push(port);
        }
        held.push(listener);
    }
    Ok(ports)
}

fn random_token() -> String {
    format!("blockipam-test-{:016x}", rand::random::<u64>())
}

/// Whether `pid` is a live (not zombie) process.
fn process_alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// A plain HTTP/1.0 GET on a loopback port: (status code, body).
fn http_get(port: u16, path: &str) -> Result<(u16, String), String> {
    let timeout = Duration::from_secs(1);
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&address, timeout)
        .map_err(|e| format!("cannot connect to 127.0.0.1:{port}: {e}"))?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| e.to_string())?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .map_err(|e| format!("cannot send to 127.0.0.1:{port}: {e}"))?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|e| format!("cannot read from 127.0.0.1:{port}: {e}"))?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("not an HTTP response from 127.0.0.1:{port}"))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// The last lines of a log file, for error messages.
fn log_tail(path: &Path) -> String {
    match fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(15)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_members_of_a_cluster_never_share_a_port() {
        // Ports found member by member repeat about once in a thousand clusters of three.
        for _ in 0..5000 {
            let ports = member_ports(3).expect("free ports");
            let distinct: std::collections::BTreeSet<u16> =
                ports.iter().flatten().copied().collect();
            assert_eq!(distinct.len(), 9, "{ports:?}");
            assert!(
                !distinct.contains(&2379) && !distinct.contains(&2380),
                "{ports:?}"
            );
        }
    }
}
