//! `node release HOST [--addresses]`: retire a node that was removed from the cluster.

use std::net::IpAddr;

use blockipam_store::DatastoreSettings;
use ipam_core::model::validate_host;
use serde::Serialize;

use super::pool::invalid_text;
use super::{open_ipam, to_json};
use crate::cli::NodeReleaseArgs;
use crate::error::CtlError;
use crate::output::{Ctx, Outcome};
use crate::settings::OpenMode;

#[derive(Debug, Serialize)]
struct NodeReleaseJson {
    host: String,
    deleted_blocks: Vec<String>,
    unassigned_blocks: Vec<String>,
    released_addresses: Vec<IpAddr>,
}

fn joined<T: ToString>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `node release`: the host's empty blocks are deleted and its other blocks lose their affinity;
/// with `--addresses`, every address whose node attribute is the host is released first.
///
/// # Errors
/// [`CtlError::Usage`] for an invalid host name; store trouble.
pub async fn release(
    ctx: &mut Ctx<'_>,
    settings: &DatastoreSettings,
    args: &NodeReleaseArgs,
) -> Result<Outcome, CtlError> {
    validate_host(&args.host).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    ctx.progress(&format!(
        "releasing node {}{} ...",
        args.host,
        if args.addresses {
            " and its addresses"
        } else {
            ""
        }
    ));
    let outcome = ipam.release_host(&args.host, args.addresses).await?;
    ctx.progress_done();
    let mut text = String::new();
    if outcome.deleted_blocks.is_empty()
        && outcome.unassigned_blocks.is_empty()
        && outcome.released_addresses.is_empty()
    {
        text.push_str(&format!(
            "Node {} held no blocks{}: nothing changed.\n",
            args.host,
            if args.addresses {
                " and no addresses"
            } else {
                ""
            }
        ));
    } else {
        text.push_str(&format!("Node {} released:\n", args.host));
        if args.addresses {
            text.push_str(&format!(
                "  addresses released:           {} {}\n",
                outcome.released_addresses.len(),
                if outcome.released_addresses.is_empty() {
                    String::new()
                } else {
                    format!("({})", joined(&outcome.released_addresses))
                }
            ));
        }
        text.push_str(&format!(
            "  empty blocks deleted:         {} {}\n",
            outcome.deleted_blocks.len(),
            if outcome.deleted_blocks.is_empty() {
                String::new()
            } else {
                format!("({})", joined(&outcome.deleted_blocks))
            }
        ));
        text.push_str(&format!(
            "  blocks left without a host:   {} {}\n",
            outcome.unassigned_blocks.len(),
            if outcome.unassigned_blocks.is_empty() {
                String::new()
            } else {
                format!(
                    "({}; each is deleted when its last address is released)",
                    joined(&outcome.unassigned_blocks)
                )
            }
        ));
        text = text
            .lines()
            .map(str::trim_end)
            .collect::<Vec<_>>()
            .join("\n");
        text.push('\n');
    }
    let json = NodeReleaseJson {
        host: args.host.clone(),
        deleted_blocks: outcome
            .deleted_blocks
            .iter()
            .map(ToString::to_string)
            .collect(),
        unassigned_blocks: outcome
            .unassigned_blocks
            .iter()
            .map(ToString::to_string)
            .collect(),
        released_addresses: outcome.released_addresses,
    };
    Ok(Outcome::ok(to_json(&json)?, text))
}
