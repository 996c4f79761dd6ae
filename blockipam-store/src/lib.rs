//! Store selection shared by the plugin and the CLI: which backend, where, and how to open it.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use backend_etcd::{EtcdConfig, EtcdStore};
use backend_redb::{RedbConfig, RedbStore};
use backend_sled::{SledConfig, SledStore};
use ipam_core::lockfile::DEFAULT_LOCK_WAIT;
use ipam_core::{KvError, KvStore};

/// Directory the embedded stores live in by default.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/blockipam";

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

/// Everything needed to open a store; the plugin fills it from netconf, the CLI from flags and
/// environment variables, with the same defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatastoreSettings {
    /// Which backend.
    pub datastore_type: DatastoreType,
    /// Embedded stores: the database path (default under [`DEFAULT_DATA_DIR`]).
    pub path: Option<PathBuf>,
    /// etcd: endpoints (`http://host:port` or `host:port`).
    pub etcd_endpoints: Vec<String>,
    /// etcd: CA certificate file.
    pub etcd_ca_cert_file: Option<PathBuf>,
    /// etcd: client certificate file.
    pub etcd_cert_file: Option<PathBuf>,
    /// etcd: client key file.
    pub etcd_key_file: Option<PathBuf>,
    /// etcd: key prefix (default `/blockipam/`).
    pub etcd_prefix: Option<String>,
    /// etcd: connect and per-request timeouts (adapter defaults when `None`).
    pub etcd_timeouts: Option<(Duration, Duration)>,
    /// Embedded stores: how long to wait for another process holding the store.
    pub lock_wait: Duration,
}

impl Default for DatastoreSettings {
    fn default() -> Self {
        DatastoreSettings {
            datastore_type: DatastoreType::default(),
            path: None,
            etcd_endpoints: Vec::new(),
            etcd_ca_cert_file: None,
            etcd_cert_file: None,
            etcd_key_file: None,
            etcd_prefix: None,
            etcd_timeouts: None,
            lock_wait: DEFAULT_LOCK_WAIT,
        }
    }
}

impl DatastoreSettings {
    /// The embedded store's path: the one given, else the type's default.
    pub fn resolved_path(&self) -> Option<PathBuf> {
        self.path
            .clone()
            .or_else(|| self.datastore_type.default_path())
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
        match self.datastore_type {
            DatastoreType::Etcdv3 => format!(
                "etcdv3 at {} (prefix {})",
                self.etcd_endpoints.join(","),
                self.etcd_prefix
                    .as_deref()
                    .unwrap_or(backend_etcd::DEFAULT_PREFIX)
            ),
            other => format!(
                "{other} at {}",
                self.resolved_path().unwrap_or_default().display()
            ),
        }
    }

    /// Opens (or creates) the store these settings name.
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] for incomplete settings (etcd without endpoints, a client
    /// certificate without its key); otherwise whatever the backend reports (unavailable etcd,
    /// store locked beyond the wait, corrupt files).
    pub async fn open(&self) -> Result<Arc<dyn KvStore>, KvError> {
        match self.datastore_type {
            DatastoreType::Sled => {
                let path = self.embedded_path()?;
                let config = SledConfig::new(path).with_lock_wait(self.lock_wait);
                Ok(Arc::new(SledStore::open(config).await?))
            }
            DatastoreType::Redb => {
                let path = self.embedded_path()?;
                let config = RedbConfig::new(path).with_lock_wait(self.lock_wait);
                Ok(Arc::new(RedbStore::open(config).await?))
            }
            DatastoreType::Etcdv3 => Ok(Arc::new(EtcdStore::connect(self.etcd_config()?).await?)),
        }
    }

    fn embedded_path(&self) -> Result<PathBuf, KvError> {
        self.resolved_path()
            .ok_or_else(|| KvError::invalid("an embedded store needs a path"))
    }

    /// The etcd adapter configuration these settings describe.
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] without endpoints, or with only one of certificate and key.
    pub fn etcd_config(&self) -> Result<EtcdConfig, KvError> {
        if self.etcd_endpoints.is_empty() {
            return Err(KvError::invalid(
                "datastore type etcdv3 needs etcd endpoints (etcd_endpoints / --etcd-endpoints / ETCD_ENDPOINTS)",
            ));
        }
        let mut config = EtcdConfig::new(self.etcd_endpoints.iter().cloned());
        if let Some(prefix) = &self.etcd_prefix {
            config = config.with_prefix(prefix.clone());
        }
        if let Some(ca) = &self.etcd_ca_cert_file {
            config = config.with_ca_cert(ca.clone());
        }
        match (&self.etcd_cert_file, &self.etcd_key_file) {
            (Some(cert), Some(key)) => config = config.with_client_cert(cert.clone(), key.clone()),
            (None, None) => {}
            _ => {
                return Err(KvError::invalid(
                    "etcd client certificate and key must be given together",
                ))
            }
        }
        if let Some((connect, request)) = self.etcd_timeouts {
            config = config.with_timeouts(connect, request);
        }
        Ok(config)
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
    fn default_paths_live_under_the_data_dir() {
        let settings = DatastoreSettings::default();
        assert_eq!(
            settings.resolved_path(),
            Some(PathBuf::from("/var/lib/blockipam/store.sled"))
        );
    }

    #[test]
    fn etcd_settings_need_endpoints_and_paired_certificates() {
        let mut settings = DatastoreSettings {
            datastore_type: DatastoreType::Etcdv3,
            ..DatastoreSettings::default()
        };
        assert!(matches!(
            settings.etcd_config(),
            Err(KvError::InvalidArgument { .. })
        ));
        settings.etcd_endpoints = vec!["127.0.0.1:1".into()];
        settings.etcd_cert_file = Some("/c.pem".into());
        assert!(matches!(
            settings.etcd_config(),
            Err(KvError::InvalidArgument { .. })
        ));
    }
}
