//! `node release HOST [--addresses]`: retire a node that was removed from the cluster;
//! `node label HOST KEY=VALUE... [--remove KEY]...` and `node show HOST`: the node's labels.

use std::collections::BTreeMap;
use std::net::IpAddr;

use blockipam_store::DatastoreSettings;
use ipam_core::dead_nodes::{forget_node, validate_node};
use ipam_core::nodes::validate_label_update;
use serde::Serialize;

use super::pool::invalid_text;
use super::{open_ipam, to_json};
use crate::cli::{NodeLabelArgs, NodeReleaseArgs, NodeShowArgs};
use crate::error::CtlError;
use crate::output::{counted, Ctx, Outcome, Table};
use crate::settings::OpenMode;

#[derive(Debug, Serialize)]
struct NodeReleaseJson {
    host: String,
    deleted_blocks: Vec<String>,
    unassigned_blocks: Vec<String>,
    released_addresses: Vec<IpAddr>,
    /// With `--addresses`: the node's agent registration was deleted (its agent was not live),
    /// so dead-node reclaim no longer lists it.
    registration_deleted: bool,
}

fn joined<T: ToString>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `node release`: the host's empty blocks are deleted and its other blocks lose their affinity;
/// with `--addresses`, every address whose node attribute is the host is released first, and the
/// registration its agent left is deleted unless that agent is live (`dead_nodes::forget_node`).
///
/// # Errors
/// [`CtlError::Usage`] for an invalid host name or the reservations' pseudo-node `-`; store
/// trouble.
pub async fn release(
    ctx: &mut Ctx<'_>,
    settings: &DatastoreSettings,
    args: &NodeReleaseArgs,
) -> Result<Outcome, CtlError> {
    validate_node(&args.host).map_err(|e| CtlError::usage(invalid_text(&e)))?;
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
    let registration_deleted =
        args.addresses && forget_node(ipam.store().as_ref(), &args.host).await?;
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
                    "({}; each is deleted when its last address is released, or by `blocks \
                     release-empty` once its addresses have cooled)",
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
    if registration_deleted {
        text.push_str(&format!(
            "The registration of node {}'s agent was deleted: dead-node reclaim no longer lists it.\n",
            args.host
        ));
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
        registration_deleted,
    };
    Ok(Outcome::ok(to_json(&json)?, text))
}

/// A node's labels as JSON: `{host, labels: {key: value}}`.
#[derive(Debug, Serialize)]
struct NodeLabelsJson<'a> {
    host: &'a str,
    labels: &'a BTreeMap<String, String>,
    /// `node label` only, when it released any: the empty blocks of any node that its pools no
    /// longer select.
    #[serde(skip_serializing_if = "Option::is_none")]
    released_empty_blocks: Option<&'a [super::blocks::ReleasedEmptyBlock]>,
}

/// The labels as a KEY / VALUE table under a line that counts them (`after_change`: "now has"),
/// or a line saying there are none.
fn labels_text(host: &str, labels: &BTreeMap<String, String>, after_change: bool) -> String {
    let has = if after_change { "now has" } else { "has" };
    if labels.is_empty() {
        return format!("Node {host} {has} no labels.\n");
    }
    let mut table = Table::new(&["KEY", "VALUE"]);
    for (key, value) in labels {
        table.row(vec![key.clone(), value.clone()]);
    }
    format!(
        "Node {host} {has} {}:\n{}",
        counted(labels.len() as u64, "label", "labels"),
        table.render()
    )
}

/// Splits `KEY=VALUE` at the first `=`.
fn parse_label(argument: &str) -> Result<(String, String), CtlError> {
    argument
        .split_once('=')
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .ok_or_else(|| {
            CtlError::usage(format!(
                "label {argument:?} must be KEY=VALUE (an empty VALUE is allowed; use --remove KEY \
                 to remove a label)"
            ))
        })
}

/// `node label`: every change is checked before the store is opened (a malformed label is a
/// usage error), then applied in one compare-and-swap update; with `--replace`, the labels given
/// replace whatever the node had.
///
/// # Errors
/// [`CtlError::Usage`] for an invalid host name or `-`, a malformed label or a key named twice;
/// too many labels; store trouble.
pub async fn label(
    settings: &DatastoreSettings,
    args: &NodeLabelArgs,
) -> Result<Outcome, CtlError> {
    validate_node(&args.host).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let set = args
        .labels
        .iter()
        .map(|argument| parse_label(argument))
        .collect::<Result<Vec<_>, _>>()?;
    validate_label_update(&set, &args.remove).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let labels = if args.replace {
        ipam.replace_node_labels(&args.host, &set).await?
    } else {
        ipam.set_node_labels(&args.host, &set, &args.remove).await?
    };
    let release = super::blocks::release_unselected_empty_blocks(&ipam).await?;
    let json = NodeLabelsJson {
        host: &args.host,
        labels: &labels,
        released_empty_blocks: (!release.released.is_empty())
            .then_some(release.released.as_slice()),
    };
    let mut text = labels_text(&args.host, &labels, true);
    text.push_str(&release.text);
    Ok(Outcome::ok(to_json(&json)?, text))
}

/// `node show`.
///
/// # Errors
/// [`CtlError::Usage`] for an invalid host name or the reservations' pseudo-node `-`; store
/// trouble.
pub async fn show(settings: &DatastoreSettings, args: &NodeShowArgs) -> Result<Outcome, CtlError> {
    validate_node(&args.host).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let labels = ipam.node_labels(&args.host).await?;
    let json = NodeLabelsJson {
        host: &args.host,
        labels: &labels,
        released_empty_blocks: None,
    };
    Ok(Outcome::ok(
        to_json(&json)?,
        labels_text(&args.host, &labels, false),
    ))
}
