//! `namespace pools NAMESPACE [--ipv4 POOL]... [--ipv6 POOL]... [--clear]`: the pools a
//! namespace's pods get (Calico's namespace annotations), kept in the store.

use blockipam_store::DatastoreSettings;
use ipam_core::namespaces::{validate_namespace, NamespacePools};
use serde::Serialize;

use super::pool::invalid_text;
use super::{family_name, open_ipam, to_json};
use crate::cli::NamespacePoolsArgs;
use crate::error::CtlError;
use crate::output::Outcome;
use crate::settings::OpenMode;

/// What `namespace pools` prints as JSON.
#[derive(Debug, Serialize)]
struct NamespaceJson {
    namespace: String,
    ipv4_pools: Vec<String>,
    ipv6_pools: Vec<String>,
    /// The named pools the namespace's pods cannot get addresses from.
    unusable_pools: Vec<UnusableJson>,
}

/// A named pool the namespace's pods cannot use, and why.
#[derive(Debug, Serialize)]
struct UnusableJson {
    family: &'static str,
    pool: String,
    reason: String,
}

fn listed(pools: &[String]) -> String {
    if pools.is_empty() {
        "the netconf's".to_owned()
    } else {
        pools.join(", ")
    }
}

/// `namespace pools`: shows the setting, or sets it (every pool must exist and be of its family),
/// or removes it.
///
/// # Errors
/// Usage errors for an invalid namespace; an unknown or wrong-family pool; store trouble.
pub async fn pools(
    settings: &DatastoreSettings,
    args: &NamespacePoolsArgs,
) -> Result<Outcome, CtlError> {
    validate_namespace(&args.namespace).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let changing = args.clear || !args.ipv4.is_empty() || !args.ipv6.is_empty();
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    if changing {
        let wanted = NamespacePools {
            ipv4_pools: args.ipv4.clone(),
            ipv6_pools: args.ipv6.clone(),
        };
        ipam.set_namespace_pools(&args.namespace, &wanted).await?;
    }
    let (now, unusable) = ipam
        .namespace_pools_status(&args.namespace)
        .await?
        .unwrap_or_default();
    let mut table = format!(
        "Namespace {}: IPv4 pools {}; IPv6 pools {}.\n",
        args.namespace,
        listed(&now.ipv4_pools),
        listed(&now.ipv6_pools)
    );
    if !unusable.is_empty() {
        table.push_str("Its pods' ADDs fail (error 105) while it names pools they cannot use:\n");
        for entry in &unusable {
            table.push_str(&format!(
                "  {} {}: {}\n",
                entry.family,
                entry.pool,
                invalid_text(&entry.reason)
            ));
        }
    }
    let json = NamespaceJson {
        namespace: args.namespace.clone(),
        ipv4_pools: now.ipv4_pools,
        ipv6_pools: now.ipv6_pools,
        unusable_pools: unusable
            .iter()
            .map(|entry| UnusableJson {
                family: family_name(entry.family),
                pool: entry.pool.clone(),
                reason: invalid_text(&entry.reason),
            })
            .collect(),
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}
