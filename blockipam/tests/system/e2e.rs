//! End-to-end tests under Debian's real `ptp` and `bridge` plugins in network namespaces.
//!
//! End to end under Debian's real CNI plugins: a "host" network namespace and two "container"
//! namespaces; `/usr/lib/cni/ptp` (and `bridge`) run inside the host namespace with `CNI_PATH`
//! pointing at the built `blockipam`, so they exec it exactly as a runtime's main plugin would.
//! Both containers get distinct addresses from a test pool, ping each other (under `bridge` with
//! the host's forwarding off: one subnet talks directly), CHECK passes; DEL of one releases its
//! address, which a new container then gets and answers at; DEL removes the allocations. Every link, route and sysctl the plugins change lives in
//! namespaces these tests create and always delete.

use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use common::*;
use serde_json::{json, Value};
use test_kit::cni::{full_cni_env, run_cni, HANG_GUARD};

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
    assert!(
        missing.is_empty() && crate::common::running_as_root(),
        "the end-to-end tests need root and Debian's CNI plugins: run as root after \
         `apt-get install containernetworking-plugins iproute2 iputils-ping` (or scripts/setup); \
         missing: {missing:?}, root: {}",
        crate::common::running_as_root()
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

/// Runs a main plugin inside `host_ns` as a runtime would, with `cni_args` as `CNI_ARGS`.
fn main_plugin(
    host_ns: &str,
    plugin: &str,
    command: &str,
    (container_id, container_ns): (&str, &str),
    netconf: &Value,
    cni_args: &str,
) -> Outcome {
    let blockipam_dir = plugin_binary().parent().expect("binary directory");
    let main_plugin = Path::new(PLUGIN_DIR).join(plugin).display().to_string();
    let mut env = full_cni_env(
        command,
        container_id,
        "eth0",
        &format!("/var/run/netns/{container_ns}"),
        &format!("{}:{PLUGIN_DIR}", blockipam_dir.display()),
    );
    env.push(("CNI_ARGS".to_owned(), cni_args.to_owned()));
    run_cni(
        Path::new("ip"),
        &["netns", "exec", host_ns, &main_plugin],
        &env,
        netconf.to_string().as_bytes(),
        HANG_GUARD,
    )
}

/// One ping from `from_ns`. iputils' exit status: 0 a reply came, 1 no reply (the packet left
/// and nobody answered), 2 any other error (for example no route: nothing was sent).
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

/// Turns IPv4 forwarding in `namespace` on or off (the main plugins turn it on at every ADD).
fn set_forwarding(namespace: &str, on: bool) {
    let script = format!("echo {} > /proc/sys/net/ipv4/ip_forward", u8::from(on));
    run_ok(
        Command::new("ip").args(["netns", "exec", namespace, "sh", "-c", &script]),
        "set ip_forward",
    );
}

/// The addresses (handle, address) blockipam holds for containers, sorted.
fn recorded(sandbox: &Sandbox) -> Vec<(String, String)> {
    let mut recorded: Vec<(String, String)> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(ip, handle, attrs)| {
            assert_eq!(attrs["node"], "e2e-node");
            (handle, ip)
        })
        .collect();
    recorded.sort();
    recorded
}

/// How the host namespace forwards between containers during a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Forwarding {
    /// Left as the main plugin sets it (on): `ptp` containers reach each other only through the
    /// host.
    AsThePluginSetsIt,
    /// Turned off before every ping: containers of one `bridge` subnet must reach each other
    /// directly, never through the host.
    Off,
}

/// The whole scenario for one main plugin: two containers ping each other, CHECK passes; DEL of
/// one releases its address (the other container still reaches the gateway, but nobody answers
/// at the released address), a new container asking for that address gets it and answers; DEL
/// of the rest leaves nothing.
fn two_containers_ping_each_other(
    plugin: &str,
    main_conf: Value,
    subnet: &str,
    gateway: &str,
    forwarding: Forwarding,
) {
    require_environment();
    let sandbox = Sandbox::new();
    let namespaces = Namespaces::create(&["host", "c1", "c2", "c3"]);
    let host = namespaces.name(0);
    let c1 = ("e2e-c1", namespaces.name(1));
    let c2 = ("e2e-c2", namespaces.name(2));
    let c3 = ("e2e-c3", namespaces.name(3));
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
    let add = |container: (&str, &str), cni_args: &str| {
        let outcome = main_plugin(host, plugin, "ADD", container, &netconf, cni_args);
        let result = outcome.success_json(&format!("{plugin} ADD {}", container.0));
        if forwarding == Forwarding::Off {
            set_forwarding(host, false);
        }
        result
    };
    let del = |container: (&str, &str)| {
        main_plugin(host, plugin, "DEL", container, &netconf, "")
            .assert_silent_success(&format!("{plugin} DEL {}", container.0));
        // DEL again, as runtimes do: still success.
        main_plugin(host, plugin, "DEL", container, &netconf, "")
            .assert_silent_success(&format!("{plugin} second DEL {}", container.0));
    };

    let results = [add(c1, ""), add(c2, "")];
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
    assert_eq!(
        recorded(&sandbox),
        vec![
            ("bipam-e2e.e2e-c1".to_owned(), ip1.clone()),
            ("bipam-e2e.e2e-c2".to_owned(), ip2.clone())
        ]
    );

    let there = ping(c1.1, &ip2);
    assert_eq!(
        there.status, 0,
        "c1 cannot ping c2 through {plugin} ({forwarding:?}): {there:#?}"
    );
    let back = ping(c2.1, &ip1);
    assert_eq!(
        back.status, 0,
        "c2 cannot ping c1 through {plugin} ({forwarding:?}): {back:#?}"
    );

    for (container, result) in [c1, c2].into_iter().zip(&results) {
        let mut check = netconf.clone();
        merge(&mut check, json!({"prevResult": result}));
        main_plugin(host, plugin, "CHECK", container, &check, "")
            .assert_silent_success(&format!("{plugin} CHECK {}", container.0));
    }

    // DEL of c2 releases its address and only it.
    del(c2);
    assert_eq!(
        recorded(&sandbox),
        vec![("bipam-e2e.e2e-c1".to_owned(), ip1.clone())],
        "DEL of c2 must release exactly c2's address"
    );
    // c1's own network is intact: it still reaches the gateway ...
    let gateway_ping = ping(c1.1, gateway);
    assert_eq!(
        gateway_ping.status, 0,
        "c1 lost its network: {gateway_ping:#?}"
    );
    // ... and its ping to the released address leaves and finds nobody (status 1, not 2).
    let gone = ping(c1.1, &ip2);
    assert_eq!(
        gone.status, 1,
        "after DEL of c2, a ping to {ip2} must go out and get no answer: {gone:#?}"
    );
    // The released address is free again: a new container asking for exactly it gets it, and
    // answers there.
    let args = format!("IgnoreUnknown=1;IP={ip2}");
    let reused = add(c3, &args);
    assert_eq!(first_address(&reused), ip2, "{reused}");
    // c3 first, so that on a bridge c1 learns c3's hardware address for it (c1 still has c2's
    // cached).
    let answered = ping(c3.1, &ip1);
    assert_eq!(answered.status, 0, "c3 cannot reach c1: {answered:#?}");
    let answered = ping(c1.1, &ip2);
    assert_eq!(
        answered.status, 0,
        "c3 does not answer at {ip2}: {answered:#?}"
    );

    del(c1);
    del(c3);
    assert!(
        sandbox.container_allocations().is_empty(),
        "DEL left allocations: {:?}",
        sandbox.container_allocations()
    );
    drop(namespaces);
}

#[test]
fn ptp_delegates_to_blockipam_and_two_containers_ping_each_other() {
    two_containers_ping_each_other(
        "ptp",
        json!({"ipMasq": false}),
        "10.244.77.0/24",
        "10.244.77.1",
        Forwarding::AsThePluginSetsIt,
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
        Forwarding::Off,
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
