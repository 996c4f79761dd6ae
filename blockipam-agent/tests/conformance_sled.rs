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

mod factory {
    use std::os::unix::fs::FileTypeExt;
    use std::time::Duration;

    use conformance::embedded::EmbeddedFactory;

    use super::*;

    /// The agent the factory starts for an opened store binds its socket in the store's own
    /// directory, which the suite made and removes: a writer the suite kills leaves no directory
    /// of its own behind in the system's temporary directory.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_opened_store_has_its_agent_socket_beside_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("store");
        let store = AgentFactory {
            backend: Backend::Sled,
        }
        .open_at(&path, Duration::from_secs(10), true)
        .await
        .expect("open through an agent");
        let sockets: Vec<String> = std::fs::read_dir(dir.path())
            .expect("read the store's directory")
            .map(|entry| entry.expect("a directory entry"))
            .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_socket()))
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            sockets.len(),
            1,
            "the store's directory should hold its agent's socket, and only it: {sockets:?}"
        );
        assert!(
            sockets[0].starts_with("store.agent-"),
            "the socket is named after the store: {sockets:?}"
        );
        drop(store);
    }
}
