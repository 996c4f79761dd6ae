//! The CLI's error type and the exit statuses it maps to.

use ipam_core::{IpamError, KvError};

/// Exit status of a command that did what was asked.
pub const EXIT_OK: i32 = 0;
/// Exit status of a command that failed, or of a check that found problems.
pub const EXIT_FAILURE: i32 = 1;
/// Exit status of a command line that can never succeed as typed (unknown flag, bad value, ...).
pub const EXIT_USAGE: i32 = 2;

/// Why a command did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CtlError {
    /// The command line is wrong whatever the store holds (exit status 2).
    #[error("{0}")]
    Usage(String),
    /// The command failed against this store (exit status 1).
    #[error("{0}")]
    Failed(String),
}

impl CtlError {
    /// Shorthand for [`CtlError::Usage`].
    pub fn usage(message: impl Into<String>) -> Self {
        CtlError::Usage(message.into())
    }

    /// Shorthand for [`CtlError::Failed`].
    pub fn failed(message: impl Into<String>) -> Self {
        CtlError::Failed(message.into())
    }

    /// The process exit status for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            CtlError::Usage(_) => EXIT_USAGE,
            CtlError::Failed(_) => EXIT_FAILURE,
        }
    }

    /// The same error with `context` put in front of its message.
    pub fn context(self, context: &str) -> Self {
        match self {
            CtlError::Usage(m) => CtlError::Usage(format!("{context}: {m}")),
            CtlError::Failed(m) => CtlError::Failed(format!("{context}: {m}")),
        }
    }
}

impl From<IpamError> for CtlError {
    fn from(error: IpamError) -> Self {
        CtlError::Failed(one_line(&error.to_string()))
    }
}

impl From<KvError> for CtlError {
    fn from(error: KvError) -> Self {
        CtlError::Failed(one_line(&error.to_string()))
    }
}

/// Joins the lines of a message so that every error is one line on stderr.
pub fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_errors_exit_2_and_failures_exit_1() {
        assert_eq!(CtlError::usage("x").exit_code(), EXIT_USAGE);
        assert_eq!(CtlError::failed("x").exit_code(), EXIT_FAILURE);
        assert_eq!(
            CtlError::from(IpamError::PoolNotFound("p".into())).exit_code(),
            EXIT_FAILURE
        );
    }

    #[test]
    fn multi_line_messages_become_one_line() {
        assert_eq!(one_line("a\n  b\n\nc  "), "a b c");
    }

    #[test]
    fn context_keeps_the_kind() {
        let e = CtlError::usage("bad").context("--flag");
        assert_eq!(e, CtlError::Usage("--flag: bad".into()));
    }
}
