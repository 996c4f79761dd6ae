//! What each CNI command does with the allocator, and the result shaping the main plugins need.
//!
//! What each CNI command does with the allocator: ADD (idempotent per attachment), DEL, CHECK, GC
//! and STATUS, plus the result shaping (gateway, prefix length, routes) the main plugins need.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipam_core::{
    AllocationInfo, AssignIpsRequest, AssignedAddress, AutoAssignRequest, Family, Ipam, IpamError,
    Pool, ReleaseRequest, Utilization,
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

    /// Specific addresses asked for (`IP=`, `args.cni.ips`, `runtimeConfig.ips`), de-duplicated in
    /// order.
    fn requested_ips(&self) -> Vec<IpAddr> {
        let mut seen = BTreeSet::new();
        self.args
            .ips
            .iter()
            .chain(&self.conf.requested_ips)
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

/// The addresses a network reserves: each configured gateway that lies in an enabled pool and,
/// because the result then reports that pool's prefix, the pool's network address and (IPv4)
/// broadcast address, so no container is given an address that is not a host address of the
/// reported subnet.
pub fn reserved_addresses(conf: &NetConf, pools: &[Pool]) -> Vec<IpAddr> {
    let mut reserved = Vec::new();
    for gateway in &conf.gateways {
        let Some(pool) = pools
            .iter()
            .find(|p| !p.disabled && p.cidr.contains(gateway))
        else {
            tracing::warn!(%gateway, "the gateway lies in no enabled pool: it is neither reserved nor reported");
            continue;
        };
        reserved.push(*gateway);
        reserved.push(pool.cidr.network());
        if let IpNet::V4(net) = pool.cidr {
            if net.prefix_len() < 31 {
                reserved.push(IpAddr::V4(net.broadcast()));
            }
        }
    }
    let mut seen = BTreeSet::new();
    reserved.retain(|ip| seen.insert(*ip));
    reserved
}

/// Reserves [`reserved_addresses`] once per network (held by [`gateway_handle`] on node
/// [`GATEWAY_NODE`]); when they are all held already this is one read. An address already held
/// by a container is left alone with a warning.
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
            ..Default::default()
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
/// Allocator failures mapped as [`from_ipam`]; code 7 when the netconf asks for no address.
pub async fn add(ipam: &Ipam, call: &Attachment<'_>) -> Result<IpamResult, CniError> {
    let conf = call.conf;
    let requested = call.requested_ips();
    if requested.is_empty() && !conf.assign_ipv4 && !conf.assign_ipv6 {
        return Err(CniError::config(
            "nothing to assign: assign_ipv4 is \"false\", assign_ipv6 is not \"true\", and no specific address was asked for",
        ));
    }
    let pools = ensure_pools(ipam, conf).await?;
    reserve_addresses(ipam, conf, &pools).await?;
    let handle = call.handle();
    let addresses = if !requested.is_empty() {
        let request = AssignIpsRequest {
            ips: requested,
            handle: handle.clone(),
            host: call.node.to_owned(),
            attributes: call.attributes(),
            ..Default::default()
        };
        ipam.assign_ips(&request).await.map_err(|e| from_ipam(&e))?
    } else {
        let mut request = AutoAssignRequest {
            handle: handle.clone(),
            host: call.node.to_owned(),
            num_v4: u32::from(conf.assign_ipv4),
            num_v6: u32::from(conf.assign_ipv6),
            v4_pools: conf.ipv4_pools.clone(),
            v6_pools: conf.ipv6_pools.clone(),
            attributes: call.attributes(),
            reuse_existing: true,
            ..Default::default()
        };
        let first = ipam
            .auto_assign(&request)
            .await
            .map_err(|e| from_ipam(&e))?;
        let mut held: Vec<AssignedAddress> = first.v4.into_iter().chain(first.v6).collect();
        if first.reused {
            let mine = held_by_interface(ipam, &handle, call.ifname, false).await?;
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
        held
    };
    Ok(shape_result(conf, &pools, &addresses))
}

/// The allocations of `handle` recorded for `ifname`; with `accept_unlabelled`, also those with no
/// interface recorded (older or foreign allocations).
async fn held_by_interface(
    ipam: &Ipam,
    handle: &str,
    ifname: &str,
    accept_unlabelled: bool,
) -> Result<Vec<AllocationInfo>, CniError> {
    Ok(ipam
        .allocations_by_handle(handle)
        .await
        .map_err(|e| from_ipam(&e))?
        .into_iter()
        .filter(|info| interface_matches(info, ifname, accept_unlabelled))
        .collect())
}

fn interface_matches(info: &AllocationInfo, ifname: &str, accept_unlabelled: bool) -> bool {
    match info.attributes.get(ATTR_INTERFACE) {
        Some(recorded) => recorded == ifname,
        None => accept_unlabelled,
    }
}

/// The result for `addresses`: each with its block's prefix length (Calico), or its pool's when a
/// configured gateway lies in that pool (so the gateway is inside the returned prefix, as ptp
/// and bridge need); routes as configured, else one per block (via the gateway, if any) that is
/// not already the address's own on-link prefix.
pub fn shape_result(conf: &NetConf, pools: &[Pool], addresses: &[AssignedAddress]) -> IpamResult {
    let mut sorted: Vec<&AssignedAddress> = addresses.iter().collect();
    sorted.sort_by_key(|a| (Family::of(a.ip), a.ip));
    let mut result = IpamResult::default();
    let mut own_networks = BTreeSet::new();
    let mut block_gateways: BTreeMap<IpNet, Option<IpAddr>> = BTreeMap::new();
    for address in &sorted {
        let pool = pools.iter().find(|p| p.cidr.contains(&address.ip));
        let gateway = pool.and_then(|p| {
            conf.gateways
                .iter()
                .find(|g| p.cidr.contains(*g) && **g != address.ip)
                .copied()
        });
        let prefix = match (pool, gateway) {
            (Some(p), Some(_)) => p.cidr.prefix_len(),
            _ => address.block.prefix_len(),
        };
        let net = IpNet::new(address.ip, prefix).unwrap_or_else(|_| address.with_block_prefix());
        own_networks.insert(net.trunc());
        let entry = block_gateways.entry(address.block).or_insert(None);
        if entry.is_none() {
            *entry = gateway;
        }
        result.ips.push(ResultIp {
            address: net,
            gateway,
        });
    }
    result.routes = match &conf.routes {
        Some(routes) => routes
            .iter()
            .map(|r| ResultRoute {
                dst: r.dst,
                gw: r.gw,
            })
            .collect(),
        // The gateway is explicit (not left for the main plugin to fill in) so that the main
        // plugins' CHECK, which looks routes up by destination and next hop, finds them.
        None => block_gateways
            .into_iter()
            .filter(|(block, _)| !own_networks.contains(block))
            .map(|(dst, gw)| ResultRoute { dst, gw })
            .collect(),
    };
    result
}

/// DEL: releases this attachment's addresses (the whole handle when no other interface of the
/// container holds any); also Calico's legacy `<namespace>.<pod>` handle when the main one is
/// unknown. Nothing to release is success.
///
/// # Errors
/// Store failures.
pub async fn del(ipam: &Ipam, call: &Attachment<'_>) -> Result<Vec<IpAddr>, CniError> {
    let handle = call.handle();
    let held = ipam
        .allocations_by_handle(&handle)
        .await
        .map_err(|e| from_ipam(&e))?;
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
    let mine: Vec<&AllocationInfo> = held
        .iter()
        .filter(|info| interface_matches(info, call.ifname, true))
        .collect();
    let released = if mine.len() == held.len() {
        ipam.release_handle(&handle)
            .await
            .map_err(|e| from_ipam(&e))?
    } else if mine.is_empty() {
        Vec::new()
    } else {
        let requests: Vec<ReleaseRequest> = mine
            .iter()
            .map(|info| ReleaseRequest {
                ip: info.ip,
                sequence: Some(info.sequence),
            })
            .collect();
        ipam.release_ips(&requests)
            .await
            .map_err(|e| from_ipam(&e))?
            .released
    };
    tracing::info!(%handle, ifname = call.ifname, ?released, "released");
    Ok(released)
}

/// CHECK: every address of `prevResult` must still be held by this attachment (without a
/// `prevResult`, the attachment must hold at least one address).
///
/// # Errors
/// Code 107 naming the first address that is not held, and by whom it is; store failures.
pub async fn check(ipam: &Ipam, call: &Attachment<'_>) -> Result<(), CniError> {
    let handle = call.handle();
    let legacy = call.args.legacy_handle();
    let Some(prev) = &call.conf.prev_result else {
        if held_by_interface(ipam, &handle, call.ifname, true)
            .await?
            .is_empty()
        {
            return Err(CniError::new(
                codes::CHECK_FAILED,
                format!(
                    "attachment {} / {} holds no address on network {:?}",
                    call.container_id, call.ifname, call.conf.name
                ),
            ));
        }
        return Ok(());
    };
    let expected = prev_result_addresses(prev)?;
    for ip in expected {
        let info = ipam.get_assignment(ip).await.map_err(|e| from_ipam(&e))?;
        let problem = match &info {
            None => Some("is not allocated".to_owned()),
            Some(info) if info.handle != handle && Some(&info.handle) != legacy.as_ref() => {
                Some(format!("is held by handle {:?}", info.handle))
            }
            Some(info) if !interface_matches(info, call.ifname, true) => Some(format!(
                "is held by this container for interface {:?}",
                info.attributes
                    .get(ATTR_INTERFACE)
                    .cloned()
                    .unwrap_or_default()
            )),
            Some(_) => None,
        };
        if let Some(problem) = problem {
            return Err(CniError::with_details(
                codes::CHECK_FAILED,
                format!(
                    "address {ip} of attachment {} / {} {problem}",
                    call.container_id, call.ifname
                ),
                format!("expected handle {handle:?}"),
            ));
        }
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
    for (family, wanted, requested) in [
        (Family::V4, conf.assign_ipv4, &conf.ipv4_pools),
        (Family::V6, conf.assign_ipv6, &conf.ipv6_pools),
    ] {
        if !wanted {
            continue;
        }
        if let Err(why) = family_available(conf, &usage, &config, node, family, requested) {
            return Err(CniError::new(
                codes::PLUGIN_NOT_AVAILABLE,
                format!("node {node:?} cannot get an {family} address: {why}"),
            ));
        }
    }
    Ok(())
}

fn family_available(
    conf: &NetConf,
    usage: &Utilization,
    config: &ipam_core::IpamConfig,
    node: &str,
    family: Family,
    requested: &[String],
) -> Result<(), String> {
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
        usage
            .pools
            .iter()
            .filter(|p| p.pool.family() == family && !p.pool.disabled)
            .collect()
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
    if blocks().any(|b| b.host.as_deref() == Some(node) && b.free > 0) {
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
    if !config.strict_affinity && blocks().any(|b| b.free > 0) {
        return Ok(());
    }
    let names: Vec<&str> = candidates.iter().map(|p| p.pool.name.as_str()).collect();
    Err(format!("no free address in pools {names:?}"))
}
