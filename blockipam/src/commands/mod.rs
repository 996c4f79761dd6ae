//! What each CNI command does with the allocator, one module per command (ADD, DEL, CHECK, GC,
//! STATUS) and one for the result shaping (gateway, prefix length, routes) the main plugins need;
//! here, what they share: the allocations' attributes, the attachment and its handle.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipam_core::network_setup::{self, NetworkSetup};
use ipam_core::{AllocationInfo, Family, Pool};

use crate::args::CniArgs;
use crate::netconf::NetConf;
use crate::timestamp::now_rfc3339;

mod add;
mod check;
mod del;
mod gc;
mod result;
mod status;

pub use add::add;
pub use check::check;
pub use del::del;
pub use gc::gc;
pub use result::shape_result;
pub use status::status;

/// Attribute: the network an allocation was made on.
pub const ATTR_NETWORK: &str = ipam_core::allocator::ATTR_NETWORK;
/// Attribute: the container id.
pub const ATTR_CONTAINER_ID: &str = ipam_core::allocator::leaks::ATTR_CONTAINER_ID;
/// Attribute: the interface inside the container.
pub const ATTR_INTERFACE: &str = ipam_core::allocator::leaks::ATTR_INTERFACE;
/// Attribute: the Kubernetes namespace.
pub const ATTR_NAMESPACE: &str = ipam_core::allocator::leaks::ATTR_NAMESPACE;
/// Attribute: the Kubernetes pod.
pub const ATTR_POD: &str = ipam_core::allocator::leaks::ATTR_POD;
/// Attribute: when the allocation was made (RFC 3339 UTC).
pub const ATTR_TIMESTAMP: &str = ipam_core::allocator::leaks::ATTR_TIMESTAMP;
/// Attribute: what a reservation is for (`gateway`).
pub const ATTR_PURPOSE: &str = ipam_core::allocator::ATTR_PURPOSE;
/// Attribute the allocator records with the node.
pub const ATTR_NODE: &str = ipam_core::allocator::ATTR_NODE;
/// The node gateway reservations are made for (no real node is called that).
pub const GATEWAY_NODE: &str = ipam_core::dead_nodes::RESERVATION_NODE;
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
        allocation_attributes(&self.conf.name, self.container_id, self.ifname, self.args)
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

pub use ipam_core::allocator::leaks::handle_id;

/// The attributes the plugin records with each address it hands out on `network` to the
/// attachment of `container_id`'s interface `ifname`: those, the time, and the pod and its
/// namespace when `CNI_ARGS` names them (the allocator adds the node).
pub fn allocation_attributes(
    network: &str,
    container_id: &str,
    ifname: &str,
    args: &CniArgs,
) -> BTreeMap<String, String> {
    ipam_core::allocator::leaks::Attachment {
        network,
        container_id,
        interface: ifname,
        namespace: args.pod_namespace.as_deref(),
        pod: args.pod_name.as_deref(),
    }
    .attributes(&now_rfc3339())
}

/// The handle gateway reservations of a network are held by: `<network>:gateway` (a colon never
/// appears in a network name or container id, so no container's handle can collide with it).
pub fn gateway_handle(network: &str) -> String {
    format!("{network}:gateway")
}

/// What the netconf needs in place before an address is handed out, for auto-assign to check
/// in its own read: the netconf's pools, and its gateways' reservations.
pub fn network_setup(conf: &NetConf) -> NetworkSetup {
    NetworkSetup {
        network: conf.name.clone(),
        pools: conf.pools.clone(),
        gateways: conf.gateways.clone(),
        reservation_handle: gateway_handle(&conf.name),
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
