//! `EtcdConfig`: where etcd is, the key prefix, TLS files, credentials and timeouts, with validation.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipam_core::KvError;

/// The key prefix used when none is configured.
pub const DEFAULT_PREFIX: &str = "/blockipam/";
/// How long establishing a connection to one endpoint may take, by default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one store call (including its retries) may take, by default.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How to reach etcd and where in its key space this store lives.
///
/// Build one with [`EtcdConfig::new`] and the `with_*` methods (or a struct literal with
/// `..EtcdConfig::default()`); [`EtcdStore::connect`](crate::EtcdStore::connect) validates it.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client endpoints: `host:port`, `http://host:port` or `https://host:port`.
    ///
    /// A bare `host:port` uses `https` when TLS files are configured and `http` otherwise.
    pub endpoints: Vec<String>,
    /// Prepended to every key written and stripped from every key listed, so that several users
    /// (or test runs) can share one etcd without seeing each other. Empty, or ending with `/`.
    pub prefix: String,
    /// PEM file with the CA certificate(s) that signed the etcd server certificates.
    /// Required for TLS: this build trusts no system roots.
    pub ca_cert_file: Option<PathBuf>,
    /// PEM client certificate, for etcd servers started with `--client-cert-auth`.
    pub cert_file: Option<PathBuf>,
    /// PEM private key of [`cert_file`](Self::cert_file).
    pub key_file: Option<PathBuf>,
    /// etcd user name, for servers with authentication enabled.
    pub username: Option<String>,
    /// Password of [`username`](Self::username).
    pub password: Option<String>,
    /// Upper bound on establishing a connection to one endpoint; at most `request_timeout`.
    pub connect_timeout: Duration,
    /// Upper bound on one store call, retries across endpoints included.
    pub request_timeout: Duration,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        EtcdConfig {
            endpoints: Vec::new(),
            prefix: DEFAULT_PREFIX.to_owned(),
            ca_cert_file: None,
            cert_file: None,
            key_file: None,
            username: None,
            password: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("ca_cert_file", &self.ca_cert_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .finish()
    }
}

impl EtcdConfig {
    /// A configuration for `endpoints` with the default prefix and timeouts, no TLS, no user.
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        EtcdConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            ..EtcdConfig::default()
        }
    }

    /// Sets the key prefix (empty, or ending with `/`).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Trusts the CA in `ca_cert_file` for the servers' certificates (turns TLS on).
    pub fn with_ca_cert(mut self, ca_cert_file: impl Into<PathBuf>) -> Self {
        self.ca_cert_file = Some(ca_cert_file.into());
        self
    }

    /// Presents this client certificate and key (for `--client-cert-auth` servers).
    pub fn with_client_cert(
        mut self,
        cert_file: impl Into<PathBuf>,
        key_file: impl Into<PathBuf>,
    ) -> Self {
        self.cert_file = Some(cert_file.into());
        self.key_file = Some(key_file.into());
        self
    }

    /// Authenticates as `username` with `password`.
    pub fn with_credentials(
        mut self,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.username = Some(username.into());
        self.password = Some(password.into());
        self
    }

    /// Sets the connect and request timeouts.
    pub fn with_timeouts(mut self, connect_timeout: Duration, request_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self.request_timeout = request_timeout;
        self
    }

    /// Checks the configuration without contacting etcd: endpoints, prefix, TLS files (they must
    /// be readable PEM), credentials and timeouts.
    ///
    /// # Errors
    /// [`KvError::InvalidArgument`] naming what is wrong (and the file, for an unreadable one).
    pub fn validate(&self) -> Result<(), KvError> {
        self.resolve().map(|_| ())
    }

    /// As [`validate`](Self::validate), without reading the TLS files: for settings written for
    /// another host, whose files exist there (`blockipamctl install-cni`). A file that is named
    /// counts as given.
    ///
    /// # Errors
    /// As [`validate`](Self::validate), except for a file that cannot be read.
    pub fn validate_without_reading_files(&self) -> Result<(), KvError> {
        self.resolve_reading_files(false).map(|_| ())
    }

    /// Validates and loads everything the store needs.
    pub(crate) fn resolve(&self) -> Result<Resolved, KvError> {
        self.resolve_reading_files(true)
    }

    /// Validates, and loads the TLS files when `read_files` (otherwise their material is left
    /// empty: the result is then only good for knowing the settings hold together).
    fn resolve_reading_files(&self, read_files: bool) -> Result<Resolved, KvError> {
        let read = |path: &Path, what: &str, kind: PemKind| {
            if read_files {
                read_pem(path, what, kind)
            } else {
                Ok(Vec::new())
            }
        };
        if self.prefix.contains('\0') {
            return Err(KvError::invalid(format!(
                "etcd key prefix {:?} contains a NUL character",
                self.prefix
            )));
        }
        if !self.prefix.is_empty() && !self.prefix.ends_with('/') {
            return Err(KvError::invalid(format!(
                "etcd key prefix {:?} must end with '/' (or be empty), so that it never matches \
                 the keys of another prefix that merely starts the same way",
                self.prefix
            )));
        }
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return Err(KvError::invalid(
                "etcd connect_timeout and request_timeout must be greater than zero",
            ));
        }
        if self.connect_timeout > self.request_timeout {
            return Err(KvError::invalid(format!(
                "etcd connect_timeout ({:?}) must not be longer than request_timeout ({:?})",
                self.connect_timeout, self.request_timeout
            )));
        }
        let credentials = match (&self.username, &self.password) {
            (None, None) => None,
            (Some(user), Some(password)) => {
                if user.is_empty() {
                    return Err(KvError::invalid("etcd username is empty"));
                }
                Some((user.clone(), password.clone()))
            }
            (Some(_), None) => {
                return Err(KvError::invalid("etcd username is set but password is not"))
            }
            (None, Some(_)) => {
                return Err(KvError::invalid("etcd password is set but username is not"))
            }
        };
        let identity = match (&self.cert_file, &self.key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((
                read(cert, "cert_file", PemKind::Certificates)?,
                read(key, "key_file", PemKind::PrivateKey)?,
            )),
            (Some(cert), None) => {
                return Err(KvError::invalid(format!(
                    "etcd cert_file {} is set but key_file is not",
                    cert.display()
                )))
            }
            (None, Some(key)) => {
                return Err(KvError::invalid(format!(
                    "etcd key_file {} is set but cert_file is not",
                    key.display()
                )))
            }
        };
        let ca = match &self.ca_cert_file {
            Some(path) => Some(read(path, "ca_cert_file", PemKind::TrustAnchors)?),
            None => None,
        };

        if self.endpoints.is_empty() {
            return Err(KvError::invalid("no etcd endpoints configured"));
        }
        let tls_files = ca.is_some() || identity.is_some();
        let mut endpoints = Vec::with_capacity(self.endpoints.len());
        for raw in &self.endpoints {
            let url = normalize_endpoint(raw, tls_files)?;
            if endpoints.contains(&url) {
                return Err(KvError::invalid(format!(
                    "etcd endpoint {raw:?} is listed twice"
                )));
            }
            endpoints.push(url);
        }
        let uses_https = endpoints.iter().any(|e| e.starts_with("https://"));
        let tls = if uses_https {
            let Some(ca) = ca else {
                return Err(KvError::invalid(
                    "etcd over https needs ca_cert_file: this build trusts no system CA roots",
                ));
            };
            Some(TlsMaterial { ca, identity })
        } else {
            None
        };
        Ok(Resolved {
            endpoints,
            prefix: self.prefix.clone(),
            tls,
            credentials,
            connect_timeout: self.connect_timeout,
            request_timeout: self.request_timeout,
        })
    }
}

/// A validated configuration with endpoints normalized to URLs and TLS files loaded.
#[derive(Clone)]
pub(crate) struct Resolved {
    pub(crate) endpoints: Vec<String>,
    pub(crate) prefix: String,
    pub(crate) tls: Option<TlsMaterial>,
    pub(crate) credentials: Option<(String, String)>,
    pub(crate) connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
}

/// PEM bytes read from the configured files.
#[derive(Clone)]
pub(crate) struct TlsMaterial {
    pub(crate) ca: Vec<u8>,
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// What a configured TLS file must hold.
#[derive(Clone, Copy)]
enum PemKind {
    /// CA certificates, each usable as a trust anchor.
    TrustAnchors,
    /// A certificate chain.
    Certificates,
    /// One private key.
    PrivateKey,
}

/// Reads a PEM file and checks that it holds what `kind` needs, naming the file on failure.
fn read_pem(path: &Path, field: &str, kind: PemKind) -> Result<Vec<u8>, KvError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let bytes = std::fs::read(path).map_err(|e| {
        KvError::invalid(format!("cannot read etcd {field} {}: {e}", path.display()))
    })?;
    let bad = |what: String| KvError::invalid(format!("etcd {field} {}: {what}", path.display()));
    match kind {
        PemKind::TrustAnchors | PemKind::Certificates => {
            let certs = CertificateDer::pem_slice_iter(&bytes)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(format!("is not a valid PEM certificate file: {e}")))?;
            if certs.is_empty() {
                return Err(bad("holds no PEM CERTIFICATE block".to_owned()));
            }
            if matches!(kind, PemKind::TrustAnchors) {
                let mut roots = rustls::RootCertStore::empty();
                for (i, cert) in certs.into_iter().enumerate() {
                    roots.add(cert).map_err(|e| {
                        bad(format!("certificate #{} is not a usable CA: {e}", i + 1))
                    })?;
                }
            }
        }
        PemKind::PrivateKey => {
            PrivateKeyDer::from_pem_slice(&bytes)
                .map_err(|e| bad(format!("holds no usable PEM private key: {e}")))?;
        }
    }
    Ok(bytes)
}

/// Turns `host:port`, `http://host:port` or `https://host:port` into a URL with a scheme.
fn normalize_endpoint(raw: &str, tls_files: bool) -> Result<String, KvError> {
    let trimmed = raw.trim();
    let (scheme, rest) = if let Some(rest) = trimmed.strip_prefix("http://") {
        if tls_files {
            return Err(KvError::invalid(format!(
                "etcd endpoint {raw:?} uses http:// but TLS files are configured: use https:// \
                 or a bare host:port"
            )));
        }
        ("http", rest)
    } else if let Some(rest) = trimmed.strip_prefix("https://") {
        ("https", rest)
    } else if trimmed.contains("://") {
        return Err(KvError::invalid(format!(
            "etcd endpoint {raw:?} has an unsupported scheme: use host:port, http:// or https://"
        )));
    } else if tls_files {
        ("https", trimmed)
    } else {
        ("http", trimmed)
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    let bad =
        |why: &str| KvError::invalid(format!("etcd endpoint {raw:?} is not host:port ({why})"));
    if authority.contains('/') || authority.contains('?') || authority.contains('@') {
        return Err(bad("it has a path, query or user part"));
    }
    let Some((host, port)) = authority.rsplit_once(':') else {
        return Err(bad("the port is missing"));
    };
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err(bad("the host is empty or has spaces"));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(bad("IPv6 addresses must be in brackets"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(bad("the port is not a number from 1 to 65535")),
    }
    Ok(format!("{scheme}://{authority}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid_message(result: Result<(), KvError>) -> String {
        match result {
            Err(KvError::InvalidArgument { message }) => message,
            other => panic!("expected an invalid-argument error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let config = EtcdConfig::new(["127.0.0.1:2379"]);
        assert_eq!(config.prefix, "/blockipam/");
        assert_eq!(config.connect_timeout, Duration::from_secs(5));
        assert_eq!(config.request_timeout, Duration::from_secs(10));
        config.validate().expect("a plain endpoint is valid");
    }

    #[test]
    fn empty_endpoint_list_is_invalid() {
        let message = invalid_message(EtcdConfig::default().validate());
        assert!(message.contains("no etcd endpoints"), "{message}");
    }

    #[test]
    fn endpoints_accept_bare_and_http_forms() {
        let resolved = EtcdConfig::new(["127.0.0.1:2379", "http://etcd-1:2379/", "[::1]:2379"])
            .resolve()
            .expect("valid");
        assert_eq!(
            resolved.endpoints,
            [
                "http://127.0.0.1:2379",
                "http://etcd-1:2379",
                "http://[::1]:2379"
            ]
        );
    }

    #[test]
    fn malformed_endpoints_are_invalid() {
        for bad in [
            "",
            "127.0.0.1",
            "127.0.0.1:0",
            "127.0.0.1:99999",
            "unix:///run/etcd.sock",
            "http://h:1/path",
            "::1:2379",
        ] {
            let message = invalid_message(EtcdConfig::new([bad]).validate());
            assert!(message.contains("endpoint"), "{bad:?}: {message}");
        }
    }

    #[test]
    fn each_malformed_part_of_an_endpoint_is_named() {
        for (bad, why) in [
            ("http://h:1?x=1", "it has a path, query or user part"),
            ("user@h:1", "it has a path, query or user part"),
            ("h:1/a", "it has a path, query or user part"),
            (":2379", "the host is empty or has spaces"),
            ("my host:2379", "the host is empty or has spaces"),
            ("fd00::1:2379", "IPv6 addresses must be in brackets"),
            ("[fd00::1:2379", "IPv6 addresses must be in brackets"),
            ("fd00::1]:2379", "IPv6 addresses must be in brackets"),
            ("h:port", "the port is not a number from 1 to 65535"),
        ] {
            let message = invalid_message(EtcdConfig::new([bad]).validate());
            assert!(
                message.contains(&format!("etcd endpoint {bad:?} is not host:port ({why})")),
                "{bad:?}: {message}"
            );
        }
    }

    #[test]
    fn duplicate_endpoint_is_invalid() {
        let message = invalid_message(EtcdConfig::new(["h:1", "http://h:1"]).validate());
        assert!(message.contains("twice"), "{message}");
    }

    #[test]
    fn prefix_must_end_with_slash_or_be_empty() {
        let message = invalid_message(EtcdConfig::new(["h:1"]).with_prefix("/a").validate());
        assert!(message.contains("must end with '/'"), "{message}");
        EtcdConfig::new(["h:1"])
            .with_prefix("")
            .validate()
            .expect("an empty prefix is allowed");
    }

    #[test]
    fn cert_without_key_is_invalid() {
        let mut config = EtcdConfig::new(["h:1"]);
        config.cert_file = Some("/tmp/client.pem".into());
        let message = invalid_message(config.validate());
        assert!(message.contains("key_file is not"), "{message}");
    }

    #[test]
    fn unreadable_file_is_invalid_and_named() {
        let config = EtcdConfig::new(["h:1"]).with_ca_cert("/nonexistent/blockipam/ca.pem");
        let message = invalid_message(config.validate());
        assert!(
            message.contains("/nonexistent/blockipam/ca.pem"),
            "{message}"
        );
    }

    #[test]
    fn non_pem_file_is_invalid_and_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, b"not a certificate").expect("write");
        let message = invalid_message(EtcdConfig::new(["h:1"]).with_ca_cert(&path).validate());
        assert!(message.contains("no PEM CERTIFICATE"), "{message}");
        assert!(message.contains(&path.display().to_string()), "{message}");
    }

    #[test]
    fn https_without_ca_is_invalid() {
        let message = invalid_message(EtcdConfig::new(["https://h:1"]).validate());
        assert!(message.contains("ca_cert_file"), "{message}");
    }

    #[test]
    fn plain_http_with_tls_files_is_invalid() {
        let pki = test_kit::etcd::TestPki::generate().expect("openssl");
        let message = invalid_message(
            EtcdConfig::new(["http://h:1"])
                .with_ca_cert(pki.ca_cert())
                .validate(),
        );
        assert!(message.contains("http://"), "{message}");
        let resolved = EtcdConfig::new(["h:1"])
            .with_ca_cert(pki.ca_cert())
            .with_client_cert(pki.client_cert(), pki.client_key())
            .resolve()
            .expect("bare endpoint with TLS files is https");
        assert_eq!(resolved.endpoints, ["https://h:1"]);
    }

    #[test]
    fn tls_files_that_do_not_parse_are_invalid_and_named() {
        let pki = test_kit::etcd::TestPki::generate().expect("openssl");
        let dir = tempfile::tempdir().expect("temp dir");
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(
            &garbage,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        let message = invalid_message(EtcdConfig::new(["h:1"]).with_ca_cert(&garbage).validate());
        assert!(message.contains("ca_cert_file"), "{message}");
        assert!(
            message.contains(&garbage.display().to_string()),
            "{message}"
        );

        // A certificate where the key should be.
        let message = invalid_message(
            EtcdConfig::new(["h:1"])
                .with_ca_cert(pki.ca_cert())
                .with_client_cert(pki.client_cert(), pki.client_cert())
                .validate(),
        );
        assert!(message.contains("private key"), "{message}");
    }

    #[test]
    fn half_credentials_are_invalid() {
        let mut config = EtcdConfig::new(["h:1"]);
        config.username = Some("root".into());
        let message = invalid_message(config.validate());
        assert!(message.contains("password is not"), "{message}");
    }

    #[test]
    fn connect_timeout_longer_than_request_timeout_is_invalid() {
        let config =
            EtcdConfig::new(["h:1"]).with_timeouts(Duration::from_secs(5), Duration::from_secs(1));
        let message = invalid_message(config.validate());
        assert!(message.contains("connect_timeout"), "{message}");
    }

    #[test]
    fn a_zero_timeout_is_invalid_and_equal_timeouts_are_valid() {
        let second = Duration::from_secs(1);
        for (connect, request) in [(Duration::ZERO, second), (second, Duration::ZERO)] {
            let config = EtcdConfig::new(["h:1"]).with_timeouts(connect, request);
            let message = invalid_message(config.validate());
            assert!(
                message.contains("connect_timeout and request_timeout must be greater than zero"),
                "{connect:?}, {request:?}: {message}"
            );
        }
        EtcdConfig::new(["h:1"])
            .with_timeouts(second, second)
            .validate()
            .expect("a connection may take the whole request's time");
    }

    #[test]
    fn debug_output_redacts_the_password() {
        let config = EtcdConfig::new(["h:1"]).with_credentials("root", "hunter2");
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }
}
