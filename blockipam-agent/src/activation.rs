//! systemd socket activation: the listening unix socket systemd passes as fd 3 (`sd_listen_fds`).
//
// The second module of the workspace with unsafe code (blockipam/src/arena.rs is the first): taking
// ownership of an inherited descriptor by number and asking the kernel what it is cannot be said
// in safe Rust. Each unsafe block names what makes it sound.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileTypeExt;

use crate::AgentError;

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
pub const FIRST_LISTEN_FD: RawFd = 3;

/// The environment of the socket activation protocol, as read at start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListenEnvironment {
    /// `LISTEN_PID`: the process the descriptors are meant for.
    pub listen_pid: Option<String>,
    /// `LISTEN_FDS`: how many descriptors from fd 3 on.
    pub listen_fds: Option<String>,
    /// `LISTEN_FDNAMES`: their names, colon-separated (optional).
    pub listen_fdnames: Option<String>,
}

impl ListenEnvironment {
    /// Reads the three variables and removes them from this process's environment, so that no
    /// child inherits them (as `sd_listen_fds(1)` does). Call it before any other thread starts:
    /// changing the environment is not safe beside threads that read it.
    pub fn take_from_process() -> ListenEnvironment {
        let read = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
        let taken = ListenEnvironment {
            listen_pid: read("LISTEN_PID"),
            listen_fds: read("LISTEN_FDS"),
            listen_fdnames: read("LISTEN_FDNAMES"),
        };
        for name in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
            std::env::remove_var(name);
        }
        taken
    }

    /// Whether these variables pass descriptors to the process `pid`: `LISTEN_PID` is set and
    /// names it. Variables meant for another process (a parent that was activated and did not
    /// unset them) are ignored, as `sd_listen_fds` ignores them.
    ///
    /// # Errors
    /// [`AgentError`] when `LISTEN_PID` is not a process id.
    pub fn is_for(&self, pid: u32) -> Result<bool, AgentError> {
        let Some(listen_pid) = &self.listen_pid else {
            return Ok(false);
        };
        let listen_pid: u32 = listen_pid.trim().parse().map_err(|_| {
            AgentError::new(format!(
                "socket activation: LISTEN_PID={listen_pid:?} is not a process id"
            ))
        })?;
        Ok(listen_pid == pid)
    }

    /// Checks that exactly one descriptor is passed; returns its name (`LISTEN_FDNAMES`), if any.
    ///
    /// # Errors
    /// [`AgentError`] when `LISTEN_FDS` is missing, not a number, or not 1.
    pub fn single_descriptor_name(&self) -> Result<Option<String>, AgentError> {
        let count = self.listen_fds.as_deref().ok_or_else(|| {
            AgentError::new("socket activation: LISTEN_PID is set but LISTEN_FDS is not")
        })?;
        match count.trim().parse::<u32>() {
            Ok(1) => Ok(self
                .listen_fdnames
                .as_deref()
                .and_then(|names| names.split(':').next())
                .filter(|name| !name.is_empty())
                .map(str::to_owned)),
            Ok(n) => Err(AgentError::new(format!(
                "socket activation: LISTEN_FDS={n}, but the agent listens on exactly one socket; \
                 give its .socket unit exactly one ListenStream= (a unix socket path)"
            ))),
            Err(_) => Err(AgentError::new(format!(
                "socket activation: LISTEN_FDS={count:?} is not a number"
            ))),
        }
    }
}

/// The listening socket systemd passed, when the environment says it passed one to this process.
///
/// # Errors
/// [`AgentError`] when the variables are malformed, pass other than one descriptor, or fd 3 is not
/// a listening unix stream socket.
pub fn inherited_listener(
    environment: &ListenEnvironment,
) -> Result<Option<std::os::unix::net::UnixListener>, AgentError> {
    if !environment.is_for(std::process::id())? {
        return Ok(None);
    }
    let name = environment.single_descriptor_name()?;
    let named = name.map(|n| format!(" ({n})")).unwrap_or_default();
    // Safe checks first: fd 3 must be open and a socket before the process takes it as its own.
    let link = std::fs::read_link(format!("/proc/self/fd/{FIRST_LISTEN_FD}")).map_err(|e| {
        AgentError::new(format!(
            "socket activation: LISTEN_FDS=1 but descriptor {FIRST_LISTEN_FD}{named} is not open \
             ({e})"
        ))
    })?;
    if !link.to_string_lossy().starts_with("socket:") {
        return Err(AgentError::new(format!(
            "socket activation: descriptor {FIRST_LISTEN_FD}{named} is {}, not a socket",
            link.display()
        )));
    }
    // SAFETY: fd 3 is open (just checked), systemd passed it to this process for it alone, and
    // nothing else in the agent uses fd 3: from here `owned` is its only owner.
    let owned = unsafe { OwnedFd::from_raw_fd(FIRST_LISTEN_FD) };
    let file = std::fs::File::from(owned);
    let metadata = file.metadata().map_err(|e| {
        AgentError::new(format!(
            "socket activation: cannot inspect descriptor {FIRST_LISTEN_FD}{named}: {e}"
        ))
    })?;
    if !metadata.file_type().is_socket() {
        return Err(AgentError::new(format!(
            "socket activation: descriptor {FIRST_LISTEN_FD}{named} is not a socket"
        )));
    }
    let owned = OwnedFd::from(file);
    set_close_on_exec(&owned, &named)?;
    let domain = socket_option(&owned, libc::SO_DOMAIN, &named)?;
    let kind = socket_option(&owned, libc::SO_TYPE, &named)?;
    let listening = socket_option(&owned, libc::SO_ACCEPTCONN, &named)?;
    if domain != libc::AF_UNIX || kind != libc::SOCK_STREAM || listening != 1 {
        return Err(AgentError::new(format!(
            "socket activation: descriptor {FIRST_LISTEN_FD}{named} is not a listening unix \
             stream socket (domain {domain}, type {kind}, listening {listening}); the agent's \
             .socket unit needs ListenStream=<path of a unix socket>, without Accept=yes"
        )));
    }
    let listener = std::os::unix::net::UnixListener::from(owned);
    listener.set_nonblocking(true).map_err(|e| {
        AgentError::new(format!(
            "socket activation: cannot make descriptor {FIRST_LISTEN_FD}{named} non-blocking: {e}"
        ))
    })?;
    Ok(Some(listener))
}

/// One integer socket option of `socket`.
fn socket_option(socket: &OwnedFd, option: libc::c_int, named: &str) -> Result<i32, AgentError> {
    let mut value: libc::c_int = 0;
    let mut length = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the descriptor is open for the borrow's length; `value` and `length` are valid for
    // writes of the int-sized option asked for, and `length` says so.
    let outcome = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            std::ptr::addr_of_mut!(value).cast(),
            &mut length,
        )
    };
    if outcome != 0 {
        return Err(AgentError::new(format!(
            "socket activation: cannot read socket option {option} of descriptor \
             {FIRST_LISTEN_FD}{named}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(value)
}

/// Marks `socket` close-on-exec (systemd passes it without), as `sd_listen_fds` does.
fn set_close_on_exec(socket: &OwnedFd, named: &str) -> Result<(), AgentError> {
    // SAFETY: F_GETFD and F_SETFD read and set the flags of an open descriptor; no memory is
    // passed.
    let outcome = unsafe {
        let flags = libc::fcntl(socket.as_raw_fd(), libc::F_GETFD);
        if flags < 0 {
            flags
        } else {
            libc::fcntl(socket.as_raw_fd(), libc::F_SETFD, flags | libc::FD_CLOEXEC)
        }
    };
    if outcome < 0 {
        return Err(AgentError::new(format!(
            "socket activation: cannot mark descriptor {FIRST_LISTEN_FD}{named} close-on-exec: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn environment(pid: Option<&str>, fds: Option<&str>, names: Option<&str>) -> ListenEnvironment {
        ListenEnvironment {
            listen_pid: pid.map(str::to_owned),
            listen_fds: fds.map(str::to_owned),
            listen_fdnames: names.map(str::to_owned),
        }
    }

    #[test]
    fn variables_for_another_process_or_none_are_ignored() {
        assert!(!environment(None, Some("1"), None)
            .is_for(42)
            .expect("no pid"));
        assert!(!environment(Some("41"), Some("1"), None)
            .is_for(42)
            .expect("another pid"));
        assert!(environment(Some("42"), Some("1"), None)
            .is_for(42)
            .expect("this pid"));
        assert!(
            inherited_listener(&environment(Some("1"), Some("1"), None))
                .expect("pid 1's")
                .is_none(),
            "descriptors meant for pid 1 were taken"
        );
    }

    #[test]
    fn malformed_or_several_descriptors_are_clear_errors() {
        let err = environment(Some("pid"), Some("1"), None)
            .is_for(42)
            .expect_err("not a pid");
        assert!(err.message.contains("LISTEN_PID=\"pid\""), "{err}");
        let err = environment(Some("42"), Some("2"), None)
            .single_descriptor_name()
            .expect_err("two");
        assert!(err.message.contains("exactly one socket"), "{err}");
        let err = environment(Some("42"), None, None)
            .single_descriptor_name()
            .expect_err("no count");
        assert!(err.message.contains("LISTEN_FDS is not"), "{err}");
        assert_eq!(
            environment(Some("42"), Some("1"), Some("agent.socket:other"))
                .single_descriptor_name()
                .expect("one"),
            Some("agent.socket".to_owned())
        );
    }
}
