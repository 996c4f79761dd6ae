//! Which store the CLI opens when the type is not given: Calico's default, etcd when endpoints are.

use crate::common::*;

use ipam_core::Ipam;

/// `ETCD_ENDPOINTS` exported without `DATASTORE_TYPE` (as calicoctl users do): the CLI works on
/// that etcd, not on a local store; `--datastore-type sled` beside the endpoints is a usage error
/// that changes nothing.
#[test]
fn etcd_endpoints_without_a_type_select_etcd_and_a_contradicting_type_is_refused() {
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

    let local = lab.dir.path().join("local.sled");
    let run = ctl(
        &[
            "--datastore-type".into(),
            "sled".into(),
            "--datastore-path".into(),
            local.display().to_string(),
            "pool".into(),
            "add".into(),
            "10.62.0.0/24".into(),
        ],
        &env,
    );
    run.expect_code(2);
    let message = run.error_line();
    assert!(
        message.contains("sled") && message.contains("ETCD_ENDPOINTS"),
        "{message}"
    );
    assert!(!local.exists(), "a local store was created");
    let pools = block_on(async {
        Ipam::new(lab.settings().open().await.expect("open the etcd store"))
            .list_pools()
            .await
            .expect("pools")
    });
    assert_eq!(pools.len(), 1, "{pools:?}");
}
