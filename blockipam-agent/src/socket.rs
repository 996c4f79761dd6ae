//! The agent's socket: its private directory, replacing a stale socket (never a live one, never
//! another kind of file), its mode, and its removal at shutdown.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;

use crate::AgentError;

/// Fails when an agent answers on `path` already, so that a second agent never takes its socket
/// over. A socket nobody accepts on (left by a killed agent) and a missing path pass.
///
/// # Errors
/// [`AgentError`] naming the live socket, or a path that exists and is not a socket.
pub fn refuse_if_live(path: &Path) -> Result<(), AgentError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(AgentError::new(format!(
            "cannot inspect the socket path {}: {e}",
            path.display()
        ))),
        Ok(metadata) if !metadata.file_type().is_socket() => Err(AgentError::new(format!(
            "{} exists and is not a socket: refusing to replace it; remove it or choose another \
             --socket",
            path.display()
        ))),
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(AgentError::new(format!(
                "another blockipam agent is serving on {}: stop it first (a second agent on the \
                 same socket is refused)",
                path.display()
            ))),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(()),
            Err(e) => Err(AgentError::new(format!(
                "cannot tell whether an agent serves on {}: {e}",
                path.display()
            ))),
        },
    }
}

/// Removes the socket when dropped, if it is still the one this agent bound.
#[derive(Debug)]
pub struct SocketGuard {
    path: PathBuf,
    device: u64,
    inode: u64,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        if let Ok(metadata) = std::fs::symlink_metadata(&self.path) {
            if metadata.dev() == self.device && metadata.ino() == self.inode {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    tracing::warn!("cannot remove the socket {}: {e}", self.path.display());
                }
            }
        }
    }
}

/// Binds the agent's socket at `path`: creates a missing directory (0700, or 0711 when
/// `open_to_others`, so that allowed users can reach the socket), replaces a stale socket (see
/// [`refuse_if_live`]), and makes the socket 0600 (0666 when `open_to_others`: the peer
/// credentials are then what keeps other users out).
///
/// # Errors
/// [`AgentError`] when a live agent serves on `path`, the path is not a socket, or the
/// directory or socket cannot be made.
pub fn bind(path: &Path, open_to_others: bool) -> Result<(UnixListener, SocketGuard), AgentError> {
    refuse_if_live(path)?;
    if let Some(directory) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !directory.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(if open_to_others { 0o711 } else { 0o700 })
                .create(directory)
                .map_err(|e| {
                    AgentError::new(format!(
                        "cannot create the socket directory {}: {e}",
                        directory.display()
                    ))
                })?;
        }
    }
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!("replaced the stale socket {}", path.display()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(AgentError::new(format!(
                "cannot remove the stale socket {}: {e}",
                path.display()
            )))
        }
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| AgentError::new(format!("cannot listen on {}: {e}", path.display())))?;
    let mode = if open_to_others { 0o666 } else { 0o600 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| {
        AgentError::new(format!(
            "cannot set the mode of the socket {}: {e}",
            path.display()
        ))
    })?;
    let metadata = std::fs::symlink_metadata(path)
        .map_err(|e| AgentError::new(format!("cannot inspect {}: {e}", path.display())))?;
    Ok((
        listener,
        SocketGuard {
            path: path.to_owned(),
            device: metadata.dev(),
            inode: metadata.ino(),
        },
    ))
}
