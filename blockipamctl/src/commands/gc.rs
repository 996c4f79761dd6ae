//! `gc --dead-nodes [--grace-seconds N] [--apply]`: the nodes agents registered, whether each is
//! alive, active (plugin at work, agent down), missing, dead or reclaimed, and what each holds;
//! with `--apply`, start the countdowns of missing ones and release the blocks of the dead ones
//! (`ipam_core::dead_nodes`, as the agents' reclaimer). Addresses are never released here: a
//! silent node may be cut off with its pods running; `node release <node> --addresses` does it
//! once the operator knows they are gone.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use blockipam_store::countdowns::countdowns_for;
use blockipam_store::DatastoreSettings;
use ipam_core::dead_nodes::{
    preview_release, reclaim_pass, survey, MissingMark, NodeAction, NodeState, NodeStatus,
    ReclaimOptions, ReleasePreview,
};
use ipam_core::{HostRelease, UndecodableObject};
use serde::Serialize;

use super::{open_ipam, to_json, undecodable_text};
use crate::cli::GcArgs;
use crate::error::CtlError;
use crate::output::{counted, Ctx, Outcome, Table};
use crate::settings::OpenMode;

#[derive(Debug, Serialize)]
struct GcJson {
    /// The grace period of the countdowns this run starts (with `--apply`).
    grace_seconds: u64,
    applied: bool,
    nodes: Vec<NodeJson>,
    /// Block objects that cannot be decoded: the `addresses` of `would_release` leave out what
    /// they hold (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    undecodable: Vec<UndecodableObject>,
}

#[derive(Debug, Serialize)]
struct NodeJson {
    node: String,
    /// `alive`, `active`, `missing`, `dead` or `reclaimed`, as found before anything was done.
    state: &'static str,
    /// The reclaimer's mark: the countdown it started and the activity revision it saw.
    #[serde(skip_serializing_if = "Option::is_none")]
    missing_mark: Option<MissingMark>,
    /// Whether a grace countdown runs for it now.
    countdown_running: bool,
    /// Whether a reclaim released its blocks (its addresses are kept).
    blocks_released: bool,
    /// Revision of its plugin's last commit (its activity record), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    activity_revision: Option<u64>,
    registered_at: u64,
    agent_version: String,
    /// What it holds now (missing, dead and reclaimed nodes, without `--apply`): the blocks a
    /// reclaim releases, the addresses `node release <node> --addresses` would.
    #[serde(skip_serializing_if = "Option::is_none")]
    would_release: Option<ReleasePreview>,
    /// What `--apply` did.
    #[serde(skip_serializing_if = "Option::is_none")]
    action: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    released: Option<ReleasedJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

#[derive(Debug, Serialize)]
struct ReleasedJson {
    deleted_blocks: Vec<String>,
    unassigned_blocks: Vec<String>,
    released_addresses: Vec<IpAddr>,
}

impl From<&HostRelease> for ReleasedJson {
    fn from(release: &HostRelease) -> Self {
        ReleasedJson {
            deleted_blocks: release
                .deleted_blocks
                .iter()
                .map(|b| b.to_string())
                .collect(),
            unassigned_blocks: release
                .unassigned_blocks
                .iter()
                .map(|b| b.to_string())
                .collect(),
            released_addresses: release.released_addresses.clone(),
        }
    }
}

pub(crate) fn state_name(state: NodeState) -> &'static str {
    match state {
        NodeState::Alive => "alive",
        NodeState::Active => "active",
        NodeState::Missing { .. } => "missing",
        NodeState::Dead { .. } => "dead",
        NodeState::Reclaimed { .. } => "reclaimed",
        NodeState::Unreadable => "unreadable",
    }
}

/// The STATE cell: the state and, for a marked node, its countdown.
pub(crate) fn state_text(state: NodeState) -> String {
    match state {
        NodeState::Alive => "alive".into(),
        NodeState::Active => "active (agent down, plugin at work)".into(),
        NodeState::Missing { mark: None } => "missing (no countdown yet)".into(),
        NodeState::Missing { mark: Some(mark) } => {
            format!("missing (countdown of {}s runs)", mark.grace_seconds)
        }
        NodeState::Dead { mark } => {
            format!("dead (countdown of {}s ran out)", mark.grace_seconds)
        }
        NodeState::Reclaimed { .. } => "reclaimed (blocks released, addresses kept)".into(),
        NodeState::Unreadable => "unreadable registration".into(),
    }
}

fn action_name(action: &NodeAction) -> &'static str {
    match action {
        NodeAction::Alive => "none",
        NodeAction::ClearedMark => "cleared-mark",
        NodeAction::MarkedMissing => "marked-missing",
        NodeAction::MarkedAgain => "marked-again",
        NodeAction::StillMissing { .. } => "none",
        NodeAction::Reclaimed(_) => "reclaimed",
        NodeAction::AddressesKept => "none",
        NodeAction::Stopped { .. } => "stopped",
        NodeAction::Changed => "changed",
        NodeAction::Failed(_) => "failed",
    }
}

/// What an applied pass released from a node, when it released anything.
fn released_by(action: &NodeAction) -> Option<&HostRelease> {
    match action {
        NodeAction::Reclaimed(release)
        | NodeAction::Stopped {
            released: Some(release),
            ..
        } => Some(release),
        _ => None,
    }
}

/// The BLOCKS and ADDRESSES cells of a node an applied pass released from.
fn released_counts(release: &HostRelease) -> (String, String) {
    (
        (release.deleted_blocks.len() + release.unassigned_blocks.len()).to_string(),
        release.released_addresses.len().to_string(),
    )
}

/// What follows the action's name for `host` after an applied pass: why a release stopped, what
/// the operator does next for a reclaimed node, or what failed.
fn applied_detail(host: &str, action: &NodeAction) -> Option<String> {
    match action {
        NodeAction::Stopped { key, .. } => Some(format!(
            "stopped: {key} changed (the node came back); nothing more written"
        )),
        NodeAction::Reclaimed(_) | NodeAction::AddressesKept => Some(format!(
            "addresses kept: once its pods are gone, `node release {host} --addresses`"
        )),
        NodeAction::Failed(message) => Some(message.clone()),
        _ => None,
    }
}

fn node_json(status: &NodeStatus) -> NodeJson {
    NodeJson {
        node: status.host.clone(),
        state: state_name(status.state),
        missing_mark: status.registration.missing_mark,
        countdown_running: status.countdown.is_some()
            && !matches!(status.state, NodeState::Reclaimed { .. }),
        blocks_released: status.registration.blocks_released,
        activity_revision: status.activity.map(|r| r.0),
        registered_at: status.registration.registered_at,
        agent_version: status.registration.agent_version.clone(),
        would_release: None,
        action: None,
        released: None,
        detail: status.problem.clone(),
    }
}

/// `gc --dead-nodes`: without `--apply` writes nothing; with it, one reclaim pass.
///
/// # Errors
/// [`CtlError::Usage`] without what to collect; store trouble.
pub async fn run(
    ctx: &mut Ctx<'_>,
    settings: &DatastoreSettings,
    args: &GcArgs,
) -> Result<Outcome, CtlError> {
    if args.leaks {
        return super::leaks::run(ctx, settings, args).await;
    }
    if !args.dead_nodes {
        return Err(CtlError::usage(
            "gc needs what to collect: --dead-nodes or --leaks",
        ));
    }
    let grace = Duration::from_secs(args.grace_seconds);
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let store = Arc::clone(ipam.store());
    ctx.progress("reading the registered nodes ...");
    let nodes = survey(store.as_ref()).await?;
    let mut json_nodes: Vec<NodeJson> = nodes.iter().map(node_json).collect();
    let mut problems_found = false;
    let mut left_out = Vec::new();
    let mut table =
        Table::new(&["NODE", "STATE", "BLOCKS", "ADDRESSES", "ACTION"]).right_align(&[2, 3]);
    if args.apply {
        ctx.progress("marking missing nodes and releasing dead ones ...");
        let options = ReclaimOptions {
            grace,
            extra_guard: Vec::new(),
        };
        let countdowns = countdowns_for(settings).await?;
        let outcomes = reclaim_pass(Arc::clone(&store), countdowns.as_ref(), &options).await?;
        for (status, json) in nodes.iter().zip(json_nodes.iter_mut()) {
            let Some(outcome) = outcomes.iter().find(|o| o.host == status.host) else {
                continue;
            };
            json.action = Some(action_name(&outcome.action));
            let (blocks, addresses) = match released_by(&outcome.action) {
                Some(release) => {
                    json.released = Some(ReleasedJson::from(release));
                    released_counts(release)
                }
                None => ("-".to_owned(), "-".to_owned()),
            };
            problems_found |= matches!(outcome.action, NodeAction::Failed(_));
            json.detail = applied_detail(&status.host, &outcome.action);
            let mut action = action_name(&outcome.action).to_owned();
            if let Some(detail) = &json.detail {
                action = format!("{action}: {detail}");
            }
            table.row(vec![
                status.host.clone(),
                state_text(status.state),
                blocks,
                addresses,
                action,
            ]);
        }
    } else {
        let judged: Vec<&str> = nodes
            .iter()
            .filter(|n| !matches!(n.state, NodeState::Alive | NodeState::Active))
            .map(|n| n.host.as_str())
            .collect();
        ctx.progress("counting what a reclaim would release ...");
        let (previews, undecodable) = preview_release(Arc::clone(&store), &judged).await?;
        left_out = undecodable;
        for (status, json) in nodes.iter().zip(json_nodes.iter_mut()) {
            json.would_release = previews.get(&status.host).copied();
            let (blocks, addresses, action) = match (status.state, json.would_release) {
                (NodeState::Dead { .. }, Some(p)) => (
                    p.blocks.to_string(),
                    p.addresses.to_string(),
                    "would release its blocks (--apply); addresses kept",
                ),
                (NodeState::Unreadable, _) => {
                    problems_found = true;
                    (
                        "-".to_owned(),
                        "-".to_owned(),
                        "none: the registration does not decode (see the JSON detail)",
                    )
                }
                (NodeState::Reclaimed { .. }, Some(p)) => (
                    p.blocks.to_string(),
                    p.addresses.to_string(),
                    "addresses kept: once its pods are gone, `node release <node> --addresses`",
                ),
                (NodeState::Missing { mark: None }, Some(p)) => (
                    p.blocks.to_string(),
                    p.addresses.to_string(),
                    "would mark missing (--apply)",
                ),
                (NodeState::Active, _) => (
                    "-".to_owned(),
                    "-".to_owned(),
                    "would mark again from its plugin's activity (--apply)",
                ),
                (_, Some(p)) => (p.blocks.to_string(), p.addresses.to_string(), "wait"),
                _ => ("-".to_owned(), "-".to_owned(), "none"),
            };
            table.row(vec![
                status.host.clone(),
                state_text(status.state),
                blocks,
                addresses,
                action.to_owned(),
            ]);
        }
    }
    ctx.progress_done();
    let mut text = if nodes.is_empty() {
        let mut text = "No node is registered: dead-node reclaim judges only nodes whose agent registered them.\n".to_owned();
        if settings.etcd().is_none() {
            text.push_str("(Agents register their nodes and keep liveness keys on etcd only.)\n");
        }
        text
    } else {
        format!(
            "{} registered (grace period {}s){}:\n{}",
            counted(nodes.len() as u64, "node", "nodes"),
            args.grace_seconds,
            if args.apply { "" } else { ", nothing changed" },
            table.render()
        )
    };
    if !args.apply
        && nodes
            .iter()
            .any(|n| matches!(n.state, NodeState::Missing { .. } | NodeState::Dead { .. }))
    {
        text.push_str(
            "\nRun again with --apply to mark missing nodes and release dead ones' blocks.\n",
        );
    }
    text.push_str(&undecodable_text(&left_out, "the ADDRESSES counts"));
    let json = GcJson {
        grace_seconds: args.grace_seconds,
        applied: args.apply,
        nodes: json_nodes,
        undecodable: left_out,
    };
    Ok(Outcome {
        json: to_json(&json)?,
        table: text,
        problems_found,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release() -> HostRelease {
        HostRelease {
            deleted_blocks: vec!["10.0.0.0/26".parse().expect("a block")],
            unassigned_blocks: vec![
                "10.0.0.64/26".parse().expect("a block"),
                "10.0.0.128/26".parse().expect("a block"),
            ],
            released_addresses: Vec::new(),
        }
    }

    #[test]
    fn a_release_stopped_by_the_node_coming_back_names_the_key_and_counts_what_it_did() {
        let finished = NodeAction::Stopped {
            key: "ipam/v1/agents/node-a".into(),
            released: Some(release()),
        };
        assert_eq!(
            applied_detail("node-a", &finished).as_deref(),
            Some(
                "stopped: ipam/v1/agents/node-a changed (the node came back); nothing more written"
            )
        );
        assert_eq!(released_by(&finished), Some(&release()));
        assert_eq!(
            released_counts(&release()),
            ("3".to_owned(), "0".to_owned())
        );
        let cut_short = NodeAction::Stopped {
            key: "k".into(),
            released: None,
        };
        assert_eq!(released_by(&cut_short), None);
        assert!(applied_detail("node-a", &cut_short)
            .is_some_and(|detail| detail.starts_with("stopped: k changed")));
    }

    #[test]
    fn a_reclaimed_node_is_told_how_its_addresses_go_and_other_actions_say_nothing_more() {
        let next_step =
            Some("addresses kept: once its pods are gone, `node release node-a --addresses`");
        assert_eq!(
            applied_detail("node-a", &NodeAction::Reclaimed(release())).as_deref(),
            next_step
        );
        assert_eq!(
            applied_detail("node-a", &NodeAction::AddressesKept).as_deref(),
            next_step
        );
        assert_eq!(
            applied_detail("node-a", &NodeAction::Failed("no route".into())).as_deref(),
            Some("no route")
        );
        for quiet in [
            NodeAction::Alive,
            NodeAction::ClearedMark,
            NodeAction::MarkedMissing,
            NodeAction::MarkedAgain,
            NodeAction::StillMissing { grace_seconds: 900 },
            NodeAction::Changed,
        ] {
            assert_eq!(applied_detail("node-a", &quiet), None, "{quiet:?}");
            assert_eq!(released_by(&quiet), None, "{quiet:?}");
        }
        assert_eq!(
            released_by(&NodeAction::Reclaimed(release())),
            Some(&release())
        );
    }
}
