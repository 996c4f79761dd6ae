//! A `blockipam-agent` in the test's own process, started one of two ways: the binary's own
//! `run` (flags parsed by its own parser) on a thread of its own, or its `serve` loop over a
//! store the test opened, as a task on the test's runtime.

use std::ffi::OsString;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_agent::{AgentConfig, AgentStore};
use blockipam_agent::{serve, AgentArgs, AgentError, ServerConfig};
use blockipam_store::DatastoreType;
use clap::Parser;
use ipam_core::KvStore;
use tokio::sync::oneshot;

/// Longest an agent run by [`InProcessAgent::run_binary`] may take to start serving before the
/// test calls it a hang.
const START_GUARD: Duration = Duration::from_secs(30);

/// An agent serving one store on a unix socket, in this process.
///
/// How it stops depends on how it was started: see [`run_binary`](Self::run_binary) and
/// [`serve_on_current_runtime`](Self::serve_on_current_runtime).
pub struct InProcessAgent {
    /// The socket it serves on.
    pub socket: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    running: Running,
    /// The temporary directory holding the socket, when the agent chose it.
    _socket_dir: Option<tempfile::TempDir>,
}

/// Where the agent runs.
enum Running {
    /// `blockipam_agent::run` on a thread with its own multi-threaded runtime.
    Thread(Option<std::thread::JoinHandle<Result<(), AgentError>>>),
    /// `blockipam_agent::serve` as a task on the runtime that started it.
    Task(Option<tokio::task::JoinHandle<()>>),
}

impl std::fmt::Debug for InProcessAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let running = match self.running {
            Running::Thread(_) => "the binary's run, on its own thread",
            Running::Task(_) => "serve, on the test's runtime",
        };
        f.debug_struct("InProcessAgent")
            .field("socket", &self.socket)
            .field("running", &running)
            .finish_non_exhaustive()
    }
}

impl InProcessAgent {
    /// Runs the agent binary's `run` on a thread with its own multi-threaded runtime, as the
    /// binary runs it, serving the embedded store `store_type` at `store` (created when missing,
    /// as `--create-if-missing` does) on `socket`, and returns once the socket is bound.
    /// Dropping it shuts it down as SIGTERM does (stop accepting, finish the requests in flight,
    /// close the store, remove the socket) and waits for that.
    ///
    /// # Errors
    /// The agent's own error message when it stops before serving (a store it cannot open, a live
    /// agent already on the socket).
    pub fn run_binary(
        socket: &Path,
        store_type: DatastoreType,
        store: &Path,
    ) -> Result<Self, String> {
        let mut store_flags: Vec<OsString> = ["--datastore-type", store_type.as_str()]
            .map(OsString::from)
            .into();
        store_flags.push("--datastore-path".into());
        store_flags.push(store.into());
        store_flags.push("--create-if-missing".into());
        Self::run_binary_with_flags(socket, store_flags)
    }

    /// As [`run_binary`](Self::run_binary), serving the store `store_flags` select (the
    /// binary's `--datastore-*` / `--etcd-*` flags, and any other of its flags; leak collection
    /// is off unless they set `--leak-collection`).
    ///
    /// # Errors
    /// As [`run_binary`](Self::run_binary).
    pub fn run_binary_with_flags(
        socket: &Path,
        store_flags: Vec<OsString>,
    ) -> Result<Self, String> {
        let mut flags: Vec<OsString> = vec!["blockipam-agent".into(), "--socket".into()];
        flags.push(socket.into());
        // Leak collection asks the machine's container runtime unless told otherwise: off for
        // tests that do not ask for it, so that no test depends on what the machine runs.
        let leak_collection_given = store_flags.iter().any(|f| f == "--leak-collection");
        flags.extend(store_flags);
        flags.extend(
            ["--lock-wait-seconds", "0", "--shutdown-grace-seconds", "10"].map(OsString::from),
        );
        if !leak_collection_given {
            flags.extend(["--leak-collection", "off"].map(OsString::from));
        }
        let args =
            AgentArgs::try_parse_from(flags).map_err(|e| format!("the agent's flags: {e}"))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("blockipam-agent".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| AgentError::new(format!("the agent's runtime: {e}")))?;
                runtime.block_on(blockipam_agent::run(&args, async {
                    let _ = stopped.await;
                }))
            })
            .expect("start the agent's thread");
        let mut agent = InProcessAgent {
            socket: socket.to_owned(),
            stop: Some(stop),
            running: Running::Thread(Some(thread)),
            _socket_dir: None,
        };
        let deadline = Instant::now() + START_GUARD;
        loop {
            if let Running::Thread(thread) = &mut agent.running {
                if thread
                    .as_ref()
                    .is_some_and(std::thread::JoinHandle::is_finished)
                {
                    let outcome = thread
                        .take()
                        .map(|thread| thread.join().expect("the agent's thread panicked"));
                    return Err(match outcome {
                        Some(Err(e)) => e.message,
                        _ => "the agent stopped before serving, without an error".to_owned(),
                    });
                }
            }
            let bound = std::fs::symlink_metadata(socket)
                .map(|m| m.file_type().is_socket())
                .unwrap_or(false);
            if bound {
                return Ok(agent);
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not bind {} within {START_GUARD:?}",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Serves `store` with `config` (the agent's `serve` loop, no flags, no lock) on a new socket
    /// in a temporary directory of its own, as a task on the current Tokio runtime. Dropping it
    /// only asks the server to stop (it finishes asynchronously); [`stop`](Self::stop) waits.
    ///
    /// # Panics
    /// When the socket cannot be bound, or outside a Tokio runtime.
    pub fn serve_on_current_runtime(store: Arc<dyn KvStore>, config: ServerConfig) -> Self {
        let dir = tempfile::tempdir().expect("a temp dir for the socket");
        let socket = dir.path().join("agent.sock");
        let mut agent = Self::serve_at_on_current_runtime(&socket, store, config);
        agent._socket_dir = Some(dir);
        agent
    }

    /// As [`serve_on_current_runtime`](Self::serve_on_current_runtime), on `socket` (its
    /// directory created when missing, as the agent creates it).
    ///
    /// # Panics
    /// When the socket cannot be bound, or outside a Tokio runtime.
    pub fn serve_at_on_current_runtime(
        socket: &Path,
        store: Arc<dyn KvStore>,
        config: ServerConfig,
    ) -> Self {
        let socket = socket.to_owned();
        let (listener, guard) =
            blockipam_agent::socket::bind(&socket, !config.allowed_uids.is_empty())
                .expect("bind the agent socket");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            serve(listener, store, config, async {
                let _ = stopped.await;
            })
            .await;
            drop(guard);
        });
        InProcessAgent {
            socket,
            stop: Some(stop),
            running: Running::Task(Some(task)),
            _socket_dir: None,
        }
    }

    /// A client of this agent.
    ///
    /// # Panics
    /// When it cannot connect.
    pub async fn client(&self) -> AgentStore {
        AgentStore::connect(AgentConfig::new(&self.socket))
            .await
            .expect("connect to the in-process agent")
    }

    /// Stops the agent and waits until it has let go of the store.
    ///
    /// # Panics
    /// When the agent stopped with an error or panicked.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Running::Task(task) = &mut self.running {
            if let Some(task) = task.take() {
                task.await.expect("the agent server task");
            }
        }
        // An agent on its own thread is joined by the drop.
    }
}

impl Drop for InProcessAgent {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Running::Thread(thread) = &mut self.running {
            if let Some(thread) = thread.take() {
                let outcome = thread.join();
                // A failed stop is worth a test failure, but never a panic while already unwinding.
                if !std::thread::panicking() {
                    match outcome {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => panic!("the agent stopped with an error: {e}"),
                        Err(_) => panic!("the agent's thread panicked"),
                    }
                }
            }
        }
    }
}
