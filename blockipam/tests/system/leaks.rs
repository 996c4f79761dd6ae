//! Leak collection under containerd's CRI, as a node lives it: the agent releases the address of a container the runtime no longer runs once the grace has passed, never a live pod's, records a live pod's address the store lost for it again, and collects nothing while the runtime cannot be asked.
//!
//! The test starts its own containerd (see `containerd.rs`), a real agent (the binary's `run`,
//! in-process) serving a sled store with leak collection on (grace 3 s,
//! `--cri-socket` at that containerd; a look every 2 s), and pods through the CRI whose addresses the plugin takes
//! through that agent. A container whose sandbox vanished without a DEL is made as the runtime
//! makes one: an ADD through the plugin for a sandbox id containerd does not hold. What the agent
//! saw is read from its metrics endpoint; what it did, from the store through `blockipamctl`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ipam_core::allocator::leaks::{LeakPolicy, LeakWatch, LiveSandbox, RuntimeView};
use ipam_core::{CountingStore, Ipam, KvStore};
use serde_json::{json, Value};
use std::sync::Arc;
use test_kit::agent::InProcessAgent;
use test_kit::cni::{full_cni_env, run_cni, HANG_GUARD};
use test_kit::unix_now;

use crate::common::{plugin_binary, Sandbox};
use crate::containerd::{ctl_on, ctl_run, require_environment, Cri};

/// The node name in the netconf and the agent's `--node`.
const NODE: &str = "leak-node";
/// The pool and its gateway (ptp needs one inside the returned prefix).
const POOL: &str = "10.96.0.0/24";
const GATEWAY: &str = "10.96.0.1";
/// The agent's leak grace and look interval (its CRI calls time out after half of it, and looks
/// more than three intervals apart restart the countdowns by themselves). The grace spans three
/// looks: a step the test takes while an orphan counts down (pausing the runtime) has some
/// seconds to spare on a loaded machine.
const GRACE_SECONDS: u64 = 6;
const SCAN_SECONDS: u64 = 2;
/// Only turns a collection that never happens into a failure (far above grace + two looks).
const WAIT_GUARD: Duration = Duration::from_secs(60);

fn conflist(sandbox: &Sandbox, network: &str, agent_socket: &Path) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": network,
        "plugins": [{
            "type": "ptp",
            "ipMasq": false,
            "ipam": ipam(sandbox, agent_socket),
        }]
    })
}

fn ipam(sandbox: &Sandbox, agent_socket: &Path) -> Value {
    json!({
        "type": "blockipam",
        "nodename": NODE,
        "datastore_type": "sled",
        "datastore_path": sandbox.store_path(),
        "ipam_lock_file": sandbox.lock_path(),
        "agent_socket": agent_socket,
        "gateway": [GATEWAY],
    })
}

/// ADD through the plugin alone for sandbox `id` of pod `pod`, as containerd's libcni calls it
/// (the pod's CNI_ARGS), on network `network`: the address it took.
fn add_without_a_sandbox(
    sandbox: &Sandbox,
    network: &str,
    agent_socket: &Path,
    id: &str,
    pod: &str,
) -> IpAddr {
    let mut env = full_cni_env(
        "ADD",
        id,
        "eth0",
        "/var/run/netns/leak-test",
        "/nonexistent",
    );
    env.push((
        "CNI_ARGS".to_owned(),
        format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={pod};\
             K8S_POD_INFRA_CONTAINER_ID={id};K8S_POD_UID=uid-{pod}"
        ),
    ));
    let netconf = json!({
        "cniVersion": "1.0.0",
        "name": network,
        "ipam": ipam(sandbox, agent_socket),
    });
    let outcome = plugin_call(&env, &netconf);
    let result = outcome.success_json("ADD without a sandbox");
    let address = result["ips"][0]["address"]
        .as_str()
        .unwrap_or_else(|| panic!("no address in {result}"));
    address
        .split('/')
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("not an address: {address}"))
}

/// One call of the real plugin with this CNI environment and netconf.
fn plugin_call(env: &[(String, String)], netconf: &Value) -> test_kit::cni::Outcome {
    run_cni(
        plugin_binary(),
        &[],
        env,
        netconf.to_string().as_bytes(),
        HANG_GUARD,
    )
}

/// The handle holding `address` in the store, read through the agent.
fn holder(sandbox: &Sandbox, agent_socket: &Path, address: IpAddr) -> Option<String> {
    let shown = ctl_on(
        &sandbox.store_path(),
        Some(agent_socket),
        &["show", "--ip", &address.to_string()],
    );
    shown["handle"].as_str().map(str::to_owned)
}

/// One sample of the agent's metrics, by exact name (no labels).
fn metric(port: u16, name: &str) -> Option<f64> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    answer.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == name).then(|| value.trim().parse().ok()).flatten()
    })
}

/// Polls `condition` every 100 ms until it holds; panics with `what` after [`WAIT_GUARD`].
fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT_GUARD;
    while !condition() {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {WAIT_GUARD:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The addresses a `gc --leaks` answer shows counting down.
fn waiting(answer: &Value) -> Vec<IpAddr> {
    decided(answer, "waiting")
}

/// The addresses a `gc --leaks` answer shows due for release.
fn leaked(answer: &Value) -> Vec<IpAddr> {
    decided(answer, "leaked")
}

/// The addresses of a `gc --leaks` answer's list of missing allocations `list`.
fn decided(answer: &Value, list: &str) -> Vec<IpAddr> {
    answer["report"]["decisions"][list]
        .as_array()
        .map(|all| {
            all.iter()
                .filter_map(|m| m["allocation"]["ip"].as_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// `blockipamctl -o json gc --leaks --report PATH`: its JSON answer (status 0, or 1 when the
/// look found a problem: a runtime that could not be asked, a live address the store disagrees
/// with).
fn gc_leaks(sandbox: &Sandbox, agent_socket: &Path, report: &Path) -> Value {
    let (status, answer) = gc_leaks_run(sandbox, agent_socket, report);
    assert!(
        status == 0 || status == 1,
        "gc --leaks: status {status}: {answer}"
    );
    answer
}

/// Whether `blockipamctl gc --leaks` reports a look the runtime did not answer (status 1, with
/// the runtime's error in the report).
fn gc_leaks_status(sandbox: &Sandbox, agent_socket: &Path, report: &Path) -> bool {
    let (status, answer) = gc_leaks_run(sandbox, agent_socket, report);
    status == 1 && answer["report"]["runtime_error"].is_string()
}

fn gc_leaks_run(sandbox: &Sandbox, agent_socket: &Path, report: &Path) -> (i32, Value) {
    let report = report.display().to_string();
    let (status, stdout, stderr) = ctl_run(
        &sandbox.store_path(),
        Some(agent_socket),
        &["gc", "--leaks", "--report", &report],
    );
    let answer = serde_json::from_str(&stdout)
        .unwrap_or_else(|_| json!({ "stdout": stdout, "stderr": stderr }));
    (status, answer)
}

/// Adds the test's pool, named `name`, with blocks of `/block_size`, to the sled store.
fn add_pool(sandbox: &Sandbox, name: &str, block_size: u8) {
    ctl_on(
        &sandbox.store_path(),
        None,
        &[
            "pool",
            "add",
            POOL,
            "--name",
            name,
            "--block-size",
            &block_size.to_string(),
        ],
    );
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn sandbox_id(n: u8) -> String {
    format!("{:02x}", n).repeat(32)
}

/// One node as the leak tests run it: a sled store with a /28-block pool, containerd with the
/// plugin (through ptp) in its conflist, and the real agent serving the store with leak
/// collection on. Dropped agent first, then containerd (its cleanup sends the remaining DELs),
/// then the directory.
struct LeakNode {
    /// Runs until the node is dropped (or [`LeakNode::stop_agent`]).
    agent: Option<InProcessAgent>,
    cri: Cri,
    sandbox: Sandbox,
    agent_socket: PathBuf,
    /// What `blockipamctl gc --leaks` reads: the agent's last look, written beside its socket.
    report_path: PathBuf,
    /// The agent's metrics port.
    port: u16,
    /// The CNI network's name (handles are `<network>.<sandbox id>`).
    network: String,
    /// The agent's `--leak-collection`.
    action: &'static str,
}

impl LeakNode {
    fn start() -> LeakNode {
        LeakNode::start_with("release")
    }

    /// A node whose agent runs with `--leak-collection <action>`.
    fn start_with(action: &'static str) -> LeakNode {
        require_environment();
        let sandbox = Sandbox::new();
        let agent_socket = sandbox.dir.path().join("leak-agent.sock");
        add_pool(&sandbox, "leak-pool", 28);
        let mut cri = Cri::prepare(&sandbox);
        let traces = cri.traces();
        cri.start(&conflist(&sandbox, &traces.network, &agent_socket));

        let port = free_port();
        let mut node = LeakNode {
            agent: None,
            cri,
            report_path: agent_socket.with_file_name("leaks.json"),
            agent_socket,
            sandbox,
            port,
            network: traces.network,
            action,
        };
        node.start_agent();
        node
    }

    /// Starts the real agent on the store, with leak collection at the test's grace and
    /// interval, against this node's containerd.
    fn start_agent(&mut self) {
        self.start_agent_looking_every(SCAN_SECONDS);
    }

    /// [`start_agent`](Self::start_agent), looking every `scan_seconds`.
    fn start_agent_looking_every(&mut self, scan_seconds: u64) {
        assert!(self.agent.is_none(), "the agent runs already");
        let flags: Vec<std::ffi::OsString> = [
            "--datastore-type",
            "sled",
            "--datastore-path",
            &self.sandbox.store_path().display().to_string(),
            "--node",
            NODE,
            "--leak-collection",
            self.action,
            "--cri-socket",
            &self.cri.traces().socket.display().to_string(),
            "--leak-grace-seconds",
            &GRACE_SECONDS.to_string(),
            "--leak-scan-seconds",
            &scan_seconds.to_string(),
            "--metrics-listen",
            &format!("127.0.0.1:{}", self.port),
        ]
        .iter()
        .map(Into::into)
        .collect();
        self.agent = Some(
            InProcessAgent::run_binary_with_flags(&self.agent_socket, flags)
                .unwrap_or_else(|e| panic!("the agent did not start: {e}")),
        );
    }

    /// Stops the agent (its countdowns and counters go with it).
    fn stop_agent(&mut self) {
        self.agent = None;
    }

    /// Runs pod `name` through the CRI: its sandbox id and address, checked recorded for it.
    fn run_pod(&self, name: &str) -> (String, IpAddr) {
        let id = self
            .cri
            .run_pod(name, "default", &BTreeMap::new())
            .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}\n{}", self.cri.log()));
        let status = self.cri.status(&id);
        let address: IpAddr = status["status"]["network"]["ip"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address for {name}: {status}"));
        assert_eq!(self.holder(address), Some(self.handle_of(&id)));
        (id, address)
    }

    /// The handle the plugin records for sandbox `id` on this network.
    fn handle_of(&self, id: &str) -> String {
        format!("{}.{id}", self.network)
    }

    fn holder(&self, address: IpAddr) -> Option<String> {
        holder(&self.sandbox, &self.agent_socket, address)
    }

    fn metric(&self, name: &str) -> Option<f64> {
        metric(self.port, name)
    }

    /// Looks the runtime answered so far.
    fn answered_looks(&self) -> u64 {
        self.metric("blockipam_agent_runtime_looks_total")
            .map_or(0, |v| v as u64)
    }

    fn gc_leaks(&self) -> Value {
        gc_leaks(&self.sandbox, &self.agent_socket, &self.report_path)
    }
}

#[test]
fn the_agent_collects_what_containerd_no_longer_runs_and_never_a_live_pods_address() {
    let node = LeakNode::start();
    let LeakNode {
        cri,
        sandbox,
        agent_socket,
        port,
        report_path,
        ..
    } = &node;
    let port = *port;
    let traces = cri.traces();

    // Two pods the runtime runs, their addresses taken through the agent.
    let mut live: Vec<(String, IpAddr)> = Vec::new();
    for name in ["web-1", "web-2"] {
        let id = cri
            .run_pod(name, "default", &BTreeMap::new())
            .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}\n{}", cri.log()));
        let status = cri.status(&id);
        let address: IpAddr = status["status"]["network"]["ip"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address for {name}: {status}"));
        assert_eq!(
            holder(sandbox, agent_socket, address),
            Some(format!("{}.{id}", traces.network))
        );
        live.push((id, address));
    }
    wait_until("the runtime answers the agent", || {
        metric(port, "blockipam_agent_runtime_answering") == Some(1.0)
    });
    let mut report = Value::Null;
    wait_until("a look that sees both pods", || {
        report = gc_leaks(sandbox, agent_socket, report_path);
        report["report"]["decisions"]["live"] == 2
    });
    assert_eq!(report["report"]["node"], NODE, "{report}");
    assert_eq!(
        report["report"]["decisions"]["runtime_unproven"], false,
        "{report}"
    );
    assert_eq!(
        report["report"]["decisions"]["leaked"],
        json!([]),
        "{report}"
    );

    // A sandbox that vanished without a DEL: its address is released once gone for the grace.
    let added = Instant::now();
    let orphan = add_without_a_sandbox(
        sandbox,
        &traces.network,
        agent_socket,
        &sandbox_id(1),
        "gone-1",
    );
    assert!(holder(sandbox, agent_socket, orphan).is_some());
    wait_until("the orphan's address released", || {
        holder(sandbox, agent_socket, orphan).is_none()
    });
    assert!(
        added.elapsed() >= Duration::from_secs(GRACE_SECONDS),
        "released before its grace"
    );
    assert_eq!(
        metric(port, "blockipam_agent_leaks_released_total"),
        Some(1.0)
    );
    // Calico's counter of its garbage collector's reclamations counts the same, by pool and node.
    let reclamations =
        format!("ipam_allocations_gc_reclamations_total{{ippool=\"leak-pool\",node=\"{NODE}\"}}");
    assert_eq!(metric(port, &reclamations), Some(1.0));
    for (id, address) in &live {
        assert_eq!(
            holder(sandbox, agent_socket, *address),
            Some(format!("{}.{id}", traces.network)),
            "a live pod's address must never be collected"
        );
    }

    // The store loses a live pod's address (a restored backup): the next look reports it (the
    // gauge, 1 until the look after it, is checked where looks are a minute apart) and records it
    // for its pod again, from containerd's (libcni's) cache of the pod's ADD.
    let (_, lost) = &live[1];
    ctl_on(
        &sandbox.store_path(),
        Some(agent_socket),
        &["release", "--ip", &lost.to_string()],
    );
    wait_until("the lost live address recorded again", || {
        metric(port, "blockipam_agent_addresses_reasserted_total") == Some(1.0)
    });
    let (lost_id, _) = &live[1];
    let shown = ctl_on(
        &sandbox.store_path(),
        Some(agent_socket),
        &["show", "--ip", &lost.to_string()],
    );
    assert_eq!(
        shown["handle"],
        format!("{}.{lost_id}", traces.network),
        "{shown}"
    );
    assert_eq!(shown["attributes"]["pod"], "web-2", "{shown}");
    assert_eq!(shown["attributes"]["node"], NODE, "{shown}");
    wait_until("no live address unrecorded any more", || {
        metric(port, "ipam_unrecorded_live_addresses") == Some(0.0)
    });

    // A stale node name (Calico #12257's case): the store hands web-1's address to a container on
    // another node. The agent reports the duplicate, and `blockipamctl check` shows it with the
    // node that found it; the address stays with its recorded holder until an operator acts.
    let (web_1, taken) = &live[0];
    let stale = add_on_another_node(sandbox, agent_socket, &traces.network, *taken);
    wait_until("the duplicate reported", || {
        metric(port, "ipam_duplicate_addresses") == Some(1.0)
    });
    let mut checked = Value::Null;
    wait_until("check reports the duplicate", || {
        let (status, stdout, _) = ctl_run(&sandbox.store_path(), Some(agent_socket), &["check"]);
        checked = serde_json::from_str(&stdout).expect("check's JSON report");
        status == 1
    });
    let problems = checked["problems"].as_array().expect("problems");
    assert_eq!(problems.len(), 1, "{checked}");
    assert_eq!(problems[0]["kind"], "duplicate-address", "{checked}");
    assert_eq!(problems[0]["node"], NODE, "{checked}");
    assert_eq!(problems[0]["handle"], stale, "{checked}");
    assert!(
        problems[0]["detail"]
            .as_str()
            .is_some_and(|d| d.contains("web-1") && d.contains(STALE_NODE)),
        "{checked}"
    );
    assert_eq!(holder(sandbox, agent_socket, *taken), Some(stale.clone()));
    // The operator releases the stale holder's address: the agent records it for web-1 again,
    // and the record `check` reads is cleared.
    ctl_on(
        &sandbox.store_path(),
        Some(agent_socket),
        &["release", "--ip", &taken.to_string()],
    );
    wait_until("web-1's address recorded for it again", || {
        holder(sandbox, agent_socket, *taken) == Some(format!("{}.{web_1}", traces.network))
            && metric(port, "ipam_duplicate_addresses") == Some(0.0)
    });
    wait_until("check clean again", || {
        ctl_run(&sandbox.store_path(), Some(agent_socket), &["check"]).0 == 0
    });

    // A short outage (containerd paused for one failed look, shorter than the gap that restarts
    // countdowns by itself): a countdown running before it starts again after it.
    let second = add_without_a_sandbox(
        sandbox,
        &traces.network,
        agent_socket,
        &sandbox_id(2),
        "gone-2",
    );
    wait_until("a look counting the second orphan down", || {
        waiting(&gc_leaks(sandbox, agent_socket, report_path)).contains(&second)
    });
    cri.pause_containerd();
    wait_until("the agent sees the runtime down", || {
        metric(port, "blockipam_agent_runtime_answering") == Some(0.0)
    });
    let resumed = Instant::now();
    cri.resume_containerd();
    assert!(
        holder(sandbox, agent_socket, second).is_some(),
        "collected while the runtime could not be asked"
    );
    wait_until("the second orphan released after a fresh grace", || {
        holder(sandbox, agent_socket, second).is_none()
    });
    assert!(
        resumed.elapsed() >= Duration::from_secs(GRACE_SECONDS),
        "the countdown did not start again when the runtime came back"
    );

    // A long outage: nothing is collected however long the runtime cannot be asked, and the
    // report says so.
    let third = add_without_a_sandbox(
        sandbox,
        &traces.network,
        agent_socket,
        &sandbox_id(3),
        "gone-3",
    );
    wait_until("a look counting the third orphan down", || {
        waiting(&gc_leaks(sandbox, agent_socket, report_path)).contains(&third)
    });
    cri.pause_containerd();
    wait_until(
        "the agent's report says the runtime could not be asked",
        || gc_leaks_status(sandbox, agent_socket, report_path),
    );
    std::thread::sleep(Duration::from_secs(GRACE_SECONDS + 3 * SCAN_SECONDS));
    assert!(
        holder(sandbox, agent_socket, third).is_some(),
        "collected while the runtime could not be asked"
    );
    let resumed = Instant::now();
    cri.resume_containerd();
    wait_until("the third orphan released after a fresh grace", || {
        holder(sandbox, agent_socket, third).is_none()
    });
    assert!(resumed.elapsed() >= Duration::from_secs(GRACE_SECONDS));
    assert_eq!(
        metric(port, "blockipam_agent_leaks_released_total"),
        Some(3.0)
    );
    assert_eq!(metric(port, &reclamations), Some(3.0));

    // The normal path: StopPodSandbox sends DEL; the agent had nothing to do with it.
    for (id, _) in &live {
        cri.stop_pod(id);
        cri.remove_pod(id);
    }
    assert_eq!(holder(sandbox, agent_socket, live[0].1), None);
    let report = ctl_on(&sandbox.store_path(), Some(agent_socket), &["check"]);
    assert_eq!(report["problems"], json!([]), "{report}");
    drop(node);
}

/// The other node in the duplicate case.
const STALE_NODE: &str = "stale-node";

/// Releases `address` and has the plugin take exactly it (`IP=` in CNI_ARGS) for a container on
/// [`STALE_NODE`]: the handle that holds it then. Tried again when this node's agent recorded the
/// address for its live pod between the two calls.
fn add_on_another_node(
    sandbox: &Sandbox,
    agent_socket: &Path,
    network: &str,
    address: IpAddr,
) -> String {
    let id = sandbox_id(0xee);
    let mut last = None;
    for _ in 0..5 {
        ctl_on(
            &sandbox.store_path(),
            Some(agent_socket),
            &["release", "--ip", &address.to_string()],
        );
        let mut env = full_cni_env("ADD", &id, "eth0", "/var/run/netns/stale", "/nonexistent");
        env.push((
            "CNI_ARGS".to_owned(),
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=stale;\
                 K8S_POD_INFRA_CONTAINER_ID={id};IP={address}"
            ),
        ));
        let mut settings = ipam(sandbox, agent_socket);
        settings["nodename"] = json!(STALE_NODE);
        let netconf = json!({"cniVersion": "1.0.0", "name": network, "ipam": settings});
        let outcome = plugin_call(&env, &netconf);
        if outcome.status == 0 {
            return format!("{network}.{id}");
        }
        last = Some(outcome);
    }
    panic!("the plugin never took {address} for {STALE_NODE}: {last:#?}");
}

/// Puts a plugin at the node's `blockipam` whose DEL fails with a CNI error (as a plugin that
/// cannot reach its store answers) and whose other commands run the real plugin.
fn break_the_plugins_del(cri: &Cri) {
    let bin = cri.traces().dir.join("cni-bin");
    let script = format!(
        "#!/bin/sh\n\
         if [ \"$CNI_COMMAND\" = DEL ]; then\n\
         \x20 echo '{{\"cniVersion\":\"1.0.0\",\"code\":11,\"msg\":\"the store cannot be reached\"}}'\n\
         \x20 exit 1\n\
         fi\n\
         exec {} \"$@\"\n",
        plugin_binary().display()
    );
    replace_plugin(&bin, |path| {
        std::fs::write(path, script)?;
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
    });
}

/// Puts the real plugin back at the node's `blockipam`.
fn mend_the_plugin(cri: &Cri) {
    let bin = cri.traces().dir.join("cni-bin");
    replace_plugin(&bin, |path| {
        std::os::unix::fs::symlink(plugin_binary(), path)
    });
}

/// Replaces `<bin>/blockipam` by what `make` writes at a temporary path, renamed into place.
fn replace_plugin(bin: &Path, make: impl FnOnce(&Path) -> std::io::Result<()>) {
    let staged = bin.join(".blockipam.new");
    let _ = std::fs::remove_file(&staged);
    make(&staged).expect("stage the plugin");
    std::fs::rename(&staged, bin.join("blockipam")).expect("put the plugin in place");
}

/// Looks the agent makes, at most, between the first look that finds a container gone and the
/// one that collects its address: the grace, then two more intervals.
fn looks_within_grace_and_two_intervals() -> u64 {
    GRACE_SECONDS.div_ceil(SCAN_SECONDS) + 2
}

#[test]
fn a_pod_whose_del_failed_is_kept_while_its_sandbox_exists_and_collected_with_the_rest_after_a_reboot(
) {
    let mut node = LeakNode::start();
    let (running_id, running) = node.run_pod("web-1");
    let (failed_id, failed) = node.run_pod("web-2");
    wait_until("a look that sees both pods", || {
        node.gc_leaks()["report"]["decisions"]["live"] == 2
    });

    // web-2 is stopped, and its DEL fails: containerd keeps the sandbox (not ready), and the
    // address stays recorded.
    break_the_plugins_del(&node.cri);
    let stopped = node
        .cri
        .call("StopPodSandbox", &json!({"pod_sandbox_id": failed_id}));
    let error = stopped.expect_err("StopPodSandbox must fail when the plugin's DEL fails");
    assert!(
        error.contains("the store cannot be reached"),
        "not the plugin's error: {error}"
    );
    let status = node.cri.status(&failed_id);
    assert_eq!(status["status"]["state"], "SANDBOX_NOTREADY", "{status}");
    // While the sandbox exists, in whatever state, its address is the pod's: longer than the
    // grace plus two looks, and every look counts it live.
    let from = node.answered_looks();
    wait_until("the grace and two more looks", || {
        node.answered_looks() > from + looks_within_grace_and_two_intervals()
    });
    assert_eq!(node.holder(failed), Some(node.handle_of(&failed_id)));
    let report = node.gc_leaks();
    assert_eq!(report["report"]["decisions"]["live"], 2, "{report}");
    assert_eq!(
        report["report"]["decisions"]["waiting"],
        json!([]),
        "{report}"
    );
    assert_eq!(
        node.metric("blockipam_agent_leaks_released_total"),
        Some(0.0)
    );

    // The node goes down and comes back with containerd's state wiped: no DEL ever reaches the
    // plugin for either pod. While the runtime's socket is gone nothing is collected.
    node.cri.power_off();
    mend_the_plugin(&node.cri);
    wait_until("the agent sees the runtime gone", || {
        node.metric("blockipam_agent_runtime_answering") == Some(0.0)
    });
    std::thread::sleep(Duration::from_secs(GRACE_SECONDS + 3 * SCAN_SECONDS));
    assert_eq!(node.holder(running), Some(node.handle_of(&running_id)));
    assert_eq!(node.holder(failed), Some(node.handle_of(&failed_id)));
    assert!(
        gc_leaks_status(&node.sandbox, &node.agent_socket, &node.report_path),
        "the report must say the runtime could not be asked"
    );

    // No look can find the pods missing before containerd is started again: the grace is timed
    // from here (the agent may see it answer while `power_on` still waits for it).
    let powered_on = Instant::now();
    node.cri.power_on();
    wait_until("the agent sees the runtime again", || {
        node.metric("blockipam_agent_runtime_answering") == Some(1.0)
    });
    let first_look_back = node.answered_looks();
    // The kubelet starts the node's pods again: new sandboxes, new addresses.
    let (recreated_id, recreated) = node.run_pod("web-1");
    let recreated_seen = node.answered_looks() + 1;
    let mut collected_at_look = 0;
    wait_until("both lost pods' addresses collected", || {
        let gone = node.holder(running).is_none() && node.holder(failed).is_none();
        collected_at_look = node.answered_looks();
        gone
    });
    assert!(
        powered_on.elapsed() >= Duration::from_secs(GRACE_SECONDS),
        "collected before the grace"
    );
    let bound = (first_look_back + looks_within_grace_and_two_intervals()).max(recreated_seen);
    assert!(
        collected_at_look <= bound,
        "collected at look {collected_at_look}, later than the grace plus two looks (look {bound}; \
         the runtime answered again at look {first_look_back})"
    );
    assert_eq!(
        node.metric("blockipam_agent_leaks_released_total"),
        Some(2.0)
    );
    assert_eq!(node.holder(recreated), Some(node.handle_of(&recreated_id)));

    // The agent stops, and the store is restored from a backup older than the recreated pod: its
    // address is free there. The agent's first look after it starts records it for the pod again.
    node.stop_agent();
    ctl_on(
        &node.sandbox.store_path(),
        None,
        &["release", "--ip", &recreated.to_string()],
    );
    // Looking once a minute: the first look is the only one within the wait, however slow the
    // machine.
    node.start_agent_looking_every(60);
    let mut looks = 0;
    wait_until("the restored store's lost address recorded again", || {
        let done = node.metric("blockipam_agent_addresses_reasserted_total") == Some(1.0);
        looks = node.answered_looks();
        done
    });
    assert_eq!(looks, 1, "recorded again at the agent's first look");
    assert_eq!(
        node.metric("ipam_unrecorded_live_addresses"),
        Some(1.0),
        "the first look reports the live address the store held free"
    );
    assert_eq!(node.holder(recreated), Some(node.handle_of(&recreated_id)));
    // What that look settled itself is not left for `blockipamctl check`: stopping the agent lets
    // the look in progress finish (its record of disagreements written), and nothing else looks
    // after it.
    node.stop_agent();
    let report = ctl_on(&node.sandbox.store_path(), None, &["check"]);
    assert_eq!(report["problems"], json!([]), "{report}");
    node.start_agent();

    node.cri.stop_pod(&recreated_id);
    node.cri.remove_pod(&recreated_id);
    assert_eq!(node.holder(recreated), None);
    let report = ctl_on(
        &node.sandbox.store_path(),
        Some(&node.agent_socket),
        &["check"],
    );
    assert_eq!(report["problems"], json!([]), "{report}");
}

/// With `--leak-collection report` the agent lists an address whose container is gone past the
/// grace as due and leaves it allocated, look after look; `blockipamctl gc --leaks --apply`
/// releases it, and never the live pod's.
#[test]
fn with_report_only_the_agent_lists_a_leak_and_releases_nothing_until_gc_applies_it() {
    let node = LeakNode::start_with("report");
    let (live_id, live) = node.run_pod("web-1");
    let orphan_id = sandbox_id(7);
    let orphan = add_without_a_sandbox(
        &node.sandbox,
        &node.network,
        &node.agent_socket,
        &orphan_id,
        "gone-7",
    );
    wait_until("a look that lists the orphan's address as due", || {
        leaked(&node.gc_leaks()) == [orphan]
    });
    // Due, and left alone by the agent for two more looks.
    let from = node.answered_looks();
    wait_until("two more looks", || node.answered_looks() >= from + 2);
    let report = node.gc_leaks();
    assert_eq!(leaked(&report), [orphan], "{report}");
    assert_eq!(report["report"]["decisions"]["live"], 1, "{report}");
    assert_eq!(node.holder(orphan), Some(node.handle_of(&orphan_id)));
    assert_eq!(
        node.metric("blockipam_agent_leaks_released_total"),
        Some(0.0)
    );

    let report_path = node.report_path.display().to_string();
    let (status, stdout, stderr) = ctl_run(
        &node.sandbox.store_path(),
        Some(&node.agent_socket),
        &["gc", "--leaks", "--report", &report_path, "--apply"],
    );
    assert_eq!(status, 0, "gc --leaks --apply: {stdout}{stderr}");
    assert_eq!(node.holder(orphan), None, "gc --leaks --apply: {stdout}");
    assert_eq!(node.holder(live), Some(node.handle_of(&live_id)));
}

/// Pods in the scan-cost run: `BLOCKIPAM_LEAK_SCAN_PODS` (110, Kubernetes' default pod limit per
/// node, for the figure in docs/benchmarks.md), 8 when unset (CI).
fn scan_pods() -> usize {
    std::env::var("BLOCKIPAM_LEAK_SCAN_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

/// What the agent asks containerd just before it records a live pod's address again: a running
/// pod's sandbox is ready; once stopped (its network torn down, the plugin's DEL sent) or removed
/// it is not, nor is a sandbox containerd never had.
#[test]
fn containerd_says_a_sandbox_is_ready_until_it_is_stopped() {
    require_environment();
    let sandbox = Sandbox::new();
    add_pool(&sandbox, "ready-pool", 28);
    let mut cri = Cri::prepare(&sandbox);
    let traces = cri.traces();
    let mut direct = conflist(&sandbox, &traces.network, Path::new("none"));
    direct["plugins"][0]["ipam"]["agent_socket"] = json!("");
    cri.start(&direct);
    let id = cri
        .run_pod("ready", "default", &BTreeMap::new())
        .unwrap_or_else(|e| panic!("RunPodSandbox ready: {e}\n{}", cri.log()));
    let is_ready = |id: &str| {
        test_kit::block_on(async {
            cri_client::CriClient::connect(&traces.socket, Duration::from_secs(10))
                .await
                .expect("connect to containerd's CRI")
                .sandbox_is_ready(id)
                .await
                .expect("containerd answers PodSandboxStatus")
        })
    };
    assert!(is_ready(&id), "a running pod's sandbox");
    cri.stop_pod(&id);
    assert!(!is_ready(&id), "a stopped sandbox");
    cri.remove_pod(&id);
    assert!(!is_ready(&id), "a removed sandbox");
    assert!(
        !is_ready(&"ab".repeat(32)),
        "a sandbox containerd never had"
    );
}

/// What one leak look costs on a node with N running pods: the CRI calls (one ListPodSandbox, one
/// PodSandboxStatus per ready sandbox) and the store's round trips, counted exactly (asserted);
/// the time of each half printed (median of 7 looks), never asserted.
#[test]
fn one_leak_look_costs_one_cri_list_one_status_per_pod_and_two_store_reads() {
    require_environment();
    let pods = scan_pods();
    let sandbox = Sandbox::new();
    add_pool(&sandbox, "scan-pool", 26);
    let mut cri = Cri::prepare(&sandbox);
    let traces = cri.traces();
    let mut direct = conflist(&sandbox, &traces.network, Path::new("none"));
    direct["plugins"][0]["ipam"]["agent_socket"] = json!("");
    cri.start(&direct);
    for n in 0..pods {
        cri.run_pod(&format!("scan-{n}"), "default", &BTreeMap::new())
            .unwrap_or_else(|e| panic!("RunPodSandbox scan-{n}: {e}\n{}", cri.log()));
    }

    let runtime = test_kit::block_on(async {
        let client = cri_client::CriClient::connect(&traces.socket, Duration::from_secs(10))
            .await
            .expect("connect to containerd's CRI");
        let mut times = Vec::new();
        let mut sandboxes = Vec::new();
        for _ in 0..7 {
            let started = Instant::now();
            sandboxes = client.sandboxes().await.expect("every sandbox");
            times.push(started.elapsed());
        }
        (sandboxes, median(times))
    });
    let (sandboxes, cri_time) = runtime;
    assert_eq!(sandboxes.len(), pods, "every pod's sandbox");
    assert!(sandboxes.iter().all(|s| s.ready && s.addresses.len() == 1));

    let view = RuntimeView {
        observed_at: unix_now(),
        sandboxes: sandboxes
            .into_iter()
            .map(|s| {
                (
                    s.id,
                    LiveSandbox {
                        pod: s.pod,
                        namespace: s.namespace,
                        uid: s.uid,
                        addresses: s.addresses,
                    },
                )
            })
            .collect(),
    };
    let (round_trips, store_time, live) = test_kit::block_on(async {
        let store = sandbox.open_store().await;
        let counting = Arc::new(CountingStore::new(store));
        let ipam = Ipam::new(Arc::clone(&counting) as Arc<dyn KvStore>);
        let policy = LeakPolicy {
            grace_seconds: 900,
            max_gap_seconds: 180,
        };
        let mut times = Vec::new();
        let mut live = 0;
        let mut watch = LeakWatch::new();
        let mut survey = None;
        for look in 0..8 {
            counting.take();
            let started = Instant::now();
            let decisions = ipam
                .look_for_leaks(NODE, &view, &mut watch, policy)
                .await
                .expect("look");
            let elapsed = started.elapsed();
            let trips = counting.take();
            // The agent's first look reads every block of the store; the others the node's.
            assert_eq!(watch.last_look_surveyed(), look == 0);
            if look == 0 {
                survey = Some(trips);
            } else {
                times.push(elapsed);
                assert_eq!(
                    (trips.reads, trips.commits),
                    (2, 0),
                    "a look is two reads (the pools; the node's blocks and borrowed-block index) \
                     and writes nothing"
                );
            }
            live = decisions.live;
            assert!(decisions.disagreements.is_empty(), "{decisions:?}");
        }
        (survey.expect("the first look"), median(times), live)
    });
    assert_eq!(live, pods, "every pod's allocation seen live");
    assert_eq!(
        (round_trips.reads, round_trips.commits),
        (2, 0),
        "the first look is two reads (every block, the pools) and writes nothing"
    );
    println!(
        "leak look, {pods} pods: CRI {} calls (1 ListPodSandbox + {pods} PodSandboxStatus), median \
         {:.2} ms; store 2 reads, 0 commits, median {:.2} ms",
        1 + pods,
        cri_time.as_secs_f64() * 1e3,
        store_time.as_secs_f64() * 1e3
    );
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}
