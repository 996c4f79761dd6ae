//! End-to-end tests under Debian's real `ptp` and `bridge` plugins in network namespaces.
//!
//! End to end under Debian's real CNI plugins: a "host" network namespace and two "container"
//! namespaces; `/usr/lib/cni/ptp` (and `bridge`) run inside the host namespace with `CNI_PATH`
//! pointing at the built `blockipam`, so they exec it exactly as a runtime's main plugin would.
//! Both containers get distinct addresses from a test pool, ping each other, CHECK passes, and
//! DEL removes the allocations. Every link, route and sysctl the plugins change lives in
//! namespaces these tests create and always delete.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use common::*;
use serde_json::{json, Value};

const PLUGIN_DIR: &str = "/usr/lib/cni";

/// Fails (never skips) when the machine cannot run these tests, saying what to do.
fn require_environment() {
    let mut missing = Vec::new();
    for plugin in ["ptp", "bridge"] {
        if !Path::new(PLUGIN_DIR).join(plugin).is_file() {
            missing.push(format!("{PLUGIN_DIR}/{plugin}"));
        }
    }
    for tool in ["/usr/sbin/ip", "/usr/bin/ping"] {
        let alternative = tool.replace("/usr", "");
        if !Path::new(tool).exists() && !Path::new(&alternative).exists() {
            missing.push(tool.to_owned());
        }
    }
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
        })
        .unwrap_or_default();
    assert!(
        missing.is_empty() && uid == "0",
        "the end-to-end tests need root and Debian's CNI plugins: run as root after \
         `apt-get install containernetworking-plugins iproute2 iputils-ping` (or scripts/setup); \
         missing: {missing:?}, uid: {uid:?}"
    );
}

/// Network namespaces created by one test, deleted on drop (even when the test fails).
struct Namespaces {
    names: Vec<String>,
}

impl Namespaces {
    fn create(roles: &[&str]) -> Namespaces {
        let tag = format!("{:08x}", rand_u32());
        let mut namespaces = Namespaces { names: Vec::new() };
        for role in roles {
            let name = format!("bipam-{role}-{tag}");
            run_ok(
                Command::new("ip").args(["netns", "add", &name]),
                "ip netns add",
            );
            namespaces.names.push(name);
        }
        namespaces
    }

    fn name(&self, index: usize) -> &str {
        &self.names[index]
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in &self.names {
            let status = Command::new("ip")
                .args(["netns", "del", name])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if !matches!(status, Ok(s) if s.success()) {
                eprintln!("warning: could not delete network namespace {name}");
            }
        }
    }
}

fn rand_u32() -> u32 {
    // A clock reading, the process id and a per-process counter: unique on one machine.
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    nanos
        ^ std::process::id().rotate_left(16)
        ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(24)
}

fn run_ok(command: &mut Command, what: &str) -> String {
    let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Runs a main plugin inside `host_ns` as a runtime would.
fn main_plugin(
    host_ns: &str,
    plugin: &str,
    command: &str,
    container_id: &str,
    container_ns: &str,
    netconf: &Value,
) -> Outcome {
    let blockipam_dir = Path::new(BIN).parent().expect("binary directory");
    let mut child = Command::new("ip")
        .args(["netns", "exec", host_ns])
        .arg(Path::new(PLUGIN_DIR).join(plugin))
        .env_clear()
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_NETNS", format!("/var/run/netns/{container_ns}"))
        .env("CNI_IFNAME", "eth0")
        .env(
            "CNI_PATH",
            format!("{}:{PLUGIN_DIR}", blockipam_dir.display()),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the main plugin");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(netconf.to_string().as_bytes())
        .expect("write the netconf");
    let output = child.wait_with_output().expect("wait");
    Outcome {
        status: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn ping(from_ns: &str, to: &str) -> Outcome {
    let output = Command::new("ip")
        .args(["netns", "exec", from_ns, "ping", "-c1", "-W2", to])
        .output()
        .expect("run ping");
    Outcome {
        status: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// The whole scenario for one main plugin: two containers, ping both ways, CHECK, DEL.
fn two_containers_ping_each_other(plugin: &str, main_conf: Value, subnet: &str, gateway: &str) {
    require_environment();
    let sandbox = Sandbox::new();
    let namespaces = Namespaces::create(&["host", "c1", "c2"]);
    let (host, c1, c2) = (namespaces.name(0), namespaces.name(1), namespaces.name(2));
    let mut netconf = json!({
        "cniVersion": "1.0.0",
        "name": "bipam-e2e",
        "type": plugin,
        "ipam": sandbox.ipam(json!({
            "nodename": "e2e-node",
            "pools": [{"cidr": subnet, "block_size": 26}],
            "gateway": gateway,
        })),
    });
    merge(&mut netconf, main_conf);

    let mut results = Vec::new();
    for (id, ns) in [("e2e-c1", c1), ("e2e-c2", c2)] {
        let outcome = main_plugin(host, plugin, "ADD", id, ns, &netconf);
        let result = outcome.success_json(&format!("{plugin} ADD {id}"));
        results.push(result);
    }
    let ip1 = first_address(&results[0]);
    let ip2 = first_address(&results[1]);
    assert_ne!(ip1, ip2, "both containers got the same address");
    let pool: ipnet::IpNet = subnet.parse().expect("subnet");
    for ip in [&ip1, &ip2] {
        let parsed: std::net::IpAddr = ip.parse().expect("ip");
        assert!(pool.contains(&parsed), "{ip} is not in {subnet}");
        assert_ne!(ip, gateway, "a container got the gateway");
    }
    // blockipam recorded exactly these two, for this node.
    let mut recorded: Vec<(String, String)> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(ip, handle, attrs)| {
            assert_eq!(attrs["node"], "e2e-node");
            (handle, ip)
        })
        .collect();
    recorded.sort();
    assert_eq!(
        recorded,
        vec![
            ("bipam-e2e.e2e-c1".to_owned(), ip1.clone()),
            ("bipam-e2e.e2e-c2".to_owned(), ip2.clone())
        ]
    );

    let there = ping(c1, &ip2);
    assert_eq!(
        there.status, 0,
        "c1 cannot ping c2 through {plugin}: {there:#?}"
    );
    let back = ping(c2, &ip1);
    assert_eq!(
        back.status, 0,
        "c2 cannot ping c1 through {plugin}: {back:#?}"
    );

    for ((id, ns), result) in [("e2e-c1", c1), ("e2e-c2", c2)].into_iter().zip(&results) {
        let mut check = netconf.clone();
        merge(&mut check, json!({"prevResult": result}));
        main_plugin(host, plugin, "CHECK", id, ns, &check)
            .assert_silent_success(&format!("{plugin} CHECK {id}"));
    }

    for (id, ns) in [("e2e-c1", c1), ("e2e-c2", c2)] {
        main_plugin(host, plugin, "DEL", id, ns, &netconf)
            .assert_silent_success(&format!("{plugin} DEL {id}"));
        // DEL again, as runtimes do: still success.
        main_plugin(host, plugin, "DEL", id, ns, &netconf)
            .assert_silent_success(&format!("{plugin} second DEL {id}"));
    }
    assert!(
        sandbox.container_allocations().is_empty(),
        "DEL left allocations: {:?}",
        sandbox.container_allocations()
    );
    let gone = ping(c1, &ip2);
    assert_ne!(gone.status, 0, "c2 still answers after DEL");
    drop(namespaces);
}

#[test]
fn ptp_delegates_to_blockipam_and_two_containers_ping_each_other() {
    two_containers_ping_each_other(
        "ptp",
        json!({"ipMasq": false}),
        "10.244.77.0/24",
        "10.244.77.1",
    );
}

#[test]
fn bridge_delegates_to_blockipam_and_two_containers_ping_each_other() {
    let bridge = format!("bipbr{:x}", rand_u32() & 0xff_ffff);
    two_containers_ping_each_other(
        "bridge",
        json!({"bridge": bridge, "isGateway": true, "ipMasq": false}),
        "10.244.78.0/24",
        "10.244.78.1",
    );
}

#[test]
fn namespaces_created_by_these_tests_are_gone_afterwards() {
    require_environment();
    let names: Vec<String> = {
        let namespaces = Namespaces::create(&["probe"]);
        namespaces.names.clone()
    };
    let listed = run_ok(Command::new("ip").args(["netns", "list"]), "ip netns list");
    for name in names {
        assert!(!listed.contains(&name), "{name} was left behind");
    }
}
