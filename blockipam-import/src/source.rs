//! The Calico etcdv3 reader: connects as backend-etcd does (endpoints, TLS files, user and
//! password) and reads every IPAM object under the Calico prefix at one etcd revision.

use std::path::PathBuf;
use std::time::Duration;

use backend_etcd::EtcdConfig;
use etcd_client::{
    Certificate, Client, ConnectOptions, GetOptions, Identity, KvClient, SortOrder, SortTarget,
    TlsOptions,
};

use crate::calico::{CalicoSnapshot, RawEntry, IPAM_DIR, NODES_DIR, POOLS_DIR, RESERVATIONS_DIR};
use crate::error::ImportError;

/// Calico's default key prefix.
pub const DEFAULT_CALICO_PREFIX: &str = "/calico";
/// Keys fetched per Range request; every page is read at the snapshot's revision.
const PAGE: i64 = 500;

/// Where the Calico datastore is and how to reach it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct CalicoEtcdSource {
    /// Client endpoints: `host:port`, `http://host:port` or `https://host:port`.
    pub endpoints: Vec<String>,
    /// Calico's key prefix, `/calico` unless Calico was configured otherwise.
    pub prefix: String,
    /// CA certificate (PEM) of the etcd servers; required for TLS.
    pub ca_cert_file: Option<PathBuf>,
    /// Client certificate (PEM), with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// Client key (PEM).
    pub key_file: Option<PathBuf>,
    /// etcd user name, with `password`.
    pub username: Option<String>,
    /// Password of `username`.
    pub password: Option<String>,
    /// Upper bound on one etcd request, connecting included (default 10 s).
    pub request_timeout: Option<Duration>,
}

impl std::fmt::Debug for CalicoEtcdSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CalicoEtcdSource")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("ca_cert_file", &self.ca_cert_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl CalicoEtcdSource {
    /// A source at `endpoints` with Calico's default prefix, no TLS, no user.
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        CalicoEtcdSource {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: DEFAULT_CALICO_PREFIX.to_owned(),
            ..CalicoEtcdSource::default()
        }
    }

    /// The prefix without a trailing `/` (`/calico`).
    pub fn normalized_prefix(&self) -> String {
        self.prefix.trim_end_matches('/').to_owned()
    }

    /// `etcd <endpoints> prefix <prefix>`, for messages and the import marker.
    pub fn describe(&self) -> String {
        format!(
            "Calico etcd {} (prefix {})",
            self.endpoints.join(","),
            self.normalized_prefix()
        )
    }

    fn timeout(&self) -> Duration {
        self.request_timeout.unwrap_or(Duration::from_secs(10))
    }

    /// Checks the settings without contacting etcd (endpoints, TLS files, credentials), with
    /// backend-etcd's own rules.
    ///
    /// # Errors
    /// [`ImportError::InvalidSource`] naming what is wrong.
    pub fn validate(&self) -> Result<(), ImportError> {
        if self.prefix.contains('\0') || !self.prefix.starts_with('/') {
            return Err(ImportError::InvalidSource(format!(
                "the Calico prefix {:?} must start with '/' (Calico's default is /calico)",
                self.prefix
            )));
        }
        self.etcd_config()
            .validate()
            .map_err(|e| ImportError::InvalidSource(e.to_string()))
    }

    fn etcd_config(&self) -> EtcdConfig {
        let timeout = self.timeout();
        EtcdConfig {
            endpoints: self.endpoints.clone(),
            prefix: String::new(),
            ca_cert_file: self.ca_cert_file.clone(),
            cert_file: self.cert_file.clone(),
            key_file: self.key_file.clone(),
            username: self.username.clone(),
            password: self.password.clone(),
            connect_timeout: timeout.min(Duration::from_secs(5)),
            request_timeout: timeout,
        }
    }

    fn connect_options(&self) -> Result<ConnectOptions, ImportError> {
        let timeout = self.timeout();
        let mut options = ConnectOptions::new()
            .with_connect_timeout(timeout.min(Duration::from_secs(5)))
            .with_timeout(timeout)
            .with_require_leader(true);
        if let (Some(user), Some(password)) = (&self.username, &self.password) {
            options = options.with_user(user.clone(), password.clone());
        }
        if let Some(ca) = &self.ca_cert_file {
            let read = |path: &PathBuf| {
                std::fs::read(path).map_err(|e| {
                    ImportError::InvalidSource(format!("cannot read {}: {e}", path.display()))
                })
            };
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(read(ca)?));
            if let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) {
                tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            options = options.with_tls(tls);
        }
        Ok(options)
    }

    /// Reads every pool, the IPAM config, every block, affinity and handle, and every
    /// reservation, all at one etcd revision: `at_revision`, or the current one when `None`.
    ///
    /// # Errors
    /// [`ImportError::InvalidSource`] for bad settings; [`ImportError::Source`] when etcd cannot
    /// be reached or refuses; [`ImportError::Compacted`] when `at_revision` was compacted away.
    pub async fn read(&self, at_revision: Option<i64>) -> Result<CalicoSnapshot, ImportError> {
        self.validate()?;
        let options = self.connect_options()?;
        let source_error = |what: &str, e: etcd_client::Error| {
            ImportError::Source(format!("{} ({what}): {e}", self.describe()))
        };
        let client = tokio::time::timeout(
            self.timeout(),
            Client::connect(self.endpoints.clone(), Some(options)),
        )
        .await
        .map_err(|_| {
            ImportError::Source(format!(
                "{}: no endpoint answered within {:?}",
                self.describe(),
                self.timeout()
            ))
        })?
        .map_err(|e| source_error("connecting", e))?;
        let mut kv = client.kv_client();
        let prefix = self.normalized_prefix();
        let mut revision = at_revision.unwrap_or(0);
        let mut entries = Vec::new();
        for dir in [POOLS_DIR, IPAM_DIR, RESERVATIONS_DIR, NODES_DIR] {
            let full = format!("{prefix}{dir}");
            self.read_range(&mut kv, &full, &mut revision, &mut entries)
                .await?;
        }
        Ok(CalicoSnapshot::parse(revision, &entries))
    }

    /// Appends every key under `dir` (full etcd path) to `entries`, relative to the prefix, reading
    /// at `*revision` (set from the first response when 0).
    async fn read_range(
        &self,
        kv: &mut KvClient,
        dir: &str,
        revision: &mut i64,
        entries: &mut Vec<RawEntry>,
    ) -> Result<(), ImportError> {
        let prefix = self.normalized_prefix();
        let end = prefix_end(dir.as_bytes());
        let mut from = dir.as_bytes().to_vec();
        loop {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_sort(SortTarget::Key, SortOrder::Ascend)
                .with_limit(PAGE)
                .with_revision(*revision);
            let page = tokio::time::timeout(self.timeout(), kv.get(from.clone(), Some(options)))
                .await
                .map_err(|_| {
                    ImportError::Source(format!(
                        "{}: reading {dir} took longer than {:?}",
                        self.describe(),
                        self.timeout()
                    ))
                })?
                .map_err(|e| {
                    let text = e.to_string();
                    if text.contains("compacted") {
                        ImportError::Compacted(format!(
                            "{}: revision {} was compacted away: {text}",
                            self.describe(),
                            *revision
                        ))
                    } else {
                        ImportError::Source(format!("{} (reading {dir}): {text}", self.describe()))
                    }
                })?;
            if *revision == 0 {
                *revision = page.header().map(|h| h.revision()).unwrap_or(0);
            }
            let more = page.more();
            let kvs = page.kvs();
            let next = kvs.last().map(|last| {
                let mut next = last.key().to_vec();
                next.push(0);
                next
            });
            for item in kvs {
                let key = String::from_utf8_lossy(item.key());
                let relative = key.strip_prefix(prefix.as_str()).unwrap_or(&key);
                entries.push(RawEntry {
                    key: relative.to_owned(),
                    value: item.value().to_vec(),
                });
            }
            match next {
                Some(next) if more => from = next,
                _ => return Ok(()),
            }
        }
    }
}

/// The smallest key greater than every key starting with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(prefix: &str) -> CalicoEtcdSource {
        CalicoEtcdSource {
            prefix: prefix.to_owned(),
            ..CalicoEtcdSource::new(["127.0.0.1:2379", "127.0.0.2:2379"])
        }
    }

    #[test]
    fn a_source_is_described_by_its_endpoints_and_prefix_and_hides_its_password() {
        let mut source = source("/calico/");
        assert_eq!(
            source.describe(),
            "Calico etcd 127.0.0.1:2379,127.0.0.2:2379 (prefix /calico)"
        );
        source.username = Some("reader".into());
        source.password = Some("s3cret".into());
        let shown = format!("{source:?}");
        assert!(shown.starts_with("CalicoEtcdSource {"), "{shown}");
        assert!(
            shown.contains("\"reader\"") && shown.contains("<redacted>"),
            "{shown}"
        );
        assert!(!shown.contains("s3cret"), "{shown}");
    }

    #[test]
    fn a_prefix_must_start_with_a_slash_and_hold_no_nul() {
        for wrong in ["calico", "/cal\0ico"] {
            match source(wrong).validate() {
                Err(ImportError::InvalidSource(message)) => {
                    assert!(
                        message.contains("must start with '/'"),
                        "{wrong:?}: {message}"
                    )
                }
                other => panic!("{wrong:?}: {other:?}"),
            }
        }
        source("/calico").validate().expect("valid");
        source("/calico/")
            .validate()
            .expect("valid with a trailing slash");
        assert!(matches!(
            CalicoEtcdSource::new(Vec::<String>::new()).validate(),
            Err(ImportError::InvalidSource(_))
        ));
    }

    #[test]
    fn tls_files_that_cannot_be_read_are_named() {
        let mut source = source("/calico");
        source.ca_cert_file = Some(PathBuf::from("/nonexistent/ca.pem"));
        match source.connect_options() {
            Err(ImportError::InvalidSource(message)) => {
                assert!(
                    message.contains("cannot read /nonexistent/ca.pem"),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_end_of_a_prefix_range_is_the_next_key_past_every_key_it_starts() {
        assert_eq!(prefix_end(b"/calico/"), b"/calico0".to_vec());
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b".to_vec());
        assert_eq!(prefix_end(&[0xfe]), vec![0xff]);
        assert_eq!(prefix_end(&[0xff, 0xff]), vec![0]);
    }
}
