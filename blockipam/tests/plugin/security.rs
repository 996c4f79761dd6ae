//! The plugin's store access under security settings: etcd over TLS and with a password, bad ones.
//!
//! A real etcd with TLS and client-certificate authentication, and one with TLS and a user name
//! and password, serve the real plugin binary. A wrong CA, a missing key file, plain text against
//! TLS, a missing client certificate and wrong credentials each fail with a clear message and the
//! documented code within the call's deadline, and write nothing. The password never appears on
//! stdout, stderr or in the log file. An embedded store (sled or redb) whose path is a symbolic
//! link, or that another user owns, is refused and left untouched.

use crate::common;

use std::collections::BTreeMap;
use std::os::unix::fs::{chown, symlink};
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use backend_etcd::{EtcdConfig, EtcdStore};
use blockipam_store::DatastoreType;
use common::*;
use ipam_core::KvStore;
use serde_json::{json, Value};
use test_kit::etcd::{unique_prefix, EtcdServer, EtcdServerOptions, TestPki};

/// A plugin process still running after this long is hung: it is killed and the test fails.
/// Only a safety net: each failing call's bound is its `timeout_seconds`.
const HANG_GUARD: Duration = Duration::from_secs(90);
/// `timeout_seconds` of the calls that must fail.
const DEADLINE_SECONDS: u64 = 3;
/// The etcd user the plugin logs in as, and its password (distinctive, to search for).
const USER: &str = "blockipam";
const PASSWORD: &str = "Pw-7d41c-never-shown";
/// A wrong password (must not be shown either).
const WRONG_PASSWORD: &str = "Wrong-93ab-never-shown";
/// Where the test prefixes live (the user's role covers it).
const TEST_PREFIXES: &str = "/blockipam-test/";
/// `nobody`.
const OTHER_UID: u32 = 65534;

/// etcd over TLS that requires a client certificate signed by the PKI's CA.
struct MutualTls {
    pki: TestPki,
    server: EtcdServer,
}

/// etcd over TLS (server certificate only) with authentication on.
struct PasswordAuth {
    pki: TestPki,
    server: EtcdServer,
}

fn start_tls(pki: &TestPki, require_client_cert: bool) -> Result<EtcdServer, String> {
    EtcdServer::start_with(EtcdServerOptions {
        tls: Some(pki.server_tls(require_client_cert)),
        ..EtcdServerOptions::default()
    })
}

fn mutual_tls() -> &'static MutualTls {
    static SERVER: OnceLock<Result<MutualTls, String>> = OnceLock::new();
    let started = SERVER.get_or_init(|| {
        let pki = TestPki::generate()?;
        let server = start_tls(&pki, true)?;
        Ok(MutualTls { pki, server })
    });
    started
        .as_ref()
        .unwrap_or_else(|e| panic!("these tests need etcd and openssl: {e}"))
}

fn password_auth() -> &'static PasswordAuth {
    static SERVER: OnceLock<Result<PasswordAuth, String>> = OnceLock::new();
    let started = SERVER.get_or_init(|| {
        let pki = TestPki::generate()?;
        let server = start_tls(&pki, false)?;
        server.enable_auth(Some(&pki), "root-pw", USER, PASSWORD, TEST_PREFIXES)?;
        Ok(PasswordAuth { pki, server })
    });
    started
        .as_ref()
        .unwrap_or_else(|e| panic!("these tests need etcd, etcdctl and openssl: {e}"))
}

impl MutualTls {
    /// The netconf keys that reach this server properly.
    fn keys(&self) -> Value {
        json!({
            "etcd_endpoints": self.server.endpoint(),
            "etcd_ca_cert_file": self.pki.ca_cert(),
            "etcd_cert_file": self.pki.client_cert(),
            "etcd_key_file": self.pki.client_key(),
        })
    }

    fn config(&self, prefix: &str) -> EtcdConfig {
        self.server
            .config(prefix)
            .with_ca_cert(self.pki.ca_cert())
            .with_client_cert(self.pki.client_cert(), self.pki.client_key())
    }
}

impl PasswordAuth {
    fn keys(&self) -> Value {
        json!({
            "etcd_endpoints": self.server.endpoint(),
            "etcd_ca_cert_file": self.pki.ca_cert(),
            "etcd_username": USER,
            "etcd_password": PASSWORD,
        })
    }

    fn config(&self, prefix: &str) -> EtcdConfig {
        self.server
            .config(prefix)
            .with_ca_cert(self.pki.ca_cert())
            .with_credentials(USER, PASSWORD)
    }
}

/// A netconf on etcd under `prefix` with `keys` (endpoint, TLS, credentials) and `extra`.
fn etcd_netconf(sandbox: &Sandbox, prefix: &str, keys: Value, extra: Value) -> Value {
    let mut ipam = json!({
        "datastore_type": "etcdv3",
        "datastore_path": null,
        "etcd_prefix": prefix,
    });
    merge(&mut ipam, keys);
    merge(&mut ipam, extra);
    sandbox.netconf("1.0.0", ipam)
}

/// Every key under `config`'s prefix.
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

/// Runs the real plugin (see [`run_plugin_bounded`]) with this file's [`HANG_GUARD`].
fn run_plugin(command: &str, container: &str, netconf: &Value) -> Outcome {
    run_plugin_bounded(command, container, netconf, HANG_GUARD)
}

/// Asserts that no secret appears in what a call printed.
fn assert_no_secret(outcome: &Outcome, what: &str) {
    for secret in [PASSWORD, WRONG_PASSWORD] {
        assert!(
            !outcome.stdout.contains(secret) && !outcome.stderr.contains(secret),
            "{what}: a password was shown: {outcome:#?}"
        );
    }
}

#[test]
fn plugin_allocates_over_tls_with_a_client_certificate() {
    let etcd = mutual_tls();
    let prefix = unique_prefix();
    let sandbox = Sandbox::new();
    let netconf = etcd_netconf(&sandbox, &prefix, etcd.keys(), json!({}));
    let result = run_plugin("ADD", "c1", &netconf).success_json("ADD over TLS");
    let mut check = netconf.clone();
    merge(&mut check, json!({"prevResult": result}));
    run_plugin("CHECK", "c1", &check).assert_silent_success("CHECK over TLS");
    let keys = keys_under(etcd.config(&prefix));
    assert!(
        keys.iter().any(|k| k.contains("c1")),
        "the allocation is in etcd: {keys:?}"
    );
    run_plugin("DEL", "c1", &netconf).assert_silent_success("DEL over TLS");

    // A bare host:port with TLS files means https.
    let bare = json!({"etcd_endpoints": etcd.server.endpoint().trim_start_matches("https://")});
    let netconf = etcd_netconf(&sandbox, &prefix, etcd.keys(), bare);
    run_plugin("ADD", "c2", &netconf).success_json("ADD over TLS, bare endpoint");
}

#[test]
fn plugin_logs_in_with_a_password_and_never_reveals_it() {
    let etcd = password_auth();
    let prefix = unique_prefix();
    let sandbox = Sandbox::new();
    let log_file = sandbox.dir.path().join("log/blockipam.log");
    let logging = json!({"log_level": "debug", "log_file_path": log_file});
    let netconf = etcd_netconf(&sandbox, &prefix, etcd.keys(), logging.clone());

    let add = run_plugin("ADD", "c1", &netconf);
    add.success_json("ADD with a password");
    assert_no_secret(&add, "ADD");
    let keys = keys_under(etcd.config(&prefix));
    assert!(keys.iter().any(|k| k.contains("c1")), "{keys:?}");
    let del = run_plugin("DEL", "c1", &netconf);
    del.assert_silent_success("DEL with a password");
    assert_no_secret(&del, "DEL");

    // Rejected credentials: a clear error at once, in the log too, without either password.
    let mut wrong = logging.clone();
    merge(&mut wrong, json!({"etcd_password": WRONG_PASSWORD}));
    let netconf = etcd_netconf(&sandbox, &prefix, etcd.keys(), wrong);
    let outcome = run_plugin("ADD", "c2", &netconf);
    let message = outcome.assert_error(5, "ADD with a wrong password");
    assert!(
        message.contains("rejected the configured user name or password"),
        "{message}"
    );
    assert_no_secret(&outcome, "ADD with a wrong password");

    let log = std::fs::read_to_string(&log_file).expect("read the log file");
    assert!(
        log.contains("ADD done") && log.contains("rejected the configured user name"),
        "the log holds the calls: {log}"
    );
    for secret in [PASSWORD, WRONG_PASSWORD] {
        assert!(
            !log.contains(secret),
            "a password is in the log file: {log}"
        );
    }
}

/// One bad setting and what the plugin must answer.
struct BadSetting {
    what: &'static str,
    keys: Value,
    code: u64,
    says: String,
}

#[test]
fn bad_tls_settings_and_credentials_fail_clearly_by_their_deadline_and_write_nothing() {
    let tls = mutual_tls();
    let auth = password_auth();
    let other_pki = TestPki::generate().expect("a second, unrelated CA");
    let prefix = unique_prefix();
    let sandbox = Sandbox::new();
    let missing_key = sandbox.dir.path().join("missing-key.pem");
    let plain_endpoint = tls.server.endpoint().replace("https://", "http://");
    let with = |base: Value, change: Value| {
        let mut keys = base;
        merge(&mut keys, change);
        keys
    };
    let cases = [
        BadSetting {
            what: "a CA that did not sign the server's certificate",
            keys: with(
                tls.keys(),
                json!({"etcd_ca_cert_file": other_pki.ca_cert()}),
            ),
            code: 11,
            says: "invalid peer certificate".to_owned(),
        },
        BadSetting {
            what: "a key file that does not exist",
            keys: with(tls.keys(), json!({"etcd_key_file": missing_key})),
            code: 7,
            says: missing_key.display().to_string(),
        },
        BadSetting {
            what: "plain text against a TLS endpoint",
            keys: json!({"etcd_endpoints": plain_endpoint}),
            code: 11,
            says: "https:// and a CA file for a TLS etcd".to_owned(),
        },
        BadSetting {
            what: "no client certificate where one is required",
            keys: with(
                tls.keys(),
                json!({"etcd_cert_file": null, "etcd_key_file": null}),
            ),
            code: 11,
            says: "a client certificate and key when it requires them".to_owned(),
        },
        BadSetting {
            what: "a wrong password",
            keys: with(auth.keys(), json!({"etcd_password": WRONG_PASSWORD})),
            code: 5,
            says: "rejected the configured user name or password".to_owned(),
        },
        BadSetting {
            what: "an unknown user",
            keys: with(auth.keys(), json!({"etcd_username": "nobody-here"})),
            code: 5,
            says: "rejected the configured user name or password".to_owned(),
        },
        BadSetting {
            what: "no credentials where they are required",
            keys: with(
                auth.keys(),
                json!({"etcd_username": null, "etcd_password": null}),
            ),
            code: 5,
            says: "user name is empty".to_owned(),
        },
    ];
    for case in &cases {
        let netconf = etcd_netconf(
            &sandbox,
            &prefix,
            case.keys.clone(),
            json!({"timeout_seconds": DEADLINE_SECONDS}),
        );
        let started = Instant::now();
        let outcome = run_plugin("ADD", "c1", &netconf);
        let took = started.elapsed();
        let message = outcome.assert_error(case.code, case.what);
        eprintln!(
            "{}: code {} after {took:?}: {message}",
            case.what, case.code
        );
        // By its deadline: the slack covers starting the process, not waiting on etcd (the hang
        // guard is 90 s).
        assert!(
            took < Duration::from_secs(DEADLINE_SECONDS + 10),
            "{}: answered after {took:?}, past its deadline of {DEADLINE_SECONDS}s",
            case.what
        );
        assert!(message.contains(&case.says), "{}: {message}", case.what);
        assert_no_secret(&outcome, case.what);
    }
    assert_eq!(keys_under(tls.config(&prefix)), Vec::<String>::new());
    assert_eq!(keys_under(auth.config(&prefix)), Vec::<String>::new());
}

/// Creates a store with one allocation (c1) through the plugin and returns its netconf.
fn store_with_one_allocation(sandbox: &Sandbox) -> Value {
    let netconf = sandbox.netconf("1.0.0", json!({}));
    run_plugin("ADD", "c1", &netconf).success_json("ADD c1");
    netconf
}

/// The netconf with another `datastore_path`.
fn at_path(netconf: &Value, path: &Path) -> Value {
    let mut netconf = netconf.clone();
    merge(&mut netconf["ipam"], json!({"datastore_path": path}));
    netconf
}

fn a_symlinked_or_foreign_owned_store_is_refused(store_type: DatastoreType) {
    let sandbox = Sandbox::with_store(store_type);
    let netconf = store_with_one_allocation(&sandbox);
    let before = sandbox.snapshot();
    assert!(!before.is_empty());

    // A link to the store: refused, and the store behind it is untouched.
    let link = sandbox.dir.path().join("link-to-store");
    symlink(sandbox.store_path(), &link).expect("create the link");
    for command in ["ADD", "DEL"] {
        let outcome = run_plugin(command, "c2", &at_path(&netconf, &link));
        let message = outcome.assert_error(5, &format!("{command} through a link"));
        assert!(
            message.contains("symbolic link") && message.contains(&link.display().to_string()),
            "{message}"
        );
    }

    // The store owned by another user: refused, untouched.
    chown(sandbox.store_path(), Some(OTHER_UID), None).expect("chown the store to nobody");
    let outcome = run_plugin("ADD", "c2", &netconf);
    chown(sandbox.store_path(), Some(0), None).expect("chown the store back");
    let message = outcome.assert_error(5, "ADD on a store owned by nobody");
    assert!(
        message.contains(&format!("owned by uid {OTHER_UID}")),
        "{message}"
    );
    assert_eq!(sandbox.snapshot(), before, "the store changed");

    // Its rightful owner uses it as before.
    run_plugin("ADD", "c2", &netconf).success_json("ADD c2 once the owner is back");
    let handles: BTreeMap<String, usize> = sandbox.container_allocations().into_iter().fold(
        BTreeMap::new(),
        |mut by, (_, handle, _)| {
            *by.entry(handle).or_default() += 1;
            by
        },
    );
    assert_eq!(handles.len(), 2, "{handles:?}");
}

#[test]
fn a_symlinked_or_foreign_owned_sled_store_is_refused() {
    a_symlinked_or_foreign_owned_store_is_refused(DatastoreType::Sled);
}

#[test]
fn a_symlinked_or_foreign_owned_redb_store_is_refused() {
    a_symlinked_or_foreign_owned_store_is_refused(DatastoreType::Redb);
}
