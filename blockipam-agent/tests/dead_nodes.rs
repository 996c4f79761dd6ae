//! Dead-node reclaim end to end on real etcd, real `blockipam-agent` processes and the real plugin.
//!
//! On one member: the operator's scenario of a node whose agent is stopped (SIGTERM), then
//! killed (SIGKILL, its socket left behind), while the node's runtime keeps calling the plugin:
//! the node's running pods keep their addresses and no other node is handed them; once the node
//! goes quiet for good its blocks are reclaimed, its addresses kept. A node cut off from etcd
//! (a proxy the test cuts) for longer than the grace: its blocks are reclaimed, its running pods'
//! addresses are never handed to another node, and once the link heals it registers again and
//! its pods' DELs release them.
//!
//! On a 3-member etcd cluster: three agents (nodes a, b, c) with a 2 s liveness TTL, a 10 s
//! grace and a 1 s reclaim interval; addresses allocated through the real plugin. Agent a is
//! killed (SIGKILL): once the grace has passed its blocks are released, its addresses kept, and
//! `blockipamctl check` is clean. Agent b is paused (SIGSTOP)
//! until its liveness key has expired and a reclaimer has marked it missing, then resumed: it is
//! never reclaimed and its liveness key comes back. Node c, and a node whose plugin runs without
//! an agent (never registered), are untouched. A second test has the reclaimer leader release
//! the empty blocks hosts no longer need (`--empty-block-release-seconds`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use backend_etcd::EtcdStore;
use blockipam_agent::counters::NODE_STATES;
use common::etcd_agents::{
    added_address, addresses_of, blocks_of, cni_add, connect, ctl, held_by, is_live, netconf,
    netconf_with_pool, registration, wait_until, Agent, WAIT_LIMIT,
};
use common::partition::PartitionProxy;
use ipam_core::dead_nodes::agent_key;
use ipam_core::{Ipam, KvStore};
use serde_json::Value;
use test_kit::etcd::{unique_prefix, EtcdCluster};

#[test]
fn killed_agents_node_is_reclaimed_after_the_grace_and_a_paused_one_that_returns_is_not() {
    let cluster = EtcdCluster::start(3).expect("a 3-member etcd cluster (package etcd-server)");
    let endpoints = cluster.endpoints().join(",");
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    let lock = dir.path().join("ipam.lock");
    let (runtime, store) = connect(&cluster, &prefix);

    let socket = |node: &str| dir.path().join(format!("{node}.sock"));
    let agents: Vec<Agent> = ["node-a", "node-b", "node-c"]
        .into_iter()
        .map(|node| Agent::start(node, &socket(node), &endpoints, &prefix))
        .collect();
    for node in ["node-a", "node-b", "node-c"] {
        wait_until(
            &runtime,
            &format!("{node} is registered and live"),
            || async { registration(&store, node).await.is_some() && is_live(&store, node).await },
        );
    }

    // Two pods per node through the real plugin and that node's agent; two on a node whose
    // plugin runs without an agent (never registered).
    for (node, agent_socket) in [
        ("node-a", socket("node-a").display().to_string()),
        ("node-b", socket("node-b").display().to_string()),
        ("node-c", socket("node-c").display().to_string()),
        ("node-x", "none".to_owned()),
    ] {
        let conf = netconf(node, &agent_socket, &endpoints, &prefix, &lock);
        for pod in 0..2 {
            let (status, stdout) = cni_add(&format!("{node}-pod{pod}"), &conf);
            assert_eq!(status, 0, "ADD on {node}: {stdout}");
        }
    }
    for node in ["node-a", "node-b", "node-c", "node-x"] {
        assert_eq!(runtime.block_on(addresses_of(&store, node)), 2, "{node}");
    }

    let (agent_a, agent_b, agent_c) = (&agents[0], &agents[1], &agents[2]);
    agent_a.signal("KILL");
    agent_b.signal("STOP");
    // b's lease expires and a reclaimer marks b missing; then b resumes, well within the grace.
    wait_until(&runtime, "node-b is marked missing", || async {
        !is_live(&store, "node-b").await
            && registration(&store, "node-b")
                .await
                .is_some_and(|r| r.missing_mark.is_some())
    });
    // Stay paused a while longer (still well within the grace): a reclaimer that ignored the
    // grace would release node-b now.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        runtime.block_on(registration(&store, "node-b")).is_some(),
        "node-b was reclaimed before its grace period had passed"
    );
    agent_b.signal("CONT");
    wait_until(
        &runtime,
        "node-b is live again, its mark cleared",
        || async {
            is_live(&store, "node-b").await
                && registration(&store, "node-b")
                    .await
                    .is_some_and(|r| r.missing_mark.is_none())
        },
    );

    let log_b = agent_b.log();
    assert!(
        log_b.contains("the lease expired") && log_b.contains("registered again"),
        "node-b did not take a new lease and register again after its pause:\n{log_b}"
    );

    // a: its blocks reclaimed once the grace has passed; its addresses kept (silence is no
    // evidence that its pods are gone).
    wait_until(&runtime, "node-a is reclaimed", || async {
        registration(&store, "node-a")
            .await
            .is_some_and(|r| r.blocks_released)
            && blocks_of(&store, "node-a").await == 0
    });
    assert_eq!(runtime.block_on(addresses_of(&store, "node-a")), 2);
    let logs = format!("{}\n{}", agent_b.log(), agent_c.log());
    assert!(
        logs.lines()
            .any(|l| l.contains("dead node reclaimed") && l.contains("node-a")),
        "no reclaimer logged the release of node-a:\n{logs}"
    );

    // b, c and the agent-less node x keep everything; b and c are registered and live.
    for node in ["node-b", "node-c", "node-x"] {
        assert_eq!(runtime.block_on(addresses_of(&store, node)), 2, "{node}");
        assert_eq!(runtime.block_on(blocks_of(&store, node)), 1, "{node}");
    }
    for node in ["node-b", "node-c"] {
        assert!(runtime.block_on(is_live(&store, node)), "{node} not live");
        assert!(
            runtime.block_on(registration(&store, node)).is_some(),
            "{node} lost its registration"
        );
    }
    assert!(runtime.block_on(registration(&store, "node-x")).is_none());
    assert!(
        !logs
            .lines()
            .any(|l| l.contains("dead node reclaimed") && !l.contains("node-a")),
        "another node was reclaimed:\n{logs}"
    );

    // The store is consistent.
    let (status, output) = ctl(&endpoints, &prefix, &["check"]);
    assert_eq!(status, 0, "check: {output}");
    drop(agents);
    drop(cluster);
}

/// The reclaimer leader releases, by itself, the empty blocks hosts no longer need: a node's
/// empty blocks beyond its newest one go once empty for `--empty-block-release-seconds`; the
/// newest stays, and so does a block in use.
#[test]
fn the_reclaimer_leader_releases_empty_blocks_beyond_each_hosts_newest() {
    let cluster = EtcdCluster::start(1).expect("an etcd (package etcd-server)");
    let endpoints = cluster.endpoints().join(",");
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    let (runtime, store) = connect(&cluster, &prefix);
    // node-q (no agent) gets three /30 blocks and empties them; node-r keeps one in use.
    let ipam = Ipam::new(Arc::clone(&store));
    runtime.block_on(async {
        ipam.create_pool(&ipam_core::PoolSpec {
            cidr: "10.77.0.0/27".parse().expect("cidr"),
            name: Some("small".into()),
            block_size: Some(30),
            disabled: false,
        })
        .await
        .expect("pool");
        ipam.update_config(|c| c.max_blocks_per_host = 0)
            .await
            .expect("config");
        let many = ipam_core::AutoAssignRequest {
            handle: "q-pods".into(),
            host: "node-q".into(),
            num_v4: 9,
            ..Default::default()
        };
        ipam.auto_assign(&many).await.expect("node-q's addresses");
        ipam.release_handle("q-pods")
            .await
            .expect("release node-q's");
        let one = ipam_core::AutoAssignRequest {
            handle: "r-pod".into(),
            host: "node-r".into(),
            num_v4: 1,
            ..Default::default()
        };
        ipam.auto_assign(&one).await.expect("node-r's address");
    });
    assert_eq!(runtime.block_on(blocks_of(&store, "node-q")), 3);

    let agent = Agent::start_with(
        "node-a",
        &dir.path().join("a.sock"),
        &endpoints,
        &prefix,
        &["--empty-block-release-seconds", "1"],
    );
    wait_until(&runtime, "node-q is down to its newest block", || async {
        blocks_of(&store, "node-q").await == 1
    });
    // The pass logs its summary after its last delete commits: wait for the line, not the store.
    wait_until(&runtime, "the agent logs the release", || {
        let logged = agent.log().contains("released empty blocks");
        async move { logged }
    });
    // A few more passes change nothing: the newest block and node-r's block in use stay.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(runtime.block_on(blocks_of(&store, "node-q")), 1);
    assert_eq!(runtime.block_on(blocks_of(&store, "node-r")), 1);
    // The summary is logged by the passes that released something, with their count: two in all.
    let log = agent.log();
    let counts: Vec<u64> = log
        .lines()
        .filter(|line| line.contains("released empty blocks"))
        .map(|line| {
            line.split_once("released=")
                .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|digits| digits.parse().ok())
                .unwrap_or_else(|| panic!("no count in {line:?}"))
        })
        .collect();
    assert!(
        counts.iter().all(|released| *released > 0) && counts.iter().sum::<u64>() == 2,
        "expected the two releases, each pass's line with its count: {counts:?}\n{log}"
    );
    assert_eq!(runtime.block_on(addresses_of(&store, "node-r")), 1);
    let report = runtime.block_on(ipam.check(false)).expect("check");
    assert!(report.problems.is_empty(), "{:#?}", report.problems);
}

/// The node's runtime at work: `pairs` ADD/DEL pairs of a short-lived pod, one about every
/// second, each answered 0 (with the agent down the plugin goes to etcd itself).
fn runtime_keeps_calling(node: &str, conf: &Value, round: &str, pairs: usize) {
    for i in 0..pairs {
        std::thread::sleep(Duration::from_millis(900));
        let container = format!("{node}-{round}-churn{i}");
        added_address(&container, conf);
        let run = common::run_plugin("DEL", &container, conf, WAIT_LIMIT);
        assert_eq!(run.status, 0, "DEL {container}: {}", run.stdout);
    }
}

/// The operator's scenario: one etcd, two agents with short liveness settings, a pool of one
/// block, three pods running on node-b. node-b's agent is stopped (SIGTERM) and later killed
/// (SIGKILL, socket left behind) while node-b's runtime keeps calling the plugin; node-a's
/// reclaimer runs all along, and node-a's pods borrow from node-b's block. node-b's running pods
/// keep their addresses and node-a is never handed one of them. Then node-b goes quiet for good
/// (no agent, no calls): it is reclaimed after one countdown.
#[test]
fn a_node_whose_agent_is_stopped_or_killed_while_its_runtime_keeps_calling_is_never_reclaimed() {
    const GRACE: &str = "4";
    let cluster = EtcdCluster::start(1).expect("an etcd (package etcd-server)");
    let endpoints = cluster.endpoints().join(",");
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    let (runtime, store) = connect(&cluster, &prefix);
    let socket = |node: &str| dir.path().join(format!("{node}.sock"));
    let conf = |node: &str| {
        netconf_with_pool(
            node,
            &socket(node).display().to_string(),
            &endpoints,
            &prefix,
            &dir.path().join(format!("{node}.lock")),
            "10.89.0.0/26",
        )
    };
    let agent_a =
        Agent::start_with_grace("node-a", &socket("node-a"), &endpoints, &prefix, GRACE, &[]);
    let mut agent_b =
        Agent::start_with_grace("node-b", &socket("node-b"), &endpoints, &prefix, GRACE, &[]);
    for node in ["node-a", "node-b"] {
        wait_until(
            &runtime,
            &format!("{node} is registered and live"),
            || async { registration(&store, node).await.is_some() && is_live(&store, node).await },
        );
    }
    let running: Vec<String> = (0..3)
        .map(|pod| added_address(&format!("node-b-pod{pod}"), &conf("node-b")))
        .collect();
    let held_before = runtime.block_on(held_by(&store, "node-b"));
    assert_eq!(held_before.len(), 3, "{held_before:?}");

    let mut handed_to_a = Vec::new();
    for (round, signal) in [("stopped", "TERM"), ("killed", "KILL")] {
        agent_b.signal(signal);
        let _ = agent_b.child.wait();
        assert_eq!(
            socket("node-b").exists(),
            signal == "KILL",
            "a stopped agent removes its socket, a killed one leaves it"
        );
        wait_until(&runtime, "node-b's liveness key is gone", || async {
            !is_live(&store, "node-b").await
        });
        // Four countdowns' worth of the runtime at work, node-a allocating between its calls; the
        // checks follow node-b's last call at once, so no gap between calls is much longer than a
        // second, well inside the countdown even on a loaded machine.
        for pod in 0..3 {
            runtime_keeps_calling("node-b", &conf("node-b"), &format!("{round}{pod}"), 4);
            handed_to_a.push(added_address(
                &format!("node-a-{round}{pod}"),
                &conf("node-a"),
            ));
        }
        runtime_keeps_calling("node-b", &conf("node-b"), &format!("{round}-last"), 4);
        let held = runtime.block_on(held_by(&store, "node-b"));
        for (handle, ip) in &held_before {
            assert_eq!(
                held.get(handle),
                Some(ip),
                "after the agent was {round}: a running pod of node-b lost its address \
                 (reclaimer log:\n{})",
                agent_a.log()
            );
        }
        assert!(
            runtime.block_on(registration(&store, "node-b")).is_some(),
            "node-b was reclaimed while its runtime kept calling (agent {round})"
        );
        assert!(
            !agent_a.log().contains("dead node reclaimed"),
            "a reclaim happened: {}",
            agent_a.log()
        );
        if signal == "TERM" {
            agent_b = Agent::start_with_grace(
                "node-b",
                &socket("node-b"),
                &endpoints,
                &prefix,
                GRACE,
                &[],
            );
            wait_until(&runtime, "node-b's agent is back", || async {
                is_live(&store, "node-b").await
            });
        }
    }
    for ip in &handed_to_a {
        assert!(
            !running.contains(ip),
            "node-a was handed {ip}, which a running pod of node-b holds"
        );
    }
    // node-b was marked missing once per time its agent went away, and then marked again from
    // its plugin's activity at the passes that found it active: never cleared to be found
    // missing and marked once more while its agent stayed down.
    let log = agent_a.log();
    let lines_about_b = |text: &str| {
        log.lines()
            .filter(|l| l.contains(text) && l.contains("node-b"))
            .count()
    };
    assert_eq!(
        lines_about_b("liveness key is gone: grace countdown started"),
        2,
        "{log}"
    );
    assert!(
        lines_about_b("grace countdown started again from the activity seen") > 0,
        "{log}"
    );

    // Now node-b is really gone: no agent, no calls. One countdown later its blocks are
    // reclaimed; its addresses are kept until someone who knows its pods are gone releases them.
    wait_until(
        &runtime,
        "node-b is reclaimed once it went quiet",
        || async {
            registration(&store, "node-b")
                .await
                .is_some_and(|r| r.blocks_released)
                && blocks_of(&store, "node-b").await == 0
        },
    );
    assert_eq!(runtime.block_on(held_by(&store, "node-b")), held_before);
    let (status, output) = ctl(
        &endpoints,
        &prefix,
        &["-o", "json", "node", "release", "node-b", "--addresses"],
    );
    assert_eq!(status, 0, "node release: {output}");
    assert!(runtime.block_on(held_by(&store, "node-b")).is_empty());
    assert!(runtime.block_on(registration(&store, "node-b")).is_none());
    assert!(
        agent_a
            .log()
            .lines()
            .any(|l| l.contains("dead node reclaimed") && l.contains("node-b")),
        "{}",
        agent_a.log()
    );
    drop(agent_b);
    drop(agent_a);
    drop(cluster);
}

/// Two agents started with the same node name (a second unit, a container beside the host's):
/// the one that stops cleanly revokes its lease, which deletes the node's shared liveness key.
/// The other puts the key back on its own lease, and the node is never reclaimed.
#[test]
fn two_agents_of_one_node_name_one_stopping_never_gets_the_node_reclaimed() {
    const GRACE: &str = "3";
    let cluster = EtcdCluster::start(1).expect("an etcd (package etcd-server)");
    let endpoints = cluster.endpoints().join(",");
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    let (runtime, store) = connect(&cluster, &prefix);
    let ipam = Ipam::new(Arc::clone(&store));
    runtime.block_on(async {
        ipam.create_pool(&ipam_core::PoolSpec {
            cidr: "10.90.0.0/24".parse().expect("cidr"),
            name: Some("twins".into()),
            block_size: Some(26),
            disabled: false,
        })
        .await
        .expect("pool");
        ipam.auto_assign(&ipam_core::AutoAssignRequest {
            handle: "twin-pod".into(),
            host: "node-t".into(),
            num_v4: 1,
            ..Default::default()
        })
        .await
        .expect("an address of node-t");
    });
    let registered = || async {
        store
            .get(&agent_key("node-t"))
            .await
            .expect("read the registration")
            .map(|kv| kv.revision)
    };
    let first = Agent::start_with_grace(
        "node-t",
        &dir.path().join("first.sock"),
        &endpoints,
        &prefix,
        GRACE,
        &[],
    );
    wait_until(&runtime, "node-t is registered and live", || async {
        registered().await.is_some() && is_live(&store, "node-t").await
    });
    let first_registration = runtime.block_on(registered());
    let second = Agent::start_with_grace(
        "node-t",
        &dir.path().join("second.sock"),
        &endpoints,
        &prefix,
        GRACE,
        &[],
    );
    // The second agent puts the liveness key on its own lease, then registers: from then on the
    // key goes with the second agent's lease. It stops cleanly, revoking that lease.
    wait_until(&runtime, "the second agent registered node-t", || async {
        registered().await != first_registration
    });
    second.signal("TERM");
    wait_until(
        &runtime,
        "the first agent puts the liveness key back",
        || async { is_live(&store, "node-t").await },
    );
    // Three graces later: still registered, still holding its address.
    std::thread::sleep(Duration::from_secs(9));
    assert!(runtime.block_on(is_live(&store, "node-t")));
    assert!(
        runtime.block_on(registration(&store, "node-t")).is_some(),
        "node-t was reclaimed while an agent of it runs:\n{}",
        first.log()
    );
    assert_eq!(runtime.block_on(addresses_of(&store, "node-t")), 1);
    assert!(
        first.log().contains("putting it again"),
        "the first agent did not notice the key was gone:\n{}",
        first.log()
    );
    drop(first);
    drop(second);
}

/// A stopped agent (SIGTERM) revokes its lease on the way out: its node's liveness key is gone
/// when the process has exited, not a TTL later (here ten minutes), so the reclaimers start the
/// grace countdown at once; its registration, with the time it was made, stays. While the agent
/// runs on one lease, its registration is not written again.
#[test]
fn a_stopped_agent_takes_its_liveness_key_away_at_once_and_leaves_its_registration() {
    let cluster = EtcdCluster::start(1).expect("an etcd (package etcd-server)");
    let endpoints = cluster.endpoints().join(",");
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    let (runtime, store) = connect(&cluster, &prefix);
    let before = test_kit::unix_now();
    let mut agent = Agent::start_with(
        "node-s",
        &dir.path().join("node-s.sock"),
        &endpoints,
        &prefix,
        &["--liveness-ttl-seconds", "600"],
    );
    wait_until(&runtime, "node-s is registered and live", || async {
        registration(&store, "node-s").await.is_some() && is_live(&store, "node-s").await
    });
    let after = test_kit::unix_now();
    let registered = runtime
        .block_on(registration(&store, "node-s"))
        .expect("node-s's registration");
    assert!(
        (before..=after).contains(&registered.registered_at),
        "registered at {}, not between {before} and {after}",
        registered.registered_at
    );
    // The agent writes its registration when it takes a lease, not at every look (one a second
    // here): over three looks on one lease, the key stays at its revision.
    let revision = || {
        runtime
            .block_on(store.get(&agent_key("node-s")))
            .expect("read the registration")
            .map(|kv| kv.revision)
    };
    let first_revision = revision();
    std::thread::sleep(Duration::from_millis(3_500));
    assert_eq!(
        revision(),
        first_revision,
        "the registration was written again on the same lease:\n{}",
        agent.log()
    );
    agent.signal("TERM");
    let status = agent.child.wait().expect("the agent's exit");
    assert!(
        status.success(),
        "exit after SIGTERM: {status}\n{}",
        agent.log()
    );
    assert!(
        !runtime.block_on(is_live(&store, "node-s")),
        "the liveness key outlived the stopped agent (its lease was not revoked):\n{}",
        agent.log()
    );
    assert_eq!(
        runtime.block_on(registration(&store, "node-s")),
        Some(registered),
        "a stop leaves the registration as it was"
    );
}

/// etcd unreachable when the agent starts (a node booting before its etcd): the agent serves its
/// socket anyway and registers its node once etcd answers.
#[test]
fn an_agent_started_while_etcd_is_down_serves_and_registers_once_etcd_is_back() {
    let mut server = test_kit::etcd::EtcdServer::start().expect("an etcd server");
    let endpoint = server.endpoint();
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    server.stop();
    let agent = Agent::start(
        "node-boot",
        &dir.path().join("boot.sock"),
        &endpoint,
        &prefix,
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    wait_until(&runtime, "the agent says it waits for etcd", || {
        let said = agent.log().contains("the node is not registered yet");
        async move { said }
    });
    server.restart().expect("restart etcd");
    let store: Arc<dyn KvStore> = Arc::new(
        runtime
            .block_on(EtcdStore::connect(server.config(&prefix)))
            .expect("connect to the restarted etcd"),
    );
    wait_until(&runtime, "node-boot is registered and live", || async {
        registration(&store, "node-boot").await.is_some() && is_live(&store, "node-boot").await
    });
    drop(agent);
}

/// A node cut off from etcd (its agent and plugin reach etcd through a proxy the test cuts) for
/// longer than the liveness TTL and the grace: from etcd it looks exactly like a node that
/// vanished, but its pods run on. Its blocks are reclaimed; its running pods' addresses are kept,
/// and node-a, taking everything the one-block pool has left, is never handed one of them. When
/// the link heals, node-b's agent registers again, the reclaim's marks are cleared, and its
/// runtime's DELs release its pods' addresses.
#[test]
fn a_node_cut_off_from_etcd_past_the_grace_keeps_its_running_pods_addresses() {
    const GRACE: &str = "3";
    let cluster = EtcdCluster::start(1).expect("an etcd (package etcd-server)");
    let endpoints = cluster.endpoints().join(",");
    let proxy = PartitionProxy::start(&cluster.endpoints()[0]);
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    let (runtime, store) = connect(&cluster, &prefix);
    let socket = |node: &str| dir.path().join(format!("{node}.sock"));
    let conf = |node: &str, endpoints: &str| {
        netconf_with_pool(
            node,
            &socket(node).display().to_string(),
            endpoints,
            &prefix,
            &dir.path().join(format!("{node}.lock")),
            "10.91.0.0/26",
        )
    };
    let conf_a = conf("node-a", &endpoints);
    let conf_b = conf("node-b", &proxy.endpoint());
    let leading = |agent: &Agent| {
        common::sample(
            &common::scrape(&agent.log()),
            "blockipam_agent_reclaimer_leader",
        )
    };
    let registered = |agent: &Agent| {
        common::sample(
            &common::scrape(&agent.log()),
            "blockipam_agent_node_registered",
        )
    };
    // node-b's agent first: it takes the reclaimer leadership, and says so. (One computation of
    // its store gauges, while etcd answers: later scrapes, while it is cut off, reuse it.)
    let agent_b = Agent::start_with_grace(
        "node-b",
        &socket("node-b"),
        &proxy.endpoint(),
        &prefix,
        GRACE,
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-cache-seconds",
            "3600",
        ],
    );
    wait_for_sample(
        || leading(&agent_b),
        1.0,
        "node-b's agent leads the reclaim",
    );
    let agent_a = Agent::start_with_grace(
        "node-a",
        &socket("node-a"),
        &endpoints,
        &prefix,
        GRACE,
        &["--metrics-listen", "127.0.0.1:0"],
    );
    for node in ["node-a", "node-b"] {
        wait_until(
            &runtime,
            &format!("{node} is registered and live"),
            || async { registration(&store, node).await.is_some() && is_live(&store, node).await },
        );
    }
    // node-a's agent finds the leader key taken, at each of its passes (one a second).
    wait_for_sample(|| registered(&agent_a), 1.0, "node-a's agent is registered");
    // Registered once per lease: two passes later neither registration was written again.
    let registrations = || {
        ["node-a", "node-b"].map(|node| {
            runtime
                .block_on(store.get(&agent_key(node)))
                .expect("read a registration")
                .map(|kv| kv.revision)
        })
    };
    let registered_before = registrations();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        registrations(),
        registered_before,
        "an agent registered its node again on the lease it has"
    );
    assert_eq!(
        leading(&agent_a),
        0.0,
        "node-a's agent leads beside node-b's"
    );
    assert_eq!(leading(&agent_b), 1.0, "node-b's agent stopped leading");
    let running: Vec<String> = (0..3)
        .map(|pod| added_address(&format!("node-b-pod{pod}"), &conf_b))
        .collect();
    let held_before = runtime.block_on(held_by(&store, "node-b"));
    assert_eq!(held_before.len(), 3, "{held_before:?}");

    proxy.cut();
    wait_until(
        &runtime,
        "node-b, cut off, is reclaimed (its blocks released)",
        || async {
            registration(&store, "node-b")
                .await
                .is_some_and(|r| r.blocks_released)
                && blocks_of(&store, "node-b").await == 0
        },
    );
    assert!(
        agent_a
            .log()
            .lines()
            .any(|l| l.contains("dead node reclaimed")
                && l.contains("node-b")
                && l.contains("addresses are kept")),
        "{}",
        agent_a.log()
    );
    assert_eq!(runtime.block_on(held_by(&store, "node-b")), held_before);
    // The leadership moved: node-a's agent holds it; node-b's, cut off, no longer says it does.
    assert_eq!(
        leading(&agent_a),
        1.0,
        "node-a's agent reclaimed without leading"
    );
    wait_for_sample(
        || leading(&agent_b),
        0.0,
        "node-b's agent, cut off, stops leading",
    );
    wait_for_sample(
        || registered(&agent_b),
        0.0,
        "node-b's agent, its lease lost, no longer says its node is registered",
    );
    // node-a's agent, the only one that could reclaim, counts what it did (its counters move
    // once the pass that wrote the mark has returned): one node, its one block, no address.
    let deadline = std::time::Instant::now() + WAIT_LIMIT;
    let metrics = loop {
        let metrics = common::scrape(&agent_a.log());
        if common::sample(&metrics, "blockipam_agent_dead_nodes_reclaimed_total") > 0.0
            || std::time::Instant::now() >= deadline
        {
            break metrics;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    for (counter, expected) in [
        ("blockipam_agent_dead_nodes_reclaimed_total", 1.0),
        ("blockipam_agent_dead_node_blocks_released_total", 1.0),
    ] {
        assert!(
            metrics
                .lines()
                .any(|line| line.starts_with(&format!("{counter} "))),
            "no {counter} in:\n{metrics}"
        );
        assert_eq!(
            common::sample(&metrics, counter),
            expected,
            "{counter} in:\n{metrics}"
        );
    }
    // A reclaim keeps the node's addresses: it counts no reclaimed address (Calico's counter,
    // which counts the leak collection's releases, has no sample).
    assert!(
        !metrics.contains("\nipam_allocations_gc_reclamations_total"),
        "{metrics}"
    );
    // Its last pass found the two registered nodes: node-a alive, node-b in whatever state the
    // reclaim had it (missing, dead or reclaimed).
    let by_state: Vec<f64> = NODE_STATES
        .iter()
        .map(|state| {
            common::sample(
                &metrics,
                &format!("blockipam_agent_nodes{{state=\"{state}\"}}"),
            )
        })
        .collect();
    assert_eq!(
        (by_state[0], by_state.iter().sum::<f64>()),
        (1.0, 2.0),
        "node states {NODE_STATES:?} = {by_state:?} in:\n{metrics}"
    );

    // node-a takes everything the pool has left.
    let mut handed_to_a = Vec::new();
    let exhausted = loop {
        let container = format!("node-a-pod{}", handed_to_a.len());
        let (status, stdout) = cni_add(&container, &conf_a);
        if status != 0 {
            break stdout;
        }
        let result: Value = serde_json::from_str(&stdout).expect("an ADD result");
        let address = result["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .expect("an address")
            .to_owned();
        assert!(
            !running.contains(&address),
            "node-a was handed {address}, which a running pod of node-b holds"
        );
        handed_to_a.push(address);
        assert!(handed_to_a.len() <= 64, "more addresses than a /26 has");
    };
    // Every address the plugin hands out is now held, by node-a or by node-b's running pods: all
    // of the block's 64 but its network and last addresses.
    assert_eq!(
        handed_to_a.len() + held_before.len(),
        64 - 2,
        "the pool ran out early: {exhausted}"
    );
    assert_eq!(runtime.block_on(held_by(&store, "node-b")), held_before);

    // The link heals: node-b's agent takes a new lease and registers again (a registration made
    // after the heal, not only marks a reclaimer cleared); the marks go.
    // (The time is taken before the heal: a stall between the two cannot put it after the
    // registration.)
    let healed_at = test_kit::unix_now();
    proxy.heal();
    wait_until(
        &runtime,
        "node-b is live and registered again, the reclaim's marks cleared",
        || async {
            is_live(&store, "node-b").await
                && registration(&store, "node-b").await.is_some_and(|r| {
                    r.registered_at >= healed_at && !r.blocks_released && r.missing_mark.is_none()
                })
        },
    );
    wait_for_sample(
        || registered(&agent_b),
        1.0,
        "node-b's agent, registered again, says so",
    );
    // node-b's runtime tears its pods down: each DEL releases its address.
    for pod in 0..3 {
        let run = common::run_plugin("DEL", &format!("node-b-pod{pod}"), &conf_b, WAIT_LIMIT);
        assert_eq!(run.status, 0, "DEL node-b-pod{pod}: {}", run.stdout);
    }
    assert!(runtime.block_on(held_by(&store, "node-b")).is_empty());
    let (status, output) = ctl(&endpoints, &prefix, &["check"]);
    assert_eq!(status, 0, "check: {output}");
    drop(agent_b);
    drop(agent_a);
    drop(proxy);
    drop(cluster);
}

/// An agent that keeps crashing and being restarted (killed, left down longer than its lease's TTL
/// so that its liveness key goes and the reclaimer starts a countdown, then started again) never
/// gets its node reclaimed, however long it loops past the grace: each start registers the node
/// again, which clears the mark before the countdown runs out. Its pod keeps its block and address.
#[test]
fn a_crash_looping_agents_node_is_never_reclaimed() {
    // Eight seconds: each cycle is down about a second past its mark, then starts the agent
    // again; the rest of the grace is margin for a slow start on a loaded machine.
    const GRACE: &str = "8";
    const CYCLES: usize = 6;
    let cluster = EtcdCluster::start(1).expect("an etcd (package etcd-server)");
    let endpoints = cluster.endpoints().join(",");
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().expect("temp dir");
    let (runtime, store) = connect(&cluster, &prefix);
    let socket = |node: &str| dir.path().join(format!("{node}.sock"));
    // node-a's agent stays up and leads the reclaim.
    let agent_a =
        Agent::start_with_grace("node-a", &socket("node-a"), &endpoints, &prefix, GRACE, &[]);
    let start_b =
        || Agent::start_with_grace("node-b", &socket("node-b"), &endpoints, &prefix, GRACE, &[]);
    let registered_and_live = |node: &'static str| {
        wait_until(
            &runtime,
            &format!("{node} is registered and live, unmarked"),
            || async {
                is_live(&store, node).await
                    && registration(&store, node)
                        .await
                        .is_some_and(|r| r.missing_mark.is_none())
            },
        );
    };
    let mut agent_b = start_b();
    registered_and_live("node-a");
    registered_and_live("node-b");
    let conf_b = netconf(
        "node-b",
        &socket("node-b").display().to_string(),
        &endpoints,
        &prefix,
        &dir.path().join("node-b.lock"),
    );
    let (status, stdout) = cni_add("node-b-pod", &conf_b);
    assert_eq!(status, 0, "ADD on node-b: {stdout}");

    let mut marked = 0;
    for cycle in 0..CYCLES {
        agent_b.signal("KILL");
        drop(agent_b);
        // Down until its liveness key is gone and the reclaimer marked the node (a countdown of
        // the grace runs), then as long again: well within the grace, never past it.
        wait_until(
            &runtime,
            &format!("cycle {cycle}: node-b is marked missing"),
            || async {
                !is_live(&store, "node-b").await
                    && registration(&store, "node-b")
                        .await
                        .is_some_and(|r| r.missing_mark.is_some())
            },
        );
        marked += 1;
        std::thread::sleep(Duration::from_secs(1));
        let held = runtime.block_on(registration(&store, "node-b"));
        assert!(
            held.as_ref().is_some_and(|r| !r.blocks_released),
            "cycle {cycle}: node-b was reclaimed while its agent crash-loops: {held:?}"
        );
        agent_b = start_b();
        registered_and_live("node-b");
    }
    assert_eq!(marked, CYCLES);
    // Another grace and more after the last start: still nothing reclaimed.
    std::thread::sleep(Duration::from_secs(9));
    let held = runtime.block_on(registration(&store, "node-b"));
    assert!(
        held.as_ref().is_some_and(|r| !r.blocks_released),
        "{held:?}"
    );
    assert_eq!(runtime.block_on(blocks_of(&store, "node-b")), 1);
    assert_eq!(runtime.block_on(addresses_of(&store, "node-b")), 1);
    assert!(
        !agent_a.log().contains("dead node reclaimed"),
        "{}",
        agent_a.log()
    );
    drop(agent_b);
    drop(agent_a);
}

/// Waits (bounded) until `sample` reads `wanted`.
fn wait_for_sample(sample: impl Fn() -> f64, wanted: f64, what: &str) {
    let deadline = std::time::Instant::now() + WAIT_LIMIT;
    loop {
        let value = sample();
        if value == wanted {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: still {value}, not {wanted}, after {WAIT_LIMIT:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
