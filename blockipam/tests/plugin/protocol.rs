//! CNI protocol tests through the real binary: every command, every spec version, every error code.
//!
//! The CNI protocol through the real binary: every command at every spec version with exact
//! result shapes, VERSION and the about text, and every error code path, with the store
//! unchanged after each failed ADD.
//!
//! Every test that reaches a store runs twice (see [`in_both_modes!`]): `direct::NAME`, the
//! plugin opening the sandbox's store itself, and `agent::NAME`, the plugin reaching it through
//! a `blockipam-agent` that holds it (netconf `agent_socket`). In agent mode the agent holds the
//! store's lock, so the plugin cannot have opened the store itself; the test
//! `agent_mode_reaches_the_store_only_through_the_agent` shows that directly. The tests that
//! never reach a store (VERSION, the about line, errors before any netconf is read) run once.

use crate::common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use ipam_core::lockfile::LockFile;
use ipam_core::IpamConfig;
use serde_json::{json, Value};

const V4: &str = "10.244.7.64/24";
const V6: &str = "fd00:10:244::c0/120";
const GW4: &str = "10.244.7.1";
const GW6: &str = "fd00:10:244::1";

/// Emits one `#[test]` per mode for each function named: `direct::NAME` calls `NAME(Mode::Direct)`,
/// `agent::NAME` calls `NAME(Mode::Agent)`.
macro_rules! in_both_modes {
    ($($name:ident),* $(,)?) => {
        mod direct {
            $(
                #[test]
                fn $name() {
                    super::$name(super::Mode::Direct)
                }
            )*
        }
        mod agent {
            $(
                #[test]
                fn $name() {
                    super::$name(super::Mode::Agent)
                }
            )*
        }
    };
}

in_both_modes! {
    an_add_passing_over_a_full_block_it_cannot_decode_warns_naming_it,
    add_result_has_the_exact_shape_of_every_spec_version,
    del_prints_nothing_at_every_spec_version_and_releases_the_attachment,
    check_passes_silently_from_0_4_0_and_is_refused_with_code_1_below,
    gc_and_status_work_at_1_1_0_and_are_refused_with_code_1_below,
    success_prints_only_the_result_on_stdout_and_logs_on_stderr,
    log_file_path_takes_the_logs_off_stderr,
    a_symlink_at_log_file_path_is_never_followed_and_the_call_logs_to_stderr,
    log_level_error_keeps_a_successful_call_quiet,
    missing_environment_variables_are_code_4_naming_each_of_them,
    unknown_command_and_invalid_container_id_or_ifname_are_code_4,
    unknown_cni_args_key_is_code_4_unless_ignore_unknown_is_set,
    unsupported_spec_versions_are_code_1_listing_what_is_supported,
    known_keys_with_wrong_types_are_code_7_naming_the_key,
    unknown_netconf_keys_are_ignored,
    unsupported_values_are_code_2_naming_key_and_value,
    bad_cidrs_and_block_sizes_in_pools_are_code_7,
    netconf_pools_that_could_not_all_exist_are_code_7_and_create_nothing,
    asking_for_no_address_at_all_is_code_7,
    address_outside_every_pool_is_code_103_and_changes_nothing,
    address_held_by_another_container_is_code_102_and_changes_nothing,
    exhausted_pool_is_code_100_and_changes_nothing,
    node_block_limit_is_code_101_and_changes_nothing,
    address_in_another_nodes_block_under_strict_affinity_is_code_104,
    requested_pool_that_is_missing_or_of_the_wrong_family_is_code_105,
    netconf_pool_overlapping_a_different_existing_pool_is_code_106,
    new_netconf_pool_in_a_link_local_range_is_code_7_and_changes_nothing,
    host_lock_held_beyond_the_wait_is_code_11_and_changes_nothing,
    store_path_holding_something_else_is_code_108_and_is_left_alone,
    failed_first_add_on_a_fresh_store_leaves_only_the_networks_pools_and_reservations,
    check_of_an_address_not_held_by_the_attachment_is_code_107,
    gc_without_valid_attachments_is_code_7,
    status_is_code_50_when_this_node_cannot_get_an_address,
    status_is_code_50_when_the_store_cannot_be_opened,
    status_answers_past_an_object_no_add_of_the_node_reads_and_names_one_they_all_read,
    status_counts_a_block_it_cannot_decode_as_taken,
    status_speaks_for_the_next_add_in_every_choice_of_pool,
    status_speaks_for_the_next_add_at_block_edges_and_when_borrowing,
    status_counts_the_free_addresses_the_network_set_up_reserves_in_claimed_blocks_as_taken,
    errors_carry_the_requests_spec_version,
    log_file_is_created_owner_only_and_an_existing_files_mode_is_kept,
    gc_with_null_valid_attachments_releases_everything_of_the_network_on_this_node,
    gc_collects_past_a_block_it_cannot_decode_and_reports_it,
    gc_collects_past_an_owner_key_it_cannot_decode_and_reports_it,
    check_compares_exactly_what_the_attachment_holds_with_prev_result,
    status_is_code_11_while_another_call_holds_the_node_lock,
}

#[test]
fn agent_mode_reaches_the_store_only_through_the_agent() {
    let sandbox = Sandbox::in_mode(Mode::Agent);
    let netconf = sandbox.netconf("1.0.0", json!({}));
    assert!(sandbox.agent_serving(), "the netconf started the agent");
    let held = first_address(&cni("ADD", "c1", "eth0", &netconf, &[]).success_json("ADD"));
    // The agent holds the store: nothing else can open it while it serves.
    let direct = block_on(
        blockipam_store::DatastoreSettings {
            backend: blockipam_store::Backend::embedded(
                sandbox.store_type,
                Some(sandbox.store_path()),
            )
            .expect("an embedded store type"),
            lock_wait: Duration::ZERO,
            agent_socket: None,
            ..blockipam_store::DatastoreSettings::default()
        }
        .open(),
    );
    let Err(refusal) = direct else {
        panic!("a direct open beside the agent must fail");
    };
    assert!(refusal.to_string().contains("lock"), "{refusal}");
    // The same plugin told to ignore the agent cannot reach the store: code 11, store locked.
    let without_agent = sandbox.netconf(
        "1.0.0",
        json!({"agent_socket": "none", "ipam_lock_timeout_seconds": 0.2}),
    );
    let msg = cni("ADD", "c2", "eth0", &without_agent, &[]).assert_error(11, "no agent");
    assert!(msg.contains("lock"), "{msg}");
    // A lock wait longer than the call's deadline ends with the deadline (the call cannot return
    // before a store open in progress does): code 11, not a call outliving `timeout_seconds`
    // until the hang guard kills it.
    let wait_beyond_the_deadline = sandbox.netconf(
        "1.0.0",
        json!({
            "agent_socket": "none",
            "ipam_lock_timeout_seconds": 3600,
            "timeout_seconds": 0.5
        }),
    );
    let msg = run_plugin_bounded(
        "ADD",
        "c3",
        &wait_beyond_the_deadline,
        Duration::from_secs(60),
    )
    .assert_error(11, "a lock wait beyond the deadline");
    assert!(msg.contains("lock") || msg.contains("deadline"), "{msg}");
    // What the ADD through the agent wrote is in the store the agent serves.
    let allocations = sandbox.container_allocations();
    assert_eq!(
        allocations,
        vec![(held, "testnet.c1".to_owned(), allocations[0].2.clone())]
    );
}

fn dual_stack() -> Value {
    json!({"assign_ipv6": "true"})
}

fn expected_add_result(version: &str) -> Value {
    match version {
        "0.1.0" | "0.2.0" => json!({
            "cniVersion": version,
            "ip4": {"ip": V4, "gateway": GW4},
            "ip6": {"ip": V6, "gateway": GW6},
            "dns": {}
        }),
        "0.3.0" | "0.3.1" | "0.4.0" => json!({
            "cniVersion": version,
            "ips": [
                {"version": "4", "address": V4, "gateway": GW4},
                {"version": "6", "address": V6, "gateway": GW6}
            ],
            "dns": {}
        }),
        _ => json!({
            "cniVersion": version,
            "ips": [
                {"address": V4, "gateway": GW4},
                {"address": V6, "gateway": GW6}
            ],
            "dns": {}
        }),
    }
}

/// A result of 0.3.0 or later, for `prevResult`.
fn prev_result() -> Value {
    expected_add_result("1.0.0")
}

fn add_result_has_the_exact_shape_of_every_spec_version(mode: Mode) {
    for version in VERSIONS {
        let sandbox = Sandbox::in_mode(mode);
        let netconf = sandbox.netconf(version, dual_stack());
        let result = cni("ADD", "c1", "eth0", &netconf, &[]).success_json(version);
        assert_eq!(result, expected_add_result(version), "spec {version}");
        // The same attachment again: the same answer, nothing new allocated.
        let again = cni("ADD", "c1", "eth0", &netconf, &[]).success_json(version);
        assert_eq!(again, result, "repeated ADD at spec {version}");
        assert_eq!(sandbox.container_allocations().len(), 2, "spec {version}");
    }
}

fn del_prints_nothing_at_every_spec_version_and_releases_the_attachment(mode: Mode) {
    for version in VERSIONS {
        let sandbox = Sandbox::in_mode(mode);
        let netconf = sandbox.netconf(version, dual_stack());
        cni("ADD", "c1", "eth0", &netconf, &[]).success_json(version);
        cni("DEL", "c1", "eth0", &netconf, &[]).assert_silent_success(version);
        assert!(sandbox.container_allocations().is_empty(), "spec {version}");
        // Nothing left to release is still success, however often.
        for _ in 0..2 {
            cni("DEL", "c1", "eth0", &netconf, &[]).assert_silent_success(version);
        }
    }
}

fn check_passes_silently_from_0_4_0_and_is_refused_with_code_1_below(mode: Mode) {
    for version in VERSIONS {
        let sandbox = Sandbox::in_mode(mode);
        let mut netconf = sandbox.netconf(version, dual_stack());
        cni("ADD", "c1", "eth0", &netconf, &[]).success_json(version);
        merge(&mut netconf, json!({"prevResult": prev_result()}));
        let outcome = cni("CHECK", "c1", "eth0", &netconf, &[]);
        if ["0.1.0", "0.2.0", "0.3.0", "0.3.1"].contains(&version) {
            let msg = outcome.assert_error(1, version);
            assert_eq!(msg, "config version does not allow CHECK");
            assert_eq!(outcome.json()["cniVersion"], json!(version));
        } else {
            outcome.assert_silent_success(version);
        }
    }
}

fn gc_and_status_work_at_1_1_0_and_are_refused_with_code_1_below(mode: Mode) {
    for version in VERSIONS {
        let sandbox = Sandbox::in_mode(mode);
        let mut netconf = sandbox.netconf(version, dual_stack());
        cni("ADD", "c1", "eth0", &netconf, &[]).success_json(version);
        merge(&mut netconf, json!({"cni.dev/valid-attachments": []}));
        let gc = cni("GC", "", "", &netconf, &[]);
        let status = cni("STATUS", "", "", &netconf, &[]);
        if version == "1.1.0" {
            gc.assert_silent_success("GC");
            status.assert_silent_success("STATUS");
            assert!(
                sandbox.container_allocations().is_empty(),
                "GC with no valid attachment releases everything of the network on this node"
            );
        } else {
            assert_eq!(
                gc.assert_error(1, version),
                "config version does not allow GC"
            );
            assert_eq!(
                status.assert_error(1, version),
                "config version does not allow STATUS"
            );
            assert_eq!(sandbox.container_allocations().len(), 2, "spec {version}");
        }
    }
}

#[test]
fn version_answers_the_same_at_every_spec_version() {
    let expected = json!({
        "cniVersion": "1.1.0",
        "supportedVersions": ["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
    });
    for version in VERSIONS {
        let stdin = json!({"cniVersion": version}).to_string();
        let outcome = exec(&cni_env("VERSION", "", ""), stdin.as_bytes());
        assert_eq!(outcome.success_json(version), expected);
    }
    let outcome = exec(&cni_env("VERSION", "", ""), b"");
    assert_eq!(outcome.success_json("VERSION, empty stdin"), expected);
}

#[test]
fn version_does_not_wait_for_stdin() {
    // Stdin stays open (never written, never closed) while the plugin runs.
    let mut child = Command::new(plugin_binary())
        .env_clear()
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start");
    let _open_stdin = child.stdin.take();
    let mut stdout = child.stdout.take().expect("stdout");
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        let _ = sender.send(text);
    });
    // A generous bound that only turns a hang into a failure; no duration is asserted.
    let text = receiver.recv_timeout(Duration::from_secs(60));
    let _ = child.kill();
    let _ = child.wait();
    let text = text.expect("VERSION kept waiting for stdin");
    let value: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(value["cniVersion"], json!("1.1.0"));
}

#[test]
fn without_cni_command_one_about_line_goes_to_stderr_and_nothing_to_stdout() {
    let outcome = exec(&[], b"");
    outcome.assert_silent_success("about");
    assert_eq!(outcome.stderr.lines().count(), 1, "{outcome:#?}");
    assert!(outcome.stderr.starts_with("blockipam v"), "{outcome:#?}");
    assert!(outcome.stderr.contains("1.1.0"), "{outcome:#?}");
}

fn success_prints_only_the_result_on_stdout_and_logs_on_stderr(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({"log_level": "debug"}));
    let outcome = cni("ADD", "c1", "eth0", &netconf, &[]);
    outcome.success_json("ADD");
    assert!(outcome.stderr.contains("ADD done"), "{outcome:#?}");
    assert!(!outcome.stdout.contains("ADD done"));
}

fn log_file_path_takes_the_logs_off_stderr(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let log = sandbox.dir.path().join("logs/cni.log");
    let netconf = sandbox.netconf("1.0.0", json!({"log_file_path": log}));
    let outcome = cni("ADD", "c1", "eth0", &netconf, &[]);
    outcome.success_json("ADD");
    assert!(!outcome.stderr.contains("ADD done"), "{outcome:#?}");
    let logged = std::fs::read_to_string(&log).expect("log file");
    assert!(logged.contains("ADD done"), "{logged}");
}

/// A symbolic link planted at `log_file_path` (pointing at a file whoever planted it wants the
/// plugin, running as root, to write) is refused: the file it points at stays as it was, the call
/// still succeeds, and the logs and the reason go to stderr.
fn a_symlink_at_log_file_path_is_never_followed_and_the_call_logs_to_stderr(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let target = sandbox.dir.path().join("precious");
    std::fs::write(&target, "untouched\n").expect("write the target");
    let log = sandbox.dir.path().join("logs/cni.log");
    std::fs::create_dir_all(sandbox.dir.path().join("logs")).expect("log dir");
    std::os::unix::fs::symlink(&target, &log).expect("plant the link");
    let netconf = sandbox.netconf("1.0.0", json!({"log_file_path": log}));
    let outcome = cni("ADD", "c1", "eth0", &netconf, &[]);
    outcome.success_json("ADD");
    assert_eq!(
        std::fs::read_to_string(&target).expect("the target"),
        "untouched\n",
        "the plugin wrote through the link"
    );
    assert!(
        outcome
            .stderr
            .contains(&format!("cannot open log_file_path {}", log.display()))
            && outcome
                .stderr
                .contains("it is a symbolic link, which is never followed")
            && outcome.stderr.contains("ADD done"),
        "the refusal and the logs go to stderr: {outcome:#?}"
    );
    assert!(
        std::fs::symlink_metadata(&log)
            .expect("the link")
            .file_type()
            .is_symlink(),
        "the link is left as it was"
    );
    // A dangling link is not followed to create its target either.
    let missing = sandbox.dir.path().join("created-through-link");
    let dangling = sandbox.dir.path().join("logs/dangling.log");
    std::os::unix::fs::symlink(&missing, &dangling).expect("plant the dangling link");
    let netconf = sandbox.netconf("1.0.0", json!({"log_file_path": dangling}));
    let outcome = cni("ADD", "c2", "eth0", &netconf, &[]);
    outcome.success_json("ADD");
    assert!(
        outcome
            .stderr
            .contains("it is a symbolic link, which is never followed"),
        "{outcome:#?}"
    );
    assert!(
        !missing.exists(),
        "the plugin created a file through the link"
    );
}

fn log_level_error_keeps_a_successful_call_quiet(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({"log_level": "error"}));
    let outcome = cni("ADD", "c1", "eth0", &netconf, &[]);
    outcome.success_json("ADD");
    assert!(!outcome.stderr.contains("INFO"), "{outcome:#?}");
}

// ---------------------------------------------------------------------------------------------
// Environment errors (code 4)
// ---------------------------------------------------------------------------------------------

fn missing_environment_variables_are_code_4_naming_each_of_them(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let stdin = sandbox.netconf("1.1.0", json!({})).to_string();
    for (command, names) in [
        ("ADD", "CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME,CNI_PATH"),
        ("CHECK", "CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME,CNI_PATH"),
        ("DEL", "CNI_CONTAINERID,CNI_IFNAME,CNI_PATH"),
        ("GC", "CNI_PATH"),
        ("STATUS", "CNI_PATH"),
    ] {
        let env = vec![("CNI_COMMAND".to_owned(), command.to_owned())];
        let outcome = exec(&env, stdin.as_bytes());
        let msg = outcome.assert_error(4, command);
        assert_eq!(msg, format!("required env variables [{names}] missing"));
    }
    // Only the missing one is named.
    let mut env = cni_env("ADD", "c1", "eth0");
    env.retain(|(k, _)| k != "CNI_NETNS");
    let msg = exec(&env, stdin.as_bytes()).assert_error(4, "ADD without CNI_NETNS");
    assert_eq!(msg, "required env variables [CNI_NETNS] missing");
    assert!(sandbox.snapshot().is_empty(), "nothing may be created");
}

fn unknown_command_and_invalid_container_id_or_ifname_are_code_4(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let stdin = sandbox.netconf("1.1.0", json!({})).to_string();
    let env = vec![
        ("CNI_COMMAND".to_owned(), "FROB".to_owned()),
        ("CNI_PATH".to_owned(), "/x".to_owned()),
    ];
    let msg = exec(&env, stdin.as_bytes()).assert_error(4, "unknown command");
    assert!(msg.contains("FROB"), "{msg}");
    let outcome = exec(&cni_env("ADD", "bad/id", "eth0"), stdin.as_bytes());
    assert!(outcome
        .assert_error(4, "bad container id")
        .contains("CNI_CONTAINERID"));
    for ifname in ["a-very-long-interface-name", "et h0", "..", "a:b"] {
        let outcome = exec(&cni_env("ADD", "c1", ifname), stdin.as_bytes());
        assert!(outcome.assert_error(4, ifname).contains("CNI_IFNAME"));
    }
    assert!(sandbox.snapshot().is_empty());
}

fn unknown_cni_args_key_is_code_4_unless_ignore_unknown_is_set(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({}));
    cni("ADD", "prime", "eth0", &netconf, &[]).success_json("prime the store");
    let before = sandbox.snapshot();
    let outcome = cni("ADD", "c1", "eth0", &netconf, &[("CNI_ARGS", "FOO=bar")]);
    let msg = outcome.assert_error(4, "unknown CNI_ARGS key");
    assert!(msg.contains("CNI_ARGS") && msg.contains("FOO=bar"), "{msg}");
    assert_eq!(
        sandbox.snapshot(),
        before,
        "the failed ADD changed the store"
    );
    for ignore in ["IgnoreUnknown=1", "IgnoreUnknown=true"] {
        let args = format!("FOO=bar;{ignore};K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p");
        cni("ADD", "c1", "eth0", &netconf, &[("CNI_ARGS", &args)]).success_json(ignore);
    }
    let outcome = cni("ADD", "c2", "eth0", &netconf, &[("CNI_ARGS", "IP")]);
    assert!(outcome
        .assert_error(4, "malformed pair")
        .contains("invalid pair"));
}

// ---------------------------------------------------------------------------------------------
// Content errors (codes 1, 2, 6, 7)
// ---------------------------------------------------------------------------------------------

#[test]
fn malformed_json_is_code_6_and_touches_nothing() {
    let sandbox = Sandbox::new();
    for stdin in [&b"{"[..], b"", b"[1, 2]", b"not json", b"{\"name\": 5}"] {
        let outcome = exec(&cni_env("ADD", "c1", "eth0"), stdin);
        outcome.assert_error(6, &String::from_utf8_lossy(stdin));
    }
    let outcome = exec(
        &cni_env("ADD", "c1", "eth0"),
        br#"{"name": "n", "cniVersion": 1}"#,
    );
    outcome.assert_error(6, "numeric cniVersion");
    assert!(sandbox.snapshot().is_empty());
}

#[test]
fn missing_or_invalid_network_name_is_code_7() {
    let outcome = exec(&cni_env("ADD", "c1", "eth0"), br#"{"cniVersion": "1.0.0"}"#);
    assert_eq!(outcome.assert_error(7, "no name"), "missing network name");
    let outcome = exec(
        &cni_env("ADD", "c1", "eth0"),
        br#"{"cniVersion": "1.0.0", "name": "bad name"}"#,
    );
    outcome.assert_error(7, "bad name");
}

fn unsupported_spec_versions_are_code_1_listing_what_is_supported(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    for version in ["0.5.0", "2.0.0", "1.0", "banana"] {
        let netconf = sandbox.netconf(version, json!({}));
        let outcome = cni("ADD", "c1", "eth0", &netconf, &[]);
        assert_eq!(
            outcome.assert_error(1, version),
            "incompatible CNI versions"
        );
        let details = outcome.json()["details"]
            .as_str()
            .expect("details")
            .to_owned();
        assert!(
            details.contains(version) && details.contains("1.1.0"),
            "{details}"
        );
        assert_eq!(outcome.json()["cniVersion"], json!("1.1.0"));
    }
    assert!(sandbox.snapshot().is_empty());
}

fn known_keys_with_wrong_types_are_code_7_naming_the_key(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    for (extra, key) in [
        (json!({"nodename": 7}), "ipam.nodename"),
        (json!({"datastore_path": ["x"]}), "ipam.datastore_path"),
        (json!({"ipv4_pools": "test-v4"}), "ipam.ipv4_pools"),
        (json!({"assign_ipv4": 1}), "ipam.assign_ipv4"),
        (json!({"pools": {"cidr": "10.0.0.0/24"}}), "ipam.pools"),
        (json!({"gateway": 5}), "ipam.gateway"),
        (json!({"routes": [{"dst": 5}]}), "ipam.routes[0].dst"),
        (json!({"timeout_seconds": "90"}), "ipam.timeout_seconds"),
        (
            json!({"ipam_lock_timeout_seconds": -1}),
            "ipam.ipam_lock_timeout_seconds",
        ),
        (json!({"etcd_endpoints": 2379}), "ipam.etcd_endpoints"),
    ] {
        let netconf = sandbox.netconf("1.0.0", extra.clone());
        let msg = cni("ADD", "c1", "eth0", &netconf, &[]).assert_error(7, key);
        assert!(msg.contains(key), "{extra}: {msg}");
    }
    let mut netconf = sandbox.netconf("1.0.0", json!({}));
    merge(
        &mut netconf,
        json!({"runtimeConfig": {"ips": "10.244.7.9"}}),
    );
    let msg = cni("ADD", "c1", "eth0", &netconf, &[]).assert_error(7, "runtimeConfig.ips");
    assert!(msg.contains("runtimeConfig.ips"), "{msg}");
    assert!(sandbox.snapshot().is_empty());
}

fn unknown_netconf_keys_are_ignored(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let mut netconf = sandbox.netconf("1.0.0", json!({"somethingElse": {"x": 1}}));
    merge(
        &mut netconf,
        json!({"type": "ptp", "mtu": 1400, "ipMasq": false}),
    );
    cni("ADD", "c1", "eth0", &netconf, &[]).success_json("unknown keys");
}

fn unsupported_values_are_code_2_naming_key_and_value(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    for (extra, key, value) in [
        (
            json!({"datastore_type": "kubernetes"}),
            "ipam.datastore_type",
            "kubernetes",
        ),
        (
            json!({"assign_ipv6": "sometimes"}),
            "ipam.assign_ipv6",
            "sometimes",
        ),
        (json!({"log_level": "shout"}), "ipam.log_level", "shout"),
    ] {
        let netconf = sandbox.netconf("1.0.0", extra);
        let msg = cni("ADD", "c1", "eth0", &netconf, &[]).assert_error(2, key);
        assert!(msg.contains(key) && msg.contains(value), "{msg}");
    }
    assert!(sandbox.snapshot().is_empty());
}

fn bad_cidrs_and_block_sizes_in_pools_are_code_7(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    for pool in [
        json!({"cidr": "10.244.300.0/24"}),
        json!({"cidr": "10.244.8.0/33"}),
        json!({"cidr": "10.244.8.1/24"}),
        json!({"cidr": "10.244.8.0/24", "block_size": 16}),
        json!({"cidr": "10.244.8.0/24", "name": "bad name"}),
        json!({"block_size": 26}),
    ] {
        let netconf = sandbox.netconf("1.0.0", json!({"pools": [pool.clone()]}));
        let msg = cni("ADD", "c1", "eth0", &netconf, &[]).assert_error(7, &pool.to_string());
        assert!(msg.contains("ipam.pools[0]"), "{pool}: {msg}");
    }
    assert!(sandbox.snapshot().is_empty());
}

fn netconf_pools_that_could_not_all_exist_are_code_7_and_create_nothing(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    for pools in [
        json!([{"cidr": "10.244.8.0/24"}, {"cidr": "10.244.8.0/25"}]),
        json!([{"cidr": "10.244.8.0/24", "name": "a"}, {"cidr": "10.244.9.0/24", "name": "a"}]),
    ] {
        let netconf = sandbox.netconf("1.0.0", json!({"pools": pools.clone(), "gateway": null}));
        let msg = cni("ADD", "c1", "eth0", &netconf, &[]).assert_error(7, &pools.to_string());
        assert!(msg.contains("ipam.pools[1]"), "{pools}: {msg}");
    }
    assert!(
        sandbox.snapshot().is_empty(),
        "the network's first pool was created"
    );
}

fn asking_for_no_address_at_all_is_code_7(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({"assign_ipv4": "false"}));
    cni("ADD", "c1", "eth0", &netconf, &[]).assert_error(7, "nothing to assign");
    assert!(sandbox.snapshot().is_empty(), "nothing may be created");
}

// ---------------------------------------------------------------------------------------------
// Allocation errors (plugin codes), each leaving the store unchanged
// ---------------------------------------------------------------------------------------------

/// Primes a sandbox (pools and reservations exist, `holder` holds an address), then runs a
/// failing ADD and asserts its code and that the store did not change.
fn failed_add_leaves_store_unchanged(
    sandbox: &Sandbox,
    netconf: &Value,
    extra_env: &[(&str, &str)],
    code: u64,
) -> String {
    let before = sandbox.snapshot();
    assert!(!before.is_empty(), "prime the store first");
    let outcome = cni("ADD", "victim", "eth0", netconf, extra_env);
    let msg = outcome.assert_error(code, &format!("{netconf} {extra_env:?}"));
    assert_eq!(
        sandbox.snapshot(),
        before,
        "the failed ADD (code {code}: {msg}) changed the store"
    );
    msg
}

fn address_outside_every_pool_is_code_103_and_changes_nothing(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({}));
    cni("ADD", "holder", "eth0", &netconf, &[]).success_json("prime");
    let msg = failed_add_leaves_store_unchanged(
        &sandbox,
        &netconf,
        &[("CNI_ARGS", "IP=192.0.2.10")],
        103,
    );
    assert!(msg.contains("192.0.2.10"), "{msg}");
    // The same through runtimeConfig.ips.
    let mut netconf_rc = netconf.clone();
    merge(
        &mut netconf_rc,
        json!({"runtimeConfig": {"ips": ["192.0.2.11/24"]}}),
    );
    failed_add_leaves_store_unchanged(&sandbox, &netconf_rc, &[], 103);
}

fn address_held_by_another_container_is_code_102_and_changes_nothing(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let held = first_address(&cni("ADD", "holder", "eth0", &netconf, &[]).success_json("prime"));
    let args = format!("IP={held}");
    let msg = failed_add_leaves_store_unchanged(&sandbox, &netconf, &[("CNI_ARGS", &args)], 102);
    assert!(msg.contains(&held), "{msg}");
    // A reserved gateway is "in use" too.
    failed_add_leaves_store_unchanged(&sandbox, &netconf, &[("CNI_ARGS", "IP=10.244.7.1")], 102);
    // Two addresses, one free and one taken: all or nothing.
    let args = format!("IP=10.244.7.200,{held}");
    failed_add_leaves_store_unchanged(&sandbox, &netconf, &[("CNI_ARGS", &args)], 102);
}

fn exhausted_pool_is_code_100_and_changes_nothing(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let small = json!({
        "pools": [{"cidr": "10.244.9.0/30", "block_size": 30}],
        "gateway": null
    });
    let netconf = sandbox.netconf("1.0.0", small);
    // Reported as its own /30, the block has two host addresses.
    for container in ["a", "b"] {
        cni("ADD", container, "eth0", &netconf, &[]).success_json(container);
    }
    let msg = failed_add_leaves_store_unchanged(&sandbox, &netconf, &[], 100);
    assert!(msg.contains("no free IPv4 address"), "{msg}");
}

fn node_block_limit_is_code_101_and_changes_nothing(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf(
        "1.0.0",
        json!({"pools": [{"cidr": "10.244.10.0/24", "block_size": 30}], "gateway": null}),
    );
    cni("ADD", "holder", "eth0", &netconf, &[]).success_json("prime");
    sandbox.with_ipam(async |ipam| {
        ipam.set_config(&IpamConfig {
            strict_affinity: true,
            auto_allocate_blocks: true,
            max_blocks_per_host: 1,
            ..IpamConfig::default()
        })
        .await
        .expect("set config");
    });
    // The holder's /30 has one more host address.
    cni("ADD", "b", "eth0", &netconf, &[]).success_json("b");
    let msg = failed_add_leaves_store_unchanged(&sandbox, &netconf, &[], 101);
    assert!(msg.contains("block limit"), "{msg}");
}

fn address_in_another_nodes_block_under_strict_affinity_is_code_104(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({"gateway": null}));
    let held = first_address(&cni("ADD", "holder", "eth0", &netconf, &[]).success_json("prime"));
    sandbox.with_ipam(async |ipam| {
        ipam.set_config(&IpamConfig {
            strict_affinity: true,
            ..IpamConfig::default()
        })
        .await
        .expect("set config");
    });
    // The next address in node-a's block, asked for from node-b.
    let next: std::net::Ipv4Addr = held.parse().expect("v4");
    let next = std::net::Ipv4Addr::from(u32::from(next) + 1);
    let other_node = sandbox.netconf("1.0.0", json!({"gateway": null, "nodename": "node-b"}));
    let args = format!("IP={next}");
    failed_add_leaves_store_unchanged(&sandbox, &other_node, &[("CNI_ARGS", &args)], 104);
}

fn requested_pool_that_is_missing_or_of_the_wrong_family_is_code_105(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({}));
    cni("ADD", "holder", "eth0", &netconf, &[]).success_json("prime");
    for pools in [
        json!(["no-such-pool"]),
        json!(["test-v6"]),
        json!(["10.99.0.0/24"]),
    ] {
        let netconf = sandbox.netconf("1.0.0", json!({"ipv4_pools": pools}));
        failed_add_leaves_store_unchanged(&sandbox, &netconf, &[], 105);
    }
}

fn netconf_pool_overlapping_a_different_existing_pool_is_code_106(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({}));
    cni("ADD", "holder", "eth0", &netconf, &[]).success_json("prime");
    let overlapping = sandbox.netconf(
        "1.0.0",
        json!({"pools": [{"cidr": "10.244.7.0/25", "block_size": 26}]}),
    );
    let msg = failed_add_leaves_store_unchanged(&sandbox, &overlapping, &[], 106);
    assert!(msg.contains("overlaps"), "{msg}");
}

fn new_netconf_pool_in_a_link_local_range_is_code_7_and_changes_nothing(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({}));
    cni("ADD", "holder", "eth0", &netconf, &[]).success_json("prime");
    for pool in [
        json!({"cidr": "169.254.0.0/16"}),
        json!({"cidr": "fe80::/64", "block_size": 122}),
    ] {
        let link_local = sandbox.netconf("1.0.0", json!({"pools": [pool], "gateway": null}));
        let msg = failed_add_leaves_store_unchanged(&sandbox, &link_local, &[], 7);
        assert!(msg.contains("link-local range"), "{msg}");
    }
}

fn host_lock_held_beyond_the_wait_is_code_11_and_changes_nothing(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({"ipam_lock_timeout_seconds": 0.2}));
    cni("ADD", "holder", "eth0", &netconf, &[]).success_json("prime");
    let before = sandbox.snapshot();
    let held = LockFile::acquire(&sandbox.lock_path(), Duration::from_secs(5)).expect("lock");
    let msg = cni("ADD", "c1", "eth0", &netconf, &[]).assert_error(11, "lock held");
    assert!(msg.contains("lock"), "{msg}");
    let msg = cni("DEL", "holder", "eth0", &netconf, &[]).assert_error(11, "lock held");
    assert!(msg.contains("lock"), "{msg}");
    drop(held);
    assert_eq!(sandbox.snapshot(), before);
    cni("ADD", "c1", "eth0", &netconf, &[]).success_json("after the lock is free");
}

fn store_path_holding_something_else_is_code_108_and_is_left_alone(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    std::fs::write(sandbox.store_path(), b"precious").expect("write");
    if mode == Mode::Agent {
        // An agent configured for that path cannot serve it and leaves it alone; with no agent
        // on the socket, the plugin opens the path itself.
        let refusal = sandbox
            .start_agent()
            .expect_err("an agent cannot serve a file that is not a store");
        assert!(refusal.contains("cannot open the store"), "{refusal}");
    }
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let msg = cni("ADD", "c1", "eth0", &netconf, &[]).assert_error(108, "not a store");
    assert!(msg.contains("store"), "{msg}");
    assert_eq!(
        std::fs::read(sandbox.store_path()).expect("read"),
        b"precious"
    );
}

fn failed_first_add_on_a_fresh_store_leaves_only_the_networks_pools_and_reservations(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({}));
    cni(
        "ADD",
        "c1",
        "eth0",
        &netconf,
        &[("CNI_ARGS", "IP=192.0.2.1")],
    )
    .assert_error(103, "fresh");
    assert!(sandbox.container_allocations().is_empty());
    let reserved: Vec<String> = sandbox
        .allocations()
        .into_iter()
        .map(|(ip, handle, _)| {
            assert_eq!(handle, "testnet:gateway");
            ip
        })
        .collect();
    assert_eq!(
        reserved,
        vec![
            "10.244.7.0",
            "10.244.7.1",
            "10.244.7.255",
            "fd00:10:244::",
            "fd00:10:244::1"
        ]
    );
}

fn check_of_an_address_not_held_by_the_attachment_is_code_107(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let c1 = cni("ADD", "c1", "eth0", &netconf, &[]).success_json("c1");
    let c2 = cni("ADD", "c2", "eth0", &netconf, &[]).success_json("c2");
    // c1 checked against c2's result: held by another handle.
    let mut check = netconf.clone();
    merge(&mut check, json!({"prevResult": c2}));
    let msg = cni("CHECK", "c1", "eth0", &check, &[]).assert_error(107, "wrong holder");
    assert!(msg.contains("testnet.c2"), "{msg}");
    // c1's own result on another interface.
    let mut check = netconf.clone();
    merge(&mut check, json!({"prevResult": c1}));
    cni("CHECK", "c1", "eth0", &check, &[]).assert_silent_success("own result");
    let msg = cni("CHECK", "c1", "eth1", &check, &[]).assert_error(107, "other interface");
    assert!(
        msg.contains("of attachment c1 / eth1 is held by this container for interface \"eth0\""),
        "{msg}"
    );
    // After DEL nothing is held.
    cni("DEL", "c1", "eth0", &netconf, &[]).assert_silent_success("DEL");
    let msg = cni("CHECK", "c1", "eth0", &check, &[]).assert_error(107, "after DEL");
    assert!(msg.contains("not allocated"), "{msg}");
    // Without prevResult: the attachment must hold something.
    cni("CHECK", "c1", "eth0", &netconf, &[]).assert_error(107, "no prevResult");
    cni("CHECK", "c2", "eth0", &netconf, &[]).assert_silent_success("no prevResult, held");
}

fn gc_without_valid_attachments_is_code_7(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.1.0", json!({}));
    cni("ADD", "c1", "eth0", &netconf, &[]).success_json("c1");
    let msg = cni("GC", "", "", &netconf, &[]).assert_error(7, "GC without list");
    assert!(msg.contains("cni.dev/valid-attachments"), "{msg}");
    assert_eq!(sandbox.container_allocations().len(), 1);
}

fn status_is_code_50_when_this_node_cannot_get_an_address(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf(
        "1.1.0",
        json!({"pools": [{"cidr": "10.244.9.0/30", "block_size": 30}], "gateway": null}),
    );
    cni("STATUS", "", "", &netconf, &[]).assert_silent_success("fresh store");
    for container in ["a", "b"] {
        cni("ADD", container, "eth0", &netconf, &[]).success_json(container);
    }
    // The block's network and broadcast addresses are free, but no ADD can have them.
    cni("ADD", "c", "eth0", &netconf, &[]).assert_error(100, "full pool");
    let msg = cni("STATUS", "", "", &netconf, &[]).assert_error(50, "full pool");
    assert!(msg.contains("cannot get an IPv4 address"), "{msg}");
    cni("DEL", "a", "eth0", &netconf, &[]).assert_silent_success("DEL");
    cni("STATUS", "", "", &netconf, &[]).assert_silent_success("after DEL");
    let missing = sandbox.netconf("1.1.0", json!({"ipv4_pools": ["nope"], "pools": null}));
    let msg = cni("STATUS", "", "", &missing, &[]).assert_error(50, "missing pool");
    assert!(msg.contains("\"nope\" does not exist"), "{msg}");
}

/// One damaged object stops the STATUS of exactly the nodes whose ADDs it stops (a runtime marks
/// a node's network not ready on a failed STATUS): another node's block does not, nor the node's
/// own block with room (its ADDs pass over it to another block), a pool object does on every
/// node; each failure names the key.
fn status_answers_past_an_object_no_add_of_the_node_reads_and_names_one_they_all_read(mode: Mode) {
    use ipam_core::model::keys;
    let sandbox = Sandbox::in_mode(mode);
    let here = sandbox.netconf("1.1.0", json!({}));
    let elsewhere = sandbox.netconf("1.1.0", json!({"nodename": "node-b"}));
    cni("ADD", "a", "eth0", &here, &[]).success_json("a");
    cni("ADD", "b", "eth0", &elsewhere, &[]).success_json("b");
    let damage_under = |dir: String| {
        let intact = sandbox.damage_under(&dir);
        assert!(!intact.is_empty(), "nothing stored under {dir}");
        intact
    };
    let status_error = |netconf: &Value, what: &str, key: &str| {
        let msg = cni("STATUS", "", "", netconf, &[]).assert_error(50, what);
        assert!(
            msg.contains(key) && msg.contains("blockipamctl check"),
            "{what}: {msg}"
        );
    };
    let node_b_blocks = damage_under(keys::host_open_blocks_dir("node-b"));
    cni("STATUS", "", "", &here, &[]).assert_silent_success("past another node's block");
    cni("ADD", "a2", "eth0", &here, &[]).success_json("node-a's ADD never reads it");
    cni("STATUS", "", "", &elsewhere, &[]).assert_silent_success("past node-b's own block");
    let b = cni("ADD", "b2", "eth0", &elsewhere, &[]).success_json("node-b's ADD passes over it");
    let (damaged_key, _) = &node_b_blocks[0];
    let address: std::net::IpAddr = first_address(&b).parse().expect("an address");
    let damaged_block: ipnet::IpNet =
        keys::parse_cidr_segment(damaged_key.rsplit_once('/').expect("a block key").1)
            .expect("a block CIDR");
    assert!(
        !damaged_block.contains(&address),
        "{address} from the damaged block {damaged_block}"
    );
    sandbox.restore(node_b_blocks);
    cni("STATUS", "", "", &elsewhere, &[]).assert_silent_success("node-b's block restored");
    let pool = damage_under(keys::pool("test-v4"));
    for netconf in [&here, &elsewhere] {
        status_error(netconf, "a pool object", &pool[0].0);
    }
    sandbox.restore(pool);
    for netconf in [&here, &elsewhere] {
        cni("STATUS", "", "", netconf, &[]).assert_silent_success("pool restored");
    }
}

/// A block that cannot be decoded still takes its place in its pool: with every other block
/// claimed and full, STATUS on a third node reports no free address, as its ADD fails.
fn status_counts_a_block_it_cannot_decode_as_taken(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    // Two /30 blocks; with no gateway, each block's edges are never handed out.
    let on = |node: &str| {
        sandbox.netconf(
            "1.1.0",
            json!({"nodename": node, "gateway": null,
                   "pools": [{"cidr": "10.244.9.0/29", "block_size": 30}]}),
        )
    };
    for container in ["a1", "a2"] {
        cni("ADD", container, "eth0", &on("node-a"), &[]).success_json(container);
    }
    cni("ADD", "b1", "eth0", &on("node-b"), &[]).success_json("b1");
    cni("STATUS", "", "", &on("node-c"), &[]).assert_silent_success("node-b's block has room");
    let damaged = sandbox.damage_under(&ipam_core::model::keys::host_blocks_dir("node-b"));
    let msg = cni("STATUS", "", "", &on("node-c"), &[]).assert_error(50, "no block to claim");
    assert!(msg.contains("no free address"), "{msg}");
    assert!(
        msg.contains(&damaged[0].0),
        "STATUS names the block whose room it could not count: {msg}"
    );
    // The ADD fails too, naming the block (it may have had room), not as exhausted pools.
    let msg = cni("ADD", "c1", "eth0", &on("node-c"), &[]).assert_error(108, "node-c's ADD");
    assert!(msg.contains(&damaged[0].0), "{msg}");
    // node-a's full block (which its ADDs do not read) counts toward its block limit.
    let full = sandbox.damage_under(&ipam_core::model::keys::host_full_blocks_dir("node-a"));
    assert_eq!(full.len(), 1, "node-a's block is full");
    sandbox.with_ipam(async move |ipam: &ipam_core::Ipam| {
        ipam.update_config(|config| config.max_blocks_per_host = 1)
            .await
            .expect("a limit of one block");
    });
    let msg = cni("STATUS", "", "", &on("node-a"), &[]).assert_error(50, "at the block limit");
    assert!(msg.contains("per-node block limit is 1"), "{msg}");
    cni("ADD", "a3", "eth0", &on("node-a"), &[]).assert_error(101, "node-a's ADD");
    // So does a block of the node with room, which its ADDs read and pass over.
    let node_e = sandbox.netconf(
        "1.1.0",
        json!({"nodename": "node-e", "gateway": null,
               "pools": [{"cidr": "10.244.14.0/28", "block_size": 30}]}),
    );
    status_then_add(&node_e, "e1", None, &[]);
    let open = sandbox.damage_under(&ipam_core::model::keys::host_open_blocks_dir("node-e"));
    assert_eq!(open.len(), 1, "node-e's block has room");
    status_then_add(&node_e, "e2", Some("per-node block limit is 1"), &[]);
    let msg = cni("STATUS", "", "", &node_e, &[]).assert_error(50, "node-e at its limit");
    assert!(
        msg.contains(&open[0].0),
        "STATUS names node-e's block whose room it could not count: {msg}"
    );
}

/// An ADD that may take block edges (a gateway in the pool) reads the node's full blocks for
/// them: one that cannot be decoded is passed over, with a warning naming it, and the ADD claims
/// a new block.
fn an_add_passing_over_a_full_block_it_cannot_decode_warns_naming_it(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf(
        "1.1.0",
        json!({"gateway": "10.244.15.1", "ipv4_pools": ["10.244.15.0/28"],
               "pools": [{"cidr": "10.244.15.0/28", "block_size": 30}]}),
    );
    // The node's block, edges included: full.
    for n in 1..=4 {
        cni("ADD", &format!("fill-{n}"), "eth0", &netconf, &[]).success_json("fill");
    }
    let full = sandbox.damage_under(&ipam_core::model::keys::host_full_blocks_dir(NODE));
    assert_eq!(full.len(), 1, "the node's block is full");
    let added = cni("ADD", "past-the-damage", "eth0", &netconf, &[]);
    added.success_json("past-the-damage");
    assert!(
        added
            .stderr
            .contains("passing over a full block of this node that cannot be decoded")
            && added.stderr.contains(&full[0].0),
        "no warning naming {}: {}",
        full[0].0,
        added.stderr
    );
    assert_eq!(
        added.stderr.matches("passing over a full block").count(),
        1,
        "one warning: {}",
        added.stderr
    );
}

/// STATUS, then the ADD it speaks for (a runtime marks the node's network not ready on a failed
/// STATUS): both succeed, or STATUS answers code 50 with `refusal` in its message and the ADD
/// fails too.
fn status_then_add(netconf: &Value, container: &str, refusal: Option<&str>, args: &[(&str, &str)]) {
    match refusal {
        None => {
            cni("STATUS", "", "", netconf, &[]).assert_silent_success(container);
            cni("ADD", container, "eth0", netconf, args).success_json(container);
        }
        Some(why) => {
            let msg = cni("STATUS", "", "", netconf, &[]).assert_error(50, container);
            assert!(msg.contains(why), "{container}: expected {why:?} in {msg}");
            let add = cni("ADD", container, "eth0", netconf, args);
            assert_ne!(
                add.status, 0,
                "{container}: STATUS refused, the ADD succeeded: {}",
                add.stdout
            );
        }
    }
}

/// STATUS agrees with the ADD that follows it whichever way the pool is chosen: pools that do
/// not select the node (node selector, manual assignment, tunnel use only), no enabled pool, a
/// requested pool that is disabled, of the other family, enabled, or named in the netconf and not
/// created yet (by name or by CIDR); a new node without a per-node block limit.
fn status_speaks_for_the_next_add_in_every_choice_of_pool(mode: Mode) {
    use ipam_core::model::selector::Selector;
    use ipam_core::{AllowedUse, AllowedUses, AssignmentMode, PoolPolicy, PoolSpec};
    let sandbox = Sandbox::in_mode(mode);
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        let spec = |cidr: &str, name: &str, block_size: u8| PoolSpec {
            cidr: cidr.parse().expect("a CIDR"),
            name: Some(name.into()),
            block_size: Some(block_size),
            disabled: false,
        };
        let policy = PoolPolicy::default();
        for (pool, policy) in [
            (
                spec("10.244.9.0/28", "zoned", 30),
                PoolPolicy {
                    node_selector: Selector::parse("zone == 'b'").expect("a selector"),
                    ..policy.clone()
                },
            ),
            (
                spec("10.244.10.0/28", "manual", 30),
                PoolPolicy {
                    assignment_mode: AssignmentMode::Manual,
                    ..policy.clone()
                },
            ),
            (
                spec("10.244.11.0/28", "tunnels", 30),
                PoolPolicy {
                    allowed_uses: AllowedUses::new([AllowedUse::Tunnel]).expect("uses"),
                    ..policy.clone()
                },
            ),
            (spec("fd00:10:245::/120", "v6", 122), policy.clone()),
        ] {
            ipam.create_pool_with_policy(&pool, &policy)
                .await
                .expect("a pool");
        }
    });
    let operator_pools = sandbox.netconf("1.1.0", json!({"pools": null, "gateway": null}));
    status_then_add(
        &operator_pools,
        "unselected",
        Some("no IP pool selects node"),
        &[],
    );
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.set_node_labels(NODE, &[("zone".into(), "b".into())], &[])
            .await
            .expect("labels");
    });
    status_then_add(&operator_pools, "selected", None, &[]);
    let set_disabled = |pools: &[&str], disabled: bool| {
        sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
            for pool in pools {
                ipam.set_pool_disabled(pool, disabled)
                    .await
                    .expect("disable or enable");
            }
        })
    };
    set_disabled(&["zoned", "manual", "tunnels"], true);
    status_then_add(
        &operator_pools,
        "none-enabled",
        Some("there is no enabled pool"),
        &[],
    );

    let requesting = |pools: &[&str], netconf_pools: Value| {
        sandbox.netconf(
            "1.1.0",
            json!({"pools": netconf_pools, "gateway": null, "ipv4_pools": pools}),
        )
    };
    status_then_add(
        &requesting(&["10.244.10.0/28"], Value::Null),
        "requested-disabled",
        Some("\"10.244.10.0/28\" is disabled"),
        &[],
    );
    set_disabled(&["manual"], false);
    status_then_add(
        &requesting(&["10.244.10.0/28"], Value::Null),
        "requested-by-cidr",
        None,
        &[],
    );
    status_then_add(
        &requesting(&["manual"], Value::Null),
        "requested-by-name",
        None,
        &[],
    );
    status_then_add(
        &requesting(&["v6"], Value::Null),
        "requested-v6",
        Some("\"v6\" is not an IPv4 pool"),
        &[],
    );
    // A netconf pool not created yet is created by the ADD: it does not stand for another one.
    let pending = |cidr: &str, name: &str| json!([{"cidr": cidr, "block_size": 30, "name": name}]);
    status_then_add(
        &requesting(&["zoned"], pending("10.244.12.0/28", "pending-a")),
        "requested-disabled-beside-a-pending-pool",
        Some("\"zoned\" is disabled"),
        &[],
    );
    status_then_add(
        &requesting(&["pending-b"], pending("10.244.13.0/28", "pending-b")),
        "requested-pending-by-name",
        None,
        &[],
    );
    status_then_add(
        &requesting(&["10.244.14.0/28"], pending("10.244.14.0/28", "pending-c")),
        "requested-pending-by-cidr",
        None,
        &[],
    );
    set_disabled(&["tunnels"], false);
    status_then_add(
        &requesting(&["tunnels"], Value::Null),
        "requested-tunnel-pool",
        Some("\"tunnels\" does not allow workload addresses"),
        &[],
    );
    // A netconf pool the ADD would create, but cannot: its range overlaps another pool.
    status_then_add(
        &requesting(&[], pending("10.244.8.0/23", "overlapping")),
        "overlapping-netconf-pool",
        Some("overlaps existing pool \"zoned\""),
        &[],
    );
    // Nor one whose range overlaps the link-local addresses, which no pool may be created on.
    status_then_add(
        &requesting(&[], pending("169.254.0.0/28", "link-local")),
        "link-local-netconf-pool",
        Some("overlaps the IPv4 link-local range"),
        &[],
    );
    // A netconf pool created by the ADD is empty: its first address needs a new block.
    let config = |change: fn(&mut IpamConfig)| {
        sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
            ipam.update_config(change).await.expect("config");
        })
    };
    config(|c| c.max_blocks_per_host = 1);
    status_then_add(
        &requesting(&["pending-d"], pending("10.244.15.0/28", "pending-d")),
        "pending-pool-at-the-block-limit",
        Some("per-node block limit is 1"),
        &[],
    );
    config(|c| {
        c.max_blocks_per_host = 0;
        c.auto_allocate_blocks = false;
    });
    status_then_add(
        &requesting(&["pending-e"], pending("10.244.16.0/28", "pending-e")),
        "pending-pool-without-new-blocks",
        Some("no free address"),
        &[],
    );
    // No per-node block limit (0): a node without a block claims its first.
    config(|c| {
        c.max_blocks_per_host = 0;
        c.auto_allocate_blocks = true;
    });
    status_then_add(
        &sandbox.netconf(
            "1.1.0",
            json!({"nodename": "unlimited", "pools": null, "gateway": null}),
        ),
        "new-node-without-a-block-limit",
        None,
        &[],
    );
}

/// STATUS agrees with the ADD that follows it at a block's edges (which an ADD whose pool holds
/// no gateway never hands out) and when the node must borrow: free addresses that are all edges
/// are no room, free addresses beside edges taken by explicit requests are, a /31 block has no
/// edges; another node's block lends unless affinity is strict.
fn status_speaks_for_the_next_add_at_block_edges_and_when_borrowing(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let one_block = |cidr: &str, block_size: u8, node: &str| {
        sandbox.netconf(
            "1.1.0",
            json!({"nodename": node, "gateway": null,
                   "pools": [{"cidr": cidr, "block_size": block_size}]}),
        )
    };
    // One /29 block: .1 to .4 by ADDs, both edges by another client (an ADD under a netconf
    // with a gateway in the pool may have them), then .5 and .6 are left.
    let block29 = one_block("10.244.9.0/29", 29, NODE);
    for n in 1..=4 {
        status_then_add(&block29, &format!("fill-{n}"), None, &[]);
    }
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.assign_ips(&ipam_core::AssignIpsRequest {
            ips: vec![
                "10.244.9.0".parse().expect("ip"),
                "10.244.9.7".parse().expect("ip"),
            ],
            handle: "edges".into(),
            host: NODE.into(),
            ..ipam_core::AssignIpsRequest::default()
        })
        .await
        .expect("both edges");
    });
    status_then_add(&block29, "beside-taken-edges-1", None, &[]);
    status_then_add(&block29, "beside-taken-edges-2", None, &[]);
    status_then_add(&block29, "block-29-full", Some("no free address"), &[]);

    // A /31 block has no edges: both its addresses are handed out.
    let block31 = one_block("10.244.10.0/31", 31, NODE);
    status_then_add(&block31, "block-31-first", None, &[]);
    status_then_add(&block31, "block-31-second", None, &[]);
    status_then_add(&block31, "block-31-full", Some("no free address"), &[]);

    // A /29 block whose broadcast address the operator reserved, .1 to .5 held: of its two
    // addresses not taken, the network address is an edge and .6 serves.
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.add_reservation(&ipam_core::reservations::Reservation {
            name: "broadcast-30".into(),
            cidrs: vec!["10.244.30.7/32".parse().expect("a CIDR")],
        })
        .await
        .expect("the operator's reservation");
        ipam.create_pool(&ipam_core::PoolSpec {
            cidr: "10.244.30.0/29".parse().expect("a CIDR"),
            name: None,
            block_size: Some(29),
            disabled: false,
        })
        .await
        .expect("the pool");
        ipam.assign_ips(&ipam_core::AssignIpsRequest {
            ips: (1..=5)
                .map(|n| format!("10.244.30.{n}").parse().expect("ip"))
                .collect(),
            handle: "held-in-30".into(),
            host: NODE.into(),
            ..ipam_core::AssignIpsRequest::default()
        })
        .await
        .expect("five addresses");
    });
    let reserved_edge = one_block("10.244.30.0/29", 29, NODE);
    status_then_add(&reserved_edge, "beside-a-reserved-edge", None, &[]);
    status_then_add(
        &reserved_edge,
        "reserved-edge-full",
        Some("no free address"),
        &[],
    );

    // One /30 block, claimed by node-b: node-a borrows its other host address, then only its
    // edges are free.
    status_then_add(
        &one_block("10.244.11.0/30", 30, "node-b"),
        "owner",
        None,
        &[],
    );
    let borrower = one_block("10.244.11.0/30", 30, NODE);
    status_then_add(&borrower, "borrowed", None, &[]);
    status_then_add(&borrower, "only-edges-left", Some("no free address"), &[]);
    // Released under a cooldown, the borrowed address is no room until it has cooled.
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.update_config(|config| config.ip_cooldown_seconds = 1200)
            .await
            .expect("a 20-minute cooldown");
    });
    cni("DEL", "borrowed", "eth0", &borrower, &[]).assert_silent_success("DEL");
    status_then_add(&borrower, "while-it-cools", Some("no free address"), &[]);
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.update_config(|config| config.ip_cooldown_seconds = 0)
            .await
            .expect("no cooldown");
    });
    status_then_add(&borrower, "once-it-cooled", None, &[]);
    cni("DEL", "once-it-cooled", "eth0", &borrower, &[]).assert_silent_success("DEL");
    // Without automatic block allocation the ADD borrows at once: the same answers.
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.update_config(|config| config.auto_allocate_blocks = false)
            .await
            .expect("automatic block allocation off");
    });
    status_then_add(&borrower, "borrowed-at-once", None, &[]);
    status_then_add(
        &borrower,
        "at-once-only-edges-left",
        Some("no free address"),
        &[],
    );
    cni("DEL", "borrowed-at-once", "eth0", &borrower, &[]).assert_silent_success("DEL");
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.update_config(|config| config.auto_allocate_blocks = true)
            .await
            .expect("automatic block allocation on");
    });

    // With a gateway in the pool, an ADD may take block edges that are not the pool's: the
    // network set-up holds the pool's network, broadcast and gateway addresses in its two /30
    // blocks (affine to no node), and the node borrows the five others, then none.
    let with_gateway = sandbox.netconf(
        "1.1.0",
        json!({"nodename": "node-c", "gateway": "10.244.12.1", "ipv4_pools": ["10.244.12.0/29"],
               "pools": [{"cidr": "10.244.12.0/29", "block_size": 30}]}),
    );
    for n in 1..=5 {
        status_then_add(&with_gateway, &format!("beside-the-gateway-{n}"), None, &[]);
    }
    status_then_add(
        &with_gateway,
        "gateway-pool-full",
        Some("no free address"),
        &[],
    );
    // A /31 pool not created yet, its gateway the second address: the set-up reserves both, in
    // the pool's one block, and leaves nothing to borrow.
    let gateway_takes_all = sandbox.netconf(
        "1.1.0",
        json!({"nodename": "node-c", "gateway": "10.244.22.1", "ipv4_pools": ["10.244.22.0/31"],
               "pools": [{"cidr": "10.244.22.0/31", "block_size": 31}]}),
    );
    status_then_add(
        &gateway_takes_all,
        "set-up-reserves-the-whole-pool",
        Some("no free address"),
        &[],
    );
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.update_config(|config| config.strict_affinity = true)
            .await
            .expect("strict affinity");
    });
    status_then_add(&borrower, "strict-affinity", Some("no free address"), &[]);
    // A pool not created yet whose every block the network set-up takes for its reservations
    // (the gateway and the pool's network address in the first /30, its broadcast address in the
    // second): under strict affinity no block is left for the node to claim. With four blocks,
    // the two between them are.
    let reserved_everywhere = sandbox.netconf(
        "1.1.0",
        json!({"nodename": "node-h", "gateway": "10.244.18.1", "ipv4_pools": ["10.244.18.0/29"],
               "pools": [{"cidr": "10.244.18.0/29", "block_size": 30}]}),
    );
    status_then_add(
        &reserved_everywhere,
        "every-block-reserved",
        Some("no free address"),
        &[],
    );
    let two_blocks_left = sandbox.netconf(
        "1.1.0",
        json!({"nodename": "node-h", "gateway": "10.244.19.1", "ipv4_pools": ["10.244.19.0/28"],
               "pools": [{"cidr": "10.244.19.0/28", "block_size": 30}]}),
    );
    status_then_add(&two_blocks_left, "between-the-reserved-blocks", None, &[]);
    // A pool the operator created, the network not set up in it yet: other nodes hold all its
    // /30 blocks but the first (the pool's network address and the gateway) and the last (its
    // broadcast address), which the set-up claims. The node's probe (from block 56 of 128) reaches
    // neither; the claim index names one of them: no room either.
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.create_pool(&ipam_core::PoolSpec {
            cidr: "10.244.20.0/23".parse().expect("a CIDR"),
            name: None,
            block_size: Some(30),
            disabled: false,
        })
        .await
        .expect("the operator's pool");
        for n in 1..127u32 {
            let ip = std::net::Ipv4Addr::from(u32::from_be_bytes([10, 244, 20, 1]) + 4 * n);
            ipam.assign_ips(&ipam_core::AssignIpsRequest {
                ips: vec![ip.into()],
                handle: format!("holder-{n}"),
                host: format!("holder-{n}"),
                ..ipam_core::AssignIpsRequest::default()
            })
            .await
            .expect("a holder's block");
        }
    });
    let operator_pool = sandbox.netconf(
        "1.1.0",
        json!({"nodename": "node-h", "gateway": "10.244.20.1", "ipv4_pools": ["10.244.20.0/23"],
               "pools": [{"cidr": "10.244.20.0/23", "block_size": 30}]}),
    );
    status_then_add(
        &operator_pool,
        "set-up-claims-the-last-free-blocks",
        Some("no free address"),
        &[],
    );
    // Both families asked for by a node with no block: room for new blocks in two IPv6 pools
    // does not make up for the IPv4 pool, whose one block node-b holds.
    let dual = sandbox.netconf(
        "1.1.0",
        json!({"nodename": "node-f", "gateway": null, "assign_ipv6": "true",
               "ipv4_pools": ["10.244.11.0/30"], "ipv6_pools": ["fd00:11::/120", "fd00:12::/120"],
               "pools": [{"cidr": "10.244.11.0/30", "block_size": 30},
                         {"cidr": "fd00:11::/120", "block_size": 126},
                         {"cidr": "fd00:12::/120", "block_size": 126}]}),
    );
    status_then_add(&dual, "dual-stack", Some("no free address"), &[]);

    // At the per-node block limit, a node whose one block has no address an ADD can have (its
    // other host address reserved) gets no new block: STATUS says so, as the ADD fails.
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.update_config(|config| config.max_blocks_per_host = 1)
            .await
            .expect("a block limit");
    });
    let limited = one_block("10.244.13.0/28", 30, "node-d");
    cni("STATUS", "", "", &limited, &[]).assert_silent_success("node-d, no block yet");
    let first = cni("ADD", "node-d-first", "eth0", &limited, &[]).success_json("node-d-first");
    let address = first["ips"][0]["address"].as_str().expect("an address");
    let ip: std::net::Ipv4Addr = address
        .split('/')
        .next()
        .and_then(|ip| ip.parse().ok())
        .expect("an IPv4 address");
    let other_host = std::net::Ipv4Addr::from(u32::from(ip) + 1);
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.add_reservation(&ipam_core::reservations::Reservation {
            name: "node-d-other-host".into(),
            cidrs: vec![format!("{other_host}/32").parse().expect("a CIDR")],
        })
        .await
        .expect("reserve the block's other host address");
    });
    status_then_add(
        &limited,
        "node-d-at-its-limit",
        Some("per-node block limit"),
        &[],
    );
    // At the limit too, under a netconf with a gateway in the pool (an ADD may take block
    // edges): a node whose one block has only its two edges free, kept with the node's full
    // blocks, can have one: STATUS says so, as the ADD takes it.
    let gateway_limited = sandbox.netconf(
        "1.1.0",
        json!({"nodename": "node-g", "gateway": "10.244.17.1", "ipv4_pools": ["10.244.17.0/28"],
               "pools": [{"cidr": "10.244.17.0/28", "block_size": 30}]}),
    );
    let mut edge_holders = Vec::new();
    for n in 1..=4 {
        let container = format!("node-g-{n}");
        cni("STATUS", "", "", &gateway_limited, &[]).assert_silent_success(&container);
        let added = cni("ADD", &container, "eth0", &gateway_limited, &[]).success_json(&container);
        let ip: std::net::Ipv4Addr = added["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .and_then(|ip| ip.parse().ok())
            .expect("an IPv4 address");
        if matches!(u32::from(ip) % 4, 0 | 3) {
            edge_holders.push(container);
        }
    }
    status_then_add(
        &gateway_limited,
        "node-g-full",
        Some("per-node block limit"),
        &[],
    );
    assert_eq!(edge_holders.len(), 2, "ADDs were given the block's edges");
    for container in &edge_holders {
        cni("DEL", container, "eth0", &gateway_limited, &[]).assert_silent_success(container);
    }
    status_then_add(&gateway_limited, "node-g-edge", None, &[]);
}

/// STATUS agrees with the ADD when the network is not set up yet in a pool the operator created
/// and the addresses its set-up reserves (the gateway, the pool's network and broadcast
/// addresses) lie in blocks already claimed and are still free there: the set-up takes them
/// before the ADD looks, so they are no room, in the node's own block and in a lender's; a block
/// with a free address besides them still serves, and one the operator's reservation covers, one
/// in IP cooldown and one allocated in a block whose owner key cannot be decoded were never free.
fn status_counts_the_free_addresses_the_network_set_up_reserves_in_claimed_blocks_as_taken(
    mode: Mode,
) {
    let sandbox = Sandbox::in_mode(mode);
    // Each pool one block, claimed by an explicit request of `holder` for the addresses at
    // `held` (offsets from the pool's network address); the gateway is the first host address.
    let claimed_pool_holding = |cidr: &str, block_size: u8, holder: &str, held: &[u32]| {
        let net: ipnet::Ipv4Net = cidr.parse().expect("a CIDR");
        sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
            ipam.create_pool(&ipam_core::PoolSpec {
                cidr: net.into(),
                name: None,
                block_size: Some(block_size),
                disabled: false,
            })
            .await
            .expect("the operator's pool");
            let at = |offset: &u32| std::net::Ipv4Addr::from(u32::from(net.network()) + offset);
            ipam.assign_ips(&ipam_core::AssignIpsRequest {
                ips: held.iter().map(|offset| at(offset).into()).collect(),
                handle: format!("held-in-{}", net.network()),
                host: holder.into(),
                ..ipam_core::AssignIpsRequest::default()
            })
            .await
            .expect("the block claimed");
        });
        sandbox.netconf(
            "1.1.0",
            json!({"gateway": std::net::Ipv4Addr::from(u32::from(net.network()) + 1).to_string(),
                   "ipv4_pools": [cidr], "pools": [{"cidr": cidr, "block_size": block_size}]}),
        )
    };
    // Its second host address held: the gateway and the pool's edges stay free.
    let claimed_pool = |cidr: &str, block_size: u8, holder: &str| {
        claimed_pool_holding(cidr, block_size, holder, &[2])
    };
    // The node's own /30 block: free are the pool's network address, the gateway and the
    // broadcast address, all three reserved by the set-up.
    status_then_add(
        &claimed_pool("10.244.40.0/30", 30, NODE),
        "own-block-all-reserved",
        Some("no free address"),
        &[],
    );
    // Another node's /30 block, the pool's only one: nothing to borrow once the set-up is done.
    status_then_add(
        &claimed_pool("10.244.41.0/30", 30, "node-b"),
        "lender-all-reserved",
        Some("no free address"),
        &[],
    );
    // A /29 block: four addresses beside the three reserved.
    status_then_add(
        &claimed_pool("10.244.42.0/29", 29, NODE),
        "own-block-room-beside-the-reserved",
        None,
        &[],
    );
    let lender_with_room = claimed_pool("10.244.43.0/29", 29, "node-b");
    status_then_add(
        &lender_with_room,
        "lender-room-beside-the-reserved",
        None,
        &[],
    );
    // The set-up done, its addresses held: the block's three other free addresses serve.
    for n in 1..=3 {
        status_then_add(
            &lender_with_room,
            &format!("after-the-set-up-{n}"),
            None,
            &[],
        );
    }
    status_then_add(
        &lender_with_room,
        "after-the-set-up-full",
        Some("no free address"),
        &[],
    );
    // The gateway inside the operator's reservation (not free, the set-up takes it all the
    // same): of the three free addresses, the set-up takes the pool's two edges and leaves one.
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.add_reservation(&ipam_core::reservations::Reservation {
            name: "gateway-44".into(),
            cidrs: vec!["10.244.44.1/32".parse().expect("a CIDR")],
        })
        .await
        .expect("the operator's reservation");
    });
    let reserved_gateway = claimed_pool_holding("10.244.44.0/29", 29, "node-b", &[2, 3, 4, 5]);
    status_then_add(&reserved_gateway, "beside-a-reserved-gateway", None, &[]);
    status_then_add(
        &reserved_gateway,
        "reserved-gateway-full",
        Some("no free address"),
        &[],
    );
    // The gateway released under a cooldown (not free, and the set-up passes over it): of the
    // three free addresses, the set-up takes the pool's two edges and leaves one.
    let cooling_gateway = claimed_pool_holding("10.244.45.0/29", 29, "node-b", &[1, 2, 3, 4, 5]);
    sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        ipam.update_config(|config| config.ip_cooldown_seconds = 1200)
            .await
            .expect("a 20-minute cooldown");
        let outcome = ipam
            .release_ips(&[ipam_core::ReleaseRequest {
                ip: "10.244.45.1".parse().expect("ip"),
                sequence: None,
            }])
            .await
            .expect("the gateway released");
        assert_eq!(outcome.released.len(), 1, "{outcome:?}");
    });
    status_then_add(&cooling_gateway, "beside-a-cooling-gateway", None, &[]);
    status_then_add(
        &cooling_gateway,
        "cooling-gateway-full",
        Some("no free address"),
        &[],
    );
    // The gateway held in a block whose owner key cannot be decoded (the block's value still
    // says it is allocated).
    let damaged_owners = claimed_pool_holding("10.244.46.0/29", 29, "node-b", &[1, 2, 3, 4, 5]);
    let kept = sandbox.damage_under(&ipam_core::model::keys::block_owners_dir(
        &"10.244.46.0/29".parse().expect("a CIDR"),
    ));
    assert!(!kept.is_empty(), "an owner key damaged");
    status_then_add(&damaged_owners, "beside-a-damaged-owner-key", None, &[]);
}

fn status_is_code_50_when_the_store_cannot_be_opened(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    std::fs::write(sandbox.store_path(), b"not a store").expect("write");
    if mode == Mode::Agent {
        let refusal = sandbox
            .start_agent()
            .expect_err("an agent cannot serve a file that is not a store");
        assert!(refusal.contains("cannot open the store"), "{refusal}");
    }
    let netconf = sandbox.netconf("1.1.0", json!({}));
    let msg = cni("STATUS", "", "", &netconf, &[]).assert_error(50, "bad store");
    assert!(msg.contains("store"), "{msg}");
}

fn errors_carry_the_requests_spec_version(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    for version in VERSIONS {
        let netconf = sandbox.netconf(version, json!({"ipv4_pools": ["nope"]}));
        let outcome = cni("ADD", "c1", "eth0", &netconf, &[]);
        outcome.assert_error(105, version);
        assert_eq!(outcome.json()["cniVersion"], json!(version));
    }
}

fn log_file_is_created_owner_only_and_an_existing_files_mode_is_kept(mode: Mode) {
    use std::os::unix::fs::PermissionsExt;
    let sandbox = Sandbox::in_mode(mode);
    let mode = |path: &std::path::Path| {
        std::fs::metadata(path)
            .expect("log file")
            .permissions()
            .mode()
            & 0o777
    };
    let created = sandbox.dir.path().join("logs/cni.log");
    let netconf = sandbox.netconf("1.0.0", json!({"log_file_path": created}));
    cni("ADD", "c1", "eth0", &netconf, &[]).success_json("ADD");
    assert!(std::fs::read_to_string(&created)
        .expect("log")
        .contains("ADD done"));
    assert_eq!(
        mode(&created),
        0o600,
        "the log holds pod names and addresses"
    );
    let existing = sandbox.dir.path().join("logs/shared.log");
    std::fs::write(&existing, "").expect("write");
    std::fs::set_permissions(&existing, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    let netconf = sandbox.netconf("1.0.0", json!({"log_file_path": existing}));
    cni("ADD", "c2", "eth0", &netconf, &[]).success_json("ADD");
    assert!(std::fs::read_to_string(&existing)
        .expect("log")
        .contains("ADD done"));
    assert_eq!(
        mode(&existing),
        0o640,
        "an existing file's mode is the operator's"
    );
}

fn gc_with_null_valid_attachments_releases_everything_of_the_network_on_this_node(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let here = sandbox.netconf("1.1.0", json!({}));
    let elsewhere = sandbox.netconf("1.1.0", json!({"nodename": "node-b"}));
    cni("ADD", "a", "eth0", &here, &[]).success_json("a");
    cni("ADD", "b", "net1", &here, &[]).success_json("b");
    cni("ADD", "r", "eth0", &elsewhere, &[]).success_json("r");
    // libcni and ocicni marshal an empty Go slice as null.
    let mut gc = here.clone();
    gc.as_object_mut()
        .expect("object")
        .insert("cni.dev/valid-attachments".into(), Value::Null);
    cni("GC", "", "", &gc, &[]).assert_silent_success("GC, null list");
    let left: Vec<String> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(_, handle, _)| handle)
        .collect();
    assert_eq!(left, vec!["testnet.r"]);
    assert_eq!(
        sandbox.allocations().len(),
        6,
        "the reservations survive GC"
    );
}

/// A block that cannot be decoded (here another node's) hides no other block's stale
/// allocations: GC releases them, then fails with code 108 naming the block; once it is restored
/// GC succeeds.
fn gc_collects_past_a_block_it_cannot_decode_and_reports_it(mode: Mode) {
    gc_collects_past_damage(mode, |sandbox, _| {
        sandbox.damage_under(&ipam_core::model::keys::host_blocks_dir("node-b"))
    });
}

/// The same for the owner key of another node's address (its attributes, kept apart from its
/// block): whose that block's addresses are is unknown, every other block's are collected.
fn gc_collects_past_an_owner_key_it_cannot_decode_and_reports_it(mode: Mode) {
    gc_collects_past_damage(mode, |sandbox, theirs| {
        let block = sandbox.with_ipam(async move |ipam: &ipam_core::Ipam| {
            ipam.get_assignment(theirs)
                .await
                .expect("read")
                .expect("node-b's address is assigned")
                .block
        });
        sandbox.damage_under(&ipam_core::model::keys::block_owners_dir(&block))
    });
}

/// GC on this node with "a" valid and "b" stale, after `damage` (given node-b's address "r")
/// damaged objects that only node-b's address depends on.
fn gc_collects_past_damage(
    mode: Mode,
    damage: impl FnOnce(&Sandbox, std::net::IpAddr) -> Vec<(String, Vec<u8>)>,
) {
    let sandbox = Sandbox::in_mode(mode);
    let here = sandbox.netconf("1.1.0", json!({}));
    let elsewhere = sandbox.netconf("1.1.0", json!({"nodename": "node-b"}));
    cni("ADD", "a", "eth0", &here, &[]).success_json("a");
    cni("ADD", "b", "eth0", &here, &[]).success_json("b");
    let theirs = cni("ADD", "r", "eth0", &elsewhere, &[]).success_json("r")["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .and_then(|a| a.parse().ok())
        .expect("r's address");
    let kept = damage(&sandbox, theirs);
    assert!(!kept.is_empty(), "something of node-b's was damaged");
    let mut gc = here.clone();
    merge(
        &mut gc,
        json!({"cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}]}),
    );
    let msg = cni("GC", "", "", &gc, &[]).assert_error(108, "GC past a damaged block");
    assert!(
        msg.contains(&kept[0].0) && msg.contains("GC released 1 stale address"),
        "{msg}"
    );
    let left: Vec<String> = sandbox.with_ipam(async |ipam: &ipam_core::Ipam| {
        let (readable, _) = ipam.list_allocations_each().await.expect("list");
        readable
            .into_iter()
            .map(|a| a.handle)
            .filter(|handle| !handle.ends_with(":gateway"))
            .collect()
    });
    assert_eq!(left, vec!["testnet.a"], "b released; r unreadable");
    sandbox.restore(kept);
    cni("GC", "", "", &gc, &[]).assert_silent_success("GC, block restored");
    let left: Vec<String> = sandbox
        .container_allocations()
        .into_iter()
        .map(|(_, handle, _)| handle)
        .collect();
    assert_eq!(left, vec!["testnet.a", "testnet.r"]);
}

fn check_compares_exactly_what_the_attachment_holds_with_prev_result(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.0.0", dual_stack());
    let result = cni("ADD", "c1", "eth0", &netconf, &[]).success_json("ADD");
    let check = |container: &str, prev: Value| {
        let mut conf = netconf.clone();
        merge(&mut conf, json!({"prevResult": prev}));
        cni("CHECK", container, "eth0", &conf, &[])
    };
    // An address outside every pool (another IPAM's, or a later plugin's) is not blockipam's.
    let mut with_foreign = result.clone();
    with_foreign["ips"]
        .as_array_mut()
        .expect("ips")
        .push(json!({"address": "192.0.2.7/24"}));
    check("c1", with_foreign).assert_silent_success("prevResult with a foreign address");
    // An address the attachment holds is missing from prevResult.
    let mut v4_only = result.clone();
    v4_only["ips"].as_array_mut().expect("ips").truncate(1);
    let msg = check("c1", v4_only).assert_error(107, "held address missing from prevResult");
    assert!(msg.contains("fd00:10:244::c0"), "{msg}");
    // A container that holds nothing fails, whatever prevResult lists.
    for prev in [
        json!({"cniVersion": "1.0.0", "ips": []}),
        json!({"cniVersion": "1.0.0"}),
        json!({"cniVersion": "1.0.0", "ips": [{"address": "192.0.2.7/24"}]}),
    ] {
        let msg = check("nobody", prev.clone()).assert_error(107, &prev.to_string());
        assert!(msg.contains("holds no address"), "{prev}: {msg}");
    }
    check("c1", result).assert_silent_success("exact prevResult");
}

fn status_is_code_11_while_another_call_holds_the_node_lock(mode: Mode) {
    let sandbox = Sandbox::in_mode(mode);
    let netconf = sandbox.netconf("1.1.0", json!({"ipam_lock_timeout_seconds": 0.2}));
    cni("STATUS", "", "", &netconf, &[]).assert_silent_success("free lock");
    let held = LockFile::acquire(&sandbox.lock_path(), Duration::from_secs(5)).expect("lock");
    let msg = cni("STATUS", "", "", &netconf, &[]).assert_error(11, "lock held");
    assert!(msg.contains("lock"), "{msg}");
    drop(held);
    cni("STATUS", "", "", &netconf, &[]).assert_silent_success("lock free again");
}
