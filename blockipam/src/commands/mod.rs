//! What each CNI command does with the allocator, and the result shaping the main plugins need.
//!
//! What each CNI command does with the allocator: ADD (idempotent per attachment), DEL, CHECK, GC
//! and STATUS, plus the result shaping (gateway, prefix length, routes) the main plugins need.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipam_core::network_setup::{self, NetworkSetup};
use ipam_core::{
    AllocationInfo, AssignIpsRequest, AssignedAddress, AutoAssignRequest, BlockUsage, Family, Ipam,
    IpamError, NamespaceLookup, Pool, ReleaseRequest, Utilization,
};
use ipnet::IpNet;

use crate::args::CniArgs;
use crate::errors::from_ipam;
use crate::netconf::NetConf;
use crate::protocol::{codes, prev_result_addresses, CniError, IpamResult, ResultIp, ResultRoute};
use crate::timestamp::now_rfc3339;

/// Attribute: the network an allocation was made on.
pub const ATTR_NETWORK: &str = "network";
/// Attribute: the container id.
pub const ATTR_CONTAINER_ID: &str = "container_id";
/// Attribute: the interface inside the container.
pub const ATTR_INTERFACE: &str = "interface";
/// Attribute: the Kubernetes namespace.
pub const ATTR_NAMESPACE: &str = "namespace";
/// Attribute: the Kubernetes pod.
pub const ATTR_POD: &str = "pod";
/// Attribute: when the allocation was made (RFC 3339 UTC).
pub const ATTR_TIMESTAMP: &str = "timestamp";
/// Attribute: what a reservation is for (`gateway`).
pub const ATTR_PURPOSE: &str = "purpose";
/// Attribute the allocator records with the node.
pub const ATTR_NODE: &str = ipam_core::allocator::ATTR_NODE;
/// The node gateway reservations are made for (no real node is called that).
pub const GATEWAY_NODE: &str = "-";
/// Addresses released per transaction by GC.
const GC_BATCH: usize = 32;
/// The conventional first interface of a container (Kubernetes, Podman): the only one an
/// allocation that records no interface can be proved to belong to (see
/// [`attachment_allocations`]).
pub const PRIMARY_IFNAME: &str = "eth0";

/// One plugin invocation for one attachment (ADD, DEL, CHECK).
#[derive(Debug, Clone)]
pub struct Attachment<'a> {
    /// The network configuration.
    pub conf: &'a NetConf,
    /// `CNI_CONTAINERID`.
    pub container_id: &'a str,
    /// `CNI_IFNAME`.
    pub ifname: &'a str,
    /// `CNI_ARGS`.
    pub args: &'a CniArgs,
    /// The node allocating.
    pub node: &'a str,
}

impl Attachment<'_> {
    /// The handle id: `<network>.<container id>`, as Calico.
    pub fn handle(&self) -> String {
        handle_id(&self.conf.name, self.container_id)
    }

    fn attributes(&self) -> BTreeMap<String, String> {
        let mut attributes = BTreeMap::from([
            (ATTR_NETWORK.to_owned(), self.conf.name.clone()),
            (ATTR_CONTAINER_ID.to_owned(), self.container_id.to_owned()),
            (ATTR_INTERFACE.to_owned(), self.ifname.to_owned()),
            (ATTR_TIMESTAMP.to_owned(), now_rfc3339()),
        ]);
        if let Some(ns) = self.args.pod_namespace.as_ref().filter(|s| !s.is_empty()) {
            attributes.insert(ATTR_NAMESPACE.to_owned(), ns.clone());
        }
        if let Some(pod) = self.args.pod_name.as_ref().filter(|s| !s.is_empty()) {
            attributes.insert(ATTR_POD.to_owned(), pod.clone());
        }
        attributes
    }

    /// Specific addresses asked for, de-duplicated in order: `args.cni.ips` when that key is
    /// present (and then `CNI_ARGS` `IP` is ignored, as the CNI conventions require of a plugin
    /// that reads `args`), else `CNI_ARGS` `IP`; then `runtimeConfig.ips`.
    fn requested_ips(&self) -> Vec<IpAddr> {
        let from_args: &[IpAddr] = match &self.conf.args_ips {
            Some(args_ips) => {
                if !self.args.ips.is_empty() {
                    tracing::debug!(
                        ignored = ?self.args.ips,
                        "args.cni.ips is present: CNI_ARGS IP is ignored (CNI conventions)"
                    );
                }
                args_ips
            }
            None => &self.args.ips,
        };
        let mut seen = BTreeSet::new();
        from_args
            .iter()
            .chain(&self.conf.runtime_ips)
            .chain(self.conf.pod_annotations.ip_addrs.iter().flatten())
            .copied()
            .filter(|ip| seen.insert(*ip))
            .collect()
    }
}

/// The handle id of a container on a network.
pub fn handle_id(network: &str, container_id: &str) -> String {
    format!("{network}.{container_id}")
}

/// The handle gateway reservations of a network are held by: `<network>:gateway` (a colon never
/// appears in a network name or container id, so no container's handle can collide with it).
pub fn gateway_handle(network: &str) -> String {
    format!("{network}:gateway")
}

/// The store's pools, after creating the netconf's pools that do not exist yet: one read when
/// they all exist (a pool with the same CIDR and block size counts, whatever its name).
///
/// # Errors
/// Code 106 when a pool clashes with a different existing one; store failures.
pub async fn ensure_pools(ipam: &Ipam, conf: &NetConf) -> Result<Vec<Pool>, CniError> {
    let pools = ipam.list_pools().await.map_err(|e| from_ipam(&e))?;
    let mut created = false;
    for spec in &conf.pools {
        let present = pools.iter().any(|p| {
            p.cidr == spec.cidr
                && Some(p.block_size) == Ipam::pool_from_spec(spec).ok().map(|s| s.block_size)
        });
        if !present {
            let pool = ipam.ensure_pool(spec).await.map_err(|e| from_ipam(&e))?;
            tracing::info!(pool = %pool.name, cidr = %pool.cidr, "pool present");
            created = true;
        }
    }
    if created {
        return ipam.list_pools().await.map_err(|e| from_ipam(&e));
    }
    Ok(pools)
}

/// The addresses a network reserves ([`network_setup::reserved_addresses`]); a gateway in no
/// enabled pool is logged, as it is neither reserved nor reported.
pub fn reserved_addresses(conf: &NetConf, pools: &[Pool]) -> Vec<IpAddr> {
    for gateway in network_setup::gateways_outside_pools(pools, &conf.gateways) {
        tracing::warn!(%gateway, "the gateway lies in no enabled pool: it is neither reserved nor reported");
    }
    network_setup::reserved_addresses(pools, &conf.gateways)
}

/// What the netconf needs in place before an address is handed out, for auto-assign to check
/// in its own read: the netconf's pools, and its gateways' reservations.
pub fn network_setup(conf: &NetConf) -> NetworkSetup {
    NetworkSetup {
        pools: conf.pools.clone(),
        gateways: conf.gateways.clone(),
        reservation_handle: gateway_handle(&conf.name),
    }
}

/// The slow path of ADD, taken on a network's first call and whenever something it needs went
/// missing: creates the netconf's missing pools, reserves its addresses and confirms them (so
/// that the next calls see it all in place in auto-assign's one read). Returns the pools.
///
/// # Errors
/// As [`ensure_pools`]; reservation failures are only logged (they are tried again next time).
pub async fn prepare_network(ipam: &Ipam, conf: &NetConf) -> Result<Vec<Pool>, CniError> {
    let pools = ensure_pools(ipam, conf).await?;
    if let Err(e) = reserve_addresses(ipam, conf, &pools).await {
        tracing::warn!(network = %conf.name, code = e.code, "the network's reservations could not be made ({}); going on, they are tried again at the next ADD", e.msg);
    } else if !conf.gateways.is_empty() {
        if let Err(e) = ipam.confirm_reservations(&gateway_handle(&conf.name)).await {
            tracing::warn!(network = %conf.name, "the network's reservations could not be confirmed ({e}); the next ADD checks them again");
        }
    }
    Ok(pools)
}

/// Reserves [`reserved_addresses`] once per network (held by [`gateway_handle`] on node
/// [`GATEWAY_NODE`]); when they are all held already this is one read. A reservation belongs to
/// no node, so strict affinity does not stop it from landing in a block affine to a node. An
/// address already held by a container is left alone with a warning.
///
/// # Errors
/// Store and allocator failures; [`add`] only logs them (a reservation never makes ADD fail).
async fn reserve_addresses(ipam: &Ipam, conf: &NetConf, pools: &[Pool]) -> Result<(), CniError> {
    let wanted = reserved_addresses(conf, pools);
    if wanted.is_empty() {
        return Ok(());
    }
    let handle = gateway_handle(&conf.name);
    let held: BTreeSet<IpAddr> = ipam
        .ips_by_handle(&handle)
        .await
        .map_err(|e| from_ipam(&e))?
        .into_iter()
        .map(|a| a.ip)
        .collect();
    for ip in wanted.into_iter().filter(|ip| !held.contains(ip)) {
        let request = AssignIpsRequest {
            ips: vec![ip],
            handle: handle.clone(),
            host: GATEWAY_NODE.to_owned(),
            attributes: BTreeMap::from([
                (ATTR_NETWORK.to_owned(), conf.name.clone()),
                (ATTR_PURPOSE.to_owned(), "gateway".to_owned()),
            ]),
            ignore_strict_affinity: true,
            purpose: None,
        };
        match ipam.assign_ips(&request).await {
            Ok(_) => tracing::info!(%ip, %handle, "reserved"),
            Err(IpamError::AlreadyAssigned { ip, handle }) => {
                tracing::warn!(%ip, %handle, "an address the network reserves is held by a container; it is reserved once that container releases it");
            }
            Err(e) => return Err(from_ipam(&e)),
        }
    }
    Ok(())
}

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
        let pools = prepare_network(ipam, conf).await?;
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
        };
        // The steady state: everything the network needs is in place, checked inside
        // auto-assign's one read. Otherwise set it up and ask again.
        let first = match ipam.auto_assign(&request).await {
            Err(IpamError::SetupNeeded(reason)) => {
                tracing::info!(network = %conf.name, %reason, "setting the network up");
                let pools = prepare_network(ipam, conf).await?;
                request.setup = None;
                // The pools this request names (an annotation's may differ from the netconf's).
                request.skip_block_edges = network_setup::block_prefix_reportable(
                    &pools,
                    &[
                        (Family::V4, conf.assign_ipv4, request.v4_pools.as_slice()),
                        (Family::V6, conf.assign_ipv6, request.v6_pools.as_slice()),
                    ],
                    &conf.gateways,
                );
                ipam.auto_assign(&request).await
            }
            other => other,
        }
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

/// True when an automatically assigned address may be reported with its block's prefix: a
/// candidate pool of a family the netconf asks for holds no configured gateway. The allocator must
/// then never hand out a block's network or last address (`skip_block_edges`), which would not be
/// a usable host address of the reported prefix. (Where a gateway lies in the pool, the pool's
/// prefix is reported and its network and broadcast addresses are reserved instead.)
pub fn may_report_block_prefix(conf: &NetConf, pools: &[Pool]) -> bool {
    network_setup::block_prefix_reportable(
        pools,
        &[
            (Family::V4, conf.assign_ipv4, conf.ipv4_pools.as_slice()),
            (Family::V6, conf.assign_ipv6, conf.ipv6_pools.as_slice()),
        ],
        &conf.gateways,
    )
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

/// The allocations of an attachment's handle that provably belong to the attachment whose
/// interface is `ifname`:
/// - an allocation that records an interface is the attachment's when it records `ifname`;
/// - one that records no interface (made through the allocator's API or by another tool) could
///   be any interface's: it is the attachment's only when `ifname` is [`PRIMARY_IFNAME`] and no
///   allocation of the handle records an interface at all (a container that never had a second
///   blockipam interface on this network).
///
/// Everything else is never returned, released or checked as this attachment's.
pub fn attachment_allocations<'a>(
    on_handle: &'a [AllocationInfo],
    ifname: &str,
) -> Vec<&'a AllocationInfo> {
    let any_labelled = on_handle
        .iter()
        .any(|info| info.attributes.contains_key(ATTR_INTERFACE));
    on_handle
        .iter()
        .filter(|info| match info.attributes.get(ATTR_INTERFACE) {
            Some(recorded) => recorded == ifname,
            None => !any_labelled && ifname == PRIMARY_IFNAME,
        })
        .collect()
}

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
fn reported_prefix(
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

/// DEL: releases this attachment's addresses ([`attachment_allocations`]: the whole handle when
/// they are all it holds); also Calico's legacy `<namespace>.<pod>` handle when the main one is
/// unknown. Nothing to release is success.
///
/// # Errors
/// Store failures.
pub async fn del(ipam: &Ipam, call: &Attachment<'_>) -> Result<Vec<IpAddr>, CniError> {
    let handle = call.handle();
    // One batched read (the handle and this node's blocks) and one transaction.
    let outcome = ipam
        .release_chosen(&handle, call.node, |held| {
            attachment_allocations(held, call.ifname)
                .into_iter()
                .map(|info| info.ip)
                .collect()
        })
        .await
        .map_err(|e| from_ipam(&e))?;
    let held = outcome.held;
    if held.is_empty() {
        if let Some(legacy) = call.args.legacy_handle() {
            let released = ipam
                .release_handle(&legacy)
                .await
                .map_err(|e| from_ipam(&e))?;
            if !released.is_empty() {
                tracing::info!(handle = %legacy, ?released, "released the legacy handle");
            }
            return Ok(released);
        }
        tracing::info!(%handle, "nothing to release");
        return Ok(Vec::new());
    }
    let unproven: Vec<IpAddr> = held
        .iter()
        .filter(|info| !info.attributes.contains_key(ATTR_INTERFACE))
        .filter(|info| !outcome.released.contains(&info.ip))
        .map(|info| info.ip)
        .collect();
    if !unproven.is_empty() {
        tracing::info!(%handle, ifname = call.ifname, ?unproven, "left allocations that record no interface: they are not provably this attachment's (GC releases them once the container has no valid attachment)");
    }
    tracing::info!(%handle, ifname = call.ifname, released = ?outcome.released, "released");
    Ok(outcome.released)
}

/// CHECK: what this attachment holds ([`attachment_allocations`] of its handle, or Calico's
/// legacy handle when the main one holds nothing) must match `prevResult` exactly, as far as
/// blockipam is concerned: every `prevResult` address inside one of the store's pools must be
/// held by the attachment, and every address the attachment holds must be in `prevResult`.
/// Addresses outside every pool are not blockipam's and are ignored. An attachment that holds
/// nothing fails (also without `prevResult`).
///
/// # Errors
/// Code 107 naming the first address that does not match and, for a `prevResult` address, who
/// holds it instead; code 6 for a `prevResult` address that does not parse; store failures.
pub async fn check(ipam: &Ipam, call: &Attachment<'_>) -> Result<(), CniError> {
    let handle = call.handle();
    let on_handle = ipam
        .allocations_by_handle(&handle)
        .await
        .map_err(|e| from_ipam(&e))?;
    let mut holders = vec![handle.clone()];
    let mine: Vec<AllocationInfo> = if on_handle.is_empty() {
        match call.args.legacy_handle() {
            Some(legacy) => {
                let on_legacy = ipam
                    .allocations_by_handle(&legacy)
                    .await
                    .map_err(|e| from_ipam(&e))?;
                holders.push(legacy);
                on_legacy
            }
            None => Vec::new(),
        }
    } else {
        attachment_allocations(&on_handle, call.ifname)
            .into_iter()
            .cloned()
            .collect()
    };
    let failed = |msg: String| {
        CniError::with_details(
            codes::CHECK_FAILED,
            msg,
            format!("expected handle {:?}", holders.join(" or ")),
        )
    };
    let attachment = format!("attachment {} / {}", call.container_id, call.ifname);
    let held: BTreeSet<IpAddr> = mine.iter().map(|info| info.ip).collect();
    if let Some(prev) = &call.conf.prev_result {
        let expected = prev_result_addresses(prev)?;
        let pools = ipam.list_pools().await.map_err(|e| from_ipam(&e))?;
        for ip in &expected {
            if held.contains(ip) || !pools.iter().any(|p| p.cidr.contains(ip)) {
                continue;
            }
            let info = ipam.get_assignment(*ip).await.map_err(|e| from_ipam(&e))?;
            let problem = match &info {
                None => "is not allocated".to_owned(),
                Some(info) if !holders.contains(&info.handle) => {
                    format!("is held by handle {:?}", info.handle)
                }
                Some(info) => match info.attributes.get(ATTR_INTERFACE) {
                    Some(ifname) => format!("is held by this container for interface {ifname:?}"),
                    None => "is held by this container without a recorded interface, so not provably by this attachment".to_owned(),
                },
            };
            return Err(failed(format!("address {ip} of {attachment} {problem}")));
        }
        if let Some(missing) = held.iter().find(|ip| !expected.contains(ip)) {
            return Err(failed(format!(
                "address {missing} is held by {attachment} but is not in prevResult"
            )));
        }
    }
    if held.is_empty() {
        return Err(failed(format!(
            "{attachment} holds no address on network {:?}",
            call.conf.name
        )));
    }
    Ok(())
}

/// GC: releases every allocation of this network made on this node whose (container id,
/// interface) is not in the valid attachments. Other nodes' allocations are never touched.
///
/// # Errors
/// Code 7 without `cni.dev/valid-attachments`; store failures.
pub async fn gc(ipam: &Ipam, conf: &NetConf, node: &str) -> Result<Vec<IpAddr>, CniError> {
    let Some(valid) = &conf.valid_attachments else {
        return Err(CniError::config(
            "GC needs the list of valid attachments (cni.dev/valid-attachments)",
        ));
    };
    let valid_pairs: BTreeSet<(&str, &str)> = valid
        .iter()
        .map(|a| (a.container_id.as_str(), a.ifname.as_str()))
        .collect();
    let valid_containers: BTreeSet<&str> = valid.iter().map(|a| a.container_id.as_str()).collect();
    let all = ipam.list_allocations().await.map_err(|e| from_ipam(&e))?;
    let stale: Vec<ReleaseRequest> = all
        .iter()
        .filter(|a| a.attributes.get(ATTR_NODE).map(String::as_str) == Some(node))
        .filter_map(|a| {
            let container = a.attributes.get(ATTR_CONTAINER_ID)?;
            let on_network = match a.attributes.get(ATTR_NETWORK) {
                Some(network) => *network == conf.name,
                None => a.handle == handle_id(&conf.name, container),
            };
            if !on_network {
                return None;
            }
            let keep = match a.attributes.get(ATTR_INTERFACE) {
                Some(ifname) => valid_pairs.contains(&(container.as_str(), ifname.as_str())),
                None => valid_containers.contains(container.as_str()),
            };
            (!keep).then_some(ReleaseRequest {
                ip: a.ip,
                sequence: Some(a.sequence),
            })
        })
        .collect();
    let mut released = Vec::new();
    for batch in stale.chunks(GC_BATCH) {
        let outcome = ipam.release_ips(batch).await.map_err(|e| from_ipam(&e))?;
        released.extend(outcome.released);
    }
    tracing::info!(
        network = %conf.name,
        %node,
        examined = all.len(),
        released = released.len(),
        "garbage collection done"
    );
    Ok(released)
}

/// STATUS: the store answers and this node can still get an address of every family the
/// netconf asks for.
///
/// # Errors
/// Code 50 saying which of the two fails.
pub async fn status(ipam: &Ipam, conf: &NetConf, node: &str) -> Result<(), CniError> {
    let unreachable = |e: IpamError| {
        CniError::new(
            codes::PLUGIN_NOT_AVAILABLE,
            format!("the IPAM store is not usable: {e}"),
        )
    };
    let config = ipam.get_config().await.map_err(unreachable)?;
    let usage = ipam.utilization().await.map_err(unreachable)?;
    let node_key = ipam_core::nodes::node_key(node);
    let labels = ipam_core::nodes::decode_node_labels(
        &node_key,
        ipam.store()
            .get(&node_key)
            .await
            .map_err(|e| unreachable(e.into()))?
            .as_ref(),
    )
    .map_err(unreachable)?;
    let pools: Vec<Pool> = usage.pools.iter().map(|p| p.pool.clone()).collect();
    let skip_edges = may_report_block_prefix(conf, &pools);
    // Which block edges are taken matters only for a block with one or two free addresses.
    let ambiguous = usage
        .pools
        .iter()
        .flat_map(|p| p.blocks.iter())
        .any(|b| (1..=2).contains(&b.free) && !block_edges(b.cidr).is_empty());
    let allocated: BTreeSet<IpAddr> = if skip_edges && ambiguous {
        ipam.list_allocations()
            .await
            .map_err(unreachable)?
            .into_iter()
            .map(|a| a.ip)
            .collect()
    } else {
        BTreeSet::new()
    };
    let usable = Usable {
        skip_edges,
        allocated: &allocated,
    };
    for (family, wanted, requested) in [
        (Family::V4, conf.assign_ipv4, &conf.ipv4_pools),
        (Family::V6, conf.assign_ipv6, &conf.ipv6_pools),
    ] {
        if !wanted {
            continue;
        }
        let scope = NodeScope {
            node,
            labels: &labels,
        };
        if let Err(why) =
            family_available(conf, &usage, &config, &scope, family, requested, &usable)
        {
            return Err(CniError::new(
                codes::PLUGIN_NOT_AVAILABLE,
                format!("node {node:?} cannot get an {family} address: {why}"),
            ));
        }
    }
    Ok(())
}

/// The node STATUS answers for, and its labels (what pools' node selectors match).
struct NodeScope<'a> {
    node: &'a str,
    labels: &'a BTreeMap<String, String>,
}

/// Which free addresses of a block an ADD can be given.
struct Usable<'a> {
    /// ADD skips block edges ([`may_report_block_prefix`]).
    skip_edges: bool,
    /// Every allocated address (read only when it matters).
    allocated: &'a BTreeSet<IpAddr>,
}

impl Usable<'_> {
    /// True when an ADD can be given one of the block's free addresses.
    fn has_room(&self, block: &BlockUsage) -> bool {
        if !self.skip_edges {
            return block.free > 0;
        }
        let free_edges = block_edges(block.cidr)
            .iter()
            .filter(|ip| !self.allocated.contains(ip))
            .count() as u64;
        block.free > free_edges
    }
}

/// A block's network and last address when it has them as edges (IPv4 blocks larger than /31,
/// IPv6 blocks larger than /127): what `skip_block_edges` never hands out.
fn block_edges(block: IpNet) -> Vec<IpAddr> {
    if block.max_prefix_len() - block.prefix_len() >= 2 {
        vec![block.network(), block.broadcast()]
    } else {
        Vec::new()
    }
}

fn family_available(
    conf: &NetConf,
    usage: &Utilization,
    config: &ipam_core::IpamConfig,
    scope: &NodeScope<'_>,
    family: Family,
    requested: &[String],
    usable: &Usable<'_>,
) -> Result<(), String> {
    let node = scope.node;
    // Netconf pools not created yet will be on the next ADD: they count as available.
    let pending: Vec<&ipam_core::PoolSpec> = conf
        .pools
        .iter()
        .filter(|s| Family::of_net(&s.cidr) == family)
        .filter(|s| !usage.pools.iter().any(|p| p.pool.cidr == s.cidr))
        .collect();
    let matches_pending = |wanted: &str| {
        pending.iter().any(|s| {
            s.name.as_deref() == Some(wanted) || wanted.parse::<IpNet>().ok() == Some(s.cidr)
        })
    };
    let candidates: Vec<&ipam_core::PoolUsage> = if requested.is_empty() {
        if !pending.is_empty() {
            return Ok(());
        }
        let enabled: Vec<&ipam_core::PoolUsage> = usage
            .pools
            .iter()
            .filter(|p| p.pool.family() == family && !p.pool.disabled)
            .collect();
        // As auto-assign: automatic pools allowing workload addresses that select the node.
        let selecting: Vec<&ipam_core::PoolUsage> = enabled
            .iter()
            .copied()
            .filter(|p| {
                p.pool.assignment_mode == ipam_core::AssignmentMode::Automatic
                    && p.pool.allowed_uses.allows(ipam_core::AllowedUse::Workload)
                    && p.pool.node_selector.matches(scope.labels)
            })
            .collect();
        if selecting.is_empty() && !enabled.is_empty() {
            return Err(format!(
                "no IP pool selects node {node:?} for automatic assignment (enabled pools: {}; \
                 check their node selectors, assignment modes and allowed uses, or the node's \
                 labels)",
                enabled
                    .iter()
                    .map(|p| p.pool.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        selecting
    } else {
        let mut chosen = Vec::new();
        for wanted in requested {
            if matches_pending(wanted) {
                return Ok(());
            }
            let found = usage.pools.iter().find(|p| {
                p.pool.name == *wanted || wanted.parse::<IpNet>().ok() == Some(p.pool.cidr)
            });
            match found {
                None => return Err(format!("pool {wanted:?} does not exist")),
                Some(p) if p.pool.disabled => return Err(format!("pool {wanted:?} is disabled")),
                Some(p) if p.pool.family() != family => {
                    return Err(format!("pool {wanted:?} is not an {family} pool"))
                }
                Some(p) => chosen.push(p),
            }
        }
        chosen
    };
    if candidates.is_empty() {
        return Err("there is no enabled pool".into());
    }
    let blocks = || candidates.iter().flat_map(|p| p.blocks.iter());
    if blocks().any(|b| b.host.as_deref() == Some(node) && usable.has_room(b)) {
        return Ok(());
    }
    if config.auto_allocate_blocks {
        let owned = usage
            .pools
            .iter()
            .filter(|p| p.pool.family() == family)
            .flat_map(|p| p.blocks.iter())
            .filter(|b| b.host.as_deref() == Some(node))
            .count();
        let under_limit =
            config.max_blocks_per_host == 0 || owned < config.max_blocks_per_host as usize;
        let room = candidates
            .iter()
            .any(|p| (p.blocks.len() as u128) < p.pool.block_count());
        if !under_limit {
            // The allocator refuses with a block-limit error before it would borrow.
            return Err(format!(
                "its {owned} blocks are full and the per-node block limit is {}",
                config.max_blocks_per_host
            ));
        }
        if room {
            return Ok(());
        }
    }
    if !config.strict_affinity && blocks().any(|b| usable.has_room(b)) {
        return Ok(());
    }
    let names: Vec<&str> = candidates.iter().map(|p| p.pool.name.as_str()).collect();
    Err(format!("no free address in pools {names:?}"))
}
