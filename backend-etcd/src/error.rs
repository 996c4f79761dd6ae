//! The one place where etcd-client and gRPC errors become `KvError`s.

use std::error::Error as _;
use std::time::Duration;

use ipam_core::KvError;
use tonic::Code;

/// What kind of request failed: reads (and authentication) can be retried freely, a
/// transaction only when the error proves it never reached etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Range requests and authentication: nothing is written, retrying is always safe.
    Read,
    /// A transaction: its outcome matters.
    Write,
}

/// Converts an etcd-client error from a request to `endpoint` into a [`KvError`].
///
/// - a connection that could not be established (the request never left) → `Unavailable`;
/// - rejected credentials or missing permissions → `Other`, saying so;
/// - requests etcd refuses by shape or size → `InvalidArgument`;
/// - etcd refusing before doing anything (no leader, too many requests) → `Unavailable`;
/// - any other transport failure or timeout: `Unavailable` for reads, `Indeterminate` for writes.
pub(crate) fn map_error(err: etcd_client::Error, kind: Kind, endpoint: &str) -> KvError {
    use etcd_client::Error as E;
    match err {
        E::GRpcStatus(status) => map_status(&status, kind, endpoint),
        E::InvalidArgs(message) => {
            KvError::invalid(format!("etcd client at {endpoint}: {message}"))
        }
        E::InvalidUri(e) => {
            KvError::invalid(format!("etcd endpoint {endpoint} is not a valid URI: {e}"))
        }
        // Raised while setting a connection up, before any request was sent.
        E::TransportError(e) => {
            KvError::unavailable(format!("etcd at {endpoint}: {}", error_chain(&e)))
        }
        E::IoError(e) => match kind {
            Kind::Read => KvError::unavailable(format!("etcd at {endpoint}: {e}")),
            Kind::Write => indeterminate(endpoint, &e.to_string()),
        },
        other => KvError::other(format!("etcd at {endpoint}: {other}")),
    }
}

/// The error for a request that got no answer within `after`; `sent` is false when the request
/// is known not to have been handed to the connection yet.
pub(crate) fn timeout_error(kind: Kind, endpoint: &str, after: Duration, sent: bool) -> KvError {
    let what = format!("no answer within {after:?}");
    match kind {
        Kind::Write if sent => indeterminate(endpoint, &what),
        _ => KvError::unavailable(format!("etcd at {endpoint}: {what}")),
    }
}

/// True when etcd refused a read at a revision that compaction already discarded.
pub(crate) fn is_compacted(err: &etcd_client::Error) -> bool {
    matches!(err, etcd_client::Error::GRpcStatus(s)
        if s.code() == Code::OutOfRange && s.message().contains("compacted"))
}

fn indeterminate(endpoint: &str, what: &str) -> KvError {
    KvError::Indeterminate {
        message: format!(
            "etcd at {endpoint}: {what}; the transaction may or may not have been applied"
        ),
    }
}

fn map_status(status: &tonic::Status, kind: Kind, endpoint: &str) -> KvError {
    let code = status.code();
    let message = status.message();
    let described = || {
        let local = status
            .source()
            .map(|source| format!(" ({})", error_chain(source)))
            .unwrap_or_default();
        format!("etcd at {endpoint}: {code:?}: {message}{local}")
    };

    // The connection could not be set up: nothing was sent, whatever the request.
    if connect_failed(status) {
        return KvError::unavailable(described());
    }

    // Authentication and authorization: permanent until someone changes the configuration.
    if message.contains("authentication failed") || message.contains("user name is empty") {
        return KvError::other(format!(
            "etcd at {endpoint} rejected the configured user name or password: {message}"
        ));
    }
    if message.contains("authentication is not enabled") {
        return KvError::other(format!(
            "etcd at {endpoint} has authentication disabled, but a user name is configured: \
             {message}"
        ));
    }
    if code == Code::PermissionDenied || message.contains("permission denied") {
        return KvError::other(format!(
            "etcd at {endpoint} denied permission (does the user's role cover the key prefix?): \
             {message}"
        ));
    }
    if code == Code::Unauthenticated {
        return KvError::other(format!(
            "etcd at {endpoint} refused the authentication token: {message}"
        ));
    }
    // The auth store changed under a valid token: refused before doing anything, retry.
    if message.contains("revision of auth store is old") {
        return KvError::unavailable(described());
    }

    // Refused before anything was applied, and retrying later may work.
    if message.contains("etcdserver: no leader") || message.contains("too many requests") {
        return KvError::unavailable(described());
    }
    if message.contains("database space exceeded") {
        return KvError::other(format!(
            "etcd at {endpoint} is out of space (NOSPACE alarm) and refuses writes until an \
             operator compacts, defragments and disarms it: {message}"
        ));
    }

    // Requests etcd or gRPC refuse because of their shape or size.
    if code == Code::InvalidArgument
        || (code == Code::ResourceExhausted && message.contains("larger than max"))
    {
        return KvError::invalid(format!("etcd at {endpoint} refused the request: {message}"));
    }

    match (kind, code) {
        (
            Kind::Read,
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Aborted
            | Code::ResourceExhausted,
        ) => KvError::unavailable(described()),
        // A local transport failure (connection reset, stream closed) carries its cause.
        (Kind::Read, Code::Unknown | Code::Internal) if status.source().is_some() => {
            KvError::unavailable(described())
        }
        (
            Kind::Write,
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Aborted
            | Code::Unknown
            | Code::Internal
            | Code::DataLoss,
        ) => indeterminate(endpoint, &described()),
        _ => KvError::other(described()),
    }
}

/// True when the status was produced because the connection to the server could not be set up
/// (refused, unreachable, TLS handshake failed, connect timeout): the request never left.
fn connect_failed(status: &tonic::Status) -> bool {
    let mut source = status.source();
    while let Some(err) = source {
        if err.downcast_ref::<tonic::ConnectError>().is_some() {
            return true;
        }
        source = err.source();
    }
    false
}

/// An error and its causes on one line: "a: b: c".
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const EP: &str = "http://127.0.0.1:1";

    fn status(code: Code, message: &str) -> etcd_client::Error {
        etcd_client::Error::GRpcStatus(tonic::Status::new(code, message))
    }

    fn local(err: impl std::error::Error + Send + Sync + 'static) -> etcd_client::Error {
        etcd_client::Error::GRpcStatus(tonic::Status::from_error(Box::new(err)))
    }

    fn refused() -> etcd_client::Error {
        local(tonic::ConnectError(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused",
        ))))
    }

    #[test]
    fn connect_failure_is_unavailable_even_for_writes() {
        for kind in [Kind::Read, Kind::Write] {
            let err = map_error(refused(), kind, EP);
            assert!(err.is_retryable(), "{kind:?}: {err:?}");
            assert!(err.to_string().contains(EP), "{err}");
        }
    }

    /// An error with a message and an optional cause.
    #[derive(Debug)]
    struct Caused(&'static str, Option<Box<Caused>>);

    impl std::fmt::Display for Caused {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Caused {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1
                .as_deref()
                .map(|c| c as &(dyn std::error::Error + 'static))
        }
    }

    #[test]
    fn a_local_failure_is_described_with_each_of_its_causes_once() {
        // A cause whose text its parent repeats already is not said twice; a deeper one is added.
        let chain = || {
            Caused(
                "client error: tcp connect error",
                Some(Box::new(Caused(
                    "tcp connect error",
                    Some(Box::new(Caused("Connection refused (os error 111)", None))),
                ))),
            )
        };
        assert_eq!(
            error_chain(&chain()),
            "client error: tcp connect error: Connection refused (os error 111)"
        );
        let text = map_error(local(chain()), Kind::Read, EP).to_string();
        assert!(
            text.contains("(client error: tcp connect error: Connection refused (os error 111))"),
            "the causes of a local failure named: {text}"
        );
    }

    #[test]
    fn a_servers_unknown_or_internal_error_on_a_read_is_not_retried() {
        // No local cause: the server answered with an error retrying will not change.
        for code in [Code::Unknown, Code::Internal] {
            let err = map_error(status(code, "etcdserver: unexpected"), Kind::Read, EP);
            assert!(matches!(err, KvError::Other { .. }), "{code:?}: {err:?}");
        }
        // Exhausted for another reason than the message's size: a read may be tried again.
        let err = map_error(
            status(Code::ResourceExhausted, "grpc: server overloaded"),
            Kind::Read,
            EP,
        );
        assert!(err.is_retryable(), "{err:?}");
    }

    #[test]
    fn transport_failure_after_sending_is_indeterminate_for_writes_only() {
        let reset = || {
            local(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "connection reset",
            ))
        };
        assert!(map_error(reset(), Kind::Read, EP).is_retryable());
        assert!(matches!(
            map_error(reset(), Kind::Write, EP),
            KvError::Indeterminate { .. }
        ));
    }

    #[test]
    fn server_timeouts_are_unavailable_for_reads_and_indeterminate_for_writes() {
        for code in [Code::Unavailable, Code::DeadlineExceeded, Code::Cancelled] {
            let read = map_error(
                status(code, "etcdserver: request timed out"),
                Kind::Read,
                EP,
            );
            assert!(read.is_retryable(), "{read:?}");
            let write = map_error(
                status(code, "etcdserver: request timed out"),
                Kind::Write,
                EP,
            );
            assert!(matches!(write, KvError::Indeterminate { .. }), "{write:?}");
        }
    }

    #[test]
    fn no_leader_and_too_many_requests_are_unavailable_for_writes() {
        let no_leader = status(Code::Unavailable, "etcdserver: no leader");
        assert!(map_error(no_leader, Kind::Write, EP).is_retryable());
        let busy = status(Code::ResourceExhausted, "etcdserver: too many requests");
        assert!(map_error(busy, Kind::Write, EP).is_retryable());
    }

    #[test]
    fn auth_failures_are_other_with_a_clear_message() {
        let cases = [
            (
                Code::InvalidArgument,
                "etcdserver: authentication failed, invalid user ID or password",
                "user name or password",
            ),
            (
                Code::PermissionDenied,
                "etcdserver: permission denied",
                "permission",
            ),
            (
                Code::PermissionDenied,
                "etcdserver: role grants no access to the key",
                "permission",
            ),
            (Code::Unknown, "etcdserver: permission denied", "permission"),
            (
                Code::Unauthenticated,
                "etcdserver: invalid auth token",
                "authentication token",
            ),
            (
                Code::FailedPrecondition,
                "etcdserver: authentication is not enabled",
                "authentication disabled",
            ),
        ];
        for (code, message, expected) in cases {
            match map_error(status(code, message), Kind::Write, EP) {
                KvError::Other { message } => {
                    assert!(message.contains(expected), "{message}")
                }
                other => panic!("{code:?} {message}: expected Other, got {other:?}"),
            }
        }
    }

    #[test]
    fn size_errors_are_invalid_argument() {
        for (code, message) in [
            (Code::InvalidArgument, "etcdserver: request is too large"),
            (
                Code::ResourceExhausted,
                "grpc: received message larger than max (3145728 vs. 2097152)",
            ),
            (
                Code::InvalidArgument,
                "etcdserver: too many operations in txn request",
            ),
        ] {
            let err = map_error(status(code, message), Kind::Write, EP);
            assert!(
                matches!(err, KvError::InvalidArgument { .. }),
                "{message}: {err:?}"
            );
        }
    }

    #[test]
    fn nospace_is_other() {
        let err = map_error(
            status(
                Code::ResourceExhausted,
                "etcdserver: mvcc: database space exceeded",
            ),
            Kind::Write,
            EP,
        );
        assert!(matches!(err, KvError::Other { .. }), "{err:?}");
    }

    #[test]
    fn timeouts_depend_on_whether_the_write_was_sent() {
        let after = Duration::from_secs(1);
        assert!(timeout_error(Kind::Read, EP, after, true).is_retryable());
        assert!(timeout_error(Kind::Write, EP, after, false).is_retryable());
        assert!(matches!(
            timeout_error(Kind::Write, EP, after, true),
            KvError::Indeterminate { .. }
        ));
    }

    #[test]
    fn compaction_is_recognised() {
        assert!(is_compacted(&status(
            Code::OutOfRange,
            "etcdserver: mvcc: required revision has been compacted"
        )));
        assert!(!is_compacted(&status(Code::Unavailable, "no leader")));
    }
}
