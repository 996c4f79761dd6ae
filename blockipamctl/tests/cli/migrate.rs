//! `migrate`: sled → etcd and redb → sled round trips that verify, and the refusals (non-empty
//! target, the source itself, an inconsistent source) that write nothing.

use std::collections::BTreeMap;

use ipam_core::model::{encode, keys, Handle};
use ipam_core::AssignIpsRequest;
use serde_json::Value;

use crate::common::{ctl, Backend, Lab};

/// Fills a store with everything migrate must carry: two pools (one IPv6, one disabled), a
/// changed config, addresses on three hosts, a borrowed address and a block without a host.
fn populate(lab: &Lab) {
    lab.ctl(&[
        "pool",
        "add",
        "10.60.0.0/22",
        "--name",
        "main",
        "--block-size",
        "28",
    ])
    .ok();
    lab.ctl(&[
        "pool",
        "add",
        "fd00:60::/120",
        "--name",
        "v6",
        "--block-size",
        "124",
    ])
    .ok();
    lab.ctl(&["pool", "add", "10.61.0.0/24", "--name", "off", "--disabled"])
        .ok();
    lab.ctl(&["config", "set", "--max-blocks-per-host", "7"])
        .ok();
    let first = lab.assign("net.a1", "host-a");
    lab.assign("net.a2", "host-a");
    lab.assign("net.b1", "host-b");
    lab.assign("net.c1", "host-c");
    lab.with_ipam(|ipam| async move {
        let borrowed = match first {
            std::net::IpAddr::V4(v4) => {
                std::net::IpAddr::from(std::net::Ipv4Addr::from(u32::from(v4) + 7))
            }
            other => other,
        };
        ipam.assign_ips(&AssignIpsRequest {
            ips: vec![borrowed],
            handle: "net.b2".into(),
            host: "host-b".into(),
            ..AssignIpsRequest::default()
        })
        .await
        .expect("borrow");
    });
    lab.ctl(&["node", "release", "host-c"]).ok();
}

fn blocks_json(lab: &Lab) -> Value {
    lab.ctl(&["-o", "json", "show", "--blocks", "--borrowed"])
        .ok()
        .json()
}

fn migrate(source: &Lab, target: &Lab) -> crate::common::Run {
    let mut args = source.store_args();
    args.extend(["-o".to_owned(), "json".to_owned(), "migrate".to_owned()]);
    args.extend(target.target_args());
    ctl(&args, &[])
}

fn round_trip_is_equal_and_clean(from: Backend, to: Backend) {
    let source = Lab::new(from);
    populate(&source);
    let target = Lab::new(to);
    let before = source.snapshot();
    let source_view = blocks_json(&source);
    let source_config = source.ctl(&["-o", "json", "config", "show"]).ok().json();

    let run = migrate(&source, &target);
    let report = run.ok().json();
    assert_eq!(report["verified"], true);
    assert_eq!(report["keys_copied"], before.len());
    assert_eq!(report["pools"], 3);
    assert_eq!(
        report["blocks"], 3,
        "host-a's, host-b's, and host-c's block without a host"
    );
    assert_eq!(report["affine_blocks"], 2);
    assert_eq!(report["claims"], 3);
    assert_eq!(report["handles"], 5);
    assert_eq!(report["config"], true);
    assert!(report["transactions"].as_u64().is_some_and(|t| t >= 1));
    assert!(report["source"]
        .as_str()
        .is_some_and(|s| s.starts_with(source.type_name())));
    assert!(report["target"]
        .as_str()
        .is_some_and(|s| s.starts_with(target.type_name())));

    assert_eq!(
        blocks_json(&target),
        source_view,
        "show --blocks is equal on both sides"
    );
    assert_eq!(
        target.ctl(&["-o", "json", "config", "show"]).ok().json(),
        source_config
    );
    assert_eq!(
        target.ctl(&["-o", "json", "check"]).ok().json()["clean"],
        true
    );
    let copied: Vec<(String, Vec<u8>)> = target
        .snapshot()
        .into_iter()
        .map(|(k, v, _)| (k, v))
        .collect();
    let original: Vec<(String, Vec<u8>)> = before
        .iter()
        .map(|(k, v, _)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(copied, original, "every key copied byte for byte");
    assert_eq!(source.snapshot(), before, "the source is left as it was");

    // The copy is a working store: the allocator carries on where the source stopped.
    let next = target.assign("net.d1", "host-a");
    assert!(next.to_string().starts_with("10.60."), "{next}");
    target.ctl(&["check"]).ok();
}

#[test]
fn migrate_sled_to_etcd_copies_everything_and_verifies() {
    round_trip_is_equal_and_clean(Backend::Sled, Backend::Etcd);
}

#[test]
fn migrate_redb_to_sled_copies_everything_and_verifies() {
    round_trip_is_equal_and_clean(Backend::Redb, Backend::Sled);
}

#[test]
fn migrate_etcd_to_redb_copies_everything_and_verifies() {
    round_trip_is_equal_and_clean(Backend::Etcd, Backend::Redb);
}

#[test]
fn migrate_into_a_non_empty_target_is_refused_and_writes_nothing() {
    let source = Lab::new(Backend::Sled);
    populate(&source);
    for to in [Backend::Redb, Backend::Etcd] {
        let target = Lab::new(to);
        target.ctl(&["pool", "add", "192.168.0.0/24"]).ok();
        let (source_before, target_before) = (source.snapshot(), target.snapshot());
        let run = migrate(&source, &target);
        run.expect_code(1);
        let message = run.json()["error"].as_str().unwrap_or_default().to_owned();
        assert!(message.contains("not empty"), "{message}");
        assert!(run.error_line().contains("Nothing was written"));
        assert_eq!(target.snapshot(), target_before, "the target is untouched");
        assert_eq!(source.snapshot(), source_before, "the source is untouched");
    }
}

#[test]
fn migrate_into_the_source_itself_is_a_usage_error() {
    let lab = Lab::new(Backend::Sled);
    populate(&lab);
    let before = lab.snapshot();
    let run = migrate(&lab, &lab);
    run.expect_code(2);
    assert!(run.error_line().contains("is the source store itself"));
    assert_eq!(lab.snapshot(), before);
    // The source's path named as a store of another type: still the source, refused at once
    // (it was waited on for the whole lock wait, then reported as held by another process).
    let mut args = lab.store_args();
    args.extend(
        [
            "migrate",
            "--to-datastore-type",
            "redb",
            "--to-datastore-path",
        ]
        .map(String::from),
    );
    args.push(lab.path().display().to_string());
    let run = ctl(&args, &[]);
    run.expect_code(2);
    assert!(
        run.error_line().contains("is the source store itself")
            && run.error_line().contains("one path holds one store"),
        "{}",
        run.error_line()
    );
    assert_eq!(lab.snapshot(), before);
}

#[test]
fn migrate_refuses_an_inconsistent_source_and_leaves_the_target_empty() {
    let source = Lab::new(Backend::Sled);
    populate(&source);
    source.with_store(|store| async move {
        let handle = Handle {
            blocks: BTreeMap::from([("10.60.0.0/28".parse().expect("cidr"), 9)]),
            ..Handle::default()
        };
        store
            .put(&keys::handle("net.a1"), encode(&handle).expect("encode"))
            .await
            .expect("put");
    });
    let target = Lab::new(Backend::Redb);
    let run = migrate(&source, &target);
    run.expect_code(1);
    let line = run.error_line();
    assert!(
        line.contains("has 1 problem (first: ") && line.contains("check --repair"),
        "{line}"
    );
    assert!(target.snapshot().is_empty(), "nothing was copied");
}

#[test]
fn migrate_of_an_empty_source_is_refused() {
    let source = Lab::new(Backend::Redb);
    source.ctl(&["config", "show"]).expect_code(1);
    source.with_store(|_| async {});
    let target = Lab::new(Backend::Sled);
    let run = migrate(&source, &target);
    run.expect_code(1);
    assert!(run.error_line().contains("nothing to migrate"));
}

#[test]
fn migrate_leaves_agent_liveness_and_the_reclaimer_leader_behind() {
    let source = Lab::new(Backend::Sled);
    populate(&source);
    let registration = ipam_core::dead_nodes::agent_key("node-a");
    let liveness = ipam_core::dead_nodes::liveness_key("node-a");
    let countdown = ipam_core::dead_nodes::countdown_key("node-a");
    let leader = ipam_core::dead_nodes::reclaimer_leader_key();
    let keys = [liveness.clone(), countdown.clone(), leader.clone()];
    // A registration marked by a reclaimer: the mark names the source's revisions.
    let marked = br#"{"node":"node-a","registered_at":1,"agent_version":"x","missing_since":5,"missing_mark":{"countdown_revision":7,"activity_revision":0,"grace_seconds":900}}"#;
    let registration_key = registration.clone();
    source.with_store(|store| async move {
        for key in keys {
            store.put(&key, b"{}".to_vec()).await.expect("put");
        }
        store
            .put(&registration_key, marked.to_vec())
            .await
            .expect("put the registration");
    });
    let target = Lab::new(Backend::Redb);
    migrate(&source, &target).ok();
    let copied = target.snapshot();
    let copied_keys: Vec<&String> = copied.iter().map(|(key, _, _)| key).collect();
    assert!(
        !copied_keys.contains(&&liveness)
            && !copied_keys.contains(&&leader)
            && !copied_keys.contains(&&countdown),
        "a lease-bound key was copied: {copied_keys:?}"
    );
    let (_, value, _) = copied
        .iter()
        .find(|(key, _, _)| *key == registration)
        .expect("the registration is data: copied");
    let copied: ipam_core::dead_nodes::Registration =
        serde_json::from_slice(value).expect("a registration");
    assert_eq!(
        (copied.missing_mark, copied.missing_since),
        (None, None),
        "a mark naming the source's revisions was carried over"
    );
}

/// Every key under `prefix` of an etcd with authentication on, read as its root user.
fn keys_as_root(
    server: &test_kit::etcd::EtcdServer,
    prefix: &str,
    root_password: &str,
) -> Vec<ipam_core::KeyValue> {
    test_kit::block_on(async {
        use ipam_core::KvStore;
        let mut config = server.config(prefix);
        config.username = Some("root".into());
        config.password = Some(root_password.into());
        let store = backend_etcd::EtcdStore::connect(config)
            .await
            .expect("connect as root");
        store.list("").await.expect("list the target")
    })
}

/// A copy that fails part way (here the target's etcd user may write only the first keys, so the
/// second transaction is refused) is undone: the keys already copied are deleted again, the
/// error says which keys failed and how many were removed, and the target is left empty.
#[test]
fn a_copy_refused_part_way_is_undone_and_leaves_the_target_empty() {
    const USER: &str = "migrator";
    const PASSWORD: &str = "Migrator-pw-8d21";
    let source = Lab::new(Backend::Sled);
    populate(&source);
    // More keys than one transaction carries (128): 140 more addresses, each with its handle.
    source.with_ipam(|ipam| async move {
        for n in 0..140 {
            ipam.auto_assign(&ipam_core::AutoAssignRequest {
                handle: format!("net.m{n:03}"),
                host: format!("host-m{}", n % 10),
                num_v4: 1,
                ..ipam_core::AutoAssignRequest::default()
            })
            .await
            .expect("auto-assign");
        }
    });
    let before = source.snapshot();
    let keys: Vec<&str> = before.iter().map(|(key, _, _)| key.as_str()).collect();
    assert!(keys.len() > 128, "{} keys", keys.len());

    let server = test_kit::etcd::EtcdServer::start().expect("a private etcd");
    let prefix = test_kit::etcd::unique_prefix();
    // The user reads the whole prefix and writes only below the 129th key: the first
    // transaction's keys.
    let first_refused = format!("{prefix}{}", keys[128]);
    server
        .enable_auth(None, "root-pw", USER, PASSWORD, "/unused/")
        .expect("authentication on");
    let as_root = |args: &[&str]| {
        let mut with_user = vec!["--user", "root:root-pw"];
        with_user.extend_from_slice(args);
        server.etcdctl(None, &with_user).expect("etcdctl as root");
    };
    let role = format!("{USER}-role");
    as_root(&[
        "role",
        "grant-permission",
        &role,
        "--prefix=true",
        "read",
        &prefix,
    ]);
    as_root(&[
        "role",
        "grant-permission",
        &role,
        "readwrite",
        &prefix,
        &first_refused,
    ]);

    let mut args = source.store_args();
    args.extend(
        [
            "migrate",
            "--to-datastore-type",
            "etcdv3",
            "--to-etcd-endpoints",
            &server.endpoint(),
            "--to-etcd-prefix",
            &prefix,
            "--to-etcd-username",
            USER,
            "--to-etcd-password",
            PASSWORD,
        ]
        .map(String::from),
    );
    let run = ctl(&args, &[]);
    run.expect_code(1);
    let line = run.error_line();
    assert!(
        line.contains("writing keys 128..")
            && line.contains("permission denied")
            && line.contains("the 128 keys copied so far were removed from the target again"),
        "{line}"
    );
    let left = keys_as_root(&server, &prefix, "root-pw");
    assert_eq!(left, Vec::new(), "the target is left empty");
    assert_eq!(source.snapshot(), before, "the source is left as it was");
}

/// A restore into an etcd with authentication on takes the target user's password from the
/// variable `--to-etcd-password-env` names (kept out of the process list): the copy succeeds and
/// verifies. A variable that is not set is a usage error (status 2) naming it, and nothing is
/// written.
#[test]
fn a_copy_into_etcd_with_authentication_takes_the_password_from_the_named_variable() {
    const USER: &str = "restorer";
    const PASSWORD: &str = "Restorer-pw-51c7";
    let source = Lab::new(Backend::Redb);
    populate(&source);
    let before = source.snapshot();

    let server = test_kit::etcd::EtcdServer::start().expect("a private etcd");
    let prefix = test_kit::etcd::unique_prefix();
    server
        .enable_auth(None, "root-pw", USER, PASSWORD, &prefix)
        .expect("authentication on");
    let migrate_args = |password_var: &str| {
        let mut args = source.store_args();
        args.extend(
            [
                "--agent-socket",
                "none",
                "migrate",
                "--to-datastore-type",
                "etcdv3",
                "--to-etcd-endpoints",
                &server.endpoint(),
                "--to-etcd-prefix",
                &prefix,
                "--to-etcd-username",
                USER,
                "--to-etcd-password-env",
                password_var,
            ]
            .map(String::from),
        );
        args
    };
    let target_keys = || keys_as_root(&server, &prefix, "root-pw").len();

    let unset = ctl(&migrate_args("TARGET_ETCD_PASSWORD"), &[]);
    unset.expect_code(2);
    assert!(
        unset
            .error_line()
            .contains("--to-etcd-password-env names TARGET_ETCD_PASSWORD, which is not set"),
        "{}",
        unset.error_line()
    );
    assert_eq!(target_keys(), 0, "a refused copy wrote nothing");

    let wrong = ctl(
        &migrate_args("TARGET_ETCD_PASSWORD"),
        &[("TARGET_ETCD_PASSWORD", "not-the-password")],
    );
    wrong.expect_code(1);
    assert!(
        wrong
            .error_line()
            .contains("rejected the configured user name or password"),
        "{}",
        wrong.error_line()
    );
    assert_eq!(target_keys(), 0, "a refused copy wrote nothing");

    let run = ctl(
        &migrate_args("TARGET_ETCD_PASSWORD"),
        &[("TARGET_ETCD_PASSWORD", PASSWORD)],
    );
    run.ok();
    assert_eq!(
        target_keys(),
        before.len(),
        "every key of the source is copied"
    );
    assert_eq!(source.snapshot(), before, "the source is left as it was");
}
