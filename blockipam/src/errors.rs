//! How allocator, store and lock failures become CNI error codes (see `docs/cni.md` for the table).

use ipam_core::lockfile::LockError;
use ipam_core::{IpamError, KvError};

use crate::protocol::{codes, CniError};

/// The CNI error for a store failure; `opening` marks failures while opening the store, where an
/// invalid argument is a configuration problem rather than a bug.
pub fn from_kv(error: &KvError, opening: bool) -> CniError {
    let code = match error {
        KvError::Conflict { .. } | KvError::Unavailable { .. } | KvError::Indeterminate { .. } => {
            codes::TRY_AGAIN_LATER
        }
        KvError::Corrupt { .. } => codes::STORE_CORRUPT,
        KvError::InvalidArgument { .. } if opening => codes::INVALID_NETWORK_CONFIG,
        KvError::InvalidArgument { .. } => codes::INTERNAL,
        KvError::Other { .. } => codes::IO_FAILURE,
        _ => codes::INTERNAL,
    };
    let msg = if opening {
        format!("cannot open the IPAM store: {error}")
    } else {
        format!("IPAM store failure: {error}")
    };
    CniError::new(code, msg)
}

/// The CNI error for an allocator failure.
pub fn from_ipam(error: &IpamError) -> CniError {
    let code = match error {
        IpamError::Store(kv) => return from_kv(kv, false),
        IpamError::Exhausted { .. } => codes::POOL_EXHAUSTED,
        IpamError::BlockLimit { .. } => codes::BLOCK_LIMIT_REACHED,
        IpamError::AlreadyAssigned { .. } | IpamError::AddressCooling { .. } => {
            codes::ADDRESS_IN_USE
        }
        IpamError::NotInPool(_) => codes::ADDRESS_NOT_IN_POOL,
        IpamError::AffinityConflict { .. } | IpamError::BlockOwnedByOtherHost { .. } => {
            codes::AFFINITY_CONFLICT
        }
        IpamError::PoolNotFound(_)
        | IpamError::NamespacePoolUnusable { .. }
        | IpamError::PoolDisabled(_)
        | IpamError::PoolWrongFamily { .. }
        | IpamError::PoolUseNotAllowed { .. } => codes::POOL_UNUSABLE,
        IpamError::NoPoolSelectsNode { .. } => codes::NO_POOL_FOR_NODE,
        IpamError::PoolExists(_) | IpamError::PoolOverlap { .. } => codes::POOL_CONFLICT,
        // A newer release finalized the store's upgrade: what it writes cannot be read here, as
        // a value of a newer format cannot (the previous releases answer the same).
        IpamError::Corrupt { .. } | IpamError::FormatTooNew { .. } => codes::STORE_CORRUPT,
        IpamError::InvalidArgument(_) => codes::INVALID_NETWORK_CONFIG,
        IpamError::RetriesExhausted { .. } | IpamError::KeptConflicting { .. } => {
            codes::TRY_AGAIN_LATER
        }
        _ => codes::INTERNAL,
    };
    CniError::new(code, error.to_string())
}

/// The CNI error for a host lock that could not be taken.
pub fn from_lock(error: &LockError) -> CniError {
    let code = match error {
        LockError::TimedOut { .. } => codes::TRY_AGAIN_LATER,
        _ => codes::IO_FAILURE,
    };
    CniError::new(code, format!("host IPAM lock: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipam_core::Family;

    #[test]
    fn a_cooling_address_asked_for_is_in_use() {
        let error = IpamError::AddressCooling {
            ip: "10.0.0.5".parse().expect("ip"),
            released_at: 100,
            cools_at: 160,
        };
        assert_eq!(from_ipam(&error).code, codes::ADDRESS_IN_USE);
    }

    #[test]
    fn retryable_failures_are_try_again_later() {
        assert_eq!(
            from_kv(&KvError::unavailable("down"), true).code,
            codes::TRY_AGAIN_LATER
        );
        assert_eq!(
            from_ipam(&IpamError::RetriesExhausted { attempts: 100 }).code,
            codes::TRY_AGAIN_LATER
        );
        assert_eq!(
            from_ipam(&IpamError::KeptConflicting {
                attempts: 100,
                what: "blocks of host-a".into()
            })
            .code,
            codes::TRY_AGAIN_LATER
        );
        assert_eq!(
            from_ipam(&IpamError::Store(KvError::Indeterminate {
                message: "x".into()
            }))
            .code,
            codes::TRY_AGAIN_LATER
        );
    }

    #[test]
    fn allocator_outcomes_get_their_documented_plugin_codes() {
        let exhausted = IpamError::Exhausted {
            family: Family::V4,
            requested: 1,
            found: 0,
            pools: vec![],
        };
        assert_eq!(from_ipam(&exhausted).code, 100);
        assert_eq!(
            from_ipam(&IpamError::NotInPool("192.0.2.1".parse().expect("ip"))).code,
            103
        );
        assert_eq!(from_ipam(&IpamError::PoolNotFound("x".into())).code, 105);
        let finalized_by_a_newer_release = IpamError::FormatTooNew {
            writes: 9,
            newest: 5,
        };
        let error = from_ipam(&finalized_by_a_newer_release);
        assert_eq!(error.code, 108);
        assert!(error.msg.contains("install the release"), "{}", error.msg);
    }

    /// A store's failures by kind, and an invalid argument while opening (a setting the store
    /// refused) apart from one later (a bug).
    #[test]
    fn store_failures_get_their_documented_plugin_codes() {
        let corrupt = KvError::Corrupt {
            key: Some("ipam/v1/blocks/x".into()),
            message: "cannot decode".into(),
        };
        let invalid = KvError::InvalidArgument {
            message: "no such directory".into(),
        };
        let other = KvError::Other {
            message: "disk full".into(),
        };
        for opening in [true, false] {
            assert_eq!(from_kv(&corrupt, opening).code, codes::STORE_CORRUPT);
            assert_eq!(from_kv(&other, opening).code, codes::IO_FAILURE);
        }
        assert_eq!(from_kv(&invalid, true).code, codes::INVALID_NETWORK_CONFIG);
        assert_eq!(from_kv(&invalid, false).code, codes::INTERNAL);
        let opened = from_kv(&other, true);
        assert!(
            opened.msg.starts_with("cannot open the IPAM store"),
            "{}",
            opened.msg
        );
        assert_eq!(
            from_ipam(&IpamError::Store(corrupt)).code,
            codes::STORE_CORRUPT
        );
    }

    /// Every allocator outcome an ADD, DEL or CHECK may meet, with the code `docs/cni.md` gives it.
    #[test]
    fn every_allocator_refusal_gets_the_code_of_the_documented_table() {
        let ip: std::net::IpAddr = "10.0.0.5".parse().expect("ip");
        let block: ipnet::IpNet = "10.0.0.0/26".parse().expect("cidr");
        let unusable = || IpamError::PoolDisabled("p".into());
        for (error, code) in [
            (
                IpamError::BlockLimit {
                    host: "n1".into(),
                    family: Family::V4,
                    owned: 2,
                    limit: 2,
                },
                codes::BLOCK_LIMIT_REACHED,
            ),
            (
                IpamError::AlreadyAssigned {
                    ip,
                    handle: "h".into(),
                },
                codes::ADDRESS_IN_USE,
            ),
            (
                IpamError::AffinityConflict {
                    ip,
                    block,
                    owner: "n2".into(),
                },
                codes::AFFINITY_CONFLICT,
            ),
            (
                IpamError::BlockOwnedByOtherHost {
                    block,
                    owner: "n2".into(),
                },
                codes::AFFINITY_CONFLICT,
            ),
            (
                IpamError::NamespacePoolUnusable {
                    namespace: "ns".into(),
                    family: Family::V4,
                    reason: Box::new(unusable()),
                },
                codes::POOL_UNUSABLE,
            ),
            (unusable(), codes::POOL_UNUSABLE),
            (
                IpamError::PoolWrongFamily {
                    pool: "p".into(),
                    family: Family::V6,
                },
                codes::POOL_UNUSABLE,
            ),
            (
                IpamError::PoolUseNotAllowed {
                    pool: "p".into(),
                    use_: ipam_core::AllowedUse::Workload,
                    allowed: ipam_core::AllowedUses::default(),
                },
                codes::POOL_UNUSABLE,
            ),
            (
                IpamError::NoPoolSelectsNode {
                    host: "n3".into(),
                    family: Family::V4,
                    pools: vec!["p".into()],
                },
                codes::NO_POOL_FOR_NODE,
            ),
            (IpamError::PoolExists("p".into()), codes::POOL_CONFLICT),
            (
                IpamError::PoolOverlap {
                    cidr: block,
                    existing: "q".into(),
                    existing_cidr: "10.0.0.0/24".parse().expect("cidr"),
                },
                codes::POOL_CONFLICT,
            ),
            (
                IpamError::Corrupt {
                    key: "ipam/v1/pools/p".into(),
                    message: "cannot decode".into(),
                },
                codes::STORE_CORRUPT,
            ),
            (
                IpamError::InvalidArgument("no address to assign".into()),
                codes::INVALID_NETWORK_CONFIG,
            ),
            (IpamError::Internal("a bug".into()), codes::INTERNAL),
        ] {
            let cni = from_ipam(&error);
            assert_eq!(cni.code, code, "{error:?}");
            assert_eq!(cni.msg, error.to_string(), "{error:?}");
        }
    }

    #[test]
    fn a_host_lock_held_too_long_is_try_again_later_and_any_other_lock_failure_io() {
        let timed_out = LockError::TimedOut {
            path: "/var/run/blockipam.lock".into(),
            waited: std::time::Duration::from_secs(1),
        };
        let io = LockError::Io {
            path: "/var/run/blockipam.lock".into(),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        assert_eq!(from_lock(&timed_out).code, codes::TRY_AGAIN_LATER);
        assert_eq!(from_lock(&io).code, codes::IO_FAILURE);
        assert!(from_lock(&io).msg.starts_with("host IPAM lock: "));
    }
}
