//! blockipam's node agent as a library: the server that serves any `KvStore` over a unix socket
//! ([`server`]), the socket's set-up and removal ([`socket`]), and the binary's flags and main
//! loop ([`cli`], [`run`]).
//!
//! The agent holds the configured store open for its whole life, so that each plugin call (a new
//! process) reaches an open store over the socket instead of opening it; the other end is
//! `backend_agent::AgentStore`. See `docs/agent.md`.

pub mod activation;
pub mod cli;
pub mod cni_cache;
pub mod counters;
pub mod first_start;
pub mod leak_collection;
pub mod liveness;
pub mod metrics;
pub mod server;
pub mod socket;

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use ipam_core::caching::CacheStats;
use ipam_core::KvStore;

pub use cli::AgentArgs;
pub use server::{serve, ServerConfig};

/// Why the agent could not start or stopped with an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentError {
    /// What went wrong, for the log.
    pub message: String,
}

impl AgentError {
    /// An error saying `message`.
    pub fn new(message: impl Into<String>) -> Self {
        AgentError {
            message: message.into(),
        }
    }
}

impl fmt::Display for AgentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for AgentError {}

/// Runs the agent these arguments describe until `shutdown` completes: refuses to start when a
/// live agent already answers on the socket, opens the store directly, binds the socket (a stale
/// one from a dead agent is replaced), serves, and on shutdown stops accepting, lets requests in
/// flight finish (bounded by `--shutdown-grace-seconds`), closes the store and removes the socket.
///
/// # Errors
/// [`AgentError`] when the settings are invalid, the store cannot be opened, or the socket cannot
/// be set up.
pub async fn run(args: &AgentArgs, shutdown: impl Future<Output = ()>) -> Result<(), AgentError> {
    run_on(args, None, shutdown).await
}

/// As [`run`], serving on `inherited` when given: the listening socket systemd passed (socket
/// activation, [`activation`]). That socket is systemd's: the agent neither binds nor checks the
/// socket path, and leaves the socket in place at shutdown.
///
/// # Errors
/// As [`run`].
pub async fn run_on(
    args: &AgentArgs,
    inherited: Option<std::os::unix::net::UnixListener>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), AgentError> {
    // Every setting, from flags or the environment (the etcd password redacted), for whoever
    // reads the journal.
    tracing::info!(configuration = ?args, "blockipam-agent starting");
    let mut settings = args.datastore_settings()?;
    // Checked before anything is opened, bound or written.
    let drain_timeout = args.shutdown_grace()?;
    // A node name given too, even where nothing uses it (a sled or redb store without leak
    // collection); liveness and the leak collection resolve it again, from the default sources
    // when none is given.
    if args.node.is_some() {
        liveness::node_name(args)?;
    }
    // etcd unreachable at boot: serve the socket anyway (calls answer "try again later" until
    // etcd answers) and register the node once it does, rather than exit and be restarted.
    if let Some(etcd) = settings.etcd_mut() {
        etcd.lazy_connect = true;
    }
    let marker = if args.create_on_first_start {
        first_start::prepare(&mut settings)?
    } else {
        None
    };
    if inherited.is_none() {
        socket::refuse_if_live(&args.socket)?;
    }
    // Shared by the dead-node reclaimer (adds) and the metrics endpoint (reads).
    let reclaim_counters = Arc::new(counters::ReclaimCounters::default());
    // Bound before the store is opened: a bad --metrics-listen stops the agent at once.
    // Shared by the leak collection (writes) and the metrics endpoint (reads).
    let leak_counters = Arc::new(counters::LeakCounters::default());
    // Shared by the read cache plugin calls are served through (counts) and the metrics endpoint.
    let cache_stats = Arc::new(CacheStats::default());
    let leak_settings = leak_collection::LeakSettings::from_args(args)?;
    let metrics_endpoint = metrics::MetricsEndpoint::from_args(
        args,
        Arc::clone(&reclaim_counters),
        Arc::clone(&leak_counters),
        Arc::clone(&cache_stats),
    )?;
    // Served from here on, so that probes see the agent start: /healthz answers, /readyz says
    // what the agent is waiting for until its socket accepts.
    let health = Arc::new(metrics::Health::starting("opening the store"));
    let metrics_server = metrics_endpoint.map(|e| e.spawn(Arc::clone(&health)));
    let store: Arc<dyn KvStore> = settings.open().await.map_err(|e| {
        AgentError::new(format!(
            "cannot open the store ({}): {e}",
            settings.describe()
        ))
    })?;
    if let Some(marker) = marker {
        marker.write()?;
    }
    // Probed as it is (readiness reads do not count as the agent's store round trips).
    let probed_store = Arc::downgrade(&store);
    let store = match &metrics_server {
        Some(server) => server.metrics().instrument(store),
        None => store,
    };
    health.set_starting("registering the node and binding the socket");
    let liveness = liveness::start_for(args, &settings, &store, &reclaim_counters).await?;
    let leaks = match leak_settings {
        Some(leak_settings) => Some(leak_collection::LeakCollection::start(
            leak_settings,
            Arc::clone(&store),
            leak_counters,
        )),
        None => {
            tracing::info!("leak collection off (--leak-collection off)");
            None
        }
    };
    let served = settings.identity();
    let (listener, guard, socket_shown) = match inherited {
        Some(inherited) => {
            let listener = tokio::net::UnixListener::from_std(inherited).map_err(|e| {
                AgentError::new(format!(
                    "socket activation: cannot serve the inherited socket: {e}"
                ))
            })?;
            let path = listener
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(std::path::Path::to_path_buf));
            if path.as_deref() != Some(args.socket.as_path()) {
                tracing::warn!(
                    inherited = ?path,
                    socket = %args.socket.display(),
                    "the socket systemd passed is not at --socket: clients find the agent at the \
                     .socket unit's ListenStream="
                );
            }
            let shown = path.map_or_else(
                || "an inherited socket".to_owned(),
                |p| format!("{} (socket activation)", p.display()),
            );
            (listener, None, shown)
        }
        None => {
            let (listener, guard) = socket::bind(&args.socket, !args.allowed_uid.is_empty())?;
            (listener, Some(guard), args.socket.display().to_string())
        }
    };
    tracing::info!(
        store = %settings.describe(),
        socket = %socket_shown,
        allowed_uids = ?args.allowed_uid,
        "blockipam-agent serving"
    );
    let config = ServerConfig {
        served,
        allowed_uids: args.allowed_uid.clone(),
        drain_timeout,
        metrics: metrics_server.as_ref().map(|s| Arc::clone(s.metrics())),
        ..ServerConfig::default()
    };
    health.set_serving(Arc::downgrade(&store), probed_store);
    let shutdown = async {
        shutdown.await;
        health.set_stopping();
    };
    // Plugin calls are served from a cache of what the agent read and wrote, each answer with
    // the conditions its commit must carry (ipam_core::caching); the agent's own work reads the
    // store.
    let cached: Arc<dyn KvStore> =
        Arc::new(ipam_core::node_cache(Arc::clone(&store)).counting_into(cache_stats));
    serve(listener, cached, config, shutdown).await;
    if let Some(leaks) = leaks {
        leaks.stop().await;
    }
    if let Some(liveness) = liveness {
        liveness.stop().await;
    }
    if let Some(metrics_server) = metrics_server {
        // A scrape in progress may hold the store: it is dropped here.
        metrics_server.stop().await;
    }
    // `serve` has dropped every clone of the store it handed out; the store itself closes when
    // this function returns, just after the socket is removed. An inherited socket has no guard:
    // it stays, systemd's, and starts the agent again.
    drop(guard);
    tracing::info!(socket = %socket_shown, "blockipam-agent stopped");
    Ok(())
}
