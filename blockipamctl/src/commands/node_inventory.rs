//! `node list`: every node the store knows, with its liveness, labels, blocks and addresses;
//! `node retire HOST [--apply] [--force]`: remove everything a removed node leaves behind.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use blockipam_store::DatastoreSettings;
use ipam_core::allocator::ATTR_NODE;
use ipam_core::dead_nodes::{
    activity_key, agent_key, forget_node, liveness_dir, liveness_key, preview_release, survey,
    validate_node, NodeState, NodeStatus, ReleasePreview,
};
use ipam_core::model::keys;
use ipam_core::{
    Condition, HostRelease, Ipam, IpamError, KvStore, Op, Revision, Txn, UndecodableObject,
};
use serde::Serialize;

use super::gc::{state_name, state_text};
use super::pool::invalid_text;
use super::{open_ipam, to_json, undecodable_text};
use crate::cli::NodeRetireArgs;
use crate::error::CtlError;
use crate::output::{counted, Ctx, Outcome, Table};
use crate::settings::OpenMode;

/// How a node's liveness is seen: the dead-node reclaim's judgement of a registered node; a node
/// no agent registered is not judged, but a liveness key of it still counts as alive.
#[derive(Debug, Clone)]
struct Liveness {
    /// `alive`, `active`, `missing`, `dead`, `reclaimed`, `unreadable` or `unregistered`.
    state: &'static str,
    /// The STATE cell.
    text: String,
    /// Whether the node is seen at work: alive or active as `gc` decides, or a liveness key
    /// without registration.
    live: bool,
}

impl Liveness {
    fn of(status: Option<&NodeStatus>, liveness_key: bool) -> Liveness {
        match status {
            Some(status) => Liveness {
                state: state_name(status.state),
                text: state_text(status.state),
                live: matches!(status.state, NodeState::Alive | NodeState::Active),
            },
            None if liveness_key => Liveness {
                state: "alive",
                text: "alive (liveness key, no registration)".into(),
                live: true,
            },
            None => Liveness {
                state: "unregistered",
                text: "unregistered (no agent: not judged)".into(),
                live: false,
            },
        }
    }
}

/// The LABELS cell (and `node retire`'s words) for a labels object that cannot be decoded.
const UNDECODABLE_LABELS: &str = "cannot be decoded (see `blockipamctl check`)";

/// The host a block key under `ipam/v1/blocks/host/<host>/...` names.
fn block_host(key: &str) -> Option<&str> {
    key.strip_prefix(&keys::affine_blocks_dir())?
        .split('/')
        .next()
}

/// The hosts under `dir` (`<dir><host>`).
fn hosts_under(dir: &str, keys: &[ipam_core::KeyValue]) -> BTreeSet<String> {
    keys.iter()
        .filter_map(|kv| kv.key.strip_prefix(dir).map(str::to_owned))
        .collect()
}

#[derive(Debug, Serialize)]
struct NodeListJson {
    nodes: Vec<NodeJson>,
    /// Block objects that cannot be decoded: `addresses` leaves out what they hold (absent when
    /// none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    undecodable: Vec<UndecodableObject>,
}

#[derive(Debug, Serialize)]
struct NodeJson {
    node: String,
    /// As `gc --dead-nodes` judges it, or `unregistered`.
    state: &'static str,
    /// Whether an agent registered it.
    registered: bool,
    /// Whether its liveness key exists.
    liveness_key: bool,
    labels: BTreeMap<String, String>,
    /// Why its labels object cannot be read (then `labels` is empty): `check` reports it.
    #[serde(skip_serializing_if = "Option::is_none")]
    labels_error: Option<String>,
    /// Blocks affine to it.
    blocks: u64,
    /// Addresses `node retire` (or `node release --addresses`) would release: every address of
    /// every handle holding an address recorded for the node.
    addresses: u64,
}

/// `node list`: the union of agent registrations, liveness keys, labelled nodes, block owners
/// and the `node` attributes of allocations (the network reservations' pseudo-node left out).
///
/// # Errors
/// Store trouble; corrupt objects.
pub async fn list(ctx: &mut Ctx<'_>, settings: &DatastoreSettings) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let store: Arc<dyn KvStore> = Arc::clone(ipam.store());
    ctx.progress("reading the nodes ...");
    let registered: BTreeMap<String, NodeStatus> = survey(store.as_ref())
        .await?
        .into_iter()
        .map(|status| (status.host.clone(), status))
        .collect();
    let live_keys = hosts_under(&liveness_dir(), &store.list(&liveness_dir()).await?);
    // A labels object that does not decode is shown as such: it hides no other node.
    let labelled: BTreeMap<String, Result<BTreeMap<String, String>, String>> = ipam
        .list_nodes_labels_each()
        .await?
        .into_iter()
        .map(|(host, labels)| (host, labels.map_err(|e| e.to_string())))
        .collect();
    let block_owners: BTreeSet<String> = store
        .list(&keys::affine_blocks_dir())
        .await?
        .iter()
        .filter_map(|kv| block_host(&kv.key).map(str::to_owned))
        .collect();
    // A block that does not decode hides no other's addresses: it is named below.
    let address_nodes: BTreeSet<String> = ipam
        .list_allocations_each()
        .await?
        .0
        .into_iter()
        .filter_map(|a| a.attributes.get(ATTR_NODE).cloned())
        .collect();
    let hosts: BTreeSet<String> = registered
        .keys()
        .cloned()
        .chain(live_keys.iter().cloned())
        .chain(labelled.keys().cloned())
        .chain(block_owners)
        .chain(address_nodes)
        .filter(|host| validate_node(host).is_ok())
        .collect();
    let host_refs: Vec<&str> = hosts.iter().map(String::as_str).collect();
    let (held, undecodable) = preview_release(Arc::clone(&store), &host_refs).await?;
    ctx.progress_done();
    let mut table =
        Table::new(&["NODE", "STATE", "BLOCKS", "ADDRESSES", "LABELS"]).right_align(&[2, 3]);
    let mut nodes = Vec::new();
    for host in &hosts {
        let liveness = Liveness::of(registered.get(host), live_keys.contains(host));
        let (labels, labels_error) = match labelled.get(host) {
            None => (BTreeMap::new(), None),
            Some(Ok(labels)) => (labels.clone(), None),
            Some(Err(e)) => (BTreeMap::new(), Some(e.clone())),
        };
        let ReleasePreview { blocks, addresses } = held.get(host).copied().unwrap_or_default();
        table.row(vec![
            host.clone(),
            liveness.text.clone(),
            blocks.to_string(),
            addresses.to_string(),
            if labels_error.is_some() {
                UNDECODABLE_LABELS.into()
            } else if labels.is_empty() {
                "-".into()
            } else {
                labels
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            },
        ]);
        nodes.push(NodeJson {
            node: host.clone(),
            state: liveness.state,
            registered: registered.contains_key(host),
            liveness_key: live_keys.contains(host),
            labels,
            labels_error,
            blocks,
            addresses,
        });
    }
    let mut text = if nodes.is_empty() {
        "The store knows no node (no registration, labels, block or address names one).\n".into()
    } else {
        format!(
            "{}:\n{}",
            counted(nodes.len() as u64, "node", "nodes"),
            table.render()
        )
    };
    text.push_str(&undecodable_text(&undecodable, "the ADDRESSES counts"));
    Ok(Outcome::ok(
        to_json(&NodeListJson { nodes, undecodable })?,
        text,
    ))
}

#[derive(Debug, Serialize)]
struct RetireJson {
    node: String,
    state: &'static str,
    applied: bool,
    /// What it holds (before `--apply`).
    labels: BTreeMap<String, String>,
    /// Why its labels object cannot be read (then `labels` is empty; `--apply` deletes it).
    #[serde(skip_serializing_if = "Option::is_none")]
    labels_error: Option<String>,
    registered: bool,
    blocks: u64,
    addresses: u64,
    /// With `--apply`: what was done.
    #[serde(skip_serializing_if = "Option::is_none")]
    retired: Option<RetiredJson>,
    /// Block objects that cannot be decoded: `addresses` leaves out what they hold, and
    /// `--apply` is refused while they are there (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    undecodable: Vec<UndecodableObject>,
}

#[derive(Debug, Serialize)]
struct RetiredJson {
    released_addresses: Vec<IpAddr>,
    deleted_blocks: Vec<String>,
    unassigned_blocks: Vec<String>,
    labels_removed: bool,
    registration_deleted: bool,
    activity_record_deleted: bool,
}

/// "The node is still as the decision saw it": its registration at the surveyed revision (or still
/// none), no liveness key, its activity record at the revision read (or still none). Its agent
/// starting again (it puts its liveness key, then registers) or its plugin recording work (a
/// marked node's every commit moves the record) breaks it.
fn idle_node_guard(
    host: &str,
    status: Option<&NodeStatus>,
    activity: Option<Revision>,
) -> Vec<Condition> {
    vec![
        match status {
            Some(status) => Condition::at_revision(agent_key(host), status.revision),
            None => Condition::absent(agent_key(host)),
        },
        Condition::absent(liveness_key(host)),
        match activity {
            Some(revision) => Condition::at_revision(activity_key(host), revision),
            None => Condition::absent(activity_key(host)),
        },
    ]
}

/// Releases `host`'s addresses and blocks (as `node release --addresses`) with `guard` on every
/// transaction: once it stops holding, nothing more is released and the retire fails, naming the
/// key that changed.
///
/// # Errors
/// [`CtlError::Failed`] when the guard stopped holding; store trouble.
async fn release_while_idle(
    ipam: &Ipam,
    host: &str,
    guard: Vec<Condition>,
) -> Result<HostRelease, CtlError> {
    match ipam
        .clone()
        .guarded_by(guard)
        .release_host(host, true)
        .await
    {
        Ok(released) => Ok(released),
        Err(IpamError::GuardLost { key }) => Err(CtlError::failed(format!(
            "node {host} is not retired: it was seen at work while being retired ({key} \
             changed); the release stopped at that write, and its labels, registration and \
             activity record are kept. Addresses released before it stay released. Check \
             `blockipamctl node list`, stop the node's agent and runtime, and run it again"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// `node retire`: previews, or with `--apply` releases the node's addresses and blocks (as
/// `node release --addresses`), removes its labels, and deletes its agent registration and its
/// plugin's activity record. Refused while the node is seen at work (alive or active as `gc`
/// decides, or a liveness key), unless `--force`.
///
/// # Errors
/// [`CtlError::Usage`] for an invalid host name or the reservations' pseudo-node;
/// [`CtlError::Failed`] for a live node without `--force`; store trouble.
pub async fn retire(
    ctx: &mut Ctx<'_>,
    settings: &DatastoreSettings,
    args: &NodeRetireArgs,
) -> Result<Outcome, CtlError> {
    let host = args.host.as_str();
    validate_node(host).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let store: Arc<dyn KvStore> = Arc::clone(ipam.store());
    ctx.progress(&format!("reading node {host} ..."));
    let status = survey(store.as_ref())
        .await?
        .into_iter()
        .find(|s| s.host == host);
    let liveness_key_present = store.get(&liveness_key(host)).await?.is_some();
    let liveness = Liveness::of(status.as_ref(), liveness_key_present);
    // The activity record as the decision saw it (the survey's, or read now for a node no agent
    // registered): what the release is guarded by, with the registration and the liveness key.
    let activity = match &status {
        Some(status) => status.activity,
        None => store.get(&activity_key(host)).await?.map(|kv| kv.revision),
    };
    if liveness.live && !args.force {
        ctx.progress_done();
        return Err(CtlError::failed(format!(
            "node {host} is {}: retiring it would release addresses its pods may use; nothing \
             changed. Stop its agent and wait until `blockipamctl gc --dead-nodes` no longer sees \
             it alive, or pass --force",
            liveness.text
        )));
    }
    // A labels object that does not decode is the node's too: retiring deletes it.
    let (labels, labels_error) = match ipam.node_labels(host).await {
        Ok(labels) => (labels, None),
        Err(e @ ipam_core::IpamError::Corrupt { .. }) => (BTreeMap::new(), Some(e.to_string())),
        Err(e) => return Err(e.into()),
    };
    let (previews, undecodable) = preview_release(Arc::clone(&store), &[host]).await?;
    let held = previews.get(host).copied().unwrap_or_default();
    let mut json = RetireJson {
        node: host.to_owned(),
        state: liveness.state,
        applied: args.apply,
        labels: labels.clone(),
        labels_error: labels_error.clone(),
        registered: status.is_some(),
        blocks: held.blocks,
        addresses: held.addresses,
        retired: None,
        undecodable: undecodable.clone(),
    };
    let mut text = format!(
        "Node {host}, {}, holds {}, {}, {} and {}.\n",
        liveness.text,
        counted(held.addresses, "address", "addresses"),
        counted(held.blocks, "block", "blocks"),
        if labels_error.is_some() {
            format!("a labels object that {UNDECODABLE_LABELS}")
        } else {
            counted(labels.len() as u64, "label", "labels")
        },
        if status.is_some() {
            "an agent registration"
        } else {
            "no agent registration"
        }
    );
    if liveness.live {
        text.push_str("It is seen at work: retiring it anyway (--force).\n");
    }
    text.push_str(&undecodable_text(&undecodable, "the address count"));
    if !undecodable.is_empty() {
        // Its addresses are found by the node attribute in every block: one that cannot be read
        // may hold some, which a retire now would leave allocated with no way to tell.
        text.push_str(
            "--apply is refused until every block can be decoded (and every owner key read): one \
             that cannot may hold addresses of this node's pods.\n",
        );
    }
    if !args.apply {
        ctx.progress_done();
        text.push_str(if undecodable.is_empty() {
            "Nothing was changed: run again with --apply to remove all of it.\n"
        } else {
            "Nothing was changed.\n"
        });
        return Ok(Outcome::ok(to_json(&json)?, text));
    }
    if let Some(first) = undecodable.first() {
        ctx.progress_done();
        return Err(CtlError::failed(format!(
            "node {host} is not retired: the object at {:?} cannot be read ({}) and may \
             hold addresses of its pods; nothing changed. `blockipamctl check` names the way out",
            first.key, first.message
        )));
    }
    ctx.progress(&format!("retiring node {host} ..."));
    // A node seen at work and retired with --force is released as it is; any other is released
    // only while it stays as the decision saw it.
    let guard = if liveness.live {
        Vec::new()
    } else {
        idle_node_guard(host, status.as_ref(), activity)
    };
    let released = release_while_idle(&ipam, host, guard).await?;
    let labels_removed = ipam.remove_node_labels(host).await?;
    let registration_deleted = forget_node(store.as_ref(), host).await?;
    let activity_record_deleted = if registration_deleted || status.is_none() {
        match store.get(&activity_key(host)).await? {
            // With the node generation its writes put (gone with the registration, if any).
            Some(kv) => match store
                .commit(
                    Txn::new()
                        .when(Condition::at_revision(&kv.key, kv.revision))
                        .then(Op::delete(&kv.key))
                        .then(Op::delete(keys::node_generation(host))),
                )
                .await
            {
                Ok(_) => true,
                Err(ipam_core::KvError::Conflict { .. }) => false,
                Err(e) => return Err(e.into()),
            },
            None => false,
        }
    } else {
        false
    };
    ctx.progress_done();
    text = format!("Node {host} retired:\n");
    text.push_str(&format!(
        "  addresses released:          {}\n",
        released.released_addresses.len()
    ));
    text.push_str(&format!(
        "  empty blocks deleted:        {}\n",
        released.deleted_blocks.len()
    ));
    text.push_str(&format!(
        "  blocks left without a host:  {}{}\n",
        released.unassigned_blocks.len(),
        if released.unassigned_blocks.is_empty() {
            ""
        } else {
            " (they hold other nodes' addresses, or released addresses still cooling down; each is \
             deleted when its last address goes, or by `blocks release-empty` once cooled)"
        }
    ));
    text.push_str(&format!(
        "  labels removed:              {}\n",
        match (labels_removed, &labels_error) {
            (false, _) => "0".to_owned(),
            (true, None) => labels.len().to_string(),
            (true, Some(_)) => "its labels object, which could not be decoded".to_owned(),
        }
    ));
    text.push_str(&format!(
        "  agent registration deleted:  {}\n",
        if registration_deleted {
            "yes"
        } else if status.is_some() {
            "no (its agent keeps its liveness key; it is deleted once the agent stops and the node is retired again)"
        } else {
            "no (it had none)"
        }
    ));
    json.retired = Some(RetiredJson {
        released_addresses: released.released_addresses,
        deleted_blocks: released
            .deleted_blocks
            .iter()
            .map(ToString::to_string)
            .collect(),
        unassigned_blocks: released
            .unassigned_blocks
            .iter()
            .map(ToString::to_string)
            .collect(),
        labels_removed,
        registration_deleted,
        activity_record_deleted,
    });
    Ok(Outcome::ok(to_json(&json)?, text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipam_core::dead_nodes::register;

    /// A store with a pool, `node-a` registered by its agent (which then stopped: no liveness
    /// key) and two of its pods' addresses.
    async fn a_stopped_node() -> (Arc<dyn KvStore>, Ipam) {
        let (store, ipam) = super::super::test_support::two_pods_on_node_a().await;
        register(store.as_ref(), "node-a", "test", 1)
            .await
            .expect("register");
        (store, ipam)
    }

    async fn allocated(ipam: &Ipam) -> usize {
        ipam.list_allocations().await.expect("list").len()
    }

    /// The guard built from what `node retire` decided on: the node as surveyed.
    async fn guard_as_decided(store: &dyn KvStore) -> Vec<Condition> {
        let status = survey(store)
            .await
            .expect("survey")
            .into_iter()
            .find(|s| s.host == "node-a")
            .expect("registered");
        idle_node_guard("node-a", Some(&status), status.activity)
    }

    /// Between `node retire`'s decision (the node idle) and its release, the node's agent starts
    /// again (its liveness key, then its registration) or its plugin records work: the release
    /// stops at its first write, and every address stays with its pod.
    #[tokio::test]
    async fn a_node_seen_at_work_after_the_decision_keeps_its_addresses() {
        for (change, changed_key) in [
            ("the agent puts its liveness key", liveness_key("node-a")),
            ("the agent registers again", agent_key("node-a")),
            ("the plugin records work", activity_key("node-a")),
        ] {
            let (store, ipam) = a_stopped_node().await;
            let guard = guard_as_decided(store.as_ref()).await;
            match changed_key.as_str() {
                key if key == agent_key("node-a") => {
                    register(store.as_ref(), "node-a", "test", 2)
                        .await
                        .expect("register again");
                }
                key => {
                    store
                        .put(key, b"{}".to_vec())
                        .await
                        .expect("the node's write");
                }
            }
            match release_while_idle(&ipam, "node-a", guard).await {
                Err(CtlError::Failed(message)) => assert!(
                    message.contains(&changed_key) && message.contains("is not retired"),
                    "{change}: {message}"
                ),
                other => panic!("{change}: the release answered {other:?}"),
            }
            assert_eq!(
                allocated(&ipam).await,
                2,
                "{change}: an address was released"
            );
        }
    }

    /// The node as decided: everything is released.
    #[tokio::test]
    async fn a_node_still_as_decided_is_released() {
        let (store, ipam) = a_stopped_node().await;
        let guard = guard_as_decided(store.as_ref()).await;
        let released = release_while_idle(&ipam, "node-a", guard)
            .await
            .expect("released");
        assert_eq!(released.released_addresses.len(), 2);
        assert_eq!(allocated(&ipam).await, 0);
        // A node no agent registered: guarded by "still no registration".
        let (store, ipam) = a_stopped_node().await;
        store
            .delete(&agent_key("node-a"))
            .await
            .expect("no registration");
        let guard = idle_node_guard("node-a", None, None);
        register(store.as_ref(), "node-a", "test", 2)
            .await
            .expect("an agent registers");
        assert!(release_while_idle(&ipam, "node-a", guard).await.is_err());
        assert_eq!(allocated(&ipam).await, 2);
    }
}
