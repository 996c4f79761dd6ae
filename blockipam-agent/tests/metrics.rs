//! The agent's metrics endpoint as a real process: pool, allocation and block gauges after real
//! plugin calls through the agent, the agent's own counters, Debian's `promtool check metrics` on
//! the scraped text, content negotiation, the gauges' cache, a damaged block, off by default, bad
//! addresses.

mod common;

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backend_agent::{AgentConfig, AgentStore};
use ipam_core::allocator::{AssignIpsRequest, PoolSpec};
use ipam_core::{Ipam, KvStore};
use serde_json::{json, Value};

const AGENT: &str = env!("CARGO_BIN_EXE_blockipam-agent");
/// Longest a plugin call may take before the test calls it a hang.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// A running `blockipam-agent` on a sled store in its own temporary directory; killed if still
/// running when dropped.
struct Agent {
    child: Child,
    socket: PathBuf,
    store: PathBuf,
    log: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
}

impl Agent {
    /// Starts an agent with `extra` flags and waits until it serves its socket.
    fn start(extra: &[&str]) -> Agent {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("run/agent.sock");
        let store = dir.path().join("store.sled");
        let mut child = Command::new(AGENT)
            .env_clear()
            .env("BLOCKIPAM_AGENT_LOG", "info")
            .arg("--socket")
            .arg(&socket)
            .args(["--datastore-type", "sled", "--datastore-path"])
            .arg(&store)
            .arg("--create-if-missing")
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start blockipam-agent");
        let log = capture_stderr(&mut child);
        let mut agent = Agent {
            child,
            socket,
            store,
            log,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let runtime = runtime();
        loop {
            if let Some(status) = agent.child.try_wait().expect("poll the agent") {
                panic!(
                    "the agent exited ({status}) before serving: {}",
                    agent.log()
                );
            }
            let connected = runtime.block_on(AgentStore::connect(
                AgentConfig::new(&agent.socket)
                    .with_timeouts(Duration::from_secs(2), Duration::from_secs(10)),
            ));
            if connected.is_ok() {
                return agent;
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not serve within 30 s: {connected:?}"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    /// The metrics address the agent logged (it binds `:0` in these tests).
    fn metrics_address(&self) -> SocketAddr {
        let log = self.log();
        let (_, rest) = log
            .split_once("metrics endpoint listening on http://")
            .unwrap_or_else(|| panic!("the agent did not log its metrics address:\n{log}"));
        let (address, _) = rest
            .split_once("/metrics")
            .expect("the logged URL ends in /metrics");
        address.parse().expect("a socket address")
    }

    /// The netconf of a plugin call for `node` through this agent.
    fn netconf(&self, node: &str) -> Value {
        json!({
            "cniVersion": "1.0.0",
            "name": "metricsnet",
            "ipam": {
                "type": "blockipam",
                "nodename": node,
                "datastore_type": "sled",
                "datastore_path": self.store,
                "agent_socket": self.socket,
                "ipam_lock_file": self.store.with_file_name(format!("lock-{node}")),
                "timeout_seconds": 30,
                "pools": [{"cidr": "10.77.0.0/16", "block_size": 26, "name": "agent-pool"}]
            }
        })
    }

    /// One real plugin ADD through this agent; returns the address.
    fn add(&self, node: &str, container: &str) -> String {
        let run = common::run_plugin("ADD", container, &self.netconf(node), HANG_GUARD);
        let stdout = run.stdout;
        assert_eq!(
            run.status, 0,
            "ADD {container} on {node}: {stdout}\n{}",
            run.stderr
        );
        let result: Value = serde_json::from_str(&stdout).expect("a CNI result");
        result["ips"][0]["address"]
            .as_str()
            .unwrap_or_else(|| panic!("no address in {stdout}"))
            .to_owned()
    }

    /// The allocator, reaching the store through this agent.
    async fn ipam(&self) -> Ipam {
        let client: Arc<dyn KvStore> = Arc::new(
            AgentStore::connect(AgentConfig::new(&self.socket))
                .await
                .expect("connect to the agent"),
        );
        Ipam::new(client)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP answer.
#[derive(Debug)]
struct HttpAnswer {
    status: u16,
    content_type: String,
    body: String,
}

/// `GET path` over a plain TCP connection (HTTP/1.1, `Connection: close`).
/// Collects the child's standard error, as it comes, into a shared string.
fn capture_stderr(child: &mut std::process::Child) -> Arc<Mutex<String>> {
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
    log
}

fn http_get(address: SocketAddr, path: &str, accept: Option<&str>) -> HttpAnswer {
    let mut stream =
        TcpStream::connect_timeout(&address, Duration::from_secs(10)).expect("connect to metrics");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    let accept = accept
        .map(|value| format!("Accept: {value}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\n{accept}Connection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut raw = String::new();
    stream.read_to_string(&mut raw).expect("read the answer");
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {head}"));
    let content_type = lines
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        .map(|(_, value)| value.trim().to_owned())
        .unwrap_or_default();
    HttpAnswer {
        status,
        content_type,
        body: body.to_owned(),
    }
}

/// Samples of a text exposition: name → (labels → value).
type Samples = BTreeMap<String, BTreeMap<BTreeMap<String, String>, f64>>;

fn parse_samples(text: &str) -> Samples {
    let mut samples = Samples::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').expect("a sample line");
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let labels = rest
                    .trim_end_matches('}')
                    .split(',')
                    .filter(|pair| !pair.is_empty())
                    .map(|pair| {
                        let (key, value) = pair.split_once('=').expect("label=value");
                        (key.to_owned(), value.trim_matches('"').to_owned())
                    })
                    .collect();
                (name, labels)
            }
        };
        let value: f64 = value
            .parse()
            .unwrap_or_else(|e| panic!("bad value in {line:?}: {e}"));
        samples
            .entry(name.to_owned())
            .or_default()
            .insert(labels, value);
    }
    samples
}

/// The value of one series, failing the test (with the whole text) when it is absent.
fn value(samples: &Samples, name: &str, labels: &[(&str, &str)]) -> f64 {
    let wanted: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    *samples
        .get(name)
        .and_then(|series| series.get(&wanted))
        .unwrap_or_else(|| panic!("no {name}{labels:?} among {samples:#?}"))
}

/// Runs Debian's `promtool` with `args` and `input` on its standard input: its exit status and
/// what it printed.
fn promtool<S: AsRef<std::ffi::OsStr>>(args: &[S], input: &str) -> (ExitStatus, String) {
    let mut child = Command::new("promtool")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("promtool is needed (Debian package prometheus; scripts/setup installs it): {e}")
        });
    child
        .stdin
        .take()
        .expect("promtool stdin")
        .write_all(input.as_bytes())
        .expect("feed promtool");
    let output = child.wait_with_output().expect("promtool output");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status, said)
}

/// Runs `promtool check metrics` on `text`; fails the test on any problem.
fn promtool_check(text: &str) {
    let (status, said) = promtool(&["check", "metrics"], text);
    assert!(
        status.success() && said.trim().is_empty(),
        "promtool check metrics: {status}\n{said}\n--- scraped text ---\n{text}"
    );
}

#[test]
fn scrape_reports_pools_allocations_blocks_and_agent_counters_and_passes_promtool() {
    let agent = Agent::start(&[
        "--metrics-listen",
        "127.0.0.1:0",
        "--metrics-cache-seconds",
        "0",
    ]);
    for (node, container) in [
        ("node-a", "a1"),
        ("node-a", "a2"),
        ("node-a", "a3"),
        ("node-b", "b1"),
        ("node-b", "b2"),
    ] {
        let address = agent.add(node, container);
        assert!(address.starts_with("10.77."), "{address}");
    }
    // A second pool of one block: node-c takes it, node-d borrows an address from it.
    runtime().block_on(async {
        let ipam = agent.ipam().await;
        ipam.create_pool(&PoolSpec {
            cidr: "10.88.0.0/26".parse().expect("cidr"),
            name: Some("tiny".to_owned()),
            block_size: Some(26),
            disabled: false,
        })
        .await
        .expect("create the pool tiny");
        for (ip, handle, host) in [("10.88.0.1", "c1", "node-c"), ("10.88.0.2", "d1", "node-d")] {
            ipam.assign_ips(&AssignIpsRequest {
                ips: vec![ip.parse().expect("ip")],
                handle: handle.to_owned(),
                host: host.to_owned(),
                ..AssignIpsRequest::default()
            })
            .await
            .expect("assign");
        }
    });

    let address = agent.metrics_address();
    let answer = http_get(address, "/metrics", None);
    assert_eq!(answer.status, 200, "{answer:#?}");
    assert_eq!(
        answer.content_type, "text/plain; version=0.0.4; charset=utf-8",
        "{answer:#?}"
    );
    promtool_check(&answer.body);
    let samples = parse_samples(&answer.body);
    let gauge = |name: &str, pool: &str, node: &str| {
        value(&samples, name, &[("ippool", pool), ("node", node)])
    };
    assert_eq!(
        value(&samples, "ipam_ippool_size", &[("ippool", "agent-pool")]),
        65_536.0
    );
    assert_eq!(
        value(&samples, "ipam_ippool_size", &[("ippool", "tiny")]),
        64.0
    );
    assert_eq!(
        gauge("ipam_allocations_in_use", "agent-pool", "node-a"),
        3.0
    );
    assert_eq!(
        gauge("ipam_allocations_in_use", "agent-pool", "node-b"),
        2.0
    );
    assert_eq!(gauge("ipam_blocks", "agent-pool", "node-a"), 1.0);
    assert_eq!(gauge("ipam_blocks", "agent-pool", "node-b"), 1.0);
    assert_eq!(
        gauge("ipam_allocations_borrowed", "agent-pool", "node-a"),
        0.0
    );
    assert_eq!(gauge("ipam_blocks", "tiny", "node-c"), 1.0);
    assert_eq!(gauge("ipam_allocations_in_use", "tiny", "node-c"), 1.0);
    assert_eq!(gauge("ipam_allocations_in_use", "tiny", "node-d"), 1.0);
    assert_eq!(gauge("ipam_allocations_borrowed", "tiny", "node-c"), 0.0);
    assert_eq!(gauge("ipam_allocations_borrowed", "tiny", "node-d"), 1.0);
    // Nodes seen anywhere get an explicit zero in every pool, as Calico's do.
    assert_eq!(gauge("ipam_allocations_in_use", "tiny", "node-a"), 0.0);
    assert_eq!(value(&samples, "blockipam_agent_store_up", &[]), 1.0);
    // Every plugin call and client request above was answered.
    assert_eq!(
        value(&samples, "blockipam_agent_requests_in_flight", &[]),
        0.0
    );
    // No leak was released: Calico's reclamation counter (by pool and node) has no sample yet,
    // as Calico's has none before its first reclamation.
    assert!(
        !samples.contains_key("ipam_allocations_gc_reclamations_total"),
        "{samples:#?}"
    );
    // The agent's own counters saw the plugin calls and the allocator calls above.
    for kind in ["read_many", "commit"] {
        assert!(
            value(
                &samples,
                "blockipam_agent_request_duration_seconds_count",
                &[("kind", kind)]
            ) > 0.0,
            "no {kind} request timed"
        );
        assert!(
            value(
                &samples,
                "blockipam_agent_store_requests_total",
                &[("kind", kind), ("outcome", "ok")]
            ) > 0.0,
            "no {kind} round trip to the store counted"
        );
    }
    // The plugin's reads: each node's first ADD read the store; the later ADDs of node-a (two)
    // and node-b (one) were answered from the agent's read cache.
    let plugin_reads = |answered: &str| {
        value(
            &samples,
            "blockipam_agent_plugin_reads_total",
            &[("answered", answered)],
        )
    };
    assert!(plugin_reads("store") >= 2.0, "{samples:#?}");
    assert!(plugin_reads("cache") >= 3.0, "{samples:#?}");
    // Each plugin call and each test client is one accepted connection.
    assert!(
        value(
            &samples,
            "blockipam_agent_connections_total",
            &[("outcome", "accepted")]
        ) >= 6.0,
        "{samples:#?}"
    );

    // Prometheus asks for OpenMetrics: it gets it, with its end marker.
    let openmetrics = http_get(
        address,
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"),
    );
    assert_eq!(openmetrics.status, 200);
    assert!(
        openmetrics
            .content_type
            .starts_with("application/openmetrics-text; version=1.0.0"),
        "{openmetrics:#?}"
    );
    assert!(openmetrics.body.ends_with("# EOF\n"), "{openmetrics:#?}");
    assert!(
        openmetrics
            .body
            .contains("# TYPE ipam_allocations_gc_reclamations counter\n"),
        "{openmetrics:#?}"
    );

    let elsewhere = http_get(address, "/", None);
    assert_eq!(elsewhere.status, 404, "{elsewhere:#?}");
}

/// One block that cannot be decoded does not take the `ipam_*` gauges away: the scrape counts the
/// rest, counts the damaged block for its owner with none of its addresses, says how many objects
/// it left out, and the agent names the key in its log; once repaired, everything counts again.
#[test]
fn a_block_that_cannot_be_decoded_is_left_out_of_the_gauges_and_named() {
    let agent = Agent::start(&[
        "--metrics-listen",
        "127.0.0.1:0",
        "--metrics-cache-seconds",
        "0",
    ]);
    let first = agent.add("node-a", "a1");
    agent.add("node-a", "a2");
    agent.add("node-a", "a3");
    agent.add("node-b", "b1");
    let (damaged_key, saved) = runtime().block_on(async {
        let ipam = agent.ipam().await;
        let first: std::net::IpAddr = first
            .split_once('/')
            .expect("an address with its prefix")
            .0
            .parse()
            .expect("an address");
        let block = ipam
            .get_assignment(first)
            .await
            .expect("read")
            .expect("assigned")
            .block;
        // node-c borrows an address of node-a's block: the gauges read that block's value.
        ipam.assign_ips(&AssignIpsRequest {
            ips: vec![block.hosts().nth(20).expect("a 21st address")],
            handle: "c1".to_owned(),
            host: "node-c".to_owned(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("borrow");
        let client = AgentStore::connect(AgentConfig::new(&agent.socket))
            .await
            .expect("connect to the agent");
        let listed = client
            .list(&ipam_core::model::keys::host_blocks_dir("node-a"))
            .await
            .expect("list node-a's blocks");
        assert_eq!(listed.len(), 1, "{listed:?}");
        let kv = listed.into_iter().next().expect("node-a's block");
        (kv.key, kv.value)
    });
    let address = agent.metrics_address();
    let scrape = || {
        let answer = http_get(address, "/metrics", None);
        assert_eq!(answer.status, 200, "{answer:#?}");
        promtool_check(&answer.body);
        parse_samples(&answer.body)
    };
    let gauge = |samples: &Samples, name: &str, node: &str| {
        value(samples, name, &[("ippool", "agent-pool"), ("node", node)])
    };
    let intact = scrape();
    assert_eq!(
        value(&intact, "blockipam_agent_ipam_undecodable_objects", &[]),
        0.0
    );
    assert_eq!(gauge(&intact, "ipam_allocations_borrowed", "node-c"), 1.0);

    let put = |bytes: Vec<u8>| {
        runtime().block_on(async {
            AgentStore::connect(AgentConfig::new(&agent.socket))
                .await
                .expect("connect to the agent")
                .put(&damaged_key, bytes)
                .await
                .expect("write the block");
        });
    };
    put(b"garbage{".to_vec());
    let damaged = scrape();
    assert_eq!(value(&damaged, "blockipam_agent_store_up", &[]), 1.0);
    assert_eq!(
        value(&damaged, "blockipam_agent_ipam_undecodable_objects", &[]),
        1.0
    );
    assert_eq!(gauge(&damaged, "ipam_blocks", "node-a"), 1.0);
    assert_eq!(gauge(&damaged, "ipam_blocks", "node-b"), 1.0);
    assert_eq!(gauge(&damaged, "ipam_allocations_in_use", "node-a"), 0.0);
    assert_eq!(gauge(&damaged, "ipam_allocations_in_use", "node-b"), 1.0);
    assert!(
        !damaged
            .get("ipam_allocations_borrowed")
            .is_some_and(|series| series
                .keys()
                .any(|labels| labels.values().any(|v| v == "node-c"))),
        "node-c's address lies in the damaged block: {damaged:#?}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !agent.log().contains(&damaged_key) {
        assert!(
            Instant::now() < deadline,
            "the agent did not name {damaged_key}:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    let again = scrape();
    assert_eq!(
        value(&again, "blockipam_agent_ipam_undecodable_objects", &[]),
        1.0
    );
    assert_eq!(
        agent
            .log()
            .matches("metrics: an object cannot be decoded")
            .count(),
        1,
        "each set of damaged objects is logged once:\n{}",
        agent.log()
    );

    put(saved);
    let repaired = scrape();
    assert_eq!(
        value(&repaired, "blockipam_agent_ipam_undecodable_objects", &[]),
        0.0
    );
    assert_eq!(gauge(&repaired, "ipam_allocations_in_use", "node-a"), 3.0);
    assert_eq!(gauge(&repaired, "ipam_allocations_borrowed", "node-c"), 1.0);
}

#[test]
fn ipam_gauges_are_reused_within_the_cache_period_while_counters_move() {
    let agent = Agent::start(&[
        "--metrics-listen",
        "127.0.0.1:0",
        "--metrics-cache-seconds",
        "3600",
    ]);
    agent.add("node-a", "first");
    let address = agent.metrics_address();
    let first = parse_samples(&http_get(address, "/metrics", None).body);
    let in_use = |samples: &Samples| {
        value(
            samples,
            "ipam_allocations_in_use",
            &[("ippool", "agent-pool"), ("node", "node-a")],
        )
    };
    let commits = |samples: &Samples| {
        value(
            samples,
            "blockipam_agent_request_duration_seconds_count",
            &[("kind", "commit")],
        )
    };
    assert_eq!(in_use(&first), 1.0);
    agent.add("node-a", "second");
    let second = parse_samples(&http_get(address, "/metrics", None).body);
    assert_eq!(
        in_use(&second),
        1.0,
        "the gauges were computed again within --metrics-cache-seconds"
    );
    assert!(
        commits(&second) > commits(&first),
        "the request counters must stay live while the gauges are cached"
    );
    let from_cache = |samples: &Samples| {
        value(
            samples,
            "blockipam_agent_plugin_reads_total",
            &[("answered", "cache")],
        )
    };
    assert_eq!(
        from_cache(&second),
        from_cache(&first) + 1.0,
        "the node's second ADD is answered from the agent's read cache"
    );
}

/// Listening TCP sockets held by process `pid` (from its descriptors and /proc/net/tcp{,6}).
fn listening_tcp_sockets(pid: u32) -> usize {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read the agent's descriptors")
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_owned(),
            )
        })
        .collect();
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .map(|line| {
                    line.split_whitespace()
                        .map(str::to_owned)
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        })
        // Columns: sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...; 0A is LISTEN.
        .filter(|columns| columns.len() > 9 && columns[3] == "0A" && inodes.contains(&columns[9]))
        .count()
}

#[test]
fn metrics_are_off_by_default_and_a_bad_address_stops_the_agent_before_the_store() {
    let off = Agent::start(&[]);
    assert_eq!(
        listening_tcp_sockets(off.child.id()),
        0,
        "an agent without --metrics-listen listens on TCP"
    );
    assert!(off.log().contains("metrics endpoint off"), "{}", off.log());
    let on = Agent::start(&["--metrics-listen", "127.0.0.1:0"]);
    assert_eq!(
        listening_tcp_sockets(on.child.id()),
        1,
        "the check above cannot see the metrics listener"
    );

    // An address already in use: a clear error, exit 1, neither socket nor store made.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("take a port");
    let taken_address = taken.local_addr().expect("its address").to_string();
    let dir = tempfile::tempdir().expect("temp dir");
    let run = |address: &str| {
        Command::new(AGENT)
            .env_clear()
            .arg("--socket")
            .arg(dir.path().join("run/agent.sock"))
            .arg("--datastore-path")
            .arg(dir.path().join("store.sled"))
            .arg("--create-if-missing")
            .args(["--metrics-listen", address])
            .output()
            .expect("run the agent")
    };
    let in_use = run(&taken_address);
    let said = String::from_utf8_lossy(&in_use.stderr);
    assert_eq!(in_use.status.code(), Some(1), "{said}");
    assert!(
        said.contains(&format!("cannot listen for metrics on {taken_address}")),
        "{said}"
    );
    assert!(
        !dir.path().join("store.sled").exists(),
        "the store was made"
    );
    assert!(
        !dir.path().join("run").exists(),
        "the socket directory was made"
    );

    // Not an IP:PORT: refused by the flag parser, naming the flag.
    let nonsense = run("localhost-9091");
    let said = String::from_utf8_lossy(&nonsense.stderr);
    assert_eq!(nonsense.status.code(), Some(2), "{said}");
    assert!(said.contains("--metrics-listen"), "{said}");
    drop(taken);
}

/// Polls `GET path` until it answers `status`, for at most `limit`; the last answer.
fn wait_for_status(address: SocketAddr, path: &str, status: u16, limit: Duration) -> HttpAnswer {
    let deadline = Instant::now() + limit;
    loop {
        let answer = http_get(address, path, None);
        if answer.status == status || Instant::now() >= deadline {
            return answer;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `/healthz` answers while the agent runs; `/readyz` is `503` with its one-line reason while the
/// agent's etcd cannot be reached (the agent serves its socket and waits), and `200` once etcd
/// answers; both beside `/metrics` on the `--metrics-listen` listener. The node-registered gauge
/// follows: 0 while etcd is away, 1 once the agent has registered, 0 again when its lease is lost.
#[test]
fn readyz_waits_for_an_unreachable_etcd_while_healthz_answers() {
    let mut etcd = test_kit::etcd::EtcdServer::start().expect("an etcd server");
    let endpoint = etcd.endpoint();
    // etcd down at the agent's start: the endpoint is known, nothing answers there.
    etcd.stop();
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let mut child = Command::new(AGENT)
        .env_clear()
        .env("BLOCKIPAM_AGENT_LOG", "info")
        .arg("--socket")
        .arg(&socket)
        .args(["--etcd-endpoints", &endpoint, "--node", "probed-node"])
        .args(["--etcd-prefix", &test_kit::etcd::unique_prefix()])
        .args([
            "--metrics-listen",
            "127.0.0.1:0",
            "--liveness-ttl-seconds",
            "2",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start blockipam-agent");
    let log = capture_stderr(&mut child);
    let agent = Agent {
        child,
        socket: socket.clone(),
        store: dir.path().join("unused"),
        log,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !agent.log().contains("metrics endpoint listening on") {
        assert!(
            Instant::now() < deadline,
            "no metrics address logged: {}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    let address = agent.metrics_address();

    let live = http_get(address, "/healthz", None);
    assert_eq!((live.status, live.body.as_str()), (200, "ok\n"), "{live:?}");
    // Not ready, and says why in one line, until etcd answers; the socket is served meanwhile.
    let unready = wait_for_status(address, "/readyz", 503, Duration::from_secs(30));
    assert_eq!(unready.status, 503, "{unready:?}");
    assert!(unready.body.starts_with("not ready: "), "{unready:?}");
    assert_eq!(unready.body.trim_end().lines().count(), 1, "{unready:?}");
    assert!(
        unready.content_type.starts_with("text/plain"),
        "{unready:?}"
    );
    let live = http_get(address, "/healthz", None);
    assert_eq!(live.status, 200, "{live:?}");
    let registered = |value: &str| {
        let line = format!("\nblockipam_agent_node_registered {value}\n");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let metrics = http_get(address, "/metrics", None).body;
            if metrics.contains(&line) || Instant::now() >= deadline {
                return metrics;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let waiting = registered("0");
    assert!(
        waiting.contains("\nblockipam_agent_node_registered 0\n"),
        "the metrics beside the probes, the node not registered while etcd is away:\n{waiting}"
    );

    etcd.restart().expect("start etcd again");
    let ready = wait_for_status(address, "/readyz", 200, Duration::from_secs(60));
    assert_eq!(
        (ready.status, ready.body.as_str()),
        (200, "ok\n"),
        "{ready:?}\n{}",
        agent.log()
    );
    assert_eq!(http_get(address, "/nowhere", None).status, 404);
    let after_ready = registered("1");
    assert!(
        after_ready.contains("\nblockipam_agent_node_registered 1\n"),
        "registered once etcd answers:\n{after_ready}\n{}",
        agent.log()
    );
    // etcd goes away again: once the 2 s lease has run out, the node is not registered.
    etcd.stop();
    let lost = registered("0");
    assert!(
        lost.contains("\nblockipam_agent_node_registered 0\n"),
        "still registered with its lease lost:\n{lost}\n{}",
        agent.log()
    );
    drop(agent);
}

/// On an embedded store `/readyz` is `200` once the agent serves its socket, and the probes'
/// answers are the plain `ok` a kubelet's httpGet probe accepts.
#[test]
fn readyz_and_healthz_answer_ok_once_an_embedded_store_agent_serves() {
    let agent = Agent::start(&["--metrics-listen", "127.0.0.1:0"]);
    let address = agent.metrics_address();
    for path in ["/healthz", "/readyz"] {
        let answer = wait_for_status(address, path, 200, Duration::from_secs(10));
        assert_eq!(
            (answer.status, answer.body.as_str()),
            (200, "ok\n"),
            "{path}: {answer:?}"
        );
    }
}

/// The shipped alerting rules (`deploy/prometheus/blockipam-alerts.yaml`): `promtool check rules`
/// accepts them, their own unit tests pass under `promtool test rules`, and every metric their
/// expressions name is one a real agent exposes, with the type the expression assumes.
#[test]
fn the_shipped_alert_rules_pass_promtool_and_name_only_metrics_the_agent_exposes() {
    let rules_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus");
    let rules = rules_dir.join("blockipam-alerts.yaml");
    for args in [
        ["check".into(), "rules".into(), rules.clone()],
        [
            "test".into(),
            "rules".into(),
            rules_dir.join("blockipam-alerts.test.yaml"),
        ],
    ] {
        let (status, said) = promtool(&args, "");
        assert!(status.success(), "promtool {args:?}: {status}\n{said}");
    }

    let agent = Agent::start(&["--metrics-listen", "127.0.0.1:0"]);
    agent.add("node-a", "a1");
    let scraped = http_get(agent.metrics_address(), "/metrics", None);
    assert_eq!(scraped.status, 200, "{scraped:#?}");
    let types: BTreeMap<&str, &str> = scraped
        .body
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE ")?.split_once(' '))
        .collect();
    let text = std::fs::read_to_string(&rules).expect("read the rules");
    let expressions: Vec<&str> = text
        .lines()
        .filter_map(|line| line.trim().strip_prefix("expr:"))
        .collect();
    assert_eq!(expressions.len(), 9, "{text}");
    let mut named = 0;
    for expression in expressions {
        let words = expression.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
        for metric in words.filter(|w| w.starts_with("ipam_") || w.starts_with("blockipam_")) {
            named += 1;
            // What the function applied to it needs: a counter for increase(), a gauge otherwise.
            let wanted = if expression.contains(&format!("increase({metric}[")) {
                "counter"
            } else {
                "gauge"
            };
            assert_eq!(
                types.get(metric).copied(),
                Some(wanted),
                "the rule {expression:?} names {metric}, which the agent does not expose as a \
                 {wanted}:\n{}",
                scraped.body
            );
        }
    }
    assert_eq!(named, 12, "metrics named by the rules");
}
