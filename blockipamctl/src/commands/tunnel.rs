//! `tunnel-address assign|release NODE --type TYPE`: a node's tunnel address, held as Calico holds
//! it (handle `<type>-tunnel-addr-<node>`, attributes `node` and `type`), from pools allowing
//! tunnel use.

use std::collections::BTreeMap;
use std::net::IpAddr;

use blockipam_store::DatastoreSettings;
use ipam_core::allocator::ATTR_NODE;
use ipam_core::dead_nodes::validate_node;
use ipam_core::{AllowedUse, AutoAssignRequest};
use serde::Serialize;

use super::pool::invalid_text;
use super::{open_ipam, to_json};
use crate::cli::TunnelAddressArgs;
use crate::error::CtlError;
use crate::output::Outcome;
use crate::settings::OpenMode;

/// One kind of tunnel address, as Calico names it.
struct TunnelKind {
    /// The `--type` value.
    name: &'static str,
    /// The handle's prefix: the handle is `<prefix>-tunnel-addr-<node>`.
    handle_prefix: &'static str,
    /// The `type` attribute.
    attribute: &'static str,
    /// IPv6 or IPv4.
    ipv6: bool,
}

const KINDS: [TunnelKind; 5] = [
    TunnelKind {
        name: "ipip",
        handle_prefix: "ipip",
        attribute: "ipipTunnelAddress",
        ipv6: false,
    },
    TunnelKind {
        name: "vxlan",
        handle_prefix: "vxlan",
        attribute: "vxlanTunnelAddress",
        ipv6: false,
    },
    TunnelKind {
        name: "vxlan-v6",
        handle_prefix: "vxlan-v6",
        attribute: "vxlanV6TunnelAddress",
        ipv6: true,
    },
    TunnelKind {
        name: "wireguard",
        handle_prefix: "wireguard",
        attribute: "wireguardTunnelAddress",
        ipv6: false,
    },
    TunnelKind {
        name: "wireguard-v6",
        handle_prefix: "wireguard-v6",
        attribute: "wireguardV6TunnelAddress",
        ipv6: true,
    },
];

/// What `tunnel-address` prints as JSON.
#[derive(Debug, Serialize)]
struct TunnelJson {
    node: String,
    #[serde(rename = "type")]
    tunnel_type: &'static str,
    handle: String,
    /// The address (`assign`), or the addresses released (`release`).
    addresses: Vec<IpAddr>,
}

/// The kind and handle these arguments name, validated before the store is touched.
fn resolve(args: &TunnelAddressArgs) -> Result<(&'static TunnelKind, String), CtlError> {
    validate_node(&args.node).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let kind = KINDS
        .iter()
        .find(|k| k.name == args.tunnel_type.trim().to_ascii_lowercase())
        .ok_or_else(|| {
            CtlError::usage(format!(
                "--type {:?}: expected one of ipip, vxlan, vxlan-v6, wireguard, wireguard-v6",
                args.tunnel_type
            ))
        })?;
    Ok((
        kind,
        format!("{}-tunnel-addr-{}", kind.handle_prefix, args.node),
    ))
}

/// `tunnel-address assign`: one address of the kind's family for the node, from a pool that
/// allows tunnel use and selects the node, preferring the node's own blocks; the same address
/// again when the node already has one.
///
/// # Errors
/// Usage errors for a bad node or type; no pool allowing tunnel use for the node; store trouble.
pub async fn assign(
    settings: &DatastoreSettings,
    args: &TunnelAddressArgs,
) -> Result<Outcome, CtlError> {
    let (kind, handle) = resolve(args)?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let request = AutoAssignRequest {
        handle: handle.clone(),
        host: args.node.clone(),
        num_v4: u32::from(!kind.ipv6),
        num_v6: u32::from(kind.ipv6),
        attributes: BTreeMap::from([
            (ATTR_NODE.to_owned(), args.node.clone()),
            ("type".to_owned(), kind.attribute.to_owned()),
        ]),
        reuse_existing: true,
        purpose: AllowedUse::Tunnel,
        ..AutoAssignRequest::default()
    };
    let result = ipam.auto_assign(&request).await?;
    let addresses: Vec<IpAddr> = result.v4.iter().chain(&result.v6).map(|a| a.ip).collect();
    let verb = if result.reused { "has" } else { "was given" };
    let shown: Vec<String> = addresses.iter().map(ToString::to_string).collect();
    let table = format!(
        "Node {} {verb} its {} tunnel address {} (handle {handle}).\n",
        args.node,
        kind.name,
        shown.join(", ")
    );
    let json = TunnelJson {
        node: args.node.clone(),
        tunnel_type: kind.name,
        handle,
        addresses,
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// `tunnel-address release`: releases the node's tunnel address of the kind (its whole handle).
///
/// # Errors
/// Usage errors for a bad node or type; store trouble.
pub async fn release(
    settings: &DatastoreSettings,
    args: &TunnelAddressArgs,
) -> Result<Outcome, CtlError> {
    let (kind, handle) = resolve(args)?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let released = ipam.release_handle(&handle).await?;
    let table = if released.is_empty() {
        format!("Node {} has no {} tunnel address.\n", args.node, kind.name)
    } else {
        let shown: Vec<String> = released.iter().map(ToString::to_string).collect();
        format!(
            "Released node {}'s {} tunnel address {}.\n",
            args.node,
            kind.name,
            shown.join(", ")
        )
    };
    let json = TunnelJson {
        node: args.node.clone(),
        tunnel_type: kind.name,
        handle,
        addresses: released,
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}
