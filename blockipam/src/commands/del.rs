//! DEL: releases the attachment's addresses (idempotent).

use std::net::IpAddr;

use ipam_core::Ipam;

use super::{attachment_allocations, Attachment, ATTR_INTERFACE};
use crate::errors::from_ipam;
use crate::protocol::CniError;

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
