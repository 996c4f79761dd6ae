//! The metrics endpoint: an HTTP/1.1 listener answering `GET /metrics` in the classic text
//! format or OpenMetrics, and the probes `GET /healthz` and `GET /readyz`, with bounded
//! connections.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ACCEPT, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::counters::{LeakCounters, ReclaimCounters};
use crate::AgentError;
use ipam_core::caching::CacheStats;

use super::health::Health;
use super::{AgentMetrics, ConnectionLimits, OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE};

// ---------------------------------------------------------------------------------------------
// The HTTP endpoint
// ---------------------------------------------------------------------------------------------

/// The metrics listener, bound at start-up so that a bad address stops the agent before it opens
/// its store.
#[derive(Debug)]
pub struct MetricsEndpoint {
    listener: TcpListener,
    metrics: Arc<AgentMetrics>,
    limits: ConnectionLimits,
}

impl MetricsEndpoint {
    /// The endpoint `--metrics-listen` asks for, bound, or `None` when the flag is absent.
    ///
    /// # Errors
    /// [`AgentError`] for a bad `--metrics-cache-seconds` or an address that cannot be bound.
    pub fn from_args(
        args: &crate::AgentArgs,
        reclaim: Arc<ReclaimCounters>,
        leaks: Arc<LeakCounters>,
        cache: Arc<CacheStats>,
    ) -> Result<Option<Self>, AgentError> {
        let cache_for = args.metrics_cache()?;
        let Some(address) = args.metrics_listen else {
            tracing::info!("metrics endpoint off (no --metrics-listen)");
            return Ok(None);
        };
        let metrics = AgentMetrics::new(reclaim, cache_for)
            .with_leak_counters(leaks)
            .with_cache_stats(cache);
        let endpoint = Self::bind(address, Arc::new(metrics))?;
        tracing::info!(
            "metrics endpoint listening on http://{}/metrics",
            endpoint.local_addr()?
        );
        Ok(Some(endpoint))
    }

    /// Binds `address` for `metrics`.
    ///
    /// # Errors
    /// [`AgentError`] naming the address when it cannot be bound (in use, not local, no right).
    pub fn bind(address: SocketAddr, metrics: Arc<AgentMetrics>) -> Result<Self, AgentError> {
        let bound = std::net::TcpListener::bind(address)
            .and_then(|listener| {
                listener.set_nonblocking(true)?;
                TcpListener::from_std(listener)
            })
            .map_err(|e| {
                AgentError::new(format!(
                    "cannot listen for metrics on {address} (--metrics-listen): {e}"
                ))
            })?;
        Ok(MetricsEndpoint {
            listener: bound,
            metrics,
            limits: ConnectionLimits::default(),
        })
    }

    /// The same endpoint with other connection bounds (the defaults suit Prometheus).
    pub fn with_limits(mut self, limits: ConnectionLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The address actually bound (the port chosen when `:0` was asked for).
    ///
    /// # Errors
    /// [`AgentError`] when the socket cannot say.
    pub fn local_addr(&self) -> Result<SocketAddr, AgentError> {
        self.listener
            .local_addr()
            .map_err(|e| AgentError::new(format!("cannot read the metrics address: {e}")))
    }

    /// The metrics this endpoint serves.
    pub fn metrics(&self) -> &Arc<AgentMetrics> {
        &self.metrics
    }

    /// Starts serving; `health` says whether the agent is ready and holds the store the IPAM
    /// gauges are computed from (weakly, so that the store closes when the agent lets go of it).
    pub fn spawn(self, health: Arc<Health>) -> MetricsServer {
        let (stop, stopped) = watch::channel(false);
        let metrics = Arc::clone(&self.metrics);
        let task = tokio::spawn(accept_loop(
            self.listener,
            self.metrics,
            health,
            self.limits,
            stopped,
        ));
        MetricsServer {
            stop,
            task: Some(task),
            metrics,
        }
    }
}

/// The running metrics endpoint.
#[derive(Debug)]
pub struct MetricsServer {
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
    metrics: Arc<AgentMetrics>,
}

impl MetricsServer {
    /// The metrics this endpoint serves.
    pub fn metrics(&self) -> &Arc<AgentMetrics> {
        &self.metrics
    }

    /// Stops accepting, drops the scrapes in progress and waits until they are gone.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            if let Err(e) = task.await {
                tracing::warn!("the metrics endpoint ended abnormally: {e}");
            }
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    metrics: Arc<AgentMetrics>,
    health: Arc<Health>,
    limits: ConnectionLimits,
    mut stopped: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    let served = Arc::new(AtomicU64::new(0));
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if connections.len() >= limits.max_connections {
                        tracing::debug!(%peer, "metrics: too many scrapes at once, closing one");
                        continue;
                    }
                    let metrics = Arc::clone(&metrics);
                    let health = Arc::clone(&health);
                    let served = Arc::clone(&served);
                    connections.spawn(async move {
                        let service = hyper::service::service_fn(move |request| {
                            let metrics = Arc::clone(&metrics);
                            let health = Arc::clone(&health);
                            served.fetch_add(1, Ordering::Relaxed);
                            async move { Ok::<_, Infallible>(respond(&metrics, &health, request).await) }
                        });
                        // One request per connection (Prometheus connects anew for each scrape),
                        // so that the lifetime bound never cuts a kept-alive connection between
                        // two scrapes, and no unread request body is waited for.
                        let connection = hyper::server::conn::http1::Builder::new()
                            .timer(TokioTimer::new())
                            .header_read_timeout(limits.header_read)
                            .keep_alive(false)
                            .serve_connection(TokioIo::new(stream), service);
                        // The lifetime bounds what hyper does not: a request body that never
                        // comes, an answer the client never reads.
                        match tokio::time::timeout(limits.lifetime, connection).await {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, "metrics: a scrape connection ended: {e}");
                            }
                            Err(_) => tracing::debug!(
                                %peer,
                                "metrics: a scrape connection outlived {:?}, closed",
                                limits.lifetime
                            ),
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!("metrics: accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    tracing::debug!(
        scrapes = served.load(Ordering::Relaxed),
        "metrics endpoint stopped"
    );
}

async fn respond(
    metrics: &AgentMetrics,
    health: &Health,
    request: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let path = request.uri().path();
    if !matches!(path, "/metrics" | "/healthz" | "/readyz") {
        return plain(
            StatusCode::NOT_FOUND,
            "not found: the metrics are at /metrics, the probes at /healthz and /readyz\n",
        );
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return plain(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and HEAD are served here\n",
        );
    }
    match path {
        // Live: this answer comes from the agent's runtime, which is all liveness asks.
        "/healthz" => return plain(StatusCode::OK, "ok\n"),
        "/readyz" => {
            return match health.readiness().await {
                Ok(()) => plain(StatusCode::OK, "ok\n"),
                Err(reason) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
            }
        }
        _ => {}
    }
    let store = health.metrics_store();
    let openmetrics = request
        .headers()
        .get_all(ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .any(|value| value.contains("application/openmetrics-text"));
    let body = metrics.scrape(&store, openmetrics).await;
    let content_type = if openmetrics {
        OPENMETRICS_CONTENT_TYPE
    } else {
        TEXT_CONTENT_TYPE
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

pub(super) fn plain(status: StatusCode, message: &'static str) -> Response<Full<Bytes>> {
    text(status, message.to_owned())
}

fn text(status: StatusCode, message: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(message)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
