//! How failures to reach the agent become `KvError`s: unavailable when nothing was sent,
//! indeterminate when a transaction may have been applied.

use std::io;
use std::path::Path;
use std::time::Duration;

use ipam_core::KvError;

/// The error for a connection attempt to `socket` that failed with `error`.
pub(crate) fn connect_failed(socket: &Path, error: &io::Error) -> KvError {
    let shown = socket.display();
    match error.kind() {
        io::ErrorKind::NotFound => KvError::unavailable(format!(
            "no blockipam agent socket at {shown}: start blockipam-agent, or configure the store \
             to be opened directly (agent_socket \"\" / --agent-socket \"\")"
        )),
        io::ErrorKind::ConnectionRefused => KvError::unavailable(format!(
            "the blockipam agent socket {shown} exists but nothing accepts connections on it: the \
             agent is not running (a socket left by a killed agent); restart blockipam-agent"
        )),
        io::ErrorKind::PermissionDenied => KvError::other(format!(
            "not allowed to connect to the blockipam agent socket {shown}: {error} (only root, the \
             agent's own user and its --allowed-uid users may)"
        )),
        _ => KvError::unavailable(format!(
            "cannot connect to the blockipam agent at {shown}: {error}"
        )),
    }
}

/// The error for an agent that did not finish the hello within `timeout`.
pub(crate) fn hello_timed_out(socket: &Path, timeout: Duration) -> KvError {
    KvError::unavailable(format!(
        "the blockipam agent at {} did not answer within {timeout:?}: it is hung or overloaded, or \
         whatever listens on that socket is not an agent",
        socket.display()
    ))
}

/// The error for a call whose answer never came: the connection was lost or the time ran out.
/// A transaction may have been applied; a read changed nothing.
pub(crate) fn answer_missing(socket: &Path, kind: &str, is_write: bool, why: &str) -> KvError {
    let shown = socket.display();
    if is_write {
        KvError::Indeterminate {
            message: format!(
                "{why} while the blockipam agent at {shown} handled a {kind}: the transaction may \
                 or may not have been applied"
            ),
        }
    } else {
        KvError::unavailable(format!(
            "{why} while the blockipam agent at {shown} handled a {kind}"
        ))
    }
}
