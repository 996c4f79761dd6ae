//! `demo` against stand-in plugins (shell scripts speaking CNI): it passes the CNI environment and
//! netconf, cleans up after a failure, and fails when a plugin misbehaves. The run with the real
//! `blockipam` plugin is in `tests/demo.rs`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::common::ctl;

/// Writes an executable stand-in plugin whose body runs after it logged the call.
fn fake_plugin(dir: &Path, body: &str) -> PathBuf {
    let log = dir.join("calls.log");
    let script = format!(
        "#!/bin/sh\n\
         input=$(cat)\n\
         echo \"$CNI_COMMAND $CNI_CONTAINERID $CNI_IFNAME $CNI_NETNS $CNI_PATH\" >> '{log}'\n\
         printf '%s\\n' \"$input\" >> '{log}.stdin'\n\
         {body}\n",
        log = log.display()
    );
    let path = dir.join("blockipam");
    std::fs::write(&path, script).expect("write the stand-in plugin");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

fn demo(dir: &Path, plugin: &Path, extra: &[&str]) -> crate::common::Run {
    let mut args: Vec<String> = vec![
        "demo".into(),
        "--dir".into(),
        dir.join("demo").display().to_string(),
        "--plugin".into(),
        plugin.display().to_string(),
    ];
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    ctl(&args, &[])
}

#[test]
fn demo_fails_clearly_when_the_plugin_binary_is_missing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run = demo(dir.path(), &dir.path().join("no-such-plugin"), &[]);
    run.expect_code(1);
    let line = run.error_line();
    assert!(
        line.contains("plugin binary was not found") && line.contains("cargo build -p blockipam"),
        "{line}"
    );
    let run = ctl(
        &[
            "demo".into(),
            "--dir".into(),
            dir.path().join("d").display().to_string(),
        ],
        &[("BLOCKIPAM_PLUGIN", "/nonexistent/blockipam")],
    );
    run.expect_code(1);
    assert!(run.error_line().contains("BLOCKIPAM_PLUGIN"));
}

#[test]
fn demo_passes_the_cni_environment_and_netconf_and_catches_a_duplicate_address() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin = fake_plugin(
        dir.path(),
        "if [ \"$CNI_COMMAND\" = ADD ]; then \
         printf '{\"cniVersion\":\"1.0.0\",\"ips\":[{\"address\":\"10.77.0.5/26\"}]}'; fi",
    );
    let run = demo(
        dir.path(),
        &plugin,
        &["--nodes", "2", "--containers-per-node", "1"],
    );
    run.expect_code(1);
    let line = run.error_line();
    assert!(
        line.contains("already handed to container demo-node-1-1"),
        "{line}"
    );
    run.stdout_has("ADD demo-node-1-1 on node-1 -> 10.77.0.5/26");

    let calls = std::fs::read_to_string(dir.path().join("calls.log")).expect("call log");
    let plugin_dir = plugin.parent().expect("dir").display().to_string();
    let lines: Vec<&str> = calls.lines().collect();
    assert_eq!(
        lines,
        vec![
            format!("ADD demo-node-1-1 eth0 /var/run/netns/demo-node-1-1 {plugin_dir}"),
            format!("ADD demo-node-2-1 eth0 /var/run/netns/demo-node-2-1 {plugin_dir}"),
            format!("DEL demo-node-1-1 eth0 /var/run/netns/demo-node-1-1 {plugin_dir}"),
            format!("DEL demo-node-2-1 eth0 /var/run/netns/demo-node-2-1 {plugin_dir}"),
        ],
        "every container that was added is deleted again, even after a failure"
    );
    let inputs = std::fs::read_to_string(dir.path().join("calls.log.stdin")).expect("stdin log");
    let first: serde_json::Value =
        serde_json::from_str(inputs.lines().next().expect("a netconf")).expect("netconf JSON");
    assert_eq!(first["cniVersion"], "1.0.0");
    assert_eq!(first["ipam"]["type"], "blockipam");
    assert_eq!(first["ipam"]["datastore_type"], "sled");
    assert_eq!(first["ipam"]["nodename"], "node-1");
    let store = dir.path().join("demo").join("store.sled");
    let store = std::fs::canonicalize(&store).expect("the demo store exists");
    assert_eq!(first["ipam"]["datastore_path"], store.display().to_string());
    assert_eq!(first["ipam"]["pools"][0]["cidr"], "10.77.0.0/16");
    assert_eq!(first["ipam"]["pools"][0]["block_size"], 26);
}

#[test]
fn demo_reports_the_plugins_cni_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin = fake_plugin(
        dir.path(),
        "if [ \"$CNI_COMMAND\" = ADD ]; then \
         printf '{\"cniVersion\":\"1.0.0\",\"code\":11,\"msg\":\"boom\",\"details\":\"no luck\"}'; \
         exit 1; fi",
    );
    let run = demo(dir.path(), &plugin, &["-o", "json"]);
    run.expect_code(1);
    assert!(run
        .error_line()
        .contains("boom: no luck (CNI error code 11)"));
    assert!(run.json()["error"]
        .as_str()
        .is_some_and(|m| m.contains("boom")));
}

#[test]
fn demo_fails_when_the_plugins_answers_do_not_match_the_store() {
    // Distinct, well-formed addresses that the plugin never recorded in the store.
    let dir = tempfile::tempdir().expect("tempdir");
    let counter = dir.path().join("counter");
    let plugin = fake_plugin(
        dir.path(),
        &format!(
            "if [ \"$CNI_COMMAND\" = ADD ]; then n=$(cat '{c}' 2>/dev/null || echo 1); \
             echo $((n + 1)) > '{c}'; \
             printf '{{\"cniVersion\":\"1.0.0\",\"ips\":[{{\"address\":\"10.77.0.%s/26\"}}]}}' \"$n\"; fi",
            c = counter.display()
        ),
    );
    let run = demo(dir.path(), &plugin, &[]);
    run.expect_code(1);
    let line = run.error_line();
    assert!(line.contains("no block holds 10.77.0.1"), "{line}");
    run.stdout_has("blockipamctl show --blocks");
}
