//! What the agent answers as committed is on disk: on an embedded store, every store file it wrote is synced before it answers a client, seen in its system calls under strace.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use backend_agent::{AgentConfig, AgentStore};
use ipam_core::{KvStore, Op, Txn};
use test_kit::strace::{
    file_calls, reports_after_a_sync, strace_path, traced_args, written_and_not_synced_at_a_report,
};

const AGENT: &str = env!("CARGO_BIN_EXE_blockipam-agent");

/// Commits the test makes through the agent.
const COMMITS: usize = 6;

/// strace running the agent; both killed when dropped before they ended.
struct TracedAgent {
    strace: Child,
}

impl TracedAgent {
    fn start(trace: &Path, socket: &Path, store_type: &str, store: &Path) -> TracedAgent {
        let strace = Command::new(strace_path())
            .args(traced_args(trace, Path::new(AGENT)))
            .arg("--socket")
            .arg(socket)
            .args(["--datastore-type", store_type, "--datastore-path"])
            .arg(store)
            .args(["--create-if-missing", "--leak-collection", "off"])
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the agent under strace");
        TracedAgent { strace }
    }

    /// The agent's process id: strace's child.
    fn agent_pid(&self) -> u32 {
        let id = self.strace.id();
        let children = std::fs::read_to_string(format!("/proc/{id}/task/{id}/children"))
            .expect("strace's children");
        children
            .split_whitespace()
            .next()
            .and_then(|pid| pid.parse().ok())
            .expect("strace runs the agent")
    }

    /// Stops the agent with SIGTERM, as systemd does, and waits (bounded) for strace to end.
    fn stop(mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.agent_pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.strace.try_wait().expect("poll strace").is_none() {
            assert!(
                Instant::now() < deadline,
                "the agent did not stop within 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for TracedAgent {
    fn drop(&mut self) {
        if let Ok(None) = self.strace.try_wait() {
            if let Ok(children) =
                std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", self.strace.id()))
            {
                for pid in children.split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            let _ = self.strace.kill();
            let _ = self.strace.wait();
        }
    }
}

/// Connects to the agent at `socket`, retrying until it serves (bounded).
async fn connect(socket: &Path) -> AgentStore {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match AgentStore::connect(AgentConfig::new(socket)).await {
            Ok(client) => return client,
            Err(e) => {
                assert!(Instant::now() < deadline, "the agent did not serve: {e}");
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    }
}

#[test]
fn every_commit_the_agent_answers_is_synced_before_its_answer() {
    for store_type in ["sled", "redb"] {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store = dir.path().join(format!("store.{store_type}"));
        let socket = dir.path().join("run/agent.sock");
        let trace = dir.path().join("agent.strace");
        let agent = TracedAgent::start(&trace, &socket, store_type, &store);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            let client = connect(&socket).await;
            // Commits of a few hundred bytes to a few KB (sled keeps larger values in blob
            // files of their own), each answered, with a read between them.
            for round in 0..COMMITS as u8 {
                let value = vec![round; 200 << round];
                client
                    .commit(Txn::new().then(Op::put(format!("durability/{round}"), value)))
                    .await
                    .expect("commit through the agent");
                client
                    .get(&format!("durability/{round}"))
                    .await
                    .expect("read it back")
                    .expect("the committed key");
            }
        });
        agent.stop();
        let calls = file_calls(&std::fs::read_to_string(&trace).expect("the trace"));
        let unsynced = written_and_not_synced_at_a_report(&calls, &store.display().to_string());
        assert!(
            unsynced.is_empty(),
            "{store_type}: written and not synced when the agent answered (a power loss after \
             the answer could lose a write its client was told is done): {unsynced:?}"
        );
        // And each of the six commits was synced before its answer (the reads need none).
        let synced_answers = reports_after_a_sync(&calls, &store.display().to_string());
        assert!(
            synced_answers >= COMMITS,
            "{store_type}: {synced_answers} answers came after a sync of the store, for \
             {COMMITS} commits"
        );
    }
}
