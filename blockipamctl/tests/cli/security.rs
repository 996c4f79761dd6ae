//! Store access under security settings: etcd over TLS and with a password, bad settings, bad paths.
//!
//! The real `blockipamctl` against a real etcd with TLS and client-certificate authentication,
//! and one with TLS and a user name and password (flags `--etcd-username`/`--etcd-password`,
//! environment `ETCD_USERNAME`/`ETCD_PASSWORD`). A wrong CA, a missing key file, plain text
//! against TLS, a missing client certificate and wrong credentials each fail with a clear error
//! line and the documented exit status within `--etcd-timeout-seconds`, and write nothing; the
//! password is never printed. An embedded store whose path is a symbolic link, or that another
//! user owns, is refused and left untouched.

use std::os::unix::fs::{chown, symlink};
use std::path::Path;
use std::sync::OnceLock;

use backend_etcd::{EtcdConfig, EtcdStore};
use ipam_core::KvStore;
use test_kit::etcd::{unique_prefix, EtcdServer, EtcdServerOptions, TestPki};

use crate::common::{block_on, ctl, Backend, Lab, Run};

/// The etcd user blockipamctl logs in as, and its password (distinctive, to search for).
const USER: &str = "blockipamctl";
const PASSWORD: &str = "Ctl-pw-51e0-never-shown";
/// A wrong password (must not be shown either).
const WRONG_PASSWORD: &str = "Ctl-wrong-0c3f-never-shown";
/// Where the test prefixes live (the user's role covers it).
const TEST_PREFIXES: &str = "/blockipam-test/";
/// `--etcd-timeout-seconds` of the runs that must fail: their stated bound.
const DEADLINE_SECONDS: &str = "3";
/// `nobody`.
const OTHER_UID: u32 = 65534;

/// A TLS etcd and the PKI that signed its certificate.
struct TlsEtcd {
    pki: TestPki,
    server: EtcdServer,
}

fn start_tls(require_client_cert: bool) -> Result<TlsEtcd, String> {
    let pki = TestPki::generate()?;
    let server = EtcdServer::start_with(EtcdServerOptions {
        tls: Some(pki.server_tls(require_client_cert)),
        ..EtcdServerOptions::default()
    })?;
    Ok(TlsEtcd { pki, server })
}

/// etcd over TLS that requires a client certificate.
fn mutual_tls() -> &'static TlsEtcd {
    static SERVER: OnceLock<Result<TlsEtcd, String>> = OnceLock::new();
    SERVER
        .get_or_init(|| start_tls(true))
        .as_ref()
        .unwrap_or_else(|e| panic!("these tests need etcd and openssl: {e}"))
}

/// etcd over TLS (server certificate only) with authentication on.
fn password_auth() -> &'static TlsEtcd {
    static SERVER: OnceLock<Result<TlsEtcd, String>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let etcd = start_tls(false)?;
            etcd.server
                .enable_auth(Some(&etcd.pki), "root-pw", USER, PASSWORD, TEST_PREFIXES)?;
            Ok(etcd)
        })
        .as_ref()
        .unwrap_or_else(|e| panic!("these tests need etcd, etcdctl and openssl: {e}"))
}

fn path_text(path: &Path) -> String {
    path.display().to_string()
}

/// `--datastore-type etcdv3 --etcd-endpoints E --etcd-prefix P` and then `rest`.
fn etcd_args(endpoint: &str, prefix: &str, rest: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--datastore-type",
        "etcdv3",
        "--etcd-endpoints",
        endpoint,
        "--etcd-prefix",
        prefix,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(rest.iter().map(|s| (*s).to_owned()));
    args
}

/// Every key under a prefix, read with good settings.
fn keys_under(config: EtcdConfig) -> Vec<String> {
    block_on(async {
        let store = EtcdStore::connect(config)
            .await
            .expect("connect with good settings");
        store
            .list("")
            .await
            .expect("list")
            .into_iter()
            .map(|kv| kv.key)
            .collect()
    })
}

fn assert_no_secret(run: &Run) {
    for secret in [PASSWORD, WRONG_PASSWORD] {
        assert!(
            !run.stdout.contains(secret) && !run.stderr.contains(secret),
            "a password was shown: {run:#?}"
        );
    }
}

#[test]
fn cli_works_over_tls_with_a_client_certificate_from_flags_or_environment() {
    let etcd = mutual_tls();
    let prefix = unique_prefix();
    let (ca, cert, key) = (
        path_text(&etcd.pki.ca_cert()),
        path_text(&etcd.pki.client_cert()),
        path_text(&etcd.pki.client_key()),
    );
    let endpoint = etcd.server.endpoint();
    let args = etcd_args(
        &endpoint,
        &prefix,
        &[
            "--etcd-ca-cert-file",
            &ca,
            "--etcd-cert-file",
            &cert,
            "--etcd-key-file",
            &key,
            "pool",
            "add",
            "10.80.0.0/24",
            "--name",
            "tls-pool",
        ],
    );
    ctl(&args, &[]).ok();
    let env = [
        ("ETCD_CA_CERT_FILE", ca.as_str()),
        ("ETCD_CERT_FILE", cert.as_str()),
        ("ETCD_KEY_FILE", key.as_str()),
    ];
    let list = ctl(
        &etcd_args(&endpoint, &prefix, &["-o", "json", "pool", "list"]),
        &env,
    );
    list.ok().stdout_has("tls-pool");
    ctl(&etcd_args(&endpoint, &prefix, &["check"]), &env).ok();
}

#[test]
fn cli_logs_in_with_a_password_from_flags_or_environment_and_never_shows_it() {
    let etcd = password_auth();
    let prefix = unique_prefix();
    let ca = path_text(&etcd.pki.ca_cert());
    let endpoint = etcd.server.endpoint();
    let with_flags = etcd_args(
        &endpoint,
        &prefix,
        &[
            "--etcd-ca-cert-file",
            &ca,
            "--etcd-username",
            USER,
            "--etcd-password",
            PASSWORD,
            "pool",
            "add",
            "10.81.0.0/24",
            "--name",
            "auth-pool",
        ],
    );
    let run = ctl(&with_flags, &[]);
    run.ok();
    assert_no_secret(&run);

    let env = [
        ("ETCD_CA_CERT_FILE", ca.as_str()),
        ("ETCD_USERNAME", USER),
        ("ETCD_PASSWORD", PASSWORD),
    ];
    for command in [
        &["-o", "json", "pool", "list"][..],
        &["pool", "list"],
        &["check"],
    ] {
        let run = ctl(&etcd_args(&endpoint, &prefix, command), &env);
        run.ok();
        assert_no_secret(&run);
        if command.contains(&"list") {
            run.stdout_has("auth-pool");
        }
    }

    for output in [&[][..], &["-o", "json"]] {
        let mut rest: Vec<&str> = output.to_vec();
        rest.extend(["pool", "list"]);
        let wrong = [
            ("ETCD_CA_CERT_FILE", ca.as_str()),
            ("ETCD_USERNAME", USER),
            ("ETCD_PASSWORD", WRONG_PASSWORD),
        ];
        let run = ctl(&etcd_args(&endpoint, &prefix, &rest), &wrong);
        run.expect_code(1);
        assert!(
            run.stderr
                .contains("rejected the configured user name or password")
                || run
                    .stdout
                    .contains("rejected the configured user name or password"),
            "{run:#?}"
        );
        assert_no_secret(&run);
    }
}

#[test]
fn cli_refuses_bad_tls_settings_and_credentials_clearly_and_writes_nothing() {
    let tls = mutual_tls();
    let auth = password_auth();
    let other_pki = TestPki::generate().expect("a second, unrelated CA");
    let prefix = unique_prefix();
    let scratch = tempfile::tempdir().expect("a temporary directory");
    let missing_key = path_text(&scratch.path().join("missing-key.pem"));
    let tls_endpoint = tls.server.endpoint();
    let plain_endpoint = tls_endpoint.replace("https://", "http://");
    let (ca, cert, key) = (
        path_text(&tls.pki.ca_cert()),
        path_text(&tls.pki.client_cert()),
        path_text(&tls.pki.client_key()),
    );
    let other_ca = path_text(&other_pki.ca_cert());
    let auth_endpoint = auth.server.endpoint();
    let auth_ca = path_text(&auth.pki.ca_cert());

    type Case<'a> = (&'a str, &'a str, Vec<&'a str>, i32, &'a str);
    let cases: Vec<Case> = vec![
        (
            "a CA that did not sign the server's certificate",
            &tls_endpoint,
            vec![
                "--etcd-ca-cert-file",
                &other_ca,
                "--etcd-cert-file",
                &cert,
                "--etcd-key-file",
                &key,
            ],
            1,
            "invalid peer certificate",
        ),
        (
            "a key file that does not exist",
            &tls_endpoint,
            vec![
                "--etcd-ca-cert-file",
                &ca,
                "--etcd-cert-file",
                &cert,
                "--etcd-key-file",
                &missing_key,
            ],
            2,
            &missing_key,
        ),
        (
            "plain text against a TLS endpoint",
            &plain_endpoint,
            vec![],
            1,
            "https:// and a CA file for a TLS etcd",
        ),
        (
            "no client certificate where one is required",
            &tls_endpoint,
            vec!["--etcd-ca-cert-file", &ca],
            1,
            "a client certificate and key when it requires them",
        ),
        (
            "a wrong password",
            &auth_endpoint,
            vec![
                "--etcd-ca-cert-file",
                &auth_ca,
                "--etcd-username",
                USER,
                "--etcd-password",
                WRONG_PASSWORD,
            ],
            1,
            "rejected the configured user name or password",
        ),
        (
            "a password without a user name",
            &auth_endpoint,
            vec!["--etcd-ca-cert-file", &auth_ca, "--etcd-password", PASSWORD],
            2,
            "must be given together",
        ),
    ];
    for (what, endpoint, settings, code, says) in cases {
        let mut rest = settings.clone();
        rest.extend([
            "--etcd-timeout-seconds",
            DEADLINE_SECONDS,
            "pool",
            "add",
            "10.82.0.0/24",
        ]);
        let run = ctl(&etcd_args(endpoint, &prefix, &rest), &[]);
        run.expect_code(code);
        let line = run.error_line();
        eprintln!("{what}: exit {code}: {line}");
        assert!(line.contains(says), "{what}: {line}");
        assert_no_secret(&run);
    }
    let tls_config = tls
        .server
        .config(&prefix)
        .with_ca_cert(tls.pki.ca_cert())
        .with_client_cert(tls.pki.client_cert(), tls.pki.client_key());
    assert_eq!(keys_under(tls_config), Vec::<String>::new());
    let auth_config = auth
        .server
        .config(&prefix)
        .with_ca_cert(auth.pki.ca_cert())
        .with_credentials(USER, PASSWORD);
    assert_eq!(keys_under(auth_config), Vec::<String>::new());
}

fn cli_refuses_a_symlinked_or_foreign_owned_store(backend: Backend) {
    let lab = Lab::new(backend);
    lab.ctl(&["pool", "add", "10.83.0.0/24", "--name", "kept"])
        .ok();
    let before = lab.snapshot();
    let link = lab.dir.path().join("link-to-store");
    symlink(lab.path(), &link).expect("create the link");
    let through_link = |rest: &[&str]| {
        let mut args: Vec<String> = vec![
            "--datastore-type".to_owned(),
            lab.type_name().to_owned(),
            "--datastore-path".to_owned(),
            path_text(&link),
        ];
        args.extend(rest.iter().map(|s| (*s).to_owned()));
        ctl(&args, &[])
    };
    for command in [&["pool", "list"][..], &["pool", "add", "10.84.0.0/24"]] {
        let run = through_link(command);
        run.expect_code(1);
        let line = run.error_line();
        assert!(
            line.contains("symbolic link") && line.contains(&path_text(&link)),
            "{line}"
        );
    }

    chown(lab.path(), Some(OTHER_UID), None).expect("chown the store to nobody");
    let list = lab.ctl(&["pool", "list"]);
    let add = lab.ctl(&["pool", "add", "10.84.0.0/24"]);
    chown(lab.path(), Some(0), None).expect("chown the store back");
    for run in [list, add] {
        run.expect_code(1);
        let line = run.error_line();
        assert!(
            line.contains(&format!("owned by uid {OTHER_UID}")),
            "{line}"
        );
    }
    assert_eq!(lab.snapshot(), before, "the store changed");
    lab.ctl(&["pool", "list"]).ok().stdout_has("kept");
}

#[test]
fn cli_refuses_a_symlinked_or_foreign_owned_sled_store() {
    cli_refuses_a_symlinked_or_foreign_owned_store(Backend::Sled);
}

#[test]
fn cli_refuses_a_symlinked_or_foreign_owned_redb_store() {
    cli_refuses_a_symlinked_or_foreign_owned_store(Backend::Redb);
}
