//! Through an agent serving etcd, the netconf's etcd credentials are not used: the agent's own are.

mod common;

use std::time::Duration;

use common::etcd_agents::{netconf, Agent};
use test_kit::etcd::EtcdServer;

const PREFIX: &str = "/credentials/";

/// On an etcd with authentication on, a netconf with a wrong password succeeds through an agent
/// that serves the same endpoints and prefix with the right one (the plugin's log says so), and
/// fails when it opens etcd itself: the agent matches stores by endpoints and prefix only.
#[test]
fn a_netconf_with_wrong_etcd_credentials_succeeds_through_an_agent_with_its_own() {
    let server = EtcdServer::start().expect("start etcd");
    server
        .enable_auth(None, "root-pw", "agent-user", "agent-pw", PREFIX)
        .expect("enable etcd authentication");
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    let endpoint = server.endpoint();
    let agent = Agent::start_with(
        "node-a",
        &socket,
        &endpoint,
        PREFIX,
        &[
            "--etcd-username",
            "agent-user",
            "--etcd-password",
            "agent-pw",
        ],
    );
    let lock = dir.path().join("ipam.lock");
    let with_wrong_password = |socket: &str| {
        let mut conf = netconf("node-a", socket, &endpoint, PREFIX, &lock);
        conf["ipam"]["etcd_username"] = "agent-user".into();
        conf["ipam"]["etcd_password"] = "wrong-password".into();
        conf
    };

    let through_agent = with_wrong_password(&socket.display().to_string());
    let add = common::run_plugin("ADD", "ctr-cred", &through_agent, Duration::from_secs(60));
    let result = add.success_json("ADD with wrong credentials through the agent");
    assert_eq!(
        test_kit::cni::result_addresses(&result).len(),
        1,
        "{add:#?}"
    );
    assert!(
        add.stderr.contains(&format!(
            "store reached through the agent at {}",
            socket.display()
        )) && add
            .stderr
            .contains("the agent's own etcd credentials and TLS files are used"),
        "{add:#?}"
    );

    // The same netconf opening etcd itself is refused: its credentials really are wrong.
    let direct = common::run_plugin(
        "ADD",
        "ctr-cred-direct",
        &with_wrong_password(""),
        Duration::from_secs(60),
    );
    assert_ne!(
        direct.status, 0,
        "wrong credentials were accepted: {direct:#?}"
    );
    assert!(
        direct.stdout.contains("authentication failed"),
        "{direct:#?}"
    );

    let del = common::run_plugin("DEL", "ctr-cred", &through_agent, Duration::from_secs(60));
    del.assert_silent_success("DEL through the agent");
    drop(agent);
}
