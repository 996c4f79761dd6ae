//! `demo` against stand-in plugins (shell scripts speaking CNI, some handing calls on to the real
//! plugin): it passes the CNI environment and netconf, releases what an earlier run left, waits
//! for a held store only as long as asked, cleans up after a failure, and fails when a plugin
//! misbehaves (a refused DEL, an address left allocated, one in another node's block). The run
//! with the real `blockipam` plugin alone is in `tests/demo.rs`.

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

/// Runs `demo` as [`demo`] does, asserting that it fails (status 1); the run and its one error line.
fn failed_demo(dir: &Path, plugin: &Path, extra: &[&str]) -> (crate::common::Run, String) {
    let run = demo(dir, plugin, extra);
    run.expect_code(1);
    let line = run.error_line();
    (run, line)
}

/// `demo` flags for one container on each of `n` nodes.
fn one_container_on(nodes: &str) -> [&str; 4] {
    ["--nodes", nodes, "--containers-per-node", "1"]
}

#[test]
fn demo_fails_clearly_when_the_plugin_binary_is_missing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, line) = failed_demo(dir.path(), &dir.path().join("no-such-plugin"), &[]);
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
    let (run, line) = failed_demo(dir.path(), &plugin, &one_container_on("2"));
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
    let store = std::fs::canonicalize(demo_store(dir.path())).expect("the demo store exists");
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
    let (run, line) = failed_demo(dir.path(), &plugin, &[]);
    assert!(line.contains("no block holds 10.77.0.1"), "{line}");
    run.stdout_has("blockipamctl show --blocks");
}

/// The real plugin, built beside blockipamctl, for stand-ins that hand some calls on to it.
fn real_plugin() -> PathBuf {
    test_kit::plugin::build_plugin_beside(Path::new(crate::common::BIN))
}

/// The store `demo --dir <dir>/demo` runs on.
fn demo_store(dir: &Path) -> PathBuf {
    dir.join("demo").join("store.sled")
}

/// Runs blockipamctl on the demo store, asserting success.
fn on_demo_store(dir: &Path, args: &[&str]) -> crate::common::Run {
    let mut full = vec![
        "--datastore-path".to_owned(),
        demo_store(dir).display().to_string(),
    ];
    full.extend(args.iter().map(|a| (*a).to_owned()));
    let run = ctl(&full, &[]);
    run.ok();
    run
}

/// The demo store's pool table as `show -o json` reads it.
fn demo_pools(dir: &Path) -> serde_json::Value {
    on_demo_store(dir, &["-o", "json", "show"]).json()["pools"].clone()
}

#[test]
fn demo_releases_what_an_earlier_run_left_and_says_how_much() {
    let dir = tempfile::tempdir().expect("tempdir");
    on_demo_store(
        dir.path(),
        &["pool", "add", "10.77.0.0/16", "--name", "demo"],
    );
    on_demo_store(
        dir.path(),
        &["tunnel-address", "assign", "node-1", "--type", "ipip"],
    );
    on_demo_store(
        dir.path(),
        &["tunnel-address", "assign", "node-2", "--type", "ipip"],
    );
    assert_eq!(demo_pools(dir.path())[0]["in_use"], 2);
    // A plugin that refuses every ADD: the demo fails, after its preparation.
    let plugin = fake_plugin(
        dir.path(),
        "if [ \"$CNI_COMMAND\" = ADD ]; then \
         printf '{\"cniVersion\":\"1.0.0\",\"code\":11,\"msg\":\"refused\"}'; exit 1; fi",
    );
    let run = demo(dir.path(), &plugin, &[]);
    run.expect_code(1);
    run.stdout_has("Using the store's pools: demo (10.77.0.0/16, /26 blocks).")
        .stdout_has("Released 2 addresses left by an earlier run that stopped half-way.");
    assert_eq!(demo_pools(dir.path())[0]["in_use"], 0, "both released");

    let run = demo(dir.path(), &plugin, &[]);
    run.expect_code(1);
    assert!(
        !run.stdout.contains("Released"),
        "nothing was left this time:\n{}",
        run.stdout
    );
}

#[test]
fn demo_reports_a_del_the_plugin_refuses_beside_the_first_failure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin = fake_plugin(
        dir.path(),
        "if [ \"$CNI_COMMAND\" = ADD ]; then \
         printf '{\"cniVersion\":\"1.0.0\",\"code\":11,\"msg\":\"add refused\"}'; exit 1; fi; \
         echo 'del refused' >&2; exit 3",
    );
    let (run, line) = failed_demo(dir.path(), &plugin, &one_container_on("1"));
    run.stdout_has(
        "DEL demo-node-1-1 on node-1 failed: the plugin exited with status 3: del refused",
    );
    assert!(!run.stdout.contains("-> released"), "{}", run.stdout);
    assert!(
        line.contains("add refused") && line.contains("(and 1 more problems, listed above)"),
        "{line}"
    );
}

#[test]
fn demo_fails_when_a_del_leaves_the_address_allocated() {
    let dir = tempfile::tempdir().expect("tempdir");
    // ADD by the real plugin; DEL answers success and releases nothing.
    let plugin = fake_plugin(
        dir.path(),
        &format!(
            "if [ \"$CNI_COMMAND\" = ADD ]; then printf '%s' \"$input\" | '{real}'; exit $?; fi",
            real = real_plugin().display()
        ),
    );
    let (_, line) = failed_demo(dir.path(), &plugin, &one_container_on("1"));
    assert!(
        line.contains("demo failed: 1 addresses are still allocated after every DEL"),
        "{line}"
    );
    assert_eq!(demo_pools(dir.path())[0]["in_use"], 1);
}

#[test]
fn demo_fails_when_an_address_lies_in_a_block_of_another_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The real plugin, told it runs on node-2 whatever node the demo names.
    let plugin = fake_plugin(
        dir.path(),
        &format!(
            "printf '%s' \"$input\" | sed 's/\"nodename\":\"node-1\"/\"nodename\":\"node-2\"/' \
             | '{real}'",
            real = real_plugin().display()
        ),
    );
    let (run, line) = failed_demo(dir.path(), &plugin, &one_container_on("2"));
    assert!(
        line.contains("of demo-node-1-1 on node-1 lies in block 10.77.")
            && line.contains("affine to Some(\"node-2\")"),
        "{line}"
    );
    run.stdout_has("DEL demo-node-2-1 on node-2 -> released");
    assert_eq!(demo_pools(dir.path())[0]["in_use"], 0);
}

#[test]
fn demo_waits_for_a_held_store_as_long_as_lock_wait_seconds_says() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin = fake_plugin(dir.path(), "exit 0");
    on_demo_store(dir.path(), &["pool", "add", "10.77.0.0/16"]);
    let settings = blockipam_store::DatastoreSettings {
        backend: blockipam_store::Backend::Sled {
            path: Some(demo_store(dir.path())),
        },
        ..blockipam_store::DatastoreSettings::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let held = runtime.block_on(settings.open()).expect("hold the store");
    let run = ctl(
        &[
            "--lock-wait-seconds".into(),
            "0.5".into(),
            "demo".into(),
            "--dir".into(),
            dir.path().join("demo").display().to_string(),
            "--plugin".into(),
            plugin.display().to_string(),
        ],
        &[],
    );
    drop(held);
    run.expect_code(1);
    let line = run.error_line();
    assert!(
        line.contains("is held by another process or handle"),
        "{line}"
    );
    // The wait the message reports: the half second asked for, not the default of 10 s.
    let waited = line
        .split("for the whole wait (")
        .nth(1)
        .unwrap_or_else(|| panic!("no wait in {line}"));
    let number: String = waited
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let unit: String = waited[number.len()..]
        .chars()
        .take_while(char::is_ascii_alphabetic)
        .collect();
    let value: f64 = number.parse().expect("a number of the wait");
    let seconds = match unit.as_str() {
        "s" => value,
        "ms" => value / 1e3,
        other => panic!("unexpected unit {other:?} in {line}"),
    };
    assert!(
        (0.5..5.0).contains(&seconds),
        "waited {seconds} s, not the half second asked for: {line}"
    );
    let calls = dir.path().join("calls.log");
    assert!(!calls.exists(), "no plugin call while the store was held");
}
