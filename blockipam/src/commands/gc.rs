//! GC: releases this node's allocations on the network that no valid attachment holds.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipam_core::{Ipam, ReleaseRequest};

use super::{handle_id, ATTR_CONTAINER_ID, ATTR_INTERFACE, ATTR_NETWORK, ATTR_NODE, GC_BATCH};
use crate::errors::from_ipam;
use crate::netconf::NetConf;
use crate::protocol::{codes, CniError};

/// GC: releases every allocation of this network made on this node whose (container id,
/// interface) is not in the valid attachments. Other nodes' allocations are never touched.
///
/// # Errors
/// Code 7 without `cni.dev/valid-attachments`; store failures; code 108 after collecting the rest
/// when a block object cannot be decoded.
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
    // A block that does not decode hides no other's allocations: the rest are collected, then
    // the error names it (the spec: continue, remove as much as possible, report the errors).
    let (all, undecodable) = ipam
        .list_allocations_each()
        .await
        .map_err(|e| from_ipam(&e))?;
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
    if let Some(first) = undecodable.first() {
        return Err(CniError::new(
            codes::STORE_CORRUPT,
            format!(
                "GC released {} stale address(es) but could not examine {} block object(s) that \
                 cannot be decoded, first {:?} ({}); `blockipamctl check` names the way out",
                released.len(),
                undecodable.len(),
                first.key,
                first.message
            ),
        ));
    }
    Ok(released)
}
