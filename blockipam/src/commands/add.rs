//! ADD: the attachment's addresses, allocating only when it holds none (idempotent per attachment).

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipam_core::{
    AssignIpsRequest, AssignedAddress, AutoAssignRequest, Ipam, NamespaceLookup, Pool,
};
use ipnet::IpNet;

use super::result::{reported_prefix, shape_result};
use super::{attachment_allocations, network_setup, Attachment, ATTR_INTERFACE};
use crate::errors::from_ipam;
use crate::netconf::NetConf;
use crate::protocol::{codes, CniError, IpamResult};

/// ADD: the attachment's addresses, allocating only when it holds none.
///
/// # Errors
/// Allocator failures mapped as [`from_ipam`]; code 7 when the netconf asks for no address;
/// code 102 when a specific address is held by another attachment of the same container.
pub async fn add(ipam: &Ipam, call: &Attachment<'_>) -> Result<IpamResult, CniError> {
    let conf = call.conf;
    let requested = call.requested_ips();
    if requested.is_empty() && !conf.assign_ipv4 && !conf.assign_ipv6 {
        return Err(CniError::config(
            "nothing to assign: assign_ipv4 is \"false\", assign_ipv6 is not \"true\", and no specific address was asked for",
        ));
    }
    let handle = call.handle();
    if !requested.is_empty() {
        let pools = ipam
            .prepare_network(&network_setup(conf))
            .await
            .map_err(|e| from_ipam(&e))?;
        refuse_non_host_addresses(ipam, conf, &pools, &requested).await?;
        refuse_other_attachments_addresses(ipam, call, &requested).await?;
        let request = AssignIpsRequest {
            ips: requested,
            handle: handle.clone(),
            host: call.node.to_owned(),
            attributes: call.attributes(),
            purpose: Some(ipam_core::AllowedUse::Workload),
            ..Default::default()
        };
        let addresses = ipam.assign_ips(&request).await.map_err(|e| from_ipam(&e))?;
        return Ok(shape_result(conf, &pools, &addresses));
    }
    {
        let annotations = &conf.pod_annotations;
        let mut request = AutoAssignRequest {
            handle: handle.clone(),
            host: call.node.to_owned(),
            num_v4: u32::from(conf.assign_ipv4),
            num_v6: u32::from(conf.assign_ipv6),
            // Calico's precedence: the pod's annotation, then its namespace's pools (read by
            // auto-assign in its own batch), then the netconf's, then the pools selecting the node.
            v4_pools: annotations
                .ipv4_pools
                .clone()
                .unwrap_or_else(|| conf.ipv4_pools.clone()),
            v6_pools: annotations
                .ipv6_pools
                .clone()
                .unwrap_or_else(|| conf.ipv6_pools.clone()),
            namespace: call
                .args
                .pod_namespace
                .as_ref()
                .filter(|ns| ipam_core::namespaces::validate_namespace(ns).is_ok())
                .map(|ns| NamespaceLookup {
                    namespace: ns.clone(),
                    v4: annotations.ipv4_pools.is_none(),
                    v6: annotations.ipv6_pools.is_none(),
                }),
            attributes: call.attributes(),
            reuse_existing: true,
            skip_block_edges: false,
            purpose: ipam_core::AllowedUse::Workload,
            setup: Some(network_setup(conf)),
            pass_over: Vec::new(),
        };
        // Everything the network needs is checked inside auto-assign's one read (the steady
        // state); a network's first call is set up there too.
        let first = ipam
            .auto_assign(&request)
            .await
            .map_err(|e| from_ipam(&e))?;
        let pools = first.pools.clone();
        let mut held: Vec<AssignedAddress> = first.v4.into_iter().chain(first.v6).collect();
        if first.reused {
            let on_handle = ipam
                .allocations_by_handle(&handle)
                .await
                .map_err(|e| from_ipam(&e))?;
            let mine = attachment_allocations(&on_handle, call.ifname);
            if mine.is_empty() {
                // The container's other interfaces hold these: this interface needs its own.
                tracing::info!(%handle, ifname = call.ifname, "handle holds addresses of other interfaces; allocating for this one");
                request.reuse_existing = false;
                let more = ipam
                    .auto_assign(&request)
                    .await
                    .map_err(|e| from_ipam(&e))?;
                held = more.v4.into_iter().chain(more.v6).collect();
            } else {
                tracing::info!(%handle, ifname = call.ifname, "attachment already holds addresses; returning them");
                held = mine
                    .into_iter()
                    .map(|info| AssignedAddress {
                        ip: info.ip,
                        block: info.block,
                    })
                    .collect();
            }
        }
        Ok(shape_result(conf, &pools, &held))
    }
}

/// Code 7 for a specific address that is not a usable host address of the prefix it would be
/// reported with (see [`edge_kind`]). Addresses outside every enabled pool are left to the
/// allocator (code 103). The block is the one that holds the address (or would), whatever its
/// size: a pool's blocks may have mixed sizes after `pool set --block-size`.
async fn refuse_non_host_addresses(
    ipam: &Ipam,
    conf: &NetConf,
    pools: &[Pool],
    requested: &[IpAddr],
) -> Result<(), CniError> {
    let blocks = ipam
        .block_cidrs_holding(pools, requested)
        .await
        .map_err(|e| from_ipam(&e))?;
    for ip in requested {
        let Some(block) = blocks.get(ip).copied() else {
            continue;
        };
        let (reported, _) = reported_prefix(conf, pools, *ip, block);
        if let Some(kind) = edge_kind(reported) {
            return Err(CniError::with_details(
                codes::INVALID_NETWORK_CONFIG,
                format!(
                    "address {ip} is the {kind} address of {}, the prefix it would be reported with: not a usable host address",
                    reported.trunc()
                ),
                "ask for another address of the block, or configure a gateway in the pool (the pool's prefix is then reported)",
            ));
        }
    }
    Ok(())
}

/// What `net`'s address is when it is no usable host address of `net`: the network address of
/// an IPv4 prefix shorter than /31 or an IPv6 prefix shorter than /127 (IPv6: the subnet-router
/// anycast address), or the broadcast address of such an IPv4 prefix.
fn edge_kind(net: IpNet) -> Option<&'static str> {
    match net {
        IpNet::V4(v4) if v4.prefix_len() < 31 && v4.addr() == v4.network() => Some("network"),
        IpNet::V4(v4) if v4.prefix_len() < 31 && v4.addr() == v4.broadcast() => Some("broadcast"),
        IpNet::V6(v6) if v6.prefix_len() < 127 && v6.addr() == v6.network() => {
            Some("network (subnet-router anycast)")
        }
        _ => None,
    }
}

/// Code 102 when a specific address asked for is held by the container's handle but not by this
/// attachment (another interface's, or one that records no interface and cannot be proved to be
/// this one's): one address is never shared by two interfaces. An address this attachment holds
/// already is fine (a retried ADD). The host lock serialises the calls of one node, and a
/// container's attachments are all made on its node, so nothing changes the handle between this
/// read and the assignment.
async fn refuse_other_attachments_addresses(
    ipam: &Ipam,
    call: &Attachment<'_>,
    requested: &[IpAddr],
) -> Result<(), CniError> {
    let handle = call.handle();
    let on_handle = ipam
        .allocations_by_handle(&handle)
        .await
        .map_err(|e| from_ipam(&e))?;
    let mine: BTreeSet<IpAddr> = attachment_allocations(&on_handle, call.ifname)
        .iter()
        .map(|info| info.ip)
        .collect();
    let Some(other) = on_handle
        .iter()
        .find(|info| requested.contains(&info.ip) && !mine.contains(&info.ip))
    else {
        return Ok(());
    };
    let holder = match other.attributes.get(ATTR_INTERFACE) {
        Some(ifname) => format!("interface {ifname:?}"),
        None => "an allocation that records no interface".to_owned(),
    };
    Err(CniError::with_details(
        codes::ADDRESS_IN_USE,
        format!(
            "address {} is already assigned to {holder} of container {} (handle {handle:?}); interface {:?} cannot share it",
            other.ip, call.container_id, call.ifname
        ),
        "one address belongs to one attachment (container, interface)",
    ))
}

#[cfg(test)]
mod tests {
    use super::edge_kind;

    /// The edges of a prefix are refused as host addresses only where they are edges: never in
    /// an IPv4 /31 (both addresses are hosts, RFC 3021) or /32, nor in an IPv6 /127 or /128.
    #[test]
    fn only_the_edges_of_prefixes_that_have_them_are_refused() {
        for (net, kind) in [
            ("10.0.0.0/30", Some("network")),
            ("10.0.0.3/30", Some("broadcast")),
            ("10.0.0.1/30", None),
            ("10.0.0.2/30", None),
            ("10.0.0.0/31", None),
            ("10.0.0.1/31", None),
            ("10.0.0.7/32", None),
            ("fd00::/126", Some("network (subnet-router anycast)")),
            ("fd00::3/126", None),
            ("fd00::/127", None),
            ("fd00::1/127", None),
            ("fd00::/128", None),
        ] {
            assert_eq!(edge_kind(net.parse().expect("a prefix")), kind, "{net}");
        }
    }
}
