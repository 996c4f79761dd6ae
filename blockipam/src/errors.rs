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
}
