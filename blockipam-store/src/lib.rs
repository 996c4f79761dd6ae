//! Store selection shared by the plugin and the CLI: which backend, where, and how to open it.

use std::fmt;
pub mod countdowns;
#[cfg(feature = "clap")]
pub mod flags;
pub mod node_name;
pub mod plugin_call;
pub mod seconds;

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_agent::{AgentConfig, AgentStore};
use backend_etcd::{EtcdConfig, EtcdStore};
use backend_redb::{RedbConfig, RedbStore};
use backend_sled::{SledConfig, SledStore};
use ipam_core::lockfile::DEFAULT_LOCK_WAIT;
use ipam_core::{KvError, KvStore};

/// Which store an agent serves, as settings name it ([`DatastoreSettings::identity`]).
pub use backend_agent::StoreIdentity;
pub use backend_agent::DEFAULT_AGENT_SOCKET;
/// How long connecting to etcd may take by default; a shorter request timeout bounds it too.
pub use backend_etcd::DEFAULT_CONNECT_TIMEOUT as DEFAULT_ETCD_CONNECT_TIMEOUT;
/// The etcd key prefix when none is given (an empty one included).
pub use backend_etcd::DEFAULT_PREFIX as DEFAULT_ETCD_PREFIX;
pub use seconds::{parse_seconds, seconds_from_f64, SecondsError, MAX_SECONDS};

/// Directory the embedded stores live in by default.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/blockipam";

/// How often a call that found no agent, and waits for an embedded store's lock, looks again for
/// one: a starting agent takes the store's lock before it binds its socket, and keeps it.
pub const AGENT_RECHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Which store to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DatastoreType {
    /// Embedded sled database (the default local mode).
    #[default]
    Sled,
    /// Embedded redb database (one file).
    Redb,
    /// An etcd v3 cluster.
    Etcdv3,
}

impl DatastoreType {
    /// The name used in netconf, flags and environment variables.
    pub fn as_str(self) -> &'static str {
        match self {
            DatastoreType::Sled => "sled",
            DatastoreType::Redb => "redb",
            DatastoreType::Etcdv3 => "etcdv3",
        }
    }

    /// Where this embedded store lives when no path is given.
    pub fn default_path(self) -> Option<PathBuf> {
        match self {
            DatastoreType::Sled => Some(Path::new(DEFAULT_DATA_DIR).join("store.sled")),
            DatastoreType::Redb => Some(Path::new(DEFAULT_DATA_DIR).join("store.redb")),
            DatastoreType::Etcdv3 => None,
        }
    }
}

impl std::fmt::Display for DatastoreType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DatastoreType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sled" => Ok(DatastoreType::Sled),
            "redb" => Ok(DatastoreType::Redb),
            "etcdv3" | "etcd" => Ok(DatastoreType::Etcdv3),
            "kubernetes" => Err(
                "datastore type \"kubernetes\" is not supported by blockipam; use sled, redb or etcdv3".into(),
            ),
            other => Err(format!(
                "unknown datastore type {other:?}; expected sled, redb or etcdv3"
            )),
        }
    }
}

/// A secret such as an etcd password: cloned and compared like a string, never shown by `Debug`,
/// so that no log line or error message that prints settings can reveal it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret::new(s))
    }
}

/// Everything needed to open a store: which backend with its own settings, and what applies to
/// every backend. The plugin fills it from netconf, the CLI, the agent and the load generator
/// from flags and environment variables, all through [`DatastoreSettings::from_raw`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatastoreSettings {
    /// Which backend, and its own settings.
    pub backend: Backend,
    /// Embedded stores: how long to wait for another process holding the store.
    pub lock_wait: Duration,
    /// Embedded stores: whether [`open`](Self::open) creates the store when it is missing (off by
    /// default). Only what knows the store must be new may set it: `blockipamctl pool add`,
    /// `migrate` into a target and `demo`, and a plugin call whose netconf lists `ipam.pools`.
    /// Anything else fails on a missing store instead of starting an empty one over addresses
    /// that are still in use (a deleted store, an unmounted volume). etcd ignores it: an empty
    /// key prefix cannot be told from a first run, so an etcd store is never "missing".
    pub create_if_missing: bool,
    /// The node agent's socket (default [`DEFAULT_AGENT_SOCKET`]; `None`: never use an agent).
    /// When a socket file is there, [`open`](Self::open) reaches the store through the agent if
    /// the agent serves the store these settings name, and opens it directly if it serves
    /// another; a socket that does not answer in time is [`KvError::Unavailable`]. No socket
    /// file: the store is opened directly.
    pub agent_socket: Option<PathBuf>,
}

/// Which backend, each with only its own settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// Embedded sled database (the default local mode).
    Sled {
        /// The database path (default under [`DEFAULT_DATA_DIR`]).
        path: Option<PathBuf>,
    },
    /// Embedded redb database (one file).
    Redb {
        /// The database file (default under [`DEFAULT_DATA_DIR`]).
        path: Option<PathBuf>,
    },
    /// An etcd v3 cluster.
    Etcd(EtcdSettings),
}

impl Default for Backend {
    fn default() -> Self {
        Backend::Sled { path: None }
    }
}

impl Backend {
    /// The embedded backend of type `datastore_type` at `path`; `None` for etcd, which has no
    /// path.
    pub fn embedded(datastore_type: DatastoreType, path: Option<PathBuf>) -> Option<Backend> {
        match datastore_type {
            DatastoreType::Sled => Some(Backend::Sled { path }),
            DatastoreType::Redb => Some(Backend::Redb { path }),
            DatastoreType::Etcdv3 => None,
        }
    }

    /// The backend's type name.
    pub fn datastore_type(&self) -> DatastoreType {
        match self {
            Backend::Sled { .. } => DatastoreType::Sled,
            Backend::Redb { .. } => DatastoreType::Redb,
            Backend::Etcd(_) => DatastoreType::Etcdv3,
        }
    }
}

/// How to reach an etcd cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdSettings {
    /// Endpoints (`http://host:port` or `host:port`).
    pub endpoints: Vec<String>,
    /// Key prefix (default [`DEFAULT_ETCD_PREFIX`]).
    pub prefix: Option<String>,
    /// CA certificate file.
    pub ca_cert_file: Option<PathBuf>,
    /// Client certificate file (with `key_file`).
    pub cert_file: Option<PathBuf>,
    /// Client key file (with `cert_file`).
    pub key_file: Option<PathBuf>,
    /// User name, for clusters with authentication enabled (with `password`).
    pub username: Option<String>,
    /// Password of `username`.
    pub password: Option<Secret>,
    /// Connect and per-request timeouts (adapter defaults when `None`).
    pub timeouts: Option<(Duration, Duration)>,
    /// Skip the probe read that [`DatastoreSettings::open`] makes so that a bad endpoint, TLS
    /// setting or credential fails at once; the first real request then reports it (with the
    /// same hint). What the plugin sets: a CNI call is short and every round trip counts.
    pub lazy_connect: bool,
}

impl EtcdSettings {
    /// The prefix in use: the one given, else [`DEFAULT_ETCD_PREFIX`].
    pub fn prefix_or_default(&self) -> &str {
        self.prefix.as_deref().unwrap_or(DEFAULT_ETCD_PREFIX)
    }

    /// The connect and request timeouts for a request timeout given by a flag or variable: the
    /// request timeout, and connecting bounded by it too.
    pub fn timeouts_for_request(request: Duration) -> (Duration, Duration) {
        (request.min(DEFAULT_ETCD_CONNECT_TIMEOUT), request)
    }

    /// Checks what [`DatastoreSettings::from_raw`] checks: endpoints, and the certificate and
    /// the credentials each given whole or not at all.
    ///
    /// # Errors
    /// The first [`SettingsError`] found, in that order.
    pub fn check(&self) -> Result<(), SettingsError> {
        if self.endpoints.is_empty() {
            return Err(SettingsError::NoEtcdEndpoints);
        }
        check_etcd_pairs(
            self.cert_file.is_some(),
            self.key_file.is_some(),
            self.username.is_some(),
            self.password.is_some(),
        )
    }

    /// The etcd adapter configuration these settings describe.
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] for what [`check`](Self::check) refuses.
    pub fn config(&self) -> Result<EtcdConfig, KvError> {
        self.check()?;
        let mut config = EtcdConfig::new(self.endpoints.iter().cloned());
        if let Some(prefix) = &self.prefix {
            config = config.with_prefix(prefix.clone());
        }
        if let Some(ca) = &self.ca_cert_file {
            config = config.with_ca_cert(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) {
            config = config.with_client_cert(cert.clone(), key.clone());
        }
        if let (Some(user), Some(password)) = (&self.username, &self.password) {
            config = config.with_credentials(user.clone(), password.expose());
        }
        if let Some((connect, request)) = self.timeouts {
            config = config.with_timeouts(connect, request);
        }
        Ok(config)
    }
}

/// The certificate and the credentials each given whole or not at all.
fn check_etcd_pairs(
    cert: bool,
    key: bool,
    username: bool,
    password: bool,
) -> Result<(), SettingsError> {
    if cert != key {
        return Err(SettingsError::UnpairedClientCertificate);
    }
    if username != password {
        return Err(SettingsError::UnpairedCredentials);
    }
    Ok(())
}

/// Store settings that cannot name a store; each entry point may word it for its own keys or
/// flags, and the default wording names them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettingsError {
    /// etcd without endpoints.
    NoEtcdEndpoints,
    /// Only one of the client certificate and its key.
    UnpairedClientCertificate,
    /// Only one of the user name and the password.
    UnpairedCredentials,
    /// An embedded store type given together with etcd endpoints.
    EndpointsForEmbeddedStore(DatastoreType),
    /// No type given, and both etcd endpoints and an embedded store's path.
    EndpointsAndPath,
    /// An etcd endpoint list that is not empty but names no endpoint (`","`): taken as no
    /// endpoints, it would select the local sled store.
    EndpointListOfNothing,
}

impl fmt::Display for SettingsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SettingsError::EndpointsForEmbeddedStore(embedded) => write!(
                f,
                "datastore type {embedded} is an embedded store, but etcd endpoints are given too \
                 (etcd_endpoints / --etcd-endpoints / ETCD_ENDPOINTS); remove the endpoints, or \
                 set the datastore type to etcdv3 (or leave it out: endpoints alone mean etcd)"
            ),
            SettingsError::EndpointListOfNothing => f.write_str(
                "the etcd endpoints (etcd_endpoints / --etcd-endpoints / ETCD_ENDPOINTS) are \
                 commas alone, naming no endpoint: give host:port or http(s)://host:port entries \
                 separated by commas, or nothing at all for an embedded store",
            ),
            SettingsError::EndpointsAndPath => f.write_str(
                "both etcd endpoints and a datastore path are given, and no datastore type: set \
                 the datastore type (etcdv3, sled or redb) and remove what the other one needs",
            ),
            SettingsError::NoEtcdEndpoints => f.write_str(
                "datastore type etcdv3 needs etcd endpoints (etcd_endpoints / --etcd-endpoints / ETCD_ENDPOINTS)",
            ),
            SettingsError::UnpairedClientCertificate => {
                f.write_str("etcd client certificate and key must be given together")
            }
            SettingsError::UnpairedCredentials => {
                f.write_str("etcd user name and password must be given together")
            }
        }
    }
}

impl std::error::Error for SettingsError {}

impl From<SettingsError> for KvError {
    fn from(error: SettingsError) -> Self {
        KvError::invalid(error.to_string())
    }
}

impl Default for DatastoreSettings {
    fn default() -> Self {
        DatastoreSettings {
            backend: Backend::default(),
            lock_wait: DEFAULT_LOCK_WAIT,
            create_if_missing: false,
            agent_socket: Some(PathBuf::from(DEFAULT_AGENT_SOCKET)),
        }
    }
}

/// The store selection as an entry point received it (the plugin's netconf keys, the flags and
/// environment variables of `blockipamctl`, `blockipam-agent` and `blockipam-load`), before
/// [`DatastoreSettings::from_raw`] reads it. The type and the numbers of seconds are parsed by
/// each entry point (its errors name the key, flag or variable); everything else is read there,
/// once, the same way for all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawDatastoreSettings {
    /// Which backend; when not given, etcd if etcd endpoints are given (Calico's default for a
    /// netconf with `etcd_endpoints`), else sled.
    pub datastore_type: Option<DatastoreType>,
    /// The embedded store's path.
    pub path: Option<PathBuf>,
    /// etcd endpoints, each entry one endpoint or a comma-separated list of them.
    pub etcd_endpoints: Vec<String>,
    /// etcd CA certificate file.
    pub etcd_ca_cert_file: Option<PathBuf>,
    /// etcd client certificate file.
    pub etcd_cert_file: Option<PathBuf>,
    /// etcd client key file.
    pub etcd_key_file: Option<PathBuf>,
    /// etcd key prefix.
    pub etcd_prefix: Option<String>,
    /// etcd user name.
    pub etcd_username: Option<String>,
    /// etcd password.
    pub etcd_password: Option<Secret>,
    /// Upper bound on one etcd request, connecting included (see
    /// [`EtcdSettings::timeouts_for_request`]); the adapter's defaults when `None`.
    pub etcd_request_timeout: Option<Duration>,
}

impl RawDatastoreSettings {
    /// Checks the etcd certificate and credentials are each given whole or not at all, whatever
    /// the datastore type (what the plugin's netconf requires; [`DatastoreSettings::from_raw`]
    /// checks them for etcd only). Values that are not given (see `from_raw`) count as absent.
    ///
    /// # Errors
    /// [`SettingsError::UnpairedClientCertificate`] or [`SettingsError::UnpairedCredentials`].
    pub fn check_etcd_pairs(&self) -> Result<(), SettingsError> {
        check_etcd_pairs(
            given_path(self.etcd_cert_file.as_deref()).is_some(),
            given_path(self.etcd_key_file.as_deref()).is_some(),
            given(self.etcd_username.as_deref()).is_some(),
            given_secret(self.etcd_password.clone()).is_some(),
        )
    }
}

/// `value` without surrounding white space; `None` when nothing is left.
fn given(value: Option<&str>) -> Option<&str> {
    value.map(str::trim).filter(|text| !text.is_empty())
}

/// `path` with surrounding white space removed; `None` when nothing is left.
fn given_path(path: Option<&Path>) -> Option<PathBuf> {
    match path.map(|p| p.to_str()) {
        None => None,
        Some(Some(text)) => given(Some(text)).map(PathBuf::from),
        // Not UTF-8: taken as it is (an empty path is always UTF-8).
        Some(None) => path.map(Path::to_path_buf),
    }
}

/// A password as given (never trimmed); `None` when empty.
fn given_secret(password: Option<Secret>) -> Option<Secret> {
    password.filter(|p| !p.expose().is_empty())
}

/// The datastore type `text` names; `None` when not given (absent, empty or only white space),
/// which [`DatastoreSettings::from_raw`] resolves from the other settings.
///
/// # Errors
/// What [`DatastoreType::from_str`] refuses.
pub fn given_datastore_type(text: Option<&str>) -> Result<Option<DatastoreType>, String> {
    given(text).map(str::parse).transpose()
}

/// The agent socket an entry point's text names: `""` or `none` (surrounding white space
/// ignored) is no agent, anything else the socket at that path.
pub fn agent_socket_from_text(text: &str) -> Option<PathBuf> {
    match text.trim() {
        "" | "none" => None,
        path => Some(PathBuf::from(path)),
    }
}

impl DatastoreSettings {
    /// The settings `raw` selects, every field that `raw` does not hold at its default (callers
    /// set the lock wait, the agent socket and the open mode themselves). A value that is absent,
    /// empty or only white space is not given and takes its default, wherever it comes from: an
    /// empty etcd prefix is the default prefix `/blockipam/` (never the root of the keyspace), an
    /// empty path the type's default path, an empty endpoint list no endpoints. Other values are
    /// taken without surrounding white space, except the password, which is taken as it is.
    /// Only the selected backend's values are kept.
    ///
    /// No datastore type given: etcd when etcd endpoints are given, as Calico reads a netconf
    /// with `etcd_endpoints` and no `datastore_type`; sled otherwise.
    ///
    /// # Errors
    /// [`SettingsError::EndpointListOfNothing`] for an endpoint list of commas alone (`","`),
    /// which no one means as "no etcd"; [`SettingsError::EndpointsForEmbeddedStore`] for an
    /// embedded type given with etcd endpoints, [`SettingsError::EndpointsAndPath`] for no type
    /// with both endpoints and a path (which store is meant?), and for etcd what
    /// [`EtcdSettings::check`] refuses. etcd given with a path is not refused: the path is
    /// ignored, as it always was.
    pub fn from_raw(raw: RawDatastoreSettings) -> Result<DatastoreSettings, SettingsError> {
        let owned = |value: Option<String>| given(value.as_deref()).map(str::to_owned);
        if raw.etcd_endpoints.iter().any(|list| {
            given(Some(list.as_str())).is_some() && Self::parse_endpoints(list).is_empty()
        }) {
            return Err(SettingsError::EndpointListOfNothing);
        }
        let endpoints_given = raw
            .etcd_endpoints
            .iter()
            .any(|list| !Self::parse_endpoints(list).is_empty());
        let path_given = given_path(raw.path.as_deref()).is_some();
        let datastore_type = match raw.datastore_type {
            Some(embedded @ (DatastoreType::Sled | DatastoreType::Redb)) if endpoints_given => {
                return Err(SettingsError::EndpointsForEmbeddedStore(embedded))
            }
            Some(given) => given,
            None if endpoints_given && path_given => return Err(SettingsError::EndpointsAndPath),
            None if endpoints_given => DatastoreType::Etcdv3,
            None => DatastoreType::default(),
        };
        let backend = match datastore_type {
            DatastoreType::Sled => Backend::Sled {
                path: given_path(raw.path.as_deref()),
            },
            DatastoreType::Redb => Backend::Redb {
                path: given_path(raw.path.as_deref()),
            },
            DatastoreType::Etcdv3 => {
                let etcd = EtcdSettings {
                    endpoints: raw
                        .etcd_endpoints
                        .iter()
                        .flat_map(|list| Self::parse_endpoints(list))
                        .collect(),
                    prefix: owned(raw.etcd_prefix),
                    ca_cert_file: given_path(raw.etcd_ca_cert_file.as_deref()),
                    cert_file: given_path(raw.etcd_cert_file.as_deref()),
                    key_file: given_path(raw.etcd_key_file.as_deref()),
                    username: owned(raw.etcd_username),
                    password: given_secret(raw.etcd_password),
                    timeouts: raw
                        .etcd_request_timeout
                        .map(EtcdSettings::timeouts_for_request),
                    lazy_connect: false,
                };
                etcd.check()?;
                Backend::Etcd(etcd)
            }
        };
        Ok(DatastoreSettings {
            backend,
            ..DatastoreSettings::default()
        })
    }

    /// The backend's type name.
    pub fn datastore_type(&self) -> DatastoreType {
        self.backend.datastore_type()
    }

    /// The etcd settings, when the backend is etcd.
    pub fn etcd(&self) -> Option<&EtcdSettings> {
        match &self.backend {
            Backend::Etcd(etcd) => Some(etcd),
            _ => None,
        }
    }

    /// The etcd settings to change, when the backend is etcd.
    pub fn etcd_mut(&mut self) -> Option<&mut EtcdSettings> {
        match &mut self.backend {
            Backend::Etcd(etcd) => Some(etcd),
            _ => None,
        }
    }

    /// The embedded store's path as given (`None` for etcd, or when not given).
    pub fn path(&self) -> Option<&Path> {
        match &self.backend {
            Backend::Sled { path } | Backend::Redb { path } => path.as_deref(),
            Backend::Etcd(_) => None,
        }
    }

    /// The embedded store's path: the one given, else the type's default (`None` for etcd).
    pub fn resolved_path(&self) -> Option<PathBuf> {
        self.path()
            .map(Path::to_path_buf)
            .or_else(|| self.datastore_type().default_path())
    }

    /// Splits Calico's comma-separated `etcd_endpoints` string into endpoints.
    pub fn parse_endpoints(list: &str) -> Vec<String> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// A one-line description for messages: `sled at /var/lib/blockipam/store.sled`.
    pub fn describe(&self) -> String {
        match &self.backend {
            Backend::Etcd(etcd) => format!(
                "etcdv3 at {} (prefix {})",
                etcd.endpoints.join(","),
                etcd.prefix_or_default()
            ),
            _ => format!(
                "{} at {}",
                self.datastore_type(),
                self.resolved_path().unwrap_or_default().display()
            ),
        }
    }

    /// Opens the store these settings name, creating a missing embedded store only when
    /// [`create_if_missing`](Self::create_if_missing) is set; through the node agent when its
    /// socket is there and the agent serves this store (see [`agent_socket`](Self::agent_socket)).
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] for incomplete settings (etcd without endpoints, a client
    /// certificate without its key); [`KvError::Other`] naming the path for a missing embedded
    /// store that may not be created (nothing is created); otherwise whatever the backend reports
    /// (unavailable etcd, store locked beyond the wait, corrupt files).
    pub async fn open(&self) -> Result<Arc<dyn KvStore>, KvError> {
        self.open_noting_direct(|| {}).await
    }

    /// As [`open`](Self::open), calling `before_direct` just before the store is opened
    /// directly (not through an agent): the plugin stops its bump arena there for sled.
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub async fn open_noting_direct(
        &self,
        before_direct: impl FnOnce(),
    ) -> Result<Arc<dyn KvStore>, KvError> {
        Ok(self.open_routed(before_direct).await?.0)
    }

    /// As [`open_noting_direct`](Self::open_noting_direct), telling which way the store was
    /// reached: through the agent, or directly and why (the plugin logs it on every call).
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub async fn open_routed(
        &self,
        before_direct: impl FnOnce(),
    ) -> Result<(Arc<dyn KvStore>, StoreRoute), KvError> {
        let reason = match &self.agent_socket {
            Some(socket) => match self.open_through_agent(socket).await? {
                Ok(store) => {
                    let route = StoreRoute::Agent {
                        socket: socket.clone(),
                        served: store.served().clone(),
                    };
                    return Ok((Arc::new(store), route));
                }
                Err(reason) => reason,
            },
            None => DirectReason::NoAgentConfigured,
        };
        if let DirectReason::DeadAgent(socket) = &reason {
            // Nothing listens: the agent is dead (killed, crashed, OOM), not busy. Nothing of it
            // can be in flight, so the store is opened directly; the node keeps working (and
            // keeps showing activity) while the agent is restarted.
            tracing::warn!(
                socket = %socket.display(),
                "the agent socket is left by a dead agent (nothing accepts on it): opening the \
                 store directly"
            );
        }
        before_direct();
        match (&reason, &self.agent_socket, &self.backend) {
            (
                DirectReason::NoSocketFile(_) | DirectReason::DeadAgent(_),
                Some(socket),
                Backend::Sled { .. } | Backend::Redb { .. },
            ) => {
                self.open_directly_watching_for_an_agent(socket, reason)
                    .await
            }
            _ => Ok((self.open_directly().await?, StoreRoute::Direct(reason))),
        }
    }

    /// Opens the embedded store directly, as [`open_directly`](Self::open_directly), but while
    /// another process holds its lock, looks again for an agent at `socket` every
    /// [`AGENT_RECHECK_INTERVAL`] of the lock wait, and goes through the agent once one serves
    /// this store. An agent that starts while this call waits takes the store's lock first and
    /// binds its socket after: waiting for the lock alone would fail (after the whole wait) a call
    /// the agent was about to answer.
    ///
    /// # Errors
    /// As [`open_directly`](Self::open_directly); [`KvError::Unavailable`] when the store was
    /// held for the whole lock wait and no agent began serving it.
    async fn open_directly_watching_for_an_agent(
        &self,
        socket: &Path,
        reason: DirectReason,
    ) -> Result<(Arc<dyn KvStore>, StoreRoute), KvError> {
        let started = Instant::now();
        let mut attempt = self.clone();
        loop {
            let left = self.lock_wait.saturating_sub(started.elapsed());
            attempt.lock_wait = left.min(AGENT_RECHECK_INTERVAL);
            let held = match attempt.open_directly().await {
                Ok(store) => return Ok((store, StoreRoute::Direct(reason))),
                Err(KvError::Unavailable { message }) => message,
                Err(e) => return Err(e),
            };
            if let Ok(store) = self.open_through_agent(socket).await? {
                tracing::info!(
                    socket = %socket.display(),
                    "an agent began serving the store while this call waited for its lock"
                );
                let route = StoreRoute::Agent {
                    socket: socket.to_owned(),
                    served: store.served().clone(),
                };
                return Ok((Arc::new(store), route));
            }
            let waited = started.elapsed();
            if waited >= self.lock_wait {
                return Err(KvError::unavailable(format!(
                    "{} is held by another process for the whole wait ({waited:?}), and no agent \
                     began serving it at {} meanwhile (the last try: {held})",
                    self.describe(),
                    socket.display()
                )));
            }
        }
    }

    /// The agent at `socket` when it serves the store these settings name; otherwise why the
    /// store is to be opened directly: there is no socket (or this user cannot see it), the agent
    /// is dead, or it serves another store.
    ///
    /// # Errors
    /// [`KvError::Unavailable`] when the socket exists but the agent does not answer in time (or
    /// nothing accepts on it); [`KvError::Other`] when the path is not a socket, the agent
    /// refuses this user, or the socket is served by a user other than root or this process's own
    /// (nothing is sent to it then).
    async fn open_through_agent(
        &self,
        socket: &Path,
    ) -> Result<Result<AgentStore, DirectReason>, KvError> {
        use std::os::unix::fs::FileTypeExt;
        match std::fs::symlink_metadata(socket) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Err(DirectReason::NoSocketFile(socket.to_owned())))
            }
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                return Ok(Err(DirectReason::SocketNotVisible(socket.to_owned())))
            }
            Err(e) => {
                return Err(KvError::other(format!(
                    "cannot inspect the agent socket {}: {e}",
                    socket.display()
                )))
            }
            Ok(metadata) if !metadata.file_type().is_socket() => {
                return Err(KvError::other(format!(
                    "the agent socket path {} is not a socket; remove it, or configure another \
                     agent socket (or \"\" for none)",
                    socket.display()
                )))
            }
            Ok(_) => {}
        }
        let store = match AgentStore::connect(AgentConfig::new(socket)).await {
            Ok(store) => store,
            Err(_) if is_stale_socket(socket) => {
                return Ok(Err(DirectReason::DeadAgent(socket.to_owned())));
            }
            Err(e) => return Err(e),
        };
        let wanted = self.identity();
        if store.served().matches(&wanted) {
            Ok(Ok(store))
        } else {
            tracing::debug!(
                agent = %store.served(),
                wanted = %wanted,
                "the agent serves another store: opening this one directly"
            );
            Ok(Err(DirectReason::AgentServesAnotherStore {
                socket: socket.to_owned(),
                served: store.served().clone(),
            }))
        }
    }

    /// Which store these settings name, as an agent announces the store it serves: embedded
    /// stores by their canonical path, etcd by its endpoints (without scheme) and prefix.
    pub fn identity(&self) -> StoreIdentity {
        match &self.backend {
            Backend::Etcd(etcd) => {
                let mut endpoints: Vec<String> = etcd
                    .endpoints
                    .iter()
                    .map(|e| bare_endpoint(e).to_owned())
                    .collect();
                endpoints.sort();
                endpoints.dedup();
                StoreIdentity {
                    datastore_type: self.datastore_type().as_str().to_owned(),
                    path: None,
                    etcd_endpoints: endpoints,
                    etcd_prefix: Some(etcd.prefix_or_default().to_owned()),
                }
            }
            _ => StoreIdentity {
                datastore_type: self.datastore_type().as_str().to_owned(),
                path: self.resolved_path().map(|path| {
                    std::fs::canonicalize(&path)
                        .unwrap_or(path)
                        .display()
                        .to_string()
                }),
                etcd_endpoints: Vec::new(),
                etcd_prefix: None,
            },
        }
    }

    /// Opens the store itself, never through an agent (what the agent does).
    ///
    /// # Errors
    /// As [`open`](Self::open), without the agent's.
    pub async fn open_directly(&self) -> Result<Arc<dyn KvStore>, KvError> {
        match &self.backend {
            Backend::Sled { .. } => {
                let path = self.embedded_path()?;
                let config = SledConfig {
                    create_if_missing: self.create_if_missing,
                    ..SledConfig::new(path).with_lock_wait(self.lock_wait)
                };
                Ok(Arc::new(SledStore::open(config).await?))
            }
            Backend::Redb { .. } => {
                let path = self.embedded_path()?;
                let config = RedbConfig {
                    create_if_missing: self.create_if_missing,
                    ..RedbConfig::new(path).with_lock_wait(self.lock_wait)
                };
                Ok(Arc::new(RedbStore::open(config).await?))
            }
            Backend::Etcd(etcd) if etcd.lazy_connect => {
                Ok(Arc::new(EtcdStore::connect_lazy(etcd.config()?)?))
            }
            Backend::Etcd(etcd) => Ok(Arc::new(EtcdStore::connect(etcd.config()?).await?)),
        }
    }

    /// Refuses, before a plugin call that may create the embedded store opens it, when the store
    /// is missing and its marker ([`store_marker_path`]) says this node had one: the store was
    /// deleted or its volume is not mounted, and a new empty one would hand out addresses running
    /// pods still hold. The node agent refuses to start on the same evidence; this keeps a call
    /// whose netconf lists pools from creating the store the agent refused to replace. Nothing to
    /// check for etcd, for settings that may not create the store, or for a store that is there.
    /// (An operator's `migrate` into the store's path, the documented restore, does not ask.)
    ///
    /// # Errors
    /// [`KvError::Other`] naming the store and its marker; or when they cannot be inspected.
    pub fn refuse_to_replace_a_lost_store(&self) -> Result<(), KvError> {
        if !self.create_if_missing || matches!(self.backend, Backend::Etcd(_)) {
            return Ok(());
        }
        let Some(path) = self.resolved_path() else {
            return Ok(());
        };
        if !embedded_store_missing(&path)? {
            return Ok(());
        }
        let marker = store_marker_path(&path);
        match std::fs::symlink_metadata(&marker) {
            Ok(_) => Err(KvError::other(format!(
                "the store {} does not exist, but its marker {} says this node had a store \
                 there: it was deleted or its volume is not mounted, and addresses recorded in it \
                 may still be held by running pods, so no new empty store is created. Put the \
                 store back (or mount its volume); only if no pod on this node holds an address \
                 from it, remove the marker to start from a new empty store",
                path.display(),
                marker.display()
            ))),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(KvError::other(format!(
                "cannot inspect the store's marker {}: {err}",
                marker.display()
            ))),
        }
    }

    /// The embedded store's path, after [`check_store_path_ownership`].
    fn embedded_path(&self) -> Result<PathBuf, KvError> {
        let path = self
            .resolved_path()
            .ok_or_else(|| KvError::invalid("an embedded store needs a path"))?;
        check_store_path_ownership(&path)?;
        Ok(path)
    }
}

/// Which way [`DatastoreSettings::open_routed`] reached the store.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreRoute {
    /// Every call goes through the agent at `socket`, which serves `served` with its own
    /// settings (for etcd: its own endpoints, TLS files and credentials, not the caller's).
    Agent {
        /// The agent's socket.
        socket: PathBuf,
        /// The store the agent announced.
        served: StoreIdentity,
    },
    /// The store was opened by this process, for this reason.
    Direct(DirectReason),
}

/// Why the store was opened directly rather than through an agent.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DirectReason {
    /// No agent socket is configured (`""` or `none`).
    NoAgentConfigured,
    /// Nothing is at the socket path: no agent runs.
    NoSocketFile(PathBuf),
    /// This user may not look into the socket's directory.
    SocketNotVisible(PathBuf),
    /// A socket nothing accepts on: its agent is dead.
    DeadAgent(PathBuf),
    /// The agent at `socket` serves another store.
    AgentServesAnotherStore {
        /// The agent's socket.
        socket: PathBuf,
        /// The store it serves.
        served: StoreIdentity,
    },
}

impl fmt::Display for StoreRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreRoute::Agent { socket, served } => write!(
                f,
                "through the agent at {} (it serves {served})",
                socket.display()
            ),
            StoreRoute::Direct(reason) => write!(f, "directly: {reason}"),
        }
    }
}

impl fmt::Display for DirectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DirectReason::NoAgentConfigured => f.write_str("no agent socket is configured"),
            DirectReason::NoSocketFile(socket) => {
                write!(f, "no socket file at {} (no agent runs)", socket.display())
            }
            DirectReason::SocketNotVisible(socket) => write!(
                f,
                "this user may not look for the agent socket {}",
                socket.display()
            ),
            DirectReason::DeadAgent(socket) => write!(
                f,
                "nothing accepts on {} (its agent is dead)",
                socket.display()
            ),
            DirectReason::AgentServesAnotherStore { socket, served } => write!(
                f,
                "the agent at {} serves another store ({served})",
                socket.display()
            ),
        }
    }
}

/// An etcd endpoint without its scheme and trailing slash: `http://h:1/` and `h:1` are one
/// endpoint.
pub fn bare_endpoint(endpoint: &str) -> &str {
    endpoint
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
}

/// Refuses an embedded store path that is a symbolic link or that another user owns. The store
/// decides which pod gets which address: it must be this user's own file or directory at the
/// configured place, not whatever a link (or another account) puts there. A path that does not
/// exist yet passes (the store creates it); links in the directories above it are not checked.
///
/// # Errors
/// [`KvError::Other`] naming the path and what is wrong with it.
pub fn check_store_path_ownership(path: &Path) -> Result<(), KvError> {
    use std::os::unix::fs::MetadataExt;

    let metadata = match std::fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(KvError::other(format!(
                "cannot inspect the store path {}: {e}",
                path.display()
            )))
        }
    };
    if metadata.file_type().is_symlink() {
        let target = std::fs::read_link(path)
            .map(|target| target.display().to_string())
            .unwrap_or_else(|_| "an unreadable target".to_owned());
        return Err(KvError::other(format!(
            "refusing to open the store at {}: it is a symbolic link (to {target}); configure \
             the store's real path instead",
            path.display()
        )));
    }
    // Unknown (no /proc): the ownership rule is not applied.
    if let Some(uid) = effective_uid() {
        if metadata.uid() != uid {
            return Err(KvError::other(format!(
                "refusing to open the store at {}: it is owned by uid {}, not by uid {uid} that \
                 runs this process; give it back to its user (chown) or configure another path",
                path.display(),
                metadata.uid()
            )));
        }
    }
    Ok(())
}

/// This process's effective user id, read from `/proc/self/status`; `None` when unreadable.
pub fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// True when `socket` is a socket nobody accepts on (connecting is refused): what a killed
/// agent leaves behind. A hung agent still accepts (the kernel queues the connection) and is not
/// stale.
fn is_stale_socket(socket: &Path) -> bool {
    matches!(
        std::os::unix::net::UnixStream::connect(socket),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// The marker of the embedded store at `store`: `<store>.created` beside it. The node agent
/// writes it once the store is open (`--create-on-first-start`); while it is there, a missing
/// store is a lost one, never created anew.
pub fn store_marker_path(store: &Path) -> PathBuf {
    let mut name = store.as_os_str().to_owned();
    name.push(".created");
    PathBuf::from(name)
}

/// Whether no embedded store is at `path`: nothing there, or an empty directory (the mount point
/// of a volume that is not mounted). Anything else is a store, or damage its backend names.
fn embedded_store_missing(path: &Path) -> Result<bool, KvError> {
    let inspect_failed = |err: std::io::Error| {
        KvError::other(format!(
            "cannot inspect the store path {}: {err}",
            path.display()
        ))
    };
    match std::fs::symlink_metadata(path) {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(err) => Err(inspect_failed(err)),
        Ok(metadata) if metadata.is_dir() => Ok(std::fs::read_dir(path)
            .map_err(inspect_failed)?
            .next()
            .is_none()),
        Ok(_) => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datastore_type_names_parse_and_unknown_ones_explain_themselves() {
        assert_eq!("sled".parse::<DatastoreType>(), Ok(DatastoreType::Sled));
        assert_eq!("redb".parse::<DatastoreType>(), Ok(DatastoreType::Redb));
        assert_eq!("etcdv3".parse::<DatastoreType>(), Ok(DatastoreType::Etcdv3));
        let err = "kubernetes"
            .parse::<DatastoreType>()
            .expect_err("unsupported");
        assert!(err.contains("not supported"));
        let err = "mysql".parse::<DatastoreType>().expect_err("unknown");
        assert!(err.contains("mysql"));
    }

    #[test]
    fn endpoints_split_on_commas_and_trim() {
        assert_eq!(
            DatastoreSettings::parse_endpoints(" http://127.0.0.1:1,127.0.0.1:2 ,,"),
            vec!["http://127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()]
        );
    }

    #[test]
    fn empty_and_blank_raw_values_are_not_given_and_take_their_defaults() {
        let etcd = |prefix: Option<&str>| {
            DatastoreSettings::from_raw(RawDatastoreSettings {
                datastore_type: Some(DatastoreType::Etcdv3),
                etcd_endpoints: vec!["http://127.0.0.1:2379".into()],
                etcd_prefix: prefix.map(str::to_owned),
                ..RawDatastoreSettings::default()
            })
            .expect("etcd settings")
        };
        let prefix = |settings: &DatastoreSettings| settings.etcd().expect("etcd").prefix.clone();
        let default = etcd(None);
        assert_eq!(
            default.identity().etcd_prefix.as_deref(),
            Some(DEFAULT_ETCD_PREFIX)
        );
        for blank in ["", "  "] {
            let settings = etcd(Some(blank));
            assert_eq!(prefix(&settings), None, "{blank:?}");
            assert_eq!(settings.identity(), default.identity(), "{blank:?}");
        }
        assert_eq!(
            prefix(&etcd(Some(" /a/ "))).as_deref(),
            Some("/a/"),
            "a given prefix is kept, trimmed"
        );
        let embedded = DatastoreSettings::from_raw(RawDatastoreSettings {
            path: Some(PathBuf::from("")),
            ..RawDatastoreSettings::default()
        })
        .expect("sled settings");
        assert_eq!(embedded.path(), None);
        let settings = DatastoreSettings::from_raw(RawDatastoreSettings {
            datastore_type: Some(DatastoreType::Etcdv3),
            etcd_endpoints: vec![" h:1, ".into(), "h:2,h:3".into(), String::new()],
            etcd_ca_cert_file: Some(PathBuf::from(" ")),
            etcd_username: Some(String::new()),
            etcd_password: Some(Secret::new("")),
            ..RawDatastoreSettings::default()
        })
        .expect("etcd settings");
        let etcd_settings = settings.etcd().expect("etcd");
        assert_eq!(etcd_settings.endpoints, ["h:1", "h:2", "h:3"]);
        assert_eq!(etcd_settings.ca_cert_file, None);
        assert_eq!(etcd_settings.username, None);
        assert_eq!(etcd_settings.password, None);
        let kept = DatastoreSettings::from_raw(RawDatastoreSettings {
            datastore_type: Some(DatastoreType::Etcdv3),
            etcd_endpoints: vec!["h:1".into()],
            etcd_username: Some("u".into()),
            etcd_password: Some(Secret::new(" spaced ")),
            ..RawDatastoreSettings::default()
        })
        .expect("etcd settings");
        assert_eq!(
            kept.etcd()
                .and_then(|etcd| etcd.password.as_ref())
                .map(Secret::expose),
            Some(" spaced ")
        );
    }

    #[test]
    fn only_the_selected_backends_values_are_kept() {
        let raw = RawDatastoreSettings {
            path: Some("/x/store".into()),
            etcd_prefix: Some("/p/".into()),
            etcd_request_timeout: Some(Duration::from_secs(2)),
            ..RawDatastoreSettings::default()
        };
        let sled = DatastoreSettings::from_raw(raw.clone()).expect("sled");
        assert_eq!(
            sled.backend,
            Backend::Sled {
                path: Some("/x/store".into())
            }
        );
        let etcd = DatastoreSettings::from_raw(RawDatastoreSettings {
            datastore_type: Some(DatastoreType::Etcdv3),
            path: None,
            etcd_endpoints: vec!["h:1".into()],
            ..raw
        })
        .expect("etcd");
        assert_eq!(etcd.path(), None);
        assert_eq!(etcd.resolved_path(), None);
        let etcd = etcd.etcd().expect("etcd");
        assert_eq!(etcd.prefix.as_deref(), Some("/p/"));
        assert_eq!(
            etcd.timeouts,
            Some((Duration::from_secs(2), Duration::from_secs(2)))
        );
    }

    /// Calico's default: etcd endpoints with no type mean etcd; no type and no endpoints, sled;
    /// a type that contradicts the other settings is refused, naming both.
    #[test]
    fn the_type_follows_the_endpoints_when_not_given_and_contradictions_are_refused() {
        let endpoints = || vec![" http://h:2379 ".to_owned()];
        let settings = DatastoreSettings::from_raw(RawDatastoreSettings {
            etcd_endpoints: endpoints(),
            ..RawDatastoreSettings::default()
        })
        .expect("endpoints alone");
        assert_eq!(settings.datastore_type(), DatastoreType::Etcdv3);
        assert_eq!(settings.etcd().expect("etcd").endpoints, ["http://h:2379"]);
        let blank = DatastoreSettings::from_raw(RawDatastoreSettings {
            etcd_endpoints: vec![" ".into()],
            ..RawDatastoreSettings::default()
        })
        .expect("blank endpoints are not given");
        assert_eq!(blank.datastore_type(), DatastoreType::Sled);
        for embedded in [DatastoreType::Sled, DatastoreType::Redb] {
            let alone = DatastoreSettings::from_raw(RawDatastoreSettings {
                datastore_type: Some(embedded),
                etcd_endpoints: vec![" ".into()],
                ..RawDatastoreSettings::default()
            })
            .expect("an embedded type without endpoints");
            assert_eq!(alone.datastore_type(), embedded);
            let refused = DatastoreSettings::from_raw(RawDatastoreSettings {
                datastore_type: Some(embedded),
                etcd_endpoints: endpoints(),
                ..RawDatastoreSettings::default()
            });
            assert_eq!(
                refused,
                Err(SettingsError::EndpointsForEmbeddedStore(embedded))
            );
            let message = refused.expect_err("refused").to_string();
            assert!(
                message.contains(embedded.as_str()) && message.contains("ETCD_ENDPOINTS"),
                "{message}"
            );
        }
        let etcd_with_a_path = DatastoreSettings::from_raw(RawDatastoreSettings {
            datastore_type: Some(DatastoreType::Etcdv3),
            etcd_endpoints: endpoints(),
            path: Some("/x/store".into()),
            ..RawDatastoreSettings::default()
        })
        .expect("etcd named, the path ignored as before");
        assert_eq!(etcd_with_a_path.path(), None);
        assert_eq!(
            DatastoreSettings::from_raw(RawDatastoreSettings {
                etcd_endpoints: endpoints(),
                path: Some("/x/store".into()),
                ..RawDatastoreSettings::default()
            }),
            Err(SettingsError::EndpointsAndPath)
        );
        assert_eq!(given_datastore_type(Some(" ")), Ok(None));
        assert_eq!(
            given_datastore_type(Some("redb")),
            Ok(Some(DatastoreType::Redb))
        );
        assert!(given_datastore_type(Some("kubernetes")).is_err());
    }

    #[test]
    fn an_endpoint_list_of_commas_alone_is_refused_rather_than_taken_as_no_etcd() {
        for (datastore_type, lists) in [
            (None, vec![","]),
            (None, vec![" , ,"]),
            (Some(DatastoreType::Etcdv3), vec![",,"]),
            (None, vec!["", ","]),
        ] {
            let refused = DatastoreSettings::from_raw(RawDatastoreSettings {
                datastore_type,
                etcd_endpoints: lists.iter().map(|l| (*l).to_owned()).collect(),
                ..RawDatastoreSettings::default()
            });
            assert_eq!(
                refused,
                Err(SettingsError::EndpointListOfNothing),
                "{lists:?}"
            );
        }
        // Empty or blank values are not given: no endpoints, the default store.
        for blank in ["", "  "] {
            let settings = DatastoreSettings::from_raw(RawDatastoreSettings {
                etcd_endpoints: vec![blank.to_owned()],
                ..RawDatastoreSettings::default()
            })
            .expect("a blank list is no list");
            assert_eq!(settings.datastore_type(), DatastoreType::Sled);
        }
    }

    #[test]
    fn etcd_settings_are_refused_without_endpoints_or_with_half_a_pair() {
        let etcd = |raw: RawDatastoreSettings| {
            DatastoreSettings::from_raw(RawDatastoreSettings {
                datastore_type: Some(DatastoreType::Etcdv3),
                ..raw
            })
        };
        assert_eq!(
            etcd(RawDatastoreSettings::default()),
            Err(SettingsError::NoEtcdEndpoints)
        );
        let endpoints = || vec!["h:1".to_owned()];
        assert_eq!(
            etcd(RawDatastoreSettings {
                etcd_endpoints: endpoints(),
                etcd_key_file: Some("/k.pem".into()),
                ..RawDatastoreSettings::default()
            }),
            Err(SettingsError::UnpairedClientCertificate)
        );
        assert_eq!(
            etcd(RawDatastoreSettings {
                etcd_endpoints: endpoints(),
                etcd_username: Some("u".into()),
                etcd_password: Some(Secret::new("")),
                ..RawDatastoreSettings::default()
            }),
            Err(SettingsError::UnpairedCredentials)
        );
        let embedded = RawDatastoreSettings {
            etcd_cert_file: Some("/c.pem".into()),
            ..RawDatastoreSettings::default()
        };
        assert!(
            DatastoreSettings::from_raw(embedded.clone()).is_ok(),
            "an embedded store ignores etcd values"
        );
        assert_eq!(
            embedded.check_etcd_pairs(),
            Err(SettingsError::UnpairedClientCertificate)
        );
    }

    #[test]
    fn default_paths_live_under_the_data_dir() {
        let settings = DatastoreSettings::default();
        assert_eq!(
            settings.resolved_path(),
            Some(PathBuf::from("/var/lib/blockipam/store.sled"))
        );
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime")
    }

    #[test]
    fn a_marked_store_that_is_gone_is_refused_only_to_settings_that_would_create_it() {
        for datastore_type in [DatastoreType::Sled, DatastoreType::Redb] {
            let dir = tempfile::tempdir().expect("temp dir");
            let path = dir.path().join("store");
            let mut settings = DatastoreSettings {
                backend: Backend::embedded(datastore_type, Some(path.clone()))
                    .expect("an embedded type"),
                create_if_missing: true,
                ..DatastoreSettings::default()
            };
            // No store, no marker: a fresh node, nothing to refuse.
            assert_eq!(settings.refuse_to_replace_a_lost_store(), Ok(()));
            let marker = store_marker_path(&path);
            assert_eq!(marker, dir.path().join("store.created"));
            std::fs::write(&marker, "created\n").expect("marker");
            let refused = settings
                .refuse_to_replace_a_lost_store()
                .expect_err("a marked store that is gone");
            let message = refused.to_string();
            assert!(
                message.contains(&path.display().to_string())
                    && message.contains(&marker.display().to_string()),
                "{datastore_type}: {message}"
            );
            // An empty directory (a volume not mounted) is as missing as nothing at all.
            std::fs::create_dir(&path).expect("an empty directory");
            assert!(settings.refuse_to_replace_a_lost_store().is_err());
            // A store there (anything in the directory) is opened as it is, marker or not.
            std::fs::write(path.join("db"), b"x").expect("a file in the store");
            assert_eq!(settings.refuse_to_replace_a_lost_store(), Ok(()));
            std::fs::remove_dir_all(&path).expect("remove the store");
            // A file there (a redb store, or damage its backend names) is not a missing store.
            std::fs::write(&path, b"x").expect("a file at the store path");
            assert_eq!(settings.refuse_to_replace_a_lost_store(), Ok(()));
            std::fs::remove_file(&path).expect("remove the file");
            // Settings that may not create the store fail on the missing store anyway.
            settings.create_if_missing = false;
            assert_eq!(settings.refuse_to_replace_a_lost_store(), Ok(()));
        }
        let etcd = DatastoreSettings {
            backend: Backend::Etcd(EtcdSettings::default()),
            create_if_missing: true,
            ..DatastoreSettings::default()
        };
        assert_eq!(etcd.refuse_to_replace_a_lost_store(), Ok(()));
    }

    #[test]
    fn missing_embedded_stores_are_created_only_when_settings_allow_it() {
        for datastore_type in [DatastoreType::Sled, DatastoreType::Redb] {
            let dir = tempfile::tempdir().expect("temp dir");
            let path = dir.path().join("data").join("store");
            let mut settings = DatastoreSettings {
                backend: Backend::embedded(datastore_type, Some(path.clone()))
                    .expect("an embedded type"),
                ..DatastoreSettings::default()
            };
            assert!(!settings.create_if_missing, "the default must not create");
            let err = runtime()
                .block_on(settings.open())
                .map(|_| ())
                .expect_err("a missing store opened without create_if_missing");
            assert!(
                err.to_string().contains(&path.display().to_string()),
                "{datastore_type}: {err}"
            );
            assert_eq!(
                std::fs::read_dir(dir.path()).expect("read dir").count(),
                0,
                "{datastore_type}: refusing a missing store created something"
            );
            settings.create_if_missing = true;
            runtime()
                .block_on(settings.open())
                .map(drop)
                .expect("create the store");
            assert!(path.exists(), "{datastore_type}: no store created");
            settings.create_if_missing = false;
            runtime()
                .block_on(settings.open())
                .map(drop)
                .expect("open the existing store without create_if_missing");
        }
    }

    #[test]
    fn etcd_settings_need_endpoints_and_paired_certificates() {
        let mut settings = EtcdSettings::default();
        assert!(matches!(
            settings.config(),
            Err(KvError::InvalidArgument { .. })
        ));
        settings.endpoints = vec!["127.0.0.1:1".into()];
        settings.cert_file = Some("/c.pem".into());
        assert!(matches!(
            settings.config(),
            Err(KvError::InvalidArgument { .. })
        ));
    }
}
