//! CHECK: the attachment still holds the addresses its previous result reported.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipam_core::{AllocationInfo, Ipam};

use super::{attachment_allocations, Attachment, ATTR_INTERFACE};
use crate::errors::from_ipam;
use crate::protocol::{codes, prev_result_addresses, CniError};

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
