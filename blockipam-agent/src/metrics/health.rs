//! The agent's health as a kubelet's probes see it, served beside the metrics: `GET /healthz`
//! (live: the agent's runtime answers) and `GET /readyz` (ready: the store is open, the socket
//! accepts, and the store answers one bounded read, whose outcome is reused for a second).

use std::sync::{RwLock, Weak};
use std::time::{Duration, Instant};

use ipam_core::model::keys;
use ipam_core::KvStore;
use tokio::sync::Mutex;

/// Longest the readiness read may take before the store counts as not answering.
pub const READINESS_READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one readiness read's outcome answers later probes: probes cost at most one store
/// read per period, however often they come.
pub const READINESS_CACHE: Duration = Duration::from_secs(1);

/// Where the agent is in its life.
#[derive(Debug, Clone)]
enum Phase {
    /// Not serving yet: what it is doing (opening the store, binding the socket).
    Starting(&'static str),
    /// Serving its socket: the store the metrics read (instrumented) and the store the
    /// readiness read goes to (not instrumented, so that probes do not show in the counters).
    Serving {
        metrics_store: Weak<dyn KvStore>,
        probed_store: Weak<dyn KvStore>,
    },
    /// Shutting down: the socket no longer accepts.
    Stopping,
}

/// The agent's phase and the last readiness read, shared by the agent's main loop (which moves
/// the phase on) and the HTTP endpoint (which answers the probes).
#[derive(Debug)]
pub struct Health {
    phase: RwLock<Phase>,
    last_read: Mutex<Option<(Instant, Result<(), String>)>>,
}

impl Health {
    /// An agent still starting, doing `what` (for the probe's answer, e.g. "opening the store").
    pub fn starting(what: &'static str) -> Self {
        Health {
            phase: RwLock::new(Phase::Starting(what)),
            last_read: Mutex::new(None),
        }
    }

    /// An agent already serving `store` (tests of the endpoint alone).
    pub fn serving(store: Weak<dyn KvStore>) -> Self {
        let health = Health::starting("starting");
        health.set_serving(store.clone(), store);
        health
    }

    /// Now doing `what` before serving.
    pub fn set_starting(&self, what: &'static str) {
        self.set(Phase::Starting(what));
    }

    /// The socket accepts: from here on readiness is the store's answer.
    pub fn set_serving(&self, metrics_store: Weak<dyn KvStore>, probed_store: Weak<dyn KvStore>) {
        self.set(Phase::Serving {
            metrics_store,
            probed_store,
        });
    }

    /// Shutting down: not ready any more.
    pub fn set_stopping(&self) {
        self.set(Phase::Stopping);
    }

    fn set(&self, phase: Phase) {
        match self.phase.write() {
            Ok(mut current) => *current = phase,
            Err(poisoned) => *poisoned.into_inner() = phase,
        }
    }

    fn phase(&self) -> Phase {
        match self.phase.read() {
            Ok(phase) => phase.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The store the metrics are computed from (a dead reference before the agent serves).
    pub fn metrics_store(&self) -> Weak<dyn KvStore> {
        match self.phase() {
            Phase::Serving { metrics_store, .. } => metrics_store,
            Phase::Starting(_) | Phase::Stopping => Weak::<ipam_core::MemoryStore>::new(),
        }
    }

    /// `Ok` when ready, else the one-line reason.
    pub async fn readiness(&self) -> Result<(), String> {
        let store = match self.phase() {
            Phase::Starting(what) => return Err(format!("not ready: {what}")),
            Phase::Stopping => return Err("not ready: shutting down".to_owned()),
            Phase::Serving { probed_store, .. } => probed_store,
        };
        // One read at a time; probes that come meanwhile wait for it and take its outcome.
        let mut last_read = self.last_read.lock().await;
        if let Some((at, outcome)) = last_read.as_ref() {
            if at.elapsed() < READINESS_CACHE {
                return outcome.clone();
            }
        }
        let outcome = read_once(&store).await;
        *last_read = Some((Instant::now(), outcome.clone()));
        outcome
    }
}

/// One read of the store's format record, bounded by [`READINESS_READ_TIMEOUT`].
async fn read_once(store: &Weak<dyn KvStore>) -> Result<(), String> {
    let Some(store) = store.upgrade() else {
        return Err("not ready: the store is closed (the agent is stopping)".to_owned());
    };
    let key = keys::store_format();
    match tokio::time::timeout(READINESS_READ_TIMEOUT, store.get(&key)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!(
            "not ready: the store does not answer: {}",
            e.to_string().replace('\n', " ")
        )),
        Err(_) => Err(format!(
            "not ready: the store did not answer a read within {READINESS_READ_TIMEOUT:?}"
        )),
    }
}
