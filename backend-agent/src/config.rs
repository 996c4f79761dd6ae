//! `AgentConfig`: where the agent's socket is and how long a connection and a call may take.

use std::path::PathBuf;
use std::time::Duration;

/// Where the agent listens by default, and where the plugin and the CLI look for it.
pub const DEFAULT_AGENT_SOCKET: &str = "/run/blockipam/agent.sock";

/// How to reach an agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// The agent's unix socket.
    pub socket: PathBuf,
    /// Upper bound on connecting and on the agent's answer to the hello; beyond it the agent
    /// is unavailable.
    pub connect_timeout: Duration,
    /// Upper bound on one call once connected; beyond it a read is unavailable and a
    /// transaction indeterminate. Longer than the etcd adapter's default request timeout (10 s),
    /// so that an agent serving etcd reports etcd's own error rather than this one.
    pub request_timeout: Duration,
}

impl AgentConfig {
    /// Default connect timeout: 3 s.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
    /// Default request timeout: 20 s.
    pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

    /// The agent at `socket`, with the default timeouts.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        AgentConfig {
            socket: socket.into(),
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// The same configuration with other timeouts.
    pub fn with_timeouts(mut self, connect: Duration, request: Duration) -> Self {
        self.connect_timeout = connect;
        self.request_timeout = request;
        self
    }
}
