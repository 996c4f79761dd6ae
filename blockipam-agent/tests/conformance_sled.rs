//! The conformance suite through the agent over sled: every storage and allocator case, and the
//! embedded cases that say something about an agent (see docs/agent.md, "Conformance").

mod common;

use common::{AgentFactory, Backend};

conformance::kv_conformance_tests!(AgentFactory {
    backend: Backend::Sled
});
conformance::ipam_conformance_tests!(AgentFactory {
    backend: Backend::Sled
});

// Opening is starting an agent on the store, closing is stopping it. The cases about the
// engine's files (missing store, empty placeholder, private files, foreign file or directory)
// and the two-process case (each open a new agent) prove nothing about the agent: the backend's
// own conformance test runs them.
conformance::__expand_cases!(embedded, conformance::embedded, AgentFactory { backend: Backend::Sled };
    writes_survive_a_clean_close_and_reopen,
    acknowledged_writes_survive_kill_9_of_the_writing_process,
    revisions_keep_growing_after_reopen,
    second_open_waits_for_the_lock_then_reports_unavailable,
    waiting_open_proceeds_once_the_holder_closes,
);

mod embedded_child {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "child process of embedded::acknowledged_writes_survive_kill_9_of_the_writing_process, which starts it"]
    async fn kill_writer() {
        conformance::embedded::run_kill_writer(&AgentFactory {
            backend: Backend::Sled,
        })
        .await;
    }
}
