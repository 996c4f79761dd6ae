//! Which store the CLI opens when the type is not given (Calico's default: etcd when endpoints are),
//! and when flags and the environment name different kinds of store (the flags win).

use crate::common::*;

use ipam_core::Ipam;

/// `ETCD_ENDPOINTS` exported without `DATASTORE_TYPE` (as calicoctl users do): the CLI works on
/// that etcd, not on a local store; `DATASTORE_TYPE=sled` beside the endpoints is a usage error
/// that changes nothing; `--datastore-type sled` flags work on their local store.
#[test]
fn etcd_endpoints_without_a_type_select_etcd_and_flags_naming_a_local_store_win() {
    let lab = Lab::new(Backend::Etcd);
    let (endpoint, prefix) = lab.etcd().expect("an etcd lab");
    let env = [
        ("ETCD_ENDPOINTS", endpoint.as_str()),
        ("ETCD_PREFIX", prefix.as_str()),
    ];
    ctl(&["pool".into(), "add".into(), "10.61.0.0/24".into()], &env).ok();
    let pools = block_on(async {
        Ipam::new(lab.settings().open().await.expect("open the etcd store"))
            .list_pools()
            .await
            .expect("pools")
    });
    assert_eq!(pools.len(), 1, "the pool did not land on etcd: {pools:?}");
    assert_eq!(pools[0].cidr.to_string(), "10.61.0.0/24");

    // DATASTORE_TYPE=sled beside the endpoints: which store is meant? Refused, nothing written.
    let local = lab.dir.path().join("local.sled");
    let local_text = local.display().to_string();
    let mut contradicting = env.to_vec();
    contradicting.extend([
        ("DATASTORE_TYPE", "sled"),
        ("DATASTORE_PATH", local_text.as_str()),
    ]);
    let add_local = [
        "pool".to_owned(),
        "add".to_owned(),
        "10.62.0.0/24".to_owned(),
    ];
    let run = ctl(&add_local, &contradicting);
    run.expect_code(2);
    let message = run.error_line();
    assert!(
        message.contains("sled") && message.contains("ETCD_ENDPOINTS"),
        "{message}"
    );
    assert!(!local.exists(), "a local store was created");

    // Flags win over the environment: flags naming a local store work on it, whatever
    // ETCD_ENDPOINTS says, and etcd is left alone.
    let mut flags = vec![
        "--datastore-type".to_owned(),
        "sled".to_owned(),
        "--datastore-path".to_owned(),
        local_text.clone(),
    ];
    flags.extend(add_local);
    ctl(&flags, &env).ok();
    assert!(local.exists(), "the flags' local store was not created");
    let pools = block_on(async {
        Ipam::new(lab.settings().open().await.expect("open the etcd store"))
            .list_pools()
            .await
            .expect("pools")
    });
    assert_eq!(pools.len(), 1, "{pools:?}");
}

/// `ETCD_ENDPOINTS` of commas alone (a template that filled in no endpoint) is a usage error
/// naming the variable: it was taken as no endpoints, and `pool add` created a local sled store.
#[test]
fn an_endpoint_list_of_commas_alone_is_refused_and_creates_no_local_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let local = dir.path().join("local.sled");
    let local_text = local.display().to_string();
    for endpoints in [",", " , ,"] {
        let run = ctl(
            &["pool".into(), "add".into(), "10.63.0.0/24".into()],
            &[
                ("ETCD_ENDPOINTS", endpoints),
                ("DATASTORE_PATH", local_text.as_str()),
                ("BLOCKIPAM_AGENT_SOCKET", ""),
            ],
        );
        run.expect_code(2);
        let message = run.error_line();
        assert!(
            message.contains("commas alone") && message.contains("ETCD_ENDPOINTS"),
            "{endpoints:?}: {message}"
        );
        assert!(!local.exists(), "{endpoints:?}: a local store was created");
    }
}
