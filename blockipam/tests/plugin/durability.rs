//! What the plugin reports as done is on disk: on an embedded store, every file an ADD or a DEL wrote is synced before the plugin writes its result (ADD) or exits (DEL), seen in its system calls under strace.

use crate::common;

use blockipam_store::DatastoreType;
use common::*;
use serde_json::json;
use test_kit::cni::{cni_env, run_cni, HANG_GUARD};
use test_kit::strace::{file_calls, strace_path, traced_args, written_and_not_synced_at_a_report};

/// Runs the plugin for `command` on `container` under strace and returns the store files it
/// wrote and did not sync before it reported.
fn unsynced_at_report(sandbox: &Sandbox, command: &str, container: &str) -> Vec<String> {
    let trace = sandbox
        .dir
        .path()
        .join(format!("{command}-{container}.strace"));
    let args = traced_args(&trace, plugin_binary());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let netconf = sandbox.netconf("1.0.0", json!({}));
    let outcome = run_cni(
        &strace_path(),
        &args,
        &cni_env(command, container, "eth0"),
        netconf.to_string().as_bytes(),
        HANG_GUARD,
    );
    assert_eq!(outcome.status, 0, "{command} {container}: {outcome:?}");
    let calls = file_calls(&std::fs::read_to_string(&trace).expect("the trace"));
    written_and_not_synced_at_a_report(&calls, &sandbox.store_path().display().to_string())
}

#[test]
fn an_add_or_a_del_is_synced_before_the_plugin_reports_it() {
    for store_type in [DatastoreType::Sled, DatastoreType::Redb] {
        let sandbox = Sandbox::with_store(store_type);
        let netconf = sandbox.netconf("1.0.0", json!({}));
        // The store and the network's set-up, untraced: what follows is a steady ADD and DEL.
        cni("ADD", "c0", "eth0", &netconf, &[]).success_json("first ADD");
        for (command, container) in [("ADD", "c1"), ("ADD", "c2"), ("DEL", "c1")] {
            let unsynced = unsynced_at_report(&sandbox, command, container);
            assert!(
                unsynced.is_empty(),
                "{store_type:?} {command} {container}: written and not synced before the \
                 plugin reported it (a power loss after the report could lose the write): \
                 {unsynced:?}"
            );
        }
    }
}
