//! Store selection: flags, then environment variables, then the plugin's defaults; and opening the
//! selected store with errors an operator can act on.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use blockipam_store::{
    agent_socket_from_text, bare_endpoint, DatastoreSettings, DatastoreType, RawDatastoreSettings,
    SecondsError, Secret, SettingsError,
};
use ipam_core::{KvError, KvStore};

use crate::cli::{self, GlobalArgs, MigrateArgs, OutputFormat};
use crate::error::{one_line, CtlError};

/// The environment the CLI reads its fallbacks from (the process environment in the binary, a map
/// in tests). Empty values count as unset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Env {
    vars: BTreeMap<String, String>,
}

impl Env {
    /// The current process's environment (variables that are not UTF-8 are ignored).
    pub fn from_process() -> Self {
        Env {
            vars: std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .collect(),
        }
    }

    /// An environment holding exactly these variables.
    pub fn new<I, K, V>(pairs: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        Env {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }

    /// The value of `name`, unless it is unset or empty.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.vars
            .get(name)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }
}

/// A flag's value, else its environment variable's, with where it came from (for messages).
fn pick<'a>(
    flag: Option<&'a str>,
    flag_name: &str,
    env: &'a Env,
    var: &str,
) -> Option<(&'a str, String)> {
    match flag {
        Some(value) => Some((value, flag_name.to_owned())),
        None => env.get(var).map(|value| (value, var.to_owned())),
    }
}

fn pick_path(flag: Option<&Path>, env: &Env, var: &str) -> Option<PathBuf> {
    flag.map(Path::to_path_buf)
        .or_else(|| env.get(var).map(PathBuf::from))
}

/// Parses a number of seconds (fractions allowed); `allow_zero` says whether 0 is accepted.
pub fn parse_seconds(text: &str, source: &str, allow_zero: bool) -> Result<Duration, CtlError> {
    blockipam_store::parse_seconds(text, allow_zero).map_err(|e| match e {
        SecondsError::NotANumber => CtlError::usage(format!(
            "invalid value {text:?} for {source}: expected a number of seconds"
        )),
        SecondsError::OutOfRange => CtlError::usage(format!(
            "invalid value {text:?} for {source}: expected {} seconds up to one day",
            if allow_zero {
                "0 or more"
            } else {
                "more than 0"
            }
        )),
    })
}

/// The output format: `-o`, else `BLOCKIPAMCTL_OUTPUT`, else table.
pub fn output_format(global: &GlobalArgs, env: &Env) -> Result<OutputFormat, CtlError> {
    if let Some(format) = global.output {
        return Ok(format);
    }
    match env.get(cli::ENV_OUTPUT) {
        None => Ok(OutputFormat::Table),
        Some(text) => OutputFormat::parse(text).ok_or_else(|| {
            CtlError::usage(format!(
                "invalid value {text:?} for {}: expected table or json",
                cli::ENV_OUTPUT
            ))
        }),
    }
}

/// How long to wait for an embedded store another process holds: `--lock-wait-seconds`, else
/// `BLOCKIPAM_LOCK_WAIT_SECONDS`, else the plugin's default (10 s).
///
/// # Errors
/// [`CtlError::Usage`] for a value that is not a number of seconds.
pub fn lock_wait(global: &GlobalArgs, env: &Env) -> Result<Duration, CtlError> {
    match pick(
        global.lock_wait_seconds.as_deref(),
        "--lock-wait-seconds",
        env,
        cli::ENV_LOCK_WAIT_SECONDS,
    ) {
        Some((text, source)) => parse_seconds(text, &source, true),
        None => Ok(DatastoreSettings::default().lock_wait),
    }
}

/// The upper bound on one etcd request: `--etcd-timeout-seconds`, else
/// `BLOCKIPAM_ETCD_TIMEOUT_SECONDS`, else none (the adapter's default). It bounds every etcd the
/// command reaches: the selected store, a `migrate` target, an `import` source.
///
/// # Errors
/// [`CtlError::Usage`] for a value that is not a number of seconds above 0.
pub fn etcd_request_timeout(global: &GlobalArgs, env: &Env) -> Result<Option<Duration>, CtlError> {
    pick(
        global.etcd_timeout_seconds.as_deref(),
        "--etcd-timeout-seconds",
        env,
        cli::ENV_ETCD_TIMEOUT_SECONDS,
    )
    .map(|(text, source)| parse_seconds(text, &source, false))
    .transpose()
}

/// Flags win over the environment, for the kind of store too: when the flags name an embedded
/// store (`--datastore-type sled|redb`, or `--datastore-path` without a type), etcd endpoints that
/// come only from the environment (an `ETCD_ENDPOINTS` exported for another tool) are ignored;
/// when they name etcd, an embedded path that comes only from the environment is. What one level
/// says against itself (`DATASTORE_TYPE=sled` beside `ETCD_ENDPOINTS`, or both flags) is still
/// refused by [`DatastoreSettings::from_raw`].
fn ignore_environment_the_flags_override(global: &GlobalArgs, raw: &mut RawDatastoreSettings) {
    let given = |flag: Option<&str>| flag.is_some_and(|text| !text.trim().is_empty());
    let type_flag = global
        .datastore_type
        .as_deref()
        .and_then(|text| text.trim().parse::<DatastoreType>().ok());
    let path_flag = global
        .datastore_path
        .as_deref()
        .is_some_and(|path| !path.as_os_str().is_empty());
    let endpoints_flag = given(global.etcd_endpoints.as_deref());
    let flags_name_embedded = match type_flag {
        Some(kind) => kind != DatastoreType::Etcdv3,
        None => path_flag && !endpoints_flag,
    };
    let flags_name_etcd = match type_flag {
        Some(kind) => kind == DatastoreType::Etcdv3,
        None => endpoints_flag && !path_flag,
    };
    if flags_name_embedded && !endpoints_flag {
        raw.etcd_endpoints.clear();
    }
    if flags_name_etcd && !path_flag {
        raw.path = None;
    }
}

/// The store the global flags and environment select.
///
/// # Errors
/// [`CtlError::Usage`] for a bad value or an incomplete etcd selection.
pub fn resolve(global: &GlobalArgs, env: &Env) -> Result<DatastoreSettings, CtlError> {
    let mut raw = RawDatastoreSettings::default();
    if let Some((text, source)) = pick(
        global.datastore_type.as_deref(),
        "--datastore-type",
        env,
        cli::ENV_DATASTORE_TYPE,
    ) {
        raw.datastore_type = Some(
            text.parse::<DatastoreType>()
                .map_err(|e| CtlError::usage(format!("invalid value for {source}: {e}")))?,
        );
    }
    let text = |flag: Option<&str>, flag_name: &str, var: &str| {
        pick(flag, flag_name, env, var).map(|(text, _)| text.to_owned())
    };
    raw.path = pick_path(
        global.datastore_path.as_deref(),
        env,
        cli::ENV_DATASTORE_PATH,
    );
    raw.etcd_endpoints = text(
        global.etcd_endpoints.as_deref(),
        "--etcd-endpoints",
        cli::ENV_ETCD_ENDPOINTS,
    )
    .into_iter()
    .collect();
    raw.etcd_ca_cert_file = pick_path(
        global.etcd_ca_cert_file.as_deref(),
        env,
        cli::ENV_ETCD_CA_CERT_FILE,
    );
    raw.etcd_cert_file = pick_path(
        global.etcd_cert_file.as_deref(),
        env,
        cli::ENV_ETCD_CERT_FILE,
    );
    raw.etcd_key_file = pick_path(global.etcd_key_file.as_deref(), env, cli::ENV_ETCD_KEY_FILE);
    raw.etcd_prefix = text(
        global.etcd_prefix.as_deref(),
        "--etcd-prefix",
        cli::ENV_ETCD_PREFIX,
    );
    raw.etcd_username = text(
        global.etcd_username.as_deref(),
        "--etcd-username",
        cli::ENV_ETCD_USERNAME,
    );
    raw.etcd_password = global
        .etcd_password
        .clone()
        .or_else(|| env.get(cli::ENV_ETCD_PASSWORD).map(Secret::new));
    let lock_wait = lock_wait(global, env)?;
    raw.etcd_request_timeout = etcd_request_timeout(global, env)?;
    ignore_environment_the_flags_override(global, &mut raw);
    let mut settings = DatastoreSettings {
        lock_wait,
        ..DatastoreSettings::from_raw(raw).map_err(|e| settings_error(e, ""))?
    };
    if let Some((text, _)) = pick(
        global.agent_socket.as_deref(),
        "--agent-socket",
        env,
        cli::ENV_AGENT_SOCKET,
    ) {
        settings.agent_socket = agent_socket_from_text(text);
    }
    Ok(settings)
}

/// The target store of `migrate`: its own flags (the password from the variable
/// `--to-etcd-password-env` names, looked up in `env`), the source's lock wait and agent socket,
/// and the etcd request timeout of the global flags ([`etcd_request_timeout`]).
///
/// # Errors
/// [`CtlError::Usage`] for a bad value, an incomplete etcd selection, or a password variable that
/// is not set.
pub fn resolve_target(
    args: &MigrateArgs,
    source: &DatastoreSettings,
    env: &Env,
    etcd_request_timeout: Option<Duration>,
) -> Result<DatastoreSettings, CtlError> {
    let password = match &args.to_etcd_password_env {
        Some(var) => Some(Secret::new(env.get(var).ok_or_else(|| {
            CtlError::usage(format!(
                "--to-etcd-password-env names {var}, which is not set (or empty)"
            ))
        })?)),
        None => args.to_etcd_password.clone(),
    };
    let datastore_type = args
        .to_datastore_type
        .parse::<DatastoreType>()
        .map_err(|e| CtlError::usage(format!("invalid value for --to-datastore-type: {e}")))?;
    let raw = RawDatastoreSettings {
        datastore_type: Some(datastore_type),
        path: args.to_datastore_path.clone(),
        etcd_endpoints: args.to_etcd_endpoints.iter().cloned().collect(),
        etcd_ca_cert_file: args.to_etcd_ca_cert_file.clone(),
        etcd_cert_file: args.to_etcd_cert_file.clone(),
        etcd_key_file: args.to_etcd_key_file.clone(),
        etcd_prefix: args.to_etcd_prefix.clone(),
        etcd_username: args.to_etcd_username.clone(),
        etcd_password: password,
        etcd_request_timeout,
    };
    Ok(DatastoreSettings {
        lock_wait: source.lock_wait,
        // Decided by the open mode (see `open`).
        create_if_missing: false,
        // Used only when the agent there serves this very store.
        agent_socket: source.agent_socket.clone(),
        ..DatastoreSettings::from_raw(raw).map_err(|e| settings_error(e, "to-"))?
    })
}

/// The usage error for settings that name no store, naming the flags (with `flag_prefix`) and,
/// for the global flags, the environment variable.
fn settings_error(error: SettingsError, flag_prefix: &str) -> CtlError {
    match error {
        SettingsError::NoEtcdEndpoints => {
            let env = if flag_prefix.is_empty() {
                format!(" or {}", cli::ENV_ETCD_ENDPOINTS)
            } else {
                String::new()
            };
            CtlError::usage(format!(
                "datastore type etcdv3 needs endpoints: give --{flag_prefix}etcd-endpoints{env}"
            ))
        }
        other => CtlError::usage(one_line(&KvError::from(other).to_string())),
    }
}

/// Whether opening may create a missing embedded store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Create the store when it does not exist: only `pool add`, `migrate` and `import calico`
    /// into a target, and `demo`, the commands that start a store's life.
    Create,
    /// Fail when an embedded store does not exist (every other command): a store that vanished
    /// (deleted, or on a volume that is not mounted) is never silently replaced by an empty one.
    Existing,
}

/// Opens the selected store.
///
/// # Errors
/// [`CtlError::Failed`] when the store is missing (with [`OpenMode::Existing`]), unreachable,
/// locked beyond the wait or corrupt; [`CtlError::Usage`] when the backend rejects the settings
/// themselves (bad TLS files, bad prefix).
pub async fn open(
    settings: &DatastoreSettings,
    mode: OpenMode,
) -> Result<Arc<dyn KvStore>, CtlError> {
    if mode == OpenMode::Existing && settings.etcd().is_none() {
        if let Some(path) = settings.resolved_path() {
            // Only a path that is not there at all: one that cannot be inspected (a file where
            // a directory of the path should be) is left to the store's own refusal, which
            // says why.
            if matches!(path.try_exists(), Ok(false)) {
                return Err(CtlError::failed(format!(
                    "no {} store at {}: check --datastore-path / {}; a store is created only by \
                     `blockipamctl pool add` (or `migrate` or `import calico` into it, or `demo`) or by a plugin call \
                     whose netconf lists `ipam.pools`",
                    settings.datastore_type(),
                    path.display(),
                    cli::ENV_DATASTORE_PATH
                )));
            }
        }
    }
    // The store itself refuses too (race-free, and for an empty directory or file left where
    // the store was), creating nothing.
    let settings = DatastoreSettings {
        create_if_missing: mode == OpenMode::Create,
        ..settings.clone()
    };
    settings.open().await.map_err(|e| open_error(&settings, &e))
}

fn open_error(settings: &DatastoreSettings, error: &KvError) -> CtlError {
    let message = format!(
        "cannot open the store ({}): {}",
        settings.describe(),
        one_line(&error.to_string())
    );
    match error {
        KvError::InvalidArgument { .. } => CtlError::usage(message),
        _ => CtlError::failed(message),
    }
}

/// True when both settings name the same store: the same etcd and prefix, or the same embedded
/// path, whatever embedded type each names (one path holds one store: a redb "at" a sled
/// store's path is that store, still open as the source).
pub fn same_store(a: &DatastoreSettings, b: &DatastoreSettings) -> bool {
    match (a.etcd(), b.etcd()) {
        (Some(a), Some(b)) => {
            a.endpoints.iter().any(|e| {
                b.endpoints
                    .iter()
                    .any(|f| bare_endpoint(e) == bare_endpoint(f))
            }) && a.prefix_or_default() == b.prefix_or_default()
        }
        (None, None) => {
            let canonical = |s: &DatastoreSettings| {
                s.resolved_path()
                    .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
            };
            canonical(a) == canonical(b)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockipam_store::{Backend, EtcdSettings, DEFAULT_ETCD_PREFIX};

    fn no_env() -> Env {
        Env::default()
    }

    /// `migrate` into the etcd at 127.0.0.1:2379 under `prefix`.
    fn migrate_to_etcd(prefix: Option<String>) -> MigrateArgs {
        MigrateArgs {
            to_datastore_type: "etcdv3".into(),
            to_datastore_path: None,
            to_etcd_endpoints: Some("127.0.0.1:2379".into()),
            to_etcd_ca_cert_file: None,
            to_etcd_cert_file: None,
            to_etcd_key_file: None,
            to_etcd_prefix: prefix,
            to_etcd_username: None,
            to_etcd_password_env: None,
            to_etcd_password: None,
        }
    }

    #[test]
    fn the_output_format_comes_from_the_flag_else_the_environment_else_table() {
        let from_env = |value: &str| {
            output_format(
                &GlobalArgs::default(),
                &Env::new([(cli::ENV_OUTPUT, value)]),
            )
        };
        assert_eq!(
            output_format(&GlobalArgs::default(), &no_env()),
            Ok(OutputFormat::Table)
        );
        assert_eq!(from_env("table"), Ok(OutputFormat::Table));
        assert_eq!(from_env("json"), Ok(OutputFormat::Json));
        assert_eq!(
            from_env(""),
            Ok(OutputFormat::Table),
            "empty counts as unset"
        );
        for wrong in ["JSON", "yaml", " json"] {
            let err = from_env(wrong).expect_err("refused");
            assert!(
                err.to_string().contains("expected table or json"),
                "{wrong:?}: {err}"
            );
        }
        let flag = GlobalArgs {
            output: Some(OutputFormat::Table),
            ..GlobalArgs::default()
        };
        assert_eq!(
            output_format(&flag, &Env::new([(cli::ENV_OUTPUT, "json")])),
            Ok(OutputFormat::Table),
            "the flag wins"
        );
    }

    #[test]
    fn defaults_are_the_plugins_defaults() {
        let settings = resolve(&GlobalArgs::default(), &no_env()).expect("defaults");
        assert_eq!(settings, DatastoreSettings::default());
        assert_eq!(
            settings.resolved_path(),
            Some(PathBuf::from("/var/lib/blockipam/store.sled"))
        );
    }

    #[test]
    fn environment_fills_in_what_flags_leave_out_and_flags_win() {
        let env = Env::new([
            ("DATASTORE_TYPE", "redb"),
            ("DATASTORE_PATH", "/env/store.redb"),
            ("BLOCKIPAM_LOCK_WAIT_SECONDS", "0.5"),
        ]);
        let settings = resolve(&GlobalArgs::default(), &env).expect("env");
        assert_eq!(settings.datastore_type(), DatastoreType::Redb);
        assert_eq!(settings.path(), Some(Path::new("/env/store.redb")));
        assert_eq!(settings.lock_wait, Duration::from_millis(500));
        let global = GlobalArgs {
            datastore_path: Some("/flag/store".into()),
            ..GlobalArgs::default()
        };
        let settings = resolve(&global, &env).expect("flag");
        assert_eq!(settings.path(), Some(Path::new("/flag/store")));
    }

    /// `--etcd-prefix ""` (or `--to-etcd-prefix ""`) is the default prefix, as an empty
    /// `etcd_prefix` in the plugin's netconf: the same store, the same agent.
    #[test]
    fn an_empty_etcd_prefix_is_the_default_prefix() {
        let etcd = |prefix: Option<&str>| GlobalArgs {
            datastore_type: Some("etcdv3".into()),
            etcd_endpoints: Some("127.0.0.1:2379".into()),
            etcd_prefix: prefix.map(str::to_owned),
            ..GlobalArgs::default()
        };
        let default = resolve(&etcd(None), &no_env()).expect("default prefix");
        let empty = resolve(&etcd(Some("")), &no_env()).expect("empty prefix");
        assert_eq!(empty.etcd().expect("etcd").prefix, None);
        assert_eq!(empty.identity(), default.identity());
        assert_eq!(
            default.identity().etcd_prefix.as_deref(),
            Some(DEFAULT_ETCD_PREFIX)
        );
        let migrate = migrate_to_etcd(Some(String::new()));
        let target = resolve_target(&migrate, &default, &Env::default(), None).expect("target");
        assert_eq!(target.identity(), default.identity());
    }

    /// `ETCD_ENDPOINTS` exported and no `DATASTORE_TYPE`: etcd, as calicoctl reads it;
    /// `DATASTORE_TYPE=sled` beside them is refused rather than silently local.
    #[test]
    fn etcd_endpoints_without_a_type_select_etcd() {
        let env = Env::new([("ETCD_ENDPOINTS", "http://10.0.0.1:2379")]);
        let settings = resolve(&GlobalArgs::default(), &env).expect("endpoints alone");
        assert_eq!(settings.datastore_type(), DatastoreType::Etcdv3);
        let local = Env::new([
            ("DATASTORE_TYPE", "sled"),
            ("ETCD_ENDPOINTS", "http://10.0.0.1:2379"),
        ]);
        let err = resolve(&GlobalArgs::default(), &local).expect_err("sled with endpoints");
        assert!(
            matches!(&err, CtlError::Usage(m) if m.contains("sled") && m.contains("ETCD_ENDPOINTS")),
            "{err}"
        );
    }

    /// Flags win over the environment for the kind of store: an embedded store named by flags
    /// ignores endpoints exported for another tool, etcd named by flags ignores an exported path;
    /// one level contradicting itself is still refused.
    #[test]
    fn flags_naming_a_store_kind_override_the_other_kinds_environment() {
        let env = Env::new([
            ("ETCD_ENDPOINTS", "http://10.0.0.1:2379"),
            ("DATASTORE_PATH", "/env/store.sled"),
        ]);
        let sled = GlobalArgs {
            datastore_type: Some("sled".into()),
            datastore_path: Some("/flag/store.sled".into()),
            ..GlobalArgs::default()
        };
        let settings = resolve(&sled, &env).expect("sled by flags");
        assert_eq!(settings.datastore_type(), DatastoreType::Sled);
        assert_eq!(settings.path(), Some(Path::new("/flag/store.sled")));
        let type_only = GlobalArgs {
            datastore_type: Some("redb".into()),
            ..GlobalArgs::default()
        };
        let settings = resolve(&type_only, &env).expect("a type flag alone");
        assert_eq!(settings.datastore_type(), DatastoreType::Redb);
        assert_eq!(
            settings.path(),
            Some(Path::new("/env/store.sled")),
            "the environment's path still applies to an embedded type flag"
        );
        let path_only = GlobalArgs {
            datastore_path: Some("/flag/store.sled".into()),
            ..GlobalArgs::default()
        };
        assert_eq!(
            resolve(&path_only, &env)
                .expect("a path flag")
                .datastore_type(),
            DatastoreType::Sled
        );
        let etcd = GlobalArgs {
            etcd_endpoints: Some("http://10.0.0.2:2379".into()),
            ..GlobalArgs::default()
        };
        let settings = resolve(&etcd, &env).expect("etcd by flags");
        assert_eq!(
            settings.etcd().expect("etcd").endpoints,
            ["http://10.0.0.2:2379"]
        );
        let both_flags = GlobalArgs {
            datastore_type: Some("redb".into()),
            etcd_endpoints: Some("http://10.0.0.2:2379".into()),
            ..GlobalArgs::default()
        };
        assert!(resolve(&both_flags, &no_env()).is_err());
        let env_only = Env::new([
            ("DATASTORE_TYPE", "sled"),
            ("ETCD_ENDPOINTS", "http://10.0.0.1:2379"),
        ]);
        assert!(resolve(&GlobalArgs::default(), &env_only).is_err());
    }

    #[test]
    fn empty_environment_values_count_as_unset() {
        let env = Env::new([("DATASTORE_TYPE", "")]);
        let settings = resolve(&GlobalArgs::default(), &env).expect("empty");
        assert_eq!(settings.datastore_type(), DatastoreType::Sled);
    }

    #[test]
    fn bad_values_are_usage_errors_naming_their_source() {
        let env = Env::new([("DATASTORE_TYPE", "mysql")]);
        let err = resolve(&GlobalArgs::default(), &env).expect_err("bad type");
        assert!(
            matches!(&err, CtlError::Usage(m) if m.contains("DATASTORE_TYPE")),
            "{err}"
        );
        let global = GlobalArgs {
            lock_wait_seconds: Some("-1".into()),
            ..GlobalArgs::default()
        };
        let err = resolve(&global, &no_env()).expect_err("bad wait");
        assert!(
            matches!(&err, CtlError::Usage(m) if m.contains("--lock-wait-seconds")),
            "{err}"
        );
        let global = GlobalArgs {
            etcd_timeout_seconds: Some("0".into()),
            ..GlobalArgs::default()
        };
        assert!(matches!(
            resolve(&global, &no_env()),
            Err(CtlError::Usage(_))
        ));
    }

    #[test]
    fn etcd_needs_endpoints_and_paired_certificates() {
        let global = GlobalArgs {
            datastore_type: Some("etcdv3".into()),
            ..GlobalArgs::default()
        };
        let err = resolve(&global, &no_env()).expect_err("no endpoints");
        assert!(
            matches!(&err, CtlError::Usage(m) if m.contains("ETCD_ENDPOINTS")),
            "{err}"
        );
        let env = Env::new([
            ("ETCD_ENDPOINTS", "127.0.0.1:2379"),
            ("ETCD_CERT_FILE", "/c.pem"),
        ]);
        assert!(matches!(resolve(&global, &env), Err(CtlError::Usage(_))));
    }

    #[test]
    fn etcd_credentials_come_from_flags_or_environment_in_pairs() {
        let global = GlobalArgs {
            datastore_type: Some("etcdv3".into()),
            etcd_endpoints: Some("127.0.0.1:1".into()),
            ..GlobalArgs::default()
        };
        let env = Env::new([("ETCD_USERNAME", "env-user"), ("ETCD_PASSWORD", "env-pw")]);
        let settings = resolve(&global, &env).expect("credentials from the environment");
        let etcd = settings.etcd().expect("etcd");
        assert_eq!(etcd.username.as_deref(), Some("env-user"));
        assert_eq!(etcd.password, Some(Secret::new("env-pw")));
        assert!(!format!("{settings:?}").contains("env-pw"));
        let flags = GlobalArgs {
            etcd_username: Some("flag-user".into()),
            etcd_password: Some(Secret::new("flag-pw")),
            ..global.clone()
        };
        let settings = resolve(&flags, &env).expect("flags win");
        let etcd = settings.etcd().expect("etcd");
        assert_eq!(etcd.username.as_deref(), Some("flag-user"));
        assert_eq!(etcd.password, Some(Secret::new("flag-pw")));
        let alone = Env::new([("ETCD_PASSWORD", "env-pw")]);
        let err = resolve(&global, &alone).expect_err("a password without a user");
        assert!(
            matches!(&err, CtlError::Usage(m) if m.contains("together") && !m.contains("env-pw")),
            "{err}"
        );
    }

    #[test]
    fn etcd_timeout_sets_both_timeouts_with_connect_not_longer_than_request() {
        let global = GlobalArgs {
            datastore_type: Some("etcdv3".into()),
            etcd_endpoints: Some("127.0.0.1:1".into()),
            etcd_timeout_seconds: Some("2".into()),
            ..GlobalArgs::default()
        };
        let settings = resolve(&global, &no_env()).expect("timeouts");
        assert_eq!(
            settings.etcd().expect("etcd").timeouts,
            Some((Duration::from_secs(2), Duration::from_secs(2)))
        );
    }

    /// The global etcd timeout bounds a `migrate` target on etcd whatever the source's type.
    #[test]
    fn a_migrate_target_on_etcd_takes_the_global_etcd_timeout_from_an_embedded_source() {
        let global = GlobalArgs {
            etcd_timeout_seconds: Some("2".into()),
            ..GlobalArgs::default()
        };
        let source = resolve(&global, &no_env()).expect("a sled source");
        assert_eq!(source.datastore_type(), DatastoreType::Sled);
        let migrate = migrate_to_etcd(None);
        let request = etcd_request_timeout(&global, &no_env()).expect("timeout");
        let target = resolve_target(&migrate, &source, &Env::default(), request).expect("target");
        assert_eq!(
            target.etcd().expect("etcd").timeouts,
            Some((Duration::from_secs(2), Duration::from_secs(2)))
        );
    }

    /// A `migrate` target waits for its lock as long as the source does and is reached through
    /// the same agent socket (used only when that agent serves the target).
    #[test]
    fn a_migrate_target_takes_the_sources_lock_wait_and_agent_socket() {
        let global = GlobalArgs {
            lock_wait_seconds: Some("0.5".into()),
            agent_socket: Some("/run/other/agent.sock".into()),
            ..GlobalArgs::default()
        };
        let source = resolve(&global, &no_env()).expect("a sled source");
        let migrate = MigrateArgs {
            to_datastore_type: "redb".into(),
            to_datastore_path: Some("/target/store.redb".into()),
            ..migrate_to_etcd(None)
        };
        let migrate = MigrateArgs {
            to_etcd_endpoints: None,
            ..migrate
        };
        let target = resolve_target(&migrate, &source, &Env::default(), None).expect("target");
        assert_eq!(target.datastore_type(), DatastoreType::Redb);
        assert_eq!(target.lock_wait, Duration::from_millis(500));
        assert_eq!(
            target.agent_socket.as_deref(),
            Some(Path::new("/run/other/agent.sock"))
        );
        assert!(!target.create_if_missing);
    }

    /// A timeout below one nanosecond is zero: refused like 0, not taken as a zero timeout.
    #[test]
    fn an_etcd_timeout_below_one_nanosecond_is_a_usage_error() {
        let global = GlobalArgs {
            datastore_type: Some("etcdv3".into()),
            etcd_endpoints: Some("127.0.0.1:1".into()),
            etcd_timeout_seconds: Some("1e-10".into()),
            ..GlobalArgs::default()
        };
        let err = resolve(&global, &no_env()).expect_err("a zero timeout");
        assert!(
            matches!(&err, CtlError::Usage(m) if m.contains("--etcd-timeout-seconds")),
            "{err}"
        );
    }

    #[test]
    fn same_store_compares_paths_and_etcd_prefixes() {
        let a = DatastoreSettings {
            backend: Backend::Sled {
                path: Some("/x/store".into()),
            },
            ..DatastoreSettings::default()
        };
        let mut b = a.clone();
        assert!(same_store(&a, &b));
        b.backend = Backend::Sled {
            path: Some("/y/store".into()),
        };
        assert!(!same_store(&a, &b));
        b.backend = Backend::Redb {
            path: Some("/x/store".into()),
        };
        assert!(
            same_store(&a, &b),
            "one path holds one store, whatever its type"
        );
        let etcd = |endpoint: &str, prefix: Option<&str>| DatastoreSettings {
            backend: Backend::Etcd(EtcdSettings {
                endpoints: vec![endpoint.into()],
                prefix: prefix.map(str::to_owned),
                ..EtcdSettings::default()
            }),
            ..DatastoreSettings::default()
        };
        let e1 = etcd("127.0.0.1:1", None);
        let e2 = etcd("http://127.0.0.1:1", None);
        assert!(
            same_store(&e1, &e2),
            "a scheme does not make another endpoint"
        );
        let e2 = etcd("http://127.0.0.1:1", Some("/other/"));
        assert!(!same_store(&e1, &e2));
        assert!(!same_store(&a, &e1) && !same_store(&e1, &a));
    }
}
