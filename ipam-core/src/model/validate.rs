//! Validation of the names that become key segments (hosts, handles and pools), and of the
//! ranges a new pool may take.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use crate::model::error::IpamError;

use crate::model::keys;

/// Rejects host names that cannot be a key segment.
pub fn validate_host(host: &str) -> Result<(), IpamError> {
    if host.is_empty() || host.len() > 253 {
        return Err(IpamError::InvalidArgument(format!(
            "host name {host:?} must be 1 to 253 characters"
        )));
    }
    if host.contains('/') || host.chars().any(|c| c.is_control()) {
        return Err(IpamError::InvalidArgument(format!(
            "host name {host:?} may not contain '/' or control characters"
        )));
    }
    Ok(())
}

/// Rejects handle ids that cannot be stored faithfully.
pub fn validate_handle(handle: &str) -> Result<(), IpamError> {
    if handle.is_empty() || handle.len() > 512 || handle.chars().any(|c| c.is_control()) {
        return Err(IpamError::InvalidArgument(format!(
            "handle id {handle:?} must be 1 to 512 printable characters"
        )));
    }
    Ok(())
}

/// Longest name of a pool or a reservation (a Kubernetes object name).
pub const MAX_OBJECT_NAME: usize = 253;

/// Rejects pool names outside `[A-Za-z0-9._:-]{1,253}`.
pub fn validate_pool_name(name: &str) -> Result<(), IpamError> {
    validate_object_name("pool", name)
}

/// Rejects a name of a stored object (`what`: "pool", "reservation") outside
/// `[A-Za-z0-9._:-]{1,253}`: the names key paths may carry.
pub(crate) fn validate_object_name(what: &str, name: &str) -> Result<(), IpamError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_OBJECT_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'));
    if ok {
        Ok(())
    } else {
        Err(IpamError::InvalidArgument(format!(
            "{what} name {name:?} must be 1 to {MAX_OBJECT_NAME} of letters, digits, '.', '_', '-', ':'"
        )))
    }
}

/// The IPv4 link-local range, 169.254.0.0/16.
pub const IPV4_LINK_LOCAL: IpNet = IpNet::new_assert(IpAddr::V4(Ipv4Addr::new(169, 254, 0, 0)), 16);

/// The IPv6 link-local range, fe80::/10.
pub const IPV6_LINK_LOCAL: IpNet =
    IpNet::new_assert(IpAddr::V6(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0)), 10);

/// Rejects a new pool whose range overlaps its family's link-local range (169.254.0.0/16,
/// fe80::/10), as Calico's pool validation does: a pod's default route goes through the
/// link-local gateway 169.254.1.1, and 169.254.169.254 is the cloud's metadata service, so no pod
/// may be given such an address. Pools already stored are left as they are.
pub fn validate_new_pool_range(cidr: &IpNet) -> Result<(), IpamError> {
    let (family, link_local) = match cidr {
        IpNet::V4(_) => ("IPv4", IPV4_LINK_LOCAL),
        IpNet::V6(_) => ("IPv6", IPV6_LINK_LOCAL),
    };
    if link_local.contains(&cidr.network()) || cidr.contains(&link_local.network()) {
        return Err(IpamError::InvalidArgument(format!(
            "pool {cidr} overlaps the {family} link-local range {link_local}, whose addresses no \
             pod may be given"
        )));
    }
    Ok(())
}

/// The name a pool gets when none is given: its CIDR with `/` replaced by `-` (`10.0.0.0-16`).
pub fn default_pool_name(cidr: &IpNet) -> String {
    keys::cidr_segment(cidr)
}
