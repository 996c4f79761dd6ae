//! A `blockipam-agent` run in the test's own process (the binary's `run`, flags parsed by its own parser), for tests and the latency bench whose plugin reaches the store through an agent.

use std::ffi::OsString;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use blockipam_agent::{AgentArgs, AgentError};
use blockipam_store::DatastoreType;
use clap::Parser;
use tokio::sync::oneshot;

/// Longest an agent may take to start serving before the test calls it a hang.
const START_GUARD: Duration = Duration::from_secs(30);

/// How the plugin under test reaches a sandbox's store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The plugin opens the store itself (no agent).
    Direct,
    /// An agent holds the store open and the netconf's `agent_socket` names its socket: the
    /// plugin can only reach the store through it (the agent holds the store's lock).
    Agent,
}

/// The agent: `blockipam_agent::run` on a thread with its own multi-threaded runtime, as the
/// binary runs it. Dropping it shuts it down as SIGTERM does (stop accepting, finish the requests
/// in flight, close the store, remove the socket) and waits for that.
#[derive(Debug)]
pub struct InProcessAgent {
    socket: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), AgentError>>>,
}

impl InProcessAgent {
    /// Starts an agent serving the embedded store `store_type` at `store` (created when missing,
    /// as `--create-if-missing` does) on `socket`, and returns once the socket is bound.
    ///
    /// # Errors
    /// The agent's own error message when it stops before serving (a store it cannot open, a live
    /// agent already on the socket).
    pub fn start(socket: &Path, store_type: DatastoreType, store: &Path) -> Result<Self, String> {
        let mut store_flags: Vec<OsString> = ["--datastore-type", store_type.as_str()]
            .map(OsString::from)
            .into();
        store_flags.push("--datastore-path".into());
        store_flags.push(store.into());
        store_flags.push("--create-if-missing".into());
        Self::start_with_flags(socket, store_flags)
    }

    /// Starts an agent on `socket` serving the store `store_flags` select (the binary's
    /// `--datastore-*` / `--etcd-*` flags), and returns once the socket is bound.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_with_flags(socket: &Path, store_flags: Vec<OsString>) -> Result<Self, String> {
        let mut flags: Vec<OsString> = vec!["blockipam-agent".into(), "--socket".into()];
        flags.push(socket.into());
        flags.extend(store_flags);
        flags.extend(
            ["--lock-wait-seconds", "0", "--shutdown-grace-seconds", "10"].map(OsString::from),
        );
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
            thread: Some(thread),
        };
        let deadline = Instant::now() + START_GUARD;
        loop {
            if agent.thread.as_ref().is_some_and(JoinHandle::is_finished) {
                let outcome = agent
                    .thread
                    .take()
                    .map(|thread| thread.join().expect("the agent's thread panicked"));
                return Err(match outcome {
                    Some(Err(e)) => e.message,
                    _ => "the agent stopped before serving, without an error".to_owned(),
                });
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

    /// The socket it serves on.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for InProcessAgent {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
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
