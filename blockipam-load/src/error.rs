//! Why a run could not be made at all (as opposed to a run that found problems, which is a
//! [`Report`](crate::Report) that did not pass).

/// A run that could not start or finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// Bad parameters (exit status 2).
    #[error("{0}")]
    Usage(String),
    /// The store, the plugin or etcd could not be set up or read back (exit status 1).
    #[error("{0}")]
    Failed(String),
}

impl LoadError {
    /// A usage error.
    pub fn usage(message: impl Into<String>) -> Self {
        LoadError::Usage(message.into())
    }

    /// A failure.
    pub fn failed(message: impl Into<String>) -> Self {
        LoadError::Failed(message.into())
    }
}
