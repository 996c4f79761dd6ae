//! etcd's database size, asked of each member with etcd-client's Status call, and an optional
//! compaction after the run (to tell live data from history).
//!
//! `db_size` is the database file (it never shrinks without a defragmentation); `db_size_in_use`
//! is the part holding data: after a compaction it falls to the live keys plus the history kept.

use std::time::Duration;

use backend_etcd::EtcdConfig;
use etcd_client::{Certificate, Client, CompactionOptions, ConnectOptions, Identity, TlsOptions};
use serde::Serialize;

/// How long one status call may take.
const STATUS_TIMEOUT: Duration = Duration::from_secs(10);

/// One member's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemberStatus {
    /// The endpoint asked.
    pub endpoint: String,
    /// Database file size in bytes.
    pub db_size_bytes: Option<i64>,
    /// Bytes of the database in use (etcd 3.4+).
    pub db_size_in_use_bytes: Option<i64>,
    /// The store revision the member reports.
    pub revision: Option<i64>,
    /// Why the member could not be asked.
    pub error: Option<String>,
}

impl MemberStatus {
    /// The largest database among `members`.
    pub fn max_db_size(members: &[MemberStatus]) -> Option<i64> {
        members.iter().filter_map(|m| m.db_size_bytes).max()
    }
}

/// Connects to etcd as the store configuration says (endpoints, TLS files, credentials).
pub struct StatusClient {
    endpoints: Vec<String>,
    options: ConnectOptions,
}

impl std::fmt::Debug for StatusClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusClient")
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

impl StatusClient {
    /// A client for the etcd `config` names.
    ///
    /// # Errors
    /// A message when a TLS file cannot be read.
    pub fn new(config: &EtcdConfig) -> Result<Self, String> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(STATUS_TIMEOUT)
            .with_timeout(STATUS_TIMEOUT);
        if let (Some(user), Some(password)) = (&config.username, &config.password) {
            options = options.with_user(user.clone(), password.clone());
        }
        if let Some(ca) = &config.ca_cert_file {
            let read = |path: &std::path::Path| {
                std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
            };
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(read(ca)?));
            if let (Some(cert), Some(key)) = (&config.cert_file, &config.key_file) {
                tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            options = options.with_tls(tls);
        }
        let tls = config.ca_cert_file.is_some();
        let endpoints = config
            .endpoints
            .iter()
            .map(|e| {
                if e.contains("://") {
                    e.clone()
                } else if tls {
                    format!("https://{e}")
                } else {
                    format!("http://{e}")
                }
            })
            .collect();
        Ok(StatusClient { endpoints, options })
    }

    async fn connect(&self, endpoint: &str) -> Result<Client, String> {
        tokio::time::timeout(
            STATUS_TIMEOUT,
            Client::connect([endpoint], Some(self.options.clone())),
        )
        .await
        .map_err(|_| format!("no answer from {endpoint} within {STATUS_TIMEOUT:?}"))?
        .map_err(|e| format!("cannot connect to {endpoint}: {e}"))
    }

    /// A new client connected to every endpoint (as the store's own clients are), with this
    /// client's TLS, credentials and timeouts.
    ///
    /// # Errors
    /// A message when no endpoint answers in time.
    pub async fn connect_cluster(&self) -> Result<Client, String> {
        tokio::time::timeout(
            STATUS_TIMEOUT,
            Client::connect(self.endpoints.clone(), Some(self.options.clone())),
        )
        .await
        .map_err(|_| {
            format!(
                "no answer from {:?} within {STATUS_TIMEOUT:?}",
                self.endpoints
            )
        })?
        .map_err(|e| format!("cannot connect to {:?}: {e}", self.endpoints))
    }

    /// Every member's status, asked of each endpoint on its own connection.
    pub async fn members(&self) -> Vec<MemberStatus> {
        let mut members = Vec::with_capacity(self.endpoints.len());
        for endpoint in &self.endpoints {
            let answer = async {
                let mut client = self.connect(endpoint).await?;
                client
                    .status()
                    .await
                    .map_err(|e| format!("status of {endpoint}: {e}"))
            }
            .await;
            members.push(match answer {
                Ok(status) => MemberStatus {
                    endpoint: endpoint.clone(),
                    db_size_bytes: Some(status.db_size()),
                    db_size_in_use_bytes: Some(status.raft_used_db_size()),
                    revision: status.header().map(|h| h.revision()),
                    error: None,
                },
                Err(error) => MemberStatus {
                    endpoint: endpoint.clone(),
                    db_size_bytes: None,
                    db_size_in_use_bytes: None,
                    revision: None,
                    error: Some(error),
                },
            });
        }
        members
    }

    /// Compacts the whole history up to the newest revision any member reported (physically:
    /// it returns once the members dropped the history). Returns the revision.
    ///
    /// # Errors
    /// A message when no member answered or the compaction failed.
    pub async fn compact(&self, members: &[MemberStatus]) -> Result<i64, String> {
        let revision = members
            .iter()
            .filter_map(|m| m.revision)
            .max()
            .ok_or("no etcd member reported a revision; nothing compacted")?;
        let mut last_error = String::new();
        for endpoint in &self.endpoints {
            let compacted = async {
                let mut client = self.connect(endpoint).await?;
                client
                    .compact(revision, Some(CompactionOptions::new().with_physical()))
                    .await
                    .map_err(|e| format!("compaction through {endpoint}: {e}"))
            }
            .await;
            match compacted {
                Ok(_) => return Ok(revision),
                Err(e) => last_error = e,
            }
        }
        Err(last_error)
    }
}

/// The CPU seconds etcd's members have used, summed over the members, each read from its
/// `process_cpu_seconds_total` metric at `<endpoint>/metrics` (plain HTTP endpoints only: a TLS
/// endpoint's metrics are not asked). Sampled before and after each measured phase, the
/// difference is what etcd itself spent on it, whatever else shares the machine's cores.
///
/// # Errors
/// A message naming the member that could not be asked or whose answer held no such metric.
pub async fn cpu_seconds(endpoints: &[String]) -> Result<f64, String> {
    let mut total = 0.0;
    for endpoint in endpoints {
        let address = endpoint.strip_prefix("http://").ok_or_else(|| {
            format!("{endpoint}: only a plain http:// endpoint's metrics are read")
        })?;
        let address = address.trim_end_matches('/');
        let text = tokio::time::timeout(STATUS_TIMEOUT, get_metrics(address))
            .await
            .map_err(|_| format!("{endpoint}/metrics: no answer within {STATUS_TIMEOUT:?}"))?
            .map_err(|e| format!("{endpoint}/metrics: {e}"))?;
        total += process_cpu_seconds(&text)
            .ok_or_else(|| format!("{endpoint}/metrics: no process_cpu_seconds_total"))?;
    }
    Ok(total)
}

/// One HTTP/1.0 GET of `/metrics` from `address` (`host:port`): the whole answer as text.
async fn get_metrics(address: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())
        .await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// The value of the `process_cpu_seconds_total` sample in a Prometheus text exposition (an
/// HTTP answer's headers before it are skipped as lines that are not that sample).
pub fn process_cpu_seconds(exposition: &str) -> Option<f64> {
    exposition.lines().find_map(|line| {
        let value = line.strip_prefix("process_cpu_seconds_total")?;
        // The bare metric name, no labels: a space follows.
        let value = value.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse::<f64>().ok()
    })
}

impl StatusClient {
    /// The CPU seconds this cluster's members have used so far ([`cpu_seconds`]).
    ///
    /// # Errors
    /// As [`cpu_seconds`].
    pub async fn cpu_seconds(&self) -> Result<f64, String> {
        cpu_seconds(&self.endpoints).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_seconds_are_read_from_the_bare_sample_of_an_exposition_after_its_headers() {
        let answer = "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\r\n\
            # HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n\
            # TYPE process_cpu_seconds_total counter\n\
            process_cpu_seconds_total_extra 9\n\
            process_cpu_seconds_total 12.34\n\
            process_open_fds 40\n";
        assert_eq!(process_cpu_seconds(answer), Some(12.34));
        assert_eq!(
            process_cpu_seconds("process_cpu_seconds_total 1.5e+01\n"),
            Some(15.0)
        );
        for without in [
            "",
            "process_open_fds 40\n",
            "process_cpu_seconds_total_extra 9\n",
            "process_cpu_seconds_total{x=\"1\"} 3\n",
            "process_cpu_seconds_total not-a-number\n",
        ] {
            assert_eq!(process_cpu_seconds(without), None, "{without:?}");
        }
    }

    #[test]
    fn a_tls_endpoints_cpu_is_not_asked() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let error = runtime
            .block_on(cpu_seconds(&["https://127.0.0.1:1".to_owned()]))
            .expect_err("a TLS endpoint");
        assert!(error.contains("only a plain http://"), "{error}");
    }
}
