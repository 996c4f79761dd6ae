//! The CNI result of ADD: each address with the prefix it is reported with, the gateway and the
//! routes the main plugins need.

use std::net::IpAddr;

use ipam_core::{AssignedAddress, Family, Pool};
use ipnet::IpNet;

use crate::netconf::NetConf;
use crate::protocol::{IpamResult, ResultIp, ResultRoute};

/// The result for `addresses`: each with its block's prefix length (Calico), or its pool's when a
/// configured gateway lies in that pool (so the gateway is inside the returned prefix, as ptp
/// and bridge need); routes exactly as configured, else none. No route is ever needed for a
/// block: every address's block lies inside the prefix it is reported with (the block itself,
/// or the pool that holds it), so the block is on-link already, and a route for it via the
/// gateway would send same-subnet traffic through the host.
pub fn shape_result(conf: &NetConf, pools: &[Pool], addresses: &[AssignedAddress]) -> IpamResult {
    let mut sorted: Vec<&AssignedAddress> = addresses.iter().collect();
    sorted.sort_by_key(|a| (Family::of(a.ip), a.ip));
    let ips = sorted
        .into_iter()
        .map(|address| {
            let (address, gateway) = reported_prefix(conf, pools, address.ip, address.block);
            ResultIp { address, gateway }
        })
        .collect();
    let routes = conf
        .routes
        .iter()
        .flatten()
        .map(|r| ResultRoute {
            dst: r.dst,
            gw: r.gw,
        })
        .collect();
    IpamResult { ips, routes }
}

/// The prefix `ip` (from `block`) is reported with, and its gateway: the pool's prefix and the
/// first configured gateway inside that pool (other than `ip` itself), else the block's prefix
/// and no gateway.
pub(super) fn reported_prefix(
    conf: &NetConf,
    pools: &[Pool],
    ip: IpAddr,
    block: IpNet,
) -> (IpNet, Option<IpAddr>) {
    let pool = pools.iter().find(|p| p.cidr.contains(&ip));
    let gateway = pool.and_then(|p| {
        conf.gateways
            .iter()
            .find(|g| p.cidr.contains(*g) && **g != ip)
            .copied()
    });
    let prefix = match (pool, gateway) {
        (Some(p), Some(_)) => p.cidr.prefix_len(),
        _ => block.prefix_len(),
    };
    let net = IpNet::new(ip, prefix).unwrap_or(block);
    (net, gateway)
}
